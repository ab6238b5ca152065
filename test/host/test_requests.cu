// test_requests.cu — the request fields of vLLM's SamplingParams (nanovllm.cu sections 2, 5, 9b, 13, 31)
// without a GPU: stop strings matched on the growing text across token boundaries, stop token ids and
// min_tokens in the scheduler, n completions sharing the prompt's blocks, the penalties' and bans' logit
// edits and the log-probabilities against plain CPU formulas, min_p's threshold, the generation_config.json
// defaults, and OpenAI batch files in and out. LLMEngine runs with a scripted runner in place of the GPU.
#define NANOVLLM_TESTING
#include "../../nanovllm.cu"
#include "../test.h"
#include "../engine_fixtures.h"
#include "../tokenizer_fixture.h"

// Every sequence's k-th output token is script[k] (so all sequences say the same thing), and each row gets
// made-up log-probabilities when the step asks for them (logprob = -k for output token k).
struct ScriptedRunner : StepRunner {
  std::vector<int> script;
  std::vector<TokenLogprobs> lp;
  bool any_logprobs = false;
  explicit ScriptedRunner(std::vector<int> s) : script(std::move(s)) {}
  std::vector<int> run(const std::vector<Sequence*>& seqs, bool) override {
    std::vector<int> out;
    lp.assign(seqs.size(), TokenLogprobs{});
    any_logprobs = false;
    for (size_t i = 0; i < seqs.size(); i++) {
      const int k = seqs[i]->num_completion_tokens();
      out.push_back(script[k % script.size()]);
      lp[i].logprob = -(float)k, lp[i].rank = 1, lp[i].num_top = std::max(0, seqs[i]->params.logprobs);
      any_logprobs |= seqs[i]->params.logprobs >= 0;
    }
    return out;
  }
  int padded_batch(int B, bool) const override { return B; }
  const TokenLogprobs* step_logprobs() const override { return any_logprobs ? lp.data() : nullptr; }
};

static std::vector<Completion> run_script(const std::vector<int>& script, const std::vector<Request>& reqs,
                                          const Tokenizer* tok, Config c = small_config(400, 16),
                                          SchedulerStats* sched = nullptr, int* peak_blocks = nullptr,
                                          std::vector<SamplingParams>* params = nullptr) {
  ScriptedRunner r(script);
  LLMEngine e(c, r);
  RunWatcher w;
  w.progress = false;
  e.observer = &w;
  e.tok = tok;
  std::vector<Completion> outs = e.generate(reqs);
  if (sched) *sched = e.scheduler.stats;
  if (peak_blocks) *peak_blocks = w.stats.peak_blocks_used;
  if (params)
    for (auto& s : e.seqs) params->push_back(s->params);
  return outs;
}

static Request req(std::vector<int> prompt, int max_tokens) {
  Request r;
  r.prompt_token_ids = std::move(prompt);
  r.params.max_tokens = max_tokens;
  r.params.temperature = 0;
  return r;
}

// ---- stop strings, stop token ids, min_tokens -------------------------------------------------------------

// The first k tokens whose decoded text contains `needle` (what the engine must have generated when it stops).
static size_t tokens_until(const Tokenizer& tok, const std::vector<int>& ids, const std::string& needle) {
  for (size_t k = 1; k <= ids.size(); k++)
    if (tok.decode(std::vector<int>(ids.begin(), ids.begin() + k)).find(needle) != std::string::npos) return k;
  return 0;
}

TEST(stop_string_spanning_tokens_cuts_the_text) {
  NEED_QWEN3();
  const std::string text = "The answer is forty-two. Then we stop here, and the rest never comes.";
  const std::vector<int> ids = tok->encode(text);
  for (const std::string stop : {"wo. Th", "forty", "e, and th"}) {
    const size_t k = tokens_until(*tok, ids, stop);
    CHECK(k > 0);
    for (bool include : {false, true}) {
      Request r = req({1, 2, 3}, 60);
      r.params.stop = {"never matches", stop};
      r.params.include_stop_str_in_output = include;
      std::vector<Completion> o = run_script(ids, {r}, tok);
      CHECK_EQ(std::string(o[0].finish_reason), std::string("stop"));
      CHECK_EQ(o[0].stop_string, stop);
      CHECK_EQ(o[0].token_ids.size(), k);  // generation ends with the token that completed the match
      const size_t at = text.find(stop);
      CHECK_EQ(o[0].text, text.substr(0, include ? at + stop.size() : at));
    }
  }
}

