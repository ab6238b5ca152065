// gpu_moe.cu — section 10b (a mixture of experts, Qwen3-MoE) on the GPU: each kernel against the CPU reference
// beside it in nanovllm.cu, at awkward sizes (one token, widths that are not multiples of the tile, every expert
// per token), on routings where most experts get no row and where one expert gets every row; the experts' steps
// replayed from a CUDA graph while the routing changes under it (the graph-capturable design); the loader's
// experts at --tp 1 and as rank 1 of --tp 2; and a tiny random MoE checkpoint end to end: the plain path's
// CUDA-graph decode bit for bit against the same steps run eagerly, and the default switches (attention's
// chapters and sections 33-36) against the plain path. Section 33 (fused_moe, the experts on tensor cores): its
// products against the CPU references and Part I's path at awkward widths and tensor-parallel slices, its sum bit
// for bit, its CUDA-graph replay, and the tiny checkpoint with it alone; section 34 (moe_gemv, small steps)
// against the CPU reference eagerly and from a graph, its router in one kernel bit for bit against the three
// launches it stands for, and the tiny checkpoint with it (graphs against eager steps at 2 sequences, with and
// without that router; logits against the plain path); section 35 (FP8 experts) against its references and on an
// FP8 folder; section 36 (the persistent kernel's MoE layers) against section 14's path and Part I's, its thread
// blocks held back, and in the engine's graphs. Every case poisons its outputs first. Without a visible GPU every
// case is SKIPPED.
//   build: make build/gpu_moe (CUDA_ARCH=90a where no GPU is visible)
//   run:   ./build/gpu_moe [NAME_SUBSTRING]   (from the repository root: the end-to-end cases run
//          test/ref/make_tiny_checkpoint.py with python3)
#define NANOVLLM_TESTING
#include "../../nanovllm.cu"
#include "../test.h"

#include "gpu_fixtures.h"

// n bf16 values (as floats) uniform in +-amp, never zero (a zero hides a missing write): splitmix64 of a
// counter seeded by rng, fast enough for Qwen3-30B-A3B's 600M expert weights.
static std::vector<float> bf16_values(size_t n, std::mt19937& rng, float amp) {
  std::vector<float> v(n);
  const uint64_t seed = ((uint64_t)rng() << 32) | rng();
  for (size_t i = 0; i < n; i++) {
    const float u = (float)(splitmix64(seed + i) >> 40) * (2.0f / 16777216.0f) - 1.0f;  // [-1, 1)
    v[i] = bf16_round(u == 0.f ? amp : u * amp);
  }
  return v;
}
static std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> b(v.size());
  for (size_t i = 0; i < v.size(); i++) b[i] = __float2bfloat16(v[i]);
  return b;
}
static std::vector<float> to_float(const std::vector<bf16>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); i++) f[i] = __bfloat162float(v[i]);
  return f;
}

// ---- moe_route ----------------------------------------------------------------------------------------

// Logits of few distinct values (many exact ties, at the k-th place too) or drawn freely; the GPU's ids
// exactly as the reference's, its weights within fp32's rounding of the double reference.
TEST(moe_route_matches_reference) {
  REQUIRE_GPU();
  std::mt19937 rng(1);
  int cases = 0;
  for (int E : {1, 3, 8, 33, 128, 512})
    for (int k : {1, 2, 8, 32})
      for (int T : {1, 37, 300})
        for (int ties : {0, 1}) {
          if (k > E) continue;
          std::vector<float> logits((size_t)T * E);
          if (ties) {
            for (float& x : logits) x = (float)(rng() % 9) * 0.5f - 2.f;
          } else {
            logits = bf16_values(logits.size(), rng, 2.f);
          }
          DevBuf<bf16> d_logits(to_bf16(logits));
          for (bool norm : {false, true}) {
            DevBuf<int> ids((size_t)T * k);
            DevBuf<float> w((size_t)T * k);
            ids.poison(), w.poison();
            moe_route(ids.p, w.p, d_logits.p, T, E, k, norm, 0);
            CUDA_CHECK(cudaDeviceSynchronize());
            std::vector<int> want_ids((size_t)T * k);
            std::vector<float> want_w((size_t)T * k);
            moe_route_reference(want_ids.data(), want_w.data(), logits.data(), T, E, k, norm);
            const std::vector<int> got_ids = ids.download();
            size_t bad = 0, first = 0;
            for (size_t i = 0; i < got_ids.size(); i++)
              if (got_ids[i] != want_ids[i] && !bad++) first = i;
            CHECK_MSG(bad == 0, "E %d k %d T %d ties %d norm %d: %zu ids differ, first [%zu] %d vs %d", E, k, T,
                      ties, norm, bad, first, got_ids[first], want_ids[first]);
            const std::vector<float> got_w = w.download();
            check_close("routing weights", got_w.data(), want_w.data(), got_w.size(), 1e-7f, 4e-6f);
            cases++;
          }
        }
  printf("    %d routings\n", cases);
}

// ---- moe_align ----------------------------------------------------------------------------------------

// Routings as the experts see them: uniform, skewed onto few experts (most get no row), every token on one
// expert; the lists byte for byte as moe_align_reference's (rows past the last run are not the kernel's to
// write).
static std::vector<int> routing(int T, int E, int k, int kind, std::mt19937& rng) {
  std::vector<int> ids((size_t)T * k);
  for (int t = 0; t < T; t++) {
    std::vector<int> all(E);
    std::iota(all.begin(), all.end(), 0);
    if (kind == 0) std::shuffle(all.begin(), all.end(), rng);                      // uniform
    if (kind == 1) std::shuffle(all.begin(), all.begin() + std::min(E, k + 1), rng);  // the first k + 1 only
    if (kind == 2) std::swap(all[0], all[E - 1]);                                    // E - 1 in every token
    std::copy(all.begin(), all.begin() + k, ids.begin() + (size_t)t * k);
  }
  return ids;
}

TEST(moe_align_matches_reference) {
  REQUIRE_GPU();
  std::mt19937 rng(2);
  for (int tile : {MOE_TILE, 32, MOE_TILE_MAX})
  for (int E : {1, 5, 128, 512})
    for (int k : {1, 2, 8})
      for (int T : {1, 7, 300, 2000})
        for (int kind : {0, 1, 2}) {
          if (k > E) continue;
          const std::vector<int> ids = routing(T, E, k, kind, rng);
          std::vector<int> rows, pair_row, tiles;
          moe_align_reference(rows, pair_row, tiles, ids.data(), T, k, E, tile);
          DevBuf<int> d_ids(ids), d_rows(rows.size()), d_pair(pair_row.size()), d_tiles(tiles.size());
          d_rows.poison(), d_pair.poison(), d_tiles.poison();
          moe_align(d_rows.p, d_pair.p, d_tiles.p, d_ids.p, T, k, E, 0, tile);
          CUDA_CHECK(cudaDeviceSynchronize());
          const std::vector<int> got_tiles = d_tiles.download(), got_pair = d_pair.download();
          std::vector<int> got_rows = d_rows.download();
          size_t used = 0;
          while (used < tiles.size() && tiles[used] >= 0) used++;
          got_rows.resize(used * tile), rows.resize(used * tile);
          CHECK_MSG(got_tiles == tiles && got_pair == pair_row && got_rows == rows,
                    "tile %d E %d k %d T %d kind %d: tiles %d, pair rows %d, rows %d", tile, E, k, T, kind,
                    got_tiles == tiles, got_pair == pair_row, got_rows == rows);
        }
}

// ---- the experts: moe_matmul, silu_and_mul, moe_combine -------------------------------------------------

// The scratch of a MoE layer for T tokens (Activations' moe_* fields), poisoned.
struct MoEScratch {
  DevBuf<int> rows, pair_row, tiles;
  DevBuf<bf16> gate_up, act, out;
  Activations a{};
  MoEScratch(int T, int H, int IE, int E, int k)
      : rows(moe_rows_alloc(T, k, E)), pair_row((size_t)T * k), tiles(moe_rows_alloc(T, k, E) / MOE_TILE),
        gate_up(moe_rows_alloc(T, k, E) * 2 * IE), act(moe_rows_alloc(T, k, E) * IE),
        out(moe_rows_alloc(T, k, E) * H) {
    for (auto* b : {&rows, &pair_row, &tiles}) b->poison();
    for (auto* b : {&gate_up, &act, &out}) b->poison();
    a.moe_rows = rows.p, a.moe_pair_row = pair_row.p, a.moe_tile_expert = tiles.p;
    a.moe_gate_up = gate_up.p, a.moe_act = act.p, a.moe_out = out.p;
  }
};

struct ExpertsCase {
  const char* what;
  int T, H, IE, E, k, kind;  // kind: as routing()'s
};

// n routing weights in [0.1, 1.1).
static std::vector<float> routing_weights(size_t n, std::mt19937& rng) {
  std::vector<float> w(n);
  for (float& v : w) v = 0.1f + (float)(rng() % 1000) / 1000.f;
  return w;
}

// The rounds of a case: with graph, `run` captured once and replayed under three routings (kind c.kind, then
// the two others), else run once eagerly; after each, check(ids, w, round) with the routing and weights of
// that round (out poisoned before each).
template <class Run, class Check>
static void routing_rounds(const ExpertsCase& c, std::mt19937& rng, bool graph, DevBuf<int>& d_ids,
                           DevBuf<float>& d_w, DevBuf<bf16>& d_out, cudaStream_t stream, Run run, Check check) {
  cudaGraphExec_t exec = nullptr;
  for (int round = 0; round < (graph ? 3 : 1); round++) {  // with a graph: three routings, one capture
    const std::vector<int> ids = routing(c.T, c.E, c.k, round == 0 ? c.kind : (c.kind + round) % 3, rng);
    const std::vector<float> w = routing_weights((size_t)c.T * c.k, rng);
    d_ids.upload(ids), d_w.upload(w);
    d_out.poison();
    if (graph && !exec) {
      cudaGraph_t g;
      CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      run();
      CUDA_CHECK(cudaStreamEndCapture(stream, &g));
      CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
      CUDA_CHECK(cudaGraphDestroy(g));
    }
    if (graph) CUDA_CHECK(cudaGraphLaunch(exec, stream));
    else run();
    CUDA_CHECK(cudaStreamSynchronize(stream));
    check(ids, w, round);
  }
  if (exec) CUDA_CHECK(cudaGraphExecDestroy(exec));
}

// The experts' products run the same three products as the CPU in another order (fp32 inside each tile
// against double): an intermediate bf16 rounding may land one step apart, so the outputs agree within a few
// bf16 steps; a wrong row, expert, weight or order of the sum is far outside that. how: section 10b's
// moe_experts, section 33's fused_moe (the same arguments, the same reference: test_moe.cu checks that
// fused_moe_reference's sum is moe_experts_reference's bit for bit) or section 34's moe_gemv (whose CPU
// reference is moe_experts_reference itself: the same roundings, the sum in the same order).
enum class Experts { PLAIN, FUSED, FUSED_WIDE, GEMV };
static void check_experts(const ExpertsCase& c, std::mt19937& rng, bool graph, Experts how = Experts::PLAIN) {
  const auto x = bf16_values((size_t)c.T * c.H, rng, 1.f);
  const auto gate_up = bf16_values((size_t)c.E * 2 * c.IE * c.H, rng, 0.06f);
  const auto down = bf16_values((size_t)c.E * c.H * c.IE, rng, 0.06f);
  DevBuf<bf16> d_x(to_bf16(x)), d_gate_up(to_bf16(gate_up)), d_down(to_bf16(down)), d_out((size_t)c.T * c.H);
  MoEScratch s(c.T, c.H, c.IE, c.E, c.k);
  DevBuf<int> d_ids((size_t)c.T * c.k);
  DevBuf<float> d_w((size_t)c.T * c.k);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto run = [&] {
#ifdef NANOVLLM_PART_II
    if (how == Experts::FUSED || how == Experts::FUSED_WIDE)
      return fused_moe(d_out.p, d_x.p, d_ids.p, d_w.p, d_gate_up.p, d_down.p, c.T, c.H, c.IE, c.E, c.k, s.a, stream,
                       how == Experts::FUSED ? MOE_TILE : FMOE_WIDE_TILE);
    if (how == Experts::GEMV)
      return moe_gemv(d_out.p, d_x.p, d_ids.p, d_w.p, d_gate_up.p, d_down.p, c.T, c.H, c.IE, c.k, s.act.p, stream);
#endif
    moe_experts(d_out.p, d_x.p, d_ids.p, d_w.p, d_gate_up.p, d_down.p, c.T, c.H, c.IE, c.E, c.k, s.a, stream);
  };
  routing_rounds(c, rng, graph, d_ids, d_w, d_out, stream, run, [&](const std::vector<int>& ids,
                                                                     const std::vector<float>& w, int round) {
    std::vector<float> want((size_t)c.T * c.H);
    moe_experts_reference(want.data(), x.data(), ids.data(), w.data(), gate_up.data(), down.data(), c.T, c.H, c.IE,
                          c.k);
    const std::vector<float> got = to_float(d_out.download());
    float scale = 0;
    for (float v : want) scale = std::max(scale, fabsf(v));
    char what[160];
    snprintf(what, sizeof what, "%s%s (T %d H %d IE %d E %d k %d%s, routing %d)",
             how == Experts::FUSED        ? "fused: "
             : how == Experts::FUSED_WIDE ? "fused, 64-row tiles: "
             : how == Experts::GEMV       ? "gemv: "
                                          : "",
             c.what,
             c.T, c.H, c.IE, c.E, c.k, graph ? ", graph replay" : "", round);
    check_close(what, got.data(), want.data(), got.size(), 0.01f * scale, 2.f / 128);
  });
  CUDA_CHECK(cudaStreamDestroy(stream));
}

