// nanovllm.cu — a vLLM-style inference engine for the Qwen3 dense family, in one CUDA C++ file.
//
// What this is
//   An offline batch inference engine: give it a Hugging Face Qwen3 checkpoint folder and a file of prompts,
//   it generates completions with continuous batching, a paged KV cache with prefix caching, chunked
//   prefill, recompute preemption, CUDA-graph decode and tensor parallelism. It mirrors nano-vllm
//   (github.com/GeeeekExplorer/nano-vllm, commit bb823b3) name for name, so the two can be read side by side,
//   and replaces its PyTorch, flash-attn and Triton with hand-written kernels and cuBLASLt.
//
// Build, run, test
//   make                                   builds ./nanovllm (prints what it found and what is missing)
//   ./nanovllm MODEL_DIR prompts.txt       generates; ./nanovllm --help lists every flag
//   make test                              host tests everywhere, GPU tests where a GPU is visible
//
// Dimension names used in every shape comment
//   T  tokens in this step (all sequences, flattened)      B  sequences in this step
//   H  hidden size                                         I  MLP intermediate size
//   NH query heads      NKV key/value heads (GQA)          D  head dim (128 for every Qwen3)
//   V  vocabulary size  L  layers                          P  KV block size in tokens (kvcache_block_size)
//   NB number of KV blocks in the pool                     MB max blocks per sequence (block table width)
//
// Invariants a reader must hold
//   * The host owns all bookkeeping (Sequence, BlockManager, Scheduler); the GPU only sees flat int arrays
//     (input_ids, positions, slot_mapping, block_tables, ...) built once per step by ModelRunner.
//   * A step is all prefill or all decode (nano-vllm's rule). Prefill writes K/V to the cache first and then
//     attends over the cache, so prefix-cache hits and chunked prefill need no special kernel.
//   * A KV slot is block_id * P + offset; slot -1 means "padding, do not store".
//   * Activations are bf16, every reduction (norms, softmax, matmul accumulation) is fp32.
//
// Contents (each section starts with a banner "// ==== N. Title" — grep for it)
//    1. Errors and utilities
//    2. Config: model config.json, engine settings, sampling parameters
//    3. Weights: safetensors -> GPU, fused q/k/v and gate/up
//    4. The KV cache layout
//    5. Kernels (each followed by its launcher)
//    6. Matrix products with cuBLASLt
//    7. The Qwen3 forward pass
//    8. Sequence
//    9. BlockManager: paged KV blocks and prefix caching
//   10. Scheduler: continuous batching, chunked prefill, preemption
//   11. ModelRunner: step inputs, CUDA graphs, sampling
//   12. LLMEngine: add_request, step, generate
//   13. Prompts in, completions out
//   14. Command line and main

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <sys/stat.h>

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#define XXH_INLINE_ALL
#include <xxhash.h>               // defines: XXH64 (block hashes, section 9)
#include <nlohmann/json.hpp>      // defines: nlohmann::json (config, checkpoints, prompts)

#include "safetensors.h"          // defines: SafeTensors, TensorView, DType (the checkpoint reader)
#include "tokenizer.h"            // defines: Tokenizer (Qwen2/Qwen3 byte-level BPE and the chat template)

using json = nlohmann::json;
typedef __nv_bfloat16 bf16;

// ==== 1. Errors and utilities ========================================================================
//
// Two kinds of failure, treated differently:
//   * a user mistake (bad flag, bad file, too-long prompt): die() with what was expected, what was found
//     and what to do, exit code 1, no stack of asserts;
//   * a broken invariant of our own or a failed CUDA call: the *_CHECK macros print the call, file, line
//     and the library's message, then exit 1.

[[noreturn]] static void die(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "nanovllm: error: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  exit(1);
}

#define CUDA_CHECK(call)                                                                             \
  do {                                                                                               \
    cudaError_t err_ = (call);                                                                       \
    if (err_ != cudaSuccess)                                                                         \
      die("CUDA call failed: %s\n  at %s:%d\n  %s (%s)", #call, __FILE__, __LINE__,                  \
          cudaGetErrorString(err_), cudaGetErrorName(err_));                                         \
  } while (0)

#define CUBLAS_CHECK(call)                                                                           \
  do {                                                                                               \
    cublasStatus_t st_ = (call);                                                                     \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                                \
      die("cuBLASLt call failed: %s\n  at %s:%d\n  %s", #call, __FILE__, __LINE__,                   \
          cublasLtGetStatusString(st_));                                                             \
  } while (0)

