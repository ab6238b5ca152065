// FP8 checkpoints (Qwen/Qwen3-*-FP8) and FP8 weights, their host side, in the order nanovllm.cu reads:
//   section 37: config.json's quantization_config (the published form and every refusal), --quantization,
//     validate_config's rule that --quantization fp8 needs the switch fp8_weights, and the trip of all three
//     to the tensor-parallel workers;
//   section 6a ("Checkpoints with 8-bit float weights"): e4m3_to_float, block_quantized_values and
//     block_quantized_first_nan (safetensors.h) against the format's
//     definition and cuda_fp8.h for all 256 bytes, block_scales, dequantize_row (scales by the global row
//     and column), checkpoint_tensors and kept_unquantized, and validate_checkpoint on safetensors files
//     written here (each way an FP8 checkpoint can be wrong);
//   sections 28-30 (switch fp8_weights): e4m3_from_float against cuda_fp8.h's __nv_cvt_float_to_fp8,
//     quantize_weight_reference, quantize_rows_reference, fp8_linear_reference against a direct product of
//     dequantized values, fp8_weights_shape_problem (the rules on a model's widths and kept linears), and
//     fp8_weights_problem (it asks the GPU its architecture first: skipped without one).
// The GPU kernels against these references: test/gpu/gpu_gemm.cu.
#define NANOVLLM_TESTING
#include "../../nanovllm.cu"
#include <cfloat>
#include <filesystem>
#include "../test.h"

// Independent of nanovllm.cu: cuda_fp8.h's and cuda_bf16.h's host conversions.
static float cuda_e4m3_to_float(uint8_t b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3)));
}
static uint8_t cuda_e4m3_from_float(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); }
static uint16_t cuda_bf16_bits(float x) {
  __nv_bfloat16_raw r = __float2bfloat16(x);
  return r.x;
}
static float bf16_value(uint16_t bits) {
  __nv_bfloat16_raw r;
  r.x = bits;
  return __bfloat162float(__nv_bfloat16(r));
}

// ==== section 37: quantization_config, --quantization ==================================================

// A tiny Qwen3 config.json (H 200, I 264: neither a multiple of 128; two layers) with `quant` as its
// quantization_config ("" for none).
static std::string tiny_config(const std::string& quant, bool tied = true) {
  return std::string(R"({"architectures":["Qwen3ForCausalLM"],"hidden_size":200,"intermediate_size":264,)"
                     R"("num_hidden_layers":2,"num_attention_heads":2,"num_key_value_heads":1,"head_dim":128,)"
                     R"("vocab_size":40,"max_position_embeddings":4096,"rms_norm_eps":1e-6,"rope_theta":1e6,)"
                     R"("tie_word_embeddings":)") +
         (tied ? "true" : "false") + (quant.empty() ? "" : ",\"quantization_config\":" + quant) + "}";
}
// Qwen3-8B-FP8's quantization_config as published.
static const std::string kPublished =
    R"({"activation_scheme":"dynamic","fmt":"e4m3","quant_method":"fp8","weight_block_size":[128,128]})";

TEST(quantization_config_as_published) {
  ModelConfig c = parse_model_config(tiny_config(kPublished), "config.json");
  CHECK(c.block_quantized);
  CHECK(c.not_quantized.empty());
  // transformers' FineGrainedFP8Config writes no fmt and may leave activation_scheme out (dynamic).
  c = parse_model_config(tiny_config(R"({"quant_method":"fp8","weight_block_size":[128,128]})"), "config.json");
  CHECK(c.block_quantized);
  c = parse_model_config(tiny_config(R"({"quant_method":"fp8","weight_block_size":[128,128],)"
                                     R"("modules_to_not_convert":["lm_head","model.layers.1.mlp.down_proj"]})"),
                         "config.json");
  CHECK(c.block_quantized);
  CHECK(c.not_quantized == std::vector<std::string>({"lm_head", "model.layers.1.mlp.down_proj"}));
  c = parse_model_config(tiny_config(R"({"quant_method":"fp8","weight_block_size":[128,128],)"
                                     R"("modules_to_not_convert":null})"),
                         "config.json");
  CHECK(c.block_quantized && c.not_quantized.empty());
  // fmt and activation_scheme null: absent, as for the other fields.
  c = parse_model_config(tiny_config(R"({"quant_method":"fp8","fmt":null,"activation_scheme":null,)"
                                     R"("weight_block_size":[128,128]})"),
                         "config.json");
  CHECK(c.block_quantized);
  // No quantization_config, or null: an unquantized checkpoint.
  for (const char* q : {"", "null"}) {
    c = parse_model_config(tiny_config(q), "config.json");
    CHECK_MSG(!c.block_quantized && c.not_quantized.empty(), "quantization_config '%s'", q);
  }
  // parse_quantization_config alone: it sets both fields and replaces a list left from before.
  ModelConfig m;
  m.not_quantized = {"stale"};
  parse_quantization_config(json::parse(R"({"quantization_config":)" + kPublished + "}"), m, "x.json");
  CHECK(m.block_quantized && m.not_quantized.empty());
  ModelConfig none;
  parse_quantization_config(json::parse(R"({"hidden_size":8})"), none, "x.json");
  CHECK(!none.block_quantized);
}

TEST(quantization_config_refusals) {
  const std::string tail = R"("weight_block_size":[128,128]})";  // closes a config that is otherwise valid
  const std::string fp8 = R"({"quant_method":"fp8",)";
  struct Case {
    std::string quant;
    std::vector<std::string> needles;
  };
  const std::string obj = "field \"quantization_config\" must be an object, found ";
  const std::string need = "quantization_config needs \"quant_method\" as a string, found ";
  const std::string unsupported_tail = "is not supported; nanovllm reads unquantized checkpoints (BF16, F16, F32) "
                                       "and \"fp8\" ones with 128 x 128 block scales";
  const std::string per_tensor = "quantization_config has no \"weight_block_size\": a per-tensor FP8 checkpoint";
  const std::string block = "quantization_config.weight_block_size must be [128, 128], found ";
  const std::string list = "quantization_config.modules_to_not_convert must be a list of module names, found ";
  const std::vector<Case> cases = {
      {R"("fp8")", {obj + "\"fp8\""}},
      {R"(["fp8"])", {obj + "[\"fp8\"]"}},
      {"3", {obj + "3"}},
      {"true", {obj + "true"}},
      {"{}", {need + "none; nanovllm reads \"fp8\""}},
      {R"({"weight_block_size":[128,128]})", {need + "none"}},
      {R"({"quant_method":8,)" + tail, {need + "8;"}},
      {R"({"quant_method":null,)" + tail, {need + "null;"}},
      {R"({"quant_method":["fp8"],)" + tail, {need + "[\"fp8\"];"}},
      {R"({"quant_method":"gptq","bits":4})", {"quant_method \"gptq\" " + unsupported_tail, "not gptq, awq"}},
      {R"({"quant_method":"awq","bits":4})", {"quant_method \"awq\" " + unsupported_tail}},
      {R"({"quant_method":"compressed-tensors"})", {"quant_method \"compressed-tensors\" " + unsupported_tail}},
      {R"({"quant_method":"bitsandbytes","load_in_4bit":true})", {"quant_method \"bitsandbytes\" is not supp"}},
      {R"({"quant_method":"gguf"})", {"quant_method \"gguf\" is not supported"}},
      {R"({"quant_method":"fbgemm_fp8",)" + tail, {"quant_method \"fbgemm_fp8\" is not supported"}},
      {R"({"quant_method":"FP8",)" + tail, {"quant_method \"FP8\" is not supported"}},
      {R"({"quant_method":"",)" + tail, {"quant_method \"\" is not supported"}},
      {fp8 + R"("fmt":"e5m2",)" + tail, {"quantization_config.fmt \"e5m2\" is not supported", "reads \"e4m3\""}},
      {fp8 + R"("fmt":"E4M3",)" + tail, {"quantization_config.fmt \"E4M3\" is not supported"}},
      {fp8 + R"("fmt":4,)" + tail, {"quantization_config.fmt 4 is not supported"}},
      {fp8 + R"("activation_scheme":"static",)" + tail,
       {"quantization_config.activation_scheme \"static\" is not supported", "\"dynamic\"", "input_scale"}},
      {fp8 + R"("activation_scheme":"Dynamic",)" + tail, {"activation_scheme \"Dynamic\" is not supported"}},
      {R"({"quant_method":"fp8","activation_scheme":"dynamic"})", {per_tensor, "[128, 128]"}},
      {R"({"quant_method":"fp8","weight_block_size":null})", {per_tensor}},
      {fp8 + R"("weight_block_size":[64,64]})", {block + "[64,64]"}},
      {fp8 + R"("weight_block_size":[1,128]})", {block + "[1,128]"}},
      {fp8 + R"("weight_block_size":[128,64]})", {block + "[128,64]"}},
      {fp8 + R"("weight_block_size":[128]})", {block + "[128]"}},
      {fp8 + R"("weight_block_size":[128,128,128]})", {block + "[128,128,128]"}},
      {fp8 + R"("weight_block_size":["128","128"]})", {block + "[\"128\",\"128\"]"}},
      {fp8 + R"("weight_block_size":128})", {block + "128"}},
      {fp8 + R"("modules_to_not_convert":"lm_head",)" + tail, {list + "\"lm_head\""}},
      {fp8 + R"("modules_to_not_convert":{"lm_head":1},)" + tail, {list + "{\"lm_head\":1}"}},
      {fp8 + R"("modules_to_not_convert":[],"weight_block_size":[64,64]})", {block + "[64,64]"}},
      {fp8 + R"("modules_to_not_convert":[""],)" + tail,
       {"quantization_config.modules_to_not_convert: \"\" is not a module name"}},
      {fp8 + R"("modules_to_not_convert":["lm_head",3],)" + tail,
       {"modules_to_not_convert: 3 is not a module name"}},
      {fp8 + R"("modules_to_not_convert":["lm_head",null],)" + tail,
       {"modules_to_not_convert: null is not a module name"}},
      {fp8 + R"("modules_to_not_convert":[["lm_head"]],)" + tail, {"[\"lm_head\"] is not a module name"}},
  };
  for (const Case& k : cases) {
    std::vector<std::string> needles = k.needles;
    needles.push_back("/m/q.json: ");  // every message names the file first
    expect_die("quantization_config " + k.quant, [&] { parse_model_config(tiny_config(k.quant), "/m/q.json"); },
               needles);
  }
}

