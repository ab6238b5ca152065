#!/usr/bin/env bash
# bench.sh — nano-vllm's benchmark and three latency/throughput probes, with roofline fractions.
#
#   ./bench.sh --model DIR            a Qwen3 checkpoint folder (with tokenizer.json)
#   ./bench.sh --random 0.6b|8b|32b   first make a random-weight checkpoint of that exact shape (needs python3
#                                     with torch and transformers; speed does not depend on the weights'
#                                     values when ignore_eos is set) in build/bench-SHAPE; SHAPE-fp8 (0.6b-fp8,
#                                     8b-fp8, 32b-fp8) writes it as Qwen's FP8 releases are written (e4m3 layer
#                                     linears, one fp32 scale per 128 x 128 block), never holding it in bf16 on
#                                     disk: the 32B shape is 65 GB in bf16, 34 GB so.
#   ./bench.sh --random 30b-a3b       Qwen3-30B-A3B's shape (a Qwen3MoeForCausalLM folder: H 2048, 48 layers,
#                                     32/4 heads, 128 experts top-8 of intermediate 768, norm_topk_prob), written
#                                     per expert as Qwen's checkpoints are by test/ref/make_tiny_checkpoint.py
#                                     --moe --random (python3 alone; 61 GB of disk): small random bf16 values
#                                     from a repeated block, so the router spreads tokens over the experts;
#                                     30b-a3b-fp8 writes it as Qwen3-30B-A3B-FP8 is (--fp8 bf16: every layer
#                                     linear and expert e4m3 with its block scales, the routers bf16; 31 GB)
#   ./bench.sh --random 235b-a22b     Qwen3-235B-A22B's widths (H 4096, 64/4 heads, 128 experts top-8 of
#                                     intermediate 1536) at 8 of its 94 layers, written the same way: 42 GB, so
#                                     that one 80 GB GPU holds it and a KV cache (5 GB a layer; the whole model
#                                     is 470 GB); 235b-a22b-fp8 as Qwen3-235B-A22B-FP8 is written (22 GB)
# Options: --nanovllm PATH (default ./nanovllm), --log-dir DIR (default build/bench-logs),
#          --only throughput|latency|prefill (one measure; --only model just makes the --random checkpoint),
#          --tp N (tensor parallelism on N GPUs; the roofline is then N GPUs' bandwidth and GEMM rate),
#          --opt LIST (passed to nanovllm: which optimizations of Part II run; --opt none is --plain),
#          --kv-cache-dtype bf16|fp8 (passed to nanovllm; the roofline then counts 1 byte per K/V value),
#          --quantization fp8 (passed to nanovllm: the layers' linear weights quantized to FP8 at load, as an
#          FP8 checkpoint holds them; the roofline then counts 1 byte per such weight; also read from the
#          model's config.json when it is an FP8 checkpoint),
#          --scheduler nano|mixed (passed to nanovllm: nano-vllm's prefill-first rule or vLLM V1's),
#          --dp N (data parallelism: with --only dataparallel, measure 7 on N replicas of --tp GPUs each).
#          TOKENIZER_DIR: tokenizer for --random.
#
#   ./bench.sh --ladder [--random 0.6b | --model DIR] [--baseline PATH]
#                                     the climb from Part I to the default path, on this GPU in one run:
#                                     batch-1 latency and bench.py throughput for --plain, then Part I plus
#                                     flash_attn (section 15), then flash_attn plus each other optimization of
#                                     Part II (pdl on top of gemv, the first kernel it acts on: +gemv+pdl),
#                                     then the default (every optimization), and
#                                     with --baseline another nanovllm binary's default path (an older build
#                                     to compare with). One table, each row with its roofline fraction.
#
# 1. throughput: nano-vllm bench.py exactly — python3 random.seed(0); 256 prompts of randint(100, 1024)
#    tokens of randint(0, 10000), then 256 max_tokens randint(100, 1024); temperature 0.6, ignore_eos,
#    max_model_len 4096. Throughput = generated tokens / generate() wall time. The totals are checked.
# 2. batch-1 decode: one 512-token prompt, 512 greedy tokens: ms per output token.
# 3. prefill: 64 prompts of 2048 tokens, max_tokens 1: prompt tokens per second.
# 4. cold start: process start to first generated token (model load and graph capture included), from run 2.
# Two more, for the schedulers, run only when named (--only short|staggered), with --max-num-seqs 512:
# 5. short: 2,000 requests arriving at once, prompts and outputs of randint(100, 400) tokens: throughput and
#    the p99 time per output token (how long prefill steps stall the running requests).
# 6. staggered: bench.py's 256 requests arriving as a Poisson process of 40 per second (--seed 0): time to
#    first token and time per output token, median and p99.
# 7. dataparallel (--only dataparallel --dp N): bench.py's distribution, 256 x N requests (drawn as bench.py
#    draws 256, from random.seed(0)) on N replicas (-dp N), against measure 1 on one replica: the throughput
#    and its ratio to N x one replica's.
# 8. ten (--only ten): 10 requests at once, 2048 random prompt tokens each, 1024 greedy output tokens: time
#    per output token (median, p99) against the floor of a decode step of 10 (the weights such a step reads:
#    of a MoE layer the experts 10 tokens touch, E (1 - (1 - k/E)^10) when routing is uniform; and the 10
#    contexts' K/V at their mean length), and the time to first token.
# Roofline: `nanovllm roofline` measures this GPU's copy bandwidth and bf16 GEMM rate in the same run.
set -euo pipefail
cd "$(dirname "$0")"
MODEL= RANDOM_SHAPE= NANOVLLM=./nanovllm LOG_DIR=build/bench-logs ONLY= TP=1 OPT=all LADDER=0 BASELINE= KV=auto
SCHED= DP=1 QUANT=
while [ $# -gt 0 ]; do
  case $1 in
    --model) MODEL=$2; shift 2 ;;
    --random) RANDOM_SHAPE=$2; shift 2 ;;
    --nanovllm) NANOVLLM=$2; shift 2 ;;
    --log-dir) LOG_DIR=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --tp) TP=$2; shift 2 ;;
    --opt) OPT=$2; shift 2 ;;
    --kv-cache-dtype) KV=$2; shift 2 ;;
    --quantization) QUANT=$2; shift 2 ;;
    --scheduler) SCHED=$2; shift 2 ;;
    --dp) DP=$2; shift 2 ;;
    --ladder) LADDER=1; shift ;;
    --baseline) BASELINE=$2; shift 2 ;;
    -h|--help) sed -n "2,/^# Roofline/p" "$0"; exit 0 ;;
    *) echo "bench.sh: unknown argument '$1' (see --help)" >&2; exit 1 ;;
  esac
