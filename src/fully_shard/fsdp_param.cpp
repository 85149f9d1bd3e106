#include "fully_shard/fsdp_param.h"

#include "fully_shard/storage.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/variable.h>

namespace fsdp::detail {

ShardGeometry ShardGeometry::make(c10::IntArrayRef sizes, int64_t world, int64_t shard_dim) {
  TORCH_CHECK(world >= 1, "fsdp: shard group size must be positive, got ", world);
  ShardGeometry g;
  g.world = world;
  if (sizes.empty()) {
    // A 0-dim parameter: one row, held by every rank (see ShardGeometry).
    g.dim0 = 1;
    g.chunk_rows = 1;
    g.replicated = true;
    return g;
  }
  const auto ndim = static_cast<int64_t>(sizes.size());
  TORCH_CHECK(shard_dim >= -ndim && shard_dim < ndim, "fsdp: shard dim ", shard_dim, " is out of range for a ",
              ndim, "-dim parameter of shape ", sizes);
  g.shard_dim = shard_dim < 0 ? shard_dim + ndim : shard_dim;
  g.dim0 = sizes[g.shard_dim];
  for (int64_t d = 0; d < ndim; ++d) {
    if (d == g.shard_dim) continue;
    g.row_sizes.push_back(sizes[d]);
    g.row_numel *= sizes[d];
  }
  g.chunk_rows = (g.dim0 + world - 1) / world;
  return g;
}

std::vector<int64_t> ShardGeometry::rows_shape(std::initializer_list<int64_t> leading) const {
  std::vector<int64_t> shape(leading);
  shape.insert(shape.end(), row_sizes.begin(), row_sizes.end());
  return shape;
}

at::Tensor ShardGeometry::rows_view(const at::Tensor& full) const {
  if (replicated) return full.reshape({1});
  return shard_dim == 0 ? full : full.movedim(shard_dim, 0);
}

at::Tensor ShardGeometry::from_rows(const at::Tensor& rows) const {
  if (replicated) return rows.view(c10::IntArrayRef{});
  return shard_dim == 0 ? rows : rows.movedim(0, shard_dim);
}

int64_t ShardGeometry::offset_of(int64_t rank) const {
  if (replicated) return 0;
  return std::min(dim0, rank * chunk_rows);
}

int64_t ShardGeometry::rows_of(int64_t rank) const {
  if (replicated) return dim0;
  return std::min(dim0, (rank + 1) * chunk_rows) - offset_of(rank);
}

namespace {
c10::ScalarType resolve_param_dtype(const at::Tensor& p, const MixedPrecisionPolicy& mp) {
  // As in PyTorch: param_dtype applies to floating-point parameters only.
  if (mp.param_dtype && at::isFloatingType(p.scalar_type())) return *mp.param_dtype;
  return p.scalar_type();
}
}  // namespace

FSDPParam::FSDPParam(at::Tensor param, std::string fqn, int64_t shard_rank, int64_t shard_world,
                     c10::Device device, const MixedPrecisionPolicy& mp, const OffloadPolicy& offload,
                     int64_t shard_dim, std::shared_ptr<const AllGatherTransform> transform)
    : param_(std::move(param)),
      transform_(std::move(transform)),
      fqn_(std::move(fqn)),
      unsharded_sizes_(param_.sizes().vec()),
      geometry_(ShardGeometry::make(param_.sizes(), shard_world, shard_dim)),
      shard_rank_(shard_rank),
      orig_dtype_(param_.scalar_type()),
      param_dtype_(resolve_param_dtype(param_, mp)),
      reduce_dtype_(mp.reduce_dtype && at::isFloatingType(param_.scalar_type()) ? *mp.reduce_dtype
                                                                                 : resolve_param_dtype(param_, mp)) {
  TORCH_CHECK(param_.layout() == c10::kStrided, "fsdp: parameter '", fqn_, "' is not a dense strided tensor");
  TORCH_CHECK(!transform_ || (geometry_.shard_dim == 0 && !geometry_.replicated), "fsdp: parameter '", fqn_,
              "' has an all-gather transform but is ", geometry_.replicated ? "0-dim" : "sharded on a dim other than 0",
              "; all-gather transforms take dim-0 shards");
  c10::NoGradGuard no_grad;
  const bool on_meta = param_.is_meta();
  const c10::Device sharded_device = on_meta ? param_.device() : (offload.cpu_offload ? c10::Device(c10::kCPU) : device);
  const c10::Device unsharded_device = on_meta ? param_.device() : device;

  allocate_storage(sharded_device, unsharded_device, offload, device, /*copy_from_param=*/!on_meta);
  // The module's tensor now shows the shard. Its old full-size data is released with the old storage.
  param_.set_data(sharded_local_);
}

void FSDPParam::allocate_storage(c10::Device sharded_device, c10::Device unsharded_device, const OffloadPolicy& offload,
                                 c10::Device compute_device, bool copy_from_param) {
  const bool on_meta = sharded_device.is_meta();
  // Padded shard in rows layout: [chunk_rows, row_sizes...], zero padding rows at the end.
  auto sharded_opts = at::TensorOptions().dtype(orig_dtype_).device(sharded_device);
  if (offload.cpu_offload && offload.pin_memory && sharded_device.is_cpu() && compute_device.is_cuda()) {
    sharded_opts = sharded_opts.pinned_memory(true);
  }
  const std::vector<int64_t> padded_sizes = geometry_.rows_shape({geometry_.chunk_rows});
  sharded_padded_ = on_meta ? at::empty(padded_sizes, sharded_opts) : at::zeros(padded_sizes, sharded_opts);
  const int64_t rows = geometry_.rows_of(shard_rank_);
  // The visible shard: the owned rows, in the parameter's own layout (0-dim: keeps the 0-dim look on every rank).
  sharded_local_ = geometry_.from_rows(sharded_padded_.narrow(0, 0, rows));
  if (copy_from_param && rows > 0) sharded_local_.copy_(local_part_of(param_));
  // (A transform always runs, also on one rank: the parameter shows what it rebuilds, on any world size.)
  aliases_shard_ = geometry_.world == 1 && param_dtype_ == orig_dtype_ && sharded_device == unsharded_device &&
                   !offload.cpu_offload && (geometry_.shard_dim == 0 || geometry_.replicated) && !transform_;
  if (aliases_shard_) {
    // One rank owns every row: the padded shard has no padding and already has the full shape.
    TORCH_CHECK(sharded_local_.sizes() == c10::IntArrayRef(unsharded_sizes_) && sharded_local_.is_contiguous(),
                "fsdp internal: world-size-1 shard of '", fqn_, "' has shape ", sharded_local_.sizes(),
                ", expected the full shape ", unsharded_sizes_);
    unsharded_ = sharded_local_;
    return;
  }
  unsharded_ = at::empty(unsharded_sizes_, at::TensorOptions().dtype(param_dtype_).device(unsharded_device));
  if (!on_meta) free_storage(unsharded_);
}

at::Tensor FSDPParam::local_part_of(const at::Tensor& full) const {
  const int64_t rows = geometry_.rows_of(shard_rank_);
  return geometry_.from_rows(geometry_.rows_view(full).narrow(0, geometry_.offset_of(shard_rank_), rows));
}

void FSDPParam::materialize(c10::Device device, const OffloadPolicy& offload) {
  if (!sharded_padded_.is_meta()) return;
  TORCH_CHECK(state_ == ShardedState::Sharded, "fsdp internal: materializing '", fqn_, "' while unsharded");
  c10::NoGradGuard no_grad;
  allocate_storage(offload.cpu_offload ? c10::Device(c10::kCPU) : device, device, offload, device,
                   /*copy_from_param=*/false);
  replace_data(param_, sharded_local_);
  known_zero_ = true;
  known_zero_version_ = param_._version();
}

void FSDPParam::begin_full_init(ProcessGroup& group) {
  TORCH_CHECK(state_ == ShardedState::Sharded && !full_init_.defined(),
              "fsdp internal: begin_full_init of '", fqn_, "' while unsharded");
  c10::NoGradGuard no_grad;
  const auto opts = at::TensorOptions().dtype(orig_dtype_).device(unsharded_.device());
  at::Tensor full = at::zeros(unsharded_sizes_, opts);
  if (!known_zero()) {
    if (geometry_.replicated) {
      full.copy_(sharded_local_);
    } else {
      at::Tensor gathered = at::empty(geometry_.rows_shape({geometry_.chunk_rows * geometry_.world}), opts);
      at::Tensor input = sharded_padded_.to(unsharded_.device());
      group.all_gather_into_tensor(gathered.view({-1}), input.view({-1})).wait();
      geometry_.rows_view(full).copy_(gathered.narrow(0, 0, geometry_.dim0));
    }
  }
  full_init_ = full;
  param_.set_data(full_init_);
}

void FSDPParam::end_full_init() {
  if (!full_init_.defined()) return;
  c10::NoGradGuard no_grad;
  if (geometry_.rows_of(shard_rank_) > 0) sharded_local_.copy_(local_part_of(full_init_));
  param_.set_data(sharded_local_);
  full_init_ = at::Tensor();
  known_zero_ = false;
}

void FSDPParam::alloc_unsharded() {
  if (!aliases_shard_) alloc_storage(unsharded_);
}

void FSDPParam::free_unsharded() {
  // Aliased: the "unsharded" storage is the shard itself, which must never be freed.
  if (!aliases_shard_) free_storage(unsharded_);
}

void FSDPParam::to_unsharded() {
  if (state_ == ShardedState::Unsharded) return;
  check_identity("unshard");
  at::Tensor& grad = param_.mutable_grad();
  if (grad.defined()) {
    stashed_sharded_grad_ = grad;
    grad = at::Tensor();
  }
  param_.set_data(unsharded_);
  state_ = ShardedState::Unsharded;
}

void FSDPParam::to_sharded() {
  if (state_ == ShardedState::Sharded) return;
  TORCH_CHECK(!param_.grad().defined(),
              "fsdp internal: resharding '", fqn_, "' while it still holds an unsharded gradient");
  param_.set_data(sharded_local_);
  if (stashed_sharded_grad_.defined()) {
    param_.mutable_grad() = stashed_sharded_grad_;
    stashed_sharded_grad_ = at::Tensor();
  }
  state_ = ShardedState::Sharded;
}

at::Tensor FSDPParam::take_unsharded_grad() {
  at::Tensor grad;
  if (state_ == ShardedState::Unsharded) {
    grad = param_.grad();
    param_.mutable_grad() = at::Tensor();
  }
  if (accumulated_unsharded_grad_.defined()) {
    if (grad.defined()) {
      accumulated_unsharded_grad_.add_(grad.to(accumulated_unsharded_grad_.scalar_type()));
    }
    grad = accumulated_unsharded_grad_;
    accumulated_unsharded_grad_ = at::Tensor();
  }
  return grad;
}

void FSDPParam::accumulate_unsharded_grad() {
  if (state_ != ShardedState::Unsharded) return;
  at::Tensor grad = param_.grad();
  if (!grad.defined()) return;
  param_.mutable_grad() = at::Tensor();
  // Accumulate in the reduce dtype (fp32 under bf16 compute keeps micro-batch sums exact enough).
  if (!accumulated_unsharded_grad_.defined()) {
    // We took the only reference from the parameter, so the gradient itself can be kept.
    accumulated_unsharded_grad_ = grad.scalar_type() == reduce_dtype_ ? grad : grad.to(reduce_dtype_);
  } else {
    accumulated_unsharded_grad_.add_(grad.to(reduce_dtype_));
  }
}

bool FSDPParam::accumulate_sharded_grad(const at::Tensor& local_grad) {
  TORCH_CHECK(state_ == ShardedState::Sharded, "fsdp internal: sharded grad for '", fqn_, "' while unsharded");
  at::Tensor& grad = param_.mutable_grad();
  // Offloaded gradient copied from the device into pinned memory without blocking the host (Python's
  // foreach_reduce): only when nothing on the host reads the result right away, i.e. no gradient to add it to,
  // and the copy is the final tensor (contiguous, not a 0-dim view, which would be cloned below).
  const bool non_blocking = !grad.defined() && local_grad.device() != sharded_local_.device() &&
                            sharded_local_.is_cpu() && !unsharded_sizes_.empty() && local_grad.is_contiguous() &&
                            sharded_padded_.is_pinned();
  at::Tensor g = local_grad.to(sharded_local_.device(), orig_dtype_, non_blocking);
  if (unsharded_sizes_.empty() && g.numel() == 1) g = g.view(c10::IntArrayRef{});
  if (grad.defined()) {
    grad.add_(g);
  } else {
    // Own the memory: a view of the reduce-scatter buffer would pin the whole buffer, and optimizers'
    // zero_grad() cannot detach views in place.
    grad = g.is_view() || !g.is_contiguous() ? g.clone(at::MemoryFormat::Contiguous) : g;
  }
  return non_blocking;
}

namespace {
int64_t accumulator_uses(const at::Tensor& param) {
  auto accumulator = torch::autograd::impl::try_get_grad_accumulator(param);
  return accumulator ? static_cast<int64_t>(accumulator.use_count()) : 0;
}
}  // namespace

void FSDPParam::record_accumulator_uses() {
  accumulator_uses_at_reshard_ = param_.requires_grad() && c10::GradMode::is_enabled() ? accumulator_uses(param_) : -1;
}

bool FSDPParam::used_while_sharded() const {
  return accumulator_uses_at_reshard_ >= 0 && state_ == ShardedState::Sharded &&
         accumulator_uses(param_) > accumulator_uses_at_reshard_;
}

void FSDPParam::drop_internal_grads() {
  if (state_ == ShardedState::Unsharded) param_.mutable_grad() = at::Tensor();
  accumulated_unsharded_grad_ = at::Tensor();
  partial_reduce_output_ = at::Tensor();
}

void FSDPParam::convert_dtype(c10::ScalarType dtype, const MixedPrecisionPolicy& mp) {
  TORCH_CHECK(state_ == ShardedState::Sharded, "fsdp: module->to() on '", fqn_,
              "' while its parameters are unsharded (during forward/backward, or after unshard()): reshard first");
  c10::NoGradGuard no_grad;
  // libtorch's Module::to re-points each parameter (set_data) to a converted copy of what it shows — our
  // shard — child modules first. Whatever the parameter shows now holds this rank's rows.
  at::Tensor shown = param_.variable_data();
  at::Tensor rows = (shown.is_alias_of(sharded_local_) ? sharded_local_ : shown).to(dtype);
  at::Tensor grad = param_.grad().defined() ? param_.grad().to(dtype) : at::Tensor();
  orig_dtype_ = dtype;
  param_dtype_ = resolve_param_dtype(rows, mp);
  reduce_dtype_ = mp.reduce_dtype && at::isFloatingType(dtype) ? *mp.reduce_dtype : param_dtype_;
  accumulated_unsharded_grad_ = at::Tensor();
  partial_reduce_output_ = at::Tensor();
  const c10::Device sharded_device = sharded_padded_.device();
  const c10::Device unsharded_device = unsharded_.device();
  // Fill the new padded shard from `rows` (copy_from_param reads param_ as the *full* tensor, so copy here).
  allocate_storage(sharded_device, unsharded_device, OffloadPolicy{}, unsharded_device, /*copy_from_param=*/false);
  if (rows.numel() > 0) sharded_local_.copy_(rows.reshape(sharded_local_.sizes()));
  param_.set_data(sharded_local_);
  if (grad.defined()) param_.mutable_grad() = grad;
}

void FSDPParam::set_tensor_parallel(const TensorParallelSpec& tp, const DeviceMesh& fsdp_mesh) {
  TORCH_CHECK(tp.placements.size() == 1, "fully_shard: parameter '", fqn_, "' is tensor-parallel over a ",
              tp.placements.size(), "-d mesh; only a 1-D TP mesh is supported");
  TORCH_CHECK(tp.mesh.device_type() == fsdp_mesh.device_type(), "fully_shard: parameter '", fqn_,
              "': TP mesh and FSDP mesh are on different device types");
  GlobalLayout layout;
  layout.mesh = DeviceMesh::concatenate({fsdp_mesh, tp.mesh});
  layout.global_shape = tp.global_shape;
  const Placement& tp_placement = tp.placements.front();
  if (fsdp_mesh.ndim() == 2) layout.placements.push_back(Replicate());  // HSDP
  if (geometry_.replicated) {
    layout.placements.push_back(Replicate());
  } else if (tp_placement.is_shard(geometry_.shard_dim)) {
    // FSDP splits the rows TP already split: right to left, TP first.
    layout.placements.push_back(StridedShard(geometry_.shard_dim, tp.mesh.size(0)));
  } else {
    layout.placements.push_back(Shard(geometry_.shard_dim));
  }
  layout.placements.push_back(tp_placement);
  tp_layout_ = std::move(layout);
}

void FSDPParam::check_identity(const char* where) const {
  const bool shows_ours = param_.storage().is_alias_of(sharded_local_.storage()) ||
                          param_.storage().is_alias_of(unsharded_.storage());
  TORCH_CHECK(shows_ours, "fsdp: parameter '", fqn_, "' was re-pointed to other data outside FSDP (before ",
              where, "); modify sharded parameters in place (e.g. param.copy_()) instead of replacing them");
}

}  // namespace fsdp::detail