// --quantization (vLLM's flag): this build's methods are the registry's, fp8 from section 30.
TEST(quantization_flag_names_what_is_supported) {
  std::string method = "unchanged";
  CHECK_EQ(parse_quantization("fp8", method), std::string(""));
  CHECK_EQ(method, std::string("fp8"));
  for (const char* bad : {"gptq", "awq", "FP8", "fp8_e4m3", "", "bitsandbytes"}) {
    method = "unchanged";
    const std::string e = parse_quantization(bad, method);
    CHECK_MSG(e.find("--quantization must be fp8 (a bf16 checkpoint's linear weights quantized at load), found '" +
                     std::string(bad) + "'") != std::string::npos,
              "'%s': %s", bad, e.c_str());
    const char* others = "gptq, awq, compressed-tensors, bitsandbytes and gguf are not supported";
    CHECK_MSG(e.find(others) != std::string::npos, "'%s': %s", bad, e.c_str());
    CHECK_EQ(method, std::string("unchanged"));
  }
  // Through the command line: the flag sets Config::quantization, in both spellings; absent, it is "".
  auto parse = [](std::vector<const char*> args) {
    args.insert(args.begin(), "nanovllm");
    return parse_args((int)args.size(), const_cast<char**>(args.data())).config;
  };
  CHECK_EQ(parse({"model", "p.txt", "--quantization", "fp8"}).quantization, std::string("fp8"));
  CHECK_EQ(parse({"model", "p.txt", "--quantization=fp8"}).quantization, std::string("fp8"));
  CHECK_EQ(parse({"model", "p.txt"}).quantization, std::string(""));
  expect_die("--quantization awq", [&] { parse({"model", "p.txt", "--quantization", "awq"}); },
             {"--quantization must be fp8", "found 'awq'"});
}

// The method is computed by the optimization fp8_weights: --plain (or --opt without it) and --quantization fp8
// contradict each other, and validate_config says which flag to change.
TEST(quantization_fp8_needs_the_fp8_weights_switch) {
  const ModelConfig m = parse_model_config(tiny_config(""), "config.json");
  auto opts = [](const char* spec) {
    OptimizationSet s = default_optimizations();
    const std::string e = parse_optimizations(spec, s);
    CHECK_MSG(e.empty(), "%s: %s", spec, e.c_str());
    return s;
  };
  auto config = [&](const std::string& quantization, const char* spec) {
    Config c;
    c.quantization = quantization;
    c.opt = opts(spec);
    return c;
  };
  for (const char* spec : {"all", "none,fp8_weights", "-pdl"}) {
    Config c = config("fp8", spec);
    expect_no_die(std::string("--quantization fp8 --opt ") + spec, [&] { validate_config(c, m); });
  }
  for (const char* spec : {"none", "all,-fp8_weights", "none,gemv,pdl"}) {
    Config c = config("fp8", spec);
    expect_die(std::string("--quantization fp8 --opt ") + spec, [&] { validate_config(c, m); },
               {"--quantization fp8 is computed by the optimization fp8_weights, which this run switches off "
                "(--plain or --opt)",
                "drop --quantization"});
    Config plain = config("", spec);  // without --quantization, any switch set is fine
    expect_no_die(std::string("--opt ") + spec, [&] { validate_config(plain, m); });
  }
  // The command line: --plain after or before --quantization fp8.
  auto run = [](std::vector<const char*> args) {
    args.insert(args.begin(), "nanovllm");
    Cli cli = parse_args((int)args.size(), const_cast<char**>(args.data()));
    return cli.config;
  };
  for (auto args : {std::vector<const char*>{"model", "p.txt", "--quantization", "fp8", "--plain"},
                    std::vector<const char*>{"model", "p.txt", "--plain", "--quantization", "fp8"}}) {
    Config c = run(args);
    expect_die("--plain --quantization fp8", [&] { validate_config(c, m); }, {"fp8_weights", "--plain"});
  }
}

// The workers build their engine from JSON (section 12b): the checkpoint's format, its list of bf16 linears
// and --quantization must all survive the trip.
TEST(quantization_reaches_the_workers) {
  const ModelConfig q = parse_model_config(
      tiny_config(R"({"quant_method":"fp8","weight_block_size":[128,128],)"
                  R"("modules_to_not_convert":["lm_head","model.layers.1.self_attn"]})"),
      "config.json");
  ModelConfig back = model_config_from_json(model_config_to_json(q));
  CHECK(back.block_quantized);
  CHECK(back.not_quantized == q.not_quantized);
  CHECK_EQ(back.not_quantized.size(), (size_t)2);
  back = model_config_from_json(model_config_to_json(parse_model_config(tiny_config(""), "config.json")));
  CHECK(!back.block_quantized);
  CHECK(back.not_quantized.empty());
  for (const char* method : {"fp8", ""}) {
    Config c;
    c.quantization = method;
    CHECK_EQ(config_from_json(config_to_json(c)).quantization, std::string(method));
  }
}

// ==== section 6a: e4m3 bytes, block scales, the dequantizing loader ====================================

