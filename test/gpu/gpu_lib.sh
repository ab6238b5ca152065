# Shared by the GPU shell checks (test/gpu/gpu_interrupt.sh, test/gpu/gpu_tp_shutdown.sh); source it after setting
# MODEL and NV. check NAME OK(0/1) DETAIL prints PASS or FAIL and counts it; left counts the processes of a
# run still alive (rank 0 and its workers share the command line).
passed=0 failed=0
check() {
  if [ "$2" = 0 ]; then echo "PASS $1"; passed=$((passed + 1)); else echo "FAIL $1: $3"; failed=$((failed + 1)); fi
}
left() { pgrep -f -- "$NV $MODEL" | wc -l; }
