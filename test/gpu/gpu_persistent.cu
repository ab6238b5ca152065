// gpu_persistent.cu — section 24's persistent decode kernel against section 14's forward pass and Part I's
// (Qwen3::forward), on random-weight models built in GPU memory (the Qwen3-0.6B shape with all 28 layers,
// a 4-layer slice of the Qwen3-8B shape, and an odd small shape whose sizes leave partial row groups and
// partial chunks everywhere, with one KV head and 16-token blocks), at every batch size the kernel has a plan
// for (1, 2, 4) with contexts from 1 to 3000 tokens over shuffled paged blocks; with a bf16 cache and with
// an fp8 one (section 31).
//   * Accuracy. The kernel adds its sums in another order than section 14 (and cuBLASLt), so the results are
//     not bit-identical: each bf16 rounding may land one ulp apart and the difference travels through the
//     layers. The yardstick is how far section 14 (other legitimate orders: section 18's gemv at batch 1
//     and 2, section 15's flash attention at every batch) lands from Part I (cuBLASLt, section 8's plain
//     attention) on the same model at batch 1 and 2: the persistent logits' relative L2 distance to Part
//     I's must be within 1.5x that plus 2e-3, likewise the keys and values the step stores, and the same token
//     must win wherever Part I's top-2 margin is clear of the logit error. The stored slots are poisoned with
//     NaN before each run: a run that does not store them, or that reads the step's own key back from the
//     cache instead of using it directly, is caught.
//     With an fp8 cache the reference is Part I on a bf16 copy of it (every stored e4m3 byte times its scale
//     is a bf16 number, so Part I sees exactly the values the fp8 paths read); the yardstick is section 14's
//     own distance from it, the largest over every batch size (both fp8 paths round the step's new keys and
//     values, which Part I keeps in bf16, at every batch size); and at least a quarter of the stored bytes
//     must equal section 14's: both round the same numbers, which differ by an ulp here and there (more of
//     them the deeper the model), while a wrong scale or format changes nearly every byte.
//   * Synchronisation. With thread blocks held back by different amounts at every operation (PersistArgs::
//     skew_ns), the logits and the stored keys and values must be the same bits as without: the kernel's
//     arithmetic does not depend on timing, so any difference is a read that raced a write. And the control:
//     leaving out one operation's wait (skip_wait) under the same skew must change the results, so this
//     check can fail.
//   * Each step on its own, as the file splits the kernel: section 24's operation chain without attention
//     (the embedding, every gate_up and down, the LM head) against Part I's kernels, with its skew and
//     left-out-wait controls; section 25's attention alone (the kernel given qkv) against section 7's
//     qk_norm_rope and section 8's attention_decode on the same qkv; section 26's plans (the step's operations
//     over the model's weights, their split and counts); section 27's routing cache (a stale or corrupt file
//     is measured again and rewritten).
//   * FP8 weights (section 30a): the kernel reading e4m3 weights against Part I on their dequantization, with
//     section 14's path with the FP8 chapter's stages as the yardstick, and its skew and left-out-wait checks.
//   * Routing (routing_by_context_picks_the_faster_path): at the context limit start-up measures, each side
//     of it must be faster on the path it routes to.
//   * Measurements (TIMING, figures only): one decode step captured in a CUDA graph, persistent vs section
//     14's stages (sampler not included), for the 0.6B and the full 8B shapes; and the breakdown of a step by operation (PersistArgs::trace): when
//     each block got past its wait, how many chunks of weights its ring then held, how long its input, its
//     rows and its end took, beside the time its share of the weights takes at its share of the bandwidth.
#define NANOVLLM_TESTING
#include "../../nanovllm.cu"
#include "../test.h"

#include "gpu_fixtures.h"

// Uniform values offset + amp * [-1, 1), from a hash of the index: reproducible and fast for GBs.
__global__ void fill_uniform(bf16* p, size_t n, uint64_t seed, float offset, float amp) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint64_t z = (i + seed * 0x632BE59BD9B4E019ull) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    p[i] = __float2bfloat16(offset + amp * ((float)(z >> 40) * (2.0f / 16777216.0f) - 1.0f));
  }
}
static void fill(bf16* p, size_t n, uint64_t seed, float offset, float amp) {
  fill_uniform<<<1024, 256>>>(p, n, seed, offset, amp);
  CUDA_CHECK(cudaGetLastError());
}

static ModelConfig test_shape(const std::string& name) {
  ModelConfig c;
  c.head_dim = 128, c.max_position_embeddings = 40960, c.rms_norm_eps = 1e-6f, c.rope_theta = 1e6f;
  if (name == "0.6b") {
    c.hidden_size = 1024, c.intermediate_size = 3072, c.num_hidden_layers = 28;
    c.num_attention_heads = 16, c.num_key_value_heads = 8, c.vocab_size = 151936, c.tie_word_embeddings = true;
  } else if (name == "8b-short") {
    c.hidden_size = 4096, c.intermediate_size = 12288, c.num_hidden_layers = 4;
    c.num_attention_heads = 32, c.num_key_value_heads = 8, c.vocab_size = 151936;
  } else if (name == "8b") {
    c.hidden_size = 4096, c.intermediate_size = 12288, c.num_hidden_layers = 36;
    c.num_attention_heads = 32, c.num_key_value_heads = 8, c.vocab_size = 151936;
  } else {  // "odd": nothing divides evenly; "odd-gqa6", "odd-gqa8": the same with 6 or 8 query heads per KV
             // head (attention's warps then take 2 or 4 heads each, in 3 or 2 sets: persist_attn_split)
    c.hidden_size = 520, c.intermediate_size = 1048, c.num_hidden_layers = 3;
    c.num_attention_heads = 4, c.num_key_value_heads = 1, c.vocab_size = 1001;
    if (name == "odd-gqa6") c.num_attention_heads = 12, c.num_key_value_heads = 2;
    if (name == "odd-gqa8") c.num_attention_heads = 8, c.num_key_value_heads = 1;
  }
  return c;
}

// Random e4m3 bytes whose values times `scale` are uniform in about [-1, 1) (so: the bf16 fill's range).
__global__ void fill_e4m3(fp8e4m3* p, size_t n, uint64_t seed, float scale) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint64_t z = (i + seed * 0x632BE59BD9B4E019ull) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z ^= z >> 31;
    const float u = (float)(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
    reinterpret_cast<uint8_t*>(p)[i] = __nv_cvt_float_to_fp8(u / scale, __NV_SATFINITE, __NV_E4M3);
  }
}
// bf16 copies of e4m3 bytes times scale (exact: a power-of-two scale times an e4m3 value is a bf16 number).
__global__ void widen_e4m3(bf16* out, const fp8e4m3* in, size_t n, float scale) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    out[i] = __float2bfloat16(float(in[i]) * scale);
}