// Every byte against the definition (written with ldexp in double) and against cuda_fp8.h (e4m3 -> fp16 is
// exact: every e4m3 value is an fp16 value); block_quantized_values holds the same 256 values.
TEST(e4m3_to_float_all_256_bytes) {
  const float* table = block_quantized_values();
  CHECK(table == block_quantized_values());  // built once
  int nans = 0;
  for (int b = 0; b < 256; b++) {
    const float got = e4m3_to_float((uint8_t)b), cuda = cuda_e4m3_to_float((uint8_t)b);
    const int e = (b >> 3) & 15, m = b & 7;
    const double mag = e == 0 ? std::ldexp((double)m, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
    const double def = (b & 0x80) ? -mag : mag;
    if ((b & 0x7f) == 0x7f) {
      nans++;
      CHECK_MSG(std::isnan(got) && std::isnan(cuda) && std::isnan(table[b]), "byte %02x: %g (table %g), want NaN",
                b, got, table[b]);
      continue;
    }
    CHECK_MSG(got == cuda && got == (float)def && std::signbit(got) == (b >= 0x80) && table[b] == got &&
                  std::signbit(table[b]) == std::signbit(got),
              "byte %02x: %g, table %g, cuda_fp8.h %g, definition %g", b, got, table[b], cuda, def);
  }
  CHECK_EQ(nans, 2);
  CHECK_EQ(e4m3_to_float(0x7e), 448.f);
  CHECK_EQ(e4m3_to_float(0xfe), -448.f);
  CHECK_EQ(e4m3_to_float(0x01), 0x1p-9f);
  CHECK_EQ(e4m3_to_float(0x08), 0x1p-6f);
  CHECK_EQ(e4m3_to_float(0x38), 1.f);
}

// block_quantized_first_nan (the loaders' check, eight bytes at a time) against a byte-by-byte search: every length to 80
// at every start offset mod 8, with no NaN, with one NaN byte (0x7F or 0xFF) at every position, and with two;
// and long random buffers in which every byte value occurs. The non-NaN bytes include the values next to a
// NaN in each word's arithmetic (0x7E, 0xFE, 0x80, 0x00, 0x01), so a carry between bytes would show.
TEST(block_quantized_first_nan_matches_a_byte_search) {
  auto naive = [](const uint8_t* p, size_t n) {
    for (size_t i = 0; i < n; i++)
      if ((p[i] & 0x7f) == 0x7f) return i;
    return n;
  };
  std::mt19937 rng(7);
  const uint8_t near[] = {0x7e, 0xfe, 0x80, 0x00, 0x01, 0x3f, 0xbf, 0x7d};
  std::vector<uint8_t> buf(96 + 8);
  size_t cases = 0;
  for (size_t off = 0; off < 8; off++)
    for (size_t n = 0; n <= 80; n++) {
      uint8_t* p = buf.data() + off;
      for (size_t i = 0; i < n; i++) p[i] = near[rng() % 8];
      CHECK_EQ(block_quantized_first_nan(p, n), n);
      for (size_t at = 0; at < n; at++)
        for (uint8_t nan : {(uint8_t)0x7f, (uint8_t)0xff}) {
          const uint8_t keep = p[at];
          p[at] = nan;
          CHECK_MSG(block_quantized_first_nan(p, n) == at, "offset %zu, length %zu: NaN 0x%02x at %zu, found at %zu", off, n,
                    nan, at, block_quantized_first_nan(p, n));
          const size_t later = at + 1 + rng() % (n - at);  // a second NaN after it (or none, at n)
          if (later < n) {
            const uint8_t keep2 = p[later];
            p[later] = 0xff;
            CHECK_EQ(block_quantized_first_nan(p, n), at);
            p[later] = keep2;
          }
          p[at] = keep;
          cases++;
        }
    }
  std::vector<uint8_t> big(1 << 16);
  for (int trial = 0; trial < 64; trial++) {
    const size_t n = big.size() - rng() % 64;
    for (size_t i = 0; i < n; i++) big[i] = (uint8_t)rng();
    for (size_t i = 0; i < n; i++)  // mostly without NaN: keep a few, clear the rest
      if ((big[i] & 0x7f) == 0x7f && rng() % 1024) big[i] = 0x7e;
    CHECK_EQ(block_quantized_first_nan(big.data(), n), naive(big.data(), n));
  }
  CHECK(cases > 20000);
}

static TensorView view(const std::string& name, DType dt, std::vector<int64_t> shape, const void* data) {
  TensorView t;
  t.name = name, t.file = "/m/model.safetensors", t.dtype = dt, t.shape = shape, t.data = data;
  t.nbytes = (size_t)t.numel() * (dt == DType::F32 ? 4 : dt == DType::F8_E4M3 ? 1 : 2);
  return t;
}

// Random scales of an awkward shape, as F32 and as BF16: read back exactly, row-major; 0, subnormals and
// the largest finite values are scales too.
TEST(block_scales_read_bf16_and_f32) {
  std::mt19937 rng(61);
  std::uniform_real_distribution<float> lg(-30.f, 30.f);
  for (std::vector<int64_t> shape : {std::vector<int64_t>{3, 5}, {1, 1}, {7, 2}, {1, 13}}) {
    const size_t n = shape[0] * shape[1];
    std::vector<float> f(n);
    for (float& x : f) x = std::exp2(lg(rng)) * (1.f + (float)(rng() % 1000) / 1000.f);
    f[0] = 0.f;
    if (n > 2) f[1] = 1e-40f, f[2] = FLT_MAX;
    const std::vector<float> got = block_scales(view("s.weight_scale_inv", DType::F32, shape, f.data()));
    CHECK_MSG(got == f, "F32 [%lld, %lld]", (long long)shape[0], (long long)shape[1]);
    std::vector<uint16_t> b(n);
    for (uint16_t& x : b) do x = (uint16_t)(rng() & 0x7fff); while ((x & 0x7f80) == 0x7f80);  // >= 0, finite
    const std::vector<float> gotb = block_scales(view("s.weight_scale_inv", DType::BF16, shape, b.data()));
    int bad = 0;
    for (size_t i = 0; i < n; i++) bad += !(gotb[i] == bf16_value(b[i]));
    CHECK_MSG(bad == 0 && gotb.size() == n, "BF16 [%lld, %lld]: %d differ", (long long)shape[0],
              (long long)shape[1], bad);
  }
}

// A NaN, infinite or negative scale is a damaged checkpoint: refused with the tensor, its file and the block
// (and which weights the block covers), never passed on to make a block of NaNs.
TEST(block_scales_refuse_nan_inf_negative) {
  // [3, 5]: element 7 is block [1, 2], rows 128.., columns 256...
  for (float bad : {NAN, INFINITY, -INFINITY, -1.f, -1e-30f}) {
    std::vector<float> f(15, 0.5f);
    f[7] = bad;
    const std::string name = "model.layers.3.mlp.up_proj.weight_scale_inv";
    expect_die("F32 " + std::to_string(bad), [&] { block_scales(view(name, DType::F32, {3, 5}, f.data())); },
               {"tensor 'model.layers.3.mlp.up_proj.weight_scale_inv' in /m/model.safetensors holds",
                "for block [1, 2] (rows 128.., columns 256..)", "finite numbers >= 0", "damaged"});
  }
  expect_die("F32 -2 names the value", [&] {
    const float f[2] = {1.f, -2.f};
    block_scales(view("s", DType::F32, {1, 2}, f));
  }, {"holds -2 for block [0, 1] (rows 0.., columns 128..)"});
  for (uint16_t bad : {(uint16_t)0x7fc0, (uint16_t)0x7f80, (uint16_t)0xff80, (uint16_t)0xbf80, (uint16_t)0x8001}) {
    std::vector<uint16_t> b(6, 0x3f00);  // 0.5
    b[5] = bad;                          // [2, 3]: block [1, 2]
    char what[32];
    snprintf(what, sizeof what, "BF16 %04x", bad);
    expect_die(what, [&] { block_scales(view("y.weight_scale_inv", DType::BF16, {2, 3}, b.data())); },
               {"tensor 'y.weight_scale_inv'", "block [1, 2] (rows 128.., columns 256..)"});
  }
}

// Random e4m3 bytes (no NaN) [rows, cols] and random fp32 scales [ceil(rows/128), ceil(cols/128)], one of
// them 0.
struct Fp8Weight {
  int64_t rows, cols, scale_cols;
  std::vector<uint8_t> w;
  std::vector<float> scale;
};
static Fp8Weight random_fp8(int64_t rows, int64_t cols, std::mt19937& rng) {
  Fp8Weight f{rows, cols, cdiv(cols, 128), {}, {}};
  f.w.resize(rows * cols);
  for (uint8_t& b : f.w) do b = (uint8_t)rng(); while ((b & 0x7f) == 0x7f);
  std::uniform_real_distribution<float> lg(-14.f, 2.f);
  f.scale.resize(cdiv(rows, 128) * f.scale_cols);
  for (float& s : f.scale) s = std::exp2(lg(rng)) * (1.f + (float)(rng() % 1000) / 997.f);  // not powers of 2
  if (f.scale.size() > 1) f.scale[1] = 0.f;
  return f;
}
// Row r of f from column c, n weights, as dequantize_row writes them (poisoned past n: it must stop there).
static std::vector<uint16_t> dequantized(const Fp8Weight& f, int64_t r, int64_t c, int64_t n,
                                         int64_t as_row = -1) {
  std::vector<uint16_t> out(n + 3, 0xdead);
  const TensorView t = view("w", DType::F8_E4M3, {f.rows, f.cols}, f.w.data());
  dequantize_row(out.data(), &f.w[r * f.cols + c], n, f.scale.data(), f.scale_cols, as_row < 0 ? r : as_row, c, t);
  for (int i = 0; i < 3; i++)
    CHECK_MSG(out[n + i] == 0xdead, "row %lld: wrote past n = %lld", (long long)r, (long long)n);
  out.resize(n);
  return out;
}

// Each weight against bf16(e4m3 * its block's scale), computed with cuda_fp8.h and cuda_bf16.h and the block
// index written out; whole rows of awkward shapes (partial blocks at both edges) and slices that start
// inside a block, as tensor parallelism cuts them.
TEST(dequantize_row_matches_the_definition) {
  std::mt19937 rng(62);
  for (std::pair<int64_t, int64_t> shape : {std::pair<int64_t, int64_t>{1, 1}, {1, 129}, {127, 1}, {300, 389},
                                            {129, 257}, {384, 130}}) {
    const Fp8Weight f = random_fp8(shape.first, shape.second, rng);
    auto want = [&](int64_t r, int64_t c) {
      const float s = f.scale[(r / 128) * f.scale_cols + c / 128];
      return cuda_bf16_bits(cuda_e4m3_to_float(f.w[r * f.cols + c]) * s);
    };
    int64_t bad = 0, checked = 0;
    auto compare = [&](int64_t r, int64_t c, int64_t n) {
      const std::vector<uint16_t> got = dequantized(f, r, c, n);
      for (int64_t j = 0; j < n; j++, checked++)
        if (got[j] != want(r, c + j) && bad++ < 3)
          fprintf(stderr, "    %lldx%lld [%lld, %lld] (slice from column %lld): %04x, want %04x\n",
                  (long long)f.rows, (long long)f.cols, (long long)r, (long long)(c + j), (long long)c, got[j],
                  want(r, c + j));
    };
    for (int64_t r = 0; r < f.rows; r++) {
      compare(r, 0, f.cols);
      const int64_t c = rng() % f.cols, n = 1 + rng() % (f.cols - c);  // anywhere, inside a block or not
      compare(r, c, n);
    }
    CHECK_MSG(bad == 0, "%lldx%lld: %lld of %lld weights differ", (long long)f.rows, (long long)f.cols,
              (long long)bad, (long long)checked);
  }
  // Known values and the rounding: 1.0 (0x38) and -448 (0xfe) times 0.5; products halfway between two bf16
  // values round to the even one (1 + 2^-8 down to 1, 1 + 3 x 2^-8 up to 1 + 2^-6).
  const uint8_t w[2] = {0x38, 0xfe};
  const TensorView t = view("w", DType::F8_E4M3, {1, 2}, w);
  uint16_t out[2];
  const float half[1] = {0.5f}, down[1] = {1.f + 0x1p-8f}, up[1] = {1.f + 3 * 0x1p-8f};
  dequantize_row(out, w, 2, half, 1, 0, 0, t);
  CHECK_EQ(bf16_value(out[0]), 0.5f);
  CHECK_EQ(bf16_value(out[1]), -224.f);
  dequantize_row(out, w, 1, down, 1, 0, 0, t);
  CHECK_EQ(bf16_value(out[0]), 1.f);
  dequantize_row(out, w, 1, up, 1, 0, 0, t);
  CHECK_EQ(bf16_value(out[0]), 1.f + 0x1p-6f);
}

// The scales are indexed by the global row and column: a slice equals the same slice of the whole row, bit
// for bit, wherever it starts; the same bytes read as if they were row 0 or column 0 (local indices) take
// another block's scales and differ, so the comparison can tell.
TEST(dequantize_row_slices_use_global_indices) {
  std::mt19937 rng(63);
  const Fp8Weight f = random_fp8(392, 520, rng);  // 3.06 x 4.06 blocks
  for (int tp : {2, 4, 8}) {
    int64_t bad = 0;
    for (int64_t r : {(int64_t)0, (int64_t)130, (int64_t)391}) {
      const std::vector<uint16_t> whole = dequantized(f, r, 0, f.cols);
      for (int k = 0; k < tp; k++) {  // row-parallel columns: 520/8 = 65, starting mid-block
        const int64_t c = k * (f.cols / tp), n = f.cols / tp;
        const std::vector<uint16_t> part = dequantized(f, r, c, n);
        for (int64_t j = 0; j < n; j++) bad += part[j] != whole[c + j];
      }
    }
    CHECK_MSG(bad == 0, "--tp %d: %lld weights differ from the whole row's", tp, (long long)bad);
  }
  const std::vector<uint16_t> row130 = dequantized(f, 130, 0, f.cols);
  const std::vector<uint16_t> as_row0 = dequantized(f, 130, 0, f.cols, 0);
  CHECK(row130 != as_row0);
  const std::vector<uint16_t> from200 = dequantized(f, 130, 200, 100);
  std::vector<uint16_t> as_col0(100);
  const TensorView t = view("w", DType::F8_E4M3, {f.rows, f.cols}, f.w.data());
  dequantize_row(as_col0.data(), &f.w[130 * f.cols + 200], 100, f.scale.data(), f.scale_cols, 130, 0, t);
  CHECK(from200 != as_col0);
}

// A NaN byte (0x7F or 0xFF) never comes out of a quantizer: refused with the tensor, its file and the
// position in the whole tensor; a slice that does not hold it passes.
TEST(dequantize_row_refuses_nan_bytes) {
  std::mt19937 rng(64);
  Fp8Weight f = random_fp8(300, 389, rng);
  f.w[130 * f.cols + 237] = 0xff;
  f.w[299 * f.cols + 388] = 0x7f;
  TensorView t = view("model.layers.5.mlp.down_proj.weight", DType::F8_E4M3, {300, 389}, f.w.data());
  std::vector<uint16_t> out(f.cols);
  expect_die("0xff", [&] {
    dequantize_row(out.data(), &f.w[130 * f.cols + 200], 100, f.scale.data(), f.scale_cols, 130, 200, t);
  }, {"tensor 'model.layers.5.mlp.down_proj.weight' in /m/model.safetensors holds a NaN byte (0xff) at [130, 237]",
      "damaged"});
  expect_die("0x7f", [&] {
    dequantize_row(out.data(), &f.w[299 * f.cols], f.cols, f.scale.data(), f.scale_cols, 299, 0, t);
  }, {"holds a NaN byte (0x7f) at [299, 388]"});
  expect_no_die("the rest of row 130", [&] {
    dequantize_row(out.data(), &f.w[130 * f.cols + 238], f.cols - 238, f.scale.data(), f.scale_cols, 130, 238, t);
    dequantize_row(out.data(), &f.w[130 * f.cols], 237, f.scale.data(), f.scale_cols, 130, 0, t);
  });
}

// modules_to_not_convert matches as transformers' FP8 integration matches it: an entry keeps every linear
// whose name contains it (so "model.layers.1" keeps layers 10..19 as well, and "model.layers.1." only 1).
TEST(kept_unquantized_matches_substrings) {
  ModelConfig c;
  c.not_quantized = {"lm_head", "model.layers.1.", "down_proj", "model.layers.2.self_attn.q_proj",
                     "model.layers.3"};
  CHECK(kept_unquantized(c, "lm_head.weight"));
  CHECK(kept_unquantized(c, "model.layers.1.mlp.up_proj.weight"));
  CHECK(!kept_unquantized(c, "model.layers.10.mlp.up_proj.weight"));
  CHECK(kept_unquantized(c, "model.layers.7.mlp.down_proj.weight"));
  CHECK(kept_unquantized(c, "model.layers.2.self_attn.q_proj.weight"));
  CHECK(!kept_unquantized(c, "model.layers.2.self_attn.k_proj.weight"));
  CHECK(kept_unquantized(c, "model.layers.3.mlp.gate_proj.weight"));
  CHECK(kept_unquantized(c, "model.layers.31.mlp.gate_proj.weight"));
  CHECK(!kept_unquantized(c, "model.layers.4.mlp.gate_proj.weight"));
  CHECK(!kept_unquantized(ModelConfig(), "model.layers.0.mlp.down_proj.weight"));
}

// The list validate_checkpoint and load_weights go by: each quantized linear followed by its scales, shaped
// one per 128 x 128 block rounded up; norms, the embedding and an untied lm_head stay plain.
TEST(checkpoint_tensors_lists_weights_and_scales) {
  const ModelConfig q = parse_model_config(tiny_config(kPublished, false), "config.json");
  const std::vector<TensorSpec> specs = checkpoint_tensors(q);
  const std::map<std::string, std::vector<int64_t>> scale_shapes = {
      {"self_attn.q_proj", {2, 2}}, {"self_attn.k_proj", {1, 2}}, {"self_attn.v_proj", {1, 2}},
      {"self_attn.o_proj", {2, 2}}, {"mlp.gate_proj", {3, 2}},    {"mlp.up_proj", {3, 2}},
      {"mlp.down_proj", {2, 3}}};
  int quantized = 0, scales = 0, plain = 0;
  for (size_t i = 0; i < specs.size(); i++) {
    const TensorSpec& s = specs[i];
    if (s.stored == Stored::quantized) {
      quantized++;
      CHECK_MSG(i + 1 < specs.size() && specs[i + 1].stored == Stored::scales &&
                    specs[i + 1].name == s.name + "_scale_inv",
                "%s is not followed by its scales", s.name.c_str());
      const std::string linear = s.name.substr(15, s.name.size() - 15 - 7);  // "model.layers.L." .. ".weight"
      CHECK_MSG(scale_shapes.count(linear) && i + 1 < specs.size() &&
                    specs[i + 1].shape == scale_shapes.at(linear),
                "%s: scales of the wrong shape", s.name.c_str());
    }
    scales += s.stored == Stored::scales;
    if (s.stored == Stored::plain) {
      plain++;
      CHECK_MSG(s.name.find("_proj") == std::string::npos, "%s is plain", s.name.c_str());
    }
  }
  CHECK_EQ(quantized, 14);
  CHECK_EQ(scales, 14);
  CHECK_EQ(plain, 3 + 2 * 4);  // embedding, final norm, lm_head; per layer two norms and q/k norms
  // The same model without quantization_config: 25 plain tensors, no scales.
  int all_plain = 0;
  for (const TensorSpec& s : checkpoint_tensors(parse_model_config(tiny_config("", false), "config.json")))
    all_plain += s.stored == Stored::plain;
  CHECK_EQ(all_plain, 25);
  // modules_to_not_convert: layer 1's attention and every down_proj stay plain, without scales.
  const ModelConfig keep = parse_model_config(
      tiny_config(R"({"quant_method":"fp8","weight_block_size":[128,128],)"
                  R"("modules_to_not_convert":["model.layers.1.self_attn","down_proj"]})"),
      "config.json");
  std::map<std::string, Stored> by_name;
  for (const TensorSpec& s : checkpoint_tensors(keep)) by_name[s.name] = s.stored;
  CHECK(by_name.at("model.layers.1.self_attn.q_proj.weight") == Stored::plain);
  CHECK(by_name.at("model.layers.1.self_attn.o_proj.weight") == Stored::plain);
  CHECK(!by_name.count("model.layers.1.self_attn.o_proj.weight_scale_inv"));
  CHECK(by_name.at("model.layers.0.self_attn.q_proj.weight") == Stored::quantized);
  CHECK(by_name.at("model.layers.1.mlp.up_proj.weight") == Stored::quantized);
  CHECK(by_name.at("model.layers.0.mlp.down_proj.weight") == Stored::plain);
  CHECK(by_name.at("model.layers.1.mlp.down_proj.weight") == Stored::plain);
  CHECK(!by_name.count("model.layers.0.mlp.down_proj.weight_scale_inv"));
}

// ---- validate_checkpoint on files written here --------------------------------------------------------

struct FileTensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // empty: valid values for its dtype
};
static int itemsize(const std::string& dtype) {
  for (const DTypeInfo& d : kDTypes)
    if (dtype == d.name) return d.itemsize;
  CHECK_MSG(false, "dtype %s", dtype.c_str());
  return 1;
}

