// Host tests of the engine core (sections 3-5): Sequence, BlockManager, Scheduler. No GPU needed.
// Each scenario mirrors one behaviour of nano-vllm bb823b3 that docs/experiments.md shows.
#define NANOVLLM_TESTING
#include "../../nanovllm.cu"
#include "../test.h"
#include "../engine_fixtures.h"


// One engine step with a fake model: every sequence "samples" token 7. Returns the scheduled batch.
static std::vector<Sequence*> fake_step(Scheduler& s, bool& is_prefill, int token = 7) {
  auto seqs = s.schedule(is_prefill);
  std::vector<int> toks(seqs.size(), token);
  s.postprocess(seqs, toks, is_prefill);
  return seqs;
}

// Known answers computed with Python: xxhash.xxh64(prefix.to_bytes(8,'little') + np.array(ids).tobytes())
TEST(block_hash_known_values) {
  auto a_ids = iota_tokens(16);
  uint64_t a = compute_block_hash(a_ids.data(), 16, nullptr);
  CHECK_EQ(a, 50805424035424587ull);
  std::vector<int> b_ids(16, 151643);
  CHECK_EQ(compute_block_hash(b_ids.data(), 16, &a), 2752619069829400484ull);
  std::vector<int> c_ids;
  for (int i = 0; i < 4; i++) c_ids.insert(c_ids.end(), {7, 0, 100000, 3});
  CHECK_EQ(compute_block_hash(c_ids.data(), 16, nullptr), 16646314807505289434ull);
  auto d_ids = iota_tokens(256, 1000), e_ids = iota_tokens(256, 2000);
  uint64_t d = compute_block_hash(d_ids.data(), 256, nullptr);
  CHECK_EQ(d, 12027368365606967808ull);
  CHECK_EQ(compute_block_hash(e_ids.data(), 256, &d), 15159129645399744549ull);
}

// Prefix sharing: a second request with the same prompt, admitted in a later step, hits every full block
// except the last one; two identical prompts in the SAME step do not share (hashes land in postprocess).
TEST(prefix_sharing_across_steps) {
  const int P = 16;
  Scheduler s(small_config(64, P));
  auto prompt = iota_tokens(5 * P + 3);  // 5 full blocks + 3 tokens
  Sequence a(0, prompt, params_len(4), P), b(1, prompt, params_len(4), P), c(2, prompt, params_len(4), P);
  s.add(&a);
  bool pf;
  auto st = fake_step(s, pf);
  CHECK(pf);
  CHECK_EQ((int)st.size(), 1);
  CHECK_EQ(a.num_cached_tokens, 5 * P + 3);
  s.add(&b);
  s.add(&c);
  st = fake_step(s, pf);
  CHECK(pf);
  CHECK_EQ((int)st.size(), 2);
  // Each of b, c found 5 cached blocks (all full prompt blocks; the partial last block is always recomputed).
  CHECK_EQ(s.stats.prefix_hit_tokens, (int64_t)(2 * 5 * P));
  for (int i = 0; i < 5; i++) {
    CHECK_EQ(b.block_table[i], a.block_table[i]);
    CHECK_EQ(c.block_table[i], a.block_table[i]);
    CHECK_EQ(s.block_manager.blocks[a.block_table[i]].ref_count, 3);
  }
  CHECK(b.block_table[5] != a.block_table[5]);
  // Same step, no sharing: two fresh identical prompts admitted together each get their own blocks.
  Scheduler s2(small_config(64, P));
  Sequence x(0, prompt, params_len(2), P), y(1, prompt, params_len(2), P);
  s2.add(&x);
  s2.add(&y);
  fake_step(s2, pf);
  CHECK_EQ(s2.stats.prefix_hit_tokens, (int64_t)0);
  CHECK(x.block_table[0] != y.block_table[0]);
}

// A prompt that is exactly a multiple of P: its last full block is recomputed, never a hit.
TEST(prefix_hit_leaves_last_block) {
  const int P = 16;
  Scheduler s(small_config(32, P));
  auto prompt = iota_tokens(3 * P);
  Sequence a(0, prompt, params_len(1), P), b(1, prompt, params_len(1), P);
  s.add(&a);
  bool pf;
  fake_step(s, pf);
  CHECK(a.is_finished());
  s.add(&b);
  auto st = s.schedule(pf);
  CHECK_EQ(b.num_cached_tokens, 2 * P);  // blocks 0 and 1 hit, block 2 (full, but last) is recomputed
  CHECK_EQ(b.num_scheduled_tokens, P);
  CHECK_EQ(s.stats.prefix_hit_tokens, (int64_t)(2 * P));
}