done
mkdir -p "$LOG_DIR"
if [ -n "$RANDOM_SHAPE" ]; then
  case $RANDOM_SHAPE in 0.6b|8b|32b|0.6b-fp8|8b-fp8|32b-fp8|30b-a3b|30b-a3b-fp8|235b-a22b|235b-a22b-fp8) ;;
    *) echo "bench.sh: --random takes 0.6b, 8b or 32b, or one of them with -fp8 (an FP8 checkpoint), or" \
            "30b-a3b or 235b-a22b (Qwen3's mixtures of experts; the 235B at 8 of its layers), or one of" \
            "them with -fp8" >&2; exit 1 ;;
  esac
  MODEL=build/bench-$RANDOM_SHAPE
  case ${RANDOM_SHAPE%-fp8} in  # the MoE shapes: H, dense intermediate, layers, heads, expert intermediate
    30b-a3b) MOE_SHAPE=(2048 6144 48 32 768) ;;
    235b-a22b) MOE_SHAPE=(4096 12288 8 64 1536) ;;
    *) MOE_SHAPE=() ;;
  esac
  if [ ${#MOE_SHAPE[@]} -gt 0 ] && [ ! -f "$MODEL/config.json" ]; then
    TOK=${TOKENIZER_DIR:-$(bash tools/fetch_tokenizer.sh | tail -n1)}
    FP8_ARGS=(); [ "$RANDOM_SHAPE" = "${RANDOM_SHAPE%-fp8}" ] || FP8_ARGS=(--fp8 bf16)
    python3 test/ref/make_tiny_checkpoint.py "$MODEL.partial" --moe --random --shards "${FP8_ARGS[@]}" \
      --set hidden_size="${MOE_SHAPE[0]}" --set intermediate_size="${MOE_SHAPE[1]}" \
      --set num_hidden_layers="${MOE_SHAPE[2]}" --set num_attention_heads="${MOE_SHAPE[3]}" \
      --set num_key_value_heads=4 --set head_dim=128 --set vocab_size=151936 --set max_position_embeddings=40960 \
      --set tie_word_embeddings=false --set num_experts=128 --set num_experts_per_tok=8 \
      --set moe_intermediate_size="${MOE_SHAPE[4]}" --set norm_topk_prob=true --set decoder_sparse_step=1 \
      --set 'mlp_only_layers=[]'
    for f in tokenizer.json tokenizer_config.json; do [ ! -f "$TOK/$f" ] || cp "$TOK/$f" "$MODEL.partial/"; done
    mv "$MODEL.partial" "$MODEL"  # (only a finished folder has the name: an interrupted write starts over)
  fi
  if [ ! -f "$MODEL/config.json" ]; then
    TOK=${TOKENIZER_DIR:-$(bash tools/fetch_tokenizer.sh | tail -n1)}
    python3 - "$MODEL" "$RANDOM_SHAPE" "$TOK" <<'PY'
import json, os, re, shutil, sys, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
out, shape, tok = sys.argv[1:]
fp8 = shape.endswith("-fp8")
dims = {"0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                     num_key_value_heads=8, tie_word_embeddings=True),
        "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                   num_key_value_heads=8, tie_word_embeddings=False),
        "32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                    num_key_value_heads=8, tie_word_embeddings=False)}[shape.removesuffix("-fp8")]
torch.manual_seed(0)
cfg = Qwen3Config(vocab_size=151936, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
                  rms_norm_eps=1e-6, eos_token_id=[151645, 151643], torch_dtype="bfloat16", **dims)
with torch.device("cuda"):
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
if not fp8:
    model.save_pretrained(out, safe_serialization=True)
else:  # Qwen's FP8 format (every dimension here a multiple of 128): per 128 x 128 block, scale = amax / 448
    from safetensors.torch import save_file
    os.makedirs(out, exist_ok=True)
    linear = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
    shards, shard, size, index = [], {}, 0, {}
    with torch.no_grad():
        for name, w in model.state_dict().items():
            if linear.fullmatch(name):
                n, k = w.shape
                b = w.float().reshape(n // 128, 128, k // 128, 128)
                amax = b.abs().amax(dim=(1, 3))
                s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
                q = (b / s[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).reshape(n, k)
                parts = {name: q.cpu(), name + "_scale_inv": s.cpu()}
            else:
                parts = {name: w.cpu()}
            for key, t in parts.items():
                shard[key] = t.contiguous()
                size += t.numel() * t.element_size()
            if size > 4e9:
                shards.append(shard)
                shard, size = {}, 0
    shards.append(shard)
    total = 0
    for i, sh in enumerate(shards):
        f = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, os.path.join(out, f), metadata={"format": "pt"})
        for key, t in sh.items():
            index[key] = f
            total += t.numel() * t.element_size()
    json.dump({"metadata": {"total_size": total}, "weight_map": index},
              open(os.path.join(out, "model.safetensors.index.json"), "w"), indent=2)
    c = model.config.to_dict()
    c["architectures"] = ["Qwen3ForCausalLM"]  # (save_pretrained adds it; to_dict does not)
    c["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]}
    json.dump(c, open(os.path.join(out, "config.json"), "w"), indent=2)
json.dump({"eos_token_id": [151645, 151643]}, open(os.path.join(out, "generation_config.json"), "w"))
for f in ("tokenizer.json", "tokenizer_config.json"):
    if os.path.exists(os.path.join(tok, f)): shutil.copy(os.path.join(tok, f), out)
PY
  fi
fi
[ "$ONLY" = model ] && exit 0
OPT_FLAGS=(); [ "$OPT" = all ] || OPT_FLAGS=(--opt "$OPT")  # only then: an older binary knows no --opt
[ "$KV" = auto ] || OPT_FLAGS+=(--kv-cache-dtype "$KV")
[ -z "$SCHED" ] || OPT_FLAGS+=(--scheduler "$SCHED")
[ -z "$QUANT" ] || OPT_FLAGS+=(--quantization "$QUANT")
case $KV in auto|bf16) KV_BYTES=2 ;; fp8|fp8_e4m3) KV_BYTES=1 ;; *) echo "bench.sh: --kv-cache-dtype takes bf16 or fp8" >&2; exit 1 ;; esac
[ -n "$MODEL" ] || { echo "bench.sh: give --model DIR or --random SHAPE" >&2; exit 1; }
[ -x "$NANOVLLM" ] || { echo "bench.sh: $NANOVLLM not found; run make first" >&2; exit 1; }

# The workloads, as JSONL of prompt_token_ids (+ per-request max_tokens).
python3 - "$LOG_DIR" "$DP" <<'PY'
import json, random, sys
d, dp = sys.argv[1], int(sys.argv[2])
random.seed(0)  # nano-vllm bench.py, in its draw order
prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
max_tokens = [random.randint(100, 1024) for _ in range(256)]
with open(f"{d}/throughput.jsonl", "w") as f:
    for p, m in zip(prompts, max_tokens):
        f.write(json.dumps({"prompt_token_ids": p, "max_tokens": m}) + "\n")
random.seed(0)  # measure 7: the same draws for 256 x dp requests (dp = 1: the 256 above)
prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256 * dp)]
max_tokens = [random.randint(100, 1024) for _ in range(256 * dp)]
with open(f"{d}/dataparallel.jsonl", "w") as f:
    for p, m in zip(prompts, max_tokens):
        f.write(json.dumps({"prompt_token_ids": p, "max_tokens": m}) + "\n")
