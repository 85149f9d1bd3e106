// PrepareModuleInput: redistributes a module's tensor inputs before its forward.

#include "tensor_parallel/collectives.h"
#include "tensor_parallel/styles.h"

#include <fsdp/nn/module_call.h>

namespace fsdp::tp {

void apply_prepare_module_input(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
                                const PrepareModuleInput& style) {
  TORCH_CHECK(style.input_layouts.size() == style.desired_input_layouts.size(), "fsdp::parallelize_module: "
              "PrepareModuleInput on '", fqn, "': ", style.input_layouts.size(), " input layouts but ",
              style.desired_input_layouts.size(), " desired layouts");
  for (size_t i = 0; i < style.input_layouts.size(); ++i) {
    const auto& from = style.input_layouts[i];
    const auto& to = style.desired_input_layouts[i];
    TORCH_CHECK(from.has_value() == to.has_value(), "fsdp::parallelize_module: PrepareModuleInput on '", fqn,
                "': input ", i, " has a layout on one side only (both or neither)");
    if (!from || *from == *to) continue;
    TORCH_CHECK((from->is_shard() && to->is_replicate()) || (from->is_replicate() && to->is_shard()),
                "fsdp::parallelize_module: PrepareModuleInput on '", fqn, "': input ", i, ": ", from->to_string(),
                " -> ", to->to_string(), " is not supported (Shard(d) <-> Replicate())");
  }
  const ProcessGroupPtr group = mesh.group(0);
  const auto from = style.input_layouts;
  const auto to = style.desired_input_layouts;
  nn::register_forward_pre_hook(module, [group, from, to](torch::nn::Module&, nn::TensorList& inputs) {
    for (size_t i = 0; i < inputs.size() && i < from.size(); ++i) {
      if (!from[i] || *from[i] == *to[i]) continue;
      // Gathered: the readers' gradients come back Partial and are reduce-scattered onto this rank's slice.
      inputs[i] = from[i]->is_shard() ? gather_for_partial_grad(inputs[i], group, from[i]->dim)
                                      : chunk_forward(inputs[i], group, to[i]->dim);
    }
  });
}

}  // namespace fsdp::tp
