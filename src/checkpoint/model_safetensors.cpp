// A sharded model to and from safetensors files (see include/fsdp/checkpoint/model_safetensors.h).
//
// Export gathers one tensor at a time (ShardedTensor::full_tensor, collective) and rank 0 streams it into the
// current file before the next is gathered. Every rank walks the same key list in the same order, so the
// gathers match; if rank 0's writing fails it keeps gathering (without writing) until the list is done, and
// the error is then broadcast, so no rank is left waiting in a collective.
//
// Import reads, on every rank, only the dim-0 rows its own pieces cover (Reader::read_rows: positioned reads
// of those bytes), and loads them through load_sharded_state_dict like any sharded state.
//
// Under pipeline parallelism (options.parts: the stages this rank trains) export has each key gathered by the
// ranks of its stage and sent by the lowest of them to rank 0 (one tensor in flight at a time); import reads
// and loads only the stages' own pieces. A file tensor may be made of several model keys (KeyAdapter::file_slice:
// Hugging Face's stacked gate_up_proj = our experts' w1 and w3), gathered one key at a time.
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
#include <optional>
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
// `slice` (when set): the model tensor is that slice of the file tensor (FileSlice), so the piece's coordinates
// are shifted by its offset along its dim.
at::Tensor read_piece(const st::Reader& reader, const std::string& name, const ShardedTensor& t, int64_t& bytes,
                      const std::vector<int64_t>& file_rows, const std::optional<FileSlice>& slice = std::nullopt) {
  const at::Tensor& local = t.local();
  if (t.dim() == 0) {
    at::Tensor whole = reader.read(name);
    bytes += whole.nbytes();
    return whole;
  }
  std::vector<int64_t> offset = t.local_offset();
  if (slice) offset[static_cast<size_t>(slice->dim)] += slice->offset;
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
    if (local.size(d) != rows.size(d)) rows = rows.narrow(d, offset[d], local.size(d));
  }
  return rows.contiguous();
}

