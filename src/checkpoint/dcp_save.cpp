// PyTorch DCP writing and format conversion (see dcp_save.h).
#include "checkpoint/dcp_save.h"

#include "checkpoint/agreement.h"
#include "checkpoint/dcp_format.h"
#include "checkpoint/format.h"
#include "checkpoint/open_checkpoint.h"
#include "checkpoint/planning.h"
#include "checkpoint/rank_reports.h"
#include "checkpoint/storage.h"

#include <fsdp/checkpoint/safetensors.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>

namespace fsdp::checkpoint {
namespace fs = std::filesystem;
using namespace detail;

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string dcp_file_name(int rank, int index) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "__%d_%d.distcp", rank, index);
  return buf;
}

// Converting: model entries are everything but TorchTitan's stateful parts.
bool is_model_key(const std::string& key) {
  for (const char* p : {"optimizer.", "train_state.", "lr_scheduler.", "dataloader.", "rng."}) {
    if (key.rfind(p, 0) == 0) return false;
  }
  return true;
}

// Our validation of a DCP layout before it is committed (chunks in bounds, no overlap, full coverage).
void validate_dcp(const dcp::Metadata& d, const std::map<std::string, int64_t>& files, const std::string& where) {
  Metadata md;
  md.dcp = true;
  md.block_bytes = 0;
  md.files = files;
  for (const auto& [fqn, t] : d.tensors) {
    TensorMeta m;
    m.dtype = t.dtype;
    m.shape = t.size;
    for (const auto& c : t.chunks) m.chunks.push_back(ChunkMeta{c.offsets, c.sizes, c.item.file, c.item.offset, c.item.length, {}});
    md.tensors.emplace(fqn, std::move(m));
  }
  validate(md, where);
}

}  // namespace

const char* format_name(Format f) { return f == Format::PytorchDcp ? "pytorch-dcp" : "libfsdp"; }

Format detect_format(const std::string& path) {
  std::error_code ec;
  if (fs::is_regular_file(fs::path(path) / kMetadataFile, ec)) return Format::Libfsdp;
  if (fs::is_regular_file(fs::path(path) / dcp::kMetadataFile, ec)) return Format::PytorchDcp;
  TORCH_CHECK(false, "checkpoint: ", path, " holds neither ", kMetadataFile, " (libfsdp) nor ", dcp::kMetadataFile,
              " (PyTorch DCP): not a complete checkpoint");
}

