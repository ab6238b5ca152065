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
//
// Shared conventions of this section:
//   * Every load and store moves 16 bytes (8 bf16) per thread: the widest access a thread can issue, so a
//     warp touches 512 contiguous bytes per instruction. Hence the preconditions "H % 8 == 0" and
//     "pointers 16-byte aligned" (cudaMalloc gives 256-byte alignment; every row length is a multiple of 8).
//   * Math is fp32; a bf16 rounding happens exactly where Hugging Face's Qwen3 rounds (a bf16 tensor is
//     stored), so our activations match the reference bit for bit in the common case.
//   * Zero-sized launches (T == 0) are skipped in the launcher: a grid of 0 blocks is a CUDA error.

constexpr int HEAD_DIM = 128;  // D: every Qwen3 model uses 128, so the kernels below hard-code it

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
__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// Sum over the whole block; every thread gets the result. scratch: 32 floats of shared memory.
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
  if (n % 8 != 0)
    die("%s: %s = %lld must be a multiple of 8 (16-byte vector loads)", kernel, what, (long long)n);
}
static void check_aligned16(const char* kernel, const char* what, const void* p) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0)
    die("%s: pointer %s = %p is not 16-byte aligned", kernel, what, p);
}
// Threads for a block that walks one row of `chunks` 16-byte chunks: one chunk per thread where possible.
static int row_threads(int64_t chunks, int max_threads) {
  return (int)std::min<int64_t>(max_threads, std::max<int64_t>(32, cdiv(chunks, 32) * 32));
}

// ---- embedding -------------------------------------------------------------------------------------
// Replaces: nano-vllm VocabParallelEmbedding.forward: F.embedding(x - vocab_start, shard) with the ids of
//           other shards masked to zero (the all-reduce over the tensor-parallel group then sums shards).
// Reads  ids [T], table [V_local, H] (this rank's rows, vocab ids vocab_start .. vocab_start+V_local-1).
// Writes out [T, H].
// Block = one token; each thread copies 16-byte chunks of the row (or writes zeros for a foreign id).
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
// Block = one row. Each thread keeps up to NORM_MAX_CHUNKS 16-byte chunks of the row in registers, so the
// row is read from memory once: sum of squares -> block reduction -> scale and write.
// out may alias x (a thread reads its chunks before writing the same chunks).
// Preconditions: H % 8 == 0, H <= NORM_THREADS * NORM_MAX_CHUNKS * 8 = 8192 (Qwen3-32B has H = 5120).
constexpr int NORM_THREADS = 256;
constexpr int NORM_MAX_CHUNKS = 4;

template <bool ADD_RESIDUAL>
__global__ __launch_bounds__(NORM_THREADS) void rmsnorm_kernel(bf16* out, bf16* residual, const bf16* x,
                                                               const bf16* w, int H, float eps) {
  __shared__ float scratch[32];
  int64_t row = (int64_t)blockIdx.x * H;
  const uint4* xr = reinterpret_cast<const uint4*>(x + row);
  uint4* rr = ADD_RESIDUAL ? reinterpret_cast<uint4*>(residual + row) : nullptr;
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
      for (int i = 0; i < 8; i++) v[k][i] = round_bf16(v[k][i] + r[i]);
      rr[c] = float_to_bf16x8(v[k]);
    }
#pragma unroll
    for (int i = 0; i < 8; i++) ss += v[k][i] * v[k][i];
  }
  float scale = rsqrtf(block_sum(ss, scratch) / (float)H + eps);
  const uint4* wr = reinterpret_cast<const uint4*>(w);
  uint4* orow = reinterpret_cast<uint4*>(out + row);