// A Qwen3 with random weights and a random cache, bf16 or (fp8 = true) fp8 with the scales the engine would
// choose for these weights plus a bf16 copy of it for Part I, and section 26's plans, without a checkpoint.
struct TestModel {
  Qwen3 m;
  PersistentDecode pd;
  int NB = 0, Bmax = 8;
  cudaStream_t s;
  bool fp8 = false;
  std::vector<KVScales> scales;  // fp8: per layer
  char* bf16_copy = nullptr;     // fp8: the cache as bf16 values, [L, 2, NB, NKV, P, D]
  // The engine's cache format for this model, as install_optimizations applies it after the switches (section
  // 32's apply_fp8_cache: its stages and persistent kernel for fp8), with this model's scales (use_fp8_cache
  // would compute them; the format is global: set before every use).
  void use_format() const {
    apply_fp8_cache(fp8, g_hooks);
    if (fp8) g_fp8_cache.scales = scales;
    else g_persistent.format = &kPersistBf16;
  }
  TestModel(const std::string& shape, int P, int max_model_len, int NB_, bool fp8_ = false) : NB(NB_), fp8(fp8_) {
    const ModelConfig c = test_shape(shape);
    m.cfg = c, m.P = P, m.MB = (int)cdiv(max_model_len, P), m.max_model_len = max_model_len;
    CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const int64_t H = c.hidden_size, I = c.intermediate_size, D = c.head_dim, V = c.vocab_size;
    const int64_t NH = c.num_attention_heads, NKV = c.num_key_value_heads;
    const int64_t total = weight_elements(c, tp_shard(c, 0, 1));
    Weights& w = m.w;
    w.bytes = total * sizeof(bf16);
    CUDA_CHECK(cudaMalloc(&w.arena, w.bytes));
    fill((bf16*)w.arena, total, 1, 0.f, 0.035f);  // ~0.02 standard deviation, like a trained matrix
    bf16* p = (bf16*)w.arena;
    uint64_t seed = 2;
    auto take = [&](int64_t n) { bf16* r = p; p += n; return r; };
    auto norm = [&](int64_t n) { bf16* r = take(n); fill(r, n, seed++, 1.f, 0.2f); return r; };
    w.embed_tokens = take(V * H);
    w.lm_head = c.tie_word_embeddings ? w.embed_tokens : take(V * H);
    w.norm = norm(H);
    for (int l = 0; l < c.num_hidden_layers; l++) {
      LayerWeights lw;
      lw.input_layernorm = norm(H);
      lw.post_attention_layernorm = norm(H);
      lw.qkv_proj = take((NH + 2 * NKV) * D * H);
      lw.q_norm = norm(D);
      lw.k_norm = norm(D);
      lw.o_proj = take(H * NH * D);
      lw.gate_up_proj = take(2 * I * H);
      lw.down_proj = take(H * I);
      w.layers.push_back(lw);
    }
    if (p != (bf16*)w.arena + total) die("gpu_persistent: weight layout mismatch");
    KVCache& kv = m.kv;
    kv.num_blocks = NB, kv.kv_stride = (int64_t)NB * NKV * P * D, kv.layer_stride = 2 * kv.kv_stride;
    kv.value_bytes = fp8 ? 1 : 2;
    kv.bytes = (size_t)c.num_hidden_layers * kv.layer_stride * kv.value_bytes;
    CUDA_CHECK(cudaMalloc(&kv.base, kv.bytes));
    if (!fp8) {
      fill((bf16*)kv.base, kv.bytes / 2, 99, 0.f, 1.f);
    } else {
      CUDA_CHECK(cudaDeviceSynchronize());
      scales = kv_scales_from_weights(w, c, 1);
      CUDA_CHECK(cudaMalloc(&bf16_copy, kv.bytes * 2));
      for (int l = 0; l < c.num_hidden_layers; l++)
        for (int which = 0; which < 2; which++) {
          const float scale = which ? scales[l].v : scales[l].k;
          const int64_t at = l * kv.layer_stride + which * kv.kv_stride;
          fp8e4m3* bytes = reinterpret_cast<fp8e4m3*>(kv.base) + at;
          fill_e4m3<<<1024, 256>>>(bytes, kv.kv_stride, 99 + 2 * l + which, scale);
          widen_e4m3<<<1024, 256>>>(reinterpret_cast<bf16*>(bf16_copy) + at, bytes, kv.kv_stride, scale);
        }
      CUDA_CHECK(cudaGetLastError());
    }
    Activations& a = m.act;
    auto alloc = [&](auto** q, size_t n) { CUDA_CHECK(cudaMalloc((void**)q, n * sizeof(**q))); };
    alloc(&a.residual, Bmax * H), alloc(&a.hidden, Bmax * H), alloc(&a.x, Bmax * H);
    alloc(&a.qkv, Bmax * (NH + 2 * NKV) * D), alloc(&a.attn, Bmax * NH * D), alloc(&a.gate_up, Bmax * 2 * I);
    alloc(&a.act, Bmax * I), alloc(&a.last, Bmax * H), alloc(&a.logits, Bmax * V);
    // section 15's split-K decode scratch, which ModelRunner allocates when flash_attn asks (Hooks)
    CUDA_CHECK(cudaMalloc(&a.attn_workspace, flash_decode_workspace_bytes(Bmax, NH, max_model_len)));
    m.gemm = new Gemm;
    m.gemm->init();
    CUDA_CHECK(cudaDeviceSynchronize());
    use_format();
    pd = persist_setup(m, Bmax);
  }
  ~TestModel() {  // the large buffers (a test may build several models of the 8B shape)
    CUDA_CHECK(cudaDeviceSynchronize());
    cudaFree(m.w.arena), cudaFree(m.kv.base), cudaFree(bf16_copy);
  }
};

// One decode step's inputs: B sequences with the given contexts, blocks drawn without repeats in a shuffled
// order; the step's token sits at position ctx - 1 in slot bt[(ctx-1)/P] * P + (ctx-1) % P.
struct DecodeStep {
  int B;
  std::vector<int> ids, pos, slots, ctx, bt;
  DevBuf<int> d_ids, d_pos, d_slots, d_ctx, d_bt;
  DecodeStep(TestModel& t, const std::vector<int>& contexts, uint64_t seed)
      : B((int)contexts.size()), ids(B), pos(B), slots(B), ctx(contexts), bt((size_t)B * t.m.MB, 0),
        d_ids(B), d_pos(B), d_slots(B), d_ctx(B), d_bt((size_t)B * t.m.MB) {
    std::mt19937 rng(seed);
    std::vector<int> blocks(t.NB);
    std::iota(blocks.begin(), blocks.end(), 0);
    std::shuffle(blocks.begin(), blocks.end(), rng);
    size_t next = 0;
    for (int b = 0; b < B; b++) {
      ids[b] = (int)(rng() % t.m.cfg.vocab_size);
      pos[b] = ctx[b] - 1;
      for (int j = 0; j < (int)cdiv(ctx[b], t.m.P); j++) bt[(size_t)b * t.m.MB + j] = blocks.at(next++);
      slots[b] = bt[(size_t)b * t.m.MB + pos[b] / t.m.P] * t.m.P + pos[b] % t.m.P;
    }
    d_ids.upload(ids), d_pos.upload(pos), d_slots.upload(slots), d_ctx.upload(ctx), d_bt.upload(bt);
  }
  StepInputs inputs() { return StepInputs{d_ids.p, d_pos.p, d_slots.p, nullptr, d_ctx.p, d_bt.p, 1}; }
};

enum class Path { PLAIN, FAST, PERSIST };
struct StepResult {
  std::vector<float> logits;  // [B, V]
  std::vector<uint8_t> kv;    // the step's stored keys and values, [L, 2, B, NKV, D] values (bf16 or e4m3 bytes)
  std::vector<float> kv_values;  // the same, as the numbers they stand for (e4m3: times the layer's scale)
};

// Value offset of the cache row (layer l, keys/values, slot, kv head g).
static int64_t slot_offset(const TestModel& t, int l, int which, int slot, int g) {
  const int P = t.m.P, NKV = t.m.cfg.num_key_value_heads;
  return l * t.m.kv.layer_stride + which * t.m.kv.kv_stride + (((int64_t)(slot / P) * NKV + g) * P + slot % P) * HEAD_DIM;
}
static void for_each_stored_row(const TestModel& t, const DecodeStep& st,
                                const std::function<void(int64_t offset, size_t index)>& f) {
  const ModelConfig& c = t.m.cfg;
  size_t i = 0;
  for (int l = 0; l < c.num_hidden_layers; l++)
    for (int which = 0; which < 2; which++)
      for (int b = 0; b < st.B; b++)
        for (int g = 0; g < c.num_key_value_heads; g++) f(slot_offset(t, l, which, st.slots[b], g), i++);
}