rng = random.Random(1)
with open(f"{d}/latency.jsonl", "w") as f:
    f.write(json.dumps({"prompt_token_ids": [rng.randint(0, 10000) for _ in range(512)], "max_tokens": 512}) + "\n")
with open(f"{d}/prefill.jsonl", "w") as f:
    for _ in range(64):
        f.write(json.dumps({"prompt_token_ids": [rng.randint(0, 10000) for _ in range(2048)], "max_tokens": 1}) + "\n")
rng = random.Random(3)
with open(f"{d}/ten.jsonl", "w") as f:
    for _ in range(10):
        f.write(json.dumps({"prompt_token_ids": [rng.randint(0, 10000) for _ in range(2048)], "max_tokens": 1024}) + "\n")
rng = random.Random(2)
with open(f"{d}/short.jsonl", "w") as f:
    for _ in range(2000):
        n, m = rng.randint(100, 400), rng.randint(100, 400)
        f.write(json.dumps({"prompt_token_ids": [rng.randint(0, 10000) for _ in range(n)], "max_tokens": m}) + "\n")
PY

"$NANOVLLM" roofline | tee "$LOG_DIR/roofline.txt"
BW=$(sed -n 's/^copy bandwidth: \([0-9]*\).*/\1/p' "$LOG_DIR/roofline.txt")
TF=$(sed -n 's/^bf16 GEMM.*: \([0-9]*\).*/\1/p' "$LOG_DIR/roofline.txt")
GPU=$(sed -n 's/^gpu: //p' "$LOG_DIR/roofline.txt")

