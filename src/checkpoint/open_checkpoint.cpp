// Reading either checkpoint format (see open_checkpoint.h).
#include "checkpoint/open_checkpoint.h"

#include "checkpoint/agreement.h"
#include "checkpoint/codec.h"
#include "checkpoint/dcp_format.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <filesystem>
#include <limits>
#include <set>

namespace fsdp::checkpoint::detail {
namespace fs = std::filesystem;

namespace {
// How DCP read errors name a chunk.
std::string dcp_chunk_what(const std::string& fqn, size_t k, const ChunkMeta& c) {
  return "tensor '" + fqn + "' chunk " + std::to_string(k) + " (" + c.file + " bytes [" + std::to_string(c.offset) +
         ", +" + std::to_string(c.length) + "))";
}
}  // namespace


OpenCheckpoint::OpenCheckpoint(std::string dir) : dir_(std::move(dir)) {
  std::error_code ec;
  TORCH_CHECK(fs::is_directory(dir_, ec), "checkpoint: ", dir_, " does not exist or is not a directory");
  const auto format = checkpoint_format(dir_);
  TORCH_CHECK(format, "checkpoint: ", (fs::path(dir_) / kMetadataFile).string(),
              " is missing: not a complete libfsdp checkpoint (interrupted save?), nor a PyTorch DCP checkpoint "
              "(no .metadata)");
  format_ = *format;
  if (format_ == Format::PytorchDcp) {
    open_dcp();
    return;
  }
  const std::string md_path = (fs::path(dir_) / kMetadataFile).string();
  md_ = parse_metadata(read_small_file(md_path, kMaxMetadataBytes), md_path);
}

const RangeReader& OpenCheckpoint::file(const std::string& name) {
  auto it = readers_.find(name);
  if (it != readers_.end()) return *it->second;
  const std::string path = (fs::path(dir_) / name).string();  // name validated: plain, no '/'
  auto r = std::make_unique<RangeReader>(path);
  const int64_t expect = md_.files.at(name);
  TORCH_CHECK(r->size() == expect, "checkpoint: ", path, " has ", r->size(), " bytes but the metadata records ",
              expect, " (truncated or altered)");
  return *readers_.emplace(name, std::move(r)).first->second;
}

std::string OpenCheckpoint::read_bytes(const std::string& name, int64_t offset, int64_t length, const std::string& what) {
  std::string buf(static_cast<size_t>(length), '\0');
  try {
    file(name).read(offset, length, buf.data());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "checkpoint: ", what, ": ", error_text(e));
  }
  return buf;
}

void OpenCheckpoint::open_dcp() {
  const std::string path = (fs::path(dir_) / dcp::kMetadataFile).string();
  const dcp::Metadata d = dcp::parse_metadata(read_small_file(path, kMaxMetadataBytes), path);
  Metadata md;
  md.block_bytes = 0;
  md.saved_on = "PyTorch DCP" + (d.version.empty() ? std::string() : " " + d.version);
  // Data files: sizes from the directory (DCP records none); a listed file that is absent is an error here.
  std::set<int64_t> ranks;
  auto add_file = [&](const std::string& name) {
    if (md.files.count(name)) return;
    const fs::path p = fs::path(dir_) / name;
    std::error_code ec;
    const auto size = fs::file_size(p, ec);
    TORCH_CHECK(!ec, "checkpoint: ", path, " refers to data file ", name, ", which cannot be read: ", ec.message());
    md.files[name] = static_cast<int64_t>(size);
    int r = -1;
    if (std::sscanf(name.c_str(), "__%d_", &r) == 1 && r >= 0) ranks.insert(r);
  };
  for (const auto& [fqn, t] : d.tensors) {
    TensorMeta m;
    m.dtype = t.dtype;
    m.shape = t.size;
    for (const auto& c : t.chunks) {
      if (checked_numel(c.sizes, "checkpoint: " + path + ": tensor '" + fqn + "'") == 0) continue;  // empty shard
      add_file(c.item.file);
      ChunkMeta cm;
      cm.offsets = c.offsets;
      cm.sizes = c.sizes;
      cm.file = c.item.file;
      cm.offset = c.item.offset;
      cm.length = c.item.length;
      m.chunks.push_back(std::move(cm));
    }
    md.tensors.emplace(fqn, std::move(m));
  }
  for (const auto& [key, item] : d.values) add_file(item.file);
  md.world_size = std::max<int64_t>(1, static_cast<int64_t>(ranks.size()));
  validate(md, path, ChunkEncoding::Archive);
  md_ = std::move(md);  // the value items are read through file(), which checks sizes against md_
  for (const auto& [key, item] : d.values) {
    const int64_t size = md_.files.at(item.file);
    TORCH_CHECK(item.offset <= size && item.length <= size - item.offset, "checkpoint: ", path, ": value '", key,
                "': bytes [", item.offset, ", +", item.length, ") outside file ", item.file, " of ", size, " bytes");
    const std::string what = "value '" + key + "' (" + item.file + " bytes [" + std::to_string(item.offset) + ", +" +
                             std::to_string(item.length) + "))";
    const std::string bytes = read_bytes(item.file, item.offset, item.length, what);
    try {
      md_.values[key] = dcp::read_value_item(bytes.data(), bytes.size(), (fs::path(dir_) / item.file).string() + ": " + what);
    } catch (const dcp::ValueNotPlainData& e) {
      md_.unreadable[key] = e.what();
    }
  }
}

