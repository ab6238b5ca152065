#!/usr/bin/env bash
# suite: docs stay true to the code
# Every flag and every optimization name that `nanovllm --help` lists appears in README.md; every section of
# the README's reading guide exists as a banner "// ==== N. " in nanovllm.cu (and the other way round); the
# host concepts come before the kernels (struct Sequence before the first __global__); no comment of
# nanovllm.cu carries a timing (ms, us, tok/s, GB/s, TFLOP/s, a percentage): those live in docs/; every
# section banner has a "// defines:" line in its comment block; every "section N" a comment names exists; and
# the contents table at the top lists the banners' numbers, titles and PART lines in the file's order.
# Then the front matter's claims (issue 44): the README is a front door (at most 600 lines, the two commands
# in its first 40, the reading guide before line 200) that links every docs/*.md, and the links of the
# README, docs/ and test/README.md resolve (files and #headings); every name on a "// defines:" line exists;
# every `--opt LIST` the README or docs/ shows names registered optimizations; every CPU reference comes
# before the kernels and launcher it checks; and every "section N's NAME" or "NAME (section N)" in the code,
# the docs, test/ and bench.sh names something section N defines (with a self-check on a file it must fault).
# Each rule is spelled out above its check.
cd "$(dirname "$0")/../.."
helper=$(mktemp)
trap 'rm -f "$helper"' EXIT
cat >"$helper" <<'PY'
import re, sys, os, glob

