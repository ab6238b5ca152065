// Host tests of --trace and the run summary (section 13). No GPU: the scheduler runs with a fake model that
// "samples" token 7 for every sequence (as in test_engine_core.cu), and each step's trace line is built by
// the same two functions LLMEngine::step() calls, trace_after_schedule() and format_trace().
#define NANOVLLM_TESTING
#include "../../nanovllm.cu"
#include "../test.h"
#include "../engine_fixtures.h"


// One engine step with the fake model, numbered like LLMEngine::step(); returns the step's trace text with
// the step time fixed at 0.25 ms so the text is exact.
struct TracedScheduler {
  Scheduler s;
  int64_t steps = 0;
  explicit TracedScheduler(const Config& c) : s(c) {}
  std::string step() {
    bool is_prefill;
    auto batch = s.schedule(is_prefill);
    StepTrace t = trace_after_schedule(s, batch, is_prefill, ++steps);
    t.ms = 0.25;
    s.postprocess(batch, std::vector<int>(batch.size(), 7), is_prefill);
    return format_trace(t);
  }
};

// The second identical prompt, admitted a step later, finds its 5 full blocks (80 tokens) cached and
// schedules only the 3 tokens of its partial last block; then both decode.
TEST(trace_prefill_with_prefix_hit_then_decode) {
  const int P = 16;
  TracedScheduler ts(small_config(64, P));
  auto prompt = iota_tokens(5 * P + 3);
  Sequence a(0, prompt, params_len(4), P), b(1, prompt, params_len(4), P);
  ts.s.add(&a);
  CHECK_EQ(
      ts.step(),
      std::string("[trace] step 1 PREFILL batch=1 tokens=83 hit=0 waiting=0 running=1 free=58/64 hashes=0 "
                  "ms=0.25\n"));
  ts.s.add(&b);
  CHECK_EQ(
      ts.step(),
      std::string("[trace] step 2 PREFILL batch=1 tokens=3 hit=80 waiting=0 running=2 free=57/64 hashes=5 "
                  "ms=0.25\n"));
  CHECK_EQ(
      ts.step(),
      std::string("[trace] step 3 DECODE  batch=2 tokens=2 hit=0 waiting=0 running=2 free=57/64 hashes=5 "
                  "ms=0.25\n"));
}

// Four blocks for two growing sequences: when both reach length 33 and need a third block, the newest (seq 1)
// is preempted (its line follows the step's line), and when it comes back its first block is still cached.
TEST(trace_preemption_and_cheap_recompute) {
  const int P = 16;
  TracedScheduler ts(small_config(4, P));
  Sequence a(0, iota_tokens(P), params_len(2 * P), P), b(1, iota_tokens(P, 100), params_len(2 * P), P);
  ts.s.add(&a);
  ts.s.add(&b);
  std::vector<std::string> lines;
  while (!ts.s.is_finished() && lines.size() < 200) lines.push_back(ts.step());
  CHECK(ts.s.is_finished());
  CHECK_EQ(ts.s.stats.num_preemptions, (int64_t)1);
  int with_preempt = 0;
  for (auto& l : lines) with_preempt += l.find("preempt") != std::string::npos;
  CHECK_EQ(with_preempt, 1);
  if (!CHECK_MSG(lines.size() >= 33, "only %zu steps", lines.size())) return;
  // step 18: a keeps going in the block b freed (b's second block, whose hash goes with it)
  CHECK_EQ(lines[17],
           std::string("[trace] step 18 DECODE  batch=1 tokens=1 hit=0 waiting=1 running=1 free=1/4 hashes=3 "
                       "ms=0.25\n[trace]   preempt seq=1 len=33\n"));
  // step 33: a has finished; b's 33 tokens come back with its first block (16 tokens) as a cache hit
  CHECK_EQ(
      lines[32],
      std::string("[trace] step 33 PREFILL batch=1 tokens=17 hit=16 waiting=0 running=1 free=1/4 hashes=2 "
                  "ms=0.25\n"));
}