std::vector<OpenCheckpoint::ChunkRead> OpenCheckpoint::plan_reads(const std::string& fqn, const Box& dest_box) const {
  const TensorMeta& t = md_.tensors.at(fqn);
  const int64_t es = static_cast<int64_t>(c10::elementSize(t.dtype));
  const int64_t B = md_.block_bytes;
  std::vector<ChunkRead> reads;
  for (size_t k = 0; k < t.chunks.size(); ++k) {
    const ChunkMeta& c = t.chunks[k];
    const Box saved{c.offsets, c.sizes};
    auto overlap = intersect(saved, dest_box);
    if (!overlap) continue;
    if (format_ == Format::PytorchDcp) {  // an archive decodes only whole
      reads.push_back({k, 0, c.length, std::move(*overlap)});
      continue;
    }
    const auto [first, last] = element_span(saved, *overlap);
    reads.push_back({k, first * es / B * B, std::min(((last + 1) * es + B - 1) / B * B, c.length), std::move(*overlap)});
  }
  return reads;
}

std::vector<OpenCheckpoint::FillPiece> OpenCheckpoint::plan_fill(const std::string& fqn, const at::Tensor& dest,
                                                                 const Box& dest_box, int64_t piece_bytes) {
  const TensorMeta& t = md_.tensors.at(fqn);
  const int64_t es = static_cast<int64_t>(c10::elementSize(t.dtype));
  const int64_t B = md_.block_bytes;
  std::vector<FillPiece> pieces;
  for (ChunkRead& r : plan_reads(fqn, dest_box)) {
    const ChunkMeta& c = t.chunks[r.chunk];
    try {
      file(c.file);  // opened (and its size checked) here, on the calling thread
    } catch (const std::exception& e) {
      if (format_ == Format::PytorchDcp) TORCH_CHECK(false, "checkpoint: ", dcp_chunk_what(fqn, r.chunk, c), ": ", error_text(e));
      TORCH_CHECK(false, "checkpoint: tensor '", fqn, "' (chunk ", r.chunk, "): ", error_text(e));
    }
    at::Tensor dst = dest;
    for (size_t d = 0; d < r.overlap.sizes.size(); ++d) {
      dst = dst.narrow(static_cast<int64_t>(d), r.overlap.offsets[d] - dest_box.offsets[d], r.overlap.sizes[d]);
    }
    if (format_ == Format::PytorchDcp) {
      std::vector<int64_t> src_offsets(r.overlap.offsets.size());
      for (size_t d = 0; d < src_offsets.size(); ++d) src_offsets[d] = r.overlap.offsets[d] - c.offsets[d];
      FillPiece p;
      p.fqn = fqn;
      p.chunk = r.chunk;
      p.begin = r.begin;
      p.end = r.end;
      p.dst = dst;
      p.sizes = r.overlap.sizes;
      p.src_offsets = std::move(src_offsets);
      pieces.push_back(std::move(p));
      continue;
    }
    const auto [first, last] = element_span(Box{c.offsets, c.sizes}, r.overlap);
    // Fast path: the overlap is exactly the block-aligned byte span, contiguous in the destination and of the
    // same dtype (e.g. the same sharding as saved): read straight into the destination, verify in place.
    const bool direct = first * es == r.begin && (last + 1) * es == r.end && dst.is_contiguous() &&
                        dst.scalar_type() == t.dtype && dst.device().is_cpu() && last - first + 1 == r.overlap.numel();
    if (!direct) {
      pieces.push_back({fqn, r.chunk, r.begin, r.end, dst, false, first * es - r.begin, r.overlap.sizes,
                        contiguous_strides(c.sizes), {}});
      continue;
    }
    const at::Tensor bytes = dst.detach().view({-1}).view(at::kByte);
    const int64_t step = std::max<int64_t>(1, piece_bytes / B) * B;
    for (int64_t at = r.begin, end; at < r.end; at = end) {
      end = r.end - at <= step ? r.end : at + step;  // never at + step past r.end: fill() passes a huge step
      pieces.push_back({fqn, r.chunk, at, end, bytes.narrow(0, at - r.begin, end - at), true, 0, {}, {}, {}});
    }
  }
  return pieces;
}

