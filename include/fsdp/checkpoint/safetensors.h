#pragma once
// A small reader/writer for the safetensors format (Hugging Face's, also written by PyTorch tooling):
//
//   u64 little-endian N | N bytes of UTF-8 JSON header (space-padded) | raw little-endian row-major data
//   header: {"<name>": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ..., "__metadata__": {..}}
//
// data_offsets are relative to the start of the data section. The reader reads lazily with positioned reads,
// so a checkpoint loader can fetch one tensor (or a range of its dim-0 rows, i.e. one FSDP shard) without
// reading the rest of the file. The writer streams tensors one by one into a temporary file and renames it
// into place when complete, so a crash never leaves a half-written file under the final name.
//
// Only little-endian hosts are supported (checked at run time), as in the reference implementation.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::checkpoint::safetensors {

// "F32" <-> at::kFloat etc. Supported: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL F8_E4M3 F8_E5M2 (+ U16/U32/U64
// where libtorch has them). Throws naming the dtype otherwise.
std::string dtype_name(c10::ScalarType dtype);
c10::ScalarType dtype_from_name(const std::string& name);

struct TensorInfo {
  std::string name;
  c10::ScalarType dtype = c10::kFloat;
  std::vector<int64_t> shape;
  int64_t begin = 0;  // byte offsets into the data section, [begin, end)
  int64_t end = 0;
  int64_t numel() const;
  int64_t nbytes() const { return end - begin; }
};

// Reads a safetensors file. The header is parsed and validated on open (offsets in bounds, sizes consistent
// with shape x dtype, no overlaps, data section fully covered); tensors are read on demand.
class Reader {
 public:
  explicit Reader(const std::string& path);
  ~Reader();
  Reader(Reader&&) noexcept;
  Reader& operator=(Reader&&) noexcept;

  const std::string& path() const;
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;  // error naming the file and the tensor when absent
  const std::map<std::string, std::string>& metadata() const;

  // A new CPU tensor holding the whole tensor.
  at::Tensor read(const std::string& name) const;
  // Rows [row_begin, row_begin + row_count) of dim 0 (a dim-0 shard), as a new CPU tensor.
  at::Tensor read_rows(const std::string& name, int64_t row_begin, int64_t row_count) const;
  // Reads into an existing tensor of the same shape (any device or dtype: the data is read on the CPU in the
  // file's dtype and copied/cast into `dst`). Used to load weights into parameters in place.
  void read_into(const std::string& name, const at::Tensor& dst) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Every tensor of a file, by name (CPU tensors in the file's dtypes).
std::map<std::string, at::Tensor> load_file(const std::string& path);

// Writes tensors (any device, any layout: made contiguous on the CPU one at a time) in the given order, with
// optional string metadata. Names must be unique and non-empty and may not be "__metadata__".
void save_file(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
               const std::map<std::string, std::string>& metadata = {});

// Streaming writer: the header is computed from `specs` (name, dtype, shape), then produce(i) is called for each
// spec in order and must return a tensor of exactly that dtype and shape; it is written and released before the
// next one is produced, so only one tensor is in memory at a time. Same atomicity as save_file.
struct TensorSpec {
  std::string name;
  c10::ScalarType dtype = c10::kFloat;
  std::vector<int64_t> shape;
};
void save_file_streamed(const std::string& path, const std::vector<TensorSpec>& specs,
                        const std::function<at::Tensor(size_t)>& produce,
                        const std::map<std::string, std::string>& metadata = {});

// How a set of tensors (in order) is split over files of at most max_file_bytes of tensor data (a larger
// tensor gets a file of its own): one file is "model.safetensors", several are "model-0000i-of-0000N.safetensors"
// (Hugging Face's names, described by an index, below).
struct FilePlan {
  std::string name;
  std::vector<size_t> specs;  // indices into the specs, in order
  int64_t bytes = 0;
};
int64_t nbytes(const TensorSpec& spec);
std::vector<FilePlan> plan_files(const std::vector<TensorSpec>& specs, int64_t max_file_bytes);

// Sharded sets (Hugging Face layout): model.safetensors.index.json =
//   {"metadata": {"total_size": <bytes>}, "weight_map": {"<tensor name>": "<file name>", ...}}
// read_index returns the weight map (tensor -> file name relative to the index's directory); save_index writes
// one (atomically, like save_file).
std::map<std::string, std::string> read_index(const std::string& path);
void save_index(const std::string& path, const std::map<std::string, std::string>& weight_map, int64_t total_size);

}  // namespace fsdp::checkpoint::safetensors