TEST(stop_strings_go_in_list_order_and_only_look_at_new_text) {
  NEED_QWEN3();
  const std::string text = "alpha beta gamma delta";
  const std::vector<int> ids = tok->encode(text);
  Request r = req({1}, 60);
  r.params.stop = {"delta", "beta"};  // vLLM: the first in the list that matches, so "beta" (it comes first)
  std::vector<Completion> o = run_script(ids, {r}, tok);
  CHECK_EQ(o[0].stop_string, std::string("beta"));
  CHECK_EQ(o[0].text, std::string("alpha "));
  // A stop string that the text held before min_tokens tokens were out is not found later.
  r.params.stop = {"alpha"};
  r.params.min_tokens = 2;
  r.params.max_tokens = (int)ids.size();
  o = run_script(ids, {r}, tok);
  CHECK_EQ(std::string(o[0].finish_reason), std::string("length"));
  CHECK_EQ(o[0].text, text);
}

TEST(stop_token_ids_eos_and_min_tokens) {
  NEED_QWEN3();
  const int A = tok->encode("A")[0], B = tok->encode("B")[0], X = tok->encode("X")[0];
  const int EOS = 151645;  // <|im_end|>, in small_config's EOS ids
  // A stop token ends the sequence even with ignore_eos; its text is left out unless asked for.
  for (bool include : {false, true}) {
    Request r = req({1}, 20);
    r.params.ignore_eos = true;
    r.params.stop_token_ids = {X};
    r.params.include_stop_str_in_output = include;
    std::vector<Completion> o = run_script({A, EOS, B, X, A}, {r}, tok);
    CHECK(o[0].token_ids == (std::vector<int>{A, EOS, B, X}));
    CHECK_EQ(o[0].stop_token_id, X);
    CHECK_EQ(std::string(o[0].finish_reason), std::string("stop"));
    CHECK_EQ(o[0].text, tok->decode(include ? std::vector<int>{A, EOS, B, X} : std::vector<int>{A, EOS, B}));
  }
  // EOS stops (reason "stop", no stop_reason) ...
  std::vector<Completion> o = run_script({A, EOS, B, B, EOS}, {req({1}, 20)}, tok);
  CHECK_EQ(o[0].token_ids.size(), (size_t)2);
  CHECK_EQ(o[0].stop_token_id, -1);
  CHECK(o[0].stop_string.empty());
  // ... but not among the first min_tokens tokens (the GPU sampler also bans it there: section 9b).
  Request r = req({1}, 20);
  r.params.min_tokens = 3;
  o = run_script({A, EOS, B, B, EOS}, {r}, tok);
  CHECK_EQ(o[0].token_ids.size(), (size_t)5);
  CHECK_EQ(std::string(o[0].finish_reason), std::string("stop"));
}

// ---- n completions share the prompt's blocks -------------------------------------------------------------

TEST(n_completions_share_the_prompt_blocks) {
  Config c = small_config(400, 16);
  Request r = req(iota_tokens(100), 5);
  r.params.n = 4;
  r.params.seed = 40;
  SchedulerStats sched;
  int peak = 0;
  std::vector<SamplingParams> params;
  std::vector<Completion> o = run_script({7, 8, 9, 10, 11}, {r}, nullptr, c, &sched, &peak, &params);
  CHECK_EQ(o.size(), (size_t)4);
  for (int k = 0; k < 4; k++) {
    CHECK_EQ(o[k].request, 0);
    CHECK_EQ(o[k].index, k);
    CHECK_EQ(o[k].token_ids.size(), (size_t)5);
    CHECK_EQ(params[k].seed, (int64_t)(40 + k));  // vLLM: child k of a seeded request draws with seed + k
  }
  // The prompt's blocks but the last: (100 - 1) / 16 = 6 full blocks of 16, hit by each of the 3 others.
  CHECK_EQ(sched.prefix_hit_tokens, (int64_t)(3 * 96));
  CHECK_EQ(peak, 7 + 3 * 1);  // 7 blocks for the first, then 1 of its own for each sibling: 10, not 28
  // Without sharing (n = 1 requests admitted together) the same four need 28 blocks.
  r.params.n = 1;
  o = run_script({7, 8, 9, 10, 11}, {r, r, r, r}, nullptr, c, &sched, &peak);
  CHECK_EQ(sched.prefix_hit_tokens, (int64_t)0);
  CHECK_EQ(peak, 28);
}

