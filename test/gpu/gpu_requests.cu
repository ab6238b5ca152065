// gpu_requests.cu — section 9b's kernels and the samplers' min_p on the GPU against their CPU references
// (nanovllm.cu: logit_edits_reference, logprobs_reference, sample_kept_reference / sample_reference):
//   * the logit edits (penalties and bans) to the bit, and their restore to the bit, on rows built from real
//     Sequences (repeated prompt tokens, counts, bans merged into penalty entries);
//   * the log-probabilities, section 9b's and section 21's split ones, against a CPU log-softmax in double of
//     the same logits (NaN, -inf, planted ties), at batch sizes where the split cuts rows;
//   * the three samplers with min_p, alone and with top-k / top-p: sections 21 and 22 draw section 9's token,
//     which is in the CPU's kept set, and is the CPU's exact draw wherever the draw's margin is clear of float
//     noise.
#define NANOVLLM_TESTING
#include "../../nanovllm.cu"
#include "../test.h"

#include "gpu_fixtures.h"

template <class T>
static T* to_device(const std::vector<T>& v) {
  T* p;
  CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(1, v.size()) * sizeof(T)));
  CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}
template <class T>
static std::vector<T> to_host(const T* p, size_t n) {
  std::vector<T> v(n);
  CUDA_CHECK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

TEST(logit_edits_match_reference_and_restore_exactly) {
  REQUIRE_GPU();
  std::mt19937 rng(31);
  for (int V : {151936, 1001}) {
    const int B = 9;
    std::vector<std::unique_ptr<Sequence>> seqs;
    std::vector<SamplingSlot> slots(B);
    std::vector<LogitEdit> edits;
    std::vector<int> start;
    const std::vector<int> eos = {V - 1, 2};
    for (int b = 0; b < B; b++) {
      SamplingParams p;
      p.repetition_penalty = b % 3 == 0 ? 1.f : 0.5f + 0.25f * b;
      p.frequency_penalty = (b % 5 - 2) * 0.7f;
      p.presence_penalty = (b % 4 - 1.5f) * 0.9f;
      p.stop_token_ids = {7, V - 1};
      p.max_tokens = 500;
      p.min_tokens = b % 2 ? 400 : 0;  // odd rows: EOS and stop ids banned
      std::vector<int> prompt(1 + rng() % 300);
      for (int& t : prompt) t = rng() % 400;  // repeats
      seqs.emplace_back(new Sequence(b, prompt, p, 16));
      for (int k = rng() % 200; k > 0; k--) seqs.back()->append_token(rng() % 600);
      start.push_back((int)edits.size());
      logit_edits_of(*seqs.back(), eos, edits);
      slots[b].repetition_penalty = p.repetition_penalty, slots[b].frequency_penalty = p.frequency_penalty;
      slots[b].presence_penalty = p.presence_penalty;
    }
    start.push_back((int)edits.size());
    std::vector<float> logits;
    for (int b = 0; b < B; b++) {
      auto row = random_logits(V, rng, 3.f);
      logits.insert(logits.end(), row.begin(), row.end());
    }
    float* d_logits = to_device(logits);
    LogitEdit* d_edits = to_device(edits);
    int* d_start = to_device(start);
    SamplingSlot* d_slots = to_device(slots);
    float* d_saved;
    CUDA_CHECK(cudaMalloc(&d_saved, edits.size() * sizeof(float)));
    logit_edits(false, d_logits, B, V, d_edits, d_start, d_slots, d_saved, 0);
    std::vector<float> got = to_host(d_logits, logits.size()), want = logits;
    for (int b = 0; b < B; b++)
      logit_edits_reference(&want[(size_t)b * V], &edits[start[b]], start[b + 1] - start[b], slots[b]);
    int differing = 0, changed = 0;
    for (size_t i = 0; i < want.size(); i++) {
      differing += memcmp(&got[i], &want[i], 4) != 0;
      changed += memcmp(&got[i], &logits[i], 4) != 0;
    }
    CHECK_MSG(differing == 0, "V=%d: %d logits differ from the CPU reference", V, differing);
    CHECK_MSG(changed > 1000, "V=%d: only %d logits changed: the test edits too little", V, changed);
    logit_edits(true, d_logits, B, V, d_edits, d_start, d_slots, d_saved, 0);
    got = to_host(d_logits, logits.size());
    CHECK_MSG(memcmp(got.data(), logits.data(), logits.size() * 4) == 0, "V=%d: restore is not exact", V);
    printf("    V=%d: %zu edits over %d rows, %d logits changed, all equal to the CPU's, restored exactly\n", V,
           edits.size(), B, changed);
    cudaFree(d_logits), cudaFree(d_edits), cudaFree(d_start), cudaFree(d_slots), cudaFree(d_saved);
  }
}

TEST(logprobs_match_cpu_log_softmax) {
  REQUIRE_GPU();
  std::mt19937 rng(32);
  for (int V : {151936, 1001, 48}) {
    std::vector<int> Ns = {-1, 0, 1, 5, 20, 20, 3};
    if (V == 1001) Ns = {20};  // one row: the split kernel cuts it into pieces
    const int B = (int)Ns.size();
    std::vector<float> logits;
    std::vector<SamplingSlot> slots(B);
    std::vector<int> tokens(B);
    for (int b = 0; b < B; b++) {
      auto row = random_logits(V, rng, b == 6 ? 0.01f : 2.5f);  // row 6: nearly flat
      if (b == 2) row[V / 3] = row[V / 2] = 40.f;                    // a tie at the top
      if (b == 4) for (int i = 0; i < V; i += 7) row[i] = NAN;
      if (b == 5) for (int i = 1; i < V; i += 3) row[i] = -INFINITY;
      logits.insert(logits.end(), row.begin(), row.end());
      slots[b].logprobs = Ns[b];
      tokens[b] = b == 2 ? V / 2 : (int)(rng() % V);
    }
    float* d_logits = to_device(logits);
    int* d_tokens = to_device(tokens);
    SamplingSlot* d_slots = to_device(slots);
    TokenLogprobs* d_out;
    CUDA_CHECK(cudaMalloc(&d_out, B * sizeof(TokenLogprobs)));
    DevBuf<unsigned char> ws(logprobs_workspace_bytes(B));
    for (bool fast : {false, true}) {  // section 9b's kernel, then section 22a's split one
    CUDA_CHECK(cudaMemset(d_out, 0xFF, B * sizeof(TokenLogprobs)));
    if (fast) compute_logprobs_fast(d_out, d_logits, d_tokens, d_slots, B, V, ws.p, ws.n, 0);
    else compute_logprobs(d_out, d_logits, d_tokens, d_slots, B, V, 0);
    std::vector<TokenLogprobs> got = to_host(d_out, B);
    double worst = 0;
    for (int b = 0; b < B; b++) {
      if (Ns[b] < 0) {
        std::vector<unsigned char> bytes((unsigned char*)&got[b], (unsigned char*)&got[b] + sizeof(TokenLogprobs));
        CHECK_MSG(std::all_of(bytes.begin(), bytes.end(), [](unsigned char c) { return c == 0xFF; }),
                  "row %d (no logprobs asked) was written", b);
        continue;
      }
      const TokenLogprobs want = logprobs_reference(&logits[(size_t)b * V], V, tokens[b], Ns[b]);
      auto close = [&](float g, float w) {
        if (std::isinf(w) || std::isinf(g)) return g == w;
        worst = std::max(worst, (double)fabs(g - w));
        return fabs(g - w) <= 1e-4 + 1e-5 * fabs(w);
      };
      CHECK_MSG(close(got[b].logprob, want.logprob), "V=%d row %d: logprob %g, want %g", V, b, got[b].logprob, want.logprob);
      CHECK_MSG(got[b].rank == want.rank, "V=%d row %d: rank %d, want %d", V, b, got[b].rank, want.rank);
      CHECK_EQ(got[b].num_top, Ns[b]);
      for (int k = 0; k < Ns[b]; k++) {
        CHECK_MSG(got[b].top_ids[k] == want.top_ids[k], "V=%d row %d top %d: id %d, want %d", V, b, k,
                  got[b].top_ids[k], want.top_ids[k]);
        CHECK_MSG(close(got[b].top_logprobs[k], want.top_logprobs[k]), "V=%d row %d top %d: %g, want %g", V, b, k,
                  got[b].top_logprobs[k], want.top_logprobs[k]);
      }
    }
    printf("    V=%d, %s: %d rows, worst |logprob - CPU double| = %.2e\n", V, fast ? "split (section 22a)" : "section 9b",
           B, worst);
    }
    cudaFree(d_logits), cudaFree(d_tokens), cudaFree(d_slots), cudaFree(d_out);
  }
}

TEST(sampler_min_p_matches_cpu) {
  REQUIRE_GPU();
  std::mt19937 rng(33);
  std::mt19937_64 rng64(34);
  struct Cfg { float t; int k; float p; float min_p; float stddev; };
  const std::vector<Cfg> cfgs = {{1.f, -1, 1.f, 0.05f, 2.f}, {0.7f, -1, 1.f, 0.3f, 1.f}, {1.f, -1, 1.f, 0.9f, 0.5f},
                                 {1.f, 50, 1.f, 0.01f, 1.f}, {1.f, -1, 0.8f, 0.1f, 1.f}, {0.8f, 12, 0.7f, 0.2f, 0.7f},
                                 {1.f, -1, 1.f, 1.f, 2.f},   {0.f, -1, 1.f, 0.5f, 2.f},  {1.f, -1, 0.95f, 0.5f, 0.02f},
                                 {1.f, 20000, 0.9f, 0.001f, 0.3f}, {1.2f, -1, 1.f, 0.99f, 0.01f}};
  int exact = 0, rows = 0;
  for (int V : {151936, 1001}) {
    for (int rep = 0; rep < 4; rep++) {
      const int B = (int)cfgs.size();
      std::vector<float> logits;
      std::vector<SamplingSlot> slots(B);
      for (int b = 0; b < B; b++) {
        auto row = random_logits(V, rng, cfgs[b].stddev);
        logits.insert(logits.end(), row.begin(), row.end());
        SamplingSlot& s = slots[b];
        s.temperature = cfgs[b].t, s.top_k = cfgs[b].k, s.top_p = cfgs[b].p, s.min_p = cfgs[b].min_p;
        s.seed = rng64(), s.offset = rng64();
      }
      float* d_logits = to_device(logits);
      SamplingSlot* d_slots = to_device(slots);
      int* d_out;
      CUDA_CHECK(cudaMalloc(&d_out, B * sizeof(int)));
      DevBuf<unsigned char> ws(std::max(sample_workspace_bytes(B, V), sample_sort_workspace_bytes(B, V)));
      ws.poison();
      CUDA_CHECK(cudaMemset(d_out, 0xFF, B * sizeof(int)));
      sample_fast(d_out, d_logits, d_slots, B, V, ws.p, ws.n, 0);  // section 22's, section 21's, then section 9's
      std::vector<int> fast = to_host(d_out, B);
      CUDA_CHECK(cudaMemset(d_out, 0xFF, B * sizeof(int)));
      sample_bisect(d_out, d_logits, d_slots, B, V, ws.p, ws.n, 0);
      std::vector<int> bisect = to_host(d_out, B);
      CUDA_CHECK(cudaMemset(d_out, 0xFF, B * sizeof(int)));
      sample(d_out, d_logits, d_slots, B, V, ws.p, ws.n, 0);
      std::vector<int> got = to_host(d_out, B);
      for (int b = 0; b < B; b++)
        CHECK_MSG(fast[b] == got[b] && bisect[b] == got[b],
                  "V=%d row %d (T=%g k=%d p=%g min_p=%g): radix select %d, bisection %d, sort %d", V, b,
                  slots[b].temperature, slots[b].top_k, slots[b].top_p, slots[b].min_p, fast[b], bisect[b], got[b]);
      for (int b = 0; b < B; b++, rows++) {
        const float* row = &logits[(size_t)b * V];
        std::vector<char> loose = sample_kept_reference(row, V, slots[b], +1e-5);
        std::vector<char> strict = sample_kept_reference(row, V, slots[b], -1e-5);
        if (!CHECK_MSG(got[b] >= 0 && got[b] < V && loose[got[b]], "V=%d row %d (min_p %g): token %d not kept", V, b,
                       slots[b].min_p, got[b]))
          continue;
        if (strict != loose) continue;  // a top-p cut within float noise: only membership is meaningful
        double margin;
        const int want = sample_reference(row, V, slots[b], strict, &margin);
        if (margin < 1e-3) continue;
        CHECK_MSG(got[b] == want, "V=%d row %d (T=%g k=%d p=%g min_p=%g): %d, CPU %d", V, b, slots[b].temperature,
                  slots[b].top_k, slots[b].top_p, slots[b].min_p, got[b], want);
        exact++;
      }
      cudaFree(d_logits), cudaFree(d_slots), cudaFree(d_out);
    }
  }
  printf("    %d rows with min_p: sections 22, 21 and 9 drew the same token; every token in the CPU's kept set, %d "
         "equal to the CPU's exact draw\n", rows, exact);
  CHECK(exact > rows / 2);
}

int main(int argc, char** argv) {
  install_default_optimizations();
  return test_main(argc, argv);
}
