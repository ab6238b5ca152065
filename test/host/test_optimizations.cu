// The optimization switch (nanovllm.cu section 2's registry, filled by the sections of Part II) and the hook
// table (section 11): --plain and --opt parse as documented, every Part II section registers one name with a
// line of --help, each switch sets its own field of Part II's Optimizations and fills the hooks it says it
// does, and the switch travels to the tensor-parallel workers with the rest of Config. No GPU needed.
#define NANOVLLM_TESTING
#include "../../nanovllm.cu"
#include <random>
#include "../test.h"
#include "../engine_fixtures.h"

static const std::vector<Optimization>& reg() { return optimization_registry(); }
static int count_on(const OptimizationSet& s) {
  int n = 0;
  for (bool on : s.on) n += on;
  return n;
}
static bool is_on(const OptimizationSet& s, const char* name) {
  for (size_t i = 0; i < reg().size(); i++)
    if (!strcmp(reg()[i].name, name)) return i < s.on.size() && s.on[i];
  fprintf(stderr, "no optimization named %s\n", name);
  return false;
}
static OptimizationSet parsed(const char* spec) {
  OptimizationSet s = default_optimizations();
  std::string e = parse_optimizations(spec, s);
  if (!e.empty()) fprintf(stderr, "parse_optimizations(%s): %s\n", spec, e.c_str());
  return s;
}
static int fields_on(const Optimizations& o) {
  return o.flash_attn + o.longest_first + o.pdl + o.gemv + o.cluster_merge + o.fused_rope + o.oneshot_allreduce +
         o.twoshot_allreduce + o.bisect_sampler + o.fast_sampler + o.prefill_graphs + o.persistent + o.fp8_weights +
         o.fp8_gemv + o.fused_moe + o.moe_gemv + o.fp8_moe + o.persistent_moe;
}

// Every Part II switch is registered exactly once, in file order, with a description naming its section,
// and switching it on alone sets exactly one field of Optimizations (its own).
TEST(every_optimization_is_registered_once) {
  const char* expected[] = {"flash_attn",        "pdl",           "gemv",           "cluster_merge",
                            "fused_rope",        "oneshot_allreduce", "twoshot_allreduce", "bisect_sampler",
                            "fast_sampler",      "prefill_graphs", "persistent",     "fp8_weights",
                            "fp8_gemv",          "longest_first",  "fused_moe",      "moe_gemv",
                            "fp8_moe",           "persistent_moe"};
  CHECK_EQ(reg().size(), sizeof expected / sizeof expected[0]);
  CHECK_EQ(sizeof(Optimizations), reg().size() * sizeof(bool));
  for (size_t i = 0; i < reg().size() && i < sizeof expected / sizeof expected[0]; i++) {
    CHECK_MSG(!strcmp(reg()[i].name, expected[i]), "registry[%zu] is %s, expected %s", i, reg()[i].name,
              expected[i]);
    CHECK_MSG(std::string(reg()[i].what).find("(section 1") != std::string::npos ||
                  std::string(reg()[i].what).find("(section 2") != std::string::npos ||
                  std::string(reg()[i].what).find("(section 3") != std::string::npos,
              "%s: its description names no Part II section", reg()[i].name);
    OptimizationSet one = parsed("none");
    one.on[i] = true;
    install_optimizations(one);
    CHECK_MSG(fields_on(g_opt) == 1, "%s sets %d fields", reg()[i].name, fields_on(g_opt));
  }
  install_optimizations(parsed("none"));
  CHECK_EQ(fields_on(g_opt), 0);
}

