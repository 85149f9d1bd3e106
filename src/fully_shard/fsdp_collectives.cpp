#include "fully_shard/fsdp_collectives.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>

#include <cmath>

namespace fsdp::detail {
namespace {

// Byte alignment of each parameter inside a slot: views of any dtype (up to complex128) stay aligned.
constexpr int64_t kAlignBytes = 16;

int64_t align_up(int64_t n) { return (n + kAlignBytes - 1) / kAlignBytes * kAlignBytes; }

// [dim0, row_sizes...] view of a full tensor: the shard dim first (0-dim tensors are one row).
at::Tensor as_rows(const at::Tensor& t, const ShardGeometry& g) { return g.rows_view(t); }

// Copies between a full tensor's rows and a rank-major [n_ranks, chunk_rows, row_sizes...] block for ranks
// [first_rank, first_rank + n_ranks). Trailing ranks own fewer (or no) rows; padding rows are left alone.
void copy_rank_rows(const ShardGeometry& g, const at::Tensor& full_rows, const at::Tensor& block,
                    int64_t first_rank, bool to_block) {
  const int64_t n_ranks = block.size(0);
  if (g.replicated) {
    // Every rank's slot holds the whole (one-row) tensor: fill each slot, or read one back (all are equal).
    for (int64_t k = 0; k < (to_block ? n_ranks : std::min<int64_t>(n_ranks, 1)); ++k) {
      at::Tensor blk = block.select(0, k).narrow(0, 0, g.dim0);
      to_block ? blk.copy_(full_rows) : full_rows.copy_(blk);
    }
    return;
  }
  for (int64_t r = first_rank; r < first_rank + n_ranks;) {
    // Ranks that own a complete chunk are contiguous in both layouts: copy them in one go.
    int64_t run = 0;
    while (r + run < first_rank + n_ranks && g.rows_of(r + run) == g.chunk_rows && g.chunk_rows > 0) ++run;
    if (run > 0) {
      // (Splitting dim 0 is a view for any strides, so this also works on a moved shard dim.)
      at::Tensor rows = full_rows.narrow(0, g.offset_of(r), run * g.chunk_rows).unflatten(0, {run, g.chunk_rows});
      at::Tensor blk = block.narrow(0, r - first_rank, run);
      to_block ? blk.copy_(rows) : rows.copy_(blk);
      r += run;
      continue;
    }
    const int64_t rows_here = g.rows_of(r);
    if (rows_here > 0) {
      at::Tensor rows = full_rows.narrow(0, g.offset_of(r), rows_here);
      at::Tensor blk = block.select(0, r - first_rank).narrow(0, 0, rows_here);
      to_block ? blk.copy_(rows) : rows.copy_(blk);
    }
    ++r;
  }
}

// [n_ranks, chunk_rows, row_sizes...] view (in `dtype`) of parameter `i`'s bytes in a rank-major byte buffer.
at::Tensor param_block(const at::Tensor& bytes_2d, const AllGatherLayout& layout, size_t i, const ShardGeometry& g,
                       c10::ScalarType dtype) {
  at::Tensor b = bytes_2d.narrow(1, layout.byte_offsets[i], layout.byte_sizes[i]).view(dtype);
  return b.view(g.rows_shape({bytes_2d.size(0), g.chunk_rows}));
}

}  // namespace

namespace {
class DefaultAllGather final : public FSDPAllGather {
 public:
  at::Tensor allocate(int64_t numel, c10::ScalarType dtype, c10::Device device) override {
    return at::empty({numel}, at::TensorOptions().dtype(dtype).device(device));
  }
  Work operator()(at::Tensor output, at::Tensor input, ProcessGroup& group) override {
    return group.all_gather_into_tensor(std::move(output), std::move(input));
  }
};
class DefaultReduceScatter final : public FSDPReduceScatter {
 public:
  at::Tensor allocate(int64_t numel, c10::ScalarType dtype, c10::Device device) override {
    return at::empty({numel}, at::TensorOptions().dtype(dtype).device(device));
  }
  Work operator()(at::Tensor output, at::Tensor input, ProcessGroup& group, ReduceOp op) override {
    return group.reduce_scatter_tensor(std::move(output), std::move(input), op);
  }
};
}  // namespace

std::shared_ptr<FSDPAllGather> default_all_gather() { return std::make_shared<DefaultAllGather>(); }
std::shared_ptr<FSDPReduceScatter> default_reduce_scatter() { return std::make_shared<DefaultReduceScatter>(); }

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

AllGatherLayout make_all_gather_layout(const std::vector<FSDPParam*>& params) {
  AllGatherLayout layout;
  for (const FSDPParam* p : params) {
    layout.byte_offsets.push_back(layout.per_rank_bytes);
    std::vector<AllGatherLayout::TransformInput> inputs;
    int64_t bytes = 0;
    if (const AllGatherTransform* t = p->all_gather_transform()) {
      // The transform's inputs one after the other, each aligned, inside the parameter's range.
      const auto padded = p->geometry().rows_shape({p->geometry().chunk_rows});
      for (auto& spec : t->input_specs(padded, p->orig_dtype())) {
        AllGatherLayout::TransformInput in;
        in.byte_offset = layout.per_rank_bytes + bytes;
        int64_t numel = 1;
        for (int64_t d : spec.sizes) numel *= d;
        in.byte_size = numel * static_cast<int64_t>(c10::elementSize(spec.dtype));
        in.sizes = spec.sizes;
        in.dtype = spec.dtype;
        TORCH_CHECK(!spec.sizes.empty() && spec.sizes[0] == p->geometry().chunk_rows, "fsdp: the all-gather transform "
                    "of parameter '", p->fqn(), "' announced an input of shape ", spec.sizes, "; every input must have "
                    "the shard's ", p->geometry().chunk_rows, " rows first");
        bytes += align_up(in.byte_size);
        inputs.push_back(std::move(in));
      }
    } else {
      bytes = p->geometry().padded_numel() * static_cast<int64_t>(c10::elementSize(p->param_dtype()));
    }
    layout.byte_sizes.push_back(bytes);
    layout.transform_inputs.push_back(std::move(inputs));
    layout.per_rank_bytes += align_up(bytes);
  }
  return layout;
}

void pack_sharded(const std::vector<FSDPParam*>& params, const AllGatherLayout& layout, const at::Tensor& slot) {
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    const FSDPParam& p = *params[i];
    if (layout.byte_sizes[i] == 0) continue;
    const bool non_blocking = p.sharded_padded().is_pinned();
    if (const AllGatherTransform* t = p.all_gather_transform()) {
      const auto& specs = layout.transform_inputs[i];
      std::vector<at::Tensor> inputs = t->pre_all_gather(p.sharded_padded());
      TORCH_CHECK(inputs.size() == specs.size(), "fsdp: the all-gather transform of parameter '", p.fqn(),
                  "' returned ", inputs.size(), " tensors, announced ", specs.size());
      for (size_t k = 0; k < specs.size(); ++k) {
        TORCH_CHECK(inputs[k].sizes() == c10::IntArrayRef(specs[k].sizes) && inputs[k].scalar_type() == specs[k].dtype,
                    "fsdp: the all-gather transform of parameter '", p.fqn(), "' returned input ", k, " as ",
                    inputs[k].scalar_type(), inputs[k].sizes(), ", announced ", specs[k].dtype,
                    c10::IntArrayRef(specs[k].sizes));
        at::Tensor dst = slot.narrow(0, specs[k].byte_offset, specs[k].byte_size).view(specs[k].dtype);
        dst.copy_(inputs[k].reshape({-1}), non_blocking);
      }
      continue;
    }
    at::Tensor dst = slot.narrow(0, layout.byte_offsets[i], layout.byte_sizes[i]).view(p.param_dtype());
    // Host-to-device copy when the shard is offloaded to CPU; cast to the compute dtype.
    dst.copy_(p.sharded_padded().reshape({-1}), non_blocking);
  }
}

