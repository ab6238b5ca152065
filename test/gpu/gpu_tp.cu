// The tensor-parallel data plane on every visible GPU (nanovllm.cu sections 12 and 20): all_reduce_fast on
// every road (the one-shot and the two-shot NVLink kernels, and NCCL), in place and into a residual,
// against an fp32 reference, eagerly and replayed from CUDA graphs mixed with eager calls, and back to back
// with the ranks out of step, and with larger grids; gather_logits with an odd vocabulary; all_reduce_min; and
// the latency of one all-reduce at the message sizes of a decode step on each road (the "bench_" case,
// used for docs/tensor-parallel.md's all-reduce figures).
//
// N ranks, one per visible GPU (at most 8; NANOVLLM_TP_RANKS=N for fewer): main() forks ranks 1..N-1 before
// any CUDA call and every process runs every case, so each collective has its partners. Rank 0 prints; the
// others check their own results too, silently, and their exit statuses count. Fewer than 2 GPUs: every
// case is skipped.
#define NANOVLLM_TESTING
#include "../../nanovllm.cu"
#include "../test.h"

static int g_rank = 0, g_gpus = 0, g_ranks = 0;
static TPComm* g_comm = nullptr;

// Host to device, finished when this returns. A cudaMemcpy from pageable memory may return while its DMA
// still runs on the legacy stream, and this file's non-blocking streams are not ordered after it: the
// likely cause of a failure seen on two H200s, where the last 11,264 values of a 379 KB buffer came out
// of the all-reduce wrong.
static void upload(void* dst, const void* src, size_t bytes) {
  CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaDeviceSynchronize());
}

// A deterministic bf16 in [-2, 2) per rank, zeros of both signs included: -0.0 is the one-shot kernel's
// "empty" mark, which a partial sum may still be (a kernel that took it for "not arrived" would hang).
static uint16_t value_bits(int rank, size_t i, int salt) {
  uint64_t h = splitmix64(((uint64_t)salt << 40) ^ ((uint64_t)rank << 32) ^ i);
  if (h % 64 == 0) return (h >> 32) & 1 ? 0x8000 : 0;
  return float_to_bf16_bits((float)((int64_t)(h % 4096) - 2048) / 1024.0f);
}

// Bit for bit, except the sign of a zero: NCCL adds -0.0 + -0.0 into -0.0, the NVLink kernels into +0.0.
static bool same_bits(uint16_t a, uint16_t b) { return a == b || ((a | b) & 0x7fff) == 0; }

// The expected result at element i: bf16(sum over ranks in fp32), or with a residual r,
// bf16(r + bf16(sum)) (the residual's values are the same on every rank).
static uint16_t expected_bits(size_t i, int salt, const uint16_t* residual) {
  float sum = 0;
  for (int r = 0; r < g_comm->size; r++) sum += bf16_bits_to_float(value_bits(r, i, salt));
  if (!residual) return float_to_bf16_bits(sum);
  return float_to_bf16_bits(bf16_bits_to_float(float_to_bf16_bits(sum)) + bf16_bits_to_float(residual[i]));
}

// NCCL's ring adds the ranks' values in its own order, rounding to bf16 at each of its N-1 adds: at N = 2
// that is the one add of the NVLink roads, beyond it the result may differ from expected_bits by those
// roundings. Within them: |got - sum| <= (N-1) 2^-8 (sum of |values| at each add) + the final rounding.
static bool within_ring_rounding(uint16_t got, size_t i, int salt, const uint16_t* residual) {
  float sum = 0, mag = 0;
  for (int r = 0; r < g_comm->size; r++) {
    const float v = bf16_bits_to_float(value_bits(r, i, salt));
    sum += v, mag += fabsf(v);
  }
  float tol = (g_comm->size - 1) * mag / 256;
  if (residual) sum += bf16_bits_to_float(residual[i]), tol += (fabsf(sum) + tol) / 256;
  return fabsf(bf16_bits_to_float(got) - sum) <= tol + fabsf(sum) / 256;
}

