// gpu_fixtures.h — what every GPU suite needs: whether a GPU is visible (a suite's cases SKIP without one, so
// `make test` on a CPU machine says so instead of passing), and DevBuf, a device array with upload, download
// and poison (0xFF bytes: a value the code under test must overwrite), rows of random logits, and Part II's
// switches: install_default_optimizations (every suite's main) and ScopedOptimizations (a set, for one
// scope). Include after nanovllm.cu and test.h.
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

// The engine's default switches (section 2's registry), installed as a ModelRunner installs them (section
// 11). Every suite's main calls it before the cases run: until something installs a set, Part II's g_opt is
// all off, and the Part II kernels a case calls directly read it (launch_pdl: pdl; attention_decode_fast:
// cluster_merge; all_reduce_fast: oneshot_allreduce).
static void install_default_optimizations() { install_optimizations(default_optimizations()); }

#ifdef NANOVLLM_PART_II  // (a build with Part II cut out has none of these names)
// Part II's switches as `--opt spec` sets them (section 2's registry), installed the way ModelRunner does
// (install_optimizations, section 11: g_opt and the hook table g_hooks), for the life of this object; what
// was installed before (and the cache format, which installing resets to bf16: section 32's g_fp8_cache and
// the persistent kernel's g_persistent.format) is put back at its end.
// A case that only picks one kernel path may still set a g_opt field directly.
struct ScopedOptimizations {
  const Optimizations saved_opt = g_opt;
  const Hooks saved_hooks = g_hooks;
  const Fp8Cache saved_fp8_cache = g_fp8_cache;
  const PersistFormat* const saved_persist_format = g_persistent.format;
  explicit ScopedOptimizations(const char* spec) {
    OptimizationSet set = default_optimizations();
    const std::string problem = parse_optimizations(spec, set);
    if (!problem.empty()) die("ScopedOptimizations(\"%s\"): %s", spec, problem.c_str());
    install_optimizations(set);
  }
  ~ScopedOptimizations() {
    g_opt = saved_opt, g_hooks = saved_hooks, g_fp8_cache = saved_fp8_cache;
    g_persistent.format = saved_persist_format;
  }
  ScopedOptimizations(const ScopedOptimizations&) = delete;
};
#endif