// The hooks each switch fills, and that --plain leaves the table empty (Part I runs everything).
TEST(switches_fill_their_hooks) {
  install_optimizations(parsed("none"));
  CHECK(!g_hooks.forward && !g_hooks.decode_step && !g_hooks.sample && !g_hooks.sample_workspace_bytes &&
        !g_hooks.compute_logprobs && !g_hooks.logprobs_workspace_bytes && !g_hooks.attention_workspace_bytes &&
        g_hooks.tp_ready.empty() && g_hooks.model_ready.empty() && !g_hooks.prefill_step &&
        g_hooks.graphs_captured.empty() && g_hooks.decode_scheduled.empty());
  install_optimizations(parsed("none,flash_attn"));
  CHECK(g_hooks.forward == forward_fast && g_hooks.attention_workspace_bytes && !g_hooks.sample);
  CHECK(!g_hooks.prefill_step && g_hooks.graphs_captured.empty());
  install_optimizations(parsed("none,prefill_graphs"));
  CHECK(g_hooks.forward == forward_fast && g_hooks.prefill_step == prefill_step_graphs &&
        g_hooks.graphs_captured.size() == 1 && g_hooks.graphs_captured[0] == capture_prefill_graphs);
  install_optimizations(parsed("none,longest_first"));
  CHECK(!g_hooks.forward && g_hooks.decode_scheduled.size() == 1 &&
        g_hooks.decode_scheduled[0] == order_longest_first);
  install_optimizations(parsed("none,pdl"));
  CHECK(!g_hooks.forward && g_opt.pdl);  // pdl changes how Part II launches, not what runs
  install_optimizations(parsed("none,fast_sampler"));
  CHECK(!g_hooks.forward && g_hooks.sample == sample_fast && g_hooks.compute_logprobs == compute_logprobs_fast);
  install_optimizations(parsed("none,bisect_sampler"));  // the draw only: section 9b's log-probabilities stay
  CHECK(!g_hooks.forward && g_hooks.sample == sample_bisect && !g_hooks.sample_workspace_bytes &&
        !g_hooks.compute_logprobs);
  install_optimizations(parsed("none,bisect_sampler,fast_sampler"));  // both: section 22's, the later step
  CHECK(g_hooks.sample == sample_fast && g_hooks.sample_workspace_bytes == sample_workspace_bytes);
  install_optimizations(parsed("-fast_sampler"));  // the default less section 22: section 21's bisection draws
  CHECK(g_hooks.sample == sample_bisect && !g_hooks.compute_logprobs);
  install_optimizations(parsed("none,oneshot_allreduce"));
  CHECK(g_hooks.tp_ready.size() == 1 && g_hooks.tp_ready[0] == oneshot_setup && g_hooks.forward == forward_fast);
  install_optimizations(parsed("none,persistent"));  // it measures at start-up, then captures its own graphs
  CHECK(g_hooks.decode_step == persist_decode_step && g_hooks.model_ready.size() == 1 &&
        g_hooks.graphs_captured.size() == 1 && g_hooks.graphs_captured[0] == persist_capture_graphs);
  install_optimizations(parsed("all"));
  CHECK(g_hooks.forward == forward_fast && g_hooks.decode_step && g_hooks.sample && g_hooks.tp_ready.size() == 1);
  CHECK(g_hooks.graphs_captured.size() == 2 && g_hooks.graphs_captured[0] == capture_prefill_graphs);  // file order
  install_optimizations(default_optimizations());
  CHECK(g_hooks.decode_step && g_hooks.model_ready.size() == 1);  // on; it measures which batch sizes it takes
}

// What section 48's simulate reads of the switches (Optimization::step_costs, by name): Part I's steps with
// none on, section 23's graphs up to its largest rung, section 16's decode rows once per GQA group.
TEST(simulate_reads_the_step_costs_of_the_switches_on) {
  CHECK_EQ(step_cost(parsed("none"), "prefill_graph_tokens"), 0.0);
  CHECK_EQ(step_cost(parsed("none"), "decode_rows_per_kv_group"), 0.0);
  CHECK_EQ(step_cost(parsed("none,prefill_graphs"), "prefill_graph_tokens"), (double)PREFILL_GRAPH_MAX_T);
  CHECK_EQ(step_cost(parsed("none,prefill_graphs"), "decode_rows_per_kv_group"), 0.0);
  CHECK_EQ(step_cost(parsed("none,flash_attn"), "decode_rows_per_kv_group"), 1.0);
  CHECK_EQ(step_cost(parsed("-prefill_graphs"), "prefill_graph_tokens"), 0.0);
  CHECK_EQ(step_cost(default_optimizations(), "prefill_graph_tokens"), (double)PREFILL_GRAPH_MAX_T);
  CHECK_EQ(step_cost(default_optimizations(), "linear_weight_bytes_saved"), 1.0);
  CHECK_EQ(step_cost(parsed("-fp8_weights"), "linear_weight_bytes_saved"), 0.0);
  CHECK_EQ(step_cost(default_optimizations(), "expert_weight_bytes_saved"), 1.0);
  CHECK_EQ(step_cost(parsed("-fp8_moe"), "expert_weight_bytes_saved"), 0.0);
  // Every name a switch gives is one section 48 reads (a misspelt name would change nothing, silently).
  for (const Optimization& o : optimization_registry())
    for (const auto& cost : o.step_costs)
      CHECK_MSG(cost.first == "prefill_graph_tokens" || cost.first == "decode_rows_per_kv_group" ||
                    cost.first == "linear_weight_bytes_saved" || cost.first == "expert_weight_bytes_saved",
                "%s gives step cost %s, which section 48 does not read", o.name, cost.first.c_str());
}

