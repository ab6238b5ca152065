// Sections 10, 18 and 28-30 on the GPU: matrix products through cuBLASLt (Part I) and through the small-batch
// gemv (Part II), each against the CPU reference (linear_reference, in double), the fused gemvs bit for bit
// against the kernels they replace, and the two paths timed side by side at decode shapes; the FP8 weight
// chapter's kernels (the weight quantizer and the activations' quantizer, bit for bit) and its cuBLASLt
// block-scaled product against fp8_linear_reference and against the dequantized bf16 product.
#define NANOVLLM_TESTING
#include "../../nanovllm.cu"
#include "../test.h"

#include "gpu_fixtures.h"

static std::vector<uint16_t> random_bf16(size_t n, uint64_t seed, float scale) {
  std::vector<uint16_t> v(n);
  uint64_t r = seed;
  for (auto& x : v) r = splitmix64(r), x = float_to_bf16_bits(scale * ((float)(r % 20001) / 10000.0f - 1.0f));
  return v;
}

// y = x W^T on the CPU: nanovllm.cu's linear_reference, from the bf16 inputs.
static std::vector<float> cpu_gemm(const std::vector<uint16_t>& x, const std::vector<uint16_t>& w, int M, int N,
                                   int K) {
  std::vector<float> xf(x.size()), wf(w.size()), y((size_t)M * N);
  for (size_t i = 0; i < x.size(); i++) xf[i] = bf16_bits_to_float(x[i]);
  for (size_t i = 0; i < w.size(); i++) wf[i] = bf16_bits_to_float(w[i]);
  linear_reference(y.data(), xf.data(), wf.data(), M, N, K);
  return y;
}

