// Host tests of FP8 checkpoints (Qwen/Qwen3-*-FP8) as Part I reads them (nanovllm.cu sections 6a and 30):
// config.json's quantization_config and each of its refusals, the checkpoint check before the GPU (files the
// test writes: F8_E4M3 weights with BF16 or F32 block scales, shapes that are not multiples of 128, and each
// way to get them wrong), the e4m3 decode against cuda_fp8.h's, the CPU reference of the dequantizing kernel,
// and tensor-parallel slices (scales indexed by the global row and column). The kernel itself against this
// reference: test/gpu/gpu_kernels.cu, fp8_dequantize_matches_reference.
#define NANOVLLM_TESTING
#include "../../nanovllm.cu"
#include "../test.h"

// die() throws TokDieError while tok_die_throws is set: run fn, expect a refusal whose message holds every
// one of `needles`.
template <class F>
static void expect_die(const char* what, F fn, std::vector<std::string> needles) {
  tok_die_throws = true;
  try {
    fn();
    CHECK_MSG(false, "%s: expected a refusal", what);
  } catch (const TokDieError& e) {
    const std::string msg = e.what();
    for (const std::string& n : needles)
      CHECK_MSG(msg.find(n) != std::string::npos, "%s: message '%s' lacks '%s'", what, msg.c_str(), n.c_str());
  }
  tok_die_throws = false;
}

static std::string tmpdir() {
  static std::string d;
  if (d.empty()) {
    char tmpl[] = "/tmp/nanovllm_fp8_XXXXXX";
    d = mkdtemp(tmpl);
  }
  return d;
}

// ---- config.json -----------------------------------------------------------------------------------------

// A tiny Qwen3 config.json (H 200, I 264: neither a multiple of 128) with `quant` as its quantization_config
// ("" for none).
static std::string tiny_config(const std::string& quant) {
  return R"({"architectures":["Qwen3ForCausalLM"],"hidden_size":200,"intermediate_size":264,)"
         R"("num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1,"head_dim":128,)"
         R"("vocab_size":40,"max_position_embeddings":4096,"rms_norm_eps":1e-6,"rope_theta":1000000.0,)"
         R"("tie_word_embeddings":true)" +
         (quant.empty() ? std::string() : ",\"quantization_config\":" + quant) + "}";
}
// Qwen3-8B-FP8's quantization_config as published.
static const std::string kQwenFp8 =
    R"({"activation_scheme":"dynamic","fmt":"e4m3","quant_method":"fp8","weight_block_size":[128,128]})";

TEST(config_fp8_as_published) {
  ModelConfig plain = parse_model_config(tiny_config(""), "config.json");
  CHECK(!plain.fp8_weights);
  ModelConfig c = parse_model_config(tiny_config(kQwenFp8), "config.json");
  CHECK(c.fp8_weights);
  CHECK(c.fp8_not_converted.empty());
  // transformers' FineGrainedFP8Config writes no fmt and may leave activation_scheme to its default (dynamic).
  c = parse_model_config(tiny_config(R"({"quant_method":"fp8","weight_block_size":[128,128]})"), "config.json");
  CHECK(c.fp8_weights);
  c = parse_model_config(tiny_config(R"({"quant_method":"fp8","weight_block_size":[128,128],)"
                                     R"("modules_to_not_convert":["lm_head","model.layers.0.mlp.down_proj"]})"),
                         "config.json");
  CHECK(c.fp8_not_converted == std::vector<std::string>({"lm_head", "model.layers.0.mlp.down_proj"}));
  c = parse_model_config(tiny_config("null"), "config.json");
  CHECK(!c.fp8_weights);
}

