// gpu_kernels.cu — sections 7 (elementwise and normalisation kernels), 9 (the sampler) and 20 (the fast
// samplers: section 21's bisection, section 22's radix select) against the CPU references beside them in nanovllm.cu, the
// three samplers against each other token for token, and section 31's fp8 conversions and store. Every case poisons its outputs first (0xFF bytes: bf16 NaN), uses fresh
// random inputs and awkward sizes. Without a visible GPU every GPU case is SKIPPED (never reported as passed).
//   build: make test (or nvcc -std=c++17 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a
//          -o build/gpu_kernels test/gpu/gpu_kernels.cu -lcublasLt -lnccl libutf8proc.a)
//   run:   ./build/gpu_kernels [NAME_SUBSTRING]
#define NANOVLLM_TESTING
#include "../../nanovllm.cu"
#include "../test.h"

// ---- helpers ------------------------------------------------------------------------------------------
#include "gpu_fixtures.h"

static float rb(float x) { return __bfloat162float(__float2bfloat16(x)); }  // round to bf16, as a float
static std::vector<bf16> random_bf16(size_t n, std::mt19937& rng, float mean = 0.f, float stddev = 1.f) {
  std::normal_distribution<float> d(mean, stddev);
  std::vector<bf16> v(n);
  for (auto& x : v) {
    float f;
    do f = d(rng); while (f == 0.f);  // never zeros: a zero hides a missing write
    x = __float2bfloat16(f);
  }
  return v;
}
static std::vector<float> to_float(const std::vector<bf16>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); i++) f[i] = __bfloat162float(v[i]);
  return f;
}
static uint16_t bits_of(bf16 x) {
  uint16_t u;
  memcpy(&u, &x, 2);
  return u;
}
// Milliseconds per call of fn, averaged over iters after a warm-up.
template <class F>
static double time_ms(F fn, int iters = 50) {
  fn();
  CUDA_CHECK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  CUDA_CHECK(cudaEventRecord(a));
  for (int i = 0; i < iters; i++) fn();
  CUDA_CHECK(cudaEventRecord(b));
  CUDA_CHECK(cudaEventSynchronize(b));
  float ms;
  CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  CUDA_CHECK(cudaEventDestroy(a));
  CUDA_CHECK(cudaEventDestroy(b));
  return ms / iters;
}

TEST(gpu_device_info) {
  REQUIRE_GPU();
  cudaDeviceProp p;
  CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
  printf("    GPU: %s, sm_%d%d, %d SMs, %.1f GiB\n", p.name, p.major, p.minor, p.multiProcessorCount,
         p.totalGlobalMem / 1073741824.0);
  CHECK_MSG(p.major >= 8, "the kernels need sm_80 or newer, found sm_%d%d", p.major, p.minor);
}

// ==== section 7 ==========================================================================================

TEST(embedding_rows_and_foreign_ids) {
  REQUIRE_GPU();
  std::mt19937 rng(1);
  for (int T : {1, 37}) {
    const int H = 1032, V_local = 1000, vocab_start = 500;
    auto table = random_bf16((size_t)V_local * H, rng);
    std::vector<int> ids(T);
    std::uniform_int_distribution<int> id(0, 1999);
    for (int& x : ids) x = id(rng);
    int edge[] = {500, 499, 1499, 1500, 0};  // first and last of the shard, their outside neighbours
    for (int i = 0; i < T && i < 5; i++) ids[i] = edge[i];
    DevBuf<bf16> d_table(table), d_out((size_t)T * H);
    DevBuf<int> d_ids(ids);
    d_out.poison();
    embedding(d_out.p, d_ids.p, d_table.p, T, H, vocab_start, V_local, 0);
    auto out = d_out.download();
    int bad = 0;
    for (int t = 0; t < T; t++) {
      int local = ids[t] - vocab_start;
      bool mine = local >= 0 && local < V_local;
      for (int h = 0; h < H; h++) {
        uint16_t want = mine ? bits_of(table[(size_t)local * H + h]) : 0;
        if (bits_of(out[(size_t)t * H + h]) != want && bad++ < 3)
          fprintf(stderr, "    T=%d token %d (id %d) dim %d: got %04x want %04x\n", T, t, ids[t], h,
                  bits_of(out[(size_t)t * H + h]), want);
      }
    }
    CHECK_EQ(bad, 0);
  }
}

// nanovllm.cu's rmsnorm_reference (Hugging Face's roundings). s is the (already bf16) input row.
static void cpu_rmsnorm_row(const float* s, const float* w, int H, float eps, float* out) {
  rmsnorm_reference(out, s, w, H, eps);
}

TEST(rmsnorm_and_add_rmsnorm_match_hf) {
  REQUIRE_GPU();
  std::mt19937 rng(2);
  const float eps = 1e-6f;
  for (int T : {1, 37})
    for (int H : {1024, 1032, 5120, 8192}) {
      size_t n = (size_t)T * H;
      auto x = random_bf16(n, rng, 0.f, 2.f), res = random_bf16(n, rng, 0.f, 3.f);
      auto w = random_bf16(H, rng, 1.f, 0.3f);
      auto xf = to_float(x), rf = to_float(res), wf = to_float(w);
      DevBuf<bf16> d_x(x), d_res(res), d_w(w), d_out(n);
      char what[96];
      // rmsnorm
      d_out.poison();
      rmsnorm(d_out.p, d_x.p, d_w.p, T, H, eps, 0);
      std::vector<float> want(n), got = to_float(d_out.download());
      for (int t = 0; t < T; t++)
        cpu_rmsnorm_row(&xf[(size_t)t * H], wf.data(), H, eps, &want[(size_t)t * H]);
      snprintf(what, sizeof what, "rmsnorm T=%d H=%d", T, H);
      check_close(what, got.data(), want.data(), n, 1e-2f, 1e-2f);
      // add_rmsnorm: residual becomes bf16(x + residual), out = rmsnorm of it
      d_out.poison();
      add_rmsnorm(d_out.p, d_res.p, d_x.p, d_w.p, T, H, eps, 0);
      std::vector<float> want_s(n);
      for (size_t i = 0; i < n; i++) want_s[i] = rb(xf[i] + rf[i]);
      for (int t = 0; t < T; t++)
        cpu_rmsnorm_row(&want_s[(size_t)t * H], wf.data(), H, eps, &want[(size_t)t * H]);
      got = to_float(d_out.download());
      auto got_s = to_float(d_res.download());
      snprintf(what, sizeof what, "add_rmsnorm out T=%d H=%d", T, H);
      check_close(what, got.data(), want.data(), n, 1e-2f, 1e-2f);
      snprintf(what, sizeof what, "add_rmsnorm residual T=%d H=%d", T, H);
      check_close(what, got_s.data(), want_s.data(), n, 0.f, 0.f);  // one rounding of one add: exact
      // in place: out aliases x
      d_res.upload(res);
      add_rmsnorm(d_x.p, d_res.p, d_x.p, d_w.p, T, H, eps, 0);
      got = to_float(d_x.download());
      snprintf(what, sizeof what, "add_rmsnorm in place T=%d H=%d", T, H);
      check_close(what, got.data(), want.data(), n, 1e-2f, 1e-2f);
    }
}

// nanovllm.cu's qk_norm_rope_reference: per-head RMSNorm (HF roundings), then RoPE in double.
static void cpu_qk_norm_rope(std::vector<float>& qkv, const std::vector<int>& pos, const float* qw,
                             const float* kw, int T, int NH, int NKV, float theta, float eps) {
  qk_norm_rope_reference(qkv.data(), pos.data(), qw, kw, T, NH, NKV, theta, eps);
}

