#!/usr/bin/env bash
# suite: docs stay true to the code
# Every flag that `nanovllm --help` lists appears in README.md, and every section of the README's reading
# guide exists as a banner "// ==== N. " in nanovllm.cu (and the other way round).
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
echo "RESULT passed=$passed failed=$failed skipped=0"
[ "$failed" -eq 0 ]
