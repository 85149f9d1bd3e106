// RowwiseParallel: input features (Linear) or the vocabulary (Embedding) split over the TP ranks; each rank's
// output is a partial sum, reduced to the output layout.

#include "tensor_parallel/collectives.h"
#include "tensor/param_spec.h"
#include "tensor_parallel/styles.h"

#include <fsdp/nn/module_call.h>

#include <ATen/ATen.h>

#include <memory>

namespace fsdp::tp {
namespace {

at::Tensor reduce_partial(const at::Tensor& y, const ProcessGroupPtr& group, const Placement& output_layout) {
  return output_layout.is_replicate() ? all_reduce_forward(y, group)
                                      : reduce_scatter_forward(y, group, output_layout.dim);
}

}  // namespace

void apply_rowwise(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
                   const RowwiseParallel& style) {
  const ModuleKind kind = module_kind(module);
  TORCH_CHECK(kind != ModuleKind::Other, "fsdp::parallelize_module: RowwiseParallel applies to Linear and Embedding "
              "modules (torch::nn::Linear, torch::nn::Embedding, or a module deriving from "
              "fsdp::nn::HasWeightLayout), but '", fqn, "' is ", module.name());
  const Placement output_layout = style.output_layout;
  TORCH_CHECK(output_layout.is_replicate() || output_layout.is_shard(), "fsdp::parallelize_module: RowwiseParallel "
              "on '", fqn, "': output layout must be Replicate() or Shard(d), got ", output_layout.to_string());
  const ProcessGroupPtr group = mesh.group(0);

  if (kind == ModuleKind::Embedding) {
    const Placement input_layout = style.input_layout.value_or(Replicate());
    TORCH_CHECK(input_layout.is_replicate(), "fsdp::parallelize_module: RowwiseParallel on embedding '", fqn,
                "': the token ids must be Replicate(), got ", input_layout.to_string());
    shard_parameter(module, "weight", mesh, Shard(0));
    const int64_t vocab = find_spec(module, "weight")->global_shape[0];
    const auto [offset, rows] = shard_offset_and_size(vocab, mesh.size(0), mesh.local_rank(0));
    // Ids outside this rank's rows look up row 0 and are zeroed afterwards (DTensor's MaskPartial); the mask
    // passes from the pre-hook to the post-hook of the same call.
    auto mask = std::make_shared<at::Tensor>();
    nn::register_forward_pre_hook(module, [mask, offset = offset, rows = rows](torch::nn::Module&,
                                                                              nn::TensorList& inputs) {
      if (inputs.empty()) return;
      at::Tensor& ids = inputs[0];
      *mask = (ids < offset).logical_or_(ids >= offset + rows);
      ids = (ids - offset).masked_fill_(*mask, 0);
    });
    nn::register_forward_hook(module, [mask, group, output_layout](torch::nn::Module&, const nn::TensorList&,
                                                                   nn::TensorList& outputs) {
      if (outputs.empty()) return;
      at::Tensor partial = outputs[0].masked_fill(mask->unsqueeze(-1), 0);
      *mask = at::Tensor();
      outputs[0] = reduce_partial(partial, group, output_layout);
    });
    return;
  }

  const Placement input_layout = style.input_layout.value_or(Shard(-1));
  TORCH_CHECK(input_layout.is_replicate() || input_layout.is_shard(-1), "fsdp::parallelize_module: RowwiseParallel "
              "on '", fqn, "': input layout must be Shard(-1) or Replicate(), got ", input_layout.to_string());
  shard_parameter(module, "weight", mesh, Shard(1));
  auto own = module.named_parameters(/*recurse=*/false);
  at::Tensor* bias = own.find("bias");
  if (bias) {
    shard_parameter(module, "bias", mesh, Replicate());
    // Added to a slice of the sequence when the output is sharded: its gradient is then Partial.
    if (output_layout.is_shard()) all_reduce_grad_over_tp(*bias, group);
  }
  if (input_layout.is_replicate()) {
    nn::register_forward_pre_hook(module, [group](torch::nn::Module&, nn::TensorList& inputs) {
      if (!inputs.empty()) inputs[0] = chunk_forward(inputs[0], group, -1);
    });
  }
  const std::string bias_name = bias ? "bias" : "";
  nn::register_forward_hook(module, [group, output_layout, bias_name](torch::nn::Module& m, const nn::TensorList&,
                                                                      nn::TensorList& outputs) {
    if (outputs.empty()) return;
    if (bias_name.empty()) {
      outputs[0] = reduce_partial(outputs[0], group, output_layout);
      return;
    }
    // Every rank's forward added the whole bias; it belongs once, after the reduction. Taking it out before
    // and adding it after keeps its gradient the (replicated) output gradient on every rank, with no
    // extra collective.
    const at::Tensor b = m.named_parameters(/*recurse=*/false)[bias_name];
    outputs[0] = reduce_partial(outputs[0] - b, group, output_layout) + b;
  });
}

}  // namespace fsdp::tp