def strip_code(text):
    """Comments become spaces and string/char literals become "" / '', line breaks kept (line numbers hold)."""
    def repl(m):
        s = m.group(0)
        if s.startswith("//") or s.startswith("/*"):
            return re.sub(r"[^\n]", " ", s)
        q = s[0]
        return q + re.sub(r"[^\n]", " ", s[1:-1]) + q
    return re.sub(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', repl, text, flags=re.S)

KEYWORDS = {"return", "else", "case", "goto", "new", "delete", "throw", "sizeof", "do", "co_return", "if",
            "while", "for", "switch", "alignof", "decltype", "typeid", "static_assert", "not", "and", "or"}

def declared_names(code):
    """Identifiers the code declares: macros, types, aliases, enumerators, and declarators (a name right after
    a type: functions, variables, members, parameters). Lenient on purpose: it answers 'does NAME exist'."""
    names = set(re.findall(r"^[ \t]*#[ \t]*define[ \t]+(\w+)", code, re.M))
    names |= set(re.findall(r"\b(?:struct|class|union|enum(?:\s+class)?|namespace)\s+(\w+)", code))
    names |= set(re.findall(r"\busing\s+(\w+)\s*=", code))
    names |= set(re.findall(r"\btypedef\b[^;]*?\b(\w+)\s*;", code))
    names |= set(re.findall(r"\(\s*\*\s*(\w+)\s*\)\s*\(", code))              # function pointers
    for body in re.findall(r"\benum\b[^{;]*\{([^}]*)\}", code):              # enumerators
        names |= set(re.findall(r"(?:^|,)\s*(\w+)", body))
    code = re.sub(r"__launch_bounds__\s*\([^)]*\)", " ", code)
    for m in re.finditer(r"([\w>\*&\]])\s*[\*&]*\s*\b([A-Za-z_]\w*)\s*(?:\(|=(?!=)|;|\[|\{|,|:(?!:))", code):
        before = code[max(0, m.start(2) - 256):m.start(2)].rstrip(" \t\n*&")
        prev = re.search(r"(\w+)$", before)
        if prev and prev.group(1) not in KEYWORDS and not prev.group(1).isdigit():
            names.add(m.group(2))
        elif before.endswith(">"):
            names.add(m.group(2))
    for m in re.finditer(r"\boperator\s*([^\s(]+)\s*\(", code):
        names.add("operator" + m.group(1))
    return names

def body_of(code, name):
    m = re.search(r"\b(?:struct|class|union)\s+" + re.escape(name) + r"\b[^;{]*\{", code)
    if not m:
        return None
    depth, i = 1, m.end()
    while i < len(code) and depth:
        depth += {"{": 1, "}": -1}.get(code[i], 0)
        i += 1
    return code[m.end():i - 1]

def registered_switches(src):
    return re.findall(r'register_optimization\(\s*\{\s*"(\w+)"', src)

IDENT = r"(?:operator\s*\S+|[A-Za-z_]\w*(?:::[A-Za-z_~]\w*)*)"

def split_top(s, seps):
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch in seps and depth == 0:
            out.append(cur); cur = ""
        else:
            cur += ch
    out.append(cur)
    return [x.strip() for x in out]

def defines_entries(path):
    """(line, text, include match) of each '// defines:' line with its continuation lines ('//' then at least
    4 spaces)."""
    return defines_entries_of(open(path, encoding="utf-8").read().split("\n"))

def defines_entries_of(lines):
    out = []
    for i, l in enumerate(lines):
        m = re.search(r"//\s*defines:\s*(.*)$", l)
        if not m:
            continue
        text, j = m.group(1), i + 1
        if l.lstrip().startswith("//"):
            while j < len(lines) and re.match(r"//\s{4,}\S", lines[j]):
                text += " " + lines[j][2:].strip(); j += 1
        out.append((i + 1, text, re.match(r'\s*#\s*include\s*([<"])([^>"]+)[>"]', l)))
    return out

def check_defines(root):
    bad = []
    src_path = os.path.join(root, "nanovllm.cu")
    headers = sorted(set(re.findall(r'#\s*include\s*"([^"]+)"', open(src_path).read())))
    files = ["nanovllm.cu"] + [h for h in headers if os.path.exists(os.path.join(root, h))]
    codes = {f: strip_code(open(os.path.join(root, f), encoding="utf-8").read()) for f in files}
    decl = {f: declared_names(c) for f, c in codes.items()}
    switches = set(registered_switches(open(src_path).read()))
    flags = set(re.findall(r'"(--[a-z][a-z-]*)', open(src_path).read()))
    for f in files:
        for line, text, inc in defines_entries(os.path.join(root, f)):
            if inc and inc.group(1) == "<":
                continue  # a system header's names: not this repository's to check
            where = inc.group(2) if inc else f
            if where not in codes:
                bad.append(f"  {f}:{line}: names {where}, which is not in the repository"); continue
            code, names = codes[where], decl[where]
            def exists(n):
                if n.startswith("operator"):
                    return re.sub(r"\s", "", n) in {re.sub(r"\s", "", x) for x in names}
                if "::" in n:
                    outer, inner = n.rsplit("::", 1)
                    b = body_of(code, outer.split("::")[-1])
                    return (b is not None and inner in declared_names(b)) or \
                        re.search(re.escape(outer) + r"\s*::\s*" + re.escape(inner) + r"\b", code) is not None
                return n in names
            def item_list(s, owner=None):
                for clause in split_top(s, ";"):
                    in_switches = False
                    for item in split_top(clause, ","):
                        if not item:
                            continue
                        m = re.match(r"(switch(?:es)?)\s+(.*)$", item)
                        if m:
                            in_switches, item = True, m.group(2).strip()
                        paren = None
                        pm = re.match(r"(.*?)\s*\((.*)\)\s*$", item)
                        if pm:
                            item, paren = pm.group(1).strip(), pm.group(2)
                        if item.startswith("--"):
                            flag = item.split()[0]
                            if flag not in flags:
                                bad.append(f"  {f}:{line}: {flag} is no flag of nanovllm.cu")
                        elif re.fullmatch(IDENT, item):
                            if in_switches:
                                if item not in switches:
                                    bad.append(f"  {f}:{line}: switch {item} is not registered "
                                               f"(register_optimization names: {', '.join(sorted(switches))})")
                            elif owner:
                                b = body_of(code, owner)
                                if item not in declared_names(b):
                                    bad.append(f"  {f}:{line}: {owner} has no member {item}")
                            elif not exists(item):
                                bad.append(f"  {f}:{line}: {item} is declared nowhere in {where}")
                        else:
                            in_switches = False  # prose ("and their CPU references", "registered in 18")
                        if paren is not None:
                            parts = split_top(paren, ",;")
                            if (not in_switches and re.fullmatch(IDENT, item or "")
                                    and body_of(code, item) is not None
                                    and all(re.fullmatch(IDENT, p) for p in parts)):
                                item_list(paren, owner=item)
                            else:
                                item_list(paren)  # prose, or a nested "switch NAME"
            item_list(text)
    return bad

def check_opt_mentions(root, docs):
    src = open(os.path.join(root, "nanovllm.cu")).read()
    ok = set(registered_switches(src)) | {"all", "none"}
    bad = []
    for d in docs:
        for n, l in enumerate(open(os.path.join(root, d), encoding="utf-8").read().split("\n"), 1):
            for m in re.finditer(r"--opt(?:=|\s+)([A-Za-z0-9_,+-]+)", l):
                for item in m.group(1).split(","):
                    name = item.lstrip("+-")
                    if not name or re.fullmatch(r"[A-Z][A-Z_]*", name):
                        continue  # a placeholder: NAME, LIST
                    if name not in ok:
                        bad.append(f"  {d}:{n}: --opt {m.group(1)}: '{name}' is no registered optimization")
    return bad

def check_references(root):
    raw = open(os.path.join(root, "nanovllm.cu"), encoding="utf-8").read()
    code = strip_code(raw)
    lines = code.split("\n")
    banners = [(i + 1, m.group(1)) for i, l in enumerate(raw.split("\n"))
               for m in [re.match(r"// ==== (\d+)\. ", l)] if m]
    def section(line):
        s = None
        for at, n in banners:
            if at <= line:
                s = n
        return s
    def line_of(pos):
        return code.count("\n", 0, pos) + 1
    kernels = []  # (line, base name without _kernel)
    c2 = re.sub(r"__launch_bounds__\s*\([^)]*\)", lambda m: re.sub(r"[^\n]", " ", m.group(0)), code)
    for m in re.finditer(r"__global__\b[^;{(]*?\b(\w+)\s*\(", c2):
        name = m.group(1)
        kernels.append((line_of(m.start()), name[:-len("_kernel")] if name.endswith("_kernel") else name, name))
    def host_definitions(name):
        out = []
        for m in re.finditer(r"^[A-Za-z][^\n;{}()=]*?\b" + re.escape(name) + r"\s*\(", code, re.M):
            if "__global__" in m.group(0) or "__device__" in m.group(0):
                continue
            i, depth = m.end() - 1, 0
            while i < len(code):
                ch = code[i]
                depth += (ch == "(") - (ch == ")")
                if depth == 0 and ch in ";{":
                    break
                i += 1
            if i < len(code) and code[i] == "{":
                out.append(line_of(m.start()))
        return out
    bad, checked = [], []
    for m in re.finditer(r"^static\b[^\n(]*?\b(\w+)_reference\s*\(", code, re.M):
        x, rline = m.group(1), line_of(m.start())
        sec = section(rline)
        words = x.split("_")
        fam = []
        for kline, base, kname in kernels:
            b = base.split("_")
            contains = any(b[i:i + len(words)] == words for i in range(len(b) - len(words) + 1))
            if section(kline) == sec and (contains or words[:len(b)] == b):
                fam.append((kline, kname))
        fam += [(hl, x) for hl in host_definitions(x) if section(hl) == sec]
        if not fam:
            continue
        checked.append(x)
        before = sorted(f for f in fam if f[0] < rline)
        if before:
            bad.append(f"  nanovllm.cu:{rline}: {x}_reference (section {sec}) comes after "
                       + ", ".join(f"{n} (line {l})" for l, n in before))
    return bad, checked

def slug(h):
    h = re.sub(r"`", "", h.strip().lower())
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")

def anchors(path):
    out, counts, fence = set(), {}, False
    for l in open(path, encoding="utf-8"):
        if l.startswith("```"):
            fence = not fence
        if fence:
            continue
        m = re.match(r"#{1,6}\s+(.*)", l)
        if m:
            s = slug(m.group(1))
            k = counts.get(s, 0); counts[s] = k + 1
            out.add(s if k == 0 else f"{s}-{k}")
    return out

def check_links(root, docs):
    bad = []
    for d in docs:
        path = os.path.join(root, d)
        fence = False
        for n, l in enumerate(open(path, encoding="utf-8").read().split("\n"), 1):
            if l.startswith("```"):
                fence = not fence
            if fence:
                continue
            for m in re.finditer(r"\]\(([^)\s]+)\)", l):
                target = m.group(1)
                if re.match(r"[a-z]+:", target):
                    continue
                file, _, anchor = target.partition("#")
                tpath = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
                if not os.path.exists(tpath):
                    bad.append(f"  {d}:{n}: {target}: no file {os.path.relpath(tpath, root)}")
                elif anchor and tpath.endswith(".md") and anchor not in anchors(tpath):
                    bad.append(f"  {d}:{n}: {target}: no heading #{anchor} in {os.path.relpath(tpath, root)}")
    return bad

SECTION_REF = r"[Ss]ections?\s+(\d+[a-z]?(?:\s*(?:-|–|,|and|or|to)\s*\d+[a-z]?)*)\b"
CODE_FILES = (".cu", ".h", ".cpp", ".cuh")

def section_spans(raw_lines):
    """{section number: (first line, last line)} of nanovllm.cu: a banner "// ==== N. " to the line before the
    next banner or PART line (subsections "// ---- Na. " are part of their section)."""
    starts = []
    for i, l in enumerate(raw_lines, 1):
        m = re.match(r"// ==== (\d+)\. ", l)
        if m:
            starts.append((i, m.group(1)))
        elif re.match(r"// PART [IVX]+ ", l):
            starts.append((i, None))
    spans = {}
    for k, (at, n) in enumerate(starts):
        if n is not None:
            spans[n] = (at, (starts[k + 1][0] - 1) if k + 1 < len(starts) else len(raw_lines))
    return spans

def section_names(root):
    """({section: names on its "// defines:" lines and the switches it registers}, {section: those and every
    name declared in its text (declared_names: lenient, members and parameters included)}, Part III's
    sections)."""
    raw = open(os.path.join(root, "nanovllm.cu"), encoding="utf-8").read()
    raw_lines, code_lines = raw.split("\n"), strip_code(raw).split("\n")
    listed, declared = {}, {}
    part3_at = next((i for i, l in enumerate(raw_lines, 1) if re.match(r"// PART III ", l)), len(raw_lines) + 1)
    spans = section_spans(raw_lines)
    for n, (a, b) in spans.items():
        text = "\n".join(raw_lines[a - 1:b])
        lst = set()
        for _, d, inc in defines_entries_of(raw_lines[a - 1:b]):
            if not inc:
                lst |= set(re.findall(r"[A-Za-z_]\w*", d))
        lst |= set(registered_switches(text))
        listed[n] = lst
        declared[n] = declared_names("\n".join(code_lines[a - 1:b])) | lst
    return listed, declared, {n for n, (a, _) in spans.items() if a > part3_at}

def expand(refs):
    """'24-27' -> 24..27, '6c' -> 6, '15 and 16' -> 15, 16: the top-level sections a reference spans."""
    out, items = set(), re.findall(r"\d+[a-z]?|-|–|to", refs)
    k = 0
    while k < len(items):
        a = int(re.match(r"\d+", items[k]).group(0))
        if k + 2 < len(items) and items[k + 1] in ("-", "–", "to"):
            b = int(re.match(r"\d+", items[k + 2]).group(0))
            out |= {str(x) for x in range(a, b + 1)}; k += 3
        else:
            out.add(str(a)); k += 1
    return out

def scan_text(path):
    """The file's prose as one string and, for each character, its line: in C++ files the comments (a line
    without one breaks the text with "|"), elsewhere every line less a leading "#" or "//"; a blank line
    breaks it too."""
    text, at, in_defines = [], [], False
    for n, l in enumerate(open(path, encoding="utf-8", errors="replace").read().split("\n"), 1):
        if path.endswith(CODE_FILES):
            code = re.sub(r'"(?:\\.|[^"\\])*"', '""', l)
            c = code[code.index("//") + 2:] if "//" in code else "|"
            # a "// defines:" line and its continuation lines: defines_names_exist checks those
            in_defines = bool(re.match(r"\s*defines:", c)) or (in_defines and bool(re.match(r"\s{4,}\S", c)))
            if in_defines:
                c = "|"
        else:
            c = re.sub(r"^\s*(#+|//)", "", l) if l.strip() else "|"
        text.append(c + " "); at += [n] * (len(c) + 1)
    return "".join(text), at

NAME = r"`?(?<![\w./\-])([A-Za-z_]\w*(?:::~?\w+)*)(?:\(\))?`?"

def claims(text):
    """(position, name, sections text, backticked) for "section N's NAME" and "NAME (section N" / "NAME, section N"."""
    for m in re.finditer(SECTION_REF + r"'s\s+" + NAME, text):
        yield m.start(), m.end(), m.group(2), m.group(1), text[m.start(2) - 1] == "`"
    for m in re.finditer(NAME + r"\s*(?:\(\s*(?:in\s+)?|,\s+)" + SECTION_REF + r"(?!'s)", text):
        yield m.start(), m.end(), m.group(1), m.group(2), text[m.start(1) - 1] == "`"
    for m in re.finditer(SECTION_REF + r"(?:\s*\(\s*|,\s+)" + NAME, text):
        yield m.start(), m.end(), m.group(2), m.group(1), text[m.start(2) - 1] == "`"

def check_claims(root, files):
    listed, declared, part3_sections = section_names(root)
    code = strip_code(open(os.path.join(root, "nanovllm.cu"), encoding="utf-8").read())
    types = set(re.findall(r"\b(?:struct|class|union|enum(?:\s+class)?)\s+(\w+)", code))
    types |= set(re.findall(r"\busing\s+(\w+)\s*=", code))
    allnames = set().union(*declared.values())
    bad = []
    for f in files:
        text, at = scan_text(os.path.join(root, f))
        seen = set()
        for pos, end, name, refs, ticked in claims(text):
            base = name.split("::")[0]
            code_like = ticked or "_" in base or "::" in name or re.search(r"[a-z][A-Z]", base) or base in types
            if not code_like or base not in allnames or (pos, name) in seen:
                continue  # prose ("section 8's kernel"), or a name nanovllm.cu does not define (nano-vllm's)
            seen.add((pos, name))
            secs = expand(refs)
            if any(base in declared.get(s, ()) for s in secs):
                if os.environ.get("CLAIMS_VERBOSE"):
                    print(f"  ok {f}:{at[pos]}: {' '.join(text[pos:end].split())}", file=sys.stderr)
                continue
            home = sorted((s for s in listed if base in listed[s]), key=int) or \
                sorted((s for s in declared if base in declared[s]), key=int)
            where = ("defined in section " + ", ".join(home[:6]) + (" ..." if len(home) > 6 else "")) if home \
                else "defined in no section"
            part3 = " [Part III]" if any(s in part3_sections for s in secs | set(home)) else ""
            claim = " ".join(text[pos:end].split())
            bad.append(f"  {f}:{at[pos]}: '{claim}': {name} is not in section {' '.join(refs.split())}; "
                       f"{where}{part3}")
    return bad

if __name__ == "__main__":
    what, root = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else ".")
    docs = ["README.md"] + sorted(glob.glob("docs/*.md"))
    if what == "defines":
        print("\n".join(check_defines(root)))
    elif what == "opt":
        print("\n".join(check_opt_mentions(root, docs)))
    elif what == "refs":
        print("\n".join(check_references(root)[0]))
    elif what == "links":
        print("\n".join(check_links(root, docs + ["test/README.md"])))
    elif what == "claims":
        files = sys.argv[3:] if len(sys.argv) > 3 else \
            ["nanovllm.cu", "tokenizer.h", "safetensors.h", "bench.sh"] + docs + sorted(
                f for f in glob.glob("test/**/*", recursive=True)
                if f.endswith((".cu", ".h", ".cpp", ".sh", ".md", ".py")))
        print("\n".join(check_claims(root, files)))
