// Qwen3-MoE (Qwen3MoeForCausalLM) on the host, in the order nanovllm.cu reads it:
//   section 37: config.json's expert fields (Qwen3-30B-A3B's as published, transformers' defaults) and each
//     refusal; section 2's ModelConfig::is_moe_layer against transformers' rule; the trip to the
//     tensor-parallel workers (section 12's model_config_to_json);
//   section 6a: checkpoint_tensors of a MoE model (the router, each expert, dense layers of mlp_only_layers,
//     a block-quantized checkpoint's experts with their scales and the router without), validate_checkpoint
//     on the tiny MoE folder test/ref/make_tiny_checkpoint.py --moe writes and on its moe_ breaks, and on
//     files written here (an expert's tensor missing or mis-shaped); (the experts' tensor-parallel slices:
//     test_tp_sharding.cu);
//   section 10b: moe_route_reference against a direct computation (a stable sort of the probabilities) on
//     random logits full of ties, moe_ranks_before's order, moe_align_reference's list, and
//     moe_experts_reference against transformers' loop (expert by expert, index_add_ into a bf16 row);
//   sections 26, 28 and 36: the persistent kernel's and fp8_weights' reasons for standing aside;
//   section 48: the parameters, the experts a step reads and simulate on the Qwen3-30B-A3B shape.
// The kernels against these references: test/gpu/gpu_moe.cu.
#define NANOVLLM_TESTING
#include "../../nanovllm.cu"
#include "../test.h"

// ==== section 37 and 2: config.json =====================================================================

// Qwen3-30B-A3B's config.json as published (the fields nanovllm reads, and two it ignores), with `extra`
// replacing or adding fields.
static json config_30b(const json& extra = json::object()) {
  json j = json::parse(R"({"architectures":["Qwen3MoeForCausalLM"],"model_type":"qwen3_moe","hidden_size":2048,
    "intermediate_size":6144,"num_hidden_layers":48,"num_attention_heads":32,"num_key_value_heads":4,
    "head_dim":128,"vocab_size":151936,"max_position_embeddings":40960,"rms_norm_eps":1e-6,"rope_theta":1e6,
    "tie_word_embeddings":false,"num_experts":128,"num_experts_per_tok":8,"moe_intermediate_size":768,
    "norm_topk_prob":true,"decoder_sparse_step":1,"mlp_only_layers":[],"router_aux_loss_coef":0.001,
    "output_router_logits":false,"torch_dtype":"bfloat16"})");
  for (auto& [k, v] : extra.items()) {
    if (v.is_null()) j.erase(k);
    else j[k] = v;
  }
  return j;
}
static ModelConfig parse(const json& j) { return parse_model_config(j.dump(), "/m/config.json"); }

TEST(moe_config_as_published) {
  const ModelConfig c = parse(config_30b());
  CHECK_EQ(c.num_experts, 128);
  CHECK_EQ(c.num_experts_per_tok, 8);
  CHECK_EQ(c.moe_intermediate_size, 768);
  CHECK(c.norm_topk_prob);
  CHECK_EQ(c.decoder_sparse_step, 1);
  CHECK(c.mlp_only_layers.empty());
  CHECK_EQ(c.num_moe_layers(), 48);
  // transformers' defaults: norm_topk_prob false, decoder_sparse_step 1, mlp_only_layers [] (absent or null).
  const ModelConfig d = parse(config_30b({{"norm_topk_prob", nullptr}, {"decoder_sparse_step", nullptr},
                                          {"mlp_only_layers", nullptr}}));
  CHECK(!d.norm_topk_prob);
  CHECK_EQ(d.decoder_sparse_step, 1);
  CHECK(d.mlp_only_layers.empty());
  const ModelConfig e = parse(config_30b({{"mlp_only_layers", {0, 47, 0}}, {"decoder_sparse_step", 2}}));
  CHECK(e.mlp_only_layers == std::vector<int>({0, 47, 0}));
  CHECK_EQ(e.decoder_sparse_step, 2);
  // A dense Qwen3 config has no experts, whatever MoE-looking field it carries.
  json dense = config_30b({{"architectures", {"Qwen3ForCausalLM"}}});
  const ModelConfig q = parse(dense);
  CHECK_EQ(q.num_experts, 0);
  CHECK_EQ(q.num_moe_layers(), 0);
  // The trip to the tensor-parallel workers (section 12) keeps every field.
  const ModelConfig back = model_config_from_json(model_config_to_json(e));
  CHECK_EQ(back.num_experts, 128);
  CHECK_EQ(back.num_experts_per_tok, 8);
  CHECK_EQ(back.moe_intermediate_size, 768);
  CHECK(back.norm_topk_prob);
  CHECK_EQ(back.decoder_sparse_step, 2);
  CHECK(back.mlp_only_layers == e.mlp_only_layers);
  for (int l = 0; l < 48; l++) CHECK_EQ(back.is_moe_layer(l), e.is_moe_layer(l));
}

