// The Scheduler and BlockManager (nanovllm.cu sections 4 and 5) under adversarial load, for 10^5 steps and
// more per scenario, with a fake model that keeps a shadow KV cache. No GPU.
//
// The fake model is what makes this test able to fail on the property that matters: that every position a
// step attends to holds the K/V of exactly this sequence's prefix, whatever preemption, prefix sharing and
// block reuse did before. It stores, per KV slot, a value that stands for "the K/V at this position":
//     kv(pos) = mix(kv(pos - 1) read FROM THE SHADOW CACHE, token[pos])      (kv(-1) = a constant)
// and samples the next token from the cache slot of the last position it computed. A slot that holds
// anything else (another sequence's K/V, a stale block, an unwritten slot) changes the generated tokens,
// and the final completions are compared with each request computed alone, from its own tokens.
// Besides that end-to-end check, every step checks directly:
//   - every slot read (positions below num_cached_tokens) holds this sequence's value for that position;
//   - a step never writes into a block another sequence holds (ref_count > 1);
//   - each block's ref_count equals the number of block tables holding it, used + free = pool, no leaks;
//   - every shared block holds the same tokens in each table that holds it, and a hashed block's stored
//     tokens are the tokens of each sequence holding it at that position;
//   - the step stays within max_num_seqs and max_num_batched_tokens, and is never empty while work remains;
//   - under the mixed scheduler, the sequences that were decoding lead the step (section 16's decode rows).
#define NANOVLLM_TESTING
#include "../../nanovllm.cu"
#include "../test.h"
#include "../engine_fixtures.h"

static uint64_t kv_mix(uint64_t prev, int token) {
  return splitmix64(prev ^ (0x9e3779b97f4a7c15ull * (uint64_t)(token + 1)));
}
static const uint64_t KV_START = 0x5eed5eed5eed5eedull;
static const uint64_t KV_POISON = 0;  // what an unwritten slot holds (kv_mix never returns it in practice)
static const int FAKE_VOCAB = 64;

// The token sampled after a position whose K/V value is v. EOS now and then (1 in 61), for requests that
// do not ignore it.
static int fake_sample(uint64_t v, int eos) { return v % 61 == 0 ? eos : (int)((v >> 8) % FAKE_VOCAB); }

// A request computed alone: prompt, then tokens until max_tokens or EOS. What the engine must produce.
static std::vector<int> reference_completion(const std::vector<int>& prompt, const SamplingParams& sp,
                                             int eos) {
  uint64_t v = KV_START;
  for (int t : prompt) v = kv_mix(v, t);
  std::vector<int> out;
  while ((int)out.size() < sp.max_tokens) {
    int t = fake_sample(v, eos);
    out.push_back(t);
    if (!sp.ignore_eos && t == eos) break;
    v = kv_mix(v, t);
  }
  return out;
}

struct Scenario {
  const char* name;
  int block_size = 16;
  int max_len = 256;    // prompt + max_tokens of any request (the engine's max_model_len)
  int num_blocks = 16;  // the pool
  int max_num_seqs = 16;
  int budget = 16384;      // max_num_batched_tokens
  int prompt_pool = 0;     // > 0: every prompt starts with one of this many fixed prompts
  bool identical = false;  // prompts are exactly one of the fixed prompts (no random tail)
  int block_alphabet = 0;  // > 0: prompts are whole blocks drawn from this many distinct P-token blocks
  int max_waiting = 64;    // new requests arrive while fewer than this are unfinished
  bool mixed = false;      // vLLM V1's scheduler (section 5b) instead of nano-vllm's
};

struct StressResult {
  int64_t steps = 0, prefill_steps = 0, decode_steps = 0, preemptions = 0, hit_tokens = 0, requests = 0;
  int64_t steps_at_most_one_free = 0, shared_block_steps = 0;
};

