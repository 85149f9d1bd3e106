// Tensor-parallel collectives as autograd functions (see collectives.h). The process group rides in the
// autograd context (group_capsule.h).

#include "tensor_parallel/collectives.h"
#include "tensor_parallel/group_capsule.h"

#include <fsdp/sharded_tensor.h>

#include <ATen/ATen.h>
#include <torch/autograd.h>

namespace fsdp::tp {
namespace {

using detail::saved_group;
using detail::save_group;

int64_t wrap_dim(int64_t dim, const at::Tensor& x) {
  const int64_t nd = x.dim();
  TORCH_CHECK(dim >= -nd && dim < nd, "fsdp tensor parallel: dim ", dim, " out of range for a tensor of shape ",
              x.sizes());
  return dim < 0 ? dim + nd : dim;
}

std::vector<int64_t> with_leading(int64_t lead, const at::Tensor& moved) {
  std::vector<int64_t> s = moved.sizes().vec();
  s[0] = lead;
  return s;
}

// Shard(dim) -> Replicate: pad this rank's chunk to ceil(full / k), all-gather, trim to `full`.
at::Tensor gather(const at::Tensor& x, const ProcessGroupPtr& group, int64_t dim, int64_t full) {
  const int64_t k = group->size();
  const int64_t cs = padded_shard_size(full, k);
  const auto [off, len] = shard_offset_and_size(full, k, group->rank());
  TORCH_CHECK(x.size(dim) == len, "fsdp tensor parallel: all-gather on dim ", dim, " of a tensor of shape ",
              x.sizes(), ": rank ", group->rank(), " of ", k, " should hold ", len, " of ", full, " (offset ", off, ")");
  const at::Tensor moved = x.movedim(dim, 0);
  at::Tensor input;
  if (len == cs) {
    input = moved.contiguous();
  } else {
    input = at::zeros(with_leading(cs, moved), x.options());
    if (len > 0) input.narrow(0, 0, len).copy_(moved);
  }
  at::Tensor out = at::empty(with_leading(k * cs, moved), x.options());
  group->all_gather_into_tensor(out, input).wait();
  return out.narrow(0, 0, full).movedim(0, dim).contiguous();
}

// Partial -> Shard(dim): pad to k * ceil(n / k), reduce-scatter (sum), keep this rank's torch.chunk piece.
at::Tensor reduce_scatter(const at::Tensor& x, const ProcessGroupPtr& group, int64_t dim) {
  const int64_t k = group->size();
  const int64_t n = x.size(dim);
  const int64_t cs = padded_shard_size(n, k);
  const at::Tensor moved = x.movedim(dim, 0);
  at::Tensor input;
  if (n == k * cs) {
    // Always a private copy: the reduce-scatter works in its input, which must not alias the caller's tensor
    // (a contiguous `moved` would be a view of it).
    input = moved.clone(at::MemoryFormat::Contiguous);
  } else {
    input = at::zeros(with_leading(k * cs, moved), x.options());
    if (n > 0) input.narrow(0, 0, n).copy_(moved);
  }
  at::Tensor out = at::empty(with_leading(cs, moved), x.options());
  group->reduce_scatter_tensor(out, input, ReduceOp::Sum).wait();
  const int64_t len = shard_offset_and_size(n, k, group->rank()).second;
  return out.narrow(0, 0, len).movedim(0, dim).contiguous();
}

at::Tensor chunk(const at::Tensor& x, const ProcessGroupPtr& group, int64_t dim) {
  const auto [off, len] = shard_offset_and_size(x.size(dim), group->size(), group->rank());
  return x.narrow(dim, off, len).contiguous();
}

at::Tensor all_reduce(const at::Tensor& x, const ProcessGroupPtr& group) {
  at::Tensor out = x.contiguous().clone();
  group->all_reduce(out, ReduceOp::Sum).wait();
  return out;
}

int64_t full_size_of(const at::Tensor& x, const ProcessGroupPtr& group, int64_t dim, int64_t full) {
  if (full >= 0) return full;
  return x.size(dim) * group->size();
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct AllReduceForward : torch::autograd::Function<AllReduceForward> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, ProcessGroupPtr group) {
    return all_reduce(x, group);
  }
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], at::Tensor()}; }
};

