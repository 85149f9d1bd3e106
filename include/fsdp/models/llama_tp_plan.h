#pragma once
// TorchTitan's tensor-parallel plan for Llama 3 (models/llama3/parallelize.py apply_tp), kept apart from the
// model code (which knows nothing of parallelism), for fsdp::parallelize_module(model, mesh["tp"], plan).

#include <fsdp/models/llama.h>
#include <fsdp/tensor_parallel.h>

#include <cstdint>

namespace fsdp::models::llama {

struct LlamaTensorParallelOptions {
  // TorchTitan always uses it: norms on sequence slices, block inputs gathered by PrepareModuleInput, wo/w2
  // and the embedding reduce-scattered onto the sequence dim. false = plain Megatron TP (all-reduces).
  bool sequence_parallel = true;
  // The output layer keeps its logits vocabulary-sharded (Shard(-1)); train with loss_parallel_cross_entropy.
  // false = logits gathered (Replicate), any loss works.
  bool loss_parallel = true;
};

// Checks that the model splits over `tp_degree` ranks (heads and kv heads divide by it; no tied embeddings),
// naming what does not.
ParallelizePlan tensor_parallel_plan(const LlamaArgs& args, int64_t tp_degree,
                                     const LlamaTensorParallelOptions& options = {});

}  // namespace fsdp::models::llama