// Runs `steps_target` steps of `sc` with seed `seed`, then drains. Returns false after the first failure.
static bool stress_run(const Scenario& sc, uint64_t seed, int64_t steps_target, StressResult& res) {
  std::mt19937_64 rng(seed);
  auto uni = [&](int lo, int hi) { return (int)(lo + rng() % (uint64_t)(hi - lo + 1)); };
  const int P = sc.block_size;
  Config c = small_config(sc.num_blocks, P, sc.budget, sc.max_num_seqs);
  c.mixed_scheduler = sc.mixed;
  const int eos = c.eos[0];
  Scheduler s(c);
  BlockManager& bm = s.block_manager;
  std::vector<uint64_t> shadow((size_t)sc.num_blocks * P, KV_POISON);
  auto slot = [&](const Sequence& q, int pos) { return (size_t)q.block_table[pos / P] * P + pos % P; };

  std::vector<std::vector<int>> fixed;  // the shared prompts; lengths hit the block-boundary cases
  for (int i = 0; i < sc.prompt_pool; i++) {
    int len = uni(0, 2) == 0 ? P * uni(1, 3) : uni(1, sc.max_len / 2);  // exact multiples of P, often
    std::vector<int> p(len);
    for (auto& t : p) t = uni(0, FAKE_VOCAB - 1);
    fixed.push_back(p);
  }
  std::vector<std::vector<int>> alphabet(sc.block_alphabet, std::vector<int>(P));
  for (auto& blk : alphabet)
    for (auto& t : blk) t = uni(0, FAKE_VOCAB - 1);
  std::vector<std::unique_ptr<Sequence>> seqs;
  std::vector<std::vector<int>> expected;
  auto add_request = [&] {
    std::vector<int> prompt;
    if (!fixed.empty()) prompt = fixed[uni(0, (int)fixed.size() - 1)];
    for (int k = sc.block_alphabet ? uni(1, sc.max_len / P - 1) : 0; k > 0; k--) {
      const std::vector<int>& blk = alphabet[uni(0, sc.block_alphabet - 1)];
      prompt.insert(prompt.end(), blk.begin(), blk.end());
    }
    if ((fixed.empty() && !sc.block_alphabet) || (!sc.identical && uni(0, 1)))
      for (int k = uni(1, sc.max_len / 2); k > 0; k--) prompt.push_back(uni(0, FAKE_VOCAB - 1));
    if ((int)prompt.size() >= sc.max_len) prompt.resize(sc.max_len - 1);
    SamplingParams sp = params_len(uni(1, sc.max_len - (int)prompt.size()));
    sp.ignore_eos = uni(0, 3) != 0;
    expected.push_back(reference_completion(prompt, sp, eos));
    seqs.emplace_back(new Sequence((int64_t)seqs.size(), prompt, sp, P));
    s.add(seqs.back().get());
  };
  auto fail = [&](const char* what, int64_t id) {
    return CHECK_MSG(false, "%s, seed %llu, step %lld, seq %lld: %s", sc.name, (unsigned long long)seed,
                     (long long)res.steps, (long long)id, what);
  };

  int64_t steps = 0;
  while (true) {
    int unfinished = 0;
    for (auto& q : seqs) unfinished += !q->is_finished();
    if (steps < steps_target)
      while (unfinished < sc.max_waiting && uni(0, 2) != 0) add_request(), unfinished++;
    if (s.is_finished()) {
      if (steps >= steps_target) break;
      continue;
    }
    bool pf;
    const std::set<const Sequence*> was_running(s.running.begin(), s.running.end());
    std::vector<Sequence*> batch = s.schedule(pf);
    steps++, res.steps++;
    pf ? res.prefill_steps++ : res.decode_steps++;
    res.preemptions += (int64_t)s.last_preempted.size();
    res.hit_tokens += s.last_cached_tokens;
    res.steps_at_most_one_free += bm.num_free_blocks() <= 1;
    if (batch.empty()) return fail("empty step while work remains", -1);
    if ((int)batch.size() > sc.max_num_seqs) return fail("more sequences than max_num_seqs", -1);
    int64_t tokens = 0;
    for (auto* q : batch) tokens += q->num_scheduled_tokens;
    if ((pf || sc.mixed) && tokens > sc.budget) return fail("a step over max_num_batched_tokens", -1);
    // Section 16 runs a step's leading one-token rows as decode rows: every running sequence with one token
    // left must be among them (the mixed scheduler serves the running ones first, and a running one mid-prompt,
    // or recomputing after a preemption, is the newest that got tokens: the budget ran out on it).
    size_t lead = 0;
    while (lead < batch.size() && batch[lead]->num_scheduled_tokens == 1) lead++;
    for (size_t b = lead; b < batch.size(); b++)
      if (sc.mixed && was_running.count(batch[b]) && has_one_token_left(*batch[b]))
        return fail("a decoding sequence after a prompt chunk", batch[b]->seq_id);

    // The fake forward pass: read the context, write this step's positions, sample.
    std::vector<int> sampled(batch.size(), -1);
    for (size_t b = 0; b < batch.size(); b++) {
      Sequence& q = *batch[b];
      int first = q.num_cached_tokens, n = q.num_scheduled_tokens;
      if (n < 1 || first + n > q.num_tokens) return fail("scheduled tokens out of range", q.seq_id);
      if ((int)q.block_table.size() < (int)cdiv(first + n, P)) return fail("block table too short", q.seq_id);
      uint64_t v = KV_START;
      for (int pos = 0; pos < first; pos++) {  // what attention reads
        v = kv_mix(v, q.token_ids[pos]);
        if (shadow[slot(q, pos)] != v) {
          char what[96];
          snprintf(what, sizeof what, "cached position %d (block %d) holds another prefix's K/V", pos,
                   q.block_table[pos / P]);
          return fail(what, q.seq_id);
        }
      }
      for (int pos = first; pos < first + n; pos++) {  // what this step writes
        if (bm.blocks[q.block_table[pos / P]].ref_count != 1)
          return fail("write into a shared block", q.seq_id);
        uint64_t prev = pos == 0 ? KV_START : shadow[slot(q, pos - 1)];
        shadow[slot(q, pos)] = kv_mix(prev, q.token_ids[pos]);
      }
      sampled[b] = fake_sample(shadow[slot(q, first + n - 1)], eos);
    }
    s.postprocess(batch, sampled, pf);

    // The block pool's bookkeeping, after every step.
    std::vector<int> refs(sc.num_blocks, 0);
    std::vector<const Sequence*> holder(sc.num_blocks, nullptr);
    std::vector<int> holder_index(sc.num_blocks, -1);
    bool shared = false;
    for (auto& q : seqs) {
      for (int i = 0; i < (int)q->block_table.size(); i++) {
        int id = q->block_table[i];
        if (refs[id]++ == 0) {
          holder[id] = q.get(), holder_index[id] = i;
          continue;
        }
        shared = true;  // two tables hold block id: it must be a full block with the same tokens in both
        const Sequence& o = *holder[id];
        if (holder_index[id] != i || q->block_len(i) != P || o.block_len(i) != P ||
            !std::equal(q->block(i), q->block(i) + P, o.block(i)))
          return fail("a block shared by sequences whose tokens differ", q->seq_id);
      }
      for (int i = 0; i < (int)q->block_table.size(); i++) {
        const Block& blk = bm.blocks[q->block_table[i]];
        if (blk.has_hash && i < q->num_cached_blocks() &&
            !std::equal(blk.token_ids.begin(), blk.token_ids.end(), q->block(i)))
          return fail("a hashed block whose stored tokens are not this sequence's", q->seq_id);
      }
    }
    res.shared_block_steps += shared;
    int used = 0;
    for (int i = 0; i < sc.num_blocks; i++) {
      if (refs[i] != bm.blocks[i].ref_count) return fail("ref_count differs from the block tables", -1);
      used += refs[i] > 0;
    }
    if (used != bm.num_used || used + bm.num_free_blocks() != sc.num_blocks) return fail("blocks leaked", -1);
    for (auto& [h, id] : bm.hash_to_block_id)
      if (!bm.blocks[id].has_hash) return fail("the prefix cache names a block without a hash", -1);
    if (steps > 50 * steps_target + 100000) return fail("no end in sight: the run does not drain", -1);
  }
  // Every request, computed alone, gives the same tokens; no block is held at the end.
  for (size_t i = 0; i < seqs.size(); i++) {
    const Sequence& q = *seqs[i];
    std::vector<int> got(q.token_ids.begin() + q.num_prompt_tokens, q.token_ids.end());
    if (!q.is_finished() || got != expected[i])
      return fail("completion differs from the request run alone", q.seq_id);
  }
  res.requests += (int64_t)seqs.size();
  if (bm.num_used != 0 || bm.num_free_blocks() != sc.num_blocks)
    return fail("blocks held after the drain", -1);
  return true;
}

