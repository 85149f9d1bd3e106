// See decoder_spec.h.
#include "decoder_spec.h"

#include "models/model_forwards.h"
#include "parallelize_llama.h"

#include <fsdp/models/llama.h>
#include <fsdp/models/llama_tp_plan.h>

#include <memory>
#include <utility>

namespace fsdp_train::llama3 {
namespace {

using fsdp::models::llama::LlamaArgs;
using fsdp::models::llama::Transformer;
using fsdp::models::llama::TransformerImpl;

// The decoder a TrainModel holds (every TrainModel of this spec was built by build_model below).
Transformer decoder_of(const TrainModel& model) {
  auto impl = std::dynamic_pointer_cast<TransformerImpl>(model.module);
  TORCH_CHECK(impl, "the model is not a Llama 3 decoder (fsdp::models::llama::Transformer)");
  return Transformer(impl);
}

TransformerImpl& decoder_impl(torch::nn::Module& model, const std::string& family, const char* what) {
  auto* impl = dynamic_cast<TransformerImpl*>(&model);
  TORCH_CHECK(impl, what, ": the model is not a ", family, " decoder (the ", family, " Hugging Face adapter's model)");
  return *impl;
}

std::string summary_of(const LlamaArgs& args) {
  std::string ffn;
  if (args.moe) {
    const auto& m = *args.moe;
    ffn = std::to_string(m.num_experts) + " experts (top-" + std::to_string(m.top_k) + ", " + m.score_func +
          ", hidden " + std::to_string(m.hidden) +
          (m.num_shared_experts ? ", shared " + std::to_string(m.num_shared_experts) : "") + ")";
  } else {
    ffn = "ffn " + std::to_string(args.ffn_hidden_dim());
  }
  return "dim " + std::to_string(args.dim) + ", " + std::to_string(args.n_layers) + " layers, " +
         std::to_string(args.n_heads) + " heads (" + std::to_string(args.kv_heads()) + " kv), " + ffn + ", vocab " +
         std::to_string(args.vocab_size);
}

TrainModel build_model(const JobConfig& config, const ModelShape& shape) {
  LlamaArgs args = model_args(config);
  args.vocab_size = shape.vocab_size;  // TorchTitan: the model's vocab follows the tokenizer
  args.max_seq_len = shape.max_seq_len;
  args.device = shape.device;
  Transformer model(args);
  TrainModel out;
  out.module = model.ptr();
  set_model_forwards(out, model, args.attn_mask_type == fsdp::models::llama::AttnMaskType::BlockCausal, shape.eos_id);
  const std::shared_ptr<TransformerImpl> impl = model.ptr();
  out.init_weights = [impl](uint64_t seed, const InitScope& scope) {
    if (scope) impl->init_weights(seed, scope);
    else impl->init_weights(seed);
  };
  out.cached_forward = [impl](int64_t capacity) {
    auto cache = std::make_shared<fsdp::models::llama::KVCache>(impl->make_kv_cache(1, capacity));
    return std::function<at::Tensor(const at::Tensor&)>(
        [impl, cache](const at::Tensor& tokens) { return impl->forward_cached(tokens, *cache); });
  };
  out.summary = summary_of(args);
  out.num_params = fsdp::models::llama::num_params(args);
  out.flops_per_token = fsdp::models::llama::flops_per_token(args, shape.max_seq_len);
  out.attention = {args.n_heads, args.head_dim(), args.head_dim()};  // K / V repeated to every head under GQA
  return out;
}

}  // namespace

TrainSpec decoder_train_spec(std::string name, std::vector<std::string> flavors, DecoderImport import_hf,
                             DecoderExport export_hf) {
  TrainSpec spec;
  spec.name = name;
  spec.flavors = std::move(flavors);
  spec.build = build_model;
  spec.check_layout = [name](const JobConfig& config, const ParallelDims& dims) {
    const LlamaArgs args = model_args(config);
    check_layout(name, args, config, dims);
    // The pipeline split is arithmetic over the flavor's layers (and the schedule file): cut it here too, so that
    // stages, a schedule or a file the layout cannot take are refused before any process group, not in parallelize.
    if (dims.pp > 1) split_pipeline(args, pipeline_split_options(config, dims));
  };
  spec.parallelize = [](TrainModel& model, const JobConfig& config, const ParallelDims& dims,
                        const fsdp::ProcessGroupPtr& group) {
    Transformer decoder = decoder_of(model);
    return parallelize_llama(decoder, config, dims, group);
  };
  spec.split_pipeline = [](const TrainModel& model, const PipelineSplitOptions& options) {
    return split_pipeline(decoder_of(model)->args(), options);
  };
  spec.tp_plan = [](const TrainModel& model, int64_t tp_degree, bool loss_parallel) {
    return fsdp::models::llama::tensor_parallel_plan(decoder_of(model)->args(), tp_degree, {true, loss_parallel});
  };
  // The adapters take the decoder; `what` names the config key in the error for any other module.
  spec.hf.import_weights = [import_hf, name](torch::nn::Module& model, const std::string& dir,
                                             const fsdp::checkpoint::SafetensorsImportOptions& options) {
    return import_hf(decoder_impl(model, name, "checkpoint.initial_load_in_hf"), dir, options);
  };
  spec.hf.export_weights = [export_hf, name](torch::nn::Module& model, const std::string& dir,
                                             const fsdp::checkpoint::SafetensorsExportOptions& options) {
    return export_hf(decoder_impl(model, name, "checkpoint.last_save_in_hf"), dir, options);
  };
  return spec;
}

}  // namespace fsdp_train::llama3
