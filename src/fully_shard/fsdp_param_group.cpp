#include "fully_shard/fsdp_param_group.h"

#include "fully_shard/mesh_cache.h"
#include "fully_shard/storage.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>

#include <cmath>

namespace fsdp::detail {

std::string mesh_identity(const DeviceMesh& mesh) {
  const DeviceMesh root = mesh.root();
  std::string out = c10::str(c10::DeviceTypeName(mesh.device_type(), /*lower_case=*/true), " root ",
                             c10::IntArrayRef(root.shape()), " [");
  for (const auto& n : root.dim_names()) out += n + ",";
  out += c10::str("] ranks ", c10::ArrayRef<int>(root.ranks()), " dims [");
  for (const auto& n : mesh.dim_names()) out += n + ",";
  return out + "]";
}

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
  // A copy kept under the old policy must not be used under the new one.
  discard_post_forward_shard();
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

void FSDPParamGroup::set_custom_all_gather(std::shared_ptr<FSDPAllGather> comm) {
  TORCH_CHECK(!machine_.gather_in_flight(), "fsdp: set_custom_all_gather on FSDP group ", name_,
              " while its all-gather is in flight; set it between steps");
  all_gather_comm_ = comm ? std::move(comm) : default_all_gather();
}

void FSDPParamGroup::set_custom_reduce_scatter(std::shared_ptr<FSDPReduceScatter> comm) {
  TORCH_CHECK(!machine_.reduce_in_flight(), "fsdp: set_custom_reduce_scatter on FSDP group ", name_,
              " while its reduction is in flight; set it between steps");
  reduce_scatter_comm_ = comm ? std::move(comm) : default_reduce_scatter();
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

int64_t FSDPParamGroup::shards_version() const {
  // Every in-place change of a shard (optimizer step, copy_ from a state dict, user code under no_grad)
  // bumps its parameter's version counter; FSDP's own set_data/resize do not. A sum is enough: counters only grow.
  int64_t sum = 0;
  for (const FSDPParam* p : param_ptrs_) sum += static_cast<int64_t>(p->param()._version());
  return sum;
}

void FSDPParamGroup::discard_post_forward_shard() {
  if (machine_.shard() != ShardStatus::ShardedPostForward) return;
  drop_unused_unshard();  // a gather in flight may be reading the copy
  post_forward_shard_ = at::Tensor();
  machine_.apply(Event::Reshard);
}

void FSDPParamGroup::invalidate_caches() {
  discard_post_forward_shard();
  forget_cached_shard_copies();
}

void FSDPParamGroup::forget_cached_shard_copies() {
  post_forward_shard_ = at::Tensor();
  post_forward_shard_version_ = -1;
  for (FSDPParam* p : param_ptrs_) p->forget_known_zero();
}

bool FSDPParamGroup::unshards_locally() const {
  if (mesh_info_.shard_size != 1) return false;
  for (const FSDPParam* p : param_ptrs_) {
    if (!p->aliases_shard()) return false;
  }
  return true;
}

bool FSDPParamGroup::hands_over_gradients() const {
  if (!unshards_locally() || (mesh_info_.replicate_group && mesh_info_.replicate_size > 1) || all_reduce_hook) {
    return false;
  }
  for (const FSDPParam* p : param_ptrs_) {
    if (p->reduce_dtype() != p->orig_dtype()) return false;
    const GradientDivision d = gradient_division(p->reduce_dtype(), 1, 1, gradient_divide_factor,
                                                 force_sum_reduction_for_comms);
    if (d.pre_divide || d.post_divide) return false;  // a divide factor other than 1 changes the values
  }
  return true;
}

void FSDPParamGroup::unshard(bool on_comm_streams) {
  if (machine_.unsharded() || machine_.gather_in_flight() || params_.empty()) return;
  for (FSDPParam* p : param_ptrs_) {
    TORCH_CHECK(!p->param().is_meta(), "fsdp: parameter '", p->fqn(),
                "' is still on the meta device; materialize the model before running it");
  }
  if (unshards_locally()) {
    // Nothing to gather: wait_for_unshard shows the shards (which are the full parameters) directly.
    machine_.apply(Event::IssueGather);
    return;
  }
  const int64_t version = shards_version();
  if (machine_.shard() == ShardStatus::ShardedPostForward && post_forward_shard_version_ != version) {
    // The shards changed since the N-way copy was kept (optimizer step, state-dict load): it is stale.
    discard_post_forward_shard();
  }
  // Re-gather from the N-way copy kept after forward (only the N-rank group communicates), or from the shards.
  const bool from_copy = machine_.shard() == ShardStatus::ShardedPostForward;
  all_gather_ = foreach_all_gather(param_ptrs_, layout_, from_copy ? post_forward_shard_ : at::Tensor(),
                                   from_copy ? *post_forward_group_ : *mesh_info_.shard_group, mesh_info_.shard_size,
                                   mesh_info_.shard_rank, mesh_info_.device, on_comm_streams ? streams() : nullptr,
                                   *all_gather_comm_);
  all_gather_version_ = version;
  machine_.apply(Event::IssueGather);
}

void FSDPParamGroup::wait_for_unshard() {
  if (machine_.unsharded() || params_.empty()) return;
  if (!machine_.gather_in_flight()) unshard();
  if (unshards_locally()) {
    // Always current (no copy that could go stale), so no version check either.
    for (FSDPParam* p : param_ptrs_) p->to_unsharded();
    machine_.apply(Event::FinishGather);
    return;
  }
  const bool on_comm_streams = all_gather_.stream.has_value();
  wait_all_gather(all_gather_, streams());
  if (all_gather_version_ != shards_version()) {
    // Issued (prefetched, or unshard(async)) before the shards changed: gather the current shards instead.
    all_gather_ = AllGatherResult();
    machine_.apply(Event::DropGather);
    discard_post_forward_shard();
    unshard(on_comm_streams);
    wait_all_gather(all_gather_, streams());
  }
  CommStreams* s = streams();
  if (s && machine_.phase() == Phase::Forward) {
    // The previous forward group's all-gather output was kept until now so that its copy-out could overlap
    // this all-gather; the all-gather streams now wait for that copy-out, then its memory may be reused.
    comm_->all_gather_state.release(*s, {s->all_gather_copy_in(), s->all_gather()});
  }
  StreamEvent copied_out = foreach_all_gather_copy_out(param_ptrs_, layout_, all_gather_.output, s);
  if (s && on_comm_streams) {
    // The copy-out ran on the current stream, the buffer belongs to the copy-in stream: no record_stream,
    // the all-gather streams wait for the copy-out before the memory can be reused there. In forward the
    // buffer is kept until the next group's copy-out (its all-gather, prefetched, must not land in this
    // memory while this copy-out may still run); otherwise released now.
    if (machine_.phase() == Phase::Forward) {
      comm_->all_gather_state.hold(std::move(all_gather_.output), copied_out);
    } else {
      // Released right below, after these waits.
      s->wait(s->all_gather_copy_in(), copied_out);
      s->wait(s->all_gather(), copied_out);
    }
  }
  all_gather_ = AllGatherResult();  // free the flat buffer before the next group's gather lands
  post_forward_shard_ = at::Tensor();  // consumed (if the gather came from it)
  for (FSDPParam* p : param_ptrs_) p->to_unsharded();
  machine_.apply(Event::FinishGather);
}

void FSDPParamGroup::drop_unused_unshard() {
  if (!machine_.gather_in_flight()) return;
  if (unshards_locally()) {
    machine_.apply(Event::DropGather);  // nothing was issued to any peer
    return;
  }
  // Completed before the buffer goes: its memory belongs to the copy-in stream, whose next use is ordered after
  // the current stream (unshard), which now waits for the gather.
  try {
    wait_all_gather(all_gather_, streams());
  } catch (...) {
    all_gather_ = AllGatherResult();
    machine_.apply(Event::DropGather);
    throw;
  }
  all_gather_ = AllGatherResult();
  machine_.apply(Event::DropGather);
}

void FSDPParamGroup::reshard(bool keep_post_forward_shard) {
  drop_unused_unshard();
  if (!machine_.unsharded()) return;
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
    p->record_accumulator_uses();
  }
  if (post_forward_shard_.defined()) {
    machine_.apply(Event::ReshardKeepPostForward);
    post_forward_shard_version_ = shards_version();
  } else {
    machine_.apply(Event::Reshard);
  }
}

const FSDPParam* FSDPParamGroup::used_outside_forward() const {
  if (machine_.unsharded()) return nullptr;
  for (const FSDPParam* p : param_ptrs_) {
    if (p->used_while_sharded()) return p;
  }
  return nullptr;
}

// ---------------------------------------------------------------------------------------------------------
// Meta-device init

void FSDPParamGroup::materialize() {
  TORCH_CHECK(!machine_.unsharded() && !machine_.gather_in_flight(), "fsdp: materialize while group ", name_, " is ",
              to_string(machine_.state()));
  for (FSDPParam* p : param_ptrs_) p->materialize(mesh_info_.device, options_.offload_policy);
}

void FSDPParamGroup::begin_full_init(const std::unordered_set<const c10::TensorImpl*>* only) {
  TORCH_CHECK(machine_.phase() == Phase::Idle && !machine_.unsharded(),
              "fsdp: initializing group ", name_, " with full parameters while it is ", to_string(machine_.state()));
  drop_unused_unshard();
  discard_post_forward_shard();
  c10::NoGradGuard no_grad;
  // The initializer writes full tensors in the parameters' original dtype (the fp32 masters under mixed
  // precision). Shards freshly materialized are zeros on every rank: start from zeros, no all-gather.
  // Otherwise gather the current values in the original dtype, one parameter at a time.
  for (FSDPParam* p : param_ptrs_) {
    if (!only || only->count(p->param().unsafeGetTensorImpl())) p->begin_full_init(*mesh_info_.shard_group);
  }
}

void FSDPParamGroup::end_full_init() {
  for (FSDPParam* p : param_ptrs_) p->end_full_init();
}

namespace {
// A range for libtorch's profiler while it lives: "FSDP::pre_forward (layers.0)", as PyTorch's FSDP2 names its
// steps. Nothing is formatted unless a profiler records.
class StepRange {
 public:
  StepRange(const char* step, const std::string& group) {
    if (range_.isActive()) range_.before(c10::str(step, " (", group, ")"));
  }

