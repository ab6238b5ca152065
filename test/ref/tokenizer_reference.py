#!/usr/bin/env python3
"""Make the tokenizer reference with Hugging Face `tokenizers` (the Rust library) and `transformers`.

Run where those are installed (the GPU machine: tokenizers 0.23.2, transformers 5.17, no network):

    python3 tokenizer_reference.py TOKENIZER_DIR OUT_DIR reference    -> OUT_DIR/tokenizer_reference.jsonl
    python3 tokenizer_reference.py TOKENIZER_DIR OUT_DIR unicode      -> OUT_DIR/tokenizer_unicode.json
    python3 tokenizer_reference.py TOKENIZER_DIR OUT_DIR bench [NANOVLLM_BINARY]

TOKENIZER_DIR holds tokenizer.json and tokenizer_config.json (tools/fetch_tokenizer.sh gets them). The
outputs are committed as test/ref/data/*; the C++ test (test/host/test_tokenizer.cu) checks nanovllm against them.

reference: every corpus case of tokenizer_corpus.py -> ids, the NFC text and the decoded text; random id
  sequences -> decoded text (byte tokens that do not form UTF-8 included); chat conversations -> the
  rendered prompt and its ids from transformers' apply_chat_template.
unicode: how the library itself classifies every code point, by probing its pre-tokenizer and normalizer
  (which Unicode tables it was built with is not documented): the split regex's class of each code point
  (\\p{L}, \\p{N}, \\s or other), which letters the case-insensitive contractions accept, and NFC/NFD of
  each code point plus whether it is a non-starter (canonical combining class > 0).
bench: encoding speed on one thread, HF against `nanovllm encode`, on the same text.
"""
import json
import os
import random
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tokenizers import Tokenizer, normalizers  # noqa: E402


def load(tok_dir):
    return Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))


