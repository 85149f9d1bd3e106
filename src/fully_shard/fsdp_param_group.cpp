#include "fully_shard/fsdp_param_group.h"

#include "fully_shard/mesh_cache.h"
#include "fully_shard/storage.h"

#include <ATen/ATen.h>
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

GradientDivision gradient_division(c10::ScalarType reduce_dtype, int64_t shard_size, int64_t replicate_size,
                                   std::optional<double> factor, bool force_sum) {
  GradientDivision d;
  // fp32 and bf16 have the range to be divided inside the collective; fp16 (and other dtypes) may overflow.
  const bool overflow_risk = reduce_dtype != c10::kFloat && reduce_dtype != c10::kBFloat16;
  const int64_t data_parallel_size = shard_size * replicate_size;
  if (!overflow_risk && !force_sum) {
    if (!factor) {
      if (data_parallel_size > 1) d.reduce_scatter_op = d.all_reduce_op = ReduceOp::Avg;
      return d;
    }
    if (*factor == static_cast<double>(shard_size)) {
      d.reduce_scatter_op = ReduceOp::Avg;
    } else if (*factor != 1.0) {
      d.pre_divide = *factor;  // NCCL's PREMUL_SUM(1 / factor): scale, then sum
    }
    return d;  // the all-reduce (HSDP) sums
  }
  const double total = factor.value_or(static_cast<double>(data_parallel_size));
  if (overflow_risk) {
    // Divide by about sqrt(N) before and the rest after the reduction.
    double pre = 1;
    while (std::fmod(total, pre) == 0 && total / pre > pre) pre *= 2;
    if (pre != 1) d.pre_divide = pre;
    if (total / pre != 1) d.post_divide = total / pre;
  } else if (total != 1) {
    d.post_divide = total;
  }
  return d;
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
  // With separate streams: copy-in on the copy-in stream after the work issued so far on the current stream
  // (an optimizer step or state-dict load may have just written the shards, reshard may have just written the
  // N-way copy), the all-gather on the all-gather stream after the copy-in. The output buffer is allocated
  // on the copy-in stream, which is where its memory is reused (see wait_for_unshard).
  CommStreams* s = on_comm_streams ? streams() : nullptr;
  std::optional<c10::Stream> copy_in, gather;
  if (s) {
    copy_in = s->all_gather_copy_in();
    gather = s->all_gather();
    s->wait_stream(*copy_in, s->current());
  }
  const int64_t world = mesh_info_.shard_size;
  const int64_t version = shards_version();
  if (machine_.shard() == ShardStatus::ShardedPostForward && post_forward_shard_version_ != version) {
    // The shards changed since the N-way copy was kept (optimizer step, state-dict load): it is stale.
    discard_post_forward_shard();
  }
  const bool from_post_forward_shard = machine_.shard() == ShardStatus::ShardedPostForward;
  at::Tensor input;
  {
    CommStreamGuard on_copy_in(copy_in);
    all_gather_output_ = at::empty({world * layout_.per_rank_bytes},
                                   at::TensorOptions().dtype(at::kByte).device(mesh_info_.device));
    if (from_post_forward_shard) {
      input = post_forward_shard_.view({-1});
    } else {
      input = all_gather_output_.narrow(0, mesh_info_.shard_rank * layout_.per_rank_bytes, layout_.per_rank_bytes);
      pack_sharded(param_ptrs_, layout_, input);  // host-to-device, non-blocking, when the shards are offloaded
    }
  }
  if (s) s->wait_stream(*gather, *copy_in);
  {
    CommStreamGuard on_gather(gather);
    // Re-gather from the N-way copy kept after forward (only the N-rank group communicates), or from the shards.
    ProcessGroup& group = from_post_forward_shard ? *post_forward_group_ : *mesh_info_.shard_group;
    all_gather_ = group.all_gather_into_tensor(all_gather_output_, input);
  }
  all_gather_stream_ = gather;
  all_gather_version_ = version;
  machine_.apply(Event::IssueGather);
}

