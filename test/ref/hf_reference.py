#!/usr/bin/env python3
"""Make random-weight Qwen3 checkpoints and Hugging Face reference data for the end-to-end GPU test.

Usage:  python3 test/ref/hf_reference.py OUT_DIR TOKENIZER_DIR [SHAPE ...]
Needs torch and transformers (Qwen3ForCausalLM; Qwen3MoeForCausalLM for the MoE shapes). For each shape it writes
OUT_DIR/SHAPE/:
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
                       "ref_q8_argmax", "ref_q8_top2_margin", "q8_vs_fp32_rel_err" (the relative L2
                       difference from ref_logits_N, also printed) and "q8_vs_fp32_max_abs_err".
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
                           "ref_w8a8_argmax", "ref_w8a8_top2_margin", "w8a8_vs_fp32_rel_err" (the relative L2
                           difference from ref_logits_N, also printed) and "w8a8_vs_fp32_max_abs_err" (the
                           largest |difference| of one logit). On deep shapes the engine's FP8 path
                           is about as far from this emulation as the emulation is from ref_logits_N (activation
                           rounding decisions decorrelate through the layers), so a bar on the engine's distance
                           scales with *_vs_fp32_rel_err.
  fp8_emulation.json       what the W8A8 logits mean, in words (FP8_EMULATION)
Where every dimension is a multiple of 128 the script also loads the FP8 folder with transformers'
FineGrainedFP8Config(dequantize=True) and requires the same weights, bit for bit (it exits non-zero otherwise;
"hf_dequantize" in cases.json says what was found).
The embedding (and untied LM head) are drawn with std 0.1 instead of 0.02 so logits are not flat: greedy
choices then have margins that bf16 rounding cannot flip, and the argmax checks mean something.
MoE shapes (only when named; Qwen3MoeForCausalLM, REFERENCE.md section 14): tiny-moe (H 256, 2 layers, 4/2 heads,
D 128, 8 experts top-2, moe_intermediate_size 128, norm_topk_prob true, mlp_only_layers [1] so layer 1 is a dense
MLP of I 768, tied: make_tiny_checkpoint.py --moe's shape), tiny-moe-nonorm (the same with norm_topk_prob false and
mlp_only_layers []: both layers MoE), 30b-a3b-short (Qwen3-30B-A3B's widths: H 2048, 32/4 heads, 128 experts top-8,
moe_intermediate_size 768, I 6144, norm_topk_prob true, untied, 2 layers). The router and the experts are drawn
from N(0, 0.02) here, whatever transformers' own init does (a router of zeros would make every routing a tie).
Each writes SHAPE/ as a bf16 shape does (model files, generation_config.json, tokenizer files, cases.json with the
same keys, ref_logits_N.f32, gen_prompts.json, and ref_q8_logits_N.f32 with the q8 keys: the engine's --quantization
fp8 quantizes a MoE checkpoint's attention linears, its dense layers' MLP and every expert at load, and the W8A8
emulation below covers the experts), the reference being transformers' Qwen3MoeForCausalLM in fp32 with
experts_implementation "eager" (eager_experts: each chosen expert's down(silu(gate(x)) * up(x)) by F.linear in fp32,
times its fp32 routing weight, index_add_ into the token's row), and also:
  moe.json           which transformers behaviour the reference follows (MOE_FACTS: the router, fp32 routing
                     weights in the multiply, the layouts) and what this run found: transformers' and torch's
                     versions, the experts implementation used, the dtype of the routing weights in transformers'
                     own bf16 model (the yardstick's), the MoE and dense layers, how the tensors were written,
                     and which keys config.json was completed with (head_dim and the MoE keys as Qwen's files
                     spell them, where save_pretrained's config.json lacked them or aliased num_experts)
  router_case.json   for a kernel test: the first MoE layer on logits case ROUTER_CASE (the 7-token prompt), per
                     token the router's logits, its fp32 probabilities over all experts, the top-k expert ids (in
                     torch.topk's order, descending) and weights (after norm_topk_prob), and the gap between the
                     k-th and (k+1)-th probability, as transformers' gate computes them (a forward hook on mlp.gate:
                     recomputed from the hooked input and compared with what the gate returned, "gate_output_check")
  router_input.f32   that gate's input, fp32 [7, H] row-major (the fp32 model's post_attention_layernorm output)
cases.json of a MoE shape adds per case "router_min_gap" (the smallest k-th minus (k+1)-th fp32 probability over
every MoE layer and token: how near routing came to a tie), "routing_pairs" (tokens x MoE layers) and
"hf_bf16_routing_flips" (the pairs where transformers' bf16 model chose another expert set than the fp32 reference:
each such flip moves that token's MoE output by a whole expert's share, so a bar on the engine's error has to allow
for flips as transformers' own bf16 error does; bf16 rounding flips near-ties whatever the router's scale).
On disk the experts are per expert, as Qwen's released checkpoints hold them: model.layers.N.mlp.experts.E.
{gate,up}_proj.weight [moe_intermediate_size, H], down_proj.weight [H, moe_intermediate_size], and the router
model.layers.N.mlp.gate.weight [num_experts, H]. transformers 5.x keeps them packed in memory
(mlp.experts.gate_up_proj [E, 2I, H], gate rows first, and mlp.experts.down_proj [E, H, I]): its
conversion_mapping.py gives qwen3_moe
(qwen2_moe's copy) WeightConverters that stack "mlp.experts.*.gate_proj.weight" and "*.up_proj.weight"
(MergeModulelist(dim=0), Concatenate(dim=1)) and "*.down_proj.weight" (MergeModulelist(dim=0)) at load, and
save_pretrained (save_original_format=True, its default) calls core_model_loading.revert_weight_conversion, which
for a model not made by from_pretrained reverses that same mapping (Chunk, SplitModulelist): the files come out
per expert. Early 5.0 development snapshots reversed only renames and would write the packed tensors, so save_moe
does not trust it: it reads back the names written and, unless they are exactly the per-expert ones with the same
values, rewrites model.safetensors per expert from the state dict itself (moe.json "tensors_written" says which);
then from_pretrained of the folder must give back the saved weights bit for bit (it exits non-zero otherwise).
FP8 MoE shapes (only when named; an FP8 checkpoint made as Qwen/Qwen3-30B-A3B-FP8 is, REFERENCE.md sections 12 and
14): tiny-moe-fp8 (tiny-moe quantized, BF16 scales), tiny-moe-nonorm-fp8 (tiny-moe-nonorm, F32 scales),
30b-a3b-short-fp8 (30b-a3b-short, BF16 scales); each drawn with its bf16 shape's seed, so it is that shape's weights
quantized. Every matrix layer_matrices names is quantized as the dense FP8 shapes' linears are (per 128 x 128 block of
one matrix: an expert's gate_proj, up_proj and down_proj each on their own) and stored per expert, as Qwen's files
hold them: X.weight F8_E4M3 [out, in] and X.weight_scale_inv [ceil(out/128), ceil(in/128)] for every layer's
self_attn.{q,k,v,o}_proj, a dense (mlp_only_layers) layer's mlp.{gate,up,down}_proj and every expert's
mlp.experts.E.{gate,up,down}_proj; the router mlp.gate.weight, the embedding, the norms and lm_head stay bf16.
config.json is the MoE shape's plus the dense FP8 shapes' quantization_config (FP8_QUANTIZATION_CONFIG: no
modules_to_not_convert; see MOE_FP8_FACTS). The folder holds what a MoE shape's does (moe.json, router_case.json,
router_input.f32, cases.json's routing keys), every reference being of the model on the dequantized weights, and
what a dense FP8 shape's does: bf16-dequantized/ (a plain per-expert bf16 MoE checkpoint of bf16(e4m3 * scale),
written and checked by save_moe), ref_logits_N.f32 and the hf_bf16_* yardsticks of the model on those weights,
ref_w8a8_logits_N.f32 with the w8a8 keys, and fp8_emulation.json. moe.json adds "fp8_checkpoint" (MOE_FP8_FACTS and
what this run found: the scales' dtype, how the files were written, transformers' dequantization). transformers'
FineGrainedFP8Config(dequantize=True) is tried on the folder (hf_dequantize_moe): where it loads the folder and
dequantizes every quantized matrix, the same bit-for-bit requirement as the dense FP8 shapes (it exits non-zero
otherwise); where it cannot (from_pretrained raises or reports keys it missed or did not use, or a matrix comes
back in e4m3 or without its scale applied), the check is skipped with the reason printed and written to cases.json's
"hf_dequantize" and moe.json.
The W8A8 emulation of a MoE model (w8a8_linears, for ref_w8a8_* and ref_q8_* alike): the attention and dense
linears as above; each expert's weights e4m3 * scale in fp32 (transformers 5.x: packed into mlp.experts.gate_up_proj
and down_proj, gate rows first), and transformers' own eager loop over the chosen experts (eager_experts) run with
the input of each of its F.linear calls fake-quantized per token per 128 columns (ExpertInputsW8A8): the gate_up
product's x (the normed hidden row) and the down product's act = silu(gate) * up, as the engine quantizes them. The
router's product is not quantized (its bf16 weight widened, its fp32 input), and the routing weights stay fp32.
cases.json of a MoE shape then also has "w8a8_routing_flips" (FP8 shapes) or "q8_routing_flips" (bf16 shapes): the
(token, layer) pairs where the emulation chose another expert set than the fp32 reference (the activations' rounding
in the layers before moves the router's input), each moving that token's output by a whole expert's share.
hf_check_generation.py imports w8a8_emulation and q8_emulation from here, so both scripts emulate FP8 one way,
and model_class and eager_experts, so both load a MoE folder one way.
"""
import contextlib, json, os, shutil, sys
import torch
import torch.overrides  # TorchFunctionMode: ExpertInputsW8A8
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

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
MOE_SHAPES = {
    "tiny-moe": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, tie_word_embeddings=True, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=128, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1]),
    "30b-a3b-short": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=2, num_attention_heads=32,
                          num_key_value_heads=4, tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[]),
}
MOE_SHAPES["tiny-moe-nonorm"] = dict(MOE_SHAPES["tiny-moe"], norm_topk_prob=False, mlp_only_layers=[])
MOE_FACTS = {
    "reference": "transformers' Qwen3MoeForCausalLM in fp32 on the bf16 checkpoint's weights widened exactly, "
                 "experts_implementation eager",
    "router": "logits = F.linear(x, mlp.gate.weight), no bias; softmax over all experts in fp32; torch.topk; "
              "divided by the top-k sum when norm_topk_prob",
    "routing_weights_in_multiply": "fp32: each chosen expert's down(silu(gate(x)) * up(x)) times its fp32 routing "
                                   "weight, index_add_ into the token's row, experts in ascending id order",
    "disk_layout": "per expert: model.layers.N.mlp.experts.E.{gate,up}_proj.weight [I, H], "
                   "model.layers.N.mlp.experts.E.down_proj.weight [H, I]; "
                   "router model.layers.N.mlp.gate.weight [E, H]; a dense layer (mlp_only_layers) "
                   "model.layers.N.mlp.{gate,up,down}_proj.weight",
    "transformers_5_memory_layout": "mlp.experts.gate_up_proj [E, 2I, H] (gate rows first), mlp.experts.down_proj "
                                    "[E, H, I], packed at load by the qwen3_moe conversion mapping",
}
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
            "mlp_only_layers")  # config.json's MoE keys, spelled as in Qwen's files
