// tokenizer.h — the Qwen2/Qwen3 tokenizer: byte-level BPE exact to Hugging Face `tokenizers`, the Qwen3
// chat template exact to transformers' apply_chat_template, and the `nanovllm encode|decode` commands.
//
// What Hugging Face does with tokenizer.json, and where each step lives here
//   encode(text)
//     a. split out added tokens (<|im_start|>, <think>, ...) in the raw text, leftmost then longest . T6
//     b. NFC-normalize each remaining segment (utf8proc) ........................................ T3
//     c. split the segment with the Qwen2 regex (a hand-written matcher, no regex engine) ......... T4
//          (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*
//          |\s*[\r\n]+|\s+(?!\S)|\s+
//     d. byte-level BPE on each piece: merge the adjacent pair of lowest merge rank until none ..... T5
//        is left (a cache of recent pieces skips most of this)
//   decode(ids): token bytes, concatenated; invalid UTF-8 becomes U+FFFD like Rust's from_utf8_lossy . T2
//   StreamDecoder: the same, one id at a time, holding back an unfinished character ................ T6
//   apply_chat_template: the Qwen3 ChatML template, rewritten in C++ ............................... T7
//   tokenizer_command: `nanovllm encode MODEL_DIR [--jsonl | --chat [--no-thinking]]`, `decode` ..... T8
//
// Sections: T1 errors · T2 UTF-8 · T3 Unicode tables · T4 pre-tokenizer · T5 BPE · T6 Tokenizer ·
//           T7 chat template · T8 command line
//
// API (T6, T7, T8)
//   Tokenizer tok = Tokenizer::load(model_dir_or_tokenizer_json);
//   std::vector<int> ids = tok.encode(text);     std::string text = tok.decode(ids);
//   StreamDecoder sd(tok); std::string piece = sd.push(id); ... piece = sd.flush();
//   tok.vocab_size() (151,669), tok.token_to_id("<|im_end|>") (151,645), tok.eos_token_id
//   tok.apply_chat_template({{"system", ...}, {"user", ...}}, add_generation_prompt, enable_thinking)
//   tokenizer_command(argc, argv) with argv[0] "encode" or "decode"
//
// Two facts a reader needs (both measured against tokenizers 0.23.2; test/ref/data/tokenizer_unicode.json):
//   * the split regex uses Unicode 16 letter/number tables while utf8proc 2.8 knows Unicode 15.0, so the
//     letters and digits added since are listed here (kRegexUnicode16Letters, kRegexUnicode16Numbers);
//   * HF's NFC tables predate Unicode 11: 110 combining marks added since are plain starters to it, so
//     its NFC never reorders or composes across them, and ours splits there (kNfcUnknownToHF).
// Tokens are byte strings internally: tokenizer.json spells bytes with GPT-2's printable alphabet
// ("Ġ" is the space byte); load() translates every vocab entry back to raw bytes once.
//
// Loading reads tokenizer.json's two large tables with a reader made for them (T6: read_tables_fast), the
// rest with nlohmann::json. Speed against Hugging Face's tokenizers: docs/performance.md.
#pragma once

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include <sys/stat.h>

#include <nlohmann/json.hpp>
#include <utf8proc.h>

// ==== T1. Errors ========================================================================================
// tokenizer.h comes before nanovllm.cu's section 1, so it has its own die() with the same output format.
// The fuzz targets (test/fuzz) set tok_die_throws: a rejection then throws TokDieError with the message
// instead of exiting, so "refused cleanly" is an outcome they can tell apart from a crash.

struct TokDieError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
static bool tok_die_throws = false;
// Run before a refusal exits; empty: nothing. (The engine sets it while a thread of its own may be inside
// CUDA's start-up: a process must not exit under that thread.)
static void (*tok_die_before_exit)() = nullptr;

[[noreturn]] static void tok_die(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  if (tok_die_throws) {
    char msg[1024];
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    throw TokDieError(msg);
  }
  fprintf(stderr, "nanovllm: error: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  if (tok_die_before_exit) tok_die_before_exit();
  exit(1);
}

// ==== T2. UTF-8 ===========================================================================================

// Offset of the first byte that breaks strict UTF-8 (overlong forms, surrogates and > U+10FFFF rejected,
// as in Rust and Python), or n when the whole text is valid.
static size_t utf8_invalid_at(const char* text, size_t n) {
  const unsigned char* s = (const unsigned char*)text;
  size_t i = 0;
  while (i < n) {
    if (i + 8 <= n) {  // 8 ASCII bytes at a time
      uint64_t w;
      memcpy(&w, s + i, 8);
      if (!(w & 0x8080808080808080ull)) {
        i += 8;
        continue;
      }
    }
    unsigned c = s[i];
    if (c < 0x80) {
      i++;
      continue;
    }
    int len;
    unsigned lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF)
      len = 2;
    else if (c >= 0xE0 && c <= 0xEF)
      len = 3, lo = (c == 0xE0) ? 0xA0 : 0x80, hi = (c == 0xED) ? 0x9F : 0xBF;
    else if (c >= 0xF0 && c <= 0xF4)
      len = 4, lo = (c == 0xF0) ? 0x90 : 0x80, hi = (c == 0xF4) ? 0x8F : 0xBF;
    else
      return i;
    if (i + len > n || s[i + 1] < lo || s[i + 1] > hi) return i;
    for (int k = 2; k < len; k++)
      if ((s[i + k] & 0xC0) != 0x80) return i;
    i += len;
  }
  return n;
}

// Decode one code point of text already known to be valid UTF-8.
static inline uint32_t utf8_next(const unsigned char* s, size_t i, int* len) {
  unsigned c = s[i];
  if (c < 0x80) {
    *len = 1;
    return c;
  }
  if (c < 0xE0) {
    *len = 2;
    return ((c & 0x1Fu) << 6) | (s[i + 1] & 0x3Fu);
  }
  if (c < 0xF0) {
    *len = 3;
    return ((c & 0x0Fu) << 12) | ((s[i + 1] & 0x3Fu) << 6) | (s[i + 2] & 0x3Fu);
  }
  *len = 4;
  return ((c & 0x07u) << 18) | ((s[i + 1] & 0x3Fu) << 12) | ((s[i + 2] & 0x3Fu) << 6) | (s[i + 3] & 0x3Fu);
}

static void utf8_append(std::string& out, uint32_t cp) {
  char b[4];
  int n = (int)utf8proc_encode_char((utf8proc_int32_t)cp, (utf8proc_uint8_t*)b);
  out.append(b, n);
}

// Bytes -> text the way Rust's String::from_utf8_lossy does it (HF's ByteLevel decoder calls it): each
// maximal piece of an ill-formed sequence becomes one U+FFFD. It is fed in chunks, so a character split
// across tokens waits in `pending` (at most 3 bytes) until its last byte arrives; finish() turns an
// unfinished character at the end of the stream into U+FFFD.
struct Utf8Repair {
  unsigned char pending[4];
  int npending = 0, need = 0;  // bytes held, and the full length of the character they start
  void feed(const char* bytes, size_t n, std::string& out) {
    for (size_t i = 0; i < n; i++) {
      unsigned b = (unsigned char)bytes[i];
      if (npending) {
        unsigned lo = 0x80, hi = 0xBF, lead = pending[0];
        if (npending == 1) {
          if (lead == 0xE0) lo = 0xA0;
          if (lead == 0xED) hi = 0x9F;
          if (lead == 0xF0) lo = 0x90;
          if (lead == 0xF4) hi = 0x8F;
        }
        if (b >= lo && b <= hi) {
          pending[npending++] = (unsigned char)b;
          if (npending == need) out.append((const char*)pending, need), npending = 0;
          continue;
        }
        out += "\xEF\xBF\xBD";  // the held bytes can never complete: one U+FFFD, then look at b afresh
        npending = 0;
      }
      if (b < 0x80)
        out += (char)b;
      else if (b >= 0xC2 && b <= 0xF4)
        pending[0] = (unsigned char)b, npending = 1, need = b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
      else
        out += "\xEF\xBF\xBD";
    }
  }
  void finish(std::string& out) {
    if (npending) out += "\xEF\xBF\xBD";
    npending = 0;
  }
};