static void check_shape(Gemm& g, int M, int N, int K, bool gemv_path) {
  auto x = random_bf16((size_t)M * K, M * 7919 + K, 1.0f), w = random_bf16((size_t)N * K, N * 31 + K, 0.05f);
  bf16 *dx, *dw, *dy;
  CUDA_CHECK(cudaMalloc(&dx, x.size() * 2));
  CUDA_CHECK(cudaMalloc(&dw, w.size() * 2));
  CUDA_CHECK(cudaMalloc(&dy, (size_t)M * N * 2));
  CUDA_CHECK(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dw, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemset(dy, 0xff, (size_t)M * N * 2));  // poison: NaN
  if (gemv_path) gemv(dy, dx, dw, M, N, K, 0);
  else g.run(dy, dx, dw, M, N, K, 0);
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> yb((size_t)M * N);
  CUDA_CHECK(cudaMemcpy(yb.data(), dy, yb.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<float> got(yb.size());
  for (size_t i = 0; i < yb.size(); i++) got[i] = bf16_bits_to_float(yb[i]);
  auto want = cpu_gemm(x, w, M, N, K);
  char what[96];
  snprintf(what, sizeof what, "%s M=%d N=%d K=%d", gemv_path ? "gemv" : "cublasLt", M, N, K);
  check_close(what, got.data(), want.data(), got.size(), 1e-2f, 1e-2f);
  cudaFree(dx), cudaFree(dw), cudaFree(dy);
}

TEST(gemm_small_batch_matches_cpu) {
  if (!have_gpu()) SKIP("no GPU");
  Gemm g;
  g.init();
  for (int M : {1, 2})
    for (auto nk : std::vector<std::pair<int, int>>{
             {1, 8}, {37, 1000}, {255, 1024}, {300, 1032}, {129, 3072}, {64, 2056}})  // 255 x 1024: two rows a warp
      check_shape(g, M, nk.first, nk.second, true);
  // Rows that would take more thread blocks than the GPU holds at once, one a warp (Qwen3-30B-A3B's qkv, and an
  // odd N with K not a multiple of a stretch): two rows a warp in stretches, where the GPU's size makes it so.
  for (int M : {1, 2})
    for (auto nk : std::vector<std::pair<int, int>>{{5120, 2048}, {6001, 2056}})
      check_shape(g, M, nk.first, nk.second, true);
  for (int M : {1, 2, 9, 40}) check_shape(g, M, 300, 1032, false);
}

// Microseconds per call of run(i), i the copy of the weights it reads: one call on every copy first, then 50
// calls rotating over them, so each reads its weights from memory, as a decode step does.
static float time_rotating(int copies, const std::function<void(int)>& run) {
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < copies; i++) run(i);
  const int reps = 50;
  CUDA_CHECK(cudaEventRecord(e0));
  for (int i = 0; i < reps; i++) run(i % copies);
  CUDA_CHECK(cudaEventRecord(e1));
  CUDA_CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  return ms * 1000 / reps;
}

// Time both paths on Qwen3-0.6B's and -8B's layer shapes; weights rotate over several copies so each run
// reads from memory, as a decode step does.
TIMING(gemm_small_batch_speed) {
  if (!have_gpu()) SKIP("no GPU");
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  printf("    GPU: %s\n", prop.name);
  Gemm g;
  g.init();
  struct Shape { const char* name; int N, K; };
  std::vector<Shape> shapes = {{"0.6B qkv", 4096, 1024}, {"0.6B o", 1024, 2048}, {"0.6B gate_up", 6144, 1024},
                               {"0.6B down", 1024, 3072}, {"8B qkv", 6144, 4096}, {"8B gate_up", 24576, 4096},
                               {"8B down", 4096, 12288}};
  for (auto& sh : shapes) {
    const int copies = std::max(2, (int)(512e6 / ((double)sh.N * sh.K * 2)));
    bf16 *w, *x, *y;
    CUDA_CHECK(cudaMalloc(&w, (size_t)copies * sh.N * sh.K * 2));
    CUDA_CHECK(cudaMemset(w, 0x3c, (size_t)copies * sh.N * sh.K * 2));
    CUDA_CHECK(cudaMalloc(&x, (size_t)8 * sh.K * 2));
    CUDA_CHECK(cudaMemset(x, 0x3c, (size_t)8 * sh.K * 2));
    CUDA_CHECK(cudaMalloc(&y, (size_t)8 * sh.N * 2));
    for (int M : {1, 2}) {
      float t[2];
      for (int path = 0; path < 2; path++)
        t[path] = time_rotating(copies, [&](int i) {
          const bf16* W = w + (size_t)i * sh.N * sh.K;
          if (path == 1) gemv(y, x, W, M, sh.N, sh.K, 0);
          else g.run(y, x, W, M, sh.N, sh.K, 0);
        });
      double bytes = (double)sh.N * sh.K * 2;
      printf("    %-12s M=%d: cuBLASLt %6.1f us (%4.0f GB/s)  gemv %6.1f us (%4.0f GB/s)\n", sh.name, M, t[0],
             bytes / t[0] / 1e3, t[1], bytes / t[1] / 1e3);
    }
    cudaFree(w), cudaFree(x), cudaFree(y);
  }
}

// The fused gemvs (RMSNORM and SILU_MUL inputs, ADD output) against the kernels they replace, run one after
// the other: the results must be identical bit for bit, since both paths share the row helpers.
struct Dev {
  bf16* p = nullptr;
  size_t n = 0;
  explicit Dev(const std::vector<uint16_t>& h) : n(h.size()) {
    CUDA_CHECK(cudaMalloc(&p, n * 2));
    CUDA_CHECK(cudaMemcpy(p, h.data(), n * 2, cudaMemcpyHostToDevice));
  }
  explicit Dev(size_t count) : n(count) {
    CUDA_CHECK(cudaMalloc(&p, n * 2));
    CUDA_CHECK(cudaMemset(p, 0xff, n * 2));  // poison: NaN
  }
  ~Dev() { cudaFree(p); }
  std::vector<uint16_t> get() const {
    std::vector<uint16_t> h(n);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(h.data(), p, n * 2, cudaMemcpyDeviceToHost));
    return h;
  }
};

static bool same_bits(const char* what, const std::vector<uint16_t>& got, const std::vector<uint16_t>& want) {
  for (size_t i = 0; i < got.size(); i++)
    if (got[i] != want[i])
      return CHECK_MSG(false, "%s: element %zu is %g, the separate kernels give %g", what, i,
                       bf16_bits_to_float(got[i]), bf16_bits_to_float(want[i]));
  return true;
}

