# Shared by the CLI suites (cli_errors.sh, simulate.sh): the counters, one PASS/FAIL/SKIPPED line per case
# and the RESULT line that test/run.sh sums. Sourced first thing; NANOVLLM_BIN overrides ./nanovllm.
set -u
passed=0 failed=0 skipped=0
BIN=${NANOVLLM_BIN:-./nanovllm}
pass() { echo "PASS $1"; passed=$((passed + 1)); }
fail() { echo "FAIL $1: $2"; failed=$((failed + 1)); }
skip() { echo "SKIPPED $1: $2"; skipped=$((skipped + 1)); }
check() { if [ "$2" = 0 ]; then pass "$1"; else fail "$1" "$3"; fi; }  # check NAME STATUS MESSAGE
finish() { echo "RESULT passed=$passed failed=$failed skipped=$skipped"; exit $((failed > 0)); }
