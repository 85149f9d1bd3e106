// Document-masked attention under context parallelism (fsdp/context_parallel.h): the mask of this rank's queries
// against every rank's keys, and attention over all-gathered K and V whose backward reduce-scatters dK and dV to
// their owners (PyTorch's all-gather rotate method, with a mask that SDPA applies).

#include <fsdp/context_parallel.h>

#include "tensor_parallel/group_capsule.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <vector>

namespace fsdp {
namespace {

// [cp, ...] <- every cp rank's `local` (all-gather along a new leading dim); backward: each rank's slice of the
// gradient summed over the ranks (reduce-scatter), so that every owner gets the gradient all ranks' queries gave.
struct AllGatherStacked : torch::autograd::Function<AllGatherStacked> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& local,
                            const ProcessGroupPtr& group) {
    RECORD_USER_SCOPE("fsdp::context_parallel::allgather_kv");
    const at::Tensor in = local.contiguous();
    std::vector<int64_t> shape{group->size()};
    shape.insert(shape.end(), in.sizes().begin(), in.sizes().end());
    at::Tensor out = at::empty(shape, in.options());
    group->all_gather_into_tensor(out, in).wait();
    detail::save_group(ctx, group);
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    RECORD_USER_SCOPE("fsdp::context_parallel::reduce_scatter_dkv");
    const auto group = detail::saved_group(ctx);
    const at::Tensor all = grads[0].contiguous();
    at::Tensor own = at::empty(all.sizes().slice(1), all.options());
    group->reduce_scatter_tensor(own, all, ReduceOp::Sum).wait();
    return {own, at::Tensor()};
  }
};

// [B, H, L, D] of every rank -> [B, H, cp * L, D], keys in cp-rank order.
at::Tensor gather_sequence(const at::Tensor& local, const ProcessGroupPtr& group) {
  const at::Tensor stacked = AllGatherStacked::apply(local, group);  // [cp, B, H, L, D]
  return stacked.permute({1, 2, 0, 3, 4}).reshape({local.size(0), local.size(1), -1, local.size(3)});
}

}  // namespace

at::Tensor context_parallel_document_mask(const at::Tensor& document_ids, const ProcessGroupPtr& cp_group,
                                          CpLoadBalancer balancer) {
  TORCH_CHECK(cp_group != nullptr, "fsdp::context_parallel_document_mask: null cp group");
  TORCH_CHECK(document_ids.dim() == 2 && document_ids.scalar_type() == at::kLong,
              "fsdp::context_parallel_document_mask: document ids must be int64 [batch, seq_local], got ",
              document_ids.scalar_type(), " ", document_ids.sizes());
  const int64_t size = cp_group->size(), rank = cp_group->rank(), local = document_ids.size(1);
  const int64_t batch = document_ids.size(0);
  at::Tensor all_ids = at::empty({size, batch, local}, document_ids.options());
  cp_group->all_gather_into_tensor(all_ids, document_ids.contiguous()).wait();
  const at::Tensor key_ids = all_ids.permute({1, 0, 2}).reshape({batch, size * local});  // cp-rank order
  std::vector<at::Tensor> key_positions;
  for (int64_t r = 0; r < size; ++r) key_positions.push_back(context_parallel_positions(local * size, r, size, balancer));
  const at::Tensor k_pos = at::cat(key_positions).to(document_ids.device());
  const at::Tensor q_pos = context_parallel_positions(local * size, rank, size, balancer).to(document_ids.device());
  const at::Tensor causal = k_pos.unsqueeze(0).le(q_pos.unsqueeze(1));                 // [L, cp*L]
  const at::Tensor same_document = document_ids.unsqueeze(2).eq(key_ids.unsqueeze(1));  // [B, L, cp*L]
  return same_document.logical_and_(causal).unsqueeze(1);
}

at::Tensor context_parallel_masked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const at::Tensor& mask, const ProcessGroupPtr& cp_group) {
  TORCH_CHECK(cp_group != nullptr, "fsdp::context_parallel_masked_attention: null cp group");
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.sizes() == q.sizes(),
              "fsdp::context_parallel_masked_attention: q, k, v must be [batch, heads, seq_local, head_dim] of one "
              "shape (repeat grouped KV heads first); got q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(mask.dim() == 4 && mask.size(2) == q.size(2) && mask.size(3) == q.size(2) * cp_group->size(),
              "fsdp::context_parallel_masked_attention: the mask ", mask.sizes(), " does not fit ", q.size(2),
              " queries and ", cp_group->size(), " x ", q.size(2), " keys (context_parallel_document_mask)");
  RECORD_USER_SCOPE("fsdp::context_parallel::masked_attention");
  const at::Tensor k_all = gather_sequence(k, cp_group), v_all = gather_sequence(v, cp_group);
  return at::scaled_dot_product_attention(q, k_all, v_all, mask, /*dropout_p=*/0.0, /*is_causal=*/false);
}

}  // namespace fsdp