// A freed block keeps its hash: a later identical prompt revives it from the free list.
TEST(freed_block_revived_as_hit) {
  const int P = 16;
  Scheduler s(small_config(16, P));
  auto prompt = iota_tokens(2 * P + 1);
  Sequence a(0, prompt, params_len(1), P);
  s.add(&a);
  bool pf;
  fake_step(s, pf);
  CHECK(a.is_finished());
  CHECK_EQ(s.block_manager.num_free_blocks(), 16);  // all back in the pool...
  std::vector<int> a_blocks = {0, 1};  // ...but blocks 0 and 1 still hold the prompt's first two blocks
  Sequence b(1, prompt, params_len(1), P);
  s.add(&b);
  fake_step(s, pf);
  CHECK_EQ(s.stats.prefix_hit_tokens, (int64_t)(2 * P));
  CHECK_EQ(b.block_table.size(), (size_t)0);  // finished and released again
  CHECK_EQ(s.block_manager.num_used, 0);
}

// A freed block handed out again loses its hash: the prefix is no longer a hit.
TEST(freed_block_reused_hash_dropped) {
  const int P = 16;
  Scheduler s(small_config(4, P));
  auto prompt = iota_tokens(2 * P + 1);  // needs 3 blocks
  Sequence a(0, prompt, params_len(1), P);
  s.add(&a);
  bool pf;
  fake_step(s, pf);
  CHECK(a.is_finished());
  CHECK_EQ((int)s.block_manager.hash_to_block_id.size(), 2);
  // Free list now: [3, 2, 1, 0] order after reverse release -> oldest first is block 3 (never used), then
  // the released ones. Another prompt of 4 blocks takes all four, so both hashes must disappear.
  Sequence b(1, iota_tokens(4 * P - 1, 5000), params_len(1), P);
  s.add(&b);
  fake_step(s, pf);
  CHECK(b.is_finished());
  bool any_old = false;
  uint64_t h0 = compute_block_hash(prompt.data(), P, nullptr);
  any_old = s.block_manager.hash_to_block_id.count(h0) > 0;
  CHECK(!any_old);
  Sequence c(2, prompt, params_len(1), P);
  s.add(&c);
  int before = (int)s.stats.prefix_hit_tokens;
  fake_step(s, pf);
  CHECK_EQ((int)s.stats.prefix_hit_tokens, before);  // no hit
}

// Chunked prefill: with a budget of 2P, a 5P+5 prompt takes three steps; it joins running only after the
// last chunk, mid-prompt samples are dropped, and only the first sequence of a step is chunked.
TEST(chunked_prefill_small_budget) {
  const int P = 16;
  Scheduler s(small_config(64, P, 2 * P));
  Sequence a(0, iota_tokens(5 * P + 5), params_len(3), P);
  Sequence b(1, iota_tokens(10, 900), params_len(3), P);
  s.add(&a);
  s.add(&b);
  bool pf;
  auto st = fake_step(s, pf);
  CHECK(pf);
  CHECK_EQ((int)st.size(), 1);  // b does not fit behind a's partial chunk
  CHECK_EQ(a.num_cached_tokens, 2 * P);
  CHECK(a.status == SequenceStatus::WAITING);
  CHECK_EQ(a.num_completion_tokens(), 0);  // the sampled token of a mid-prompt chunk is dropped
  st = fake_step(s, pf);
  CHECK_EQ((int)st.size(), 1);
  CHECK_EQ(a.num_cached_tokens, 4 * P);
  CHECK(a.status == SequenceStatus::WAITING);
  st = fake_step(s, pf);  // last chunk (P+5 tokens) then b (10 tokens) fits in 2P=32? 21 + 10 = 31: yes
  CHECK_EQ((int)st.size(), 2);
  CHECK(a.status == SequenceStatus::RUNNING);
  CHECK_EQ(a.num_completion_tokens(), 1);
  CHECK_EQ(b.num_completion_tokens(), 1);
  st = fake_step(s, pf);
  CHECK(!pf);
  CHECK_EQ((int)st.size(), 2);
}