static const ExpertsCase kExpertsCases[] = {
    {"one token", 1, 256, 128, 8, 2, 0},
    {"tiny-moe's shape", 37, 256, 128, 8, 2, 0},
    {"widths not multiples of the tile", 45, 264, 24, 7, 3, 0},
    {"every expert in every token", 5, 64, 16, 5, 5, 0},
    {"most experts without a row", 300, 128, 32, 64, 2, 1},
    {"one expert in every token", 300, 128, 32, 16, 1, 2},
    {"Qwen3-30B-A3B's widths", 70, 2048, 768, 128, 8, 0},
};

TEST(moe_experts_match_reference) {
  REQUIRE_GPU();
  std::mt19937 rng(3);
  for (const ExpertsCase& c : kExpertsCases) check_experts(c, rng, false);
}

// The experts' steps captured once in a CUDA graph, replayed after the routing changed on the GPU (another
// kind of routing each time): the work of every step is fixed by T, so the replay is right for any routing.
TEST(moe_experts_replay_from_a_cuda_graph) {
  REQUIRE_GPU();
  std::mt19937 rng(4);
  for (const ExpertsCase& c : kExpertsCases) check_experts(c, rng, true);
}

// ---- section 33: fused_moe, the experts on tensor cores ----------------------------------------------

#ifdef NANOVLLM_PART_II
// Its awkward sizes: H not a multiple of the thread block's 64 columns (264 = 4 x 64 + 8), IE not a multiple of
// its 32 (24, 40, and Qwen3-30B-A3B's 768 sliced by --tp 2, 4, 8: 384, 192, 96), one token, a token in the
// hundreds, experts that get no row, one expert that gets every row (several tiles of it), every expert in
// every token. (The preconditions: H and IE multiples of 8.)
static const ExpertsCase kFusedCases[] = {
    {"one token", 1, 256, 128, 8, 2, 0},
    {"tiny-moe's shape", 37, 256, 128, 8, 2, 0},
    {"widths not multiples of the thread block's", 45, 264, 24, 7, 3, 0},
    {"every expert in every token", 5, 64, 16, 5, 5, 0},
    {"most experts without a row", 300, 128, 32, 64, 2, 1},
    {"one expert in every token", 300, 136, 40, 16, 1, 2},
    {"hundreds of tokens, 128 experts top-8", 256, 1024, 256, 128, 8, 0},
    {"Qwen3-30B-A3B's widths", 70, 2048, 768, 128, 8, 0},
    {"Qwen3-30B-A3B at --tp 2", 70, 2048, 384, 128, 8, 0},
    {"Qwen3-30B-A3B at --tp 4", 33, 2048, 192, 128, 8, 1},
    {"Qwen3-30B-A3B at --tp 8, one token", 1, 2048, 96, 128, 8, 0},
};

// fused_moe against moe_experts_reference, eagerly, and replayed from a CUDA graph under changing routings
// (three routings each: the cases whose CPU reference is quick enough to run three times); in 16-row tiles
// and in the 64-row tiles of long steps (fused_moe_wide_kernel: its column blocks of 64 act columns and 128
// output columns cut IE 24, 40, 96, 192, 384 and H 264 partially too).
TEST(fused_moe_matches_reference) {
  REQUIRE_GPU();
  std::mt19937 rng(13);
  for (Experts how : {Experts::FUSED, Experts::FUSED_WIDE}) {
    for (const ExpertsCase& c : kFusedCases) check_experts(c, rng, false, how);
    for (const ExpertsCase& c : kFusedCases)
      if ((int64_t)c.T * c.k * c.H * c.IE <= 400000000) check_experts(c, rng, true, how);
  }
}

// The two results bit for bit, and mostly nonzero (a result of zeros matches anything).
static void same_bits(const char* what, const DevBuf<bf16>& x, const DevBuf<bf16>& y) {
  CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<bf16> a = x.download(), b = y.download();
  size_t differ = 0, nonzero = 0;
  for (size_t i = 0; i < a.size(); i++) {
    differ += memcmp(&a[i], &b[i], sizeof(bf16)) != 0;
    nonzero += __bfloat162float(a[i]) != 0.f;
  }
  printf("    %s: %zu of %zu values differ (%zu nonzero)\n", what, differ, a.size(), nonzero);
  CHECK_MSG(differ == 0, "%s: %zu values differ", what, differ);
  CHECK_MSG(nonzero > a.size() / 2, "%s: only %zu of %zu values nonzero", what, nonzero, a.size());
}

// fused_moe's 64-row tiles against its 16-row tiles, bit for bit: the same MMAs along K in the same order
// and the same epilogue, whatever the tile (fused_moe_wide_kernel's claim), at sizes the CPU reference would
// take minutes over: thousands of tokens, 512 experts, one expert in every token (a run of thousands of rows),
// the widths of Qwen3-30B-A3B at --tp 1, 2 and 4. And fused_moe picks the 64-row tiles only where a step's
// experts average FMOE_WIDE_MIN_ROWS rows.
TEST(fused_moe_wide_tiles_match_16_row_tiles) {
  REQUIRE_GPU();
  CHECK_EQ(fused_moe_tile(1, 8, 128), MOE_TILE);
  CHECK_EQ(fused_moe_tile((int64_t)FMOE_WIDE_MIN_ROWS * 128 / 8 - 1, 8, 128), MOE_TILE);
  CHECK_EQ(fused_moe_tile((int64_t)FMOE_WIDE_MIN_ROWS * 128 / 8, 8, 128), FMOE_WIDE_TILE);
  CHECK_EQ(fused_moe_tile((int64_t)FMOE_WIDE_MIN_ROWS_FP8 * 128 / 8 - 1, 8, 128, true), MOE_TILE);
  CHECK_EQ(fused_moe_tile((int64_t)FMOE_WIDE_MIN_ROWS_FP8 * 128 / 8, 8, 128, true), FMOE_WIDE_TILE);
  static const ExpertsCase cases[] = {
      {"Qwen3-30B-A3B's widths, 2,000 tokens", 2000, 2048, 768, 128, 8, 0},
      {"Qwen3-30B-A3B at --tp 2, 1,500 tokens", 1500, 2048, 384, 128, 8, 0},
      {"Qwen3-30B-A3B at --tp 4, 777 tokens, the first 9 experts", 777, 2048, 192, 128, 8, 1},
      {"512 experts, 3,001 tokens", 3001, 1024, 256, 512, 8, 0},
      {"one expert in every token, 4,100 tokens", 4100, 264, 40, 16, 1, 2},
      {"widths not multiples of a block, 999 tokens", 999, 264, 24, 7, 3, 0},
  };
  std::mt19937 rng(19);
  for (const ExpertsCase& c : cases) {
    DevBuf<bf16> x(to_bf16(bf16_values((size_t)c.T * c.H, rng, 1.f)));
    DevBuf<bf16> gate_up(to_bf16(bf16_values((size_t)c.E * 2 * c.IE * c.H, rng, 0.06f)));
    DevBuf<bf16> down(to_bf16(bf16_values((size_t)c.E * c.H * c.IE, rng, 0.06f)));
    DevBuf<bf16> out16((size_t)c.T * c.H), out64((size_t)c.T * c.H);
    MoEScratch s(c.T, c.H, c.IE, c.E, c.k);
    DevBuf<int> ids(routing(c.T, c.E, c.k, c.kind, rng));
    DevBuf<float> d_w(routing_weights((size_t)c.T * c.k, rng));
    out16.poison(), out64.poison();
    fused_moe(out16.p, x.p, ids.p, d_w.p, gate_up.p, down.p, c.T, c.H, c.IE, c.E, c.k, s.a, 0, MOE_TILE);
    s.act.poison(), s.out.poison();
    fused_moe(out64.p, x.p, ids.p, d_w.p, gate_up.p, down.p, c.T, c.H, c.IE, c.E, c.k, s.a, 0, FMOE_WIDE_TILE);
    same_bits(c.what, out16, out64);
  }
}

// Section 34's moe_gemv at 1 to 4 tokens (the stage takes it up to MOE_GEMV_MAX_T; the kernels compute the same
// for any T: the grid's second dimension is T, and at one token the down kernel's warps share an output's
// experts, which changes no sum), at one token with each size of a down row's loads: widths that are not
// multiples of a stretch (H 264, 1,032: a partial stretch of 1,024 columns; IE 24, 776), IE at its limit (2,048) and
// Qwen3-30B-A3B's slices, one choice per token and every expert in every token (k = E), two tokens that chose
// the same experts (routing kind 2: one expert for all), eagerly and replayed from a CUDA graph under
// changing routings.
static const ExpertsCase kGemvCases[] = {
    {"one token", 1, 256, 128, 8, 2, 0},
    {"widths not multiples of a stretch", 3, 264, 24, 7, 3, 0},
    {"a partial second stretch of H", 2, 1032, 776, 16, 4, 0},
    {"every expert in every token", 4, 64, 16, 5, 5, 0},
    {"one expert for every token", 4, 128, 32, 16, 1, 2},
    {"IE at moe_gemv's limit", 2, 512, 2048, 8, 2, 1},
    {"one token, a down row of 8 loads per lane, the last partial", 1, 512, 1544, 8, 3, 0},
    {"Qwen3-30B-A3B's widths, one token", 1, 2048, 768, 128, 8, 0},
    {"Qwen3-30B-A3B's widths, four tokens", 4, 2048, 768, 128, 8, 0},
    {"Qwen3-30B-A3B at --tp 4, two tokens", 2, 2048, 192, 128, 8, 1},
    {"Qwen3-235B-A22B's widths at --tp 2 (16 experts)", 1, 4096, 768, 16, 8, 0},
};
TEST(moe_gemv_matches_reference) {
  REQUIRE_GPU();
  std::mt19937 rng(17);
  for (const ExpertsCase& c : kGemvCases) {
    CHECK(moe_gemv_fits(c.H, c.IE));
    check_experts(c, rng, false, Experts::GEMV);
    check_experts(c, rng, true, Experts::GEMV);
  }
}

// Section 34's router in one kernel (moe_router) against the three launches it stands for (Part I's rmsnorm,
// section 18's gemv, Part I's moe_route): the normed rows, the logits, the ids and the weights bit for bit, at
// 1 and 2 tokens, from the residual stream (the norm inside) and from rows normed already; E not a multiple of
// the 8 logits a thread block computes, E at MOE_MAX_EXPERTS, k at MOE_MAX_TOPK; eagerly, then replayed from
// one CUDA graph three times with new rows (the last thread block's ticket must start from zero every time).
TEST(moe_router_matches_its_parts) {
  REQUIRE_GPU();
  std::mt19937 rng(21);
  const struct { int H, E, k; } cases[] = {{64, 8, 2}, {264, 60, 4}, {2048, 128, 8}, {4096, 512, 8}, {1024, 33, 32}};
  const float eps = 1e-6f;
  int checked = 0;
  for (const auto& c : cases)
    for (int T : {1, 2})
      for (int normed : {0, 1}) {
        CHECK(moe_router_fits(T, c.H, c.E));
        const bool norm_topk = (checked & 1) != 0;
        DevBuf<bf16> in((size_t)T * c.H), norm_w(to_bf16(bf16_values(c.H, rng, 1.f))), W((size_t)c.E * c.H);
        DevBuf<bf16> x_want((size_t)T * c.H), x_got((size_t)T * c.H), l_want((size_t)T * c.E), l_got((size_t)T * c.E);
        DevBuf<int> id_want((size_t)T * c.k), id_got((size_t)T * c.k);
        DevBuf<float> w_want((size_t)T * c.k), w_got((size_t)T * c.k);
        cudaStream_t s;
        CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        auto fused = [&] {
          moe_router(x_got.p, l_got.p, id_got.p, w_got.p, in.p, normed ? nullptr : norm_w.p, eps, W.p, T, c.E, c.H,
                     c.k, norm_topk, s);
        };
        cudaGraphExec_t exec = nullptr;
        for (int round = 0; round < 4; round++) {  // round 0 eager, 1-3 one graph's replays
          in.upload(to_bf16(bf16_values(in.n, rng, 2.f)));
          W.upload(to_bf16(bf16_values(W.n, rng, 0.05f)));
          for (auto* b : {&x_want, &x_got, &l_want, &l_got}) b->poison();
          id_want.poison(), id_got.poison(), w_want.poison(), w_got.poison();
          if (normed) {  // the rows are the input as they are; x_out is not the kernel's to write
            CUDA_CHECK(cudaMemcpy(x_want.p, in.p, in.n * sizeof(bf16), cudaMemcpyDeviceToDevice));
            CUDA_CHECK(cudaMemcpy(x_got.p, in.p, in.n * sizeof(bf16), cudaMemcpyDeviceToDevice));
          } else {
            rmsnorm(x_want.p, in.p, norm_w.p, T, c.H, eps, s);
          }
          gemv(l_want.p, x_want.p, W.p, T, c.E, c.H, s);
          moe_route(id_want.p, w_want.p, l_want.p, T, c.E, c.k, norm_topk, s);
          if (round == 0) {
            fused();
          } else {
            if (!exec) {
              cudaGraph_t g;
              CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
              fused();
              CUDA_CHECK(cudaStreamEndCapture(s, &g));
              CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
              CUDA_CHECK(cudaGraphDestroy(g));
            }
            CUDA_CHECK(cudaGraphLaunch(exec, s));
          }
          CUDA_CHECK(cudaStreamSynchronize(s));
          char what[120];
          snprintf(what, sizeof what, "H %d E %d k %d T %d%s%s, round %d", c.H, c.E, c.k, T,
                   normed ? ", rows normed already" : "", norm_topk ? ", norm_topk_prob" : "", round);
          auto same = [&](const char* name, const void* a, const void* b, size_t bytes) {
            CHECK_MSG(memcmp(a, b, bytes) == 0, "%s: %s differ", what, name);
          };
          const auto xw = x_want.download(), xg = x_got.download(), lw = l_want.download(), lg = l_got.download();
          const auto iw = id_want.download(), ig = id_got.download();
          const auto ww = w_want.download(), wg = w_got.download();
          same("the normed rows", xw.data(), xg.data(), xw.size() * sizeof(bf16));
          same("the logits", lw.data(), lg.data(), lw.size() * sizeof(bf16));
          same("the ids", iw.data(), ig.data(), iw.size() * sizeof(int));
          same("the weights", ww.data(), wg.data(), ww.size() * sizeof(float));
          for (int v : ig) CHECK_MSG(v >= 0 && v < c.E, "%s: id %d out of range", what, v);
        }
        checked++;
        CUDA_CHECK(cudaGraphExecDestroy(exec));
        CUDA_CHECK(cudaStreamDestroy(s));
      }
  printf("    %d cases, each eager and 3 graph replays\n", checked);
}

