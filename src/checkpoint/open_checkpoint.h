#pragma once
// An opened checkpoint directory of either format, behind one interface: libfsdp's (metadata.json, raw
// chunks with xxHash blocks) or PyTorch DCP's (.metadata pickle, chunks as torch.save archives; read through
// dcp_format.h). The metadata is validated once; data files open lazily with their sizes checked. fill()
// copies the part of a saved tensor that overlaps any box, which is all resharding needs.

#include "checkpoint/format.h"

#include <fsdp/checkpoint/checkpoint.h>
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
  Format format() const { return format_; }

  const RangeReader& file(const std::string& name);
  // Copies the part of saved tensor `fqn` that overlaps `dest_box` into `dest` (whose box it is). libfsdp:
  // reads only the checksum blocks covering each overlap and verifies them. DCP: decodes each overlapping
  // chunk's archive (the last one decoded is kept, so consecutive boxes of one chunk decode it once).
  // Returns the bytes read.
  int64_t fill(const std::string& fqn, const at::Tensor& dest, const Box& dest_box);

  // One independent piece of a fill. libfsdp: read bytes [begin, end) of a saved chunk, verify the checksum
  // blocks they cover, place them. DCP: read the chunk's archive (begin 0, end its length), decode it, copy the
  // overlap. load() runs the pieces of all tensors on several threads, which keeps several reads in flight (one
  // sequential reader leaves this kind of disk half idle) and spreads the checksum or decoding work.
  struct FillPiece {
    std::string fqn;
    size_t chunk = 0;
    int64_t begin = 0, end = 0;  // chunk-relative; libfsdp: whole checksum blocks
    at::Tensor dst;              // direct: exactly these bytes, contiguous, same dtype; else the overlap's view
    bool direct = false;
    int64_t skip = 0;                     // libfsdp, not direct: bytes from `begin` to the overlap's first element
    std::vector<int64_t> sizes, strides;  // libfsdp, not direct: the overlap inside the saved chunk (elements)
    std::vector<int64_t> src_offsets;     // DCP: the overlap's offsets inside the decoded chunk
  };
  // The pieces of fill(fqn, dest, dest_box), libfsdp's direct ones split into pieces of about `piece_bytes`.
  // Opens the files they read, so read_piece() may then run on any thread.
  std::vector<FillPiece> plan_fill(const std::string& fqn, const at::Tensor& dest, const Box& dest_box,
                                   int64_t piece_bytes);
  int64_t read_piece(const FillPiece& piece) const;  // thread-safe; returns the bytes read

 private:
  void open_dcp();  // fills md_
  // One saved chunk's part that a box needs: the file bytes [begin, end) relative to the chunk (libfsdp: whole
  // checksum blocks; DCP: the whole archive) and the overlap in global coordinates.
  struct ChunkRead {
    size_t chunk;
    int64_t begin, end;
    Box overlap;
  };
  std::vector<ChunkRead> plan_reads(const std::string& fqn, const Box& dest_box) const;
  int64_t fill_dcp(const std::string& fqn, const at::Tensor& dest, const Box& dest_box);
  std::string read_bytes(const std::string& file, int64_t offset, int64_t length, const std::string& what);

  at::Tensor decode_dcp_chunk(const std::string& fqn, size_t chunk, const std::string& raw) const;

  std::string dir_;
  Format format_ = Format::Libfsdp;
  Metadata md_;
  std::map<std::string, std::unique_ptr<RangeReader>> readers_;
  std::string cached_key_;  // DCP: "<fqn>#<chunk>" of cached_
  at::Tensor cached_;
};

}  // namespace fsdp::checkpoint::detail
