#!/usr/bin/env bash
# suite: data parallelism and shards on a CPU machine (issue 46)
# `nanovllm simulate --data-parallel-size N` forks the replica processes a GPU run forks (nanovllm.cu
# sections 46-47) with the stand-in model of section 48, so the process plumbing runs here without a GPU:
# the completions of N replicas equal one engine's (plain and OpenAI batch output, greedy, sampled and
# seeded requests, n > 1); one progress line and one summary with a line per replica; a replica that fails
# is named, the finished completions are written, the exit status is 1 and no process is left; SIGTERM and
# Ctrl-C end every replica. Then shards: --shard K/N runs plan and write their share with its record, and
# `nanovllm merge` gives back the unsharded run's completions; the merge refuses a missing, duplicated or
# foreign shard naming the file. Run from the repo root; NANOVLLM_BIN overrides ./nanovllm.
source "$(dirname "$0")/lib.sh"
if ! TOK=$(bash tools/fetch_tokenizer.sh | tail -n 1) || [ -z "$TOK" ]; then
  fail fetch_tokenizer "tools/fetch_tokenizer.sh could not provide the Qwen3 tokenizer"; finish
fi
[ -x "$BIN" ] || { fail binary "$BIN is missing: run make first"; finish; }
tmp=$(mktemp -d)
MARK=nanovllm_dp_test_$$  # in the environment of every nanovllm process this suite starts: none may be left
trap 'rm -rf "$tmp"' EXIT
python3 - "$tmp" <<'PY'
import json, random, sys
d = sys.argv[1]
random.seed(3)
with open(f"{d}/w.jsonl", "w") as f:  # 60 requests: greedy, sampled, seeded, n = 3, stop strings
    for i in range(60):
        r = {"prompt_token_ids": [random.randint(0, 5000) for _ in range(random.randint(5, 80))],
             "max_tokens": random.randint(4, 60), "temperature": 0 if i % 3 == 0 else 0.8}
        if i % 3 == 2: r["seed"] = 100 + i
        if i % 7 == 0: r["n"] = 3
        f.write(json.dumps(r) + "\n")