// Write `dir`/model.safetensors holding `ts`, with random valid values: e4m3 bytes never NaN, scales and
// bf16 values finite and positive.
static void write_checkpoint(const std::string& dir, const std::vector<FileTensor>& ts) {
  mkdir(dir.c_str(), 0755);
  json header = json::object();
  std::vector<uint8_t> data;
  std::mt19937 rng(65);
  for (const FileTensor& t : ts) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    const size_t n = numel * itemsize(t.dtype);
    std::vector<uint8_t> b = t.bytes;
    if (b.empty()) {
      b.resize(n);
      for (uint8_t& x : b) x = (uint8_t)(rng() % 0x7f);  // 0x00..0x7e: no NaN byte
      const int size = itemsize(t.dtype);
      if (size > 1)
        for (size_t i = size - 1; i < n; i += size) b[i] = 0x3c;  // the sign and top exponent bits: 2^-7.. in bf16
    }
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {data.size(), data.size() + n}}};
    data.insert(data.end(), b.begin(), b.end());
  }
  write_safetensors_file(dir, header.dump(), data);
}

// The tiny config's tensors as an FP8 checkpoint stores them, scales in `scale_dtype`; `keep` names the
// linears stored in BF16 instead (without scales).
struct TinyDims {
  int64_t H = 200, I = 264, NH = 2, NKV = 1;  // the tiny config's: neither H nor I a multiple of 128
};
static std::vector<FileTensor> fp8_tensors(const std::string& scale_dtype,
                                           const std::vector<std::string>& keep = {}, TinyDims dims = {}) {
  const int64_t H = dims.H, I = dims.I, D = 128, NH = dims.NH, NKV = dims.NKV, V = 40;
  std::vector<FileTensor> ts = {{"model.embed_tokens.weight", "BF16", {V, H}, {}},
                                {"model.norm.weight", "BF16", {H}, {}}};
  const std::vector<std::pair<std::string, std::vector<int64_t>>> linears = {
      {"self_attn.q_proj", {NH * D, H}}, {"self_attn.k_proj", {NKV * D, H}}, {"self_attn.v_proj", {NKV * D, H}},
      {"self_attn.o_proj", {H, NH * D}}, {"mlp.gate_proj", {I, H}},        {"mlp.up_proj", {I, H}},
      {"mlp.down_proj", {H, I}}};
  for (int l = 0; l < 2; l++) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    for (const char* norm : {"input_layernorm", "post_attention_layernorm"})
      ts.push_back({pre + norm + ".weight", "BF16", {H}, {}});
    ts.push_back({pre + "self_attn.q_norm.weight", "BF16", {D}, {}});
    ts.push_back({pre + "self_attn.k_norm.weight", "BF16", {D}, {}});
    for (const auto& [name, shape] : linears) {
      if (std::find(keep.begin(), keep.end(), name) != keep.end()) {
        ts.push_back({pre + name + ".weight", "BF16", shape, {}});
        continue;
      }
      ts.push_back({pre + name + ".weight", "F8_E4M3", shape, {}});
      const std::vector<int64_t> blocks = {cdiv(shape[0], 128), cdiv(shape[1], 128)};
      ts.push_back({pre + name + ".weight_scale_inv", scale_dtype, blocks, {}});
    }
  }
  return ts;
}
static FileTensor& find_tensor(std::vector<FileTensor>& ts, const std::string& name) {
  for (FileTensor& t : ts)
    if (t.name == name) return t;
  CHECK_MSG(false, "no tensor %s in the fixture", name.c_str());
  return ts[0];
}
static const ModelConfig& published_config() {
  static const ModelConfig c = parse_model_config(tiny_config(kPublished), "config.json");
  return c;
}

