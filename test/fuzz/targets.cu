// targets.cu — the fuzz targets, on the engine's own parsers (the single translation unit, as in every
// test): the safetensors header, config.json, the tokenizer (encode and decode of arbitrary bytes),
// tokenizer.json's two tables (the fast reader against nlohmann::json) and the prompts file (text and JSONL).
//
// A target takes arbitrary bytes and must either accept them, with the properties checked below holding,
// or refuse them the way the program does: die() (which throws TokDieError while tok_die_throws is set,
// see tokenizer.h T1) or SafeTensorsError. A crash, a sanitizer report, an escaping exception, a hang or a
// broken property is a bug.
//
// Two drivers use these functions:
//   test/fuzz/main.cpp                   libFuzzer (clang -fsanitize=fuzzer,address,undefined): `make fuzz`
//   test/host/test_fuzz_regressions.cu   the host test that replays test/fuzz/corpus/* and test/fuzz/regressions/*
// The tokenizer is Qwen3's (NANOVLLM_TOKENIZER_DIR, else tools/fetch_tokenizer.sh), loaded on first use.
#ifndef NANOVLLM_TESTING
#define NANOVLLM_TESTING
#include "../../nanovllm.cu"
#endif

// A broken property: abort() under libFuzzer (it saves the input); the regression test records a failure.
static void (*fuzz_failure_hook)(const char* msg) = nullptr;
static void fuzz_fail(const char* fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (fuzz_failure_hook) return fuzz_failure_hook(msg);
  fprintf(stderr, "fuzz property broken: %s\n", msg);
  abort();
}

