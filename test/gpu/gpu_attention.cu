// gpu_attention.cu — section 8 (paged attention, prefill and decode) against its CPU reference, sections 16
// and 17 (the cluster merge, the fused decode kernel) against section 8, and timings.
//
// Every case builds a paged KV cache the way the engine does: blocks handed out in a shuffled order, the
// block-table tail set to -1, and every slot that no sequence owns (spare blocks, the tail of each last
// block) set to NaN, so a kernel that reads a key it should not turns its output into NaN. Outputs and the
// decode workspace are poisoned with NaN bytes before each run, and a guard zone after the output must
// survive. The reference is fp64 over the same bf16-rounded inputs. Cases named timing_* print numbers.
#define NANOVLLM_TESTING
#include "../../nanovllm.cu"
#include "../test.h"

#include <atomic>
#include <thread>

#include "gpu_fixtures.h"

// splitmix64: a fast reproducible source for the hundreds of millions of cache values some cases need.
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float uniform() { return (float)(next() >> 40) * (2.0f / 16777216.0f) - 1.0f; }  // [-1, 1)
  int range(int lo, int hi) { return lo + (int)(next() % (uint64_t)(hi - lo + 1)); }  // [lo, hi]
};

// A batch of sequences over a paged cache, on the host. Values are bf16-rounded floats.
struct PagedBatch {
  int NH = 0, NKV = 0, P = 0, B = 0, MB = 0, NB = 0, T = 0;
  std::vector<int> q_lens, k_lens, cu_q;  // per sequence; cu_q [B+1]
  std::vector<int> block_tables;          // [B, MB], -1 past each sequence's blocks
  std::vector<float> k, v;                // [NB, NKV, P, D], NaN where no sequence owns the slot
  std::vector<float> qkv;                 // [T, (NH + 2*NKV)*D]
  size_t slot_index(int b, int j, int kvh) const {  // element offset of key j of sequence b, kv head kvh
    size_t block = block_tables[(size_t)b * MB + j / P];
    return ((block * NKV + kvh) * P + j % P) * HEAD_DIM;
  }
};

// q_amp scales the queries: larger values make the softmax peaky (scores with a std of several units).
// mb, nb: block-table width and pool size (0 = just enough, plus a few spare blocks that stay NaN).
static PagedBatch make_batch(int NH, int NKV, int P, const std::vector<int>& q_lens,
                             const std::vector<int>& k_lens, uint64_t seed, float q_amp = 1.f, int mb = 0,
                             int nb = 0) {
  PagedBatch pb;
  pb.NH = NH, pb.NKV = NKV, pb.P = P, pb.B = (int)q_lens.size();
  pb.q_lens = q_lens, pb.k_lens = k_lens;
  Rng rng{seed};
  int need_mb = 0, need_nb = 0;
  for (int b = 0; b < pb.B; b++) {
    need_mb = std::max(need_mb, (int)cdiv(k_lens[b], P));
    need_nb += (int)cdiv(k_lens[b], P);
  }
  pb.MB = mb ? mb : need_mb + 1;
  pb.NB = nb ? nb : need_nb + 5;
  if (pb.MB < need_mb || pb.NB < need_nb) die("make_batch: mb/nb too small");
  std::vector<int> order(pb.NB);
  for (int i = 0; i < pb.NB; i++) order[i] = i;
  for (int i = pb.NB - 1; i > 0; i--) std::swap(order[i], order[rng.range(0, i)]);
  pb.block_tables.assign((size_t)pb.B * pb.MB, -1);
  int used = 0;
  for (int b = 0; b < pb.B; b++)
    for (int i = 0; i < cdiv(k_lens[b], P); i++) pb.block_tables[(size_t)b * pb.MB + i] = order[used++];
  const size_t cache_elems = (size_t)pb.NB * NKV * P * HEAD_DIM;
  pb.k.assign(cache_elems, NAN);
  pb.v.assign(cache_elems, NAN);
  for (int b = 0; b < pb.B; b++)
    for (int j = 0; j < k_lens[b]; j++)
      for (int kvh = 0; kvh < NKV; kvh++) {
        size_t at = pb.slot_index(b, j, kvh);
        for (int d = 0; d < HEAD_DIM; d++) {
          pb.k[at + d] = bf16_round(rng.uniform());
          pb.v[at + d] = bf16_round(rng.uniform());
        }
      }
  pb.cu_q.assign(pb.B + 1, 0);
  for (int b = 0; b < pb.B; b++) pb.cu_q[b + 1] = pb.cu_q[b] + q_lens[b];
  pb.T = pb.cu_q[pb.B];
  const int width = (NH + 2 * NKV) * HEAD_DIM;
  pb.qkv.resize((size_t)pb.T * width);
  for (int t = 0; t < pb.T; t++)
    for (int c = 0; c < width; c++)
      pb.qkv[(size_t)t * width + c] = bf16_round(rng.uniform() * (c < NH * HEAD_DIM ? q_amp : 1.f));
  return pb;
}

// fp64 paged causal attention, out [T, NH*D]: nanovllm.cu's attention_reference over every (sequence,
// head), on all cores.
static std::vector<float> reference_attention(const PagedBatch& pb) {
  std::vector<float> out((size_t)pb.T * pb.NH * HEAD_DIM);
  std::atomic<int> next{0};
  auto worker = [&]() {
    for (int task; (task = next++) < pb.B * pb.NH;)
      attention_reference(out.data(), pb.qkv.data(), pb.k.data(), pb.v.data(), pb.cu_q.data(), pb.k_lens.data(),
                          pb.block_tables.data(), task / pb.NH, task % pb.NH, pb.NH, pb.NKV, pb.P, pb.MB);
  };
  std::vector<std::thread> threads;
  const unsigned n_threads = std::max(1u, std::thread::hardware_concurrency());
  for (unsigned i = 0; i < n_threads; i++) threads.emplace_back(worker);
  for (auto& th : threads) th.join();
  return out;
}

