// safetensors.h — a validating, zero-copy reader for Hugging Face .safetensors checkpoints.
//
// The format: 8 bytes little-endian N, then N bytes of JSON header, then the data section.
//   header = { "TENSOR_NAME": {"dtype": "BF16", "shape": [r, c], "data_offsets": [begin, end]}, ...,
//              "__metadata__": {"format": "pt", ...} (optional, free-form string map) }
//   offsets are relative to the start of the data section; end - begin = prod(shape) * itemsize.
// A sharded checkpoint adds model.safetensors.index.json: {"weight_map": {"TENSOR_NAME": "file", ...}}.
//
// Every file is mmap()ed read-only, so opening a 60 GB checkpoint costs nothing until a tensor is touched,
// and a tensor's bytes are read straight from the page cache into the GPU copy. Everything is validated
// before use: a truncated download or a corrupt header must be an error that names the file and tensor
// and shows what was expected against what was found, never a crash or silent garbage.
//
// API:  SafeTensors st = SafeTensors::open_dir("model/");   // or open_file("x.safetensors")
//       const TensorView* t = st.find("model.norm.weight");  // nullptr if absent
//       t->dtype, t->shape, t->data (host pointer into the mapping), t->nbytes, t->file
//       st.names()                                            // every tensor name, sorted
// Errors throw SafeTensorsError (a std::runtime_error) with the full message; callers print and exit.
#pragma once
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

struct SafeTensorsError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class DType { BF16, F16, F32, F64, I8, I16, I32, I64, U8, U16, U32, U64, BOOL, F8_E4M3, F8_E5M2 };

struct DTypeInfo {
  const char* name;
  DType dtype;
  int itemsize;
};
static const DTypeInfo kDTypes[] = {
    {"BF16", DType::BF16, 2}, {"F16", DType::F16, 2},   {"F32", DType::F32, 4},         {"F64", DType::F64, 8},
    {"I8", DType::I8, 1},     {"I16", DType::I16, 2},   {"I32", DType::I32, 4},         {"I64", DType::I64, 8},
    {"U8", DType::U8, 1},     {"U16", DType::U16, 2},   {"U32", DType::U32, 4},         {"U64", DType::U64, 8},
    {"BOOL", DType::BOOL, 1}, {"F8_E4M3", DType::F8_E4M3, 1}, {"F8_E5M2", DType::F8_E5M2, 1},
};
static inline const char* dtype_name(DType d) {
  for (auto& t : kDTypes)
    if (t.dtype == d) return t.name;
  return "?";
}
static inline int dtype_size(DType d) {
  for (auto& t : kDTypes)
    if (t.dtype == d) return t.itemsize;
  return 0;
}

