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
The folder of each of these bf16 shapes (not of the FP8 ones below) also holds:
  ref_q8_logits_N.f32  fp32 logits [V], same cases and positions, of the reference for the engine's
                       --quantization fp8 (the seven layer linears of this bf16 checkpoint quantized at load, then
                       the FP8 compute path): the W8A8 emulation described below (q8_emulation, through the same
                       w8a8_linears) with weights e4m3 * scale in fp32 from quantize_fp8(the bf16 weight,
                       torch.float32): per 128 x 128 block, scale = amax / 448 in fp32 (1 for an all-zero block),
                       e4m3(W / scale) rounded to nearest even, saturating. cases.json then has per case
                       "ref_q8_argmax", "ref_q8_top2_margin" and "q8_vs_fp32_rel_err" (the relative L2
                       difference from ref_logits_N, also printed).
FP8 shapes (only when named; an FP8 checkpoint made the way Qwen's are, REFERENCE.md section 12): tiny-fp8
(BF16 scales), tiny-fp8-f32 (F32 scales), odd-fp8 (H 264, I 776: partial 128 x 128 blocks on both edges,
untied, F32 scales), 0.6b-fp8 and 8b-short-fp8 (BF16 scales). Per 128 x 128 block of each layer's linear
(q, k, v, o, gate, up, down): scale = amax / 448 (rounded to the scale's dtype first), weight = e4m3(W / scale),
stored as X.weight (F8_E4M3 [out, in]) and X.weight_scale_inv [ceil(out/128), ceil(in/128)]. The folder of an
FP8 shape also holds:
  bf16-dequantized/        a plain bf16 checkpoint of the dequantized weights, bf16(e4m3 * scale) with the
                           product in fp32: what the engine's dequantizing path loads. ref_logits_N.f32 and the
                           hf_bf16_* errors are of the model on these weights.
  ref_w8a8_logits_N.f32    fp32 logits [V], same cases and positions, of the reference for the engine's FP8
                           compute path (W8A8, w8a8_emulation below): each layer's linears with weights
                           e4m3 * scale in fp32 (not rounded to bf16) and inputs fake-quantized to e4m3 per token
                           per group of 128 columns (s = amax / 448, 1 for an all-zero group), the products in
                           fp32; everything else as the fp32 reference. cases.json then has per case
                           "ref_w8a8_argmax", "ref_w8a8_top2_margin" and "w8a8_vs_fp32_rel_err" (the relative
                           L2 difference from ref_logits_N, also printed). On deep shapes the engine's FP8 path
                           is about as far from this emulation as the emulation is from ref_logits_N (activation
                           rounding decisions decorrelate through the layers), so a bar on the engine's distance
                           scales with *_vs_fp32_rel_err.
  fp8_emulation.json       what the W8A8 logits mean, in words (FP8_EMULATION)
Where every dimension is a multiple of 128 the script also loads the FP8 folder with transformers'
FineGrainedFP8Config(dequantize=True) and requires the same weights, bit for bit (it exits non-zero otherwise;
"hf_dequantize" in cases.json says what was found).
The embedding (and untied LM head) are drawn with std 0.1 instead of 0.02 so logits are not flat: greedy
choices then have margins that bf16 rounding cannot flip, and the argmax checks mean something.
hf_check_generation.py imports w8a8_emulation and q8_emulation from here, so both scripts emulate FP8 one way.
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
GEN_LENS = [5, 17, 100, 255, 256, 300, 600, 1000]
FP8_EMULATION = {"activation_group": 128, "scale": "amax/448, 1 for a zero group", "weights": "e4m3*scale in fp32"}


def expand_blocks(scale, out, inn):
    """scale [ceil(out/128), ceil(in/128)] -> fp32 [out, in]: each block's scale on its 128 x 128 elements."""
    return scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:out, :inn]


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
    s_full = expand_blocks(scale, out, inn)
    q = (wf / s_full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    deq = (q.float() * s_full).to(torch.bfloat16)  # fp32 product, one rounding: what nanovllm loads
    return q, scale, deq


# The reference for the engine's FP8 compute path (W8A8): FP8 weights and FP8 activations, products in fp32.

def fake_quantize_fp8(x):
    """x [..., K] -> fp32, rounded as the engine's FP8 activations are: per token, per group of 128 consecutive
    columns (the last group partial), s = amax / 448 in fp32 (1 for an all-zero group), e4m3(clamp(x / s, +-448))
    * s. The zeros padding the last group change no amax and are cut off again."""
    k = x.shape[-1]
    g = torch.nn.functional.pad(x.float(), (0, -k % 128)).unflatten(-1, (-1, 128))
    amax = g.abs().amax(dim=-1, keepdim=True)
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (g / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q.float() * s).flatten(-2)[..., :k]


def fp8_tensors(d):
    """{"model.layers.L.X.weight": (e4m3 [out, in], weight_scale_inv [ceil(out/128), ceil(in/128)])} for every
    F8_E4M3 tensor of FP8 folder d (any number of safetensors files), as stored (the scales in their dtype)."""
    from safetensors import safe_open
    t = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(d, f), framework="pt") as s:  # the layers only: not the embedding
                t.update({k: s.get_tensor(k) for k in s.keys() if ".layers." in k})
    return {k: (q, t[k + "_scale_inv"]) for k, q in t.items() if q.dtype == torch.float8_e4m3fn}


def w8a8_linears(model, qs):
    """Make the fp32 `model` (on any device) a W8A8 reference in place and return it: qs holds (e4m3 [out, in],
    scale [ceil(out/128), ceil(in/128)]) for every "model.layers.L.X.weight" of LINEARS, and nothing else. Each
    such linear gets the weight e4m3 * scale per 128 x 128 block, the product in fp32 (not rounded to bf16), and
    a forward pre-hook that passes its input through fake_quantize_fp8, so it computes y = x_hat @ W^T in fp32.
    Embedding, norms, attention, lm_head: unchanged. The one definition of the W8A8 linears, for FP8 folders
    (w8a8_emulation) and for bf16 checkpoints quantized at load (q8_emulation)."""
    qs = dict(qs)
    with torch.no_grad():
        for l, layer in enumerate(model.model.layers):
            for lin in LINEARS:
                mod = layer.get_submodule(lin)
                assert mod.weight.dtype == torch.float32, "the W8A8 reference is an fp32 model"
                q, scale = qs.pop(f"model.layers.{l}.{lin}.weight")
                mod.weight.copy_(q.float() * expand_blocks(scale, *q.shape))
                mod.register_forward_pre_hook(lambda m, args: (fake_quantize_fp8(args[0]),) + args[1:])
    assert not qs, f"FP8 tensors that are no layer's linear: {list(qs)[:3]}"
    return model


def w8a8_emulation(model, d):
    """Make the fp32 `model` the W8A8 reference of FP8 folder d, in place, and return it: w8a8_linears with
    d's own e4m3 weights and scales (fp8_tensors), the reference for an FP8 checkpoint computed in FP8."""
    return w8a8_linears(model, fp8_tensors(d))


def q8_emulation(model):
    """Make the fp32 `model`, whose weights are a bf16 checkpoint's widened exactly, the W8A8 reference of the
    engine's --quantization fp8 in place, and return it: w8a8_linears with each layer linear's (q, scale) =
    quantize_fp8(its own weight, torch.float32), as the engine quantizes at load (per 128 x 128 block, scale =
    amax / 448 in fp32, 1 for an all-zero block; e4m3 round to nearest even, saturating)."""
    with torch.no_grad():
        qs = {}
        for l, layer in enumerate(model.model.layers):
            for lin in LINEARS:
                w = layer.get_submodule(lin).weight
                assert torch.equal(w, w.to(torch.bfloat16).float()), "q8_emulation quantizes bf16 weights"
                qs[f"model.layers.{l}.{lin}.weight"] = quantize_fp8(w, torch.float32)[:2]
    return w8a8_linears(model, qs)


def fp32_copy(m16, cfg, dev):
    """An fp32 Qwen3ForCausalLM on dev with m16's weights (widened exactly)."""
    m32 = Qwen3ForCausalLM(cfg).to(dev).eval()
    m32.load_state_dict({k: v.float() for k, v in m16.state_dict().items()})
    return m32.float()


def w8a8_case(m8, x, ref, d, tag, i):
    """Logits case i (ids x) under the W8A8 reference m8: writes its last-position logits to
    d/ref_{tag}_logits_{i}.f32; returns its cases.json entries, "ref_{tag}_argmax", "ref_{tag}_top2_margin" and
    "{tag}_vs_fp32_rel_err" (the relative L2 difference from the plain fp32 reference logits ref), and that
    difference. tag: "w8a8" (an FP8 folder's weights) or "q8" (a bf16 checkpoint's, quantized as at load)."""
    with torch.no_grad():
        w8 = m8(x).logits[0, -1].float()
    w8.cpu().numpy().astype("float32").tofile(os.path.join(d, f"ref_{tag}_logits_{i}.f32"))
    top2 = torch.topk(w8, 2).values
    rel = ((w8 - ref).norm() / ref.norm()).item()
    entries = {f"ref_{tag}_argmax": int(w8.argmax()), f"ref_{tag}_top2_margin": (top2[0] - top2[1]).item(),
               f"{tag}_vs_fp32_rel_err": rel}
    return entries, rel


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
        with open(os.path.join(d, "fp8_emulation.json"), "w") as f:
            json.dump(FP8_EMULATION, f, indent=2)
    else:
        model.save_pretrained(d, safe_serialization=True)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [151645, 151643], "bos_token_id": 151643}, f)
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(tok_dir, fn)):
            shutil.copy(os.path.join(tok_dir, fn), d)
    dev = "cuda"
    m16 = model.to(dev).eval()  # for an FP8 shape: the dequantized weights (save_fp8 put them in)
    m32 = fp32_copy(m16, cfg, dev)
    # The W8A8 reference: an FP8 shape's weights re-read from d's bytes ("w8a8"); a bf16 shape's own weights
    # quantized as the engine's --quantization fp8 does at load ("q8").
    m8 = w8a8_emulation(fp32_copy(m16, cfg, dev), d) if scale_dtype else q8_emulation(fp32_copy(m16, cfg, dev))
    tag, what = (("w8a8", "W8A8 emulation") if scale_dtype else
                 ("q8", "W8A8 emulation of the weights quantized at load"))
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
        cases.append({"ids": ids, "hf_bf16_rel_err": err, "hf_bf16_max_abs_err": (got - ref).abs().max().item(),
                      "hf_dequantize": hf_dequantize, "ref_argmax": int(ref.argmax()),
                      "ref_top2_margin": (top2[0] - top2[1]).item()})
        print(f"{name}: logits case {n:5d} tokens: transformers bf16 vs fp32 rel err {err:.2e}", flush=True)
        entries, rel = w8a8_case(m8, x, ref, d, tag, i)  # the FP8 compute path's reference, beside the fp32 one
        cases[-1].update(entries)
        print(f"{name}: logits case {n:5d} tokens: {what} vs fp32 reference rel diff {rel:.2e}", flush=True)
    with open(os.path.join(d, "cases.json"), "w") as f:
        json.dump(cases, f)
    prompts = [torch.randint(0, 151643, (n,), generator=g).tolist() for n in GEN_LENS]
    with open(os.path.join(d, "gen_prompts.json"), "w") as f:
        json.dump(prompts, f)
    del m16, m32, m8
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
