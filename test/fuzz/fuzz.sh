#!/usr/bin/env bash
# suite: fuzz (each libFuzzer target of test/fuzz for FUZZ_SECONDS, 10 by default)
# Runs build/fuzz/fuzz_NAME for safetensors, config, tokenizer, tokenizer_json and prompts, from the seeds in
# test/fuzz/corpus/NAME with the dictionary test/fuzz/NAME.dict. A crash, a sanitizer report, a hang (10 s
# on one input) or a broken property fails the case and leaves the input in build/fuzz/crash-NAME-*:
# replay it with `build/fuzz/fuzz_NAME FILE`, fix the bug, then commit the file to test/fuzz/regressions/NAME/
# (the host suite test_fuzz_regressions replays that folder in every `make test`, with or without clang).
# `make fuzz` runs this with FUZZ_SECONDS=60 and FUZZ_KEEP_CORPUS=1 (the corpus grows in build/fuzz/corpus-NAME).
# Where clang cannot build the targets (no libclang-rt-dev), every case is SKIPPED and says why.
set -u
BUILD=${1:-build}
SECONDS_EACH=${FUZZ_SECONDS:-10}
passed=0 failed=0 skipped=0
finish() { echo "RESULT passed=$passed failed=$failed skipped=$skipped"; exit $((failed > 0)); }

if ! TOK=$(bash tools/fetch_tokenizer.sh | tail -n 1) || [ -z "$TOK" ]; then
  echo "FAIL fetch_tokenizer: tools/fetch_tokenizer.sh could not provide the Qwen3 tokenizer"
  failed=1
  finish
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for t in safetensors config tokenizer tokenizer_json prompts; do
  bin=$BUILD/fuzz/fuzz_$t
  if [ ! -x "$bin" ]; then
    echo "SKIPPED fuzz_$t: $bin not built (clang with libFuzzer: apt-get install clang libclang-rt-dev)"
    skipped=$((skipped + 1))
    continue
  fi
  corpus=$tmp/corpus-$t
  [ "${FUZZ_KEEP_CORPUS:-0}" = 1 ] && corpus=$BUILD/fuzz/corpus-$t
  mkdir -p "$corpus"
  NANOVLLM_TOKENIZER_DIR=$TOK "$bin" -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=4096 \
    -dict="test/fuzz/$t.dict" -artifact_prefix="$BUILD/fuzz/crash-$t-" -print_final_stats=1 \
    "$corpus" "test/fuzz/corpus/$t" >"$tmp/log" 2>&1
  rc=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$tmp/log")
  if [ "$rc" -eq 0 ] && [ -n "$runs" ]; then
    echo "PASS fuzz_$t: $runs inputs in ${SECONDS_EACH} s, no crash, corpus $(ls "$corpus" | wc -l) files"
    passed=$((passed + 1))
  else
    echo "FAIL fuzz_$t: exit status $rc; the input is in $BUILD/fuzz/crash-$t-*; the report:"
    grep -E 'ERROR|SUMMARY|runtime error|property broken|#[0-9]+ in ' "$tmp/log" | head -n 20 | sed 's/^/    /'
    failed=$((failed + 1))
  fi
done
finish
