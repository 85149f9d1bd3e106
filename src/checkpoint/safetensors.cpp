// safetensors reader/writer (see include/fsdp/checkpoint/safetensors.h). Validation follows the reference
// implementation: header length bounded, JSON object, every tensor's byte range consistent with its shape and
// dtype, ranges contiguous from 0 and covering the data section exactly.
#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/util/atomic_file.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>

namespace fsdp::checkpoint::safetensors {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // the reference implementation's limit
constexpr int64_t kMaxIndexBytes = 64 << 20;      // model.safetensors.index.json (real ones: 20-200 kB)

// Elements and bytes of a shape, every product checked for int64 overflow left to right as the reference
// implementation does (so [2^40, 2^40, 0] is refused rather than taken for 0 elements); nullopt on overflow.
std::optional<std::pair<int64_t, int64_t>> checked_numel_nbytes(const std::vector<int64_t>& shape,
                                                                c10::ScalarType dtype) {
  int64_t numel = 1, nbytes = 0;
  for (int64_t d : shape)
    if (d < 0 || __builtin_mul_overflow(numel, d, &numel)) return std::nullopt;
  if (__builtin_mul_overflow(numel, static_cast<int64_t>(c10::elementSize(dtype)), &nbytes)) return std::nullopt;
  return std::make_pair(numel, nbytes);
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// A JSON integer in [0, 2^63): what a dimension or a byte offset may be.
bool is_index(const nlohmann::json& v) {
  return v.is_number_unsigned() && v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
}

bool little_endian_host() {
  const uint16_t one = 1;
  unsigned char first = 0;
  std::memcpy(&first, &one, 1);
  return first == 1;
}

void check_host() {
  TORCH_CHECK(little_endian_host(), "safetensors: only little-endian hosts are supported");
}

const std::vector<std::pair<std::string, c10::ScalarType>>& dtype_table() {
  static const std::vector<std::pair<std::string, c10::ScalarType>> table = {
      {"F64", c10::kDouble},  {"F32", c10::kFloat},  {"F16", c10::kHalf},         {"BF16", c10::kBFloat16},
      {"I64", c10::kLong},    {"I32", c10::kInt},    {"I16", c10::kShort},        {"I8", c10::kChar},
      {"U8", c10::kByte},     {"BOOL", c10::kBool},  {"F8_E4M3", c10::kFloat8_e4m3fn},
      {"F8_E5M2", c10::kFloat8_e5m2}, {"U16", c10::kUInt16}, {"U32", c10::kUInt32}, {"U64", c10::kUInt64},
  };
  return table;
}

// An owned file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.fd_;
      o.fd_ = -1;
    }
    return *this;
  }
  int get() const { return fd_; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

void pread_all(int fd, void* dst, int64_t n, int64_t offset, const std::string& path) {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, static_cast<size_t>(std::min<int64_t>(n, 1 << 30)), offset);
    if (got < 0 && errno == EINTR) continue;
    TORCH_CHECK(got > 0, "safetensors: reading ", path, " at byte ", offset, " failed: ",
                got == 0 ? "unexpected end of file" : std::strerror(errno));
    p += got, n -= got, offset += got;
  }
}

}  // namespace

std::string dtype_name(c10::ScalarType dtype) {
  for (const auto& [name, d] : dtype_table()) {
    if (d == dtype) return name;
  }
  TORCH_CHECK(false, "safetensors: dtype ", dtype, " has no safetensors name");
}

