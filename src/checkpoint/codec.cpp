// The two format codecs and the one save loop (see codec.h).
#include "checkpoint/codec.h"

#include "checkpoint/agreement.h"
#include "checkpoint/dcp_format.h"
#include "checkpoint/rank_reports.h"

#include <fsdp/checkpoint/safetensors.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>

namespace fsdp::checkpoint {
namespace fs = std::filesystem;

namespace detail {

FileWriter& DataFiles::writer(const std::string& name) {
  TORCH_INTERNAL_ASSERT(!closed_.count(name), "checkpoint: data file ", name, " written after it was closed");
  auto& w = writers_[name];
  if (!w) w = std::make_unique<FileWriter>((fs::path(dir_) / name).string(), mode_);
  return *w;
}

std::map<std::string, int64_t> DataFiles::close_all() {
  for (auto& [name, w] : writers_) {
    if (closed_.count(name)) continue;
    w->fsync();
    w->close();
    closed_[name] = w->size();
  }
  return closed_;
}

namespace {

// libfsdp: raw row-major bytes with one xxHash per block; the values live in metadata.json.
class LibfsdpCodec final : public CheckpointCodec {
 public:
  explicit LibfsdpCodec(int64_t block_bytes) : block_bytes_(block_bytes) {}
  Format format() const override { return Format::Libfsdp; }
  const char* save_what() const override { return "checkpoint::save"; }
  std::string data_file_name(int rank, int index) const override {
    char buf[48];
    if (index == 0) std::snprintf(buf, sizeof buf, "rank-%05d.bin", rank);
    else std::snprintf(buf, sizeof buf, "rank-%05d-%d.bin", rank, index);
    return buf;
  }
  ChunkMeta append_piece(DataFiles& files, const std::string& file, const at::Tensor& piece,
                         const Box& box) const override {
    const at::Tensor c = piece.detach().to(at::kCPU).contiguous();
    const int64_t n = c.numel() * static_cast<int64_t>(c.element_size());
    ChunkMeta m;
    m.offsets = box.offsets;
    m.sizes = box.sizes;
    m.file = file;
    m.hashes = block_hashes(c.data_ptr(), n, block_bytes_);
    m.offset = files.writer(file).append(c.data_ptr(), n);
    m.length = n;
    return m;
  }
  bool values_in_data_files() const override { return false; }
  void write_metadata(Metadata& md, DataFiles& files, const std::string& tmp, const std::string& final_dir) override {
    for (const auto& [name, size] : files.close_all()) md.files[name] = size;
    validate(md, final_dir, ChunkEncoding::RawBlocks);
    write_file_atomic((fs::path(tmp) / kMetadataFile).string(), to_json_text(md));
  }