// Preemption: a pool too small for every sequence to grow; the newest running sequence is the victim and
// it is the first to come back.
TEST(preemption_newest_is_victim) {
  const int P = 16;
  Scheduler s(small_config(4, P));
  Sequence a(0, iota_tokens(P), params_len(2 * P), P), b(1, iota_tokens(P, 100), params_len(2 * P), P);
  s.add(&a);
  s.add(&b);
  bool pf;
  fake_step(s, pf);  // both prefilled: 1 block each, len 17 now
  CHECK(pf);
  CHECK_EQ(s.block_manager.num_free_blocks(), 2);
  fake_step(s, pf);  // decode: each needs a 2nd block (len 17 % 16 == 1): pool now empty
  CHECK(!pf);
  CHECK_EQ(s.block_manager.num_free_blocks(), 0);
  CHECK_EQ(s.stats.num_preemptions, (int64_t)0);
  // Run until a preemption happens: at len 33 both need a 3rd block and only one can have it.
  for (int i = 0; i < 40 && s.stats.num_preemptions == 0; i++) fake_step(s, pf);
  CHECK_EQ(s.stats.num_preemptions, (int64_t)1);
  CHECK_EQ(s.last_preempted.size(), (size_t)1);
  CHECK_EQ(s.last_preempted[0].first, (int64_t)1);  // b, the newest, was preempted
  CHECK(b.status == SequenceStatus::WAITING);
  CHECK(b.block_table.empty());
  CHECK_EQ(s.waiting.front(), &b);
  // Drive to completion: both finish with exactly max_tokens.
  for (int i = 0; i < 200 && !s.is_finished(); i++) fake_step(s, pf);
  CHECK(s.is_finished());
  CHECK_EQ(a.num_completion_tokens(), 2 * P);
  CHECK_EQ(b.num_completion_tokens(), 2 * P);
  CHECK_EQ(s.block_manager.num_used, 0);
}

// Continuous batching: the decode batch shrinks as short requests finish; long ones keep going.
TEST(continuous_batching_batch_shrinks) {
  const int P = 16;
  Scheduler s(small_config(64, P));
  std::vector<std::unique_ptr<Sequence>> seqs;
  for (int i = 0; i < 4; i++) {
    seqs.emplace_back(new Sequence(i, iota_tokens(5, 10 * i), params_len(2 + 3 * i), P));
    s.add(seqs.back().get());
  }
  bool pf;
  fake_step(s, pf);
  std::vector<int> batch_sizes;
  while (!s.is_finished()) batch_sizes.push_back((int)fake_step(s, pf).size());
  // max_tokens 2, 5, 8, 11: prefill gives token 1, so decode batches are 4 x1, 3 x3, 2 x3, 1 x3.
  std::vector<int> want = {4, 3, 3, 3, 2, 2, 2, 1, 1, 1};
  CHECK(batch_sizes == want);
  for (int i = 0; i < 4; i++) CHECK_EQ(seqs[i]->num_completion_tokens(), 2 + 3 * i);
}

// The len % P == 1 boundary: a decode step takes a new block exactly when the token it stores opens one.
TEST(append_boundary_len_mod_p_is_1) {
  const int P = 16;
  Scheduler s(small_config(8, P));
  Sequence a(0, iota_tokens(P - 1), params_len(P + 3), P);
  s.add(&a);
  bool pf;
  fake_step(s, pf);  // prefill: 15 tokens in block 0, then token 16 appended (len 16)
  CHECK_EQ(a.block_table.size(), (size_t)1);
  fake_step(s, pf);  // stores token at position 15 (slot 15 of block 0), len 17
  CHECK_EQ(a.block_table.size(), (size_t)1);
  CHECK_EQ(a.size() % P, 1);
  CHECK(s.block_manager.can_append(a));
  fake_step(s, pf);  // len 17 % 16 == 1: position 16 opens block 1
  CHECK_EQ(a.block_table.size(), (size_t)2);
  // The first block became full during decode and was hashed (decode tokens are cacheable too).
  CHECK(s.block_manager.blocks[a.block_table[0]].has_hash);
}