static const Tokenizer* fuzz_tokenizer() {
  static const Tokenizer* tok = nullptr;
  if (tok) return tok;
  std::string dir = getenv("NANOVLLM_TOKENIZER_DIR") ? getenv("NANOVLLM_TOKENIZER_DIR") : "";
  if (dir.empty()) {
    FILE* p = popen("bash tools/fetch_tokenizer.sh", "r");
    char buf[4096];
    size_t n;
    std::string out;
    while (p && (n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    if (p) pclose(p);
    while (!out.empty() && out.back() == '\n') out.pop_back();
    dir = out.substr(out.rfind('\n') == std::string::npos ? 0 : out.rfind('\n') + 1);
  }
  if (dir.empty()) {
    fprintf(stderr, "fuzz: no Qwen3 tokenizer (set NANOVLLM_TOKENIZER_DIR or run tools/fetch_tokenizer.sh)\n");
    exit(2);
  }
  tok_die_throws = false;  // a broken tokenizer.json is a set-up error, not a finding
  tok = new Tokenizer(Tokenizer::load(dir));
  return tok;
}

// Run one input; a clean refusal (die() or SafeTensorsError) returns false.
template <typename Fn>
static bool fuzz_accepts(Fn&& fn) {
  tok_die_throws = true;
  try {
    fn();
  } catch (const TokDieError&) {
    return false;
  } catch (const SafeTensorsError&) {
    return false;
  }
  return true;
}

// ---- 1. safetensors header ---------------------------------------------------------------------------
// Input: 8 bytes little-endian = the size of the data section, then the header JSON. On acceptance every
// tensor lies inside the data section, its span is exactly numel x itemsize, and no two spans overlap.
extern "C" int nanovllm_fuzz_safetensors(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  uint64_t data_size;
  memcpy(&data_size, data, 8);
  std::vector<TensorView> ts;
  if (!fuzz_accepts([&] {
        ts = SafeTensors::parse_header("fuzz.safetensors", (const char*)data + 8, size - 8, nullptr, data_size);
      }))
    return 0;
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  for (const TensorView& t : ts) {
    int itemsize = dtype_size(t.dtype);
    if (itemsize <= 0) fuzz_fail("tensor '%s': dtype without a size", t.name.c_str());
    unsigned __int128 bytes = itemsize;
    for (int64_t d : t.shape) {
      if (d < 0) fuzz_fail("tensor '%s': negative dim accepted", t.name.c_str());
      bytes *= (uint64_t)d;
      if (bytes > ((unsigned __int128)1 << 64)) bytes = (unsigned __int128)1 << 64;
    }
    if (bytes != t.nbytes)
      fuzz_fail("tensor '%s': shape %s of %s accepted with a span of %zu bytes", t.name.c_str(),
                t.shape_str().c_str(), dtype_name(t.dtype), t.nbytes);
    if (t.nbytes > data_size) fuzz_fail("tensor '%s' is larger than the data section", t.name.c_str());
    if (t.data) fuzz_fail("tensor '%s' has a data pointer without data", t.name.c_str());
  }
  return 0;
}

// ---- 2. config.json ------------------------------------------------------------------------------------
// On acceptance the config is one the engine can size buffers from.
extern "C" int nanovllm_fuzz_config(const uint8_t* data, size_t size) {
  std::string text((const char*)data, size);
  ModelConfig c;
  if (!fuzz_accepts([&] { c = parse_model_config(text, "config.json"); })) return 0;
  if (c.hidden_size <= 0 || c.intermediate_size <= 0 || c.num_hidden_layers <= 0 || c.vocab_size <= 0 ||
      c.num_attention_heads <= 0 || c.num_key_value_heads <= 0 || c.max_position_embeddings <= 0)
    fuzz_fail("config accepted with a non-positive size");
  if (c.num_attention_heads % c.num_key_value_heads) fuzz_fail("heads not divisible by KV heads accepted");
  if (c.head_dim != HEAD_DIM) fuzz_fail("head_dim %d accepted", c.head_dim);
  if (c.hidden_size % 8 || c.intermediate_size % 8) fuzz_fail("sizes not multiples of 8 accepted");
  if (!(c.rms_norm_eps > 0) || !std::isfinite(c.rope_theta)) fuzz_fail("bad eps or rope_theta accepted");
  if (c.num_experts) {  // a Qwen3-MoE config: what the router and the experts' kernels need (section 10b)
    const int E = c.num_experts, k = c.num_experts_per_tok;
    if (E < 1 || E > MOE_MAX_EXPERTS || k < 1 || k > E || k > MOE_MAX_TOPK) fuzz_fail("E %d, k %d accepted", E, k);
    if (c.moe_intermediate_size <= 0 || c.moe_intermediate_size % 8 || c.decoder_sparse_step < 1)
      fuzz_fail("moe_intermediate_size %d, decoder_sparse_step %d accepted", c.moe_intermediate_size,
                c.decoder_sparse_step);
    for (int l : c.mlp_only_layers)
      if (l < 0 || l >= c.num_hidden_layers) fuzz_fail("mlp_only_layers entry %d accepted", l);
  }
  // The engine settings checked against it must refuse or accept cleanly too.
  Config cfg;
  fuzz_accepts([&] { validate_config(cfg, c); });
  return 0;
}

// ---- 3. tokenizer ----------------------------------------------------------------------------------------
// Input byte 0 picks the mode, the rest is the payload.
//   even: encode the payload as text. Invalid UTF-8 must be refused; valid text must give ids in the
//         vocabulary that decode back to the text (when NFC leaves it unchanged), and the chat template
//         around it must encode too.
//   odd:  decode the payload as ids (3 bytes each, some past the vocabulary): the text must be valid UTF-8
//         and equal to what the streaming decoder gives one id at a time.
static bool utf8_ok(const std::string& s) { return utf8_invalid_at(s.data(), s.size()) == s.size(); }

extern "C" int nanovllm_fuzz_tokenizer(const uint8_t* data, size_t size) {
  const Tokenizer& tok = *fuzz_tokenizer();
  if (size < 1) return 0;
  std::string payload((const char*)data + 1, size - 1);
  if (data[0] % 2 == 0) {
    std::vector<int> ids;
    bool accepted = fuzz_accepts([&] { ids = tok.encode(payload); });
    if (accepted != utf8_ok(payload)) fuzz_fail("encode %s invalid UTF-8", accepted ? "accepted" : "refused");
    if (!accepted) return 0;
    for (int id : ids)
      if (id < 0 || id >= tok.vocab_size()) fuzz_fail("encode gave id %d outside the vocabulary", id);
    std::string normalized;
    if (!nfc_normalize(payload.data(), payload.size(), normalized) && tok.decode(ids) != payload)
      fuzz_fail("decode(encode(text)) != text for %zu bytes of NFC text", payload.size());
    std::vector<int> chat;
    if (!fuzz_accepts([&] { chat = tok.encode(tok.apply_chat_template({{"user", payload}}, true, data[0] & 2)); }))
      fuzz_fail("the chat template around valid text was refused");
    if (chat.size() < ids.size()) fuzz_fail("the chat prompt has fewer ids than its text");
  } else {
    std::vector<int> ids;
    for (size_t i = 1; i + 3 <= size; i += 3) {
      uint32_t v = data[i] | data[i + 1] << 8 | (uint32_t)data[i + 2] << 16;
      ids.push_back((int)(v % (uint32_t)(tok.vocab_size() + 64)) - (v >> 23 ? 32 : 0));  // a few invalid
    }
    std::string text = tok.decode(ids);
    if (!utf8_ok(text)) fuzz_fail("decode gave invalid UTF-8");
    StreamDecoder sd(tok);
    std::string streamed;
    for (int id : ids) {
      std::string piece = sd.push(id);
      if (!utf8_ok(piece)) fuzz_fail("StreamDecoder gave invalid UTF-8 mid-stream");
      streamed += piece;
    }
    streamed += sd.flush();
    if (streamed != text) fuzz_fail("streamed decode differs from decode");
  }
  return 0;
}

// ---- 3b. tokenizer.json's two tables ---------------------------------------------------------------------
// Input: a tokenizer.json. read_tables_fast (tokenizer.h T6) must accept only what nlohmann::json accepts,
// and read what the whole-document reader finds there: the same merges in order, and the same vocabulary
// (compared as a map, where no spelling repeats).
extern "C" int nanovllm_fuzz_tokenizer_json(const uint8_t* data, size_t size) {
  using nlohmann::json;
  const std::string text((const char*)data, size);
  TokenizerTables fast;
  if (!read_tables_fast(text, &fast)) return 0;
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::exception&) {
    fuzz_fail("read_tables_fast accepted a file nlohmann::json refuses");
    return 0;
  }
  const json& vocab = doc.at("model").at("vocab");
  const json& merges = doc.at("model").at("merges");
  if (!merges.is_array() || merges.size() != fast.merges.size())
    return fuzz_fail("merges: %zu read fast, %zu in the document", fast.merges.size(), merges.size()), 0;
  for (size_t r = 0; r < merges.size(); r++) {
    const TokenizerTables::Merge& m = fast.merges[r];
    const json want = m.pair ? json::array({m.left, m.right}) : json(m.left + " " + m.right);
    if (merges[r] != want) return fuzz_fail("merges[%zu] read as %s", r, want.dump().c_str()), 0;
  }
  std::map<std::string, int> read;
  for (const auto& e : fast.vocab)
    if (!read.emplace(e.first, e.second).second) return 0;  // a repeated spelling: the document keeps one
  if (!vocab.is_object() || vocab.size() != read.size())
    return fuzz_fail("vocab: %zu read fast, %zu in the document", read.size(), vocab.size()), 0;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    auto f = read.find(it.key());
    if (f == read.end() || !it.value().is_number_integer() || it.value().get<long long>() != f->second)
      return fuzz_fail("vocab['%s'] is %s in the document", it.key().c_str(), it.value().dump().c_str()), 0;
  }
  return 0;
}