static StressResult run_scenario(const Scenario& sc, int seeds, int64_t steps_per_seed) {
  StressResult r;
  for (int seed = 1; seed <= seeds; seed++)
    if (!stress_run(sc, (uint64_t)seed * 7919 + sc.max_len, steps_per_seed, r)) break;
  printf(
      "    %-34s %7lld steps (%lld prefill, %lld decode), %lld requests, %lld preemptions, %lld prefix-hit "
      "tokens, %lld steps with <= 1 free block, %lld with shared blocks\n",
      sc.name, (long long)r.steps, (long long)r.prefill_steps, (long long)r.decode_steps,
      (long long)r.requests, (long long)r.preemptions, (long long)r.hit_tokens,
      (long long)r.steps_at_most_one_free, (long long)r.shared_block_steps);
  return r;
}

// The smallest pool the engine accepts: exactly one max_model_len sequence. Sixteen sequences compete for it,
// so nearly every decode step preempts and the free list sits at zero or one block.
TEST(one_free_block) {
  Scenario sc;
  sc.name = "one max_len of blocks, 16 seqs";
  sc.max_len = 128, sc.num_blocks = 128 / 16, sc.max_num_seqs = 16;
  StressResult r = run_scenario(sc, 10, 10000);
  CHECK(r.steps >= 100000);
  CHECK(r.preemptions >= 1000);
  CHECK(r.steps_at_most_one_free >= r.steps / 2);  // the pool is nearly always full
}

