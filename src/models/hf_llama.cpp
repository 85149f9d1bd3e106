// Hugging Face Llama <-> our Llama 3 (see include/fsdp/models/hf_llama.h).
#include <fsdp/models/hf_llama.h>

#include "checkpoint/model_safetensors_impl.h"
#include "models/hf_common.h"

#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/models/llama.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <set>

namespace fsdp::models::hf {
namespace fs = std::filesystem;
namespace llama = fsdp::models::llama;

namespace {

using common::split_layer;

// Which attention projection a key is and its head count (wq: n_heads, wk: kv heads); 0 = not permuted.
int64_t permuted_heads(const std::string& key, const llama::LlamaArgs& a) {
  auto l = split_layer(key, "layers.");
  if (!l) return 0;
  if (l->second == "attention.wq.weight") return a.n_heads;
  if (l->second == "attention.wk.weight") return a.kv_heads();
  return 0;
}

// Our row r of a permuted projection -> its Hugging Face row.
int64_t hf_row(int64_t r, int64_t head_dim) {
  const int64_t h = r / head_dim, j = r % head_dim;
  return h * head_dim + (j % 2) * (head_dim / 2) + j / 2;
}

// Checks a Hugging Face config.json against the model: every field that changes the computation is honoured
// (equal to the model's) or refused (common::parse_config). Returns the config's tie_word_embeddings.
bool check_config(const std::string& path, const llama::LlamaArgs& a) {
  common::ConfigJson config(path, "import_llama");
  const common::ParsedConfig parsed = common::parse_config(config, "llama");
  common::check_config_matches(config, parsed, a, /*untied_model_may_load_tied=*/true);
  return parsed.args.tie_embeddings;
}

// This adapter permutes q/k rows for the interleaved RoPE layout and knows no QK-norm or MoE names.
void check_is_llama(const char* who, const llama::LlamaArgs& a) {
  TORCH_CHECK(!a.qk_norm && !a.moe && a.rope_layout == llama::RopeLayout::Interleaved, who,
              ": the model is not a Llama 3 (it has QK-norm, MoE layers or half-split RoPE); for Qwen3 use ",
              "export_qwen3 / import_qwen3 (<fsdp/models/hf_qwen3.h>)");
}

}  // namespace

std::optional<std::string> to_hf_name(const std::string& key) {
  return common::to_hf(key, common::top_names(), common::layer_names());
}

std::optional<std::string> from_hf_name(const std::string& hf_name) {
  return common::from_hf(hf_name, common::top_names(), common::layer_names());
}

at::Tensor permute_to_hf(const at::Tensor& w, int64_t n_heads) {
  const int64_t rows = w.size(0), cols = w.size(1);
  TORCH_CHECK(n_heads > 0 && rows % (2 * n_heads) == 0, "hf::permute_to_hf: ", rows, " rows are not ", n_heads,
              " heads of an even head_dim");
  return w.reshape({n_heads, rows / n_heads / 2, 2, cols}).transpose(1, 2).reshape({rows, cols}).contiguous();
}

at::Tensor permute_from_hf(const at::Tensor& w, int64_t n_heads) {
  const int64_t rows = w.size(0), cols = w.size(1);
  TORCH_CHECK(n_heads > 0 && rows % (2 * n_heads) == 0, "hf::permute_from_hf: ", rows, " rows are not ", n_heads,
              " heads of an even head_dim");
  return w.reshape({n_heads, 2, rows / n_heads / 2, cols}).transpose(1, 2).reshape({rows, cols}).contiguous();
}

std::string config_json(const llama::LlamaArgs& a, const std::string& dtype) {
  nlohmann::json c = common::decoder_config_json(a, dtype);
  c["architectures"] = {"LlamaForCausalLM"};
  c["model_type"] = "llama";
  c["mlp_bias"] = false;
  return c.dump(2) + "\n";
}

checkpoint::SafetensorsExportResult export_llama(llama::TransformerImpl& model, const std::string& dir,
                                     const checkpoint::SafetensorsExportOptions& options) {
  const llama::LlamaArgs args = model.args();
  check_is_llama("export_llama", args);
  const std::string dtype = common::dtype_name(options.dtype);
  const common::TensorMap to_file = [args](const std::string& key, const at::Tensor& full) {
    const int64_t heads = permuted_heads(key, args);
    return heads ? permute_to_hf(full, heads) : full;
  };
  if (!common::uses_fully_shard(model)) {
    // One process holding the whole model (no fully_shard): one model.safetensors + config.json.
    auto tensors = common::whole_model_tensors("export_llama", model, to_hf_name, to_file, nullptr);
    return common::write_whole_model(dir, std::move(tensors), options, config_json(args, dtype));
  }
  checkpoint::detail::KeyAdapter adapter;
  adapter.file_name = [](const std::string& key) {
    auto hf = to_hf_name(key);
    TORCH_CHECK(hf, "export_llama: '", key, "' is not a Llama 3 weight the Hugging Face adapter knows");
    return hf;
  };
  adapter.to_file = to_file;
  adapter.extra_files.emplace_back("config.json", config_json(args, dtype));
  return checkpoint::detail::export_safetensors(model, dir, options, adapter);
}

checkpoint::SafetensorsImportResult import_llama(llama::TransformerImpl& model, const std::string& path,
                                     const checkpoint::SafetensorsImportOptions& options) {
  const llama::LlamaArgs args = model.args();
  check_is_llama("import_llama", args);
  const fs::path dir = fs::is_directory(path) ? fs::path(path) : fs::path(path).parent_path();
  // Without a config.json a file set lacking lm_head.weight is taken as tied; with one, it must say so.
  bool config_tied = true;
  if (fs::is_regular_file(dir / "config.json")) config_tied = check_config((dir / "config.json").string(), args);
  common::FileTensors files(path);
  const bool has_lm_head = files.has("lm_head.weight");
  common::check_lm_head("import_llama", path, has_lm_head, config_tied, args, options);
  checkpoint::detail::KeyAdapter adapter = common::import_adapter("import_llama", to_hf_name, has_lm_head, args.tie_embeddings,
                                                      /*lm_head_from_embeddings=*/config_tied);
  adapter.file_rows = [args](const std::string& key, int64_t begin, int64_t count) {
    std::vector<int64_t> rows;
    if (!permuted_heads(key, args)) return rows;
    for (int64_t r = begin; r < begin + count; ++r) rows.push_back(hf_row(r, args.head_dim()));
    return rows;
  };
  if (!common::uses_fully_shard(model)) {
    // One process holding the whole model: every tensor read whole.
    std::set<std::string> used;
    auto from_file = [args](const std::string& key, const at::Tensor& t) {
      const int64_t heads = permuted_heads(key, args);
      return heads ? permute_from_hf(t, heads) : t;
    };
    auto r = common::import_whole_model("import_llama", model, files, adapter, options, from_file, nullptr, used);
    // Unexpected tensors: an error on a strict load, as on N ranks (import_safetensors).
    common::finish_whole_import("import_llama", path, files, used, adapter, options, r);
    return r;
  }
  return checkpoint::detail::import_safetensors(model, path, options, adapter);
}

}  // namespace fsdp::models::hf