TEST(moe_config_refusals) {
  struct Case {
    json extra;
    std::vector<std::string> needles;
  };
  const std::string topk = "num_experts_per_tok must be from 1 to num_experts";
  const std::string layers = "its entries are layer numbers from 0 to num_hidden_layers - 1 = 47";
  const std::vector<Case> cases = {
      {{{"num_experts", 0}}, {"num_experts must be at least 1 in a Qwen3MoeForCausalLM config, found 0",
                              "a dense Qwen3: Qwen3ForCausalLM"}},
      {{{"num_experts", -3}}, {"num_experts must be at least 1", "found -3"}},
      {{{"num_experts", nullptr}}, {"missing field \"num_experts\""}},
      {{{"num_experts", "128"}}, {"field \"num_experts\" must be a number, found \"128\""}},
      {{{"num_experts", 600}, {"num_experts_per_tok", 8}}, {"num_experts 600 is above the 512 experts"}},
      {{{"num_experts_per_tok", 129}}, {topk + " (128), found 129"}},
      {{{"num_experts_per_tok", 0}}, {topk + " (128), found 0"}},
      {{{"num_experts_per_tok", nullptr}}, {"missing field \"num_experts_per_tok\""}},
      {{{"num_experts_per_tok", 33}}, {"num_experts_per_tok 33 is above the 32 the router kernel picks"}},
      {{{"num_experts_per_tok", 2.5}}, {"field \"num_experts_per_tok\" must be an integer, found 2.5"}},
      {{{"moe_intermediate_size", nullptr}}, {"missing field \"moe_intermediate_size\""}},
      {{{"moe_intermediate_size", 0}}, {"moe_intermediate_size must be a positive multiple of 8, found 0"}},
      {{{"moe_intermediate_size", 100}}, {"moe_intermediate_size must be a positive multiple of 8, found 100"}},
      {{{"decoder_sparse_step", 0}}, {"decoder_sparse_step must be at least 1", "found 0"}},
      {{{"decoder_sparse_step", -1}}, {"decoder_sparse_step must be at least 1", "found -1"}},
      {{{"norm_topk_prob", "yes"}}, {"field \"norm_topk_prob\" must be true or false, found \"yes\""}},
      {{{"mlp_only_layers", 3}}, {"field \"mlp_only_layers\" must be a list of layer numbers, found 3"}},
      {{{"mlp_only_layers", "0,1"}}, {"must be a list of layer numbers, found \"0,1\""}},
      {{{"mlp_only_layers", {0, 48}}}, {"mlp_only_layers holds 48; " + layers}},
      {{{"mlp_only_layers", {-1}}}, {"mlp_only_layers holds -1; " + layers}},
      {{{"mlp_only_layers", {1.5}}}, {"mlp_only_layers holds 1.5; " + layers}},
      {{{"mlp_only_layers", {"3"}}}, {"mlp_only_layers holds \"3\"; " + layers}},
      {{{"mlp_only_layers", {{3}}}}, {"mlp_only_layers holds [3]; " + layers}},
      {{{"architectures", {"Qwen2MoeForCausalLM"}}},
       {"architecture Qwen2MoeForCausalLM is not supported; nanovllm runs Qwen3ForCausalLM and Qwen3MoeForCausalLM"}},
  };
  for (const Case& k : cases) {
    std::vector<std::string> needles = k.needles;
    needles.push_back("/m/config.json: ");  // every message names the file first
    expect_die("config " + k.extra.dump(), [&] { parse(config_30b(k.extra)); }, needles);
  }
  // Each value on the edge of what is refused is taken.
  for (const json& ok : {json{{"num_experts_per_tok", 32}}, json{{"num_experts", 8}, {"num_experts_per_tok", 8}},
                         json{{"num_experts", 512}}, json{{"mlp_only_layers", {0, 47}}},
                         json{{"moe_intermediate_size", 8}}, json{{"num_experts", 1}, {"num_experts_per_tok", 1}}})
    expect_no_die("config " + ok.dump(), [&] { parse(config_30b(ok)); });
}

// ModelConfig::is_moe_layer against transformers' rule, written here as Qwen3MoeDecoderLayer writes it:
// (layer_idx not in config.mlp_only_layers) and (config.num_experts > 0 and (layer_idx + 1) %
// config.decoder_sparse_step == 0).
TEST(moe_layer_kinds_follow_transformers) {
  std::mt19937 rng(3);
  int moe_seen = 0, dense_seen = 0;
  for (int trial = 0; trial < 500; trial++) {
    ModelConfig c;
    c.num_hidden_layers = 1 + rng() % 12;
    c.num_experts = rng() % 4 == 0 ? 0 : 1 + rng() % 16;
    c.decoder_sparse_step = 1 + rng() % 4;
    for (int l = 0; l < c.num_hidden_layers; l++)
      if (rng() % 3 == 0) c.mlp_only_layers.push_back(l);
    int n = 0;
    for (int l = 0; l < c.num_hidden_layers; l++) {
      bool listed = false;
      for (int x : c.mlp_only_layers) listed |= x == l;
      const bool want = !listed && c.num_experts > 0 && (l + 1) % c.decoder_sparse_step == 0;
      CHECK_MSG(c.is_moe_layer(l) == want, "trial %d layer %d: %d, transformers %d", trial, l, c.is_moe_layer(l),
                want);
      n += want;
      (want ? moe_seen : dense_seen)++;
    }
    CHECK_EQ(c.num_moe_layers(), n);
  }
  CHECK(moe_seen > 100 && dense_seen > 100);
  // The fixtures': make_tiny_checkpoint.py --moe (mlp_only_layers [1]) and a sparse step of 2.
  const ModelConfig tiny = parse(config_30b({{"num_hidden_layers", 2}, {"mlp_only_layers", {1}}}));
  CHECK(tiny.is_moe_layer(0) && !tiny.is_moe_layer(1));
  const ModelConfig step2 = parse(config_30b({{"num_hidden_layers", 4}, {"decoder_sparse_step", 2}}));
  CHECK(!step2.is_moe_layer(0) && step2.is_moe_layer(1) && !step2.is_moe_layer(2) && step2.is_moe_layer(3));
}

// ==== section 6a: the checkpoint's tensors ==============================================================

// The tiny MoE shape of make_tiny_checkpoint.py --moe: H 256, 2 layers, 8 experts top-2 of IE 128, layer 1
// dense (I 768) through mlp_only_layers, tied embeddings.
static json tiny_moe_config(const json& extra = json::object()) {
  json j = config_30b({{"hidden_size", 256}, {"intermediate_size", 768}, {"num_hidden_layers", 2},
                       {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"num_experts", 8},
                       {"num_experts_per_tok", 2}, {"moe_intermediate_size", 128}, {"mlp_only_layers", {1}},
                       {"tie_word_embeddings", true}});
  for (auto& [k, v] : extra.items()) j[k] = v;
  return j;
}

