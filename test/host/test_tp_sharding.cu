// Tensor-parallel sharding arithmetic (nanovllm.cu section 2: tp_shard, tp_shard_problem; section 6a:
// weight_elements; section 6b: kv_block_bytes), for every N from 1 to 8 on every Qwen3 shape of REFERENCE.md
// section 5, and the experts of the MoE shapes of its section 14 (each expert's IE split like the dense MLP's
// I, the router whole on every rank). No GPU: these are the numbers load_weights slices the checkpoint by, so
// a wrong one would load the wrong rows on 4 or 8 GPUs, which no machine here can run (test/gpu/gpu_moe.cu
// checks the loader's experts at --tp 1 and as rank 1 of 2 against the file).
#define NANOVLLM_TESTING
#include "../../nanovllm.cu"
#include "../test.h"

struct Shape {
  const char* name;
  int H, I, L, NH, NKV;
  bool tied;
};
static const Shape kShapes[] = {
    {"Qwen3-0.6B", 1024, 3072, 28, 16, 8, true},   {"Qwen3-1.7B", 2048, 6144, 28, 16, 8, true},
    {"Qwen3-4B", 2560, 9728, 36, 32, 8, true},     {"Qwen3-8B", 4096, 12288, 36, 32, 8, false},
    {"Qwen3-14B", 5120, 17408, 40, 40, 8, false},  {"Qwen3-32B", 5120, 25600, 64, 64, 8, false},
};

static ModelConfig model_of(const Shape& s, int vocab = 151936) {
  ModelConfig m;
  m.hidden_size = s.H, m.intermediate_size = s.I, m.num_hidden_layers = s.L;
  m.num_attention_heads = s.NH, m.num_key_value_heads = s.NKV, m.head_dim = 128;
  m.vocab_size = vocab, m.max_position_embeddings = 40960, m.tie_word_embeddings = s.tied;
  return m;
}

// Every Qwen3 dense model has 8 KV heads, so exactly the divisors of 8 split it.
TEST(valid_sizes_are_the_divisors_of_the_kv_heads) {
  for (const Shape& s : kShapes) {
    ModelConfig m = model_of(s);
    for (int n = 1; n <= 8; n++) {
      bool want = n == 1 || n == 2 || n == 4 || n == 8;
      std::string problem = tp_shard_problem(m, n);
      CHECK_MSG(problem.empty() == want, "%s at N = %d: valid %d, expected %d (%s)", s.name, n, problem.empty(),
                want, problem.c_str());
      if (!want) CHECK_MSG(problem.find(std::to_string(n)) != std::string::npos, "%s", problem.c_str());
    }
    CHECK(!tp_shard_problem(m, 0).empty());
    CHECK(!tp_shard_problem(m, 16).empty());  // divides everything, but more than 8 ranks are refused
  }
}

// Made-up shapes: each rule fires on its own and names the numbers a user can act on.
TEST(each_divisibility_rule_is_checked) {
  ModelConfig m = model_of(kShapes[0]);
  m.num_attention_heads = 12, m.num_key_value_heads = 4;  // 4 ranks can split it, 8 cannot
  CHECK(tp_shard_problem(m, 4).empty());
  CHECK(tp_shard_problem(m, 8).find("query heads (12)") != std::string::npos);
  m.num_attention_heads = 16, m.num_key_value_heads = 8, m.intermediate_size = 1032;  // 1032 / 2 = 516: not x8
  CHECK(tp_shard_problem(m, 1).empty());
  CHECK(tp_shard_problem(m, 2).find("intermediate_size (1032)") != std::string::npos);
}

