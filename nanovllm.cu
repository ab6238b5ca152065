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
//
// What attention sees of the paged KV cache (section 4 allocates it; store_kvcache in 5a fills it):
//   k_cache, v_cache   bf16 [NB, NKV, P, D] per layer: block, then kv head, then token in block, then dim.
//                      One (block, kv head) tile is P*D contiguous bf16 (P * 256 bytes), so the keys of one
//                      head inside one block are a single contiguous run, the unit every kernel streams.
//   block_tables       int [B, MB]: token j of sequence b lives in block block_tables[b*MB + j/P] at offset
//                      j%P (its slot is block*P + offset). Entries past the sequence's last block are -1.
//   qkv                bf16 [T, (NH + 2*NKV)*D]: per token the NH q heads, then the NKV k heads, then v.
// By the time attention runs, store_kvcache has already written this step's k and v into their slots, so
// attention reads every key, cached prefix and new ones alike, through the block table, and reads only q
// from qkv. That is why prefix-cache hits and chunked prefill need no special case here.
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

constexpr int HEAD_DIM = 128;          // D for every Qwen3 model; both kernels are written for exactly this
constexpr int ATTN_KV_TILE = 64;       // keys per shared-memory tile (K and V each: 64 x 128 bf16 = 16 KiB)
constexpr int ATTN_STAGES = 2;         // K/V tiles in shared memory: tile t+1 loads while tile t computes
                                       // (3 stages measured 1-3% slower: fewer CTAs fit per SM)
constexpr int PREFILL_WARPS = 8;       // warps of one prefill CTA, 16 query rows each
constexpr int PREFILL_BLOCK_M = 16 * PREFILL_WARPS;  // query rows of one prefill CTA
constexpr int DECODE_WARPS = 4;        // warps of one decode CTA, 16 keys of every tile each
constexpr int DECODE_PARTITION = 512;  // keys per decode CTA: the split-K partition size (256 measured
                                       // equal at B=128 and 3-6% slower at B=131 mixed and B=256)
constexpr int DECODE_ROWS = 16;        // MMA rows in decode: the query heads of one GQA group, padded to 16
static_assert(DECODE_WARPS * 32 == HEAD_DIM, "the decode epilogue gives each thread one output dim");
static_assert(DECODE_WARPS * 16 == ATTN_KV_TILE, "decode warps split each tile 16 keys apiece");
static_assert(DECODE_PARTITION % ATTN_KV_TILE == 0, "partitions are made of whole tiles");

// A shared-memory tile row is HEAD_DIM bf16 = 256 bytes = 16 chunks of 16 bytes. ldmatrix reads one chunk
// column of 8 consecutive rows at once; stored plainly those 8 chunks are 256 bytes apart, all in the same
// 4 banks (an 8-way conflict). XOR-ing the chunk index with row % 8 puts them in 8 different bank groups.
// Writers (cp.async) and readers (ldmatrix) both go through this function, so they agree.
__device__ __forceinline__ int attn_smem_index(int row, int chunk) {
  return row * HEAD_DIM + ((chunk ^ (row & 7)) << 3);
}

// 16-byte asynchronous copy global -> shared. With valid = false it reads nothing (source size 0) and
// writes 16 zero bytes; gmem must still be a legal address, callers pass the buffer's base. .cg skips L1
// (each byte is used once per CTA); the L2::128B prefetch hint measured about 1% faster decode on H200.
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

// 2^x in one instruction (MUFU.EX2, relative error ~2^-22); 2^-inf = 0, which the masking relies on.
// The softmax works in base 2: exp(s*scale - m*scale) = 2^(s*scale*log2(e) - m*scale*log2(e)).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Issue (not wait for) the copies of keys [key0, key0 + ATTN_KV_TILE) of kv head kvh of one sequence into
// the K and V tiles sK, sV [ATTN_KV_TILE][HEAD_DIM] (swizzled). Keys at or past key_end are zero-filled
// instead of read: their block-table entries are -1, and the unused tail of a sequence's last block holds
// stale or never-written data; a NaN there would survive the softmax mask as 0 * NaN in P V.
// All NTHREADS threads of the CTA call it: 16 threads copy one 256-byte row.
template <int NTHREADS>
__device__ __forceinline__ void load_kv_tile(bf16* sK, bf16* sV, const bf16* k_cache, const bf16* v_cache,
                                             const int* block_table /* [MB] */, int kvh, int NKV, int log2P,
                                             int key0, int key_end) {
  const int chunk = threadIdx.x & 15;
#pragma unroll
  for (int r = threadIdx.x >> 4; r < ATTN_KV_TILE; r += NTHREADS / 16) {
    const int key = key0 + r;
    const bool valid = key < key_end;
    size_t offset = 0;
    if (valid) {
      const size_t block = block_table[key >> log2P];
      const size_t row = ((block * NKV + kvh) << log2P) + (key & ((1 << log2P) - 1));
      offset = row * HEAD_DIM + chunk * 8;
    }
    cp_async_16(sK + attn_smem_index(r, chunk), k_cache + offset, valid);
    cp_async_16(sV + attn_smem_index(r, chunk), v_cache + offset, valid);
  }
}

