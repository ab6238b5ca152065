#!/usr/bin/env bash
# Run every test suite and sum their RESULT lines into one closing line "N passed, N failed, N skipped".
#   host suites  build/test_*   always
#   GPU suites   build/gpu_*    one per test/gpu/gpu_*.cu, run only where a GPU is visible; otherwise one
#                               "SKIPPED (no GPU): name" line each
#   shell suites test/cli/*.sh and test/fuzz/fuzz.sh that start with "# suite:" (CLI behaviour), run with
#                the built ./nanovllm
# Exit status: non-zero if any case failed or any suite crashed without a RESULT line.
set -u
BUILD=${1:-build}
passed=0 failed=0 skipped=0
have_gpu=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q GPU; then have_gpu=1; fi

run_suite() {  # run_suite NAME CMD...
  local name=$1; shift
  echo "== $name"
  local out rc
  out=$("$@" 2>&1); rc=$?
  echo "$out" | grep -v '^RESULT '
  local line
  line=$(echo "$out" | grep '^RESULT ' | tail -n1)
  if [ -z "$line" ]; then
    echo "FAIL $name: the suite exited with status $rc before printing its RESULT line"
    failed=$((failed + 1))
    return
  fi
  local p f s
  p=$(echo "$line" | sed -n 's/.*passed=\([0-9]*\).*/\1/p')
  f=$(echo "$line" | sed -n 's/.*failed=\([0-9]*\).*/\1/p')
  s=$(echo "$line" | sed -n 's/.*skipped=\([0-9]*\).*/\1/p')
  passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + s))
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    echo "FAIL $name: exit status $rc"
    failed=$((failed + 1))
  fi
}

for t in "$BUILD"/test_*; do
  [ -x "$t" ] || continue
  run_suite "$(basename "$t")" "$t"
done
for src in test/gpu/gpu_*.cu; do
  [ -e "$src" ] || continue
  name=$(basename "$src" .cu)
  if [ "$have_gpu" = 1 ] && [ -x "$BUILD/$name" ]; then
    run_suite "$name" "$BUILD/$name"
  else
    echo "SKIPPED (no GPU): $name"
    skipped=$((skipped + 1))
  fi
done
for t in test/cli/*.sh test/fuzz/fuzz.sh; do
  head -n 3 "$t" | grep -q '^# suite:' || continue
  run_suite "$(basename "$t")" bash "$t"
done
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