// ==== T3. Unicode tables: regex classes and the NFC quick check =========================================
//
// One byte per code point (1.1 MB, built once from utf8proc): the class the split regex sees, whether it
// is \r or \n, and whether NFC could change the text around it. Text with no NFC_CHECK code point is
// already NFC and is used as it is, which is almost all text.

enum : uint8_t {
  CP_OTHER = 0,         // none of \p{L}, \p{N}, \s
  CP_LETTER = 1,        // \p{L}: Lu Ll Lt Lm Lo
  CP_NUMBER = 2,        // \p{N}: Nd Nl No
  CP_SPACE = 3,         // \s: the White_Space property
  CP_CLASS = 3,         // mask of the class bits above
  CP_NEWLINE = 4,       // \r or \n
  CP_NFC_CHECK = 8,     // NFC may change the text here: a mark, a non-NFC character, a composition's 2nd part
  CP_NFC_BARRIER = 16,  // unknown to HF's NFC tables (kNfcUnknownToHF): normalize each side on its own
};

struct CodepointRange {
  uint32_t first, last;
};

// Letters (Unicode 15.1 and 16.0) that utf8proc 2.8 calls unassigned but the split regex treats as \p{L}.
static const CodepointRange kRegexUnicode16Letters[] = {
    {0x1C89, 0x1C8A},   {0xA7CB, 0xA7CD},   {0xA7DA, 0xA7DC},   {0x105C0, 0x105F3}, {0x10D4A, 0x10D65},
    {0x10D6F, 0x10D85}, {0x10EC2, 0x10EC4}, {0x11380, 0x11389}, {0x1138B, 0x1138B}, {0x1138E, 0x1138E},
    {0x11390, 0x113B5}, {0x113B7, 0x113B7}, {0x113D1, 0x113D1}, {0x113D3, 0x113D3}, {0x11BC0, 0x11BE0},
    {0x13460, 0x143FA}, {0x16100, 0x1611D}, {0x16D40, 0x16D6C}, {0x18CFF, 0x18CFF}, {0x1E5D0, 0x1E5ED},
    {0x1E5F0, 0x1E5F0}, {0x2EBF0, 0x2EE5D}};
// ... and the digits of Unicode 16.0 (\p{N}).
static const CodepointRange kRegexUnicode16Numbers[] = {
    {0x10D40, 0x10D49}, {0x116D0, 0x116E3}, {0x11BF0, 0x11BF9}, {0x16130, 0x16139},
    {0x16D70, 0x16D79}, {0x1CCF0, 0x1CCF9}, {0x1E5F1, 0x1E5FA}};
// Combining marks added after HF's normalization tables were made (plus U+11930 and U+11938, whose
// composition U+11935 U+11930 -> U+11938 it does not know): to HF they are inert starters.
static const CodepointRange kNfcUnknownToHF[] = {
    {0x7FD, 0x7FD},     {0x898, 0x89F},     {0x8CA, 0x8D3},     {0x9FE, 0x9FE},     {0xC3C, 0xC3C},
    {0xD3B, 0xD3C},     {0xEBA, 0xEBA},     {0x1715, 0x1715},   {0x1ABF, 0x1ACE},   {0x1DF6, 0x1DFA},
    {0xA82C, 0xA82C},   {0x10D24, 0x10D27}, {0x10EAB, 0x10EAC}, {0x10EFD, 0x10EFF}, {0x10F46, 0x10F50},
    {0x10F82, 0x10F85}, {0x11070, 0x11070}, {0x1133B, 0x1133B}, {0x1145E, 0x1145E}, {0x11839, 0x1183A},
    {0x11930, 0x11930}, {0x11938, 0x11938}, {0x1193D, 0x1193E}, {0x11943, 0x11943}, {0x119E0, 0x119E0},
    {0x11A34, 0x11A34}, {0x11A47, 0x11A47}, {0x11A99, 0x11A99}, {0x11D42, 0x11D42}, {0x11D44, 0x11D45},
    {0x11D97, 0x11D97}, {0x11F41, 0x11F42}, {0x16FF0, 0x16FF1}, {0x1E08F, 0x1E08F}, {0x1E130, 0x1E136},
    {0x1E2AE, 0x1E2AE}, {0x1E2EC, 0x1E2EF}, {0x1E4EC, 0x1E4EF}};

static const uint8_t* unicode_table() {
  static std::vector<uint8_t> table;
  if (!table.empty()) return table.data();
  table.assign(0x110000, CP_OTHER);
  for (uint32_t cp = 0; cp < 0x110000; cp++) {
    const utf8proc_property_t* p = utf8proc_get_property((utf8proc_int32_t)cp);
    uint8_t k = CP_OTHER;
    if (p->category >= UTF8PROC_CATEGORY_LU && p->category <= UTF8PROC_CATEGORY_LO) k = CP_LETTER;
    if (p->category >= UTF8PROC_CATEGORY_ND && p->category <= UTF8PROC_CATEGORY_NO) k = CP_NUMBER;
    if (p->combining_class != 0) k |= CP_NFC_CHECK;
    if (p->decomp_seqindex != UINT16_MAX && !(cp >= 0xD800 && cp <= 0xDFFF)) {
      // A canonical decomposition: its later parts can compose with what precedes them, and the code
      // point itself may not survive NFC (singletons such as U+212B, exclusions such as U+0958).
      utf8proc_int32_t parts[8];
      int last_boundclass = 0;
      utf8proc_ssize_t n =
          utf8proc_decompose_char((utf8proc_int32_t)cp, parts, 8, UTF8PROC_DECOMPOSE, &last_boundclass);
      if (n > 1 || (n == 1 && (uint32_t)parts[0] != cp)) {
        for (utf8proc_ssize_t j = 1; j < n && j < 8; j++) table[parts[j]] |= CP_NFC_CHECK;
        uint8_t in[4], *out = nullptr;
        utf8proc_ssize_t len = utf8proc_encode_char((utf8proc_int32_t)cp, in);
        utf8proc_ssize_t m =
            utf8proc_map(in, len, &out, (utf8proc_option_t)(UTF8PROC_COMPOSE | UTF8PROC_STABLE));
        if (m != len || memcmp(in, out, len) != 0) k |= CP_NFC_CHECK;
        free(out);
      }
    }
    table[cp] |= k;
  }
  for (uint32_t cp = 0x1161; cp <= 0x1175; cp++) table[cp] |= CP_NFC_CHECK;  // Hangul V: L+V -> LV
  for (uint32_t cp = 0x11A8; cp <= 0x11C2; cp++) table[cp] |= CP_NFC_CHECK;  // Hangul T: LV+T -> LVT
  const uint32_t spaces[] = {0x9,  0xA,    0xB,    0xC,    0xD,    0x20,   0x85,
                             0xA0, 0x1680, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000};
  for (uint32_t cp : spaces) table[cp] = (table[cp] & ~CP_CLASS) | CP_SPACE;
  for (uint32_t cp = 0x2000; cp <= 0x200A; cp++) table[cp] = (table[cp] & ~CP_CLASS) | CP_SPACE;
  table['\r'] |= CP_NEWLINE;
  table['\n'] |= CP_NEWLINE;
  for (auto r : kRegexUnicode16Letters)
    for (uint32_t cp = r.first; cp <= r.last; cp++) table[cp] = (table[cp] & ~CP_CLASS) | CP_LETTER;
  for (auto r : kRegexUnicode16Numbers)
    for (uint32_t cp = r.first; cp <= r.last; cp++) table[cp] = (table[cp] & ~CP_CLASS) | CP_NUMBER;
  for (auto r : kNfcUnknownToHF)
    for (uint32_t cp = r.first; cp <= r.last; cp++) table[cp] |= CP_NFC_CHECK | CP_NFC_BARRIER;
  return table.data();
}

// utf8proc's NFC of text[a, b), appended to out. Code points that HF's tables do not know (barriers) are
// copied through and each side is normalized on its own, which is what an inert starter amounts to.
static void nfc_region(const unsigned char* s, size_t a, size_t b, std::string& out) {
  const uint8_t* table = unicode_table();
  auto map = [&](size_t x, size_t y) {
    if (x == y) return;
    uint8_t* mapped = nullptr;
    utf8proc_ssize_t m = utf8proc_map(s + x, (utf8proc_ssize_t)(y - x), &mapped,
                                      (utf8proc_option_t)(UTF8PROC_COMPOSE | UTF8PROC_STABLE));
    if (m < 0) tok_die("NFC normalization failed: %s", utf8proc_errmsg(m));
    out.append((const char*)mapped, m);
    free(mapped);
  };
  size_t start = a;
  for (size_t i = a; i < b;) {
    int len;
    uint8_t k = table[utf8_next(s, i, &len)];
    if (k & CP_NFC_BARRIER) map(start, i), out.append((const char*)s + i, len), start = i + len;
    i += len;
  }
  map(start, b);
}

