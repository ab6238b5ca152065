#!/usr/bin/env bash
# Ctrl-C and SIGTERM during a run (needs a GPU; test/gpu/gpu_check.sh runs it, with TP GPUs when
# NANOVLLM_E2E_TP > 1). The run gets its own process group (setsid, like a shell job) and signals go to the
# whole group, as a terminal sends them. Cases:
#   one Ctrl-C     the step in flight completes, the requests that had finished are written (stdout and
#                  --output, whose summary counts the unfinished ones), exit status 130
#   two Ctrl-C     stops at once: exit status 130, no --output file. A step takes a millisecond or less here,
#                  so the run holds its graceful stop for 10 s (NANOVLLM_TEST_SLOW_STOP, test-only) to give
#                  the second Ctrl-C the window a long step would; it must end the run within 2 s.
#   SIGTERM        (to the main process only, as `kill PID` sends it) stops at once: exit status 143
# After each: no process of the run is left, and no GPU memory is held by one.
#
#   bash test/gpu/gpu_interrupt.sh MODEL_DIR [NANOVLLM] [TP]
set -u
MODEL=$1 NV=${2:-./nanovllm} TP=${3:-1}
T=$(mktemp -d)
source "$(dirname "$0")/gpu_lib.sh"  # check, left
gpu_procs() { nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | grep -c . ; }
gpu_before=$(gpu_procs)

# 4 requests that finish after 4 tokens, 4 that would run for tens of thousands of steps.
python3 -c "
import json, random
r = random.Random(0)
for i in range(8):
    print(json.dumps({'prompt_token_ids': [r.randint(0, 10000) for _ in range(300)],
                      'max_tokens': 4 if i % 2 == 0 else 30000}))
" >"$T/mixed.jsonl"

# start_run NAME [VAR=VALUE...]: the run in the background (with those variables), its stderr in $T/NAME.err;
# returns once it has made 40 steps.
start_run() {
  local name=$1; shift
  rm -f "$T/$name.jsonl"
  env "$@" setsid "$NV" "$MODEL" "$T/mixed.jsonl" --tp "$TP" --ignore-eos --max-model-len 32768 --temperature 0 \
    --trace --output "$T/$name.jsonl" >"$T/$name.out" 2>"$T/$name.err" &
  pid=$!
  for _ in $(seq 1200); do grep -q '^\[trace\] step 40 ' "$T/$name.err" && break; sleep 0.05; done
}
stop_run() {  # stop_run TARGET SIGNAL...: each to TARGET (-PID: the run's process group), 0.2 s apart; sets rc
  local target=$1; shift
  for sig in "$@"; do kill "-$sig" -- "$target" 2>/dev/null; sleep 0.2; done
  wait $pid
  rc=$?
  sleep 1
}

start_run once
t0=$(date +%s.%N)
stop_run "-$pid" INT
dt=$(python3 -c "print(f'{$(date +%s.%N) - $t0 - 1.2:.2f}')")
written=$(grep -c '"finish_reason"' "$T/once.jsonl" 2>/dev/null)
unfinished=$(python3 -c "import json, sys
r = json.loads(open(sys.argv[1]).readlines()[-1])
print(r['summary']['unfinished_requests'])" "$T/once.jsonl" 2>/dev/null)
shown=$(grep -c '^==> request' "$T/once.out")
grep -q 'interrupted: stopping after this step' "$T/once.err" && [ $rc = 130 ] && [ "$written" = 4 ] &&
  [ "$shown" = 4 ] && [ "$unfinished" = 4 ] && [ "$(left)" = 0 ] && [ "$(gpu_procs)" = "$gpu_before" ]
check one_ctrl_c_writes_finished_requests $? "rc=$rc, $written records and $shown completions written (want 4),
  unfinished_requests=$unfinished (want 4), $(left) processes left, $(gpu_procs) GPU processes (before: $gpu_before),
  stopped ${dt}s after the signal; $(grep -v '^\[trace\]' "$T/once.err" | tail -n 4)"
grep -q '"finish_reason": *"length"' "$T/once.jsonl" && ! grep -q '"finish_reason": *null' "$T/once.jsonl"
check written_requests_are_finished $? "$(head -c 300 "$T/once.jsonl")"

start_run twice NANOVLLM_TEST_SLOW_STOP=10
t0=$(date +%s.%N)
stop_run "-$pid" INT INT
dt=$(python3 -c "print(f'{$(date +%s.%N) - $t0 - 1.4:.2f}')")  # less the 0.4 s of stop_run's pauses and 1 s wait
expect="nanovllm: interrupted"; [ "$TP" -gt 1 ] && expect="nanovllm: interrupted; stopping all $TP ranks"
grep -q -x "$expect" "$T/twice.err" && [ $rc = 130 ] && [ ! -e "$T/twice.jsonl" ] && [ "$(left)" = 0 ] &&
  [ "$(gpu_procs)" = "$gpu_before" ] && python3 -c "import sys; sys.exit(not $dt < 2)"
check two_ctrl_c_stop_at_once $? "rc=$rc, output file $( [ -e "$T/twice.jsonl" ] && echo exists || echo absent),
  ended ${dt}s after the second Ctrl-C, $(left) processes left; $(grep -v '^\[trace\]' "$T/twice.err" | tail -n 3)"

start_run term
stop_run "$pid" TERM
grep -q "terminated" "$T/term.err" && [ $rc = 143 ] && [ "$(left)" = 0 ] && [ "$(gpu_procs)" = "$gpu_before" ]
check sigterm_stops_at_once $? "rc=$rc, $(left) processes left; $(grep -v '^\[trace\]' "$T/term.err" | tail -n 3)"

rm -rf "$T"
echo "RESULT passed=$passed failed=$failed skipped=0"
[ "$failed" = 0 ]
