#!/usr/bin/env python3
"""Make random-weight Qwen3 checkpoints and Hugging Face reference data for the end-to-end GPU test.

Usage:  python3 test/ref/hf_reference.py OUT_DIR TOKENIZER_DIR [SHAPE ...]
Needs torch and transformers (Qwen3ForCausalLM). For each shape it writes OUT_DIR/SHAPE/:
  model.safetensors, config.json, generation_config.json, tokenizer files  (a model folder nanovllm loads)
  cases.json         the logits cases: prompt ids, and per case the error of transformers' own bf16 model
                     against the fp32 reference (the yardstick our error is held to)
  ref_logits_N.f32   fp32 reference logits [V] at the last position of case N
  gen_prompts.json   8 prompts of mixed length for the generation checks
Shapes: tiny (2 layers), 0.6b (the exact Qwen3-0.6B shape), 8b-short (Qwen3-8B's width, untied, 2 layers).
FP8 shapes (an FP8 checkpoint made the way Qwen's are, nanovllm.cu section 6a): tiny-fp8 (BF16 scales),
tiny-fp8-f32 (F32 scales), odd-fp8 (H 264, I 776: partial 128 x 128 blocks on both edges, untied, F32 scales),
0.6b-fp8 and 8b-short-fp8 (BF16 scales). Per 128 x 128 block of each linear projection: scale = amax / 448
(rounded to the scale's dtype first), weight = e4m3(W / scale), stored as X.weight (F8_E4M3) and
X.weight_scale_inv [ceil(out/128), ceil(in/128)]. The reference logits come from the model on the dequantized
weights, bf16(e4m3 * scale) with the product in fp32, which is what the engine loads; SHAPE/bf16-dequantized/
holds those weights as a plain checkpoint. Where every dimension is a multiple of 128 the script also loads the
FP8 folder with transformers' FineGrainedFP8Config(dequantize=True) and requires the same weights, bit for bit
(it exits non-zero otherwise; "hf_dequantize" in cases.json says what was found).
The embedding (and untied LM head) are drawn with std 0.1 instead of 0.02 so logits are not flat: greedy
choices then have margins that bf16 rounding cannot flip, and the argmax checks mean something.
"""
import json, os, shutil, sys
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, tie_word_embeddings=True),
    "8b-short": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=2, num_attention_heads=32,
                     num_key_value_heads=8, tie_word_embeddings=False),
}
FP8_SHAPES = {  # name: (the bf16 shape it quantizes, the scales' dtype)
    "tiny-fp8": ("tiny", "bf16"), "tiny-fp8-f32": ("tiny", "f32"), "odd-fp8": ("odd", "f32"),
    "0.6b-fp8": ("0.6b", "bf16"), "8b-short-fp8": ("8b-short", "bf16"),
}
ODD = dict(hidden_size=264, intermediate_size=776, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, tie_word_embeddings=False)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
LOGIT_LENS = [1, 7, 255, 256, 257, 1000, 3000]