# nano-vllm's workload samples with its own settings alone: a model's generation_config.json (Qwen3's sets
# top_k 20 and top_p 0.95) must not add to them. An older binary without --generation-config has none to add.
gen_flags() { "$1" --help | grep -q -- --generation-config && echo --generation-config vllm || true; }
run() {  # run NAME FLAGS... : ./nanovllm on LOG_DIR/NAME.jsonl, summary line -> LOG_DIR/NAME.log
  local name=$1; shift
  "$NANOVLLM" "$MODEL" "$LOG_DIR/$name.jsonl" --ignore-eos --max-model-len 4096 --output "$LOG_DIR/$name.out.jsonl" \
    $(gen_flags "$NANOVLLM") --tensor-parallel-size "$TP" ${OPT_FLAGS[@]+"${OPT_FLAGS[@]}"} "$@" >"$LOG_DIR/$name.stdout" 2>"$LOG_DIR/$name.log" ||
    { cat "$LOG_DIR/$name.log" >&2; exit 1; }
  grep '^nanovllm:' "$LOG_DIR/$name.log"
}

if [ "$LADDER" = 1 ]; then
  # rung NAME BINARY FLAGS...: the latency and throughput workloads, logs LOG_DIR/ladder-NAME-{latency,throughput}
  rung() {
    local name=$1 bin=$2; shift 2
    for w in latency throughput; do
      local t=0; [ $w = throughput ] && t=0.6
      "$bin" "$MODEL" "$LOG_DIR/$w.jsonl" --ignore-eos --max-model-len 4096 --temperature $t $(gen_flags "$bin") \
        --tensor-parallel-size "$TP" ${OPT_FLAGS[@]+"${OPT_FLAGS[@]}"} "$@" >/dev/null 2>"$LOG_DIR/ladder-$name-$w.log" ||
        { cat "$LOG_DIR/ladder-$name-$w.log" >&2; exit 1; }
    done
    echo "ladder: $name done"
  }
  RUNGS="plain"
  rung plain "$NANOVLLM" --plain
  # Section 15's flash attention is the second rung; the others build on it (cluster_merge and fused_rope
  # change its decode kernel), so each of them is measured with it: "+NAME" runs --opt none,flash_attn,NAME.
  # pdl changes only how the kernels written for it launch, the first of them the gemv's (section 17), so
  # it is measured on top of the gemv: "+gemv+pdl" runs --opt none,flash_attn,gemv,pdl, right after "+gemv".
  # An older binary without flash_attn runs each alone.
  names=$("$NANOVLLM" --help | sed -n 's/^ *NAME: //p')
  base=none; case " $names " in *" flash_attn "*) base=none,flash_attn ;; esac
  has() { case " $names " in *" $1 "*) return 0 ;; esac; return 1; }
  for o in $names; do
    [ "$TP" = 1 ] && case $o in oneshot_allreduce|twoshot_allreduce) true ;; *) false ;; esac && continue  # one GPU: nothing to do
    [ "$o" = pdl ] && has gemv && continue                     # measured with gemv, below
    if [ "$o" = flash_attn ]; then rung "+$o" "$NANOVLLM" --opt none,flash_attn
    else rung "+$o" "$NANOVLLM" --opt "$base,$o"; fi
    RUNGS="$RUNGS +$o"
    if [ "$o" = gemv ] && has pdl; then
      rung "+gemv+pdl" "$NANOVLLM" --opt "$base,gemv,pdl"; RUNGS="$RUNGS +gemv+pdl"
    fi
  done
  rung default "$NANOVLLM"; RUNGS="$RUNGS default"
  if [ -n "$BASELINE" ]; then rung baseline "$BASELINE"; RUNGS="$RUNGS baseline"; fi