TEST(n_with_a_prompt_shorter_than_a_block_does_not_wait) {
  Config c = small_config(400, 16);
  Request r = req(iota_tokens(10), 3);
  r.params.n = 3;
  std::vector<StepTrace> steps;
  ScriptedRunner runner({5});
  LLMEngine e(c, runner);
  RunWatcher w;
  w.progress = false;
  w.record = &steps;
  e.observer = &w;
  e.generate({r});
  CHECK_EQ(steps[0].batch, 3);  // nothing to share: all three are admitted in the first step
}

// ---- penalties and bans: the logit edits against vLLM's dense formula ----------------------------------

TEST(logit_edits_match_vllm_penalties_on_a_known_row) {
  const int V = 40;
  const std::vector<int> prompt = {5, 7, 7, 9, 30}, output = {7, 11, 11, 3, 30, 30};
  const std::vector<int> eos = {2, 30};
  for (int min_tokens : {0, 9}) {
    SamplingParams p;
    p.repetition_penalty = 1.3f, p.frequency_penalty = 0.4f, p.presence_penalty = -0.7f;
    p.stop_token_ids = {11, 13, 2};
    p.min_tokens = min_tokens;
    p.max_tokens = 20;
    Sequence q(0, prompt, p, 16);
    for (int t : output) q.append_token(t);
    std::vector<LogitEdit> edits;
    logit_edits_of(q, eos, edits);
    std::set<int> distinct;
    for (auto& e : edits) CHECK(distinct.insert(e.token).second);  // one entry per token: no write races
    std::vector<float> row(V), want(V);
    uint64_t st = 99;
    for (int t = 0; t < V; t++) row[t] = ((float)(splitmix64(st += t + 1) % 2001) - 1000.f) / 250.f;
    row[5] = 0.f;  // a zero logit: neither divided nor multiplied changes it
    SamplingSlot s{};
    s.repetition_penalty = p.repetition_penalty, s.frequency_penalty = p.frequency_penalty;
    s.presence_penalty = p.presence_penalty;
    for (int t = 0; t < V; t++) {  // vLLM's apply_penalties on dense masks and counts
      const bool in_prompt = std::count(prompt.begin(), prompt.end(), t) > 0;
      const int c = (int)std::count(output.begin(), output.end(), t);
      float x = row[t];
      if (in_prompt || c > 0) x = x > 0 ? x / 1.3f : x * 1.3f;
      x -= 0.4f * (float)c;
      x -= -0.7f * (c > 0 ? 1.f : 0.f);
      const bool banned = (int)output.size() < min_tokens &&
                          (std::count(eos.begin(), eos.end(), t) || std::count(p.stop_token_ids.begin(), p.stop_token_ids.end(), t));
      want[t] = banned ? -INFINITY : x;
    }
    logit_edits_reference(row.data(), edits.data(), (int)edits.size(), s);
    for (int t = 0; t < V; t++) CHECK_MSG(row[t] == want[t], "min_tokens %d token %d: %g, want %g", min_tokens, t, row[t], want[t]);
  }
}

TEST(no_penalty_keeps_no_counts) {
  SamplingParams p;
  Sequence q(0, {1, 2, 3}, p, 16);
  q.append_token(4);
  std::vector<LogitEdit> edits;
  logit_edits_of(q, {2}, edits);
  CHECK(q.token_counts.empty());
  CHECK(edits.empty());  // the default path has nothing to send
}

// ---- log-probabilities and min_p (the CPU halves of section 9b and section 9) ---------------------------