// Block-quantized weights, as Qwen's FP8 checkpoints store them: F8_E4M3 bytes with one scale per 128 x 128
// block in a NAME_scale_inv tensor (config.json's quantization_config, quant_method "fp8"; nanovllm.cu
// section 6a reads them). An e4m3 byte (PyTorch's float8_e4m3fn): a sign bit, 4 exponent bits (bias 7) and
// 3 mantissa bits, no infinities:
//   exponent field e = 1..15:  +-(1 + m/8) * 2^(e-7)      (e = 15 with m = 7 is NaN: bytes 0x7F and 0xFF)
//   exponent field e = 0:      +-(m/8) * 2^-6              subnormals, and +-0
constexpr DType kBlockQuantizedDType = DType::F8_E4M3;
constexpr const char* kBlockQuantizedMethod = "fp8";
// An e4m3 byte's value, from the definition above (exact: every e4m3 value is a float).
static inline float e4m3_to_float(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return NAN;
  const float mag = e == 0 ? m * 0x1p-9f : std::ldexp(1.0f + m / 8.0f, e - 7);
  return b & 0x80 ? -mag : mag;
}
// Where the first NaN byte (0x7F or 0xFF) of n e4m3 bytes is, or n if there is none. A loader checks every
// byte of a checkpoint, tens of GB, on its way in, so eight bytes are checked at once: for a word's bytes
// x & 0x7f (each at most 0x7f), adding 0x01 to every byte carries into no neighbour, and sets a byte's high
// bit only where its low 7 bits were all ones, the NaN bytes. Four words a round, then one, then bytes.
static inline size_t block_quantized_first_nan(const uint8_t* p, size_t n) {
  constexpr uint64_t kLow7 = 0x7f7f7f7f7f7f7f7full, kOnes = 0x0101010101010101ull, kHigh = 0x8080808080808080ull;
  auto word = [&](size_t i) {
    uint64_t w;
    memcpy(&w, p + i, 8);
    return ((w & kLow7) + kOnes) & kHigh;
  };
  size_t i = 0;
  while (i + 32 <= n && !(word(i) | word(i + 8) | word(i + 16) | word(i + 24))) i += 32;
  while (i + 8 <= n && !word(i)) i += 8;
  for (; i < n; i++)
    if ((p[i] & 0x7f) == 0x7f) return i;
  return n;
}
// The 256 values of kBlockQuantizedDType's bytes, built once.
static inline const float* block_quantized_values() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int b = 0; b < 256; b++) t[b] = e4m3_to_float((uint8_t)b);
    return t;
  }();
  return table.data();
}
// The dtypes a block-quantized checkpoint's tensors may have (nanovllm.cu's loader checks each tensor's kind
// with them): "" when a weight (or, is_scale, its block scales) of dtype d is what it must be, else what is
// wrong; and, for a tensor that must be unquantized, what to add to the list of dtypes it may have.
static inline std::string quantized_dtype_problem(bool is_scale, DType d) {
  if (is_scale) return d == DType::BF16 || d == DType::F32 ? "" : "block scales are BF16 or F32";
  if (d == kBlockQuantizedDType) return "";
  return std::string("config.json's quantization_config (quant_method ") + kBlockQuantizedMethod +
         ") makes the layers' linear weights " + dtype_name(kBlockQuantizedDType) +
         " unless modules_to_not_convert names them";
}
static inline std::string unquantized_dtype_hint(DType d) {
  if (d != kBlockQuantizedDType) return "";
  return std::string(", and ") + dtype_name(d) + " only for the layers' linear weights of a checkpoint whose "
         "config.json has quantization_config with quant_method " + kBlockQuantizedMethod;
}

struct TensorView {
  std::string name;
  std::string file;            // the .safetensors file that holds it
  DType dtype;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // host pointer into the read-only mapping
  size_t nbytes = 0;
  int64_t numel() const {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
  std::string shape_str() const {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); i++) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
  }
};

// One mmap()ed file; unmapped when the last SafeTensors holding it goes away.
struct MappedFile {
  std::string path;
  const uint8_t* base = nullptr;
  size_t size = 0;
  ~MappedFile() {
    if (base && size) munmap((void*)base, size);
  }
};

class SafeTensors {
 public:
  static SafeTensors open_file(const std::string& path) {
    SafeTensors st;
    st.add_file(path);
    return st;
  }