static double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Read a whole file into a string; a missing or unreadable file is a user error that names the path.
static std::string read_file(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  if (!f) die("cannot read %s '%s': %s", what, path.c_str(), strerror(errno));
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// ==== 2. Config: model config.json, engine settings, sampling parameters ==============================
//
// ModelConfig is what the checkpoint says (config.json, generation_config.json); Config is how the engine
// runs (nano-vllm: config.py Config, same field names and defaults); SamplingParams is per request
// (nano-vllm: sampling_params.py, plus greedy, top-k, top-p and a seed).

constexpr int HEAD_DIM = 128;  // D: every Qwen3 dense model uses 128, and the attention kernels are built for it

struct ModelConfig {
  int hidden_size = 0;              // H
  int intermediate_size = 0;        // I
  int num_hidden_layers = 0;        // L
  int num_attention_heads = 0;      // NH
  int num_key_value_heads = 0;      // NKV
  int head_dim = 0;                 // D
  int vocab_size = 0;               // V
  int max_position_embeddings = 0;
  float rms_norm_eps = 1e-6f;
  float rope_theta = 1e6f;
  bool tie_word_embeddings = false;
  std::string dtype = "bfloat16";   // the checkpoint's dtype (weights are converted to bf16 at load)
  std::vector<int> eos_token_ids;   // generation_config.json eos_token_id (int or list), else config.json's
};

// A field of config.json that must be there and be a number; the message names the file and field.
static double config_number(const json& j, const char* key, const std::string& path) {
  if (!j.contains(key)) die("%s: missing field \"%s\" (is this a Qwen3 config.json?)", path.c_str(), key);
  if (!j[key].is_number()) die("%s: field \"%s\" must be a number, found %s", path.c_str(), key, j[key].dump().c_str());
  return j[key].get<double>();
}

static std::vector<int> eos_ids_from(const json& v) {
  std::vector<int> ids;
  if (v.is_number_integer()) ids.push_back(v.get<int>());
  if (v.is_array())
    for (auto& x : v)
      if (x.is_number_integer()) ids.push_back(x.get<int>());
  return ids;
}

// Parse config.json text. Refuses anything that is not a dense Qwen3 (MoE, Llama, Qwen2 with qkv bias, rope
// scaling, sliding windows) with a message that names the field, rather than computing garbage later.
static ModelConfig parse_model_config(const std::string& text, const std::string& path) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    die("%s is not valid JSON: %s", path.c_str(), e.what());
  }
  if (!j.is_object()) die("%s: expected a JSON object", path.c_str());
  std::string arch = "(none)";
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty() &&
      j["architectures"][0].is_string())
    arch = j["architectures"][0].get<std::string>();
  if (arch != "Qwen3ForCausalLM")
    die("%s: architecture %s is not supported; nanovllm runs Qwen3ForCausalLM (dense Qwen3 models only)",
        path.c_str(), arch.c_str());
  ModelConfig c;
  c.hidden_size = (int)config_number(j, "hidden_size", path);
  c.intermediate_size = (int)config_number(j, "intermediate_size", path);
  c.num_hidden_layers = (int)config_number(j, "num_hidden_layers", path);
  c.num_attention_heads = (int)config_number(j, "num_attention_heads", path);
  c.num_key_value_heads = (int)config_number(j, "num_key_value_heads", path);
  c.vocab_size = (int)config_number(j, "vocab_size", path);
  c.max_position_embeddings = (int)config_number(j, "max_position_embeddings", path);
  c.rms_norm_eps = (float)config_number(j, "rms_norm_eps", path);
  if (!j.contains("head_dim"))
    die("%s: missing field \"head_dim\" (Qwen3 configs state it; nanovllm does not guess it)", path.c_str());
  c.head_dim = (int)config_number(j, "head_dim", path);
  // transformers < 5 writes rope_theta at the top level; transformers 5 nests it in rope_parameters.
  const json* rope = j.contains("rope_parameters") && j["rope_parameters"].is_object() ? &j["rope_parameters"]
                     : j.contains("rope_scaling") && j["rope_scaling"].is_object() ? &j["rope_scaling"] : nullptr;
  if (rope && rope->contains("rope_type") && (*rope)["rope_type"] != "default")
    die("%s: rope type %s is not supported (only plain RoPE)", path.c_str(), (*rope)["rope_type"].dump().c_str());
  if (j.contains("rope_theta")) c.rope_theta = (float)config_number(j, "rope_theta", path);
  else if (rope && rope->contains("rope_theta")) c.rope_theta = (float)config_number(*rope, "rope_theta", path);
  else die("%s: missing field \"rope_theta\"", path.c_str());
  if (j.value("attention_bias", false)) die("%s: attention_bias=true is not supported (Qwen3 has none)", path.c_str());
  if (j.value("use_sliding_window", false)) die("%s: sliding-window attention is not supported", path.c_str());
  c.tie_word_embeddings = j.value("tie_word_embeddings", false);
  if (j.contains("dtype") && j["dtype"].is_string()) c.dtype = j["dtype"];
  else if (j.contains("torch_dtype") && j["torch_dtype"].is_string()) c.dtype = j["torch_dtype"];
  if (j.contains("eos_token_id")) c.eos_token_ids = eos_ids_from(j["eos_token_id"]);

  auto positive = [&](int v, const char* name) {
    if (v <= 0) die("%s: \"%s\" must be positive, found %d", path.c_str(), name, v);
  };
  positive(c.hidden_size, "hidden_size");
  positive(c.intermediate_size, "intermediate_size");
  positive(c.num_hidden_layers, "num_hidden_layers");
  positive(c.num_attention_heads, "num_attention_heads");
  positive(c.num_key_value_heads, "num_key_value_heads");
  positive(c.vocab_size, "vocab_size");
  positive(c.max_position_embeddings, "max_position_embeddings");
  if (c.num_attention_heads % c.num_key_value_heads)
    die("%s: num_attention_heads (%d) must be a multiple of num_key_value_heads (%d)", path.c_str(),
        c.num_attention_heads, c.num_key_value_heads);
  if (c.head_dim != HEAD_DIM)
    die("%s: head_dim %d is not supported; every Qwen3 model uses %d and the kernels are built for it",
        path.c_str(), c.head_dim, HEAD_DIM);
  if (c.hidden_size % 8 || c.intermediate_size % 8)
    die("%s: hidden_size and intermediate_size must be multiples of 8 (found %d, %d)", path.c_str(),
        c.hidden_size, c.intermediate_size);
  return c;
}

static bool is_dir(const std::string& p) {
  struct stat sb;
  return stat(p.c_str(), &sb) == 0 && S_ISDIR(sb.st_mode);
}
static bool is_file(const std::string& p) {
  struct stat sb;
  return stat(p.c_str(), &sb) == 0 && S_ISREG(sb.st_mode);
}

// config.json, then generation_config.json for the EOS ids (it lists both <|im_end|> and <|endoftext|>).
static ModelConfig load_model_config(const std::string& dir) {
  if (!is_dir(dir))
    die("model folder '%s' does not exist or is not a folder.\n  Get one with: huggingface-cli download "
        "Qwen/Qwen3-0.6B --local-dir ~/huggingface/Qwen3-0.6B",
        dir.c_str());
  std::string path = dir + "/config.json";
  if (!is_file(path)) die("no config.json in model folder '%s' (is it a Hugging Face model folder?)", dir.c_str());
  ModelConfig c = parse_model_config(read_file(path, "model config"), path);
  std::string gpath = dir + "/generation_config.json";
  if (is_file(gpath)) {
    try {
      json g = json::parse(read_file(gpath, "generation config"));
      if (g.is_object() && g.contains("eos_token_id")) c.eos_token_ids = eos_ids_from(g["eos_token_id"]);
    } catch (const json::exception& e) {
      die("%s is not valid JSON: %s", gpath.c_str(), e.what());
    }
  }
  return c;
}

// The engine's knobs (nano-vllm: config.py Config). Flags spell them in kebab case: --max-num-seqs.
struct Config {
  std::string model;
  int max_num_batched_tokens = 16384;  // token budget of one prefill step
  int max_num_seqs = 512;              // sequences in one step
  int max_model_len = 4096;            // prompt + completion, clamped to max_position_embeddings
  float gpu_memory_utilization = 0.9f; // fraction of the GPU the engine may fill (weights + activations + KV)
  int tensor_parallel_size = 1;
  bool enforce_eager = false;          // no CUDA graphs
  int kvcache_block_size = 256;        // P: tokens per KV block (nano-vllm: multiples of 256; here 16..256)
  int num_kvcache_blocks = -1;         // NB: -1 = as many as fit (measured after a warm-up)
  std::vector<int> eos;                // filled from the model config
};

static bool is_pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }

// Check the engine settings; every message names the flag to change.
static void validate_config(Config& c, const ModelConfig& m) {
  if (c.max_num_batched_tokens < 1) die("--max-num-batched-tokens must be at least 1, found %d", c.max_num_batched_tokens);
  if (c.max_num_seqs < 1) die("--max-num-seqs must be at least 1, found %d", c.max_num_seqs);
  if (c.max_model_len < 2) die("--max-model-len must be at least 2, found %d", c.max_model_len);
  if (!(c.gpu_memory_utilization > 0 && c.gpu_memory_utilization <= 1))
    die("--gpu-memory-utilization must be in (0, 1], found %g", c.gpu_memory_utilization);
  if (c.tensor_parallel_size < 1 || c.tensor_parallel_size > 8)
    die("--tensor-parallel-size must be between 1 and 8, found %d", c.tensor_parallel_size);
  if (!is_pow2(c.kvcache_block_size) || c.kvcache_block_size < 16 || c.kvcache_block_size > 256)
    die("--kvcache-block-size must be a power of two from 16 to 256, found %d", c.kvcache_block_size);
  if (c.num_kvcache_blocks == 0 || c.num_kvcache_blocks < -1)
    die("--num-kvcache-blocks must be positive (or -1 for automatic), found %d", c.num_kvcache_blocks);
  c.max_model_len = std::min(c.max_model_len, m.max_position_embeddings);
  if (m.num_attention_heads % c.tensor_parallel_size || m.num_key_value_heads % c.tensor_parallel_size)
    die("--tensor-parallel-size %d must divide the number of query heads (%d) and of KV heads (%d)",
        c.tensor_parallel_size, m.num_attention_heads, m.num_key_value_heads);
  c.eos = m.eos_token_ids;
}

