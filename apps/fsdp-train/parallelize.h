#pragma once
// What a model family's parallelize step (TorchTitan's parallelize_<model>, reached through the model seam:
// model_spec.h) gives the trainer, and the pieces every family shares: the meshes, the device, whether the model
// is built on `meta`, the pipeline split's options and result. Nothing here knows a model class; each family's
// apply_* steps live in its folder (models/<family>/parallelize.*).
// Meshes are built once (build_meshes): [pp, dp_replicate, dp_shard, cp, tp] with the dims of size 1 left out (but
// dp_shard, and dp_replicate on the DDP path), on the device type of training.device.
// Gradients are summed, not averaged, across ranks (gradient divide factor 1): the loss is already divided by
// the global token count, so the sum is the full-batch gradient.

#include "config.h"
#include "parallel_dims.h"

#include <fsdp/device_mesh.h>
#include <fsdp/fully_shard.h>
#include <fsdp/nn/module_call.h>
#include <fsdp/pipeline/schedule.h>
#include <fsdp/process_group.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp_train {

// A pipeline stage this rank holds: its module (sharing the whole model's modules, so FQNs are the whole
// model's) and its forward through fsdp::nn::call (hidden states or tokens in, hidden states or logits out).
struct ModelStage {
  std::shared_ptr<torch::nn::Module> module;
  // (input, document ids) -> output; the ids are undefined under causal attention (TrainModel::document_ids).
  std::function<at::Tensor(const at::Tensor& input, const at::Tensor& document_ids)> forward;
};

struct ParallelPlan {
  bool fsdp = false;  // fully_shard or replicate applied (clip with fsdp::clip_grad_norm_)
  fsdp::DeviceMesh mesh;
  fsdp::ProcessGroupPtr dp_group;  // all data-parallel ranks (loss and token-count reductions); null on 1 rank
  std::vector<fsdp::FSDPModule> fsdp_modules;
  std::string description;
  std::string activation_checkpointing;  // what [activation_checkpoint] applied (before fully_shard)
  fsdp::DeviceMesh tp_mesh;              // valid when tensor parallel
  fsdp::DeviceMesh cp_mesh;              // valid when context parallel (each sequence split over its ranks)
  // The mesh FSDP shards over when it is not a sub-mesh of `mesh` (context parallel: the flattened dp_shard_cp,
  // a second mesh over the same ranks): its groups get the train timeout and the profiler too.
  fsdp::DeviceMesh fsdp_mesh;
  bool loss_parallel = false;            // logits are vocabulary-sharded over tp_mesh
  // Pipeline parallelism (pipeline_parallel_degree > 1): the stages this rank holds, and the pipeline group
  // (mesh dim "pp").
  std::vector<ModelStage> stages;
  std::vector<int> stage_indices;
  int num_stages = 1;
  // The schedule that placed the stages (split_pipeline's): the trainer's fsdp::Pipeline runs this one, not one
  // built again from the config.
  fsdp::pipeline::PipelineSchedule pipeline_schedule;
  fsdp::ProcessGroupPtr pp_group;
  bool holds_first_stage = true, holds_last_stage = true;
  // MoE under PP: the groups of this stage's data-parallel mesh dims (the expert loads are summed over them, not
  // the world: each stage's MoE layers live on its ranks only), and the sequence balance loss the stages attached
  // to this step's backward so far (summed, detached; undefined when none; the trainer reads and clears it).
  std::vector<fsdp::ProcessGroupPtr> stage_dp_groups;
  std::shared_ptr<at::Tensor> stage_aux_loss;
};

// The device of the mesh (training.device); a ConfigError when it is not available in this process.
c10::Device mesh_device(const JobConfig& config);
// Replicas without sharding or tensor parallelism: TorchTitan's DDP path (fsdp::replicate).
bool plain_data_parallel(const ParallelDims& dims);
// Whether the parallelize step will apply fully_shard (then the trainer builds the model on `meta` and
// materializes only the shards, as TorchTitan does). `has_group`: running under a process group.
bool plan_uses_fully_shard(const ParallelDims& dims, bool has_group);
// Whether the trainer must build and initialize the model whole before the parallelize step (meta init otherwise).
bool plan_needs_full_init(const ParallelDims& dims, bool has_group);