TEST(config_fp8_refusals) {
  struct Case {
    const char* what;
    std::string quant;
    std::vector<std::string> needles;
  };
  const std::string block = R"("weight_block_size":[128,128])";
  const std::vector<Case> cases = {
      {"gptq", R"({"quant_method":"gptq","bits":4})",
       {"q.json", "quantization_config.quant_method \"gptq\" is not supported", "\"fp8\"", "BF16, F16, F32"}},
      {"awq", R"({"quant_method":"awq"})", {"\"awq\" is not supported"}},
      {"compressed-tensors", R"({"quant_method":"compressed-tensors"})", {"\"compressed-tensors\" is not supported"}},
      {"bitsandbytes", R"({"quant_method":"bitsandbytes","load_in_4bit":true})", {"\"bitsandbytes\" is not supported"}},
      {"no method", R"({"weight_block_size":[128,128]})", {"q.json", "needs \"quant_method\""}},
      {"method not a string", R"({"quant_method":8})", {"needs \"quant_method\" as a string"}},
      {"not an object", R"("fp8")", {"q.json", "\"quantization_config\" must be an object", "\"fp8\""}},
      {"block 64", R"({"quant_method":"fp8","weight_block_size":[64,64]})",
       {"q.json", "weight_block_size must be [128, 128], found [64,64]"}},
      {"block 1x128", R"({"quant_method":"fp8","weight_block_size":[1,128]})", {"found [1,128]"}},
      {"block of three", R"({"quant_method":"fp8","weight_block_size":[128,128,128]})", {"must be [128, 128]"}},
      {"block strings", R"({"quant_method":"fp8","weight_block_size":["128","128"]})", {"must be [128, 128]"}},
      {"per-tensor", R"({"quant_method":"fp8","activation_scheme":"dynamic"})",
       {"no \"weight_block_size\"", "per-tensor FP8", "[128, 128]"}},
      {"static", R"({"quant_method":"fp8","activation_scheme":"static",)" + block + "}",
       {"q.json", "activation_scheme \"static\" is not supported", "\"dynamic\"", "input_scale"}},
      {"e5m2", R"({"quant_method":"fp8","fmt":"e5m2",)" + block + "}",
       {"q.json", "quantization_config.fmt \"e5m2\" is not supported", "\"e4m3\""}},
      {"skip list not a list", R"({"quant_method":"fp8","modules_to_not_convert":"lm_head",)" + block + "}",
       {"modules_to_not_convert must be a list of module names", "\"lm_head\""}},
      {"skip pattern", R"({"quant_method":"fp8","modules_to_not_convert":["model.layers.*.mlp"],)" + block + "}",
       {"\"model.layers.*.mlp\" is not a module name", "not patterns"}},
      {"skip empty", R"({"quant_method":"fp8","modules_to_not_convert":[""],)" + block + "}",
       {"\"\" is not a module name"}},
      {"skip number", R"({"quant_method":"fp8","modules_to_not_convert":[3],)" + block + "}",
       {"3 is not a module name"}},
  };
  for (const Case& k : cases)
    expect_die(k.what, [&] { parse_model_config(tiny_config(k.quant), "q.json"); }, k.needles);
}

TEST(fp8_kept_bf16_matches_names_prefixes_and_suffixes) {
  ModelConfig c;
  c.fp8_not_converted = {"lm_head", "model.layers.1.", "down_proj", "model.layers.2.self_attn.q_proj"};
  CHECK(fp8_kept_bf16(c, "lm_head"));
  CHECK(fp8_kept_bf16(c, "model.layers.1.mlp.up_proj"));
  CHECK(!fp8_kept_bf16(c, "model.layers.10.mlp.up_proj"));  // "model.layers.1." is not a prefix of layer 10
  CHECK(fp8_kept_bf16(c, "model.layers.7.mlp.down_proj"));
  CHECK(fp8_kept_bf16(c, "model.layers.2.self_attn.q_proj"));
  CHECK(!fp8_kept_bf16(c, "model.layers.2.self_attn.k_proj"));
  CHECK(!fp8_kept_bf16(ModelConfig(), "model.layers.0.mlp.down_proj"));
}

TEST(fp8_config_reaches_the_workers) {
  ModelConfig c = parse_model_config(tiny_config(R"({"quant_method":"fp8","weight_block_size":[128,128],)"
                                                 R"("modules_to_not_convert":["lm_head"]})"),
                                     "config.json");
  ModelConfig back = model_config_from_json(model_config_to_json(c));
  CHECK(back.fp8_weights);
  CHECK(back.fp8_not_converted == std::vector<std::string>({"lm_head"}));
  CHECK(!model_config_from_json(model_config_to_json(ModelConfig())).fp8_weights);
}

// ---- the checkpoint check (validate_checkpoint, checked_tensor) --------------------------------------------

struct Tensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // empty: filled with valid values for its dtype
};
static int64_t numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}
static int itemsize(const std::string& dtype) {
  return dtype == "F32" ? 4 : dtype.rfind("F8_", 0) == 0 || dtype == "I8" ? 1 : 2;
}