fi
[ "$LADDER" = 1 ] && ONLY=ladder
{ [ -z "$ONLY" ] || [ "$ONLY" = throughput ]; } && run throughput --temperature 0.6
{ [ -z "$ONLY" ] || [ "$ONLY" = latency ]; } && run latency --temperature 0
{ [ -z "$ONLY" ] || [ "$ONLY" = prefill ]; } && run prefill --temperature 0
[ "$ONLY" = short ] && run short --temperature 0.6 --max-num-seqs 512
[ "$ONLY" = ten ] && run ten --temperature 0
[ "$ONLY" = staggered ] && cp "$LOG_DIR/throughput.jsonl" "$LOG_DIR/staggered.jsonl" &&
  run staggered --temperature 0.6 --max-num-seqs 512 --request-rate 40 --seed 0
[ "$ONLY" = dataparallel ] && run throughput --temperature 0.6 &&
  run dataparallel --temperature 0.6 --data-parallel-size "$DP"

# The table, with roofline fractions computed from the model's shape and the measured ceilings.
python3 - "$LOG_DIR" "$MODEL" "$BW" "$TF" "$GPU" "$ONLY" "$TP" "${RUNGS:-}" "$KV_BYTES" "$DP" "$QUANT" <<'PY'
import json, os, re, sys
d, model, bw, tf, gpu, only = sys.argv[1], sys.argv[2], float(sys.argv[3]) * 1e9, float(sys.argv[4]) * 1e12, sys.argv[5], sys.argv[6]
tp = int(sys.argv[7])
rungs = sys.argv[8].split()
kv_bytes = int(sys.argv[9])  # bytes per cached K or V value: 2 (bf16), 1 (fp8)
dp = int(sys.argv[10])  # replicas of measure 7
quant = sys.argv[11]  # --quantization, "" for none
bw, tf = bw * tp, tf * tp  # N GPUs each read 1/N of the weights and KV, and do 1/N of the FLOPs
if tp > 1: gpu = f"{tp} x {gpu} (tensor parallel; ceilings below are the sums)"
c = json.load(open(f"{model}/config.json"))
H, I, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
NH, NKV, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
tied = c.get("tie_word_embeddings", False)
# A Qwen3-MoE model (nanovllm.cu section 10b): its MoE layers hold a router and E experts of IE, a token
# computes with k of them; large batches read nearly every expert each step, a batch-1 step k per layer.
E, k, IE = c.get("num_experts", 0), c.get("num_experts_per_tok", 0), c.get("moe_intermediate_size", 0)
moe = [l for l in range(L) if E and l not in c.get("mlp_only_layers", []) and (l + 1) % c.get("decoder_sparse_step", 1) == 0]
layer = H * (NH + 2 * NKV) * D + NH * D * H + 3 * H * I + 2 * H + 2 * D  # a dense layer
moe_gap = 3 * H * I - E * H - E * 3 * H * IE  # a dense layer less a MoE one
params = L * layer - len(moe) * moe_gap + V * H * (1 if tied else 2) + H
active = params - len(moe) * (E - k) * 3 * H * IE  # what one token computes with
attn = L * (H * (NH + 2 * NKV) * D + NH * D * H)  # the layer linears: attention's, the dense MLPs', the experts'
linears = attn + (L - len(moe)) * 3 * H * I + len(moe) * E * 3 * H * IE
active_linears = attn + (L - len(moe)) * 3 * H * I + len(moe) * k * 3 * H * IE  # a token's
fp8w = quant == "fp8" or c.get("quantization_config", {}).get("quant_method") == "fp8"  # (experts too: section 35)
vb = 1 + 4 / 128**2 if fp8w else 2  # bytes per linear weight: FP8 1 (+ its block's fp32 scale), else bf16
# decode reads every weight once per step (not the embedding table); FP8 linears 1 byte each (+ their scales)
wbytes = 2 * (params - (0 if tied else V * H)) - (2 - vb) * linears
wbytes1 = wbytes - vb * (params - active)  # a batch-1 step: of a MoE layer k experts
kv_tok = 2 * L * NKV * D * kv_bytes  # K and V bytes per token
def summary(name, log=None):
    lines = open(log or f"{d}/{name}.log").readlines()
    line = [l for l in lines if l.startswith("nanovllm:") and "requests" in l][-1]
    num = lambda pat, l=line: float(re.search(pat, l).group(1))
    r = dict(seconds=num(r"tokens in ([\d.]+) s"), gen=num(r"\+ (\d+) generated"), prompt=num(r"\| (\d+) prompt"),
             prefill=num(r"prefill (\d+) tok/s"), decode=num(r"decode (\d+) tok/s"), first=num(r"first token ([\d.]+) s"))
    lat = [l for l in lines if l.startswith("nanovllm: latency")]
    if lat:
        r.update(sched=re.search(r"scheduler (\w+)", lat[-1]).group(1),
                 ttft=(num(r"first token median ([\d.]+) s", lat[-1]), num(r"first token median [\d.]+ s, p99 ([\d.]+) s", lat[-1])),
                 tpot=(num(r"output token median ([\d.]+) ms", lat[-1]), num(r"output token median [\d.]+ ms, p99 ([\d.]+) ms", lat[-1])))
    return r
