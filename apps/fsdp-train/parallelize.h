#pragma once
// TorchTitan's declarative split between the model and its parallelisation: the model (fsdp/models/llama.h) knows
// nothing of FSDP; this step applies fsdp::fully_shard to every transformer block and then to the root, from
// the [parallelism] and [training] keys:
//   mesh            1-D over the data-parallel ranks, or 2-D ("dp_replicate", "dp_shard") = HSDP; on the device
//                   of training.device
//   shard degree 1  with replicate > 1: plain data parallelism (TorchTitan's DDP path) through fsdp::replicate
//                   on every block and the root: parameters broadcast from rank 0, never sharded, gradients
//                   summed by one all-reduce per block as its backward finishes
//   reshard         fsdp_reshard_after_forward: default (every block but the last, which backward needs at
//                   once; root kept, as TorchTitan), always, never
//   precision       mixed_precision_param / mixed_precision_reduce (FSDP only, as in TorchTitan)
//   AC              [activation_checkpoint] on every block first (any plan): full, every k-th block, or op SAC
//   TP              tensor_parallel_degree > 1: mesh [dp_replicate,] dp_shard, tp (TP innermost), TorchTitan's
//                   Llama plan (sequence parallel; loss parallel unless disable_loss_parallel) applied before
//                   fully_shard, which then shards over the data-parallel dims (HSDP when replicate > 1, even
//                   with shard degree 1). The model is initialized whole on every rank first (no meta init).
// Gradients are summed, not averaged, across ranks (gradient divide factor 1): the loss is already divided by
// the global token count, so the sum is the full-batch gradient.

#include "config.h"
#include "parallel_dims.h"

#include <fsdp/device_mesh.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/llama.h>
#include <fsdp/models/llama_pipeline.h>
#include <fsdp/process_group.h>

#include <c10/core/Device.h>

#include <string>
#include <vector>

namespace fsdp_train {

struct ParallelPlan {
  bool fsdp = false;  // fully_shard or replicate applied (clip with fsdp::clip_grad_norm_)
  fsdp::DeviceMesh mesh;
  fsdp::ProcessGroupPtr dp_group;  // all data-parallel ranks (loss and token-count reductions); null on 1 rank
  std::vector<fsdp::FSDPModule> fsdp_modules;
  std::string description;
  std::string activation_checkpointing;  // what [activation_checkpoint] applied (before fully_shard)
  fsdp::DeviceMesh tp_mesh;              // valid when tensor parallel
  bool loss_parallel = false;            // logits are vocabulary-sharded over tp_mesh
  // Pipeline parallelism (pipeline_parallel_degree > 1): the stages this rank holds (sharing the whole model's
  // modules, so FQNs are the whole model's), and the pipeline group (mesh dim "pp").
  std::vector<fsdp::nn::llama::LlamaStage> stages;
  std::vector<int> stage_indices;
  int num_stages = 1;
  fsdp::ProcessGroupPtr pp_group;
  bool holds_first_stage = true, holds_last_stage = true;
};

// The model the config names: model.name's flavor (llama3 or qwen3) with the [model] moe_* overrides applied; a
// ConfigError for an unknown flavor, or overrides on a flavor without MoE layers.
fsdp::nn::llama::LlamaArgs model_args(const JobConfig& config);

// The device of the mesh (training.device); a ConfigError when it is not available in this process.
c10::Device mesh_device(const JobConfig& config);
// Whether parallelize_llama will apply fully_shard (then the trainer builds the model on `meta` and
// materializes only the shards, as TorchTitan does). `has_group`: running under a process group.
bool plan_uses_fully_shard(const ParallelDims& dims, bool has_group);
// Whether the trainer must build and initialize the model whole before parallelize_llama (meta init otherwise).
bool plan_needs_full_init(const ParallelDims& dims, bool has_group);

// `group` is the world group when distributed, or null for a single process (no collectives at all).
// With pipeline_parallel_degree > 1: mesh [pp, dp_replicate, dp_shard, tp] (dims of size 1 left out but pp), the
// model split into stages as TorchTitan splits it (fsdp/models/llama_pipeline.h), this rank's stages each given
// TP, then fully_shard per block and on the stage (reshard_after_forward false unless "always": TorchTitan's
// default under PP, one all-gather per step).
ParallelPlan parallelize_llama(fsdp::nn::llama::Transformer& model, const JobConfig& config, const ParallelDims& dims,
                               const fsdp::ProcessGroupPtr& group);

}  // namespace fsdp_train