// One warp's share of one K/V tile, the heart of both kernels:
//   S = Q K^T over NKEYS keys (tile rows row0 .. row0+NKEYS-1, absolute key numbers key0 ..), scores of keys
//   past a row's last_key set to -inf (only when need_mask), then the online-softmax update of the row max
//   m and row sum l, rescaling of O, and O += P V.
// q: the warp's 16 query rows as A fragments, one per 16-dim slice. o: [16 row x 128 dim] accumulator as
// 16 fragments of 8 dims. m, l, last_key: this lane's two rows (lane/4 and lane/4 + 8). m is kept in raw
// score units; l is this lane's partial sum over its own columns (the quad adds them up at the very end,
// which is valid because all four lanes of a row always rescale by the same factor).
template <int NKEYS>
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
      mma_bf16_16816(s[2 * j], q[kk], b[0], b[1]);
      mma_bf16_16816(s[2 * j + 1], q[kk], b[2], b[3]);
    }
  }

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

  // O += P V. The accumulator layout of S is the A-fragment layout of P (two 8-key column groups make
  // one 16-key k-slice), so P goes from registers to the MMA without shared memory. V needs .trans.
#pragma unroll
  for (int kt = 0; kt < NKEYS / 16; kt++) {
    const uint32_t p[4] = {pack_bf16x2(s[2 * kt][0], s[2 * kt][1]), pack_bf16x2(s[2 * kt][2], s[2 * kt][3]),
                           pack_bf16x2(s[2 * kt + 1][0], s[2 * kt + 1][1]),
                           pack_bf16x2(s[2 * kt + 1][2], s[2 * kt + 1][3])};
#pragma unroll
    for (int dt = 0; dt < HEAD_DIM / 16; dt++) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, sV + attn_smem_index(row0 + kt * 16 + (lane & 15), 2 * dt + (lane >> 4)));
      mma_bf16_16816(o[2 * dt], p, b[0], b[1]);
      mma_bf16_16816(o[2 * dt + 1], p, b[2], b[3]);
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

