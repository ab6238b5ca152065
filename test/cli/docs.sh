#!/usr/bin/env bash
# suite: docs stay true to the code
# Every flag and every optimization name that `nanovllm --help` lists appears in README.md; every section of
# the README's reading guide exists as a banner "// ==== N. " in nanovllm.cu (and the other way round); the
# host concepts come before the kernels (struct Sequence before the first __global__); and no comment of
# nanovllm.cu carries a timing (ms, us, tok/s, GB/s, TFLOP/s, a percentage): those live in the README.
cd "$(dirname "$0")/../.."
passed=0 failed=0
check() {  # check NAME CONDITION_EXIT_CODE MESSAGE
  if [ "$2" -eq 0 ]; then echo "PASS $1"; passed=$((passed + 1)); else echo "FAIL $1: $3"; failed=$((failed + 1)); fi
}
flags=$(./nanovllm --help | grep -o -- '--[a-z][a-z-]*' | sort -u)
[ -n "$flags" ]; check help_lists_flags $? "./nanovllm --help printed no flags"
missing=""
for f in $flags; do grep -qE -- "(^|[^a-z-])$f([^a-z-]|$)" README.md || missing="$missing $f"; done
[ -z "$missing" ]; check readme_documents_every_flag $? "not in README.md:$missing"
code_sections=$(grep -o '^// ==== [0-9]*\.' nanovllm.cu | grep -o '[0-9]*' | sort -n | tr '\n' ' ')
guide_sections=$(sed -n '/^## Reading guide/,/^## /p' README.md | grep -o '^| [0-9]* |' | grep -o '[0-9]*' | sort -n | tr '\n' ' ')
[ -n "$code_sections" ] && [ "$code_sections" = "$guide_sections" ]
check reading_guide_matches_sections $? "nanovllm.cu has sections [$code_sections], the README guide [$guide_sections]"
map_sections=$(sed -n '/^\/\/ Contents/,/^$/p' nanovllm.cu | grep -o '^//  *[0-9]*\.' | grep -o '[0-9]*' | sort -n | tr '\n' ' ')
[ "$code_sections" = "$map_sections" ]
check file_map_matches_sections $? "the map at the top lists [$map_sections], banners are [$code_sections]"
opts=$(./nanovllm --help | sed -n 's/^ *NAME: //p')
[ -n "$opts" ]; check help_names_optimizations $? "--help lists no NAME: line"
missing=""
for o in $opts; do grep -q -- "\`$o\`" README.md || missing="$missing $o"; done
[ -z "$missing" ]; check readme_documents_every_optimization $? "not in README.md:$missing"
seq_line=$(grep -n '^struct Sequence ' nanovllm.cu | head -n1 | cut -d: -f1)
kernel_line=$(grep -n '__global__' nanovllm.cu | head -n1 | cut -d: -f1)
[ -n "$seq_line" ] && [ -n "$kernel_line" ] && [ "$seq_line" -lt "$kernel_line" ]
check sequence_before_first_kernel $? "struct Sequence at line $seq_line, first __global__ at line $kernel_line"
timings=$(grep -nE '//.*([0-9] ?(ms|us|tok/s|GB/s|TB/s|TFLOP/s)([^a-z]|$)|[0-9]%)' nanovllm.cu | grep -v '\[trace\]')
[ -z "$timings" ]; check no_timings_in_code_comments $? "timing figures in comments (they belong in the README):
$timings"
echo "RESULT passed=$passed failed=$failed skipped=0"
[ "$failed" -eq 0 ]