// The two kernels of the same launcher shape: section 7's qk_norm_rope and section 19's eight-lane one.
typedef void (*QkNormRope)(bf16*, const int*, const bf16*, const bf16*, const KVLayer&, const int*, int, int, int,
                           int, float, float, cudaStream_t);
static const struct { const char* name; QkNormRope f; } kQkNormRopes[] = {{"qk_norm_rope", qk_norm_rope},
                                                                          {"qk_norm_rope_fast", qk_norm_rope_fast}};

TEST(qk_norm_rope_matches_reference) {
  REQUIRE_GPU();
  std::mt19937 rng(3);
  const float eps = 1e-6f;
  struct Case { int T, NH, NKV; float theta; };
  for (const auto& kernel : kQkNormRopes)
  for (Case c : {Case{1, 16, 8, 1e6f}, Case{37, 16, 8, 1e6f}, Case{37, 32, 8, 1e6f}, Case{37, 40, 8, 1e4f},
                 Case{3, 64, 8, 1e6f}}) {
    int W = (c.NH + 2 * c.NKV) * HEAD_DIM;
    size_t n = (size_t)c.T * W;
    auto qkv = random_bf16(n, rng, 0.f, 1.5f);
    auto qw = random_bf16(HEAD_DIM, rng, 1.f, 0.3f), kw = random_bf16(HEAD_DIM, rng, 1.f, 0.3f);
    std::vector<int> pos(c.T);
    std::uniform_int_distribution<int> pd(0, 40959);
    for (int& p : pos) p = pd(rng);
    int edge[] = {40959, 0, 40000, 1, 32768};
    for (int i = 0; i < c.T && i < 5; i++) pos[i] = edge[i];
    DevBuf<bf16> d_qkv(qkv), d_qw(qw), d_kw(kw), d_cache((size_t)c.NKV * 16 * HEAD_DIM);
    DevBuf<int> d_pos(pos), d_slots(std::vector<int>(c.T, -1));  // no store here: see the next test
    d_cache.poison();
    kernel.f(d_qkv.p, d_pos.p, d_qw.p, d_kw.p, KVLayer{d_cache.p, d_cache.p}, d_slots.p, c.T, c.NH, c.NKV, 16,
             c.theta, eps, 0);
    auto got = to_float(d_qkv.download());
    auto want = to_float(qkv);
    auto qwf = to_float(qw), kwf = to_float(kw);
    cpu_qk_norm_rope(want, pos, qwf.data(), kwf.data(), c.T, c.NH, c.NKV, c.theta, eps);
    char what[96];
    snprintf(what, sizeof what, "%s T=%d NH=%d NKV=%d theta=%g", kernel.name, c.T, c.NH, c.NKV, c.theta);
    check_close(what, got.data(), want.data(), n, 1e-2f, 1e-2f);  // v heads: want == input, exact
  }
}

// The KV store fused into qk_norm_rope (both kernels): every k head lands in its slot exactly as the kernel
// left it in qkv, every v head as it came in; slot -1 stores nothing; nothing else in the cache is touched.
TEST(store_kvcache_slots_and_padding) {
  REQUIRE_GPU();
  std::mt19937 rng(4);
  for (const auto& kernel : kQkNormRopes)
  for (int P : {16, 256})
    for (int NH : {16, 32}) {
      const int T = 37, NKV = 8, NB = 6, D = HEAD_DIM;
      int W = (NH + 2 * NKV) * D;
      auto qkv = random_bf16((size_t)T * W, rng);
      std::vector<int> all(NB * P);
      for (int i = 0; i < NB * P; i++) all[i] = i;
      std::shuffle(all.begin(), all.end(), rng);
      std::vector<int> slots(all.begin(), all.begin() + T);
      slots[0] = NB * P - 1;  // the very last slot
      for (int i : {3, 10, 11, 36}) slots[i] = -1;
      size_t cache_n = (size_t)NB * NKV * P * D;
      auto w = random_bf16(HEAD_DIM, rng, 1.f, 0.3f);
      std::vector<int> pos(T);
      for (int t = 0; t < T; t++) pos[t] = 7 * t;
      DevBuf<bf16> d_qkv(qkv), d_k(cache_n), d_v(cache_n), d_w(w);
      DevBuf<int> d_slots(slots), d_pos(pos);
      d_k.poison();
      d_v.poison();
      kernel.f(d_qkv.p, d_pos.p, d_w.p, d_w.p, KVLayer{d_k.p, d_v.p}, d_slots.p, T, NH, NKV, P, 1e6f, 1e-6f, 0);
      auto k = d_k.download(), v = d_v.download();
      auto roped = d_qkv.download();  // k heads as qk_norm_rope wrote them
      std::vector<uint16_t> want_k(cache_n, 0xFFFF), want_v(cache_n, 0xFFFF);
      for (int t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        int blk = slots[t] / P, off = slots[t] % P;
        for (int h = 0; h < NKV; h++)
          for (int d = 0; d < D; d++) {
            size_t dst = (((size_t)blk * NKV + h) * P + off) * D + d;
            want_k[dst] = bits_of(roped[(size_t)t * W + (NH + h) * D + d]);
            want_v[dst] = bits_of(qkv[(size_t)t * W + (NH + NKV + h) * D + d]);
          }
      }
      size_t bad = 0;
      for (size_t i = 0; i < cache_n; i++) {
        bool ok = bits_of(k[i]) == want_k[i] && bits_of(v[i]) == want_v[i];
        if (!ok && bad++ < 3)
          fprintf(stderr, "    %s P=%d NH=%d element %zu: k %04x want %04x, v %04x want %04x\n", kernel.name, P,
                  NH, i, bits_of(k[i]), want_k[i], bits_of(v[i]), want_v[i]);
      }
      CHECK_MSG(bad == 0, "%s P=%d NH=%d: %zu cache elements wrong", kernel.name, P, NH, bad);
    }
}

// ---- section 31: the fp8 cache's conversions and store ---------------------------------------------------

__global__ void fp8_round_trip_kernel(const uint16_t* in, uint8_t* bytes, uint16_t* back, uint8_t* again, int n,
                                      float scale) {
  const int i = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  if (i >= n) return;
  const uint2 q = bf16x8_to_fp8x8(*reinterpret_cast<const uint4*>(in + i), scale);
  *reinterpret_cast<uint2*>(bytes + i) = q;
  const uint4 h = fp8x8_to_half8(q);
  *reinterpret_cast<uint4*>(back + i) = h;
  *reinterpret_cast<uint2*>(again + i) = half8_to_fp8x8(h);
}

