// test.h — the whole test framework: TEST() registers a case, CHECK* record failures, test_main() runs
// them. Every test binary ends with one line "RESULT passed=N failed=N skipped=N measured=N" that
// test/run.sh sums.
//
// A case fails when any CHECK fails; it is skipped (never counted as passed) when it calls SKIP(why).
// TIMING(name) registers a measurement instead: it prints figures and asserts nothing, so it is never
// counted as passed (or failed): it reports "MEASURED name (N ms)" and counts in measured=. What a timing run
// could check belongs in a TEST beside it. A CHECK that fails inside one still reports FAIL and counts as
// failed, so no failure is hidden; a SKIP inside one prints "SKIPPED name: why (a measurement)" and counts
// nowhere.
// Usage:   #define NANOVLLM_TESTING
//          #include "../../nanovllm.cu"   (from test/host/ or test/gpu/)
//          #include "../test.h"
//          TEST(block_hash_known_values) { CHECK_EQ(x, y); }
//          int main(int argc, char** argv) { return test_main(argc, argv); }
// Run some cases with `./build/test_x NAME_SUBSTRING`, one with `=NAME`; `--list` names them all,
// `--list-tests` all but the measurements.
// `make test` builds every host suite into one program (test/host_suites.sh): there TEST_SUITE names the
// suite a case belongs to and test_main runs only the cases of g_test_suite, the one asked for.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

#ifndef TEST_SUITE
#define TEST_SUITE ""  // a suite in its own binary
#endif
struct TestCase {
  const char* suite;
  const char* name;
  std::function<void()> fn;
  bool measure;  // registered by TIMING: figures, not a test
};
static std::vector<TestCase>& test_registry() {
  static std::vector<TestCase> r;
  return r;
}
struct TestRegistrar {
  TestRegistrar(const char* suite, const char* name, std::function<void()> fn, bool measure = false) {
    test_registry().push_back({suite, name, fn, measure});
  }
};
static const char* g_test_suite = "";  // test_main runs the cases whose suite this is
static int g_test_failures = 0;   // failures recorded in the running case
static bool g_test_skipped = false;
static std::string g_skip_reason;

// TEST(name) { ... } registers a test, TIMING(name) { ... } a measurement: the same case with its kind.
#define TEST_CASE_OF_KIND(name, measure)                                                   \
  static void test_##name();                                                               \
  static TestRegistrar test_registrar_##name(TEST_SUITE, #name, test_##name, measure);     \
  static void test_##name()
#define TEST(name) TEST_CASE_OF_KIND(name, false)
#define TIMING(name) TEST_CASE_OF_KIND(name, true)

#define CHECK(cond)                                                                                \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      fprintf(stderr, "    CHECK failed at %s:%d: %s\n", __FILE__, __LINE__, #cond);               \
      g_test_failures++;                                                                           \
    }                                                                                              \
  } while (0)

#define CHECK_EQ(a, b)                                                                             \
  do {                                                                                             \
    auto va_ = (a);                                                                                \
    auto vb_ = (b);                                                                                \
    if (!(va_ == vb_)) {                                                                           \
      std::ostringstream os_;                                                                      \
      os_ << va_ << " != " << vb_;                                                                 \
      fprintf(stderr, "    CHECK_EQ failed at %s:%d: %s == %s (%s)\n", __FILE__, __LINE__, #a, #b, \
              os_.str().c_str());                                                                  \
      g_test_failures++;                                                                           \
    }                                                                                              \
  } while (0)