// Section 34's moe_route_warp (the router's last thread block routes with it), in moe_route_fast (every other
// step's routing while moe_gemv is on), against Part I's moe_route, ids and weights bit for bit: E from 1 to
// MOE_MAX_EXPERTS (every count of slots a lane holds, 1 to 16, and E not a multiple of 32), k from 1 to
// MOE_MAX_TOPK, norm_topk_prob both ways, on logits drawn freely, of few distinct values (ties, at the k-th
// place too), all equal, and with infinities and NaNs among them (a -inf logit is a probability of exactly 0,
// which must still be picked before no expert at all).
TEST(moe_route_warp_matches_moe_route) {
  REQUIRE_GPU();
  std::mt19937 rng(28);
  const int T = 67;
  int cases = 0;
  for (int E : {1, 5, 32, 33, 64, 100, 128, 129, 256, 300, 512})
    for (int k : {1, 2, 8, 32})
      for (int kind = 0; kind < 4; kind++) {
        if (k > E) continue;
        std::vector<float> l = bf16_values((size_t)T * E, rng, 2.f);
        for (size_t i = 0; i < l.size(); i++) {
          if (kind == 1) l[i] = (float)(rng() % 5) * 0.5f;  // ties
          if (kind == 2) l[i] = 0.25f;                      // all equal
          if (kind == 3 && rng() % 7 == 0) {                // special values
            const float special[] = {INFINITY, -INFINITY, NAN};
            l[i] = special[rng() % 3];
          }
        }
        DevBuf<bf16> logits(to_bf16(l));
        for (bool norm : {false, true}) {
          DevBuf<int> ids((size_t)T * k), ids_want((size_t)T * k);
          DevBuf<float> w((size_t)T * k), w_want((size_t)T * k);
          ids.poison(), w.poison();
          moe_route(ids_want.p, w_want.p, logits.p, T, E, k, norm, 0);
          moe_route_fast(ids.p, w.p, logits.p, T, E, k, norm, 0);
          CUDA_CHECK(cudaDeviceSynchronize());
          const auto gi = ids.download(), wi = ids_want.download();
          const auto gw = w.download(), ww = w_want.download();
          size_t bad_ids = 0, bad_w = 0, first = 0;
          for (size_t i = 0; i < gi.size(); i++) {
            if (gi[i] != wi[i] && !bad_ids++) first = i;
            bad_w += memcmp(&gw[i], &ww[i], sizeof(float)) != 0;
          }
          CHECK_MSG(bad_ids == 0 && bad_w == 0,
                    "E %d k %d logits kind %d norm %d: %zu ids and %zu weights differ (first id [%zu]: %d, want %d)",
                    E, k, kind, norm, bad_ids, bad_w, first, gi[first], wi[first]);
          for (int v : wi) CHECK_MSG(v >= 0 && v < E, "E %d k %d logits kind %d: moe_route picked %d", E, k, kind,
                                     v);
          cases++;
        }
      }
  printf("    %d routings of %d tokens\n", cases, T);
}

// Each step of fused_moe on its own, on one routing per case: act (every row of a used tile, padding rows
// exactly 0) and the weighted down rows (every pair's row) against fused_moe_reference, the final sum bit
// for bit as the CPU adds the GPU's own weighted rows (ascending expert id, bf16 after each addition), and
// the result against Part I's path (moe_experts) on the GPU, within the products' rounding distance. In
// 16-row tiles and in the 64-row tiles of long steps.
TEST(fused_moe_steps_match_reference_and_plain) {
  REQUIRE_GPU();
  std::mt19937 rng(14);
  for (int tile : {MOE_TILE, FMOE_WIDE_TILE})
  for (const ExpertsCase& c : kFusedCases) {
    const auto x = bf16_values((size_t)c.T * c.H, rng, 1.f);
    const auto gate_up = bf16_values((size_t)c.E * 2 * c.IE * c.H, rng, 0.06f);
    const auto down = bf16_values((size_t)c.E * c.H * c.IE, rng, 0.06f);
    const std::vector<int> ids = routing(c.T, c.E, c.k, c.kind, rng);
    const std::vector<float> w = routing_weights((size_t)c.T * c.k, rng);
    DevBuf<bf16> d_x(to_bf16(x)), d_gate_up(to_bf16(gate_up)), d_down(to_bf16(down));
    DevBuf<bf16> d_out((size_t)c.T * c.H), d_plain((size_t)c.T * c.H);
    DevBuf<int> d_ids(ids);
    DevBuf<float> d_w(w);
    MoEScratch s(c.T, c.H, c.IE, c.E, c.k), sp(c.T, c.H, c.IE, c.E, c.k);
    d_out.poison(), d_plain.poison();
    fused_moe(d_out.p, d_x.p, d_ids.p, d_w.p, d_gate_up.p, d_down.p, c.T, c.H, c.IE, c.E, c.k, s.a, 0, tile);
    moe_experts(d_plain.p, d_x.p, d_ids.p, d_w.p, d_gate_up.p, d_down.p, c.T, c.H, c.IE, c.E, c.k, sp.a, 0);
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<int> rows, pair_row, tiles;
    moe_align_reference(rows, pair_row, tiles, ids.data(), c.T, c.k, c.E, tile);
    std::vector<float> act, wy, want((size_t)c.T * c.H);
    fused_moe_reference(act, wy, want.data(), x.data(), rows, tiles, pair_row, ids.data(), w.data(), gate_up.data(),
                        down.data(), c.T, c.H, c.IE, c.k);
    const std::vector<float> got_act = to_float(s.act.download()), got_wy = to_float(s.out.download());
    const std::vector<float> got = to_float(d_out.download()), plain = to_float(d_plain.download());
    // The rows the kernels write: act of each used tile's rows, the weighted rows of the pairs.
    std::vector<float> ga, wa, gw, ww;
    size_t padding = 0, padding_nonzero = 0;
    for (size_t r = 0; r < rows.size(); r++) {
      if (tiles[r / tile] < 0) continue;
      ga.insert(ga.end(), got_act.begin() + r * c.IE, got_act.begin() + (r + 1) * c.IE);
      wa.insert(wa.end(), act.begin() + r * c.IE, act.begin() + (r + 1) * c.IE);
      if (rows[r] < 0) {
        padding++;
        for (int i = 0; i < c.IE; i++) padding_nonzero += got_act[r * c.IE + i] != 0.f;
        continue;
      }
      gw.insert(gw.end(), got_wy.begin() + r * c.H, got_wy.begin() + (r + 1) * c.H);
      ww.insert(ww.end(), wy.begin() + r * c.H, wy.begin() + (r + 1) * c.H);
    }
    char what[160];
    auto name = [&](const char* step) {
      snprintf(what, sizeof what, "%s (T %d H %d IE %d E %d k %d, tile %d): %s", c.what, c.T, c.H, c.IE, c.E, c.k,
               tile, step);
      return what;
    };
    auto scale_of = [](const std::vector<float>& v) {
      float m = 0;
      for (float f : v) m = std::max(m, fabsf(f));
      return m;
    };
    check_close(name("act"), ga.data(), wa.data(), ga.size(), 0.01f * scale_of(wa), 2.f / 128);
    CHECK_MSG(padding_nonzero == 0, "%s", name("padding rows' act not 0"));
    check_close(name("weighted down rows"), gw.data(), ww.data(), gw.size(), 0.01f * scale_of(ww), 2.f / 128);
    check_close(name("out"), got.data(), want.data(), got.size(), 0.01f * scale_of(want), 2.f / 128);
    check_close(name("out against Part I's path"), got.data(), plain.data(), got.size(), 0.01f * scale_of(plain),
                2.f / 128);
    // The sum, exactly: the GPU's weighted rows added on the CPU in Part I's order and rounding.
    size_t differ = 0, first = 0;
    float first_want = 0.f;
    for (int t = 0; t < c.T; t++) {
      const int* id = &ids[(size_t)t * c.k];
      std::vector<int> order(c.k);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int a, int b) { return id[a] < id[b]; });
      for (int h = 0; h < c.H; h++) {
        float acc = 0.f;
        for (int j : order) acc = bf16_round(acc + got_wy[(size_t)pair_row[(size_t)t * c.k + j] * c.H + h]);
        const size_t i = (size_t)t * c.H + h;
        if (memcmp(&acc, &got[i], 4) != 0 && !differ++) first = i, first_want = acc;
      }
    }
    CHECK_MSG(differ == 0, "%s: %zu values, first [%zu] got %g, want %g", name("the sum not bit for bit"), differ,
              first, got[first], first_want);
    printf("    %s, tile %d: %zu padding rows\n", c.what, tile, padding);
  }
}
#endif

// ---- section 35: the experts in FP8 -----------------------------------------------------------------------

#ifdef NANOVLLM_PART_II
// A stack of experts' FP8 matrices (E n rows of K) as an FP8 checkpoint holds them: e4m3 bytes of either sign
// with exponent fields 4-8 (values 1/8 to 15/4, every mantissa), one scale of 0.01-0.03 per 128 x 128 block
// ([E n / 128, ld]): weights of about bf16_values(0.06)'s size (a quantizer's bytes span the same binades
// below the block's largest); and the same weights dequantized, bf16(e4m3 * s), as section 6a's loader holds
// them.
struct Fp8Stack {
  int N = 0, K = 0, ld = 0;
  std::vector<uint8_t> q;
  std::vector<float> s, deq;
};
// (The bytes come from a xorshift generator seeded by rng: hundreds of millions of them at Qwen3-30B-A3B's
// widths.) deq: also the dequantized values.
static Fp8Stack fp8_stack(int N, int K, std::mt19937& rng, bool deq = true) {
  Fp8Stack m;
  m.N = N, m.K = K, m.ld = (int)cdiv(K / 128, 4) * 4;
  m.q.resize((size_t)N * K), m.s.assign((size_t)N / 128 * m.ld, 0.f);
  uint64_t x = (uint64_t)rng() << 32 | rng() | 1;
  for (uint8_t& b : m.q) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    const uint32_t r = (uint32_t)(x >> 32);
    b = (uint8_t)((r & 1) << 7 | (4 + (r >> 1) % 5) << 3 | (r >> 8) % 8);
  }
  for (int bi = 0; bi < N / 128; bi++)
    for (int bj = 0; bj < K / 128; bj++) m.s[(size_t)bi * m.ld + bj] = 0.01f + 0.02f * (float)(rng() % 1000) / 1000.f;
  if (!deq) return m;
  m.deq.resize((size_t)N * K);
  const float* e4m3 = block_quantized_values();
  for (size_t i = 0; i < m.q.size(); i++)
    m.deq[i] = bf16_round(e4m3[m.q[i]] * m.s[(i / K) / 128 * m.ld + (i % K) / 128]);
  return m;
}
struct Fp8StackOnGpu {
  DevBuf<uint8_t> q;
  DevBuf<float> s;
  Fp8Matrix m;
  explicit Fp8StackOnGpu(const Fp8Stack& h) : q(h.q), s(h.s) { m.w = q.p, m.scale = s.p, m.N = h.N, m.K = h.K, m.ld = h.ld; }
};