// Write `dir`/model.safetensors holding `ts`. Values are valid: e4m3 bytes never 0x7F/0xFF, scales and bf16
// values finite and positive.
static void write_checkpoint(const std::string& dir, const std::vector<Tensor>& ts) {
  mkdir(dir.c_str(), 0755);
  json header = json::object();
  std::vector<uint8_t> data;
  std::mt19937 rng(7);
  for (const Tensor& t : ts) {
    const size_t n = numel(t.shape) * itemsize(t.dtype);
    std::vector<uint8_t> b = t.bytes;
    if (b.empty()) {
      b.resize(n);
      for (size_t i = 0; i < n; i++) b[i] = (uint8_t)(rng() % 0x7f);  // no NaN byte
      if (t.dtype == "BF16")
        for (size_t i = 0; i + 1 < n; i += 2) b[i + 1] = 0x3c;  // 2^-7 .. 2^-6: finite, positive
      if (t.dtype == "F32")
        for (size_t i = 0; i + 3 < n; i += 4) b[i + 3] = 0x3c;
    }
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {data.size(), data.size() + n}}};
    data.insert(data.end(), b.begin(), b.end());
  }
  const std::string h = header.dump();
  FILE* f = fopen((dir + "/model.safetensors").c_str(), "wb");
  const uint64_t len = h.size();
  fwrite(&len, 8, 1, f);
  fwrite(h.data(), 1, h.size(), f);
  if (!data.empty()) fwrite(data.data(), 1, data.size(), f);
  fclose(f);
}

// The tiny config's tensors as an FP8 checkpoint stores them, scales in `scale_dtype`; `keep` lists the
// linears stored in BF16 instead (no scales).
static std::vector<Tensor> fp8_tensors(const std::string& scale_dtype, const std::set<std::string>& keep = {}) {
  const int64_t H = 200, I = 264, D = 128, NH = 2, NKV = 1, V = 40;
  std::vector<Tensor> ts = {{"model.embed_tokens.weight", "BF16", {V, H}, {}}, {"model.norm.weight", "BF16", {H}, {}}};
  const std::string pre = "model.layers.0.";
  for (const char* norm : {"input_layernorm", "post_attention_layernorm"}) ts.push_back({pre + norm + ".weight", "BF16", {H}, {}});
  ts.push_back({pre + "self_attn.q_norm.weight", "BF16", {D}, {}});
  ts.push_back({pre + "self_attn.k_norm.weight", "BF16", {D}, {}});
  const std::vector<std::pair<std::string, std::vector<int64_t>>> linears = {
      {"self_attn.q_proj", {NH * D, H}}, {"self_attn.k_proj", {NKV * D, H}}, {"self_attn.v_proj", {NKV * D, H}},
      {"self_attn.o_proj", {H, NH * D}}, {"mlp.gate_proj", {I, H}},        {"mlp.up_proj", {I, H}},
      {"mlp.down_proj", {H, I}}};
  for (const auto& [name, shape] : linears) {
    if (keep.count(name)) {
      ts.push_back({pre + name + ".weight", "BF16", shape, {}});
      continue;
    }
    ts.push_back({pre + name + ".weight", "F8_E4M3", shape, {}});
    ts.push_back({pre + name + ".weight_scale_inv", scale_dtype, {cdiv(shape[0], 128), cdiv(shape[1], 128)}, {}});
  }
  return ts;
}
static Tensor* find_tensor(std::vector<Tensor>& ts, const std::string& name) {
  for (Tensor& t : ts)
    if (t.name == name) return &t;
  return nullptr;
}

static const ModelConfig& fp8_config() {
  static ModelConfig c = parse_model_config(tiny_config(kQwenFp8), "config.json");
  return c;
}

TEST(checkpoint_fp8_valid_with_either_scale_dtype) {
  for (const char* sd : {"BF16", "F32"}) {
    const std::string dir = tmpdir() + "/valid_" + sd;
    write_checkpoint(dir, fp8_tensors(sd));
    tok_die_throws = true;
    try {
      validate_checkpoint(dir, fp8_config());
    } catch (const TokDieError& e) {
      CHECK_MSG(false, "scales %s: refused: %s", sd, e.what());
    }
    tok_die_throws = false;
  }
  // The list validate_checkpoint and load_weights go by: 7 quantized linears, each with its scales.
  int weights = 0, scales = 0;
  for (const TensorSpec& s : checkpoint_tensors(fp8_config())) {
    weights += s.stored == Stored::fp8_weight;
    scales += s.stored == Stored::fp8_scales;
    if (s.name == "model.layers.0.mlp.down_proj.weight_scale_inv") CHECK(s.shape == std::vector<int64_t>({2, 3}));
    if (s.name == "model.layers.0.mlp.gate_proj.weight_scale_inv") CHECK(s.shape == std::vector<int64_t>({3, 2}));
  }
  CHECK_EQ(weights, 7);
  CHECK_EQ(scales, 7);
}

