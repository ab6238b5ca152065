// nanovllm.cu — a vLLM-style inference engine for the Qwen3 family, in one CUDA C++ file.
//
// What this is
//   An offline batch inference engine: give it a Hugging Face Qwen3 checkpoint folder and a file of prompts,
//   it generates completions with continuous batching, a paged KV cache with prefix caching, chunked
//   prefill, recompute preemption, CUDA-graph decode and tensor parallelism. It runs the dense Qwen3 models
//   and the mixture-of-experts ones (Qwen3-30B-A3B), whose experts run as grouped products on tensor cores. It
//   mirrors nano-vllm (github.com/GeeeekExplorer/nano-vllm, commit bb823b3) name for name, so the two can be
//   read side by side, and replaces its PyTorch, flash-attn and Triton with hand-written kernels and cuBLASLt.
//
// Build, run, test
//   make                                   builds ./nanovllm (prints what it found and what is missing)
//   ./nanovllm MODEL_DIR prompts.txt       generates; ./nanovllm --help lists every flag
//   ./nanovllm MODEL_DIR prompts.txt --plain    the same with Part I alone (no optimization of Part II)
//   make test                              host tests everywhere, GPU tests where a GPU is visible
//
// How to read it
//   Part I (sections 1-13) is the whole engine, plainly: the host bookkeeping first (config, Sequence,
//   BlockManager, Scheduler: what a reader came for, and none of it needs the GPU), then the model, its
//   kernels (the simplest correct ones, each after the CPU code it must agree with), cuBLASLt (and, in 10b,
//   the mixture-of-experts layer of Qwen3-MoE), the ModelRunner with CUDA graphs, tensor parallelism and the
//   LLMEngine loop. It is complete and correct on its own, and names nothing defined after it: `--plain` runs
//   it alone, and a build with Part II cut out (test/cli/part2_cut.sh) compiles and runs.
//   Part II (sections 14-36) makes it fast. Section 14 cuts the forward pass into stages; each chapter after
//   it is one optimization that says what it replaces and why it is faster on the hardware, and installs
//   itself through the hook table Part I declares (section 11) or section 14's stages; each registers its
//   own switch (--opt NAME, section 2; sections 31-32, the FP8 KV cache, register a value of --kv-cache-dtype
//   instead, since it trades accuracy, and 32a, which orders an fp8 decode step's rows, the switch
//   longest_first). The last four serve a mixture-of-experts layer: its experts on tensor cores (33,
//   fused_moe), a small step's as a gemv per routed expert (34, moe_gemv), an FP8 checkpoint's experts in FP8
//   (35, fp8_moe), and a decode step's MoE layers inside the persistent kernel (36, persistent_moe).
//   docs/performance.md has the measured gain of each. The Part I code each one replaces stays, as the
//   reference the GPU tests compare it with.
//   Part III (sections 37-51) is the program around the engine: reading config.json and the flags, prompts
//   in and completions out, shards, the trace, summary and report, signals, the worker processes and the
//   data-parallel replicas, `simulate` (the engine without a GPU), the command line and main.
//
// Dimension names used in every shape comment
//   T  tokens in this step (all sequences, flattened)      B  sequences in this step
//   H  hidden size                                         I  MLP intermediate size
//   NH query heads      NKV key/value heads (GQA)          D  head dim (128 for every Qwen3)
//   V  vocabulary size  L  layers                          P  KV block size in tokens (kvcache_block_size)
//   NB number of KV blocks in the pool                     MB max blocks per sequence (block table width)
//   tp tensor-parallel ranks: a rank holds NH/tp query heads, NKV/tp KV heads, I/tp columns, V/tp rows
//   A mixture-of-experts layer (Qwen3-MoE, section 10b): E experts, k of them per token, IE an expert's
//   intermediate size (a rank holds IE/tp of every expert's columns)
//
// Invariants a reader must hold
//   * The host owns all bookkeeping (Sequence, BlockManager, Scheduler); the GPU only sees flat int arrays
//     (input_ids, positions, slot_mapping, block_tables, ...) built once per step by ModelRunner.
//   * A step is a prefill step or a decode step. Under nano-vllm's scheduler (section 5) it holds prompt
//     tokens only or one token per running sequence; under vLLM V1's (5b, the command line's default) a
//     prefill step may also carry the running sequences' next tokens. Prefill writes K/V to the cache first
//     and then attends over the cache, so prefix-cache hits and chunked prefill need no special kernel.
//   * A KV slot is block_id * P + offset; slot -1 means "padding, do not store".
//   * Activations are bf16, every reduction (norms, softmax, matmul accumulation) is fp32.
//
// Glossary (the engine's words first, then the GPU's)
//   prefill / decode  a step that computes the K/V of prompt tokens (many per sequence; under vLLM V1's
//                     scheduler, decode rows too) / one new token for each running sequence
//   KV cache, block   the keys and values of every token computed so far, in a pool of fixed-size blocks of
//                     P tokens. "Block" alone always means such a KV block; the CUDA one is a thread block.
//   block table       a sequence's list of KV block ids: logical block i of the sequence -> physical block
//   paged attention   attention that finds each key through the block table instead of a contiguous array
//   prefix caching    reusing the KV blocks of an identical earlier prompt prefix, found by a hash
//   continuous batching  sequences join and leave the batch at every step, not once per batch
//   chunked prefill   a long prompt's prefill split over several steps to stay within the token budget
//   preemption        taking a running sequence's blocks away when the pool is full; it is recomputed later
//   GQA               grouped-query attention: NH/NKV query heads share one K/V head (a "group")
//   MoE, expert, router  a mixture of experts: a layer whose MLP is one of E small MLPs ("experts") per
//                     token, k of them, chosen by a router (a small matrix product and a softmax; section 10b)
//   RoPE              rotary position embedding: q and k rotated by angles that grow with the position
//   SM                streaming multiprocessor, one of the GPU's cores (132 on an H100); it runs thread blocks
//   warp              32 threads that execute together; shuffles exchange registers within a warp
//   thread block, CTA a group of up to 1024 threads on one SM sharing its shared memory ("cooperative thread
//                     array", CUDA's name for it); a kernel launch is a grid of them
//   cluster           (Hopper) up to 16 thread blocks on neighbouring SMs that can read each other's shared
//                     memory ("distributed shared memory")
//   shared memory     fast on-chip memory of one SM, private to a thread block; L2 is the cache all SMs share
//   tensor core, MMA  the unit that multiplies small matrix tiles in one instruction (section 15)
//   gemv              a matrix-vector product: a matrix product whose batch is 1 or 2 rows
//   split-K           splitting a long reduction (here: over keys) among thread blocks, then merging their
//                     partial results
//   online softmax    softmax computed in one pass over tiles: a running max and sum, earlier partial sums
//                     rescaled when the max grows (flash attention)
//   epilogue          what a kernel does with its result on the way out (scale, add, round, store)
//   CUDA graph        a recorded sequence of kernel launches replayed with one call, without the per-launch
//                     CPU cost
//   PDL               programmatic dependent launch (Hopper): the next kernel starts while the previous one
//                     finishes, and waits inside itself for its data (section 17)
//   all-reduce        every rank ends with the sum of every rank's array (tensor parallelism)
//   NCCL              NVIDIA's library of collectives (all-reduce, send/receive) between GPUs
//   NVLink            the direct GPU-to-GPU link; GPUs on it can read and write each other's memory
//   one-shot all-reduce  each rank writes its partial sums straight into every other rank's memory and adds
//                     what arrives: one crossing of NVLink instead of NCCL's ring (section 20)
//   two-shot all-reduce  each rank sums one slice of the message (scatter), then sends its sum to every
//                     other rank (gather): two crossings, for large messages (section 20b)
//   roofline          the fastest a step can run given the bytes it must read and the memory bandwidth
//
// Contents (each section starts with a banner "// ==== N. Title": grep for it)
//   PART I — THE ENGINE, PLAINLY
//    1. Errors and utilities
//    2. Config: the model, the engine's settings, sampling parameters, the optimization switch
//    3. Sequence
//    4. BlockManager: paged KV blocks and prefix caching
//    5. Scheduler: continuous batching, chunked prefill, preemption
//    6. The Qwen3 model: weights, the KV cache, the forward pass
//    7. Kernels: embedding, RMSNorm, q/k-norm + RoPE + KV store, SiLU
//    8. Paged attention: prefill and decode
//    9. Sampler: greedy, temperature, top-k, min-p, top-p
//   10. Matrix products with cuBLASLt
//   11. ModelRunner: step inputs, CUDA graphs
//   12. Tensor parallelism: sharded weights, NCCL all-reduce
//   13. LLMEngine: add_request, step, generate
//   PART II — MAKING IT FAST
//   14. The forward pass, in stages a chapter can replace
//   15. Flash attention on tensor cores: the tiles and the prefill kernel
//   16. Flash decode: split-K over the context, then a merge
//   17. Small-batch gemv, 1: programmatic dependent launch
//   18. Small-batch gemv, 2: the gemv with its neighbours fused in
//   19. Decode attention in one kernel: the split-K merge in a cluster, q/k-norm, RoPE, the KV store
//   20. All-reduce over NVLink: one-shot, and two-shot for large messages
//   21. The fast sampler, 1: the cut by bisection
//   22. The fast sampler, 2: radix select, rows split over thread blocks
//   23. Prefill and mixed steps in CUDA graphs, in pieces
//   24. One persistent kernel for a small-batch decode step, 1: the operation chain
//   25. The persistent kernel, 2: attention inside it
//   26. The persistent kernel, 3: the kernel, its plan and its launch
//   27. The persistent kernel, 4: which steps take it, measured at start-up and remembered
//   28. FP8 weights, 1: the format on the GPU, loading it, quantizing a bf16 checkpoint
//   29. FP8 weights, 2: the activations' quantizer and cuBLASLt's block-scaled products
//   30. FP8 weights, 3: small steps on the FP8 tensor cores, the persistent kernel, the stages
//   31. An FP8 KV cache, 1: the format, its scales, the store and prefill's tiles
//   32. The FP8 KV cache, 2: decode attention over it, the persistent kernel, the stages
//   33. A mixture of experts on tensor cores
//   34. A mixture of experts, 2: small steps, a gemv per routed expert
//   35. A mixture of experts, 3: FP8 experts
//   36. A mixture of experts, 4: a decode step's MoE layers inside the persistent kernel
//   PART III — THE PROGRAM AROUND IT
//   37. Reading the configuration: config.json, flags and sampling fields
//   38. Prompts in: the formats and the sampling fields
//   39. Reading the prompts file: text, .jsonl and OpenAI batch lines
//   40. Completions out: stdout, the --output lines, a batch's answers
//   41. Shards: a part of the input per machine, and the merge
//   42. Watching the run: the progress line and the trace
//   43. The run summary: its figures, two fingerprints and the summary record
//   44. The report: the whole run in one HTML page
//   45. Signals and the tensor-parallel workers
//   46. Data parallelism, 1: N replicas of the engine, one queue
//   47. Data parallelism, 2: the coordinator
//   48. simulate: the engine without a GPU
//   49. The command line: flags and --help
//   50. A run's start and end: the GPUs, the start-up line, the closing lines
//   51. The commands and main

#include <algorithm>
#include <cerrno>
#include <climits>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <csignal>
#include <fcntl.h>
#include <poll.h>
#include <strings.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <nccl.h>

#define XXH_INLINE_ALL
#include <xxhash.h>               // defines: XXH64 (block hashes, section 4)
#include <nlohmann/json.hpp>      // defines: nlohmann::json (config, checkpoints, prompts)

#include "safetensors.h"          // defines: SafeTensors, TensorView, DType (the checkpoint reader)
#include "tokenizer.h"            // defines: Tokenizer (Qwen2/Qwen3 byte-level BPE and the chat template)

using json = nlohmann::json;
typedef __nv_bfloat16 bf16;

// ##########################################################################################################
// PART I — THE ENGINE, PLAINLY
// ##########################################################################################################

// ==== 1. Errors and utilities ==============================================================================
// defines: die, INTERNAL_CHECK, CUDA_CHECK, CUBLAS_CHECK, NCCL_CHECK, g_tp_rank, g_process_label,
//          now_seconds, cdiv, read_file, is_dir, is_file, splitmix64, bf16_bits_to_float, float_to_bf16_bits,
//          bf16_round, half_bits_to_float
//
// Two kinds of failure, treated differently:
//   * a user mistake (bad flag, bad file, too-long prompt): die() with what was expected, what was found
//     and what to do, exit code 1, no stack of asserts;
//   * a broken invariant of our own (a launcher's preconditions included): INTERNAL_CHECK prints "internal
//     error", the condition, file and line; a failed CUDA, cuBLASLt or NCCL call: CUDA_CHECK, CUBLAS_CHECK,
//     NCCL_CHECK print the call, file, line and the library's message. Both exit 1.

// This process's tensor-parallel rank (section 12): 0 in the main process, 1..N-1 in the workers.
static int g_tp_rank = 0;
// The name this process's messages carry: "" in the main process, "rank 1" in a tensor-parallel worker
// (section 12), "replica 2" or "replica 2, rank 1" with data parallelism (section 46).
static char g_process_label[48] = "";

// A worker's message: named by its label, and written with one write(2) so that two processes failing at
// once cannot interleave their lines.
[[noreturn]] static void die_on_worker(const char* fmt, ...) {
  char msg[4096];
  int n = snprintf(msg, sizeof msg, "[%s] nanovllm: error: ", g_process_label);
  va_list ap;
  va_start(ap, fmt);
  n += vsnprintf(msg + n, sizeof msg - n - 1, fmt, ap);
  va_end(ap);
  n = std::min<int>(n, sizeof msg - 2);
  msg[n++] = '\n';
  ssize_t w = write(2, msg, n);
  (void)w;
  exit(1);
}

// die() is tokenizer.h's tok_die(): that header is included first and needed the same function, so the
// engine forwards to it rather than keep a second copy. A worker process (sections 12, 47) names itself.
template <typename... Args>
[[noreturn]] static void die(const char* fmt, Args... args) {
  if (g_process_label[0]) die_on_worker(fmt, args...);
  tok_die(fmt, args...);
}

// A broken invariant of our own, a launcher's preconditions included: never something a user can fix, so
// the message says "internal error", the condition that failed, where, and what was found.
#define INTERNAL_CHECK(cond, ...)                                                                    \
  do {                                                                                               \
    if (!(cond)) internal_error(#cond, __FILE__, __LINE__, __VA_ARGS__);                             \
  } while (0)
[[noreturn]] static void internal_error(const char* cond, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));  // (the compiler checks every INTERNAL_CHECK's format and values)
[[noreturn]] static void internal_error(const char* cond, const char* file, int line, const char* fmt, ...) {
  char what[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  die("internal error: %s\n  check failed: %s\n  at %s:%d", what, cond, file, line);
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

#define NCCL_CHECK(call)                                                                             \
  do {                                                                                               \
    ncclResult_t nr_ = (call);                                                                       \
    if (nr_ != ncclSuccess)                                                                          \
      die("NCCL call failed: %s\n  at %s:%d\n  %s: %s", #call, __FILE__, __LINE__,                   \
          ncclGetErrorString(nr_), ncclGetLastError(nullptr));                                       \
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

static bool is_dir(const std::string& p) {
  struct stat sb;
  return stat(p.c_str(), &sb) == 0 && S_ISDIR(sb.st_mode);
}
static bool is_file(const std::string& p) {
  struct stat sb;
  return stat(p.c_str(), &sb) == 0 && S_ISREG(sb.st_mode);
}

// SplitMix64: a 64-bit mix that turns a counter into well-spread bits (per-request sampler seeds).
static uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// bf16 and fp16 values as bit patterns, on the host: the checkpoint's bytes and the CPU references' roundings.
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
// A float rounded to the nearest bf16 (ties to even), as PyTorch rounds: the same function on the host (CPU
// references) and on the GPU (kernels that round an intermediate the way Hugging Face stores it).
__host__ __device__ inline float bf16_round(float x) { return __bfloat162float(__float2bfloat16(x)); }
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

// ==== 2. Config: the model, the engine's settings, sampling parameters, the optimization switch ============
// defines: HEAD_DIM, ModelConfig, Optimization, register_optimization, OptimizationSet,
//          default_optimizations, KVCacheFormat, register_kv_cache_format, kv_cache_value_bytes, Config,
//          TPShard, tp_shard, SamplingParams, MAX_LOGPROBS, TokenLogprobs
//
// ModelConfig is what the checkpoint says (config.json, generation_config.json); Config is how the engine
// runs (nano-vllm: config.py Config, same field names and defaults); SamplingParams is per request
// (nano-vllm: sampling_params.py, grown to vLLM's: n, stop conditions, penalties, min_p, logprobs, a
// seed). The optimization registry, before Config, is how Part II's speed work plugs in and is switched.
// This section says what each setting means; reading and checking them (config.json, the flags, a request's
// fields) is Part III's job (section 37).

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
  // A checkpoint whose layers' linear weights are stored as 8-bit floats with one scale per 128 x 128 block
  // (config.json's quantization_config, which section 37 reads; section 6a says how Part I loads one):
  bool block_quantized = false;
  std::vector<std::string> not_quantized;  // its modules_to_not_convert: names of linears it keeps in bf16
  std::vector<int> eos_token_ids;   // generation_config.json eos_token_id (int or list), else config.json's
  json generation_config;           // generation_config.json (null without one): sampling defaults (section 38)
  // A mixture-of-experts model (Qwen3MoeForCausalLM; section 10b says how a MoE layer computes). 0 experts:
  // a dense Qwen3, every layer's MLP of intermediate_size.
  int num_experts = 0;              // E: the experts of a MoE layer
  int num_experts_per_tok = 0;      // k: how many of them each token is routed to
  int moe_intermediate_size = 0;    // IE: one expert's intermediate size
  bool norm_topk_prob = false;      // the k routing weights divided by their sum (the released models: true)
  int decoder_sparse_step = 1;      // every this many layers is a MoE layer ...
  std::vector<int> mlp_only_layers; // ... except these, which keep a dense MLP
  // transformers' rule (Qwen3MoeDecoderLayer): layer l's MLP is a mixture of experts when l is not in
  // mlp_only_layers and (l + 1) % decoder_sparse_step == 0; otherwise a dense MLP of intermediate_size.
  bool is_moe_layer(int l) const {
    return num_experts > 0 && (l + 1) % decoder_sparse_step == 0 &&
           std::find(mlp_only_layers.begin(), mlp_only_layers.end(), l) == mlp_only_layers.end();
  }
  int num_moe_layers() const {
    int n = 0;
    for (int l = 0; l < num_hidden_layers; l++) n += is_moe_layer(l);
    return n;
  }
};

// The optimization switch. Part II makes the engine fast one optimization at a time. Part I knows none of
// them by name: each Part II section registers itself here at start-up (register_optimization: its --opt
// name, one line for --help, whether it is on by default, and `apply`, which turns it on or off and fills
// the hook entries of section 11 it replaces). So a reader can run the plain engine (--plain, or --opt
// none) and climb back one step at a time (--opt none,NAME), every optimization can be checked against the
// code it replaces, and a build with Part II cut out has an empty registry and runs Part I alone. `step_costs`
// is for a model of the engine that runs no GPU (section 48's simulate, which prices each step): what the
// optimization changes in how a step runs, as named numbers; section 48 lists the names it reads.
struct Hooks;  // section 11
struct Qwen3;  // section 6c
struct Optimization {
  const char* name;                   // what --opt calls it
  const char* what;                   // one line for --help and the start-up line
  bool on_by_default;
  void (*apply)(bool on, Hooks& h);   // switch it on or off; when on, fill the hooks it replaces
  std::string (*note)(const Qwen3& model) = nullptr;  // what the start-up line adds about it ("": nothing)
  std::vector<std::pair<std::string, double>> step_costs = {};  // (name, value); none: Part I's steps
  // The --quantization method it provides (vLLM's flag: a bf16 checkpoint's linear weights quantized at
  // load), or nullptr. Part I has none: the flag names a chapter, and needs it switched on.
  const char* quantization = nullptr;
};
static std::vector<Optimization>& optimization_registry() {
  static std::vector<Optimization> registry;  // in the order the sections come in the file
  return registry;
}
static int register_optimization(const Optimization& o) {
  optimization_registry().push_back(o);
  return (int)optimization_registry().size() - 1;
}

// Which registered optimizations a run switches on: on[i] for registry entry i.
struct OptimizationSet {
  std::vector<bool> on;
  bool operator==(const OptimizationSet& o) const { return on == o.on; }
};
static OptimizationSet default_optimizations() {
  OptimizationSet s;
  for (const Optimization& o : optimization_registry()) s.on.push_back(o.on_by_default);
  return s;
}

// What the KV cache stores (--kv-cache-dtype, vLLM's flag). Part I's cache holds bf16, as the model computes
// keys and values. A Part II section may register another format with fewer bytes per value (more tokens
// in the pool, fewer bytes for attention to read); `refused` names spellings it knows and does not take,
// with the reason. Like an optimization, a format has an `apply`, run for every engine (after the
// optimizations' apply: install_optimizations, section 11): on for the engine's format, off for the others;
// it resets what the format keeps per engine and, when on, fills the hook entries it replaces.
struct KVCacheFormat {
  const char* name;                  // the canonical name, as the summary prints it
  std::vector<std::string> aliases;  // other spellings the flag accepts
  int value_bytes;                   // bytes per stored key or value element
  std::vector<std::pair<std::string, std::string>> refused;  // (spelling, why not)
  void (*use)(Qwen3& model) = nullptr;  // before the pool is sized: check the GPU, prepare (scales); may die()
  void (*apply)(bool on, Hooks& h) = nullptr;  // on or off for an engine; when on, fill the hooks it replaces
};
static std::vector<KVCacheFormat>& kv_cache_formats() {
  static std::vector<KVCacheFormat> formats = {{"bf16", {"auto", "bfloat16"}, 2, {}}};  // Part I's
  return formats;
}
static int register_kv_cache_format(const KVCacheFormat& f) {
  kv_cache_formats().push_back(f);
  return (int)kv_cache_formats().size() - 1;
}
// Bytes per stored value of the format `name` (a name parse_kv_cache_dtype returned).
static int kv_cache_value_bytes(const std::string& name) {
  for (const KVCacheFormat& f : kv_cache_formats())
    if (name == f.name) return f.value_bytes;
  return 2;
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
  OptimizationSet opt = default_optimizations();  // which Part II optimizations run (--plain, --opt)
  bool mixed_scheduler = false;        // vLLM V1's scheduler (section 5b), not nano-vllm's: a step may mix
                                       // decode rows and prompt chunks. The command line's default (Part
                                       // III); a Config built in code gets nano-vllm's, as Part I tells it
  std::string kv_cache_dtype = "bf16"; // --kv-cache-dtype: a KVCacheFormat's name (Part I: bf16)
  std::string quantization;            // --quantization: "" (the checkpoint's own format), or the method of
                                       // an Optimization that provides one (its `quantization`)
};

// ---- Tensor-parallel sharding arithmetic (used by load_weights, section 37's validate_config, the tests) ----
// Which sizes N can split a model, and what rank r of N holds (nano-vllm: the tp_size divisions in
// layers/linear.py and layers/embed_head.py). Heads are never split: a rank owns whole query heads and
// whole KV heads, so attention needs no communication; the MLP is split by intermediate columns, and so is
// every expert of a MoE layer (as vLLM's FusedMoE splits them; the router is replicated); the vocabulary by
// rows, rounded up so every rank's slice has the same shape (the last one is zero-padded).
struct TPShard {
  int64_t q_heads, q_head0;     // NH/N query heads, starting at head q_head0
  int64_t kv_heads, kv_head0;   // NKV/N KV heads (this rank's share of the KV cache too)
  int64_t inter, inter0;        // I/N columns of gate/up (rows of down's input), starting at inter0
  int64_t moe_inter, moe_inter0;  // IE/N columns of every expert's gate/up (the router is whole on each rank)
  int64_t vocab, vocab0;        // V_local = ceil(V/N) rows of embed_tokens / lm_head, vocab ids vocab0..
  int64_t vocab_rows;           // of which real rows (the rest are zeros): min(V_local, V - vocab0), >= 0
};

// Why N cannot split this model, or "" when it can. The messages name the flag and the numbers.
static std::string tp_shard_problem(const ModelConfig& m, int n) {
  char buf[256];
  if (n < 1 || n > 8)
    snprintf(buf, sizeof buf, "--tensor-parallel-size must be between 1 and 8, found %d", n);
  else if (m.num_attention_heads % n || m.num_key_value_heads % n)
    snprintf(buf, sizeof buf,
             "--tensor-parallel-size %d must divide the number of query heads (%d) and of KV heads (%d)", n,
             m.num_attention_heads, m.num_key_value_heads);
  else if (m.num_moe_layers() < m.num_hidden_layers && (m.intermediate_size % n || (m.intermediate_size / n) % 8))
    snprintf(buf, sizeof buf, "--tensor-parallel-size %d must divide intermediate_size (%d) into slices that "
             "are multiples of 8", n, m.intermediate_size);
  else if (m.num_experts > 0 && (m.moe_intermediate_size % n || (m.moe_intermediate_size / n) % 8))
    snprintf(buf, sizeof buf, "--tensor-parallel-size %d must divide moe_intermediate_size (%d) into slices "
             "that are multiples of 8", n, m.moe_intermediate_size);
  else return "";
  return buf;
}

static TPShard tp_shard(const ModelConfig& m, int rank, int n) {
  TPShard s;
  s.q_heads = m.num_attention_heads / n, s.q_head0 = rank * s.q_heads;
  s.kv_heads = m.num_key_value_heads / n, s.kv_head0 = rank * s.kv_heads;
  s.inter = m.intermediate_size / n, s.inter0 = rank * s.inter;
  s.moe_inter = m.moe_intermediate_size / n, s.moe_inter0 = rank * s.moe_inter;
  s.vocab = cdiv(m.vocab_size, n), s.vocab0 = rank * s.vocab;
  s.vocab_rows = std::max<int64_t>(0, std::min<int64_t>(s.vocab, m.vocab_size - s.vocab0));
  return s;
}

// One request's sampling settings (nano-vllm: SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=False),
// grown to vLLM's SamplingParams: the same field names, meanings and ranges). The defaults below are the
// built-in ones; the model's generation_config.json may replace some (section 38, --generation-config).
constexpr int MAX_LOGPROBS = 20;  // vLLM's default max_logprobs: alternatives a request may ask for per token

struct SamplingParams {
  int n = 1;                 // completions of the prompt: n sequences, each with its own draws (section 13)
  float temperature = 1.0f;  // 0 = greedy (nano-vllm forbids 0; we allow it)
  int top_k = -1;            // keep the k most likely tokens; -1 (or 0) = off
  float top_p = 1.0f;        // keep the smallest set whose probability reaches top_p; 1 = off
  float min_p = 0.0f;        // drop tokens less likely than min_p times the most likely one; 0 = off
  // Penalties (section 9b), applied to the logits before the sampler, in vLLM's order:
  float repetition_penalty = 1.0f;  // tokens of the prompt or the output: logit / r if > 0, else logit * r
  float frequency_penalty = 0.0f;   // minus f * (times the token is in the output so far)
  float presence_penalty = 0.0f;    // minus p if the token is in the output so far
  int max_tokens = 64;
  int min_tokens = 0;        // EOS and stop_token_ids cannot be sampled, and stop strings do not count, until
                             // this many tokens are out
  bool ignore_eos = false;
  std::vector<std::string> stop;    // finish when the output text contains one; the text ends before it
  std::vector<int> stop_token_ids;  // finish when one is sampled (as EOS does, even with ignore_eos)
  bool include_stop_str_in_output = false;  // keep the matched stop string (or stop token's text) in the text
  int logprobs = -1;         // -1 = none; N in 0..MAX_LOGPROBS: per output token, the sampled token's
                             // log-probability and the N most likely tokens' (section 9b)
  int64_t seed = -1;         // -1 = derived from the engine's --seed and the request's place in the input
                             // (Sequence::sampling_seed)

  bool penalized() const {
    return repetition_penalty != 1.0f || frequency_penalty != 0.0f || presence_penalty != 0.0f;
  }
};

// One output token's log-probabilities, from the model's raw logits (section 9b): what a request with
// logprobs = N gets back per token.
struct TokenLogprobs {
  float logprob;                      // of the sampled token: logit - logsumexp(logits)
  int rank;                           // 1 + the number of tokens with a larger logit
  int num_top;                        // N
  int top_ids[MAX_LOGPROBS];          // the N most likely tokens, most likely first (ties: lowest id)
  float top_logprobs[MAX_LOGPROBS];
};

// ==== 3. Sequence ==========================================================================================
// defines: SequenceStatus, Sequence
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
  const char* finish_reason = nullptr;  // "stop" (EOS, a stop token or a stop string) or "length" (max_tokens)
  int stop_token_id = -1;               // the stop_token_ids entry that finished it (vLLM's stop_reason)
  std::string stop_string;              // the stop string that finished it (vLLM's stop_reason)
  // Its request's place in the whole input (section 13), and with n > 1, which of the request's completions
  // this is, and the first one, whose prompt blocks the others wait for so that prefix caching shares them
  // (Scheduler::waits_for_sibling).
  int request_index = 0, completion_index = 0;
  const Sequence* first_sibling = nullptr;
  // What the engine keeps of the output besides token ids (section 13): the text (decoded as it grows when
  // the request has stop strings, else once at the end), and with logprobs, one TokenLogprobs per token.
  std::string text;
  Utf8Repair text_repair;               // holds a character's bytes back until its last byte is decoded
  std::vector<TokenLogprobs> logprobs;
  double cumulative_logprob = 0;
  // With a penalty (section 9b): every distinct token of the prompt and the output with the number of times
  // the output holds it, prompt tokens first (the first num_prompt_distinct entries). append_token keeps it.
  std::vector<std::pair<int, int>> token_counts;
  std::unordered_map<int, int> token_count_at;  // token -> its index in token_counts
  int num_prompt_distinct = 0;
  // When it happened, in seconds since generate() began (LLMEngine's clock; -1 = not yet): for the time to
  // first token and the time per output token of the summary and the report.
  double arrival_time = 0, first_scheduled_time = -1, first_token_time = -1, finish_time = -1;

  Sequence(int64_t id, std::vector<int> prompt, SamplingParams sp, int block_size_)
      : seq_id(id), token_ids(std::move(prompt)), block_size(block_size_), params(sp) {
    last_token = token_ids.back();
    num_tokens = (int)token_ids.size();
    num_prompt_tokens = num_tokens;
    if (params.penalized()) {
      for (int t : token_ids) count_token(t, 0);
      num_prompt_distinct = (int)token_counts.size();
    }
  }
  void count_token(int t, int add) {
    auto it = token_count_at.find(t);
    if (it != token_count_at.end()) token_counts[it->second].second += add;
    else token_count_at[t] = (int)token_counts.size(), token_counts.push_back({t, add});
  }
  int size() const { return num_tokens; }  // nano-vllm: __len__
  bool is_finished() const { return status == SequenceStatus::FINISHED; }
  int num_completion_tokens() const { return num_tokens - num_prompt_tokens; }
  int num_cached_blocks() const { return num_cached_tokens / block_size; }
  int num_blocks() const { return (int)cdiv(num_tokens, block_size); }
  // The key of this sequence's draws (section 9): its request's seed (child k of a seeded request with
  // n > 1 has seed + k, section 13), or for a request without one, a seed made from the engine's --seed and
  // the request's place in the whole input, never from anything the engine counts. So a request draws the
  // same tokens in any batch, and whichever data-parallel replica (section 46) or shard (section 41) runs it.
  uint64_t sampling_seed(uint64_t engine_seed) const {
    if (params.seed >= 0) return (uint64_t)params.seed;
    return splitmix64(engine_seed ^ splitmix64((uint64_t)request_index)) + (uint64_t)completion_index;
  }
  int last_block_num_tokens() const { return num_tokens - (num_blocks() - 1) * block_size; }
  // Tokens of logical block i (the last one may be partial).
  const int* block(int i) const { return token_ids.data() + (size_t)i * block_size; }
  int block_len(int i) const { return std::min(block_size, num_tokens - i * block_size); }
  void append_token(int token_id) {
    token_ids.push_back(token_id);
    last_token = token_id;
    num_tokens++;
    if (params.penalized()) count_token(token_id, 1);
  }
};

// ==== 4. BlockManager: paged KV blocks and prefix caching ==================================================
// defines: Block, compute_block_hash, BlockManager
//
// The KV cache is a pool of NB blocks of P token slots each (its GPU layout: section 6b). A sequence owns a block table, a
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
    INTERNAL_CHECK(ok, "BlockManager: %s", what);
  }
};

// ==== 5. Scheduler: continuous batching, chunked prefill, preemption =======================================
// defines: SchedulerStats, Scheduler (schedule, schedule_mixed, preempt, postprocess)
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
// finished sequences, whose blocks go back to the pool at once: that is continuous batching. (5b, after the
// struct, is vLLM V1's policy, which mixes the two in one step, for contrast: --scheduler mixed.)

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
  bool mixed = false;                                   // vLLM V1's policy instead (section 5b)

  Scheduler(const Config& c)
      : max_num_seqs(c.max_num_seqs), max_num_batched_tokens(c.max_num_batched_tokens),
        block_size(c.kvcache_block_size), eos(c.eos), block_manager(c.num_kvcache_blocks, c.kvcache_block_size),
        mixed(c.mixed_scheduler) {}

  bool is_finished() const { return waiting.empty() && running.empty(); }
  void add(Sequence* seq) { waiting.push_back(seq); }

  // Returns the sequences of this step; sets is_prefill.
  std::vector<Sequence*> schedule(bool& is_prefill) {
    if (mixed) return schedule_mixed(is_prefill);  // section 5b
    std::vector<Sequence*> scheduled;
    begin_step();
    int num_batched_tokens = 0;
    // prefill
    while (!waiting.empty() && (int)scheduled.size() < max_num_seqs) {
      Sequence* seq = waiting.front();
      int remaining = max_num_batched_tokens - num_batched_tokens;
      if (remaining == 0 || waits_for_sibling(*seq)) break;
      int num_tokens, num_cached_blocks = 0;
      if (seq->block_table.empty()) {
        num_cached_blocks = block_manager.can_allocate(*seq);
        if (num_cached_blocks == -1) break;
        num_tokens = seq->num_tokens - num_cached_blocks * block_size;
      } else {
        num_tokens = seq->num_tokens - seq->num_cached_tokens;  // the rest of a chunked prompt
      }
      if (remaining < num_tokens && !scheduled.empty()) break;  // only the first sequence may be chunked
      if (seq->block_table.empty()) admit(seq, num_cached_blocks);
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
    if (scheduled.empty()) no_room();
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

  // What both schedulers do: forget the last step's notes; admit a waiting sequence (its blocks, the prefix
  // cache's hits among them); give up when nothing fits.
  void begin_step() {
    last_preempted.clear();
    last_cached_tokens = 0;
  }
  void admit(Sequence* seq, int num_cached_blocks) {
    block_manager.allocate(*seq, num_cached_blocks);
    stats.prefix_hit_tokens += seq->num_cached_tokens;
    stats.prompt_tokens_admitted += seq->num_tokens;
    last_cached_tokens += seq->num_cached_tokens;
  }
  [[noreturn]] void no_room() const {  // cannot happen when the pool holds one max_model_len sequence
    die("the KV cache cannot hold even one sequence: %d free blocks of %d tokens. Lower --max-model-len or "
        "raise --gpu-memory-utilization / --num-kvcache-blocks",
        block_manager.num_free_blocks(), block_size);
  }

  bool is_eos(int token) const { return std::find(eos.begin(), eos.end(), token) != eos.end(); }
  std::vector<Sequence*> schedule_mixed(bool& is_prefill);  // section 5b

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
      // vLLM's check_stop: EOS (unless ignore_eos), then a stop token id, then max_tokens. Neither of the first
      // two counts among the first min_tokens tokens (the sampler cannot pick them there: section 9b).
      const SamplingParams& p = seq->params;
      const bool may_stop = seq->num_completion_tokens() > p.min_tokens;
      const bool eos = may_stop && !p.ignore_eos && is_eos(token);
      const bool stop_id = may_stop && !eos &&
                           std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) != p.stop_token_ids.end();
      if (stop_id) seq->stop_token_id = token;
      if (eos || stop_id) finish(seq, "stop");
      else if (seq->num_completion_tokens() == p.max_tokens) finish(seq, "length");
    }
  }

  // A sequence is done: its blocks go back to the pool (their prefix stays cached) and it leaves `running`.
  // Also called by the engine when a stop string appears in the text (section 13).
  void finish(Sequence* seq, const char* reason) {
    seq->finish_reason = reason;
    seq->status = SequenceStatus::FINISHED;
    block_manager.deallocate(*seq);
    running.erase(std::find(running.begin(), running.end(), seq));
  }

  // n > 1: the request's later completions wait in the queue until the first one has its prompt in the
  // cache; then can_allocate finds the prompt's full blocks by their hashes and the siblings share them,
  // computing only the last, partial block. (Admitted in the same step they would each compute the whole
  // prompt: blocks are registered only once their K/V is written, in hash_blocks.)
  bool waits_for_sibling(const Sequence& seq) const {
    const Sequence* first = seq.first_sibling;
    if (!first || first->is_finished()) return false;
    const int shared_tokens = (first->num_prompt_tokens - 1) / block_size * block_size;  // can_allocate's blocks
    return first->num_cached_tokens < shared_tokens;
  }
};

// ---- 5b. vLLM V1's mixed scheduler, for contrast (--scheduler mixed) -----------------------------------
//
// nano-vllm's rule above makes every step all prefill or all decode, and prefill first: while prompts keep
// arriving, the running sequences wait, so each new request's first token comes quickly but the others'
// next tokens stall. vLLM V1 has no phases. Each sequence just has tokens it has not computed yet
// (num_tokens - num_cached_tokens: the rest of its prompt, or 1 when it is decoding), and a step hands out
// one token budget (max_num_batched_tokens):
//   1. running sequences first, oldest first: each gets all it needs (1 when decoding, the rest of its
//      prompt when it is still in prefill) or what is left of the budget. One that needs a new block when
//      none is free preempts the newest running sequence (possibly itself), as in nano-vllm;
//   2. then waiting sequences are admitted in order, with chunked prefill from the rest of the budget,
//      while max_num_seqs allows, but not in a step that preempted (vLLM V1's rule: the pool is short).
// A sequence joins `running` as soon as it is admitted, even mid-prompt. So a step can hold decode tokens
// and prompt chunks together, and it is a prefill step to the model: Part I's prefill attention kernel
// computes it (a decoding sequence is a query of length 1 over its cached keys). Because running sequences
// come first, the decoding ones lead the step, which is what lets Part II send them through its decode
// kernel instead (section 16) and replay the rest of the step from CUDA graphs (section 23, as vLLM does).
// postprocess() above needs no change: a sequence whose scheduled tokens reach its end gets a token.

// A sequence whose one remaining token is its last (it decodes, or its prompt's last token is left).
static bool has_one_token_left(const Sequence& seq) { return seq.num_cached_tokens + 1 == seq.num_tokens; }

std::vector<Sequence*> Scheduler::schedule_mixed(bool& is_prefill) {
  std::vector<Sequence*> scheduled;
  begin_step();
  is_prefill = false;  // true once a step holds a token that is not a decoding sequence's last
  int budget = max_num_batched_tokens;
  // 1. running sequences, oldest first
  for (size_t i = 0; i < running.size() && budget > 0;) {
    Sequence* seq = running[i];
    // Blocks its tokens lack: 1 when its last token opened a new block (admission allocated the prompt's)
    const int missing = seq->num_blocks() - (int)seq->block_table.size();
    bool preempted_itself = false;
    while (missing > block_manager.num_free_blocks()) {
      Sequence* victim = running.back();  // the newest; never one scheduled already (those are in front)
      running.pop_back();
      preempt(victim);
      if (victim == seq) {
        preempted_itself = true;
        break;
      }
    }
    if (preempted_itself) break;  // it was the newest left: nothing after it runs
    for (int k = 0; k < missing; k++) seq->block_table.push_back(block_manager.allocate_block());
    seq->num_scheduled_tokens = std::min(seq->num_tokens - seq->num_cached_tokens, budget);
    budget -= seq->num_scheduled_tokens;
    if (!has_one_token_left(*seq)) is_prefill = true;
    scheduled.push_back(seq);
    i++;
  }
  // 2. admissions from what is left (none after a preemption, unless nothing else runs)
  while ((last_preempted.empty() || scheduled.empty()) && !waiting.empty() && budget > 0 &&
         (int)running.size() < max_num_seqs) {
    Sequence* seq = waiting.front();
    if (waits_for_sibling(*seq)) break;
    int num_cached_blocks = block_manager.can_allocate(*seq);
    if (num_cached_blocks == -1) break;
    admit(seq, num_cached_blocks);
    seq->num_scheduled_tokens = std::min(seq->num_tokens - seq->num_cached_tokens, budget);
    budget -= seq->num_scheduled_tokens;
    if (!has_one_token_left(*seq)) is_prefill = true;
    seq->status = SequenceStatus::RUNNING;
    waiting.pop_front();
    running.push_back(seq);
    scheduled.push_back(seq);
  }
  if (scheduled.empty()) no_room();
  return scheduled;
}

// ==== 6. The Qwen3 model: weights, the KV cache, the forward pass ==========================================
// defines: LayerWeights, Weights, WeightLoader, Stored, TensorSpec, checkpoint_tensors,
//          load_weights, validate_checkpoint, KVLayer, KVCache, kv_block_bytes, Activations, StepInputs,
//          Qwen3 (forward)
//
// Everything the GPU holds for one model, and the one function that runs it: 6a loads the weights, 6b lays
// out the KV cache, 6c is the forward pass (nano-vllm: models/qwen3.py and layers/). The kernels it calls
// come next, in sections 7-10.

// ---- 6a. Weights: safetensors -> GPU, fused q/k/v and gate/up ------------------------------------------
//
// The checkpoint is read once, straight from the mmap()ed files into one GPU arena. Two fusions happen at
// load time (nano-vllm: packed_modules_mapping and the weight_loader of QKVParallelLinear /
// MergedColumnParallelLinear):
//   q_proj [NH*D, H] ; k_proj [NKV*D, H] ; v_proj [NKV*D, H]  ->  qkv_proj [(NH+2*NKV)*D, H]   one GEMM
//   gate_proj [I, H] ; up_proj [I, H]                          ->  gate_up  [2*I, H]            one GEMM
// so a layer runs 4 matrix products instead of 7. Every matrix stays in PyTorch's [out, in] row-major layout;
// section 10 explains how cuBLASLt reads it. Each expert of a MoE layer (section 10b) is fused the same way,
// and the experts of a layer lie one after another: gate_up [E, 2*IE, H], down [E, H, IE].
//
// Tensor parallelism slices while loading, so each rank reads only its share (section 12):
//   column-parallel (qkv, gate_up): each rank takes its rows: its q heads, its k/v heads, its I/tp slice
//   (and of every expert its IE/tp slice);
//   row-parallel (o_proj, down): each rank takes its columns; the partial products are summed by all-reduce;
//   replicated (the norms, a MoE layer's router): every rank holds the whole tensor;
//   vocab-parallel (embed_tokens, lm_head): each rank takes V/tp rows.
// fp16 and fp32 checkpoints are converted to bf16 on the way in, and 8-bit float ones dequantized (below).

struct LayerWeights {
  bf16* input_layernorm;           // [H]
  bf16* post_attention_layernorm;  // [H]
  bf16* qkv_proj;                  // [(NH+2*NKV)/tp * D, H]
  bf16* q_norm;                    // [D]
  bf16* k_norm;                    // [D]
  bf16* o_proj;                    // [H, NH/tp * D]
  bf16* gate_up_proj;              // [2 * I/tp, H]   gate rows first, then up rows   (null in a MoE layer)
  bf16* down_proj;                 // [H, I/tp]
  // A MoE layer's MLP instead (section 10b; null in a dense layer): the router and every expert, fused and
  // sliced as the dense MLP is.
  bf16* router;                    // [E, H]            the same on every rank
  bf16* experts_gate_up;           // [E, 2 * IE/tp, H] per expert its gate rows, then its up rows
  bf16* experts_down;              // [E, H, IE/tp]
};

struct Weights {
  bf16* embed_tokens;  // [V/tp, H]
  bf16* lm_head;       // [V/tp, H] (== embed_tokens when tie_word_embeddings)
  bf16* norm;          // [H]
  std::vector<LayerWeights> layers;
  void* arena = nullptr;
  size_t bytes = 0;
  std::string held = "bf16";  // how the linear weights are held, for the start-up line
};

// ---- Checkpoints with 8-bit float weights (a storage format, read on the host) ---------------------------
// defines: block_scales, dequantize_row
// (safetensors.h holds what the format itself fixes: the bytes' values and the dtypes its tensors may have.)
//
// Qwen publishes each dense Qwen3 also as an FP8 checkpoint (Qwen/Qwen3-8B-FP8 and its siblings): half the
// bytes. Its config.json says
//   "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
//                           "weight_block_size": [128, 128]}
// (section 37 checks it), and each linear projection X of a layer (q, k, v, o, gate, up, down) is stored as
//   X.weight            F8_E4M3        [out, in]                         one byte per weight
//   X.weight_scale_inv  BF16 or F32    [ceil(out/128), ceil(in/128)]     one multiplier per 128 x 128 block
// meaning W[r][c] = e4m3(X.weight[r][c]) * X.weight_scale_inv[r / 128][c / 128]. The quantizer took each
// block's largest |W|, amax, divided the block by amax / 448 (448 is e4m3's largest value), rounded to e4m3,
// and stored amax / 448. Where out or in is not a multiple of 128 the last row or column of blocks is
// partial. The embedding, the norms and lm_head stay bf16, and so does any linear that
// modules_to_not_convert names.
//
// e4m3 (PyTorch's float8_e4m3fn: safetensors.h defines it) has no infinities, and a quantizer clamps to
// +-448, so a NaN byte (0x7F, 0xFF) means a damaged file: the loader refuses it.
//
// Part I computes in bf16, so it reads such a checkpoint by dequantizing it while loading:
//   W = bf16(e4m3_value * scale)     the product in fp32, rounded once to bf16 (ties to even)
// as transformers' FineGrainedFP8Config(dequantize=True) computes it. The work is done by the CPU, in the
// loader, with a table of the 256 e4m3 values (safetensors.h decodes the dtype, as it reads every other one:
// e4m3_to_float, block_quantized_values): every weight passes through the CPU on its way to the
// staging buffers anyway, a lookup and a multiply per byte keep up with reading the file, and Part I keeps
// no FP8 kernel. After loading, the engine is the bf16 engine, with bf16's memory and speed. A Part II
// chapter (switch fp8_weights) keeps the weights in FP8 on the GPU and computes with them instead.

// A weight_scale_inv tensor's values as fp32, row-major [ceil(out/128), ceil(in/128)]. A NaN or infinite
// scale (which would make its whole block NaN) or a negative one is a damaged checkpoint: refused with the
// tensor's name and the block. validate_checkpoint calls this for every scale tensor before any GPU work.
static std::vector<float> block_scales(const TensorView& s) {
  std::vector<float> out(s.numel());
  const int64_t cols = s.shape.size() == 2 ? s.shape[1] : 1;
  for (size_t i = 0; i < out.size(); i++) {
    if (s.dtype == DType::BF16) {
      uint16_t b;
      memcpy(&b, (const uint8_t*)s.data + 2 * i, 2);
      out[i] = bf16_bits_to_float(b);
    } else {
      memcpy(&out[i], (const uint8_t*)s.data + 4 * i, 4);
    }
    if (!std::isfinite(out[i]) || out[i] < 0)
      die("tensor '%s' in %s holds %g for block [%lld, %lld] (rows %lld.., columns %lld..); the block scales "
          "of an 8-bit weight are finite numbers >= 0: the checkpoint is damaged", s.name.c_str(), s.file.c_str(),
          out[i], (long long)(i / cols), (long long)(i % cols), (long long)(i / cols * 128),
          (long long)(i % cols * 128));
  }
  return out;
}

// n weights of row r of an FP8 weight, from column c on, dequantized to bf16 bits: out[j] =
// bf16(e4m3(w[j]) * scale[r / 128][(c + j) / 128]). scale is the whole tensor's [ceil(out/128), scale_cols]:
// indexed by the global row and column, so a tensor-parallel slice that starts inside a block gets the
// scales its weights were quantized with. A NaN byte is refused, naming `t` (the weight) and where.
static void dequantize_row(uint16_t* out, const uint8_t* w, int64_t n, const float* scale, int64_t scale_cols,
                           int64_t r, int64_t c, const TensorView& t) {
  const size_t bad = block_quantized_first_nan(w, (size_t)n);
  if (bad < (size_t)n)
    die("tensor '%s' in %s holds a NaN byte (0x%02x) at [%lld, %lld]; a quantizer never writes one: the "
        "checkpoint is damaged", t.name.c_str(), t.file.c_str(), w[bad], (long long)r, (long long)(c + bad));
  const float* table = block_quantized_values();
  const float* srow = scale + r / 128 * scale_cols;
  for (int64_t j = 0; j < n; j++) out[j] = float_to_bf16_bits(table[w[j]] * srow[(c + j) / 128]);
}
// ---- The loader: staging buffers, the list of tensors, the checks ----------------------------------------
// Copies tensor slices into the GPU arena through two pinned staging buffers, so the CPU fills one while the
// GPU copy engine drains the other. A slice is rows [r0, r0+nr) and columns [c0, c0+nc) of a 2-D tensor
// (1-D tensors are one row).
struct WeightLoader {
  const SafeTensors& st;
  const ModelConfig& cfg;
  cudaStream_t stream;
  static constexpr size_t kStage = 64 << 20;
  uint8_t* stage[2] = {nullptr, nullptr};
  cudaEvent_t done[2];
  int cur = 0;
  size_t fill = 0;              // bytes in stage[cur]
  uint8_t* fill_dst = nullptr;  // the GPU address stage[cur]'s contents go to (contiguous)
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
  // Room in the staging buffer for up to `want` bytes bound for GPU address `dst`, in whole units of `unit`
  // bytes (the element size). What is staged goes first unless `dst` continues it. Returns where to write
  // and sets *got (at least one unit).
  uint8_t* stage_for(void* dst, size_t want, size_t unit, size_t* got) {
    if (fill + unit > kStage || fill % unit || (fill && fill_dst + fill != (uint8_t*)dst)) flush();
    if (!fill) fill_dst = (uint8_t*)dst;
    *got = std::min(want, (kStage - fill) / unit * unit);
    uint8_t* p = stage[cur] + fill;
    fill += *got;
    return p;
  }
  // Append rows [r0, r0+nr) x cols [c0, c0+nc) of `t` (converted to bf16) at `dst`, contiguously. A weight
  // stored in 8-bit floats comes with `scales` (block_scales, above) and is dequantized on the way.
  void load(bf16* dst, const TensorView& t, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
            const std::vector<float>* scales = nullptr) {
    const int64_t cols = t.shape.size() == 2 ? t.shape[1] : t.numel();
    const int esize = dtype_size(t.dtype);
    const uint8_t* base = (const uint8_t*)t.data;
    for (int64_t r = r0; r < r0 + nr; r++) {
      int64_t c = c0;
      while (c < c0 + nc) {
        size_t got;
        uint16_t* out = (uint16_t*)stage_for(dst, (c0 + nc - c) * 2, 2, &got);
        const int64_t n = got / 2;
        const uint8_t* src = base + (r * cols + c) * esize;
        if (scales) {
          dequantize_row(out, src, n, scales->data(), cdiv(cols, 128), r, c, t);
        } else if (t.dtype == DType::BF16) {
          memcpy(out, src, n * 2);
        } else if (t.dtype == DType::F16) {
          for (int64_t i = 0; i < n; i++) out[i] = float_to_bf16_bits(half_bits_to_float(((const uint16_t*)src)[i]));
        } else {
          for (int64_t i = 0; i < n; i++) out[i] = float_to_bf16_bits(((const float*)src)[i]);
        }
        dst += n;
        c += n;
        bytes_read += n * esize;
      }
    }
  }
};

// Every tensor the config needs, with its full (unsliced) shape: the one list that both the check before
// any GPU work (validate_checkpoint) and load_weights go by. A block-quantized checkpoint's linear weights
// are `quantized`, each followed by its `scales` (NAME_scale_inv, one value per 128 x 128 block).
enum class Stored { plain, quantized, scales };
struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  Stored stored = Stored::plain;
};
// Whether a block-quantized checkpoint keeps linear `name` in bf16: modules_to_not_convert names it or a
// module around it, matched as transformers matches it (the entry is part of the tensor's name).
static bool kept_unquantized(const ModelConfig& c, const std::string& name) {
  for (const std::string& m : c.not_quantized)
    if (name.find(m) != std::string::npos) return true;
  return false;
}
// A MoE layer (section 10b) has, instead of mlp.{gate,up,down}_proj, the router mlp.gate.weight [E, H] and
// per expert e mlp.experts.e.{gate,up}_proj.weight [IE, H] and mlp.experts.e.down_proj.weight [H, IE], as
// Qwen's checkpoints store them. The router is never block-quantized (vLLM reads it unquantized too).
static std::vector<TensorSpec> checkpoint_tensors(const ModelConfig& c) {
  const int64_t H = c.hidden_size, I = c.intermediate_size, D = c.head_dim, V = c.vocab_size;
  const int64_t NH = c.num_attention_heads, NKV = c.num_key_value_heads, IE = c.moe_intermediate_size;
  std::vector<TensorSpec> specs = {{"model.embed_tokens.weight", {V, H}}, {"model.norm.weight", {H}}};
  if (!c.tie_word_embeddings) specs.push_back({"lm_head.weight", {V, H}});
  for (int l = 0; l < c.num_hidden_layers; l++) {
    std::string pre = "model.layers." + std::to_string(l) + ".";
    std::vector<TensorSpec> layer = {
        {"input_layernorm.weight", {H}},           {"post_attention_layernorm.weight", {H}},
        {"self_attn.q_proj.weight", {NH * D, H}},  {"self_attn.k_proj.weight", {NKV * D, H}},
        {"self_attn.v_proj.weight", {NKV * D, H}}, {"self_attn.q_norm.weight", {D}},
        {"self_attn.k_norm.weight", {D}},          {"self_attn.o_proj.weight", {H, NH * D}}};
    if (!c.is_moe_layer(l))
      layer.insert(layer.end(), {{"mlp.gate_proj.weight", {I, H}}, {"mlp.up_proj.weight", {I, H}},
                                 {"mlp.down_proj.weight", {H, I}}});
    else layer.push_back({"mlp.gate.weight", {c.num_experts, H}});
    for (int e = 0; c.is_moe_layer(l) && e < c.num_experts; e++) {
      const std::string ex = "mlp.experts." + std::to_string(e) + ".";
      layer.insert(layer.end(), {{ex + "gate_proj.weight", {IE, H}}, {ex + "up_proj.weight", {IE, H}},
                                 {ex + "down_proj.weight", {H, IE}}});
    }
    for (const TensorSpec& t : layer) {
      const std::string name = pre + t.name;
      if (!c.block_quantized || t.shape.size() != 2 || kept_unquantized(c, name) || t.name == "mlp.gate.weight") {
        specs.push_back({name, t.shape});
        continue;
      }
      specs.push_back({name, t.shape, Stored::quantized});
      specs.push_back({name + "_scale_inv", {cdiv(t.shape[0], 128), cdiv(t.shape[1], 128)}, Stored::scales});
    }
  }
  return specs;
}

// Look a tensor up and check it against its spec: a wrong checkpoint is a clear error, not a crash.
static const TensorView& checked_tensor(const SafeTensors& st, const TensorSpec& spec,
                                        const std::string& dir) {
  const TensorView* t = st.find(spec.name);
  if (!t && spec.stored == Stored::scales)
    die("the checkpoint in %s has no tensor '%s': the 8-bit weight '%s' needs its block scales (config.json's "
        "quantization_config says 128 x 128 blocks)", dir.c_str(), spec.name.c_str(),
        spec.name.substr(0, spec.name.size() - 10).c_str());
  TensorView want;
  want.shape = spec.shape;
  if (!t)
    die("the checkpoint in %s has no tensor '%s' (shape %s; config.json needs it: is this a Qwen3 checkpoint, "
        "and a MoE one where config.json says so?)", dir.c_str(), spec.name.c_str(), want.shape_str().c_str());
  if (t->shape != spec.shape) {
    die("tensor '%s' in %s has shape %s, but config.json implies %s%s", spec.name.c_str(), t->file.c_str(),
        t->shape_str().c_str(), want.shape_str().c_str(),
        spec.stored == Stored::scales ? " (one scale per 128 x 128 block of the weight, rounded up)" : "");
  }
  const DType d = t->dtype;
  if (spec.stored != Stored::plain) {
    const std::string problem = quantized_dtype_problem(spec.stored == Stored::scales, d);
    if (!problem.empty())
      die("tensor '%s' in %s has dtype %s; %s", spec.name.c_str(), t->file.c_str(), dtype_name(d), problem.c_str());
  } else if (d != DType::BF16 && d != DType::F16 && d != DType::F32) {
    die("tensor '%s' in %s has dtype %s; nanovllm loads BF16, F16 or F32 checkpoints%s", spec.name.c_str(),
        t->file.c_str(), dtype_name(d), unquantized_dtype_hint(d).c_str());
  }
  return *t;
}

static SafeTensors open_checkpoint(const std::string& dir) {
  try {
    return SafeTensors::open_dir(dir);
  } catch (const SafeTensorsError& e) {
    die("%s", e.what());
  }
}

// Before any GPU work: open every shard (headers, sizes, offsets) and check every tensor the config needs,
// so a broken download is reported in a second rather than after CUDA start-up. Reads no weight bytes but
// the block scales of a block-quantized checkpoint (a few thousandths of it); a NaN weight byte is found
// while loading.
static void validate_checkpoint(const std::string& dir, const ModelConfig& c) {
  SafeTensors st = open_checkpoint(dir);
  // Before listing 11 tensors per layer: a config that claims millions of layers gets a message, not an OOM.
  if (11 * (int64_t)c.num_hidden_layers > (int64_t)st.names().size())
    die("config.json has num_hidden_layers %d (11 tensors each), but the checkpoint in %s holds only %zu "
        "tensors: config.json does not describe this checkpoint", c.num_hidden_layers, dir.c_str(),
        st.names().size());
  for (const TensorSpec& spec : checkpoint_tensors(c)) {
    const TensorView& t = checked_tensor(st, spec, dir);
    if (spec.stored == Stored::scales) block_scales(t);  // refuses NaN, infinite or negative scales
  }
}

// Elements of one rank's weight arena: per layer two norms, qkv, q/k norms, o_proj, gate/up and down (a MoE
// layer: the router and every expert's gate/up and down); then the embedding, the LM head unless it is tied
// to it, and the final norm. With linears false: all but the four matrices (a MoE layer: all but the experts;
// its router stays).
static int64_t weight_elements(const ModelConfig& c, const TPShard& s, bool linears = true) {
  const int64_t H = c.hidden_size, D = c.head_dim, L = c.num_hidden_layers, L_moe = c.num_moe_layers();
  int64_t per_layer = 2 * H + 2 * D;
  if (linears) per_layer += (s.q_heads + 2 * s.kv_heads) * D * H + H * s.q_heads * D;
  const int64_t dense = linears ? 3 * s.inter * H : 0, moe = c.num_experts * H * (1 + (linears ? 3 * s.moe_inter : 0));
  return s.vocab * H * (c.tie_word_embeddings ? 1 : 2) + L * per_layer + (L - L_moe) * dense + L_moe * moe + H;
}

// Load (this rank's share of) every weight. Returns the arena; prints nothing (the caller reports timing).
// With linears false the layers' four matrices (a MoE layer's experts) are left out (their pointers null): a
// chapter that holds them in another format loads them itself (Hooks::load_weights).
static Weights load_weights(const std::string& dir, const ModelConfig& c, int rank, int tp, cudaStream_t stream,
                            size_t* bytes_read, bool linears = true) {
  SafeTensors st = open_checkpoint(dir);
  std::map<std::string, TensorSpec> spec;
  for (TensorSpec& t : checkpoint_tensors(c)) spec[t.name] = t;
  auto get = [&](const std::string& name) -> const TensorView& {
    return checked_tensor(st, spec.at(name), dir);
  };
  const TPShard shard = tp_shard(c, rank, tp);  // this rank's slice of every split dimension (section 2)
  const int64_t H = c.hidden_size, I = shard.inter, D = c.head_dim;
  const int64_t NH = shard.q_heads, NKV = shard.kv_heads;
  const int64_t V = shard.vocab, L = c.num_hidden_layers;
  const int64_t qkv_rows = (NH + 2 * NKV) * D;
  const int64_t total = weight_elements(c, shard, linears);  // the arena is sized once
  Weights w;
  w.bytes = total * sizeof(bf16);
  CUDA_CHECK(cudaMalloc(&w.arena, w.bytes));
  bf16* p = (bf16*)w.arena;
  auto take = [&](int64_t n) { bf16* r = p; p += n; return r; };
  WeightLoader ld(st, c, stream);
  // A matrix's slice, dequantized on the way when the checkpoint stores it in 8 bits; a layer's four linear
  // projections only when `linears`.
  auto load_matrix = [&](bf16* dst, const std::string& name, int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
    if (spec.at(name).stored != Stored::quantized) return ld.load(dst, get(name), r0, nr, c0, nc);
    const std::vector<float> scales = block_scales(get(name + "_scale_inv"));
    ld.load(dst, get(name), r0, nr, c0, nc, &scales);
  };
  auto load_linear = [&](bf16* dst, const std::string& name, int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
    if (linears) load_matrix(dst, name, r0, nr, c0, nc);
  };
  if (c.block_quantized) w.held = "bf16, dequantized at load from the checkpoint's 8-bit weights";
  auto take_linear = [&](int64_t n) { return linears ? take(n) : nullptr; };
  // Vocab-parallel rows; the last rank's slice may run past V (zero-filled, never selected).
  auto load_vocab = [&](bf16* dst, const TensorView& t) {
    if (shard.vocab_rows < V) CUDA_CHECK(cudaMemsetAsync(dst, 0, V * H * sizeof(bf16), stream));
    ld.load(dst, t, shard.vocab0, shard.vocab_rows, 0, H);
  };
  w.embed_tokens = take(V * H);
  load_vocab(w.embed_tokens, get("model.embed_tokens.weight"));
  if (c.tie_word_embeddings) w.lm_head = w.embed_tokens;
  else {
    w.lm_head = take(V * H);
    load_vocab(w.lm_head, get("lm_head.weight"));
  }
  w.norm = take(H);
  ld.load(w.norm, get("model.norm.weight"), 0, 1, 0, H);
  for (int64_t l = 0; l < L; l++) {
    std::string pre = "model.layers." + std::to_string(l) + ".";
    LayerWeights lw;
    lw.input_layernorm = take(H);
    ld.load(lw.input_layernorm, get(pre + "input_layernorm.weight"), 0, 1, 0, H);
    lw.post_attention_layernorm = take(H);
    ld.load(lw.post_attention_layernorm, get(pre + "post_attention_layernorm.weight"), 0, 1, 0, H);
    lw.qkv_proj = take_linear(qkv_rows * H);
    const int64_t q0 = shard.q_head0 * D, kv0 = shard.kv_head0 * D;  // first row (or column) of this rank
    load_linear(lw.qkv_proj, pre + "self_attn.q_proj.weight", q0, NH * D, 0, H);
    load_linear(lw.qkv_proj + NH * D * H, pre + "self_attn.k_proj.weight", kv0, NKV * D, 0, H);
    load_linear(lw.qkv_proj + (NH + NKV) * D * H, pre + "self_attn.v_proj.weight", kv0, NKV * D, 0, H);
    lw.q_norm = take(D);
    ld.load(lw.q_norm, get(pre + "self_attn.q_norm.weight"), 0, 1, 0, D);
    lw.k_norm = take(D);
    ld.load(lw.k_norm, get(pre + "self_attn.k_norm.weight"), 0, 1, 0, D);
    lw.o_proj = take_linear(H * NH * D);
    load_linear(lw.o_proj, pre + "self_attn.o_proj.weight", 0, H, q0, NH * D);
    lw.gate_up_proj = lw.down_proj = lw.router = lw.experts_gate_up = lw.experts_down = nullptr;
    if (!c.is_moe_layer(l)) {
      lw.gate_up_proj = take_linear(2 * I * H);
      load_linear(lw.gate_up_proj, pre + "mlp.gate_proj.weight", shard.inter0, I, 0, H);
      load_linear(lw.gate_up_proj + I * H, pre + "mlp.up_proj.weight", shard.inter0, I, 0, H);
      lw.down_proj = take_linear(H * I);
      load_linear(lw.down_proj, pre + "mlp.down_proj.weight", 0, H, shard.inter0, I);
    } else {  // the router whole, every expert sliced (the experts only with linears)
      const int64_t E = c.num_experts, IE = shard.moe_inter, ie0 = shard.moe_inter0;
      lw.router = take(E * H);
      ld.load(lw.router, get(pre + "mlp.gate.weight"), 0, E, 0, H);
      lw.experts_gate_up = take_linear(E * 2 * IE * H), lw.experts_down = take_linear(E * H * IE);
      for (int64_t e = 0; e < E && linears; e++) {
        const std::string ex = pre + "mlp.experts." + std::to_string(e) + ".";
        bf16* gate_up = lw.experts_gate_up + e * 2 * IE * H;
        load_matrix(gate_up, ex + "gate_proj.weight", ie0, IE, 0, H);
        load_matrix(gate_up + IE * H, ex + "up_proj.weight", ie0, IE, 0, H);
        load_matrix(lw.experts_down + e * H * IE, ex + "down_proj.weight", 0, H, ie0, IE);
      }
    }
    w.layers.push_back(lw);
  }
  ld.flush();
  INTERNAL_CHECK(p == (bf16*)w.arena + total, "load_weights filled %lld of %lld elements",
                 (long long)(p - (bf16*)w.arena), (long long)total);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  *bytes_read = ld.bytes_read;
  return w;
}

// ---- 6b. The KV cache layout -------------------------------------------------------------------------
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
// (A Part II cache format may store fewer bytes per value; the layout stays the same.)

// One layer's cache as the kernels take it: two [NB, NKV/tp, P, D] arrays.
struct KVLayer {
  bf16* k;
  bf16* v;
};

struct KVCache {
  char* base = nullptr;  // [L, 2, NB, NKV/tp, P, D], value_bytes per value
  int value_bytes = 2;   // bf16
  int64_t num_blocks = 0, layer_stride = 0, kv_stride = 0;  // elements
  size_t bytes = 0;
  KVLayer layer(int l) const {
    return {(bf16*)(base + l * layer_stride * value_bytes),
            (bf16*)(base + (l * layer_stride + kv_stride) * value_bytes)};
  }
};

static size_t kv_block_bytes(const ModelConfig& c, int P, int tp, int value_bytes = 2) {
  return (size_t)2 * c.num_hidden_layers * P * (c.num_key_value_heads / tp) * c.head_dim * value_bytes;
}

// ---- 6c. The forward pass ------------------------------------------------------------------------------
//
// One step, prefill or decode, T tokens from B sequences (nano-vllm: models/qwen3.py). Per layer:
//
//   x = RMSNorm(residual += h)                         (layer 0: residual = embedding, nothing to add)
//   qkv = x @ Wqkv^T                                   [T, (NH+2NKV)*D]
//   q, k = RMSNorm_head(q), RMSNorm_head(k); RoPE(q, k)   in place
//   K/V cache[slot_mapping] = k, v                     this step's keys/values join the cache
//   a = attention(q, cache, block_tables)              causal, GQA; prefill or decode kernel
//   h = a @ Wo^T                 (+ all-reduce)        [T, H]
//   x = RMSNorm(residual += h)
//   h = (SiLU(x @ Wg^T) * (x @ Wu^T)) @ Wd^T   (+ all-reduce)
//       or in a MoE layer: h = moe_mlp(x), k of E experts per token, weighted (section 10b)
// then x = RMSNorm(residual += h), keep each sequence's last row, logits = x @ lm_head^T (fp32).
// "residual += h" rides inside the next RMSNorm (add_rmsnorm), as nano-vllm's RMSNorm(x, residual) does.
//
// The pass below is written against the launchers of sections 7-10 and 12, declared here and defined there,
// so it reads like the list above. Every buffer is allocated once for the largest step (ModelRunner), so a
// step allocates nothing and a decode step can be captured in a CUDA graph.

struct Activations {
  bf16* residual;  // [Tmax, H]  the residual stream
  bf16* hidden;    // [Tmax, H]  a sub-layer's output h
  bf16* x;         // [Tmax, H]  normed input of a sub-layer
  bf16* qkv;       // [Tmax, (NH+2NKV)/tp * D]
  bf16* attn;      // [Tmax, NH/tp * D]
  bf16* gate_up;   // [Tmax, 2 * I/tp]
  bf16* act;       // [Tmax, I/tp]
  bf16* last;      // [Bmax, H]  final normed row of each sequence
  float* logits;   // [Bmax, V/tp]
  float* attn_workspace;  // scratch a Part II attention kernel asks for (Hooks, section 11); Part I's need none
  // A MoE layer's work (section 10b), for a model with experts (else null). RM = moe_rows_alloc(Tmax, k, E).
  bf16* router_logits;   // [Tmax, E]
  int* topk_ids;         // [Tmax, k]  the experts of each token
  float* topk_weights;   // [Tmax, k]
  int* moe_rows;         // [RM]       the (token, expert) pair of each row of the experts' list, -1: padding
  int* moe_pair_row;     // [Tmax * k] the row of each pair
  int* moe_tile_expert;  // [RM / MOE_TILE] the expert of each tile of the list, -1: unused
  bf16* moe_gate_up;     // [RM, 2 * IE/tp]
  bf16* moe_act;         // [RM, IE/tp]
  bf16* moe_out;         // [RM, H]
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
  int decode_rows = 0;  // host value (prefill): how many leading sequences compute one token, their last
                        // (decoding sequences in a --scheduler mixed step, 5b). Part I ignores it: such a row
                        // is a query of length 1 to the prefill kernel. Section 16 runs them as decode rows.
};

// The launchers the forward pass calls (section 7: elementwise kernels; 8: attention; 10: cuBLASLt; 10b: a
// MoE layer's MLP; 12: the all-reduce). Shapes are in each definition's comment.
void embedding(bf16* out, const int* ids, const bf16* table, int T, int H, int vocab_start, int V_local,
               cudaStream_t stream);
void rmsnorm(bf16* out, const bf16* x, const bf16* w, int T, int H, float eps, cudaStream_t stream);
void add_rmsnorm(bf16* out, bf16* residual, const bf16* x, const bf16* w, int T, int H, float eps,
                 cudaStream_t stream);
void qk_norm_rope(bf16* qkv, const int* positions, const bf16* q_norm_w, const bf16* k_norm_w,
                  const KVLayer& cache, const int* slot_mapping, int T, int NH, int NKV, int P, float rope_theta,
                  float eps, cudaStream_t stream);
static void attention_prefill(bf16* out, const bf16* qkv, const KVLayer& cache, const int* cu_seqlens_q,
                              const int* seqlens_k, const int* block_tables, int B, int max_seqlen_q, int NH,
                              int NKV, int P, int MB, float scale, cudaStream_t stream);
static void attention_decode(bf16* out, const bf16* qkv, const KVLayer& cache, const int* context_lens,
                             const int* block_tables, int B, int NH, int NKV, int P, int MB, float scale,
                             cudaStream_t stream);
void silu_and_mul(bf16* out, const bf16* gate_up, int T, int I, cudaStream_t stream);
void gather_last_tokens(bf16* out, const bf16* x, const int* cu_seqlens_q, int B, int H, cudaStream_t stream);
struct Gemm;
static void linear(Gemm& gemm, void* y, const bf16* x, const bf16* W, int M, int N, int K, cudaStream_t stream,
                   cudaDataType out_type = CUDA_R_16BF);
static void moe_mlp(bf16* out, const bf16* x, const LayerWeights& lw, const ModelConfig& c, int tp, int T,
                    Gemm& gemm, const Activations& a, cudaStream_t stream);
struct TPComm;  // section 12; null without tensor parallelism
static void all_reduce_sum(TPComm* comm, bf16* x, size_t n, cudaStream_t stream);

struct Qwen3 {
  ModelConfig cfg;
  Weights w;
  KVCache kv;
  Gemm* gemm = nullptr;  // cuBLASLt handle, workspace and cached plans (section 10)
  Activations act;
  int tp = 1, rank = 0;
  TPComm* comm = nullptr;
  int P = 256, MB = 16, max_model_len = 4096;

  // Runs the model on one step and leaves fp32 logits of each sequence's last token in act.logits.
  // nano-vllm: Qwen3ForCausalLM.forward, then compute_logits.
  void forward(const StepInputs& in, int T, int B, bool is_prefill, cudaStream_t s) {
    const int H = cfg.hidden_size, I = cfg.intermediate_size / tp, D = cfg.head_dim;
    const int NH = cfg.num_attention_heads / tp, NKV = cfg.num_key_value_heads / tp;
    const int V = (int)cdiv(cfg.vocab_size, tp);
    const float eps = cfg.rms_norm_eps, scale = 1.0f / sqrtf((float)D);
    embedding(act.residual, in.input_ids, w.embed_tokens, T, H, rank * V, V, s);
    if (tp > 1) all_reduce_sum(comm, act.residual, (size_t)T * H, s);  // each rank looked up its own ids
    for (int l = 0; l < cfg.num_hidden_layers; l++) {
      const LayerWeights& lw = w.layers[l];
      // attention
      if (l == 0) rmsnorm(act.x, act.residual, lw.input_layernorm, T, H, eps, s);
      else add_rmsnorm(act.x, act.residual, act.hidden, lw.input_layernorm, T, H, eps, s);
      linear(*gemm, act.qkv, act.x, lw.qkv_proj, T, (NH + 2 * NKV) * D, H, s);
      qk_norm_rope(act.qkv, in.positions, lw.q_norm, lw.k_norm, kv.layer(l), in.slot_mapping, T, NH, NKV, P,
                   cfg.rope_theta, eps, s);
      if (is_prefill)
        attention_prefill(act.attn, act.qkv, kv.layer(l), in.cu_seqlens_q, in.seqlens_k, in.block_tables, B,
                          in.max_seqlen_q, NH, NKV, P, MB, scale, s);
      else
        attention_decode(act.attn, act.qkv, kv.layer(l), in.seqlens_k, in.block_tables, B, NH, NKV, P, MB,
                         scale, s);
      linear(*gemm, act.hidden, act.attn, lw.o_proj, T, H, NH * D, s);
      if (tp > 1) all_reduce_sum(comm, act.hidden, (size_t)T * H, s);
      // MLP: dense, or a mixture of experts
      add_rmsnorm(act.x, act.residual, act.hidden, lw.post_attention_layernorm, T, H, eps, s);
      if (cfg.is_moe_layer(l)) {
        moe_mlp(act.hidden, act.x, lw, cfg, tp, T, *gemm, act, s);
      } else {
        linear(*gemm, act.gate_up, act.x, lw.gate_up_proj, T, 2 * I, H, s);
        silu_and_mul(act.act, act.gate_up, T, I, s);
        linear(*gemm, act.hidden, act.act, lw.down_proj, T, H, I, s);
      }
      if (tp > 1) all_reduce_sum(comm, act.hidden, (size_t)T * H, s);
    }
    add_rmsnorm(act.x, act.residual, act.hidden, w.norm, T, H, eps, s);
    const bf16* last = act.x;
    if (is_prefill) {  // only each sequence's last position needs logits (nano-vllm: ParallelLMHead)
      gather_last_tokens(act.last, act.x, in.cu_seqlens_q, B, H, s);
      last = act.last;
    }
    linear(*gemm, act.logits, last, w.lm_head, B, V, H, s, CUDA_R_32F);
  }
};

// ==== 7. Kernels: embedding, RMSNorm, q/k-norm + RoPE + KV store, SiLU =====================================
// defines: embedding, rmsnorm, add_rmsnorm, RopeInvFreq, rope_inv_freq, qk_norm_rope, silu_and_mul,
//          gather_last_tokens, and their CPU references
//
// Shared conventions of this section:
//   * Every load and store moves 16 bytes (8 bf16) per thread (qk_norm_rope, which works on RoPE's pairs of
//     values, excepted): the widest access a thread can issue, so a warp touches 512 contiguous bytes per
//     instruction. Hence the preconditions "H % 8 == 0" and
//     "pointers 16-byte aligned" (cudaMalloc gives 256-byte alignment; every row length is a multiple of 8).
//   * Math is fp32; a bf16 rounding happens exactly where Hugging Face's Qwen3 rounds (a bf16 tensor is
//     stored), so our activations match the reference bit for bit in the common case.
//   * Zero-sized launches (T == 0) are skipped in the launcher: a grid of 0 thread blocks is a CUDA error.
//   * Each kernel is followed by its launcher, and its CPU reference ("what this kernel computes", in plain
//     loops) sits beside it: test/gpu/gpu_kernels.cu checks one against the other at awkward sizes.

// 8 bf16 <-> 8 floats, through one 16-byte register quad (uint4).
__device__ __forceinline__ void bf16x8_to_float(const uint4& u, float f[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}
__device__ __forceinline__ uint4 float_to_bf16x8(const float f[8]) {
  uint4 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; i++) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return u;
}

// Sum over the whole thread block; every thread gets the result. scratch: 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < nwarps; w++) total += scratch[w];
  return total;
}

// Launcher-side checks shared by this section's launchers: these are engine invariants, but a clear
// message beats a misaligned-address fault three kernels later.
static void check_vec8(const char* kernel, const char* what, int64_t n) {
  INTERNAL_CHECK(n % 8 == 0, "%s: %s = %lld must be a multiple of 8 (16-byte vector loads)", kernel, what,
                 (long long)n);
}
static void check_aligned16(const char* kernel, const char* what, const void* p) {
  INTERNAL_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, "%s: pointer %s = %p is not 16-byte aligned", kernel,
                 what, p);
}
// Threads for a thread block that walks a row of `chunks` 16-byte chunks: one chunk per thread if possible.
static int row_threads(int64_t chunks, int max_threads) {
  return (int)std::min<int64_t>(max_threads, std::max<int64_t>(32, cdiv(chunks, 32) * 32));
}

// ---- embedding -------------------------------------------------------------------------------------
// Replaces: nano-vllm VocabParallelEmbedding.forward: F.embedding(x - vocab_start, shard) with the ids of
//           other shards masked to zero (the all-reduce over the tensor-parallel group then sums shards).
// Reads  ids [T], table [V_local, H] (this rank's rows, vocab ids vocab_start .. vocab_start+V_local-1).
// Writes out [T, H].
// Thread block = one token; each thread copies 16-byte chunks of the row (zeros for a foreign id).
// What embedding_kernel computes, on the CPU (bf16 as float): out [T, H].
static void embedding_reference(float* out, const int* ids, const float* table, int T, int H, int vocab_start,
                                int V_local) {
  for (int t = 0; t < T; t++) {
    const int64_t local = (int64_t)ids[t] - vocab_start;
    for (int h = 0; h < H; h++) out[(size_t)t * H + h] = local >= 0 && local < V_local ? table[local * H + h] : 0.f;
  }
}

__global__ void embedding_kernel(bf16* out, const int* ids, const bf16* table, int H, int vocab_start,
                                 int V_local) {
  int t = blockIdx.x;
  int64_t local = (int64_t)ids[t] - vocab_start;
  bool mine = local >= 0 && local < V_local;
  const uint4* src = reinterpret_cast<const uint4*>(table + local * H);
  uint4* dst = reinterpret_cast<uint4*>(out + (int64_t)t * H);
  for (int c = threadIdx.x; c < H / 8; c += blockDim.x) dst[c] = mine ? src[c] : make_uint4(0, 0, 0, 0);
}
void embedding(bf16* out, const int* ids, const bf16* table, int T, int H, int vocab_start, int V_local,
               cudaStream_t stream) {
  check_vec8("embedding", "H", H);
  check_aligned16("embedding", "out", out);
  check_aligned16("embedding", "table", table);
  if (T == 0) return;
  embedding_kernel<<<T, row_threads(H / 8, 256), 0, stream>>>(out, ids, table, H, vocab_start, V_local);
  CUDA_CHECK(cudaGetLastError());
}

// ---- rmsnorm and add_rmsnorm -------------------------------------------------------------------------
// Replaces (Hugging Face Qwen3RMSNorm, which nano-vllm's RMSNorm reproduces):
//     y   = bf16(x_f32 * rsqrt(mean(x_f32^2) + eps))        # HF casts back to the input dtype here...
//     out = bf16(float(w) * float(y))                       # ...and then multiplies two bf16 tensors
// add_rmsnorm first does the residual add the way the PyTorch model does it, in bf16:
//     s = bf16(float(x) + float(residual));  residual = s;  out = rmsnorm(s)
// (nano-vllm fuses the add into the norm the same way, so the residual stream is always bf16.)
// Reads  x [T, H], residual [T, H] (add_rmsnorm), w [H].   Writes out [T, H], residual [T, H].
// Thread block = one row. Each thread keeps up to NORM_MAX_CHUNKS 16-byte chunks of the row in registers, so
// the row is read from memory once: sum of squares -> reduction over the thread block -> scale and write.
// out may alias x (a thread reads its chunks before writing the same chunks).
// Preconditions: H % 8 == 0, H <= NORM_THREADS * NORM_MAX_CHUNKS * 8 = 8192 (Qwen3-32B has H = 5120).
// What rmsnorm_kernel computes for one row, on the CPU, with Hugging Face's roundings: x [H] holds bf16
// values (for add_rmsnorm: bf16(x + residual), which is also the new residual), out [H].
static void rmsnorm_reference(float* out, const float* x, const float* w, int H, float eps) {
  double ss = 0;
  for (int h = 0; h < H; h++) ss += (double)x[h] * x[h];
  const float scale = (float)(1.0 / sqrt(ss / H + eps));
  for (int h = 0; h < H; h++) out[h] = bf16_round(w[h] * bf16_round(x[h] * scale));
}

constexpr int NORM_THREADS = 256;
constexpr int NORM_MAX_CHUNKS = 4;

// One row, by the whole thread block (rmsnorm_kernel's body; the fused gemv of section 18 calls it too, so the
// fused and the separate paths round identically). scratch: 32 floats of shared memory.
template <bool ADD_RESIDUAL>
__device__ __forceinline__ void rmsnorm_row(bf16* out, bf16* residual, const bf16* x, const bf16* w, int H,
                                            float eps, float* scratch) {
  const uint4* xr = reinterpret_cast<const uint4*>(x);
  uint4* rr = ADD_RESIDUAL ? reinterpret_cast<uint4*>(residual) : nullptr;
  int nchunks = H / 8;
  float v[NORM_MAX_CHUNKS][8];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < NORM_MAX_CHUNKS; k++) {
    int c = threadIdx.x + k * blockDim.x;
    if (c >= nchunks) break;
    bf16x8_to_float(xr[c], v[k]);
    if (ADD_RESIDUAL) {
      float r[8];
      bf16x8_to_float(rr[c], r);
#pragma unroll
      for (int i = 0; i < 8; i++) v[k][i] = bf16_round(v[k][i] + r[i]);
      rr[c] = float_to_bf16x8(v[k]);
    }
#pragma unroll
    for (int i = 0; i < 8; i++) ss += v[k][i] * v[k][i];
  }
  float scale = rsqrtf(block_sum(ss, scratch) / (float)H + eps);
  const uint4* wr = reinterpret_cast<const uint4*>(w);
  uint4* orow = reinterpret_cast<uint4*>(out);
#pragma unroll
  for (int k = 0; k < NORM_MAX_CHUNKS; k++) {
    int c = threadIdx.x + k * blockDim.x;
    if (c >= nchunks) break;
    float wf[8], o[8];
    bf16x8_to_float(wr[c], wf);
#pragma unroll
    for (int i = 0; i < 8; i++) o[i] = wf[i] * bf16_round(v[k][i] * scale);
    orow[c] = float_to_bf16x8(o);
  }
}

template <bool ADD_RESIDUAL>
__global__ __launch_bounds__(NORM_THREADS) void rmsnorm_kernel(bf16* out, bf16* residual, const bf16* x,
                                                               const bf16* w, int H, float eps) {
  __shared__ float scratch[32];
  int64_t row = (int64_t)blockIdx.x * H;
  rmsnorm_row<ADD_RESIDUAL>(out + row, ADD_RESIDUAL ? residual + row : nullptr, x + row, w, H, eps, scratch);
}
static void rmsnorm_checks(const char* name, const void* out, const void* x, const void* w, int H) {
  check_vec8(name, "H", H);
  INTERNAL_CHECK(H <= NORM_THREADS * NORM_MAX_CHUNKS * 8,
                 "%s: H = %d is larger than the %d this kernel keeps in registers (raise NORM_MAX_CHUNKS)", name,
                 H, NORM_THREADS * NORM_MAX_CHUNKS * 8);
  check_aligned16(name, "out", out);
  check_aligned16(name, "x", x);
  check_aligned16(name, "w", w);
}
void rmsnorm(bf16* out, const bf16* x, const bf16* w, int T, int H, float eps, cudaStream_t stream) {
  rmsnorm_checks("rmsnorm", out, x, w, H);
  if (T == 0) return;
  rmsnorm_kernel<false><<<T, row_threads(H / 8, NORM_THREADS), 0, stream>>>(out, nullptr, x, w, H, eps);
  CUDA_CHECK(cudaGetLastError());
}
void add_rmsnorm(bf16* out, bf16* residual, const bf16* x, const bf16* w, int T, int H, float eps,
                 cudaStream_t stream) {
  rmsnorm_checks("add_rmsnorm", out, x, w, H);
  check_aligned16("add_rmsnorm", "residual", residual);
  if (T == 0) return;
  rmsnorm_kernel<true><<<T, row_threads(H / 8, NORM_THREADS), 0, stream>>>(out, residual, x, w, H, eps);
  CUDA_CHECK(cudaGetLastError());
}

// ---- qk_norm_rope (and the KV-cache store) ---------------------------------------------------------------
// Replaces (Qwen3Attention.forward, between the qkv projection and attention):
//     q = q_norm(q.view(T, NH, D));  k = k_norm(k.view(T, NKV, D))     # RMSNorm over D, semantics above
//     q, k = rotary_emb(positions, q, k)                               # rotate-half (NeoX) RoPE, full D
//     store_kvcache(k, v, k_cache, v_cache, slot_mapping)              # nano-vllm's Triton kernel
// The store is fused in: the thread that writes a finished k head also writes it to its cache slot, and
// the thread block copies the token's v heads, so K/V never take a second trip through memory. (Section 19
// has a faster kernel for the same work, and moves it into decode attention.)
// Cache layout [NB, NKV, P, D]: head h of the token goes to [slot / P, h, slot % P, :]; slot -1 (padding)
// stores nothing. Every head is 256 contiguous bytes.
// RoPE, as nano-vllm computes it (fp32 math, one bf16 rounding at the end):
//     inv_freq[i] = 1 / theta^(2i/D)  (i < D/2)      angle = float(pos) * inv_freq[i]
//     out[i]       = x[i] * cos(angle) - x[i+D/2] * sin(angle)
//     out[i+D/2]   = x[i+D/2] * cos(angle) + x[i] * sin(angle)
// (Hugging Face rounds cos/sin to bf16 first and rounds after each product; the difference is within
//  bf16 noise and nano-vllm's fp32 path is the more accurate of the two.)
// Reads and writes the q and k heads of qkv [T, (NH + 2*NKV) * D] in place; v heads are only read.
// Why host-computed inv_freq: theta^(2i/D) in float must equal what PyTorch computes at model load; a
// device powf may differ by an ulp, which at position 40000 moves the angle by ~0.003 rad. The table is
// passed by value as a kernel argument (256 bytes), so CUDA graphs capture it too.
// Why sincosf and not __sinf: the fast intrinsics lose all accuracy for angles in the thousands of
// radians, and positions go to 40960. (Never build this file with --use_fast_math.)
struct RopeInvFreq {
  float v[HEAD_DIM / 2];
};

// RoPE's inverse frequencies for theta, as PyTorch computes them:
//   inv_freq = 1.0 / (theta ** (arange(0, D, 2).float() / D)), every step in float. The pow is evaluated in
// double and rounded once, i.e. the correctly rounded float of PyTorch's expression. Cached: launchers ask
// once per layer per step and theta never changes within a run.
static const RopeInvFreq& rope_inv_freq(float rope_theta) {
  static RopeInvFreq inv_freq;
  static float cached_theta = -1.f;
  if (rope_theta != cached_theta) {
    for (int i = 0; i < HEAD_DIM / 2; i++) {
      float exponent = (float)(2 * i) / (float)HEAD_DIM;
      float denom = (float)pow((double)rope_theta, (double)exponent);
      inv_freq.v[i] = 1.0f / denom;
    }
    cached_theta = rope_theta;
  }
  return inv_freq;
}

// What qk_norm_rope_kernel computes, on the CPU, in place on qkv [T, (NH + 2*NKV) * D] (bf16 as float):
// per-head RMSNorm with Hugging Face's roundings, then rotate-half RoPE in double with one bf16 rounding.
// The KV store is a copy: k heads as left here, v heads as they came in, to their slots.
static void qk_norm_rope_reference(float* qkv, const int* positions, const float* q_norm_w,
                                   const float* k_norm_w, int T, int NH, int NKV, float theta, float eps) {
  const int D = HEAD_DIM;
  const RopeInvFreq& inv_freq = rope_inv_freq(theta);
  for (int t = 0; t < T; t++)
    for (int h = 0; h < NH + NKV; h++) {
      float* x = &qkv[((size_t)t * (NH + 2 * NKV) + h) * D];
      float n[D];
      rmsnorm_reference(n, x, h < NH ? q_norm_w : k_norm_w, D, eps);
      for (int i = 0; i < D / 2; i++) {
        const double angle = (double)((float)positions[t] * inv_freq.v[i]);  // the fp32 angle, as PyTorch
        const double c = cos(angle), s = sin(angle);
        x[i] = bf16_round((float)(n[i] * c - n[i + D / 2] * s));
        x[i + D / 2] = bf16_round((float)(n[i + D / 2] * c + n[i] * s));
      }
    }
}

// One thread block per token, D/2 = 64 threads: thread i owns the RoPE pair (i, i + D/2) of every head,
// and the heads of the token are taken one after another, q heads first, then k heads:
//     head h of token t:  x = qkv[t, h*D .. h*D + D)
//     ss = sum over the block of x[i]^2 + x[i+D/2]^2;   n = bf16(w * bf16(x * rsqrt(ss/D + eps)))
//     x[i], x[i+D/2] = rotate(n[i], n[i+D/2]) by angle i of position positions[t]
// A k head also goes to its cache slot; then the threads copy the token's v heads to theirs.
// Launch: grid T, block HEAD_DIM / 2. Preconditions: D = HEAD_DIM; qkv and the cache 2-byte aligned.
__global__ void qk_norm_rope_kernel(bf16* qkv, const int* positions, const bf16* q_norm_w, const bf16* k_norm_w,
                                    bf16* k_cache, bf16* v_cache, const int* slot_mapping, int NH, int NKV, int P,
                                    float eps, RopeInvFreq inv_freq) {
  __shared__ float scratch[32];
  const int t = blockIdx.x, i = threadIdx.x, D = HEAD_DIM;
  bf16* row = qkv + (int64_t)t * (NH + 2 * NKV) * D;   // token t's q heads, k heads, v heads
  float sin_a, cos_a;
  sincosf((float)positions[t] * inv_freq.v[i], &sin_a, &cos_a);
  const int slot = slot_mapping[t];
  const int64_t cache_block = slot / P, cache_offset = slot % P;  // used only when slot >= 0
  for (int h = 0; h < NH + NKV; h++) {
    bf16* x = row + (int64_t)h * D;
    const float a = __bfloat162float(x[i]), b = __bfloat162float(x[i + D / 2]);
    const float scale = rsqrtf(block_sum(a * a + b * b, scratch) / (float)D + eps);
    __syncthreads();  // every thread has read scratch before the next head's block_sum writes it
    const bf16* w = h < NH ? q_norm_w : k_norm_w;
    const float na = bf16_round(__bfloat162float(w[i]) * bf16_round(a * scale));  // the normed head, as HF
    const float nb = bf16_round(__bfloat162float(w[i + D / 2]) * bf16_round(b * scale));
    x[i] = __float2bfloat16(na * cos_a - nb * sin_a);
    x[i + D / 2] = __float2bfloat16(nb * cos_a + na * sin_a);
    if (h >= NH && slot >= 0) {  // a k head: into its cache slot [block, h - NH, offset, :] too
      bf16* dst = k_cache + ((cache_block * NKV + (h - NH)) * P + cache_offset) * D;
      dst[i] = x[i];
      dst[i + D / 2] = x[i + D / 2];
    }
  }
  if (slot < 0) return;
  for (int h = 0; h < NKV; h++)  // the v heads go to the cache as they are
    for (int d = i; d < D; d += blockDim.x)
      v_cache[((cache_block * NKV + h) * P + cache_offset) * D + d] = row[(int64_t)(NH + NKV + h) * D + d];
}
// cache: one layer's k and v [NB, NKV, P, D]; slot_mapping [T] (device; -1 = do not store).
void qk_norm_rope(bf16* qkv, const int* positions, const bf16* q_norm_w, const bf16* k_norm_w,
                  const KVLayer& cache, const int* slot_mapping, int T, int NH, int NKV, int P, float rope_theta,
                  float eps, cudaStream_t stream) {
  INTERNAL_CHECK(P > 0, "qk_norm_rope: block size P = %d", P);
  if (T == 0) return;
  qk_norm_rope_kernel<<<T, HEAD_DIM / 2, 0, stream>>>(qkv, positions, q_norm_w, k_norm_w, cache.k, cache.v,
                                                      slot_mapping, NH, NKV, P, eps, rope_inv_freq(rope_theta));
  CUDA_CHECK(cudaGetLastError());
}

// ---- silu_and_mul --------------------------------------------------------------------------------------
// Replaces: nano-vllm SiluAndMul: x, y = gate_up.chunk(2, -1); return F.silu(x) * y
// computed as out = bf16(silu(g) * u) in fp32, silu(g) = g / (1 + exp(-g)).
// Reads gate_up [T, 2I] (gate in columns [0, I), up in [I, 2I)). Writes out [T, I].
// One thread = one 16-byte chunk of out (8 outputs), a flat grid over T * I / 8 chunks.
// Precondition: I % 8 == 0 (true for every Qwen3 size divided by any tensor-parallel degree up to 8).
// One output, before its bf16 rounding (section 24's epilogue uses it alone), then 8 outputs from 8 gates
// and 8 ups (the fused gemv of section 18 uses it too).
// What silu_and_mul_kernel computes, on the CPU: out [T, I] from gate_up [T, 2I] (bf16 as float).
static void silu_and_mul_reference(float* out, const float* gate_up, int T, int I) {
  for (int t = 0; t < T; t++)
    for (int i = 0; i < I; i++) {
      const double g = gate_up[(size_t)t * 2 * I + i], u = gate_up[(size_t)t * 2 * I + I + i];
      out[(size_t)t * I + i] = bf16_round((float)(g / (1 + exp(-g)) * u));
    }
}

__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.f + expf(-g)) * u; }
__device__ __forceinline__ uint4 silu_mul8(const uint4& gate, const uint4& up) {
  float g[8], u[8], o[8];
  bf16x8_to_float(gate, g);
  bf16x8_to_float(up, u);
#pragma unroll
  for (int i = 0; i < 8; i++) o[i] = silu_mul(g[i], u[i]);
  return float_to_bf16x8(o);
}

__global__ void silu_and_mul_kernel(bf16* out, const bf16* gate_up, int64_t total_chunks, int I) {
  int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= total_chunks) return;
  int64_t t = c / (I / 8), chunk = c % (I / 8);
  const uint4* gate = reinterpret_cast<const uint4*>(gate_up + t * 2 * I);
  const uint4* up = reinterpret_cast<const uint4*>(gate_up + t * 2 * I + I);
  reinterpret_cast<uint4*>(out + t * I)[chunk] = silu_mul8(gate[chunk], up[chunk]);
}
void silu_and_mul(bf16* out, const bf16* gate_up, int T, int I, cudaStream_t stream) {
  check_vec8("silu_and_mul", "I", I);
  check_aligned16("silu_and_mul", "out", out);
  check_aligned16("silu_and_mul", "gate_up", gate_up);
  int64_t total = (int64_t)T * (I / 8);
  if (total == 0) return;
  silu_and_mul_kernel<<<(unsigned)cdiv(total, 256), 256, 0, stream>>>(out, gate_up, total, I);
  CUDA_CHECK(cudaGetLastError());
}

// ---- gather_last_tokens ------------------------------------------------------------------------------
// Replaces: nano-vllm ParallelLMHead.forward's  x = x[cu_seqlens_q[1:] - 1]  (prefill): only the last
// position of each sequence needs logits. In decode every sequence has one token and this is a copy.
// Reads x [T, H], cu_seqlens_q [B + 1]. Writes out [B, H]. Thread block = one sequence, 16-byte chunks.
__global__ void gather_last_tokens_kernel(bf16* out, const bf16* x, const int* cu_seqlens_q, int H) {
  int b = blockIdx.x;
  int64_t last = cu_seqlens_q[b + 1] - 1;
  const uint4* src = reinterpret_cast<const uint4*>(x + last * H);
  uint4* dst = reinterpret_cast<uint4*>(out + (int64_t)b * H);
  for (int c = threadIdx.x; c < H / 8; c += blockDim.x) dst[c] = src[c];
}
void gather_last_tokens(bf16* out, const bf16* x, const int* cu_seqlens_q, int B, int H,
                        cudaStream_t stream) {
  check_vec8("gather_last_tokens", "H", H);
  check_aligned16("gather_last_tokens", "out", out);
  check_aligned16("gather_last_tokens", "x", x);
  if (B == 0) return;
  gather_last_tokens_kernel<<<B, row_threads(H / 8, 256), 0, stream>>>(out, x, cu_seqlens_q, H);
  CUDA_CHECK(cudaGetLastError());
}

// ==== 8. Paged attention: prefill and decode ===============================================================
// defines: attention_reference, attend_row, attention_prefill, attention_decode, check_attention_shapes
//
// What attention computes. For one query row (token t of sequence b, at position pos) and one query head h,
// whose keys and values are those of KV head kvh = h / (NH/NKV) (GQA: a group of query heads shares one):
//
//   s_j   = scale * (q . k_j)                      for every key j = 0 .. pos (causal: no key after t)
//   out   = sum_j softmax(s)_j * v_j               scale = 1/sqrt(D)
//
// Where key j lives (the block-table lookup): in block block_tables[b][j / P], at offset j % P, so
//
//   k_j = k_cache[block_tables[b * MB + j / P]][kvh][j % P][0 .. D)        (v_j likewise in v_cache)
//
// By the time attention runs, qk_norm_rope (section 7) has already written this step's k and v into their
// slots, so attention reads every key, cached prefix and new ones alike, through the block table, and reads
// only q from qkv. That is why prefix-cache hits and chunked prefill need no special case here. A prefill
// row is one of a sequence's new tokens (its position: seqlens_k[b] - q_len + i); a decode row is the one
// new token of a sequence (position context_lens[b] - 1). The same computation serves both.
//
// Online softmax: the softmax needs the largest score first (exp of a large score overflows), which would
// mean two passes over the keys. Instead one pass keeps a running maximum m, a running sum l of
// exp(s_j - m) and a running unnormalised output o, and rescales them whenever m grows. Key by key:
//
//   m'  = max(m, s_j)
//   l'  = l * exp(m - m') + exp(s_j - m')
//   o'  = o * exp(m - m') + exp(s_j - m') * v_j           and at the end  out = o / l
//
// (m starts at -infinity, l and o at 0; exp(-inf) = 0 makes the first step right.) Every quantity stays
// at most 1 in size, and the keys are read once.
//
// The kernels below are the plain version: one warp per (query row, query head), each lane holding 4 of
// the 128 dims of q, of the running o, and of each key and value it reads. Part II replaces them with
// flash attention on tensor cores, which shares each key tile between many rows and many heads.

// What both attention kernels compute, on the CPU in double precision, for sequence b and query head h:
// its q_len queries (rows cu_seqlens_q[b] ..), query i at position seqlens_k[b] - q_len + i, each attending
// to keys 0 .. its position through the block table. qkv [T, (NH + 2*NKV) * D], k_cache and v_cache
// [NB, NKV, P, D], block_tables [B, MB] (host arrays of bf16 values as float); writes out [T, NH * D] rows
// of this (b, h). Decode is the case q_len = 1. (test/gpu/gpu_attention.cu runs it over every (b, h).)
static void attention_reference(float* out, const float* qkv, const float* k_cache, const float* v_cache,
                                const int* cu_seqlens_q, const int* seqlens_k, const int* block_tables, int b,
                                int h, int NH, int NKV, int P, int MB) {
  const int D = HEAD_DIM, kvh = h / (NH / NKV), width = (NH + 2 * NKV) * D;
  const int q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
  const double scale = 1.0 / std::sqrt((double)D);
  auto key_at = [&](int j) {  // element offset of key j of sequence b in the cache
    const size_t block = block_tables[(size_t)b * MB + j / P];
    return ((block * NKV + kvh) * P + j % P) * D;
  };
  std::vector<double> p, acc(D);
  for (int i = 0; i < q_len; i++) {
    const int t = cu_seqlens_q[b] + i, pos = seqlens_k[b] - q_len + i;
    const float* q = &qkv[(size_t)t * width + h * D];
    p.assign(pos + 1, 0.0);
    double mx = -1e300;
    for (int j = 0; j <= pos; j++) {
      const float* k = &k_cache[key_at(j)];
      double s = 0;
      for (int d = 0; d < D; d++) s += (double)q[d] * k[d];
      p[j] = s * scale;
      mx = std::max(mx, p[j]);
    }
    double sum = 0;
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int j = 0; j <= pos; j++) {
      p[j] = std::exp(p[j] - mx);
      sum += p[j];
      const float* v = &v_cache[key_at(j)];
      for (int d = 0; d < D; d++) acc[d] += p[j] * v[d];
    }
    for (int d = 0; d < D; d++) out[(size_t)t * NH * D + h * D + d] = (float)(acc[d] / sum);
  }
}

constexpr int ATTN_DIMS_PER_LANE = HEAD_DIM / 32;  // 4: a warp covers one head, 8 bytes of bf16 per lane
constexpr int ATTN_ROWS_PER_BLOCK = 4;             // warps (query rows) per thread block of 128 threads

// attend_row — one warp computes one (query row, query head) of attention over keys 0 .. pos.
//   q: the row's query head (D bf16); out: where its D outputs go; the cache and block_table as above.
//   Lane l owns dims [4l, 4l + 4): it loads those 4 values of q once, and of each key and value it reads.
//   Per key j (the equations above): the lanes' partial dot products are summed over the warp with 5
//   butterfly shuffles, so every lane holds s_j; every lane updates m, l identically and its own 4 dims of o.
__device__ void attend_row(bf16* out, const bf16* q, const bf16* k_cache, const bf16* v_cache,
                           const int* block_table, int kvh, int NKV, int P, int pos, float scale) {
  const int lane = threadIdx.x % 32, d0 = lane * ATTN_DIMS_PER_LANE;
  float qf[ATTN_DIMS_PER_LANE], o[ATTN_DIMS_PER_LANE] = {0.f, 0.f, 0.f, 0.f};
  for (int i = 0; i < ATTN_DIMS_PER_LANE; i++) qf[i] = __bfloat162float(q[d0 + i]);
  float m = -INFINITY, l = 0.f;
  for (int j = 0; j <= pos; j++) {
    // The block-table lookup: key j's row in the [NB, NKV, P, D] cache.
    const int64_t row = ((int64_t)block_table[j / P] * NKV + kvh) * P + j % P;
    const bf16* k = k_cache + row * HEAD_DIM + d0;
    const bf16* v = v_cache + row * HEAD_DIM + d0;
    float dot = 0.f;
    for (int i = 0; i < ATTN_DIMS_PER_LANE; i++) dot += qf[i] * __bfloat162float(k[i]);
    for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    const float s = dot * scale;
    const float m_new = fmaxf(m, s);
    const float correction = expf(m - m_new);  // exp(-inf) = 0 on the first key
    const float p = expf(s - m_new);
    l = l * correction + p;
    for (int i = 0; i < ATTN_DIMS_PER_LANE; i++) o[i] = o[i] * correction + p * __bfloat162float(v[i]);
    m = m_new;
  }
  for (int i = 0; i < ATTN_DIMS_PER_LANE; i++) out[d0 + i] = __float2bfloat16(o[i] / l);
}

// attention_prefill_kernel — the new tokens of each sequence attend to their keys (causal).
//   Replaces: flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, causal=True,
//             block_table=block_tables) in nano-vllm's Attention.forward (prefill branch).
//   Grid (B, NH, ceil(max_seqlen_q / 4)), 128 threads: warp w of thread block (b, h, z) takes query
//   i = 4z + w of sequence b (row t = cu_seqlens_q[b] + i, position seqlens_k[b] - q_len + i), head h;
//   warps past the sequence's q_len have nothing to do.
__global__ void attention_prefill_kernel(bf16* out, const bf16* qkv, const bf16* k_cache, const bf16* v_cache,
                                         const int* cu_seqlens_q, const int* seqlens_k,
                                         const int* block_tables, int NH, int NKV, int P, int MB, float scale) {
  const int b = blockIdx.x, h = blockIdx.y, i = blockIdx.z * ATTN_ROWS_PER_BLOCK + threadIdx.x / 32;
  const int q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
  if (i >= q_len) return;
  const int t = cu_seqlens_q[b] + i, pos = seqlens_k[b] - q_len + i;
  const bf16* q = qkv + (int64_t)t * (NH + 2 * NKV) * HEAD_DIM + h * HEAD_DIM;
  attend_row(out + (int64_t)t * NH * HEAD_DIM + h * HEAD_DIM, q, k_cache, v_cache, block_tables + (int64_t)b * MB,
             h / (NH / NKV), NKV, P, pos, scale);
}

// attention_decode_kernel — one new token per sequence attends to its whole context.
//   Replaces: flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context_lens,
//             block_table=block_tables, causal=True) in nano-vllm's Attention.forward (decode branch).
//   Grid (B, ceil(NH / 4)), 128 threads: warp w of thread block (b, z) takes head h = 4z + w of sequence b's
//   one row (row b of qkv, position context_lens[b] - 1). The grid depends on B alone, so a CUDA graph
//   captured for a batch size stays valid as the contexts grow.
__global__ void attention_decode_kernel(bf16* out, const bf16* qkv, const bf16* k_cache, const bf16* v_cache,
                                        const int* context_lens, const int* block_tables, int NH, int NKV, int P,
                                        int MB, float scale) {
  const int b = blockIdx.x, h = blockIdx.y * ATTN_ROWS_PER_BLOCK + threadIdx.x / 32;
  if (h >= NH) return;
  const bf16* q = qkv + (int64_t)b * (NH + 2 * NKV) * HEAD_DIM + h * HEAD_DIM;
  attend_row(out + (int64_t)b * NH * HEAD_DIM + h * HEAD_DIM, q, k_cache, v_cache, block_tables + (int64_t)b * MB,
             h / (NH / NKV), NKV, P, context_lens[b] - 1, scale);
}

// Launchers check what the kernels assume; a violation is a bug in the caller (ModelRunner), not a user
// error.
static void check_attention_shapes(const char* who, int NH, int NKV, int P) {
  INTERNAL_CHECK(NKV > 0 && NH % NKV == 0, "%s: NH=%d is not a multiple of NKV=%d", who, NH, NKV);
  INTERNAL_CHECK(P >= 16 && P <= 256 && (P & (P - 1)) == 0,
                 "%s: block size P=%d must be a power of two in 16..256", who, P);
}

// out: bf16 [T, NH*D]; qkv: bf16 [T, (NH+2NKV)*D]; cache: bf16 [NB, NKV, P, D] each;
// cu_seqlens_q: int [B+1] (device); seqlens_k: int [B] (device, keys of sequence b including this step's);
// block_tables: int [B, MB] (device); max_seqlen_q: the largest q_len (host). scale = 1/sqrt(D).
static void attention_prefill(bf16* out, const bf16* qkv, const KVLayer& cache, const int* cu_seqlens_q,
                              const int* seqlens_k, const int* block_tables, int B, int max_seqlen_q, int NH,
                              int NKV, int P, int MB, float scale, cudaStream_t stream) {
  check_attention_shapes("attention_prefill", NH, NKV, P);
  if (B == 0 || max_seqlen_q == 0) return;
  dim3 grid(B, NH, cdiv(max_seqlen_q, ATTN_ROWS_PER_BLOCK));
  attention_prefill_kernel<<<grid, ATTN_ROWS_PER_BLOCK * 32, 0, stream>>>(
      out, qkv, cache.k, cache.v, cu_seqlens_q, seqlens_k, block_tables, NH, NKV, P, MB, scale);
  CUDA_CHECK(cudaGetLastError());
}

// out: bf16 [B, NH*D]; qkv: bf16 [B, (NH+2NKV)*D]; cache as above; context_lens: int [B] (device, keys
// including the current token, at least 1); block_tables: int [B, MB] (device).
static void attention_decode(bf16* out, const bf16* qkv, const KVLayer& cache, const int* context_lens,
                             const int* block_tables, int B, int NH, int NKV, int P, int MB, float scale,
                             cudaStream_t stream) {
  check_attention_shapes("attention_decode", NH, NKV, P);
  if (B == 0) return;
  dim3 grid(B, cdiv(NH, ATTN_ROWS_PER_BLOCK));
  attention_decode_kernel<<<grid, ATTN_ROWS_PER_BLOCK * 32, 0, stream>>>(
      out, qkv, cache.k, cache.v, context_lens, block_tables, NH, NKV, P, MB, scale);
  CUDA_CHECK(cudaGetLastError());
}

// ==== 9. Sampler: greedy, temperature, top-k, min-p, top-p =================================================
// defines: SamplingSlot, SAMPLE_THREADS, philox4x32_10, gumbel_noise, scaled_logit, min_p_keeps, fixed_mass,
//          sample_kept_reference, sample_reference, ScoredToken, outranks, block_reduce, Plus, Larger, Top,
//          bitonic_compare_exchange, block_sort_descending, sample_sort_workspace_bytes, sample, LogitEdit,
//          logit_edits_of, logit_edits_reference, logit_edits, logprobs_reference, compute_logprobs
//
// What the sampler computes, per sequence b (one row of logits [V], fp32), with z_i = logit_i / temperature:
//   temperature == 0            greedy: the argmax (lowest index on ties)
//   otherwise                   a draw from softmax(z), optionally restricted:
//     top_k in (0, V)           ... to the k largest z                          (keep set S_k)
//     min_p in (0, 1]           ... and to the tokens at least min_p times as likely as the most likely
//     top_p in (0, 1)           ... then to the smallest set of the most likely tokens of what is left whose
//                                   probability (renormalised over it) sums to >= top_p   (S_p)
//   vLLM's order: min_p and top-k (both keep the largest values, so in either order the kept set is the
//   smaller of the two), then top-p on what is left. A token tied with the last one a cut keeps is kept too.
//
// The Gumbel-max trick. nano-vllm samples with
//     probs = softmax(logits / T);  token = argmax(probs / Exponential(1) noise)
// which is an exact categorical draw in one pass, without a cumulative sum. Taking logs, dividing by
// E_i ~ Exp(1) is adding G_i = -log(E_i) = -log(-log U_i), a standard Gumbel variable, and the softmax
// normalisation is a constant shift that cannot change an argmax:
//     token = argmax_i ( logit_i / T + G_i )       P(token = i) = exp(logit_i/T) / sum_j exp(logit_j/T)
// so a draw costs one read of the row, no exp, no sum and no max-subtraction. Restricting the draw to a
// kept set S is the same argmax taken over S only (renormalising a distribution does not change the ratios
// between the kept tokens).
//
// Where the noise comes from: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
// 3", SC 2011), a counter-based generator: 10 rounds of multiply-and-xor scramble a 128-bit counter
// under a 64-bit key into 4 random 32-bit words. No state is stored anywhere; the noise of token i is a
// pure function of (seed, offset, i):
//     key = seed,  counter = (i / 4, 0, offset_lo, offset_hi),  word i % 4 of the output
// The engine sets seed per request and offset = that request's step index, so a request's draws do not
// depend on which batch it ran in, on its row in the batch, or on the other requests' settings.
//
// The kept set, by sorting (what vLLM's apply_top_k_top_p does too). Every cut keeps the most likely tokens
// and all the tokens tied with its last one, so the kept set is always "every token with z_i >= tau" for
// one threshold tau, a value of the row. One thread block per row copies the row's z to a scratch row,
// sorts it largest first, and reads tau off the sorted values s_0 >= s_1 >= ... >= s_{V-1}:
//   top-k   tau = s_{k-1}, the k-th largest
//   min-p   p_i >= min_p * p_max  is  z_i - m >= log(min_p), with m = s_0; the values it keeps are a prefix
//   top-p   over the prefix s_0 .. s_{n-1} that top-k and min-p keep: with w_j the probability of s_j,
//           tau = s_j for the first j at which w_0 + ... + w_j reaches top_p * (w_0 + ... + w_{n-1})
// Then the draw: the argmax of z_i + G_i over the tokens with z_i >= tau.
// The probabilities w_j are counted in integers: w = exp(z - m) scaled by 2^32 and rounded (m = the row max,
// so w <= 2^32 and a row of them sums to well under 2^64). Integer sums are exact in any order, so the cut
// does not depend on how the threads split a sum, and the samplers of sections 21 and 22, which add the same
// integers in other orders, find the same tau and draw the same token. A term below 2^-32 of the top token counts as
// zero (a relative error below V * 2^-32 < 4e-5).
// NaN logits never win and are never kept (they count as -inf). A temperature <= 0 means greedy.
//
// The sort is Batcher's bitonic sort, in the form where every compare-exchange puts the larger value first.
// With n2 = V rounded up to a power of two, for k = 2, 4, ..., n2 it merges sorted runs of k/2 into sorted
// runs of k: each position i in the lower half of a run of k is compared with its mirror image i ^ (k-1)
// in the upper half, then with i ^ j for j = k/4, ..., 2, 1. The pairs of one step are disjoint, so the
// thread block's threads take them in parallel, with a barrier between steps. A position past the row's end
// counts as -inf: it is always the second of its pair, and nothing larger moves to it.
// What it costs: a row without a cut (greedy, or temperature alone) is read once. A row with a cut is also
// sorted, in log2(n2) * (log2(n2) + 1) / 2 steps each touching the whole scratch row (171 for V = 151,936),
// and needs that scratch row: V floats per sequence (sample_sort_workspace_bytes). Section 21 finds the same
// tau without sorting, by counting passes over the row.

struct SamplingSlot {                // one per sequence in the step (device array [B])
  float temperature;                 // 0 = greedy
  int top_k;                         // <= 0 or >= V: off
  float top_p;                       // >= 1: off
  float min_p;                       // <= 0: off
  unsigned long long seed;           // Philox key: one per request
  unsigned long long offset;         // Philox counter high half: the request's step index
  // Read by section 9b only: the penalties, and how many top alternatives the log-probabilities list
  // (-1: no log-probabilities for this row).
  float repetition_penalty, frequency_penalty, presence_penalty;
  int logprobs;
};
static_assert(sizeof(SamplingSlot) == 48, "SamplingSlot is copied to the GPU as-is");

constexpr int SAMPLE_THREADS = 1024;  // threads of a sampler thread block (sections 9, 9b and 21)

// Philox4x32-10 (Random123's constants). __host__ so the tests reproduce every draw on the CPU.
__host__ __device__ inline uint4 philox4x32_10(uint4 ctr, uint2 key) {
  const uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;  // round multipliers
  const uint32_t W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;  // key schedule (golden ratio, sqrt(3) - 1)
  for (int round = 0; round < 10; round++) {
    uint64_t p0 = (uint64_t)M0 * ctr.x, p1 = (uint64_t)M1 * ctr.z;
    ctr = make_uint4((uint32_t)(p1 >> 32) ^ ctr.y ^ key.x, (uint32_t)p1,
                     (uint32_t)(p0 >> 32) ^ ctr.w ^ key.y, (uint32_t)p0);
    key.x += W0;
    key.y += W1;
  }
  return ctr;
}
// The 4 random words that serve tokens 4g .. 4g+3 of a row.
__host__ __device__ inline uint4 philox_group(unsigned long long seed, unsigned long long offset,
                                              uint32_t g) {
  return philox4x32_10(make_uint4(g, 0u, (uint32_t)offset, (uint32_t)(offset >> 32)),
                       make_uint2((uint32_t)seed, (uint32_t)(seed >> 32)));
}
__host__ __device__ inline uint32_t uint4_word(const uint4& r, int j) {
  return j == 0 ? r.x : j == 1 ? r.y : j == 2 ? r.z : r.w;
}
// A standard Gumbel variable from 32 random bits: U uses the top 23 bits and sits strictly inside (0, 1)
// (U = (n + 0.5) / 2^23, both ends exactly representable), so neither log can see 0. The inner logf is
// the accurate one on purpose: the winners are the U close to 1, where -log(U) is tiny and __logf would
// lose it entirely. The outer log's argument lies in [6e-8, 16.7], where the hardware __logf is good to
// ~1e-6 absolute: far below anything a sample can notice, and it is a third of the fast path's work.
__host__ __device__ inline float gumbel_from_bits(uint32_t bits) {
  float u = ((float)(bits >> 9) + 0.5f) * (1.0f / 8388608.0f);
#ifdef __CUDA_ARCH__
  return -__logf(-logf(u));
#else
  return -logf(-logf(u));
#endif
}
__host__ __device__ inline float gumbel_noise(unsigned long long seed, unsigned long long offset,
                                              uint32_t i) {
  return gumbel_from_bits(uint4_word(philox_group(seed, offset, i / 4), i % 4));
}

// The value every path compares: logit / T, computed as logit * (1/T) (one rounding, identical on the
// CPU reference), with NaN -> -inf and -0 -> +0 (adding +0.0f), so that equal values compare equal
// whichever way a path compares them.
__host__ __device__ inline float scaled_logit(float logit, float inv_temp) {
  float z = logit * inv_temp + 0.0f;
  return z != z ? -INFINITY : z;
}
// min-p keeps z when z - m >= log(min_p) (m = the row's largest z). The top value is always kept, also when
// m is infinite and z - m is NaN.
__host__ __device__ inline bool min_p_keeps(float z, float m, float log_min_p) {
  return z == m || z - m >= log_min_p;
}
// Probability of a token relative to the row max m, in units of 2^-32 (the integers above).
__device__ inline unsigned long long fixed_mass(float z, float m) {
  return z == m ? (1ull << 32) : (unsigned long long)__float2ull_rn(expf(z - m) * 4294967296.0f);
}

// What the sampler computes, on the CPU, by the textbook definitions: the kept set (keep [V]) by sorting,
// with top-p's target moved by top_p_slack (the probabilities here are exp in double, the GPU's are expf in
// 2^-32 fixed point, so a test brackets the GPU's kept set between slack -1e-5 and +1e-5); then the draw
// from the kept set (the Gumbel argmax with the same Philox noise). *margin: the gap between the winner and
// the runner-up (a gap below float noise makes a comparison with the GPU meaningless).
static std::vector<char> sample_kept_reference(const float* logits, int V, const SamplingSlot& s,
                                               double top_p_slack) {
  std::vector<char> keep(V, 1);
  if (!(s.temperature > 0.f)) return keep;
  const float inv = 1.f / s.temperature;
  std::vector<float> z(V);
  for (int i = 0; i < V; i++) z[i] = scaled_logit(logits[i], inv);
  if (s.top_k > 0 && s.top_k < V) {  // the k largest (ties at the cut all kept)
    std::vector<float> sorted = z;
    std::nth_element(sorted.begin(), sorted.begin() + (s.top_k - 1), sorted.end(), std::greater<float>());
    for (int i = 0; i < V; i++) keep[i] = z[i] >= sorted[s.top_k - 1];
  }
  if (s.min_p > 0.f) {  // p_i >= min_p * p_max, as z_i - max(z) >= log(min_p)
    const float m = *std::max_element(z.begin(), z.end());
    for (int i = 0; i < V; i++) keep[i] = keep[i] && min_p_keeps(z[i], m, logf(s.min_p));
  }
  if (s.top_p < 1.f) {  // then the most likely of those until their probability reaches top_p
    std::vector<int> idx;
    for (int i = 0; i < V; i++)
      if (keep[i]) idx.push_back(i);
    std::sort(idx.begin(), idx.end(), [&](int a, int b) { return z[a] > z[b]; });
    const double m = z[idx[0]];
    double total = 0, cum = 0;
    for (int i : idx) total += z[i] == m ? 1.0 : exp((double)z[i] - m);
    const double target = std::min(1.0, std::max(0.0, s.top_p + top_p_slack)) * total;
    float tau = z[idx.back()];
    for (int i : idx) {
      cum += z[i] == m ? 1.0 : exp((double)z[i] - m);
      if (cum >= target) {
        tau = z[i];
        break;
      }
    }
    for (int i = 0; i < V; i++) keep[i] = keep[i] && z[i] >= tau;
  }
  return keep;
}

// A token in the running for the draw, and the order the draw picks by: a larger value outranks a smaller
// one, and of two equal values the lower index outranks (index -1 stands for no token: everything outranks it).
struct ScoredToken {
  float value;
  int index;
};
__host__ __device__ inline bool outranks(const ScoredToken& a, const ScoredToken& b) {
  return a.index >= 0 && (b.index < 0 || a.value > b.value || (a.value == b.value && a.index < b.index));
}

static int sample_reference(const float* logits, int V, const SamplingSlot& s, const std::vector<char>& keep,
                            double* margin) {
  const bool greedy = !(s.temperature > 0.f);
  const float inv = greedy ? 1.f : 1.f / s.temperature;
  ScoredToken best{0.f, -1};
  float v1 = -INFINITY, v2 = -INFINITY;
  for (int i = 0; i < V; i++) {
    if (!keep[i]) continue;
    const float v = scaled_logit(logits[i], inv) + (greedy ? 0.f : gumbel_noise(s.seed, s.offset, (uint32_t)i));
    if (outranks({v, i}, best)) best = {v, i};
    if (v > v1) v2 = v1, v1 = v;
    else if (v > v2) v2 = v;
  }
  *margin = greedy ? INFINITY : (double)v1 - v2;
  return best.index >= 0 ? best.index : 0;
}

// op(v of every thread of the block), with op one of the three below; every thread gets the
// result. A warp combines its 32 values by shuffles, then the warps' results meet in scratch (32 values of
// shared memory; the leading barrier lets the caller reuse it at once). blockDim.x: a multiple of 32.
__device__ inline float shfl_xor(float v, int lane_mask) { return __shfl_xor_sync(0xffffffffu, v, lane_mask); }
__device__ inline unsigned long long shfl_xor(unsigned long long v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}
__device__ inline ScoredToken shfl_xor(ScoredToken t, int lane_mask) {
  return {shfl_xor(t.value, lane_mask), __shfl_xor_sync(0xffffffffu, t.index, lane_mask)};
}
template <class T, class Op>
__device__ T block_reduce(T v, Op op, T* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, shfl_xor(v, o));
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[0];
  for (int w = 1; w < (int)blockDim.x / 32; w++) v = op(v, scratch[w]);
  return v;
}
// block_reduce's ops: the sum, the larger, and the token that outranks.
struct Plus {
  template <class T> __device__ T operator()(T a, T b) const { return a + b; }
};
struct Larger {
  template <class T> __device__ T operator()(T a, T b) const { return a > b ? a : b; }
};
struct Top {
  __device__ ScoredToken operator()(ScoredToken a, ScoredToken b) const { return outranks(b, a) ? b : a; }
};

// One compare-exchange of the bitonic sort (see the section comment): step (k, j) at position i of
// keys[0 .. n). __host__ so a test can run the whole sort on the CPU.
__host__ __device__ inline void bitonic_compare_exchange(float* keys, int n, int k, int j, int i) {
  const int partner = j == k / 2 ? i ^ (k - 1) : i ^ j;
  if (partner > i && partner < n && keys[partner] > keys[i]) {
    const float t = keys[i];
    keys[i] = keys[partner];
    keys[partner] = t;
  }
}
// keys[0 .. n), sorted largest first by the calling thread block (all of its threads call it).
__device__ void block_sort_descending(float* keys, int n) {
  int n2 = 1;
  while (n2 < n) n2 *= 2;
  for (int k = 2; k <= n2; k *= 2)
    for (int j = k / 2; j >= 1; j /= 2) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) bitonic_compare_exchange(keys, n, k, j, i);
      __syncthreads();
    }
}

// top-p's cut over the sorted prefix [0, n): with total = w(0) + ... + w(n-1) and target = ceil(top_p * total)
// (at least 1, at most total), the first j at which w(0) + ... + w(j) reaches target. Every thread gets j.
// Each thread adds up a contiguous piece of [0, n); a running sum over the pieces (within a warp by
// shuffles, then over the warps' totals) tells each thread the mass before its piece, and the one thread
// whose piece holds the crossing walks it. scratch: 32 words of shared memory.
template <class Mass>
__device__ int block_top_p_cut(int n, float top_p, Mass w, unsigned long long* scratch) {
  __shared__ int cut;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int per = (n + blockDim.x - 1) / blockDim.x;
  const int begin = min(n, (int)threadIdx.x * per), end = min(n, begin + per);
  unsigned long long mine = 0;
  for (int j = begin; j < end; j++) mine += w(j);
  unsigned long long upto = mine;  // this piece and the pieces before it in the warp
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long u = __shfl_up_sync(0xffffffffu, upto, o);
    if (lane >= o) upto += u;
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = upto;
  __syncthreads();
  unsigned long long before = upto - mine, total = 0;
  for (int v = 0; v < (int)blockDim.x / 32; v++) {
    if (v < warp) before += scratch[v];
    total += scratch[v];
  }
  unsigned long long target = (unsigned long long)ceil((double)top_p * (double)total);
  target = min(max(target, 1ull), total);
  if (before < target && target <= before + mine) {
    unsigned long long sum = before + w(begin);
    int j = begin;
    while (sum < target) sum += w(++j);
    cut = j;
  }
  __syncthreads();
  return cut;
}

// sample_kernel — one token per sequence (nano-vllm: layers/sampler.py Sampler.forward, plus greedy and the
// cuts). Reads logits [B, V] fp32 and slots [B]; writes out_tokens [B]; sorted [B, V] fp32 is scratch (row b
// only where sequence b asks for a cut). One thread block per row; threads stride over the row, so every
// pass over it is coalesced.
//   1. tau, the smallest kept value (-inf: no cut): the row's z sorted, then read off as the section comment
//      says;
//   2. the draw: the top (z_i + G_i, i) over the tokens with z_i >= tau (greedy: the top (z_i, i)).
__global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_kernel(int* out_tokens, const float* logits, const SamplingSlot* slots, float* sorted, int V) {
  __shared__ unsigned long long sum_scratch[32];
  __shared__ ScoredToken top_scratch[32];
  const float* row = logits + (int64_t)blockIdx.x * V;
  const SamplingSlot slot = slots[blockIdx.x];
  const bool greedy = !(slot.temperature > 0.f);
  const float inv_temp = greedy ? 1.f : 1.f / slot.temperature;
  const bool use_top_k = !greedy && slot.top_k > 0 && slot.top_k < V;
  const bool use_min_p = !greedy && slot.min_p > 0.f;
  const bool use_top_p = !greedy && slot.top_p < 1.f;
  float tau = -INFINITY;
  if (use_top_k || use_min_p || use_top_p) {
    float* s = sorted + (int64_t)blockIdx.x * V;  // this row's z, sorted in place
    for (int i = threadIdx.x; i < V; i += blockDim.x) s[i] = scaled_logit(row[i], inv_temp);
    __syncthreads();
    block_sort_descending(s, V);
    const float m = s[0], kth = use_top_k ? s[slot.top_k - 1] : -INFINITY;
    const float log_min_p = use_min_p ? logf(slot.min_p) : 0.f;
    unsigned long long n = 0;  // how many values top-k and min-p keep: a prefix of s
    for (int j = threadIdx.x; j < V; j += blockDim.x)
      n += s[j] >= kth && (!use_min_p || min_p_keeps(s[j], m, log_min_p));
    n = block_reduce(n, Plus(), sum_scratch);
    int last = (int)n - 1;  // where tau sits in s
    auto mass = [&](int j) { return fixed_mass(s[j], m); };
    if (use_top_p) last = block_top_p_cut((int)n, slot.top_p, mass, sum_scratch);
    tau = s[last];
  }
  ScoredToken best{0.f, -1};
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const float z = scaled_logit(row[i], inv_temp);
    if (z < tau) continue;
    const ScoredToken t{greedy ? z : z + gumbel_noise(slot.seed, slot.offset, (uint32_t)i), i};
    if (outranks(t, best)) best = t;
  }
  best = block_reduce(best, Top(), top_scratch);
  if (threadIdx.x == 0) out_tokens[blockIdx.x] = best.index >= 0 ? best.index : 0;
}
// The scratch sample sorts rows in: V floats per sequence.
size_t sample_sort_workspace_bytes(int B, int V) { return (size_t)B * V * sizeof(float); }
// logits [B, V] fp32, slots [B], out_tokens [B], all on the device. workspace: at least
// sample_sort_workspace_bytes(B, V) bytes of device memory (scratch: no initialisation needed).
void sample(int* out_tokens, const float* logits, const SamplingSlot* slots, int B, int V, void* workspace,
            size_t workspace_bytes, cudaStream_t stream) {
  INTERNAL_CHECK(V > 0 && V < 2000000, "sample: V = %d outside 1 .. 2,000,000", V);
  INTERNAL_CHECK(workspace_bytes >= sample_sort_workspace_bytes(B, V),
                 "sample: workspace of %zu bytes, need sample_sort_workspace_bytes(%d, %d) = %zu", workspace_bytes, B,
                 V, sample_sort_workspace_bytes(B, V));
  if (B == 0) return;
  sample_kernel<<<B, SAMPLE_THREADS, 0, stream>>>(out_tokens, logits, slots, static_cast<float*>(workspace), V);
  CUDA_CHECK(cudaGetLastError());
}

// ---- 9b. Penalties, banned tokens and log-probabilities ------------------------------------------------
//
// Requests may ask for more than a draw (vLLM's SamplingParams, section 2). Two kinds of work surround the
// sampler, and only a step whose batch asks for them runs them (ModelRunner::process_and_sample):
//
// Before the draw, logit edits. Each touches a few tokens of a row, so the host sends a short list per row
// (CSR: row b owns edits[edit_start[b] .. edit_start[b+1])), one entry per distinct token:
//   banned (min_tokens not reached; the token is an EOS id or a stop_token_id)   logit = -inf
//   otherwise, with c = times the token is in the output so far:
//     repetition_penalty r, if the token is in the prompt or c > 0   logit = logit > 0 ? logit / r : logit * r
//     frequency_penalty f                                            logit -= f * c
//     presence_penalty p                                             logit -= p * (c > 0)
// (vLLM's apply_penalties, in its order; HF's repetition rule.) Then the sampler of section 9 draws from
// the edited row with the row's temperature, top-k, min_p and top-p.
//
// After the draw, log-probabilities. vLLM V1 reports them from the raw model logits, before any edit and
// before temperature (logprobs_mode raw_logprobs), and so do we: the edit kernel saves the value it
// overwrites and a second kernel puts it back once the token is drawn. Then per row asking for N:
//   lse = logsumexp(logits)                        (max first, so exp never overflows)
//   logprob(token) = logit[token] - lse,  rank = 1 + #{i : logit_i > logit[token]}
//   the N largest logits (ties: lowest id), each minus lse.
// NaN logits count as -inf, as in the sampler.

constexpr int EDIT_BANNED = 1, EDIT_IN_PROMPT = 2;
struct LogitEdit {     // one distinct token of one row (device array [E], rows' entries contiguous)
  int token;
  int output_count;    // c: times the token is in the output so far
  int flags;           // EDIT_BANNED | EDIT_IN_PROMPT
};

// The new value of one logit under one edit: what the kernel below and the CPU reference both compute, to
// the bit. (The products are rounded on their own, __fmul_rn on the GPU: a fused multiply-add there would
// round once where the CPU rounds twice.)
__host__ __device__ inline float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
__host__ __device__ inline float edited_logit(float x, const LogitEdit& e, const SamplingSlot& s) {
  if (e.flags & EDIT_BANNED) return -INFINITY;
  if (s.repetition_penalty != 1.f && ((e.flags & EDIT_IN_PROMPT) || e.output_count > 0))
    x = x > 0.f ? x / s.repetition_penalty : mul_rn(x, s.repetition_penalty);
  x -= mul_rn(s.frequency_penalty, (float)e.output_count);
  x -= e.output_count > 0 ? s.presence_penalty : 0.f;
  return x;
}

// The edits of one sequence's row, appended to `out`: its token counts (with a penalty), then its banned
// tokens (before min_tokens: the EOS ids and the stop_token_ids; vLLM bans both even with ignore_eos), one
// entry per distinct token.
static void logit_edits_of(const Sequence& seq, const std::vector<int>& eos, std::vector<LogitEdit>& out) {
  const size_t first = out.size();
  for (size_t k = 0; k < seq.token_counts.size(); k++)
    out.push_back({seq.token_counts[k].first, seq.token_counts[k].second,
                   (int)k < seq.num_prompt_distinct ? EDIT_IN_PROMPT : 0});
  if (seq.num_completion_tokens() >= seq.params.min_tokens) return;
  auto ban = [&](int t) {
    auto it = seq.token_count_at.find(t);
    if (it != seq.token_count_at.end()) {
      out[first + it->second].flags |= EDIT_BANNED;
      return;
    }
    for (size_t e = first + seq.token_counts.size(); e < out.size(); e++)
      if (out[e].token == t) return;  // listed twice (an EOS id among the stop ids)
    out.push_back({t, 0, EDIT_BANNED});
  };
  for (int t : eos) ban(t);
  for (int t : seq.params.stop_token_ids) ban(t);
}

// What the two kernels below compute, on the CPU: a row's edits in place, and a row's log-probabilities
// (sums in double; the GPU's in float, so a test compares them with a tolerance).
static void logit_edits_reference(float* row, const LogitEdit* edits, int num_edits, const SamplingSlot& s) {
  for (int e = 0; e < num_edits; e++) row[edits[e].token] = edited_logit(row[edits[e].token], edits[e], s);
}
static TokenLogprobs logprobs_reference(const float* row, int V, int token, int N) {
  std::vector<std::pair<float, int>> x(V);
  double m = -INFINITY;
  for (int i = 0; i < V; i++) x[i] = {scaled_logit(row[i], 1.f), i}, m = std::max(m, (double)x[i].first);
  double sum = 0;
  for (auto& [v, i] : x) sum += std::exp((double)v - m);
  const double lse = m + std::log(sum);
  TokenLogprobs o{};
  o.logprob = (float)(x[token].first - lse);
  o.rank = 1;
  for (auto& [v, i] : x) o.rank += v > x[token].first;
  o.num_top = N;
  std::partial_sort(x.begin(), x.begin() + N, x.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;  // larger, then the lower id
  });
  for (int k = 0; k < N; k++) o.top_ids[k] = x[k].second, o.top_logprobs[k] = (float)(x[k].first - lse);
  return o;
}

// apply_logit_edits_kernel — logits [B, V] fp32 edited in place; saved [E] receives each old value.
// One thread block per row, its threads striding over the row's edits (distinct tokens: no two threads
// write one logit). restore_logit_edits_kernel writes saved back: the same grid, the same entries.
__global__ void apply_logit_edits_kernel(float* logits, int V, const LogitEdit* edits, const int* edit_start,
                                         const SamplingSlot* slots, float* saved) {
  float* row = logits + (int64_t)blockIdx.x * V;
  const SamplingSlot slot = slots[blockIdx.x];
  for (int e = edit_start[blockIdx.x] + threadIdx.x; e < edit_start[blockIdx.x + 1]; e += blockDim.x) {
    const float x = row[edits[e].token];
    saved[e] = x;
    row[edits[e].token] = edited_logit(x, edits[e], slot);
  }
}
__global__ void restore_logit_edits_kernel(float* logits, int V, const LogitEdit* edits, const int* edit_start,
                                           const float* saved) {
  float* row = logits + (int64_t)blockIdx.x * V;
  for (int e = edit_start[blockIdx.x] + threadIdx.x; e < edit_start[blockIdx.x + 1]; e += blockDim.x)
    row[edits[e].token] = saved[e];
}
// edits [E], edit_start [B+1], saved [E] on the device; restore = false edits, true puts the values back.
static void logit_edits(bool restore, float* logits, int B, int V, const LogitEdit* edits, const int* edit_start,
                        const SamplingSlot* slots, float* saved, cudaStream_t stream) {
  if (B == 0) return;
  if (restore) restore_logit_edits_kernel<<<B, 256, 0, stream>>>(logits, V, edits, edit_start, saved);
  else apply_logit_edits_kernel<<<B, 256, 0, stream>>>(logits, V, edits, edit_start, slots, saved);
  CUDA_CHECK(cudaGetLastError());
}

// logprobs_kernel — for each row b with slots[b].logprobs = N >= 0: out[b] from logits [B, V] (the raw ones)
// and tokens [B] (the drawn ones). One thread block of SAMPLE_THREADS per row: a pass for the max, one for the
// sum of exponentials and the sampled token's rank, then N passes, each the top (value, id) of those the
// previous pass's winner outranks (section 9's order: the larger value, then the lower id).
__global__ void __launch_bounds__(SAMPLE_THREADS)
    logprobs_kernel(TokenLogprobs* out, const float* logits, const int* tokens, const SamplingSlot* slots, int V) {
  __shared__ float float_scratch[32];
  __shared__ unsigned long long count_scratch[32];
  __shared__ ScoredToken top_scratch[32];
  const int N = slots[blockIdx.x].logprobs;
  if (N < 0) return;
  const float* row = logits + (int64_t)blockIdx.x * V;
  auto x_of = [&](int i) { return scaled_logit(row[i], 1.f); };  // NaN -> -inf
  float m = -INFINITY;
  for (int i = threadIdx.x; i < V; i += blockDim.x) m = fmaxf(m, x_of(i));
  m = block_reduce(m, Larger(), float_scratch);
  const int token = tokens[blockIdx.x];
  const float x_token = x_of(token);
  float sum = 0.f;
  unsigned long long above = 0;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const float x = x_of(i);
    sum += m == -INFINITY ? 1.f : expf(x - m);
    above += x > x_token;
  }
  sum = block_reduce(sum, Plus(), float_scratch);
  above = block_reduce(above, Plus(), count_scratch);
  const float lse = m == -INFINITY ? -INFINITY : m + logf(sum);
  TokenLogprobs& o = out[blockIdx.x];
  if (threadIdx.x == 0) o.logprob = x_token - lse, o.rank = 1 + (int)above, o.num_top = N;
  ScoredToken prev{0.f, -1};
  for (int k = 0; k < N; k++) {
    ScoredToken best{0.f, -1};
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
      const ScoredToken t{x_of(i), i};
      if ((k == 0 || outranks(prev, t)) && outranks(t, best)) best = t;
    }
    prev = block_reduce(best, Top(), top_scratch);
    if (threadIdx.x == 0) o.top_ids[k] = prev.index, o.top_logprobs[k] = prev.value - lse;
  }
}
// out [B], logits [B, V], tokens [B], slots [B] on the device; rows with slots[b].logprobs < 0 are skipped.
static void compute_logprobs(TokenLogprobs* out, const float* logits, const int* tokens, const SamplingSlot* slots,
                             int B, int V, cudaStream_t stream) {
  if (B == 0) return;
  logprobs_kernel<<<B, SAMPLE_THREADS, 0, stream>>>(out, logits, tokens, slots, V);
  CUDA_CHECK(cudaGetLastError());
}

// ==== 10. Matrix products with cuBLASLt ====================================================================
// defines: Gemm, linear, linear_reference, MOE_TILE, MOE_TILE_MAX, MOE_MAX_EXPERTS, MOE_MAX_TOPK, moe_rows_max,
//          moe_rows_alloc, moe_ranks_before, moe_route_reference, moe_route, moe_align_reference, moe_align,
//          moe_matmul, moe_experts_reference, moe_combine, moe_allocate, moe_experts, moe_mlp
//
// Every linear layer is y = x @ W^T with x [M, K] (M tokens) and W [N, K] in PyTorch's row-major [out, in]
// layout. cuBLASLt thinks in column-major, where a row-major [M, N] matrix is the column-major [N, M] one,
// so we ask it for  y^T [N, M] = W [N, K] (i.e. column-major K x N, transposed) * x^T (column-major K x M):
// transa = T, transb = N, m = N, n = M, k = K. bf16 inputs, fp32 accumulation, bf16 (or fp32 for logits) out.
//
// Choosing an algorithm costs tens of microseconds, so it is done once per (M, N, K, output type) and cached;
// a CUDA graph captures the chosen algorithm and the one preallocated workspace.

// What every matrix product computes, on the CPU: y [M, N] = x [M, K] @ W [N, K]^T in double, rounded to
// bf16 (x and W hold bf16 values as float).
static void linear_reference(float* y, const float* x, const float* W, int M, int N, int K) {
  for (int m = 0; m < M; m++)
    for (int n = 0; n < N; n++) {
      double acc = 0;
      for (int k = 0; k < K; k++) acc += (double)x[(size_t)m * K + k] * W[(size_t)n * K + k];
      y[(size_t)m * N + n] = bf16_round((float)acc);
    }
}

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
    CUBLAS_CHECK(cublasLtMatmul(handle, p.desc, &alpha, W, p.a, x, p.b, &beta, y, p.c, y, p.c, &p.algo,
                                workspace, workspace_bytes, stream));
  }
};

// A linear layer without bias (nano-vllm: layers/linear.py, F.linear(x, W)): y [M, N] = x [M, K] @ W^T.
static void linear(Gemm& gemm, void* y, const bf16* x, const bf16* W, int M, int N, int K, cudaStream_t stream,
                   cudaDataType out_type) {
  gemm.run(y, x, W, M, N, K, stream, out_type);
}


// ---- 10b. A mixture of experts (Qwen3-MoE): the router, each expert's rows, their products ---------------
//
// Qwen3-30B-A3B and Qwen3-235B-A22B (Qwen3MoeForCausalLM; nano-vllm has no MoE model, vLLM's is
// qwen3_moe.py with FusedMoE) replace the MLP of their layers with a mixture of experts: E small MLPs
// ("experts", each of intermediate size IE) and a router that sends each token to k of them. As transformers
// computes it (modeling_qwen3_moe.py, Qwen3MoeTopKRouter and Qwen3MoeExperts), for the normed rows x [T, H]:
//
//   logits = x @ Wr^T                      [T, E]  the router: mlp.gate.weight [E, H], no bias
//   p      = softmax(logits), in fp32       over all E experts
//   ids, w = the k largest p               [T, k]  and their indices (torch.topk)
//   w      = w / sum(w)                     only when norm_topk_prob (the released models set it)
//   h[t]   = sum over j of w[t,j] * down_e(SiLU(gate_e(x[t])) * up_e(x[t])),   e = ids[t,j]
//
// Which layers: ModelConfig::is_moe_layer (section 2); the others keep a dense MLP. In Qwen3-30B-A3B every
// one of its 48 layers has 128 experts of IE = 768, k = 8: a token computes 3.3B of the 30.5B parameters.
//
// The plain way, in four steps. The catch is that how many rows each expert gets is known only on the GPU,
// after the router ran, and cuBLASLt takes a product's sizes from the host. Reading them back would end the
// CUDA graph of a decode step (section 11) at every layer, so every step below is a fixed amount of work
// for a step of T tokens (a host value), and a step with MoE layers is captured and replayed like any other:
//   1. route     the router's product (section 10's linear, bf16 logits), then moe_route: the softmax, the
//                top-k and the weights, one warp per token;
//   2. align     moe_align lists the step's R = T*k (token, expert) pairs expert by expert, each expert's run
//                padded with empty rows to a multiple of MOE_TILE, and writes which expert each tile of
//                MOE_TILE rows belongs to (-1: a tile past the list's end). The list has at most
//                moe_rows_max(T, k, E) = R + min(E, R) * (MOE_TILE - 1) rows, rounded up to a tile. (A Part
//                II chapter lists long steps in longer tiles, up to MOE_TILE_MAX rows: the buffers are sized
//                for those, moe_rows_alloc);
//   3. products  moe_matmul with every expert's gate_up, silu_and_mul (section 7), moe_matmul with every
//                expert's down: the dense MLP's three steps, on the list's rows, over the whole buffer; each
//                thread block of moe_matmul reads its tile's expert on the GPU, an unused tile writes zeros;
//   4. combine   moe_combine: per token, its k results times their weights, added in ascending expert id.
// What that costs: moe_matmul is the textbook tiled product on the GPU's ordinary cores (a thread block per
// 16 x 16 tile of the result), not cuBLASLt, so a prefill step of many tokens computes its experts many
// times slower than a dense model's products of the same size; and up to min(E, R) * (MOE_TILE - 1) padding
// rows ride along. A decode step reads each chosen expert's weights once, as it must. Part II is where a
// faster way belongs.
//
// Where the rounding happens: where transformers 5.x's bf16 model rounds, but for one step (SiLU-and-mul):
//   * the router's logits are bf16 (F.linear in bf16); the softmax, the top-k and the renormalisation are
//     fp32, and the weights w stay fp32 into the multiply. (transformers 4.x cast them to bf16 first,
//     routing_weights.to(hidden_states.dtype): this file follows 5.x);
//   * each expert's products are rounded to bf16 like the dense MLP's (section 10), SiLU-and-mul once
//     (silu_and_mul, as the dense MLP here: transformers rounds SiLU's output first, a bf16 step apart);
//   * each weighted result is rounded to bf16, then added into the token's bf16 row one expert at a time in
//     ascending expert id, rounding after each addition: transformers' index_add_ into a bf16 zero tensor,
//     in its loop over the experts that were hit (ascending). So h = bf16(bf16(y_e1 * w_e1) + bf16(y_e2 * w_e2))
//     and so on, e1 < e2 < ..., and the result does not depend on the order the top-k lists them in.
// Ties in the top-k: torch.topk promises no order among equal values (on CUDA it has returned the higher
// index first: pytorch issue 127196); here the lower expert id wins, as a stable sort orders them
// (torch.sort(stable=True)). Only an exact tie at the k-th place changes which experts run, and exact ties
// of fp32 probabilities come from exactly equal logits.
// Tensor parallelism: each rank holds IE/tp of every expert (section 6a) and the whole router, so every rank
// routes its identical rows identically; each rank's h is a partial sum, and the all-reduce after the
// layer adds them up as it does the dense MLP's.

constexpr int MOE_TILE = 16;          // rows (and columns) of a tile of moe_matmul; an expert's run is padded to it
constexpr int MOE_TILE_MAX = 64;      // the longest tile moe_align is asked for (Part II's long steps)
constexpr int MOE_MAX_EXPERTS = 512;  // E: moe_route holds E / 32 probabilities per lane in registers
constexpr int MOE_MAX_TOPK = 32;      // k: moe_route's picks are one per lane
constexpr int MOE_ALIGN_THREADS = 256;

// Rows of the experts' list for T tokens in tiles of `tile` rows: every pair, plus at most tile - 1 padding
// rows per expert that has any, rounded up to whole tiles. The buffers hold moe_rows_alloc rows: the longest
// list any tile makes (moe_tile_expert: moe_rows_alloc / MOE_TILE entries, the most tiles any list has).
static int64_t moe_rows_max(int64_t T, int k, int E, int tile = MOE_TILE) {
  const int64_t R = T * k;
  return cdiv(R + std::min<int64_t>(E, R) * (tile - 1), tile) * tile;
}
static int64_t moe_rows_alloc(int64_t T, int k, int E) { return moe_rows_max(T, k, E, MOE_TILE_MAX); }

// Whether expert e with probability p comes before (bp, be) in the top-k order: the larger probability, and
// on a tie the lower expert id; NaN counts as -inf (a total order, so every lane of a warp agrees). An id < 0
// is "none" (a lane with no candidate left, in moe_route_row's argmax), after every expert, even one of
// probability 0 (a logit of -inf, or one that far below the largest), which must still be picked before none.
__host__ __device__ inline bool moe_ranks_before(float p, int e, float bp, int be) {
  if (be < 0) return e >= 0;
  if (e < 0) return false;
  const float a = p != p ? -INFINITY : p, b = bp != bp ? -INFINITY : bp;
  return a > b || (a == b && e < be);
}

// ---- moe_route -----------------------------------------------------------------------------------------
// What moe_route_kernel computes, on the CPU: for each token the softmax of its logits [E] (bf16 values as
// float; in double here), the k most probable experts in order (ties: lower id), their probabilities,
// divided by their sum when norm.
static void moe_route_reference(int* ids, float* weights, const float* logits, int T, int E, int k, bool norm) {
  std::vector<double> p(E);
  for (int t = 0; t < T; t++) {
    const float* l = logits + (size_t)t * E;
    const double m = *std::max_element(l, l + E);
    double sum = 0;
    for (int e = 0; e < E; e++) sum += p[e] = exp((double)l[e] - m);
    std::vector<bool> taken(E, false);
    double picked = 0;
    for (int j = 0; j < k; j++) {
      int best = -1;
      for (int e = 0; e < E; e++)
        if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;  // the first of equals: the lower id
      taken[best] = true;
      ids[(size_t)t * k + j] = best;
      weights[(size_t)t * k + j] = (float)(p[best] / sum);
      picked += p[best] / sum;
    }
    for (int j = 0; norm && j < k; j++) weights[(size_t)t * k + j] = (float)(weights[(size_t)t * k + j] / picked);
  }
}

// Replaces: Qwen3MoeTopKRouter.forward after its F.linear: softmax(logits, dtype=float32), torch.topk,
// and the division by the top-k sum.
// Reads logits [T, E] (bf16). Writes ids [T, k] (int) and weights [T, k] (fp32), most probable first.
// One warp per token; lane i holds experts i, i + 32, i + 64, ... in registers (E <= MOE_MAX_EXPERTS):
//   m = max of the logits (warp shuffles), p_e = exp(l_e - m) / sum_e' exp(l_e' - m)   (fp32)
//   k times: each lane its best expert not yet taken, then a warp argmax under moe_ranks_before; the lane
//   that holds the winner marks it taken, and lane j keeps the j-th pick
//   norm: the k picks' probabilities summed over the warp, each divided by the sum.
// Launch: 4 warps per thread block, grid ceil(T / 4). Preconditions: 1 <= k <= min(E, MOE_MAX_TOPK).
constexpr int MOE_ROUTE_SLOTS = MOE_MAX_EXPERTS / 32;
__device__ __forceinline__ float warp_max_f(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum_f(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// One token's routing by one warp: row [E] its logits, ids and weights [k] its picks (the kernel below;
// section 34's moe_route_warp computes the same bits in a fraction of the time).
__device__ __forceinline__ void moe_route_row(int* ids, float* weights, const bf16* row, int E, int k, bool norm) {
  const int lane = threadIdx.x % 32;
  float p[MOE_ROUTE_SLOTS];
  float m = -INFINITY;
#pragma unroll
  for (int s = 0; s < MOE_ROUTE_SLOTS; s++) {
    const int e = lane + 32 * s;
    p[s] = e < E ? __bfloat162float(row[e]) : -INFINITY;
    m = fmaxf(m, p[s]);
  }
  m = warp_max_f(m);
  float sum = 0.f;
#pragma unroll
  for (int s = 0; s < MOE_ROUTE_SLOTS; s++) {
    p[s] = lane + 32 * s < E ? expf(p[s] - m) : 0.f;
    sum += p[s];
  }
  sum = warp_sum_f(sum);
#pragma unroll
  for (int s = 0; s < MOE_ROUTE_SLOTS; s++) p[s] /= sum;
  unsigned taken = 0;  // bit s: this lane's expert lane + 32 s is picked
  int my_id = -1;      // lane j: the j-th pick
  float my_p = 0.f;
  for (int j = 0; j < k; j++) {
    float bp = 0.f;
    int be = -1;
#pragma unroll
    for (int s = 0; s < MOE_ROUTE_SLOTS; s++) {
      const int e = lane + 32 * s;
      if (e < E && !(taken >> s & 1) && moe_ranks_before(p[s], e, bp, be)) bp = p[s], be = e;
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float op = __shfl_xor_sync(0xffffffffu, bp, o);
      const int oe = __shfl_xor_sync(0xffffffffu, be, o);
      if (moe_ranks_before(op, oe, bp, be)) bp = op, be = oe;
    }
    if (be % 32 == lane) taken |= 1u << (be / 32);
    if (lane == j) my_id = be, my_p = bp;
  }
  const float picked = warp_sum_f(lane < k ? my_p : 0.f);
  if (lane < k) {
    ids[lane] = my_id;
    weights[lane] = norm ? my_p / picked : my_p;
  }
}
__global__ void moe_route_kernel(int* ids, float* weights, const bf16* logits, int T, int E, int k, bool norm) {
  const int64_t t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (t >= T) return;  // a whole warp
  moe_route_row(ids + t * k, weights + t * k, logits + t * E, E, k, norm);
}
static void moe_route(int* ids, float* weights, const bf16* logits, int T, int E, int k, bool norm,
                      cudaStream_t stream) {
  INTERNAL_CHECK(E >= 1 && E <= MOE_MAX_EXPERTS && k >= 1 && k <= std::min(E, MOE_MAX_TOPK),
                 "moe_route: E = %d, k = %d (at most %d experts, 1 <= k <= min(E, %d))", E, k, MOE_MAX_EXPERTS,
                 MOE_MAX_TOPK);
  if (T == 0) return;
  moe_route_kernel<<<(unsigned)cdiv(T, 4), 128, 0, stream>>>(ids, weights, logits, T, E, k, norm);
  CUDA_CHECK(cudaGetLastError());
}

// ---- moe_align -----------------------------------------------------------------------------------------
// What moe_align_kernel computes, on the CPU: the experts' list for the pairs p = t*k + j of ids [T, k].
// Expert e's run starts at the sum of the earlier runs, holds e's pairs in ascending p (token order), then -1
// up to a multiple of the tile (MOE_TILE rows, or a Part II chapter's). rows [RM]: the pair of each row (-1:
// padding; past the last run: -1 here, unwritten by the kernel); pair_row [T*k]: each pair's row; tile_expert
// [RM / tile]: each tile's expert, -1 past the last run (RM = moe_rows_max(T, k, E, tile)).
static void moe_align_reference(std::vector<int>& rows, std::vector<int>& pair_row, std::vector<int>& tile_expert,
                                const int* ids, int T, int k, int E, int tile = MOE_TILE) {
  const int R = T * k, RM = (int)moe_rows_max(T, k, E, tile);
  rows.assign(RM, -1), pair_row.assign(R, -1), tile_expert.assign(RM / tile, -1);
  int at = 0;
  for (int e = 0; e < E; e++) {
    const int start = at;
    for (int p = 0; p < R; p++)
      if (ids[p] == e) rows[at] = p, pair_row[p] = at++;
    at = (int)cdiv(at, tile) * tile;
    for (int i = start / tile; i < at / tile; i++) tile_expert[i] = e;
  }
}

// Replaces: the bookkeeping of Qwen3MoeExperts.forward (one_hot, then torch.where per expert that was hit).
// Reads ids [T, k]. Writes rows, pair_row and tile_expert as moe_align_reference says.
// One thread block per expert e, each reading all R = T*k ids:
//   1. count[e'] of every expert (shared-memory atomics: integer, so the same whatever the order);
//   2. e's run starts at start = sum over e' < e of ceil(count[e'] / tile) * tile;
//   3. e's pairs in order: the ids MOE_ALIGN_THREADS at a time, a thread's place among its chunk's matches
//      from its warp's ballot and the warps before it, after the matches of earlier chunks;
//   4. its padding rows and its tiles' entries; block 0 also marks the tiles past the last run.
// Launch: grid E, MOE_ALIGN_THREADS threads. Preconditions: 0 <= ids < E <= MOE_MAX_EXPERTS.
__global__ __launch_bounds__(MOE_ALIGN_THREADS) void moe_align_kernel(int* rows, int* pair_row, int* tile_expert,
                                                                      const int* ids, int R, int E, int tile,
                                                                      int tiles) {
  __shared__ int count[MOE_MAX_EXPERTS];
  __shared__ int warp_matches[MOE_ALIGN_THREADS / 32];
  const int e = blockIdx.x, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  for (int i = tid; i < E; i += blockDim.x) count[i] = 0;
  __syncthreads();
  for (int p = tid; p < R; p += blockDim.x) atomicAdd(&count[ids[p]], 1);
  __syncthreads();
  int start = 0, end = 0;
  for (int i = 0; i < E; i++) {
    const int run = (count[i] + tile - 1) / tile * tile;
    start += i < e ? run : 0;
    end += run;
  }
  const int n = count[e], run = (n + tile - 1) / tile * tile;
  int placed = 0;  // e's pairs in the chunks before this one
  for (int base = 0; base < R; base += blockDim.x) {
    const int p = base + tid;
    const bool match = p < R && ids[p] == e;
    const unsigned ballot = __ballot_sync(0xffffffffu, match);
    if (lane == 0) warp_matches[warp] = __popc(ballot);
    __syncthreads();
    int before = placed + __popc(ballot & ((1u << lane) - 1)), chunk = 0;
    for (int w = 0; w < (int)blockDim.x / 32; w++) {
      before += w < warp ? warp_matches[w] : 0;
      chunk += warp_matches[w];
    }
    if (match) rows[start + before] = p, pair_row[p] = start + before;
    placed += chunk;
    __syncthreads();  // warp_matches is read before the next chunk writes it
  }
  for (int i = n + tid; i < run; i += blockDim.x) rows[start + i] = -1;
  for (int i = tid; i < run / tile; i += blockDim.x) tile_expert[start / tile + i] = e;
  if (e == 0)
    for (int i = end / tile + tid; i < tiles; i += blockDim.x) tile_expert[i] = -1;
}
// rows [moe_rows_max(T, k, E, tile)], pair_row [T*k], tile_expert [moe_rows_max(T, k, E, tile) / tile]
// (device). tile: MOE_TILE (Part I), up to MOE_TILE_MAX.
static void moe_align(int* rows, int* pair_row, int* tile_expert, const int* ids, int T, int k, int E,
                      cudaStream_t stream, int tile = MOE_TILE) {
  INTERNAL_CHECK(E >= 1 && E <= MOE_MAX_EXPERTS, "moe_align: E = %d (1 to %d)", E, MOE_MAX_EXPERTS);
  INTERNAL_CHECK(tile >= MOE_TILE && tile <= MOE_TILE_MAX && tile % MOE_TILE == 0, "moe_align: tile = %d", tile);
  if (T == 0) return;
  const int tiles = (int)(moe_rows_max(T, k, E, tile) / tile);
  moe_align_kernel<<<E, MOE_ALIGN_THREADS, 0, stream>>>(rows, pair_row, tile_expert, ids, T * k, E, tile, tiles);
  CUDA_CHECK(cudaGetLastError());
}

// ---- moe_matmul ----------------------------------------------------------------------------------------
// Replaces: Qwen3MoeExperts.forward's F.linear(current_state, gate_up_proj[e]) and F.linear(..., down_proj[e])
// for every expert e that was hit, on the rows torch.where gathered for it.
// Computes, for every row r of the experts' list whose tile's expert e = tile_expert[r / MOE_TILE] >= 0:
//   y[r, :] = a_r @ W_e^T        W [E, N, K]: W_e = W + e * N * K, [N, K] like a linear's weight
// where a_r is, with gather_k > 0 (the gate_up product), row rows[r] / gather_k of a [T, K] (the token of
// pair rows[r]); with gather_k = 0 (the down product), row r of a [RM, K]; a padding row (rows[r] = -1) is
// zeros. A row of an unused tile (e = -1) is written as zeros: silu_and_mul reads the whole buffer.
// Thread block = one MOE_TILE x MOE_TILE tile of y [RM, N] (blockIdx.x: the tile of rows, blockIdx.y: of
// columns); thread (ty, tx) computes y[r0 + ty, n0 + tx]. Per step of MOE_TILE values along K the threads
// load the tile's rows of a and of W_e into shared memory, one value each, then each adds MOE_TILE products:
// every value loaded is used MOE_TILE times. fp32 accumulation along K in order, one bf16 rounding (the
// products' own order differs from cuBLASLt's, inside fp32). Preconditions: RM a multiple of MOE_TILE.
// (Its CPU reference is section 10's linear_reference on each expert's rows: moe_experts_reference, below.)
__global__ void moe_matmul_kernel(bf16* y, const bf16* a, const int* rows, const int* tile_expert, const bf16* W,
                                  int N, int K, int gather_k) {
  __shared__ float as[MOE_TILE][MOE_TILE + 1], ws[MOE_TILE][MOE_TILE + 1];  // + 1: no bank conflicts
  const int ty = threadIdx.y, tx = threadIdx.x;
  const int64_t r = (int64_t)blockIdx.x * MOE_TILE + ty;
  const int n = blockIdx.y * MOE_TILE + tx;         // this thread's column of y
  const int n_load = blockIdx.y * MOE_TILE + ty;    // the row of W_e it loads
  const int e = tile_expert[blockIdx.x];
  if (e < 0) {
    if (n < N) y[r * N + n] = __float2bfloat16(0.f);
    return;  // (the whole thread block: e is the tile's)
  }
  const int pair = rows[r];
  const int64_t a_row = pair < 0 ? -1 : gather_k > 0 ? pair / gather_k : r;
  const bf16* We = W + (int64_t)e * N * K;
  float acc = 0.f;
  for (int k0 = 0; k0 < K; k0 += MOE_TILE) {
    const int kk = k0 + tx;
    as[ty][tx] = a_row >= 0 && kk < K ? __bfloat162float(a[a_row * K + kk]) : 0.f;
    ws[ty][tx] = n_load < N && kk < K ? __bfloat162float(We[(int64_t)n_load * K + kk]) : 0.f;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < MOE_TILE; i++) acc += as[ty][i] * ws[tx][i];
    __syncthreads();
  }
  if (n < N) y[r * N + n] = __float2bfloat16(acc);
}
// y [RM, N], a [T or RM, K], W [E, N, K]; rows and tile_expert from moe_align for these RM rows.
static void moe_matmul(bf16* y, const bf16* a, const int* rows, const int* tile_expert, const bf16* W, int64_t RM,
                       int N, int K, int gather_k, cudaStream_t stream) {
  INTERNAL_CHECK(RM % MOE_TILE == 0 && N > 0 && K > 0, "moe_matmul: RM = %lld, N = %d, K = %d", (long long)RM, N, K);
  if (RM == 0) return;
  const dim3 grid((unsigned)(RM / MOE_TILE), (unsigned)cdiv(N, MOE_TILE)), block(MOE_TILE, MOE_TILE);
  moe_matmul_kernel<<<grid, block, 0, stream>>>(y, a, rows, tile_expert, W, N, K, gather_k);
  CUDA_CHECK(cudaGetLastError());
}

// ---- moe_combine, and the experts' part of a layer on the CPU ----------------------------------------------
// What moe_experts computes (the layer less its router), on the CPU, with the roundings listed above: out
// [T, H] from x [T, H], ids and weights [T, k], gate_up [E, 2*IE, H] and down [E, H, IE] (bf16 values as
// float). Per token, its experts in ascending id, each through section 7's and 10's references.
static void moe_experts_reference(float* out, const float* x, const int* ids, const float* weights,
                                  const float* gate_up, const float* down, int T, int H, int IE, int k) {
  std::vector<float> gu(2 * IE), act(IE), y(H), acc(H);
  std::vector<int> order(k);
  for (int t = 0; t < T; t++) {
    const int* id = ids + (size_t)t * k;
    for (int j = 0; j < k; j++) order[j] = j;
    std::sort(order.begin(), order.end(), [&](int a, int b) { return id[a] < id[b]; });
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int j : order) {
      linear_reference(gu.data(), x + (size_t)t * H, gate_up + (size_t)id[j] * 2 * IE * H, 1, 2 * IE, H);
      silu_and_mul_reference(act.data(), gu.data(), 1, IE);
      linear_reference(y.data(), act.data(), down + (size_t)id[j] * H * IE, 1, H, IE);
      for (int h = 0; h < H; h++) acc[h] = bf16_round(acc[h] + bf16_round(y[h] * weights[(size_t)t * k + j]));
    }
    std::copy(acc.begin(), acc.end(), out + (size_t)t * H);
  }
}

// A token's k choices in ascending expert id: order[i] = the place j in ids [k] of the i-th (insertion sort, by
// one thread; k <= MOE_MAX_TOPK). The order every sum over a token's experts is made in (section 34's too).
__host__ __device__ __forceinline__ void moe_order_by_expert(int* order, const int* ids, int k) {
  int expert[MOE_MAX_TOPK];
  for (int j = 0; j < k; j++) {
    const int e = ids[j];
    int i = j;
    for (; i > 0 && expert[i - 1] > e; i--) expert[i] = expert[i - 1], order[i] = order[i - 1];
    expert[i] = e, order[i] = j;
  }
}

// Replaces: Qwen3MoeExperts.forward's  current_hidden_states * top_k_weights[...]  and index_add_.
// Reads y [RM, H] (each pair's expert output, at its row pair_row[p]), ids and weights [T, k]. Writes out
// [T, H]: out[t] = the bf16 sum, in ascending expert id, of bf16(y[pair_row[t*k + j]] * weights[t*k + j]).
// weights null: y's rows are weighted already (section 33's down product does it), and only the sum is made.
// Thread block = one token: thread 0 orders its k pairs by expert id (moe_order_by_expert, above) into
// shared memory, then each thread takes 16-byte chunks of the row (section 7's convention).
// Preconditions: H % 8 == 0, pointers 16-byte aligned.
__global__ void moe_combine_kernel(bf16* out, const bf16* y, const int* ids, const float* weights,
                                   const int* pair_row, int H, int k) {
  __shared__ int row[MOE_MAX_TOPK];
  __shared__ float weight[MOE_MAX_TOPK];
  const int64_t t = blockIdx.x;
  if (threadIdx.x == 0) {
    int order[MOE_MAX_TOPK];
    moe_order_by_expert(order, ids + t * k, k);
    for (int i = 0; i < k; i++)
      row[i] = pair_row[t * k + order[i]], weight[i] = weights ? weights[t * k + order[i]] : 1.f;
  }
  __syncthreads();
  for (int c = threadIdx.x; c < H / 8; c += blockDim.x) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < k; j++) {
      float v[8];
      bf16x8_to_float(reinterpret_cast<const uint4*>(y + (int64_t)row[j] * H)[c], v);
#pragma unroll
      for (int i = 0; i < 8; i++) acc[i] = bf16_round(acc[i] + bf16_round(v[i] * weight[j]));
    }
    reinterpret_cast<uint4*>(out + t * H)[c] = float_to_bf16x8(acc);
  }
}
static void moe_combine(bf16* out, const bf16* y, const int* ids, const float* weights, const int* pair_row, int T,
                        int H, int k, cudaStream_t stream) {
  check_vec8("moe_combine", "H", H);
  check_aligned16("moe_combine", "out", out);
  check_aligned16("moe_combine", "y", y);
  INTERNAL_CHECK(k >= 1 && k <= MOE_MAX_TOPK, "moe_combine: k = %d (1 to %d)", k, MOE_MAX_TOPK);
  if (T == 0) return;
  moe_combine_kernel<<<T, row_threads(H / 8, 256), 0, stream>>>(out, y, ids, weights, pair_row, H, k);
  CUDA_CHECK(cudaGetLastError());
}

// ---- The layer ---------------------------------------------------------------------------------------
// Activations' moe_* buffers for steps of up to T tokens of model c at tp ranks (ModelRunner, section 11), or
// null ones for a dense model.
static void moe_allocate(Activations& a, const ModelConfig& c, int tp, int T) {
  a.router_logits = nullptr, a.topk_ids = nullptr, a.topk_weights = nullptr, a.moe_rows = nullptr;
  a.moe_pair_row = nullptr, a.moe_tile_expert = nullptr, a.moe_gate_up = a.moe_act = a.moe_out = nullptr;
  if (c.num_experts == 0) return;
  const int E = c.num_experts, k = c.num_experts_per_tok, IE = c.moe_intermediate_size / tp, H = c.hidden_size;
  const size_t RM = moe_rows_alloc(T, k, E);
  auto alloc = [&](auto** p, size_t n) { CUDA_CHECK(cudaMalloc((void**)p, n * sizeof(**p))); };
  alloc(&a.router_logits, (size_t)T * E);
  alloc(&a.topk_ids, (size_t)T * k);
  alloc(&a.topk_weights, (size_t)T * k);
  alloc(&a.moe_rows, RM);
  alloc(&a.moe_pair_row, (size_t)T * k);
  alloc(&a.moe_tile_expert, RM / MOE_TILE);
  alloc(&a.moe_gate_up, RM * 2 * IE);
  alloc(&a.moe_act, RM * IE);
  alloc(&a.moe_out, RM * H);
}

// The experts' part of a MoE layer, steps 2-4: out [T, H] from x [T, H] and the routing ids, weights [T, k];
// gate_up [E, 2*IE, H] and down [E, H, IE] (IE: this rank's slice); the scratch is a's moe_* buffers, long
// enough for moe_rows_max(T, k, E) rows. out may not alias x.
static void moe_experts(bf16* out, const bf16* x, const int* ids, const float* weights, const bf16* gate_up,
                        const bf16* down, int T, int H, int IE, int E, int k, const Activations& a,
                        cudaStream_t stream) {
  const int64_t RM = moe_rows_max(T, k, E);
  moe_align(a.moe_rows, a.moe_pair_row, a.moe_tile_expert, ids, T, k, E, stream);
  moe_matmul(a.moe_gate_up, x, a.moe_rows, a.moe_tile_expert, gate_up, RM, 2 * IE, H, k, stream);
  silu_and_mul(a.moe_act, a.moe_gate_up, (int)RM, IE, stream);
  moe_matmul(a.moe_out, a.moe_act, a.moe_rows, a.moe_tile_expert, down, RM, H, IE, 0, stream);
  moe_combine(out, a.moe_out, ids, weights, a.moe_pair_row, T, H, k, stream);
}

// A MoE layer's MLP (nano-vllm has none; transformers: Qwen3MoeSparseMoeBlock.forward): out [T, H] from the
// normed rows x [T, H], this rank's share of a partial sum when tp > 1. Steps 1-4 above.
static void moe_mlp(bf16* out, const bf16* x, const LayerWeights& lw, const ModelConfig& c, int tp, int T,
                    Gemm& gemm, const Activations& a, cudaStream_t stream) {
  const int H = c.hidden_size, E = c.num_experts, k = c.num_experts_per_tok;
  linear(gemm, a.router_logits, x, lw.router, T, E, H, stream);  // bf16, as transformers' F.linear rounds
  moe_route(a.topk_ids, a.topk_weights, a.router_logits, T, E, k, c.norm_topk_prob, stream);
  moe_experts(out, x, a.topk_ids, a.topk_weights, lw.experts_gate_up, lw.experts_down, T, H,
              c.moe_intermediate_size / tp, E, k, a, stream);
}

// ==== 11. ModelRunner: step inputs, CUDA graphs ============================================================
// defines: StepRegion, Field, TPStep, Hooks, g_hooks, install_optimizations, StepRunner, graph_batch_sizes,
//          ModelRunner
//
// The bridge between the host's sequences and the GPU (nano-vllm: engine/model_runner.py ModelRunner).
// Per step: prepare_prefill or prepare_decode lays the step's flat int arrays out in a pinned host region,
// ONE cudaMemcpyAsync moves the region to its device twin, the model runs, the sampler picks one token per
// sequence, and ONE synchronisation brings the tokens back. Nothing is allocated inside a step.
//
//   prefill region: input_ids [T] positions [T] slot_mapping [T] cu_seqlens_q [B+1] seqlens_k [B]
//                   block_tables [B, MB] sampling slots [B]
//   decode region:  input_ids [B] positions [B] slot_mapping [B] context_lens [B] block_tables [B, MB]
//                   sampling slots [B]         (fixed addresses: the CUDA graphs read them)
//
// CUDA graphs (decode steps; section 23 adds prefill steps, in pieces): a decode step of Qwen3-0.6B is ~400
// small kernel launches whose launch cost would rival their run time. They are captured once per batch size
// 1, 2, 4, 8, 16, 32, ..., 512 (largest first) and replayed; a batch of 37 replays the 48 graph with 11
// padding rows (slot -1: nothing stored, context 1: a harmless read, token discarded). No kernel's grid
// depends on the contexts (section 8's on the batch size, section 16's on max_model_len), so one capture
// serves every step. (A Part II chapter that runs some decode steps its own way captures graphs of its own
// the same way, capture_decode_graph, and replays them from Hooks::decode_step.)

// A pinned host array and its device twin inside one of the two step regions.
template <typename Tp>
struct Field {
  Tp* host = nullptr;  // pinned
  Tp* dev = nullptr;
};

struct StepRegion {
  char* host = nullptr;  // pinned
  char* dev = nullptr;
  size_t bytes = 0, used = 0;
  template <typename Tp>
  Field<Tp> field(size_t n) {  // carve n elements, 16-byte aligned
    Field<Tp> f;
    f.host = (Tp*)(host + used);
    f.dev = (Tp*)(dev + used);
    used += (n * sizeof(Tp) + 15) / 16 * 16;
    return f;
  }
  void alloc(size_t n) {
    bytes = n;
    CUDA_CHECK(cudaMallocHost(&host, n));
    CUDA_CHECK(cudaMalloc(&dev, n));
  }
};

// Tensor parallelism is read after this section but ModelRunner calls into it: on every rank it agrees on
// the KV pool size and gathers the vocabulary-sharded logits to rank 0 (section 12); on rank 0 it tells the
// workers what to do: build an engine, capture graphs, run this step (the mailbox of section 12b).
struct TPStep {      // what rank 0 decided for one step; the step region's bytes follow it (section 12b)
  int is_prefill;
  int T, B;          // tokens and sequences (decode: B padded to the graph's batch size, T = B)
  int max_seqlen_q;  // prefill; decode: the longest context (Hooks::decode_step may choose by it)
  int decode_rows;   // prefill: StepInputs::decode_rows
  int graph_bs;      // decode: the CUDA graph to replay, 0 = run eagerly
  uint64_t bytes;    // used bytes of the step region
};
// rank 0: connect once, send the workers this Config; *engine: which engine they now build for it
static TPComm* tp_attach(const Config& c, const ModelConfig& mc, int rank, uint64_t* engine);
static void tp_send_step(uint64_t engine, const TPStep& step, const void* region);
static void tp_send_capture(uint64_t engine);
static int64_t all_reduce_min(TPComm* comm, int64_t v);
static void gather_logits(TPComm* comm, const float* shard, float* staging, float* full, int B, int V,
                          cudaStream_t stream);

// ---- The hooks: where Part II plugs in -------------------------------------------------------------------
// What Part II may replace, and the points in an engine's life where it may act, in one table. Each entry
// says what runs when it is empty: the state a run starts in, and all there is with Part II cut out.
// install_optimizations empties the table and lets every registered optimization (section 2) fill its
// entries, in file order, then every registered KV cache format (on for the engine's); ModelRunner calls it
// first thing, so each engine runs with its own Config's switches and cache format.
struct ModelRunner;
struct Hooks {
  // -- What a chapter may replace --
  // Loading the weights, for a chapter that holds the layers' linear matrices in a format of its own (it
  // calls section 6a's load_weights with linears false for the rest). Returns false for a model it does
  // not take. Empty (or false): section 6a's load_weights.
  bool (*load_weights)(Weights& w, const Config& c, const ModelConfig& mc, int rank, int tp, cudaStream_t s,
                       size_t* bytes_read) = nullptr;
  // The forward pass of a step. Empty: section 6c's Qwen3::forward.
  void (*forward)(Qwen3& model, const StepInputs& in, int T, int B, bool is_prefill, cudaStream_t s) = nullptr;
  // A decode step of B rows (a graph's batch size, padding included, where graphs are on) whose longest
  // context is max_context keys, run some other way from its inputs to its drawn tokens; it may replay CUDA
  // graphs of its own (ModelRunner::capture_decode_graph). draw: as in forward_and_sample (a graph draws
  // anyway). Returns false for a step it does not take. Empty (or false): the runner's CUDA graph of the
  // step, `forward` and the sampler (ModelRunner::run_decode; --enforce-eager: forward_and_sample).
  bool (*decode_step)(ModelRunner& r, const StepInputs& in, int B, int max_context, bool draw) = nullptr;
  // The model's part of a prefill step of T tokens, run some other way; returns false for a step it does
  // not take. It may write the step's inputs past row T (padding). Empty (or false): `forward`.
  bool (*prefill_step)(Qwen3& model, const StepInputs& in, int T, int B, cudaStream_t s) = nullptr;
  // The sampler, with a workspace of sample_workspace_bytes(Bmax, V). Empty: section 9's sample, with a
  // workspace of sample_sort_workspace_bytes(Bmax, V).
  void (*sample)(int* out_tokens, const float* logits, const SamplingSlot* slots, int B, int V, void* workspace,
                 size_t workspace_bytes, cudaStream_t stream) = nullptr;
  size_t (*sample_workspace_bytes)(int B, int V) = nullptr;
  // The log-probabilities, with a workspace of logprobs_workspace_bytes(Bmax). Empty: section 9b's.
  void (*compute_logprobs)(TokenLogprobs* out, const float* logits, const int* tokens, const SamplingSlot* slots,
                           int B, int V, void* workspace, size_t workspace_bytes, cudaStream_t stream) = nullptr;
  size_t (*logprobs_workspace_bytes)(int B) = nullptr;
  // Scratch for `forward`'s attention (Activations::attn_workspace) at B sequences of up to max_context_len
  // keys. Empty: none (section 8's kernels need none).
  size_t (*attention_workspace_bytes)(int B, int NH, int max_context_len) = nullptr;

  // -- Where a chapter may act: each a list, run in order; empty: nothing happens there --
  // On every rank, in the same order, once NCCL is up (section 12).
  std::vector<void (*)(TPComm* comm)> tp_ready;
  // Once the model's weights, activations and KV cache exist (a chapter's plans, tables).
  std::vector<void (*)(Qwen3& model, const Config& c)> model_ready;
  // Once the runner has captured its CUDA graphs (capture_cudagraphs; never with --enforce-eager): a chapter
  // captures the graphs it replays.
  std::vector<void (*)(ModelRunner& r)> graphs_captured;
  // Once the scheduler has picked a decode step's rows, before the runner lays them out: a chapter may
  // reorder them (the engine reads each sequence's token back by its row, so each keeps its own).
  std::vector<void (*)(std::vector<Sequence*>& batch)> decode_scheduled;
};
static Hooks g_hooks;

static void install_optimizations(const OptimizationSet& set, const std::string& kv_cache_dtype = "bf16") {
  g_hooks = Hooks{};
  const std::vector<Optimization>& reg = optimization_registry();
  for (size_t i = 0; i < reg.size(); i++) reg[i].apply(i < set.on.size() && set.on[i], g_hooks);
  for (const KVCacheFormat& f : kv_cache_formats())
    if (f.apply) f.apply(kv_cache_dtype == f.name, g_hooks);
}

// What LLMEngine (section 13) needs from the side that computes a step: the sampled tokens, the batch a step
// really runs (padded to a CUDA graph's size), and a clock. ModelRunner is the real one; `nanovllm simulate`
// (section 48) plugs in a stand-in that needs no GPU and keeps a modelled clock.
struct StepRunner {
  double gpu_seconds = 0;  // time spent waiting for the GPU (the rest of a step is host work)
  virtual std::vector<int> run(const std::vector<Sequence*>& seqs, bool is_prefill) = 0;
  virtual int padded_batch(int B, bool is_prefill) const = 0;
  // After run(): row i's log-probabilities for the sequences that asked for them (section 9b); nullptr when
  // none did, or when the runner has no logits (section 48's stand-in model).
  virtual const TokenLogprobs* step_logprobs() const { return nullptr; }
  virtual double now() { return now_seconds(); }
  virtual void wait_until(double t) {  // nothing to do before t (requests arrive later)
    for (double left; (left = t - now()) > 0;) usleep((useconds_t)std::min(left * 1e6, 10000.0));
  }
  virtual ~StepRunner() {}
};

// The decode batch sizes CUDA graphs are captured for (nano-vllm: 1, 2, 4, 8, then every 16 up to 512).
static std::vector<int> graph_batch_sizes(int max_num_seqs) {
  const int max_bs = std::min(max_num_seqs, 512);
  std::vector<int> sizes;
  for (int bs : {1, 2, 4, 8})
    if (bs <= max_bs) sizes.push_back(bs);
  for (int bs = 16; bs <= max_bs; bs += 16) sizes.push_back(bs);
  if (sizes.back() < max_bs) sizes.push_back(max_bs);
  return sizes;
}

struct ModelRunner : StepRunner {
  Config& config;
  Qwen3 model;
  cudaStream_t stream;
  int Tmax, Bmax, MB, P;
  uint64_t engine_seed = 0;
  StepRegion prefill_region, decode_region;
  Field<int> prefill_ids, prefill_pos, prefill_slots, prefill_cu_q, prefill_seqlens_k, prefill_bt;
  Field<SamplingSlot> prefill_samp;
  Field<int> decode_ids, decode_pos, decode_slots, decode_ctx, decode_bt;
  Field<SamplingSlot> decode_samp;
  float* logits = nullptr;         // [Bmax, V] what the sampler reads: act.logits itself at tp == 1; on
                                   // rank 0 at tp > 1 the shards of every rank, gathered (section 12)
  float* logits_gather = nullptr;  // [tp-1, Bmax, V/tp] rank 0: the other ranks' shards as received
  int* out_tokens_d = nullptr;  // [Bmax]
  int* out_tokens_h = nullptr;  // pinned
  void* sample_ws = nullptr;       // the sampler's workspace (Hooks; rank 0)
  size_t sample_ws_bytes = 0;
  // Section 9b's work, for the steps that ask for it; allocated the first time one does.
  LogitEdit* edits_h = nullptr;    // [edit_cap] pinned: the step's logit edits, row by row
  LogitEdit* edits_d = nullptr;    // [edit_cap]
  float* edit_saved = nullptr;     // [edit_cap] the logits the edits overwrote
  int* edit_start_h = nullptr;     // [Bmax + 1] pinned: row b's edits are [edit_start[b], edit_start[b+1])
  int* edit_start_d = nullptr;     // [Bmax + 1]
  size_t edit_cap = 0;
  TokenLogprobs* logprobs_d = nullptr;  // [Bmax]
  TokenLogprobs* logprobs_h = nullptr;  // [Bmax] pinned
  void* logprobs_ws = nullptr;     // a Part II log-probability kernel's workspace (Hooks)
  size_t logprobs_ws_bytes = 0;
  bool have_logprobs = false;      // the last step computed some (step_logprobs)
  uint64_t tp_engine = 0;          // rank 0 with tensor parallelism: the engine the workers built for this one
  std::vector<int> graph_bs;                 // captured batch sizes, ascending
  std::map<int, cudaGraphExec_t> graphs;    // by batch size: a decode step, `forward` and the sampler
  double load_seconds = 0, load_gbps = 0, capture_seconds = 0;
  size_t free_at_start = 0;  // GPU memory free when this engine began: the rest is other processes' (and
                             // this process's CUDA context, or an earlier engine's)

  ModelRunner(Config& c, const ModelConfig& mc, int rank = 0) : config(c) {
    install_optimizations(c.opt, c.kv_cache_dtype);
    model.cfg = mc;
    model.rank = rank;
    model.tp = c.tensor_parallel_size;
    P = model.P = c.kvcache_block_size;
    MB = model.MB = (int)cdiv(c.max_model_len, P);
    model.max_model_len = c.max_model_len;
    Tmax = std::max(c.max_num_batched_tokens, c.max_num_seqs);
    Bmax = c.max_num_seqs;
    if (model.tp > 1) {
      model.comm = tp_attach(c, mc, rank, &tp_engine);  // first, so the workers load weights alongside
      for (auto ready : g_hooks.tp_ready) ready(model.comm);  // every rank, same order
    }
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    size_t total_b;
    CUDA_CHECK(cudaMemGetInfo(&free_at_start, &total_b));  // before this engine's first allocation
    double t0 = now_seconds();
    size_t bytes_read = 0;
    if (!(g_hooks.load_weights && g_hooks.load_weights(model.w, c, mc, rank, model.tp, stream, &bytes_read)))
      model.w = load_weights(c.model, mc, rank, model.tp, stream, &bytes_read);
    load_seconds = now_seconds() - t0;
    load_gbps = bytes_read / load_seconds / 1e9;
    model.gemm = new Gemm;  // lives as long as the process: an engine frees none of its GPU memory
    model.gemm->init();
    allocate_activations();
    allocate_inputs();
    allocate_kv_cache();
    for (auto ready : g_hooks.model_ready) ready(model, c);
  }

  void allocate_activations() {
    const ModelConfig& mc = model.cfg;
    const int tp = model.tp, H = mc.hidden_size, D = mc.head_dim, I = mc.intermediate_size / tp;
    const int NH = mc.num_attention_heads / tp, NKV = mc.num_key_value_heads / tp;
    const int V = (int)cdiv(mc.vocab_size, tp);
    Activations& a = model.act;
    auto alloc = [&](auto** p, size_t n) { CUDA_CHECK(cudaMalloc((void**)p, n * sizeof(**p))); };
    const size_t rows = cdiv(Tmax, 4) * 4;  // Tmax rounded up: a Part II product may work in rows of four
    alloc(&a.residual, rows * H);
    alloc(&a.hidden, rows * H);
    alloc(&a.x, rows * H);
    alloc(&a.qkv, rows * (NH + 2 * NKV) * D);
    alloc(&a.attn, rows * NH * D);
    alloc(&a.gate_up, rows * 2 * I);
    alloc(&a.act, rows * I);
    alloc(&a.last, (size_t)Bmax * H);
    alloc(&a.logits, (size_t)Bmax * V);
    moe_allocate(a, mc, tp, (int)rows);  // a MoE layer's lists and products (section 10b); none for a dense model
    a.attn_workspace = nullptr;
    if (g_hooks.attention_workspace_bytes)
      CUDA_CHECK(cudaMalloc(&a.attn_workspace, g_hooks.attention_workspace_bytes(Bmax, NH, config.max_model_len)));
    if (tp == 1) logits = a.logits;
    else if (model.rank == 0) {
      alloc(&logits, (size_t)Bmax * mc.vocab_size);
      alloc(&logits_gather, (size_t)(tp - 1) * Bmax * V);
    }
    if (g_hooks.sample)
      sample_ws_bytes = g_hooks.sample_workspace_bytes ? g_hooks.sample_workspace_bytes(Bmax, mc.vocab_size) : 0;
    else sample_ws_bytes = model.rank == 0 ? sample_sort_workspace_bytes(Bmax, mc.vocab_size) : 0;
    if (sample_ws_bytes) CUDA_CHECK(cudaMalloc(&sample_ws, sample_ws_bytes));
  }

  void allocate_inputs() {
    size_t pb = 3 * 16 * cdiv(Tmax, 4) + 2 * 16 * cdiv(Bmax + 1, 4) + 16 * cdiv((size_t)Bmax * MB, 4) +
                sizeof(SamplingSlot) * Bmax + 16 * 8;
    prefill_region.alloc(pb);
    prefill_ids = prefill_region.field<int>(Tmax);
    prefill_pos = prefill_region.field<int>(Tmax);
    prefill_slots = prefill_region.field<int>(Tmax);
    prefill_cu_q = prefill_region.field<int>(Bmax + 1);
    prefill_seqlens_k = prefill_region.field<int>(Bmax);
    prefill_bt = prefill_region.field<int>((size_t)Bmax * MB);
    prefill_samp = prefill_region.field<SamplingSlot>(Bmax);
    size_t db = 4 * 16 * cdiv(Bmax, 4) + 16 * cdiv((size_t)Bmax * MB, 4) + sizeof(SamplingSlot) * Bmax + 16 * 8;
    decode_region.alloc(db);
    decode_ids = decode_region.field<int>(Bmax);
    decode_pos = decode_region.field<int>(Bmax);
    decode_slots = decode_region.field<int>(Bmax);
    decode_ctx = decode_region.field<int>(Bmax);
    decode_bt = decode_region.field<int>((size_t)Bmax * MB);
    decode_samp = decode_region.field<SamplingSlot>(Bmax);
    CUDA_CHECK(cudaMalloc(&out_tokens_d, Bmax * sizeof(int)));
    CUDA_CHECK(cudaMallocHost(&out_tokens_h, Bmax * sizeof(int)));
  }

  // nano-vllm: allocate_kv_cache. Everything else is already allocated, so what is free now, minus the
  // (1 - gpu_memory_utilization) share of the card, is the KV pool.
  void allocate_kv_cache() {
    size_t free_b, total_b;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    for (const KVCacheFormat& f : kv_cache_formats())
      if (config.kv_cache_dtype == f.name && f.use) f.use(model);
    const int value_bytes = kv_cache_value_bytes(config.kv_cache_dtype);
    size_t block_bytes = kv_block_bytes(model.cfg, P, model.tp, value_bytes);
    double budget = (double)total_b * config.gpu_memory_utilization - (double)(total_b - free_b);
    int64_t fit = budget > 0 ? (int64_t)(budget / block_bytes) : 0;
    if (model.tp > 1) fit = all_reduce_min(model.comm, fit);  // every rank must hold the same block ids
    if (config.num_kvcache_blocks > 0) {
      if (config.num_kvcache_blocks > fit)
        die("--num-kvcache-blocks %d needs %.2f GiB but only %.2f GiB are left under --gpu-memory-utilization %g",
            config.num_kvcache_blocks, config.num_kvcache_blocks * (double)block_bytes / (1 << 30),
            std::max(budget, 0.0) / (1 << 30), config.gpu_memory_utilization);
    } else {
      config.num_kvcache_blocks = (int)std::min<int64_t>(fit, 1 << 30);
    }
    int need = MB;
    const double held_before = (double)(total_b - free_at_start);  // by others before this engine began
    if (config.num_kvcache_blocks < need && held_before > 0.25 * total_b)
      die("the KV cache has room for %d blocks of %d tokens, but one sequence of --max-model-len %d needs %d: "
          "%.1f of this GPU's %.1f GiB were already in use before this engine loaded anything (another "
          "process, listed by nvidia-smi?). Free the GPU or run on another one (CUDA_VISIBLE_DEVICES); else "
          "lower --max-model-len",
          config.num_kvcache_blocks, P, config.max_model_len, need, held_before / (1 << 30),
          total_b / (double)(1 << 30));
    if (config.num_kvcache_blocks < need)
      die("the KV cache has room for %d blocks of %d tokens (%.2f GiB free under --gpu-memory-utilization %g), "
          "but one sequence of --max-model-len %d needs %d. Raise --gpu-memory-utilization or "
          "--num-kvcache-blocks, or lower --max-model-len",
          config.num_kvcache_blocks, P, std::max(budget, 0.0) / (1 << 30), config.gpu_memory_utilization,
          config.max_model_len, need);
    KVCache& kv = model.kv;
    kv.value_bytes = value_bytes;
    kv.num_blocks = config.num_kvcache_blocks;
    kv.kv_stride = kv.num_blocks * (model.cfg.num_key_value_heads / model.tp) * P * model.cfg.head_dim;
    kv.layer_stride = 2 * kv.kv_stride;
    kv.bytes = (size_t)kv.num_blocks * block_bytes;
    CUDA_CHECK(cudaMalloc(&kv.base, kv.bytes));
  }

  SamplingSlot sampling_slot(const Sequence& seq) const {
    SamplingSlot s{};
    s.temperature = seq.params.temperature;
    s.top_k = seq.params.top_k;
    s.top_p = seq.params.top_p;
    s.min_p = seq.params.min_p;
    s.seed = seq.sampling_seed(engine_seed);
    s.offset = (uint64_t)seq.num_completion_tokens();  // the draw for the n-th token is fixed by (seed, n)
    s.repetition_penalty = seq.params.repetition_penalty;
    s.frequency_penalty = seq.params.frequency_penalty;
    s.presence_penalty = seq.params.presence_penalty;
    s.logprobs = seq.params.logprobs;
    return s;
  }

  void fill_block_table(int* row, const Sequence& seq) {
    int n = (int)seq.block_table.size();
    memcpy(row, seq.block_table.data(), n * sizeof(int));
    for (int i = n; i < MB; i++) row[i] = 0;  // never read (beyond the sequence's length)
  }

  // nano-vllm: prepare_prefill. Each sequence contributes its scheduled tokens [start, end).
  StepInputs prepare_prefill(const std::vector<Sequence*>& seqs, int& T) {
    T = 0;
    int max_q = 0, decode_rows = 0;
    prefill_cu_q.host[0] = 0;
    for (size_t b = 0; b < seqs.size(); b++) {
      const Sequence& seq = *seqs[b];
      int start = seq.num_cached_tokens, end = start + seq.num_scheduled_tokens;
      for (int t = start; t < end; t++) {
        prefill_ids.host[T] = seq.token_ids[t];
        prefill_pos.host[T] = t;
        prefill_slots.host[T] = seq.block_table[t / P] * P + t % P;
        T++;
      }
      prefill_cu_q.host[b + 1] = T;
      prefill_seqlens_k.host[b] = end;
      max_q = std::max(max_q, end - start);
      if (decode_rows == (int)b && end - start == 1) decode_rows++;
      fill_block_table(prefill_bt.host + b * MB, seq);
      prefill_samp.host[b] = sampling_slot(seq);
    }
    CUDA_CHECK(cudaMemcpyAsync(prefill_region.dev, prefill_region.host, prefill_region.used,
                               cudaMemcpyHostToDevice,
                               stream));
    return prefill_inputs(max_q, decode_rows);
  }
  StepInputs prefill_inputs(int max_q, int decode_rows) const {
    return StepInputs{prefill_ids.dev,  prefill_pos.dev,       prefill_slots.dev, prefill_cu_q.dev,
                      prefill_seqlens_k.dev, prefill_bt.dev, max_q, decode_rows};
  }

  // nano-vllm: prepare_decode. One token per sequence: its last one, at position len-1. Rows bs..padded_bs-1
  // are padding for a CUDA graph of size padded_bs.
  StepInputs prepare_decode(const std::vector<Sequence*>& seqs, int padded_bs) {
    int bs = (int)seqs.size();
    for (int b = 0; b < padded_bs; b++) {
      if (b < bs) {
        const Sequence& seq = *seqs[b];
        int pos = seq.size() - 1;
        decode_ids.host[b] = seq.last_token;
        decode_pos.host[b] = pos;
        decode_slots.host[b] = seq.block_table[pos / P] * P + pos % P;
        decode_ctx.host[b] = seq.size();
        fill_block_table(decode_bt.host + b * MB, seq);
        decode_samp.host[b] = sampling_slot(seq);
      } else {
        decode_ids.host[b] = 0, decode_pos.host[b] = 0, decode_slots.host[b] = -1, decode_ctx.host[b] = 1;
        std::fill(decode_bt.host + b * MB, decode_bt.host + (b + 1) * MB, 0);
        decode_samp.host[b] = SamplingSlot{};  // greedy
      }
    }
    CUDA_CHECK(cudaMemcpyAsync(decode_region.dev, decode_region.host, decode_region.used, cudaMemcpyHostToDevice,
                               stream));
    return decode_inputs();
  }
  StepInputs decode_inputs() const {
    return StepInputs{decode_ids.dev, decode_pos.dev, decode_slots.dev, nullptr, decode_ctx.dev, decode_bt.dev, 1};
  }

  // nano-vllm: run_model. The forward pass: Part II's where the hook is filled, else section 6c's.
  void run_model(const StepInputs& in, int T, int B, bool is_prefill) {
    if (g_hooks.forward) g_hooks.forward(model, in, T, B, is_prefill, stream);
    else model.forward(in, T, B, is_prefill, stream);
  }
  // The model, then (rank 0) the sampler: Part I's, or Part II's where a hook is filled. draw = false: the
  // draw comes later (process_and_sample, after section 9b's edits).
  void forward_and_sample(const StepInputs& in, int T, int B, bool is_prefill, const SamplingSlot* slots_d,
                          bool draw = true) {
    if (!(is_prefill && g_hooks.prefill_step && g_hooks.prefill_step(model, in, T, B, stream)))
      run_model(in, T, B, is_prefill);
    gather_and_draw(B, slots_d, draw);
  }
  // What follows the model in every step: the logits gathered to rank 0 (section 12), and there one token
  // drawn per row.
  void gather_and_draw(int B, const SamplingSlot* slots_d, bool draw = true) {
    if (model.tp > 1)
      gather_logits(model.comm, model.act.logits, logits_gather, logits, B, model.cfg.vocab_size, stream);
    if (model.rank != 0 || !draw) return;
    draw_tokens(B, slots_d);
  }
  // One token per row of logits into out_tokens_d.
  void draw_tokens(int B, const SamplingSlot* slots_d) {
    const int V = model.cfg.vocab_size;
    if (g_hooks.sample) g_hooks.sample(out_tokens_d, logits, slots_d, B, V, sample_ws, sample_ws_bytes, stream);
    else sample(out_tokens_d, logits, slots_d, B, V, sample_ws, sample_ws_bytes, stream);
  }

  // A decode step of B rows, already in the decode region (B: the graph's batch size where graphs are on,
  // padding included) whose longest context is max_context keys: a chapter's way where it takes the step
  // (Hooks::decode_step), else the runner's graph of B, else (--enforce-eager) forward_and_sample.
  void run_decode(int B, bool graph, int max_context, bool draw) {
    const StepInputs in = decode_inputs();
    if (g_hooks.decode_step && g_hooks.decode_step(*this, in, B, max_context, draw)) return;
    if (graph) CUDA_CHECK(cudaGraphLaunch(graphs.at(B), stream));
    else forward_and_sample(in, B, B, false, decode_samp.dev, draw);
  }
  int graph_size_for(int bs) const {
    for (int g : graph_bs)
      if (g >= bs) return g;
    return 0;
  }

  int padded_batch(int B, bool is_prefill) const override {
    const int g = is_prefill || config.enforce_eager ? 0 : graph_size_for(B);
    return g ? g : B;
  }

  // What a step's batch asks of section 9b. A step where no sequence sets a penalty, min_tokens or logprobs
  // does none of this: the default path is exactly the one above. (min_p needs nothing here: both samplers
  // apply it in the step's usual draw.)
  struct StepExtras {
    bool edits = false;     // some row has logit edits (a penalty, or a ban before min_tokens): draw again
    bool logprobs = false;  // some row asks for log-probabilities
  };
  StepExtras step_extras(const std::vector<Sequence*>& seqs) const {
    StepExtras x;
    for (const Sequence* seq : seqs) {
      const SamplingParams& p = seq->params;
      x.edits |= p.penalized() || seq->num_completion_tokens() < p.min_tokens;
      x.logprobs |= p.logprobs >= 0;
    }
    return x;
  }

  // The host side of the logit edits (section 9b's logit_edits_of, row by row), copied to the GPU on the
  // step's stream, ahead of the forward pass.
  std::vector<LogitEdit> edit_list;
  void upload_logit_edits(const std::vector<Sequence*>& seqs) {
    const int B = (int)seqs.size();
    if (!edit_start_h) {
      CUDA_CHECK(cudaMallocHost(&edit_start_h, (Bmax + 1) * sizeof(int)));
      CUDA_CHECK(cudaMalloc(&edit_start_d, (Bmax + 1) * sizeof(int)));
    }
    edit_list.clear();
    for (int b = 0; b < B; b++) {
      edit_start_h[b] = (int)edit_list.size();
      logit_edits_of(*seqs[b], config.eos, edit_list);
    }
    const size_t E = edit_list.size();
    edit_start_h[B] = (int)E;
    if (E > edit_cap) {
      if (edit_cap) {  // the last step has finished with them (run() ends in a synchronisation)
        CUDA_CHECK(cudaFreeHost(edits_h));
        CUDA_CHECK(cudaFree(edits_d));
        CUDA_CHECK(cudaFree(edit_saved));
      }
      edit_cap = std::max(E, 2 * edit_cap);
      CUDA_CHECK(cudaMallocHost(&edits_h, edit_cap * sizeof(LogitEdit)));
      CUDA_CHECK(cudaMalloc(&edits_d, edit_cap * sizeof(LogitEdit)));
      CUDA_CHECK(cudaMalloc(&edit_saved, edit_cap * sizeof(float)));
    }
    if (E) memcpy(edits_h, edit_list.data(), E * sizeof(LogitEdit));
    CUDA_CHECK(cudaMemcpyAsync(edit_start_d, edit_start_h, (B + 1) * sizeof(int), cudaMemcpyHostToDevice, stream));
    if (E) CUDA_CHECK(cudaMemcpyAsync(edits_d, edits_h, E * sizeof(LogitEdit), cudaMemcpyHostToDevice, stream));
  }

  // After the model and the default draw (rank 0): edit the logits, draw again with the same sampler (the
  // draw a CUDA graph made saw the logits unedited; a draw is a pure function of the logits and the slot,
  // so drawing twice changes nothing else), put the raw logits back, and compute the log-probabilities
  // from them. B: the real rows (a graph's padding rows are left alone).
  void process_and_sample(const StepExtras& x, int B, const SamplingSlot* slots_d) {
    const int V = model.cfg.vocab_size;
    if (x.edits) {
      logit_edits(false, logits, B, V, edits_d, edit_start_d, slots_d, edit_saved, stream);
      draw_tokens(B, slots_d);
      logit_edits(true, logits, B, V, edits_d, edit_start_d, slots_d, edit_saved, stream);
    }
    if (x.logprobs) {
      if (!logprobs_d) {
        CUDA_CHECK(cudaMalloc(&logprobs_d, Bmax * sizeof(TokenLogprobs)));
        CUDA_CHECK(cudaMallocHost(&logprobs_h, Bmax * sizeof(TokenLogprobs)));
        logprobs_ws_bytes = g_hooks.logprobs_workspace_bytes ? g_hooks.logprobs_workspace_bytes(Bmax) : 0;
        if (logprobs_ws_bytes) CUDA_CHECK(cudaMalloc(&logprobs_ws, logprobs_ws_bytes));
      }
      if (g_hooks.compute_logprobs)
        g_hooks.compute_logprobs(logprobs_d, logits, out_tokens_d, slots_d, B, V, logprobs_ws, logprobs_ws_bytes,
                                 stream);
      else compute_logprobs(logprobs_d, logits, out_tokens_d, slots_d, B, V, stream);
      CUDA_CHECK(cudaMemcpyAsync(logprobs_h, logprobs_d, B * sizeof(TokenLogprobs), cudaMemcpyDeviceToHost, stream));
    }
  }
  const TokenLogprobs* step_logprobs() const override { return have_logprobs ? logprobs_h : nullptr; }

  // nano-vllm: run. Returns one sampled token per sequence.
  std::vector<int> run(const std::vector<Sequence*>& seqs, bool is_prefill) override {
    int B = (int)seqs.size();
    const StepExtras x = step_extras(seqs);
    if (x.edits) upload_logit_edits(seqs);
    if (is_prefill) {
      int T;
      StepInputs in = prepare_prefill(seqs, T);
      if (model.tp > 1)
        tp_send_step(tp_engine, {1, T, B, in.max_seqlen_q, in.decode_rows, 0, prefill_region.used},
                     prefill_region.host);
      forward_and_sample(in, T, B, true, prefill_samp.dev, !x.edits);
      if (x.edits || x.logprobs) process_and_sample(x, B, prefill_samp.dev);
    } else {
      int g = config.enforce_eager ? 0 : graph_size_for(B);
      prepare_decode(seqs, g ? g : B);
      int max_context = 1;
      for (const Sequence* s : seqs) max_context = std::max(max_context, s->size());
      if (model.tp > 1)
        tp_send_step(tp_engine, {0, g ? g : B, g ? g : B, max_context, 0, g, decode_region.used},
                     decode_region.host);
      run_decode(g ? g : B, g != 0, max_context, !x.edits);
      if (x.edits || x.logprobs) process_and_sample(x, B, decode_samp.dev);
    }
    have_logprobs = x.logprobs;
    CUDA_CHECK(cudaMemcpyAsync(out_tokens_h, out_tokens_d, B * sizeof(int), cudaMemcpyDeviceToHost, stream));
    double t0 = now_seconds();
    CUDA_CHECK(cudaStreamSynchronize(stream));  // the one synchronisation of the step
    gpu_seconds += now_seconds() - t0;
    return std::vector<int>(out_tokens_h, out_tokens_h + B);
  }

  // A decode step of bs rows captured in a CUDA graph: model_part(in) (which leaves the logits in
  // model.act.logits), then gather_and_draw, on all-padding rows (valid inputs that store nothing). It runs
  // once outside the capture first: cuBLASLt chooses its algorithms there. The runner's graphs are this
  // with `forward`; a chapter that replays graphs of its own from Hooks::decode_step captures them with
  // its model part, so they hold the same work around it.
  template <class ModelPart>
  cudaGraphExec_t capture_decode_graph(int bs, ModelPart model_part) {
    std::vector<Sequence*> none;
    const StepInputs in = prepare_decode(none, bs);
    auto step = [&] {
      model_part(in);
      gather_and_draw(bs, decode_samp.dev);
    };
    step();
    CUDA_CHECK(cudaStreamSynchronize(stream));
    cudaGraph_t graph;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    step();
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_CHECK(cudaGraphDestroy(graph));
    return exec;
  }

  // nano-vllm: capture_cudagraph. Batch sizes 1, 2, 4, 8, then every 16 up to max_num_seqs (capped at 512),
  // largest first; then the chapters capture theirs (Hooks::graphs_captured).
  void capture_cudagraphs() {
    if (config.enforce_eager) return;
    if (model.tp > 1 && model.rank == 0) tp_send_capture(tp_engine);  // every rank, the same graphs, in order
    double t0 = now_seconds();
    graph_bs = graph_batch_sizes(Bmax);
    for (auto it = graph_bs.rbegin(); it != graph_bs.rend(); ++it) {
      const int bs = *it;
      graphs[bs] = capture_decode_graph(bs, [&](const StepInputs& in) { run_model(in, bs, bs, false); });
    }
    for (auto captured : g_hooks.graphs_captured) captured(*this);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    capture_seconds = now_seconds() - t0;
  }
};

// ==== 12. Tensor parallelism: sharded weights, NCCL all-reduce =============================================
// defines: TPComm, all_reduce_sum, all_reduce_min, gather_logits, tp_comm_init, TPMailbox, TPGroup,
//          TPSupervisor, tp_fork_workers, tp_send, tp_attach, config_to_json, tp_worker_main
//
// N GPUs run one model (nano-vllm: model_runner.py with torch.distributed, layers/linear.py,
// layers/embed_head.py). Every rank holds 1/N of each split weight (tp_shard in section 2 says which part,
// load_weights in section 6a reads only that part) and 1/N of the KV heads (section 6b), and runs the same
// forward pass on its share:
//
//   qkv, gate_up      column-parallel: a rank computes its own heads / intermediate columns, no traffic
//   o_proj, down      row-parallel: each rank's product is a partial sum of the full one -> all-reduce
//   embed_tokens      vocabulary-parallel: a rank looks up only its ids (zeros elsewhere) -> all-reduce
//   lm_head           vocabulary-parallel: a rank computes V/N logits -> gathered to rank 0, which samples
//
// This section has two halves: the data plane (the communicator, the all-reduce, the logits gather), and
// the processes (12b): rank 0 is this process; ranks 1..N-1 are workers fork()ed before the first CUDA
// call, and rank 0 sends them each step through a mailbox in shared memory. Section 20 gives the small
// all-reduces of decode a faster road than NCCL's; section 45 handles the signals and shutdown.
//
// What crosses between the ranks in one batch-1 decode step of Qwen3-8B at N = 2:
//   mailbox      ~57 KB of step inputs at --max-num-seqs 512 (ids, positions, slots, context lengths,
//                block tables, sampling slots)
//   all-reduce   73 x 8 KB: after the embedding, and after o_proj and down_proj in each of 36 layers
//   gather       304 KB: the worker's half of the fp32 logits, to rank 0

constexpr int TP_MAX_RANKS = 8;


struct TPComm {
  int rank = 0, size = 1;
  ncclComm_t nccl = nullptr;
  cudaStream_t stream = nullptr;    // for the set-up collectives outside the model's stream
  int64_t* scratch = nullptr;       // [1] device scalar for all_reduce_min
  bool skip = false;                // NANOVLLM_ALLREDUCE=skip: no all-reduce at all (timing only)
  void* fast = nullptr;             // what a Part II all-reduce keeps per communicator (Hooks::tp_ready)
};

// The sum of x [n] over the ranks, in place (nano-vllm: dist.all_reduce in RowParallelLinear and
// VocabParallelEmbedding). NCCL's ring: every rank sends and receives 2(N-1)/N of the message. Every rank
// must make the same calls in the same order.
static void all_reduce_sum(TPComm* comm, bf16* x, size_t n, cudaStream_t stream) {
  if (comm->skip) return;
  NCCL_CHECK(ncclAllReduce(x, x, n, ncclBfloat16, ncclSum, comm->nccl, stream));
}

// The minimum of v over the ranks (host to host; start-up only, e.g. the KV pool size every rank can hold).
static int64_t all_reduce_min(TPComm* comm, int64_t v) {
  // On comm->stream: a plain cudaMemcpy from pageable memory can return before its copy lands, and the
  // non-blocking stream would not wait for it.
  CUDA_CHECK(cudaMemcpyAsync(comm->scratch, &v, sizeof v, cudaMemcpyHostToDevice, comm->stream));
  NCCL_CHECK(ncclAllReduce(comm->scratch, comm->scratch, 1, ncclInt64, ncclMin, comm->nccl, comm->stream));
  CUDA_CHECK(cudaStreamSynchronize(comm->stream));
  CUDA_CHECK(cudaMemcpy(&v, comm->scratch, sizeof v, cudaMemcpyDeviceToHost));
  return v;
}

// Rank 0 gets full [B, V] from every rank's shard [B, V_local] (nano-vllm: ParallelLMHead.forward gathers
// to rank 0 with dist.gather). The other ranks send their shard to rank 0, which receives each into
// staging [N-1, B, V_local] and then lays all shards side by side with strided 2-D copies (the last shard
// loses its zero-padded columns). Sends and receives are NCCL point-to-point calls, captured into the
// decode CUDA graphs like everything else. staging and full are only used on rank 0.
static void gather_logits(TPComm* comm, const float* shard, float* staging, float* full, int B, int V,
                          cudaStream_t stream) {
  const int64_t Vl = cdiv(V, comm->size), n = (int64_t)B * Vl;
  if (comm->rank != 0) {
    NCCL_CHECK(ncclSend(shard, n, ncclFloat32, 0, comm->nccl, stream));
    return;
  }
  NCCL_CHECK(ncclGroupStart());
  for (int r = 1; r < comm->size; r++)
    NCCL_CHECK(ncclRecv(staging + (r - 1) * n, n, ncclFloat32, r, comm->nccl, stream));
  NCCL_CHECK(ncclGroupEnd());
  for (int r = 0; r < comm->size; r++) {
    const float* src = r == 0 ? shard : staging + (r - 1) * n;
    const int64_t cols = std::min<int64_t>(Vl, V - r * Vl);
    if (cols > 0)
      CUDA_CHECK(cudaMemcpy2DAsync(full + r * Vl, V * sizeof(float), src, Vl * sizeof(float),
                                   cols * sizeof(float), B, cudaMemcpyDeviceToDevice, stream));
  }
}
// Join the NCCL communicator as `rank` (every rank calls this with the same id) on GPU `rank`.
static TPComm* tp_comm_init(int rank, int size, const ncclUniqueId& id) {
  TPComm* c = new TPComm;
  c->rank = rank, c->size = size;
  CUDA_CHECK(cudaSetDevice(rank));
  NCCL_CHECK(ncclCommInitRank(&c->nccl, size, id, rank));
  CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
  CUDA_CHECK(cudaMalloc(&c->scratch, sizeof(int64_t)));
  if (const char* mode = getenv("NANOVLLM_ALLREDUCE")) {
    if (strcmp(mode, "skip"))
      die("NANOVLLM_ALLREDUCE=%s: the only value is skip (timing only: every all-reduce is left out)",
          mode);
    c->skip = true;
    if (rank == 0)
      fprintf(stderr, "nanovllm: NANOVLLM_ALLREDUCE=skip: every all-reduce is skipped, the output is WRONG "
                      "(this is for timing only)\n");
  }
  return c;
}

// ---- 12b. The processes: fork, the mailbox, the worker loop -------------------------------------------
//
// Processes. tp_launch(N) fork()s ranks 1..N-1 before this process makes its first CUDA call: a child
// cannot use CUDA once its parent has, so the order is forced (nano-vllm spawns fresh Python processes
// instead). The workers are generic: they know nothing of the model until rank 0 sends them an engine's
// Config, so one launch serves every engine the process builds (the end-to-end test builds several).
// Rank r binds GPU r; all ranks join one NCCL communicator whose unique id travels through the mailbox.
//
// Control plane. nano-vllm pickles each call (method name and arguments, the Sequence objects included)
// into a 1 MiB SharedMemory segment, sets one Event per worker, and every worker re-runs prepare_prefill /
// prepare_decode from the sequences. Here rank 0 prepares a step once and sends the result: the step
// region of section 11, the flat arrays exactly as they will be copied to the GPU, with a small header
// (TPStep). A worker copies those bytes into its own pinned region and runs what rank 0 runs, the same
// CUDA graph included. No serialisation, no second copy of the scheduler's state, and the two ranks cannot
// disagree about a step's inputs.
//
// The mailbox is one slot in a MAP_SHARED | MAP_ANONYMOUS mapping made before fork(): every rank inherits
// it and it has no name, so nothing can be left behind in /dev/shm however the run ends (nano-vllm's named
// segment must be unlinked). Rank 0 writes a message and increments `seq`; a worker notices by spinning on
// seq for a few milliseconds (the next decode step usually comes sooner, and a futex wake-up costs tens of
// microseconds on the critical path), then sleeps in futex(FUTEX_WAIT) on the same word, which rank 0's
// FUTEX_WAKE ends. Before writing, rank 0 waits until every worker has acknowledged (copied out) the
// previous message, so a single slot is enough; in practice they always have, because each message is
// followed by collectives that need every worker.
//
// What happens when a process fails or a signal arrives (reaping the workers, naming the rank that failed,
// Ctrl-C) is section 45's: it passes its handlers to tp_fork_workers (TPSupervisor), and none of it changes
// what the ranks compute.

enum class TPOp : uint32_t { CONNECT, INIT, CAPTURE, STEP, EXIT };

struct TPMailbox {
  uint32_t seq;      // messages sent so far: the futex word
  uint32_t acks;     // messages copied out, summed over the workers
  TPOp op;
  TPStep step;       // STEP: the header
  uint64_t bytes;    // of payload: CONNECT the NCCL unique id, INIT the Config as JSON, STEP the step region
  static constexpr size_t kHeader = 256;
  char* payload() { return reinterpret_cast<char*>(this) + kHeader; }
};
static_assert(sizeof(TPMailbox) <= TPMailbox::kHeader, "the payload starts after the header");
constexpr size_t TP_MAILBOX_BYTES = 64 << 20;  // address space; memory only as far as messages reach
constexpr size_t TP_PAYLOAD_BYTES = TP_MAILBOX_BYTES - TPMailbox::kHeader;
constexpr double TP_SPIN_SECONDS = 0.01;       // a worker spins this long before it sleeps on the futex

struct TPGroup {
  int size = 1;
  TPMailbox* mb = nullptr;
  TPComm* comm = nullptr;                  // this process's, once connected
  pid_t pids[TP_MAX_RANKS] = {};           // rank 0: the workers, -1 once reaped
  int status[TP_MAX_RANKS] = {};           // rank 0: their wait() status once reaped
  volatile sig_atomic_t stopping = 0;      // rank 0: a worker's exit is expected from now on
  volatile sig_atomic_t worker_busy = 0;   // worker: it has received a message (SIGTERM then says why)
  uint64_t engines = 0;                    // rank 0: engines built; the workers serve only the newest
};
static TPGroup g_tp;

// What section 45 adds around the processes: rank 0's reaper and signal handlers, installed between the
// forks and the moment a worker's death can be noticed; a worker's own signals; and a per-step call (tests
// make a worker fail on purpose there). Empty entries do nothing.
struct TPSupervisor {
  void (*supervise)() = nullptr;                         // rank 0, every worker forked, SIGCHLD still blocked
  void (*worker_begins)(int rank) = nullptr;             // a worker, before its loop
  void (*worker_step)(int rank, long long step) = nullptr;  // a worker, before it runs its step-th step
};
static TPSupervisor g_tp_supervisor;  // the workers' copy of what tp_fork_workers was given

[[noreturn]] static void tp_worker_main(int rank);

// Fork ranks 1..n-1 (nano-vllm: mp.Process per rank in LLMEngine.__init__). Call before the first CUDA
// call; a no-op for n = 1.
static void tp_fork_workers(int n, const TPSupervisor& sup) {
  if (n <= 1) return;
  if (n > TP_MAX_RANKS) die("--tensor-parallel-size %d: at most %d ranks", n, TP_MAX_RANKS);
  // NVLink SHARP (multicast) buys nothing at these message sizes and GPU counts; keep it off unless asked.
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  void* p = mmap(nullptr, TP_MAILBOX_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    die("cannot map %zu MiB of shared memory for the tensor-parallel mailbox: %s", TP_MAILBOX_BYTES >> 20,
        strerror(errno));
  g_tp.mb = static_cast<TPMailbox*>(p);
  g_tp.size = n;
  g_tp_supervisor = sup;
  sigset_t chld, old;  // a worker that dies at once is reaped only once its pid is recorded
  sigemptyset(&chld);
  sigaddset(&chld, SIGCHLD);
  sigprocmask(SIG_BLOCK, &chld, &old);
  fflush(stdout);  // or the children would print rank 0's buffered output again
  fflush(stderr);
  const pid_t parent = getpid();
  for (int r = 1; r < n; r++) {
    pid_t pid = fork();
    if (pid < 0) {
      int e = errno;
      for (int q = 1; q < r; q++) kill(g_tp.pids[q], SIGKILL), waitpid(g_tp.pids[q], nullptr, 0);
      die("fork() for tensor-parallel rank %d failed: %s", r, strerror(e));
    }
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGTERM);   // rank 0 gone, however it went: this worker goes too
      if (getppid() != parent) _exit(1);  // it went before prctl took effect
      sigprocmask(SIG_SETMASK, &old, nullptr);
      tp_worker_main(r);
    }
    g_tp.pids[r] = pid;
  }
  if (sup.supervise) sup.supervise();
  sigprocmask(SIG_SETMASK, &old, nullptr);
}

// Rank 0: put one message in the mailbox and wake the workers.
static void tp_send(TPOp op, const void* payload, size_t bytes, const TPStep* step = nullptr) {
  TPMailbox* mb = g_tp.mb;
  if (bytes > TP_PAYLOAD_BYTES)
    die("a tensor-parallel step of %.1f MiB does not fit the %zu MiB mailbox; lower "
        "--max-num-batched-tokens, --max-num-seqs or --max-model-len",
        bytes / 1048576.0, TP_PAYLOAD_BYTES >> 20);
  const uint32_t sent = mb->seq;
  while (__atomic_load_n(&mb->acks, __ATOMIC_ACQUIRE) != sent * (uint32_t)(g_tp.size - 1)) sched_yield();
  mb->op = op;
  mb->bytes = bytes;
  if (step) mb->step = *step;
  if (bytes) memcpy(mb->payload(), payload, bytes);
  __atomic_store_n(&mb->seq, sent + 1, __ATOMIC_RELEASE);
  syscall(SYS_futex, &mb->seq, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// A worker keeps one engine, the one rank 0 built last (TPOp::INIT replaces it): an older engine's step would
// run on the newer one's block tables and buffers.
static void tp_check_engine(uint64_t engine) {
  if (engine != g_tp.engines)
    die("this engine (number %llu) can no longer run with tensor parallelism: the workers serve only the "
        "engine built last (number %llu). Build one engine at a time with --tensor-parallel-size > 1",
        (unsigned long long)engine, (unsigned long long)g_tp.engines);
}
static void tp_send_step(uint64_t engine, const TPStep& step, const void* region) {
  tp_check_engine(engine);
  tp_send(TPOp::STEP, region, step.bytes, &step);
}
static void tp_send_capture(uint64_t engine) {
  tp_check_engine(engine);
  tp_send(TPOp::CAPTURE, nullptr, 0);
}

// Every field of Config and ModelConfig (section 2) travels; a field added there must be added here and in
// the functions below.
static std::string config_to_json(const Config& c) {
  json j = {{"model", c.model},
            {"max_num_batched_tokens", c.max_num_batched_tokens},
            {"max_num_seqs", c.max_num_seqs},
            {"max_model_len", c.max_model_len},
            {"gpu_memory_utilization", c.gpu_memory_utilization},
            {"tensor_parallel_size", c.tensor_parallel_size},
            {"enforce_eager", c.enforce_eager},
            {"kvcache_block_size", c.kvcache_block_size},
            {"num_kvcache_blocks", c.num_kvcache_blocks},
            {"eos", c.eos},
            {"kv_cache_dtype", c.kv_cache_dtype},
            {"quantization", c.quantization}};
  j["opt"] = json::object();
  for (size_t i = 0; i < optimization_registry().size(); i++)
    j["opt"][optimization_registry()[i].name] = i < c.opt.on.size() && c.opt.on[i];
  return j.dump();
}
static std::string model_config_to_json(const ModelConfig& m) {
  json j = {{"hidden_size", m.hidden_size},
            {"intermediate_size", m.intermediate_size},
            {"num_hidden_layers", m.num_hidden_layers},
            {"num_attention_heads", m.num_attention_heads},
            {"num_key_value_heads", m.num_key_value_heads},
            {"head_dim", m.head_dim},
            {"vocab_size", m.vocab_size},
            {"max_position_embeddings", m.max_position_embeddings},
            {"rms_norm_eps", m.rms_norm_eps},
            {"rope_theta", m.rope_theta},
            {"tie_word_embeddings", m.tie_word_embeddings},
            {"dtype", m.dtype},
            {"block_quantized", m.block_quantized},
            {"not_quantized", m.not_quantized},
            {"eos_token_ids", m.eos_token_ids},
            {"generation_config", m.generation_config},
            {"num_experts", m.num_experts},
            {"num_experts_per_tok", m.num_experts_per_tok},
            {"moe_intermediate_size", m.moe_intermediate_size},
            {"norm_topk_prob", m.norm_topk_prob},
            {"decoder_sparse_step", m.decoder_sparse_step},
            {"mlp_only_layers", m.mlp_only_layers}};
  return j.dump();
}
static ModelConfig model_config_from_json(const std::string& text) {
  json j = json::parse(text);
  ModelConfig m;
  m.hidden_size = j["hidden_size"], m.intermediate_size = j["intermediate_size"];
  m.num_hidden_layers = j["num_hidden_layers"], m.num_attention_heads = j["num_attention_heads"];
  m.num_key_value_heads = j["num_key_value_heads"], m.head_dim = j["head_dim"], m.vocab_size = j["vocab_size"];
  m.max_position_embeddings = j["max_position_embeddings"];
  m.rms_norm_eps = j["rms_norm_eps"], m.rope_theta = j["rope_theta"];
  m.tie_word_embeddings = j["tie_word_embeddings"], m.dtype = j["dtype"];
  m.block_quantized = j["block_quantized"], m.not_quantized = j["not_quantized"].get<std::vector<std::string>>();
  m.eos_token_ids = j["eos_token_ids"].get<std::vector<int>>();
  m.generation_config = j["generation_config"];
  m.num_experts = j["num_experts"], m.num_experts_per_tok = j["num_experts_per_tok"];
  m.moe_intermediate_size = j["moe_intermediate_size"], m.norm_topk_prob = j["norm_topk_prob"];
  m.decoder_sparse_step = j["decoder_sparse_step"];
  m.mlp_only_layers = j["mlp_only_layers"].get<std::vector<int>>();
  return m;
}
static Config config_from_json(const std::string& text) {
  json j = json::parse(text);
  Config c;
  c.model = j["model"];
  c.max_num_batched_tokens = j["max_num_batched_tokens"];
  c.max_num_seqs = j["max_num_seqs"];
  c.max_model_len = j["max_model_len"];
  c.gpu_memory_utilization = j["gpu_memory_utilization"];
  c.tensor_parallel_size = j["tensor_parallel_size"];
  c.enforce_eager = j["enforce_eager"];
  c.kvcache_block_size = j["kvcache_block_size"];
  c.num_kvcache_blocks = j["num_kvcache_blocks"];
  c.eos = j["eos"].get<std::vector<int>>();
  c.kv_cache_dtype = j["kv_cache_dtype"].get<std::string>();
  c.quantization = j["quantization"].get<std::string>();
  for (size_t i = 0; i < optimization_registry().size(); i++)
    c.opt.on[i] = j["opt"][optimization_registry()[i].name].get<bool>();
  return c;
}

// What INIT carries: the engine's Config and the model's (the workers do not read config.json again).
static std::string tp_init_payload(const Config& c, const ModelConfig& mc) {
  return json{{"config", config_to_json(c)}, {"model", model_config_to_json(mc)}}.dump();
}

// The communicator of this process for an engine with Config c, called first thing by ModelRunner. On
// rank 0 it connects the group (once per process: NCCL unique id -> CONNECT) and sends the workers c and
// mc, so they build the same engine alongside; on a worker the group is already connected.
static TPComm* tp_attach(const Config& c, const ModelConfig& mc, int rank, uint64_t* engine) {
  if (!g_tp.mb || g_tp.size != c.tensor_parallel_size)
    die("--tensor-parallel-size %d, but %d ranks were launched (tp_fork_workers must run before the first CUDA "
        "call)", c.tensor_parallel_size, g_tp.size);
  if (rank > 0) return g_tp.comm;
  if (!g_tp.comm) {
    CUDA_CHECK(cudaSetDevice(0));
    ncclUniqueId id;
    NCCL_CHECK(ncclGetUniqueId(&id));
    tp_send(TPOp::CONNECT, &id, sizeof id);
    g_tp.comm = tp_comm_init(0, g_tp.size, id);
  }
  const std::string text = tp_init_payload(c, mc);
  tp_send(TPOp::INIT, text.data(), text.size());
  *engine = ++g_tp.engines;
  return g_tp.comm;
}

// The worker loop (nano-vllm: ModelRunner.loop).
//
// A worker waits for a message and does what rank 0 does at the same point, so that every collective call
// on every rank has its partners: build the engine (weights, activations, the KV pool sized by the minimum
// over ranks), capture the same CUDA graphs in the same order, and for each step copy the step region to
// its GPU and run the same forward pass or replay the same graph. It never samples: rank 0 does, from the
// gathered logits.

// Wait until seq moves past `seen`; returns the new value.
static uint32_t tp_wait(uint32_t seen) {
  TPMailbox* mb = g_tp.mb;
  const double t0 = now_seconds();
  for (;;) {
    uint32_t s = __atomic_load_n(&mb->seq, __ATOMIC_ACQUIRE);
    if (s != seen) return s;
    if (now_seconds() - t0 < TP_SPIN_SECONDS) continue;
    struct timespec ts = {1, 0};  // a bounded sleep: the loop re-reads seq whatever woke it
    syscall(SYS_futex, &mb->seq, FUTEX_WAIT, seen, &ts, nullptr, 0);
  }
}

// The worker's half of ModelRunner::run: the step region is already in r's pinned buffer.
static void tp_replay_step(ModelRunner& r, const TPStep& st) {
  StepRegion& region = st.is_prefill ? r.prefill_region : r.decode_region;
  CUDA_CHECK(cudaMemcpyAsync(region.dev, region.host, st.bytes, cudaMemcpyHostToDevice, r.stream));
  if (st.is_prefill) {
    r.forward_and_sample(r.prefill_inputs(st.max_seqlen_q, st.decode_rows), st.T, st.B, true, r.prefill_samp.dev);
  } else {
    INTERNAL_CHECK(!st.graph_bs || r.graphs.count(st.graph_bs), "rank 0 replays a graph of batch %d, this rank "
                   "has none", st.graph_bs);
    r.run_decode(st.B, st.graph_bs != 0, st.max_seqlen_q, true);
  }
  CUDA_CHECK(cudaStreamSynchronize(r.stream));  // a failure surfaces here, in this step, named by rank
}

[[noreturn]] static void tp_worker_main(int rank) {
  g_tp_rank = rank;
  const size_t at = strlen(g_process_label);  // a replica's worker: "replica 2, rank 1" (section 47)
  snprintf(g_process_label + at, sizeof g_process_label - at, "%srank %d", at ? ", " : "", rank);
  if (g_tp_supervisor.worker_begins) g_tp_supervisor.worker_begins(rank);
  TPMailbox* mb = g_tp.mb;
  auto ack = [&] { __atomic_fetch_add(&mb->acks, 1, __ATOMIC_RELEASE); };
  Config config;
  std::unique_ptr<ModelRunner> runner;
  uint32_t seen = 0;
  long long steps = 0;
  for (;;) {
    seen = tp_wait(seen);
    g_tp.worker_busy = 1;
    INTERNAL_CHECK(runner || (mb->op != TPOp::CAPTURE && mb->op != TPOp::STEP),
                   "tensor-parallel message %d before any engine", (int)mb->op);
    switch (mb->op) {
      case TPOp::CONNECT: {
        ncclUniqueId id;
        memcpy(&id, mb->payload(), sizeof id);
        ack();
        g_tp.comm = tp_comm_init(rank, g_tp.size, id);
        break;
      }
      case TPOp::INIT: {
        const json init = json::parse(std::string(mb->payload(), mb->bytes));
        ack();
        runner.reset();  // like rank 0's previous engine, it keeps its GPU memory (ModelRunner frees nothing)
        config = config_from_json(init["config"].get<std::string>());
        const ModelConfig mc = model_config_from_json(init["model"].get<std::string>());
        validate_checkpoint(config.model, mc);  // a missing or broken folder: this rank's message, exit 1
        runner.reset(new ModelRunner(config, mc, rank));
        break;
      }
      case TPOp::CAPTURE:
        ack();
        runner->capture_cudagraphs();
        break;
      case TPOp::STEP: {
        TPStep st = mb->step;
        StepRegion& region = st.is_prefill ? runner->prefill_region : runner->decode_region;
        INTERNAL_CHECK(st.bytes <= region.bytes, "a step of %llu bytes for a region of %zu",
                       (unsigned long long)st.bytes, region.bytes);
        memcpy(region.host, mb->payload(), st.bytes);
        ack();
        if (g_tp_supervisor.worker_step) g_tp_supervisor.worker_step(rank, ++steps);
        tp_replay_step(*runner, st);
        break;
      }
      case TPOp::EXIT:
        ack();
        fflush(stderr);
        _exit(0);  // no teardown: the driver frees this process's GPU memory, and rank 0 waits for us
    }
  }
}


// ---- 12c. Data parallelism: the simplest way to use N GPUs ---------------------------------------------
//
// When the model fits on one GPU there is a simpler way to use N of them than splitting every matrix: run
// N whole engines, each on its own GPU, and share the requests among them (vLLM's --data-parallel-size).
// Nothing crosses between the engines while they run, so each reads its own weights and K/V at its own
// GPU's full bandwidth, with no all-reduce and no gathered logits: on an offline batch their speeds add up.
// Tensor parallelism is for what data parallelism cannot do:
// a model too large for one GPU, and one request (or a small batch) that must go faster, since its decode
// step reads 1/N of the weights per GPU. The two combine: N replicas of T GPUs each. The replicas are
// processes forked like this section's ranks, each running this file's engine unchanged; the queue they
// pull from, and how the run stops, are program plumbing (sections 46-47). docs/data-parallel.md has the
// measurements that say when each wins.

// ==== 13. LLMEngine: add_request, step, generate ===========================================================
// defines: Request, Completion, StepObserver, LLMEngine (add_request, step, generate)
//
// The loop that ties it together (nano-vllm: engine/llm_engine.py LLMEngine): requests become Sequences in
// the scheduler's waiting queue (n of them for a request with n > 1); each step() is one schedule() -> run()
// -> postprocess(), then the new tokens' text (stop strings) and log-probabilities; generate() steps until
// every request is finished and returns the completions in input order. A request may arrive later
// than the start (arrival_time): it joins the queue once the clock reaches it, which is how a server sees
// its traffic and what makes the two schedulers' difference visible.
//
// Watching the scheduler think: with --trace every step prints one line on stderr, every run ends with a
// summary, and --report draws the whole run. All of them watch through StepObserver (below; Part III
// implements it, section 42) and only read what the scheduler, the runner and the Sequences already keep.

struct Request {
  std::vector<int> prompt_token_ids;
  SamplingParams params;
  std::string source;         // "prompts.txt:12", for messages
  double arrival_time = 0;    // seconds after generate() begins (a .jsonl field, or --request-rate)
  bool arrival_given = false; // the .jsonl line gave it (--request-rate leaves it alone)
  std::string error;          // an OpenAI batch line we answer with an error instead of running (section 39)
  json batch;                 // that batch line's custom_id, url and body (section 39); null otherwise
  int index = -1;             // its place in the whole input when a run holds only part of it (a shard,
                              // section 41); -1: its place in generate()'s input
};

// One completion: a request with n > 1 has n of them, consecutive, in index order.
struct Completion {
  std::vector<int> token_ids;
  const char* finish_reason;  // nullptr: unfinished (the run was interrupted by Ctrl-C, section 45)
  int prompt_tokens;
  double arrival_time = 0, first_token_time = -1, finish_time = -1;  // seconds since generate() began (-1: never)
  int64_t seq_id = 0;
  int request = 0;            // the Request's place in the input (Request::index, else in generate()'s)
  int index = 0;              // which of its n completions (vLLM: CompletionOutput.index)
  std::string text;           // decoded, cut at a stop string (empty when the engine has no tokenizer)
  int stop_token_id = -1;     // vLLM's stop_reason: the stop token id, or the stop string, or neither (-1, "")
  std::string stop_string;
  std::vector<TokenLogprobs> logprobs;  // one per output token, when the request asked for logprobs
  double cumulative_logprob = 0;
};

// Ctrl-C (section 45's handler sets it; main arms it): generate() stops after the step in flight.
static volatile sig_atomic_t g_stop_armed = 0;
static volatile sig_atomic_t g_stop_requested = 0;

struct LLMEngine;

// observer interface: StepObserver
// Whoever watches the engine run (Part III: the progress line, --trace, the run summary, --report) sees it
// through these calls, made around the three phases of a step. None of them may change what the engine
// computes; with no observer nothing is printed or kept but the completions' own times.
struct StepObserver {
  virtual void step_begins(const LLMEngine&) {}                                  // before schedule()
  virtual void scheduled(const LLMEngine&, const std::vector<Sequence*>&, bool) {}  // the batch, is_prefill
  virtual void ran(const LLMEngine&) {}                                          // after the model and sampler
  virtual void step_ends(const LLMEngine&, const std::vector<Sequence*>&, bool) {}  // tokens appended
  virtual void generate_ends(const LLMEngine&) {}                                // the loop has stopped
  virtual ~StepObserver() {}
};

struct LLMEngine {
  Config& config;
  StepRunner& runner;
  Scheduler scheduler;
  std::vector<std::unique_ptr<Sequence>> seqs;  // every sequence added, by seq_id
  std::deque<Sequence*> arriving;               // added but not yet due (later arrival_time), in arrival order
  StepObserver* observer = nullptr;
  const Tokenizer* tok = nullptr;  // decodes the output text (stop strings need it as it grows); may be null
  double t0 = 0;                   // the clock's reading when generate() began

  LLMEngine(Config& c, StepRunner& r) : config(c), runner(r), scheduler(c) {}

  double clock() const { return runner.now() - t0; }  // seconds since generate() began

  // nano-vllm: add_request. A request becomes n sequences (n completions, each with its own id and so its
  // own draws); they join the scheduler's waiting queue when the clock reaches the request's arrival_time.
  // request_index: the request's place in the input, carried to its Completions (and the key of its draws
  // when it has no seed, Sequence::sampling_seed).
  void add_request(const Request& req, int request_index = 0) {
    const Sequence* first_sibling = nullptr;
    for (int k = 0; k < req.params.n; k++) {
      SamplingParams sp = req.params;
      if (sp.seed >= 0) sp.seed += k;  // vLLM's parallel sampling: child k of a seeded request uses seed + k
      seqs.emplace_back(new Sequence((int64_t)seqs.size(), req.prompt_token_ids, sp, config.kvcache_block_size));
      Sequence* s = seqs.back().get();
      s->arrival_time = req.arrival_time;
      s->request_index = request_index, s->completion_index = k;
      s->first_sibling = first_sibling;
      if (k == 0) first_sibling = s;
      auto at = std::upper_bound(arriving.begin(), arriving.end(), s, [](const Sequence* a, const Sequence* b) {
        return a->arrival_time < b->arrival_time;  // ties: the order they were added
      });
      arriving.insert(at, s);
    }
  }
  // Moves the sequences whose arrival time has come into the waiting queue.
  void admit_arrivals() {
    for (double now = clock(); !arriving.empty() && arriving.front()->arrival_time <= now; arriving.pop_front())
      scheduler.add(arriving.front());
  }

  // nano-vllm: step. Schedule, run the model, append the sampled tokens.
  void step() {
    bool is_prefill;
    admit_arrivals();
    if (observer) observer->step_begins(*this);
    std::vector<Sequence*> batch = scheduler.schedule(is_prefill);
    if (!is_prefill)
      for (auto scheduled : g_hooks.decode_scheduled) scheduled(batch);  // (section 11's hooks)
    if (observer) observer->scheduled(*this, batch, is_prefill);
    std::vector<int> token_ids = runner.run(batch, is_prefill);
    if (observer) observer->ran(*this);
    std::vector<int> completions_before;  // a prompt chunk that does not end its prompt samples no token
    for (const Sequence* s : batch) completions_before.push_back(s->num_completion_tokens());
    scheduler.postprocess(batch, token_ids, is_prefill);
    for (size_t i = 0; i < batch.size(); i++)
      if (batch[i]->num_completion_tokens() > completions_before[i]) take_new_token(*batch[i], i);
    if (observer) observer->step_ends(*this, batch, is_prefill);
  }

  // What a sequence's new token (row `row` of the step) brings besides itself: its log-probabilities when the
  // request asked for them, its text when stop strings must be watched, and the completion's times.
  void take_new_token(Sequence& s, size_t row) {
    const TokenLogprobs* logprobs = runner.step_logprobs();
    if (logprobs && s.params.logprobs >= 0) {
      s.logprobs.push_back(logprobs[row]);
      s.cumulative_logprob += logprobs[row].logprob;
    }
    if (tok && !s.params.stop.empty()) detokenize(s);  // (the others' text is decoded once, at the end)
    const double now = clock();
    if (s.first_token_time < 0) s.first_token_time = now;
    if (s.is_finished()) s.finish_time = now;
  }

  // A token that ended the sequence as EOS or a stop token adds no text unless include_stop_str_in_output.
  static bool last_token_has_no_text(const Sequence& s) {
    return s.is_finished() && !strcmp(s.finish_reason, "stop") && s.stop_string.empty() &&
           !s.params.include_stop_str_in_output;
  }

  // The text of a sequence's new token, then its stop strings (vLLM: detokenizer.py
  // IncrementalDetokenizer.update). Only a sequence with stop strings needs its text while it runs; the
  // others' is decoded once, when generate() returns (the same text). The search looks only where the new
  // text can complete a match: the last (new bytes + stop length - 1) bytes. As in vLLM, stop strings are
  // tried in the order given (the first that matches wins, not the earliest in the text), only once more
  // than min_tokens tokens are out, and on a sequence that just finished by length too. A match cuts the
  // text before the stop string (or after it, with include_stop_str_in_output), and finishes the sequence
  // with reason "stop".
  void detokenize(Sequence& s) {
    const size_t before = s.text.size();
    if (!last_token_has_no_text(s)) {
      if (s.last_token >= 0 && s.last_token < tok->vocab_size()) {  // (ids past the tokenizer: no text, as decode)
        const std::string& bytes = tok->id_to_bytes[s.last_token];
        s.text_repair.feed(bytes.data(), bytes.size(), s.text);
      }
    }
    if (s.is_finished()) s.text_repair.finish(s.text);
    const size_t added = s.text.size() - before;
    if (s.params.stop.empty() || added == 0 || s.num_completion_tokens() <= s.params.min_tokens) return;
    for (const std::string& stop : s.params.stop) {
      const size_t from = s.text.size() > added + stop.size() - 1 ? s.text.size() - added - stop.size() + 1 : 0;
      const size_t at = s.text.find(stop, from);
      if (at == std::string::npos) continue;
      s.text.resize(s.params.include_stop_str_in_output ? at + stop.size() : at);
      s.stop_string = stop;
      if (s.is_finished()) s.finish_reason = "stop";  // it had just reached max_tokens
      else scheduler.finish(&s, "stop");
      return;
    }
  }

  // nano-vllm: generate. Steps until every request has finished, or until a Ctrl-C asks the run to stop
  // (g_stop_requested): then the step in flight completes and the unfinished requests come back with
  // finish_reason nullptr and the tokens they had so far. While nothing is left to run before the next
  // arrival, the runner waits for it. Returns the completions in input order (a request's n together).
  std::vector<Completion> generate(const std::vector<Request>& requests) {
    t0 = runner.now();
    const size_t first = seqs.size();
    for (size_t r = 0; r < requests.size(); r++)  // (one with an error is answered with it instead, section 40)
      if (requests[r].error.empty()) add_request(requests[r], requests[r].index >= 0 ? requests[r].index : (int)r);
    while (!g_stop_requested) {
      admit_arrivals();
      if (scheduler.is_finished()) {  // idle until the next request arrives (a Ctrl-C ends the wait too)
        if (arriving.empty()) break;
        const double due = t0 + arriving.front()->arrival_time;
        while (!g_stop_requested && runner.now() < due) runner.wait_until(std::min(due, runner.now() + 0.05));
        continue;
      }
      step();
    }
    if (observer) observer->generate_ends(*this);
    std::vector<Completion> out;
    for (size_t i = first; i < seqs.size(); i++) out.push_back(completion_of(*seqs[i]));
    return out;
  }

  // A sequence's completion as it stands (unfinished: finish_reason nullptr), its text decoded now unless
  // stop strings had it decoded as it grew.
  Completion completion_of(Sequence& s) const {
    if (tok && s.params.stop.empty() && s.is_finished()) {
      const int n = s.num_completion_tokens() - last_token_has_no_text(s);
      s.text = tok->decode(std::vector<int>(s.token_ids.begin() + s.num_prompt_tokens,
                                            s.token_ids.begin() + s.num_prompt_tokens + n));
    }
    return {std::vector<int>(s.token_ids.begin() + s.num_prompt_tokens, s.token_ids.end()),
            s.finish_reason, s.num_prompt_tokens, s.arrival_time, s.first_token_time, s.finish_time,
            s.seq_id, s.request_index, s.completion_index, s.text, s.stop_token_id, s.stop_string,
            s.logprobs, s.cumulative_logprob};
  }
};

// ##########################################################################################################
// PART II — MAKING IT FAST
// ##########################################################################################################
// Part I is complete: every request runs, and every result is right. This part makes it fast, and can be
// taken away: nothing before it or after it names what it defines. Each chapter below is one optimization:
// what it replaces, why that is faster on the hardware, its switch, and where docs/performance.md has its
// measurement. A chapter registers its switch with Part I's registry (register_optimization, section 2:
// `--opt -NAME` turns one off, `--plain` all of them) and, when switched on, installs its own change: it fills
// the entries of Part I's hook table (Hooks, section 11) or of section 14's stage table for the code it
// replaces, so it changes the engine without help from a later chapter. The Part I code each one replaces
// stays: it is what --plain runs, and what the GPU tests check the fast code against (bit for bit where the
// arithmetic is the same, else a stated tolerance). `./bench.sh --ladder` measures Part I alone, Part I plus
// each chapter, and everything.
//
// Where the time goes, and so what there is to win: a decode step must read every weight and every active
// sequence's K/V once, so its floor is those bytes over the memory bandwidth (the roofline). Section 14 first
// cuts section 6c's forward pass into stages a chapter can replace. Part I's attention reads each key once
// per query head and per query row; flash attention (15-16) shares each tile of keys among them on tensor
// cores, and is what brings large batches near the roofline. Small batches are not near it: a batch-1 step of
// Qwen3-0.6B is hundreds of small kernels, and what costs is matrix products too thin for cuBLASLt's tiles
// and the gaps between the kernels (the gemv chapter, 17-18: how its kernels launch, then the gemv), and the
// kernels that exist only to merge partial results or to prepare q and k (19). With tensor parallelism,
// NCCL's latency on small messages (20). A sampler that reads its row many times (21-22). Prefill and mixed
// steps launched kernel by kernel (23). Then 24-27 run a small decode step as one kernel, 28-30 halve the
// bytes of the weights (FP8) and 31-32 those of the cache. A mixture-of-experts model's experts on Part I's
// plain tiled products (33), a decode step's experts read at a fraction of the bandwidth by any tile (34),
// the experts' bytes halved too (35), and a decode step's MoE layers, still a few kernels each, in the one
// persistent kernel (36).

// Defined only while this part is in the file: a test that also exercises Part II asks for it.
#define NANOVLLM_PART_II 1

// The switches of this part, one per section (each section registers its own with Part I's registry,
// section 2, and fills its hook entries, section 11, when on). They live here, so that Part I and Part III
// never name them.
struct Optimizations {
  bool flash_attn = false;         // 15-16: flash attention on tensor cores, not section 8's kernels
  bool pdl = false;                // 17-18: the next kernel launches while the previous one finishes
  bool gemv = false;               // 18: batch-1/2 matrix products in a gemv with its neighbours fused in
  bool cluster_merge = false;      // 19: decode's split-K merge inside a cluster, no merge kernel
  bool fused_rope = false;         // 19: q/k-norm, RoPE and the KV store 8 lanes a head, in decode in attention
  bool oneshot_allreduce = false;  // 20: small all-reduces over NVLink in one crossing, not NCCL's ring
  bool twoshot_allreduce = false;  // 20b: large ones at N > 2 in two crossings (scatter, gather)
  bool bisect_sampler = false;     // 21: the sampler's cut by bisection, not section 9's sort
  bool fast_sampler = false;       // 22: radix-select top-k/top-p and split rows, not the plain sampler
  bool prefill_graphs = false;     // 23: prefill and mixed steps replay CUDA graphs, attention between pieces
  bool longest_first = false;      // 32a: an fp8 decode step's rows in order of context length, longest first
  bool fused_moe = false;          // 33: a MoE layer's experts as grouped products on tensor cores
  bool moe_gemv = false;           // 34: a small step's MoE layer as a gemv per routed expert
  bool persistent = false;         // 24-27: a small-batch decode step in one persistent kernel
  bool fp8_weights = false;        // 28-29: an FP8 checkpoint's linear weights kept in FP8 (--quantization fp8)
  bool fp8_gemv = false;           // 29: with FP8 weights, batch-1/2 products in a tensor-core gemv
  bool fp8_moe = false;            // 35: with FP8 weights, a MoE layer's experts in FP8 too
  bool persistent_moe = false;     // 36: a MoE model's small decode steps in the persistent kernel
};
static Optimizations g_opt;  // set by each section's apply (install_optimizations, section 11)

// ==== 14. The forward pass, in stages a chapter can replace ===============================================
// defines: Pass, store_qkv_using, ForwardStages, g_stages, stages_for, forward_fast, lm_head_logits
//
// Section 6c's forward pass is a list of named calls. The chapters of this part each replace a few of them
// (flash attention replaces the attention calls, the gemv the matrix products of small steps, the one-shot
// all-reduce the sums over the GPUs), so this section writes the same pass once more, with those calls
// cut into stages, and a table that says which code runs each stage. Every entry starts as Part I's code:
// with no chapter switched on, forward_fast computes exactly what Qwen3::forward computes, with the same
// kernels in the same order. A chapter switched on writes its own function into the entries it replaces
// (in its apply, section 2's switch), and so it changes the engine by itself, whatever comes after it.
//
//   per layer          Part I's stage                                   replaced by
//   norm_matmul        y = RMSNorm(residual) @ W^T: rmsnorm + cuBLASLt   18 (gemv: the norm inside the gemv),
//                                                                        29 (FP8 weights)
//   store_qkv          q/k-norm, RoPE, this step's K/V into the cache    19 (eight threads a head), 31 (fp8)
//   attention_prefill  section 8's prefill kernel                        15-16 (flash attention), 31 (fp8)
//   attention_decode   store_qkv, then section 8's decode kernel         16, then 19 (all in one kernel), 31
//   matmul_out         h = x @ W^T (after SiLU-and-mul for down), summed over the ranks   18, 29
//   moe                a MoE layer's MLP: RMSNorm, then section 10b's moe_mlp, summed   33 (the experts' products
//                                                                        on tensor cores: fused_moe), 34 (small
//                                                                        steps: a gemv per routed expert)
//   all_reduce         NCCL's all-reduce (section 12)                    20 (one or two crossings of NVLink)
// and one entry that only a chapter fills: cut (23: where a CUDA graph of a prefill step ends a piece).
// A MoE layer's MLP is the moe stage alone, so the chapters that replace norm_matmul and matmul_out (the
// gemv, FP8 weights) change only its attention's products, and what replaces attention applies as it is.
//
// The residual stream. Part I adds a sub-layer's output h to the residual stream inside the next RMSNorm
// (add_rmsnorm). A chapter may add it earlier, where that costs no kernel of its own: in the gemv's
// epilogue, or inside the all-reduce that sums h over the GPUs. So the stages share one fact, Pass::pending:
// h waits in act.hidden for the next norm_matmul (or the final norm) to add it. A stage that adds h itself
// clears it; norm_matmul always clears it.
//
// A chapter's apply (a switch's, or a KV cache format's: section 2) calls stages_for(h) to get the table: the
// first call after install_optimizations has emptied Part I's hook table (section 11) starts the table over
// from Part I's stages and makes forward_fast the forward hook, so each engine's table holds exactly the
// chapters its Config switches on. No chapter writes g_stages itself.
//
// Each chapter keeps what it holds for an engine (its plans, its graphs, its cache's scales) in one state of
// its own, which its apply resets: install_optimizations runs every chapter's apply, on or off, for every
// engine. The switches themselves are g_opt's fields (above), each set by its chapter's apply.

// One step's forward pass, as its stages share it.
struct Pass {
  Qwen3& m;
  const StepInputs& in;
  int T, B;                // tokens and sequences of the step
  bool is_prefill;
  cudaStream_t s;
  bool pending = false;    // act.hidden holds a sub-layer's output not yet added to act.residual
  int l = 0;               // the layer the pass is in
};

// Part I's stages: the calls of section 6c, one stage each. A sub-layer begins with act.x = RMSNorm(residual),
// after residual += hidden where p.pending (norm_residual).
static void norm_residual(Pass& p, const bf16* norm_w) {
  Activations& a = p.m.act;
  const int H = p.m.cfg.hidden_size;
  const float eps = p.m.cfg.rms_norm_eps;
  if (p.pending) add_rmsnorm(a.x, a.residual, a.hidden, norm_w, p.T, H, eps, p.s);
  else rmsnorm(a.x, a.residual, norm_w, p.T, H, eps, p.s);
  p.pending = false;
}
static void norm_matmul_plain(Pass& p, bf16* y, const bf16* norm_w, const bf16* W, int N) {
  norm_residual(p, norm_w);
  linear(*p.m.gemm, y, p.m.act.x, W, p.T, N, p.m.cfg.hidden_size, p.s);
}
static bool all_reduce_plain(TPComm* comm, bf16* x, size_t n, cudaStream_t s, bf16*) {
  all_reduce_sum(comm, x, n, s);
  return false;  // summed in place; nothing added to the residual stream
}
static void matmul_out_plain(Pass& p, const bf16* x, const bf16* W, int K, bool gate_up);
// A store_qkv stage from a launcher with qk_norm_rope's arguments, given layer l's cache as that launcher
// takes it (section 19's faster kernel and the FP8 chapter's store make their stages so too).
template <typename Launch, typename Cache>
static void store_qkv_using(Pass& p, int l, Launch launch, const Cache& cache) {
  const Qwen3& m = p.m;
  const ModelConfig& c = m.cfg;
  const LayerWeights& lw = m.w.layers[l];
  launch(m.act.qkv, p.in.positions, lw.q_norm, lw.k_norm, cache, p.in.slot_mapping, p.T,
         c.num_attention_heads / m.tp, c.num_key_value_heads / m.tp, m.P, c.rope_theta, c.rms_norm_eps, p.s);
}
static void store_qkv_plain(Pass& p, int l) { store_qkv_using(p, l, qk_norm_rope, p.m.kv.layer(l)); }
static void attention_prefill_plain(Pass& p, int l) {
  const Qwen3& m = p.m;
  const ModelConfig& c = m.cfg;
  attention_prefill(m.act.attn, m.act.qkv, m.kv.layer(l), p.in.cu_seqlens_q, p.in.seqlens_k, p.in.block_tables,
                    p.B, p.in.max_seqlen_q, c.num_attention_heads / m.tp, c.num_key_value_heads / m.tp, m.P, m.MB,
                    1.0f / sqrtf((float)c.head_dim), p.s);
}
static void attention_decode_plain(Pass& p, int l);
static void moe_plain(Pass& p, const LayerWeights& lw);

// The table. Each entry's comment says what it must compute; the default is Part I's code.
struct ForwardStages {
  // y [T, N] = RMSNorm(residual) @ W^T, after residual += hidden where p.pending; clears p.pending. (W, and
  // matmul_out's, is null where a chapter holds layer p.l's matrices in a format of its own, section 28.)
  void (*norm_matmul)(Pass& p, bf16* y, const bf16* norm_w, const bf16* W, int N) = norm_matmul_plain;
  // A sub-layer's output h [T, H] = x @ W^T (x [T, K]; with gate_up, x is gate_up [T, 2K] and the product is
  // of SiLU(gate) * up), summed over the ranks, then either left in act.hidden (p.pending) or added.
  void (*matmul_out)(Pass& p, const bf16* x, const bf16* W, int K, bool gate_up) = matmul_out_plain;
  // Layer p.l's MoE MLP (a MoE layer, section 10b): h [T, H] = moe_mlp(RMSNorm(residual)), after residual +=
  // hidden where p.pending, summed over the ranks, then left in act.hidden (p.pending) or added.
  void (*moe)(Pass& p, const LayerWeights& lw) = moe_plain;
  // x [n] summed over the ranks. Given `residual`, it may add the sum into residual instead, and says so.
  bool (*all_reduce)(TPComm* comm, bf16* x, size_t n, cudaStream_t s, bf16* residual) = all_reduce_plain;
  // Layer l: q/k-norm and RoPE of act.qkv in place, this step's keys and values into the cache.
  void (*store_qkv)(Pass& p, int l) = store_qkv_plain;
  // Layer l's attention of a prefill step (store_qkv done) into act.attn.
  void (*attention_prefill)(Pass& p, int l) = attention_prefill_plain;
  // Layer l's attention of a decode step from the raw projection act.qkv (store_qkv included) into act.attn.
  void (*attention_decode)(Pass& p, int l) = attention_decode_plain;
  // Filled by section 23 while it captures a prefill step in pieces: ends a piece (before a layer's attention
  // and before the LM head) and says the pass must skip what follows it. Empty: the pass runs whole.
  bool (*cut)(cudaStream_t s) = nullptr;
};
static ForwardStages g_stages;

static void attention_decode_plain(Pass& p, int l) {
  const Qwen3& m = p.m;
  const ModelConfig& c = m.cfg;
  g_stages.store_qkv(p, l);
  attention_decode(m.act.attn, m.act.qkv, m.kv.layer(l), p.in.seqlens_k, p.in.block_tables, p.B,
                   c.num_attention_heads / m.tp, c.num_key_value_heads / m.tp, m.P, m.MB,
                   1.0f / sqrtf((float)c.head_dim), p.s);
}
static void matmul_out_plain(Pass& p, const bf16* x, const bf16* W, int K, bool gate_up) {
  Activations& a = p.m.act;
  const int H = p.m.cfg.hidden_size;
  if (gate_up) {
    silu_and_mul(a.act, x, p.T, K, p.s);
    x = a.act;
  }
  linear(*p.m.gemm, a.hidden, x, W, p.T, H, K, p.s);
  p.pending = true;
  if (p.m.tp > 1 && g_stages.all_reduce(p.m.comm, a.hidden, (size_t)p.T * H, p.s, a.residual)) p.pending = false;
}

static void moe_plain(Pass& p, const LayerWeights& lw) {
  Activations& a = p.m.act;
  const int H = p.m.cfg.hidden_size;
  norm_residual(p, lw.post_attention_layernorm);
  moe_mlp(a.hidden, a.x, lw, p.m.cfg, p.m.tp, p.T, *p.m.gemm, a, p.s);
  p.pending = true;
  if (p.m.tp > 1 && g_stages.all_reduce(p.m.comm, a.hidden, (size_t)p.T * H, p.s, a.residual)) p.pending = false;
}

static void forward_fast(Qwen3& model, const StepInputs& in, int T, int B, bool is_prefill, cudaStream_t s);
// The table a chapter's apply fills (see above): started over from Part I's stages at the first call of each
// install_optimizations, which also makes forward_fast the forward hook.
static ForwardStages& stages_for(Hooks& h) {
  if (h.forward != forward_fast) {
    g_stages = ForwardStages{};
    h.forward = forward_fast;
  }
  return g_stages;
}

// The step's logits from the final normed rows (act.x): in a prefill step only each sequence's last row needs
// them (nano-vllm: ParallelLMHead).
static void lm_head_logits(Qwen3& model, const StepInputs& in, int B, bool is_prefill, cudaStream_t s) {
  const int H = model.cfg.hidden_size, V = (int)cdiv(model.cfg.vocab_size, model.tp);
  const bf16* last = model.act.x;
  if (is_prefill) {
    gather_last_tokens(model.act.last, model.act.x, in.cu_seqlens_q, B, H, s);
    last = model.act.last;
  }
  linear(*model.gemm, model.act.logits, last, model.w.lm_head, B, V, H, s, CUDA_R_32F);
}

// Section 6c's pass, stage by stage (the forward hook of every chapter that fills a stage).
static void forward_fast(Qwen3& model, const StepInputs& in, int T, int B, bool is_prefill, cudaStream_t s) {
  const ModelConfig& cfg = model.cfg;
  const Weights& w = model.w;
  Activations& act = model.act;
  const ForwardStages& st = g_stages;
  const int H = cfg.hidden_size, I = cfg.intermediate_size / model.tp, D = cfg.head_dim;
  const int NH = cfg.num_attention_heads / model.tp, NKV = cfg.num_key_value_heads / model.tp;
  const int V = (int)cdiv(cfg.vocab_size, model.tp);
  Pass p{model, in, T, B, is_prefill, s};
  embedding(act.residual, in.input_ids, w.embed_tokens, T, H, model.rank * V, V, s);
  if (model.tp > 1) st.all_reduce(model.comm, act.residual, (size_t)T * H, s, nullptr);  // ids of each rank
  for (int l = 0; l < cfg.num_hidden_layers; l++) {
    const LayerWeights& lw = w.layers[l];
    p.l = l;
    st.norm_matmul(p, act.qkv, lw.input_layernorm, lw.qkv_proj, (NH + 2 * NKV) * D);
    if (is_prefill) {
      st.store_qkv(p, l);
      if (!(st.cut && st.cut(s))) st.attention_prefill(p, l);
    } else {
      st.attention_decode(p, l);
    }
    st.matmul_out(p, act.attn, lw.o_proj, NH * D, false);
    if (cfg.is_moe_layer(l)) {
      st.moe(p, lw);
      continue;
    }
    st.norm_matmul(p, act.gate_up, lw.post_attention_layernorm, lw.gate_up_proj, 2 * I);
    st.matmul_out(p, act.gate_up, lw.down_proj, I, true);
  }
  if (p.pending) add_rmsnorm(act.x, act.residual, act.hidden, w.norm, T, H, cfg.rms_norm_eps, s);
  else rmsnorm(act.x, act.residual, w.norm, T, H, cfg.rms_norm_eps, s);
  if (is_prefill && st.cut && st.cut(s)) return;
  lm_head_logits(model, in, B, is_prefill, s);
}

// ==== 15. Flash attention on tensor cores: the tiles and the prefill kernel ================================
// defines: KVBf16 (15a: the cache format, a template parameter), attend_kv_slice, flash_attention_prefill
//          (section 16: decode, and the switch flash_attn)
//
// Replaces: section 8's attention kernels, which give each (query row, head) a warp of its own. There,
// every query head of a GQA group reads the same keys again, every row of a prefill reads its keys again,
// and each key costs a shuffle reduction on the CUDA cores. Here a thread block loads a tile of 64 keys
// and values into shared memory once and every row and head that needs it computes from there, with the
// matrix products on tensor cores; decode splits long contexts over several thread blocks (split-K) so
// that a small batch still fills the GPU. The equations are section 8's; what changes is who computes what.
// Switch: flash_attn. Tested against section 8's kernels and the CPU reference (gpu_attention).
// The kernels are templates over a cache format F, how they read K and V from the cache (15a, below): read
// F as KVBf16, Part I's bf16 cache, until section 31.
//
// Both kernels are flash-attention-2: a warp holds 16 query rows, streams K and V tiles of 64 keys
// through shared memory, computes S = Q K^T with tensor cores, keeps a running row max m and row sum l
// (the online softmax), rescales its fp32 output accumulator O when m grows, and adds P V, again on
// tensor cores. Only at the end is O divided by l. Scores never touch memory.
// Decode reuses the same warp routine: its 16 MMA rows are the query heads of one GQA group (one query
// token), so each K/V tile is read once for all the heads that share it. Most of those 16 rows are
// padding (2 of 16 are real for Qwen3-0.6B), but tensor cores have about ten times the throughput decode
// needs, and decode is bound by reading the cache anyway.
//
// Tensor-core vocabulary used below (PTX ISA, "warp-level matrix fragments for mma.m16n8k16"):
//   mma.m16n8k16   D[16x8] += A[16x16] * B[16x8], bf16 in, fp32 out, one warp. In A and in the fp32
//                  accumulator a lane owns rows lane/4 and lane/4 + 8, and in each 8-wide column group
//                  the columns 2*(lane%4) and 2*(lane%4)+1. So acc[j][0..1] is row lane/4, acc[j][2..3]
//                  is row lane/4 + 8, and the four lanes of a quad share a row.
//   ldmatrix.x4    loads four 8x8 bf16 matrices from shared memory straight into that fragment layout;
//                  lanes 0-7, 8-15, 16-23, 24-31 give the row addresses of matrix 0, 1, 2, 3. With .trans
//                  each matrix arrives transposed (how V, stored [key][dim], becomes the B of P V).
//   cp.async       a 16-byte global -> shared copy that does not block the thread; groups of them are
//                  committed and later waited for, so the next tile loads while this one is computed.


__device__ __forceinline__ int cdiv_dev(int a, int b) { return (a + b - 1) / b; }

constexpr int ATTN_KV_TILE = 64;       // keys per shared-memory tile (K and V each: 64 x 128 bf16 = 16 KiB)
constexpr int ATTN_STAGES = 2;         // K/V tiles in shared memory: tile t+1 loads while tile t computes
                                       // (a third stage would leave room for fewer thread blocks per SM)
constexpr int PREFILL_WARPS = 8;       // warps of one prefill CTA, 16 query rows each
constexpr int PREFILL_BLOCK_M = 16 * PREFILL_WARPS;  // query rows of one prefill CTA
constexpr int DECODE_WARPS = 4;        // warps of one decode CTA, 16 keys of every tile each
constexpr int DECODE_PARTITION = 512;  // keys per decode thread block at large batches: the split-K
                                       // partition size (long enough that the merge stays cheap; the batch
                                       // alone fills the GPU). Small batches split finer: decode_partition().
constexpr int DECODE_ROWS = 16;        // MMA rows in decode: the query heads of one GQA group, padded to 16
static_assert(DECODE_WARPS * 32 == HEAD_DIM, "the decode epilogue gives each thread one output dim");
static_assert(DECODE_WARPS * 16 == ATTN_KV_TILE, "decode warps split each tile 16 keys apiece");
static_assert(DECODE_PARTITION % ATTN_KV_TILE == 0, "partitions are made of whole tiles");

// Keys per decode CTA for a batch of B sequences. With few sequences, 512-key partitions leave most of the
// GPU idle (B = 1, NKV = 8, a 768-token context: 16 CTAs for 132 SMs), so small batches use shorter
// partitions and more CTAs; the merge kernel pays for it with a few more partials. Depends on B (and the
// cache's format, fixed for a run) only, so a graph captured for a batch size keeps its grid. (On sm_90 and
// later, batches of at most 4 take the cluster path below instead, whose partitions follow the context.)
static int decode_partition(int B) { return B <= 4 ? 64 : B <= 32 ? 128 : DECODE_PARTITION; }

// A shared-memory tile row is HEAD_DIM bf16 = 256 bytes = 16 chunks of 16 bytes. ldmatrix reads one chunk
// column of 8 consecutive rows at once; stored plainly those 8 chunks are 256 bytes apart, all in the same
// 4 banks (an 8-way conflict). XOR-ing the chunk index with row % 8 puts them in 8 different bank groups.
// Writers (cp.async) and readers (ldmatrix) both go through this function, so they agree.
__device__ __forceinline__ int attn_smem_index(int row, int chunk) {
  return row * HEAD_DIM + ((chunk ^ (row & 7)) << 3);
}

// 16-byte asynchronous copy global -> shared. With valid = false it reads nothing (source size 0) and
// writes 16 zero bytes; gmem must still be a legal address, callers pass the buffer's base. .cg skips L1
// (each byte is used once per thread block); L2::128B asks L2 to fetch whole 128-byte lines.
__device__ __forceinline__ void cp_async_16(bf16* smem, const bf16* gmem, bool valid) {
  uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const bf16* smem) {
  uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const bf16* smem) {
  uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// acc[16x8] += a[16x16] * (b0, b1)[16x8], bf16 inputs, fp32 accumulate.
__device__ __forceinline__ void mma_bf16_16816(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // lo lands in the low half: the smaller column
  return *reinterpret_cast<uint32_t*>(&v);
}
// The same two on fp16 tiles (the FP8 chapters' values, converted to fp16: sections 30a, 31-32).
__device__ __forceinline__ void mma_f16_16816(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// 2^x in one instruction (MUFU.EX2, relative error ~2^-22); 2^-inf = 0, which the masking relies on.
// The softmax works in base 2: exp(s*scale - m*scale) = 2^(s*scale*log2(e) - m*scale*log2(e)).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The row of key `key` of kv head kvh in one layer's cache [NB, NKV, P, D] (a row is D values), found
// through the sequence's block table.
__device__ __forceinline__ size_t kv_cache_row(const int* block_table, int kvh, int NKV, int log2P, int key) {
  const size_t block = block_table[key >> log2P];
  return ((block * NKV + kvh) << log2P) + (key & ((1 << log2P) - 1));
}

// Issue (not wait for) the copies of keys [key0, key0 + ATTN_KV_TILE) of kv head kvh of one sequence into
// the K and V tiles sK, sV [ATTN_KV_TILE][HEAD_DIM] (swizzled). Keys at or past key_end are zero-filled
// instead of read: their block-table entries are -1, and the unused tail of a sequence's last block holds
// stale or never-written data; a NaN there would survive the softmax mask as 0 * NaN in P V.
// All NTHREADS threads of the CTA call it: 16 threads copy one 256-byte row. The row of key skip_key is
// left alone (not even zero-filled): the fused decode kernel writes that key itself.
template <int NTHREADS>
__device__ __forceinline__ void load_kv_tile(bf16* sK, bf16* sV, const bf16* k_cache, const bf16* v_cache,
                                             const int* block_table /* [MB] */, int kvh, int NKV, int log2P,
                                             int key0, int key_end, int skip_key = -1) {
  const int chunk = threadIdx.x & 15;
#pragma unroll
  for (int r = threadIdx.x >> 4; r < ATTN_KV_TILE; r += NTHREADS / 16) {
    const int key = key0 + r;
    if (key == skip_key) continue;
    const bool valid = key < key_end;
    const size_t offset = valid ? kv_cache_row(block_table, kvh, NKV, log2P, key) * HEAD_DIM + chunk * 8 : 0;
    cp_async_16(sK + attn_smem_index(r, chunk), k_cache + offset, valid);
    cp_async_16(sV + attn_smem_index(r, chunk), v_cache + offset, valid);
  }
}

// ---- 15a. The cache format: how the kernels read K and V ----------------------------------------------------
// Every kernel of Part II that reads or writes the KV cache (the two of this chapter, section 19's fused
// decode kernel, the persistent kernel of sections 24-26) is a template over a cache format F: a struct of
// types and forceinline functions that say how the kernel reads keys and values from the cache and stores
// them: what one cached value is, how a tile of keys and values reaches shared memory and the tensor cores,
// what the scores and the output are multiplied by, and how this step's key or value is stored. Part I's
// cache (section 6b) holds bf16, as the model computes keys and values, and its format, KVBf16 below, moves
// them as they are. Why a parameter at all: with --kv-cache-dtype fp8 the cache holds one byte per value, with
// a scale per layer for the keys and one for the values, and the FP8 chapter (sections 31-32) runs these same
// kernels with a format of its own rather than a second copy of each. Until then KVBf16 is the only format:
// read F as KVBf16 until section 31. Every piece is inlined, so KVBf16's kernels are the plain bf16 ones and a
// format costs nothing at run time.
// The tile pipeline both kernels run: tile `index` (keys key0 ..) is issued tiles_ahead tiles before it is
// needed, one committed cp.async group per tile; when its turn comes, every thread calls tile_ready once the
// tile has landed for it (cp_async_wait), before the barrier that publishes it, and learns where it lies as a
// [ATTN_KV_TILE][HEAD_DIM] tile (swizzled) of F::Tile. For bf16 the copies land straight in stage
// index % ATTN_STAGES of sK, sV, and there is nothing more to do. skip_key: a key the copies leave alone, for
// section 19's fused decode kernel, which writes that key itself (-1: none).
struct KVBf16 {
  using Elem = bf16;       // one cached value
  using Tile = bf16;       // what the tensor cores multiply: the element of a shared-memory tile
  struct Scales {};        // what a layer's stored keys and values must be multiplied by: nothing
  using Layer = KVLayer;   // one layer's cache as the launchers take it: keys, values [NB, NKV, P, D]
  static bf16* keys(const KVLayer& c) { return c.k; }
  static bf16* values(const KVLayer& c) { return c.v; }
  static Scales scales(const KVLayer&) { return {}; }

  static constexpr int tiles_ahead = ATTN_STAGES - 1;
  template <int NTHREADS>
  __device__ static __forceinline__ void issue_tile(bf16* sK, bf16* sV, const bf16* k_cache, const bf16* v_cache,
                                                    const int* block_table, int kvh, int NKV, int log2P, int index,
                                                    int key0, int key_end, int skip_key) {
    constexpr int TILE = ATTN_KV_TILE * HEAD_DIM;
    load_kv_tile<NTHREADS>(sK + (index % ATTN_STAGES) * TILE, sV + (index % ATTN_STAGES) * TILE, k_cache, v_cache,
                           block_table, kvh, NKV, log2P, key0, key_end, skip_key);
  }
  template <int NTHREADS>
  __device__ static __forceinline__ void tile_ready(bf16* sK, bf16* sV, int index, bf16*& sK_t, bf16*& sV_t) {
    constexpr int TILE = ATTN_KV_TILE * HEAD_DIM;
    sK_t = sK + (index % ATTN_STAGES) * TILE, sV_t = sV + (index % ATTN_STAGES) * TILE;
  }
  // acc[16x8] += a[16x16] * (b0, b1)[16x8] on the tiles' element, and two floats packed as its input.
  __device__ static __forceinline__ void mma(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    mma_bf16_16816(acc, a, b0, b1);
  }
  __device__ static __forceinline__ uint32_t pack(float lo, float hi) { return pack_bf16x2(lo, hi); }
  // The Q fragments as the tiles' element (bf16: as they are), the scores' scale (scale * log2 e: unchanged)
  // and the output's (unchanged).
  __device__ static __forceinline__ void tile_q(uint32_t (&)[HEAD_DIM / 16][4]) {}
  __device__ static __forceinline__ float score_scale(float scale_log2, Scales) { return scale_log2; }
  __device__ static __forceinline__ void scale_output(float (&)[HEAD_DIM / 8][4], Scales) {}

  // The store (section 19's fused kernel, the persistent kernel): a 16-byte chunk of 8 bf16 values v, a key
  // or a value, to elements [8 chunk, 8 chunk + 8) of a cache row. The values an attention tile holds for it
  // after the store and a tile load ("tile values": v itself), and the store of such tile values.
  __device__ static __forceinline__ void store_key(bf16* row, int chunk, uint4 v, Scales) {
    reinterpret_cast<uint4*>(row)[chunk] = v;
  }
  __device__ static __forceinline__ void store_value(bf16* row, int chunk, uint4 v, Scales) {
    reinterpret_cast<uint4*>(row)[chunk] = v;
  }
  __device__ static __forceinline__ uint4 key_tile_values(uint4 v, Scales) { return v; }
  __device__ static __forceinline__ uint4 value_tile_values(uint4 v, Scales) { return v; }
  __device__ static __forceinline__ void store_tile_values(bf16* row, int chunk, uint4 tile_values) {
    reinterpret_cast<uint4*>(row)[chunk] = tile_values;
  }
};

// The first F::tiles_ahead tiles of keys [key_begin, key_end), one committed group each (empty past the end).
template <int NTHREADS, class F>
__device__ __forceinline__ void issue_first_kv_tiles(bf16* sK, bf16* sV, const typename F::Elem* k_cache,
                                                     const typename F::Elem* v_cache, const int* block_table,
                                                     int kvh, int NKV, int log2P, int key_begin, int key_end,
                                                     int skip_key = -1) {
#pragma unroll
  for (int t = 0; t < F::tiles_ahead; t++) {
    const int key0 = key_begin + t * ATTN_KV_TILE;
    if (key0 < key_end)
      F::template issue_tile<NTHREADS>(sK, sV, k_cache, v_cache, block_table, kvh, NKV, log2P, t, key0, key_end,
                                       skip_key);
    cp_async_commit();
  }
}

// The online-softmax step of one warp's slice of keys, for attend_kv_slice below: scores s (the S = Q K^T
// accumulators of NKEYS keys, key0 .., in 8-key column groups) of keys past a row's last_key set
// to -inf (only when need_mask), then the update of the row max m and row sum l, the rescaling of O, and s
// turned into the probabilities P in place (unnormalised). Lane layout as in attend_kv_slice below.
template <int NKEYS>
__device__ __forceinline__ void online_softmax_update(float (&s)[NKEYS / 8][4], int key0, bool need_mask,
                                                      const int (&last_key)[2], float scale_log2,
                                                      float (&o)[HEAD_DIM / 8][4], float (&m)[2], float (&l)[2]) {
  const int lane = threadIdx.x & 31;
  if (need_mask) {
#pragma unroll
    for (int j = 0; j < NKEYS / 8; j++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        if (key0 + j * 8 + 2 * (lane & 3) + (e & 1) > last_key[e >> 1]) s[j][e] = -INFINITY;
  }

  // Online softmax, per row: new max over this tile (lanes of a quad hold the same row: combine with two
  // xor-shuffles), rescale what was accumulated under the old max by alpha = 2^((m_old - m_new) * c),
  // then turn scores into probabilities in place.
#pragma unroll
  for (int i = 0; i < 2; i++) {
    float mx = m[i];
#pragma unroll
    for (int j = 0; j < NKEYS / 8; j++) mx = fmaxf(mx, fmaxf(s[j][2 * i], s[j][2 * i + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // A row that has seen only masked keys keeps m = -inf; subtracting 0 instead of -inf keeps
    // 2^(-inf - -inf) = NaN out (its p and alpha come out 0, so l and O stay 0).
    const float m_scaled = mx == -INFINITY ? 0.f : mx * scale_log2;
    const float alpha = fast_exp2(m[i] * scale_log2 - m_scaled);
    m[i] = mx;
    float row_sum = 0.f;
#pragma unroll
    for (int j = 0; j < NKEYS / 8; j++)
#pragma unroll
      for (int e = 2 * i; e < 2 * i + 2; e++) {
        s[j][e] = fast_exp2(fmaf(s[j][e], scale_log2, -m_scaled));
        row_sum += s[j][e];
      }
    l[i] = l[i] * alpha + row_sum;
#pragma unroll
    for (int d = 0; d < HEAD_DIM / 8; d++) o[d][2 * i] *= alpha, o[d][2 * i + 1] *= alpha;
  }
}

// One warp's share of one K/V tile, the heart of both kernels:
//   S = Q K^T over NKEYS keys (tile rows row0 .. row0+NKEYS-1, absolute key numbers key0 ..), then
//   online_softmax_update (the mask, the row max m and row sum l, O rescaled), and O += P V.
// q: the warp's 16 query rows as A fragments, one per 16-dim slice. o: [16 row x 128 dim] accumulator as
// 16 fragments of 8 dims. m, l, last_key: this lane's two rows (lane/4 and lane/4 + 8). m is kept in raw
// score units; l is this lane's partial sum over its own columns (the quad adds them up at the very end,
// which is valid because all four lanes of a row always rescale by the same factor). F: the cache format,
// whose tiles' element the tensor cores multiply (F::mma, F::pack).
template <int NKEYS, class F = KVBf16>
__device__ __forceinline__ void attend_kv_slice(const uint32_t (&q)[HEAD_DIM / 16][4], const bf16* sK,
                                                const bf16* sV, int row0, int key0, bool need_mask,
                                                const int (&last_key)[2], float scale_log2,
                                                float (&o)[HEAD_DIM / 8][4], float (&m)[2], float (&l)[2]) {
  const int lane = threadIdx.x & 31;
  float s[NKEYS / 8][4];
#pragma unroll
  for (int j = 0; j < NKEYS / 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;

  // S = Q K^T. K is stored [key][dim], which is exactly the "column-major B" the MMA wants: one
  // ldmatrix.x4 gives the B fragments of 16 keys x 16 dims (matrices: keys 0-7 / dims 0-7, keys 0-7 /
  // dims 8-15, keys 8-15 / dims 0-7, keys 8-15 / dims 8-15).
#pragma unroll
  for (int kk = 0; kk < HEAD_DIM / 16; kk++) {
#pragma unroll
    for (int j = 0; j < NKEYS / 16; j++) {
      uint32_t b[4];
      const int row = row0 + j * 16 + (lane & 7) + ((lane >> 4) << 3);
      ldmatrix_x4(b, sK + attn_smem_index(row, 2 * kk + ((lane >> 3) & 1)));
      F::mma(s[2 * j], q[kk], b[0], b[1]);
      F::mma(s[2 * j + 1], q[kk], b[2], b[3]);
    }
  }

  online_softmax_update<NKEYS>(s, key0, need_mask, last_key, scale_log2, o, m, l);

  // O += P V. The accumulator layout of S is the A-fragment layout of P (two 8-key column groups make
  // one 16-key k-slice), so P goes from registers to the MMA without shared memory. V needs .trans.
#pragma unroll
  for (int kt = 0; kt < NKEYS / 16; kt++) {
    const uint32_t p[4] = {F::pack(s[2 * kt][0], s[2 * kt][1]), F::pack(s[2 * kt][2], s[2 * kt][3]),
                           F::pack(s[2 * kt + 1][0], s[2 * kt + 1][1]),
                           F::pack(s[2 * kt + 1][2], s[2 * kt + 1][3])};
#pragma unroll
    for (int dt = 0; dt < HEAD_DIM / 16; dt++) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, sV + attn_smem_index(row0 + kt * 16 + (lane & 15), 2 * dt + (lane >> 4)));
      F::mma(o[2 * dt], p, b[0], b[1]);
      F::mma(o[2 * dt + 1], p, b[2], b[3]);
    }
  }
}

// Load a warp's 16 rows of a swizzled [rows][HEAD_DIM] Q tile (rows row0..row0+15) into A fragments.
__device__ __forceinline__ void load_q_fragments(uint32_t (&q)[HEAD_DIM / 16][4], const bf16* sQ, int row0) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int kk = 0; kk < HEAD_DIM / 16; kk++)
    ldmatrix_x4(q[kk], sQ + attn_smem_index(row0 + (lane & 15), 2 * kk + (lane >> 4)));
}
// flash_prefill_kernel — causal attention of a variable-length batch over the paged cache.
//   Replaces: flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, ..., causal=True,
//             block_table=block_tables) in nano-vllm's Attention.forward (prefill branch).
//   out[t, h*D + d] = sum_j softmax_j(scale * q[t,h] . k[j,kvh]) v[j,kvh,d] over j = 0 .. pos(t),
//   kvh = h / (NH/NKV),
//   where query i of sequence b (row t = cu_seqlens_q[b] + i) sits at pos = seqlens_k[b] - q_len + i:
//   with a cached prefix (prefix-cache hit or an earlier chunk) the queries are the last q_len positions.
//   Reads qkv (q part), k_cache, v_cache, block_tables; writes out bf16 [T, NH*D].
//   One CTA: query rows m0 .. m0+127 of sequence b for query head h; warp w owns rows m0+16w .. +15.
//   Eight warps share each K/V tile, so a tile loaded into shared memory serves 128 queries.
//   grid = (NH, cdiv(max_seqlen_q, PREFILL_BLOCK_M), B). Heads are the fastest grid index so that the
//   NH/NKV CTAs that read the same K/V run together and share it through L2. Query tiles run last-to-first:
//   under the causal mask the last tile of a sequence has the most keys, and starting the long CTAs first
//   keeps the tail of the launch short. CTAs past their sequence's q_len exit at once.
//   Preconditions: 1 <= q_len <= seqlens_k[b] for every sequence; NH % NKV == 0; P a power of two.
//   F: the cache format (KVBf16 above); kv_scale: what its layer's values are multiplied by.
template <class F>
__global__ void __launch_bounds__(PREFILL_WARPS * 32)
    flash_prefill_kernel(bf16* __restrict__ out, const bf16* __restrict__ qkv,
                         const typename F::Elem* __restrict__ k_cache, const typename F::Elem* __restrict__ v_cache,
                         typename F::Scales kv_scale,
                             const int* __restrict__ cu_seqlens_q, const int* __restrict__ seqlens_k,
                             const int* __restrict__ block_tables, int NH, int NKV, int log2P, int MB,
                             float scale_log2) {
  const int h = blockIdx.x, b = blockIdx.z;
  const int m0 = (gridDim.y - 1 - blockIdx.y) * PREFILL_BLOCK_M;
  const int q_start = cu_seqlens_q[b], q_len = cu_seqlens_q[b + 1] - q_start;
  if (m0 >= q_len) return;
  const int kv_len = seqlens_k[b];
  const int pos0 = kv_len - q_len + m0;                          // position of this tile's first query
  const int n_tiles = cdiv_dev(min(kv_len, pos0 + PREFILL_BLOCK_M), ATTN_KV_TILE);  // keys any row sees
  const int kvh = h / (NH / NKV);
  const int qkv_stride = (NH + 2 * NKV) * HEAD_DIM;
  const int* block_table = block_tables + (size_t)b * MB;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  extern __shared__ __align__(16) unsigned char attn_smem[];
  bf16* sQ = reinterpret_cast<bf16*>(attn_smem);              // [PREFILL_BLOCK_M][D]
  bf16* sK = sQ + PREFILL_BLOCK_M * HEAD_DIM;                 // [ATTN_STAGES][ATTN_KV_TILE][D]
  bf16* sV = sK + ATTN_STAGES * ATTN_KV_TILE * HEAD_DIM;      // [ATTN_STAGES][ATTN_KV_TILE][D]

  // Q rows past q_len are zero-filled: they belong to the next sequence or lie past the end of qkv.
  for (int i = threadIdx.x; i < PREFILL_BLOCK_M * 16; i += PREFILL_WARPS * 32) {
    const int r = i >> 4, c = i & 15;
    const bool valid = m0 + r < q_len;
    const bf16* src = qkv + (size_t)(q_start + m0 + r) * qkv_stride + h * HEAD_DIM + c * 8;
    cp_async_16(sQ + attn_smem_index(r, c), valid ? src : qkv, valid);
  }
  cp_async_commit();
  constexpr int AHEAD = F::tiles_ahead;
  issue_first_kv_tiles<PREFILL_WARPS * 32, F>(sK, sV, k_cache, v_cache, block_table, kvh, NKV, log2P, 0, kv_len);
  cp_async_wait<AHEAD>();  // the Q group is complete
  __syncthreads();
  uint32_t q[HEAD_DIM / 16][4];
  load_q_fragments(q, sQ, warp * 16);
  F::tile_q(q);
  scale_log2 = F::score_scale(scale_log2, kv_scale);

  float o[HEAD_DIM / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int warp_pos0 = pos0 + warp * 16;  // position of the warp's first row
  const int last_key[2] = {warp_pos0 + lane / 4, warp_pos0 + lane / 4 + 8};
  const bool warp_has_rows = m0 + warp * 16 < q_len;

  for (int t = 0; t < n_tiles; t++) {
    // Prefetch the tile AHEAD tiles ahead into the buffer computed last iteration (freed by the
    // __syncthreads that ended it). An empty commit at the end keeps the group count uniform.
    const int ahead = t + AHEAD;
    if (ahead < n_tiles)
      F::template issue_tile<PREFILL_WARPS * 32>(sK, sV, k_cache, v_cache, block_table, kvh, NKV, log2P, ahead,
                                                 ahead * ATTN_KV_TILE, kv_len, -1);
    cp_async_commit();
    cp_async_wait<AHEAD>();  // tile t has landed (for this thread) ...
    bf16 *sK_t, *sV_t;
    F::template tile_ready<PREFILL_WARPS * 32>(sK, sV, t, sK_t, sV_t);
    __syncthreads();         // ... and for every thread
    const int key0 = t * ATTN_KV_TILE;
    // Only tiles that cross the diagonal need the mask; a warp whose rows all precede the tile skips it.
    if (warp_has_rows && key0 <= warp_pos0 + 15)
      attend_kv_slice<ATTN_KV_TILE, F>(q, sK_t, sV_t, 0, key0, key0 + ATTN_KV_TILE - 1 > warp_pos0, last_key,
                                       scale_log2, o, m, l);
    __syncthreads();
  }
  F::scale_output(o, kv_scale);

  // Finish the row sums across the quad, normalise, write bf16 (each lane: 2 dims of 2 rows per group).
#pragma unroll
  for (int i = 0; i < 2; i++) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    const int r = m0 + warp * 16 + lane / 4 + 8 * i;
    if (r >= q_len) continue;
    const float inv_l = 1.f / l[i];
    bf16* dst = out + (size_t)(q_start + r) * NH * HEAD_DIM + h * HEAD_DIM + 2 * (lane & 3);
#pragma unroll
    for (int d = 0; d < HEAD_DIM / 8; d++)
      *reinterpret_cast<__nv_bfloat162*>(dst + d * 8) =
          __floats2bfloat162_rn(o[d][2 * i] * inv_l, o[d][2 * i + 1] * inv_l);
  }
}

// out: bf16 [T, NH*D]; qkv: bf16 [T, (NH+2NKV)*D]; cache: one layer's keys and values [NB, NKV, P, D] in
// format F; cu_seqlens_q: int [B+1] (device); seqlens_k: int [B] (device, keys of sequence b including this
// step's); block_tables: int [B, MB] (device); max_seqlen_q: the largest q_len (host). scale = 1/sqrt(D).
template <class F = KVBf16>
static void flash_attention_prefill(bf16* out, const bf16* qkv, const typename F::Layer& cache,
                                    const int* cu_seqlens_q, const int* seqlens_k, const int* block_tables,
                                    int B, int max_seqlen_q, int NH, int NKV, int P, int MB, float scale,
                                    cudaStream_t stream) {
  check_attention_shapes("flash_attention_prefill", NH, NKV, P);
  if (B == 0 || max_seqlen_q == 0) return;
  const size_t smem = (PREFILL_BLOCK_M + 2 * ATTN_STAGES * ATTN_KV_TILE) * HEAD_DIM * sizeof(bf16);  // 96 KiB
  dim3 grid(NH, cdiv(max_seqlen_q, PREFILL_BLOCK_M), B);
  // More than the default 48 KiB of shared memory must be asked for; cheap, and legal during graph capture.
  CUDA_CHECK(cudaFuncSetAttribute(flash_prefill_kernel<F>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  flash_prefill_kernel<F><<<grid, PREFILL_WARPS * 32, smem, stream>>>(
      out, qkv, F::keys(cache), F::values(cache), F::scales(cache), cu_seqlens_q, seqlens_k, block_tables, NH, NKV,
      __builtin_ctz(P), MB, scale * (float)M_LOG2E);
  CUDA_CHECK(cudaGetLastError());
}

// ==== 16. Flash decode: split-K over the context, then a merge =============================================
// defines: DecodeAcc, DecodeLoop, decode_combine_warps, flash_decode_kernel, flash_decode_merge,
//          flash_decode_workspace_bytes, flash_attention_decode, DecodeAttention, g_decode_attention,
//          attention_prefill_step; the stages attention_prefill, attention_decode; switch flash_attn

// flash_decode_kernel — one new token per sequence attends to its whole context (split-K, phase 1).
//   Replaces: flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context_lens,
//             block_table=block_tables, causal=True) in nano-vllm's Attention.forward (decode branch).
//   out[b, h*D + d] = sum_j softmax_j(scale * q_b,h . k_j) v_j[d] over j = 0 .. context_lens[b]-1.
//   Split-K: a decode step has one query per sequence, so one thread block per (sequence, head) would leave
//   most SMs idle; instead the keys are split. Thread block (part, kvh, b) handles keys [part*S, min(part*S
//   + S, ctx)), S = decode_partition(B), for the NH/NKV query heads of kv head kvh, so each K/V tile is read
//   from memory exactly once. Warp w takes keys 16w .. 16w+15 of every 64-key tile; at the end the four
//   warps' (m, l, O) are combined through shared memory (decode_combine_warps).
//   If the context fits in one partition the thread block writes the final bf16 output; otherwise it writes
//   its unnormalised O and (m, l) to the workspace and flash_decode_merge_kernel combines them.
//   Why a grid sized by max_context_len (a host bound) and not by the real contexts: a CUDA graph captured
//   once must stay valid as contexts grow; thread blocks whose partition starts past context_lens[b] exit
//   at once.
//   Workspace: ws_o float [B, NH, max_parts, D], ws_ml float [B, NH, max_parts, 2] = (m * scale*log2e, l).
//   Preconditions: 1 <= context_lens[b] <= max_context_len; NH/NKV <= 16; this step's k and v are in the
//   cache (qk_norm_rope ran).

// The tile loop of a decode thread block over keys [key_begin, key_end) of a bf16 cache: prefetch the tile
// ATTN_STAGES - 1 ahead, wait for tile t, and let each warp attend to its 16 keys of it (attend_kv_slice).
// The caller has issued the first tiles (issue_first_kv_tiles). after_landing(t, n_tiles, sK_t, sV_t,
// first_key) runs when tile t has landed for this thread and before the barrier that publishes it to the
// others: the fused kernel of section 19 writes this step's own key into the last tile there. skip_key: a
// key the tile loads leave alone (-1: none).
template <class AfterLanding>
__device__ __forceinline__ void decode_attend_tiles(const uint32_t (&q)[HEAD_DIM / 16][4], bf16* sK, bf16* sV,
                                                    const bf16* k_cache, const bf16* v_cache,
                                                    const int* block_table, int kvh, int NKV, int log2P,
                                                    int key_begin, int key_end, int skip_key, float scale_log2,
                                                    float (&o)[HEAD_DIM / 8][4], float (&m)[2], float (&l)[2],
                                                    AfterLanding after_landing) {
  constexpr int AHEAD = ATTN_STAGES - 1, TILE = ATTN_KV_TILE * HEAD_DIM;
  const int n_tiles = cdiv_dev(key_end - key_begin, ATTN_KV_TILE);
  const int warp = threadIdx.x >> 5;
  const int last_key[2] = {key_end - 1, key_end - 1};  // no causal mask within the context: only its end
  for (int t = 0; t < n_tiles; t++) {  // the same pipeline as the prefill loop
    const int ahead = t + AHEAD;
    if (ahead < n_tiles)
      load_kv_tile<DECODE_WARPS * 32>(sK + (ahead % ATTN_STAGES) * TILE, sV + (ahead % ATTN_STAGES) * TILE, k_cache,
                                      v_cache, block_table, kvh, NKV, log2P, key_begin + ahead * ATTN_KV_TILE,
                                      key_end, skip_key);
    cp_async_commit();
    cp_async_wait<AHEAD>();
    const int tile_key0 = key_begin + t * ATTN_KV_TILE;
    bf16 *sK_t = sK + (t % ATTN_STAGES) * TILE, *sV_t = sV + (t % ATTN_STAGES) * TILE;
    after_landing(t, n_tiles, sK_t, sV_t, tile_key0);
    __syncthreads();
    const int key0 = tile_key0 + warp * 16;
    if (key0 < key_end)
      attend_kv_slice<16>(q, sK_t, sV_t, warp * 16, key0, key0 + 16 > key_end, last_key, scale_log2, o, m, l);
    __syncthreads();
  }
}

// A decode thread block's running sums: per warp, O and the online softmax's max m and sum l of each query
// head it holds, in section 15's layout (o[d][e], m[i], l[i]).
struct DecodeAcc {
  float o[HEAD_DIM / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
};

// How a decode thread block of format F (section 15a) reads its partition: the pieces of the loop, a template
// a format specialises. For bf16, the tile pipeline of section 15 and attend_kv_slice (decode_attend_tiles);
// a format may read its tiles its own way, with sums of its own (Acc) that store_partials leaves in
// decode_combine_warps' buffers in this layout.
template <class F>
struct DecodeLoop;
template <>
struct DecodeLoop<KVBf16> {
  using Acc = DecodeAcc;
  // Keys per thread block at a batch of B sequences (decode_partition, section 15).
  static int partition(int B) { return decode_partition(B); }
  // The first loads of the thread block: its first tile.
  __device__ static __forceinline__ void issue_first(bf16* sK, bf16* sV, const bf16* k_cache, const bf16* v_cache,
                                                     const int* block_table, int kvh, int NKV, int log2P,
                                                     int key_begin, int key_end, int skip_key) {
    issue_first_kv_tiles<DECODE_WARPS * 32, KVBf16>(sK, sV, k_cache, v_cache, block_table, kvh, NKV, log2P,
                                                    key_begin, key_end, skip_key);
  }
  // The group's Q tile as every warp's A fragments (all warps hold the same 16 rows: the group's heads).
  __device__ static __forceinline__ void q_fragments(uint32_t (&q)[HEAD_DIM / 16][4], const bf16* sQ) {
    load_q_fragments(q, sQ, 0);
  }
  // The partition's keys [key_begin, key_end) into sums. new_key: this step's key, which the tile loads left
  // out (skip_key) and whose tile values new_kv holds (keys, then values; section 19's fused kernel); -1: none.
  __device__ static __forceinline__ void attend(const uint32_t (&q)[HEAD_DIM / 16][4], bf16* sK, bf16* sV,
                                                const bf16* k_cache, const bf16* v_cache, KVBf16::Scales,
                                                const int* block_table, int kvh, int NKV, int log2P, int key_begin,
                                                int key_end, int new_key, const uint4 (*new_kv)[HEAD_DIM / 8],
                                                int group, float scale_log2, Acc& sums) {
    decode_attend_tiles(q, sK, sV, k_cache, v_cache, block_table, kvh, NKV, log2P, key_begin, key_end, new_key,
                        scale_log2, sums.o, sums.m, sums.l,
                        [&](int t, int n_tiles, bf16* sK_t, bf16* sV_t, int key_tile) {
                          if (new_key >= 0 && t == n_tiles - 1 && threadIdx.x < 2 * HEAD_DIM / 8) {  // its tile
                            const int kv = threadIdx.x / 16, c = threadIdx.x % 16;
                            bf16* dst = (kv ? sV_t : sK_t) + attn_smem_index(new_key - key_tile, c);
                            *reinterpret_cast<uint4*>(dst) = new_kv[kv][c];
                          }
                        });
  }
  // A warp's sums into decode_combine_warps' buffers: sO[warp][head][dim], sML[warp][head] = (m in log2 units,
  // l), l summed over the quad first.
  __device__ static __forceinline__ void store_partials(Acc& sums, float scale_log2, int, float* sO, float* sML) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < 2; i++) {
      sums.l[i] += __shfl_xor_sync(0xffffffffu, sums.l[i], 1);
      sums.l[i] += __shfl_xor_sync(0xffffffffu, sums.l[i], 2);
      const int row = warp * DECODE_ROWS + lane / 4 + 8 * i;
#pragma unroll
      for (int d = 0; d < HEAD_DIM / 8; d++)
        *reinterpret_cast<float2*>(sO + row * HEAD_DIM + d * 8 + 2 * (lane & 3)) =
            make_float2(sums.o[d][2 * i], sums.o[d][2 * i + 1]);
      if ((lane & 3) == 0) sML[row * 2] = sums.m[i] * scale_log2, sML[row * 2 + 1] = sums.l[i];  // -inf stays -inf
    }
  }
};

// Combines the four warps of a decode thread block. Their O, m, l go to shared memory (reusing the K/V
// stages sK: every copy has landed and every warp is past the loop's last barrier), then thread d computes
// output dim d of every head g of the group and calls write(g, acc, m_max, l_sum): acc = sum_w 2^(m_w -
// m_max) O_w[d], l_sum the same sum of the l_w, m_max in log2 units (so out = acc / l_sum). F: the cache
// format, whose DecodeLoop knows where each warp's sums lie in its registers.
template <class F, class Write>
__device__ __forceinline__ void decode_combine_warps(typename DecodeLoop<F>::Acc& sums, float scale_log2, bf16* sK,
                                                     int group, Write write) {
  float* sO = reinterpret_cast<float*>(sK);                 // [DECODE_WARPS][DECODE_ROWS][D]
  float* sML = sO + DECODE_WARPS * DECODE_ROWS * HEAD_DIM;  // [DECODE_WARPS][DECODE_ROWS][2]
  static_assert((DECODE_WARPS * DECODE_ROWS * (HEAD_DIM + 2)) * sizeof(float) <=
                    2 * ATTN_STAGES * ATTN_KV_TILE * HEAD_DIM * sizeof(bf16),
                "the combine buffers fit in the K/V stages");
  DecodeLoop<F>::store_partials(sums, scale_log2, group, sO, sML);
  __syncthreads();
  const int d = threadIdx.x;
  for (int g = 0; g < group; g++) {
    float m_max = -INFINITY;  // warp 0 saw the partition's first key, so at least one warp has a finite m
    for (int w = 0; w < DECODE_WARPS; w++) m_max = fmaxf(m_max, sML[(w * DECODE_ROWS + g) * 2]);
    float l_sum = 0.f, acc = 0.f;
    for (int w = 0; w < DECODE_WARPS; w++) {
      const float f = fast_exp2(sML[(w * DECODE_ROWS + g) * 2] - m_max);
      l_sum += sML[(w * DECODE_ROWS + g) * 2 + 1] * f;
      acc += sO[(w * DECODE_ROWS + g) * HEAD_DIM + d] * f;
    }
    write(g, acc, m_max, l_sum);
  }
}

template <class F>
__global__ void __launch_bounds__(DECODE_WARPS * 32)
    flash_decode_kernel(bf16* __restrict__ out, const bf16* __restrict__ qkv,
                        const typename F::Elem* __restrict__ k_cache, const typename F::Elem* __restrict__ v_cache,
                        typename F::Scales kv_scale,
                            const int* __restrict__ context_lens, const int* __restrict__ block_tables, int NH,
                            int NKV, int log2P, int MB, int max_parts, int partition, float* __restrict__ ws_o,
                            float* __restrict__ ws_ml, float scale_log2) {
  const int part = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int ctx = context_lens[b];
  const int key_begin = part * partition;
  if (key_begin >= ctx) return;  // a partition past this sequence's context
  const int key_end = min(ctx, key_begin + partition);
  const int group = NH / NKV;  // query heads kvh*group .. kvh*group + group-1 share this kv head
  const int* block_table = block_tables + (size_t)b * MB;

  extern __shared__ __align__(16) unsigned char attn_smem[];
  bf16* sQ = reinterpret_cast<bf16*>(attn_smem);              // [DECODE_ROWS][D]
  bf16* sK = sQ + DECODE_ROWS * HEAD_DIM;                     // [ATTN_STAGES][ATTN_KV_TILE][D]
  bf16* sV = sK + ATTN_STAGES * ATTN_KV_TILE * HEAD_DIM;      // [ATTN_STAGES][ATTN_KV_TILE][D]

  // Row g of the Q tile is query head kvh*group + g of token b (the group's heads are adjacent in qkv);
  // rows past the group are zeros.
  const bf16* q_src = qkv + (size_t)b * (NH + 2 * NKV) * HEAD_DIM + (size_t)kvh * group * HEAD_DIM;
  for (int i = threadIdx.x; i < DECODE_ROWS * 16; i += DECODE_WARPS * 32) {
    const int r = i >> 4, c = i & 15;
    cp_async_16(sQ + attn_smem_index(r, c), r < group ? q_src + r * HEAD_DIM + c * 8 : qkv, r < group);
  }
  cp_async_commit();
  using Loop = DecodeLoop<F>;
  Loop::issue_first(sK, sV, k_cache, v_cache, block_table, kvh, NKV, log2P, key_begin, key_end, -1);
  cp_async_wait<1>();  // the Q tile has landed (the first K/V tile is the group after it)
  __syncthreads();
  uint32_t q[HEAD_DIM / 16][4];
  Loop::q_fragments(q, sQ);
  scale_log2 = F::score_scale(scale_log2, kv_scale);

  typename Loop::Acc sums;
  Loop::attend(q, sK, sV, k_cache, v_cache, kv_scale, block_table, kvh, NKV, log2P, key_begin, key_end, -1, nullptr,
               group, scale_log2, sums);
  const bool single = key_begin == 0 && key_end == ctx;  // the only live partition: finish here
  decode_combine_warps<F>(sums, scale_log2, sK, group, [&](int g, float acc, float m_max, float l_sum) {
    const int h = kvh * group + g, d = threadIdx.x;
    if (single) {
      out[(size_t)b * NH * HEAD_DIM + h * HEAD_DIM + d] = __float2bfloat16(acc / l_sum);
    } else {
      const size_t slot = ((size_t)b * NH + h) * max_parts + part;
      ws_o[slot * HEAD_DIM + d] = acc;
      if (d == 0) ws_ml[slot * 2] = m_max, ws_ml[slot * 2 + 1] = l_sum;
    }
  });
}

// flash_decode_merge_kernel — split-K, phase 2: combine the partitions of one (sequence, head).
//   With partition p holding O_p = sum_j 2^(x_j - m_p) v_j and l_p = sum_j 2^(x_j - m_p) (x in log2 units):
//   out = sum_p 2^(m_p - M) O_p / sum_p 2^(m_p - M) l_p, M = max_p m_p (the log-sum-exp rule).
//   One CTA per MERGE_HEADS heads of a sequence b (grid: cdiv(NH, MERGE_HEADS) x B); thread (g, d) owns dim
//   d of head blockIdx.x * MERGE_HEADS + g. Sequences with one partition were finished by phase 1 and exit at
//   once: in a large batch most of them, which is why a CTA takes several heads (the GPU launches a quarter
//   as many CTAs that do nothing; one CTA per head is slower at large batches: docs/performance.md).
//   Reads ws_o, ws_ml as written by flash_decode_kernel; writes out.
constexpr int MERGE_HEADS = 4;
__global__ void __launch_bounds__(MERGE_HEADS * HEAD_DIM)
    flash_decode_merge_kernel(bf16* __restrict__ out, const int* __restrict__ context_lens,
                                  const float* __restrict__ ws_o, const float* __restrict__ ws_ml, int NH,
                                  int max_parts, int partition) {
  const int h = blockIdx.x * MERGE_HEADS + threadIdx.x / HEAD_DIM, b = blockIdx.y, d = threadIdx.x % HEAD_DIM;
  const int n_parts = cdiv_dev(context_lens[b], partition);
  if (n_parts <= 1 || h >= NH) return;
  const size_t base = ((size_t)b * NH + h) * max_parts;
  float m_max = -INFINITY;
  for (int p = 0; p < n_parts; p++) m_max = fmaxf(m_max, ws_ml[(base + p) * 2]);
  float l_sum = 0.f, acc = 0.f;
  for (int p = 0; p < n_parts; p++) {
    const float f = fast_exp2(ws_ml[(base + p) * 2] - m_max);
    l_sum += ws_ml[(base + p) * 2 + 1] * f;
    acc += ws_o[(base + p) * HEAD_DIM + d] * f;
  }
  out[(size_t)b * NH * HEAD_DIM + h * HEAD_DIM + d] = __float2bfloat16(acc / l_sum);
}
// Phase 2 for a batch of B sequences whose partials phase 1 left in ws_o, ws_ml (nothing to do when no
// context spans more than one partition). Section 19's split-K kernel merges through it too.
static void flash_decode_merge(bf16* out, const int* context_lens, const float* ws_o, const float* ws_ml, int B,
                               int NH, int max_parts, int partition, cudaStream_t stream) {
  if (max_parts <= 1) return;
  flash_decode_merge_kernel<<<dim3(cdiv(NH, MERGE_HEADS), B), MERGE_HEADS * HEAD_DIM, 0, stream>>>(
      out, context_lens, ws_o, ws_ml, NH, max_parts, partition);
  CUDA_CHECK(cudaGetLastError());
}

// Bytes of float workspace flash_attention_decode needs: partial O and (m, l) for every (sequence, head,
// partition), for any batch of at most B. B = 512, NH = 16, max_context_len = 4096 (nano-vllm defaults) ->
// 8 partitions of 512, 34 MB. (A cache format with longer partitions needs less.)
static size_t flash_decode_workspace_bytes(int B, int NH, int max_context_len) {
  size_t parts = 0;
  for (int b : {std::min(B, 4), std::min(B, 32), B})
    parts = std::max(parts, (size_t)b * cdiv(max_context_len, decode_partition(b)));
  return parts * NH * (HEAD_DIM + 2) * sizeof(float);
}

// Shared memory of a decode thread block: the Q tile, then two K/V stages of 32 KiB (64 keys and their
// values), 68 KiB.
constexpr size_t DECODE_SMEM =
    DECODE_ROWS * HEAD_DIM * sizeof(bf16) + 2 * ATTN_STAGES * ATTN_KV_TILE * HEAD_DIM * sizeof(bf16);

// out: bf16 [B, NH*D]; qkv: bf16 [B, (NH+2NKV)*D]; cache: one layer's keys and values [NB, NKV, P, D] in
// format F; context_lens: int [B] (device, keys including the current token); block_tables: int [B, MB]
// (device); max_context_len: host bound on every context_lens[b] (max_model_len): the grid depends only on
// it, so a captured graph stays valid; workspace: flash_decode_workspace_bytes(B, NH, max_context_len) bytes.
template <class F = KVBf16>
static void flash_attention_decode(bf16* out, const bf16* qkv, const typename F::Layer& cache, const int* context_lens,
                             const int* block_tables, int B, int NH, int NKV, int P, int MB, int max_context_len,
                             float* workspace, float scale, cudaStream_t stream) {
  check_attention_shapes("flash_attention_decode", NH, NKV, P);
  INTERNAL_CHECK(NH / NKV <= DECODE_ROWS,
                 "flash_attention_decode: NH/NKV = %d query heads per kv head, at most %d", NH / NKV, DECODE_ROWS);
  if (B == 0) return;
  const int partition = DecodeLoop<F>::partition(B);
  const int max_parts = (int)cdiv(max_context_len, partition);
  float* ws_o = workspace;                                           // [B, NH, max_parts, D]
  float* ws_ml = workspace + (size_t)B * NH * max_parts * HEAD_DIM;  // [B, NH, max_parts, 2]
  static bool opted_in = false;  // more than the default 48 KiB of shared memory must be asked for, once
  if (!opted_in) {
    CUDA_CHECK(cudaFuncSetAttribute(flash_decode_kernel<F>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)DECODE_SMEM));
    opted_in = true;
  }
  flash_decode_kernel<F><<<dim3(max_parts, NKV, B), DECODE_WARPS * 32, DECODE_SMEM, stream>>>(
      out, qkv, F::keys(cache), F::values(cache), F::scales(cache), context_lens, block_tables, NH, NKV,
      __builtin_ctz(P), MB, max_parts, partition, ws_o, ws_ml, scale * (float)M_LOG2E);
  CUDA_CHECK(cudaGetLastError());
  flash_decode_merge(out, context_lens, ws_o, ws_ml, B, NH, max_parts, partition, stream);
}

// ---- The stages this section fills, and its switch: flash_attn ----
// The decode kernel above, as the attention of a decode step's rows (each one query token whose q, k and v
// are ready). Section 19 swaps in its cluster merge here (apply_cluster_merge), and both a decode step and a
// mixed step's decode rows then take it. DecodeAttention<F>: such a function for a cache of format F.
template <class F>
using DecodeAttention = void (*)(bf16* out, const bf16* qkv, const typename F::Layer& cache,
                                 const int* context_lens, const int* block_tables, int B, int NH, int NKV, int P,
                                 int MB, int max_context_len, float* workspace, float scale, cudaStream_t stream);
static DecodeAttention<KVBf16> g_decode_attention = flash_attention_decode<KVBf16>;

// The attention of a prefill step (q/k-norm, RoPE and the KV store done). Under --scheduler mixed (5b) a step
// holds decode rows and prompt chunks; the scheduler serves the running sequences first, so the decoding
// ones lead (in.decode_rows of them, one query row each, rows 0..nd-1). Those go through the decode kernel,
// which reads each K/V tile once for the GQA group and uses all of its tiles' rows; the prefill kernel would
// read it once per query head into tiles of 128 query rows holding one. The prompt chunks, from sequence nd
// on, go through the prefill kernel as in any prefill step. Both kernels write their own rows of out, and
// both read the keys store_qkv just stored. decode: the decode rows' kernel (g_decode_attention for bf16).
template <class F>
static void attention_prefill_step(bf16* out, const bf16* qkv, const typename F::Layer& cache,
                                   const StepInputs& in, int B, int NH, int NKV, int P, int MB, int max_context_len,
                                   float* workspace, float scale, cudaStream_t s, DecodeAttention<F> decode) {
  const int nd = in.decode_rows;
  if (nd > 0)
    decode(out, qkv, cache, in.seqlens_k, in.block_tables, nd, NH, NKV, P, MB, max_context_len, workspace, scale,
           s);
  if (nd < B)
    flash_attention_prefill<F>(out, qkv, cache, in.cu_seqlens_q + nd, in.seqlens_k + nd,
                            in.block_tables + (size_t)nd * MB, B - nd, in.max_seqlen_q, NH, NKV, P, MB, scale, s);
}

// Section 14's stages attention_prefill and attention_decode: section 15's prefill kernel, this section's
// decode kernel.
static void flash_attention_prefill_stage(Pass& p, int l) {
  Qwen3& m = p.m;
  const ModelConfig& c = m.cfg;
  attention_prefill_step<KVBf16>(m.act.attn, m.act.qkv, m.kv.layer(l), p.in, p.B, c.num_attention_heads / m.tp,
                                 c.num_key_value_heads / m.tp, m.P, m.MB, m.max_model_len, m.act.attn_workspace,
                                 1.0f / sqrtf((float)c.head_dim), p.s, g_decode_attention);
}
static void flash_attention_decode_stage(Pass& p, int l) {
  Qwen3& m = p.m;
  const ModelConfig& c = m.cfg;
  g_stages.store_qkv(p, l);
  g_decode_attention(m.act.attn, m.act.qkv, m.kv.layer(l), p.in.seqlens_k, p.in.block_tables, p.B,
                     c.num_attention_heads / m.tp, c.num_key_value_heads / m.tp, m.P, m.MB, m.max_model_len,
                     m.act.attn_workspace, 1.0f / sqrtf((float)c.head_dim), p.s);
}

// Part I's hooks this section fills: the forward pass (section 14's stages) and the decode workspace. It also
// resets the decode rows' kernel to this section's (section 19 may swap in its own).
static void apply_flash_attn(bool on, Hooks& h) {
  g_opt.flash_attn = on;
  g_decode_attention = flash_attention_decode<KVBf16>;
  if (!on) return;
  ForwardStages& st = stages_for(h);
  st.attention_prefill = flash_attention_prefill_stage;
  st.attention_decode = flash_attention_decode_stage;
  h.attention_workspace_bytes = flash_decode_workspace_bytes;
}
static const int kFlashAttnRegistered = register_optimization(
    {"flash_attn", "flash attention on tensor cores, split-K decode (section 15, decode 16)", true, apply_flash_attn,
     nullptr, {{"decode_rows_per_kv_group", 1}}});  // (attention_prefill_step: a mixed step's decode rows)

// ==== 17. Small-batch gemv, 1: programmatic dependent launch ===============================================
// defines: pdl_begin, pdl_trigger, gpu_cc_major, gpu_sm_count, gpu_resident_blocks, launch_pdl,
//          launch_pdl_cluster
//
// The gemv chapter (sections 17-18) makes a batch-1 or -2 step's kernels small and quick; this first step is
// how they are launched, section 18 the gemv itself. PDL is a step of this chapter, not a chapter of its own,
// because it changes how a kernel is launched, not what runs, and acts only on kernels written for it (each
// calls pdl_begin, below). Part I's kernels and flash attention's (15-16) are not, so beside them alone it
// would change nothing; the first kernel written for it is the gemv's. So its switch, pdl, is registered with
// the gemv's (section 18), and its gain is measured on top of the gemv: bench.sh --ladder's rung +gemv+pdl
// against +gemv. The kernels of sections 19, 20 and 22 are written for it too, and launch through it.
//
// Replaces: the ordinary launch, where the GPU lets a kernel finish completely before the next one in the
// stream starts. At every boundary the SMs drain (the last thread blocks of the kernel run while the rest of
// the GPU idles), then the next kernel's thread blocks are set up and start with empty caches and no loads
// in flight. A batch-1 decode step of Qwen3-0.6B has about a hundred and fifty such boundaries.
// Why it is faster: with programmatic dependent launch (PDL, Hopper and later) the next kernel is launched
// while the previous one still runs; its thread blocks start, do whatever does not depend on that kernel (a
// gemv loads its weights, which no step writes; decode attention loads cached keys), and wait in
// pdl_begin() until the previous grid has finished and its writes are visible. Two rules keep this exactly
// as safe as plain stream order:
//   * every kernel launched with PDL (the kernels of Part II, through launch_pdl) calls pdl_begin() before it
//     reads anything the kernel before it wrote and before it writes anything; so it finishes only after the
//     one before it, and waiting for the last kernel is waiting for them all. (The fused decode attention of
//     section 19 reads the KV cache, block tables and context lengths before its wait: all of them were
//     written before the kernel ahead of it started, which is as good, since that kernel launched only
//     after its own predecessor had finished. Its thread blocks past the context exit without waiting,
//     after pdl_trigger(), writing nothing);
//   * Part I's kernels, cuBLASLt's and copies are launched the ordinary way, so they wait for everything
//     before them whatever that was.
// pdl_begin() then allows the next kernel to launch: at most two kernels share the GPU at a time.
// Switch: pdl (section 18 registers it). GPUs before sm_90 always launch the ordinary way.
__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");  // the kernel before has finished; its writes are seen
  asm volatile("griddepcontrol.launch_dependents;");  // the kernel after may launch now
#endif
}

// Lets the next kernel launch without waiting for anything: for thread blocks that exit without reading or
// writing (decode partitions past the context), which would otherwise hold the next launch back.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// The current GPU's compute capability major version: 9 for Hopper (asked once; a process uses one GPU).
static int gpu_cc_major() {
  static int major = -1;
  if (major < 0) {
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  }
  return major;
}
// The current GPU's number of SMs (asked once).
static int gpu_sm_count() {
  static int sms = 0;
  if (sms == 0) {
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  }
  return sms;
}
// Thread blocks of `threads` threads and smem bytes of dynamic shared memory that the GPU holds at once: one
// wave of a kernel's grid.
template <class Kernel>
static int64_t gpu_resident_blocks(Kernel kernel, int threads, size_t smem) {
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  return (int64_t)per_sm * gpu_sm_count();
}

// The kernels of Part II are launched through here: kernel<<<grid, block, smem, stream>>>(args...), plus
// the PDL attribute when switched on; launch_pdl_cluster also groups the thread blocks in clusters of
// cluster_x along x (section 19).
template <typename... Params, typename... Args>
static void launch_pdl_cluster(unsigned cluster_x, void (*kernel)(Params...), dim3 grid, dim3 block,
                               size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attrs[2] = {};
  int n = 0;
  if (g_opt.pdl && gpu_cc_major() >= 9) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster_x > 1) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n++].val.clusterDim = {cluster_x, 1, 1};
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = smem, cfg.stream = stream;
  cfg.attrs = attrs, cfg.numAttrs = n;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}
template <typename... Params, typename... Args>
static void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  launch_pdl_cluster(1, kernel, grid, block, smem, stream, std::forward<Args>(args)...);
}

// ==== 18. Small-batch gemv, 2: the gemv with its neighbours fused in =======================================
// defines: GemvIn, GemvOptions, GEMV_MAX_M, gemv_stage_input, gemv_store, gemv, gemv_can_stage; switches
//          pdl, gemv
//
// Replaces: at steps of at most GEMV_MAX_M tokens (batch-1 and -2 decode), cuBLASLt's matrix products and
// the small kernels around them (the RMSNorm before qkv and gate_up, SiLU-and-mul before down, the residual
// add after o_proj and down).
// Why it is faster: with one or two tokens a "matrix product" is a pass over W that does 2*M FLOPs per
// weight it reads: pure memory traffic, and the GPU is at its best streaming W with every load in flight at
// once. cuBLASLt's tiles are made for larger M and leave part of the bandwidth unused at this shape (a
// split-K plus a reduction kernel for down_proj, fewer thread blocks than SMs for others;
// test/gpu/gpu_gemm.cu times both). And a tiny kernel such as the RMSNorm of one row costs mostly the cost of
// being a kernel at all: the gemv takes its work over where that needs no extra pass over memory.
// Switches: gemv (it fills section 14's stages norm_matmul and matmul_out; below), and pdl, section 17's
// launch, whose first kernel is this one.
//
// gemv_kernel — y [M, N] = x [M, K] @ W [N, K]^T, M <= 2.
//   One warp per output column n streams row n of W once with 16-byte loads (all of a row's loads issued
//   before the first use), dots it with the M rows of x (tiny, served from L1), reduces across the warp, and
//   writes y[:, n]. For short rows, and where one row a warp would take more thread blocks than the GPU holds
//   at once, a warp takes two adjacent columns (gemv_rows_per_warp below); the sums are the same either way,
//   added in the same order.
//   Layouts: x bf16 [M, K] row-major; W bf16 [N, K] row-major (PyTorch's [out, in]); y bf16 [M, N].
//   Preconditions: K % 8 == 0; x, W 16-byte aligned. fp32 accumulation, one bf16 rounding.
// Fused variants (the epilogue and the input side take their neighbours' work):
//   RMSNORM   x is the residual stream; each thread block first writes rmsnorm(x) * norm_w into shared
//             memory with rmsnorm_row (section 7's code, so the rounding is the same) and dots W with that;
//   SILU_MUL  x is gate_up [M, 2K]; each thread block first writes silu(gate) * up into shared memory
//             (silu_mul8, section 7);
//   ADD       y is the residual stream and y += x @ W^T, rounded like add_rmsnorm: bf16(bf16(dot) + y).
//             The warp that owns column n is the only reader and writer of y[:, n]: no race.
// Each thread block recomputes the tiny input row (1-3 thousand values) instead of reading it from a kernel
// before. test/gpu/gpu_gemm.cu checks every variant bit for bit against the kernels it replaces.
enum class GemvIn { PLAIN, RMSNORM, SILU_MUL };
struct GemvOptions {
  GemvIn in = GemvIn::PLAIN;
  const bf16* norm_w = nullptr;  // RMSNORM: the norm's weight [K]
  float eps = 0.f;
  bool add = false;              // ADD: y += x @ W^T
};
constexpr int GEMV_MAX_M = 2;  // from M = 4 on, cuBLASLt's tiles win on some of Qwen3's shapes (docs/)
constexpr int GEMV_WARPS = 8;
// 16-byte loads per lane in flight per iteration (8 x 256 = 2048 columns): enough bytes in flight per SM to
// cover the memory latency, few enough registers to keep every warp resident.
constexpr int GEMV_UNROLL = 8;
// Thread blocks an SM must be able to hold (the registers a thread may use: at most 85): with fewer, the grid
// of two rows a warp (below) at Qwen3-30B-A3B's qkv width would not fit on the GPU at once.
constexpr int GEMV_MIN_BLOCKS = 3;
constexpr size_t GEMV_MAX_SMEM = 48 << 10;  // the staged input [M, K]: what a launch gets without opting in

// The input side of the fused variants, for the M rows: RMSNORM stages rmsnorm(x) * norm_w into shared memory
// (rmsnorm_row, section 7's code, so the rounding is the same), SILU_MUL stages silu(gate) * up (silu_mul8),
// PLAIN stages nothing. Every thread of the thread block takes part.
template <int M, GemvIn IN>
__device__ __forceinline__ void gemv_stage_input(uint4* staged, const bf16* __restrict__ x,
                                                 const bf16* __restrict__ norm_w, int K, float eps) {
  if constexpr (IN == GemvIn::RMSNORM) {
    __shared__ float scratch[32];
    for (int m = 0; m < M; m++) {
      rmsnorm_row<false>(reinterpret_cast<bf16*>(staged) + (size_t)m * K, nullptr, x + (size_t)m * K, norm_w, K,
                         eps, scratch);
      __syncthreads();  // the row is complete, and scratch may be used again
    }
  } else if constexpr (IN == GemvIn::SILU_MUL) {
    const uint4* gu = reinterpret_cast<const uint4*>(x);
    for (int c = threadIdx.x; c < M * K / 8; c += blockDim.x) {
      const int m = c / (K / 8), j = c % (K / 8);
      staged[c] = silu_mul8(gu[(size_t)m * K / 4 + j], gu[(size_t)m * K / 4 + K / 8 + j]);
    }
    __syncthreads();
  }
}
// The output side: a warp's per-lane sums for its R rows and M inputs reduced across the warp, then lane
// r*M + m writes y[m, n0 + r] (registers are indexed with constants only); ADD adds into y as add_rmsnorm rounds.
template <int M, int R, bool ADD>
__device__ __forceinline__ void gemv_store(bf16* __restrict__ y, float (&acc)[R][M], int n0, int N, int lane) {
#pragma unroll
  for (int r = 0; r < R; r++)
#pragma unroll
    for (int m = 0; m < M; m++) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) acc[r][m] += __shfl_xor_sync(0xffffffffu, acc[r][m], off);
    }
#pragma unroll
  for (int r = 0; r < R; r++)
#pragma unroll
    for (int m = 0; m < M; m++)
      if (lane == r * M + m && n0 + r < N) {
        bf16& out = y[(size_t)m * N + n0 + r];
        out = ADD ? __float2bfloat16(bf16_round(acc[r][m]) + __bfloat162float(out)) : __float2bfloat16(acc[r][m]);
      }
}

// One thread block's share of gemv_kernel (below): its warps' R rows each, the input staged first (staged: IN !=
// PLAIN's [M, K] of shared memory). A function of its own so that another kernel can run a gemv's rows with
// the same arithmetic (section 34's router).
template <int M, GemvIn IN, bool ADD, int R>
__device__ __forceinline__ void gemv_block(bf16* __restrict__ y, const bf16* __restrict__ x,
                                           const bf16* __restrict__ W, int N, int K, const bf16* __restrict__ norm_w,
                                           float eps, uint4* staged) {
  constexpr int U = GEMV_UNROLL / R;  // loads in flight per row
  const int n0 = (blockIdx.x * GEMV_WARPS + threadIdx.x / 32) * R, lane = threadIdx.x & 31;  // rows n0..n0+R-1
  uint4 wv[R][U];
  auto load_stretch = [&](int k0) {  // issue every load of a stretch of the rows before its first use
#pragma unroll
    for (int r = 0; r < R; r++) {
#pragma unroll
      for (int u = 0; u < U; u++) {
        const int k = k0 + u * 256 + lane * 8;
        if (n0 + r < N && k < K) wv[r][u] = __ldcs(reinterpret_cast<const uint4*>(W + (size_t)(n0 + r) * K + k));
      }
    }
  };
  // No step writes the weights, so the first stretch is loaded before waiting for the kernel before
  // (section 17, PDL): for R * K <= GEMV_UNROLL * 256 that is all of the warp's rows, in flight while that
  // kernel finishes.
  if (n0 < N) load_stretch(0);
  pdl_begin();
  gemv_stage_input<M, IN>(staged, x, norm_w, K, eps);
  if (n0 >= N) return;
  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; r++)
#pragma unroll
    for (int m = 0; m < M; m++) acc[r][m] = 0.f;
  for (int k0 = 0; k0 < K; k0 += U * 256) {  // every lane sums its columns in increasing order, whatever R is
    if (k0 > 0) load_stretch(k0);
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int k = k0 + u * 256 + lane * 8;
      if (k >= K) break;
#pragma unroll
      for (int m = 0; m < M; m++) {
        float xf[8];
        const size_t at = ((size_t)m * K + k) / 8;
        bf16x8_to_float(IN == GemvIn::PLAIN ? __ldg(reinterpret_cast<const uint4*>(x) + at) : staged[at], xf);
#pragma unroll
        for (int r = 0; r < R; r++) {
          float wf[8];
          bf16x8_to_float(wv[r][u], wf);
#pragma unroll
          for (int j = 0; j < 8; j++) acc[r][m] = fmaf(wf[j], xf[j], acc[r][m]);
        }
      }
    }
  }
  gemv_store<M, R, ADD>(y, acc, n0, N, lane);
}
template <int M, GemvIn IN, bool ADD, int R>
__global__ void __launch_bounds__(GEMV_WARPS * 32, GEMV_MIN_BLOCKS)
    gemv_kernel(bf16* __restrict__ y, const bf16* __restrict__ x, const bf16* __restrict__ W, int N, int K,
                const bf16* __restrict__ norm_w, float eps) {
  extern __shared__ uint4 staged[];  // IN != PLAIN: the input the dot products use, bf16 [M, K]
  gemv_block<M, IN, ADD, R>(y, x, W, N, K, norm_w, eps, staged);
}

// Thread blocks of a kernel the GPU holds at once (asked once per kernel and shared-memory size: a process
// uses one GPU, and a model one K per input side).
template <int M, GemvIn IN, bool ADD, int R>
static int64_t gemv_resident_blocks(size_t smem) {
  static size_t asked = SIZE_MAX;
  static int64_t blocks = 0;
  if (asked != smem) blocks = gpu_resident_blocks(gemv_kernel<M, IN, ADD, R>, GEMV_WARPS * 32, smem), asked = smem;
  return blocks;
}

// Rows per warp: 2 when both rows' loads fit in one stretch (K <= 1024: Qwen3-0.6B's qkv and gate_up), so the
// grid is half as large and fits on the GPU at once beside the kernel before, every block loading all of its
// weights before the PDL wait. Also 2 when a row a warp would need more thread blocks than the GPU holds at once
// and two would not (Qwen3-30B-A3B's qkv: 640 blocks where 396 fit): the blocks of a second wave start only as
// the first wave's leave, their loads issued then, after the wait, and each stages its input again; two rows a
// warp take their K in two stretches instead, every block's first stretch in flight before the wait. Else 1.
template <int M, GemvIn IN, bool ADD>
static int gemv_rows_per_warp(int K, int N, size_t smem) {
  if (2 * K <= GEMV_UNROLL * 256) return 2;
  if (cdiv(N, GEMV_WARPS) <= gemv_resident_blocks<M, IN, ADD, 1>(smem)) return 1;
  return cdiv(N, 2 * GEMV_WARPS) <= gemv_resident_blocks<M, IN, ADD, 2>(smem) ? 2 : 1;
}

template <int M, GemvIn IN, bool ADD>
static void gemv_launch(int K, int N, size_t smem, cudaStream_t stream, bf16* y, const bf16* x, const bf16* W,
                        const bf16* norm_w, float eps) {
  if (gemv_rows_per_warp<M, IN, ADD>(K, N, smem) == 2)
    launch_pdl(gemv_kernel<M, IN, ADD, 2>, (unsigned)cdiv(N, 2 * GEMV_WARPS), GEMV_WARPS * 32, smem, stream, y, x,
               W, N, K, norm_w, eps);
  else
    launch_pdl(gemv_kernel<M, IN, ADD, 1>, (unsigned)cdiv(N, GEMV_WARPS), GEMV_WARPS * 32, smem, stream, y, x, W,
               N, K, norm_w, eps);
}
template <int M, GemvIn IN>
static void gemv_launch(bool add, int K, int N, size_t smem, cudaStream_t stream, bf16* y, const bf16* x,
                        const bf16* W, const bf16* norm_w, float eps) {
  if (add) gemv_launch<M, IN, true>(K, N, smem, stream, y, x, W, norm_w, eps);
  else gemv_launch<M, IN, false>(K, N, smem, stream, y, x, W, norm_w, eps);
}
template <int M>
static void gemv_launch(const GemvOptions& o, size_t smem, cudaStream_t stream, bf16* y, const bf16* x,
                        const bf16* W, int N, int K) {
  switch (o.in) {
    case GemvIn::PLAIN: gemv_launch<M, GemvIn::PLAIN>(o.add, K, N, smem, stream, y, x, W, nullptr, 0); break;
    case GemvIn::RMSNORM: gemv_launch<M, GemvIn::RMSNORM>(o.add, K, N, smem, stream, y, x, W, o.norm_w, o.eps); break;
    case GemvIn::SILU_MUL: gemv_launch<M, GemvIn::SILU_MUL>(o.add, K, N, smem, stream, y, x, W, nullptr, 0); break;
  }
}

// Whether gemv() can stage an [M, K] input in shared memory (RMSNORM and SILU_MUL).
static bool gemv_can_stage(int M, int K) { return (size_t)M * K * sizeof(bf16) <= GEMV_MAX_SMEM; }

static void gemv(bf16* y, const bf16* x, const bf16* W, int M, int N, int K, cudaStream_t stream,
                 const GemvOptions& o = {}) {
  INTERNAL_CHECK(K % 8 == 0, "gemv: K = %d must be a multiple of 8", K);
  INTERNAL_CHECK(((uintptr_t)x | (uintptr_t)W) % 16 == 0, "gemv: x and W must be 16-byte aligned");
  size_t smem = 0;
  if (o.in != GemvIn::PLAIN) {
    INTERNAL_CHECK(gemv_can_stage(M, K), "gemv: a fused input of %d x %d does not fit in shared memory", M, K);
    smem = (size_t)M * K * sizeof(bf16);
  }
  if (o.in == GemvIn::RMSNORM) rmsnorm_checks("gemv (RMSNORM)", x, x, o.norm_w, K);
  switch (M) {
    case 1: gemv_launch<1>(o, smem, stream, y, x, W, N, K); break;
    case 2: gemv_launch<2>(o, smem, stream, y, x, W, N, K); break;
    default: INTERNAL_CHECK(M <= GEMV_MAX_M, "gemv: M = %d, at most %d", M, GEMV_MAX_M);
  }
  CUDA_CHECK(cudaGetLastError());
}

// ---- The stages this section fills, and its switch: gemv ----
// Section 14's norm_matmul and matmul_out at steps of at most GEMV_MAX_M tokens (larger steps: Part I's).
// y = RMSNorm(residual) @ W^T with the norm inside the gemv. Where the residual stream still waits for h
// (several GPUs whose all-reduce did not add it, p.pending), the norm runs on its own first.
static void gemv_norm_matmul(Pass& p, bf16* y, const bf16* norm_w, const bf16* W, int N) {
  if (p.T > GEMV_MAX_M) return norm_matmul_plain(p, y, norm_w, W, N);
  Activations& a = p.m.act;
  const int H = p.m.cfg.hidden_size;
  const float eps = p.m.cfg.rms_norm_eps;
  if (p.pending) {
    add_rmsnorm(a.x, a.residual, a.hidden, norm_w, p.T, H, eps, p.s);
    p.pending = false;
    return gemv(y, a.x, W, p.T, N, H, p.s);
  }
  gemv(y, a.residual, W, p.T, N, H, p.s, {GemvIn::RMSNORM, norm_w, eps});
}
// h = x @ W^T with SiLU-and-mul inside (down, where the input fits in shared memory). On one GPU h goes
// straight into the residual stream (the ADD epilogue); on several it is summed first (all_reduce), which
// may add it too.
static void gemv_matmul_out(Pass& p, const bf16* x, const bf16* W, int K, bool gate_up) {
  if (p.T > GEMV_MAX_M) return matmul_out_plain(p, x, W, K, gate_up);
  Activations& a = p.m.act;
  const int H = p.m.cfg.hidden_size;
  GemvIn how = GemvIn::PLAIN;
  if (gate_up && gemv_can_stage(p.T, K)) {
    how = GemvIn::SILU_MUL;
  } else if (gate_up) {
    silu_and_mul(a.act, x, p.T, K, p.s);
    x = a.act;
  }
  if (p.m.tp == 1) {
    gemv(a.residual, x, W, p.T, H, K, p.s, {how, nullptr, 0.f, true});
    p.pending = false;
    return;
  }
  gemv(a.hidden, x, W, p.T, H, K, p.s, {how});
  p.pending = !g_stages.all_reduce(p.m.comm, a.hidden, (size_t)p.T * H, p.s, a.residual);
}
static void apply_gemv(bool on, Hooks& h) {
  g_opt.gemv = on;
  if (!on) return;
  ForwardStages& st = stages_for(h);
  st.norm_matmul = gemv_norm_matmul;
  st.matmul_out = gemv_matmul_out;
}

// ---- The switches: pdl, gemv ----
// pdl fills no hook: the gemv above and the kernels of the chapters after it launch through launch_pdl
// (section 17), which reads g_opt.pdl. It is registered before gemv, so `--opt` lists it first.
static void apply_pdl(bool on, Hooks&) { g_opt.pdl = on; }
static std::string pdl_note(const Qwen3&) { return gpu_cc_major() < 9 ? "pdl needs sm_90, off here" : ""; }
static const int kPdlRegistered = register_optimization(
    {"pdl", "programmatic dependent launch of the gemv and the kernels after it (section 17)", true, apply_pdl,
     pdl_note});
static const int kGemvRegistered = register_optimization(
    {"gemv", "small-batch gemv with RMSNorm, SiLU and the residual add fused in (section 18)", true, apply_gemv});

// ==== 19. Decode attention in one kernel: the split-K merge in a cluster, q/k-norm, RoPE, the KV store
// defines: DECODE_CLUSTER, DECODE_CLUSTER_MAX_B, cluster_partial, cluster_merge, rope_angles,
//          head_sum_squares, head_norm_rope, KVStoreBf16, qk_norm_rope_fast, store_qkv_fast, DecodeRope,
//          decode_fused_kernel, decode_clusters_supported, attention_decode_fast; switches cluster_merge,
//          fused_rope
//
// A decode step's attention, as section 16 runs it, is three kernels per layer: qk_norm_rope (section 7), the
// split-K decode kernel, and the merge kernel that combines its partitions. This section makes it one, in
// two steps that each have a switch: first the merge moves inside the decode kernel (cluster_merge), then
// q/k-norm, RoPE and the KV store do (fused_rope), built from a faster qk_norm_rope with eight threads per
// head, which every prefill step takes too. One kernel template, decode_fused_kernel<ROPE, CLUSTER>, carries
// both; section 16's split-K decode is its <false, false> case in all but name.
//
// ---- The split-K merge inside a cluster (switch cluster_merge) ----
// Replaces: flash_decode_merge_kernel (section 16) and its workspace, for batches of at most
// DECODE_CLUSTER_MAX_B sequences on sm_90 and later.
// Why it is faster: a small batch needs many partitions to fill the GPU, so at long contexts the merge
// kernel has many partials per head to read back from memory, and it is one more kernel boundary per layer.
// On Hopper the thread blocks of a cluster run at the same time on neighbouring SMs and can read each
// other's shared memory (distributed shared memory), so the partitions of one (sequence, kv head) can merge
// where they are: the grid is (DECODE_CLUSTER, NKV, B), one cluster of DECODE_CLUSTER thread blocks per
// (sequence, kv head), and the partition length follows the context: ceil(ctx / DECODE_CLUSTER) rounded up
// to whole tiles. Each live thread block leaves its share of every head of the group in shared memory
// (cluster_partial) and cluster_merge combines them: no workspace, no second kernel. The merge does the
// merge kernel's arithmetic in the same order, so the result is the same as section 16's at the same
// partition length. GPUs before sm_90, and batches above DECODE_CLUSTER_MAX_B, use the merge kernel.
constexpr int DECODE_CLUSTER = 16;        // thread blocks per cluster (16 is above the portable 8: opted into)
constexpr int DECODE_CLUSTER_MAX_B = 4;   // larger batches: the workspace and the merge kernel

// This thread block's share of head g of its group: O[HEAD_DIM], then m, l (the merge kernel's ws_o and
// ws_ml). It lies in the K/V stages after the warps' combine buffers, at the same offset in every block.
__device__ __forceinline__ float* cluster_partial(int g) {
  extern __shared__ __align__(16) unsigned char attn_smem[];
  float* after_combine = reinterpret_cast<float*>(attn_smem + DECODE_ROWS * HEAD_DIM * sizeof(bf16)) +
                         DECODE_WARPS * DECODE_ROWS * (HEAD_DIM + 2);
  return after_combine + g * (HEAD_DIM + 2);
}
static_assert((DECODE_WARPS + 1) * DECODE_ROWS * (HEAD_DIM + 2) * sizeof(float) <=
                  2 * ATTN_STAGES * ATTN_KV_TILE * HEAD_DIM * sizeof(bf16),
              "the combine buffers and the cluster partials fit in the K/V stages");

// The merge of one cluster. Every thread block calls it, live (it has written its cluster_partial of every
// head) or not (a partition past the context). After a cluster barrier, live thread block p merges heads p,
// p + n_parts, ... of the group, reading the live blocks' shares through distributed shared memory; the
// second barrier keeps every thread block, and so its shared memory, alive until all reads are done.
__device__ void cluster_merge(bf16* out, int b, int kvh, int group, int NH, int n_parts, bool live) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  const int d = threadIdx.x;
  if (live) {
    for (int g = (int)cluster.block_rank(); g < group; g += n_parts) {
      float m_max = -INFINITY;
      for (int p = 0; p < n_parts; p++)
        m_max = fmaxf(m_max, cluster.map_shared_rank(cluster_partial(g), p)[HEAD_DIM]);
      float l_sum = 0.f, acc = 0.f;
      for (int p = 0; p < n_parts; p++) {
        const float* share = cluster.map_shared_rank(cluster_partial(g), p);
        const float f = fast_exp2(share[HEAD_DIM] - m_max);
        l_sum += share[HEAD_DIM + 1] * f;
        acc += share[d] * f;
      }
      out[(size_t)b * NH * HEAD_DIM + (kvh * group + g) * HEAD_DIM + d] = __float2bfloat16(acc / l_sum);
    }
  }
  cluster.sync();
#else
  __trap();  // not launched: clusters are used on sm_90 and later only
#endif
}

// ---- q/k-norm and RoPE, eight threads per head (switch fused_rope) ----
// Replaces: qk_norm_rope_kernel (section 7), which gives a head the whole thread block in turn: one thread
// per RoPE pair, a reduction over the thread block for every head and two 2-byte accesses per thread.
// Why it is faster: here 8 threads own one head, so the thread block works on all NH + NKV heads of its
// token at once, every access moves 16 bytes, and a head's sum of squares is three shuffles among its 8
// threads: thread j holds dims [8j, 8j+8) and their RoPE partners [64+8j, 64+8j+8). The token's 64 (cos, sin)
// pairs are computed once into shared memory. The arithmetic is section 7's, term for term (gpu_kernels
// checks both against the CPU reference). Every prefill step takes it (section 14's store_qkv stage), and
// the fused decode kernel below and the persistent kernel (section 25) are built from its pieces.
constexpr int ROPE_THREADS_PER_HEAD = 8;

// rope_angles: thread i < D/2 puts the cosine and sine of angle i of position pos into cos_s[i], sin_s[i].
__device__ __forceinline__ void rope_angles(float* cos_s, float* sin_s, int pos, const RopeInvFreq& inv_freq) {
  if (threadIdx.x < HEAD_DIM / 2) {
    float angle = (float)pos * inv_freq.v[threadIdx.x];
    sincosf(angle, &sin_s[threadIdx.x], &cos_s[threadIdx.x]);
  }
}
// head_sum_squares: the sum of squares of one head, over the 8 lanes that hold it (ua = dims 8j..8j+7,
// ub = dims 64+8j..). Every lane of the warp must call it (a shuffle); lanes without a head pass zeros.
__device__ __forceinline__ float head_sum_squares(const uint4& ua, const uint4& ub) {
  float a[8], b[8], ss = 0.f;
  bf16x8_to_float(ua, a);
  bf16x8_to_float(ub, b);
#pragma unroll
  for (int i = 0; i < 8; i++) ss += a[i] * a[i] + b[i] * b[i];
#pragma unroll
  for (int o = 1; o < ROPE_THREADS_PER_HEAD; o <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  return ss;
}
// head_norm_rope: lane j's share of RMSNorm(head) * w, then RoPE, in place on ua, ub (ss from above).
__device__ __forceinline__ void head_norm_rope(uint4& ua, uint4& ub, float ss, const bf16* w_head,
                                               const float* cos_s, const float* sin_s, int j, float eps) {
  float a[8], b[8], wa[8], wb[8], oa[8], ob[8];
  bf16x8_to_float(ua, a);
  bf16x8_to_float(ub, b);
  float scale = rsqrtf(ss / (float)HEAD_DIM + eps);
  const uint4* w = reinterpret_cast<const uint4*>(w_head);
  bf16x8_to_float(w[j], wa);
  bf16x8_to_float(w[j + 8], wb);
#pragma unroll
  for (int i = 0; i < 8; i++) {
    float na = bf16_round(wa[i] * bf16_round(a[i] * scale));  // the normed head, as HF stores it
    float nb = bf16_round(wb[i] * bf16_round(b[i] * scale));
    float c = cos_s[8 * j + i], s = sin_s[8 * j + i];
    oa[i] = na * c - nb * s;
    ob[i] = nb * c + na * s;
  }
  ua = float_to_bf16x8(oa);
  ub = float_to_bf16x8(ob);
}

// Where the kernel puts a finished k head and a token's v heads: a 16-byte chunk of 8 bf16 values (chunk c of
// row `row` = (block * NKV + head) * P + offset). Part I's cache holds bf16, so the store is a plain copy; the
// kernel is a template over this policy so that a cache format (15a) can store the same chunks its way.
struct KVStoreBf16 {
  bf16* k_cache;  // [NB, NKV, P, D]
  bf16* v_cache;
  __device__ void key(int64_t row, int chunk, uint4 v) const {
    reinterpret_cast<uint4*>(k_cache + row * HEAD_DIM)[chunk] = v;
  }
  __device__ void value(int64_t row, int chunk, uint4 v) const {
    reinterpret_cast<uint4*>(v_cache + row * HEAD_DIM)[chunk] = v;
  }
};

// Reads and writes qkv [T, (NH + 2*NKV) * D] in place as qk_norm_rope_kernel does; slot_mapping [T].
// Thread block = one token, 8 threads per head (qk_norm_rope_fast_threads).
template <class Store>
__global__ void qk_norm_rope_fast_kernel(bf16* qkv, const int* positions, const bf16* q_norm_w,
                                    const bf16* k_norm_w, Store store, const int* slot_mapping, int NH, int NKV,
                                    int P, float eps, RopeInvFreq inv_freq) {
  __shared__ float cos_s[HEAD_DIM / 2], sin_s[HEAD_DIM / 2];
  int t = blockIdx.x;
  const int slot = slot_mapping[t];
  const int64_t cache_block = slot / P, cache_offset = slot % P;  // used only when slot >= 0
  rope_angles(cos_s, sin_s, positions[t], inv_freq);
  __syncthreads();
  int j = threadIdx.x % ROPE_THREADS_PER_HEAD;  // which 8-dim slice of the head this thread owns
  int heads_per_pass = blockDim.x / ROPE_THREADS_PER_HEAD;
  int nheads = NH + NKV;                         // q heads then k heads: they are contiguous in qkv
  bf16* row = qkv + (int64_t)t * (NH + 2 * NKV) * HEAD_DIM;
  // Every thread runs the same number of passes so the 8-lane shuffles never see a missing lane.
  for (int base = 0; base < nheads; base += heads_per_pass) {
    int h = base + threadIdx.x / ROPE_THREADS_PER_HEAD;
    bool active = h < nheads;
    uint4* head = reinterpret_cast<uint4*>(row + (int64_t)h * HEAD_DIM);
    uint4 ua = {}, ub = {};
    if (active) ua = head[j], ub = head[j + 8];
    float ss = head_sum_squares(ua, ub);
    if (!active) continue;
    head_norm_rope(ua, ub, ss, h < NH ? q_norm_w : k_norm_w, cos_s, sin_s, j, eps);
    head[j] = ua;
    head[j + 8] = ub;
    if (h >= NH && slot >= 0) {  // a k head: into its cache slot too
      const int64_t cache_row = (cache_block * NKV + (h - NH)) * P + cache_offset;
      store.key(cache_row, j, ua);
      store.key(cache_row, j + 8, ub);
    }
  }
  if (slot < 0) return;
  constexpr int CHUNKS_PER_HEAD = HEAD_DIM / 8;  // the v heads go to the cache as they are
  const uint4* v_src = reinterpret_cast<const uint4*>(row + (int64_t)(NH + NKV) * HEAD_DIM);
  for (int c = threadIdx.x; c < NKV * CHUNKS_PER_HEAD; c += blockDim.x) {
    int h = c / CHUNKS_PER_HEAD, chunk = c % CHUNKS_PER_HEAD;
    store.value((cache_block * NKV + h) * P + cache_offset, chunk, v_src[c]);
  }
}
// Threads of one thread block: 8 per head, at least D/2 (one per RoPE angle), at most 512.
static int qk_norm_rope_fast_threads(int NH, int NKV) {
  return (int)std::min<int64_t>(512, std::max<int64_t>(HEAD_DIM / 2,
                                    cdiv((int64_t)(NH + NKV) * ROPE_THREADS_PER_HEAD, 32) * 32));
}
// Section 7's qk_norm_rope (the same arguments), eight threads per head.
static void qk_norm_rope_fast(bf16* qkv, const int* positions, const bf16* q_norm_w, const bf16* k_norm_w,
                              const KVLayer& cache, const int* slot_mapping, int T, int NH, int NKV, int P,
                              float rope_theta, float eps, cudaStream_t stream) {
  check_aligned16("qk_norm_rope_fast", "qkv", qkv);
  check_aligned16("qk_norm_rope_fast", "q_norm_w", q_norm_w);
  check_aligned16("qk_norm_rope_fast", "k_norm_w", k_norm_w);
  check_aligned16("qk_norm_rope_fast", "k_cache", cache.k);
  check_aligned16("qk_norm_rope_fast", "v_cache", cache.v);
  INTERNAL_CHECK(P > 0, "qk_norm_rope_fast: block size P = %d", P);
  if (T == 0) return;
  qk_norm_rope_fast_kernel<<<T, qk_norm_rope_fast_threads(NH, NKV), 0, stream>>>(
      qkv, positions, q_norm_w, k_norm_w, KVStoreBf16{cache.k, cache.v}, slot_mapping, NH, NKV, P, eps,
      rope_inv_freq(rope_theta));
  CUDA_CHECK(cudaGetLastError());
}

// Section 14's store_qkv stage with this kernel.
static void store_qkv_fast(Pass& p, int l) { store_qkv_using(p, l, qk_norm_rope_fast, p.m.kv.layer(l)); }

// ---- q/k-norm, RoPE and the KV store inside the decode kernel (switch fused_rope) ----
// Replaces: in decode steps, qk_norm_rope (section 7) and the kernel boundary between it and decode
// attention (section 16).
// Why it is faster: the decode kernel can do qk_norm_rope's work for its token itself. Every thread block
// normalises and rotates its group's query heads straight into its Q tile (the few hundred bytes are read
// from qkv by every thread block of the group, and the 64 sines and cosines computed by each: both cheaper
// than a kernel boundary); the thread block whose partition ends at the context's end (the "owner": key
// ctx-1 is this step's token) does the same for the k head, writes k and v to their cache slot (slot_mapping;
// -1 stores nothing) and puts them in its last tile itself, the one key its tile loads leave out (a format
// whose decode loop reads its tiles into registers takes it there: DecodeLoop<F>::attend). Because of that,
// everything a thread block reads before its Q tile was written before the kernel ahead of this one started:
// context lengths and block tables by the step's upload, the cached keys and values by earlier steps. So it
// issues its first K/V tile loads before pdl_begin() (section 17), while the qkv projection before it still
// runs; at batch 1 that is all of the keys it reads. The result is bit for bit that of qk_norm_rope followed
// by section 16's kernel, since the math is the same code (head_norm_rope, DecodeLoop<F>::attend,
// decode_combine_warps); gpu_attention checks it.
// The kernel's instances: <ROPE, CLUSTER> is <true, false>, <true, true>, or <false, true> (the cluster merge
// alone, after store_qkv).
struct DecodeRope {         // the fused q/k-norm + RoPE + KV store (ROPE = true)
  const int* positions;     // [B] the token's position
  const int* slot_mapping;  // [B] its cache slot, -1 = do not store
  const bf16* q_norm_w;     // [D]
  const bf16* k_norm_w;     // [D]
  float eps;
  RopeInvFreq inv_freq;
};

template <bool ROPE, bool CLUSTER, class F>
__global__ void __launch_bounds__(DECODE_WARPS * 32)
    attention_decode_fused_kernel(bf16* __restrict__ out, const bf16* __restrict__ qkv,
                                  typename F::Elem* __restrict__ k_cache, typename F::Elem* __restrict__ v_cache,
                                  typename F::Scales kv_scale,
                                  const int* __restrict__ context_lens, const int* __restrict__ block_tables,
                                  int NH, int NKV, int log2P, int MB, int max_parts, int partition,
                                  float* __restrict__ ws_o, float* __restrict__ ws_ml, float scale_log2,
                                  DecodeRope rope) {
  if (!ROPE) pdl_begin();  // q and this step's k/v come from qk_norm_rope, the kernel before
  const int part = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int ctx = context_lens[b];
  if (CLUSTER) partition = cdiv_dev(cdiv_dev(ctx, DECODE_CLUSTER), ATTN_KV_TILE) * ATTN_KV_TILE;
  const int key_begin = part * partition;
  if (key_begin >= ctx) {  // writes nothing; with ROPE it need not wait for the kernel before either
    if (CLUSTER) {  // it still takes part in the cluster's barriers, which end only with the live blocks
      pdl_trigger();
      cluster_merge(out, b, kvh, NH / NKV, NH, cdiv_dev(ctx, partition), false);
    }
    return;
  }
  const int key_end = min(ctx, key_begin + partition);
  const int group = NH / NKV;  // query heads kvh*group .. kvh*group + group-1 share this kv head
  const int* block_table = block_tables + (size_t)b * MB;
  const bool owner = ROPE && key_end == ctx;  // holds this step's token, key ctx-1
  const int new_key = owner ? ctx - 1 : -1;   // the key the tile loads leave out

  extern __shared__ __align__(16) unsigned char attn_smem[];
  bf16* sQ = reinterpret_cast<bf16*>(attn_smem);              // [DECODE_ROWS][D]
  bf16* sK = sQ + DECODE_ROWS * HEAD_DIM;                     // [ATTN_STAGES][ATTN_KV_TILE][D]
  bf16* sV = sK + ATTN_STAGES * ATTN_KV_TILE * HEAD_DIM;      // [ATTN_STAGES][ATTN_KV_TILE][D]
  // Static shared memory comes before the dynamic buffer, so its size sets where attn_smem starts: these
  // arrays are 512 bytes each (or unused and dropped), which keeps the tiles' rows on whole 128-byte lines.
  // A buffer that started 16 bytes into a line would make L2 serve every tile copy twice.
  __shared__ uint4 s_new_kv[2][HEAD_DIM / 8];                 // ROPE owner: this step's k and v, as in a tile
  __shared__ float cos_s[ROPE ? HEAD_DIM / 2 : 1], sin_s[ROPE ? HEAD_DIM / 2 : 1];

  // Row g of the Q tile is query head kvh*group + g of token b: the group's heads are adjacent in qkv.
  const bf16* qkv_row = qkv + (size_t)b * (NH + 2 * NKV) * HEAD_DIM;
  const bf16* q_src = qkv_row + (size_t)kvh * group * HEAD_DIM;
  if (!ROPE) {
    for (int i = threadIdx.x; i < DECODE_ROWS * 16; i += DECODE_WARPS * 32) {
      const int r = i >> 4, c = i & 15;
      cp_async_16(sQ + attn_smem_index(r, c), r < group ? q_src + r * HEAD_DIM + c * 8 : qkv, r < group);
    }
  }
  cp_async_commit();  // (empty with ROPE: the group count stays the same)
  using Loop = DecodeLoop<F>;
  Loop::issue_first(sK, sV, k_cache, v_cache, block_table, kvh, NKV, log2P, key_begin, key_end, new_key);
  if (ROPE) {
    pdl_begin();  // qkv is the kernel before's output
    rope_angles(cos_s, sin_s, rope.positions[b], rope.inv_freq);
    __syncthreads();
    // 8 threads per head as in qk_norm_rope_fast_kernel: heads 0..group-1 are the queries, head `group` the key
    // (owner only); Q rows past the group are zeros. Every thread runs the same passes (shuffles).
    const int j = threadIdx.x % ROPE_THREADS_PER_HEAD, nheads = group + (owner ? 1 : 0);
    for (int base = 0; base < max(DECODE_ROWS, group + 1); base += DECODE_WARPS * 32 / ROPE_THREADS_PER_HEAD) {
      const int r = base + threadIdx.x / ROPE_THREADS_PER_HEAD;
      const bool active = r < nheads;
      const uint4* src = reinterpret_cast<const uint4*>(r < group ? q_src + (size_t)r * HEAD_DIM
                                                                  : qkv_row + (size_t)(NH + kvh) * HEAD_DIM);
      uint4 ua = {}, ub = {};
      if (active) ua = src[j], ub = src[j + 8];
      const float ss = head_sum_squares(ua, ub);
      if (active)
        head_norm_rope(ua, ub, ss, r < group ? rope.q_norm_w : rope.k_norm_w, cos_s, sin_s, j, rope.eps);
      if (r == group && owner)
        s_new_kv[0][j] = F::key_tile_values(ua, kv_scale), s_new_kv[0][j + 8] = F::key_tile_values(ub, kv_scale);
      if (r < DECODE_ROWS) {
        *reinterpret_cast<uint4*>(sQ + attn_smem_index(r, j)) = r < group ? ua : uint4{};
        *reinterpret_cast<uint4*>(sQ + attn_smem_index(r, j + 8)) = r < group ? ub : uint4{};
      }
    }
    if (owner && threadIdx.x < HEAD_DIM / 8) {  // v as it is
      const uint4* v_src = reinterpret_cast<const uint4*>(qkv_row + (size_t)(NH + NKV + kvh) * HEAD_DIM);
      s_new_kv[1][threadIdx.x] = F::value_tile_values(v_src[threadIdx.x], kv_scale);
    }
    __syncthreads();
    const int slot = owner ? rope.slot_mapping[b] : -1;
    if (slot >= 0 && threadIdx.x < 2 * HEAD_DIM / 8) {  // into the cache: k by threads 0-15, v by 16-31
      const int kv = threadIdx.x / 16, c = threadIdx.x % 16;
      const size_t row = (((size_t)(slot >> log2P) * NKV + kvh) << log2P) + (slot & ((1 << log2P) - 1));
      F::store_tile_values((kv ? v_cache : k_cache) + row * HEAD_DIM, c, s_new_kv[kv][c]);
    }
  }
  cp_async_wait<1>();  // the Q tile has landed (the first K/V tile is the group after it)
  __syncthreads();
  uint32_t q[HEAD_DIM / 16][4];
  Loop::q_fragments(q, sQ);
  scale_log2 = F::score_scale(scale_log2, kv_scale);

  typename Loop::Acc sums;  // the left-out key (owner only) comes from s_new_kv
  Loop::attend(q, sK, sV, k_cache, v_cache, kv_scale, block_table, kvh, NKV, log2P, key_begin, key_end, new_key,
               s_new_kv, group, scale_log2, sums);
  const bool single = key_begin == 0 && key_end == ctx;  // the only live partition: finish here
  decode_combine_warps<F>(sums, scale_log2, sK, group, [&](int g, float acc, float m_max, float l_sum) {
    const int h = kvh * group + g, d = threadIdx.x;
    if (CLUSTER) {  // this partition's share of head g, for cluster_merge (same offset in every block)
      cluster_partial(g)[d] = acc;
      if (d == 0) cluster_partial(g)[HEAD_DIM] = m_max, cluster_partial(g)[HEAD_DIM + 1] = l_sum;
    } else if (single) {
      out[(size_t)b * NH * HEAD_DIM + h * HEAD_DIM + d] = __float2bfloat16(acc / l_sum);
    } else {
      const size_t slot = ((size_t)b * NH + h) * max_parts + part;
      ws_o[slot * HEAD_DIM + d] = acc;
      if (d == 0) ws_ml[slot * 2] = m_max, ws_ml[slot * 2 + 1] = l_sum;
    }
  });
  if (CLUSTER) cluster_merge(out, b, kvh, group, NH, cdiv_dev(ctx, partition), true);
}

// The fused kernel of this kind, its opt-ins (the decode shared memory; clusters of 16) made once.
template <bool ROPE, bool CLUSTER, class F = KVBf16>
static auto decode_fused_kernel() {
  static bool ready = false;
  auto kernel = attention_decode_fused_kernel<ROPE, CLUSTER, F>;
  if (!ready) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)DECODE_SMEM));
    if (CLUSTER) CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    ready = true;
  }
  return kernel;
}

// Whether this GPU can run the cluster kernel: sm_90 or later, and a cluster of DECODE_CLUSTER thread
// blocks with the kernel's shared memory fits (asked once per cache format).
template <class F = KVBf16>
static bool decode_clusters_supported() {
  static int ok = -1;
  if (ok < 0) {
    ok = 0;
    if (gpu_cc_major() >= 9) {
      cudaLaunchConfig_t cfg = {};
      cudaLaunchAttribute attr = {};
      attr.id = cudaLaunchAttributeClusterDimension;
      attr.val.clusterDim = {DECODE_CLUSTER, 1, 1};
      cfg.gridDim = dim3(DECODE_CLUSTER, 1, 1), cfg.blockDim = DECODE_WARPS * 32;
      cfg.dynamicSmemBytes = DECODE_SMEM, cfg.attrs = &attr, cfg.numAttrs = 1;
      int clusters = 0;
      ok = cudaOccupancyMaxActiveClusters(&clusters, decode_fused_kernel<true, true, F>(), &cfg) == cudaSuccess &&
           clusters > 0;
      cudaGetLastError();  // a refusal is an answer, not an error
    }
  }
  return ok;
}

// Section 16's decode attention with this section's two steps where switched on. Arguments as there, except:
// rope: null = q and this step's k/v are ready (qk_norm_rope ran); else the fused kernel (ROPE = true): qkv
// is the raw projection, and this step's k and v go to the cache here (the cache is written). F: the cache
// format (section 15).
template <class F = KVBf16>
static void attention_decode_fast(bf16* out, const bf16* qkv, const typename F::Layer& cache,
                                  const int* context_lens, const int* block_tables, int B, int NH, int NKV, int P,
                                  int MB, int max_context_len, float* workspace, float scale, cudaStream_t stream,
                                  const DecodeRope* rope) {
  const bool cluster = g_opt.cluster_merge && B <= DECODE_CLUSTER_MAX_B && decode_clusters_supported<F>();
  if (!rope && !cluster)
    return flash_attention_decode<F>(out, qkv, cache, context_lens, block_tables, B, NH, NKV, P, MB, max_context_len,
                            workspace, scale, stream);
  check_attention_shapes("attention_decode_fast", NH, NKV, P);
  INTERNAL_CHECK(NH / NKV <= DECODE_ROWS, "attention_decode_fast: NH/NKV = %d query heads per kv head, at most %d",
                 NH / NKV, DECODE_ROWS);
  if (rope) {
    check_aligned16("attention_decode_fast", "q_norm_w", rope->q_norm_w);
    check_aligned16("attention_decode_fast", "k_norm_w", rope->k_norm_w);
  }
  if (B == 0) return;
  const float scale_log2 = scale * (float)M_LOG2E;
  const DecodeRope r = rope ? *rope : DecodeRope{};
  typename F::Elem* k_cache = F::keys(cache);
  typename F::Elem* v_cache = F::values(cache);
  if (cluster) {  // merged inside the kernel
    auto kernel = rope ? decode_fused_kernel<true, true, F>() : decode_fused_kernel<false, true, F>();
    launch_pdl_cluster(DECODE_CLUSTER, kernel, dim3(DECODE_CLUSTER, NKV, B), DECODE_WARPS * 32, DECODE_SMEM,
                       stream, out, qkv, k_cache, v_cache, F::scales(cache), context_lens, block_tables, NH, NKV,
                       __builtin_ctz(P), MB, 0, 0, nullptr, nullptr, scale_log2, r);
    CUDA_CHECK(cudaGetLastError());
    return;
  }
  const int partition = DecodeLoop<F>::partition(B);
  const int max_parts = (int)cdiv(max_context_len, partition);
  float* ws_o = workspace;                                           // [B, NH, max_parts, D]
  float* ws_ml = workspace + (size_t)B * NH * max_parts * HEAD_DIM;  // [B, NH, max_parts, 2]
  launch_pdl(decode_fused_kernel<true, false, F>(), dim3(max_parts, NKV, B), DECODE_WARPS * 32, DECODE_SMEM,
             stream, out, qkv, k_cache, v_cache, F::scales(cache), context_lens, block_tables, NH, NKV,
             __builtin_ctz(P), MB, max_parts, partition, ws_o, ws_ml, scale_log2, r);
  CUDA_CHECK(cudaGetLastError());
  // section 16's merge kernel, launched the ordinary way (it has no pdl_begin)
  flash_decode_merge(out, context_lens, ws_o, ws_ml, B, NH, max_parts, partition, stream);
}

// ---- The stages this section fills, and its switches: cluster_merge, fused_rope ----
// Both change flash_attn's decode kernel (section 16), so they act only where flash_attn is on too.
// cluster_merge: the decode rows' kernel (section 16's g_decode_attention) merges in a cluster where it can.
template <class F = KVBf16>
static void attention_decode_cluster(bf16* out, const bf16* qkv, const typename F::Layer& cache,
                                     const int* context_lens, const int* block_tables, int B, int NH, int NKV, int P,
                                     int MB, int max_context_len, float* workspace, float scale, cudaStream_t stream) {
  attention_decode_fast<F>(out, qkv, cache, context_lens, block_tables, B, NH, NKV, P, MB, max_context_len,
                        workspace, scale, stream, nullptr);
}
static void apply_cluster_merge(bool on, Hooks&) {
  g_opt.cluster_merge = on;
  if (on && g_opt.flash_attn) g_decode_attention = attention_decode_cluster<KVBf16>;
}
static std::string cluster_merge_note(const Qwen3&) {
  return decode_clusters_supported() ? "" : "cluster_merge needs sm_90, off here";
}
static const int kClusterMergeRegistered = register_optimization(
    {"cluster_merge", "decode's split-K merge inside a cluster (section 19)", true, apply_cluster_merge,
     cluster_merge_note});

// fused_rope: section 14's attention_decode stage as one kernel, and its store_qkv stage as the eight-lane
// kernel above (every prefill step takes it).
static void fused_attention_decode_stage(Pass& p, int l) {
  Qwen3& m = p.m;
  const ModelConfig& c = m.cfg;
  const LayerWeights& lw = m.w.layers[l];
  const KVLayer cache = m.kv.layer(l);
  const DecodeRope rope{p.in.positions, p.in.slot_mapping, lw.q_norm, lw.k_norm, c.rms_norm_eps,
                        rope_inv_freq(c.rope_theta)};
  attention_decode_fast(m.act.attn, m.act.qkv, cache, p.in.seqlens_k, p.in.block_tables, p.B,
                        c.num_attention_heads / m.tp, c.num_key_value_heads / m.tp, m.P, m.MB, m.max_model_len,
                        m.act.attn_workspace, 1.0f / sqrtf((float)c.head_dim), p.s, &rope);
}
static void apply_fused_rope(bool on, Hooks& h) {
  g_opt.fused_rope = on;
  if (!on) return;
  ForwardStages& st = stages_for(h);
  st.store_qkv = store_qkv_fast;
  if (g_opt.flash_attn) st.attention_decode = fused_attention_decode_stage;
}
static const int kFusedRopeRegistered = register_optimization(
    {"fused_rope", "q/k-norm, RoPE and the KV store inside decode attention (section 19)", true,
     apply_fused_rope});

// ==== 20. All-reduce over NVLink: one-shot, and two-shot for large messages ===============================
// defines: OneShot, all_reduce_p2p, all_reduce_2shot, ARRoad, ar_road, all_reduce_fast, oneshot_setup; switches
//          oneshot_allreduce, twoshot_allreduce
//
// Replaces: section 12's NCCL all-reduce for messages up to ar_max_bytes(N) (decode's), and the residual add
// that follows it (add_rmsnorm's add, section 7), when every GPU can write every other GPU's memory (NVLink,
// or PCIe peer-to-peer); with 20b (twoshot_allreduce) also the larger messages of large decode batches, up
// to AR_TWOSHOT_MAX_BYTES.
// Why it is faster: NCCL's ring all-reduce costs 2(N-1) dependent steps plus its own kernel set-up, paid 73
// times per token for Qwen3-8B; for an 8 KB message that is all latency. The one-shot road (after the
// "custom all-reduce" of vLLM and TensorRT-LLM): each rank writes its partial sums straight into a staging
// buffer on every other rank (mapped with CUDA IPC), then adds what arrived in its own memory. There are no
// flags and no barrier: a staging slot holds a value no partial sum is sent as (bf16 -0.0, see below) until
// the data lands, so "has it arrived?" is read from the data itself (the Lamport-style all-reduce of
// TensorRT-LLM). One crossing of NVLink per call, and no release/acquire pair at system scope, which must
// wait for the thread block's NVLink stores to be acknowledged. The sum can also land in the residual stream
// at once (residual += sum): section 14 uses that instead of a separate add, so at N > 1 the add costs no
// kernel. The one-shot road makes every rank send N-1 copies of its message and add up all N of them; past
// a few hundred KB on four GPUs that is more than NCCL's ring moves (2(N-1)/N of it), and past a MB on two
// the adding shows, and 20b's two-shot road takes over: it moves what the ring moves, in two crossings
// instead of 2(N-1) steps, and each rank adds up 1/N of the message. The largest messages (prefill) stay
// with NCCL.
// Switches: oneshot_allreduce, twoshot_allreduce (20b). NANOVLLM_ALLREDUCE=skip (section 12) skips every
// all-reduce on every road. Measurements: docs/tensor-parallel.md.

constexpr int AR_THREADS = 512;             // threads of an all-reduce thread block, 16 bytes each a pass
constexpr int AR_MAX_BLOCKS = 128;          // the most any call may ask for (a copy of the call counter each):
                                            // every block of a call must be resident at once, so no call has
                                            // more than the GPU has SMs (ar_launch)
constexpr int AR_BLOCKS = AR_MAX_BLOCKS;    // the launchers' default: one block per AR_THREADS chunks, up to
                                            // this (a 2 MB message spreads over 128 SMs; fewer blocks leave
                                            // NVLink idle: docs/tensor-parallel.md times 32, 64 and 128)
constexpr size_t AR_DATA_BYTES = 1 << 20;   // the largest one-shot message at N = 2 (decode: B * H * 2)
constexpr size_t AR_ONESHOT_MANY_RANKS = 512 << 10;  // ... and at N > 2, where every rank writes (N-1)x the
                                                     // message: the two-shot road wins sooner
constexpr uint16_t AR_EMPTY = 0x8000;       // bf16 -0.0: "not arrived yet" in a staging slot
static size_t ar_max_bytes(int size) { return size == 2 ? AR_DATA_BYTES : AR_ONESHOT_MANY_RANKS; }
constexpr size_t AR_TWOSHOT_MAX_BYTES = 8 << 20;  // the largest two-shot message (20b): a decode step of
                                                  // 512 rows of H = 5120 is 5 MB

// Every rank's staging buffer, as mapped into this process, in 16-byte chunks: rank d's is two halves of
// ar_half_chunks(size) chunks each; a call uses one half, either as the one-shot road lays it out
//   data [size][ar_max_bytes(size)]        data[s]: what rank s sent to rank d, or AR_EMPTY
// or as the two-shot road does (20b)
//   scatter [size][twoshot_part_chunks]    scatter[s]: rank s's partials of the slice rank d sums
//   gather [AR_TWOSHOT_MAX_BYTES]          the sums of the other ranks' slices, each at its place
static int64_t ar_oneshot_slot_chunks(int size) { return (int64_t)(ar_max_bytes(size) / 16); }
static int64_t ar_twoshot_part_chunks(int size) { return cdiv((int64_t)(AR_TWOSHOT_MAX_BYTES / 16), size); }
static int64_t ar_half_chunks(int size) {  // (at N = 2 both layouts take 16 MB)
  return std::max(size * ar_oneshot_slot_chunks(size),
                  size * ar_twoshot_part_chunks(size) + (int64_t)(AR_TWOSHOT_MAX_BYTES / 16));
}
struct ARPeers {
  bf16* data[TP_MAX_RANKS];
};

struct OneShot {
  ARPeers peers{};
  uint64_t* epochs = nullptr;  // [AR_MAX_BLOCKS] calls made so far, one copy per thread block (all equal)
};

// ---- all_reduce_p2p ------------------------------------------------------------------------------------
// Replaces: ncclAllReduce(x, x, n, ncclBfloat16, ncclSum) (torch.distributed.all_reduce in nano-vllm's
//           RowParallelLinear and VocabParallelEmbedding) for messages up to ar_max_bytes(N), and with
//           `residual` the add that follows it in Qwen3DecoderLayer (the residual input of the next RMSNorm).
// Reads  x [n] bf16 on every rank (that rank's partial sum), and the other ranks' partials as they arrive.
// Writes the sum over ranks, added in fp32 in rank order 0..N-1 on every rank so that all ranks get the same
//        bits (they must: the residual stream of every rank has to stay identical), rounded to bf16 and
//          residual == nullptr:  into x
//          otherwise:            into residual [n]: residual = bf16(residual + bf16(sum)), the rounding of
//                                an all-reduce followed by add_rmsnorm's add (section 7)
//        A partial of -0.0 is sent and added as +0.0 (-0.0 means "empty"); only the sign of a zero sum
//        can differ from NCCL's.
// A thread owns the 16-byte chunks c = blockIdx.x * blockDim.x + threadIdx.x + k * gridDim.x * blockDim.x:
//   1. push: it stores its chunks of x into data[h][my rank] of every other rank (stores over NVLink);
//   2. for each other rank s, it reads data[h][s][c] from its own memory until none of the 8 values is
//      AR_EMPTY, which means all 16 bytes have landed (a wider store may land in parts; each part is new),
//      adds, and writes AR_EMPTY back, ready for the next use of the slot.
// Call k uses half h = k % 2. A rank writes half h again only at call k + 2, after call k + 1 got data from
// every rank, and each rank sends that only after its own call k has finished, emptied slots included
// (kernels run in stream order, each waiting for the one before, section 17). So two halves are enough,
// whichever road each call takes: at the end of a call every slot the call filled is empty again.
// The call number lives in device memory and the kernel bumps it itself, so the kernel works eagerly and
// replayed from any CUDA graph, in any mix, as long as every rank makes the same calls in the same order.
// Every block keeps its own copy (no block may read a counter another block of the same call updates):
// block b reads epochs[b] and writes the new number into every copy j = b (mod gridDim.x), so all copies
// stay equal whatever grid the next call has.
// Preconditions: n % 8 == 0, 2n <= ar_max_bytes(N), every rank calls it in the same order with the same n.
__device__ __forceinline__ uint4 ld_volatile16(const uint4* p) {  // a fresh read from memory every time
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}
__device__ __forceinline__ bool ar_has_empty(const uint4& v) {  // any of the 8 bf16 equal to AR_EMPTY
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  bool empty = false;
#pragma unroll
  for (int i = 0; i < 4; i++) empty |= (w[i] & 0xffffu) == AR_EMPTY || (w[i] >> 16) == AR_EMPTY;
  return empty;
}
__device__ __forceinline__ uint4 ar_no_negative_zero(uint4 v) {  // -0.0 -> +0.0 in each of the 8 bf16
  uint32_t* w = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    if ((w[i] & 0xffffu) == AR_EMPTY) w[i] &= 0xffff0000u;
    if ((w[i] >> 16) == AR_EMPTY) w[i] &= 0x0000ffffu;
  }
  return v;
}
// What arrived in slot p: waits until none of its 8 values is AR_EMPTY, then empties it for the next use.
__device__ __forceinline__ uint4 ar_take(uint4* p) {
  constexpr uint32_t EMPTY2 = AR_EMPTY * 0x10001u;  // two empty bf16
  uint4 u;
  do u = ld_volatile16(p);
  while (ar_has_empty(u));
  *p = make_uint4(EMPTY2, EMPTY2, EMPTY2, EMPTY2);
  return u;
}
// Chunk c of the result: sum (8 bf16, the sum over the ranks rounded once) into x, or added into the
// residual stream.
__device__ __forceinline__ void ar_store(uint4* xv, uint4* rv, int64_t c, const uint4& sum) {
  if (!rv) {
    xv[c] = sum;
    return;
  }
  float s[8], r[8];
  bf16x8_to_float(sum, s);
  bf16x8_to_float(rv[c], r);
#pragma unroll
  for (int i = 0; i < 8; i++) s[i] += r[i];
  rv[c] = float_to_bf16x8(s);
}
// What a thread of either road's kernel starts from: the call number (1, 2, ...) as this block's copy holds
// it (ar_call_done stores it back), the first chunk of this call's half of the staging buffer, and the
// thread's first chunk and stride over the message. Waits for the kernel before (PDL, section 17) first.
struct ARCall {
  uint64_t epoch;
  int64_t half, first, stride;
};
__device__ __forceinline__ ARCall ar_call(const uint64_t* epochs, int64_t half_chunks) {
  pdl_begin();
  const uint64_t epoch = epochs[blockIdx.x] + 1;
  return {epoch, (int64_t)(epoch & 1) * half_chunks, (int64_t)blockIdx.x * blockDim.x + threadIdx.x,
          (int64_t)gridDim.x * blockDim.x};
}
__device__ __forceinline__ void ar_call_done(uint64_t* epochs, uint64_t epoch) {
  if (threadIdx.x == 0)
    for (int j = blockIdx.x; j < AR_MAX_BLOCKS; j += gridDim.x) epochs[j] = epoch;
}

__global__ __launch_bounds__(AR_THREADS) void all_reduce_p2p_kernel(bf16* x, bf16* residual, ARPeers peers,
                                                                    uint64_t* epochs, int64_t chunks,
                                                                    int64_t half_chunks, int64_t slot_chunks,
                                                                    int rank, int size) {
  const ARCall k = ar_call(epochs, half_chunks);
  const int64_t first = k.first, stride = k.stride;
  uint4* xv = reinterpret_cast<uint4*>(x);
  auto slot = [&](int owner, int from) {  // data[from] of this call's half in rank owner's buffer
    return reinterpret_cast<uint4*>(peers.data[owner]) + k.half + from * slot_chunks;
  };
  for (int64_t c = first; c < chunks; c += stride) {  // 1. push
    const uint4 v = ar_no_negative_zero(xv[c]);
    for (int r = 0; r < size; r++)
      if (r != rank) slot(r, rank)[c] = v;
  }
  for (int64_t c = first; c < chunks; c += stride) {  // 2. wait, add, empty
    float sum[8] = {}, v[8];
    for (int r = 0; r < size; r++) {
      bf16x8_to_float(r == rank ? ar_no_negative_zero(xv[c]) : ar_take(slot(rank, r) + c), v);
#pragma unroll
      for (int i = 0; i < 8; i++) sum[i] += v[i];
    }
    ar_store(xv, reinterpret_cast<uint4*>(residual), c, float_to_bf16x8(sum));
  }
  ar_call_done(epochs, k.epoch);
}
// Launches either road's kernel (the same arguments; `region`: the chunks of one sender's region in a
// half) over n elements on up to max_blocks thread blocks.
template <class Kernel>
static void ar_launch(Kernel kernel, const char* name, TPComm* comm, bf16* x, bf16* residual, size_t n,
                      int64_t region, cudaStream_t stream, int max_blocks) {
  check_aligned16(name, "x", x);
  if (residual) check_aligned16(name, "residual", residual);
  INTERNAL_CHECK(max_blocks >= 1 && max_blocks <= AR_MAX_BLOCKS, "%s: %d blocks", name, max_blocks);
  const int64_t chunks = (int64_t)n / 8;
  const int blocks = (int)std::min<int64_t>(std::min(max_blocks, gpu_sm_count()), cdiv(chunks, AR_THREADS));
  const OneShot* os = (const OneShot*)comm->fast;
  launch_pdl(kernel, blocks, AR_THREADS, 0, stream, x, residual, os->peers, os->epochs, chunks,
             ar_half_chunks(comm->size), region, comm->rank, comm->size);
  CUDA_CHECK(cudaGetLastError());
}
static void all_reduce_p2p(TPComm* comm, bf16* x, bf16* residual, size_t n, cudaStream_t stream,
                           int max_blocks = AR_BLOCKS) {
  check_vec8("all_reduce_p2p", "n", (int64_t)n);
  INTERNAL_CHECK(n * sizeof(bf16) <= ar_max_bytes(comm->size), "all_reduce_p2p: %zu elements exceed the "
                 "staging buffer", n);
  if (n == 0) return;
  ar_launch(all_reduce_p2p_kernel, "all_reduce_p2p", comm, x, residual, n, ar_oneshot_slot_chunks(comm->size),
            stream, max_blocks);
}

// ---- 20b. Two-shot: the large messages (switch twoshot_allreduce) ---------------------------------------
// Replaces: NCCL's ring for messages over ar_max_bytes(N), up to AR_TWOSHOT_MAX_BYTES (a decode step of
//           more than a few dozen rows on four GPUs, of more than 128 rows of H = 4096 on two), and the
//           residual add after it.
// Why it is faster: the one-shot road sends (N-1) copies of the whole message from every rank and has every
// rank add all N; this road splits the message into N slices and gives rank j slice j to sum, so each rank
// sends (N-1)/N of the message twice, what NCCL's ring sends, but in two crossings of NVLink (scatter, then
// gather) where the ring takes 2(N-1) dependent steps, and with no NCCL kernel to set up; and each rank
// adds up only its slice (at N = 2 both roads move the message once, and that is the difference). The
// "two-shot" all-reduce of vLLM's and TensorRT-LLM's custom all-reduce, here with the Lamport-style empty
// mark of the one-shot road, so no barrier between the two shots either.
// Reads  x [n] bf16 on every rank (that rank's partial sum).
// Writes what all_reduce_p2p writes, bit for bit: the owner of a slice adds the ranks' partials in fp32 in
//        rank order 0..N-1, as the one-shot road does, rounds once, and every rank stores that.
// The message is cut into N slices of part = ceil(chunks / N) 16-byte chunks; rank j owns slice j.
//   1. scatter: each rank stores chunk c of slice j (j != its own) into scatter[its rank] of rank j;
//   2. reduce: each rank takes the N-1 partials of its own slice as they land, adds them with its own in
//      rank order, and stores the sum into gather[c] of every other rank, and into its own output;
//   3. gather: each rank takes the other slices' sums from its gather region as they land.
// Step 3 waits for step 2 of other ranks, which waits only for step 1, which waits for nothing: no cycle.
// The halves are reused as in the one-shot road (a call's slots are all emptied before the call ends).
// Preconditions: n % 8 == 0, chunks >= N * N (every slice holds chunks), 2n <= AR_TWOSHOT_MAX_BYTES.
__global__ __launch_bounds__(AR_THREADS) void all_reduce_2shot_kernel(bf16* x, bf16* residual, ARPeers peers,
                                                                      uint64_t* epochs, int64_t chunks,
                                                                      int64_t half_chunks, int64_t part_chunks,
                                                                      int rank, int size) {
  const ARCall k = ar_call(epochs, half_chunks);
  const int64_t first = k.first, stride = k.stride, half = k.half;
  const int64_t part = (chunks + size - 1) / size;
  uint4* xv = reinterpret_cast<uint4*>(x);
  uint4* rv = reinterpret_cast<uint4*>(residual);
  auto scatter = [&](int owner, int from) {  // scatter[from] of this call's half in rank owner's buffer
    return reinterpret_cast<uint4*>(peers.data[owner]) + half + from * part_chunks;
  };
  auto gather = [&](int owner) {  // gather of this call's half in rank owner's buffer
    return reinterpret_cast<uint4*>(peers.data[owner]) + half + size * part_chunks;
  };
  for (int64_t c = first; c < chunks; c += stride) {  // 1. scatter
    const int j = (int)(c / part);
    if (j != rank) scatter(j, rank)[c - j * part] = ar_no_negative_zero(xv[c]);
  }
  const int64_t lo = rank * part, hi = std::min(chunks, lo + part);
  for (int64_t c = lo + first; c < hi; c += stride) {  // 2. reduce this rank's slice
    float sum[8] = {}, v[8];
    for (int r = 0; r < size; r++) {
      bf16x8_to_float(r == rank ? ar_no_negative_zero(xv[c]) : ar_take(scatter(rank, r) + (c - lo)), v);
#pragma unroll
      for (int i = 0; i < 8; i++) sum[i] += v[i];
    }
    const uint4 s = float_to_bf16x8(sum);  // (never -0.0: the sum starts at +0.0 and adds no -0.0)
    for (int r = 0; r < size; r++)
      if (r != rank) gather(r)[c] = s;
    ar_store(xv, rv, c, s);
  }
  for (int64_t c = first; c < chunks; c += stride)  // 3. gather the other slices
    if (c < lo || c >= hi) ar_store(xv, rv, c, ar_take(gather(rank) + c));
  ar_call_done(epochs, k.epoch);
}
static bool twoshot_fits(const TPComm* comm, size_t n) {
  return n % 8 == 0 && (int64_t)n / 8 >= (int64_t)comm->size * comm->size &&
         n * sizeof(bf16) <= AR_TWOSHOT_MAX_BYTES;
}
static void all_reduce_2shot(TPComm* comm, bf16* x, bf16* residual, size_t n, cudaStream_t stream,
                             int max_blocks = AR_BLOCKS) {
  INTERNAL_CHECK(twoshot_fits(comm, n), "all_reduce_2shot: %zu elements on %d ranks do not fit", n, comm->size);
  ar_launch(all_reduce_2shot_kernel, "all_reduce_2shot", comm, x, residual, n,
            ar_twoshot_part_chunks(comm->size), stream, max_blocks);
}

// residual [n] = bf16(residual + x): the add after an NCCL all-reduce, rounded like the one-shot kernel's.
__global__ void residual_add_kernel(bf16* residual, const bf16* x, int64_t chunks) {
  pdl_begin();
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= chunks) return;
  float r[8], v[8];
  bf16x8_to_float(reinterpret_cast<const uint4*>(residual)[c], r);
  bf16x8_to_float(reinterpret_cast<const uint4*>(x)[c], v);
#pragma unroll
  for (int i = 0; i < 8; i++) r[i] += v[i];
  reinterpret_cast<uint4*>(residual)[c] = float_to_bf16x8(r);
}

// The road a message of n elements takes: the one-shot road where switched on and the message fits, else
// the two-shot road where switched on and it fits, else NCCL. It depends only on n and on what every rank
// agreed at start-up, so it is the same everywhere.
enum class ARRoad { ONESHOT, TWOSHOT, NCCL };
static ARRoad ar_road(const TPComm* comm, size_t n) {
  if (g_opt.oneshot_allreduce && comm->fast && n % 8 == 0 && n * sizeof(bf16) <= ar_max_bytes(comm->size))
    return ARRoad::ONESHOT;
  if (g_opt.twoshot_allreduce && comm->fast && twoshot_fits(comm, n)) return ARRoad::TWOSHOT;
  return ARRoad::NCCL;
}

// The sum of x over the ranks: in place into x, or, with `residual`, added into residual (x then holds this
// rank's partial still, or the sum: callers must not rely on either), on ar_road's road (NCCL plus
// residual_add_kernel). Every rank must make the same calls in the same order.
static void all_reduce_fast(TPComm* comm, bf16* x, size_t n, cudaStream_t stream, bf16* residual) {
  if (comm->skip) return;
  const ARRoad road = ar_road(comm, n);
  if (road == ARRoad::ONESHOT) return all_reduce_p2p(comm, x, residual, n, stream);
  if (road == ARRoad::TWOSHOT) return all_reduce_2shot(comm, x, residual, n, stream);
  all_reduce_sum(comm, x, n, stream);
  if (residual && n > 0) {
    check_vec8("all_reduce_fast (residual)", "n", (int64_t)n);
    const int64_t chunks = (int64_t)n / 8;
    launch_pdl(residual_add_kernel, (unsigned)cdiv(chunks, 256), 256, 0, stream, residual, x, chunks);
    CUDA_CHECK(cudaGetLastError());
  }
}

// Set up the staging buffers of both roads, once per communicator: map every rank's buffer into this process.
// Every step is agreed by all ranks (an all_reduce_min of "it worked here"), so they all take the same road
// afterwards. Every rank calls it at the same point (ModelRunner's constructor).
static void oneshot_setup(TPComm* c) {
  static std::set<const TPComm*> tried;  // the communicators this ran for (comm->fast is set on success only)
  if (!tried.insert(c).second) return;
  int ok = 1;
  for (int r = 0; r < c->size; r++) {
    int can = 1;
    if (r != c->rank) CUDA_CHECK(cudaDeviceCanAccessPeer(&can, c->rank, r));
    ok &= can;
  }
  if (!all_reduce_min(c, ok)) return;
  char* buf;
  const size_t bytes = 2 * ar_half_chunks(c->size) * 16;
  CUDA_CHECK(cudaMalloc(&buf, bytes));
  const std::vector<uint16_t> empty(bytes / 2, AR_EMPTY);  // every slot starts empty
  CUDA_CHECK(cudaMemcpy(buf, empty.data(), bytes, cudaMemcpyHostToDevice));
  OneShot* os = new OneShot;
  CUDA_CHECK(cudaMalloc(&os->epochs, AR_MAX_BLOCKS * sizeof(uint64_t)));
  CUDA_CHECK(cudaMemset(os->epochs, 0, AR_MAX_BLOCKS * sizeof(uint64_t)));
  CUDA_CHECK(cudaDeviceSynchronize());  // emptied before any rank can see the buffer
  // Exchange the IPC handles with an all-gather of their bytes.
  const size_t hb = sizeof(cudaIpcMemHandle_t);
  std::vector<cudaIpcMemHandle_t> handles(c->size);
  CUDA_CHECK(cudaIpcGetMemHandle(&handles[c->rank], buf));
  char* d;
  CUDA_CHECK(cudaMalloc(&d, c->size * hb));
  CUDA_CHECK(cudaMemcpyAsync(d + c->rank * hb, &handles[c->rank], hb, cudaMemcpyHostToDevice, c->stream));
  NCCL_CHECK(ncclAllGather(d + c->rank * hb, d, hb, ncclUint8, c->nccl, c->stream));
  CUDA_CHECK(cudaStreamSynchronize(c->stream));
  CUDA_CHECK(cudaMemcpy(handles.data(), d, c->size * hb, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaFree(d));
  for (int r = 0; r < c->size; r++) {
    void* p = buf;
    if (r != c->rank && cudaIpcOpenMemHandle(&p, handles[r], cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky: report it through `ok`, NCCL carries on alone
      ok = 0;
      continue;
    }
    os->peers.data[r] = static_cast<bf16*>(p);
  }
  if (all_reduce_min(c, ok) == 1) c->fast = os;  // else NCCL alone (the buffers stay: start-up only)
}

// ---- The stage this section fills, and its switches: oneshot_allreduce, twoshot_allreduce ----
// Section 14's all_reduce: the roads switched on where the message fits, else NCCL and residual_add_kernel;
// either way, given the residual stream, the sum goes into it. Either switch installs it and the set-up.
static bool all_reduce_nvlink(TPComm* comm, bf16* x, size_t n, cudaStream_t s, bf16* residual) {
  all_reduce_fast(comm, x, n, s, residual);
  return residual != nullptr;
}
static void install_nvlink_allreduce(Hooks& h) {
  stages_for(h).all_reduce = all_reduce_nvlink;
  if (std::find(h.tp_ready.begin(), h.tp_ready.end(), oneshot_setup) == h.tp_ready.end())
    h.tp_ready.push_back(oneshot_setup);
}
static void apply_oneshot(bool on, Hooks& h) {
  g_opt.oneshot_allreduce = on;
  if (on) install_nvlink_allreduce(h);
}
static void apply_twoshot(bool on, Hooks& h) {
  g_opt.twoshot_allreduce = on;
  if (on) install_nvlink_allreduce(h);
}
static std::string oneshot_note(const Qwen3& model) {
  return model.tp > 1 && !model.comm->fast ? "oneshot_allreduce: the GPUs cannot reach each other's memory, "
                                             "NCCL alone"
                                           : "";
}
static const int kOneshotRegistered = register_optimization(
    {"oneshot_allreduce", "one-shot all-reduce over NVLink (section 20)", true, apply_oneshot, oneshot_note});
static const int kTwoshotRegistered = register_optimization(
    {"twoshot_allreduce", "two-shot all-reduce over NVLink for large decode messages (section 20b)",
     true, apply_twoshot, nullptr});

// ==== 21. The fast sampler, 1: the cut by bisection ========================================================
// defines: float_order_key, float_from_order_key, min_p_threshold, sample_bisect; switch bisect_sampler
//
// Replaces: section 9's sampler, which sorts a row with a cut to find its threshold tau and gives each row one
// thread block, and section 9b's log-probabilities kernel. The same tokens: test/gpu/gpu_kernels.cu compares
// the three samplers token for token. Why it is faster: tau can be found by counting instead of sorting.
// This section bisects over the floats' order keys: 32 read-only passes per cut, no scratch (switch
// bisect_sampler). Section 22 selects tau digit by digit, in two or three passes mostly over a short list in
// shared memory, and splits a row without a cut over several thread blocks; 22a splits the log-probabilities'
// rows the same way (switch fast_sampler, for both; it wins over bisect_sampler when both are on). Measured: the README's
// sampler table (build/gpu_kernels bench_sampler prints all three samplers).

// The kept set is "z >= tau" (section 9), and both counts that decide tau shrink as tau grows: top-k's tau
// is the largest t with at least k values >= t, top-p's the largest t whose values >= t hold top_p of the
// mass top-k and min-p kept (in section 9's integers: the same sums, so the same tau). So tau can be
// bisected. To bisect floats exactly, map each z to a 32-bit key whose unsigned order is the float order
// (flip all bits of negatives, set the sign bit of positives): 32 halvings of the keys, each one pass over
// the row that counts, or adds the masses of, the keys >= the middle one. min-p's key comes from the row
// max alone. A (value, index) pair packs into one word, (key(value) << 32) | ~index, whose unsigned max is
// the pair that outranks (section 9's order). A row with top-k reads its logits 33 times, with top-p 35,
// with both 67; a row without a cut once. Switch: bisect_sampler.

// Order-preserving float <-> uint32 map: a < b as floats  <=>  key(a) < key(b) as unsigned (for non-NaN).
__host__ __device__ inline uint32_t float_order_key(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__host__ __device__ inline float float_from_order_key(uint32_t k) {
  uint32_t u = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
// (value, index) -> one word whose unsigned max is "largest value, then lowest index". 0 means "nothing".
__host__ __device__ inline unsigned long long pack_candidate(float value, uint32_t index) {
  return ((unsigned long long)float_order_key(value) << 32) | (uint32_t)~index;
}
// min_p keeps token i when z_i - m >= log(min_p) (m = the row's largest z): an upper set of keys like
// top-k's. Its threshold is the smallest key that passes, found by bisecting the keys from the bottom
// (negative NaNs: fail) to key(m) (passes: section 9's min_p_keeps keeps the top value). Pure arithmetic on
// m, no pass over the row; host and device compute the same float operations.
__host__ __device__ inline uint32_t min_p_threshold(float m, float min_p) {
  const float log_min_p = logf(min_p);
  uint32_t lo = 0, hi = float_order_key(m);
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (float_from_order_key(mid) - m >= log_min_p) hi = mid;
    else lo = mid + 1;
  }
  return hi;
}

// sample_bisect_kernel — section 9's sample_kernel with tau found by bisection. Reads logits [B, V] fp32
// and slots [B]; writes out_tokens [B]. One thread block per row; threads stride over the row, so every
// pass reads it once, coalesced.
//   1. the kept set's threshold key (top-k, then min-p, then top-p on what they kept), by bisection;
//   2. the draw: argmax over the kept tokens of z + Gumbel noise (greedy: of z), packed with its index.
__global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_bisect_kernel(int* out_tokens, const float* logits, const SamplingSlot* slots, int V) {
  __shared__ unsigned long long scratch[32];
  const float* row = logits + (int64_t)blockIdx.x * V;
  const SamplingSlot slot = slots[blockIdx.x];
  const bool greedy = !(slot.temperature > 0.f);
  const float inv_temp = greedy ? 1.f : 1.f / slot.temperature;
  auto key_of = [&](int i) { return float_order_key(scaled_logit(row[i], inv_temp)); };
  // The largest t >= lo with measure(t) >= target, where measure (the count or the mass of the keys >= t)
  // can only shrink as t grows and measure(lo) >= target. 32 halvings of [lo, 2^32).
  auto bisect = [&](uint32_t lo, unsigned long long target, auto measure) {
    unsigned long long hi = 1ull << 32;  // measure(hi) < target: no key reaches it
    while (hi - lo > 1) {
      const uint32_t mid = (uint32_t)(lo + (hi - lo) / 2);
      if (measure(mid) >= target) lo = mid;
      else hi = mid;
    }
    return lo;
  };
  uint32_t threshold = 0;  // the kept set is every token whose key >= threshold
  if (!greedy && slot.top_k > 0 && slot.top_k < V) {
    threshold = bisect(0u, (unsigned long long)slot.top_k, [&](uint32_t t) {
      unsigned long long n = 0;
      for (int i = threadIdx.x; i < V; i += blockDim.x) n += key_of(i) >= t;
      return block_reduce(n, Plus(), scratch);
    });
  }
  float m = 0.f;  // the row's largest z: min_p's reference, and top-p's for the masses
  if (!greedy && (slot.top_p < 1.f || slot.min_p > 0.f)) {
    unsigned long long top = 0;
    for (int i = threadIdx.x; i < V; i += blockDim.x) top = max(top, (unsigned long long)key_of(i));
    m = float_from_order_key((uint32_t)block_reduce(top, Larger(), scratch));
  }
  if (!greedy && slot.min_p > 0.f) threshold = max(threshold, min_p_threshold(m, slot.min_p));
  if (!greedy && slot.top_p < 1.f) {
    auto mass_from = [&](uint32_t t) {  // the mass of the kept tokens with key >= t
      unsigned long long w = 0;
      for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const uint32_t k = key_of(i);
        if (k >= t && k >= threshold) w += fixed_mass(float_from_order_key(k), m);
      }
      return block_reduce(w, Plus(), scratch);
    };
    const unsigned long long total = mass_from(threshold);
    unsigned long long target = (unsigned long long)ceil((double)slot.top_p * (double)total);
    target = std::min(std::max(target, 1ull), total);
    threshold = bisect(threshold, target, mass_from);
  }
  unsigned long long best = 0;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const float z = scaled_logit(row[i], inv_temp);
    if (float_order_key(z) < threshold) continue;
    const float value = greedy ? z : z + gumbel_noise(slot.seed, slot.offset, (uint32_t)i);
    best = max(best, pack_candidate(value, (uint32_t)i));
  }
  best = block_reduce(best, Larger(), scratch);
  if (threadIdx.x == 0) out_tokens[blockIdx.x] = best ? (int)~(uint32_t)best : 0;
}
// Section 9's sample, the same arguments (the hook's: this one needs no workspace). logits [B, V] fp32,
// slots [B], out_tokens [B], all on the device.
void sample_bisect(int* out_tokens, const float* logits, const SamplingSlot* slots, int B, int V, void* workspace,
                   size_t workspace_bytes, cudaStream_t stream) {
  (void)workspace, (void)workspace_bytes;
  INTERNAL_CHECK(V > 0 && V < 2000000, "sample_bisect: V = %d outside 1 .. 2,000,000 (the mass sums' range)", V);
  if (B == 0) return;
  sample_bisect_kernel<<<B, SAMPLE_THREADS, 0, stream>>>(out_tokens, logits, slots, V);
  CUDA_CHECK(cudaGetLastError());
}

// ---- The switch: bisect_sampler ----
static void apply_bisect_sampler(bool on, Hooks& h) {
  g_opt.bisect_sampler = on;
  if (on) h.sample = sample_bisect;
}
static const int kBisectSamplerRegistered = register_optimization(
    {"bisect_sampler", "top-k/min-p/top-p cut by bisection, no sort (section 21)", true, apply_bisect_sampler});

// ==== 22. The fast sampler, 2: radix select, rows split over thread blocks =================================
// defines: pack_candidate, sample_fast, sample_workspace_bytes, compute_logprobs_fast,
//          logprobs_workspace_bytes; switch fast_sampler
//
// Section 21 halves the 2^32 order keys 32 times; a radix select takes the threshold key digit by digit instead,
// most significant first (digits of 11, 11 and 10 bits): histogram the keys that still match the digits
// chosen so far, walk the 2048 bins from the top accumulating counts (top-k: until k is reached) or mass
// (top-p: until top_p of the mass is reached), and the bin where the walk stops is the next digit. Three
// passes give the exact threshold (ties at it all kept); a pass stops early when its bin must be kept whole.
// min_p (21's min_p_threshold) is a floor under the top-p select and a lower bound on the final threshold.
// The masses are section 9's integers, so atomics add them in any order to the same sum (floating-point
// atomics would not). A histogram bin keeps w in three 32-bit counters of 11-bit pieces (w & 2047, (w >> 11)
// & 2047, w >> 22), none of which overflows for V < 2 million: 32-bit shared-memory atomics, because 64-bit
// ones are much slower under a histogram's contention (most tokens land in a few bins).
//
// Keeping it cheap: after the first histogram pass over the row, only tokens at or above the first
// digit's bin can be kept. One more pass copies those candidates (key and index) into shared memory;
// the remaining digits, the top-p selection and the final Gumbel argmax then run on that short list.
// A filtered row therefore reads its logits 2 times (top-k) or 3 times (top-p alone: one more pass for
// the row max that the probabilities need). If more than SAMPLE_LIST_CAP tokens survive (a nucleus of
// tens of thousands of tokens, e.g. top_p = 0.95 over near-flat logits), the later passes read the row
// from memory again instead: slower, same result.
// The temperature path is bound by arithmetic (Philox and two logs per token), not by memory.
//
// Grid: (splits, B) thread blocks of SAMPLE_THREADS. A row without filters (greedy or plain temperature) is
// cut into `splits` contiguous pieces, each thread block writing the best packed (value, index) of its
// piece to the workspace; sample_finish_kernel then takes the best piece per row. Splitting matters for
// small batches: one thread block per row would leave all but B SMs idle. A filtered row is handled whole by
// its split-0 thread block.

constexpr int SAMPLE_MAX_SPLITS = 32;
constexpr int SAMPLE_LIST_CAP = 8192;   // candidates kept in shared memory (64 KiB)
constexpr int RADIX_BINS = 2048;        // 11-bit digits

// Shared memory of one sampler thread block (dynamic: 96 KiB, under the 99 KiB opt-in limit of sm_86/sm_89).
struct SampleSmem {
  unsigned int count[RADIX_BINS];        // histogram: tokens per bin
  unsigned int mass[3][RADIX_BINS];      // histogram: fixed-point mass per bin, in 11-bit pieces
  uint32_t list_key[SAMPLE_LIST_CAP];    // the candidate list: order keys of z ...
  uint32_t list_idx[SAMPLE_LIST_CAP];    // ... and token indices
  unsigned long long red[32];            // one slot per warp for reductions over the thread block
  int list_n;                            // candidates found (may exceed SAMPLE_LIST_CAP: then unused)
  int sel_bin;                           // block_select_bin's answers
  unsigned long long sel_above, sel_target;

  __device__ void add_mass(int b, unsigned long long w) {
    unsigned int lo = (unsigned int)(w & 2047), mid = (unsigned int)((w >> 11) & 2047);
    unsigned int hi = (unsigned int)(w >> 22);
    if (lo) atomicAdd(&mass[0][b], lo);
    if (mid) atomicAdd(&mass[1][b], mid);
    if (hi) atomicAdd(&mass[2][b], hi);
  }
  __device__ unsigned long long mass_of(int b) const {
    return mass[0][b] + ((unsigned long long)mass[1][b] << 11) + ((unsigned long long)mass[2][b] << 22);
  }
};
static_assert(sizeof(SampleSmem) <= 99 * 1024, "sm_86/sm_89 allow at most 99 KiB of shared memory per block");

// Reserves one slot per calling lane with one atomic per warp: every candidate of a flat row hitting a
// single shared counter would otherwise serialise 150,000 atomics.
__device__ inline int warp_aggregated_inc(int* counter) {
  unsigned mask = __activemask();
  int lane = threadIdx.x % 32, leader = __ffs(mask) - 1, base = 0;
  if (lane == leader) base = atomicAdd(counter, __popc(mask));
  base = __shfl_sync(mask, base, leader);
  return base + __popc(mask & ((1u << lane) - 1));
}

// Walk hist(nbins-1), hist(nbins-2), ... accumulating; find the bin b where the running sum first
// reaches target:  sum(hist(b+1..)) < target <= sum(hist(b..)).  When frac > 0 the target is instead
// ceil(frac * total) (top-p's first digit, where the total mass is only known now). The target is
// clamped to [1, total], so the chosen bin is never empty. Results in s.sel_*; all threads call it.
// Each thread owns nbins / SAMPLE_THREADS adjacent bins; a block-wide exclusive scan (from the top bin
// down) tells each thread the sum above its bins, and the one thread whose range crosses the target
// walks its own bins.
template <class BinValue>  // hist(b) -> unsigned long long
__device__ void block_select_bin(BinValue hist, int nbins, unsigned long long target, float frac,
                                 SampleSmem& s) {
  int per = nbins / SAMPLE_THREADS, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int top = nbins - 1 - threadIdx.x * per;  // this thread's bins: top, top-1, ..., top-per+1
  unsigned long long mine = 0;
  for (int j = 0; j < per; j++) mine += hist(top - j);
  unsigned long long incl = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    unsigned long long n = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += n;
  }
  __syncthreads();
  if (lane == 31) s.red[warp] = incl;
  if (threadIdx.x == 0) s.sel_bin = 0, s.sel_above = 0;
  __syncthreads();
  unsigned long long above = incl - mine, total = 0;
  for (int w = 0; w < SAMPLE_THREADS / 32; w++) {
    if (w < warp) above += s.red[w];
    total += s.red[w];
  }
  if (frac > 0.f) target = (unsigned long long)ceil((double)frac * (double)total);
  target = min(max(target, 1ull), total);
  if (threadIdx.x == 0) s.sel_target = target;
  if (above < target && target <= above + mine) {
    for (int j = 0; j < per; j++) {
      unsigned long long h = hist(top - j);
      if (above + h >= target) {
        s.sel_bin = top - j;
        s.sel_above = above;
        break;
      }
      above += h;
    }
  }
  __syncthreads();
}

// The tokens a filtered row still considers: either the shared-memory list, or (when the list would
// not fit) the whole row re-read from memory, keeping keys >= lo. for_each calls f(key, index).
struct Candidates {
  const float* row;
  int V;
  float inv_temp;
  uint32_t lo;
  const SampleSmem* list;  // nullptr: read the row
  int n;

  // Read the row 4 logits at a time (one float4 when V % 4 == 0, so rows stay 16-byte aligned), with 4
  // loads in flight per thread before any is used: a block streams its row with ~64 KiB in flight.
  template <class F>
  __device__ static void for_each_group(const float* row, int V, int g_begin, int g_end, F f) {
    constexpr int U = 4;
    for (int g0 = g_begin + threadIdx.x; g0 < g_end; g0 += U * blockDim.x) {
      float v[U][4];
#pragma unroll
      for (int u = 0; u < U; u++) {
        int g = g0 + u * blockDim.x;
        if (g >= g_end) break;
        if ((V & 3) == 0) {
          float4 q = __ldg(reinterpret_cast<const float4*>(row) + g);
          v[u][0] = q.x, v[u][1] = q.y, v[u][2] = q.z, v[u][3] = q.w;
        } else {
          for (int j = 0; j < 4; j++) v[u][j] = 4 * g + j < V ? __ldg(row + 4 * g + j) : 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < U; u++) {
        int g = g0 + u * blockDim.x;
        if (g >= g_end) break;
        f(g, v[u]);
      }
    }
  }
  template <class F>
  __device__ void for_each(F f) const {
    if (list) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) f(list->list_key[i], (int)list->list_idx[i]);
      return;
    }
    for_each_group(row, V, 0, (V + 3) / 4, [&](int g, const float* v) {
      for (int j = 0; j < 4; j++) {
        int i = 4 * g + j;
        uint32_t key = float_order_key(scaled_logit(v[j], inv_temp));
        if (i < V && key >= lo) f(key, i);
      }
    });
  }
};

// One digit of a radix select (see the section comment). State is block-uniform.
struct RadixSelect {
  uint32_t prefix = 0;             // digits chosen so far (lower bits zero): the threshold once done
  uint32_t decided = 0;            // mask of those digits' bits
  unsigned long long target = 0;   // tokens (top-k) or mass (top-p) still to cover below the prefix
  int digit = 0;
  bool done = false;
};
__device__ void radix_step(RadixSelect& st, const Candidates& c, uint32_t floor_key, bool by_mass,
                           float top_p, float m, SampleSmem& s) {
  int shift = st.digit == 0 ? 21 : st.digit == 1 ? 10 : 0;
  int nbins = st.digit < 2 ? 2048 : 1024;
  for (int b = threadIdx.x; b < nbins; b += blockDim.x)
    s.count[b] = 0, s.mass[0][b] = 0, s.mass[1][b] = 0, s.mass[2][b] = 0;
  __syncthreads();
  uint32_t prefix = st.prefix, decided = st.decided;
  c.for_each([&](uint32_t key, int) {
    if (key < floor_key || (key & decided) != prefix) return;
    int b = (key >> shift) & (nbins - 1);
    atomicAdd(&s.count[b], 1u);
    if (by_mass) s.add_mass(b, fixed_mass(float_from_order_key(key), m));
  });
  __syncthreads();
  if (by_mass)
    block_select_bin([&](int b) { return s.mass_of(b); }, nbins, st.target, st.digit == 0 ? top_p : 0.f, s);
  else
    block_select_bin([&](int b) { return (unsigned long long)s.count[b]; }, nbins, st.target, 0.f, s);
  int b = s.sel_bin;
  unsigned long long need = s.sel_target - s.sel_above;  // what bin b must still provide
  // Bin b is kept whole when all of it is needed (top-k) or it holds a single token (top-p): its lowest
  // possible key is then the exact threshold and the lower digits need no pass.
  bool whole = by_mass ? s.count[b] == 1 : s.count[b] == need;
  st.prefix |= (uint32_t)b << shift;
  st.decided |= (uint32_t)(nbins - 1) << shift;
  st.target = need;
  st.digit++;
  st.done = whole || st.digit == 3;
  __syncthreads();  // the histograms are reused by the next step
}

// Reads logits [B, V] (fp32), slots [B]. Writes partial [B, splits]: the packed best candidate of each
// block's piece of its row (0 = none). See the section comment for the algorithm.
__global__ __launch_bounds__(SAMPLE_THREADS, 1) void sample_radix_kernel(unsigned long long* partial,
                                                                   const float* logits,
                                                                   const SamplingSlot* slots, int V) {
  pdl_begin();
  extern __shared__ __align__(16) unsigned char sample_smem_raw[];
  SampleSmem& s = *reinterpret_cast<SampleSmem*>(sample_smem_raw);
  int b = blockIdx.y, split = blockIdx.x, splits = gridDim.x;
  const float* row = logits + (int64_t)b * V;
  SamplingSlot slot = slots[b];
  bool greedy = !(slot.temperature > 0.f);
  bool use_top_k = !greedy && slot.top_k > 0 && slot.top_k < V;
  bool use_top_p = !greedy && slot.top_p < 1.f;
  bool use_min_p = !greedy && slot.min_p > 0.f;
  float inv_temp = greedy ? 1.f : 1.f / slot.temperature;
  unsigned long long best = 0;

  if (!use_top_k && !use_top_p && !use_min_p) {
    // The fast path: one read of this block's piece of the row, 4 tokens per Philox call.
    int groups = (V + 3) / 4, per_split = (groups + splits - 1) / splits;
    int g_begin = min(groups, split * per_split), g_end = min(groups, g_begin + per_split);
    // A thread visits its tokens in increasing index order, so a strict ">" keeps the lowest index of
    // equal values; only the thread's winner is packed. (-inf never wins here: a row of nothing but
    // -inf/NaN comes out as token 0, as the packed rule would choose.)
    float best_value = -INFINITY;
    int best_index = -1;
    Candidates::for_each_group(row, V, g_begin, g_end, [&](int g, const float* v) {
      uint4 r = greedy ? make_uint4(0, 0, 0, 0) : philox_group(slot.seed, slot.offset, (uint32_t)g);
      for (int j = 0; j < 4; j++) {
        int i = 4 * g + j;
        if (i >= V) break;
        float value = greedy ? scaled_logit(v[j], 1.f)
                             : scaled_logit(v[j], inv_temp) + gumbel_from_bits(uint4_word(r, j));
        if (value > best_value) best_value = value, best_index = i;
      }
    });
    if (best_index >= 0) best = pack_candidate(best_value, (uint32_t)best_index);
    best = block_reduce(best, Larger(), s.red);
    if (threadIdx.x == 0) partial[(int64_t)b * splits + split] = best;
    return;
  }

  if (split != 0) {  // a filtered row belongs to its first block alone
    if (threadIdx.x == 0) partial[(int64_t)b * splits + split] = 0;
    return;
  }
  Candidates whole_row{row, V, inv_temp, 0u, nullptr, 0};
  RadixSelect k_sel, p_sel;
  auto max_z = [&](const Candidates& c) {  // the largest z (always among the candidates)
    unsigned long long mk = 0;
    c.for_each([&](uint32_t key, int) { mk = max(mk, (unsigned long long)key); });
    return float_from_order_key((uint32_t)block_reduce(mk, Larger(), s.red));
  };
  float m = 0.f;            // row max of z: the reference point of the probability masses and of min_p
  uint32_t min_p_key = 0;   // min_p's threshold (21's min_p_threshold); 0 = off
  uint32_t lo;              // every token that can be kept has key >= lo
  if (use_top_k) {
    k_sel.target = (unsigned long long)slot.top_k;
    radix_step(k_sel, whole_row, 0u, false, 0.f, 0.f, s);
    lo = k_sel.prefix;
  } else {
    m = max_z(whole_row);
    if (use_min_p) min_p_key = min_p_threshold(m, slot.min_p);
    lo = min_p_key;
    if (use_top_p) {  // top-p's mass counts only what min_p keeps: the floor
      radix_step(p_sel, whole_row, min_p_key, true, slot.top_p, m, s);
      lo = max(p_sel.prefix, min_p_key);
    }
  }
  // Copy the candidates (key >= lo) to shared memory; count them even past the capacity.
  if (threadIdx.x == 0) s.list_n = 0;
  __syncthreads();
  Candidates{row, V, inv_temp, lo, nullptr, 0}.for_each([&](uint32_t key, int i) {
    int pos = warp_aggregated_inc(&s.list_n);
    if (pos < SAMPLE_LIST_CAP) s.list_key[pos] = key, s.list_idx[pos] = (uint32_t)i;
  });
  __syncthreads();
  int n = s.list_n;
  Candidates cands{row, V, inv_temp, lo, n <= SAMPLE_LIST_CAP ? &s : nullptr, n};

  uint32_t threshold = lo;
  if (use_top_k) {
    while (!k_sel.done) radix_step(k_sel, cands, 0u, false, 0.f, 0.f, s);
    threshold = k_sel.prefix;
    if (use_top_p || use_min_p) m = max_z(cands);
    if (use_min_p) threshold = max(threshold, min_p_key = min_p_threshold(m, slot.min_p));  // both keep a top
  }
  if (use_top_p) {
    // With top-k, a fresh select over S_k (and min_p's set): its first histogram's total is their mass.
    while (!p_sel.done) radix_step(p_sel, cands, threshold, true, slot.top_p, m, s);
    // A whole-bin stop leaves p_sel.prefix at the bin's lower edge, which may lie below the top-k cut.
    threshold = max(threshold, p_sel.prefix);
  }
  cands.for_each([&](uint32_t key, int i) {
    if (key >= threshold)
      best = max(best, pack_candidate(float_from_order_key(key) + gumbel_noise(slot.seed, slot.offset, i),
                                      (uint32_t)i));
  });
  best = block_reduce(best, Larger(), s.red);
  if (threadIdx.x == 0) partial[(int64_t)b * splits] = best;
}

// Reads partial [B, splits]; writes out_tokens [B]: the index packed in the best piece of each row.
__global__ void sample_finish_kernel(int* out_tokens, const unsigned long long* partial, int B, int splits) {
  pdl_begin();
  int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= B) return;
  unsigned long long best = 0;
  for (int i = 0; i < splits; i++) best = max(best, partial[(int64_t)b * splits + i]);
  out_tokens[b] = best ? (int)~(uint32_t)best : 0;
}

size_t sample_workspace_bytes(int B, int V) {
  (void)V;
  return (size_t)B * SAMPLE_MAX_SPLITS * sizeof(unsigned long long);
}

// Samples one token per row. logits [B, V] fp32, slots [B], out_tokens [B], all on the device.
// workspace: at least sample_workspace_bytes(B, V) bytes of device memory (no initialisation needed).
void sample_fast(int* out_tokens, const float* logits, const SamplingSlot* slots, int B, int V,
                 void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  INTERNAL_CHECK(workspace_bytes >= sample_workspace_bytes(B, V),
                 "sample_fast: workspace of %zu bytes, need sample_workspace_bytes(%d, %d) = %zu", workspace_bytes,
                 B, V, sample_workspace_bytes(B, V));
  INTERNAL_CHECK(V > 0 && V < 2000000, "sample_fast: V = %d outside 1 .. 2,000,000 (the mass counters' range)",
                 V);
  check_aligned16("sample_fast", "logits", logits);
  if (B == 0) return;
  static bool opted_in = false;  // once per process (each tensor-parallel rank is its own process)
  if (!opted_in) {
    CUDA_CHECK(cudaFuncSetAttribute(sample_radix_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)sizeof(SampleSmem)));
    opted_in = true;
  }
  // Enough pieces to give every SM a thread block, but at least ~4 logits per thread per piece.
  int splits = std::max(1, std::min(gpu_sm_count() / B, SAMPLE_MAX_SPLITS));
  splits = std::max(1, std::min<int>(splits, (int)cdiv(V, 4 * SAMPLE_THREADS)));
  auto* partial = static_cast<unsigned long long*>(workspace);
  launch_pdl(sample_radix_kernel, dim3(splits, B), SAMPLE_THREADS, sizeof(SampleSmem), stream, partial, logits,
             slots, V);
  CUDA_CHECK(cudaGetLastError());
  launch_pdl(sample_finish_kernel, (unsigned)cdiv(B, 128), 128, 0, stream, out_tokens, partial, B, splits);
  CUDA_CHECK(cudaGetLastError());
}

// ---- 22a. Log-probabilities with the row split over thread blocks -----------------------------------------
// Section 9b gives a row asking for logprobs one thread block, which reads the row N + 2 times: at batch 1
// one SM does all of it while the rest idle. Here, like the draw above, a row is cut into `splits` pieces.
// Each piece's thread block computes, over its piece, the largest logit m_j, s_j = sum exp(x - m_j), the
// count of logits above the drawn token's, and its own N largest (value, id) words; logprobs_finish_kernel
// then merges the pieces per row: M = max m_j, lse = M + log(sum_j s_j exp(m_j - M)), rank = 1 + sum of the
// counts, and the N largest of the pieces' candidates. Same ids and ranks as section 9b; the sums are
// added in another order (float rounding apart). Switch: fast_sampler (the same switch as the draw).

struct LogprobPiece {                    // one piece of one row (device workspace [B, splits])
  float max, sum;                        // m_j and s_j
  unsigned int above;                    // logits of the piece larger than the drawn token's
  unsigned long long top[MAX_LOGPROBS];  // the piece's N largest, packed (0 = none)
};
constexpr int LOGPROB_MAX_SPLITS = 32, LOGPROB_THREADS = SAMPLE_THREADS;  // a whole row per block at large B

// Reads logits [B, V], tokens [B], slots [B]; writes pieces [B, splits]. Grid (splits, B).
__global__ void __launch_bounds__(LOGPROB_THREADS)
    logprobs_split_kernel(LogprobPiece* pieces, const float* logits, const int* tokens, const SamplingSlot* slots,
                          int V) {
  pdl_begin();
  __shared__ unsigned long long scratch[32];
  __shared__ float fscratch[32];
  const int b = blockIdx.y, N = slots[b].logprobs;
  if (N < 0) return;
  const int per = (V + gridDim.x - 1) / gridDim.x, begin = min(V, blockIdx.x * per), end = min(V, begin + per);
  const float* row = logits + (int64_t)b * V;
  auto x_of = [&](int i) { return scaled_logit(row[i], 1.f); };  // NaN -> -inf
  const float x_token = x_of(tokens[b]);
  unsigned long long top = 0, above = 0;
  for (int i = begin + threadIdx.x; i < end; i += blockDim.x) {
    top = max(top, (unsigned long long)float_order_key(x_of(i)));
    above += x_of(i) > x_token;
  }
  top = block_reduce(top, Larger(), scratch);
  const float m = top ? float_from_order_key((uint32_t)top) : -INFINITY;  // (0: an empty piece)
  above = block_reduce(above, Plus(), scratch);
  float sum = 0.f;
  for (int i = begin + threadIdx.x; i < end; i += blockDim.x) sum += m == -INFINITY ? 0.f : expf(x_of(i) - m);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (threadIdx.x % 32 == 0) fscratch[threadIdx.x / 32] = sum;
  __syncthreads();
  sum = 0.f;
  for (int w = 0; w < (int)blockDim.x / 32; w++) sum += fscratch[w];
  LogprobPiece& piece = pieces[(int64_t)b * gridDim.x + blockIdx.x];
  if (threadIdx.x == 0) piece.max = m, piece.sum = sum, piece.above = (unsigned int)above;
  unsigned long long prev = ~0ull;
  for (int k = 0; k < N; k++) {
    unsigned long long best = 0;
    for (int i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const unsigned long long c = pack_candidate(x_of(i), (uint32_t)i);
      if (c < prev) best = max(best, c);
    }
    prev = block_reduce(best, Larger(), scratch);
    if (threadIdx.x == 0) piece.top[k] = prev;
  }
}

// Reads pieces [B, splits], logits and tokens (the drawn token's logit); writes out [B]. One warp per row.
__global__ void logprobs_finish_kernel(TokenLogprobs* out, const LogprobPiece* pieces, const float* logits,
                                       const int* tokens, const SamplingSlot* slots, int V, int splits) {
  pdl_begin();
  const int b = blockIdx.x, N = slots[b].logprobs, lane = threadIdx.x;
  if (N < 0) return;
  const LogprobPiece* p = pieces + (int64_t)b * splits;
  float M = -INFINITY;
  for (int j = 0; j < splits; j++) M = fmaxf(M, p[j].max);
  float sum = 0.f;
  unsigned int above = 0;
  for (int j = 0; j < splits; j++) {
    if (p[j].max != -INFINITY) sum += p[j].sum * expf(p[j].max - M);
    above += p[j].above;
  }
  const float lse = M == -INFINITY ? -INFINITY : M + logf(sum);
  TokenLogprobs& o = out[b];
  if (lane == 0) {
    o.logprob = scaled_logit(logits[(int64_t)b * V + tokens[b]], 1.f) - lse;
    o.rank = 1 + (int)above, o.num_top = N;
  }
  unsigned long long prev = ~0ull;
  for (int k = 0; k < N; k++) {  // the N largest of the pieces' candidates, one per round
    unsigned long long best = 0;
    for (int c = lane; c < splits * N; c += 32) {
      const unsigned long long v = p[c / N].top[c % N];
      if (v < prev) best = max(best, v);
    }
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, s));
    prev = best;
    if (lane == 0) {
      o.top_ids[k] = (int)~(uint32_t)prev;
      o.top_logprobs[k] = float_from_order_key((uint32_t)(prev >> 32)) - lse;
    }
  }
}

size_t logprobs_workspace_bytes(int B) { return (size_t)B * LOGPROB_MAX_SPLITS * sizeof(LogprobPiece); }

// Section 9b's compute_logprobs, split: the same arguments, plus a workspace of logprobs_workspace_bytes(B).
static void compute_logprobs_fast(TokenLogprobs* out, const float* logits, const int* tokens,
                                  const SamplingSlot* slots, int B, int V, void* workspace, size_t workspace_bytes,
                                  cudaStream_t stream) {
  INTERNAL_CHECK(workspace_bytes >= logprobs_workspace_bytes(B), "compute_logprobs_fast: workspace of %zu bytes, "
                 "need %zu", workspace_bytes, logprobs_workspace_bytes(B));
  if (B == 0) return;
  // Enough pieces to give every SM a thread block, but at least ~4 logits per thread per piece.
  int splits = std::max(1, std::min(gpu_sm_count() / B, LOGPROB_MAX_SPLITS));
  splits = std::max(1, std::min<int>(splits, (int)cdiv(V, 4 * LOGPROB_THREADS)));
  auto* pieces = static_cast<LogprobPiece*>(workspace);
  launch_pdl(logprobs_split_kernel, dim3(splits, B), LOGPROB_THREADS, 0, stream, pieces, logits, tokens, slots, V);
  CUDA_CHECK(cudaGetLastError());
  launch_pdl(logprobs_finish_kernel, (unsigned)B, 32, 0, stream, out, (const LogprobPiece*)pieces, logits, tokens,
             slots, V, splits);
  CUDA_CHECK(cudaGetLastError());
}

// ---- The switch: fast_sampler ----
static void apply_fast_sampler(bool on, Hooks& h) {
  g_opt.fast_sampler = on;
  if (!on) return;
  h.sample = sample_fast;
  h.sample_workspace_bytes = sample_workspace_bytes;
  h.compute_logprobs = compute_logprobs_fast;
  h.logprobs_workspace_bytes = logprobs_workspace_bytes;
}
static const int kFastSamplerRegistered = register_optimization(
    {"fast_sampler", "radix-select sampler and split log-probabilities (section 22)", true, apply_fast_sampler});

// ==== 23. Prefill and mixed steps in CUDA graphs, in pieces ================================================
// defines: PREFILL_GRAPH_MAX_T, prefill_graph_sizes, PiecewiseCapture, piecewise_cut, pad_prefill_rows,
//          PrefillGraphs, g_prefill_graphs, capture_prefill_graphs, prefill_step_graphs; switch prefill_graphs
//
// Replaces: running every prefill step kernel by kernel (section 11 captures decode steps only).
// Why it is faster: a step of Qwen3-0.6B is about 400 launches, which cost the host more than a millisecond;
// under --scheduler mixed (5b) most steps of a busy engine hold a few new prompt tokens among the decode
// rows, so they are prefill steps, and without graphs they pay that launch cost where a decode step would
// replay one graph.
//
// Why in pieces. A graph replays fixed launches: fixed grids and fixed arguments. Everything in a step but
// attention has shapes that follow the number of tokens T alone (the matrix products, norms, RoPE, the KV
// store: one row per token), so it can be captured for a ladder of T and the step padded up to the next
// rung. Attention's work follows the sequences (how many, how long each chunk, how many keys each reads, how
// many decode rows, section 16's split), which a fixed grid could only cover by launching for the worst case
// of all of them and letting most thread blocks exit. So, as vLLM does (piecewise CUDA graphs), attention
// stays out: for each rung, L + 1 graphs, cut before each layer's attention and before the LM head.
//   piece 0      embedding, layer 0 up to and including q/k-norm, RoPE and the KV store
//   piece l      layer l-1 after attention (o_proj, MLP), layer l up to attention       (l = 1 .. L-1)
//   piece L      layer L-1 after attention, the final norm
// A replay is piece 0, then for each layer its attention (launched as usual, with this step's sequences)
// and the next piece; then the LM head on the B last rows and the sampler, as usual: about 3 to 4 launches
// per layer instead of about 14. Section 14's forward_fast itself is what is captured (its cut stage ends a
// piece where it would run attention or the LM head), so the pieces compute exactly what an eager step of T padded
// tokens does.
//
// Padding. Rows T .. Tg - 1 of a step padded to rung Tg are token 0 at position 0 with slot -1: the KV
// store skips them, no sequence's attention reads them (cu_seqlens_q ends at T), and each of the other
// operations works row by row, so they change no real row; the LM head reads only the sequences' last rows.
// They cost what Tg - T more tokens cost in the matrix products (the rungs are 128 tokens apart above 128,
// so at most 127 rows: an eighth of a step of 1,024 tokens, less above). Above the last rung
// (PREFILL_GRAPH_MAX_T) a step runs eagerly: there the launches are a small part of the step. Tensor
// parallelism keeps prefill steps eager too (the workers would have to replay the same pieces; not built).
constexpr int PREFILL_GRAPH_MAX_T = 2048;

// The rungs: 16, 32, 64, then every 128 tokens up to PREFILL_GRAPH_MAX_T (and no more than the step's budget).
static std::vector<int> prefill_graph_sizes(int Tmax) {
  std::vector<int> sizes;
  for (int t : {16, 32, 64})
    if (t <= Tmax) sizes.push_back(t);
  for (int t = 128; t <= std::min(Tmax, PREFILL_GRAPH_MAX_T); t += 128) sizes.push_back(t);
  return sizes;
}

// While this section captures a prefill step in pieces, section 14's cut stage ends a piece at each of the
// pass's two cut points (before a layer's attention, before the LM head) and the pass skips what follows the
// cut, which the replay runs between the pieces. Off (every other time), cut() does nothing and returns false.
struct PiecewiseCapture {
  enum { OFF, WARMUP, CAPTURE } mode = OFF;  // WARMUP: a run outside any capture (cuBLASLt picks its algorithms)
  std::vector<cudaGraph_t> pieces;           // CAPTURE: the pieces so far
  bool cut(cudaStream_t s) {
    if (mode == OFF) return false;
    if (mode == CAPTURE) {
      cudaGraph_t g;
      CUDA_CHECK(cudaStreamEndCapture(s, &g));
      pieces.push_back(g);
      CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    }
    return true;
  }
};
// This chapter's state, for the engine built last: each rung's pieces, and the capture under way. Its apply
// resets it whenever an engine installs its optimizations.
struct PrefillGraphs {
  std::map<int, std::vector<cudaGraphExec_t>> rungs;  // by the rung's tokens: its pieces, in order
  PiecewiseCapture capture;                           // what the cut stage does (capture_prefill_graphs)
  void reset() {
    for (auto& rung : rungs)
      for (cudaGraphExec_t e : rung.second) CUDA_CHECK(cudaGraphExecDestroy(e));
    rungs.clear();
    capture = PiecewiseCapture{};
  }
};
static PrefillGraphs g_prefill_graphs;
static bool piecewise_cut(cudaStream_t s) { return g_prefill_graphs.capture.cut(s); }

// Rows T .. Tg - 1 of the step's inputs: token 0 at position 0, stored nowhere (slot -1).
static void pad_prefill_rows(const StepInputs& in, int T, int Tg, cudaStream_t s) {
  if (Tg <= T) return;
  const size_t n = (size_t)(Tg - T) * sizeof(int);
  CUDA_CHECK(cudaMemsetAsync(in.input_ids + T, 0, n, s));
  CUDA_CHECK(cudaMemsetAsync(in.positions + T, 0, n, s));
  CUDA_CHECK(cudaMemsetAsync(in.slot_mapping + T, 0xFF, n, s));  // every byte 0xFF: -1
}

// Once the runner has captured its decode graphs (Hooks::graphs_captured): every rung, each first run once
// outside a capture (cuBLASLt chooses its algorithms for the shape then), then captured piece by piece, on the
// prefill region's inputs, whose first rows (up to the largest rung) this fills with padding.
static void capture_prefill_graphs(ModelRunner& r) {
  Qwen3& model = r.model;
  const StepInputs in = r.prefill_inputs(0, 0);
  const int Tmax = r.Tmax;
  cudaStream_t s = r.stream;
  PiecewiseCapture& pieces = g_prefill_graphs.capture;
  g_prefill_graphs.reset();
  if (model.tp > 1) return;
  for (int Tg : prefill_graph_sizes(Tmax)) {
    pad_prefill_rows(in, 0, Tg, s);
    pieces.mode = PiecewiseCapture::WARMUP;
    forward_fast(model, in, Tg, 0, true, s);
    CUDA_CHECK(cudaStreamSynchronize(s));
    pieces.mode = PiecewiseCapture::CAPTURE;
    pieces.pieces.clear();
    CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    forward_fast(model, in, Tg, 0, true, s);
    cudaGraph_t after_last_cut;  // empty: forward_fast returned at its last cut
    CUDA_CHECK(cudaStreamEndCapture(s, &after_last_cut));
    CUDA_CHECK(cudaGraphDestroy(after_last_cut));
    pieces.mode = PiecewiseCapture::OFF;
    INTERNAL_CHECK((int)pieces.pieces.size() == model.cfg.num_hidden_layers + 1,
                   "capture_prefill_graphs: %zu pieces for %d layers", pieces.pieces.size(),
                   model.cfg.num_hidden_layers);
    std::vector<cudaGraphExec_t>& execs = g_prefill_graphs.rungs[Tg];
    for (cudaGraph_t g : pieces.pieces) {
      cudaGraphExec_t e;
      CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
      CUDA_CHECK(cudaGraphDestroy(g));
      execs.push_back(e);
    }
    pieces.pieces.clear();
  }
  CUDA_CHECK(cudaStreamSynchronize(s));
}

// A prefill step of T tokens and B sequences from the pieces of the smallest rung that holds it (false: none
// does, the step runs eagerly). The logits land where forward_fast puts them.
static bool prefill_step_graphs(Qwen3& model, const StepInputs& in, int T, int B, cudaStream_t s) {
  auto rung = g_prefill_graphs.rungs.lower_bound(T);
  if (rung == g_prefill_graphs.rungs.end()) return false;
  pad_prefill_rows(in, T, rung->first, s);
  const std::vector<cudaGraphExec_t>& pieces = rung->second;
  Pass p{model, in, T, B, true, s};
  for (int l = 0; l < model.cfg.num_hidden_layers; l++) {
    CUDA_CHECK(cudaGraphLaunch(pieces[l], s));
    g_stages.attention_prefill(p, l);
  }
  CUDA_CHECK(cudaGraphLaunch(pieces.back(), s));
  lm_head_logits(model, in, B, true, s);
  return true;
}

static void apply_prefill_graphs(bool on, Hooks& h) {
  g_opt.prefill_graphs = on;
  g_prefill_graphs.reset();
  if (!on) return;
  stages_for(h).cut = piecewise_cut;  // the pieces are captured from forward_fast, so eager steps match them
  h.prefill_step = prefill_step_graphs;
  h.graphs_captured.push_back(capture_prefill_graphs);
}
static const int kPrefillGraphsRegistered = register_optimization(
    {"prefill_graphs", "prefill and mixed steps of up to 2048 tokens replay CUDA graphs, in pieces (section 23)",
     true, apply_prefill_graphs, nullptr, {{"prefill_graph_tokens", PREFILL_GRAPH_MAX_T}}});

// ==== 24. One persistent kernel for a small-batch decode step, 1: the operation chain ===============
// defines: PERSIST_MAX_B, PersistOp, PersistArgs, PersistCursor, persist_issue, persist_wait, persist_signal,
//          persist_stream_k, persist_rms_scales, persist_stage_input, persist_gemv_chunk, persist_warp_sums,
//          persist_row_sum, persist_gemv_epilogue, persist_all_reduce (sections 25-27: the rest)
//
// Replaces: at decode steps of 1, 2 or 4 sequences, all of section 14's forward pass on each GPU: about five
// kernels per layer plus the head, 143 launches for Qwen3-0.6B, and at TP > 1 the all-reduces between them.
// Why it could be faster. A batch-1 step reads every weight once (1.19 GB for Qwen3-0.6B) and does little
// else, so its floor is the time to stream the weights at the GPU's copy bandwidth. Between two kernels the
// GPU is not streaming: the last thread blocks of one kernel finish while most SMs idle, then the next
// kernel's blocks start with nothing in flight and wait a full memory latency for their first bytes. Each
// such "bubble" lasts microseconds, a step has 143 of them, and a sub-layer of 4-12 MB streams in 2-5
// microseconds: the bubbles are as long as the work. PDL (section 17) lets the next kernel's first loads
// start early, but the drain at the end of each kernel remains. The cure published by Hazy Research (the
// "megakernel") and by mirage (MPK) is one kernel for the whole step, one thread block per SM, that never
// ends between operations:
//   * the step is a list of operations fixed at start-up (PersistOp: embed; per layer qkv, attention, o,
//     gate_up, down; the LM head), each split over the thread blocks by a fixed rule: a gemv's weight rows
//     in groups of 16, group i to block i % grid; attention's (sequence, KV head, context partition)
//     triples, triple i to block i;
//   * every thread block runs the list in order, doing its share of each operation. An operation waits for
//     the one before it through a counter in global memory: each block that did some of operation o adds 1
//     to done[o] after its outputs are written, and a block that starts operation o + 1 first waits until
//     done[o] reaches the number of blocks that work on o. No grid-wide barrier: a block with no share of an
//     operation skips it without waiting;
//   * weights do not depend on the step, so a block loads them ahead of time, across operation and layer
//     boundaries. A chunk is 16 weight rows x 1024 columns (32 KiB); each of the 16 warps copies its own
//     64-column strip of every chunk into a ring of PERSIST_RING shared-memory slots (cp.async) and reads
//     only that strip back, so the stream needs no barrier across the block. Anything else that does not
//     depend on the wait is also done before it: attention loads its first keys and values into registers
//     (earlier steps wrote them; which cache rows they are is looked up once per step), RoPE's angles are
//     computed once per step, and an RMSNorm's weights are in registers before its input arrives;
//   * the dot products run on the tensor cores (m16n8k16, section 15's mma): a warp multiplies its 16 x 64
//     strip by the same 64 columns of the B <= 4 inputs, which sit as the 8 columns of the right-hand matrix,
//     so a step of 4 sequences costs the same instructions as a step of 1. The 16 warps' partial sums of a
//     group meet in shared memory, are added in warp order, and the output is written the way section 14
//     writes it (bf16 roundings in the same places).
// Why it is correct: an operation's inputs were written by the operation before it (or earlier), whose blocks
// count themselves done only after their writes (a barrier, then one thread's release add), while a waiting
// block, once its polls see the count, reads the counter with an acquire load before it reads anything, and
// reads what other blocks wrote through L2 (__ldcg), never from a stale L1 line. The operations form a chain,
// so when operation o starts every earlier one is complete: a buffer that o writes (qkv, attn, act, the
// residual stream) is no longer read by anyone. Attention's last step, merging the partitions of a (sequence,
// KV head), is done by whichever partition finishes last (a ticket counter per layer, sequence and KV head,
// taken with an acquire-release add), which then counts the pair done. Every sum is computed by one thread
// block in a fixed order whatever the timing, so the results do not depend on scheduling:
// test/gpu/gpu_persistent.cu runs the kernel with thread blocks delayed by different amounts at every
// operation and requires the same bits, and checks that leaving one wait out is caught.
// All thread blocks must be resident at once (a waiting block never yields its SM): the grid is one block per
// SM, the kernel is launched alone in its stream, and a block that waits longer than 5 s stops the kernel
// with a message instead of hanging.
// What limits it is the hand-offs between operations, not the weights. test/gpu/gpu_persistent.cu's breakdown
// times every operation of every block (when it got past its wait, how many of its chunks were then in its
// ring, how long its input took, its rows, its end), and the code is shaped by what that shows:
//   * instructions: 16 warps on 4 schedulers leave few warps to hide latency, so every instruction counts. A
//     strip that lies wholly inside W costs one address and two strides (persist_issue, persist_gemv_chunk),
//     and the stream's cursor keeps its operation in registers (PersistCursor);
//   * a release waits for the signalling thread's earlier memory operations, its cp.async copies included, so
//     the copy of a later operation's weights is issued just after an operation's signal, not before it;
//   * round trips on the critical path (the count seen, the input through L2, attention's merge): the norm's
//     weights are loaded before the wait, and the polls are relaxed loads with one acquire load at the end
//     (an acquire poll empties the SM's L1 every time).
// A constraint on any change: the kernel has at most 128 registers a thread (512 threads on an SM) and spills
// some already, and code added to one operation's path, even code that never runs, lengthens every
// operation's rows; so a change is measured on all of them (docs/performance.md has the measurements, and
// what was tried and dropped).
// Whether it beats section 14's path depends on the GPU, the model, the batch size and the contexts, so a decode
// step of a batch size with a plan takes it only up to the context at which a measurement at start-up finds it
// faster (persist_measure).
// The kernel is a template over the cache format (section 15a's F): what attention reads, and how the step's
// own key and value are stored. This chapter instantiates it for bf16 (KVBf16).
// What it computes: section 14's arithmetic with the sums added in another order, so results match section
// 14's within float rounding, not bit for bit (gpu_persistent.cu states the tolerance).
// Tensor parallelism. Each GPU runs the kernel on its shard (its heads, its intermediate columns, its part of
// the vocabulary), and the sums over the GPUs become operations of the chain: after the embedding, after O
// and after DOWN, an ALLREDUCE operation does what section 20's one-shot kernel does, with the same staging
// buffers, the same empty mark, the same call counter and the same rounding: its thread blocks wait for the
// operation before (O's or DOWN's partial sums, which those now write to act.hidden instead of adding them
// to the residual stream), store their chunks into every other GPU's staging buffer, take the other GPUs'
// chunks as they land, add them in rank order and add the sum to the residual stream; then they count
// themselves done like any operation. No flag crosses between the GPUs: the data is its own flag. What this
// needs that one GPU did not: every GPU runs the same kernel at the same time (each rank launches it for the
// same step: the route below is agreed by all ranks), and every rank's all-reduces are numbered alike, the
// kernel's included (it reads the call counter when it starts, numbers its own 2L + 1 calls after it, and
// the last of its thread blocks to finish stores the new count). Part I's one-shot ordering argument (section
// 20) holds inside the kernel too: an ALLREDUCE operation starts only after the one before it finished on
// its GPU, empty slots included, because the operations form a chain. The kernel is a template over this
// (TP), so that one GPU's kernel carries none of it.
// Switch: persistent (on by default; measured per batch size and context at start-up). Needs sm_80; a batch
// size whose shared memory does not fit, TP > 1 without section 20's one-shot all-reduce, or a variant the
// cache format has no kernel for (section 26's PersistFormat) uses section 14's path, and the start-up line
// says which decode path runs at which batch sizes and contexts, with the times measured.

constexpr int PERSIST_THREADS = 512;
constexpr int PERSIST_WARPS = PERSIST_THREADS / 32;
constexpr int PERSIST_ROWS = 16;        // weight rows per group: one tensor-core tile (m16n8k16) tall
constexpr int PERSIST_KC = 1024;         // columns per chunk: a chunk is 16 x 1024 bf16 = 32 KiB
constexpr int PERSIST_WARP_K = PERSIST_KC / PERSIST_WARPS;  // 64 columns of a chunk per warp: 4 k-tiles
constexpr int PERSIST_SLOT_ELEMS = PERSIST_ROWS * PERSIST_KC;
constexpr int PERSIST_RING = 4;          // slots: 3 chunks (96 KiB) ahead of the one in use
static_assert((PERSIST_RING & (PERSIST_RING - 1)) == 0, "the ring's slot is a count modulo PERSIST_RING");
constexpr int PERSIST_PREFETCH = 8;       // attention: tokens per warp whose K and V are loaded before the wait
constexpr int PERSIST_MAX_B = 4;          // batch sizes 1, 2, 4 (decode graph sizes; docs/performance.md: 8)

enum PersistKind : int { PERSIST_EMBED, PERSIST_QKV, PERSIST_ATTN, PERSIST_O, PERSIST_GATE_UP, PERSIST_DOWN,
                         PERSIST_LM_HEAD, PERSIST_ALLREDUCE,
                         PERSIST_ROUTER, PERSIST_MOE_GATE_UP, PERSIST_MOE_DOWN };  // the last three: section 36

// One operation of the step. The gemvs (QKV .. LM_HEAD, not ATTN) compute y[b, n] = in[b, :] . W[n, :] for
// their N outputs and write y where section 14 writes it:
//   QKV      in = rmsnorm(residual) * norm_w   y -> qkv (bf16)
//   O, DOWN  in = attn / act                   residual = bf16(bf16(y) + residual)
//   GATE_UP  in = rmsnorm(residual) * norm_w   act[j] = bf16(silu(bf16(y_gate j)) * bf16(y_up j))
//   LM_HEAD  in = rmsnorm(residual) * norm_w   logits (fp32)
// and at TP > 1 (the chain's sums over the GPUs; `layer` is then the call's number in the step, 0 .. 2L):
//   O, DOWN    y -> act.hidden (bf16), this GPU's partial sum
//   ALLREDUCE  K = 1: residual = bf16(residual + bf16(sum of act.hidden over the GPUs)), as section 20 adds;
//              K = 0: residual = bf16(sum of residual over the GPUs) (after the embedding: each GPU looked up
//              only the ids of its part of the vocabulary)
struct PersistOp {
  int kind, layer;
  const bf16* W;       // [rows, K] (GATE_UP: the I gate rows, then the I up rows)
  const bf16* norm_w;  // the RMSNorm of the input (QKV, GATE_UP, LM_HEAD); ATTN: q_norm
  const bf16* k_norm;  // ATTN
  int N, K;            // outputs per sequence (GATE_UP: I), input length
  int groups;          // groups of 16 weight rows (GATE_UP: 8 gate rows and the 8 up rows they pair with)
  int tasks;           // how many adds to done[o] complete this operation
  float kv_scale[2] = {1.f, 1.f};  // ATTN: what the layer's stored keys, values are multiplied by (a cache
                                   // format's, PersistFormat::layer_scales; bf16: 1)
  // A product whose weights are FP8 (section 30a; null: bf16): W then holds e4m3 bytes [N, K], wscale their
  // block scales [N / 128, wld] (section 28's Fp8Matrix). The weight stream takes two e4m3 bytes for one
  // bf16 value: the same 32 KiB chunks, 2,048 columns wide.
  const float* wscale = nullptr;
  int wld = 0;
  // A MoE layer's experts (section 36: MOE_GATE_UP, MOE_DOWN): the experts each token routes to (k); MOE_DOWN's
  // input is a token's k rows of act, K = k IE.
  int topk = 0;
};

// Shared-memory bytes of a copy of the operation list (16-byte multiple).
__host__ __device__ constexpr size_t persist_ops_bytes(int n_ops) {
  return (n_ops * sizeof(PersistOp) + 15) / 16 * 16;
}

struct PersistArgs {
  const PersistOp* ops;
  int n_ops;
  int* done;         // [n_ops] zeroed before each launch
  int* tickets;      // [L, B, NKV] attention partitions finished; zeroed before each launch
  float* partials;   // [B, NKV, parts, GQA, D + 2] one partition's unnormalised output, then its max and sum
  bf16 *residual, *qkv, *attn, *act;  // section 6c's activations (act.act holds SiLU(gate) * up)
  float* logits;
  const bf16* embed;
  const int *ids, *positions, *slots, *context_lens, *block_tables;  // the decode step's inputs
  void* kv;  // the cache: layer l's keys at value l * layer_stride, its values kv_stride values further
  int64_t layer_stride, kv_stride;
  int B, H, NH, NKV, I, V, P, MB, parts, Kmax;
  float eps, scale;
  RopeInvFreq inv_freq;
  int skew_ns;    // tests: block i starts operation o after ((7 i + 13 o) % 11) * skew_ns ns (0: never)
  int skip_wait;  // tests: the operation whose wait is left out (-1: none)
  uint64_t* trace;  // tests: [grid, n_ops, PERSIST_TRACE], see persist_trace
  // Tensor parallelism (TP > 1 only): this rank's vocabulary starts at id vocab_offset (V ids: embed and the
  // head hold those rows); O and DOWN write their partial sums to hidden [B, H]; section 20's staging buffers
  // (peers), call counter (epochs) and layout (ar_half, ar_slot: ar_half_chunks, ar_oneshot_slot_chunks);
  // n_calls: the step's all-reduces; finished: thread blocks done with the step (zeroed before each launch).
  int rank, tp, vocab_offset, n_calls;
  int* finished;
  bf16* hidden;
  ARPeers peers;
  uint64_t* epochs;
  int64_t ar_half, ar_slot;
  // A MoE model (section 36): the router's logits [B, E] and the pairs' act [B k, IE] (section 6c's buffers),
  // the routing written for the tests [B, k], and the routing's settings.
  bf16 *router_logits, *moe_act;
  int* topk_ids;
  int E, topk;
  bool norm_topk;
};

// Rows of W that row r of group g of op uses (-1: past the end, not loaded, result not written).
__device__ __forceinline__ int64_t persist_weight_row(const PersistOp& op, int g, int r) {
  if (op.kind == PERSIST_GATE_UP) {
    const int half = PERSIST_ROWS / 2, pair = g * half + (r & (half - 1));
    if (pair >= op.N) return -1;
    return r < half ? pair : (int64_t)op.N + pair;
  }
  const int n = g * PERSIST_ROWS + r;
  return n < op.N ? n : -1;
}
__host__ __device__ __forceinline__ bool persist_is_gemv(int kind) {
  return kind != PERSIST_EMBED && kind != PERSIST_ATTN && kind != PERSIST_ALLREDUCE;
}
// A row of W in the stream's 16-bit units: K, or K / 2 for FP8 weights.
__host__ __device__ __forceinline__ int persist_stream_k(const PersistOp& op) { return op.wscale ? op.K / 2 : op.K; }
__host__ __device__ __forceinline__ int persist_k_chunks(const PersistOp& op) {
  return (persist_stream_k(op) + PERSIST_KC - 1) / PERSIST_KC;
}

// The weight ring's producer side: the position of the next chunk to load (operation, group, column chunk)
// in this thread block's order, which is the order the block consumes them in, and what the copies need of
// that operation, held in registers while the cursor stays in it. The stream issues one chunk per chunk
// consumed, in every warp, so its cost per chunk is paid inside the rows, and reading the operation from the
// list at every chunk would cost about half the instructions of a chunk.
struct PersistCursor {
  int o, g, kc;
  int n;  // how many chunks of this block's order come before this one
  const bf16* W;              // operation o's weights
  int K, N, kchunks, groups;  // its input length, outputs, column chunks per group and groups
  int per;   // W rows a group starts apart: 16, or GATE_UP's 8 (a group is 8 gate rows and their 8 up rows)
  int half;  // row r + 8 of a group is `half` rows of W after row r: 8, or GATE_UP's N (gate row r's up row)
};
// Before the block's first chunk.
__host__ __device__ __forceinline__ PersistCursor persist_cursor_start() {
  PersistCursor c = {};
  c.o = -1, c.kchunks = 1;  // past the end of "operation -1": persist_seek enters the first
  return c;
}
// Moves c to thread block `block`'s next chunk at or after it (the column chunk past a group's last is the next
// group's first, the group past an operation's last for this block is the next operation's), entering an
// operation by reading its fields from ops (the list's copy in shared memory); false when there is none. The
// kernel consumes the chunks in the same order (test_optimizations checks the two orders agree).
__host__ __device__ __forceinline__ bool persist_seek(int n_ops, const PersistOp* ops, PersistCursor& c,
                                                      int block, int grid) {
  if (c.kc >= c.kchunks) c.kc = 0, c.g += grid;
  if (c.g < c.groups) return true;
  while (++c.o < n_ops) {
    const PersistOp& op = ops[c.o];
    if (!persist_is_gemv(op.kind) || block >= op.groups) continue;
    const bool gate_up = op.kind == PERSIST_GATE_UP;
    c.g = block, c.kc = 0, c.W = op.W, c.K = persist_stream_k(op), c.N = op.N, c.kchunks = persist_k_chunks(op);
    c.groups = op.groups, c.per = gate_up ? PERSIST_ROWS / 2 : PERSIST_ROWS, c.half = gate_up ? op.N : 8;
    return true;
  }
  c.groups = 0;
  return false;
}
// Each warp streams its own share of every chunk: warp w computes columns [64 w, 64 w + 64) of the chunk's
// 16 rows, and it alone copies those (cp.async, four 16-byte pieces per lane) into its own 2 KiB strip of the
// slot, [16 rows][64 columns] with each row's eight 16-byte pieces rotated by the row (piece c of row r at
// c ^ (r % 8)), so that the tensor cores' ldmatrix reads eight rows without a bank conflict. A warp waits
// only for its own copies (cp.async.wait_group) and reuses its strip as soon as it is done with it: the
// weight stream needs no barrier across the thread block. Pieces past the end of W (the last group's rows,
// the last chunk's columns) are filled with zeros, which add nothing.
__device__ __forceinline__ int persist_strip_index(int r, int c) {
  return r * PERSIST_WARP_K + ((c ^ (r & 7)) << 3);
}
// MOE (section 36's kernel): a MoE layer's expert operations have their own copies
// (persist_issue_expert), which wait, without issuing, until this block knows the layer's routing.
struct PersistRoute;
__device__ __forceinline__ bool persist_issue_expert(const PersistOp& op, const PersistCursor& c, bf16* slot,
                                                     const PersistRoute* route);
template <bool MOE = false>
__device__ __forceinline__ void persist_issue(const PersistArgs& a, const PersistOp* ops, PersistCursor& c,
                                              bf16* slot, const PersistRoute* route = nullptr) {
  if (persist_seek(a.n_ops, ops, c, blockIdx.x, gridDim.x)) {
    if constexpr (MOE) {
      const PersistOp& op = ops[c.o];
      if (op.kind == PERSIST_MOE_GATE_UP || op.kind == PERSIST_MOE_DOWN) {
        if (persist_issue_expert(op, c, slot, route)) c.kc++, c.n++;
        cp_async_commit();
        return;
      }
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int k0 = c.kc * PERSIST_KC + warp * PERSIST_WARP_K;
    bf16* strip = slot + warp * PERSIST_ROWS * PERSIST_WARP_K;
    if (k0 + PERSIST_WARP_K <= c.K && (c.g + 1) * c.per <= c.N) {
      // The whole strip lies inside W (every chunk but the edges of odd shapes): this lane's four pieces are
      // rows r0, r0 + 4, r0 + 8, r0 + 12 of the group at the same columns, so one address and two strides
      // (rows 8-15 are 8 rows on, or GATE_UP's up rows, N rows on) place them all; rows r and r + 8 rotate
      // their pieces alike (r % 8).
      const int r0 = lane >> 3, piece = lane & 7;
      const int64_t four = 4 * (int64_t)c.K, half = (int64_t)c.half * c.K;
      const bf16* src = c.W + ((int64_t)c.g * c.per + r0) * c.K + k0 + piece * 8;
      bf16* dst = strip + r0 * PERSIST_WARP_K;
      const int rot0 = (piece ^ r0) << 3, rot4 = (piece ^ (r0 + 4)) << 3;
      cp_async_16(dst + rot0, src, true);
      cp_async_16(dst + 4 * PERSIST_WARP_K + rot4, src + four, true);
      cp_async_16(dst + 8 * PERSIST_WARP_K + rot0, src + half, true);
      cp_async_16(dst + 12 * PERSIST_WARP_K + rot4, src + half + four, true);
    } else {
      const PersistOp& op = ops[c.o];
#pragma unroll
      for (int i = 0; i < PERSIST_ROWS * PERSIST_WARP_K / 8 / 32; i++) {
        const int p = lane + 32 * i, r = p >> 3, piece = p & 7, col = k0 + piece * 8;
        const int64_t row = persist_weight_row(op, c.g, r);
        const int K = persist_stream_k(op);
        const bool valid = row >= 0 && col < K;
        cp_async_16(strip + persist_strip_index(r, piece), valid ? op.W + row * K + col : op.W, valid);
      }
    }
    c.kc++, c.n++;
  }
  cp_async_commit();
}

__device__ __forceinline__ int persist_load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ int persist_load_relaxed(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t persist_clock_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
// The one thread of a block that waits and signals for it.
constexpr int PERSIST_SYNC_THREAD = PERSIST_THREADS - 1;
__device__ __forceinline__ void red_release_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int atom_acq_rel_add(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
// One thread waits until done[op] >= target, then the barrier releases the whole block. It polls with relaxed
// loads and reads the count once more with an acquire load when it has reached the target (the count only
// grows, so that read sees it too): an acquire load also discards the SM's L1 cache, which at every poll
// would cost both the polling and the block's other warps.
__device__ __forceinline__ void persist_wait(const PersistArgs& a, int op, int target) {
  if (threadIdx.x == PERSIST_SYNC_THREAD) {
    const uint64_t t0 = persist_clock_ns();
    for (int spins = 1; persist_load_relaxed(a.done + op) < target; spins++) {
      if (spins % 4096 == 0 && persist_clock_ns() - t0 > 5000000000ull) {
        printf("nanovllm: persistent decode: thread block %d waited 5 s for operation %d (%d of %d done): "
               "are all %d thread blocks resident?\n", blockIdx.x, op, a.done[op], target, gridDim.x);
        __trap();
      }
    }
    persist_load_acquire(a.done + op);  // the count only grows, so this read sees the target too
  }
  __syncthreads();
}
// After a block's writes for operation op: every thread's writes are done (barrier), then one thread counts
// them with a release add, which makes them visible at GPU scope before the count (the other half of
// persist_wait's acquire).
__device__ __forceinline__ void persist_signal(const PersistArgs& a, int op) {
  __syncthreads();
  if (threadIdx.x == PERSIST_SYNC_THREAD) red_release_add(a.done + op, 1);
}
// -- Testing probes: what test/gpu/gpu_persistent.cu watches and perturbs. Inert in a run: the engine passes no
//    trace buffer, no skew and no left-out wait (persistent_decode's last three arguments). --
// Tests only: what thread block b saw of operation o, at trace[(b * n_ops + o) * PERSIST_TRACE + k]: the
// clock at k = 0 its start, 1 after its wait and its input, 2 its end, 3 when warp 0 finished its rows of a
// gemv, 4 just past its wait, 6 when it had routed (section 36's expert operations); and 5, how many chunks
// the block had issued to its ring and not yet used when it got past its wait (its weights in flight or
// landed).
constexpr int PERSIST_TRACE = 8;
__device__ __forceinline__ void persist_trace(const PersistArgs& a, int o, int k) {
  if (a.trace && threadIdx.x == 0) a.trace[((size_t)blockIdx.x * a.n_ops + o) * PERSIST_TRACE + k] = persist_clock_ns();
}
__device__ __forceinline__ void persist_trace_ahead(const PersistArgs& a, int o, const PersistCursor& load,
                                                    int consumed) {
  if (!a.trace || threadIdx.x != 0) return;
  uint64_t* t = a.trace + ((size_t)blockIdx.x * a.n_ops + o) * PERSIST_TRACE;
  t[4] = persist_clock_ns(), t[5] = load.n - consumed;
}
// Tests only: hold this block back before operation o, by an amount that differs between blocks.
__device__ __forceinline__ void persist_skew(const PersistArgs& a, int o) {
  if (!a.skew_ns) return;
  const uint64_t until = persist_clock_ns() + (uint64_t)((7 * blockIdx.x + 13 * o) % 11) * a.skew_ns;
  while (persist_clock_ns() < until) __nanosleep(500);
}

// Copies n bf16 values written by other blocks (through L2) into shared memory.
__device__ __forceinline__ void persist_copy_in(bf16* dst, const bf16* src, int n) {
  for (int c = threadIdx.x; c < n / 8; c += PERSIST_THREADS)
    reinterpret_cast<uint4*>(dst)[c] = __ldcg(reinterpret_cast<const uint4*>(src) + c);
}

// The weights of op's RMSNorm (QKV, GATE_UP, LM_HEAD), the chunks of 8 this thread normalises (those
// rmsnorm_row gives it): loaded before the wait, since they do not depend on it.
__device__ __forceinline__ void persist_load_norm(const PersistOp& op, uint4 (&nw)[NORM_MAX_CHUNKS]) {
#pragma unroll
  for (int k = 0; k < NORM_MAX_CHUNKS; k++) {
    const int c = threadIdx.x + k * PERSIST_THREADS;
    if (op.norm_w && c < op.K / 8) nw[k] = __ldg(reinterpret_cast<const uint4*>(op.norm_w) + c);
  }
}

// The RMSNorm's 1 / rms of B rows of K values, in scale[b] for every thread: section 7's rmsnorm_row's sum, bit
// for bit (each thread's squares in its chunks' order, added across the warp, then over the warps in order),
// row(b, c) giving chunk c (8 values) of row b. scratch: [B, 32].
template <int B, class Row>
__device__ __forceinline__ void persist_rms_scales(Row row, int K, float eps, float* scratch, float (&scale)[B]) {
  const int nchunks = K / 8, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float ss[B];
#pragma unroll
  for (int b = 0; b < B; b++) ss[b] = 0.f;
#pragma unroll
  for (int k = 0; k < NORM_MAX_CHUNKS; k++) {
    const int c = threadIdx.x + k * PERSIST_THREADS;
    if (c >= nchunks) break;
#pragma unroll
    for (int b = 0; b < B; b++) {
      float v[8];
      bf16x8_to_float(row(b, c), v);
#pragma unroll
      for (int i = 0; i < 8; i++) ss[b] += v[i] * v[i];
    }
  }
#pragma unroll
  for (int b = 0; b < B; b++) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss[b] += __shfl_xor_sync(0xffffffffu, ss[b], o);
    if (lane == 0) scratch[b * 32 + warp] = ss[b];
  }
  __syncthreads();
#pragma unroll
  for (int b = 0; b < B; b++) {
    float total = 0.f;
    for (int w = 0; w < PERSIST_WARPS; w++) total += scratch[b * 32 + w];
    scale[b] = rsqrtf(total / (float)K + eps);
  }
}

// The input of a gemv for all B sequences into xs [B, K + 8] (rows 16 bytes longer than K, so the sequences'
// reads in persist_gemv_chunk fall in different banks): a copy of attn or act, or rmsnorm of the residual
// stream. O and DOWN also copy the residual stream into res [B, H], for their epilogue (not at TP > 1, where
// the ALLREDUCE after them adds to it). The RMSNorm is
// section 7's rmsnorm_row, bit for bit (each thread's squares in its chunks' order, added across the warp,
// then over the warps in order; then w * bf16(x * scale)), done for the B rows at once: one barrier for all
// of them, and the weights nw already in registers. scratch: [B, 32].
template <int B, bool TP>
__device__ __forceinline__ void persist_stage_input(const PersistArgs& a, const PersistOp& op, bf16* xs, bf16* res,
                                                    float* scratch, const uint4 (&nw)[NORM_MAX_CHUNKS]) {
  const bf16* src = op.kind == PERSIST_O ? a.attn : op.kind == PERSIST_DOWN ? a.act : a.residual;
  const int ks = op.K + 8;
  for (int c = threadIdx.x; c < B * op.K / 8; c += PERSIST_THREADS) {
    const int b = c / (op.K / 8), j = c % (op.K / 8);
    reinterpret_cast<uint4*>(xs + b * ks)[j] = __ldcg(reinterpret_cast<const uint4*>(src + (size_t)b * op.K) + j);
  }
  if (!TP && (op.kind == PERSIST_O || op.kind == PERSIST_DOWN)) persist_copy_in(res, a.residual, B * op.N);
  __syncthreads();
  if (!op.norm_w) return;
  const int nchunks = op.K / 8;
  float scale[B];
  persist_rms_scales<B>([&](int b, int c) { return reinterpret_cast<const uint4*>(xs + b * ks)[c]; }, op.K, a.eps,
                        scratch, scale);
#pragma unroll
  for (int k = 0; k < NORM_MAX_CHUNKS; k++) {
    const int c = threadIdx.x + k * PERSIST_THREADS;
    if (c >= nchunks) break;
    float wf[8];
    bf16x8_to_float(nw[k], wf);
#pragma unroll
    for (int b = 0; b < B; b++) {
      uint4* row = reinterpret_cast<uint4*>(xs + b * ks);
      float v[8], o[8];
      bf16x8_to_float(row[c], v);
#pragma unroll
      for (int i = 0; i < 8; i++) o[i] = wf[i] * bf16_round(v[i] * scale[b]);
      row[c] = float_to_bf16x8(o);
    }
  }
  __syncthreads();
}

// acc += this warp's strip of chunk kc (16 rows x 64 columns of W) times the same 64 columns of the B inputs:
// four tensor-core products m16n8k16, the inputs as the 8 columns of the right-hand matrix (column n =
// sequence n; those past B are zeros). acc is the m16n8 accumulator fragment: lane l holds rows l/4 and
// l/4 + 8, columns 2 (l % 4) and 2 (l % 4) + 1.
template <int B>
__device__ __forceinline__ void persist_gemv_chunk(const PersistOp& op, int kc, const bf16* slot, const bf16* xs,
                                                   float (&acc)[4]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, ks = op.K + 8;
  const int k0 = kc * PERSIST_KC + warp * PERSIST_WARP_K, n = lane >> 2;
  const bf16* strip = slot + warp * PERSIST_ROWS * PERSIST_WARP_K;
  if (k0 + PERSIST_WARP_K <= op.K) {  // the whole strip inside K: no bounds to check (same arithmetic)
    const bf16* arow = strip + ((lane & 7) + ((lane >> 3) & 1) * 8) * PERSIST_WARP_K;
    const bf16* xrow = xs + n * ks + k0 + 2 * (lane & 3);
#pragma unroll
    for (int t = 0; t < PERSIST_WARP_K / 16; t++) {
      uint32_t w[4];
      ldmatrix_x4(w, arow + (((2 * t + (lane >> 4)) ^ (lane & 7)) << 3));
      uint32_t x0 = 0, x1 = 0;
      if (n < B) {
        x0 = *reinterpret_cast<const uint32_t*>(xrow + 16 * t);
        x1 = *reinterpret_cast<const uint32_t*>(xrow + 16 * t + 8);
      }
      mma_bf16_16816(acc, w, x0, x1);
    }
    return;
  }
#pragma unroll
  for (int t = 0; t < PERSIST_WARP_K / 16; t++) {
    const int k = k0 + 16 * t;
    if (k >= op.K) break;
    uint32_t w[4];  // A: rows 0-7 / 8-15 x columns 0-7, then the same x columns 8-15 (ldmatrix's four 8x8)
    const int r = (lane & 7) + ((lane >> 3) & 1) * 8;
    ldmatrix_x4(w, strip + persist_strip_index(r, 2 * t + (lane >> 4)));
    const int kk = k + 2 * (lane & 3);  // B: x[n][kk, kk+1] and x[n][kk+8, kk+9]
    uint32_t x0 = 0, x1 = 0;
    if (n < B) {
      if (kk < op.K) x0 = *reinterpret_cast<const uint32_t*>(xs + n * ks + kk);
      if (kk + 8 < op.K) x1 = *reinterpret_cast<const uint32_t*>(xs + n * ks + kk + 8);
    }
    mma_bf16_16816(acc, w, x0, x1);
  }
}

// The end of a group: every warp's 16 x 8 partial sums (its 64-column share of each chunk) go to red, one of
// two buffers (by the group's parity, so the next group can fill the other before this one is read); after
// a barrier, thread t < 16 B adds row t / B, sequence t % B over the 16 warps in order and writes the output
// the way op writes it (GATE_UP: thread t < 8 B, gate row r and its up row r + 8).
// persist_warp_sums is its first half (section 36's operations end their groups with it too): every warp's
// fragment into buffer `parity` and acc zeroed, then the barrier; persist_row_sum(all, r, b) is then row r,
// sequence b, added over the warps in order.
__device__ __forceinline__ const float* persist_warp_sums(float (&acc)[4], float* red, int parity) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* mine = red + (parity * PERSIST_WARPS + warp) * PERSIST_ROWS * 8;  // [16 rows][8 columns]
  const int row = lane >> 2, col = 2 * (lane & 3);
  mine[row * 8 + col] = acc[0], mine[row * 8 + col + 1] = acc[1];
  mine[(row + 8) * 8 + col] = acc[2], mine[(row + 8) * 8 + col + 1] = acc[3];
  acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
  __syncthreads();
  return red + parity * PERSIST_WARPS * PERSIST_ROWS * 8;
}
__device__ __forceinline__ float persist_row_sum(const float* all, int r, int b) {
  float sum = 0.f;
  for (int w = 0; w < PERSIST_WARPS; w++) sum += all[(w * PERSIST_ROWS + r) * 8 + b];
  return sum;
}
template <int B, bool TP>
__device__ __forceinline__ void persist_gemv_epilogue(const PersistArgs& a, const PersistOp& op, int g, int parity,
                                                      float (&acc)[4], float* red, const bf16* res) {
  const float* all = persist_warp_sums(acc, red, parity);
  auto row_sum = [&](int r, int b) { return persist_row_sum(all, r, b); };
  const int t = threadIdx.x;
  if (op.kind == PERSIST_GATE_UP) {
    if (t < PERSIST_ROWS / 2 * B) {
      const int r = t / B, b = t % B, j = g * (PERSIST_ROWS / 2) + r;
      if (j < op.N) {
        const float gate = bf16_round(row_sum(r, b)), up = bf16_round(row_sum(r + PERSIST_ROWS / 2, b));
        a.act[(size_t)b * op.N + j] = __float2bfloat16(silu_mul(gate, up));
      }
    }
  } else if (t < PERSIST_ROWS * B) {
    const int r = t / B, b = t % B, n = g * PERSIST_ROWS + r;
    if (n < op.N) {
      const float y = row_sum(r, b);
      if (op.kind == PERSIST_QKV) a.qkv[(size_t)b * op.N + n] = __float2bfloat16(y);
      else if (op.kind == PERSIST_LM_HEAD) a.logits[(size_t)b * op.N + n] = y;
      else if (TP) a.hidden[(size_t)b * op.N + n] = __float2bfloat16(y);  // O, DOWN: summed by ALLREDUCE
      else {  // O, DOWN: the residual add, rounded as add_rmsnorm rounds it
        const float r0 = __bfloat162float(res[b * op.N + n]);  // staged with the input
        a.residual[(size_t)b * op.N + n] = __float2bfloat16(bf16_round(y) + r0);
      }
    }
  }
}

// An ALLREDUCE operation (TP > 1): section 20's one-shot all-reduce of B * H values, thread t of the operation's
// block i owning chunk i * PERSIST_THREADS + t (16 bytes), with the kernel's own call number: `first` is the
// count the call counter held when the kernel started, and this is the step's call op.layer. What the
// operation before wrote (act.hidden, or the residual stream after the embedding) is read through L2.
template <int B>
__device__ __forceinline__ void persist_all_reduce(const PersistArgs& a, const PersistOp& op, uint64_t first) {
  const int64_t c = (int64_t)blockIdx.x * PERSIST_THREADS + threadIdx.x;
  if (c >= (int64_t)B * a.H / 8) return;
  const int64_t half = (int64_t)((first + op.layer + 1) & 1) * a.ar_half;
  auto slot = [&](int owner, int from) {  // data[from] of this call's half in rank owner's buffer
    return reinterpret_cast<uint4*>(a.peers.data[owner]) + half + from * a.ar_slot;
  };
  uint4* x = reinterpret_cast<uint4*>(op.K ? a.hidden : a.residual);
  const uint4 mine = ar_no_negative_zero(__ldcg(x + c));
  for (int r = 0; r < a.tp; r++)
    if (r != a.rank) slot(r, a.rank)[c] = mine;
  float sum[8] = {}, v[8];
  for (int r = 0; r < a.tp; r++) {
    bf16x8_to_float(r == a.rank ? mine : ar_take(slot(a.rank, r) + c), v);
#pragma unroll
    for (int i = 0; i < 8; i++) sum[i] += v[i];
  }
  // (ar_store's plain load of the residual stream is fresh: the wait before this operation ended with an
  // acquire load, which emptied this SM's L1.)
  ar_store(reinterpret_cast<uint4*>(a.residual), op.K ? reinterpret_cast<uint4*>(a.residual) : nullptr, c,
           float_to_bf16x8(sum));
}

// ==== 25. The persistent kernel, 2: attention inside it ====================================================
// defines: PersistTask, PersistAttnSplit, PersistKV, persist_attn_new_token, persist_attn_combine_warps,
//          persist_attn_merge, persist_attention
// A decode step's attention as tasks of the chain: one per (sequence, KV head, context partition), each a
// share of the 132 thread blocks, the partitions of a pair merged by whichever finishes last (a ticket).

// The cache row (block, KV head g, slot) of sequence b's key t.
__device__ __forceinline__ int64_t persist_cache_row(const PersistArgs& a, int b, int g, int t) {
  return ((int64_t)a.block_tables[(size_t)b * a.MB + t / a.P] * a.NKV + g) * a.P + t % a.P;
}
// Which (sequence b, KV head g, partition p) attention task `task` is, and the partition's keys [t0, t1).
struct PersistTask {
  int b, g, p, ctx, t0, t1;
};
__device__ __forceinline__ PersistTask persist_task(const PersistArgs& a, int task) {
  PersistTask k;
  k.p = task % a.parts, k.g = (task / a.parts) % a.NKV, k.b = task / (a.parts * a.NKV);
  k.ctx = a.context_lens[k.b];
  const int len = (k.ctx + a.parts - 1) / a.parts;
  k.t0 = min(k.ctx, k.p * len), k.t1 = min(k.ctx, k.t0 + len);
  return k;
}
// How attention's 16 warps split a partition: a warp takes `hpw` query heads of the group (all of them when
// there are at most PERSIST_MAX_HPW, so each key and value is read once per thread block, and the heads'
// dot products interleave), the group's ng = GQA / hpw sets of heads each take wph warps, and warp w of a set
// takes every wph-th token of the partition from w % wph on. (GQA 2 or 4, Qwen3's common case: one set, 16
// warps, each on a sixteenth of the tokens for every head.) At batch 1 too: one head per warp loads every
// key once per head, so its time grows about twice as fast with the context (docs/performance.md).
constexpr int PERSIST_MAX_HPW = 4;  // query heads a warp carries (registers: 10 floats per head)
struct PersistAttnSplit {
  int hpw, ng, wph;
};
__host__ __device__ inline PersistAttnSplit persist_attn_split(int gqa) {
  const int hpw = gqa <= PERSIST_MAX_HPW ? gqa : gqa % 4 == 0 ? 4 : gqa % 2 == 0 ? 2 : 1;
  return {hpw, gqa / hpw, PERSIST_WARPS / (gqa / hpw)};
}

// A block's attention task is the same in every layer (there are at most as many tasks as blocks), and so are
// the cache rows of the keys and values it reads first: they are looked up once per step, at the kernel's
// start, into rows [WARPS, PERSIST_PREFETCH] (warp w's i-th token; -1: none), not in every layer while the
// block is about to wait (a block-table read that misses L1 is a trip to L2 on the critical path).
__device__ __forceinline__ void persist_first_rows(const PersistArgs& a, int64_t* rows) {
  const PersistTask k = persist_task(a, blockIdx.x);
  const PersistAttnSplit sp = persist_attn_split(a.NH / a.NKV);
  for (int i = threadIdx.x; i < PERSIST_WARPS * PERSIST_PREFETCH; i += PERSIST_THREADS) {
    const int w = i / PERSIST_PREFETCH, t = k.t0 + w % sp.wph + (i % PERSIST_PREFETCH) * sp.wph;
    const bool used = w / sp.wph < sp.ng && t < k.t1;
    rows[i] = used ? persist_cache_row(a, k.b, k.g, t) : -1;
  }
}

// A cache format F (section 15a) as attention reads it here, a template each format specialises: a lane reads
// 4 values of a row (dims 4 lane .. 4 lane + 3) as one Word (8 bytes of bf16) and widens them to float;
// tile_floats: 8 tile values (F::key_tile_values) as floats; the layer's scales from its operation, and the
// factors they put on the scores' scale and on the output (bf16: none).
template <class F>
struct PersistKV;
template <>
struct PersistKV<KVBf16> {
  using Word = uint2;
  __device__ static __forceinline__ void widen(uint2 w, float (&f)[4]) {
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.y));
    f[0] = lo.x, f[1] = lo.y, f[2] = hi.x, f[3] = hi.y;
  }
  __device__ static __forceinline__ void tile_floats(uint4 v, float* f) { bf16x8_to_float(v, f); }
  __device__ static __forceinline__ KVBf16::Scales scales(const PersistOp&) { return {}; }
  __device__ static __forceinline__ float key_factor(KVBf16::Scales) { return 1.f; }
  __device__ static __forceinline__ float value_factor(KVBf16::Scales) { return 1.f; }
};

// persist_attention's step 1: q/k-norm and RoPE, 8 threads per head (section 19's pieces), heads 0..GQA-1
// the group's queries, head GQA its key: the queries to q_s [GQA, D] as bf16 values (as section 15 takes
// them), the key and the value to kv_new [2, D] as the cache will return them, and both into the cache by the
// partition that owns the new token. cos_s, sin_s: this sequence's RoPE angles. No barrier: the caller's
// publishes q_s and kv_new. The task (b, g, ctx, t0, t1) and GQA, warp come from the caller, which has them.
template <class F>
__device__ __forceinline__ void persist_attn_new_token(const PersistArgs& a, const PersistOp& op,
                                                      int GQA, int warp, int b, int g, int ctx, int t0, int t1,
                                                      const float* cos_s, const float* sin_s, float* q_s,
                                                      float* kv_new, typename F::Elem* k_cache,
                                                      typename F::Elem* v_cache, typename F::Scales kv_scale) {
  using Elem = typename F::Elem;
  const int D = HEAD_DIM;
  const bf16* row = a.qkv + (size_t)b * (a.NH + 2 * a.NKV) * D;
  const int hh = threadIdx.x / ROPE_THREADS_PER_HEAD, j = threadIdx.x % ROPE_THREADS_PER_HEAD;
  if (warp < (GQA + 1 + 3) / 4) {  // 4 heads per warp: every lane of these warps takes part in the shuffles
    const bool mine = hh <= GQA;
    const bf16* src = row + (size_t)(hh < GQA ? g * GQA + hh : a.NH + g) * D;
    uint4 ua = {}, ub = {};
    const uint4* head = reinterpret_cast<const uint4*>(src);
    if (mine) ua = __ldcg(head + j), ub = __ldcg(head + j + 8);
    const float ss = head_sum_squares(ua, ub);
    if (mine) {
      head_norm_rope(ua, ub, ss, hh < GQA ? op.norm_w : op.k_norm, cos_s, sin_s, j, a.eps);
      if (hh < GQA) {  // a query: bf16 values, as section 15 takes them
        bf16x8_to_float(ua, q_s + hh * D + 8 * j);
        bf16x8_to_float(ub, q_s + hh * D + D / 2 + 8 * j);
      } else {  // the key, as the cache holds it
        PersistKV<F>::tile_floats(F::key_tile_values(ua, kv_scale), kv_new + 8 * j);
        PersistKV<F>::tile_floats(F::key_tile_values(ub, kv_scale), kv_new + D / 2 + 8 * j);
        const int slot = a.slots[b];
        if (slot >= 0 && t0 <= ctx - 1 && ctx - 1 < t1) {  // the partition that owns the new token stores it
          Elem* dst_k = k_cache + (((int64_t)(slot / a.P) * a.NKV + g) * a.P + slot % a.P) * D;
          F::store_key(dst_k, j, ua, kv_scale);
          F::store_key(dst_k, j + 8, ub, kv_scale);
        }
      }
    }
  }
  if (threadIdx.x < D / 8) {
    const uint4 v = __ldcg(reinterpret_cast<const uint4*>(row + (size_t)(a.NH + a.NKV + g) * D) + threadIdx.x);
    PersistKV<F>::tile_floats(F::value_tile_values(v, kv_scale), kv_new + D + 8 * threadIdx.x);
    const int slot = a.slots[b];
    if (slot >= 0 && t0 <= ctx - 1 && ctx - 1 < t1) {
      Elem* dst_v = v_cache + (((int64_t)(slot / a.P) * a.NKV + g) * a.P + slot % a.P) * D;
      F::store_value(dst_v, threadIdx.x, v, kv_scale);
    }
  }
}

// persist_attention's step 2: the warps of each head combined (in warp order) into this partition's partial
// result in a.partials: wpart [WARPS, HPW, D + 2] holds each warp's o, m, l for each of its heads.
template <int HPW>
__device__ __forceinline__ void persist_attn_combine_warps(const PersistArgs& a, int GQA, int wph, int parts, int b,
                                                          int g, int p, const float* wpart) {
  const int D = HEAD_DIM;
  float* part = a.partials + ((((size_t)b * a.NKV + g) * parts + p) * GQA) * (D + 2);
  for (int e = threadIdx.x; e < GQA * D; e += PERSIST_THREADS) {
    const int hq = e / D, d = e % D, w0 = hq / HPW * wph, j = hq % HPW;  // head hq: warps w0.., slot j
    float mm = -INFINITY;
    for (int w = w0; w < w0 + wph; w++) mm = fmaxf(mm, wpart[(w * HPW + j) * (D + 2) + D]);
    float ll = 0.f, oo = 0.f;
    if (mm != -INFINITY)
      for (int w = w0; w < w0 + wph; w++) {
        const float* wp = wpart + (w * HPW + j) * (D + 2);
        if (wp[D] == -INFINITY) continue;
        const float f = fast_exp2(wp[D] - mm);
        ll += wp[D + 1] * f;
        oo += wp[d] * f;
      }
    part[hq * (D + 2) + d] = oo;
    if (d == 0) part[hq * (D + 2) + D] = mm, part[hq * (D + 2) + D + 1] = ll;
  }
}

// persist_attention's step 3, in the partition that finished last: the partial results of every partition
// of (b, g) merged into attn.
// Each thread merges one (query head, dimension) over the partitions, 16 at a time in partition order:
// their outputs, maxima and sums are all loaded before any is used (one trip to L2 for up to 16
// partitions), and a batch's larger maximum rescales what the batches before it added up.
__device__ __forceinline__ void persist_attn_merge(const PersistArgs& a, int GQA, int parts, int b, int g) {
  const int D = HEAD_DIM;
  const float* all = a.partials + (((size_t)b * a.NKV + g) * parts) * GQA * (D + 2);
  for (int e = threadIdx.x; e < GQA * D; e += PERSIST_THREADS) {
    const int hq = e / D, d = e % D;
    float mm = -INFINITY, ll = 0.f, oo = 0.f;
    for (int q0 = 0; q0 < parts; q0 += 16) {
      float ov[16], mv[16], lv[16];
#pragma unroll
      for (int j = 0; j < 16; j++) {
        const float* pj = all + ((size_t)(q0 + j) * GQA + hq) * (D + 2);
        const bool in = q0 + j < parts;
        ov[j] = in ? __ldcg(pj + d) : 0.f;
        mv[j] = in ? __ldcg(pj + D) : -INFINITY;
        lv[j] = in ? __ldcg(pj + D + 1) : 0.f;
      }
      float bm = mm;
#pragma unroll
      for (int j = 0; j < 16; j++) bm = fmaxf(bm, mv[j]);
      if (bm == -INFINITY) continue;  // no keys in these partitions (nor before)
      const float r = fast_exp2(mm - bm);  // 0 while nothing came before
      ll *= r, oo *= r;
#pragma unroll
      for (int j = 0; j < 16; j++) {
        if (mv[j] == -INFINITY) continue;
        const float f = fast_exp2(mv[j] - bm);
        ll += lv[j] * f;
        oo += ov[j] * f;
      }
      mm = bm;
    }
    a.attn[(size_t)b * a.NH * D + (g * GQA + hq) * D + d] = __float2bfloat16(oo / ll);
  }
}

// Attention for one (sequence b, KV head g, partition p) of layer op.layer: q/k-norm and RoPE of the group's
// heads (each partition does it for itself, from qkv), the partition's share of the context with an online
// softmax, its partial result to a.partials; the last partition to finish merges them all into attn and
// counts the (b, g) pair done. Warps split as persist_attn_split says: HPW query heads of the group per warp,
// every wph-th token of the partition; lane l holds dimensions [4l, 4l + 4) of each. angles: RoPE's cosines
// and sines for each sequence [B, D], computed once at the kernel's start (the positions do not change during
// a step). smem: see persist_smem_bytes.
// F: the cache format (section 15a). The step's own key and value are used as the cache will return them
// (F::key_tile_values: for a format that rounds, rounded): this step computes with the numbers every later step
// reads from that row, as section 19's fused kernel does.
template <class F, int HPW>
__device__ __forceinline__ void persist_attention(const PersistArgs& a, const PersistOp* ops, const PersistOp& op,
                                                  int o, int task, const float* angles, const int64_t* first_rows,
                                                  float* smem, const PersistCursor& load, int consumed) {
  using Word = typename PersistKV<F>::Word;
  using Elem = typename F::Elem;
  const int D = HEAD_DIM, GQA = a.NH / a.NKV, parts = a.parts;
  const PersistAttnSplit sp = persist_attn_split(GQA);
  const int wph = sp.wph;
  const PersistTask k = persist_task(a, task);
  const int g = k.g, b = k.b, ctx = k.ctx, t0 = k.t0, t1 = k.t1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, hg = warp / wph;  // heads hg*HPW .. + HPW-1
  const float* cos_s = angles + b * D;  // [64]
  const float* sin_s = cos_s + D / 2;   // [64]
  float* q_s = smem;                    // [GQA, D] normed, rotated queries (bf16 values)
  float* kv_new = q_s + GQA * D;      // [2, D] this step's key (normed, rotated) and value as the cache holds them
  float* wpart = kv_new + 2 * D;      // [WARPS, HPW, D + 2] each warp's o, m, l for each of its heads
  int* flag = reinterpret_cast<int*>(wpart + PERSIST_WARPS * HPW * (D + 2));
  Elem* k_cache = static_cast<Elem*>(a.kv) + op.layer * a.layer_stride;
  Elem* v_cache = k_cache + a.kv_stride;
  const typename F::Scales kv_scale = PersistKV<F>::scales(op);
  auto cache_row = [&](int t) { return persist_cache_row(a, b, g, t); };
  // Before the wait: this warp's first tokens' keys and values (written by earlier steps).
  const bool live = hg < sp.ng;
  const int first = t0 + warp % wph;  // this warp's tokens: first, first + wph, ...
  Word kr[PERSIST_PREFETCH], vr[PERSIST_PREFETCH];
  auto load_batch = [&](int from) {  // PERSIST_PREFETCH of them, every load issued before any is used
#pragma unroll
    for (int i = 0; i < PERSIST_PREFETCH; i++) {
      const int t = from + i * wph;
      if (live && t < t1) {
        const int64_t at = cache_row(t) * D + lane * 4;
        kr[i] = *reinterpret_cast<const Word*>(k_cache + at);
        vr[i] = *reinterpret_cast<const Word*>(v_cache + at);
      }
    }
  };
  if (task == (int)blockIdx.x) {  // the rows looked up at the start
#pragma unroll
    for (int i = 0; i < PERSIST_PREFETCH; i++) {
      const int64_t r = first_rows[warp * PERSIST_PREFETCH + i];
      if (r >= 0) {
        kr[i] = *reinterpret_cast<const Word*>(k_cache + r * D + lane * 4);
        vr[i] = *reinterpret_cast<const Word*>(v_cache + r * D + lane * 4);
      }
    }
  } else {
    load_batch(first);
  }
  if (o != a.skip_wait) persist_wait(a, o - 1, ops[o - 1].tasks);
  persist_trace_ahead(a, o, load, consumed);
  persist_trace(a, o, 1);
  persist_attn_new_token<F>(a, op, GQA, warp, b, g, ctx, t0, t1, cos_s, sin_s, q_s, kv_new, k_cache, v_cache,
                            kv_scale);  // step 1
  __syncthreads();
  // The partition's tokens, this warp's share, online softmax in base 2 (section 15's arithmetic).
  const float scale_log2 = a.scale * PersistKV<F>::key_factor(kv_scale) * 1.4426950408889634f;
  // Each of the warp's HPW heads keeps its own running max m, sum l and output acc; a key's HPW dot products
  // are reduced across the warp together, so their shuffles overlap.
  float m[HPW], l[HPW], acc[HPW][4], q[HPW][4];
  if (live) {
#pragma unroll
    for (int j = 0; j < HPW; j++) {
      m[j] = -INFINITY, l[j] = 0.f;
#pragma unroll
      for (int i = 0; i < 4; i++) acc[j][i] = 0.f, q[j][i] = q_s[(hg * HPW + j) * D + lane * 4 + i];
    }
    auto step = [&](int t, Word kw, Word vw) {
      float k[4], v[4];
      if (t == ctx - 1) {
        for (int i = 0; i < 4; i++) k[i] = kv_new[lane * 4 + i], v[i] = kv_new[D + lane * 4 + i];
      } else {
        PersistKV<F>::widen(kw, k);
        PersistKV<F>::widen(vw, v);
      }
      float s[HPW];
#pragma unroll
      for (int j = 0; j < HPW; j++) s[j] = q[j][0] * k[0] + q[j][1] * k[1] + q[j][2] * k[2] + q[j][3] * k[3];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1)
#pragma unroll
        for (int j = 0; j < HPW; j++) s[j] += __shfl_xor_sync(0xffffffffu, s[j], off);
#pragma unroll
      for (int j = 0; j < HPW; j++) {
        const float sj = s[j] * scale_log2;
        const float m_new = fmaxf(m[j], sj), alpha = fast_exp2(m[j] - m_new), pr = fast_exp2(sj - m_new);
        l[j] = l[j] * alpha + pr;
#pragma unroll
        for (int i = 0; i < 4; i++) acc[j][i] = acc[j][i] * alpha + pr * v[i];
        m[j] = m_new;
      }
    };
    for (int from = first; from < t1; from += PERSIST_PREFETCH * wph) {
      if (from != first) load_batch(from);
#pragma unroll
      for (int i = 0; i < PERSIST_PREFETCH; i++)
        if (from + i * wph < t1) step(from + i * wph, kr[i], vr[i]);
    }
#pragma unroll
    for (int j = 0; j < HPW; j++) {
      float* wp = wpart + (warp * HPW + j) * (D + 2);
      for (int i = 0; i < 4; i++) wp[lane * 4 + i] = acc[j][i] * PersistKV<F>::value_factor(kv_scale);
      if (lane == 0) wp[D] = m[j], wp[D + 1] = l[j];
    }
  }
  __syncthreads();
  persist_attn_combine_warps<HPW>(a, GQA, wph, parts, b, g, k.p, wpart);  // step 2
  // The last partition of (b, g) to get here merges them all (step 3).
  __syncthreads();
  if (threadIdx.x == PERSIST_SYNC_THREAD)  // release: our partial is out; acquire: so are the others'
    *flag = atom_acq_rel_add(a.tickets + ((size_t)op.layer * a.B + b) * a.NKV + g, 1) == parts - 1;
  __syncthreads();
  if (!*flag) return;
  persist_attn_merge(a, GQA, parts, b, g);
  persist_signal(a, o);
}

// ==== 26. The persistent kernel, 3: the kernel, its plan and its launch ====================================
// defines: PersistVariant, persistent_decode_kernel, PersistPlan, PersistentDecode, persist_launch, persist_fits,
//          PersistKernels, PersistFormat, kPersistBf16, PersistentState, g_persistent, PersistFp8Layer,
//          persist_setup, persistent_decode

// The kernel's variants, each its own instantiation (code one variant needs costs the others registers):
// one GPU; a rank of several (its sums over the GPUs, section 24); one GPU with FP8 weights (section 30a,
// whose staging of a product's input and whose chunk of FP8 products are declared here); one GPU with a MoE
// model (section 36, whose MoE operations are declared here).
enum PersistVariant : int { PERSIST_ONE_GPU, PERSIST_TP, PERSIST_FP8_WEIGHTS, PERSIST_MOE, PERSIST_VARIANTS };
template <int B>
__device__ void persist_stage_fp8(const PersistArgs& a, const PersistOp& op, bf16* xs, bf16* res, float* scratch,
                                  const uint4 (&nw)[NORM_MAX_CHUNKS]);
template <int B>
__device__ void persist_gemv_chunk_fp8(const PersistOp& op, int g, int kc, const bf16* slot, const bf16* xs,
                                       float (&acc)[4]);
template <int B>
__device__ void persist_moe_route(const PersistArgs& a, const PersistOp* ops, int o, PersistRoute* route);
__device__ void persist_moe_refill(const PersistArgs& a, const PersistOp* ops, PersistCursor& load,
                                   unsigned consumed, bf16* ring, const PersistRoute* route);
template <int B>
__device__ void persist_stage_moe_down(const PersistArgs& a, const PersistOp& op, bf16* xs, bf16* res);
__device__ __forceinline__ void persist_moe_down_chunk(const PersistOp& op, int g, int kc, const bf16* slot,
                                                       const bf16* xs, float* ex, float (&acc)[4]);
template <int B>
__device__ void persist_moe_epilogue(const PersistArgs& a, const PersistOp& op, int g, int parity, float (&acc)[4],
                                     float* red, const bf16* res, const PersistRoute* route);
__host__ __device__ size_t persist_route_bytes();
__device__ void persist_route_start(PersistRoute* route);

// F: the cache format (section 15a; one kernel per format: another's attention would cost this one registers).
// V: the variant.
template <int B, class F, int V>
__global__ void __launch_bounds__(PERSIST_THREADS, 1) persistent_decode_kernel(PersistArgs a) {
  constexpr bool TP = V == PERSIST_TP, W8 = V == PERSIST_FP8_WEIGHTS, MOE = V == PERSIST_MOE;
  extern __shared__ __align__(16) unsigned char persist_smem[];
  bf16* ring = reinterpret_cast<bf16*>(persist_smem);                      // [RING, SLOT_ELEMS]
  float* red = reinterpret_cast<float*>(ring + PERSIST_RING * PERSIST_SLOT_ELEMS);  // [2, WARPS, 16, 8]
  float* scratch = red + 2 * PERSIST_WARPS * PERSIST_ROWS * 8;             // [B, 32] the RMSNorm's sums
  float* angles = scratch + B * 32;                                        // [B, HEAD_DIM] RoPE's, per sequence
  int64_t* first_rows = reinterpret_cast<int64_t*>(angles + B * HEAD_DIM);  // [WARPS, PREFETCH] attention's
  PersistOp* ops = reinterpret_cast<PersistOp*>(first_rows + PERSIST_WARPS * PERSIST_PREFETCH);  // the list
  unsigned char* after_ops = reinterpret_cast<unsigned char*>(ops) + persist_ops_bytes(a.n_ops);
  PersistRoute* route = MOE ? reinterpret_cast<PersistRoute*>(after_ops) : nullptr;  // section 36's
  float* work = reinterpret_cast<float*>(after_ops + (MOE ? persist_route_bytes() : 0));
  bf16* xs = reinterpret_cast<bf16*>(work);  // a gemv's input [B, Kmax + 8], or attention's buffers
  bf16* res = xs + B * (a.Kmax + 8);           // O, DOWN: the residual stream [B, H]
  for (int i = threadIdx.x; i < a.n_ops * (int)sizeof(PersistOp) / 4; i += PERSIST_THREADS)
    reinterpret_cast<int*>(ops)[i] = reinterpret_cast<const int*>(a.ops)[i];
  for (int b = 0; b < B; b++) rope_angles(angles + b * HEAD_DIM, angles + b * HEAD_DIM + HEAD_DIM / 2,
                                          a.positions[b], a.inv_freq);
  if ((int)blockIdx.x < B * a.NKV * a.parts) persist_first_rows(a, first_rows);
  const uint64_t calls = TP ? a.epochs[0] : 0;  // all-reduces made before this step (section 20's counter)
  if constexpr (MOE) persist_route_start(route);
  __syncthreads();
  // Fill the ring: chunks 0 .. RING-2 of this block's order (each warp its own strips).
  PersistCursor load = persist_cursor_start();
  for (int s = 0; s < PERSIST_RING - 1; s++) persist_issue<MOE>(a, ops, load, ring + s * PERSIST_SLOT_ELEMS, route);
  unsigned consumed = 0;  // chunks used so far (RING is a power of 2: the slot is consumed % RING)
  for (int o = 0; o < a.n_ops; o++) {
    const PersistOp& op = ops[o];  // in shared memory
    persist_skew(a, o);
    persist_trace(a, o, 0);
    if (op.kind == PERSIST_EMBED) {
      if (blockIdx.x == 0) {
        for (int c = threadIdx.x; c < B * a.H / 8; c += PERSIST_THREADS) {
          const int b = c / (a.H / 8), i = c % (a.H / 8), id = a.ids[b] - (TP ? a.vocab_offset : 0);
          const bool ok = id >= 0 && id < a.V;  // at TP > 1, this rank's part of the vocabulary
          reinterpret_cast<uint4*>(a.residual)[c] =
              ok ? reinterpret_cast<const uint4*>(a.embed + (size_t)id * a.H)[i] : make_uint4(0, 0, 0, 0);
        }
        persist_signal(a, o);
      }
      continue;
    }
    if constexpr (TP) {
      if (op.kind == PERSIST_ALLREDUCE) {
        if ((int)blockIdx.x < op.groups) {
          persist_wait(a, o - 1, ops[o - 1].tasks);
          persist_all_reduce<B>(a, op, calls);
          persist_signal(a, o);
        }
        continue;
      }
    }
    if (op.kind == PERSIST_ATTN) {
      const int hpw = persist_attn_split(a.NH / a.NKV).hpw;
      for (int task = blockIdx.x; task < B * a.NKV * a.parts; task += gridDim.x) {
        if (hpw == 4) persist_attention<F, 4>(a, ops, op, o, task, angles, first_rows, work, load, consumed);
        else if (hpw == 2) persist_attention<F, 2>(a, ops, op, o, task, angles, first_rows, work, load, consumed);
        else persist_attention<F, 1>(a, ops, op, o, task, angles, first_rows, work, load, consumed);
      }
      persist_trace(a, o, 2);
      continue;
    }
    if ((int)blockIdx.x >= op.groups) continue;  // no rows of this operation here: nothing to wait for
    uint4 nw[NORM_MAX_CHUNKS];
    persist_load_norm(op, nw);
    if (o != a.skip_wait) persist_wait(a, o - 1, ops[o - 1].tasks);
    persist_trace_ahead(a, o, load, consumed);
    if constexpr (MOE) {  // section 36: a MoE layer's routing, and the refill, before its experts' first chunk
      if (op.kind >= PERSIST_MOE_GATE_UP && route->layer != op.layer) {
        persist_moe_route<B>(a, ops, o, route);
        persist_moe_refill(a, ops, load, consumed, ring, route);
      }
    }
    if constexpr (W8) {
      if (op.wscale) persist_stage_fp8<B>(a, op, xs, res, scratch, nw);
      else persist_stage_input<B, TP>(a, op, xs, res, scratch, nw);
    } else if constexpr (MOE) {
      if (op.kind == PERSIST_MOE_DOWN) persist_stage_moe_down<B>(a, op, xs, res);
      else persist_stage_input<B, TP>(a, op, xs, res, scratch, nw);
    } else {
      persist_stage_input<B, TP>(a, op, xs, res, scratch, nw);
    }
    persist_trace(a, o, 1);
    const int kchunks = persist_k_chunks(op);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    int parity = 0;
    bf16* deferred = nullptr;  // the operation's last copy: issued after the signal (What limits it, above)
    for (int g = blockIdx.x; g < op.groups; g += gridDim.x, parity ^= 1) {
      for (int kc = 0; kc < kchunks; kc++) {
        // This warp's strip of chunk `consumed` has landed (its group is at most RING-2 behind the newest);
        // the strip of the chunk before, which this warp has finished with, takes the chunk RING-1 ahead.
        cp_async_wait<PERSIST_RING - 2>();
        __syncwarp();
        bf16* next = ring + (consumed + PERSIST_RING - 1) % PERSIST_RING * PERSIST_SLOT_ELEMS;
        if (g + (int)gridDim.x >= op.groups && kc == kchunks - 1) deferred = next;
        else persist_issue<MOE>(a, ops, load, next, route);
        const bf16* slot = ring + consumed % PERSIST_RING * PERSIST_SLOT_ELEMS;
        if constexpr (W8) {
          if (op.wscale) persist_gemv_chunk_fp8<B>(op, g, kc, slot, xs, acc);
          else persist_gemv_chunk<B>(op, kc, slot, xs, acc);
        } else if constexpr (MOE) {
          if (op.kind == PERSIST_MOE_DOWN)
            persist_moe_down_chunk(op, g, kc, slot, xs, red + parity * PERSIST_WARPS * PERSIST_ROWS * 8, acc);
          else persist_gemv_chunk<B>(op, kc, slot, xs, acc);
        } else {
          persist_gemv_chunk<B>(op, kc, slot, xs, acc);
        }
        consumed++;
      }
      if constexpr (MOE) {
        if (op.kind >= PERSIST_ROUTER) {
          persist_moe_epilogue<B>(a, op, g, parity, acc, red, res, route);
          continue;
        }
      }
      persist_gemv_epilogue<B, TP>(a, op, g, parity, acc, red, res);
    }
    persist_trace(a, o, 3);
    persist_signal(a, o);
    persist_issue<MOE>(a, ops, load, deferred, route);
    persist_trace(a, o, 2);
  }
  cp_async_wait<0>();
  if constexpr (TP) {  // the last block to finish stores the call count (every block has read it by then)
    if (threadIdx.x == 0 && atom_acq_rel_add(a.finished, 1) == (int)gridDim.x - 1) {
      const uint64_t count = calls + (uint64_t)a.n_calls;
      for (int j = 0; j < AR_MAX_BLOCKS; j++) a.epochs[j] = count;
    }
  }
}

// The plan: built once per batch size at start-up.
// The operation list, the split of every operation over the thread blocks, and the buffers the kernel
// synchronises through. A decode step then costs one memset (the counters) and one launch, both captured
// in the step's CUDA graph; the host does nothing per step beyond Part I's input upload.
struct PersistFormat;
struct PersistPlan {
  int B = 0, grid = 0, parts = 0;  // parts: attention's partitions of each (sequence, KV head)
  int Kmax = 0;                    // the longest input of a gemv (the staged input's row in shared memory)
  int tp = 1, calls = 0;           // the GPUs, and the all-reduces of a step (ALLREDUCE operations)
  int variant = PERSIST_ONE_GPU;   // the kernel it launches
  const PersistFormat* format = nullptr;  // the cache format it reads, the engine's (fixed for a run)
  size_t smem = 0;
  std::vector<PersistOp> ops;
  PersistOp* ops_d = nullptr;
  int* sync_d = nullptr;  // done [ops], tickets [L, B, NKV], then (TP > 1) finished [1]: one memset clears all
  size_t sync_bytes = 0;
  float* partials_d = nullptr;
};

// One measurement of a decode step both ways (persist_measure): microseconds per step at `context` keys.
struct PersistTimes {
  int context;
  double fused, kernel;  // section 14's path, the kernel
};
struct PersistentDecode {
  std::map<int, PersistPlan> plans;  // by batch size
  std::string off_reason;            // why there are none (for the start-up line)
  std::set<int> route;               // the batch sizes that run their plan (persist_measure)
  std::map<int, int> context_limit;  // B -> the longest context it runs its plan at (none: every context)
  std::map<int, std::vector<PersistTimes>> timed;  // B -> what persist_measure measured
  std::string cache_file;            // where the times came from, when they were not measured in this run
  // The longest context at which a step of B sequences runs the kernel (0: never).
  int limit_for(int B) const {
    if (!g_opt.persistent || !route.count(B) || !plans.count(B)) return 0;
    auto it = context_limit.find(B);
    return it == context_limit.end() ? INT_MAX : it->second;
  }
  // The plan a decode step of B sequences, the longest of max_context keys, runs, or null: section 14's path.
  const PersistPlan* plan_for(int B, int max_context) const {
    return max_context <= limit_for(B) ? &plans.at(B) : nullptr;
  }
};

// Shared memory: the ring, the epilogue's per-warp sums (two buffers), a reduction scratch, RoPE's angles,
// attention's first cache rows, the operation list, then the larger of a gemv's staged input [B, Kmax + 8] and
// residual [B, H], and attention's buffers (queries, the new key and value, per-warp partials).
// (MoE: section 36's routing after the list.)
static size_t persist_smem_bytes(int B, int Kmax, int H, int gqa, int n_ops, bool moe = false) {
  const int hpw = persist_attn_split(gqa).hpw;  // attention's per-warp partials: one per head it carries
  const size_t attn = (size_t)(gqa * HEAD_DIM + 2 * HEAD_DIM + PERSIST_WARPS * hpw * (HEAD_DIM + 2)) * 4 + 16;
  return (size_t)PERSIST_RING * PERSIST_SLOT_ELEMS * sizeof(bf16) + 2 * PERSIST_WARPS * PERSIST_ROWS * 8 * 4 +
         (size_t)B * (32 + HEAD_DIM) * 4 + PERSIST_WARPS * PERSIST_PREFETCH * 8 + persist_ops_bytes(n_ops) +
         (moe ? persist_route_bytes() : 0) + std::max((size_t)B * (Kmax + 8 + H) * sizeof(bf16), attn);
}

// Variant V's kernel of cache format F for the plan's batch size.
template <class F, int V>
static void persist_launch(const PersistPlan& plan, const PersistArgs& a, cudaStream_t s) {
  switch (plan.B) {
    case 1: persistent_decode_kernel<1, F, V><<<plan.grid, PERSIST_THREADS, plan.smem, s>>>(a); break;
    case 2: persistent_decode_kernel<2, F, V><<<plan.grid, PERSIST_THREADS, plan.smem, s>>>(a); break;
    case 4: persistent_decode_kernel<4, F, V><<<plan.grid, PERSIST_THREADS, plan.smem, s>>>(a); break;
    default: INTERNAL_CHECK(false, "no persistent decode kernel for batch %d", plan.B);
  }
}
template <int B, class F, int V>
static bool persist_kernel_fits(size_t smem) {
  const auto kernel = persistent_decode_kernel<B, F, V>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  int blocks = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, PERSIST_THREADS, smem));
  return blocks >= 1;
}
// Whether batch B's kernel for cache format F fits on this GPU with smem bytes of shared memory (and sets its
// limit to that).
template <class F, int V>
static bool persist_fits(int B, size_t smem) {
  switch (B) {
    case 1: return persist_kernel_fits<1, F, V>(smem);
    case 2: return persist_kernel_fits<2, F, V>(smem);
    case 4: return persist_kernel_fits<4, F, V>(smem);
  }
  return false;
}
// A variant's kernels for one cache format: whether batch B's fits, and its launch (null: no such kernel).
struct PersistKernels {
  bool (*fits)(int B, size_t smem);
  void (*launch)(const PersistPlan& plan, const PersistArgs& a, cudaStream_t s);
};
template <class F, int V>
constexpr PersistKernels persist_kernels() { return {persist_fits<F, V>, persist_launch<F, V>}; }

// The cache format the plans read: its kernels and, per layer, its scales. bf16 is Part I's, and the plans
// read it unless the engine's cache format names another in g_persistent (below).
struct PersistFormat {
  const char* name;  // as the measurement's cache key spells it
  int value_bytes;   // bytes per cached value (KVCache::value_bytes)
  void (*layer_scales)(int layer, float (&kv_scale)[2]);  // PersistOp::kv_scale of layer's ATTN; null: 1, 1
  // By PersistVariant. A variant without kernels for this format keeps such an engine on section 14's path.
  PersistKernels kernels[PERSIST_VARIANTS];
};
static const PersistFormat kPersistBf16 = {
    "bf16", 2, nullptr,
    {persist_kernels<KVBf16, PERSIST_ONE_GPU>(), persist_kernels<KVBf16, PERSIST_TP>(),
     persist_kernels<KVBf16, PERSIST_FP8_WEIGHTS>(), persist_kernels<KVBf16, PERSIST_MOE>()}};

// This chapter's state, for the engine built last; its apply (section 27) resets it for every engine. The
// format its plans read is bf16 unless the engine's KV cache format names its own (a format's apply, section
// 2, runs after the switches' and before the plans are built, at model_ready). The plans' device buffers are
// not freed on reset: an engine frees none of its GPU memory (section 11).
// A MoE model's layers are section 36's to plan (its switch sets moe_problem and moe_ops; unset, a MoE model
// keeps section 14's path): moe_problem says why a model's MoE layers cannot run in the kernel ("" if they can),
// moe_ops appends MoE layer l's operations after its attention (and returns the largest input they stage).
struct PersistentState {
  const PersistFormat* format = &kPersistBf16;
  std::unique_ptr<PersistentDecode> decode;  // the plans (persist_model_ready); null: none built
  std::map<int, cudaGraphExec_t> graphs;     // by batch size: the engine's CUDA graphs of the kernel's step
  std::string (*moe_problem)(const Qwen3& model, bool fp8) = nullptr;
  int (*moe_ops)(const Qwen3& model, int layer, int B, int sms, std::vector<PersistOp>& ops) = nullptr;
  void reset() {
    for (auto& [B, exec] : graphs) CUDA_CHECK(cudaGraphExecDestroy(exec));
    graphs.clear();
    decode.reset();
    format = &kPersistBf16;
    moe_problem = nullptr, moe_ops = nullptr;
  }
};
static PersistentState g_persistent;

// Layer l's four matrices (qkv, o, gate_up, down) with FP8 weights, as section 30a gives them to the kernel: W
// (e4m3 bytes), and their scales and scale row length (PersistOp::wscale, wld).
struct PersistFp8Layer {
  const void* w[4];
  const float* scale[4];
  int ld[4];
};
using PersistFp8Source = PersistFp8Layer (*)(int layer);

// The plans for the decode graphs' batch sizes up to PERSIST_MAX_B (and max_num_seqs), or a reason for none.
// fp8: where the model's four matrices of each layer are FP8 (section 30a), where they are; null: bf16.
static PersistentDecode persist_setup(Qwen3& model, int max_num_seqs, PersistFp8Source fp8 = nullptr) {
  PersistentDecode pd;
  const ModelConfig& c = model.cfg;
  const int tp = model.tp, H = c.hidden_size, I = c.intermediate_size / tp, D = c.head_dim;
  const int L = c.num_hidden_layers, NH = c.num_attention_heads / tp, NKV = c.num_key_value_heads / tp;
  const int V = (int)cdiv(c.vocab_size, tp);  // this rank's shard of each (section 12)
  const bool moe = c.num_experts > 0;
  if (moe && !g_persistent.moe_ops)
    return pd.off_reason = "a MoE model keeps section 14's path (persistent_moe off: no expert operations)", pd;
  if (moe) {
    const std::string problem = g_persistent.moe_problem(model, fp8 != nullptr);
    if (!problem.empty()) return pd.off_reason = problem, pd;
  }
  if (tp > 1 && !(model.comm && model.comm->fast && g_opt.oneshot_allreduce))
    return pd.off_reason = "tensor parallelism without section 20's one-shot all-reduce (oneshot_allreduce off, or "
                           "GPUs that cannot reach each other's memory) keeps section 14's path", pd;
  if (tp > 1 && fp8) return pd.off_reason = "FP8 weights at tensor parallelism keep section 14's path", pd;
  const int variant = moe ? PERSIST_MOE : fp8 ? PERSIST_FP8_WEIGHTS : tp > 1 ? PERSIST_TP : PERSIST_ONE_GPU;
  const PersistKernels kernels = g_persistent.format->kernels[variant];
  if (!kernels.launch)
    return pd.off_reason = std::string(moe ? "a MoE model" : tp > 1 ? "tensor parallelism" : "FP8 weights") +
                           " with the " + g_persistent.format->name +
                           " cache keeps section 14's path (no kernel for it)", pd;
  // The sums over the GPUs (section 24): after the embedding and after each layer's O and DOWN; none where
  // NANOVLLM_ALLREDUCE=skip leaves every all-reduce out (timing only).
  const bool sums = tp > 1 && !model.comm->skip;
  const int calls = sums ? 2 * L + 1 : 0;
  const int sms = gpu_sm_count();
  if (gpu_cc_major() < 8) return pd.off_reason = "needs sm_80 (cp.async)", pd;
  const int gqa = NH / NKV;
  if (NH % NKV || gqa > PERSIST_WARPS) return pd.off_reason = "needs at most 16 query heads per KV head", pd;
  if (H > PERSIST_THREADS * NORM_MAX_CHUNKS * 8) return pd.off_reason = "hidden size above its RMSNorm's", pd;
  int dense_layers = L;  // (a MoE layer is 6 operations: qkv, attention, o, and section 36's three)
  if (moe) dense_layers -= c.num_moe_layers();
  const int n_ops = 2 + 5 * L + (L - dense_layers) + calls;
  for (int B = 1; B <= std::min(PERSIST_MAX_B, max_num_seqs); B *= 2) {
    PersistPlan p;
    int Kmax = std::max({H, NH * D, dense_layers ? I : 0});
    std::vector<PersistOp> probe;  // (section 36's operations, for the largest input they stage)
    for (int l = 0; moe && l < L; l++)
      if (c.is_moe_layer(l)) Kmax = std::max(Kmax, g_persistent.moe_ops(model, l, B, sms, probe));
    p.B = B, p.grid = sms, p.Kmax = Kmax, p.smem = persist_smem_bytes(B, Kmax, H, gqa, n_ops, moe);
    p.tp = tp, p.calls = calls, p.variant = variant;
    p.format = g_persistent.format;
    if (!kernels.fits(B, p.smem)) continue;
    p.parts = std::max(1, std::min(64, sms / (B * NKV)));
    // m: which of the layer's four matrices, for FP8 weights (-1: the LM head, always bf16).
    auto gemv_op = [&](int kind, int layer, const bf16* W, const bf16* norm_w, int N, int K, int m = -1) {
      PersistOp op = {kind, layer, W, norm_w, nullptr, N, K, 0, 0};
      if (fp8 && m >= 0) {
        const PersistFp8Layer f = fp8(layer);
        op.W = (const bf16*)f.w[m], op.wscale = f.scale[m], op.wld = f.ld[m];
      }
      const bool pairs = kind == PERSIST_GATE_UP;
      op.groups = (int)cdiv(N, pairs ? PERSIST_ROWS / 2 : PERSIST_ROWS);
      op.tasks = std::min(op.groups, sms);
      p.ops.push_back(op);
    };
    int call = 0;
    auto all_reduce_op = [&](int add) {  // the next sum over the GPUs (K = add: see PersistOp)
      if (!sums) return;
      const int blocks = (int)cdiv((int64_t)B * H / 8, PERSIST_THREADS);
      p.ops.push_back({PERSIST_ALLREDUCE, call++, nullptr, nullptr, nullptr, H, add, blocks, blocks});
    };
    p.ops.push_back({PERSIST_EMBED, 0, nullptr, nullptr, nullptr, 0, 0, 0, 1});
    all_reduce_op(0);
    for (int l = 0; l < L; l++) {
      const LayerWeights& lw = model.w.layers[l];
      gemv_op(PERSIST_QKV, l, lw.qkv_proj, lw.input_layernorm, (NH + 2 * NKV) * D, H, 0);
      PersistOp attn = {PERSIST_ATTN, l, nullptr, lw.q_norm, lw.k_norm, 0, 0, 0, B * NKV};
      if (p.format->layer_scales) p.format->layer_scales(l, attn.kv_scale);
      p.ops.push_back(attn);
      gemv_op(PERSIST_O, l, lw.o_proj, nullptr, H, NH * D, 1);
      all_reduce_op(1);
      if (moe && c.is_moe_layer(l)) {
        g_persistent.moe_ops(model, l, B, sms, p.ops);
      } else {
        gemv_op(PERSIST_GATE_UP, l, lw.gate_up_proj, lw.post_attention_layernorm, I, H, 2);
        gemv_op(PERSIST_DOWN, l, lw.down_proj, nullptr, H, I, 3);
      }
      all_reduce_op(1);
    }
    gemv_op(PERSIST_LM_HEAD, L, model.w.lm_head, model.w.norm, V, H);
    INTERNAL_CHECK(call == calls && (int)p.ops.size() == n_ops, "persistent plan: %d all-reduces, %d expected; %zu "
                   "operations, %d expected", call, calls, p.ops.size(), n_ops);
    CUDA_CHECK(cudaMalloc(&p.ops_d, p.ops.size() * sizeof(PersistOp)));
    CUDA_CHECK(cudaMemcpy(p.ops_d, p.ops.data(), p.ops.size() * sizeof(PersistOp), cudaMemcpyHostToDevice));
    p.sync_bytes = (p.ops.size() + (size_t)L * B * NKV + 1) * sizeof(int);
    CUDA_CHECK(cudaMalloc(&p.sync_d, p.sync_bytes));
    CUDA_CHECK(cudaMalloc(&p.partials_d, (size_t)B * NKV * p.parts * gqa * (D + 2) * sizeof(float)));
    pd.plans[B] = std::move(p);
  }
  if (pd.plans.empty()) pd.off_reason = "its shared memory does not fit on this GPU";
  return pd;
}

// One decode step of plan.B sequences: logits in model.act.logits, this step's keys and values in the cache,
// as forward_fast leaves them. skew_ns, skip_wait: tests only (PersistArgs).
static void persistent_decode(Qwen3& model, const PersistPlan& plan, const StepInputs& in, cudaStream_t s,
                              int skew_ns, int skip_wait, uint64_t* trace) {
  const ModelConfig& c = model.cfg;
  CUDA_CHECK(cudaMemsetAsync(plan.sync_d, 0, plan.sync_bytes, s));
  PersistArgs a = {};
  a.ops = plan.ops_d, a.n_ops = (int)plan.ops.size();
  a.done = plan.sync_d, a.tickets = plan.sync_d + plan.ops.size(), a.partials = plan.partials_d;
  a.residual = model.act.residual, a.qkv = model.act.qkv, a.attn = model.act.attn, a.act = model.act.act;
  a.logits = model.act.logits, a.embed = model.w.embed_tokens;
  a.ids = in.input_ids, a.positions = in.positions, a.slots = in.slot_mapping, a.context_lens = in.seqlens_k;
  a.block_tables = in.block_tables;
  a.kv = model.kv.base, a.layer_stride = model.kv.layer_stride, a.kv_stride = model.kv.kv_stride;
  INTERNAL_CHECK(model.kv.value_bytes == plan.format->value_bytes, "the cache's format changed after the plan");
  const int tp = plan.tp;  // this rank's shard of the heads, the intermediate columns and the vocabulary
  a.B = plan.B, a.H = c.hidden_size, a.NH = c.num_attention_heads / tp, a.NKV = c.num_key_value_heads / tp;
  a.I = c.intermediate_size / tp, a.V = (int)cdiv(c.vocab_size, tp), a.P = model.P, a.MB = model.MB;
  a.parts = plan.parts, a.Kmax = plan.Kmax;
  a.eps = c.rms_norm_eps, a.scale = 1.0f / sqrtf((float)c.head_dim), a.inv_freq = rope_inv_freq(c.rope_theta);
  a.skew_ns = skew_ns, a.skip_wait = skip_wait, a.trace = trace;
  a.rank = model.rank, a.tp = tp, a.vocab_offset = model.rank * a.V, a.n_calls = plan.calls;
  a.finished = plan.sync_d + plan.ops.size() + (size_t)c.num_hidden_layers * plan.B * a.NKV;
  if (plan.variant == PERSIST_MOE) {
    a.router_logits = model.act.router_logits, a.moe_act = model.act.moe_act, a.topk_ids = model.act.topk_ids;
    a.E = c.num_experts, a.topk = c.num_experts_per_tok, a.norm_topk = c.norm_topk_prob;
  }
  if (tp > 1) {
    const OneShot* os = (const OneShot*)model.comm->fast;
    a.hidden = model.act.hidden, a.peers = os->peers, a.epochs = os->epochs;
    a.ar_half = ar_half_chunks(tp), a.ar_slot = ar_oneshot_slot_chunks(tp);
  }
  plan.format->kernels[plan.variant].launch(plan, a, s);
  CUDA_CHECK(cudaGetLastError());
}

// ==== 27. The persistent kernel, 4: which steps take it, measured at start-up and remembered ===============
// defines: persist_measure, persist_context_limit, persist_route, persist_cache_read, persist_cache_write,
//          persist_describe, persist_ready; switch persistent

// Which steps take the kernel: measured once at start-up, on this GPU and this model, because the answer
// depends on both (how many layers, how wide, how many SMs), on the batch size and on the context. The kernel
// wins where a step is mostly weights; its attention, a share of 132 thread blocks that wait for qkv, reads
// the cache more slowly than section 16's kernels, which have the whole GPU to themselves, so the longer the
// contexts the less it wins, and past some length it loses (docs/performance.md). For each batch size
// with a plan, a decode step of B sequences of the same context (the cache's first blocks; slot -1, so nothing
// is stored) runs both ways, each captured in a CUDA graph as the engine runs it (5 replays to warm up, 20
// timed), at PERSIST_MEASURE_SHORT keys and at PERSIST_MEASURE_LONG (or max_model_len - 1 if shorter). A
// step's time grows about linearly with its contexts on either path (the cache bytes it reads), so the two
// measurements give a line for each, and the kernel takes the steps of B sequences whose longest context is at
// most where the kernel's line meets section 14's less PERSIST_ROUTE_MARGIN (persist_context_limit); past it,
// and at batch sizes where the kernel does not win at the shorter context, section 14's path runs. The two
// paths add their sums in different orders, so their logits differ in the last bits: the margin keeps a step
// whose two times are close on section 14's path, rather than on whichever won this run's measurement. A
// batch size the kernel takes has two CUDA graphs, the runner's of section 14's path and this section's of the
// kernel (the switch, below), and each step replays the one its longest context picks.
// NANOVLLM_PERSISTENT=always skips the measurement and routes every step of a batch size with a plan to the
// kernel, whatever its contexts (the tests that check it inside the engine); NANOVLLM_PERSISTENT=upto:N the
// steps whose longest context is at most N keys (the tests of the switch between the two graphs).
constexpr double PERSIST_ROUTE_MARGIN = 0.02;
constexpr int PERSIST_MEASURE_SHORT = 512, PERSIST_MEASURE_LONG = 4096;  // contexts measured (keys)
// The longest context at which the kernel is still PERSIST_ROUTE_MARGIN faster than section 14's path, from the
// two measurements a (the shorter context) and b: 0 if it is not faster at a; INT_MAX if its lead does not
// shrink from a to b (or a is the only measurement); else where the lead, a straight line through a and b,
// reaches 0 (past b too, if it is still positive there).
static int persist_context_limit(const PersistTimes& a, const PersistTimes* b, double margin) {
  const double lead_a = (1.0 - margin) * a.fused - a.kernel;  // microseconds the kernel wins by, less the margin
  if (lead_a <= 0) return 0;
  if (!b) return INT_MAX;
  const double lead_b = (1.0 - margin) * b->fused - b->kernel;
  if (lead_b >= lead_a) return INT_MAX;
  const double at = a.context + lead_a / (lead_a - lead_b) * (b->context - a.context);
  return at >= (double)INT_MAX ? INT_MAX : (int)at;
}
// Microseconds per replay of `step` captured in a CUDA graph (warm replays first, then `timed` timed).
template <typename Step>
static double persist_time_graph(Step step, cudaStream_t s, int warm = 5, int timed = 20) {
  step();  // once outside the capture (cuBLASLt's algorithm choice, the kernels' attributes)
  CUDA_CHECK(cudaStreamSynchronize(s));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  step();
  CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < warm; i++) CUDA_CHECK(cudaGraphLaunch(exec, s));
  CUDA_CHECK(cudaEventRecord(e0, s));
  for (int i = 0; i < timed; i++) CUDA_CHECK(cudaGraphLaunch(exec, s));
  CUDA_CHECK(cudaEventRecord(e1, s));
  CUDA_CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  return ms * 1000.0 / timed;
}
// The contexts persist_measure times for batch size B, and how it routes from the times (pd.timed[B]): a
// batch size whose kernel does not win at the shorter context keeps section 14's path; else it takes the
// kernel up to persist_context_limit. `longest`: the longest context a step can have (max_model_len - 1).
static int persist_short_context(int longest) { return std::max(1, std::min(PERSIST_MEASURE_SHORT, longest)); }
static int persist_long_context(int longest) { return std::min(PERSIST_MEASURE_LONG, longest); }
static void persist_route(PersistentDecode& pd, int longest) {
  pd.route.clear(), pd.context_limit.clear();
  for (const auto& [B, t] : pd.timed) {
    if (t.empty() || !persist_context_limit(t[0], nullptr, PERSIST_ROUTE_MARGIN)) continue;
    pd.route.insert(B);
    const int limit = persist_context_limit(t[0], t.size() > 1 ? &t[1] : nullptr, PERSIST_ROUTE_MARGIN);
    if (limit < longest) pd.context_limit[B] = limit;  // (else it takes every step of B sequences)
  }
}

// ---- Remembering the measurement ----
// The measurement costs every start-up a second or so, and its answer depends only on the GPU, its driver,
// the model's shape, the engine's settings that change either path, and this build. So the times are kept in
// a file per such key in the user's cache directory, as cuBLAS's and TensorRT's timing caches are:
// $NANOVLLM_CACHE_DIR, else $XDG_CACHE_HOME/nanovllm, else ~/.cache/nanovllm (NANOVLLM_CACHE_DIR=off: none).
// The file is named by a hash of the key and holds the key in full, the times and a checksum. It is trusted
// only whole: a key that differs (a hash collision, another build), a file that does not parse, a batch size
// that is missing or extra, a context other than the ones this run would time, a time that is not finite and
// positive, or a wrong checksum, and the run measures again and rewrites the file (a temporary file renamed
// over it, so a reader never sees half of one). The build is a hash of the executable's own bytes: any
// rebuild, of any code, measures again.
static std::string persist_cache_dir() {
  const char* dir = getenv("NANOVLLM_CACHE_DIR");
  if (dir && !strcmp(dir, "off")) return "";
  if (dir && *dir) return dir;
  const char* xdg = getenv("XDG_CACHE_HOME");
  if (xdg && *xdg) return std::string(xdg) + "/nanovllm";
  const char* home = getenv("HOME");
  return home && *home ? std::string(home) + "/.cache/nanovllm" : "";
}
// XXH64 of this executable's bytes (0 if it cannot be read: then nothing is cached).
static uint64_t persist_build_hash() {
  static uint64_t hash = [] {
    FILE* f = fopen("/proc/self/exe", "rb");
    if (!f) return (uint64_t)0;
    XXH64_state_t st;
    XXH64_reset(&st, 0);
    std::vector<char> buf(1 << 20);
    size_t n;
    while ((n = fread(buf.data(), 1, buf.size(), f)) > 0) XXH64_update(&st, buf.data(), n);
    fclose(f);
    return (uint64_t)XXH64_digest(&st);
  }();
  return hash;
}
// Everything the two paths' times depend on, as one line.
static std::string persist_cache_key(const Qwen3& model, const PersistentDecode& pd) {
  int dev = 0, driver = 0, runtime = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  CUDA_CHECK(cudaDriverGetVersion(&driver));
  CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  const ModelConfig& c = model.cfg;
  char buf[512];
  snprintf(buf, sizeof buf,
           "gpu=%s cc=%d.%d sms=%d mem=%zu driver=%d runtime=%d build=%016llx model=%d,%d,%d,%d,%d,%d,%d,%d "
           "P=%d MB=%d max_model_len=%d kv=%s opt=%d%d%d%d%d%d%d tp=%d rank=%d",
           prop.name, prop.major, prop.minor, prop.multiProcessorCount, prop.totalGlobalMem, driver, runtime,
           (unsigned long long)persist_build_hash(), c.hidden_size, c.intermediate_size, c.num_hidden_layers,
           c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size, (int)c.tie_word_embeddings,
           model.P, model.MB, model.max_model_len, g_persistent.format->name,
           g_opt.flash_attn, g_opt.pdl, g_opt.gemv, g_opt.cluster_merge, g_opt.fused_rope, g_opt.fast_sampler,
           g_opt.prefill_graphs, model.tp, model.rank);
  std::string key = buf;
  if (c.num_experts > 0)  // a MoE model: its experts' shape and the switches of section 14's MoE stages
    key += " moe=" + std::to_string(c.num_experts) + "," + std::to_string(c.num_experts_per_tok) + "," +
           std::to_string(c.moe_intermediate_size) + "," + std::to_string(c.num_moe_layers()) + "," +
           std::to_string(g_opt.fused_moe) + std::to_string(g_opt.moe_gemv);
  for (const auto& [B, p] : pd.plans)
    key += " plan=" + std::to_string(B) + ":" + std::to_string(p.grid) + ":" + std::to_string(p.smem) + ":" +
           std::to_string(p.variant);
  return key;
}
static std::string persist_cache_path(const std::string& dir, const std::string& key) {
  char name[64];
  snprintf(name, sizeof name, "/persistent-%016llx.json", (unsigned long long)XXH64(key.data(), key.size(), 0));
  return dir + name;
}
// The checksum of a file's key and times (its "times" as text, as json::dump writes them).
static uint64_t persist_cache_checksum(const std::string& key, const json& times) {
  const std::string text = key + "\n" + times.dump();
  return XXH64(text.data(), text.size(), 0);
}
// pd.timed from the file of `key`, if it holds exactly what persist_measure would time; false otherwise.
static bool persist_cache_read(const std::string& path, const std::string& key, PersistentDecode& pd,
                               int longest) {
  std::ifstream f(path);
  if (!f) return false;
  std::map<int, std::vector<PersistTimes>> timed;
  try {
    const json j = json::parse(f);
    const json& times = j.at("times");
    if (j.at("key").get<std::string>() != key || !times.is_object() || times.size() != pd.plans.size() ||
        j.at("checksum").get<std::string>() != std::to_string(persist_cache_checksum(key, times)))
      return false;
    for (const auto& [B, plan] : pd.plans) {
      std::vector<PersistTimes>& t = timed[B];
      for (const json& row : times.at(std::to_string(B)))
        t.push_back({row.at(0).get<int>(), row.at(1).get<double>(), row.at(2).get<double>()});
      // The contexts persist_measure would time: the shorter one, and the longer one where the kernel won there.
      std::vector<int> want = {persist_short_context(longest)};
      if (!t.empty() && persist_context_limit(t[0], nullptr, PERSIST_ROUTE_MARGIN) && longest > want[0])
        want.push_back(persist_long_context(longest));
      if (t.size() != want.size()) return false;
      for (size_t i = 0; i < t.size(); i++)
        if (t[i].context != want[i] || !std::isfinite(t[i].fused) || !std::isfinite(t[i].kernel) ||
            t[i].fused <= 0 || t[i].kernel <= 0)
          return false;
    }
  } catch (const std::exception&) {
    return false;
  }
  pd.timed = timed;
  return true;
}
// Writes pd.timed under `key` (a failure to write costs only the next run's measurement: not an error).
static void persist_cache_write(const std::string& dir, const std::string& path, const std::string& key,
                                const PersistentDecode& pd) {
  json times = json::object();
  for (const auto& [B, t] : pd.timed) {
    json rows = json::array();
    for (const PersistTimes& x : t) rows.push_back({x.context, x.fused, x.kernel});
    times[std::to_string(B)] = rows;
  }
  const json j = {{"key", key}, {"times", times}, {"checksum", std::to_string(persist_cache_checksum(key, times))}};
  for (size_t i = 1; i <= dir.size(); i++)
    if (i == dir.size() || dir[i] == '/') mkdir(dir.substr(0, i).c_str(), 0755);
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  std::ofstream out(tmp);
  out << j.dump(1) << "\n";
  out.close();
  if (!out || rename(tmp.c_str(), path.c_str()) != 0) unlink(tmp.c_str());
}

// Routes every batch size with a plan: from NANOVLLM_PERSISTENT where it says so, else from the cached times
// where they are valid, else by timing a step of each batch size both ways (and caching the times).
static void persist_measure(Qwen3& model, PersistentDecode& pd, cudaStream_t s) {
  const char* env = getenv("NANOVLLM_PERSISTENT");
  if (env && (!strcmp(env, "always") || !strncmp(env, "upto:", 5))) {
    for (const auto& [B, p] : pd.plans) {
      pd.route.insert(B);
      if (env[0] == 'u') pd.context_limit[B] = std::max(1, atoi(env + 5));
    }
    return;
  }
  const int longest = model.max_model_len - 1;
  const std::string dir = pd.plans.empty() || !persist_build_hash() ? "" : persist_cache_dir();
  const std::string key = dir.empty() ? "" : persist_cache_key(model, pd);
  const std::string path = dir.empty() ? "" : persist_cache_path(dir, key);
  // At TP > 1 the ranks must route alike (each rank's kernel waits for the others' in its all-reduces, and
  // both paths' measurements make all-reduces): each rank reads its own file, and they use the files only if
  // every rank's is valid; a measured time is the slowest rank's (a step takes as long as its slowest GPU),
  // so every rank holds the same times and routes the same.
  auto agreed = [&](int64_t v) { return model.tp > 1 ? all_reduce_min(model.comm, v) : v; };
  if (agreed(!dir.empty() && persist_cache_read(path, key, pd, longest))) {
    pd.cache_file = path;
    return persist_route(pd, longest);
  }
  pd.timed.clear();
  auto slowest = [&](double us) { return model.tp > 1 ? -agreed(-llround(us * 1000.0)) / 1000.0 : us; };
  // One step of B sequences of ctx keys, both ways.
  auto measure = [&](int B, const PersistPlan& plan, int ctx) {
    const int per_seq = (int)cdiv(ctx, model.P);
    std::vector<int> ids(B, 0), pos(B, ctx - 1), slots(B, -1), lens(B, ctx), bt((size_t)B * model.MB, 0);
    for (int b = 0; b < B; b++)
      for (int i = 0; i < per_seq; i++) bt[(size_t)b * model.MB + i] = (int)((b * per_seq + i) % model.kv.num_blocks);
    int* d = nullptr;  // ids, positions, slots, context lengths, block tables
    const size_t n = 4 * (size_t)B + bt.size();
    CUDA_CHECK(cudaMalloc(&d, n * sizeof(int)));
    std::vector<int> all;
    for (const auto* v : {&ids, &pos, &slots, &lens, &bt}) all.insert(all.end(), v->begin(), v->end());
    CUDA_CHECK(cudaMemcpy(d, all.data(), n * sizeof(int), cudaMemcpyHostToDevice));
    const StepInputs in{d, d + B, d + 2 * B, nullptr, d + 3 * B, d + 4 * B, 1};
    const double fused = persist_time_graph([&] {
      if (g_hooks.forward) g_hooks.forward(model, in, B, B, false, s);
      else model.forward(in, B, B, false, s);
    }, s);
    const double kernel = persist_time_graph([&] { persistent_decode(model, plan, in, s, 0, -1, nullptr); }, s);
    CUDA_CHECK(cudaFree(d));
    return PersistTimes{ctx, slowest(fused), slowest(kernel)};
  };
  for (const auto& [B, plan] : pd.plans) {
    std::vector<PersistTimes>& t = pd.timed[B];
    t.push_back(measure(B, plan, persist_short_context(longest)));
    if (persist_context_limit(t[0], nullptr, PERSIST_ROUTE_MARGIN) && longest > t[0].context)
      t.push_back(measure(B, plan, persist_long_context(longest)));
  }
  persist_route(pd, longest);
  if (!dir.empty()) persist_cache_write(dir, path, key, pd);
}

static std::string persist_describe(const PersistentDecode& pd) {
  if (!g_opt.persistent) return "section 14's kernels (persistent off)";
  if (pd.plans.empty()) return "section 14's kernels (persistent: " + pd.off_reason + ")";
  std::string sizes, times;
  char buf[128];
  for (int B : pd.route) {
    sizes += (sizes.empty() ? "" : ", ") + std::to_string(B);
    if (pd.context_limit.count(B)) sizes += " up to " + std::to_string(pd.context_limit.at(B)) + " keys";
  }
  for (const auto& [B, ts] : pd.timed) {
    std::string one = "B=" + std::to_string(B);
    for (size_t i = 0; i < ts.size(); i++) {
      snprintf(buf, sizeof buf, "%s %.3f / %.3f at %d", i ? "," : "", ts[i].fused / 1e3, ts[i].kernel / 1e3,
               ts[i].context);
      one += buf;
    }
    times += (times.empty() ? "" : "; ") + one;
  }
  const PersistPlan& p = pd.plans.begin()->second;
  std::string line = sizes.empty() ? "section 14's kernels at every batch size"
                                   : "one persistent kernel at batch " + sizes + " (" + std::to_string(p.grid) +
                                         " thread blocks), section 14's kernels at the others";
  const std::string when = pd.cache_file.empty() ? "at start-up" : "earlier, from " + pd.cache_file;
  if (!times.empty())
    line += " (measured " + when + ", ms per step, section 14 / persistent at a context: " + times + ")";
  else if (!sizes.empty()) line += " (NANOVLLM_PERSISTENT, not measured)";
  return line;
}

// ---- The switch: persistent ----
// On by default. At start-up (Hooks::model_ready) the plans and the measurement; once the runner has captured
// its graphs (Hooks::graphs_captured), a CUDA graph of the kernel's step for each batch size the kernel takes,
// with the same gather and draw after it as the runner's graphs (ModelRunner::capture_decode_graph). A decode
// step (Hooks::decode_step) within its batch size's context limit replays it; every other step is left to the
// runner's graph of section 14's path. Under --enforce-eager there are no graphs: the kernel and the draw are
// launched directly.
// Its state is g_persistent (section 26).
// fp8: as persist_setup's (section 30a passes it for a model whose weights it holds in FP8).
static void persist_ready(Qwen3& model, const Config& c, PersistFp8Source fp8) {
  g_persistent.decode = std::make_unique<PersistentDecode>(persist_setup(model, c.max_num_seqs, fp8));
  PersistentDecode& pd = *g_persistent.decode;
  if (model.tp > 1) {  // a batch size has a plan on every rank or on none (persist_measure: the ranks agree)
    for (int B = 1; B <= PERSIST_MAX_B; B *= 2)
      if (!all_reduce_min(model.comm, (int64_t)pd.plans.count(B))) pd.plans.erase(B);
    if (pd.plans.empty() && pd.off_reason.empty()) pd.off_reason = "its shared memory does not fit on every GPU";
  }
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  persist_measure(model, *g_persistent.decode, s);
  CUDA_CHECK(cudaStreamDestroy(s));
}
static void persist_model_ready(Qwen3& model, const Config& c) { persist_ready(model, c, nullptr); }
static void persist_capture_graphs(ModelRunner& r) {
  for (auto it = r.graph_bs.rbegin(); it != r.graph_bs.rend(); ++it) {  // largest first, as the runner's
    const int B = *it;
    const PersistentDecode* pd = g_persistent.decode.get();
    if (!pd || !pd->limit_for(B)) continue;
    const PersistPlan& plan = pd->plans.at(B);
    g_persistent.graphs[B] = r.capture_decode_graph(B, [&](const StepInputs& in) {
      persistent_decode(r.model, plan, in, r.stream, 0, -1, nullptr);
    });
  }
}
static bool persist_decode_step(ModelRunner& r, const StepInputs& in, int B, int max_context, bool draw) {
  const PersistPlan* plan = g_persistent.decode ? g_persistent.decode->plan_for(B, max_context) : nullptr;
  if (!plan) return false;
  auto graph = g_persistent.graphs.find(B);
  if (graph != g_persistent.graphs.end()) {
    CUDA_CHECK(cudaGraphLaunch(graph->second, r.stream));
  } else {  // no graphs (--enforce-eager)
    persistent_decode(r.model, *plan, in, r.stream, 0, -1, nullptr);
    r.gather_and_draw(B, r.decode_samp.dev, draw);
  }
  return true;
}
static void apply_persistent(bool on, Hooks& h) {
  g_opt.persistent = on;
  g_persistent.reset();
  if (!on) return;
  h.model_ready.push_back(persist_model_ready);
  h.graphs_captured.push_back(persist_capture_graphs);
  h.decode_step = persist_decode_step;
}
static std::string persist_note(const Qwen3&) {
  return g_persistent.decode ? "decode: " + persist_describe(*g_persistent.decode) : "";
}
static const int kPersistentRegistered = register_optimization(
    {"persistent", "a small-batch decode step in one persistent kernel (section 24)", true, apply_persistent,
     persist_note});

// ==== 28. FP8 weights, 1: the format on the GPU, loading it, quantizing a bf16 checkpoint =================
// defines: e4m3_from_float, Fp8Matrix, Fp8Layer, Fp8Weights, g_fp8_weights, fp8_weights_shape_problem,
//          fp8_weights_problem, quantize_weight_reference, quantize_weight_kernel, quantize_weight, fp8_matrix_rows,
//          fp8_load_weights (sections 29-30: the products, the stages, the switches fp8_weights and fp8_gemv,
//          --quantization fp8)
//
// Replaces: section 6a's reading of an FP8 checkpoint (Qwen/Qwen3-*-FP8), which dequantizes every weight to
// bf16 on the way in, and then the bf16 matrix products of sections 10 and 18, which read two bytes per
// weight.
// Why it is faster: a small decode step reads every weight once, and that reading is most of its time
// (section 18). Kept as the checkpoint stores them, the layers' linear weights cost one byte each: half the
// bytes per step, and half the memory, which the KV pool gets. A large step is bound by arithmetic instead,
// and Hopper's tensor cores multiply e4m3 at twice the rate of bf16. With --quantization fp8 (vLLM's flag)
// a bf16 checkpoint is quantized the same way while loading, so a bf16 user gets the same speed.
// Switch: fp8_weights (section 30). Its measurements: docs/performance.md, FP8 weights.
//
// The format on the GPU. Section 6a's fused matrices (q|k|v and gate|up), each as
//   w      [N, K]        e4m3, row-major: the checkpoint's bytes, PyTorch's [out, in]
//   scale  [N/128, ld]   fp32: scale[i][j] multiplies block (rows 128i.., columns 128j..) of w;
//                        ld = K/128 rounded up to a multiple of 4, the stride cuBLASLt reads the scales with
// so W[r][c] = e4m3(w[r][c]) * scale[r/128][c/128], exactly as section 6a defines the checkpoint's weights.
// Fusing needs every part to start on a 128-row boundary, and a tensor-parallel slice to start on a block
// too: the q and k/v parts are whole heads of 128 rows, gate and up are I/tp rows each, and o_proj's and
// down's slices start at a multiple of NH/tp * 128 and I/tp columns. So the chapter takes a model where
// hidden_size and I/tp are multiples of 128 (every published Qwen3 at the --tp sizes its heads allow,
// except a few at --tp 8) on a Hopper GPU (cuBLASLt's 128-wide block scales are sm_90's), and stands aside
// otherwise: section 6a then dequantizes the checkpoint, and the start-up line says why. A checkpoint that
// keeps some layer linears in bf16 (modules_to_not_convert) is left to section 6a too.
//
// Where rounding happens, the whole arithmetic of an FP8 layer (sections 29-30 compute it):
//   1. the weights: once, in the checkpoint (Qwen's quantizer) or at load (quantize_weight): per 128 x 128
//      block, s_w = amax / 448 in fp32 (1 for a block of zeros) and w = e4m3(W / s_w), rounded to nearest,
//      ties to even, saturating at +-448. (A checkpoint's bf16 scales are exact in fp32.)
//   2. the activations: per token and group of 128 columns, s_x = amax / 448, x_q = e4m3(x / s_x);
//   3. the product: y[t][n] = sum over column blocks b of  s_x[t][b] * s_w[n/128][b] * (sum over the 128
//      columns k of block b of x_q[t][k] * w[n][k]), accumulated in fp32, rounded once to bf16.
// So an FP8 layer differs from the bf16 one by the weights' rounding (which the checkpoint fixed) and the
// activations' (about 2^-4 relative per value, averaging out over K): test/ref/hf_reference.py emulates
// 1-3 in PyTorch and the end-to-end test compares the engine with that. Every step size computes 1-3 (section
// 30's gemv for steps of one or two tokens too: its input comes quantized by the same kernels); only a MoE
// model's experts at steps of 1-4 tokens skip step 2 (section 35's small steps multiply the bf16 rows).

// e4m3 rounding on the CPU (to nearest, ties to even, saturating at +-448; NaN stays NaN), written from the
// format's definition (section 6a) rather than from cuda_fp8.h: what __nv_cvt_float_to_fp8(x, __NV_SATFINITE,
// __NV_E4M3) computes, which the kernels here and of the FP8 KV cache (section 31) use. Its inverse is
// e4m3_to_float (safetensors.h).
static uint8_t e4m3_from_float(float x) {
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  double a = std::fabs((double)x);
  if (a >= 448.0) return sign | 0x7e;  // satfinite: the largest finite value, 1.75 x 2^8
  // The spacing of representable values around a: 2^-9 below 2^-6 (subnormals), else 2^(e-3) in [2^e, 2^e+1).
  int e = (int)std::floor(std::log2(a));
  if (a > 0 && std::ldexp(1.0, e) > a) e--;  // log2's rounding, either way
  if (a > 0 && std::ldexp(1.0, e + 1) <= a) e++;
  const double step = a < 0x1p-6 ? 0x1p-9 : std::ldexp(1.0, e - 3);
  const double q = std::nearbyint(a / step) * step;  // the default rounding mode: ties to even
  if (q == 0) return sign;
  if (q < 0x1p-6) return sign | (uint8_t)(q / 0x1p-9);  // subnormal: exponent field 0
  int qe = (int)std::floor(std::log2(q));
  if (std::ldexp(1.0, qe) > q) qe--;
  const int mant = (int)(q / std::ldexp(1.0, qe) * 8) - 8;  // 0..7
  return sign | (uint8_t)((qe + 7) << 3) | (uint8_t)mant;
}

struct Fp8Matrix {
  uint8_t* w = nullptr;    // [N, K] e4m3
  float* scale = nullptr;  // [N/128, ld] fp32 block scales
  int N = 0, K = 0, ld = 0;
};
struct Fp8Layer {
  Fp8Matrix qkv, o, gate_up, down;  // the fused matrices of section 6a's LayerWeights, in its order
  // A MoE layer (section 10b) instead of gate_up and down: every expert's, stacked by rows as LayerWeights
  // holds them: [E 2 IE, H] and [E H, IE], expert e's rows from e 2 IE and e H on (section 35 multiplies them).
  Fp8Matrix experts_gate_up, experts_down;
};

// The chapter's state for one engine (reset by its apply, section 30).
struct Fp8Weights {
  bool held = false;               // this engine's linear weights are FP8 (else the stages pass through)
  bool quantized_at_load = false;  // by --quantization fp8
  std::string reason;              // why the chapter stands aside for an FP8 checkpoint ("" when it does not)
  std::vector<Fp8Layer> layers;
  void* arena = nullptr;           // every Fp8Matrix's bytes and scales
  uint8_t* xq = nullptr;           // [rows, Kmax] e4m3: a step's activations, quantized (section 29)
  float* xs = nullptr;             // [Kmax/128, rows] fp32: their scales
  int rows = 0, kmax = 0;          // Tmax rounded up to 4, and the widest K of the four matrices
  // The stages this chapter's replace, for an engine whose weights are bf16 (section 30).
  void (*norm_matmul_bf16)(Pass& p, bf16* y, const bf16* norm_w, const bf16* W, int N) = nullptr;
  void (*matmul_out_bf16)(Pass& p, const bf16* x, const bf16* W, int K, bool gate_up) = nullptr;
  void reset() {  // what an engine held is never freed (no engine frees its GPU memory), only forgotten
    *this = Fp8Weights{};
  }
};
static Fp8Weights g_fp8_weights;

// Why model `mc`'s linear weights cannot be held in this chapter's blocks with `tp` ranks, whatever the GPU,
// or "" when they can: its widths, and the linears a checkpoint keeps in bf16. Asks nothing of the GPU.
static std::string fp8_weights_shape_problem(const ModelConfig& mc, int tp) {
  char buf[320];
  // The widths split across ranks: the dense MLP's (where the model has dense layers) and the experts'.
  const bool dense = mc.num_moe_layers() < mc.num_hidden_layers, moe = mc.num_moe_layers() > 0;
  auto whole_blocks = [&](int n) {
    return (!dense || (mc.intermediate_size / n) % 128 == 0) && (!moe || (mc.moe_intermediate_size / n) % 128 == 0);
  };
  if (mc.hidden_size % 128 || !whole_blocks(tp)) {
    std::string works;  // the --tp sizes this model can split in whole blocks
    for (int n = 1; n <= 8 && mc.hidden_size % 128 == 0; n++)
      if (tp_shard_problem(mc, n).empty() && whole_blocks(n)) works += (works.empty() ? "" : ", ") + std::to_string(n);
    std::string widths = dense ? "intermediate_size / tp = " + std::to_string(mc.intermediate_size / tp) : "";
    if (moe)
      widths += (dense ? ", " : "") + std::string("moe_intermediate_size / tp = ") +
                std::to_string(mc.moe_intermediate_size / tp);
    snprintf(buf, sizeof buf, "hidden_size %d and %s must be multiples of 128 for 128 x 128 blocks to fuse and "
             "split%s%s", mc.hidden_size, widths.c_str(),
             works.empty() ? "" : "; it splits so at --tensor-parallel-size ", works.c_str());
    return buf;
  }
  if (mc.block_quantized)  // a checkpoint that keeps a layer linear in bf16 (modules_to_not_convert)
    for (const TensorSpec& t : checkpoint_tensors(mc))
      if (t.shape.size() == 2 && t.stored == Stored::plain && t.name.rfind("model.layers.", 0) == 0 &&
          t.name.find(".mlp.gate.weight") == std::string::npos)  // (a MoE router is never quantized: section 6a)
        return "modules_to_not_convert keeps " + t.name + " in bf16";
  return "";
}
// Why this chapter cannot hold model `mc`'s linear weights on this GPU with `tp` ranks, or "" when it can: the
// switches, then the GPU and cuBLASLt, then the shape rules above.
static std::string fp8_weights_problem(const ModelConfig& mc, int tp) {
  if (mc.num_experts > 0 && !g_opt.fp8_moe)
    return "a MoE model's experts are multiplied in FP8 by section 35 (switch fp8_moe), which this run switches off";
  const int major = gpu_cc_major();
  if (major != 9) {
    char buf[160];
    snprintf(buf, sizeof buf, "cuBLASLt's block-scaled FP8 products need a Hopper GPU (sm_90), this one is sm_%d0",
             major);
    return buf;
  }
#if CUBLAS_VERSION < 120900
  return "cuBLASLt before 12.9 has no block-scaled FP8 products";
#endif
  return fp8_weights_shape_problem(mc, tp);
}

// What quantize_weight_kernel computes, on the CPU: block (bi, bj) of a bf16 weight w [N, K] (N, K multiples
// of 128) quantized into q (the same layout, e4m3 bytes); returns the block's scale.
static float quantize_weight_reference(uint8_t* q, const bf16* w, int K, int bi, int bj) {
  float amax = 0.f;
  for (int r = bi * 128; r < bi * 128 + 128; r++)
    for (int c = bj * 128; c < bj * 128 + 128; c++) amax = std::max(amax, std::fabs(__bfloat162float(w[(size_t)r * K + c])));
  const float s = amax > 0.f ? amax / 448.f : 1.f;
  for (int r = bi * 128; r < bi * 128 + 128; r++)
    for (int c = bj * 128; c < bj * 128 + 128; c++)
      q[(size_t)r * K + c] = e4m3_from_float(__bfloat162float(w[(size_t)r * K + c]) / s);
  return s;
}

// quantize_weight_kernel — q = e4m3(w / s_w), s_w = amax / 448 per 128 x 128 block (step 1 above).
//   w bf16 [N, K] row-major; q e4m3 [N, K]; scale fp32 [N/128, ld]. N, K multiples of 128.
//   One thread block of 256 threads per 128 x 128 block (grid K/128 x N/128): thread t owns row t/2 of the
//   block, columns 64 * (t % 2) .. +64, as eight 16-byte loads kept in registers across both passes: the
//   block's amax (a warp reduction, then one across the eight warps), then the division and the rounding.
//   It runs once per weight, at load.
__global__ void __launch_bounds__(256) quantize_weight_kernel(uint8_t* __restrict__ q, float* __restrict__ scale,
                                                              const bf16* __restrict__ w, int K, int ld) {
  __shared__ float warp_max[8];
  const int bi = blockIdx.y, bj = blockIdx.x, t = threadIdx.x;
  const size_t at = (size_t)(bi * 128 + t / 2) * K + bj * 128 + 64 * (t % 2);
  uint4 v[8];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; i++) {
    v[i] = reinterpret_cast<const uint4*>(w + at)[i];
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v[i]);
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const float2 f = __bfloat1622float2(h[j]);
      amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  if (t % 32 == 0) warp_max[t / 32] = amax;
  __syncthreads();
  amax = warp_max[0];
#pragma unroll
  for (int i = 1; i < 8; i++) amax = fmaxf(amax, warp_max[i]);
  const float s = amax > 0.f ? amax / 448.f : 1.f;
  if (t == 0) scale[(size_t)bi * ld + bj] = s;
  uint32_t out[16];
#pragma unroll
  for (int i = 0; i < 8; i++) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v[i]);
    uint32_t packed[2];
#pragma unroll
    for (int j = 0; j < 2; j++) {
      const float2 a = __bfloat1622float2(h[2 * j]), b = __bfloat1622float2(h[2 * j + 1]);
      const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a.x / s, a.y / s), __NV_SATFINITE, __NV_E4M3);
      const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(b.x / s, b.y / s), __NV_SATFINITE, __NV_E4M3);
      packed[j] = lo | hi << 16;
    }
    out[2 * i] = packed[0], out[2 * i + 1] = packed[1];
  }
#pragma unroll
  for (int i = 0; i < 4; i++)
    reinterpret_cast<uint4*>(q + at)[i] = make_uint4(out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]);
}
static void quantize_weight(const Fp8Matrix& m, const bf16* w, cudaStream_t stream) {
  INTERNAL_CHECK(m.N % 128 == 0 && m.K % 128 == 0 && m.ld >= m.K / 128, "quantize_weight: %d x %d, ld %d", m.N,
                 m.K, m.ld);
  check_aligned16("quantize_weight", "w", w);
  if (m.N == 0) return;
  CUDA_CHECK(cudaMemsetAsync(m.scale, 0, (size_t)m.N / 128 * m.ld * sizeof(float), stream));  // ld's padding
  quantize_weight_kernel<<<dim3(m.K / 128, m.N / 128), 256, 0, stream>>>(m.w, m.scale, w, m.K, m.ld);
  CUDA_CHECK(cudaGetLastError());
}

// Rows [r0, r0+nr) of an FP8 matrix as fp32 values on the host (e4m3 * scale): for code that reads weight
// values at start-up (the FP8 KV cache's scale bounds, section 31).
static std::vector<float> fp8_matrix_rows(const Fp8Matrix& m, int64_t r0, int64_t nr) {
  std::vector<uint8_t> q((size_t)nr * m.K);
  std::vector<float> s((size_t)m.N / 128 * m.ld), out((size_t)nr * m.K);
  CUDA_CHECK(cudaMemcpy(q.data(), m.w + r0 * m.K, q.size(), cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(s.data(), m.scale, s.size() * sizeof(float), cudaMemcpyDeviceToHost));
  for (int64_t i = 0; i < nr; i++)
    for (int64_t c = 0; c < m.K; c++)
      out[i * m.K + c] = e4m3_to_float(q[i * m.K + c]) * s[(r0 + i) / 128 * m.ld + c / 128];
  return out;
}

// ---- Loading ----
// Section 6a's load_weights loads everything but the four matrices (linears false); then each fused matrix
// is filled part by part, as section 6a fuses them: an FP8 checkpoint's bytes copied as they are, with its
// scales gathered into the fused table on the host; or, under --quantization fp8, the bf16 parts loaded
// into a scratch buffer on the GPU and quantized there (quantize_weight).

// One part of a fused matrix: rows [r0, r0+nr) and columns [c0, c0+nc) of checkpoint tensor `name`.
struct Fp8Part {
  std::string name;
  int64_t r0, nr, c0, nc;
};

// Fills m (its w, scale, N, K, ld set) from parts stacked by rows. `scratch` holds a bf16 [N, K] matrix
// (quantizing only).
static void fp8_fill_matrix(WeightLoader& ld, const SafeTensors& st, const std::map<std::string, TensorSpec>& spec,
                            const std::string& dir, const Fp8Matrix& m, const std::vector<Fp8Part>& parts,
                            bool quantize, bf16* scratch, cudaStream_t stream) {
  std::vector<float> table((size_t)m.N / 128 * m.ld, 0.f);  // the fused scales, zero in ld's padding
  int64_t row = 0;
  for (const Fp8Part& part : parts) {
    const TensorView& t = checked_tensor(st, spec.at(part.name), dir);
    if (quantize) {
      ld.load(scratch + row * m.K, t, part.r0, part.nr, part.c0, part.nc);
      row += part.nr;
      continue;
    }
    const std::vector<float> s = block_scales(checked_tensor(st, spec.at(part.name + "_scale_inv"), dir));
    const int64_t cols = t.shape[1], scols = cdiv(cols, 128);
    for (int64_t r = 0; r < part.nr; r++) {
      const uint8_t* src = (const uint8_t*)t.data + (part.r0 + r) * cols + part.c0;
      for (int64_t c = 0; c < part.nc;) {
        size_t got;
        uint8_t* out = ld.stage_for(m.w + (row + r) * m.K + c, part.nc - c, 1, &got);
        const size_t bad = block_quantized_first_nan(src + c, got);
        if (bad < got)
          die("tensor '%s' in %s holds a NaN byte (0x%02x) at [%lld, %lld]; an FP8 checkpoint's quantizer "
              "never writes one: the checkpoint is damaged", t.name.c_str(), t.file.c_str(), src[c + bad],
              (long long)(part.r0 + r), (long long)(part.c0 + c + bad));
        memcpy(out, src + c, got);
        c += got;
        ld.bytes_read += got;
      }
    }
    for (int64_t bi = 0; bi < part.nr / 128; bi++)  // the part's blocks, by the tensor's own block indices
      for (int64_t bj = 0; bj < part.nc / 128; bj++)
        table[(row / 128 + bi) * m.ld + bj] = s[(part.r0 / 128 + bi) * scols + part.c0 / 128 + bj];
    row += part.nr;
  }
  INTERNAL_CHECK(row == m.N, "fp8_fill_matrix: %lld of %d rows", (long long)row, m.N);
  if (quantize) {
    ld.flush();  // the copies into scratch are queued on `stream` before the kernel that reads them
    quantize_weight(m, scratch, stream);
    return;
  }
  for (size_t i = 0; i < table.size();) {
    size_t got;
    float* out = (float*)ld.stage_for(m.scale + i, (table.size() - i) * sizeof(float), sizeof(float), &got);
    memcpy(out, table.data() + i, got);
    i += got / sizeof(float);
  }
}

// Hooks::load_weights, which section 30 installs: the model's weights with its four matrices per layer in FP8,
// or false where section 6a's load_weights is to run (a bf16 checkpoint without --quantization fp8, or a
// model this chapter stands aside for, g_fp8_weights.reason saying why).
static bool fp8_load_weights(Weights& w, const Config& c, const ModelConfig& mc, int rank, int tp,
                             cudaStream_t stream, size_t* bytes_read) {
  Fp8Weights& f = g_fp8_weights;
  const bool quantize = c.quantization == "fp8" && !mc.block_quantized;
  if (!mc.block_quantized && !quantize) return false;
  const std::string problem = fp8_weights_problem(mc, tp);
  if (!problem.empty()) {
    if (quantize) die("--quantization fp8: %s", problem.c_str());
    f.reason = problem;
    return false;
  }
  w = load_weights(c.model, mc, rank, tp, stream, bytes_read, false);
  const TPShard sh = tp_shard(mc, rank, tp);
  const int H = mc.hidden_size, D = mc.head_dim, I = (int)sh.inter, NH = (int)sh.q_heads, NKV = (int)sh.kv_heads;
  const int L = mc.num_hidden_layers, E = mc.num_experts, IE = (int)sh.moe_inter;
  auto shape = [](int N, int K) {
    Fp8Matrix m;
    m.N = N, m.K = K, m.ld = (int)cdiv(K / 128, 4) * 4;
    return m;
  };
  auto bytes = [](const Fp8Matrix& m) { return (size_t)m.N * m.K + (size_t)m.N / 128 * m.ld * sizeof(float); };
  // A dense layer's four matrices; a MoE layer's two and its experts' (quantized one expert at a time).
  const Fp8Layer dense{shape((NH + 2 * NKV) * D, H), shape(H, NH * D), shape(2 * I, H), shape(H, I)};
  Fp8Layer moe{dense.qkv, dense.o, Fp8Matrix{}, Fp8Matrix{}, shape(E * 2 * IE, H), shape(E * H, IE)};
  const size_t dense_bytes = bytes(dense.qkv) + bytes(dense.o) + bytes(dense.gate_up) + bytes(dense.down);
  const size_t moe_bytes = bytes(moe.qkv) + bytes(moe.o) + bytes(moe.experts_gate_up) + bytes(moe.experts_down);
  const int L_moe = mc.num_moe_layers();
  size_t scratch_elems = std::max((size_t)(NH + 2 * NKV) * D * H, (size_t)H * NH * D);
  if (L_moe < L) scratch_elems = std::max(scratch_elems, (size_t)2 * I * H);
  if (L_moe > 0) scratch_elems = std::max(scratch_elems, (size_t)2 * IE * H);
  const size_t total_bytes = dense_bytes * (L - L_moe) + moe_bytes * L_moe;
  CUDA_CHECK(cudaMalloc(&f.arena, total_bytes));
  uint8_t* p = (uint8_t*)f.arena;
  auto place = [&](Fp8Matrix m) {  // sizes are multiples of 16 bytes, so every part stays 16-byte aligned
    m.w = p, p += (size_t)m.N * m.K;
    m.scale = (float*)p, p += (size_t)m.N / 128 * m.ld * sizeof(float);
    return m;
  };
  // Expert e's rows of a stacked matrix, as a matrix of its own (n rows an expert, a multiple of 128).
  auto expert = [](const Fp8Matrix& m, int e, int n) {
    Fp8Matrix v = m;
    v.w += (size_t)e * n * m.K, v.scale += (size_t)e * n / 128 * m.ld, v.N = n;
    return v;
  };
  bf16* scratch = nullptr;
  if (quantize) CUDA_CHECK(cudaMalloc(&scratch, scratch_elems * sizeof(bf16)));
  SafeTensors st = open_checkpoint(c.model);
  std::map<std::string, TensorSpec> spec;
  for (TensorSpec& t : checkpoint_tensors(mc)) spec[t.name] = t;
  WeightLoader ld(st, mc, stream);
  const int64_t q0 = sh.q_head0 * D, kv0 = sh.kv_head0 * D;  // this rank's first row (or column), as 6a's
  for (int l = 0; l < L; l++) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    const bool is_moe = mc.is_moe_layer(l);
    const Fp8Layer& like = is_moe ? moe : dense;
    Fp8Layer fl{place(like.qkv), place(like.o), Fp8Matrix{}, Fp8Matrix{}, Fp8Matrix{}, Fp8Matrix{}};
    auto fill = [&](const Fp8Matrix& m, const std::vector<Fp8Part>& parts) {
      fp8_fill_matrix(ld, st, spec, c.model, m, parts, quantize, scratch, stream);
    };
    fill(fl.qkv, {{pre + "self_attn.q_proj.weight", q0, NH * D, 0, H},
                  {pre + "self_attn.k_proj.weight", kv0, NKV * D, 0, H},
                  {pre + "self_attn.v_proj.weight", kv0, NKV * D, 0, H}});
    fill(fl.o, {{pre + "self_attn.o_proj.weight", 0, H, q0, NH * D}});
    if (!is_moe) {
      fl.gate_up = place(like.gate_up), fl.down = place(like.down);
      fill(fl.gate_up, {{pre + "mlp.gate_proj.weight", sh.inter0, I, 0, H},
                        {pre + "mlp.up_proj.weight", sh.inter0, I, 0, H}});
      fill(fl.down, {{pre + "mlp.down_proj.weight", 0, H, sh.inter0, I}});
    } else {  // each expert's gate and up (this rank's rows), then its down (this rank's columns)
      fl.experts_gate_up = place(like.experts_gate_up), fl.experts_down = place(like.experts_down);
      for (int e = 0; e < E; e++) {
        const std::string ex = pre + "mlp.experts." + std::to_string(e) + ".";
        fill(expert(fl.experts_gate_up, e, 2 * IE), {{ex + "gate_proj.weight", sh.moe_inter0, IE, 0, H},
                                                      {ex + "up_proj.weight", sh.moe_inter0, IE, 0, H}});
        fill(expert(fl.experts_down, e, H), {{ex + "down_proj.weight", 0, H, sh.moe_inter0, IE}});
      }
    }
    f.layers.push_back(fl);
  }
  ld.flush();
  CUDA_CHECK(cudaStreamSynchronize(stream));
  if (scratch) CUDA_CHECK(cudaFree(scratch));
  *bytes_read += ld.bytes_read;
  w.bytes += total_bytes;
  // The buffers of section 29's activation quantizer: ModelRunner's Tmax tokens rounded up to 4 rows, at
  // the widest K of the matrices (a MoE layer's experts quantize their inputs elsewhere: section 35).
  f.rows = (int)cdiv(std::max(c.max_num_batched_tokens, c.max_num_seqs), 4) * 4;
  f.kmax = std::max({H, NH * D, L_moe < L ? I : 0});
  CUDA_CHECK(cudaMalloc(&f.xq, (size_t)f.rows * f.kmax));
  CUDA_CHECK(cudaMalloc(&f.xs, (size_t)f.rows * (f.kmax / 128) * sizeof(float)));
  f.held = true, f.quantized_at_load = quantize;
  w.held = quantize ? "linears fp8 e4m3 with 128 x 128 block scales, quantized at load"
                    : "linears fp8 e4m3 with 128 x 128 block scales, as the checkpoint stores them";
  return true;
}

// ==== 29. FP8 weights, 2: the activations' quantizer and cuBLASLt's block-scaled products ==================
// defines: quantize_rows_reference, e4m3_quantize_group, quantize_rows_kernel, quantize_rows,
//          fp8_linear_reference, Fp8GemmPlan, fp8_gemm_plan, fp8_product, fp8_linear, rmsnorm_quantize,
//          silu_quantize (section 30: the small steps, the persistent kernel, the stages and the switches)
//
// Section 28's format, computed with: the arithmetic of its steps 2 and 3, as two launches per matrix
// product. quantize_rows rounds a step's activations to e4m3, one scale per token and 128 columns; then one
// cuBLASLt call multiplies them by the e4m3 weights on the tensor cores, applying both sets of scales as
// it accumulates (cuBLASLt's "128-element 1D and 128x128 2D block scaling", CUDA 12.9 on: the activations'
// scales in mode VEC128_32F, the weights' in BLK128x128_32F; the two 2-D modes together are not offered).
// Steps of every size can take this path: cuBLASLt wants the token count a multiple of 4, so a step is
// padded to one (rows of zeros with scale 1, whose products land in the activation buffers' spare rows,
// section 11).
// The norm before qkv and gate_up and SiLU-and-mul before down write the quantized rows themselves (two
// kernels below: Part I's row code, then the quantizer); the residual add after o_proj and down stays Part
// I's. At steps of one or two tokens a gemv on the FP8 tensor cores replaces cuBLASLt and takes the residual
// add in (switch fp8_gemv, below).

// What quantize_rows_kernel computes, on the CPU: x [T, K] (bf16 values as float) -> xq [T4, K] e4m3 and
// xs [K/128, T4] fp32, T4 = T rounded up to 4, rows past T zero with scale 1.
static void quantize_rows_reference(uint8_t* xq, float* xs, const float* x, int T, int K) {
  const int T4 = (int)cdiv(T, 4) * 4;
  for (int t = 0; t < T4; t++)
    for (int b = 0; b < K / 128; b++) {
      float amax = 0.f;
      for (int k = b * 128; k < b * 128 + 128 && t < T; k++) amax = std::max(amax, std::fabs(x[(size_t)t * K + k]));
      const float s = amax > 0.f ? amax / 448.f : 1.f;
      xs[(size_t)b * T4 + t] = s;
      for (int k = b * 128; k < b * 128 + 128; k++)
        xq[(size_t)t * K + k] = t < T ? e4m3_from_float(x[(size_t)t * K + k] / s) : 0;
    }
}

// Step 2 of section 28 for one group of 128 values spread over a warp, lane i holding values 4i..4i+3 (bf16
// values, as floats): the group's scale s = amax / 448 (1 for a group of zeros) into *scale (lane 0), and
// the lane's four bytes e4m3(v / s), the first value in the low byte, into q128 (the group's 128 bytes).
// quantize_rows_kernel and rmsnorm_quantize_kernel (below) both quantize with it, so they write the same bytes.
__device__ __forceinline__ void e4m3_quantize_group(const float (&v)[4], uint8_t* q128, float* scale, int lane) {
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float s = amax > 0.f ? amax / 448.f : 1.f;
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(v[0] / s, v[1] / s), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v[2] / s, v[3] / s), __NV_SATFINITE, __NV_E4M3);
  reinterpret_cast<uint32_t*>(q128)[lane] = lo | hi << 16;
  if (lane == 0) *scale = s;
}
__device__ __forceinline__ void bf16x4_to_float(const uint2& u, float (&f)[4]) {
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  f[0] = lo.x, f[1] = lo.y, f[2] = hi.x, f[3] = hi.y;
}

// quantize_rows_kernel — step 2 of section 28: x_q = e4m3(x / s_x), s_x = amax / 448 per token and 128 columns.
//   x bf16 [T, K] row-major; xq e4m3 [T4, K]; xs fp32 [K/128, T4], tokens contiguous (the layout cuBLASLt
//   reads VEC128_32F scales of its second operand in). K a multiple of 128.
//   One warp per (token, group of 128 columns), 8 warps per thread block: lane i holds columns 4i..4i+3 of
//   the group (one 8-byte load), e4m3_quantize_group gives the scale (five shuffles) and the lane's 4 bytes.
//   Rows t >= T (the padding up to T4) write zeros and scale 1. Launched with PDL (section 17).
//   SILU: x is gate_up [T, 2K] and the values quantized are silu(gate) * up, each computed and rounded to
//   bf16 as section 7's silu_and_mul_kernel does (SiLU-and-mul with the quantizer fused in, below).
template <bool SILU>
__global__ void __launch_bounds__(256) quantize_rows_kernel(uint8_t* __restrict__ xq, float* __restrict__ xs,
                                                            const bf16* __restrict__ x, int T, int T4, int K) {
  const int groups = K / 128, warp = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x & 31;
  pdl_begin();
  if (warp >= T4 * groups) return;
  const int t = warp / groups, b = warp % groups;
  float v[4] = {0.f, 0.f, 0.f, 0.f};
  if (t < T && !SILU) bf16x4_to_float(reinterpret_cast<const uint2*>(x + (size_t)t * K + b * 128)[lane], v);
  if (t < T && SILU) {
    const bf16* gate = x + (size_t)t * 2 * K + b * 128;
    float g[4], u[4];
    bf16x4_to_float(reinterpret_cast<const uint2*>(gate)[lane], g);
    bf16x4_to_float(reinterpret_cast<const uint2*>(gate + K)[lane], u);
#pragma unroll
    for (int i = 0; i < 4; i++) v[i] = bf16_round(silu_mul(g[i], u[i]));
  }
  e4m3_quantize_group(v, xq + (size_t)t * K + b * 128, xs + (size_t)b * T4 + t, lane);
}
template <bool SILU>
static void quantize_rows_launch(const char* name, uint8_t* xq, float* xs, const bf16* x, int T, int K,
                                 cudaStream_t stream) {
  INTERNAL_CHECK(K % 128 == 0 && T >= 0, "%s: T = %d, K = %d (a multiple of 128)", name, T, K);
  check_aligned16(name, "x", x);
  const int T4 = (int)cdiv(T, 4) * 4;
  if (T4 == 0) return;
  launch_pdl(quantize_rows_kernel<SILU>, (unsigned)cdiv((int64_t)T4 * (K / 128), 8), 256, 0, stream, xq, xs, x, T,
             T4, K);
}
static void quantize_rows(uint8_t* xq, float* xs, const bf16* x, int T, int K, cudaStream_t stream) {
  quantize_rows_launch<false>("quantize_rows", xq, xs, x, T, K, stream);
}

// What one FP8 layer product computes (section 28's steps 2 and 3), on the CPU: y [T, N] = x [T, K] (bf16
// values as float) times W [N, K] given as e4m3 bytes w and block scales [N/128, ld]; sums in double, one
// bf16 rounding. w8a16 (section 35's small steps): x as it is, step 2 left out.
static void fp8_linear_reference(float* y, const float* x, const uint8_t* w, const float* scale, int ld, int T,
                                 int N, int K, bool w8a16 = false) {
  const int T4 = (int)cdiv(T, 4) * 4;
  std::vector<uint8_t> xq((size_t)T4 * K);
  std::vector<float> xs((size_t)K / 128 * T4);
  quantize_rows_reference(xq.data(), xs.data(), x, T, K);
  const float* e4m3 = block_quantized_values();  // e4m3_to_float of every byte
  for (int t = 0; t < T; t++)
    for (int n = 0; n < N; n++) {
      double acc = 0;
      for (int b = 0; b < K / 128; b++) {
        double block = 0;
        for (int k = b * 128; k < b * 128 + 128; k++)
          block += (w8a16 ? (double)x[(size_t)t * K + k] : (double)e4m3[xq[(size_t)t * K + k]]) *
                   e4m3[w[(size_t)n * K + k]];
        acc += block * (w8a16 ? 1.f : xs[(size_t)b * T4 + t]) * scale[(size_t)(n / 128) * ld + b];
      }
      y[(size_t)t * N + n] = bf16_round((float)acc);
    }
}

// One cuBLASLt product per shape (T4, N, K), chosen once like section 10's: y^T [N, T4] = W [N, K] (read
// transposed: "TN", the only layout cuBLASLt's FP8 products take) times x_q^T. The scale pointers differ per
// call (each matrix has its own), so they are set on the descriptor just before each call; under graph
// capture the captured call keeps them.
struct Fp8GemmPlan {
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t a, b, c;
  cublasLtMatmulAlgo_t algo;
  bool found = false;
};
static Fp8GemmPlan& fp8_gemm_plan(Gemm& g, int T4, int N, int K, const void* wscale, const void* xscale) {
  static std::map<std::tuple<cublasLtHandle_t, int, int, int>, Fp8GemmPlan> plans;
  auto key = std::make_tuple(g.handle, T4, N, K);
  auto it = plans.find(key);
  if (it != plans.end()) return it->second;
  Fp8GemmPlan p;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
#if CUBLAS_VERSION >= 120900
  const cublasLtMatmulMatrixScale_t wmode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                                    xmode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &wmode, sizeof wmode));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &xmode, sizeof xmode));
  // The heuristic refuses block-scaled modes without scale pointers: the first call's, replaced at each call.
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &wscale, sizeof wscale));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &xscale, sizeof xscale));
#endif
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_8F_E4M3, K, N, K));  // W, read transposed
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_8F_E4M3, K, T4, K));  // x_q
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_16BF, N, T4, N));     // y
  cublasLtMatmulPreference_t pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &g.workspace_bytes, sizeof g.workspace_bytes));
  cublasLtMatmulHeuristicResult_t res;
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(g.handle, p.desc, p.a, p.b, p.c, p.c, pref, 1, &res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || !found)
    die("cuBLASLt found no block-scaled FP8 algorithm for a %d x %d x %d product (%s); run with --opt "
        "-fp8_weights to dequantize the weights to bf16 instead", T4, N, K, cublasLtGetStatusString(st));
  p.algo = res.algo;
  p.found = true;
  return plans[key] = p;
}

// y [T, N] = the product of the chapter's quantized activations (f.xq, f.xs: T rows of m.K columns, padded to
// T4) and m, through cuBLASLt. y needs T rounded up to 4 rows (section 11 allocates the activations so).
static void fp8_product(Gemm& g, bf16* y, const Fp8Matrix& m, int T, cudaStream_t stream) {
  Fp8Weights& f = g_fp8_weights;
  const int T4 = (int)cdiv(T, 4) * 4;
  if (T4 == 0) return;
  INTERNAL_CHECK(T4 <= f.rows && m.K <= f.kmax, "fp8_product: %d rows of %d columns, buffers for %d of %d", T4,
                 m.K, f.rows, f.kmax);
  Fp8GemmPlan& p = fp8_gemm_plan(g, T4, m.N, m.K, m.scale, f.xs);
#if CUBLAS_VERSION >= 120900
  const void* ws = m.scale;
  const void* xs = f.xs;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ws, sizeof ws));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &xs, sizeof xs));
#endif
  const float alpha = 1.0f, beta = 0.0f;
  CUBLAS_CHECK(cublasLtMatmul(g.handle, p.desc, &alpha, m.w, p.a, f.xq, p.b, &beta, y, p.c, y, p.c, &p.algo,
                              g.workspace, g.workspace_bytes, stream));
}
// y [T, N] = FP8 product of x [T, K] (bf16) and m: quantize_rows into the chapter's buffers, then cuBLASLt.
static void fp8_linear(Gemm& g, bf16* y, const bf16* x, const Fp8Matrix& m, int T, cudaStream_t stream) {
  Fp8Weights& f = g_fp8_weights;
  INTERNAL_CHECK(cdiv(T, 4) * 4 <= f.rows && m.K <= f.kmax, "fp8_linear: %d rows of %d columns, buffers for %d of %d",
                 T, m.K, f.rows, f.kmax);
  quantize_rows(f.xq, f.xs, x, T, m.K, stream);
  fp8_product(g, y, m, T, stream);
}

// ---- The quantizer fused into the kernels before it ------------------------------------------------------
// At a large step the activations' quantizer reads what Part I's RMSNorm or SiLU-and-mul has just written: a
// bf16 [T, K] written, read back, and a kernel launched, for each of qkv, gate_up and down. rmsnorm_quantize
// (below) and silu_quantize (quantize_rows_kernel<true>, above) write the e4m3 rows and their scales directly
// instead (o_proj's input, attention's output, keeps quantize_rows): the bytes are the same as the two
// kernels' (section 7's row code, then e4m3_quantize_group), and for a prefill step of 16,384 tokens of the 8B
// shape they leave out about 1.3 GB of traffic a layer.
//
// rmsnorm_quantize_kernel — xq [T4, H], xs [H/128, T4] = quantize_rows(rmsnorm(x) * w): one thread block per
//   row (rows past T: zeros, scale 1), as many threads as section 7's rmsnorm_kernel takes; rmsnorm_row
//   stages the normalized row in shared memory, then each warp quantizes groups of 128 columns of it.
__global__ void __launch_bounds__(NORM_THREADS) rmsnorm_quantize_kernel(uint8_t* __restrict__ xq,
                                                                        float* __restrict__ xs,
                                                                        const bf16* __restrict__ x,
                                                                        const bf16* __restrict__ w, int T, int T4,
                                                                        int H, float eps) {
  extern __shared__ uint4 row[];  // bf16 [H]
  __shared__ float scratch[32];
  const int t = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  pdl_begin();
  if (t < T) {
    rmsnorm_row<false>(reinterpret_cast<bf16*>(row), nullptr, x + (size_t)t * H, w, H, eps, scratch);
    __syncthreads();
  }
  for (int b = warp; b < H / 128; b += blockDim.x / 32) {
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (t < T) bf16x4_to_float(reinterpret_cast<const uint2*>(reinterpret_cast<const bf16*>(row) + b * 128)[lane], v);
    e4m3_quantize_group(v, xq + (size_t)t * H + b * 128, xs + (size_t)b * T4 + t, lane);
  }
}
static void rmsnorm_quantize(uint8_t* xq, float* xs, const bf16* x, const bf16* w, int T, int H, float eps,
                             cudaStream_t stream) {
  rmsnorm_checks("rmsnorm_quantize", x, x, w, H);
  INTERNAL_CHECK(H % 128 == 0, "rmsnorm_quantize: H = %d (a multiple of 128)", H);
  const int T4 = (int)cdiv(T, 4) * 4;
  if (T4 == 0) return;
  launch_pdl(rmsnorm_quantize_kernel, (unsigned)T4, (unsigned)row_threads(H / 8, NORM_THREADS), H * sizeof(bf16),
             stream, xq, xs, x, w, T, T4, H, eps);
}

// silu_quantize — xq [T4, I], xs [I/128, T4] = quantize_rows(silu(gate) * up) for gate_up [T, 2I]: the
// quantizer's kernel reading gate and up (SILU, above), each lane's four values computed as section 7's
// silu_and_mul_kernel computes them.
static void silu_quantize(uint8_t* xq, float* xs, const bf16* gate_up, int T, int I, cudaStream_t stream) {
  quantize_rows_launch<true>("silu_quantize", xq, xs, gate_up, T, I, stream);
}

// ==== 30. FP8 weights, 3: small steps on the FP8 tensor cores, the persistent kernel, the stages ===========
// defines: mma_e4m3_16832, FP8_GEMV_STEP, gemv_fp8_kernel, gemv_fp8, persist_stage_fp8, persist_gemv_chunk_fp8,
//          persist_fp8_layer, fp8_multiply, fp8_norm_matmul, fp8_matmul_out, apply_fp8_weights; switches
//          fp8_weights, fp8_gemv; --quantization fp8
//
// Small steps: a gemv on the FP8 tensor cores (switch fp8_gemv).
// Replaces: at steps of at most FP8_GEMV_STEP tokens, cuBLASLt's product above, and the residual add after it.
// Why it is faster: as in section 18, a step of a few tokens is a pass over the weights, and a kernel that
// streams them at the copy bandwidth beats cuBLASLt, whose tiles are made for many tokens (padded to 4 here).
// A weight is one byte here, so the pass is half section 18's, and the instructions per byte matter twice as
// much: a gemv that converted each e4m3 weight to a float in registers (a conversion, a multiply-add and more
// per weight) was measured no faster than cuBLASLt on the 8B shape, and one that quantized its input in
// every thread block lost as much again at two tokens (docs/performance.md, FP8 weights). So the input comes
// quantized, by the same kernels as the large steps' (rmsnorm_quantize, silu_quantize, quantize_rows: one
// launch before the gemv, whose weight loads start while it runs), and the products run on the tensor cores,
// whose FP8 instruction (mma.m16n8k32, e4m3 x e4m3 into fp32, sm_89 and later) takes the weights' bytes as
// they come from memory: 512 weights an instruction, nothing converted.
// Its arithmetic is section 28's steps 2 and 3, the large steps' (fp8_linear_reference says what both
// compute), so a token's result does not depend on the size of the step it came in, up to the order of the
// additions (the tensor cores' own, and across blocks).
// The work: a thread block of GEMV_WARPS warps takes 16 x TILES weight rows (TILES = 1, 2 or 4, as many as
// keep at least two thread blocks per SM) and all of K, in slabs of 128 columns (one scale block): warp w
// takes slabs w, w + 8, w + 16, ..., so the 8 warps split K and the block's rows are read once. In a slab,
// lane (g, t) (g = lane / 4, t = lane % 4) loads 32 bytes of rows g and g + 8 of each 16-row tile, columns
// 32 t .. 32 t + 31 (the four lanes of a row read its 128 bytes together), straight into the registers the
// tensor cores read: the m16n8k32 instruction takes, from lane (g, t), row g's and row g + 8's bytes at 8 "k
// positions" 4t..4t+3 and 16+4t..16+4t+3, and the input's bytes at the same positions for token g. A dot
// product does not depend on the order of its terms, so which column a k position holds is ours to choose,
// as long as weights and inputs agree: instruction j takes bytes 8j..8j+7 of the lane's 32, for weights and
// inputs alike. Four instructions make a slab; its 16 x 8 sums (rows x tokens; tokens past M are zeros) are
// scaled by s_w s_x and added to the warp's accumulators; at the end the 8 warps' accumulators meet in shared
// memory and are added in warp order (fixed, so results do not depend on timing). The quantized input, M x K
// bytes, is copied into shared memory first (rows K + 16 bytes apart, so the eight tokens' reads fall in
// different banks).

// acc[16x8] += a[16x32] * b[32x8], e4m3 inputs, fp32 accumulation. a0, a2: row g's bytes at k positions
// 4t..4t+3 and 16+4t..16+4t+3; a1, a3: row g + 8's; b0, b1: column g's at the same positions. acc as
// mma_bf16_16816's. Needs sm_89 or later (the FP8 chapter runs on sm_90 only).
__device__ __forceinline__ void mma_e4m3_16832(float (&acc)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();  // never launched: fp8_weights_problem keeps the chapter off before sm_90
#endif
}

constexpr int FP8_GEMV_MAX_M = 8;  // tokens the kernel can take: the instruction's 8 columns
constexpr int FP8_GEMV_STEP = 2;   // the steps that take it (docs/performance.md, FP8 weights)
constexpr int FP8_GEMV_SLABS = 4;  // 128-column slabs of each tile in flight per warp (TILES = 1)
constexpr size_t FP8_GEMV_MAX_SMEM = 112 << 10;  // the staged input: two thread blocks an SM

// Shared-memory bytes: the input, e4m3 [M, K + 16] and its scales [M, K / 128], or the epilogue's
// [GEMV_WARPS][16 TILES][8] sums, whichever is more.
static size_t gemv_fp8_smem(int M, int K, int tiles) {
  const size_t in = (size_t)M * (K + 16) + (size_t)M * (K / 128) * sizeof(float);
  return std::max(in, (size_t)GEMV_WARPS * 16 * tiles * 8 * sizeof(float));
}

// gemv_fp8_kernel — y [M, N] = the FP8 product of a quantized input and W (section 28's step 3), M <= 8.
//   xq e4m3 [M, K] and xs fp32 [K/128, T4] as quantize_rows writes them (T4: xs's row length); W e4m3 [N, K];
//   scale fp32 [N/128, ld]; y bf16 [M, N] (ADD: y += the product, rounded as add_rmsnorm rounds). N a
//   multiple of 16 x TILES, K of 128. Grid N / (16 TILES), GEMV_WARPS warps.
template <bool ADD, int TILES>
__global__ void __launch_bounds__(GEMV_WARPS * 32, 2)
    gemv_fp8_kernel(bf16* __restrict__ y, const uint8_t* __restrict__ xq_in, const float* __restrict__ xs_in,
                    int T4, const uint8_t* __restrict__ W, const float* __restrict__ scale, int ld, int M, int N,
                    int K) {
  constexpr int U = FP8_GEMV_SLABS / TILES;  // slabs in flight: 16 registers of weights per slab and tile
  extern __shared__ uint4 smem[];
  uint8_t* xq = reinterpret_cast<uint8_t*>(smem);                   // [M][K + 16]
  float* xs = reinterpret_cast<float*>(xq + (size_t)M * (K + 16));  // [M][K / 128]
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int slabs = K / 128, n0 = blockIdx.x * 16 * TILES;
  const uint8_t* w0 = W + (size_t)(n0 + g) * K + 32 * t;  // tile i's row g is 16 i rows on, row g + 8 is 8 on
  uint4 wv[U][TILES][4];  // slab u, tile i: row g's 32 bytes, then row g + 8's
  auto load_stretch = [&](int s0) {
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int s = s0 + u * GEMV_WARPS;
      if (s >= slabs) break;
#pragma unroll
      for (int i = 0; i < TILES; i++) {
        const uint8_t* p = w0 + (size_t)16 * i * K + (size_t)s * 128;
        wv[u][i][0] = __ldcs(reinterpret_cast<const uint4*>(p));
        wv[u][i][1] = __ldcs(reinterpret_cast<const uint4*>(p + 16));
        wv[u][i][2] = __ldcs(reinterpret_cast<const uint4*>(p + (size_t)8 * K));
        wv[u][i][3] = __ldcs(reinterpret_cast<const uint4*>(p + (size_t)8 * K + 16));
      }
    }
  };
  load_stretch(warp);  // the weights: no step writes them (section 17)
  pdl_begin();
  for (int c = threadIdx.x; c < M * K / 16; c += GEMV_WARPS * 32) {  // the input, written by the kernel before
    const int m = c / (K / 16), j = c % (K / 16);
    reinterpret_cast<uint4*>(xq + (size_t)m * (K + 16))[j] =
        __ldcg(reinterpret_cast<const uint4*>(xq_in + (size_t)m * K) + j);
  }
  for (int c = threadIdx.x; c < M * slabs; c += GEMV_WARPS * 32)  // xs [m][b] from xs_in [b][m]
    xs[c] = __ldcg(xs_in + (size_t)(c % slabs) * T4 + c / slabs);
  __syncthreads();
  float acc[TILES][4] = {};
  const float* srow = scale + (size_t)(n0 / 128) * ld;  // the tiles' rows lie in one 128-row block
  for (int s0 = warp; s0 < slabs; s0 += U * GEMV_WARPS) {
    if (s0 != warp) load_stretch(s0);
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int s = s0 + u * GEMV_WARPS;
      if (s >= slabs) break;
      uint4 xa = {0, 0, 0, 0}, xb = {0, 0, 0, 0};  // token g's 32 bytes at the lane's columns
      if (g < M) {
        const uint4* xp = reinterpret_cast<const uint4*>(xq + (size_t)g * (K + 16) + s * 128 + 32 * t);
        xa = xp[0], xb = xp[1];
      }
      const float sw = __ldg(srow + s);
      const float sx0 = 2 * t < M ? xs[2 * t * slabs + s] * sw : 0.f;  // the lane's two tokens: 2t, 2t + 1
      const float sx1 = 2 * t + 1 < M ? xs[(2 * t + 1) * slabs + s] * sw : 0.f;
#pragma unroll
      for (int i = 0; i < TILES; i++) {
        const uint4 *r0 = wv[u][i], *r8 = wv[u][i] + 2;  // rows g and g + 8: 2 x 16 bytes each
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        mma_e4m3_16832(d, r0[0].x, r8[0].x, r0[0].y, r8[0].y, xa.x, xa.y);  // bytes 0-7
        mma_e4m3_16832(d, r0[0].z, r8[0].z, r0[0].w, r8[0].w, xa.z, xa.w);  // bytes 8-15
        mma_e4m3_16832(d, r0[1].x, r8[1].x, r0[1].y, r8[1].y, xb.x, xb.y);  // bytes 16-23
        mma_e4m3_16832(d, r0[1].z, r8[1].z, r0[1].w, r8[1].w, xb.z, xb.w);  // bytes 24-31
        acc[i][0] = fmaf(d[0], sx0, acc[i][0]), acc[i][1] = fmaf(d[1], sx1, acc[i][1]);
        acc[i][2] = fmaf(d[2], sx0, acc[i][2]), acc[i][3] = fmaf(d[3], sx1, acc[i][3]);
      }
    }
  }
  // The 8 warps' sums meet in shared memory (the staged input is no longer read), then one thread per output
  // adds them in warp order. acc[i]: rows 16 i + g (0, 1) and 16 i + g + 8 (2, 3), tokens 2t and 2t + 1.
  __syncthreads();
  float* red = reinterpret_cast<float*>(smem);  // [GEMV_WARPS][16 TILES][8]
#pragma unroll
  for (int i = 0; i < TILES; i++) {
    float* mine = red + ((size_t)warp * 16 * TILES + 16 * i) * 8;
    mine[g * 8 + 2 * t] = acc[i][0], mine[g * 8 + 2 * t + 1] = acc[i][1];
    mine[(g + 8) * 8 + 2 * t] = acc[i][2], mine[(g + 8) * 8 + 2 * t + 1] = acc[i][3];
  }
  __syncthreads();
  for (int o = threadIdx.x; o < 16 * TILES * M; o += GEMV_WARPS * 32) {
    const int r = o / M, m = o % M;
    float sum = 0.f;
    for (int w = 0; w < GEMV_WARPS; w++) sum += red[((size_t)w * 16 * TILES + r) * 8 + m];
    bf16& out = y[(size_t)m * N + n0 + r];
    out = ADD ? __float2bfloat16(bf16_round(sum) + __bfloat162float(out)) : __float2bfloat16(sum);
  }
}

// Tiles per thread block: the most of 4, 2, 1 that leave at least two thread blocks per SM.
static int gemv_fp8_tiles(int N) {
  const int sms = gpu_sm_count();
  for (int tiles : {4, 2})
    if (N % (16 * tiles) == 0 && N / (16 * tiles) >= 2 * sms) return tiles;
  return 1;
}
template <bool ADD, int TILES>
static void gemv_fp8_launch(bf16* y, const uint8_t* xq, const float* xs, int T4, const Fp8Matrix& m, int M,
                            cudaStream_t stream) {
  static bool opted_in = false;  // shared memory past 48 KiB, once per kernel
  if (!opted_in) {
    CUDA_CHECK(cudaFuncSetAttribute(gemv_fp8_kernel<ADD, TILES>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)FP8_GEMV_MAX_SMEM));
    opted_in = true;
  }
  launch_pdl(gemv_fp8_kernel<ADD, TILES>, (unsigned)(m.N / (16 * TILES)), GEMV_WARPS * 32,
             gemv_fp8_smem(M, m.K, TILES), stream, y, xq, xs, T4, (const uint8_t*)m.w, (const float*)m.scale, m.ld,
             M, m.N, m.K);
}
// Whether gemv_fp8 can take an input of M x K.
static bool gemv_fp8_fits(int M, int K) {
  return M <= FP8_GEMV_MAX_M && gemv_fp8_smem(M, K, 4) <= FP8_GEMV_MAX_SMEM;
}
// y [M, N] = the FP8 product of the quantized input (xq [M, K], xs [K/128, T4], as quantize_rows and the
// kernels beside it write them) and m; add: y += it. M <= FP8_GEMV_MAX_M.
static void gemv_fp8(bf16* y, const uint8_t* xq, const float* xs, int T4, const Fp8Matrix& m, int M,
                     cudaStream_t stream, bool add = false) {
  INTERNAL_CHECK(m.K % 128 == 0 && m.N % 16 == 0 && M >= 1 && M <= T4 && gemv_fp8_fits(M, m.K),
                 "gemv_fp8: M = %d (T4 %d), N = %d, K = %d", M, T4, m.N, m.K);
  check_aligned16("gemv_fp8", "xq", xq);
  const int tiles = gemv_fp8_tiles(m.N);
  if (add) {
    if (tiles == 4) gemv_fp8_launch<true, 4>(y, xq, xs, T4, m, M, stream);
    else if (tiles == 2) gemv_fp8_launch<true, 2>(y, xq, xs, T4, m, M, stream);
    else gemv_fp8_launch<true, 1>(y, xq, xs, T4, m, M, stream);
  } else {
    if (tiles == 4) gemv_fp8_launch<false, 4>(y, xq, xs, T4, m, M, stream);
    else if (tiles == 2) gemv_fp8_launch<false, 2>(y, xq, xs, T4, m, M, stream);
    else gemv_fp8_launch<false, 1>(y, xq, xs, T4, m, M, stream);
  }
  CUDA_CHECK(cudaGetLastError());
}

// ---- 30a. The persistent kernel reading FP8 weights --------------------------------------------------
// Replaces: at decode steps of 1, 2 or 4 sequences on one GPU, section 14's path with this chapter's stages (the
//           gemv above at steps of 1-2 tokens), where the start-up measurement (section 27) finds it faster.
// Why it could be faster: a batch-1 step is a pass over the weights, and this chapter halves the weights'
// bytes, but each of its products is two short kernels (the quantizer, then the gemv) whose gaps do not shrink
// with the bytes; the persistent kernel (sections 24-27) has no gaps, and with it the bf16 weights' step came
// closer to its floor than the FP8 weights' step came to theirs (docs/performance.md, FP8 weights).
// How it reads them. The kernel's weight stream moves bytes: a 32 KiB chunk of a layer's four matrices is 16
// rows of 2,048 e4m3 weights instead of 1,024 bf16 ones (PersistOp::wscale marks such a product; its stream K
// is K / 2, persist_stream_k), so a warp's strip of 64 bf16 columns is 128 e4m3 columns: one scale block.
// ldmatrix gives each lane the same bytes as for bf16, four e4m3 weights where it gave two bf16 ones, and one
// instruction turns two e4m3 values into two fp16 ones, exactly (every e4m3 value is an fp16 number). So the
// products run on the fp16 tensor cores (m16n8k16), two instructions where bf16 had one: the lane's weights at
// columns c, c + 1 in the first and c + 2, c + 3 in the second, with the inputs at the same columns (a dot
// product does not care which of its terms the tensor cores pair up, only that weights and inputs agree).
// After the strip's eight instructions its 16 x 8 sums are multiplied by the rows' block scale and added.
// The input stays what section 24 stages (RMSNorm, rounded to bf16), converted to fp16 in shared memory once
// per product: exact for every bf16 value between 2^-14 and 65,504 (the smaller ones lose low bits, the larger
// are held at 65,504). Nothing is quantized: this is W8A16, the weights' values (e4m3 times their scale, in
// fp32) against the bf16 input, closer to Part I on the dequantized weights than the chapter's W8A8 products,
// and not the same arithmetic as theirs: a token's result here depends on whether its step took the kernel.
// Preconditions: N and K multiples of 128 (fp8_weights_problem's), one GPU, the bf16 cache (the other
// variants keep section 14's path: section 26's PersistFormat says which kernels exist).
template <int B>
__device__ void persist_stage_fp8(const PersistArgs& a, const PersistOp& op, bf16* xs, bf16* res, float* scratch,
                                  const uint4 (&nw)[NORM_MAX_CHUNKS]) {
  persist_stage_input<B, false>(a, op, xs, res, scratch, nw);
  const int ks = op.K + 8;  // section 24's rows
  for (int c = threadIdx.x; c < B * op.K / 8; c += PERSIST_THREADS) {
    uint4* p = reinterpret_cast<uint4*>(xs + c / (op.K / 8) * ks) + c % (op.K / 8);
    float v[8];
    bf16x8_to_float(*p, v);
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = fminf(fmaxf(v[i], -65504.f), 65504.f);
    *p = make_uint4(pack_half2(v[0], v[1]), pack_half2(v[2], v[3]), pack_half2(v[4], v[5]), pack_half2(v[6], v[7]));
  }
  __syncthreads();
}
// Two e4m3 values (the low 16 bits of w, the first in the low byte) as two fp16 ones, the first in the low half.
__device__ __forceinline__ uint32_t persist_e4m3x2_to_half2(uint32_t w) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w & 0xffff), __NV_E4M3);
  return (uint32_t)h.x | ((uint32_t)h.y << 16);
}
// acc += this warp's strip of chunk kc of group g (16 rows x 128 e4m3 columns: scale block kc * 16 + warp)
// times the same columns of the staged inputs (fp16), times the rows' scale. acc as persist_gemv_chunk's.
template <int B>
__device__ void persist_gemv_chunk_fp8(const PersistOp& op, int g, int kc, const bf16* slot, const bf16* xs,
                                       float (&acc)[4]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n = lane >> 2, t = lane & 3;
  const int kb = kc * (2 * PERSIST_KC / 128) + warp;
  if (kb >= op.K / 128) return;  // past K (the strip was filled with zeros)
  // The scales first, so that their trip through L2 overlaps the products. Rows 0-7 and 8-15 of the group each
  // lie in one 128-row scale block (GATE_UP: the gate rows and their up rows, in different ones).
  const int64_t r_lo = persist_weight_row(op, g, 0), r_hi = persist_weight_row(op, g, 8);
  const float w_lo = __ldg(op.wscale + (r_lo < 0 ? 0 : r_lo / 128) * op.wld + kb);
  const float w_hi = __ldg(op.wscale + (r_hi < 0 ? 0 : r_hi / 128) * op.wld + kb);
  const bf16* arow = slot + warp * PERSIST_ROWS * PERSIST_WARP_K + ((lane & 7) + ((lane >> 3) & 1) * 8) *
                                                                       PERSIST_WARP_K;
  // The lane's input columns: kb * 128 + 32 tt + 4t (+ 16), as its weights' (the staged row holds fp16 now).
  const uint16_t* xrow = reinterpret_cast<const uint16_t*>(xs) + (size_t)n * (op.K + 8) + kb * 128 + 4 * t;
  float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int tt = 0; tt < PERSIST_WARP_K / 16; tt++) {
    uint32_t w[4];  // rows g and g + 8, columns 32 tt + 4t .. + 3, then the same 16 columns on
    ldmatrix_x4(w, arow + (((2 * tt + (lane >> 4)) ^ (lane & 7)) << 3));
    uint32_t lo[4], hi[4];  // the first two and the last two of each register's four weights
#pragma unroll
    for (int i = 0; i < 4; i++) lo[i] = persist_e4m3x2_to_half2(w[i]), hi[i] = persist_e4m3x2_to_half2(w[i] >> 16);
    uint32_t x[4] = {0, 0, 0, 0};
    if (n < B) {
      const uint16_t* xp = xrow + 32 * tt;
      x[0] = *reinterpret_cast<const uint32_t*>(xp), x[1] = *reinterpret_cast<const uint32_t*>(xp + 16);
      x[2] = *reinterpret_cast<const uint32_t*>(xp + 2), x[3] = *reinterpret_cast<const uint32_t*>(xp + 18);
    }
    mma_f16_16816(d, lo, x[0], x[1]);
    mma_f16_16816(d, hi, x[2], x[3]);
  }
  acc[0] = fmaf(d[0], w_lo, acc[0]), acc[1] = fmaf(d[1], w_lo, acc[1]);
  acc[2] = fmaf(d[2], w_hi, acc[2]), acc[3] = fmaf(d[3], w_hi, acc[3]);
}
// Section 26's source of a layer's FP8 matrices (persist_setup's fp8).
static PersistFp8Layer persist_fp8_layer(int l) {
  const Fp8Layer& f = g_fp8_weights.layers.at(l);
  PersistFp8Layer p;
  const Fp8Matrix* m[4] = {&f.qkv, &f.o, &f.gate_up, &f.down};
  for (int i = 0; i < 4; i++) {
    INTERNAL_CHECK(m[i]->N % 128 == 0 && m[i]->K % 128 == 0, "persistent FP8: a %d x %d matrix", m[i]->N, m[i]->K);
    p.w[i] = m[i]->w, p.scale[i] = m[i]->scale, p.ld[i] = m[i]->ld;
  }
  return p;
}

// ---- The stages, and the switches: fp8_weights, fp8_gemv ----
// Section 14's norm_matmul and matmul_out for an engine whose weights this chapter holds (the layer's
// matrices found by p.l; the LayerWeights pointers are null); for any other engine, the stages they replaced.
// Whether this step's products with m take the gemv (switch fp8_gemv), else cuBLASLt's.
static bool fp8_gemv_takes(const Pass& p, const Fp8Matrix& m) {
  return g_opt.fp8_gemv && p.T <= FP8_GEMV_STEP && gemv_fp8_fits(p.T, m.K);
}
// y = the product of the step's quantized input (f.xq, f.xs) and m; add (the gemv only): y += it.
static void fp8_multiply(Pass& p, bf16* y, const Fp8Matrix& m, bool add) {
  Fp8Weights& f = g_fp8_weights;
  if (fp8_gemv_takes(p, m)) return gemv_fp8(y, f.xq, f.xs, (int)cdiv(p.T, 4) * 4, m, p.T, p.s, add);
  INTERNAL_CHECK(!add, "fp8_multiply: cuBLASLt's product does not add into y");
  fp8_product(*p.m.gemm, y, m, p.T, p.s);
}
static void fp8_norm_matmul(Pass& p, bf16* y, const bf16* norm_w, const bf16* W, int N) {
  Fp8Weights& f = g_fp8_weights;
  if (!f.held) return f.norm_matmul_bf16(p, y, norm_w, W, N);
  Activations& a = p.m.act;
  const int H = p.m.cfg.hidden_size;
  const float eps = p.m.cfg.rms_norm_eps;
  const Fp8Layer& fl = f.layers[p.l];
  const Fp8Matrix& m = norm_w == p.m.w.layers[p.l].input_layernorm ? fl.qkv : fl.gate_up;
  INTERNAL_CHECK(m.N == N, "fp8_norm_matmul: layer %d's matrix has %d rows, the stage asks for %d", p.l, m.N, N);
  if (p.pending) {  // several GPUs whose all-reduce left the add to the norm: Part I's, then the quantizer
    add_rmsnorm(a.x, a.residual, a.hidden, norm_w, p.T, H, eps, p.s);
    quantize_rows(f.xq, f.xs, a.x, p.T, H, p.s);
    p.pending = false;
  } else {  // the norm writes the quantized rows
    rmsnorm_quantize(f.xq, f.xs, a.residual, norm_w, p.T, H, eps, p.s);
  }
  fp8_multiply(p, y, m, false);
}
static void fp8_matmul_out(Pass& p, const bf16* x, const bf16* W, int K, bool gate_up) {
  Fp8Weights& f = g_fp8_weights;
  if (!f.held) return f.matmul_out_bf16(p, x, W, K, gate_up);
  Activations& a = p.m.act;
  const int H = p.m.cfg.hidden_size;
  const Fp8Matrix& m = gate_up ? f.layers[p.l].down : f.layers[p.l].o;
  if (gate_up) silu_quantize(f.xq, f.xs, x, p.T, K, p.s);  // SiLU-and-mul writes the quantized rows
  else quantize_rows(f.xq, f.xs, x, p.T, K, p.s);
  if (p.m.tp == 1 && fp8_gemv_takes(p, m)) {  // the residual add in the gemv's epilogue
    fp8_multiply(p, a.residual, m, true);
    p.pending = false;
    return;
  }
  fp8_multiply(p, a.hidden, m, false);
  p.pending = true;
  if (p.m.tp > 1 && g_stages.all_reduce(p.m.comm, a.hidden, (size_t)p.T * H, p.s, a.residual)) p.pending = false;
}

// The persistent kernel's plans (sections 24-27) with this engine's weights: FP8 where the chapter holds them
// (30a), else bf16.
static void fp8_persistent_model_ready(Qwen3& model, const Config& c) {
  persist_ready(model, c, g_fp8_weights.held ? persist_fp8_layer : nullptr);
}
static void apply_fp8_weights(bool on, Hooks& h) {
  g_opt.fp8_weights = on;
  g_fp8_weights.reset();
  if (!on) return;
  ForwardStages& st = stages_for(h);
  g_fp8_weights.norm_matmul_bf16 = st.norm_matmul;
  g_fp8_weights.matmul_out_bf16 = st.matmul_out;
  st.norm_matmul = fp8_norm_matmul;
  st.matmul_out = fp8_matmul_out;
  h.load_weights = fp8_load_weights;
  for (auto& ready : h.model_ready)
    if (ready == persist_model_ready) ready = fp8_persistent_model_ready;
}
static std::string fp8_weights_note(const Qwen3&) {
  const Fp8Weights& f = g_fp8_weights;
  if (f.held)
    return g_opt.fp8_gemv ? "FP8 weights: a gemv on the FP8 tensor cores at steps of 1-2 tokens, cuBLASLt's "
                            "block-scaled products at the others"
                          : "FP8 weights: cuBLASLt block-scaled products at every step size";
  if (!f.reason.empty()) return "fp8_weights stands aside (" + f.reason + "): the checkpoint is dequantized to bf16";
  return "";
}
static const int kFp8WeightsRegistered = register_optimization(
    {"fp8_weights", "an FP8 checkpoint's linear weights kept in FP8, products on FP8 tensor cores (section 28)",
     true, apply_fp8_weights, fp8_weights_note, {{"linear_weight_bytes_saved", 1}}, "fp8"});
// fp8_gemv fills no hook: fp8_weights' stages read g_opt.fp8_gemv.
static void apply_fp8_gemv(bool on, Hooks&) { g_opt.fp8_gemv = on; }
static const int kFp8GemvRegistered = register_optimization(
    {"fp8_gemv", "batch-1/2 products of FP8 weights in a tensor-core gemv with the residual add fused in "
     "(section 30)", true, apply_fp8_gemv});

// ==== 31. An FP8 KV cache, 1: the format, its scales, the store and prefill's tiles ========================
// defines: fp8e4m3, KVScales, KVLayerFp8, bf16x8_to_fp8x8, fp8x8_to_half8, half8_to_fp8x8, KVFp8,
//          kv_scale_for, kv_scales_from_weights, KVStoreFp8, qk_norm_rope_fp8
//          (section 32: decode, the stages, --kv-cache-dtype fp8)
//
// Replaces: the bf16 KV cache of sections 6b-8, when --kv-cache-dtype fp8 asks (vLLM's flag; the default,
// auto, is bf16). The layout, block tables, prefix caching, preemption, CUDA graphs and tensor parallelism
// (each rank its own heads) are unchanged: only the element is one byte instead of two.
// Why it is faster: at large batches a decode step mostly reads keys and values (nano-vllm's benchmark: about
// 9 bytes of cache per byte of weights), so half the bytes per value is close to half the step; and the pool
// holds twice the tokens in the same memory (bigger batches, fewer preemptions). The cost is precision.
//
// The format, e4m3 (OCP FP8, what vLLM's fp8 means): sign, 4 exponent bits (bias 7), 3 mantissa bits.
// Normal values 2^-6 .. 448, subnormals down to 2^-9; no infinities; 0x7f/0xff are NaN. Rounding to nearest
// keeps a relative error of at most 2^-4, the same at every magnitude: a float format, so it does
// not care where the values sit as long as they stay inside 2^-6 .. 448.
//
// Scales. A stored byte means (e4m3 value) x scale, one scale for the keys and one for the values of each
// layer (per tensor per layer, as vLLM's k_scale and v_scale). Because e4m3 is a float format, a scale only
// slides the window 2^-6 .. 448 along the number line: it must keep the largest value under 448 (above it,
// a value saturates, which silently distorts attention) and the bulk well above 2^-6 (below it precision
// thins out). The scales are chosen once, from the weights, as bounds no input can exceed:
//   keys:    k = RoPE(k_norm(x)): the RMSNorm'd head has sum of squares D, so every element of it, and every
//            rotated pair, is at most max|k_norm.weight| * sqrt(D);
//   values:  v_j = W_v[j] . (w_ln * u) with |u|^2 = H (u: the RMSNorm'd input before its weight w_ln), so
//            |v_j| <= sqrt(H) * |W_v[j] * w_ln| (Cauchy-Schwarz), the largest over this rank's rows j;
// each bound (raised by a hundredth for the bf16 roundings on the way) over 448, rounded up to a power of
// two. A typical element then lands about sqrt(D) (keys) or sqrt(H) (values) below 448, far above 2^-6. The
// docs/performance.md has the accuracy of this choice and of vLLM's default (scale 1.0);
// g_fp8_cache.scales_from_weights = false (section 32; the tests' switch) runs the latter.
// Why powers of two: dividing by one is exact, so the stored byte is the rounding of the bf16 value itself,
// whatever the scale, and the scale can be applied after the matrix products at no cost in accuracy.
//
// Writing (section 19's eight-lane qk_norm_rope and fused decode kernel, the persistent kernel): a bf16
// value / scale, rounded to nearest even, saturating at +-448 (cvt ... satfinite). Reading: every value is
// converted to fp16 (exact: every e4m3 value is an fp16 number; e4m3 -> fp16 is one instruction per pair, and
// there is none to bf16), the tensor cores multiply
// fp16 (the q fragments are converted once per thread block, exact for |q| up to 65504), and the key scale
// multiplies the scores' scale and the value scale the output, both once. Where the conversion happens
// differs: the prefill kernel stages a tile's bytes (cp.async, 16 values a copy) and every thread widens the
// chunks it copied itself into section 15's fp16 tile (no barrier: nobody else reads a thread's staged
// chunks); decode, which only streams, converts in registers on the way into the MMAs (section 32).
// How: this is a cache format in section 15's sense, KVFp8 (its pieces here and in section 32), and the
// chapter runs the kernels of sections 15, 16, 19 and 24-26 instantiated with it: its own stages of section
// 14's forward pass and its own persistent kernel, installed when an engine asks for fp8 (section 32).
// Needs: FP8 conversion instructions (compute capability 8.9 and later: Ada, Hopper); ModelRunner refuses
// --kv-cache-dtype fp8 on older GPUs with a message.


typedef __nv_fp8_e4m3 fp8e4m3;  // one byte: sign, 4 exponent bits, 3 mantissa bits
// A layer's scales: a stored key is k_true / k, a stored value v_true / v (powers of two).
struct KVScales {
  float k = 1.f, v = 1.f;
};
// One layer's fp8 cache as the launchers take it (KVFp8::Layer).
struct KVLayerFp8 {
  fp8e4m3* k;  // [NB, NKV/tp, P, D], one e4m3 byte per value
  fp8e4m3* v;
  KVScales scale;
};

// e4m3 -> fp16, exactly: every e4m3 value (normal 2^-6 .. 448, subnormal down to 2^-9) is an fp16 normal
// number, and one instruction converts a pair (cvt.rn.f16x2.e4m3x2). 8 values per call; the scale is left
// out here and applied by the attention kernels (KVFp8::score_scale, scale_output).
__device__ __forceinline__ uint4 fp8x8_to_half8(uint2 in) {
  const uint32_t w[2] = {in.x, in.y};
  uint4 out;
  uint32_t* o = &out.x;
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int half = 0; half < 2; half++) {
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w[i] >> (16 * half)), __NV_E4M3);
      o[2 * i + half] = (uint32_t)h.x | ((uint32_t)h.y << 16);
    }
  return out;
}
// fp16 values that are e4m3 values (tile values) -> their e4m3 bytes (exact: no rounding happens).
__device__ __forceinline__ uint2 half8_to_fp8x8(uint4 v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t b[4];
#pragma unroll
  for (int i = 0; i < 4; i++) {
    __half2_raw h;
    h.x = (unsigned short)(w[i] & 0xffff), h.y = (unsigned short)(w[i] >> 16);
    b[i] = __nv_cvt_halfraw2_to_fp8x2(h, __NV_SATFINITE, __NV_E4M3);
  }
  return make_uint2(b[0] | (b[1] << 16), b[2] | (b[3] << 16));
}
// 8 bf16 values / scale -> 8 e4m3 bytes, round to nearest even, saturating (the first value in the low byte).
__device__ __forceinline__ uint2 bf16x8_to_fp8x8(uint4 v, float scale) {
  float f[8];
  bf16x8_to_float(v, f);
  const float inv = 1.f / scale;  // a power of two: exact, and so is every product below
  uint32_t w[2];
#pragma unroll
  for (int i = 0; i < 2; i++) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(f[4 * i] * inv, f[4 * i + 1] * inv), __NV_SATFINITE,
                                                 __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(f[4 * i + 2] * inv, f[4 * i + 3] * inv),
                                                 __NV_SATFINITE, __NV_E4M3);
    w[i] = lo | (hi << 16);
  }
  return make_uint2(w[0], w[1]);
}
// Two e4m3 bytes (the low one first) -> fp16x2, exactly.
__device__ __forceinline__ uint32_t fp8x2_to_half2(uint32_t two_bytes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(two_bytes & 0xffff), __NV_E4M3);
  return (uint32_t)h.x | ((uint32_t)h.y << 16);
}


// ---- Prefill's tiles ----
// The ring of staging slots where the prefill kernel's fp8 tiles wait (section 15's tile pipeline). A slot is
// one tile of keys then one of values, FP8_TILE_BYTES each, row r's 16-byte chunk c (values 16c .. 16c+15)
// at chunk r * 8 + c: plain order, because only the thread that copied a chunk reads it back. Slots 0 and 1
// are the second bf16 stage of sK and of sV (the widened tile always goes to stage 0, so the second one is
// free): the ring of PREFILL_FP8_RING = 2 costs no shared memory.
constexpr int PREFILL_FP8_RING = 2;
constexpr int FP8_ROW_CHUNKS = HEAD_DIM / 16;                // 16-byte chunks in one fp8 row: 8
constexpr int FP8_TILE_BYTES = ATTN_KV_TILE * HEAD_DIM;      // 8 KiB
static_assert(2 * FP8_TILE_BYTES == ATTN_KV_TILE * HEAD_DIM * sizeof(bf16), "slots 0, 1 fill a bf16 stage");
__device__ __forceinline__ char* fp8_ring_slot(bf16* sK, bf16* sV, int i) {
  constexpr int TILE = ATTN_KV_TILE * HEAD_DIM;
  return reinterpret_cast<char*>((i == 0 ? sK : sV) + TILE);
}
__device__ __forceinline__ bf16* fp8_staged(char* slot, int kv, int r, int c) {
  return reinterpret_cast<bf16*>(slot + kv * FP8_TILE_BYTES + (r * FP8_ROW_CHUNKS + c) * 16);
}
// load_kv_tile for an fp8 cache, into a ring slot: the same rows (zero-filled past key_end), 8 threads per
// row.
template <int NTHREADS>
__device__ __forceinline__ void load_kv_tile_fp8(char* slot, const fp8e4m3* k_cache, const fp8e4m3* v_cache,
                                                 const int* block_table, int kvh, int NKV, int log2P, int key0,
                                                 int key_end) {
  const int chunk = threadIdx.x % FP8_ROW_CHUNKS;
#pragma unroll
  for (int r = threadIdx.x / FP8_ROW_CHUNKS; r < ATTN_KV_TILE; r += NTHREADS / FP8_ROW_CHUNKS) {
    const int key = key0 + r;
    const bool valid = key < key_end;
    const size_t offset = valid ? kv_cache_row(block_table, kvh, NKV, log2P, key) * HEAD_DIM + chunk * 16 : 0;
    cp_async_16(fp8_staged(slot, 0, r, chunk), reinterpret_cast<const bf16*>(k_cache + offset), valid);
    cp_async_16(fp8_staged(slot, 1, r, chunk), reinterpret_cast<const bf16*>(v_cache + offset), valid);
  }
}
// Every thread widens the chunks it copied into the bf16 tiles sK, sV (stage 0). No barrier is needed
// before: each thread reads only its own copies, and the barrier that ended the previous tile's attention
// freed stage 0.
template <int NTHREADS>
__device__ __forceinline__ void widen_kv_tile_fp8(const char* slot, bf16* sK, bf16* sV) {
  const int chunk = threadIdx.x % FP8_ROW_CHUNKS;
#pragma unroll
  for (int r = threadIdx.x / FP8_ROW_CHUNKS; r < ATTN_KV_TILE; r += NTHREADS / FP8_ROW_CHUNKS) {
    const uint4 k = *reinterpret_cast<const uint4*>(fp8_staged(const_cast<char*>(slot), 0, r, chunk));
    const uint4 v = *reinterpret_cast<const uint4*>(fp8_staged(const_cast<char*>(slot), 1, r, chunk));
    *reinterpret_cast<uint4*>(sK + attn_smem_index(r, 2 * chunk)) = fp8x8_to_half8({k.x, k.y});
    *reinterpret_cast<uint4*>(sK + attn_smem_index(r, 2 * chunk + 1)) = fp8x8_to_half8({k.z, k.w});
    *reinterpret_cast<uint4*>(sV + attn_smem_index(r, 2 * chunk)) = fp8x8_to_half8({v.x, v.y});
    *reinterpret_cast<uint4*>(sV + attn_smem_index(r, 2 * chunk + 1)) = fp8x8_to_half8({v.z, v.w});
  }
}


// ---- The format as section 15's kernels take it ----
// KVFp8: section 15's KVBf16 for this cache. Tiles of fp16 (every e4m3 value exactly); the prefill pipeline
// stages a tile's bytes in the ring above and widens them into stage 0 (tile_ready); the q fragments become
// fp16 (exact for |q| up to 65504), the scores take the key scale and the output the value scale; the store
// divides by the layer's scale and rounds to e4m3, and the values an attention tile then holds (tile values)
// are those bytes widened. Section 32 adds its decode loop and the persistent kernel's reads.
struct KVFp8 {
  using Elem = fp8e4m3;
  using Tile = __half;
  using Scales = KVScales;
  using Layer = KVLayerFp8;
  static fp8e4m3* keys(const KVLayerFp8& c) { return c.k; }
  static fp8e4m3* values(const KVLayerFp8& c) { return c.v; }
  static KVScales scales(const KVLayerFp8& c) { return c.scale; }

  static constexpr int tiles_ahead = PREFILL_FP8_RING - 1;
  template <int NTHREADS>
  __device__ static __forceinline__ void issue_tile(bf16* sK, bf16* sV, const fp8e4m3* k_cache,
                                                    const fp8e4m3* v_cache, const int* block_table, int kvh,
                                                    int NKV, int log2P, int index, int key0, int key_end, int) {
    load_kv_tile_fp8<NTHREADS>(fp8_ring_slot(sK, sV, index % PREFILL_FP8_RING), k_cache, v_cache, block_table, kvh,
                               NKV, log2P, key0, key_end);
  }
  template <int NTHREADS>
  __device__ static __forceinline__ void tile_ready(bf16* sK, bf16* sV, int index, bf16*& sK_t, bf16*& sV_t) {
    widen_kv_tile_fp8<NTHREADS>(fp8_ring_slot(sK, sV, index % PREFILL_FP8_RING), sK, sV);
    sK_t = sK, sV_t = sV;
  }
  __device__ static __forceinline__ void mma(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    mma_f16_16816(acc, a, b0, b1);
  }
  __device__ static __forceinline__ uint32_t pack(float lo, float hi) { return pack_half2(lo, hi); }
  __device__ static __forceinline__ void tile_q(uint32_t (&q)[HEAD_DIM / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; kk++)
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&q[kk][i]));
        const __half2 h = __floats2half2_rn(f.x, f.y);
        q[kk][i] = *reinterpret_cast<const uint32_t*>(&h);
      }
  }
  __device__ static __forceinline__ float score_scale(float scale_log2, KVScales s) { return scale_log2 * s.k; }
  __device__ static __forceinline__ void scale_output(float (&o)[HEAD_DIM / 8][4], KVScales s) {
#pragma unroll
    for (int d = 0; d < HEAD_DIM / 8; d++)
#pragma unroll
      for (int e = 0; e < 4; e++) o[d][e] *= s.v;
  }

  __device__ static __forceinline__ void store_key(fp8e4m3* row, int chunk, uint4 v, KVScales s) {
    reinterpret_cast<uint2*>(row)[chunk] = bf16x8_to_fp8x8(v, s.k);
  }
  __device__ static __forceinline__ void store_value(fp8e4m3* row, int chunk, uint4 v, KVScales s) {
    reinterpret_cast<uint2*>(row)[chunk] = bf16x8_to_fp8x8(v, s.v);
  }
  __device__ static __forceinline__ uint4 key_tile_values(uint4 v, KVScales s) {
    return fp8x8_to_half8(bf16x8_to_fp8x8(v, s.k));
  }
  __device__ static __forceinline__ uint4 value_tile_values(uint4 v, KVScales s) {
    return fp8x8_to_half8(bf16x8_to_fp8x8(v, s.v));
  }
  __device__ static __forceinline__ void store_tile_values(fp8e4m3* row, int chunk, uint4 tile_values) {
    reinterpret_cast<uint2*>(row)[chunk] = half8_to_fp8x8(tile_values);
  }
};

// What the kernels compute, on the CPU: e4m3 rounding is section 28's e4m3_from_float, its inverse
// e4m3_to_float (safetensors.h).

// The scale for values bounded by `bound`: the smallest power of two s with bound / s <= 448, kept within
// 2^-100 .. 2^7 (a bound above 448 x 2^7 = 57,344 would be beyond any bf16 model's K or V).
static float kv_scale_for(double bound) {
  int e = bound > 0 ? (int)std::ceil(std::log2(bound / 448.0)) : 0;
  e = std::min(7, std::max(-100, e));
  return std::ldexp(1.f, e);
}

// Per layer: the scales from the weight bounds above, for this rank's heads (its slice of W_v).
static std::vector<KVScales> kv_scales_from_weights(const Weights& w, const ModelConfig& c, int tp) {
  const int64_t H = c.hidden_size, D = c.head_dim, NH = c.num_attention_heads / tp;
  const int64_t NKV = c.num_key_value_heads / tp;
  std::vector<KVScales> scales;
  std::vector<bf16> k_norm(D), ln(H), wv((size_t)NKV * D * H);
  auto to_host = [](std::vector<bf16>& dst, const bf16* src) {
    CUDA_CHECK(cudaMemcpy(dst.data(), src, dst.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
  };
  for (size_t l = 0; l < w.layers.size(); l++) {
    const LayerWeights& lw = w.layers[l];
    to_host(k_norm, lw.k_norm);
    to_host(ln, lw.input_layernorm);
    std::vector<float> wvf;  // the v rows of the fused qkv weight, as float
    if (lw.qkv_proj) {
      to_host(wv, lw.qkv_proj + (NH + NKV) * D * H);
      for (bf16 x : wv) wvf.push_back(__bfloat162float(x));
    } else {  // held in FP8 (section 28)
      wvf = fp8_matrix_rows(g_fp8_weights.layers[l].qkv, (NH + NKV) * D, NKV * D);
    }
    double k_max = 0, v_row_max = 0;
    for (bf16 x : k_norm) k_max = std::max(k_max, std::fabs((double)__bfloat162float(x)));
    std::vector<double> lnf(H);
    for (int64_t i = 0; i < H; i++) lnf[i] = __bfloat162float(ln[i]);
    for (int64_t j = 0; j < NKV * D; j++) {
      double ss = 0;
      for (int64_t i = 0; i < H; i++) {
        const double a = (double)wvf[j * H + i] * lnf[i];
        ss += a * a;
      }
      v_row_max = std::max(v_row_max, std::sqrt(ss));
    }
    scales.push_back({kv_scale_for(1.01 * k_max * std::sqrt((double)D)),
                      kv_scale_for(1.01 * v_row_max * std::sqrt((double)H))});
  }
  return scales;
}


// ---- The store: section 19's eight-lane qk_norm_rope into an fp8 cache ----
// Its store policy for this cache: the same chunks, each 8 bf16 values divided by the layer's scale and
// rounded to e4m3 (8 bytes).
struct KVStoreFp8 {
  fp8e4m3* k_cache;  // [NB, NKV, P, D]
  fp8e4m3* v_cache;
  KVScales scale;
  __device__ void key(int64_t row, int chunk, uint4 v) const {
    KVFp8::store_key(k_cache + row * HEAD_DIM, chunk, v, scale);
  }
  __device__ void value(int64_t row, int chunk, uint4 v) const {
    KVFp8::store_value(v_cache + row * HEAD_DIM, chunk, v, scale);
  }
};
// Section 7's qk_norm_rope (the same arguments) for an fp8 cache.
static void qk_norm_rope_fp8(bf16* qkv, const int* positions, const bf16* q_norm_w, const bf16* k_norm_w,
                             const KVLayerFp8& cache, const int* slot_mapping, int T, int NH, int NKV, int P,
                             float rope_theta, float eps, cudaStream_t stream) {
  check_aligned16("qk_norm_rope_fp8", "qkv", qkv);
  check_aligned16("qk_norm_rope_fp8", "q_norm_w", q_norm_w);
  check_aligned16("qk_norm_rope_fp8", "k_norm_w", k_norm_w);
  INTERNAL_CHECK(P > 0, "qk_norm_rope_fp8: block size P = %d", P);
  if (T == 0) return;
  qk_norm_rope_fast_kernel<<<T, qk_norm_rope_fast_threads(NH, NKV), 0, stream>>>(
      qkv, positions, q_norm_w, k_norm_w, KVStoreFp8{cache.k, cache.v, cache.scale}, slot_mapping, NH, NKV, P, eps,
      rope_inv_freq(rope_theta));
  CUDA_CHECK(cudaGetLastError());
}


// ==== 32. The FP8 KV cache, 2: decode attention over it, the persistent kernel, the stages =================
// defines: DecodeAccFp8, DecodeLoop<KVFp8>, fp8_decode_attend, PersistKV<KVFp8>, Fp8Cache, g_fp8_cache,
//          store_qkv_fp8, attention_prefill_fp8, attention_decode_fp8, apply_fp8_cache, use_fp8_cache;
//          --kv-cache-dtype fp8; switch longest_first (32a)
//
// Section 31's format, continued: how decode reads it (its own loop: the tile pipeline is prefill's), how the
// persistent kernel reads it, and the format's apply: the stages of section 14's forward pass and the
// persistent kernel that an engine with an fp8 cache runs, installed as every chapter installs its change
// (section 14's stages_for), when the engine installs its optimizations and cache format (section 11).
//
// The tile pipeline of section 31 is how the prefill kernel reads fp8: stage a 64-key tile, widen it to fp16 in
// shared memory, a barrier, the tensor cores, a barrier. For decode, which only streams, that is slow: it
// keeps one 16 KiB fp8 tile in flight per thread block (the staging slots live in the shadow of the bf16
// tile, half of what bf16 keeps in flight at the same shared memory), and every byte makes an extra round
// trip through shared memory to be widened (docs/performance.md has the measurement).
//
// The decode loop below reads fp8 the way the bf16 kernel reads bf16: tiles of FP8_TILE_KEYS = 128 keys
// (16 KiB of keys and 16 of values: the bytes of a bf16 tile), two stages, the next tile in flight while
// this one is computed, every copy instruction reading whole 128-byte rows. What it drops is the widening
// pass: every lane reads the bytes it will feed to the tensor cores from the staged tile straight into
// registers and converts them there (one cvt.rn.f16x2.e4m3x2 per pair of values) into MMA fragments. Warp
// w takes two slices of 16 keys of each tile, rows 16w .. 16w+15 and 64+16w .. 64+16w+15 (fp8_attend_slice).
//
// Keys on the MMA's rows. Section 15 puts the GQA group's query heads on the 16 rows of mma.m16n8k16 and
// keys on its 8 columns; with 2 heads per group (Qwen3-0.6B) 14 of the 16 rows are padding, and the online
// softmax, which runs on every element a lane holds, does 8 times the work it needs. Half the bytes per key
// make that matter: per byte of cache an fp8 tile holds twice the keys, so twice the MMAs and softmax steps
// of a bf16 one, and the kernel ran out of instruction issue before it ran out of bandwidth. So the fp8 loop
// computes the transposed products, with the keys (and, for P V, the head dims) on the 16 rows and the heads
// on the 8 columns:
//   S^T = K Q^T      16 keys x 8 heads per k-step of 16 dims: 8 MMAs a slice instead of 16;
//   O^T += V^T P^T   16 dims x 8 heads per k-step of 16 keys: 8 MMAs a slice instead of 16.
// A lane then holds 4 scores (keys g and g + 8, heads 2c and 2c + 1: g = lane/4, c = lane%4) instead of 8,
// and the softmax's max and sum run over the 8 lanes of one c. P^T must reach the second product as a B
// fragment (lane g: head g, keys 2c, 2c + 1), while the first product left it with lane g holding key g:
// movmatrix, the warp's transpose of an 8 x 8 matrix of 16-bit values, moves it over, once per 8 keys.
// A group of more than 8 heads takes two column tiles (NT = 2); Qwen3's groups have at most 8.
//
// What makes the register route possible is a choice of order. An A fragment of mma.m16n8k16 (section 15's
// vocabulary) wants, in lane (g, c), two consecutive values along k at k = 2c and 2c + 8, of rows g and
// g + 8. Fed from a row of the cache that would be 2-byte pieces scattered over the row. But a dot product
// does not care in which order its terms are added, so the kernel renames:
//   S^T         sums over the head dims: lane c reads, of key rows g and g + 8, the 16 bytes 16c .. 16c+15
//               and the 16 bytes 64+16c .. 64+16c+15, and uses its 4-byte word kk as k-slice kk's values
//               2c, 2c+1, 2c+8, 2c+9. The Q fragments are built with the same renaming
//               (fp8_decode_q_fragments), so every product pairs q_d with k_d as before.
//   O^T         sums over keys, and its rows are head dims: lane g reads bytes 16g .. 16g+15 of the value
//               rows of keys 2c, 2c+1, 2c+8, 2c+9, and row-tile mt takes bytes 2mt (row g) and 2mt + 1
//               (row g + 8). So accumulator o[mt][e] holds head 2c + e%2 at head dim 16g + 2mt + e/2, which
//               fp8_decode_store_partials writes back in head-dim order.
// An A fragment of V^T pairs one dim of two keys, so those bytes are paired first (one byte_perm per two
// pairs). Every read is 16 bytes, and the tile is swizzled like section 15's, which spreads a read over the
// banks (the key reads still meet 2-way conflicts).
// Thread-block tiles as large as the bf16 kernel's are what streams at its rate: how the cache is fetched,
// not the conversions, decides the speed (docs/performance.md: the variants measured).
constexpr int FP8_TILE_KEYS = 2 * ATTN_KV_TILE;               // keys per fp8 decode tile: 128
constexpr int FP8_STAGE_BYTES = 2 * FP8_TILE_KEYS * HEAD_DIM;  // its keys and values: 32 KiB, a bf16 tile's
static_assert(DECODE_ROWS * HEAD_DIM * sizeof(bf16) + ATTN_STAGES * FP8_STAGE_BYTES <= DECODE_SMEM,
              "two fp8 stages fit in a decode thread block's shared memory");

// The running sums of a decode thread block (section 16's DecodeAcc), with the heads 8..15 of a group larger
// than 8 in m_hi, l_hi: the products below put keys on the MMA rows and heads on its columns.
struct DecodeAccFp8 {
  float o[HEAD_DIM / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float m_hi[2] = {-INFINITY, -INFINITY}, l_hi[2] = {0.f, 0.f};
};

// Where lane's chunk i of a 16-key slice comes from: the key row (0..15 within the slice) and the byte
//   i = 0, 1: key row g,     bytes 16c and 64 + 16c        i = 2, 3: key row g + 8, the same bytes
//   i = 4..7: value rows 2c, 2c + 1, 2c + 8, 2c + 9, bytes 16g
// (16 bytes each; i < 4 from the key tile, the rest from the value tile).
constexpr int FP8_SLICE_KEYS = 16;
constexpr int FP8_SLICE_CHUNKS = 8;
static_assert(DECODE_WARPS * 2 * FP8_SLICE_KEYS == FP8_TILE_KEYS, "each warp takes two slices of every tile");
__device__ __forceinline__ void fp8_slice_source(int i, int& row, int& byte) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  if (i < 4) row = g + 8 * (i >> 1), byte = 16 * c + 64 * (i & 1);
  else row = 2 * c + (i & 1) + 8 * ((i - 4) >> 1), byte = 16 * g;
}
// The head dim of k-slice kk's value e (0..3: MMA k = 2c, 2c+1, 2c+8, 2c+9) in lane c (see above).
__device__ __forceinline__ int fp8_key_dim(int c, int kk, int e) {
  return (kk < 4 ? 16 * c + 4 * kk : 64 + 16 * c + 4 * (kk - 4)) + e;
}

// A staged tile: FP8_TILE_KEYS rows of keys (128 bytes each), then as many of values; 16-byte chunk c of row
// r at r * 128 + 16 * (c ^ (r % 8)), the XOR swizzle of section 15 on 8 chunks a row.
constexpr int FP8_TILE_HALF = FP8_TILE_KEYS * HEAD_DIM;  // bytes of keys (or of values) in a tile: 16 KiB
static_assert(2 * FP8_TILE_HALF == FP8_STAGE_BYTES, "a stage is a tile of keys and one of values");
__device__ __forceinline__ int fp8_tile_offset(int row, int chunk) {
  return row * HEAD_DIM + ((chunk ^ (row & 7)) << 4);
}

// Issue (not wait for) the copies of keys key0 .. key0 + FP8_TILE_KEYS - 1 into `stage`, all DECODE_WARPS * 32
// threads, 8 threads a row (so one copy instruction reads 4 whole rows). Keys at or past key_end, and
// skip_key (this step's own key, which the fused kernel holds itself), are zero-filled instead of read;
// slices of 16 keys that lie wholly past key_end are not written at all (nobody reads them).
__device__ __forceinline__ void fp8_issue_tile(char* stage, const fp8e4m3* k_cache, const fp8e4m3* v_cache,
                                               const int* block_table, int kvh, int NKV, int log2P, int key0,
                                               int key_end, int skip_key) {
  const int chunk = threadIdx.x & 7;
#pragma unroll
  for (int r = threadIdx.x >> 3; r < FP8_TILE_KEYS; r += DECODE_WARPS * 32 / 8) {
    const int key = key0 + r;
    if (key0 + (r & ~(FP8_SLICE_KEYS - 1)) >= key_end) break;  // a slice no warp reads (past the partition)
    const bool valid = key < key_end && key != skip_key;
    const size_t off = valid ? kv_cache_row(block_table, kvh, NKV, log2P, key) * HEAD_DIM + chunk * 16 : 0;
    cp_async_16(reinterpret_cast<bf16*>(stage + fp8_tile_offset(r, chunk)),
                reinterpret_cast<const bf16*>(k_cache + off), valid);
    cp_async_16(reinterpret_cast<bf16*>(stage + FP8_TILE_HALF + fp8_tile_offset(r, chunk)),
                reinterpret_cast<const bf16*>(v_cache + off), valid);
  }
}
// The first tile of a decode thread block's partition into stage 0, as one committed group.
__device__ __forceinline__ void fp8_decode_issue_first(char* stages, const fp8e4m3* k_cache, const fp8e4m3* v_cache,
                                                       const int* block_table, int kvh, int NKV, int log2P,
                                                       int key_begin, int key_end, int skip_key) {
  fp8_issue_tile(stages, k_cache, v_cache, block_table, kvh, NKV, log2P, key_begin, key_end, skip_key);
  cp_async_commit();
}

// The group's Q tile (bf16, swizzled, section 15's layout) as fp16 A fragments in the renamed dim order:
// fragment kk, register e holds rows g (e even) or g + 8 (e odd) at the dims of values 2(e/2), 2(e/2) + 1.
__device__ __forceinline__ void fp8_decode_q_fragments(uint32_t (&q)[HEAD_DIM / 16][4], const bf16* sQ) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int kk = 0; kk < HEAD_DIM / 16; kk++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int row = g + 8 * (e & 1), d = fp8_key_dim(c, kk, 2 * (e >> 1));
      const float2 f = __bfloat1622float2(
          *reinterpret_cast<const __nv_bfloat162*>(sQ + attn_smem_index(row, d >> 3) + (d & 7)));
      const __half2 h = __floats2half2_rn(f.x, f.y);  // exact: a bf16 q below 65504 is an fp16 number
      q[kk][e] = *reinterpret_cast<const uint32_t*>(&h);
    }
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int w) {
  return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

// The warp's transpose of an 8 x 8 matrix of 16-bit values: lane (g, c) gives its row g, columns 2c, 2c + 1
// (an accumulator's layout) and gets back row g of the transpose, i.e. column g, rows 2c, 2c + 1.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// One warp's slice of 16 keys from the registers x (its chunks, fp8_slice_source's order), for the group's
// heads 0..8NT-1 (8NT >= the group): S^T = K Q^T, the online softmax per head, O^T += V^T P^T (see above).
template <int NT>
__device__ __forceinline__ void fp8_attend_slice(const uint32_t (&q)[HEAD_DIM / 16][4], const uint4 (&x)[8],
                                                 int key0, int key_end, float scale_log2, DecodeAccFp8& sums) {
  const int g = (threadIdx.x & 31) >> 2;
  float s[NT][4] = {};  // [column tile][e]: key g + 8 (e / 2), head 2c + e % 2 (+ 8 per column tile)
#pragma unroll
  for (int kk = 0; kk < HEAD_DIM / 16; kk++) {
    const uint32_t w0 = word_of(x[kk / 4], kk % 4), w1 = word_of(x[2 + kk / 4], kk % 4);  // key rows g, g + 8
    const uint32_t a[4] = {fp8x2_to_half2(w0), fp8x2_to_half2(w1), fp8x2_to_half2(w0 >> 16),
                           fp8x2_to_half2(w1 >> 16)};
#pragma unroll
    for (int nt = 0; nt < NT; nt++) mma_f16_16816(s[nt], a, q[kk][nt], q[kk][2 + nt]);
  }
  // The online softmax of section 15 (online_softmax_update), per head: a lane holds two keys of it, and
  // the other seven pairs sit in the lanes of the same c (xor-shuffles over 4, 8, 16).
  uint32_t p[NT][2];  // P^T as B fragments: keys 2c, 2c + 1 (then + 8) of head g
#pragma unroll
  for (int nt = 0; nt < NT; nt++) {
    if (key0 + 16 > key_end)
#pragma unroll
      for (int e = 0; e < 4; e++)
        if (key0 + g + 8 * (e >> 1) >= key_end) s[nt][e] = -INFINITY;
#pragma unroll
    for (int i = 0; i < 2; i++) {
      float& m = nt ? sums.m_hi[i] : sums.m[i];
      float& l = nt ? sums.l_hi[i] : sums.l[i];
      float mx = fmaxf(m, fmaxf(s[nt][i], s[nt][2 + i]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      const float m_scaled = mx == -INFINITY ? 0.f : mx * scale_log2;  // as in online_softmax_update
      const float alpha = fast_exp2(m * scale_log2 - m_scaled);
      m = mx;
      s[nt][i] = fast_exp2(fmaf(s[nt][i], scale_log2, -m_scaled));
      s[nt][2 + i] = fast_exp2(fmaf(s[nt][2 + i], scale_log2, -m_scaled));
      l = l * alpha + (s[nt][i] + s[nt][2 + i]);
#pragma unroll
      for (int mt = 0; mt < HEAD_DIM / 16; mt++) sums.o[8 * nt + mt][i] *= alpha, sums.o[8 * nt + mt][2 + i] *= alpha;
    }
    p[nt][0] = movmatrix_trans(pack_half2(s[nt][0], s[nt][1]));
    p[nt][1] = movmatrix_trans(pack_half2(s[nt][2], s[nt][3]));
  }
#pragma unroll
  for (int w = 0; w < 4; w++) {  // bytes 4w .. 4w+3 of the four value chunks: row tiles 2w and 2w + 1
    const uint32_t a = word_of(x[4], w), b = word_of(x[5], w), c = word_of(x[6], w), d = word_of(x[7], w);
    const uint32_t ab[2] = {__byte_perm(a, b, 0x5140), __byte_perm(a, b, 0x7362)};  // a0 b0 a1 b1, a2 b2 a3 b3
    const uint32_t cd[2] = {__byte_perm(c, d, 0x5140), __byte_perm(c, d, 0x7362)};
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const uint32_t v[4] = {fp8x2_to_half2(ab[h]), fp8x2_to_half2(ab[h] >> 16), fp8x2_to_half2(cd[h]),
                             fp8x2_to_half2(cd[h] >> 16)};
#pragma unroll
      for (int nt = 0; nt < NT; nt++) mma_f16_16816(sums.o[8 * nt + 2 * w + h], v, p[nt][0], p[nt][1]);
    }
  }
}

// The decode loop of a thread block over keys [key_begin, key_end) of an fp8 cache: issue tile t + 1 into
// the other stage, wait for tile t, and let each warp read its two slices of it into registers and attend.
// new_key: this step's key, whose bytes come from new_kv (section 19's tile values, fp16: converted back to
// the bytes the cache holds) instead of the cache; -1: none. The caller issued the first tile
// (fp8_decode_issue_first). A partition need not be a whole number of these tiles (the cluster kernel's and
// small batches' are multiples of 64 keys): rows past key_end are zero-filled, never read, and masked. The
// loop's last barrier frees the stages for decode_combine_warps. group: the GQA group's query heads (one
// column tile of the products up to 8, two up to 16).
__device__ __forceinline__ void fp8_decode_attend(const uint32_t (&q)[HEAD_DIM / 16][4], char* stages,
                                                  const fp8e4m3* k_cache, const fp8e4m3* v_cache, KVScales kv_scale,
                                                  const int* block_table, int kvh, int NKV, int log2P, int key_begin,
                                                  int key_end, int new_key, const uint4 (*new_kv)[HEAD_DIM / 8],
                                                  int group, float scale_log2, DecodeAccFp8& sums) {
  const int n_tiles = cdiv_dev(key_end - key_begin, FP8_TILE_KEYS), warp = threadIdx.x >> 5;
  for (int t = 0; t < n_tiles; t++) {
    if (t + 1 < n_tiles)
      fp8_issue_tile(stages + ((t + 1) & 1) * FP8_STAGE_BYTES, k_cache, v_cache, block_table, kvh, NKV, log2P,
                     key_begin + (t + 1) * FP8_TILE_KEYS, key_end, new_key);
    cp_async_commit();
    cp_async_wait<1>();  // tile t has landed (this thread's copies) ...
    __syncthreads();     // ... and everyone's
    const char* stage = stages + (t & 1) * FP8_STAGE_BYTES;
#pragma unroll
    for (int j = 0; j < 2; j++) {
      // warp w: rows 16w .. 16w+15 and 64+16w .. (a partition of 64 keys still gives every warp a slice)
      const int row0 = FP8_SLICE_KEYS * (warp + DECODE_WARPS * j), key0 = key_begin + t * FP8_TILE_KEYS + row0;
      if (key0 >= key_end) continue;
      uint4 x[FP8_SLICE_CHUNKS];
#pragma unroll
      for (int i = 0; i < FP8_SLICE_CHUNKS; i++) {
        int row, byte;
        fp8_slice_source(i, row, byte);
        x[i] = *reinterpret_cast<const uint4*>(stage + (i < 4 ? 0 : FP8_TILE_HALF) +
                                               fp8_tile_offset(row0 + row, byte / 16));
      }
      if (new_key >= key0 && new_key < key0 + FP8_SLICE_KEYS) {  // this step's key (zero-filled in the tile)
#pragma unroll
        for (int i = 0; i < FP8_SLICE_CHUNKS; i++) {
          int row, byte;
          fp8_slice_source(i, row, byte);
          if (key0 + row != new_key) continue;
          const uint4* tile = new_kv[i < 4 ? 0 : 1] + byte / 8;  // 8 values per fp16 chunk
          const uint2 lo = half8_to_fp8x8(tile[0]), hi = half8_to_fp8x8(tile[1]);
          x[i] = make_uint4(lo.x, lo.y, hi.x, hi.y);
        }
      }
      if (group <= 8) fp8_attend_slice<1>(q, x, key0, key_end, scale_log2, sums);
      else fp8_attend_slice<2>(q, x, key0, key_end, scale_log2, sums);
    }
    __syncthreads();  // every warp is done with stage t % 2 before tile t + 2 is issued into it
  }
  KVFp8::scale_output(sums.o, kv_scale);
}

// A warp's sums of the fp8 loop into decode_combine_warps' buffers, in the bf16 layout: sO[warp][head][dim]
// and sML[warp][head] = (m in log2 units, l). Accumulator o[8 nt + mt][e] holds head 2c + e % 2 + 8 nt at
// dim 16g + 2mt + e / 2; each lane holds a partial l of its keys, summed here over the lanes of one c. Only
// the column tiles the loop used (fp8_attend_slice<NT>) are written: heads past them are never read.
__device__ __forceinline__ void fp8_decode_store_partials(DecodeAccFp8& sums, float scale_log2, int group, float* sO,
                                                          float* sML) {
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
#pragma unroll
  for (int nt = 0; nt < 2; nt++) {
    if (nt == 1 && group <= 8) break;  // one column tile (fp8_decode_attend's choice)
#pragma unroll
    for (int i = 0; i < 2; i++) {
      const int head = warp * DECODE_ROWS + 8 * nt + 2 * c + i;
      float& l = nt ? sums.l_hi[i] : sums.l[i];
      l += __shfl_xor_sync(0xffffffffu, l, 4);
      l += __shfl_xor_sync(0xffffffffu, l, 8);
      l += __shfl_xor_sync(0xffffffffu, l, 16);
#pragma unroll
      for (int mt = 0; mt < HEAD_DIM / 16; mt++)
        *reinterpret_cast<float2*>(sO + head * HEAD_DIM + 16 * g + 2 * mt) =
            make_float2(sums.o[8 * nt + mt][i], sums.o[8 * nt + mt][2 + i]);
      if (g == 0) sML[head * 2] = (nt ? sums.m_hi[i] : sums.m[i]) * scale_log2, sML[head * 2 + 1] = l;
    }
  }
}


// The loop as section 16's kernel and section 19's fused kernel take it (their DecodeLoop<F>).
template <>
struct DecodeLoop<KVFp8> {
  using Acc = DecodeAccFp8;
  // Partitions twice as long as bf16's (decode_partition): the same bytes per thread block.
  static int partition(int B) { return 2 * decode_partition(B); }
  __device__ static __forceinline__ void issue_first(bf16* sK, bf16*, const fp8e4m3* k_cache, const fp8e4m3* v_cache,
                                                     const int* block_table, int kvh, int NKV, int log2P,
                                                     int key_begin, int key_end, int skip_key) {
    fp8_decode_issue_first(reinterpret_cast<char*>(sK), k_cache, v_cache, block_table, kvh, NKV, log2P, key_begin,
                           key_end, skip_key);
  }
  __device__ static __forceinline__ void q_fragments(uint32_t (&q)[HEAD_DIM / 16][4], const bf16* sQ) {
    fp8_decode_q_fragments(q, sQ);
  }
  // Each warp takes this step's key from new_kv when its slice holds it.
  __device__ static __forceinline__ void attend(const uint32_t (&q)[HEAD_DIM / 16][4], bf16* sK, bf16*,
                                                const fp8e4m3* k_cache, const fp8e4m3* v_cache, KVScales kv_scale,
                                                const int* block_table, int kvh, int NKV, int log2P, int key_begin,
                                                int key_end, int new_key, const uint4 (*new_kv)[HEAD_DIM / 8],
                                                int group, float scale_log2, Acc& sums) {
    fp8_decode_attend(q, reinterpret_cast<char*>(sK), k_cache, v_cache, kv_scale, block_table, kvh, NKV, log2P,
                      key_begin, key_end, new_key, new_kv, group, scale_log2, sums);
  }
  __device__ static __forceinline__ void store_partials(Acc& sums, float scale_log2, int group, float* sO,
                                                        float* sML) {
    fp8_decode_store_partials(sums, scale_log2, group, sO, sML);
  }
};

// ---- The persistent kernel over an fp8 cache (sections 24-26) ----
// What changes is only what its attention reads: a lane's 4 values of a row are 4 bytes instead of 8, widened
// with the conversion above; the key scale joins the scores' scale and the value scale the partition's output,
// and the step's own key and value are rounded to e4m3 before they are used (and stored), as this chapter's
// other kernels use them. At batch 1 a step's cache bytes are a few percent of its weights', so the kernel is
// what makes an fp8 engine's latency the same as a bf16 one's.
template <>
struct PersistKV<KVFp8> {
  using Word = uint32_t;
  __device__ static void widen(uint32_t w, float (&f)[4]) {
    const uint32_t h[2] = {fp8x2_to_half2(w), fp8x2_to_half2(w >> 16)};
    const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&h[0]));
    const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&h[1]));
    f[0] = lo.x, f[1] = lo.y, f[2] = hi.x, f[3] = hi.y;
  }
  // 8 tile values (fp16: e4m3 values, unscaled) as floats
  __device__ static void tile_floats(uint4 v, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const float2 x = __half22float2(h[i]);
      f[2 * i] = x.x, f[2 * i + 1] = x.y;
    }
  }
  __device__ static __forceinline__ KVScales scales(const PersistOp& op) { return {op.kv_scale[0], op.kv_scale[1]}; }
  __device__ static __forceinline__ float key_factor(KVScales s) { return s.k; }
  __device__ static __forceinline__ float value_factor(KVScales s) { return s.v; }  // (a power of two: exact)
};

// This chapter's state, for the engine built last: reset by the format's apply (apply_fp8_cache, below),
// which install_optimizations runs for every engine, fp8 or not.
struct Fp8Cache {
  bool on = false;                  // the engine's cache is fp8 (apply_fp8_cache)
  std::vector<KVScales> scales;     // [L] per layer (use_fp8_cache, before the pool is sized)
  bool scales_from_weights = true;  // a setting, kept across engines: tests set it false to run vLLM's
                                    // default scales (1.0) instead of the weight bounds of section 31
};
static Fp8Cache g_fp8_cache;
static void fp8_layer_scales(int l, float (&kv_scale)[2]) {
  kv_scale[0] = g_fp8_cache.scales.at(l).k, kv_scale[1] = g_fp8_cache.scales.at(l).v;
}
static const PersistFormat kPersistFp8 = {"fp8", 1, fp8_layer_scales,
                                          {persist_kernels<KVFp8, PERSIST_ONE_GPU>(), {}, {}}};

// ---- Section 14's stages for an fp8 cache ----
// The kernels of the bf16 path, instantiated with KVFp8: store_qkv is section 19's eight-lane kernel;
// attention_prefill section 16's step (section 15's prefill kernel, and the decode rows' kernel); the decode
// rows' kernel and attention_decode follow the switches cluster_merge and fused_rope as bf16's do, except
// that above the cluster kernel's batches the fused kernel is slower over fp8 (docs/performance.md), so
// there attention_decode is the store, then section 16's decode kernel.
static KVLayerFp8 fp8_layer(const KVCache& kv, int l) {
  const KVLayer p = kv.layer(l);  // (the byte offsets already follow kv.value_bytes)
  return {(fp8e4m3*)p.k, (fp8e4m3*)p.v, g_fp8_cache.scales.at(l)};
}
static void store_qkv_fp8(Pass& p, int l) { store_qkv_using(p, l, qk_norm_rope_fp8, fp8_layer(p.m.kv, l)); }
static DecodeAttention<KVFp8> fp8_decode_attention() {
  return g_opt.cluster_merge ? attention_decode_cluster<KVFp8> : flash_attention_decode<KVFp8>;
}
static void attention_prefill_fp8(Pass& p, int l) {
  Qwen3& m = p.m;
  const ModelConfig& c = m.cfg;
  attention_prefill_step<KVFp8>(m.act.attn, m.act.qkv, fp8_layer(m.kv, l), p.in, p.B, c.num_attention_heads / m.tp,
                                c.num_key_value_heads / m.tp, m.P, m.MB, m.max_model_len, m.act.attn_workspace,
                                1.0f / sqrtf((float)c.head_dim), p.s, fp8_decode_attention());
}
static void attention_decode_fp8(Pass& p, int l) {
  Qwen3& m = p.m;
  const ModelConfig& c = m.cfg;
  const LayerWeights& lw = m.w.layers[l];
  const int NH = c.num_attention_heads / m.tp, NKV = c.num_key_value_heads / m.tp;
  const float scale = 1.0f / sqrtf((float)c.head_dim);
  if (g_opt.fused_rope && p.B <= DECODE_CLUSTER_MAX_B) {
    const DecodeRope rope{p.in.positions, p.in.slot_mapping, lw.q_norm, lw.k_norm, c.rms_norm_eps,
                          rope_inv_freq(c.rope_theta)};
    return attention_decode_fast<KVFp8>(m.act.attn, m.act.qkv, fp8_layer(m.kv, l), p.in.seqlens_k,
                                        p.in.block_tables, p.B, NH, NKV, m.P, m.MB, m.max_model_len,
                                        m.act.attn_workspace, scale, p.s, &rope);
  }
  store_qkv_fp8(p, l);
  fp8_decode_attention()(m.act.attn, m.act.qkv, fp8_layer(m.kv, l), p.in.seqlens_k, p.in.block_tables, p.B, NH,
                         NKV, m.P, m.MB, m.max_model_len, m.act.attn_workspace, scale, p.s);
}

// ---- The format: fp8 (--kv-cache-dtype) ----
// Its apply (section 2's KVCacheFormat::apply), run for every engine after the switches': resets this
// chapter's state, and for an fp8 engine installs its stages in section 14's table and its persistent kernel's
// format (section 26's g_persistent, which the plans built at model_ready read). Its stages read the scales,
// which use_fp8_cache computes before the pool exists, so before any step. Without flash_attn there are no
// stages to install: use_fp8_cache refuses such an engine.
static void apply_fp8_cache(bool on, Hooks& h) {
  g_fp8_cache.on = on;
  g_fp8_cache.scales.clear();
  if (!on) return;
  g_persistent.format = &kPersistFp8;
  if (!g_opt.flash_attn) return;
  ForwardStages& st = stages_for(h);
  st.store_qkv = store_qkv_fp8;
  st.attention_prefill = attention_prefill_fp8;
  st.attention_decode = attention_decode_fp8;
}
// Before ModelRunner sizes the pool of an fp8 engine: check what it needs, then compute the scales.
static void use_fp8_cache(Qwen3& model) {
  int dev = 0, major = 0, minor = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (major * 10 + minor < 89)
    die("--kv-cache-dtype fp8 needs a GPU with FP8 conversion instructions (compute capability 8.9 or "
        "newer: Ada, Hopper, Blackwell); this one is %d.%d. Use --kv-cache-dtype bf16 (the default)", major,
        minor);
  if (!g_opt.flash_attn)
    die("--kv-cache-dtype fp8 is read by the flash_attn kernels (section 15), which this run switched "
        "off: drop --plain or -flash_attn, or use --kv-cache-dtype bf16");
  g_fp8_cache.scales = g_fp8_cache.scales_from_weights ? kv_scales_from_weights(model.w, model.cfg, model.tp)
                                                        : std::vector<KVScales>(model.cfg.num_hidden_layers);
}
static const int kFp8FormatRegistered = register_kv_cache_format(
    {"fp8", {"fp8_e4m3"}, 1, {{"fp8_e5m2", "nanovllm stores FP8 as e4m3 (write fp8 or fp8_e4m3)"}}, use_fp8_cache,
     apply_fp8_cache});


// ---- 32a. An fp8 decode step's rows, longest context first (switch longest_first) -------------------------
// Replaces: the scheduler's order of a decode step's rows, which is the order flash_decode_kernel's thread
// blocks start in (its grid runs partition fastest, then kv head, then row).
// Why it is faster: a step's contexts differ (bench.py's run from 100 to 2,048 tokens), and a thread block
// takes as long as its partition has keys. The GPU starts blocks in grid order as slots free up, so a long
// context whose blocks come late still runs while most SMs have nothing left to start. With the rows in
// order of context length, longest first (the "longest processing time first" rule for jobs on parallel
// machines), the blocks that start last are the shortest, and they fill that tail. That pays with an fp8
// cache, whose partitions are twice as long (1,024 keys above 32 sequences), so its blocks
// differ more; with bf16's 512-key partitions the order gains nothing, so a bf16 run keeps the
// scheduler's order (docs/performance.md, the FP8 cache).
// What it changes: only which row of the step a sequence sits in. Every kernel of a decode step computes each
// row on its own, and the engine reads a token back by its row, so every sequence gets the same tokens (the
// run's tokens hash is the same with the switch on or off; the trace and the last step's logits hash follow
// the new order). The order is a stable sort of the batch on the engine's side; prefill and mixed steps
// keep the scheduler's order (a mixed step's decode rows must lead, section 16).
// Switch: longest_first.
static void order_longest_first(std::vector<Sequence*>& batch) {
  if (!g_fp8_cache.on) return;  // (the cache's format is fixed for a run)
  std::stable_sort(batch.begin(), batch.end(),
                   [](const Sequence* a, const Sequence* b) { return a->size() > b->size(); });
}
static void apply_longest_first(bool on, Hooks& h) {
  g_opt.longest_first = on;
  if (on) h.decode_scheduled.push_back(order_longest_first);
}
static const int kLongestFirstRegistered = register_optimization(
    {"longest_first", "an fp8 decode step's rows in order of context length, longest first (section 32a)", true,
     apply_longest_first});


// ==== 33. A mixture of experts on tensor cores =============================================================
// defines: fused_moe_rows_reference, fused_moe_reference, fused_moe_kernel (33a: the long steps' tiles,
//          fused_moe and the stage; sections 34-35: the small steps' gemv, the FP8 experts)
//
// Replaces: in section 14's moe stage (section 10b's moe_mlp), the experts' products after the align:
// moe_matmul for gate_up, silu_and_mul, moe_matmul for down, and moe_combine's multiply by the routing
// weights. The router's product, the routing (moe_route; section 34's moe_route_fast, the same bits, where
// that switch is on) and moe_align stay as they are: they are small, and moe_align's list (each expert's rows
// padded to tiles of MOE_TILE rows, and the expert of each tile) is what the products below are grouped by.
// Why it is faster: moe_matmul is the textbook product on the CUDA cores: a thread per output, 2-byte loads,
// one multiply-add per instruction. Here the same tile of 16 rows of the list meets its expert's weights on
// the tensor cores (section 15's mma.sync m16n8k16: one instruction of a warp does 16 x 8 x 16 multiply-
// adds), the weights and the rows arrive by 16-byte cp.async copies FMOE_STAGES - 1 slices ahead of the
// slice being multiplied (a thread block keeps its loads in flight while it computes), and SiLU-and-mul
// happens in the first product's registers: the [RM, 2 IE] gate_up buffer is neither written nor read, and
// a kernel is gone.
// The design: one grouped product per weight matrix, over all experts at once. A thread block owns one tile
// of MOE_TILE rows of the list (so one expert, tile_expert's) and FMOE_COLS rows of that expert's weight
// matrix, which it streams once along K, FMOE_BK values at a time, through shared memory; each of its four
// warps multiplies the tile's 16 rows by 16 of those weight rows. A tile past the list's end (tile_expert
// -1) exits at once. As in Part I the grid depends on T alone, so a step with MoE layers is captured in a
// CUDA graph and replayed whatever the routing.
//   1. fused_moe_kernel<true>: act [RM, IE] = SiLU(gate) * up for the rows of x [T, H] the list names (the
//      copies gather them: row r reads token rows[r] / k; a padding row reads zeros). A thread block's
//      FMOE_COLS weight rows are 32 rows of gate and the same 32 columns' rows of up, placed so that each
//      lane's accumulators hold gate and up of the same (row, column): the epilogue works in registers.
//   2. fused_moe_kernel<false>: the down product of act's rows, and in its epilogue the multiply by the
//      routing weight of each row's pair; a padding row writes nothing.
//   3. section 10b's moe_combine, given no weights: per token, its k weighted rows added in ascending id.
// Why the sum stays a kernel of its own: Part I rounds the sum to bf16 after each expert's addition, in
// ascending expert id (transformers' index_add_ into a bf16 row: section 10b). A token's k rows come from k
// different thread blocks (one per expert's tile). Adding them in place would take atomics, whose order, and
// so whose rounding, changes from run to run, or thread blocks that wait for each other's turn. A kernel
// that reads the k rows of H values per token (small next to the experts' weights a step reads) keeps the
// sum exactly Part I's for the same products, and Part I's kernel is that kernel. (vLLM's fused MoE ends with a moe_sum kernel too.)
// Rounding, where Part I rounds (section 10b): gate and up to bf16 each, then act = bf16(SiLU(gate) * up) in
// fp32 (section 7's silu_mul); y = bf16(the down product), then bf16(y * w) with w fp32; the sum in bf16 after
// each addition. Only the order of the fp32 additions inside a product differs from moe_matmul's (the tensor
// cores add in an order of their own), so a result may land one bf16 step from Part I's where a value sits
// near a rounding boundary. fused_moe_reference (below) is the CPU's account of these steps, and
// test/gpu/gpu_moe.cu checks the kernels against it and against Part I's path.
// What it costs: a tile is 16 rows, the mma's height: right for decode, wasteful for prefill's hundreds of
// rows an expert, so a long step is listed in tiles of 64 rows for fused_moe_wide_kernel (section 33a).
// Padding: up to a tile less one row per expert that is hit, as in Part I. The kernels launch the ordinary
// way, not through section 17's launch_pdl: their neighbours in the stream are Part I's kernels.
// Preconditions: H and IE (this rank's slice) multiples of 8 (16-byte copies; section 2's tp_shard_problem
// already requires IE / tp % 8 == 0), pointers 16-byte aligned. The widths need not be multiples of a tile:
// the copies zero-fill a partial slice of K and the weight rows past N, and the epilogues skip those columns.
// Switch: fused_moe. Its measurement: docs/performance.md, "Qwen3-MoE".

constexpr int FMOE_BK = 64;      // K values per slice: a row of a slice is 128 bytes, 8 chunks of 16 bytes
constexpr int FMOE_COLS = 64;    // weight rows per thread block (gate_up: 32 of gate, 32 of up)
constexpr int FMOE_WARPS = 4;    // each multiplies the tile by 16 of the weight rows: two 8-row MMA tiles
constexpr int FMOE_THREADS = 32 * FMOE_WARPS;
constexpr int FMOE_STAGES = 4;   // slices in shared memory: 3 in flight while one is multiplied (40 KiB)
static_assert(FMOE_WARPS * 16 == FMOE_COLS, "the warps share the weight rows 16 apiece");
static_assert(MOE_TILE == 16, "a tile of the list is one MMA's 16 rows");
static_assert(MOE_TILE * FMOE_BK / 8 == FMOE_THREADS, "a slice of the tile's rows is one 16-byte copy a thread");

// What fused_moe computes, on the CPU, row by row of the experts' list (rows, tile_expert and pair_row as
// moe_align_reference makes them): act [RM, IE] of every row of a used tile (a padding row's is SiLU(0) * 0 =
// 0), the weighted down rows wy [RM, H] of the rows that hold a pair, and out [T, H], each token's rows added
// in ascending expert id. x [T, H], weights [T, k] (bf16 values as float). Rows the kernels do not write stay
// 0 here, and so does a padding row's act (its products are of zeros). One row's product is product(y, row,
// e, gate_up): gate_up: y [2 IE] (gate, then up) from a row of x; else y [H] from a row of act; each value
// rounded to bf16 (fused_moe_reference's is section 10's linear_reference; section 35's the FP8 one).
template <typename Product>
static void fused_moe_rows_reference(std::vector<float>& act, std::vector<float>& wy, float* out, const float* x,
                                     const std::vector<int>& rows, const std::vector<int>& tile_expert,
                                     const std::vector<int>& pair_row, const int* ids, const float* weights, int T,
                                     int H, int IE, int k, Product product) {
  const size_t RM = rows.size(), tile = RM / std::max<size_t>(1, tile_expert.size());  // (16, or 64: section 33)
  act.assign(RM * IE, 0.f), wy.assign(RM * H, 0.f);
  std::vector<float> gu(2 * IE), y(H);
  for (size_t r = 0; r < RM; r++) {
    const int e = tile_expert[r / tile], pair = rows[r];
    if (e < 0 || pair < 0) continue;
    product(gu.data(), x + (size_t)(pair / k) * H, e, true);
    silu_and_mul_reference(&act[r * IE], gu.data(), 1, IE);
    product(y.data(), &act[r * IE], e, false);
    for (int h = 0; h < H; h++) wy[r * H + h] = bf16_round(y[h] * weights[pair]);
  }
  std::vector<int> order(k);
  for (int t = 0; t < T; t++) {
    const int* id = ids + (size_t)t * k;
    for (int j = 0; j < k; j++) order[j] = j;
    std::sort(order.begin(), order.end(), [&](int a, int b) { return id[a] < id[b]; });
    for (int h = 0; h < H; h++) {
      float acc = 0.f;
      for (int j : order) acc = bf16_round(acc + wy[(size_t)pair_row[(size_t)t * k + j] * H + h]);
      out[(size_t)t * H + h] = acc;
    }
  }
}
// fused_moe's: gate_up [E, 2 IE, H], down [E, H, IE] (bf16 values as float). The same calls and roundings as
// moe_experts_reference (section 10b), only grouped by expert: out is that function's, bit for bit
// (test/host/test_moe.cu).
static void fused_moe_reference(std::vector<float>& act, std::vector<float>& wy, float* out, const float* x,
                                const std::vector<int>& rows, const std::vector<int>& tile_expert,
                                const std::vector<int>& pair_row, const int* ids, const float* weights,
                                const float* gate_up, const float* down, int T, int H, int IE, int k) {
  fused_moe_rows_reference(act, wy, out, x, rows, tile_expert, pair_row, ids, weights, T, H, IE, k,
                           [&](float* y, const float* row, int e, bool gu) {
                             if (gu) linear_reference(y, row, gate_up + (size_t)e * 2 * IE * H, 1, 2 * IE, H);
                             else linear_reference(y, row, down + (size_t)e * H * IE, 1, H, IE);
                           });
}

// A slice in shared memory is [rows][FMOE_BK] bf16, 8 chunks of 16 bytes a row. ldmatrix reads one chunk
// column of 8 consecutive rows, 128 bytes apart: all in the same 4 banks if stored plainly. XOR-ing the chunk
// with row % 8 spreads them over all 32 banks (section 15's swizzle, for rows of 8 chunks instead of 16).
__device__ __forceinline__ int fmoe_smem_index(int row, int chunk) {
  return row * FMOE_BK + ((chunk ^ (row & 7)) << 3);
}

// fused_moe_kernel — one grouped product over all experts: for every tile of the list whose expert e =
// tile_expert[tile] >= 0 and every row r of it,
//   GATE_UP:  act[r, n] = bf16(SiLU(bf16(x_r . Wgu_e[n])) * bf16(x_r . Wgu_e[IE + n]))    n < IE
//             x_r = x[rows[r] / k] (zeros for a padding row); Wgu = gate_up [E, 2 IE, H]
//   down:     y[r, n] = bf16(bf16(act_r . Wd_e[n]) * weights[rows[r]])                     n < H
//             for the rows that hold a pair; Wd = down [E, H, IE]
// Replaces: moe_matmul + silu_and_mul, and moe_matmul + moe_combine's multiply (section 10b).
// Layouts: x [T, H], act [RM, IE], y [RM, H] row-major bf16; the weights as a linear's, [N, K] per expert.
// Grid: (RM / MOE_TILE tiles, column blocks: ceil(IE / 32) for GATE_UP, ceil(H / FMOE_COLS) for down); the
// tiles run fastest, so the thread blocks of one expert's tiles, which read the same weight rows, run
// together and share them through L2. A thread block of FMOE_THREADS threads:
//   * its weight rows, slot i of FMOE_COLS: GATE_UP: gate row n0 + i for i < 32, up row IE + n0 + i - 32
//     after (n0 = 32 blockIdx.y); down: row n0 + i (n0 = FMOE_COLS blockIdx.y). A row past N is zero-filled;
//   * per slice of FMOE_BK values of K: thread t copies chunk t % 8 of tile row t / 8 and four chunks of the
//     weight rows, into stage (slice % FMOE_STAGES); a chunk past K is zero-filled;
//   * warp w multiplies the tile (A, 16 x 16 per ldmatrix.x4) by two 8-row MMA tiles of weight rows: slots
//     8w .. 8w + 7 and 32 + 8w .. 32 + 8w + 7 (B, both from one ldmatrix.x4). For GATE_UP those are gate and
//     up of the same 8 columns, so acc[0][i] and acc[1][i] are gate and up of one (row, column);
//   * the epilogue: lane l holds rows l / 4 and l / 4 + 8 of the tile, columns 2 (l % 4) and + 1 of each MMA
//     tile (section 15's fragment layout), and writes them as one bf16 pair each.
// Preconditions: the launcher's (fused_moe_products).
// FP8 (section 35): the same kernel on an FP8 model's experts, W8A8 as section 28 computes a product. a and W
// are e4m3 bytes (a quantized by quantize_rows: a_scale [K/128, a_ld], tokens contiguous; W's scales w_scale
// [E N/128, w_ld], the experts stacked by rows), so a slice's 128 bytes of a row are 128 values, one scale
// block: the copies and ldmatrix move the same bytes as for bf16, and the m16n8k32 e4m3 instruction reads
// from them the fragments m16n8k16 reads (section 30's mma_e4m3_16832: a 16-byte column of chunks is 16 k
// positions instead of 8). Each slice's sums are kept apart, then scaled by s_x (the row's) * s_w (the weight
// rows' block) and added to acc: step 3's sum over blocks. The epilogue is the bf16 kernel's.
template <bool GATE_UP, bool FP8 = false>
__global__ __launch_bounds__(FMOE_THREADS) void fused_moe_kernel(bf16* out, const void* a_in, const int* rows,
                                                                 const int* tile_expert, const float* weights,
                                                                 const void* W_in, int N, int K, int k,
                                                                 const float* a_scale, int a_ld,
                                                                 const float* w_scale, int w_ld) {
  using Elt = std::conditional_t<FP8, uint8_t, bf16>;
  constexpr int CV = 16 / sizeof(Elt);  // values in a 16-byte chunk: 8, or 16 e4m3
  constexpr int SV = 8 * CV;            // values in a slice's row: FMOE_BK, or 128 e4m3 (one scale block)
  __shared__ __align__(128) bf16 sA[FMOE_STAGES][MOE_TILE * FMOE_BK];
  __shared__ __align__(128) bf16 sW[FMOE_STAGES][FMOE_COLS * FMOE_BK];
  const int e = tile_expert[blockIdx.x];
  if (e < 0) return;  // a tile past the list's end: the whole thread block
  const Elt* a = static_cast<const Elt*>(a_in);
  const Elt* W = static_cast<const Elt*>(W_in);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, chunk = tid % 8;
  const int64_t r0 = (int64_t)blockIdx.x * MOE_TILE;
  const int n0 = blockIdx.y * (GATE_UP ? FMOE_COLS / 2 : FMOE_COLS);
  const int NOUT = GATE_UP ? N / 2 : N;  // columns of the result: IE, or H
  // The rows this thread copies from: one row of the tile, and weight slots tid / 8 + 16 i (null: zeros).
  const int pair = rows[r0 + tid / 8];
  const Elt* a_row = pair < 0 && GATE_UP ? nullptr : a + (GATE_UP ? (int64_t)(pair / k) : r0 + tid / 8) * K;
  const Elt* w_row[FMOE_COLS * FMOE_BK / 8 / FMOE_THREADS];
#pragma unroll
  for (int i = 0; i < FMOE_COLS * FMOE_BK / 8 / FMOE_THREADS; i++) {
    const int slot = tid / 8 + 16 * i, col = n0 + (GATE_UP ? slot % (FMOE_COLS / 2) : slot);
    const int w_index = GATE_UP && slot >= FMOE_COLS / 2 ? NOUT + col : col;
    w_row[i] = col < NOUT ? W + ((int64_t)e * N + w_index) * K : nullptr;
  }
  auto copy = [](bf16* dst, const Elt* src, bool ok) { cp_async_16(dst, reinterpret_cast<const bf16*>(src), ok); };
  auto issue = [&](int slice) {  // the copies of slice `slice` into its stage, as one committed group
    const int kk = slice * SV + chunk * CV, s = slice % FMOE_STAGES;
    const bool a_ok = a_row && kk < K;
    copy(&sA[s][fmoe_smem_index(tid / 8, chunk)], a_ok ? a_row + kk : a, a_ok);
#pragma unroll
    for (int i = 0; i < FMOE_COLS * FMOE_BK / 8 / FMOE_THREADS; i++) {
      const bool w_ok = w_row[i] && kk < K;
      copy(&sW[s][fmoe_smem_index(tid / 8 + 16 * i, chunk)], w_ok ? w_row[i] + kk : W, w_ok);
    }
  };
  // FP8: the scales this lane applies. Its accumulators hold tile rows g and g + 8 (g = lane / 4) of its warp's
  // two MMA tiles, whose weight rows lie in one 128-row block each (n0 is a multiple of 32, IE of 128).
  const float *sx_lo = nullptr, *sx_hi = nullptr, *sw0 = nullptr, *sw1 = nullptr;
  if constexpr (FP8) {
    auto row_scales = [&](int i) -> const float* {  // s_x of tile row i at block 0 (null: a padding row's, 0)
      if (!GATE_UP) return a_scale + r0 + i;
      const int p = rows[r0 + i];
      return p < 0 ? nullptr : a_scale + p / k;
    };
    sx_lo = row_scales(lane / 4), sx_hi = row_scales(lane / 4 + 8);
    const int64_t w0 = (int64_t)e * N + n0, w1 = w0 + (GATE_UP ? NOUT : FMOE_COLS / 2);
    sw0 = w_scale + w0 / 128 * w_ld, sw1 = w_scale + w1 / 128 * w_ld;
  }
  const int slices = (K + SV - 1) / SV;
#pragma unroll
  for (int s = 0; s < FMOE_STAGES - 1; s++) {
    if (s < slices) issue(s);
    cp_async_commit();  // (an empty group past the end keeps the count of groups in flight the same)
  }
  float acc[2][4] = {};
  // FP8: a slice's scales, loaded a slice ahead (from L2: their latency would otherwise follow each slice's
  // few MMAs).
  float next[4] = {};  // s_x of rows lane / 4 and lane / 4 + 8, s_w of MMA tiles 0 and 1
  auto scales_of = [&](int slice) {
    const int64_t at = (int64_t)slice * a_ld;
    next[0] = sx_lo ? __ldg(sx_lo + at) : 0.f, next[1] = sx_hi ? __ldg(sx_hi + at) : 0.f;
    next[2] = __ldg(sw0 + slice), next[3] = __ldg(sw1 + slice);
  };
  if constexpr (FP8) scales_of(0);
  for (int slice = 0; slice < slices; slice++) {
    cp_async_wait<FMOE_STAGES - 2>();  // this thread's copies of `slice` have landed ...
    __syncthreads();                   // ... and everyone's; and every warp is done with slice - 1's stage
    if (slice + FMOE_STAGES - 1 < slices) issue(slice + FMOE_STAGES - 1);  // into slice - 1's stage
    cp_async_commit();
    const float x_lo = next[0], x_hi = next[1], s0 = next[2], s1 = next[3];  // FP8: this slice's
    if (FP8 && slice + 1 < slices) scales_of(slice + 1);
    const bf16* tA = sA[slice % FMOE_STAGES];
    const bf16* tW = sW[slice % FMOE_STAGES];
    float d[2][4] = {};  // FP8: this slice's sums
#pragma unroll
    for (int kk = 0; kk < FMOE_BK / 16; kk++) {
      uint32_t af[4], bf[4];
      ldmatrix_x4(af, tA + fmoe_smem_index(lane & 15, 2 * kk + (lane >> 4)));
      ldmatrix_x4(bf, tW + fmoe_smem_index((lane >> 4) * (FMOE_COLS / 2) + 8 * warp + (lane & 7),
                                            2 * kk + ((lane >> 3) & 1)));
      if constexpr (FP8) {
        mma_e4m3_16832(d[0], af[0], af[1], af[2], af[3], bf[0], bf[1]);
        mma_e4m3_16832(d[1], af[0], af[1], af[2], af[3], bf[2], bf[3]);
      } else {
        mma_bf16_16816(acc[0], af, bf[0], bf[1]);
        mma_bf16_16816(acc[1], af, bf[2], bf[3]);
      }
    }
    if constexpr (FP8) {
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const float x = j < 2 ? x_lo : x_hi;
        acc[0][j] = fmaf(d[0][j], x * s0, acc[0][j]);
        acc[1][j] = fmaf(d[1][j], x * s1, acc[1][j]);
      }
    }
  }
  cp_async_wait<0>();  // (only empty groups are left; no copy outlives the thread block)
  const int col = n0 + 8 * warp + 2 * (lane % 4);  // GATE_UP: act's column; down: of MMA tile 0 (tile 1: + 32)
  auto store2 = [&](int64_t r, int c, float lo, float hi) {  // (NOUT % 8 == 0: with c, c + 1 is a column too)
    if (c < NOUT) *reinterpret_cast<uint32_t*>(out + r * NOUT + c) = pack_bf16x2(lo, hi);
  };
#pragma unroll
  for (int half = 0; half < 2; half++) {
    const int64_t r = r0 + lane / 4 + 8 * half;
    const float* t0 = &acc[0][2 * half];  // this row's two columns of MMA tile 0 (GATE_UP: gate), of tile 1 (up)
    const float* t1 = &acc[1][2 * half];
    if constexpr (GATE_UP) {
      store2(r, col, silu_mul(bf16_round(t0[0]), bf16_round(t1[0])), silu_mul(bf16_round(t0[1]), bf16_round(t1[1])));
    } else {
      const int p = rows[r];
      if (p < 0) continue;  // a padding row: no pair reads it
      const float w = weights[p];
      store2(r, col, bf16_round(t0[0]) * w, bf16_round(t0[1]) * w);
      store2(r, col + FMOE_COLS / 2, bf16_round(t1[0]) * w, bf16_round(t1[1]) * w);
    }
  }
}

// ---- 33a. Long steps: tiles of 64 rows --------------------------------------------------------------------
// defines: FMOE_WIDE_TILE, fused_moe_wide_kernel, fused_moe_wide_launch, fused_moe_products, fused_moe_tile,
//          fused_moe, g_moe_route, fused_moe_stage; switch fused_moe
//
// A prefill step of thousands of tokens gives each expert hundreds of rows (2,048 tokens x 8 choices over 128
// experts: 128 an expert). fused_moe_kernel takes them 16 at a time, and each of its thread blocks streams its
// 64 weight rows through shared memory for those 16 rows alone: 16 x 64 products per 80 rows loaded, about
// 13 multiply-adds per byte that comes from L2, so the kernel waits on L2, not on the tensor cores (gpu_moe's
// fused_moe_speed measures it). fused_moe_wide_kernel is the same product in bigger tiles: moe_align lists
// the step in tiles of FMOE_WIDE_TILE = 64 rows (MOE_TILE_MAX is what section 10b's buffers are sized for),
// and a thread block of eight warps multiplies one tile by FMOE_WIDE_COLS = 128 weight rows: 64 x 128
// products per 192 rows loaded, 3.3 times the reuse. Each warp owns 32 rows x 32
// weight rows (warps 2 x 4): per 16 values of K, two ldmatrix.x4 of the tile's rows, two of the weight rows,
// eight MMAs. For GATE_UP the 128 weight rows are 64 gate rows and the same 64 columns' up rows, and a warp's
// two weight loads each bring 8 gate rows and the 8 up rows of the same columns, so, as in fused_moe_kernel,
// a lane's accumulators hold gate and up of the same (row, column) and SiLU-and-mul happens in registers.
// The grid runs the column blocks fastest: the thread blocks in flight together are a few tiles' column
// blocks, which share their gathered rows through L2 while an expert's weights stay there for all of its
// tiles (the other order would stream the step's rows, 8 copies of each token, once per column block).
// Results: the same per (row, column) as fused_moe_kernel's, bit for bit: the same MMAs along K in the
// same order, the same epilogue (gpu_moe checks the bits). Padding: up to 63 rows per expert, so a step takes
// these tiles only where its experts average FMOE_WIDE_MIN_ROWS rows or more (fused_moe_tile; measured by
// gpu_moe's fused_moe_speed: docs/performance.md, "Long MoE steps in 64-row tiles"). Section 35's FP8 experts take the same tiles
// (its W8A8 products: the kernel's FP8 note) from more rows an expert: their two sets of sums (each slice's,
// then the scaled total) hold a thread block of these tiles to one an SM.
constexpr int FMOE_WIDE_TILE = 64;    // rows of the list per thread block: moe_align's tile for long steps
constexpr int FMOE_WIDE_COLS = 128;   // weight rows per thread block (gate_up: 64 of gate, 64 of up)
constexpr int FMOE_WIDE_WARPS = 8;    // 2 (rows) x 4 (weight rows): each multiplies 32 rows by 32 weight rows
constexpr int FMOE_WIDE_THREADS = 32 * FMOE_WIDE_WARPS;
constexpr int FMOE_WIDE_STAGES = 4;   // slices in shared memory: 4 x (64 + 128) rows x 128 bytes = 96 KiB
constexpr int FMOE_WIDE_MIN_ROWS = 32;  // average rows per expert from which a step takes these tiles (measured)
constexpr int FMOE_WIDE_MIN_ROWS_FP8 = 512;  // the same for FP8 experts (section 35; measured)
static_assert(FMOE_WIDE_TILE <= MOE_TILE_MAX && FMOE_WIDE_TILE % MOE_TILE == 0, "section 10b's buffers hold it");
static_assert(FMOE_WIDE_TILE * 8 % FMOE_WIDE_THREADS == 0 && FMOE_WIDE_COLS * 8 % FMOE_WIDE_THREADS == 0,
              "a slice's 16-byte copies split evenly over the threads");
constexpr size_t FMOE_WIDE_SMEM = (size_t)FMOE_WIDE_STAGES * (FMOE_WIDE_TILE + FMOE_WIDE_COLS) * FMOE_BK * 2;

// fused_moe_wide_kernel — fused_moe_kernel's two products (same arguments, same results) over a list in tiles
// of FMOE_WIDE_TILE rows. Grid: (column blocks: ceil(IE / 64) for GATE_UP, ceil(H / 128) for down; tiles,
// RM / FMOE_WIDE_TILE). A thread block of FMOE_WIDE_THREADS threads, warp w = (wm, wn) = (w / 4, w % 4):
//   * its weight rows, slot i of 128: GATE_UP: gate row n0 + i for i < 64, up row IE + n0 + i - 64 after
//     (n0 = 64 blockIdx.x); down: row n0 + i (n0 = 128 blockIdx.x). A row past N is zero-filled;
//   * per slice of FMOE_BK values of K: thread t copies chunk t % 8 of tile rows t / 8 and t / 8 + 32, and of
//     weight slots t / 8 + 32 i (i < 4), into stage (slice % FMOE_WIDE_STAGES);
//   * warp (wm, wn) multiplies tile rows 32 wm .. + 31 (two 16-row MMA tiles, mi) by four 8-row MMA tiles of
//     weight rows (nt): GATE_UP: nt = 2 j is gate slots 16 wn + 8 j .., nt = 2 j + 1 the up slots 64 + 16 wn
//     + 8 j .. of the same columns; down: nt is slots 32 wn + 8 nt ..;
//   * the epilogue: fused_moe_kernel's, per (mi, nt): lane l holds rows l / 4 and l / 4 + 8 of the MMA tile,
//     columns 2 (l % 4) and + 1.
//   * FP8 (section 35): as fused_moe_kernel's FP8 note: 128 e4m3 values a slice's row, each slice's sums kept
//     apart and added to acc times s_x (each of the lane's four rows') * s_w (the MMA tile's weight block:
//     a thread block's 64 gate rows lie in one 128-row block, its 64 up rows in one, its 128 down rows in one).
template <bool GATE_UP, bool FP8 = false>
__global__ __launch_bounds__(FMOE_WIDE_THREADS) void fused_moe_wide_kernel(bf16* out, const void* a_in,
                                                                           const int* rows, const int* tile_expert,
                                                                           const float* weights, const void* W_in,
                                                                           int N, int K, int k,
                                                                           const float* a_scale, int a_ld,
                                                                           const float* w_scale, int w_ld) {
  using Elt = std::conditional_t<FP8, uint8_t, bf16>;
  constexpr int CV = 16 / sizeof(Elt);  // values in a 16-byte chunk: 8, or 16 e4m3
  constexpr int SV = 8 * CV;            // values in a slice's row: FMOE_BK, or 128 e4m3 (one scale block)
  extern __shared__ __align__(128) uint4 fmoe_wide_smem[];
  constexpr int A_ELEMS = FMOE_WIDE_TILE * FMOE_BK, W_ELEMS = FMOE_WIDE_COLS * FMOE_BK;
  constexpr int AC = FMOE_WIDE_TILE * 8 / FMOE_WIDE_THREADS, WC = FMOE_WIDE_COLS * 8 / FMOE_WIDE_THREADS;
  bf16* sA = reinterpret_cast<bf16*>(fmoe_wide_smem);  // [STAGES][TILE x BK]
  bf16* sW = sA + FMOE_WIDE_STAGES * A_ELEMS;          // [STAGES][COLS x BK]
  const int e = tile_expert[blockIdx.y];
  if (e < 0) return;  // a tile past the list's end: the whole thread block
  const Elt* a = static_cast<const Elt*>(a_in);
  const Elt* W = static_cast<const Elt*>(W_in);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, chunk = tid % 8, wm = warp / 4, wn = warp % 4;
  const int64_t r0 = (int64_t)blockIdx.y * FMOE_WIDE_TILE;
  const int n0 = blockIdx.x * (GATE_UP ? FMOE_WIDE_COLS / 2 : FMOE_WIDE_COLS);
  const int NOUT = GATE_UP ? N / 2 : N;  // columns of the result: IE, or H
  const Elt* a_row[AC];  // the rows this thread copies from (null: zeros)
  const Elt* w_row[WC];
#pragma unroll
  for (int i = 0; i < AC; i++) {
    const int r = tid / 8 + 32 * i, pair = rows[r0 + r];
    a_row[i] = pair < 0 && GATE_UP ? nullptr : a + (GATE_UP ? (int64_t)(pair / k) : r0 + r) * K;
  }
#pragma unroll
  for (int i = 0; i < WC; i++) {
    const int slot = tid / 8 + 32 * i, col = n0 + (GATE_UP ? slot % (FMOE_WIDE_COLS / 2) : slot);
    const int w_index = GATE_UP && slot >= FMOE_WIDE_COLS / 2 ? NOUT + col : col;
    w_row[i] = col < NOUT ? W + ((int64_t)e * N + w_index) * K : nullptr;
  }
  auto copy = [](bf16* dst, const Elt* src, bool ok) { cp_async_16(dst, reinterpret_cast<const bf16*>(src), ok); };
  auto issue = [&](int slice) {  // the copies of slice `slice` into its stage, as one committed group
    const int kk = slice * SV + chunk * CV, s = slice % FMOE_WIDE_STAGES;
#pragma unroll
    for (int i = 0; i < AC; i++) {
      const bool ok = a_row[i] && kk < K;
      copy(sA + s * A_ELEMS + fmoe_smem_index(tid / 8 + 32 * i, chunk), ok ? a_row[i] + kk : a, ok);
    }
#pragma unroll
    for (int i = 0; i < WC; i++) {
      const bool ok = w_row[i] && kk < K;
      copy(sW + s * W_ELEMS + fmoe_smem_index(tid / 8 + 32 * i, chunk), ok ? w_row[i] + kk : W, ok);
    }
  };
  // FP8: the scales this lane applies: s_x of its rows (mi, half) at block 0 (null: a padding row's, 0), s_w
  // of its gate (or down) rows' block and of its up rows' block.
  const float* sx[2][2] = {};
  const float *sw_lo = nullptr, *sw_hi = nullptr;
  if constexpr (FP8) {
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
      for (int half = 0; half < 2; half++) {
        const int r = 32 * wm + 16 * mi + lane / 4 + 8 * half;
        if (!GATE_UP) sx[mi][half] = a_scale + r0 + r;
        else if (rows[r0 + r] >= 0) sx[mi][half] = a_scale + rows[r0 + r] / k;
      }
    const int64_t w0 = (int64_t)e * N + n0;
    sw_lo = w_scale + w0 / 128 * w_ld;
    sw_hi = GATE_UP ? w_scale + (w0 + NOUT) / 128 * w_ld : sw_lo;
  }
  const int slices = (K + SV - 1) / SV;
#pragma unroll
  for (int s = 0; s < FMOE_WIDE_STAGES - 1; s++) {
    if (s < slices) issue(s);
    cp_async_commit();
  }
  // This lane's ldmatrix rows: of the tile (per mi), and of the weight slots (per j: two MMA tiles each).
  const int a_at = 32 * wm + (lane & 15);
  const int w_at = GATE_UP ? (lane >> 4) * (FMOE_WIDE_COLS / 2) + 16 * wn + (lane & 7)
                           : 32 * wn + 8 * (lane >> 4) + (lane & 7);
  constexpr int J_STEP = GATE_UP ? 8 : 16;  // the slots between the two weight loads of a warp
  float acc[2][4][4] = {};
  float next[6] = {};  // FP8: a slice's scales, loaded a slice ahead (fused_moe_kernel's): s_x (mi, half), s_w
  auto scales_of = [&](int slice) {
    const int64_t at = (int64_t)slice * a_ld;
#pragma unroll
    for (int i = 0; i < 4; i++) next[i] = sx[i / 2][i % 2] ? __ldg(sx[i / 2][i % 2] + at) : 0.f;
    next[4] = __ldg(sw_lo + slice), next[5] = __ldg(sw_hi + slice);
  };
  if constexpr (FP8) scales_of(0);
  for (int slice = 0; slice < slices; slice++) {
    cp_async_wait<FMOE_WIDE_STAGES - 2>();  // this thread's copies of `slice` have landed ...
    __syncthreads();                        // ... and everyone's; every warp is done with slice - 1's stage
    if (slice + FMOE_WIDE_STAGES - 1 < slices) issue(slice + FMOE_WIDE_STAGES - 1);
    cp_async_commit();
    float cur[6];  // FP8: this slice's scales
#pragma unroll
    for (int i = 0; i < 6; i++) cur[i] = next[i];
    if (FP8 && slice + 1 < slices) scales_of(slice + 1);
    const bf16* tA = sA + (slice % FMOE_WIDE_STAGES) * A_ELEMS;
    const bf16* tW = sW + (slice % FMOE_WIDE_STAGES) * W_ELEMS;
    float d[2][4][4] = {};  // FP8: this slice's sums
#pragma unroll
    for (int kk = 0; kk < FMOE_BK / 16; kk++) {
      uint32_t af[2][4], bf[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; mi++) ldmatrix_x4(af[mi], tA + fmoe_smem_index(a_at + 16 * mi, 2 * kk + (lane >> 4)));
#pragma unroll
      for (int j = 0; j < 2; j++)
        ldmatrix_x4(bf[j], tW + fmoe_smem_index(w_at + J_STEP * j, 2 * kk + ((lane >> 3) & 1)));
#pragma unroll
      for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
          if constexpr (FP8) {
            mma_e4m3_16832(d[mi][2 * j], af[mi][0], af[mi][1], af[mi][2], af[mi][3], bf[j][0], bf[j][1]);
            mma_e4m3_16832(d[mi][2 * j + 1], af[mi][0], af[mi][1], af[mi][2], af[mi][3], bf[j][2], bf[j][3]);
          } else {
            mma_bf16_16816(acc[mi][2 * j], af[mi], bf[j][0], bf[j][1]);
            mma_bf16_16816(acc[mi][2 * j + 1], af[mi], bf[j][2], bf[j][3]);
          }
        }
    }
    if constexpr (FP8) {
#pragma unroll
      for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
          const float x = cur[2 * mi + half];
#pragma unroll
          for (int nt = 0; nt < 4; nt++) {
            // (GATE_UP: odd tiles are up rows; down: the thread block's rows share one block)
            const float sc = x * (nt % 2 ? cur[5] : cur[4]);
#pragma unroll
            for (int c = 0; c < 2; c++)
              acc[mi][nt][2 * half + c] = fmaf(d[mi][nt][2 * half + c], sc, acc[mi][nt][2 * half + c]);
          }
        }
    }
  }
  cp_async_wait<0>();  // (only empty groups are left)
  auto store2 = [&](int64_t r, int c, float lo, float hi) {  // (NOUT % 8 == 0: with c, c + 1 is a column too)
    if (c < NOUT) *reinterpret_cast<uint32_t*>(out + r * NOUT + c) = pack_bf16x2(lo, hi);
  };
#pragma unroll
  for (int mi = 0; mi < 2; mi++)
#pragma unroll
    for (int half = 0; half < 2; half++) {
      const int64_t r = r0 + 32 * wm + 16 * mi + lane / 4 + 8 * half;
      if constexpr (GATE_UP) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
          const float* g = &acc[mi][2 * j][2 * half];  // this row's two columns of gate, then of up
          const float* u = &acc[mi][2 * j + 1][2 * half];
          store2(r, n0 + 16 * wn + 8 * j + 2 * (lane % 4), silu_mul(bf16_round(g[0]), bf16_round(u[0])),
                 silu_mul(bf16_round(g[1]), bf16_round(u[1])));
        }
      } else {
        const int p = rows[r];
        if (p < 0) continue;  // a padding row: no pair reads it
        const float w = weights[p];
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
          const float* t = &acc[mi][nt][2 * half];
          store2(r, n0 + 32 * wn + 8 * nt + 2 * (lane % 4), bf16_round(t[0]) * w, bf16_round(t[1]) * w);
        }
      }
    }
}
// Launches fused_moe_wide_kernel<GATE_UP, FP8> over RM rows (its shared memory opted into once per
// instantiation): section 33's and section 35's launchers.
template <bool GATE_UP, bool FP8>
static void fused_moe_wide_launch(bf16* out, const void* a, const int* rows, const int* tile_expert,
                                  const float* weights, const void* W, int64_t RM, int N, int K, int k,
                                  const float* a_scale, int a_ld, const float* w_scale, int w_ld,
                                  cudaStream_t stream) {
  static bool smem_set = false;
  if (!smem_set) {
    CUDA_CHECK(cudaFuncSetAttribute(fused_moe_wide_kernel<GATE_UP, FP8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)FMOE_WIDE_SMEM));
    smem_set = true;
  }
  const int NOUT = GATE_UP ? N / 2 : N;
  const dim3 grid((unsigned)cdiv(NOUT, GATE_UP ? FMOE_WIDE_COLS / 2 : FMOE_WIDE_COLS),
                  (unsigned)(RM / FMOE_WIDE_TILE));
  fused_moe_wide_kernel<GATE_UP, FP8><<<grid, FMOE_WIDE_THREADS, FMOE_WIDE_SMEM, stream>>>(
      out, a, rows, tile_expert, weights, W, N, K, k, a_scale, a_ld, w_scale, w_ld);
}
// GATE_UP: out = act [RM, IE] from a = x [T, H] and W = gate_up [E, 2 IE, H] (N = 2 IE, K = H); down: out =
// y [RM, H] from a = act [RM, IE] and W = down [E, H, IE] (N = H, K = IE), weights [T, k] (fp32). rows and
// tile_expert: moe_align's, for these RM rows in tiles of `tile` rows: MOE_TILE (fused_moe_kernel) or
// FMOE_WIDE_TILE (fused_moe_wide_kernel).
template <bool GATE_UP>
static void fused_moe_products(bf16* out, const bf16* a, const int* rows, const int* tile_expert,
                               const float* weights, const bf16* W, int64_t RM, int N, int K, int k, int tile,
                               cudaStream_t stream) {
  const char* name = GATE_UP ? "fused_moe (gate_up)" : "fused_moe (down)";
  INTERNAL_CHECK((tile == MOE_TILE || tile == FMOE_WIDE_TILE) && RM % tile == 0 && RM / tile <= 65535 && N > 0 &&
                     K > 0 && k >= 1 && (!GATE_UP || N % 2 == 0),
                 "%s: tile = %d, RM = %lld, N = %d, K = %d, k = %d", name, tile, (long long)RM, N, K, k);
  check_vec8(name, "K", K);
  check_vec8(name, GATE_UP ? "IE" : "H", GATE_UP ? N / 2 : N);
  check_aligned16(name, "out", out);
  check_aligned16(name, "a", a);
  check_aligned16(name, "W", W);
  if (RM == 0) return;
  const int NOUT = GATE_UP ? N / 2 : N;
  if (tile == MOE_TILE) {
    const dim3 grid((unsigned)(RM / MOE_TILE), (unsigned)cdiv(NOUT, GATE_UP ? FMOE_COLS / 2 : FMOE_COLS));
    fused_moe_kernel<GATE_UP><<<grid, FMOE_THREADS, 0, stream>>>(out, a, rows, tile_expert, weights, W, N, K, k,
                                                                  nullptr, 0, nullptr, 0);
  } else {
    fused_moe_wide_launch<GATE_UP, false>(out, a, rows, tile_expert, weights, W, RM, N, K, k, nullptr, 0, nullptr, 0,
                                          stream);
  }
  CUDA_CHECK(cudaGetLastError());
}
// The tile a step of T tokens is listed in: FMOE_WIDE_TILE where its E experts average FMOE_WIDE_MIN_ROWS rows
// or more (FMOE_WIDE_MIN_ROWS_FP8 for FP8 experts), else MOE_TILE.
static int fused_moe_tile(int64_t T, int k, int E, bool fp8 = false) {
  return T * k >= (int64_t)(fp8 ? FMOE_WIDE_MIN_ROWS_FP8 : FMOE_WIDE_MIN_ROWS) * E ? FMOE_WIDE_TILE : MOE_TILE;
}

// The experts' part of a MoE layer the fused way: section 10b's moe_experts with the same arguments and the
// same scratch (a's moe_* buffers; moe_gate_up is not used). out [T, H] may not alias x. tile: the list's
// (fused_moe_tile's, unless a test asks for another).
static void fused_moe(bf16* out, const bf16* x, const int* ids, const float* weights, const bf16* gate_up,
                      const bf16* down, int T, int H, int IE, int E, int k, const Activations& a,
                      cudaStream_t stream, int tile = 0) {
  if (tile == 0) tile = fused_moe_tile(T, k, E);
  const int64_t RM = moe_rows_max(T, k, E, tile);
  moe_align(a.moe_rows, a.moe_pair_row, a.moe_tile_expert, ids, T, k, E, stream, tile);
  fused_moe_products<true>(a.moe_act, x, a.moe_rows, a.moe_tile_expert, nullptr, gate_up, RM, 2 * IE, H, k, tile,
                           stream);
  fused_moe_products<false>(a.moe_out, a.moe_act, a.moe_rows, a.moe_tile_expert, weights, down, RM, H, IE, k, tile,
                            stream);
  moe_combine(out, a.moe_out, ids, nullptr, a.moe_pair_row, T, H, k, stream);  // (weights applied already)
}

// ---- The stage this section fills, and its switch: fused_moe ----
// Section 14's moe: moe_plain with the experts' part (section 10b's moe_experts) replaced by fused_moe; the
// norm, the router's product and the routing before it (g_moe_route: moe_route, or section 34's moe_route_fast,
// the same bits sooner, where that switch is on) and the sum over the ranks after it as moe_plain has them.
static void (*g_moe_route)(int*, float*, const bf16*, int, int, int, bool, cudaStream_t) = moe_route;
static void fused_moe_stage(Pass& p, const LayerWeights& lw) {
  Activations& a = p.m.act;
  const ModelConfig& c = p.m.cfg;
  const int H = c.hidden_size, E = c.num_experts, k = c.num_experts_per_tok;
  norm_residual(p, lw.post_attention_layernorm);
  linear(*p.m.gemm, a.router_logits, a.x, lw.router, p.T, E, H, p.s);
  g_moe_route(a.topk_ids, a.topk_weights, a.router_logits, p.T, E, k, c.norm_topk_prob, p.s);
  fused_moe(a.hidden, a.x, a.topk_ids, a.topk_weights, lw.experts_gate_up, lw.experts_down, p.T, H,
            c.moe_intermediate_size / p.m.tp, E, k, a, p.s);
  p.pending = true;
  if (p.m.tp > 1 && g_stages.all_reduce(p.m.comm, a.hidden, (size_t)p.T * H, p.s, a.residual)) p.pending = false;
}
static void apply_fused_moe(bool on, Hooks& h) {
  g_opt.fused_moe = on;
  if (on) stages_for(h).moe = fused_moe_stage;
}
static const int kFusedMoeRegistered = register_optimization(
    {"fused_moe", "a MoE layer's experts as grouped products on tensor cores, SiLU-and-mul fused in (section 33)",
     true, apply_fused_moe});

// ==== 34. A mixture of experts, 2: small steps, a gemv per routed expert ===================================
// defines: MOE_GEMV_MAX_T, moe_route_lanes, moe_route_warp, moe_route_fast_kernel, moe_route_fast,
//          moe_router_kernel, moe_router, e4m3x16_to_float, moe_gemv_dot, moe_gemv_gate_up_kernel,
//          moe_gemv_down_kernel, moe_gemv, moe_gemv_route, moe_gemv_stage; switch moe_gemv
//
// Replaces: at steps of at most MOE_GEMV_MAX_T tokens (decode at batch 1 to 4), all of the moe stage above: the
// norm, the router's product and moe_route (one kernel here where section 18's gemv is switched on), and the
// experts' part (moe_align, the two grouped products and moe_combine: two kernels here).
// Why it is faster: a batch-1 step's MoE layer reads the k experts its token chose (8 of 128 in Qwen3-30B-A3B:
// 38 MB of weights in bf16) and does 2 FLOPs per weight: a pass over memory, like section 18's dense gemv. The
// tiles above serve one row of 16 (the other 15 padding), stream each weight slice through shared memory with
// four warps per thread block and leave most of the bandwidth unused at this size; and the list they need
// (moe_align) and the sum after them (moe_combine) are two launches more per layer. A boundary between two
// kernels costs microseconds (section 17), a large share of a layer this small, so the layer is three
// kernels, each launched with PDL (section 17) so that it is resident, and where it can its loads are in
// flight, before the kernel ahead of it ends:
//   1. moe_router_kernel: the RMSNorm of the residual stream, the router's product and the routing. Its thread
//      blocks are section 18's gemv blocks (gemv_block: each stages the normed rows in shared memory, block 0
//      also writes them to act.x for the experts, and each computes E / gridDim of the logits with the gemv's
//      arithmetic); the last block to finish (a ticket: each block's writes, a fence, then an atomic count)
//      reads all the logits back through L2 and routes each token, one warp each, with moe_route_warp (below:
//      Part I's moe_route_row's results by a much shorter chain of instructions). So the norm, the router's
//      product and moe_route, three launches, are one, and their results are theirs bit for bit.
//   2. moe_gemv_gate_up_kernel: one warp per (pair, column j of act): it streams row j of the pair's expert's
//      gate and row j of its up (16-byte loads, every load of a stretch in flight before the first use, as
//      section 18), dots both with the token's row of x, and writes act[pair, j] = bf16(SiLU(bf16(gate)) *
//      bf16(up)). Pair p = t k + i is token t's i-th choice, expert ids[p]: nothing is sorted or listed. Which
//      rows to read is known only once the router has finished, so nothing is loaded before the wait.
//   3. moe_gemv_down_kernel: one warp per (token, output n), or at a step of one token MOE_DOWN_SPLIT_ONE
//      warps sharing the token's k experts (a one-token step has only H outputs; two warps put twice the loads
//      in flight): a warp dots row n of its experts' down with the pairs' act rows, the next expert's row
//      loading while it sums the current one; then the k results, taken in ascending expert id, are each
//      rounded, multiplied by the routing weight, rounded, and added to the running sum, rounded: the sum is
//      made where the products are, in Part I's order and rounding, so moe_combine and the [T k, H] buffer of
//      weighted rows are gone. A row's loads are sized to IE (2, 4 or 8 16-byte loads per lane): registers
//      held for 2,048 columns when the row has 768 cut the warps an SM keeps resident. A warp's first row is
//      in flight before its PDL wait: the routing was written by the kernel before the kernel ahead (every
//      thread block of that one waited for it to finish before this one could launch), so only act, written
//      by the kernel ahead, waits.
// gpu_moe's moe_layer_speed times these choices against the others (docs/performance.md, "Qwen3-MoE").
// A token's experts are read once per token: two tokens that chose the same expert read it twice (at batch 4
// about 3 of 32 choices when routing is uniform), where the tiles read it once. Timed at Qwen3-30B-A3B's
// widths (gpu_moe's fused_moe_speed), the gemv is faster at one, two and four tokens and slower at eight: so
// MOE_GEMV_MAX_T is 4 (docs/performance.md, "Qwen3-MoE"). (The router's one kernel takes steps of up to
// GEMV_MAX_M tokens, section 18's gemv's; a step of 4 routes with Part I's three launches.)
// Rounding: section 10b's (moe_experts_reference is this path's CPU reference, to the order of the fp32
// additions inside a dot product): gate and up rounded to bf16, act = bf16(SiLU(gate) * up), y = bf16(act .
// down), bf16(y * w) with w fp32, the sum in bf16 after each addition, in ascending expert id. The router:
// section 18's gemv and Part I's moe_route exactly (gpu_moe checks the bits).
// The grids depend on T alone (the experts are read from ids on the GPU), so CUDA graphs capture them. The
// router's ticket is one counter in GPU memory that its last thread block sets back to zero, so every launch
// and every replay starts from zero (the launches on a GPU follow each other: each waits for the one before).
// Preconditions: H and IE multiples of 8, IE <= MOE_GEMV_DOWN_U * 256 (a down row in one stretch; larger
// slices take the stage before), pointers 16-byte aligned; the router's fused kernel also wants the T normed
// rows in shared memory (gemv_can_stage) and E <= MOE_MAX_EXPERTS.
// Switch: moe_gemv.

constexpr int MOE_GEMV_MAX_T = 4;    // tokens per step (measured: above)
// gate_up: 16-byte loads per lane per row in flight, MOE_GEMV_U (1,024 bf16 columns, 2,048 e4m3), or, where
// that grid (IE / GEMV_WARPS x T k thread blocks) would not fit on the GPU at once, MOE_GEMV_U_NARROW (bf16)
// with MOE_GEMV_NARROW_BLOCKS thread blocks an SM (so at most 40 registers a thread): a one-token step of
// Qwen3-30B-A3B (768 blocks, where 528 of the wider kernel fit) is then resident at once (792 on 132 SMs), its
// last blocks' loads no longer waiting for the first blocks to leave (moe_gemv below chooses; measured).
constexpr int MOE_GEMV_U = 4;
constexpr int MOE_GEMV_U_NARROW = 2;
constexpr int MOE_GEMV_NARROW_BLOCKS = 6;
constexpr int MOE_GEMV_DOWN_U = 8;   // down: a row of at most 2,048 columns (IE) in one stretch
constexpr int MOE_DOWN_SPLIT_ONE = 2;  // down, at one token: warps sharing one output's experts (measured)

// One token's routing by one warp, bit for bit Part I's moe_route_row, in a fraction of its time. Part I's is
// written to be read: each lane scans all MOE_ROUTE_SLOTS (16) of its slots in every one of the k rounds, and
// a round's winner is a butterfly of shuffles, each step waiting on the one before: one long chain of
// dependent instructions, which the router's last thread block runs while the layer waits
// (docs/performance.md, "The router's routing, a shorter chain"). Here:
//   * a lane holds S = ceil(E / 32) slots (a template argument: 4 for 128 experts), and sorts them once, best
//     first under moe_ranks_before (insertion, unrolled over registers); a round's candidate of the lane is
//     then its first, and the lane whose candidate wins shifts the others up;
//   * a round's winner is two warp reductions (__reduce_max_sync, __reduce_min_sync: redux.sync, one
//     instruction each for a max or a min of one 32-bit value over the warp, where the butterfly is five
//     shuffles and compares in a row): the max of a key that orders the candidates as moe_ranks_before does
//     (2 + the bits of p, whose unsigned order is p's order for p >= 0, as every probability is; NaN, which
//     moe_ranks_before puts below every number, 1; a lane with no candidate 0), then the least expert id of
//     the lanes that hold that key (ties to the lower id). The winner's p is its key's bits (a NaN's own bits
//     are fetched from its lane).
// The softmax and the sums are Part I's operations in Part I's order: the slots past the S here held zeros
// there, and adding +0 changes no sum. Lane j < k ends with the j-th pick, its id and its weight.
template <int S>
__device__ __forceinline__ void moe_route_lanes(int& my_id, float& my_w, const bf16* row, int E, int k, bool norm) {
  const int lane = threadIdx.x % 32;
  float p[S];
  int e[S];  // -1: no expert (past E)
  float m = -INFINITY;
#pragma unroll
  for (int s = 0; s < S; s++) {
    e[s] = lane + 32 * s < E ? lane + 32 * s : -1;
    p[s] = e[s] >= 0 ? __bfloat162float(row[e[s]]) : -INFINITY;
    m = fmaxf(m, p[s]);
  }
  m = warp_max_f(m);
  float sum = 0.f;
#pragma unroll
  for (int s = 0; s < S; s++) {
    p[s] = e[s] >= 0 ? expf(p[s] - m) : 0.f;
    sum += p[s];
  }
  sum = warp_sum_f(sum);
#pragma unroll
  for (int s = 0; s < S; s++) p[s] /= sum;
#pragma unroll
  for (int i = 1; i < S; i++)
#pragma unroll
    for (int j = i; j > 0; j--)
      if (e[j] >= 0 && moe_ranks_before(p[j], e[j], p[j - 1], e[j - 1])) {
        const float tp = p[j];
        const int te = e[j];
        p[j] = p[j - 1], e[j] = e[j - 1], p[j - 1] = tp, e[j - 1] = te;
      }
  float my_p = 0.f;
  my_id = -1;
  for (int j = 0; j < k; j++) {
    const unsigned key = e[0] < 0 ? 0u : p[0] != p[0] ? 1u : __float_as_uint(p[0]) + 2u;
    const unsigned top = __reduce_max_sync(0xffffffffu, key);
    const int be = (int)__reduce_min_sync(0xffffffffu, key == top ? (unsigned)e[0] : 0xffffffffu);
    float bp = __uint_as_float(top - 2u);
    if (top == 1u) bp = __shfl_sync(0xffffffffu, p[0], be % 32);  // (top is the warp's: every lane takes this)
    if (be % 32 == lane) {
#pragma unroll
      for (int s = 0; s + 1 < S; s++) p[s] = p[s + 1], e[s] = e[s + 1];
      e[S - 1] = -1;
    }
    if (lane == j) my_id = be, my_p = bp;
  }
  const float picked = warp_sum_f(lane < k ? my_p : 0.f);
  my_w = norm ? my_p / picked : my_p;
}
// moe_route_lanes for E experts (at most MOE_MAX_EXPERTS), the picks written to ids and weights [k].
__device__ __forceinline__ void moe_route_warp(int* ids, float* weights, const bf16* row, int E, int k, bool norm) {
  static_assert(MOE_MAX_EXPERTS == 512, "moe_route_warp instantiates moe_route_lanes for up to 16 slots");
  int id;
  float w;
  if (E <= 32) moe_route_lanes<1>(id, w, row, E, k, norm);
  else if (E <= 64) moe_route_lanes<2>(id, w, row, E, k, norm);
  else if (E <= 128) moe_route_lanes<4>(id, w, row, E, k, norm);
  else if (E <= 256) moe_route_lanes<8>(id, w, row, E, k, norm);
  else moe_route_lanes<16>(id, w, row, E, k, norm);
  const int lane = threadIdx.x % 32;
  if (lane < k) ids[lane] = id, weights[lane] = w;
}
// Part I's moe_route (the same arguments, grid and bits) with moe_route_warp: the routing of every other step
// size (section 33's stage takes it through g_moe_route while this switch is on).
__global__ void moe_route_fast_kernel(int* ids, float* weights, const bf16* logits, int T, int E, int k, bool norm) {
  const int64_t t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (t < T) moe_route_warp(ids + t * k, weights + t * k, logits + t * E, E, k, norm);
}
static void moe_route_fast(int* ids, float* weights, const bf16* logits, int T, int E, int k, bool norm,
                           cudaStream_t stream) {
  INTERNAL_CHECK(E >= 1 && E <= MOE_MAX_EXPERTS && k >= 1 && k <= std::min(E, MOE_MAX_TOPK),
                 "moe_route_fast: E = %d, k = %d", E, k);
  if (T == 0) return;
  moe_route_fast_kernel<<<(unsigned)cdiv(T, 4), 128, 0, stream>>>(ids, weights, logits, T, E, k, norm);
  CUDA_CHECK(cudaGetLastError());
}

// The router's ticket: its thread blocks that have written their logits in this launch (see above).
__device__ unsigned g_moe_router_arrived = 0;

// x_out [M, H] = RMSNorm(x) * norm_w (IN RMSNORM; PLAIN: x is normed already and x_out is not written), logits
// [M, E] = x_out @ W^T (bf16), and ids, weights [M, k]: each token's routing (moe_route_row). Grid ceil(E /
// GEMV_WARPS) thread blocks of GEMV_WARPS warps; shared memory M H bf16 (RMSNORM).
template <int M, GemvIn IN>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
    moe_router_kernel(bf16* __restrict__ x_out, bf16* __restrict__ logits, int* __restrict__ ids,
                      float* __restrict__ weights, const bf16* __restrict__ x, const bf16* __restrict__ W,
                      const bf16* __restrict__ norm_w, float eps, int E, int H, int k, bool norm_topk) {
  extern __shared__ uint4 staged[];
  __shared__ bool last;
  __shared__ bf16 row[GEMV_MAX_M][MOE_MAX_EXPERTS];
  gemv_block<M, IN, false, 1>(logits, x, W, E, H, norm_w, eps, staged);  // waits (PDL) before reading x
  if (IN == GemvIn::RMSNORM && blockIdx.x == 0)
    for (int c = threadIdx.x; c < M * H / 8; c += blockDim.x) reinterpret_cast<uint4*>(x_out)[c] = staged[c];
  __syncthreads();  // this block's logits are written
  if (threadIdx.x == 0) {
    __threadfence();  // ... and visible to every block before the count says so
    last = atomicAdd(&g_moe_router_arrived, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int c = threadIdx.x; c < M * E; c += blockDim.x) row[c / E][c % E] = __ldcg(logits + c);  // through L2
  __syncthreads();
  const int t = threadIdx.x / 32;
  if (t < M) moe_route_warp(ids + t * k, weights + t * k, row[t], E, k, norm_topk);
  if (threadIdx.x == 0) g_moe_router_arrived = 0;
}

// Whether moe_router takes a step of T tokens of width H.
static bool moe_router_fits(int T, int H, int E) {
  return T >= 1 && T <= GEMV_MAX_M && gemv_can_stage(T, H) && H % 8 == 0 && E <= MOE_MAX_EXPERTS;
}
// norm_residual (without a pending add), the router's product and moe_route in one launch (see above): x_out
// [T, H] = RMSNorm(residual) * norm_w, logits [T, E], ids and weights [T, k]. norm_w null: residual is the
// normed x already (x_out is then not written).
static void moe_router(bf16* x_out, bf16* logits, int* ids, float* weights, const bf16* residual,
                       const bf16* norm_w, float eps, const bf16* W, int T, int E, int H, int k, bool norm_topk,
                       cudaStream_t stream) {
  INTERNAL_CHECK(moe_router_fits(T, H, E) && k >= 1 && k <= std::min(E, MOE_MAX_TOPK),
                 "moe_router: T = %d, H = %d, E = %d, k = %d", T, H, E, k);
  INTERNAL_CHECK(((uintptr_t)residual | (uintptr_t)W | (uintptr_t)x_out) % 16 == 0,
                 "moe_router: its rows must be 16-byte aligned");
  const unsigned grid = (unsigned)cdiv(E, GEMV_WARPS);
  const size_t smem = norm_w ? (size_t)T * H * sizeof(bf16) : 0;
  if (norm_w) rmsnorm_checks("moe_router", x_out, residual, norm_w, H);
  static_assert(GEMV_MAX_M == 2, "moe_router instantiates its kernel for 1 and 2 tokens");
  const auto kernel = T == 1 ? (norm_w ? moe_router_kernel<1, GemvIn::RMSNORM> : moe_router_kernel<1, GemvIn::PLAIN>)
                             : (norm_w ? moe_router_kernel<2, GemvIn::RMSNORM> : moe_router_kernel<2, GemvIn::PLAIN>);
  launch_pdl(kernel, grid, GEMV_WARPS * 32, smem, stream, x_out, logits, ids, weights, residual, W, norm_w, eps, E,
             H, k, norm_topk);
  CUDA_CHECK(cudaGetLastError());
}

// FP8 (section 35): the same two kernels on an FP8 model's experts (section 28's stacked matrices: w e4m3,
// scale [rows / 128, ld]). A 16-byte load is then 16 weights, converted to fp32 in registers (exact: every
// e4m3 value is a float), their products with the bf16 inputs summed in fp32 and times the 128 x 128 block's
// scale: W8A16, the activations not quantized. e4m3x16_to_float is the conversion.
__device__ __forceinline__ void e4m3x16_to_float(const uint4& v, float (&f)[16]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int half = 0; half < 2; half++) {
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w[i] >> (16 * half)), __NV_E4M3);
      const float2 f2 = __half22float2(*reinterpret_cast<const __half2*>(&h));
      f[4 * i + 2 * half] = f2.x, f[4 * i + 2 * half + 1] = f2.y;
    }
}
// acc plus the dot product of one 16-byte load of weights with the input's values at the same columns c..
// (8 or 16: CV), for the kernels below: bf16 weights multiplied into acc; FP8 (e4m3 bytes) summed apart, then
// times the scale of their block (s_row: the weight row's scales).
template <bool FP8>
__device__ __forceinline__ float moe_gemv_dot(const uint4& w, const bf16* in, const float* s_row, int c, float acc) {
  float wf[FP8 ? 16 : 8], xf[8], dot = FP8 ? 0.f : acc;
  if constexpr (FP8) e4m3x16_to_float(w, wf);
  else bf16x8_to_float(w, reinterpret_cast<float(&)[8]>(wf));
#pragma unroll
  for (int h = 0; h < (FP8 ? 2 : 1); h++) {
    bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(in + c + 8 * h)), xf);
#pragma unroll
    for (int q = 0; q < 8; q++) dot = fmaf(wf[8 * h + q], xf[q], dot);
  }
  if constexpr (FP8) return fmaf(dot, __ldg(s_row + c / 128), acc);
  return dot;
}

// act [T k, IE] from x [T, H] (the normed rows) and gate_up [E, 2 IE, H] (FP8: scale, ld as above). Grid
// (ceil(IE / GEMV_WARPS), T k).
template <bool FP8 = false, int U = MOE_GEMV_U>
__global__ void __launch_bounds__(GEMV_WARPS * 32, U == MOE_GEMV_U_NARROW ? MOE_GEMV_NARROW_BLOCKS : 1)
    moe_gemv_gate_up_kernel(bf16* __restrict__ act, const bf16* __restrict__ x, const int* __restrict__ ids,
                            const void* __restrict__ gate_up, int H, int IE, int k, const float* __restrict__ scale,
                            int ld) {
  using Elt = std::conditional_t<FP8, uint8_t, bf16>;
  constexpr int CV = 16 / sizeof(Elt);  // weights per 16-byte load
  pdl_begin();  // ids and x come from the kernel before; every thread waits (the kernel after relies on it)
  const int p = blockIdx.y, j = blockIdx.x * GEMV_WARPS + threadIdx.x / 32, lane = threadIdx.x & 31;
  if (j >= IE) return;
  const int64_t rg = (int64_t)ids[p] * 2 * IE + j, ru = rg + IE;  // gate row j, and up row j IE rows on
  const Elt* wg = static_cast<const Elt*>(gate_up) + rg * H;
  const Elt* wu = static_cast<const Elt*>(gate_up) + ru * H;
  const float* sg = FP8 ? scale + rg / 128 * ld : nullptr;
  const float* su = FP8 ? scale + ru / 128 * ld : nullptr;
  const bf16* xr = x + (int64_t)(p / k) * H;
  float g = 0.f, u = 0.f;
  for (int k0 = 0; k0 < H; k0 += U * 32 * CV) {
    uint4 vg[U], vu[U];
#pragma unroll
    for (int i = 0; i < U; i++) {
      const int c = k0 + (i * 32 + lane) * CV;
      if (c < H) {
        vg[i] = __ldcs(reinterpret_cast<const uint4*>(wg + c));
        vu[i] = __ldcs(reinterpret_cast<const uint4*>(wu + c));
      }
    }
#pragma unroll
    for (int i = 0; i < U; i++) {
      const int c = k0 + (i * 32 + lane) * CV;
      if (c >= H) break;
      g = moe_gemv_dot<FP8>(vg[i], xr, sg, c, g);
      u = moe_gemv_dot<FP8>(vu[i], xr, su, c, u);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    g += __shfl_xor_sync(0xffffffffu, g, off);
    u += __shfl_xor_sync(0xffffffffu, u, off);
  }
  if (lane == 0) act[(int64_t)p * IE + j] = __float2bfloat16(silu_mul(bf16_round(g), bf16_round(u)));
}

// out [T, H]: each token's k experts' down rows, weighted and summed (see above), from act [T k, IE], ids and
// weights [T, k] and down [E, H, IE] (FP8: scale, ld as above); a row of down is U 16-byte loads per lane (U *
// 32 * CV >= IE). Grid (ceil(H / (GEMV_WARPS / SPLIT)), T): warp w of a thread block takes output (GEMV_WARPS /
// SPLIT) b + w / SPLIT and, of its token's choices in ascending expert id (thread 0 orders them first:
// moe_order_by_expert), the i-th for i = w % SPLIT, that + SPLIT, ...; with SPLIT 1 the warp makes the sum
// itself.
template <int U, int SPLIT, bool FP8 = false>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
    moe_gemv_down_kernel(bf16* __restrict__ out, const bf16* __restrict__ act, const int* __restrict__ ids,
                         const float* __restrict__ weights, const void* __restrict__ down, int H, int IE, int k,
                         const float* __restrict__ scale, int ld) {
  using Elt = std::conditional_t<FP8, uint8_t, bf16>;
  constexpr int CV = 16 / sizeof(Elt);                 // weights per 16-byte load
  constexpr int OUTPUTS = GEMV_WARPS / SPLIT;          // per thread block
  __shared__ int order[MOE_MAX_TOPK];                  // the token's choices (places in ids[t]), ascending id
  __shared__ float y[SPLIT > 1 ? OUTPUTS : 1][MOE_MAX_TOPK];  // SPLIT > 1: their products, in that order
  const int64_t t = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, s = warp % SPLIT;
  const int r = warp / SPLIT, n = blockIdx.x * OUTPUTS + r;
  if (threadIdx.x == 0) moe_order_by_expert(order, ids + t * k, k);  // before the wait: see above
  __syncthreads();
  uint4 cur[U], next[U];
  const float *s_cur = nullptr, *s_next = nullptr;  // FP8: the scale row of the row loaded
  auto load = [&](uint4 (&v)[U], const float*& s_row, int i) {  // row n of the down of the i-th choice's expert
    const int64_t row = (int64_t)ids[t * k + order[i]] * H + n;
    const Elt* w = static_cast<const Elt*>(down) + row * IE;
    if (FP8) s_row = scale + row / 128 * ld;
#pragma unroll
    for (int q = 0; q < U; q++) {
      const int c = (q * 32 + lane) * CV;
      if (c < IE) v[q] = __ldcs(reinterpret_cast<const uint4*>(w + c));
    }
  };
  if (n < H && s < k) load(cur, s_cur, s);
  pdl_begin();  // act comes from the kernel before
  float sum = 0.f;  // SPLIT 1
  for (int i = s; n < H && i < k; i += SPLIT) {
    if (i + SPLIT < k) load(next, s_next, i + SPLIT);
    const bf16* ar = act + (t * k + order[i]) * IE;
    float dot = 0.f;
#pragma unroll
    for (int q = 0; q < U; q++) {
      const int c = (q * 32 + lane) * CV;
      if (c >= IE) break;
      dot = moe_gemv_dot<FP8>(cur[q], ar, s_cur, c, dot);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    if (SPLIT == 1) sum = bf16_round(sum + bf16_round(bf16_round(dot) * weights[t * k + order[i]]));
    else if (lane == 0) y[r][i] = dot;
#pragma unroll
    for (int q = 0; q < U; q++) cur[q] = next[q];
    s_cur = s_next;
  }
  if (SPLIT == 1) {
    if (n < H && lane == 0) out[t * H + n] = __float2bfloat16(sum);
    return;
  }
  __syncthreads();
  const int n_sum = blockIdx.x * OUTPUTS + threadIdx.x;  // thread o < OUTPUTS sums output o's products
  if (threadIdx.x < OUTPUTS && n_sum < H) {
    for (int i = 0; i < k; i++)
      sum = bf16_round(sum + bf16_round(bf16_round(y[threadIdx.x][i]) * weights[t * k + order[i]]));
    out[t * H + n_sum] = __float2bfloat16(sum);
  }
}
template <int U, int SPLIT, bool FP8>
static void moe_gemv_down_launch(bf16* out, const bf16* act, const int* ids, const float* weights, const void* down,
                                 const float* scale, int ld, int T, int H, int IE, int k, cudaStream_t stream) {
  launch_pdl(moe_gemv_down_kernel<U, SPLIT, FP8>, dim3((unsigned)cdiv(H, GEMV_WARPS / SPLIT), (unsigned)T),
             GEMV_WARPS * 32, 0, stream, out, act, ids, weights, down, H, IE, k, scale, ld);
}
template <int SPLIT, bool FP8 = false>
static void moe_gemv_down_launch(bf16* out, const bf16* act, const int* ids, const float* weights, const void* down,
                                 const float* scale, int ld, int T, int H, int IE, int k, cudaStream_t stream) {
  constexpr int CV = FP8 ? 16 : 8;  // the row's columns a lane's load holds
  if (IE <= 2 * 32 * CV) moe_gemv_down_launch<2, SPLIT, FP8>(out, act, ids, weights, down, scale, ld, T, H, IE, k, stream);
  else if (IE <= 4 * 32 * CV) moe_gemv_down_launch<4, SPLIT, FP8>(out, act, ids, weights, down, scale, ld, T, H, IE, k, stream);
  else moe_gemv_down_launch<MOE_GEMV_DOWN_U, SPLIT, FP8>(out, act, ids, weights, down, scale, ld, T, H, IE, k, stream);
}

// Whether moe_gemv takes a layer of these widths (IE: this rank's slice).
static bool moe_gemv_fits(int H, int IE) { return H % 8 == 0 && IE % 8 == 0 && IE <= MOE_GEMV_DOWN_U * 256; }

// The experts' part of a MoE layer the gemv way (the stage takes it at steps of T <= MOE_GEMV_MAX_T tokens; any
// T computes the same): out [T, H] from x [T, H], ids and weights [T, k] (moe_route's), gate_up [E, 2 IE, H]
// and down [E, H, IE]; act: [T k, IE] of scratch (a.moe_act). out may not alias x.
static void moe_gemv(bf16* out, const bf16* x, const int* ids, const float* weights, const bf16* gate_up,
                     const bf16* down, int T, int H, int IE, int k, bf16* act, cudaStream_t stream) {
  INTERNAL_CHECK(moe_gemv_fits(H, IE) && k >= 1 && k <= MOE_MAX_TOPK, "moe_gemv: H = %d, IE = %d, k = %d", H, IE, k);
  for (const void* ptr : {(const void*)out, (const void*)x, (const void*)gate_up, (const void*)down,
                          (const void*)act})
    check_aligned16("moe_gemv", "a matrix", ptr);
  if (T == 0) return;
  // gate_up: the wider kernel where its grid fits on the GPU at once, else the narrower (above); a lane adds
  // its columns in the same order in both, so the bits are the same.
  static const int64_t wide_fits = gpu_resident_blocks(moe_gemv_gate_up_kernel<false>, GEMV_WARPS * 32, 0);
  const dim3 grid((unsigned)cdiv(IE, GEMV_WARPS), (unsigned)(T * k));
  const auto gate_up_kernel = (int64_t)grid.x * grid.y <= wide_fits
                                  ? moe_gemv_gate_up_kernel<false>
                                  : moe_gemv_gate_up_kernel<false, MOE_GEMV_U_NARROW>;
  launch_pdl(gate_up_kernel, grid, GEMV_WARPS * 32, 0, stream, act, x, ids, (const void*)gate_up, H, IE, k,
             (const float*)nullptr, 0);
  if (T == 1) moe_gemv_down_launch<MOE_DOWN_SPLIT_ONE>(out, act, ids, weights, down, nullptr, 0, T, H, IE, k, stream);
  else moe_gemv_down_launch<1>(out, act, ids, weights, down, nullptr, 0, T, H, IE, k, stream);
  CUDA_CHECK(cudaGetLastError());
}

// ---- The stage, and its switch: moe_gemv ----
// The moe stage this one stands in front of: fused_moe's where that switch is on (it registers first), else
// Part I's moe_plain. Steps of more than MOE_GEMV_MAX_T tokens, and slices moe_gemv does not take, go there.
static void (*g_moe_larger)(Pass& p, const LayerWeights& lw) = moe_plain;

// The first half of section 14's moe (section 35's stage calls it too): the norm, the router's product and
// moe_route in moe_router where this switch and section 18's gemv are on and the step fits it (its arithmetic;
// a pending add to the residual stream, left by an all-reduce at TP > 1 that did not make it, is Part I's
// norm_residual first), else Part I's norm and router product and g_moe_route (moe_route_fast while this switch
// is on).
static void moe_gemv_route(Pass& p, const LayerWeights& lw) {
  const ModelConfig& c = p.m.cfg;
  const int H = c.hidden_size, E = c.num_experts, k = c.num_experts_per_tok;
  Activations& a = p.m.act;
  if (g_opt.moe_gemv && g_opt.gemv && moe_router_fits(p.T, H, E)) {
    const bool normed = p.pending;
    if (normed) norm_residual(p, lw.post_attention_layernorm);
    moe_router(a.x, a.router_logits, a.topk_ids, a.topk_weights, normed ? a.x : a.residual,
               normed ? nullptr : lw.post_attention_layernorm, c.rms_norm_eps, lw.router, p.T, E, H, k,
               c.norm_topk_prob, p.s);
  } else {
    norm_residual(p, lw.post_attention_layernorm);
    linear(*p.m.gemm, a.router_logits, a.x, lw.router, p.T, E, H, p.s);
    g_moe_route(a.topk_ids, a.topk_weights, a.router_logits, p.T, E, k, c.norm_topk_prob, p.s);
  }
}
// Section 14's moe at small steps: moe_gemv_route, then moe_gemv.
static void moe_gemv_stage(Pass& p, const LayerWeights& lw) {
  const ModelConfig& c = p.m.cfg;
  const int H = c.hidden_size, k = c.num_experts_per_tok, IE = c.moe_intermediate_size / p.m.tp;
  if (p.T > MOE_GEMV_MAX_T || !moe_gemv_fits(H, IE)) return g_moe_larger(p, lw);
  Activations& a = p.m.act;
  moe_gemv_route(p, lw);
  moe_gemv(a.hidden, a.x, a.topk_ids, a.topk_weights, lw.experts_gate_up, lw.experts_down, p.T, H, IE, k, a.moe_act,
           p.s);
  p.pending = true;
  if (p.m.tp > 1 && g_stages.all_reduce(p.m.comm, a.hidden, (size_t)p.T * H, p.s, a.residual)) p.pending = false;
}
static void apply_moe_gemv(bool on, Hooks& h) {
  g_opt.moe_gemv = on;
  g_moe_route = on ? moe_route_fast : moe_route;
  if (!on) return;
  ForwardStages& st = stages_for(h);
  if (st.moe != moe_gemv_stage) g_moe_larger = st.moe;
  st.moe = moe_gemv_stage;
}
static const int kMoeGemvRegistered = register_optimization(
    {"moe_gemv", "a small step's MoE layer as a gemv per routed expert, the sum in its epilogue (section 34)",
     true, apply_moe_gemv});

// ==== 35. A mixture of experts, 3: FP8 experts =============================================================
// defines: fused_moe_fp8_reference, fused_moe_fp8_products, fused_moe_fp8, moe_gemv_fp8, fp8_moe_stage; switch
//          fp8_moe
//
// An FP8 checkpoint's experts on the FP8 tensor cores (switch fp8_moe).
// Replaces: for a MoE model whose weights sections 28-30 hold in FP8 (Qwen/Qwen3-30B-A3B-FP8, or a bf16 MoE
// checkpoint under --quantization fp8), section 14's moe stage at every step size. Without this switch the
// FP8 chapter stands aside for a MoE model and section 6a dequantizes the whole checkpoint to bf16.
// Why it is faster: the experts are most of a MoE model's bytes (30B-A3B: 29 of its 30.5B parameters), and a
// decode step is a pass over the experts its tokens chose; kept as the checkpoint stores them they cost one
// byte a weight instead of two, and half the memory, which the KV pool gets.
// The format: section 28's, the experts of a layer stacked by rows as section 6a stacks them in bf16:
//   experts_gate_up  w [E 2 IE, H] e4m3, scale [E 2 IE / 128, ld]: expert e's gate rows, then its up rows
//   experts_down     w [E H, IE]   e4m3, scale [E H / 128, ld]
// (IE this rank's slice). Each expert's matrices start on a 128-row boundary (IE and H multiples of 128),
// so a 128 x 128 block never straddles two experts, and a tensor-parallel slice of IE starts on a block
// (IE / tp a multiple of 128: fp8_weights_problem names the --tp sizes that split so; Qwen3-30B-A3B's 768 at
// --tp 1 and 2, where at --tp 4 the chapter stands aside, as vLLM refuses such a split). The router (mlp.gate)
// is never quantized: it stays bf16, as section 6a loads it.
// The arithmetic: section 28's steps 2 and 3 for both of an expert's products, as fp8_weights computes a
// dense MLP's: x (the normed rows) quantized per token and 128 columns, gate and up each rounded to bf16,
// act = bf16(SiLU(gate) * up), act quantized per row and 128 columns, y = bf16(the down product); then
// section 33's bf16(y * w) and the sum in bf16 in ascending expert id. fused_moe_fp8_reference (below) is the
// CPU's account.
// The work, six launches a layer after the routing: quantize_rows (x), moe_align, fused_moe_kernel<true,
// true> (act in bf16; at long steps fused_moe_wide_kernel<true, true>, section 33's 64-row tiles), quantize_rows
// (act, into the bytes of the moe_gate_up buffer, which the fused path leaves unused), fused_moe_kernel<false,
// true> (or the wide one), moe_combine. The kernels are section 33's: only the bytes
// they copy and the instruction that multiplies them change (see fused_moe_kernel's FP8 note).
// What it costs: two quantizer launches a layer.
// Small steps (1 to MOE_GEMV_MAX_T tokens, where moe_gemv is on) take section 34's path instead, its two
// kernels reading the e4m3 bytes (moe_gemv_fp8; the router in one kernel at 1-2 tokens, moe_gemv_route):
// half the bytes of the bf16 gemv, and no quantizer launches. There the arithmetic is W8A16: the weights'
// e4m3 values are converted to fp32 in registers (exactly), multiplied with the bf16 rows as they are, summed
// per 128-column block and scaled, the roundings after the products as above. So a small step's experts skip
// step 2 (the activations' rounding), which the grouped products take: at a decode step of 1-4 sequences a
// token's experts compute what the dequantized checkpoint's bf16 experts would (up to the bf16 rounding of
// the dequantized weights), at larger steps they carry the activations' e4m3 rounding too
// (fused_moe_fp8_reference with w8a16 is the small steps' CPU account). Why not W8A8 there too: the input
// would be quantized once more per step (a launch, or in every thread block), and a warp per output row has
// no use for the FP8 tensor cores' 16 x 8 tiles; converting each weight costs instructions, and at 1-4 tokens
// what bounds the step is the weights' bytes and the kernels' boundaries, not instructions.
// Preconditions: the FP8 chapter's (H and IE / tp multiples of 128, a Hopper GPU). Switch: fp8_moe.

// What fused_moe_fp8 (below) computes, on the CPU: the rows of the list as fused_moe_reference (section 33),
// each expert's products as fp8_linear_reference computes an FP8 product (the row quantized per 128 columns,
// the e4m3 products summed per block, scaled by s_x s_w). x [T, H], weights [T, k] (bf16 values as float);
// gate_up and down this section's stacked matrices, bytes and scales (ld: their scale rows' stride). w8a16:
// what moe_gemv_fp8 computes (the rows not quantized; the same roundings and sum, as moe_gemv's are
// fused_moe's).
static void fused_moe_fp8_reference(std::vector<float>& act, std::vector<float>& wy, float* out, const float* x,
                                    const std::vector<int>& rows, const std::vector<int>& tile_expert,
                                    const std::vector<int>& pair_row, const int* ids, const float* weights,
                                    const uint8_t* gate_up, const float* gate_up_scale, int gate_up_ld,
                                    const uint8_t* down, const float* down_scale, int down_ld, int T, int H, int IE,
                                    int k, bool w8a16 = false) {
  fused_moe_rows_reference(act, wy, out, x, rows, tile_expert, pair_row, ids, weights, T, H, IE, k,
                           [&](float* y, const float* row, int e, bool gu) {
                             if (gu)
                               fp8_linear_reference(y, row, gate_up + (size_t)e * 2 * IE * H,
                                                    gate_up_scale + (size_t)e * 2 * IE / 128 * gate_up_ld,
                                                    gate_up_ld, 1, 2 * IE, H, w8a16);
                             else
                               fp8_linear_reference(y, row, down + (size_t)e * H * IE,
                                                    down_scale + (size_t)e * H / 128 * down_ld, down_ld, 1, H, IE,
                                                    w8a16);
                           });
}

// GATE_UP: out = act [RM, IE] from a = x quantized (xq [T4, H], xs [H/128, T4]) and W = experts_gate_up (N =
// 2 IE rows an expert, K = H); down: out = y [RM, H] from a = act quantized ([RM, IE], [IE/128, RM]) and W =
// experts_down (N = H, K = IE), weights [T, k]. a_ld: the rows of a's scale table (T4, or RM).
// The list in tiles of `tile` rows: MOE_TILE (fused_moe_kernel) or FMOE_WIDE_TILE (fused_moe_wide_kernel).
template <bool GATE_UP>
static void fused_moe_fp8_products(bf16* out, const uint8_t* a, const float* a_scale, int a_ld, const int* rows,
                                   const int* tile_expert, const float* weights, const Fp8Matrix& W, int64_t RM,
                                   int N, int k, int tile, cudaStream_t stream) {
  const char* name = GATE_UP ? "fused_moe_fp8 (gate_up)" : "fused_moe_fp8 (down)";
  const int K = W.K;
  INTERNAL_CHECK((tile == MOE_TILE || tile == FMOE_WIDE_TILE) && RM % tile == 0 && RM / tile <= 65535 &&
                     N % 128 == 0 && K % 128 == 0 && W.N % N == 0 && (!GATE_UP || N % 256 == 0),
                 "%s: tile = %d, RM = %lld, N = %d, K = %d, W.N = %d", name, tile, (long long)RM, N, K, W.N);
  check_aligned16(name, "out", out);
  check_aligned16(name, "a", a);
  check_aligned16(name, "W", W.w);
  if (RM == 0) return;
  if (tile == MOE_TILE) {
    const int cols = GATE_UP ? FMOE_COLS / 2 : FMOE_COLS, NOUT = GATE_UP ? N / 2 : N;
    const dim3 grid((unsigned)(RM / MOE_TILE), (unsigned)cdiv(NOUT, cols));
    fused_moe_kernel<GATE_UP, true><<<grid, FMOE_THREADS, 0, stream>>>(out, a, rows, tile_expert, weights, W.w, N,
                                                                       K, k, a_scale, a_ld, W.scale, W.ld);
  } else {
    fused_moe_wide_launch<GATE_UP, true>(out, a, rows, tile_expert, weights, W.w, RM, N, K, k, a_scale, a_ld,
                                         W.scale, W.ld, stream);
  }
  CUDA_CHECK(cudaGetLastError());
}

// The experts' part of a MoE layer with FP8 experts: fused_moe's arguments, the experts as above, and xq, xs:
// room for x quantized (T rounded up to 4 rows of H). out [T, H] may not alias x. tile: the list's, as
// fused_moe's (section 33's fused_moe_tile: long steps in 64-row tiles, from more rows an expert than bf16's).
static void fused_moe_fp8(bf16* out, const bf16* x, const int* ids, const float* weights, const Fp8Matrix& gate_up,
                          const Fp8Matrix& down, int T, int H, int IE, int E, int k, uint8_t* xq, float* xs,
                          const Activations& a, cudaStream_t stream, int tile = 0) {
  INTERNAL_CHECK(gate_up.N == E * 2 * IE && gate_up.K == H && down.N == E * H && down.K == IE,
                 "fused_moe_fp8: experts [%d, %d] and [%d, %d] for E %d, H %d, IE %d", gate_up.N, gate_up.K, down.N,
                 down.K, E, H, IE);
  if (tile == 0) tile = fused_moe_tile(T, k, E, true);
  const int64_t RM = moe_rows_max(T, k, E, tile);
  uint8_t* aq = reinterpret_cast<uint8_t*>(a.moe_gate_up);  // act quantized: [RM, IE] bytes, then [IE/128, RM]
  float* as = reinterpret_cast<float*>(aq + RM * IE);       // (RM a multiple of 16: 16-byte aligned)
  quantize_rows(xq, xs, x, T, H, stream);
  moe_align(a.moe_rows, a.moe_pair_row, a.moe_tile_expert, ids, T, k, E, stream, tile);
  fused_moe_fp8_products<true>(a.moe_act, xq, xs, (int)cdiv(T, 4) * 4, a.moe_rows, a.moe_tile_expert, nullptr,
                               gate_up, RM, 2 * IE, k, tile, stream);
  quantize_rows(aq, as, a.moe_act, (int)RM, IE, stream);
  fused_moe_fp8_products<false>(a.moe_out, aq, as, (int)RM, a.moe_rows, a.moe_tile_expert, weights, down, RM, H,
                                k, tile, stream);
  moe_combine(out, a.moe_out, ids, nullptr, a.moe_pair_row, T, H, k, stream);  // (weights applied already)
}

// Small steps (T <= MOE_GEMV_MAX_T, where moe_gemv is on): section 34's moe_gemv with its kernels reading
// the FP8 experts (their FP8 note), W8A16. gate_up and down as above; act: [T k, IE] of scratch. out may not
// alias x.
static void moe_gemv_fp8(bf16* out, const bf16* x, const int* ids, const float* weights, const Fp8Matrix& gate_up,
                         const Fp8Matrix& down, int T, int H, int IE, int k, bf16* act, cudaStream_t stream) {
  INTERNAL_CHECK(moe_gemv_fits(H, IE) && H % 128 == 0 && IE % 128 == 0 && gate_up.K == H && down.K == IE &&
                     k >= 1 && k <= MOE_MAX_TOPK, "moe_gemv_fp8: H = %d, IE = %d, k = %d", H, IE, k);
  for (const void* ptr : {(const void*)out, (const void*)x, (const void*)gate_up.w, (const void*)down.w,
                          (const void*)act})
    check_aligned16("moe_gemv_fp8", "a matrix", ptr);
  if (T == 0) return;
  launch_pdl(moe_gemv_gate_up_kernel<true>, dim3((unsigned)cdiv(IE, GEMV_WARPS), (unsigned)(T * k)),
             GEMV_WARPS * 32, 0, stream, act, x, ids, (const void*)gate_up.w, H, IE, k, (const float*)gate_up.scale,
             gate_up.ld);
  if (T == 1)
    moe_gemv_down_launch<MOE_DOWN_SPLIT_ONE, true>(out, act, ids, weights, down.w, down.scale, down.ld, T, H, IE, k,
                                                   stream);
  else moe_gemv_down_launch<1, true>(out, act, ids, weights, down.w, down.scale, down.ld, T, H, IE, k, stream);
  CUDA_CHECK(cudaGetLastError());
}

// ---- The stage, and its switch: fp8_moe ----
// The moe stage before this one (section 34's, 33's or Part I's), for an engine whose experts are bf16.
static void (*g_moe_bf16)(Pass& p, const LayerWeights& lw) = moe_plain;

// Section 14's moe with FP8 experts: the routing (section 34's moe_gemv_route: moe_router where it takes the
// step, else Part I's three calls), then moe_gemv_fp8 at small steps where moe_gemv is on, else fused_moe_fp8.
static void fp8_moe_stage(Pass& p, const LayerWeights& lw) {
  Fp8Weights& f = g_fp8_weights;
  if (!f.held) return g_moe_bf16(p, lw);
  Activations& a = p.m.act;
  const ModelConfig& c = p.m.cfg;
  const int H = c.hidden_size, E = c.num_experts, k = c.num_experts_per_tok, IE = c.moe_intermediate_size / p.m.tp;
  moe_gemv_route(p, lw);
  const Fp8Layer& fl = f.layers[p.l];
  if (g_opt.moe_gemv && p.T <= MOE_GEMV_MAX_T && moe_gemv_fits(H, IE))
    moe_gemv_fp8(a.hidden, a.x, a.topk_ids, a.topk_weights, fl.experts_gate_up, fl.experts_down, p.T, H, IE, k,
                 a.moe_act, p.s);
  else
    fused_moe_fp8(a.hidden, a.x, a.topk_ids, a.topk_weights, fl.experts_gate_up, fl.experts_down, p.T, H, IE, E, k,
                  f.xq, f.xs, a, p.s);
  p.pending = true;
  if (p.m.tp > 1 && g_stages.all_reduce(p.m.comm, a.hidden, (size_t)p.T * H, p.s, a.residual)) p.pending = false;
}
static void apply_fp8_moe(bool on, Hooks& h) {
  g_opt.fp8_moe = on;
  if (!on) return;
  ForwardStages& st = stages_for(h);
  if (st.moe != fp8_moe_stage) g_moe_bf16 = st.moe;
  st.moe = fp8_moe_stage;
}
static std::string fp8_moe_note(const Qwen3& model) {
  if (!g_fp8_weights.held || model.cfg.num_experts == 0) return "";
  return g_opt.moe_gemv ? "FP8 experts: a gemv reading e4m3 (W8A16) at steps of 1-4 tokens, grouped products on "
                          "the FP8 tensor cores at the others"
                        : "FP8 experts: grouped products on the FP8 tensor cores at every step size";
}
static const int kFp8MoeRegistered = register_optimization(
    {"fp8_moe", "with fp8_weights, a MoE model's experts kept in FP8, grouped products on FP8 tensor cores "
     "(section 35)", true, apply_fp8_moe, fp8_moe_note, {{"expert_weight_bytes_saved", 1}}});


// ==== 36. A mixture of experts, 4: a decode step's MoE layers inside the persistent kernel ==================
// defines: PERSIST_MOE_MAX_TOPK, PersistRoute, persist_route_in, persist_issue_expert, persist_stage_moe_down,
//          persist_moe_down_chunk, persist_moe_route, persist_moe_refill, persist_moe_epilogue,
//          persist_moe_problem, persist_moe_ops; switch persistent_moe
//
// Replaces: at the decode steps the persistent kernel takes (sections 24-27: 1, 2 or 4 sequences where its
// shared memory fits and start-up measures it faster), section 14's whole path for a MoE model, whose MoE
// layers run section 34's three kernels (the router, then the gemv of gate_up, then down's) and whose
// attention half runs section 18's and 19's (norm and qkv, attention, o): six kernels a layer.
// Why it could be faster. A batch-1 step of Qwen3-30B-A3B reads about 3 GB of weights (its attention and the 8
// experts each token routes to, in each of 48 layers) and does little else, yet section 14's path takes about
// twice the time the copy bandwidth needs for them (docs/performance.md): most of the difference is its 300 kernel
// boundaries, each a drain of one kernel and a cold start of the next (section 24), in a layer whose parts each
// stream in a few microseconds. The persistent kernel has no boundaries, and the only new thing a MoE layer asks
// of it is this: its weights depend on the step. The kernel's weight stream runs ahead of the step, across
// operations and layers (section 24), but which experts' rows a MoE layer reads is known only once its router has
// run. So a MoE layer is three operations, and the stream stops once per layer, at the router:
//   * ROUTER: a gemv like the others, over the router's E rows, its input the RMSNorm of the residual stream
//     (post_attention_layernorm); its logits are rounded to bf16 into act.router_logits, as section 34's;
//   * routing: every thread block with rows of the layer's experts waits for the router, reads the B x E
//     logits back through L2 and routes each token itself: Part I's moe_route_row's picks and weights bit for
//     bit, made by the whole block (persist_route_in), then each token's picks in ascending expert id (as
//     moe_order_by_expert orders them). The same routing in every block, made where it is used: no operation
//     and no wait more. It goes into the block's shared memory (PersistRoute) with the layer it belongs to
//     (block 0 also writes it to act.topk_ids, for the tests);
//   * the stream's copies of an expert operation wait for that: while the block's routing is an earlier
//     layer's, persist_issue_expert issues nothing, and the block commits an empty cp.async group in its place,
//     so the count of groups stays one per chunk consumed (section 24's ring waits by that count). Once it
//     has routed, the block refills its ring (RING - 1 chunks) before it takes its first chunk. A layer's one
//     bubble is that refill, a memory round trip, where section 34 had three kernel boundaries;
//   * MOE_GATE_UP: group g is 8 gate rows and their 8 up rows of pair p = g / ceil(IE / 8) (token p / k and
//     its (p % k)-th expert in id order), as GATE_UP pairs them. Its input is GATE_UP's (the normed rows of all
//     B tokens, the B columns of the tensor-core product, of which the epilogue keeps the pair's token's
//     column): act[p, j] = bf16(SiLU(bf16(gate)) * bf16(up)) into act.moe_act;
//   * MOE_DOWN: group g is 16 output rows of token b = g / ceil(H / 16); its input is the token's k rows of act
//     (K = k IE, its column 0 of the product), and its chunks run on across the experts' columns (chunk kc:
//     columns [1024 kc, 1024 kc + 1024) of the k IE, a warp's 64-column strip within one expert), so a warp
//     adds each strip's sums to its own sums for that strip's expert (in the epilogue's buffer: k experts x
//     16 warps x 16 rows), and the epilogue makes section 34's sum: each expert's y over the warps, rounded,
//     times its weight, rounded, added in ascending expert id, rounded, then the residual add as DOWN's.
// Dense layers of a MoE model (mlp_only_layers) are GATE_UP and DOWN as in a dense model.
// What it computes: section 34's arithmetic with the sums inside a dot product in the kernel's order, so its
// results match section 14's path within float rounding. One difference can be larger: a router logit one
// bf16 step apart can swap a token's k-th and (k+1)-th expert where they nearly tie, and that token's output
// then differs by an expert's share (gpu_moe's check counts such steps and does not hold them to the bar).
// Limits (persist_moe_problem; section 14's path runs otherwise): one GPU, bf16 weights and cache, k <=
// PERSIST_MOE_MAX_TOPK (MOE_DOWN's per-expert sums fill one of the epilogue's two buffers), IE a multiple of 64
// (a warp's 64-column strip lies in one expert), E <= MOE_MAX_EXPERTS.
// Where it stands: start-up measures it against section 14's path like any plan (section 27), and on an H200
// at Qwen3-30B-A3B's shape section 14's path is still the faster, so it keeps those steps (docs/performance.md
// has the breakdown of a step and what is next).
// Switch: persistent_moe (with persistent; on by default).

constexpr int PERSIST_MOE_MAX_TOPK = 8;
static_assert(PERSIST_MOE_MAX_TOPK * PERSIST_WARPS * PERSIST_ROWS <= PERSIST_WARPS * PERSIST_ROWS * 8,
              "MOE_DOWN's per-expert partial sums fill one of the epilogue's buffers");

// A thread block's routing of one layer, in shared memory after the operation list.
struct PersistRoute {
  int layer;                                            // the layer routed (-1: none yet this step)
  int ids[PERSIST_MAX_B * PERSIST_MOE_MAX_TOPK];        // [B, k] each token's experts, ascending id
  float weights[PERSIST_MAX_B * PERSIST_MOE_MAX_TOPK];  // their routing weights
  int picked[PERSIST_MAX_B * PERSIST_MOE_MAX_TOPK];     // [B, k] the picks in moe_route_row's order (rank)
  float picked_p[PERSIST_MAX_B * PERSIST_MOE_MAX_TOPK];
  float p[PERSIST_MAX_B * MOE_MAX_EXPERTS];             // [B, E] the router's logits, then the probabilities
};
__host__ __device__ size_t persist_route_bytes() { return (sizeof(PersistRoute) + 15) / 16 * 16; }
__device__ void persist_route_start(PersistRoute* route) {
  if (threadIdx.x == 0) route->layer = -1;
}

// The routing of `layer` for the B tokens, from the router's logits (written by other blocks: through L2),
// into route: moe_route_row's results bit for bit, made by the whole block instead of one warp (one warp's
// serial top-k, k rounds over every expert, was most of the routing's time: docs/performance.md), with four
// barriers. Warp b makes token b's softmax maximum and sum exactly as
// moe_route_row does (lane l over experts l, l + 32, ... in order, then the warp's butterfly) and its
// probabilities, expf(x - m) / sum as there; every thread then takes experts of a token (one per thread where
// B E <= 512) and counts how many of the token's experts come before its own in moe_ranks_before's total
// order: the experts of rank < k are moe_route_row's picks, in its order. Warp b then adds their
// probabilities as moe_route_row does (lane j the j-th pick) for the renormalisation, and lane j places pick j
// at its place in ascending expert id (moe_order_by_expert's order). Every thread of the block calls it; it
// ends with a barrier.
template <int B>
__device__ void persist_route_in(const PersistArgs& a, int layer, PersistRoute* route) {
  const int E = a.E, k = a.topk, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned short* from = reinterpret_cast<const unsigned short*>(a.router_logits);
  for (int c = threadIdx.x; c < B * E; c += PERSIST_THREADS) {
    const unsigned short bits = __ldcg(from + c);
    route->p[c] = __bfloat162float(*reinterpret_cast<const bf16*>(&bits));
  }
  __syncthreads();
  if (warp < B) {  // token `warp`'s softmax, as moe_route_row makes it
    float* x = route->p + warp * E;
    float m = -INFINITY, sum = 0.f;
    for (int e = lane; e < E; e += 32) m = fmaxf(m, x[e]);
    m = warp_max_f(m);
    for (int e = lane; e < E; e += 32) sum += expf(x[e] - m);
    sum = warp_sum_f(sum);
    for (int e = lane; e < E; e += 32) {
      float p = expf(x[e] - m);
      p /= sum;
      x[e] = p;
    }
  }
  __syncthreads();
  for (int c = threadIdx.x; c < B * E; c += PERSIST_THREADS) {  // each expert's rank
    const int b = c / E, e = c - b * E;
    const float* p = route->p + b * E;
    const float mine = p[e];
    int rank = 0;
#pragma unroll 8
    for (int f = 0; f < E; f++) rank += moe_ranks_before(p[f], f, mine, e);
    if (rank < k) route->picked[b * k + rank] = e, route->picked_p[b * k + rank] = mine;
  }
  __syncthreads();
  if (warp < B) {  // the renormalisation, as moe_route_row makes it; then pick `lane` to its place by id
    const int* picked = route->picked + warp * k;
    const float mine = lane < k ? route->picked_p[warp * k + lane] : 0.f;
    const float total = warp_sum_f(mine);
    if (lane < k) {
      const int e = picked[lane];
      int place = 0;
      for (int i = 0; i < k; i++) place += picked[i] < e;
      route->ids[warp * k + place] = e;
      route->weights[warp * k + place] = a.norm_topk ? mine / total : mine;
      if (blockIdx.x == 0) a.topk_ids[warp * k + place] = e;
    }
  }
  if (threadIdx.x == 0) route->layer = layer;
  __syncthreads();
}

// The weight stream's copy of chunk (c.g, c.kc) of an expert operation, this warp's strip (section 24's
// layout), from the experts its group's token routed to; false, issuing nothing, while the block's routing is
// not this operation's layer's (see above). As section 24's copy, a strip that lies wholly inside its
// expert's rows costs one address and three strides; other strips (odd shapes' edges) place piece by piece,
// zeros past the last row or column. A MOE_DOWN strip past the token's k IE columns is not copied at all: its
// products are skipped (persist_moe_down_chunk).
__device__ __forceinline__ bool persist_issue_expert(const PersistOp& op, const PersistCursor& c, bf16* slot,
                                                     const PersistRoute* route) {
  if (route->layer != op.layer) return false;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, k = op.topk;
  bf16* strip = slot + warp * PERSIST_ROWS * PERSIST_WARP_K;
  const bool gate_up = op.kind == PERSIST_MOE_GATE_UP;
  // The group's first weight row (row 0 of the strip), the row length, how many rows the strip's rows 8-15
  // are from its rows 0-7 (GATE_UP: the up rows, N rows on), how many rows are valid, and the strip's column.
  int64_t first;
  int len, valid_rows, col;
  int64_t half;
  if (gate_up) {  // W [E, 2 IE, H]; N = IE, K = H; group: pair p's gate rows j0.. and their up rows
    const int per_pair = op.N / 8, p = c.g / per_pair, j0 = (c.g - p * per_pair) * 8;
    first = ((int64_t)route->ids[p] * 2 * op.N + j0), len = op.K, half = op.N, valid_rows = 8;
    col = c.kc * PERSIST_KC + warp * PERSIST_WARP_K;
  } else {  // MOE_DOWN: W [E, H, IE]; N = H, K = k IE; group: token b's output rows n0..; a chunk runs on
            // across the token's experts' columns, a strip within one expert (IE % 64 == 0)
    const int IE = op.K / k, per_token = (op.N + 15) / 16;
    const int b = c.g / per_token, n0 = (c.g - b * per_token) * 16;
    const int at = c.kc * PERSIST_KC + warp * PERSIST_WARP_K, j = at / IE;  // the strip's column of k IE
    if (at >= op.K) return true;  // past the token's last expert: nothing to copy
    col = at - j * IE;
    first = (int64_t)route->ids[b * k + j] * op.N + n0, len = IE, half = 8, valid_rows = min(16, op.N - n0);
  }
  const int r0 = lane >> 3, piece = lane & 7;
  if (col + PERSIST_WARP_K <= len && valid_rows == (gate_up ? 8 : 16)) {
    const bf16* src = op.W + (first + r0) * len + col + piece * 8;
    const int64_t four = 4 * (int64_t)len, up = half * len;
    bf16* dst = strip + r0 * PERSIST_WARP_K;
    const int rot0 = (piece ^ r0) << 3, rot4 = (piece ^ (r0 + 4)) << 3;
    cp_async_16(dst + rot0, src, true);
    cp_async_16(dst + 4 * PERSIST_WARP_K + rot4, src + four, true);
    cp_async_16(dst + 8 * PERSIST_WARP_K + rot0, src + up, true);
    cp_async_16(dst + 12 * PERSIST_WARP_K + rot4, src + up + four, true);
    return true;
  }
#pragma unroll
  for (int i = 0; i < PERSIST_ROWS * PERSIST_WARP_K / 8 / 32; i++) {
    const int q = lane + 32 * i, r = q >> 3, pc = q & 7, cc = col + pc * 8;
    const int rr = gate_up ? (r & 7) : r;  // the row's place among the group's valid rows
    const bool valid = rr < valid_rows && cc < len;
    const int64_t row = first + (gate_up && r >= 8 ? half : 0) + rr;
    cp_async_16(strip + persist_strip_index(r, pc), valid ? op.W + row * len + cc : op.W, valid);
  }
  return true;
}

// MOE_DOWN's input for all B tokens into xs [B, K + 8] (a token's k rows of act, in its experts' id order),
// and the residual stream into res [B, H] for the epilogue.
template <int B>
__device__ void persist_stage_moe_down(const PersistArgs& a, const PersistOp& op, bf16* xs, bf16* res) {
  const int ks = op.K + 8;
  for (int c = threadIdx.x; c < B * op.K / 8; c += PERSIST_THREADS) {
    const int b = c / (op.K / 8), j = c % (op.K / 8);
    const uint4* act = reinterpret_cast<const uint4*>(a.moe_act + (size_t)b * op.K);
    reinterpret_cast<uint4*>(xs + b * ks)[j] = __ldcg(act + j);
  }
  persist_copy_in(res, a.residual, B * op.N);
  __syncthreads();
}

// acc = this warp's strip of MOE_DOWN's chunk kc (16 rows of one expert's down x 64 of its columns: chunk kc
// holds columns [1024 kc, 1024 kc + 1024) of the token's k IE, a strip lies within one expert) times the same
// columns of the group's token's act row, that token as column 0 of the product, added to the warp's sums of
// its 16 rows for that expert in ex [k][WARPS][16], which the warp zeroes at the group's first chunk (a warp
// meets some experts in no strip: at IE 768, warp 0's strips start at 0, 1024, ... and miss experts 3 and 7).
__device__ __forceinline__ void persist_moe_down_chunk(const PersistOp& op, int g, int kc, const bf16* slot,
                                                       const bf16* xs, float* ex, float (&acc)[4]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, k = op.topk, IE = op.K / k;
  float* mine = ex + warp * PERSIST_ROWS;  // expert j's sums at mine[j * WARPS * 16 + row]
  if (kc == 0) {
    for (int i = lane; i < k * PERSIST_ROWS; i += 32)
      mine[i / PERSIST_ROWS * PERSIST_WARPS * PERSIST_ROWS + i % PERSIST_ROWS] = 0.f;
    __syncwarp();
  }
  const int at = kc * PERSIST_KC + warp * PERSIST_WARP_K;  // the strip's column of the token's k IE
  if (at >= op.K) return;
  const int b = g / ((op.N + 15) / 16), j = at / IE;
  const bf16* strip = slot + warp * PERSIST_ROWS * PERSIST_WARP_K;
  const bf16* arow = strip + ((lane & 7) + ((lane >> 3) & 1) * 8) * PERSIST_WARP_K;
  const bf16* xrow = xs + b * (op.K + 8) + at + 2 * (lane & 3);
  acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
#pragma unroll
  for (int t = 0; t < PERSIST_WARP_K / 16; t++) {
    uint32_t w[4];
    ldmatrix_x4(w, arow + (((2 * t + (lane >> 4)) ^ (lane & 7)) << 3));
    uint32_t x0 = 0, x1 = 0;
    if (lane < 4) {  // column 0
      x0 = *reinterpret_cast<const uint32_t*>(xrow + 16 * t);
      x1 = *reinterpret_cast<const uint32_t*>(xrow + 16 * t + 8);
    }
    mma_bf16_16816(acc, w, x0, x1);
  }
  if ((lane & 3) == 0) {  // column 0: rows lane / 4 and lane / 4 + 8
    mine[j * PERSIST_WARPS * PERSIST_ROWS + lane / 4] += acc[0];
    mine[j * PERSIST_WARPS * PERSIST_ROWS + lane / 4 + 8] += acc[2];
  }
  __syncwarp();
}

// Before an expert operation's first chunk, in a block whose routing is an earlier layer's (section 26's
// kernel calls these past the operation's wait): the routing, then, where the stream stopped at this
// operation (nothing of it issued: load.n == consumed), the ring refilled with its first RING - 1 chunks.
template <int B>
__device__ void persist_moe_route(const PersistArgs& a, const PersistOp* ops, int o, PersistRoute* route) {
  persist_route_in<B>(a, ops[o].layer, route);
  persist_trace(a, o, 6);
}
__device__ void persist_moe_refill(const PersistArgs& a, const PersistOp* ops, PersistCursor& load,
                                   unsigned consumed, bf16* ring, const PersistRoute* route) {
  if (load.n != (int)consumed) return;
  for (int s = 0; s < PERSIST_RING - 1; s++)
    persist_issue<true>(a, ops, load, ring + (consumed + s) % PERSIST_RING * PERSIST_SLOT_ELEMS, route);
}

// The end of a group of a MoE layer's operation (section 26's loop, in place of persist_gemv_epilogue): ROUTER
// writes its logits, MOE_GATE_UP the pair's act, MOE_DOWN makes section 34's sum from the per-expert sums
// (red's buffer `parity`) and adds the residual stream (staged in res), as DOWN does.
template <int B>
__device__ void persist_moe_epilogue(const PersistArgs& a, const PersistOp& op, int g, int parity, float (&acc)[4],
                                     float* red, const bf16* res, const PersistRoute* route) {
  const int t = threadIdx.x;
  if (op.kind == PERSIST_MOE_DOWN) {
    __syncthreads();
    const float* ex = red + parity * PERSIST_WARPS * PERSIST_ROWS * 8;
    const int per_token = (op.N + 15) / 16, b = g / per_token, n = (g - b * per_token) * 16 + t, k = op.topk;
    if (t < PERSIST_ROWS && n < op.N) {
      float sum = 0.f;
      for (int j = 0; j < k; j++) {  // in ascending expert id (the routing's order)
        float y = 0.f;
        for (int w = 0; w < PERSIST_WARPS; w++) y += ex[(j * PERSIST_WARPS + w) * PERSIST_ROWS + t];
        sum = bf16_round(sum + bf16_round(bf16_round(y) * route->weights[b * k + j]));
      }
      const float r0 = __bfloat162float(res[b * op.N + n]);
      a.residual[(size_t)b * op.N + n] = __float2bfloat16(sum + r0);
    }
    return;
  }
  const float* all = persist_warp_sums(acc, red, parity);
  if (op.kind == PERSIST_ROUTER) {
    if (t < PERSIST_ROWS * B) {
      const int r = t / B, b = t % B, n = g * PERSIST_ROWS + r;
      if (n < op.N) a.router_logits[(size_t)b * op.N + n] = __float2bfloat16(persist_row_sum(all, r, b));
    }
  } else if (t < PERSIST_ROWS / 2) {  // MOE_GATE_UP: gate row t and its up row t + 8, the pair's token's column
    const int per_pair = op.N / 8, p = g / per_pair, b = p / op.topk, j = (g - p * per_pair) * 8 + t;
    const float gate = bf16_round(persist_row_sum(all, t, b)), up = bf16_round(persist_row_sum(all, t + 8, b));
    a.moe_act[(size_t)p * op.N + j] = __float2bfloat16(silu_mul(gate, up));
  }
}

// ---- The plans' MoE layers, and the switch: persistent_moe ----
// Why the kernel cannot take this MoE model ("": it can). fp8: the plan would read FP8 weights (section 30a).
static std::string persist_moe_problem(const Qwen3& model, bool fp8) {
  const ModelConfig& c = model.cfg;
  const int IE = c.moe_intermediate_size / model.tp;
  if (model.tp > 1) return "a MoE model at tensor parallelism keeps section 14's path (section 36 runs on one GPU)";
  if (fp8) return "a MoE model with FP8 weights keeps section 14's path (section 36 reads bf16 experts)";
  if (c.num_experts_per_tok > PERSIST_MOE_MAX_TOPK)
    return "a MoE model routing each token to more than " + std::to_string(PERSIST_MOE_MAX_TOPK) +
           " experts keeps section 14's path";
  if (IE % PERSIST_WARP_K)
    return "a MoE model whose experts' intermediate size is not a multiple of 64 keeps section 14's path";
  if (c.num_experts > MOE_MAX_EXPERTS)  // (validate_config refuses such a model; PersistRoute is sized by it)
    return "a MoE model of more than " + std::to_string(MOE_MAX_EXPERTS) + " experts keeps section 14's path";
  return "";
}
// MoE layer l's three operations (see above), appended to ops for a plan of B sequences over sms thread blocks;
// returns the longest input they stage (MOE_DOWN's k IE).
static int persist_moe_ops(const Qwen3& model, int l, int B, int sms, std::vector<PersistOp>& ops) {
  const ModelConfig& c = model.cfg;
  const LayerWeights& lw = model.w.layers[l];
  const int H = c.hidden_size, E = c.num_experts, k = c.num_experts_per_tok, IE = c.moe_intermediate_size;
  auto add = [&](int kind, const bf16* W, const bf16* norm_w, int N, int K, int groups) {
    PersistOp op = {kind, l, W, norm_w, nullptr, N, K, groups, std::min(groups, sms)};
    op.topk = k;
    ops.push_back(op);
  };
  add(PERSIST_ROUTER, lw.router, lw.post_attention_layernorm, E, H, (int)cdiv(E, PERSIST_ROWS));
  add(PERSIST_MOE_GATE_UP, lw.experts_gate_up, lw.post_attention_layernorm, IE, H,
      B * k * (int)cdiv(IE, PERSIST_ROWS / 2));
  add(PERSIST_MOE_DOWN, lw.experts_down, nullptr, H, k * IE, B * (int)cdiv(H, PERSIST_ROWS));
  return k * IE;
}
static void apply_persistent_moe(bool on, Hooks&) {
  g_opt.persistent_moe = on;
  if (!on) return;
  g_persistent.moe_problem = persist_moe_problem;
  g_persistent.moe_ops = persist_moe_ops;
}
static const int kPersistentMoeRegistered = register_optimization(
    {"persistent_moe", "a MoE model's small decode steps in the persistent kernel (section 36)", true,
     apply_persistent_moe});

// ##########################################################################################################
// PART III — THE PROGRAM AROUND IT
// ##########################################################################################################

// ==== 37. Reading the configuration: config.json, flags and sampling fields ================================
// defines: parse_moe_config, parse_model_config, load_model_config, parse_optimizations, optimizations_str,
//          parse_kv_cache_dtype, parse_quantization_config, parse_quantization, validate_config,
//          validate_sampling
//
// Section 2 says what each setting means; this section reads them from where a user writes them and
// refuses what the engine cannot run, with a message that names the file, field or flag, what was expected
// and what was found: config.json (a Qwen3, dense or MoE), --opt and --kv-cache-dtype against what the build's
// registries hold, the engine settings (Config) and a request's sampling fields (vLLM's ranges).

// A field of config.json that must be there and be a number; the message names the file and field.
static double config_number(const json& j, const char* key, const std::string& path) {
  if (!j.contains(key)) die("%s: missing field \"%s\" (is this a Qwen3 config.json?)", path.c_str(), key);
  if (!j[key].is_number()) die("%s: field \"%s\" must be a number, found %s", path.c_str(), key, j[key].dump().c_str());
  return j[key].get<double>();
}

// An integer field (a count or a size): a fraction or a value past int is refused, never truncated.
static int config_int(const json& j, const char* key, const std::string& path) {
  double v = config_number(j, key, path);
  if (v != std::floor(v) || v < INT32_MIN || v > INT32_MAX)
    die("%s: field \"%s\" must be an integer, found %s", path.c_str(), key, j[key].dump().c_str());
  return (int)v;
}

// A true/false field that may be absent.
static bool config_bool(const json& j, const char* key, bool absent, const std::string& path) {
  if (!j.contains(key) || j[key].is_null()) return absent;
  if (!j[key].is_boolean()) die("%s: field \"%s\" must be true or false, found %s", path.c_str(), key,
                                j[key].dump().c_str());
  return j[key].get<bool>();
}

static std::vector<int> eos_ids_from(const json& v) {
  std::vector<int> ids;
  auto add = [&](const json& x) {
    if (x.is_number_integer() && x.get<int64_t>() >= 0 && x.get<int64_t>() <= INT32_MAX)
      ids.push_back(x.get<int>());
  };
  add(v);
  if (v.is_array())
    for (auto& x : v) add(x);
  return ids;
}

// config.json's quantization_config, when there is one: only Qwen's FP8 format (section 6a says what it
// stores) is read, with the fields as the published Qwen/Qwen3-*-FP8 configs write them; fmt and
// activation_scheme may be absent (transformers' FineGrainedFP8Config writes no fmt; its activation_scheme
// defaults to dynamic). Sets c.block_quantized and c.not_quantized, or refuses with the field, what was found
// and what nanovllm reads.
static void parse_quantization_config(const json& j, ModelConfig& c, const std::string& path) {
  if (!j.contains("quantization_config") || j["quantization_config"].is_null()) return;
  const json& q = j["quantization_config"];
  const char* p = path.c_str();
  if (!q.is_object()) die("%s: field \"quantization_config\" must be an object, found %s", p, q.dump().c_str());
  if (!q.contains("quant_method") || !q["quant_method"].is_string())
    die("%s: quantization_config needs \"quant_method\" as a string, found %s; nanovllm reads \"fp8\" "
        "(Qwen/Qwen3-*-FP8)", p, q.contains("quant_method") ? q["quant_method"].dump().c_str() : "none");
  const std::string method = q["quant_method"];
  if (method != "fp8")
    die("%s: quantization_config.quant_method \"%s\" is not supported; nanovllm reads unquantized checkpoints "
        "(BF16, F16, F32) and \"fp8\" ones with 128 x 128 block scales (Qwen/Qwen3-*-FP8), not gptq, awq, "
        "compressed-tensors, bitsandbytes or gguf", p, method.c_str());
  auto given = [&](const char* key) { return q.contains(key) && !q[key].is_null(); };  // null: absent
  if (given("fmt") && q["fmt"] != "e4m3")
    die("%s: quantization_config.fmt %s is not supported; nanovllm reads \"e4m3\" weights", p,
        q["fmt"].dump().c_str());
  if (given("activation_scheme") && q["activation_scheme"] != "dynamic")
    die("%s: quantization_config.activation_scheme %s is not supported; nanovllm reads \"dynamic\" checkpoints "
        "(a static one stores per-tensor activation scales, input_scale)", p, q["activation_scheme"].dump().c_str());
  if (!q.contains("weight_block_size") || q["weight_block_size"].is_null())
    die("%s: quantization_config has no \"weight_block_size\": a per-tensor FP8 checkpoint (one weight_scale per "
        "tensor) is not supported; nanovllm reads block-scaled ones with weight_block_size [128, 128]", p);
  if (q["weight_block_size"] != json::array({128, 128}))
    die("%s: quantization_config.weight_block_size must be [128, 128], found %s", p,
        q["weight_block_size"].dump().c_str());
  c.block_quantized = true;
  c.not_quantized.clear();
  if (!q.contains("modules_to_not_convert") || q["modules_to_not_convert"].is_null()) return;
  const json& keep = q["modules_to_not_convert"];
  if (!keep.is_array())
    die("%s: quantization_config.modules_to_not_convert must be a list of module names, found %s", p,
        keep.dump().c_str());
  for (const json& e : keep) {
    if (!e.is_string() || e.get<std::string>().empty())
      die("%s: quantization_config.modules_to_not_convert: %s is not a module name", p, e.dump().c_str());
    c.not_quantized.push_back(e);
  }
}

// A Qwen3MoeForCausalLM config.json's expert fields (section 2 says what each means), with transformers'
// defaults where Qwen3MoeConfig has one, and the values the engine cannot run refused: each message names the
// field, what was found and what it must be. router_aux_loss_coef and output_router_logits are training's.
static void parse_moe_config(const json& j, ModelConfig& c, const std::string& path) {
  const char* p = path.c_str();
  c.num_experts = config_int(j, "num_experts", path);
  c.num_experts_per_tok = config_int(j, "num_experts_per_tok", path);
  c.moe_intermediate_size = config_int(j, "moe_intermediate_size", path);
  c.norm_topk_prob = config_bool(j, "norm_topk_prob", false, path);
  c.decoder_sparse_step = j.contains("decoder_sparse_step") && !j["decoder_sparse_step"].is_null()
                              ? config_int(j, "decoder_sparse_step", path) : 1;
  if (c.num_experts < 1)
    die("%s: num_experts must be at least 1 in a Qwen3MoeForCausalLM config, found %d (a model without experts "
        "is a dense Qwen3: Qwen3ForCausalLM)", p, c.num_experts);
  if (c.num_experts > MOE_MAX_EXPERTS)
    die("%s: num_experts %d is above the %d experts the router kernel holds (section 10b)", p, c.num_experts,
        MOE_MAX_EXPERTS);
  if (c.num_experts_per_tok < 1 || c.num_experts_per_tok > c.num_experts)
    die("%s: num_experts_per_tok must be from 1 to num_experts (%d), found %d", p, c.num_experts,
        c.num_experts_per_tok);
  if (c.num_experts_per_tok > MOE_MAX_TOPK)
    die("%s: num_experts_per_tok %d is above the %d the router kernel picks (section 10b)", p,
        c.num_experts_per_tok, MOE_MAX_TOPK);
  if (c.moe_intermediate_size < 1 || c.moe_intermediate_size % 8)
    die("%s: moe_intermediate_size must be a positive multiple of 8, found %d", p, c.moe_intermediate_size);
  if (c.decoder_sparse_step < 1)
    die("%s: decoder_sparse_step must be at least 1 (every that many layers is a MoE layer), found %d", p,
        c.decoder_sparse_step);
  c.mlp_only_layers.clear();
  if (!j.contains("mlp_only_layers") || j["mlp_only_layers"].is_null()) return;
  const json& dense = j["mlp_only_layers"];
  if (!dense.is_array())
    die("%s: field \"mlp_only_layers\" must be a list of layer numbers, found %s", p, dense.dump().c_str());
  for (const json& l : dense) {
    if (!l.is_number_integer() || l.get<int64_t>() < 0 || l.get<int64_t>() >= c.num_hidden_layers)
      die("%s: mlp_only_layers holds %s; its entries are layer numbers from 0 to num_hidden_layers - 1 = %d", p,
          l.dump().c_str(), c.num_hidden_layers - 1);
    c.mlp_only_layers.push_back(l.get<int>());
  }
}

// Parse config.json text. Refuses anything that is not a Qwen3 (Llama, Qwen2 with qkv bias, rope scaling,
// sliding windows) with a message that names the field, rather than computing garbage later.
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
  if (arch != "Qwen3ForCausalLM" && arch != "Qwen3MoeForCausalLM")
    die("%s: architecture %s is not supported; nanovllm runs Qwen3ForCausalLM and Qwen3MoeForCausalLM (the "
        "Qwen3 models, dense and mixture-of-experts)", path.c_str(), arch.c_str());
  ModelConfig c;
  c.hidden_size = config_int(j, "hidden_size", path);
  c.intermediate_size = config_int(j, "intermediate_size", path);
  c.num_hidden_layers = config_int(j, "num_hidden_layers", path);
  c.num_attention_heads = config_int(j, "num_attention_heads", path);
  c.num_key_value_heads = config_int(j, "num_key_value_heads", path);
  c.vocab_size = config_int(j, "vocab_size", path);
  c.max_position_embeddings = config_int(j, "max_position_embeddings", path);
  c.rms_norm_eps = (float)config_number(j, "rms_norm_eps", path);
  if (!j.contains("head_dim"))
    die("%s: missing field \"head_dim\" (Qwen3 configs state it; nanovllm does not guess it)", path.c_str());
  c.head_dim = config_int(j, "head_dim", path);
  // transformers < 5 writes rope_theta at the top level; transformers 5 nests it in rope_parameters.
  const json* rope = j.contains("rope_parameters") && j["rope_parameters"].is_object() ? &j["rope_parameters"]
                     : j.contains("rope_scaling") && j["rope_scaling"].is_object() ? &j["rope_scaling"] : nullptr;
  if (rope && rope->contains("rope_type") && (*rope)["rope_type"] != "default")
    die("%s: rope type %s is not supported (only plain RoPE)", path.c_str(), (*rope)["rope_type"].dump().c_str());
  if (j.contains("rope_theta")) c.rope_theta = (float)config_number(j, "rope_theta", path);
  else if (rope && rope->contains("rope_theta")) c.rope_theta = (float)config_number(*rope, "rope_theta", path);
  else die("%s: missing field \"rope_theta\"", path.c_str());
  if (config_bool(j, "attention_bias", false, path))
    die("%s: attention_bias=true is not supported (Qwen3 has none)", path.c_str());
  if (config_bool(j, "use_sliding_window", false, path))
    die("%s: sliding-window attention is not supported", path.c_str());
  c.tie_word_embeddings = config_bool(j, "tie_word_embeddings", false, path);
  bool eps_ok = c.rms_norm_eps > 0 && std::isfinite(c.rms_norm_eps);
  if (!eps_ok || !(c.rope_theta > 0 && std::isfinite(c.rope_theta)))
    die("%s: rms_norm_eps (%g) and rope_theta (%g) must be positive and finite", path.c_str(), c.rms_norm_eps,
        c.rope_theta);
  if (j.contains("dtype") && j["dtype"].is_string()) c.dtype = j["dtype"];
  else if (j.contains("torch_dtype") && j["torch_dtype"].is_string()) c.dtype = j["torch_dtype"];
  if (j.contains("eos_token_id")) c.eos_token_ids = eos_ids_from(j["eos_token_id"]);
  parse_quantization_config(j, c, path);

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
  if (c.hidden_size > NORM_THREADS * NORM_MAX_CHUNKS * 8)
    die("%s: hidden_size %d is above the %d that the RMSNorm kernels hold in registers", path.c_str(),
        c.hidden_size, NORM_THREADS * NORM_MAX_CHUNKS * 8);
  if (c.hidden_size % 8 || c.intermediate_size % 8)
    die("%s: hidden_size and intermediate_size must be multiples of 8 (found %d, %d)", path.c_str(),
        c.hidden_size, c.intermediate_size);
  if (arch == "Qwen3MoeForCausalLM") parse_moe_config(j, c, path);
  return c;
}

// config.json, then generation_config.json for the EOS ids (it lists both <|im_end|> and <|endoftext|>).
static ModelConfig load_model_config(const std::string& dir) {
  if (!is_dir(dir))
    die("model folder '%s' does not exist or is not a folder.\n  Get one with: huggingface-cli download "
        "Qwen/Qwen3-0.6B --local-dir ~/huggingface/Qwen3-0.6B",
        dir.c_str());
  if (access(dir.c_str(), R_OK | X_OK) != 0)
    die("cannot read model folder '%s': %s", dir.c_str(), strerror(errno));
  std::string path = dir + "/config.json";
  if (!is_file(path)) die("no config.json in model folder '%s' (is it a Hugging Face model folder?)", dir.c_str());
  ModelConfig c = parse_model_config(read_file(path, "model config"), path);
  std::string gpath = dir + "/generation_config.json";
  if (is_file(gpath)) {
    try {
      json g = json::parse(read_file(gpath, "generation config"));
      if (g.is_object() && g.contains("eos_token_id")) c.eos_token_ids = eos_ids_from(g["eos_token_id"]);
      if (g.is_object()) c.generation_config = g;
    } catch (const json::exception& e) {
      die("%s is not valid JSON: %s", gpath.c_str(), e.what());
    }
  }
  return c;
}

// Applies a comma-separated list to `set`, left to right: "all", "none", NAME (on) or -NAME (off). Returns
// "" or what is wrong, naming the known names. Examples: "none" (= --plain), "-pdl", "none,gemv,pdl".
static std::string parse_optimizations(const std::string& spec, OptimizationSet& set) {
  const std::vector<Optimization>& reg = optimization_registry();
  set.on.resize(reg.size());
  std::string names;
  for (const Optimization& o : reg) names += std::string(names.empty() ? "" : ", ") + o.name;
  if (names.empty()) names = "none in this build";
  if (spec.empty()) return "--opt needs a list: all, none, NAME or -NAME, comma-separated (" + names + ")";
  size_t pos = 0;
  while (pos <= spec.size()) {
    size_t comma = spec.find(',', pos);
    std::string item = spec.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    pos = comma == std::string::npos ? spec.size() + 1 : comma + 1;
    bool on = true;
    std::string name = item;
    if (!name.empty() && (name[0] == '-' || name[0] == '+')) on = name[0] == '+', name = name.substr(1);
    if (name == "all" || name == "none") {
      if (item != name) return "--opt: '" + item + "': write all or none without a sign";
      for (size_t i = 0; i < reg.size(); i++) set.on[i] = name == "all";
      continue;
    }
    size_t found = reg.size();
    for (size_t i = 0; i < reg.size(); i++)
      if (name == reg[i].name) found = i;
    if (found == reg.size())
      return "--opt: unknown optimization '" + item + "'; the names are " + names + " (or all, none)";
    set.on[found] = on;
  }
  return "";
}

// "all", "none (Part I alone)", "all except NAMES" when fewer are off than on, or the names that are on,
// for the start-up line.
static std::string optimizations_str(const OptimizationSet& set) {
  std::string on, off;
  int n_on = 0, n_off = 0;
  for (size_t i = 0; i < optimization_registry().size(); i++) {
    const bool is_on = i < set.on.size() && set.on[i];
    (is_on ? on : off) += std::string(" ") + optimization_registry()[i].name;
    (is_on ? n_on : n_off)++;
  }
  if (on.empty()) return "none (Part I alone)";
  if (off.empty()) return "all";
  return n_off < n_on ? "all except" + off : on.substr(1);
}

// Every spelling --kv-cache-dtype accepts in this build, for messages and --help: "auto, bfloat16, bf16, ...".
static std::string kv_cache_spellings() {
  std::string known;
  for (const KVCacheFormat& f : kv_cache_formats()) {
    for (const std::string& a : f.aliases) known += a + ", ";
    known += std::string(f.name) + ", ";
  }
  return known.substr(0, known.size() - 2);
}

// The format a spelling names. Returns "" and sets `name` to the canonical name, or says what is wrong.
static std::string parse_kv_cache_dtype(const std::string& s, std::string& name) {
  for (const KVCacheFormat& f : kv_cache_formats()) {
    for (const auto& r : f.refused)
      if (s == r.first) return "--kv-cache-dtype " + s + " is not supported: " + r.second;
    if (s == f.name || std::find(f.aliases.begin(), f.aliases.end(), s) != f.aliases.end()) {
      name = f.name;
      return "";
    }
  }
  return "--kv-cache-dtype must be one of " + kv_cache_spellings() + "; found '" + s + "'";
}
// --quantization (vLLM's flag): the methods this build's optimizations provide (Optimization::quantization).
// Returns "" and sets `method`, or says what is wrong.
static std::string parse_quantization(const std::string& s, std::string& method) {
  std::string known;
  for (const Optimization& o : optimization_registry())
    if (o.quantization) {
      if (s == o.quantization) {
        method = s;
        return "";
      }
      known += std::string(known.empty() ? "" : ", ") + o.quantization;
    }
  if (known.empty())
    return "--quantization " + s + ": this build quantizes nothing (Part II, which holds the FP8 weight chapter, "
           "is cut out); it still runs an FP8 checkpoint, dequantized to bf16 at load";
  return "--quantization must be " + known + " (a bf16 checkpoint's linear weights quantized at load), found '" +
         s + "'; gptq, awq, compressed-tensors, bitsandbytes and gguf are not supported";
}
static bool is_pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }

// Check the engine settings; every message names the flag to change.
static void validate_config(Config& c, const ModelConfig& m) {
  if (c.max_num_batched_tokens < 1) die("--max-num-batched-tokens must be at least 1, found %d", c.max_num_batched_tokens);
  if (c.max_num_seqs < 1) die("--max-num-seqs must be at least 1, found %d", c.max_num_seqs);
  if (c.max_model_len < 2) die("--max-model-len must be at least 2, found %d", c.max_model_len);
  if (!(c.gpu_memory_utilization > 0 && c.gpu_memory_utilization <= 1))
    die("--gpu-memory-utilization must be in (0, 1], found %g", c.gpu_memory_utilization);
  if (!is_pow2(c.kvcache_block_size) || c.kvcache_block_size < 16 || c.kvcache_block_size > 256)
    die("--kvcache-block-size must be a power of two from 16 to 256, found %d", c.kvcache_block_size);
  if (c.num_kvcache_blocks == 0 || c.num_kvcache_blocks < -1)
    die("--num-kvcache-blocks must be positive (or -1 for automatic), found %d", c.num_kvcache_blocks);
  c.max_model_len = std::min(c.max_model_len, m.max_position_embeddings);
  std::string tp_problem = tp_shard_problem(m, c.tensor_parallel_size);
  if (!tp_problem.empty()) die("%s", tp_problem.c_str());
  const std::vector<Optimization>& reg = optimization_registry();
  for (size_t i = 0; i < reg.size() && !c.quantization.empty(); i++)
    if (reg[i].quantization && c.quantization == reg[i].quantization && !(i < c.opt.on.size() && c.opt.on[i]))
      die("--quantization %s is computed by the optimization %s, which this run switches off (--plain or --opt); "
          "switch it on, or drop --quantization to run the checkpoint as it is", c.quantization.c_str(),
          reg[i].name);
  for (size_t i = 0; i < reg.size() && !c.quantization.empty() && m.num_experts > 0; i++)  // (section 35)
    if (!strcmp(reg[i].name, "fp8_moe") && !(i < c.opt.on.size() && c.opt.on[i]))
      die("--quantization %s: a MoE model's experts are quantized and multiplied by the optimization fp8_moe, "
          "which this run switches off; switch it on, or drop --quantization to run the checkpoint as it is",
          c.quantization.c_str());
  c.eos = m.eos_token_ids;
}

// vLLM's ranges (SamplingParams._verify_args). `where` names the line or the flag in the message. A default
// (from the command line or generation_config.json) skips min_tokens <= max_tokens unless it sets both: a
// .jsonl line may set max_tokens itself, and each request is checked whole.
static void validate_sampling(const SamplingParams& p, const std::string& where, bool min_le_max = true) {
  const char* w = where.c_str();
  if (p.n < 1 || p.n > 4096) die("%s: n must be an integer from 1 to 4096, found %d", w, p.n);
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature))
    die("%s: temperature must be >= 0, found %g", w, p.temperature);
  if (!(p.top_p > 0 && p.top_p <= 1)) die("%s: top_p must be in (0, 1], found %g", w, p.top_p);
  if (p.top_k < -1) die("%s: top_k must be positive, or -1 or 0 (off), found %d", w, p.top_k);
  if (!(p.min_p >= 0 && p.min_p <= 1)) die("%s: min_p must be in [0, 1], found %g", w, p.min_p);
  if (!(p.repetition_penalty > 0) || !std::isfinite(p.repetition_penalty))
    die("%s: repetition_penalty must be > 0 (1 = off), found %g", w, p.repetition_penalty);
  if (!(p.frequency_penalty >= -2 && p.frequency_penalty <= 2))
    die("%s: frequency_penalty must be in [-2, 2], found %g", w, p.frequency_penalty);
  if (!(p.presence_penalty >= -2 && p.presence_penalty <= 2))
    die("%s: presence_penalty must be in [-2, 2], found %g", w, p.presence_penalty);
  if (p.max_tokens < 1) die("%s: max_tokens must be at least 1, found %d", w, p.max_tokens);
  if (p.min_tokens < 0 || (min_le_max && p.min_tokens > p.max_tokens))
    die("%s: min_tokens must be in [0, max_tokens = %d], found %d", w, p.max_tokens, p.min_tokens);
  if (p.logprobs < -1 || p.logprobs > MAX_LOGPROBS)
    die("%s: logprobs must be in [0, %d] (or absent), found %d", w, MAX_LOGPROBS, p.logprobs);
  for (const std::string& s : p.stop)
    if (s.empty()) die("%s: stop cannot contain an empty string", w);
  for (int id : p.stop_token_ids)
    if (id < 0) die("%s: stop_token_ids must be token ids >= 0, found %d", w, id);
}

// ==== 38. Prompts in: the formats and the sampling fields ==================================================
// defines: valid_utf8, PromptOptions, sampling_from_json, kSamplingFields, check_jsonl_fields,
//          sampling_defaults
//
// PROMPTS is either a text file, one prompt per line (the chat template is applied unless --raw), or a
// .jsonl file whose lines are objects with one of
//   "prompt": "text"   "prompt_token_ids": [1, 2, 3]   "messages": [{"role": "user", "content": "..."}]
// and optional per-request sampling fields under vLLM's SamplingParams names (kSamplingFields below: n,
// temperature, top_k, top_p, min_p, the penalties, max_tokens, min_tokens, ignore_eos, stop, stop_token_ids,
// include_stop_str_in_output, logprobs, seed), and "arrival_time" (seconds after the start: the request
// joins the queue then; --request-rate fills it in). Or the .jsonl file is an OpenAI batch (section 39).
// Everything is checked before the GPU is touched: a bad line is reported by number in a second, not after
// a model load. A prompt that cannot fit (prompt tokens + max_tokens > max_model_len) refuses the whole run,
// naming the line: silently dropping or truncating a request would hand back garbage.

static bool valid_utf8(const std::string& s, size_t* bad_at) {
  const unsigned char* p = (const unsigned char*)s.data();
  size_t n = s.size(), i = 0;
  while (i < n) {
    unsigned c = p[i];
    int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (!len || i + len > n) break;
    unsigned cp = len == 1 ? c : len == 2 ? c & 31 : len == 3 ? c & 15 : c & 7;
    bool ok = true;
    for (int k = 1; k < len; k++) {
      if ((p[i + k] & 0xC0) != 0x80) ok = false;
      cp = (cp << 6) | (p[i + k] & 63);
    }
    // reject overlong forms, surrogates and code points past U+10FFFF
    if (!ok || (len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
        (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF)
      break;
    i += len;
  }
  if (bad_at) *bad_at = i;
  return i == n;
}

struct PromptOptions {
  bool raw = false;          // send text as is, no chat template
  bool enable_thinking = true;
  SamplingParams defaults;   // built in, then generation_config.json, then the command line (sampling_defaults)
};

// ---- Sampling fields, by vLLM's names ----
// One function reads them from a JSON object for every source: a .jsonl line, an OpenAI batch body, the
// model's generation_config.json and the command line's flags (gathered into an object by parse_args). Each
// field must have the right type (null means absent, as in vLLM's JSON); the ranges are validate_sampling's.
// vocab > 0: stop_token_ids must be below it.
static void sampling_from_json(const json& j, SamplingParams& sp, const std::string& where, int vocab,
                               bool min_le_max = true) {
  const char* w = where.c_str();
  auto get = [&](const char* k) -> const json* { return j.contains(k) && !j[k].is_null() ? &j[k] : nullptr; };
  auto num = [&](const char* k, float& out) {
    if (const json* v = get(k)) {
      if (!v->is_number()) die("%s: \"%s\" must be a number, found %s", w, k, v->dump().c_str());
      out = (float)v->get<double>();
    }
  };
  auto integer = [&](const char* k, auto& out, int64_t lo, int64_t hi) {
    if (const json* v = get(k)) {
      if (!v->is_number_integer() || v->get<int64_t>() < lo || v->get<int64_t>() > hi)
        die("%s: \"%s\" must be an integer in [%lld, %lld], found %s", w, k, (long long)lo, (long long)hi,
            v->dump().c_str());
      out = v->get<int64_t>();
    }
  };
  auto boolean = [&](const char* k, bool& out) {
    if (const json* v = get(k)) {
      if (!v->is_boolean()) die("%s: \"%s\" must be true or false, found %s", w, k, v->dump().c_str());
      out = v->get<bool>();
    }
  };
  integer("n", sp.n, INT32_MIN, INT32_MAX);
  num("temperature", sp.temperature);
  integer("top_k", sp.top_k, INT32_MIN, INT32_MAX);
  num("top_p", sp.top_p);
  num("min_p", sp.min_p);
  num("repetition_penalty", sp.repetition_penalty);
  num("frequency_penalty", sp.frequency_penalty);
  num("presence_penalty", sp.presence_penalty);
  integer("max_tokens", sp.max_tokens, INT32_MIN, INT32_MAX);
  integer("min_tokens", sp.min_tokens, INT32_MIN, INT32_MAX);
  boolean("ignore_eos", sp.ignore_eos);
  boolean("include_stop_str_in_output", sp.include_stop_str_in_output);
  integer("logprobs", sp.logprobs, INT32_MIN, INT32_MAX);
  integer("seed", sp.seed, INT64_MIN, INT64_MAX);
  if (const json* v = get("stop")) {  // a string or a list of strings (vLLM takes both)
    sp.stop.clear();
    if (v->is_string()) sp.stop.push_back(v->get<std::string>());
    else if (v->is_array() && std::all_of(v->begin(), v->end(), [](const json& e) { return e.is_string(); }))
      for (auto& e : *v) sp.stop.push_back(e.get<std::string>());
    else die("%s: \"stop\" must be a string or a list of strings, found %s", w, v->dump().c_str());
  }
  if (const json* v = get("stop_token_ids")) {
    sp.stop_token_ids.clear();
    if (!v->is_array()) die("%s: \"stop_token_ids\" must be a list of token ids, found %s", w, v->dump().c_str());
    for (auto& e : *v) {
      if (!e.is_number_integer() || e.get<int64_t>() < 0 || (vocab > 0 && e.get<int64_t>() >= vocab))
        die("%s: \"stop_token_ids\": %s is not a token id in [0, %d)", w, e.dump().c_str(), vocab);
      sp.stop_token_ids.push_back(e.get<int>());
    }
  }
  if (get("prompt_logprobs"))
    die("%s: \"prompt_logprobs\" is not supported: it needs the LM head at every prompt position (a [T, V] "
        "product, 10 GB of fp32 logits at the default 16,384-token step), where the engine computes only the "
        "last position's; use \"logprobs\" for the generated tokens", w);
  if (sp.top_k == 0) sp.top_k = -1;  // vLLM: 0 and -1 both mean off
  validate_sampling(sp, where, min_le_max);
}

// The fields a .jsonl line may have. A field we do not know is refused, naming the nearest known one: a
// misspelt "max_token" must not run silently with the default max_tokens.
static const char* const kSamplingFields[] = {
    "n", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
    "max_tokens", "min_tokens", "ignore_eos", "stop", "stop_token_ids", "include_stop_str_in_output", "logprobs",
    "prompt_logprobs", "seed"};
static const char* const kJsonlOtherFields[] = {"prompt", "prompt_token_ids", "messages", "arrival_time"};

// The edit distance between a and b (insertions, deletions, substitutions), for "did you mean".
static size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); j++) row[j] = j;
  for (size_t i = 1; i <= a.size(); i++) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); j++) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1])});
      diag = up;
    }
  }
  return row[b.size()];
}

// The first key of j that is not in `known`, with a message naming it and the nearest known name ("" if all
// are known).
static std::string unknown_field(const json& j, const std::vector<std::string>& known) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    std::string nearest = known[0], all;
    for (const std::string& f : known) {
      if (edit_distance(key, f) < edit_distance(key, nearest)) nearest = f;
      all += (all.empty() ? "" : ", ") + f;
    }
    return "unknown field \"" + key + "\" (did you mean \"" + nearest + "\"?); known: " + all;
  }
  return "";
}
static std::vector<std::string> jsonl_fields() {
  std::vector<std::string> v(std::begin(kJsonlOtherFields), std::end(kJsonlOtherFields));
  v.insert(v.end(), std::begin(kSamplingFields), std::end(kSamplingFields));
  return v;
}
static void check_jsonl_fields(const json& j, const std::string& where) {
  std::string problem = unknown_field(j, jsonl_fields());
  if (!problem.empty()) die("%s: %s", where.c_str(), problem.c_str());
}

// ---- The defaults every request starts from (vLLM's --generation-config) ----
// auto: the model's generation_config.json sets the defaults it names (vLLM reads the same five fields, and
// max_new_tokens as max_tokens); vllm: the built-in defaults of section 2 alone. Flags on the command line
// (gathered in `flags` under vLLM's names) override either; a request's own fields override all.
// *described: one line naming each default that is not the built-in one, and where it came from.
static SamplingParams sampling_defaults(const json& generation_config, const std::string& gen_path, bool use_gen,
                                        const json& flags, int vocab, std::string* described) {
  SamplingParams sp;
  json from_gen = json::object();
  if (use_gen && generation_config.is_object()) {
    for (const char* k : {"temperature", "top_k", "top_p", "min_p", "repetition_penalty"})
      if (generation_config.contains(k)) from_gen[k] = generation_config[k];
    if (generation_config.contains("max_new_tokens")) from_gen["max_tokens"] = generation_config["max_new_tokens"];
    sampling_from_json(from_gen, sp, gen_path, vocab, false);
  }
  sampling_from_json(flags, sp, "command line", vocab, flags.contains("min_tokens") && flags.contains("max_tokens"));
  std::string gen, cli;
  for (auto it = from_gen.begin(); it != from_gen.end(); ++it)
    if (!flags.contains(it.key())) gen += (gen.empty() ? "" : ", ") + it.key() + " " + it.value().dump();
  for (auto it = flags.begin(); it != flags.end(); ++it)
    cli += (cli.empty() ? "" : ", ") + it.key() + " " + it.value().dump();
  std::string d;
  if (!gen.empty()) d += gen + " from " + gen_path;
  if (!cli.empty()) d += (d.empty() ? "" : "; ") + cli + " from the command line";
  if (d.empty()) d = "built in";
  if (use_gen && gen.empty() && cli.empty()) d += " (" + gen_path + " sets none)";
  if (!use_gen) d += " (--generation-config vllm)";
  char head[160];
  snprintf(head, sizeof head, "temperature %g, top_k %d, top_p %g, min_p %g, repetition_penalty %g, max_tokens %d",
           sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.repetition_penalty, sp.max_tokens);
  *described = std::string(head) + ": " + d;
  return sp;
}

// ==== 39. Reading the prompts file: text, .jsonl and OpenAI batch lines ====================================
// defines: is_batch_line, batch_request, parse_batch_line, parse_prompts, read_prompts, assign_arrivals
//
// parse_prompts turns a prompts file into Requests, line by line, in the formats section 38 lists, and
// assign_arrivals gives them their arrival times (--request-rate). An OpenAI batch's lines are read first, by
// their own functions: a .jsonl file whose lines are {"custom_id", "method": "POST", "url", "body"} is a
// batch (what `vllm run-batch` reads and writes): url is /v1/chat/completions (body.messages) or
// /v1/completions (body.prompt), and body holds OpenAI's request fields plus vLLM's extra sampling fields. A
// line that is malformed (no custom_id, an unknown url, a field of the wrong type or out of range) refuses
// the run, as any bad line does; a well-formed line that asks for something the engine does not do (tools,
// images, streaming, logit_bias, a prompt too long for --max-model-len) is answered with an error for that
// line (status 400), and the others run.

static bool is_batch_line(const json& j) {
  return j.is_object() && (j.contains("custom_id") || (j.contains("url") && j.contains("body")));
}

// The request of one batch body. Dies on a malformed field; returns a message (the line's error) for what
// the engine does not support, or "".
static std::string batch_request(const json& body, bool chat, Request& r, const Tokenizer& tok,
                                 const PromptOptions& opt, const std::string& where, int vocab) {
  const char* w = where.c_str();
  static const char* const common[] = {"model", "max_tokens", "user", "stream", "stream_options", "metadata",
                                       "service_tier", "store", "logit_bias", "best_of", "response_format",
                                       "chat_template_kwargs"};
  static const char* const chat_only[] = {"messages", "max_completion_tokens", "top_logprobs", "tools",
                                          "tool_choice", "functions", "function_call", "parallel_tool_calls",
                                          "modalities", "audio", "prediction", "reasoning_effort"};
  static const char* const completion_only[] = {"prompt", "echo", "suffix"};
  std::vector<std::string> known(std::begin(common), std::end(common));
  if (chat) known.insert(known.end(), std::begin(chat_only), std::end(chat_only));
  else known.insert(known.end(), std::begin(completion_only), std::end(completion_only));
  for (const char* f : kSamplingFields)
    known.push_back(f);
  std::string unknown = unknown_field(body, known);
  if (!unknown.empty()) return unknown;
  auto set = [&](const char* k) { return body.contains(k) && !body[k].is_null(); };
  for (const char* k : {"tools", "tool_choice", "functions", "function_call", "audio", "prediction"})
    if (set(k) && !(body[k].is_array() && body[k].empty())) return std::string("\"") + k + "\" is not supported";
  if (set("stream") && body["stream"] != false) return "\"stream\": streaming is not supported in a batch";
  if (set("echo") && body["echo"] != false) return "\"echo\" is not supported";
  if (set("suffix")) return "\"suffix\" is not supported";
  if (set("logit_bias") && !(body["logit_bias"].is_object() && body["logit_bias"].empty()))
    return "\"logit_bias\" is not supported";
  if (set("response_format") && body["response_format"] != json{{"type", "text"}})
    return "\"response_format\": only {\"type\": \"text\"} is supported";
  if (set("modalities") && body["modalities"] != json{"text"}) return "\"modalities\": only [\"text\"] is supported";
  bool thinking = opt.enable_thinking;
  if (set("chat_template_kwargs")) {
    const json& k = body["chat_template_kwargs"];
    if (!k.is_object()) die("%s: \"chat_template_kwargs\" must be an object", w);
    for (auto it = k.begin(); it != k.end(); ++it) {
      if (it.key() != "enable_thinking") return "\"chat_template_kwargs\": only enable_thinking is supported";
      if (!it.value().is_boolean()) die("%s: \"enable_thinking\" must be true or false", w);
      thinking = it.value().get<bool>();
    }
  }
  // The sampling fields, with OpenAI's spellings mapped to vLLM's.
  json fields = json::object();
  for (const char* f : kSamplingFields)
    if (body.contains(f)) fields[f] = body[f];
  if (chat) {
    fields.erase("logprobs");  // chat: "logprobs": true/false with "top_logprobs": N
    if (set("logprobs")) {
      if (!body["logprobs"].is_boolean()) die("%s: \"logprobs\" must be true or false in a chat request", w);
      if (body["logprobs"].get<bool>()) fields["logprobs"] = set("top_logprobs") ? body["top_logprobs"] : json(0);
    } else if (set("top_logprobs")) {
      die("%s: \"top_logprobs\" needs \"logprobs\": true", w);
    }
    if (set("max_completion_tokens")) fields["max_tokens"] = body["max_completion_tokens"];
  }
  sampling_from_json(fields, r.params, where, vocab);
  if (set("best_of") && body["best_of"] != json(r.params.n)) return "\"best_of\" other than n is not supported";
  if (chat) {
    if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty())
      die("%s: a chat request needs \"messages\": a non-empty list of {\"role\", \"content\"}", w);
    std::vector<ChatMessage> msgs;
    for (auto& m : body["messages"]) {
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content"))
        die("%s: each message must be {\"role\": string, \"content\": string or list of parts}", w);
      std::string role = m["role"];
      if (role == "developer") role = "system";  // OpenAI's newer name for it
      if (role != "system" && role != "user" && role != "assistant")
        return "message role \"" + role + "\" is not supported; use system, user or assistant";
      if (m.contains("tool_calls") && !m["tool_calls"].is_null()) return "\"tool_calls\" are not supported";
      std::string content;
      if (m["content"].is_string()) content = m["content"];
      else if (m["content"].is_array()) {  // parts: text only
        for (auto& part : m["content"]) {
          if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
            die("%s: a content part must be {\"type\": ..., ...}", w);
          if (part["type"] != "text") return "content of type \"" + part["type"].get<std::string>() +
                                             "\" is not supported (text only: no images or audio)";
          if (!part.contains("text") || !part["text"].is_string()) die("%s: a text part needs \"text\"", w);
          content += part["text"].get<std::string>();
        }
      } else {
        die("%s: \"content\" must be a string or a list of parts", w);
      }
      msgs.push_back({role, content});
    }
    r.prompt_token_ids = tok.encode(tok.apply_chat_template(msgs, true, thinking));
  } else {
    if (!body.contains("prompt")) die("%s: a completion request needs \"prompt\"", w);
    json p = body["prompt"];
    if (p.is_array() && p.size() == 1 && (p[0].is_string() || p[0].is_array())) p = p[0];  // a list of one prompt
    if (p.is_string()) {
      r.prompt_token_ids = tok.encode(p.get<std::string>());  // completions: the text as given, no template
    } else if (p.is_array() && !p.empty() &&
               std::all_of(p.begin(), p.end(), [](const json& e) { return e.is_number_integer(); })) {
      for (auto& e : p) {
        if (e.get<int64_t>() < 0 || e.get<int64_t>() >= vocab)
          die("%s: token id %s is outside the vocabulary [0, %d)", w, e.dump().c_str(), vocab);
        r.prompt_token_ids.push_back(e.get<int>());
      }
    } else if (p.is_array() && p.size() > 1) {
      return "several prompts in one line are not supported: give one line per prompt";
    } else {
      die("%s: \"prompt\" must be a string or a list of token ids", w);
    }
  }
  return "";
}

// One batch line: its envelope checked here (dies naming the line), its body by batch_request.
static void parse_batch_line(const json& j, Request& r, std::set<std::string>& custom_ids, const Tokenizer& tok,
                             const PromptOptions& opt, const std::string& where, int vocab) {
  const char* w = where.c_str();
  std::string problem = unknown_field(j, {"custom_id", "method", "url", "body"});
  if (!problem.empty()) die("%s: %s", w, problem.c_str());
  if (!j.contains("custom_id") || !j["custom_id"].is_string())
    die("%s: a batch line needs \"custom_id\": a string that names the request in the output", w);
  if (!custom_ids.insert(j["custom_id"].get<std::string>()).second)
    die("%s: custom_id %s is used by an earlier line; each must be unique", w, j["custom_id"].dump().c_str());
  if (!j.contains("method") || j["method"] != "POST") die("%s: a batch line needs \"method\": \"POST\"", w);
  if (!j.contains("url") || !j["url"].is_string() ||
      (j["url"] != "/v1/chat/completions" && j["url"] != "/v1/completions"))
    die("%s: \"url\" must be \"/v1/chat/completions\" or \"/v1/completions\", found %s", w,
        j.contains("url") ? j["url"].dump().c_str() : "nothing");
  if (!j.contains("body") || !j["body"].is_object()) die("%s: a batch line needs \"body\": an object", w);
  const json& body = j["body"];
  const bool chat = j["url"] == "/v1/chat/completions";
  r.batch = {{"custom_id", j["custom_id"]},
             {"url", j["url"]},
             {"model", body.contains("model") ? body["model"] : json()},
             {"chat", chat}};
  r.error = batch_request(body, chat, r, tok, opt, where + ": body", vocab);
}

// The requests of a prompts file's text; `path` names the file in messages and its ".jsonl" ending picks
// the format. Separate from reading the file so the fuzz target (test/fuzz) can feed it bytes.
static std::vector<Request> parse_prompts(const std::string& text, const std::string& path,
                                          const Tokenizer& tok, const PromptOptions& opt, const Config& cfg,
                                          const ModelConfig& mc) {
  bool jsonl = path.size() >= 6 && path.compare(path.size() - 6, 6, ".jsonl") == 0;
  std::vector<Request> reqs;
  std::set<std::string> custom_ids;
  int batch = -1;  // -1: not known yet (the first line decides), 0: plain requests, 1: an OpenAI batch
  size_t pos = 0;
  int lineno = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    std::string line = text.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
    pos = nl == std::string::npos ? text.size() : nl + 1;
    lineno++;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    std::string where = path + ":" + std::to_string(lineno);
    size_t bad;
    if (!valid_utf8(line, &bad)) die("%s: invalid UTF-8 at byte %zu of the line", where.c_str(), bad + 1);
    if (line.find_first_not_of(" \t") == std::string::npos) continue;  // blank lines separate nothing
    Request r;
    r.source = where;
    r.params = opt.defaults;
    if (!jsonl) {
      r.prompt_token_ids =
          opt.raw ? tok.encode(line) : tok.encode(tok.apply_chat_template({{"user", line}}, true, opt.enable_thinking));
      validate_sampling(r.params, "command line");  // the defaults, now whole (min_tokens against max_tokens)
    } else {
      json j;
      try {
        j = json::parse(line);
      } catch (const json::exception& e) {
        die("%s: not valid JSON: %s", where.c_str(), e.what());
      }
      if (!j.is_object()) die("%s: each line must be a JSON object", where.c_str());
      if (batch == -1) batch = is_batch_line(j);
      if (batch == 1) {
        if (!is_batch_line(j))
          die("%s: not a batch request; every line of an OpenAI batch file (line 1 is one) must be "
              "{\"custom_id\", \"method\", \"url\", \"body\"}", where.c_str());
        parse_batch_line(j, r, custom_ids, tok, opt, where, mc.vocab_size);
        if (r.error.empty() && r.prompt_token_ids.empty()) r.error = "the prompt is empty";
        int64_t n = (int64_t)r.prompt_token_ids.size();
        if (r.error.empty() && n + r.params.max_tokens > cfg.max_model_len)
          r.error = "This model's maximum context length is " + std::to_string(cfg.max_model_len) +
                    " tokens (--max-model-len). However, you requested " + std::to_string(n + r.params.max_tokens) +
                    " tokens (" + std::to_string(n) + " in the prompt, " + std::to_string(r.params.max_tokens) +
                    " for the completion).";
        reqs.push_back(std::move(r));
        continue;
      }
      check_jsonl_fields(j, where);
      int kinds = j.contains("prompt") + j.contains("prompt_token_ids") + j.contains("messages");
      if (kinds != 1)
        die("%s: give exactly one of \"prompt\", \"prompt_token_ids\" or \"messages\" (found %d)", where.c_str(),
            kinds);
      if (j.contains("prompt")) {
        if (!j["prompt"].is_string()) die("%s: \"prompt\" must be a string", where.c_str());
        std::string p = j["prompt"];
        r.prompt_token_ids =
            opt.raw ? tok.encode(p) : tok.encode(tok.apply_chat_template({{"user", p}}, true, opt.enable_thinking));
      } else if (j.contains("messages")) {
        if (!j["messages"].is_array() || j["messages"].empty())
          die("%s: \"messages\" must be a non-empty array of {\"role\", \"content\"}", where.c_str());
        std::vector<ChatMessage> msgs;
        for (auto& m : j["messages"]) {
          if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
              !m["content"].is_string())
            die("%s: each message must be {\"role\": string, \"content\": string}", where.c_str());
          std::string role = m["role"];
          if (role != "system" && role != "user" && role != "assistant")
            die("%s: message role '%s' is not supported; use system, user or assistant", where.c_str(),
                role.c_str());
          msgs.push_back({role, m["content"].get<std::string>()});
        }
        r.prompt_token_ids = tok.encode(tok.apply_chat_template(msgs, true, opt.enable_thinking));
      } else {
        if (!j["prompt_token_ids"].is_array()) die("%s: \"prompt_token_ids\" must be an array", where.c_str());
        for (auto& v : j["prompt_token_ids"]) {
          if (!v.is_number_integer()) die("%s: token ids must be integers, found %s", where.c_str(), v.dump().c_str());
          int64_t id = v.get<int64_t>();
          if (id < 0 || id >= mc.vocab_size)
            die("%s: token id %lld is outside the vocabulary [0, %d)", where.c_str(), (long long)id, mc.vocab_size);
          r.prompt_token_ids.push_back((int)id);
        }
      }
      sampling_from_json(j, r.params, where, mc.vocab_size);
      if (j.contains("arrival_time")) {
        const json& v = j["arrival_time"];
        if (!v.is_number() || !(v.get<double>() >= 0) || !std::isfinite(v.get<double>()))
          die("%s: \"arrival_time\" must be a number of seconds >= 0 after the start, found %s", where.c_str(),
              v.dump().c_str());
        r.arrival_time = v.get<double>(), r.arrival_given = true;
      }
    }
    if (r.prompt_token_ids.empty()) die("%s: the prompt is empty", where.c_str());
    int64_t n = (int64_t)r.prompt_token_ids.size();
    if (n + r.params.max_tokens > cfg.max_model_len)
      die("%s: prompt of %lld tokens + max_tokens %d = %lld exceeds --max-model-len %d; shorten the prompt, "
          "lower max_tokens or raise --max-model-len (up to %d for this model)",
          where.c_str(), (long long)n, r.params.max_tokens, (long long)(n + r.params.max_tokens),
          cfg.max_model_len, mc.max_position_embeddings);
    reqs.push_back(std::move(r));
  }
  if (reqs.empty()) die("prompts file '%s' has no prompts", path.c_str());
  return reqs;
}

static std::vector<Request> read_prompts(const std::string& path, const Tokenizer& tok, const PromptOptions& opt,
                                         const Config& cfg, const ModelConfig& mc) {
  if (is_dir(path)) die("prompts file '%s' is a folder", path.c_str());
  return parse_prompts(read_file(path, "prompts file"), path, tok, opt, cfg, mc);
}

// --request-rate R: the requests without an arrival_time of their own arrive as a Poisson process of rate R
// in input order (exponential gaps drawn with --seed), the first at time 0.
static void assign_arrivals(std::vector<Request>& reqs, double rate, uint64_t seed) {
  double t = 0;
  uint64_t state = splitmix64(seed ^ 0xa5a5a5a5ull);
  bool first = true;
  for (Request& r : reqs) {
    if (r.arrival_given) continue;
    if (!first) {
      state = splitmix64(state);
      const double u = ((double)(state >> 11) + 0.5) * 0x1.0p-53;  // in (0, 1)
      t += -log(u) / rate;
    }
    r.arrival_time = t, first = false;
  }
}

// ==== 40. Completions out: stdout, the --output lines, a batch's answers ===================================
// defines: check_output_path, logprobs_json, batch_output_line, write_completions
//
// A readable block per completion on stdout, and with --output one JSON object per completion; an OpenAI
// batch is answered instead with one output line per input line (vLLM's BatchRequestOutput).

// --output is checked here, before the run, but opened only when the completions are written, so a refused
// or failed run leaves an existing file as it was.
static void check_output_path(const std::string& path, const char* flag = "--output",
                              const char* example = "out.jsonl") {
  if (is_dir(path)) die("%s '%s' is a folder; give a file name such as %s", flag, path.c_str(), example);
  if (access(path.c_str(), F_OK) == 0) {
    if (access(path.c_str(), W_OK) != 0) die("cannot write %s '%s': %s", flag, path.c_str(), strerror(errno));
    return;
  }
  size_t slash = path.rfind('/');
  std::string parent = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  if (!is_dir(parent))
    die("cannot write %s '%s': the folder '%s' does not exist", flag, path.c_str(), parent.c_str());
  if (access(parent.c_str(), W_OK | X_OK) != 0)
    die("cannot write %s '%s': folder '%s': %s", flag, path.c_str(), parent.c_str(), strerror(errno));
}

// A log-probability for JSON: -inf (a token the model rules out) is written as -9999, as vLLM's OpenAI server does.
static double json_logprob(float x) { return std::isfinite(x) ? (double)x : -9999.0; }
// vLLM's stop_reason: the stop string, or the stop token id, or null (EOS, or length).
static json stop_reason_json(const Completion& o) {
  return !o.stop_string.empty() ? json(o.stop_string) : o.stop_token_id >= 0 ? json(o.stop_token_id) : json();
}
// Our .jsonl form of a completion's log-probabilities: per output token its id, text, logprob and rank, and
// the top alternatives.
static json logprobs_json(const Completion& o, const Tokenizer& tok) {
  json a = json::array();
  for (size_t t = 0; t < o.logprobs.size() && t < o.token_ids.size(); t++) {
    const TokenLogprobs& l = o.logprobs[t];
    json top = json::array();
    for (int k = 0; k < l.num_top; k++)
      top.push_back({{"token_id", l.top_ids[k]}, {"token", tok.decode({l.top_ids[k]})},
                     {"logprob", json_logprob(l.top_logprobs[k])}});
    a.push_back({{"token_id", o.token_ids[t]}, {"token", tok.decode({o.token_ids[t]})},
                 {"logprob", json_logprob(l.logprob)}, {"rank", l.rank}, {"top_logprobs", top}});
  }
  return a;
}

// An id like OpenAI's ("chatcmpl-" + 24 hex digits): random per line, as vLLM's are.
static std::string batch_id(const char* prefix) {
  static uint64_t state = splitmix64((uint64_t)(now_seconds() * 1e9) ^ (uint64_t)getpid());
  char hex[40];
  const uint64_t a = state = splitmix64(state), b = state = splitmix64(state);
  snprintf(hex, sizeof hex, "%016llx%08llx", (unsigned long long)a, (unsigned long long)(b >> 32));
  return std::string(prefix) + hex;
}

// One output line of an OpenAI batch (vLLM's BatchRequestOutput): the request's n completions as the
// choices of a chat.completion or text_completion object, with usage; or its error with status 400.
static json batch_output_line(const Request& r, const Completion* outs, int n, const Tokenizer& tok,
                              const std::string& model_name, const char* stopped_by = "Ctrl-C") {
  json line = {{"id", batch_id("vllm-")}, {"custom_id", r.batch["custom_id"]}};
  std::string error = r.error;
  for (int k = 0; k < n && error.empty(); k++)
    if (!outs[k].finish_reason)
      error = std::string("the run was stopped (") + stopped_by + ") before this request finished";
  if (!error.empty()) {
    line["response"] = {{"status_code", 400}, {"request_id", batch_id("vllm-batch-")}, {"body", nullptr}};
    line["error"] = error;
    return line;
  }
  const bool chat = r.batch["chat"].get<bool>();
  const json model = r.batch["model"].is_string() ? r.batch["model"] : json(model_name);
  json choices = json::array();
  int64_t completion_tokens = 0;
  for (int k = 0; k < n; k++) {
    const Completion& o = outs[k];
    completion_tokens += (int64_t)o.token_ids.size();
    json lp = nullptr;
    if (r.params.logprobs >= 0 && chat) {
      json content = json::array();
      for (size_t t = 0; t < o.logprobs.size() && t < o.token_ids.size(); t++) {
        auto entry = [&](int id, float x) {
          const std::string& b = id < tok.vocab_size() ? tok.id_to_bytes[id] : std::string();
          return json{{"token", tok.decode({id})}, {"logprob", json_logprob(x)},
                      {"bytes", std::vector<int>(b.begin(), b.end())}};
        };
        json e = entry(o.token_ids[t], o.logprobs[t].logprob);
        e["top_logprobs"] = json::array();
        for (int i = 0; i < o.logprobs[t].num_top; i++)
          e["top_logprobs"].push_back(entry(o.logprobs[t].top_ids[i], o.logprobs[t].top_logprobs[i]));
        content.push_back(e);
      }
      lp = {{"content", content}};
    } else if (r.params.logprobs >= 0) {
      json tokens = json::array(), token_logprobs = json::array(), top = json::array(), offsets = json::array();
      size_t offset = 0;
      for (size_t t = 0; t < o.logprobs.size() && t < o.token_ids.size(); t++) {
        const std::string s = tok.decode({o.token_ids[t]});
        tokens.push_back(s);
        token_logprobs.push_back(json_logprob(o.logprobs[t].logprob));
        json alt = json::object();
        for (int i = 0; i < o.logprobs[t].num_top; i++)
          alt[tok.decode({o.logprobs[t].top_ids[i]})] = json_logprob(o.logprobs[t].top_logprobs[i]);
        top.push_back(alt);
        offsets.push_back(offset);
        offset += s.size();
      }
      lp = {{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top}, {"text_offset", offsets}};
    }
    json c = {{"index", k}, {"logprobs", lp}, {"finish_reason", o.finish_reason}, {"stop_reason", stop_reason_json(o)}};
    if (chat) c["message"] = {{"role", "assistant"}, {"content", o.text}};
    else c["text"] = o.text;
    choices.push_back(c);
  }
  const int prompt_tokens = outs[0].prompt_tokens;
  json body = {{"id", batch_id(chat ? "chatcmpl-" : "cmpl-")},
               {"object", chat ? "chat.completion" : "text_completion"},
               {"created", (int64_t)time(nullptr)},
               {"model", model},
               {"choices", choices},
               {"usage", {{"prompt_tokens", prompt_tokens}, {"completion_tokens", completion_tokens},
                          {"total_tokens", prompt_tokens + completion_tokens}}}};
  line["response"] = {{"status_code", 200}, {"request_id", batch_id("vllm-batch-")}, {"body", body}};
  line["error"] = nullptr;
  return line;
}

// The completions: a readable block per completion on stdout, and with --output one JSON object per
// completion (then the run summary, section 43). An OpenAI batch is answered instead with one output line
// per input line, in input order, to --output or else to stdout. Returns true for a batch. stopped_by: what
// left requests unfinished, for a batch's error lines.
static bool write_completions(const std::vector<Request>& reqs, const std::vector<Completion>& outs,
                              const Tokenizer& tok, FILE* jsonl, const std::string& model_name,
                              const char* stopped_by = "Ctrl-C") {
  const bool batch = !reqs.empty() && !reqs[0].batch.is_null();
  size_t next = 0;  // outs holds each request's n completions, consecutive, in request order
  for (size_t i = 0; i < reqs.size(); i++) {
    const int n = reqs[i].error.empty() ? reqs[i].params.n : 0;
    const Completion* mine = outs.data() + next;
    next += n;
    if (batch) {
      const std::string line =
          batch_output_line(reqs[i], mine, n, tok, model_name, stopped_by)
              .dump(-1, ' ', false, json::error_handler_t::replace);
      fprintf(jsonl ? jsonl : stdout, "%s\n", line.c_str());
      if (jsonl) printf("==> %s | %s\n", reqs[i].batch["custom_id"].get<std::string>().c_str(),
                        reqs[i].error.empty() ? "done" : ("error: " + reqs[i].error).c_str());
      continue;
    }
    const size_t index = reqs[i].index >= 0 ? (size_t)reqs[i].index : i;  // a shard's: its place in the input
    for (int k = 0; k < n; k++) {
      const Completion& o = mine[k];
      if (!o.finish_reason) continue;  // unfinished (Ctrl-C): counted in the summary, not written
      const std::string which = n > 1 ? " | completion " + std::to_string(k) + " of " + std::to_string(n) : "";
      const json reason = stop_reason_json(o);
      printf("==> request %zu%s | %d prompt tokens | %zu tokens | finish: %s%s\n%s\n\n", index, which.c_str(),
             o.prompt_tokens, o.token_ids.size(), o.finish_reason,
             reason.is_null() ? "" : (" (" + reason.dump() + ")").c_str(), o.text.c_str());
      if (!jsonl) continue;
      json line = {{"index", index},
                   {"completion", k},
                   {"text", o.text},
                   {"token_ids", o.token_ids},
                   {"finish_reason", o.finish_reason},
                   {"stop_reason", reason},
                   {"prompt_tokens", o.prompt_tokens}};
      if (reqs[i].params.logprobs >= 0) {
        line["logprobs"] = logprobs_json(o, tok);
        line["cumulative_logprob"] = o.cumulative_logprob;
      }
      fprintf(jsonl, "%s\n", line.dump(-1, ' ', false, json::error_handler_t::replace).c_str());
    }
  }
  fflush(stdout);
  return batch;
}

// ==== 41. Shards: a part of the input per machine, and the merge ===========================================
// defines: ShardSpec, parse_shard, request_weight, shard_split, requests_xxh64, shard_requests, shard_plan,
//          ShardOut, shard_record, ShardFile, read_shard_file, merge_shards
//
// A batch that outgrows one machine runs as an array job of the cluster's own scheduler (a Slurm job array,
// a Kubernetes Indexed Job): the same command on every machine, each with --shard K/N, reads the whole
// input and runs only its share; `nanovllm merge` then joins the shards' --output files in input order.
// The split is a function of the requests and N alone, so every machine computes the same one without
// talking to the others: runs of consecutive requests (neighbours often share a prompt prefix, which the
// prefix cache then finds on the same machine), cut where the running total of the requests' weights
// crosses k/N of the whole. A request's weight is the tokens it may put through the model, n x (prompt
// tokens + max_tokens); one answered with an error weighs nothing. Each share then differs from 1/N of the
// weight by at most one request's. A shard's completions carry the request's place in the whole input
// ("index"; an OpenAI batch line its custom_id), and its draws are keyed by that place
// (Sequence::sampling_seed), so the merged output is the unsharded run's.
//
// A shard's --output ends with one line more than a run's, the shard record:
//   {"shard": {"index": K, "count": N, "requests": TOTAL, "input_xxh64": H, "indices": [...],
//              "completions": C, "unfinished": U}}
// indices: the requests of its share; input_xxh64: a fingerprint of every request of the input (tokens and
// sampling fields) and --seed; completions: the lines it wrote; unfinished: those it did not (Ctrl-C).

struct ShardSpec {
  int index = 0, count = 1;  // K and N: this run is shard K of N, 0 <= K < N
  std::string from;          // how they were given, for messages ("" when there is no --shard)
  bool on() const { return !from.empty(); }
};

// --shard SPEC: "K/N"; "slurm" (K and N from the job array's environment); "k8s:N" (K from Kubernetes'
// JOB_COMPLETION_INDEX, N the Indexed Job's completions). `env` reads the environment (tests pass their
// own). Returns "" and sets `out`, or says what is wrong.
typedef std::function<const char*(const char*)> EnvLookup;
static std::string parse_shard(const std::string& spec, ShardSpec& out, const EnvLookup& env = getenv) {
  auto integer = [](const char* v, long long& x) {
    if (!v) return false;
    char* end;
    errno = 0;
    x = strtoll(v, &end, 10);
    return *v && !*end && !errno;
  };
  auto str = [](long long v) { return std::to_string(v); };
  long long k = -1, n = 0;
  std::string from;
  if (spec == "slurm") {
    const char *id = env("SLURM_ARRAY_TASK_ID"), *cnt = env("SLURM_ARRAY_TASK_COUNT");
    const char *min = env("SLURM_ARRAY_TASK_MIN"), *max = env("SLURM_ARRAY_TASK_MAX");
    const char* step = env("SLURM_ARRAY_TASK_STEP");
    if (!id || !cnt)
      return "--shard slurm: SLURM_ARRAY_TASK_ID and SLURM_ARRAY_TASK_COUNT are not set (is this a task of a "
             "job array, sbatch --array=0-7?)";
    long long lo = 0, hi = 0, st = 1;
    if (!integer(id, k) || !integer(cnt, n) || (min && !integer(min, lo)) || (max && !integer(max, hi)) ||
        (step && !integer(step, st)))
      return std::string("--shard slurm: the SLURM_ARRAY_TASK_* variables must be integers, found ID=") + id +
             " COUNT=" + cnt + " MIN=" + (min ? min : "(unset)") + " MAX=" + (max ? max : "(unset)") +
             " STEP=" + (step ? step : "(unset)");
    if (st != 1 || (max && hi - lo + 1 != n))
      return "--shard slurm: the job array must be one range of task ids without gaps (--array=" + str(lo) +
             "-" + str(lo + n - 1) + "); this one has " + str(n) + " tasks from " + str(lo) + " to " +
             (max ? str(hi) : std::string("?")) + " in steps of " + str(st) + ". Give --shard K/N instead";
    k -= lo;
    from = std::string("SLURM_ARRAY_TASK_ID=") + id + " (from " + str(lo) + ") of SLURM_ARRAY_TASK_COUNT=" + cnt;
  } else if (spec.rfind("k8s:", 0) == 0) {
    if (!integer(spec.c_str() + 4, n) || n < 1)
      return "--shard k8s:N: N is the Indexed Job's .spec.completions, a positive integer; found '" + spec + "'";
    const char* idx = env("JOB_COMPLETION_INDEX");
    if (!idx)
      return "--shard " + spec + ": JOB_COMPLETION_INDEX is not set (is this a pod of a Kubernetes Job with "
             "completionMode: Indexed?)";
    if (!integer(idx, k))
      return std::string("--shard ") + spec + ": JOB_COMPLETION_INDEX must be an integer, found '" + idx + "'";
    from = std::string("JOB_COMPLETION_INDEX=") + idx + " of " + str(n) + " completions (--shard " + spec + ")";
  } else {
    const size_t slash = spec.find('/');
    if (slash == std::string::npos || !integer(spec.substr(0, slash).c_str(), k) ||
        !integer(spec.substr(slash + 1).c_str(), n))
      return "--shard takes K/N (shard K of N, counted from 0), slurm or k8s:N; found '" + spec + "'";
    from = "--shard " + spec;
  }
  if (n < 1 || n > 1000000) return from + ": the number of shards must be from 1 to 1000000, found " + str(n);
  if (k < 0 || k >= n)
    return from + ": shard " + str(k) + " of " + str(n) + " does not exist; shards are numbered 0 to " +
           str(n - 1);
  out.index = (int)k, out.count = (int)n, out.from = from;
  return "";
}

// The tokens a request may put through the model: what the split balances.
static int64_t request_weight(const Request& r) {
  return r.error.empty() ? (int64_t)r.params.n * ((int64_t)r.prompt_token_ids.size() + r.params.max_tokens) : 0;
}

// The shard of each request, 0..count-1, in input order and never decreasing: request i goes to shard
// floor(count x (the weight before it + half its own) / the total weight), so a shard holds the requests
// whose middle falls in its 1/count of the total. With no weight at all (every line an error): by position.
static std::vector<int> shard_split(const std::vector<Request>& reqs, int count) {
  int64_t total = 0, before = 0;
  for (const Request& r : reqs) total += request_weight(r);
  std::vector<int> shard(reqs.size());
  for (size_t i = 0; i < reqs.size(); i++) {
    const int64_t w = request_weight(reqs[i]);
    const int64_t s = total > 0 ? (int64_t)((__int128)(2 * before + w) * count / (2 * total))
                                : (int64_t)(i * (uint64_t)count / reqs.size());
    shard[i] = (int)std::min<int64_t>(s, count - 1);
    before += w;
  }
  return shard;
}

// A fingerprint of the input as the engine sees it (each request's tokens, sampling fields, custom_id or
// error) and of --seed: shards of one run agree on it, shards of another input or other flags do not.
static uint64_t requests_xxh64(const std::vector<Request>& reqs, uint64_t seed) {
  std::string bytes;  // every field in turn, each string and list after its length
  auto add = [&](const void* p, size_t n) { bytes.append(static_cast<const char*>(p), n); };
  auto add_str = [&](const std::string& s) {
    const uint64_t n = s.size();
    add(&n, sizeof n), add(s.data(), n);
  };
  for (const Request& r : reqs) {
    const SamplingParams& p = r.params;
    const uint64_t len = r.prompt_token_ids.size();
    add(&len, sizeof len), add(r.prompt_token_ids.data(), len * sizeof(int));
    const double nums[] = {(double)p.n, p.temperature, (double)p.top_k, p.top_p, p.min_p, p.repetition_penalty,
                           p.frequency_penalty, p.presence_penalty, (double)p.max_tokens, (double)p.min_tokens,
                           (double)p.ignore_eos, (double)p.include_stop_str_in_output, (double)p.logprobs,
                           (double)p.seed, (double)p.stop.size()};
    add(nums, sizeof nums);
    for (const std::string& s : p.stop) add_str(s);
    add_str(std::string(reinterpret_cast<const char*>(p.stop_token_ids.data()),
                        p.stop_token_ids.size() * sizeof(int)));
    add_str(r.batch.is_null() ? std::string() : r.batch.dump());
    add_str(r.error);
  }
  return XXH64(bytes.data(), bytes.size(), seed);
}

// This shard's requests (each keeping its place in `all` as Request::index) and their indices.
static std::vector<Request> shard_requests(std::vector<Request>& all, const ShardSpec& sh,
                                           std::vector<int>& indices) {
  const std::vector<int> shard = shard_split(all, sh.count);
  std::vector<Request> mine;
  indices.clear();
  for (size_t i = 0; i < all.size(); i++) {
    all[i].index = (int)i;
    if (shard[i] == sh.index) mine.push_back(all[i]), indices.push_back((int)i);
  }
  return mine;
}

// The plan of a sharded run (`nanovllm simulate ... --shard K/N`): per shard its requests and tokens.
static std::string shard_plan(const std::vector<Request>& all, int count, int mark) {
  const std::vector<int> shard = shard_split(all, count);
  std::vector<int64_t> reqs(count), prompt(count), max_new(count), weight(count);
  std::vector<int> first(count, -1), last(count, -1);
  int64_t total = 0;
  for (size_t i = 0; i < all.size(); i++) {
    const int s = shard[i];
    const Request& r = all[i];
    reqs[s]++, weight[s] += request_weight(r), total += request_weight(r);
    if (r.error.empty()) {
      prompt[s] += (int64_t)r.params.n * r.prompt_token_ids.size();
      max_new[s] += (int64_t)r.params.n * r.params.max_tokens;
    }
    if (first[s] < 0) first[s] = (int)i;
    last[s] = (int)i;
  }
  char line[320];
  snprintf(line, sizeof line, "nanovllm: shard plan | %zu prompts in %d shards, in input order, balanced by "
           "n x (prompt tokens + max_tokens)\n", all.size(), count);
  std::string plan = line;
  for (int s = 0; s < count; s++) {
    const std::string range = reqs[s] ? "#" + std::to_string(first[s]) + "-" + std::to_string(last[s]) : "none";
    snprintf(line, sizeof line, "nanovllm: shard %d/%d | %lld prompts (%s) | %lld prompt tokens + %lld max_tokens "
             "| %.1f%% of the weight%s\n", s, count, (long long)reqs[s], range.c_str(), (long long)prompt[s],
             (long long)max_new[s], 100.0 * weight[s] / std::max<int64_t>(total, 1), s == mark ? " <- this run" : "");
    plan += line;
  }
  return plan;
}

// A shard run's part of the input, for its record.
struct ShardOut {
  ShardSpec spec;
  std::vector<int> indices;  // the requests of its share, by their place in the input
  size_t total = 0;          // requests in the input
  uint64_t input_xxh64 = 0;  // requests_xxh64 of the input
};

static json shard_record(const ShardOut& sh, int64_t completions, int64_t unfinished) {
  char hex[17];
  snprintf(hex, sizeof hex, "%016llx", (unsigned long long)sh.input_xxh64);
  return json{{"shard", {{"index", sh.spec.index}, {"count", sh.spec.count}, {"requests", sh.total},
                         {"input_xxh64", hex}, {"indices", sh.indices}, {"completions", completions},
                         {"unfinished", unfinished}}}};
}

// `nanovllm merge OUT SHARD_FILE...`: the shards' --output files as one, in input order, checked complete.
// Returns "" and the merged text, or the first problem found, naming the file. The merged file is what one
// run would have written: the completion lines by (index, completion), then a summary of the whole
// ({"summary": {"merged_shards", "requests", "completions", "prompt_tokens", "generated_tokens",
// "tokens_xxh64", "shards": [each shard's summary]}}); an OpenAI batch's output lines by input order alone.
struct ShardFile {
  std::string path;
  json record;              // the "shard" object
  std::vector<json> lines;  // completion lines, or an OpenAI batch's output lines
  json summary;             // a plain run's summary line (null for a batch)
  bool batch = false;
};

static std::string read_shard_file(const std::string& path, ShardFile& f) {
  f.path = path;
  if (!is_file(path)) return path + ": no such file";
  std::ifstream in(path, std::ios::binary);
  if (!in) return path + ": cannot read it: " + strerror(errno);
  std::string line;
  std::vector<json> all;
  for (int no = 1; std::getline(in, line); no++) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      all.push_back(json::parse(line));
    } catch (const json::exception& e) {
      return path + ":" + std::to_string(no) + ": not a JSON line (" + e.what() + ")";
    }
    if (!all.back().is_object()) return path + ":" + std::to_string(no) + ": not a JSON object";
  }
  if (all.empty() || !all.back().contains("shard") || !all.back()["shard"].is_object())
    return path + ": not a shard's --output: its last line is not a shard record (write it with --shard and "
                  "--output; a run that failed before it wrote its completions has none)";
  f.record = all.back()["shard"];
  all.pop_back();
  for (const char* k : {"index", "count", "requests", "completions", "unfinished"})
    if (!f.record.contains(k) || !f.record[k].is_number_integer())
      return path + ": the shard record lacks \"" + k + "\" (an integer)";
  if (!f.record.contains("indices") || !f.record["indices"].is_array() || !f.record.contains("input_xxh64"))
    return path + ": the shard record lacks \"indices\" or \"input_xxh64\"";
  for (json& j : all) {
    if (j.contains("summary")) f.summary = j["summary"];
    else if (j.contains("custom_id")) f.batch = true, f.lines.push_back(std::move(j));
    else if (j.contains("index") && j["index"].is_number_integer() && j.contains("completion") &&
             j["completion"].is_number_integer())
      f.lines.push_back(std::move(j));
    else
      return path + ": a line that is neither a completion, a batch output line nor a summary: " +
             j.dump().substr(0, 120);
  }
  return "";
}

static std::string merge_shards(const std::vector<std::string>& paths, std::string& merged, std::string& said) {
  auto S = [](int64_t v) { return std::to_string(v); };
  if (paths.empty()) return "merge: give the shards' --output files";
  std::vector<ShardFile> files(paths.size());
  for (size_t i = 0; i < paths.size(); i++) {
    std::string problem = read_shard_file(paths[i], files[i]);
    if (!problem.empty()) return problem;
  }
  const ShardFile& ref = files[0];
  const int64_t count = ref.record["count"], total = ref.record["requests"];
  const json hash = ref.record["input_xxh64"];
  std::vector<int> by_shard(count, -1);  // shard -> its file
  for (size_t i = 0; i < files.size(); i++) {
    const ShardFile& f = files[i];
    const json& r = f.record;
    if (r["count"] != count || r["requests"] != total || r["input_xxh64"] != hash)
      return f.path + " is a shard of another run than " + ref.path + ": " + r["count"].dump() + " shards of " +
             r["requests"].dump() + " requests, input " + r["input_xxh64"].dump() + ", against " + S(count) +
             " of " + S(total) + ", input " + hash.dump() + " (another input, other flags or another --seed)";
    if (f.batch != ref.batch)
      return f.path + (f.batch ? " is" : " is not") + " an OpenAI batch's output, but " + ref.path +
             (ref.batch ? " is" : " is not");
    const int64_t k = r["index"];
    if (k < 0 || k >= count) return f.path + ": shard " + S(k) + " of " + S(count) + " does not exist";
    if (by_shard[k] >= 0)
      return f.path + " and " + files[by_shard[k]].path + " are both shard " + S(k) + "/" + S(count);
    by_shard[k] = (int)i;
    if (r["unfinished"].get<int64_t>() > 0)
      return f.path + ": shard " + S(k) + "/" + S(count) + " was stopped with " +
             r["unfinished"].dump() + " completions unfinished; run it again";
    if ((int64_t)f.lines.size() != r["completions"].get<int64_t>())
      return f.path + ": " + S(f.lines.size()) + " output lines, but its shard record says " +
             r["completions"].dump() + " (a truncated or edited file?)";
  }
  std::string missing;
  for (int64_t k = 0; k < count; k++)
    if (by_shard[k] < 0) missing += (missing.empty() ? "" : ", ") + S(k) + "/" + S(count);
  if (!missing.empty()) return "shard " + missing + " missing: give every shard's --output file (" +
                               S(files.size()) + " of " + S(count) + " given)";
  // Every request in exactly one shard's share; its lines all there, once.
  std::vector<int> owner(total, -1);
  std::vector<std::vector<const json*>> out(total);  // request -> its lines, by completion
  for (const ShardFile& f : files) {
    const json& idx = f.record["indices"];
    for (const json& v : idx) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= total)
        return f.path + ": the shard record names request " + v.dump() + " of " + S(total);
      const int64_t i = v;
      if (owner[i] >= 0)
        return "request " + S(i) + " is in the share of both " + files[owner[i]].path + " and " + f.path;
      owner[i] = (int)(&f - files.data());
    }
    if (f.batch) {
      if (f.lines.size() != idx.size())
        return f.path + ": " + S(f.lines.size()) + " batch lines for the " + S(idx.size()) +
               " requests of its share";
      for (size_t j = 0; j < idx.size(); j++) out[idx[j].get<int64_t>()].push_back(&f.lines[j]);
      continue;
    }
    for (const json& line : f.lines) {
      const int64_t i = line["index"], c = line["completion"];
      if (i < 0 || i >= total || owner[i] != (int)(&f - files.data()))
        return f.path + ": a completion of request " + S(i) + ", which is not in its share";
      std::vector<const json*>& v = out[i];
      if (c < 0 || c > 4096) return f.path + ": request " + S(i) + " has a completion numbered " + S(c);
      if ((int64_t)v.size() <= c) v.resize(c + 1, nullptr);
      if (v[c]) return f.path + ": request " + S(i) + ", completion " + S(c) + " twice";
      v[c] = &line;
    }
  }
  for (int64_t i = 0; i < total; i++) {
    if (owner[i] < 0) return "request " + S(i) + " is in no shard's share";
    if (out[i].empty()) return files[owner[i]].path + ": no output line for request " + S(i);
    for (size_t c = 0; c < out[i].size(); c++)
      if (!out[i][c]) return files[owner[i]].path + ": request " + S(i) + " lacks completion " + S(c);
  }
  // The merged file.
  merged.clear();
  int64_t lines = 0, prompt_tokens = 0, generated = 0;
  std::vector<int32_t> tokens;  // completions_xxh64's bytes (section 43), from the lines
  for (int64_t i = 0; i < total; i++)
    for (const json* l : out[i]) {
      merged += l->dump(-1, ' ', false, json::error_handler_t::replace) + "\n", lines++;
      if (ref.batch) continue;
      const json& t = (*l)["token_ids"];
      prompt_tokens += l->value("prompt_tokens", 0), generated += (int64_t)t.size();
      tokens.push_back((int32_t)t.size());
      for (const json& id : t) tokens.push_back(id.get<int32_t>());
    }
  char hex[17];
  snprintf(hex, sizeof hex, "%016llx", (unsigned long long)XXH64(tokens.data(), tokens.size() * sizeof(int32_t), 0));
  if (!ref.batch) {
    json shards = json::array();
    for (int64_t k = 0; k < count; k++) shards.push_back(files[by_shard[k]].summary);
    merged += json{{"summary", {{"merged_shards", count}, {"requests", total}, {"completions", lines},
                                {"prompt_tokens", prompt_tokens}, {"generated_tokens", generated},
                                {"tokens_xxh64", hex}, {"shards", shards}}}}.dump() + "\n";
  }
  said = S(count) + " shards, " + S(total) + " prompts, " + S(lines) +
         (ref.batch ? " batch output lines" : " completions | tokens xxh64 " + std::string(hex) + " (all completions, in input order)");
  return "";
}

// ==== 42. Watching the run: the progress line and the trace ================================================
// defines: RunStats, StepTrace, trace_after_schedule, format_trace, labelled, format_progress, RunWatcher
//
// The text and pictures a run shows about itself (section 13 keeps the numbers), in three steps: this
// section watches each step (RunWatcher, section 13's StepObserver) and prints the progress line or one
// --trace line per step; section 43 sums the run up at its end (with the time to first token, the time per
// output token, and two fingerprints that make runs comparable bit for bit); section 44 draws --report's
// one-file HTML picture of the whole run.

struct RunStats {
  double seconds = 0;
  int64_t prefill_tokens = 0, decode_tokens = 0, steps_prefill = 0, steps_decode = 0;
  int64_t steps_mixed = 0;     // --scheduler mixed: steps that held decode tokens and prompt chunks (in prefill)
  int64_t mixed_decode_tokens = 0;  // ... and the decode tokens they held (in decode_tokens too)
  double prefill_seconds = 0, decode_seconds = 0;
  double first_token_at = -1;  // seconds since generate() began
  int peak_blocks_used = 0;    // taken right after schedule(), when a step holds the most blocks
  // Where step time goes. The engine is synchronous: the host schedules and prepares, launches, then waits
  // for the GPU in the step's one synchronisation (ModelRunner::run). In eager mode kernels already run
  // while the host is still launching later ones, so part of the GPU's work hides in prepare_seconds.
  double schedule_seconds = 0, prepare_seconds = 0, gpu_wait_seconds = 0, postprocess_seconds = 0;
  int last_batch = 0;          // sequences in the last step: the logits rows left in the buffer
};

// One step's worth of state, taken right after schedule() (the step's end time added after it ran): a
// --trace line, and one column of --report's pictures.
struct StepTrace {
  int64_t step = 0;
  bool is_prefill = false;
  int batch = 0;
  int64_t tokens = 0;    // tokens the model computes this step (decode: one per sequence)
  int64_t decode_tokens = 0;  // of which the last token of a sequence that decodes (the rest: prompt)
  int padded_batch = 0;  // the batch the step really runs (a decode step pads to a CUDA graph's size)
  int prefix_hit = 0;    // prompt tokens admitted this step whose K/V was already cached
  int waiting = 0, running = 0;
  int free_blocks = 0, num_blocks = 0;
  int cached_free_blocks = 0;  // free blocks that still hold a registered prefix (a hit revives them)
  int hashes = 0;        // full blocks registered in the prefix cache (hash_to_block_id)
  std::vector<std::pair<int64_t, int>> preempted;  // (seq_id, length) of each victim, in order
  std::vector<std::pair<int64_t, int>> scheduled;  // (seq_id, tokens) of each sequence of the step
  double start = 0, end = 0;  // seconds since generate() began
  double ms = 0;
};
static StepTrace trace_after_schedule(const Scheduler& s, const std::vector<Sequence*>& batch,
                                      bool is_prefill, int64_t step) {
  StepTrace t;
  t.step = step;
  t.is_prefill = is_prefill;
  t.batch = (int)batch.size();
  for (auto* seq : batch) {
    t.tokens += seq->num_scheduled_tokens;
    if (s.mixed) t.decode_tokens += seq->num_scheduled_tokens == 1 && seq->num_completion_tokens() > 0;
    t.scheduled.push_back({seq->seq_id, seq->num_scheduled_tokens});
  }
  if (!s.mixed && !is_prefill) t.decode_tokens = t.tokens;
  t.padded_batch = t.batch;
  t.prefix_hit = s.last_cached_tokens;
  t.waiting = (int)s.waiting.size();
  t.running = (int)s.running.size();
  const BlockManager& bm = s.block_manager;
  t.free_blocks = bm.num_free_blocks();
  t.num_blocks = (int)bm.blocks.size();
  t.hashes = (int)bm.hash_to_block_id.size();
  for (const Block& b : bm.blocks) {  // free, and still the block its hash names: a hit would revive it
    if (b.ref_count || !b.has_hash) continue;
    auto it = bm.hash_to_block_id.find(b.hash);
    t.cached_free_blocks += it != bm.hash_to_block_id.end() && it->second == b.block_id;
  }
  t.preempted = s.last_preempted;
  return t;
}

// The trace line, then one indented line per preemption of this step (docs/observability.md, "The trace
// line"):
//   [trace] step S KIND    batch=B tokens=N hit=K waiting=W running=R free=F/NB hashes=C ms=T
//   [trace]   preempt seq=ID len=LEN
// batch, tokens: sequences and tokens computed this step; hit: prompt tokens found in the prefix cache at
// admission this step; waiting, running: the queues after schedule(); free: free blocks / pool size;
// hashes: full blocks in the prefix cache; ms: the step's time; preempt: a victim's id and length. With
// --scheduler mixed a step that holds decode tokens and prompt tokens is MIXED.
static std::string format_trace(const StepTrace& t) {
  char buf[256];
  const char* kind = !t.is_prefill ? "DECODE " : t.decode_tokens ? "MIXED  " : "PREFILL";
  snprintf(buf, sizeof buf,
           "[trace] step %lld %s batch=%d tokens=%lld hit=%d waiting=%d running=%d free=%d/%d hashes=%d "
           "ms=%.2f\n",
           (long long)t.step, kind, t.batch, (long long)t.tokens, t.prefix_hit, t.waiting, t.running,
           t.free_blocks, t.num_blocks, t.hashes, t.ms);
  std::string line = buf;
  for (auto& p : t.preempted) {
    snprintf(buf, sizeof buf, "[trace]   preempt seq=%lld len=%d\n", (long long)p.first, p.second);
    line += buf;
  }
  return line;
}

// Each line of `text` with `label` in front (a data-parallel replica's trace, section 46).
static std::string labelled(const std::string& label, const std::string& text) {
  if (label.empty()) return text;
  std::string out;
  for (size_t at = 0; at < text.size();) {
    const size_t nl = std::min(text.find('\n', at), text.size() - 1);
    out += label + text.substr(at, nl + 1 - at), at = nl + 1;
  }
  return out;
}

// The progress line (one run's, or with data parallelism every replica's together): completions done of all,
// the prefill and decode rates, and the KV blocks in use. On a terminal it rewrites itself in place.
static std::string format_progress(int64_t done, int64_t total, double prefill_rate, double decode_rate,
                                   int64_t kv_used, int64_t kv_blocks, bool tty) {
  char b[256];
  snprintf(b, sizeof b, "%s[progress] %lld/%lld done | prefill %.0f tok/s | decode %.0f tok/s | KV %lld/%lld blocks%s",
           tty ? "\r" : "", (long long)done, (long long)total, prefill_rate, decode_rate, (long long)kv_used,
           (long long)kv_blocks, tty ? "   " : "\n");
  return b;
}

// The observer the program installs (StepObserver, section 13): it keeps RunStats, prints the progress line
// and the --trace lines, and keeps every step's StepTrace for --report. Times: h* are host clock readings
// (where a step's time goes), the rest the engine's clock (seconds since generate() began).
struct RunWatcher : StepObserver {
  RunStats stats;
  bool progress = true;                      // a progress line on stderr (not with --trace: it says more)
  bool trace = false;                        // --trace: one line per step
  FILE* trace_out = stderr;                  // where the trace lines go
  std::string label;                         // a data-parallel replica's "[replica K] " before each line
  std::vector<StepTrace>* record = nullptr;  // --report: every step's StepTrace is kept here
  StepTrace tr;                              // the step in flight
  int64_t num_tokens = 0, decode_tokens = 0; // of the step in flight (decode: the next token of a sequence
                                             // that has generated)
  double h0 = 0, h1 = 0, h2 = 0, start = 0, gpu_before = 0, last_print = 0;
  const bool tty = isatty(2);                // a terminal: the progress line is rewritten in place

  void step_begins(const LLMEngine& e) override {
    h0 = now_seconds(), start = e.clock();
    if (last_print == 0) last_print = h0;
  }
  void scheduled(const LLMEngine& e, const std::vector<Sequence*>& batch, bool is_prefill) override {
    h1 = now_seconds();
    num_tokens = decode_tokens = 0;
    for (Sequence* s : batch) {
      num_tokens += s->num_scheduled_tokens;
      if (e.scheduler.mixed) decode_tokens += s->num_scheduled_tokens == 1 && s->num_completion_tokens() > 0;
      else if (!is_prefill) decode_tokens += s->num_scheduled_tokens;  // nano-vllm: a step is one or the other
      if (s->first_scheduled_time < 0) s->first_scheduled_time = start;
    }
    stats.peak_blocks_used = std::max(stats.peak_blocks_used, e.scheduler.block_manager.num_used);
    if (trace || record) {
      tr = trace_after_schedule(e.scheduler, batch, is_prefill, stats.steps_prefill + stats.steps_decode + 1);
      tr.padded_batch = e.runner.padded_batch((int)batch.size(), is_prefill);
      tr.start = start;
    }
    gpu_before = e.runner.gpu_seconds;
  }
  void ran(const LLMEngine&) override { h2 = now_seconds(); }
  void step_ends(const LLMEngine& e, const std::vector<Sequence*>& batch, bool is_prefill) override {
    const double h3 = now_seconds(), end = e.clock(), gpu_wait = e.runner.gpu_seconds - gpu_before;
    stats.schedule_seconds += h1 - h0;
    stats.prepare_seconds += (h2 - h1) - gpu_wait;
    stats.gpu_wait_seconds += gpu_wait;
    stats.postprocess_seconds += h3 - h2;
    stats.last_batch = (int)batch.size();
    if (is_prefill) {  // (with --scheduler mixed a prefill step may hold decode tokens too)
      stats.prefill_tokens += num_tokens - decode_tokens;
      stats.decode_tokens += decode_tokens;
      stats.prefill_seconds += end - start;
      stats.steps_prefill++;
      stats.steps_mixed += decode_tokens > 0;
      stats.mixed_decode_tokens += decode_tokens;
    } else {
      stats.decode_tokens += num_tokens;
      stats.decode_seconds += end - start;
      stats.steps_decode++;
    }
    if (stats.first_token_at < 0) stats.first_token_at = e.clock();
    if (trace || record) {
      tr.ms = (end - start) * 1e3;
      tr.end = end;
    }
    if (trace) fputs(labelled(label, format_trace(tr)).c_str(), trace_out);
    if (record) record->push_back(std::move(tr));
    print_progress(e, false);
  }
  // The progress line: every 0.25 s on a terminal (rewritten in place), every 5 s into a file.
  void print_progress(const LLMEngine& e, bool last) {
    if (!progress || trace) return;
    const double t = now_seconds();
    if (last) {
      if (tty && last_print > 0) fprintf(stderr, "\n");
      return;
    }
    if (t - last_print <= (tty ? 0.25 : 5.0)) return;
    int done = 0;
    for (const auto& s : e.seqs) done += s->is_finished();
    fputs(format_progress(done, (int64_t)e.seqs.size(), stats.prefill_tokens / std::max(stats.prefill_seconds, 1e-9),
                          stats.decode_tokens / std::max(stats.decode_seconds, 1e-9),
                          e.scheduler.block_manager.num_used, e.config.num_kvcache_blocks, tty).c_str(), stderr);
    last_print = t;
  }
  void generate_ends(const LLMEngine& e) override {
    print_progress(e, true);
    // Test-only: NANOVLLM_TEST_SLOW_STOP=S holds a stopped run S seconds here, as a long step in flight
    // would, so that test/gpu/gpu_interrupt.sh can send its second Ctrl-C into that window on any GPU.
    const char* slow = getenv("NANOVLLM_TEST_SLOW_STOP");
    for (double until = now_seconds() + (slow ? atof(slow) : 0); g_stop_requested && now_seconds() < until;)
      usleep(10000);
    stats.seconds = e.clock();
  }
};


// ==== 43. The run summary: its figures, two fingerprints and the summary record ============================
// defines: completions_xxh64, last_logits_xxh64, Percentiles, percentiles, RunSummary, run_summary,
//          summary_json, format_summary, write_summary
//
// What a run prints when it ends and writes as the last line of --output: counts, rates, where the time
// went, request latencies, and fingerprints of the results, built from RunWatcher's figures (section 42)
// and the scheduler's.

// xxHash64 (seed 0) of every completion in input order, each as its length then its token ids, all
// little-endian int32: the same bytes as, in Python over the --output records,
//   xxhash.xxh64(b"".join(struct.pack(f"<i{len(t)}i", len(t), *t) for t in token_id_lists)).hexdigest()
// Equal hashes mean identical generated text, whatever the batching, chunking or preemption on the way.
static uint64_t completions_xxh64(const std::vector<Completion>& outs) {
  std::vector<int32_t> buf;
  for (auto& o : outs) {
    if (!o.finish_reason) continue;  // unfinished (Ctrl-C): not in --output, so not in the hash either
    buf.push_back((int32_t)o.token_ids.size());
    buf.insert(buf.end(), o.token_ids.begin(), o.token_ids.end());
  }
  return XXH64(buf.data(), buf.size() * sizeof(int32_t), 0);
}

// xxHash64 (seed 0) of the last step's logits as the GPU left them: rows [0, rows) of [B, V/tp] fp32, row
// by row. A bit-exact fingerprint of the arithmetic: stricter than the tokens' hash (a different cuBLASLt
// algorithm or a padded CUDA-graph batch may change low bits without changing any token).
static uint64_t last_logits_xxh64(ModelRunner& runner, int rows) {
  size_t V = (size_t)cdiv(runner.model.cfg.vocab_size, runner.model.tp);
  std::vector<float> row(V);
  XXH64_state_t st;
  XXH64_reset(&st, 0);
  for (int b = 0; b < rows; b++) {  // run() has synchronised its stream: the rows are final
    const float* logits_row = runner.model.act.logits + b * V;
    CUDA_CHECK(cudaMemcpy(row.data(), logits_row, V * sizeof(float), cudaMemcpyDeviceToHost));
    XXH64_update(&st, row.data(), V * sizeof(float));
  }
  return XXH64_digest(&st);
}

// Median, 99th percentile and mean of a sample (nearest rank; all 0 for none).
struct Percentiles {
  double median = 0, p99 = 0, mean = 0;
  int n = 0;
};
static Percentiles percentiles(std::vector<double> v) {
  Percentiles p;
  p.n = (int)v.size();
  if (v.empty()) return p;
  std::sort(v.begin(), v.end());
  auto rank = [&](double q) { return v[std::min(v.size() - 1, (size_t)std::ceil(q * v.size()) - (q > 0))]; };
  p.median = rank(0.5), p.p99 = rank(0.99);
  for (double x : v) p.mean += x / v.size();
  return p;
}

// The run summary: what the scheduler did and where the time went, how long requests waited, plus two
// fingerprints of the results. Counters add up over every generate() of an engine. Admitted tokens count
// every admission, so a preempted sequence that comes back counts again (with its generated tokens), and
// so do its hits. Time to first token (TTFT): from a request's arrival to the end of the step that sampled
// its first token; time per output token (TPOT): from then to its last token, over the tokens after the
// first (requests of at least two tokens).
struct RunSummary {
  int64_t prompt_tokens = 0, generated_tokens = 0, steps_prefill = 0, steps_decode = 0, steps_mixed = 0;
  int64_t prefix_hit_tokens = 0, admitted_tokens = 0, preemptions = 0;
  double prefix_hit_rate = 0, mean_decode_batch = 0;
  int peak_kv_blocks = 0, kv_blocks = 0;
  int64_t kv_pool_tokens = 0;         // kv_blocks x block size (set by the caller)
  const char* kv_cache_dtype = "bf16";  // --kv-cache-dtype (set by the caller)
  double steps_s = 0, schedule_s = 0, prepare_s = 0, gpu_wait_s = 0, postprocess_s = 0, run_s = 0;
  Percentiles ttft, tpot;  // seconds
  const char* scheduler = "nano";
  uint64_t tokens_xxh64 = 0, logits_xxh64 = 0;
  int logits_rows = 0;
  int64_t unfinished_requests = 0;  // > 0 only when a Ctrl-C (or a failed replica) stopped the run
  // With data parallelism (section 46): one entry per replica. The figures above are then the run's: counts
  // summed, the step times the mean of the replicas' (so a rate is theirs together), the run's seconds the
  // longest replica's; the logits fingerprint is each replica's, here.
  struct Replica {
    int replica = 0;
    std::string gpus;              // CUDA_VISIBLE_DEVICES of its process
    int64_t requests = 0, completions = 0, generated_tokens = 0, preemptions = 0;
    double seconds = 0;
    int peak_kv_blocks = 0, kv_blocks = 0;
    uint64_t logits_xxh64 = 0;
    int logits_rows = 0;
  };
  std::vector<Replica> replicas;
  double host_s() const { return schedule_s + prepare_s + postprocess_s; }
};

static RunSummary run_summary(const RunStats& st, const SchedulerStats& ss, int num_kvcache_blocks,
                              const std::vector<Completion>& outs, uint64_t logits_xxh64, bool mixed = false) {
  RunSummary r;
  std::vector<double> ttft, tpot;
  for (auto& o : outs) {
    r.prompt_tokens += o.prompt_tokens, r.generated_tokens += (int64_t)o.token_ids.size();
    r.unfinished_requests += o.finish_reason == nullptr;
    if (o.first_token_time >= 0) ttft.push_back(o.first_token_time - o.arrival_time);
    if (o.finish_reason && o.token_ids.size() >= 2)
      tpot.push_back((o.finish_time - o.first_token_time) / (o.token_ids.size() - 1));
  }
  r.ttft = percentiles(ttft), r.tpot = percentiles(tpot);
  r.scheduler = mixed ? "mixed" : "nano";
  r.steps_prefill = st.steps_prefill;
  r.steps_decode = st.steps_decode;
  r.steps_mixed = st.steps_mixed;
  r.prefix_hit_tokens = ss.prefix_hit_tokens;
  r.admitted_tokens = ss.prompt_tokens_admitted;
  r.preemptions = ss.num_preemptions;
  r.prefix_hit_rate = r.admitted_tokens ? (double)r.prefix_hit_tokens / r.admitted_tokens : 0.0;
  r.mean_decode_batch = st.steps_decode ? (double)(st.decode_tokens - st.mixed_decode_tokens) / st.steps_decode : 0.0;
  r.peak_kv_blocks = st.peak_blocks_used;
  r.kv_blocks = num_kvcache_blocks;
  r.steps_s = st.prefill_seconds + st.decode_seconds;
  r.run_s = st.seconds;
  r.schedule_s = st.schedule_seconds;
  r.prepare_s = st.prepare_seconds;
  r.gpu_wait_s = st.gpu_wait_seconds;
  r.postprocess_s = st.postprocess_seconds;
  r.tokens_xxh64 = completions_xxh64(outs);
  r.logits_xxh64 = logits_xxh64;
  r.logits_rows = st.last_batch;
  return r;
}

static std::string hex64(uint64_t h) {
  char b[17];
  snprintf(b, sizeof b, "%016llx", (unsigned long long)h);
  return b;
}

// The --output file's last record: {"summary": {...}}. --report draws its numbers from this same record.
static json summary_json(const RunSummary& r) {
  auto pct = [](const Percentiles& p) { return json{{"median", p.median}, {"p99", p.p99}, {"mean", p.mean}, {"n", p.n}}; };
  json j = {{"summary",
               {{"prompt_tokens", r.prompt_tokens},
                {"generated_tokens", r.generated_tokens},
                {"scheduler", r.scheduler},
                {"steps_prefill", r.steps_prefill},
                {"steps_decode", r.steps_decode},
                {"steps_mixed", r.steps_mixed},
                {"prefix_hit_tokens", r.prefix_hit_tokens},
                {"admitted_tokens", r.admitted_tokens},
                {"prefix_hit_rate", r.prefix_hit_rate},
                {"preemptions", r.preemptions},
                {"mean_decode_batch", r.mean_decode_batch},
                {"peak_kv_blocks", r.peak_kv_blocks},
                {"kv_blocks", r.kv_blocks},
                {"kv_pool_tokens", r.kv_pool_tokens},
                {"kv_cache_dtype", r.kv_cache_dtype},
                {"ttft_s", pct(r.ttft)},
                {"tpot_s", pct(r.tpot)},
                {"throughput_tok_s", r.run_s > 0 ? r.generated_tokens / r.run_s : 0.0},
                {"seconds",
                 {{"run", r.run_s},
                  {"steps", r.steps_s},
                  {"schedule", r.schedule_s},
                  {"prepare_and_launch", r.prepare_s},
                  {"gpu_wait", r.gpu_wait_s},
                  {"postprocess", r.postprocess_s}}},
                {"tokens_xxh64", hex64(r.tokens_xxh64)},
                {"logits_xxh64", hex64(r.logits_xxh64)},
                {"logits_rows", r.logits_rows},
                {"unfinished_requests", r.unfinished_requests}}}};
  if (!r.replicas.empty()) {
    json reps = json::array();
    for (const RunSummary::Replica& p : r.replicas)
      reps.push_back({{"replica", p.replica}, {"gpus", p.gpus}, {"requests", p.requests},
                      {"completions", p.completions}, {"generated_tokens", p.generated_tokens},
                      {"seconds", p.seconds}, {"throughput_tok_s", p.seconds > 0 ? p.generated_tokens / p.seconds : 0.0},
                      {"preemptions", p.preemptions}, {"peak_kv_blocks", p.peak_kv_blocks},
                      {"kv_blocks", p.kv_blocks}, {"logits_xxh64", hex64(p.logits_xxh64)},
                      {"logits_rows", p.logits_rows}});
    j["summary"]["data_parallel_size"] = (int)r.replicas.size();
    j["summary"]["replicas"] = reps;
  }
  return j;
}

// The summary's four stderr lines. None contains the word "requests": bench.sh parses the last line
// that does.
// Which sequences --max-num-seqs caps under each scheduler, for the summary: latencies of the two are only
// comparable when that is said. nano-vllm caps the sequences of one step and lets any number run (a
// request admitted in an earlier step keeps its KV blocks while it waits for a decode step with room), so
// its time to first token hides waiting that vLLM's cap on running requests shows as queueing.
static const char* scheduler_cap(const char* scheduler) {
  return strcmp(scheduler, "mixed") == 0 ? "max_num_seqs caps running sequences"
                                         : "max_num_seqs caps each step's sequences";
}

static std::string format_summary(const RunSummary& r) {
  auto pct = [](double part, double whole) { return 100.0 * part / std::max(whole, 1e-9); };
  char buf[4][512];
  snprintf(buf[0], sizeof buf[0],
           "nanovllm: summary | prefix cache hit %lld of %lld admitted tokens (%.1f%%) | %lld preemptions | "
           "mean decode batch %.2f over %lld steps | peak KV %d of %d blocks (%.1f%%) | KV cache %s, %lld "
           "tokens\n",
           (long long)r.prefix_hit_tokens, (long long)r.admitted_tokens, 100.0 * r.prefix_hit_rate,
           (long long)r.preemptions, r.mean_decode_batch, (long long)r.steps_decode, r.peak_kv_blocks,
           r.kv_blocks, pct(r.peak_kv_blocks, r.kv_blocks), r.kv_cache_dtype, (long long)r.kv_pool_tokens);
  snprintf(buf[1], sizeof buf[1],
           "nanovllm: time | %.3f s in %lld steps | host %.3f s (%.0f%%): schedule %.3f, prepare + launch "
           "%.3f, postprocess %.3f | waiting for the GPU %.3f s (%.0f%%)\n",
           r.steps_s, (long long)(r.steps_prefill + r.steps_decode), r.host_s(), pct(r.host_s(), r.steps_s),
           r.schedule_s, r.prepare_s, r.postprocess_s, r.gpu_wait_s, pct(r.gpu_wait_s, r.steps_s));
  snprintf(buf[2], sizeof buf[2],
           "nanovllm: latency | scheduler %s (%s) | time to first token median %.3f s, p99 %.3f s | time per "
           "output token median %.2f ms, p99 %.2f ms\n",
           r.scheduler, scheduler_cap(r.scheduler), r.ttft.median, r.ttft.p99, 1e3 * r.tpot.median,
           1e3 * r.tpot.p99);
  snprintf(buf[3], sizeof buf[3],
           "nanovllm: check | tokens xxh64 %s (all completions, in input order) | logits xxh64 %s "
           "(last step, %d rows)\n",
           hex64(r.tokens_xxh64).c_str(), hex64(r.logits_xxh64).c_str(), r.logits_rows);
  std::string text = std::string(buf[0]) + buf[1] + buf[2] + buf[3];
  for (const RunSummary::Replica& p : r.replicas) {  // (a replica line names no "requests" either)
    snprintf(buf[0], sizeof buf[0],
             "nanovllm: replica %d | GPU %s | %lld prompts, %lld generated tokens in %.2f s (%.0f tok/s) | peak KV "
             "%d of %d blocks | %lld preemptions | logits xxh64 %s (last step, %d rows)\n",
             p.replica, p.gpus.c_str(), (long long)p.requests, (long long)p.generated_tokens, p.seconds,
             p.generated_tokens / std::max(p.seconds, 1e-9), p.peak_kv_blocks, p.kv_blocks, (long long)p.preemptions,
             hex64(p.logits_xxh64).c_str(), p.logits_rows);
    text += buf[0];
  }
  return text;
}

// The --output file's last line: {"summary": {...}}.
static void write_summary(const RunSummary& summary, FILE* jsonl) {
  if (jsonl) fprintf(jsonl, "%s\n", summary_json(summary).dump().c_str());
}

// ==== 44. The report: the whole run in one HTML page =======================================================
// defines: svg_text, svg_rect, fmt, ReportChart, chart_step_tokens, chart_kv_pool,
//          chart_hits_and_preemptions, chart_requests, report_head, write_report
//
// --report FILE.html: the whole run in one self-contained page (inline SVG and CSS, no script, nothing
// fetched from the network), drawn from the StepTraces the engine recorded, the completions' times and the
// summary record. Four pictures over the same steps: what each step computed, the KV pool, prefix-cache hits
// and preemptions, and each request's life from arrival to its last token. Every step is one
// <g class="step"> in the first picture (test/cli/simulate.sh counts them in a headless browser).

static std::string svg_text(double x, double y, const std::string& s, const char* anchor = "start",
                            const char* extra = "") {
  char b[96];
  snprintf(b, sizeof b, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"%s\"%s>", x, y, anchor, extra);
  std::string e;
  for (char c : s) e += c == '<' ? std::string("&lt;") : c == '&' ? std::string("&amp;") : std::string(1, c);
  return b + e + "</text>";
}
static std::string svg_rect(double x, double y, double w, double h, const char* fill, const char* extra = "") {
  char b[192];
  snprintf(b, sizeof b, "<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"%s\"%s/>", x, y,
           std::max(w, 0.0), std::max(h, 0.0), fill, extra);
  return b;
}
static std::string fmt(const char* f, double v) {
  char b[64];
  snprintf(b, sizeof b, f, v);
  return b;
}

// One picture of the report: an SVG whose x axis is the run's steps (picture 4's is time), and the page
// geometry every picture shares. Each picture's function draws into `svg` and returns it.
struct ReportChart {
  const int n;                                            // steps on the x axis (at least 1)
  const double W = 1100, L = 70, R = 20, PW = W - L - R;  // page width, plot left and right margins
  const double bw;                                        // a step's bar width
  std::string svg;
  explicit ReportChart(size_t steps) : n(std::max<int>(1, (int)steps)), bw(std::max(PW / n, 0.4)) {}
  double sx(double i) const { return L + PW * i / n; }    // step index -> x
  // The picture's frame: its size, the two axes and their labels.
  void open(double height, const std::string& ylabel, const std::string& xlabel) {
    svg += "<svg width=\"" + fmt("%.0f", W) + "\" height=\"" + fmt("%.0f", height + 40) + "\">";
    svg += svg_text(14, 10 + height / 2, ylabel, "middle",
                    (" transform=\"rotate(-90 14 " + fmt("%.1f", 10 + height / 2) + ")\"").c_str());
    svg += svg_text(L + PW / 2, height + 38, xlabel, "middle");
    svg += "<line x1=\"" + fmt("%.0f", L) + "\" y1=\"10\" x2=\"" + fmt("%.0f", L) + "\" y2=\"" +
           fmt("%.0f", height + 10) + "\" class=\"axis\"/><line x1=\"" + fmt("%.0f", L) + "\" y1=\"" +
           fmt("%.0f", height + 10) + "\" x2=\"" + fmt("%.0f", L + PW) + "\" y2=\"" +
           fmt("%.0f", height + 10) + "\" class=\"axis\"/>";
  }
  void step_ticks(double y) {  // x ticks at round step numbers
    int every = 1;
    while (n / every > 10) every *= every % 3 == 1 ? 5 : 2;  // 1, 2, 10, 20, 100, ...
    for (int i = 0; i <= n; i += every)
      svg += svg_text(sx(i), y, std::to_string(i + (i < n ? 1 : 0)), "middle");
  }
  void legend(double x, double y, std::vector<std::pair<const char*, const char*>> items) {
    for (auto& [color, name] : items) {
      svg += svg_rect(x, y - 9, 10, 10, color) + svg_text(x + 14, y, name);
      x += 20 + 7.0 * strlen(name);
    }
  }
};

// Picture 1: the tokens of each step, on a log scale so that decode steps stay visible beside prefill.
static std::string chart_step_tokens(const std::vector<StepTrace>& steps) {
  ReportChart c(steps.size());
  std::string& h = c.svg;
  int64_t max_tokens = 1;
  for (auto& t : steps) max_tokens = std::max<int64_t>(max_tokens, t.tokens + (t.padded_batch - t.batch));
  const double H1 = 220, top1 = log10(1.0 + max_tokens);
  auto y1 = [&](double v) { return 10 + H1 - H1 * log10(1.0 + v) / top1; };
  c.open(H1, "tokens (log scale)", "step");
  for (double v = 1; v <= max_tokens; v *= 10) {
    h += svg_text(c.L - 6, y1(v) + 4, fmt("%.0f", v), "end");
    h += "<line x1=\"" + fmt("%.0f", c.L) + "\" x2=\"" + fmt("%.0f", c.L + c.PW) + "\" y1=\"" +
         fmt("%.1f", y1(v)) + "\" y2=\"" + fmt("%.1f", y1(v)) + "\" class=\"grid\"/>";
  }
  for (int i = 0; i < (int)steps.size(); i++) {
    const StepTrace& t = steps[i];
    const double pre = (double)(t.tokens - t.decode_tokens), dec = (double)t.decode_tokens;
    const double pad = (double)(t.padded_batch - t.batch);
    h += "<g class=\"step\" data-step=\"" + std::to_string(t.step) + "\">";
    h += svg_rect(c.sx(i), y1(pre), c.bw, y1(0) - y1(pre), "#4e79a7");
    h += svg_rect(c.sx(i), y1(pre + dec), c.bw, y1(pre) - y1(pre + dec), "#59a14f");
    h += svg_rect(c.sx(i), y1(pre + dec + pad), c.bw, y1(pre + dec) - y1(pre + dec + pad), "#bab0ac");
    h += "<title>step " + std::to_string(t.step) + ": " + fmt("%.0f", pre) + " prompt tokens, " +
         fmt("%.0f", dec) + " decode tokens, " + fmt("%.0f", pad) + " padding rows</title></g>";
  }
  c.step_ticks(H1 + 24);
  c.legend(c.L + 10, 24, {{"#4e79a7", "prompt tokens (prefill)"}, {"#59a14f", "decode tokens"},
                          {"#bab0ac", "padding to the CUDA graph's batch"}});
  return h + "</svg>\n";
}

// Picture 2: the KV pool of NB blocks after each step's scheduling.
static std::string chart_kv_pool(const std::vector<StepTrace>& steps, int NB) {
  ReportChart c(steps.size());
  std::string& h = c.svg;
  const double H2 = 180;
  auto y2 = [&](double v) { return 10 + H2 - H2 * v / NB; };
  c.open(H2, "KV blocks", "step");
  for (int k = 0; k <= 4; k++) h += svg_text(c.L - 6, y2(NB * k / 4.0) + 4, fmt("%.0f", NB * k / 4.0), "end");
  for (int i = 0; i < (int)steps.size(); i++) {
    const StepTrace& t = steps[i];
    const double used = t.num_blocks - t.free_blocks, cached = t.cached_free_blocks;
    h += svg_rect(c.sx(i), y2(used), c.bw, y2(0) - y2(used), "#f28e2b");
    h += svg_rect(c.sx(i), y2(used + cached), c.bw, y2(used) - y2(used + cached), "#76b7b2");
    h += svg_rect(c.sx(i), y2(NB), c.bw, y2(used + cached) - y2(NB), "#eeeeee");
  }
  c.step_ticks(H2 + 24);
  c.legend(c.L + 10, 24, {{"#f28e2b", "held by sequences"}, {"#76b7b2", "free but still a cached prefix"},
                          {"#eeeeee", "free"}});
  return h + "</svg>\n";
}

// Picture 3: prefix-cache hits at admission (bars) and preemptions (red marks, one per victim).
static std::string chart_hits_and_preemptions(const std::vector<StepTrace>& steps) {
  ReportChart c(steps.size());
  std::string& h = c.svg;
  int max_hit = 1;
  for (auto& t : steps) max_hit = std::max(max_hit, t.prefix_hit);
  const double H3 = 120;
  auto y3 = [&](double v) { return 10 + H3 - (H3 - 20) * v / max_hit; };
  c.open(H3, "hit tokens", "step");
  h += svg_text(c.L - 6, y3(max_hit) + 4, std::to_string(max_hit), "end");
  h += svg_text(c.L - 6, y3(0) + 4, "0", "end");
  for (int i = 0; i < (int)steps.size(); i++) {
    const StepTrace& t = steps[i];
    if (t.prefix_hit) h += svg_rect(c.sx(i), y3(t.prefix_hit), c.bw, y3(0) - y3(t.prefix_hit), "#b07aa1");
    for (size_t k = 0; k < t.preempted.size(); k++) {
      const double x = c.sx(i) + c.bw / 2, y = 14 + 7 * k;
      h += "<path class=\"preempt\" d=\"M" + fmt("%.1f", x - 4) + " " + fmt("%.1f", y) + " L" +
           fmt("%.1f", x + 4) + " " + fmt("%.1f", y) + " L" + fmt("%.1f", x) + " " + fmt("%.1f", y + 7) +
           " Z\" fill=\"#e15759\"><title>step " + std::to_string(t.step) + ": preempted seq " +
           std::to_string(t.preempted[k].first) + " at length " + std::to_string(t.preempted[k].second) +
           "</title></path>";
    }
  }
  c.step_ticks(H3 + 24);
  c.legend(c.L + 10 + c.PW / 2, 24,
           {{"#b07aa1", "prompt tokens found in the prefix cache"}, {"#e15759", "preemption"}});
  return h + "</svg>\n";
}

// Picture 4: each request from arrival to its last token, on the time axis; rows: the completions shown.
static std::string chart_requests(const std::vector<StepTrace>& steps, const std::vector<Completion>& outs,
                                  const std::vector<int>& rows) {
  ReportChart c(steps.size());
  std::string& h = c.svg;
  std::map<int64_t, int> row_of;  // seq_id -> row
  for (int k = 0; k < (int)rows.size(); k++) row_of[outs[rows[k]].seq_id] = k;
  double t_end = 1e-9;
  for (auto& t : steps) t_end = std::max(t_end, t.end);
  for (auto& o : outs) t_end = std::max(t_end, o.finish_time);
  const double rh = std::max(2.0, std::min(10.0, 600.0 / std::max<size_t>(1, rows.size())));
  const double H4 = rh * rows.size() + 10;
  auto tx = [&](double t) { return c.L + c.PW * t / t_end; };
  c.open(H4, "requests", "seconds since the run began");
  for (int k = 0; k <= 4; k++) h += svg_text(tx(t_end * k / 4), H4 + 24, fmt("%.3g", t_end * k / 4), "middle");
  for (int k = 0; k < (int)rows.size(); k++) {
    const Completion& o = outs[rows[k]];
    const double y = 10 + k * rh, start = o.arrival_time;
    const double first = o.first_token_time >= 0 ? o.first_token_time : t_end;
    const double fin = o.finish_time >= 0 ? o.finish_time : t_end;
    h += svg_rect(tx(start), y, tx(first) - tx(start), rh * 0.8, "#d9d9d9");   // waiting and in prefill
    h += svg_rect(tx(first), y, tx(fin) - tx(first), rh * 0.8, "#59a14f");     // decoding
    h += "<title>request " + std::to_string(rows[k]) + ": arrived " + fmt("%.3f", start) + " s, first token " +
         fmt("%.3f", first) + " s, last " + fmt("%.3f", fin) + " s</title>";
  }
  for (auto& t : steps) {  // prompt chunks (and recomputes after a preemption) over the waiting bar
    for (auto& [id, k] : t.scheduled) {
      auto it = row_of.find(id);
      if (it == row_of.end()) continue;
      const Completion& o = outs[rows[it->second]];
      if (k > 1 || o.first_token_time < 0 || t.start < o.first_token_time)
        h += svg_rect(tx(t.start), 10 + it->second * rh, std::max(tx(t.end) - tx(t.start), 1.0), rh * 0.8,
                      "#4e79a7");
    }
    for (auto& [id, len] : t.preempted) {
      auto it = row_of.find(id);
      if (it != row_of.end())
        h += svg_rect(tx(t.start) - 1, 10 + it->second * rh, 2, rh * 0.8, "#e15759");
    }
  }
  return h + "</svg>\n";
}

// The page's head: its title, the style, and a table of the summary's main figures (S: the record's
// "summary" object).
static std::string report_head(const std::string& title, const json& S, const std::vector<Completion>& outs) {
  auto num = [&](const json& v, const char* f) { return fmt(f, v.get<double>()); };
  std::string page =
      "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>nanovllm report: " + title +
      "</title>\n<style>body{font:13px sans-serif;margin:20px;max-width:1120px;color:#222}"
      "h2{font-size:15px;margin:22px 0 4px}svg text{font:11px sans-serif;fill:#333}.axis{stroke:#555}"
      ".grid{stroke:#eee}table{border-collapse:collapse}td,th{padding:2px 10px;text-align:right;"
      "border-bottom:1px solid #ddd}p{max-width:1050px}.key{display:inline-block;width:10px;height:10px;"
      "margin:0 4px 0 12px}</style></head><body>\n<h1>nanovllm run report</h1>\n<p>" + title + "</p>\n";
  page += "<table><tr><th>requests</th><th>generated tokens</th><th>steps (prefill / decode / mixed)</th>"
          "<th>time to first token median / p99</th><th>time per output token median / p99</th>"
          "<th>throughput</th><th>preemptions</th><th>prefix-cache hit</th></tr><tr><td>" +
          std::to_string(outs.size()) + "</td><td>" + std::to_string(S["generated_tokens"].get<int64_t>()) +
          "</td><td>" + std::to_string(S["steps_prefill"].get<int64_t>()) + " / " +
          std::to_string(S["steps_decode"].get<int64_t>()) + " / " + std::to_string(S["steps_mixed"].get<int64_t>()) +
          "</td><td>" + num(S["ttft_s"]["median"], "%.3f") + " / " + num(S["ttft_s"]["p99"], "%.3f") + " s</td><td>" +
          fmt("%.2f", 1e3 * S["tpot_s"]["median"].get<double>()) + " / " +
          fmt("%.2f", 1e3 * S["tpot_s"]["p99"].get<double>()) + " ms</td><td>" +
          num(S["throughput_tok_s"], "%.0f") + " tok/s</td><td>" + std::to_string(S["preemptions"].get<int64_t>()) +
          "</td><td>" + fmt("%.1f", 100 * S["prefix_hit_rate"].get<double>()) + "% of admitted tokens</td></tr></table>\n";
  return page;
}

static void write_report(const std::string& path, const std::string& title, const json& summary_record,
                         const std::vector<StepTrace>& steps, const std::vector<Completion>& outs) {
  const int NB = steps.empty() ? 1 : std::max(1, steps[0].num_blocks);
  std::vector<int> rows;  // the requests picture 4 shows: up to 150, evenly chosen
  const int shown = std::min<int>((int)outs.size(), 150);
  for (int k = 0; k < shown; k++) rows.push_back((int)((int64_t)k * outs.size() / shown));
  std::string page = report_head(title, summary_record["summary"], outs);
  page += "<h2>What to look for</h2><p>Under nano-vllm's scheduler (<code>--scheduler nano</code>) a step is all "
          "prefill or all decode and prefill goes first: a blue spike in picture 1 is a step in which every "
          "running request waited, which shows as a pause in its green bar in picture 4 and in the time per "
          "output token. Under vLLM V1's (<code>--scheduler mixed</code>) a step carries decode tokens and prompt "
          "chunks together within one token budget: fewer stalls for running requests, a little later first "
          "tokens for new ones. Grey on top of a decode step is padding: the batch rounded up to a captured CUDA "
          "graph. In picture 2, orange blocks hold running sequences' K/V; teal ones are free but still a cached "
          "prefix, which a later identical prefix revives without computing it (purple in picture 3). When the "
          "pool runs out a running sequence is preempted (red): its blocks are freed and it is recomputed later, "
          "mostly from those cached blocks. In picture 4 each row is a request: grey while it waits or its "
          "prompt is computed (blue chunks), green while it decodes, red where it was preempted.</p>\n";
  page += "<h2>1. What each step computed</h2>\n" + chart_step_tokens(steps);
  page += "<h2>2. The KV pool (" + std::to_string(NB) + " blocks)</h2>\n" + chart_kv_pool(steps, NB);
  page += "<h2>3. Prefix-cache hits and preemptions</h2>\n" + chart_hits_and_preemptions(steps);
  page += "<h2>4. Requests over time" +
          (rows.size() < outs.size() ? " (" + std::to_string(rows.size()) + " of " + std::to_string(outs.size()) +
                                           ", evenly chosen)" : std::string("")) +
          "</h2><p><span class=\"key\" style=\"background:#d9d9d9\"></span>waiting<span class=\"key\" "
          "style=\"background:#4e79a7\"></span>prompt chunk<span class=\"key\" style=\"background:#59a14f\">"
          "</span>decoding<span class=\"key\" style=\"background:#e15759\"></span>preempted</p>\n" +
          chart_requests(steps, outs, rows);
  page += "<h2>The summary record (as <code>--output</code> writes it)</h2><pre>" + summary_record.dump(1) +
          "</pre>\n</body></html>\n";
  FILE* f = fopen(path.c_str(), "w");
  if (!f) die("cannot write --report '%s': %s", path.c_str(), strerror(errno));
  fputs(page.c_str(), f);
  fclose(f);
}

// ==== 45. Signals and the tensor-parallel workers ==========================================================
// defines: install_stop_handlers, g_stop_hook, stop_processes, tp_supervise, test_fail_at, tp_launch,
//          tp_shutdown
//
// The process plumbing, in three steps: here Ctrl-C and SIGTERM and the tensor-parallel workers (section
// 12's ranks 1..N-1); then the data-parallel replicas (whole engines that share one queue of requests),
// each one's side (section 46) and the coordinator's (section 47): how they are forked, told what to do,
// and stopped on every path. None of it changes what the engine computes.

// Signal handlers may only use async-signal-safe calls: write(2) instead of fprintf.
static void sig_puts(const char* s) {
  ssize_t r = write(2, s, strlen(s));
  (void)r;
}
static void sig_putn(long v) {
  char b[24];
  int i = 23;
  b[i] = 0;
  unsigned long u = v < 0 ? -(unsigned long)v : (unsigned long)v;
  do b[--i] = (char)('0' + u % 10), u /= 10;
  while (u);
  if (v < 0) b[--i] = '-';
  sig_puts(b + i);
}

// Stopping a run: Ctrl-C and SIGTERM. The first Ctrl-C while the engine generates (g_stop_armed, set by
// main) only raises g_stop_requested: generate() returns after the step in flight (section 13), the requests
// that had finished are written as usual, the others are counted as unfinished, and the exit status is 130
// (128 + SIGINT, what a shell reports for Ctrl-C). A second Ctrl-C, a Ctrl-C before the engine runs, or
// SIGTERM stops at once with 128 + the signal; tensor parallelism hooks in to stop its workers first
// (g_stop_hook, below). GPU memory needs no cleanup: the driver frees it when the process ends.
static void (*g_stop_hook)() = nullptr;

static void on_stop_signal(int sig) {
  if (sig == SIGINT && g_stop_armed && !g_stop_requested) {
    g_stop_requested = 1;
    sig_puts("\nnanovllm: interrupted: stopping after this step and writing the finished requests "
             "(Ctrl-C again stops at once)\n");
    return;
  }
  sig_puts(sig == SIGINT ? "\nnanovllm: interrupted" : "nanovllm: terminated");
  if (g_stop_hook) g_stop_hook();  // ends the line itself, before a worker can print
  else sig_puts("\n");
  _exit(128 + sig);
}

// Installs on_stop_signal for SIGINT and SIGTERM; neither interrupts the other's handler (nor SIGCHLD's).
static void install_stop_handlers() {
  struct sigaction sa = {};
  sigemptyset(&sa.sa_mask);
  sigaddset(&sa.sa_mask, SIGCHLD), sigaddset(&sa.sa_mask, SIGINT), sigaddset(&sa.sa_mask, SIGTERM);
  sa.sa_flags = SA_RESTART;
  sa.sa_handler = on_stop_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

// ---- The tensor-parallel workers: reaping, stopping, and shutdown ----
//
// Shutdown, on every path (all workers are reaped; rank 0's exit status says whether the run succeeded):
//   normal end       tp_shutdown(): an EXIT message; workers exit 0; rank 0 waits for them
//   worker fails     its message, then exit 1 (or a crash): rank 0's SIGCHLD handler names the rank, stops
//                    the others and exits 1, even while it waits on the GPU for a collective that will
//                    never complete (NCCL would wait forever)
//   rank 0 fails     die() -> exit(1) -> atexit: SIGTERM to the workers, wait; a rank 0 killed outright
//                    takes the workers with it through PR_SET_PDEATHSIG
//   Ctrl-C           the terminal signals every rank; workers ignore SIGINT. The first Ctrl-C during
//                    generate() ends the run after the current step, with the normal EXIT message; a
//                    second one (or SIGTERM, or Ctrl-C before generate) stops the workers at once (exit 130)
// NANOVLLM_TEST_WORKER_FAIL=RANK:STEP makes worker RANK fail at its STEP-th step, for the test of the above.

static void sig_put_status(int st) {
  if (WIFSIGNALED(st)) sig_puts("was killed by signal "), sig_putn(WTERMSIG(st));
  else sig_puts("exited with status "), sig_putn(WEXITSTATUS(st));
}

// Rank 0: send `sig` to every live worker and reap them all (SIGKILL after 5 s). Async-signal-safe.
// Send `sig` to each of n processes (pids[i] <= 0: already reaped) and reap them all, SIGKILL after 5 s;
// each reaped one's pid becomes -1. Async-signal-safe: the signal handlers below call it.
static void stop_processes(pid_t* pids, int n, int sig) {
  for (int i = 0; i < n; i++)
    if (pids[i] > 0) kill(pids[i], sig);
  for (int ms = 0;; ms += 10) {
    bool alive = false;
    for (int i = 0; i < n; i++) {
      if (pids[i] <= 0) continue;
      int st;
      pid_t p = waitpid(pids[i], &st, WNOHANG);
      if (p == pids[i] || (p < 0 && errno == ECHILD)) pids[i] = -1;
      else alive = true;
    }
    if (!alive) return;
    if (ms == 5000)
      for (int i = 0; i < n; i++)
        if (pids[i] > 0) kill(pids[i], SIGKILL);
    struct timespec ts = {0, 10 * 1000 * 1000};
    nanosleep(&ts, nullptr);
  }
}

// Rank 0: send `sig` to every live worker and reap them all. Async-signal-safe.
static void tp_stop_workers(int sig) { stop_processes(g_tp.pids + 1, g_tp.size - 1, sig); }

// "[replica 2] " in a data-parallel replica (section 1's g_process_label), nothing in the main process.
static void sig_put_label() {
  if (g_process_label[0]) sig_puts("["), sig_puts(g_process_label), sig_puts("] ");
}

static void tp_on_sigchld(int) {
  int saved = errno;
  for (int r = 1; r < g_tp.size; r++) {
    int st;
    if (g_tp.pids[r] <= 0 || waitpid(g_tp.pids[r], &st, WNOHANG) != g_tp.pids[r]) continue;
    g_tp.pids[r] = -1;
    g_tp.status[r] = st;
    if (g_tp.stopping) continue;  // tp_shutdown() reads the statuses
    g_tp.stopping = 1;
    sig_put_label(), sig_puts("nanovllm: error: tensor-parallel rank "), sig_putn(r), sig_puts(" ");
    sig_put_status(st);
    sig_puts(" (its message, if any, is above); stopping all "), sig_putn(g_tp.size), sig_puts(" ranks\n");
    tp_stop_workers(SIGTERM);
    _exit(1);
  }
  errno = saved;
}

// Rank 0's part of an immediate stop (on_stop_signal above): end the workers before rank 0 exits.
static void tp_on_stop() {
  g_tp.stopping = 1;
  sig_puts("; stopping all "), sig_putn(g_tp.size), sig_puts(" ranks\n");  // the whole line, then the workers
  tp_stop_workers(SIGTERM);
}

// Rank 0 leaving through exit() (die() included) without tp_shutdown(): the workers must not outlive it.
static void tp_atexit() {
  sigset_t all;
  sigemptyset(&all);
  sigaddset(&all, SIGCHLD), sigaddset(&all, SIGINT), sigaddset(&all, SIGTERM);
  sigprocmask(SIG_BLOCK, &all, nullptr);
  g_tp.stopping = 1;
  tp_stop_workers(SIGTERM);
}

static void tp_worker_on_sigterm(int) {
  if (g_tp.worker_busy)
    sig_puts("["), sig_puts(g_process_label), sig_puts("] nanovllm: stopping: rank 0 ended the run\n");
  _exit(1);
}

// Rank 0, right after the forks (TPSupervisor::supervise): the reaper, the stop hook, and exit's cleanup.
static void tp_supervise() {
  struct sigaction sa = {};
  sigemptyset(&sa.sa_mask);
  sigaddset(&sa.sa_mask, SIGCHLD), sigaddset(&sa.sa_mask, SIGINT), sigaddset(&sa.sa_mask, SIGTERM);
  sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  sa.sa_handler = tp_on_sigchld;
  sigaction(SIGCHLD, &sa, nullptr);
  g_stop_hook = tp_on_stop;
  install_stop_handlers();
  atexit(tp_atexit);
}

// A worker, before its loop (TPSupervisor::worker_begins): Ctrl-C is rank 0's to decide; SIGTERM ends it.
static void tp_worker_signals(int) {
  signal(SIGCHLD, SIG_DFL);
  signal(SIGINT, SIG_IGN);  // Ctrl-C reaches every rank; rank 0 decides and stops the workers
  struct sigaction sa = {};
  sa.sa_handler = tp_worker_on_sigterm;
  sigaction(SIGTERM, &sa, nullptr);
}

// Test-only: the environment variable `var` = K:STEP makes process K (`who`: a tensor-parallel rank, a
// data-parallel replica) fail at its STEP-th step, for the tests of the shutdown paths.
static void test_fail_at(const char* var, const char* who, const char* WHO, int k, long long step) {
  const char* fail = getenv(var);
  if (!fail) return;
  int fail_k = -1;
  long long fail_step = -1;
  if (sscanf(fail, "%d:%lld", &fail_k, &fail_step) != 2) die("%s=%s: expected %s:STEP", var, fail, WHO);
  if (k == fail_k && step == fail_step)
    die("%s=%s: %s %d fails at its step %lld, on purpose", var, fail, who, k, step);
}
// TPSupervisor::worker_step: NANOVLLM_TEST_WORKER_FAIL=RANK:STEP (test/gpu/gpu_tp_shutdown.sh).
static void tp_worker_test_fail(int rank, long long step) {
  test_fail_at("NANOVLLM_TEST_WORKER_FAIL", "rank", "RANK", rank, step);
}

// Fork ranks 1..n-1 with all of the above (section 12's tp_fork_workers). A no-op for n = 1.
static void tp_launch(int n) {
  TPSupervisor sup;
  sup.supervise = tp_supervise;
  sup.worker_begins = tp_worker_signals;
  sup.worker_step = tp_worker_test_fail;
  tp_fork_workers(n, sup);
}

// nano-vllm: LLMEngine.exit. Tells the workers to exit and reaps them; false if one of them failed.
static bool tp_shutdown() {
  if (g_tp.size <= 1 || !g_tp.mb) return true;
  g_tp.stopping = 1;  // from here on the SIGCHLD handler only records exit statuses
  TPMailbox* mb = g_tp.mb;
  bool acked = false;  // every earlier message was copied out (always, unless a worker is stuck)
  for (double t0 = now_seconds(); !acked && now_seconds() - t0 < 10; sched_yield())
    acked = __atomic_load_n(&mb->acks, __ATOMIC_ACQUIRE) == mb->seq * (uint32_t)(g_tp.size - 1);
  if (acked) tp_send(TPOp::EXIT, nullptr, 0);
  for (double t0 = now_seconds();;) {
    bool alive = false;
    for (int r = 1; r < g_tp.size; r++) alive |= g_tp.pids[r] > 0;
    if (!alive) break;
    if (!acked || now_seconds() - t0 > 10) {
      fprintf(stderr, "nanovllm: error: tensor-parallel workers did not exit; stopping them\n");
      tp_atexit();
      return false;
    }
    usleep(1000);
  }
  bool ok = true;
  for (int r = 1; r < g_tp.size; r++)
    if (!WIFEXITED(g_tp.status[r]) || WEXITSTATUS(g_tp.status[r]) != 0) {
      fprintf(stderr, "nanovllm: error: tensor-parallel rank %d ended badly at shutdown (wait status %d)\n",
              r, g_tp.status[r]);
      ok = false;
    }
  return ok;
}

// ==== 46. Data parallelism, 1: N replicas of the engine, one queue =========================================
// defines: DP_MAX_REPLICAS, PROMPT_TOKENS_PER_OUTPUT_TOKEN, predicted_work, request_work, remaining_work,
//          RequestQueue, Replica, Wire, put_completion, get_completion, DPMsg, DPShared, ReplicaLink, dp_send,
//          replica_serve
//
// With --data-parallel-size N (vLLM's name; -dp N) a run is N whole engines, each in its own process on its
// own GPU, or with --tensor-parallel-size T on its own T GPUs (N x T in all). Nothing crosses between the
// replicas while they run: no all-reduce, no gathered logits (section 12c says when this beats tensor
// parallelism; docs/data-parallel.md has the measurements).
//
// The processes. This process, the coordinator, reads and checks everything, then forks the N replicas
// before any CUDA call (section 12b says why the order is forced) and never uses a GPU itself (main counts
// them in a short-lived child). Replica k sees only its own GPUs: its CUDA_VISIBLE_DEVICES is the k-th
// slice of T of the coordinator's, so inside it tensor-parallel rank r binds GPU r as in a run without
// replicas, and section 12 runs in it unchanged, forking its own T-1 workers.
//
// The queue. Requests are handed out from one queue as each replica has room, not split before the run:
// an offline batch's completions have lengths nobody knows in advance (a request stops at EOS), so a split
// made beforehand, even one balanced by tokens, ends with one replica still decoding its long requests while
// the others idle; pulling gives the last requests to whichever replica frees a place first. Before each
// step a replica tops its waiting queue up to the places that step has for new sequences (Replica::room), so
// its scheduler sees what it would see holding the whole batch, but it takes no more than its fair share of
// the work: the work still to do (the queue's and every replica's outstanding work, predicted_work) over N.
// A cap on the count alone is not enough: when the batch fits in the replicas' places the queue is empty
// almost at once, and the replicas that pulled first, topping themselves up at each step while everything
// fits, end up with far more requests than the others and finish well after them, with nothing to even the
// work out afterwards. Each replica publishes its outstanding work in shared memory after each pull and each
// step; the queue is one counter in shared memory that a replica advances atomically (each replica was
// forked after the requests were read, so each holds them all and sums their work itself); the replicas
// start pulling together, once each has built its engine. A request's draws do not depend on which replica
// runs it (Sequence::sampling_seed).
//
// What comes back. Each replica writes to its own pipe: READY with its start-up line, PROGRESS a few times
// a second, REQUEST with a request's completions as soon as all are finished (a replica that fails later
// loses nothing already done), FINISHED with its figures. The coordinator prints one progress line, puts
// the completions in input order and writes them, --output and an OpenAI batch's output exactly as one
// engine's run does, and one summary with a line per replica.
//
// Stopping works as with tensor parallelism (12b): replicas ignore SIGINT and the coordinator decides. The
// first Ctrl-C once the replicas run sets `stop` in shared memory: each replica completes its step in
// flight and hands back what it holds; the finished completions are written, exit status 130. A second
// Ctrl-C, SIGTERM, or a Ctrl-C while the replicas load: SIGTERM to every replica (each ends its own
// workers), exit at once. A replica that fails is named with its GPUs and wait status, the others are
// stopped, the completions already handed back are written (if the replicas had started), exit status 1. A
// coordinator killed outright takes the replicas with it (PR_SET_PDEATHSIG), and they take their workers.

constexpr int DP_MAX_REPLICAS = 64;

// The work one completion is predicted to cost, in output tokens: the tokens it still has to generate
// (max_tokens until it starts: an offline batch's EOS cannot be foreseen) plus its prompt tokens whose K/V
// is not computed yet, a quarter each. A prompt token is one row of a prefill's matrix products, computed
// thousands at a time against weights read once; an output token needs a decode step, whose weights only
// the batch's other rows share and which reads the whole context's K/V for it. So a prompt token costs far
// less: about a quarter of an output token on the GPUs this engine targets (docs/data-parallel.md has the
// measurement). The prediction only has to rank the replicas' loads, not time them.
constexpr int PROMPT_TOKENS_PER_OUTPUT_TOKEN = 4;
static int64_t predicted_work(int64_t prompt_left, int64_t output_left) {
  return output_left + prompt_left / PROMPT_TOKENS_PER_OUTPUT_TOKEN;
}
// A request's work before it runs: n completions, none started.
static int64_t request_work(const Request& r) {
  return r.params.n * predicted_work((int64_t)r.prompt_token_ids.size(), r.params.max_tokens);
}
// A sequence's work still to do: none once finished (a preempted one counts its prompt again).
static int64_t remaining_work(const Sequence& s) {
  if (s.is_finished()) return 0;
  return predicted_work(s.num_prompt_tokens - std::min(s.num_cached_tokens, s.num_prompt_tokens),
                        s.params.max_tokens - s.num_completion_tokens());
}

// The queue, as each replica sees it (the tests drive it with stand-in engines in one process, where the
// shared fields point into plain memory).
struct RequestQueue {
  uint32_t* next = nullptr;                 // shared: the place in `order` of the next request to hand out
  int64_t* work = nullptr;                  // shared: [replicas] each one's work held (Replica::publish)
  const std::vector<int>* order = nullptr;  // the requests to run (places in the run's list), in input order
  int replicas = 1;
  std::vector<int64_t> work_before;         // [order size + 1] request_work of order[0..i) summed: count_work

  // Every replica sums the requests' work itself, once, before its first pull.
  void count_work(const std::vector<Request>& reqs) {
    work_before.assign(order->size() + 1, 0);
    for (size_t i = 0; i < order->size(); i++)
      work_before[i + 1] = work_before[i] + request_work(reqs[(*order)[i]]);
  }

  // Requests for replica `me`, for up to `room` sequences (one of n counts n; the first is taken even when it
  // needs more), while its outstanding work and what it has taken so far stay below a fair share: the work
  // left (the queue's, every replica's outstanding) over the replicas, as the pull starts. So it takes at
  // most its share plus one request; a replica holding nothing always gets one if any is left; and one
  // replica alone takes all that fits, as an engine handed the whole batch would. Empty once the queue is.
  std::vector<int> pull(int me, int room, const std::vector<Request>& reqs) {
    INTERNAL_CHECK(work_before.size() == order->size() + 1, "RequestQueue::pull before count_work");
    std::vector<int> got;
    const uint32_t size = (uint32_t)order->size();
    const uint32_t at = std::min(__atomic_load_n(next, __ATOMIC_RELAXED), size);
    int64_t left = work_before[size] - work_before[at];
    for (int k = 0; k < replicas; k++) left += __atomic_load_n(&work[k], __ATOMIC_RELAXED);
    const int64_t fair = left / replicas, own = __atomic_load_n(&work[me], __ATOMIC_RELAXED);
    int64_t taken = 0;
    while (room > 0 && (own + taken < fair || (own == 0 && got.empty()))) {
      const uint32_t i = __atomic_fetch_add(next, 1u, __ATOMIC_RELAXED);
      if (i >= size) break;
      const int r = (*order)[i];
      got.push_back(r);
      room -= reqs[r].params.n;
      taken += work_before[i + 1] - work_before[i];
    }
    return got;
  }
};

// One replica's engine fed from the queue: LLMEngine::generate's loop with the requests pulled as it goes.
struct Replica {
  LLMEngine& engine;
  RequestQueue& queue;
  const std::vector<Request>& reqs;
  int index;  // which replica: its place in queue.work
  struct Held {
    int request;       // its place in reqs
    size_t first_seq;  // its first sequence in engine.seqs (the others follow)
  };
  std::vector<Held> held;  // pulled and not handed back yet, in pull order
  int64_t pulled = 0, steps = 0;

  Replica(LLMEngine& e, RequestQueue& q, const std::vector<Request>& r, int k)
      : engine(e), queue(q), reqs(r), index(k) {}

  // Places the next step has for new sequences: under vLLM V1's scheduler max_num_seqs caps the running
  // sequences; under nano-vllm's it caps each step's, and any number may run (the KV pool decides), so
  // there the room alone would let a replica take all its pool can hold: its share of the work
  // (RequestQueue::pull) is what leaves the rest to the others.
  int room() const {
    const Scheduler& s = engine.scheduler;
    return engine.config.max_num_seqs - (s.mixed ? (int)s.running.size() : 0);
  }

  // One turn: top the waiting queue up to the next step's places, then one step. False when there is
  // nothing to run: the queue is empty and every request this replica took is finished.
  bool turn() {
    Scheduler& s = engine.scheduler;
    if ((int)s.waiting.size() < room() && engine.arriving.empty()) {
      for (int r : queue.pull(index, room() - (int)s.waiting.size(), reqs)) {
        held.push_back({r, engine.seqs.size()});
        engine.add_request(reqs[r], reqs[r].index >= 0 ? reqs[r].index : r);
        pulled++;
      }
      publish();
    }
    engine.admit_arrivals();
    if (s.is_finished()) return false;
    engine.step();
    steps++;
    publish();
    return true;
  }

  // Its outstanding work, for the others' pulls: remaining_work over the sequences it holds.
  void publish() {
    int64_t w = 0;
    for (const Held& h : held)
      for (int k = 0; k < reqs[h.request].params.n; k++) w += remaining_work(*engine.seqs[h.first_seq + k]);
    __atomic_store_n(&queue.work[index], w, __ATOMIC_RELAXED);
  }

  // give(request, its completions) for each held request whose completions are all finished (every held
  // one, as it stands, when `all`), which is then forgotten.
  template <class Give> void hand_back(Give&& give, bool all = false) {
    size_t kept = 0;
    for (const Held& h : held) {
      const int n = reqs[h.request].params.n;
      bool done = true;
      for (int k = 0; k < n && done; k++) done = engine.seqs[h.first_seq + k]->is_finished();
      if (!done && !all) {
        held[kept++] = h;
        continue;
      }
      std::vector<Completion> outs;
      for (int k = 0; k < n; k++) outs.push_back(engine.completion_of(*engine.seqs[h.first_seq + k]));
      give(h.request, outs);
    }
    held.resize(kept);
  }
};

// A message between two processes of this program: plain bytes, read back in the order they were written.
struct Wire {
  std::string bytes;
  size_t at = 0;
  template <class T> void put(const T& v) {
    static_assert(std::is_trivially_copyable<T>::value, "plain bytes only");
    bytes.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  void put(const std::string& s) {
    put<uint64_t>(s.size());
    bytes += s;
  }
  template <class T> void put(const std::vector<T>& v) {
    static_assert(std::is_trivially_copyable<T>::value, "plain bytes only");
    put<uint64_t>(v.size());
    bytes.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  }
  void need(size_t n) {
    INTERNAL_CHECK(at + n <= bytes.size(), "a message of %zu bytes read past its end (at %zu, %zu more)",
                   bytes.size(), at, n);
  }
  template <class T> T get() {
    T v;
    need(sizeof v);
    memcpy(&v, bytes.data() + at, sizeof v);
    at += sizeof v;
    return v;
  }
  std::string get_string() {
    const uint64_t n = get<uint64_t>();
    need(n);
    at += n;
    return bytes.substr(at - n, n);
  }
  template <class T> std::vector<T> get_vector() {
    const uint64_t n = get<uint64_t>();
    need(n * sizeof(T));
    std::vector<T> v(n);
    if (n) memcpy(v.data(), bytes.data() + at, n * sizeof(T));
    at += n * sizeof(T);
    return v;
  }
};

static void put_completion(Wire& w, const Completion& c) {
  w.put(c.token_ids);
  w.put<uint8_t>(!c.finish_reason ? 0 : !strcmp(c.finish_reason, "stop") ? 1 : 2);
  w.put(c.prompt_tokens), w.put(c.arrival_time), w.put(c.first_token_time), w.put(c.finish_time);
  w.put(c.seq_id), w.put(c.request), w.put(c.index), w.put(c.text), w.put(c.stop_token_id);
  w.put(c.stop_string), w.put(c.logprobs), w.put(c.cumulative_logprob);
}
static Completion get_completion(Wire& w) {
  Completion c;
  c.token_ids = w.get_vector<int>();
  const uint8_t reason = w.get<uint8_t>();  // the scheduler's two reasons (section 5), as the same literals
  c.finish_reason = reason == 0 ? nullptr : reason == 1 ? "stop" : "length";
  c.prompt_tokens = w.get<int>();
  c.arrival_time = w.get<double>(), c.first_token_time = w.get<double>(), c.finish_time = w.get<double>();
  c.seq_id = w.get<int64_t>(), c.request = w.get<int>(), c.index = w.get<int>();
  c.text = w.get_string();
  c.stop_token_id = w.get<int>();
  c.stop_string = w.get_string();
  c.logprobs = w.get_vector<TokenLogprobs>();
  c.cumulative_logprob = w.get<double>();
  return c;
}

enum class DPMsg : uint8_t { READY, PROGRESS, REQUEST, FINISHED };

struct DPShared {  // in a MAP_SHARED | MAP_ANONYMOUS mapping made before the forks
  uint32_t next;   // the queue (RequestQueue::next)
  uint32_t go;     // 1 once every replica is ready: start pulling
  uint32_t stop;   // 1 after the first Ctrl-C: stop after the step in flight
  int64_t work[DP_MAX_REPLICAS];  // each replica's outstanding work (RequestQueue::work)
};

// What a replica's body gets: who it is, its pipe to the coordinator, the queue.
struct ReplicaLink {
  int replica = 0, fd = -1;
  DPShared* shared = nullptr;
  RequestQueue queue;
};

// One framed message (4 bytes of length, 1 of kind, the bytes) on a replica's pipe. A coordinator that is
// gone ends the replica here (SIGPIPE), if PR_SET_PDEATHSIG has not already.
static void dp_send(int fd, DPMsg kind, const Wire& w) {
  std::string frame(5, '\0');
  const uint32_t n = (uint32_t)w.bytes.size();
  memcpy(&frame[0], &n, 4);
  frame[4] = (char)kind;
  frame += w.bytes;
  for (size_t off = 0; off < frame.size();) {
    const ssize_t k = write(fd, frame.data() + off, frame.size() - off);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) die("cannot write to the coordinator: %s", strerror(errno));
    off += (size_t)k;
  }
}

// Test-only: NANOVLLM_TEST_REPLICA_FAIL=K:STEP makes replica K fail at its STEP-th step, for the test of the
// paths above (test/cli/data_parallel.sh, test/gpu/gpu_dp.sh).
static void replica_test_fail(int replica, long long step) {
  test_fail_at("NANOVLLM_TEST_REPLICA_FAIL", "replica", "REPLICA", replica, step);
}

// A replica's run once its engine is built: READY, wait until every replica is, then turns (pull, step)
// until the queue is empty and its requests are finished, or a stop; each request handed back as soon as
// it is finished; FINISHED last. logits_hash(rows): its runner's fingerprint of the last step.
static void replica_serve(ReplicaLink& link, LLMEngine& engine, RunWatcher& watcher,
                          const std::vector<Request>& reqs, const std::string& ready_line, const std::string& notes, int kv_blocks,
                          const std::function<uint64_t(int)>& logits_hash) {
  Wire ready;
  ready.put(ready_line), ready.put(notes), ready.put(kv_blocks);
  dp_send(link.fd, DPMsg::READY, ready);
  link.queue.count_work(reqs);
  while (!__atomic_load_n(&link.shared->go, __ATOMIC_ACQUIRE)) usleep(1000);
  Replica rep(engine, link.queue, reqs, link.replica);
  auto give = [&](int r, const std::vector<Completion>& outs) {
    Wire w;
    w.put(r), w.put<uint32_t>((uint32_t)outs.size());
    for (const Completion& c : outs) put_completion(w, c);
    dp_send(link.fd, DPMsg::REQUEST, w);
  };
  engine.t0 = engine.runner.now();
  for (double last = now_seconds(); !__atomic_load_n(&link.shared->stop, __ATOMIC_ACQUIRE);) {
    replica_test_fail(link.replica, rep.steps + 1);
    if (!rep.turn()) break;
    rep.hand_back(give);
    if (now_seconds() - last > 0.2) {
      int64_t done = 0;
      for (const auto& s : engine.seqs) done += s->is_finished();
      Wire p;
      p.put(watcher.stats), p.put(engine.scheduler.block_manager.num_used), p.put(done);
      dp_send(link.fd, DPMsg::PROGRESS, p);
      last = now_seconds();
    }
  }
  if (engine.observer) engine.observer->generate_ends(engine);
  rep.hand_back(give, true);  // after a stop: the unfinished ones too, as they stand
  Wire fin;
  fin.put(watcher.stats), fin.put(engine.scheduler.stats), fin.put(rep.pulled);
  fin.put(logits_hash(watcher.stats.last_batch));
  dp_send(link.fd, DPMsg::FINISHED, fin);
}

// ==== 47. Data parallelism, 2: the coordinator =============================================================
// defines: DPGroup, g_dp, replica_signals, DPRun, dp_fork_replicas, DPCoordinator, dp_handle, dp_receive,
//          dp_reap, dp_print_progress, dp_run, dp_figures, dp_completions
//
// The coordinator forks the replicas (section 46 says how the run is shared out among them), reads what
// each sends on its pipe, stops them all when one fails or a signal says so, and turns what they handed
// back into one run's completions and figures.

// The coordinator's view of the replicas, for the signal handlers.
struct DPGroup {
  int size = 0;
  pid_t pids[DP_MAX_REPLICAS] = {};  // -1 once reaped
};
static DPGroup g_dp;

// The coordinator's part of an immediate stop (on_stop_signal): end the replicas before it exits.
static void dp_on_stop() {
  sig_puts("; stopping all "), sig_putn(g_dp.size), sig_puts(" replicas\n");
  stop_processes(g_dp.pids, g_dp.size, SIGTERM);
}
// The coordinator leaving through exit() (die() included): no replica outlives it.
static void dp_atexit() {
  sigset_t all;
  sigemptyset(&all);
  sigaddset(&all, SIGINT), sigaddset(&all, SIGTERM);
  sigprocmask(SIG_BLOCK, &all, nullptr);
  stop_processes(g_dp.pids, g_dp.size, SIGTERM);
}
// A replica told to stop by the coordinator: its tensor-parallel workers first, then itself, quietly (the
// coordinator has said why).
static void replica_on_sigterm(int) {
  if (g_tp.size > 1 && g_tp.mb) g_tp.stopping = 1, tp_stop_workers(SIGTERM);
  _exit(128 + SIGTERM);
}
// A replica's signals: Ctrl-C is the coordinator's to decide. Called again after tp_launch, which installs
// rank 0's own.
static void replica_signals() {
  signal(SIGINT, SIG_IGN);
  struct sigaction sa = {};
  sigemptyset(&sa.sa_mask);
  sigaddset(&sa.sa_mask, SIGCHLD);
  sa.sa_handler = replica_on_sigterm;
  sigaction(SIGTERM, &sa, nullptr);
}

// What the replicas sent, gathered by dp_run.
struct DPRun {
  std::vector<std::vector<Completion>> outs;  // per request of the run: its completions as handed back
  std::vector<RunStats> stats;                // per replica: its last PROGRESS, then its FINISHED figures
  std::vector<SchedulerStats> sched;
  std::vector<RunSummary::Replica> replicas;
  std::vector<std::string> ready_lines;
  std::string notes;        // replica 0's Optimization notes, for the start-up line
  int failed = -1;          // the replica that failed
  bool started = false;     // every replica was ready and the queue opened
  double go_at = 0;         // now_seconds() then
};

// Forks the n replicas, each running body(link) and exiting with its return value, and installs the
// coordinator's signal handlers. Returns the read end of each replica's pipe (non-blocking). order: the
// requests to run, the queue's list, which each replica reads from its own copy of this process.
static std::vector<int> dp_fork_replicas(int n, const std::vector<int>& order, DPShared* shared,
                                         const std::vector<std::string>& gpus,
                                         const std::function<int(ReplicaLink&)>& body) {
  std::vector<int> fds(n);
  std::vector<int> write_fds(n);
  for (int k = 0; k < n; k++) {
    int fd[2];
    if (pipe(fd) != 0) die("cannot make a pipe for data-parallel replica %d: %s", k, strerror(errno));
    fds[k] = fd[0], write_fds[k] = fd[1];
  }
  sigset_t stops, old;  // no Ctrl-C handled before every replica's pid is recorded
  sigemptyset(&stops);
  sigaddset(&stops, SIGINT), sigaddset(&stops, SIGTERM);
  sigprocmask(SIG_BLOCK, &stops, &old);
  fflush(stdout), fflush(stderr);
  const pid_t parent = getpid();
  g_dp.size = n;
  for (int k = 0; k < n; k++) {
    const pid_t pid = fork();
    if (pid < 0)  // (the replicas forked so far follow this process out: PR_SET_PDEATHSIG)
      die("fork() for data-parallel replica %d failed: %s", k, strerror(errno));
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGTERM);  // the coordinator gone, however it went: this replica goes too
      if (getppid() != parent) _exit(1);
      g_dp.size = 0;  // (its atexit, inherited, must not touch its siblings)
      replica_signals();
      sigprocmask(SIG_SETMASK, &old, nullptr);
      for (int j = 0; j < n; j++) {
        close(fds[j]);
        if (j != k) close(write_fds[j]);
      }
      snprintf(g_process_label, sizeof g_process_label, "replica %d", k);
      if (!gpus.empty()) setenv("CUDA_VISIBLE_DEVICES", gpus[k].c_str(), 1);
      ReplicaLink link;
      link.replica = k, link.fd = write_fds[k], link.shared = shared;
      link.queue.next = &shared->next, link.queue.work = shared->work, link.queue.order = &order;
      link.queue.replicas = n;
      const int rc = body(link);
      fflush(stderr);
      exit(rc);
    }
    g_dp.pids[k] = pid;
  }
  for (int k = 0; k < n; k++) close(write_fds[k]), fcntl(fds[k], F_SETFL, O_NONBLOCK);
  g_stop_hook = dp_on_stop;
  install_stop_handlers();
  atexit(dp_atexit);
  sigprocmask(SIG_SETMASK, &old, nullptr);
  return fds;
}

// What the coordinator keeps while the replicas run, besides what it gathers into `run`.
struct DPCoordinator {
  const std::vector<Request>& reqs;
  const std::vector<std::string>& gpus;  // replica k's CUDA_VISIBLE_DEVICES (none when simulated)
  DPRun& run;
  std::vector<int> fds;                  // the read end of each replica's pipe
  std::vector<std::string> inbox;        // per replica: bytes read that are not yet a whole message
  std::vector<int> kv_used, state;       // state: 0 loading, 1 ready, 2 finished (FINISHED received)
  std::vector<int64_t> done;             // per replica: completions finished, by its last PROGRESS
  int ready = 0;                         // replicas that sent READY
  std::string name(int k) const {        // for messages: "replica 2 (GPU 2,3)"
    return "replica " + std::to_string(k) + (gpus.empty() ? std::string() : " (GPU " + gpus[k] + ")");
  }
};

// One message from replica k, into the coordinator's record.
static void dp_handle(DPCoordinator& c, int k, DPMsg kind, Wire& w) {
  DPRun& run = c.run;
  RunSummary::Replica& fig = run.replicas[k];
  if (kind == DPMsg::READY) {
    run.ready_lines[k] = w.get_string();
    const std::string notes = w.get_string();
    if (k == 0) run.notes = notes;
    fig.kv_blocks = w.get<int>();
    c.state[k] = 1, c.ready++;
  } else if (kind == DPMsg::PROGRESS) {
    run.stats[k] = w.get<RunStats>(), c.kv_used[k] = w.get<int>(), c.done[k] = w.get<int64_t>();
  } else if (kind == DPMsg::REQUEST) {
    const int r = w.get<int>();
    const uint32_t m = w.get<uint32_t>();
    INTERNAL_CHECK(r >= 0 && r < (int)c.reqs.size() && run.outs[r].empty(), "%s handed back request %d twice",
                   c.name(k).c_str(), r);
    for (uint32_t i = 0; i < m; i++) {
      run.outs[r].push_back(get_completion(w));
      fig.completions++, fig.generated_tokens += (int64_t)run.outs[r].back().token_ids.size();
    }
  } else {
    INTERNAL_CHECK(kind == DPMsg::FINISHED, "message kind %d from %s", (int)kind, c.name(k).c_str());
    run.stats[k] = w.get<RunStats>(), run.sched[k] = w.get<SchedulerStats>(), fig.requests = w.get<int64_t>();
    fig.logits_xxh64 = w.get<uint64_t>();
    c.state[k] = 2;
  }
}

// Reads what replica k's pipe holds and handles each whole message (dp_send's frames).
static void dp_receive(DPCoordinator& c, int k) {
  char buf[65536];
  for (ssize_t got; (got = read(c.fds[k], buf, sizeof buf)) > 0;) c.inbox[k].append(buf, (size_t)got);
  for (;;) {
    std::string& in = c.inbox[k];
    if (in.size() < 5) return;
    uint32_t len;
    memcpy(&len, in.data(), 4);
    if (in.size() < 5 + (size_t)len) return;
    const DPMsg kind = (DPMsg)in[4];
    Wire w;
    w.bytes = in.substr(5, len);
    in.erase(0, 5 + (size_t)len);
    dp_handle(c, k, kind, w);
  }
}

// Reaps the replicas that have ended. One that ended before its FINISHED, or with a status other than 0,
// is named, the others are stopped, and run.failed says which; `alive` counts those still running.
// progress_line: the progress line is on a terminal (the message starts a line of its own).
static void dp_reap(DPCoordinator& c, bool progress_line, int& alive) {
  const int n = (int)c.fds.size();
  for (int k = 0; k < n; k++) {
    int st;
    if (g_dp.pids[k] <= 0 || waitpid(g_dp.pids[k], &st, WNOHANG) != g_dp.pids[k]) continue;
    g_dp.pids[k] = -1, alive--;
    dp_receive(c, k);  // what it wrote before it ended
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0 && c.state[k] == 2) continue;
    std::string how = WIFSIGNALED(st) ? "was killed by signal " + std::to_string(WTERMSIG(st))
                                      : "exited with status " + std::to_string(WEXITSTATUS(st));
    fprintf(stderr, "%snanovllm: error: %s %s%s (its message, if any, is above); stopping all %d replicas\n",
            progress_line && c.run.started ? "\n" : "", c.name(k).c_str(), how.c_str(),
            c.run.started ? "" : " before it was ready", n);
    c.run.failed = k;
    stop_processes(g_dp.pids, n, SIGTERM);
    for (int j = 0; j < n; j++) dp_receive(c, j);
    alive = 0;
    return;
  }
}

// The one progress line of all replicas together, from their last PROGRESS messages.
static void dp_print_progress(const DPCoordinator& c, int64_t total_completions, bool tty) {
  int64_t all_done = 0, used = 0, blocks = 0;
  double prefill = 0, decode = 0;
  for (size_t k = 0; k < c.fds.size(); k++) {
    const RunStats& s = c.run.stats[k];
    all_done += c.done[k], used += c.kv_used[k], blocks += c.run.replicas[k].kv_blocks;
    prefill += s.prefill_tokens / std::max(s.prefill_seconds, 1e-9);
    decode += s.decode_tokens / std::max(s.decode_seconds, 1e-9);
  }
  fputs(format_progress(all_done, total_completions, prefill, decode, used, blocks, tty).c_str(), stderr);
}

// Forks n replicas, each running body(link) (which builds its engine and calls replica_serve; its return
// value is the replica's exit status), and gathers what they send until each has ended. gpus[k]: replica
// k's CUDA_VISIBLE_DEVICES (none for a simulated run). progress: print the progress line. ready_hook(run):
// once every replica is ready, after their start-up lines (may be empty).
static DPRun dp_run(int n, const std::vector<Request>& reqs, const std::vector<std::string>& gpus,
                    bool progress, const std::function<int(ReplicaLink&)>& body,
                    const std::function<void(const DPRun&)>& ready_hook = nullptr) {
  if (n > DP_MAX_REPLICAS) die("--data-parallel-size %d: at most %d replicas", n, DP_MAX_REPLICAS);
  std::vector<int> order;
  int64_t total_completions = 0;
  for (size_t i = 0; i < reqs.size(); i++)
    if (reqs[i].error.empty()) order.push_back((int)i), total_completions += reqs[i].params.n;
  void* p = mmap(nullptr, sizeof(DPShared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) die("cannot map shared memory for the data-parallel queue: %s", strerror(errno));
  DPShared* shared = static_cast<DPShared*>(p);
  memset(shared, 0, sizeof *shared);
  DPRun run;
  DPCoordinator c{reqs, gpus, run, dp_fork_replicas(n, order, shared, gpus, body)};
  run.outs.resize(reqs.size());
  run.stats.resize(n), run.sched.resize(n), run.replicas.resize(n), run.ready_lines.resize(n);
  c.inbox.resize(n), c.kv_used.resize(n), c.state.resize(n), c.done.resize(n);
  const bool tty = isatty(2);
  double last_print = now_seconds();
  for (int alive = n; alive > 0;) {
    std::vector<struct pollfd> pfd(n);
    for (int k = 0; k < n; k++) pfd[k] = {c.fds[k], POLLIN, 0};
    poll(pfd.data(), n, 100);  // (EINTR after a signal: the loop looks again)
    for (int k = 0; k < n; k++) dp_receive(c, k);
    dp_reap(c, progress && tty, alive);
    if (run.failed >= 0) break;
    if (c.ready == n && !run.started) {
      for (const std::string& line : run.ready_lines)
        if (!line.empty()) fputs(line.c_str(), stderr);
      if (ready_hook) ready_hook(run);
      run.started = true, run.go_at = now_seconds();
      g_stop_armed = 1;  // from here the first Ctrl-C stops after the step in flight
      __atomic_store_n(&shared->go, 1u, __ATOMIC_RELEASE);
    }
    if (g_stop_requested) __atomic_store_n(&shared->stop, 1u, __ATOMIC_RELEASE);
    if (progress && run.started && now_seconds() - last_print > (tty ? 0.25 : 5.0)) {
      dp_print_progress(c, total_completions, tty);
      last_print = now_seconds();
    }
  }
  if (progress && tty && run.started && run.failed < 0) fputs("\n", stderr);
  for (int k = 0; k < n; k++) close(c.fds[k]);
  return run;  // (still armed: a Ctrl-C while the completions are written lets them finish, as in one engine's run)
}

// The run's figures from the replicas' (RunSummary says how they combine), and each replica's line.
static void dp_figures(DPRun& run, const std::vector<std::string>& gpus, RunStats& st, SchedulerStats& ss,
                       int& kv_blocks) {
  const int n = (int)run.stats.size();
  st = RunStats{}, ss = SchedulerStats{}, kv_blocks = 0;
  for (int k = 0; k < n; k++) {
    const RunStats& s = run.stats[k];
    st.seconds = std::max(st.seconds, s.seconds);
    st.prefill_tokens += s.prefill_tokens, st.decode_tokens += s.decode_tokens;
    st.steps_prefill += s.steps_prefill, st.steps_decode += s.steps_decode, st.steps_mixed += s.steps_mixed;
    st.mixed_decode_tokens += s.mixed_decode_tokens;
    st.prefill_seconds += s.prefill_seconds / n, st.decode_seconds += s.decode_seconds / n;
    st.schedule_seconds += s.schedule_seconds / n, st.prepare_seconds += s.prepare_seconds / n;
    st.gpu_wait_seconds += s.gpu_wait_seconds / n, st.postprocess_seconds += s.postprocess_seconds / n;
    if (s.first_token_at >= 0 && (st.first_token_at < 0 || s.first_token_at < st.first_token_at))
      st.first_token_at = s.first_token_at;
    st.peak_blocks_used += s.peak_blocks_used;
    ss.num_preemptions += run.sched[k].num_preemptions;
    ss.prefix_hit_tokens += run.sched[k].prefix_hit_tokens;
    ss.prompt_tokens_admitted += run.sched[k].prompt_tokens_admitted;
    RunSummary::Replica& fig = run.replicas[k];
    fig.replica = k, fig.gpus = gpus.empty() ? "(simulated)" : gpus[k];
    fig.seconds = s.seconds, fig.peak_kv_blocks = s.peak_blocks_used, fig.logits_rows = s.last_batch;
    fig.preemptions = run.sched[k].num_preemptions;
    kv_blocks += fig.kv_blocks;
  }
}

// Every request's completions in input order, as one engine's generate() returns them: those handed back,
// and for a request no replica finished (a stop, a failed replica) unfinished ones with no tokens.
static std::vector<Completion> dp_completions(const DPRun& run, const std::vector<Request>& reqs) {
  std::vector<Completion> outs;
  for (size_t r = 0; r < reqs.size(); r++) {
    if (!reqs[r].error.empty()) continue;
    if (!run.outs[r].empty()) {
      outs.insert(outs.end(), run.outs[r].begin(), run.outs[r].end());
      continue;
    }
    for (int k = 0; k < reqs[r].params.n; k++) {
      Completion c{};
      c.finish_reason = nullptr;
      c.prompt_tokens = (int)reqs[r].prompt_token_ids.size();
      c.arrival_time = 0, c.first_token_time = -1, c.finish_time = -1;
      c.request = reqs[r].index >= 0 ? reqs[r].index : (int)r, c.index = k;
      outs.push_back(c);
    }
  }
  return outs;
}

// ==== 48. simulate: the engine without a GPU ===============================================================
// defines: SimGpu, qwen3_shape, model_params, active_params, experts_touched, model_weight_bytes,
//          step_weight_bytes, simulated_kv_blocks, step_cost, SimRunner
//
// `nanovllm simulate MODEL_OR_TOKENIZER PROMPTS [flags]` runs the real LLMEngine, Scheduler and BlockManager
// (sections 3-5, 13) with SimRunner below in place of ModelRunner: no GPU, no weights, the same flags,
// --trace, summary and --report. Two things stand in for the GPU:
//   * the tokens. A sampled token is a hash of the sequence's tokens so far (for a request that samples
//     with temperature > 0, mixed with its seed), so identical prefixes continue identically, as greedy
//     decoding does, and generated text becomes a cacheable prefix exactly as in a real run. With
//     probability --simulate-eos-prob a token is EOS instead (decided by the same hash and --seed; never
//     with ignore_eos), so requests can end early;
//   * the clock. Each step advances a modelled clock by a roofline of the step (SimGpu): a fixed cost per
//     step (larger for a step run eagerly than for one replayed from a CUDA graph), plus the bytes it must
//     read (every weight once, of a MoE layer only the experts its tokens are routed to; the K/V of every
//     token attended) over the memory bandwidth or its FLOPs over the tensor-core rate, whichever is longer.
//     The rates are what this engine reaches on an H100 (docs/observability.md); the times are a model, not
//     a measurement, but they make arrival times, TTFT and TPOT mean something without a GPU. (A MoE model's
//     experts run on Part I's plain products, far below the tensor-core rate in a long prefill: the model
//     prices them as if they did not.)
// The KV pool: --num-kvcache-blocks, or --simulate-gpu-memory SIZE (for example 24GB): what is left of SIZE
// x --gpu-memory-utilization after this shape's weights and an estimate of the activations.

struct SimGpu {           // rates this engine reaches on an H100 80GB (docs/observability.md)
  double bandwidth = 2.8e12;   // bytes/s of weights and K/V read by a step
  double flops = 3.7e14;       // bf16 FLOP/s of prefill's matrix products
  double step_cost = 0.5e-3;   // s: the fixed costs of a step replayed from a CUDA graph
  double eager_cost = 3.5e-3;  // s: ... of a step launched kernel by kernel (prefill, mixed, --enforce-eager)
};

// The Qwen3 shapes (REFERENCE.md sections 5 and 14), for a tokenizer without a config.json: --simulate-model
// NAME. The two MoE ones have 128 experts, 8 per token, in every layer.
static bool qwen3_shape(const std::string& name, ModelConfig& c) {
  struct Shape { const char* name; int H, I, L, NH, NKV; bool tied; int IE; };
  static const Shape shapes[] = {
      {"Qwen3-0.6B", 1024, 3072, 28, 16, 8, true, 0},       {"Qwen3-1.7B", 2048, 6144, 28, 16, 8, true, 0},
      {"Qwen3-4B", 2560, 9728, 36, 32, 8, true, 0},         {"Qwen3-8B", 4096, 12288, 36, 32, 8, false, 0},
      {"Qwen3-14B", 5120, 17408, 40, 40, 8, false, 0},      {"Qwen3-32B", 5120, 25600, 64, 64, 8, false, 0},
      {"Qwen3-30B-A3B", 2048, 6144, 48, 32, 4, false, 768}, {"Qwen3-235B-A22B", 4096, 12288, 94, 64, 4, false, 1536}};
  for (const Shape& s : shapes) {
    if (strcasecmp(name.c_str(), s.name) != 0) continue;
    c.hidden_size = s.H, c.intermediate_size = s.I, c.num_hidden_layers = s.L, c.num_attention_heads = s.NH;
    c.num_key_value_heads = s.NKV, c.head_dim = 128, c.vocab_size = 151936, c.max_position_embeddings = 40960;
    c.tie_word_embeddings = s.tied, c.eos_token_ids = {151645, 151643};
    if (s.IE) c.num_experts = 128, c.num_experts_per_tok = 8, c.moe_intermediate_size = s.IE, c.norm_topk_prob = true;
    return true;
  }
  return false;
}

// Parameters of a shape (the embedding counted once when tied), and those one token computes with
// (active_params: of a MoE layer, the router and k of its E experts).
static int64_t model_params(const ModelConfig& c, bool active = false) {
  const int64_t H = c.hidden_size, I = c.intermediate_size, D = c.head_dim, V = c.vocab_size;
  const int64_t attention = H * (c.num_attention_heads + 2 * c.num_key_value_heads) * D +
                            (int64_t)c.num_attention_heads * D * H + 2 * H + 2 * D;
  const int64_t experts = active ? c.num_experts_per_tok : c.num_experts, L_moe = c.num_moe_layers();
  const int64_t moe = c.num_experts * H + experts * 3 * H * c.moe_intermediate_size;
  return c.num_hidden_layers * attention + (c.num_hidden_layers - L_moe) * 3 * H * I + L_moe * moe +
         V * H * (c.tie_word_embeddings ? 1 : 2) + H;
}
static int64_t active_params(const ModelConfig& c) { return model_params(c, true); }
// The experts of one MoE layer that a step of n tokens reads, expected under uniform routing: an expert is
// left out when none of the n tokens picks it, (1 - k/E)^n, so E (1 - ((E - k) / E)^n) are read (61 of
// Qwen3-30B-A3B's 128 at n = 10, 126 at n = 64).
static double experts_touched(const ModelConfig& c, double n) {
  if (c.num_experts == 0) return 0;
  const double E = c.num_experts, k = c.num_experts_per_tok;
  return E * (1 - pow((E - k) / E, n));
}
// Bytes of the weights a run holds: 2 per parameter, less what a chapter saves on the layers' linear
// weights when it holds them in fewer bytes (step cost linear_weight_bytes_saved, below) for a block-
// quantized checkpoint or a --quantization run.
static double step_cost(const OptimizationSet& set, const std::string& name);
// A MoE model's weights stay bf16 (the chapter that holds linear weights in fewer bytes stands aside for one).
// Bytes a layer linear's weight (an expert's too) is held and read in: 2, less what a chapter that holds a
// block-quantized checkpoint (or a --quantization run) in fewer bytes saves; a MoE model's only where its
// experts are held so too (else the FP8 chapter stands aside and the checkpoint is dequantized).
static double linear_value_bytes(const ModelConfig& c, const Config& cfg) {
  if (!c.block_quantized && cfg.quantization.empty()) return 2.0;
  if (c.num_experts > 0 && step_cost(cfg.opt, "expert_weight_bytes_saved") == 0) return 2.0;
  return 2.0 - step_cost(cfg.opt, "linear_weight_bytes_saved");
}
static double model_weight_bytes(const ModelConfig& c, const Config& cfg) {
  const double H = c.hidden_size, I = c.intermediate_size, D = c.head_dim, L = c.num_hidden_layers;
  const double L_moe = c.num_moe_layers();
  const double linears = L * (H * (c.num_attention_heads + 2 * c.num_key_value_heads) * D +
                              c.num_attention_heads * D * H) + (L - L_moe) * 3 * H * I +
                         L_moe * c.num_experts * 3.0 * H * c.moe_intermediate_size;
  return 2.0 * model_params(c) - (2.0 - linear_value_bytes(c, cfg)) * linears;
}
// The weight bytes a step of n tokens reads: every weight but the experts no token of the step is routed
// to (experts_touched).
static double step_weight_bytes(const ModelConfig& c, const Config& cfg, double n) {
  const double expert = linear_value_bytes(c, cfg) * 3 * c.hidden_size * c.moe_intermediate_size;
  return model_weight_bytes(c, cfg) - c.num_moe_layers() * (c.num_experts - experts_touched(c, n)) * expert;
}

// The KV blocks --simulate-gpu-memory leaves (one GPU): what ModelRunner::allocate_kv_cache would find free,
// estimated from the same allocations (weights, activations for the largest step, workspaces) plus a fixed
// allowance for the CUDA context, cuBLASLt and the CUDA graphs.
static int64_t simulated_kv_blocks(const ModelConfig& c, const Config& cfg, double gpu_bytes) {
  const int64_t H = c.hidden_size, I = c.intermediate_size, D = c.head_dim, V = c.vocab_size;
  const int64_t NH = c.num_attention_heads, NKV = c.num_key_value_heads;
  const int64_t Tmax = std::max(cfg.max_num_batched_tokens, cfg.max_num_seqs), Bmax = cfg.max_num_seqs;
  const double weights = model_weight_bytes(c, cfg);
  install_optimizations(cfg.opt, cfg.kv_cache_dtype);  // the hooks a real run would have: their workspaces too
  const double attention_ws = g_hooks.attention_workspace_bytes
                                  ? (double)g_hooks.attention_workspace_bytes((int)Bmax, (int)NH, cfg.max_model_len)
                                  : 0.0;
  double activations = 2.0 * Tmax * (3 * H + (NH + 2 * NKV) * D + NH * D + 3 * I) + 2.0 * Bmax * H +
                       4.0 * Bmax * V + attention_ws;
  if (c.num_experts > 0) {  // a MoE layer's buffers (ModelRunner::allocate_activations)
    const int E = c.num_experts, k = c.num_experts_per_tok;
    const double RM = (double)moe_rows_alloc(Tmax, k, E);  // logits, ids, weights, pair rows; then the list's
    activations += (double)Tmax * (2 * E + 12 * k) + RM * (4 + 4.0 / MOE_TILE + 2 * (3 * c.moe_intermediate_size + H));
  }
  const double fixed = 1.0e9;  // CUDA context, cuBLASLt workspace, graphs, the sampler's workspace
  const double left = gpu_bytes * cfg.gpu_memory_utilization - weights - activations - fixed;
  const int value_bytes = kv_cache_value_bytes(cfg.kv_cache_dtype);
  const size_t block_bytes = kv_block_bytes(c, cfg.kvcache_block_size, 1, value_bytes);
  return left > 0 ? (int64_t)(left / block_bytes) : 0;
}

// What the optimizations a run switches on change in how a step runs, by the names they give it
// (Optimization::step_costs, section 2; the largest value where several give one, else 0):
//   prefill_graph_tokens      prefill steps of at most this many tokens replay CUDA graphs (one GPU only)
//   decode_rows_per_kv_group  1: a prefill step's leading one-token rows (a mixed step's decode rows) read
//                             their K/V once per GQA group, as a decode step's rows do; 0: once per query head
//   linear_weight_bytes_saved bytes saved per layer linear weight of a block-quantized checkpoint or a
//                             --quantization run (linear_value_bytes): held and read at 2 minus this
//   expert_weight_bytes_saved the same for a MoE model's experts: nonzero where a chapter holds them in fewer
//                             bytes too (linear_value_bytes: without it the FP8 chapter stands aside for a MoE model)
static double step_cost(const OptimizationSet& set, const std::string& name) {
  const std::vector<Optimization>& reg = optimization_registry();
  double v = 0;
  for (size_t i = 0; i < reg.size() && i < set.on.size(); i++)
    for (const auto& [n, x] : reg[i].step_costs)
      if (set.on[i] && n == name) v = std::max(v, x);
  return v;
}

struct SimRunner : StepRunner {
  const ModelConfig& mc;
  const Config& config;
  uint64_t seed;            // --seed: per-request seeds and the EOS draws
  double eos_prob;          // --simulate-eos-prob
  SimGpu gpu;
  double clock = 0;         // the modelled time, in seconds
  std::vector<int> graph_bs = graph_batch_sizes(config.max_num_seqs);
  const int prefill_graph_tokens = (int)step_cost(config.opt, "prefill_graph_tokens");
  const bool decode_rows_per_kv_group = step_cost(config.opt, "decode_rows_per_kv_group") > 0;

  SimRunner(const ModelConfig& m, const Config& c, uint64_t s, double p) : mc(m), config(c), seed(s), eos_prob(p) {
    install_optimizations(c.opt, c.kv_cache_dtype);  // the hooks a real run would have (the engine reads them)
  }

  double now() override { return clock; }
  void wait_until(double t) override { clock = std::max(clock, t); }
  int padded_batch(int B, bool is_prefill) const override {
    if (is_prefill || config.enforce_eager) return B;
    for (int g : graph_bs)
      if (g >= B) return g;
    return B;
  }

  // The stand-in for the model and the sampler: a function of the sequence's tokens (see above).
  int token_after(const Sequence& seq) const {
    const uint64_t salt = seq.params.temperature > 0 ? seq.sampling_seed(seed) : 0;
    const uint64_t h = XXH64(seq.token_ids.data(), seq.token_ids.size() * sizeof(int), salt);
    const bool eos = !seq.params.ignore_eos && !config.eos.empty() &&
                     (double)(splitmix64(h ^ seed) >> 11) * 0x1.0p-53 < eos_prob;
    if (eos) return config.eos[0];
    int limit = mc.vocab_size;  // ordinary tokens only: ids below the first EOS id (the added tokens)
    for (int e : config.eos) limit = std::min(limit, std::max(e, 1));
    return (int)(h % (uint64_t)limit);
  }

  std::vector<int> run(const std::vector<Sequence*>& seqs, bool is_prefill) override {
    // one token's K and V
    const double kv_token = (double)kv_block_bytes(mc, 1, 1, kv_cache_value_bytes(config.kv_cache_dtype));
    const double params = (double)active_params(mc);  // a token's products: of a MoE layer, k experts
    int step_tokens = 0;
    for (const Sequence* s : seqs) step_tokens += s->num_scheduled_tokens;
    double bytes = step_weight_bytes(mc, config, step_tokens), flops = 0;
    // A one-token row of a prefill (or mixed) step that goes through the prefill attention kernel reads its
    // K/V once per query head rather than once per GQA group (section 16); Part II sends the leading ones (a
    // mixed step's decode rows) through the decode kernel instead (decode_rows_per_kv_group).
    const double group = (double)mc.num_attention_heads / mc.num_key_value_heads;
    bool leading = true;  // every row so far had one token
    int tokens = 0;
    for (const Sequence* s : seqs) {
      const double n = s->num_scheduled_tokens, first = s->num_cached_tokens;
      tokens += s->num_scheduled_tokens;
      leading = leading && n == 1;
      const bool per_head = is_prefill && n == 1 && !(leading && decode_rows_per_kv_group);
      bytes += kv_token * (first + n) * (per_head ? group : 1.0);  // the context attended
      flops += 2 * params * n + 4.0 * mc.num_attention_heads * mc.head_dim * mc.num_hidden_layers * n * (first + n / 2);
    }
    // A prefill step replays graphs where Part II captured them (prefill_graph_tokens; one GPU only),
    // charged like a decode graph (the launches of attention between the pieces, and the padding up to the
    // captured size, are left out of the model).
    const bool graphs = tokens <= prefill_graph_tokens && config.tensor_parallel_size == 1;
    const bool eager = config.enforce_eager || (is_prefill && !graphs);
    const double seconds = (eager ? gpu.eager_cost : gpu.step_cost) + std::max(bytes / gpu.bandwidth, flops / gpu.flops);
    clock += seconds;  // (gpu_seconds stays 0: the host's own time is real, the step's is modelled)
    std::vector<int> out;
    for (const Sequence* s : seqs) out.push_back(token_after(*s));
    return out;
  }
};

// ==== 49. The command line: flags and --help ===============================================================
// defines: Cli, kUsage, usage_text, parse_size, FlagReader, engine_flag, sampling_flag, run_flag,
//          check_flag_combinations, parse_args
//
// Every flag lands in a Cli: the engine's Config, the sampling flags under vLLM's names, and what the run
// reads and writes. A flag's mistake is reported before anything is read.

struct Cli {
  Config config;
  PromptOptions prompts;
  std::string prompts_path;  // empty: nano-vllm example.py's two prompts
  std::string output_path;
  std::string report_path;   // --report FILE.html
  int64_t seed = 0;
  bool trace = false;
  double request_rate = 0;   // --request-rate: requests/s of a Poisson process (0: all arrive at once)
  bool simulate = false;     // `nanovllm simulate` (section 48)
  double sim_gpu_bytes = 0;  // --simulate-gpu-memory
  std::string sim_model = "Qwen3-0.6B";  // --simulate-model: the shape when there is no config.json
  bool sim_model_given = false;
  double sim_eos_prob = 0;   // --simulate-eos-prob
  json sampling_flags = json::object();  // the sampling flags given, by vLLM's field names (section 38)
  bool generation_config = true;         // --generation-config auto (true) or vllm
  int data_parallel_size = 1;            // --data-parallel-size: engine replicas (section 46)
  ShardSpec shard;                       // --shard: this run's part of the input (section 41)
};

static const char* kUsage =
    "usage: nanovllm [MODEL_DIR] [PROMPTS] [flags]\n"
    "       nanovllm encode MODEL_DIR [--jsonl | --chat [--no-thinking]]   (stdin -> token ids)\n"
    "       nanovllm decode MODEL_DIR                                      (token ids -> text)\n"
    "       nanovllm roofline          (this GPU's copy bandwidth and bf16 GEMM rate)\n"
    "       nanovllm simulate MODEL_OR_TOKENIZER PROMPTS [flags]   (the scheduler without a GPU; see below)\n"
    "       nanovllm merge OUT.jsonl SHARD.jsonl...   (the --shard runs' --output files as one, in input order)\n"
    "\n"
    "MODEL_DIR  a Hugging Face Qwen3 folder (default ~/huggingface/Qwen3-0.6B/)\n"
    "PROMPTS    a text file (one prompt per line) or a .jsonl file (see docs/requests.md); default: two example prompts\n"
    "\n"
    "engine (nano-vllm Config):\n"
    "  --max-num-batched-tokens N   token budget of a prefill step            (16384)\n"
    "  --max-num-seqs N             sequences in one step                     (512)\n"
    "  --max-model-len N            prompt + completion tokens, at most       (4096)\n"
    "  --gpu-memory-utilization F   share of GPU memory to use, in (0, 1]     (0.9)\n"
    "  --tensor-parallel-size N     GPUs that run one engine (alias --tp)     (1)\n"
    "  --data-parallel-size N       engines, each on its own --tp GPUs, sharing the requests (alias -dp)  (1)\n"
    "  --enforce-eager              no CUDA graphs\n"
    "  --kvcache-block-size N       tokens per KV block, power of two 16-256  (256)\n"
    "  --num-kvcache-blocks N       KV blocks (default: as many as fit)\n"
    "  --kv-cache-dtype T           what the KV cache stores: @KV_FORMATS@  (auto = bf16)\n"
    "  --quantization M             quantize a bf16 checkpoint's linear weights at load: @QUANTIZATIONS@\n"
    "speed (Part II of nanovllm.cu; on by default: @OPT_DEFAULTS@):\n"
    "  --plain                      Part I alone: no optimization of Part II (same as --opt none)\n"
    "  --opt LIST                   comma-separated: all, none, NAME (on) or -NAME (off), left to right;\n"
    "                               NAME: @OPT_NAMES@\n"
    "sampling (defaults for every request, vLLM's names; a .jsonl line may override them):\n"
    "  --generation-config auto|vllm  auto: the model's generation_config.json sets the defaults it names\n"
    "                               (Qwen3: temperature 0.6, top_k 20, top_p 0.95); vllm: the built-in ones (auto)\n"
    "  --temperature F              0 = greedy                                (1.0)\n"
    "  --top-k N                    keep the N most likely tokens, -1 = off   (-1)\n"
    "  --top-p F                    nucleus sampling, 1 = off                 (1.0)\n"
    "  --min-p F                    drop tokens below F x the top token's probability, 0 = off  (0)\n"
    "  --max-tokens N               tokens to generate                        (64)\n"
    "  --min-tokens N               no EOS, stop token or stop string before N tokens  (0)\n"
    "  --n N                        completions per prompt                    (1)\n"
    "  --stop STR                   finish at this text (repeat for several)\n"
    "  --stop-token-ids A,B,...     finish at these token ids\n"
    "  --include-stop-str-in-output keep the stop string (or stop token's text) in the text\n"
    "  --presence-penalty F         minus F for tokens already in the output, in [-2, 2]  (0)\n"
    "  --frequency-penalty F        minus F x count of each token in the output, in [-2, 2]  (0)\n"
    "  --repetition-penalty F       prompt and output tokens: logit / F (or x F if negative), 1 = off  (1)\n"
    "  --logprobs N                 per token: its log-probability and the N most likely, 0..20\n"
    "  --ignore-eos                 do not stop at end-of-sequence tokens\n"
    "  --seed N                     seed of the sampler                       (0)\n"
    "prompts and output:\n"
    "  --raw                        do not apply the chat template\n"
    "  --no-thinking                chat template with enable_thinking=false\n"
    "  --output FILE.jsonl          also write one JSON object per request, then a summary\n"
    "  --trace                      one line per scheduler step on stderr\n"
    "  --report FILE.html           a picture of the whole run: steps, KV pool, hits, preemptions, requests\n"
    "  --shard K/N | slurm | k8s:N  run only shard K of N of the input (from 0; slurm: the job array's task;\n"
    "                               k8s:N: JOB_COMPLETION_INDEX of N completions); needs --output; see merge\n"
    "scheduling:\n"
    "  --scheduler nano|mixed       nano-vllm's (prefill first) or vLLM V1's (one token budget)  (mixed)\n"
    "  --request-rate R             requests arrive at R per second (Poisson, seeded by --seed), not at once\n"
    "simulate (nanovllm simulate: no GPU, a stand-in model and a modelled clock):\n"
    "  --simulate-gpu-memory SIZE   size the KV pool for a GPU of SIZE (e.g. 24GB, 80GB), this model's shape\n"
    "  --simulate-model NAME        the shape when MODEL_OR_TOKENIZER has no config.json       (Qwen3-0.6B)\n"
    "  --simulate-eos-prob P        each token is EOS with probability P (not with ignore_eos)   (0)\n"
    "  --help                       this text\n";

// kUsage with the names this build knows filled in: the registered optimizations (with their one-line
// descriptions) and KV cache formats. A build with Part II cut out lists none.
static std::string usage_text() {
  std::string text = kUsage, names, defaults, lines;
  for (const Optimization& o : optimization_registry()) {
    names += std::string(names.empty() ? "" : " ") + o.name;
    if (o.on_by_default) defaults += std::string(defaults.empty() ? "" : " ") + o.name;
    lines += std::string("                                 ") + o.name + ": " + o.what + "\n";
  }
  auto put = [&](const std::string& key, const std::string& value) {
    const size_t at = text.find(key);
    if (at != std::string::npos) text.replace(at, key.size(), value);
  };
  put("@KV_FORMATS@", kv_cache_spellings());
  std::string methods;
  for (const Optimization& o : optimization_registry())
    if (o.quantization) methods += std::string(methods.empty() ? "" : ", ") + o.quantization;
  put("@QUANTIZATIONS@", methods.empty() ? "none in this build" : methods);
  put("@OPT_DEFAULTS@", defaults.empty() ? "none in this build" : defaults);
  put("@OPT_NAMES@\n", (names.empty() ? std::string("(none in this build)") : names) + "\n" + lines);
  return text;
}

// A memory size: a number and a unit, GB or MB (read as GiB and MiB, as GPU makers mean them: an "80GB"
// card has 80 GiB, less what the driver keeps), or bytes.
static double parse_size(const std::string& flag, const std::string& v) {
  char* end;
  double x = strtod(v.c_str(), &end);
  std::string unit = end;
  double mult = unit == "GB" || unit == "G" || unit == "GiB" ? 1073741824.0
              : unit == "MB" || unit == "M" || unit == "MiB" ? 1048576.0 : unit.empty() ? 1.0 : -1;
  if (v.empty() || end == v.c_str() || mult < 0 || !(x > 0) || !std::isfinite(x))
    die("flag %s expects a memory size such as 24GB or 80GiB, found '%s'", flag.c_str(), v.c_str());
  return x * mult;
}

// The flag being read: its name (`a`), and its value from "--flag=value" or the next argument, read as the
// flag expects with a message that names the flag.
struct FlagReader {
  int argc;
  char** argv;
  int& i;             // argv[i] is the flag; value() moves it on to the value
  std::string a, val; // the flag, and the value after its '=' if it has one
  bool has_eq = false;
  FlagReader(int argc_, char** argv_, int& i_) : argc(argc_), argv(argv_), i(i_), a(argv_[i_]) {
    if (a.rfind("--", 0) == 0 && a.find('=') != std::string::npos) {
      val = a.substr(a.find('=') + 1);
      a = a.substr(0, a.find('='));
      has_eq = true;
    }
  }
  std::string value() {
    if (has_eq) return val;
    if (i + 1 >= argc) die("flag %s needs a value (see --help)", a.c_str());
    return argv[++i];
  }
  int64_t as_int(const std::string& v) const {
    char* end;
    errno = 0;
    long long x = strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end || errno) die("flag %s expects an integer, found '%s'", a.c_str(), v.c_str());
    return x;
  }
  float as_float(const std::string& v) const {
    char* end;
    float x = strtof(v.c_str(), &end);
    if (v.empty() || *end) die("flag %s expects a number, found '%s'", a.c_str(), v.c_str());
    return x;
  }
  double as_double(const std::string& v) const {
    char* end;
    double x = strtod(v.c_str(), &end);
    if (v.empty() || *end) die("flag %s expects a number, found '%s'", a.c_str(), v.c_str());
    return x;
  }
  int as_int32(const std::string& v) const {
    int64_t x = as_int(v);
    if (x < INT32_MIN || x > INT32_MAX) die("flag %s: %s is out of range", a.c_str(), v.c_str());
    return (int)x;
  }
  void flag_only() const {
    if (has_eq) die("flag %s takes no value", a.c_str());
  }
};

// The engine's settings (section 2's Config) and the run's shape (-dp, --shard). False: not one of these.
static bool engine_flag(FlagReader& f, Cli& cli) {
  const std::string& a = f.a;
  Config& c = cli.config;
  if (a == "--max-num-batched-tokens") c.max_num_batched_tokens = f.as_int32(f.value());
  else if (a == "--max-num-seqs") c.max_num_seqs = f.as_int32(f.value());
  else if (a == "--max-model-len") c.max_model_len = f.as_int32(f.value());
  else if (a == "--gpu-memory-utilization") c.gpu_memory_utilization = f.as_float(f.value());
  else if (a == "--tensor-parallel-size" || a == "--tp") c.tensor_parallel_size = f.as_int32(f.value());
  else if (a == "--data-parallel-size" || a == "-dp") {
    cli.data_parallel_size = f.as_int32(f.value());
    if (cli.data_parallel_size < 1 || cli.data_parallel_size > DP_MAX_REPLICAS)
      die("--data-parallel-size must be from 1 to %d, found %d", DP_MAX_REPLICAS, cli.data_parallel_size);
  } else if (a == "--shard") {
    const std::string problem = parse_shard(f.value(), cli.shard);
    if (!problem.empty()) die("%s", problem.c_str());
  }
  else if (a == "--enforce-eager") f.flag_only(), c.enforce_eager = true;
  else if (a == "--kvcache-block-size") c.kvcache_block_size = f.as_int32(f.value());
  else if (a == "--kv-cache-dtype") {
    const std::string problem = parse_kv_cache_dtype(f.value(), c.kv_cache_dtype);
    if (!problem.empty()) die("%s", problem.c_str());
  }
  else if (a == "--quantization") {
    const std::string problem = parse_quantization(f.value(), c.quantization);
    if (!problem.empty()) die("%s", problem.c_str());
  }
  else if (a == "--num-kvcache-blocks") c.num_kvcache_blocks = f.as_int32(f.value());
  else if (a == "--plain") f.flag_only(), parse_optimizations("none", c.opt);
  else if (a == "--scheduler") {
    std::string v = f.value();
    if (v != "nano" && v != "mixed") die("--scheduler must be nano or mixed, found '%s'", v.c_str());
    c.mixed_scheduler = v == "mixed";
  }
  else if (a == "--opt") {
    std::string problem = parse_optimizations(f.value(), c.opt);
    if (!problem.empty()) die("%s", problem.c_str());
  }
  else return false;
  return true;
}

// The sampling flags, gathered under vLLM's field names (`--top-k` is "top_k") for sampling_defaults,
// and --generation-config. False: not one of these.
static bool sampling_flag(FlagReader& f, Cli& cli) {
  const std::string& a = f.a;
  json& sp = cli.sampling_flags;
  std::string field = a.size() > 2 ? a.substr(2) : "";
  std::replace(field.begin(), field.end(), '-', '_');
  if (a == "--temperature" || a == "--top-p" || a == "--min-p" || a == "--presence-penalty" ||
      a == "--frequency-penalty" || a == "--repetition-penalty")
    sp[field] = f.as_double(f.value());
  else if (a == "--top-k" || a == "--max-tokens" || a == "--min-tokens" || a == "--n" || a == "--logprobs")
    sp[field] = f.as_int32(f.value());
  else if (a == "--ignore-eos" || a == "--include-stop-str-in-output") f.flag_only(), sp[field] = true;
  else if (a == "--stop") {
    if (!sp.contains("stop")) sp["stop"] = json::array();
    sp["stop"].push_back(f.value());
  } else if (a == "--stop-token-ids") {
    sp["stop_token_ids"] = json::array();
    std::string v = f.value();
    for (size_t at = 0; at <= v.size();) {
      size_t comma = std::min(v.find(',', at), v.size());
      sp["stop_token_ids"].push_back(f.as_int(v.substr(at, comma - at)));
      at = comma + 1;
    }
  } else if (a == "--generation-config") {
    std::string v = f.value();
    if (v != "auto" && v != "vllm") die("--generation-config must be auto or vllm, found '%s'", v.c_str());
    cli.generation_config = v == "auto";
  }
  else return false;
  return true;
}

// What goes in and comes out (prompts, --output, --trace, --report, arrivals) and the --simulate-* flags.
// False: not one of these.
static bool run_flag(FlagReader& f, Cli& cli) {
  const std::string& a = f.a;
  if (a == "--seed") cli.seed = f.as_int(f.value());
  else if (a == "--raw") f.flag_only(), cli.prompts.raw = true;
  else if (a == "--no-thinking") f.flag_only(), cli.prompts.enable_thinking = false;
  else if (a == "--output") cli.output_path = f.value();
  else if (a == "--trace") f.flag_only(), cli.trace = true;
  else if (a == "--report") cli.report_path = f.value();
  else if (a == "--request-rate") {
    cli.request_rate = f.as_float(f.value());
    if (!(cli.request_rate > 0) || !std::isfinite(cli.request_rate))
      die("--request-rate must be a positive number of requests per second, found %g", cli.request_rate);
  } else if (a == "--simulate-gpu-memory") cli.sim_gpu_bytes = parse_size(a, f.value());
  else if (a == "--simulate-model") {
    cli.sim_model = f.value(), cli.sim_model_given = true;
    ModelConfig probe;
    if (!qwen3_shape(cli.sim_model, probe))
      die("--simulate-model %s: not a known shape; give Qwen3-0.6B, -1.7B, -4B, -8B, -14B, -32B, -30B-A3B or "
          "-235B-A22B", cli.sim_model.c_str());
  } else if (a == "--simulate-eos-prob") {
    cli.sim_eos_prob = f.as_float(f.value());
    if (!(cli.sim_eos_prob >= 0 && cli.sim_eos_prob <= 1))
      die("--simulate-eos-prob must be in [0, 1], found %g", cli.sim_eos_prob);
  }
  else return false;
  return true;
}

// The flags that cannot go together, and the sampling flags' values (flag mistakes first, before the
// model is read).
static void check_flag_combinations(Cli& cli, bool simulate) {
  if (!simulate && (cli.sim_gpu_bytes > 0 || cli.sim_model_given || cli.sim_eos_prob > 0))
    die("the --simulate-* flags belong to `nanovllm simulate MODEL_OR_TOKENIZER PROMPTS`");
  if (cli.shard.on() && cli.output_path.empty() && !simulate)
    die("%s: a shard's completions are merged from its --output file (nanovllm merge); "
        "give --output FILE.jsonl", cli.shard.from.c_str());
  if (cli.data_parallel_size > 1 && cli.request_rate > 0)
    die("--data-parallel-size %d runs an offline batch; requests that arrive over time (--request-rate) "
        "model one engine serving traffic: run them with one replica", cli.data_parallel_size);
  if (cli.data_parallel_size > 1 && !cli.report_path.empty())
    die("--report draws one engine's steps, and --data-parallel-size %d runs %d engines: drop --report or "
        "run one replica", cli.data_parallel_size, cli.data_parallel_size);
  const json& f = cli.sampling_flags;
  sampling_from_json(f, cli.prompts.defaults, "command line", 0,
                     f.contains("min_tokens") && f.contains("max_tokens"));
}

static Cli parse_args(int argc, char** argv, bool simulate = false) {
  Cli cli;
  cli.simulate = simulate;
  // vLLM V1's scheduler by default: with the decode rows of its mixed steps at decode speed (section 16) and
  // those steps in CUDA graphs (23) it matches nano-vllm's rule on bench.py and cuts the tail of the time per
  // output token (docs/experiments.md, "Two schedulers"). --scheduler nano runs nano-vllm's, the one Part I tells first.
  cli.config.mixed_scheduler = true;
  const char* home = getenv("HOME");
  cli.config.model = std::string(home ? home : ".") + "/huggingface/Qwen3-0.6B/";
  std::vector<std::string> positional;
  for (int i = 1; i < argc; i++) {
    FlagReader f(argc, argv, i);
    const std::string& a = f.a;
    if (a == "--help" || a == "-h") {
      fputs(usage_text().c_str(), stdout);
      exit(0);
    }
    if (engine_flag(f, cli) || sampling_flag(f, cli) || run_flag(f, cli)) continue;
    if (a.rfind("-", 0) == 0 && a.size() > 1) die("unknown flag '%s' (see --help)", a.c_str());
    positional.push_back(a);
  }
  if (positional.size() > 2) die("too many arguments: '%s' (expected MODEL_DIR [PROMPTS])", positional[2].c_str());
  if (positional.size() >= 1) cli.config.model = positional[0];
  if (positional.size() == 2) cli.prompts_path = positional[1];
  if (simulate && positional.size() != 2)
    die("usage: nanovllm simulate MODEL_OR_TOKENIZER PROMPTS [flags] (a model folder, a folder with a "
        "tokenizer.json, or the path of a tokenizer.json; then the prompts file)");
  check_flag_combinations(cli, simulate);
  return cli;
}

// ==== 50. A run's start and end: the GPUs, the start-up line, the closing lines ============================
// defines: example_requests, sampling_defaults_for, check_gpus, count_gpus_in_child, replica_gpus,
//          gpu_warmup_start, startup_line, optimization_notes, take_shard, RunOutcome, finish_run, finish_dp
//
// The pieces every kind of run shares (one engine, data-parallel replicas, a simulated run): the requests
// and sampling defaults, the GPUs it may use, what it prints once it is ready, its share of the input under
// --shard, and finish_run, which writes the completions, the report and the summary after it.

// The requests when no PROMPTS file is given: nano-vllm example.py's two chat prompts.
static std::vector<Request> example_requests(const Tokenizer& tok, const PromptOptions& opt) {
  std::vector<Request> reqs;
  for (const char* p : {"introduce yourself", "list all prime numbers within 100"}) {
    Request r;
    r.params = opt.defaults;
    validate_sampling(r.params, "command line");
    r.prompt_token_ids = opt.raw ? tok.encode(p) : tok.encode(tok.apply_chat_template({{"user", p}}, true,
                                                                                    opt.enable_thinking));
    reqs.push_back(r);
  }
  return reqs;
}

// The sampling defaults of this run (section 38's sampling_defaults) into cli.prompts.defaults; returns the
// description the start-up line prints.
static std::string sampling_defaults_for(Cli& cli, const ModelConfig& mc) {
  std::string described;
  cli.prompts.defaults = sampling_defaults(mc.generation_config, cli.config.model + "/generation_config.json",
                                           cli.generation_config, cli.sampling_flags, mc.vocab_size, &described);
  return described;
}

// The GPUs a run needs: at least `needed` visible, of compute capability 8.0 or newer, with this binary's
// kernels built for them. Returns how many CUDA sees.
static int check_gpus(int needed) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0)
    die("no CUDA GPU is visible (%s). nanovllm needs an NVIDIA GPU of compute capability 8.0 or newer "
        "(encode/decode work without one)",
        e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
  if (needed > n) die("--tensor-parallel-size %d needs %d GPUs, but %d are visible", needed, needed, n);
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major < 8)
    die("GPU 0 (%s) has compute capability %d.%d; nanovllm needs 8.0 or newer for its bf16 tensor-core "
        "kernels (A100, RTX 30 and 40 series, L4, L40, H100 and later)",
        prop.name, prop.major, prop.minor);
  // A binary built for one architecture (make CUDA_ARCH=...) on another GPU: say so now, not at the first
  // kernel launch as "no kernel image is available".
  cudaFuncAttributes fa;
  cudaError_t ke = cudaFuncGetAttributes(&fa, embedding_kernel);
  if (ke != cudaSuccess)
    die("this nanovllm binary has no kernels for GPU 0 (%s, compute capability %d.%d): %s. Rebuild it on this "
        "machine: make clean && make",
        prop.name, prop.major, prop.minor, cudaGetErrorString(ke));
  return n;
}

// How many GPUs CUDA sees, counted in a child process: the coordinator of a data-parallel run must not
// initialise CUDA before it forks the replicas (section 12b). 0, with `why`, when CUDA finds none.
static int count_gpus_in_child(std::string& why) {
  int fd[2];
  if (pipe(fd) != 0) die("cannot make a pipe: %s", strerror(errno));
  fflush(stdout), fflush(stderr);
  const pid_t pid = fork();
  if (pid < 0) die("fork() failed: %s", strerror(errno));
  if (pid == 0) {
    close(fd[0]);
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    char msg[256];
    const int len = snprintf(msg, sizeof msg, "%d %s", e == cudaSuccess ? n : 0,
                             e == cudaSuccess ? "" : cudaGetErrorString(e));
    ssize_t w = write(fd[1], msg, std::min<int>(len, sizeof msg - 1));
    (void)w;
    _exit(0);
  }
  close(fd[1]);
  std::string got;
  char buf[256];
  for (ssize_t k; (k = read(fd[0], buf, sizeof buf)) > 0 || (k < 0 && errno == EINTR);)
    if (k > 0) got.append(buf, (size_t)k);
  close(fd[0]);
  waitpid(pid, nullptr, 0);
  const int n = atoi(got.c_str());
  const size_t space = got.find(' ');
  why = space == std::string::npos ? "" : got.substr(space + 1);
  return n;
}

// Replica k's CUDA_VISIBLE_DEVICES: the k-th slice of tp of this process's devices (its CUDA_VISIBLE_DEVICES,
// or 0..count-1 when it has none).
static std::vector<std::string> replica_gpus(int dp, int tp, int count) {
  std::vector<std::string> ids;
  if (const char* v = getenv("CUDA_VISIBLE_DEVICES")) {
    for (const char* p = v; *p;) {
      const char* comma = strchr(p, ',');
      const std::string id(p, comma ? comma - p : strlen(p));
      if (!id.empty()) ids.push_back(id);
      p = comma ? comma + 1 : p + strlen(p);
    }
    ids.resize(std::min<size_t>(ids.size(), count));  // CUDA stops at the first entry it cannot use
  } else {
    for (int i = 0; i < count; i++) ids.push_back(std::to_string(i));
  }
  std::vector<std::string> out(dp);
  for (int k = 0; k < dp; k++)
    for (int r = 0; r < tp; r++) out[k] += (r ? "," : "") + ids[k * tp + r];
  return out;
}

// Start-up in parallel. Creating the CUDA context and cuBLASLt's first algorithm choices (the first loads its
// heuristics) need nothing the tokenizer, the prompts or the weights give, so a run on one GPU starts them
// on a second thread while this one reads those; cuBLASLt keeps its choices for the whole process, so the
// engine's own Gemm (section 10) then finds them made. The thread asks for every product a decode step of
// each CUDA-graph batch size makes. Never when processes are still to be forked (--tp, -dp > 1): a process
// must not fork once it has used CUDA. A mistake found meanwhile waits for the thread before it exits.
static std::thread* g_gpu_warmup = nullptr;
static void gpu_warmup_join() {
  if (g_gpu_warmup && g_gpu_warmup->joinable() && g_gpu_warmup->get_id() != std::this_thread::get_id())
    g_gpu_warmup->join();
}
static void gpu_warmup_start(const Config& config, const ModelConfig& mc) {
  const int H = mc.hidden_size, D = mc.head_dim, I = mc.intermediate_size, V = mc.vocab_size;
  const int NH = mc.num_attention_heads, NKV = mc.num_key_value_heads;
  const std::vector<int> batch_sizes = graph_batch_sizes(config.max_num_seqs);
  tok_die_before_exit = gpu_warmup_join;
  g_gpu_warmup = new std::thread([=] {
    if (cudaFree(nullptr) != cudaSuccess) {  // no usable GPU: check_gpus says so, on the main thread
      cudaGetLastError();
      return;
    }
    Gemm* gemm = new Gemm;  // a handle of its own, no workspace: plan() only chooses (kept: cheap)
    if (cublasLtCreate(&gemm->handle) != CUBLAS_STATUS_SUCCESS) return;
    for (int M : batch_sizes) {
      gemm->plan(M, (NH + 2 * NKV) * D, H, CUDA_R_16BF);  // qkv
      gemm->plan(M, H, NH * D, CUDA_R_16BF);              // o_proj
      gemm->plan(M, 2 * I, H, CUDA_R_16BF);               // gate_up
      gemm->plan(M, H, I, CUDA_R_16BF);                   // down
      if (mc.num_experts) gemm->plan(M, mc.num_experts, H, CUDA_R_16BF);  // a MoE layer's router
      gemm->plan(M, V, H, CUDA_R_32F);                    // the LM head's fp32 logits
    }
  });
}

// The start-up line of an engine on its GPUs.
static std::string startup_line(ModelRunner& runner, const Config& config, double t_start) {
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int tp = config.tensor_parallel_size;
  const std::string gpus = tp > 1 ? std::to_string(tp) + " x " + prop.name + " (tensor parallel)" : prop.name;
  char line[640];
  snprintf(line, sizeof line,
           "nanovllm: %s%s | weights %.2f GB%s%s loaded in %.2f s (%.1f GB/s) | KV cache %s, %d blocks x %d "
           "tokens = %lld tokens, %.2f GiB | %zu CUDA graphs in %.2f s | ready after %.2f s\n",
           g_process_label[0] ? (std::string(g_process_label) + ": ").c_str() : "", gpus.c_str(),
           runner.model.w.bytes / 1e9, tp > 1 ? " per GPU" : "",
           runner.model.w.held == "bf16" ? "" : (" (" + runner.model.w.held + ")").c_str(), runner.load_seconds,
           runner.load_gbps,
           config.kv_cache_dtype.c_str(), config.num_kvcache_blocks, config.kvcache_block_size,
           (long long)config.num_kvcache_blocks * config.kvcache_block_size,
           runner.model.kv.bytes / (double)(1 << 30), runner.graphs.size(), runner.capture_seconds,
           now_seconds() - t_start);
  return line;
}

// What the switched-on optimizations say about this machine (Optimization::note), for the start-up line.
static std::string optimization_notes(ModelRunner& runner) {
  std::string notes;
  for (size_t i = 0; i < optimization_registry().size(); i++) {
    const Optimization& o = optimization_registry()[i];
    if (o.note && i < runner.config.opt.on.size() && runner.config.opt.on[i]) {
      const std::string n = o.note(runner.model);
      if (!n.empty()) notes += "; " + n;
    }
  }
  return notes.empty() ? "" : " (" + notes.substr(2) + ")";
}

// --shard: this run's share of the input (each request keeping its place as Request::index), and its
// record's facts. A shard with no request writes its record alone (no GPU needed) and the run ends.
static std::vector<Request> take_shard(const Cli& cli, std::vector<Request>& all, ShardOut& out) {
  out.spec = cli.shard, out.total = all.size();
  out.input_xxh64 = requests_xxh64(all, (uint64_t)cli.seed);
  std::vector<Request> mine = shard_requests(all, cli.shard, out.indices);
  int64_t weight = 0, total = 0;
  for (const Request& r : all) total += request_weight(r);
  for (const Request& r : mine) weight += request_weight(r);
  const std::string range = mine.empty() ? "none" : "#" + std::to_string(out.indices.front()) + "-" +
                                                    std::to_string(out.indices.back());
  fprintf(stderr, "nanovllm: shard %d/%d (%s) | %zu of %zu prompts (%s) | %.1f%% of the weight\n",
          cli.shard.index, cli.shard.count, cli.shard.from.c_str(), mine.size(), all.size(), range.c_str(),
          100.0 * weight / std::max<int64_t>(total, 1));
  return mine;
}
static int finish_empty_shard(const Cli& cli, const ShardOut& sh) {
  if (!cli.output_path.empty()) {
    FILE* f = fopen(cli.output_path.c_str(), "w");
    if (!f) die("cannot write --output '%s': %s", cli.output_path.c_str(), strerror(errno));
    fprintf(f, "%s\n", shard_record(sh, 0, 0).dump().c_str());
    fclose(f);
  }
  fprintf(stderr, "nanovllm: shard %d/%d has no prompts of its own; its --output holds its shard record alone\n",
          sh.spec.index, sh.spec.count);
  return 0;
}

// What a run leaves for finish_run besides its completions: one engine's figures, or the replicas' together.
struct RunOutcome {
  RunStats stats;
  SchedulerStats sched;
  int kv_blocks = 0;
  uint64_t logits_xxh64 = 0;
  std::vector<StepTrace> steps;                // --report
  std::vector<RunSummary::Replica> replicas;   // --data-parallel-size > 1
  std::string title;                           // --report's
  double first_token_after = 0;                // seconds from the process's start
  const char* stopped_by = "Ctrl-C";           // what left completions unfinished, if any did
  int status = 0;                              // the exit status unless Ctrl-C stopped the run
};

// After the run, for one engine, the replicas of data parallelism, a real run and a simulated one alike:
// completions to stdout and --output (a shard's with its record last), the report, the closing line and
// the summary. Returns the exit status.
static int finish_run(const Cli& cli, const std::vector<Request>& requests, const std::vector<Completion>& outs,
                      const Tokenizer& tok, const RunOutcome& run, const ShardOut* shard) {
  const Config& config = cli.config;
  const RunStats& st = run.stats;
  RunSummary summary = run_summary(st, run.sched, run.kv_blocks, outs, run.logits_xxh64, config.mixed_scheduler);
  summary.kv_cache_dtype = config.kv_cache_dtype.c_str();
  summary.kv_pool_tokens = (int64_t)run.kv_blocks * config.kvcache_block_size;
  summary.replicas = run.replicas;
  FILE* jsonl = nullptr;
  if (!cli.output_path.empty() && !(jsonl = fopen(cli.output_path.c_str(), "w")))
    die("cannot write --output '%s': %s", cli.output_path.c_str(), strerror(errno));
  std::string model_name = config.model;
  while (model_name.size() > 1 && model_name.back() == '/') model_name.pop_back();
  model_name = model_name.substr(model_name.rfind('/') + 1);  // the folder's name, as a batch's "model"
  const bool batch = write_completions(requests, outs, tok, jsonl, model_name, run.stopped_by);
  if (!batch) write_summary(summary, jsonl);
  int64_t finished = 0;
  for (auto& o : outs) finished += o.finish_reason != nullptr;
  if (shard && jsonl)
    fprintf(jsonl, "%s\n", shard_record(*shard, batch ? (int64_t)requests.size() : finished,
                                        (int64_t)outs.size() - finished).dump().c_str());
  if (jsonl) fclose(jsonl);
  if (!cli.report_path.empty()) write_report(cli.report_path, run.title, summary_json(summary), run.steps, outs);
  int64_t out_tokens = 0;
  for (auto& o : outs) out_tokens += (int64_t)o.token_ids.size();
  size_t ran = 0;  // requests that ran (an OpenAI batch's error lines do not); with n > 1, more completions
  for (auto& r : requests) ran += r.error.empty();
  const std::string count = std::to_string(ran) + " requests" +
                            (outs.size() != ran ? " (" + std::to_string(outs.size()) + " completions)" : "");
  fprintf(stderr,
          "nanovllm: %s | %lld prompt + %lld generated tokens in %.2f s | %.0f generated tok/s | "
          "prefill %.0f tok/s, decode %.0f tok/s | first token %.3f s after start\n",
          count.c_str(), (long long)st.prefill_tokens, (long long)out_tokens, st.seconds,
          out_tokens / std::max(st.seconds, 1e-9), st.prefill_tokens / std::max(st.prefill_seconds, 1e-9),
          st.decode_tokens / std::max(st.decode_seconds, 1e-9), run.first_token_after);
  fputs(format_summary(summary).c_str(), stderr);
  if (summary.unfinished_requests)
    fprintf(stderr, "nanovllm: stopped by %s: %lld of %zu completions unfinished, not written\n", run.stopped_by,
            (long long)summary.unfinished_requests, outs.size());
  if (run.status) return run.status;
  return g_stop_requested ? 128 + SIGINT : 0;
}

// A data-parallel run's end (section 47): the replicas' completions in input order and their figures,
// written as one run's. Exit status 1 when a replica failed (after writing what finished, once they ran).
static int finish_dp(const Cli& cli, const std::vector<Request>& requests, DPRun& dp,
                     const std::vector<std::string>& gpus, const Tokenizer& tok, double t_start,
                     const ShardOut* shard) {
  if (dp.failed >= 0 && !dp.started) return 1;
  RunOutcome run;
  dp_figures(dp, gpus, run.stats, run.sched, run.kv_blocks);
  run.replicas = dp.replicas;
  run.first_token_after = dp.go_at - t_start + std::max(run.stats.first_token_at, 0.0);
  std::string failed;
  if (dp.failed >= 0) {
    failed = "replica " + std::to_string(dp.failed) + "'s failure";
    run.stopped_by = failed.c_str(), run.status = 1;
  }
  return finish_run(cli, requests, dp_completions(dp, requests), tok, run, shard);
}

// ==== 51. The commands and main ============================================================================
// defines: roofline_command, merge_command, simulate_command, run_data_parallel, main
//
// What `nanovllm` can be asked to do besides a run (roofline, merge, simulate; encode and decode are the
// tokenizer's), the data-parallel run, and main, which reads everything it can check without a GPU first.

// `nanovllm roofline`: the two ceilings every speed figure is measured against, on this GPU: device-to-device
// copy bandwidth (bytes read + written) and a large bf16 cuBLASLt matrix product. bench.sh uses both.
static int roofline_command() {
  check_gpus(1);
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreate(&s));
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  auto median_ms = [&](auto&& fn, int reps) {
    std::vector<float> t;
    for (int i = 0; i < reps + 3; i++) {
      CUDA_CHECK(cudaEventRecord(e0, s));
      fn();
      CUDA_CHECK(cudaEventRecord(e1, s));
      CUDA_CHECK(cudaEventSynchronize(e1));
      float ms;
      CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (i >= 3) t.push_back(ms);  // the first runs are warm-up
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  size_t n = (size_t)2 << 30;  // 2 GiB each way: far beyond L2
  void *a, *b;
  CUDA_CHECK(cudaMalloc(&a, n));
  CUDA_CHECK(cudaMalloc(&b, n));
  CUDA_CHECK(cudaMemsetAsync(a, 0x5a, n, s));
  float ms = median_ms([&] { CUDA_CHECK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, s)); }, 20);
  double gbps = 2.0 * n / (ms * 1e-3) / 1e9;
  CUDA_CHECK(cudaFree(a));
  CUDA_CHECK(cudaFree(b));
  const int M = 8192;
  bf16 *x, *w, *y;
  CUDA_CHECK(cudaMalloc(&x, (size_t)M * M * 2));
  CUDA_CHECK(cudaMalloc(&w, (size_t)M * M * 2));
  CUDA_CHECK(cudaMalloc(&y, (size_t)M * M * 2));
  std::vector<uint16_t> h((size_t)M * M);
  uint64_t r = 1;
  for (auto& v : h) r = splitmix64(r), v = float_to_bf16_bits((float)((int64_t)(r % 2001) - 1000) / 1000.0f);
  CUDA_CHECK(cudaMemcpy(x, h.data(), h.size() * 2, cudaMemcpyHostToDevice));  // random data, not zeros
  CUDA_CHECK(cudaMemcpy(w, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  Gemm g;
  g.init();
  ms = median_ms([&] { g.run(y, x, w, M, M, M, s); }, 10);
  double tflops = 2.0 * M * M * M / (ms * 1e-3) / 1e12;
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  printf("gpu: %s\ncopy bandwidth: %.0f GB/s (read + write)\nbf16 GEMM 8192^3: %.0f TFLOP/s\n", prop.name, gbps,
         tflops);
  return 0;
}

// `nanovllm merge OUT SHARD_FILE...` (section 41's merge_shards).
static int merge_command(int argc, char** argv) {
  if (argc < 3 || !strcmp(argv[1], "--help"))
    die("usage: nanovllm merge OUT.jsonl SHARD.jsonl... (the --output files of every --shard K/N run)");
  const std::string out = argv[1];
  std::vector<std::string> paths(argv + 2, argv + argc);
  for (const std::string& p : paths)
    if (p == out) die("merge: the output '%s' is also one of the shard files", out.c_str());
  check_output_path(out, "merge's output", "merged.jsonl");
  std::string merged, said;
  const std::string problem = merge_shards(paths, merged, said);
  if (!problem.empty()) die("merge: %s", problem.c_str());
  FILE* f = fopen(out.c_str(), "w");
  if (!f || fwrite(merged.data(), 1, merged.size(), f) != merged.size() || fclose(f) != 0)
    die("cannot write merge's output '%s': %s", out.c_str(), strerror(errno));
  fprintf(stderr, "nanovllm: merged %s -> %s\n", said.c_str(), out.c_str());
  return 0;
}

// `nanovllm simulate MODEL_OR_TOKENIZER PROMPTS [flags]` (section 48): the same checks and the same engine as
// a run, with SimRunner in place of the GPU. With --shard it first prints the plan of every shard, then
// runs its own share; with --data-parallel-size N, N replica processes as a real run forks (section 46).
static int simulate_command(Cli& cli) {
  const double t_start = now_seconds();
  Config& config = cli.config;
  const std::string& src = config.model;
  ModelConfig mc;
  const bool has_config = is_dir(src) && is_file(src + "/config.json");
  if (has_config && cli.sim_model_given)
    die("simulate: %s has a config.json, whose shape is used; --simulate-model is for a tokenizer alone",
        src.c_str());
  if (has_config) mc = load_model_config(src);
  else if (!qwen3_shape(cli.sim_model, mc)) die("--simulate-model %s: not a known shape", cli.sim_model.c_str());
  if (config.tensor_parallel_size != 1)
    die("simulate models one GPU per engine: --tensor-parallel-size must be 1, found %d",
        config.tensor_parallel_size);
  validate_config(config, mc);
  const std::string sampling = sampling_defaults_for(cli, mc);
  Tokenizer tok = Tokenizer::load(src);
  std::vector<Request> requests = read_prompts(cli.prompts_path, tok, cli.prompts, config, mc);
  if (cli.request_rate > 0) assign_arrivals(requests, cli.request_rate, (uint64_t)cli.seed);
  const int need = (int)cdiv(config.max_model_len, config.kvcache_block_size);
  if (config.num_kvcache_blocks < 0) {
    if (!(cli.sim_gpu_bytes > 0))
      die("simulate needs the size of the KV pool: --num-kvcache-blocks N, or --simulate-gpu-memory SIZE "
          "(for example 24GB) to size it for a GPU");
    config.num_kvcache_blocks = (int)std::min<int64_t>(simulated_kv_blocks(mc, config, cli.sim_gpu_bytes), 1 << 30);
  }
  if (config.num_kvcache_blocks < need)
    die("the KV pool has %d blocks of %d tokens, but one sequence of --max-model-len %d needs %d: give more "
        "--simulate-gpu-memory or --num-kvcache-blocks, or lower --max-model-len", config.num_kvcache_blocks,
        config.kvcache_block_size, config.max_model_len, need);
  if (!cli.output_path.empty()) check_output_path(cli.output_path);
  if (!cli.report_path.empty()) check_output_path(cli.report_path, "--report", "report.html");
  const int dp = cli.data_parallel_size;
  for (const Request& r : requests)
    if (dp > 1 && r.arrival_given)
      die("%s: \"arrival_time\": --data-parallel-size %d runs an offline batch; requests that arrive over time "
          "model one engine serving traffic: run them with one replica", r.source.c_str(), dp);
  ShardOut shard;
  if (cli.shard.on()) {
    fputs(shard_plan(requests, cli.shard.count, cli.shard.index).c_str(), stderr);
    requests = take_shard(cli, requests, shard);
    if (requests.empty()) return finish_empty_shard(cli, shard);
  }
  const std::string shape = has_config ? src + "/config.json" : cli.sim_model;
  char active[48] = "";  // a MoE model: the parameters one token computes with
  if (mc.num_experts) snprintf(active, sizeof active, ", %.2f B active", active_params(mc) / 1e9);
  fprintf(stderr,
          "nanovllm: simulate | shape of %s (%.2f B parameters%s) | KV cache %s, %d blocks x %d tokens = %lld "
          "tokens%s | scheduler %s | no GPU: a stand-in model and a modelled clock (section 48)\n",
          shape.c_str(), model_params(mc) / 1e9, active, config.kv_cache_dtype.c_str(),
          config.num_kvcache_blocks, config.kvcache_block_size,
          (long long)config.num_kvcache_blocks * config.kvcache_block_size,
          dp > 1 ? (" per replica, " + std::to_string(dp) + " replicas").c_str() : "",
          config.mixed_scheduler ? "mixed" : "nano");
  fprintf(stderr, "nanovllm: sampling defaults: %s\n", sampling.c_str());
  if (dp > 1) {
    DPRun run = dp_run(dp, requests, {}, !cli.trace, [&](ReplicaLink& link) {
      SimRunner sim(mc, config, (uint64_t)cli.seed, cli.sim_eos_prob);
      LLMEngine engine(config, sim);
      RunWatcher watcher;
      watcher.progress = false, watcher.trace = cli.trace;
      watcher.label = "[replica " + std::to_string(link.replica) + "] ";
      engine.observer = &watcher;
      engine.tok = &tok;
      replica_serve(link, engine, watcher, requests, "", "", config.num_kvcache_blocks, [](int) { return 0ull; });
      return 0;
    });
    return finish_dp(cli, requests, run, {}, tok, t_start, cli.shard.on() ? &shard : nullptr);
  }
  SimRunner sim(mc, config, (uint64_t)cli.seed, cli.sim_eos_prob);
  LLMEngine engine(config, sim);
  RunWatcher watcher;
  watcher.trace = cli.trace;
  engine.observer = &watcher;
  engine.tok = &tok;
  RunOutcome run;
  if (!cli.report_path.empty()) watcher.record = &run.steps;
  install_stop_handlers();
  g_stop_armed = 1;
  std::vector<Completion> outs = engine.generate(requests);
  char title[512];
  snprintf(title, sizeof title, "simulate: %s shape, %d KV blocks of %d tokens, scheduler %s, %zu requests%s",
           shape.c_str(), config.num_kvcache_blocks, config.kvcache_block_size,
           config.mixed_scheduler ? "mixed (vLLM V1)" : "nano (nano-vllm)", requests.size(),
           cli.request_rate > 0 ? (", arriving at " + fmt("%g", cli.request_rate) + " per second").c_str() : "");
  run.stats = watcher.stats, run.sched = engine.scheduler.stats, run.kv_blocks = config.num_kvcache_blocks;
  run.title = title, run.first_token_after = watcher.stats.first_token_at;
  return finish_run(cli, requests, outs, tok, run, cli.shard.on() ? &shard : nullptr);
}

// --data-parallel-size N (-dp N): N replicas, each an engine on its own GPUs (section 46); this process only
// hands out the requests and writes what comes back. It counts the GPUs in a child: it must not use CUDA
// itself before it forks.
static int run_data_parallel(Cli& cli, const ModelConfig& mc, const Tokenizer& tok, std::vector<Request>& requests,
                             const std::string& sampling, double t_start, const ShardOut* sharded) {
  Config& config = cli.config;
  const int dp = cli.data_parallel_size, tp = config.tensor_parallel_size;
  std::string why;
  const int visible = count_gpus_in_child(why);
  if (visible < dp * tp)
    die("--data-parallel-size %d x --tensor-parallel-size %d needs %d GPUs, but %d %s visible%s%s", dp, tp, dp * tp,
        visible, visible == 1 ? "is" : "are", why.empty() ? "" : ": ", why.c_str());
  const std::vector<std::string> gpus = replica_gpus(dp, tp, visible);
  fprintf(stderr, "nanovllm: data parallel | %d replicas of %d GPU%s each, GPUs %s\n", dp, tp, tp > 1 ? "s" : "",
          [&] { std::string g; for (auto& s : gpus) g += (g.empty() ? "" : " | ") + s; return g; }().c_str());
  fprintf(stderr, "nanovllm: sampling defaults: %s\n", sampling.c_str());
  DPRun run = dp_run(dp, requests, gpus, !cli.trace, [&](ReplicaLink& link) {
    tp_launch(tp);
    replica_signals();  // (tp_launch installed rank 0's own)
    check_gpus(tp);
    ModelRunner runner(config, mc);
    runner.engine_seed = (uint64_t)cli.seed;
    runner.capture_cudagraphs();
    LLMEngine engine(config, runner);
    RunWatcher watcher;
    watcher.progress = false, watcher.trace = cli.trace;
    watcher.label = "[replica " + std::to_string(link.replica) + "] ";
    engine.observer = &watcher;
    engine.tok = &tok;
    replica_serve(link, engine, watcher, requests, startup_line(runner, config, t_start),
                  optimization_notes(runner), config.num_kvcache_blocks,
                  [&](int rows) { return last_logits_xxh64(runner, rows); });
    return tp_shutdown() ? 0 : 1;
  }, [&](const DPRun& ready) {
    fprintf(stderr, "nanovllm: optimizations (Part II): %s%s\n", optimizations_str(config.opt).c_str(),
            ready.notes.c_str());
  });
  return finish_dp(cli, requests, run, gpus, tok, t_start, sharded);
}

#ifndef NANOVLLM_TESTING
int main(int argc, char** argv) {
  double t_start = now_seconds();
  if (argc > 1 && (!strcmp(argv[1], "encode") || !strcmp(argv[1], "decode")))
    return tokenizer_command(argc - 1, argv + 1);
  if (argc > 1 && !strcmp(argv[1], "roofline")) return roofline_command();
  if (argc > 1 && !strcmp(argv[1], "merge")) return merge_command(argc - 1, argv + 1);
  const bool simulate = argc > 1 && !strcmp(argv[1], "simulate");
  Cli cli = parse_args(argc - simulate, argv + simulate, simulate);
  if (simulate) return simulate_command(cli);
  Config& config = cli.config;
  // 1. Everything that can be checked without a GPU (test/cli/cli_errors.sh runs each mistake on a CPU machine).
  ModelConfig mc = load_model_config(config.model);
  validate_config(config, mc);
  validate_checkpoint(config.model, mc);
  const std::string sampling = sampling_defaults_for(cli, mc);
  if (cli.data_parallel_size == 1 && config.tensor_parallel_size == 1) gpu_warmup_start(config, mc);
  Tokenizer tok = Tokenizer::load(config.model);
  if (tok.vocab_size() > mc.vocab_size)
    die("%s has %d tokens, but vocab_size in %s/config.json is %d: the tokenizer is not this model's",
        tok.path.c_str(), tok.vocab_size(), config.model.c_str(), mc.vocab_size);
  std::vector<Request> requests = cli.prompts_path.empty() ? example_requests(tok, cli.prompts)
                                                           : read_prompts(cli.prompts_path, tok, cli.prompts, config, mc);
  if (cli.request_rate > 0) assign_arrivals(requests, cli.request_rate, (uint64_t)cli.seed);
  const int dp = cli.data_parallel_size, tp = config.tensor_parallel_size;
  for (const Request& r : requests)
    if (dp > 1 && r.arrival_given)
      die("%s: \"arrival_time\": --data-parallel-size %d runs an offline batch; requests that arrive over time "
          "model one engine serving traffic: run them with one replica", r.source.c_str(), dp);
  if (!cli.output_path.empty()) check_output_path(cli.output_path);
  if (!cli.report_path.empty()) check_output_path(cli.report_path, "--report", "report.html");
  ShardOut shard;
  const ShardOut* sharded = cli.shard.on() ? &shard : nullptr;
  if (sharded) {
    requests = take_shard(cli, requests, shard);
    if (requests.empty()) {
      gpu_warmup_join();
      return finish_empty_shard(cli, shard);
    }
  }
  // 2. With --data-parallel-size N: N replicas of what follows, each on its own GPUs.
  if (dp > 1) return run_data_parallel(cli, mc, tok, requests, sampling, t_start, sharded);
  // 2. The GPU: weights, KV cache, CUDA graphs. Tensor-parallel workers are forked first: a child process
  //    cannot use CUDA once its parent has (section 45).
  tp_launch(tp);
  check_gpus(tp);
  ModelRunner runner(config, mc);
  runner.engine_seed = (uint64_t)cli.seed;
  gpu_warmup_join();  // (its choices are made by now; capture asks for them)
  runner.capture_cudagraphs();
  fputs(startup_line(runner, config, t_start).c_str(), stderr);
  fprintf(stderr, "nanovllm: optimizations (Part II): %s%s\n", optimizations_str(config.opt).c_str(),
          optimization_notes(runner).c_str());
  fprintf(stderr, "nanovllm: sampling defaults: %s\n", sampling.c_str());
  // 3. Generate. From here the first Ctrl-C stops after the current step and still writes what finished.
  LLMEngine engine(config, runner);
  RunWatcher watcher;
  watcher.trace = cli.trace;
  engine.observer = &watcher;
  engine.tok = &tok;
  RunOutcome run;
  if (!cli.report_path.empty()) watcher.record = &run.steps;
  double t_gen = now_seconds();
  install_stop_handlers();
  g_stop_armed = 1;
  std::vector<Completion> outs = engine.generate(requests);
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  run.title = config.model + " on " + (tp > 1 ? std::to_string(tp) + " x " + prop.name + " (tensor parallel)"
                                               : std::string(prop.name)) +
              ", scheduler " + (config.mixed_scheduler ? "mixed (vLLM V1)" : "nano (nano-vllm)") + ", " +
              std::to_string(requests.size()) + " requests";
  run.stats = watcher.stats, run.sched = engine.scheduler.stats, run.kv_blocks = config.num_kvcache_blocks;
  run.logits_xxh64 = last_logits_xxh64(runner, watcher.stats.last_batch);
  run.first_token_after = t_gen - t_start + watcher.stats.first_token_at;
  int rc = finish_run(cli, requests, outs, tok, run, sharded);
  if (!tp_shutdown()) return 1;
  return rc;
}
#endif