// One decode step of st run by `run` (given its inputs), with what it must write poisoned first, and what it wrote.
static StepResult run_step_with(TestModel& t, DecodeStep& st, const std::function<void(const StepInputs&)>& run) {
  const ModelConfig& c = t.m.cfg;
  char* kv = t.m.kv.base;
  const int vb = t.m.kv.value_bytes;
  // Poison what the step must write: the logits and the step's own cache rows (0xFF: NaN in both formats).
  CUDA_CHECK(cudaMemset(t.m.act.logits, 0xFF, (size_t)st.B * c.vocab_size * sizeof(float)));
  for_each_stored_row(t, st,
                      [&](int64_t off, size_t) { CUDA_CHECK(cudaMemset(kv + off * vb, 0xFF, HEAD_DIM * vb)); });
  CUDA_CHECK(cudaDeviceSynchronize());
  run(st.inputs());
  CUDA_CHECK(cudaStreamSynchronize(t.s));
  StepResult r;
  r.logits.resize((size_t)st.B * c.vocab_size);
  CUDA_CHECK(cudaMemcpy(r.logits.data(), t.m.act.logits, r.logits.size() * 4, cudaMemcpyDeviceToHost));
  const size_t rows = (size_t)c.num_hidden_layers * 2 * st.B * c.num_key_value_heads;
  r.kv.resize(rows * HEAD_DIM * vb);
  r.kv_values.resize(rows * HEAD_DIM);
  const size_t per_layer = 2 * (size_t)st.B * c.num_key_value_heads;  // rows of one layer (for_each_stored_row)
  for_each_stored_row(t, st, [&](int64_t off, size_t i) {
    CUDA_CHECK(cudaMemcpy(&r.kv[i * HEAD_DIM * vb], kv + off * vb, HEAD_DIM * vb, cudaMemcpyDeviceToHost));
    const int l = (int)(i / per_layer), which = (int)(i % per_layer / (per_layer / 2));
    for (int d = 0; d < HEAD_DIM; d++) {
      const size_t e = i * HEAD_DIM + d;
      if (vb == 2) {
        uint16_t bits;
        memcpy(&bits, &r.kv[e * 2], 2);
        r.kv_values[e] = bf16_bits_to_float(bits);
      } else {
        r.kv_values[e] = e4m3_to_float(r.kv[e]) * (which ? t.scales[l].v : t.scales[l].k);
      }
    }
  });
  return r;
}
static StepResult run_step(TestModel& t, DecodeStep& st, Path path, int skew_ns = 0, int skip_wait = -1) {
  // Part I reads an fp8 model's bf16 copy of the cache: the engine's format is bf16 for this run.
  const bool on_copy = path == Path::PLAIN && t.fp8;
  char* const fp8_base = t.m.kv.base;
  if (on_copy) t.m.kv.base = t.bf16_copy, t.m.kv.value_bytes = 2;
  else t.use_format();
  StepResult r = run_step_with(t, st, [&](const StepInputs& in) {
    if (path == Path::PLAIN) {
      ScopedOptimizations plain("none");
      t.m.forward(in, st.B, st.B, false, t.s);
      CUDA_CHECK(cudaStreamSynchronize(t.s));
    } else if (path == Path::FAST) {
      ScopedOptimizations fast("all,-persistent");
      t.use_format();  // (installing the switches resets section 14's stages to bf16's)
      CHECK_MSG(g_opt.flash_attn && g_opt.gemv, "section 14 with flash_attn and gemv expected");
      forward_fast(t.m, in, st.B, st.B, false, t.s);
      CUDA_CHECK(cudaStreamSynchronize(t.s));
    } else {
      const PersistPlan* plan = t.pd.plans.count(st.B) ? &t.pd.plans.at(st.B) : nullptr;
      if (!plan) die("gpu_persistent: no plan for batch %d (%s)", st.B, t.pd.off_reason.c_str());
      persistent_decode(t.m, *plan, in, t.s, skew_ns, skip_wait, nullptr);
    }
  });
  if (on_copy) t.m.kv.base = fp8_base, t.m.kv.value_bytes = 1, t.use_format();
  return r;
}

static double rel_l2(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); i++) {
    const double d = (double)a[i] - ref[i];
    num += d * d, den += (double)ref[i] * ref[i];
  }
  return sqrt(num / std::max(den, 1e-30));
}
static bool all_finite(const std::vector<float>& v) {
  for (float x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

// Rows whose reference top-2 margin is clear of `noise` must pick the same token. Returns how many were.
static int argmax_agrees(const std::vector<float>& got, const std::vector<float>& ref, int B, int V, double noise,
                         int* checked) {
  int same = 0;
  *checked = 0;
  for (int b = 0; b < B; b++) {
    const float* r = &ref[(size_t)b * V];
    const float* g = &got[(size_t)b * V];
    int i1 = (int)(std::max_element(r, r + V) - r), i2 = -1;
    for (int i = 0; i < V; i++)
      if (i != i1 && (i2 < 0 || r[i] > r[i2])) i2 = i;
    if (r[i1] - r[i2] <= noise) continue;
    (*checked)++;
    same += (int)(std::max_element(g, g + V) - g) == i1;
  }
  return same;
}

static bool fp8_cache_supported() {  // section 31's conversion instructions: compute capability 8.9
  int major = 0, minor = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0));
  return major * 10 + minor >= 89;
}

static std::vector<std::vector<int>> contexts_for(int B, int max_len) {
  std::vector<std::vector<int>> all = {{700}, {1, 2049}, {33, 256, 257, 1500},
                                       {5, 17, 100, 256, 511, 512, 1023, 3000}};
  for (auto& v : all)
    for (int& x : v) x = std::min(x, max_len);
  return {all[B == 1 ? 0 : B == 2 ? 1 : B == 4 ? 2 : 3]};
}

static void accuracy_case(const std::string& shape, int P, bool fp8 = false) {
  const int max_len = 3072;
  TestModel t(shape, P, max_len, 8 * (int)cdiv(max_len, P) + 3, fp8);
  const char* cache = fp8 ? "fp8 cache" : "bf16 cache";
  printf("    %s, %s, P = %d: plans for %zu batch sizes, grid %d, partitions at B=1: %d\n", shape.c_str(), cache, P,
         t.pd.plans.size(), t.pd.plans.empty() ? 0 : t.pd.plans.begin()->second.grid,
         t.pd.plans.count(1) ? t.pd.plans.at(1).parts : 0);
  CHECK_MSG(t.pd.plans.count(1), "no plan for batch 1 (%s)", t.pd.off_reason.c_str());
  const int V = t.m.cfg.vocab_size;
  // The yardstick: how far other legitimate summation orders land from Part I on this model. Section 14
  // runs batch 1 and 2 through section 18's gemv, whose order differs from cuBLASLt's (larger batches go
  // through cuBLASLt like Part I), and attention at every batch through section 15's flash kernels, whose
  // order differs from section 8's; its largest distance at batch 1 and 2 is the shape's noise level. With an
  // fp8 cache section 14's distance at every batch size counts (its fp8 roundings of the step's keys and
  // values, which Part I does not make, are there at every batch size).
  struct Row { int B; double e_fast, e_pers, e_pf, kv_fast, kv_pers, bytes_same; int same, checked; };
  std::vector<Row> rows;
  double noise = 0, noise_kv = 0;
  for (int B : {1, 2, 4, 8}) {
    if (!t.pd.plans.count(B)) {
      printf("    %s B=%d: no plan (shared memory does not fit): section 14's path\n", shape.c_str(), B);
      continue;
    }
    DecodeStep st(t, contexts_for(B, max_len)[0], 1000 + B);
    const StepResult plain = run_step(t, st, Path::PLAIN), fast = run_step(t, st, Path::FAST);
    const StepResult pers = run_step(t, st, Path::PERSIST);
    CHECK_MSG(all_finite(pers.logits), "%s B=%d: non-finite logits", shape.c_str(), B);
    CHECK_MSG(all_finite(pers.kv_values), "%s B=%d: a stored key or value is missing (NaN)", shape.c_str(), B);
    Row r{B, rel_l2(fast.logits, plain.logits), rel_l2(pers.logits, plain.logits), rel_l2(pers.logits, fast.logits),
          rel_l2(fast.kv_values, plain.kv_values), rel_l2(pers.kv_values, plain.kv_values), 0, 0, 0};
    size_t same_bytes = 0;  // the stored bytes the persistent kernel and section 14 agree on
    for (size_t i = 0; i < pers.kv.size(); i++) same_bytes += pers.kv[i] == fast.kv[i];
    r.bytes_same = (double)same_bytes / pers.kv.size();
    double worst = 0;  // the largest logit difference from Part I: what an argmax may be off by
    for (size_t i = 0; i < pers.logits.size(); i++)
      worst = std::max(worst, (double)fabsf(pers.logits[i] - plain.logits[i]));
    r.same = argmax_agrees(pers.logits, plain.logits, B, V, 2 * worst, &r.checked);
    if (B <= GEMV_MAX_M || fp8) noise = std::max(noise, r.e_fast), noise_kv = std::max(noise_kv, r.kv_fast);
    rows.push_back(r);
  }
  for (const Row& r : rows) {
    printf("    %s %s B=%d: logits vs Part I: section 14 %.2e, persistent %.2e (vs section 14 %.2e); stored K/V vs "
           "Part I: section 14 %.2e, persistent %.2e, bytes equal to section 14's %.2f%%; argmax %d/%d clear "
           "rows\n", shape.c_str(), cache, r.B, r.e_fast, r.e_pers, r.e_pf, r.kv_fast, r.kv_pers,
           100 * r.bytes_same, r.same, r.checked);
    CHECK_MSG(r.e_pers <= 1.5 * noise + 2e-3, "%s B=%d: logits %.3e from Part I, noise level %.3e", shape.c_str(),
              r.B, r.e_pers, noise);
    CHECK_MSG(r.kv_pers <= 1.5 * noise_kv + 2e-3, "%s B=%d: stored K/V %.3e from Part I, noise level %.3e",
              shape.c_str(), r.B, r.kv_pers, noise_kv);
    CHECK_MSG(r.same == r.checked, "%s B=%d: argmax differs in %d of %d clear rows", shape.c_str(), r.B,
              r.checked - r.same, r.checked);
    // fp8: both store the same numbers rounded the same way; a one-ulp difference in a bf16 key or value before
    // the rounding moves a byte now and then, a wrong scale or format moves nearly all of them.
    CHECK_MSG(!fp8 || r.bytes_same >= 0.25, "%s B=%d: only %.1f%% of the stored bytes match section 14's", shape.c_str(),
              r.B, 100 * r.bytes_same);
  }
}