// NFC of valid UTF-8 text into out. Returns false (out untouched) when the quick check finds nothing to
// do, so the caller keeps the original bytes: the common case. Otherwise only the regions around flagged
// code points go through utf8proc: a region starts at the last unflagged character before them (a mark
// may compose with it) and ends at the next unflagged one. An unflagged character is a starter that
// nothing before it can combine with, so NFC never reaches across it.
static bool nfc_normalize(const char* text, size_t n, std::string& out) {
  const uint8_t* table = unicode_table();
  const unsigned char* s = (const unsigned char*)text;
  size_t done = 0, last_safe = 0;  // text[0, done) is in out; last_safe starts an unflagged character
  bool any = false;
  for (size_t i = 0; i < n;) {
    if (s[i] < 0x80) {
      last_safe = i++;
      continue;
    }
    int len;
    if (!(table[utf8_next(s, i, &len)] & CP_NFC_CHECK)) {
      last_safe = i;
      i += len;
      continue;
    }
    size_t start = std::max(last_safe, done), end = i + len;
    while (end < n && (table[utf8_next(s, end, &len)] & CP_NFC_CHECK)) end += len;
    if (!any) out.reserve(n + 16), any = true;
    out.append(text + done, start - done);
    nfc_region(s, start, end, out);
    done = i = end;
  }
  if (!any) return false;
  out.append(text + done, n - done);
  return true;
}

// ==== T4. Pre-tokenizer: the Qwen2 split regex, by hand ==================================================
//
// The regex's alternatives are tried in order at each position and the first that matches wins (leftmost
// first, not longest). Every character matches some alternative, so the pieces tile the text. Per
// alternative, where the cursor is at code point c0:
//   A1 (?i:'s|'t|'re|'ve|'m|'ll|'d)  c0 is ' and a contraction follows, case-insensitively (ſ folds to s)
//   A2 [^\r\n\p{L}\p{N}]?\p{L}+      a run of letters, with one optional non-letter/number/newline before
//   A3 \p{N}                         exactly one number character: "2024" is four pieces
//   A4  ?[^\s\p{L}\p{N}]+[\r\n]*     punctuation/symbols, an optional space before, newlines after
//   A5 \s*[\r\n]+                    whitespace up to and including its last newline
//   A6 \s+(?!\S)                     whitespace not followed by a non-space: the run minus its last
//                                    character (that one joins the next word via A2/A4), or all of it at
//                                    the end of the text
//   A7 \s+                           the rest: a single whitespace character before a non-space
// `emit(begin, end)` receives byte offsets of each piece in order.

static inline size_t contraction_end(const unsigned char* s, size_t n, size_t i) {
  // s[i] is the byte after the apostrophe. Returns the end of the contraction, or 0.
  auto lower = [&](size_t j) -> int {  // ASCII letter folded to lower case, 's' for U+017F, else 0
    if (j >= n) return 0;
    unsigned c = s[j];
    if (c >= 'A' && c <= 'Z') return c + 32;
    if (c >= 'a' && c <= 'z') return c;
    if (c == 0xC5 && j + 1 < n && s[j + 1] == 0xBF) return 'S';  // ſ, two bytes: marked with 'S'
    return 0;
  };
  int c1 = lower(i);
  if (c1 == 'S') return i + 2;
  if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return i + 1;
  int c2 = lower(i + 1);
  if ((c1 == 'r' || c1 == 'v') && c2 == 'e') return i + 2;
  if (c1 == 'l' && c2 == 'l') return i + 2;
  return 0;
}

template <class Emit>
static void pretokenize(const char* text, size_t n, Emit&& emit) {
  const uint8_t* table = unicode_table();
  const unsigned char* s = (const unsigned char*)text;
  auto class_at = [&](size_t j, int* len) -> uint8_t {
    if (s[j] < 0x80) {
      *len = 1;
      return table[s[j]];
    }
    return table[utf8_next(s, j, len)];
  };
  auto run_end = [&](size_t j, uint8_t cls) {  // end of the run of class `cls` starting at j
    int len;
    while (j < n && (class_at(j, &len) & CP_CLASS) == cls) j += len;
    return j;
  };
  size_t i = 0;
  while (i < n) {
    int l0, l1 = 0;
    uint8_t k0 = class_at(i, &l0), c0 = k0 & CP_CLASS;
    uint8_t c1 = i + l0 < n ? (class_at(i + l0, &l1) & CP_CLASS) : 0xFF;  // 0xFF: end of text
    size_t end = 0;
    if (s[i] == '\'') end = contraction_end(s, n, i + 1);  // A1
    if (end) {
    } else if (c0 == CP_LETTER) {  // A2 without the optional character
      end = run_end(i + l0, CP_LETTER);
    } else if (c1 == CP_LETTER && c0 != CP_NUMBER && !(k0 & CP_NEWLINE)) {  // A2 with it
      end = run_end(i + l0 + l1, CP_LETTER);
    } else if (c0 == CP_NUMBER) {  // A3
      end = i + l0;
    } else if (c0 == CP_OTHER || (s[i] == ' ' && c1 == CP_OTHER)) {  // A4
      end = run_end(c0 == CP_OTHER ? i + l0 : i + 1, CP_OTHER);
      while (end < n && (s[end] == '\r' || s[end] == '\n')) end++;
    } else {  // whitespace: A5, A6 or A7
      size_t j = i, last_start = i, newline_end = 0;
      int len;
      uint8_t k;
      while (j < n && ((k = class_at(j, &len)) & CP_CLASS) == CP_SPACE) {
        last_start = j;
        if (k & CP_NEWLINE) newline_end = j + len;
        j += len;
      }
      // A5 up to the last newline; else A6: all of it at the end of the text, or all but the last
      // character (it joins the next piece); else A7: the single whitespace character.
      end = newline_end ? newline_end : j == n ? n : last_start > i ? last_start : j;
    }
    emit(i, end);
    i = end;
  }
}

// ==== T5. Byte-level BPE =================================================================================
//
// A piece starts as one token per byte. Repeatedly the adjacent pair with the lowest merge rank (the line
// number in tokenizer.json's "merges"; the leftmost pair on a tie) is replaced by the merged token, until
// no adjacent pair has a merge. Hugging Face does exactly this with a heap; for the short pieces that are
// almost all of real text a flat array scan is faster, and long pieces (long words, runs of symbols) use
// a heap and a linked list so they stay O(n log n). The two give identical results (tested).

// (left id, right id) -> (rank, merged id): open addressing with linear probing.
struct MergeTable {
  struct Slot {
    uint64_t key;  // left << 32 | right; EMPTY when unused
    uint32_t rank;
    int32_t merged;
  };
  static constexpr uint64_t EMPTY = ~0ull;
  std::vector<Slot> slots;
  uint64_t mask = 0;
  void init(size_t n_merges) {
    size_t cap = 1;
    while (cap < n_merges * 3) cap <<= 1;  // load factor <= 1/3: most lookups are misses
    slots.assign(cap, Slot{EMPTY, 0, 0});
    mask = cap - 1;
  }
  static uint64_t hash(uint64_t key) { return (key * 0x9E3779B97F4A7C15ull) >> 20; }
  // A pair listed twice keeps its last rank, as in HF (its merges go into a HashMap in file order).
  void insert(int left, int right, uint32_t rank, int merged) {
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    for (uint64_t h = hash(key) & mask;; h = (h + 1) & mask) {
      if (slots[h].key == key || slots[h].key == EMPTY) {
        slots[h] = Slot{key, rank, merged};
        return;
      }
    }
  }
  const Slot* find(int left, int right) const {
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    for (uint64_t h = hash(key) & mask;; h = (h + 1) & mask) {
      if (slots[h].key == key) return &slots[h];
      if (slots[h].key == EMPTY) return nullptr;
    }
  }
};

static constexpr uint32_t NO_MERGE = ~0u;