TEST(fused_gemv_matches_separate_kernels) {
  if (!have_gpu()) SKIP("no GPU");
  const float eps = 1e-6f;
  struct Shape { int N, K; };
  for (int M : {1, 2})
    for (Shape sh : {Shape{4096, 1024}, Shape{1024, 3072}, Shape{37, 1000}, Shape{300, 4096}, Shape{8, 8},
                      Shape{5120, 2048}}) {
      const int N = sh.N, K = sh.K;
      char what[96];
      Dev W(random_bf16((size_t)N * K, N * 17 + K, 0.05f));
      Dev res(random_bf16((size_t)M * K, M * 5 + K, 2.0f)), norm_w(random_bf16(K, K + 3, 1.5f));
      Dev gate_up(random_bf16((size_t)M * 2 * K, M + 2 * K, 3.0f));
      Dev resid_out(random_bf16((size_t)M * N, M + N, 1.0f));
      Dev xn((size_t)M * K), act((size_t)M * K), hidden((size_t)M * N), normed((size_t)M * N);
      Dev y_fused((size_t)M * N), y_sep((size_t)M * N);
      // RMSNORM input: gemv(rmsnorm(res)) against rmsnorm then gemv
      gemv(y_fused.p, res.p, W.p, M, N, K, 0, {GemvIn::RMSNORM, norm_w.p, eps});
      rmsnorm(xn.p, res.p, norm_w.p, M, K, eps, 0);
      gemv(y_sep.p, xn.p, W.p, M, N, K, 0);
      snprintf(what, sizeof what, "RMSNORM M=%d N=%d K=%d", M, N, K);
      same_bits(what, y_fused.get(), y_sep.get());
      // SILU_MUL input: gemv(silu(gate) * up) against silu_and_mul then gemv
      gemv(y_fused.p, gate_up.p, W.p, M, N, K, 0, {GemvIn::SILU_MUL});
      silu_and_mul(act.p, gate_up.p, M, K, 0);
      gemv(y_sep.p, act.p, W.p, M, N, K, 0);
      snprintf(what, sizeof what, "SILU_MUL M=%d N=%d K=%d", M, N, K);
      same_bits(what, y_fused.get(), y_sep.get());
      // ADD output (with SILU_MUL input, as down_proj runs): residual += ..., against gemv into hidden and
      // add_rmsnorm's residual update (N plays H there; it needs N % 8 == 0)
      if (N % 8 == 0) {
        std::vector<uint16_t> r0 = resid_out.get();
        Dev r_fused(r0), r_sep(r0), nw(random_bf16(N, N, 1.0f));
        gemv(r_fused.p, gate_up.p, W.p, M, N, K, 0, {GemvIn::SILU_MUL, nullptr, 0.f, true});
        gemv(hidden.p, act.p, W.p, M, N, K, 0);
        add_rmsnorm(normed.p, r_sep.p, hidden.p, nw.p, M, N, eps, 0);
        snprintf(what, sizeof what, "SILU_MUL + ADD M=%d N=%d K=%d", M, N, K);
        same_bits(what, r_fused.get(), r_sep.get());
      }
    }
}

// Batch-1 decode's four products of a Qwen3-0.6B layer, each fused gemv against the kernels it replaces,
// launched back to back on one stream as a decode step launches them.
TIMING(fused_gemv_speed) {
  if (!have_gpu()) SKIP("no GPU");
  const int H = 1024, I = 3072, QKV = 4096, O_K = 2048, reps = 200;
  Dev wqkv(random_bf16((size_t)QKV * H, 1, 0.05f)), wo(random_bf16((size_t)H * O_K, 2, 0.05f));
  Dev wgu(random_bf16((size_t)2 * I * H, 3, 0.05f)), wd(random_bf16((size_t)H * I, 4, 0.05f));
  Dev res(random_bf16(H, 5, 1.0f)), nw(random_bf16(H, 6, 1.0f)), attn(random_bf16(O_K, 7, 1.0f));
  Dev x(H), qkv(QKV), hidden(H), gu(2 * I), act(I);
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  auto layer = [&](bool fused) {
    if (fused) {
      gemv(qkv.p, res.p, wqkv.p, 1, QKV, H, 0, {GemvIn::RMSNORM, nw.p, 1e-6f});
      gemv(res.p, attn.p, wo.p, 1, H, O_K, 0, {GemvIn::PLAIN, nullptr, 0.f, true});
      gemv(gu.p, res.p, wgu.p, 1, 2 * I, H, 0, {GemvIn::RMSNORM, nw.p, 1e-6f});
      gemv(res.p, gu.p, wd.p, 1, H, I, 0, {GemvIn::SILU_MUL, nullptr, 0.f, true});
    } else {
      add_rmsnorm(x.p, res.p, hidden.p, nw.p, 1, H, 1e-6f, 0);
      gemv(qkv.p, x.p, wqkv.p, 1, QKV, H, 0);
      gemv(hidden.p, attn.p, wo.p, 1, H, O_K, 0);
      add_rmsnorm(x.p, res.p, hidden.p, nw.p, 1, H, 1e-6f, 0);
      gemv(gu.p, x.p, wgu.p, 1, 2 * I, H, 0);
      silu_and_mul(act.p, gu.p, 1, I, 0);
      gemv(hidden.p, act.p, wd.p, 1, H, I, 0);
    }
  };
  float t[2];
  for (int fused = 0; fused < 2; fused++) {
    CUDA_CHECK(cudaMemset(res.p, 0, H * 2));  // keep the residual finite over many repetitions
    CUDA_CHECK(cudaMemset(hidden.p, 0, H * 2));
    for (int i = 0; i < 10; i++) layer(fused);
    CUDA_CHECK(cudaEventRecord(e0));
    for (int i = 0; i < reps; i++) layer(fused);
    CUDA_CHECK(cudaEventRecord(e1));
    CUDA_CHECK(cudaEventSynchronize(e1));
    CUDA_CHECK(cudaEventElapsedTime(&t[fused], e0, e1));
    t[fused] = t[fused] * 1000 / reps;
  }
  printf("    Qwen3-0.6B layer products at M=1 (weights in L2 after the first pass): separate kernels %.1f us, "
         "fused %.1f us\n", t[0], t[1]);
}


