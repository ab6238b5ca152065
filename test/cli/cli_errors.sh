#!/usr/bin/env bash
# suite: bad input (issue 8)
# Every mistake a user can make with flags, the model folder, config.json, the checkpoint, the tokenizer, the
# prompts file and --output: ./nanovllm must refuse it before any GPU work (so these run on a CPU machine),
# exit with status 1 (not a crash, not a hang: each run has a 60 s limit), name the culprit on stderr (file,
# line, tensor or flag), write nothing to stdout and leave no --output file. Fixtures are built in a temp
# folder: a tiny Qwen3 checkpoint (test/ref/make_tiny_checkpoint.py, zeros stored sparsely) and the Qwen3
# tokenizer (tools/fetch_tokenizer.sh). Run from the repo root; NANOVLLM_BIN overrides ./nanovllm.
source "$(dirname "$0")/lib.sh"

if ! TOK=$(bash tools/fetch_tokenizer.sh | tail -n 1) || [ -z "$TOK" ]; then
  fail fetch_tokenizer "tools/fetch_tokenizer.sh could not provide the Qwen3 tokenizer"
  finish
fi
if [ ! -x "$BIN" ]; then fail binary "$BIN is missing: run make first"; finish; fi
BIN=$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")
tmp=$(mktemp -d)
chmod 755 "$tmp"  # the unreadable-folder cases run as an unprivileged user when we are root
trap 'chmod -R u+rwx "$tmp"; rm -rf "$tmp"' EXIT
OUT=$tmp/out.jsonl  # every case passes --output $OUT and checks that it was not created

# model NAME [make_tiny_checkpoint.py options] -> a model folder $tmp/NAME with the tokenizer files
model() {
  local name=$1; shift
  python3 "$(dirname "$0")/../ref/make_tiny_checkpoint.py" "$tmp/$name" "$@" ||
    { echo "make_tiny_checkpoint.py $* failed" >&2; exit 1; }
  cp "$TOK/tokenizer.json" "$TOK/tokenizer_config.json" "$tmp/$name/"
  echo "$tmp/$name"
}

# expect_error NAME 'NEEDLE1|NEEDLE2|...' CMD...  (each needle must appear in stderr)
expect_error() {
  local name=$1 needles=$2; shift 2
  local rc
  rm -f "$OUT"
  timeout 60 "$@" >"$tmp/stdout" 2>"$tmp/stderr" </dev/null; rc=$?
  local err; err=$(head -c 600 "$tmp/stderr")
  if [ "$rc" -eq 124 ]; then fail "$name" "no answer in 60 s (a hang)"; return; fi
  if [ "$rc" -ne 1 ]; then fail "$name" "exit status $rc, want 1: $err"; return; fi
  if ! grep -q '^nanovllm: error: ' "$tmp/stderr"; then fail "$name" "no 'nanovllm: error:' line: $err"
    return; fi
  local IFS='|' n
  for n in $needles; do
    if ! grep -qF -- "$n" "$tmp/stderr"; then fail "$name" "stderr lacks '$n': $err"; return; fi
  done
  if [ -s "$tmp/stdout" ]; then fail "$name" "wrote to stdout: $(head -c 200 "$tmp/stdout")"; return; fi
  if [ -e "$OUT" ]; then fail "$name" "created the --output file"; return; fi
  pass "$name"
  [ -n "${VERBOSE:-}" ] && sed 's/^/    /' "$tmp/stderr"
  return 0
}

# refuse NAME NEEDLES MODEL PROMPTS [FLAGS...]: the usual case, run with --output $OUT and no GPU.
refuse() {
  local name=$1 needles=$2 model=$3 prompts=$4; shift 4
  expect_error "$name" "$needles" "${RUN[@]}" "$model" "$prompts" --output "$OUT" "$@"
}

# Permission cases run as an unprivileged user when we are root (root reads and writes any file).
AS_USER=()
[ "$(id -u)" = 0 ] && AS_USER=(setpriv --reuid=65534 --regid=65534 --clear-groups --)
can_drop_root() { [ "$(id -u)" != 0 ] || command -v setpriv >/dev/null; }

G=$(model good)  # the valid model every other case starts from
PT=$tmp/p.txt  # valid prompts
printf 'Hello there\nWhat is 2 + 2?\n' >"$PT"
NOGPU="no CUDA GPU is visible"
RUN=(env CUDA_VISIBLE_DEVICES= "$BIN")  # no GPU even on a GPU machine, so every case means the same there

# ---- the fixtures are valid: every check passes and the run stops only at the GPU --------------------
refuse valid_model_reaches_gpu_check "$NOGPU" "$G" "$PT"
SHARDED=$(model sharded --shards)
refuse valid_sharded_model_reaches_gpu_check "$NOGPU" "$SHARDED" "$PT"
printf '%s\n' '{"prompt": "hi", "max_tokens": 5, "temperature": 0}' '{"prompt_token_ids": [1, 2, 3]}' \
  '{"messages": [{"role": "user", "content": "hi"}], "top_p": 0.5, "seed": 3}' >"$tmp/good.jsonl"