rows = []
print(f"\nGPU: {gpu} | copy bandwidth {bw/1e9:.0f} GB/s | bf16 GEMM {tf/1e12:.0f} TFLOP/s | model {model}: {params/1e9:.3f} B params"
      f" | KV cache {'fp8' if kv_bytes == 1 else 'bf16'} | linear weights {'fp8' if fp8w else 'bf16'}")
reqs = [json.loads(l) for l in open(f"{d}/throughput.jsonl")]
steps = max(r["max_tokens"] for r in reqs) - 1
kv = sum(sum(len(r["prompt_token_ids"]) + k for k in range(1, r["max_tokens"])) for r in reqs) * kv_tok
t_roof = sum(r["max_tokens"] for r in reqs) / ((steps * wbytes + kv) / bw)  # tok/s at the bandwidth floor
floor_ms = (wbytes1 + (512 + 256) * kv_tok) / bw * 1000  # batch-1: mean context of the 512 decode steps
if only == "ladder":
    print(f"\n{'rung':<22} {'batch-1 ms/token':<28} {'bench.py throughput':<30}")
    for r in rungs:
        lat, thr = summary(None, f"{d}/ladder-{r}-latency.log"), summary(None, f"{d}/ladder-{r}-throughput.log")
        ms, tput = 1000 / lat["decode"], thr["gen"] / thr["seconds"]
        print(f"{r:<22} {ms:7.3f} ({100 * floor_ms / ms:3.0f}% of {floor_ms:.3f}) {'':<6}"
              f"{tput:8.0f} tok/s ({100 * tput / t_roof:3.0f}% of {t_roof:.0f})")
    sys.exit(0)