// Section 14's stage table: each chapter fills its own stages, a chapter that changes flash_attn's decode
// kernel leaves decode alone without flash_attn, and every install starts the table over from Part I's stages.
TEST(chapters_fill_their_stages) {
  install_optimizations(parsed("none,gemv"));
  CHECK(g_hooks.forward == forward_fast && g_stages.norm_matmul == gemv_norm_matmul &&
        g_stages.matmul_out == gemv_matmul_out && g_stages.attention_decode == attention_decode_plain &&
        g_stages.all_reduce == all_reduce_plain && g_stages.store_qkv == store_qkv_plain && !g_stages.cut);
  install_optimizations(parsed("none,flash_attn"));
  CHECK(g_stages.norm_matmul == norm_matmul_plain && g_stages.matmul_out == matmul_out_plain);  // started over
  CHECK(g_stages.attention_prefill == flash_attention_prefill_stage &&
        g_stages.attention_decode == flash_attention_decode_stage &&
        g_decode_attention == flash_attention_decode<KVBf16> && g_stages.store_qkv == store_qkv_plain);
  install_optimizations(parsed("none,fused_rope,cluster_merge"));  // without flash_attn: only fused_rope's store
  CHECK(g_hooks.forward == forward_fast && g_stages.store_qkv == store_qkv_fast &&
        g_stages.attention_decode == attention_decode_plain && g_decode_attention == flash_attention_decode<KVBf16>);
  install_optimizations(parsed("none,flash_attn,cluster_merge"));
  CHECK(g_stages.attention_decode == flash_attention_decode_stage &&
        g_decode_attention == attention_decode_cluster<KVBf16>);
  install_optimizations(parsed("none,flash_attn,fused_rope"));
  CHECK(g_stages.attention_decode == fused_attention_decode_stage && g_stages.store_qkv == store_qkv_fast &&
        g_decode_attention == flash_attention_decode<KVBf16>);
  install_optimizations(parsed("none,oneshot_allreduce"));
  CHECK(g_hooks.forward == forward_fast && g_stages.all_reduce == all_reduce_nvlink &&
        g_stages.attention_decode == attention_decode_plain && g_hooks.tp_ready.size() == 1);
  install_optimizations(parsed("none,twoshot_allreduce"));  // alone: the two-shot road, NCCL for the rest
  CHECK(g_stages.all_reduce == all_reduce_nvlink && g_opt.twoshot_allreduce && !g_opt.oneshot_allreduce &&
        g_hooks.tp_ready.size() == 1);
  install_optimizations(parsed("none,oneshot_allreduce,twoshot_allreduce"));  // one set-up for both
  CHECK(g_hooks.tp_ready.size() == 1 && g_hooks.tp_ready[0] == oneshot_setup);
  install_optimizations(parsed("none,prefill_graphs"));
  CHECK(g_stages.cut == piecewise_cut && g_stages.attention_prefill == attention_prefill_plain);
  CHECK(g_stages.moe == moe_plain);
  install_optimizations(parsed("none,fused_moe"));  // the moe stage alone; a dense model's pass is Part I's
  CHECK(g_hooks.forward == forward_fast && g_stages.moe == fused_moe_stage && g_opt.fused_moe &&
        g_stages.norm_matmul == norm_matmul_plain && g_stages.matmul_out == matmul_out_plain &&
        g_stages.attention_decode == attention_decode_plain && g_stages.all_reduce == all_reduce_plain);
  install_optimizations(parsed("none,moe_gemv"));  // small steps' gemv in front of Part I's stage
  CHECK(g_stages.moe == moe_gemv_stage && g_moe_larger == moe_plain && g_opt.moe_gemv && !g_opt.fused_moe);
  install_optimizations(parsed("all,-fused_moe"));  // fp8_moe's stage in front (it passes bf16 experts on)
  CHECK(!g_opt.fused_moe && g_stages.moe == fp8_moe_stage && g_moe_bf16 == moe_gemv_stage &&
        g_moe_larger == moe_plain);
  install_optimizations(parsed("all,-moe_gemv"));  // fp8_moe's stage in front of every bf16 one
  CHECK(!g_opt.moe_gemv && g_stages.moe == fp8_moe_stage && g_moe_bf16 == fused_moe_stage);
  install_optimizations(parsed("all,-moe_gemv,-fp8_moe"));
  CHECK(!g_opt.moe_gemv && !g_opt.fp8_moe && g_stages.moe == fused_moe_stage);
  install_optimizations(parsed("none,fp8_moe"));  // alone (fp8_weights off: it holds nothing, Part I's stage behind)
  CHECK(g_opt.fp8_moe && g_stages.moe == fp8_moe_stage && g_moe_bf16 == moe_plain);
  install_optimizations(default_optimizations());  // fp8_weights' stages in front, the gemv's behind them
  CHECK(g_stages.norm_matmul == fp8_norm_matmul && g_fp8_weights.norm_matmul_bf16 == gemv_norm_matmul &&
        g_stages.matmul_out == fp8_matmul_out && g_fp8_weights.matmul_out_bf16 == gemv_matmul_out &&
        g_stages.attention_decode == fused_attention_decode_stage &&
        g_stages.store_qkv == store_qkv_fast &&
        g_stages.all_reduce == all_reduce_nvlink && g_stages.cut == piecewise_cut &&
        g_stages.attention_prefill == flash_attention_prefill_stage && g_stages.moe == fp8_moe_stage &&
        g_moe_bf16 == moe_gemv_stage && g_moe_larger == fused_moe_stage);
}