namespace detail {

SaveResult save_dcp(const StateDict& state, const std::string& path, const SaveOptions& options) {
  const auto t0 = Clock::now();
  const ProcessGroupPtr group = options.local_only ? nullptr : resolve_group(options.group);
  const int rank = group ? group->rank() : 0;
  TORCH_CHECK(!path.empty(), "checkpoint::save: empty path");
  const std::string final_dir = fs::path(path).lexically_normal().string();
  const std::string tmp = final_dir + ".partial";

  std::string err;
  if (rank == 0) {
    try {
      remove_tree(tmp);
      fs::create_directories(tmp);
    } catch (const std::exception& e) {
      err = error_text(e);
    }
  }
  err = broadcast_string(group, err);
  TORCH_CHECK(err.empty(), "checkpoint::save (DCP) to ", final_dir, " failed: ", err);

  // Every rank appends its pieces, one torch.save archive each.
  nlohmann::json mine = {{"error", ""}, {"chunks", nlohmann::json::array()}, {"decls", nlohmann::json::array()},
                         {"values", nlohmann::json::object()}, {"files", nlohmann::json::object()}};
  const std::string file = dcp_file_name(rank, 0);
  std::unique_ptr<FileWriter> w;
  const auto mode = options.direct_io ? FileWriter::Mode::Direct : FileWriter::Mode::Buffered;
  auto writer = [&]() -> FileWriter& {
    if (!w) w = std::make_unique<FileWriter>((fs::path(tmp) / file).string(), mode);
    return *w;
  };
  int64_t local_bytes = 0;
  auto write_piece = [&](const std::string& fqn, const at::Tensor& local, const std::vector<int64_t>& shape, const Box& box) {
    const std::string item = dcp::tensor_item(local);
    const int64_t off = writer().append(item.data(), static_cast<int64_t>(item.size()));
    mine["chunks"].push_back({{"fqn", fqn}, {"dtype", safetensors::dtype_name(local.scalar_type())}, {"shape", shape},
                              {"offsets", box.offsets}, {"sizes", box.sizes}, {"offset", off},
                              {"length", static_cast<int64_t>(item.size())}});
  };
  try {
    c10::NoGradGuard no_grad;
    for (const auto& [fqn, t] : state.tensors) {
      if (rank == 0) mine["decls"].push_back({{"fqn", fqn}, {"dtype", safetensors::dtype_name(t.dtype())}, {"shape", t.sizes()}});
      const WritePlan plan = plan_write(fqn, t);
      if (plan.write) write_piece(fqn, t.local(), t.sizes(), plan.box);
    }
    if (rank == 0) {
      for (const auto& [fqn, t] : state.full) {
        TORCH_CHECK(t.defined(), "checkpoint: '", fqn, "' is an undefined tensor");
        TORCH_CHECK(!state.tensors.count(fqn), "checkpoint: key '", fqn, "' is both sharded and full");
        mine["decls"].push_back({{"fqn", fqn}, {"dtype", safetensors::dtype_name(t.scalar_type())}, {"shape", t.sizes().vec()}});
        if (t.numel() > 0) write_piece(fqn, t, t.sizes().vec(), Box{std::vector<int64_t>(t.dim(), 0), t.sizes().vec()});
      }
    }
    for (const auto& [key, text] : state.values) {
      try {
        mine["values"][key] = nlohmann::json::parse(text);
      } catch (const std::exception& e) {
        TORCH_CHECK(false, "checkpoint: value '", key, "' is not valid JSON: ", e.what());
      }
    }
    if (w && rank != 0) {
      w->fsync();
      w->close();
      local_bytes = w->size();
      mine["files"][file] = w->size();
    }
  } catch (const std::exception& e) {
    mine["error"] = "rank " + std::to_string(rank) + ": " + error_text(e);
  }

  // Rank 0 gathers the chunk lists and values, appends the values, writes .metadata and commits.
  const std::vector<std::string> all = all_gather_strings(group, mine.dump());
  auto write_metadata_and_commit = [&]() -> int64_t {
    int64_t bytes = 0;
    const std::vector<nlohmann::json> reports = parse_rank_reports(all);
    dcp::Metadata md;
    md.version = dcp::kVersion;
    auto declare = [&](const nlohmann::json& d) -> dcp::TensorEntry& {
      return declare_tensor(md.tensors, d, &dcp::TensorEntry::size);
    };
    for (const auto& r : reports) {
      for (const auto& d : r["decls"]) declare(d);
    }
    std::map<std::string, int64_t> files;
    for (size_t rk = 0; rk < reports.size(); ++rk) {
      const auto& r = reports[rk];
      for (const auto& c : r["chunks"]) {
        dcp::Chunk ch;
        ch.offsets = c["offsets"].get<std::vector<int64_t>>();
        ch.sizes = c["sizes"].get<std::vector<int64_t>>();
        ch.item = {dcp_file_name(static_cast<int>(rk), 0), c["offset"].get<int64_t>(), c["length"].get<int64_t>()};
        declare(c).chunks.push_back(std::move(ch));
      }
      for (auto f = r["files"].begin(); f != r["files"].end(); ++f) files[f.key()] = f.value().get<int64_t>();
    }
    std::map<std::string, std::string> values;  // the lowest rank's value of each key
    for (const auto& r : reports) {
      for (auto v = r["values"].begin(); v != r["values"].end(); ++v) values.try_emplace(v.key(), v.value().dump());
    }
    for (const auto& [key, text] : values) {
      TORCH_CHECK(!md.tensors.count(key), "checkpoint: key '", key, "' is both a tensor and a value");
      const std::string item = dcp::value_item(text);
      const int64_t off = writer().append(item.data(), static_cast<int64_t>(item.size()));
      md.values[key] = {file, off, static_cast<int64_t>(item.size())};
    }
    if (w) {
      w->fsync();
      w->close();
      local_bytes = w->size();
      files[file] = w->size();
    }
    for (const auto& [f, size] : files) bytes += size;
    validate_dcp(md, files, final_dir);
    write_file_atomic((fs::path(tmp) / dcp::kMetadataFile).string(),
                      dcp::metadata_pickle(md, fs::absolute(final_dir).lexically_normal().string()));
    commit_dir(tmp, final_dir);
    return bytes;
  };
  const int64_t total_bytes =
      commit_on_coordinator(group, rank == 0, tmp, "checkpoint::save (DCP)", final_dir, write_metadata_and_commit);
  SaveResult res;
  res.path = final_dir;
  res.local_bytes = local_bytes;
  res.total_bytes = total_bytes;
  res.seconds = since(t0);
  return res;
}

}  // namespace detail