if only in ("", "throughput"):
    s = summary("throughput")
    outs = [o for o in map(json.loads, open(f"{d}/throughput.out.jsonl")) if "summary" not in o]
    ptok, gtok = sum(o["prompt_tokens"] for o in outs), sum(len(o["token_ids"]) for o in outs)
    reqs = [json.loads(l) for l in open(f"{d}/throughput.jsonl")]
    assert ptok == 142827 and gtok == 133966, f"workload totals {ptok} prompt / {gtok} output, expected 142827 / 133966"
    # Roofline: each decode step reads the weights once plus the KV of every running sequence.
    steps = max(r["max_tokens"] for r in reqs) - 1
    kv = sum(sum(len(r["prompt_token_ids"]) + k for k in range(1, r["max_tokens"])) for r in reqs) * kv_tok
    floor = (steps * wbytes + kv) / bw
    tput = gtok / s["seconds"]
    print(f"Total: {gtok} tok, Time: {s['seconds']:.2f} s, Throughput: {tput:.0f} tok/s "
          f"({100 * tput / (gtok / floor):.0f}% of the {gtok / floor:.0f} tok/s bandwidth roofline)")
    rows.append(("bench.py throughput", f"{tput:.0f} tok/s", f"{100 * tput / (gtok / floor):.0f}% of {gtok / floor:.0f} tok/s"))
