// Loss parallel: cross entropy on class-sharded logits without gathering them (PyTorch's loss_parallel()).

#include "tensor_parallel/collectives.h"

#include <fsdp/tensor_parallel.h>

#include <ATen/ATen.h>

namespace fsdp {

at::Tensor loss_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& target,
                                       const DeviceMesh& tp_mesh, int64_t ignore_index, LossReduction reduction) {
  TORCH_CHECK(tp_mesh.valid() && tp_mesh.ndim() == 1, "fsdp::loss_parallel_cross_entropy: the TP mesh must be 1-D");
  TORCH_CHECK(local_logits.dim() >= 1 && target.dim() == local_logits.dim() - 1,
              "fsdp::loss_parallel_cross_entropy: logits [..., classes/tp] and targets [...] expected, got logits ",
              local_logits.sizes(), " and targets ", target.sizes());
  TORCH_CHECK(local_logits.sizes().slice(0, target.dim()) == target.sizes(),
              "fsdp::loss_parallel_cross_entropy: logits ", local_logits.sizes(), " do not match targets ",
              target.sizes());
  const ProcessGroupPtr group = tp_mesh.group(0);
  const int64_t local_classes = local_logits.size(-1);
  const int64_t rank = group->rank();
  at::Tensor x = local_logits.reshape({-1, local_classes}).to(at::kFloat);
  at::Tensor t = target.reshape({-1});
  // This rank's classes are torch.chunk piece `rank` of the class dim: the ranks before it hold the chunk size
  // ceil(V / tp) each, which is the largest local size (rank 0's), found by the max all-reduce that also
  // finds the logits' row maxima (so the forward runs 3 collectives, the backward none).
  at::Tensor row_max = std::get<0>(x.detach().max(-1));
  at::Tensor stats = at::cat({row_max, at::full({1}, static_cast<float>(local_classes), row_max.options())});
  group->all_reduce(stats, ReduceOp::Max).wait();
  const int64_t chunk = static_cast<int64_t>(stats[-1].item<float>());
  const at::Tensor global_max = stats.narrow(0, 0, row_max.size(0));
  const int64_t offset = rank * chunk;
  // log-sum-exp over all classes: a shift that cancels (no gradient through the max), then a summed exponent.
  at::Tensor sum_exp = tp::all_reduce_forward((x - global_max.unsqueeze(-1)).exp().sum(-1), group);
  const at::Tensor valid = t != ignore_index;
  at::Tensor local_ids = t - offset;
  const at::Tensor mine = valid.logical_and(local_ids >= 0).logical_and_(local_ids < local_classes);
  local_ids = local_ids.masked_fill(mine.logical_not(), 0);
  at::Tensor target_logit = x.gather(-1, local_ids.unsqueeze(-1)).squeeze(-1).masked_fill(mine.logical_not(), 0);
  target_logit = tp::all_reduce_forward(target_logit, group);
  at::Tensor per_token = (sum_exp.log() + global_max - target_logit).masked_fill(valid.logical_not(), 0);
  if (reduction == LossReduction::Sum) return per_token.sum().to(local_logits.scalar_type());
  const at::Tensor count = valid.sum().to(at::kFloat);
  return (per_token.sum() / count).to(local_logits.scalar_type());
}

}  // namespace fsdp