// For every shape and valid N, the ranks' slices tile every split dimension exactly, in rank order.
TEST(rank_slices_tile_heads_mlp_and_vocab) {
  for (const Shape& s : kShapes) {
    ModelConfig m = model_of(s);
    for (int n : {1, 2, 4, 8}) {
      int64_t q_next = 0, kv_next = 0, i_next = 0, v_next = 0;
      for (int r = 0; r < n; r++) {
        TPShard sh = tp_shard(m, r, n);
        CHECK_MSG(sh.q_head0 == q_next && sh.kv_head0 == kv_next && sh.inter0 == i_next,
                  "%s N=%d rank %d: starts %lld/%lld/%lld", s.name, n, r, (long long)sh.q_head0,
                  (long long)sh.kv_head0, (long long)sh.inter0);
        CHECK_MSG(sh.q_heads * n == s.NH && sh.kv_heads * n == s.NKV && sh.inter * n == s.I,
                  "%s N=%d: %lld q heads, %lld kv heads, %lld columns per rank", s.name, n,
                  (long long)sh.q_heads, (long long)sh.kv_heads, (long long)sh.inter);
        CHECK_MSG(sh.q_heads % sh.kv_heads == 0, "%s N=%d: GQA groups split across ranks", s.name, n);
        CHECK(sh.inter % 8 == 0);  // silu_and_mul's 16-byte vectors
        CHECK_MSG(sh.vocab0 == v_next || sh.vocab_rows == 0, "%s N=%d rank %d: vocab starts at %lld", s.name, n, r,
                  (long long)sh.vocab0);
        q_next += sh.q_heads, kv_next += sh.kv_heads, i_next += sh.inter, v_next += sh.vocab_rows;
      }
      CHECK_EQ(q_next, (int64_t)s.NH);
      CHECK_EQ(kv_next, (int64_t)s.NKV);
      CHECK_EQ(i_next, (int64_t)s.I);
      CHECK_EQ(v_next, (int64_t)m.vocab_size);
    }
  }
}

// A vocabulary that does not divide: the last rank is short and its padding rows are zeros, never ids.
TEST(vocab_shards_cover_an_odd_vocabulary) {
  for (int V : {151936, 151643, 1001, 7, 8}) {
    ModelConfig m = model_of(kShapes[0], V);
    for (int n = 1; n <= 8; n++) {
      int64_t covered = 0;
      bool short_seen = false;  // once a rank is short, the ranks after it hold padding only
      for (int r = 0; r < n; r++) {
        TPShard sh = tp_shard(m, r, n);
        CHECK_EQ(sh.vocab, cdiv(V, n));  // every rank's table and logits have the same shape
        CHECK(sh.vocab_rows >= 0 && sh.vocab_rows <= sh.vocab);
        CHECK_MSG(!short_seen || sh.vocab_rows == 0, "V=%d N=%d rank %d has ids after a short rank", V, n, r);
        short_seen |= sh.vocab_rows < sh.vocab;
        if (sh.vocab_rows) CHECK_EQ(sh.vocab0, covered);
        covered += sh.vocab_rows;
      }
      CHECK_MSG(covered == V, "V=%d N=%d: shards cover %lld ids", V, n, (long long)covered);
    }
  }
}

// Summed over the ranks, the weight arenas hold the whole model once (plus the vocabulary padding), and
// at N = 1 exactly the parameter count of the checkpoint; one rank's KV block is 1/N of the whole.
TEST(rank_arenas_sum_to_the_model) {
  for (const Shape& s : kShapes) {
    ModelConfig m = model_of(s);
    const int64_t H = s.H, D = 128, V = m.vocab_size;
    int64_t params = (int64_t)s.L * (2 * H + (s.NH + 2 * s.NKV) * D * H + 2 * D + H * s.NH * D + 3 * (int64_t)s.I * H) +
                     V * H * (s.tied ? 1 : 2) + H;
    for (int n : {1, 2, 4, 8}) {
      int64_t sum = 0;
      for (int r = 0; r < n; r++) sum += weight_elements(m, tp_shard(m, r, n));
      // Replicated per rank: the norms (2H per layer, q/k norms 2D per layer, the final H).
      int64_t replicated = (int64_t)(n - 1) * (s.L * (2 * H + 2 * D) + H);
      int64_t pad = (cdiv(V, n) * n - V) * H * (s.tied ? 1 : 2);
      CHECK_MSG(sum == params + replicated + pad, "%s N=%d: %lld elements over the ranks, expected %lld", s.name, n,
                (long long)sum, (long long)(params + replicated + pad));
      for (int P : {16, 256})
        CHECK_EQ(kv_block_bytes(m, P, n) * n, kv_block_bytes(m, P, 1));
    }
    if (std::string(s.name) == "Qwen3-8B") CHECK_EQ(params, (int64_t)8190735360);  // the published 8.19 B
  }
}

