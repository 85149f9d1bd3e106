// Format layer: metadata JSON and checksums (see format.h).
#include "checkpoint/format.h"

#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/util/json_nesting.h>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <limits>

namespace fsdp::checkpoint::detail {
namespace {

constexpr int64_t kMaxI64 = std::numeric_limits<int64_t>::max();

int64_t mul_checked(int64_t a, int64_t b, const std::string& what) {
  TORCH_CHECK(a >= 0 && b >= 0 && (b == 0 || a <= kMaxI64 / b), what, ": size overflows 64 bits");
  return a * b;
}

uint64_t parse_hex(const std::string& s, const std::string& what) {
  TORCH_CHECK(s.size() == 16, what, ": hash '", s, "' is not 16 hex digits");
  uint64_t v = 0;
  for (char ch : s) {
    int d;
    if (ch >= '0' && ch <= '9') d = ch - '0';
    else if (ch >= 'a' && ch <= 'f') d = ch - 'a' + 10;
    else TORCH_CHECK(false, what, ": hash '", s, "' is not 16 lowercase hex digits");
    v = (v << 4) | static_cast<uint64_t>(d);
  }
  return v;
}

std::vector<int64_t> int_list(const nlohmann::json& j, const std::string& what) {
  TORCH_CHECK(j.is_array(), what, " is not a list");
  std::vector<int64_t> out;
  for (const auto& v : j) {
    TORCH_CHECK(v.is_number_integer(), what, " holds a non-integer");
    out.push_back(v.get<int64_t>());
  }
  return out;
}

int64_t get_int(const nlohmann::json& j, const char* key, const std::string& what) {
  TORCH_CHECK(j.is_object() && j.contains(key) && j[key].is_number_integer(), what, ": \"", key,
              "\" missing or not an integer");
  return j[key].get<int64_t>();
}

bool boxes_overlap(const ChunkMeta& a, const ChunkMeta& b) {
  for (size_t d = 0; d < a.offsets.size(); ++d) {
    if (!(a.offsets[d] < b.offsets[d] + b.sizes[d] && b.offsets[d] < a.offsets[d] + a.sizes[d])) return false;
  }
  return true;
}

// Sweep along the dimension with the most distinct chunk offsets (dim 0 for FSDP's row shards, dim 1 for column
// shards): only chunks whose ranges on it intersect are compared, linear for any 1-D sharding. A hostile file can
// still make every pair intersect on every dimension; `budget` (shared by the whole metadata file) bounds the
// comparisons, so the work per file stays bounded whatever it holds.
void check_no_overlap(const TensorMeta& t, const std::string& what, int64_t& budget) {
  std::vector<size_t> order(t.chunks.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  if (t.shape.empty()) {
    TORCH_CHECK(t.chunks.size() <= 1, what, ": ", t.chunks.size(), " chunks of a 0-dim tensor overlap");
    return;
  }
  if (t.chunks.size() <= 1) return;
  size_t dim = 0, most = 0;
  for (size_t d = 0; d < t.shape.size(); ++d) {
    std::vector<int64_t> starts;
    starts.reserve(t.chunks.size());
    for (const auto& c : t.chunks) starts.push_back(c.offsets[d]);
    std::sort(starts.begin(), starts.end());
    const auto distinct = static_cast<size_t>(std::unique(starts.begin(), starts.end()) - starts.begin());
    if (distinct > most) most = distinct, dim = d;
  }
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return t.chunks[a].offsets[dim] < t.chunks[b].offsets[dim]; });
  std::vector<size_t> active;
  for (size_t i : order) {
    const ChunkMeta& c = t.chunks[i];
    budget -= static_cast<int64_t>(active.size());
    TORCH_CHECK(budget >= 0, what, ": too many chunks sharing rows and columns to check for overlaps (more than ",
                kMaxOverlapComparisons, " box comparisons per metadata file)");
    active.erase(std::remove_if(active.begin(), active.end(),
                                [&](size_t k) { return t.chunks[k].offsets[dim] + t.chunks[k].sizes[dim] <= c.offsets[dim]; }),
                 active.end());
    for (size_t k : active) {
      TORCH_CHECK(!boxes_overlap(c, t.chunks[k]), what, ": chunk ", i, " (file '", c.file, "') overlaps chunk ", k,
                  " (file '", t.chunks[k].file, "')");
    }
    active.push_back(i);
  }
}

}  // namespace