// ---- 4. prompts file (text and JSONL) --------------------------------------------------------------------
// Input byte 0: bit 0 = JSONL, bit 1 = --raw, bit 2 = --no-thinking; the rest is the file. On acceptance
// every request fits --max-model-len, its ids are in the vocabulary and its sampling settings are valid.
extern "C" int nanovllm_fuzz_prompts(const uint8_t* data, size_t size) {
  const Tokenizer& tok = *fuzz_tokenizer();
  if (size < 1) return 0;
  std::string text((const char*)data + 1, size - 1);
  PromptOptions opt;
  opt.raw = data[0] & 2;
  opt.enable_thinking = !(data[0] & 4);
  Config cfg;
  cfg.max_model_len = 256;  // small, so the length check is reached often
  ModelConfig mc;
  mc.vocab_size = 151936;
  mc.max_position_embeddings = 40960;
  std::vector<Request> reqs;
  std::string path = data[0] & 1 ? "fuzz.jsonl" : "fuzz.txt";
  if (!fuzz_accepts([&] { reqs = parse_prompts(text, path, tok, opt, cfg, mc); })) return 0;
  if (reqs.empty()) fuzz_fail("no requests accepted");
  for (const Request& r : reqs) {
    const SamplingParams& p = r.params;
    if (!r.error.empty()) continue;  // an OpenAI batch line answered with its error: never run
    if (r.prompt_token_ids.empty()) fuzz_fail("%s: empty prompt accepted", r.source.c_str());
    if ((int64_t)r.prompt_token_ids.size() + p.max_tokens > cfg.max_model_len)
      fuzz_fail("%s: prompt + max_tokens past max_model_len accepted", r.source.c_str());
    for (int id : r.prompt_token_ids)
      if (id < 0 || id >= mc.vocab_size) fuzz_fail("%s: token id %d accepted", r.source.c_str(), id);
    if (!(p.temperature >= 0) || !std::isfinite(p.temperature) || !(p.top_p > 0 && p.top_p <= 1) ||
        p.max_tokens < 1 || p.top_k == 0 || p.top_k < -1 || p.n < 1 || p.min_tokens < 0 ||
        p.min_tokens > p.max_tokens || p.logprobs < -1 || p.logprobs > MAX_LOGPROBS || !(p.min_p >= 0 && p.min_p <= 1) ||
        !(p.repetition_penalty > 0) || !(std::fabs(p.presence_penalty) <= 2) || !(std::fabs(p.frequency_penalty) <= 2))
      fuzz_fail("%s: invalid sampling settings accepted", r.source.c_str());
  }
  return 0;
}