// ---- FP8 weights (sections 28-30) ----
// A random bf16 [N, K] matrix with a block of zeros and a block of large values, so the quantizer meets a
// zero amax and values far from 1.
static std::vector<uint16_t> fp8_test_weight(int N, int K, uint64_t seed) {
  auto w = random_bf16((size_t)N * K, seed, 0.05f);
  for (int r = 0; r < 128 && r < N; r++)
    for (int c = 0; c < 128 && c < K; c++) w[(size_t)r * K + c] = 0;
  if (N >= 256)
    for (int r = 128; r < 256; r++)
      for (int c = 0; c < 128 && c < K; c++) w[(size_t)r * K + c] = float_to_bf16_bits(300.f * bf16_bits_to_float(w[(size_t)r * K + c]));
  return w;
}

// Why this GPU and cuBLASLt cannot run the FP8 weight chapter ("" when they can): fp8_weights_problem for a
// shape it always takes.
static std::string fp8_chapter_problem() {
  ModelConfig shape;
  shape.hidden_size = shape.intermediate_size = 1024;
  return fp8_weights_problem(shape, 1);
}

// A test weight [N, K] (fp8_test_weight) quantized on the GPU by quantize_weight into buffers it owns,
// poisoned first; m points at them.
struct QuantizedTestWeight {
  std::vector<uint16_t> w;  // the bf16 weight
  DevBuf<uint16_t> dw;
  DevBuf<uint8_t> q;
  DevBuf<float> sc;
  Fp8Matrix m;
  QuantizedTestWeight(int N, int K, uint64_t seed)
      : w(fp8_test_weight(N, K, seed)), dw(w), q((size_t)N * K), sc((size_t)N / 128 * (cdiv(K / 128, 4) * 4)) {
    q.poison(), sc.poison();
    m.N = N, m.K = K, m.ld = (int)cdiv(K / 128, 4) * 4, m.w = q.p, m.scale = sc.p;
    quantize_weight(m, (const bf16*)dw.p, 0);
  }
};

// quantize_weight against quantize_weight_reference: the same bytes and scales, exactly.
TEST(fp8_quantize_weight_matches_reference) {
  if (!have_gpu()) SKIP("no GPU");
  for (auto nk : std::vector<std::pair<int, int>>{{128, 128}, {256, 384}, {384, 1024}}) {
    const int N = nk.first, K = nk.second;
    QuantizedTestWeight t(N, K, N * 7 + K);
    const std::vector<uint16_t>& w = t.w;
    const Fp8Matrix& m = t.m;
    DevBuf<uint8_t>& q = t.q;
    DevBuf<float>& sc = t.sc;
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint8_t> gq = q.download(), wq((size_t)N * K);
    std::vector<float> gs = sc.download();
    int bad_q = 0, bad_s = 0;
    for (int bi = 0; bi < N / 128; bi++)
      for (int bj = 0; bj < K / 128; bj++) {
        const float s = quantize_weight_reference(wq.data(), (const bf16*)w.data(), K, bi, bj);
        bad_s += gs[(size_t)bi * m.ld + bj] != s;
      }
    for (size_t i = 0; i < wq.size(); i++) bad_q += gq[i] != wq[i];
    CHECK_MSG(bad_q == 0 && bad_s == 0, "N=%d K=%d: %d bytes and %d scales differ from the CPU reference", N, K,
              bad_q, bad_s);
  }
}