def quantize_fp8(w, scale_dtype):
    """w [out, in] (any float dtype) -> (e4m3 [out, in], scale [ceil(out/128), ceil(in/128)] in scale_dtype,
    the dequantized bf16 weight). Per 128 x 128 block (partial at the edges): scale = amax / 448 (1 for an all-zero
    block), rounded to scale_dtype; e4m3 = round(clamp(w / scale, +-448)) to nearest even."""
    out, inn = w.shape
    rb, cb = -(-out // 128), -(-inn // 128)
    wf = w.float()
    pad = torch.zeros(rb * 128, cb * 128, dtype=torch.float32, device=w.device)
    pad[:out, :inn] = wf
    amax = pad.reshape(rb, 128, cb, 128).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)).to(scale_dtype)
    s_full = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:out, :inn]
    q = (wf / s_full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    deq = (q.float() * s_full).to(torch.bfloat16)  # fp32 product, one rounding: what nanovllm loads
    return q, scale, deq
GEN_LENS = [5, 17, 100, 255, 256, 300, 600, 1000]


def make(out, tok_dir, name):
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    torch.manual_seed(0)
    base, scale_dtype = FP8_SHAPES.get(name, (name, None))
    cfg = Qwen3Config(vocab_size=151936, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
                      rms_norm_eps=1e-6, eos_token_id=[151645, 151643], bos_token_id=151643,
                      **(ODD if base == "odd" else SHAPES[base]))
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.1)
        if not cfg.tie_word_embeddings:
            model.lm_head.weight.normal_(0, 0.1)
    model = model.to(torch.bfloat16)
    hf_dequantize = None
    if scale_dtype:
        hf_dequantize = save_fp8(model, d, {"bf16": torch.bfloat16, "f32": torch.float32}[scale_dtype], name)
    else:
        model.save_pretrained(d, safe_serialization=True)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [151645, 151643], "bos_token_id": 151643}, f)
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(tok_dir, fn)):
            shutil.copy(os.path.join(tok_dir, fn), d)
    dev = "cuda"
    m16 = model.to(dev).eval()
    m32 = Qwen3ForCausalLM(cfg).to(dev).eval()
    m32.load_state_dict({k: v.float() for k, v in m16.state_dict().items()})
    m32 = m32.float()
    g = torch.Generator().manual_seed(1)
    cases = []
    for i, n in enumerate(LOGIT_LENS):
        ids = torch.randint(0, 151643, (n,), generator=g).tolist()
        x = torch.tensor([ids], device=dev)
        with torch.no_grad():
            ref = m32(x).logits[0, -1].float()
            got = m16(x).logits[0, -1].float()
        err = ((got - ref).norm() / ref.norm()).item()
        top2 = torch.topk(ref, 2).values
        ref.cpu().numpy().astype("float32").tofile(os.path.join(d, f"ref_logits_{i}.f32"))
        cases.append({"ids": ids, "hf_bf16_rel_err": err, "hf_dequantize": hf_dequantize, "hf_bf16_max_abs_err": (got - ref).abs().max().item(),
                      "ref_argmax": int(ref.argmax()), "ref_top2_margin": (top2[0] - top2[1]).item()})
        print(f"{name}: logits case {n:5d} tokens: transformers bf16 vs fp32 rel err {err:.2e}", flush=True)
    with open(os.path.join(d, "cases.json"), "w") as f:
        json.dump(cases, f)
    prompts = [torch.randint(0, 151643, (n,), generator=g).tolist() for n in GEN_LENS]
    with open(os.path.join(d, "gen_prompts.json"), "w") as f:
        json.dump(prompts, f)
    del m16, m32
    torch.cuda.empty_cache()


def save_fp8(model, d, scale_dtype, name):
    """Quantize the layers' linears of `model` in place to their dequantized values, write d/bf16-dequantized/
    (a plain checkpoint of them) and d/ as the FP8 checkpoint; then, where transformers can read it (every
    dimension a multiple of 128), check its dequantization against ours. Returns what that check found."""
    from safetensors.torch import load_file, save_file
    fp8 = {}
    with torch.no_grad():
        for l, layer in enumerate(model.model.layers):
            for lin in LINEARS:
                mod = layer.get_submodule(lin)
                q, scale, deq = quantize_fp8(mod.weight.data, scale_dtype)
                mod.weight.data.copy_(deq)
                fp8[f"model.layers.{l}.{lin}.weight"] = (q, scale)
    model.save_pretrained(os.path.join(d, "bf16-dequantized"), safe_serialization=True)
    model.save_pretrained(d, safe_serialization=True)
    files = [f for f in os.listdir(d) if f.endswith(".safetensors")]
    for f in files:
        path = os.path.join(d, f)
        tensors = load_file(path)
        for k in list(tensors):
            if k in fp8:
                tensors[k] = fp8[k][0].contiguous()
                tensors[k + "_scale_inv"] = fp8[k][1].contiguous()
        save_file(tensors, path, metadata={"format": "pt"})
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):  # a sharded save: the scales go in their weight's shard
        with open(index) as f:
            j = json.load(f)
        for k in fp8:
            j["weight_map"][k + "_scale_inv"] = j["weight_map"][k]
        with open(index, "w") as f:
            json.dump(j, f, indent=2)
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    c["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    dims = [q.shape for q, _ in fp8.values()]
    if any(x % 128 for s in dims for x in s):
        print(f"{name}: transformers' FP8 dequantization skipped (it needs every dimension a multiple of 128)")
        return "skipped: dimensions not multiples of 128"
    from transformers import FineGrainedFP8Config
    hf = Qwen3ForCausalLM.from_pretrained(d, quantization_config=FineGrainedFP8Config(dequantize=True),
                                          dtype=torch.bfloat16)
    ours, theirs = model.state_dict(), hf.state_dict()
    bad = [k for k in fp8 if not torch.equal(ours[k].cpu(), theirs[k].to(torch.bfloat16).cpu())]
    print(f"{name}: transformers' FineGrainedFP8Config(dequantize=True) vs our dequantization: "
          f"{len(fp8) - len(bad)} of {len(fp8)} linears bit for bit" + (f"; differ: {bad[:3]}" if bad else ""))
    del hf
    if bad:
        sys.exit(f"{name}: transformers dequantizes {len(bad)} linears differently, e.g. {bad[0]}")
    return "equal"


if __name__ == "__main__":
    out, tok = sys.argv[1], sys.argv[2]
    for name in (sys.argv[3:] or SHAPES):
        make(out, tok, name)