c10::ScalarType dtype_from_name(const std::string& name) {
  for (const auto& [n, d] : dtype_table()) {
    if (n == name) return d;
  }
  TORCH_CHECK(false, "safetensors: unsupported dtype '", name, "'");
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// ---- Reader ----------------------------------------------------------------------------------------------

struct Reader::Impl {
  std::string path;
  Fd fd;
  int64_t data_start = 0;  // 8 + header length
  std::map<std::string, TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
};

Reader::Reader(const std::string& path) : impl_(std::make_unique<Impl>()) {
  check_host();
  impl_->path = path;
  impl_->fd = Fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  TORCH_CHECK(impl_->fd.get() >= 0, "safetensors: cannot open ", path, ": ", std::strerror(errno));
  struct stat st {};
  TORCH_CHECK(::fstat(impl_->fd.get(), &st) == 0, "safetensors: cannot stat ", path, ": ", std::strerror(errno));
  const int64_t file_size = st.st_size;
  TORCH_CHECK(file_size >= 8, "safetensors: ", path, " is ", file_size, " bytes, too short for a header length");

  unsigned char len_bytes[8];
  pread_all(impl_->fd.get(), len_bytes, 8, 0, path);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  TORCH_CHECK(header_len <= kMaxHeaderBytes, "safetensors: ", path, ": header length ", header_len,
              " exceeds the ", kMaxHeaderBytes, "-byte limit (not a safetensors file?)");
  TORCH_CHECK(static_cast<int64_t>(8 + header_len) <= file_size, "safetensors: ", path, ": header length ",
              header_len, " runs past the end of the ", file_size, "-byte file");
  std::string header(header_len, '\0');
  pread_all(impl_->fd.get(), header.data(), static_cast<int64_t>(header_len), 8, path);
  TORCH_CHECK(!header.empty() && header[0] == '{', "safetensors: ", path, ": header does not start with '{'");
  impl_->data_start = 8 + static_cast<int64_t>(header_len);
  const int64_t data_size = file_size - impl_->data_start;

  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "safetensors: ", path, ": header is not valid JSON: ", e.what());
  }
  TORCH_CHECK(j.is_object(), "safetensors: ", path, ": header is not a JSON object");
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      TORCH_CHECK(v.is_object(), "safetensors: ", path, ": __metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        TORCH_CHECK(m.value().is_string(), "safetensors: ", path, ": metadata value of '", m.key(),
                    "' is not a string");
        impl_->metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    try {
      TensorInfo info;
      info.name = name;
      TORCH_CHECK(v.is_object(), "entry is not an object");
      TORCH_CHECK(v.contains("dtype") && v["dtype"].is_string(), "\"dtype\" is not a string");
      info.dtype = dtype_from_name(v["dtype"].get<std::string>());
      TORCH_CHECK(v.contains("shape") && v["shape"].is_array(), "\"shape\" is not an array");
      for (const auto& s : v["shape"]) {
        TORCH_CHECK(is_index(s), "shape: every dimension must be an integer in [0, 2^63)");
        info.shape.push_back(s.get<int64_t>());
      }
      const auto sizes = checked_numel_nbytes(info.shape, info.dtype);
      TORCH_CHECK(sizes, "shape ", shape_text(info.shape), " x ", v["dtype"].get<std::string>(),
                  " overflows 64-bit element or byte counts");
      TORCH_CHECK(v.contains("data_offsets") && v["data_offsets"].is_array() && v["data_offsets"].size() == 2,
                  "data_offsets must be [begin, end]");
      const auto& off = v["data_offsets"];
      TORCH_CHECK(is_index(off[0]) && is_index(off[1]), "data_offsets must be integers in [0, 2^63)");
      info.begin = off[0].get<int64_t>();
      info.end = off[1].get<int64_t>();
      TORCH_CHECK(info.begin <= info.end && info.end <= data_size, "data_offsets [", info.begin, ", ", info.end,
                  ") outside the ", data_size, "-byte data section");
      TORCH_CHECK(info.nbytes() == sizes->second, "holds ", info.nbytes(), " bytes but shape x dtype (",
                  shape_text(info.shape), " x ", v["dtype"].get<std::string>(), ") needs ", sizes->second);
      impl_->tensors.emplace(name, std::move(info));
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "safetensors: ", path, ": tensor '", name, "': ", e.what_without_backtrace());
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "safetensors: ", path, ": tensor '", name, "': malformed entry: ", e.what());
    }
  }
  // Byte ranges must tile the data section: sorted by offset, each starts where the previous ended.
  std::vector<const TensorInfo*> by_offset;
  for (const auto& [_, info] : impl_->tensors) by_offset.push_back(&info);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  int64_t expected_begin = 0;
  for (const TensorInfo* info : by_offset) {
    TORCH_CHECK(info->begin == expected_begin, "safetensors: ", path, ": tensor '", info->name, "' starts at byte ",
                info->begin, " but the previous tensor ends at ", expected_begin, " (overlap or gap)");
    expected_begin = info->end;
  }
  TORCH_CHECK(expected_begin == data_size, "safetensors: ", path, ": tensors cover ", expected_begin,
              " bytes but the data section has ", data_size);
}