TEST(checkpoint_fp8_modules_to_not_convert) {
  ModelConfig c = parse_model_config(
      tiny_config(R"({"quant_method":"fp8","weight_block_size":[128,128],"modules_to_not_convert":["down_proj"]})"),
      "config.json");
  const std::string dir = tmpdir() + "/keep_down";
  write_checkpoint(dir, fp8_tensors("F32", {"mlp.down_proj"}));
  tok_die_throws = true;
  try {
    validate_checkpoint(dir, c);
  } catch (const TokDieError& e) {
    CHECK_MSG(false, "refused: %s", e.what());
  }
  tok_die_throws = false;
  // The same files read with the published config (nothing kept): down_proj should have been FP8.
  expect_die("kept linear, config without the list", [&] { validate_checkpoint(dir, fp8_config()); },
             {"'model.layers.0.mlp.down_proj.weight'", "has dtype BF16", "F8_E4M3", "modules_to_not_convert"});
}

TEST(checkpoint_fp8_refusals) {
  const std::string q = "model.layers.0.self_attn.q_proj.weight", d = "model.layers.0.mlp.down_proj.weight";
  int n = 0;
  auto refused = [&](const char* what, std::vector<Tensor> ts, std::vector<std::string> needles,
                     const ModelConfig& c = fp8_config()) {
    const std::string dir = tmpdir() + "/bad" + std::to_string(n++);
    write_checkpoint(dir, ts);
    needles.push_back(dir);
    expect_die(what, [&] { validate_checkpoint(dir, c); }, needles);
  };
  {
    auto ts = fp8_tensors("BF16");
    ts.erase(std::remove_if(ts.begin(), ts.end(), [&](const Tensor& t) { return t.name == d + "_scale_inv"; }),
             ts.end());
    refused("missing scale", ts, {"no tensor '" + d + "_scale_inv'", "the F8_E4M3 weight '" + d + "'", "128 x 128"});
  }
  {
    auto ts = fp8_tensors("BF16");
    find_tensor(ts, d + "_scale_inv")->shape = {2, 2};  // in = 264 needs 3 column blocks
    refused("scale shape", ts, {"'" + d + "_scale_inv'", "has shape [2, 2]", "implies [2, 3]", "rounded up"});
  }
  {
    auto ts = fp8_tensors("BF16");
    find_tensor(ts, q + "_scale_inv")->shape = {256, 200};  // one scale per weight: not the block format
    refused("per-weight scale", ts, {"'" + q + "_scale_inv'", "has shape [256, 200]", "implies [2, 2]"});
  }
  {
    auto ts = fp8_tensors("F32");
    find_tensor(ts, q + "_scale_inv")->dtype = "F16";
    refused("F16 scale", ts, {"'" + q + "_scale_inv'", "has dtype F16", "block scales are BF16 or F32"});
  }
  {
    auto ts = fp8_tensors("F32");
    find_tensor(ts, q)->dtype = "F8_E5M2";
    refused("e5m2 weight", ts, {"'" + q + "'", "has dtype F8_E5M2", "F8_E4M3"});
  }
  {
    auto ts = fp8_tensors("F32");
    find_tensor(ts, q)->dtype = "I8";
    refused("int8 weight", ts, {"'" + q + "'", "has dtype I8"});
  }
  {
    auto ts = fp8_tensors("F32");
    find_tensor(ts, q)->shape = {255, 200};
    refused("weight shape", ts, {"'" + q + "'", "has shape [255, 200]", "implies [256, 200]"});
  }
  {
    auto ts = fp8_tensors("F32");
    find_tensor(ts, "model.embed_tokens.weight")->dtype = "F8_E4M3";
    refused("fp8 embedding", ts, {"'model.embed_tokens.weight'", "has dtype F8_E4M3",
                                  "F8_E4M3 only for the layers' linear weights"});
  }
  {
    auto ts = fp8_tensors("F32");
    find_tensor(ts, "model.layers.0.input_layernorm.weight")->dtype = "F8_E4M3";
    refused("fp8 norm", ts, {"'model.layers.0.input_layernorm.weight'", "has dtype F8_E4M3"});
  }
  // An FP8 checkpoint whose config.json lost its quantization_config.
  refused("fp8 weights, plain config", fp8_tensors("F32"),
          {"'model.layers.0.self_attn.q_proj.weight'", "has dtype F8_E4M3", "quant_method fp8"},
          parse_model_config(tiny_config(""), "config.json"));
}