struct AllReduceBackward : torch::autograd::Function<AllReduceBackward> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, ProcessGroupPtr group) {
    save_group(ctx, group);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_reduce(grads[0], saved_group(ctx)), at::Tensor()};
  }
};

struct GatherPartialGrad : torch::autograd::Function<GatherPartialGrad> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, ProcessGroupPtr group, int64_t dim,
                            int64_t full) {
    save_group(ctx, group);
    ctx->saved_data["dim"] = dim;
    return gather(x, group, dim, full);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t dim = ctx->saved_data["dim"].toInt();
    return {reduce_scatter(grads[0], saved_group(ctx), dim), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct GatherReplicateGrad : torch::autograd::Function<GatherReplicateGrad> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, ProcessGroupPtr group, int64_t dim,
                            int64_t full) {
    save_group(ctx, group);
    ctx->saved_data["dim"] = dim;
    return gather(x, group, dim, full);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t dim = ctx->saved_data["dim"].toInt();
    return {chunk(grads[0], saved_group(ctx), dim), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct ReduceScatterForward : torch::autograd::Function<ReduceScatterForward> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, ProcessGroupPtr group, int64_t dim) {
    save_group(ctx, group);
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["full"] = x.size(dim);
    return reduce_scatter(x, group, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const int64_t full = ctx->saved_data["full"].toInt();
    return {gather(grads[0], saved_group(ctx), dim, full), at::Tensor(), at::Tensor()};
  }
};

struct ChunkForward : torch::autograd::Function<ChunkForward> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, ProcessGroupPtr group, int64_t dim) {
    save_group(ctx, group);
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["full"] = x.size(dim);
    return chunk(x, group, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const int64_t full = ctx->saved_data["full"].toInt();
    return {gather(grads[0], saved_group(ctx), dim, full), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor all_reduce_forward(const at::Tensor& x, const ProcessGroupPtr& group) {
  return AllReduceForward::apply(x, group);
}

at::Tensor all_reduce_backward(const at::Tensor& x, const ProcessGroupPtr& group) {
  return AllReduceBackward::apply(x, group);
}

at::Tensor gather_for_partial_grad(const at::Tensor& x, const ProcessGroupPtr& group, int64_t dim, int64_t full) {
  dim = wrap_dim(dim, x);
  return GatherPartialGrad::apply(x, group, dim, full_size_of(x, group, dim, full));
}

at::Tensor gather_for_replicate_grad(const at::Tensor& x, const ProcessGroupPtr& group, int64_t dim,
                                     int64_t full) {
  dim = wrap_dim(dim, x);
  return GatherReplicateGrad::apply(x, group, dim, full_size_of(x, group, dim, full));
}

at::Tensor reduce_scatter_forward(const at::Tensor& x, const ProcessGroupPtr& group, int64_t dim) {
  dim = wrap_dim(dim, x);
  TORCH_CHECK(x.size(dim) % group->size() == 0, "fsdp tensor parallel: reduce-scatter of dim ", dim, " (size ",
              x.size(dim), ") over ", group->size(), " TP ranks: the size must divide by the TP degree (for the "
              "sequence dim: seq_len % tp == 0)");
  return ReduceScatterForward::apply(x, group, dim);
}

at::Tensor chunk_forward(const at::Tensor& x, const ProcessGroupPtr& group, int64_t dim) {
  dim = wrap_dim(dim, x);
  return ChunkForward::apply(x, group, dim);
}

void all_reduce_grad_over_tp(at::Tensor& param, const ProcessGroupPtr& group) {
  // register_hook needs requires_grad; a frozen parameter keeps its flag.
  const bool frozen = !param.requires_grad();
  if (frozen) param.requires_grad_(true);
  param.register_hook([group](const at::Tensor& grad) { return all_reduce(grad, group); });
  if (frozen) param.requires_grad_(false);
}

bool produced_by_partial_grad_gather(const at::Tensor& x) {
  const auto fn = x.grad_fn();
  return fn && dynamic_cast<torch::autograd::CppNode<GatherPartialGrad>*>(fn.get()) != nullptr;
}

}  // namespace fsdp::tp
