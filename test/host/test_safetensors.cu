// Host tests of safetensors.h and the config reader: files the test writes itself, valid and broken.
#define NANOVLLM_TESTING
#include "../../nanovllm.cu"
#include "../test.h"

static std::string tmpdir() {
  static std::string d;
  if (d.empty()) {
    char tmpl[] = "/tmp/nanovllm_test_XXXXXX";
    d = mkdtemp(tmpl);
  }
  return d;
}

// Write a safetensors file from a header JSON string and a data section of `data_bytes` bytes.
static std::string write_st(const std::string& name, const std::string& header, size_t data_bytes,
                            int64_t header_len_override = -1) {
  std::string path = tmpdir() + "/" + name;
  FILE* f = fopen(path.c_str(), "wb");
  uint64_t n = header_len_override >= 0 ? (uint64_t)header_len_override : header.size();
  fwrite(&n, 8, 1, f);
  fwrite(header.data(), 1, header.size(), f);
  std::vector<uint8_t> data(data_bytes);
  for (size_t i = 0; i < data_bytes; i++) data[i] = (uint8_t)(i * 31 + 7);
  if (data_bytes) fwrite(data.data(), 1, data.size(), f);  // data() may be null when empty
  fclose(f);
  return path;
}

// Expect open_file to throw with a message containing every one of `needles`.
static void expect_error(const std::string& path, std::vector<std::string> needles) {
  try {
    SafeTensors::open_file(path);
    CHECK_MSG(false, "%s: expected an error", path.c_str());
  } catch (const SafeTensorsError& e) {
    std::string msg = e.what();
    for (auto& n : needles) CHECK_MSG(msg.find(n) != std::string::npos, "message '%s' lacks '%s'", msg.c_str(), n.c_str());
  }
}

TEST(safetensors_valid_file) {
  std::string h = R"({"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},)"
                  R"("b":{"dtype":"F32","shape":[4],"data_offsets":[12,28]},"c":{"dtype":"I64","shape":[],"data_offsets":[28,36]}})";
  std::string p = write_st("ok.safetensors", h, 36);
  SafeTensors st = SafeTensors::open_file(p);
  CHECK_EQ(st.names().size(), (size_t)3);
  const TensorView* a = st.find("a");
  CHECK(a && a->dtype == DType::BF16 && a->shape == std::vector<int64_t>({2, 3}) && a->nbytes == 12);
  const TensorView* b = st.find("b");
  CHECK(b && b->nbytes == 16 && ((const uint8_t*)b->data)[0] == (uint8_t)(12 * 31 + 7));
  CHECK(st.find("missing") == nullptr);
  CHECK_EQ(st.find("c")->numel(), (int64_t)1);
}

TEST(safetensors_broken_files) {
  std::string ok_t = R"("a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]})";
  expect_error(write_st("empty.safetensors", "", 0), {"empty.safetensors", "not valid JSON"});
  expect_error(write_st("hlen.safetensors", "{}", 0, 1000), {"header length 1000", "hlen.safetensors"});
  expect_error(write_st("notjson.safetensors", "{not json", 0), {"not valid JSON"});
  expect_error(write_st("array.safetensors", "[1,2]", 0), {"JSON object"});
  expect_error(write_st("dtype.safetensors", R"({"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,2]}})", 2),
               {"'a'", "unknown dtype \"Q4\""});
  expect_error(write_st("span.safetensors", R"({"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,10]}})", 12),
               {"'a'", "[2, 3]", "needs 12 bytes", "span 10"});
  expect_error(write_st("past.safetensors", "{" + ok_t + "}", 8), {"'a'", "past the data section", "truncated"});
  expect_error(write_st("overlap.safetensors",
                        R"({"a":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[4],"data_offsets":[4,12]}})",
                        12),
               {"overlap", "'a'", "'b'"});
  expect_error(write_st("noshape.safetensors", R"({"a":{"dtype":"BF16","data_offsets":[0,2]}})", 2), {"shape"});
  expect_error(write_st("neg.safetensors", R"({"a":{"dtype":"BF16","shape":[-1],"data_offsets":[0,2]}})", 2),
               {"non-negative"});
  expect_error(tmpdir() + "/does_not_exist.safetensors", {"cannot open"});
}

TEST(safetensors_truncated_header_file) {
  std::string path = tmpdir() + "/tiny.safetensors";
  FILE* f = fopen(path.c_str(), "wb");
  fwrite("abc", 1, 3, f);
  fclose(f);
  expect_error(path, {"too small"});
}