// ---- the meshes -------------------------------------------------------------------------------------------

struct ParallelMeshes {
  fsdp::DeviceMesh world;     // [pp, dp_replicate, dp_shard, cp, tp], dims of size 1 left out (see above)
  // The data-parallel dims FSDP shards over: dp_shard, or (dp_replicate, dp_shard); with context parallelism
  // dp_shard_cp (dp_shard x cp flattened, TorchTitan's) in place of dp_shard.
  fsdp::DeviceMesh dp;
  fsdp::DeviceMesh cp;        // valid when dims.cp > 1
  fsdp::DeviceMesh tp;        // valid when dims.tp > 1
  fsdp::DeviceMesh cp_tp;     // cp x tp flattened (the ranks holding pieces of one sequence): valid for an MoE
                              // model with dims.cp > 1 and dims.tp > 1
  fsdp::DeviceMesh ep;        // valid when dims.ep > 1: the expert-parallel dim ...
  fsdp::DeviceMesh expert_dp; // ... and the experts' data-parallel mesh: efsdp, or (dp_replicate, efsdp); also
                              // valid for an MoE model under TP without EP (efsdp = dp_shard x cp x tp)
};
// Collective over the world (every rank, same order). `device_type`: "cpu" or "cuda". `moe`: the model has MoE
// layers (their routed experts get their own mesh under EP or TP).
ParallelMeshes build_meshes(const ParallelDims& dims, const std::string& device_type, bool moe = false);
// The ranks holding pieces of one sequence, over which the MoE blocks sum their per-sequence expert counts for
// the sequence balance loss (the whole sequence's, as TorchTitan computes it): cp_tp under cp x tp (cp cuts a
// sequence into chunks, TP's sequence parallelism each chunk into slices), else cp, else tp; invalid when no
// rank splits a sequence (or for a dense model under cp x tp: no cp_tp, nothing to sum).
fsdp::DeviceMesh moe_sequence_mesh(const ParallelMeshes& meshes);
// Hands every MoE block among `blocks` (its child "moe", in every family) moe_sequence_mesh(meshes)'s group; dense
// blocks, and every block when that mesh is invalid, are left alone. Once per model or pipeline stage, after its
// apply_* steps (collective-free).
void set_moe_sequence_group(const std::vector<std::shared_ptr<torch::nn::Module>>& blocks,
                            const ParallelMeshes& meshes);

// ---- FSDP / DDP wrapping (every family) ---------------------------------------------------------------------

struct FsdpOptions {
  fsdp::DeviceMesh mesh;  // the data-parallel mesh (1-D = FSDP, 2-D (replicate, shard) = HSDP)
  MixedPrecision param_dtype = MixedPrecision::Float32;
  MixedPrecision reduce_dtype = MixedPrecision::Float32;
  bool cpu_offload = false;
  ReshardAfterForward reshard_after_forward = ReshardAfterForward::Default;
  bool pipeline = false;  // under PP "default" keeps every unit unsharded across microbatches (TorchTitan)
  // MoE blocks' routed experts: sharded on `experts_mesh` (invalid: `mesh`) along `experts_shard_dim`.
  fsdp::DeviceMesh experts_mesh;
  int64_t experts_shard_dim = 0;
};
// The [training] / [parallelism] FSDP keys of `config` over `dp_mesh` (no expert placement: the family sets it).
FsdpOptions fsdp_options(const JobConfig& config, const fsdp::DeviceMesh& dp_mesh, bool pipeline);

// A block's routed-experts module (its parameters get the experts' mesh and shard dim), or null for a dense block.
using ExpertsOfBlock = std::function<std::shared_ptr<torch::nn::Module>(torch::nn::Module& block)>;

