// Hugging Face Qwen3 / Qwen3-MoE <-> our decoder with Qwen3 args (see include/fsdp/models/hf_qwen3.h).
#include <fsdp/models/hf_qwen3.h>

#include "checkpoint/model_safetensors_impl.h"
#include "models/hf_common.h"

#include <fsdp/models/llama.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>

namespace fsdp::models::hf {
namespace fs = std::filesystem;
namespace llama = fsdp::models::llama;

namespace {

// Llama's decoder names plus Qwen3's QK-norm and the MoE router (the stacked experts are mapped apart).
const std::vector<common::NamePair>& qwen3_layer_names() {
  static const std::vector<common::NamePair> names = [] {
    std::vector<common::NamePair> n = common::layer_names();
    n.push_back({"attention.q_norm.weight", "self_attn.q_norm.weight"});
    n.push_back({"attention.k_norm.weight", "self_attn.k_norm.weight"});
    n.push_back({"moe.router.gate.weight", "mlp.gate.weight"});
    return n;
  }();
  return names;
}

// What a Qwen3 config.json can express; the adapter refuses anything else rather than export a model that
// transformers would compute differently.
void check_is_qwen3(const char* who, const llama::LlamaArgs& a) {
  TORCH_CHECK(a.rope_layout == llama::RopeLayout::HalfSplit, who,
              ": Qwen3 checkpoints use half-split RoPE (RopeLayout::HalfSplit); the model has the interleaved layout",
              " (a Llama 3 model: use export_llama / import_llama)");
  TORCH_CHECK(a.qk_norm, who, ": Qwen3 has QK-norm; the model has none (qk_norm = false)");
  if (!a.moe) return;
  const auto o = a.moe_options();
  TORCH_CHECK(o.score_func == "softmax" && o.route_scale == 1.0 && o.num_shared_experts == 0, who,
              ": Qwen3-MoE routes by softmax scores with scale 1 and no shared experts; the model has score_func \"",
              o.score_func, "\", route_scale ", o.route_scale, ", ", o.num_shared_experts, " shared experts");
}

// Checks a config.json against the model (common::parse_config: every field that changes the computation
// honoured or refused). Returns the config's tie_word_embeddings.
bool check_config(const std::string& path, const llama::LlamaArgs& a) {
  common::ConfigJson config(path, "import_qwen3");
  const common::ParsedConfig parsed = common::parse_config(config, a.moe ? "qwen3_moe" : "qwen3");
  common::check_config_matches(config, parsed, a, /*untied_model_may_load_tied=*/false);
  return parsed.args.tie_embeddings;
}

}  // namespace

std::optional<std::string> qwen3_to_hf_name(const std::string& key) {
  return common::to_hf(key, common::top_names(), qwen3_layer_names());
}

std::optional<std::string> qwen3_from_hf_name(const std::string& hf_name) {
  return common::from_hf(hf_name, common::top_names(), qwen3_layer_names());
}

std::string qwen3_config_json(const llama::LlamaArgs& a, const std::string& dtype) {
  check_is_qwen3("qwen3_config_json", a);
  nlohmann::json c = common::decoder_config_json(a, dtype);
  c["architectures"] = {a.moe ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM"};
  c["model_type"] = a.moe ? "qwen3_moe" : "qwen3";
  c["use_sliding_window"] = false;
  if (a.moe) {
    const auto o = a.moe_options();
    c["num_experts"] = o.num_experts;
    c["num_experts_per_tok"] = o.top_k;
    c["moe_intermediate_size"] = o.hidden;
    c["norm_topk_prob"] = o.route_norm;
    c["decoder_sparse_step"] = a.moe_layer_step;
    c["mlp_only_layers"] = a.dense_layers;
  }
  return c.dump(2) + "\n";
}

checkpoint::SafetensorsExportResult export_qwen3(llama::TransformerImpl& model, const std::string& dir,
                                     const checkpoint::SafetensorsExportOptions& options) {
  const llama::LlamaArgs args = model.args();
  check_is_qwen3("export_qwen3", args);
  const std::string config = qwen3_config_json(args, common::dtype_name(options.dtype));
  if (common::uses_fully_shard(model)) {
    // Sharded (FSDP, EP, TP, pipeline stages): gathered one tensor at a time, the experts as slices; the
    // load-balancing bias has no Hugging Face tensor (TorchTitan's Qwen3 adapter drops it too).
    return common::export_sharded("export_qwen3", model, dir, options, qwen3_to_hf_name, common::is_expert_bias_key,
                                  args.moe ? args.moe_options().hidden : 0, config);
  }
  // Whole model: names by table, then per MoE layer the stacked experts in transformers 5's layout.
  auto tensors = common::whole_model_tensors("export_qwen3", model, qwen3_to_hf_name, nullptr, common::is_expert_key);
  for (auto& block : model.blocks()) {
    if (!block->moe) continue;
    const auto& e = block->moe->experts;
    const int64_t E = block->moe->options().num_experts;
    // Expert parallelism leaves each rank a slice of the experts (and no fully_shard to gather them): refuse
    // rather than write a partial tensor under the full name.
    TORCH_CHECK(e->w1.size(0) == E && e->w2.size(0) == E && e->w3.size(0) == E, "export_qwen3: layer ",
                block->layer_id, " holds ", e->w1.size(0), " of its ", E, " experts (split by expert parallelism?); ",
                "the Hugging Face export needs every expert in this process");
    common::append_stacked_experts(tensors, common::experts_prefix(block->layer_id), *e);
  }
  return common::write_whole_model(dir, std::move(tensors), options, config);
}

checkpoint::SafetensorsImportResult import_qwen3(llama::TransformerImpl& model, const std::string& path,
                                     const checkpoint::SafetensorsImportOptions& options) {
  const llama::LlamaArgs args = model.args();
  check_is_qwen3("import_qwen3", args);
  const fs::path dir = fs::is_directory(path) ? fs::path(path) : fs::path(path).parent_path();
  // Without a config.json a file set lacking lm_head.weight is taken as tied; with one, it must say so.
  bool config_tied = true;
  if (fs::is_regular_file(dir / "config.json")) config_tied = check_config((dir / "config.json").string(), args);
  common::FileTensors files(path);
  const bool has_lm_head = files.has("lm_head.weight");
  common::check_lm_head("import_qwen3", path, has_lm_head, config_tied, args, options);
  checkpoint::detail::KeyAdapter adapter = common::import_adapter("import_qwen3", qwen3_to_hf_name, has_lm_head,
                                                      args.tie_embeddings, /*lm_head_from_embeddings=*/config_tied);
  if (common::uses_fully_shard(model)) {
    return common::import_sharded("import_qwen3", model, files, adapter, options, common::is_expert_bias_key,
                                  common::moe_layer_ids(model), args.moe ? args.moe_options().hidden : 0);
  }
  std::set<std::string> used;
  checkpoint::SafetensorsImportResult r =
      common::import_whole_model("import_qwen3", model, files, adapter, options, nullptr, common::is_expert_key, used);
  // Per MoE layer: transformers 5's stacked gate_up_proj / down_proj, or one tensor per expert and projection.
  for (auto& block : model.blocks()) {
    if (!block->moe) continue;
    const std::string prefix = common::experts_prefix(block->layer_id);
    const std::string ours = "layers." + std::to_string(block->layer_id) + ".moe.experts";
    if (common::import_experts("import_qwen3", files, prefix, ours, *block->moe->experts, used, r)) continue;
    TORCH_CHECK(!options.strict, "import_qwen3 from ", path, ": the experts of layer ", block->layer_id, " ('", ours,
                "') are missing: neither '", prefix, "gate_up_proj' nor '", prefix, "0.gate_proj.weight' is in the files");
    r.missing.push_back(prefix + "gate_up_proj");
    r.missing.push_back(prefix + "down_proj");
  }
  common::finish_whole_import("import_qwen3", path, files, used, adapter, options, r);
  return r;
}

}  // namespace fsdp::models::hf