// One request's sampling settings (nano-vllm: SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=False)).
struct SamplingParams {
  float temperature = 1.0f;  // 0 = greedy (nano-vllm forbids 0; we allow it)
  int top_k = -1;            // keep the k most likely tokens; -1 = off
  float top_p = 1.0f;        // keep the smallest set whose probability reaches top_p; 1 = off
  int max_tokens = 64;
  bool ignore_eos = false;
  int64_t seed = -1;         // -1 = derived from the engine's --seed and the request's id
};

static void validate_sampling(const SamplingParams& p, const std::string& where) {
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature))
    die("%s: temperature must be >= 0, found %g", where.c_str(), p.temperature);
  if (!(p.top_p > 0 && p.top_p <= 1)) die("%s: top_p must be in (0, 1], found %g", where.c_str(), p.top_p);
  if (p.top_k == 0 || p.top_k < -1) die("%s: top_k must be positive or -1 (off), found %d", where.c_str(), p.top_k);
  if (p.max_tokens < 1) die("%s: max_tokens must be at least 1, found %d", where.c_str(), p.max_tokens);
}


// ==== 3. Weights: safetensors -> GPU, fused q/k/v and gate/up =========================================
//
// The checkpoint is read once, straight from the mmap()ed files into one GPU arena. Two fusions happen at
// load time (nano-vllm: packed_modules_mapping and the weight_loader of QKVParallelLinear /
// MergedColumnParallelLinear):
//   q_proj [NH*D, H] ; k_proj [NKV*D, H] ; v_proj [NKV*D, H]  ->  qkv_proj [(NH+2*NKV)*D, H]   one GEMM
//   gate_proj [I, H] ; up_proj [I, H]                          ->  gate_up  [2*I, H]            one GEMM
// so a layer runs 4 matrix products instead of 7. Every matrix stays in PyTorch's [out, in] row-major layout;
// section 6 explains how cuBLASLt reads it.
//
// Tensor parallelism slices while loading, so each rank reads only its share (section 12 of the map):
//   column-parallel (qkv, gate_up): each rank takes its rows: its q heads, its k/v heads, its I/tp slice;
//   row-parallel (o_proj, down): each rank takes its columns; the partial products are summed by all-reduce;
//   vocab-parallel (embed_tokens, lm_head): each rank takes V/tp rows.
// fp16 and fp32 checkpoints are converted to bf16 on the way in.

struct LayerWeights {
  bf16* input_layernorm;           // [H]
  bf16* post_attention_layernorm;  // [H]
  bf16* qkv_proj;                  // [(NH+2*NKV)/tp * D, H]
  bf16* q_norm;                    // [D]
  bf16* k_norm;                    // [D]
  bf16* o_proj;                    // [H, NH/tp * D]
  bf16* gate_up_proj;              // [2 * I/tp, H]   gate rows first, then up rows
  bf16* down_proj;                 // [H, I/tp]
};

struct Weights {
  bf16* embed_tokens;  // [V/tp, H]
  bf16* lm_head;       // [V/tp, H] (== embed_tokens when tie_word_embeddings)
  bf16* norm;          // [H]
  std::vector<LayerWeights> layers;
  void* arena = nullptr;
  size_t bytes = 0;
};