// fused_moe_fp8 against fused_moe_fp8_reference: act of every used tile's rows and the result, eagerly and
// (with graph) replayed from a CUDA graph under three routings; eagerly also against section 33's bf16
// fused_moe on the dequantized weights, which differs by the activations' e4m3 rounding only (section 28: up
// to 2^-4 of a value, twice: x and act): a relative L2 difference of a few percent (5.1e-2 measured at one
// token of H 256), where a wrong scale, block or expert is of order 1.
// gemv: section 35's small steps (moe_gemv_fp8, W8A16) against the reference's w8a16 products instead.
// tile: the list's (section 33's 64-row tiles of long steps, or 16).
static void check_experts_fp8(const ExpertsCase& c, std::mt19937& rng, bool graph, bool gemv = false,
                              int tile = MOE_TILE) {
  const auto x = bf16_values((size_t)c.T * c.H, rng, 1.f);
  const bool plain = !graph && !gemv;  // compared with the bf16 products of the dequantized weights too
  const Fp8Stack gu = fp8_stack(c.E * 2 * c.IE, c.H, rng, plain), dn = fp8_stack(c.E * c.H, c.IE, rng, plain);
  Fp8StackOnGpu d_gu(gu), d_dn(dn);
  const int T4 = (int)cdiv(c.T, 4) * 4;
  DevBuf<bf16> d_x(to_bf16(x)), d_out((size_t)c.T * c.H), d_plain((size_t)c.T * c.H);
  DevBuf<bf16> d_gu_deq(to_bf16(gu.deq)), d_dn_deq(to_bf16(dn.deq));
  DevBuf<uint8_t> xq((size_t)T4 * c.H);
  DevBuf<float> xs((size_t)c.H / 128 * T4);
  MoEScratch s(c.T, c.H, c.IE, c.E, c.k), sp(c.T, c.H, c.IE, c.E, c.k);
  DevBuf<int> d_ids((size_t)c.T * c.k);
  DevBuf<float> d_w((size_t)c.T * c.k);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto run = [&] {
    if (gemv) moe_gemv_fp8(d_out.p, d_x.p, d_ids.p, d_w.p, d_gu.m, d_dn.m, c.T, c.H, c.IE, c.k, s.act.p, stream);
    else fused_moe_fp8(d_out.p, d_x.p, d_ids.p, d_w.p, d_gu.m, d_dn.m, c.T, c.H, c.IE, c.E, c.k, xq.p, xs.p, s.a,
                       stream, tile);
  };
  routing_rounds(c, rng, graph, d_ids, d_w, d_out, stream, run, [&](const std::vector<int>& ids,
                                                                     const std::vector<float>& w, int round) {
    std::vector<int> rows, pair_row, tiles;
    moe_align_reference(rows, pair_row, tiles, ids.data(), c.T, c.k, c.E, tile);
    std::vector<float> act, wy, want((size_t)c.T * c.H);
    fused_moe_fp8_reference(act, wy, want.data(), x.data(), rows, tiles, pair_row, ids.data(), w.data(), gu.q.data(),
                            gu.s.data(), gu.ld, dn.q.data(), dn.s.data(), dn.ld, c.T, c.H, c.IE, c.k, gemv);
    const std::vector<float> got = to_float(d_out.download());
    float scale = 0;
    for (float v : want) scale = std::max(scale, fabsf(v));
    char what[200];
    snprintf(what, sizeof what, "fp8%s: %s (T %d H %d IE %d E %d k %d%s, tile %d, routing %d)", gemv ? " gemv" : "",
             c.what, c.T, c.H, c.IE, c.E, c.k, graph ? ", graph replay" : "", tile, round);
    check_close(what, got.data(), want.data(), got.size(), 0.01f * scale, 2.f / 128);
    if (graph || gemv) return;
    // act, the rows of every used tile (padding rows exactly 0): where an intermediate differs, here first.
    const std::vector<float> got_act = to_float(s.act.download());
    std::vector<float> ga, wa;
    size_t padding_nonzero = 0;
    float act_scale = 0;
    for (size_t r = 0; r < rows.size(); r++) {
      if (tiles[r / tile] < 0) continue;
      for (int i = 0; i < c.IE; i++) {
        ga.push_back(got_act[r * c.IE + i]), wa.push_back(act[r * c.IE + i]);
        act_scale = std::max(act_scale, fabsf(act[r * c.IE + i]));
        padding_nonzero += rows[r] < 0 && got_act[r * c.IE + i] != 0.f;
      }
    }
    snprintf(what, sizeof what, "fp8: %s: act", c.what);
    check_close(what, ga.data(), wa.data(), ga.size(), 0.01f * act_scale, 2.f / 128);
    CHECK_MSG(padding_nonzero == 0, "fp8: %s: %zu values of padding rows' act not 0", c.what, padding_nonzero);
    fused_moe(d_plain.p, d_x.p, d_ids.p, d_w.p, d_gu_deq.p, d_dn_deq.p, c.T, c.H, c.IE, c.E, c.k, sp.a, stream,
              tile);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<float> plain = to_float(d_plain.download());
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); i++) num += (double)(got[i] - plain[i]) * (got[i] - plain[i]), den += (double)plain[i] * plain[i];
    const double rel = sqrt(num / den);
    printf("    %s: relative L2 against bf16 products of the dequantized weights %.2e\n", c.what, rel);
    CHECK_MSG(rel < 0.1, "fp8: %s: relative L2 %.3e against the bf16 path on the dequantized weights", c.what, rel);
  });
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// H and IE multiples of 128 (the chapter's precondition); one token, a token in the hundreds, experts that get
// no row, one expert that gets every row (many tiles of it), every expert in every token; Qwen3-30B-A3B's
// widths whole and at --tp 2 (IE 384); Qwen3-235B-A22B's (IE 1,536, H 4,096) with 16 of its experts.
static const ExpertsCase kFp8Cases[] = {
    {"one token", 1, 256, 128, 8, 2, 0},
    {"tiny-moe's shape", 37, 256, 128, 8, 2, 0},
    {"every expert in every token", 5, 128, 128, 5, 5, 0},
    {"most experts without a row", 300, 128, 128, 64, 2, 1},
    {"one expert in every token", 300, 256, 256, 16, 1, 2},
    {"Qwen3-30B-A3B's widths, one token", 1, 2048, 768, 128, 8, 0},
    {"Qwen3-30B-A3B's widths", 16, 2048, 768, 128, 8, 0},
    {"Qwen3-30B-A3B at --tp 2", 9, 2048, 384, 128, 8, 1},
    {"Qwen3-235B-A22B's widths, 16 experts", 4, 4096, 1536, 16, 8, 0},
};
TEST(fused_moe_fp8_matches_reference) {
  REQUIRE_GPU();
  if (gpu_cc_major() != 9) SKIP("the FP8 chapter runs on sm_90 only (this GPU: sm_%d0)", gpu_cc_major());
  std::mt19937 rng(19);
  for (const ExpertsCase& c : kFp8Cases) check_experts_fp8(c, rng, false);
  for (const ExpertsCase& c : kFp8Cases)
    if ((int64_t)c.T * c.k * c.H * c.IE <= 100000000) check_experts_fp8(c, rng, true);
  for (const ExpertsCase& c : kFp8Cases) check_experts_fp8(c, rng, false, false, FMOE_WIDE_TILE);  // 64-row tiles
}

// The FP8 experts' 64-row tiles against their 16-row tiles, bit for bit (fused_moe_wide_kernel's FP8 note: the
// same MMAs, the same scaling per slice, the same epilogue), at the sizes of long steps.
TEST(fused_moe_fp8_wide_tiles_match_16_row_tiles) {
  REQUIRE_GPU();
  if (gpu_cc_major() != 9) SKIP("the FP8 chapter runs on sm_90 only (this GPU: sm_%d0)", gpu_cc_major());
  static const ExpertsCase cases[] = {
      {"Qwen3-30B-A3B's widths, 2,000 tokens", 2000, 2048, 768, 128, 8, 0},
      {"Qwen3-30B-A3B at --tp 2, 1,500 tokens, the first 9 experts", 1500, 2048, 384, 128, 8, 1},
      {"Qwen3-235B-A22B's widths, 16 experts, 700 tokens", 700, 4096, 1536, 16, 8, 0},
      {"one expert in every token, 3,000 tokens", 3000, 256, 256, 16, 1, 2},
  };
  std::mt19937 rng(23);
  for (const ExpertsCase& c : cases) {
    const Fp8Stack gu = fp8_stack(c.E * 2 * c.IE, c.H, rng, false), dn = fp8_stack(c.E * c.H, c.IE, rng, false);
    Fp8StackOnGpu d_gu(gu), d_dn(dn);
    const int T4 = (int)cdiv(c.T, 4) * 4;
    DevBuf<bf16> x(to_bf16(bf16_values((size_t)c.T * c.H, rng, 1.f)));
    DevBuf<bf16> out16((size_t)c.T * c.H), out64((size_t)c.T * c.H);
    DevBuf<uint8_t> xq((size_t)T4 * c.H);
    DevBuf<float> xs((size_t)c.H / 128 * T4);
    MoEScratch s(c.T, c.H, c.IE, c.E, c.k);
    DevBuf<int> ids(routing(c.T, c.E, c.k, c.kind, rng));
    DevBuf<float> d_w(routing_weights((size_t)c.T * c.k, rng));
    out16.poison(), out64.poison();
    fused_moe_fp8(out16.p, x.p, ids.p, d_w.p, d_gu.m, d_dn.m, c.T, c.H, c.IE, c.E, c.k, xq.p, xs.p, s.a, 0,
                  MOE_TILE);
    s.act.poison(), s.out.poison(), s.gate_up.poison();
    fused_moe_fp8(out64.p, x.p, ids.p, d_w.p, d_gu.m, d_dn.m, c.T, c.H, c.IE, c.E, c.k, xq.p, xs.p, s.a, 0,
                  FMOE_WIDE_TILE);
    same_bits((std::string("fp8: ") + c.what).c_str(), out16, out64);
  }
}
// Section 35's small steps (moe_gemv_fp8) at 1 to 4 tokens: each size of a down row's loads (IE 128, 384,
// 768: two 16-byte loads a lane; 1,536 and 2,048: four), one choice per token and every expert in every
// token, two tokens that chose the same expert, eagerly and replayed from a CUDA graph under changing
// routings.
static const ExpertsCase kFp8GemvCases[] = {
    {"one token", 1, 256, 128, 8, 2, 0},
    {"every expert in every token", 4, 128, 128, 5, 5, 0},
    {"one expert for every token", 4, 128, 256, 16, 1, 2},
    {"IE at moe_gemv's limit", 2, 512, 2048, 8, 2, 1},
    {"Qwen3-30B-A3B's widths, one token", 1, 2048, 768, 128, 8, 0},
    {"Qwen3-30B-A3B's widths, four tokens", 4, 2048, 768, 128, 8, 0},
    {"Qwen3-30B-A3B at --tp 2, two tokens", 2, 2048, 384, 128, 8, 1},
    {"Qwen3-235B-A22B's widths, 16 experts", 1, 4096, 1536, 16, 8, 0},
};
TEST(moe_gemv_fp8_matches_reference) {
  REQUIRE_GPU();
  if (gpu_cc_major() != 9) SKIP("the FP8 chapter runs on sm_90 only (this GPU: sm_%d0)", gpu_cc_major());
  std::mt19937 rng(23);
  for (const ExpertsCase& c : kFp8GemvCases) {
    CHECK(moe_gemv_fits(c.H, c.IE));
    check_experts_fp8(c, rng, false, true);
    check_experts_fp8(c, rng, true, true);
  }
}
#endif