TEST(checkpoint_valid_with_bf16_or_f32_scales) {
  for (const char* sd : {"BF16", "F32"}) {
    const std::string dir = test_tmpdir() + "/valid_" + sd;
    write_checkpoint(dir, fp8_tensors(sd));
    expect_no_die(std::string("scales ") + sd, [&] { validate_checkpoint(dir, published_config()); });
  }
}

// A checkpoint that keeps some linears in bf16 is valid with the config that names them, and refused, naming
// the field, with a config that does not.
TEST(checkpoint_modules_to_not_convert) {
  const ModelConfig keep = parse_model_config(
      tiny_config(R"({"quant_method":"fp8","weight_block_size":[128,128],)"
                  R"("modules_to_not_convert":["down_proj"]})"),
      "config.json");
  const std::string dir = test_tmpdir() + "/keep_down";
  write_checkpoint(dir, fp8_tensors("F32", {"mlp.down_proj"}));
  expect_no_die("down_proj kept, config names it", [&] { validate_checkpoint(dir, keep); });
  expect_die("down_proj kept, published config", [&] { validate_checkpoint(dir, published_config()); },
             {"tensor 'model.layers.0.mlp.down_proj.weight' in " + dir + "/model.safetensors has dtype BF16",
              "quantization_config (quant_method fp8) makes the layers' linear weights F8_E4M3 unless "
              "modules_to_not_convert names them"});
  // The other way round: the config keeps down_proj in bf16, the files hold it in 8 bits.
  const std::string dir8 = test_tmpdir() + "/all_fp8";
  write_checkpoint(dir8, fp8_tensors("F32"));
  expect_die("config keeps down_proj, files hold F8_E4M3", [&] { validate_checkpoint(dir8, keep); },
             {"'model.layers.0.mlp.down_proj.weight'", "has dtype F8_E4M3", "nanovllm loads BF16, F16 or F32"});
}