static float bf16_bits_to_float(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static uint16_t float_to_bf16_bits(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return 0x7fc0;
  return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
static float half_bits_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, u;
  if (exp == 0) {
    if (mant == 0) u = sign;
    else {  // subnormal: renormalise
      int e = -1;
      do { mant <<= 1; e++; } while (!(mant & 0x400));
      u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) u = sign | 0x7f800000 | (mant << 13);
  else u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// Copies tensor slices into the GPU arena through two pinned staging buffers, so the CPU fills one while the
// GPU copy engine drains the other. A slice is rows [r0, r0+nr) and columns [c0, c0+nc) of a 2-D tensor
// (1-D tensors are one row).
struct WeightLoader {
  const SafeTensors& st;
  const ModelConfig& cfg;
  cudaStream_t stream;
  static constexpr size_t kStage = 64 << 20;
  uint16_t* stage[2] = {nullptr, nullptr};
  cudaEvent_t done[2];
  int cur = 0;
  size_t fill = 0;       // bytes in stage[cur]
  bf16* fill_dst = nullptr;  // where stage[cur]'s contents go (contiguous)
  size_t bytes_read = 0;

  WeightLoader(const SafeTensors& s, const ModelConfig& c, cudaStream_t st_) : st(s), cfg(c), stream(st_) {
    for (int i = 0; i < 2; i++) {
      CUDA_CHECK(cudaMallocHost(&stage[i], kStage));
      CUDA_CHECK(cudaEventCreateWithFlags(&done[i], cudaEventDisableTiming));
      CUDA_CHECK(cudaEventRecord(done[i], stream));
    }
  }
  ~WeightLoader() {
    for (int i = 0; i < 2; i++) {
      cudaEventSynchronize(done[i]);
      cudaFreeHost(stage[i]);
      cudaEventDestroy(done[i]);
    }
  }
  void flush() {
    if (!fill) return;
    CUDA_CHECK(cudaMemcpyAsync(fill_dst, stage[cur], fill, cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaEventRecord(done[cur], stream));
    cur ^= 1;
    CUDA_CHECK(cudaEventSynchronize(done[cur]));  // the other buffer is free again
    fill = 0;
  }
  // Look a tensor up and check its shape against the config: a wrong checkpoint is a clear error.
  const TensorView& get(const std::string& name, std::vector<int64_t> shape) {
    const TensorView* t = st.find(name);
    if (!t) die("checkpoint has no tensor '%s' (needed by the config: is this a Qwen3 checkpoint?)", name.c_str());
    if (t->shape != shape) {
      TensorView want;
      want.shape = shape;
      die("tensor '%s' in %s has shape %s, but config.json implies %s", name.c_str(), t->file.c_str(),
          t->shape_str().c_str(), want.shape_str().c_str());
    }
    if (t->dtype != DType::BF16 && t->dtype != DType::F16 && t->dtype != DType::F32)
      die("tensor '%s' has dtype %s; nanovllm loads BF16, F16 or F32 checkpoints", name.c_str(), dtype_name(t->dtype));
    return *t;
  }
  // Append rows [r0, r0+nr) x cols [c0, c0+nc) of `t` (converted to bf16) at `dst`, contiguously.
  void load(bf16* dst, const TensorView& t, int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
    int64_t cols = t.shape.size() == 2 ? t.shape[1] : t.numel();
    int esize = dtype_size(t.dtype);
    const uint8_t* base = (const uint8_t*)t.data;
    for (int64_t r = r0; r < r0 + nr; r++) {
      int64_t c = c0;
      while (c < c0 + nc) {
        if (fill == kStage || (fill && fill_dst + fill / 2 != dst)) flush();
        if (!fill) fill_dst = dst;
        int64_t n = std::min<int64_t>(c0 + nc - c, (kStage - fill) / 2);
        const uint8_t* src = base + (r * cols + c) * esize;
        uint16_t* out = stage[cur] + fill / 2;
        if (t.dtype == DType::BF16) memcpy(out, src, n * 2);
        else if (t.dtype == DType::F16)
          for (int64_t i = 0; i < n; i++) out[i] = float_to_bf16_bits(half_bits_to_float(((const uint16_t*)src)[i]));
        else
          for (int64_t i = 0; i < n; i++) out[i] = float_to_bf16_bits(((const float*)src)[i]);
        fill += n * 2;
        dst += n;
        c += n;
        bytes_read += n * esize;
      }
    }
  }
};

// Load (this rank's share of) every weight. Returns the arena; prints nothing (the caller reports timing).
static Weights load_weights(const std::string& dir, const ModelConfig& c, int rank, int tp, cudaStream_t stream,
                            size_t* bytes_read) {
  SafeTensors st;
  try {
    st = SafeTensors::open_dir(dir);
  } catch (const SafeTensorsError& e) {
    die("%s", e.what());
  }
  const int64_t H = c.hidden_size, I = c.intermediate_size / tp, D = c.head_dim;
  const int64_t NH = c.num_attention_heads / tp, NKV = c.num_key_value_heads / tp;
  const int64_t V = cdiv(c.vocab_size, tp), L = c.num_hidden_layers;
  if (c.intermediate_size % tp) die("intermediate_size %d is not divisible by --tensor-parallel-size %d",
                                    c.intermediate_size, tp);
  const int64_t qkv_rows = (NH + 2 * NKV) * D;
  // Element counts of everything, to size the arena once.
  int64_t per_layer = 2 * H + qkv_rows * H + 2 * D + H * NH * D + 2 * I * H + H * I;
  int64_t total = V * H * (c.tie_word_embeddings ? 1 : 2) + H + L * per_layer;
  Weights w;
  w.bytes = total * sizeof(bf16);
  CUDA_CHECK(cudaMalloc(&w.arena, w.bytes));
  bf16* p = (bf16*)w.arena;
  auto take = [&](int64_t n) { bf16* r = p; p += n; return r; };
  WeightLoader ld(st, c, stream);
  // Vocab-parallel rows; the last rank's slice may run past V (zero-filled, never selected).
  auto load_vocab = [&](bf16* dst, const TensorView& t) {
    int64_t r0 = rank * V, nr = std::max<int64_t>(0, std::min<int64_t>(V, c.vocab_size - r0));
    if (nr < V) CUDA_CHECK(cudaMemsetAsync(dst, 0, V * H * sizeof(bf16), stream));
    ld.load(dst, t, r0, nr, 0, H);
  };
  w.embed_tokens = take(V * H);
  load_vocab(w.embed_tokens, ld.get("model.embed_tokens.weight", {c.vocab_size, H}));
  if (c.tie_word_embeddings) w.lm_head = w.embed_tokens;
  else {
    w.lm_head = take(V * H);
    load_vocab(w.lm_head, ld.get("lm_head.weight", {c.vocab_size, H}));
  }
  w.norm = take(H);
  ld.load(w.norm, ld.get("model.norm.weight", {H}), 0, 1, 0, H);
  for (int64_t l = 0; l < L; l++) {
    std::string pre = "model.layers." + std::to_string(l) + ".";
    LayerWeights lw;
    lw.input_layernorm = take(H);
    ld.load(lw.input_layernorm, ld.get(pre + "input_layernorm.weight", {H}), 0, 1, 0, H);
    lw.post_attention_layernorm = take(H);
    ld.load(lw.post_attention_layernorm, ld.get(pre + "post_attention_layernorm.weight", {H}), 0, 1, 0, H);
    lw.qkv_proj = take(qkv_rows * H);
    const int64_t NHf = c.num_attention_heads, NKVf = c.num_key_value_heads;
    ld.load(lw.qkv_proj, ld.get(pre + "self_attn.q_proj.weight", {NHf * D, H}), rank * NH * D, NH * D, 0, H);
    ld.load(lw.qkv_proj + NH * D * H, ld.get(pre + "self_attn.k_proj.weight", {NKVf * D, H}), rank * NKV * D,
            NKV * D, 0, H);
    ld.load(lw.qkv_proj + (NH + NKV) * D * H, ld.get(pre + "self_attn.v_proj.weight", {NKVf * D, H}),
            rank * NKV * D, NKV * D, 0, H);
    lw.q_norm = take(D);
    ld.load(lw.q_norm, ld.get(pre + "self_attn.q_norm.weight", {D}), 0, 1, 0, D);
    lw.k_norm = take(D);
    ld.load(lw.k_norm, ld.get(pre + "self_attn.k_norm.weight", {D}), 0, 1, 0, D);
    lw.o_proj = take(H * NH * D);
    ld.load(lw.o_proj, ld.get(pre + "self_attn.o_proj.weight", {H, NHf * D}), 0, H, rank * NH * D, NH * D);
    lw.gate_up_proj = take(2 * I * H);
    const int64_t If = c.intermediate_size;
    ld.load(lw.gate_up_proj, ld.get(pre + "mlp.gate_proj.weight", {If, H}), rank * I, I, 0, H);
    ld.load(lw.gate_up_proj + I * H, ld.get(pre + "mlp.up_proj.weight", {If, H}), rank * I, I, 0, H);
    lw.down_proj = take(H * I);
    ld.load(lw.down_proj, ld.get(pre + "mlp.down_proj.weight", {H, If}), 0, H, rank * I, I);
    w.layers.push_back(lw);
  }
  ld.flush();
  CUDA_CHECK(cudaStreamSynchronize(stream));
  *bytes_read = ld.bytes_read;
  return w;
}

// ==== 4. The KV cache layout ==========================================================================
//
// One cudaMalloc holds every layer's keys and values (nano-vllm: ModelRunner.allocate_kv_cache):
//
//   kv_cache  [L, 2, NB, NKV/tp, P, D]  bf16
//              |  |   |    |     |  '-- head dim (128)
//              |  |   |    |     '---- token slot inside the block
//              |  |   |    '---------- KV head (this rank's share)
//              |  |   '--------------- physical block (what block tables point at)
//              |  '------------------- 0 = keys, 1 = values
//              '---------------------- layer
//
// One (block, head) tile is P*D contiguous values: the decode kernel streams it with wide loads, and every
// query head of a GQA group reuses it. Token t of a sequence lives in block block_table[t / P], slot t % P;
// the flat slot number block * P + t % P is what slot_mapping carries. A block costs
//   block_bytes = 2 * L * P * NKV/tp * D * 2 bytes   (28 MiB for Qwen3-0.6B at P = 256)
// and the pool gets whatever gpu_memory_utilization leaves after weights and activations (section 11).

struct KVCache {
  bf16* base = nullptr;
  int64_t num_blocks = 0, layer_stride = 0, kv_stride = 0;  // elements
  size_t bytes = 0;
  bf16* k(int layer) const { return base + layer * layer_stride; }
  bf16* v(int layer) const { return base + layer * layer_stride + kv_stride; }
};

static size_t kv_block_bytes(const ModelConfig& c, int P, int tp) {
  return (size_t)2 * c.num_hidden_layers * P * (c.num_key_value_heads / tp) * c.head_dim * sizeof(bf16);
}

// ==== 5. Kernels (each followed by its launcher) ======================================================
//
// Every kernel has a comment block: the math it replaces, the layouts it reads and writes, what one
// thread / warp / block owns, and its preconditions. Its launcher follows it and checks the launch.

// ---- 5a. Elementwise and normalisation kernels: embedding, RMSNorm, q/k norm + RoPE, KV store, SiLU ----


// (end of 5a)
//
//
// ---- 5b. Paged attention: prefill (tensor cores, online softmax) and decode (split-K) -------------------


// (end of 5b)
//
//
// ---- 5c. Sampling: greedy, temperature (Gumbel-max with Philox), top-k, top-p ---------------------------


// (end of 5c)

// ==== 6. Matrix products with cuBLASLt ================================================================
//
// Every linear layer is y = x @ W^T with x [M, K] (M tokens) and W [N, K] in PyTorch's row-major [out, in]
// layout. cuBLASLt thinks in column-major, where a row-major [M, N] matrix is the column-major [N, M] one,
// so we ask it for  y^T [N, M] = W [N, K] (i.e. column-major K x N, transposed) * x^T (column-major K x M):
// transa = T, transb = N, m = N, n = M, k = K. bf16 inputs, fp32 accumulation, bf16 (or fp32 for logits) out.
//
// Choosing an algorithm costs tens of microseconds, so it is done once per (M, N, K, output type) and cached;
// a CUDA graph captures the chosen algorithm and the one preallocated workspace.

struct GemmPlan {
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t a, b, c;
  cublasLtMatmulAlgo_t algo;
};

struct Gemm {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 32 << 20;
  std::map<std::tuple<int, int, int, int>, GemmPlan> plans;

  void init() {
    CUBLAS_CHECK(cublasLtCreate(&handle));
    CUDA_CHECK(cudaMalloc(&workspace, workspace_bytes));
  }

  GemmPlan& plan(int M, int N, int K, cudaDataType out_type) {
    auto key = std::make_tuple(M, N, K, (int)out_type);
    auto it = plans.find(key);
    if (it != plans.end()) return it->second;
    GemmPlan p;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, K, N, K));  // W, read transposed
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, K, M, K));  // x
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, out_type, N, M, N));     // y
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &workspace_bytes, sizeof workspace_bytes));
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.a, p.b, p.c, p.c, pref, 1, &res, &found));
    cublasLtMatmulPreferenceDestroy(pref);
    if (!found) die("cuBLASLt found no algorithm for a %d x %d x %d bf16 matrix product", M, N, K);
    p.algo = res.algo;
    return plans[key] = p;
  }

  // y [M, N] = x [M, K] @ W[N, K]^T ; y is bf16, or fp32 when out_type is CUDA_R_32F.
  void run(void* y, const bf16* x, const bf16* W, int M, int N, int K, cudaStream_t stream,
           cudaDataType out_type = CUDA_R_16BF) {
    if (M == 0) return;
    GemmPlan& p = plan(M, N, K, out_type);
    const float alpha = 1.0f, beta = 0.0f;
    CUBLAS_CHECK(cublasLtMatmul(handle, p.desc, &alpha, W, p.a, x, p.b, &beta, y, p.c, y, p.c, &p.algo, workspace,
                                workspace_bytes, stream));
  }
};