 private:
  at::RecordFunction range_{at::RecordScope::USER_SCOPE};
};
}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Forward / backward

void FSDPParamGroup::pre_forward() {
  const StepRange range("FSDP::pre_forward", name_);
  machine_.apply(Event::PreForward);
  unshard();
  wait_for_unshard();
}

void FSDPParamGroup::record_use(bool registered_node) {
  ++uses_;
  if (registered_node) ++uses_with_node_;
}

void FSDPParamGroup::forget_use(bool registered_node) {
  if (uses_ > 0) --uses_;
  if (registered_node && uses_with_node_ > 0) --uses_with_node_;
}

void FSDPParamGroup::post_forward(bool grad_enabled) {
  const StepRange range("FSDP::post_forward", name_);
  if (!grad_enabled) {
    // No backward follows this call: holding full parameters would only grow memory (PyTorch issue 149029).
    // (A backward of an earlier use gathers again.)
    reshard();
  } else if (reshard_after_forward()) {
    reshard(/*keep_post_forward_shard=*/true);
  }
  machine_.apply(Event::PostForward);
}

void FSDPParamGroup::pre_backward() {
  if (machine_.phase() == Phase::PreBackward) return;  // another output of the same use got its gradient
  const StepRange range("FSDP::pre_backward", name_);
  machine_.apply(Event::PreBackward);
  if (!unshard_in_backward && !machine_.unsharded()) {
    // The user promised backward reads none of these parameters: show their full-sized (freed) storage, so
    // autograd accumulates full-sized gradients into them, and skip the all-gather (Python skips unshard()
    // in PRE_BACKWARD). A prefetch issued anyway (explicit unshard) is dropped unused.
    drop_unused_unshard();
    post_forward_shard_ = at::Tensor();  // not needed: nothing is gathered
    for (FSDPParam* p : param_ptrs_) p->to_unsharded();
    machine_.apply(Event::ShowUnshardedNoGather);
    return;
  }
  unshard();
  wait_for_unshard();
}

void FSDPParamGroup::unshard_for_backward() {
  if (unshard_in_backward) unshard();
}

void FSDPParamGroup::post_backward_from_node() {
  machine_.apply(Event::PostBackward);
  ++nodes_fired_;
  // Reduce now only if every use of this group is known complete: all uses registered a node and all of
  // those fired in this backward. Otherwise a later use (or one without a node) may still add gradients to
  // the unsharded parameters: keep them (unsharded) and reduce once at the end of backward.
  if (uses_ == uses_with_node_ && nodes_fired_ >= uses_with_node_) reduce_gradients();
}

void FSDPParamGroup::reduce_gradients(bool force_sync) {
  const StepRange range("FSDP::post_backward", name_);
  if (!requires_gradient_sync && !force_sync) {
    for (FSDPParam* p : param_ptrs_) p->accumulate_unsharded_grad();
    if (reshard_after_backward) reshard();
    return;
  }
  std::vector<at::Tensor> grads;
  grads.reserve(params_.size());
  bool any = false;
  for (FSDPParam* p : param_ptrs_) {
    at::Tensor g = p->take_unsharded_grad();
    if (!g.defined() && p->partial_reduce_output().defined()) {
      // HSDP: nothing new this backward, but an earlier partial reduction still has to join the all-reduce.
      g = at::zeros(p->unsharded_sizes(), p->partial_reduce_output().options());
    }
    grads.push_back(std::move(g));
    any = any || grads.back().defined();
  }
  // Sharded gradients live on the sharded parameters, so a synchronized backward always reshards.
  reshard();
  if (!any) return;
  // At most one reduction in flight per group; the previous one completes first.
  finish_pending_reduce();
  if (hands_over_gradients()) {
    // One rank, same dtype, nothing to divide: the reduced gradient is the gradient. It becomes the sharded
    // .grad as is (or is added to one kept from an earlier backward), exactly as without FSDP.
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (grads[i].defined()) param_ptrs_[i]->accumulate_sharded_grad(grads[i]);
    }
    return;
  }
  pending_reduce_ = foreach_reduce_scatter(param_ptrs_, std::move(grads), mesh_info_, gradient_divide_factor,
                                           force_sum_reduction_for_comms, streams() ? comm_.get() : nullptr,
                                           *reduce_scatter_comm_);
  machine_.apply(Event::IssueReduce);
}

