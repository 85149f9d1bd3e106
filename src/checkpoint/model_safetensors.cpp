// A sharded model to and from safetensors files (see include/fsdp/checkpoint/model_safetensors.h).
//
// Export gathers one tensor at a time (ShardedTensor::full_tensor, collective) and rank 0 streams it into the
// current file before the next is gathered. Every rank walks the same key list in the same order, so the
// gathers match; if rank 0's writing fails it keeps gathering (without writing) until the list is done, and
// the error is then broadcast, so no rank is left waiting in a collective.
//
// Import reads, on every rank, only the dim-0 rows its own pieces cover (Reader::read_rows: positioned reads
// of those bytes), and loads them through load_sharded_state_dict like any sharded state.
#include <fsdp/checkpoint/model_safetensors.h>
#include <fsdp/util/timer.h>

#include "checkpoint/agreement.h"
#include "checkpoint/model_safetensors_impl.h"
#include "checkpoint/storage.h"

#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/process_group.h>
#include <fsdp/state_dict.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <filesystem>
#include <algorithm>
#include <memory>
#include <set>

namespace fsdp::checkpoint {
namespace fs = std::filesystem;
namespace st = safetensors;
using namespace detail;

namespace {

using Clock = util::SteadyClock;

constexpr const char* kIndexName = "model.safetensors.index.json";

// Files of an earlier export with another split ("model.safetensors", "model-*-of-*.safetensors", the index)
// that the new set does not contain: left in place they would shadow or contradict the new files.
void remove_stale_files(const fs::path& dir, const std::set<std::string>& keep) {
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    const bool ours = name == "model.safetensors" || name == kIndexName ||
                      (name.rfind("model-", 0) == 0 && name.find("-of-") != std::string::npos &&
                       name.size() > 12 && name.compare(name.size() - 12, 12, ".safetensors") == 0);
    if (ours && !keep.count(name)) fs::remove(entry.path());
  }
}

}  // namespace

namespace detail {
// tensor name -> file, for a single file, an index, or a directory holding either.
std::map<std::string, std::string> resolve_files(const std::string& path) {
  fs::path p(path);
  TORCH_CHECK(fs::exists(p), "import_safetensors: ", path, " does not exist");
  if (fs::is_directory(p)) {
    if (fs::exists(p / kIndexName)) p /= kIndexName;
    else if (fs::exists(p / "model.safetensors")) p /= "model.safetensors";
    else TORCH_CHECK(false, "import_safetensors: ", path, " holds neither ", kIndexName, " nor model.safetensors");
  }
  std::map<std::string, std::string> where;
  if (p.extension() == ".json") {
    for (const auto& [name, file] : st::read_index(p.string())) {
      const fs::path f = p.parent_path() / file;
      TORCH_CHECK(fs::path(file).filename().string() == file, "import_safetensors: ", p.string(), " maps '", name,
                  "' to '", file, "', which is not a file name in the index's directory");
      where[name] = f.string();
    }
  } else {
    st::Reader r(p.string());
    for (const auto& name : r.names()) where[name] = p.string();
  }
  return where;
}
}  // namespace detail

