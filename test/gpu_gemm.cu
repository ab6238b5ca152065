// Section 6 on the GPU: Gemm::run through cuBLASLt and through the small-batch gemv, against a CPU
// reference, and the two paths timed side by side at decode shapes.
#define NANOVLLM_TESTING
#include "../nanovllm.cu"
#include "test.h"

static bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

static std::vector<uint16_t> random_bf16(size_t n, uint64_t seed, float scale) {
  std::vector<uint16_t> v(n);
  uint64_t r = seed;
  for (auto& x : v) r = splitmix64(r), x = float_to_bf16_bits(scale * ((float)(r % 20001) / 10000.0f - 1.0f));
  return v;
}

// y = x W^T on the CPU in double, from the bf16 inputs.
static std::vector<float> cpu_gemm(const std::vector<uint16_t>& x, const std::vector<uint16_t>& w, int M, int N,
                                   int K) {
  std::vector<float> y((size_t)M * N);
  for (int m = 0; m < M; m++)
    for (int n = 0; n < N; n++) {
      double acc = 0;
      for (int k = 0; k < K; k++)
        acc += (double)bf16_bits_to_float(x[(size_t)m * K + k]) * bf16_bits_to_float(w[(size_t)n * K + k]);
      y[(size_t)m * N + n] = (float)acc;
    }
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
  g.use_gemv = gemv_path;
  g.run(dy, dx, dw, M, N, K, 0);
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
  g.use_gemv = true;
}

TEST(gemm_small_batch_matches_cpu) {
  if (!have_gpu()) SKIP("no GPU");
  Gemm g;
  g.init();
  for (int M : {1, 2})
    for (auto nk : std::vector<std::pair<int, int>>{{1, 8}, {37, 1000}, {300, 1032}, {129, 3072}, {64, 2056}})
      check_shape(g, M, nk.first, nk.second, true);
  for (int M : {1, 9, 40}) check_shape(g, M, 300, 1032, false);
}

// Time both paths on Qwen3-0.6B's and -8B's layer shapes; weights rotate over several copies so each run
// reads from memory, as a decode step does.
TEST(gemm_small_batch_speed) {
  if (!have_gpu()) SKIP("no GPU");
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  printf("    GPU: %s\n", prop.name);
  Gemm g;
  g.init();
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
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
      for (int path = 0; path < 2; path++) {
        g.use_gemv = path == 1;
        for (int i = 0; i < copies; i++) g.run(y, x, w + (size_t)i * sh.N * sh.K, M, sh.N, sh.K, 0);
        const int reps = 50;
        CUDA_CHECK(cudaEventRecord(e0));
        for (int i = 0; i < reps; i++) g.run(y, x, w + (size_t)(i % copies) * sh.N * sh.K, M, sh.N, sh.K, 0);
        CUDA_CHECK(cudaEventRecord(e1));
        CUDA_CHECK(cudaEventSynchronize(e1));
        CUDA_CHECK(cudaEventElapsedTime(&t[path], e0, e1));
        t[path] = t[path] * 1000 / reps;
      }
      double bytes = (double)sh.N * sh.K * 2;
      printf("    %-12s M=%d: cuBLASLt %6.1f us (%4.0f GB/s)  gemv %6.1f us (%4.0f GB/s)\n", sh.name, M, t[0],
             bytes / t[0] / 1e3, t[1], bytes / t[1] / 1e3);
    }
    g.use_gemv = true;
    cudaFree(w), cudaFree(x), cudaFree(y);
  }
}

int main(int argc, char** argv) { return test_main(argc, argv); }
