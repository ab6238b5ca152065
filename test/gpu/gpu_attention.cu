// gpu_attention.cu — paged attention, prefill and decode, the way the file climbs:
//   * section 8's plain kernels (attention_prefill, attention_decode) against the CPU reference beside them
//     (attention_reference, fp64 over the same bf16-rounded inputs);
//   * the flash kernels, section 15's flash_attention_prefill and section 16's flash_attention_decode,
//     against the same reference, and against section 8 on the same inputs, within a bound of a few bf16
//     ulps (compare_flash_with_plain says why);
//   * section 19 (the cluster merge, the fused q/k-norm + RoPE + store decode kernel) against section 16,
//     bit for bit;
//   * section 31's fp8 cache, read by the flash kernels (section 8 reads bf16 only), against the reference
//     over the values its bytes stand for;
//   * CUDA-graph replay of both decode kernels as contexts grow; and measurements (TIMING: timing_decode,
//     timing_prefill, figures only), each beside a test that its paths give finite outputs at its shapes.
//
// Every case builds a paged KV cache the way the engine does: blocks handed out in a shuffled order, the
// block-table tail set to -1, and every slot that no sequence owns (spare blocks, the tail of each last
// block) set to NaN, so a kernel that reads a key it should not turns its output into NaN. Outputs and the
// decode workspace are poisoned with NaN bytes before each run, and a guard zone after the output must
// survive. Shapes: 1 token, odd lengths, partial blocks, chunked prefill over a cached prefix, mixed
// batches, P = 16 to 256, GQA ratios 1 to 16, contexts up to 4000.
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

// A test's cache in either format. Part II's launchers are templates over the cache format (section 15's
// F: KVBf16, or section 31's KVFp8); with_format picks the instance at run time, as an engine's stages do once
// for a run, and calls fn(F{}, the layer as F's launchers take it).
enum class KVCacheDtype { BF16, FP8 };
struct KVView {
  void *k, *v;  // [NB, NKV, P, D] bf16, or e4m3 bytes
  KVCacheDtype dtype;
  KVScales scale;  // fp8
};
template <class Fn>
static void with_format(const KVView& c, Fn fn) {
  if (c.dtype == KVCacheDtype::FP8) fn(KVFp8{}, KVLayerFp8{(fp8e4m3*)c.k, (fp8e4m3*)c.v, c.scale});
  else fn(KVBf16{}, KVLayer{(bf16*)c.k, (bf16*)c.v});
}

// The batch with an fp8 cache (section 31): every owned key and value replaced by what its e4m3 byte at
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