namespace {

// This rank's piece of `t` read from `reader`: the rows its box covers along dim 0 (only those bytes), then
// narrowed along the other dims when the piece does not span them (a Shard on another dim).
// `file_rows` (when not empty) gives the file row of each of the piece's rows: they are read as runs of
// consecutive file rows (still only the piece's own rows) and put in the piece's order.
at::Tensor read_piece(const st::Reader& reader, const std::string& name, const ShardedTensor& t, int64_t& bytes,
                      const std::vector<int64_t>& file_rows) {
  const at::Tensor& local = t.local();
  if (t.dim() == 0) {
    at::Tensor whole = reader.read(name);
    bytes += whole.nbytes();
    return whole;
  }
  const std::vector<int64_t> offset = t.local_offset();
  at::Tensor rows;
  if (file_rows.empty()) {
    rows = reader.read_rows(name, offset[0], local.size(0));
  } else {
    TORCH_CHECK(static_cast<int64_t>(file_rows.size()) == local.size(0), "import_safetensors: '", name,
                "': row map of ", file_rows.size(), " rows for a piece of ", local.size(0));
    std::vector<int64_t> sorted = file_rows;
    std::sort(sorted.begin(), sorted.end());
    sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
    std::vector<at::Tensor> runs;
    for (size_t i = 0; i < sorted.size();) {
      size_t j = i + 1;
      while (j < sorted.size() && sorted[j] == sorted[j - 1] + 1) ++j;
      runs.push_back(reader.read_rows(name, sorted[i], static_cast<int64_t>(j - i)));
      i = j;
    }
    at::Tensor gathered = runs.size() == 1 ? runs[0] : at::cat(runs);
    std::vector<int64_t> pick;
    for (int64_t r : file_rows) pick.push_back(std::lower_bound(sorted.begin(), sorted.end(), r) - sorted.begin());
    rows = gathered.index_select(0, at::tensor(pick, at::kLong));
  }
  bytes += rows.nbytes();
  for (int64_t d = 1; d < t.dim(); ++d) {
    if (local.size(d) != t.sizes()[d]) rows = rows.narrow(d, offset[d], local.size(d));
  }
  return rows.contiguous();
}

}  // namespace

SafetensorsExportResult export_safetensors(torch::nn::Module& root, const std::string& dir,
                                           const SafetensorsExportOptions& options) {
  return detail::export_safetensors(root, dir, options, detail::KeyAdapter{});
}

SafetensorsImportResult import_safetensors(torch::nn::Module& root, const std::string& path,
                                           const SafetensorsImportOptions& options) {
  return detail::import_safetensors(root, path, options, detail::KeyAdapter{});
}