// ==== 7. The Qwen3 forward pass =======================================================================
//
// One step, prefill or decode, T tokens from B sequences (nano-vllm: models/qwen3.py). Per layer:
//
//   x = RMSNorm(residual)                              (layer 0: residual = embedding)
//   qkv = x @ Wqkv^T                                   [T, (NH+2NKV)*D]
//   q, k = RMSNorm_head(q), RMSNorm_head(k); RoPE(q, k)   in place
//   K/V cache[slot_mapping] = k, v                     this step's keys/values join the cache
//   a = attention(q, cache, block_tables)              causal, GQA; prefill or decode kernel
//   h = a @ Wo^T                 (+ all-reduce)        [T, H]
//   x = RMSNorm(residual += h)
//   h = (SiLU(x @ Wg^T) * (x @ Wu^T)) @ Wd^T   (+ all-reduce)
//   residual += h  (folded into the next layer's norm)
// then x = RMSNorm(residual += h), keep each sequence's last row, logits = x @ lm_head^T (fp32).
//
// Every buffer is allocated once for the largest step (ModelRunner), so a step allocates nothing and a
// decode step can be captured in a CUDA graph.

struct Activations {
  bf16* residual;  // [Tmax, H]
  bf16* hidden;    // [Tmax, H]  a sub-layer's output
  bf16* x;         // [Tmax, H]  normed input of a sub-layer
  bf16* qkv;       // [Tmax, (NH+2NKV)/tp * D]
  bf16* attn;      // [Tmax, NH/tp * D]
  bf16* gate_up;   // [Tmax, 2 * I/tp]
  bf16* act;       // [Tmax, I/tp]
  bf16* last;      // [Bmax, H]  final normed row of each sequence
  float* logits;   // [Bmax, V/tp]
  float* attn_workspace;  // decode split-K partials
};

// Device pointers to one step's inputs (built on the host by ModelRunner::prepare_*).
struct StepInputs {
  int* input_ids;     // [T]
  int* positions;     // [T]
  int* slot_mapping;  // [T]  -1 = do not store
  int* cu_seqlens_q;  // [B+1] prefill: row offsets of each sequence's new tokens
  int* seqlens_k;     // [B]   prefill: keys each sequence attends (cached + new); decode: context lengths
  int* block_tables;  // [B, MB]
  int max_seqlen_q;   // host value (prefill)
};

struct TPComm;  // section 12a; null without tensor parallelism
static void all_reduce_sum(TPComm* comm, bf16* x, size_t n, cudaStream_t stream);

struct Qwen3 {
  ModelConfig cfg;
  Weights w;
  KVCache kv;
  Gemm gemm;
  Activations act;
  int tp = 1, rank = 0;
  TPComm* comm = nullptr;
  int P = 256, MB = 16, max_model_len = 4096;

