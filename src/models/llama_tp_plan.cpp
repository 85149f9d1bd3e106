// TorchTitan's Llama 3 TP plan (see <fsdp/models/llama_tp_plan.h>).

#include <fsdp/models/llama_tp_plan.h>

namespace fsdp::models::llama {
namespace {

// A SwiGLU feed-forward at `prefix` (w1, w3 colwise; w2 rowwise onto `out`): a dense layer's, or an MoE block's
// shared experts.
void add_dense_ffn(ParallelizePlan& plan, const std::string& prefix, const Placement& out) {
  plan.emplace_back(prefix + ".w1", ColwiseParallel{});
  plan.emplace_back(prefix + ".w3", ColwiseParallel{});
  plan.emplace_back(prefix + ".w2", RowwiseParallel{std::nullopt, out});
}

// MoE models name each layer (dense and MoE layers mix: a pattern must match a module). The MoE block takes this
// rank's slice of the sequence as it comes from the sequence-parallel ffn_norm and returns its slice: the router
// runs on the local tokens with a replicated gate (its gradient Partial over TP, all-reduced like a norm's), the
// routed experts see only this rank's tokens (no expert tensor parallel: TorchTitan removed ETP; their FSDP or
// expert-parallel mesh spans the TP ranks), and the shared experts are a dense feed-forward on the gathered
// sequence, reduce-scattered back.
void add_moe_layers(ParallelizePlan& plan, const LlamaArgs& args, const LlamaTensorParallelOptions& o) {
  TORCH_CHECK(o.sequence_parallel, "llama tensor parallel: MoE layers need sequence parallelism (each TP rank "
              "routes its own slice of the tokens)");
  const Placement seq = Shard(1);
  for (int64_t i = 0; i < args.n_layers; ++i) {
    const std::string layer = "layers." + std::to_string(i);
    if (!args.is_moe_layer(i)) {
      plan.emplace_back(layer + ".feed_forward", PrepareModuleInput{{seq}, {Replicate()}});
      add_dense_ffn(plan, layer + ".feed_forward", seq);
      continue;
    }
    plan.emplace_back(layer + ".moe.router.gate", SequenceParallel{});
    if (args.moe->num_shared_experts > 0) {
      plan.emplace_back(layer + ".moe.shared_experts", PrepareModuleInput{{seq}, {Replicate()}});
      add_dense_ffn(plan, layer + ".moe.shared_experts", seq);
    }
  }
}

}  // namespace

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
  }
  const Placement block_out = o.sequence_parallel ? seq : Replicate();
  for (const char* name : {"layers.*.attention.wq", "layers.*.attention.wk", "layers.*.attention.wv"}) {
    plan.emplace_back(name, ColwiseParallel{});
  }
  plan.emplace_back("layers.*.attention.wo", RowwiseParallel{std::nullopt, block_out});
  if (args.qk_norm) {
    // Qwen3's per-head norms see this rank's heads only: replicated weights whose gradients are Partial over TP
    // (TorchTitan: SequenceParallel(sequence_dim=2) on the heads dim).
    plan.emplace_back("layers.*.attention.q_norm", SequenceParallel{2});
    plan.emplace_back("layers.*.attention.k_norm", SequenceParallel{2});
  }
  if (!args.moe) {
    if (o.sequence_parallel) plan.emplace_back("layers.*.feed_forward", PrepareModuleInput{{seq}, {Replicate()}});
    add_dense_ffn(plan, "layers.*.feed_forward", block_out);
    return plan;
  }
  add_moe_layers(plan, args, o);
  return plan;
}

}  // namespace fsdp::models::llama