#ifdef NANOVLLM_PART_II
// A timing, not a test: one MoE layer's experts (after the router) at Qwen3-30B-A3B's widths (H 2048, 128
// experts top-8, IE 768), Part I's moe_experts against section 33's fused_moe, at T = 1 to 2048 tokens, and
// section 34's moe_gemv at the steps it may take (T <= 16, past MOE_GEMV_MAX_T too: where the tiles win).
// Each run takes the next of 8 uniform routings, so the experts it reads are rarely the run before's (L2
// holds a few dozen of the 128). Printed: microseconds per layer, the weights the routing touches over the
// time (GB/s), and the experts' FLOPs over the time (TFLOP/s).
TIMING(fused_moe_speed) {
  if (!have_gpu()) SKIP("no GPU");
  const int H = 2048, IE = 768, E = 128, k = 8, Tmax = 8192, R = 8;
  DevBuf<bf16> gate_up((size_t)E * 2 * IE * H), down((size_t)E * H * IE), x((size_t)Tmax * H), out((size_t)Tmax * H);
  CUDA_CHECK(cudaMemset(gate_up.p, 0x3c, gate_up.n * 2));  // every value 0x3c3c: about 0.0115
  CUDA_CHECK(cudaMemset(down.p, 0x3c, down.n * 2));
  CUDA_CHECK(cudaMemset(x.p, 0x3f, x.n * 2));  // about 0.75
  // Section 35's FP8 experts (every byte 0x30: e4m3 0.5, every block's scale 0.02), at steps of 256 tokens up.
  const int ld = (int)cdiv(H / 128, 4) * 4, ld_dn = (int)cdiv(IE / 128, 4) * 4;
  DevBuf<uint8_t> gu8(gate_up.n), dn8(down.n), xq((size_t)Tmax * H);
  DevBuf<float> gus(std::vector<float>((size_t)E * 2 * IE / 128 * ld, 0.02f));
  DevBuf<float> dns(std::vector<float>((size_t)E * H / 128 * ld_dn, 0.02f)), xs((size_t)H / 128 * Tmax);
  CUDA_CHECK(cudaMemset(gu8.p, 0x30, gu8.n));
  CUDA_CHECK(cudaMemset(dn8.p, 0x30, dn8.n));
  Fp8Matrix gu_m, dn_m;
  gu_m.w = gu8.p, gu_m.scale = gus.p, gu_m.N = E * 2 * IE, gu_m.K = H, gu_m.ld = ld;
  dn_m.w = dn8.p, dn_m.scale = dns.p, dn_m.N = E * H, dn_m.K = IE, dn_m.ld = ld_dn;
  std::mt19937 rng(15);
  for (int T : {1, 2, 4, 8, 10, 16, 32, 64, 256, 512, 1024, 2048, 8192}) {
    std::vector<std::unique_ptr<DevBuf<int>>> ids;
    std::vector<std::unique_ptr<DevBuf<float>>> w;
    double touched = 0;
    for (int i = 0; i < R; i++) {
      const std::vector<int> h = routing(T, E, k, 0, rng);
      touched += std::set<int>(h.begin(), h.end()).size() / (double)R;
      ids.emplace_back(new DevBuf<int>(h));
      w.emplace_back(new DevBuf<float>(std::vector<float>((size_t)T * k, 1.f / k)));
    }
    MoEScratch s(T, H, IE, E, k);
    float us[6] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    // 0: moe_experts, 1: fused_moe (16 rows), 2: moe_gemv, 3: 64 rows, 4 and 5: fused_moe_fp8 in 16 and 64 rows
    for (int fused = 0; fused < 6; fused++) {
      if ((fused == 2 && T > 16) || (fused == 3 && T < 64) || (fused == 0 && T > 2048) || (fused >= 4 && T < 256))
        continue;
      auto run = [&](int i) {
        const int r = i % R;
        if (fused >= 4)
          fused_moe_fp8(out.p, x.p, ids[r]->p, w[r]->p, gu_m, dn_m, T, H, IE, E, k, xq.p, xs.p, s.a, 0,
                        fused == 4 ? MOE_TILE : FMOE_WIDE_TILE);
        else if (fused == 2) moe_gemv(out.p, x.p, ids[r]->p, w[r]->p, gate_up.p, down.p, T, H, IE, k, s.act.p, 0);
        else if (fused) fused_moe(out.p, x.p, ids[r]->p, w[r]->p, gate_up.p, down.p, T, H, IE, E, k, s.a, 0,
                                  fused == 1 ? MOE_TILE : FMOE_WIDE_TILE);
        else moe_experts(out.p, x.p, ids[r]->p, w[r]->p, gate_up.p, down.p, T, H, IE, E, k, s.a, 0);
      };
      for (int i = 0; i < 3; i++) run(i);
      const int iters = T >= 256 && !fused ? 5 : 40;
      cudaEvent_t a, b;
      CUDA_CHECK(cudaEventCreate(&a));
      CUDA_CHECK(cudaEventCreate(&b));
      CUDA_CHECK(cudaEventRecord(a, 0));
      for (int i = 0; i < iters; i++) run(i);
      CUDA_CHECK(cudaEventRecord(b, 0));
      CUDA_CHECK(cudaEventSynchronize(b));
      float ms;
      CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      us[fused] = ms * 1e3f / iters;
      CUDA_CHECK(cudaEventDestroy(a));
      CUDA_CHECK(cudaEventDestroy(b));
    }
    const double bytes = touched * 3.0 * H * IE * 2, flops = 2.0 * T * k * 3 * H * IE;
    printf("    T %4d (%5.1f experts):", T, touched);
    if (us[0] > 0)
      printf(" moe_experts %8.1f us (%5.0f GB/s, %5.1f TFLOP/s)  ", us[0], bytes / us[0] / 1e3, flops / us[0] / 1e6);
    printf(" fused_moe %8.1f us (%5.0f GB/s, %5.1f TFLOP/s)", us[1], bytes / us[1] / 1e3, flops / us[1] / 1e6);
    if (us[2] > 0) printf("   moe_gemv %6.1f us (%5.0f GB/s)", us[2], bytes / us[2] / 1e3);
    if (us[3] > 0) printf("   64-row tiles %8.1f us (%5.1f TFLOP/s)", us[3], flops / us[3] / 1e6);
    if (us[4] > 0)
      printf("   FP8: 16-row tiles %8.1f us (%5.1f TFLOP/s), 64-row %8.1f us (%5.1f TFLOP/s)", us[4],
             flops / us[4] / 1e6, us[5], flops / us[5] / 1e6);
    printf("\n");
  }
}
#endif

#ifdef NANOVLLM_PART_II
// A timing, not a test: section 34's layer at steps of 1 and 2 tokens at Qwen3-30B-A3B's widths, 48 layers in
// one CUDA graph (as a decode step replays them, each kernel launched with PDL behind the one before), each
// layer with its own router (random) and routing, the experts shared (they come mostly from HBM): the router as
// Part I's three launches against moe_router; the down kernel with a row's loads sized to IE (4 at IE 768)
// against 8, and with one or two warps per output; the whole MoE layer both ways; the attention half's two
// products (section 18's gemvs, without the attention between them) alone and before the MoE layer, the share
// of a decode layer they take; and the whole layer, section 19's decode attention between them (a cache per
// layer, at 520 and 2,048 keys). Microseconds per layer.
TIMING(moe_layer_speed) {
  if (!have_gpu()) SKIP("no GPU");
  ScopedOptimizations opt("all");  // pdl on
  const int H = 2048, IE = 768, E = 128, k = 8, L = 48;
  DevBuf<bf16> gate_up((size_t)E * 2 * IE * H), down((size_t)E * H * IE), norm_w(H);
  DevBuf<bf16> x(2 * H), residual(2 * H), out(2 * H), act(2 * k * IE), logits(2 * E);
  for (auto* b : {&gate_up, &down}) CUDA_CHECK(cudaMemset(b->p, 0x3c, b->n * 2));  // about 0.0115
  std::mt19937 router_rng(26);  // a router per layer, random: its routing differs layer to layer
  DevBuf<bf16> router(to_bf16(bf16_values((size_t)L * E * H, router_rng, 0.05f)));
  // The attention half's two products (32 / 4 heads of 128): qkv [NQKV, H] with the norm fused, o [H, NQ] with
  // the residual add; C copies of each, layer l reading copy l % C (300 MB in all: the weights come from HBM).
  const int NQ = 32 * 128, NQKV = NQ + 2 * 4 * 128, C = 8;
  DevBuf<bf16> wqkv((size_t)C * NQKV * H), wo((size_t)C * H * NQ), qkv(2 * NQKV), attn(2 * NQ);
  for (auto* b : {&wqkv, &wo, &attn}) CUDA_CHECK(cudaMemset(b->p, 0x3c, b->n * 2));
  for (auto* b : {&norm_w, &residual, &act}) CUDA_CHECK(cudaMemset(b->p, 0x3f, b->n * 2));  // about 0.75
#ifdef NANOVLLM_PART_II
  Fp8Stack gu8h, dn8h;  // section 35's stacks of the same shapes, every byte 0x30 (0.5), every scale 0.023
  gu8h.N = E * 2 * IE, gu8h.K = H, gu8h.ld = H / 128, dn8h.N = E * H, dn8h.K = IE, dn8h.ld = 8;
  for (Fp8Stack* m : {&gu8h, &dn8h})
    m->q.assign((size_t)m->N * m->K, 0x30), m->s.assign((size_t)m->N / 128 * m->ld, 0.023f);
  Fp8StackOnGpu gu8(gu8h), dn8(dn8h);
  DevBuf<uint8_t> xq(4 * H);
  DevBuf<float> xs(4 * H / 128);
#endif
  std::mt19937 rng(25);
  std::vector<std::unique_ptr<DevBuf<int>>> ids;
  std::vector<std::unique_ptr<DevBuf<float>>> w;
  for (int l = 0; l < L; l++) {
    ids.emplace_back(new DevBuf<int>(routing(2, E, k, 0, rng)));
    w.emplace_back(new DevBuf<float>(std::vector<float>(2 * k, 1.f / k)));
  }
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto per_layer = [&](auto layer) {  // microseconds per layer of a 48-layer graph, replayed 20 times
    cudaGraph_t g;
    cudaGraphExec_t e;
    CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int l = 0; l < L; l++) layer(l);
    CUDA_CHECK(cudaStreamEndCapture(s, &g));
    CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
    for (int i = 0; i < 3; i++) CUDA_CHECK(cudaGraphLaunch(e, s));
    cudaEvent_t a, b;
    CUDA_CHECK(cudaEventCreate(&a));
    CUDA_CHECK(cudaEventCreate(&b));
    CUDA_CHECK(cudaEventRecord(a, s));
    for (int i = 0; i < 20; i++) CUDA_CHECK(cudaGraphLaunch(e, s));
    CUDA_CHECK(cudaEventRecord(b, s));
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    CUDA_CHECK(cudaEventDestroy(a));
    CUDA_CHECK(cudaEventDestroy(b));
    CUDA_CHECK(cudaGraphExecDestroy(e));
    CUDA_CHECK(cudaGraphDestroy(g));
    return ms * 1e3 / 20 / L;
  };
  for (int T : {1, 2}) {
    auto parts = [&](int l) {
      rmsnorm(x.p, residual.p, norm_w.p, T, H, 1e-6f, s);
      gemv(logits.p, x.p, router.p + (size_t)l * E * H, T, E, H, s);
      moe_route(ids[l]->p, w[l]->p, logits.p, T, E, k, true, s);
    };
    auto fused = [&](int l) {
      moe_router(x.p, logits.p, ids[l]->p, w[l]->p, residual.p, norm_w.p, 1e-6f, router.p + (size_t)l * E * H, T, E, H,
                 k, true, s);
    };
    auto experts = [&](int l) {
      moe_gemv(out.p, x.p, ids[l]->p, w[l]->p, gate_up.p, down.p, T, H, IE, k, act.p, s);
    };
    printf("    T %d: router: rmsnorm + gemv + moe_route %5.2f us, moe_router %5.2f us\n", T, per_layer(parts),
           per_layer(fused));
    printf("    T %d: down: loads per row 8, 1 warp per output %5.2f us; 4, 1 warp %5.2f us; 4, 2 warps %5.2f us; "
           "8, 2 warps %5.2f us\n", T,
           per_layer([&](int l) { moe_gemv_down_launch<8, 1, false>(out.p, act.p, ids[l]->p, w[l]->p, down.p, nullptr, 0, T, H, IE, k, s); }),
           per_layer([&](int l) { moe_gemv_down_launch<4, 1, false>(out.p, act.p, ids[l]->p, w[l]->p, down.p, nullptr, 0, T, H, IE, k, s); }),
           per_layer([&](int l) { moe_gemv_down_launch<4, 2, false>(out.p, act.p, ids[l]->p, w[l]->p, down.p, nullptr, 0, T, H, IE, k, s); }),
           per_layer([&](int l) { moe_gemv_down_launch<8, 2, false>(out.p, act.p, ids[l]->p, w[l]->p, down.p, nullptr, 0, T, H, IE, k, s); }));
    printf("    T %d: the MoE layer: Part I's router + moe_gemv %5.2f us, moe_router + moe_gemv (the stage) %5.2f us\n",
           T, per_layer([&](int l) { parts(l), experts(l); }), per_layer([&](int l) { fused(l), experts(l); }));
    GemvOptions qkv_opt, o_opt;
    qkv_opt.in = GemvIn::RMSNORM, qkv_opt.norm_w = norm_w.p, qkv_opt.eps = 1e-6f, o_opt.add = true;
    auto qkv_l = [&](int l) { gemv(qkv.p, residual.p, wqkv.p + (size_t)(l % C) * NQKV * H, T, NQKV, H, s, qkv_opt); };
    auto o_l = [&](int l) { gemv(residual.p, attn.p, wo.p + (size_t)(l % C) * H * NQ, T, H, NQ, s, o_opt); };
    printf("    T %d: the attention half's products (no attention between): qkv gemv with the norm %5.2f us, o gemv "
           "with the add %5.2f us, both %5.2f us; both and the MoE layer %5.2f us\n", T, per_layer(qkv_l),
           per_layer(o_l), per_layer([&](int l) { qkv_l(l), o_l(l); }),
           per_layer([&](int l) { qkv_l(l), o_l(l), fused(l), experts(l); }));
    // The whole layer: section 19's decode attention between the two (T sequences of ctx keys, a cache a layer).
    for (int ctx : {520, 2048}) {
      const int P = 256, MB = (int)cdiv(ctx, P), NKV = 4;
      const size_t per = (size_t)T * MB * NKV * P * 128;
      DevBuf<bf16> kc((size_t)L * per), vc((size_t)L * per), qn(128), kn(128);
      for (auto* b : {&kc, &vc, &qn, &kn}) CUDA_CHECK(cudaMemset(b->p, 0x3c, b->n * 2));
      std::vector<int> bt((size_t)T * MB);
      std::iota(bt.begin(), bt.end(), 0);
      DevBuf<int> d_bt(bt), d_len(std::vector<int>(T, ctx)), d_pos(std::vector<int>(T, ctx - 1));
      std::vector<int> slots(T);
      for (int b = 0; b < T; b++) slots[b] = (b * MB + (ctx - 1) / P) * P + (ctx - 1) % P;
      DevBuf<int> d_slot(slots);
      const DecodeRope rope{d_pos.p, d_slot.p, qn.p, kn.p, 1e-6f, rope_inv_freq(1e6f)};
      const float scale = 1.f / sqrtf(128.f);
      auto attn_l = [&](int l) {
        const KVLayer cache{kc.p + (size_t)l * per, vc.p + (size_t)l * per};
        attention_decode_fast<KVBf16>(attn.p, qkv.p, cache, d_len.p, d_bt.p, T, 32, NKV, P, MB, 4096, nullptr,
                                      scale, s, &rope);
      };
      printf("    T %d, %d keys: decode attention alone %5.2f us; qkv, attention, o %5.2f us; the whole layer "
             "%5.2f us\n", T, ctx, per_layer(attn_l), per_layer([&](int l) { qkv_l(l), attn_l(l), o_l(l); }),
             per_layer([&](int l) { qkv_l(l), attn_l(l), o_l(l), fused(l), experts(l); }));
    }
#ifdef NANOVLLM_PART_II
    if (gpu_cc_major() == 9) {  // section 35: the same experts in FP8 (bytes 0x30, 0.5; scales 0.023)
      MoEScratch sc(T, H, IE, E, k);
      printf("    T %d: FP8 experts: moe_gemv_fp8 %5.2f us, fused_moe_fp8 %5.2f us (bf16 moe_gemv %5.2f us)\n", T,
             per_layer([&](int l) {
               moe_gemv_fp8(out.p, x.p, ids[l]->p, w[l]->p, gu8.m, dn8.m, T, H, IE, k, act.p, s);
             }),
             per_layer([&](int l) {
               fused_moe_fp8(out.p, x.p, ids[l]->p, w[l]->p, gu8.m, dn8.m, T, H, IE, E, k, xq.p, xs.p, sc.a, s);
             }),
             per_layer(experts));
    }
#endif
  }
  CUDA_CHECK(cudaStreamDestroy(s));
}
#endif

