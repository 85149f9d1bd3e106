#pragma once
// An opened checkpoint directory of either format, behind one interface: libfsdp's (metadata.json, raw
// chunks with xxHash blocks) or PyTorch DCP's (.metadata pickle, chunks as torch.save archives; read through
// dcp_format.h). The metadata is validated once; data files open lazily with their sizes checked. fill()
// copies the part of a saved tensor that overlaps any box, which is all resharding needs.

#include "checkpoint/format.h"
#include "checkpoint/planning.h"
#include "checkpoint/storage.h"

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>

namespace fsdp::checkpoint::detail {

class OpenCheckpoint {
 public:
  explicit OpenCheckpoint(std::string dir);
  const Metadata& md() const { return md_; }
  const std::string& dir() const { return dir_; }
  bool is_dcp() const { return md_.dcp; }

  const RangeReader& file(const std::string& name);
  // Copies the part of saved tensor `fqn` that overlaps `dest_box` into `dest` (whose box it is). libfsdp:
  // reads only the checksum blocks covering each overlap and verifies them. DCP: decodes each overlapping
  // chunk's archive (the last one decoded is kept, so consecutive boxes of one chunk decode it once).
  // Returns the bytes read.
  int64_t fill(const std::string& fqn, const at::Tensor& dest, const Box& dest_box);

 private:
  void open_dcp();  // fills md_
  int64_t fill_dcp(const std::string& fqn, const at::Tensor& dest, const Box& dest_box);
  std::string read_bytes(const std::string& file, int64_t offset, int64_t length, const std::string& what);

  std::string dir_;
  Metadata md_;
  std::map<std::string, std::unique_ptr<RangeReader>> readers_;
  std::string cached_key_;  // DCP: "<fqn>#<chunk>" of cached_
  at::Tensor cached_;
};

// Which format `dir` holds: metadata.json (ours) wins over .metadata (DCP); error when neither.
bool is_dcp_dir(const std::string& dir);

}  // namespace fsdp::checkpoint::detail