// Chunked prefill: the prompt's chunks stay in `waiting` until the last one.
TEST(trace_chunked_prefill_waits_until_last_chunk) {
  const int P = 16;
  Config c = small_config(64, P);
  c.max_num_batched_tokens = 2 * P;
  TracedScheduler ts(c);
  Sequence a(0, iota_tokens(5 * P + 5), params_len(2), P);
  ts.s.add(&a);
  CHECK_EQ(
      ts.step(),
      std::string("[trace] step 1 PREFILL batch=1 tokens=32 hit=0 waiting=1 running=0 free=58/64 hashes=0 "
                  "ms=0.25\n"));
  CHECK_EQ(
      ts.step(),
      std::string("[trace] step 2 PREFILL batch=1 tokens=32 hit=0 waiting=1 running=0 free=58/64 hashes=2 "
                  "ms=0.25\n"));
  CHECK_EQ(
      ts.step(),
      std::string("[trace] step 3 PREFILL batch=1 tokens=21 hit=0 waiting=0 running=1 free=58/64 hashes=4 "
                  "ms=0.25\n"));
}

// Known answers from a pure-Python XXH64 (checked against Python's xxhash on test_engine_core's block
// hashes):
//   xxh64(b"".join(struct.pack(f"<i{len(t)}i", len(t), *t) for t in lists)).hexdigest()
TEST(completions_hash_known_values) {
  auto comp = [](std::vector<int> t) { return Completion{t, "length", 1}; };
  CHECK_EQ(hex64(completions_xxh64({comp({9707, 1879, 0}), comp({}), comp({151645})})),
           std::string("df91a04fc2eefd41"));
  CHECK_EQ(hex64(completions_xxh64({comp(iota_tokens(37, 100))})), std::string("63c139633d32e9f0"));
  CHECK_EQ(hex64(completions_xxh64({})), std::string("ef46db3751d8e999"));  // XXH64 of no bytes
  // Order matters: the same completions in another order are another result.
  CHECK(completions_xxh64({comp({1}), comp({2})}) != completions_xxh64({comp({2}), comp({1})}));
}

TEST(summary_numbers_lines_and_json) {
  RunStats st;
  st.steps_prefill = 2, st.steps_decode = 4, st.decode_tokens = 10;
  st.prefill_seconds = 0.5, st.decode_seconds = 1.5;
  st.schedule_seconds = 0.1, st.prepare_seconds = 0.2, st.gpu_wait_seconds = 1.6,
  st.postprocess_seconds = 0.1;
  st.peak_blocks_used = 25, st.last_batch = 3;
  SchedulerStats ss;
  ss.prefix_hit_tokens = 256, ss.prompt_tokens_admitted = 1024, ss.num_preemptions = 2;
  std::vector<Completion> outs = {{{1, 2, 3}, "length", 600}, {{4}, "stop", 424}};
  RunSummary r = run_summary(st, ss, 100, outs, 0xabcdef0123456789ull);
  r.kv_cache_dtype = "fp8", r.kv_pool_tokens = 1600;  // finish_run sets these from the Config
  CHECK_EQ(r.prompt_tokens, (int64_t)1024);
  CHECK_EQ(r.generated_tokens, (int64_t)4);
  CHECK_EQ(r.prefix_hit_rate, 0.25);
  CHECK_EQ(r.mean_decode_batch, 2.5);
  CHECK_EQ(r.tokens_xxh64, completions_xxh64(outs));
  CHECK_EQ(
      format_summary(r),
      "nanovllm: summary | prefix cache hit 256 of 1024 admitted tokens (25.0%) | 2 preemptions | mean "
      "decode "
      "batch 2.50 over 4 steps | peak KV 25 of 100 blocks (25.0%) | KV cache fp8, 1600 tokens\n"
      "nanovllm: time | 2.000 s in 6 steps | host 0.400 s (20%): schedule 0.100, prepare + launch 0.200, "
      "postprocess 0.100 | waiting for the GPU 1.600 s (80%)\n"
      "nanovllm: latency | scheduler nano (max_num_seqs caps each step's sequences) | time to first token "
      "median 0.000 s, p99 0.000 s | time per output token median 0.00 ms, p99 0.00 ms\n"
      "nanovllm: check | tokens xxh64 " +
          hex64(completions_xxh64(outs)) +
          " (all completions, in input order) | logits xxh64 abcdef0123456789 (last step, 3 rows)\n");
  CHECK(format_summary(r).find("requests") == std::string::npos);  // bench.sh keys on that word
  json j = json::parse(summary_json(r).dump());
  CHECK(j.contains("summary"));
  CHECK_EQ(j["summary"]["preemptions"].get<int>(), 2);
  CHECK_EQ(j["summary"]["peak_kv_blocks"].get<int>(), 25);
  CHECK_EQ(j["summary"]["kv_pool_tokens"].get<int>(), 1600);
  CHECK_EQ(j["summary"]["kv_cache_dtype"].get<std::string>(), std::string("fp8"));
  CHECK_EQ(j["summary"]["logits_xxh64"].get<std::string>(), std::string("abcdef0123456789"));
  CHECK_EQ(j["summary"]["seconds"]["gpu_wait"].get<double>(), 1.6);
}