TEST(logprobs_reference_on_a_known_row) {
  const float row[7] = {1.f, 3.f, 3.f, -2.f, NAN, 0.5f, -INFINITY};
  TokenLogprobs o = logprobs_reference(row, 7, 5, 7);
  double lse = 0;
  for (float x : {1.f, 3.f, 3.f, -2.f, 0.5f}) lse += exp((double)x);
  lse = log(lse);
  CHECK(fabs(o.logprob - (0.5 - lse)) < 1e-6);
  CHECK_EQ(o.rank, 4);  // 3, 3 and 1 are larger
  const int order[7] = {1, 2, 0, 5, 3, 4, 6};  // ties: the lower id first; NaN counts as -inf
  for (int k = 0; k < 7; k++) CHECK_EQ(o.top_ids[k], order[k]);
  CHECK(fabs(o.top_logprobs[0] - (3.0 - lse)) < 1e-6);
  CHECK(o.top_logprobs[6] == -INFINITY);
}

TEST(min_p_threshold_is_the_direct_rule) {
  uint64_t st = 1;
  auto uni = [&] { return (float)((splitmix64(st++) >> 40) * 0x1.0p-24); };
  for (int i = 0; i < 20000; i++) {
    const float m = (uni() - 0.5f) * 60.f, min_p = i % 7 == 0 ? 1.f : uni() * 0.5f + 1e-6f;
    const uint32_t t = min_p_threshold(m, min_p);
    const float z = m - uni() * 20.f;
    CHECK_MSG((float_order_key(z) >= t) == (z - m >= logf(min_p)), "m %g min_p %g z %g", m, min_p, z);
    // section 9's rule and section 21's threshold key keep the same tokens
    CHECK_MSG((float_order_key(z) >= t) == min_p_keeps(z, m, logf(min_p)), "m %g min_p %g z %g", m, min_p, z);
  }
  // ... also where z - m is NaN or infinite: a row max of +inf or -inf keeps exactly the tokens equal to it.
  for (float m : {INFINITY, -INFINITY})
    for (float z : {m, -INFINITY, -3.f, 0.f, 5.f, INFINITY}) {
      if (z > m) continue;
      const uint32_t t = min_p_threshold(m, 0.1f);
      CHECK_MSG((float_order_key(z) >= t) == min_p_keeps(z, m, logf(0.1f)), "m %g z %g", m, z);
      CHECK_MSG(min_p_keeps(z, m, logf(0.1f)) == (z == m), "m %g z %g", m, z);
    }
  // The kept set of sample_kept_reference with min_p: tokens with p >= min_p * p_max.
  std::vector<float> logits = {2.f, 1.f, 0.f, -1.f, 2.f - logf(10.f) + 1e-4f, 2.f - logf(10.f) - 1e-4f};
  SamplingSlot s{};
  s.temperature = 1.f, s.top_p = 1.f, s.min_p = 0.1f;
  std::vector<char> keep = sample_kept_reference(logits.data(), 6, s, 0);
  CHECK(keep == (std::vector<char>{1, 1, 1, 0, 1, 0}));  // e^-2 > 0.1 > e^-3
}

// ---- section 9's sort, and its cut against section 21's bisection, on the CPU -------------------------

// block_sort_descending's loops run by one thread: within a step the pairs are disjoint, so running them one
// after another is the same as running them all at once. *touched_twice: a position two pairs of one step
// share (the parallel sort would race there).
static void sort_descending_on_host(float* keys, int n, bool* touched_twice = nullptr) {
  int n2 = 1;
  while (n2 < n) n2 *= 2;
  std::vector<int> touched(n);
  for (int k = 2; k <= n2; k *= 2)
    for (int j = k / 2; j >= 1; j /= 2) {
      std::fill(touched.begin(), touched.end(), 0);
      for (int i = 0; i < n; i++) {
        const int partner = j == k / 2 ? i ^ (k - 1) : i ^ j;
        if (partner > i && partner < n && ++touched[i] + ++touched[partner] > 2 && touched_twice)
          *touched_twice = true;
        bitonic_compare_exchange(keys, n, k, j, i);
      }
    }
}