template <class T>
static T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  CUDA_CHECK(cudaMalloc(&d, std::max<size_t>(1, h.size()) * sizeof(T)));
  CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
static std::vector<bf16> to_bf16(const std::vector<float>& x) {
  std::vector<bf16> y(x.size());
  for (size_t i = 0; i < x.size(); i++) y[i] = __float2bfloat16(x[i]);
  return y;
}

// The batch with an fp8 cache (section 21): every owned key and value replaced by what its e4m3 byte at
// these scales stands for, so the fp64 reference sees exactly what the kernels read. NaN slots stay NaN.
static PagedBatch with_fp8_values(PagedBatch pb, KVScales s) {
  for (auto* c : {&pb.k, &pb.v}) {
    const float scale = c == &pb.k ? s.k : s.v;
    for (float& x : *c)
      if (!std::isnan(x)) x = e4m3_to_float(e4m3_from_float(x / scale)) * scale;
  }
  return pb;
}
static std::vector<uint8_t> to_e4m3(const std::vector<float>& x, float scale) {
  std::vector<uint8_t> y(x.size());
  for (size_t i = 0; i < x.size(); i++) y[i] = e4m3_from_float(x[i] / scale);
  return y;
}

// The batch on the device, its cache in bf16 or (fp8) in e4m3 bytes at `scale`. Decode uses context_lens =
// k_lens and ignores cu_q.
struct DeviceBatch {
  bf16* qkv = nullptr;
  void *k = nullptr, *v = nullptr;
  int *cu_q = nullptr, *k_lens = nullptr, *block_tables = nullptr;
  KVCacheDtype dtype;
  KVScales scale;
  explicit DeviceBatch(const PagedBatch& pb, KVCacheDtype dtype_ = KVCacheDtype::BF16, KVScales scale_ = {})
      : dtype(dtype_), scale(scale_) {
    qkv = to_device(to_bf16(pb.qkv));
    if (dtype == KVCacheDtype::FP8) {
      k = to_device(to_e4m3(pb.k, scale.k));
      v = to_device(to_e4m3(pb.v, scale.v));
    } else {
      k = to_device(to_bf16(pb.k));
      v = to_device(to_bf16(pb.v));
    }
    cu_q = to_device(pb.cu_q);
    k_lens = to_device(pb.k_lens);
    block_tables = to_device(pb.block_tables);
  }
  // The cache as the kernels are told to read it; read_factor != 1 lies about the scales (a test of the test).
  KVLayer layer(float read_factor = 1.f) const {
    return {k, v, dtype, {scale.k * read_factor, scale.v * read_factor}};
  }
  ~DeviceBatch() {
    for (void* p : {(void*)qkv, k, v, (void*)cu_q, (void*)k_lens, (void*)block_tables}) CUDA_CHECK(cudaFree(p));
  }
};