// ---- docs/experiments.md's experiments, replayed ----
// With --ignore-eos every request runs to its max_tokens, so the trace depends only on prompt lengths, the
// budgets and the pool size, never on the weights: these replays print the very lines docs/experiments.md quotes from
// H200 runs (the step time aside). If the scheduler changes, these fail and docs/experiments.md needs new excerpts.

static std::string no_ms(std::string s) {
  for (size_t at; (at = s.find(" ms=0.25")) != std::string::npos;) s.erase(at, 8);
  return s;
}

// Runs the requests to the end; lines[i] is step i+1's trace text without its ms.
struct Replay {
  TracedScheduler ts;
  std::vector<std::unique_ptr<Sequence>> seqs;
  std::vector<std::string> lines;
  Replay(const Config& c, const std::vector<int>& prompt_lens, const std::vector<int>& max_tokens,
         bool identical_prompts = false)
      : ts(c) {
    for (size_t i = 0; i < prompt_lens.size(); i++) {
      // distinct prompts share no block, so nothing but the intended prefix can hit
      auto prompt = iota_tokens(prompt_lens[i], identical_prompts ? 0 : 5000 * (int)i);
      seqs.emplace_back(new Sequence((int64_t)i, prompt, params_len(max_tokens[i]), c.kvcache_block_size));
      ts.s.add(seqs.back().get());
    }
    while (!ts.s.is_finished() && lines.size() < 100000) lines.push_back(no_ms(ts.step()));
  }
};

static Config readme_config(int num_blocks, int max_num_batched_tokens = 16384) {
  Config c = small_config(num_blocks, 256);
  c.max_num_batched_tokens = max_num_batched_tokens;
  return c;
}

TEST(readme_prefix_caching) {
  // the same 1100-token prompt twice, admitted in one step: no sharing
  auto same = Replay(readme_config(4508), {1100, 1100}, {4, 4}, true).lines;
  CHECK_EQ(same[0], std::string("[trace] step 1 PREFILL batch=2 tokens=2200 hit=0 waiting=0 running=2 "
                                "free=4498/4508 hashes=0\n"));
  // a 2048-token budget leaves the second for step 2, when the first one's 4 full blocks are hashed
  auto two = Replay(readme_config(4526, 2048), {1100, 1100}, {4, 4}, true).lines;
  CHECK_EQ(two[0], std::string("[trace] step 1 PREFILL batch=1 tokens=1100 hit=0 waiting=1 running=1 "
                               "free=4521/4526 hashes=0\n"));
  CHECK_EQ(two[1], std::string("[trace] step 2 PREFILL batch=1 tokens=76 hit=1024 waiting=0 running=2 "
                               "free=4520/4526 hashes=4\n"));
}