refuse valid_jsonl_reaches_gpu_check "$NOGPU" "$G" "$tmp/good.jsonl"
echo keep >"$tmp/existing.jsonl"
CUDA_VISIBLE_DEVICES= timeout 60 "$BIN" "$G" "$PT" --output "$tmp/existing.jsonl" >/dev/null 2>&1
if [ "$(cat "$tmp/existing.jsonl")" = keep ]; then pass refused_run_leaves_existing_output_as_it_was
else fail refused_run_leaves_existing_output_as_it_was "the existing --output file was changed"; fi
expect_error roofline_without_gpu "$NOGPU" "${RUN[@]}" roofline

# ---- flags ---------------------------------------------------------------------------------------------
refuse flag_temperature_negative "temperature must be >= 0|-0.5|command line" "$G" "$PT" --temperature -0.5
refuse flag_temperature_nan "temperature must be >= 0" "$G" "$PT" --temperature nan
refuse flag_top_p_zero "top_p must be in (0, 1]|found 0" "$G" "$PT" --top-p 0
refuse flag_top_p_above_one "top_p must be in (0, 1]|1.5" "$G" "$PT" --top-p 1.5
refuse flag_top_k_negative "top_k must be positive, or -1 or 0 (off)|-2" "$G" "$PT" --top-k -2
refuse flag_max_tokens_zero "max_tokens must be at least 1" "$G" "$PT" --max-tokens 0
refuse flag_max_tokens_not_a_number "--max-tokens expects an integer|'ten'" "$G" "$PT" --max-tokens ten
refuse flag_max_tokens_overflow "--max-tokens: 99999999999 is out of range" "$G" "$PT" \
  --max-tokens 99999999999
refuse flag_gpu_memory_zero "--gpu-memory-utilization must be in (0, 1]" "$G" "$PT" --gpu-memory-utilization 0
refuse flag_gpu_memory_above_one "--gpu-memory-utilization must be in (0, 1]|1.5" \
  "$G" "$PT" --gpu-memory-utilization=1.5
refuse flag_block_size_not_pow2 "--kvcache-block-size must be a power of two|48" "$G" "$PT" \
  --kvcache-block-size 48
refuse flag_block_size_too_big "--kvcache-block-size must be a power of two from 16 to 256|512" \
  "$G" "$PT" --kvcache-block-size 512
refuse flag_max_model_len_one "--max-model-len must be at least 2" "$G" "$PT" --max-model-len 1
refuse flag_kv_cache_dtype_unknown "--kv-cache-dtype must be one of auto, bfloat16, bf16, fp8_e4m3, fp8|'fp9'" "$G" "$PT" --kv-cache-dtype fp9
refuse flag_kv_cache_dtype_e5m2 "--kv-cache-dtype fp8_e5m2 is not supported|e4m3" "$G" "$PT" \
  --kv-cache-dtype fp8_e5m2
refuse flag_kv_cache_dtype_fp8_reaches_gpu_check "$NOGPU" "$G" "$PT" --kv-cache-dtype fp8
refuse flag_num_kvcache_blocks_zero "--num-kvcache-blocks must be positive" "$G" "$PT" --num-kvcache-blocks 0
refuse flag_max_num_seqs_zero "--max-num-seqs must be at least 1" "$G" "$PT" --max-num-seqs 0
refuse flag_tp_out_of_range "--tensor-parallel-size must be between 1 and 8|16" "$G" "$PT" --tp 16
refuse flag_tp_not_dividing_heads "--tensor-parallel-size 3 must divide" "$G" "$PT" --tensor-parallel-size 3
refuse flag_opt_unknown_name "--opt: unknown optimization '-fused_gemv'|gemv, cluster_merge" "$G" "$PT" \
  --opt -fused_gemv
refuse flag_opt_empty "--opt needs a list" "$G" "$PT" --opt=
refuse flag_opt_signed_all "write all or none without a sign" "$G" "$PT" --opt -all
refuse flag_plain_with_value "flag --plain takes no value" "$G" "$PT" --plain=1
refuse valid_plain_reaches_gpu_check "$NOGPU" "$G" "$PT" --plain
refuse valid_opt_list_reaches_gpu_check "$NOGPU" "$G" "$PT" --opt none,gemv,+pdl --opt -pdl
refuse flag_unknown "unknown flag '--frobnicate'" "$G" "$PT" --frobnicate
refuse flag_missing_value "flag --max-tokens needs a value" "$G" "$PT" --max-tokens
refuse flag_value_on_switch "flag --ignore-eos takes no value" "$G" "$PT" --ignore-eos=1
refuse too_many_arguments "too many arguments: 'extra'" "$G" "$PT" extra

# ---- output path ---------------------------------------------------------------------------------------
expect_error output_folder_missing "cannot write --output|$tmp/nope/out.jsonl|does not exist" \
  "${RUN[@]}" "$G" "$PT" --output "$tmp/nope/out.jsonl"
expect_error output_is_a_folder "--output '$tmp' is a folder" "${RUN[@]}" "$G" "$PT" --output "$tmp"
if can_drop_root; then
  mkdir "$tmp/ro" && chmod 555 "$tmp/ro"
  expect_error output_folder_read_only "cannot write --output|$tmp/ro/out.jsonl|Permission denied" \
    "${AS_USER[@]}" "${RUN[@]}" "$G" "$PT" --output "$tmp/ro/out.jsonl"
else skip output_folder_read_only "root and no setpriv to drop privileges"; fi