// Each way an FP8 checkpoint's tensors can be wrong, refused before any GPU work with the tensor, the file
// (or folder) and what was expected.
TEST(checkpoint_refusals) {
  const std::string q1 = "model.layers.1.self_attn.q_proj.weight", d1 = "model.layers.1.mlp.down_proj.weight";
  const std::string k0 = "model.layers.0.self_attn.k_proj.weight";
  int n = 0;
  auto refused = [&](const std::string& what, const std::vector<FileTensor>& ts, std::vector<std::string> needles,
                     const ModelConfig& c = published_config()) {
    const std::string dir = test_tmpdir() + "/bad" + std::to_string(n++);
    write_checkpoint(dir, ts);
    for (std::string& s : needles) {
      const size_t at = s.find("$DIR");
      if (at != std::string::npos) s.replace(at, 4, dir);
    }
    expect_die(what, [&] { validate_checkpoint(dir, c); }, needles);
  };
  {
    auto ts = fp8_tensors("BF16");
    auto is_scale = [&](const FileTensor& t) { return t.name == d1 + "_scale_inv"; };
    ts.erase(std::remove_if(ts.begin(), ts.end(), is_scale), ts.end());
    refused("missing scale", ts,
            {"the checkpoint in $DIR has no tensor '" + d1 + "_scale_inv': the 8-bit weight '" + d1 +
             "' needs its block scales", "128 x 128 blocks"});
  }
  {
    auto ts = fp8_tensors("BF16");
    find_tensor(ts, d1 + "_scale_inv").shape = {2, 2};  // in = 264 needs 3 column blocks
    refused("scale shape [2, 2]", ts,
            {"tensor '" + d1 + "_scale_inv' in $DIR/model.safetensors has shape [2, 2], but config.json implies "
             "[2, 3] (one scale per 128 x 128 block of the weight, rounded up)"});
  }
  {
    auto ts = fp8_tensors("F32");
    find_tensor(ts, q1 + "_scale_inv").shape = {256, 200};  // one scale per weight: not the block format
    refused("per-weight scale", ts, {"'" + q1 + "_scale_inv'", "has shape [256, 200]", "implies [2, 2]"});
  }
  {
    auto ts = fp8_tensors("F32");
    find_tensor(ts, k0 + "_scale_inv").shape = {2};  // a 1-D list of the same count
    refused("1-D scale", ts, {"'" + k0 + "_scale_inv'", "has shape [2]", "implies [1, 2]"});
  }
  for (const char* bad : {"F16", "F8_E4M3", "F64", "I32"}) {
    auto ts = fp8_tensors("F32");
    find_tensor(ts, k0 + "_scale_inv").dtype = bad;
    refused(std::string("scale dtype ") + bad, ts,
            {"tensor '" + k0 + "_scale_inv' in $DIR/model.safetensors has dtype " + bad +
             "; block scales are BF16 or F32"});
  }
  for (const char* bad : {"F8_E5M2", "I8", "U8", "BF16"}) {
    auto ts = fp8_tensors("F32");
    find_tensor(ts, q1).dtype = bad;
    refused(std::string("weight dtype ") + bad, ts,
            {"tensor '" + q1 + "' in $DIR/model.safetensors has dtype " + bad, "F8_E4M3 unless"});
  }
  {
    auto ts = fp8_tensors("F32");
    find_tensor(ts, q1).shape = {255, 200};
    refused("weight shape", ts, {"'" + q1 + "'", "has shape [255, 200], but config.json implies [256, 200]"});
  }
  {
    auto ts = fp8_tensors("F32");
    find_tensor(ts, "model.embed_tokens.weight").dtype = "F8_E4M3";
    refused("F8_E4M3 embedding", ts,
            {"'model.embed_tokens.weight'", "has dtype F8_E4M3; nanovllm loads BF16, F16 or F32 checkpoints",
             "F8_E4M3 only for the layers' linear weights"});
  }
  {
    auto ts = fp8_tensors("F32");
    find_tensor(ts, "model.layers.1.input_layernorm.weight").dtype = "F8_E4M3";
    refused("F8_E4M3 norm", ts, {"'model.layers.1.input_layernorm.weight'", "has dtype F8_E4M3"});
  }
  // Block scales that are not finite numbers >= 0, found by validate_checkpoint (it reads every scale).
  for (const char* sd : {"F32", "BF16"}) {
    auto ts = fp8_tensors(sd);
    FileTensor& s = find_tensor(ts, d1 + "_scale_inv");  // [2, 3]; element 5 is block [1, 2]
    if (std::string(sd) == "F32") {
      std::vector<float> v = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, NAN};
      s.bytes.resize(24);
      memcpy(s.bytes.data(), v.data(), 24);
    } else {
      s.bytes = {0, 0x3f, 0, 0x3f, 0, 0x3f, 0, 0x3f, 0, 0x3f, 0x80, 0xbf};  // the last: -1
    }
    refused(std::string("bad scale ") + sd, ts,
            {"tensor '" + d1 + "_scale_inv' in $DIR/model.safetensors holds",
             "block [1, 2] (rows 128.., columns 256..)"});
  }
  // An FP8 checkpoint whose config.json lost its quantization_config: the first linear says what is missing.
  refused("F8_E4M3 weights, config without quantization_config", fp8_tensors("F32"),
          {"tensor 'model.layers.0.self_attn.q_proj.weight' in $DIR/model.safetensors has dtype F8_E4M3; nanovllm "
           "loads BF16, F16 or F32 checkpoints, and F8_E4M3 only for the layers' linear weights of a checkpoint "
           "whose config.json has quantization_config with quant_method fp8"},
          parse_model_config(tiny_config(""), "config.json"));
}

// ==== sections 28-30 (switch fp8_weights): the CPU references of the FP8 kernels =========================

// e4m3_from_float is written from the format's definition; the kernels round with cuda_fp8.h. Byte for
// byte over every e4m3 value, every midpoint between neighbours (ties: to the even code) and one float ulp
// either side, the subnormal range on a fine grid, saturation, specials, a sweep of float bit patterns and
// random floats of every useful exponent.
TEST(e4m3_from_float_matches_cuda_fp8) {
  std::vector<float> xs;
  std::vector<float> codes;
  for (int b = 0; b < 128; b++)
    if (b != 0x7f) codes.push_back(e4m3_to_float((uint8_t)b));
  std::sort(codes.begin(), codes.end());
  for (size_t i = 0; i < codes.size(); i++) {
    xs.push_back(codes[i]);
    const float next = i + 1 < codes.size() ? codes[i + 1] : 480.f;  // past 448: the step that would come next
    const float mid = (codes[i] + next) / 2;  // exact: both are short binary fractions
    for (float x : {mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1e9f)}) xs.push_back(x);
  }
  for (int k = 0; k <= 1024; k++) xs.push_back(k * 0x1p-15f);  // [0, 2^-5]: subnormals and the first normals
  for (float x = 440.f; x <= 500.f; x += 0.25f) xs.push_back(x);
  for (float x : {464.f, std::nextafter(464.f, 0.f), std::nextafter(464.f, 1e9f), std::nextafter(448.f, 1e9f),
                  1e-45f, FLT_MIN, FLT_MAX, 1e30f, INFINITY, 0x1p-10f, 0x1.0002p-10f, 0x1p-11f})
    xs.push_back(x);
  for (uint64_t u = 0; u < (1ull << 32); u += 65521) {
    uint32_t bits = (uint32_t)u;
    float x;
    memcpy(&x, &bits, 4);
    if (!std::isnan(x)) xs.push_back(x);
  }
  std::mt19937 rng(66);
  std::uniform_real_distribution<float> lg(-14.f, 10.f);
  for (int i = 0; i < 200000; i++) xs.push_back(std::exp2(lg(rng)) * (1.f + (float)(rng() % 100000) / 1e5f));
  const size_t n = xs.size();
  for (size_t i = 0; i < n; i++) xs.push_back(-xs[i]);
  int bad = 0;
  for (float x : xs) {
    const uint8_t got = e4m3_from_float(x), want = cuda_e4m3_from_float(x);
    if (got != want && bad++ < 5) fprintf(stderr, "    %a (%g): %02x, cuda_fp8.h %02x\n", x, x, got, want);
  }
  CHECK_MSG(bad == 0, "%d of %zu floats round differently", bad, xs.size());
  CHECK_EQ((int)(e4m3_from_float(NAN) & 0x7f), 0x7f);
  CHECK_EQ((int)(cuda_e4m3_from_float(NAN) & 0x7f), 0x7f);
}

// A bf16 weight [N, K] with blocks of very different magnitudes, one block all zeros (+0 and -0), and every
// element of the array poisoned outside the block under test.
static std::vector<bf16> weight_blocks(int N, int K, std::mt19937& rng) {
  std::vector<bf16> w((size_t)N * K);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int r = 0; r < N; r++)
    for (int c = 0; c < K; c++) {
      const int bi = r / 128, bj = c / 128;
      const float mag = std::exp2((float)((bi * 7 + bj * 3) % 23 - 16));  // 2^-16 .. 2^6 a block
      float v = nd(rng) * mag;
      if (bi == 1 && bj == 1) v = (r + c) % 2 ? 0.f : -0.f;  // the zero block
      w[(size_t)r * K + c] = __float2bfloat16(v);
    }
  return w;
}