TEST(persistent_matches_stages_and_part1_odd_shape) {
  REQUIRE_GPU();
  accuracy_case("odd", 16);
}
TEST(persistent_matches_stages_and_part1_wide_groups) {
  REQUIRE_GPU();
  accuracy_case("odd-gqa6", 16);
  accuracy_case("odd-gqa8", 16);
}
TEST(persistent_matches_stages_and_part1_06b) {
  REQUIRE_GPU();
  accuracy_case("0.6b", 256);
}
TEST(persistent_matches_stages_and_part1_8b_short) {
  REQUIRE_GPU();
  accuracy_case("8b-short", 64);
}
#define REQUIRE_FP8()                                                                      \
  do {                                                                                     \
    REQUIRE_GPU();                                                                         \
    if (!fp8_cache_supported()) SKIP("an fp8 cache needs compute capability 8.9 or newer"); \
  } while (0)
TEST(persistent_matches_stages_and_part1_fp8_odd_shape) {
  REQUIRE_FP8();
  accuracy_case("odd", 16, true);
}
TEST(persistent_matches_stages_and_part1_fp8_06b) {
  REQUIRE_FP8();
  accuracy_case("0.6b", 256, true);
}
TEST(persistent_matches_stages_and_part1_fp8_8b_short) {
  REQUIRE_FP8();
  accuracy_case("8b-short", 64, true);
}

// ---- Section 30a: the kernel reading FP8 weights -----------------------------------------------------------
// The model's four matrices of each layer quantized by section 28's quantize_weight (as --quantization fp8
// does at load), and the bf16 weights replaced by their dequantization bf16(e4m3 * scale), the weights an FP8
// checkpoint has under Part I. Then, as accuracy_case does: the kernel's logits and stored keys and values
// against Part I's on the dequantized weights, within 1.5x (plus 2e-3) of how far section 14's path with the
// FP8 chapter's stages lands from them (its W8A8 products: the gemv at 1-2 sequences, cuBLASLt's at 4), the
// same token wherever Part I's margin is clear; and the same bits with thread blocks held back (skew), which
// the left-out wait changes.
__global__ void dequantize_test_weight(bf16* w, const uint8_t* q, const float* scale, int N, int K, int ld) {
  const size_t n = (size_t)N * K;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const size_t r = i / K, c = i % K;
    w[i] = __float2bfloat16(float(reinterpret_cast<const fp8e4m3*>(q)[i]) * scale[r / 128 * ld + c / 128]);
  }
}
static void fp8_weights_case(const std::string& shape, int P) {
  const std::string problem = fp8_weights_problem(test_shape(shape), 1);  // (a Hopper GPU, cuBLASLt 12.9)
  if (!problem.empty()) SKIP("%s", problem.c_str());
  const int max_len = 3072;
  TestModel t(shape, P, max_len, 8 * (int)cdiv(max_len, P) + 3);
  const ModelConfig& c = t.m.cfg;
  const int H = c.hidden_size, I = c.intermediate_size, D = c.head_dim;
  const int NH = c.num_attention_heads, NKV = c.num_key_value_heads;
  Fp8Weights held;  // what fp8_load_weights would leave in g_fp8_weights
  for (int l = 0; l < c.num_hidden_layers; l++) {
    LayerWeights& lw = t.m.w.layers[l];
    Fp8Layer fl;
    Fp8Matrix* ms[4] = {&fl.qkv, &fl.o, &fl.gate_up, &fl.down};
    bf16* ws[4] = {lw.qkv_proj, lw.o_proj, lw.gate_up_proj, lw.down_proj};
    const int dims[4][2] = {{(NH + 2 * NKV) * D, H}, {H, NH * D}, {2 * I, H}, {H, I}};
    for (int i = 0; i < 4; i++) {
      Fp8Matrix& m = *ms[i];
      m.N = dims[i][0], m.K = dims[i][1], m.ld = (int)cdiv(m.K / 128, 4) * 4;
      CUDA_CHECK(cudaMalloc(&m.w, (size_t)m.N * m.K));
      CUDA_CHECK(cudaMalloc(&m.scale, (size_t)m.N / 128 * m.ld * sizeof(float)));
      quantize_weight(m, ws[i], t.s);
      dequantize_test_weight<<<1024, 256, 0, t.s>>>(ws[i], m.w, m.scale, m.N, m.K, m.ld);
      CUDA_CHECK(cudaGetLastError());
    }
    held.layers.push_back(fl);
  }
  held.held = true, held.rows = (int)cdiv(t.Bmax, 4) * 4, held.kmax = std::max({H, NH * D, I});
  CUDA_CHECK(cudaMalloc(&held.xq, (size_t)held.rows * held.kmax));
  CUDA_CHECK(cudaMalloc(&held.xs, (size_t)held.rows * (held.kmax / 128) * sizeof(float)));
  CUDA_CHECK(cudaStreamSynchronize(t.s));
  g_fp8_weights = held;
  const PersistentDecode pd = persist_setup(t.m, t.Bmax, persist_fp8_layer);
  CHECK_MSG(pd.plans.count(1), "no FP8-weight plan for batch 1 (%s)", pd.off_reason.c_str());
  const int V = c.vocab_size;
  double noise = 0, noise_kv = 0;
  struct Row { int B; double e_fast, e_pers, kv_fast, kv_pers; int same, checked; bool same_bits, wait_caught; };
  std::vector<Row> rows;
  for (int B : {1, 2, 4}) {
    if (!pd.plans.count(B)) {
      printf("    %s, FP8 weights, B=%d: no plan (shared memory does not fit)\n", shape.c_str(), B);
      continue;
    }
    DecodeStep st(t, contexts_for(B, max_len)[0], 2000 + B);
    const StepResult plain = run_step(t, st, Path::PLAIN);
    StepResult fast;
    {
      ScopedOptimizations fp8("all,-persistent");  // (installing fp8_weights empties g_fp8_weights)
      Fp8Weights& f = g_fp8_weights;
      f.held = true, f.layers = held.layers, f.rows = held.rows, f.kmax = held.kmax, f.xq = held.xq, f.xs = held.xs;
      t.use_format();
      fast = run_step_with(t, st, [&](const StepInputs& in) { forward_fast(t.m, in, st.B, st.B, false, t.s); });
    }
    g_fp8_weights = held;
    auto persistent = [&](int skew, int skip) {
      return run_step_with(t, st, [&](const StepInputs& in) {
        persistent_decode(t.m, pd.plans.at(B), in, t.s, skew, skip, nullptr);
      });
    };
    const StepResult pers = persistent(0, -1), skewed = persistent(4000, -1);
    const StepResult unwaited = persistent(4000, 10);  // operation 10: layer 1's down (reads gate_up's act)
    CHECK_MSG(all_finite(pers.logits) && all_finite(pers.kv_values), "%s B=%d: non-finite results", shape.c_str(),
              B);
    Row r{B, rel_l2(fast.logits, plain.logits), rel_l2(pers.logits, plain.logits),
          rel_l2(fast.kv_values, plain.kv_values), rel_l2(pers.kv_values, plain.kv_values), 0, 0,
          skewed.logits == pers.logits && skewed.kv == pers.kv,
          unwaited.logits != pers.logits || unwaited.kv != pers.kv};
    double worst = 0;
    for (size_t i = 0; i < pers.logits.size(); i++)
      worst = std::max(worst, (double)fabsf(pers.logits[i] - plain.logits[i]));
    r.same = argmax_agrees(pers.logits, plain.logits, B, V, 2 * worst, &r.checked);
    noise = std::max(noise, r.e_fast), noise_kv = std::max(noise_kv, r.kv_fast);
    rows.push_back(r);
  }
  g_fp8_weights = Fp8Weights{};
  for (const Row& r : rows) {
    printf("    %s, FP8 weights, B=%d: logits vs Part I (dequantized): section 14 %.2e, persistent %.2e; stored K/V "
           "%.2e, %.2e; argmax %d/%d clear rows; skewed: %s; a left-out wait %s\n", shape.c_str(), r.B, r.e_fast,
           r.e_pers, r.kv_fast, r.kv_pers, r.same, r.checked, r.same_bits ? "same bits" : "DIFFERENT",
           r.wait_caught ? "caught" : "NOT caught");
    CHECK_MSG(r.e_pers <= 1.5 * noise + 2e-3, "%s B=%d: logits %.3e from Part I, noise %.3e", shape.c_str(), r.B,
              r.e_pers, noise);
    CHECK_MSG(r.kv_pers <= 1.5 * noise_kv + 2e-3, "%s B=%d: stored K/V %.3e from Part I, noise %.3e", shape.c_str(),
              r.B, r.kv_pers, noise_kv);
    CHECK_MSG(r.same == r.checked, "%s B=%d: argmax differs in %d of %d clear rows", shape.c_str(), r.B,
              r.checked - r.same, r.checked);
    CHECK_MSG(r.same_bits, "%s B=%d: thread blocks held back changed the results", shape.c_str(), r.B);
    CHECK_MSG(r.wait_caught, "%s B=%d: leaving a wait out changed nothing (the check cannot fail)", shape.c_str(),
              r.B);
  }
}
TEST(persistent_fp8_weights_match_stages_and_part1_06b) {
  REQUIRE_GPU();
  fp8_weights_case("0.6b", 256);
}
TEST(persistent_fp8_weights_match_stages_and_part1_8b_short) {
  REQUIRE_GPU();
  fp8_weights_case("8b-short", 64);
}