void pack_unsharded_rows(const std::vector<FSDPParam*>& params, const AllGatherLayout& layout, int64_t first_rank,
                         const at::Tensor& dst) {
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    const FSDPParam& p = *params[i];
    if (layout.byte_sizes[i] == 0) continue;
    TORCH_CHECK(!p.all_gather_transform(), "fsdp: parameter '", p.fqn(), "' has an all-gather transform; "
                "reshard_after_forward = N (an N-way copy kept after forward) cannot be combined with it");
    at::Tensor block = param_block(dst, layout, i, p.geometry(), p.param_dtype());
    block.zero_();
    copy_rank_rows(p.geometry(), as_rows(p.unsharded(), p.geometry()), block, first_rank, /*to_block=*/true);
  }
}

void unpack_all_gather(const std::vector<FSDPParam*>& params, const AllGatherLayout& layout,
                       const at::Tensor& output) {
  c10::NoGradGuard no_grad;
  const int64_t world = output.numel() / std::max<int64_t>(layout.per_rank_bytes, 1);
  at::Tensor out_2d = output.view({world, layout.per_rank_bytes});
  for (size_t i = 0; i < params.size(); ++i) {
    const FSDPParam& p = *params[i];
    if (layout.byte_sizes[i] == 0) continue;
    if (const AllGatherTransform* t = p.all_gather_transform()) {
      // Every input gathered rank-major, [world, chunk_rows, ...] flattened to [world * chunk_rows, ...]: with
      // torch.chunk sharding the parameter's rows are the first dim0 ones.
      std::vector<at::Tensor> gathered;
      for (const auto& in : layout.transform_inputs[i]) {
        std::vector<int64_t> sizes{world};
        sizes.insert(sizes.end(), in.sizes.begin(), in.sizes.end());
        gathered.push_back(out_2d.narrow(1, in.byte_offset, in.byte_size).view(in.dtype).view(sizes).flatten(0, 1));
      }
      at::Tensor full = t->post_all_gather(gathered, p.param_dtype());
      const int64_t rows = p.geometry().dim0;
      TORCH_CHECK(full.dim() >= 1 && full.size(0) >= rows &&
                      full.narrow(0, 0, rows).sizes() == p.unsharded().sizes(),
                  "fsdp: the all-gather transform of parameter '", p.fqn(), "' rebuilt a tensor of shape ",
                  full.sizes(), "; expected its first ", rows, " rows to have the parameter's shape ",
                  p.unsharded().sizes());
      p.unsharded().copy_(full.narrow(0, 0, rows));
      continue;
    }
    at::Tensor block = param_block(out_2d, layout, i, p.geometry(), p.param_dtype());
    copy_rank_rows(p.geometry(), as_rows(p.unsharded(), p.geometry()), block, 0, /*to_block=*/false);
  }
}