MOE_FP8_SHAPES = {  # name: (the bf16 MoE shape it quantizes, the scales' dtype), as FP8_SHAPES
    "tiny-moe-fp8": ("tiny-moe", "bf16"), "tiny-moe-nonorm-fp8": ("tiny-moe-nonorm", "f32"),
    "30b-a3b-short-fp8": ("30b-a3b-short", "bf16"),
}
SCALE_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
# config.json's quantization_config of every FP8 folder written here, as the Qwen3 FP8 releases spell it (REFERENCE.md
# section 12). No modules_to_not_convert: the dense 0.6B-32B releases carry none, and what the MoE releases list was
# not checked against a published file here; the engine never quantizes a MoE router (mlp.gate) whatever the list says.
FP8_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                           "weight_block_size": [128, 128]}
FP8_MOE_EMULATION = {  # fp8_emulation.json of a MoE FP8 shape adds these to FP8_EMULATION
    "experts": "transformers' eager loop over the chosen experts, each F.linear with weights e4m3*scale in fp32 and "
               "its input fake-quantized per token per 128 columns: x (the normed hidden row) for gate_up, "
               "act = silu(gate)*up for down; routing weights fp32",
    "router": "not quantized: F.linear of its fp32 input by its bf16 weight widened, as the fp32 reference",
}
MOE_FP8_FACTS = {
    "quantized": "F8_E4M3 [out, in] + weight_scale_inv [ceil(out/128), ceil(in/128)] per 128 x 128 block of one "
                 "matrix: every layer's self_attn.{q,k,v,o}_proj, a dense (mlp_only_layers) layer's "
                 "mlp.{gate,up,down}_proj, every expert's mlp.experts.E.{gate,up,down}_proj (stored per expert)",
    "not_quantized": "bf16: the router mlp.gate.weight, model.embed_tokens, lm_head, the norms",
    "quantization_config": FP8_QUANTIZATION_CONFIG,
    "modules_to_not_convert": "none written, as the dense FP8 shapes (the dense Qwen3 FP8 releases carry none; the "
                              "MoE releases' list was not checked against a published config.json here)",
    "dequantized": "bf16-dequantized/: bf16(e4m3 * scale), the product in fp32; ref_logits_N and hf_bf16_* are of "
                   "the model on these weights",
    "w8a8_reference": "ref_w8a8_logits_N: the W8A8 emulation (FP8_EMULATION and FP8_MOE_EMULATION), the router "
                      "unquantized",
}
MOE_Q8_FACTS = ("ref_q8_logits_N: the engine's --quantization fp8 (every attention linear, dense MLP linear and expert "
                "matrix quantized at load per 128 x 128 block, scale = amax / 448 in fp32), computed W8A8 as "
                "FP8_EMULATION and FP8_MOE_EMULATION say; the router unquantized")