// Fill x with this rank's values (and, if residual, residual with values common to all ranks), all-reduce,
// and compare x (or residual) with expected_bits bit for bit (NCCL's road beyond 2 ranks: within its
// roundings).
// The road all_reduce_fast takes for n elements, with the NVLink roads' grids capped at `blocks` thread
// blocks instead of AR_BLOCKS.
static void reduce_with_grid(bf16* x, size_t n, cudaStream_t s, bf16* residual, int blocks) {
  const ARRoad road = ar_road(g_comm, n);
  if (road == ARRoad::ONESHOT) all_reduce_p2p(g_comm, x, residual, n, s, blocks);
  else if (road == ARRoad::TWOSHOT) all_reduce_2shot(g_comm, x, residual, n, s, blocks);
  else all_reduce_fast(g_comm, x, n, s, residual);
}

// The most blocks an all-reduce may have here: one per SM, the same on every rank.
static int grid_limit() {
  int sms = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, g_rank));
  return (int)std::min<int64_t>(AR_MAX_BLOCKS, all_reduce_min(g_comm, sms));
}

static void check_all_reduce(bf16* x, size_t n, int salt, cudaStream_t s, const char* what,
                             bf16* residual = nullptr, int blocks = AR_BLOCKS) {
  const bool ring = g_comm->size > 2 && ar_road(g_comm, n) == ARRoad::NCCL;
  std::vector<uint16_t> h(n), r(n), got(n);
  for (size_t i = 0; i < n; i++) h[i] = value_bits(g_rank, i, salt), r[i] = value_bits(7, i, salt + 1);
  upload(x, h.data(), n * 2);
  if (residual) upload(residual, r.data(), n * 2);
  reduce_with_grid(x, n, s, residual, blocks);
  CUDA_CHECK(cudaStreamSynchronize(s));
  CUDA_CHECK(cudaMemcpy(got.data(), residual ? residual : x, n * 2, cudaMemcpyDeviceToHost));
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < n; i++) {
    const uint16_t* res = residual ? r.data() : nullptr;
    const bool ok = ring ? within_ring_rounding(got[i], i, salt, res) : same_bits(got[i], expected_bits(i, salt, res));
    if (!ok && !bad++) first = i;
  }
  CHECK_MSG(bad == 0, "%s%s n=%zu: %zu of %zu wrong, first at [%zu]: got %g want %g", what,
            residual ? " (into residual)" : "", n, bad, n, first, bf16_bits_to_float(got[first]),
            bf16_bits_to_float(expected_bits(first, salt, residual ? r.data() : nullptr)));
}

#define NEED_TWO_GPUS() \
  if (g_gpus < 2) SKIP("needs 2 GPUs, %d visible", g_gpus)

// The roads a test can force: the engine's default (each message on the first road it fits), NCCL alone,
// and the two-shot road alone (NCCL for what it does not take).
static const char* force_road(int m) {
  g_opt.oneshot_allreduce = m == 0;
  g_opt.twoshot_allreduce = m == 0 || m == 2;
  return m == 0 ? "auto" : m == 1 ? "nccl" : "two-shot";
}

TEST(all_reduce_matches_fp32_sum_on_every_road) {
  NEED_TWO_GPUS();
  printf("    %d ranks; NVLink all-reduce available: %s\n", g_comm->size, g_comm->fast ? "yes" : "no (NCCL only)");
  // Sizes: tiny; one decode row; uneven slices for the two-shot road (8 (N^2 + 1) and 5120 x 37); the
  // largest one-shot message at N > 2 and one row past it; 2 MB (past the one-shot road at N = 2 too); the
  // largest two-shot message; and a prefill step's (NCCL on every road).
  const size_t N2 = (size_t)g_comm->size * g_comm->size;
  const size_t sizes[] = {8,         4096,       8 * (N2 + 1),          5120 * 37,
                          AR_ONESHOT_MANY_RANKS / 2, AR_ONESHOT_MANY_RANKS / 2 + 4096, 4096 * 256,
                          AR_TWOSHOT_MAX_BYTES / 2, (size_t)16384 * 4096};
  bf16 *x, *residual;
  CUDA_CHECK(cudaMalloc(&x, sizes[8] * 2));
  CUDA_CHECK(cudaMalloc(&residual, sizes[8] * 2));
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const Optimizations saved = g_opt;
  for (int m : {0, 1, 2}) {
    const char* road = force_road(m);
    for (size_t n : sizes)
      for (bf16* r : {(bf16*)nullptr, residual}) check_all_reduce(x, n, (int)n + m + (r ? 99 : 0), s, road, r);
  }
  g_opt = saved;
  CUDA_CHECK(cudaFree(x));
  CUDA_CHECK(cudaFree(residual));
}