# ---- model folder --------------------------------------------------------------------------------------
refuse model_folder_missing "model folder '$tmp/nope' does not exist" "$tmp/nope" "$PT"
refuse model_folder_is_a_file "'$PT' does not exist or is not a folder" "$PT" "$PT"
if can_drop_root; then
  LOCKED=$(model locked) && chmod 000 "$LOCKED"
  expect_error model_folder_unreadable "cannot read model folder '$LOCKED'|Permission denied" \
    "${AS_USER[@]}" "${RUN[@]}" "$LOCKED" "$PT" --output "$OUT"
  chmod 755 "$LOCKED"
else skip model_folder_unreadable "root and no setpriv to drop privileges"; fi
M=$(model noconfig) && rm "$M/config.json"
refuse model_folder_without_config "no config.json in model folder '$M'" "$M" "$PT"
M=$(model noweights) && rm "$M/model.safetensors"
refuse model_folder_without_weights "no weights in $M|model.safetensors" "$M" "$PT"

# ---- config.json ---------------------------------------------------------------------------------------
M=$(model badjson) && echo '{"hidden_size": 256,' >"$M/config.json"
refuse config_not_json "$M/config.json is not valid JSON" "$M" "$PT"
M=$(model moe --set 'architectures=["Qwen3MoeForCausalLM"]' --set num_experts=128)
refuse config_moe_fields_missing "$M/config.json|missing field \"num_experts_per_tok\"" "$M" "$PT"
M=$(model qwen2moe --set 'architectures=["Qwen2MoeForCausalLM"]')
refuse config_qwen2_moe "architecture Qwen2MoeForCausalLM is not supported|Qwen3MoeForCausalLM" "$M" "$PT"
M=$(model llama --set 'architectures=["LlamaForCausalLM"]' --set model_type='"llama"')
refuse config_llama "architecture LlamaForCausalLM is not supported" "$M" "$PT"
M=$(model heads --set num_key_value_heads=3)
refuse config_heads_not_divisible "num_attention_heads (4) must be a multiple of num_key_value_heads (3)" \
  "$M" "$PT"
M=$(model nohd --del head_dim)
refuse config_head_dim_absent "missing field \"head_dim\"|$M/config.json" "$M" "$PT"
M=$(model hd64 --set head_dim=64)
refuse config_head_dim_64 "head_dim 64 is not supported" "$M" "$PT"
M=$(model nohidden --del hidden_size)
refuse config_field_missing "missing field \"hidden_size\"" "$M" "$PT"
M=$(model strhidden --set hidden_size='"256"')
refuse config_field_not_a_number "field \"hidden_size\" must be a number" "$M" "$PT"
M=$(model neglayers --set num_hidden_layers=-2)
refuse config_field_negative "\"num_hidden_layers\" must be positive, found -2" \
  "$M" "$PT"
M=$(model hbig --set hidden_size=1e20)
refuse config_field_past_int "field \"hidden_size\" must be an integer, found 1e+20" \
  "$M" "$PT"
M=$(model hfrac --set hidden_size=256.5)
refuse config_field_fraction "field \"hidden_size\" must be an integer" "$M" "$PT"
M=$(model biasstr --set attention_bias='"no"')
refuse config_bool_not_a_bool "field \"attention_bias\" must be true or false" \
  "$M" "$PT"
M=$(model bias --set attention_bias=true)
refuse config_attention_bias "attention_bias=true is not supported" "$M" "$PT"
M=$(model eps --set rms_norm_eps=-1)
refuse config_eps_negative "rms_norm_eps (-1)|must be positive and finite" "$M" "$PT"
M=$(model layers) && sed -i 's/"num_hidden_layers": 2/"num_hidden_layers": 2000000000/' "$M/config.json"
refuse config_layers_absurd "num_hidden_layers 2000000000|holds only 24 tensors" \
  "$M" "$PT"
M=$(model yarn --set 'rope_scaling={"rope_type": "yarn", "factor": 4.0}')
refuse config_rope_scaling "rope type \"yarn\" is not supported" "$M" "$PT"
M=$(model badgen) && echo '{"eos_token_id": [1,' >"$M/generation_config.json"
refuse generation_config_not_json "$M/generation_config.json is not valid JSON" \
  "$M" "$PT"

# ---- Qwen3-MoE: the tiny MoE folder (make_tiny_checkpoint.py --moe) and its breaks -----------------------
# The config fields and the tensors one by one are test/host/test_moe.cu's; here, that the binary refuses each
# before any GPU work.
M=$(model moe_good --moe)
refuse valid_moe_model_reaches_gpu_check "$NOGPU" "$M" "$PT"
M=$(model moe_missing --moe --break moe_expert_missing)
refuse moe_expert_missing "checkpoint in $M has no tensor 'model.layers.0.mlp.experts.7.up_proj.weight'|\
shape [128, 256]" "$M" "$PT"
M=$(model moe_router --moe --break moe_router_shape)
refuse moe_router_shape "'model.layers.0.mlp.gate.weight'|$M/model.safetensors|[256, 8]|implies [8, 256]" \
  "$M" "$PT"
