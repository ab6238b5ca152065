#!/usr/bin/env bash
# Run every test suite and sum their RESULT lines into one closing line "N passed, N failed, N skipped".
# Measurements (TIMING cases, test/test.h: "MEASURED name", measured=N) are no tests: they count on a line of
# their own, "N measurements (figures, not tests)", printed just before the closing line when there are any.
#   host suites  build/test_*   always; or, with HOST_SUITES=build/host_suites (make test), each suite of that
#                               one program (test/host_suites.sh), each in its own process
#   GPU suites   build/gpu_*    one per test/gpu/gpu_*.cu, run only where a GPU is visible; otherwise one
#                               "SKIPPED (no GPU): name" line each
#   shell suites test/cli/*.sh and test/fuzz/fuzz.sh that start with "# suite:" (CLI behaviour), run with
#                the built ./nanovllm (NANOVLLM_BIN overrides it; `make test` without a GPU: build/nanovllm)
# Host and shell suites run TEST_JOBS at a time (default: one per core), each with its output held until it
# ends; GPU suites run one at a time with nothing beside them (their timing cases print figures). The report
# keeps the order above, each suite under "== name" and over "-- name: N s" (its wall time).
# Exit status: non-zero if any case failed or any suite crashed without a RESULT line.
set -u
BUILD=${1:-build}
JOBS=${TEST_JOBS:-$(nproc 2>/dev/null || echo 1)}
passed=0 failed=0 skipped=0 measured=0
have_gpu=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q GPU; then have_gpu=1; fi
held=$(mktemp -d)
trap 'rm -rf "$held"' EXIT
# Several suites fetch the tokenizer into build/ on first use: fetch it once before they run side by side. A
# failure here is theirs to report.
bash tools/fetch_tokenizer.sh >/dev/null 2>&1

# The suites in report order: names[N], how to run it, kinds[N] (binary, script, suite: `paths[N] NAME`, or
# skip: a SKIPPED line), and paths[N].
names=() kinds=() paths=()
add() { names+=("$1"); kinds+=("$2"); paths+=("$3"); }
if [ -n "${HOST_SUITES:-}" ]; then
  if list=$("$HOST_SUITES" --suites) && [ -n "$list" ]; then
    for name in $list; do add "$name" suite "$HOST_SUITES"; done
  else
    add "$(basename "$HOST_SUITES")" binary "$HOST_SUITES"  # reported as a suite without a RESULT line
  fi
else
  for t in "$BUILD"/test_*; do
    [ -x "$t" ] && add "$(basename "$t")" binary "$t"
  done
fi
gpu_first=${#names[@]}
for src in test/gpu/gpu_*.cu; do
  [ -e "$src" ] || continue
  name=$(basename "$src" .cu)
  if [ "$have_gpu" = 1 ] && [ -x "$BUILD/$name" ]; then add "$name" binary "$BUILD/$name"
  else add "$name" skip ""; fi
done
gpu_end=${#names[@]}
for t in test/cli/*.sh test/fuzz/fuzz.sh; do
  head -n 3 "$t" | grep -q '^# suite:' && add "$(basename "$t")" script "$t"
done

# Suite N's output is $held/N.out; $held/N.rc (its exit status, written last) says it has ended.
report() {  # report N: print suite N's output and add its RESULT line to the sums
  local i=$1 name=${names[$1]}
  if [ "${kinds[$i]}" = skip ]; then echo "SKIPPED (no GPU): $name"; skipped=$((skipped + 1)); return; fi
  local rc out took line p f s m
  rc=$(cat "$held/$i.rc"); out=$(cat "$held/$i.out"); took=$(cat "$held/$i.took")
  echo "== $name"
  echo "$out" | grep -v '^RESULT '
  echo "-- $name: $took s"
  line=$(echo "$out" | grep '^RESULT ' | tail -n1)
  if [ -z "$line" ]; then
    echo "FAIL $name: the suite exited with status $rc before printing its RESULT line"
    failed=$((failed + 1))
    return
  fi
  p=$(echo "$line" | sed -n 's/.*passed=\([0-9]*\).*/\1/p')
  f=$(echo "$line" | sed -n 's/.*failed=\([0-9]*\).*/\1/p')
  s=$(echo "$line" | sed -n 's/.*skipped=\([0-9]*\).*/\1/p')
  m=$(echo "$line" | sed -n 's/.*measured=\([0-9]*\).*/\1/p')
  passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + s)); measured=$((measured + ${m:-0}))
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    echo "FAIL $name: exit status $rc"
    failed=$((failed + 1))
  fi
}
shown=0
show_ended() {  # report, in order, each suite that has ended (or is a SKIPPED line) after those shown
  while [ "$shown" -lt "${#names[@]}" ] && { [ "${kinds[$shown]}" = skip ] || [ -e "$held/$shown.rc" ]; }; do
    report "$shown"
    shown=$((shown + 1))
  done
}
start() {  # start N: run suite N in the background once fewer than JOBS suites are running
  [ "${kinds[$1]}" != skip ] || return 0
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; show_ended; done
  local i=$1
  {
    t0=$EPOCHREALTIME
    case ${kinds[$i]} in
      script) bash "${paths[$i]}" ;;
      suite) "${paths[$i]}" "${names[$i]}" ;;
      *) "${paths[$i]}" ;;
    esac >"$held/$i.out" 2>&1
    echo $? >"$held/$i.rc.part"
    awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f\n", b - a }' >"$held/$i.took"
    mv "$held/$i.rc.part" "$held/$i.rc"
  } &
}
wait_all() { wait; show_ended; }

# Host suites; GPU suites one at a time, alone; shell suites, the two longest first (part2_cut.sh compiles
# five programs, fuzz.sh runs for its 40 s however busy the machine is).
for ((i = 0; i < gpu_first; i++)); do start "$i"; done
if [ "$have_gpu" = 1 ]; then
  wait_all
  for ((i = gpu_first; i < gpu_end; i++)); do start "$i"; wait_all; done
fi
for ((i = gpu_end; i < ${#names[@]}; i++)); do
  case ${names[$i]} in part2_cut.sh | fuzz.sh) start "$i" ;; esac
done
for ((i = gpu_end; i < ${#names[@]}; i++)); do
  case ${names[$i]} in part2_cut.sh | fuzz.sh) ;; *) start "$i" ;; esac
done
wait_all
[ "$measured" -eq 0 ] || echo "$measured measurements (figures, not tests)"
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
