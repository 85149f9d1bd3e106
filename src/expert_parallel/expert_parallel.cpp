// ExpertParallel (fsdp/expert_parallel.h): shard the stacked experts on dim 0 over the ep group, and wrap the
// experts' forward with the token exchange: count exchange -> dispatch -> regroup by local expert -> experts ->
// back to source order -> combine.

#include <fsdp/all_to_all.h>
#include <fsdp/expert_parallel.h>
#include <fsdp/nn/module_call.h>

#include "tensor/param_spec.h"
#include "tensor_parallel/group_capsule.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {
namespace {

constexpr const char* kWrapperTag = "expert_parallel";

// Rows exchanged between the ep ranks: input rows [sum(in_splits[:j]), +in_splits[j]) go to rank j. Backward
// sends each row's gradient back where the row came from: the same exchange with the splits swapped.
struct AllToAllRows : torch::autograd::Function<AllToAllRows> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, std::vector<int64_t> out_splits,
                            std::vector<int64_t> in_splits, const ProcessGroupPtr& group) {
    detail::save_group(ctx, group);
    ctx->saved_data["out_splits"] = out_splits;
    ctx->saved_data["in_splits"] = in_splits;
    return exchange(x, out_splits, in_splits, *group);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const std::vector<int64_t> out_splits = ctx->saved_data["out_splits"].toIntVector();
    const std::vector<int64_t> in_splits = ctx->saved_data["in_splits"].toIntVector();
    return {exchange(grads[0], in_splits, out_splits, *detail::saved_group(ctx)), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
  static at::Tensor exchange(const at::Tensor& x, const std::vector<int64_t>& out_splits,
                             const std::vector<int64_t>& in_splits, ProcessGroup& group) {
    const int64_t rows = std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0});
    std::vector<int64_t> shape = x.sizes().vec();
    shape[0] = rows;
    at::Tensor out = at::empty(shape, x.options());
    all_to_all_single(group, out, x.contiguous(), out_splits, in_splits).wait();
    return out;
  }
};

std::vector<int64_t> sums_per_rank(const at::Tensor& counts_cpu, int64_t ep, int64_t local_experts) {
  const int64_t* c = counts_cpu.data_ptr<int64_t>();
  std::vector<int64_t> out(static_cast<size_t>(ep), 0);
  for (int64_t r = 0; r < ep; ++r) {
    for (int64_t e = 0; e < local_experts; ++e) out[static_cast<size_t>(r)] += c[r * local_experts + e];
  }
  return out;
}

// The wrapper around the experts' forward on one ep rank.
nn::TensorList dispatch_and_combine(const ProcessGroupPtr& group, int64_t local_experts, const std::string& fqn,
                                    const nn::TensorList& inputs, const nn::ForwardFunction& forward) {
  TORCH_CHECK(inputs.size() == 2, "ExpertParallel(", fqn, "): the experts' forward must take (rows [R, D], counts [E]);"
              " it got ", inputs.size(), " tensor arguments");
  const at::Tensor& rows = inputs[0];
  const at::Tensor& counts = inputs[1];
  const int64_t ep = group->size();
  TORCH_CHECK(counts.dim() == 1 && counts.size(0) == local_experts * ep, "ExpertParallel(", fqn, "): counts has shape ",
              counts.sizes(), ", expected [", local_experts * ep, "] (", local_experts, " experts on each of ", ep,
              " ep ranks)");
  TORCH_CHECK(!at::isFloatingType(counts.scalar_type()), "ExpertParallel(", fqn, "): counts must be integers, got ",
              counts.scalar_type());
  // 1. Count exchange: rank r learns, for each source rank, how many of its rows go to each of r's experts.
  const at::Tensor sent_counts = counts.to(at::kLong).contiguous();
  at::Tensor received_counts = at::empty_like(sent_counts);
  const std::vector<int64_t> equal(static_cast<size_t>(ep), local_experts);
  all_to_all_single(*group, received_counts, sent_counts, equal, equal).wait();
  // The device-to-host copy of expert parallelism: the row splits size the next exchange.
  const at::Tensor sent_cpu = sent_counts.cpu().contiguous();
  const at::Tensor received_cpu = received_counts.cpu().contiguous();
  const std::vector<int64_t> in_splits = sums_per_rank(sent_cpu, ep, local_experts);
  const std::vector<int64_t> out_splits = sums_per_rank(received_cpu, ep, local_experts);
  const int64_t total_in = std::accumulate(in_splits.begin(), in_splits.end(), int64_t{0});
  TORCH_CHECK(rows.dim() == 2 && rows.size(0) == total_in, "ExpertParallel(", fqn, "): rows has shape ", rows.sizes(),
              " but counts sum to ", total_in);
  // 2. Dispatch.
  const at::Tensor received = AllToAllRows::apply(rows, out_splits, in_splits, group);
  // 3. Received rows are rank-major ((src 0: e0, e1, ...), (src 1: e0, ...)); the experts want them expert-major
  // ((e0: src 0, src 1, ...), (e1: ...)). `order[i]` = the received row that goes to grouped position i.
  const int64_t* rc = received_cpu.data_ptr<int64_t>();
  std::vector<int64_t> block_start(static_cast<size_t>(ep * local_experts));
  int64_t start = 0;
  for (int64_t i = 0; i < ep * local_experts; ++i) {
    block_start[static_cast<size_t>(i)] = start;
    start += rc[i];
  }
  std::vector<int64_t> order;
  order.reserve(static_cast<size_t>(start));
  for (int64_t e = 0; e < local_experts; ++e) {
    for (int64_t src = 0; src < ep; ++src) {
      const int64_t b = src * local_experts + e;
      for (int64_t k = 0; k < rc[b]; ++k) order.push_back(block_start[static_cast<size_t>(b)] + k);
    }
  }
  std::vector<int64_t> inverse(order.size());
  for (size_t i = 0; i < order.size(); ++i) inverse[static_cast<size_t>(order[i])] = static_cast<int64_t>(i);
  const auto index_opts = at::TensorOptions().dtype(at::kLong);
  const at::Tensor order_t = at::tensor(order, index_opts).to(rows.device());
  const at::Tensor inverse_t = at::tensor(inverse, index_opts).to(rows.device());
  const at::Tensor local_counts = received_counts.view({ep, local_experts}).sum(0).to(counts.scalar_type());
  // 4. The experts on their rows (empty groups included: every rank runs them, so FSDP's hooks fire everywhere).
  nn::TensorList outs = forward({received.index_select(0, order_t), local_counts});
  TORCH_CHECK(outs.size() == 1 && outs[0].dim() == 2 && outs[0].size(0) == static_cast<int64_t>(order.size()),
              "ExpertParallel(", fqn, "): the experts' forward must return one row per input row");
  // 5. Back to rank-major order, and 6. combine: each row returns to the rank that sent it.
  return {AllToAllRows::apply(outs[0].index_select(0, inverse_t), in_splits, out_splits, group)};
}

}  // namespace