void FSDPParamGroup::finish_pending_reduce() {
  if (!machine_.reduce_in_flight()) return;
  PendingReduce pending = std::move(*pending_reduce_);
  pending_reduce_.reset();
  machine_.apply(Event::FinishReduce);
  const ReduceFinish finish = finish_reduce(std::move(pending), param_ptrs_, mesh_info_, requires_all_reduce,
                                            all_reduce_hook, comm_.get());
  // The current stream waits on this event at the end of backward (or before a conversion): the sharded
  // gradients were written after it. Non-blocking copies into pinned CPU gradients: the host waits on the same
  // event before the optimizer reads them (Python's grad_offload_event).
  if (finish.post_reduce.recorded()) {
    post_reduce_event_ = finish.post_reduce;
    if (finish.copying_to_host) grad_offload_event_ = finish.post_reduce;
  }
}

void FSDPParamGroup::wait_for_post_reduce() {
  if (!comm_) return;
  CommStreams& s = comm_->streams;
  if (post_reduce_event_.recorded()) s.wait(s.current(), post_reduce_event_);
  post_reduce_event_ = StreamEvent();
  s.synchronize(grad_offload_event_);
  grad_offload_event_ = StreamEvent();
}

void FSDPParamGroup::finish_backward(bool keep_graph, bool finalize, bool force_sync) {
  // Uses whose gradients were deferred (or that had no post-backward node) are complete now.
  bool has_grads = false;
  for (FSDPParam* p : param_ptrs_) {
    has_grads = has_grads || p->has_accumulated_unsharded_grad() ||
                (p->state() == ShardedState::Unsharded && p->param().grad().defined());
  }
  if (has_grads) {
    reduce_gradients(force_sync);
  } else if (machine_.unsharded() && (reshard_after_backward || force_sync)) {
    reshard();
  }
  if (finalize) {
    finish_pending_reduce();
    wait_for_post_reduce();  // the optimizer (current stream, or the host for offloaded gradients) reads them next
  }
  drop_unused_unshard();  // a backward prefetch nobody consumed must not feed the next step
  nodes_fired_ = 0;
  if (!keep_graph) {
    uses_ = 0;
    uses_with_node_ = 0;
  }
  machine_.apply(Event::EndBackward);
}