int64_t checked_numel(const std::vector<int64_t>& shape, const std::string& what) {
  int64_t n = 1;
  for (int64_t s : shape) {
    TORCH_CHECK(s >= 0, what, ": negative size ", s);
    n = mul_checked(n, s, what);
  }
  return n;
}

int64_t TensorMeta::numel() const { return checked_numel(shape, "tensor"); }
int64_t TensorMeta::nbytes() const { return numel() * static_cast<int64_t>(c10::elementSize(dtype)); }

uint64_t hash_bytes(const void* data, int64_t n) { return XXH3_64bits(data, static_cast<size_t>(n)); }

std::string hash_hex(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::vector<uint64_t> block_hashes(const void* data, int64_t n, int64_t block_bytes) {
  std::vector<uint64_t> out;
  const auto* p = static_cast<const char*>(data);
  for (int64_t at = 0; at < n; at += block_bytes) out.push_back(hash_bytes(p + at, std::min(block_bytes, n - at)));
  return out;
}

bool is_plain_file_name(const std::string& name) {
  if (name.empty() || name == "." || name == ".." || name.size() > 255) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == '-';
  });
}

nlohmann::json chunk_to_json(const ChunkMeta& c) {
  nlohmann::json hashes = nlohmann::json::array();
  for (uint64_t h : c.hashes) hashes.push_back(hash_hex(h));
  return {{"offsets", c.offsets}, {"sizes", c.sizes}, {"file", c.file},
          {"offset", c.offset},   {"length", c.length}, {"hashes", hashes}};
}

std::string chunk_to_json_text(const std::string& fqn, c10::ScalarType dtype, const std::vector<int64_t>& shape,
                               const ChunkMeta& c) {
  nlohmann::json j = {{"fqn", fqn}, {"dtype", safetensors::dtype_name(dtype)}, {"shape", shape},
                      {"chunk", chunk_to_json(c)}};
  return j.dump();
}

std::string to_json_text(const Metadata& md) {
  nlohmann::json j;
  j["format"] = kFormatName;
  j["version"] = md.version;
  j["hash"] = "xxh3-64";
  j["block_bytes"] = md.block_bytes;
  j["world_size"] = md.world_size;
  j["saved_on"] = md.saved_on;
  j["files"] = nlohmann::json::object();
  for (const auto& [name, size] : md.files) j["files"][name] = {{"size", size}};
  j["tensors"] = nlohmann::json::object();
  for (const auto& [fqn, t] : md.tensors) {
    nlohmann::json chunks = nlohmann::json::array();
    for (const auto& c : t.chunks) chunks.push_back(chunk_to_json(c));
    j["tensors"][fqn] = {{"dtype", safetensors::dtype_name(t.dtype)}, {"shape", t.shape}, {"chunks", chunks}};
  }
  j["values"] = nlohmann::json::object();
  for (const auto& [k, v] : md.values) j["values"][k] = nlohmann::json::parse(v);
  return j.dump(1) + "\n";
}