void FSDPParamGroup::complete_all_gather() {
  Work work = std::move(all_gather_);
  all_gather_ = Work();
  const std::optional<c10::Stream> gather = all_gather_stream_;
  all_gather_stream_.reset();
  if (!gather) {
    work.wait();  // issued on the current stream: NCCL makes it wait, Gloo blocks the host
    return;
  }
  // Python's synchronous all-gather on the all-gather stream, then the current stream waits on the event
  // recorded there after it (not on the whole stream: a later prefetch may already be queued on it).
  CommStreams& s = comm_->streams;
  {
    CommStreamGuard on_gather(gather);
    work.wait();
  }
  s.wait(s.current(), s.record(*gather));
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
  const bool on_comm_streams = all_gather_stream_.has_value();
  complete_all_gather();
  if (all_gather_version_ != shards_version()) {
    // Issued (prefetched, or unshard(async)) before the shards changed: gather the current shards instead.
    all_gather_output_ = at::Tensor();
    machine_.apply(Event::DropGather);
    discard_post_forward_shard();
    unshard(on_comm_streams);
    complete_all_gather();
  }
  CommStreams* s = streams();
  if (s && machine_.phase() == Phase::Forward) {
    // The previous forward group's all-gather output was kept until now so that its copy-out could overlap
    // this all-gather; the all-gather streams now wait for that copy-out, then its memory may be reused.
    comm_->all_gather_state.release(*s, {s->all_gather_copy_in(), s->all_gather()});
  }
  // The full parameters are allocated only now, not when the (possibly prefetched) all-gather was issued:
  // a prefetched group then costs one buffer while the current group computes, so forward holds at most
  // two groups' worth of unsharded data (the current group freed, this group's buffer + parameters).
  for (FSDPParam* p : param_ptrs_) p->alloc_unsharded();
  unpack_all_gather(param_ptrs_, layout_, all_gather_output_);
  if (s && on_comm_streams) {
    // The copy-out ran on the current stream, the buffer belongs to the copy-in stream: no record_stream,
    // the all-gather streams wait for the copy-out before the memory can be reused there. In forward the
    // buffer is kept until the next group's copy-out (its all-gather, prefetched, must not land in this
    // memory while this copy-out may still run); otherwise released now.
    StreamEvent copied_out = s->record(s->current());
    if (machine_.phase() == Phase::Forward) {
      comm_->all_gather_state.hold(std::move(all_gather_output_), copied_out);
    } else {
      // Released right below, after these waits.
      s->wait(s->all_gather_copy_in(), copied_out);
      s->wait(s->all_gather(), copied_out);
    }
  }
  all_gather_output_ = at::Tensor();  // free the flat buffer before the next group's gather lands
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
    complete_all_gather();
  } catch (...) {
    all_gather_output_ = at::Tensor();
    machine_.apply(Event::DropGather);
    throw;
  }
  all_gather_output_ = at::Tensor();
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

// ---------------------------------------------------------------------------------------------------------
// Forward / backward

void FSDPParamGroup::pre_forward() {
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
  PendingReduce pending;
  pending.layout = make_reduce_scatter_layout(param_ptrs_, grads);
  CommStreams* s = streams();
  if (s) {
    // The previous reduce-scatter's input (allocated on the current stream) is released once the current
    // stream is ordered after that reduce-scatter (Python's ReduceScatterState).
    comm_->reduce_scatter_state.release(*s, {s->current()});
  }
  // Packed on the current stream, where autograd produced the gradients: they can be freed right after
  // (as in Python's foreach_reduce; packing on the reduce-scatter stream would need them kept alive).
  at::Tensor input = pack_reduce_scatter_input(param_ptrs_, grads, pending.layout, mesh_info_.device);
  grads.clear();  // the unsharded gradients are no longer needed once packed
  const bool hsdp = mesh_info_.replicate_group && mesh_info_.replicate_size > 1;
  pending.division = gradient_division(pending.layout.dtype, mesh_info_.shard_size, hsdp ? mesh_info_.replicate_size : 1,
                                       gradient_divide_factor, force_sum_reduction_for_comms);
  if (s) {
    pending.stream = s->reduce_scatter();
    s->wait_stream(*pending.stream, s->current());
  }
  {
    // Pre-division and the collective on the reduce-scatter stream; the output is allocated there.
    CommStreamGuard on_reduce_scatter(pending.stream);
    if (pending.division.pre_divide) input.div_(*pending.division.pre_divide);
    pending.output = at::empty({pending.layout.per_rank_numel}, input.options());
    pending.reduce_scatter =
        mesh_info_.shard_group->reduce_scatter_tensor(pending.output, input, pending.division.reduce_scatter_op);
  }
  pending.input = std::move(input);
  pending_reduce_ = std::move(pending);
  machine_.apply(Event::IssueReduce);
}