// Message-carrying check, for loops that would otherwise print thousands of lines: returns cond.
#define CHECK_MSG(cond, ...)                                                                       \
  ([&]() {                                                                                         \
    bool ok_ = (cond);                                                                             \
    if (!ok_) {                                                                                    \
      fprintf(stderr, "    CHECK failed at %s:%d: %s: ", __FILE__, __LINE__, #cond);               \
      fprintf(stderr, __VA_ARGS__);                                                                \
      fprintf(stderr, "\n");                                                                       \
      g_test_failures++;                                                                           \
    }                                                                                              \
    return ok_;                                                                                    \
  }())

#define SKIP(...)                                  \
  do {                                             \
    char buf_[512];                                \
    snprintf(buf_, sizeof buf_, __VA_ARGS__);      \
    g_test_skipped = true;                         \
    g_skip_reason = buf_;                          \
    return;                                        \
  } while (0)

// Compare two float arrays with |got - want| <= atol + rtol * |want|; print the worst element on failure.
static bool check_close(const char* what, const float* got, const float* want, size_t n, float atol,
                        float rtol) {
  size_t worst = 0, bad = 0;
  double worst_excess = -1;
  for (size_t i = 0; i < n; i++) {
    double tol = atol + rtol * fabs(want[i]);
    double err = fabs((double)got[i] - want[i]);
    if (!(err <= tol)) {  // NaN fails
      bad++;
      double excess = std::isnan(err) ? 1e30 : err - tol;
      if (excess > worst_excess) worst_excess = excess, worst = i;
    }
  }
  if (bad) {
    fprintf(stderr, "    %s: %zu of %zu elements out of tolerance; worst at [%zu]: got %g want %g\n", what,
            bad, n, worst, got[worst], want[worst]);
    g_test_failures++;
    return false;
  }
  return true;
}

// A folder under /tmp for the files this process's cases write (checkpoints, folders), removed at exit.
static std::string test_tmpdir() {
  static struct Dir {
    std::string path;
    Dir() {
      char tmpl[] = "/tmp/nanovllm_test_XXXXXX";
      path = mkdtemp(tmpl) ? tmpl : "";
    }
    ~Dir() {
      if (!path.empty()) std::filesystem::remove_all(path);
    }
  } dir;
  return dir.path;
}

// Writes dir/model.safetensors: the header's length (8 bytes, little-endian), the header (JSON text), then
// `data`, then `zeros` zero bytes. False (and a failed check) when the file cannot be written.
static bool write_safetensors_file(const std::string& dir, const std::string& header,
                                   const std::vector<uint8_t>& data, size_t zeros = 0) {
  const std::string path = dir + "/model.safetensors";
  FILE* f = fopen(path.c_str(), "wb");
  CHECK_MSG(f != nullptr, "cannot write %s", path.c_str());
  if (!f) return false;
  const uint64_t len = header.size();
  fwrite(&len, 8, 1, f);
  fwrite(header.data(), 1, header.size(), f);
  if (!data.empty()) fwrite(data.data(), 1, data.size(), f);
  fclose(f);
  if (zeros) CHECK(truncate(path.c_str(), 8 + header.size() + data.size() + zeros) == 0);
  return true;
}

// test/ref/make_tiny_checkpoint.py OUT --moe ARGS, the repository's own fixture writer (run from the
// repository root, as the test runner does): the folder, or "" when python3 or the script is not there.
static std::string tiny_moe_folder(const std::string& name, const std::string& args = "") {
  const std::string script = "test/ref/make_tiny_checkpoint.py", out = test_tmpdir() + "/" + name;
  if (!std::filesystem::is_regular_file(script) || system("python3 -c pass >/dev/null 2>&1") != 0) return "";
  const std::string cmd = "python3 " + script + " '" + out + "' --moe " + args + " >/dev/null 2>&1";
  CHECK_MSG(system(cmd.c_str()) == 0, "%s failed", cmd.c_str());
  return out;
}

// Refusals. The engine's die() (a user's mistake: nanovllm.cu section 1) throws TokDieError while tok_die_throws
// is set (tokenizer.h): expect_die runs fn and expects a refusal whose message holds every one of `needles`;
// expect_no_die expects none.
template <class F>
static void expect_die(const std::string& what, F fn, const std::vector<std::string>& needles) {
  tok_die_throws = true;
  try {
    fn();
    CHECK_MSG(false, "%s: expected a refusal, got none", what.c_str());
  } catch (const TokDieError& e) {
    const std::string msg = e.what();
    for (const std::string& n : needles)
      CHECK_MSG(msg.find(n) != std::string::npos, "%s: message '%s' lacks '%s'", what.c_str(), msg.c_str(),
                n.c_str());
  }
  tok_die_throws = false;
}
template <class F>
static void expect_no_die(const std::string& what, F fn) {
  tok_die_throws = true;
  try {
    fn();
  } catch (const TokDieError& e) {
    CHECK_MSG(false, "%s: refused: %s", what.c_str(), e.what());
  }
  tok_die_throws = false;
}

// argv[1]: run only the cases whose name contains it; "=NAME" runs the case named exactly NAME; --list prints
// the names and runs nothing, --list-tests the names of the cases that are not measurements
// (test/gpu/gpu_sanitize.sh runs those one by one).
static int test_main(int argc, char** argv) {
  const char* filter = argc > 1 ? argv[1] : nullptr;
  if (filter && (!strcmp(filter, "--list") || !strcmp(filter, "--list-tests"))) {
    const bool tests_only = !strcmp(filter, "--list-tests");
    for (auto& t : test_registry())
      if (!strcmp(t.suite, g_test_suite) && !(tests_only && t.measure)) printf("%s\n", t.name);
    return 0;
  }
  const bool exact = filter && filter[0] == '=';
  int passed = 0, failed = 0, skipped = 0, measured = 0;
  for (auto& t : test_registry()) {
    if (strcmp(t.suite, g_test_suite) != 0) continue;
    if (filter && (exact ? strcmp(t.name, filter + 1) != 0 : !strstr(t.name, filter))) continue;
    g_test_failures = 0;
    g_test_skipped = false;
    auto t0 = std::chrono::steady_clock::now();
    t.fn();
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (g_test_failures) {
      printf("FAIL %s (%d checks failed)\n", t.name, g_test_failures);
      failed++;
    } else if (g_test_skipped) {
      printf("SKIPPED %s: %s%s\n", t.name, g_skip_reason.c_str(), t.measure ? " (a measurement)" : "");
      skipped += !t.measure;
    } else if (t.measure) {
      printf("MEASURED %s (%.0f ms)\n", t.name, ms);
      measured++;
    } else {
      printf("PASS %s (%.0f ms)\n", t.name, ms);
      passed++;
    }
    fflush(stdout);
  }
  printf("RESULT passed=%d failed=%d skipped=%d measured=%d\n", passed, failed, skipped, measured);
  return failed ? 1 : 0;
}