// The FP8 cache (sections 31-32) installs the way every chapter does: its format's apply, run by
// install_optimizations after the switches, fills section 14's stages through stages_for and names the
// persistent kernel's format; an engine of another format (or another install) resets all of it.
TEST(fp8_cache_installs_through_the_stages) {
  install_optimizations(default_optimizations(), "fp8");
  CHECK(g_fp8_cache.on && g_fp8_cache.scales.empty() && g_persistent.format == &kPersistFp8);
  CHECK(g_hooks.forward == forward_fast && g_stages.store_qkv == store_qkv_fp8 &&
        g_stages.attention_prefill == attention_prefill_fp8 && g_stages.attention_decode == attention_decode_fp8 &&
        g_stages.norm_matmul == fp8_norm_matmul && g_fp8_weights.norm_matmul_bf16 == gemv_norm_matmul);
  g_fp8_cache.scales.resize(3);  // (use_fp8_cache's part, which needs a GPU)
  install_optimizations(default_optimizations());
  CHECK(!g_fp8_cache.on && g_fp8_cache.scales.empty() && g_persistent.format == &kPersistBf16);
  CHECK(g_stages.store_qkv == store_qkv_fast && g_stages.attention_decode == fused_attention_decode_stage);
  install_optimizations(parsed("none"), "fp8");  // without flash_attn: no stages (use_fp8_cache refuses it)
  CHECK(g_fp8_cache.on && !g_hooks.forward);
  install_optimizations(default_optimizations());
}

// Section 32a's order: with an fp8 cache, a decode batch sorted by context length, longest first, ties kept in
// the scheduler's order (stable), the same sequences; with a bf16 cache, the batch as it was.
// FP8 weights (sections 28-30) install the way every chapter does: the load hook, section 14's two product
// stages (with the ones they replace kept for bf16 engines), and the persistent kernel's start-up wrapped so
// that an engine holding FP8 weights plans no persistent step; off (or --plain), none of it, and a bf16
// engine's stages are the ones behind.
TEST(fp8_weights_install_through_the_stages) {
  install_optimizations(default_optimizations());
  CHECK(g_opt.fp8_weights && g_opt.fp8_gemv && g_hooks.load_weights == fp8_load_weights);
  CHECK(!g_fp8_weights.held && g_fp8_weights.layers.empty());
  bool persist_plain = false, persist_wrapped = false;
  for (auto ready : g_hooks.model_ready) {
    persist_plain |= ready == persist_model_ready;
    persist_wrapped |= ready == fp8_persistent_model_ready;
  }
  CHECK(persist_wrapped && !persist_plain);
  install_optimizations(parsed("none,fp8_weights"));
  CHECK(g_hooks.forward == forward_fast && g_stages.norm_matmul == fp8_norm_matmul &&
        g_fp8_weights.norm_matmul_bf16 == norm_matmul_plain && g_fp8_weights.matmul_out_bf16 == matmul_out_plain);
  install_optimizations(parsed("all,-fp8_weights"));
  CHECK(!g_opt.fp8_weights && !g_hooks.load_weights && g_stages.norm_matmul == gemv_norm_matmul);
  install_optimizations(parsed("none"));
  CHECK(!g_hooks.load_weights && !g_opt.fp8_weights);
  install_optimizations(default_optimizations());
}

TEST(longest_first_orders_decode_rows) {
  std::vector<Sequence> seqs;
  seqs.reserve(8);
  const int lens[] = {5, 300, 17, 300, 1, 17, 4096, 300};
  for (int i = 0; i < 8; i++) seqs.emplace_back(i, std::vector<int>(lens[i], 7), SamplingParams{}, 16);
  std::vector<Sequence*> batch;
  for (auto& s : seqs) batch.push_back(&s);
  std::vector<Sequence*> sorted = batch;
  g_fp8_cache.on = false;
  order_longest_first(sorted);
  CHECK(sorted == batch);
  g_fp8_cache.on = true;
  order_longest_first(sorted);
  g_fp8_cache.on = false;
  const int want[] = {6, 1, 3, 7, 2, 5, 0, 4};  // by length, then by place in the batch
  for (int i = 0; i < 8; i++)
    CHECK_MSG(sorted[i] == batch[want[i]], "row %d holds sequence %d (length %d), expected %d", i,
              (int)(sorted[i] - batch[0]), sorted[i]->size(), want[i]);
}