// Every bf16 value (all 65,536 bit patterns but NaN), at scales 1, 2^-3, 2^5 and 2^7: the byte the store
// writes equals section 31's CPU rounding of value / scale (nearest, ties to even, saturating at 448); the
// fp16 the attention tiles get is exactly that e4m3 value (subnormals included); and the fused kernel's
// store of those tile values writes the same byte again.
TEST(fp8_conversions_exact) {
  REQUIRE_GPU();
  const int n = 65536;
  std::vector<uint16_t> all(n);
  for (int i = 0; i < n; i++) all[i] = (uint16_t)i;
  for (float scale : {1.f, 0.125f, 32.f, 128.f}) {
    DevBuf<uint16_t> d_in(all), d_back(n);
    DevBuf<uint8_t> d_bytes(n), d_again(n);
    fp8_round_trip_kernel<<<n / 8 / 256, 256>>>(d_in.p, d_bytes.p, d_back.p, d_again.p, n, scale);
    CUDA_CHECK(cudaGetLastError());
    auto bytes = d_bytes.download(), again = d_again.download();
    auto back = d_back.download();
    size_t bad_q = 0, bad_back = 0, subnormal = 0, saturated = 0;
    for (int i = 0; i < n; i++) {
      const float x = bf16_bits_to_float((uint16_t)i);
      if (std::isnan(x)) continue;
      const uint8_t want = e4m3_from_float(x / scale);
      const __half h = __float2half(e4m3_to_float(bytes[i]));
      const uint16_t want_back = *reinterpret_cast<const uint16_t*>(&h);
      bad_back += again[i] != bytes[i];
      subnormal += (bytes[i] & 0x78) == 0 && (bytes[i] & 7) != 0;
      saturated += (bytes[i] & 0x7f) == 0x7e;
      if (bytes[i] != want && bad_q++ < 3)
        fprintf(stderr, "    scale %g: bf16 %04x (%g) -> e4m3 %02x, want %02x\n", scale, i, x, bytes[i], want);
      if (back[i] != want_back && bad_back++ < 3)
        fprintf(stderr, "    scale %g: e4m3 %02x -> fp16 %04x, want %04x\n", scale, bytes[i], back[i], want_back);
    }
    printf("    scale %-6g %zu wrong bytes, %zu wrong widened values (%zu subnormal, %zu saturated)\n", scale,
           bad_q, bad_back, subnormal, saturated);
    CHECK_MSG(bad_q == 0 && bad_back == 0, "scale %g: %zu bytes, %zu widened values wrong", scale, bad_q,
              bad_back);
    CHECK(subnormal > 0 && saturated > 0);  // both ends of the range were exercised
  }
}

// qk_norm_rope_fp8's store into an fp8 cache (section 31): every k head lands in its slot as e4m3(k / k_scale)
// of the bf16 k it left in qkv, every v head as e4m3(v / v_scale); slot -1 stores nothing; nothing else is
// touched.
TEST(store_kvcache_fp8) {
  REQUIRE_GPU();
  std::mt19937 rng(14);
  for (int P : {16, 256}) {
    const int T = 37, NH = 16, NKV = 8, NB = 6, D = HEAD_DIM, W = (NH + 2 * NKV) * D;
    auto qkv = random_bf16((size_t)T * W, rng, 0.f, 3.f);
    std::vector<int> all(NB * P);
    for (int i = 0; i < NB * P; i++) all[i] = i;
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int> slots(all.begin(), all.begin() + T);
    slots[0] = NB * P - 1;
    for (int i : {3, 10, 36}) slots[i] = -1;
    const size_t cache_n = (size_t)NB * NKV * P * D;
    auto w = random_bf16(HEAD_DIM, rng, 1.f, 0.3f);
    std::vector<int> pos(T);
    for (int t = 0; t < T; t++) pos[t] = 5 * t;
    DevBuf<bf16> d_qkv(qkv), d_w(w);
    DevBuf<uint8_t> d_k(cache_n), d_v(cache_n);
    DevBuf<int> d_slots(slots), d_pos(pos);
    CUDA_CHECK(cudaMemset(d_k.p, 0xA5, cache_n));
    CUDA_CHECK(cudaMemset(d_v.p, 0xA5, cache_n));
    const KVScales scale{0.25f, 2.f};
    qk_norm_rope_fp8(d_qkv.p, d_pos.p, d_w.p, d_w.p, KVLayerFp8{(fp8e4m3*)d_k.p, (fp8e4m3*)d_v.p, scale}, d_slots.p,
                     T, NH, NKV, P, 1e6f, 1e-6f, 0);
    auto k = d_k.download(), v = d_v.download();
    auto roped = d_qkv.download();
    std::vector<uint8_t> want_k(cache_n, 0xA5), want_v(cache_n, 0xA5);
    for (int t = 0; t < T; t++) {
      if (slots[t] < 0) continue;
      const int blk = slots[t] / P, off = slots[t] % P;
      for (int h = 0; h < NKV; h++)
        for (int d = 0; d < D; d++) {
          const size_t dst = (((size_t)blk * NKV + h) * P + off) * D + d;
          want_k[dst] = e4m3_from_float(__bfloat162float(roped[(size_t)t * W + (NH + h) * D + d]) / scale.k);
          want_v[dst] = e4m3_from_float(__bfloat162float(qkv[(size_t)t * W + (NH + NKV + h) * D + d]) / scale.v);
        }
    }
    size_t bad = 0;
    for (size_t i = 0; i < cache_n; i++) bad += k[i] != want_k[i] || v[i] != want_v[i];
    printf("    P=%d: %zu of %zu cache bytes wrong\n", P, bad, 2 * cache_n);
    CHECK_MSG(bad == 0, "P=%d: %zu fp8 cache bytes wrong", P, bad);
  }
}

TEST(silu_and_mul_matches_reference) {
  REQUIRE_GPU();
  std::mt19937 rng(5);
  for (int T : {1, 37})
    for (int I : {8, 1000, 3072}) {
      auto gu = random_bf16((size_t)T * 2 * I, rng, 0.f, 3.f);
      auto f = to_float(gu);
      DevBuf<bf16> d_gu(gu), d_out((size_t)T * I);
      d_out.poison();
      silu_and_mul(d_out.p, d_gu.p, T, I, 0);
      auto got = to_float(d_out.download());
      std::vector<float> want((size_t)T * I);
      silu_and_mul_reference(want.data(), f.data(), T, I);
      char what[64];
      snprintf(what, sizeof what, "silu_and_mul T=%d I=%d", T, I);
      check_close(what, got.data(), want.data(), want.size(), 1e-2f, 1e-2f);
    }
}

TEST(gather_last_tokens_picks_each_last_row) {
  REQUIRE_GPU();
  std::mt19937 rng(6);
  const int H = 1032;
  std::vector<int> lens = {1, 7, 1, 20, 3};
  std::vector<int> cu = {0};
  for (int l : lens) cu.push_back(cu.back() + l);
  int B = (int)lens.size(), T = cu.back();
  auto x = random_bf16((size_t)T * H, rng);
  DevBuf<bf16> d_x(x), d_out((size_t)B * H);
  DevBuf<int> d_cu(cu);
  d_out.poison();
  gather_last_tokens(d_out.p, d_x.p, d_cu.p, B, H, 0);
  auto out = d_out.download();
  int bad = 0;
  for (int b = 0; b < B; b++)
    for (int h = 0; h < H; h++)
      bad += bits_of(out[(size_t)b * H + h]) != bits_of(x[(size_t)(cu[b + 1] - 1) * H + h]);
  CHECK_EQ(bad, 0);
}