// Randomized: random prompts, lengths, budgets and pool sizes with a fake runner. Checks the invariants
// after every step: no leaks, ref counts equal the block tables holding each block, free + used = total,
// every request ends with exactly max_tokens tokens (ignore_eos).
static void random_run(uint64_t seed, int steps_target, int* steps_done) {
  std::mt19937_64 rng(seed);
  auto uni = [&](int lo, int hi) { return (int)(lo + rng() % (uint64_t)(hi - lo + 1)); };
  int P = 1 << uni(4, 6);
  int max_len = uni(2 * P, 8 * P);
  int num_blocks = (int)cdiv(max_len, P) + uni(0, 24);
  Config c = small_config(num_blocks, P, uni(P, 4 * max_len), uni(1, 16));
  Scheduler s(c);
  std::vector<std::unique_ptr<Sequence>> seqs;
  // A few shared prefixes so prefix caching is exercised.
  std::vector<std::vector<int>> prefixes;
  for (int i = 0; i < 3; i++) prefixes.push_back(iota_tokens(uni(1, 3 * P), 1000 * i));
  int next_id = 0, steps = 0;
  while (steps < steps_target) {
    if (seqs.size() < 200 && (s.is_finished() || uni(0, 3) == 0)) {
      int n_new = uni(1, 4);
      for (int k = 0; k < n_new; k++) {
        std::vector<int> prompt = uni(0, 1) ? prefixes[uni(0, 2)] : std::vector<int>();
        int extra = uni(1, max_len / 2);
        for (int t = 0; t < extra; t++) prompt.push_back(uni(0, 50));
        if ((int)prompt.size() >= max_len) prompt.resize(max_len - 1);
        int max_tokens = uni(1, max_len - (int)prompt.size());
        seqs.emplace_back(new Sequence(next_id++, prompt, params_len(max_tokens), P));
        s.add(seqs.back().get());
      }
    }
    if (s.is_finished()) break;  // no more requests to add
    bool pf;
    auto batch = s.schedule(pf);
    std::vector<int> toks(batch.size());
    for (auto& t : toks) t = uni(0, 60);
    int total_sched = 0;
    for (auto* q : batch) total_sched += q->num_scheduled_tokens;
    if (pf && !CHECK_MSG(total_sched <= c.max_num_batched_tokens, "seed %llu", (unsigned long long)seed)) return;
    s.postprocess(batch, toks, pf);
    steps++;
    // Invariants.
    BlockManager& bm = s.block_manager;
    std::vector<int> refs(num_blocks, 0);
    for (auto& q : seqs)
      for (int id : q->block_table) refs[id]++;
    int used = 0;
    for (int i = 0; i < num_blocks; i++) {
      if (!CHECK_MSG(refs[i] == bm.blocks[i].ref_count, "seed %llu step %d block %d: %d tables, ref_count %d",
                     (unsigned long long)seed, steps, i, refs[i], bm.blocks[i].ref_count))
        return;
      used += refs[i] > 0;
    }
    if (!CHECK_MSG(used == bm.num_used && used + bm.num_free_blocks() == num_blocks,
                   "seed %llu: used %d num_used %d free %d total %d", (unsigned long long)seed, used, bm.num_used,
                   bm.num_free_blocks(), num_blocks))
      return;
    for (auto& q : seqs) {
      if (q->status == SequenceStatus::RUNNING &&
          !CHECK_MSG((int)q->block_table.size() >= (int)cdiv(q->num_cached_tokens, P), "seed %llu",
                     (unsigned long long)seed))
        return;
    }
  }
  // Drain, then every request must have exactly max_tokens completion tokens and no block may be held.
  int guard = 0;
  while (!s.is_finished() && guard++ < 1000000) {
    bool pf;
    auto batch = s.schedule(pf);
    std::vector<int> toks(batch.size(), 3);
    s.postprocess(batch, toks, pf);
    steps++;
  }
  CHECK(s.is_finished());
  for (auto& q : seqs)
    CHECK_MSG(q->is_finished() && q->num_completion_tokens() == q->params.max_tokens,
              "seed %llu seq %lld: %d of %d tokens", (unsigned long long)seed, (long long)q->seq_id,
              q->num_completion_tokens(), q->params.max_tokens);
  CHECK_EQ(s.block_manager.num_used, 0);
  CHECK_EQ(s.block_manager.num_free_blocks(), num_blocks);
  *steps_done += steps;
}

TEST(randomized_scheduler_invariants) {
  int steps = 0;
  int before = g_test_failures;
  for (uint64_t seed = 1; seed <= 40 && g_test_failures == before; seed++) random_run(seed, 400, &steps);
  printf("    %d steps over 40 seeds\n", steps);
  CHECK(steps >= 10000);
}

int main(int argc, char** argv) { return test_main(argc, argv); }