// Every prompt is one of three fixed prompts (some an exact multiple of P, the case where the last full block
// must still be recomputed): hits, shared blocks, revived free blocks and preemption together.
TEST(many_identical_prefixes) {
  Scenario sc;
  sc.name = "identical prompts, tight pool";
  sc.max_len = 192, sc.num_blocks = 192 / 16 + 4, sc.max_num_seqs = 16;
  sc.prompt_pool = 3, sc.identical = true;
  StressResult r = run_scenario(sc, 10, 10000);
  CHECK(r.steps >= 100000);
  CHECK(r.hit_tokens > 0 && r.shared_block_steps > 0 && r.preemptions > 0);
}

// Shared prefixes with random tails, and a token budget of one block: every prompt is chunked, chunks meet
// prefix hits and preemption.
TEST(chunked_prefill_shared_prefixes) {
  Scenario sc;
  sc.name = "shared prefixes, budget = P";
  sc.max_len = 256, sc.num_blocks = 256 / 16 + 8, sc.max_num_seqs = 8, sc.budget = 16;
  sc.prompt_pool = 4;
  StressResult r = run_scenario(sc, 10, 10000);
  CHECK(r.steps >= 100000);
  CHECK(r.hit_tokens > 0 && r.preemptions > 0);
}

// Prompts made of whole blocks from an alphabet of two: the same block content sits after many different
// prefixes, so a prefix cache keyed on a block alone (not chained to the blocks before it) would serve the
// wrong K/V. Half the prompts end on a block boundary.
TEST(same_blocks_after_different_prefixes) {
  Scenario sc;
  sc.name = "two-block alphabet, tight pool";
  sc.max_len = 160, sc.num_blocks = 160 / 16 + 6, sc.max_num_seqs = 16;
  sc.block_alphabet = 2;
  StressResult r = run_scenario(sc, 10, 10000);
  CHECK(r.steps >= 100000);
  CHECK(r.hit_tokens > 0 && r.shared_block_steps > 0 && r.preemptions > 0);
}

// The same adversarial loads under vLLM V1's mixed scheduler (section 5b): decode tokens and prompt chunks in
// one step, running sequences mid-prompt, preemption of the newest when a block is missing. Every check above
// holds: every slot read was written by this sequence's prefix, every completion equals the request run alone.
TEST(mixed_scheduler_one_free_block) {
  Scenario sc;
  sc.name = "mixed: one max_len of blocks";
  sc.max_len = 128, sc.num_blocks = 128 / 16, sc.max_num_seqs = 16, sc.mixed = true;
  StressResult r = run_scenario(sc, 10, 10000);
  CHECK(r.steps >= 100000);
  CHECK(r.preemptions >= 1000);
}

TEST(mixed_scheduler_chunks_and_shared_prefixes) {
  Scenario sc;
  sc.name = "mixed: shared prefixes, budget = P";
  sc.max_len = 256, sc.num_blocks = 256 / 16 + 8, sc.max_num_seqs = 8, sc.budget = 16, sc.mixed = true;
  sc.prompt_pool = 4;
  StressResult r = run_scenario(sc, 10, 10000);
  CHECK(r.steps >= 100000);
  CHECK(r.hit_tokens > 0 && r.preemptions > 0);
}

TEST(mixed_scheduler_identical_prefixes_and_block_alphabet) {
  Scenario a;
  a.name = "mixed: identical prompts, tight pool";
  a.max_len = 192, a.num_blocks = 192 / 16 + 4, a.max_num_seqs = 16, a.budget = 64, a.mixed = true;
  a.prompt_pool = 3, a.identical = true;
  StressResult ra = run_scenario(a, 10, 10000);
  CHECK(ra.hit_tokens > 0 && ra.shared_block_steps > 0 && ra.preemptions > 0);
  Scenario b;
  b.name = "mixed: two-block alphabet";
  b.max_len = 160, b.num_blocks = 160 / 16 + 6, b.max_num_seqs = 16, b.budget = 48, b.mixed = true;
  b.block_alphabet = 2;
  StressResult rb = run_scenario(b, 10, 10000);
  CHECK(rb.hit_tokens > 0 && rb.shared_block_steps > 0 && rb.preemptions > 0);
}

int main(int argc, char** argv) { return test_main(argc, argv); }