// Bytes per stored key or value: bf16, or (section 31) one e4m3 byte.
static size_t kv_value_bytes(KVCacheDtype d) { return d == KVCacheDtype::FP8 ? 1 : 2; }

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
  // The cache as section 8's kernels take it (bf16 only).
  KVLayer layer() const {
    if (dtype != KVCacheDtype::BF16) die("internal error: DeviceBatch::layer: section 8 reads bf16 only");
    return {(bf16*)k, (bf16*)v};
  }
  // The cache as Part II's kernels are told to read it; read_factor != 1 lies about the scales (a test of
  // the test).
  KVView view(float read_factor = 1.f) const {
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

// bf16 ulps between two bf16 values (their bit patterns as ordered integers); NaN: a large number.
static int bf16_ulps(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return INT_MAX;
  auto ordered = [](float x) {
    const bf16 h = __float2bfloat16(x);
    const int bits = *reinterpret_cast<const uint16_t*>(&h);
    return bits & 0x8000 ? -(bits & 0x7fff) : bits;
  };
  return std::abs(ordered(a) - ordered(b));
}

// Section 15 against section 8 on the same inputs. Both multiply bf16 inputs and accumulate in fp32, and
// round each output to bf16 once; they add in different orders, and section 15 rounds each probability
// p_j = exp(s_j - m) to bf16 before P V (its tensor cores take bf16 operands). That rounding moves an output
// by at most 2^-8 * sum_j p_j |v_j| / sum_j p_j <= 2^-8 * max|v| = 2^-8 here (values lie in [-1, 1)), and the
// two final roundings by half an ulp each, an ulp of x being at most 2^-7 |x|. The bound, with an ulp to
// spare for the fp32 sums: |flash - plain| <= 2^-8 + 2^-6 |plain|. Prints how many outputs differ at all,
// the largest difference, and the element nearest the bound (index, both values, the fraction of the bound
// it uses, its distance in bf16 ulps); on failure, the worst element outside it.
static void compare_flash_with_plain(const char* what, const std::vector<float>& flash,
                                     const std::vector<float>& plain) {
  const double atol = 1.0 / 256, rtol = 1.0 / 64;
  size_t worst = 0, outside = 0, differ = 0;
  double worst_share = -1, max_diff = 0;
  for (size_t i = 0; i < flash.size(); i++) {
    const double e = std::isnan(flash[i]) || std::isnan(plain[i]) ? INFINITY : fabs((double)flash[i] - plain[i]);
    const double share = e / (atol + rtol * fabs((double)plain[i]));
    if (share > worst_share) worst_share = share, worst = i;
    outside += !(share <= 1);
    differ += !(flash[i] == plain[i]);
    max_diff = std::max(max_diff, e);
  }
  printf("    %-58s vs section 8: %zu of %zu differ, max |diff| %.2e; nearest the bound [%zu]: %.5f vs %.5f "
         "(%.2f of it, %d ulps)\n", what, differ, flash.size(), max_diff, worst, flash[worst], plain[worst],
         worst_share, bf16_ulps(flash[worst], plain[worst]));
  CHECK_MSG(outside == 0, "%s: section 15 vs section 8: %zu of %zu outside 2^-8 + 2^-6 |plain|; worst at "
            "[%zu]: flash %.6f, plain %.6f (%.2f x the bound, %d ulps)", what, outside, flash.size(), worst,
            flash[worst], plain[worst], worst_share, bf16_ulps(flash[worst], plain[worst]));
}

// fp8 (section 31): the cache is stored in e4m3 at `scale` and the reference reads the values it stands for;
// read_factor != 1 tells the kernel the wrong scales and expects the comparison to fail. Section 8 reads bf16
// only, so fp8 cases run the flash kernels (and the cluster merge) alone.
struct KVChoice {
  KVCacheDtype dtype = KVCacheDtype::BF16;
  KVScales scale;
  float read_factor = 1.f;
};
// The fp8 cache as the fp8 tests store it (section 31's tests, below): scales other than 1 on purpose.
static const KVChoice kFp8{KVCacheDtype::FP8, {0.25f, 2.f}, 1.f};

static const PagedBatch& reference_input(const PagedBatch& pb, const KVChoice& kv, PagedBatch& holder) {
  if (kv.dtype == KVCacheDtype::BF16) return pb;
  holder = with_fp8_values(pb, kv.scale);
  return holder;
}

static std::string label(const char* what, const char* path) { return std::string(what) + " " + path; }

// Section 16's attention_prefill_step on a batch whose first nd sequences have one query row (a mixed step's
// decode rows): those through the decode kernel (with and without the cluster merge), the rest through
// section 15's prefill kernel. Against the fp64 reference; the prompt rows bit for bit what section 15's
// prefill kernel gave for the whole batch (flash), the decode rows bit for bit what the decode path gives for
// those nd sequences alone.
static void check_prefill_step(const char* what, const PagedBatch& pb, const DeviceBatch& db, const KVChoice& kv,
                               int nd, int max_q, const std::vector<float>& want, const std::vector<float>& flash) {
  const float scale = 1.f / sqrtf((float)HEAD_DIM);
  const size_t n = (size_t)pb.T * pb.NH * HEAD_DIM, row = (size_t)pb.NH * HEAD_DIM;
  const int max_ctx = *std::max_element(pb.k_lens.begin(), pb.k_lens.end());
  const size_t ws_bytes = flash_decode_workspace_bytes(pb.B, pb.NH, max_ctx);
  float* ws = nullptr;
  CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
  StepInputs in{nullptr, nullptr, nullptr, db.cu_q, db.k_lens, db.block_tables, max_q, nd};
  const Optimizations saved = g_opt;
  for (bool cluster : {false, true}) {
    if (cluster && !(nd <= DECODE_CLUSTER_MAX_B && decode_clusters_supported())) continue;
    g_opt.cluster_merge = cluster;  // the decode rows' kernel as apply_cluster_merge (section 19) chooses it
    const std::string name = label(what, cluster ? "[prefill step, decode rows with cluster merge, 18]"
                                                 : "[prefill step, decode rows through section 15]");
    PoisonedOutput out(n), alone((size_t)nd * row);
    CUDA_CHECK(cudaMemset(ws, 0xFF, ws_bytes));
    with_format(db.view(kv.read_factor), [&](auto f, const auto& layer) {
      using F = decltype(f);
      attention_prefill_step<F>(out.d, db.qkv, layer, in, pb.B, pb.NH, pb.NKV, pb.P, pb.MB, max_ctx, ws, scale, 0,
                                cluster ? attention_decode_cluster<F> : flash_attention_decode<F>);
    });
    const std::vector<float> got = out.read();
    compare(name.c_str(), got, want, kv.read_factor == 1.f);
    with_format(db.view(kv.read_factor), [&](auto f, const auto& layer) {
      attention_decode_fast<decltype(f)>(alone.d, db.qkv, layer, db.k_lens, db.block_tables, nd, pb.NH, pb.NKV,
                                         pb.P, pb.MB, max_ctx, ws, scale, 0, nullptr);
    });
    const std::vector<float> dec = alone.read();
    size_t differ_decode = 0, differ_prompt = 0;
    for (size_t i = 0; i < (size_t)nd * row; i++) differ_decode += got[i] != dec[i];
    for (size_t i = (size_t)nd * row; i < n; i++) differ_prompt += got[i] != flash[i];
    CHECK_MSG(differ_decode == 0 && differ_prompt == 0,
              "%s: %zu decode-row values differ from the decode path alone, %zu prompt-row values from section 15",
              name.c_str(), differ_decode, differ_prompt);
  }
  g_opt = saved;
  CUDA_CHECK(cudaFree(ws));
}

// Section 8's prefill kernel (bf16) and section 15's, each against the fp64 reference; then 14 against 8.
// Where the batch starts with one-row sequences, section 15's prefill step too (check_prefill_step).
static void check_prefill(const char* what, const PagedBatch& pb, const KVChoice& kv = {}) {
  DeviceBatch db(pb, kv.dtype, kv.scale);
  const int max_q = *std::max_element(pb.q_lens.begin(), pb.q_lens.end());
  const float scale = 1.f / sqrtf((float)HEAD_DIM);
  const size_t n = (size_t)pb.T * pb.NH * HEAD_DIM;
  PagedBatch holder;
  const std::vector<float> want = reference_attention(reference_input(pb, kv, holder));
  std::vector<float> plain;
  if (kv.dtype == KVCacheDtype::BF16) {
    PoisonedOutput out(n);
    attention_prefill(out.d, db.qkv, db.layer(), db.cu_q, db.k_lens, db.block_tables, pb.B, max_q, pb.NH, pb.NKV,
                      pb.P, pb.MB, scale, 0);
    plain = out.read();
    compare(label(what, "[section 8]").c_str(), plain, want);
  }
  PoisonedOutput out(n);
  with_format(db.view(kv.read_factor), [&](auto f, const auto& layer) {
    flash_attention_prefill<decltype(f)>(out.d, db.qkv, layer, db.cu_q, db.k_lens, db.block_tables, pb.B, max_q,
                                         pb.NH, pb.NKV, pb.P, pb.MB, scale, 0);
  });
  const std::vector<float> flash = out.read();
  compare(label(what, "[section 15]").c_str(), flash, want, kv.read_factor == 1.f);
  if (!plain.empty()) compare_flash_with_plain(label(what, "[section 15]").c_str(), flash, plain);
  int nd = 0;  // leading sequences with one query row: a mixed step's decode rows
  while (nd < pb.B && pb.q_lens[nd] == 1) nd++;
  if (nd) check_prefill_step(what, pb, db, kv, nd, max_q, want, flash);
}

// Section 8's decode kernel (bf16); section 16's split-K kernel with its merge kernel; and section 19's
// cluster merge where it applies (batches of at most DECODE_CLUSTER_MAX_B on sm_90 and later): each against
// the fp64 reference, and the Part II ones against section 8.
static void check_decode(const char* what, const PagedBatch& pb, int max_context_len, const KVChoice& kv = {}) {
  DeviceBatch db(pb, kv.dtype, kv.scale);
  const float scale = 1.f / sqrtf((float)HEAD_DIM);
  const size_t n = (size_t)pb.B * pb.NH * HEAD_DIM;
  PagedBatch holder;
  const std::vector<float> want = reference_attention(reference_input(pb, kv, holder));
  std::vector<float> plain;
  if (kv.dtype == KVCacheDtype::BF16) {
    PoisonedOutput out(n);
    attention_decode(out.d, db.qkv, db.layer(), db.k_lens, db.block_tables, pb.B, pb.NH, pb.NKV, pb.P, pb.MB,
                     scale, 0);
    plain = out.read();
    compare(label(what, "[section 8]").c_str(), plain, want);
  }
  const size_t ws_bytes = flash_decode_workspace_bytes(pb.B, pb.NH, max_context_len);
  float* ws = nullptr;
  CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
  const bool cluster = pb.B <= DECODE_CLUSTER_MAX_B && decode_clusters_supported();
  for (int path = 0; path < (cluster ? 2 : 1); path++) {
    PoisonedOutput out(n);
    CUDA_CHECK(cudaMemset(ws, 0xFF, ws_bytes));
    if (path == 0) {
      with_format(db.view(kv.read_factor), [&](auto f, const auto& layer) {
        flash_attention_decode<decltype(f)>(out.d, db.qkv, layer, db.k_lens, db.block_tables, pb.B, pb.NH, pb.NKV,
                                            pb.P, pb.MB, max_context_len, ws, scale, 0);
      });
    } else {
      const Optimizations saved = g_opt;
      g_opt.cluster_merge = true;
      with_format(db.view(kv.read_factor), [&](auto f, const auto& layer) {
        attention_decode_fast<decltype(f)>(out.d, db.qkv, layer, db.k_lens, db.block_tables, pb.B, pb.NH, pb.NKV,
                                           pb.P, pb.MB, max_context_len, ws, scale, 0, nullptr);
      });
      g_opt = saved;
    }
    const std::string name = label(what, path ? "[cluster merge, 19]" : "[section 16]");
    const std::vector<float> got = out.read();
    compare(name.c_str(), got, want, kv.read_factor == 1.f);
    if (!plain.empty()) compare_flash_with_plain(name.c_str(), got, plain);
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

// A mixed step (--scheduler mixed): many decoding sequences first (one query row each, contexts from 1 to
// 2000 keys), then prompt chunks over cached prefixes and a prompt whose last token is left. 3 decode rows
// take the cluster kernel where there is one; 40 the split-K kernel with its merge.
TEST(prefill_step_with_decode_rows) {
  REQUIRE_GPU();
  for (int nd : {3, 40}) {
    std::vector<int> q(nd, 1), k = random_lengths(nd, 1, 2000, 200 + nd);
    for (int x : {130, 1, 300}) q.push_back(x);
    for (int x : {400, 77, 300}) k.push_back(x);
    const std::string name = "prefill step, " + std::to_string(nd) + " decode rows + 3 sequences";
    check_prefill((name + " P=16 NH=16 NKV=8").c_str(), make_batch(16, 8, 16, q, k, 300 + nd));
    check_prefill((name + " P=256 NH=32 NKV=8").c_str(), make_batch(32, 8, 256, q, k, 310 + nd));
    check_prefill(("fp8 " + name + " P=16 NH=16 NKV=8").c_str(), make_batch(16, 8, 16, q, k, 320 + nd), kFp8);
  }
}

TEST(prefill_long_peaky) {
  REQUIRE_GPU();
  check_prefill("prefill q=2048 k=2048 P=256 NH=16 NKV=8, q x4 (peaky)",
                make_batch(16, 8, 256, {2048}, {2048}, 10, 4.f));
}

// GQA ratios NH/NKV of 1, 2 and 8 (Qwen3-0.6B is 2, Qwen3-32B is 8), each at P = 16 and 256, with a
// cached prefix and partial blocks.
TEST(prefill_gqa_ratios) {
  REQUIRE_GPU();
  const std::vector<int> q = {1, 37, 300}, k = {17, 37, 1100};
  check_prefill("prefill GQA 1 (NH=4 NKV=4) B=3 P=16", make_batch(4, 4, 16, q, k, 71));
  check_prefill("prefill GQA 1 (NH=4 NKV=4) B=3 P=256", make_batch(4, 4, 256, q, k, 72));
  check_prefill("prefill GQA 2 (NH=8 NKV=4) B=3 P=16", make_batch(8, 4, 16, q, k, 73));
  check_prefill("prefill GQA 2 (NH=8 NKV=4) B=3 P=256", make_batch(8, 4, 256, q, k, 74));
  check_prefill("prefill GQA 8 (NH=16 NKV=2) B=3 P=16", make_batch(16, 2, 16, q, k, 75));
  check_prefill("prefill GQA 8 (NH=64 NKV=8) B=3 P=256", make_batch(64, 8, 256, q, k, 76));
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

TEST(decode_gqa_ratios) {
  REQUIRE_GPU();
  const std::vector<int> ctx = {1, 31, 257, 2500, 700};
  const std::vector<int> ones(ctx.size(), 1);
  check_decode("decode GQA 1 (NH=4 NKV=4) B=5 P=16", make_batch(4, 4, 16, ones, ctx, 81), 4096);
  check_decode("decode GQA 1 (NH=4 NKV=4) B=5 P=256", make_batch(4, 4, 256, ones, ctx, 82), 2560);
  check_decode("decode GQA 2 (NH=8 NKV=4) B=5 P=16", make_batch(8, 4, 16, ones, ctx, 83), 2500);
  check_decode("decode GQA 2 (NH=8 NKV=4) B=5 P=256", make_batch(8, 4, 256, ones, ctx, 84), 4096);
  check_decode("decode GQA 8 (NH=16 NKV=2) B=5 P=16", make_batch(16, 2, 16, ones, ctx, 85), 4096);
  check_decode("decode GQA 8 (NH=64 NKV=8) B=5 P=256 peaky", make_batch(64, 8, 256, ones, ctx, 86, 4.f), 4096);
  check_decode("decode GQA 8 (NH=32 NKV=4) B=2 P=16", make_batch(32, 4, 16, {1, 1}, {3001, 2}, 87), 3072);
  // Head counts the merge kernel's 4 heads per thread block do not divide: one rank's share at tensor
  // parallelism 8 of Qwen3-14B (40 / 8 heads, 8 / 8 kv heads) and of Qwen3-0.6B (16 / 8, 8 / 8).
  check_decode("decode GQA 5 (NH=5 NKV=1) B=5 P=16", make_batch(5, 1, 16, ones, ctx, 88), 4096);
  check_decode("decode GQA 2 (NH=2 NKV=1) B=40 P=64", make_batch(2, 1, 64, std::vector<int>(40, 1),
                                                                    random_lengths(40, 1, 2000, 89), 90), 2048);
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

// The engine captures decode once per batch size and replays it as contexts grow and blocks change: one
// capture, three steps whose every context is longer than at the step before (new contents, new blocks),
// each replay against the fp64 reference and bit for bit against the same kernel run eagerly on the same
// inputs. plain: section 8's kernel (its grid depends on B alone); else section 16's (a grid sized by
// max_context_len, the bound every step stays under).
static void check_decode_graph_replay(bool plain) {
  const int B = 32, NH = 16, NKV = 8, P = 64, max_ctx = 2048, MB = max_ctx / P, NB = B * MB + 3;
  const std::vector<int> ones(B, 1);
  std::vector<std::vector<int>> lens = {random_lengths(B, 1, 700, 24)};
  Rng grow{26};
  for (int step = 1; step < 3; step++) {
    std::vector<int> next = lens.back();
    for (int& c : next) c += grow.range(1, std::max(1, (max_ctx - c) / (3 - step)));
    lens.push_back(next);
  }
  std::vector<PagedBatch> steps;
  for (int step = 0; step < 3; step++)
    steps.push_back(make_batch(NH, NKV, P, ones, lens[step], 25 + 2 * step, 1.f + step, MB, NB));
  DeviceBatch db(steps[0]);
  PoisonedOutput out((size_t)B * NH * HEAD_DIM), eager((size_t)B * NH * HEAD_DIM);
  const size_t ws_bytes = flash_decode_workspace_bytes(B, NH, max_ctx);
  float* ws = nullptr;
  CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
  const float scale = 1.f / sqrtf((float)HEAD_DIM);
  auto launch = [&](bf16* o, cudaStream_t st) {
    if (plain)
      attention_decode(o, db.qkv, db.layer(), db.k_lens, db.block_tables, B, NH, NKV, P, MB, scale, st);
    else
      flash_attention_decode(o, db.qkv, db.layer(), db.k_lens, db.block_tables, B, NH, NKV, P, MB, max_ctx, ws,
                             scale, st);
  };
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  launch(out.d, stream);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const char* path = plain ? "section 8" : "section 16";
  for (int step = 0; step < 3; step++) {
    const PagedBatch* pb = &steps[step];
    // New step: same buffers, new contents (what ModelRunner.prepare_decode does before a replay).
    CUDA_CHECK(cudaMemcpy(db.qkv, to_bf16(pb->qkv).data(), pb->qkv.size() * sizeof(bf16),
                          cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(db.k, to_bf16(pb->k).data(), pb->k.size() * sizeof(bf16), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(db.v, to_bf16(pb->v).data(), pb->v.size() * sizeof(bf16), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(db.k_lens, pb->k_lens.data(), B * sizeof(int), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(db.block_tables, pb->block_tables.data(), pb->block_tables.size() * sizeof(int),
                          cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(out.d, 0xFF, out.n * sizeof(bf16)));
    CUDA_CHECK(cudaMemset(eager.d, 0xFF, eager.n * sizeof(bf16)));
    CUDA_CHECK(cudaMemset(ws, 0xFF, ws_bytes));
    // The copies and memsets above ran on the legacy default stream, which does not order work on a
    // cudaStreamNonBlocking stream: wait for them before the replay reads their results.
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<float> replayed = out.read();
    launch(eager.d, stream);  // the same kernel eagerly, on the same inputs
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<float> direct = eager.read();
    const auto [lo, hi] = std::minmax_element(pb->k_lens.begin(), pb->k_lens.end());
    char what[96];
    snprintf(what, sizeof what, "decode graph replay %d (%s): B=32 ctx %d..%d", step + 1, path, *lo, *hi);
    compare(what, replayed, reference_attention(*pb));
    size_t differ = 0;
    for (size_t i = 0; i < replayed.size(); i++)
      differ += memcmp(&replayed[i], &direct[i], sizeof(float)) != 0;
    CHECK_MSG(differ == 0, "%s: %zu outputs differ from the eager run", what, differ);
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
  CUDA_CHECK(cudaFree(ws));
}

TEST(decode_cuda_graph_replay) {
  REQUIRE_GPU();
  check_decode_graph_replay(false);
}

TEST(decode_plain_cuda_graph_replay) {
  REQUIRE_GPU();
  check_decode_graph_replay(true);
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
// The same, per launch, for `reps` launches issued back to back between the two events. median_us also times
// the host's launch latency (the GPU waits for the launch); back to back, the next launch is issued while the
// one before it runs, as kernels follow one another in the engine's CUDA graphs.
template <class F>
static double median_us_back_to_back(F&& launch, int reps = 10) {
  return median_us([&] {
           for (int r = 0; r < reps; r++) launch();
         }) / reps;
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

// Decode at a fixed batch: KV bytes read = sum(ctx) * NKV * D * (2 bytes, fp8: 1) * (K and V). The cache
// (hundreds of MB) is far larger than L2, so every run reads it from HBM. Three paths over the same inputs:
// section 16's kernel (with its merge kernel), the engine's default decode path (section 19), and section 8's
// plain kernel (bf16 only; each query head of a GQA group reads the group's keys again, from L2 if they are
// still there: its GB/s counts the bytes once, as the others do). decode_timing_shapes_give_finite_outputs runs each
// once and checks its output; timing_decode times them.
struct DecodeShape {
  const char* what;
  std::vector<int> ctx;
  int NH, NKV, P, max_ctx;
  KVCacheDtype dtype;
};
struct DecodeBench {
  std::vector<int> ctx;
  int B, NH, NKV, P, MB, max_ctx;
  KVCacheDtype dtype;
  bool fp8, fuse;
  void *k, *v;
  bf16 *qkv, *out, *w;
  int *d_ctx, *d_bt, *d_pos, *d_slots;
  float* ws;
  explicit DecodeBench(const DecodeShape& sh)
      : ctx(sh.ctx), B((int)sh.ctx.size()), NH(sh.NH), NKV(sh.NKV), P(sh.P), MB((int)cdiv(sh.max_ctx, sh.P)),
        max_ctx(sh.max_ctx), dtype(sh.dtype), fp8(sh.dtype == KVCacheDtype::FP8) {
    int NB = 0;
    std::vector<int> bt = shuffled_tables(ctx, P, MB, NB, 31);
    const size_t cache = (size_t)NB * NKV * P * HEAD_DIM;
    k = fp8 ? device_random_e4m3(cache, 1) : (void*)device_random(cache, 1);
    v = fp8 ? device_random_e4m3(cache, 2) : (void*)device_random(cache, 2);
    qkv = device_random((size_t)B * (NH + 2 * NKV) * HEAD_DIM, 3);
    d_ctx = to_device(ctx);
    d_bt = to_device(bt);
    CUDA_CHECK(cudaMalloc(&out, (size_t)B * NH * HEAD_DIM * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&ws, flash_decode_workspace_bytes(B, NH, max_ctx)));
    // The engine's path fuses q/k-norm, RoPE and the store into the kernel (padding slots here, so the cache
    // is not written) where the engine does: a bf16 cache, or small batches; elsewhere they run in the kernel
    // before it, which is not timed here.
    fuse = !fp8 || B <= DECODE_CLUSTER_MAX_B;
    std::vector<int> pos(B), no_slots(B, -1);
    for (int b = 0; b < B; b++) pos[b] = ctx[b] - 1;
    d_pos = to_device(pos), d_slots = to_device(no_slots);
    w = device_random(HEAD_DIM, 4);
  }
  ~DecodeBench() {
    for (void* p : {(void*)d_pos, (void*)d_slots, (void*)w}) CUDA_CHECK(cudaFree(p));
    for (void* p : {k, v, (void*)qkv, (void*)d_ctx, (void*)d_bt, (void*)out, (void*)ws}) CUDA_CHECK(cudaFree(p));
  }
  KVView view() const { return KVView{k, v, dtype, {}}; }
  void flash() {
    with_format(view(), [&](auto f, const auto& layer) {
      flash_attention_decode<decltype(f)>(out, qkv, layer, d_ctx, d_bt, B, NH, NKV, P, MB, max_ctx, ws,
                                          1.f / sqrtf(128.f), 0);
    });
  }
  // The decode attention section 14's forward_fast runs (at batches of 1, 2 and 4 the persistent kernel may
  // take the whole step instead): section 19's kernel, at small batches with its cluster merge.
  void engine() {
    const Optimizations saved = g_opt;
    g_opt.cluster_merge = true;  // the engine's default (where the GPU has clusters)
    const DecodeRope rope{d_pos, d_slots, w, w, 1e-6f, rope_inv_freq(1e6f)};
    with_format(view(), [&](auto f, const auto& layer) {
      attention_decode_fast<decltype(f)>(out, qkv, layer, d_ctx, d_bt, B, NH, NKV, P, MB, max_ctx, ws,
                                         1.f / sqrtf(128.f), 0, fuse ? &rope : nullptr);
    });
    g_opt = saved;
  }
  void plain() {  // bf16 only
    attention_decode(out, qkv, KVLayer{(bf16*)k, (bf16*)v}, d_ctx, d_bt, B, NH, NKV, P, MB, 1.f / sqrtf(128.f),
                     0);
  }
  size_t nonfinite_out() const { return count_nonfinite(out, (size_t)B * NH * HEAD_DIM); }
  double kv_bytes() const {
    double tokens = 0;
    for (int c : ctx) tokens += c;
    return tokens * NKV * HEAD_DIM * kv_value_bytes(dtype) * 2;
  }
};
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

// Section 19's fused kernel (q/k-norm, RoPE and the KV store inside decode attention) against the kernels
// it replaces, qk_norm_rope then section 16's flash_attention_decode, on the same raw qkv and cache: the
// outputs of the real rows and the whole cache afterwards must be equal bit for bit. Where the cluster merge
// applies (section 19), the same again with it on both sides, and (contexts of at most 1024 keys, where its
// partition length equals section 16's 64 keys: a bf16 cache) the cluster path against section 16 too.
// The last n_pad rows are padding (slot -1, as the engine pads a graph's batch): every path stores nothing
// for them; their outputs are not compared (the fused kernel attends to the row's own k and v, the separate
// path to what the cache held).
// The separate path's q/k-norm and RoPE is section 19's eight-lane kernel, whose pieces the fused kernel uses.
// fp8 (section 31): the same over an e4m3 cache at these scales (qk_norm_rope_fp8 stores e4m3); this step's
// k and v are then the values their bytes stand for on both sides.
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
  const size_t cache_bytes = cache * kv_value_bytes(dtype);
  void* k0 = fp8 ? device_random_e4m3(cache, seed + 1) : (void*)device_random(cache, seed + 1);
  void* v0 = fp8 ? device_random_e4m3(cache, seed + 2) : (void*)device_random(cache, seed + 2);
  bf16* qkv0 = device_random((size_t)B * W, seed + 3);
  bf16 *qw = device_random(HEAD_DIM, seed + 4), *kw = device_random(HEAD_DIM, seed + 5);
  int *d_ctx = to_device(ctx), *d_bt = to_device(bt), *d_pos = to_device(pos), *d_slots = to_device(slots);
  float* ws = nullptr;
  CUDA_CHECK(cudaMalloc(&ws, flash_decode_workspace_bytes(B, NH, max_ctx)));
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
    const KVView view{k, v, dtype, kv_scale};
    PoisonedOutput out((size_t)B * NH * HEAD_DIM);
    CUDA_CHECK(cudaMemset(ws, 0xFF, flash_decode_workspace_bytes(B, NH, max_ctx)));
    with_format(view, [&](auto f, const auto& layer) {
      using F = decltype(f);
      if (fused) {
        const DecodeRope rope{d_pos, d_slots, qw, kw, eps, rope_inv_freq(theta)};
        attention_decode_fast<F>(out.d, qkv, layer, d_ctx, d_bt, B, NH, NKV, P, MB, max_ctx, ws, scale, 0, &rope);
      } else {  // (without the cluster merge, attention_decode_fast is flash_attention_decode)
        if constexpr (std::is_same<F, KVFp8>::value)
          qk_norm_rope_fp8(qkv, d_pos, qw, kw, layer, d_slots, B, NH, NKV, P, theta, eps, 0);
        else
          qk_norm_rope_fast(qkv, d_pos, qw, kw, layer, d_slots, B, NH, NKV, P, theta, eps, 0);
        attention_decode_fast<F>(out.d, qkv, layer, d_ctx, d_bt, B, NH, NKV, P, MB, max_ctx, ws, scale, 0, nullptr);
      }
    });
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
  compare_bits(1, 0, "fused vs section 16");
  if (cluster) compare_bits(3, 2, "fused vs separate, cluster");
  const int partition = fp8 ? DecodeLoop<KVFp8>::partition(B) : DecodeLoop<KVBf16>::partition(B);
  if (cluster && *std::max_element(ctx.begin(), ctx.end()) <= 1024 && partition == ATTN_KV_TILE)
    compare_bits(2, 0, "cluster vs section 16");
  // the store happened: every real row's slot changed (random values repeat by chance only rarely)
  std::vector<uint8_t> k_before = download_bytes(k0, cache_bytes);
  size_t stored = 0;
  const size_t row_bytes = HEAD_DIM * kv_value_bytes(dtype);
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

// ---- section 31: the fp8 cache ------------------------------------------------------------------------------
// The kernels read e4m3 bytes and widen them exactly, so against the fp64 reference over the values the
// bytes stand for they are held to the bf16 tolerance. Scales other than 1 on purpose (kFp8, above:
// keys 1/4, values 2).

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

// Section 19 with an fp8 cache: the fused kernel keeps this step's key and value in shared memory as the values
// their bytes stand for, so its outputs and the bytes it stores equal qk_norm_rope_fp8 + section 16's, bit
// for bit.
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

// The decode shapes timed (DecodeBench allocates each in turn: several caches are hundreds of MB).
static std::vector<DecodeShape> decode_timing_shapes() {
  const std::vector<int> ctx1024(128, 1024), mixed = random_lengths(131, 100, 2000, 41);
  const KVCacheDtype bf16 = KVCacheDtype::BF16, fp8 = KVCacheDtype::FP8;
  return {
      {"decode B=128 ctx=1024 NH=16 NKV=8 P=256 max_ctx=1024", ctx1024, 16, 8, 256, 1024, bf16},
      {"decode B=128 ctx=1024 NH=16 NKV=8 P=256 max_ctx=4096", ctx1024, 16, 8, 256, 4096, bf16},
      {"decode B=128 ctx=1024 NH=16 NKV=8 P=16  max_ctx=4096", ctx1024, 16, 8, 16, 4096, bf16},
      {"decode B=131 ctx 100..2000 NH=16 NKV=8 P=256 max_ctx=4096", mixed, 16, 8, 256, 4096, bf16},
      {"decode B=256 ctx=512 NH=32 NKV=8 P=256 max_ctx=4096", std::vector<int>(256, 512), 32, 8, 256, 4096, bf16},
      {"decode B=1 ctx=4096 NH=16 NKV=8 P=256 max_ctx=4096", {4096}, 16, 8, 256, 4096, bf16},
      // 268 MB, the KV bytes of the fp8 row at B = 128 below (bf16 at half the batch reads as many bytes).
      {"decode B=64 ctx=1024 NH=16 NKV=8 P=256 max_ctx=4096", std::vector<int>(64, 1024), 16, 8, 256, 4096, bf16},
      {"fp8 decode B=1 ctx=4096 NH=16 NKV=8 P=256 max_ctx=4096", {4096}, 16, 8, 256, 4096, fp8},
      {"fp8 decode B=128 ctx=1024 NH=16 NKV=8 P=256 max_ctx=4096", ctx1024, 16, 8, 256, 4096, fp8},
      // 537 MB, the KV bytes of the bf16 rows at B = 128 above.
      {"fp8 decode B=256 ctx=1024 NH=16 NKV=8 P=256 max_ctx=4096", std::vector<int>(256, 1024), 16, 8, 256, 4096,
       fp8},
      {"fp8 decode B=131 ctx 100..2000 NH=16 NKV=8 P=256 max_ctx=4096", mixed, 16, 8, 256, 4096, fp8},
      {"fp8 decode B=256 ctx=512 NH=32 NKV=8 P=256 max_ctx=4096", std::vector<int>(256, 512), 32, 8, 256, 4096, fp8},
  };
}

// Each timed path once at each timed shape: its output is finite.
TEST(decode_timing_shapes_give_finite_outputs) {
  REQUIRE_GPU();
  for (const DecodeShape& sh : decode_timing_shapes()) {
    DecodeBench d(sh);
    d.flash();
    CHECK_MSG(d.nonfinite_out() == 0, "%s: non-finite output (section 16)", sh.what);
    d.engine();
    CHECK_MSG(d.nonfinite_out() == 0, "%s: non-finite output (the engine's path)", sh.what);
    if (d.fp8) continue;
    d.plain();
    CHECK_MSG(d.nonfinite_out() == 0, "%s: non-finite output (section 8)", sh.what);
  }
}

TIMING(timing_decode) {
  REQUIRE_GPU();
  for (const DecodeShape& sh : decode_timing_shapes()) {
    DecodeBench d(sh);
    const double bytes = d.kv_bytes(), us = median_us([&] { d.flash(); });
    const double us_fused = median_us([&] { d.engine(); });
    const double us_fused_b2b = median_us_back_to_back([&] { d.engine(); });
    char plain_row[64] = "n/a (bf16 only)";
    if (!d.fp8) {
      const double us_plain = median_us([&] { d.plain(); });
      snprintf(plain_row, sizeof plain_row, "%.1f us, %.0f GB/s", us_plain, bytes / us_plain / 1e3);
    }
    printf("    TIMING %s: KV %.1f MB; section 16 %.1f us, %.0f GB/s; engine (section 19%s) %.1f us, %.0f GB/s, "
           "back to back %.1f us, %.0f GB/s; section 8 %s\n", sh.what, bytes / 1e6, us, bytes / us / 1e3,
           d.fuse ? ", fused rope" : "", us_fused, bytes / us_fused / 1e3, us_fused_b2b, bytes / us_fused_b2b / 1e3,
           plain_row);
  }
}

// Prefill of S sequences of L tokens (no cached prefix). Causal FLOPs: 4 * D * NH * sum over queries of
// (keys seen) — QK^T and PV, 2 FLOPs per multiply-add each. Two paths: section 15's kernel (tensor cores) and
// section 8's (a warp per query row and head, on the CUDA cores).
struct PrefillBench {
  static const int S = 64, L = 2048, NH = 16, NKV = 8, P = 256, T = S * L, MB = L / P;
  bf16 *k, *v, *qkv, *out;
  int *d_cu, *d_lens, *d_bt;
  PrefillBench() {
    std::vector<int> lens(S, L), cu(S + 1);
    for (int b = 0; b <= S; b++) cu[b] = b * L;
    int NB = 0;
    std::vector<int> bt = shuffled_tables(lens, P, MB, NB, 32);
    const size_t cache = (size_t)NB * NKV * P * HEAD_DIM;
    k = device_random(cache, 4);
    v = device_random(cache, 5);
    qkv = device_random((size_t)T * (NH + 2 * NKV) * HEAD_DIM, 6);
    d_cu = to_device(cu);
    d_lens = to_device(lens);
    d_bt = to_device(bt);
    CUDA_CHECK(cudaMalloc(&out, out_elems() * sizeof(bf16)));
  }
  ~PrefillBench() {
    for (void* p : {(void*)k, (void*)v, (void*)qkv, (void*)d_cu, (void*)d_lens, (void*)d_bt, (void*)out})
      CUDA_CHECK(cudaFree(p));
  }
  static size_t out_elems() { return (size_t)T * NH * HEAD_DIM; }
  void run(bool plain) {
    const float scale = 1.f / sqrtf(128.f);
    if (plain) attention_prefill(out, qkv, KVLayer{k, v}, d_cu, d_lens, d_bt, S, L, NH, NKV, P, MB, scale, 0);
    else flash_attention_prefill(out, qkv, KVLayer{k, v}, d_cu, d_lens, d_bt, S, L, NH, NKV, P, MB, scale, 0);
  }
};

TEST(prefill_timing_shape_gives_finite_outputs) {
  REQUIRE_GPU();
  PrefillBench p;
  for (int plain = 0; plain < 2; plain++) {
    CUDA_CHECK(cudaMemset(p.out, 0xFF, p.out_elems() * sizeof(bf16)));  // NaN
    p.run(plain);
    CHECK_MSG(count_nonfinite(p.out, p.out_elems()) == 0, "non-finite prefill output (section %d)",
              plain ? 8 : 15);
  }
}

TIMING(timing_prefill) {
  REQUIRE_GPU();
  PrefillBench p;
  const int S = p.S, L = p.L, NH = p.NH, T = p.T;
  const double flops = 4.0 * HEAD_DIM * NH * S * ((double)L * (L + 1) / 2);
  for (int plain = 0; plain < 2; plain++) {
    const double us = median_us([&] { p.run(plain); }, plain ? 3 : 7);
    printf("    TIMING prefill %d x %d NH=%d NKV=%d P=%d, section %d: %.0f us, %.1f TFLOP/s, %.0f tok/s "
           "(1 layer)\n", S, L, NH, p.NKV, p.P, plain ? 8 : 15, us, flops / us / 1e6, T / us * 1e6);
  }
}

int main(int argc, char** argv) {
  install_default_optimizations();
  if (have_gpu()) {
    cudaDeviceProp p;
    CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
    printf("GPU: %s (sm_%d%d, %d SMs, %.0f GiB)\n", p.name, p.major, p.minor, p.multiProcessorCount,
           p.totalGlobalMem / 1073741824.0);
  }
  return test_main(argc, argv);
}