// The whole layer (moe_mlp): the router's product by cuBLASLt, then the route and the experts. The reference
// routes from the GPU's own bf16 logits (a logit one bf16 step apart could flip a near-tie and move a token's
// result by a whole expert): the logits are checked against the CPU's product first.
TEST(moe_mlp_matches_reference) {
  REQUIRE_GPU();
  std::mt19937 rng(5);
  for (const ExpertsCase& c : {ExpertsCase{"layer", 37, 256, 128, 8, 2, 0}, ExpertsCase{"layer", 1, 2048, 768, 128, 8, 0},
                               ExpertsCase{"layer", 200, 2048, 768, 128, 8, 0}}) {
    ModelConfig mc;
    mc.hidden_size = c.H, mc.num_experts = c.E, mc.num_experts_per_tok = c.k, mc.moe_intermediate_size = c.IE;
    mc.norm_topk_prob = c.T != 37;
    const auto x = bf16_values((size_t)c.T * c.H, rng, 1.f);
    const auto router = bf16_values((size_t)c.E * c.H, rng, 0.05f);
    const auto gate_up = bf16_values((size_t)c.E * 2 * c.IE * c.H, rng, 0.04f);
    const auto down = bf16_values((size_t)c.E * c.H * c.IE, rng, 0.04f);
    DevBuf<bf16> d_x(to_bf16(x)), d_router(to_bf16(router)), d_gate_up(to_bf16(gate_up)), d_down(to_bf16(down));
    DevBuf<bf16> d_logits((size_t)c.T * c.E), d_out((size_t)c.T * c.H);
    DevBuf<int> d_ids((size_t)c.T * c.k);
    DevBuf<float> d_w((size_t)c.T * c.k);
    MoEScratch s(c.T, c.H, c.IE, c.E, c.k);
    s.a.router_logits = d_logits.p, s.a.topk_ids = d_ids.p, s.a.topk_weights = d_w.p;
    d_out.poison(), d_logits.poison();
    LayerWeights lw{};
    lw.router = d_router.p, lw.experts_gate_up = d_gate_up.p, lw.experts_down = d_down.p;
    Gemm gemm;
    gemm.init();
    moe_mlp(d_out.p, d_x.p, lw, mc, 1, c.T, gemm, s.a, 0);
    CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> logits = to_float(d_logits.download());
    std::vector<float> want_logits((size_t)c.T * c.E);
    linear_reference(want_logits.data(), x.data(), router.data(), c.T, c.E, c.H);
    check_close("router logits", logits.data(), want_logits.data(), logits.size(), 1e-3f, 1.f / 128);
    std::vector<int> ids((size_t)c.T * c.k);
    std::vector<float> w((size_t)c.T * c.k), want((size_t)c.T * c.H);
    moe_route_reference(ids.data(), w.data(), logits.data(), c.T, c.E, c.k, mc.norm_topk_prob);
    CHECK(d_ids.download() == ids);
    moe_experts_reference(want.data(), x.data(), ids.data(), w.data(), gate_up.data(), down.data(), c.T, c.H, c.IE,
                          c.k);
    const std::vector<float> got = to_float(d_out.download());
    float scale = 0;
    for (float v : want) scale = std::max(scale, fabsf(v));
    check_close("moe_mlp", got.data(), want.data(), got.size(), 0.01f * scale, 2.f / 128);
    CUDA_CHECK(cudaFree(gemm.workspace));
  }
}

// ---- the loader, and a tiny MoE checkpoint end to end -------------------------------------------------

// A tiny MoE checkpoint with random weights (test.h's tiny_moe_folder): the folder, or "". fp8: an FP8
// checkpoint made as Qwen's are (every layer linear and expert in e4m3 with bf16 block scales, the router bf16).
static std::string tiny_moe(const std::string& name, bool fp8 = false) {
  return tiny_moe_folder(name, fp8 ? "--random --fp8 bf16" : "--random");
}