Metadata parse_metadata(const std::string& text, const std::string& where) {
  const size_t deep = util::json_nesting_beyond(text, kMaxMetadataDepth);
  TORCH_CHECK(deep == std::string::npos, "checkpoint: ", where, ": JSON nested deeper than ", kMaxMetadataDepth,
              " levels (at byte ", deep, ")");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "checkpoint: ", where, " is not valid JSON: ", e.what());
  }
  TORCH_CHECK(j.is_object(), "checkpoint: ", where, " is not a JSON object");
  TORCH_CHECK(j.contains("format") && j["format"] == kFormatName, "checkpoint: ", where,
              " is not a libfsdp checkpoint (\"format\" is not \"", kFormatName, "\")");
  Metadata md;
  md.version = static_cast<int>(get_int(j, "version", "checkpoint: " + where));
  TORCH_CHECK(md.version == kFormatVersion, "checkpoint: ", where, " has format version ", md.version,
              "; this build reads version ", kFormatVersion);
  TORCH_CHECK(j.contains("hash") && j["hash"] == "xxh3-64", "checkpoint: ", where, ": unknown \"hash\" (expected xxh3-64)");
  md.block_bytes = get_int(j, "block_bytes", "checkpoint: " + where);
  md.world_size = get_int(j, "world_size", "checkpoint: " + where);
  if (j.contains("saved_on") && j["saved_on"].is_string()) md.saved_on = j["saved_on"].get<std::string>();
  TORCH_CHECK(j.contains("files") && j["files"].is_object(), "checkpoint: ", where, ": \"files\" missing");
  for (auto it = j["files"].begin(); it != j["files"].end(); ++it) {
    md.files[it.key()] = get_int(it.value(), "size", "checkpoint: " + where + ": file '" + it.key() + "'");
  }
  TORCH_CHECK(j.contains("tensors") && j["tensors"].is_object(), "checkpoint: ", where, ": \"tensors\" missing");
  for (auto it = j["tensors"].begin(); it != j["tensors"].end(); ++it) {
    const std::string what = "checkpoint: " + where + ": tensor '" + it.key() + "'";
    const auto& v = it.value();
    TORCH_CHECK(v.is_object() && v.contains("dtype") && v["dtype"].is_string(), what, ": \"dtype\" missing");
    TensorMeta t;
    try {
      t.dtype = safetensors::dtype_from_name(v["dtype"].get<std::string>());
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, what, ": ", e.msg());
    }
    TORCH_CHECK(v.contains("shape") && v.contains("chunks") && v["chunks"].is_array(), what, ": shape or chunks missing");
    t.shape = int_list(v["shape"], what + ": shape");
    for (const auto& c : v["chunks"]) {
      TORCH_CHECK(c.is_object(), what, ": a chunk is not an object");
      ChunkMeta m;
      TORCH_CHECK(c.contains("offsets") && c.contains("sizes") && c.contains("hashes") && c["hashes"].is_array() &&
                      c.contains("file") && c["file"].is_string(),
                  what, ": chunk without offsets, sizes, file or hashes");
      m.offsets = int_list(c["offsets"], what + ": chunk offsets");
      m.sizes = int_list(c["sizes"], what + ": chunk sizes");
      m.file = c["file"].get<std::string>();
      m.offset = get_int(c, "offset", what + ": chunk");
      m.length = get_int(c, "length", what + ": chunk");
      for (const auto& h : c["hashes"]) {
        TORCH_CHECK(h.is_string(), what, ": a hash is not a string");
        m.hashes.push_back(parse_hex(h.get<std::string>(), what));
      }
      t.chunks.push_back(std::move(m));
    }
    md.tensors.emplace(it.key(), std::move(t));
  }
  if (j.contains("values")) {
    TORCH_CHECK(j["values"].is_object(), "checkpoint: ", where, ": \"values\" is not an object");
    for (auto it = j["values"].begin(); it != j["values"].end(); ++it) md.values[it.key()] = it.value().dump();
  }
  validate(md, where);
  return md;
}