// ... and the engine applies it to decode steps only: a fake runner records each step's rows and answers
// with a token that depends on the sequence alone. With the switch on, every decode step's rows run longest
// first and every prefill step's rows come as scheduled (the same steps as with it off); the completions are
// the same either way (the engine reads each token back by its row).
struct RecordingRunner : StepRunner {
  std::vector<std::pair<bool, std::vector<int64_t>>> steps;  // (is_prefill, the rows' seq_ids)
  std::vector<std::vector<int>> sizes;                       // the rows' context lengths
  std::vector<int> run(const std::vector<Sequence*>& seqs, bool is_prefill) override {
    steps.push_back({is_prefill, {}});
    sizes.push_back({});
    std::vector<int> out;
    for (const Sequence* s : seqs) {
      steps.back().second.push_back(s->seq_id);
      sizes.back().push_back(s->size());
      out.push_back((int)(s->seq_id * 100 + s->num_completion_tokens()) % 151000);
    }
    return out;
  }
  int padded_batch(int B, bool) const override { return B; }
};
TEST(longest_first_reorders_decode_steps_only) {
  std::vector<Request> reqs;
  for (int i = 0; i < 12; i++) {  // prompts of 3..80 tokens, outputs of 5..27, so contexts differ every step
    Request r;
    r.prompt_token_ids = iota_tokens(3 + (i * 37) % 78, i);
    r.params = params_len(5 + (i * 7) % 23);
    reqs.push_back(r);
  }
  std::vector<std::vector<int>> tokens[2];
  RecordingRunner runners[2];
  for (int on = 0; on < 2; on++) {
    // (the order applies to an fp8 cache; no GPU: the format's apply, not its use, which needs one)
    install_optimizations(parsed(on ? "none,longest_first" : "none"), "fp8");
    Config c = small_config(200, 16, 64);  // a small token budget: prompts spread over several prefill steps
    LLMEngine e(c, runners[on]);
    for (const Completion& o : e.generate(reqs)) tokens[on].push_back(o.token_ids);
  }
  install_optimizations(default_optimizations());  // (and the format back to bf16)
  CHECK_MSG(tokens[0] == tokens[1], "the completions differ with longest_first on");
  CHECK_EQ(runners[0].steps.size(), runners[1].steps.size());
  int decode_steps = 0, reordered = 0;
  for (size_t k = 0; k < runners[1].steps.size() && k < runners[0].steps.size(); k++) {
    const auto &off = runners[0].steps[k], &on = runners[1].steps[k];
    CHECK_EQ(off.first, on.first);
    if (on.first) {
      CHECK_MSG(on.second == off.second, "prefill step %zu: rows reordered", k);
      continue;
    }
    decode_steps++;
    const std::vector<int>& sz = runners[1].sizes[k];
    CHECK_MSG(std::is_sorted(sz.rbegin(), sz.rend()), "decode step %zu: rows not longest first", k);
    std::vector<int64_t> a = off.second, b = on.second;
    reordered += a != b;
    std::sort(a.begin(), a.end()), std::sort(b.begin(), b.end());
    CHECK_MSG(a == b, "decode step %zu: not the same sequences", k);
  }
  CHECK(decode_steps > 0 && reordered > 0);  // the workload did exercise the order
}

// Section 23's rungs: ascending, within the step budget and PREFILL_GRAPH_MAX_T, and every step size up to
// the last rung finds one that holds it with fewer than 128 padding rows (below 128: a rung under 2T + 16).
TEST(prefill_graph_rungs_bound_the_padding) {
  for (int Tmax : {8, 16, 100, 512, 2048, 2100, 16384}) {
    const std::vector<int> rungs = prefill_graph_sizes(Tmax);
    CHECK_MSG(std::is_sorted(rungs.begin(), rungs.end()), "Tmax %d: rungs out of order", Tmax);
    for (int r : rungs) CHECK_MSG(r <= Tmax && r <= PREFILL_GRAPH_MAX_T, "Tmax %d: rung %d too large", Tmax, r);
    const int top = rungs.empty() ? 0 : rungs.back();
    CHECK_MSG(Tmax < 16 || top == std::min(Tmax, PREFILL_GRAPH_MAX_T) / 128 * 128 ||
                  (Tmax < 128 && top == (Tmax >= 64 ? 64 : Tmax >= 32 ? 32 : 16)),
              "Tmax %d: last rung %d", Tmax, top);
    for (int T = 1; T <= top; T++) {
      auto it = std::lower_bound(rungs.begin(), rungs.end(), T);
      CHECK_MSG(it != rungs.end() && *it - T < 128 && *it < 2 * T + 16,
                "Tmax %d: T=%d pads to %d", Tmax, T, it == rungs.end() ? -1 : *it);
    }
  }
}

// Every optimization is on by default (section 24's persistent kernel then takes only the batch sizes it
// measures faster at start-up).
TEST(defaults_are_all) {
  OptimizationSet o = default_optimizations();
  CHECK_EQ(count_on(o), (int)reg().size());
  CHECK(is_on(o, "persistent") && is_on(o, "fp8_gemv"));
  CHECK_EQ(optimizations_str(o), std::string("all"));
  OptimizationSet one_off = o;
  CHECK_EQ(parse_optimizations("-fp8_gemv", one_off), std::string(""));
  CHECK_EQ(optimizations_str(one_off), std::string("all except fp8_gemv"));
  Config c;
  CHECK(c.opt == o);
  CHECK_EQ(parse_optimizations("all", o), std::string(""));
  CHECK_EQ(optimizations_str(o), std::string("all"));
}