// Per block: scale = amax / 448 (1 for a block of zeros), bytes = cuda_fp8.h's e4m3(w / scale), the block's
// largest element lands on +-448, every value comes back within half an e4m3 step, and nothing outside the
// block is written.
TEST(quantize_weight_reference_per_block) {
  std::mt19937 rng(67);
  const int N = 384, K = 256;
  const std::vector<bf16> w = weight_blocks(N, K, rng);
  for (int bi = 0; bi < N / 128; bi++)
    for (int bj = 0; bj < K / 128; bj++) {
      std::vector<uint8_t> q((size_t)N * K, 0xab);
      const float s = quantize_weight_reference(q.data(), w.data(), K, bi, bj);
      double amax = 0;
      for (int r = bi * 128; r < bi * 128 + 128; r++)
        for (int c = bj * 128; c < bj * 128 + 128; c++)
          amax = std::max(amax, std::fabs((double)__bfloat162float(w[(size_t)r * K + c])));
      const bool zero = amax == 0;
      CHECK_MSG(s == (zero ? 1.f : (float)(amax / 448)), "block [%d, %d]: scale %a, amax %a", bi, bj, s, amax);
      int wrong = 0, outside = 0, far = 0;
      float qmax = 0;
      for (int r = 0; r < N; r++)
        for (int c = 0; c < K; c++) {
          const size_t i = (size_t)r * K + c;
          if (r / 128 != bi || c / 128 != bj) {
            outside += q[i] != 0xab;
            continue;
          }
          const float x = __bfloat162float(w[i]);
          wrong += q[i] != cuda_e4m3_from_float(x / s);
          const float back = e4m3_to_float(q[i]);
          qmax = std::max(qmax, std::fabs(back));
          far += !(std::fabs(back * s - x) <= 0x1p-4f * std::fabs(x) + 0x1p-10f * s);
          if (zero) wrong += q[i] != (std::signbit(x) ? 0x80 : 0x00);
        }
      CHECK_MSG(wrong == 0 && outside == 0 && far == 0,
                "block [%d, %d]: %d bytes differ from cuda_fp8.h, %d written outside, %d values off", bi, bj,
                wrong, outside, far);
      CHECK_MSG(qmax == (zero ? 0.f : 448.f), "block [%d, %d]: largest |e4m3| %g", bi, bj, qmax);
    }
}

// x [T, K] -> xq [T4, K] and xs [K/128, T4] (tokens contiguous), T4 = T rounded up to 4; the padding rows
// zero with scale 1, and a row's all-zero group gets scale 1 too.
TEST(quantize_rows_reference_pads_and_lays_out_scales) {
  std::mt19937 rng(68);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int T : {1, 3, 4, 6, 9}) {
    for (int K : {128, 384}) {
      const int T4 = (T + 3) / 4 * 4, G = K / 128;
      std::vector<float> x((size_t)T * K);
      for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++)
          x[(size_t)t * K + k] = bf16_round(nd(rng) * std::exp2((float)((t * 5 + k / 128 * 3) % 17 - 8)));
      if (T > 2 && G > 1)
        for (int k = 128; k < 256; k++) x[(size_t)2 * K + k] = 0.f;  // token 2, group 1: all zeros
      std::vector<uint8_t> xq((size_t)T4 * K, 0x5a);
      std::vector<float> xs((size_t)G * T4, NAN);
      quantize_rows_reference(xq.data(), xs.data(), x.data(), T, K);
      int bad_scale = 0, bad_byte = 0;
      for (int t = 0; t < T4; t++)
        for (int b = 0; b < G; b++) {
          float amax = 0;
          for (int k = b * 128; t < T && k < b * 128 + 128; k++)
            amax = std::max(amax, std::fabs(x[(size_t)t * K + k]));
          const float s = amax > 0 ? (float)((double)amax / 448) : 1.f;
          if (!(xs[(size_t)b * T4 + t] == s) && bad_scale++ < 3)
            fprintf(stderr, "    T %d K %d: xs[%d][%d] = %g, want %g\n", T, K, b, t, xs[(size_t)b * T4 + t], s);
          for (int k = b * 128; k < b * 128 + 128; k++) {
            const uint8_t want = t < T ? cuda_e4m3_from_float(x[(size_t)t * K + k] / s) : 0;
            bad_byte += xq[(size_t)t * K + k] != want;
          }
        }
      CHECK_MSG(bad_scale == 0 && bad_byte == 0, "T %d, K %d: %d scales and %d bytes wrong", T, K, bad_scale,
                bad_byte);
    }
  }
}

// y = x W^T with the activations quantized per token and 128 columns and W given as e4m3 bytes and block
// scales [ceil(N/128), ld], against the same product written directly: each value dequantized (cuda_fp8.h),
// multiplied and summed in double, rounded once to bf16. The scale table's padding columns (ld > K/128) hold
// NaN: they must not be read. And the result is not the product with x unquantized: the activations'
// rounding shows.
TEST(fp8_linear_reference_matches_direct_product) {
  std::mt19937 rng(69);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> lg(-12.f, -4.f);
  const int N = 200, K = 384, G = K / 128, ld = 4;
  std::vector<uint8_t> w((size_t)N * K);
  for (uint8_t& b : w) do b = (uint8_t)rng(); while ((b & 0x7f) == 0x7f);
  std::vector<float> scale((size_t)cdiv(N, 128) * ld, NAN);
  for (int i = 0; i < (int)cdiv(N, 128); i++)
    for (int b = 0; b < G; b++) scale[(size_t)i * ld + b] = std::exp2(lg(rng));
  for (int T : {1, 3, 6}) {
    std::vector<float> x((size_t)T * K);
    for (float& v : x) v = bf16_round(nd(rng) * 3.f);
    std::vector<float> y((size_t)T * N, NAN), want((size_t)T * N), unquantized((size_t)T * N);
    fp8_linear_reference(y.data(), x.data(), w.data(), scale.data(), ld, T, N, K);
    for (int t = 0; t < T; t++) {
      std::vector<double> xd(K);
      for (int b = 0; b < G; b++) {
        float amax = 0;
        for (int k = b * 128; k < b * 128 + 128; k++) amax = std::max(amax, std::fabs(x[(size_t)t * K + k]));
        const float s = amax > 0 ? amax / 448.f : 1.f;
        for (int k = b * 128; k < b * 128 + 128; k++)
          xd[k] = (double)cuda_e4m3_to_float(cuda_e4m3_from_float(x[(size_t)t * K + k] / s)) * s;
      }
      for (int n = 0; n < N; n++) {
        double acc = 0, plain = 0;
        for (int k = 0; k < K; k++) {
          const double s = scale[(size_t)(n / 128) * ld + k / 128];
          const double wv = (double)cuda_e4m3_to_float(w[(size_t)n * K + k]) * s;
          acc += xd[k] * wv;
          plain += (double)x[(size_t)t * K + k] * wv;
        }
        want[(size_t)t * N + n] = bf16_value(cuda_bf16_bits((float)acc));
        unquantized[(size_t)t * N + n] = (float)plain;
      }
    }
    char what[64];
    snprintf(what, sizeof what, "fp8_linear_reference T %d", T);
    check_close(what, y.data(), want.data(), y.size(), 1e-6f, 0x1p-7f);  // one bf16 step at most
    int differ = 0;
    for (size_t i = 0; i < y.size(); i++)
      differ += std::fabs(y[i] - unquantized[i]) > 0x1p-7f * std::fabs(unquantized[i]);
    CHECK_MSG(differ > 0, "T %d: no element shows the activations' rounding", T);
  }
}

// fp8_weights_problem asks the GPU its architecture (gpu_cc_major): without one the cases that call it, and
// the loader's, are skipped; fp8_weights_shape_problem's asks nothing of the GPU.
static bool gpu_visible() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
static ModelConfig shape_config(int H, int I, std::vector<std::string> not_quantized = {}) {
  ModelConfig m = parse_model_config(tiny_config(kPublished), "config.json");
  m.hidden_size = H, m.intermediate_size = I, m.not_quantized = not_quantized;
  // Four layers (layer 3 exists), and Qwen3-4B's 32 query and 8 KV heads, which any --tp up to 8 divides.
  m.num_hidden_layers = 4, m.num_attention_heads = 32, m.num_key_value_heads = 8;
  return m;
}
// Why fp8_weights_problem's shape rules cannot be reached here ("" on a Hopper GPU with cuBLASLt 12.9 or
// later). Before any shape it answers for the GPU, and that answer is checked here; the case is then skipped.
static std::string fp8_weights_unreachable() {
  if (!gpu_visible()) return "no GPU: fp8_weights_problem calls gpu_cc_major";
  const int major = gpu_cc_major();
  const std::string e = fp8_weights_problem(shape_config(1024, 3072), 1);
  if (major != 9) {
    CHECK_MSG(e.find("need a Hopper GPU (sm_90), this one is sm_" + std::to_string(major) + "0") !=
                  std::string::npos, "sm_%d0: %s", major, e.c_str());
    return "sm_" + std::to_string(major) + "0: the shape rules are checked on sm_90 only";
  }
  if (CUBLAS_VERSION < 120900) {
    CHECK_MSG(e.find("before 12.9") != std::string::npos, "%s", e.c_str());
    return "cuBLASLt " + std::to_string(CUBLAS_VERSION) + ": no block-scaled FP8 products";
  }
  return "";
}