TEST(sample_sort_is_a_sorting_network) {
  std::mt19937 rng(41);
  std::vector<int> sizes;
  for (int n = 0; n <= 300; n++) sizes.push_back(n);
  for (int n : {511, 512, 513, 1000, 1001, 4097, 151936}) sizes.push_back(n);
  int sorted = 0;
  for (int n : sizes) {
    for (int kind = 0; kind < 3; kind++) {
      // normal values; a few distinct values (ties everywhere); already sorted the wrong way round, with -inf
      std::vector<float> v(n);
      std::normal_distribution<float> d(0.f, 3.f);
      for (int i = 0; i < n; i++)
        v[i] = kind == 0 ? d(rng) : kind == 1 ? (float)(rng() % 5) : i % 9 == 0 ? -INFINITY : (float)i;
      std::vector<float> want = v;
      std::sort(want.begin(), want.end(), std::greater<float>());
      bool twice = false;
      sort_descending_on_host(v.data(), n, &twice);
      CHECK_MSG(v == want, "n = %d, kind %d: not sorted largest first", n, kind);
      CHECK_MSG(!twice, "n = %d: two pairs of one step share a position", n);
      sorted++;
    }
  }
  printf("    %d arrays of 0 .. 151,936 values sorted as std::sort sorts them, no position shared within a step\n",
         sorted);
}

