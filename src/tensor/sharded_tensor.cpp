// ShardedTensor: construction, metadata, and redistribution between placements.
//
// redistribute() works one mesh dim at a time in two phases, so nested shards of one tensor dim stay
// consistent (mesh dims shard in shard_order — left to right, a _StridedShard after the Shards it nests
// around — so they are undone in reverse):
//   1. in reverse shard order: all-gather every Shard that changes — and every Shard of a tensor dim that some
//      changing mesh dim touches — back to Replicate;
//   2. in the target's shard order: Replicate -> Shard (local chunk), Replicate -> Partial (local), Partial -> Replicate
//      (all-reduce), Partial -> Shard (reduce-scatter).
// Uneven chunks are zero-padded to ceil(n / k) for the collectives and trimmed afterwards.

#include <fsdp/sharded_tensor.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <set>
#include <sstream>

namespace fsdp {
namespace {

// Validates placements for `mesh` and a tensor of `ndim` dims; wraps negative Shard dims.
Placements normalize(const Placements& placements, const DeviceMesh& mesh, int64_t ndim, const char* where) {
  TORCH_CHECK(mesh.valid(), "fsdp: ", where, ": the DeviceMesh is empty");
  TORCH_CHECK(static_cast<int64_t>(placements.size()) == mesh.ndim(), "fsdp: ", where, ": ", placements.size(),
              " placements ", to_string(placements), " for a ", mesh.ndim(), "-d mesh (one per mesh dim)");
  Placements out = placements;
  for (auto& p : out) {
    if (!p.is_shard()) continue;
    const int64_t d = p.dim < 0 ? p.dim + ndim : p.dim;
    TORCH_CHECK(d >= 0 && d < ndim, "fsdp: ", where, ": ", p.to_string(), " is out of range for a ", ndim,
                "-d tensor");
    p.dim = d;
  }
  return out;
}

// Length along tensor dim `d` of the piece mesh dim `i` splits: the global size narrowed by the Shard(d)s of
// the mesh dims before `i` in `order` (shard_order).
int64_t parent_size(const std::vector<int64_t>& global_shape, const DeviceMesh& mesh, const Placements& cur,
                    const std::vector<size_t>& order, const std::vector<int64_t>& coord, size_t i, int64_t d) {
  int64_t n = global_shape[d];
  for (size_t j : order) {
    if (j == i) break;
    if (cur[j].is_shard(d)) n = shard_offset_and_size(n, mesh.size(j), coord[j]).second;
  }
  return n;
}

std::vector<int64_t> with_leading(int64_t lead, const at::Tensor& moved) {
  std::vector<int64_t> s = moved.sizes().vec();
  s[0] = lead;
  return s;
}

// The collectives below run on the group's device. A local tensor held elsewhere — a CPU-offloaded shard of
// a CUDA mesh, which is where FSDP's CPU offload keeps them — is staged there and the result handed back on
// the tensor's own device (PyTorch's state-dict gather moves such DTensors to the mesh's device likewise).
at::TensorOptions on_group_device(const at::Tensor& local, const ProcessGroupPtr& group) {
  return local.options().device(group->device()).pinned_memory(false);
}
at::Tensor back_to(at::Tensor result, const at::Tensor& local) {
  return result.device() == local.device() ? result : result.to(local.device());
}

// Shard(d) -> Replicate along one mesh dim: pad my chunk to ceil(n/k), all-gather, trim to n.
at::Tensor gather_dim(const at::Tensor& local, const ProcessGroupPtr& group, int64_t d, int64_t n) {
  const int64_t k = group->size();
  const int64_t cs = padded_shard_size(n, k);
  const at::Tensor x = local.movedim(d, 0);
  at::Tensor padded = at::zeros(with_leading(cs, x), on_group_device(local, group));
  if (x.size(0) > 0) padded.narrow(0, 0, x.size(0)).copy_(x);
  at::Tensor out = at::empty(with_leading(k * cs, x), on_group_device(local, group));
  group->all_gather_into_tensor(out, padded).wait();
  return back_to(out.narrow(0, 0, n).movedim(0, d).contiguous(), local);
}

// Partial(op) -> Shard(d) along one mesh dim: pad to k * ceil(n/k), reduce-scatter, trim my chunk.
at::Tensor reduce_scatter_dim(const at::Tensor& local, const ProcessGroupPtr& group, int64_t d, int64_t n,
                              int64_t index, ReduceOp op) {
  const int64_t k = group->size();
  const int64_t cs = padded_shard_size(n, k);
  const at::Tensor x = local.movedim(d, 0);
  at::Tensor padded = at::zeros(with_leading(k * cs, x), on_group_device(local, group));
  if (n > 0) padded.narrow(0, 0, n).copy_(x);
  at::Tensor out = at::empty(with_leading(cs, x), on_group_device(local, group));
  group->reduce_scatter_tensor(out, padded, op).wait();
  const int64_t len = shard_offset_and_size(n, k, index).second;
  return back_to(out.narrow(0, 0, len).movedim(0, d).contiguous(), local);
}

at::Tensor chunk_dim(const at::Tensor& local, int64_t d, int64_t n, int64_t k, int64_t index) {
  const auto [off, len] = shard_offset_and_size(n, k, index);
  // A copy, not a view: the piece must not keep the full tensor alive or alias the caller's data.
  return local.narrow(d, off, len).clone(at::MemoryFormat::Contiguous);
}

}  // namespace

ShardedTensor ShardedTensor::from_local(at::Tensor local, DeviceMesh mesh, Placements placements,
                                        std::vector<int64_t> global_shape) {
  TORCH_CHECK(local.defined(), "fsdp: ShardedTensor::from_local: undefined local tensor");
  placements = normalize(placements, mesh, local.dim(), "ShardedTensor::from_local");
  if (global_shape.empty() && local.dim() > 0) {
    global_shape = local.sizes().vec();
    for (size_t i = 0; i < placements.size(); ++i) {
      if (placements[i].is_shard()) global_shape[placements[i].dim] *= mesh.size(i);
    }
  } else {
    TORCH_CHECK(static_cast<int64_t>(global_shape.size()) == local.dim(), "fsdp: ShardedTensor::from_local: global "
                "shape ", c10::IntArrayRef(global_shape), " has ", global_shape.size(), " dims but the local tensor has ",
                local.dim());
    const auto chunk = compute_local_chunk(global_shape, mesh.shape(), placements, mesh.coordinate());
    TORCH_CHECK(chunk.shape == local.sizes().vec(), "fsdp: ShardedTensor::from_local: local shape ",
                c10::IntArrayRef(local.sizes().vec()), " is not the chunk ", c10::IntArrayRef(chunk.shape), " that mesh coordinate ",
                c10::IntArrayRef(mesh.coordinate()), " holds of global shape ", c10::IntArrayRef(global_shape), " with placements ",
                fsdp::to_string(placements));
  }
  ShardedTensor t;
  t.local_ = std::move(local);
  t.mesh_ = std::move(mesh);
  t.placements_ = std::move(placements);
  t.global_shape_ = std::move(global_shape);
  return t;
}

std::vector<int64_t> ShardedTensor::strides() const {
  std::vector<int64_t> st(global_shape_.size(), 1);
  for (int64_t i = static_cast<int64_t>(st.size()) - 2; i >= 0; --i) {
    st[i] = st[i + 1] * std::max<int64_t>(global_shape_[i + 1], 1);
  }
  return st;
}

int64_t ShardedTensor::numel() const {
  int64_t n = 1;
  for (auto s : global_shape_) n *= s;
  return n;
}

std::vector<int64_t> ShardedTensor::local_offset() const {
  return compute_local_chunk(global_shape_, mesh_.shape(), placements_, mesh_.coordinate()).offset;
}

at::Tensor ShardedTensor::full_tensor() const {
  TORCH_CHECK(defined(), "fsdp: full_tensor() of an undefined ShardedTensor");
  return redistribute(Placements(placements_.size(), Replicate())).local();
}

ShardedTensor ShardedTensor::redistribute(const Placements& placements) const {
  TORCH_CHECK(defined(), "fsdp: redistribute() of an undefined ShardedTensor");
  const Placements target = normalize(placements, mesh_, dim(), "ShardedTensor::redistribute");
  const auto coord = mesh_.coordinate();
  const size_t nd = target.size();
  Placements cur = placements_;
  at::Tensor x = local_;

  std::set<int64_t> touched;  // tensor dims whose sharding changes on some mesh dim
  for (size_t i = 0; i < nd; ++i) {
    if (cur[i] == target[i]) continue;
    if (cur[i].is_shard()) touched.insert(cur[i].dim);
    if (target[i].is_shard()) touched.insert(target[i].dim);
    TORCH_CHECK(!(cur[i].is_partial() && target[i].is_partial()), "fsdp: redistribute ", fsdp::to_string(placements_),
                " -> ", fsdp::to_string(target), ": mesh dim ", i, " cannot change ", cur[i].to_string(), " to ",
                target[i].to_string());
  }

  // Phase 1, in reverse shard order: undo shards.
  const std::vector<size_t> cur_order = shard_order(cur);
  for (auto it = cur_order.rbegin(); it != cur_order.rend(); ++it) {
    const size_t ii = *it;
    if (!cur[ii].is_shard() || (cur[ii] == target[ii] && touched.count(cur[ii].dim) == 0)) continue;
    const int64_t d = cur[ii].dim;
    x = gather_dim(x, mesh_.group(ii), d, parent_size(global_shape_, mesh_, cur, cur_order, coord, ii, d));
    cur[ii] = Replicate();
  }
  // Phase 2, in the target's shard order: apply the target placements.
  const std::vector<size_t> target_order = shard_order(target);
  for (size_t i : target_order) {
    if (cur[i] == target[i]) continue;
    const auto& t = target[i];
    if (cur[i].is_partial()) {
      if (t.is_replicate()) {
        const ProcessGroupPtr& g = mesh_.group(i);
        at::Tensor reduced = x.to(on_group_device(x, g), /*non_blocking=*/false, /*copy=*/true,
                                  at::MemoryFormat::Contiguous);
        g->all_reduce(reduced, cur[i].op).wait();
        x = back_to(reduced, x);
      } else {
        const int64_t n = parent_size(global_shape_, mesh_, cur, target_order, coord, i, t.dim);
        x = reduce_scatter_dim(x, mesh_.group(i), t.dim, n, coord[i], cur[i].op);
      }
    } else {  // Replicate
      if (t.is_shard()) {
        const int64_t n = parent_size(global_shape_, mesh_, cur, target_order, coord, i, t.dim);
        x = chunk_dim(x, t.dim, n, mesh_.size(i), coord[i]);
      } else {  // Partial: a split whose reduction gives back the value, exactly
        const bool keep = t.op != ReduceOp::Sum || coord[i] == 0;
        x = keep ? x.clone(at::MemoryFormat::Contiguous) : at::zeros_like(x, at::MemoryFormat::Contiguous);
      }
    }
    cur[i] = t;
  }
  ShardedTensor out;
  out.local_ = x;
  out.mesh_ = mesh_;
  out.placements_ = target;
  out.global_shape_ = global_shape_;
  return out;
}

std::string ShardedTensor::to_string() const {
  if (!defined()) return "ShardedTensor(undefined)";
  std::ostringstream os;
  os << "ShardedTensor(global " << c10::IntArrayRef(global_shape_) << ", " << dtype() << ", placements "
     << fsdp::to_string(placements_) << ", local " << c10::IntArrayRef(local_.sizes().vec()) << " at offset "
     << c10::IntArrayRef(local_offset()) << ", " << mesh_.to_string() << ")";
  return os.str();
}

ShardedTensor distribute_tensor(const at::Tensor& full, const DeviceMesh& mesh, const Placements& placements) {
  TORCH_CHECK(full.defined(), "fsdp: distribute_tensor: undefined tensor");
  const Placements target = normalize(placements, mesh, full.dim(), "distribute_tensor");
  // Start replicated (every rank has the full value) and move locally to the target: Replicate -> Shard and
  // Replicate -> Partial need no communication.
  auto replicated = ShardedTensor::from_local(full, mesh, Placements(target.size(), Replicate()), full.sizes().vec());
  auto out = replicated.redistribute(target);
  if (out.local().is_same(full)) {  // all Replicate: still hand out a private copy
    return ShardedTensor::from_local(full.clone(at::MemoryFormat::Contiguous), mesh, target, full.sizes().vec());
  }
  return out;
}

}  // namespace fsdp