LOGIT_LENS = [1, 7, 255, 256, 257, 1000, 3000]
ROUTER_CASE = LOGIT_LENS.index(7)  # router_case.json's prompt: a few tokens, each with its own routing
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


def dequantize(q, scale):
    """e4m3 [out, in] and its block scales -> the fp32 weight e4m3 * scale (not rounded to bf16): what the W8A8
    reference multiplies by."""
    return q.float() * expand_blocks(scale, *q.shape)


def layer_matrices(model):
    """{"model.layers.L.X.weight": (w, consumer)} for every matrix an FP8 checkpoint of `model` quantizes, named as
    on disk: each layer's self_attn.{q,k,v,o}_proj; a dense layer's (a Qwen3 layer, or a MoE model's mlp_only_layers)
    mlp.{gate,up,down}_proj; a MoE layer's mlp.experts.E.{gate,up,down}_proj for every expert E. Never the router
    mlp.gate (REFERENCE.md section 14: it stays bf16), the embedding, the norms or lm_head. w is the [out, in] tensor
    holding that matrix in `model` (a view: writing it writes the model): the Linear's weight, or for transformers
    5.x's packed experts rows [:I] (gate) and [I:] (up) of mlp.experts.gate_up_proj[E] and mlp.experts.down_proj[E]
    (transformers 4.x keeps a Linear per expert). consumer is the module whose forward multiplies by it: the Linear,
    or the packed experts module. Call under torch.no_grad() when writing the views."""
    out = {}
    for l, layer in enumerate(model.model.layers):
        pre = f"model.layers.{l}."
        experts = getattr(layer.mlp, "experts", None)  # a MoE layer's (mlp.gate is its router)
        for lin in LINEARS if experts is None else LINEARS[:4]:
            mod = layer.get_submodule(lin)
            out[f"{pre}{lin}.weight"] = (mod.weight, mod)
        if experts is None:
            continue
        if hasattr(experts, "gate_up_proj"):  # transformers 5.x: [E, 2I, H] (gate rows first) and [E, H, I]
            gu, dn = experts.gate_up_proj, experts.down_proj
            E, I2, H = gu.shape
            assert not getattr(experts, "is_transposed", False) and not getattr(experts, "has_bias", False), \
                f"{pre}mlp.experts: transposed or biased experts, not Qwen3-MoE's layout"
            assert I2 % 2 == 0 and tuple(dn.shape) == (E, H, I2 // 2), \
                f"{pre}mlp.experts: gate_up_proj {tuple(gu.shape)} and down_proj {tuple(dn.shape)}"
            for e in range(E):
                q = f"{pre}mlp.experts.{e}."
                out[q + "gate_proj.weight"] = (gu[e, :I2 // 2], experts)
                out[q + "up_proj.weight"] = (gu[e, I2 // 2:], experts)
                out[q + "down_proj.weight"] = (dn[e], experts)
        else:  # transformers 4.x: a ModuleList of MLPs, each with its gate_proj, up_proj and down_proj Linears
            for e, mlp in enumerate(experts):
                for lin in ("gate_proj", "up_proj", "down_proj"):
                    mod = mlp.get_submodule(lin)
                    out[f"{pre}mlp.experts.{e}.{lin}.weight"] = (mod.weight, mod)
    return out


def quantize_layers(model, scale_dtype):
    """Quantize every matrix of layer_matrices(model) (a bf16 model) with quantize_fp8(w, scale_dtype), replace it
    in place by its dequantized value, bf16(e4m3 * scale), and return {its disk name: (e4m3, scale)}: how the FP8
    shapes' checkpoints are made, dense or MoE."""
    fp8 = {}
    with torch.no_grad():
        for name, (w, _) in layer_matrices(model).items():
            q, scale, deq = quantize_fp8(w, scale_dtype)
            w.copy_(deq)
            fp8[name] = (q, scale)
    return fp8


LINEAR_FUNCS = (torch.nn.functional.linear, torch._C._nn.linear)  # the same builtin, under either name


class ExpertInputsW8A8(torch.overrides.TorchFunctionMode):
    """Entered around one forward of a packed experts module (transformers 5.x, its "eager" implementation: the
    loop over the chosen experts, eager_experts): every F.linear call made inside is one expert's product,
    F.linear(x[tokens], gate_up_proj[e]) or F.linear(act, down_proj[e]) with act = silu(gate) * up, and gets its
    input through fake_quantize_fp8 (per token per 128 columns: how the engine quantizes x and act) before the
    product in fp32; the rest of the loop (the routing weights in fp32, index_add_) is transformers' own. Counts the
    products; one whose weight is not a slice of this module's gate_up_proj or down_proj is an error (the loop is
    not the one this emulation was written against). A TorchFunctionMode sees F.linear however the module's code
    names it, and is off inside its own handler, so fake_quantize_fp8's torch calls pass straight through."""

    def __init__(self, experts):
        super().__init__()
        self.storages = {experts.gate_up_proj.untyped_storage().data_ptr(),
                         experts.down_proj.untyped_storage().data_ptr()}
        self.products = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not any(func is f for f in LINEAR_FUNCS):
            return func(*args, **kwargs)
        bound = dict(zip(("input", "weight", "bias"), args), **kwargs)
        w = bound["weight"]
        if w.untyped_storage().data_ptr() not in self.storages:
            raise RuntimeError(f"an F.linear by a weight {tuple(w.shape)} that is not one of the experts' inside "
                               f"their forward: not the eager loop ExpertInputsW8A8 emulates")
        self.products += 1
        return func(fake_quantize_fp8(bound["input"]), w, bound.get("bias"))


def quantize_expert_inputs(experts):
    """Make a packed experts module compute its products W8A8 (its weights already e4m3 * scale): its forward runs
    inside ExpertInputsW8A8, and must make exactly two products (gate_up, down) for each expert some token chose,
    else it raises (grouped_mm or batched_mm would make none: eager_experts pins "eager"). Returns experts."""
    forward = type(experts).forward  # transformers' dispatch to config._experts_implementation

    def w8a8_forward(*args, **kwargs):
        mode = ExpertInputsW8A8(experts)
        with mode:
            out = forward(experts, *args, **kwargs)
        top_k_index = kwargs["top_k_index"] if "top_k_index" in kwargs else args[1]
        chosen = int(torch.unique(top_k_index).numel())
        if mode.products != 2 * chosen:
            raise RuntimeError(f"the experts' forward made {mode.products} products for {chosen} experts chosen, "
                               f"expected {2 * chosen}: not the eager loop ExpertInputsW8A8 emulates")
        return out

    experts.forward = w8a8_forward  # an instance attribute: nn.Module.__call__ calls it, hooks included
    return experts


def w8a8_linears(model, qs):
    """Make the fp32 `model` (on any device; Qwen3 or Qwen3-MoE) a W8A8 reference in place and return it: qs holds
    (e4m3 [out, in], scale [ceil(out/128), ceil(in/128)]) for every matrix of layer_matrices(model), and nothing
    else. Each such matrix gets the weight e4m3 * scale per 128 x 128 block (dequantize: fp32, not rounded to
    bf16), and its product a fake-quantized input (fake_quantize_fp8), so it computes y = x_hat @ W^T in fp32: a
    Linear through a forward pre-hook on its input, a MoE layer's packed experts through quantize_expert_inputs
    (x for gate_up, act = silu(gate) * up for down, in transformers' eager loop, which eager_experts pins).
    Embedding, norms, attention, the MoE router (mlp.gate: its bf16 weight and fp32 input as in the fp32 model),
    the routing, lm_head: unchanged. The one definition of the W8A8 linears, for FP8 folders (w8a8_emulation) and
    for bf16 checkpoints quantized at load (q8_emulation)."""
    consumers = {}
    with torch.no_grad():
        mats = layer_matrices(eager_experts(model))
        extra, lacking = sorted(set(qs) - set(mats)), sorted(set(mats) - set(qs))
        assert not extra, f"FP8 tensors that are no layer's linear or expert: {extra[:3]}"
        assert not lacking, f"layer linears or experts without FP8 weights: {lacking[:3]}"
        for name, (w, mod) in mats.items():
            assert w.dtype == torch.float32, "the W8A8 reference is an fp32 model"
            w.copy_(dequantize(*(t.to(w.device) for t in qs[name])))  # (one fp32 product: the same bits anywhere)
            consumers[id(mod)] = mod
    for mod in consumers.values():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_pre_hook(lambda m, args: (fake_quantize_fp8(args[0]),) + args[1:])
        else:
            quantize_expert_inputs(mod)
    return model


def w8a8_emulation(model, d):
    """Make the fp32 `model` the W8A8 reference of FP8 folder d, in place, and return it: w8a8_linears with
    d's own e4m3 weights and scales (fp8_tensors), the reference for an FP8 checkpoint computed in FP8."""
    return w8a8_linears(model, fp8_tensors(d))


def q8_emulation(model):
    """Make the fp32 `model`, whose weights are a bf16 checkpoint's widened exactly, the W8A8 reference of the
    engine's --quantization fp8 in place, and return it: w8a8_linears with each layer matrix's (q, scale) =
    quantize_fp8(its own weight, torch.float32), as the engine quantizes at load (per 128 x 128 block, scale =
    amax / 448 in fp32, 1 for an all-zero block; e4m3 round to nearest even, saturating): a dense model's seven
    layer linears, a MoE model's attention linears, dense-layer MLPs and every expert's gate, up and down (each on
    its own blocks; the engine's stacked gate and up rows block the same way, moe_intermediate_size being a
    multiple of 128 wherever it keeps experts in FP8), never the router."""
    with torch.no_grad():
        qs = {}
        for name, (w, _) in layer_matrices(eager_experts(model)).items():
            assert torch.equal(w, w.to(torch.bfloat16).float()), "q8_emulation quantizes bf16 weights"
            qs[name] = quantize_fp8(w, torch.float32)[:2]
    return w8a8_linears(model, qs)


def fp32_copy(m16, cfg, dev):
    """An fp32 model of m16's class (Qwen3ForCausalLM or Qwen3MoeForCausalLM) on dev with m16's weights (widened
    exactly)."""
    m32 = type(m16)(cfg).to(dev).eval()
    m32.load_state_dict({k: v.float() for k, v in m16.state_dict().items()})
    return m32.float()


def w8a8_case(m8, x, ref, d, tag, i):
    """Logits case i (ids x) under the W8A8 reference m8: writes its last-position logits to
    d/ref_{tag}_logits_{i}.f32; returns its cases.json entries, "ref_{tag}_argmax", "ref_{tag}_top2_margin" and
    "{tag}_vs_fp32_rel_err" (the relative L2 difference from the plain fp32 reference logits ref) and
    "{tag}_vs_fp32_max_abs_err" (the largest difference of one logit), and that relative difference. tag: "w8a8"
    (an FP8 folder's weights) or "q8" (a bf16 checkpoint's, quantized as at load)."""
    with torch.no_grad():
        w8 = m8(x).logits[0, -1].float()
    w8.cpu().numpy().astype("float32").tofile(os.path.join(d, f"ref_{tag}_logits_{i}.f32"))
    top2 = torch.topk(w8, 2).values
    rel = ((w8 - ref).norm() / ref.norm()).item()
    entries = {f"ref_{tag}_argmax": int(w8.argmax()), f"ref_{tag}_top2_margin": (top2[0] - top2[1]).item(),
               f"{tag}_vs_fp32_rel_err": rel, f"{tag}_vs_fp32_max_abs_err": (w8 - ref).abs().max().item()}
    return entries, rel


def write_folder_files(d, tok_dir):
    """What a model folder holds besides the weights and config.json: generation_config.json (Qwen3's EOS
    ids) and the tokenizer's files."""
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [151645, 151643], "bos_token_id": 151643}, f)
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(tok_dir, fn)):
            shutil.copy(os.path.join(tok_dir, fn), d)


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
        hf_dequantize = save_fp8(model, d, SCALE_DTYPES[scale_dtype], name)
        with open(os.path.join(d, "fp8_emulation.json"), "w") as f:
            json.dump(FP8_EMULATION, f, indent=2)
    else:
        model.save_pretrained(d, safe_serialization=True)
    write_folder_files(d, tok_dir)
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
    fp8 = quantize_layers(model, scale_dtype)  # the seven linears of each layer
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
    c["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
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


# Qwen3-MoE (REFERENCE.md section 14): the MoE shapes, and what hf_check_generation.py needs to load their folders.

def model_class(d):
    """Qwen3MoeForCausalLM for a folder whose config.json names it in "architectures", else Qwen3ForCausalLM."""
    with open(os.path.join(d, "config.json")) as f:
        arch = json.load(f).get("architectures") or []
    return Qwen3MoeForCausalLM if "Qwen3MoeForCausalLM" in arch else Qwen3ForCausalLM


def eager_experts(model):
    """Pin a MoE model's experts to transformers' "eager" forward and return the model: the loop over the chosen
    experts with F.linear per expert, not grouped_mm / batched_mm, which transformers 5.x may pick by default (other
    summation orders, and torch._grouped_mm's fp32 support is not something to lean on). transformers 4.x has only
    the loop; dense models pass."""
    if getattr(model.config, "num_experts", 0) and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    return model


def moe_layers(cfg):
    """The MoE layers, as Qwen3MoeDecoderLayer decides: l not in mlp_only_layers and (l + 1) % decoder_sparse_step
    == 0."""
    return [l for l in range(cfg.num_hidden_layers) if cfg.num_experts > 0 and l not in cfg.mlp_only_layers
            and (l + 1) % cfg.decoder_sparse_step == 0]


def disk_tensors(model, cfg):
    """{name: bf16 tensor} of `model` as Qwen's checkpoints lay it out on disk: transformers 5.x's packed
    mlp.experts.gate_up_proj [E, 2I, H] split into experts.E.gate_proj.weight (rows :I) and up_proj.weight (rows
    I:), mlp.experts.down_proj [E, H, I] into experts.E.down_proj.weight; 4.x's per-expert modules as they are; the
    tied lm_head left out. Checks that exactly the MoE layers have a router."""
    E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    out = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if k.endswith(".mlp.experts.gate_up_proj"):
            assert tuple(v.shape) == (E, 2 * I, H), f"{k}: {tuple(v.shape)}, expected [E, 2I, H] (not transposed)"
            for e in range(E):
                out[f"{k[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = v[e, :I].contiguous()
                out[f"{k[:-len('gate_up_proj')]}{e}.up_proj.weight"] = v[e, I:].contiguous()
        elif k.endswith(".mlp.experts.down_proj"):
            assert tuple(v.shape) == (E, H, I), f"{k}: {tuple(v.shape)}, expected [E, H, I] (not transposed)"
            for e in range(E):
                out[f"{k[:-len('down_proj')]}{e}.down_proj.weight"] = v[e].contiguous()
        else:
            out[k] = v.contiguous()
    routed = [l for l in range(cfg.num_hidden_layers) if f"model.layers.{l}.mlp.gate.weight" in out]
    assert routed == moe_layers(cfg), f"routers in layers {routed}, MoE layers {moe_layers(cfg)}"
    return out


def check_moe_config(model, cfg, name):
    """Exit unless the model took head_dim 128 and rope_theta 1e6: some transformers 5.x Qwen3MoeConfig declare
    neither (head_dim then rides as an extra attribute, rope_theta goes into rope_parameters), and attention falls
    back to hidden_size / num_attention_heads (64 here) without head_dim."""
    attn = model.model.layers[0].self_attn
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
    if attn.head_dim != 128 or attn.q_proj.out_features != cfg.num_attention_heads * 128 or theta != 1e6:
        sys.exit(f"{name}: the model has head_dim {attn.head_dim}, q_proj {attn.q_proj.out_features} rows and "
                 f"rope_theta {theta}; expected 128, {cfg.num_attention_heads * 128} and 1e6")


def save_moe(model, cfg, d, name):
    """Write the bf16 `model` to d (config.json, safetensors) with its experts per expert, as Qwen's checkpoints are
    (see the docstring at the top for why save_pretrained alone is not trusted); then require from_pretrained of d
    to give back model's weights bit for bit. Returns what moe.json says of it: "tensors_written" (how) and
    "config_json_completed" (the keys of Qwen's config.json that save_pretrained's lacked or spelled otherwise, e.g.
    num_experts written as num_local_experts where the config class aliases it, added with their values).
    """
    from safetensors import safe_open
    from safetensors.torch import save_file
    model.save_pretrained(d, safe_serialization=True)
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    fixed = {k: v for k, v in dict(head_dim=128, **{k: getattr(cfg, k) for k in MOE_KEYS}).items() if c.get(k) != v}
    if fixed:  # the engine reads these names, as Qwen's files have them
        print(f"{name}: config.json completed with {fixed}", flush=True)
        c.update(fixed)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f, indent=2)
    want = disk_tensors(model, cfg)
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    got = {}
    for f in files:
        with safe_open(os.path.join(d, f), framework="pt") as s:
            got.update({k: s.get_tensor(k) for k in s.keys()})
    if set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want):
        how = "save_pretrained's own files: per-expert names, values equal to the packed tensors' slices"
    else:
        extra, lacking = sorted(set(got) - set(want))[:3], sorted(set(want) - set(got))[:3]
        how = (f"rewritten per expert by hf_reference.py into one model.safetensors: save_pretrained's files had "
               f"{extra or 'no other names'} beyond the per-expert ones and lacked {lacking or 'none'}"
               + ("" if extra or lacking else ", but other values"))
        for f in files + ["model.safetensors.index.json"]:
            if os.path.exists(os.path.join(d, f)):
                os.remove(os.path.join(d, f))
        save_file(want, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    del got
    print(f"{name}: tensors on disk: {how}", flush=True)
    back = Qwen3MoeForCausalLM.from_pretrained(d, dtype=torch.bfloat16).state_dict()
    ours = model.state_dict()
    bad = sorted(set(ours) ^ set(back)) or [k for k in ours  # (a module kept in fp32 at load is compared in bf16)
                                             if not torch.equal(ours[k].cpu(), back[k].cpu().to(ours[k].dtype))]
    if bad:
        sys.exit(f"{name}: from_pretrained of {d} does not give back the saved weights: {bad[:3]}")
    print(f"{name}: from_pretrained of the folder gives back all {len(ours)} tensors bit for bit", flush=True)
    return {"tensors_written": how, "config_json_completed": sorted(fixed)}


@contextlib.contextmanager
def gate_calls(model, layers):
    """While inside: {layer: (input, output)} of each listed MoE layer's last gate (mlp.gate) call."""
    calls = {}
    hooks = [model.model.layers[l].mlp.gate.register_forward_hook(
        lambda mod, args, kwargs, out, l=l: calls.__setitem__(l, (args[0] if args else next(iter(kwargs.values())),
                                                                  out)), with_kwargs=True) for l in layers]
    try:
        yield calls
    finally:
        for h in hooks:
            h.remove()


def routing(gate, x, cfg):
    """(logits, probs, weights, ids) of gate on x [..., H] as Qwen3-MoE routes: logits = F.linear(x, gate.weight) in
    x's dtype, fp32 softmax over all experts, torch.topk, divided by the top-k sum when norm_topk_prob (weights stay
    fp32). The same calls as transformers' router (5.x) or sparse block (4.x), so the same bits."""
    logits = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), gate.weight)
    probs = torch.nn.functional.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, probs, weights, ids


def check_gate(out, logits, weights, ids):
    """Compare routing()'s result with what the gate returned: transformers 5.x's router returns (logits or probs,
    weights [T, k] or dense scores [T, E], ids [T, k]), 4.x's gate (a Linear) the logits. Returns (a phrase for the
    JSON, the dtype of the routing weights the gate returned or None)."""
    if torch.is_tensor(out):
        same = torch.equal(out.reshape(logits.shape), logits)
        return ("equal: the gate returns the logits; the block routes from them" if same else "logits differ"), None
    ints = [t for t in out if torch.is_tensor(t) and not t.is_floating_point()]
    if len(ints) != 1 or not torch.equal(ints[0].reshape(ids.shape), ids):
        return f"expert ids differ or not found in {[tuple(t.shape) for t in out if torch.is_tensor(t)]}", None
    floats = [t.reshape(-1, t.shape[-1]) for t in out if torch.is_tensor(t) and t.is_floating_point()]
    for t in sorted(floats, key=lambda t: t.shape != weights.shape):  # [T, k] weights before [T, E] scores
        mine = t if t.shape == weights.shape else t.gather(1, ids) if t.shape == logits.shape else None
        if mine is not None and torch.equal(mine, weights.to(t.dtype)):
            return f"equal: expert ids, and weights in {t.dtype}", str(t.dtype).replace("torch.", "")
    return "expert ids equal, weights differ", None


def kth_gap(probs, k):
    """Per token, the k-th minus the (k+1)-th largest probability (None where k is every expert)."""
    if k >= probs.shape[-1]:
        return None
    top = torch.topk(probs, k + 1, dim=-1).values
    return top[:, k - 1] - top[:, k]


def routing_flips(m32, c32, m, c, cfg):
    """The (layer, token) pairs of one forward where model m (its gate_calls c) chose another expert set than the fp32
    reference m32 (c32): transformers' bf16 model, or a W8A8 emulation."""
    flips = 0
    for l, (x, _) in c32.items():
        ids = routing(m32.model.layers[l].mlp.gate, x, cfg)[3]
        ids_m = routing(m.model.layers[l].mlp.gate, c[l][0], cfg)[3]
        flips += int((ids.sort(dim=-1).values != ids_m.sort(dim=-1).values).any(dim=-1).sum())
    return flips


def routing_stats(m32, m16, c32, c16, cfg):
    """(router_min_gap, hf_bf16_routing_flips) of one forward of each model, from their gate_calls: the smallest
    kth_gap of the fp32 reference over every MoE layer and token (None if top-k is every expert), and the (layer,
    token) pairs where the bf16 model's expert set differs from the fp32 reference's (routing_flips)."""
    gaps = []
    for l, (x, _) in c32.items():
        gap = kth_gap(routing(m32.model.layers[l].mlp.gate, x, cfg)[1], cfg.num_experts_per_tok)
        if gap is not None:
            gaps.append(gap.min().item())
    return (min(gaps) if gaps else None), routing_flips(m32, c32, m16, c16, cfg)


def write_router_case(d, m32, calls, cfg, layer, i, ids):
    """router_case.json and router_input.f32 (see the docstring at the top) for layer `layer` on case i (ids)."""
    x, out = calls[layer]
    logits, probs, weights, experts = routing(m32.model.layers[layer].mlp.gate, x, cfg)
    check, _ = check_gate(out, logits, weights, experts)
    if not check.startswith("equal"):
        print(f"WARNING {d}: the gate's own output and the recomputed routing: {check}", flush=True)
    gap = kth_gap(probs, cfg.num_experts_per_tok)
    x.reshape(-1, x.shape[-1]).float().cpu().numpy().astype("float32").tofile(os.path.join(d, "router_input.f32"))
    tokens = [{"token": ids[t], "expert_ids": experts[t].tolist(), "weights": weights[t].tolist(),
               "kth_gap": None if gap is None else gap[t].item(), "probs": probs[t].tolist(),
               "logits": logits[t].float().tolist()} for t in range(len(ids))]
    with open(os.path.join(d, "router_case.json"), "w") as f:
        json.dump({"layer": layer, "case": i, "ids": ids, "num_experts": cfg.num_experts,
                   "num_experts_per_tok": cfg.num_experts_per_tok, "norm_topk_prob": cfg.norm_topk_prob,
                   "input": f"router_input.f32: fp32 [{len(ids)}, {cfg.hidden_size}] row-major, the gate's input",
                   "order": "expert_ids and weights in torch.topk's order (descending probability)",
                   "gate_output_check": check, "tokens": tokens}, f, indent=1)


def make_moe(out, tok_dir, name):
    """One MoE shape (MOE_SHAPES) or FP8 MoE shape (MOE_FP8_SHAPES): the folder, the fp32 reference logits and
    cases.json as make() writes them for a bf16 or FP8 shape (ref_q8_* or bf16-dequantized/ and ref_w8a8_*), and
    moe.json, router_case.json, router_input.f32 (the docstring at the top)."""
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    base, scale_dtype = MOE_FP8_SHAPES.get(name, (name, None))
    torch.manual_seed(0)  # an FP8 shape draws its bf16 shape's weights, then quantizes them
    cfg = Qwen3MoeConfig(vocab_size=151936, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
                         rms_norm_eps=1e-6, eos_token_id=[151645, 151643], bos_token_id=151643, **MOE_SHAPES[base])
    model = eager_experts(Qwen3MoeForCausalLM(cfg))
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.1)
        if not cfg.tie_word_embeddings:
            model.lm_head.weight.normal_(0, 0.1)
        for k, p in model.named_parameters():  # the router and experts drawn here, whatever the init did
            if ".mlp.experts." in k or k.endswith(".mlp.gate.weight"):
                p.normal_(0, 0.02)
    model = model.to(torch.bfloat16)
    check_moe_config(model, cfg, name)
    layers = moe_layers(cfg)
    fp8_facts, hf_dequantize = None, None
    if scale_dtype:  # from here on `model` holds the dequantized weights (save_moe_fp8 put them in)
        written, fp8_facts, hf_dequantize = save_moe_fp8(model, cfg, d, scale_dtype, name)
        with open(os.path.join(d, "fp8_emulation.json"), "w") as f:
            json.dump(dict(FP8_EMULATION, **FP8_MOE_EMULATION), f, indent=2)
    else:
        written = save_moe(model, cfg, d, name)
    write_folder_files(d, tok_dir)
    dev = "cuda"
    m16 = model.to(dev).eval()
    m32 = eager_experts(fp32_copy(m16, cfg, dev))
    # The W8A8 reference, as make()'s: an FP8 shape's weights re-read from d's bytes ("w8a8"), a bf16 shape's own
    # weights quantized as the engine's --quantization fp8 does at load ("q8"); the experts included, the router not.
    m8 = w8a8_emulation(fp32_copy(m16, cfg, dev), d) if scale_dtype else q8_emulation(fp32_copy(m16, cfg, dev))
    tag, what = (("w8a8", "W8A8 emulation") if scale_dtype else
                 ("q8", "W8A8 emulation of the weights quantized at load"))
    g = torch.Generator().manual_seed(1)  # the same prompts as the dense shapes'
    cases, bf16_weights = [], None
    for i, n in enumerate(LOGIT_LENS):
        ids = torch.randint(0, 151643, (n,), generator=g).tolist()
        x = torch.tensor([ids], device=dev)
        with torch.no_grad(), gate_calls(m32, layers) as c32, gate_calls(m16, layers) as c16:
            ref = m32(x).logits[0, -1].float()
            got = m16(x).logits[0, -1].float()
            min_gap, flips = routing_stats(m32, m16, c32, c16, cfg)
            if i == ROUTER_CASE:
                write_router_case(d, m32, c32, cfg, layers[0], i, ids)
                x16, out16 = c16[layers[0]]  # which dtype transformers' bf16 model multiplies by
                lg16, _, w16, e16 = routing(m16.model.layers[layers[0]].mlp.gate, x16, cfg)
                bf16_check, bf16_dtype = check_gate(out16, lg16, w16, e16)
                bf16_weights = bf16_dtype or f"not returned by the gate ({bf16_check})"
        err = ((got - ref).norm() / ref.norm()).item()
        top2 = torch.topk(ref, 2).values
        ref.cpu().numpy().astype("float32").tofile(os.path.join(d, f"ref_logits_{i}.f32"))
        cases.append({"ids": ids, "hf_bf16_rel_err": err, "hf_bf16_max_abs_err": (got - ref).abs().max().item(),
                      "hf_dequantize": hf_dequantize, "ref_argmax": int(ref.argmax()),
                      "ref_top2_margin": (top2[0] - top2[1]).item(), "router_min_gap": min_gap,
                      "routing_pairs": n * len(layers), "hf_bf16_routing_flips": flips})
        print(f"{name}: logits case {n:5d} tokens: transformers bf16 vs fp32 rel err {err:.2e}; routing: smallest "
              f"k-th gap {min_gap}, bf16 flips {flips} of {n * len(layers)}", flush=True)
        with gate_calls(m8, layers) as c8:  # the FP8 compute path's reference, beside the fp32 one
            entries, rel = w8a8_case(m8, x, ref, d, tag, i)
        with torch.no_grad():
            flips8 = routing_flips(m32, c32, m8, c8, cfg)
        cases[-1].update(entries, **{f"{tag}_routing_flips": flips8})
        print(f"{name}: logits case {n:5d} tokens: {what} vs fp32 reference rel diff {rel:.2e}; it routed {flips8} "
              f"of {n * len(layers)} (token, layer) pairs otherwise", flush=True)
    with open(os.path.join(d, "cases.json"), "w") as f:
        json.dump(cases, f)
    prompts = [torch.randint(0, 151643, (n,), generator=g).tolist() for n in GEN_LENS]
    with open(os.path.join(d, "gen_prompts.json"), "w") as f:
        json.dump(prompts, f)
    extra = {"fp8_checkpoint": fp8_facts} if scale_dtype else {"q8_reference": MOE_Q8_FACTS}
    write_moe_json(d, cfg, layers, m32, bf16_weights, dict(written, **extra))
    del m16, m32, m8
    torch.cuda.empty_cache()