// Section 9's cut (sort, then read tau off the sorted values) and section 21's (bisection over order keys),
// each written out here on the CPU with one mass function standing in for the GPU's fixed_mass (the same
// integers for both, as on the GPU): the two kept sets must be the same set, on rows made of ties, NaN, -inf,
// +inf and flat stretches, for every kind of cut. And both lie between the CPU reference's bracketing sets.
static unsigned long long host_mass(float z, float m) {
  return z == m ? (1ull << 32) : (unsigned long long)llrintf(expf(z - m) * 4294967296.0f);
}
static std::vector<char> sorted_cut(const std::vector<float>& z, const SamplingSlot& s) {
  const int V = (int)z.size();
  std::vector<float> sorted = z;
  sort_descending_on_host(sorted.data(), V);
  const bool top_k = s.top_k > 0 && s.top_k < V, min_p = s.min_p > 0.f;
  const float m = sorted[0], kth = top_k ? sorted[s.top_k - 1] : -INFINITY;
  int n = 0;
  for (float v : sorted) n += v >= kth && (!min_p || min_p_keeps(v, m, logf(s.min_p)));
  int last = n - 1;
  if (s.top_p < 1.f) {
    unsigned long long total = 0, sum = 0;
    for (int j = 0; j < n; j++) total += host_mass(sorted[j], m);
    unsigned long long target = (unsigned long long)ceil((double)s.top_p * (double)total);
    target = std::min(std::max(target, 1ull), total);
    for (last = 0; (sum += host_mass(sorted[last], m)) < target;) last++;
  }
  std::vector<char> keep(V);
  for (int i = 0; i < V; i++) keep[i] = z[i] >= sorted[last];
  return keep;
}
static std::vector<char> bisected_cut(const std::vector<float>& z, const SamplingSlot& s) {
  const int V = (int)z.size();
  auto bisect = [](uint32_t lo, unsigned long long target, auto measure) {
    unsigned long long hi = 1ull << 32;
    while (hi - lo > 1) {
      const uint32_t mid = (uint32_t)(lo + (hi - lo) / 2);
      if (measure(mid) >= target) lo = mid;
      else hi = mid;
    }
    return lo;
  };
  uint32_t threshold = 0, top = 0;
  for (float v : z) top = std::max(top, float_order_key(v));
  const float m = float_from_order_key(top);
  if (s.top_k > 0 && s.top_k < V)
    threshold = bisect(0u, s.top_k, [&](uint32_t t) {
      unsigned long long c = 0;
      for (float v : z) c += float_order_key(v) >= t;
      return c;
    });
  if (s.min_p > 0.f) threshold = std::max(threshold, min_p_threshold(m, s.min_p));
  if (s.top_p < 1.f) {
    auto mass_from = [&](uint32_t t) {
      unsigned long long w = 0;
      for (float v : z)
        if (float_order_key(v) >= t && float_order_key(v) >= threshold) w += host_mass(v, m);
      return w;
    };
    const unsigned long long total = mass_from(threshold);
    unsigned long long target = (unsigned long long)ceil((double)s.top_p * (double)total);
    target = std::min(std::max(target, 1ull), total);
    threshold = bisect(threshold, target, mass_from);
  }
  std::vector<char> keep(V);
  for (int i = 0; i < V; i++) keep[i] = float_order_key(z[i]) >= threshold;
  return keep;
}
TEST(sort_cut_is_the_bisection_cut) {
  std::mt19937 rng(42);
  std::normal_distribution<float> d(0.f, 1.f);
  struct Cut { int k; float p, min_p; };
  const Cut cuts[] = {{1, 1.f, 0.f},     {2, 1.f, 0.f},    {7, 1.f, 0.f},      {-1, 1e-7f, 0.f},  {-1, 0.5f, 0.f},
                      {-1, 0.999999f, 0.f}, {-1, 1.f, 0.05f}, {-1, 1.f, 1.f},    {5, 0.7f, 0.f},    {3, 0.9f, 0.2f},
                      {-1, 0.8f, 0.01f}, {40, 0.95f, 0.001f}};
  int rows = 0, kept_total = 0, bracketed = 0;
  for (int V : {1, 2, 5, 33, 200, 1001}) {
    for (int kind = 0; kind < 8; kind++) {
      std::vector<float> logits(V);
      for (int i = 0; i < V; i++) {
        switch (kind) {
          case 0: logits[i] = 2.f * d(rng); break;                           // plain
          case 1: logits[i] = (float)(rng() % 4) * 0.5f; break;                // ties at every cut
          case 2: logits[i] = i % 3 == 0 ? NAN : 2.f * d(rng); break;         // NaN: never kept
          case 3: logits[i] = i % 2 ? -INFINITY : (float)(rng() % 3); break;   // -inf and ties
          case 4: logits[i] = 1.25f; break;                                     // all equal
          case 5: logits[i] = i % 4 == 1 ? INFINITY : d(rng); break;           // +inf, tied
          case 6: logits[i] = i % 2 ? NAN : -INFINITY; break;                  // nothing finite
          case 7: logits[i] = 0.01f * d(rng) + (i == V / 2 ? 30.f : 0.f); break;  // flat, one peak
        }
      }
      for (const Cut& c : cuts)
        for (float T : {0.6f, 1.f, 3.f}) {
          SamplingSlot s{};
          s.temperature = T, s.top_k = c.k, s.top_p = c.p, s.min_p = c.min_p;
          std::vector<float> z(V);
          for (int i = 0; i < V; i++) z[i] = scaled_logit(logits[i], 1.f / T);
          const std::vector<char> a = sorted_cut(z, s), b = bisected_cut(z, s);
          rows++;
          int n = 0;
          for (int i = 0; i < V; i++) n += a[i];
          kept_total += n;
          if (!CHECK_MSG(a == b, "V=%d kind %d T=%g k=%d p=%g min_p=%g: the sort keeps %d, the bisection another set",
                         V, kind, T, c.k, c.p, c.min_p, n))
            continue;
          CHECK_MSG(n >= 1, "V=%d kind %d: nothing kept", V, kind);
          const std::vector<char> strict = sample_kept_reference(logits.data(), V, s, -1e-5);
          const std::vector<char> loose = sample_kept_reference(logits.data(), V, s, +1e-5);
          bool inside = true;
          for (int i = 0; i < V; i++) inside = inside && (!strict[i] || a[i]) && (!a[i] || loose[i]);
          CHECK_MSG(inside, "V=%d kind %d T=%g k=%d p=%g min_p=%g: the kept set is outside the CPU reference's "
                    "bracket", V, kind, T, c.k, c.p, c.min_p);
          bracketed += inside;
        }
    }
  }
  printf("    %d rows: the sort's cut and the bisection's the same set (%d tokens kept in all), %d inside the "
         "reference's bracket\n", rows, kept_total, bracketed);
}

// ---- the defaults: generation_config.json, then the command line ----------------------------------------