 private:
  int64_t block_bytes_;
};

// PyTorch DCP (FileSystemWriter's layout): each piece one torch.save archive; values are archives too, appended
// to the coordinator's data file, and .metadata (a pickle) maps every key to its items.
class DcpCodec final : public CheckpointCodec {
 public:
  Format format() const override { return Format::PytorchDcp; }
  const char* save_what() const override { return "checkpoint::save (DCP)"; }
  std::string data_file_name(int rank, int index) const override {
    char buf[48];
    std::snprintf(buf, sizeof buf, "__%d_%d.distcp", rank, index);
    return buf;
  }
  ChunkMeta append_piece(DataFiles& files, const std::string& file, const at::Tensor& piece,
                         const Box& box) const override {
    const std::string item = dcp::tensor_item(piece);
    ChunkMeta m;
    m.offsets = box.offsets;
    m.sizes = box.sizes;
    m.file = file;
    m.offset = files.writer(file).append(item.data(), static_cast<int64_t>(item.size()));
    m.length = static_cast<int64_t>(item.size());
    return m;
  }
  bool values_in_data_files() const override { return true; }
  void write_metadata(Metadata& md, DataFiles& files, const std::string& tmp, const std::string& final_dir) override {
    dcp::Metadata d;
    d.version = dcp::kVersion;
    // The values go to the coordinator's first data file (rank 0's in a save), which exists even when it
    // holds no tensor.
    const std::string value_file = files.empty() ? data_file_name(0, 0) : files.first_name();
    for (const auto& [key, text] : md.values) {
      const std::string item = dcp::value_item(text);
      const int64_t off = files.writer(value_file).append(item.data(), static_cast<int64_t>(item.size()));
      d.values[key] = {value_file, off, static_cast<int64_t>(item.size())};
    }
    for (const auto& [name, size] : files.close_all()) md.files[name] = size;
    validate(md, final_dir, ChunkEncoding::Archive);
    for (const auto& [fqn, t] : md.tensors) {
      dcp::TensorEntry e{t.dtype, t.shape, {}};
      for (const auto& c : t.chunks) e.chunks.push_back({c.offsets, c.sizes, {c.file, c.offset, c.length}});
      d.tensors.emplace(fqn, std::move(e));
    }
    write_file_atomic((fs::path(tmp) / dcp::kMetadataFile).string(),
                      dcp::metadata_pickle(d, fs::absolute(final_dir).lexically_normal().string()));
  }
};

ChunkMeta chunk_from_json(const nlohmann::json& j) {
  ChunkMeta m;
  m.offsets = j.at("offsets").get<std::vector<int64_t>>();
  m.sizes = j.at("sizes").get<std::vector<int64_t>>();
  m.file = j.at("file").get<std::string>();
  m.offset = j.at("offset").get<int64_t>();
  m.length = j.at("length").get<int64_t>();
  for (const auto& h : j.at("hashes")) m.hashes.push_back(std::stoull(h.get<std::string>(), nullptr, 16));
  return m;
}

// One process's report to the coordinator: {"error", "decls", "chunks", "values", "files"}.
class ReportSink final : public PieceSink {
 public:
  ReportSink(const CheckpointCodec& codec, DataFiles& files) : codec_(codec), files_(files) {}
  void declare(const std::string& fqn, c10::ScalarType dtype, const std::vector<int64_t>& shape) override {
    report["decls"].push_back({{"fqn", fqn}, {"dtype", safetensors::dtype_name(dtype)}, {"shape", shape}});
  }
  void piece(const std::string& fqn, const at::Tensor& data, const std::vector<int64_t>& shape, const Box& box,
             const std::string& file) override {
    const ChunkMeta m = codec_.append_piece(files_, file, data, box);
    report["chunks"].push_back({{"fqn", fqn}, {"dtype", safetensors::dtype_name(data.scalar_type())},
                                {"shape", shape}, {"chunk", chunk_to_json(m)}});
  }
  void value(const std::string& key, const std::string& json_text) override {
    try {
      report["values"][key] = nlohmann::json::parse(json_text);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "checkpoint: value '", key, "' is not valid JSON: ", e.what());
    }
  }
  nlohmann::json report = {{"error", ""}, {"chunks", nlohmann::json::array()}, {"decls", nlohmann::json::array()},
                           {"values", nlohmann::json::object()}, {"files", nlohmann::json::object()}};

 private:
  const CheckpointCodec& codec_;
  DataFiles& files_;
};

}  // namespace

std::unique_ptr<CheckpointCodec> make_codec(Format format, int64_t block_bytes) {
  if (format == Format::PytorchDcp) return std::make_unique<DcpCodec>();
  return std::make_unique<LibfsdpCodec>(block_bytes);
}

SaveResult save_with_codec(CheckpointCodec& codec, const SaveJob& job, const std::function<void(PieceSink&)>& produce) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  const int rank = job.group ? job.group->rank() : 0;
  const bool coordinator = rank == 0;
  const std::string what = job.what ? job.what : codec.save_what();
  TORCH_CHECK(!job.path.empty(), what, ": empty path");
  const std::string final_dir = fs::path(job.path).lexically_normal().string();
  const std::string tmp = final_dir + ".partial";

