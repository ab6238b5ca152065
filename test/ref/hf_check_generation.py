#!/usr/bin/env python3
"""Score nanovllm's greedy generations under teacher forcing with the fp32 Hugging Face model.

Usage:  python3 test/ref/hf_check_generation.py MODEL_DIR
Reads MODEL_DIR/gen_results.json written by build/gpu_e2e: {"tolerance": t, "kv_cache_dtype": "bf16"|"fp8",
"weights": "bf16"|"fp8"|"fp8-quantized" (optional, below; absent = "bf16"), "runs": {name: {"sequences": [[ids]...],
"prompt_lens": [...], and optionally "logprobs" and "penalties"}}}, each sequence one request's prompt + generated
ids. For every generated token, the fp32 reference logits at that position (given OUR prefix) must score our
token within `tolerance` of the reference's best; our token must be the reference's argmax wherever the
reference's top-2 margin is clear of our error (margin > 2/3 x tolerance = 2 x the worst logit error of (a));
and with a bf16 KV cache and bf16 weights ("weights" "bf16" or absent) at least 90% of our tokens must be the
exact argmax. An fp8 cache's larger error flips more near-ties, and so does FP8 compute (either fp8 "weights"
mode): the activations are rounded to e4m3 per token per 128 columns, and those rounding decisions differ
between the engine and the emulation and decorrelate through the layers, so near-ties flip; the margin rule and
the tolerance alone hold those runs, as (a) does.
An FP8 folder of hf_reference.py (MODEL_DIR/bf16-dequantized exists; transformers here cannot run the FP8 one):
the reference model is read from MODEL_DIR/bf16-dequantized, the weights the engine's dequantizing path loads.
"weights" modes (the reference's linears; everything else is the fp32 model):
  "bf16" or absent  the fp32 model as read (MODEL_DIR, or MODEL_DIR/bf16-dequantized for an FP8 folder).
  "fp8"             an FP8 checkpoint computed in FP8 (FP8 weights, FP8 activations); needs an FP8 folder: the
                    reference is hf_reference.py's W8A8 emulation of MODEL_DIR (w8a8_emulation): each layer's
                    linears (and a MoE layer's experts) with weights e4m3 * scale in fp32 from MODEL_DIR's
                    safetensors and inputs fake-quantized to e4m3 per token per group of 128 columns
                    (s = amax / 448), the products in fp32.
  "fp8-quantized"   a bf16 checkpoint the engine quantized at load (--quantization fp8); needs a bf16 folder (no
                    bf16-dequantized/): the same W8A8 emulation with weights quantize_fp8(the model's own bf16
                    weights, torch.float32), e4m3 * scale in fp32 (q8_emulation), as hf_reference.py's
                    ref_q8_logits_N.
Both emulations go through hf_reference.py's w8a8_linears, the one definition both scripts use.
A MoE folder (config.json's architectures names Qwen3MoeForCausalLM: hf_reference.py's MoE shapes and FP8 MoE
shapes, or a real Qwen3-MoE) is read as Qwen3MoeForCausalLM in fp32 with the experts' "eager" forward, as
hf_reference.py's reference (its model_class and eager_experts); an FP8 one from its bf16-dequantized/ as above.
Both weights modes cover it: w8a8_linears quantizes the attention linears, the dense (mlp_only_layers) layers' MLP
and every expert's gate, up and down, and runs transformers' eager loop over the chosen experts with the input of
each expert product fake-quantized (x for gate_up, act = silu(gate) * up for down); the router (mlp.gate) and the
routing stay as in the fp32 model (bf16 weights widened, fp32 inputs and routing weights), never quantized.
Prints PASS/FAIL lines and a RESULT line like the C++ suites.
"""
import json, os, sys
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # hf_reference.py sits beside this script
from hf_reference import eager_experts, model_class, q8_emulation, w8a8_emulation

d = sys.argv[1]
res = json.load(open(f"{d}/gen_results.json"))
tol = res["tolerance"]
fp8 = res.get("kv_cache_dtype") == "fp8"
weights = res.get("weights", "bf16")
if weights not in ("bf16", "fp8", "fp8-quantized"):
    sys.exit(f"{d}/gen_results.json: \"weights\": {weights!r}, expected \"bf16\", \"fp8\" or \"fp8-quantized\"")