TEST(readme_chunked_prefill) {
  auto l = Replay(readme_config(4527, 1024), {4000}, {16}).lines;
  CHECK_EQ((int)l.size(), 19);
  const char* want[] = {
      "[trace] step 1 PREFILL batch=1 tokens=1024 hit=0 waiting=1 running=0 free=4511/4527 hashes=0\n",
      "[trace] step 2 PREFILL batch=1 tokens=1024 hit=0 waiting=1 running=0 free=4511/4527 hashes=4\n",
      "[trace] step 3 PREFILL batch=1 tokens=1024 hit=0 waiting=1 running=0 free=4511/4527 hashes=8\n",
      "[trace] step 4 PREFILL batch=1 tokens=928 hit=0 waiting=0 running=1 free=4511/4527 hashes=12\n",
      "[trace] step 5 DECODE  batch=1 tokens=1 hit=0 waiting=0 running=1 free=4511/4527 hashes=15\n"};
  for (int i = 0; i < 5 && i < (int)l.size(); i++) CHECK_EQ(l[i], std::string(want[i]));
}

TEST(readme_preemption) {
  Replay r(readme_config(24), std::vector<int>(12, 300), std::vector<int>(12, 700));
  const auto& l = r.lines;
  // the summary the H200 run printed: 6 preemptions, 0 of 7190 admitted tokens hit
  CHECK_EQ(r.ts.s.stats.num_preemptions, (int64_t)6);
  CHECK_EQ(r.ts.s.stats.prefix_hit_tokens, (int64_t)0);
  CHECK_EQ(r.ts.s.stats.prompt_tokens_admitted, (int64_t)7190);
  if (!CHECK_MSG(l.size() == 1187, "%zu steps", l.size())) return;
  CHECK_EQ(l[0],
           std::string("[trace] step 1 PREFILL batch=12 tokens=3600 hit=0 waiting=0 running=12 free=0/24 "
                       "hashes=0\n"));
  CHECK_EQ(l[213],
           std::string("[trace] step 214 DECODE  batch=8 tokens=8 hit=0 waiting=4 running=8 free=0/24 "
                       "hashes=16\n[trace]   preempt seq=11 len=513\n[trace]   preempt seq=10 len=513\n"
                       "[trace]   preempt seq=9 len=513\n[trace]   preempt seq=8 len=513\n"));
  CHECK_EQ(l[469],
           std::string("[trace] step 470 DECODE  batch=6 tokens=6 hit=0 waiting=6 running=6 free=0/24 "
                       "hashes=18\n[trace]   preempt seq=7 len=769\n[trace]   preempt seq=6 len=769\n"));
  CHECK_EQ(l[700], std::string("[trace] step 701 PREFILL batch=6 tokens=3590 hit=0 waiting=0 running=6 "
                               "free=4/24 hashes=3\n"));
}

TEST(readme_continuous_batching) {
  std::vector<int> lens = {278, 172, 82,  213, 204, 171, 73,  132, 118, 180, 228, 296, 131, 280, 234, 230,
                           74,  93,  221, 157, 108, 282, 242, 160, 270, 294, 175, 173, 262, 295, 222, 271};
  std::vector<int> max_tokens = {136, 424, 24,  328, 392, 488, 104, 248, 88,  120, 296,
                                 168, 504, 280, 472, 72,  440, 376, 184, 232, 216, 264,
                                 200, 456, 56,  408, 360, 312, 8,   152, 344, 40};
  auto l = Replay(readme_config(4508), lens, max_tokens).lines;
  if (!CHECK_MSG(l.size() == 504, "%zu steps", l.size())) return;
  CHECK_EQ(l[0], std::string("[trace] step 1 PREFILL batch=32 tokens=6321 hit=0 waiting=0 running=32 "
                             "free=4467/4508 hashes=0\n"));
  CHECK_EQ(l[7], std::string("[trace] step 8 DECODE  batch=32 tokens=32 hit=0 waiting=0 running=32 "
                             "free=4467/4508 hashes=9\n"));
  CHECK_EQ(l[8], std::string("[trace] step 9 DECODE  batch=31 tokens=31 hit=0 waiting=0 running=31 "
                             "free=4469/4508 hashes=9\n"));
  CHECK_EQ(l[503], std::string("[trace] step 504 DECODE  batch=1 tokens=1 hit=0 waiting=0 running=1 "
                               "free=4505/4508 hashes=43\n"));
  // the decode batch only shrinks, one sequence at a time (max_tokens 8, 24, 40, ... 504: every 16 steps)
  std::vector<int> batches;
  for (size_t i = 1; i < l.size(); i++) {
    int b = 0;
    CHECK(sscanf(l[i].c_str() + l[i].find("batch="), "batch=%d", &b) == 1);
    if (batches.empty() || batches.back() != b) batches.push_back(b);
  }
  std::vector<int> want(32);
  for (int i = 0; i < 32; i++) want[i] = 32 - i;
  CHECK(batches == want);
}

