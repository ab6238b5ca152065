// test_fuzz_regressions.cu — every committed fuzz input, replayed through the fuzz targets without libFuzzer:
// the seeds (test/fuzz/corpus/NAME) and the inputs that once broke something (test/fuzz/regressions/NAME,
// one file per bug, named after it). Built by nvcc like every host test, so it runs where clang is absent;
// under `make SANITIZE=1 test` it runs with AddressSanitizer and UndefinedBehaviorSanitizer.
#include "../fuzz/targets.cu"
#include "../test.h"

#include <dirent.h>

static std::string g_replaying;  // the input being replayed, for the failure message
static void record_failure(const char* msg) {
  CHECK_MSG(false, "%s: %s", g_replaying.c_str(), msg);
}

// Replay every file of test/fuzz/corpus/NAME and test/fuzz/regressions/NAME; returns how many there were.
static int replay(const std::string& name, int (*target)(const uint8_t*, size_t)) {
  fuzz_failure_hook = record_failure;
  int n = 0;
  for (std::string dir : {"test/fuzz/corpus/" + name, "test/fuzz/regressions/" + name}) {
    DIR* d = opendir(dir.c_str());
    if (!d) continue;
    std::vector<std::string> files;
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') files.push_back(dir + "/" + e->d_name);
    closedir(d);
    std::sort(files.begin(), files.end());
    for (auto& f : files) {
      g_replaying = f;
      std::string bytes = read_file(f, "fuzz input");
      target((const uint8_t*)bytes.data(), bytes.size());
      n++;
    }
  }
  tok_die_throws = false;
  return n;
}

TEST(fuzz_inputs_safetensors) { CHECK(replay("safetensors", nanovllm_fuzz_safetensors) >= 5); }
TEST(fuzz_inputs_config) { CHECK(replay("config", nanovllm_fuzz_config) >= 4); }
TEST(fuzz_inputs_tokenizer) { CHECK(replay("tokenizer", nanovllm_fuzz_tokenizer) >= 5); }
TEST(fuzz_inputs_tokenizer_json) { CHECK(replay("tokenizer_json", nanovllm_fuzz_tokenizer_json) >= 4); }
TEST(fuzz_inputs_prompts) { CHECK(replay("prompts", nanovllm_fuzz_prompts) >= 4); }

// The targets must be able to fail: a property they check, broken on purpose, is reported.
TEST(fuzz_targets_report_broken_properties) {
  int before = g_test_failures;
  fuzz_failure_hook = [](const char* msg) { g_replaying = msg; };
  g_replaying.clear();
  // A header the parser accepts, checked against a data section smaller than it claims: parse_header must
  // refuse it, so the target reports nothing; then the property check itself on a hand-made view.
  std::string h = std::string(8, '\0') + R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  nanovllm_fuzz_safetensors((const uint8_t*)h.data(), h.size());
  CHECK_MSG(g_replaying.empty(), "a refused header was reported: %s", g_replaying.c_str());
  fuzz_fail("property %d", 7);
  CHECK_EQ(g_replaying, std::string("property 7"));
  CHECK_EQ(g_test_failures, before);
}

int main(int argc, char** argv) { return test_main(argc, argv); }
