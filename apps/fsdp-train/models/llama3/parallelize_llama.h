#pragma once
// The Llama 3 decoder's parallelize step (torchtitan/models/llama3/infra/parallelize.py), shared by every family
// built on fsdp::models::llama::Transformer (Llama 3, Qwen3, Qwen3-MoE) and reached through the model seam
// (model_spec.h): the model (fsdp/models/llama.h)
// knows nothing of any parallelism; one apply_* function per parallelism changes it, each taking the module, its
// mesh and the few typed options it needs, and parallelize_llama composes them from the config:
//   apply_ac        [activation_checkpoint] on every block, first (any plan): full, every k-th block, or op SAC
//   apply_tp        tensor_parallel_degree > 1: TorchTitan's Llama plan (sequence parallel; loss parallel unless
//                   disable_loss_parallel) over the innermost mesh dim "tp"; the model is initialized whole on
//                   every rank first (no meta init)
//   apply_cp        context_parallel_degree > 1: attention through ring attention over the mesh dim "cp", RoPE at
//                   the global positions of this rank's chunks; FSDP then shards over dp_shard x cp
//   apply_ep        expert_parallel_degree > 1: each MoE block's routed experts split over "ep", borrowed from
//                   the data-parallel shard dim (mesh [dp_replicate,] efsdp, ep)
//   apply_fsdp      fully_shard on every block, then on the root, over the data-parallel mesh: 1-D "dp_shard",
//                   or 2-D (dp_replicate, dp_shard) = HSDP (also with shard degree 1 under TP); reshard
//                   fsdp_reshard_after_forward (default: every block but the last, which backward needs at once;
//                   root kept, as TorchTitan; under PP: kept, one all-gather per step), mixed_precision_param /
//                   _reduce, CPU offload; MoE experts on their own mesh (EP's efsdp) and shard dim
//   apply_ddp       shard degree 1 with replicate > 1 and no TP: plain data parallelism (TorchTitan's DDP path)
//                   through fsdp::replicate on every block and the root (parameters broadcast from rank 0, never
//                   sharded, one gradient all-reduce per block as its backward finishes; full precision)
//   split_pipeline  pipeline_parallel_degree > 1: TorchTitan's stage split and the schedule's stage placement;
//                   parallelize_llama then gives each stage this rank holds apply_tp and apply_fsdp
// The meshes, the plan it returns and the pipeline split's options are the trainer's (parallelize.h).

#include "config.h"
#include "parallel_dims.h"
#include "parallelize.h"

#include <fsdp/device_mesh.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/llama.h>
#include <fsdp/models/llama_pipeline.h>
#include <fsdp/pipeline/schedule.h>
#include <fsdp/process_group.h>

#include <c10/core/Device.h>

#include <string>
#include <utility>
#include <vector>

namespace fsdp_train::llama3 {

// The model the config names: model.name's flavor (llama3 or qwen3) with the [model] moe_* overrides applied; a
// ConfigError for an unknown flavor, or overrides on a flavor without MoE layers.
fsdp::models::llama::LlamaArgs model_args(const JobConfig& config);

// ---- one apply_* per parallelism --------------------------------------------------------------------------

// Activation checkpointing on every transformer block (before fully_shard: TorchTitan's order). Returns what it
// applied, for the log.
std::string apply_ac(fsdp::models::llama::Transformer& model, AcMode mode, const SelectiveAcOption& option);

// TorchTitan's Llama TP plan (sequence parallel) over the 1-D `tp_mesh`; loss_parallel: the output projection
// keeps its logits sharded over the vocabulary.
void apply_tp(fsdp::models::llama::Transformer& model, const fsdp::DeviceMesh& tp_mesh, bool loss_parallel);
// The same for one pipeline stage: only the plan's entries for the modules it holds; its hidden states between
// stages travel split along the sequence.
void apply_tp(fsdp::models::llama::LlamaStage& stage, const fsdp::models::llama::LlamaArgs& args,
              const fsdp::DeviceMesh& tp_mesh, bool loss_parallel);

// Context parallelism over the 1-D `cp_mesh` (TorchTitan's apply_cp, after apply_tp): every block's attention
// runs as the library's ring attention over the cp ranks (fsdp/context_parallel.h), and RoPE takes the global
// positions of the chunks this rank holds. The trainer feeds each cp rank its chunks of the tokens and labels.
// Collective-free.
void apply_cp(fsdp::models::llama::Transformer& model, const fsdp::DeviceMesh& cp_mesh, CpRotateMethod rotate_method,
              CpLoadBalancer load_balancer);
// The same for one pipeline stage (its blocks; its RoPE positions and document mask): each stage's attention
// runs the ring over the stage's cp ranks, on the chunks the previous stage passed on.
void apply_cp(fsdp::models::llama::LlamaStage& stage, const fsdp::DeviceMesh& cp_mesh, CpRotateMethod rotate_method,
              CpLoadBalancer load_balancer);

// The routed experts of every MoE block split over the 1-D `ep_mesh` (collective-free; before fully_shard).
void apply_ep(fsdp::models::llama::Transformer& model, const fsdp::DeviceMesh& ep_mesh);

// FsdpOptions: parallelize.h (every family's FSDP wrapping).
// fully_shard on every block, then on the root; returns the FSDP modules (blocks first, the root last).
std::vector<fsdp::FSDPModule> apply_fsdp(fsdp::models::llama::Transformer& model, const FsdpOptions& options);
// The same for a pipeline stage (its blocks, then the stage).
std::vector<fsdp::FSDPModule> apply_fsdp(fsdp::models::llama::LlamaStage& stage, const FsdpOptions& options);

// TorchTitan's DDP path: fsdp::replicate on every block, then the root, over `mesh` (dp_replicate, 1).
std::vector<fsdp::FSDPModule> apply_ddp(fsdp::models::llama::Transformer& model, const fsdp::DeviceMesh& mesh);

// ---- pipeline split -----------------------------------------------------------------------------------------

// TorchTitan's split of `args.n_layers` into stages and the schedule that places them; a ConfigError naming the
// [parallelism] keys when they do not fit. No collectives: any rank (or a test) can compute any rank's stages.
PipelineSplit split_pipeline(const fsdp::models::llama::LlamaArgs& args, const PipelineSplitOptions& options);

// ---- the composition ------------------------------------------------------------------------------------------

// The layouts the decoder trains (no collectives; fsdp-train runs it before its process group exists): a
// ConfigError naming `family`, the flavor and the refused layout (MoE with PP or TP, an expert_parallel_degree the
// experts do not fit).
void check_layout(const std::string& family, const fsdp::models::llama::LlamaArgs& args, const JobConfig& config,
                  const ParallelDims& dims);

// check_layout first. `group` is the world group when distributed, or null for a single process (no collectives
// at all: only AC).
// With pipeline_parallel_degree > 1: the model split into stages (split_pipeline), this rank's stages each given
// TP, then fully_shard per block and on the stage.
ParallelPlan parallelize_llama(fsdp::models::llama::Transformer& model, const JobConfig& config, const ParallelDims& dims,
                               const fsdp::ProcessGroupPtr& group);

}  // namespace fsdp_train::llama3