AllGatherResult foreach_all_gather(const std::vector<FSDPParam*>& params, const AllGatherLayout& layout,
                                   const at::Tensor& post_forward_rows, ProcessGroup& group, int64_t shard_world,
                                   int64_t shard_rank, c10::Device device, CommStreams* streams,
                                   FSDPAllGather& collective) {
  std::optional<c10::Stream> copy_in, gather;
  if (streams) {
    copy_in = streams->all_gather_copy_in();
    gather = streams->all_gather();
    streams->wait_stream(*copy_in, streams->current());
  }
  AllGatherResult result;
  at::Tensor input;
  {
    // Named ranges for libtorch's profiler (the names PyTorch's FSDP2 gives the same steps).
    RECORD_USER_SCOPE("FSDP::all_gather_copy_in");
    // The output is allocated on the copy-in stream, which is where its memory is reused.
    CommStreamGuard on_copy_in(copy_in);
    result.output = collective.allocate(shard_world * layout.per_rank_bytes, at::kByte, device);
    TORCH_CHECK(result.output.numel() == shard_world * layout.per_rank_bytes &&
                    result.output.scalar_type() == at::kByte && result.output.device() == device &&
                    result.output.is_contiguous(),
                "fsdp: the custom all-gather's allocate() returned ", result.output.scalar_type(),
                result.output.sizes(), " on ", result.output.device(), "; asked for ", shard_world * layout.per_rank_bytes,
                " contiguous uint8 elements on ", device);
    if (post_forward_rows.defined()) {
      input = post_forward_rows.view({-1});
    } else {
      input = result.output.narrow(0, shard_rank * layout.per_rank_bytes, layout.per_rank_bytes);
      pack_sharded(params, layout, input);  // host-to-device, non-blocking, when the shards are offloaded
    }
  }
  if (streams) streams->wait_stream(*gather, *copy_in);
  {
    RECORD_USER_SCOPE("FSDP::all_gather");
    CommStreamGuard on_gather(gather);
    result.work = collective(result.output, input, group);
  }
  result.stream = gather;
  return result;
}

void wait_all_gather(AllGatherResult& result, CommStreams* streams) {
  Work work = std::move(result.work);
  result.work = Work();
  const std::optional<c10::Stream> gather = result.stream;
  result.stream.reset();
  if (!gather || !streams) {
    work.wait();  // issued on the current stream: NCCL makes it wait, Gloo blocks the host
    return;
  }
  // Python's synchronous all-gather on the all-gather stream, then the current stream waits on the event
  // recorded there after it.
  {
    CommStreamGuard on_gather(gather);
    work.wait();
  }
  streams->wait(streams->current(), streams->record(*gather));
}