// quantize_rows against quantize_rows_reference, bit for bit, at token counts that need padding to 4.
TEST(fp8_quantize_rows_matches_reference) {
  if (!have_gpu()) SKIP("no GPU");
  for (int T : {1, 3, 4, 5, 17})
    for (int K : {128, 384, 1024}) {
      const int T4 = (int)cdiv(T, 4) * 4;
      auto x = random_bf16((size_t)T * K, T * 131 + K, 2.0f);
      for (int k = 0; k < 128; k++) x[k] = 0;  // a group of zeros: scale 1
      DevBuf<uint16_t> dx(x);
      DevBuf<uint8_t> q((size_t)T4 * K);
      DevBuf<float> sc((size_t)T4 * K / 128);
      q.poison(), sc.poison();
      quantize_rows(q.p, sc.p, (const bf16*)dx.p, T, K, 0);
      CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<float> xf(x.size());
      for (size_t i = 0; i < x.size(); i++) xf[i] = bf16_bits_to_float(x[i]);
      std::vector<uint8_t> wq((size_t)T4 * K);
      std::vector<float> ws((size_t)T4 * K / 128);
      quantize_rows_reference(wq.data(), ws.data(), xf.data(), T, K);
      std::vector<uint8_t> gq = q.download();
      std::vector<float> gs = sc.download();
      int bad = 0;
      for (size_t i = 0; i < wq.size(); i++) bad += gq[i] != wq[i];
      for (size_t i = 0; i < ws.size(); i++) bad += gs[i] != ws[i];
      CHECK_MSG(bad == 0, "T=%d K=%d: %d bytes or scales differ from the CPU reference", T, K, bad);
    }
}

// The quantizer fused into the kernels before it (section 29): rmsnorm_quantize against rmsnorm then
// quantize_rows, silu_quantize against silu_and_mul then quantize_rows, bit for bit (bytes and scales, the
// padding rows included), at token counts that need padding to 4 and widths of 1 to 40 groups.
TEST(fp8_fused_quantizers_match_separate_kernels) {
  if (!have_gpu()) SKIP("no GPU");
  for (int T : {1, 3, 4, 6, 37})
    for (int K : {128, 1024, 2560, 5120}) {
      const int T4 = (int)cdiv(T, 4) * 4;
      char what[96];
      DevBuf<uint8_t> q1((size_t)T4 * K), q2((size_t)T4 * K);
      DevBuf<float> s1((size_t)T4 * K / 128), s2((size_t)T4 * K / 128);
      auto same = [&](const char* name) {
        CUDA_CHECK(cudaDeviceSynchronize());
        snprintf(what, sizeof what, "%s T=%d K=%d", name, T, K);
        const std::vector<uint8_t> a = q1.download(), b = q2.download();
        const std::vector<float> sa = s1.download(), sb = s2.download();
        int bad = 0;
        for (size_t i = 0; i < a.size(); i++) bad += a[i] != b[i];
        for (size_t i = 0; i < sa.size(); i++) bad += sa[i] != sb[i];
        CHECK_MSG(bad == 0, "%s: %d bytes or scales differ from the separate kernels", what, bad);
      };
      DevBuf<uint16_t> x(random_bf16((size_t)T * K, T * 7 + K, 3.0f)), nw(random_bf16(K, K + 1, 1.5f));
      DevBuf<uint16_t> xn((size_t)T * K);
      q1.poison(), q2.poison(), s1.poison(), s2.poison();
      rmsnorm((bf16*)xn.p, (const bf16*)x.p, (const bf16*)nw.p, T, K, 1e-6f, 0);
      quantize_rows(q1.p, s1.p, (const bf16*)xn.p, T, K, 0);
      rmsnorm_quantize(q2.p, s2.p, (const bf16*)x.p, (const bf16*)nw.p, T, K, 1e-6f, 0);
      same("rmsnorm_quantize");
      DevBuf<uint16_t> gu(random_bf16((size_t)T * 2 * K, T + 3 * K, 4.0f)), act((size_t)T * K);
      q1.poison(), q2.poison(), s1.poison(), s2.poison();
      silu_and_mul((bf16*)act.p, (const bf16*)gu.p, T, K, 0);
      quantize_rows(q1.p, s1.p, (const bf16*)act.p, T, K, 0);
      silu_quantize(q2.p, s2.p, (const bf16*)gu.p, T, K, 0);
      same("silu_quantize");
    }
}