// Short pieces: ids[0..m) and rank[i] of the pair (ids[i], ids[i+1]); each merge scans for the minimum.
static int bpe_merge_small(const MergeTable& merges, int* ids, int m) {
  uint32_t rank[64];
  int merged[64];
  auto look = [&](int i) {
    const MergeTable::Slot* e = merges.find(ids[i], ids[i + 1]);
    rank[i] = e ? e->rank : NO_MERGE;
    merged[i] = e ? e->merged : -1;
  };
  for (int i = 0; i + 1 < m; i++) look(i);
  while (m > 1) {
    int best = -1;
    uint32_t best_rank = NO_MERGE;
    for (int i = 0; i + 1 < m; i++)
      if (rank[i] < best_rank) best_rank = rank[i], best = i;
    if (best < 0) break;
    ids[best] = merged[best];
    // Drop ids[best + 1] and the pair that started there; the pairs on either side of `best` change.
    memmove(ids + best + 1, ids + best + 2, (m - best - 2) * sizeof(int));
    memmove(rank + best + 1, rank + best + 2, (m - best - 2) * sizeof(uint32_t));
    memmove(merged + best + 1, merged + best + 2, (m - best - 2) * sizeof(int));
    m--;
    if (best + 1 < m) look(best);
    if (best > 0) look(best - 1);
  }
  return m;
}

// Long pieces: a doubly linked list of symbols and a min-heap of candidate merges ordered by (rank,
// position). A popped candidate is stale when its left symbol was merged away or its right neighbour
// changed; then it is skipped (Hugging Face's word.rs merge_all works the same way).
static int bpe_merge_large(const MergeTable& merges, int* ids, int m) {
  struct Cand {
    uint32_t rank;
    int pos;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::vector<int> prev(m), next(m);
  std::vector<char> alive(m, 1);
  std::vector<Cand> heap;
  auto push = [&](int i) {
    if (i < 0 || next[i] >= m) return;
    const MergeTable::Slot* e = merges.find(ids[i], ids[next[i]]);
    if (e) heap.push_back({e->rank, i}), std::push_heap(heap.begin(), heap.end(), std::greater<Cand>());
  };
  for (int i = 0; i < m; i++) prev[i] = i - 1, next[i] = i + 1;
  for (int i = 0; i + 1 < m; i++) push(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<Cand>());
    Cand c = heap.back();
    heap.pop_back();
    int r = next[c.pos];
    if (!alive[c.pos] || r >= m) continue;
    const MergeTable::Slot* e = merges.find(ids[c.pos], ids[r]);
    if (!e || e->rank != c.rank) continue;  // stale: the pair at c.pos is no longer this one
    ids[c.pos] = e->merged;
    alive[r] = 0;
    next[c.pos] = next[r];
    if (next[r] < m) prev[next[r]] = c.pos;
    push(prev[c.pos]);
    push(c.pos);
  }
  int out = 0;
  for (int i = 0; i < m; i = next[i]) ids[out++] = ids[i];
  return out;
}

// ==== T6. Tokenizer ======================================================================================

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

struct Tokenizer {
  // --- API -----------------------------------------------------------------------------------------------
  // `path` is a model folder (tokenizer.json, tokenizer_config.json if present) or a tokenizer.json.
  static Tokenizer load(const std::string& path, bool plain_reader = false);  // plain_reader: tests only
  std::vector<int> encode(const std::string& text) const;     // dies on invalid UTF-8; not thread-safe
  std::string decode(const std::vector<int>& ids) const;      // ids without a token are skipped, as in HF
  int vocab_size() const { return (int)id_to_bytes.size(); }  // 151,669 for Qwen3 (added tokens included)
  int token_to_id(const std::string& token) const;            // "<|im_end|>" -> 151645; -1 when absent
  std::string apply_chat_template(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                                  bool enable_thinking) const;  // section T7
  int eos_token_id = -1;  // tokenizer_config.json's eos_token ("<|im_end|>" for Qwen3), -1 when absent

  // --- state ---------------------------------------------------------------------------------------------
  struct AddedToken {
    std::string content;
    int id;
  };
  std::string path;                                  // for messages
  std::vector<std::string> id_to_bytes;              // [vocab_size] raw bytes of each token
  std::unordered_map<std::string, int> bytes_to_id;  // BPE vocabulary (added tokens not included)
  std::vector<AddedToken> added;                     // longest first, so the first match is the longest
  bool starts_added[256] = {};                       // first bytes of added tokens: where to look
  int byte_id[256];                                  // the one-byte token of each byte
  MergeTable merges;
  bool chat_template_is_qwen3 = true;  // false when tokenizer_config.json carries another template
  bool has_config = false;

  // Cache of recent pieces -> ids, direct-mapped: a piece's hash picks one slot, a new piece overwrites
  // it. Natural text repeats a few thousand pieces ("Ġthe", "ing", ...), so most pieces skip BPE.
  struct CacheSlot {
    uint64_t hash;
    uint8_t len, nids;
    char piece[30];
    int32_t ids[16];
  };
  static constexpr int CACHE_SLOTS = 1 << 15;
  mutable std::vector<CacheSlot> cache;

  bool build(const std::string& file, const std::string& dir, const struct TokenizerTables& tables, bool fast);
  void encode_piece(const char* p, size_t n, std::vector<int>& out) const;
  void encode_segment(const char* p, size_t n, std::vector<int>& out) const;
};

// GPT-2's byte-level alphabet: the 188 printable bytes stand for themselves (as Latin-1 code points), the
// other 68 (controls, space, 0x7F-0xA0, 0xAD) for U+0100.. in byte order. So the space byte is "Ġ" U+0120.
static void byte_level_alphabet(uint32_t byte_to_cp[256]) {
  int extra = 0;
  for (int b = 0; b < 256; b++) {
    bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    byte_to_cp[b] = printable ? (uint32_t)b : 256u + extra++;
  }
}

