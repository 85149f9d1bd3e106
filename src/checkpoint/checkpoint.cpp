// Distributed checkpoint save/load (see include/fsdp/checkpoint/checkpoint.h): save() hands its state's pieces
// to the one save loop (codec.h, either format); load() and the inspection calls read through OpenCheckpoint
// (either format) with the parallel piece reader below.
#include <fsdp/checkpoint/checkpoint.h>
#include <fsdp/util/timer.h>

#include "checkpoint/agreement.h"
#include "checkpoint/codec.h"
#include "checkpoint/format.h"
#include "checkpoint/open_checkpoint.h"
#include "checkpoint/planning.h"
#include "checkpoint/storage.h"

#include <fsdp/checkpoint/safetensors.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <filesystem>
#include <iterator>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

namespace fsdp::checkpoint {
namespace fs = std::filesystem;
using namespace detail;

namespace {

using Clock = util::SteadyClock;

bool excluded(const std::string& key, const std::vector<std::string>& prefixes) {
  for (const auto& p : prefixes) {
    if (key.compare(0, p.size(), p) == 0) return true;
  }
  return false;
}

}  // namespace

// ---- StateDict ----------------------------------------------------------------------------------------------

bool StateDict::contains(const std::string& key) const {
  return tensors.count(key) || full.count(key) || values.count(key);
}

void StateDict::merge(StateDict other) {
  for (auto& [k, v] : other.tensors) {
    TORCH_CHECK(!contains(k), "checkpoint: StateDict::merge: key '", k, "' given twice");
    tensors.emplace(k, std::move(v));
  }
  for (auto& [k, v] : other.full) {
    TORCH_CHECK(!contains(k), "checkpoint: StateDict::merge: key '", k, "' given twice");
    full.emplace(k, std::move(v));
  }
  for (auto& [k, v] : other.values) {
    TORCH_CHECK(!contains(k), "checkpoint: StateDict::merge: key '", k, "' given twice");
    values.emplace(k, std::move(v));
  }
}

// ---- save ---------------------------------------------------------------------------------------------------

SaveResult save(const StateDict& state, const std::string& path, const SaveOptions& options) {
  const auto codec = make_codec(options.format, options.block_bytes);
  SaveJob job;
  job.group = options.local_only ? nullptr : resolve_group(options.group);
  job.path = path;
  job.mode = options.direct_io ? FileWriter::Mode::Direct : FileWriter::Mode::Buffered;
  job.world_size = job.group ? job.group->size() : 1;
  job.saved_on = options.saved_on;
  job.block_bytes = options.block_bytes;
  const int rank = job.group ? job.group->rank() : 0;
  const std::string file = codec->data_file_name(rank, 0);
  return save_with_codec(*codec, job, [&](PieceSink& sink) {
    // Rank 0 declares every tensor (also those of which it holds no piece) and writes the whole tensors; each
    // rank writes the sharded pieces that plan_write gives it (replicas once).
    for (const auto& [fqn, t] : state.tensors) {
      if (rank == 0) sink.declare(fqn, t.dtype(), t.sizes());
      const WritePlan plan = plan_write(fqn, t);
      if (plan.write) sink.piece(fqn, t.local(), t.sizes(), plan.box, file);
    }
    if (rank == 0) {
      for (const auto& [fqn, t] : state.full) {
        TORCH_CHECK(t.defined(), "checkpoint: '", fqn, "' is an undefined tensor");
        TORCH_CHECK(!state.tensors.count(fqn), "checkpoint: key '", fqn, "' is both sharded and full");
        sink.declare(fqn, t.scalar_type(), t.sizes().vec());
        if (t.numel() > 0) sink.piece(fqn, t, t.sizes().vec(), Box{std::vector<int64_t>(t.dim(), 0), t.sizes().vec()}, file);
      }
    }
    for (const auto& [key, text] : state.values) sink.value(key, text);
  });
}

// ---- load ---------------------------------------------------------------------------------------------------

namespace {

constexpr int64_t kReadPieceBytes = int64_t(16) << 20;

struct PieceReadStats {
  int64_t bytes = 0;
  int threads = 0;  // threads that took part (the caller's included)
};

// Runs the pieces on up to `threads` threads, in order of their index (so the reads stay roughly sequential
// in each file); the first error stops the others and is raised here.
PieceReadStats read_pieces(const OpenCheckpoint& ck, const std::vector<OpenCheckpoint::FillPiece>& pieces, int threads) {
  std::atomic<size_t> next{0};
  std::atomic<int64_t> bytes{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto work = [&] {
    c10::NoGradGuard no_grad;  // per thread: destinations may be parameters
    try {
      for (size_t i; !failed && (i = next++) < pieces.size();) bytes += ck.read_piece(pieces[i]);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      failed = true;
    }
  };
  const size_t helpers = std::min<size_t>(static_cast<size_t>(threads), pieces.size());
  std::vector<std::thread> pool;
  for (size_t t = 1; t < helpers; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
  return {bytes, static_cast<int>(std::max<size_t>(helpers, 1))};
}

LoadResult load_local(StateDict& state, const std::string& path, const LoadOptions& options) {
  OpenCheckpoint ck(path);
  const Metadata& md = ck.md();
  LoadResult res;
  std::vector<std::string> mismatched;
  auto check_tensor = [&](const std::string& fqn, const std::vector<int64_t>& shape) -> bool {
    auto it = md.tensors.find(fqn);
    if (it == md.tensors.end()) {
      res.missing.push_back(fqn);
      return false;
    }
    if (it->second.shape != shape) {
      std::ostringstream os;
      os << "'" << fqn << "' has shape " << c10::IntArrayRef(it->second.shape) << " in the checkpoint but "
         << c10::IntArrayRef(shape) << " in the state dict";
      mismatched.push_back(os.str());
      return false;
    }
    return true;
  };
  std::vector<std::pair<std::string, std::pair<at::Tensor, Box>>> todo;
  for (auto& [fqn, t] : state.tensors) {
    if (excluded(fqn, options.exclude_prefixes)) continue;
    TORCH_CHECK(t.defined(), "checkpoint::load: '", fqn, "' is an undefined tensor");
    if (!check_tensor(fqn, t.sizes())) continue;
    if (t.local().numel() > 0) todo.push_back({fqn, {t.local(), Box{t.local_offset(), t.local().sizes().vec()}}});
  }
  for (auto& [fqn, t] : state.full) {
    if (excluded(fqn, options.exclude_prefixes)) continue;
    TORCH_CHECK(t.defined(), "checkpoint::load: '", fqn, "' is an undefined tensor");
    if (!check_tensor(fqn, t.sizes().vec())) continue;
    if (t.numel() > 0) todo.push_back({fqn, {t, Box{std::vector<int64_t>(t.dim(), 0), t.sizes().vec()}}});
  }
  std::vector<std::string> value_keys;
  for (auto& [key, v] : state.values) {
    if (excluded(key, options.exclude_prefixes)) continue;
    auto bad = md.unreadable.find(key);
    TORCH_CHECK(bad == md.unreadable.end(), "checkpoint::load from ", path, ": value '", key,
                "' cannot be loaded: ", bad == md.unreadable.end() ? "" : bad->second);
    if (md.values.count(key)) value_keys.push_back(key);
    else res.missing.push_back(key);
  }
  for (const auto& [fqn, _] : md.tensors) {
    if (!state.contains(fqn) && !excluded(fqn, options.exclude_prefixes)) res.unexpected.push_back(fqn);
  }
  for (const auto& [key, _] : md.values) {
    if (!state.contains(key) && !excluded(key, options.exclude_prefixes)) res.unexpected.push_back(key);
  }
  for (const auto& [key, _] : md.unreadable) {
    if (!state.contains(key) && !excluded(key, options.exclude_prefixes)) res.unexpected.push_back(key);
  }
  TORCH_CHECK(mismatched.empty(), "checkpoint::load from ", path, ": ", mismatched.size(), " shape mismatch(es): ",
              list_names(mismatched));
  if (options.strict) {
    TORCH_CHECK(res.missing.empty() && res.unexpected.empty(), "checkpoint::load from ", path, " (strict): ",
                res.missing.size(), " key(s) missing from the checkpoint", res.missing.empty() ? "" : ": ",
                list_names(res.missing), "; ", res.unexpected.size(), " unexpected key(s) in the checkpoint",
                res.unexpected.empty() ? "" : ": ", list_names(res.unexpected));
  }
  TORCH_CHECK(options.read_threads >= 1, "checkpoint::load: read_threads must be >= 1, got ", options.read_threads);
  c10::NoGradGuard no_grad;
  // Both formats: every overlap of a saved chunk with a local piece is an independent piece of work, read on
  // up to read_threads threads (DCP: one archive decoded per piece).
  std::vector<OpenCheckpoint::FillPiece> pieces;
  for (auto& [fqn, dest] : todo) {
    auto p = ck.plan_fill(fqn, dest.first, dest.second, kReadPieceBytes);
    std::move(p.begin(), p.end(), std::back_inserter(pieces));
  }
  const PieceReadStats stats = read_pieces(ck, pieces, options.read_threads);
  res.bytes_read += stats.bytes;
  res.read_threads_used = stats.threads;
  for (const auto& key : value_keys) state.values[key] = md.values.at(key);
  return res;
}

}  // namespace

LoadResult load(StateDict& state, const std::string& path, const LoadOptions& options) {
  const auto t0 = Clock::now();
  const ProcessGroupPtr group = options.local_only ? nullptr : resolve_group(options.group);
  LoadResult res;
  std::string err;
  try {
    res = load_local(state, path, options);
  } catch (const std::exception& e) {
    err = error_text(e);
  }
  const bool failed = any_rank(group, !err.empty());
  TORCH_CHECK(err.empty(), err);
  TORCH_CHECK(!failed, "checkpoint::load from ", path, " failed on another rank (see its error)");
  res.seconds = util::seconds_since(t0);
  return res;
}

// ---- inspection ---------------------------------------------------------------------------------------------

namespace {
CheckpointSummary summarize(const OpenCheckpoint& ck) {
  const Metadata& md = ck.md();
  CheckpointSummary s;
  s.format = ck.format();
  s.unreadable_values = md.unreadable;
  s.version = md.version;
  s.world_size = md.world_size;
  s.saved_on = md.saved_on;
  s.values = md.values;
  s.files = md.files;
  for (const auto& [name, t] : md.tensors) {
    s.tensors.push_back({name, safetensors::dtype_name(t.dtype), t.shape, static_cast<int64_t>(t.chunks.size()), t.nbytes()});
    s.total_bytes += t.nbytes();
  }
  return s;
}
}  // namespace

CheckpointSummary inspect(const std::string& path) { return summarize(OpenCheckpoint(path)); }

struct Reader::Impl {
  explicit Impl(const std::string& path) : ck(path), summary(summarize(ck)) {}
  OpenCheckpoint ck;
  CheckpointSummary summary;
};

Reader::Reader(const std::string& path) : impl_(std::make_unique<Impl>(path)) {}
Reader::~Reader() = default;
Reader::Reader(Reader&&) noexcept = default;
Reader& Reader::operator=(Reader&&) noexcept = default;
const CheckpointSummary& Reader::summary() const { return impl_->summary; }

at::Tensor Reader::read(const std::string& name) {
  auto it = impl_->ck.md().tensors.find(name);
  TORCH_CHECK(it != impl_->ck.md().tensors.end(), "checkpoint: ", impl_->ck.dir(), " has no tensor '", name, "'");
  return read_rows(name, 0, it->second.shape.empty() ? 1 : it->second.shape[0]);
}

at::Tensor Reader::read_rows(const std::string& name, int64_t row_begin, int64_t rows) {
  auto it = impl_->ck.md().tensors.find(name);
  TORCH_CHECK(it != impl_->ck.md().tensors.end(), "checkpoint: ", impl_->ck.dir(), " has no tensor '", name, "'");
  const TensorMeta& t = it->second;
  Box box{std::vector<int64_t>(t.shape.size(), 0), t.shape};
  if (!t.shape.empty()) {
    TORCH_CHECK(row_begin >= 0 && rows >= 0 && row_begin <= t.shape[0] && rows <= t.shape[0] - row_begin,
                "checkpoint: rows [", row_begin, ", +", rows, ") outside tensor '", name, "' with ", t.shape[0], " rows");
    box.offsets[0] = row_begin;
    box.sizes[0] = rows;
  }
  at::Tensor out = at::empty(box.sizes, at::TensorOptions().dtype(t.dtype));
  if (out.numel() > 0) impl_->ck.fill(name, out, box);
  return out;
}

std::vector<std::string> verify(const std::string& path) {
  std::vector<std::string> problems;
  std::unique_ptr<OpenCheckpoint> ck;
  try {
    ck = std::make_unique<OpenCheckpoint>(path);
  } catch (const std::exception& e) {
    problems.push_back(error_text(e));
    return problems;
  }
  for (const auto& [name, size] : ck->md().files) {
    try {
      ck->file(name);
    } catch (const std::exception& e) {
      problems.push_back(error_text(e));
    }
  }
  if (!problems.empty()) return problems;
  for (const auto& [fqn, t] : ck->md().tensors) {
    try {
      at::Tensor full = at::empty(t.shape, at::TensorOptions().dtype(t.dtype));
      ck->fill(fqn, full, Box{std::vector<int64_t>(t.shape.size(), 0), t.shape});
    } catch (const std::exception& e) {
      problems.push_back(error_text(e));
    }
  }
  return problems;
}

at::Tensor read_tensor(const std::string& path, const std::string& name) { return Reader(path).read(name); }

std::string read_value(const std::string& path, const std::string& key) {
  OpenCheckpoint ck(path);
  auto it = ck.md().values.find(key);
  TORCH_CHECK(it != ck.md().values.end(), "checkpoint: ", path, " has no value '", key, "'");
  return it->second;
}

// ---- step folders -------------------------------------------------------------------------------------------

std::string step_path(const std::string& folder, int64_t step) { return step_dir(folder, step); }

std::vector<int64_t> complete_steps(const std::string& folder) { return detail::complete_steps(folder); }

std::optional<int64_t> latest_step(const std::string& folder) {
  auto steps = detail::complete_steps(folder);
  if (steps.empty()) return std::nullopt;
  return steps.back();
}

std::vector<std::string> purge(const std::string& folder, int64_t keep) {
  keep = std::max<int64_t>(keep, 1);
  std::vector<std::string> deleted;
  const auto steps = detail::complete_steps(folder);
  if (steps.empty()) return deleted;
  for (size_t i = 0; i + static_cast<size_t>(keep) < steps.size(); ++i) {
    // First an atomic rename out of the step-N namespace: a crash during the (non-atomic) recursive delete
    // must not leave a step-N with its metadata but without some data files.
    const std::string dir = step_dir(folder, steps[i]);
    const std::string trash = dir + ".deleting";
    remove_tree(trash);
    TORCH_CHECK(::rename(dir.c_str(), trash.c_str()) == 0, "checkpoint: purge cannot rename ", dir, ": ",
                std::strerror(errno));
    remove_tree(trash);
    deleted.push_back(dir);
  }
  // Leftovers of interrupted saves older than the newest complete checkpoint (newer ones may be in flight).
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("step-", 0) != 0) continue;
    const std::string deleting = ".deleting";
    if (name.size() > deleting.size() &&
        name.compare(name.size() - deleting.size(), deleting.size(), deleting) == 0) {  // an interrupted purge
      remove_tree(entry.path().string());
      continue;
    }
    const std::string suffix = ".partial";
    if (name.size() <= suffix.size() + 5 || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    try {
      const int64_t n = std::stoll(name.substr(5, name.size() - 5 - suffix.size()));
      if (n < steps.back()) {
        remove_tree(entry.path().string());
        deleted.push_back(entry.path().string());
      }
    } catch (const std::exception&) {
    }
  }
  return deleted;
}

}  // namespace fsdp::checkpoint