// ---- Each step of the kernel on its own (sections 24-27) ----------------------------------------------------
// The cases above check the whole kernel; these check each section a reader takes on its own: the operation
// chain with its counters and gemvs without attention (section 24), attention inside the kernel from the same
// inputs as section 8's (section 25), the plans (section 26), and the routing's cache (section 27).

// A plan whose operation list is the part of `full`'s that `keep` keeps, in order (with the whole plan's split,
// shared memory and partials, which a shorter list fits in): the kernel runs the list it is given, each
// operation waiting for the one before it.
struct SubPlan {
  PersistPlan p;
  SubPlan(const TestModel& t, const PersistPlan& full, const std::function<bool(const PersistOp&)>& keep)
      : p(full) {
    p.ops.clear();
    for (const PersistOp& op : full.ops)
      if (keep(op)) p.ops.push_back(op);
    CUDA_CHECK(cudaMalloc(&p.ops_d, p.ops.size() * sizeof(PersistOp)));
    CUDA_CHECK(cudaMemcpy(p.ops_d, p.ops.data(), p.ops.size() * sizeof(PersistOp), cudaMemcpyHostToDevice));
    const ModelConfig& c = t.m.cfg;
    p.sync_bytes = (p.ops.size() + (size_t)c.num_hidden_layers * full.B * c.num_key_value_heads) * sizeof(int);
    CUDA_CHECK(cudaMalloc(&p.sync_d, p.sync_bytes));
  }
  ~SubPlan() { cudaFree(p.ops_d), cudaFree(p.sync_d); }
  SubPlan(const SubPlan&) = delete;
};

static std::vector<float> download_bf16(const bf16* p, size_t n) {
  std::vector<uint16_t> bits(n);
  CUDA_CHECK(cudaMemcpy(bits.data(), p, n * 2, cudaMemcpyDeviceToHost));
  std::vector<float> v(n);
  for (size_t i = 0; i < n; i++) v[i] = bf16_bits_to_float(bits[i]);
  return v;
}
static std::vector<float> download_f32(const float* p, size_t n) {
  std::vector<float> v(n);
  CUDA_CHECK(cudaMemcpy(v.data(), p, n * 4, cudaMemcpyDeviceToHost));
  return v;
}
// Every activation the kernel reads or writes, NaN (0xFF bytes): a read before the write shows.
static void poison_activations(TestModel& t, int B) {
  const ModelConfig& c = t.m.cfg;
  const size_t H = c.hidden_size, I = c.intermediate_size, D = c.head_dim, V = c.vocab_size;
  const size_t NH = c.num_attention_heads, NKV = c.num_key_value_heads;
  Activations& a = t.m.act;
  CUDA_CHECK(cudaMemset(a.residual, 0xFF, B * H * 2));
  CUDA_CHECK(cudaMemset(a.qkv, 0xFF, B * (NH + 2 * NKV) * D * 2));
  CUDA_CHECK(cudaMemset(a.attn, 0xFF, B * NH * D * 2));
  CUDA_CHECK(cudaMemset(a.act, 0xFF, B * I * 2));
  CUDA_CHECK(cudaMemset(a.logits, 0xFF, B * V * 4));
  CUDA_CHECK(cudaDeviceSynchronize());
}

// Section 24 alone: the operation chain, its counters and its gemvs, without attention. The embedding, every
// layer's gate_up and down (their RMSNorm, SiLU * up and the residual add) and the LM head, against Part I's
// kernels doing the same (embedding, rmsnorm / add_rmsnorm, cuBLASLt, silu_and_mul): the logits and the
// residual stream within 1e-2 relative L2 (the two add each dot product in another order; a wrong row, norm,
// epilogue or hand-off is off by order 1). Every activation is NaN before each run. Then the same list with
// thread blocks held back: the same bits; and without layer 0's down's wait (it reads gate_up's output):
// caught.
static void chain_case(const std::string& shape, int P) {
  TestModel t(shape, P, 1024, 64);
  const ModelConfig& c = t.m.cfg;
  const int H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size, L = c.num_hidden_layers;
  const float eps = c.rms_norm_eps;
  Activations& a = t.m.act;
  for (int B : {1, 2, 4}) {
    if (!t.pd.plans.count(B)) {
      printf("    %s B=%d: no plan (%s)\n", shape.c_str(), B, t.pd.off_reason.c_str());
      continue;
    }
    SubPlan chain(t, t.pd.plans.at(B), [](const PersistOp& op) {
      return op.kind == PERSIST_EMBED || op.kind == PERSIST_GATE_UP || op.kind == PERSIST_DOWN ||
             op.kind == PERSIST_LM_HEAD;
    });
    CHECK_EQ(chain.p.ops.size(), (size_t)(2 + 2 * L));
    DecodeStep st(t, std::vector<int>(B, 1 + B), 40 + B);  // (no attention: the contexts are not read)
    const StepInputs in = st.inputs();
    poison_activations(t, B);
    embedding(a.residual, in.input_ids, t.m.w.embed_tokens, B, H, 0, V, t.s);
    for (int l = 0; l < L; l++) {
      const LayerWeights& lw = t.m.w.layers[l];
      if (l == 0) rmsnorm(a.x, a.residual, lw.post_attention_layernorm, B, H, eps, t.s);
      else add_rmsnorm(a.x, a.residual, a.hidden, lw.post_attention_layernorm, B, H, eps, t.s);
      linear(*t.m.gemm, a.gate_up, a.x, lw.gate_up_proj, B, 2 * I, H, t.s);
      silu_and_mul(a.act, a.gate_up, B, I, t.s);
      linear(*t.m.gemm, a.hidden, a.act, lw.down_proj, B, H, I, t.s);
    }
    add_rmsnorm(a.x, a.residual, a.hidden, t.m.w.norm, B, H, eps, t.s);
    linear(*t.m.gemm, a.logits, a.x, t.m.w.lm_head, B, V, H, t.s, CUDA_R_32F);
    CUDA_CHECK(cudaStreamSynchronize(t.s));
    const std::vector<float> want_logits = download_f32(a.logits, (size_t)B * V);
    const std::vector<float> want_res = download_bf16(a.residual, (size_t)B * H);
    auto run = [&](int skew, int skip, std::vector<float>& logits, std::vector<float>& res) {
      poison_activations(t, B);
      persistent_decode(t.m, chain.p, in, t.s, skew, skip, nullptr);
      CUDA_CHECK(cudaStreamSynchronize(t.s));
      logits = download_f32(a.logits, (size_t)B * V), res = download_bf16(a.residual, (size_t)B * H);
    };
    std::vector<float> logits, res;
    run(0, -1, logits, res);
    const double e_logits = rel_l2(logits, want_logits), e_res = rel_l2(res, want_res);
    printf("    %s B=%d, the chain without attention (%zu operations): logits %.2e, residual %.2e from Part I's "
           "kernels\n", shape.c_str(), B, chain.p.ops.size(), e_logits, e_res);
    CHECK_MSG(all_finite(logits) && all_finite(res), "%s B=%d: a NaN got through (a read before its write)",
              shape.c_str(), B);
    CHECK_MSG(e_logits <= 1e-2 && e_res <= 1e-2, "%s B=%d: logits %.3e, residual %.3e from Part I's kernels",
              shape.c_str(), B, e_logits, e_res);
    std::vector<float> skewed_logits, skewed_res;
    run(4000, -1, skewed_logits, skewed_res);
    CHECK_MSG(skewed_logits == logits && skewed_res == res, "%s B=%d: the chain's results changed under skew",
              shape.c_str(), B);
    run(4000, 2, skewed_logits, skewed_res);  // operation 2: layer 0's down
    const bool caught = skewed_logits != logits || skewed_res != res;
    printf("    %s B=%d, the chain without operation 2's wait: %s\n", shape.c_str(), B,
           caught ? "results differ (caught)" : "SAME");
    CHECK_MSG(caught, "%s B=%d: leaving out layer 0's down's wait went unnoticed", shape.c_str(), B);
  }
}
TEST(persistent_chain_without_attention_matches_part1_kernels) {
  REQUIRE_GPU();
  chain_case("odd", 16);
  chain_case("8b-short", 64);
}