static uint64_t fnv1a64(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// tokenizer.json's two large tables, model.vocab (151,643 spellings -> ids) and model.merges (151,387 pairs),
// are almost all of its 11 MB. Read as one nlohmann::json document, they become some 450,000 small objects,
// a sorted map among them, built and then freed: most of the load. So load() first tries a small reader
// made for exactly these two tables (read_tables_fast): it walks the file's structure, reads the two tables
// straight into vectors, and hands nlohmann::json the rest with the tables emptied (a few KB). It gives up
// on anything it does not expect (a malformed or out-of-range entry, an empty or repeated table, a number
// that is not a plain integer, invalid UTF-8); read_tables_plain then reads the whole file as one document
// and says what is wrong. Both give the same tables for any file the fast one accepts (test_tokenizer
// checks on the real tokenizer and on edge cases).
struct TokenizerTables {
  nlohmann::json doc;  // the file (read_tables_fast: with model.vocab and model.merges emptied)
  std::vector<std::pair<std::string, int>> vocab;  // (spelling, id)
  struct Merge {
    std::string left, right;  // the two spellings
    bool pair;                // written ["a", "b"] (else "a b")
  };
  std::vector<Merge> merges;  // in rank order
};

// A cursor over JSON text that reads strings and plain integers, and skips any other value.
struct JsonCursor {
  const char* p;
  const char* end;
  void ws() {
    while (p < end && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t')) p++;
  }
  bool take(char c) {
    ws();
    if (p < end && *p == c) return p++, true;
    return false;
  }
  bool hex4(uint32_t* v) {
    if (end - p < 4) return false;
    *v = 0;
    for (int i = 0; i < 4; i++) {
      char c = *p++;
      int d = c >= '0' && c <= '9'   ? c - '0'
              : c >= 'a' && c <= 'f' ? c - 'a' + 10
              : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                     : -1;
      if (d < 0) return false;
      *v = *v << 4 | d;
    }
    return true;
  }
  // A string (RFC 8259: escapes, \uXXXX with surrogate pairs, no raw control characters), as UTF-8.
  bool string(std::string* out) {
    if (!take('"')) return false;
    out->clear();
    const char* run = p;  // bytes copied as they are, flushed at each escape
    while (p < end) {
      unsigned char c = *p;
      if (c == '"') {
        out->append(run, p++ - run);
        return utf8_invalid_at(out->data(), out->size()) == out->size();
      }
      if (c < 0x20) return false;
      if (c != '\\') {
        p++;
        continue;
      }
      out->append(run, p - run);
      if (++p >= end) return false;
      char e = *p++;
      uint32_t cp;
      switch (e) {
        case '"': case '\\': case '/': *out += e; break;
        case 'b': *out += '\b'; break;
        case 'f': *out += '\f'; break;
        case 'n': *out += '\n'; break;
        case 'r': *out += '\r'; break;
        case 't': *out += '\t'; break;
        case 'u':
          if (!hex4(&cp)) return false;
          if (cp >= 0xDC00 && cp <= 0xDFFF) return false;  // a low surrogate alone
          if (cp >= 0xD800 && cp <= 0xDBFF) {                // a high one: its low one must follow
            uint32_t lo;
            if (end - p < 2 || p[0] != '\\' || p[1] != 'u') return false;
            p += 2;
            if (!hex4(&lo) || lo < 0xDC00 || lo > 0xDFFF) return false;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          utf8_append(*out, cp);
          break;
        default: return false;
      }
      run = p;
    }
    return false;
  }
  // An integer in [0, 2^24) written plainly (no sign, fraction or exponent).
  bool token_id(int* v) {
    ws();
    const char* b = p;
    long long x = 0;
    while (p < end && *p >= '0' && *p <= '9' && p - b < 9) x = x * 10 + (*p++ - '0');
    if (p == b || (p - b > 1 && *b == '0') || x >= (1 << 24)) return false;
    if (p < end && (*p == '.' || *p == 'e' || *p == 'E' || (*p >= '0' && *p <= '9'))) return false;
    *v = (int)x;
    return true;
  }
  // Any value, unread (its strings are still checked, so a string cannot hide a structural character).
  bool skip(int depth = 0) {
    ws();
    if (p >= end || depth > 256) return false;
    std::string scratch;
    if (*p == '"') return string(&scratch);
    if (*p == '{' || *p == '[') {
      const char close = *p++ == '{' ? '}' : ']';
      if (take(close)) return true;
      do {
        if (close == '}' && !(string(&scratch) && take(':'))) return false;
        if (!skip(depth + 1)) return false;
      } while (take(','));
      return take(close);
    }
    const char* b = p;  // a number or true / false / null: nlohmann::json checks it later
    while (p < end && (isalnum((unsigned char)*p) || *p == '-' || *p == '+' || *p == '.')) p++;
    return p > b;
  }
};

static bool read_tables_fast(const std::string& text, TokenizerTables* out) {
  JsonCursor c{text.data(), text.data() + text.size()};
  std::string key;
  size_t vocab_at[2] = {0, 0}, merges_at[2] = {0, 0};  // byte ranges of the two tables' values
  auto read_vocab = [&]() {
    if (!c.take('{') || c.take('}')) return false;
    std::pair<std::string, int> e;
    do {
      if (!c.string(&e.first) || !c.take(':') || !c.token_id(&e.second)) return false;
      out->vocab.push_back(e);
    } while (c.take(','));
    return c.take('}');
  };
  auto read_merges = [&]() {
    if (!c.take('[')) return false;
    if (c.take(']')) return true;
    TokenizerTables::Merge m;
    std::string both;
    do {
      c.ws();
      if (c.p < c.end && *c.p == '[') {
        c.p++;
        if (!c.string(&m.left) || !c.take(',') || !c.string(&m.right) || !c.take(']')) return false;
        m.pair = true;
      } else {
        if (!c.string(&both)) return false;
        const size_t sp = both.find(' ', 1);
        if (sp == std::string::npos) return false;
        m.left.assign(both, 0, sp);
        m.right.assign(both, sp + 1, std::string::npos);
        m.pair = false;
      }
      out->merges.push_back(m);
    } while (c.take(','));
    return c.take(']');
  };
  if (!c.take('{')) return false;
  bool in_model = false, model_seen = false;
  if (c.take('}')) return false;
  do {
    if (!c.string(&key) || !c.take(':')) return false;
    if (key != "model") {
      if (!c.skip()) return false;
      continue;
    }
    if (model_seen || !c.take('{') || c.take('}')) return false;
    model_seen = in_model = true;
    do {
      if (!c.string(&key) || !c.take(':')) return false;
      c.ws();
      const size_t begin = c.p - text.data();
      if (key == "vocab" || key == "merges") {
        size_t* at = key == "vocab" ? vocab_at : merges_at;
        if (at[1] != 0) return false;  // the same table twice
        if (!(key == "vocab" ? read_vocab() : read_merges())) return false;
        at[0] = begin;
        at[1] = c.p - text.data();
      } else if (!c.skip()) {
        return false;
      }
    } while (c.take(','));
    if (!c.take('}')) return false;
    in_model = false;
  } while (c.take(','));
  if (!c.take('}') || in_model || vocab_at[1] == 0 || merges_at[1] == 0) return false;
  c.ws();
  if (c.p != c.end) return false;
  // The rest of the file, the tables emptied, for the checks that follow.
  const bool vocab_first = vocab_at[0] < merges_at[0];
  const size_t* a = vocab_first ? vocab_at : merges_at;
  const size_t* b = vocab_first ? merges_at : vocab_at;
  std::string rest;
  rest.reserve(a[0] + (b[0] - a[1]) + (text.size() - b[1]) + 4);
  rest.append(text, 0, a[0]).append(vocab_first ? "{}" : "[]");
  rest.append(text, a[1], b[0] - a[1]).append(vocab_first ? "[]" : "{}");
  rest.append(text, b[1], std::string::npos);
  try {
    out->doc = nlohmann::json::parse(rest);
  } catch (const nlohmann::json::exception&) {
    return false;
  }
  return true;
}

// The whole file as one document; every malformed entry of the tables is reported here.
static void read_tables_plain(const std::string& text, const char* f, TokenizerTables* out) {
  using nlohmann::json;
  try {
    out->doc = json::parse(text);
  } catch (const json::exception& e) {
    tok_die("%s is not valid JSON (%s); is the file complete?", f, e.what());
  }
  const json& j = out->doc;
  // What is missing or is not a BPE model, build() says.
  if (!j.is_object() || !j.contains("model") || !j["model"].is_object() || j["model"].value("type", "") != "BPE")
    return;
  const json& model = j["model"];
  if (model.contains("vocab")) {
    const json& vocab = model["vocab"];
    if (!vocab.is_object() || vocab.empty()) tok_die("%s: model.vocab is not a non-empty object", f);
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      const json& v = it.value();
      if (!v.is_number_integer() || v.get<long long>() < 0 || v.get<long long>() >= (1 << 24))
        tok_die("%s: model.vocab['%s'] is %s, not a token id in [0, 2^24)", f, it.key().c_str(),
                v.dump().c_str());
      out->vocab.push_back({it.key(), v.get<int>()});
    }
  }
  if (model.contains("merges")) {
    const json& merges = model["merges"];
    if (!merges.is_array()) tok_die("%s: model.merges is not an array", f);
    for (size_t r = 0; r < merges.size(); r++) {
      const json& m = merges[r];
      if (m.is_string()) {
        const std::string& s = m.get_ref<const std::string&>();
        size_t sp = s.find(' ', 1);
        if (sp == std::string::npos) tok_die("%s: merges[%zu] = '%s' is not two tokens 'a b'", f, r, s.c_str());
        out->merges.push_back({s.substr(0, sp), s.substr(sp + 1), false});
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        out->merges.push_back({m[0].get<std::string>(), m[1].get<std::string>(), true});
      } else {
        tok_die("%s: merges[%zu] is %s; expected \"a b\" or [\"a\", \"b\"]", f, r, m.dump().c_str());
      }
    }
  }
}

static bool read_file_to(const std::string& p, std::string* out) {
  FILE* f = fopen(p.c_str(), "rb");
  if (!f) return false;
  struct stat st;
  if (fstat(fileno(f), &st) == 0 && st.st_size > 0) out->reserve(st.st_size);
  char buf[1 << 16];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) out->append(buf, n);
  fclose(f);
  return true;
}

inline Tokenizer Tokenizer::load(const std::string& path_arg, bool plain_reader) {
  auto is_dir = [](const std::string& p) {
    struct stat st;
    return stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
  };
  std::string dir = path_arg, file = path_arg;
  if (is_dir(path_arg))
    file = path_arg + "/tokenizer.json";
  else
    dir = path_arg.find('/') == std::string::npos ? "." : path_arg.substr(0, path_arg.rfind('/'));
  std::string text;
  if (!read_file_to(file, &text))
    tok_die(
        "cannot read the tokenizer '%s': %s\n  expected a model folder with tokenizer.json, or the path of "
        "a tokenizer.json",
        file.c_str(), strerror(errno));
  Tokenizer t;
  TokenizerTables tables;
  if (!plain_reader && read_tables_fast(text, &tables) && t.build(file, dir, tables, true)) return t;
  t = Tokenizer();
  tables = TokenizerTables();
  read_tables_plain(text, file.c_str(), &tables);
  t.build(file, dir, tables, false);
  return t;
}

// The tables and the rest of the file -> the tokenizer. `fast`: the tables came from read_tables_fast, and
// a vocabulary that repeats a spelling or an id returns false (the plain reader's order decides those).
inline bool Tokenizer::build(const std::string& file, const std::string& dir, const TokenizerTables& tables,
                             bool fast) {
  using nlohmann::json;
  Tokenizer& t = *this;
  t.path = file;
  const json& j = tables.doc;
  const char* f = file.c_str();
  auto need = [&](const json& parent, const char* key, const char* where) -> const json& {
    if (!parent.is_object() || !parent.contains(key))
      tok_die("%s: '%s' is missing from %s; is this a Hugging Face tokenizer.json?", f, key, where);
    return parent[key];
  };
  // Check every part of the pipeline: anything but the Qwen2 recipe would silently give other ids.
  const json& model = need(j, "model", "the top level");
  std::string type = need(model, "type", "model").is_string() ? model["type"].get<std::string>() : "?";
  if (type != "BPE")
    tok_die("%s: model.type is '%s'; only byte-level BPE (Qwen2/Qwen3) is supported", f, type.c_str());
  for (const char* key : {"byte_fallback", "ignore_merges"})
    if (model.contains(key) && model[key].is_boolean() && model[key].get<bool>())
      tok_die("%s: model.%s is true; the Qwen2/Qwen3 tokenizer has it false and so does nanovllm", f, key);
  if (model.contains("dropout") && !model["dropout"].is_null())
    tok_die("%s: model.dropout is set; nanovllm only does deterministic BPE", f);
  const json& norm = need(j, "normalizer", "the top level");
  if (!(norm.is_object() && norm.value("type", "") == "NFC"))
    tok_die("%s: the normalizer is %s; the Qwen2/Qwen3 tokenizer uses {\"type\": \"NFC\"}", f,
            norm.dump().c_str());
  const char* kRegex =
      "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
      "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
  const json& pre = need(j, "pre_tokenizer", "the top level");
  bool pre_ok = pre.is_object() && pre.value("type", "") == "Sequence" && pre.contains("pretokenizers") &&
                pre["pretokenizers"].is_array() && pre["pretokenizers"].size() == 2;
  if (pre_ok) {
    const json& split = pre["pretokenizers"][0];
    const json& bl = pre["pretokenizers"][1];
    pre_ok = split.value("type", "") == "Split" && split.contains("pattern") &&
             split["pattern"].is_object() && split["pattern"].value("Regex", "") == kRegex &&
             split.value("behavior", "") == "Isolated" && !split.value("invert", false) &&
             bl.value("type", "") == "ByteLevel" && !bl.value("add_prefix_space", true) &&
             !bl.value("use_regex", true);
  }
  if (!pre_ok)
    tok_die(
        "%s: the pre_tokenizer is not Qwen2's (a Split on the regex %s, Isolated, then ByteLevel without "
        "prefix space or regex); found %.300s",
        f, kRegex, pre.dump().c_str());
  const json& dec = need(j, "decoder", "the top level");
  if (!(dec.is_object() && dec.value("type", "") == "ByteLevel"))
    tok_die("%s: the decoder is %.200s; expected ByteLevel", f, dec.dump().c_str());

  // Vocabulary: byte-level spellings -> raw bytes.
  uint32_t byte_to_cp[256];
  byte_level_alphabet(byte_to_cp);
  int cp_to_byte[0x144];
  for (int& b : cp_to_byte) b = -1;
  for (int b = 0; b < 256; b++) cp_to_byte[byte_to_cp[b]] = b;
  auto spelling_to_bytes = [&](const char* s, size_t n, std::string* out) {
    out->clear();
    const unsigned char* p = (const unsigned char*)s;
    if (utf8_invalid_at(s, n) != n) return false;
    for (size_t i = 0; i < n;) {
      int len;
      uint32_t cp = utf8_next(p, i, &len);
      if (cp >= 0x144 || cp_to_byte[cp] < 0) return false;
      *out += (char)cp_to_byte[cp];
      i += len;
    }
    return !out->empty();
  };
  need(model, "vocab", "model");
  const json& added_json = need(j, "added_tokens", "the top level");
  need(model, "merges", "model");
  t.id_to_bytes.reserve(tables.vocab.size() + 64);
  t.bytes_to_id.reserve(tables.vocab.size() * 2);
  std::string bytes;
  for (const auto& [spelling, id] : tables.vocab) {
    if (!spelling_to_bytes(spelling.data(), spelling.size(), &bytes))
      tok_die(
          "%s: vocab entry '%s' is not spelled in the byte-level alphabet: not a byte-level BPE vocabulary",
          f, spelling.c_str());
    if (id >= (int)t.id_to_bytes.size()) t.id_to_bytes.resize(id + 1);
    if (fast && !t.id_to_bytes[id].empty()) return false;  // an id spelled twice
    t.id_to_bytes[id] = bytes;
    if (!t.bytes_to_id.emplace(bytes, id).second) {
      if (fast) return false;  // a spelling listed twice
      t.bytes_to_id[bytes] = id;
    }
  }
  for (int b = 0; b < 256; b++) {
    auto it = t.bytes_to_id.find(std::string(1, (char)b));
    if (it == t.bytes_to_id.end()) tok_die("%s: the vocabulary has no token for the byte 0x%02X", f, b);
    t.byte_id[b] = it->second;
  }
  // Merges: "a b" strings (older files) or ["a", "b"] pairs (newer files).
  t.merges.init(tables.merges.size());
  std::string left, right, both;
  for (size_t r = 0; r < tables.merges.size(); r++) {
    const TokenizerTables::Merge& m = tables.merges[r];
    auto shown = [&] {
      return (m.pair ? json::array({m.left, m.right}) : json(m.left + " " + m.right)).dump();
    };
    if (!spelling_to_bytes(m.left.data(), m.left.size(), &left) ||
        !spelling_to_bytes(m.right.data(), m.right.size(), &right))
      tok_die("%s: merges[%zu] (%s) is not spelled in the byte-level alphabet", f, r, shown().c_str());
    both.assign(left).append(right);
    auto ia = t.bytes_to_id.find(left), ib = t.bytes_to_id.find(right), ic = t.bytes_to_id.find(both);
    if (ia == t.bytes_to_id.end() || ib == t.bytes_to_id.end() || ic == t.bytes_to_id.end())
      tok_die("%s: merges[%zu] (%s) names a token that is not in the vocabulary", f, r, shown().c_str());
    t.merges.insert(ia->second, ib->second, (uint32_t)r, ic->second);
  }
  // Added tokens: matched in the raw text whether "special" or not.
  if (!added_json.is_array()) tok_die("%s: added_tokens is not an array", f);
  for (const json& a : added_json) {
    if (!a.is_object() || !a.contains("id") || !a.contains("content") || !a["content"].is_string() ||
        !a["id"].is_number_integer())
      tok_die("%s: added_tokens entry %s lacks an integer id or a string content", f, a.dump().c_str());
    for (const char* flag : {"lstrip", "rstrip", "single_word", "normalized"})
      if (a.value(flag, false))
        tok_die("%s: added token %s sets %s, which nanovllm does not implement (Qwen2/Qwen3 never set it)", f,
                a["content"].dump().c_str(), flag);
    long long id = a["id"].get<long long>();
    if (a["content"].get_ref<const std::string&>().empty() || id < 0 || id >= (1 << 24))
      tok_die("%s: added token %s is empty or its id is not in [0, 2^24)", f, a.dump().c_str());
    AddedToken at{a["content"].get<std::string>(), (int)id};
    if (at.id >= (int)t.id_to_bytes.size()) t.id_to_bytes.resize(at.id + 1);
    t.id_to_bytes[at.id] = at.content;
    t.starts_added[(unsigned char)at.content[0]] = true;
    t.added.push_back(at);
  }
  std::stable_sort(t.added.begin(), t.added.end(), [](const AddedToken& x, const AddedToken& y) {
    return x.content.size() > y.content.size();
  });

  // tokenizer_config.json (optional): the end-of-sequence token, and whether the chat template is Qwen3's.
  std::string config_text;
  if (read_file_to(dir + "/tokenizer_config.json", &config_text)) {
    json c;
    try {
      c = json::parse(config_text);
    } catch (const json::exception& e) {
      tok_die("%s/tokenizer_config.json is not valid JSON (%s)", dir.c_str(), e.what());
    }
    t.has_config = true;
    // eos_token is a string, or in older files an object {"content": "<|im_end|>", ...}.
    json eos = c.value("eos_token", json());
    if (eos.is_object()) eos = eos.value("content", json());
    if (eos.is_string()) t.eos_token_id = t.token_to_id(eos.get<std::string>());
    // FNV-1a of the Qwen3 template this file was written against (the one in tools/fetch_tokenizer.sh's
    // tokenizer_config.json); section T7 is its C++ translation.
    t.chat_template_is_qwen3 = c.contains("chat_template") && c["chat_template"].is_string() &&
                               fnv1a64(c["chat_template"].get<std::string>()) == 0x2bfdb7aa9754484eull;
  }
  t.cache.assign(CACHE_SLOTS, CacheSlot{});
  unicode_table();  // build it now rather than inside the first encode
  return true;
}

inline int Tokenizer::token_to_id(const std::string& token) const {
  for (const AddedToken& a : added)
    if (a.content == token) return a.id;
  uint32_t byte_to_cp[256];  // the vocabulary spelling ("Ġthe") -> bytes (" the")
  byte_level_alphabet(byte_to_cp);
  std::string bytes;
  const unsigned char* p = (const unsigned char*)token.data();
  if (utf8_invalid_at(token.data(), token.size()) != token.size()) return -1;
  for (size_t i = 0; i < token.size();) {
    int len, b = -1;
    uint32_t cp = utf8_next(p, i, &len);
    for (int k = 0; k < 256; k++)
      if (byte_to_cp[k] == cp) b = k;
    if (b < 0) return -1;
    bytes += (char)b;
    i += len;
  }
  auto it = bytes_to_id.find(bytes);
  return it == bytes_to_id.end() ? -1 : it->second;
}

// One pre-tokenized piece -> ids, through the cache.
inline void Tokenizer::encode_piece(const char* p, size_t n, std::vector<int>& out) const {
  const unsigned char* s = (const unsigned char*)p;
  if (n == 1) {
    out.push_back(byte_id[s[0]]);
    return;
  }
  uint64_t h = 0x9E3779B97F4A7C15ull ^ n;  // a small multiply-xorshift hash, 8 bytes at a time
  for (size_t i = 0; i < n; i += 8) {
    uint64_t w = 0;
    memcpy(&w, p + i, n - i < 8 ? n - i : 8);
    h = (h ^ w) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
  }
  CacheSlot& slot = cache[h & (CACHE_SLOTS - 1)];
  if (slot.hash == h && slot.len == n && memcmp(slot.piece, p, n) == 0) {
    out.insert(out.end(), slot.ids, slot.ids + slot.nids);
    return;
  }
  int small[64];
  std::vector<int> big;
  int* ids = n <= 64 ? small : (big.resize(n), big.data());
  for (size_t i = 0; i < n; i++) ids[i] = byte_id[s[i]];
  int m = n <= 64 ? bpe_merge_small(merges, ids, (int)n) : bpe_merge_large(merges, ids, (int)n);
  out.insert(out.end(), ids, ids + m);
  if (n <= sizeof slot.piece && m <= 16) {
    slot.hash = h, slot.len = (uint8_t)n, slot.nids = (uint8_t)m;
    memcpy(slot.piece, p, n);
    memcpy(slot.ids, ids, m * sizeof(int));
  }
}

// Text between added tokens: NFC, split, BPE.
inline void Tokenizer::encode_segment(const char* p, size_t n, std::vector<int>& out) const {
  std::string normalized;
  if (nfc_normalize(p, n, normalized)) p = normalized.data(), n = normalized.size();
  pretokenize(p, n, [&](size_t b, size_t e) { encode_piece(p + b, e - b, out); });
}

inline std::vector<int> Tokenizer::encode(const std::string& text) const {
  size_t n = text.size(), bad = utf8_invalid_at(text.data(), n);
  if (bad != n)
    tok_die("encode: the text is not valid UTF-8 (byte 0x%02X at offset %zu)", (unsigned char)text[bad], bad);
  std::vector<int> ids;
  ids.reserve(n / 3 + 8);
  const char* s = text.data();
  size_t segment = 0;
  for (size_t i = 0; i < n;) {
    if (!starts_added[(unsigned char)s[i]]) {
      i++;
      continue;
    }
    const AddedToken* hit = nullptr;
    for (const AddedToken& a : added)  // longest first
      if (a.content.size() <= n - i && memcmp(s + i, a.content.data(), a.content.size()) == 0) {
        hit = &a;
        break;
      }
    if (!hit) {
      i++;
      continue;
    }
    encode_segment(s + segment, i - segment, ids);
    ids.push_back(hit->id);
    i += hit->content.size();
    segment = i;
  }
  encode_segment(s + segment, n - segment, ids);
  return ids;
}

inline std::string Tokenizer::decode(const std::vector<int>& ids) const {
  std::string out;
  Utf8Repair repair;
  for (int id : ids)
    if (id >= 0 && id < vocab_size()) repair.feed(id_to_bytes[id].data(), id_to_bytes[id].size(), out);
  repair.finish(out);
  return out;
}

// Streaming decode for generation: push() each sampled id, print what it returns; flush() at the end.
// The concatenation of everything returned equals decode(all ids), and every returned string is valid
// UTF-8: a character whose bytes span several tokens comes out with its last byte.
struct StreamDecoder {
  explicit StreamDecoder(const Tokenizer& tokenizer) : tok(&tokenizer) {}
  std::string push(int id) {
    std::string out;
    if (id >= 0 && id < tok->vocab_size())
      repair.feed(tok->id_to_bytes[id].data(), tok->id_to_bytes[id].size(), out);
    return out;
  }
  std::string flush() {
    std::string out;
    repair.finish(out);
    return out;
  }
  const Tokenizer* tok;
  Utf8Repair repair;
};

// ==== T7. The Qwen3 chat template =========================================================================
//
// tokenizer_config.json's Jinja template for Qwen3, translated line for line for system, user and
// assistant messages (tools are not supported). What it does:
//   * messages[0], if a system message, opens the prompt; later system messages render like user ones;
//   * every message is "<|im_start|>ROLE\nCONTENT<|im_end|>\n";
//   * an assistant message keeps its <think>...</think> part only if it comes after the last real user
//     query (a user message that is not a <tool_response>) and is either the last message or has
//     non-empty reasoning; earlier assistant turns lose it;
//   * the generation prompt is "<|im_start|>assistant\n", plus "<think>\n\n</think>\n\n" when thinking is
//     off (the model then answers directly).

static std::string py_lstrip_newlines(const std::string& s) {
  size_t b = s.find_first_not_of('\n');
  return b == std::string::npos ? "" : s.substr(b);
}
static std::string py_rstrip_newlines(const std::string& s) {
  size_t e = s.find_last_not_of('\n');
  return e == std::string::npos ? "" : s.substr(0, e + 1);
}
static bool starts_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }
static bool ends_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}