TEST(generation_config_sets_the_defaults_flags_override) {
  const json qwen3 = {{"do_sample", true}, {"eos_token_id", {151645, 151643}}, {"temperature", 0.6},
                      {"top_k", 20}, {"top_p", 0.95}};
  std::string d;
  SamplingParams p = sampling_defaults(qwen3, "M/generation_config.json", true, json::object(), 151936, &d);
  CHECK(p.temperature == 0.6f && p.top_k == 20 && p.top_p == 0.95f && p.max_tokens == 64);
  CHECK_MSG(d.find("from M/generation_config.json") != std::string::npos, "%s", d.c_str());
  p = sampling_defaults(qwen3, "M/generation_config.json", true, {{"temperature", 0.0}, {"top_k", -1}}, 151936, &d);
  CHECK(p.temperature == 0.f && p.top_k == -1 && p.top_p == 0.95f);
  CHECK_MSG(d.find("from the command line") != std::string::npos, "%s", d.c_str());
  p = sampling_defaults(qwen3, "M/generation_config.json", false, json::object(), 151936, &d);
  CHECK(p.temperature == 1.f && p.top_k == -1 && p.top_p == 1.f);  // --generation-config vllm
  p = sampling_defaults(json{{"max_new_tokens", 300}}, "M/generation_config.json", true, json::object(), 151936, &d);
  CHECK_EQ(p.max_tokens, 300);  // vLLM reads max_new_tokens as the default max_tokens
}

TEST(jsonl_line_sets_every_field) {
  NEED_QWEN3();
  Config cfg;
  ModelConfig mc;
  mc.vocab_size = 151936, mc.max_position_embeddings = 40960;
  PromptOptions opt;
  const std::string line =
      R"({"prompt": "hi", "n": 3, "top_k": 0, "min_p": 0.05, "repetition_penalty": 1.2, "frequency_penalty": 0.5,)"
      R"( "presence_penalty": -1, "max_tokens": 9, "min_tokens": 2, "stop": "END", "stop_token_ids": [13, 14],)"
      R"( "include_stop_str_in_output": true, "logprobs": 4, "seed": null})";
  std::vector<Request> r = parse_prompts(line + "\n", "x.jsonl", *tok, opt, cfg, mc);
  const SamplingParams& p = r[0].params;
  CHECK(p.n == 3 && p.top_k == -1 && p.min_p == 0.05f && p.repetition_penalty == 1.2f);
  CHECK(p.frequency_penalty == 0.5f && p.presence_penalty == -1.f && p.max_tokens == 9 && p.min_tokens == 2);
  CHECK(p.stop == std::vector<std::string>{"END"} && p.stop_token_ids == (std::vector<int>{13, 14}));
  CHECK(p.include_stop_str_in_output && p.logprobs == 4 && p.seed == -1);
}

// ---- OpenAI batch files ---------------------------------------------------------------------------------