#pragma unroll
  for (int k = 0; k < NORM_MAX_CHUNKS; k++) {
    int c = threadIdx.x + k * blockDim.x;
    if (c >= nchunks) break;
    float wf[8], o[8];
    bf16x8_to_float(wr[c], wf);
#pragma unroll
    for (int i = 0; i < 8; i++) o[i] = wf[i] * round_bf16(v[k][i] * scale);
    orow[c] = float_to_bf16x8(o);
  }
}
static void rmsnorm_checks(const char* name, const void* out, const void* x, const void* w, int H) {
  check_vec8(name, "H", H);
  if (H > NORM_THREADS * NORM_MAX_CHUNKS * 8)
    die("%s: H = %d is larger than the %d this kernel keeps in registers; raise NORM_MAX_CHUNKS", name, H,
        NORM_THREADS * NORM_MAX_CHUNKS * 8);
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

// ---- qk_norm_rope ------------------------------------------------------------------------------------
// Replaces (Qwen3Attention.forward, between the qkv projection and attention):
//     q = q_norm(q.view(T, NH, D));  k = k_norm(k.view(T, NKV, D))     # RMSNorm over D, semantics above
//     q, k = rotary_emb(positions, q, k)                               # rotate-half (NeoX) RoPE, full D
// RoPE, as nano-vllm computes it (fp32 math, one bf16 rounding at the end):
//     inv_freq[i] = 1 / theta^(2i/D)  (i < D/2)      angle = float(pos) * inv_freq[i]
//     out[i]       = x[i] * cos(angle) - x[i+D/2] * sin(angle)
//     out[i+D/2]   = x[i+D/2] * cos(angle) + x[i] * sin(angle)
// (Hugging Face rounds cos/sin to bf16 first and rounds after each product; the difference is within
//  bf16 noise and nano-vllm's fp32 path is the more accurate of the two.)
// Reads and writes the q and k heads of qkv [T, (NH + 2*NKV) * D] in place; v heads are untouched.
// Block = one token: its 64 (cos, sin) pairs are computed once into shared memory and shared by all of
// its NH + NKV heads. 8 threads own one head: thread j holds dims [8j, 8j+8) and their RoPE partners
// [64+8j, 64+8j+8), two 16-byte loads; the sum of squares is reduced over the 8 threads with shuffles.
// Why host-computed inv_freq: theta^(2i/D) in float must equal what PyTorch computes at model load; a
// device powf may differ by an ulp, which at position 40000 moves the angle by ~0.003 rad. The table is
// passed by value as a kernel argument (256 bytes), so CUDA graphs capture it too.
// Why sincosf and not __sinf: the fast intrinsics lose all accuracy for angles in the thousands of
// radians, and positions go to 40960. (Never build this file with --use_fast_math.)
constexpr int ROPE_THREADS_PER_HEAD = 8;
struct RopeInvFreq {
  float v[HEAD_DIM / 2];
};

__global__ void qk_norm_rope_kernel(bf16* qkv, const int* positions, const bf16* q_norm_w,
                                    const bf16* k_norm_w, int NH, int NKV, float eps, RopeInvFreq inv_freq) {
  __shared__ float cos_s[HEAD_DIM / 2], sin_s[HEAD_DIM / 2];
  int t = blockIdx.x;
  if (threadIdx.x < HEAD_DIM / 2) {
    float angle = (float)positions[t] * inv_freq.v[threadIdx.x];
    sincosf(angle, &sin_s[threadIdx.x], &cos_s[threadIdx.x]);
  }
  __syncthreads();
  int j = threadIdx.x % ROPE_THREADS_PER_HEAD;  // which 8-dim slice of the head this thread owns
  int heads_per_pass = blockDim.x / ROPE_THREADS_PER_HEAD;
  int nheads = NH + NKV;                         // q heads then k heads: they are contiguous in qkv
  bf16* row = qkv + (int64_t)t * (NH + 2 * NKV) * HEAD_DIM;
  // Every thread runs the same number of passes so the 8-lane shuffles below never see a missing lane.
  for (int base = 0; base < nheads; base += heads_per_pass) {
    int h = base + threadIdx.x / ROPE_THREADS_PER_HEAD;
    bool active = h < nheads;
    uint4* head = reinterpret_cast<uint4*>(row + (int64_t)h * HEAD_DIM);
    float a[8] = {}, b[8] = {};  // a = dims 8j.., b = dims 64+8j..
    if (active) {
      bf16x8_to_float(head[j], a);
      bf16x8_to_float(head[j + 8], b);
    }
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) ss += a[i] * a[i] + b[i] * b[i];
#pragma unroll
    for (int o = 1; o < ROPE_THREADS_PER_HEAD; o <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (!active) continue;
    float scale = rsqrtf(ss / (float)HEAD_DIM + eps);
    const uint4* w = reinterpret_cast<const uint4*>(h < NH ? q_norm_w : k_norm_w);
    float wa[8], wb[8], oa[8], ob[8];
    bf16x8_to_float(w[j], wa);
    bf16x8_to_float(w[j + 8], wb);
#pragma unroll
    for (int i = 0; i < 8; i++) {
      float na = round_bf16(wa[i] * round_bf16(a[i] * scale));  // the normed head, as HF stores it
      float nb = round_bf16(wb[i] * round_bf16(b[i] * scale));
      float c = cos_s[8 * j + i], s = sin_s[8 * j + i];
      oa[i] = na * c - nb * s;
      ob[i] = nb * c + na * s;
    }
    head[j] = float_to_bf16x8(oa);
    head[j + 8] = float_to_bf16x8(ob);
  }
}
void qk_norm_rope(bf16* qkv, const int* positions, const bf16* q_norm_w, const bf16* k_norm_w, int T, int NH,
                  int NKV, float rope_theta, float eps, cudaStream_t stream) {
  // As PyTorch: inv_freq = 1.0 / (theta ** (arange(0, D, 2).float() / D)), every step in float. The pow
  // is evaluated in double and rounded once, i.e. the correctly rounded float of PyTorch's expression.
  // Cached: the launcher runs once per layer per step and theta never changes within a run.
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
  check_aligned16("qk_norm_rope", "qkv", qkv);
  check_aligned16("qk_norm_rope", "q_norm_w", q_norm_w);
  check_aligned16("qk_norm_rope", "k_norm_w", k_norm_w);
  if (T == 0) return;
  int heads = NH + NKV;
  int threads = (int)std::min<int64_t>(512, std::max<int64_t>(HEAD_DIM / 2,
                                           cdiv((int64_t)heads * ROPE_THREADS_PER_HEAD, 32) * 32));
  qk_norm_rope_kernel<<<T, threads, 0, stream>>>(qkv, positions, q_norm_w, k_norm_w, NH, NKV, eps, inv_freq);
  CUDA_CHECK(cudaGetLastError());
}

// ---- store_kvcache -------------------------------------------------------------------------------------
// Replaces: nano-vllm store_kvcache (a Triton kernel): k_cache[slot] = k; v_cache[slot] = v for slot != -1.
// Reads  qkv [T, (NH + 2*NKV) * D] (the k heads start at column NH*D, the v heads at (NH+NKV)*D),
//        slot_mapping [T] (slot = block_id * P + offset; -1 = padding, skip).
// Writes k_cache, v_cache [NB, NKV, P, D]: head h of the token goes to [block_id, h, offset, :].
// Block = one token; its 2 * NKV * 16 chunks of 16 bytes (k then v, 256 chunks for NKV = 8) are spread
// over the threads. Each head is 256 contiguous bytes on both sides, so every access is a full sector.
// 64-bit offsets: one layer's cache can exceed 2^31 elements on an 80 GB GPU.
__global__ void store_kvcache_kernel(bf16* k_cache, bf16* v_cache, const bf16* qkv, const int* slot_mapping,
                                     int NH, int NKV, int P) {
  int t = blockIdx.x;
  int slot = slot_mapping[t];
  if (slot < 0) return;
  int64_t block = slot / P, offset = slot % P;
  constexpr int CHUNKS_PER_HEAD = HEAD_DIM / 8;
  int per_tensor = NKV * CHUNKS_PER_HEAD;
  const bf16* row = qkv + (int64_t)t * (NH + 2 * NKV) * HEAD_DIM;
  for (int c = threadIdx.x; c < 2 * per_tensor; c += blockDim.x) {
    int is_v = c >= per_tensor;
    int h = (c - is_v * per_tensor) / CHUNKS_PER_HEAD, chunk = c % CHUNKS_PER_HEAD;
    const uint4* src = reinterpret_cast<const uint4*>(row + (int64_t)(NH + is_v * NKV + h) * HEAD_DIM);
    bf16* cache = is_v ? v_cache : k_cache;
    uint4* dst = reinterpret_cast<uint4*>(cache + ((block * NKV + h) * P + offset) * HEAD_DIM);
    dst[chunk] = src[chunk];
  }
}
void store_kvcache(bf16* k_cache, bf16* v_cache, const bf16* qkv, const int* slot_mapping, int T, int NH,
                   int NKV, int P, cudaStream_t stream) {
  check_aligned16("store_kvcache", "k_cache", k_cache);
  check_aligned16("store_kvcache", "v_cache", v_cache);
  check_aligned16("store_kvcache", "qkv", qkv);
  if (P <= 0) die("store_kvcache: block size P = %d must be positive", P);
  if (T == 0) return;
  int threads = row_threads(2 * NKV * HEAD_DIM / 8, 256);
  store_kvcache_kernel<<<T, threads, 0, stream>>>(k_cache, v_cache, qkv, slot_mapping, NH, NKV, P);
  CUDA_CHECK(cudaGetLastError());
}

// ---- silu_and_mul --------------------------------------------------------------------------------------
// Replaces: nano-vllm SiluAndMul: x, y = gate_up.chunk(2, -1); return F.silu(x) * y
// computed as out = bf16(silu(g) * u) in fp32, silu(g) = g / (1 + exp(-g)).
// Reads gate_up [T, 2I] (gate in columns [0, I), up in [I, 2I)). Writes out [T, I].
// One thread = one 16-byte chunk of out (8 outputs), a flat grid over T * I / 8 chunks.
// Precondition: I % 8 == 0 (true for every Qwen3 size divided by any tensor-parallel degree up to 8).
__global__ void silu_and_mul_kernel(bf16* out, const bf16* gate_up, int64_t total_chunks, int I) {
  int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= total_chunks) return;
  int64_t t = c / (I / 8), chunk = c % (I / 8);
  const uint4* gate = reinterpret_cast<const uint4*>(gate_up + t * 2 * I);
  const uint4* up = reinterpret_cast<const uint4*>(gate_up + t * 2 * I + I);
  float g[8], u[8], o[8];
  bf16x8_to_float(gate[chunk], g);
  bf16x8_to_float(up[chunk], u);
#pragma unroll
  for (int i = 0; i < 8; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
  reinterpret_cast<uint4*>(out + t * I)[chunk] = float_to_bf16x8(o);
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
// Reads x [T, H], cu_seqlens_q [B + 1]. Writes out [B, H]. Block = one sequence, 16-byte chunks.
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

// (end of 5a)
//
//
// ---- 5b. Paged attention: prefill (tensor cores, online softmax) and decode (split-K) -------------------


// (end of 5b)
//
//
// ---- 5c. Sampling: greedy, temperature (Gumbel-max with Philox), top-k, top-p ---------------------------
//
// What the sampler computes, per sequence b (one row of logits [V], fp32):
//   temperature == 0            greedy: the argmax (lowest index on ties)
//   otherwise                   a draw from softmax(logits / temperature), optionally restricted:
//     top_k in (0, V)           ... to the k largest logits                     (keep set S_k)
//     top_p in (0, 1)           ... then to the smallest set of the most likely tokens of S_k whose
//                                   probability (renormalised over S_k) sums to >= top_p   (S_p)
//   Both filters are applied in Hugging Face's order: top-k first, then top-p on what is left.
//
// The Gumbel-max trick. nano-vllm samples with
//     probs = softmax(logits / T);  token = argmax(probs / Exponential(1) noise)
// which is an exact categorical draw in one pass, without a cumulative sum. Taking logs, dividing by
// E_i ~ Exp(1) is adding G_i = -log(E_i) = -log(-log U_i), a standard Gumbel variable, and the softmax
// normalisation is a constant shift that cannot change an argmax:
//     token = argmax_i ( logit_i / T + G_i )       P(token = i) = exp(logit_i/T) / sum_j exp(logit_j/T)
// so sampling costs one read of the row, no exp, no sum and no max-subtraction. Restricting the draw
// to a kept set S is the same argmax taken over S only (renormalising a distribution does not change
// the ratios between the kept tokens).
//
// Where the noise comes from: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
// 3", SC 2011), a counter-based generator: 10 rounds of multiply-and-xor scramble a 128-bit counter
// under a 64-bit key into 4 random 32-bit words. No state is stored anywhere; the noise of token i is a
// pure function of (seed, offset, i):
//     key = seed,  counter = (i / 4, 0, offset_lo, offset_hi),  word i % 4 of the output
// The engine sets seed per request and offset = that request's step index, so a request's draws do not
// depend on which batch it ran in, on its row in the batch, or on the other requests' settings.
//
// Finding the kept set without sorting V = 151,936 logits: a radix select. Map each float z to a 32-bit
// key whose unsigned order is the float order (flip all bits of negatives, set the sign bit of
// positives). The threshold key (the smallest kept key) is then found digit by digit, most significant
// first (digits of 11, 11 and 10 bits): histogram the keys that still match the digits chosen so far,
// walk the 2048 bins from the top accumulating counts (top-k: until k is reached) or probability mass
// (top-p: until top_p of the mass is reached), and the bin where the walk stops is the next digit.
// Three passes give the exact threshold; a pass stops early when its bin must be kept whole. The kept
// set is "key >= threshold": tokens whose value equals the threshold are all kept, so a tie at the
// cut-off can keep a few more than k tokens (or a little more mass than top_p).
//
// Probability mass is accumulated in fixed point: w_i = exp(z_i - m) scaled by 2^32 and rounded to an
// integer (m = the row max, so each w_i <= 2^32). Integer atomics add in any order to the same sum, so
// the chosen threshold, and hence the sampled token, is deterministic run to run; floating-point
// atomics would not be. Terms below 2^-32 of the top token count as zero mass (a relative error below
// V * 2^-32 < 4e-5). A histogram bin keeps w in three 32-bit counters of 11-bit pieces (w & 2047,
// (w >> 11) & 2047, w >> 22), each of which cannot overflow for V < 2 million: 64-bit shared-memory
// atomics were measured 9x slower under a histogram's contention (most tokens land in a few bins).
//
// Keeping it cheap: after the first histogram pass over the row, only tokens at or above the first
// digit's bin can be kept. One more pass copies those candidates (key and index) into shared memory;
// the remaining digits, the top-p selection and the final Gumbel argmax then run on that short list.
// A filtered row therefore reads its logits 2 times (top-k) or 3 times (top-p alone: one more pass for
// the row max that the probabilities need). If more than SAMPLE_LIST_CAP tokens survive (a nucleus of
// tens of thousands of tokens, e.g. top_p = 0.95 over near-flat logits), the later passes read the row
// from memory again instead: slower, same result.
// Measured on an H200, V = 151,936, logits ~ N(0, 2), T = 0.6 (test/gpu_kernels.cu, bench_sampler):
//   B = 256: greedy 45 us, temperature 105 us, top-k 50 98 us, top-p 0.9 227 us, both 114 us
//   B = 1:   greedy 8 us, temperature 8 us, top-k 50 41 us, top-p 0.9 104 us
// The temperature path is bound by arithmetic (Philox and two logs per token), not by memory.
//
// Grid: (splits, B) blocks of SAMPLE_THREADS. A row without filters (greedy or plain temperature) is cut
// into `splits` contiguous pieces, each block writing the best (value, index) of its piece to the
// workspace; sample_finish_kernel then takes the best piece per row. Splitting matters for small batches:
// one block per row would leave all but B SMs idle. A filtered row is handled whole by its split-0 block.
// Value and index travel packed in one 64-bit word, (order_key(value) << 32) | ~index, so "max of the
// packed words" is "largest value, then lowest index": one integer max per comparison, ties resolved the
// same way on every path.
//
// NaN logits never win and are never kept (they are treated as -inf). A temperature <= 0 means greedy.

struct SamplingSlot {                // one per sequence in the step (device array [B])
  float temperature;                 // 0 = greedy
  int top_k;                         // <= 0 or >= V: off
  float top_p;                       // >= 1: off
  uint32_t pad;
  unsigned long long seed;           // Philox key: one per request
  unsigned long long offset;         // Philox counter high half: the request's step index
};
static_assert(sizeof(SamplingSlot) == 32, "SamplingSlot is copied to the GPU as-is");

constexpr int SAMPLE_THREADS = 1024;
constexpr int SAMPLE_MAX_SPLITS = 32;
constexpr int SAMPLE_LIST_CAP = 8192;   // candidates kept in shared memory (64 KiB)
constexpr int RADIX_BINS = 2048;        // 11-bit digits

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
// The value every path compares: logit / T, computed as logit * (1/T) (one rounding, identical on the
// CPU reference), with NaN -> -inf and -0 -> +0 (adding +0.0f), so that equal values have equal keys.
__host__ __device__ inline float scaled_logit(float logit, float inv_temp) {
  float z = logit * inv_temp + 0.0f;
  return z != z ? -INFINITY : z;
}
// (value, index) -> one word whose unsigned max is "largest value, then lowest index". 0 means "nothing".
__host__ __device__ inline unsigned long long pack_candidate(float value, uint32_t index) {
  return ((unsigned long long)float_order_key(value) << 32) | (uint32_t)~index;
}
// Probability mass of a token relative to the row max m, in units of 2^-32 (see the fixed-point note).
__device__ inline unsigned long long fixed_mass(float z, float m) {
  return z == m ? (1ull << 32) : (unsigned long long)__float2ull_rn(expf(z - m) * 4294967296.0f);
}

// Shared memory of one sampler block (dynamic: 96 KiB, under the 99 KiB opt-in limit of sm_86/sm_89).
struct SampleSmem {
  unsigned int count[RADIX_BINS];        // histogram: tokens per bin
  unsigned int mass[3][RADIX_BINS];      // histogram: fixed-point mass per bin, in 11-bit pieces
  uint32_t list_key[SAMPLE_LIST_CAP];    // the candidate list: order keys of z ...
  uint32_t list_idx[SAMPLE_LIST_CAP];    // ... and token indices
  unsigned long long red[32];            // one slot per warp for block reductions
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

// Max over the block; every thread gets the result.
__device__ unsigned long long block_max_u64(unsigned long long v, SampleSmem& s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();  // s.red may still be read by an earlier reduction
  if (threadIdx.x % 32 == 0) s.red[threadIdx.x / 32] = v;
  __syncthreads();
  for (int w = 0; w < SAMPLE_THREADS / 32; w++) v = max(v, s.red[w]);
  return v;
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
__global__ __launch_bounds__(SAMPLE_THREADS, 1) void sample_kernel(unsigned long long* partial,
                                                                   const float* logits,
                                                                   const SamplingSlot* slots, int V) {
  extern __shared__ __align__(16) unsigned char sample_smem_raw[];
  SampleSmem& s = *reinterpret_cast<SampleSmem*>(sample_smem_raw);
  int b = blockIdx.y, split = blockIdx.x, splits = gridDim.x;
  const float* row = logits + (int64_t)b * V;
  SamplingSlot slot = slots[b];
  bool greedy = !(slot.temperature > 0.f);
  bool use_top_k = !greedy && slot.top_k > 0 && slot.top_k < V;
  bool use_top_p = !greedy && slot.top_p < 1.f;
  float inv_temp = greedy ? 1.f : 1.f / slot.temperature;
  unsigned long long best = 0;

  if (!use_top_k && !use_top_p) {
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
    best = block_max_u64(best, s);
    if (threadIdx.x == 0) partial[(int64_t)b * splits + split] = best;
    return;
  }

  if (split != 0) {  // a filtered row belongs to its first block alone
    if (threadIdx.x == 0) partial[(int64_t)b * splits + split] = 0;
    return;
  }
  Candidates whole_row{row, V, inv_temp, 0u, nullptr, 0};
  RadixSelect k_sel, p_sel;
  float m = 0.f;  // row max of z: the reference point of the probability masses
  uint32_t lo;    // every token that can be kept has key >= lo
  if (use_top_k) {
    k_sel.target = (unsigned long long)slot.top_k;
    radix_step(k_sel, whole_row, 0u, false, 0.f, 0.f, s);
    lo = k_sel.prefix;
  } else {
    unsigned long long mk = 0;
    whole_row.for_each([&](uint32_t key, int) { mk = max(mk, (unsigned long long)key); });
    m = float_from_order_key((uint32_t)block_max_u64(mk, s));
    radix_step(p_sel, whole_row, 0u, true, slot.top_p, m, s);
    lo = p_sel.prefix;
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
  }
  if (use_top_p) {
    if (use_top_k) {  // a fresh select over S_k; its first histogram's total is S_k's mass
      unsigned long long mk = 0;
      cands.for_each([&](uint32_t key, int) { mk = max(mk, (unsigned long long)key); });
      m = float_from_order_key((uint32_t)block_max_u64(mk, s));
    }
    while (!p_sel.done) radix_step(p_sel, cands, threshold, true, slot.top_p, m, s);
    // A whole-bin stop leaves p_sel.prefix at the bin's lower edge, which may lie below the top-k cut.
    threshold = max(threshold, p_sel.prefix);
  }
  cands.for_each([&](uint32_t key, int i) {
    if (key >= threshold)
      best = max(best, pack_candidate(float_from_order_key(key) + gumbel_noise(slot.seed, slot.offset, i),
                                      (uint32_t)i));
  });
  best = block_max_u64(best, s);
  if (threadIdx.x == 0) partial[(int64_t)b * splits] = best;
}

// Reads partial [B, splits]; writes out_tokens [B]: the index packed in the best piece of each row.
__global__ void sample_finish_kernel(int* out_tokens, const unsigned long long* partial, int B, int splits) {
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
void sample(int* out_tokens, const float* logits, const SamplingSlot* slots, int B, int V,
            void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (workspace_bytes < sample_workspace_bytes(B, V))
    die("sample: workspace of %zu bytes, need sample_workspace_bytes(%d, %d) = %zu", workspace_bytes, B, V,
        sample_workspace_bytes(B, V));
  if (V <= 0 || V >= 2000000) die("sample: V = %d outside 1 .. 2,000,000 (the mass counters' range)", V);
  check_aligned16("sample", "logits", logits);
  if (B == 0) return;
  static int num_sms = 0;  // once per process (each tensor-parallel rank is its own process)
  if (num_sms == 0) {
    int dev;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev));
    CUDA_CHECK(cudaFuncSetAttribute(sample_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)sizeof(SampleSmem)));
  }
  // Enough pieces to give every SM a block, but at least ~4 logits per thread per piece.
  int splits = std::max(1, std::min(num_sms / B, SAMPLE_MAX_SPLITS));
  splits = std::max(1, std::min<int>(splits, (int)cdiv(V, 4 * SAMPLE_THREADS)));
  auto* partial = static_cast<unsigned long long*>(workspace);
  sample_kernel<<<dim3(splits, B), SAMPLE_THREADS, sizeof(SampleSmem), stream>>>(partial, logits, slots, V);
  CUDA_CHECK(cudaGetLastError());
  sample_finish_kernel<<<(unsigned)cdiv(B, 128), 128, 0, stream>>>(out_tokens, partial, B, splits);
  CUDA_CHECK(cudaGetLastError());
}

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
  (void)argc;
  (void)argv;
  return 0;
}
#endif