// fully_shard on every block, then on `root` (the model or a pipeline stage): TorchTitan's per-block reshard
// rule (every block but the last by default: backward needs it at once; under PP kept across microbatches; the
// root kept unless "always") and, when the options place them apart, each block's routed experts on their own
// mesh and shard dim (FSDP2's shard_placement_fn: one fully_shard per block, the experts their own parameter
// group). Returns the FSDP modules, blocks first, the root last.
std::vector<fsdp::FSDPModule> fully_shard_blocks_then_root(const std::vector<std::shared_ptr<torch::nn::Module>>& blocks,
                                                           const std::shared_ptr<torch::nn::Module>& root,
                                                           const FsdpOptions& options,
                                                           const ExpertsOfBlock& experts_of_block);
// TorchTitan's DDP path: fsdp::replicate on every block, then `root`, over `mesh` (dp_replicate, 1): one gradient
// all-reduce per block as its backward finishes. Full precision.
std::vector<fsdp::FSDPModule> replicate_blocks_then_root(const std::vector<std::shared_ptr<torch::nn::Module>>& blocks,
                                                         const std::shared_ptr<torch::nn::Module>& root,
                                                         const fsdp::DeviceMesh& mesh);
// Gradients summed, not averaged, across ranks (the loss is already divided by the global token count); marks
// the plan as FSDP-wrapped (clip with fsdp::clip_grad_norm_).
void set_sum_gradients(ParallelPlan& plan);

// ---- pipeline stages (every family) -------------------------------------------------------------------------

// MoE under PP (TorchTitan: apply_moe_ep and apply_fsdp inside each stage's model part), before the stages are
// sharded: the routed experts' placement in every stage as without PP (EP over ep of the stage's dp_shard x cp x tp
// ranks, their FSDP over what is left; Shard(1) when those ranks exceed the experts), the groups the stage's expert
// loads are summed over (plan.stage_dp_groups: its dp x cp ranks, and tp) and the balance-loss accumulator
// (plan.stage_aux_loss). Returns the
// plan's description of the experts ("" for a dense model: num_experts 0).
std::string pipeline_moe_setup(ParallelPlan& plan, FsdpOptions& fsdp, int64_t num_experts, const JobConfig& config,
                               const ParallelDims& dims, const ParallelMeshes& meshes);
// A stage this rank holds as the trainer runs it: `call` runs `module` on (input, document ids: undefined under
// causal attention); with the sequence balance loss on (plan.stage_aux_loss) the stage's MoE layers' loss joins
// each microbatch's backward, weighted by the microbatch's share of this replica group's batch (moe_balance.h).
ModelStage pipeline_stage(std::shared_ptr<torch::nn::Module> module,
                          std::function<at::Tensor(const at::Tensor& input, const at::Tensor& document_ids)> call,
                          const ParallelPlan& plan, const ParallelDims& dims);
// A stage's `call` for pipeline_stage: the stage module (a holder: LlamaStage, DeepSeekV3Stage, ...) through
// fsdp::nn::call, with the microbatch's document ids alongside under block_causal (the pipeline's context) and
// without them under causal attention (the ids undefined).
template <class StageHolder>
std::function<at::Tensor(const at::Tensor& input, const at::Tensor& document_ids)> stage_call(StageHolder stage) {
  return [stage](const at::Tensor& x, const at::Tensor& ids) {
    return ids.defined() ? fsdp::nn::call(stage, x, std::optional<at::Tensor>(ids)) : fsdp::nn::call(stage, x);
  };
}
// The tail of every family's pipeline path, once plan.stages holds the stages this rank holds (sharded): the
// first/last-stage flags, gradients summed across ranks (set_sum_gradients) and the description
// (pipeline_description of `layers`, the stages' stage_layers_text, and `parts`, the TP/CP/EP words).
void finish_pipeline_plan(ParallelPlan& plan, const JobConfig& config, const ParallelDims& dims,
                          const std::string& layers, const std::string& parts);
// The plan's words for context parallelism, every family's ("" without it): degree, rotate method, load balancer,
// sequence per rank, FSDP's dp_shard x cp ranks.
std::string cp_description(const JobConfig& config, const ParallelDims& dims);
// The plan's description of a pipeline split: "PP <pp> (<schedule>, <n> stages, <m> microbatches; this rank:
// <layers>) + <parts>" followed by the FSDP mesh and reshard policy.
std::string pipeline_description(const ParallelPlan& plan, const JobConfig& config, const ParallelDims& dims,
                                 const std::string& layers, const std::string& parts);
