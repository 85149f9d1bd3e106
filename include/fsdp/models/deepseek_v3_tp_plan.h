#pragma once
// TorchTitan's tensor-parallel plan for DeepSeek-V3 (torchtitan/models/deepseek_v3/infra/parallelize.py
// apply_non_moe_tp, and the MoE blocks as apply_moe_ep_tp leaves them without expert tensor parallel), for
// fsdp::parallelize_module(model, mesh["tp"], plan). Sequence parallel throughout:
//   tok_embeddings rowwise onto Shard(1), norm sequence parallel, output colwise (logits Shard(-1) under loss
//   parallel, else gathered); per block attention_norm / ffn_norm sequence parallel, the attention's input gathered;
//   multi-head latent attention split by heads: wq (or wq_b after the low-rank wq_a, q_norm) and wkv_b colwise,
//   wo rowwise onto Shard(1); the low-rank wkv_a, kv_norm (and wq_a, q_norm) replicated, their gradients Partial
//   over TP and all-reduced (TorchTitan's NoParallel: each rank back-propagates only its heads' share);
//   dense layers' feed_forward w1/w3 colwise, w2 rowwise; MoE layers: the router's gate replicated on this rank's
//   tokens, the shared experts a dense feed-forward on the gathered sequence, the routed experts untouched (their
//   FSDP or EP mesh spans the TP ranks).
// The model code needs no change: MLA takes its head count from the projections' local outputs.

#include <fsdp/models/deepseek_v3.h>
#include <fsdp/tensor_parallel.h>

#include <cstdint>

namespace fsdp::models::deepseek_v3 {

// Checks that the heads divide by `tp_degree`, naming the numbers. loss_parallel: the output projection keeps its
// logits vocabulary-sharded (train with loss_parallel_cross_entropy).
ParallelizePlan tensor_parallel_plan(const DeepSeekV3Args& args, int64_t tp_degree, bool loss_parallel = true);
// The same for a pipeline stage holding tok_embeddings (`first`), layers [begin, end) and norm + output (`last`).
ParallelizePlan tensor_parallel_plan(const DeepSeekV3Args& args, int64_t tp_degree, bool loss_parallel, bool first,
                                     int64_t begin, int64_t end, bool last);

}  // namespace fsdp::models::deepseek_v3