def byte_token_ids(tok):
    """id of the one-byte token for each byte value (GPT-2's bytes_to_unicode alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_to_char = dict(zip(bs, (chr(c) for c in cs)))
    return [tok.token_to_id(byte_to_char[b]) for b in range(256)]


# ---- reference ---------------------------------------------------------------------------------------------
CHATS = [
    ("user_only", [{"role": "user", "content": "Hello!"}]),
    ("system_user", [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "What is 2+2?"}]),
    ("system_only", [{"role": "system", "content": "Be brief."}]),
    ("multi_turn_think", [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."}]),
    ("last_assistant_think", [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nr1\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "<think>\nr2\n</think>\n\nA2"}]),
    ("assistant_after_last_user_no_think", [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "partial answer without think"}]),
    ("two_assistants_after_user", [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "<think>\nfirst\n</think>\n\nA"},
        {"role": "assistant", "content": "<think>\n\n</think>\n\nB"},
        {"role": "assistant", "content": "no think at all"}]),
    ("think_edge_cases", [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "\n\n<think>\n\n a \n b \n\n</think>\n\n\n c </think>\n\n d\n"},
        {"role": "user", "content": "y"},
        {"role": "assistant", "content": "pre<think>inner</think>post"},
        {"role": "assistant", "content": "<think>unclosed"}]),
    ("system_not_first", [
        {"role": "user", "content": "a"},
        {"role": "system", "content": "late system"},
        {"role": "user", "content": "b"}]),
    ("tool_response_user", [
        {"role": "user", "content": "real question"},
        {"role": "assistant", "content": "<think>\nplan\n</think>\n\ncalling"},
        {"role": "user", "content": "<tool_response>\n{\"x\": 1}\n</tool_response>"},
        {"role": "assistant", "content": "<think>\nlook\n</think>\n\nresult"}]),
    ("assistant_first", [
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nI start."},
        {"role": "user", "content": "ok"}]),
    ("empty_contents", [
        {"role": "system", "content": ""},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": ""}]),
    ("unicode_content", [
        {"role": "system", "content": "Réponds en français. 用中文回答。"},
        {"role": "user", "content": "Ça va? 👍🏽 e\u0301 <|im_end|> inside"},
        {"role": "assistant", "content": "<think>\nPensons… 思考\n</think>\n\nOui ! ✅"},
        {"role": "user", "content": "Merci\r\n\tbye  "}]),
    ("newlines_in_content", [
        {"role": "user", "content": "\n\nleading and trailing\n\n"},
        {"role": "assistant", "content": "\n</think>\n\nonly a close tag"},
        {"role": "user", "content": "z"}]),
]


def chat_reference(tok_dir, tok):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(tok_dir)
    out = []
    for name, msgs in CHATS:
        for agp in (True, False):
            for think in (None, True, False):
                kw = {} if think is None else {"enable_thinking": think}
                case = {"kind": "chat", "name": f"{name}/gen={int(agp)}/think={think}", "messages": msgs,
                        "add_generation_prompt": agp, "enable_thinking": think}
                try:
                    text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp, **kw)
                    ids = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=agp, **kw)
                    if hasattr(ids, "keys"):
                        ids = ids["input_ids"]
                    if ids and isinstance(ids[0], list):
                        ids = ids[0]
                    case["text"] = text
                    case["ids"] = [int(i) for i in ids]
                    lib_ids = tok.encode(text, add_special_tokens=False).ids
                    if lib_ids != case["ids"]:
                        case["tokenizers_ids_differ"] = lib_ids
                except Exception as e:  # record it: a template error is part of the reference
                    case["error"] = f"{type(e).__name__}: {e}"
                out.append(case)
    return out


def decode_cases(tok):
    rng = random.Random(7)
    byte_ids = byte_token_ids(tok)
    high = [byte_ids[b] for b in range(0x80, 0x100)]
    n_all = tok.get_vocab_size(with_added_tokens=True)
    cases = []
    for i in range(300):
        ids = []
        for _ in range(rng.randint(1, 20)):
            r = rng.random()
            if r < 0.45:
                ids.append(rng.randrange(n_all))
            elif r < 0.85:
                ids.append(rng.choice(high))  # lone or partial UTF-8 bytes
            elif r < 0.95:
                ids.append(rng.randrange(151643, n_all))
            else:
                ids.append(byte_ids[rng.randrange(0x80)])
        cases.append((f"decode/random/{i}", ids))
    # Complete and truncated multi-byte characters, byte by byte.
    for s in ["é", "中", "😀", "👨‍👩‍👧", "\u0301", "a\u00e9b"]:
        bs = s.encode("utf-8")
        cases.append((f"decode/bytes/{s.encode('unicode_escape').decode()}", [byte_ids[b] for b in bs]))
        cases.append((f"decode/bytes_cut/{s.encode('unicode_escape').decode()}",
                      [byte_ids[b] for b in bs[:-1]]))
    cases.append(("decode/empty", []))
    cases.append(("decode/beyond_vocab", [9707, n_all, n_all + 100, 151935, 1879]))
    return [{"kind": "decode", "name": name, "ids": ids, "text": tok.decode(ids, skip_special_tokens=False)}
            for name, ids in cases]


def reference(tok_dir, out_dir):
    import tokenizer_corpus
    tok = load(tok_dir)
    nfc = normalizers.NFC()
    lines = []
    for name, text in tokenizer_corpus.cases():
        enc = tok.encode(text, add_special_tokens=False)
        case = {"kind": "encode", "name": name, "text": text, "ids": enc.ids, "nfc": nfc.normalize_str(text)}
        decoded = tok.decode(enc.ids, skip_special_tokens=False)
        if decoded != case["nfc"]:
            case["decoded"] = decoded
        assert tok.encode(text).ids == enc.ids  # the post-processor adds nothing
        lines.append(case)
    # Not committed: the split pieces and token strings of each case, to debug a mismatch by hand.
    with open(os.path.join(out_dir, "tokenizer_pieces.jsonl"), "w", encoding="utf-8") as f:
        for c in lines:
            pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(c["nfc"])]
            tokens = tok.encode(c["text"], add_special_tokens=False).tokens
            row = {"name": c["name"], "pieces": pieces, "tokens": tokens}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    lines += decode_cases(tok)
    lines += chat_reference(tok_dir, tok)
    path = os.path.join(out_dir, "tokenizer_reference.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for c in lines:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
    kinds = {}
    for c in lines:
        kinds[c["kind"]] = kinds.get(c["kind"], 0) + 1
    errors = [c["name"] for c in lines if "error" in c]
    differ = [c["name"] for c in lines if "tokenizers_ids_differ" in c]
    print(f"reference: {path}: {kinds}, {os.path.getsize(path)} bytes; chat errors {errors}; "
          f"transformers/tokenizers id differences ({len(differ)}) {differ[:10]}")


# ---- unicode --------------------------------------------------------------------------------------------
_pt = None


def _init(tok_dir):
    global _pt
    _pt = load(tok_dir).pre_tokenizer


def _n(s):
    return len(_pt.pre_tokenize_str(s))


def _classify(rng_):
    """Class of each code point in [a, b) as the split regex sees it: L, N, W (\\s), O (other),
    X (surrogate)."""
    a, b = rng_
    out = []
    extra = {"single": [], "first_rv": [], "first_l": [], "second_e": [], "second_l": []}
    for cp in range(a, b):
        if 0xD800 <= cp <= 0xDFFF:
            out.append("X")
            continue
        c = chr(cp)
        if c in "\r\n":
            out.append("W")
            continue
        if _n("a" + c) == 1:
            out.append("L")
            if _n("'" + c + "a") == 2:
                extra["single"].append(cp)
            else:
                if _n("'" + c + "ea") == 2:
                    extra["first_rv"].append(cp)
                if _n("'" + c + "la") == 2:
                    extra["first_l"].append(cp)
            if _n("'r" + c + "a") == 2:
                extra["second_e"].append(cp)
            if _n("'l" + c + "a") == 2:
                extra["second_l"].append(cp)
        elif _n(c + c) == 2:
            out.append("N")
        elif _n("!" + c + "!") >= 2:
            out.append("W")
        else:
            out.append("O")
    return a, "".join(out), extra


def _normalize(rng_):
    a, b = rng_
    nfc, nfd = normalizers.NFC(), normalizers.NFD()
    res = {"nfc": {}, "nfd": {}, "nonstarter": []}
    for cp in range(a, b):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        c = chr(cp)
        x = nfc.normalize_str(c)
        y = nfd.normalize_str(c)
        if x != c:
            res["nfc"][cp] = x
        if y != c and not (0xAC00 <= cp <= 0xD7A3):
            res["nfd"][cp] = y
        if y == c:
            if (nfd.normalize_str("\u0345" + c) == c + "\u0345"
                    or nfd.normalize_str(c + "\u0301") == "\u0301" + c):
                res["nonstarter"].append(cp)
    return res


def unicode_tables(tok_dir, out_dir):
    from multiprocessing import Pool
    t0 = time.time()
    chunks = [(a, min(a + 0x4000, 0x110000)) for a in range(0, 0x110000, 0x4000)]
    with Pool(os.cpu_count(), initializer=_init, initargs=(tok_dir,)) as pool:
        classified = sorted(pool.map(_classify, chunks))
        normalized = pool.map(_normalize, chunks)
    classes = "".join(s for _, s, _ in classified)
    runs = []
    for cp, k in enumerate(classes):
        if not runs or runs[-1][1] != k:
            runs.append([cp, k])
    contraction = {}
    for _, _, extra in classified:
        for k, v in extra.items():
            contraction.setdefault(k, []).extend(v)
    nfc, nfd, nonstarter = {}, {}, []
    for r in normalized:
        nfc.update(r["nfc"])
        nfd.update(r["nfd"])
        nonstarter += r["nonstarter"]
    # Hangul syllables decompose by arithmetic; check that instead of storing 11,172 entries.
    nfdn = normalizers.NFD()
    hangul_ok = True
    for s in range(0xAC00, 0xD7A4):
        i = s - 0xAC00
        want = chr(0x1100 + i // 588) + chr(0x1161 + (i % 588) // 28)
        want += chr(0x11A7 + i % 28) if i % 28 else ""
        hangul_ok &= nfdn.normalize_str(chr(s)) == want
    ranges = []
    for cp in sorted(nonstarter):
        if ranges and ranges[-1][1] == cp - 1:
            ranges[-1][1] = cp
        else:
            ranges.append([cp, cp])
    data = {"classes": runs, "contraction": contraction, "nfc": {f"{k:X}": v for k, v in sorted(nfc.items())},
            "nfd": {f"{k:X}": v for k, v in sorted(nfd.items())}, "nonstarter": ranges,
            "hangul_nfd_algorithmic": hangul_ok}
    path = os.path.join(out_dir, "tokenizer_unicode.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=True, separators=(",", ":"))
    counts = {k: classes.count(k) for k in "LNWOX"}
    print(f"unicode: {path}: {len(runs)} class runs {counts}, contraction letters "
          f"{ {k: [hex(c) for c in v[:40]] for k, v in contraction.items()} }, {len(nfc)} NFC changes, "
          f"{len(nfd)} NFD changes, {len(nonstarter)} non-starters, hangul ok {hangul_ok}, "
          f"{time.time() - t0:.1f} s")


# ---- bench ------------------------------------------------------------------------------------------------
def bench_texts(target=10_000_000):
    import sysconfig
    import glob
    import tokenizer_corpus
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True))
    parts, n = [], 0
    for p in files:
        try:
            s = open(p, encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(s)
        n += len(s.encode("utf-8"))
        if n >= target:
            break
    code = "".join(parts)
    corpus = "\n".join(t for _, t in tokenizer_corpus.cases() if not _.startswith("long/"))
    reps = target // len(corpus.encode("utf-8")) + 1
    return [("python_stdlib", code), ("corpus_x%d" % reps, "\n".join([corpus] * reps))]


def bench(tok_dir, out_dir, ours=None):
    import subprocess
    try:
        os.sched_setaffinity(0, {os.sched_getaffinity(0).pop()})  # one core for HF and for ours
    except (AttributeError, OSError):
        pass
    print(f"bench: one core {sorted(os.sched_getaffinity(0))}, "
          f"RAYON_NUM_THREADS={os.environ['RAYON_NUM_THREADS']}")
    for name, text in bench_texts():
        data = text.encode("utf-8")
        mb = len(data) / 1e6
        lines = text.splitlines(keepends=True)
        hf_one, hf_lines = [], []
        ids = None
        for _ in range(2):
            tok = load(tok_dir)  # fresh: no warm word cache
            t0 = time.perf_counter()
            ids = tok.encode(text, add_special_tokens=False).ids
            hf_one.append(time.perf_counter() - t0)
            tok = load(tok_dir)
            t0 = time.perf_counter()
            batch = tok.encode_batch(lines, add_special_tokens=False)
            hf_lines.append(time.perf_counter() - t0)
            batch_ids = [e.ids for e in batch]
        print(f"bench {name}: {mb:.2f} MB, {len(lines)} lines, {len(ids)} tokens")
        print(f"  HF tokenizers one string  : {mb / min(hf_one):7.2f} MB/s  (best of {len(hf_one)}: "
              f"{min(hf_one):.3f} s)")
        print(f"  HF tokenizers encode_batch: {mb / min(hf_lines):7.2f} MB/s  ({min(hf_lines):.3f} s)")
        if not ours:
            continue
        txt = os.path.join(out_dir, "bench.txt")
        jl = os.path.join(out_dir, "bench.jsonl")
        with open(txt, "wb") as f:
            f.write(data)
        with open(jl, "w", encoding="utf-8") as f:
            for ln in lines:
                f.write(json.dumps(ln, ensure_ascii=False) + "\n")

        def run(args, stdin_path):
            with open(stdin_path, "rb") as fin:
                t0 = time.perf_counter()
                r = subprocess.run([ours, "encode", tok_dir] + args, stdin=fin, capture_output=True)
                dt = time.perf_counter() - t0
            if r.returncode != 0:
                print("  ours failed:", r.stderr.decode()[-2000:])
            return dt, r.stdout

        empty = os.path.join(out_dir, "empty.txt")
        open(empty, "w").close()
        load_s = min(run([], empty)[0] for _ in range(5))
        one, lines_t = [], []
        out = b""
        for _ in range(5):
            dt, out = run([], txt)
            one.append(dt)
            dt, out_l = run(["--jsonl"], jl)
            lines_t.append(dt)
        same = json.loads(out) == ids if out else False
        same_lines = [json.loads(x) for x in out_l.decode().splitlines()] == batch_ids
        print(f"  ours load only            : {load_s:.3f} s")
        print(f"  ours one string           : {mb / (min(one) - load_s):7.2f} MB/s  ({min(one):.3f} s total, "
              f"{min(one) - load_s:.3f} s after load); ids identical to HF: {same}")
        print(f"  ours --jsonl lines        : {mb / (min(lines_t) - load_s):7.2f} MB/s  "
              f"({min(lines_t):.3f} s total); ids identical to HF: {same_lines}")
        os.remove(txt)
        os.remove(jl)


if __name__ == "__main__":
    tok_dir, out_dir, what = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(out_dir, exist_ok=True)
    if what == "reference":
        reference(tok_dir, out_dir)
    elif what == "unicode":
        unicode_tables(tok_dir, out_dir)
    elif what == "bench":
        bench(tok_dir, out_dir, sys.argv[4] if len(sys.argv) > 4 else None)
    else:
        sys.exit(f"unknown command {what}")