inline std::string Tokenizer::apply_chat_template(const std::vector<ChatMessage>& msgs,
                                                  bool add_generation_prompt, bool enable_thinking) const {
  if (has_config && !chat_template_is_qwen3) {
    static bool warned = false;
    if (!warned)
      fprintf(stderr,
              "nanovllm: warning: the chat template in %s's tokenizer_config.json is not Qwen3's; "
              "prompts are rendered with Qwen3's template\n",
              path.c_str());
    warned = true;
  }
  if (msgs.empty()) tok_die("chat: the conversation has no messages");
  for (size_t i = 0; i < msgs.size(); i++) {
    const std::string& r = msgs[i].role;
    if (r == "tool") tok_die("chat: message %zu has role 'tool': tool calls are not supported", i);
    if (r != "system" && r != "user" && r != "assistant")
      tok_die("chat: message %zu has role '%s'; expected system, user or assistant", i, r.c_str());
  }
  const int n = (int)msgs.size();
  std::string out;
  if (msgs[0].role == "system") out += "<|im_start|>system\n" + msgs[0].content + "<|im_end|>\n";
  int last_query = n - 1;
  for (int i = n - 1; i >= 0; i--)
    if (msgs[i].role == "user" && !(starts_with(msgs[i].content, "<tool_response>") &&
                                    ends_with(msgs[i].content, "</tool_response>"))) {
      last_query = i;
      break;
    }
  for (int i = 0; i < n; i++) {
    const ChatMessage& m = msgs[i];
    if (m.role == "user" || (m.role == "system" && i != 0)) {
      out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
    } else if (m.role == "assistant") {
      std::string content = m.content, reasoning;
      size_t close = m.content.find("</think>");
      if (close != std::string::npos) {
        // content.split('</think>')[-1].lstrip('\n') and
        // content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n')
        content = py_lstrip_newlines(m.content.substr(m.content.rfind("</think>") + 8));
        std::string before = py_rstrip_newlines(m.content.substr(0, close));
        size_t open = before.rfind("<think>");
        reasoning = py_lstrip_newlines(open == std::string::npos ? before : before.substr(open + 7));
      }
      if (i > last_query && (i == n - 1 || !reasoning.empty()))
        out += "<|im_start|>assistant\n<think>\n" + py_rstrip_newlines(py_lstrip_newlines(reasoning)) +
               "\n</think>\n\n" + py_lstrip_newlines(content);
      else
        out += "<|im_start|>assistant\n" + content;
      out += "<|im_end|>\n";
    }
  }
  if (add_generation_prompt) {
    out += "<|im_start|>assistant\n";
    if (!enable_thinking) out += "<think>\n\n</think>\n\n";
  }
  return out;
}