M=$(model moe_topk --moe --break moe_topk)
refuse moe_topk "$M/config.json|num_experts_per_tok must be from 1 to num_experts (8), found 9" "$M" "$PT"
M=$(model moe_zero --moe --set num_experts=0)
refuse moe_zero_experts "$M/config.json|num_experts must be at least 1|Qwen3ForCausalLM" "$M" "$PT"
M=$(model moe_layers --moe --set 'mlp_only_layers=[2]')
refuse moe_mlp_only_layers_out_of_range "$M/config.json|mlp_only_layers holds 2|num_hidden_layers - 1 = 1" \
  "$M" "$PT"
M=$(model moe_quant --moe)
refuse moe_quantization_fp8_opt_off "--quantization fp8: a MoE model's experts are quantized and multiplied by \
the optimization fp8_moe|switch it on" "$M" "$PT" --quantization fp8 --opt -fp8_moe
refuse valid_moe_quantization_fp8_reaches_gpu_check "$NOGPU" "$M" "$PT" --quantization fp8
# An FP8 MoE checkpoint as Qwen3-30B-A3B-FP8 is written (every expert e4m3 with its scales, the router bf16): valid;
# an expert's missing scales are refused by name before the GPU.
M=$(model moe_fp8 --moe --fp8 bf16)
refuse valid_moe_fp8_model_reaches_gpu_check "$NOGPU" "$M" "$PT"
M=$(model moe_fp8_scale --moe --fp8 f32 --break moe_fp8_scale_missing)
refuse moe_fp8_scale_missing "checkpoint in $M has no tensor \
'model.layers.0.mlp.experts.7.down_proj.weight_scale_inv'" "$M" "$PT"

# ---- FP8: config.json's quantization_config and --quantization ----------------------------------------
# Set into the bf16 tiny model's config.json; the checkpoint-tensor cases (F8_E4M3 weights and their block
# scales, each way to get them wrong) are test/host/test_fp8_checkpoint.cu's, on files it writes.
qc() { model "$1" --set "quantization_config=$2"; }
M=$(qc q_gptq '{"quant_method": "gptq", "bits": 4, "group_size": 128}')
refuse fp8_config_gptq "$M/config.json|quant_method \"gptq\" is not supported|\"fp8\"|BF16, F16, F32" "$M" "$PT"
M=$(qc q_awq '{"quant_method": "awq", "bits": 4}')
refuse fp8_config_awq "$M/config.json|quant_method \"awq\" is not supported|128 x 128 block scales" "$M" "$PT"
M=$(qc q_str '"fp8"')
refuse fp8_config_not_an_object "$M/config.json|field \"quantization_config\" must be an object, found \"fp8\"" \
  "$M" "$PT"
M=$(qc q_nomethod '{"weight_block_size": [128, 128]}')
refuse fp8_config_no_quant_method "$M/config.json|needs \"quant_method\" as a string" "$M" "$PT"
M=$(qc q_e5m2 '{"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}')
refuse fp8_config_fmt_e5m2 "$M/config.json|quantization_config.fmt \"e5m2\" is not supported|\"e4m3\"" "$M" "$PT"
M=$(qc q_static '{"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}')
refuse fp8_config_static "$M/config.json|activation_scheme \"static\" is not supported|\"dynamic\"|input_scale" \
  "$M" "$PT"
M=$(qc q_pertensor '{"quant_method": "fp8", "activation_scheme": "dynamic"}')
refuse fp8_config_per_tensor "$M/config.json|no \"weight_block_size\"|per-tensor FP8|[128, 128]" "$M" "$PT"
M=$(qc q_b64 '{"quant_method": "fp8", "weight_block_size": [64, 64]}')
refuse fp8_config_block_64 "$M/config.json|weight_block_size must be [128, 128], found [64,64]" "$M" "$PT"
M=$(qc q_keepstr '{"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": "lm_head"}')
refuse fp8_config_not_convert_not_a_list "$M/config.json|modules_to_not_convert must be a list|\"lm_head\"" \
  "$M" "$PT"
M=$(qc q_keepempty '{"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": [""]}')
refuse fp8_config_not_convert_empty_name "$M/config.json|modules_to_not_convert: \"\" is not a module name" \
  "$M" "$PT"
# The published FP8 config on a bf16 checkpoint: the first layer linear is not F8_E4M3.
M=$(qc q_onbf16 '{"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
  "weight_block_size": [128, 128]}')
refuse fp8_config_on_bf16_checkpoint "'model.layers.0.self_attn.q_proj.weight'|$M/model.safetensors|dtype BF16|\
F8_E4M3 unless modules_to_not_convert names them" "$M" "$PT"
# ... and with every layer linear named in modules_to_not_convert the same files are valid.
M=$(qc q_allkept '{"quant_method": "fp8", "weight_block_size": [128, 128],
  "modules_to_not_convert": ["model.layers"]}')
refuse valid_fp8_config_every_linear_kept_reaches_gpu_check "$NOGPU" "$M" "$PT"
M=$(qc q_null null)
refuse valid_quantization_config_null_reaches_gpu_check "$NOGPU" "$M" "$PT"
refuse flag_quantization_gptq "--quantization must be fp8|found 'gptq'|\
gptq, awq, compressed-tensors, bitsandbytes and gguf are not supported" "$G" "$PT" --quantization gptq
refuse flag_quantization_fp8_with_plain "--quantization fp8 is computed by the optimization fp8_weights|--plain or --opt" \
  "$G" "$PT" --quantization fp8 --plain
