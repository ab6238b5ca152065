#!/usr/bin/env bash
# Data parallelism and shards on GPUs (nanovllm.cu sections 41 and 46-47; needs DP x TP GPUs, and DP for
# the first cases). test/gpu/gpu_check.sh runs it when NANOVLLM_E2E_DP > 1. Each case checks the exit
# status, the message, and that no process of the run is left afterwards:
#   1. -dp DP (then -dp DP --tp TP against --tp TP): every request alone (--max-num-seqs 1, so no batch can
#      change a bit), greedy, sampled with and without a seed, n = 2: the completions equal one engine's
#      token for token; the summary has one line per replica; one closing line.
#   2. the default batch: the same requests in input order, and the share of them whose tokens equal one
#      engine's printed (a different batch may round a logit differently; not asserted).
#   3. an OpenAI batch file: -dp DP writes the same lines (custom_id, choices) as one engine.
#   4. a replica that fails at its 3rd step (NANOVLLM_TEST_REPLICA_FAIL=1:3): named with its GPU, exit 1.
#   5. SIGTERM and Ctrl-C mid-run: exit 143 / 130 (the finished completions written), nothing left.
#   6. more GPUs than there are: refused naming both flags, before any replica exists.
#   7. two --shard K/2 runs merged equal the unsharded run (--max-num-seqs 1).
# Teacher forcing with transformers of the -dp run's greedy tokens: when MODEL_DIR/gen_results.json (from
# gpu_e2e, for its tolerance) and python3 with torch are there.
#
#   bash test/gpu/gpu_dp.sh MODEL_DIR [NANOVLLM] [DP] [TP]
set -u
MODEL=$1 NV=${2:-./nanovllm} DP=${3:-2} TP=${4:-2}
T=$(mktemp -d)
source "$(dirname "$0")/gpu_lib.sh"  # check, left
gpus=$(nvidia-smi -L | grep -c GPU)
python3 - "$T" <<'PY'
import json, random, sys
d = sys.argv[1]
random.seed(5)
words = "the of a to in is it that for on with as was at by an be this from or have not are but".split()
with open(f"{d}/w.jsonl", "w") as f:
    for i in range(24):
        r = {"prompt": " ".join(random.choice(words) for _ in range(random.randint(3, 40))),
             "max_tokens": random.randint(8, 48), "temperature": 0 if i % 3 == 0 else 0.8}
        if i % 3 == 2: r["seed"] = 1000 + i
        if i % 8 == 5: r["n"] = 2
        f.write(json.dumps(r) + "\n")
