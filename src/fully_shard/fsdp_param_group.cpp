#include "fully_shard/fsdp_param_group.h"

#include "fully_shard/mesh_cache.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

namespace fsdp::detail {

FSDPParamGroup::FSDPParamGroup(std::vector<std::unique_ptr<FSDPParam>> params, MeshInfo mesh_info,
                               FullyShardOptions options)
    : params_(std::move(params)), mesh_info_(std::move(mesh_info)), options_(std::move(options)) {
  for (auto& p : params_) param_ptrs_.push_back(p.get());
  layout_ = make_all_gather_layout(param_ptrs_);
  if (options_.reshard_after_forward) set_reshard_after_forward(*options_.reshard_after_forward);
}

// ---------------------------------------------------------------------------------------------------------
// Policy

bool FSDPParamGroup::reshard_after_forward() const {
  if (!reshard_after_forward_) return true;  // non-root default until lazy init decides
  if (const bool* b = std::get_if<bool>(&*reshard_after_forward_)) return *b;
  return std::get<int>(*reshard_after_forward_) > 1;
}

void FSDPParamGroup::set_default_reshard_after_forward(bool is_root) {
  if (!reshard_after_forward_) reshard_after_forward_ = ReshardAfterForward(!is_root);
}

void FSDPParamGroup::set_reshard_after_forward(ReshardAfterForward value) {
  post_forward_size_ = 0;
  if (const int* n = std::get_if<int>(&value)) {
    const int64_t shard = mesh_info_.shard_size;
    TORCH_CHECK(*n >= 1 && shard % *n == 0, "fsdp: reshard_after_forward=", *n,
                " must be a positive divisor of the shard group size ", shard, " (group ", name_, ")");
    if (*n == 1) {
      value = false;
    } else if (*n == shard) {
      value = true;
    } else {
      post_forward_size_ = *n;
      ensure_post_forward_group();
    }
  }
  reshard_after_forward_ = value;
}

void FSDPParamGroup::ensure_post_forward_group() {
  const DeviceMesh& mesh = mesh_info_.mesh;
  const int64_t n = post_forward_size_;
  // One set of communicators per (rank layout, N), shared by every group that reshards N-way.
  const std::string key = c10::str("post_forward:", c10::ArrayRef<int>(mesh.ranks()), ":", n);
  DeviceMesh groups = cached_mesh(key, [&] {
    // Split the shard dim (the last) into (shard / N, N): groups of N consecutive shard ranks. Collective
    // over the world, reached in the same order on every rank because fully_shard calls are.
    std::vector<int64_t> shape(mesh.shape().begin(), mesh.shape().end() - 1);
    shape.push_back(mesh_info_.shard_size / n);
    shape.push_back(n);
    std::vector<std::string> names;
    for (size_t i = 0; i < shape.size(); ++i) names.push_back("hpz" + std::to_string(i));
    return DeviceMesh(mesh.device_type(), shape, names, mesh.ranks());
  });
  post_forward_group_ = groups.group(groups.ndim() - 1);
}

// ---------------------------------------------------------------------------------------------------------
// Unshard / reshard

void FSDPParamGroup::unshard() {
  if (is_unsharded_ || unshard_in_flight() || params_.empty()) return;
  for (FSDPParam* p : param_ptrs_) {
    TORCH_CHECK(!p->param().is_meta(), "fsdp: parameter '", p->fqn(),
                "' is still on the meta device; materialize the model before running it");
  }
  const int64_t world = mesh_info_.shard_size;
  all_gather_output_ = at::empty({world * layout_.per_rank_bytes},
                                 at::TensorOptions().dtype(at::kByte).device(mesh_info_.device));
  if (post_forward_shard_.defined()) {
    // Re-gather from the N-way copy kept after forward: only the N-rank group communicates.
    all_gather_ = post_forward_group_->all_gather_into_tensor(all_gather_output_, post_forward_shard_.view({-1}));
  } else {
    at::Tensor slot = all_gather_output_.narrow(0, mesh_info_.shard_rank * layout_.per_rank_bytes, layout_.per_rank_bytes);
    pack_sharded(param_ptrs_, layout_, slot);
    all_gather_ = mesh_info_.shard_group->all_gather_into_tensor(all_gather_output_, slot);
  }
}

void FSDPParamGroup::wait_for_unshard() {
  if (is_unsharded_ || params_.empty()) return;
  if (!unshard_in_flight()) unshard();
  all_gather_.wait();
  all_gather_ = Work();
  // The full parameters are allocated only now, not when the (possibly prefetched) all-gather was issued:
  // a prefetched group then costs one buffer while the current group computes, so forward holds at most
  // two groups' worth of unsharded data (the current group freed, this group's buffer + parameters).
  for (FSDPParam* p : param_ptrs_) p->alloc_unsharded();
  unpack_all_gather(param_ptrs_, layout_, all_gather_output_);
  all_gather_output_ = at::Tensor();  // free the flat buffer before the next group's gather lands
  post_forward_shard_ = at::Tensor();
  for (FSDPParam* p : param_ptrs_) p->to_unsharded();
  is_unsharded_ = true;
}

void FSDPParamGroup::reshard(bool keep_post_forward_shard) {
  if (unshard_in_flight()) {
    // A prefetched all-gather nobody used: complete it so the collective order stays matched across ranks.
    all_gather_.wait();
    all_gather_ = Work();
    all_gather_output_ = at::Tensor();
  }
  if (!is_unsharded_) return;
  if (keep_post_forward_shard && post_forward_size_ > 0) {
    const int64_t ranks_kept = mesh_info_.shard_size / post_forward_size_;
    const int64_t member = post_forward_group_->rank();
    post_forward_shard_ = at::empty({ranks_kept, layout_.per_rank_bytes},
                                    at::TensorOptions().dtype(at::kByte).device(mesh_info_.device));
    pack_unsharded_rows(param_ptrs_, layout_, member * ranks_kept, post_forward_shard_);
  }
  for (FSDPParam* p : param_ptrs_) {
    p->to_sharded();
    p->free_unsharded();
  }
  is_unsharded_ = false;
}

// ---------------------------------------------------------------------------------------------------------
// Meta-device init

void FSDPParamGroup::materialize() {
  TORCH_CHECK(!is_unsharded_ && !unshard_in_flight(), "fsdp: materialize while group ", name_, " is unsharded");
  for (FSDPParam* p : param_ptrs_) p->materialize(mesh_info_.device, options_.offload_policy);
}

void FSDPParamGroup::write_back_shards() {
  TORCH_CHECK(is_unsharded_, "fsdp internal: write_back_shards of a sharded group ", name_);
  for (FSDPParam* p : param_ptrs_) p->write_back_shard();
}

// ---------------------------------------------------------------------------------------------------------
// Forward / backward

void FSDPParamGroup::pre_forward() {
  unshard();
  wait_for_unshard();
  if (c10::GradMode::is_enabled()) {
    for (FSDPParam* p : param_ptrs_) needs_post_backward_ = needs_post_backward_ || p->requires_grad();
  }
}

void FSDPParamGroup::post_forward(bool grad_enabled) {
  if (!grad_enabled) {
    // No backward will follow: holding full parameters would only grow memory (PyTorch issue 149029).
    reshard();
  } else if (reshard_after_forward()) {
    reshard(/*keep_post_forward_shard=*/true);
  }
}

void FSDPParamGroup::pre_backward() {
  if (ran_pre_backward_) return;
  ran_pre_backward_ = true;
  unshard();
  wait_for_unshard();
}

void FSDPParamGroup::post_backward() {
  if (!needs_post_backward_) return;
  needs_post_backward_ = false;
  if (!requires_gradient_sync) {
    for (FSDPParam* p : param_ptrs_) p->accumulate_unsharded_grad();
    if (reshard_after_backward) reshard();
    return;
  }
  finish_pending_reduce();
  std::vector<at::Tensor> grads;
  grads.reserve(params_.size());
  bool any = false;
  for (FSDPParam* p : param_ptrs_) {
    grads.push_back(p->requires_grad() ? p->take_unsharded_grad() : at::Tensor());
    any = any || grads.back().defined();
  }
  // Sharded gradients live on the sharded parameters, so a synchronized backward always reshards.
  reshard();
  if (!any) return;
  PendingReduce pending;
  pending.layout = make_reduce_scatter_layout(param_ptrs_, grads);
  at::Tensor input = pack_reduce_scatter_input(param_ptrs_, grads, pending.layout);
  grads.clear();  // the unsharded gradients are no longer needed once packed
  pending.output = at::empty({pending.layout.per_rank_numel}, input.options());
  pending.reduce_scatter = mesh_info_.shard_group->reduce_scatter_tensor(pending.output, input, ReduceOp::Sum);
  pending.input = std::move(input);
  pending_reduce_ = std::move(pending);
}

void FSDPParamGroup::finish_pending_reduce() {
  if (!pending_reduce_) return;
  PendingReduce pending = std::move(*pending_reduce_);
  pending_reduce_.reset();
  pending.reduce_scatter.wait();
  c10::NoGradGuard no_grad;
  if (mesh_info_.replicate_group && mesh_info_.replicate_size > 1 && requires_all_reduce) {
    mesh_info_.replicate_group->all_reduce(pending.output, ReduceOp::Sum).wait();
  }
  // Average over every data-parallel rank (shard x replicate) unless the user set a factor. Dividing
  // after summing in the reduce dtype matches PyTorch's fp32 AVG; partial (no all-reduce) outputs divided
  // by the same factor still add up to the average.
  const double factor = gradient_divide_factor.value_or(
      static_cast<double>(mesh_info_.shard_size * mesh_info_.replicate_size));
  if (factor != 1.0) pending.output.div_(factor);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (pending.layout.offsets[i] < 0) continue;
    param_ptrs_[i]->accumulate_sharded_grad(reduced_local_grad(*param_ptrs_[i], pending.layout, i, pending.output));
  }
}

void FSDPParamGroup::end_of_backward() {
  finish_pending_reduce();
  ran_pre_backward_ = false;
  needs_post_backward_ = false;
  if (is_unsharded_ && reshard_after_backward) reshard();
}

}  // namespace fsdp::detail
