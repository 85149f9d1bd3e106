// See pipeline_deepseek_v3.h.
#include "pipeline_deepseek_v3.h"

#include "models/llama3/parallelize_llama.h"
#include "parallelize_deepseek_v3.h"

#include <fsdp/expert_parallel.h>
#include <fsdp/models/deepseek_v3_pipeline.h>
#include <fsdp/models/moe.h>

#include <ATen/ATen.h>

#include <memory>
#include <vector>

namespace fsdp_train::deepseek_v3 {

namespace ds = fsdp::models::deepseek_v3;

PipelineSplit split_pipeline(const ds::DeepSeekV3Args& args, const PipelineSplitOptions& options) {
  // The split only sees the chain of modules, which is the untied Llama decoder's: its layer count is all it takes.
  fsdp::models::llama::LlamaArgs chain;
  chain.n_layers = args.n_layers;
  chain.tie_embeddings = false;
  return llama3::split_pipeline(chain, options);
}

ParallelPlan parallelize_deepseek_v3_pipeline(ds::DeepSeekV3& model, const JobConfig& config,
                                              const ParallelDims& dims, const fsdp::ProcessGroupPtr& group,
                                              ParallelPlan plan) {
  TORCH_CHECK(group, "pipeline parallelism needs a process group (run under fsdprun)");
  const PipelineSplit split = split_pipeline(model->args(), pipeline_split_options(config, dims));
  const ParallelMeshes meshes = start_pipeline_plan(plan, config, dims, /*moe=*/true, split);
  const auto& p = config.parallelism;
  FsdpOptions fsdp = fsdp_options(config, meshes.dp, /*pipeline=*/true);
  const std::string experts_description =
      pipeline_moe_setup(plan, fsdp, model->args().moe.num_experts, config, dims, meshes);
  std::string layers;
  for (int s : plan.stage_indices) {
    const auto [begin, end] = split.layers[static_cast<size_t>(s)];
    ds::DeepSeekV3Stage stage(*model, begin, end, s == 0, s == plan.num_stages - 1);
    if (dims.tp > 1) apply_tp(stage, model->args(), plan.tp_mesh, plan.loss_parallel);
    if (dims.cp > 1) apply_cp(stage, plan.cp_mesh, p.context_parallel_rotate_method, p.context_parallel_load_balancer);
    set_moe_sequence_group(block_modules(stage->blocks()), meshes);  // tp, cp or cp x tp: moe_sequence_mesh
    if (dims.ep > 1) {
      for (auto& block : stage->blocks()) {
        if (block->moe) fsdp::apply_expert_parallel(block->moe->experts.ptr(), meshes.ep);
      }
    }
    for (auto& m : fully_shard_blocks_then_root(block_modules(stage->blocks()), stage.ptr(), fsdp, experts_of_block))
      plan.fsdp_modules.push_back(m);
    layers += (layers.empty() ? "" : ", ") + stage_layers_text(s, begin, end, plan.num_stages);
    plan.stages.push_back(pipeline_stage(stage.ptr(), stage_call(stage), plan, dims));
  }
  finish_pipeline_plan(plan, config, dims, layers,
                       (dims.tp > 1 ? tp_description(plan) : std::string()) + cp_description(config, dims) +
                           experts_description);
  return plan;
}

}  // namespace fsdp_train::deepseek_v3