def write_moe_json(d, cfg, layers, m32, bf16_weights, written):
    """moe.json: MOE_FACTS and what this run found (see the docstring at the top); written: save_moe's answer (for an
    FP8 shape save_moe_fp8's) and the FP8 entry ("fp8_checkpoint" or "q8_reference")."""
    import transformers
    facts = dict(MOE_FACTS, transformers_version=transformers.__version__, torch_version=torch.__version__,
                 experts_implementation=getattr(m32.config, "_experts_implementation", None) or "eager (4.x)",
                 hf_bf16_routing_weights_dtype=bf16_weights,
                 moe_layers=layers, dense_layers=[l for l in range(cfg.num_hidden_layers) if l not in layers],
                 intermediate_size=cfg.intermediate_size, **{k: getattr(cfg, k) for k in MOE_KEYS}, **written)
    with open(os.path.join(d, "moe.json"), "w") as f:
        json.dump(facts, f, indent=2)


def save_moe_fp8(model, cfg, d, scale_dtype, name):
    """An FP8 MoE shape's checkpoint (the docstring at the top): quantize the bf16 MoE `model` in place to its
    dequantized weights (quantize_layers: attention, dense-layer MLPs, every expert; never the router), write
    d/bf16-dequantized/ with save_moe (per expert, then checked by from_pretrained bit for bit), then d/ as the FP8
    checkpoint: the same tensors per expert with each quantized matrix's e4m3 weight and its weight_scale_inv in its
    place, in one model.safetensors, and bf16-dequantized's config.json plus quantization_config. Returns (moe.json's
    "tensors_written" and "config_json_completed", its "fp8_checkpoint", transformers' check: hf_dequantize_moe)."""
    from safetensors.torch import save_file
    fp8 = quantize_layers(model, SCALE_DTYPES[scale_dtype])
    bf16 = save_moe(model, cfg, os.path.join(d, "bf16-dequantized"), name)
    tensors = disk_tensors(model, cfg)
    lacking = sorted(set(fp8) - set(tensors))
    assert not lacking, f"quantized matrices that are not on disk: {lacking[:3]}"
    for k, (q, scale) in fp8.items():
        tensors[k] = q.contiguous()
        tensors[k + "_scale_inv"] = scale.contiguous()
    for f in os.listdir(d):  # a folder written before (maybe sharded): only this run's files stay
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(d, f))
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    del tensors
    with open(os.path.join(d, "bf16-dequantized", "config.json")) as f:
        c = json.load(f)
    c["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    n_experts = sum(".mlp.experts." in k for k in fp8)
    how = (f"written by hf_reference.py into one model.safetensors, per expert: {len(fp8)} matrices F8_E4M3 with "
           f"{scale_dtype} weight_scale_inv ({n_experts} of them experts'), the routers and the rest bf16")
    print(f"{name}: FP8 checkpoint {how}", flush=True)
    hf = hf_dequantize_moe(model, cfg, d, fp8, name)
    written = {"tensors_written": f"FP8 folder: {how}; bf16-dequantized/: {bf16['tensors_written']}",
               "config_json_completed": bf16["config_json_completed"]}
    facts = dict(MOE_FP8_FACTS, scales_dtype=scale_dtype, quantized_matrices=len(fp8),
                 quantized_expert_matrices=n_experts, hf_dequantize=hf)
    return written, facts, hf


def hf_dequantize_moe(model, cfg, d, fp8, name):
    """transformers' FineGrainedFP8Config(dequantize=True) on FP8 MoE folder d, against our dequantization (`model`,
    bf16, after quantize_layers): every quantized matrix (an expert's from transformers' packed tensors, disk_tensors)
    and every router, bit for bit, as save_fp8 requires of the dense shapes. Returns cases.json's "hf_dequantize":
    "equal", or "skipped: why" where transformers cannot dequantize the folder: from_pretrained raises, reports keys it
    missed, did not use or could not fit, gives a model not laid out as Qwen3-MoE's, or leaves a matrix in e4m3 or
    without its scale applied (its limits, not a different answer: printed and recorded). Exits non-zero where it
    dequantizes a matrix, or reads a router, to other values."""
    from transformers import FineGrainedFP8Config

    def skip(why):
        print(f"{name}: transformers' FP8 dequantization skipped: {why}", flush=True)
        return f"skipped: {why}"

    try:
        got = Qwen3MoeForCausalLM.from_pretrained(d, quantization_config=FineGrainedFP8Config(dequantize=True),
                                                  dtype=torch.bfloat16, output_loading_info=True)
    except Exception as e:  # whatever transformers raises on this folder is the finding
        msg = (str(e).strip().splitlines() or [""])[0][:300]
        return skip(f"from_pretrained with FineGrainedFP8Config(dequantize=True) raised {type(e).__name__}: {msg}")
    hf, info = got if isinstance(got, tuple) else (got, {})  # (model, loading info), or the model alone
    keys = {k: sorted(map(str, info.get(k) or []))[:3] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")
            if info.get(k)}
    if keys:
        del hf
        return skip(f"from_pretrained with FineGrainedFP8Config(dequantize=True) reported {keys}")
    try:
        theirs = disk_tensors(hf, cfg)
    except AssertionError as e:
        del hf
        return skip(f"the model it gives is not laid out as Qwen3-MoE's: {e}")
    del hf
    ours = disk_tensors(model, cfg)
    routers = [k for k in ours if k.endswith(".mlp.gate.weight")]
    not_deq, bad = [], []
    for k in list(fp8) + routers:
        t = theirs.get(k)
        if t is None or not t.is_floating_point() or t.element_size() == 1 or tuple(t.shape) != tuple(ours[k].shape):
            not_deq.append(f"{k} ({'absent' if t is None else f'{t.dtype} {list(t.shape)}'})")
        elif torch.equal(ours[k].cpu(), t.to(torch.bfloat16).cpu()):
            continue
        elif k in fp8 and torch.equal(fp8[k][0].to(torch.bfloat16).cpu(), t.to(torch.bfloat16).cpu()):
            not_deq.append(f"{k} (its e4m3 values, the scale not applied)")
        else:
            bad.append(k)
    if not_deq:
        return skip(f"{len(not_deq)} of {len(fp8)} quantized matrices and {len(routers)} routers not dequantized, "
                    f"e.g. {not_deq[:2]}")
    n = len(fp8) + len(routers)
    print(f"{name}: transformers' FineGrainedFP8Config(dequantize=True) vs our dequantization: {n - len(bad)} of {n} "
          f"matrices (every quantized one, experts included, and the bf16 routers) bit for bit"
          + (f"; differ: {bad[:3]}" if bad else ""), flush=True)
    if bad:
        sys.exit(f"{name}: transformers dequantizes {len(bad)} matrices differently, e.g. {bad[0]}")
    return "equal"


if __name__ == "__main__":
    out, tok = sys.argv[1], sys.argv[2]
    for name in (sys.argv[3:] or SHAPES):
        (make_moe if name in MOE_SHAPES or name in MOE_FP8_SHAPES else make)(out, tok, name)
