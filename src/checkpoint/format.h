#pragma once
// Format layer of distributed checkpoints: the metadata (versioned JSON, data only), its validation against
// hostile input, and the per-block checksums (xxHash XXH3-64). No I/O and no collectives here.
//
// metadata.json:
//   {"format": "libfsdp-checkpoint", "version": 1, "hash": "xxh3-64", "block_bytes": B,
//    "world_size": N, "saved_on": "<mesh description>",
//    "files":   {"rank-00000.bin": {"size": bytes}, ...},
//    "tensors": {"<fqn>": {"dtype": "F32", "shape": [..],
//                          "chunks": [{"offsets": [..], "sizes": [..], "file": "rank-00000.bin",
//                                      "offset": byte, "length": bytes, "hashes": ["<16 hex>", ...]}]}},
//    "values":  {"<key>": <any JSON>}}
// A chunk's bytes are its row-major elements; hashes[i] covers bytes [i*B, min((i+1)*B, length)).

#include <c10/core/ScalarType.h>
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail {

constexpr const char* kFormatName = "libfsdp-checkpoint";
constexpr int kFormatVersion = 1;
constexpr const char* kMetadataFile = "metadata.json";
// Limits a reader enforces on metadata a file controls (docs/reliability.md): its size, the nesting of its JSON
// (checked on the bytes before parsing), chunks per tensor and in all, and the box comparisons the overlap check
// may make (linear for 1-D sharding; a file forcing more is refused rather than checked for minutes).
constexpr int64_t kMaxMetadataBytes = int64_t(1) << 30;
constexpr int kMaxMetadataDepth = 64;
constexpr int64_t kMaxChunksPerTensor = int64_t(1) << 20;
constexpr int64_t kMaxChunks = int64_t(1) << 24;
constexpr int64_t kMaxOverlapComparisons = int64_t(1) << 26;

struct ChunkMeta {
  std::vector<int64_t> offsets, sizes;  // global coordinates of the box
  std::string file;
  int64_t offset = 0, length = 0;       // bytes in `file`
  std::vector<uint64_t> hashes;         // one per block
};

struct TensorMeta {
  c10::ScalarType dtype = c10::kFloat;
  std::vector<int64_t> shape;
  std::vector<ChunkMeta> chunks;
  int64_t numel() const;
  int64_t nbytes() const;
};

// The metadata of a checkpoint of either format, as the save loop builds it and OpenCheckpoint reads it. The
// format itself is not recorded here: it is what the codec writes and what checkpoint_format() detects. A DCP
// checkpoint's chunks are torch.save archives (ChunkEncoding::Archive: length = the archive's bytes, no hashes).
struct Metadata {
  // DCP values that are not plain data (key -> why): listed, never loaded.
  std::map<std::string, std::string> unreadable;
  int version = kFormatVersion;
  int64_t block_bytes = 4 << 20;
  int64_t world_size = 1;
  std::string saved_on;
  std::map<std::string, int64_t> files;  // name -> size in bytes
  std::map<std::string, TensorMeta> tensors;
  std::map<std::string, std::string> values;  // key -> JSON text
};

// 64-bit XXH3 of a byte range; hex form as stored.
uint64_t hash_bytes(const void* data, int64_t n);
std::string hash_hex(uint64_t h);
// Hashes of consecutive blocks of `block_bytes`.
std::vector<uint64_t> block_hashes(const void* data, int64_t n, int64_t block_bytes);

std::string chunk_to_json_text(const std::string& fqn, c10::ScalarType dtype, const std::vector<int64_t>& shape,
                               const ChunkMeta& c);
nlohmann::json chunk_to_json(const ChunkMeta& c);

std::string to_json_text(const Metadata& md);
// Parses and validates everything a reader relies on; `where` names the file in errors. Checks: format and
// version, dtypes, non-negative shapes without overflow, chunks inside their tensor, no two chunks overlapping,
// chunks covering the tensor, byte lengths matching sizes x dtype, byte ranges inside the recorded file sizes
// and not overlapping, one hash per block, file names plain (no '/', not '.' or '..').
Metadata parse_metadata(const std::string& text, const std::string& where);
// How a chunk's bytes hold its elements. RawBlocks (libfsdp): exactly the row-major elements, one hash per
// block of block_bytes. Archive (PyTorch DCP): one self-describing torch.save archive of any length, no hashes
// (block_bytes unused).
enum class ChunkEncoding { RawBlocks, Archive };
// The same checks on an in-memory Metadata (the coordinator runs them before committing a save).
void validate(const Metadata& md, const std::string& where, ChunkEncoding encoding = ChunkEncoding::RawBlocks);

bool is_plain_file_name(const std::string& name);
int64_t checked_numel(const std::vector<int64_t>& shape, const std::string& what);

}  // namespace fsdp::checkpoint::detail
