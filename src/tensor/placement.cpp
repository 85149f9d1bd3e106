// Placements and the chunk arithmetic shared by ShardedTensor, FSDP parameter sharding and checkpoints.

#include <fsdp/sharded_tensor.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace fsdp {

Placement Shard(int64_t dim) {
  Placement p;
  p.kind = Placement::Kind::Shard;
  p.dim = dim;
  return p;
}

Placement StridedShard(int64_t dim, int64_t split_factor) {
  TORCH_CHECK(split_factor >= 1, "fsdp: StridedShard split factor must be positive, got ", split_factor);
  Placement p = Shard(dim);
  p.split_factor = split_factor;
  return p;
}

Placement Replicate() { return Placement{}; }

Placement Partial(ReduceOp op) {
  Placement p;
  p.kind = Placement::Kind::Partial;
  p.op = op;
  return p;
}

bool Placement::operator==(const Placement& o) const {
  if (kind != o.kind) return false;
  if (kind == Kind::Shard) return dim == o.dim && split_factor == o.split_factor;
  if (kind == Kind::Partial) return op == o.op;
  return true;
}

std::string Placement::to_string() const {
  switch (kind) {
    case Kind::Shard:
      return split_factor > 1 ? c10::str("_StridedShard(dim=", dim, ", sf=", split_factor, ")")
                              : c10::str("Shard(", dim, ")");
    case Kind::Replicate: return "Replicate()";
    case Kind::Partial: return c10::str("Partial(", fsdp::to_string(op), ")");
  }
  return "?";
}

std::string to_string(const Placements& placements) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < placements.size(); ++i) os << (i ? ", " : "") << placements[i].to_string();
  os << ")";
  return os.str();
}

int64_t padded_shard_size(int64_t dim_size, int64_t num_chunks) {
  TORCH_CHECK(dim_size >= 0, "fsdp: padded_shard_size: negative dim size ", dim_size);
  TORCH_CHECK(num_chunks > 0, "fsdp: padded_shard_size: num_chunks must be positive, got ", num_chunks);
  return (dim_size + num_chunks - 1) / num_chunks;
}

std::pair<int64_t, int64_t> shard_offset_and_size(int64_t dim_size, int64_t num_chunks, int64_t index) {
  TORCH_CHECK(index >= 0 && index < num_chunks, "fsdp: shard_offset_and_size: chunk index ", index,
              " out of range for ", num_chunks, " chunks");
  const int64_t chunk = padded_shard_size(dim_size, num_chunks);
  const int64_t begin = std::min(index * chunk, dim_size);
  const int64_t end = std::min(begin + chunk, dim_size);
  return {begin, end - begin};
}

std::vector<size_t> shard_order(const Placements& placements) {
  // Sort key: the mesh dim itself, or for a _StridedShard just after the last plain Shard of its tensor dim
  // to its right (it splits what those leave).
  std::vector<std::pair<double, size_t>> keyed;
  for (size_t i = 0; i < placements.size(); ++i) {
    double key = static_cast<double>(i);
    if (placements[i].is_strided()) {
      for (size_t j = i + 1; j < placements.size(); ++j) {
        if (placements[j].is_shard(placements[i].dim) && !placements[j].is_strided()) key = j + 0.5;
      }
    }
    keyed.emplace_back(key, i);
  }
  std::stable_sort(keyed.begin(), keyed.end());
  std::vector<size_t> order;
  for (const auto& k : keyed) order.push_back(k.second);
  return order;
}

LocalChunk compute_local_chunk(const std::vector<int64_t>& global_shape, const std::vector<int64_t>& mesh_shape,
                               const Placements& placements, const std::vector<int64_t>& coordinate) {
  TORCH_CHECK(placements.size() == mesh_shape.size() && coordinate.size() == mesh_shape.size(),
              "fsdp: compute_local_chunk: ", placements.size(), " placements and ", coordinate.size(),
              " coordinates for a ", mesh_shape.size(), "-d mesh");
  LocalChunk c;
  c.shape = global_shape;
  c.offset.assign(global_shape.size(), 0);
  for (size_t i : shard_order(placements)) {
    if (!placements[i].is_shard()) continue;
    const int64_t d = placements[i].dim;
    TORCH_CHECK(d >= 0 && d < static_cast<int64_t>(global_shape.size()), "fsdp: ", placements[i].to_string(),
                " on mesh dim ", i, " is out of range for a ", global_shape.size(), "-d tensor");
    // Nested sharding: this mesh dim splits what the earlier ones left.
    const auto [off, len] = shard_offset_and_size(c.shape[d], mesh_shape[i], coordinate[i]);
    c.offset[d] += off;
    c.shape[d] = len;
  }
  return c;
}

}  // namespace fsdp