  // 1. The coordinator prepares the temporary directory (a leftover of an interrupted save is discarded).
  std::string err;
  if (coordinator) {
    try {
      TORCH_CHECK(codec.format() != Format::Libfsdp || job.block_bytes >= 64, what, ": block_bytes ",
                  job.block_bytes, " < 64");
      remove_tree(tmp);
      fs::create_directories(tmp);
    } catch (const std::exception& e) {
      err = error_text(e);
    }
  }
  err = broadcast_string(job.group, err);
  TORCH_CHECK(err.empty(), what, " to ", final_dir, " failed: ", err);

  // 2. Every rank writes its own pieces in parallel with the others. The coordinator's files stay open when the
  // codec appends the values to them after the gather.
  DataFiles files(tmp, job.mode);
  ReportSink sink(codec, files);
  try {
    c10::NoGradGuard no_grad;
    produce(sink);
    if (!(coordinator && codec.values_in_data_files())) {
      for (const auto& [name, size] : files.close_all()) sink.report["files"][name] = size;
    }
  } catch (const std::exception& e) {
    sink.report["error"] = "rank " + std::to_string(rank) + ": " + error_text(e);
  }

  // 3. The coordinator collects every rank's report, lets the codec write the metadata last and commits with
  // one rename.
  const std::vector<std::string> all = all_gather_strings(job.group, sink.report.dump());
  auto write_metadata_and_commit = [&]() -> int64_t {
    const std::vector<nlohmann::json> reports = parse_rank_reports(all);
    Metadata md;
    md.block_bytes = job.block_bytes;
    md.world_size = job.world_size;
    md.saved_on = job.saved_on;
    auto declare = [&](const nlohmann::json& d) -> TensorMeta& {
      return declare_tensor(md.tensors, d, &TensorMeta::shape);
    };
    for (const auto& r : reports) {
      for (const auto& d : r["decls"]) declare(d);
    }
    for (const auto& r : reports) {
      for (const auto& c : r["chunks"]) declare(c).chunks.push_back(chunk_from_json(c["chunk"]));
      for (auto f = r["files"].begin(); f != r["files"].end(); ++f) md.files[f.key()] = f.value().get<int64_t>();
      // The lowest rank's value of each key.
      for (auto v = r["values"].begin(); v != r["values"].end(); ++v) md.values.try_emplace(v.key(), v.value().dump());
    }
    for (const auto& [key, _] : md.values) {
      TORCH_CHECK(!md.tensors.count(key), "checkpoint: key '", key, "' is both a tensor and a value");
    }
    codec.write_metadata(md, files, tmp, final_dir);
    commit_dir(tmp, final_dir);
    int64_t bytes = 0;
    for (const auto& [name, size] : md.files) bytes += size;
    return bytes;
  };
  const int64_t total_bytes = commit_on_coordinator(job.group, coordinator, tmp, what, final_dir, write_metadata_and_commit);
  SaveResult res;
  res.path = final_dir;
  for (const auto& [name, size] : files.close_all()) res.local_bytes += size;
  res.total_bytes = total_bytes;
  res.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return res;
}

}  // namespace detail

const char* format_name(Format f) { return f == Format::PytorchDcp ? "pytorch-dcp" : "libfsdp"; }

std::optional<Format> checkpoint_format(const std::string& path) {
  std::error_code ec;
  if (fs::is_regular_file(fs::path(path) / detail::kMetadataFile, ec)) return Format::Libfsdp;
  if (fs::is_regular_file(fs::path(path) / detail::dcp::kMetadataFile, ec)) return Format::PytorchDcp;
  return std::nullopt;
}

Format detect_format(const std::string& path) {
  const auto f = checkpoint_format(path);
  TORCH_CHECK(f, "checkpoint: ", path, " holds neither ", detail::kMetadataFile, " (libfsdp) nor ",
              detail::dcp::kMetadataFile, " (PyTorch DCP): not a complete checkpoint");
  return *f;
}

}  // namespace fsdp::checkpoint