// Section 24's weight stream: the chunks a thread block's cursor visits (persist_seek, then the next column
// chunk, as persist_issue steps it) come in the order the kernel's main loop uses them: operation by
// operation, the block's groups (block, block + grid, ...), each group's column chunks in order; none of
// operations that are not matrix products or in which the block has no group; and once past the last, none
// again. The cursor holds the fields of the operation it is in (for FP8 weights, K in the stream's 16-bit
// units: half the row's bytes). Any other order would multiply one operation's weights by another's input.
// Random operation lists, some with FP8 weights, grids of 1 to 132 blocks.
TEST(persistent_weight_stream_order) {
  std::mt19937 rng(23);
  const int kinds[] = {PERSIST_EMBED,   PERSIST_QKV,  PERSIST_ATTN,    PERSIST_O,
                       PERSIST_GATE_UP, PERSIST_DOWN, PERSIST_LM_HEAD, PERSIST_ALLREDUCE};
  const int grids[] = {1, 3, 7, 132};
  size_t visited = 0;
  for (int trial = 0; trial < 400; trial++) {
    const int grid = grids[trial % 4], n = 1 + (int)(rng() % 12);
    std::vector<PersistOp> ops(n);
    for (int i = 0; i < n; i++) {
      PersistOp& op = ops[i];
      op = PersistOp{};
      op.kind = kinds[rng() % 8], op.layer = i;
      op.W = reinterpret_cast<const bf16*>((uintptr_t)(i + 1) << 20);
      op.K = 1 + (int)(rng() % 5000), op.N = 1 + (int)(rng() % 3000);
      if (persist_is_gemv(op.kind) && rng() % 3 == 0) {  // FP8 weights (section 30a): K bytes, K / 2 in the stream
        static const float scale = 1.f;
        op.K = 128 * (1 + (int)(rng() % 40)), op.wscale = &scale;
      }
      op.groups = rng() % 4 ? 1 + (int)(rng() % 400) : (int)(rng() % 3);  // some with fewer groups than blocks
    }
    for (int block = 0; block < grid; block++) {
      std::vector<std::vector<int>> want, got;  // (operation, group, column chunk)
      for (int o = 0; o < n; o++) {
        if (!persist_is_gemv(ops[o].kind)) continue;
        for (int g = block; g < ops[o].groups; g += grid)
          for (int kc = 0; kc < persist_k_chunks(ops[o]); kc++) want.push_back({o, g, kc});
      }
      PersistCursor c = persist_cursor_start();
      bool fields = true;
      while (got.size() <= want.size() && persist_seek(n, ops.data(), c, block, grid)) {
        got.push_back({c.o, c.g, c.kc});
        const PersistOp& op = ops[c.o];
        const bool gate_up = op.kind == PERSIST_GATE_UP;
        fields &= c.W == op.W && c.K == (op.wscale ? op.K / 2 : op.K) && c.N == op.N && c.groups == op.groups &&
                  c.kchunks == (op.wscale ? (op.K + 2047) / 2048 : (op.K + 1023) / 1024) &&
                  c.per == (gate_up ? 8 : 16) && c.half == (gate_up ? op.N : 8);
        c.kc++, c.n++;
      }
      CHECK_MSG(got == want, "trial %d, block %d of %d: the cursor visited %zu chunks, the kernel uses %zu",
                trial, block, grid, got.size(), want.size());
      CHECK_MSG(fields, "trial %d, block %d: the cursor's fields are not its operation's", trial, block);
      CHECK(!persist_seek(n, ops.data(), c, block, grid) && !persist_seek(n, ops.data(), c, block, grid));
      visited += got.size();
    }
  }
  CHECK(visited > 100000);  // the lists are not all empty
}