with open(f"{d}/batch.jsonl", "w") as f:
    for i in range(12):
        body = {"messages": [{"role": "user", "content": f"count to {i + 3}"}], "max_tokens": 24, "temperature": 0}
        f.write(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n")
with open(f"{d}/long.jsonl", "w") as f:  # seconds even for the tiny checkpoint (~1M tok/s on two H200s)
    for i in range(1024):
        f.write(json.dumps({"prompt_token_ids": [random.randint(0, 10000) for _ in range(300)], "max_tokens": 1500,
                            "ignore_eos": True}) + "\n")
PY
lines() { python3 -c '
import json, sys
for l in open(sys.argv[1]):
    j = json.loads(l)
    if "summary" in j or "shard" in j: continue
    if "custom_id" in j:
        b = (j["response"] or {}).get("body") or {}
        print(j["custom_id"], json.dumps([(c["message"]["content"], c["finish_reason"]) for c in b.get("choices", [])]))
    else: print(j["index"], j["completion"], j["token_ids"], j["finish_reason"])' "$1"; }
RUN=("$NV" "$MODEL")

# 1. every request alone: equal to one engine, token for token
for tp in 1 "$TP"; do
  [ $((DP * tp)) -le "$gpus" ] || { echo "SKIPPED dp${DP}_tp${tp}_alone: needs $((DP * tp)) GPUs, $gpus here"; continue; }
  "${RUN[@]}" "$T/w.jsonl" --tp "$tp" --max-num-seqs 1 --output "$T/one$tp.jsonl" >/dev/null 2>"$T/one$tp.err"
  rc1=$?
  "${RUN[@]}" "$T/w.jsonl" --tp "$tp" -dp "$DP" --max-num-seqs 1 --output "$T/dp$tp.jsonl" >/dev/null 2>"$T/dp$tp.err"
  rc=$?
  [ $rc1 = 0 ] && [ $rc = 0 ] && cmp -s <(lines "$T/one$tp.jsonl") <(lines "$T/dp$tp.jsonl") && [ "$(left)" = 0 ]
  check "dp${DP}_tp${tp}_alone_equals_one_engine" $? "rc=$rc1/$rc, $(left) left; $(diff <(lines "$T/one$tp.jsonl") <(lines "$T/dp$tp.jsonl") | head -3); $(tail -n 2 "$T/dp$tp.err")"
  [ "$(grep -c '^nanovllm: replica [0-9]* | GPU ' "$T/dp$tp.err")" = "$DP" ] &&
    [ "$(grep -c '^nanovllm: [0-9]* requests' "$T/dp$tp.err")" = 1 ]
  check "dp${DP}_tp${tp}_one_summary_a_line_per_replica" $? "$(grep '^nanovllm: ' "$T/dp$tp.err" | tail -n 8)"
done

# 2. the default batch: same requests, in order; agreement printed
"${RUN[@]}" "$T/w.jsonl" --output "$T/oneb.jsonl" >/dev/null 2>&1 &&
  "${RUN[@]}" "$T/w.jsonl" -dp "$DP" --output "$T/dpb.jsonl" >/dev/null 2>"$T/dpb.err"
rc=$?
cut -d' ' -f1,2 <(lines "$T/oneb.jsonl") >"$T/k1"; cut -d' ' -f1,2 <(lines "$T/dpb.jsonl") >"$T/k2"
[ $rc = 0 ] && cmp -s "$T/k1" "$T/k2"; check "dp${DP}_batched_same_requests_in_order" $? "rc=$rc"
echo "  dp$DP, default batch: $(comm -12 <(lines "$T/oneb.jsonl" | sort) <(lines "$T/dpb.jsonl" | sort) | wc -l) of $(wc -l <"$T/k1") completions token-identical to one engine's"
if [ -f "$MODEL/gen_results.json" ] && python3 -c 'import torch, transformers' 2>/dev/null; then
  mkdir -p "$T/tf"; for f in "$(cd "$MODEL" && pwd)"/*; do ln -sf "$f" "$T/tf/"; done; rm -f "$T/tf/gen_results.json"
  python3 - "$MODEL/gen_results.json" "$T/w.jsonl" "$T/dpb.jsonl" "$T/tf/gen_results.json" "$MODEL" <<'PY'
import json, sys
from transformers import AutoTokenizer
ref, reqs, out, dst, model = sys.argv[1:]
tok = AutoTokenizer.from_pretrained(model)
reqs = [json.loads(l) for l in open(reqs)]
seqs, plens = [], []
for l in open(out):
    j = json.loads(l)
    if "index" not in j or reqs[j["index"]]["temperature"] != 0: continue
    # (the text, then its ids: apply_chat_template(tokenize=True) returns a list in transformers 4.x and a
    # BatchEncoding in 5.x)
    text = tok.apply_chat_template([{"role": "user", "content": reqs[j["index"]]["prompt"]}], tokenize=False, add_generation_prompt=True)
    p = tok(text, add_special_tokens=False)["input_ids"]
    seqs.append(list(p) + j["token_ids"]); plens.append(len(p))
json.dump({"tolerance": json.load(open(ref))["tolerance"], "runs": {"dp": {"sequences": seqs, "prompt_lens": plens}}}, open(dst, "w"))
PY
  python3 test/ref/hf_check_generation.py "$T/tf" >"$T/tf.txt" 2>&1
  check "dp${DP}_greedy_passes_teacher_forcing" $? "$(grep -E 'FAIL|RESULT' "$T/tf.txt" | head -4; tail -n 5 "$T/tf.txt")"
else
  echo "SKIPPED dp${DP}_greedy_passes_teacher_forcing: no $MODEL/gen_results.json (run gpu_e2e first) or no torch"
fi

# 3. an OpenAI batch file
"${RUN[@]}" "$T/batch.jsonl" --max-num-seqs 1 --output "$T/b1.jsonl" >/dev/null 2>&1 &&
  "${RUN[@]}" "$T/batch.jsonl" --max-num-seqs 1 -dp "$DP" --output "$T/b2.jsonl" >/dev/null 2>&1 &&
  cmp -s <(lines "$T/b1.jsonl") <(lines "$T/b2.jsonl")
check "dp${DP}_batch_file_equals_one_engine" $? "$(diff <(lines "$T/b1.jsonl") <(lines "$T/b2.jsonl") | head -3)"

# 4. a replica that fails
NANOVLLM_TEST_REPLICA_FAIL=1:3 timeout 300 "${RUN[@]}" "$T/long.jsonl" -dp "$DP" --output "$T/fail.jsonl" \
  >/dev/null 2>"$T/fail.err"
rc=$?
sleep 1
[ $rc = 1 ] && grep -q 'replica 1 fails at its step 3, on purpose' "$T/fail.err" &&
  grep -q 'nanovllm: error: replica 1 (GPU [0-9,]*) exited with status 1' "$T/fail.err" && [ "$(left)" = 0 ]
check "dp${DP}_failing_replica_ends_the_run" $? "rc=$rc, $(left) left; $(grep error "$T/fail.err" | head -3)"

# 5. SIGTERM and Ctrl-C mid-run (once the replicas run: the progress line has appeared)
for sig in TERM INT; do
  setsid "${RUN[@]}" "$T/long.jsonl" -dp "$DP" --output "$T/$sig.jsonl" >/dev/null 2>"$T/$sig.err" &
  pid=$!
  # Wait until the replicas run (the optimizations line comes when all are ready), or the run is over.
  for _ in $(seq 600); do
    grep -q 'optimizations (Part II)' "$T/$sig.err" && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.2
  done
  sleep 0.5
  kill -$sig -- -$pid
  wait $pid
  rc=$?
  sleep 1
  want=$([ $sig = TERM ] && echo 143 || echo 130)
  ok=1
  [ $rc = "$want" ] && [ "$(left)" = 0 ] && ok=0
  [ $sig = INT ] && ! grep -q 'stopped by Ctrl-C' "$T/$sig.err" && ok=1
  check "dp${DP}_sig${sig}_ends_every_replica" $ok "rc=$rc (want $want), $(left) left; $(tail -n 3 "$T/$sig.err")"
done

# 6. more GPUs than there are
"${RUN[@]}" "$T/w.jsonl" -dp $((gpus + 1)) >/dev/null 2>"$T/many.err"
rc=$?
[ $rc = 1 ] && grep -q -- "--data-parallel-size $((gpus + 1)) x --tensor-parallel-size 1 needs $((gpus + 1)) GPUs, but $gpus are visible" "$T/many.err" && [ "$(left)" = 0 ]
check "too_many_gpus_refused" $? "rc=$rc; $(cat "$T/many.err")"

# 7. shards merged = the unsharded run
"${RUN[@]}" "$T/w.jsonl" --max-num-seqs 1 --shard 0/2 --output "$T/s0.jsonl" >/dev/null 2>&1 &&
  "${RUN[@]}" "$T/w.jsonl" --max-num-seqs 1 --shard 1/2 -dp "$DP" --output "$T/s1.jsonl" >/dev/null 2>&1 &&
  "$NV" merge "$T/merged.jsonl" "$T/s1.jsonl" "$T/s0.jsonl" 2>/dev/null &&
  cmp -s <(lines "$T/one1.jsonl") <(lines "$T/merged.jsonl")
check shards_merged_equal_the_unsharded_run $? "$(diff <(lines "$T/one1.jsonl") <(lines "$T/merged.jsonl") | head -3)"

rm -rf "$T"
echo "RESULT passed=$passed failed=$failed skipped=0"
[ "$failed" = 0 ]
