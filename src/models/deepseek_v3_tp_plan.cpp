// TorchTitan's DeepSeek-V3 TP plan (see <fsdp/models/deepseek_v3_tp_plan.h>).

#include <fsdp/models/deepseek_v3_tp_plan.h>

#include <string>

namespace fsdp::models::deepseek_v3 {
namespace {

// A SwiGLU feed-forward at `prefix` on the gathered sequence: w1, w3 colwise, w2 rowwise back onto the sequence.
void add_dense_ffn(ParallelizePlan& plan, const std::string& prefix) {
  const Placement seq = Shard(1);
  plan.emplace_back(prefix, PrepareModuleInput{{seq}, {Replicate()}});
  plan.emplace_back(prefix + ".w1", ColwiseParallel{});
  plan.emplace_back(prefix + ".w3", ColwiseParallel{});
  plan.emplace_back(prefix + ".w2", RowwiseParallel{std::nullopt, seq});
}

void add_layer(ParallelizePlan& plan, const DeepSeekV3Args& args, int64_t i) {
  const Placement seq = Shard(1);
  const std::string layer = "layers." + std::to_string(i);
  plan.emplace_back(layer + ".attention_norm", SequenceParallel{});
  plan.emplace_back(layer + ".ffn_norm", SequenceParallel{});
  // (x, rope_cos, rope_sin[, block_causal mask]): only x is sequence-sharded; attention runs on the gathered
  // sequence with this rank's heads.
  plan.emplace_back(layer + ".attention",
                    PrepareModuleInput{{seq, std::nullopt, std::nullopt}, {Replicate(), std::nullopt, std::nullopt}});
  // The low-rank projections and their norms are replicated (SequenceParallel's mechanics: parameters Replicate,
  // no collective in forward, gradients all-reduced over TP), and the colwise projections reading them leave their
  // input gradient Partial (each rank's heads' share) for those all-reduces to sum, as DTensor does for
  // TorchTitan's NoParallel modules.
  const ColwiseParallel heads_from_latent{Replicate(), Shard(-1), /*reduce_input_grad=*/false};
  if (args.q_lora_rank == 0) {
    plan.emplace_back(layer + ".attention.wq", ColwiseParallel{});
  } else {
    plan.emplace_back(layer + ".attention.wq_a", SequenceParallel{});
    plan.emplace_back(layer + ".attention.q_norm", SequenceParallel{});
    plan.emplace_back(layer + ".attention.wq_b", heads_from_latent);
  }
  plan.emplace_back(layer + ".attention.wkv_a", SequenceParallel{});
  plan.emplace_back(layer + ".attention.kv_norm", SequenceParallel{});
  plan.emplace_back(layer + ".attention.wkv_b", heads_from_latent);
  plan.emplace_back(layer + ".attention.wo", RowwiseParallel{std::nullopt, seq});
  if (!args.is_moe_layer(i)) {
    add_dense_ffn(plan, layer + ".feed_forward");
    return;
  }
  // The MoE block takes this rank's slice of the sequence and returns its slice: the router runs on the local
  // tokens with a replicated gate (its gradient Partial over TP, all-reduced like a norm's); no expert tensor
  // parallel (TorchTitan removed ETP).
  plan.emplace_back(layer + ".moe.router.gate", SequenceParallel{});
  if (args.moe.num_shared_experts > 0) add_dense_ffn(plan, layer + ".moe.shared_experts");
}

}  // namespace

ParallelizePlan tensor_parallel_plan(const DeepSeekV3Args& args, int64_t tp, bool loss_parallel) {
  return tensor_parallel_plan(args, tp, loss_parallel, true, 0, args.n_layers, true);
}

ParallelizePlan tensor_parallel_plan(const DeepSeekV3Args& args, int64_t tp, bool loss_parallel, bool first,
                                     int64_t begin, int64_t end, bool last) {
  TORCH_CHECK(tp >= 1, "deepseek_v3 tensor parallel: degree must be positive, got ", tp);
  TORCH_CHECK(args.n_heads % tp == 0, "deepseek_v3 tensor parallel: n_heads ", args.n_heads,
              " does not divide by the TP degree ", tp);
  const Placement seq = Shard(1);
  ParallelizePlan plan;
  if (first) plan.emplace_back("tok_embeddings", RowwiseParallel{Replicate(), seq});
  if (last) {
    plan.emplace_back("norm", SequenceParallel{});
    plan.emplace_back("output", ColwiseParallel{seq, loss_parallel ? Shard(-1) : Replicate()});
  }
  for (int64_t i = begin; i < end; ++i) add_layer(plan, args, i);
  return plan;
}

}  // namespace fsdp::models::deepseek_v3