// The NVLink roads with smaller grids than their default, which the timing case compares: the same bits
// (a thread block then carries several chunks of a message, and a rank's grid may differ from another's).
TEST(all_reduce_with_smaller_grids) {
  NEED_TWO_GPUS();
  if (!g_comm->fast) SKIP("no NVLink road between these GPUs");
  const size_t sizes[] = {4096 * 64, 4096 * 256, 4096 * 512 + 8 * 17};
  bf16 *x, *residual;
  CUDA_CHECK(cudaMalloc(&x, sizes[2] * 2));
  CUDA_CHECK(cudaMalloc(&residual, sizes[2] * 2));
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int blocks : {8, 32, 64})
    for (size_t n : sizes)
      for (bf16* r : {(bf16*)nullptr, residual}) {
        // (rank r launches blocks << (r % 2): grids that differ between the ranks)
        const int mine = std::min(AR_BLOCKS, blocks << (g_rank % 2));
        const std::string what = std::to_string(blocks) + " blocks";
        check_all_reduce(x, n, (int)n + blocks + (r ? 7 : 0), s, what.c_str(), r, mine);
      }
  CUDA_CHECK(cudaFree(x));
  CUDA_CHECK(cudaFree(residual));
}

// Graphs keep the kernel's arguments; the call numbers (which staging half a call uses) live in device
// memory, so replays and eager calls can interleave in any order as long as every rank does the same.
TEST(all_reduce_in_cuda_graphs_mixed_with_eager_calls) {
  NEED_TWO_GPUS();
  const size_t na = 4096, nb = 4096 * 128;  // one-shot, and (N > 2) two-shot
  bf16 *a, *b, *c;
  CUDA_CHECK(cudaMalloc(&a, na * 2));
  CUDA_CHECK(cudaMalloc(&b, nb * 2));
  CUDA_CHECK(cudaMalloc(&c, nb * 2));
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  all_reduce_fast(g_comm, a, na, s, nullptr);
  all_reduce_fast(g_comm, b, nb, s, nullptr);
  CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 4; rep++) {
    std::vector<uint16_t> ha(na), hb(nb);
    for (size_t i = 0; i < na; i++) ha[i] = value_bits(g_rank, i, 100 + rep);
    for (size_t i = 0; i < nb; i++) hb[i] = value_bits(g_rank, i, 200 + rep);
    upload(a, ha.data(), na * 2);
    upload(b, hb.data(), nb * 2);
    CUDA_CHECK(cudaGraphLaunch(exec, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<uint16_t> ga(na), gb(nb);
    CUDA_CHECK(cudaMemcpy(ga.data(), a, na * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(gb.data(), b, nb * 2, cudaMemcpyDeviceToHost));
    size_t bad = 0;
    for (size_t i = 0; i < na; i++) {
      float sum = 0;
      for (int r = 0; r < g_comm->size; r++) sum += bf16_bits_to_float(value_bits(r, i, 100 + rep));
      bad += !same_bits(ga[i], float_to_bf16_bits(sum));
    }
    for (size_t i = 0; i < nb; i++) {
      float sum = 0;
      for (int r = 0; r < g_comm->size; r++) sum += bf16_bits_to_float(value_bits(r, i, 200 + rep));
      bad += !same_bits(gb[i], float_to_bf16_bits(sum));
    }
    CHECK_MSG(bad == 0, "replay %d: %zu wrong elements", rep, bad);
    check_all_reduce(c, 4096 * (rep + 1), 300 + rep, s, "eager between replays");
    check_all_reduce(c, 4096 * 32 * (rep + 1), 400 + rep, s, "eager between replays");
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
}

// Holds the GPU for a while: one rank falls behind the others.
__global__ void spin_kernel(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

// Many calls back to back with the ranks out of step: before some calls one rank is held up for 5-40 us,
// so the faster ranks run into their next calls (and reuse their staging halves) while the slower one
// still works on earlier ones. Sizes change from call to call, so the road (one-shot, two-shot), the grid
// (1 to 32 blocks) and the chunks each block owns change too. Every call has its own buffers, checked after
// all of them ran: a staging half overwritten too early would show up as a wrong sum. Eagerly, then from a
// graph, twice.
TEST(all_reduce_back_to_back_with_ranks_out_of_step) {
  NEED_TWO_GPUS();
  constexpr int CALLS = 48;
  const size_t sizes[] = {4096, 4096 * 40, 8, 4096 * 3, 4096 * 256, 4096 * 512};
  int clock_khz = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, g_rank));
  std::vector<bf16*> x(CALLS), res(CALLS);
  for (int i = 0; i < CALLS; i++) {
    CUDA_CHECK(cudaMalloc(&x[i], sizes[i % 6] * 2));
    CUDA_CHECK(cudaMalloc(&res[i], sizes[i % 6] * 2));
  }
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto calls = [&] {
    for (int i = 0; i < CALLS; i++) {
      const int slow = (i * 7 / 3) % (g_comm->size + 1);  // rank `slow` waits (size: nobody)
      if (slow == g_rank) spin_kernel<<<1, 1, 0, s>>>((long long)clock_khz / 1000 * (5 + (i * 13) % 36));
      all_reduce_fast(g_comm, x[i], sizes[i % 6], s, i % 4 == 1 ? res[i] : nullptr);
    }
  };
  auto fill_and_check = [&](int salt, const std::function<void()>& run, const char* what) {
    std::vector<std::vector<uint16_t>> r(CALLS);
    for (int i = 0; i < CALLS; i++) {
      const size_t n = sizes[i % 6];
      std::vector<uint16_t> h(n);
      r[i].resize(n);
      for (size_t j = 0; j < n; j++) {
        h[j] = value_bits(g_rank, j, salt + i);
        r[i][j] = value_bits(7, j, salt + i + 1);
      }
      upload(x[i], h.data(), n * 2);
      upload(res[i], r[i].data(), n * 2);
    }
    run();
    CUDA_CHECK(cudaStreamSynchronize(s));
    size_t bad = 0;
    int first = -1;
    for (int i = 0; i < CALLS; i++) {
      const size_t n = sizes[i % 6];
      const bool into_residual = i % 4 == 1;
      std::vector<uint16_t> got(n);
      CUDA_CHECK(cudaMemcpy(got.data(), into_residual ? res[i] : x[i], n * 2, cudaMemcpyDeviceToHost));
      size_t b = 0;
      for (size_t j = 0; j < n; j++)
        b += !same_bits(got[j], expected_bits(j, salt + i, into_residual ? r[i].data() : nullptr));
      if (b && first < 0) first = i;
      bad += b;
    }
    CHECK_MSG(bad == 0, "%s: %zu wrong elements, first in call %d", what, bad, first);
  };
  fill_and_check(1000, calls, "eager");
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  calls();
  CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 2; rep++)
    fill_and_check(2000 + 100 * rep, [&] { CUDA_CHECK(cudaGraphLaunch(exec, s)); }, "graph replay");
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  for (int i = 0; i < CALLS; i++) {
    CUDA_CHECK(cudaFree(x[i]));
    CUDA_CHECK(cudaFree(res[i]));
  }
}

TEST(gather_logits_to_rank_zero) {
  NEED_TWO_GPUS();
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int V : {151936, 1001}) {
    for (int B : {1, 3}) {
      const int64_t Vl = cdiv(V, g_comm->size);
      std::vector<float> shard((size_t)B * Vl);
      for (int b = 0; b < B; b++)
        for (int64_t j = 0; j < Vl; j++) {
          int64_t v = g_rank * Vl + j;
          shard[b * Vl + j] = v < V ? (float)(b * 1000003 + v) : 1e30f;  // padding must not arrive
        }
      float *d_shard, *staging, *full;
      CUDA_CHECK(cudaMalloc(&d_shard, shard.size() * 4));
      CUDA_CHECK(cudaMalloc(&staging, (size_t)(g_comm->size - 1) * B * Vl * 4));
      CUDA_CHECK(cudaMalloc(&full, (size_t)B * V * 4));
      CUDA_CHECK(cudaMemset(full, 0xff, (size_t)B * V * 4));  // poison: NaN
      upload(d_shard, shard.data(), shard.size() * 4);
      gather_logits(g_comm, d_shard, staging, full, B, V, s);
      CUDA_CHECK(cudaStreamSynchronize(s));
      if (g_rank == 0) {
        std::vector<float> got((size_t)B * V);
        CUDA_CHECK(cudaMemcpy(got.data(), full, got.size() * 4, cudaMemcpyDeviceToHost));
        size_t bad = 0;
        for (int b = 0; b < B; b++)
          for (int v = 0; v < V; v++) bad += got[(size_t)b * V + v] != (float)(b * 1000003 + v);
        CHECK_MSG(bad == 0, "V=%d B=%d: %zu wrong logits", V, B, bad);
      }
      CUDA_CHECK(cudaFree(d_shard));
      CUDA_CHECK(cudaFree(staging));
      CUDA_CHECK(cudaFree(full));
    }
  }
}