// A large step's quantizing at prefill sizes (8B widths): Part I's RMSNorm or SiLU-and-mul then quantize_rows,
// against the fused kernel.
TIMING(fp8_fused_quantizer_speed) {
  if (!have_gpu()) SKIP("no GPU");
  const int H = 4096, I = 12288, reps = 20;
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  for (int T : {256, 4096, 16384}) {
    DevBuf<uint16_t> x((size_t)T * H), nw(H), xn((size_t)T * H), gu((size_t)T * 2 * I), act((size_t)T * I);
    CUDA_CHECK(cudaMemset(x.p, 0x3c, x.n * 2));
    CUDA_CHECK(cudaMemset(nw.p, 0x3c, nw.n * 2));
    CUDA_CHECK(cudaMemset(gu.p, 0x3c, gu.n * 2));
    DevBuf<uint8_t> q((size_t)T * I);
    DevBuf<float> sc((size_t)T * I / 128);
    float ms[4];
    for (int v = 0; v < 4; v++) {
      auto run = [&] {
        if (v == 0) rmsnorm((bf16*)xn.p, (const bf16*)x.p, (const bf16*)nw.p, T, H, 1e-6f, 0),
                    quantize_rows(q.p, sc.p, (const bf16*)xn.p, T, H, 0);
        if (v == 1) rmsnorm_quantize(q.p, sc.p, (const bf16*)x.p, (const bf16*)nw.p, T, H, 1e-6f, 0);
        if (v == 2) silu_and_mul((bf16*)act.p, (const bf16*)gu.p, T, I, 0),
                    quantize_rows(q.p, sc.p, (const bf16*)act.p, T, I, 0);
        if (v == 3) silu_quantize(q.p, sc.p, (const bf16*)gu.p, T, I, 0);
      };
      run();
      CUDA_CHECK(cudaEventRecord(e0));
      for (int i = 0; i < reps; i++) run();
      CUDA_CHECK(cudaEventRecord(e1));
      CUDA_CHECK(cudaEventSynchronize(e1));
      CUDA_CHECK(cudaEventElapsedTime(&ms[v], e0, e1));
    }
    printf("    T=%5d: rmsnorm + quantize_rows %7.1f us, rmsnorm_quantize %7.1f us; silu_and_mul + quantize_rows "
           "%7.1f us, silu_quantize %7.1f us\n", T, ms[0] * 1000 / reps, ms[1] * 1000 / reps, ms[2] * 1000 / reps,
           ms[3] * 1000 / reps);
  }
}

// got [T, N] (the GPU's product of x [T, K] and the e4m3 weight wq with block scales ws [N/128, ld]) against
// fp8_linear_reference, the same arithmetic in double. The tensor cores sum a block's e4m3 products with about
// 14 significant bits (DeepSeek-V3's report, and what this test measured), so an element's error scales with
// the sum of its terms' magnitudes, not with the result: where large terms cancel (the block of large
// weights), 1% of the result is too tight. Bound: 1e-2 + 1e-2 |want| + 2^-12 x sum |x_q w| over the row (the
// terms in their scaled values).
static void check_fp8_product(const char* what, const std::vector<float>& got, const std::vector<float>& xf,
                              const std::vector<uint8_t>& wq, const std::vector<float>& ws, int ld, int T, int N,
                              int K) {
  const int T4 = (int)cdiv(T, 4) * 4;
  std::vector<float> want((size_t)T * N);
  fp8_linear_reference(want.data(), xf.data(), wq.data(), ws.data(), ld, T, N, K);
  std::vector<uint8_t> xq_ref((size_t)T4 * K);
  std::vector<float> xs_ref((size_t)T4 * K / 128);
  quantize_rows_reference(xq_ref.data(), xs_ref.data(), xf.data(), T, K);
  const float* e4m3 = block_quantized_values();
  int bad = 0;
  size_t worst = 0;
  double worst_excess = -1;
  for (int t = 0; t < T; t++)
    for (int n = 0; n < N; n++) {
      double mag = 0;
      for (int k = 0; k < K; k++)
        mag += fabs(e4m3[xq_ref[(size_t)t * K + k]] * xs_ref[(size_t)(k / 128) * T4 + t] *
                    e4m3[wq[(size_t)n * K + k]] * ws[(size_t)(n / 128) * ld + k / 128]);
      const size_t i = (size_t)t * N + n;
      const double err = fabs(got[i] - want[i]), bound = 1e-2 + 1e-2 * fabs(want[i]) + mag / 4096;
      if (!(err <= bound)) bad++;
      if (err - bound > worst_excess) worst_excess = err - bound, worst = i;
    }
  CHECK_MSG(bad == 0, "%s: %d of %zu elements out of bounds; worst at [%zu]: got %g want %g", what, bad,
            got.size(), worst, got[worst], want[worst]);
}

