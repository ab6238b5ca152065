#!/usr/bin/env bash
# Everything a GPU machine checks, in one call: the GPU suites, Ctrl-C, the end-to-end comparison with
# transformers (test/gpu/gpu_check.sh), then the benchmark (./bench.sh --random SHAPE), and last one short table.
#
#   bash test/gpu/gpu_all.sh [BIN_DIR]
#
# BIN_DIR holds nanovllm and the build/gpu_* binaries, built elsewhere (a GPU machine without the build
# dependencies); without it this builds them first with `make`.
# Env: LOG_DIR (default build/logs: check/ and bench/ logs), TOKENIZER_DIR, SHAPES (test/gpu/gpu_check.sh),
#      BENCH_SHAPE (0.6b; `none` skips the benchmark), NANOVLLM_E2E_TP (tensor parallelism, as gpu_check.sh),
#      SANITIZE=1 (also test/gpu/gpu_sanitize.sh: compute-sanitizer case by case; long).
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:-}
LOG_DIR=${LOG_DIR:-build/logs}
mkdir -p "$LOG_DIR/check" "$LOG_DIR/bench"
if [ -z "$BIN" ]; then
  make nanovllm build/gpu_kernels build/gpu_requests build/gpu_attention build/gpu_gemm build/gpu_e2e build/gpu_tp \
    build/gpu_persistent build/gpu_moe \
    >"$LOG_DIR/build.txt" 2>&1 || { tail -n 20 "$LOG_DIR/build.txt"; echo "gpu_all: build failed"; exit 1; }
  mkdir -p build/bin && cp nanovllm build/gpu_* build/bin/ && BIN=build/bin
fi
t0=$(date +%s)
LOG_DIR="$LOG_DIR/check" bash test/gpu/gpu_check.sh "$BIN" 2>&1 | tee "$LOG_DIR/check.txt"
if [ "${SANITIZE:-0}" = 1 ]; then
  bash test/gpu/gpu_sanitize.sh "$BIN" "${WORK_DIR:-build/e2e}/tiny" 2>&1 | tee "$LOG_DIR/sanitize.txt"
fi
t1=$(date +%s)
BENCH_SHAPE=${BENCH_SHAPE:-0.6b}
TP=${NANOVLLM_E2E_TP:-1}
if [ "$BENCH_SHAPE" != none ]; then
  ./bench.sh --random "$BENCH_SHAPE" --tp "$TP" --nanovllm "$BIN/nanovllm" --log-dir "$LOG_DIR/bench" 2>&1 |
    tee "$LOG_DIR/bench.txt"
fi
t2=$(date +%s)
echo
echo "== gpu_all: $(nvidia-smi -L | head -n 1) | tests $((t1 - t0)) s, bench $((t2 - t1)) s"
sed -n '/^== summary/,$p' "$LOG_DIR/check.txt" | tail -n +2
[ "${SANITIZE:-0}" = 1 ] && grep '^RESULT' "$LOG_DIR/sanitize.txt" | sed 's/^/sanitize                     /'
[ "$BENCH_SHAPE" != none ] && sed -n '/^measure /,$p' "$LOG_DIR/bench.txt"
failed=$(sed -n '/^== summary/,$p' "$LOG_DIR/check.txt" | grep -c -E 'rc=[1-9]|no RESULT')
[ "$failed" = 0 ]