// ---- the bytes, found while loading (fp8_block_scales, e4m3_nan_at) -----------------------------------------

static TensorView view(const std::string& name, DType dt, std::vector<int64_t> shape, const void* data) {
  TensorView t;
  t.name = name, t.file = "/m/model.safetensors", t.dtype = dt, t.shape = shape, t.data = data;
  t.nbytes = numel(shape) * dtype_size(dt);
  return t;
}

TEST(block_scales_read_and_refused) {
  const float f[6] = {0.5f, 0.25f, 1e-30f, 3.f, 448.f, 0.f};
  std::vector<float> got = fp8_block_scales(view("s", DType::F32, {2, 3}, f));
  CHECK(got == std::vector<float>(f, f + 6));
  const uint16_t b[2] = {0x3f00, 0x4040};  // 0.5, 3
  got = fp8_block_scales(view("s", DType::BF16, {1, 2}, b));
  CHECK(got == std::vector<float>({0.5f, 3.f}));
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    float g[6] = {1, 1, 1, 1, 1, 1};
    g[4] = bad;  // block [1, 1]: rows 128.., columns 128..
    expect_die("non-finite f32 scale", [&] { fp8_block_scales(view("x.weight_scale_inv", DType::F32, {2, 3}, g)); },
               {"'x.weight_scale_inv'", "/m/model.safetensors", "block [1, 1]", "rows 128..", "columns 128..",
                "must be finite"});
  }
  const uint16_t nan_b[2] = {0x3f80, 0x7fc0};
  expect_die("NaN bf16 scale", [&] { fp8_block_scales(view("y", DType::BF16, {1, 2}, nan_b)); },
             {"'y'", "block [0, 1]", "columns 128.."});
  const uint16_t inf_b[1] = {0xff80};
  expect_die("-inf bf16 scale", [&] { fp8_block_scales(view("z", DType::BF16, {1, 1}, inf_b)); }, {"'z'", "-inf"});
}

TEST(e4m3_nan_bytes_found) {
  std::vector<uint8_t> w(1000);
  for (size_t i = 0; i < w.size(); i++) w[i] = (uint8_t)(i % 0x7f) | (i & 0x80 ? 0x80 : 0);  // 0x00..0x7e, 0x80..0xfe
  CHECK_EQ(e4m3_nan_at(w.data(), (int64_t)w.size()), (int64_t)-1);
  w[613] = 0xff;
  CHECK_EQ(e4m3_nan_at(w.data(), (int64_t)w.size()), (int64_t)613);
  w[17] = 0x7f;
  CHECK_EQ(e4m3_nan_at(w.data(), (int64_t)w.size()), (int64_t)17);
  CHECK_EQ(e4m3_nan_at(w.data(), 17), (int64_t)-1);
  CHECK_EQ(e4m3_nan_at(w.data(), 0), (int64_t)-1);
}

// ---- the e4m3 decode and the CPU reference of the dequantizing kernel ---------------------------------------

// Every byte against cuda_fp8.h's conversion (e4m3 -> fp16, exact: every e4m3 value is an fp16 value) and
// against the format's definition written with ldexp.
TEST(e4m3_to_float_all_256_bytes) {
  int nans = 0;
  for (int b = 0; b < 256; b++) {
    const float got = e4m3_to_float((uint8_t)b);
    const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3);
    const float cuda = __half2float(__half(h));
    const int e = (b >> 3) & 15, m = b & 7;
    const double mag = e == 0 ? std::ldexp((double)m, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
    const double def = (b & 0x80) ? -mag : mag;
    if ((b & 0x7f) == 0x7f) {
      nans++;
      CHECK_MSG(std::isnan(got) && std::isnan(cuda), "byte %02x: %g, cuda_fp8.h %g, want NaN", b, got, cuda);
      continue;
    }
    CHECK_MSG(got == cuda && got == (float)def && std::signbit(got) == (b >= 0x80),
              "byte %02x: %g, cuda_fp8.h %g, definition %g", b, got, cuda, def);
  }
  CHECK_EQ(nans, 2);
  CHECK_EQ(e4m3_to_float(0x7e), 448.f);
  CHECK_EQ(e4m3_to_float(0xfe), -448.f);
  CHECK_EQ(e4m3_to_float(0x01), 0x1p-9f);
  CHECK_EQ(e4m3_to_float(0x08), 0x1p-6f);
  CHECK_EQ(e4m3_to_float(0x38), 1.f);
}

