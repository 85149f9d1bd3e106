// SequenceParallel: a norm runs on this rank's slice of the sequence with replicated parameters.

#include "tensor_parallel/collectives.h"
#include "tensor/param_spec.h"
#include "tensor_parallel/styles.h"

namespace fsdp::tp {

void apply_sequence_parallel(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
                             const SequenceParallel& style) {
  // Input and output stay Shard(sequence_dim): elementwise over the last dim, the norm needs no communication
  // in forward. Its parameters see only this rank's tokens, so their gradients are Partial over TP.
  auto params = module.named_parameters(/*recurse=*/false);
  for (auto& item : params) {
    shard_parameter(module, item.key(), mesh, Replicate());
    all_reduce_grad_over_tp(item.value(), mesh.group(0));  // a handle on the module's tensor
  }
  (void)fqn;
  (void)style;  // sequence_dim: activations pass through unchanged (this rank's slice in, its slice out)
}

}  // namespace fsdp::tp