Reader::~Reader() = default;
Reader::Reader(Reader&&) noexcept = default;
Reader& Reader::operator=(Reader&&) noexcept = default;

const std::string& Reader::path() const { return impl_->path; }

std::vector<std::string> Reader::names() const {
  std::vector<std::string> out;
  for (const auto& [name, _] : impl_->tensors) out.push_back(name);
  return out;
}

bool Reader::contains(const std::string& name) const { return impl_->tensors.count(name) > 0; }

const TensorInfo& Reader::info(const std::string& name) const {
  auto it = impl_->tensors.find(name);
  TORCH_CHECK(it != impl_->tensors.end(), "safetensors: ", impl_->path, " has no tensor '", name, "' (it has ",
              impl_->tensors.size(), " tensors)");
  return it->second;
}

const std::map<std::string, std::string>& Reader::metadata() const { return impl_->metadata; }

at::Tensor Reader::read(const std::string& name) const {
  const TensorInfo& i = info(name);
  at::Tensor out = at::empty(i.shape, at::TensorOptions().dtype(i.dtype));
  if (i.nbytes() > 0) pread_all(impl_->fd.get(), out.data_ptr(), i.nbytes(), impl_->data_start + i.begin, impl_->path);
  return out;
}

at::Tensor Reader::read_rows(const std::string& name, int64_t row_begin, int64_t row_count) const {
  const TensorInfo& i = info(name);
  TORCH_CHECK(!i.shape.empty(), "safetensors: read_rows of 0-dim tensor '", name, "' in ", impl_->path);
  TORCH_CHECK(row_begin >= 0 && row_count >= 0 && row_begin + row_count <= i.shape[0], "safetensors: rows [",
              row_begin, ", ", row_begin + row_count, ") out of range for '", name, "' with ", i.shape[0], " rows");
  std::vector<int64_t> shape = i.shape;
  shape[0] = row_count;
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(i.dtype));
  const int64_t row_bytes = i.shape[0] == 0 ? 0 : i.nbytes() / i.shape[0];
  if (row_count > 0 && row_bytes > 0) {
    pread_all(impl_->fd.get(), out.data_ptr(), row_count * row_bytes,
              impl_->data_start + i.begin + row_begin * row_bytes, impl_->path);
  }
  return out;
}

void Reader::read_into(const std::string& name, const at::Tensor& dst) const {
  const TensorInfo& i = info(name);
  TORCH_CHECK(dst.sizes() == at::IntArrayRef(i.shape), "safetensors: '", name, "' in ", impl_->path, " has shape ",
              at::IntArrayRef(i.shape), " but the destination has ", dst.sizes());
  c10::NoGradGuard no_grad;  // loading into parameters that require grad
  dst.copy_(read(name));
}

std::map<std::string, at::Tensor> load_file(const std::string& path) {
  Reader r(path);
  std::map<std::string, at::Tensor> out;
  for (const auto& name : r.names()) out.emplace(name, r.read(name));
  return out;
}

// ---- Writer ----------------------------------------------------------------------------------------------

void save_file(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
               const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  for (const auto& [name, t] : tensors) {
    TORCH_CHECK(t.defined(), "safetensors: tensor '", name, "' is undefined");
    specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  }
  save_file_streamed(path, specs, [&](size_t i) { return tensors[i].second; }, metadata);
}