StreamEvent foreach_all_gather_copy_out(const std::vector<FSDPParam*>& params, const AllGatherLayout& layout,
                                        const at::Tensor& output, CommStreams* streams) {
  // The full parameters are allocated only now, not when the (possibly prefetched) all-gather was issued: a
  // prefetched group then costs one buffer while the current group computes.
  RECORD_USER_SCOPE("FSDP::all_gather_copy_out");
  for (FSDPParam* p : params) p->alloc_unsharded();
  unpack_all_gather(params, layout, output);
  return streams ? streams->record(streams->current()) : StreamEvent();
}

ReduceScatterLayout make_reduce_scatter_layout(const std::vector<FSDPParam*>& params,
                                               const std::vector<at::Tensor>& grads) {
  ReduceScatterLayout layout;
  std::optional<c10::ScalarType> dtype;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!grads[i].defined()) {
      layout.offsets.push_back(-1);
      continue;
    }
    const c10::ScalarType d = params[i]->reduce_dtype();
    TORCH_CHECK(!dtype || *dtype == d, "fsdp: one parameter group reduces gradients in both ", *dtype, " and ", d,
                " (parameter '", params[i]->fqn(), "'); give such parameters their own fully_shard call");
    dtype = d;
    layout.offsets.push_back(layout.per_rank_numel);
    layout.per_rank_numel += params[i]->geometry().padded_numel();
  }
  if (dtype) layout.dtype = *dtype;
  return layout;
}

at::Tensor pack_reduce_scatter_input(const std::vector<FSDPParam*>& params, const std::vector<at::Tensor>& grads,
                                     const ReduceScatterLayout& layout, c10::Device device) {
  c10::NoGradGuard no_grad;
  TORCH_CHECK(!params.empty(), "fsdp internal: empty reduce-scatter");
  const ShardGeometry& g0 = params.front()->geometry();
  const int64_t world = g0.world;
  // Not zero-filled: every element is written below, the gradient rows by the copy and only the padding rows
  // of trailing ranks (uneven shards) by zero_.
  at::Tensor input = at::empty({world, layout.per_rank_numel}, at::TensorOptions().dtype(layout.dtype).device(device));
  for (size_t i = 0; i < params.size(); ++i) {
    if (layout.offsets[i] < 0) continue;
    const ShardGeometry& g = params[i]->geometry();
    at::Tensor block = input.narrow(1, layout.offsets[i], g.padded_numel()).view(g.rows_shape({world, g.chunk_rows}));
    copy_rank_rows(g, as_rows(grads[i], g), block, 0, /*to_block=*/true);
    for (int64_t r = 0; r < world; ++r) {
      const int64_t rows = g.rows_of(r);
      if (rows < g.chunk_rows) block.select(0, r).narrow(0, rows, g.chunk_rows - rows).zero_();
    }
  }
  return input.view({-1});
}

at::Tensor reduced_local_grad(const FSDPParam& param, const ReduceScatterLayout& layout, size_t index,
                              const at::Tensor& output) {
  const ShardGeometry& g = param.geometry();
  at::Tensor rows = output.narrow(0, layout.offsets[index], g.padded_numel()).view(g.rows_shape({g.chunk_rows}));
  return g.from_rows(rows.narrow(0, 0, g.rows_of(param.shard_rank())));
}


