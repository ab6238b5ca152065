#!/usr/bin/env bash
# suite: Part II can be cut out (STYLE.md: Part I and Part III never name anything Part II defines)
# build/cut/nanovllm.cu is nanovllm.cu less the lines from the PART II banner's first #### line up to the PART
# III banner's first ####; beside it tokenizer.h, safetensors.h and a copy of test/ (so "../../nanovllm.cu" of
# build/cut/test/host/X.cu is the cut file). The checks:
#   part1_no_fast_path_words       Part I names no inline PTX, tensor-core or FP8 word, comments included
#   part1_no_forward_declarations  Part I declares no function or struct that only Part II or III defines,
#                                  except the names on a Part I line "// observer interface: A, B"
#   cut_compiles, cut_help, cut_error_case   the cut ./nanovllm builds, prints its usage, refuses a bad run
#   cut_test_X                     each host suite of CUT_SUITES builds from the cut file and passes
# CPU only: the Makefile's nvcc flags, one architecture (CUT_GENCODE), CUT_JOBS compilers at a time; logs stay
# in build/cut/ (a failure shows their first errors or last 30 lines). Run from the repo root.
source "$(dirname "$0")/lib.sh"
CUT_SUITES=${CUT_SUITES:-"test_engine_core test_scheduler_stress test_simulate test_tp_control"}
CUT_GENCODE=${CUT_GENCODE:--gencode=arch=compute_80,code=sm_80}
CUT_JOBS=${CUT_JOBS:-2}
SRC=nanovllm.cu OUT=build/cut p_I= p_II= p_III=  # p_N: the line of the banner "// PART N — "
show_tail() { tail -n 30 "$1" | sed 's/^/    /'; }  # a log's last lines, indented under its FAIL line
errors() { grep -E ': error|undefined reference' "$1" | sed -E 's|^[^ (]*/||' | sort -u; }  # paths cut to names
show_errors() {  # the first compiler errors of a log with their source lines, else its last 30 lines
  if grep -q ': error' "$1"; then grep -A2 ': error' "$1" | grep -v '^--$' | head -n 30 | sed 's/^/    /'
  else show_tail "$1"; fi
}

# ---- a. the cut file ------------------------------------------------------------------------------------
# A banner is the line "// PART N — TITLE" with a line of #### above and below it.
for p in I II III; do
  n=$(grep -n "^// PART $p — " "$SRC" | cut -d: -f1)
  if [ "$(echo "$n" | wc -w)" != 1 ] ||
     [ "$(sed -n "$((n - 1))p;$((n + 1))p" "$SRC" | grep -cE '^// #{20,}$')" != 2 ]; then
    fail cut "$SRC needs exactly one banner '// PART $p — ...' with a '// ####' line above and below it"
    finish
  fi
  printf -v "p_$p" %s "$n"
done
if ! [ "$p_I" -lt "$p_II" ] || ! [ "$p_II" -lt "$p_III" ]; then
  fail cut "the PART banners are out of order: I at line $p_I, II at $p_II, III at $p_III"; finish
fi
rm -rf "$OUT" && mkdir -p "$OUT" && cp -r tokenizer.h safetensors.h test "$OUT/" ||
  { fail cut "cannot fill $OUT"; finish; }
# The #line directive keeps compiler messages about Part III on the line numbers of the real nanovllm.cu.
{ head -n $((p_II - 2)) "$SRC"; echo "#line $((p_III - 1)) \"$SRC\""; tail -n +$((p_III - 1)) "$SRC"; } \
  >"$OUT/nanovllm.cu"

