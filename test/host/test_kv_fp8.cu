// The FP8 KV cache's host side (nanovllm.cu section 31, and section 2's --kv-cache-dtype): the e4m3 CPU
// reference the GPU suites hold the kernels to, the per-layer scale rule, the flag, the block size and the
// trip to the tensor-parallel workers. No GPU: the kernels are checked against these in test/gpu.
#define NANOVLLM_TESTING
#include "../../nanovllm.cu"
#include "../test.h"

// Every byte but the two NaNs decodes to a value that encodes back to the same byte; the table's landmarks.
TEST(e4m3_reference_round_trips_every_code) {
  int nan = 0;
  for (int b = 0; b < 256; b++) {
    const float x = e4m3_to_float((uint8_t)b);
    if (std::isnan(x)) {
      nan++;
      continue;
    }
    CHECK_MSG(e4m3_from_float(x) == b, "code %02x -> %g -> %02x", b, x, e4m3_from_float(x));
  }
  CHECK_EQ(nan, 2);  // 0x7f and 0xff
  CHECK_EQ(e4m3_to_float(0x7e), 448.f);
  CHECK_EQ(e4m3_to_float(0x38), 1.f);
  CHECK_EQ(e4m3_to_float(0x08), 0x1p-6f);  // the smallest normal
  CHECK_EQ(e4m3_to_float(0x01), 0x1p-9f);  // the smallest subnormal
  CHECK_EQ(e4m3_to_float(0x07), 7 * 0x1p-9f);
  CHECK_EQ(e4m3_to_float(0xb8), -1.f);
}

// Round to nearest, ties to the even code; saturate at 448 (no infinities in e4m3); NaN stays NaN.
TEST(e4m3_reference_rounds_to_nearest_even_and_saturates) {
  CHECK_EQ(e4m3_from_float(1.0625f), 0x38);   // halfway between 1 (even) and 1.125: down
  CHECK_EQ(e4m3_from_float(1.1875f), 0x3a);   // halfway between 1.125 and 1.25 (even): up
  CHECK_EQ(e4m3_from_float(1.07f), 0x39);     // above halfway: up
  CHECK_EQ(e4m3_from_float(0x1p-10f), 0x00);  // halfway between 0 (even) and 2^-9: 0
  CHECK_EQ(e4m3_from_float(0x1.2p-10f), 0x01);
  CHECK_EQ(e4m3_from_float(0x1p-11f), 0x00);
  CHECK_EQ(e4m3_from_float(15 * 0x1p-10f), 0x08);  // 7.5 x 2^-9: to 8 x 2^-9 = 2^-6, the first normal
  CHECK_EQ(e4m3_from_float(464.f), 0x7e);     // halfway to the next (unrepresentable) step: saturates
  CHECK_EQ(e4m3_from_float(1e30f), 0x7e);
  CHECK_EQ(e4m3_from_float(INFINITY), 0x7e);
  CHECK_EQ(e4m3_from_float(-INFINITY), 0xfe);
  CHECK_EQ(e4m3_from_float(-0.f), 0x80);
  CHECK(std::isnan(e4m3_to_float(e4m3_from_float(NAN))));
  // Nearest: over a fine sweep of [-500, 500], no code is closer than the chosen one.
  std::vector<float> values;
  for (int b = 0; b < 256; b++)
    if (!std::isnan(e4m3_to_float((uint8_t)b))) values.push_back(e4m3_to_float((uint8_t)b));
  int bad = 0;
  for (double x = -500; x <= 500; x += 0.0137) {
    const float got = e4m3_to_float(e4m3_from_float((float)x));
    double nearest = 1e9;  // the distance to the closest code
    for (float v : values) nearest = std::min(nearest, std::fabs(x - v));
    bad += std::fabs(x - got) > nearest + 1e-12;
  }
  CHECK_EQ(bad, 0);
}

// The scale for a bound: the smallest power of two that brings the bound to 448 or below, within 2^-100..2^7.
TEST(kv_scale_is_the_smallest_power_of_two_that_fits) {
  std::mt19937 rng(17);
  std::uniform_real_distribution<double> lg(-20, 15);
  for (int i = 0; i < 10000; i++) {
    const double bound = std::pow(2.0, lg(rng));
    const float s = kv_scale_for(bound);
    int e;
    CHECK_MSG(std::frexp(s, &e) == 0.5, "scale %g is not a power of two", s);
    if (s < 128.f) {
      CHECK_MSG(bound / s <= 448.0, "bound %g / scale %g = %g > 448", bound, s, bound / s);
      CHECK_MSG(bound / (s / 2) > 448.0, "scale %g is not the smallest for bound %g", s, bound);
    }
  }
  CHECK_EQ(kv_scale_for(448.0), 1.f);
  CHECK_EQ(kv_scale_for(449.0), 2.f);
  CHECK_EQ(kv_scale_for(1e9), 128.f);  // clamped: values past 57,344 saturate
  CHECK_EQ(kv_scale_for(0.0), 1.f);
}

TEST(kv_cache_dtype_flag_and_block_size) {
  std::string d = "fp8";
  for (const char* s : {"auto", "bf16", "bfloat16"}) {
    CHECK_EQ(parse_kv_cache_dtype(s, d), std::string(""));
    CHECK_EQ(d, std::string("bf16"));
  }
  for (const char* s : {"fp8", "fp8_e4m3"}) {
    CHECK_EQ(parse_kv_cache_dtype(s, d), std::string(""));
    CHECK_EQ(d, std::string("fp8"));
  }
  CHECK(parse_kv_cache_dtype("fp8_e5m2", d).find("not supported") != std::string::npos);
  const std::string e = parse_kv_cache_dtype("fp9", d);
  CHECK_MSG(e.find("must be one of auto, bfloat16, bf16, fp8_e4m3, fp8") != std::string::npos, "%s", e.c_str());
  CHECK_EQ(kv_cache_value_bytes("bf16"), 2);
  CHECK_EQ(kv_cache_value_bytes("fp8"), 1);
  ModelConfig m;
  m.num_hidden_layers = 36, m.num_key_value_heads = 8, m.head_dim = 128;
  for (int tp : {1, 2, 4, 8})
    for (int P : {16, 256}) {
      CHECK_EQ(2 * kv_block_bytes(m, P, tp, kv_cache_value_bytes("fp8")), kv_block_bytes(m, P, tp, 2));
      CHECK_EQ(kv_block_bytes(m, P, tp), kv_block_bytes(m, P, tp, kv_cache_value_bytes("bf16")));
    }
}

// The workers build their engine from Config as JSON (section 12b): the cache's format too.
TEST(kv_cache_dtype_travels_to_the_workers) {
  for (const char* d : {"bf16", "fp8"}) {
    Config c;
    c.kv_cache_dtype = d;
    Config back = config_from_json(config_to_json(c));
    CHECK_EQ(back.kv_cache_dtype, std::string(d));
  }
}

int main(int argc, char** argv) { return test_main(argc, argv); }
