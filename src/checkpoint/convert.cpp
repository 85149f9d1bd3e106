// Format conversion (see include/fsdp/checkpoint/checkpoint.h, convert): the source's chunks, one at a time,
// through the same save loop and codecs as save(), run by this process alone.
#include "checkpoint/agreement.h"
#include "checkpoint/codec.h"
#include "checkpoint/open_checkpoint.h"

#include <fsdp/checkpoint/checkpoint.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <filesystem>

namespace fsdp::checkpoint {
namespace fs = std::filesystem;
using namespace detail;

namespace {

// Converting with model_only: model entries are everything but TorchTitan's stateful parts.
bool is_model_key(const std::string& key) {
  for (const char* p : {"optimizer.", "train_state.", "lr_scheduler.", "dataloader.", "rng."}) {
    if (key.rfind(p, 0) == 0) return false;
  }
  return true;
}

}  // namespace

ConvertResult convert(const std::string& src, const std::string& dst, const ConvertOptions& options) {
  OpenCheckpoint ck(src);
  const Metadata& in = ck.md();
  TORCH_CHECK(!dst.empty(), "checkpoint::convert: empty destination");
  TORCH_CHECK(fs::absolute(fs::path(dst).lexically_normal()).lexically_normal() != fs::absolute(src).lexically_normal(),
              "checkpoint::convert: the destination is the source (", src, ")");
  const auto codec = make_codec(options.to, 4 << 20);

  // Each source file becomes one target file named for the same rank (and index).
  std::map<std::string, std::string> names;
  auto out_name = [&](const std::string& from) {
    auto it = names.find(from);
    if (it != names.end()) return it->second;
    int r = -1, i = 0;
    std::string name;
    if (std::sscanf(from.c_str(), "rank-%d.bin", &r) == 1 || std::sscanf(from.c_str(), "__%d_%d.distcp", &r, &i) == 2) {
      name = codec->data_file_name(r, i);
    } else if (options.to == Format::PytorchDcp) {  // any other naming: in order of use
      name = codec->data_file_name(static_cast<int>(names.size()), 0);
    } else {
      name = "rank-" + std::to_string(names.size()) + ".bin";
    }
    names[from] = name;
    return name;
  };

  ConvertResult res;
  SaveJob job;  // no group: this process alone
  job.path = dst;
  job.mode = FileWriter::Mode::Direct;
  job.world_size = in.world_size;
  job.saved_on = std::string("converted from ") + (ck.format() == Format::PytorchDcp ? "PyTorch DCP" : "libfsdp") +
                 " " + src;
  job.block_bytes = 4 << 20;
  job.what = "checkpoint::convert";
  res.bytes_written = save_with_codec(*codec, job, [&](PieceSink& sink) {
    for (const auto& [fqn, t] : in.tensors) {
      if (options.model_only && !is_model_key(fqn)) continue;
      ++res.tensors;
      sink.declare(fqn, t.dtype, t.shape);
      for (const auto& c : t.chunks) {
        at::Tensor piece = at::empty(c.sizes, at::TensorOptions().dtype(t.dtype));
        ck.fill(fqn, piece, Box{c.offsets, c.sizes});
        sink.piece(fqn, piece, t.shape, Box{c.offsets, c.sizes}, out_name(c.file));
        ++res.chunks;
      }
    }
    for (const auto& [key, text] : in.values) {
      if (options.model_only && !is_model_key(key)) continue;
      ++res.values;
      sink.value(key, text);
    }
    for (const auto& [key, why] : in.unreadable) {
      if (!options.model_only || is_model_key(key)) res.skipped.push_back(key + ": " + why);
    }
  }).total_bytes;
  return res;
}

}  // namespace fsdp::checkpoint