TEST(fp8_weights_problem_messages) {
  for (int tp : {1, 2, 4, 8}) CHECK_EQ(fp8_weights_shape_problem(shape_config(1024, 3072), tp), std::string(""));
  CHECK_EQ(fp8_weights_shape_problem(shape_config(2560, 9728), 4), std::string(""));
  CHECK_EQ(fp8_weights_shape_problem(shape_config(2560, 9728), 8),  // Qwen3-4B at --tp 8: 1216 columns a rank
           std::string("hidden_size 2560 and intermediate_size / tp = 1216 must be multiples of 128 for 128 x 128 "
                       "blocks to fuse and split; it splits so at --tensor-parallel-size 1, 2, 4"));
  CHECK(fp8_weights_shape_problem(shape_config(200, 264), 1).find("hidden_size 200 and intermediate_size / tp = "
                                                                  "264 must be multiples of 128") != std::string::npos);
  CHECK(fp8_weights_shape_problem(shape_config(1000, 3072), 1).find("hidden_size 1000") != std::string::npos);
  CHECK_EQ(fp8_weights_shape_problem(shape_config(1024, 3072, {"lm_head"}), 1), std::string(""));
  CHECK_EQ(fp8_weights_shape_problem(shape_config(1024, 3072, {"model.layers.3.mlp.down_proj"}), 1),
           std::string("modules_to_not_convert keeps model.layers.3.mlp.down_proj.weight in bf16"));
  CHECK_EQ(fp8_weights_shape_problem(shape_config(1024, 3072, {"lm_head", "o_proj"}), 1),
           std::string("modules_to_not_convert keeps model.layers.0.self_attn.o_proj.weight in bf16"));
}

// On a GPU the chapter can use, fp8_weights_problem's answer is the shape rules' (elsewhere
// fp8_weights_unreachable has checked that it names the GPU or cuBLASLt first).
TEST(fp8_weights_problem_is_the_shape_rules_on_hopper) {
  const std::string why = fp8_weights_unreachable();
  if (!why.empty()) SKIP("%s", why.c_str());
  for (const ModelConfig& m : {shape_config(1024, 3072), shape_config(2560, 9728), shape_config(200, 264),
                               shape_config(1024, 3072, {"lm_head", "o_proj"})})
    for (int tp : {1, 2, 4, 8}) CHECK_EQ(fp8_weights_problem(m, tp), fp8_weights_shape_problem(m, tp));
}

// The chapter fuses and loads every layer linear as e4m3 with its scales; a linear that the checkpoint keeps
// in bf16 (kept_unquantized: any entry of modules_to_not_convert that is part of its name) has no scales to
// load, so whenever checkpoint_tensors lists a layer linear as plain, fp8_weights_shape_problem (and so
// fp8_weights_problem) must say why the chapter stands aside (section 6a then loads the checkpoint).
TEST(fp8_weights_stands_aside_when_a_layer_linear_is_kept) {
  for (const char* entry : {"model.layers.0.mlp.down_proj", "down_proj", "model.layers", "mlp", "self_attn",
                            "gate", "model.layers.1.mlp", "model"}) {
    ModelConfig m = shape_config(1024, 3072, {"lm_head", entry});
    bool kept = false;
    for (const TensorSpec& s : checkpoint_tensors(m))
      kept |= s.stored == Stored::plain && s.shape.size() == 2 && s.name.find(".layers.") != std::string::npos;
    CHECK_MSG(kept, "'%s' keeps no layer linear", entry);
    CHECK_MSG(!fp8_weights_shape_problem(m, 1).empty(),
              "modules_to_not_convert [\"lm_head\", \"%s\"] keeps layer linears in bf16, but "
              "fp8_weights_shape_problem says the chapter can hold the model", entry);
  }
  CHECK_EQ(fp8_weights_shape_problem(shape_config(1024, 3072, {"lm_head", "visual"}), 1), std::string(""));
}

// Section 28's loader on the GPU (skipped without a Hopper GPU): a written FP8 checkpoint (H 256, I 512, two
// query and two KV heads, random bytes and scales that differ block by block) loaded by fp8_load_weights at
// --tp 1 and as rank 1 of --tp 2 (loading needs no NCCL). Every fused matrix read back (fp8_matrix_rows:
// e4m3 x its scale-table entry) must equal, exactly, the checkpoint's byte times the checkpoint's scale for
// that row and column of the rank's slice; and bf16 of it must equal what Part I's dequantizing loader puts
// in the arena for the same slice. A misplaced part, slice or scale-table entry changes the values by a
// block's scale ratio, which the end-to-end comparison could mistake for rounding.
TEST(fp8_load_weights_places_bytes_and_scales) {
  const std::string why = fp8_weights_unreachable();
  if (!why.empty()) SKIP("%s", why.c_str());
  const int64_t H = 256, I = 512, D = 128, NH = 2, NKV = 2, V = 40;
  const std::vector<FileTensor> ts = fp8_tensors("F32", {}, {H, I, NH, NKV});
  const std::string dir = test_tmpdir() + "/load";
  write_checkpoint(dir, ts);
  ModelConfig mc = published_config();
  mc.hidden_size = (int)H, mc.intermediate_size = (int)I, mc.num_attention_heads = (int)NH;
  mc.num_key_value_heads = (int)NKV, mc.vocab_size = (int)V;
  Config c;
  c.model = dir, c.max_num_batched_tokens = 64, c.max_num_seqs = 4;
  SafeTensors st = SafeTensors::open_dir(dir);
  // The value the checkpoint stores at (r, col) of tensor `name`, in fp32.
  auto stored = [&](const std::string& name, int64_t r, int64_t col) {
    const TensorView& t = *st.find(name);
    const std::vector<float> s = block_scales(*st.find(name + "_scale_inv"));
    return e4m3_to_float(((const uint8_t*)t.data)[r * t.shape[1] + col]) * s[r / 128 * cdiv(t.shape[1], 128) + col / 128];
  };
  for (int tp : {1, 2}) {
    const int rank = tp - 1;
    const TPShard sh = tp_shard(mc, rank, tp);
    install_optimizations(default_optimizations());
    Weights w8, w16;
    size_t bytes = 0;
    CHECK(fp8_load_weights(w8, c, mc, rank, tp, 0, &bytes));
    w16 = load_weights(dir, mc, rank, tp, 0, &bytes);
    const int64_t q0 = sh.q_head0 * D, kv0 = sh.kv_head0 * D, nq = sh.q_heads * D, nkv = sh.kv_heads * D;
    const int64_t i0 = sh.inter0, ni = sh.inter;
    for (int l = 0; l < 2; l++) {
      const std::string pre = "model.layers." + std::to_string(l) + ".";
      const Fp8Layer& fl = g_fp8_weights.layers[l];
      const LayerWeights& lw = w16.layers[l];
      // (matrix, its bf16 twin, and where fused row / column (r, col) comes from in the checkpoint)
      struct Check {
        const Fp8Matrix& m;
        const bf16* twin;
        std::function<std::pair<std::string, std::pair<int64_t, int64_t>>(int64_t, int64_t)> from;
      };
      const std::vector<Check> checks = {
          {fl.qkv, lw.qkv_proj, [&](int64_t r, int64_t col) {
             if (r < nq) return std::make_pair(pre + "self_attn.q_proj.weight", std::make_pair(q0 + r, col));
             if (r < nq + nkv) return std::make_pair(pre + "self_attn.k_proj.weight", std::make_pair(kv0 + r - nq, col));
             return std::make_pair(pre + "self_attn.v_proj.weight", std::make_pair(kv0 + r - nq - nkv, col));
           }},
          {fl.o, lw.o_proj, [&](int64_t r, int64_t col) {
             return std::make_pair(pre + "self_attn.o_proj.weight", std::make_pair(r, q0 + col));
           }},
          {fl.gate_up, lw.gate_up_proj, [&](int64_t r, int64_t col) {
             if (r < ni) return std::make_pair(pre + "mlp.gate_proj.weight", std::make_pair(i0 + r, col));
             return std::make_pair(pre + "mlp.up_proj.weight", std::make_pair(i0 + r - ni, col));
           }},
          {fl.down, lw.down_proj, [&](int64_t r, int64_t col) {
             return std::make_pair(pre + "mlp.down_proj.weight", std::make_pair(r, i0 + col));
           }}};
      for (const Check& k : checks) {
        const std::vector<float> got = fp8_matrix_rows(k.m, 0, k.m.N);
        std::vector<uint16_t> twin((size_t)k.m.N * k.m.K);
        CUDA_CHECK(cudaMemcpy(twin.data(), k.twin, twin.size() * 2, cudaMemcpyDeviceToHost));
        int bad = 0, bad_twin = 0;
        for (int64_t r = 0; r < k.m.N; r++)
          for (int64_t col = 0; col < k.m.K; col++) {
            const auto [name, at] = k.from(r, col);
            const float want = stored(name, at.first, at.second), g = got[r * k.m.K + col];
            bad += g != want;
            bad_twin += twin[r * k.m.K + col] != float_to_bf16_bits(g);
          }
        CHECK_MSG(bad == 0 && bad_twin == 0, "tp %d rank %d layer %d, a %d x %d matrix: %d values differ from the "
                  "checkpoint's, %d from section 6a's dequantized twin", tp, rank, l, k.m.N, k.m.K, bad, bad_twin);
      }
    }
  }
  install_optimizations(default_optimizations());
}

int main(int argc, char** argv) { return test_main(argc, argv); }