  // Runs the model on one step and leaves fp32 logits of each sequence's last token in act.logits.
  void forward(const StepInputs& in, int T, int B, bool is_prefill, cudaStream_t s) {
    const int H = cfg.hidden_size, I = cfg.intermediate_size / tp, D = cfg.head_dim;
    const int NH = cfg.num_attention_heads / tp, NKV = cfg.num_key_value_heads / tp;
    const int V = (int)cdiv(cfg.vocab_size, tp);
    const float eps = cfg.rms_norm_eps, scale = 1.0f / sqrtf((float)D);
    embedding(act.residual, in.input_ids, w.embed_tokens, T, H, rank * V, V, s);
    if (tp > 1) all_reduce_sum(comm, act.residual, (size_t)T * H, s);
    for (int l = 0; l < cfg.num_hidden_layers; l++) {
      const LayerWeights& lw = w.layers[l];
      if (l == 0) rmsnorm(act.x, act.residual, lw.input_layernorm, T, H, eps, s);
      else add_rmsnorm(act.x, act.residual, act.hidden, lw.input_layernorm, T, H, eps, s);
      gemm.run(act.qkv, act.x, lw.qkv_proj, T, (NH + 2 * NKV) * D, H, s);
      qk_norm_rope(act.qkv, in.positions, lw.q_norm, lw.k_norm, T, NH, NKV, cfg.rope_theta, eps, s);
      store_kvcache(kv.k(l), kv.v(l), act.qkv, in.slot_mapping, T, NH, NKV, P, s);
      if (is_prefill)
        attention_prefill(act.attn, act.qkv, kv.k(l), kv.v(l), in.cu_seqlens_q, in.seqlens_k, in.block_tables, B,
                          in.max_seqlen_q, NH, NKV, P, MB, scale, s);
      else
        attention_decode(act.attn, act.qkv, kv.k(l), kv.v(l), in.seqlens_k, in.block_tables, B, NH, NKV, P, MB,
                         max_model_len, act.attn_workspace, scale, s);
      gemm.run(act.hidden, act.attn, lw.o_proj, T, H, NH * D, s);
      if (tp > 1) all_reduce_sum(comm, act.hidden, (size_t)T * H, s);
      add_rmsnorm(act.x, act.residual, act.hidden, lw.post_attention_layernorm, T, H, eps, s);
      gemm.run(act.gate_up, act.x, lw.gate_up_proj, T, 2 * I, H, s);
      silu_and_mul(act.act, act.gate_up, T, I, s);
      gemm.run(act.hidden, act.act, lw.down_proj, T, H, I, s);
      if (tp > 1) all_reduce_sum(comm, act.hidden, (size_t)T * H, s);
    }
    add_rmsnorm(act.x, act.residual, act.hidden, w.norm, T, H, eps, s);
    const bf16* last = act.x;
    if (is_prefill) {  // only each sequence's last position needs logits (nano-vllm: ParallelLMHead)
      gather_last_tokens(act.last, act.x, in.cu_seqlens_q, B, H, s);
      last = act.last;
    }
    gemm.run(act.logits, last, w.lm_head, B, V, H, s, CUDA_R_32F);
  }
};

// ==== 8. Sequence =====================================================================================
//
// One request as the scheduler sees it (nano-vllm: engine/sequence.py Sequence). The token list holds the
// prompt followed by every generated token. Three counters tell the whole story of a sequence:
//
//   token_ids:  [ p p p p p p p p p p | c c c ]           num_tokens = 13, num_prompt_tokens = 10
//   KV cache:   [ k k k k k k k k k k   k k ]             num_cached_tokens = 12 (K/V already computed)
//   this step:                                [ s ]       num_scheduled_tokens = 1 (decode)
//
// num_cached_tokens grows by prefix-cache hits (whole blocks at admission), by finished prefill chunks and by
// one per decode step; preemption drops it to 0 (recompute).

enum class SequenceStatus { WAITING, RUNNING, FINISHED };

struct Sequence {
  int64_t seq_id;                // increasing: the order requests arrived in
  SequenceStatus status = SequenceStatus::WAITING;
  std::vector<int> token_ids;    // prompt, then completion
  int last_token;
  int num_tokens;
  int num_prompt_tokens;
  int num_cached_tokens = 0;     // leading tokens whose K/V is in the cache
  int num_scheduled_tokens = 0;  // tokens this step computes
  std::vector<int> block_table;  // logical block i -> physical block id
  int block_size;                // P (nano-vllm keeps it as a class attribute)
  SamplingParams params;
  const char* finish_reason = nullptr;  // "stop" (EOS) or "length" (max_tokens)

  Sequence(int64_t id, std::vector<int> prompt, SamplingParams sp, int block_size_)
      : seq_id(id), token_ids(std::move(prompt)), block_size(block_size_), params(sp) {
    last_token = token_ids.back();
    num_tokens = (int)token_ids.size();
    num_prompt_tokens = num_tokens;
  }
  int size() const { return num_tokens; }  // nano-vllm: __len__
  bool is_finished() const { return status == SequenceStatus::FINISHED; }
  int num_completion_tokens() const { return num_tokens - num_prompt_tokens; }
  int num_cached_blocks() const { return num_cached_tokens / block_size; }
  int num_blocks() const { return (int)cdiv(num_tokens, block_size); }
  int last_block_num_tokens() const { return num_tokens - (num_blocks() - 1) * block_size; }
  // Tokens of logical block i (the last one may be partial).
  const int* block(int i) const { return token_ids.data() + (size_t)i * block_size; }
  int block_len(int i) const { return std::min(block_size, num_tokens - i * block_size); }
  void append_token(int token_id) {
    token_ids.push_back(token_id);
    last_token = token_id;
    num_tokens++;
  }
};

// ==== 9. BlockManager: paged KV blocks and prefix caching =============================================
//
// The KV cache is a pool of NB blocks of P token slots each (section 4). A sequence owns a block table, a
// list of physical block ids, so its K/V can live anywhere in the pool: no fragmentation, no copying when it
// grows (nano-vllm: engine/block_manager.py; vLLM's PagedAttention).
//
// Prefix caching: every FULL block gets a hash that commits to its tokens and, through the previous block's
// hash, to every token before it:
//     hash(block i) = xxHash64(seed 0) over [ hash(block i-1) as 8 little-endian bytes ] (absent for i = 0)
//                                        ++ [ the block's P token ids as little-endian int64 ]
// (byte for byte what nano-vllm feeds xxhash from numpy's int64 array, so the hashes are equal). One table
// lookup per block finds the longest cached prefix. A hit also compares the stored tokens, so a hash collision
// can never serve wrong K/V.
//
// Lazy eviction: a block whose ref_count drops to 0 goes to the back of the free list but keeps its hash and
// contents, so it is still a cache hit until it is handed out again (from the front of the free list, oldest
// first); only then is its hash forgotten.
//
// Our free list is a doubly linked list threaded through the blocks, so reviving a free block that got a hit
// is O(1) (nano-vllm removes it from a deque in O(NB)); the order of blocks handed out is the same.