refuse flag_quantization_fp8_opt_off "--quantization fp8 is computed by the optimization fp8_weights" \
  "$G" "$PT" --opt=-fp8_weights --quantization=fp8
refuse flag_quantization_missing_value "flag --quantization needs a value" "$G" "$PT" --quantization
refuse valid_quantization_fp8_reaches_gpu_check "$NOGPU" "$G" "$PT" --quantization fp8

# ---- the checkpoint ------------------------------------------------------------------------------------
ST=model.safetensors
M=$(model truncated --break truncated)
refuse st_truncated "$M/$ST|past the data section|truncated" "$M" "$PT"
M=$(model hlen --break header_len)
refuse st_header_length_past_end "$M/$ST|header length|does not fit in the file" \
  "$M" "$PT"
M=$(model hjson --break header_json)
refuse st_header_not_json "$M/$ST|header is not valid JSON" "$M" "$PT"
M=$(model dtq4 --break dtype_unknown)
refuse st_unknown_dtype "$M/$ST|'model.layers.1.mlp.down_proj.weight'|unknown dtype \"Q4\"" \
  "$M" "$PT"
M=$(model dti16 --break dtype_unsupported)
refuse st_unsupported_dtype "'model.layers.1.mlp.down_proj.weight'|$M/$ST|dtype I16|BF16, F16 or F32" \
  "$M" "$PT"
M=$(model span --break span)
refuse st_shape_times_dtype_not_span "$M/$ST|'model.norm.weight'|[255]|needs 510 bytes|span 512" \
  "$M" "$PT"
M=$(model offsets --break offsets)
refuse st_offsets_outside_file "$M/$ST|'model.layers.1.mlp.down_proj.weight'|past the data section" \
  "$M" "$PT"
M=$(model overlap --break overlap)
refuse st_overlapping_tensors "$M/$ST|overlap|'model.norm.weight'" "$M" "$PT"
M=$(model missing --break missing)
refuse st_tensor_missing "checkpoint in $M has no tensor 'model.norm.weight'" "$M" "$PT"
M=$(model shape --break shape)
refuse st_tensor_wrong_shape "'model.layers.1.self_attn.k_norm.weight'|$M/$ST|[2, 64]|implies [128]" \
  "$M" "$PT"
M=$(model untied --break no_lm_head)
refuse st_untied_without_lm_head "no tensor 'lm_head.weight'" "$M" "$PT"
M=$(model shardmiss --shards --break shard_missing)
refuse st_index_names_missing_shard "names shard 'model-00003-of-00002.safetensors'|does not exist" \
  "$M" "$PT"
M=$(model shardbad --shards --break index_json)
refuse st_index_not_json "$M/model.safetensors.index.json|not valid JSON" "$M" "$PT"
M=$(model shardtrunc --shards --break truncated)
refuse st_shard_truncated "$M/model-00002-of-00002.safetensors|past the data section" \
  "$M" "$PT"
M=$(model tiny_file) && head -c 5 "$G/$ST" >"$M/$ST"
refuse st_shorter_than_8_bytes "$M/$ST|too small" "$M" "$PT"
M=$(model st_dir) && rm "$M/$ST" && mkdir "$M/$ST"
refuse st_is_a_folder "$M/$ST|not a regular file" "$M" "$PT"

# ---- tokenizer -----------------------------------------------------------------------------------------
M=$(model notok) && rm "$M/tokenizer.json"
refuse tokenizer_missing "cannot read the tokenizer '$M/tokenizer.json'" "$M" "$PT"
M=$(model badtok) && head -c 100000 "$TOK/tokenizer.json" >"$M/tokenizer.json"
refuse tokenizer_corrupt "$M/tokenizer.json is not valid JSON" "$M" "$PT"
M=$(model smallvocab --set vocab_size=1000)
refuse tokenizer_larger_than_vocab "$M/tokenizer.json has 151669 tokens|vocab_size|is 1000" \
  "$M" "$PT"

# ---- prompts -------------------------------------------------------------------------------------------
refuse prompts_missing "cannot read prompts file '$tmp/nope.txt'" "$G" "$tmp/nope.txt"
: >"$tmp/empty.txt"
refuse prompts_empty "prompts file '$tmp/empty.txt' has no prompts" "$G" "$tmp/empty.txt"
printf '\n  \n\n' >"$tmp/blank.txt"
refuse prompts_only_blank_lines "has no prompts" "$G" "$tmp/blank.txt"
refuse prompts_is_a_folder "prompts file '$tmp' is a folder" "$G" "$tmp"
printf 'fine\nbad \xff byte\n' >"$tmp/utf8.txt"
refuse prompts_invalid_utf8 "$tmp/utf8.txt:2|invalid UTF-8 at byte 5" "$G" "$tmp/utf8.txt"
J=$tmp/p.jsonl
printf '%s\n' '{"prompt": "ok"}' '' '{"prompt": "unterminated}' >"$J"
refuse jsonl_bad_line "$J:3|not valid JSON" "$G" "$J"
printf '%s\n' '["a list"]' >"$J"
refuse jsonl_not_an_object "$J:1|must be a JSON object" "$G" "$J"
printf '%s\n' '{"prompt": "a", "messages": []}' >"$J"
refuse jsonl_two_prompt_kinds "$J:1|exactly one of" "$G" "$J"
printf '%s\n' '{"prompt": "a"}' '{"prompt_token_ids": [1, 151936]}' >"$J"
refuse jsonl_token_id_at_vocab "$J:2|token id 151936 is outside the vocabulary [0, 151936)" \
  "$G" "$J"