  // A folder: every shard named by model.safetensors.index.json, else the single model.safetensors.
  static SafeTensors open_dir(const std::string& dir) {
    SafeTensors st;
    std::string index = dir + "/model.safetensors.index.json";
    struct stat sb;
    if (stat(index.c_str(), &sb) == 0) {
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(read_all(index));
      } catch (const nlohmann::json::exception& e) {
        throw SafeTensorsError(index + ": not valid JSON: " + e.what());
      }
      if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
        throw SafeTensorsError(index + ": expected an object with a \"weight_map\" object");
      std::map<std::string, std::string> want;  // tensor -> shard the index names
      std::vector<std::string> shards;
      for (auto& [name, file] : j["weight_map"].items()) {
        if (!file.is_string()) throw SafeTensorsError(index + ": weight_map[\"" + name + "\"] is not a string");
        std::string f = file.get<std::string>();
        if (f.find('/') != std::string::npos)
          throw SafeTensorsError(index + ": shard name '" + f + "' must be a plain file name");
        want[name] = f;
        if (std::find(shards.begin(), shards.end(), f) == shards.end()) shards.push_back(f);
      }
      for (auto& f : shards) {
        std::string p = dir + "/" + f;
        if (stat(p.c_str(), &sb) != 0)
          throw SafeTensorsError(index + " names shard '" + f + "', but " + p + " does not exist");
        st.add_file(p);
      }
      for (auto& [name, f] : want) {
        const TensorView* t = st.find(name);
        if (!t)
          throw SafeTensorsError(index + " maps tensor '" + name + "' to " + f + ", but that file has no such tensor");
      }
    } else {
      std::string single = dir + "/model.safetensors";
      if (stat(single.c_str(), &sb) != 0)
        throw SafeTensorsError("no weights in " + dir + ": expected model.safetensors or model.safetensors.index.json");
      st.add_file(single);
    }
    return st;
  }

  const TensorView* find(const std::string& name) const {
    auto it = tensors_.find(name);
    return it == tensors_.end() ? nullptr : &it->second;
  }
  std::vector<std::string> names() const {
    std::vector<std::string> v;
    for (auto& kv : tensors_) v.push_back(kv.first);
    return v;
  }
  size_t total_bytes() const {
    size_t n = 0;
    for (auto& kv : tensors_) n += kv.second.nbytes;
    return n;
  }

  // Parse and validate one file's header. Public so the fuzzer and the tests can feed it raw bytes.
  // `data_size` is the size of the data section; returned views point into `data` (may be null for checks).
  static std::vector<TensorView> parse_header(const std::string& file, const char* header, size_t header_len,
                                              const uint8_t* data, size_t data_size) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(header, header + header_len);
    } catch (const nlohmann::json::exception& e) {
      throw SafeTensorsError(file + ": header is not valid JSON: " + e.what());
    }
    if (!j.is_object()) throw SafeTensorsError(file + ": header must be a JSON object, found " + j.type_name());
    std::vector<TensorView> out;
    std::vector<std::pair<uint64_t, uint64_t>> spans;  // [begin, end) of each tensor in `out`
    for (auto& [name, v] : j.items()) {
      if (name == "__metadata__") {
        if (!v.is_object()) throw SafeTensorsError(file + ": __metadata__ must be an object");
        continue;
      }
      std::string where = file + ": tensor '" + name + "'";
      if (!v.is_object()) throw SafeTensorsError(where + ": entry must be an object");
      if (!v.contains("dtype") || !v["dtype"].is_string()) throw SafeTensorsError(where + ": missing \"dtype\"");
      if (!v.contains("shape") || !v["shape"].is_array()) throw SafeTensorsError(where + ": missing \"shape\"");
      if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2)
        throw SafeTensorsError(where + ": \"data_offsets\" must be [begin, end]");
      TensorView t;
      t.name = name;
      t.file = file;
      std::string dt = v["dtype"].get<std::string>();
      int itemsize = 0;
      for (auto& d : kDTypes)
        if (dt == d.name) t.dtype = d.dtype, itemsize = d.itemsize;
      if (!itemsize) throw SafeTensorsError(where + ": unknown dtype \"" + dt + "\"");
      // Nothing may overflow: each dim at most 2^40 and the element count at most 2^56, checked as we go,
      // so numel * itemsize (itemsize <= 8) below fits in 64 bits and cannot wrap around to a small span.
      uint64_t numel = 1;
      for (auto& d : v["shape"]) {
        if (!d.is_number_unsigned() && !(d.is_number_integer() && d.get<int64_t>() >= 0))
          throw SafeTensorsError(where + ": shape entries must be non-negative integers");
        uint64_t dim = d.get<uint64_t>();
        if (dim > (1ull << 40) || (dim && numel > (1ull << 56) / dim))
          throw SafeTensorsError(where + ": shape is absurdly large");
        numel *= dim;
        t.shape.push_back((int64_t)dim);
      }
      auto& off = v["data_offsets"];
      if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned())
        throw SafeTensorsError(where + ": data_offsets must be non-negative integers");
      uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
      if (end < begin)
        throw SafeTensorsError(where + ": data_offsets end " + std::to_string(end) + " < begin " +
                               std::to_string(begin));
      if (end > data_size)
        throw SafeTensorsError(where + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                               "] run past the data section of " + std::to_string(data_size) +
                               " bytes (truncated file?)");
      if (numel * itemsize != end - begin)
        throw SafeTensorsError(where + ": shape " + t.shape_str() + " of " + dt + " needs " +
                               std::to_string(numel * itemsize) + " bytes, but data_offsets span " +
                               std::to_string(end - begin));
      t.data = data ? data + begin : nullptr;
      t.nbytes = end - begin;
      out.push_back(std::move(t));
      out.back().shape.shrink_to_fit();
      spans.push_back({begin, end});
    }
    check_overlaps(file, out, spans);
    return out;
  }

 private:
  std::map<std::string, TensorView> tensors_;
  std::vector<std::shared_ptr<MappedFile>> files_;

  static std::string read_all(const std::string& path) {
    FILE* f = fopen(path.c_str(), "rb");
    if (!f) throw SafeTensorsError("cannot open " + path + ": " + strerror(errno));
    std::string s;
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
    fclose(f);
    return s;
  }

  // No two tensors may share bytes (an empty tensor overlaps nothing).
  static void check_overlaps(const std::string& file, const std::vector<TensorView>& ts,
                             const std::vector<std::pair<uint64_t, uint64_t>>& begin_end) {
    std::vector<std::pair<std::pair<uint64_t, uint64_t>, size_t>> spans;
    for (size_t i = 0; i < ts.size(); i++)
      if (begin_end[i].second > begin_end[i].first) spans.push_back({begin_end[i], i});
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); i++) {
      auto& a = spans[i - 1];
      auto& b = spans[i];
      if (b.first.first < a.first.second)
        throw SafeTensorsError(file + ": tensors '" + ts[a.second].name + "' [" + std::to_string(a.first.first) +
                               ", " + std::to_string(a.first.second) + ") and '" + ts[b.second].name + "' [" +
                               std::to_string(b.first.first) + ", " + std::to_string(b.first.second) +
                               ") overlap");
    }
  }

  void add_file(const std::string& path) {
    auto mf = std::make_shared<MappedFile>();
    mf->path = path;
    int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) throw SafeTensorsError("cannot open " + path + ": " + strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
      ::close(fd);
      throw SafeTensorsError(path + ": not a regular file");
    }
    mf->size = (size_t)sb.st_size;
    if (mf->size < 8) {
      ::close(fd);
      throw SafeTensorsError(path + ": " + std::to_string(mf->size) + " bytes is too small for a safetensors file "
                             "(at least 8 bytes of header length expected)");
    }
    void* p = mmap(nullptr, mf->size, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) throw SafeTensorsError("cannot mmap " + path + ": " + strerror(errno));
    mf->base = (const uint8_t*)p;
    uint64_t n = 0;
    memcpy(&n, mf->base, 8);  // little-endian on every machine CUDA runs on
    if (n > mf->size - 8 || n > (100ull << 20))
      throw SafeTensorsError(path + ": header length " + std::to_string(n) + " does not fit in the file of " +
                             std::to_string(mf->size) + " bytes (limit 100 MiB; truncated or not safetensors?)");
    const uint8_t* data = mf->base + 8 + n;
    size_t data_size = mf->size - 8 - n;
    for (auto& t : parse_header(path, (const char*)mf->base + 8, n, data, data_size)) {
      if (tensors_.count(t.name))
        throw SafeTensorsError(path + ": tensor '" + t.name + "' is also in " + tensors_[t.name].file);
      tensors_[t.name] = std::move(t);
    }
    files_.push_back(mf);
  }
};
