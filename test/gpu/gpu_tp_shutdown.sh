#!/usr/bin/env bash
# A tensor-parallel run ends cleanly on every path (needs TP GPUs; test/gpu/gpu_check.sh runs it when
# NANOVLLM_E2E_TP > 1). Each case checks the exit status, the message, and that no process of the run is
# left afterwards (nor anything new in /dev/shm):
#   normal end; a worker that fails mid-run (NANOVLLM_TEST_WORKER_FAIL=1:3); an error on rank 0 after the
#   workers exist; too many GPUs. Ctrl-C and SIGTERM are test/gpu/gpu_interrupt.sh's cases, run with TP ranks.
#
#   bash test/gpu/gpu_tp_shutdown.sh MODEL_DIR [NANOVLLM] [TP]
set -u
MODEL=$1 NV=${2:-./nanovllm} TP=${3:-2}
T=$(mktemp -d)
source "$(dirname "$0")/gpu_lib.sh"  # check, left
shm_before=$(ls /dev/shm | sort)
printf 'introduce yourself\nlist all prime numbers within 100\n' >"$T/prompts.txt"

"$NV" "$MODEL" "$T/prompts.txt" --tp "$TP" --max-tokens 16 --temperature 0 >"$T/ok.out" 2>"$T/ok.err"
rc=$? n=$(grep -c '^==> request' "$T/ok.out")
[ $rc = 0 ] && [ "$n" = 2 ] && [ "$(left)" = 0 ]
check normal_end $? "rc=$rc, $n completions, $(left) processes left; $(tail -n 3 "$T/ok.err")"

t0=$(date +%s)
NANOVLLM_TEST_WORKER_FAIL=1:3 timeout 120 "$NV" "$MODEL" "$T/prompts.txt" --tp "$TP" --max-tokens 16 \
  >/dev/null 2>"$T/fail.err"
rc=$? dt=$(($(date +%s) - t0))
sleep 1
grep -q 'rank 1 fails at its step 3, on purpose' "$T/fail.err" &&
  grep -q 'tensor-parallel rank 1 exited with status 1' "$T/fail.err" && [ $rc = 1 ] && [ "$(left)" = 0 ]
check worker_failure_ends_the_run $? "rc=$rc after ${dt}s, $(left) processes left; $(tail -n 4 "$T/fail.err")"

"$NV" "$MODEL" "$T/prompts.txt" --tp "$TP" --num-kvcache-blocks 100000000 >/dev/null 2>"$T/kv.err"
rc=$?
sleep 1
grep -q -- '--num-kvcache-blocks 100000000 needs' "$T/kv.err" && [ $rc = 1 ] && [ "$(left)" = 0 ]
check rank0_error_ends_every_rank $? "rc=$rc, $(left) processes left; $(tail -n 3 "$T/kv.err")"

# More ranks than GPUs: the smallest --tp above the GPU count that splits this model must be refused for the
# GPUs; where none does (a model with 2 KV heads on 2 GPUs), --tp 8 must be refused for the model's shape.
# Either way before any worker exists, with rc 1.
gpus=$(nvidia-smi -L | grep -c GPU)
cfg() { grep -o "\"$1\": *[0-9]*" "$MODEL/config.json" | head -n1 | grep -o '[0-9]*$'; }
NH=$(cfg num_attention_heads) NKV=$(cfg num_key_value_heads) I=$(cfg intermediate_size)
tp=8 expect="--tensor-parallel-size 8 must divide"
for n in 2 4 8; do
  if [ "$n" -gt "$gpus" ] && [ $((NH % n)) = 0 ] && [ $((NKV % n)) = 0 ] && [ $((I % n)) = 0 ] &&
    [ $((I / n % 8)) = 0 ]; then
    tp=$n expect="--tensor-parallel-size $n needs $n GPUs, but $gpus are visible"
    break
  fi
done
"$NV" "$MODEL" "$T/prompts.txt" --tp $tp >/dev/null 2>"$T/gpus.err"
rc=$?
sleep 1
if [ "$gpus" -lt 8 ]; then
  grep -q -- "$expect" "$T/gpus.err" && [ $rc = 1 ] && [ "$(left)" = 0 ]
  check too_many_gpus_is_refused $? \
    "--tp $tp on $gpus GPUs: rc=$rc, $(left) processes left; $(cat "$T/gpus.err")"
fi

[ "$(ls /dev/shm | sort)" = "$shm_before" ]
check no_shared_memory_left $? "/dev/shm changed: $(ls /dev/shm)"
rm -rf "$T"
echo "RESULT passed=$passed failed=$failed skipped=0"
[ "$failed" = 0 ]