TEST(moe_checkpoint_tensors) {
  const ModelConfig c = parse(tiny_moe_config());
  std::map<std::string, TensorSpec> by_name;
  for (const TensorSpec& t : checkpoint_tensors(c)) by_name[t.name] = t;
  // 2 + 8 attention tensors per layer; layer 0: the router and 3 per expert; layer 1: the dense three.
  CHECK_EQ(by_name.size(), (size_t)(2 + 2 * 8 + 1 + 3 * 8 + 3));
  auto shape = [&](const std::string& n) {
    CHECK_MSG(by_name.count(n), "no spec for %s", n.c_str());
    return by_name.count(n) ? by_name[n].shape : std::vector<int64_t>{};
  };
  CHECK(shape("model.layers.0.mlp.gate.weight") == std::vector<int64_t>({8, 256}));
  for (int e = 0; e < 8; e++) {
    const std::string ex = "model.layers.0.mlp.experts." + std::to_string(e) + ".";
    CHECK(shape(ex + "gate_proj.weight") == std::vector<int64_t>({128, 256}));
    CHECK(shape(ex + "up_proj.weight") == std::vector<int64_t>({128, 256}));
    CHECK(shape(ex + "down_proj.weight") == std::vector<int64_t>({256, 128}));
  }
  CHECK(!by_name.count("model.layers.0.mlp.gate_proj.weight") && !by_name.count("model.layers.0.mlp.experts.8.up_proj.weight"));
  CHECK(!by_name.count("model.layers.1.mlp.gate.weight"));
  CHECK(shape("model.layers.1.mlp.down_proj.weight") == std::vector<int64_t>({256, 768}));
  // Block-quantized (Qwen's FP8 MoE checkpoints): every expert's projections with their scales; the router
  // stays unquantized whether modules_to_not_convert names it or not.
  for (const json& keep : {json(nullptr), json{"lm_head", "model.layers.0.mlp.gate"}}) {
    json q = {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}};
    if (!keep.is_null()) q["modules_to_not_convert"] = keep;
    const ModelConfig b = parse(tiny_moe_config({{"quantization_config", q}}));
    std::map<std::string, TensorSpec> s;
    for (const TensorSpec& t : checkpoint_tensors(b)) s[t.name] = t;
    CHECK(s.at("model.layers.0.mlp.gate.weight").stored == Stored::plain);
    CHECK(!s.count("model.layers.0.mlp.gate.weight_scale_inv"));
    CHECK(s.at("model.layers.0.mlp.experts.5.down_proj.weight").stored == Stored::quantized);
    CHECK(s.at("model.layers.0.mlp.experts.5.down_proj.weight_scale_inv").shape == std::vector<int64_t>({2, 1}));
    CHECK(s.at("model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv").shape == std::vector<int64_t>({1, 2}));
    CHECK(s.at("model.layers.1.mlp.up_proj.weight_scale_inv").shape == std::vector<int64_t>({6, 2}));
  }
}

// The tiny MoE folder as test/ref/make_tiny_checkpoint.py --moe writes it (what hf_reference.py's tiny-moe
// is), and its three moe_ breaks: each refused before any GPU work, naming the tensor (or field), the file or
// folder, and what was expected.
TEST(moe_tiny_checkpoint_and_its_breaks) {
  const std::string good = tiny_moe_folder("good");
  if (good.empty()) SKIP("python3 or test/ref/make_tiny_checkpoint.py is missing (run from the repository root)");
  ModelConfig c;
  expect_no_die("tiny MoE folder", [&] {
    c = load_model_config(good);
    validate_checkpoint(good, c);
  });
  CHECK_EQ(c.num_experts, 8);
  CHECK_EQ(c.num_experts_per_tok, 2);
  CHECK(c.is_moe_layer(0) && !c.is_moe_layer(1));
  const std::string missing = tiny_moe_folder("missing", "--break moe_expert_missing");
  expect_die("an expert's tensor missing", [&] { validate_checkpoint(missing, load_model_config(missing)); },
             {"the checkpoint in " + missing + " has no tensor 'model.layers.0.mlp.experts.7.up_proj.weight'",
              "shape [128, 256]", "a MoE one where config.json says so"});
  const std::string router = tiny_moe_folder("router", "--break moe_router_shape");
  expect_die("a transposed router", [&] { validate_checkpoint(router, load_model_config(router)); },
             {"tensor 'model.layers.0.mlp.gate.weight' in " + router + "/model.safetensors has shape [256, 8], "
              "but config.json implies [8, 256]"});
  const std::string topk = tiny_moe_folder("topk", "--break moe_topk");
  expect_die("top-k above the experts", [&] { load_model_config(topk); },
             {topk + "/config.json: num_experts_per_tok must be from 1 to num_experts (8), found 9"});
  // The same files read as another shape: 16 experts (the router has 8 rows; experts 8-15 are missing), IE 64
  // (every expert mis-shaped).
  ModelConfig wide = c;
  wide.num_experts = 16;
  expect_die("num_experts larger than the files", [&] { validate_checkpoint(good, wide); },
             {"tensor 'model.layers.0.mlp.gate.weight' in " + good + "/model.safetensors has shape [8, 256], but "
              "config.json implies [16, 256]"});
  ModelConfig narrow = c;
  narrow.moe_intermediate_size = 64;
  expect_die("moe_intermediate_size other than the files'", [&] { validate_checkpoint(good, narrow); },
             {"tensor 'model.layers.0.mlp.experts.0.gate_proj.weight' in " + good + "/model.safetensors has shape "
              "[128, 256], but config.json implies [64, 256]"});
  // mlp_only_layers [] makes layer 1 a MoE layer too: its router is not in the files.
  ModelConfig all_moe = c;
  all_moe.mlp_only_layers.clear();
  expect_die("a dense layer read as a MoE layer", [&] { validate_checkpoint(good, all_moe); },
             {"has no tensor 'model.layers.1.mlp.gate.weight'", "shape [8, 256]"});
}

// Files written here: an expert's down_proj transposed, a block-quantized MoE checkpoint with its experts'
// scales (and without one).
static void write_zeros_checkpoint(const std::string& dir, const std::vector<TensorSpec>& specs,
                                   const std::map<std::string, std::vector<int64_t>>& reshape = {}) {
  mkdir(dir.c_str(), 0755);
  json header = json::object();
  size_t off = 0;
  for (const TensorSpec& t : specs) {
    std::vector<int64_t> shape = reshape.count(t.name) ? reshape.at(t.name) : t.shape;
    const char* dtype = t.stored == Stored::quantized ? "F8_E4M3" : t.stored == Stored::scales ? "F32" : "BF16";
    int64_t n = t.stored == Stored::quantized ? 1 : t.stored == Stored::scales ? 4 : 2;
    for (int64_t d : shape) n *= d;
    header[t.name] = {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {off, off + n}}};
    off += n;
  }
  write_safetensors_file(dir, header.dump(), {}, off);  // zeros: valid scales too
}