void FSDPParamGroup::finish_pending_reduce() {
  if (!machine_.reduce_in_flight()) return;
  PendingReduce pending = std::move(*pending_reduce_);
  pending_reduce_.reset();
  machine_.apply(Event::FinishReduce);
  CommStreams* s = pending.stream ? &comm_->streams : nullptr;
  // Everything after the collective runs on the stream it was issued on (the reduce-scatter stream, or the
  // all-reduce stream after an HSDP all-reduce): `post` is where the sharded gradients are written.
  std::optional<c10::Stream> post = pending.stream;
  std::optional<CommStreamGuard> on_post;
  on_post.emplace(post);
  pending.reduce_scatter.wait();
  if (s) {
    // The input stays alive until the current stream is ordered after the collective that read it.
    comm_->reduce_scatter_state.release(*s, {s->current()});
    comm_->reduce_scatter_state.hold(std::move(pending.input), s->record(*post));
  }
  pending.input = at::Tensor();
  c10::NoGradGuard no_grad;
  const bool hsdp = mesh_info_.replicate_group && mesh_info_.replicate_size > 1;
  auto rows_of = [&](size_t i) {
    return pending.output.narrow(0, pending.layout.offsets[i], param_ptrs_[i]->geometry().padded_numel());
  };
  if (hsdp) {
    // Partial reductions (set_requires_all_reduce(false)) are kept apart and join the next all-reduce, as
    // PyTorch's partial reduce output does: every replica then ends with the same sum.
    for (size_t i = 0; i < params_.size(); ++i) {
      at::Tensor& partial = param_ptrs_[i]->partial_reduce_output();
      if (pending.layout.offsets[i] < 0) continue;
      if (!requires_all_reduce) {
        if (partial.defined()) partial.add_(rows_of(i));
        else partial = rows_of(i).clone();
      } else if (partial.defined()) {
        rows_of(i).add_(partial);
        partial = at::Tensor();
      }
    }
    if (!requires_all_reduce) {
      if (s) post_reduce_event_ = s->record(*post);  // the partial sums are written on the reduce-scatter stream
      return;
    }
    if (s) {
      // HSDP's all-reduce on its own stream, so it can overlap the next reduce-scatter (another network).
      post = s->all_reduce();
      s->wait_stream(*post, *pending.stream);
      on_post.reset();
      on_post.emplace(post);
    }
    mesh_info_.replicate_group->all_reduce(pending.output, pending.division.all_reduce_op).wait();
  }
  // As in PyTorch: the hook sees the reduced output after the collectives and before the post-division.
  if (all_reduce_hook) all_reduce_hook(pending.output);
  if (pending.division.post_divide) pending.output.div_(*pending.division.post_divide);
  bool copying_to_host = false;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (pending.layout.offsets[i] < 0) continue;
    copying_to_host = param_ptrs_[i]->accumulate_sharded_grad(
                          reduced_local_grad(*param_ptrs_[i], pending.layout, i, pending.output)) ||
                      copying_to_host;
  }
  // The current stream waits on this event at the end of backward (or before a conversion): the sharded
  // gradients were written on `post`. Non-blocking copies into pinned CPU gradients: the host waits on the same
  // event before the optimizer reads them (Python's grad_offload_event).
  if (s) {
    post_reduce_event_ = s->record(*post);
    if (copying_to_host) grad_offload_event_ = post_reduce_event_;
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
  all_gather_ = Work();
  all_gather_output_ = at::Tensor();
  all_gather_stream_.reset();
  post_forward_shard_ = at::Tensor();
  post_forward_shard_version_ = -1;
  pending_reduce_.reset();
  for (FSDPParam* p : param_ptrs_) p->forget_known_zero();
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