// The element-wise kernels at a large prefill (T = 16384), each timed over 50 launches: its name, the bytes
// it reads and writes, and its time.
struct ElementwiseRow {
  const char* name;
  double bytes, ms;
  double gbs() const { return bytes / (ms * 1e-3) / 1e9; }
};
static std::vector<ElementwiseRow> time_elementwise_kernels() {
  std::mt19937 rng(7);
  const int T = 16384, H = 1024, I = 3072, NH = 16, NKV = 8, P = 256, W = (NH + 2 * NKV) * HEAD_DIM;
  auto big = random_bf16((size_t)T * 2 * I, rng);  // reused as the input of every kernel
  DevBuf<bf16> in(big), out((size_t)T * 2 * I), res(big), w(random_bf16(H, rng, 1.f, 0.3f));
  DevBuf<bf16> kc((size_t)(T / P + 1) * NKV * P * HEAD_DIM), vc((size_t)(T / P + 1) * NKV * P * HEAD_DIM);
  std::vector<int> slots(T), pos(T), ids(T);
  for (int t = 0; t < T; t++) slots[t] = t, pos[t] = t, ids[t] = t % 1000;
  DevBuf<int> d_slots(slots), d_pos(pos), d_ids(ids);
  std::vector<ElementwiseRow> rows = {
      {"embedding      T=16384 H=1024", 2.0 * T * H * 2,
       time_ms([&] { embedding(out.p, d_ids.p, in.p, T, H, 0, 1000, 0); })},
      {"add_rmsnorm    T=16384 H=1024", 4.0 * T * H * 2,
       time_ms([&] { add_rmsnorm(out.p, res.p, in.p, w.p, T, H, 1e-6f, 0); })},
      {"qk_norm_rope + KV store T=16384 NH=16 NKV=8", (2.0 * (NH + NKV) + 3.0 * NKV) * T * HEAD_DIM * 2,
       time_ms([&] {
         qk_norm_rope(out.p, d_pos.p, w.p, w.p, KVLayer{kc.p, vc.p}, d_slots.p, T, NH, NKV, P, 1e6f, 1e-6f, 0);
       })},
      {"qk_norm_rope_fast + KV store", (2.0 * (NH + NKV) + 3.0 * NKV) * T * HEAD_DIM * 2,
       time_ms([&] {
         qk_norm_rope_fast(out.p, d_pos.p, w.p, w.p, KVLayer{kc.p, vc.p}, d_slots.p, T, NH, NKV, P, 1e6f, 1e-6f, 0);
       })},
      {"silu_and_mul   T=16384 I=3072", 3.0 * T * I * 2,
       time_ms([&] { silu_and_mul(out.p, in.p, T, I, 0); })},
  };
  (void)W;
  return rows;
}
TEST(elementwise_kernels_above_100_GBps) {  // far below any sm_80+ GPU: a slower one is a broken launch
  REQUIRE_GPU();
  for (const ElementwiseRow& r : time_elementwise_kernels())
    CHECK_MSG(r.gbs() > 100, "%s: %.1f us, %.0f GB/s", r.name, r.ms * 1e3, r.gbs());
}
TIMING(bench_elementwise_bandwidth) {
  REQUIRE_GPU();
  for (const ElementwiseRow& r : time_elementwise_kernels())
    printf("    BENCH %-36s %8.1f us  %7.0f GB/s\n", r.name, r.ms * 1e3, r.gbs());
}

// ==== sections 9 and 21: the sampler =====================================================================

TEST(philox_known_answers) {  // Random123's kat_vectors for philox4x32-10; runs on the CPU
  struct Kat { uint4 ctr; uint2 key; uint4 want; };
  Kat kats[] = {
      {make_uint4(0, 0, 0, 0), make_uint2(0, 0), make_uint4(0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)},
      {make_uint4(~0u, ~0u, ~0u, ~0u), make_uint2(~0u, ~0u),
       make_uint4(0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)},
      {make_uint4(0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), make_uint2(0xa4093822, 0x299f31d0),
       make_uint4(0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)},
  };
  for (auto& k : kats) {
    uint4 r = philox4x32_10(k.ctr, k.key);
    CHECK_MSG(r.x == k.want.x && r.y == k.want.y && r.z == k.want.z && r.w == k.want.w,
              "got %08x %08x %08x %08x want %08x %08x %08x %08x", r.x, r.y, r.z, r.w, k.want.x, k.want.y,
              k.want.z, k.want.w);
  }
  // The order key must sort like the floats it encodes.
  float vals[] = {-INFINITY, -3e38f, -1.5f, -1e-30f, 0.f, 1e-30f, 2.f, 3e38f, INFINITY};
  for (int i = 0; i + 1 < 9; i++) CHECK(float_order_key(vals[i]) < float_order_key(vals[i + 1]));
  for (float v : vals) CHECK(float_from_order_key(float_order_key(v)) == v);
}

static SamplingSlot make_slot(float temperature, int top_k, float top_p, unsigned long long seed,
                              unsigned long long offset) {
  SamplingSlot s{};
  s.temperature = temperature, s.top_k = top_k, s.top_p = top_p, s.seed = seed, s.offset = offset;
  return s;
}

// The kept set on the CPU (nanovllm.cu's sample_kept_reference): exact for greedy/top-k; for top-p two sets
// bracket the GPU's, `strict` with target top_p - 1e-5 and `loose` with top_p + 1e-5 (the GPU's masses are
// fp32 exp in 2^-32 fixed point).
struct KeptSets {
  std::vector<char> strict, loose;
  int n_strict = 0, n_loose = 0;
};
static KeptSets cpu_kept_sets(const float* logits, int V, const SamplingSlot& s) {
  KeptSets k;
  k.strict = sample_kept_reference(logits, V, s, -1e-5);
  k.loose = sample_kept_reference(logits, V, s, +1e-5);
  for (int i = 0; i < V; i++) k.n_strict += k.strict[i], k.n_loose += k.loose[i];
  return k;
}
// The GPU's draw, reproduced (sample_reference): argmax over the kept set (empty: all) of z + Gumbel(seed,
// offset, i). *margin = the gap to the runner-up (a gap below float noise makes the comparison meaningless).
static int cpu_sample(const float* logits, int V, const SamplingSlot& s, const std::vector<char>& keep,
                      double* margin) {
  return sample_reference(logits, V, s, keep.empty() ? std::vector<char>(V, 1) : keep, margin);
}

// Which sampler gpu_sample and sample_histogram run: section 22's (the engine's default), section 21's or
// section 9's, each with a workspace large enough for any of them.
enum class Sampler { fast, bisect, plain };
static const Sampler kAllSamplers[] = {Sampler::fast, Sampler::bisect, Sampler::plain};
static Sampler g_sampler = Sampler::fast;
static const char* sampler_name(Sampler s) {
  return s == Sampler::fast ? "section 22 (radix select)" : s == Sampler::bisect ? "section 21 (bisection)"
                                                                                   : "section 9 (sort)";
}
static size_t any_sampler_workspace_bytes(int B, int V) {
  return std::max(sample_workspace_bytes(B, V), sample_sort_workspace_bytes(B, V));
}
static void run_sampler(int* out, const float* logits, const SamplingSlot* slots, int B, int V, void* ws,
                        size_t ws_bytes) {
  if (g_sampler == Sampler::fast) sample_fast(out, logits, slots, B, V, ws, ws_bytes, 0);
  else if (g_sampler == Sampler::bisect) sample_bisect(out, logits, slots, B, V, ws, ws_bytes, 0);
  else sample(out, logits, slots, B, V, ws, ws_bytes, 0);
}

// Runs the GPU sampler once on host data.
static std::vector<int> gpu_sample(const std::vector<float>& logits, const std::vector<SamplingSlot>& slots,
                                   int V) {
  int B = (int)slots.size();
  DevBuf<float> d_logits(logits);
  DevBuf<SamplingSlot> d_slots(slots);
  DevBuf<int> d_out(B);
  size_t ws = any_sampler_workspace_bytes(B, V);
  DevBuf<unsigned char> d_ws(ws);
  d_out.poison();
  d_ws.poison();
  run_sampler(d_out.p, d_logits.p, d_slots.p, B, V, d_ws.p, ws);
  return d_out.download();
}

// The same rows through all three samplers (g_sampler is left at the engine's default, section 22's).
struct ThreeDraws {
  std::vector<int> plain, bisect, fast;
};
static ThreeDraws gpu_sample_all(const std::vector<float>& logits, const std::vector<SamplingSlot>& slots,
                                 int V) {
  ThreeDraws d;
  g_sampler = Sampler::plain;
  d.plain = gpu_sample(logits, slots, V);
  g_sampler = Sampler::bisect;
  d.bisect = gpu_sample(logits, slots, V);
  g_sampler = Sampler::fast;
  d.fast = gpu_sample(logits, slots, V);
  return d;
}