# ---- b. Part I speaks no PTX, tensor-core or FP8 --------------------------------------------------------
# Whole words or the start of an identifier's part (mma_16816, fp8e4m3, cp_async_16, __asm__, use_mma), any
# case; "comma", "gamma", "plasma" and "mmap" are no hits: asm and mma must end the word (or add an s).
# One kind of Part I subsection may say FP8: a storage format Part I reads on the host (its banner "// ----
# TITLE (a storage format, read on the host) ----", up to the next "// ----" or "// ====" line), such as an
# FP8 checkpoint the loader dequantizes. It holds no GPU code: a __global__ or __device__ there is a hit.
words='(^|[^a-z0-9])(fp8|e4m3|ldmatrix|cp[._]?async|wgmma|griddepcontrol|(asm|mma)s?([^a-z]|$))'
host_format_lines=$(awk '/^\/\/ (----|====) /{inside = /\(a storage format, read on the host\)/} inside{print NR}' "$SRC" | tr '\n' ' ')
hits=$(grep -niE "$words" "$SRC" | awk -F: -v a="$p_I" -v b="$((p_II - 2))" -v ok="$host_format_lines" '
  BEGIN { n = split(ok, l, " "); for (i = 1; i <= n; i++) exempt[l[i]] = 1 }
  $1 >= a && $1 <= b && !($1 in exempt)' | sed "s|^|  $SRC:|")
gpu_code=$(grep -nE '__(global|device)__' "$SRC" | awk -F: -v ok="$host_format_lines" '
  BEGIN { n = split(ok, l, " "); for (i = 1; i <= n; i++) exempt[l[i]] = 1 } $1 in exempt' | sed "s|^|  $SRC:|")
hits=$(printf '%s\n%s' "$hits" "$gpu_code" | sed '/^$/d')
[ -z "$hits" ]; check part1_no_fast_path_words $? "$(echo "$hits" | wc -l) lines of Part I (lines \
$p_I-$((p_II - 2))) use Part II's words (inline PTX, tensor cores, FP8), or put GPU code in a subsection of a \
storage format read on the host; move them to Part II or reword:
$hits"

# ---- c. Part I declares nothing that only a later part defines ------------------------------------------
# A small scanner of each part's top level (brace depth 0) once comments, strings and preprocessor lines are
# blanked: a statement ending in ";" declares a function ("static T name(...);") or a struct ("struct Name;");
# the text before a "{" defines a function (it ends in ")") or a type ("struct Name"). Names are compared
# with their qualification: Scheduler::step is not step.
bad=$(python3 - "$SRC" "$p_I" "$p_II" "$p_III" <<'PY'
import re, sys
path, (p1, p2, p3) = sys.argv[1], map(int, sys.argv[2:])
raw = open(path, encoding="utf-8").read()
blank = lambda m: ('""' if m.group(0)[0] in "R\"'" else " ") + "\n" * m.group(0).count("\n")  # keeps lines
text = re.sub(r'R"([^(\s]*)\(.*?\)\1"|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|/\*.*?\*/',
              blank, raw, flags=re.S).split("\n")
cont = False
for i, l in enumerate(text):  # preprocessor lines and their continuations
    if cont or l.lstrip().startswith("#"): cont, text[i] = l.rstrip().endswith("\\"), ""
parts = {"I": (p1 - 1, p2 - 2), "II": (p2 - 2, p3 - 2), "III": (p3 - 2, len(text))}  # 0-based [first, last)
def func_name(s):  # "static int A::f(int x = g(1)) const" -> "A::f"; None unless s ends in a (...) group
    s = re.sub(r"(\s*\b(const|noexcept|override|final))+$", "", re.sub(r"\)\s*->[^()]*$", ")", s))
    if not s.endswith(")"): return None
    depth, i = 0, len(s) - 1
    while i >= 0:
        depth += {")": 1, "(": -1}.get(s[i], 0)
        if depth == 0: break
        i -= 1
    m = re.search(r"([A-Za-z_][\w:~]*) ?$", s[:max(i, 0)])  # a return type before it, no "=" (a variable)
    return m.group(1) if m and re.search(r"\w", s[:m.start()]) and "=" not in s[:m.start()] else None
def scan(first, last):  # -> [(kind, name, line)] at brace depth 0, kind "decl" or "def"
    out, stmt, start, depth, paren = [], "", None, 0, 0
    for ln in range(first, last):
        for ch in text[ln] + "\n":
            if depth > 0: depth += {"{": 1, "}": -1}.get(ch, 0); continue
            if start is None and not ch.isspace(): start = ln + 1
            paren += {"(": 1, ")": -1}.get(ch, 0)
            if not (ch == "{" and paren == 0 or ch == ";"): stmt += ch; continue
            s = re.sub(r"\b(__align__|alignas|__launch_bounds__)\s*\([^)]*\)", "", stmt)
            s = re.sub(r"\s+", " ", re.sub(r"template\s*<[^;{]*?>\s*(?=\w)", "", s)).strip()
            if ch == ";" and re.fullmatch(r"(struct|class) \w+", s): out.append(("decl", s.split()[1], start))
            elif ch == ";" and not re.match(r"(using|typedef|friend)\b", s) and func_name(s):
                out.append(("decl", func_name(s), start))
            elif ch == "{":
                s = re.sub(r"\)\s*:(?!:).*$", ")", s)  # a constructor's initialisers
                t = re.fullmatch(r"(?:\w+ )*(?:struct|class|union|enum(?: class)?) (\w+)(?: ?:[^=(]*)?", s)
                if t or func_name(s): out.append(("def", t.group(1) if t else func_name(s), start))
            depth, stmt, start = (1 if ch == "{" else 0), "", None
    return out
defined = {}  # name -> [(part, line)] of its definitions
for part, (a, b) in parts.items():
    for kind, name, line in scan(a, b):
        if kind == "def": defined.setdefault(name, []).append((part, line))
observers = {n.group(1) for m in (re.match(r"\s*//\s*observer interface:(.*)", l)  # the allowed names
             for l in raw.split("\n")[slice(*parts["I"])]) if m
             for n in (re.match(r"\s*([A-Za-z_][\w:]*)", x) for x in m.group(1).split(",")) if n}
for kind, name, line in scan(*parts["I"]):
    where = defined.get(name, [])
    if kind == "decl" and name not in observers and where and all(p != "I" for p, _ in where):
        print(f"  {path}:{line}: '{name}' is declared in Part I, defined only in Part {where[0][0]} "
              f"(line {where[0][1]})")
PY
) || bad="  the scanner (python3) failed"
[ -z "$bad" ]; check part1_no_forward_declarations $? "Part I declares what only a later part defines (a \
Part I line '// observer interface: A, B' allows those that Part III implements on purpose):
$bad"

# ---- d, e. build the cut ./nanovllm and the host suites, CUT_JOBS at a time -----------------------------
# NVCC, NVFLAGS and LDLIBS as the Makefile has them (LDLIBS runs tools/deps.sh for utf8proc's library).
flags=$(printf 'cut-flags:\n\t@echo "$(NVCC)|$(NVFLAGS)|$(LDLIBS)"\n' |
  env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make -s --no-print-directory -f Makefile -f - cut-flags) ||
  { fail cut_flags "cannot read NVCC, NVFLAGS and LDLIBS from the Makefile: $flags"; finish; }
IFS='|' read -r NVCC NVFLAGS LDLIBS <<<"$flags"
build() {  # build NAME SOURCE -> $OUT/NAME, its log $OUT/NAME.log, its exit status in $OUT/NAME.rc
  # shellcheck disable=SC2086  # the flags are word lists
  $NVCC $NVFLAGS $CUT_GENCODE -o "$OUT/$1" "$2" $LDLIBS >"$OUT/$1.log" 2>&1; echo $? >"$OUT/$1.rc"
}
for t in nanovllm $CUT_SUITES; do
  while [ "$(jobs -rp | wc -l)" -ge "$CUT_JOBS" ]; do wait -n; done
  if [ "$t" = nanovllm ]; then build nanovllm "$OUT/nanovllm.cu" & else build "$t" "$OUT/test/host/$t.cu" & fi
done
wait
built() { [ "$(cat "$OUT/$1.rc")" = 0 ]; }

if built nanovllm; then
  pass cut_compiles
  "$OUT/nanovllm" --help >"$OUT/help.out" 2>&1; rc=$?
  [ "$rc" = 0 ] && grep -q '^usage: nanovllm' "$OUT/help.out"
  check cut_help $? "--help exited $rc or printed no 'usage: nanovllm' line ($OUT/help.out):
$(show_tail "$OUT/help.out")"
  CUDA_VISIBLE_DEVICES= timeout 60 "$OUT/nanovllm" "$OUT/no-such-model" "$OUT/no-such-prompts.txt" \
    >"$OUT/error.out" 2>&1; rc=$?
  [ "$rc" != 0 ] && [ "$rc" != 124 ] && grep -q 'error' "$OUT/error.out"
  check cut_error_case $? "a missing model folder: exit status $rc, want non-zero and a message with \
'error' ($OUT/error.out):
$(show_tail "$OUT/error.out")"
else
  fail cut_compiles "nvcc failed on $OUT/nanovllm.cu, Part II cut out ($(errors "$OUT/nanovllm.log" | wc -l) \
errors in $OUT/nanovllm.log; the first):
$(show_errors "$OUT/nanovllm.log")"
  fail cut_help "not run: the cut ./nanovllm did not build"
  fail cut_error_case "not run: the cut ./nanovllm did not build"
fi

# A suite passes when it exits 0 and its RESULT line says failed=0 with at least one pass.
for t in $CUT_SUITES; do
  if ! built "$t"; then  # errors that cut_compiles shows already are not shown again
    if ! built nanovllm && [ -n "$(errors "$OUT/$t.log")" ] &&
       [ -z "$(comm -23 <(errors "$OUT/$t.log") <(errors "$OUT/nanovllm.log"))" ]; then
      fail "cut_$t" "nvcc failed with errors that cut_compiles shows ($OUT/$t.log)"; continue; fi
    fail "cut_$t" "nvcc failed on $OUT/test/host/$t.cu ($OUT/$t.log; the first errors):
$(show_errors "$OUT/$t.log")"; continue
  fi
  timeout 600 "$OUT/$t" >"$OUT/$t.out" 2>&1; rc=$?
  result=$(grep '^RESULT ' "$OUT/$t.out" | tail -n 1)
  [ "$rc" = 0 ] && echo "$result" | grep -qE 'passed=[1-9][0-9]* failed=0( |$)'
  check "cut_$t" $? "exit status $rc, ${result:-no RESULT line} ($OUT/$t.out ends):
$(show_tail "$OUT/$t.out")"
done
finish
