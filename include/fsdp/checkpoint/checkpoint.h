#pragma once
// Distributed checkpoints: every rank saves its own shards, any number of ranks with any mesh loads them.
//
//   auto sd = fsdp::checkpoint::model_state_dict(*model);                    // model keys, no prefix
//   sd.merge(fsdp::checkpoint::optimizer_state_dict(*model, optim));          // optimizer.state.<fqn>.exp_avg ...
//   fsdp::checkpoint::save(sd, "ckpt/step-100");                              // collective
//   ...
//   auto sd = ... the same calls on the new model/optimizer (any mesh, any world size) ...
//   fsdp::checkpoint::load(sd, "ckpt/step-100");                              // fills sd's tensors in place
//   fsdp::checkpoint::load_optimizer_state_dict(*model, optim, sd);           // step counters, hyperparameters
//
// Layout: a directory with one data file per writing rank and metadata.json (versioned JSON, data only:
// dtype, global shape, chunks with offsets/sizes, file, byte range and an xxHash per 4 MiB block). The
// directory appears under its final name only when complete (temporary name, fsync, one rename). See
// docs/checkpoint.md.

#include <fsdp/process_group.h>
#include <fsdp/sharded_tensor.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::checkpoint {

struct StateDict {
  // Sharded (Shard placements) or replicated (Replicate placements) over a mesh: each piece is written once,
  // by the rank at coordinate 0 of every Replicate mesh dim.
  std::map<std::string, ShardedTensor> tensors;
  // Whole tensors that every rank holds identically (written by rank 0 only; loaded whole).
  std::map<std::string, at::Tensor> full;
  // Non-tensor values as JSON text ("0.001", "[0.9, 0.95]", "{...}"). Every rank's values are saved; a key
  // given by several ranks keeps rank 0's (lowest rank's) value. Loading replaces each requested value.
  std::map<std::string, std::string> values;

  // Adds another dict's entries; a key present in both is an error naming it.
  void merge(StateDict other);
  size_t size() const { return tensors.size() + full.size() + values.size(); }
  bool contains(const std::string& key) const;
};

// On-disk formats. Loading, inspecting and converting accept both (detected from the directory); saving
// writes libfsdp's unless asked otherwise.
//   Libfsdp:    metadata.json (data only) + rank-NNNNN.bin with xxHash per block; atomic directory commit.
//   PytorchDcp: PyTorch Distributed Checkpoint as torch.distributed.checkpoint.FileSystemWriter writes it
//               (.metadata pickle + __<rank>_0.distcp of torch.save archives), readable by dcp.load and
//               TorchTitan. Its .metadata is read by a restricted pickle reader that executes nothing; DCP has
//               no checksums. See docs/interop.md.
enum class Format { Libfsdp, PytorchDcp };
const char* format_name(Format f);  // "libfsdp", "pytorch-dcp"
// The format of the checkpoint directory `path`: metadata.json (libfsdp) wins over .metadata (DCP); nullopt
// when it holds neither as a regular file (no checkpoint, or an interrupted save). The one format detection:
// loads, detect_format and complete_steps all ask it.
std::optional<Format> checkpoint_format(const std::string& path);
// The same; error when it holds neither metadata.json nor .metadata.
Format detect_format(const std::string& path);

struct SaveOptions {
  ProcessGroupPtr group;            // null = the world when initialized, else a single process
  bool local_only = false;          // this process saves alone, without collectives (ignores `group`)
  int64_t block_bytes = 4 << 20;    // checksum granularity (partial reads verify whole blocks)
  std::string saved_on;             // free text recorded in the metadata (e.g. the mesh; not in DCP)
  Format format = Format::Libfsdp;
  // Data files are written with O_DIRECT in large aligned blocks, bypassing the page cache (up to twice the
  // bandwidth of buffered writes + fsync on the disks measured, bench/RESULTS.md); where the file system refuses
  // O_DIRECT, buffered writes. false: always buffered (the files then stay in the page cache for a quick re-read).
  bool direct_io = true;
};

struct SaveResult {
  std::string path;
  int64_t local_bytes = 0;   // data this rank wrote
  int64_t total_bytes = 0;   // all ranks' data
  double seconds = 0;        // wall time of the whole collective save on this rank
};

// Collective over `group`: writes the state into directory `path` (its parent is created). An existing
// checkpoint at `path` is replaced atomically. Any rank's failure raises on every rank; the target is then
// left as it was.
SaveResult save(const StateDict& state, const std::string& path, const SaveOptions& options = {});