ConvertResult convert(const std::string& src, const std::string& dst, const ConvertOptions& options) {
  OpenCheckpoint ck(src);
  const Metadata& in = ck.md();
  TORCH_CHECK(!dst.empty(), "checkpoint::convert: empty destination");
  const std::string final_dir = fs::path(dst).lexically_normal().string();
  TORCH_CHECK(fs::absolute(final_dir).lexically_normal() != fs::absolute(src).lexically_normal(),
              "checkpoint::convert: the destination is the source (", src, ")");
  const std::string tmp = final_dir + ".partial";
  const bool to_dcp = options.to == Format::PytorchDcp;
  const int64_t block_bytes = 4 << 20;

  // Each source file becomes one target file named for the same rank.
  std::map<std::string, std::string> names;
  auto out_name = [&](const std::string& from) {
    auto it = names.find(from);
    if (it != names.end()) return it->second;
    int r = -1, i = 0;
    std::string name;
    if (std::sscanf(from.c_str(), "rank-%d.bin", &r) == 1 ||
        (std::sscanf(from.c_str(), "__%d_%d.distcp", &r, &i) == 2)) {
      char buf[64];
      if (to_dcp) std::snprintf(buf, sizeof buf, "__%d_%d.distcp", r, i);
      else if (i == 0) std::snprintf(buf, sizeof buf, "rank-%05d.bin", r);
      else std::snprintf(buf, sizeof buf, "rank-%05d-%d.bin", r, i);
      name = buf;
    } else {
      name = to_dcp ? dcp_file_name(static_cast<int>(names.size()), 0)
                    : "rank-" + std::to_string(names.size()) + ".bin";  // any other naming: in order of use
    }
    names[from] = name;
    return name;
  };

  ConvertResult res;
  remove_tree(tmp);
  fs::create_directories(tmp);
  try {
    std::map<std::string, std::unique_ptr<FileWriter>> writers;
    auto writer = [&](const std::string& name) -> FileWriter& {
      auto& w = writers[name];
      if (!w) w = std::make_unique<FileWriter>((fs::path(tmp) / name).string(), FileWriter::Mode::Direct);
      return *w;
    };
    dcp::Metadata dmd;
    dmd.version = dcp::kVersion;
    Metadata omd;
    omd.block_bytes = block_bytes;
    omd.world_size = in.world_size;
    omd.saved_on = std::string("converted from ") + (in.dcp ? "PyTorch DCP" : "libfsdp") + " " + src;
    c10::NoGradGuard no_grad;
    for (const auto& [fqn, t] : in.tensors) {
      if (options.model_only && !is_model_key(fqn)) continue;
      ++res.tensors;
      dcp::TensorEntry de{t.dtype, t.shape, {}};
      TensorMeta om;
      om.dtype = t.dtype;
      om.shape = t.shape;
      for (const auto& c : t.chunks) {
        at::Tensor piece = at::empty(c.sizes, at::TensorOptions().dtype(t.dtype));
        ck.fill(fqn, piece, Box{c.offsets, c.sizes});
        const std::string name = out_name(c.file);
        FileWriter& w = writer(name);
        ++res.chunks;
        if (to_dcp) {
          const std::string item = dcp::tensor_item(piece);
          const int64_t off = w.append(item.data(), static_cast<int64_t>(item.size()));
          de.chunks.push_back({c.offsets, c.sizes, {name, off, static_cast<int64_t>(item.size())}});
        } else {
          const int64_t n = piece.numel() * static_cast<int64_t>(piece.element_size());
          ChunkMeta m{c.offsets, c.sizes, name, 0, n, block_hashes(piece.data_ptr(), n, block_bytes)};
          m.offset = w.append(piece.data_ptr(), n);
          om.chunks.push_back(std::move(m));
        }
      }
      if (to_dcp) dmd.tensors.emplace(fqn, std::move(de));
      else omd.tensors.emplace(fqn, std::move(om));
    }
    for (const auto& [key, text] : in.values) {
      if (options.model_only && !is_model_key(key)) continue;
      ++res.values;
      if (to_dcp) {
        const std::string name = writers.empty() ? dcp_file_name(0, 0) : writers.begin()->first;
        const std::string item = dcp::value_item(text);
        const int64_t off = writer(name).append(item.data(), static_cast<int64_t>(item.size()));
        dmd.values[key] = {name, off, static_cast<int64_t>(item.size())};
      } else {
        omd.values[key] = text;
      }
    }
    for (const auto& [key, why] : in.unreadable) {
      if (!options.model_only || is_model_key(key)) res.skipped.push_back(key + ": " + why);
    }
    std::map<std::string, int64_t> files;
    for (auto& [name, w] : writers) {
      w->fsync();
      w->close();
      files[name] = w->size();
      res.bytes_written += w->size();
    }
    if (to_dcp) {
      validate_dcp(dmd, files, final_dir);
      write_file_atomic((fs::path(tmp) / dcp::kMetadataFile).string(),
                        dcp::metadata_pickle(dmd, fs::absolute(final_dir).lexically_normal().string()));
    } else {
      omd.files = files;
      validate(omd, final_dir);
      write_file_atomic((fs::path(tmp) / kMetadataFile).string(), to_json_text(omd));
    }
    commit_dir(tmp, final_dir);
  } catch (...) {
    try {
      remove_tree(tmp);
    } catch (...) {
    }
    throw;
  }
  return res;
}

}  // namespace fsdp::checkpoint