TEST(all_reduce_min_agrees) {
  NEED_TWO_GPUS();
  CHECK_EQ(all_reduce_min(g_comm, g_rank == 0 ? 1000 : 37), (int64_t)37);
  CHECK_EQ(all_reduce_min(g_comm, (int64_t)1 << 40), (int64_t)1 << 40);
}

// Microseconds per call of `call`, captured 100 times back to back in one CUDA graph (how decode runs the
// collectives) and replayed 10 times after a warm-up replay.
static double graph_us_per_call(cudaStream_t s, const std::function<void()>& call) {
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < 100; i++) call();
  CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_CHECK(cudaGraphLaunch(exec, s));  // warm-up
  CUDA_CHECK(cudaEventRecord(e0, s));
  for (int rep = 0; rep < 10; rep++) CUDA_CHECK(cudaGraphLaunch(exec, s));
  CUDA_CHECK(cudaEventRecord(e1, s));
  CUDA_CHECK(cudaEventSynchronize(e1));
  float ms;
  CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
  return ms * 1000.0 / 1000;  // 1000 calls
}

// Microseconds per all-reduce at the sizes of one decode step of a Qwen3-8B-wide model: B rows of H = 4096
// bf16, on each road that takes the message ("-" where it does not fit).
TIMING(bench_all_reduce_latency) {
  NEED_TWO_GPUS();
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const size_t most = (size_t)512 * 4096;
  bf16 *x, *residual;
  CUDA_CHECK(cudaMalloc(&x, most * 2));
  CUDA_CHECK(cudaMemset(x, 0, most * 2));
  CUDA_CHECK(cudaMalloc(&residual, most * 2));
  CUDA_CHECK(cudaMemset(residual, 0, most * 2));
  const Optimizations saved = g_opt;
  auto cell = [](bool fits, double us) {
    char b[32];
    if (fits) snprintf(b, sizeof b, "%7.2f us", us);
    else snprintf(b, sizeof b, "%10s", "-");
    return std::string(b);
  };
  for (int B : {1, 8, 32, 64, 128, 256, 512}) {
    const size_t n = (size_t)B * 4096;
    const bool one = g_comm->fast && n * 2 <= ar_max_bytes(g_comm->size), two = g_comm->fast && twoshot_fits(g_comm, n);
    double us[3] = {0, 0, 0};
    for (int road = 0; road < 3; road++) {  // one-shot alone, two-shot alone, NCCL alone
      g_opt.oneshot_allreduce = road == 0, g_opt.twoshot_allreduce = road == 1;
      if ((road == 0 && !one) || (road == 1 && !two)) continue;
      us[road] = graph_us_per_call(s, [&] { all_reduce_fast(g_comm, x, n, s, nullptr); });
    }
    force_road(0);
    const double add_us = graph_us_per_call(s, [&] { all_reduce_fast(g_comm, x, n, s, residual); });
    printf("    %d ranks, all-reduce of %3d x 4096 bf16 (%8zu bytes): one-shot %s  two-shot %s  NCCL %7.2f us  "
           "(default road into the residual %.2f us; in a CUDA graph)\n",
           g_comm->size, B, n * 2, cell(one, us[0]).c_str(), cell(two, us[1]).c_str(), us[2], add_us);
  }
  // The NVLink roads' grids: 32 and 64 thread blocks against 128 (the default, AR_BLOCKS), at most one per SM.
  const int grid_most = grid_limit();
  for (int B : {32, 64, 128, 256, 512}) {
    const size_t n = (size_t)B * 4096;
    std::string line;
    for (int road = 0; road < 2; road++) {
      const bool fits = road == 0 ? n * 2 <= ar_max_bytes(g_comm->size) : twoshot_fits(g_comm, n);
      if (!g_comm->fast || !fits) continue;
      line += road == 0 ? "  one-shot" : "  two-shot";
      for (int blocks : {32, 64, 128}) {
        if (blocks > grid_most) continue;
        const double t = graph_us_per_call(s, [&] {
          if (road == 0) all_reduce_p2p(g_comm, x, nullptr, n, s, blocks);
          else all_reduce_2shot(g_comm, x, nullptr, n, s, blocks);
        });
        char b[48];
        snprintf(b, sizeof b, " %d blocks %.2f us,", blocks, t);
        line += b;
      }
    }
    if (!line.empty()) printf("    %d ranks, %3d x 4096 bf16, by grid:%s\n", g_comm->size, B, line.c_str());
  }
  g_opt = saved;
  // One decode step's logits gather at batch 1 (Qwen3's vocabulary), also from a graph of 100.
  const int V = 151936;
  const int64_t Vl = cdiv(V, g_comm->size);
  float *shard, *staging, *full;
  CUDA_CHECK(cudaMalloc(&shard, Vl * 4));
  CUDA_CHECK(cudaMalloc(&staging, (g_comm->size - 1) * Vl * 4));
  CUDA_CHECK(cudaMalloc(&full, (size_t)V * 4));
  double us = graph_us_per_call(s, [&] { gather_logits(g_comm, shard, staging, full, 1, V, s); });
  printf("    gather_logits, batch 1, V = %d: %.2f us per call\n", V, us);
}

