#!/usr/bin/env python3
"""Write a tiny Qwen3 model folder nanovllm accepts, or one broken in a named way. Python stdlib only.

Usage:  python3 test/ref/make_tiny_checkpoint.py OUT_DIR [--random] [--shards] [--fp8 bf16|f32] [--moe]
                                              [--break KIND] [--set KEY=JSON ...] [--del KEY ...]
Writes OUT_DIR/config.json, generation_config.json and model.safetensors (or two shards and
model.safetensors.index.json with --shards). The tokenizer files are not written: copy them in.
--set/--del change config.json (the tensors follow the changed shape where they can).
--fp8 SCALES writes an FP8 checkpoint as Qwen/Qwen3-*-FP8 are: config.json's quantization_config, each
linear projection of a layer as F8_E4M3 with X.weight_scale_inv [ceil(out/128), ceil(in/128)] in BF16 or F32
(--set/--del then apply to that config too). With --moe, as Qwen/Qwen3-30B-A3B-FP8 is: every expert's gate_proj,
up_proj and down_proj in F8_E4M3 with its own scales (model.layers.0.mlp.experts.E.gate_proj.weight_scale_inv
[1, 2], down_proj's [2, 1]), the dense layer's MLP and the attention likewise; the router mlp.gate.weight stays BF16
without scales (REFERENCE.md section 14: never quantized), as do the embedding and the norms. config.json carries
the dense FP8 folders' quantization_config (no modules_to_not_convert), as hf_reference.py's FP8 MoE shapes do.
Shape: the "tiny" of test/ref/hf_reference.py (H 256, I 768, 2 layers, 4 query heads, 2 KV heads, D 128,
V 151936, tied embeddings). Weights are zeros stored sparsely (the file costs no disk), or with --random
small random bf16 values (a model the GPU can run; not a model that says anything): a block of 4099 values
(a prime, so no row or expert repeats another's) repeated, each tensor starting at its own place in it (by
a hash of its name), so no two tensors, experts or tensor-parallel slices hold the same values.
--moe writes a Qwen3MoeForCausalLM folder instead (REFERENCE.md section 14), the "tiny-moe" of hf_reference.py:
the same attention, and config.json's architectures ["Qwen3MoeForCausalLM"], model_type "qwen3_moe", num_experts
8, num_experts_per_tok 2, moe_intermediate_size 128, norm_topk_prob true, decoder_sparse_step 1, mlp_only_layers
[1]: layer 0 is MoE, layer 1 a dense MLP of intermediate_size. A MoE layer's tensors are as on disk in Qwen's
checkpoints: the router model.layers.N.mlp.gate.weight [num_experts, H] and, per expert E,
model.layers.N.mlp.experts.E.{gate,up}_proj.weight [moe_intermediate_size, H] and down_proj.weight
[H, moe_intermediate_size] (transformers 5.x packs these at load; the files hold them one by one). --set of
num_experts, moe_intermediate_size, decoder_sparse_step or mlp_only_layers reshapes the tensors too. The moe_
breaks below but moe_fp8_scale_missing are checked by cli_errors.sh and test/host/test_moe.cu; the fp8_ breaks
work with --moe --fp8 too (the tensors they name are attention's and the dense layer 1's).
--break KIND corrupts the checkpoint in one way; test/cli/cli_errors.sh checks the error each one gives:
"""
import json, os, random, struct, sys, zlib

CONFIG = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=256, intermediate_size=768,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
              vocab_size=151936, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6,
              tie_word_embeddings=True, torch_dtype="bfloat16", attention_bias=False,
              eos_token_id=151645, bos_token_id=151643)

