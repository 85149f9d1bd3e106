#pragma once
// A Hugging Face model directory in one call: its config.json read into our args, nothing mapped by hand.
//
//   auto model = fsdp::models::hf::load_model("Qwen3-0.6B/");   // CPU, float32, every weight loaded
//
//   auto cfg = fsdp::models::hf::read_config("Qwen3-30B-A3B/");  // or step by step: the args first,
//   cfg.args.device = c10::kMeta;                                    // change device/dtype, build,
//   fsdp::models::llama::Transformer model(cfg.args);                    // shard (dense models), then
//   fsdp::models::hf::import_hf(*model, "Qwen3-30B-A3B/");        // the weights (import_llama/import_qwen3)
//
// Families: model_type "llama" (LlamaForCausalLM), "qwen3" (Qwen3ForCausalLM), "qwen3_moe" (Qwen3MoeForCausalLM).
// Every config.json field that changes transformers' computation is honoured (sizes, explicit head_dim,
// intermediate_size, rms_norm_eps, rope_theta at either level, RoPE scaling "linear" / "llama3" / "yarn" in the
// rope_scaling or rope_parameters form, tie_word_embeddings, num_experts or num_local_experts, top-k,
// moe_intermediate_size, norm_topk_prob, decoder_sparse_step, mlp_only_layers) or refused with its name and
// value (another hidden_act, attention or MLP biases, attention dropout, sliding windows, partial rotary
// factors, other RoPE types, output_router_logits). Absent fields take the transformers configuration class's
// default. The table is in docs/interop.md. Errors name the file, the field and the rule.

#include <fsdp/checkpoint/model_safetensors.h>
#include <fsdp/models/llama.h>

#include <string>

namespace fsdp::models::hf {

struct HfConfig {
  std::string model_type;        // "llama", "qwen3" or "qwen3_moe"
  fsdp::models::llama::LlamaArgs args;  // device CPU, dtype float32: set them before building the model
};

// `path`: a directory holding config.json, or the config.json file.
HfConfig read_config(const std::string& path);

// The weights of `path` (a directory, an index json or one .safetensors file) into `model` with its family's
// adapter (import_qwen3 for half-split RoPE models, import_llama otherwise), which checks a config.json there
// against the model.
checkpoint::SafetensorsImportResult import_hf(fsdp::models::llama::TransformerImpl& model, const std::string& path,
                                  const checkpoint::SafetensorsImportOptions& options = {});

// read_config + build on the CPU in float32 + import_hf (strict by default).
fsdp::models::llama::Transformer load_model(const std::string& dir, const checkpoint::SafetensorsImportOptions& options = {});

}  // namespace fsdp::models::hf