w8a8 = weights == "fp8"  # an FP8 checkpoint computed in FP8
q8 = weights == "fp8-quantized"  # a bf16 checkpoint quantized at load, computed in FP8
src = f"{d}/bf16-dequantized" if os.path.isdir(f"{d}/bf16-dequantized") else d  # an FP8 folder: its bf16 twin
if w8a8 and src == d:
    sys.exit(f"{d}: \"weights\": \"fp8\" needs an FP8 folder of hf_reference.py (no {d}/bf16-dequantized)")
if q8 and src != d:
    sys.exit(f"{d}: \"weights\": \"fp8-quantized\" needs a bf16 checkpoint, not an FP8 folder of hf_reference.py")
cls = model_class(src)  # Qwen3ForCausalLM, or Qwen3MoeForCausalLM by config.json's architectures
model = eager_experts(cls.from_pretrained(src, torch_dtype=torch.float32)).to("cuda").eval()
if w8a8:  # score against what FP8 weights and activations compute, not against the dequantized bf16 weights
    model = w8a8_emulation(model, d)
elif q8:  # the bf16 weights as the engine quantizes them at load, then the same FP8 compute
    model = q8_emulation(model)
moe = cls.__name__ == "Qwen3MoeForCausalLM"
print(f"reference: fp32 transformers {cls.__name__} from {src}"
      + (f", its linears{' and experts' if moe else ''} W8A8-emulated from {d}'s FP8 weights" if w8a8 else "")
      + (f", its linears{' and experts' if moe else ''} W8A8-emulated with its bf16 weights quantized as at load"
         if q8 else "") + (", the router unquantized" if moe and (w8a8 or q8) else ""), flush=True)
passed = failed = 0
for name, run in res["runs"].items():
    worst, n_tok, n_exact, worst_lp, n_clear, n_clear_wrong = 0.0, 0, 0, 0.0, 0, 0
    pen = run.get("penalties")  # {"repetition", "frequency", "presence"}: applied to the reference row first
    for i, (seq, plen) in enumerate(zip(run["sequences"], run["prompt_lens"])):
        x = torch.tensor([seq], device="cuda")
        with torch.no_grad():
            logits = model(x).logits[0].float()
        for pos in range(plen, len(seq)):
            row = logits[pos - 1].clone()
            if "logprobs" in run:  # ours (raw logits) against log_softmax of the reference's
                ref_lp = torch.log_softmax(row.double(), dim=-1)[seq[pos]].item()
                worst_lp = max(worst_lp, abs(run["logprobs"][i][pos - plen] - ref_lp))
            if pen:  # vLLM's apply_penalties (HF's repetition rule) over prompt + output so far
                out_ids = torch.tensor(seq[plen:pos], device="cuda", dtype=torch.long)
                counts = torch.bincount(out_ids, minlength=row.numel()).float() if pos > plen else torch.zeros_like(row)
                seen = counts > 0
                seen[torch.tensor(seq[:plen], device="cuda")] = True
                r = pen["repetition"]
                row = torch.where(seen, torch.where(row > 0, row / r, row * r), row)
                row = row - pen["frequency"] * counts - pen["presence"] * (counts > 0).float()
            top2 = torch.topk(row, 2).values
            best = top2[0].item()
            gap = best - row[seq[pos]].item()
            worst = max(worst, gap)
            exact = int(row.argmax().item() == seq[pos])
            n_exact += exact
            if best - top2[1].item() > 2 * tol / 3:  # clear of our error: must match
                n_clear += 1
                n_clear_wrong += 1 - exact
            n_tok += 1
    frac = n_exact / max(n_tok, 1)
    exact_rule = not (fp8 or w8a8 or q8)  # FP8 rounding (cache or activations) flips near-ties: see the docstring
    ok = worst <= tol and (not exact_rule or frac >= 0.9) and n_clear_wrong == 0 and n_tok > 0 and worst_lp <= tol
    lp_note = f", worst |logprob - reference| {worst_lp:.4f}" if "logprobs" in run else ""
    print(f"{'PASS' if ok else 'FAIL'} teacher_forcing_{name}: {n_tok} tokens, {100*frac:.1f}% exact argmax, "
          f"worst gap to the best logit {worst:.4f} (tolerance {tol:.4f}), {n_clear - n_clear_wrong} of {n_clear} "
          f"clear-margin tokens exact{lp_note}")
    passed += ok
    failed += not ok
print(f"RESULT passed={passed} failed={failed} skipped=0")
sys.exit(1 if failed else 0)