TEST(openai_batch_in_and_out) {
  NEED_QWEN3();
  Config cfg = small_config(400, 16);
  cfg.max_model_len = 64;
  ModelConfig mc;
  mc.vocab_size = 151936, mc.max_position_embeddings = 40960;
  PromptOptions opt;
  std::string long_prompt;
  for (int i = 0; i < 80; i++) long_prompt += "word ";
  const std::string text =
      R"({"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "qwen", )"
      R"("messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}], )"
      R"("n": 2, "logprobs": true, "top_logprobs": 3, "max_completion_tokens": 5, "stop": ["zzz"], "temperature": 0})"
      "}\n"
      R"({"custom_id": "cmpl-2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hello", "max_tokens": 4, "logprobs": 2}})"
      "\n"
      R"({"custom_id": "tools-3", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}})"
      "\n"
      R"({"custom_id": "long-4", "method": "POST", "url": "/v1/completions", "body": {"prompt": ")" + long_prompt +
      R"(", "max_tokens": 4}})" "\n"
      R"({"custom_id": "img-5", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}})"
      "\n";
  std::vector<Request> reqs = parse_prompts(text, "batch.jsonl", *tok, opt, cfg, mc);
  CHECK_EQ(reqs.size(), (size_t)5);
  CHECK(reqs[0].error.empty() && reqs[0].params.n == 2 && reqs[0].params.logprobs == 3);
  CHECK(reqs[0].params.max_tokens == 5 && reqs[0].params.stop == std::vector<std::string>{"zzz"});
  CHECK(reqs[0].prompt_token_ids ==
        tok->encode(tok->apply_chat_template({{"system", "Be brief."}, {"user", "Hi"}}, true, true)));
  CHECK(reqs[1].error.empty() && reqs[1].params.logprobs == 2 && reqs[1].params.max_tokens == 4);
  CHECK(reqs[1].prompt_token_ids == tok->encode("Hello"));  // completions: no chat template
  CHECK_MSG(reqs[2].error.find("\"tools\" is not supported") != std::string::npos, "%s", reqs[2].error.c_str());
  CHECK_MSG(reqs[3].error.find("maximum context length is 64") != std::string::npos, "%s", reqs[3].error.c_str());
  CHECK_MSG(reqs[4].error.find("image_url") != std::string::npos, "%s", reqs[4].error.c_str());

  const std::vector<int> script = tok->encode(" one two three four five six");
  std::vector<Completion> outs = run_script(script, reqs, tok, cfg);
  CHECK_EQ(outs.size(), (size_t)3);  // 2 + 1: the error lines do not run
  FILE* f = tmpfile();
  CHECK(write_completions(reqs, outs, *tok, f, "model-dir"));
  rewind(f);
  std::vector<json> lines;
  char buf[65536];
  while (fgets(buf, sizeof buf, f)) lines.push_back(json::parse(buf));
  fclose(f);
  CHECK_EQ(lines.size(), (size_t)5);
  const char* ids[] = {"chat-1", "cmpl-2", "tools-3", "long-4", "img-5"};
  for (int i = 0; i < 5; i++) {
    CHECK_EQ(lines[i]["custom_id"].get<std::string>(), std::string(ids[i]));  // input order
    CHECK(lines[i]["id"].is_string() && lines[i]["response"]["request_id"].is_string());
  }
  const json& chat = lines[0]["response"];
  CHECK_EQ(chat["status_code"].get<int>(), 200);
  CHECK(lines[0]["error"].is_null());
  CHECK_EQ(chat["body"]["object"].get<std::string>(), std::string("chat.completion"));
  CHECK_EQ(chat["body"]["model"].get<std::string>(), std::string("qwen"));
  CHECK_EQ(chat["body"]["choices"].size(), (size_t)2);
  for (int k = 0; k < 2; k++) {
    const json& c = chat["body"]["choices"][k];
    CHECK_EQ(c["index"].get<int>(), k);
    CHECK_EQ(c["message"]["role"].get<std::string>(), std::string("assistant"));
    CHECK_EQ(c["message"]["content"].get<std::string>(), tok->decode(std::vector<int>(script.begin(), script.begin() + 5)));
    CHECK_EQ(c["finish_reason"].get<std::string>(), std::string("length"));
    CHECK_EQ(c["logprobs"]["content"].size(), (size_t)5);
    CHECK_EQ(c["logprobs"]["content"][0]["top_logprobs"].size(), (size_t)3);
    CHECK(c["logprobs"]["content"][1]["logprob"].get<double>() == -1.0);
  }
  CHECK_EQ(chat["body"]["usage"]["completion_tokens"].get<int>(), 10);
  CHECK_EQ(chat["body"]["usage"]["total_tokens"].get<int>(), 10 + (int)reqs[0].prompt_token_ids.size());
  const json& cmpl = lines[1]["response"]["body"];
  CHECK_EQ(cmpl["object"].get<std::string>(), std::string("text_completion"));
  CHECK_EQ(cmpl["model"].get<std::string>(), std::string("model-dir"));  // no "model" in the body
  CHECK_EQ(cmpl["choices"][0]["logprobs"]["tokens"].size(), (size_t)4);
  CHECK_EQ(cmpl["choices"][0]["text"].get<std::string>(), tok->decode(std::vector<int>(script.begin(), script.begin() + 4)));
  for (int i = 2; i < 5; i++) {
    CHECK_EQ(lines[i]["response"]["status_code"].get<int>(), 400);
    CHECK(lines[i]["response"]["body"].is_null());
    CHECK(lines[i]["error"].is_string());
  }
}

int main(int argc, char** argv) { return test_main(argc, argv); }