// attention_prefill_kernel — causal attention of a variable-length batch over the paged cache.
//   Replaces: flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, ..., causal=True,
//             block_table=block_tables) in nano-vllm's Attention.forward (prefill branch).
//   out[t, h*D + d] = sum_j softmax_j(scale * q[t,h] . k[j,kvh]) v[j,kvh,d] over j = 0 .. pos(t),
//   kvh = h / (NH/NKV),
//   where query i of sequence b (row t = cu_seqlens_q[b] + i) sits at pos = seqlens_k[b] - q_len + i:
//   with a cached prefix (prefix-cache hit or an earlier chunk) the queries are the last q_len positions.
//   Reads qkv (q part), k_cache, v_cache, block_tables; writes out bf16 [T, NH*D].
//   One CTA: query rows m0 .. m0+127 of sequence b for query head h; warp w owns rows m0+16w .. +15.
//   Eight warps share each K/V tile, so a tile loaded into shared memory serves 128 queries (measured
//   on H200: 214 TFLOP/s against 196 with four warps and 64 rows).
//   grid = (NH, cdiv(max_seqlen_q, PREFILL_BLOCK_M), B). Heads are the fastest grid index so that the
//   NH/NKV CTAs that read the same K/V run together and share it through L2. Query tiles run last-to-first:
//   under the causal mask the last tile of a sequence has the most keys, and starting the long CTAs first
//   keeps the tail of the launch short. CTAs past their sequence's q_len exit at once.
//   Preconditions: 1 <= q_len <= seqlens_k[b] for every sequence; NH % NKV == 0; P a power of two.
__global__ void __launch_bounds__(PREFILL_WARPS * 32)
    attention_prefill_kernel(bf16* __restrict__ out, const bf16* __restrict__ qkv,
                             const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
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
  constexpr int TILE = ATTN_KV_TILE * HEAD_DIM;

  // Q rows past q_len are zero-filled: they belong to the next sequence or lie past the end of qkv.
  for (int i = threadIdx.x; i < PREFILL_BLOCK_M * 16; i += PREFILL_WARPS * 32) {
    const int r = i >> 4, c = i & 15;
    const bool valid = m0 + r < q_len;
    const bf16* src = qkv + (size_t)(q_start + m0 + r) * qkv_stride + h * HEAD_DIM + c * 8;
    cp_async_16(sQ + attn_smem_index(r, c), valid ? src : qkv, valid);
  }
  cp_async_commit();
  for (int t = 0; t < ATTN_STAGES - 1; t++) {
    if (t < n_tiles)
      load_kv_tile<PREFILL_WARPS * 32>(sK + t * TILE, sV + t * TILE, k_cache, v_cache, block_table, kvh, NKV,
                                       log2P, t * ATTN_KV_TILE, kv_len);
    cp_async_commit();
  }
  cp_async_wait<ATTN_STAGES - 1>();  // the Q group is complete
  __syncthreads();
  uint32_t q[HEAD_DIM / 16][4];
  load_q_fragments(q, sQ, warp * 16);

  float o[HEAD_DIM / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int warp_pos0 = pos0 + warp * 16;  // position of the warp's first row
  const int last_key[2] = {warp_pos0 + lane / 4, warp_pos0 + lane / 4 + 8};
  const bool warp_has_rows = m0 + warp * 16 < q_len;

  for (int t = 0; t < n_tiles; t++) {
    // Prefetch the tile ATTN_STAGES-1 ahead into the stage computed last iteration (freed by the
    // __syncthreads that ended it). An empty commit at the end keeps the group count uniform.
    const int ahead = t + ATTN_STAGES - 1;
    if (ahead < n_tiles) {
      const int stage = ahead % ATTN_STAGES;
      load_kv_tile<PREFILL_WARPS * 32>(sK + stage * TILE, sV + stage * TILE, k_cache, v_cache, block_table,
                                       kvh, NKV, log2P, ahead * ATTN_KV_TILE, kv_len);
    }
    cp_async_commit();
    cp_async_wait<ATTN_STAGES - 1>();  // tile t has landed (for this thread) ...
    __syncthreads();                   // ... and for every thread
    const int key0 = t * ATTN_KV_TILE;
    // Only tiles that cross the diagonal need the mask; a warp whose rows all precede the tile skips it.
    if (warp_has_rows && key0 <= warp_pos0 + 15)
      attend_kv_slice<ATTN_KV_TILE>(q, sK + (t % ATTN_STAGES) * TILE, sV + (t % ATTN_STAGES) * TILE, 0, key0,
                                    key0 + ATTN_KV_TILE - 1 > warp_pos0, last_key, scale_log2, o, m, l);
    __syncthreads();
  }

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

// Launchers check what the kernels assume; a violation is a bug in the caller (ModelRunner), not a user
// error.
static void check_attention_shapes(const char* who, int NH, int NKV, int P) {
  if (NKV <= 0 || NH % NKV != 0) die("%s: NH=%d is not a multiple of NKV=%d", who, NH, NKV);
  if (P < 16 || P > 256 || (P & (P - 1)) != 0)
    die("%s: block size P=%d must be a power of two in 16..256", who, P);
}

// out: bf16 [T, NH*D]; qkv: bf16 [T, (NH+2NKV)*D]; k_cache, v_cache: bf16 [NB, NKV, P, D];
// cu_seqlens_q: int [B+1] (device); seqlens_k: int [B] (device, keys of sequence b including this step's);
// block_tables: int [B, MB] (device); max_seqlen_q: the largest q_len (host). scale = 1/sqrt(D).
static void attention_prefill(bf16* out, const bf16* qkv, const bf16* k_cache, const bf16* v_cache,
                              const int* cu_seqlens_q, const int* seqlens_k, const int* block_tables, int B,
                              int max_seqlen_q, int NH, int NKV, int P, int MB, float scale,
                              cudaStream_t stream) {
  check_attention_shapes("attention_prefill", NH, NKV, P);
  if (B == 0 || max_seqlen_q == 0) return;
  const size_t smem = (PREFILL_BLOCK_M + 2 * ATTN_STAGES * ATTN_KV_TILE) * HEAD_DIM * sizeof(bf16);  // 96 KiB
  // More than the default 48 KiB of shared memory must be asked for; cheap, and legal during graph capture.
  CUDA_CHECK(cudaFuncSetAttribute(attention_prefill_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  (int)smem));
  dim3 grid(NH, cdiv(max_seqlen_q, PREFILL_BLOCK_M), B);
  attention_prefill_kernel<<<grid, PREFILL_WARPS * 32, smem, stream>>>(
      out, qkv, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_tables, NH, NKV, __builtin_ctz(P), MB,
      scale * (float)M_LOG2E);
  CUDA_CHECK(cudaGetLastError());
}

// attention_decode_kernel — one new token per sequence attends to its whole context (split-K, phase 1).
//   Replaces: flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context_lens,
//             block_table=block_tables, causal=True) in nano-vllm's Attention.forward (decode branch).
//   out[b, h*D + d] = sum_j softmax_j(scale * q_b,h . k_j) v_j[d] over j = 0 .. context_lens[b]-1.
//   Split-K: CTA (part, kvh, b) handles keys [part*512, min(part*512 + 512, ctx)) for the NH/NKV query heads
//   of kv head kvh, so each K/V tile is read from memory exactly once. Warp w takes keys 16w .. 16w+15 of
//   every 64-key tile; at the end the four warps' (m, l, O) are combined through shared memory.
//   If the context fits in one partition the CTA writes the final bf16 output; otherwise it writes its
//   unnormalised O and (m, l) to the workspace and attention_decode_merge_kernel combines them.
//   Why a grid sized by max_context_len (a host bound) and not by the real contexts: a CUDA graph captured
//   once must stay valid as contexts grow; CTAs whose partition starts past context_lens[b] exit at once.
//   Workspace: ws_o float [B, NH, max_parts, D], ws_ml float [B, NH, max_parts, 2] = (m * scale*log2e, l).
//   Measured on H200 (B=128, ctx 1024, Qwen3-0.6B heads): 3.75 TB/s of K/V read, about 88% of the copy
//   bandwidth (4.26 TB/s); early-exit CTAs of a max_context_len=4096 grid cost nothing measurable.
//   Preconditions: 1 <= context_lens[b] <= max_context_len; NH/NKV <= 16.
__global__ void __launch_bounds__(DECODE_WARPS * 32)
    attention_decode_kernel(bf16* __restrict__ out, const bf16* __restrict__ qkv,
                            const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                            const int* __restrict__ context_lens, const int* __restrict__ block_tables,
                            int NH, int NKV, int log2P, int MB, int max_parts, float* __restrict__ ws_o,
                            float* __restrict__ ws_ml, float scale_log2) {
  const int part = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int ctx = context_lens[b];
  const int key_begin = part * DECODE_PARTITION;
  if (key_begin >= ctx) return;
  const int key_end = min(ctx, key_begin + DECODE_PARTITION);
  const int n_tiles = cdiv_dev(key_end - key_begin, ATTN_KV_TILE);
  const int group = NH / NKV;  // query heads kvh*group .. kvh*group + group-1 share this kv head
  const int* block_table = block_tables + (size_t)b * MB;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  extern __shared__ __align__(16) unsigned char attn_smem[];
  bf16* sQ = reinterpret_cast<bf16*>(attn_smem);              // [DECODE_ROWS][D]
  bf16* sK = sQ + DECODE_ROWS * HEAD_DIM;                     // [ATTN_STAGES][ATTN_KV_TILE][D]
  bf16* sV = sK + ATTN_STAGES * ATTN_KV_TILE * HEAD_DIM;      // [ATTN_STAGES][ATTN_KV_TILE][D]
  constexpr int TILE = ATTN_KV_TILE * HEAD_DIM;

  // Row g of the Q tile is query head kvh*group + g of token b: the group's heads are adjacent in qkv.
  const bf16* q_src = qkv + (size_t)b * (NH + 2 * NKV) * HEAD_DIM + (size_t)kvh * group * HEAD_DIM;
  for (int i = threadIdx.x; i < DECODE_ROWS * 16; i += DECODE_WARPS * 32) {
    const int r = i >> 4, c = i & 15;
    cp_async_16(sQ + attn_smem_index(r, c), r < group ? q_src + r * HEAD_DIM + c * 8 : qkv, r < group);
  }
  cp_async_commit();
  for (int t = 0; t < ATTN_STAGES - 1; t++) {
    if (t < n_tiles)
      load_kv_tile<DECODE_WARPS * 32>(sK + t * TILE, sV + t * TILE, k_cache, v_cache, block_table, kvh, NKV,
                                      log2P, key_begin + t * ATTN_KV_TILE, key_end);
    cp_async_commit();
  }
  cp_async_wait<ATTN_STAGES - 1>();
  __syncthreads();
  uint32_t q[HEAD_DIM / 16][4];
  load_q_fragments(q, sQ, 0);  // every warp holds the same 16 rows (the group's heads)

  float o[HEAD_DIM / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int last_key[2] = {key_end - 1, key_end - 1};  // no causal mask within the context: only its end

  for (int t = 0; t < n_tiles; t++) {  // same pipeline as the prefill loop
    const int ahead = t + ATTN_STAGES - 1;
    if (ahead < n_tiles) {
      const int stage = ahead % ATTN_STAGES;
      load_kv_tile<DECODE_WARPS * 32>(sK + stage * TILE, sV + stage * TILE, k_cache, v_cache, block_table,
                                      kvh, NKV, log2P, key_begin + ahead * ATTN_KV_TILE, key_end);
    }
    cp_async_commit();
    cp_async_wait<ATTN_STAGES - 1>();
    __syncthreads();
    const int key0 = key_begin + t * ATTN_KV_TILE + warp * 16;
    if (key0 < key_end)
      attend_kv_slice<16>(q, sK + (t % ATTN_STAGES) * TILE, sV + (t % ATTN_STAGES) * TILE, warp * 16, key0,
                          key0 + 16 > key_end, last_key, scale_log2, o, m, l);
    __syncthreads();
  }

  // Combine the warps. Their O, m, l go to shared memory (reusing the K/V stages: every copy has
  // landed and every warp is past the loop's last barrier), then thread d computes output dim d.
  float* sO = reinterpret_cast<float*>(sK);                 // [DECODE_WARPS][DECODE_ROWS][D]
  float* sML = sO + DECODE_WARPS * DECODE_ROWS * HEAD_DIM;  // [DECODE_WARPS][DECODE_ROWS][2]
  static_assert((DECODE_WARPS * DECODE_ROWS * (HEAD_DIM + 2)) * sizeof(float) <=
                    2 * ATTN_STAGES * ATTN_KV_TILE * HEAD_DIM * sizeof(bf16),
                "the combine buffers fit in the K/V stages");
#pragma unroll
  for (int i = 0; i < 2; i++) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    const int row = warp * DECODE_ROWS + lane / 4 + 8 * i;
#pragma unroll
    for (int d = 0; d < HEAD_DIM / 8; d++)
      *reinterpret_cast<float2*>(sO + row * HEAD_DIM + d * 8 + 2 * (lane & 3)) =
          make_float2(o[d][2 * i], o[d][2 * i + 1]);
    if ((lane & 3) == 0) sML[row * 2] = m[i] * scale_log2, sML[row * 2 + 1] = l[i];  // -inf stays -inf
  }
  __syncthreads();

  const int d = threadIdx.x;
  const bool single = key_begin == 0 && key_end == ctx;  // the only live partition: finish here
  for (int g = 0; g < group; g++) {
    float m_max = -INFINITY;  // warp 0 saw key_begin, so at least one warp has a finite m
    for (int w = 0; w < DECODE_WARPS; w++) m_max = fmaxf(m_max, sML[(w * DECODE_ROWS + g) * 2]);
    float l_sum = 0.f, acc = 0.f;
    for (int w = 0; w < DECODE_WARPS; w++) {
      const float f = fast_exp2(sML[(w * DECODE_ROWS + g) * 2] - m_max);
      l_sum += sML[(w * DECODE_ROWS + g) * 2 + 1] * f;
      acc += sO[(w * DECODE_ROWS + g) * HEAD_DIM + d] * f;
    }
    const int h = kvh * group + g;
    if (single) {
      out[(size_t)b * NH * HEAD_DIM + h * HEAD_DIM + d] = __float2bfloat16(acc / l_sum);
    } else {
      const size_t slot = ((size_t)b * NH + h) * max_parts + part;
      ws_o[slot * HEAD_DIM + d] = acc;
      if (d == 0) ws_ml[slot * 2] = m_max, ws_ml[slot * 2 + 1] = l_sum;
    }
  }
}

// attention_decode_merge_kernel — split-K, phase 2: combine the partitions of one (sequence, head).
//   With partition p holding O_p = sum_j 2^(x_j - m_p) v_j and l_p = sum_j 2^(x_j - m_p) (x in log2 units):
//   out = sum_p 2^(m_p - M) O_p / sum_p 2^(m_p - M) l_p, M = max_p m_p (the log-sum-exp rule).
//   One CTA per (head h, sequence b), thread d owns dim d. Sequences with one partition were finished by
//   phase 1 and exit at once. Reads ws_o, ws_ml as written by attention_decode_kernel; writes out.
__global__ void __launch_bounds__(HEAD_DIM)
    attention_decode_merge_kernel(bf16* __restrict__ out, const int* __restrict__ context_lens,
                                  const float* __restrict__ ws_o, const float* __restrict__ ws_ml, int NH,
                                  int max_parts) {
  const int h = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
  const int n_parts = cdiv_dev(context_lens[b], DECODE_PARTITION);
  if (n_parts <= 1) return;
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

// Bytes of float workspace attention_decode needs: partial O and (m, l) for every (sequence, head,
// partition). B = 512, NH = 16, max_context_len = 4096 (nano-vllm defaults) -> 8 partitions, 34 MB.
static size_t attention_decode_workspace_bytes(int B, int NH, int max_context_len) {
  return (size_t)B * NH * cdiv(max_context_len, DECODE_PARTITION) * (HEAD_DIM + 2) * sizeof(float);
}

// out: bf16 [B, NH*D]; qkv: bf16 [B, (NH+2NKV)*D]; k_cache, v_cache: bf16 [NB, NKV, P, D];
// context_lens: int [B] (device, keys including the current token); block_tables: int [B, MB] (device);
// max_context_len: host bound on every context_lens[b] (max_model_len): the grid depends only on it, so a
// captured graph stays valid; workspace: attention_decode_workspace_bytes(B, NH, max_context_len) bytes.
static void attention_decode(bf16* out, const bf16* qkv, const bf16* k_cache, const bf16* v_cache,
                             const int* context_lens, const int* block_tables, int B, int NH, int NKV, int P,
                             int MB, int max_context_len, float* workspace, float scale,
                             cudaStream_t stream) {
  check_attention_shapes("attention_decode", NH, NKV, P);
  if (NH / NKV > DECODE_ROWS)
    die("attention_decode: NH/NKV = %d query heads per kv head, at most %d", NH / NKV, DECODE_ROWS);
  if (B == 0) return;
  const int max_parts = (int)cdiv(max_context_len, DECODE_PARTITION);
  float* ws_o = workspace;                                          // [B, NH, max_parts, D]
  float* ws_ml = workspace + (size_t)B * NH * max_parts * HEAD_DIM;  // [B, NH, max_parts, 2]
  const size_t smem = (DECODE_ROWS + 2 * ATTN_STAGES * ATTN_KV_TILE) * HEAD_DIM * sizeof(bf16);  // 68 KiB
  CUDA_CHECK(cudaFuncSetAttribute(attention_decode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  (int)smem));
  attention_decode_kernel<<<dim3(max_parts, NKV, B), DECODE_WARPS * 32, smem, stream>>>(
      out, qkv, k_cache, v_cache, context_lens, block_tables, NH, NKV, __builtin_ctz(P), MB, max_parts, ws_o,
      ws_ml, scale * (float)M_LOG2E);
  CUDA_CHECK(cudaGetLastError());
  if (max_parts > 1) {
    attention_decode_merge_kernel<<<dim3(NH, B), HEAD_DIM, 0, stream>>>(out, context_lens, ws_o, ws_ml, NH,
                                                                        max_parts);
    CUDA_CHECK(cudaGetLastError());
  }
}

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
  (void)argc;
  (void)argv;
  return 0;
}
#endif