TEST(moe_checkpoint_refusals_on_written_files) {
  const ModelConfig c = parse(tiny_moe_config({{"vocab_size", 64}}));
  const std::string dir = test_tmpdir() + "/down_t";
  const std::string down = "model.layers.0.mlp.experts.3.down_proj.weight";
  write_zeros_checkpoint(dir, checkpoint_tensors(c), {{down, {128, 256}}});
  expect_die("an expert's down_proj transposed", [&] { validate_checkpoint(dir, c); },
             {"tensor '" + down + "' in " + dir + "/model.safetensors has shape [128, 256], but config.json "
              "implies [256, 128]"});
  const ModelConfig q = parse(tiny_moe_config({{"vocab_size", 64},
                                               {"quantization_config", {{"quant_method", "fp8"},
                                                                        {"weight_block_size", {128, 128}}}}}));
  const std::string qdir = test_tmpdir() + "/quantized";
  write_zeros_checkpoint(qdir, checkpoint_tensors(q));
  expect_no_die("a block-quantized MoE checkpoint", [&] { validate_checkpoint(qdir, q); });
  std::vector<TensorSpec> lacking;
  for (const TensorSpec& t : checkpoint_tensors(q))
    if (t.name != "model.layers.0.mlp.experts.6.up_proj.weight_scale_inv") lacking.push_back(t);
  const std::string ldir = test_tmpdir() + "/no_scale";
  write_zeros_checkpoint(ldir, lacking);
  expect_die("an expert without its block scales", [&] { validate_checkpoint(ldir, q); },
             {"has no tensor 'model.layers.0.mlp.experts.6.up_proj.weight_scale_inv': the 8-bit weight"});
}

// ==== section 10b: the CPU references ====================================================================

// The order moe_route's warp argmax relies on, over (probability, expert id) pairs with distinct ids (a
// token's experts): strict and total, NaN as -inf, the lower id first on a tie.
TEST(moe_ranks_before_is_a_total_order) {
  const float vals[] = {-INFINITY, -1.f, 0.f, 0.25f, 0.25f, 1.f, INFINITY, NAN};
  std::vector<std::pair<float, int>> items;
  for (int e = 0; e < 8; e++)
    for (float v : vals) items.push_back({v, e});
  for (auto& a : items) {
    CHECK(!moe_ranks_before(a.first, a.second, a.first, a.second));  // irreflexive
    CHECK(moe_ranks_before(a.first, a.second, 5.f, -1));             // anything beats "none yet"
    CHECK(!moe_ranks_before(a.first, -1, a.first, a.second));         // ... and "none" beats nothing
    for (auto& b : items) {
      if (a.second == b.second) continue;  // one expert is never two candidates
      const bool ab = moe_ranks_before(a.first, a.second, b.first, b.second);
      const bool ba = moe_ranks_before(b.first, b.second, a.first, a.second);
      CHECK_MSG(ab != ba, "(%g, %d) vs (%g, %d): %d %d", a.first, a.second, b.first, b.second, ab, ba);
      for (auto& c : items)
        if (ab && c.second != b.second && c.second != a.second && moe_ranks_before(b.first, b.second, c.first, c.second))
          CHECK(moe_ranks_before(a.first, a.second, c.first, c.second));  // transitive
    }
  }
  CHECK(moe_ranks_before(0.5f, 7, 0.25f, 0));  // larger first
  CHECK(moe_ranks_before(0.5f, 2, 0.5f, 3));   // a tie: the lower id
  CHECK(moe_ranks_before(-1e30f, 9, NAN, 0));  // a number before NaN
  CHECK(!moe_ranks_before(-INFINITY, 9, NAN, 0) && moe_ranks_before(NAN, 0, -INFINITY, 9));  // NaN as -inf
  CHECK(moe_ranks_before(NAN, 0, NAN, 1));
}

// The order every sum over a token's experts is made in (moe_combine, section 34's down kernel):
// moe_order_by_expert against std::stable_sort of the places by expert id, for k from 1 to MOE_MAX_TOPK, on a
// token's distinct experts and on repeated ids (equal ones keep their order).
TEST(moe_order_by_expert_matches_a_stable_sort) {
  std::mt19937 rng(23);
  for (int k = 1; k <= MOE_MAX_TOPK; k++)
    for (int repeats : {0, 1})
      for (int round = 0; round < 20; round++) {
        std::vector<int> ids(k);
        for (int j = 0; j < k; j++) ids[j] = repeats ? (int)(rng() % 4) : j * 7 % 512;
        if (!repeats) std::shuffle(ids.begin(), ids.end(), rng);
        std::vector<int> want(k);
        std::iota(want.begin(), want.end(), 0);
        std::stable_sort(want.begin(), want.end(), [&](int a, int b) { return ids[a] < ids[b]; });
        int got[MOE_MAX_TOPK];
        moe_order_by_expert(got, ids.data(), k);
        CHECK_MSG(std::equal(want.begin(), want.end(), got), "k %d repeats %d round %d", k, repeats, round);
      }
}

// What the router computes, directly: probabilities exp(l) / sum exp(l) in long double, the experts ordered by
// std::stable_sort on the probability (equal ones keep their order: the lower id first), the first k.
static void route_directly(std::vector<int>& ids, std::vector<float>& w, const std::vector<float>& logits, int T,
                           int E, int k, bool norm) {
  ids.assign((size_t)T * k, -1), w.assign((size_t)T * k, 0.f);
  for (int t = 0; t < T; t++) {
    std::vector<long double> p(E);
    long double z = 0;
    for (int e = 0; e < E; e++) z += p[e] = expl((long double)logits[(size_t)t * E + e]);
    std::vector<int> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
    long double top = 0;
    for (int j = 0; j < k; j++) top += p[order[j]] / z;
    for (int j = 0; j < k; j++) {
      ids[(size_t)t * k + j] = order[j];
      w[(size_t)t * k + j] = (float)(p[order[j]] / z / (norm ? top : 1));
    }
  }
}

