#!/usr/bin/env bash
# The GPU half of the test suite in one call: kernel suites, a CLI smoke run, Ctrl-C and SIGTERM during a run
# (test/gpu/gpu_interrupt.sh), and the end-to-end comparison with Hugging Face transformers (needs python3 with
# torch + transformers on the GPU machine).
#
#   bash test/gpu/gpu_check.sh [BIN_DIR]      BIN_DIR holds nanovllm, gpu_kernels, gpu_requests, gpu_attention, gpu_gemm, gpu_e2e,
#                                         gpu_tp, gpu_persistent, gpu_moe
#                                         (default: . for nanovllm and build/ for the rest)
# Env: TOKENIZER_DIR (a folder with Qwen3's tokenizer.json; default: tools/fetch_tokenizer.sh),
#      LOG_DIR (default build/logs), WORK_DIR (checkpoints; default build/e2e), SHAPES (tiny 0.6b 8b-short),
#      NANOVLLM_E2E_TP=N (tensor parallelism: the CLI run and the end-to-end comparison on N GPUs, plus the
#      data-plane suite gpu_tp on every visible GPU and test/gpu/gpu_tp_shutdown.sh), NANOVLLM_E2E_DP=N
#      (data parallelism: test/gpu/gpu_dp.sh with N replicas, and N x TP GPUs for its --tp cases),
#      KERNELS=0 (skip the kernel and data-plane suites), E2E_OPTS (optimization sets of the transformers
#      comparison, default "all none": the default path and --plain), E2E_KV (KV cache dtypes the default
#      path runs again with, default "fp8"; "" for none), FP8_SHAPES (FP8 checkpoints compared in FP8 and
#      dequantized, default "tiny-fp8 odd-fp8"; "" for none), E2E_QUANT (the default path again with
#      --quantization fp8 on SHAPES' first shape and on MOE_SHAPES' first, default 1), MOE_SHAPES (Qwen3-MoE
#      checkpoints compared with the default switches and --plain, default "tiny-moe tiny-moe-nonorm
#      30b-a3b-short"; "" for none), MOE_FP8_SHAPES (FP8 Qwen3-MoE checkpoints, experts in FP8 as
#      Qwen3-30B-A3B-FP8's, compared in FP8 and dequantized like FP8_SHAPES, default "tiny-moe-fp8
#      tiny-moe-nonorm-fp8"; 30b-a3b-short-fp8 by name, it takes longer to make; "" for none)
set -uo pipefail
BIN=${1:-}
NANOVLLM=${BIN:+$BIN/}nanovllm; [ -n "$BIN" ] || NANOVLLM=./nanovllm
TB=${BIN:-build}
LOG_DIR=${LOG_DIR:-build/logs}; WORK_DIR=${WORK_DIR:-build/e2e}; SHAPES=${SHAPES:-tiny 0.6b 8b-short}
TOKENIZER_DIR=${TOKENIZER_DIR:-$(bash tools/fetch_tokenizer.sh | tail -n1)}
mkdir -p "$LOG_DIR" "$WORK_DIR"
export PYTHONUNBUFFERED=1
declare -a rows
row() { rows+=("$(printf '%-28s %s' "$1" "$2")"); }
suite() {  # suite NAME LOGFILE CMD...
  local name=$1 log=$2; shift 2
  "$@" >"$LOG_DIR/$log" 2>&1; local rc=$?
  local res; res=$(grep '^RESULT' "$LOG_DIR/$log" | tail -n1)
  row "$name" "rc=$rc ${res:-no RESULT line}"
  grep -E '^(FAIL|SKIPPED)' "$LOG_DIR/$log" | head -n 20
}
TP=${NANOVLLM_E2E_TP:-1}
nvidia-smi -L | tee "$LOG_DIR/gpu.txt"
if [ "${KERNELS:-1}" != 0 ]; then
  suite gpu_kernels gpu_kernels.txt "$TB/gpu_kernels"
  suite gpu_requests gpu_requests.txt "$TB/gpu_requests"
  suite gpu_attention gpu_attention.txt "$TB/gpu_attention"
  suite gpu_gemm gpu_gemm.txt "$TB/gpu_gemm"
  suite gpu_persistent gpu_persistent.txt "$TB/gpu_persistent"
  suite gpu_moe gpu_moe.txt "$TB/gpu_moe"
  grep -E 'TIMING|^MEASURED' "$LOG_DIR/gpu_persistent.txt"
  [ "$TP" -gt 1 ] && { suite gpu_tp gpu_tp.txt "$TB/gpu_tp"; grep -E '^ ' "$LOG_DIR/gpu_tp.txt"; }
fi
FP8_SHAPES=${FP8_SHAPES-tiny-fp8 odd-fp8}
MOE_SHAPES=${MOE_SHAPES-tiny-moe tiny-moe-nonorm 30b-a3b-short}
MOE_FP8_SHAPES=${MOE_FP8_SHAPES-tiny-moe-fp8 tiny-moe-nonorm-fp8}
python3 test/ref/hf_reference.py "$WORK_DIR" "$TOKENIZER_DIR" $SHAPES $FP8_SHAPES $MOE_SHAPES $MOE_FP8_SHAPES 2>&1 |
  tee "$LOG_DIR/hf_reference.txt" | grep -v Warning