printf '%s\n' '{"prompt_token_ids": [-1]}' >"$J"
refuse jsonl_token_id_negative "$J:1|token id -1" "$G" "$J"
printf '%s\n' '{"prompt_token_ids": [1.5]}' >"$J"
refuse jsonl_token_id_not_integer "$J:1|token ids must be integers" "$G" "$J"
printf '%s\n' '{"prompt_token_ids": []}' >"$J"
refuse jsonl_empty_prompt "$J:1|the prompt is empty" "$G" "$J"
printf '%s\n' '{"prompt": "a", "temperature": -1}' >"$J"
refuse jsonl_temperature_negative "$J:1|temperature must be >= 0" "$G" "$J"
printf '%s\n' '{"prompt": "a", "top_p": "high"}' >"$J"
refuse jsonl_top_p_not_a_number "$J:1|\"top_p\" must be a number" "$G" "$J"
printf '%s\n' '{"prompt": "a", "max_tokens": 2.5}' >"$J"
refuse jsonl_max_tokens_fraction "$J:1|\"max_tokens\" must be an integer" "$G" "$J"
printf '%s\n' '{"prompt": "a", "max_tokens": 1e20}' >"$J"
refuse jsonl_max_tokens_past_int "$J:1|\"max_tokens\" must be an integer" "$G" "$J"
printf '%s\n' '{"prompt": "a", "max_tokens": 0}' >"$J"
refuse jsonl_max_tokens_zero "$J:1|max_tokens must be at least 1" "$G" "$J"
printf '%s\n' '{"messages": [{"role": "tool", "content": "x"}]}' >"$J"
refuse jsonl_tool_role "$J:1|role 'tool' is not supported" "$G" "$J"
printf '%s\n' '{"prompt": "hi"}' "{\"prompt_token_ids\": [$(seq -s, 1 40)]}" >"$J"
refuse prompt_too_long_refuses_the_run "$J:2|40 tokens + max_tokens 8 = 48 exceeds --max-model-len 32" \
  "$G" "$J" --max-model-len 32 --max-tokens 8
refuse max_tokens_int_max_does_not_overflow "max_tokens 2147483647 = 2147483657 exceeds" \
  "$G" "$PT" --max-tokens 2147483647
refuse prompt_too_long_for_the_model "exceeds --max-model-len 4096|up to 4096 for this model" \
  "$G" "$PT" --max-model-len 100000 --max-tokens 4090

# ---- scheduling, arrivals, --report and simulate (issue 18) ------------------------------------------
refuse flag_scheduler_unknown "--scheduler must be nano or mixed|'fifo'" "$G" "$PT" --scheduler fifo
refuse flag_request_rate_zero "--request-rate must be a positive number" "$G" "$PT" --request-rate 0
refuse flag_request_rate_not_a_number "--request-rate expects a number|'fast'" "$G" "$PT" --request-rate fast
printf '%s\n' '{"prompt": "hi", "max_token": 5}' >"$J"
refuse jsonl_unknown_field_names_the_nearest "$J:1|unknown field \"max_token\"|did you mean \"max_tokens\"" "$G" "$J"
printf '%s\n' '{"prompt": "hi"}' '{"prompt": "hi", "temprature": 0.5}' >"$J"
refuse jsonl_misspelt_temperature "$J:2|unknown field \"temprature\"|did you mean \"temperature\"" "$G" "$J"
printf '%s\n' '{"prompt": "a", "arrival_time": -1}' >"$J"
refuse jsonl_arrival_negative "$J:1|\"arrival_time\" must be a number of seconds >= 0|-1" "$G" "$J"
printf '%s\n' '{"prompt": "a"}' '{"prompt": "b", "arrival_time": "soon"}' >"$J"
refuse jsonl_arrival_not_a_number "$J:2|\"arrival_time\" must be a number|\"soon\"" "$G" "$J"
refuse report_folder_missing "cannot write --report|$tmp/nope/r.html|does not exist" "$G" "$PT" \
  --report "$tmp/nope/r.html"
refuse report_is_a_folder "--report '$tmp' is a folder" "$G" "$PT" --report "$tmp"
refuse valid_mixed_rate_report_reach_gpu_check "$NOGPU" "$G" "$PT" --scheduler mixed --request-rate 5 \
  --report "$tmp/r.html"
[ ! -e "$tmp/r.html" ] && pass refused_run_writes_no_report || fail refused_run_writes_no_report "r.html exists"
refuse simulate_flag_without_simulate "belong to \`nanovllm simulate" "$G" "$PT" --simulate-eos-prob 0.1
refuse simulate_needs_a_pool "simulate needs the size of the KV pool|--simulate-gpu-memory" simulate "$G" "$PT"
refuse simulate_unknown_shape "--simulate-model Qwen3-9B: not a known shape" simulate "$G/tokenizer.json" \
  "$PT" --simulate-model Qwen3-9B