TEST(sample_greedy_is_argmax_lowest_index_on_ties) {
  REQUIRE_GPU();
  for (Sampler which : kAllSamplers) {
  g_sampler = which;
  std::mt19937 rng(11);
  for (int V : {151936, 1001, 50})
    for (int B : {1, 37}) {
      auto logits = random_logits((size_t)B * V, rng, 2.f);
      std::vector<SamplingSlot> slots(B);
      for (int b = 0; b < B; b++)  // greedy ignores top-k and top-p: mix them in
        slots[b] = make_slot(0.f, b % 3 == 1 ? 5 : 0, b % 3 == 2 ? 0.5f : 1.f, b, b);
      // Row 0: a planted tie far apart (different splits at V = 151936); lowest index must win.
      int lo_i = V / 3, hi_i = V - 1 - V / 5;
      logits[lo_i] = logits[hi_i] = 50.f;
      if (B > 1) {
        float* r1 = &logits[V];  // row 1: NaNs everywhere around a winner at the last index
        for (int i = 0; i < V; i += 7) r1[i] = NAN;
        r1[V - 1] = 40.f;
      }
      if (B > 2)
        for (int i = 0; i < V; i++) logits[2 * (size_t)V + i] = -1.f;  // row 2: all equal -> 0
      auto got = gpu_sample(logits, slots, V);
      std::vector<char> none;
      for (int b = 0; b < B; b++) {
        double margin;
        int want = cpu_sample(&logits[(size_t)b * V], V, slots[b], none, &margin);
        CHECK_MSG(got[b] == want, "V=%d B=%d row %d: got %d want %d", V, B, b, got[b], want);
      }
      CHECK_EQ(got[0], lo_i);
      if (B > 2) {
        CHECK_EQ(got[1], V - 1);
        CHECK_EQ(got[2], 0);
      }
    }
  }
  g_sampler = Sampler::fast;
}

// Builds a batch mixing every kind of row and compares each GPU token with the CPU's reproduction.
TEST(sample_reproduces_cpu_draws_exactly) {
  REQUIRE_GPU();
  for (Sampler which : kAllSamplers) {
  g_sampler = which;
  printf("    %s:\n", sampler_name(which));
  std::mt19937_64 rng(12);
  std::mt19937 rng32(13);
  struct Cfg { float t; int k; float p; float stddev; };
  std::vector<Cfg> cfgs = {
      {0.6f, 0, 1.f, 2.f},    {1.0f, 0, 1.f, 2.f},    {1.3f, 0, 1.f, 0.3f},  {0.7f, 1, 1.f, 2.f},
      {0.7f, 5, 1.f, 2.f},    {1.0f, 50, 1.f, 2.f},   {0.8f, 1000, 1.f, 2.f}, {1.0f, 20000, 1.f, 1.f},
      {0.7f, 0, 0.5f, 2.f},   {1.0f, 0, 0.9f, 2.f},   {1.0f, 0, 0.99f, 3.f}, {1.0f, 0, 0.9f, 0.05f},
      {0.9f, 50, 0.9f, 2.f},  {0.6f, 1000, 0.5f, 2.f}, {1.2f, 20000, 0.95f, 0.3f}, {0.f, 7, 0.3f, 2.f},
  };
  for (int V : {151936, 1001, 50}) {
    int B = 48, checked = 0, ambiguous = 0;
    std::vector<float> logits;
    std::vector<SamplingSlot> slots;
    for (int b = 0; b < B; b++) {
      Cfg c = cfgs[b % cfgs.size()];
      auto row = random_logits(V, rng32, c.stddev);
      logits.insert(logits.end(), row.begin(), row.end());
      slots.push_back(make_slot(c.t, c.k, c.p, rng(), rng()));
    }
    auto got = gpu_sample(logits, slots, V);
    for (int b = 0; b < B; b++) {
      const float* row = &logits[(size_t)b * V];
      bool greedy = slots[b].temperature == 0.f;
      KeptSets k = greedy ? KeptSets{std::vector<char>(V, 1), std::vector<char>(V, 1), V, V}
                          : cpu_kept_sets(row, V, slots[b]);
      CHECK_MSG(got[b] >= 0 && got[b] < V, "V=%d row %d: token %d out of range", V, b, got[b]);
      if (got[b] < 0 || got[b] >= V) continue;
      double m1, m2;
      int w1 = cpu_sample(row, V, slots[b], k.strict, &m1);
      int w2 = cpu_sample(row, V, slots[b], k.loose, &m2);
      CHECK_MSG(k.loose[got[b]], "V=%d row %d: token %d outside the kept set", V, b, got[b]);
      if (w1 != w2 || m1 < 1e-4) {
        ambiguous++;
        continue;
      }
      checked++;
      CHECK_MSG(got[b] == w1, "V=%d row %d (T=%g k=%d p=%g, kept %d): got %d want %d", V, b,
                slots[b].temperature, slots[b].top_k, slots[b].top_p, k.n_strict, got[b], w1);
    }
    printf("    V=%d: %d rows compared exactly, %d too close to call\n", V, checked, ambiguous);
    CHECK_MSG(ambiguous <= B / 8, "V=%d: %d of %d rows ambiguous: the test lost its power", V, ambiguous, B);
  }
  }
  g_sampler = Sampler::fast;
}

TEST(sample_is_deterministic_and_independent_of_batch) {
  REQUIRE_GPU();
  std::mt19937 rng(14);
  const int V = 151936;
  // Three probe rows: plain temperature, top-k, top-p (flat logits, so the noise decides the token).
  std::vector<SamplingSlot> probes = {make_slot(1.f, 0, 1.f, 42, 7), make_slot(1.f, 100, 1.f, 43, 8),
                                      make_slot(1.f, 0, 0.8f, 44, 9)};
  auto probe_logits = random_logits((size_t)3 * V, rng, 0.5f);
  auto small = gpu_sample(probe_logits, probes, V);  // B = 3: rows split over many blocks
  auto again = gpu_sample(probe_logits, probes, V);
  const int B = 200, at[3] = {7, 100, 199};
  auto logits = random_logits((size_t)B * V, rng, 2.f);
  std::vector<SamplingSlot> slots(B);
  for (int b = 0; b < B; b++)
    slots[b] = make_slot(0.5f + b % 3, b % 4 == 0 ? 20 : 0, b % 5 == 0 ? 0.7f : 1.f, 1000 + b, 5);
  for (int j = 0; j < 3; j++) {
    slots[at[j]] = probes[j];
    std::copy(&probe_logits[(size_t)j * V], &probe_logits[(size_t)(j + 1) * V], &logits[(size_t)at[j] * V]);
  }
  auto big = gpu_sample(logits, slots, V);
  for (int j = 0; j < 3; j++) {
    CHECK_MSG(small[j] == again[j], "probe %d: %d then %d on the same input", j, small[j], again[j]);
    CHECK_MSG(small[j] == big[at[j]], "probe %d: %d alone, %d at row %d of %d", j, small[j], big[at[j]],
              at[j], B);
  }
  // ... and the noise does move with the offset: 64 offsets of the plain probe give many tokens.
  std::vector<SamplingSlot> many(64, probes[0]);
  std::vector<float> rep;
  for (int i = 0; i < 64; i++) {
    many[i].offset = i;
    rep.insert(rep.end(), probe_logits.begin(), probe_logits.begin() + V);
  }
  auto toks = gpu_sample(rep, many, V);
  std::set<int> distinct(toks.begin(), toks.end());
  CHECK_MSG(distinct.size() >= 50, "64 offsets gave only %zu distinct tokens", distinct.size());
}

