// gpu_fixtures.h — what every GPU suite needs: whether a GPU is visible (a suite's cases SKIP without one, so
// `make test` on a CPU machine says so instead of passing), and DevBuf, a device array with upload, download
// and poison (0xFF bytes: a value the code under test must overwrite), and rows of random logits. Include
// after nanovllm.cu and test.h.
#pragma once

static bool have_gpu() {
  static int n = -1;
  if (n < 0 && cudaGetDeviceCount(&n) != cudaSuccess) {
    n = 0;
    cudaGetLastError();  // clear the error, so that later checks do not see it
  }
  return n > 0;
}
#define REQUIRE_GPU()                          \
  do {                                         \
    if (!have_gpu()) SKIP("no GPU visible");   \
  } while (0)

template <class T>
struct DevBuf {
  T* p = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t count) : n(count) {
    CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(1, n) * sizeof(T)));
  }
  DevBuf(const std::vector<T>& v) : DevBuf(v.size()) { upload(v); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  void upload(const std::vector<T>& v) {
    CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> v(n);
    CUDA_CHECK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
  void poison() { CUDA_CHECK(cudaMemset(p, 0xFF, n * sizeof(T))); }
};

// n logits drawn from N(0, stddev^2): the sampler suites' rows.
static std::vector<float> random_logits(size_t n, std::mt19937& rng, float stddev) {
  std::normal_distribution<float> d(0.f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}