// The cuBLASLt block-scaled product (fp8_linear) against fp8_linear_reference (the same arithmetic in double)
// at token counts that are and are not multiples of 4 and K whose scale rows need padding (384: 3 blocks, ld 4),
// and, more loosely, against the bf16 product of the dequantized weights (what the activations' rounding costs).
TEST(fp8_linear_matches_reference) {
  if (!have_gpu()) SKIP("no GPU");
  Gemm g;
  g.init();
  const std::string problem = fp8_chapter_problem();
  if (!problem.empty()) SKIP("no FP8 weight chapter here: %s", problem.c_str());
  for (auto nk : std::vector<std::pair<int, int>>{{256, 384}, {384, 1024}, {1024, 3072}})
    for (int T : {1, 3, 4, 6, 33, 130}) {
      const int N = nk.first, K = nk.second, T4 = (int)cdiv(T, 4) * 4;
      QuantizedTestWeight t(N, K, N * 3 + K);
      const Fp8Matrix& m = t.m;
      DevBuf<uint8_t>& q = t.q;
      DevBuf<float>& sc = t.sc;
      Fp8Weights& f = g_fp8_weights;
      f.rows = T4, f.kmax = K;
      DevBuf<uint8_t> xq((size_t)T4 * K);
      DevBuf<float> xs((size_t)T4 * K / 128);
      f.xq = xq.p, f.xs = xs.p;
      auto x = random_bf16((size_t)T * K, T * 17 + K, 1.0f);
      DevBuf<uint16_t> dx(x);
      DevBuf<uint16_t> y((size_t)T4 * N);
      y.poison();
      fp8_linear(g, (bf16*)y.p, (const bf16*)dx.p, m, T, 0);
      CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<uint16_t> yb = y.download();
      std::vector<float> got((size_t)T * N), xf(x.size());
      for (size_t i = 0; i < got.size(); i++) got[i] = bf16_bits_to_float(yb[i]);
      for (size_t i = 0; i < x.size(); i++) xf[i] = bf16_bits_to_float(x[i]);
      std::vector<uint8_t> wq = q.download();
      std::vector<float> ws = sc.download();
      char what[96];
      snprintf(what, sizeof what, "fp8_linear T=%d N=%d K=%d", T, N, K);
      check_fp8_product(what, got, xf, wq, ws, m.ld, T, N, K);
      // the dequantized weights' bf16 product: within the activations' e4m3 rounding (2^-4 relative per value)
      std::vector<float> wd((size_t)N * K), yd((size_t)T * N);
      for (int r = 0; r < N; r++)
        for (int c = 0; c < K; c++)
          wd[(size_t)r * K + c] = e4m3_to_float(wq[(size_t)r * K + c]) * ws[(size_t)(r / 128) * m.ld + c / 128];
      linear_reference(yd.data(), xf.data(), wd.data(), T, N, K);
      double num = 0, den = 0;
      for (size_t i = 0; i < yd.size(); i++) num += (got[i] - yd[i]) * (got[i] - yd[i]), den += yd[i] * yd[i];
      CHECK_MSG(sqrt(num / den) < 0.05, "%s: relative L2 distance %.3f from the dequantized bf16 product", what,
                sqrt(num / den));
      f = Fp8Weights{};
    }
}


// Section 30's gemv on the FP8 tensor cores, its input quantized by quantize_rows: against fp8_linear_reference
// (the large steps' arithmetic, which it shares) at every M it takes, on shapes with one, two and four 16-row
// tiles a thread block (the last two need N / 32 and N / 64 to reach two thread blocks per SM: 8448 and 24576
// rows on 132 SMs) and K of 1 to 96 slabs (fewer slabs than warps, and several stretches a warp); the ADD
// epilogue bit for bit against the PLAIN result added to the residual on the host, rounded as add_rmsnorm
// rounds.
TEST(fp8_gemv_matches_reference) {
  if (!have_gpu()) SKIP("no GPU");
  const std::string problem = fp8_chapter_problem();
  if (!problem.empty()) SKIP("no FP8 weight chapter here: %s", problem.c_str());
  struct Case { int N, K; std::vector<int> Ms; };
  for (const Case& c : std::vector<Case>{{256, 384, {1, 2, 3, 8}}, {384, 1024, {1, 2, 5}}, {1024, 3072, {1, 2, 8}},
                                        {128, 128, {1, 4}}, {128, 12288, {1, 2, 8}}, {8448, 384, {1, 2}},
                                        {24576, 256, {1, 7}}})
    for (int M : c.Ms) {
      const int N = c.N, K = c.K, T4 = (int)cdiv(M, 4) * 4;
      char what[96];
      snprintf(what, sizeof what, "gemv_fp8 M=%d N=%d K=%d (%d tiles a block)", M, N, K, gemv_fp8_tiles(N));
      QuantizedTestWeight t(N, K, N * 5 + K + M);
      const Fp8Matrix& m = t.m;
      std::vector<uint8_t> wq = t.q.download();
      std::vector<float> ws = t.sc.download();
      auto x = random_bf16((size_t)M * K, M * 101 + K, 1.0f);
      DevBuf<uint16_t> dx(x), y((size_t)M * N), y2((size_t)M * N);
      DevBuf<uint8_t> xq((size_t)T4 * K);
      DevBuf<float> xs((size_t)T4 * K / 128);
      quantize_rows(xq.p, xs.p, (const bf16*)dx.p, M, K, 0);
      y.poison();
      gemv_fp8((bf16*)y.p, xq.p, xs.p, T4, m, M, 0);
      CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<float> xf(x.size()), got((size_t)M * N);
      for (size_t i = 0; i < x.size(); i++) xf[i] = bf16_bits_to_float(x[i]);
      std::vector<uint16_t> yb = y.download();
      for (size_t i = 0; i < yb.size(); i++) got[i] = bf16_bits_to_float(yb[i]);
      check_fp8_product(what, got, xf, wq, ws, m.ld, M, N, K);
      // ADD: y2 starts as a residual and gets y added, rounded as add_rmsnorm rounds
      auto res = random_bf16((size_t)M * N, M + N, 1.0f);
      y2.upload(res);
      gemv_fp8((bf16*)y2.p, xq.p, xs.p, T4, m, M, 0, true);
      CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<uint16_t> h = y.download(), sum = y2.download();
      int bad = 0;
      for (size_t i = 0; i < h.size(); i++)
        bad += sum[i] != float_to_bf16_bits(bf16_bits_to_float(h[i]) + bf16_bits_to_float(res[i]));
      CHECK_MSG(bad == 0, "%s: ADD differs from the product added to the residual in %d places", what, bad);
    }
}

