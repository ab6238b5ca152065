// engine_fixtures.h — small builders shared by the host tests that drive the Scheduler with a fake model
// (test_engine_core.cu, test_trace.cu). Include after nanovllm.cu.
#pragma once

static Config small_config(int num_blocks, int block_size, int max_num_batched_tokens = 16384,
                           int max_num_seqs = 512) {
  Config c;
  c.num_kvcache_blocks = num_blocks;
  c.kvcache_block_size = block_size;
  c.max_num_batched_tokens = max_num_batched_tokens;
  c.max_num_seqs = max_num_seqs;
  c.eos = {151645, 151643};
  return c;
}

static std::vector<int> iota_tokens(int n, int start = 0) {
  std::vector<int> v(n);
  for (int i = 0; i < n; i++) v[i] = start + i;
  return v;
}

static SamplingParams params_len(int max_tokens) {
  SamplingParams p;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}