// Draws n_rows * launches samples of one (logits, slot) with distinct offsets; returns per-token counts.
static std::vector<long> sample_histogram(const std::vector<float>& row, SamplingSlot slot, int n_rows,
                                          int launches) {
  int V = (int)row.size();
  std::vector<float> logits;
  for (int b = 0; b < n_rows; b++) logits.insert(logits.end(), row.begin(), row.end());
  std::vector<SamplingSlot> slots(n_rows, slot);
  DevBuf<float> d_logits(logits);
  DevBuf<SamplingSlot> d_slots(n_rows);
  DevBuf<int> d_out(n_rows);
  size_t ws = any_sampler_workspace_bytes(n_rows, V);
  DevBuf<unsigned char> d_ws(ws);
  std::vector<long> counts(V, 0);
  for (int l = 0; l < launches; l++) {
    for (int b = 0; b < n_rows; b++) slots[b].offset = (unsigned long long)l * n_rows + b;
    d_slots.upload(slots);
    d_out.poison();
    run_sampler(d_out.p, d_logits.p, d_slots.p, n_rows, V, d_ws.p, ws);
    for (int t : d_out.download()) {
      if (t >= 0 && t < V) counts[t]++;
    }
  }
  return counts;
}
// Pearson chi-square of counts against probabilities p (bins with expected count < 5 are pooled).
// Returns the statistic and its degrees of freedom. Counts where p == 0 make the statistic infinite.
static double chi_square(const std::vector<long>& counts, const std::vector<double>& p, int* df) {
  long n = 0;
  for (long c : counts) n += c;
  double chi = 0, pool_e = 0, pool_o = 0;
  int bins = 0;
  for (size_t i = 0; i < p.size(); i++) {
    double e = p[i] * n;
    if (p[i] == 0 && counts[i] > 0) return INFINITY;
    if (e < 5) {
      pool_e += e, pool_o += counts[i];
      continue;
    }
    chi += (counts[i] - e) * (counts[i] - e) / e, bins++;
  }
  if (pool_e > 0) chi += (pool_o - pool_e) * (pool_o - pool_e) / pool_e, bins++;
  *df = bins - 1;
  return chi;
}
// The 1 - 1e-6 quantile of chi-square(df), Wilson-Hilferty: a correct sampler fails once in a million.
static double chi_square_limit(int df) {
  double a = 2.0 / (9.0 * df), z = 4.75;
  return df * pow(1 - a + z * sqrt(a), 3);
}
// softmax(logits / T) restricted to a kept mask (renormalised).
static std::vector<double> kept_softmax(const std::vector<float>& row, float T,
                                        const std::vector<char>& keep) {
  std::vector<double> p(row.size(), 0.0);
  double m = -INFINITY, Z = 0;
  for (size_t i = 0; i < row.size(); i++)
    if (keep[i]) m = std::max(m, (double)row[i] / T);
  for (size_t i = 0; i < row.size(); i++)
    if (keep[i]) Z += (p[i] = exp(row[i] / (double)T - m));
  for (auto& x : p) x /= Z;
  return p;
}
// Samples one configuration many times and checks: every draw inside the CPU's kept set, the counts fit
// the renormalised kept distribution, and they do NOT fit `wrong` (so the test has the power to fail).
static void check_distribution(const char* name, const std::vector<float>& row, SamplingSlot slot,
                               const std::vector<double>& wrong) {
  int V = (int)row.size();
  KeptSets k = cpu_kept_sets(row.data(), V, slot);
  CHECK_MSG(k.n_strict == k.n_loose, "%s: test logits put the top-p boundary within rounding", name);
  auto counts = sample_histogram(row, slot, 4096, 16);
  long outside = 0;
  for (int i = 0; i < V; i++)
    if (!k.loose[i]) outside += counts[i];
  CHECK_MSG(outside == 0, "%s: %ld draws outside the kept set of %d tokens", name, outside, k.n_loose);
  auto p = kept_softmax(row, slot.temperature, k.loose);
  int df, df_wrong;
  double chi = chi_square(counts, p, &df), chi_wrong = chi_square(counts, wrong, &df_wrong);
  printf("    %-34s kept %2d of %d  chi2 = %6.1f (df %d, limit %.1f); against the wrong model %.3g\n",
         name, k.n_loose, V, chi, df, chi_square_limit(df), chi_wrong);
  CHECK_MSG(chi < chi_square_limit(df), "%s: chi2 %.1f over the limit %.1f", name, chi, chi_square_limit(df));
  CHECK_MSG(chi_wrong > chi_square_limit(df_wrong), "%s: the test cannot tell the wrong model apart", name);
}

TEST(sample_distribution_matches_softmax) {
  REQUIRE_GPU();
  std::mt19937 rng(15);
  auto row50 = random_logits(50, rng, 1.5f);
  std::vector<char> all50(50, 1), all48(48, 1);
  // temperature: compare with the same softmax taken at T = 1 (temperature ignored)
  check_distribution("temperature 0.7, V=50", row50, make_slot(0.7f, 0, 1.f, 99, 0),
                     kept_softmax(row50, 1.0f, all50));
  // top-k on V = 48 (the float4 path): wrong model = the same temperature without the cut
  auto row48 = random_logits(48, rng, 1.5f);
  check_distribution("top-k 10, T 0.9, V=48", row48, make_slot(0.9f, 10, 1.f, 5, 0),
                     kept_softmax(row48, 0.9f, all48));
  // top-p: wrong model = no cut
  check_distribution("top-p 0.8, T 1.0, V=50", row50, make_slot(1.0f, 0, 0.8f, 6, 0),
                     kept_softmax(row50, 1.0f, all50));
  // top-k then top-p: wrong model = top-p alone (on these logits the two sets differ)
  auto row50b = random_logits(50, rng, 0.7f);
  SamplingSlot kp = make_slot(0.8f, 12, 0.7f, 7, 0);
  KeptSets p_only = cpu_kept_sets(row50b.data(), 50, make_slot(0.8f, 0, 0.7f, 0, 0));
  check_distribution("top-k 12 + top-p 0.7, T 0.8, V=50", row50b, kp,
                     kept_softmax(row50b, 0.8f, p_only.loose));
}

TEST(sample_large_vocab_kept_sets) {
  REQUIRE_GPU();
  std::mt19937 rng(16);
  const int V = 151936;
  struct Cfg { const char* name; SamplingSlot slot; int hot; float hot_mean, hot_spread, stddev; };
  std::vector<Cfg> cfgs = {
      {"top-k 50 (50 hot tokens)", make_slot(3.f, 50, 1.f, 1, 0), 50, 12.f, 0.5f, 2.f},
      {"top-p 0.9 (200 hot tokens)", make_slot(1.f, 0, 0.9f, 2, 0), 200, 14.f, 0.5f, 2.f},
      {"top-p 0.5 flat (list overflow)", make_slot(1.f, 0, 0.5f, 3, 0), 0, 0.f, 0.f, 0.3f},
      {"top-k 20000 + top-p 0.95 flat", make_slot(1.f, 20000, 0.95f, 4, 0), 0, 0.f, 0.f, 0.3f},
  };
  for (auto& c : cfgs) {
    auto row = random_logits(V, rng, c.stddev);
    std::uniform_int_distribution<int> pick(0, V - 1);
    std::normal_distribution<float> hot(c.hot_mean, c.hot_spread);
    for (int h = 0; h < c.hot; h++) row[pick(rng)] = hot(rng);
    KeptSets k = cpu_kept_sets(row.data(), V, c.slot);
    auto counts = sample_histogram(row, c.slot, 256, 8);
    long outside = 0, n = 0;
    int distinct = 0, distinct_strict = 0;
    for (int i = 0; i < V; i++) {
      n += counts[i];
      if (!k.loose[i]) outside += counts[i];
      distinct += counts[i] > 0;
      distinct_strict += counts[i] > 0 && k.strict[i];
    }
    printf("    %-32s kept %6d..%-6d tokens; %ld draws, %d distinct, %ld outside\n", c.name, k.n_strict,
           k.n_loose, n, distinct, outside);
    CHECK_MSG(outside == 0, "%s: %ld of %ld draws outside the kept set", c.name, outside, n);
    CHECK_EQ(n, 2048L);
    // Small kept sets must be covered (a set cut too small would miss tokens); large ones must spread.
    int want = k.n_strict <= 300 ? (int)(0.9 * k.n_strict) : 1800;
    CHECK_MSG(distinct_strict >= want, "%s: only %d distinct kept tokens drawn, expected >= %d", c.name,
              distinct_strict, want);
  }
}