BREAKS = {
    "truncated": "model.safetensors cut to half its size",
    "header_len": "the 8-byte header length points past the end of the file",
    "header_json": "the header is not JSON",
    "dtype_unknown": "a tensor has dtype Q4",
    "dtype_unsupported": "a tensor is I16 (valid safetensors, not a weight dtype nanovllm loads)",
    "span": "a tensor's shape times its dtype size differs from its data_offsets span",
    "offsets": "the last tensor's data_offsets run past the end of the file",
    "overlap": "two tensors share bytes",
    "missing": "model.norm.weight is absent",
    "no_lm_head": "config.json says tie_word_embeddings false, but there is no lm_head.weight",
    "shape": "model.layers.1.self_attn.k_norm.weight is [2, 64] instead of [128]",
    "shard_missing": "(with --shards) the index names a shard file that does not exist",
    "index_json": "(with --shards) model.safetensors.index.json is not JSON",
    "fp8_scale_missing": "(with --fp8) model.layers.1.mlp.down_proj.weight_scale_inv is absent",
    "fp8_scale_shape": "(with --fp8) model.layers.1.mlp.down_proj.weight_scale_inv is [2, 2] instead of [2, 6]",
    "fp8_scale_dtype": "(with --fp8 bf16) model.layers.0.self_attn.k_proj.weight_scale_inv is F16",
    "fp8_weight_dtype": "(with --fp8) model.layers.0.self_attn.q_proj.weight is F8_E5M2",
    "moe_expert_missing": "(with --moe) model.layers.0.mlp.experts.7.up_proj.weight is absent",
    "moe_router_shape": "(with --moe) model.layers.0.mlp.gate.weight is [256, 8] instead of [8, 256]",
    "moe_topk": "(with --moe) config.json says num_experts_per_tok 9 with num_experts 8",
    "moe_fp8_scale_missing": "(with --moe --fp8) model.layers.0.mlp.experts.7.down_proj.weight_scale_inv is absent",
}
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
MOE_CONFIG = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[1], router_aux_loss_coef=0.001,
                  output_router_logits=False)  # the last two: training only, in Qwen's config.json too
__doc__ += "".join(f"  {k:22s} {v}\n" for k, v in BREAKS.items())


