// See deepseek_v3_spec.h.
#include "deepseek_v3_spec.h"

#include "models/model_forwards.h"
#include "parallelize_deepseek_v3.h"
#include "pipeline_deepseek_v3.h"

#include <fsdp/models/deepseek_v3.h>
#include <fsdp/models/deepseek_v3_tp_plan.h>
#include <fsdp/models/hf_deepseek_v3.h>

#include <ATen/ATen.h>

#include <memory>

namespace fsdp_train::deepseek_v3 {
namespace {

namespace ds = fsdp::models::deepseek_v3;

// The model a TrainModel of this spec holds (build_model below made it).
ds::DeepSeekV3 model_of(const TrainModel& model) {
  auto impl = std::dynamic_pointer_cast<ds::DeepSeekV3Impl>(model.module);
  TORCH_CHECK(impl, "the model is not a DeepSeek-V3 model (fsdp::models::deepseek_v3::DeepSeekV3)");
  return ds::DeepSeekV3(impl);
}

ds::DeepSeekV3Impl& model_impl(torch::nn::Module& model, const char* what) {
  auto* impl = dynamic_cast<ds::DeepSeekV3Impl*>(&model);
  TORCH_CHECK(impl, what, ": the model is not a DeepSeek-V3 model (the deepseek_v3 Hugging Face adapter's model)");
  return *impl;
}

std::string summary_of(const ds::DeepSeekV3Args& a) {
  const auto& m = a.moe;
  const std::string q = a.q_lora_rank ? "q_lora " + std::to_string(a.q_lora_rank) + ", " : std::string();
  return "dim " + std::to_string(a.dim) + ", " + std::to_string(a.n_layers) + " layers (" +
         std::to_string(a.n_dense_layers) + " dense, ffn " + std::to_string(a.inter_dim) + "), " +
         std::to_string(a.n_heads) + " heads, MLA (" + q + "kv_lora " + std::to_string(a.kv_lora_rank) + "), " +
         std::to_string(m.num_experts) + " experts (top-" + std::to_string(m.top_k) + ", " + m.score_func +
         ", hidden " + std::to_string(m.hidden) +
         (m.num_shared_experts ? ", shared " + std::to_string(m.num_shared_experts) : "") +
         (m.num_expert_groups ? ", " + std::to_string(m.num_expert_groups) + " groups / " +
                                    std::to_string(m.num_limited_groups)
                              : "") +
         "), vocab " + std::to_string(a.vocab_size);
}

TrainModel build_model(const JobConfig& config, const ModelShape& shape) {
  ds::DeepSeekV3Args args = model_args(config);
  args.vocab_size = shape.vocab_size;  // TorchTitan: the model's vocab follows the tokenizer
  args.max_seq_len = shape.max_seq_len;
  args.device = shape.device;
  ds::DeepSeekV3 model(args);
  TrainModel out;
  out.module = model.ptr();
  set_model_forwards(out, model, args.attn_mask_type == fsdp::models::llama::AttnMaskType::BlockCausal, shape.eos_id);
  const std::shared_ptr<ds::DeepSeekV3Impl> impl = model.ptr();
  out.init_weights = [impl](uint64_t seed, const InitScope& scope) {
    if (scope) impl->init_weights(seed, scope);
    else impl->init_weights(seed);
  };
  // No cached_forward: MLA's latent KV cache is not written, so generate re-runs the whole sequence for each new
  // token (the same numbers, quadratic in the generated length) and says "no KV cache".
  out.summary = summary_of(args);
  out.num_params = ds::num_params(args);
  out.flops_per_token = ds::flops_per_token(args, shape.max_seq_len);
  out.attention = {args.n_heads, args.qk_nope_head_dim + args.qk_rope_head_dim, args.v_head_dim};
  return out;
}

}  // namespace

TrainSpec train_spec() {
  TrainSpec spec;
  spec.name = "deepseek_v3";
  spec.flavors = ds::deepseek_v3_flavor_names();
  spec.build = build_model;
  spec.check_layout = [](const JobConfig& config, const ParallelDims& dims) {
    check_layout(model_args(config), config, dims);
  };
  spec.parallelize = [](TrainModel& model, const JobConfig& config, const ParallelDims& dims,
                        const fsdp::ProcessGroupPtr& group) {
    ds::DeepSeekV3 m = model_of(model);
    return parallelize_deepseek_v3(m, config, dims, group);
  };
  spec.split_pipeline = [](const TrainModel& model, const PipelineSplitOptions& options) {
    return split_pipeline(model_of(model)->args(), options);
  };
  spec.tp_plan = [](const TrainModel& model, int64_t tp_degree, bool loss_parallel) {
    return ds::tensor_parallel_plan(model_of(model)->args(), tp_degree, loss_parallel);
  };
  spec.hf.import_weights = [](torch::nn::Module& model, const std::string& dir,
                              const fsdp::checkpoint::SafetensorsImportOptions& options) {
    return fsdp::models::hf::import_deepseek_v3(model_impl(model, "checkpoint.initial_load_in_hf"), dir, options);
  };
  spec.hf.export_weights = [](torch::nn::Module& model, const std::string& dir,
                              const fsdp::checkpoint::SafetensorsExportOptions& options) {
    return fsdp::models::hf::export_deepseek_v3(model_impl(model, "checkpoint.last_save_in_hf"), dir, options);
  };
  return spec;
}

}  // namespace fsdp_train::deepseek_v3