// `nanovllm simulate` steps the same code: LLMEngine with SimRunner (section 48) in place of the GPU prints,
// for the workloads of docs/experiments.md (real H200 runs with --ignore-eos), the very trace lines the
// scheduler replays above print, step for step (the step time aside).
static std::vector<std::string> simulated(const Config& base, const std::vector<int>& prompt_lens,
                                          const std::vector<int>& max_tokens, bool identical_prompts = false) {
  Config c = base;
  c.max_model_len = 4096;
  ModelConfig mc;
  qwen3_shape("Qwen3-0.6B", mc);
  SimRunner sim(mc, c, 0, 0.0);
  LLMEngine e(c, sim);
  RunWatcher w;
  w.progress = false, w.trace = true;
  e.observer = &w;
  FILE* f = tmpfile();
  w.trace_out = f;
  std::vector<Request> reqs;
  for (size_t i = 0; i < prompt_lens.size(); i++) {
    Request r;
    r.prompt_token_ids = iota_tokens(prompt_lens[i], identical_prompts ? 0 : 5000 * (int)i);
    r.params = params_len(max_tokens[i]);
    reqs.push_back(r);
  }
  e.generate(reqs);
  rewind(f);
  std::vector<std::string> steps;
  char buf[512];
  while (fgets(buf, sizeof buf, f)) {
    std::string line = buf;
    size_t ms = line.find(" ms=");
    if (ms != std::string::npos) line.erase(ms, line.find('\n', ms) - ms);
    if (line.rfind("[trace] step ", 0) == 0) steps.push_back(line);
    else if (!steps.empty()) steps.back() += line;  // a preemption line belongs to its step
  }
  fclose(f);
  return steps;
}

TEST(simulate_prints_the_real_runs_trace) {
  struct Case { const char* name; Config c; std::vector<int> lens, max_tokens; bool identical; };
  std::vector<int> lens = {278, 172, 82,  213, 204, 171, 73,  132, 118, 180, 228, 296, 131, 280, 234, 230,
                           74,  93,  221, 157, 108, 282, 242, 160, 270, 294, 175, 173, 262, 295, 222, 271};
  std::vector<int> max_tokens = {136, 424, 24,  328, 392, 488, 104, 248, 88,  120, 296,
                                 168, 504, 280, 472, 72,  440, 376, 184, 232, 216, 264,
                                 200, 456, 56,  408, 360, 312, 8,   152, 344, 40};
  std::vector<Case> cases = {
      {"preemption", readme_config(24), std::vector<int>(12, 300), std::vector<int>(12, 700), false},
      {"continuous batching", readme_config(4508), lens, max_tokens, false},
      {"chunked prefill", readme_config(4527, 1024), {4000}, {16}, false},
      {"prefix caching", readme_config(4526, 2048), {1100, 1100}, {4, 4}, true}};
  for (const Case& k : cases) {
    auto want = Replay(k.c, k.lens, k.max_tokens, k.identical).lines;
    auto got = simulated(k.c, k.lens, k.max_tokens, k.identical);
    size_t first_diff = 0;
    while (first_diff < std::min(want.size(), got.size()) && want[first_diff] == got[first_diff]) first_diff++;
    CHECK_MSG(got.size() == want.size() && first_diff == want.size(),
              "%s: %zu simulated steps against %zu; first difference at step %zu:\n%s  against\n%s", k.name,
              got.size(), want.size(), first_diff + 1, first_diff < got.size() ? got[first_diff].c_str() : "",
              first_diff < want.size() ? want[first_diff].c_str() : "");
    printf("    %-20s %zu steps, every trace line the same\n", k.name, got.size());
  }
}

int main(int argc, char** argv) { return test_main(argc, argv); }