// The number of GPUs, counted in a short-lived child: this process must not touch CUDA before it forks.
static int count_gpus() {
  pid_t pid = fork();
  if (pid == 0) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    _exit(std::min(n, 100));
  }
  int st = 0;
  if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st)) return 0;
  return WEXITSTATUS(st);
}

int main(int argc, char** argv) {
  // The engine's default switches, on every rank, as a ModelRunner installs them (section 11): the NVLink
  // roads where they apply (g_opt is all off until a set is installed).
  install_optimizations(default_optimizations());
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  g_gpus = count_gpus();
  g_ranks = std::min(g_gpus, TP_MAX_RANKS);
  if (const char* e = getenv("NANOVLLM_TP_RANKS")) g_ranks = std::min(g_ranks, atoi(e));
  struct Shared {
    volatile int ready;
    ncclUniqueId id;
  };
  auto* sh = static_cast<Shared*>(mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                                       -1, 0));
  fflush(stdout);
  std::vector<pid_t> children;
  for (int r = 1; r < std::max(g_ranks, 2); r++) {  // (one partner even without GPUs: every case skips)
    const pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      g_rank = g_tp_rank = r;
      if (!freopen("/dev/null", "w", stdout)) return 1;
      break;
    }
    children.push_back(pid);
  }
  if (g_rank == 0) alarm(300);  // a lost partner would leave a collective waiting forever: fail instead
  if (g_ranks >= 2) {
    if (g_rank == 0) {
      CUDA_CHECK(cudaSetDevice(0));
      NCCL_CHECK(ncclGetUniqueId(&sh->id));
      __atomic_store_n(&sh->ready, 1, __ATOMIC_RELEASE);
    } else {
      while (!__atomic_load_n(&sh->ready, __ATOMIC_ACQUIRE)) usleep(1000);
    }
    g_comm = tp_comm_init(g_rank, g_ranks, sh->id);
    oneshot_setup(g_comm);  // section 20, as ModelRunner does it (the tp_ready hook)
  }
  g_gpus = g_ranks;  // what the cases use: NEED_TWO_GPUS
  int rc = test_main(argc, argv);
  if (g_rank != 0) _exit(rc);
  for (size_t k = 0; k < children.size(); k++) {
    int st;
    waitpid(children[k], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      printf("FAIL rank %zu ended with wait status %d: its checks failed or it crashed (see stderr)\n", k + 1, st);
      rc = 1;
    }
  }
  return rc;
}
