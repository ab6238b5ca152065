#!/usr/bin/env bash
# suite: docs stay true to the code
# Every flag and every optimization name that `nanovllm --help` lists appears in README.md; every section of
# the README's reading guide exists as a banner "// ==== N. " in nanovllm.cu (and the other way round); the
# host concepts come before the kernels (struct Sequence before the first __global__); no comment of
# nanovllm.cu carries a timing (ms, us, tok/s, GB/s, TFLOP/s, a percentage): those live in the README; every
# section banner has a "// defines:" line in its comment block; every "section N" a comment names exists; and
# the contents table at the top lists the banners' numbers, titles and PART lines in the file's order.
cd "$(dirname "$0")/../.."
BIN=${NANOVLLM_BIN:-./nanovllm}  # make test on a CPU-only machine: build/nanovllm
passed=0 failed=0
check() {  # check NAME CONDITION_EXIT_CODE MESSAGE
  if [ "$2" -eq 0 ]; then echo "PASS $1"; passed=$((passed + 1)); else echo "FAIL $1: $3"; failed=$((failed + 1)); fi
}
flags=$("$BIN" --help | grep -o -- '--[a-z][a-z-]*' | sort -u)
[ -n "$flags" ]; check help_lists_flags $? "$BIN --help printed no flags"
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
opts=$("$BIN" --help | sed -n 's/^ *NAME: //p')
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

# The comment block right under each "// ==== N. " banner (its "//" lines up to the first other line) holds a
# line "// defines: ...", the names the section introduces (STYLE.md).
undefined=$(awk '
  function close_block() { if (open && !found) print "  nanovllm.cu:" at ": " title; open = 0 }
  /^\/\/ ==== [0-9]+\. / { close_block(); open = 1; found = 0; at = NR; title = $0; next }
  open && /^\/\/ defines:/ { found = 1 }
  open && !/^\/\// { close_block() }
  END { close_block() }' nanovllm.cu | sed -E 's/ =+$//')
[ -z "$undefined" ]; check defines_line_under_every_banner $? "no '// defines:' line in the comment block under:
$undefined"

# "section 7", "Section 9b's", "sections 7-10 and 12", "sections 6b-8" in comments (a reference may run onto
# the next comment line): N must be a section banner "// ==== N. "; Na a subsection banner "// ---- Na. ", or
# when there is none, N a section; a range needs both ends.
badrefs=$(python3 - nanovllm.cu <<'PY'
import re, sys
lines = open(sys.argv[1], encoding="utf-8").read().split("\n")
sections = {m.group(1) for l in lines for m in [re.match(r"// ==== (\d+)\. ", l)] if m}
subsections = {m.group(1) for l in lines for m in [re.match(r"// ---- (\d+[a-z])\. ", l)] if m}
text, at = "", []  # the comments joined by spaces ("|" for a line without one); at[i]: line of text[i]
for n, l in enumerate(lines, 1):
    code = re.sub(r'"(?:\\.|[^"\\])*"', '""', l)  # a "//" inside a string starts no comment
    c = code[code.index("//") + 2:] if "//" in code else "|"
    text += c + " "; at += [n] * (len(c) + 1)
N = r"\d+[a-z]?\b"
def exists(ref):
    return ref in sections or ref in subsections or (ref[-1].isalpha() and ref[:-1] in sections)
for m in re.finditer(rf"\b(?:[Ss]ection\s+{N}|[Ss]ections\s+{N}(?:\s*(?:-|–|,|and|or|to)\s*{N})*)", text):
    refs = re.findall(N, m.group(0))
    missing = [r for r in refs if not exists(r)]
    if missing:
        print(f"  nanovllm.cu:{at[m.start()]}: '{' '.join(m.group(0).split())}' names no section "
              f"{', '.join(missing)}")
PY
) || badrefs="  the scanner (python3) failed"
[ -z "$badrefs" ]; check section_references_exist $? "comments name sections that do not exist:
$badrefs"

# The contents table (from "// Contents" to the first blank line) against the file's banners, in order:
# "N. Title" for each "// ==== N. Title ====" (padding dropped) and "PART II" for each "// PART II — ".
table=$(sed -n '/^\/\/ Contents/,/^$/p' nanovllm.cu | sed -nE 's/^\/\/ +([0-9]+\. .*[^ ]) *$/\1/p;
  s/^\/\/ +(PART [IVX]+) .*/\1/p')
banners=$(sed -nE 's/^\/\/ ==== ([0-9]+\. .*[^ =])[ =]*$/\1/p; s/^\/\/ (PART [IVX]+) — .*/\1/p' nanovllm.cu)
diff=$(diff -U1 <(echo "$table") <(echo "$banners") | tail -n +3 | sed 's/^@@.*/  .../; s/^/  /')
[ -n "$table" ] && [ -z "$diff" ]
check contents_table_matches_banners $? "the contents table and the banners differ (- only in the table, \
+ only in the banners, in file order):
${diff:-  the table is empty}"
echo "RESULT passed=$passed failed=$failed skipped=0"
[ "$failed" -eq 0 ]
