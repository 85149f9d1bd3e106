#pragma once
// fsdp-plan's pieces, one job per file (plan.h is the public model):
//   plan_model.cpp        the model through the trainer's seam: built on meta, parallelized under a fake world
//                         for each rank planned, its FSDP units' shards read back (no shape formulas here)
//   plan_activations.cpp  what autograd saves per block and for the loss
//   plan.cpp              make_plan: memory and data-parallel / TP / EP communication of one rank
//   plan_pipeline.cpp     pipeline parallelism: stages, the schedule's action list walked per pp rank
//   plan_text.cpp         the report (format_plan) and the command line's parsers
// Private to apps/fsdp-plan.

#include "plan.h"

#include "attention_memory.h"

#include <fsdp/pipeline/schedule.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace fsdp::plan::detail {

inline int64_t bytes_of(c10::ScalarType t) { return static_cast<int64_t>(c10::elementSize(t)); }
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t align16(int64_t n) { return (n + 15) / 16 * 16; }
inline bool is_moe(const models::llama::LlamaArgs& a, int64_t layer) { return a.moe.has_value() && a.is_moe_layer(layer); }

// ---- the model, from the seam (plan_model.cpp) ----

// What the trainer's parallelize step makes of the model on the ranks planned: the FSDP units with this rank's
// shards (GroupPlan), in the trainer's order (blocks, then the root; under PP per stage).
struct SeamLayout {
  int64_t num_params = 0;            // the whole model's, counted on the built model before any sharding
  std::vector<GroupPlan> groups;     // pp = 1: blocks 0..n-1, then "root" (rank 0's shards, the largest)
  // pp > 1: per stage (index = stage), its units: its blocks, then its "root" (embedding / norm + output) if any;
  // each stage as the first rank of its pp rank's data-parallel x TP block holds it.
  std::vector<std::vector<GroupPlan>> stage_groups;
  std::string description;           // the trainer's ParallelPlan::description (rank 0)
  // The attention kernel's shape (all heads; TP divides them): the trainer's TrainModel::attention, which its
  // start-up log reads too (DeepSeek-V3's MLA: q/k and v head dims of their own).
  fsdp_train::AttentionShape attention;
};
// Builds config's model through the trainer's model seam (apps/fsdp-train/model_spec.h) on meta and runs its
// family's parallelize under a fsdp::FakeWorld, once per rank planned. A refused layout is the trainer's
// ConfigError, as "fsdp-plan: <its message>".
// `stage_fqns`: explicit stages (PipelineSetup::stage_fqns), empty = the trainer's own split.
SeamLayout layout_from_seam(const PlanConfig& c, const std::vector<std::vector<std::string>>& stage_fqns = {});
// The parameters c.args describe (what the seam's model must have): llama::num_params, or for deepseek_v3 the
// flavor's own count when c.args is its view (model_args); -1 when they describe another model.
int64_t described_num_params(const PlanConfig& c);

// ---- collectives of a group (plan.cpp) ----

// A group's parameters by the mesh they shard over: the dense part over the S shard ranks, and in an MoE block
// the routed experts of this rank over expert_shard (efsdp) ranks. `own_call`: the part is its own FSDP
// parameter group (one collective of its own); the experts of an ep = 1 block travel in the block's.
struct ShardedPart {
  int64_t numel = 0;  // unsharded on this rank
  int64_t shard_numel = 0, all_gather_bytes = 0, ranks = 1;
  bool own_call = true, experts = false;
};
std::vector<ShardedPart> parts_of(const GroupPlan& g, int64_t S);
// One all-gather of a group (each part over its own ranks: (n-1) x slot bytes); `hpz` = N > 1: an hpZ re-gather
// within N ranks.
void add_all_gather(CommPlan& cm, const GroupPlan& g, int64_t S, int64_t e, int64_t hpz = 0);
// One group's gradient reduction per step: a reduce-scatter over each part's shard ranks and, with R > 1
// replicas, HSDP's all-reduce of the shard over them; `rb` = bytes per reduce-dtype element.
void add_gradient_reduction(CommPlan& cm, const GroupPlan& g, int64_t S, int64_t R, int64_t rb);

// ---- activations (plan_activations.cpp) ----