if only in ("", "latency"):
    s = summary("latency")
    ms = 1000 / s["decode"]
    floor_ms = (wbytes1 + (512 + 256) * kv_tok) / bw * 1000  # mean context of the 512 decode steps
    rows.append(("batch-1 decode", f"{ms:.3f} ms/token", f"{100 * floor_ms / ms:.0f}% of the {floor_ms:.3f} ms floor"))
    rows.append(("cold start", f"{s['first']:.2f} s to first token", "process start, load and graphs included"))
if only in ("", "prefill"):
    s = summary("prefill")
    flops = 2 * (active - V * H * (1 if tied else 2)) + 4 * NH * D * 1024 * L  # per token: the layers' weights +
    # causal attention (mean 1024 keys)
    ceil = tf / flops
    what = "GEMM ceiling"
    if fp8w:  # the layers' products run on FP8 tensor cores: twice the bf16 rate on Hopper, not measured here
        ceil = tf / (flops - active_linears)
        what = "GEMM ceiling (FP8 products at 2x the measured bf16 rate)"
    rows.append(("prefill (64 x 2048)", f"{s['prefill']:.0f} tok/s", f"{100 * s['prefill'] / ceil:.0f}% of the {ceil:.0f} tok/s {what}"))
if only == "dataparallel":  # the roofline of one replica (its --tp GPUs); N replicas: N times it at most
    one, many = summary("throughput"), summary("dataparallel")
    t1, tn = one["gen"] / one["seconds"], many["gen"] / many["seconds"]
    rows.append(("bench.py, 1 replica", f"{t1:.0f} tok/s", f"{100 * t1 / t_roof:.0f}% of {t_roof:.0f} tok/s"))
    rows.append((f"bench.py x {dp}, -dp {dp}", f"{tn:.0f} tok/s",
                 f"{tn / (dp * t1):.3f} x ({dp} x one replica's); {100 * tn / (dp * t_roof):.0f}% of {dp} x {t_roof:.0f} tok/s"))
if only == "ten":  # measure 8: a decode step of 10 reads the weights of 10 tokens and 10 contexts' K/V
    s = summary("ten")
    touched = E * (1 - (1 - k / E) ** 10) if E else 0  # experts per MoE layer
    wbytes10 = wbytes1 + vb * len(moe) * (touched - k) * 3 * H * IE if E else wbytes
    floor10 = (wbytes10 + 10 * (2048 + 512) * kv_tok) / bw * 1000
    rows.append(("10 at once, 2048/1024", f"TPOT {s['tpot'][0]:.2f} ms (p99 {s['tpot'][1]:.2f})",
                 f"{100 * floor10 / s['tpot'][0]:.0f}% of the {floor10:.2f} ms floor; TTFT median {1e3 * s['ttft'][0]:.0f} ms"))
for w in ("short", "staggered"):
    if only != w: continue
    s = summary(w)
    tput = s["gen"] / s["seconds"]
    bound = ""
    if w == "short":  # a bandwidth bound: every step reads the weights, at most 512 sequences decode per step,
        # and each output token's step reads its sequence's whole context (arrivals do not limit it)
        rs = [json.loads(l) for l in open(f"{d}/short.jsonl")]
        gen = sum(r["max_tokens"] for r in rs)
        n_steps = max(max(r["max_tokens"] for r in rs) - 1, -(-gen // 512))
        kv_reads = sum(sum(len(r["prompt_token_ids"]) + k for k in range(1, r["max_tokens"])) for r in rs) * kv_tok
        roof = gen / ((n_steps * wbytes + kv_reads) / bw)
        bound = f"{100 * tput / roof:.0f}% of {roof:.0f} tok/s; "
    rows.append((f"{w} ({s['sched']})", f"{tput:.0f} tok/s",
                 f"{bound}TTFT median/p99 {1e3 * s['ttft'][0]:.0f} / {1e3 * s['ttft'][1]:.0f} ms, TPOT median/p99 "
                 f"{s['tpot'][0]:.2f} / {s['tpot'][1]:.2f} ms"))
print(f"\n{'measure':<22} {'result':<26} roofline")
for r in rows:
    print(f"{r[0]:<22} {r[1]:<26} {r[2]}")
PY