void FSDPParamGroup::reset() {
  // Collectives this rank issued are completed, so the next step's collectives pair with the right ones on
  // every rank (all ranks raised at the same point). A wait that fails means the ranks did not: report that.
  std::exception_ptr failure;
  auto drain = [&](auto&& fn) {
    try {
      fn();
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  };
  drain([&] { drop_unused_unshard(); });
  drain([&] {
    if (machine_.reduce_in_flight()) {
      PendingReduce pending = std::move(*pending_reduce_);
      pending_reduce_.reset();
      machine_.apply(Event::FinishReduce);
      {
        CommStreamGuard on_stream(pending.stream);
        pending.reduce_scatter.wait();  // waited, result dropped: the step it belonged to was abandoned
      }
      if (pending.stream) comm_->streams.wait_stream(comm_->streams.current(), *pending.stream);
    }
  });
  drain([&] { wait_for_post_reduce(); });
  for (FSDPParam* p : param_ptrs_) p->drop_internal_grads();
  if (machine_.unsharded()) {
    for (FSDPParam* p : param_ptrs_) {
      p->to_sharded();
      p->free_unsharded();
    }
  }
  // Whatever a failed drain left behind belongs to the abandoned step.
  all_gather_ = AllGatherResult();
  pending_reduce_.reset();
  forget_cached_shard_copies();
  uses_ = uses_with_node_ = nodes_fired_ = 0;
  machine_.apply(Event::Reset);
  if (failure) {
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "fsdp: the process group of FSDP group ", name_, " is unusable after an exception: a "
                  "collective this rank had issued did not complete (the ranks stopped at different points, e.g. "
                  "only some ranks raised). Restart the job (fsdprun --max-restarts) and resume from a checkpoint. "
                  "Cause: ", e.what());
    }
  }
}

void FSDPParamGroup::convert_dtype(c10::ScalarType dtype, const MixedPrecisionPolicy& mp) {
  TORCH_CHECK(machine_.phase() == Phase::Idle && !machine_.unsharded() && !machine_.gather_in_flight(),
              "fsdp: module->to(", dtype, ") on FSDP group ", name_, " while it is ", to_string(machine_.state()),
              "; convert between steps");
  finish_pending_reduce();
  wait_for_post_reduce();
  invalidate_caches();
  for (FSDPParam* p : param_ptrs_) p->convert_dtype(dtype, mp);
  layout_ = make_all_gather_layout(param_ptrs_);
}

}  // namespace fsdp::detail