void save_file_streamed(const std::string& path, const std::vector<TensorSpec>& specs,
                        const std::function<at::Tensor(size_t)>& produce,
                        const std::map<std::string, std::string>& metadata) {
  check_host();
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  int64_t offset = 0;
  for (const auto& spec : specs) {
    const std::string& name = spec.name;
    TORCH_CHECK(!name.empty() && name != "__metadata__", "safetensors: invalid tensor name '", name, "' for ", path);
    TORCH_CHECK(!header.contains(name), "safetensors: tensor name '", name, "' given twice for ", path);
    const int64_t nbytes = safetensors::nbytes(spec);
    int64_t end = 0;
    TORCH_CHECK(!__builtin_add_overflow(offset, nbytes, &end), "safetensors: ", path,
                ": the tensors' total size overflows 64 bits");
    header[name] = {{"dtype", dtype_name(spec.dtype)}, {"shape", spec.shape}, {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string text = header.dump();
  // Pad with spaces so the data section starts 8-byte aligned (as the reference writer does).
  text.append((8 - text.size() % 8) % 8, ' ');
  unsigned char len_bytes[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>((n >> (8 * i)) & 0xff);

  // A throw from produce() or a failed write leaves the old file (if any) as it was and no temporary.
  util::AtomicFile file(path, "safetensors");
  file.write(len_bytes, 8);
  file.write(text);
  for (size_t i = 0; i < specs.size(); ++i) {
    at::Tensor t = produce(i);
    TORCH_CHECK(t.defined(), "safetensors: tensor '", specs[i].name, "' is undefined");
    TORCH_CHECK(t.scalar_type() == specs[i].dtype && t.sizes() == at::IntArrayRef(specs[i].shape), "safetensors: tensor '",
                specs[i].name, "' is ", t.scalar_type(), t.sizes(), " but was declared ", specs[i].dtype,
                at::IntArrayRef(specs[i].shape));
    at::Tensor c = t.detach().to(at::kCPU).contiguous();
    if (c.numel() > 0) file.write(c.data_ptr(), c.numel() * static_cast<int64_t>(c.element_size()));
  }
  file.commit(util::DirSync::No);
}

// ---- index of a sharded set ------------------------------------------------------------------------------

int64_t nbytes(const TensorSpec& spec) {
  const auto sizes = checked_numel_nbytes(spec.shape, spec.dtype);
  TORCH_CHECK(sizes, "safetensors: tensor '", spec.name, "': shape ", shape_text(spec.shape), " x ",
              dtype_name(spec.dtype), " overflows 64-bit element or byte counts");
  return sizes->second;
}

std::vector<FilePlan> plan_files(const std::vector<TensorSpec>& specs, int64_t max_file_bytes) {
  TORCH_CHECK(max_file_bytes > 0, "safetensors: the largest file size must be positive, got ", max_file_bytes);
  std::vector<FilePlan> files(1);
  for (size_t i = 0; i < specs.size(); ++i) {
    const int64_t b = nbytes(specs[i]);
    int64_t with = 0;
    const bool overflow = __builtin_add_overflow(files.back().bytes, b, &with);
    if (!files.back().specs.empty() && (overflow || with > max_file_bytes)) files.emplace_back();
    files.back().specs.push_back(i);
    files.back().bytes += b;  // a tensor alone in its file: b itself
  }
  const size_t n = files.size();
  for (size_t f = 0; f < n; ++f) {
    char name[64];
    if (n == 1) std::snprintf(name, sizeof name, "model.safetensors");
    else std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", f + 1, n);
    files[f].name = name;
  }
  return files;
}

std::map<std::string, std::string> read_index(const std::string& path) {
  std::error_code ec;
  TORCH_CHECK(std::filesystem::is_regular_file(path, ec), "safetensors: index ", path, " is not a regular file");
  const auto size = std::filesystem::file_size(path, ec);
  TORCH_CHECK(!ec && size <= static_cast<uintmax_t>(kMaxIndexBytes), "safetensors: index ", path, " is ",
              ec ? std::string("unreadable") : std::to_string(size) + " bytes", " (limit ", kMaxIndexBytes, ")");
  std::ifstream f(path);
  TORCH_CHECK(f, "safetensors: cannot open index ", path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "safetensors: index ", path, " is not valid JSON: ", e.what());
  }
  TORCH_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(), "safetensors: index ", path,
              " has no \"weight_map\" object");
  std::map<std::string, std::string> out;
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    TORCH_CHECK(it.value().is_string(), "safetensors: index ", path, ": file of '", it.key(), "' is not a string");
    out[it.key()] = it.value().get<std::string>();
  }
  return out;
}

void save_index(const std::string& path, const std::map<std::string, std::string>& weight_map, int64_t total_size) {
  nlohmann::json j = {{"metadata", {{"total_size", total_size}}}, {"weight_map", weight_map}};
  const std::string text = j.dump(2) + "\n";
  util::write_file_atomic(path, text, util::DirSync::No, "safetensors");
}

}  // namespace fsdp::checkpoint::safetensors