// This rank's piece of `t`, a model tensor stored as one file tensor per index of its dim 0 (`names`, located by
// `where`): the tensors of the piece's own indices, each read for the piece's rows of its dim 1 only and narrowed
// along the others, stacked.
at::Tensor read_stacked_piece(std::map<std::string, std::unique_ptr<st::Reader>>& readers,
                              const std::map<std::string, std::string>& where, const std::vector<std::string>& names,
                              const std::string& key, const ShardedTensor& t, int64_t& bytes) {
  const at::Tensor& local = t.local();
  const std::vector<int64_t> offset = t.local_offset();
  const std::vector<int64_t> row_shape(t.sizes().begin() + 1, t.sizes().end());
  std::vector<at::Tensor> rows;
  for (int64_t i = 0; i < local.size(0); ++i) {
    const std::string& name = names[static_cast<size_t>(offset[0] + i)];
    const std::string& file = where.at(name);
    auto& reader = readers[file];
    if (!reader) reader = std::make_unique<st::Reader>(file);
    const st::TensorInfo& info = reader->info(name);
    check_loadable_dtype("import_safetensors", name, file, info.dtype, key, t.dtype());
    TORCH_CHECK(info.shape == row_shape, "import_safetensors: '", name, "' in ", file, " has shape ",
                c10::IntArrayRef(info.shape), " but is index ", offset[0] + i, " of the model's '", key, "' (",
                c10::IntArrayRef(t.sizes()), "): expected ", c10::IntArrayRef(row_shape));
    at::Tensor row = t.dim() > 1 ? reader->read_rows(name, offset[1], local.size(1)) : reader->read(name);
    bytes += row.nbytes();
    for (int64_t d = 2; d < t.dim(); ++d) {
      if (local.size(d) != row.size(d - 1)) row = row.narrow(d - 1, offset[d], local.size(d));
    }
    rows.push_back(row);
  }
  if (rows.empty()) return at::empty(local.sizes(), local.options().device(at::kCPU));
  return at::stack(rows).contiguous();
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

void check_loadable_dtype(const std::string& who, const std::string& file_tensor, const std::string& file,
                          c10::ScalarType file_dtype, const std::string& key, c10::ScalarType model_dtype) {
  TORCH_CHECK(!at::isFloatingType(model_dtype) || at::isFloatingType(file_dtype), who, ": '", file_tensor, "' in ",
              file, " has dtype ", c10::toString(file_dtype), " but the model's '", key, "' is ",
              c10::toString(model_dtype), " (an integer or bool tensor is not a floating-point weight)");
}

namespace {

// One tensor of the files: the model keys it is made of (one, or the slices of a file tensor in offset order).
struct FileEntry {
  st::TensorSpec spec;
  std::vector<size_t> parts;  // indices into the state's keys
  int64_t dim = 0;            // the slices' dimension (several parts)
};

// The file tensors of `keys` (state order), each built from its slices or its one key; every rank computes the
// same list from the same keys.
std::vector<FileEntry> plan_entries(const std::vector<std::string>& keys, const std::vector<const ShardedTensor*>& tensors,
                                    const SafetensorsExportOptions& options, const KeyAdapter& adapter) {
  std::vector<FileEntry> entries;
  std::map<std::string, size_t> entry_of;  // file name -> entries index
  std::vector<std::vector<std::pair<int64_t, size_t>>> slices;  // per entry: (offset, key index)
  for (size_t i = 0; i < keys.size(); ++i) {
    const ShardedTensor& t = *tensors[i];
    std::optional<FileSlice> slice = adapter.file_slice ? adapter.file_slice(keys[i]) : std::nullopt;
    std::optional<std::string> file_name =
        slice ? std::optional<std::string>(slice->file_name)
              : (adapter.file_name ? adapter.file_name(keys[i]) : std::optional<std::string>(keys[i]));
    if (!file_name) continue;
    c10::ScalarType dtype = t.dtype();
    if (options.dtype && at::isFloatingType(dtype)) dtype = *options.dtype;
    auto [it, fresh] = entry_of.emplace(*file_name, entries.size());
    if (fresh) {
      entries.push_back({{*file_name, dtype, t.sizes()}, {}, slice ? slice->dim : 0});
      slices.emplace_back();
    }
    FileEntry& e = entries[it->second];
    TORCH_CHECK(fresh || slice, "export_safetensors: '", keys[i], "' and another key both map to '", *file_name, "'");
    if (slice) {
      TORCH_CHECK(slice->dim >= 0 && slice->dim < t.dim() && slice->dim == e.dim, "export_safetensors: '", keys[i],
                  "': slice of '", *file_name, "' along dim ", slice->dim, " (the file tensor's slices use dim ", e.dim,
                  ", the key has ", t.dim(), " dims)");
      slices[it->second].emplace_back(slice->offset, i);
    } else {
      e.parts.push_back(i);
    }
  }
  for (size_t k = 0; k < entries.size(); ++k) {
    if (slices[k].empty()) continue;
    FileEntry& e = entries[k];
    std::sort(slices[k].begin(), slices[k].end());
    int64_t extent = 0;
    for (const auto& [offset, i] : slices[k]) {
      const std::vector<int64_t>& sizes = tensors[i]->sizes();
      TORCH_CHECK(offset == extent, "export_safetensors: '", keys[i], "' is the slice at ", offset, " of '",
                  e.spec.name, "' along dim ", e.dim, ", but the slices before it end at ", extent);
      for (int64_t d = 0; d < static_cast<int64_t>(sizes.size()); ++d) {
        TORCH_CHECK(d == e.dim || sizes[d] == e.spec.shape[d], "export_safetensors: '", keys[i], "' (", c10::IntArrayRef(sizes),
                    ") does not fit next to the other slices of '", e.spec.name, "' (", c10::IntArrayRef(e.spec.shape), ")");
      }
      extent += sizes[e.dim];
      e.parts.push_back(i);
    }
    e.spec.shape[e.dim] = extent;
  }
  return entries;
}

// The root's state with the parts' entries in place of the root's (pipeline parallelism: the stages this rank
// trains; the root's other entries only name the keys and shapes). `held[key]`: this rank holds the tensor.
ShardedStateDict state_with_parts(torch::nn::Module& root, const std::vector<torch::nn::Module*>& parts,
                                  std::map<std::string, bool>& held) {
  ShardedStateDict state = sharded_state_dict(root);
  for (const auto& [name, t] : state) held[name] = parts.empty();
  for (torch::nn::Module* part : parts) {
    TORCH_CHECK(part, "export_safetensors / import_safetensors: null part");
    for (auto& [name, t] : sharded_state_dict(*part)) {
      TORCH_CHECK(state.count(name), "export_safetensors / import_safetensors: the part's key '", name,
                  "' is not a key of the whole model (a stage must keep the whole model's FQNs)");
      state.insert_or_assign(name, t);
      held[name] = true;
    }
  }
  return state;
}

}  // namespace

SafetensorsExportResult export_safetensors(torch::nn::Module& root, const std::string& dir,
                                           const SafetensorsExportOptions& options, const KeyAdapter& adapter) {
  const auto start = Clock::now();
  const ProcessGroupPtr group = resolve_group(nullptr);
  const bool writer = !group || group->rank() == 0;
  std::map<std::string, bool> held_by_name;
  const ShardedStateDict state = state_with_parts(root, options.parts, held_by_name);

  std::vector<const ShardedTensor*> tensors;
  std::vector<std::string> keys;
  std::vector<bool> held;
  for (const auto& [name, t] : state) {
    tensors.push_back(&t);
    keys.push_back(name);
    held.push_back(held_by_name.at(name));
  }
  const std::vector<FileEntry> entries = plan_entries(keys, tensors, options, adapter);
  std::vector<st::TensorSpec> specs;
  for (const auto& e : entries) specs.push_back(e.spec);
  // Tensors no model key holds follow the model's (written by the writer alone: no collective).
  std::vector<at::Tensor> extras;
  for (const auto& [name, t] : adapter.extra_tensors) {
    for (const auto& spec : specs) {
      TORCH_CHECK(spec.name != name, "export_safetensors: the extra tensor '", name, "' is also a model tensor's name");
    }
    at::Tensor x = t.detach().to(at::kCPU).contiguous();
    if (options.dtype && at::isFloatingType(x.scalar_type())) x = x.to(*options.dtype);
    specs.push_back({name, x.scalar_type(), x.sizes().vec()});
    extras.push_back(x);
  }
  const std::vector<st::FilePlan> files = st::plan_files(specs, options.max_file_bytes);
  std::map<std::string, std::string> metadata = options.metadata;
  metadata.emplace("format", "pt");

  // Under pipeline parallelism each rank holds only its stages' tensors: every key is gathered by the ranks
  // holding it (over its own mesh) and sent by the lowest of them to the writer. Whether this is such a model is
  // agreed over the group, and so is each key's sender.
  std::vector<int64_t> sender(keys.size(), 0);
  bool owned_by_stages = false;
  if (group && group->size() > 1) {
    at::Tensor flag = at::full({1}, options.parts.empty() ? 0 : 1,
                               at::TensorOptions().dtype(at::kLong).device(group->device()));
    group->all_reduce(flag, ReduceOp::Max).wait();
    owned_by_stages = flag.item<int64_t>() != 0;
    TORCH_CHECK(!owned_by_stages || !options.parts.empty(), "export_safetensors: other ranks export pipeline ",
                "stages (SafetensorsExportOptions::parts), this rank gave none");
    if (owned_by_stages && !keys.empty()) {
      std::vector<int64_t> mine(keys.size(), group->size());
      for (size_t i = 0; i < keys.size(); ++i)
        if (held[i]) mine[i] = group->rank();
      at::Tensor owners = at::tensor(mine, at::kLong).to(group->device());
      group->all_reduce(owners, ReduceOp::Min).wait();
      owners = owners.cpu();
      for (size_t i = 0; i < keys.size(); ++i) {
        sender[i] = owners[static_cast<int64_t>(i)].item<int64_t>();
        TORCH_CHECK(sender[i] < group->size(), "export_safetensors: no rank's stages hold '", keys[i], "'");
      }
    }
  }
  // Key i's full tensor on the writer (undefined elsewhere); collective for the ranks holding it.
  auto full_of = [&](size_t i) -> at::Tensor {
    if (!owned_by_stages) return tensors[i]->full_tensor();
    at::Tensor full;
    if (held[i]) full = tensors[i]->full_tensor();
    const int tag = static_cast<int>(i);
    if (sender[i] == group->rank() && !writer) {
      group->send(full.contiguous(), 0, tag).wait();
      return {};
    }
    if (writer && sender[i] != group->rank()) {
      full = at::empty(tensors[i]->sizes(),
                       at::TensorOptions().dtype(tensors[i]->dtype()).device(group->device()));
      group->recv(full, static_cast<int>(sender[i]), tag).wait();
    }
    return writer ? full : at::Tensor();
  };

  // The next tensor to gather; every rank gathers them all, in order, exactly once.
  size_t next = 0;
  auto gather = [&](size_t k) {
    TORCH_CHECK(k == next, "export_safetensors: internal error: tensor ", k, " gathered out of order");
    ++next;
    if (k >= entries.size()) return extras[k - entries.size()];
    const FileEntry& e = entries[k];
    at::Tensor full;
    if (e.parts.size() == 1) {
      full = full_of(e.parts[0]);
      if (full.defined() && adapter.to_file) full = adapter.to_file(keys[e.parts[0]], full);
    } else {
      // One slice gathered at a time; the writer joins them (what the file tensor holds).
      std::vector<at::Tensor> pieces;
      for (size_t i : e.parts) pieces.push_back(full_of(i));
      if (pieces.front().defined()) full = at::cat(pieces, e.dim);
    }
    if (full.defined() && full.scalar_type() != e.spec.dtype) full = full.to(e.spec.dtype);
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
  while (next < entries.size()) gather(next);  // other ranks: every gather; rank 0: the rest after a failure
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
    std::map<std::string, bool> held;
    const ShardedStateDict current = state_with_parts(root, options.parts, held);
    std::map<std::string, std::string> file_name;  // model key -> file tensor
    std::map<std::string, FileSlice> slice_of;     // model key -> its slice of file_name[key] (FileSlice keys)
    std::map<std::string, std::vector<std::string>> stack_of;  // model key -> a file tensor per dim-0 index
    std::set<std::string> wanted;
    for (const auto& [name, t] : current) {
      std::vector<std::string> stack =
          adapter.file_stack && t.dim() > 0 ? adapter.file_stack(name, t.sizes()[0]) : std::vector<std::string>{};
      if (!stack.empty()) {
        TORCH_CHECK(static_cast<int64_t>(stack.size()) == t.sizes()[0], "import_safetensors: '", name, "': ",
                    stack.size(), " file tensors for its ", t.sizes()[0], " rows");
        for (const auto& f : stack) {
          wanted.insert(f);
          if (!where.count(f)) result.missing.push_back(f);
        }
        stack_of.emplace(name, std::move(stack));
        continue;
      }
      std::optional<FileSlice> slice = adapter.file_slice ? adapter.file_slice(name) : std::nullopt;
      if (slice) slice_of.emplace(name, *slice);
      std::optional<std::string> f =
          slice ? std::optional<std::string>(slice->file_name)
                : (adapter.file_name ? adapter.file_name(name) : std::optional<std::string>(name));
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
      if (!held.at(name)) continue;  // another pipeline stage's: read by the ranks holding it
      if (auto stack = stack_of.find(name); stack != stack_of.end()) {
        const bool complete = std::all_of(stack->second.begin(), stack->second.end(),
                                          [&](const std::string& f) { return where.count(f) > 0; });
        if (!complete) {
          loaded.emplace(name, t);  // non-strict: keeps its value
          continue;
        }
        at::Tensor piece = read_stacked_piece(readers, where, stack->second, name, t, result.bytes_read);
        loaded.emplace(name, ShardedTensor::from_local(piece.to(t.local().options()), t.mesh(), t.placements(),
                                                       t.sizes()));
        continue;
      }
      if (w == where.end()) {
        loaded.emplace(name, t);  // non-strict: keeps its value
        continue;
      }
      const std::string& fname = fn->second;
      auto& reader = readers[w->second];
      if (!reader) reader = std::make_unique<st::Reader>(w->second);
      const st::TensorInfo& info = reader->info(fname);
      check_loadable_dtype("import_safetensors", fname, w->second, info.dtype, name, t.dtype());
      auto sl = slice_of.find(name);
      const std::optional<FileSlice> slice = sl == slice_of.end() ? std::nullopt : std::optional<FileSlice>(sl->second);
      if (slice) {
        // The file tensor must hold the slice: the model's shape but along the slice dim, long enough.
        bool fits = info.shape.size() == t.sizes().size() && slice->dim >= 0 && slice->dim < t.dim() && slice->offset >= 0;
        for (size_t d = 0; fits && d < info.shape.size(); ++d) {
          fits = static_cast<int64_t>(d) == slice->dim ? info.shape[d] >= slice->offset + t.sizes()[d]
                                                      : info.shape[d] == t.sizes()[d];
        }
        TORCH_CHECK(fits, "import_safetensors: '", fname, "' in ", w->second, " has shape ", c10::IntArrayRef(info.shape),
                    ", which does not hold the model's '", name, "' (", c10::IntArrayRef(t.sizes()), ") at offset ",
                    slice->offset, " of dim ", slice->dim);
      } else {
        TORCH_CHECK(info.shape == t.sizes(), "import_safetensors: '", fname, "' in ", w->second, " has shape ",
                    c10::IntArrayRef(info.shape), " but the model's '", name, "' is ", c10::IntArrayRef(t.sizes()));
      }
      std::vector<int64_t> rows;
      if (adapter.file_rows && t.dim() > 0) rows = adapter.file_rows(name, t.local_offset()[0], t.local().size(0));
      at::Tensor piece = read_piece(*reader, fname, t, result.bytes_read, rows, slice);
      piece = piece.to(t.local().options());
      loaded.emplace(name, ShardedTensor::from_local(piece, t.mesh(), t.placements(), t.sizes()));
    }
    if (options.parts.empty()) {
      load_sharded_state_dict(root, loaded);
    } else {
      for (torch::nn::Module* part : options.parts) {  // each stage its own keys
        ShardedStateDict mine;
        for (const auto& [name, t] : sharded_state_dict(*part)) mine.emplace(name, loaded.at(name));
        load_sharded_state_dict(*part, mine);
      }
    }
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
