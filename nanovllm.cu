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

// ==== 3. Weights: safetensors -> GPU, fused q/k/v and gate/up =========================================

// ==== 4. The KV cache layout ==========================================================================

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

// ==== 7. The Qwen3 forward pass =======================================================================

// ==== 8. Sequence =====================================================================================

// ==== 9. BlockManager: paged KV blocks and prefix caching =============================================

// ==== 10. Scheduler: continuous batching, chunked prefill, preemption =================================

// ==== 11. ModelRunner: step inputs, CUDA graphs, sampling =============================================

// ==== 12. LLMEngine: add_request, step, generate ======================================================

// ==== 13. Prompts in, completions out =================================================================

// ==== 14. Command line and main =======================================================================

#ifndef NANOVLLM_TESTING
int main(int argc, char** argv) {
  if (argc > 1 && (!strcmp(argv[1], "encode") || !strcmp(argv[1], "decode")))
    return tokenizer_command(argc - 1, argv + 1);
  return 0;
}
#endif