PendingReduce foreach_reduce_scatter(const std::vector<FSDPParam*>& params, std::vector<at::Tensor> grads,
                                     const MeshInfo& mesh, std::optional<double> divide_factor, bool force_sum,
                                     CommContext* comm, FSDPReduceScatter& collective) {
  CommStreams* s = comm && comm->streams.separate() ? &comm->streams : nullptr;
  PendingReduce pending;
  pending.layout = make_reduce_scatter_layout(params, grads);
  if (s) {
    // The previous reduce-scatter's input (allocated on the current stream) is released once the current
    // stream is ordered after that reduce-scatter (Python's ReduceScatterState).
    comm->reduce_scatter_state.release(*s, {s->current()});
  }
  // Packed on the current stream, where autograd produced the gradients: they can be freed right after
  // (as in Python's foreach_reduce; packing on the reduce-scatter stream would need them kept alive).
  at::Tensor input;
  {
    RECORD_USER_SCOPE("FSDP::reduce_scatter_copy_in");
    input = pack_reduce_scatter_input(params, grads, pending.layout, mesh.device);
  }
  grads.clear();  // the unsharded gradients are no longer needed once packed
  pending.division = gradient_division(pending.layout.dtype, mesh.shard_size, mesh.hsdp() ? mesh.replicate_size : 1,
                                       divide_factor, force_sum);
  if (s) {
    pending.stream = s->reduce_scatter();
    s->wait_stream(*pending.stream, s->current());
  }
  {
    // Pre-division and the collective on the reduce-scatter stream; the output is allocated there.
    RECORD_USER_SCOPE("FSDP::reduce_scatter");
    CommStreamGuard on_reduce_scatter(pending.stream);
    if (pending.division.pre_divide) input.div_(*pending.division.pre_divide);
    pending.output = collective.allocate(pending.layout.per_rank_numel, input.scalar_type(), input.device());
    TORCH_CHECK(pending.output.numel() == pending.layout.per_rank_numel &&
                    pending.output.scalar_type() == input.scalar_type() && pending.output.device() == input.device() &&
                    pending.output.is_contiguous(),
                "fsdp: the custom reduce-scatter's allocate() returned ", pending.output.scalar_type(),
                pending.output.sizes(), " on ", pending.output.device(), "; asked for ", pending.layout.per_rank_numel,
                " contiguous ", input.scalar_type(), " elements on ", input.device());
    pending.reduce_scatter = collective(pending.output, input, *mesh.shard_group, pending.division.reduce_scatter_op);
  }
  pending.input = std::move(input);
  return pending;
}

ReduceFinish finish_reduce(PendingReduce pending, const std::vector<FSDPParam*>& params, const MeshInfo& mesh,
                           bool requires_all_reduce, const FSDPModule::AllReduceHook& hook, CommContext* comm) {
  RECORD_USER_SCOPE("FSDP::post_reduce");
  CommStreams* s = pending.stream && comm ? &comm->streams : nullptr;
  ReduceFinish finish;
  // Everything after the collective runs on the stream it was issued on (the reduce-scatter stream, or the
  // all-reduce stream after an HSDP all-reduce): `post` is where the sharded gradients are written.
  std::optional<c10::Stream> post = pending.stream;
  std::optional<CommStreamGuard> on_post;
  on_post.emplace(post);
  pending.reduce_scatter.wait();
  if (s) {
    // The input stays alive until the current stream is ordered after the collective that read it.
    comm->reduce_scatter_state.release(*s, {s->current()});
    comm->reduce_scatter_state.hold(std::move(pending.input), s->record(*post));
  }
  pending.input = at::Tensor();
  c10::NoGradGuard no_grad;
  auto rows_of = [&](size_t i) {
    return pending.output.narrow(0, pending.layout.offsets[i], params[i]->geometry().padded_numel());
  };
  if (mesh.hsdp()) {
    // Partial reductions (set_requires_all_reduce(false)) are kept apart and join the next all-reduce, as
    // PyTorch's partial reduce output does: every replica then ends with the same sum.
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor& partial = params[i]->partial_reduce_output();
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
      if (s) finish.post_reduce = s->record(*post);  // the partial sums are written on the reduce-scatter stream
      return finish;
    }
    if (s) {
      // HSDP's all-reduce on its own stream, so it can overlap the next reduce-scatter (another network).
      post = s->all_reduce();
      s->wait_stream(*post, *pending.stream);
      on_post.reset();
      on_post.emplace(post);
    }
    mesh.replicate_group->all_reduce(pending.output, pending.division.all_reduce_op).wait();
  }
  // As in PyTorch: the hook sees the reduced output after the collectives and before the post-division.
  if (hook) hook(pending.output);
  if (pending.division.post_divide) pending.output.div_(*pending.division.post_divide);
  for (size_t i = 0; i < params.size(); ++i) {
    if (pending.layout.offsets[i] < 0) continue;
    finish.copying_to_host =
        params[i]->accumulate_sharded_grad(reduced_local_grad(*params[i], pending.layout, i, pending.output)) ||
        finish.copying_to_host;
  }
  // The sharded gradients were written on `post`.
  if (s) finish.post_reduce = s->record(*post);
  return finish;
}

}  // namespace fsdp::detail