// Section 27's routing by context: where the kernel's line meets section 14's less the margin, from two
// measurements; and the plan a step gets on either side of that limit. Pure host arithmetic.
TEST(persistent_routing_by_context) {
  const double m = PERSIST_ROUTE_MARGIN;
  // Section 14: 900 us at 512 keys, +0.06 us a key; the kernel: 800 us at 512, +0.14 us a key. Their lead
  // less the margin, 0.98 (900 + 0.06 x) - (800 + 0.14 x) = 82 - 0.0812 x with x = keys past 512, reaches 0
  // at x = 1,009.9: 1,521 keys.
  const PersistTimes a{512, 900, 800}, b{4096, 900 + 0.06 * 3584, 800 + 0.14 * 3584};
  const int limit = persist_context_limit(a, &b, m);
  CHECK_MSG(limit == 1521, "limit %d", limit);
  // The same lines measured at two other contexts give the same limit (it is where they meet, not a point).
  const PersistTimes c{1024, 900 + 0.06 * 512, 800 + 0.14 * 512}, d{2048, 900 + 0.06 * 1536, 800 + 0.14 * 1536};
  CHECK_EQ(persist_context_limit(c, &d, m), limit);
  // Still faster at the longer context (a kernel line of +0.07 us a key: 82 - 0.0112 x, 0 at x = 7,321.4): the
  // line is followed past it.
  const PersistTimes e{4096, 900 + 0.06 * 3584, 800 + 0.07 * 3584};
  const int far = persist_context_limit(a, &e, m);
  CHECK_MSG(far == 7833, "limit %d", far);
  // A lead that does not shrink, or a single measurement: every context. Not faster at the first: none.
  const PersistTimes f{4096, 1200, 1000};
  CHECK_EQ(persist_context_limit(a, &f, m), INT_MAX);
  CHECK_EQ(persist_context_limit(a, nullptr, m), INT_MAX);
  CHECK_EQ(persist_context_limit(PersistTimes{512, 900, 890}, &b, m), 0);  // 1.1% faster: inside the margin
  // The plan for a step: its batch size routed and its longest context within the limit.
  const Optimizations saved = g_opt;
  g_opt.persistent = true;
  PersistentDecode pd;
  pd.plans[1], pd.plans[2], pd.plans[4];
  pd.route = {1, 2};
  pd.context_limit[1] = limit;
  CHECK(pd.plan_for(1, 1) == &pd.plans[1] && pd.plan_for(1, limit) == &pd.plans[1]);
  CHECK(pd.plan_for(1, limit + 1) == nullptr);
  CHECK(pd.plan_for(2, 100000) == &pd.plans[2] && pd.limit_for(2) == INT_MAX);  // no limit: every context
  CHECK(pd.plan_for(4, 1) == nullptr && pd.limit_for(4) == 0);                 // not routed
  CHECK(pd.plan_for(8, 1) == nullptr && pd.limit_for(8) == 0);                 // no plan
  g_opt.persistent = false;
  CHECK(pd.plan_for(1, 1) == nullptr && pd.limit_for(1) == 0);
  g_opt = saved;
}

// Section 27's cache of the routing measurement: what it writes it reads back whole; anything else (another
// key, a corrupted time, a missing or extra batch size, a context the run would not time, a time that is not
// finite and positive, a file cut short or not JSON) is refused, so the run measures again.
TEST(persistent_routing_cache_trusts_only_a_whole_entry) {
  char dir_template[] = "/tmp/nanovllm_cache_XXXXXX";
  const std::string dir = std::string(mkdtemp(dir_template)) + "/a/b";  // made by the writer
  const int longest = 4095;
  PersistentDecode pd;
  pd.plans[1], pd.plans[2], pd.plans[4];
  // B=1 wins at 512 keys (so 4,095 is timed too), B=2 and 4 do not (one time each).
  pd.timed[1] = {{512, 900, 800}, {4095, 1115, 1302}};
  pd.timed[2] = {{512, 950, 990}};
  pd.timed[4] = {{512, 1000, 1100}};
  const std::string key = "gpu=test model=1,2,3 plan=1:132:1000";
  const std::string path = persist_cache_path(dir, key);
  persist_cache_write(dir, path, key, pd);
  auto read = [&](const std::string& k) {
    PersistentDecode q;
    q.plans[1], q.plans[2], q.plans[4];
    const bool ok = persist_cache_read(path, k, q, longest);
    if (ok) {
      CHECK(q.timed.size() == 3 && q.timed[1].size() == 2 && q.timed[1][1].context == 4095 &&
            q.timed[1][1].kernel == 1302 && q.timed[2][0].fused == 950);
      persist_route(q, longest);
      CHECK(q.route == std::set<int>({1}) && q.context_limit.count(1) && !q.context_limit.count(2));
    }
    return ok;
  };
  CHECK(read(key));
  CHECK(!read(key + " "));  // another key: another GPU, driver, model or build
  const std::string good = [&] { std::ifstream f(path); return std::string(std::istreambuf_iterator<char>(f), {}); }();
  auto edited = [&](const std::string& from, const std::string& to) {  // the file with one edit; read back
    std::string t = good;
    const size_t at = t.find(from);
    CHECK_MSG(at != std::string::npos, "'%s' not in the cache file", from.c_str());
    if (at != std::string::npos) t.replace(at, from.size(), to);
    std::ofstream(path) << t;
    return read(key);
  };
  CHECK(!edited("1302", "1301"));              // a time changed: the checksum does not match
  CHECK(!edited("\"4\"", "\"8\""));            // a batch size without a plan (and B=4 missing)
  CHECK(!edited("4095", "2048"));              // a context this run would not time
  std::ofstream(path) << good.substr(0, good.size() / 2);  // cut short
  CHECK(!read(key));
  std::ofstream(path) << "not json";
  CHECK(!read(key));
  // A measurement that is not finite, or not positive, is refused even with a matching checksum.
  PersistentDecode bad = pd;
  bad.timed[2] = {{512, std::nan(""), 990}};
  persist_cache_write(dir, path, key, bad);
  CHECK(!read(key));
  bad.timed[2] = {{512, 950, 0}};
  persist_cache_write(dir, path, key, bad);
  CHECK(!read(key));
  // The times of B=2 say the kernel won at 512 keys, but the file has no longer context for it: refused.
  bad = pd;
  bad.timed[2] = {{512, 950, 800}};
  persist_cache_write(dir, path, key, bad);
  CHECK(!read(key));
  persist_cache_write(dir, path, key, pd);  // and rewritten whole, it is read again
  CHECK(read(key));
  unlink(path.c_str());
  CHECK(!read(key));  // no file
}