with open(f"{d}/batch.jsonl", "w") as f:
    for i in range(30):
        body = {"model": "m", "messages": [{"role": "user", "content": f"question {i} " + "x" * (i % 9)}],
                "max_tokens": 5 + i % 20, "temperature": 0.7}
        if i == 4: body["tools"] = [{"type": "function"}]  # answered with an error line
        f.write(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n")
with open(f"{d}/long.jsonl", "w") as f:  # work for many seconds, so that a signal arrives mid-run
    for i in range(2000):
        f.write(json.dumps({"prompt_token_ids": [random.randint(0, 5000) for _ in range(100)],
                            "max_tokens": 50 if i % 10 == 0 else 2000, "ignore_eos": True, "temperature": 0.5}) + "\n")
PY
SIM=(env NANOVLLM_DP_TEST_MARK=$MARK "$BIN" simulate "$TOK" --num-kvcache-blocks 400 --kvcache-block-size 16 --max-model-len 512
     --simulate-eos-prob 0.02)
LONG=(env NANOVLLM_DP_TEST_MARK=$MARK "$BIN" simulate "$TOK" --num-kvcache-blocks 2000 --kvcache-block-size 16
      --max-model-len 4096 "$tmp/long.jsonl")

# left_behind: the pids of processes (other than this shell's) that carry this run's mark
left_behind() { grep -l "NANOVLLM_DP_TEST_MARK=$MARK" /proc/[0-9]*/environ 2>/dev/null |
                sed 's|/proc/\([0-9]*\)/environ|\1|' || true; }
no_process_left() {  # NAME: every process of the run is gone within 5 s
  local i
  for i in $(seq 50); do [ -z "$(left_behind)" ] && { pass "$1"; return; }; sleep 0.1; done
  fail "$1" "still running: $(left_behind | tr '\n' ' ')"
  left_behind | xargs -r kill -9
}
completions() { python3 -c '
import json, sys
for l in open(sys.argv[1]):
    j = json.loads(l)
    if "summary" in j or "shard" in j: continue
    if "custom_id" in j:  # a batch line: what it answers, less its random ids and time
        b = (j["response"] or {}).get("body") or {}
        print(j["custom_id"], json.dumps(b.get("choices")), j["error"])
    else: print(j["index"], j["completion"], j["token_ids"], j["finish_reason"])' "$1"; }
summary_field() { python3 -c 'import json, sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])["summary"][sys.argv[2]])' "$1" "$2"; }

# 1. N replicas give one engine's completions, in input order.
"${SIM[@]}" "$tmp/w.jsonl" --output "$tmp/one.jsonl" >"$tmp/one.out" 2>"$tmp/one.err"
check one_engine_runs $? "$(tail -n 3 "$tmp/one.err")"
for n in 2 3; do
  "${SIM[@]}" "$tmp/w.jsonl" -dp $n --output "$tmp/dp$n.jsonl" >"$tmp/dp$n.out" 2>"$tmp/dp$n.err"
  check "dp${n}_runs" $? "$(tail -n 3 "$tmp/dp$n.err")"
  cmp -s <(completions "$tmp/one.jsonl") <(completions "$tmp/dp$n.jsonl")
  check "dp${n}_completions_equal_one_engines" $? "$(diff <(completions "$tmp/one.jsonl") <(completions "$tmp/dp$n.jsonl") | head -5)"
  cmp -s "$tmp/one.out" "$tmp/dp$n.out"; check "dp${n}_stdout_equal_one_engines" $? "stdout differs"
  [ "$(summary_field "$tmp/one.jsonl" tokens_xxh64)" = "$(summary_field "$tmp/dp$n.jsonl" tokens_xxh64)" ]
  check "dp${n}_tokens_xxh64_equal" $? "the summaries' tokens_xxh64 differ"
  [ "$(grep -c '^nanovllm: replica [0-9]* | GPU (simulated) | ' "$tmp/dp$n.err")" = $n ]
  check "dp${n}_summary_has_a_line_per_replica" $? "$(grep '^nanovllm: replica' "$tmp/dp$n.err")"
  [ "$(summary_field "$tmp/dp$n.jsonl" data_parallel_size)" = $n ]
  check "dp${n}_summary_record_names_the_replicas" $? "no data_parallel_size $n"
  [ "$(grep -c '^nanovllm: [0-9]* requests' "$tmp/dp$n.err")" = 1 ]
  check "dp${n}_one_closing_line" $? "$(grep -c '^nanovllm: [0-9]* requests' "$tmp/dp$n.err") closing lines"
done
"${SIM[@]}" "$tmp/batch.jsonl" --output "$tmp/b1.jsonl" >/dev/null 2>"$tmp/b1.err" &&
  "${SIM[@]}" "$tmp/batch.jsonl" -dp 3 --output "$tmp/b3.jsonl" >/dev/null 2>"$tmp/b3.err"
check batch_runs $? "$(tail -n 2 "$tmp/b3.err")"
cmp -s <(completions "$tmp/b1.jsonl") <(completions "$tmp/b3.jsonl")
check batch_output_equal_one_engines $? "$(diff <(completions "$tmp/b1.jsonl") <(completions "$tmp/b3.jsonl") | head -4)"
no_process_left normal_runs_leave_no_process

# 2. A replica that fails: named, the others stopped, what had finished written, exit status 1.
NANOVLLM_TEST_REPLICA_FAIL=1:600 "${LONG[@]}" -dp 3 --output "$tmp/fail.jsonl" \
  >"$tmp/fail.out" 2>"$tmp/fail.err"
rc=$?
[ $rc = 1 ]; check failing_replica_exit_status_1 $? "exit $rc"
grep -q '^\[replica 1\] nanovllm: error: NANOVLLM_TEST_REPLICA_FAIL=1:600: replica 1 fails' "$tmp/fail.err"
check failing_replica_says_why $? "$(head -c 400 "$tmp/fail.err")"
grep -q '^nanovllm: error: replica 1 exited with status 1 .*stopping all 3 replicas' "$tmp/fail.err"
check coordinator_names_the_failing_replica $? "$(grep error "$tmp/fail.err" | head -3)"
grep -q "stopped by replica 1's failure: .* completions unfinished, not written" "$tmp/fail.err"
check failure_counts_the_unfinished $? "$(tail -n 2 "$tmp/fail.err")"
[ -s "$tmp/fail.jsonl" ] && [ "$(summary_field "$tmp/fail.jsonl" unfinished_requests)" -gt 0 ]
check failure_writes_the_output $? "no --output, or nothing unfinished"
no_process_left failure_leaves_no_process
# ... and before the replicas are ready: nothing ran, nothing written.
NANOVLLM_TEST_REPLICA_FAIL=0:1 "${SIM[@]}" "$tmp/w.jsonl" -dp 2 --output "$tmp/fail1.jsonl" >/dev/null 2>"$tmp/fail1.err"
rc=$?
[ $rc = 1 ] && grep -q 'nanovllm: error: replica 0 exited with status 1' "$tmp/fail1.err"
check first_step_failure_named $? "exit $rc: $(grep error "$tmp/fail1.err" | head -2)"

# 3. SIGTERM mid-run: every replica ends, exit status 143. Ctrl-C (SIGINT to the process group, as a
#    terminal sends it): the step in flight ends, the finished completions are written, exit status 130.
setsid "${LONG[@]}" -dp 3 --output "$tmp/term.jsonl" >/dev/null 2>"$tmp/term.err" &
pid=$!
sleep 1.5
kill -TERM $pid
wait $pid
rc=$?
[ $rc = 143 ]; check sigterm_exit_status_143 $? "exit $rc: $(tail -n 2 "$tmp/term.err")"
grep -q 'terminated; stopping all 3 replicas' "$tmp/term.err"; check sigterm_says_it_stops_the_replicas $? "$(tail -n 2 "$tmp/term.err")"
no_process_left sigterm_leaves_no_process
setsid "${LONG[@]}" -dp 3 --shard 0/1 --output "$tmp/int.jsonl" >/dev/null 2>"$tmp/int.err" &
pid=$!
sleep 1.5
kill -INT -- -$pid
wait $pid
rc=$?
[ $rc = 130 ]; check ctrl_c_exit_status_130 $? "exit $rc: $(tail -n 3 "$tmp/int.err")"
[ "$(grep -c 'interrupted: stopping after this step' "$tmp/int.err")" = 1 ]
check ctrl_c_said_once $? "$(grep -c interrupted "$tmp/int.err") times"
grep -q 'stopped by Ctrl-C: .* completions unfinished, not written' "$tmp/int.err" && [ -s "$tmp/int.jsonl" ]
check ctrl_c_writes_the_finished $? "$(tail -n 2 "$tmp/int.err")"
no_process_left ctrl_c_leaves_no_process

# 4. Shards: the plan, each shard's share with its record, and the merge is the unsharded run.
for k in 0 1 2 3; do
  "${SIM[@]}" "$tmp/w.jsonl" --shard $k/4 --output "$tmp/s$k.jsonl" >/dev/null 2>"$tmp/s$k.err" ||
    fail "shard_${k}_runs" "$(tail -n 2 "$tmp/s$k.err")"
done
[ "$(grep -c '^nanovllm: shard [0-3]/4 | ' "$tmp/s2.err")" = 4 ] && grep -q '<- this run' "$tmp/s2.err"
check simulate_plans_every_shard $? "$(grep 'shard' "$tmp/s2.err" | head -6)"
"$BIN" merge "$tmp/merged.jsonl" "$tmp/s3.jsonl" "$tmp/s1.jsonl" "$tmp/s0.jsonl" "$tmp/s2.jsonl" 2>"$tmp/merge.err"
check merge_runs $? "$(cat "$tmp/merge.err")"
cmp -s <(completions "$tmp/one.jsonl") <(completions "$tmp/merged.jsonl")
check merged_shards_equal_the_unsharded_run $? "$(diff <(completions "$tmp/one.jsonl") <(completions "$tmp/merged.jsonl") | head -4)"
[ "$(summary_field "$tmp/one.jsonl" tokens_xxh64)" = "$(summary_field "$tmp/merged.jsonl" tokens_xxh64)" ]
check merged_tokens_xxh64_equals_the_unsharded_runs $? "differ"
"${SIM[@]}" "$tmp/w.jsonl" --shard 1/2 -dp 2 --output "$tmp/sd1.jsonl" >/dev/null 2>&1 &&
  "${SIM[@]}" "$tmp/w.jsonl" --shard 0/2 --output "$tmp/sd0.jsonl" >/dev/null 2>&1 &&
  "$BIN" merge "$tmp/mergeddp.jsonl" "$tmp/sd0.jsonl" "$tmp/sd1.jsonl" 2>/dev/null &&
  cmp -s <(completions "$tmp/one.jsonl") <(completions "$tmp/mergeddp.jsonl")
check a_shard_with_replicas_merges_the_same $? "differs"
for k in 0 1; do "${SIM[@]}" "$tmp/batch.jsonl" --shard $k/2 --output "$tmp/bs$k.jsonl" >/dev/null 2>&1; done
"$BIN" merge "$tmp/bmerged.jsonl" "$tmp/bs0.jsonl" "$tmp/bs1.jsonl" 2>/dev/null &&
  cmp -s <(completions "$tmp/b1.jsonl") <(completions "$tmp/bmerged.jsonl")
check merged_batch_shards_equal_the_unsharded_run $? "differs"
SLURM_ARRAY_TASK_ID=12 SLURM_ARRAY_TASK_MIN=10 SLURM_ARRAY_TASK_MAX=13 SLURM_ARRAY_TASK_COUNT=4 \
  "${SIM[@]}" "$tmp/w.jsonl" --shard slurm --output "$tmp/slurm.jsonl" >/dev/null 2>&1
cmp -s <(completions "$tmp/s2.jsonl") <(completions "$tmp/slurm.jsonl"); check slurm_task_12_from_10_is_shard_2 $? "differs"
JOB_COMPLETION_INDEX=3 "${SIM[@]}" "$tmp/w.jsonl" --shard k8s:4 --output "$tmp/k8s.jsonl" >/dev/null 2>&1
cmp -s <(completions "$tmp/s3.jsonl") <(completions "$tmp/k8s.jsonl"); check k8s_index_3_is_shard_3 $? "differs"
# more shards than prompts: an empty shard writes its record alone, and the merge still completes
printf '%s\n' '{"prompt_token_ids": [1, 2, 3], "max_tokens": 4}' '{"prompt_token_ids": [4, 5], "max_tokens": 4}' >"$tmp/two.jsonl"
for k in 0 1 2; do "${SIM[@]}" "$tmp/two.jsonl" --shard $k/3 --output "$tmp/t$k.jsonl" >/dev/null 2>&1; done
"$BIN" merge "$tmp/tmerged.jsonl" "$tmp/t0.jsonl" "$tmp/t1.jsonl" "$tmp/t2.jsonl" 2>/dev/null &&
  [ "$(grep -c '"index"' "$tmp/tmerged.jsonl")" = 2 ]
check empty_shard_merges $? "$(cat "$tmp/t1.jsonl" "$tmp/t2.jsonl" | head -c 300)"

# 5. The merge refuses an incomplete set, naming the file; it writes nothing then.
merge_refuses() {  # NAME NEEDLE SHARD_FILES...
  local name=$1 needle=$2; shift 2
  rm -f "$tmp/bad.jsonl"
  "$BIN" merge "$tmp/bad.jsonl" "$@" >/dev/null 2>"$tmp/merge.err"
  local rc=$?
  if [ $rc != 1 ]; then fail "$name" "exit $rc"; return; fi
  if ! grep -qF -- "$needle" "$tmp/merge.err"; then fail "$name" "no '$needle' in: $(cat "$tmp/merge.err")"; return; fi
  if [ -e "$tmp/bad.jsonl" ]; then fail "$name" "wrote the output"; return; fi
  pass "$name"
}
merge_refuses merge_missing_shard "shard 1/4 missing" "$tmp/s0.jsonl" "$tmp/s2.jsonl" "$tmp/s3.jsonl"
cp "$tmp/s2.jsonl" "$tmp/s2-again.jsonl"
merge_refuses merge_duplicated_shard "s2-again.jsonl and $tmp/s2.jsonl are both shard 2/4" "$tmp/s0.jsonl" "$tmp/s1.jsonl" "$tmp/s2.jsonl" \
  "$tmp/s3.jsonl" "$tmp/s2-again.jsonl"
merge_refuses merge_foreign_shard "sd1.jsonl is a shard of another run" "$tmp/s0.jsonl" "$tmp/sd1.jsonl"
"${SIM[@]}" "$tmp/w.jsonl" --shard 1/4 --seed 9 --output "$tmp/seed9.jsonl" >/dev/null 2>&1
merge_refuses merge_shard_of_another_seed "seed9.jsonl is a shard of another run" "$tmp/s0.jsonl" "$tmp/seed9.jsonl" \
  "$tmp/s2.jsonl" "$tmp/s3.jsonl"
merge_refuses merge_not_a_shard "one.jsonl: not a shard's --output" "$tmp/one.jsonl" "$tmp/s1.jsonl"
merge_refuses merge_interrupted_shard "int.jsonl: shard 0/1 was stopped with" "$tmp/int.jsonl"
head -n 3 "$tmp/s1.jsonl" >"$tmp/s1-cut.jsonl"; tail -n 1 "$tmp/s1.jsonl" >>"$tmp/s1-cut.jsonl"
merge_refuses merge_truncated_shard "s1-cut.jsonl: " "$tmp/s0.jsonl" "$tmp/s1-cut.jsonl" "$tmp/s2.jsonl" "$tmp/s3.jsonl"
merge_refuses merge_output_is_an_input "is also one of the shard files" "$tmp/bad.jsonl"
finish