TEST(moe_route_reference_matches_a_stable_sort) {
  // A known row: logits 1, 3, 3, 2 (experts 1 and 2 tie at the top).
  int ids[2];
  float w[2];
  const float row[4] = {1, 3, 3, 2};
  moe_route_reference(ids, w, row, 1, 4, 2, false);
  const double z = exp(1.0) + 2 * exp(3.0) + exp(2.0);
  CHECK(ids[0] == 1 && ids[1] == 2);
  CHECK(fabs(w[0] - exp(3.0) / z) < 1e-7 && fabs(w[1] - exp(3.0) / z) < 1e-7);
  moe_route_reference(ids, w, row, 1, 4, 2, true);
  CHECK(w[0] == 0.5f && w[1] == 0.5f);
  moe_route_reference(ids, w, row, 1, 4, 1, false);
  CHECK_EQ(ids[0], 1);
  // Random rows whose logits take few values (many exact ties, at the k-th place too), at awkward E and k.
  std::mt19937 rng(11);
  int ties_at_k = 0;
  for (int E : {1, 2, 3, 8, 33, 128, 512})
    for (int k : {1, 2, 8, 32, 512}) {
      if (k > E) continue;
      const int T = 13;
      std::vector<float> logits((size_t)T * E);
      for (float& x : logits) x = (float)(rng() % 7) * 0.5f - 1.5f;  // 7 values
      for (bool norm : {false, true}) {
        std::vector<int> got((size_t)T * k), want;
        std::vector<float> gw((size_t)T * k), ww;
        moe_route_reference(got.data(), gw.data(), logits.data(), T, E, k, norm);
        route_directly(want, ww, logits, T, E, k, norm);
        CHECK_MSG(got == want, "E %d k %d norm %d: the experts differ", E, k, norm);
        check_close("routing weights", gw.data(), ww.data(), gw.size(), 0.f, 1e-6f);
        for (int t = 0; t < T && k < E && !norm; t++) {  // the k-th and (k+1)-th largest logits equal
          std::vector<float> l(logits.begin() + (size_t)t * E, logits.begin() + (size_t)(t + 1) * E);
          std::sort(l.begin(), l.end(), std::greater<float>());
          ties_at_k += l[k - 1] == l[k];
        }
      }
    }
  CHECK_MSG(ties_at_k > 30, "%d rows tie at the k-th place", ties_at_k);  // the cases test the tie rule
}

TEST(moe_align_reference_lists_each_expert_in_token_order) {
  // T 3, k 2, E 5: pairs 0..5 go to experts 4, 1 | 1, 0 | 4, 1. Expert 0: pair 3; 1: pairs 1, 2, 5; 4: 0, 4.
  const int ids[6] = {4, 1, 1, 0, 4, 1};
  std::vector<int> rows, pair_row, tiles;
  moe_align_reference(rows, pair_row, tiles, ids, 3, 2, 5);
  CHECK_EQ(rows.size(), (size_t)moe_rows_max(3, 2, 5));
  CHECK_EQ(rows.size(), (size_t)(cdiv(6 + 5 * (MOE_TILE - 1), MOE_TILE) * MOE_TILE));
  const int T0 = MOE_TILE;
  CHECK(rows[0] == 3 && rows[1] == -1 && rows[T0 - 1] == -1);
  CHECK(rows[T0] == 1 && rows[T0 + 1] == 2 && rows[T0 + 2] == 5 && rows[T0 + 3] == -1);
  CHECK(rows[2 * T0] == 0 && rows[2 * T0 + 1] == 4 && rows[2 * T0 + 2] == -1);
  CHECK(tiles[0] == 0 && tiles[1] == 1 && tiles[2] == 4);
  for (size_t i = 3; i < tiles.size(); i++) CHECK_EQ(tiles[i], -1);
  for (int p = 0; p < 6; p++) CHECK_EQ(rows[pair_row[p]], p);
  // Random routings, every expert count from none to every token: the list is a permutation of the pairs,
  // each expert's run ascending and within its tiles.
  std::mt19937 rng(5);
  for (int trial = 0; trial < 200; trial++) {
    const int E = 1 + rng() % 20, k = 1 + rng() % std::min(E, 4), T = rng() % 40;
    std::vector<int> id((size_t)T * k);
    for (int t = 0; t < T; t++) {  // k distinct experts per token, skewed toward the low ids
      std::vector<int> all(E);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      if (trial % 3 == 0) std::sort(all.begin(), all.end());
      std::copy(all.begin(), all.begin() + k, id.begin() + (size_t)t * k);
    }
    const int tile = trial % 2 ? MOE_TILE : MOE_TILE_MAX;  // (Part II lists long steps in longer tiles)
    moe_align_reference(rows, pair_row, tiles, id.data(), T, k, E, tile);
    CHECK_EQ(rows.size(), (size_t)moe_rows_max(T, k, E, tile));
    CHECK(rows.size() % tile == 0 && rows.size() <= (size_t)moe_rows_alloc(T, k, E));
    std::vector<int> seen((size_t)T * k, 0);
    for (size_t r = 0; r < rows.size(); r++) {
      if (rows[r] < 0) continue;
      seen[rows[r]]++;
      CHECK_EQ(tiles[r / tile], id[rows[r]]);
      CHECK_EQ(pair_row[rows[r]], (int)r);
      if (r > 0 && rows[r - 1] >= 0 && id[rows[r - 1]] == id[rows[r]]) CHECK(rows[r - 1] < rows[r]);
    }
    for (int s : seen) CHECK_EQ(s, 1);
  }
}

// transformers' Qwen3MoeExperts.forward, its loop written out: for each expert that was hit, in ascending
// id, its tokens' rows through gate_up, SiLU-and-mul and down (bf16 roundings as the engine's dense MLP),
// times the fp32 routing weight, rounded to bf16 and index_add_-ed into the token's bf16 row.
static void experts_as_transformers(std::vector<float>& out, const std::vector<float>& x, const std::vector<int>& ids,
                                    const std::vector<float>& w, const std::vector<float>& gate_up,
                                    const std::vector<float>& down, int T, int H, int IE, int E, int k) {
  out.assign((size_t)T * H, 0.f);
  std::vector<double> gu(2 * IE), act(IE);
  for (int e = 0; e < E; e++)
    for (int j = 0; j < k; j++)  // torch.where(expert_mask[e]): top-k slot, then token
      for (int t = 0; t < T; t++) {
        if (ids[(size_t)t * k + j] != e) continue;
        for (int n = 0; n < 2 * IE; n++) {
          double a = 0;
          for (int h = 0; h < H; h++) a += (double)x[(size_t)t * H + h] * gate_up[((size_t)e * 2 * IE + n) * H + h];
          gu[n] = bf16_round((float)a);
        }
        for (int i = 0; i < IE; i++) act[i] = bf16_round((float)(gu[i] / (1 + exp(-gu[i])) * gu[IE + i]));
        for (int h = 0; h < H; h++) {
          double a = 0;
          for (int i = 0; i < IE; i++) a += act[i] * down[((size_t)e * H + h) * IE + i];
          const float y = bf16_round((float)a) * w[(size_t)t * k + j];  // a bf16 value times an fp32 weight
          float& o = out[(size_t)t * H + h];
          o = bf16_round(o + bf16_round(y));
        }
      }
}