void apply_expert_parallel(const std::shared_ptr<torch::nn::Module>& experts, const DeviceMesh& ep_mesh) {
  TORCH_CHECK(experts != nullptr, "fsdp::apply_expert_parallel: null module");
  const std::string fqn = experts->name();
  TORCH_CHECK(ep_mesh.valid() && ep_mesh.ndim() == 1, "ExpertParallel(", fqn, "): the ep mesh must be 1-D, got ",
              ep_mesh.valid() ? ep_mesh.to_string() : std::string("an empty mesh"), " (pass a sub-mesh: mesh[\"ep\"])");
  TORCH_CHECK(!is_expert_parallel(*experts), "ExpertParallel(", fqn, "): applied twice");
  const int64_t ep = ep_mesh.size(0);
  int64_t num_experts = -1;
  std::vector<std::string> names;
  for (const auto& item : experts->named_parameters(/*recurse=*/false)) {
    const at::Tensor& p = item.value();
    TORCH_CHECK(p.dim() >= 1, "ExpertParallel(", fqn, "): parameter '", item.key(), "' is a scalar; experts are "
                "stacked on dim 0");
    if (num_experts < 0) num_experts = p.size(0);
    TORCH_CHECK(p.size(0) == num_experts, "ExpertParallel(", fqn, "): parameter '", item.key(), "' has ", p.size(0),
                " rows on dim 0, another has ", num_experts, "; every parameter stacks the same experts on dim 0");
    TORCH_CHECK(!tp::find_spec(*experts, item.key()), "ExpertParallel(", fqn, "): parameter '", item.key(),
                "' is already tensor-parallel");
    names.push_back(item.key());
  }
  TORCH_CHECK(num_experts > 0, "ExpertParallel(", fqn, "): the module has no parameters of its own (it must hold "
              "the stacked expert weights)");
  TORCH_CHECK(num_experts % ep == 0, "ExpertParallel(", fqn, "): ", num_experts, " experts do not divide over ", ep,
              " ep ranks (expert_parallel_degree must divide the number of experts)");
  for (const auto& name : names) tp::shard_parameter(*experts, name, ep_mesh, Shard(0));
  const ProcessGroupPtr group = ep_mesh.group(0);
  const int64_t local_experts = num_experts / ep;
  nn::register_forward_wrapper(
      *experts,
      [group, local_experts, fqn](torch::nn::Module&, const nn::TensorList& inputs, const nn::ForwardFunction& fwd) {
        return dispatch_and_combine(group, local_experts, fqn, inputs, fwd);
      },
      kWrapperTag);
}

bool is_expert_parallel(const torch::nn::Module& module) { return nn::has_forward_wrapper(module, kWrapperTag); }

}  // namespace fsdp