// Every expert's fused gate_up and down, and the router, as load_weights places them at --tp 1 and as rank 1
// of --tp 2, against the checkpoint's values: gate rows [IE0, IE0 + IE/tp) then up rows, down's columns.
TEST(moe_load_weights_places_experts) {
  REQUIRE_GPU();
  const std::string dir = tiny_moe("load");
  if (dir.empty()) SKIP("python3 or test/ref/make_tiny_checkpoint.py is missing (run from the repository root)");
  const ModelConfig mc = load_model_config(dir);
  SafeTensors st = SafeTensors::open_dir(dir);
  auto stored = [&](const std::string& name, int64_t r, int64_t col) {  // bf16 bits of the file's value
    const TensorView& t = *st.find(name);
    return ((const uint16_t*)t.data)[r * t.shape[1] + col];
  };
  const int64_t H = mc.hidden_size, E = mc.num_experts;
  for (int tp : {1, 2}) {
    const int rank = tp - 1;
    const TPShard sh = tp_shard(mc, rank, tp);
    const int64_t IE = sh.moe_inter, i0 = sh.moe_inter0;
    size_t bytes = 0;
    const Weights w = load_weights(dir, mc, rank, tp, 0, &bytes);
    const LayerWeights& lw = w.layers[0];
    CHECK(lw.gate_up_proj == nullptr && lw.router != nullptr && w.layers[1].router == nullptr);
    std::vector<uint16_t> gu((size_t)E * 2 * IE * H), dn((size_t)E * H * IE), rt((size_t)E * H);
    CUDA_CHECK(cudaMemcpy(gu.data(), lw.experts_gate_up, gu.size() * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(dn.data(), lw.experts_down, dn.size() * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(rt.data(), lw.router, rt.size() * 2, cudaMemcpyDeviceToHost));
    size_t bad = 0;
    for (int64_t e = 0; e < E; e++) {
      const std::string ex = "model.layers.0.mlp.experts." + std::to_string(e) + ".";
      for (int64_t r = 0; r < 2 * IE; r++)
        for (int64_t c = 0; c < H; c++)
          bad += gu[((size_t)e * 2 * IE + r) * H + c] !=
                 stored(ex + (r < IE ? "gate_proj.weight" : "up_proj.weight"), i0 + r % IE, c);
      for (int64_t r = 0; r < H; r++)
        for (int64_t c = 0; c < IE; c++) bad += dn[((size_t)e * H + r) * IE + c] != stored(ex + "down_proj.weight", r, i0 + c);
      for (int64_t c = 0; c < H; c++) bad += rt[e * H + c] != stored("model.layers.0.mlp.gate.weight", e, c);
    }
    CHECK_MSG(bad == 0, "rank %d of %d: %zu values not where the checkpoint's are", rank, tp, bad);
    CHECK_EQ(w.bytes, (size_t)weight_elements(mc, sh) * 2);
    CUDA_CHECK(cudaFree(w.arena));
  }
}

#ifdef NANOVLLM_PART_II
// Section 35's loading: an FP8 checkpoint's experts stacked as the chapter holds them (expert e's gate rows,
// then its up rows, from row e 2 IE; its down from row e H), their bytes exactly the file's and their block
// scales the file's weight_scale_inv values at the stacked rows' blocks; the bf16 experts not loaded at all
// (section 6a leaves them out), the router loaded in bf16.
TEST(fp8_moe_loads_experts_as_stored) {
  REQUIRE_GPU();
  if (gpu_cc_major() != 9) SKIP("the FP8 chapter runs on sm_90 only (this GPU: sm_%d0)", gpu_cc_major());
  const std::string dir = tiny_moe("fp8-load", true);
  if (dir.empty()) SKIP("python3 or test/ref/make_tiny_checkpoint.py is missing (run from the repository root)");
  const ModelConfig mc = load_model_config(dir);
  CHECK(mc.block_quantized && mc.is_moe_layer(0));
  Config c;
  c.model = dir, c.max_num_batched_tokens = 256, c.max_num_seqs = 8;
  install_optimizations(default_optimizations());
  Weights w;
  size_t bytes = 0;
  CHECK(fp8_load_weights(w, c, mc, 0, 1, 0, &bytes));
  CHECK_MSG(g_fp8_weights.held, "the chapter stood aside: %s", g_fp8_weights.reason.c_str());
  const LayerWeights& lw = w.layers[0];
  CHECK(lw.experts_gate_up == nullptr && lw.experts_down == nullptr && lw.router != nullptr);
  const Fp8Layer& fl = g_fp8_weights.layers[0];
  const int64_t H = mc.hidden_size, E = mc.num_experts, IE = mc.moe_intermediate_size;
  CHECK(fl.experts_gate_up.N == E * 2 * IE && fl.experts_gate_up.K == H && fl.experts_down.N == E * H &&
        fl.experts_down.K == IE && fl.gate_up.w == nullptr);
  SafeTensors st = SafeTensors::open_dir(dir);
  auto check_matrix = [&](const Fp8Matrix& m, int64_t rows_per_expert, const std::vector<std::string>& parts) {
    std::vector<uint8_t> q((size_t)m.N * m.K);
    std::vector<float> s((size_t)m.N / 128 * m.ld);
    CUDA_CHECK(cudaMemcpy(q.data(), m.w, q.size(), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(s.data(), m.scale, s.size() * 4, cudaMemcpyDeviceToHost));
    size_t bad_bytes = 0, bad_scales = 0;
    for (int64_t e = 0; e < E; e++) {
      int64_t row = e * rows_per_expert;
      for (const std::string& part : parts) {
        const std::string name = "model.layers.0.mlp.experts." + std::to_string(e) + "." + part;
        const TensorView& t = *st.find(name);
        const std::vector<float> file_scales = block_scales(*st.find(name + "_scale_inv"));
        const int64_t nr = t.shape[0], nc = t.shape[1];
        for (int64_t r = 0; r < nr; r++)
          for (int64_t col = 0; col < nc; col++)
            bad_bytes += q[(size_t)(row + r) * m.K + col] != ((const uint8_t*)t.data)[r * nc + col];
        for (int64_t bi = 0; bi < nr / 128; bi++)
          for (int64_t bj = 0; bj < nc / 128; bj++)
            bad_scales += s[(size_t)(row / 128 + bi) * m.ld + bj] != file_scales[bi * (nc / 128) + bj];
        row += nr;
      }
    }
    CHECK_MSG(bad_bytes == 0 && bad_scales == 0, "%zu bytes and %zu scales not where the checkpoint's are",
              bad_bytes, bad_scales);
  };
  check_matrix(fl.experts_gate_up, 2 * IE, {"gate_proj.weight", "up_proj.weight"});
  check_matrix(fl.experts_down, H, {"down_proj.weight"});
  install_optimizations(default_optimizations());  // (forgets this engine's FP8 weights; nothing is freed)
}
#endif

// An engine of the tiny MoE folder (test/gpu/gpu_e2e.cu's Engine, smaller): --opt `opt`, CUDA graphs unless
// eager.
struct MoEEngine {
  Config config;
  ModelConfig mc;
  std::unique_ptr<ModelRunner> runner;
  std::unique_ptr<LLMEngine> engine;
  MoEEngine(const std::string& dir, const char* opt, bool eager) {
    config.model = dir, config.max_num_batched_tokens = 2048, config.max_num_seqs = 16;
    config.kvcache_block_size = 16, config.num_kvcache_blocks = 256, config.max_model_len = 1024;
    config.gpu_memory_utilization = 0.9f, config.enforce_eager = eager;
    const std::string problem = parse_optimizations(opt, config.opt);
    if (!problem.empty()) die("%s", problem.c_str());
    mc = load_model_config(dir);
    validate_config(config, mc);
    runner.reset(new ModelRunner(config, mc));
    runner->capture_cudagraphs();
    engine.reset(new LLMEngine(config, *runner));
  }
  static Request greedy(const std::vector<int>& prompt, int max_tokens) {
    Request r;
    r.prompt_token_ids = prompt;
    r.params.temperature = 0, r.params.max_tokens = max_tokens, r.params.ignore_eos = true;
    return r;
  }
  // Greedy tokens of each prompt, generated together.
  std::vector<std::vector<int>> generate(const std::vector<std::vector<int>>& prompts, int n) {
    std::vector<Request> reqs;
    for (const auto& p : prompts) reqs.push_back(greedy(p, n));
    std::vector<std::vector<int>> out;
    for (const Completion& c : engine->generate(reqs)) out.push_back(c.token_ids);
    return out;
  }
  // The logits [rows, V] the last step left (a decode step: one row per sequence).
  std::vector<float> logits(int rows) const {
    std::vector<float> v((size_t)rows * mc.vocab_size);
    CUDA_CHECK(cudaMemcpy(v.data(), runner->logits, v.size() * 4, cudaMemcpyDeviceToHost));
    return v;
  }
  // The logits of one prefill step of `prompt` (its last position), and in *routing the experts its tokens
  // took in the model's last MoE layer (act.topk_ids, [len, k]).
  std::vector<float> prefill_logits(const std::vector<int>& prompt, std::vector<int>* routing = nullptr) {
    engine->add_request(greedy(prompt, 1));
    engine->step();  // its one token: the request is done
    CHECK(engine->scheduler.is_finished());
    if (routing) {
      routing->resize(prompt.size() * mc.num_experts_per_tok);
      CUDA_CHECK(cudaMemcpy(routing->data(), runner->model.act.topk_ids, routing->size() * 4, cudaMemcpyDeviceToHost));
    }
    return logits(1);
  }
};

static std::vector<std::vector<int>> moe_prompts() {
  std::mt19937 rng(9);
  std::vector<std::vector<int>> prompts;
  for (int n : {1, 5, 17, 40, 100, 300, 64, 9}) {  // 8: a CUDA graph's batch size, so eager steps run as many
    std::vector<int> p(n);
    for (int& t : p) t = (int)(rng() % 151643);
    prompts.push_back(p);
  }
  return prompts;
}

// The plain path (Part I alone) decodes from CUDA graphs with MoE layers in them: 8 sequences (a graph's own
// batch size, so the eager steps have the same shapes) give the same tokens as the same engine stepping
// eagerly, the last decode step's logits bit for bit (the same kernels in the same order), and so do the
// logits of a prefill step after them. `opt`: the switches (none: Part I alone; section 33's fused_moe, then
// section 34's moe_gemv alone in the next cases); B: the sequences (the first B prompts; a graph's batch size);
// fp8: an FP8 checkpoint (tiny_moe).
static void graphs_match_eager(const char* opt, const char* folder, int B = 8, bool fp8 = false) {
  const std::string dir = tiny_moe(folder, fp8);
  if (dir.empty()) SKIP("python3 or test/ref/make_tiny_checkpoint.py is missing (run from the repository root)");
  auto prompts = moe_prompts();
  prompts.resize(B);
  std::vector<std::vector<int>> graphs, eager;
  std::vector<float> dg, de, lg, le;
  {
    MoEEngine e(dir, opt, false);
    CHECK(e.runner->graphs.count(B));
    graphs = e.generate(prompts, 24);
    dg = e.logits(B);
    lg = e.prefill_logits(prompts[std::min(4, B - 1)]);
  }
  {
    MoEEngine e(dir, opt, true);
    CHECK(e.runner->graphs.empty());
    eager = e.generate(prompts, 24);
    de = e.logits(B);
    le = e.prefill_logits(prompts[std::min(4, B - 1)]);
  }
  CHECK_MSG(graphs == eager, "greedy tokens differ between CUDA-graph and eager decode steps");
  CHECK_MSG(dg == de, "the last decode step's logits differ between CUDA-graph and eager steps");
  CHECK_MSG(memcmp(lg.data(), le.data(), lg.size() * 4) == 0, "prefill logits differ between the two engines");
  size_t distinct = 0;
  for (size_t i = 1; i < dg.size(); i++) distinct += dg[i] != dg[0];
  CHECK_MSG(distinct > dg.size() / 2, "the logits are nearly constant: a comparison that could not tell");
}
TEST(moe_plain_graphs_match_eager) {
  REQUIRE_GPU();
  graphs_match_eager("none", "plain");
}
#ifdef NANOVLLM_PART_II
TEST(fused_moe_graphs_match_eager) {
  REQUIRE_GPU();
  graphs_match_eager("none,fused_moe", "fused-graphs");
}
// MOE_GEMV_MAX_T (4) sequences, then 2: decode steps in its range; the router as Part I's three launches, then
// with section 18's gemv switched on (and PDL) as moe_router's one (at 2 sequences: GEMV_MAX_M).
TEST(moe_gemv_graphs_match_eager) {
  REQUIRE_GPU();
  CHECK(MOE_GEMV_MAX_T == 4 && GEMV_MAX_M == 2);  // graph batch sizes both
  graphs_match_eager("none,moe_gemv", "gemv-graphs", MOE_GEMV_MAX_T);
  graphs_match_eager("none,pdl,gemv,moe_gemv", "gemv-router-graphs", GEMV_MAX_M);
}
// Section 35 on an FP8 checkpoint, with every default switch (the attention half's FP8 products too) but
// section 23's prefill graphs: 8 sequences, then 2 (the router as moe_router's one launch). A prefill graph
// runs its step padded to the next rung (100 tokens as 128), and cuBLASLt picks its block-scaled FP8
// algorithm by the product's rows, so a padded step may add the same products in another order than an eager
// one (on an H200 the 100-token prompt's prefill logits differed with them on, the 5-token one's, padded to
// 16, did not): what this test holds to the bit is a step of the same shape both ways.
TEST(fp8_moe_graphs_match_eager) {
  REQUIRE_GPU();
  if (gpu_cc_major() != 9) SKIP("the FP8 chapter runs on sm_90 only (this GPU: sm_%d0)", gpu_cc_major());
  graphs_match_eager("all,-prefill_graphs", "fp8-graphs", 8, true);
  graphs_match_eager("all,-prefill_graphs", "fp8-graphs-2", GEMV_MAX_M, true);
}
#endif

// The default switches on a MoE model: the persistent kernel plans the decode steps of a bf16 folder (section
// 36) and none of an FP8 one's, fp8_weights holds only an FP8 folder, sections 33-35 run the moe stage (these
// prefill steps: section 33's grouped products), and the logits are the plain path's within
// attention's chapters' distance (flash attention's bf16 probabilities) and the fused products' (their fp32
// sums in another order): relative L2 under 1e-2 for each source alone (fused_moe_alone_matches_plain here,
// attention's chapters in gpu_e2e's dense comparisons), so under 2e-2 where both run (`bound`; the two
// roundings add: measured on an H200, 4.4e-3 for section 33 alone and 1.03e-2 with both, on the same
// prompt), the same argmax wherever the margin is clear. A prompt whose
// tokens the two paths route differently in the last MoE layer (a rounding moved a near-tie of the router:
// that token's output then differs by a whole expert's share) is printed and not held to the bar; most
// prompts must route the same and pass. `opt`: the switches compared with --plain. fp8: an FP8 checkpoint
// (tiny_moe), which the plain path dequantizes and the default switches compute in FP8 (sections 28-30 and
// 35): the bound then allows for the activations' e4m3 rounding, and one prompt routed alike suffices: W8A8
// rounds every product's input to e4m3 (3 mantissa bits), so the first MoE layer's router sees inputs a
// percent or so from the plain path's and the tiny model's near-ties flip in most prompts (6 of 8 on an
// H200). The comparison that does not depend on the routing is gpu_e2e's, against transformers' emulation
// of the same W8A8 arithmetic.
static void switches_match_plain(const char* opt, const char* folder, double bound, bool fp8 = false) {
  const std::string dir = tiny_moe(folder, fp8);
  if (dir.empty()) SKIP("python3 or test/ref/make_tiny_checkpoint.py is missing (run from the repository root)");
  const auto prompts = moe_prompts();
  std::vector<std::vector<float>> plain, fast;
  std::vector<std::vector<int>> route_plain(prompts.size()), route_fast(prompts.size());
  {
    MoEEngine e(dir, "none", false);
    for (size_t i = 0; i < prompts.size(); i++) plain.push_back(e.prefill_logits(prompts[i], &route_plain[i]));
  }
  {
    MoEEngine e(dir, opt, false);
#ifdef NANOVLLM_PART_II
    if (!strcmp(opt, "all")) {
      CHECK(g_persistent.decode && g_persistent.decode->plans.empty() == fp8);  // (section 36 plans bf16 MoE)
      CHECK_EQ(g_fp8_weights.held, fp8);
      CHECK(g_stages.moe == fp8_moe_stage && g_moe_bf16 == moe_gemv_stage && g_moe_larger == fused_moe_stage);
    }
    if (!strcmp(opt, "none,fused_moe")) CHECK(g_stages.moe == fused_moe_stage);
    else if (!strcmp(opt, "none,moe_gemv")) CHECK(g_stages.moe == moe_gemv_stage && g_moe_larger == moe_plain);
#endif
    for (size_t i = 0; i < prompts.size(); i++) fast.push_back(e.prefill_logits(prompts[i], &route_fast[i]));
    const auto tokens = e.generate(prompts, 16);  // decode steps through the default path's graphs
    CHECK_EQ(tokens.size(), prompts.size());
  }
  size_t held = 0;
  for (size_t i = 0; i < prompts.size(); i++) {
    size_t flips = 0;
    for (size_t j = 0; j < route_plain[i].size(); j++) flips += route_plain[i][j] != route_fast[i][j];
    double num = 0, den = 0, worst = 0;
    int ap = 0, af = 0;
    const std::vector<float>& x = plain[i];
    const std::vector<float>& y = fast[i];
    for (size_t v = 0; v < x.size(); v++) {
      num += (double)(x[v] - y[v]) * (x[v] - y[v]), den += (double)x[v] * x[v];
      worst = std::max(worst, (double)fabsf(x[v] - y[v]));
      if (x[v] > x[ap]) ap = (int)v;
      if (y[v] > y[af]) af = (int)v;
    }
    float second = -INFINITY;
    for (size_t v = 0; v < x.size(); v++)
      if ((int)v != ap) second = std::max(second, x[v]);
    const double rel = sqrt(num / den);
    printf("    prompt of %zu tokens: rel L2 %.2e, argmax %d vs %d (margin %.3f), %zu of %zu routing choices "
           "differ\n", prompts[i].size(), rel, af, ap, x[ap] - second, flips, route_plain[i].size());
    if (flips) continue;
    held++;
    CHECK_MSG(rel < bound, "prompt %zu: relative L2 %.3e between --opt %s and the plain path (bound %.0e)", i, rel,
              opt, bound);
    if (x[ap] - second > 2 * worst) CHECK_EQ(af, ap);
  }
  CHECK_MSG(fp8 ? held >= 1 : held * 2 > prompts.size(), "only %zu of %zu prompts routed the same both ways", held,
            prompts.size());
}
TEST(moe_default_switches_match_plain) {
  REQUIRE_GPU();
  switches_match_plain("all", "fast", 2e-2);
}
#ifdef NANOVLLM_PART_II
// An FP8 checkpoint: the default switches hold it in FP8 (W8A8 products, the experts through section 35)
// against the plain path's bf16 products of the dequantized weights. The bound is the activations' e4m3
// rounding (a few 1e-2 relative per product, mostly averaging out) on top of the bf16 chapters' 2e-2.
TEST(fp8_moe_default_switches_match_plain) {
  REQUIRE_GPU();
  if (gpu_cc_major() != 9) SKIP("the FP8 chapter runs on sm_90 only (this GPU: sm_%d0)", gpu_cc_major());
  switches_match_plain("all", "fp8-fast", 8e-2, true);
}
#endif
#ifdef NANOVLLM_PART_II
// Section 33 alone: Part I's attention, so the first MoE layer sees the plain path's rows exactly.
TEST(fused_moe_alone_matches_plain) {
  REQUIRE_GPU();
  switches_match_plain("none,fused_moe", "fused-alone", 1e-2);
}
// Section 34 alone: the one-token prompt's prefill step takes the gemv (the other prompts' steps are longer
// and Part I's; decode at 2 sequences is moe_gemv_graphs_match_eager's), held to the plain path's logits.
TEST(moe_gemv_alone_matches_plain) {
  REQUIRE_GPU();
  switches_match_plain("none,moe_gemv", "gemv-alone", 1e-2);
}
#endif

#ifdef NANOVLLM_PART_II
// ---- Section 36: a MoE model's decode step inside the persistent kernel ------------------------------------
// One decode step of B sequences (every batch size with a plan: 1, 2, 4 where shared memory fits) over a cache of
// random values (contexts of 17 to 1000 keys in shuffled blocks; each path stores the step's key and value and
// reads it), run three ways on the same engine: Part I (--plain), section 14's path with the default switches
// (moe_gemv at these sizes) and the persistent kernel. As gpu_persistent.cu holds the dense kernel: its logits
// within 1.5x (plus 2e-3) of how far section 14's path lands from Part I's, the same token wherever Part I's top-2
// margin is clear of the logit error, and the same bits with its thread blocks held back by different amounts (a
// read that raced a write would change them), which leaving out the wait of the first MOE_DOWN (it reads
// MOE_GATE_UP's act) or of the first MOE_GATE_UP (it routes from the router's logits) must change (what the
// operations hand each other is poisoned before each run). The last MoE layer's routing (act.topk_ids, each
// token's experts as a set) is compared three ways: a step where a token's routing differs (a near-tie that the
// paths' sums, in other orders, round apart) is printed and not held to the logits' bar; most steps must route
// alike. Shapes: the tiny folder (8 experts, top 2, a dense layer among the MoE ones), and Qwen3-30B-A3B's widths
// (H 2048, 128 experts, top 8, IE 768, 32 / 4 heads) at 3 layers.
static void persistent_moe_case(const char* folder, const std::string& sets) {
  const std::string dir = tiny_moe_folder(folder, "--random" + sets);
  if (dir.empty()) SKIP("python3 or test/ref/make_tiny_checkpoint.py is missing (run from the repository root)");
  MoEEngine e(dir, "all", true);
  Qwen3& m = e.runner->model;
  const ModelConfig& c = m.cfg;
  const PersistentDecode pd = persist_setup(m, 4);  // (ours: the scoped switches below reset the engine's)
  CHECK_MSG(pd.plans.count(1), "no plan for batch 1: %s", pd.off_reason.c_str());
  const int V = c.vocab_size, k = c.num_experts_per_tok, L = c.num_hidden_layers;
  int last_moe = -1, gate_up_op = -1, down_op = -1;  // the last MoE layer; its first expert operations' places
  for (int l = 0; l < L; l++)
    if (c.is_moe_layer(l)) last_moe = l;
  {
    const std::vector<PersistOp>& ops = pd.plans.at(1).ops;
    for (int o = (int)ops.size() - 1; o >= 0; o--) {
      if (ops[o].kind == PERSIST_MOE_GATE_UP) gate_up_op = o;
      if (ops[o].kind == PERSIST_MOE_DOWN) down_op = o;
    }
  }
  CHECK(last_moe >= 0 && gate_up_op > 0 && down_op > 0);
  {  // the cache: random values (what the steps' attention reads), uploaded once
    std::mt19937 rng(11);
    const std::vector<bf16> values = to_bf16(bf16_values(m.kv.bytes / 2, rng, 1.f));
    CUDA_CHECK(cudaMemcpy(m.kv.base, values.data(), m.kv.bytes, cudaMemcpyHostToDevice));
  }
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int steps = 0, held = 0;  // steps, and those routed alike three ways (held to the bar)
  for (const auto& entry : pd.plans) {
    const int B = entry.first;
    const PersistPlan& plan = entry.second;
    std::mt19937 rng(100 + B);
    const int P = m.P, lens[4] = {1000, 17, 300, 64};
    std::vector<int> ids(B), pos(B), slots(B), ctx(B), bt((size_t)B * m.MB, 0), blocks(m.kv.num_blocks);
    std::iota(blocks.begin(), blocks.end(), 0);
    std::shuffle(blocks.begin(), blocks.end(), rng);
    size_t next = 0;
    for (int b = 0; b < B; b++) {
      ids[b] = (int)(rng() % 151643), ctx[b] = lens[b], pos[b] = ctx[b] - 1;
      for (int j = 0; j < (int)cdiv(ctx[b], P); j++) bt[(size_t)b * m.MB + j] = blocks.at(next++);
      slots[b] = bt[(size_t)b * m.MB + pos[b] / P] * P + pos[b] % P;  // (each path stores the step's key, value)
    }
    DevBuf<int> d_ids(B), d_pos(B), d_slots(B), d_ctx(B), d_bt(bt.size());
    d_ids.upload(ids), d_pos.upload(pos), d_slots.upload(slots), d_ctx.upload(ctx), d_bt.upload(bt);
    const StepInputs in{d_ids.p, d_pos.p, d_slots.p, nullptr, d_ctx.p, d_bt.p, 1};
    struct Out { std::vector<float> logits; std::vector<int> route; };
    auto run = [&](const std::function<void()>& step) {
      CUDA_CHECK(cudaMemset(m.act.logits, 0xFF, (size_t)B * V * 4));
      CUDA_CHECK(cudaMemset(m.act.topk_ids, 0xFF, (size_t)B * k * 4));
      // and what the kernel's MoE operations hand each other (a left-out wait then reads poison, not the last
      // run's values): the router's logits, the pairs' act
      CUDA_CHECK(cudaMemset(m.act.router_logits, 0xFF, (size_t)B * c.num_experts * 2));
      CUDA_CHECK(cudaMemset(m.act.moe_act, 0xFF, (size_t)B * k * c.moe_intermediate_size * 2));
      CUDA_CHECK(cudaDeviceSynchronize());
      step();
      CUDA_CHECK(cudaStreamSynchronize(s));
      Out o{std::vector<float>((size_t)B * V), std::vector<int>((size_t)B * k)};
      CUDA_CHECK(cudaMemcpy(o.logits.data(), m.act.logits, o.logits.size() * 4, cudaMemcpyDeviceToHost));
      CUDA_CHECK(cudaMemcpy(o.route.data(), m.act.topk_ids, o.route.size() * 4, cudaMemcpyDeviceToHost));
      for (int b = 0; b < B; b++) std::sort(o.route.begin() + b * k, o.route.begin() + (b + 1) * k);
      return o;
    };
    Out plain, fast;
    {
      ScopedOptimizations none("none");
      plain = run([&] { m.forward(in, B, B, false, s); });
    }
    {
      ScopedOptimizations all("all");
      fast = run([&] { forward_fast(m, in, B, B, false, s); });
    }
    auto persistent = [&](int skew, int skip) {
      return run([&] { persistent_decode(m, plan, in, s, skew, skip, nullptr); });
    };
    const Out pers = persistent(0, -1), skewed = persistent(4000, -1);
    const Out no_wait_down = persistent(4000, down_op), no_wait_gate_up = persistent(4000, gate_up_op);
    CHECK_MSG(std::all_of(pers.logits.begin(), pers.logits.end(), [](float x) { return std::isfinite(x); }),
              "%s B=%d: non-finite logits", folder, B);
    CHECK_MSG(skewed.logits == pers.logits && skewed.route == pers.route,
              "%s B=%d: thread blocks held back changed the results", folder, B);
    CHECK_MSG(no_wait_down.logits != pers.logits, "%s B=%d: leaving MOE_DOWN's wait out changed nothing", folder, B);
    CHECK_MSG(no_wait_gate_up.logits != pers.logits || no_wait_gate_up.route != pers.route,
              "%s B=%d: leaving MOE_GATE_UP's wait out changed nothing", folder, B);
    auto rel = [](const std::vector<float>& a, const std::vector<float>& ref) {
      double num = 0, den = 0;
      for (size_t i = 0; i < a.size(); i++) num += ((double)a[i] - ref[i]) * (a[i] - ref[i]), den += (double)ref[i] * ref[i];
      return sqrt(num / den);
    };
    const double e_fast = rel(fast.logits, plain.logits), e_pers = rel(pers.logits, plain.logits);
    double worst = 0;
    for (size_t i = 0; i < pers.logits.size(); i++) worst = std::max(worst, (double)fabsf(pers.logits[i] - plain.logits[i]));
    int checked = 0, same = 0;
    for (int b = 0; b < B; b++) {
      const float* r = &plain.logits[(size_t)b * V];
      const float* g = &pers.logits[(size_t)b * V];
      const int i1 = (int)(std::max_element(r, r + V) - r);
      float second = -INFINITY;
      for (int i = 0; i < V; i++)
        if (i != i1) second = std::max(second, r[i]);
      if (r[i1] - second <= 2 * worst) continue;
      checked++;
      same += (int)(std::max_element(g, g + V) - g) == i1;
    }
    const bool routed_alike = pers.route == fast.route && fast.route == plain.route;
    printf("    %s B=%d: logits vs Part I: section 14 %.2e, persistent %.2e (vs section 14 %.2e); argmax %d/%d clear "
           "rows; layer %d routed %s (persistent / section 14 / Part I)\n", folder, B, e_fast, e_pers,
           rel(pers.logits, fast.logits), same, checked, last_moe,
           routed_alike ? "alike" : pers.route == fast.route ? "alike / alike / OTHERWISE" : "OTHERWISE");
    steps++;
    if (!routed_alike) continue;
    held++;
    CHECK_MSG(e_pers <= 1.5 * e_fast + 2e-3, "%s B=%d: logits %.3e from Part I, section 14 %.3e", folder, B, e_pers,
              e_fast);
    CHECK_MSG(same == checked, "%s B=%d: argmax differs in %d of %d clear rows", folder, B, checked - same, checked);
  }
  CHECK_MSG(held * 2 > steps, "%s: only %d of %d steps routed alike three ways", folder, held, steps);
  CUDA_CHECK(cudaStreamDestroy(s));
  install_optimizations(default_optimizations());
}
TEST(persistent_moe_matches_section14_and_part1) {
  REQUIRE_GPU();
  persistent_moe_case("persist-tiny", "");
  persistent_moe_case("persist-30b", " --set hidden_size=2048 --set intermediate_size=6144 --set num_hidden_layers=3"
                      " --set num_attention_heads=32 --set num_key_value_heads=4 --set num_experts=128"
                      " --set num_experts_per_tok=8 --set moe_intermediate_size=768");
}
// Where a step's time goes in the kernel on a MoE model (figures only): Qwen3-30B-A3B's widths at 3 layers (MoE,
// dense, MoE), one decode step of one sequence at 600 keys, launched alone with its trace (PersistArgs::trace):
// per operation, when it completed after the one before it, when its first and last thread blocks got past
// their waits, and a block's mean time from its wait to its end.
TIMING(timing_persistent_moe_breakdown) {
  REQUIRE_GPU();
  const std::string dir = tiny_moe_folder("persist-30b-timing", "--random --set hidden_size=2048 --set "
      "intermediate_size=6144 --set num_hidden_layers=3 --set num_attention_heads=32 --set num_key_value_heads=4 "
      "--set num_experts=128 --set num_experts_per_tok=8 --set moe_intermediate_size=768");
  if (dir.empty()) SKIP("python3 or test/ref/make_tiny_checkpoint.py is missing (run from the repository root)");
  MoEEngine e(dir, "all", true);
  Qwen3& m = e.runner->model;
  const PersistentDecode pd = persist_setup(m, 1);
  if (!pd.plans.count(1)) SKIP("no plan: %s", pd.off_reason.c_str());
  const PersistPlan& plan = pd.plans.at(1);
  const int n = (int)plan.ops.size(), ctx = 600, P = m.P;
  std::vector<int> bt(m.MB, 0);
  for (int j = 0; j < (int)cdiv(ctx, P); j++) bt[j] = j;
  DevBuf<int> d_ids(1), d_pos(1), d_slots(1), d_ctx(1), d_bt(bt.size());
  d_ids.upload({7}), d_pos.upload({ctx - 1}), d_slots.upload({-1}), d_ctx.upload({ctx}), d_bt.upload(bt);
  const StepInputs in{d_ids.p, d_pos.p, d_slots.p, nullptr, d_ctx.p, d_bt.p, 1};
  DevBuf<uint64_t> trace((size_t)plan.grid * n * PERSIST_TRACE);
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int rep = 0; rep < 3; rep++) {  // the last of three
    CUDA_CHECK(cudaMemset(trace.p, 0, trace.n * 8));
    persistent_decode(m, plan, in, s, 0, -1, trace.p);
    CUDA_CHECK(cudaStreamSynchronize(s));
  }
  CUDA_CHECK(cudaStreamDestroy(s));
  const std::vector<uint64_t> tr = trace.download();
  auto at = [&](int b, int o, int k) { return (double)tr[((size_t)b * n + o) * PERSIST_TRACE + k]; };
  double start = 1e300;
  for (int b = 0; b < plan.grid; b++) start = std::min(start, at(b, 0, 0));
  const char* names[] = {"embed", "qkv", "attention", "o_proj", "gate_up", "down", "lm_head", "all-reduce",
                         "router", "moe_gate_up", "moe_down"};
  double prev_end = 0;
  printf("    TIMING breakdown, 30B-A3B widths at 3 layers, B=1, 600 keys (us from the step's start):\n");
  for (int o = 0; o < n; o++) {
    double end = 0, first = 1e300, last = 0, busy = 0, routed = 0, staged = 0, rows = 0;
    int blocks = 0, routing = 0;
    for (int b = 0; b < plan.grid; b++) {
      if (!at(b, o, 2)) continue;
      end = std::max(end, at(b, o, 2) - start);
      if (!at(b, o, 4)) continue;
      first = std::min(first, at(b, o, 4) - start), last = std::max(last, at(b, o, 4) - start);
      busy += at(b, o, 2) - at(b, o, 4), blocks++;
      if (at(b, o, 6)) routed += at(b, o, 6) - at(b, o, 4), routing++;
      if (at(b, o, 1)) staged += at(b, o, 1) - at(b, o, 4);
      if (at(b, o, 3)) rows += at(b, o, 3) - at(b, o, 1);
    }
    printf("      %2d %-11s layer %d: complete at %7.2f (+%6.2f); past its wait: first %7.2f, last %7.2f; a block "
           "from its wait to its end %6.2f (routed %5.2f, input staged %5.2f, rows %6.2f; %d blocks)\n", o,
           names[plan.ops[o].kind], plan.ops[o].layer, end / 1e3, (end - prev_end) / 1e3, blocks ? first / 1e3 : 0.0,
           last / 1e3, blocks ? busy / blocks / 1e3 : 0.0, routing ? routed / routing / 1e3 : 0.0,
           blocks ? staged / blocks / 1e3 : 0.0, blocks ? rows / blocks / 1e3 : 0.0, blocks);
    prev_end = end;
  }
  install_optimizations(default_optimizations());
}
// The engine with every default switch and the kernel forced on every decode step it has a plan for
// (NANOVLLM_PERSISTENT=always): CUDA-graph decode at 4 and 2 sequences bit for bit against eager steps (each
// replays or launches the same kernel).
TEST(persistent_moe_graphs_match_eager) {
  REQUIRE_GPU();
  setenv("NANOVLLM_PERSISTENT", "always", 1);
  graphs_match_eager("all,-prefill_graphs", "persist-graphs", 4);
  graphs_match_eager("all,-prefill_graphs", "persist-graphs-2", 2);
  unsetenv("NANOVLLM_PERSISTENT");
}
#endif

int main(int argc, char** argv) {
  install_default_optimizations();
  return test_main(argc, argv);
}
