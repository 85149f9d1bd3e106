// ColwiseParallel: output features (Linear) or embedding dims (Embedding) split over the TP ranks.

#include "tensor_parallel/collectives.h"
#include "tensor/param_spec.h"
#include "tensor_parallel/styles.h"

#include <fsdp/nn/module_call.h>

namespace fsdp::tp {

void apply_colwise(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
                   const ColwiseParallel& style) {
  const ModuleKind kind = module_kind(module);
  TORCH_CHECK(kind != ModuleKind::Other, "fsdp::parallelize_module: ColwiseParallel applies to Linear and Embedding "
              "modules (torch::nn::Linear, torch::nn::Embedding, or a module deriving from "
              "fsdp::nn::HasWeightLayout), but '", fqn, "' is ", module.name());
  TORCH_CHECK(!style.input_layout.is_partial(), "fsdp::parallelize_module: ColwiseParallel on '", fqn,
              "': input layout must be Replicate() or Shard(d), got ", style.input_layout.to_string());
  const bool gather_output = style.output_layout.is_replicate();
  TORCH_CHECK(gather_output || style.output_layout.is_shard(-1),
              "fsdp::parallelize_module: ColwiseParallel on '", fqn, "': output layout must be Shard(-1) or ",
              "Replicate(), got ", style.output_layout.to_string());

  shard_parameter(module, "weight", mesh, kind == ModuleKind::Linear ? Shard(0) : Shard(1));
  const int64_t out_features = find_spec(module, "weight")->global_shape[kind == ModuleKind::Linear ? 0 : 1];
  if (kind == ModuleKind::Linear && module.named_parameters(/*recurse=*/false).find("bias")) {
    shard_parameter(module, "bias", mesh, Shard(0));
  }

  const ProcessGroupPtr group = mesh.group(0);
  const Placement input_layout = style.input_layout;
  const bool reduce_input_grad = style.reduce_input_grad;
  nn::register_forward_pre_hook(module, [group, input_layout, kind, reduce_input_grad](torch::nn::Module&,
                                                                                      nn::TensorList& inputs) {
    if (inputs.empty()) return;
    at::Tensor& x = inputs[0];
    if (input_layout.is_shard()) {
      x = gather_for_partial_grad(x, group, input_layout.dim);
    } else if (kind == ModuleKind::Linear && reduce_input_grad && x.requires_grad() &&
               !produced_by_partial_grad_gather(x)) {
      // A local replicated input: each rank's input gradient covers only its output features (Partial).
      x = all_reduce_backward(x, group);
    }
  });
  if (gather_output) {
    nn::register_forward_hook(module, [group, out_features](torch::nn::Module&, const nn::TensorList&,
                                                            nn::TensorList& outputs) {
      if (!outputs.empty()) outputs[0] = gather_for_replicate_grad(outputs[0], group, -1, out_features);
    });
  }
}

}  // namespace fsdp::tp