PY
BIN=${NANOVLLM_BIN:-./nanovllm}  # make test on a CPU-only machine: build/nanovllm
passed=0 failed=0 skipped=0
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
[ -z "$timings" ]; check no_timings_in_code_comments $? "timing figures in comments (they belong in docs/performance.md):
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
# The README is the front door (STYLE.md): at most 600 lines, the run and test commands within its first 40
# lines, the reading guide (a code reader's first need) before line 200, and a link to every docs/*.md.
readme_lines=$(wc -l <README.md)
[ "$readme_lines" -le 600 ]; check readme_at_most_600_lines $? "README.md has $readme_lines lines"
head -n 40 README.md | grep -q 'make && ./nanovllm ' && head -n 40 README.md | grep -qE '^make test( |$)'
check readme_two_commands_first $? "'make && ./nanovllm ...' and 'make test' are not both in README.md's first 40 lines"
guide_at=$(grep -n '^## Reading guide' README.md | head -n1 | cut -d: -f1)
[ -n "$guide_at" ] && [ "$guide_at" -lt 200 ]
check reading_guide_before_line_200 $? "'## Reading guide' is at line ${guide_at:-none}"
unlinked=""
for d in docs/*.md; do grep -q "](${d}" README.md || unlinked="$unlinked $d"; done
[ -z "$unlinked" ]; check readme_links_every_doc $? "README.md does not link:$unlinked"

# Relative links of README.md, docs/*.md and test/README.md ([text](path#anchor), outside code fences): the
# file exists, and an #anchor into a .md file is one of its headings as GitHub spells it (lower case,
# punctuation dropped, spaces to hyphens, -1, -2, ... for repeats).
broken=$(python3 "$helper" links) || broken="  the scanner (python3) failed"
[ -z "$broken" ]; check doc_links_resolve $? "links that lead nowhere:
$broken"

# Each name on a "// defines:" line exists (issue 44). The line runs on over the comment lines below it that
# start with "//" and at least four spaces. Its items are separated by "," and ";"; an item that is one C++
# name (Foo, Foo::bar, operator==) must be declared in the file: a macro, struct/class/union/enum, alias,
# enumerator, or a name right after a type (a function, variable, member, parameter); "Foo (a, b)" with Foo a
# struct or class means a and b are its members; after "switch" or "switches", the names up to the next ";"
# are --opt switches and must be register_optimization's; an item "--flag ..." must be a flag the file parses;
# an item of several words is prose and is skipped. A defines line on `#include "h"` is checked against h; one
# on `#include <h>` (a system header) is not checked.
undefined_names=$(python3 "$helper" defines) || undefined_names="  the scanner (python3) failed"
[ -z "$undefined_names" ]; check defines_names_exist $? "names on '// defines:' lines that do not exist:
$undefined_names"

# Each `--opt LIST` (or --opt=LIST) in README.md and docs/*.md names registered optimizations: every item,
# its +/- sign dropped, is a register_optimization name, or all or none (what Part III's parse_optimizations
# accepts); upper-case placeholders (NAME, LIST) are skipped.
bad_opts=$(python3 "$helper" opt) || bad_opts="  the scanner (python3) failed"
[ -z "$bad_opts" ]; check docs_opt_names_registered $? "--opt names that are not registered:
$bad_opts"

# The header says Part I's kernels come "each after the CPU code it must agree with". The CPU code of X is a
# host function `static ... X_reference(` at the start of a line. Its GPU code is, in the same section
# ("// ==== N." to the next), every __global__ kernel whose name less "_kernel" contains X's words in order
# (apply_logit_edits_kernel for logit_edits) or is a leading part of them (sample_kernel for
# sample_kept_reference), and the host function named X where it is defined (a body, not the forward
# declaration of section 6c). The reference must start before each of them.
late_refs=$(python3 "$helper" refs) || late_refs="  the scanner (python3) failed"
[ -z "$late_refs" ]; check references_precede_their_kernels $? "CPU references after the GPU code they check:
$late_refs"
# References say what they point to (STYLE.md). A claim is "section N's NAME", "NAME (section N", "NAME, section
# N", "section N (NAME" or "section N, NAME" (N also "Na", "N-M", "N and M"; "Section" too), in the prose of
# nanovllm.cu, tokenizer.h, safetensors.h, bench.sh, README.md, docs/*.md and test/** (comments in C++ files,
# whole lines elsewhere; a reference may run onto the next line). NAME is checked when it looks like code (in
# backticks, or with an underscore, "::" or an inner capital, or a struct/class/enum/alias name) and
# nanovllm.cu declares it somewhere (not prose like "section 8's kernel", nor a name of nano-vllm's): one of
# the sections cited (Na counts as its section N, a range as each section in it) must define it: its
# "// defines:" lines, the switches it registers, or any name declared between its banner and the next
# top-level banner (a function, type, variable, member, parameter or macro). "// defines:" lines themselves
# are defines_names_exist's. Each violation prints file:line, the claim, and the sections that define NAME
# ([Part III] where the cited or defining section is in Part III).
bad_claims=$(python3 "$helper" claims) || bad_claims="  the scanner (python3) failed"
[ -z "$bad_claims" ]; check section_claims_name_what_the_section_defines $? "references to sections that do
not define the name they cite:
$bad_claims"
# The same scanner on a file it must fault: two sections and four claims, two of them wrong.
fake=$(mktemp -d)
s=section  # (spelled apart so that this file holds no claim of its own)
printf '// ==== 1. One ===\n// defines: alpha_fn\nstatic void alpha_fn() {}\n// ==== 2. Two ===\n// defines: %s\n%s\n' \
  'BetaTable' 'struct BetaTable { int beta_rows; };' >"$fake/nanovllm.cu"
printf 'Right: %s 1'"'"'s alpha_fn and `BetaTable` (%s 2).\nWrong: %s 2'"'"'s alpha_fn,\nand beta_rows (%s 1).\n' \
  "$s" "$s" "$s" "$s" >"$fake/claims.md"
got=$(python3 "$helper" claims "$fake" claims.md)
rm -rf "$fake"
[ "$(echo "$got" | grep -c .)" = 2 ] && echo "$got" | grep -q "claims.md:2: .*alpha_fn is not in $s 2; defined in $s 1" &&
  echo "$got" | grep -q "claims.md:3: .*beta_rows is not in $s 1; defined in $s 2"
check section_claims_checker_faults_a_bad_claim $? "on two wrong claims and two right ones it printed:
${got:-  nothing}"
echo "RESULT passed=$passed failed=$failed skipped=$skipped"
[ "$failed" -eq 0 ]
