#!/usr/bin/env bash
# compute-sanitizer over the GPU suites, one case at a time, on a GPU machine:
#   memcheck and initcheck  every case of gpu_kernels, gpu_requests, gpu_attention and gpu_gemm but the
#                           measurements (TIMING cases: left out of --list-tests)
#   racecheck               the same, except the sampler's statistical cases (millions of draws: hours under
#                           racecheck); sample_every_path_once takes every sampler path instead
#   memcheck on ./nanovllm  a short generation with CUDA graphs and one eager (when MODEL_DIR is given);
#                           their completions must equal the run without the sanitizer
#   gpu_persistent          only when SUITES names it; its 0.6B and 8B cases are long under the tools, so
#                           CASES=odd_shape is the usual choice (section 24's kernel at every batch size)
#   gpu_tp                  only when SUITES names it (2+ GPUs). compute-sanitizer does not follow a fork()
#                           without exec, so it watches rank 0 only; rank 1 runs the same kernels on the
#                           other GPU, and its exit status still counts. API errors are not reported there:
#                           NCCL's set-up probes for kernel images and meets several missing ones by design
#                           (every CUDA call of ours goes through CUDA_CHECK anyway)
# Prints one line per run (clean / errors / timeout) and a RESULT line like the other suites.
#
#   bash test/gpu/gpu_sanitize.sh [BIN_DIR] [MODEL_DIR]      env: CASE_TIMEOUT (seconds per run, default 600),
#                                                         SUITES (default: gpu_gemm gpu_kernels gpu_requests gpu_attention;
#                                                         gpu_tp may be added),
#                                                         CASES (an extended regex: only the cases it matches),
#                                                         TOOLS (default: memcheck initcheck racecheck)
set -u
BIN=${1:-build} MODEL=${2:-}
NV=$BIN/nanovllm; [ -x "$NV" ] || NV=./nanovllm
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
TO=${CASE_TIMEOUT:-600}
T=$(mktemp -d)
passed=0 failed=0 skipped=0
sanitize() {  # sanitize TOOL NAME CMD...: clean = exit 0 and "ERROR SUMMARY: 0 errors" (racecheck: hazards)
  local tool=$1 name=$2; shift 2
  local log="$T/$tool-$name.txt" t0=$(date +%s)
  timeout "$TO" "$CS" --tool "$tool" --error-exitcode 9 ${CS_FLAGS:-} "$@" >"$log" 2>&1
  local rc=$? dt=$(($(date +%s) - t0))
  local summary; summary=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -n 1)
  if [ $rc = 124 ]; then
    echo "TIMEOUT $tool $name after ${dt}s"; skipped=$((skipped + 1))
  elif grep -q 'terminated before first instrumented API call' "$log"; then
    echo "SKIPPED $tool $name: a host-only case (no CUDA call to watch)"; skipped=$((skipped + 1))
  elif grep -q '^SKIPPED ' "$log"; then
    echo "SKIPPED $tool $name: the case skipped ($(grep -m1 '^SKIPPED ' "$log"))"; skipped=$((skipped + 1))
  elif [ $rc = 0 ] && grep -q -E 'SUMMARY: 0 (errors|hazards)' "$log"; then
    echo "PASS $tool $name (${dt}s): $summary"; passed=$((passed + 1))
  else
    echo "FAIL $tool $name (rc=$rc, ${dt}s): $summary"; failed=$((failed + 1))
    grep -E '^=+ +(Invalid|Uninitialized|Race|Error|ERROR)|^(FAIL|    CHECK)' "$log" | head -n 8
  fi
}
for suite in ${SUITES:-gpu_gemm gpu_kernels gpu_requests gpu_attention}; do
  CS_FLAGS=; [ "$suite" = gpu_tp ] && CS_FLAGS="--report-api-errors no"
  # --list-tests prints the names of the cases that are tests, one per line (a suite may print a GPU line first)
  for c in $("$BIN/$suite" --list-tests | grep -E '^[a-z][a-z0-9_]*$' |
    grep -E "${CASES:-.}"); do
    for tool in ${TOOLS:-memcheck initcheck racecheck}; do
      case "$tool:$c" in
        # Tests of a time (a bandwidth floor, a budget, the faster path): the tools slow every kernel.
        *:elementwise_kernels_above_100_GBps | *:sample_fast_within_budget_at_b256 | \
          *:routing_by_context_picks_the_faster_path) continue ;;
        racecheck:sample_reproduces_cpu_draws_exactly | racecheck:sample_is_deterministic_and_independent_of_batch | \
          racecheck:sample_distribution_matches_softmax | racecheck:sample_large_vocab_kept_sets) continue ;;
      esac
      sanitize "$tool" "$c" "$BIN/$suite" "=$c"
    done
  done
done
if [ -n "$MODEL" ]; then
  printf 'introduce yourself\nlist all prime numbers within 100\n' >"$T/prompts.txt"
  flags=(--max-tokens 16 --temperature 0 --max-model-len 1024 --max-num-seqs 8)
  "$NV" "$MODEL" "$T/prompts.txt" "${flags[@]}" --output "$T/plain.jsonl" >/dev/null 2>&1
  for mode in graphs eager; do
    extra=(); [ $mode = eager ] && extra=(--enforce-eager)
    sanitize memcheck "nanovllm_$mode" "$NV" "$MODEL" "$T/prompts.txt" "${flags[@]}" "${extra[@]}" \
      --output "$T/$mode.jsonl"
    if [ -s "$T/plain.jsonl" ] && diff <(grep -v summary "$T/plain.jsonl") <(grep -v summary "$T/$mode.jsonl") \
      >/dev/null; then
      echo "PASS nanovllm_${mode}_same_completions"; passed=$((passed + 1))
    else
      echo "FAIL nanovllm_${mode}_same_completions: the output under memcheck differs from the plain run"
      failed=$((failed + 1))
    fi
  done
fi
rm -rf "$T"
echo "RESULT passed=$passed failed=$failed skipped=$skipped"
[ "$failed" = 0 ]