// One launch through every path of the sampler (greedy; temperature; top-k with small and huge k; top-p
// with a short kept list and with the list overflow of a flat row; both cuts together) at the vocabulary
// sizes that change the kernel's shape (one split or many, V % 4 != 0): each token must be in the CPU's kept
// set. Small on purpose: it is the case compute-sanitizer racecheck runs (test/gpu/gpu_sanitize.sh), where the
// statistical cases above take hours.
TEST(sample_every_path_once) {
  REQUIRE_GPU();
  for (Sampler which : kAllSamplers) {
  g_sampler = which;
  std::mt19937 rng(17);
  std::mt19937_64 rng64(18);
  struct Cfg { float t; int k; float p; float stddev; };
  const std::vector<Cfg> cfgs = {{0.f, 0, 1.f, 2.f},     {0.7f, 0, 1.f, 2.f},      {0.9f, 10, 1.f, 2.f},
                                 {1.f, 20000, 1.f, 1.f}, {1.f, 0, 0.8f, 2.f},      {1.f, 0, 0.5f, 0.3f},
                                 {0.8f, 12, 0.7f, 0.7f}, {1.f, 20000, 0.95f, 0.3f}};
  for (int V : {151936, 1001, 48}) {
    std::vector<float> logits;
    std::vector<SamplingSlot> slots;
    for (auto& c : cfgs) {
      auto row = random_logits(V, rng, c.stddev);
      logits.insert(logits.end(), row.begin(), row.end());
      slots.push_back(make_slot(c.t, c.k, c.p, rng64(), rng64()));
    }
    auto got = gpu_sample(logits, slots, V);
    for (size_t b = 0; b < cfgs.size(); b++) {
      const float* row = &logits[b * V];
      if (!CHECK_MSG(got[b] >= 0 && got[b] < V, "V=%d row %zu: token %d", V, b, got[b])) continue;
      if (slots[b].temperature == 0.f) {
        std::vector<char> none;
        double margin;
        CHECK_MSG(got[b] == cpu_sample(row, V, slots[b], none, &margin), "V=%d greedy row: %d", V, got[b]);
      } else {
        KeptSets k = cpu_kept_sets(row, V, slots[b]);
        CHECK_MSG(k.loose[got[b]], "V=%d row %zu (T=%g k=%d p=%g): token %d outside the kept set of %d", V, b,
                  slots[b].temperature, slots[b].top_k, slots[b].top_p, got[b], k.n_loose);
      }
    }
  }
  }
  g_sampler = Sampler::fast;
}

// Sections 21 and 22 compute the same kept set and the same draw as section 9 by other roads: every token
// must be equal, on every kind of row (greedy with planted ties and NaNs, temperature, top-k small and huge,
// top-p with a short list and with the list overflow of a flat row, both cuts), at batch sizes that change
// how section 22 splits rows, and at vocabulary sizes with V % 4 != 0.
TEST(sample_fast_matches_plain) {
  REQUIRE_GPU();
  std::mt19937 rng(19);
  std::mt19937_64 rng64(20);
  struct Cfg { float t; int k; float p; float stddev; };
  const std::vector<Cfg> cfgs = {{0.f, 0, 1.f, 2.f},       {0.6f, 0, 1.f, 2.f},     {1.3f, 0, 1.f, 0.3f},
                                 {0.7f, 1, 1.f, 2.f},      {0.9f, 10, 1.f, 2.f},    {1.f, 20000, 1.f, 1.f},
                                 {1.f, 0, 0.8f, 2.f},      {1.f, 0, 0.5f, 0.3f},    {1.f, 0, 0.9f, 0.05f},
                                 {0.8f, 12, 0.7f, 0.7f},   {1.2f, 20000, 0.95f, 0.3f}, {5.f, 0, 0.9f, 2.f}};
  int compared = 0;
  for (int V : {151936, 1001, 48})
    for (int B : {1, 3, 12, 40}) {
      std::vector<float> logits;
      std::vector<SamplingSlot> slots;
      for (int b = 0; b < B; b++) {
        const Cfg& c = cfgs[(b * 7 + V) % cfgs.size()];
        auto row = random_logits(V, rng, c.stddev);
        if (b % 5 == 1) row[V / 2] = row[V - 1] = 30.f;  // a planted tie
        if (b % 6 == 2)
          for (int i = 0; i < V; i += 11) row[i] = NAN;
        logits.insert(logits.end(), row.begin(), row.end());
        slots.push_back(make_slot(c.t, c.k, c.p, rng64(), rng64()));
      }
      const ThreeDraws d = gpu_sample_all(logits, slots, V);
      const std::vector<int>&plain = d.plain, &bisect = d.bisect, &fast = d.fast;
      for (int b = 0; b < B; b++, compared++)
        CHECK_MSG(fast[b] == plain[b] && bisect[b] == plain[b],
                  "V=%d B=%d row %d (T=%g k=%d p=%g): radix select %d, bisection %d, sort %d", V, B, b,
                  slots[b].temperature, slots[b].top_k, slots[b].top_p, fast[b], bisect[b], plain[b]);
    }
  printf("    %d rows: sections 9, 21 and 22 drew the same token\n", compared);
}