void validate(const Metadata& md, const std::string& where, ChunkEncoding encoding) {
  const bool raw = encoding == ChunkEncoding::RawBlocks;
  TORCH_CHECK(!raw || (md.block_bytes >= 64 && md.block_bytes <= (int64_t(1) << 32)), "checkpoint: ", where,
              ": block_bytes ", md.block_bytes, " out of range");
  TORCH_CHECK(md.world_size >= 1, "checkpoint: ", where, ": world_size ", md.world_size, " < 1");
  for (const auto& [name, size] : md.files) {
    TORCH_CHECK(is_plain_file_name(name), "checkpoint: ", where, ": file name '", name,
                "' is not a plain name inside the checkpoint directory");
    TORCH_CHECK(size >= 0, "checkpoint: ", where, ": file '", name, "' has negative size ", size);
  }
  // Byte ranges per file, to check that no two chunks share bytes.
  std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> ranges;
  int64_t chunks = 0, comparisons = kMaxOverlapComparisons;
  for (const auto& [fqn, t] : md.tensors) {
    const std::string what = "checkpoint: " + where + ": tensor '" + fqn + "'";
    TORCH_CHECK(!fqn.empty(), "checkpoint: ", where, ": empty tensor name");
    TORCH_CHECK(t.shape.size() <= 64, what, ": ", t.shape.size(), " dims");
    const int64_t numel = checked_numel(t.shape, what);
    const int64_t esize = static_cast<int64_t>(c10::elementSize(t.dtype));
    mul_checked(numel, esize, what);
    TORCH_CHECK(t.chunks.size() <= static_cast<size_t>(kMaxChunksPerTensor), what, ": ", t.chunks.size(),
                " chunks (at most ", kMaxChunksPerTensor, " per tensor)");
    chunks += static_cast<int64_t>(t.chunks.size());
    TORCH_CHECK(chunks <= kMaxChunks, "checkpoint: ", where, ": more than ", kMaxChunks, " chunks in all");
    int64_t covered = 0;
    for (size_t i = 0; i < t.chunks.size(); ++i) {
      const ChunkMeta& c = t.chunks[i];
      const std::string cw = what + " chunk " + std::to_string(i) + " (file '" + c.file + "')";
      TORCH_CHECK(c.offsets.size() == t.shape.size() && c.sizes.size() == t.shape.size(), cw,
                  ": offsets/sizes have the wrong number of dims");
      for (size_t d = 0; d < t.shape.size(); ++d) {
        TORCH_CHECK(c.offsets[d] >= 0 && c.sizes[d] >= 0 && c.offsets[d] <= t.shape[d] &&
                        c.sizes[d] <= t.shape[d] - c.offsets[d],
                    cw, ": box offset ", c.offsets[d], " size ", c.sizes[d], " outside dim ", d, " of size ", t.shape[d]);
      }
      const int64_t cnumel = checked_numel(c.sizes, cw);
      TORCH_CHECK(cnumel > 0, cw, ": empty chunk");
      TORCH_CHECK(raw ? c.length == cnumel * esize : c.length > 0, cw, ": holds ", c.length,
                  " bytes but its box needs ", cnumel * esize);
      auto f = md.files.find(c.file);
      TORCH_CHECK(f != md.files.end(), cw, ": file not listed in \"files\"");
      TORCH_CHECK(c.offset >= 0 && c.offset <= f->second && c.length <= f->second - c.offset, cw, ": bytes [",
                  c.offset, ", +", c.length, ") outside the file's ", f->second, " bytes");
      if (raw) {
        const int64_t blocks = (c.length + md.block_bytes - 1) / md.block_bytes;
        TORCH_CHECK(static_cast<int64_t>(c.hashes.size()) == blocks, cw, ": ", c.hashes.size(), " hashes for ",
                    blocks, " blocks");
      }
      ranges[c.file].emplace_back(c.offset, c.length);
      TORCH_CHECK(cnumel <= numel - covered, cw, ": the chunks hold more elements than the tensor (overlap)");
      covered += cnumel;
    }
    check_no_overlap(t, what, comparisons);
    TORCH_CHECK(covered == numel, what, ": chunks cover ", covered, " of ", numel, " elements (incomplete checkpoint)");
  }
  for (auto& [file, rs] : ranges) {
    std::sort(rs.begin(), rs.end());
    for (size_t i = 1; i < rs.size(); ++i) {
      TORCH_CHECK(rs[i - 1].first + rs[i - 1].second <= rs[i].first, "checkpoint: ", where, ": file '", file,
                  "': chunks overlap at byte ", rs[i].first);
    }
  }
}

}  // namespace fsdp::checkpoint::detail