// The MoE shapes (section 48's qwen3_shape): which N split them (their 4 KV heads: 1, 2 and 4), each rank's
// slice of every expert's IE in rank order, and the arenas adding up to the model once, plus what every rank
// holds whole (the norms and the routers) and the vocabulary padding.
TEST(moe_experts_split_like_the_dense_mlp) {
  for (const char* name : {"Qwen3-30B-A3B", "Qwen3-235B-A22B"}) {
    ModelConfig m;
    CHECK(qwen3_shape(name, m));
    for (int n = 1; n <= 8; n++) {
      const bool want = n == 1 || n == 2 || n == 4;
      CHECK_MSG(tp_shard_problem(m, n).empty() == want, "%s at N = %d: '%s'", name, n, tp_shard_problem(m, n).c_str());
    }
    const int64_t H = m.hidden_size, L = m.num_hidden_layers, E = m.num_experts, IE = m.moe_intermediate_size;
    const int64_t V = m.vocab_size, D = 128;
    for (int n : {1, 2, 4}) {
      int64_t next = 0, sum = 0;
      for (int r = 0; r < n; r++) {
        const TPShard s = tp_shard(m, r, n);
        CHECK_EQ(s.moe_inter0, next);
        CHECK_EQ(s.moe_inter * n, IE);
        CHECK(s.moe_inter % 8 == 0);  // silu_and_mul's 16-byte vectors
        next += s.moe_inter;
        sum += weight_elements(m, s);
      }
      CHECK_EQ(next, IE);
      const int64_t replicated = (int64_t)(n - 1) * (L * (2 * H + 2 * D + E * H) + H);
      const int64_t pad = (cdiv(V, n) * n - V) * H * 2;
      CHECK_MSG(sum == model_params(m) + replicated + pad, "%s N=%d: %lld elements over the ranks, expected %lld",
                name, n, (long long)sum, (long long)(model_params(m) + replicated + pad));
    }
    // Without the layers' four matrices (a chapter that loads them itself): a MoE layer's experts are left out
    // too, its router stays.
    const TPShard one = tp_shard(m, 0, 1);
    CHECK_EQ(weight_elements(m, one) - weight_elements(m, one, false),
             L * (H * (m.num_attention_heads + 2 * m.num_key_value_heads) * D + m.num_attention_heads * D * H) +
                 (L - m.num_moe_layers()) * 3 * H * (int64_t)m.intermediate_size +
                 m.num_moe_layers() * (int64_t)m.num_experts * 3 * H * m.moe_intermediate_size);
  }
  // Each rule on its own: moe_intermediate_size that splits into slices that are not multiples of 8 is refused
  // by name, and a model whose layers are all MoE layers needs no intermediate_size that splits.
  ModelConfig m;
  qwen3_shape("Qwen3-30B-A3B", m);
  m.moe_intermediate_size = 776;  // / 2 = 388, not a multiple of 8
  CHECK(tp_shard_problem(m, 1).empty());
  CHECK_MSG(tp_shard_problem(m, 2).find("moe_intermediate_size (776)") != std::string::npos, "%s",
            tp_shard_problem(m, 2).c_str());
  qwen3_shape("Qwen3-30B-A3B", m);
  m.intermediate_size = 6152;  // / 2 = 3076, not a multiple of 8
  CHECK(tp_shard_problem(m, 2).empty());
  m.mlp_only_layers = {5};  // now one layer is dense
  CHECK(tp_shard_problem(m, 2).find("intermediate_size (6152)") != std::string::npos);
}

int main(int argc, char** argv) { return test_main(argc, argv); }