TEST(parse_lists_left_to_right) {
  OptimizationSet o = parsed("none");
  CHECK_EQ(count_on(o), 0);
  CHECK_EQ(optimizations_str(o), std::string("none (Part I alone)"));
  CHECK_EQ(parse_optimizations("gemv,+pdl", o), std::string(""));
  CHECK(is_on(o, "gemv") && is_on(o, "pdl") && count_on(o) == 2);
  CHECK_EQ(optimizations_str(o), std::string("pdl gemv"));
  CHECK_EQ(parse_optimizations("all,-fused_rope,-fast_sampler", o), std::string(""));
  CHECK(!is_on(o, "fused_rope") && !is_on(o, "fast_sampler") && is_on(o, "gemv") && is_on(o, "flash_attn"));
  CHECK_EQ(parse_optimizations("-pdl,none,cluster_merge", o), std::string(""));  // none resets what came before
  CHECK_EQ(count_on(o), 1);
  CHECK(is_on(o, "cluster_merge"));
  CHECK_EQ(parse_optimizations("all", o), std::string(""));
  CHECK_EQ(count_on(o), (int)reg().size());
}

TEST(parse_refuses_what_it_does_not_know) {
  OptimizationSet o = default_optimizations();
  std::string e = parse_optimizations("none,fused_gemv", o);
  CHECK_MSG(e.find("unknown optimization 'fused_gemv'") != std::string::npos, "%s", e.c_str());
  for (const Optimization& k : reg()) CHECK_MSG(e.find(k.name) != std::string::npos, "%s", e.c_str());
  CHECK(!parse_optimizations("", o).empty());
  CHECK(!parse_optimizations("gemv,", o).empty());  // an empty item is an unknown name
  CHECK(!parse_optimizations("-none", o).empty());
  CHECK(!parse_optimizations("+all", o).empty());
  CHECK(!parse_optimizations("GEMV", o).empty());
}

// --plain and --opt on the command line, as main() sees them; --help lists every name.
TEST(command_line_flags) {
  auto parse = [](std::vector<const char*> args) {
    args.insert(args.begin(), "nanovllm");
    return parse_args((int)args.size(), const_cast<char**>(args.data()));
  };
  CHECK_EQ(count_on(parse({"model", "p.txt"}).config.opt), (int)reg().size());  // all
  CHECK_EQ(count_on(parse({"--plain", "model"}).config.opt), 0);
  Cli c = parse({"--opt", "-pdl", "--opt=-gemv"});
  CHECK(!is_on(c.config.opt, "pdl") && !is_on(c.config.opt, "gemv") && is_on(c.config.opt, "fused_rope"));
  c = parse({"--plain", "--opt", "fast_sampler"});
  CHECK_EQ(count_on(c.config.opt), 1);
  CHECK(is_on(c.config.opt, "fast_sampler"));
  const std::string help = usage_text();
  for (const Optimization& k : reg())
    CHECK_MSG(help.find(std::string(k.name) + ": " + k.what) != std::string::npos, "--help does not name %s",
              k.name);
  CHECK(help.find("--plain") != std::string::npos && help.find('@') == std::string::npos);
  // The scheduler: vLLM V1's on the command line unless --scheduler nano (the engine's Config keeps nano-vllm's).
  CHECK(parse({"model", "p.txt"}).config.mixed_scheduler);
  CHECK(!parse({"model", "p.txt", "--scheduler", "nano"}).config.mixed_scheduler);
  CHECK(parse({"--scheduler=mixed", "model"}).config.mixed_scheduler);
  CHECK(!Config{}.mixed_scheduler);
  CHECK(help.find("(mixed)") != std::string::npos);
}

// The workers build their engine from Config as JSON (section 12b): the switch must survive the trip.
TEST(switch_travels_to_the_workers) {
  Config c;
  c.opt = parsed("none,gemv,oneshot_allreduce");
  Config back = config_from_json(config_to_json(c));
  CHECK(back.opt == c.opt);
  CHECK(!(back.opt == default_optimizations()));
}

int main(int argc, char** argv) { return test_main(argc, argv); }
