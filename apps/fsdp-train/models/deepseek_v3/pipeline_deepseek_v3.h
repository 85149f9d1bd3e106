#pragma once
// DeepSeek-V3 under pipeline parallelism (TorchTitan: pipeline_llm with deepseek_v3's parallelize on each model
// part): the model cut into stages as Llama 3 is (the same chain of module FQNs: tok_embeddings, layers.<i>,
// norm, output), the schedule's stage placement, and in each stage this rank holds the TP plan of the stage's
// modules, CP (the stage's MLA through the ring over its cp ranks), EP over the stage's data-parallel (x cp x tp)
// ranks and fully_shard per block and on the stage (the routed experts on their own mesh).

#include "config.h"
#include "parallel_dims.h"
#include "parallelize.h"

#include <fsdp/models/deepseek_v3.h>
#include <fsdp/process_group.h>

namespace fsdp_train::deepseek_v3 {

// TorchTitan's split of `args.n_layers` into stages and the schedule placing them; a ConfigError naming the
// [parallelism] keys when they do not fit. No collectives.
PipelineSplit split_pipeline(const fsdp::models::deepseek_v3::DeepSeekV3Args& args, const PipelineSplitOptions& options);

// The pipeline half of parallelize_deepseek_v3: `plan` holds what came before (activation checkpointing); the
// stages this rank holds, each with TP, CP, EP and FSDP. Collective over `group` (the meshes).
ParallelPlan parallelize_deepseek_v3_pipeline(fsdp::models::deepseek_v3::DeepSeekV3& model, const JobConfig& config,
                                              const ParallelDims& dims, const fsdp::ProcessGroupPtr& group,
                                              ParallelPlan plan);

}  // namespace fsdp_train::deepseek_v3