at::Tensor OpenCheckpoint::decode_dcp_chunk(const std::string& fqn, size_t k, const std::string& raw) const {
  const TensorMeta& t = md_.tensors.at(fqn);
  const ChunkMeta& c = t.chunks[k];
  const std::string what = dcp_chunk_what(fqn, k, c);
  at::Tensor x = dcp::read_tensor_item(raw.data(), raw.size(), (fs::path(dir_) / c.file).string() + ": " + what);
  TORCH_CHECK(x.scalar_type() == t.dtype && x.sizes().vec() == c.sizes, "checkpoint: ", dir_, ": ", what,
              " holds a ", x.scalar_type(), " tensor of shape ", x.sizes(), " but the metadata records ", t.dtype,
              " ", c10::IntArrayRef(c.sizes));
  return x;
}

int64_t OpenCheckpoint::read_piece(const FillPiece& piece) const {
  const ChunkMeta& c = md_.tensors.at(piece.fqn).chunks[piece.chunk];
  if (format_ == Format::PytorchDcp) {
    std::string raw(static_cast<size_t>(c.length), '\0');
    try {
      readers_.at(c.file)->read(c.offset, c.length, raw.data());
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "checkpoint: ", dcp_chunk_what(piece.fqn, piece.chunk, c), ": ", error_text(e));
    }
    at::Tensor src = decode_dcp_chunk(piece.fqn, piece.chunk, raw);
    for (size_t d = 0; d < piece.sizes.size(); ++d) {
      src = src.narrow(static_cast<int64_t>(d), piece.src_offsets[d], piece.sizes[d]);
    }
    piece.dst.copy_(src);
    return c.length;
  }
  const int64_t B = md_.block_bytes, b0 = piece.begin, b1 = piece.end;
  const RangeReader& r = *readers_.at(c.file);
  at::Tensor buf = piece.direct ? piece.dst : at::empty({b1 - b0}, at::kByte);
  try {
    r.read(c.offset + b0, b1 - b0, buf.data_ptr());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "checkpoint: tensor '", piece.fqn, "' (chunk ", piece.chunk, "): ", error_text(e));
  }
  const auto* p = static_cast<const char*>(buf.data_ptr());
  for (int64_t blk = b0 / B; blk * B < b1; ++blk) {
    const int64_t n = std::min(B, c.length - blk * B);
    TORCH_CHECK(hash_bytes(p + (blk * B - b0), n) == c.hashes[static_cast<size_t>(blk)], "checkpoint: tensor '",
                piece.fqn, "': checksum mismatch in file ", r.path(), " bytes [", c.offset + blk * B, ", ",
                c.offset + blk * B + n, ") (chunk ", piece.chunk, "): the file was altered or is corrupt");
  }
  if (!piece.direct) {
    const auto dtype = md_.tensors.at(piece.fqn).dtype;
    piece.dst.copy_(at::from_blob(const_cast<char*>(p) + piece.skip, piece.sizes, piece.strides,
                                  at::TensorOptions().dtype(dtype)));
  }
  return b1 - b0;
}

int64_t OpenCheckpoint::fill(const std::string& fqn, const at::Tensor& dest, const Box& dest_box) {
  if (format_ == Format::PytorchDcp) return fill_dcp(fqn, dest, dest_box);
  int64_t bytes = 0;
  for (const FillPiece& p : plan_fill(fqn, dest, dest_box, std::numeric_limits<int64_t>::max())) bytes += read_piece(p);
  return bytes;
}

int64_t OpenCheckpoint::fill_dcp(const std::string& fqn, const at::Tensor& dest, const Box& dest_box) {
  const TensorMeta& t = md_.tensors.at(fqn);
  int64_t bytes = 0;
  for (const ChunkRead& plan : plan_reads(fqn, dest_box)) {
    const size_t k = plan.chunk;
    const ChunkMeta& c = t.chunks[k];
    const Box& overlap = plan.overlap;
    const std::string key = fqn + "#" + std::to_string(k);
    if (cached_key_ != key) {
      cached_key_.clear();
      const std::string raw = read_bytes(c.file, c.offset, c.length, dcp_chunk_what(fqn, k, c));
      bytes += c.length;
      at::Tensor x = decode_dcp_chunk(fqn, k, raw);
      cached_ = x;
      cached_key_ = key;
    }
    at::Tensor src = cached_, dst = dest;
    for (size_t d = 0; d < overlap.sizes.size(); ++d) {
      const auto dim = static_cast<int64_t>(d);
      src = src.narrow(dim, overlap.offsets[d] - c.offsets[d], overlap.sizes[d]);
      dst = dst.narrow(dim, overlap.offsets[d] - dest_box.offsets[d], overlap.sizes[d]);
    }
    dst.copy_(src);
  }
  return bytes;
}

}  // namespace fsdp::checkpoint::detail