// What autograd saves for a batch of T tokens (docs/planner.md, "Activations"): per block under the configured
// AC, and for the final norm and the loss. The pipeline planner evaluates it at one microbatch's tokens.
struct ActivationModel {
  int64_t full_per_layer = 0;          // a block that saves everything (the first block; blocks alike without MoE)
  int64_t moe_per_layer = 0, dense_per_layer = 0;  // an MoE / a dense block that saves everything (0: none)
  std::vector<int64_t> layer_full;     // per block: everything it saves (what a recomputation rebuilds)
  std::vector<int64_t> layer_workspace;  // per block: gradients in flight through its backward
  int64_t checkpointed_per_layer = 0;  // a checkpointed block: its input only
  std::vector<int64_t> layer_saved;    // per block, under the configured AC
  std::vector<bool> recomputed;        // per block: its backward first recomputes its forward
  int64_t final_norm = 0;
  int64_t logits = 0;                  // T x V (per TP rank) in the compute dtype
  int64_t lsm = 0;                     // T x V x 4: the float32 copy / log-softmax output when upcast
  int64_t lsm_bytes = 0;               // the log-softmax output
  int64_t loss_forward = 0;            // logits, log-softmax output and the float32 copy when upcast
  int64_t grad_workspace = 0;          // gradients in flight through one block's backward (the largest block's)
  int64_t largest_full = 0;            // the largest block's full activations (MoE and dense blocks differ)
  // One block's attention on this rank: saved, and held beyond that by a ring-attention call under cp
  // (fsdp-train's attention_memory.h, the formula its start-up log uses too).
  fsdp_train::AttentionMemory attention;
};
// `attention`: the seam's (SeamLayout::attention).
ActivationModel activation_model(const PlanConfig& c, int64_t T, const fsdp_train::AttentionShape& attention);

// ---- collectives of the model dims (plan.cpp) ----

// The TP dim's collectives of one forward + backward of T tokens through blocks [first, first + count), plus the
// embedding and the output layer / loss when held; the ep dim's all-to-alls of the same blocks. Both add to `cm`
// (a pipeline rank calls them per microbatch and stage).
// `units`: those blocks' FSDP units (and the root's when it holds the embedding or the output), whose
// TP-replicated parameters' gradients are all-reduced (GroupPlan::tp_replicated_numels, from the seam).
void add_tp_collectives(CommPlan& cm, const PlanConfig& c, const ActivationModel& act, int64_t first, int64_t count,
                        bool has_embedding, bool has_output, int64_t T, const std::vector<GroupPlan>& units);
void add_ep_collectives(CommPlan& cm, const PlanConfig& c, const ActivationModel& act, int64_t first, int64_t count,
                        int64_t T);
// The MoE blocks' [E] buffers (expert_bias, tokens_per_expert) among blocks [first, first + count), in bytes.
int64_t moe_buffer_bytes(const models::llama::LlamaArgs& a, int64_t first, int64_t count);

// ---- pipeline parallelism (plan_pipeline.cpp) ----

// The pipeline options checked (with the planner's own messages, before the model is built), the stages split
// (TorchTitan's split_layers) and the schedule built.
struct PipelineSetup {
  pipeline::ScheduleKind kind;
  std::string name;                  // torch's spelling
  int64_t v = 1, num_stages = 1;     // stages per rank, stages
  std::vector<int64_t> layers;       // per stage
  pipeline::PipelineSchedule schedule;
  // --stages-per-rank (no trainer key): the stages as TorchTitan's module_fqns_per_model_part; else empty.
  std::vector<std::vector<std::string>> stage_fqns;
};
PipelineSetup prepare_pipeline(const PlanConfig& c);
// Fills plan.pipeline from the seam's stages and replaces plan.memory / plan.comm by the pp rank with the
// largest peak.
void plan_pipeline(const PlanConfig& c, const PipelineSetup& setup, const SeamLayout& seam, Plan& plan);

// ---- the report (plan_text.cpp) ----

std::string gib(int64_t bytes);  // "1.50 GiB" / "3.25 MiB"
void format_pipeline(std::ostringstream& os, const Plan& p);

}  // namespace fsdp::plan::detail