// An output buffer of n bf16 plus a guard zone, filled with NaN bytes; read() checks the guard survived.
constexpr size_t GUARD = 4096;
struct PoisonedOutput {
  size_t n;
  bf16* d = nullptr;
  explicit PoisonedOutput(size_t n_) : n(n_) {
    CUDA_CHECK(cudaMalloc(&d, (n + GUARD) * sizeof(bf16)));
    CUDA_CHECK(cudaMemset(d, 0xFF, (n + GUARD) * sizeof(bf16)));
  }
  ~PoisonedOutput() { CUDA_CHECK(cudaFree(d)); }
  std::vector<float> read() {
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<bf16> h(n + GUARD);
    CUDA_CHECK(cudaMemcpy(h.data(), d, h.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
    size_t touched = 0;
    for (size_t i = n; i < n + GUARD; i++) touched += *reinterpret_cast<uint16_t*>(&h[i]) != 0xFFFF;
    CHECK_MSG(touched == 0, "%zu bf16 past the end of the output were overwritten", touched);
    std::vector<float> out(n);
    for (size_t i = 0; i < n; i++) out[i] = __bfloat162float(h[i]);
    return out;
  }
};

// |got - want| <= 2e-2 + 2e-2 |want| everywhere. expect_ok = false: the case is built to be wrong (a lie
// about the fp8 scales), and the comparison must say so.
static void compare(const char* what, const std::vector<float>& got, const std::vector<float>& want,
                    bool expect_ok = true) {
  double worst = 0;
  size_t at = 0, outside = 0;
  for (size_t i = 0; i < got.size(); i++) {
    double e = std::isnan(got[i]) ? INFINITY : fabs((double)got[i] - want[i]);
    if (e > worst) worst = e, at = i;
    outside += !(e <= 2e-2 + 2e-2 * fabs((double)want[i]));
  }
  printf("    %-58s max|err| %.2e at [%zu] (got %.5f want %.5f)%s\n", what, worst, at, got[at], want[at],
         expect_ok ? "" : (" " + std::to_string(outside) + " outside the tolerance, as intended").c_str());
  if (expect_ok) check_close(what, got.data(), want.data(), got.size(), 2e-2f, 2e-2f);
  else CHECK_MSG(outside > 0, "%s: the comparison did not notice the wrong scales", what);
}

// fp8 (section 21): the cache is stored in e4m3 at `scale` and the reference reads the values it stands for;
// read_factor != 1 tells the kernel the wrong scales and expects the comparison to fail.
struct KVChoice {
  KVCacheDtype dtype = KVCacheDtype::BF16;
  KVScales scale;
  float read_factor = 1.f;
};
static const PagedBatch& reference_input(const PagedBatch& pb, const KVChoice& kv, PagedBatch& holder) {
  if (kv.dtype == KVCacheDtype::BF16) return pb;
  holder = with_fp8_values(pb, kv.scale);
  return holder;
}

static void check_prefill(const char* what, const PagedBatch& pb, const KVChoice& kv = {}) {
  DeviceBatch db(pb, kv.dtype, kv.scale);
  PoisonedOutput out((size_t)pb.T * pb.NH * HEAD_DIM);
  int max_q = *std::max_element(pb.q_lens.begin(), pb.q_lens.end());
  attention_prefill(out.d, db.qkv, db.layer(kv.read_factor), db.cu_q, db.k_lens, db.block_tables, pb.B, max_q,
                    pb.NH, pb.NKV, pb.P, pb.MB, 1.f / sqrtf((float)HEAD_DIM), 0);
  PagedBatch holder;
  compare(what, out.read(), reference_attention(reference_input(pb, kv, holder)), kv.read_factor == 1.f);
}

// Section 8's decode kernel, and section 16's cluster merge where it applies (batches of at most
// DECODE_CLUSTER_MAX_B on sm_90 and later), each against the fp64 reference.
static void check_decode(const char* what, const PagedBatch& pb, int max_context_len, const KVChoice& kv = {}) {
  DeviceBatch db(pb, kv.dtype, kv.scale);
  size_t ws_bytes = attention_decode_workspace_bytes(pb.B, pb.NH, max_context_len);
  float* ws = nullptr;
  CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
  PagedBatch holder;
  const std::vector<float> want = reference_attention(reference_input(pb, kv, holder));
  const bool cluster = pb.B <= DECODE_CLUSTER_MAX_B && decode_clusters_supported();
  for (int path = 0; path < (cluster ? 2 : 1); path++) {
    PoisonedOutput out((size_t)pb.B * pb.NH * HEAD_DIM);
    CUDA_CHECK(cudaMemset(ws, 0xFF, ws_bytes));
    const Optimizations saved = g_opt;
    g_opt.cluster_merge = path == 1;
    attention_decode_fast(out.d, db.qkv, db.layer(kv.read_factor), db.k_lens, db.block_tables, pb.B, pb.NH,
                          pb.NKV, pb.P, pb.MB, max_context_len, ws, 1.f / sqrtf((float)HEAD_DIM), 0, nullptr);
    g_opt = saved;
    compare((std::string(what) + (path ? " [cluster merge]" : " [section 8]")).c_str(), out.read(), want,
            kv.read_factor == 1.f);
  }
  CUDA_CHECK(cudaFree(ws));
}

static std::vector<int> random_lengths(int n, int lo, int hi, uint64_t seed) {
  Rng rng{seed};
  std::vector<int> x(n);
  for (auto& v : x) v = rng.range(lo, hi);
  return x;
}

// ---- prefill ---------------------------------------------------------------------------------------------

TEST(prefill_one_token) {
  REQUIRE_GPU();
  check_prefill("prefill q=1 k=1 P=16 NH=16 NKV=8", make_batch(16, 8, 16, {1}, {1}, 1));
}

TEST(prefill_odd_length) {
  REQUIRE_GPU();
  check_prefill("prefill q=100 k=100 P=16 NH=16 NKV=8", make_batch(16, 8, 16, {100}, {100}, 2));
  check_prefill("prefill q=77 k=77 P=256 NH=8 NKV=8", make_batch(8, 8, 256, {77}, {77}, 3));
}

TEST(prefill_chunked_with_cached_prefix) {
  REQUIRE_GPU();
  check_prefill("prefill q=77 k=300 P=64 NH=32 NKV=8", make_batch(32, 8, 64, {77}, {300}, 4));
  check_prefill("prefill q=200 k=3000 P=16 NH=16 NKV=8 (188 blocks)",
                make_batch(16, 8, 16, {200}, {3000}, 5));
  check_prefill("prefill q=1 k=513 P=256 NH=16 NKV=8", make_batch(16, 8, 256, {1}, {513}, 6));
}

TEST(prefill_mixed_batch) {
  REQUIRE_GPU();
  const std::vector<int> q = {1, 130, 64, 257, 33, 5, 128};
  const std::vector<int> k = {1, 130, 200, 1000, 545, 700, 128};
  check_prefill("prefill mixed B=7 P=16 NH=8 NKV=8", make_batch(8, 8, 16, q, k, 7));
  check_prefill("prefill mixed B=7 P=64 NH=16 NKV=8", make_batch(16, 8, 64, q, k, 8));
  check_prefill("prefill mixed B=7 P=256 NH=32 NKV=8", make_batch(32, 8, 256, q, k, 9));
}

TEST(prefill_long_peaky) {
  REQUIRE_GPU();
  check_prefill("prefill q=2048 k=2048 P=256 NH=16 NKV=8, q x4 (peaky)",
                make_batch(16, 8, 256, {2048}, {2048}, 10, 4.f));
}

// ---- decode ----------------------------------------------------------------------------------------------

TEST(decode_one_token) {
  REQUIRE_GPU();
  check_decode("decode B=1 ctx=1 P=16 NH=16 NKV=8 max_ctx=16", make_batch(16, 8, 16, {1}, {1}, 11), 16);
  check_decode("decode B=1 ctx=1 P=16 NH=16 NKV=8 max_ctx=4096", make_batch(16, 8, 16, {1}, {1}, 12), 4096);
}

TEST(decode_long_context) {
  REQUIRE_GPU();
  check_decode("decode B=1 ctx=3000 P=16 NH=16 NKV=8 (16 partitions of 192)", make_batch(16, 8, 16, {1}, {3000}, 13),
               4096);
  check_decode("decode B=2 ctx=3000,2999 P=256 NH=32 NKV=8 peaky",
               make_batch(32, 8, 256, {1, 1}, {3000, 2999}, 14, 4.f), 3000);
}

TEST(decode_edge_lengths) {
  REQUIRE_GPU();
  const std::vector<int> ctx = {1, 15, 16, 17, 63, 64, 65, 255, 256, 257, 511, 512, 513, 1024, 1025, 1537};
  const std::vector<int> ones(ctx.size(), 1);
  check_decode("decode B=16 edge lengths P=16 NH=32 NKV=8", make_batch(32, 8, 16, ones, ctx, 15), 2048);
  check_decode("decode B=16 edge lengths P=256 NH=8 NKV=8", make_batch(8, 8, 256, ones, ctx, 16), 1537);
  check_decode("decode B=16 edge lengths P=64 NH=16 NKV=8", make_batch(16, 8, 64, ones, ctx, 17), 4096);
}

// Batches of at most DECODE_CLUSTER_MAX_B merge their partitions inside a cluster (a partition length that
// follows the context); a group of 16 heads means several heads per merging CTA when few partitions live.
TEST(decode_small_batch_cluster_merge) {
  REQUIRE_GPU();
  check_decode("decode B=3 ctx 1,100,4000 P=16 NH=32 NKV=2", make_batch(32, 2, 16, {1, 1, 1}, {1, 100, 4000}, 61),
               4096);
  check_decode("decode B=4 ctx 1023..1026 P=64 NH=16 NKV=8", make_batch(16, 8, 64, {1, 1, 1, 1},
                                                                         {1023, 1024, 1025, 1026}, 62), 2048);
  check_decode("decode B=1 ctx=16 P=16 NH=16 NKV=1 peaky", make_batch(16, 1, 16, {1}, {16}, 63, 8.f), 4096);
}

TEST(decode_batch_64_mixed) {
  REQUIRE_GPU();
  const std::vector<int> ones(64, 1);
  check_decode("decode B=64 ctx 1..2000 P=64 NH=8 NKV=8",
               make_batch(8, 8, 64, ones, random_lengths(64, 1, 2000, 18), 19), 4096);
  check_decode("decode B=64 ctx 1..2000 P=16 NH=32 NKV=8",
               make_batch(32, 8, 16, ones, random_lengths(64, 1, 2000, 20), 21), 2000);
}

TEST(decode_batch_256) {
  REQUIRE_GPU();
  const std::vector<int> ones(256, 1);
  check_decode("decode B=256 ctx 1..600 P=256 NH=16 NKV=8",
               make_batch(16, 8, 256, ones, random_lengths(256, 1, 600, 22), 23), 1024);
}

// The engine captures decode once per batch size and replays it as contexts grow and blocks change.
TEST(decode_cuda_graph_replay) {
  REQUIRE_GPU();
  const int B = 32, NH = 16, NKV = 8, P = 64, max_ctx = 2048, MB = max_ctx / P, NB = B * MB + 3;
  const std::vector<int> ones(B, 1);
  PagedBatch a = make_batch(NH, NKV, P, ones, random_lengths(B, 1, 700, 24), 25, 1.f, MB, NB);
  PagedBatch b = make_batch(NH, NKV, P, ones, random_lengths(B, 300, 2048, 26), 27, 2.f, MB, NB);
  DeviceBatch db(a);
  PoisonedOutput out((size_t)B * NH * HEAD_DIM);
  size_t ws_bytes = attention_decode_workspace_bytes(B, NH, max_ctx);
  float* ws = nullptr;
  CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  attention_decode(out.d, db.qkv, db.layer(), db.k_lens, db.block_tables, B, NH, NKV, P, MB, max_ctx, ws,
                   1.f / sqrtf((float)HEAD_DIM), stream);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (const PagedBatch* pb : {&a, &b}) {
    // New step: same buffers, new contents (what ModelRunner.prepare_decode does before a replay).
    CUDA_CHECK(cudaMemcpy(db.qkv, to_bf16(pb->qkv).data(), pb->qkv.size() * sizeof(bf16),
                          cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(db.k, to_bf16(pb->k).data(), pb->k.size() * sizeof(bf16), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(db.v, to_bf16(pb->v).data(), pb->v.size() * sizeof(bf16), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(db.k_lens, pb->k_lens.data(), B * sizeof(int), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(db.block_tables, pb->block_tables.data(), pb->block_tables.size() * sizeof(int),
                          cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(out.d, 0xFF, out.n * sizeof(bf16)));
    CUDA_CHECK(cudaMemset(ws, 0xFF, ws_bytes));
    // The copies and memsets above ran on the legacy default stream, which does not order work on a
    // cudaStreamNonBlocking stream: wait for them before the replay reads their results.
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    compare(pb == &a ? "decode graph replay 1: B=32 ctx 1..700" : "decode graph replay 2: B=32 ctx 300..2048",
            out.read(), reference_attention(*pb));
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
  CUDA_CHECK(cudaFree(ws));
}

// ---- timings ---------------------------------------------------------------------------------------------

__global__ void fill_uniform_bf16_kernel(bf16* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint64_t z = (i + seed) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    p[i] = __float2bfloat16((float)(z >> 40) * (2.0f / 16777216.0f) - 1.0f);
  }
}
static bf16* device_random(size_t n, uint64_t seed) {
  bf16* d = nullptr;
  CUDA_CHECK(cudaMalloc(&d, n * sizeof(bf16)));
  fill_uniform_bf16_kernel<<<1024, 256>>>(d, n, seed);
  CUDA_CHECK(cudaGetLastError());
  return d;
}

// n random e4m3 bytes of magnitude below 16 (never NaN), for an fp8 cache of n values.
static void* device_random_e4m3(size_t n, uint64_t seed) {
  Rng rng{seed};
  std::vector<uint8_t> h(n);
  for (auto& b : h) {
    const uint64_t r = rng.next();
    b = (uint8_t)((r % 0x58) | ((r >> 32) & 0x80));
  }
  return to_device(h);
}

// Median of `iters` timed runs after a warm-up, in microseconds.
template <class F>
static double median_us(F&& launch, int iters = 21) {
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; i++) launch();
  std::vector<float> ms(iters);
  for (int i = 0; i < iters; i++) {
    CUDA_CHECK(cudaEventRecord(e0));
    launch();
    CUDA_CHECK(cudaEventRecord(e1));
    CUDA_CHECK(cudaEventSynchronize(e1));
    CUDA_CHECK(cudaEventElapsedTime(&ms[i], e0, e1));
  }
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
  std::sort(ms.begin(), ms.end());
  return ms[iters / 2] * 1000.0;
}

static size_t count_nonfinite(const bf16* d, size_t n) {
  std::vector<bf16> h(n);
  CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(bf16), cudaMemcpyDeviceToHost));
  size_t bad = 0;
  for (auto x : h) bad += !std::isfinite(__bfloat162float(x));
  return bad;
}

// Shuffled block tables for sequences with these contexts; returns the pool size through nb.
static std::vector<int> shuffled_tables(const std::vector<int>& ctx, int P, int MB, int& nb, uint64_t seed) {
  nb = 0;
  for (int c : ctx) nb += (int)cdiv(c, P);
  Rng rng{seed};
  std::vector<int> order(nb), bt(ctx.size() * MB, -1);
  for (int i = 0; i < nb; i++) order[i] = i;
  for (int i = nb - 1; i > 0; i--) std::swap(order[i], order[rng.range(0, i)]);
  int used = 0;
  for (size_t b = 0; b < ctx.size(); b++)
    for (int i = 0; i < cdiv(ctx[b], P); i++) bt[b * MB + i] = order[used++];
  return bt;
}

// Decode at a fixed batch: KV bytes read = sum(ctx) * NKV * D * 2 bytes * (K and V). The cache (hundreds of
// MB) is far larger than L2, so every run reads it from HBM.
static void time_decode(const char* what, const std::vector<int>& ctx, int NH, int NKV, int P, int max_ctx,
                        KVCacheDtype dtype = KVCacheDtype::BF16) {
  const int B = (int)ctx.size(), MB = (int)cdiv(max_ctx, P);
  int NB = 0;
  std::vector<int> bt = shuffled_tables(ctx, P, MB, NB, 31);
  const size_t cache = (size_t)NB * NKV * P * HEAD_DIM;
  const bool fp8 = dtype == KVCacheDtype::FP8;
  void* k = fp8 ? device_random_e4m3(cache, 1) : (void*)device_random(cache, 1);
  void* v = fp8 ? device_random_e4m3(cache, 2) : (void*)device_random(cache, 2);
  bf16* qkv = device_random((size_t)B * (NH + 2 * NKV) * HEAD_DIM, 3);
  int* d_ctx = to_device(ctx);
  int* d_bt = to_device(bt);
  bf16* out = nullptr;
  CUDA_CHECK(cudaMalloc(&out, (size_t)B * NH * HEAD_DIM * sizeof(bf16)));
  float* ws = nullptr;
  CUDA_CHECK(cudaMalloc(&ws, attention_decode_workspace_bytes(B, NH, max_ctx)));
  double us = median_us([&] {
    attention_decode(out, qkv, KVLayer{k, v, dtype, {}}, d_ctx, d_bt, B, NH, NKV, P, MB, max_ctx, ws,
                     1.f / sqrtf(128.f), 0);
  });
  // The engine's default decode path: section 17's kernel (q/k-norm, RoPE and the store inside; padding slots
  // here, so the cache is not written) and, at small batches, section 16's cluster merge.
  std::vector<int> pos(B), no_slots(B, -1);
  for (int b = 0; b < B; b++) pos[b] = ctx[b] - 1;
  int *d_pos = to_device(pos), *d_slots = to_device(no_slots);
  bf16* w = device_random(HEAD_DIM, 4);
  const DecodeRope rope{d_pos, d_slots, w, w, 1e-6f, rope_inv_freq(1e6f)};
  double us_fused = median_us([&] {
    attention_decode_fast(out, qkv, KVLayer{k, v, dtype, {}}, d_ctx, d_bt, B, NH, NKV, P, MB, max_ctx, ws,
                          1.f / sqrtf(128.f), 0, &rope);
  });
  double tokens = 0;
  for (int c : ctx) tokens += c;
  const double bytes = tokens * NKV * HEAD_DIM * kv_cache_elem_bytes(dtype) * 2;
  printf("    TIMING %s: %.1f us, KV %.1f MB, %.0f GB/s; fused (section 17) %.1f us, %.0f GB/s\n", what, us,
         bytes / 1e6, bytes / us / 1e3, us_fused, bytes / us_fused / 1e3);
  for (void* p : {(void*)d_pos, (void*)d_slots, (void*)w}) CUDA_CHECK(cudaFree(p));
  CHECK_MSG(count_nonfinite(out, (size_t)B * NH * HEAD_DIM) == 0, "non-finite decode output");
  for (void* p : {k, v, (void*)qkv, (void*)d_ctx, (void*)d_bt, (void*)out, (void*)ws}) CUDA_CHECK(cudaFree(p));
}

// ---- the fused decode path -------------------------------------------------------------------------------

static std::vector<uint16_t> download_bits(const bf16* d, size_t n) {
  std::vector<uint16_t> h(n);
  CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(bf16), cudaMemcpyDeviceToHost));
  return h;
}
static bf16* device_copy(const bf16* src, size_t n) {
  bf16* d = nullptr;
  CUDA_CHECK(cudaMalloc(&d, n * sizeof(bf16)));
  CUDA_CHECK(cudaMemcpy(d, src, n * sizeof(bf16), cudaMemcpyDeviceToDevice));
  return d;
}
static std::vector<uint8_t> download_bytes(const void* d, size_t n) {
  std::vector<uint8_t> h(n);
  CUDA_CHECK(cudaMemcpy(h.data(), d, n, cudaMemcpyDeviceToHost));
  return h;
}
static void* device_copy_bytes(const void* src, size_t n) {
  void* d = nullptr;
  CUDA_CHECK(cudaMalloc(&d, n));
  CUDA_CHECK(cudaMemcpy(d, src, n, cudaMemcpyDeviceToDevice));
  return d;
}

// Section 17's fused kernel (q/k-norm, RoPE and the KV store inside decode attention) against the kernels
// it replaces, qk_norm_rope then section 8's attention_decode, on the same raw qkv and cache: the outputs of
// the real rows and the whole cache afterwards must be equal bit for bit. Where the cluster merge applies
// (section 16), the same again with it on both sides, and (contexts of at most 1024 keys, where its partition
// length equals section 8's 64 keys: a bf16 cache) the cluster path against section 8 too.
// The last n_pad rows are padding (slot -1, as the engine pads a graph's batch): every path stores nothing
// for them; their outputs are not compared (the fused kernel attends to the row's own k and v, the separate
// path to what the cache held).
// fp8 (section 21): the same over an e4m3 cache at these scales; this step's k and v are then the values their
// bytes stand for on both sides.
static void check_fused_rope(const char* what, int NH, int NKV, int P, const std::vector<int>& ctx, int n_pad,
                             int max_ctx, uint64_t seed, KVCacheDtype dtype = KVCacheDtype::BF16,
                             KVScales kv_scale = {}) {
  const int B = (int)ctx.size(), MB = (int)cdiv(max_ctx, P), W = (NH + 2 * NKV) * HEAD_DIM;
  int NB = 0;
  std::vector<int> bt = shuffled_tables(ctx, P, MB, NB, seed);
  std::vector<int> pos(B), slots(B);
  for (int b = 0; b < B; b++) {
    pos[b] = ctx[b] - 1;
    slots[b] = b >= B - n_pad ? -1 : bt[(size_t)b * MB + pos[b] / P] * P + pos[b] % P;
  }
  const size_t cache = (size_t)NB * NKV * P * HEAD_DIM;
  const bool fp8 = dtype == KVCacheDtype::FP8;
  const size_t cache_bytes = cache * kv_cache_elem_bytes(dtype);
  void* k0 = fp8 ? device_random_e4m3(cache, seed + 1) : (void*)device_random(cache, seed + 1);
  void* v0 = fp8 ? device_random_e4m3(cache, seed + 2) : (void*)device_random(cache, seed + 2);
  bf16* qkv0 = device_random((size_t)B * W, seed + 3);
  bf16 *qw = device_random(HEAD_DIM, seed + 4), *kw = device_random(HEAD_DIM, seed + 5);
  int *d_ctx = to_device(ctx), *d_bt = to_device(bt), *d_pos = to_device(pos), *d_slots = to_device(slots);
  float* ws = nullptr;
  CUDA_CHECK(cudaMalloc(&ws, attention_decode_workspace_bytes(B, NH, max_ctx)));
  const float theta = 1e6f, eps = 1e-6f, scale = 1.f / sqrtf((float)HEAD_DIM);
  const bool cluster = B <= DECODE_CLUSTER_MAX_B && decode_clusters_supported();
  const int variants = cluster ? 4 : 2;  // bit 0: fused rope; bit 1: cluster merge
  std::vector<uint16_t> out_bits[4];
  std::vector<uint8_t> k_bits[4], v_bits[4];
  const Optimizations saved = g_opt;
  for (int variant = 0; variant < variants; variant++) {
    const bool fused = variant & 1;
    g_opt.cluster_merge = variant & 2;
    bf16* qkv = device_copy(qkv0, (size_t)B * W);
    void *k = device_copy_bytes(k0, cache_bytes), *v = device_copy_bytes(v0, cache_bytes);
    const KVLayer layer{k, v, dtype, kv_scale};
    PoisonedOutput out((size_t)B * NH * HEAD_DIM);
    CUDA_CHECK(cudaMemset(ws, 0xFF, attention_decode_workspace_bytes(B, NH, max_ctx)));
    if (fused) {
      const DecodeRope rope{d_pos, d_slots, qw, kw, eps, rope_inv_freq(theta)};
      attention_decode_fast(out.d, qkv, layer, d_ctx, d_bt, B, NH, NKV, P, MB, max_ctx, ws, scale, 0, &rope);
    } else {
      qk_norm_rope(qkv, d_pos, qw, kw, layer, d_slots, B, NH, NKV, P, theta, eps, 0);
      attention_decode_fast(out.d, qkv, layer, d_ctx, d_bt, B, NH, NKV, P, MB, max_ctx, ws, scale, 0, nullptr);
    }
    std::vector<float> o = out.read();  // also checks the guard zone
    out_bits[variant] = download_bits(out.d, (size_t)(B - n_pad) * NH * HEAD_DIM);
    k_bits[variant] = download_bytes(k, cache_bytes);
    v_bits[variant] = download_bytes(v, cache_bytes);
    size_t nonfinite = 0;
    for (size_t i = 0; i < (size_t)(B - n_pad) * NH * HEAD_DIM; i++) nonfinite += !std::isfinite(o[i]);
    CHECK_MSG(nonfinite == 0, "%s: %zu non-finite outputs (variant %d)", what, nonfinite, variant);
    if (fused) {  // the unfused qkv is roped in place; the fused kernel must leave qkv as it was
      CHECK_MSG(download_bits(qkv, (size_t)B * W) == download_bits(qkv0, (size_t)B * W),
                "%s: the fused kernel wrote to qkv", what);
    }
    for (void* p : {(void*)qkv, k, v}) CUDA_CHECK(cudaFree(p));
  }
  g_opt = saved;
  auto compare_bits = [&](int x, int y, const char* label) {
    size_t out_diff = 0, k_diff = 0, v_diff = 0;
    for (size_t i = 0; i < out_bits[x].size(); i++) out_diff += out_bits[x][i] != out_bits[y][i];
    for (size_t i = 0; i < cache_bytes; i++)
      k_diff += k_bits[x][i] != k_bits[y][i], v_diff += v_bits[x][i] != v_bits[y][i];
    printf("    %-50s %-26s outputs differing %zu, k cache %zu, v cache %zu\n", what, label, out_diff, k_diff, v_diff);
    CHECK_MSG(out_diff == 0 && k_diff == 0 && v_diff == 0, "%s: %s differ", what, label);
  };
  compare_bits(1, 0, "fused vs section 8");
  if (cluster) compare_bits(3, 2, "fused vs separate, cluster");
  if (cluster && *std::max_element(ctx.begin(), ctx.end()) <= 1024 && decode_partition(B, dtype) == ATTN_KV_TILE)
    compare_bits(2, 0, "cluster vs section 8");
  // the store happened: every real row's slot changed (random values repeat by chance only rarely)
  std::vector<uint8_t> k_before = download_bytes(k0, cache_bytes);
  size_t stored = 0;
  const size_t row_bytes = HEAD_DIM * kv_cache_elem_bytes(dtype);
  for (int b = 0; b < B - n_pad; b++) {
    const size_t at = ((size_t)(slots[b] / P) * NKV * P + slots[b] % P) * row_bytes;  // kv head 0
    stored += memcmp(&k_before[at], &k_bits[1][at], row_bytes) != 0;
  }
  CHECK_MSG(stored == (size_t)(B - n_pad), "%s: %zu of %d slots were stored", what, stored, B - n_pad);
  for (void* p : {k0, v0, (void*)qkv0, (void*)qw, (void*)kw, (void*)d_ctx, (void*)d_bt, (void*)d_pos,
                  (void*)d_slots, (void*)ws})
    CUDA_CHECK(cudaFree(p));
}

TEST(decode_fused_rope_matches_separate_kernels) {
  REQUIRE_GPU();
  check_fused_rope("fused B=1 ctx=777 NH=16 NKV=8 P=256", 16, 8, 256, {777}, 0, 4096, 51);
  check_fused_rope("fused B=1 ctx=1 NH=16 NKV=8 P=16", 16, 8, 16, {1}, 0, 4096, 52);
  check_fused_rope("fused B=4 ctx 1,64,65,+pad NH=32 NKV=8 P=16", 32, 8, 16, {1, 64, 65, 1}, 1, 2048, 53);
  check_fused_rope("fused B=37 ctx 1..1500 NH=16 NKV=2 P=64", 16, 2, 64, random_lengths(37, 1, 1500, 54), 0, 2048,
                   55);
  std::vector<int> ctx64 = random_lengths(64, 1, 3000, 56);
  for (int b = 60; b < 64; b++) ctx64[b] = 1;
  check_fused_rope("fused B=64 ctx 1..3000 NH=16 NKV=1 (group 16) P=256 +4 pad", 16, 1, 256, ctx64, 4, 4096, 57);
  check_fused_rope("fused B=2 ctx 64,2000 NH=16 NKV=1 (group 16) P=16", 16, 1, 16, {64, 2000}, 0, 4096, 60);
  check_fused_rope("fused B=200 ctx 1..700 NH=16 NKV=8 P=16", 16, 8, 16, random_lengths(200, 1, 700, 58), 0, 1024,
                   59);
}

// ---- section 21: the fp8 cache ------------------------------------------------------------------------------
// The kernels read e4m3 bytes and widen them exactly, so against the fp64 reference over the values the
// bytes stand for they are held to the bf16 tolerance. Scales other than 1 on purpose (keys 1/4, values 2).

static const KVChoice kFp8{KVCacheDtype::FP8, {0.25f, 2.f}, 1.f};

TEST(fp8_prefill) {
  REQUIRE_GPU();
  check_prefill("fp8 prefill q=1 k=1 P=16 NH=16 NKV=8", make_batch(16, 8, 16, {1}, {1}, 101), kFp8);
  check_prefill("fp8 prefill q=77 k=300 P=64 NH=32 NKV=8", make_batch(32, 8, 64, {77}, {300}, 102), kFp8);
  const std::vector<int> q = {1, 130, 64, 257, 33, 5, 128};
  const std::vector<int> k = {1, 130, 200, 1000, 545, 700, 128};
  check_prefill("fp8 prefill mixed B=7 P=16 NH=16 NKV=8", make_batch(16, 8, 16, q, k, 103), kFp8);
  check_prefill("fp8 prefill q=1000 k=1000 P=256 NH=16 NKV=8 peaky",
                make_batch(16, 8, 256, {1000}, {1000}, 104, 4.f), kFp8);
  check_prefill("fp8 prefill, scales 1", make_batch(16, 8, 16, q, k, 105), {KVCacheDtype::FP8, {1.f, 1.f}, 1.f});
}

TEST(fp8_decode) {
  REQUIRE_GPU();
  const std::vector<int> ctx = {1, 15, 16, 17, 63, 64, 65, 255, 256, 257, 511, 512, 513, 1024, 1025, 1537};
  check_decode("fp8 decode B=16 edge lengths P=16 NH=32 NKV=8",
               make_batch(32, 8, 16, std::vector<int>(ctx.size(), 1), ctx, 111), 2048, kFp8);
  check_decode("fp8 decode B=3 ctx 1,100,4000 P=16 NH=32 NKV=2",
               make_batch(32, 2, 16, {1, 1, 1}, {1, 100, 4000}, 112), 4096, kFp8);
  check_decode("fp8 decode B=1 ctx=3000 P=256 NH=16 NKV=8 peaky", make_batch(16, 8, 256, {1}, {3000}, 113, 4.f),
               4096, kFp8);
  check_decode("fp8 decode B=64 ctx 1..2000 P=64 NH=16 NKV=8",
               make_batch(16, 8, 64, std::vector<int>(64, 1), random_lengths(64, 1, 2000, 114), 115), 2048, kFp8);
}

// A test of the tests: the same cases with the kernels told twice the scales the cache was written with.
// The comparison must notice (attention's scores double and its outputs double).
TEST(fp8_wrong_scale_is_caught) {
  REQUIRE_GPU();
  const KVChoice wrong{KVCacheDtype::FP8, {0.25f, 2.f}, 2.f};
  check_prefill("fp8 prefill, scales read 2x", make_batch(16, 8, 16, {77}, {300}, 121), wrong);
  check_decode("fp8 decode B=3, scales read 2x", make_batch(16, 8, 16, {1, 1, 1}, {1, 100, 700}, 122), 1024, wrong);
  check_decode("fp8 decode B=40, scales read 2x",
               make_batch(16, 8, 64, std::vector<int>(40, 1), random_lengths(40, 1, 900, 123), 124), 1024, wrong);
}

// Section 17 with an fp8 cache: the fused kernel keeps this step's key and value in shared memory as the values
// their bytes stand for, so its outputs and the bytes it stores equal qk_norm_rope + section 8's, bit for bit.
TEST(fp8_decode_fused_rope_matches_separate_kernels) {
  REQUIRE_GPU();
  const KVScales s{0.25f, 2.f};
  check_fused_rope("fp8 fused B=1 ctx=777 NH=16 NKV=8 P=256", 16, 8, 256, {777}, 0, 4096, 151, KVCacheDtype::FP8, s);
  check_fused_rope("fp8 fused B=4 ctx 1,64,65,+pad NH=32 NKV=8 P=16", 32, 8, 16, {1, 64, 65, 1}, 1, 2048, 153,
                   KVCacheDtype::FP8, s);
  check_fused_rope("fp8 fused B=37 ctx 1..1500 NH=16 NKV=2 P=64", 16, 2, 64, random_lengths(37, 1, 1500, 154), 0,
                   2048, 155, KVCacheDtype::FP8, s);
  check_fused_rope("fp8 fused B=2 ctx 64,2000 NH=16 NKV=1 P=16", 16, 1, 16, {64, 2000}, 0, 4096, 160,
                   KVCacheDtype::FP8, s);
}

TEST(timing_decode) {
  REQUIRE_GPU();
  const std::vector<int> ctx1024(128, 1024);
  time_decode("decode B=128 ctx=1024 NH=16 NKV=8 P=256 max_ctx=1024", ctx1024, 16, 8, 256, 1024);
  time_decode("decode B=128 ctx=1024 NH=16 NKV=8 P=256 max_ctx=4096", ctx1024, 16, 8, 256, 4096);
  time_decode("decode B=128 ctx=1024 NH=16 NKV=8 P=16  max_ctx=4096", ctx1024, 16, 8, 16, 4096);
  time_decode("decode B=131 ctx 100..2000 NH=16 NKV=8 P=256 max_ctx=4096", random_lengths(131, 100, 2000, 41),
              16, 8, 256, 4096);
  time_decode("decode B=256 ctx=512 NH=32 NKV=8 P=256 max_ctx=4096", std::vector<int>(256, 512), 32, 8, 256,
              4096);
  time_decode("decode B=1 ctx=4096 NH=16 NKV=8 P=256 max_ctx=4096", {4096}, 16, 8, 256, 4096);
  const KVCacheDtype fp8 = KVCacheDtype::FP8;
  time_decode("fp8 decode B=1 ctx=4096 NH=16 NKV=8 P=256 max_ctx=4096", {4096}, 16, 8, 256, 4096, fp8);
  time_decode("fp8 decode B=128 ctx=1024 NH=16 NKV=8 P=256 max_ctx=4096", ctx1024, 16, 8, 256, 4096, fp8);
  time_decode("fp8 decode B=131 ctx 100..2000 NH=16 NKV=8 P=256 max_ctx=4096", random_lengths(131, 100, 2000, 41),
              16, 8, 256, 4096, fp8);
  time_decode("fp8 decode B=256 ctx=512 NH=32 NKV=8 P=256 max_ctx=4096", std::vector<int>(256, 512), 32, 8, 256,
              4096, fp8);
}

// Prefill of S sequences of L tokens (no cached prefix). Causal FLOPs: 4 * D * NH * sum over queries of
// (keys seen) — QK^T and PV, 2 FLOPs per multiply-add each.
TEST(timing_prefill) {
  REQUIRE_GPU();
  const int S = 64, L = 2048, NH = 16, NKV = 8, P = 256, T = S * L, MB = L / P;
  std::vector<int> lens(S, L), cu(S + 1);
  for (int b = 0; b <= S; b++) cu[b] = b * L;
  int NB = 0;
  std::vector<int> bt = shuffled_tables(lens, P, MB, NB, 32);
  const size_t cache = (size_t)NB * NKV * P * HEAD_DIM;
  bf16* k = device_random(cache, 4);
  bf16* v = device_random(cache, 5);
  bf16* qkv = device_random((size_t)T * (NH + 2 * NKV) * HEAD_DIM, 6);
  int* d_cu = to_device(cu);
  int* d_lens = to_device(lens);
  int* d_bt = to_device(bt);
  bf16* out = nullptr;
  CUDA_CHECK(cudaMalloc(&out, (size_t)T * NH * HEAD_DIM * sizeof(bf16)));
  double us = median_us(
      [&] {
        attention_prefill(out, qkv, bf16_kv_layer(k, v), d_cu, d_lens, d_bt, S, L, NH, NKV, P, MB,
                          1.f / sqrtf(128.f), 0);
      },
      7);
  const double flops = 4.0 * HEAD_DIM * NH * S * ((double)L * (L + 1) / 2);
  printf("    TIMING prefill %d x %d NH=%d NKV=%d P=%d: %.0f us, %.1f TFLOP/s, %.0f tok/s (1 layer)\n",
         S, L, NH, NKV, P, us, flops / us / 1e6, T / us * 1e6);
  CHECK_MSG(count_nonfinite(out, (size_t)T * NH * HEAD_DIM) == 0, "non-finite prefill output");
  for (void* p : {(void*)k, (void*)v, (void*)qkv, (void*)d_cu, (void*)d_lens, (void*)d_bt, (void*)out})
    CUDA_CHECK(cudaFree(p));
}

int main(int argc, char** argv) {
  if (have_gpu()) {
    cudaDeviceProp p;
    CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
    printf("GPU: %s (sm_%d%d, %d SMs, %.0f GiB)\n", p.name, p.major, p.minor, p.multiProcessorCount,
           p.totalGlobalMem / 1073741824.0);
  }
  return test_main(argc, argv);
}