// Section 25 alone: attention inside the kernel. The embedding and one layer's attention, with qkv written
// before the launch (random, the same bits for both), against section 7's qk_norm_rope and section 8's
// attention_decode on the same qkv: the step's stored key and value the same bits (the same code computes
// them, head_norm_rope), the attention output within 4e-3 relative L2 (its partitions and their merge add in
// another order than section 8's one warp per head; a wrong row, partition or merge is off by order 1).
// Every batch size with a plan, contexts that cross KV blocks and partitions, and 4, 6 and 8 query heads per
// KV head (persist_attn_split: 1, 2 or 4 heads a warp). The output and the step's cache rows are NaN before
// each run; the kernel takes the step's own key and value from qkv, so a NaN in their row would show too.
static void attention_case(const std::string& shape, int P) {
  const int max_len = 3072;
  TestModel t(shape, P, max_len, 8 * (int)cdiv(max_len, P) + 3);
  const ModelConfig& c = t.m.cfg;
  const int NH = c.num_attention_heads, NKV = c.num_key_value_heads, D = c.head_dim, L = c.num_hidden_layers;
  const int l = L - 1;  // the last layer: its cache offsets are the largest
  const LayerWeights& lw = t.m.w.layers[l];
  Activations& a = t.m.act;
  for (int B : {1, 2, 4}) {
    if (!t.pd.plans.count(B)) {
      printf("    %s B=%d: no plan (%s)\n", shape.c_str(), B, t.pd.off_reason.c_str());
      continue;
    }
    SubPlan one(t, t.pd.plans.at(B), [&](const PersistOp& op) {
      return op.kind == PERSIST_EMBED || (op.kind == PERSIST_ATTN && op.layer == l);
    });
    CHECK_EQ(one.p.ops.size(), (size_t)2);
    DecodeStep st(t, contexts_for(B, max_len)[0], 77 + B);
    const StepInputs in = st.inputs();
    const size_t qkv_n = (size_t)B * (NH + 2 * NKV) * D, attn_n = (size_t)B * NH * D;
    DevBuf<bf16> qkv0(qkv_n);
    fill(qkv0.p, qkv_n, 500 + B, 0.f, 1.f);
    auto rows = [&](auto f) {  // the step's cache rows of layer l: keys, then values
      for (int which = 0; which < 2; which++)
        for (int b = 0; b < B; b++)
          for (int g = 0; g < NKV; g++) f(slot_offset(t, l, which, st.slots[b], g));
    };
    auto run = [&](bool persistent, std::vector<float>& attn, std::vector<uint16_t>& stored) {
      poison_activations(t, B);
      rows([&](int64_t off) { CUDA_CHECK(cudaMemset((bf16*)t.m.kv.base + off, 0xFF, HEAD_DIM * 2)); });
      CUDA_CHECK(cudaMemcpy(a.qkv, qkv0.p, qkv_n * 2, cudaMemcpyDeviceToDevice));
      if (persistent) {
        persistent_decode(t.m, one.p, in, t.s, 0, -1, nullptr);
      } else {
        qk_norm_rope(a.qkv, in.positions, lw.q_norm, lw.k_norm, t.m.kv.layer(l), in.slot_mapping, B, NH, NKV, P,
                     c.rope_theta, c.rms_norm_eps, t.s);
        attention_decode(a.attn, a.qkv, t.m.kv.layer(l), in.seqlens_k, in.block_tables, B, NH, NKV, P, t.m.MB,
                         1.0f / sqrtf((float)D), t.s);
      }
      CUDA_CHECK(cudaStreamSynchronize(t.s));
      attn = download_bf16(a.attn, attn_n);
      stored.clear();
      rows([&](int64_t off) {
        std::vector<uint16_t> r(HEAD_DIM);
        CUDA_CHECK(cudaMemcpy(r.data(), (bf16*)t.m.kv.base + off, HEAD_DIM * 2, cudaMemcpyDeviceToHost));
        stored.insert(stored.end(), r.begin(), r.end());
      });
    };
    std::vector<float> want, got;
    std::vector<uint16_t> want_kv, got_kv;
    run(false, want, want_kv);
    run(true, got, got_kv);
    size_t kv_diff = 0;
    for (size_t i = 0; i < got_kv.size(); i++) kv_diff += got_kv[i] != want_kv[i];
    const double e = rel_l2(got, want);
    printf("    %s B=%d, attention alone (layer %d, contexts up to %d): output %.2e from section 8's, %zu of %zu "
           "stored values differ\n", shape.c_str(), B, l, *std::max_element(st.ctx.begin(), st.ctx.end()), e,
           kv_diff, got_kv.size());
    CHECK_MSG(all_finite(want) && all_finite(got), "%s B=%d: a NaN in the attention output", shape.c_str(), B);
    CHECK_MSG(kv_diff == 0, "%s B=%d: %zu stored key/value elements differ from section 7's", shape.c_str(), B,
              kv_diff);
    CHECK_MSG(e <= 4e-3, "%s B=%d: attention %.3e from section 8's", shape.c_str(), B, e);
  }
}
TEST(persistent_attention_matches_section8) {
  REQUIRE_GPU();
  attention_case("odd", 16);
  attention_case("odd-gqa6", 16);
  attention_case("odd-gqa8", 16);
  attention_case("0.6b", 256);
}

