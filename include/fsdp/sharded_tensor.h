#pragma once
// ShardedTensor: a DTensor-like global tensor stored as one local piece per rank of a DeviceMesh.
//
// Each mesh dim has a placement:
//   Shard(d)      the tensor is split along tensor dim d across that mesh dim, torch.chunk-style:
//                 chunk size ceil(n / k); trailing chunks may be smaller or EMPTY (3 rows over 4 ranks ->
//                 1, 1, 1, 0). Several mesh dims sharding the same tensor dim nest left to right, as in DTensor.
//   Replicate()   every rank of that mesh dim holds the same values.
//   Partial(op)   every rank holds a partial value; the global value is op over the ranks of that mesh dim.
//   _StridedShard(d, split_factor)   PyTorch's strided sharding: a Shard(d) that applies *after* the Shard(d)s
//                 of the mesh dims to its right (which split the dim into split_factor pieces first). FSDP over
//                 tensor parallel writes (_StridedShard(0, tp), Shard(0)) for a colwise weight: TP splits the
//                 rows into tp chunks, then FSDP splits each rank's chunk across the data-parallel ranks, so
//                 the data-parallel rank's rows are not contiguous in the global tensor order of "dp outer".
// FSDP uses (Shard(0)) on a 1-D mesh and (Replicate(), Shard(0)) on a 2-D HSDP mesh.
//
// Nothing here communicates except full_tensor() and redistribute(), which are collective over the mesh
// (every rank must call them in the same order).

#include <fsdp/device_mesh.h>
#include <fsdp/process_group.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {

struct Placement {
  enum class Kind { Shard, Replicate, Partial };
  Kind kind = Kind::Replicate;
  int64_t dim = 0;               // tensor dim, for Shard
  ReduceOp op = ReduceOp::Sum;   // reduction, for Partial
  int64_t split_factor = 1;      // > 1: a _StridedShard (see above)

  bool is_shard() const { return kind == Kind::Shard; }
  bool is_shard(int64_t d) const { return kind == Kind::Shard && dim == d; }
  bool is_strided() const { return kind == Kind::Shard && split_factor > 1; }
  bool is_replicate() const { return kind == Kind::Replicate; }
  bool is_partial() const { return kind == Kind::Partial; }
  std::string to_string() const;  // "Shard(0)", "Replicate()", "Partial(Sum)", "_StridedShard(dim=0, sf=2)"
  bool operator==(const Placement& o) const;
  bool operator!=(const Placement& o) const { return !(*this == o); }
};

Placement Shard(int64_t dim);
Placement StridedShard(int64_t dim, int64_t split_factor);
Placement Replicate();
Placement Partial(ReduceOp op = ReduceOp::Sum);

using Placements = std::vector<Placement>;  // one per mesh dim
std::string to_string(const Placements& placements);

// torch.chunk / DTensor Shard semantics for one chunk: (offset, length) of chunk `index` when `dim_size`
// elements are split into `num_chunks` chunks of ceil(dim_size / num_chunks); trailing chunks may be shorter
// or empty (offset is then clamped to dim_size). Example: (3, 4, 3) -> (3, 0); (10, 4, 3) -> (9, 1).
std::pair<int64_t, int64_t> shard_offset_and_size(int64_t dim_size, int64_t num_chunks, int64_t index);
// ceil(dim_size / num_chunks): the padded chunk length every rank allocates for even collectives.
int64_t padded_shard_size(int64_t dim_size, int64_t num_chunks);

// The order in which the mesh dims' Shards split the tensor: left to right, except that a _StridedShard comes
// after the plain Shards of the same tensor dim to its right.
std::vector<size_t> shard_order(const Placements& placements);

// Shape and global offset of the piece held at mesh coordinate `coordinate` (nesting Shards in shard_order).
struct LocalChunk {
  std::vector<int64_t> shape;
  std::vector<int64_t> offset;
};
LocalChunk compute_local_chunk(const std::vector<int64_t>& global_shape, const std::vector<int64_t>& mesh_shape,
                               const Placements& placements, const std::vector<int64_t>& coordinate);

class ShardedTensor {
 public:
  ShardedTensor() = default;  // undefined; defined() is false

  // Wraps this rank's piece, no communication. With `global_shape` empty, it is inferred assuming every Shard
  // is even (local size * mesh size); otherwise the local shape must equal the chunk this rank should hold.
  static ShardedTensor from_local(at::Tensor local, DeviceMesh mesh, Placements placements,
                                  std::vector<int64_t> global_shape = {});

  bool defined() const { return local_.defined(); }
  const at::Tensor& local() const { return local_; }  // this rank's piece (to_local())
  const DeviceMesh& mesh() const { return mesh_; }
  const Placements& placements() const { return placements_; }
  const std::vector<int64_t>& sizes() const { return global_shape_; }  // global shape
  std::vector<int64_t> strides() const;                                 // contiguous strides of the global shape
  int64_t dim() const { return static_cast<int64_t>(global_shape_.size()); }
  int64_t numel() const;                                                 // global
  at::ScalarType dtype() const { return local_.scalar_type(); }
  std::vector<int64_t> local_offset() const;  // global index of local()[0, 0, ...]

  // Collective: the whole global tensor on every rank (all-gathers Shards, all-reduces Partials; uneven
  // shards are zero-padded internally).
  at::Tensor full_tensor() const;
  // Collective: the same global tensor with other placements. Supported per mesh dim: Shard(d) -> Replicate
  // (all-gather), Replicate -> Shard(d) (local chunk), Shard(d) -> Shard(d') (all-gather + chunk),
  // Partial -> Replicate (all-reduce), Partial -> Shard(d) (reduce-scatter), Replicate -> Partial (local:
  // coordinate 0 keeps the value, others hold 0 for Sum; every rank keeps it for Avg/Max/Min), and the same
  // placement (no-op). Partial(a) -> Partial(b) with a != b is an error.
  ShardedTensor redistribute(const Placements& placements) const;

  std::string to_string() const;

 private:
  at::Tensor local_;
  DeviceMesh mesh_;
  Placements placements_;
  std::vector<int64_t> global_shape_;
};

// Collective-free: every rank passes the same full tensor and keeps its own piece (a contiguous copy).
ShardedTensor distribute_tensor(const at::Tensor& full, const DeviceMesh& mesh, const Placements& placements);

}  // namespace fsdp