struct LoadOptions {
  ProcessGroupPtr group;   // for agreeing on success; null = world when initialized, else none
  bool local_only = false; // no collectives (ignores `group`)
  // strict: every requested key must be in the checkpoint (values included), and checkpoint keys that were not
  // requested are listed in the error. Non-strict: missing keys are skipped (listed in the result).
  bool strict = true;
  std::vector<std::string> exclude_prefixes;  // keys starting with any of these are neither loaded nor required
  // Threads per rank reading pieces of the checkpoint in parallel (both formats: libfsdp pieces are verified
  // against their checksums, DCP pieces are torch.save archives decoded). Several reads in flight use a disk
  // better than one sequential reader.
  int read_threads = 2;
};

struct LoadResult {
  std::vector<std::string> missing;     // requested but not in the checkpoint (non-strict loads)
  std::vector<std::string> unexpected;  // in the checkpoint but not requested
  int64_t bytes_read = 0;               // by this rank, checksummed blocks included
  int read_threads_used = 0;            // threads that read pieces: min(read_threads, pieces), at least 1
  double seconds = 0;
};

// Fills `state`'s tensors in place (each rank reads only the byte ranges of its pieces, verifying their
// checksums) and replaces its values. Global shapes must match; dtypes may differ (values are cast).
// Collective when a group is used: if any rank fails, every rank raises.
LoadResult load(StateDict& state, const std::string& path, const LoadOptions& options = {});

// ---- inspection (no collectives) --------------------------------------------------------------------------

struct TensorSummary {
  std::string name;
  std::string dtype;  // safetensors names: F32, BF16, I64, ...
  std::vector<int64_t> shape;
  int64_t chunks = 0;
  int64_t bytes = 0;
};
struct CheckpointSummary {
  Format format = Format::Libfsdp;
  int version = 0;
  int64_t world_size = 0;
  std::string saved_on;
  int64_t total_bytes = 0;
  std::vector<TensorSummary> tensors;          // sorted by name
  std::map<std::string, std::string> values;   // JSON text
  // DCP non-tensor items that are not plain data (bytes, Python objects): key -> why. Never loaded.
  std::map<std::string, std::string> unreadable_values;
  std::map<std::string, int64_t> files;        // data files and their sizes
};
CheckpointSummary inspect(const std::string& path);
// An open checkpoint (metadata parsed and validated once) for reading tensors one at a time.
class Reader {
 public:
  explicit Reader(const std::string& path);
  ~Reader();
  Reader(Reader&&) noexcept;
  Reader& operator=(Reader&&) noexcept;
  const CheckpointSummary& summary() const;
  // Whole tensor on the CPU in its saved dtype, checksums verified.
  at::Tensor read(const std::string& name);
  // Rows [row_begin, row_begin + rows) of dim 0 (only the bytes of those rows are read).
  at::Tensor read_rows(const std::string& name, int64_t row_begin, int64_t rows);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};
// Reads every chunk and checks file sizes and checksums. Returns the problems found (empty = valid); never
// throws for a damaged checkpoint (only the list grows).
std::vector<std::string> verify(const std::string& path);
// One whole tensor (CPU), assembled from its chunks with checksums verified.
at::Tensor read_tensor(const std::string& path, const std::string& name);
// A value's JSON text; error naming the key when absent.
std::string read_value(const std::string& path, const std::string& key);

// Rewrites checkpoint `src` (either format) as `dst` in format `to`, one saved chunk at a time (memory: one
// chunk). The chunk layout is kept: each source data file becomes one file of the target (rank r's file stays
// rank r's), so the result is what a save on the same mesh would have written. No collectives. `dst` appears
// complete or not at all. Values that are not plain data (DCP) cannot be converted and are listed.
struct ConvertOptions {
  Format to = Format::PytorchDcp;
  bool model_only = false;  // drop optimizer.*, train_state.*, lr_scheduler.*, dataloader.*, rng.* entries
};
struct ConvertResult {
  int64_t tensors = 0, chunks = 0, values = 0;
  int64_t bytes_written = 0;
  std::vector<std::string> skipped;  // "key: why"
};
ConvertResult convert(const std::string& src, const std::string& dst, const ConvertOptions& options = {});

// ---- step folders ---------------------------------------------------------------------------------------

// "<folder>/step-<N>".
std::string step_path(const std::string& folder, int64_t step);
// Steps of complete checkpoints (step-N holding metadata.json, or a DCP .metadata) under folder, ascending.
std::vector<int64_t> complete_steps(const std::string& folder);
std::optional<int64_t> latest_step(const std::string& folder);
// Deletes all complete step-N folders but the newest `keep` (keep >= 1: the newest complete one always
// survives) and leftovers of interrupted saves older than the newest complete one. Returns what it deleted.
std::vector<std::string> purge(const std::string& folder, int64_t keep);

}  // namespace fsdp::checkpoint