refuse simulate_shape_twice "has a config.json|--simulate-model is for a tokenizer alone" simulate "$G" "$PT" \
  --simulate-model Qwen3-8B --num-kvcache-blocks 100
refuse simulate_eos_prob_range "--simulate-eos-prob must be in [0, 1]|1.5" simulate "$G" "$PT" \
  --simulate-eos-prob 1.5 --num-kvcache-blocks 100
refuse simulate_gpu_memory_not_a_size "--simulate-gpu-memory expects a memory size|'lots'" simulate "$G" "$PT" \
  --simulate-gpu-memory lots
refuse simulate_pool_too_small "the KV pool has 1 blocks|needs" simulate "$G" "$PT" --num-kvcache-blocks 1
refuse simulate_gpu_too_small "the KV pool has 0 blocks" simulate "$G/tokenizer.json" "$PT" \
  --simulate-model Qwen3-8B --simulate-gpu-memory 8GB
expect_error simulate_missing_prompts "usage: nanovllm simulate MODEL_OR_TOKENIZER PROMPTS" "${RUN[@]}" \
  simulate "$G" --num-kvcache-blocks 100

# ---- request fields as vLLM users write them (issue 20): each bad value names the line and the field ----
B=$tmp/batch.jsonl
refuse flag_n_zero "command line|n must be an integer from 1|found 0" "$G" "$PT" --n 0
refuse flag_min_p_above_one "command line|min_p must be in [0, 1]|1.5" "$G" "$PT" --min-p 1.5
refuse flag_logprobs_21 "command line|logprobs must be in [0, 20]|21" "$G" "$PT" --logprobs 21
refuse flag_repetition_penalty_zero "command line|repetition_penalty must be > 0" "$G" "$PT" --repetition-penalty 0
refuse flag_presence_penalty_3 "command line|presence_penalty must be in [-2, 2]|3" "$G" "$PT" --presence-penalty 3
refuse flag_frequency_penalty_minus_3 "command line|frequency_penalty must be in [-2, 2]" "$G" "$PT" \
  --frequency-penalty -3
refuse flag_min_tokens_past_max "command line|min_tokens must be in [0, max_tokens = 8]|9" "$G" "$PT" \
  --max-tokens 8 --min-tokens 9
refuse flag_min_tokens_past_default_max_tokens "command line|min_tokens must be in [0, max_tokens = 64]|70" "$G" "$PT" \
  --min-tokens 70
printf '%s\n' '{"prompt": "hi", "max_tokens": 100}' >"$J"
refuse valid_flag_min_tokens_under_a_line_max_tokens "$NOGPU" "$G" "$J" --min-tokens 70
refuse flag_stop_empty "command line|stop cannot contain an empty string" "$G" "$PT" --stop ''
refuse flag_stop_token_ids_not_numbers "flag --stop-token-ids expects an integer|'x'" "$G" "$PT" --stop-token-ids 5,x
refuse flag_generation_config_unknown "--generation-config must be auto or vllm|'hf'" "$G" "$PT" \
  --generation-config hf
refuse valid_request_flags_reach_gpu_check "$NOGPU" "$G" "$PT" --n 3 --min-p 0.1 --logprobs 5 \
  --repetition-penalty 1.2 --presence-penalty 0.5 --frequency-penalty -0.5 --min-tokens 4 --stop END \
  --stop 'two words' --stop-token-ids 13,14 --include-stop-str-in-output --generation-config vllm
printf '%s\n' '{"prompt": "hi"}' '{"prompt": "hi", "n": 0}' >"$J"
refuse jsonl_n_zero "$J:2|n must be an integer from 1|found 0" "$G" "$J"
printf '%s\n' '{"prompt": "hi", "logprobs": 21}' >"$J"
refuse jsonl_logprobs_21 "$J:1|logprobs must be in [0, 20]|21" "$G" "$J"
printf '%s\n' '{"prompt": "hi", "min_p": 1.5}' >"$J"
refuse jsonl_min_p_above_one "$J:1|min_p must be in [0, 1]|1.5" "$G" "$J"
printf '%s\n' '{"prompt": "hi", "stop": 5}' >"$J"
refuse jsonl_stop_not_a_string "$J:1|\"stop\" must be a string or a list of strings|5" "$G" "$J"
printf '%s\n' '{"prompt": "hi", "repetition_penalty": 0}' >"$J"
refuse jsonl_repetition_penalty_zero "$J:1|repetition_penalty must be > 0" "$G" "$J"
printf '%s\n' '{"prompt": "hi", "stop_token_ids": [151936]}' >"$J"
refuse jsonl_stop_token_id_past_vocab "$J:1|\"stop_token_ids\": 151936 is not a token id in [0, 151936)" "$G" "$J"
printf '%s\n' '{"prompt": "hi", "prompt_logprobs": 1}' >"$J"
refuse jsonl_prompt_logprobs "$J:1|\"prompt_logprobs\" is not supported|last position" "$G" "$J"
printf '%s\n' '{"prompt": "hi", "min_tokens": 70}' >"$J"
refuse jsonl_min_tokens_past_max_tokens "$J:1|min_tokens must be in [0, max_tokens = 64]|70" "$G" "$J"
printf '%s\n' '{"prompt": "hi", "include_stop_str_in_output": 1}' >"$J"
refuse jsonl_include_stop_not_bool "$J:1|\"include_stop_str_in_output\" must be true or false" "$G" "$J"
printf '%s\n' '{"prompt": "hi", "n": 2, "stop": ["a", "b"], "stop_token_ids": [13], "min_tokens": 2, "logprobs": 0,' \
  '"min_p": 0.05, "presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 1.1, "seed": null}' | tr -d '\n' >"$J"