def tensors(c, fp8=None):
    """[(name, shape, dtype)]: BF16, or with fp8 = "BF16"/"F32" the layers' linears (and a MoE layer's experts) in
    F8_E4M3 + their scales; a MoE router (mlp.gate.weight) stays BF16 without scales, as in Qwen's FP8 MoE files."""
    out = []
    for name, shape in bf16_tensors(c):
        if fp8 and len(shape) == 2 and ".layers." in name and not name.endswith(".mlp.gate.weight"):
            out.append((name, shape, "F8_E4M3"))
            out.append((name + "_scale_inv", [-(-shape[0] // 128), -(-shape[1] // 128)], fp8))
        else:
            out.append((name, shape, "BF16"))
    return out


def is_moe_layer(c, l):
    """Layer l is a MoE layer (transformers' Qwen3MoeDecoderLayer): experts configured, l not in mlp_only_layers,
    and (l + 1) % decoder_sparse_step == 0. A dense config (no moe_intermediate_size) has none, whatever
    --set num_experts says: the dense files stay as they were."""
    return ("moe_intermediate_size" in c and c.get("num_experts", 0) > 0 and l not in c.get("mlp_only_layers", [])
            and (l + 1) % c.get("decoder_sparse_step", 1) == 0)


def mlp_tensors(c, p):
    """[(name, shape)] of layer prefix p's MLP: dense gate/up/down, or for a MoE layer the router and each
    expert's three projections, named as Qwen's checkpoints name them on disk."""
    H, I = c["hidden_size"], c["intermediate_size"]
    if not is_moe_layer(c, int(p.split(".")[2])):
        return [(p + "mlp.gate_proj.weight", [I, H]), (p + "mlp.up_proj.weight", [I, H]),
                (p + "mlp.down_proj.weight", [H, I])]
    E, MI = c["num_experts"], c["moe_intermediate_size"]
    out = [(p + "mlp.gate.weight", [E, H])]
    for e in range(E):
        q = f"{p}mlp.experts.{e}."
        out += [(q + "gate_proj.weight", [MI, H]), (q + "up_proj.weight", [MI, H]),
                (q + "down_proj.weight", [H, MI])]
    return out


def bf16_tensors(c):
    H, D, V = c["hidden_size"], c["head_dim"], c["vocab_size"]
    NH, NKV = c["num_attention_heads"], c["num_key_value_heads"]
    out = [("model.embed_tokens.weight", [V, H]), ("model.norm.weight", [H])]
    if not c["tie_word_embeddings"]:
        out.append(("lm_head.weight", [V, H]))
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        out += [(p + "input_layernorm.weight", [H]), (p + "post_attention_layernorm.weight", [H]),
                (p + "self_attn.q_proj.weight", [NH * D, H]), (p + "self_attn.k_proj.weight", [NKV * D, H]),
                (p + "self_attn.v_proj.weight", [NKV * D, H]), (p + "self_attn.q_norm.weight", [D]),
                (p + "self_attn.k_norm.weight", [D]), (p + "self_attn.o_proj.weight", [H, NH * D])]
        out += mlp_tensors(c, p)
    return out


def bf16_block(n_values, rng, norm):
    """n_values bf16 values: 1 + small noise for norm weights, else ~N(0, 0.05)."""
    vals = []
    for _ in range(n_values):
        x = (1.0 + rng.gauss(0, 0.05)) if norm else rng.gauss(0, 0.05)
        vals.append(struct.unpack("<I", struct.pack("<f", x))[0] >> 16)
    return struct.pack(f"<{n_values}H", *vals)


SIZE = {"BF16": 2, "F32": 4, "F8_E4M3": 1}


def fp8_block(n_values, rng):
    """n_values e4m3 bytes, any but the two NaNs (0x7F, 0xFF)."""
    return bytes(b if b & 0x7F != 0x7F else b - 1 for b in (rng.randrange(256) for _ in range(n_values)))


def write_safetensors(path, entries, random_values, brk):
    """entries: [(name, shape, dtype)]. Returns nothing; applies the header-level breaks."""
    header, off = {}, 0
    for name, shape, dtype in entries:
        n = SIZE[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    data_size = off
    names = [n for n, _, _ in entries]
    if brk == "dtype_unknown":
        header[names[-1]]["dtype"] = "Q4"
    if brk == "dtype_unsupported":
        header[names[-1]]["dtype"] = "I16"
    if brk == "span":
        header[names[1]]["shape"] = [header[names[1]]["shape"][0] - 1]
    if brk == "offsets":
        b, e = header[names[-1]]["data_offsets"]
        header[names[-1]]["data_offsets"] = [b + 64, e + 64]
    if brk == "overlap":
        b, e = header[names[2]]["data_offsets"]
        header[names[2]]["data_offsets"] = [b - 2, e - 2]
    if brk == "shape":
        for n in names:
            if n.endswith("layers.1.self_attn.k_norm.weight"):
                header[n]["shape"] = [2, 64]
    if brk == "moe_router_shape":  # transposed: the same element count and span, so only a shape check refuses it
        for n in names:
            if n == "model.layers.0.mlp.gate.weight":
                header[n]["shape"] = header[n]["shape"][::-1]
    for n in names:
        if brk == "fp8_scale_shape" and n.endswith("layers.1.mlp.down_proj.weight_scale_inv"):
            header[n]["shape"] = [2, 2]
            b, e = header[n]["data_offsets"]
            header[n]["data_offsets"] = [b, b + (e - b) // 3]  # 12 of 4 bytes (f32) or 8 of 2 (bf16) : a span
            # that fits the new shape, so the shape check (not the span check) is what refuses it
        if brk == "fp8_scale_dtype" and n.endswith("layers.0.self_attn.k_proj.weight_scale_inv"):
            header[n]["dtype"] = "F16"
        if brk == "fp8_weight_dtype" and n.endswith("layers.0.self_attn.q_proj.weight"):
            header[n]["dtype"] = "F8_E5M2"
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    if brk == "header_json":
        text = b"{" + text[1:-1] + b" ,,"
    hlen = (1 << 32) if brk == "header_len" else len(text)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", hlen))
        f.write(text)
        start = f.tell()
        if random_values:
            rng = random.Random(0)
            block = {True: bf16_block(4099, rng, True), False: bf16_block(4099, rng, False),
                     "F8_E4M3": fp8_block(4099, rng), "BF16_scale": struct.pack("<H", 0x39A0) * 2048,
                     "F32_scale": struct.pack("<f", 3e-4) * 1024}  # scale ~ amax / 448 of N(0, 0.05) weights
            for name, shape, dtype in entries:
                nbytes = SIZE[dtype]
                for d in shape:
                    nbytes *= d
                key = (dtype + "_scale" if name.endswith("_scale_inv") else dtype if dtype == "F8_E4M3"
                       else name.endswith("norm.weight"))
                b = block[key]
                at = zlib.crc32(name.encode()) % (len(b) // SIZE[dtype]) * SIZE[dtype]  # this tensor's own
                rep = (b[at:] + b * (nbytes // len(b) + 1))[:nbytes]
                f.write(rep)
        f.truncate(start + data_size)  # zeros, stored sparsely
    if brk == "truncated":
        os.truncate(path, (start + data_size) // 2)


def main():
    args = sys.argv[1:]
    if not args or args[0].startswith("-"):
        sys.exit(__doc__)
    out = args[0]
    random_values = "--random" in args
    shards = "--shards" in args
    brk = args[args.index("--break") + 1] if "--break" in args else None
    if brk is not None and brk not in BREAKS:
        sys.exit(f"unknown --break {brk}; one of {', '.join(BREAKS)}")
    fp8 = args[args.index("--fp8") + 1] if "--fp8" in args else None
    if fp8 is not None and fp8 not in ("bf16", "f32"):
        sys.exit(f"--fp8 takes bf16 or f32 (the scales' dtype), found {fp8}")
    fp8 = {"bf16": "BF16", "f32": "F32"}.get(fp8)
    moe = "--moe" in args
    if brk is not None and brk.startswith("moe_") and not moe:
        sys.exit(f"--break {brk} needs --moe")
    if brk == "moe_fp8_scale_missing" and not fp8:
        sys.exit(f"--break {brk} needs --fp8")
    base = dict(CONFIG, **MOE_CONFIG) if moe else dict(CONFIG)
    config = dict(base)
    if fp8:
        config["quantization_config"] = dict(FP8_CONFIG)
    for i, a in enumerate(args):
        if a == "--set":
            key, value = args[i + 1].split("=", 1)
            config[key] = json.loads(value)
        if a == "--del":
            del config[args[i + 1]]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [151645, 151643], "bos_token_id": 151643}, f)
    shape = dict(base)
    shape.update({k: v for k, v in config.items() if type(v) is bool or (type(v) is int and v > 0)})
    if type(config.get("mlp_only_layers")) is list and all(type(x) is int for x in config["mlp_only_layers"]):
        shape["mlp_only_layers"] = config["mlp_only_layers"]  # a list: the line above keeps only numbers and flags
    entries = tensors(shape, fp8)
    if brk == "no_lm_head":
        config["tie_word_embeddings"] = False
    if brk == "moe_topk":
        config["num_experts_per_tok"] = config["num_experts"] + 1
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if brk == "missing":
        entries = [e for e in entries if e[0] != "model.norm.weight"]
    if brk == "fp8_scale_missing":
        entries = [e for e in entries if e[0] != "model.layers.1.mlp.down_proj.weight_scale_inv"]
    if brk == "moe_expert_missing":
        entries = [e for e in entries if e[0] != "model.layers.0.mlp.experts.7.up_proj.weight"]
    if brk == "moe_fp8_scale_missing":
        entries = [e for e in entries if e[0] != "model.layers.0.mlp.experts.7.down_proj.weight_scale_inv"]
    if not shards:
        write_safetensors(os.path.join(out, "model.safetensors"), entries, random_values, brk)
        return
    half = len(entries) // 2
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {}
    for i, part in enumerate([entries[:half], entries[half:]]):
        write_safetensors(os.path.join(out, files[i]), part, random_values, brk if i == 1 else None)
        weight_map.update({n: files[i] for n, _, _ in part})
    if brk == "shard_missing":
        weight_map[entries[-1][0]] = "model-00003-of-00002.safetensors"
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        if brk == "index_json":
            f.write('{"weight_map": {')
        else:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)


if __name__ == "__main__":
    main()