// "stage <s> = layers <begin>..<end-1> [+ tok_embeddings] [+ norm, output]", for the description.
std::string stage_layers_text(int s, int64_t begin, int64_t end, int num_stages);

// ---- context parallelism (every family) ---------------------------------------------------------------------

// What context parallelism over a 1-D `cp_mesh` gives a model or a pipeline stage (TorchTitan's apply_cp), the
// same for every family: the RoPE positions of this rank's chunks, block_causal's document ids of every cp rank
// (gathered once per forward), and each block's attention through the ring. The only per-family part is the
// attention's softmax scale (Llama: 1/sqrt(head dim); DeepSeek-V3's MLA: its own, with YaRN's mscale); a v head
// dim other than q/k's the ring handles itself (it pads v).
struct CpHooks {
  // this rank's tokens' global positions (int64 [local_len]) for the local_len tokens a forward is given
  std::function<at::Tensor(int64_t local_len)> rope_positions;
  // this rank's chunks' document ids -> every cp rank's ([cp, batch, local_len]; collective over cp)
  std::function<at::Tensor(const at::Tensor& document_ids)> document_mask;
  // A block's attention kernel: q, k, v of this rank's chunks through ring attention over cp at `scale` (unset:
  // 1/sqrt(q's head dim)), masked by the gathered document ids when given (block_causal), causal otherwise.
  using AttentionKernel = std::function<at::Tensor(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   const std::optional<at::Tensor>& all_document_ids)>;
  AttentionKernel ring_attention(std::optional<double> scale = std::nullopt) const;
  // Sets rope_positions and document_mask on a model or a stage (any holder with those two members).
  template <class Holder>
  void install(Holder& holder) const {
    holder.rope_positions = rope_positions;
    holder.document_mask = document_mask;
  }

  fsdp::ProcessGroupPtr group;  // the cp ranks
  CpRotateMethod rotate_method = CpRotateMethod::AllGather;
  CpLoadBalancer load_balancer = CpLoadBalancer::HeadTail;
};
// The hooks over `cp_mesh` with the [parallelism] rotate method and load balancer. Collective-free.
CpHooks cp_hooks(const fsdp::DeviceMesh& cp_mesh, CpRotateMethod rotate_method, CpLoadBalancer load_balancer);

// ---- pipeline split -----------------------------------------------------------------------------------------

struct PipelineSplitOptions {
  PipelineSchedule schedule = PipelineSchedule::OneFOneB;
  int64_t pp = 1;            // pipeline ranks
  int64_t microbatches = 1;  // per step
  int64_t layers_per_stage = 0;  // 0 = the schedule's stages per rank
  int64_t first_stage_less_layers = 1, last_stage_less_layers = 1;
  std::vector<std::vector<std::string>> module_fqns_per_model_part;  // explicit stages; empty = none
  std::string schedule_csv;  // a schedule file (replaces `schedule`); empty = none
};
// The [parallelism] pipeline keys of `config` with `dims`' degree and microbatches.
PipelineSplitOptions pipeline_split_options(const JobConfig& config, const ParallelDims& dims);
struct PipelineSplit {
  int64_t num_stages = 0;
  std::vector<std::pair<int64_t, int64_t>> layers;  // [begin, end) per stage
  fsdp::pipeline::PipelineSchedule schedule;        // stages_of_rank(r): the stages pipeline rank r holds
};
// The head of every family's pipeline path, once the family has split its layers (`split`): the meshes
// (build_meshes; `moe`: the model has MoE layers) on training.device, the world mesh and its pp group, the tp mesh
// (and loss parallel) under TP, the cp mesh under CP (each stage's attention runs the ring over its cp ranks on the
// chunks the trainer cut before the schedule split the rows into microbatches; FSDP over dp_shard_cp), and the
// stages this rank holds under the split's schedule. Returns the meshes. Collective over the world.
ParallelMeshes start_pipeline_plan(ParallelPlan& plan, const JobConfig& config, const ParallelDims& dims, bool moe,
                                   const PipelineSplit& split);

}  // namespace fsdp_train