echo >>"$J"
refuse valid_request_fields_reach_gpu_check "$NOGPU" "$G" "$J"
chat='"method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}]}'
printf '%s\n' "{\"custom_id\": \"a\", $chat}" "{$chat}" >"$B"
refuse batch_without_custom_id "$B:2|needs \"custom_id\"" "$G" "$B"
printf '%s\n' '{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hi"}}' >"$B"
refuse batch_unknown_url "$B:1|\"url\" must be \"/v1/chat/completions\" or \"/v1/completions\"|/v1/embeddings" "$G" "$B"
printf '%s\n' "{\"custom_id\": \"a\", $chat}" "{\"custom_id\": \"a\", $chat}" >"$B"
refuse batch_duplicate_custom_id "$B:2|custom_id \"a\" is used by an earlier line" "$G" "$B"
printf '%s\n' "{\"custom_id\": \"a\", $chat}" '{"prompt": "hi"}' >"$B"
refuse batch_then_plain_line "$B:2|not a batch request" "$G" "$B"
printf '%s\n' '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "n": 0}}' >"$B"
refuse batch_body_n_zero "$B:1: body|n must be an integer from 1|found 0" "$G" "$B"
printf '%s\n' '{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21}}' >"$B"
refuse batch_top_logprobs_21 "$B:1: body|logprobs must be in [0, 20]|21" "$G" "$B"
printf '%s\n' "{\"custom_id\": \"a\", $chat}" \
  '{"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}}' >"$B"
refuse valid_batch_with_an_unsupported_line_reaches_gpu_check "$NOGPU" "$G" "$B"


# ---- data parallelism and shards (issue 46) -------------------------------------------------------------
refuse flag_dp_zero "--data-parallel-size must be from 1 to 64, found 0" "$G" "$PT" -dp 0
refuse flag_dp_not_a_number "flag -dp expects an integer, found 'two'" "$G" "$PT" -dp two
refuse flag_dp_needs_gpus "--data-parallel-size 3 x --tensor-parallel-size 1 needs 3 GPUs, but 0 are visible" \
  "$G" "$PT" -dp 3
refuse flag_dp_with_request_rate "--data-parallel-size 2 runs an offline batch|--request-rate" "$G" "$PT" -dp 2 \
  --request-rate 5
refuse flag_dp_with_report "--report draws one engine's steps" "$G" "$PT" -dp 2 --report "$tmp/r.html"
printf '%s\n' '{"prompt": "hi"}' '{"prompt": "ho", "arrival_time": 1.5}' >"$tmp/arrive.jsonl"
refuse flag_dp_with_arrival_time "$tmp/arrive.jsonl:2: \"arrival_time\"|runs an offline batch" "$G" \
  "$tmp/arrive.jsonl" -dp 2
refuse simulate_dp_with_tp "simulate models one GPU per engine" simulate "$G" "$PT" -dp 2 --tp 2 \
  --num-kvcache-blocks 100
refuse flag_shard_spec "--shard takes K/N (shard K of N, counted from 0), slurm or k8s:N; found '3'" "$G" "$PT" \
  --shard 3
refuse flag_shard_out_of_range "--shard 4/4: shard 4 of 4 does not exist" "$G" "$PT" --shard 4/4
expect_error flag_shard_slurm_outside_an_array "--shard slurm: SLURM_ARRAY_TASK_ID and SLURM_ARRAY_TASK_COUNT are not set" \
  env -u SLURM_ARRAY_TASK_ID -u SLURM_ARRAY_TASK_COUNT "${RUN[@]}" "$G" "$PT" --output "$OUT" --shard slurm
expect_error flag_shard_slurm_with_a_step "the job array must be one range of task ids without gaps" \
  env SLURM_ARRAY_TASK_ID=2 SLURM_ARRAY_TASK_COUNT=3 SLURM_ARRAY_TASK_MIN=0 SLURM_ARRAY_TASK_MAX=4 \
  SLURM_ARRAY_TASK_STEP=2 "${RUN[@]}" "$G" "$PT" --output "$OUT" --shard slurm
expect_error flag_shard_k8s_outside_a_job "--shard k8s:4: JOB_COMPLETION_INDEX is not set" \
  env -u JOB_COMPLETION_INDEX "${RUN[@]}" "$G" "$PT" --output "$OUT" --shard k8s:4
expect_error flag_shard_needs_output "--shard 0/2: a shard's completions are merged from its --output file" \
  "${RUN[@]}" "$G" "$PT" --shard 0/2
refuse valid_shard_reaches_gpu_check "$NOGPU" "$G" "$PT" --shard 1/2
expect_error merge_needs_files "usage: nanovllm merge OUT.jsonl SHARD.jsonl" "$BIN" merge "$OUT"

finish