TEST(safetensors_sharded_index) {
  std::string d = tmpdir() + "/sharded";
  mkdir(d.c_str(), 0755);
  auto write_in = [&](const std::string& name, const std::string& h, size_t n) {
    std::string p = write_st("tmp.bin", h, n);
    rename(p.c_str(), (d + "/" + name).c_str());
  };
  write_in("m-1.safetensors", R"({"x":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})", 4);
  write_in("m-2.safetensors", R"({"y":{"dtype":"F16","shape":[3],"data_offsets":[0,6]}})", 6);
  FILE* f = fopen((d + "/model.safetensors.index.json").c_str(), "w");
  fprintf(f, R"({"metadata":{},"weight_map":{"x":"m-1.safetensors","y":"m-2.safetensors"}})");
  fclose(f);
  SafeTensors st = SafeTensors::open_dir(d);
  CHECK(st.find("x") && st.find("y"));
  CHECK_EQ(st.total_bytes(), (size_t)10);
  // An index that names a missing shard.
  f = fopen((d + "/model.safetensors.index.json").c_str(), "w");
  fprintf(f, R"({"weight_map":{"x":"m-1.safetensors","z":"m-3.safetensors"}})");
  fclose(f);
  try {
    SafeTensors::open_dir(d);
    CHECK_MSG(false, "expected an error for a missing shard");
  } catch (const SafeTensorsError& e) {
    CHECK(std::string(e.what()).find("m-3.safetensors") != std::string::npos);
  }
}

// An FP8 checkpoint's tensors (Qwen/Qwen3-*-FP8): F8_E4M3 weights take one byte per element, their block
// scales BF16 or F32; odd shapes need no padding.
TEST(safetensors_fp8_weights_and_scales) {
  std::string h = R"({"w":{"dtype":"F8_E4M3","shape":[3,131],"data_offsets":[0,393]},)"
                  R"("s16":{"dtype":"BF16","shape":[1,2],"data_offsets":[393,397]},)"
                  R"("s32":{"dtype":"F32","shape":[1,2],"data_offsets":[397,405]},)"
                  R"("e":{"dtype":"F8_E4M3","shape":[0,7],"data_offsets":[405,405]}})";
  SafeTensors st = SafeTensors::open_file(write_st("fp8.safetensors", h, 405));
  const TensorView* w = st.find("w");
  CHECK(w && w->dtype == DType::F8_E4M3 && w->nbytes == 393 && w->numel() == 393);
  CHECK(w && ((const uint8_t*)w->data)[392] == (uint8_t)(392 * 31 + 7));  // the last byte is its own
  CHECK_EQ(dtype_size(DType::F8_E4M3), 1);
  CHECK_EQ(std::string(dtype_name(DType::F8_E4M3)), std::string("F8_E4M3"));
  CHECK(st.find("s16") && st.find("s16")->dtype == DType::BF16 && st.find("s16")->nbytes == 4);
  CHECK(st.find("s32") && st.find("s32")->dtype == DType::F32 && st.find("s32")->nbytes == 8);
  CHECK(st.find("e") && st.find("e")->nbytes == 0);
  CHECK_EQ(st.total_bytes(), (size_t)405);
}

TEST(safetensors_fp8_broken_files) {
  // Sized as if two bytes an element: the span check counts one.
  expect_error(write_st("fp8span.safetensors", R"({"w":{"dtype":"F8_E4M3","shape":[3,131],"data_offsets":[0,786]}})",
                        786),
               {"'w'", "[3, 131] of F8_E4M3 needs 393 bytes", "span 786"});
  // The download stopped inside the weight.
  expect_error(write_st("fp8cut.safetensors", R"({"w":{"dtype":"F8_E4M3","shape":[3,131],"data_offsets":[0,393]}})",
                        200),
               {"'w'", "[0, 393] run past the data section of 200 bytes", "truncated"});
  // A weight and its scales overlapping.
  expect_error(write_st("fp8overlap.safetensors",
                        R"({"w":{"dtype":"F8_E4M3","shape":[2,2],"data_offsets":[0,4]},)"
                        R"("s":{"dtype":"F32","shape":[1,1],"data_offsets":[2,6]}})",
                        6),
               {"overlap", "'w'", "'s'"});
  expect_error(write_st("fp8e3.safetensors", R"({"w":{"dtype":"F8_E3M4","shape":[1],"data_offsets":[0,1]}})", 1),
               {"'w'", "unknown dtype \"F8_E3M4\""});
}

// A config.json for a valid tiny Qwen3, as transformers 5 writes it (rope_theta inside rope_parameters).
static std::string qwen3_config(const std::string& extra = "") {
  return R"({"architectures":["Qwen3ForCausalLM"],"hidden_size":256,"intermediate_size":512,)"
         R"("num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":128,)"
         R"("vocab_size":151936,"max_position_embeddings":40960,"rms_norm_eps":1e-6,)" +
         extra + R"("rope_parameters":{"rope_theta":1000000.0,"rope_type":"default"},"tie_word_embeddings":true})";
}

TEST(config_parse_valid) {
  ModelConfig c = parse_model_config(qwen3_config(), "config.json");
  CHECK_EQ(c.hidden_size, 256);
  CHECK_EQ(c.num_key_value_heads, 2);
  CHECK(c.tie_word_embeddings);
  CHECK(fabs(c.rope_theta - 1e6f) < 1);
  ModelConfig c2 = parse_model_config(qwen3_config(R"("eos_token_id":[151645,151643],)"), "config.json");
  CHECK(c2.eos_token_ids == std::vector<int>({151645, 151643}));
}

int main(int argc, char** argv) { return test_main(argc, argv); }