namespace detail {

SafetensorsExportResult export_safetensors(torch::nn::Module& root, const std::string& dir,
                                           const SafetensorsExportOptions& options, const KeyAdapter& adapter) {
  const auto start = Clock::now();
  const ProcessGroupPtr group = resolve_group(nullptr);
  const bool writer = !group || group->rank() == 0;
  const ShardedStateDict state = sharded_state_dict(root);

  std::vector<const ShardedTensor*> tensors;
  std::vector<std::string> keys;
  std::vector<st::TensorSpec> specs;
  for (const auto& [name, t] : state) {
    std::optional<std::string> file_name = adapter.file_name ? adapter.file_name(name) : std::optional<std::string>(name);
    if (!file_name) continue;
    c10::ScalarType dtype = t.dtype();
    if (options.dtype && at::isFloatingType(dtype)) dtype = *options.dtype;
    specs.push_back({*file_name, dtype, t.sizes()});
    tensors.push_back(&t);
    keys.push_back(name);
  }
  const std::vector<st::FilePlan> files = st::plan_files(specs, options.max_file_bytes);
  std::map<std::string, std::string> metadata = options.metadata;
  metadata.emplace("format", "pt");

  // The next tensor to gather; every rank gathers them all, in order, exactly once.
  size_t next = 0;
  auto gather = [&](size_t k) {
    TORCH_CHECK(k == next, "export_safetensors: internal error: tensor ", k, " gathered out of order");
    ++next;
    at::Tensor full = tensors[k]->full_tensor();
    if (adapter.to_file) full = adapter.to_file(keys[k], full);
    if (full.scalar_type() != specs[k].dtype) full = full.to(specs[k].dtype);
    return full;
  };

  SafetensorsExportResult result;
  std::string error;
  if (writer) {
    try {
      fs::create_directories(dir);
      std::map<std::string, std::string> weight_map;
      std::set<std::string> names;
      for (const auto& file : files) {
        std::vector<st::TensorSpec> mine;
        for (size_t i : file.specs) {
          mine.push_back(specs[i]);
          weight_map[specs[i].name] = file.name;
        }
        const size_t first = file.specs.empty() ? 0 : file.specs.front();
        const std::string path = (fs::path(dir) / file.name).string();
        st::save_file_streamed(path, mine, [&](size_t i) { return gather(first + i); }, metadata);
        result.files.push_back(path);
        names.insert(file.name);
        result.total_bytes += file.bytes;
      }
      if (files.size() > 1) {
        const std::string index = (fs::path(dir) / kIndexName).string();
        st::save_index(index, weight_map, result.total_bytes);
        result.files.push_back(index);
        names.insert(kIndexName);
      }
      for (const auto& [name, text] : adapter.extra_files) {
        const std::string path = (fs::path(dir) / name).string();
        write_file_atomic(path, text);
        result.files.push_back(path);
      }
      remove_stale_files(dir, names);
    } catch (const std::exception& e) {
      error = error_text(e);
    }
  }
  while (next < tensors.size()) gather(next);  // other ranks: every gather; rank 0: the rest after a failure
  error = broadcast_string(group, error);
  TORCH_CHECK(error.empty(), "export_safetensors to ", dir, " failed on rank 0: ", error);
  if (!writer) {
    for (const auto& file : files) result.total_bytes += file.bytes;
  }
  result.seconds = util::seconds_since(start);
  return result;
}

SafetensorsImportResult import_safetensors(torch::nn::Module& root, const std::string& path,
                                           const SafetensorsImportOptions& options, const KeyAdapter& adapter) {
  const auto start = Clock::now();
  const ProcessGroupPtr group = resolve_group(nullptr);
  SafetensorsImportResult result;
  std::string error;
  try {
    const std::map<std::string, std::string> where = resolve_files(path);
    const ShardedStateDict current = sharded_state_dict(root);
    std::map<std::string, std::string> file_name;  // model key -> file tensor
    std::set<std::string> wanted;
    for (const auto& [name, t] : current) {
      std::optional<std::string> f = adapter.file_name ? adapter.file_name(name) : std::optional<std::string>(name);
      if (!f) continue;
      file_name[name] = *f;
      wanted.insert(*f);
    }
    for (const auto& [name, file] : where) {
      if (!wanted.count(name) && !(adapter.ignorable && adapter.ignorable(name))) result.unexpected.push_back(name);
    }
    for (const auto& [name, f] : file_name) {
      if (!where.count(f)) result.missing.push_back(f);
    }
    TORCH_CHECK(!options.strict || (result.missing.empty() && result.unexpected.empty()), "import_safetensors from ",
                path, ": keys do not match the model (strict load). Missing from the files: [",
                list_names(result.missing), "]; in the files but not in the model: [", list_names(result.unexpected),
                "]");
    std::map<std::string, std::unique_ptr<st::Reader>> readers;  // opened once per file
    ShardedStateDict loaded;
    for (const auto& [name, t] : current) {
      auto fn = file_name.find(name);
      auto w = fn == file_name.end() ? where.end() : where.find(fn->second);
      if (w == where.end()) {
        loaded.emplace(name, t);  // non-strict: keeps its value
        continue;
      }
      const std::string& fname = fn->second;
      auto& reader = readers[w->second];
      if (!reader) reader = std::make_unique<st::Reader>(w->second);
      const st::TensorInfo& info = reader->info(fname);
      TORCH_CHECK(info.shape == t.sizes(), "import_safetensors: '", fname, "' in ", w->second, " has shape ",
                  c10::IntArrayRef(info.shape), " but the model's '", name, "' is ", c10::IntArrayRef(t.sizes()));
      std::vector<int64_t> rows;
      if (adapter.file_rows && t.dim() > 0) rows = adapter.file_rows(name, t.local_offset()[0], t.local().size(0));
      at::Tensor piece = read_piece(*reader, fname, t, result.bytes_read, rows);
      piece = piece.to(t.local().options());
      loaded.emplace(name, ShardedTensor::from_local(piece, t.mesh(), t.placements(), t.sizes()));
    }
    load_sharded_state_dict(root, loaded);
  } catch (const std::exception& e) {
    error = (group ? "rank " + std::to_string(group->rank()) + ": " : std::string()) + error_text(e);
  }
  error = first_error(group, error);
  TORCH_CHECK(error.empty(), error);
  result.seconds = util::seconds_since(start);
  return result;
}

}  // namespace detail
}  // namespace fsdp::checkpoint