// Random e4m3 bytes (no NaN) [rows, cols] and scales [ceil(rows/128), ceil(cols/128)], each a random float.
struct Fp8Weight {
  int64_t rows, cols, scale_cols;
  std::vector<uint8_t> w;
  std::vector<float> scale;
};
static Fp8Weight random_fp8(int64_t rows, int64_t cols, std::mt19937& rng) {
  Fp8Weight f{rows, cols, cdiv(cols, 128), {}, {}};
  f.w.resize(rows * cols);
  for (auto& b : f.w) do b = (uint8_t)rng(); while ((b & 0x7f) == 0x7f);
  std::uniform_real_distribution<float> u(-14.f, 2.f);
  f.scale.resize(cdiv(rows, 128) * f.scale_cols);
  for (auto& s : f.scale) s = std::exp2(u(rng)) * (1.f + (float)(rng() % 1000) / 997.f);  // any f32, not 2^k
  return f;
}
static std::vector<bf16> dequantize(const Fp8Weight& f, int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
  std::vector<uint8_t> slice(nr * nc);
  for (int64_t i = 0; i < nr; i++)
    memcpy(&slice[i * nc], &f.w[(r0 + i) * f.cols + c0], nc);
  std::vector<bf16> out(nr * nc);
  fp8_dequantize_reference(out.data(), slice.data(), f.scale.data(), f.scale_cols, r0, nr, c0, nc);
  return out;
}
static uint16_t bits(bf16 x) {
  uint16_t u;
  memcpy(&u, &x, 2);
  return u;
}

// Each element against value * its block's scale, written out with the block index by hand, rounded once
// from the fp32 product (ties to even); at odd shapes, so partial blocks on both edges.
TEST(dequantize_reference_odd_shapes) {
  std::mt19937 rng(45);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 1}, {1, 129}, {127, 1}, {129, 257}, {200, 264},
                                                           {384, 130}};
  for (std::pair<int64_t, int64_t> shape : shapes) {
    const int64_t rows = shape.first, cols = shape.second;
    Fp8Weight f = random_fp8(rows, cols, rng);
    std::vector<bf16> got = dequantize(f, 0, rows, 0, cols);
    int64_t bad = 0;
    for (int64_t r = 0; r < rows; r++)
      for (int64_t c = 0; c < cols; c++) {
        const float s = f.scale[(r >> 7) * f.scale_cols + (c >> 7)];
        const uint16_t want = float_to_bf16_bits(e4m3_to_float(f.w[r * cols + c]) * s);
        if (bits(got[r * cols + c]) != want && bad++ < 3)
          fprintf(stderr, "    [%lld, %lld] of %lldx%lld: %04x, want %04x\n", (long long)r, (long long)c,
                  (long long)rows, (long long)cols, bits(got[r * cols + c]), want);
      }
    CHECK_MSG(bad == 0, "%lldx%lld: %lld elements differ", (long long)rows, (long long)cols, (long long)bad);
  }
  // Known values: 1.0 (0x38) and -448 (0xfe) times 0.5; products halfway between two bf16 values round to
  // the even one: 1 + 2^-8 down to 1, 1 + 3 * 2^-8 up to 1 + 2^-6.
  const uint8_t w[2] = {0x38, 0xfe};
  const float s[1] = {0.5f};
  bf16 out[2];
  fp8_dequantize_reference(out, w, s, 1, 0, 1, 0, 2);
  CHECK_EQ(__bfloat162float(out[0]), 0.5f);
  CHECK_EQ(__bfloat162float(out[1]), -224.f);
  const float down[1] = {1.f + 0x1p-8f}, up[1] = {1.f + 3 * 0x1p-8f};
  fp8_dequantize_reference(out, w, down, 1, 0, 1, 0, 1);
  CHECK_EQ(__bfloat162float(out[0]), 1.f);
  fp8_dequantize_reference(out, w, up, 1, 0, 1, 0, 1);
  CHECK_EQ(__bfloat162float(out[0]), 1.f + 0x1p-6f);
}