struct Block {
  int block_id;
  int ref_count = 0;
  bool has_hash = false;
  uint64_t hash = 0;
  std::vector<int> token_ids;  // the tokens whose K/V this block holds (set when it becomes full)
  int prev_free = -1, next_free = -1;  // free-list links (valid while ref_count == 0)
  void update(uint64_t h, const int* tokens, int n) {
    hash = h;
    has_hash = true;
    token_ids.assign(tokens, tokens + n);
  }
  void reset() {
    ref_count = 1;
    has_hash = false;
    token_ids.clear();
  }
};

// nano-vllm: BlockManager.compute_hash. `prefix` is the previous block's hash, or none for block 0.
static uint64_t compute_block_hash(const int* token_ids, int n, const uint64_t* prefix) {
  std::vector<uint8_t> buf;  // [prefix: 8 bytes] [n token ids: 8 bytes each], all little-endian
  buf.reserve(8 + 8 * (size_t)n);
  auto put_le64 = [&](uint64_t v) {
    for (int i = 0; i < 8; i++) buf.push_back((uint8_t)(v >> (8 * i)));
  };
  if (prefix) put_le64(*prefix);
  for (int i = 0; i < n; i++) put_le64((uint64_t)(int64_t)token_ids[i]);  // numpy int64, sign-extended
  return XXH64(buf.data(), buf.size(), 0);
}

struct BlockManager {
  int block_size;
  std::vector<Block> blocks;
  std::unordered_map<uint64_t, int> hash_to_block_id;
  int free_head = -1, free_tail = -1, num_free = 0;  // the free list, oldest first
  int num_used = 0;

  BlockManager(int num_blocks, int block_size_) : block_size(block_size_), blocks(num_blocks) {
    for (int i = 0; i < num_blocks; i++) {
      blocks[i].block_id = i;
      free_push_back(i);
    }
  }
  int num_free_blocks() const { return num_free; }
  bool is_used(int id) const { return blocks[id].ref_count > 0; }

  // ---- the free list (nano-vllm: free_block_ids deque + used_block_ids set) ----
  void free_push_back(int id) {
    Block& b = blocks[id];
    b.prev_free = free_tail;
    b.next_free = -1;
    if (free_tail >= 0) blocks[free_tail].next_free = id;
    else free_head = id;
    free_tail = id;
    num_free++;
  }
  void free_remove(int id) {
    Block& b = blocks[id];
    if (b.prev_free >= 0) blocks[b.prev_free].next_free = b.next_free;
    else free_head = b.next_free;
    if (b.next_free >= 0) blocks[b.next_free].prev_free = b.prev_free;
    else free_tail = b.prev_free;
    b.prev_free = b.next_free = -1;
    num_free--;
  }

  // nano-vllm: _allocate_block. Take the oldest free block; its old hash (if still registered to it) goes.
  int allocate_block() {
    int id = free_head;
    assert_invariant(id >= 0, "allocate_block with an empty free list");
    Block& b = blocks[id];
    assert_invariant(b.ref_count == 0, "free block with a non-zero ref_count");
    if (b.has_hash) {
      auto it = hash_to_block_id.find(b.hash);
      if (it != hash_to_block_id.end() && it->second == id) hash_to_block_id.erase(it);
    }
    free_remove(id);
    b.reset();
    num_used++;
    return id;
  }
  void deallocate_block(int id) {
    assert_invariant(blocks[id].ref_count == 0, "deallocate_block of a block still referenced");
    num_used--;
    free_push_back(id);
  }

  // nano-vllm: can_allocate. Walk the prompt's full blocks except the last (which is always recomputed, so
  // at least one token produces logits), following the hash chain to the first miss. Returns the number of
  // cached leading blocks, or -1 when the free blocks cannot cover the rest.
  int can_allocate(const Sequence& seq) const {
    uint64_t h = 0;
    bool have_prev = false;
    int num_cached_blocks = 0;
    int num_new_blocks = seq.num_blocks();
    for (int i = 0; i < seq.num_blocks() - 1; i++) {
      h = compute_block_hash(seq.block(i), block_size, have_prev ? &h : nullptr);
      have_prev = true;
      auto it = hash_to_block_id.find(h);
      if (it == hash_to_block_id.end()) break;
      const Block& b = blocks[it->second];
      if ((int)b.token_ids.size() != block_size || !std::equal(b.token_ids.begin(), b.token_ids.end(), seq.block(i)))
        break;  // a hash collision, or the block was rewritten: not a hit
      num_cached_blocks++;
      if (is_used(it->second)) num_new_blocks--;  // shared, not taken from the free list
    }
    if (num_free < num_new_blocks) return -1;
    return num_cached_blocks;
  }

  // nano-vllm: allocate. Share (or revive) the cached blocks, take fresh ones for the rest.
  void allocate(Sequence& seq, int num_cached_blocks) {
    assert_invariant(seq.block_table.empty(), "allocate on a sequence that has blocks");
    uint64_t h = 0;
    for (int i = 0; i < num_cached_blocks; i++) {
      h = compute_block_hash(seq.block(i), block_size, i ? &h : nullptr);
      int id = hash_to_block_id.at(h);
      Block& b = blocks[id];
      if (is_used(id)) {
        b.ref_count++;
      } else {  // a freed block that still holds this prefix: take it back off the free list
        free_remove(id);
        b.ref_count = 1;
        num_used++;
      }
      seq.block_table.push_back(id);
    }
    for (int i = num_cached_blocks; i < seq.num_blocks(); i++) seq.block_table.push_back(allocate_block());
    seq.num_cached_tokens = num_cached_blocks * block_size;
  }

  // nano-vllm: deallocate. Release in reverse so a sequence's tail blocks are reused before its prefix.
  void deallocate(Sequence& seq) {
    for (int k = (int)seq.block_table.size() - 1; k >= 0; k--) {
      int id = seq.block_table[k];
      if (--blocks[id].ref_count == 0) deallocate_block(id);
    }
    seq.num_cached_tokens = 0;
    seq.block_table.clear();
  }

  // nano-vllm: can_append / may_append. A decode step writes the K/V of the sequence's last token at slot
  // len-1; when len % P == 1 that slot opens a new block.
  bool can_append(const Sequence& seq) const { return num_free >= (seq.size() % block_size == 1 ? 1 : 0); }
  void may_append(Sequence& seq) {
    if (seq.size() % block_size == 1) seq.block_table.push_back(allocate_block());
  }

  // nano-vllm: hash_blocks. After a step, register the blocks that just became full (prefill and decode
  // alike, so generated text becomes a cacheable prefix too).
  void hash_blocks(Sequence& seq) {
    int start = seq.num_cached_tokens / block_size;
    int end = (seq.num_cached_tokens + seq.num_scheduled_tokens) / block_size;
    if (start == end) return;
    uint64_t h = 0;
    bool have_prev = start > 0;
    if (have_prev) {
      const Block& prev = blocks[seq.block_table[start - 1]];
      assert_invariant(prev.has_hash, "hash_blocks: previous block has no hash");
      h = prev.hash;
    }
    for (int i = start; i < end; i++) {
      Block& b = blocks[seq.block_table[i]];
      h = compute_block_hash(seq.block(i), block_size, have_prev ? &h : nullptr);
      have_prev = true;
      b.update(h, seq.block(i), block_size);
      hash_to_block_id[h] = b.block_id;
    }
  }