printf 'introduce yourself\nlist all prime numbers within 100\n' >"$WORK_DIR/prompts.txt"
SMOKE=${SHAPES%% *}
"$NANOVLLM" "$WORK_DIR/$SMOKE" "$WORK_DIR/prompts.txt" --max-tokens 16 --temperature 0 --tp "$TP" \
  --output "$WORK_DIR/out.jsonl" >"$LOG_DIR/smoke.txt" 2>&1
row "smoke_cli ($SMOKE, tp $TP)" "rc=$? $(grep -c finish "$LOG_DIR/smoke.txt") completions"
tail -n 3 "$LOG_DIR/smoke.txt"
suite "interrupt (tp $TP)" interrupt.txt bash test/gpu/gpu_interrupt.sh "$WORK_DIR/$SMOKE" "$NANOVLLM" "$TP"
grep -E '^(PASS|FAIL)' "$LOG_DIR/interrupt.txt"
if [ "$TP" -gt 1 ]; then
  suite tp_shutdown tp_shutdown.txt bash test/gpu/gpu_tp_shutdown.sh "$WORK_DIR/$SMOKE" "$NANOVLLM" "$TP"
  grep -E '^PASS' "$LOG_DIR/tp_shutdown.txt"
fi
# The comparison with transformers for each optimization set in E2E_OPTS: all (the default path) and none
# (--plain: Part I alone). Teacher forcing reads what gpu_e2e just wrote, so each set runs both in turn.
# E2E_SCHEDULERS (default "mixed") runs the default path again with each of these schedulers.
run_e2e() {  # run_e2e LABEL ENV... (SHAPES may be set for one call: SHAPES="..." run_e2e ...)
  local label=$1; shift
  env "$@" NANOVLLM_E2E_DIR="$WORK_DIR" NANOVLLM_E2E_SHAPES="$SHAPES" "$TB/gpu_e2e" \
    >"$LOG_DIR/gpu_e2e_$label.txt" 2>&1
  local rc=$? res; res=$(grep '^RESULT' "$LOG_DIR/gpu_e2e_$label.txt" | tail -n1)
  row "gpu_e2e ($label)" "rc=$rc ${res:-no RESULT line}"
  grep -E '^\s+\(|model|weights|tolerance|tensor-parallel' "$LOG_DIR/gpu_e2e_$label.txt"
  for s in $SHAPES; do
    suite "teacher_forcing_$s ($label)" "tf_${s}_$label.txt" python3 test/ref/hf_check_generation.py "$WORK_DIR/$s"
    grep -E '^(PASS|FAIL)' "$LOG_DIR/tf_${s}_$label.txt"
  done
}
for opt in ${E2E_OPTS:-all none}; do run_e2e "opt-$opt" NANOVLLM_E2E_OPT="$opt"; done
for sch in ${E2E_SCHEDULERS:-mixed}; do run_e2e "scheduler-$sch" NANOVLLM_E2E_SCHEDULER="$sch"; done
for kv in ${E2E_KV-fp8}; do run_e2e "kv-$kv" NANOVLLM_E2E_KV="$kv"; done  # --kv-cache-dtype (section 31)
# FP8 weights (sections 28-30): FP8 checkpoints computed in FP8 and dequantized (--plain), and a bf16 one
# quantized at load.
if [ -n "$FP8_SHAPES" ]; then
  for opt in all none; do SHAPES=$FP8_SHAPES run_e2e "fp8-weights-$opt" NANOVLLM_E2E_OPT="$opt"; done
fi
[ "${E2E_QUANT:-1}" = 0 ] || SHAPES=${SHAPES%% *} run_e2e quantization-fp8 NANOVLLM_E2E_QUANT=fp8
# Qwen3-MoE (section 10b): the experts on Part I's path either way; the default switches change attention.
if [ -n "$MOE_SHAPES" ]; then
  for opt in all none; do SHAPES=$MOE_SHAPES run_e2e "moe-$opt" NANOVLLM_E2E_OPT="$opt"; done
fi
# FP8 experts (section 35): FP8 MoE checkpoints computed in FP8 (against hf_reference.py's W8A8 emulation, the
# experts included) and dequantized (--plain), and a bf16 MoE one quantized at load (its ref_q8_logits_N).
if [ -n "$MOE_FP8_SHAPES" ]; then
  for opt in all none; do SHAPES=$MOE_FP8_SHAPES run_e2e "moe-fp8-weights-$opt" NANOVLLM_E2E_OPT="$opt"; done
fi
[ "${E2E_QUANT:-1}" = 0 ] || [ -z "$MOE_SHAPES" ] ||
  SHAPES=${MOE_SHAPES%% *} run_e2e moe-quantization-fp8 NANOVLLM_E2E_QUANT=fp8
# Data parallelism (sections 46-47) on NANOVLLM_E2E_DP replicas (of TP GPUs each in its --tp case), after
# gpu_e2e wrote the tolerance its teacher-forcing check reuses.
DP=${NANOVLLM_E2E_DP:-1}
if [ "$DP" -gt 1 ]; then
  suite "data_parallel (dp $DP)" dp.txt bash test/gpu/gpu_dp.sh "$WORK_DIR/$SMOKE" "$NANOVLLM" "$DP" "$TP"
  grep -E '^(PASS|  dp)' "$LOG_DIR/dp.txt"
fi
echo; echo "== summary"; printf '%s\n' "${rows[@]}"