// Tensor parallelism slices a weight before dequantizing it: rows for q/k/v and gate/up, columns for o and
// down. Because the scales are indexed by the global row and column, the slice of rank r equals the same
// slice of the whole dequantized weight, bit for bit, wherever the split falls (on a 128 boundary or not).
TEST(tp_slices_equal_slices_of_the_whole) {
  std::mt19937 rng(46);
  Fp8Weight f = random_fp8(392, 520, rng);  // 3.06 x 4.06 blocks
  const std::vector<bf16> whole = dequantize(f, 0, f.rows, 0, f.cols);
  auto same = [&](int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
    std::vector<bf16> part = dequantize(f, r0, nr, c0, nc);
    int64_t bad = 0;
    for (int64_t i = 0; i < nr; i++)
      for (int64_t j = 0; j < nc; j++) bad += bits(part[i * nc + j]) != bits(whole[(r0 + i) * f.cols + c0 + j]);
    return CHECK_MSG(bad == 0, "rows %lld+%lld, columns %lld+%lld: %lld differ", (long long)r0, (long long)nr,
                     (long long)c0, (long long)nc, (long long)bad);
  };
  for (int tp : {1, 2, 4, 8})
    for (int r = 0; r < tp; r++) {
      same(r * (f.rows / tp), f.rows / tp, 0, f.cols);  // column-parallel: 392/8 = 49 rows, mid-block
      same(0, f.rows, r * (f.cols / tp), f.cols / tp);  // row-parallel: 520/8 = 65 columns
    }
  same(100, 200, 60, 300);
  // The control: row 130 read as if it were row 0 of the tensor (local indices) takes row block 0's scales
  // instead of row block 1's, and differs.
  std::vector<bf16> local = dequantize(f, 130, 1, 0, f.cols);
  fp8_dequantize_reference(local.data(), &f.w[130 * f.cols], f.scale.data(), f.scale_cols, 0, 1, 0, f.cols);
  int64_t differ = 0;
  for (int64_t j = 0; j < f.cols; j++) differ += bits(local[j]) != bits(whole[130 * f.cols + j]);
  CHECK(differ > 0);
}

// The splits of the published shapes: some fall inside a 128 block (Qwen3-4B's I = 9728 at --tp 8 is 1216
// columns a rank, 9.5 blocks), and tp_shard_problem takes them, so the loader must (and does) handle them.
TEST(tp_splits_of_published_shapes) {
  struct Shape {
    const char* name;
    int H, I, NH, NKV;
  };
  int inside = 0;
  for (const Shape& s : {Shape{"0.6B", 1024, 3072, 16, 8}, Shape{"1.7B", 2048, 6144, 16, 8},
                         Shape{"4B", 2560, 9728, 32, 8}, Shape{"8B", 4096, 12288, 32, 8},
                         Shape{"14B", 5120, 17408, 40, 8}, Shape{"32B", 5120, 25600, 64, 8}}) {
    ModelConfig m;
    m.hidden_size = s.H, m.intermediate_size = s.I, m.num_attention_heads = s.NH, m.num_key_value_heads = s.NKV;
    m.head_dim = 128, m.vocab_size = 151936;
    for (int tp : {1, 2, 4, 8}) {
      if (!tp_shard_problem(m, tp).empty()) continue;
      for (int r = 0; r < tp; r++) {
        const TPShard sh = tp_shard(m, r, tp);
        CHECK(sh.q_head0 * 128 % 128 == 0 && sh.kv_head0 * 128 % 128 == 0);  // heads are whole blocks
        inside += sh.inter0 % 128 != 0;
      }
    }
  }
  CHECK(inside > 0);  // 4B at --tp 8 (and others): starts that are not block boundaries exist
  ModelConfig m4;
  m4.hidden_size = 2560, m4.intermediate_size = 9728, m4.num_attention_heads = 32, m4.num_key_value_heads = 8;
  CHECK(tp_shard_problem(m4, 8).empty());
  CHECK_EQ(tp_shard(m4, 1, 8).inter0, (int64_t)1216);
}

int main(int argc, char** argv) { return test_main(argc, argv); }
