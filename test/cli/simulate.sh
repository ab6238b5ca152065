#!/usr/bin/env bash
# suite: simulate and --report (issue 18)
# `nanovllm simulate` on a CPU machine: the tiny test checkpoint's shape and a tokenizer alone (with a named
# Qwen3 shape and a pool sized for a GPU), both schedulers, arrivals; the report it writes holds the summary
# record --output writes, one mark per step and one per preemption; and, where Debian's chromium is
# installed (CI installs it), the report rendered headless: a screenshot that is not blank, and the live DOM
# holding one <g class="step"> per step of the summary; and the trace lines docs/experiments.md quotes,
# replayed by running its commands under simulate. Run from the repo root; NANOVLLM_BIN overrides ./nanovllm.
source "$(dirname "$0")/lib.sh"
if ! TOK=$(bash tools/fetch_tokenizer.sh | tail -n 1) || [ -z "$TOK" ]; then
  fail fetch_tokenizer "tools/fetch_tokenizer.sh could not provide the Qwen3 tokenizer"; finish
fi
[ -x "$BIN" ] || { fail binary "$BIN is missing: run make first"; finish; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 test/ref/make_tiny_checkpoint.py "$tmp/tiny" >/dev/null || { fail fixture "make_tiny_checkpoint.py"; finish; }
cp "$TOK/tokenizer.json" "$TOK/tokenizer_config.json" "$tmp/tiny/"
python3 - "$tmp" <<'PY'
import json, random, sys
d = sys.argv[1]
random.seed(1)
with open(f"{d}/w.jsonl", "w") as f:  # 24 requests: two arrive late, four share a prompt
    for i in range(24):
        n = 16 if i % 6 == 0 else random.randint(5, 60)
        ids = list(range(100, 100 + n)) if i % 6 == 0 else [random.randint(0, 5000) for _ in range(n)]
        r = {"prompt_token_ids": ids, "max_tokens": random.randint(4, 40), "ignore_eos": True, "temperature": 0}
        if i in (5, 17): r["arrival_time"] = 0.05 * i
        f.write(json.dumps(r) + "\n")
PY

# 1. The tiny model's shape, a small pool: it runs, stdout has every completion, the report holds the same
#    summary record as --output, one step mark per step and one preemption mark per preemption.
"$BIN" simulate "$tmp/tiny" "$tmp/w.jsonl" --num-kvcache-blocks 7 --kvcache-block-size 16 --max-model-len 112 \
  --output "$tmp/o.jsonl" --report "$tmp/r.html" --trace >"$tmp/stdout" 2>"$tmp/stderr"
rc=$?
check simulate_runs "$rc" "exit $rc: $(tail -n 3 "$tmp/stderr")"
[ "$(grep -c '^==> request' "$tmp/stdout")" = 24 ]; check every_completion_printed $? "$(grep -c '^==> request' "$tmp/stdout") of 24"
grep -q '^nanovllm: simulate | shape of' "$tmp/stderr"; check startup_line_says_simulate $? "no simulate line"
python3 - "$tmp" >"$tmp/py.txt" 2>&1 <<'PY'
import json, re, sys, html
d = sys.argv[1]
s = json.loads(open(f"{d}/o.jsonl").read().splitlines()[-1])
page = open(f"{d}/r.html").read()
rec = json.loads(html.unescape(re.search(r"<pre>(.*?)</pre>", page, re.S).group(1)))
assert rec == s, "the report's summary record differs from --output's"
steps = s["summary"]["steps_prefill"] + s["summary"]["steps_decode"]
marks = page.count('<g class="step"')
assert marks == steps, f"{marks} step marks for {steps} steps"
pre = s["summary"]["preemptions"]
assert pre > 0, "no preemption in a 7-block pool"
marks_p = page.count('class="preempt"')
assert marks_p == pre, f"{marks_p} preemption marks for {pre}"
trace = open(f"{d}/stderr").read()
assert trace.count("[trace]   preempt seq=") == pre, "trace and summary disagree on preemptions"
assert "<script" not in page and "http" not in page, "the report must open offline"
print(f"{steps} steps, {pre} preemptions")
PY
check report_matches_summary_and_trace $? "$(cat "$tmp/py.txt")"

# 2. A tokenizer alone, a named shape, a pool sized for a 24 GB card, both schedulers, arrivals at a rate.
for s in nano mixed; do
  "$BIN" simulate "$tmp/tiny/tokenizer.json" "$tmp/w.jsonl" --simulate-model Qwen3-8B --simulate-gpu-memory 24GB \
    --scheduler $s --request-rate 50 --max-num-batched-tokens 64 --output "$tmp/o_$s.jsonl" >/dev/null \
    2>"$tmp/e_$s"
  check "simulate_${s}_on_a_24GB_card" $? "$(tail -n 3 "$tmp/e_$s")"
done
# A MoE shape (Qwen3-30B-A3B): its parameters, the active ones, and a run that finishes.
"$BIN" simulate "$tmp/tiny/tokenizer.json" "$tmp/w.jsonl" --simulate-model Qwen3-30B-A3B \
  --simulate-gpu-memory 80GB --output "$tmp/o_moe.jsonl" >/dev/null 2>"$tmp/e_moe"
rc=$?
grep -q "shape of Qwen3-30B-A3B (30.53 B parameters, 3.35 B active)" "$tmp/e_moe" && [ "$rc" = 0 ] &&
  [ "$(grep -c '"summary"' "$tmp/o_moe.jsonl")" = 1 ]
check simulate_moe_shape $? "rc $rc: $(head -n 2 "$tmp/e_moe")"
python3 - "$tmp" >"$tmp/py2.txt" 2>&1 <<'PY'
import json, sys
d = sys.argv[1]
out = {s: [json.loads(l) for l in open(f"{d}/o_{s}.jsonl")] for s in ("nano", "mixed")}
for s in out:
    assert out[s][-1]["summary"]["scheduler"] == s
assert out["mixed"][-1]["summary"]["steps_mixed"] > 0, "no mixed step under --scheduler mixed"
assert out["nano"][-1]["summary"]["steps_mixed"] == 0
# the stand-in's tokens depend on each request's tokens only: the same completions under both schedulers
a = [r["token_ids"] for r in out["nano"][:-1]]; b = [r["token_ids"] for r in out["mixed"][:-1]]
assert a == b, "the schedulers changed a completion"
PY
check schedulers_differ_only_in_schedule $? "$(cat "$tmp/py2.txt")"

# 3. --kv-cache-dtype fp8 (section 31): one byte per cached value, so the same card holds twice the blocks.
for kv in bf16 fp8; do
  "$BIN" simulate "$tmp/tiny/tokenizer.json" "$tmp/w.jsonl" --simulate-model Qwen3-8B --simulate-gpu-memory 24GB \
    --kv-cache-dtype $kv --output "$tmp/kv_$kv.jsonl" >/dev/null 2>"$tmp/kv_$kv.err"
  check "simulate_kv_cache_$kv" $? "$(tail -n 3 "$tmp/kv_$kv.err")"
done
python3 - "$tmp" >"$tmp/py3.txt" 2>&1 <<'PY'
import json, sys
d = sys.argv[1]
s = {kv: json.loads(open(f"{d}/kv_{kv}.jsonl").readlines()[-1])["summary"] for kv in ("bf16", "fp8")}
assert s["bf16"]["kv_cache_dtype"] == "bf16" and s["fp8"]["kv_cache_dtype"] == "fp8", s
ratio = s["fp8"]["kv_pool_tokens"] / s["bf16"]["kv_pool_tokens"]
assert 1.99 <= ratio <= 2.01, f"fp8 holds {ratio:.3f}x the tokens of bf16"
assert "KV cache fp8," in open(f"{d}/kv_fp8.err").read(), "the start-up line does not name the KV dtype"
PY
check fp8_pool_holds_twice_the_tokens $? "$(cat "$tmp/py3.txt")"

# 3. The report in a real browser.
CHROME=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$CHROME" ]; then
  skip report_renders_in_chromium "no chromium here (apt-get install chromium)"
else
  timeout 120 "$CHROME" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1150,1400 \
    --screenshot="$tmp/r.png" "file://$tmp/r.html" >/dev/null 2>&1
  timeout 120 "$CHROME" --headless --no-sandbox --disable-gpu --dump-dom "file://$tmp/r.html" >"$tmp/dom.html" 2>/dev/null
  python3 - "$tmp" >"$tmp/py3.txt" 2>&1 <<'PY'
import json, struct, sys, zlib
d = sys.argv[1]
png = open(f"{d}/r.png", "rb").read()
assert png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
pos, chunks, w = 8, b"", 0
while pos < len(png):
    n, t = struct.unpack(">I4s", png[pos:pos + 8])
    body = png[pos + 8:pos + 8 + n]
    if t == b"IHDR": w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
    if t == b"IDAT": chunks += body
    pos += 12 + n
raw = zlib.decompress(chunks)
bpp = {2: 3, 6: 4}[ctype]
stride = w * bpp
prev, colors, nonwhite = bytearray(stride), set(), 0
for y in range(h):  # undo PNG's per-row filters (None, Sub, Up, Average, Paeth), then sample pixels
    f, row = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
    for i in range(stride):
        a = row[i - bpp] if i >= bpp else 0
        b, c = prev[i], prev[i - bpp] if i >= bpp else 0
        if f == 1: row[i] = (row[i] + a) & 255
        elif f == 2: row[i] = (row[i] + b) & 255
        elif f == 3: row[i] = (row[i] + (a + b) // 2) & 255
        elif f == 4:
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            row[i] = (row[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    prev = row
    if y % 4 == 0:
        for x in range(0, stride, bpp * 4):
            px = bytes(row[x:x + 3])
            colors.add(px)
            nonwhite += px != b"\xff\xff\xff"
assert len(colors) > 20 and nonwhite > 2000, f"a blank screenshot: {len(colors)} colours, {nonwhite} non-white samples"
dom = open(f"{d}/dom.html").read()
s = json.loads(open(f"{d}/o.jsonl").read().splitlines()[-1])["summary"]
steps = s["steps_prefill"] + s["steps_decode"]
in_dom = dom.count('<g class="step"')
assert in_dom == steps, f"the rendered page holds {in_dom} step marks for {steps} steps"
print(f"{w}x{h} screenshot, {len(colors)} colours sampled; {steps} step marks in the DOM")
PY
  check report_renders_in_chromium $? "$(cat "$tmp/py3.txt")"
  cat "$tmp/py3.txt" | sed 's/^/    /'
fi
# 5. Request fields end to end (issue 20): an OpenAI batch with n, stop strings, logprobs and an unsupported
#    line answered with its own error; n = 3 of a 100-token prompt shares its 6 full blocks of 16.
cat >"$tmp/batch.jsonl" <<'J'
{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}], "n": 3, "max_completion_tokens": 20, "stop": ["e"], "logprobs": true, "top_logprobs": 2}}
{"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}}
{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Once upon a time", "max_tokens": 7, "temperature": 0, "stop_token_ids": [13]}}
J
"$BIN" simulate "$tmp/tiny" "$tmp/batch.jsonl" --num-kvcache-blocks 64 --kvcache-block-size 16 --max-model-len 256 \
  --output "$tmp/batch_out.jsonl" >"$tmp/stdout" 2>"$tmp/stderr"
check batch_runs $? "$(tail -n 3 "$tmp/stderr")"
python3 - "$tmp/batch_out.jsonl" >"$tmp/py5.txt" 2>&1 <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
assert [l["custom_id"] for l in lines] == ["a", "b", "c"], [l["custom_id"] for l in lines]
a, b, c = (l["response"] for l in lines)
assert a["status_code"] == 200 and a["body"]["object"] == "chat.completion" and len(a["body"]["choices"]) == 3
for ch in a["body"]["choices"]:
    assert "e" not in ch["message"]["content"], ch  # cut before the stop string
    assert ch["finish_reason"] == "length" or ch["stop_reason"] == "e", ch
    assert ch["logprobs"] == {"content": []}, ch["logprobs"]  # simulate has no logits
assert b["status_code"] == 400 and b["body"] is None and "tools" in lines[1]["error"]
assert c["status_code"] == 200 and c["body"]["object"] == "text_completion"
assert c["body"]["usage"]["completion_tokens"] <= 7
print("3 lines in input order; n = 3 choices cut at the stop string; the tools line answered 400")
PY
check batch_output_shape $? "$(cat "$tmp/py5.txt")"
python3 -c 'import json; print(json.dumps({"prompt_token_ids": list(range(1000, 1100)), "n": 3, "max_tokens": 5}))' >"$tmp/n3.jsonl"
"$BIN" simulate "$tmp/tiny" "$tmp/n3.jsonl" --num-kvcache-blocks 64 --kvcache-block-size 16 --max-model-len 256 \
  --output "$tmp/n3_out.jsonl" >/dev/null 2>"$tmp/stderr"
python3 - "$tmp/n3_out.jsonl" >"$tmp/py6.txt" 2>&1 <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
outs, s = rows[:-1], rows[-1]["summary"]
assert [(o["index"], o["completion"]) for o in outs] == [(0, 0), (0, 1), (0, 2)], outs
assert s["prefix_hit_tokens"] == 2 * 96 and s["peak_kv_blocks"] == 7 + 2, s
print(f"3 completions; {s['prefix_hit_tokens']} prefix-hit tokens, peak {s['peak_kv_blocks']} blocks")
PY
check n_shares_prompt_blocks $? "$(cat "$tmp/py6.txt")"
# 6. The experiments of docs/experiments.md, replayed: the prompt files its "Setup" block writes (its Python
#    heredoc, run as written), then every command there of the form "./nanovllm $M build/exp/FILE $G ...
#    --trace" run as `nanovllm simulate` with the Qwen3-0.6B shape and the pool its quoted lines show
#    (free=F/NB, unless the command sets --num-kvcache-blocks). simulate prints the trace a GPU run prints
#    (test_trace's simulate_prints_the_real_runs_trace), so every "[trace]" line quoted under the command, its
#    ms= dropped, must come out in the quoted order, and every quoted "nanovllm: summary" line must match, its
#    "..." standing for any text. The "check" lines are not replayed: simulate's stand-in model samples other
#    tokens than the real one.
python3 - "$tmp" "$BIN" "$TOK/tokenizer.json" docs/experiments.md >"$tmp/py7.txt" 2>&1 <<'PY'
import os, re, shlex, subprocess, sys
tmp, doc = sys.argv[1], sys.argv[4]
binary, tokenizer = os.path.abspath(sys.argv[2]), os.path.abspath(sys.argv[3])  # run from another folder
text = open(doc, encoding="utf-8").read()
setup = re.search(r"python3 - <<'PY'\n(.*?)\nPY\n", text, re.S)
assert setup, f"{doc}: no setup heredoc (python3 - <<'PY' ... PY) to write the prompt files"
work = os.path.join(tmp, "exp")
os.makedirs(os.path.join(work, "build", "exp"))
subprocess.run([sys.executable, "-c", setup.group(1)], cwd=work, check=True)
g = re.search(r'^M=\S+ G="([^"]*)"', text, re.M)
assert g, f"{doc}: no line M=... G=\"...\" giving the experiments' flags"
runs = 0
for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M):
    cmds = []  # (command, the lines quoted under it)
    for line in block.split("\n"):
        if line.startswith("./nanovllm $M "):
            cmds.append((line, []))
        elif cmds:
            cmds[-1][1].append(line)
    for cmd, quoted in cmds:
        if "--trace" not in cmd:
            continue
        args = shlex.split(cmd.replace("$G", g.group(1)))[2:]  # drop ./nanovllm $M
        traces = [re.sub(r" ms=\S+", "", l) for l in quoted if l.startswith("[trace]")]
        summaries = [l for l in quoted if l.startswith("nanovllm: summary")]
        assert traces, f"{cmd}: no [trace] line quoted under it"
        if "--num-kvcache-blocks" not in args:
            nb = re.search(r"free=\d+/(\d+)", traces[0])
            args += ["--num-kvcache-blocks", nb.group(1)]
        r = subprocess.run([binary, "simulate", tokenizer] + args + ["--simulate-model", "Qwen3-0.6B"],
                           cwd=work, capture_output=True, text=True)
        assert r.returncode == 0, f"{cmd}: simulate exited {r.returncode}: {r.stderr[-500:]}"
        got = [re.sub(r" ms=\S+", "", l) for l in r.stderr.split("\n") if l.startswith("[trace]")]
        at = 0
        for want in traces:
            while at < len(got) and got[at] != want:
                at += 1
            assert at < len(got), f"{cmd}:\n  quoted  {want}\n  not printed in that order (simulate printed " \
                                  f"{len(got)} trace lines)"
            at += 1
        for want in summaries:
            pattern = ".*".join(re.escape(part) for part in want.split("..."))
            line = next((l for l in r.stderr.split("\n") if l.startswith("nanovllm: summary")), "")
            assert re.match(pattern, line), f"{cmd}:\n  quoted  {want}\n  printed {line}"
        runs += 1
assert runs >= 5, f"only {runs} traced commands found in {doc}"
print(f"{runs} commands of {doc} replayed, every quoted trace and summary line printed")
PY
check experiments_doc_trace_lines_replay $? "$(cat "$tmp/py7.txt")"
finish