// FP8 weights at small steps: cuBLASLt's path (fp8_linear: the activations' quantizer, then the block-scaled
// product) against section 30's gemv (the same quantizer, then the gemv), at M = 1, 2, 4, 8 on Qwen3-0.6B's and
// -8B's layer shapes, each timed over rotating copies of the weights as gemm_small_batch_speed does. GB/s
// counts the weight bytes (one a weight). What FP8_GEMV_STEP is set from.
TIMING(fp8_small_batch_speed) {
  if (!have_gpu()) SKIP("no GPU");
  const std::string problem = fp8_chapter_problem();
  if (!problem.empty()) SKIP("no FP8 weight chapter here: %s", problem.c_str());
  Gemm g;
  g.init();
  struct Shape { const char* name; int N, K; };
  std::vector<Shape> shapes = {{"0.6B qkv", 4096, 1024}, {"0.6B o", 1024, 2048}, {"0.6B gate_up", 6144, 1024},
                               {"0.6B down", 1024, 3072}, {"8B qkv", 6144, 4096}, {"8B o", 4096, 4096},
                               {"8B gate_up", 24576, 4096}, {"8B down", 4096, 12288}};
  for (auto& sh : shapes) {
    const int copies = std::max(2, (int)(512e6 / ((double)sh.N * sh.K)));
    const int ld = (int)cdiv(sh.K / 128, 4) * 4;
    DevBuf<uint8_t> w((size_t)copies * sh.N * sh.K);
    DevBuf<float> sc((size_t)copies * sh.N / 128 * ld);
    CUDA_CHECK(cudaMemset(w.p, 0x30, w.n));
    CUDA_CHECK(cudaMemset(sc.p, 0, sc.n * sizeof(float)));
    DevBuf<uint16_t> x((size_t)8 * sh.K), y((size_t)8 * sh.N);
    CUDA_CHECK(cudaMemset(x.p, 0x3c, x.n * 2));
    Fp8Weights& f = g_fp8_weights;
    DevBuf<uint8_t> xq((size_t)8 * sh.K);
    DevBuf<float> xs((size_t)8 * sh.K / 128);
    f.rows = 8, f.kmax = sh.K, f.xq = xq.p, f.xs = xs.p;
    auto matrix = [&](int i) {
      Fp8Matrix m;
      m.N = sh.N, m.K = sh.K, m.ld = ld;
      m.w = w.p + (size_t)i * sh.N * sh.K, m.scale = sc.p + (size_t)i * sh.N / 128 * ld;
      return m;
    };
    for (int M : {1, 2, 4, 8}) {
      float t[2];
      for (int path = 0; path < 2; path++)
        t[path] = time_rotating(copies, [&](int i) {
          const Fp8Matrix m = matrix(i);
          if (path == 0) return fp8_linear(g, (bf16*)y.p, (const bf16*)x.p, m, M, 0);
          quantize_rows(xq.p, xs.p, (const bf16*)x.p, M, sh.K, 0);
          gemv_fp8((bf16*)y.p, xq.p, xs.p, (int)cdiv(M, 4) * 4, m, M, 0);
        });
      const double bytes = (double)sh.N * sh.K;
      printf("    %-12s M=%d: cuBLASLt %6.1f us (%4.0f GB/s)  gemv_fp8 %6.1f us (%4.0f GB/s)\n", sh.name, M, t[0],
             bytes / t[0] / 1e3, t[1], bytes / t[1] / 1e3);
    }
    f = Fp8Weights{};
  }
}

int main(int argc, char** argv) {
  install_default_optimizations();
  return test_main(argc, argv);
}