  static void assert_invariant(bool ok, const char* what) {
    if (!ok) die("internal error in BlockManager: %s", what);
  }
};

// ==== 10. Scheduler: continuous batching, chunked prefill, preemption =================================
//
// Every step the scheduler picks the work (nano-vllm: engine/scheduler.py Scheduler):
//   1. Prefill first. Admit waiting sequences in arrival order while the step has room (max_num_seqs,
//      max_num_batched_tokens) and the block pool can hold them. Prefix-cache hits cost no compute. Only the
//      first sequence of a step may be cut short (chunked prefill): it gets what is left of the budget, keeps
//      its place at the head of `waiting`, and joins `running` once its whole prompt has been scheduled.
//   2. If nothing was admitted, decode: one token for every running sequence. A sequence that needs a new
//      block when none is free makes room by preempting the newest running sequence (or itself, if it is the
//      last): its blocks are freed and it goes back to the FRONT of `waiting` to be recomputed later
//      (no swapping). Its full blocks keep their hashes, so the recompute is mostly prefix-cache hits.
// A step is therefore all prefill or all decode. postprocess() then appends the sampled tokens and retires
// finished sequences, whose blocks go back to the pool at once: that is continuous batching.

struct SchedulerStats {
  int64_t num_preemptions = 0;
  int64_t prefix_hit_tokens = 0;  // prompt tokens served from the cache at admission
  int64_t prompt_tokens_admitted = 0;
};

struct Scheduler {
  int max_num_seqs, max_num_batched_tokens, block_size;
  std::vector<int> eos;
  BlockManager block_manager;
  std::deque<Sequence*> waiting, running;
  SchedulerStats stats;
  std::vector<std::pair<int64_t, int>> last_preempted;  // (seq_id, length) preempted in the last schedule()
  int last_cached_tokens = 0;                           // prefix-hit tokens found in the last schedule()

  Scheduler(const Config& c)
      : max_num_seqs(c.max_num_seqs), max_num_batched_tokens(c.max_num_batched_tokens),
        block_size(c.kvcache_block_size), eos(c.eos), block_manager(c.num_kvcache_blocks, c.kvcache_block_size) {}

  bool is_finished() const { return waiting.empty() && running.empty(); }
  void add(Sequence* seq) { waiting.push_back(seq); }

  // Returns the sequences of this step; sets is_prefill.
  std::vector<Sequence*> schedule(bool& is_prefill) {
    std::vector<Sequence*> scheduled;
    last_preempted.clear();
    last_cached_tokens = 0;
    int num_batched_tokens = 0;
    // prefill
    while (!waiting.empty() && (int)scheduled.size() < max_num_seqs) {
      Sequence* seq = waiting.front();
      int remaining = max_num_batched_tokens - num_batched_tokens;
      if (remaining == 0) break;
      int num_tokens, num_cached_blocks = 0;
      if (seq->block_table.empty()) {
        num_cached_blocks = block_manager.can_allocate(*seq);
        if (num_cached_blocks == -1) break;
        num_tokens = seq->num_tokens - num_cached_blocks * block_size;
      } else {
        num_tokens = seq->num_tokens - seq->num_cached_tokens;  // the rest of a chunked prompt
      }
      if (remaining < num_tokens && !scheduled.empty()) break;  // only the first sequence may be chunked
      if (seq->block_table.empty()) {
        block_manager.allocate(*seq, num_cached_blocks);
        stats.prefix_hit_tokens += seq->num_cached_tokens;
        stats.prompt_tokens_admitted += seq->num_tokens;
        last_cached_tokens += seq->num_cached_tokens;
      }
      seq->num_scheduled_tokens = std::min(num_tokens, remaining);
      num_batched_tokens += seq->num_scheduled_tokens;
      if (seq->num_cached_tokens + seq->num_scheduled_tokens == seq->num_tokens) {
        seq->status = SequenceStatus::RUNNING;
        waiting.pop_front();
        running.push_back(seq);
      }
      scheduled.push_back(seq);
    }
    if (!scheduled.empty()) {
      is_prefill = true;
      return scheduled;
    }
    // decode
    while (!running.empty() && (int)scheduled.size() < max_num_seqs) {
      Sequence* seq = running.front();
      running.pop_front();
      bool ok = true;
      while (!block_manager.can_append(*seq)) {
        if (!running.empty()) {
          preempt(running.back());
          running.pop_back();
        } else {
          preempt(seq);
          ok = false;
          break;
        }
      }
      if (ok) {
        seq->num_scheduled_tokens = 1;
        block_manager.may_append(*seq);
        scheduled.push_back(seq);
      }
    }
    if (scheduled.empty())  // cannot happen when the pool holds one max_model_len sequence (checked at start)
      die("the KV cache cannot hold even one sequence: %d free blocks of %d tokens. Lower --max-model-len or "
          "raise --gpu-memory-utilization / --num-kvcache-blocks",
          block_manager.num_free_blocks(), block_size);
    for (auto it = scheduled.rbegin(); it != scheduled.rend(); ++it) running.push_front(*it);
    is_prefill = false;
    return scheduled;
  }

  // nano-vllm: preempt. Recompute later: free everything, back to the front of the queue.
  void preempt(Sequence* seq) {
    last_preempted.push_back({seq->seq_id, seq->num_tokens});
    stats.num_preemptions++;
    seq->status = SequenceStatus::WAITING;
    seq->num_scheduled_tokens = 0;
    block_manager.deallocate(*seq);
    waiting.push_front(seq);
  }

  bool is_eos(int token) const { return std::find(eos.begin(), eos.end(), token) != eos.end(); }

  // nano-vllm: postprocess. token_ids[i] was sampled for seqs[i].
  void postprocess(const std::vector<Sequence*>& seqs, const std::vector<int>& token_ids, bool is_prefill) {
    for (size_t i = 0; i < seqs.size(); i++) {
      Sequence* seq = seqs[i];
      block_manager.hash_blocks(*seq);
      seq->num_cached_tokens += seq->num_scheduled_tokens;
      seq->num_scheduled_tokens = 0;
      if (is_prefill && seq->num_cached_tokens < seq->num_tokens) continue;  // mid-prompt chunk: no token yet
      int token = token_ids[i];
      seq->append_token(token);
      bool stop = !seq->params.ignore_eos && is_eos(token);
      if (stop || seq->num_completion_tokens() == seq->params.max_tokens) {
        seq->finish_reason = stop ? "stop" : "length";
        seq->status = SequenceStatus::FINISHED;
        block_manager.deallocate(*seq);
        running.erase(std::find(running.begin(), running.end(), seq));
      }
    }
  }
};

// ==== 11. ModelRunner: step inputs, CUDA graphs, sampling =============================================

// ==== 12. LLMEngine: add_request, step, generate ======================================================

// ==== 13. Prompts in, completions out =================================================================

// ==== 14. Command line and main =======================================================================

#ifndef NANOVLLM_TESTING
int main(int argc, char** argv) {
  (void)argc;
  (void)argv;
  return 0;
}
#endif
