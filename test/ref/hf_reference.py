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
LOGIT_LENS = [1, 7, 255, 256, 257, 1000, 3000]
GEN_LENS = [5, 17, 100, 255, 256, 300, 600, 1000]


def make(out, tok_dir, name):
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=151936, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
                      rms_norm_eps=1e-6, eos_token_id=[151645, 151643], bos_token_id=151643,
                      **SHAPES[name])
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.1)
        if not cfg.tie_word_embeddings:
            model.lm_head.weight.normal_(0, 0.1)
    model = model.to(torch.bfloat16)
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
        cases.append({"ids": ids, "hf_bf16_rel_err": err, "hf_bf16_max_abs_err": (got - ref).abs().max().item(),
                      "ref_argmax": int(ref.argmax()), "ref_top2_margin": (top2[0] - top2[1]).item()})
        print(f"{name}: logits case {n:5d} tokens: transformers bf16 vs fp32 rel err {err:.2e}", flush=True)
    with open(os.path.join(d, "cases.json"), "w") as f:
        json.dump(cases, f)
    prompts = [torch.randint(0, 151643, (n,), generator=g).tolist() for n in GEN_LENS]
    with open(os.path.join(d, "gen_prompts.json"), "w") as f:
        json.dump(prompts, f)
    del m16, m32
    torch.cuda.empty_cache()


if __name__ == "__main__":
    out, tok = sys.argv[1], sys.argv[2]
    for name in (sys.argv[3:] or SHAPES):
        make(out, tok, name)