// Section 26 alone: the plans. For each batch size: the operation list is the step in order (the embedding;
// per layer qkv, attention, o, gate_up, down; the LM head) over this model's own weights and norms; a gemv's
// groups cover its outputs exactly (16 rows, gate_up 8 pairs) and it counts done once per thread block that
// has a group, which is what the next operation waits for; attention counts once per (sequence, KV head);
// the synchronisation buffer holds the counters, the tickets and the finished flag (read at TP > 1); one
// thread block per SM, the shared memory within the GPU's limit, 1 to 64 partitions. And under tensor
// parallelism no plans, with the reason.
static void plan_case(const std::string& shape, int P) {
  TestModel t(shape, P, 1024, 64);
  const ModelConfig& c = t.m.cfg;
  const int H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size, L = c.num_hidden_layers;
  const int NH = c.num_attention_heads, NKV = c.num_key_value_heads, D = c.head_dim;
  int sms = 0, smem_max = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CUDA_CHECK(cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  CHECK_MSG(t.pd.plans.count(1), "%s: no plan for batch 1 (%s)", shape.c_str(), t.pd.off_reason.c_str());
  for (const auto& entry : t.pd.plans) {
    const int B = entry.first;
    const PersistPlan& p = entry.second;
    CHECK_MSG(p.B == B && (B == 1 || B == 2 || B == 4), "%s: a plan for batch %d says %d", shape.c_str(), B, p.B);
    CHECK_MSG(p.grid == sms && p.smem <= (size_t)smem_max && p.parts >= 1 && p.parts <= 64,
              "%s B=%d: grid %d (SMs %d), shared memory %zu (limit %d), partitions %d", shape.c_str(), B, p.grid,
              sms, p.smem, smem_max, p.parts);
    CHECK_EQ(p.ops.size(), (size_t)(2 + 5 * L));
    CHECK_EQ(p.sync_bytes, (p.ops.size() + (size_t)L * B * NKV + 1) * sizeof(int));
    if (p.ops.size() != (size_t)(2 + 5 * L)) continue;
    struct Want { int kind, layer; const bf16 *W, *norm_w; int N, K; };
    std::vector<Want> want = {{PERSIST_EMBED, 0, nullptr, nullptr, 0, 0}};
    for (int l = 0; l < L; l++) {
      const LayerWeights& lw = t.m.w.layers[l];
      want.push_back({PERSIST_QKV, l, lw.qkv_proj, lw.input_layernorm, (NH + 2 * NKV) * D, H});
      want.push_back({PERSIST_ATTN, l, nullptr, lw.q_norm, 0, 0});
      want.push_back({PERSIST_O, l, lw.o_proj, nullptr, H, NH * D});
      want.push_back({PERSIST_GATE_UP, l, lw.gate_up_proj, lw.post_attention_layernorm, I, H});
      want.push_back({PERSIST_DOWN, l, lw.down_proj, nullptr, H, I});
    }
    want.push_back({PERSIST_LM_HEAD, L, t.m.w.lm_head, t.m.w.norm, V, H});
    for (size_t o = 0; o < want.size(); o++) {
      const PersistOp& op = p.ops[o];
      const Want& w = want[o];
      bool ok = op.kind == w.kind && op.layer == w.layer && op.W == w.W && op.norm_w == w.norm_w;
      if (op.kind == PERSIST_EMBED) ok &= op.tasks == 1;
      else if (op.kind == PERSIST_ATTN) ok &= op.k_norm == t.m.w.layers[w.layer].k_norm && op.tasks == B * NKV;
      else {
        const int rows = op.kind == PERSIST_GATE_UP ? PERSIST_ROWS / 2 : PERSIST_ROWS;
        ok &= op.N == w.N && op.K == w.K && op.groups * rows >= op.N && (op.groups - 1) * rows < op.N &&
              op.tasks == std::min(op.groups, p.grid);
      }
      CHECK_MSG(ok, "%s B=%d: operation %zu (kind %d, layer %d, N %d, K %d, groups %d, tasks %d) is not the "
                "step's (kind %d, layer %d, N %d, K %d)", shape.c_str(), B, o, op.kind, op.layer, op.N, op.K,
                op.groups, op.tasks, w.kind, w.layer, w.N, w.K);
    }
  }
  t.m.tp = 2;
  const PersistentDecode tp = persist_setup(t.m, t.Bmax);
  t.m.tp = 1;
  CHECK_MSG(tp.plans.empty() && tp.off_reason.find("tensor parallelism") != std::string::npos,
            "%s at tp 2: %zu plans, reason '%s'", shape.c_str(), tp.plans.size(), tp.off_reason.c_str());
}
TEST(persistent_plans_are_the_step) {
  REQUIRE_GPU();
  plan_case("odd", 16);
  plan_case("odd-gqa8", 16);
  plan_case("0.6b", 256);
}

// Section 27 alone: the routing is measured once and remembered, and a remembered file that is stale or
// corrupt is measured again and rewritten. In a fresh cache directory (NANOVLLM_CACHE_DIR): the first
// start-up measures and writes the file; the second reads it and routes the same; a file with one time
// changed (its checksum no longer matches), one written under another key (another build, GPU or model, at
// the same name), and one that is not JSON are each measured again, and the file is whole again afterwards.
// (test_optimizations checks the reader's refusals one by one, without a GPU.)
TEST(persistent_routing_is_remembered_and_measured_again_when_stale) {
  REQUIRE_GPU();
  const char* pinned = getenv("NANOVLLM_PERSISTENT");
  const std::string saved_pin = pinned ? pinned : "", saved_dir = getenv("NANOVLLM_CACHE_DIR") ?: "";
  const bool had_dir = getenv("NANOVLLM_CACHE_DIR") != nullptr;
  unsetenv("NANOVLLM_PERSISTENT");  // (it would skip the measurement)
  char tmpl[] = "/tmp/nanovllm_gpu_cache_XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  setenv("NANOVLLM_CACHE_DIR", dir.c_str(), 1);
  {
    TestModel t("odd", 16, 1024, 200);
    ScopedOptimizations opt("all");
    t.use_format();
    const int longest = t.m.max_model_len - 1;
    auto start_up = [&] {
      PersistentDecode pd = persist_setup(t.m, t.Bmax);
      persist_measure(t.m, pd, t.s);
      return pd;
    };
    auto same_times = [](const PersistentDecode& x, const PersistentDecode& y) {
      if (x.timed.size() != y.timed.size()) return false;
      for (const auto& [B, ts] : x.timed) {
        if (!y.timed.count(B) || y.timed.at(B).size() != ts.size()) return false;
        for (size_t i = 0; i < ts.size(); i++) {
          const PersistTimes &a = ts[i], &b = y.timed.at(B)[i];
          if (a.context != b.context || a.fused != b.fused || a.kernel != b.kernel) return false;
        }
      }
      return true;
    };
    const PersistentDecode first = start_up();
    const std::string key = persist_cache_key(t.m, first), path = persist_cache_path(dir, key);
    CHECK_MSG(first.cache_file.empty() && first.timed.size() == first.plans.size() && !first.timed.empty(),
              "the first start-up did not measure (%zu of %zu batch sizes; from '%s')", first.timed.size(),
              first.plans.size(), first.cache_file.c_str());
    auto file_is_whole = [&] {
      PersistentDecode q;
      for (const auto& [B, p] : first.plans) q.plans[B];
      return persist_cache_read(path, key, q, longest);
    };
    CHECK_MSG(file_is_whole(), "no whole cache file at %s after the measurement", path.c_str());
    const PersistentDecode second = start_up();
    CHECK_MSG(second.cache_file == path && same_times(first, second) && second.route == first.route &&
                  second.context_limit == first.context_limit,
              "the second start-up did not take the remembered times (from '%s')", second.cache_file.c_str());
    auto stale = [&](const char* what, const std::function<std::string(json)>& edit) {
      std::ifstream f(path);
      const std::string text = edit(json::parse(f));
      f.close();
      std::ofstream(path) << text;
      const PersistentDecode again = start_up();
      CHECK_MSG(again.cache_file.empty() && again.timed.size() == first.timed.size(),
                "%s: the start-up took the file (from '%s') instead of measuring again", what,
                again.cache_file.c_str());
      CHECK_MSG(file_is_whole(), "%s: the file was not rewritten whole", what);
    };
    stale("a time changed", [](json j) {
      json& row = j["times"].begin().value()[0];
      row[1] = row[1].get<double>() * 1.5;
      return j.dump();
    });
    stale("another key", [&](json j) {
      j["key"] = key + " build=another";
      j["checksum"] = std::to_string(persist_cache_checksum(j["key"].get<std::string>(), j["times"]));
      return j.dump();
    });
    stale("not JSON", [](json j) { return j.dump().substr(0, 10); });
    unlink(path.c_str());
  }
  rmdir(dir.c_str());
  if (had_dir) setenv("NANOVLLM_CACHE_DIR", saved_dir.c_str(), 1);
  else unsetenv("NANOVLLM_CACHE_DIR");
  if (pinned) setenv("NANOVLLM_PERSISTENT", saved_pin.c_str(), 1);
}

// Same bits whatever the timing; and a left-out wait is caught under the same skew.
static void timing_independence_case(bool fp8) {
  TestModel t("0.6b", 256, 4096, 40, fp8);
  const char* cache = fp8 ? "fp8 cache" : "bf16 cache";
  for (int B : {1, 4}) {
    DecodeStep st(t, B == 1 ? std::vector<int>{1200} : std::vector<int>{1, 300, 900, 2500}, 7 + B);
    const StepResult ref = run_step(t, st, Path::PERSIST);
    for (int skew : {1000, 4000}) {
      const StepResult r = run_step(t, st, Path::PERSIST, skew);
      CHECK_MSG(r.logits == ref.logits && r.kv == ref.kv, "%s B=%d skew %d ns: results changed", cache, B, skew);
    }
    // The control: operation 3 is layer 0's o_proj (reads attention's output), 10 layer 1's down (reads
    // gate_up's), 12 layer 2's attention (reads qkv); without their waits the same skew must show.
    for (int skip : {3, 10, 12}) {
      const StepResult r = run_step(t, st, Path::PERSIST, 4000, skip);
      const bool caught = r.logits != ref.logits || r.kv != ref.kv;
      printf("    %s B=%d without operation %d's wait: %s\n", cache, B, skip,
             caught ? "results differ (caught)" : "SAME");
      CHECK_MSG(caught, "%s B=%d: leaving out operation %d's wait went unnoticed", cache, B, skip);
    }
  }
}
TEST(persistent_results_do_not_depend_on_timing) {
  REQUIRE_GPU();
  timing_independence_case(false);
  if (fp8_cache_supported()) timing_independence_case(true);
}

// One decode step in a CUDA graph: section 14's kernels vs the persistent kernel (no sampler).
TIMING(timing_persistent_vs_stages) {
  REQUIRE_GPU();
  for (const char* shape : {"0.6b", "8b"})
  for (bool fp8 : {false, true}) {
    if (fp8 && !fp8_cache_supported()) continue;
    TestModel t(shape, 256, 4096, 64, fp8);
    const double weight_bytes = (double)t.m.w.bytes;
    for (int B : {1, 2, 4, 8}) {
      if (!t.pd.plans.count(B)) continue;
      DecodeStep st(t, std::vector<int>(B, 600), 5);
      const StepInputs in = st.inputs();
      double us[2];
      for (int k = 0; k < 2; k++) {
        ScopedOptimizations opt(k ? "all" : "all,-persistent");
        t.use_format();
        us[k] = persist_time_graph([&] {
          if (k) persistent_decode(t.m, t.pd.plans.at(B), in, t.s, 0, -1, nullptr);
          else forward_fast(t.m, in, B, B, false, t.s);
        }, t.s, 20, 200);
      }
      const double kv_bytes =
          2.0 * t.m.cfg.num_hidden_layers * B * 600 * t.m.cfg.num_key_value_heads * HEAD_DIM * t.m.kv.value_bytes;
      const double bytes = weight_bytes + kv_bytes;
      printf("    TIMING %s %s cache B=%d ctx 600: section 14 %.1f us (%.0f GB/s), persistent %.1f us (%.0f GB/s), "
             "%.2fx\n", shape, fp8 ? "fp8" : "bf16", B, us[0], bytes / us[0] / 1e3, us[1], bytes / us[1] / 1e3,
             us[0] / us[1]);
    }
  }
}

// Routing by context (persist_measure): on this GPU, the limit it measures for batch 1 of the 0.6B shape is
// right on both sides. Each path timed again in a graph at half the limit (the kernel must be faster) and at
// twice it (section 14's path must be); with no limit, the kernel must be faster at the longest context
// measured, and where it takes no step, section 14's path at the shortest.
TEST(routing_by_context_picks_the_faster_path) {
  REQUIRE_GPU();
  const int max_len = 16384;
  TestModel t("0.6b", 256, max_len, 4 * max_len / 256);
  ScopedOptimizations opt("all");
  t.use_format();
  persist_measure(t.m, t.pd, t.s);
  const int limit = t.pd.limit_for(1);
  printf("    TIMING routing: %s\n", persist_describe(t.pd).c_str());
  auto time_at = [&](int ctx, int k) {  // k = 0: section 14's path, 1: the kernel
    DecodeStep st(t, std::vector<int>(1, ctx), 7);
    const StepInputs in = st.inputs();
    ScopedOptimizations o(k ? "all" : "all,-persistent");
    t.use_format();
    return persist_time_graph([&] {
      if (k) persistent_decode(t.m, t.pd.plans.at(1), in, t.s, 0, -1, nullptr);
      else forward_fast(t.m, in, 1, 1, false, t.s);
    }, t.s, 10, 50);
  };
  auto check = [&](int ctx, bool kernel_faster) {
    const double fused = time_at(ctx, 0), kernel = time_at(ctx, 1);
    printf("    TIMING routing: B=1 ctx %d: section 14 %.1f us, persistent %.1f us\n", ctx, fused, kernel);
    CHECK_MSG(kernel_faster ? kernel < fused : fused < kernel, "B=1 at %d keys: the %s path should be faster "
              "(limit %d)", ctx, kernel_faster ? "persistent" : "section 14", limit);
  };
  if (limit == 0) check(PERSIST_MEASURE_SHORT, false);
  else if (limit == INT_MAX) check(PERSIST_MEASURE_LONG, true);
  else {
    CHECK_MSG(limit > PERSIST_MEASURE_SHORT && limit < max_len - 1, "limit %d", limit);
    check(limit / 2, true);
    if (2 * limit < max_len) check(2 * limit, false);
  }
}

// Where a step's time goes: every thread block's clock at the start of each operation, past its wait, after
// its input, and at its end (persist_trace). Per kind of operation, averaged over the layers: from the
// previous operation's completion (its last block's end) to this one's first block past its wait, to its
// last block past it, to its completion; then per block, from past its wait to its end, beside the time
// its share of the weights takes at its share (1 / grid) of the copy bandwidth, and how many of its chunks
// were in its ring (in flight or landed) at that moment.
TIMING(timing_persistent_breakdown) {
  REQUIRE_GPU();
  TestModel t("0.6b", 256, 4096, 64);
  double copy_gbps = 0;  // device-to-device copy of 512 MiB: bytes read and written per ns, the best of 5
  {
    DevBuf<char> src(512u << 20), dst(512u << 20);
    for (int i = 0; i < 5; i++) {
      const double t0 = now_seconds();
      CUDA_CHECK(cudaMemcpy(dst.p, src.p, src.n, cudaMemcpyDeviceToDevice));
      CUDA_CHECK(cudaDeviceSynchronize());
      copy_gbps = std::max(copy_gbps, 2.0 * src.n / ((now_seconds() - t0) * 1e9));
    }
  }
  for (int B : {1, 4}) {
    if (!t.pd.plans.count(B)) continue;
    DecodeStep st(t, std::vector<int>(B, 600), 5);
    const PersistPlan& plan = t.pd.plans.at(B);
    const int n = (int)plan.ops.size();
    DevBuf<uint64_t> trace((size_t)plan.grid * n * PERSIST_TRACE);
    for (int rep = 0; rep < 3; rep++) {  // the last of three
      CUDA_CHECK(cudaMemset(trace.p, 0, trace.n * 8));
      persistent_decode(t.m, plan, st.inputs(), t.s, 0, -1, trace.p);
      CUDA_CHECK(cudaStreamSynchronize(t.s));
    }
    const std::vector<uint64_t> tr = trace.download();
    auto at = [&](int b, int o, int k) { return tr[((size_t)b * n + o) * PERSIST_TRACE + k]; };
    std::vector<double> end(n, 0), first(n, 1e300), last(n, 0);
    double start = 1e300;
    for (int b = 0; b < plan.grid; b++) start = std::min(start, (double)at(b, 0, 0));
    for (int o = 0; o < n; o++)
      for (int b = 0; b < plan.grid; b++) {
        if (!at(b, o, 2)) continue;
        end[o] = std::max(end[o], (double)at(b, o, 2) - start);
        if (!at(b, o, 4)) continue;
        const double past = (double)at(b, o, 4) - start;  // past its wait
        first[o] = std::min(first[o], past), last[o] = std::max(last[o], past);
      }
    const double step_ns = end[n - 1], gbps = (double)t.m.w.bytes / step_ns;  // bytes per ns
    const char* names[] = {"embed", "qkv", "attention", "o_proj", "gate_up", "down", "lm_head"};
    double sum[7][11] = {}, cnt[7] = {};
    for (int o = 1; o < n; o++) {
      const PersistOp& op = plan.ops[o];
      const int k = op.kind;
      sum[k][0] += first[o] - end[o - 1], sum[k][1] += last[o] - end[o - 1], sum[k][2] += end[o] - end[o - 1];
      double after = 0, after_max = 0, ring = 0, chunks = 0;  // per block that had a share
      double staging = 0, rows = 0, tail = 0;  // gemvs: past its wait -> input staged -> warp 0's rows -> end
      int blocks = 0;
      for (int b = 0; b < plan.grid; b++) {
        if (!at(b, o, 2) || !at(b, o, 4)) continue;
        const double w = (double)at(b, o, 2) - at(b, o, 4);
        after += w, after_max = std::max(after_max, w), ring += at(b, o, 5), blocks++;
        if (at(b, o, 3))
          staging += (double)at(b, o, 1) - at(b, o, 4), rows += (double)at(b, o, 3) - at(b, o, 1),
              tail += (double)at(b, o, 2) - at(b, o, 3);
      }
      if (blocks) sum[k][8] += staging / blocks, sum[k][9] += rows / blocks, sum[k][10] += tail / blocks;
      if (op.kind != PERSIST_ATTN && op.kind != PERSIST_EMBED)
        chunks = (double)op.groups * persist_k_chunks(op) / std::min(op.groups, plan.grid);
      if (blocks) {
        sum[k][3] += after / blocks, sum[k][4] += after_max, sum[k][5] += ring / blocks;
        sum[k][7] += chunks * PERSIST_SLOT_ELEMS * 2 * plan.grid / copy_gbps;
      }
      cnt[k]++;
    }
    printf("    TIMING breakdown 0.6b B=%d ctx 600: step %.1f us (one launch, no graph, %.0f GB/s of weights, copy "
           "bandwidth %.0f GB/s); per operation, mean over layers (us):\n", B, step_ns / 1e3, gbps, copy_gbps);
    for (int k = 1; k < 7; k++)
      printf("      %-9s past its wait: first block %6.2f, last %6.2f after the previous op completed; complete "
             "%6.2f | a block from past its wait to its end: mean %5.2f (input %4.2f, rows %4.2f, sums and signal "
             "%4.2f), max %5.2f (its weights: %5.2f) | chunks in its ring at its wait %4.2f\n",
             names[k], sum[k][0] / cnt[k] / 1e3, sum[k][1] / cnt[k] / 1e3, sum[k][2] / cnt[k] / 1e3,
             sum[k][3] / cnt[k] / 1e3, sum[k][8] / cnt[k] / 1e3, sum[k][9] / cnt[k] / 1e3, sum[k][10] / cnt[k] / 1e3,
             sum[k][4] / cnt[k] / 1e3, sum[k][7] / cnt[k] / 1e3, sum[k][5] / cnt[k]);
  }
}

int main(int argc, char** argv) {
  install_default_optimizations();
  return test_main(argc, argv);
}