// ==== T8. Command line: nanovllm encode | decode ==========================================================
//
//   nanovllm encode MODEL_DIR                          stdin is one text -> one JSON array of ids
//   nanovllm encode MODEL_DIR --jsonl                  one JSON string per line -> one array per line
//   nanovllm encode MODEL_DIR --chat [--no-thinking]   one JSON array of {"role","content"} per line ->
//                                                      the ids of the prompt, generation prompt included
//   nanovllm decode MODEL_DIR                          one JSON array of ids per line -> one JSON string
// MODEL_DIR may be a tokenizer.json. Bad input stops with the line number and exit status 1.

static std::string read_all_stdin() {
  std::string s;
  char buf[1 << 16];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, stdin)) > 0) s.append(buf, n);
  return s;
}

static void append_ids_json(std::string& out, const std::vector<int>& ids) {
  out += '[';
  char buf[16];
  for (size_t i = 0; i < ids.size(); i++) {
    if (i) out += ',';
    auto r = std::to_chars(buf, buf + sizeof buf, ids[i]);
    out.append(buf, r.ptr);
  }
  out += "]\n";
}

static int tokenizer_command(int argc, char** argv) {
  using nlohmann::json;
  const char* usage =
      "usage: nanovllm encode MODEL_DIR [--jsonl | --chat [--no-thinking]]   (stdin -> token ids)\n"
      "       nanovllm decode MODEL_DIR                     (JSON arrays of ids -> JSON strings)\n"
      "MODEL_DIR is a model folder with tokenizer.json, or the path of a tokenizer.json.";
  if (argc < 2) tok_die("%s: missing MODEL_DIR\n%s", argv[0], usage);
  bool encode = strcmp(argv[0], "encode") == 0, jsonl = false, chat = false, thinking = true;
  for (int i = 2; i < argc; i++) {
    if (encode && !strcmp(argv[i], "--jsonl"))
      jsonl = true;
    else if (encode && !strcmp(argv[i], "--chat"))
      chat = true;
    else if (encode && !strcmp(argv[i], "--no-thinking"))
      thinking = false;
    else
      tok_die("%s: unknown argument '%s'\n%s", argv[0], argv[i], usage);
  }
  if (jsonl && chat) tok_die("encode: --jsonl and --chat exclude each other\n%s", usage);
  if (!thinking && !chat) tok_die("encode: --no-thinking only applies to --chat\n%s", usage);
  Tokenizer tok = Tokenizer::load(argv[1]);
  std::string in = read_all_stdin(), out;
  size_t bad = utf8_invalid_at(in.data(), in.size());
  if (bad != in.size()) {
    long line = 1 + std::count(in.begin(), in.begin() + bad, '\n');
    size_t line_start = bad == 0 ? std::string::npos : in.rfind('\n', bad - 1);
    size_t col = bad - (line_start == std::string::npos ? 0 : line_start + 1);
    tok_die("stdin line %ld, byte %zu of the line: invalid UTF-8 (byte 0x%02X); the input must be UTF-8",
            line, col + 1, (unsigned char)in[bad]);
  }
  if (encode && !jsonl && !chat) {
    append_ids_json(out, tok.encode(in));
    fwrite(out.data(), 1, out.size(), stdout);
    return 0;
  }
  long line_no = 0;
  for (size_t pos = 0; pos < in.size();) {
    size_t eol = in.find('\n', pos);
    if (eol == std::string::npos) eol = in.size();
    std::string line = in.substr(pos, eol - pos);
    pos = eol + 1;
    line_no++;
    json j;
    try {
      j = json::parse(line);
    } catch (const json::exception& e) { tok_die("stdin line %ld: not valid JSON (%s)", line_no, e.what()); }
    if (!encode) {
      if (!j.is_array())
        tok_die("stdin line %ld: expected a JSON array of token ids, got %.80s", line_no, j.dump().c_str());
      std::vector<int> ids;
      for (size_t k = 0; k < j.size(); k++) {
        const json& v = j[k];
        if (!v.is_number_integer() || v.get<long long>() < 0 || v.get<long long>() >= tok.vocab_size())
          tok_die("stdin line %ld: element %zu (%s) is not a token id in [0, %d)", line_no, k,
                  v.dump().c_str(), tok.vocab_size());
        ids.push_back(v.get<int>());
      }
      out += json(tok.decode(ids)).dump();
      out += '\n';
    } else if (jsonl) {
      if (!j.is_string())
        tok_die("stdin line %ld: expected a JSON string, got %.80s", line_no, j.dump().c_str());
      append_ids_json(out, tok.encode(j.get<std::string>()));
    } else {
      if (!j.is_array() || j.empty())
        tok_die("stdin line %ld: expected a non-empty JSON array of {\"role\", \"content\"} messages",
                line_no);
      std::vector<ChatMessage> msgs;
      for (size_t k = 0; k < j.size(); k++) {
        const json& m = j[k];
        if (!m.is_object()) tok_die("stdin line %ld: message %zu is not a JSON object", line_no, k);
        if (m.contains("tool_calls") || m.value("role", "") == "tool")
          tok_die("stdin line %ld: message %zu: tool calls are not supported", line_no, k);
        for (auto it = m.begin(); it != m.end(); ++it)
          if (it.key() != "role" && it.key() != "content")
            tok_die(
                "stdin line %ld: message %zu has the key '%s'; only \"role\" and \"content\" are supported%s",
                line_no, k, it.key().c_str(),
                it.key() == "reasoning_content" ? " (put the reasoning in content as <think>...</think>)"
                                                : "");
        if (!m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
            !m["content"].is_string())
          tok_die("stdin line %ld: message %zu needs string \"role\" and \"content\"", line_no, k);
        std::string role = m["role"].get<std::string>();
        if (role != "system" && role != "user" && role != "assistant")
          tok_die("stdin line %ld: message %zu has role '%s'; expected system, user or assistant", line_no, k,
                  role.c_str());
        msgs.push_back({role, m["content"].get<std::string>()});
      }
      append_ids_json(out, tok.encode(tok.apply_chat_template(msgs, true, thinking)));
    }
    if (out.size() > (1 << 20)) fwrite(out.data(), 1, out.size(), stdout), out.clear();
  }
  fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}