// The three samplers (section 9's sort, section 21's bisection, section 22's radix select) on rows built to sit on their
// edges: ties everywhere and ties at the top, NaN, -inf, +inf, every value equal, nothing finite, a flat row;
// under every kind of cut: greedy, temperature alone, top_k 1, 2 and V - 1, top_p tiny and just under 1,
// min_p (1 included), all three at once; at vocabulary sizes that change the kernels' shapes (one split or
// many, V % 4 != 0, a row shorter than a warp). The three tokens must be equal; each must be in the CPU
// reference's kept set (sample_kept_reference) and equal to its draw (sample_reference) wherever the
// reference is sharp (its kept set the same at top_p -1e-5 and +1e-5, its winner clear of float noise);
// and where the answer is known without the reference, it is that (a row with nothing finite: token 0; top_k
// 1 or a tiny top_p: a token of the row's largest value).
TEST(samplers_agree_on_awkward_rows) {
  REQUIRE_GPU();
  std::mt19937 rng(21);
  std::mt19937_64 rng64(22);
  struct Cut { float t; int k; float p; float min_p; };  // k = -2: V - 1
  const std::vector<Cut> cuts = {
      {0.f, 0, 1.f, 0.f},   {0.f, 3, 0.5f, 0.2f},     {0.8f, 0, 1.f, 0.f},  {1.f, 1, 1.f, 0.f},
      {1.f, 2, 1.f, 0.f},   {1.f, -2, 1.f, 0.f},      {0.7f, 0, 1e-7f, 0.f}, {1.f, 0, 0.999999f, 0.f},
      {1.f, 0, 0.5f, 0.f},  {1.f, 0, 1.f, 0.05f},     {1.f, 0, 1.f, 1.f},   {0.9f, 40, 0.9f, 0.01f},
      {5.f, 0, 0.9f, 0.f},  {1.2f, 5000, 0.95f, 0.001f}};
  const int kinds = 9;
  auto make_row = [&](int kind, int V) {
    std::vector<float> row = random_logits(V, rng, kind == 8 ? 0.01f : 2.f);
    for (int i = 0; i < V; i++) {
      if (kind == 1) row[i] = (float)(rng() % 6) * 0.5f;                        // ties at every cut
      if (kind == 3 && i % 7 == 3) row[i] = NAN;                                 // NaN: never kept
      if (kind == 4) row[i] = i % 3 == 0 ? -INFINITY : (float)(rng() % 4);      // -inf and ties
      if (kind == 5) row[i] = -1.5f;                                             // every value equal
      if (kind == 6) row[i] = i % 2 ? NAN : -INFINITY;                           // nothing finite
    }
    if (kind == 2)  // four tokens tied at the top, far apart
      for (int i : {V / 7, V / 3, V / 2, V - 1}) row[i] = 20.f;
    if (kind == 7) row[V / 3] = row[V - 1] = INFINITY;
    return row;
  };
  int rows = 0, exact = 0, sharp = 0;
  for (int V : {151936, 1001, 48, 5}) {
    std::vector<float> logits;
    std::vector<SamplingSlot> slots;
    for (int kind = 0; kind < kinds; kind++)
      for (const Cut& c : cuts) {
        auto row = make_row(kind, V);
        logits.insert(logits.end(), row.begin(), row.end());
        SamplingSlot s = make_slot(c.t, c.k == -2 ? V - 1 : c.k, c.p, rng64(), rng64());
        s.min_p = c.min_p;
        slots.push_back(s);
      }
    const int B = (int)slots.size();
    const ThreeDraws d = gpu_sample_all(logits, slots, V);
    const std::vector<int>&plain = d.plain, &bisect = d.bisect, &fast = d.fast;
    for (int b = 0; b < B; b++, rows++) {
      const float* row = &logits[(size_t)b * V];
      const SamplingSlot& s = slots[b];
      const int kind = b / (int)cuts.size(), got = plain[b];
      char what[160];
      snprintf(what, sizeof what, "V=%d row %d (kind %d; T=%g k=%d p=%g min_p=%g)", V, b, kind, s.temperature,
               s.top_k, s.top_p, s.min_p);
      if (!CHECK_MSG(got >= 0 && got < V, "%s: token %d out of range", what, got)) continue;
      CHECK_MSG(bisect[b] == got && fast[b] == got, "%s: sort %d, bisection %d, radix select %d", what, got,
                bisect[b], fast[b]);
      const bool greedy = !(s.temperature > 0.f);
      if (kind == 6) CHECK_MSG(got == 0, "%s: nothing finite, token %d, want 0", what, got);
      if (!greedy && (s.top_k == 1 || s.top_p < 1e-6f)) {
        float m = -INFINITY;
        for (int i = 0; i < V; i++) m = std::max(m, scaled_logit(row[i], 1.f / s.temperature));
        CHECK_MSG(scaled_logit(row[got], 1.f / s.temperature) == m, "%s: token %d is not of the largest value",
                  what, got);
      }
      std::vector<char> all(V, 1);
      const KeptSets k = greedy ? KeptSets{all, all, V, V} : cpu_kept_sets(row, V, s);
      if (!CHECK_MSG(k.loose[got], "%s: token %d outside the CPU's kept set of %d", what, got, k.n_loose)) continue;
      double margin;
      const int want = cpu_sample(row, V, s, k.strict, &margin);
      if (k.n_strict != k.n_loose || margin < 1e-4) continue;  // (a NaN margin: a tie at +-inf, decided by index)
      sharp++;
      exact += CHECK_MSG(got == want, "%s: token %d, the CPU's draw %d", what, got, want);
    }
  }
  printf("    %d rows: the three samplers drew the same token; %d rows sharp enough for the CPU's exact draw, "
         "%d equal to it\n", rows, sharp, exact);
  CHECK_MSG(sharp > rows / 2, "only %d of %d rows sharp: the test lost its power", sharp, rows);
}

// sample_fast's budget: at B = 256 over Qwen3's vocabulary, greedy and plain temperature (no top-k or top-p
// cut, the fast path) take under 500 us.
TEST(sample_fast_within_budget_at_b256) {
  REQUIRE_GPU();
  std::mt19937 rng(17);
  const int B = 256, V = 151936;
  DevBuf<float> d_logits(random_logits((size_t)B * V, rng, 2.f));
  DevBuf<int> d_out(B);
  const size_t ws = any_sampler_workspace_bytes(B, V);
  DevBuf<unsigned char> d_ws(ws);
  for (float temperature : {0.f, 0.6f}) {
    std::vector<SamplingSlot> slots(B, make_slot(temperature, 0, 1.f, 1, 1));
    for (int b = 0; b < B; b++) slots[b].seed = b;
    DevBuf<SamplingSlot> d_slots(slots);
    const double ms = time_ms([&] { sample_fast(d_out.p, d_logits.p, d_slots.p, B, V, d_ws.p, ws, 0); }, 20);
    CHECK_MSG(ms < 0.5, "temperature %g at B=256: %.1f us, the budget is 500 us", temperature, ms * 1e3);
  }
}

TIMING(bench_sampler) {
  REQUIRE_GPU();
  std::mt19937 rng(17);
  const int V = 151936;
  for (int B : {256, 32, 1}) {
    auto logits = random_logits((size_t)B * V, rng, 2.f);
    DevBuf<float> d_logits(logits);
    DevBuf<int> d_out(B);
    size_t ws = any_sampler_workspace_bytes(B, V);
    DevBuf<unsigned char> d_ws(ws);
    struct Cfg { const char* name; SamplingSlot slot; };
    std::vector<Cfg> cfgs = {{"greedy", make_slot(0.f, 0, 1.f, 1, 1)},
                             {"temperature (fast path)", make_slot(0.6f, 0, 1.f, 1, 1)},
                             {"top-k 50", make_slot(0.6f, 50, 1.f, 1, 1)},
                             {"top-p 0.9", make_slot(0.6f, 0, 0.9f, 1, 1)},
                             {"top-k 50 + top-p 0.9", make_slot(0.6f, 50, 0.9f, 1, 1)},
                             {"top-p 0.9, T 5 (list overflow)", make_slot(5.f, 0, 0.9f, 1, 1)}};
    for (auto& c : cfgs) {
      std::vector<SamplingSlot> slots(B, c.slot);
      for (int b = 0; b < B; b++) slots[b].seed = b;
      DevBuf<SamplingSlot> d_slots(slots);
      double ms = time_ms([&] { sample_fast(d_out.p, d_logits.p, d_slots.p, B, V, d_ws.p, ws, 0); }, 20);
      double bisect = time_ms([&] { sample_bisect(d_out.p, d_logits.p, d_slots.p, B, V, d_ws.p, ws, 0); }, 5);
      double plain = time_ms([&] { sample(d_out.p, d_logits.p, d_slots.p, B, V, d_ws.p, ws, 0); }, 3);
      double gbs = (double)B * V * 4 / (ms * 1e-3) / 1e9;
      printf("    BENCH sample B=%-3d V=%d %-32s %8.1f us  (%5.0f GB/s of logits); 20a: %8.1f us; section 9: "
             "%8.1f us\n", B, V, c.name, ms * 1e3, gbs, bisect * 1e3, plain * 1e3);
    }
  }
}

int main(int argc, char** argv) {
  install_default_optimizations();
  return test_main(argc, argv);
}
