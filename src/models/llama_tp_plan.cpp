// TorchTitan's Llama 3 TP plan (see <fsdp/models/llama_tp_plan.h>).

#include <fsdp/models/llama_tp_plan.h>

namespace fsdp::nn::llama {

ParallelizePlan tensor_parallel_plan(const LlamaArgs& args, int64_t tp, const LlamaTensorParallelOptions& o) {
  TORCH_CHECK(tp >= 1, "llama tensor parallel: degree must be positive, got ", tp);
  TORCH_CHECK(args.n_heads % tp == 0, "llama tensor parallel: n_heads ", args.n_heads,
              " does not divide by the TP degree ", tp);
  TORCH_CHECK(args.kv_heads() % tp == 0, "llama tensor parallel: n_kv_heads ", args.kv_heads(),
              " does not divide by the TP degree ", tp);
  TORCH_CHECK(!args.tie_embeddings, "llama tensor parallel: tied embeddings (tok_embeddings.weight used as the "
              "output projection) cannot be split both row- and column-wise; use a flavor without tie_embeddings");
  const Placement seq = Shard(1);
  ParallelizePlan plan;
  // Root: the embedding's partial output lands on the sequence dim (SP) or is all-reduced.
  plan.emplace_back("tok_embeddings", RowwiseParallel{Replicate(), o.sequence_parallel ? seq : Replicate()});
  if (o.sequence_parallel) plan.emplace_back("norm", SequenceParallel{});
  plan.emplace_back("output", ColwiseParallel{o.sequence_parallel ? seq : Replicate(),
                                              o.loss_parallel ? Shard(-1) : Replicate()});
  // Blocks.
  if (o.sequence_parallel) {
    plan.emplace_back("layers.*.attention_norm", SequenceParallel{});
    plan.emplace_back("layers.*.ffn_norm", SequenceParallel{});
    // (x, rope_cos, rope_sin[, block_causal mask]): only x is sequence-sharded (the mask, over the full sequence,
    // passes untouched: attention runs on the gathered sequence with this rank's heads).
    plan.emplace_back("layers.*.attention",
                      PrepareModuleInput{{seq, std::nullopt, std::nullopt}, {Replicate(), std::nullopt, std::nullopt}});
    plan.emplace_back("layers.*.feed_forward", PrepareModuleInput{{seq}, {Replicate()}});
  }
  const Placement block_out = o.sequence_parallel ? seq : Replicate();
  for (const char* name : {"layers.*.attention.wq", "layers.*.attention.wk", "layers.*.attention.wv",
                           "layers.*.feed_forward.w1", "layers.*.feed_forward.w3"}) {
    plan.emplace_back(name, ColwiseParallel{});
  }
  plan.emplace_back("layers.*.attention.wo", RowwiseParallel{std::nullopt, block_out});
  plan.emplace_back("layers.*.feed_forward.w2", RowwiseParallel{std::nullopt, block_out});
  return plan;
}

}  // namespace fsdp::nn::llama