static std::vector<float> bf16_values(size_t n, std::mt19937& rng, float stddev) {
  std::normal_distribution<float> d(0.f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = bf16_round(d(rng));
  return v;
}

// A MoE layer's inputs on the CPU: rows x [T, H], the experts' weights, and a routing of random logits.
struct ExpertsInputs {
  int T, H, IE, E, k;
  std::vector<float> x, gate_up, down, w;
  std::vector<int> ids;
  ExpertsInputs(int T_, int H_, int IE_, int E_, int k_, bool norm, std::mt19937& rng)
      : T(T_), H(H_), IE(IE_), E(E_), k(k_), x(bf16_values((size_t)T * H, rng, 1.f)),
        gate_up(bf16_values((size_t)E * 2 * IE * H, rng, 0.3f)), down(bf16_values((size_t)E * H * IE, rng, 0.3f)),
        w((size_t)T * k), ids((size_t)T * k) {
    const std::vector<float> logits = bf16_values((size_t)T * E, rng, 1.f);
    moe_route_reference(ids.data(), w.data(), logits.data(), T, E, k, norm);
  }
};

TEST(moe_experts_reference_matches_transformers_loop) {
  std::mt19937 rng(7);
  struct Shape { int T, H, IE, E, k; };
  for (const Shape sh : {Shape{1, 8, 8, 1, 1}, Shape{7, 24, 16, 5, 3}, Shape{19, 40, 24, 8, 2}, Shape{33, 16, 8, 12, 8}}) {
    const ExpertsInputs s(sh.T, sh.H, sh.IE, sh.E, sh.k, true, rng);
    const auto& x = s.x;
    const auto& gate_up = s.gate_up;
    const auto& down = s.down;
    const auto& ids = s.ids;
    const auto& w = s.w;
    std::vector<float> got((size_t)s.T * s.H), want;
    moe_experts_reference(got.data(), x.data(), ids.data(), w.data(), gate_up.data(), down.data(), s.T, s.H, s.IE,
                          s.k);
    experts_as_transformers(want, x, ids, w, gate_up, down, s.T, s.H, s.IE, s.E, s.k);
    size_t differ = 0;
    for (size_t i = 0; i < got.size(); i++) differ += memcmp(&got[i], &want[i], 4) != 0;
    CHECK_MSG(differ == 0, "T %d H %d IE %d E %d k %d: %zu of %zu values differ", s.T, s.H, s.IE, s.E, s.k, differ,
              got.size());
  }
  // The order of the sum matters: adding the same results in the top-k's order (most probable first) instead
  // of by expert id rounds differently somewhere on these rows, so the comparison above can tell.
  const ExpertsInputs s(64, 32, 16, 8, 4, false, rng);
  const auto& x = s.x;
  const auto& gate_up = s.gate_up;
  const auto& down = s.down;
  const auto& ids = s.ids;
  const auto& w = s.w;
  std::vector<float> by_id((size_t)s.T * s.H), by_rank((size_t)s.T * s.H, 0.f);
  moe_experts_reference(by_id.data(), x.data(), ids.data(), w.data(), gate_up.data(), down.data(), s.T, s.H, s.IE, s.k);
  for (int t = 0; t < s.T; t++)
    for (int j = 0; j < s.k; j++) {  // one expert at a time, in the top-k's order
      std::vector<float> one(s.H);
      const int expert0 = 0;
      float weight = w[(size_t)t * s.k + j];
      std::vector<float> gate_up_e(gate_up.begin() + (size_t)ids[(size_t)t * s.k + j] * 2 * s.IE * s.H,
                                   gate_up.begin() + (size_t)(ids[(size_t)t * s.k + j] + 1) * 2 * s.IE * s.H);
      std::vector<float> down_e(down.begin() + (size_t)ids[(size_t)t * s.k + j] * s.H * s.IE,
                                down.begin() + (size_t)(ids[(size_t)t * s.k + j] + 1) * s.H * s.IE);
      moe_experts_reference(one.data(), &x[(size_t)t * s.H], &expert0, &weight, gate_up_e.data(), down_e.data(), 1,
                            s.H, s.IE, 1);
      for (int h = 0; h < s.H; h++) {
        float& o = by_rank[(size_t)t * s.H + h];
        o = bf16_round(o + one[h]);
      }
    }
  size_t differ = 0;
  for (size_t i = 0; i < by_id.size(); i++) differ += by_id[i] != by_rank[i];
  CHECK_MSG(differ > 0, "summing by rank and by id agree everywhere: the order check above could not fail");
}

// ==== sections 26, 28 and 36: what stands aside for a MoE model =========================================

TEST(moe_stand_aside_reasons) {
#ifdef NANOVLLM_PART_II
  const ModelConfig c = parse(config_30b());
  // fp8_weights' reason, where section 35's switch is off, comes before it asks the GPU anything.
  const bool fp8_moe = g_opt.fp8_moe;
  g_opt.fp8_moe = false;
  CHECK_EQ(fp8_weights_problem(c, 1), std::string("a MoE model's experts are multiplied in FP8 by section 35 "
                                                  "(switch fp8_moe), which this run switches off"));
  g_opt.fp8_moe = fp8_moe;
  // Section 36 plans a MoE model's decode steps in the persistent kernel: one GPU, bf16 weights, k <= 8, IE a
  // multiple of 64. Where it cannot, or where its switch is off, the kernel plans nothing and says why before
  // it asks the GPU anything.
  Qwen3 model;
  model.cfg = c;
  auto has = [](const std::string& s, const char* what) { return s.find(what) != std::string::npos; };
  CHECK_EQ(persist_moe_problem(model, false), std::string(""));
  CHECK(has(persist_moe_problem(model, true), "FP8 weights"));
  model.tp = 2;
  CHECK(has(persist_moe_problem(model, false), "tensor parallelism"));
  model.tp = 1;
  model.cfg.num_experts_per_tok = 9;
  CHECK(has(persist_moe_problem(model, false), "more than 8 experts"));
  model.cfg = c, model.cfg.moe_intermediate_size = 96;
  CHECK(has(persist_moe_problem(model, false), "not a multiple of 64"));
  model.cfg = c, model.tp = 2;  // (the 30B-A3B shape at --tp 2: section 36 stands aside)
  install_optimizations(default_optimizations());
  {
    const PersistentDecode pd = persist_setup(model, 8);
    CHECK(pd.plans.empty());
    CHECK_MSG(has(pd.off_reason, "a MoE model at tensor parallelism keeps section 14's path"), "%s",
              pd.off_reason.c_str());
  }
  model.tp = 1;
  {
    OptimizationSet off = default_optimizations();
    CHECK(parse_optimizations("-persistent_moe", off).empty());
    install_optimizations(off);
    const PersistentDecode pd = persist_setup(model, 8);
    CHECK(pd.plans.empty());
    CHECK_MSG(has(pd.off_reason, "persistent_moe off"), "%s", pd.off_reason.c_str());
  }
  // Section 14's table sends a MoE layer's MLP to its moe stage: Part I's unless a chapter fills it, as
  // sections 33-35 do by default (FP8 experts 35's stage, else small steps 34's gemv, the others 33's
  // fused_moe); --plain fills no stage (section 6c's pass runs moe_mlp).
  install_optimizations(default_optimizations());
  CHECK(g_stages.moe == fp8_moe_stage && g_moe_bf16 == moe_gemv_stage && g_moe_larger == fused_moe_stage);
  OptimizationSet set = default_optimizations();
  CHECK(parse_optimizations("-fused_moe,-moe_gemv,-fp8_moe", set).empty());
  install_optimizations(set);
  CHECK(g_hooks.forward == forward_fast && g_stages.moe == moe_plain);
  CHECK(parse_optimizations("none", set).empty());
  install_optimizations(set);
  CHECK(!g_hooks.forward);
  install_optimizations(default_optimizations());
#else
  SKIP("Part II is cut out of this build");
#endif
}

// ==== section 33: the fused MoE's arithmetic ===========================================================

// fused_moe_reference (what section 33's kernels compute: the rows of moe_align_reference's list through
// gate_up and SiLU-and-mul, the down product times the routing weight, then each token's rows summed in
// ascending expert id) gives moe_experts_reference's output bit for bit: the chapter moves the weight's
// multiply and regroups the rows by expert, and keeps every rounding. On routings where most experts get no
// row, where one expert gets every row, every expert in every token, one token, and widths that are not
// multiples of 8; padding rows' act is exactly 0 (what the down product then reads), and each pair's row
// holds its weighted result.
#ifdef NANOVLLM_PART_II
TEST(fused_moe_reference_is_moe_experts_reference_regrouped) {
  std::mt19937 rng(11);
  struct Shape { int T, H, IE, E, k, kind; };  // kind 0: random logits; 1: expert E - 1 in every token;
                                               // 2: only experts 0 .. k used (most get no row)
  int cases = 0;
  for (const Shape sh : {Shape{1, 24, 8, 4, 2, 0}, Shape{7, 24, 16, 5, 3, 0}, Shape{19, 40, 24, 8, 2, 1},
                         Shape{40, 16, 8, 12, 2, 2}, Shape{5, 12, 6, 5, 5, 0}, Shape{33, 16, 8, 12, 8, 0}}) {
    ExpertsInputs s(sh.T, sh.H, sh.IE, sh.E, sh.k, true, rng);
    for (int t = 0; t < s.T && sh.kind > 0; t++) {
      std::vector<int> all(s.E);
      std::iota(all.begin(), all.end(), 0);
      if (sh.kind == 1) std::swap(all[0], all[s.E - 1]);
      std::shuffle(all.begin() + (sh.kind == 1), all.begin() + (sh.kind == 1 ? s.E : s.k + 1), rng);
      std::copy(all.begin(), all.begin() + s.k, s.ids.begin() + (size_t)t * s.k);
    }
    std::vector<int> rows, pair_row, tiles;
    moe_align_reference(rows, pair_row, tiles, s.ids.data(), s.T, s.k, s.E);
    std::vector<float> act, wy, got((size_t)s.T * s.H), want((size_t)s.T * s.H);
    fused_moe_reference(act, wy, got.data(), s.x.data(), rows, tiles, pair_row, s.ids.data(), s.w.data(),
                        s.gate_up.data(), s.down.data(), s.T, s.H, s.IE, s.k);
    moe_experts_reference(want.data(), s.x.data(), s.ids.data(), s.w.data(), s.gate_up.data(), s.down.data(), s.T,
                          s.H, s.IE, s.k);
    size_t differ = 0;
    for (size_t i = 0; i < got.size(); i++) differ += memcmp(&got[i], &want[i], 4) != 0;
    CHECK_MSG(differ == 0, "T %d H %d IE %d E %d k %d kind %d: %zu of %zu values differ", s.T, s.H, s.IE, s.E, s.k,
              sh.kind, differ, got.size());
    size_t padding = 0, nonzero_pad = 0, zero_pairs = 0;
    for (size_t r = 0; r < rows.size(); r++) {
      if (tiles[r / MOE_TILE] < 0 || rows[r] >= 0) continue;
      padding++;
      for (int i = 0; i < s.IE; i++) nonzero_pad += act[r * s.IE + i] != 0.f;
    }
    for (int p = 0; p < s.T * s.k; p++) {
      bool all_zero = true;
      for (int h = 0; h < s.H; h++) all_zero &= wy[(size_t)pair_row[p] * s.H + h] == 0.f;
      zero_pairs += all_zero;
    }
    CHECK_MSG(nonzero_pad == 0, "%zu values of %zu padding rows' act are not 0", nonzero_pad, padding);
    CHECK_MSG(zero_pairs == 0, "%zu pairs' weighted rows are all zeros (not written?)", zero_pairs);
    if (sh.kind == 1) CHECK(std::count(tiles.begin(), tiles.end(), s.E - 1) == cdiv(s.T, MOE_TILE));
    cases++;
  }
  CHECK_EQ(cases, 6);
}
#endif

// ==== section 48: parameters, the experts a step reads, simulate =========================================

TEST(moe_parameters_and_bytes_per_step) {
  ModelConfig a3b, a22b, dense;
  CHECK(qwen3_shape("Qwen3-30B-A3B", a3b) && qwen3_shape("Qwen3-235B-A22B", a22b) && qwen3_shape("Qwen3-8B", dense));
  // The published counts: 30.5B parameters of which 3.3B active; 235B of which 22B.
  CHECK_EQ(model_params(a3b), (int64_t)30532122624);
  CHECK_EQ(active_params(a3b), (int64_t)3353032704);
  CHECK_EQ(model_params(a22b), (int64_t)235093634560);
  CHECK_EQ(active_params(a22b), (int64_t)22190763520);
  CHECK_EQ(active_params(dense), model_params(dense));
  // The same counts from the config.json form of the shape.
  CHECK_EQ(model_params(parse(config_30b())), model_params(a3b));
  // Experts a step of n tokens reads per layer, under uniform routing: E (1 - ((E - k) / E)^n).
  CHECK(fabs(experts_touched(a3b, 1) - 8) < 1e-9);
  CHECK(fabs(experts_touched(a3b, 10) - 60.869) < 0.001);   // REFERENCE.md: 61 at B = 10
  CHECK(fabs(experts_touched(a3b, 64) - 125.942) < 0.001);  // 126 at B = 64
  CHECK(experts_touched(a3b, 1e6) <= 128 && experts_touched(a3b, 1e6) > 127.999);
  CHECK_EQ(experts_touched(dense, 64), 0.0);
  // Bytes: a batch-1 step reads every active parameter once; a large step every parameter.
  Config cfg;
  CHECK_EQ(step_weight_bytes(a3b, cfg, 1), 2.0 * active_params(a3b));
  CHECK(fabs(step_weight_bytes(a3b, cfg, 1e6) - 2.0 * model_params(a3b)) < 1e3);
  CHECK(step_weight_bytes(a3b, cfg, 10) > step_weight_bytes(a3b, cfg, 1));
  CHECK_EQ(step_weight_bytes(dense, cfg, 1), model_weight_bytes(dense, cfg));
  // A block-quantized MoE checkpoint (or --quantization fp8) with the default switches: the layer linears and
  // every expert one byte each (fp8_weights and fp8_moe), the rest bf16; a batch-1 step reads k experts of
  // them. With fp8_moe off the FP8 chapter stands aside and the checkpoint is held dequantized: bf16 bytes.
  ModelConfig q = a3b;
  q.block_quantized = true;
#ifdef NANOVLLM_PART_II
  Config quant = cfg, off = cfg;
  quant.quantization = "fp8";
  CHECK(parse_optimizations("-fp8_moe", off.opt).empty());
  CHECK_EQ(model_weight_bytes(q, off), model_weight_bytes(a3b, off));
  const double H = 2048, L = 48, E = 128, IE = 768, attention = H * (32 + 2 * 4) * 128 + 32 * 128 * H;
  const double linears = L * (attention + E * 3 * H * IE);
  CHECK(fabs(model_weight_bytes(q, cfg) - (2.0 * model_params(a3b) - linears)) < 1);
  CHECK_EQ(model_weight_bytes(a3b, quant), model_weight_bytes(q, cfg));
  CHECK(fabs(step_weight_bytes(q, cfg, 1) - (model_weight_bytes(q, cfg) - L * (E - 8) * 3 * H * IE)) < 1);
#else  // Part II cut out: no chapter holds FP8 weights, the checkpoint is dequantized
  CHECK_EQ(model_weight_bytes(q, cfg), model_weight_bytes(a3b, cfg));
#endif
  // --simulate-gpu-memory: the experts' buffers for the largest step come out of the pool.
  Config c;
  c.kvcache_block_size = 256;
  const int64_t blocks = simulated_kv_blocks(a3b, c, 141.0 * (1 << 30));
  Config small_step = c;
  small_step.max_num_batched_tokens = 512;
  const int64_t more = simulated_kv_blocks(a3b, small_step, 141.0 * (1 << 30));
  printf("    Qwen3-30B-A3B on 141 GiB: %lld KV blocks of 256 tokens (%lld with a 512-token step budget)\n",
         (long long)blocks, (long long)more);
  // The experts' lists and products at 16,384 tokens: about 1.2 GB more than at 512, in blocks of 24 MiB.
  const double buffers = (moe_rows_max(16384, 8, 128) - moe_rows_max(512, 8, 128)) * 2.0 * (3 * 768 + 2048);
  const double block = (double)kv_block_bytes(a3b, 256, 1, 2);
  CHECK(blocks > 0);
  CHECK_MSG(more - blocks >= (int64_t)(buffers / block), "%lld blocks more, at least %.1f expected",
            (long long)(more - blocks), buffers / block);
}

// A batch on the Qwen3-30B-A3B shape through LLMEngine and SimRunner: it finishes, and its modelled decode
// steps get slower as the batch grows and reads more experts (at batch 1 a step reads 3.4B parameters, at
// batch 64 nearly all 30.5B).
TEST(moe_simulate_runs_and_prices_the_experts) {
  ModelConfig mc;
  qwen3_shape("Qwen3-30B-A3B", mc);
  Config config;
  config.max_model_len = 4096;
  config.num_kvcache_blocks = 256;
  config.kvcache_block_size = 256;
  config.eos = mc.eos_token_ids;
  auto decode_seconds = [&](int B) {
    SimRunner sim(mc, config, 0, 0);
    LLMEngine e(config, sim);
    std::vector<Request> reqs;
    for (int b = 0; b < B; b++) {
      Request r;
      r.prompt_token_ids = std::vector<int>(16, 100 + b);
      r.params.max_tokens = 9;
      r.params.ignore_eos = true;
      r.params.temperature = 0;
      reqs.push_back(r);
    }
    const double t0 = sim.clock;
    const std::vector<Completion> outs = e.generate(reqs);
    CHECK_EQ(outs.size(), (size_t)B);
    for (const Completion& o : outs) CHECK_EQ(o.token_ids.size(), (size_t)9);
    return sim.clock - t0;
  };
  const double one = decode_seconds(1), many = decode_seconds(64);
  printf("    modelled run of 9 tokens: batch 1 %.2f ms, batch 64 %.2f ms\n", one * 1e3, many * 1e3);
  CHECK(many > 2 * one);
}

int main(int argc, char** argv) { return test_main(argc, argv); }
