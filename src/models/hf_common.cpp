// Shared pieces of the Hugging Face adapters (see hf_common.h).
#include "models/hf_common.h"

#include <fsdp/models/llama.h>

#include "checkpoint/model_safetensors_impl.h"
#include "checkpoint/storage.h"

#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/fully_shard.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <filesystem>
#include <sstream>

namespace fsdp::models::hf::common {
namespace fs = std::filesystem;

const std::vector<NamePair>& top_names() {
  static const std::vector<NamePair> names = {{"tok_embeddings.weight", "model.embed_tokens.weight"},
                                              {"norm.weight", "model.norm.weight"},
                                              {"output.weight", "lm_head.weight"}};
  return names;
}

const std::vector<NamePair>& layer_names() {
  static const std::vector<NamePair> names = {{"attention.wq.weight", "self_attn.q_proj.weight"},
                                              {"attention.wk.weight", "self_attn.k_proj.weight"},
                                              {"attention.wv.weight", "self_attn.v_proj.weight"},
                                              {"attention.wo.weight", "self_attn.o_proj.weight"},
                                              {"feed_forward.w1.weight", "mlp.gate_proj.weight"},
                                              {"feed_forward.w2.weight", "mlp.down_proj.weight"},
                                              {"feed_forward.w3.weight", "mlp.up_proj.weight"},
                                              {"attention_norm.weight", "input_layernorm.weight"},
                                              {"ffn_norm.weight", "post_attention_layernorm.weight"}};
  return names;
}

std::optional<std::pair<std::string, std::string>> split_layer(const std::string& key, const std::string& prefix) {
  if (key.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  const size_t dot = key.find('.', prefix.size());
  if (dot == std::string::npos || dot == prefix.size()) return std::nullopt;
  const std::string idx = key.substr(prefix.size(), dot - prefix.size());
  for (char c : idx) {
    if (c < '0' || c > '9') return std::nullopt;
  }
  return std::make_pair(idx, key.substr(dot + 1));
}

namespace {
std::optional<std::string> rename(const std::string& name, const std::vector<NamePair>& top,
                                  const std::vector<NamePair>& layers, bool to_hf) {
  for (const auto& p : top) {
    if (name == (to_hf ? p.ours : p.hf)) return std::string(to_hf ? p.hf : p.ours);
  }
  if (auto l = split_layer(name, to_hf ? "layers." : "model.layers.")) {
    for (const auto& p : layers) {
      if (l->second == (to_hf ? p.ours : p.hf)) {
        return (to_hf ? "model.layers." : "layers.") + l->first + "." + (to_hf ? p.hf : p.ours);
      }
    }
  }
  return std::nullopt;
}
}  // namespace

std::optional<std::string> to_hf(const std::string& key, const std::vector<NamePair>& top,
                                 const std::vector<NamePair>& layers) {
  return rename(key, top, layers, /*to_hf=*/true);
}

std::optional<std::string> from_hf(const std::string& hf_name, const std::vector<NamePair>& top,
                                   const std::vector<NamePair>& layers) {
  return rename(hf_name, top, layers, /*to_hf=*/false);
}

bool uses_fully_shard(torch::nn::Module& model) {
  for (const auto& m : model.modules(/*include_self=*/true)) {
    if (fsdp_module(*m).has_value()) return true;
  }
  return false;
}

std::string dtype_name(const std::optional<c10::ScalarType>& dtype) {
  if (dtype == c10::kBFloat16) return "bfloat16";
  if (dtype == c10::kHalf) return "float16";
  return "float32";
}

nlohmann::json decoder_config_json(const models::llama::LlamaArgs& a, const std::string& dtype) {
  nlohmann::json c;
  c["hidden_size"] = a.dim;
  c["intermediate_size"] = a.ffn_hidden_dim();
  c["num_hidden_layers"] = a.n_layers;
  c["num_attention_heads"] = a.n_heads;
  c["num_key_value_heads"] = a.kv_heads();
  c["head_dim"] = a.head_dim();
  c["vocab_size"] = a.vocab_size;
  c["rms_norm_eps"] = a.norm_eps;
  c["max_position_embeddings"] = a.max_seq_len;
  c["hidden_act"] = "silu";
  c["attention_bias"] = false;
  c["attention_dropout"] = 0.0;
  c["tie_word_embeddings"] = a.tie_embeddings;
  c["torch_dtype"] = dtype;
  // transformers >= 5 reads rope_parameters; older versions rope_theta and rope_scaling. transformers 5 also
  // reads rope_scaling (it then replaces rope_parameters, taking rope_theta from the top level): both agree.
  c["rope_theta"] = a.rope_theta;
  nlohmann::json rope = {{"rope_type", "default"}};
  if (a.rope_scaling) {
    const auto& r = *a.rope_scaling;
    rope = {{"rope_type", models::llama::rope_type_name(r.type)}, {"factor", r.factor}};
    if (r.type == models::llama::RopeScaling::Type::Llama3) {
      rope["low_freq_factor"] = r.low_freq_factor;
      rope["high_freq_factor"] = r.high_freq_factor;
    } else if (r.type == models::llama::RopeScaling::Type::Yarn) {
      rope["beta_fast"] = r.beta_fast;
      rope["beta_slow"] = r.beta_slow;
      rope["truncate"] = r.truncate;
      if (r.attention_factor) rope["attention_factor"] = *r.attention_factor;
      if (r.mscale) rope["mscale"] = *r.mscale;
      if (r.mscale_all_dim) rope["mscale_all_dim"] = *r.mscale_all_dim;
    }
    if (r.type != models::llama::RopeScaling::Type::Linear) {
      rope["original_max_position_embeddings"] = r.original_max_position_embeddings;
    }
    c["rope_scaling"] = rope;
  }
  rope["rope_theta"] = a.rope_theta;
  c["rope_parameters"] = rope;
  return c;
}

checkpoint::SafetensorsExportResult write_whole_model(const std::string& dir,
                                          std::vector<std::pair<std::string, at::Tensor>> tensors,
                                          const checkpoint::SafetensorsExportOptions& options, const std::string& config_text) {
  checkpoint::SafetensorsExportResult r;
  for (auto& [name, t] : tensors) {
    t = t.detach().to(at::kCPU);
    if (options.dtype && at::isFloatingType(t.scalar_type())) t = t.to(*options.dtype);
    r.total_bytes += t.nbytes();
  }
  fs::create_directories(dir);
  std::map<std::string, std::string> md = options.metadata;
  md.emplace("format", "pt");
  const std::string file = (fs::path(dir) / "model.safetensors").string();
  checkpoint::safetensors::save_file(file, tensors, md);
  const std::string config = (fs::path(dir) / "config.json").string();
  checkpoint::detail::write_file_atomic(config, config_text);
  r.files = {file, config};
  return r;
}

FileTensors::FileTensors(const std::string& path) : path_(path), where_(checkpoint::detail::resolve_files(path)) {}
FileTensors::~FileTensors() = default;

at::Tensor FileTensors::read(const std::string& name) {
  auto w = where_.find(name);
  TORCH_CHECK(w != where_.end(), "'", name, "' is not in ", path_);
  auto& reader = readers_[w->second];
  if (!reader) reader = std::make_unique<checkpoint::safetensors::Reader>(w->second);
  return reader->read(name);
}

std::string FileTensors::file_of(const std::string& name) const {
  auto w = where_.find(name);
  return w == where_.end() ? path_ : w->second;
}

void copy_checked(const char* who, const std::string& file_name, const std::string& file, const std::string& key,
                  at::Tensor& param, const at::Tensor& t) {
  checkpoint::detail::check_loadable_dtype(who, file_name, file, t.scalar_type(), key, param.scalar_type());
  TORCH_CHECK(t.sizes() == param.sizes(), who, ": '", file_name, "' in ", file, " has shape ", t.sizes(),
              " but the model's '", key, "' is ", param.sizes());
  c10::NoGradGuard no_grad;
  param.copy_(t);
}

std::vector<std::pair<std::string, at::Tensor>> whole_model_tensors(const char* who, torch::nn::Module& model,
                                                                    const KeyToFile& to_hf, const TensorMap& to_file,
                                                                    const std::function<bool(const std::string&)>& skip) {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    if (skip && skip(item.key())) continue;
    auto hf = to_hf(item.key());
    TORCH_CHECK(hf, who, ": '", item.key(), "' is not a weight the Hugging Face adapter knows");
    at::Tensor t = item.value().detach().to(at::kCPU);
    if (to_file) t = to_file(item.key(), t);
    tensors.emplace_back(*hf, t);
  }
  return tensors;
}

checkpoint::detail::KeyAdapter import_adapter(const char* who, const KeyToFile& to_hf, bool files_have_lm_head,
                                              bool model_tied, bool lm_head_from_embeddings) {
  checkpoint::detail::KeyAdapter adapter;
  adapter.file_name = [who, to_hf, files_have_lm_head,
                       lm_head_from_embeddings](const std::string& key) -> std::optional<std::string> {
    if (key == "output.weight" && !files_have_lm_head && lm_head_from_embeddings) {
      return std::string("model.embed_tokens.weight");  // a tied checkpoint
    }
    auto hf = to_hf(key);
    TORCH_CHECK(hf, who, ": '", key, "' is not a weight the Hugging Face adapter knows");
    return hf;
  };
  adapter.ignorable = [model_tied](const std::string& name) {
    const std::string inv = "rotary_emb.inv_freq";
    if (name.size() >= inv.size() && name.compare(name.size() - inv.size(), inv.size(), inv) == 0) return true;
    return model_tied && name == "lm_head.weight";
  };
  return adapter;
}

checkpoint::SafetensorsImportResult import_whole_model(const char* who, torch::nn::Module& model, FileTensors& files,
                                           const checkpoint::detail::KeyAdapter& adapter,
                                           const checkpoint::SafetensorsImportOptions& options, const TensorMap& from_file,
                                           const std::function<bool(const std::string&)>& skip,
                                           std::set<std::string>& used) {
  checkpoint::SafetensorsImportResult r;
  for (auto& item : model.named_parameters(/*recurse=*/true)) {
    if (skip && skip(item.key())) continue;
    auto f = adapter.file_name(item.key());
    if (!f) continue;
    if (!files.has(*f)) {
      TORCH_CHECK(!options.strict, who, " from ", files.path(), ": '", *f, "' (for '", item.key(), "') is missing");
      r.missing.push_back(*f);
      continue;
    }
    at::Tensor t = files.read(*f);
    used.insert(*f);
    if (from_file) t = from_file(item.key(), t);
    copy_checked(who, *f, files.file_of(*f), item.key(), item.value(), t);
    r.bytes_read += t.nbytes();
  }
  return r;
}

void append_stacked_experts(std::vector<std::pair<std::string, at::Tensor>>& tensors, const std::string& prefix,
                            const models::moe::GroupedExpertsImpl& e) {
  tensors.emplace_back(prefix + "gate_up_proj", at::cat({e.w1.detach(), e.w3.detach()}, /*dim=*/1));
  tensors.emplace_back(prefix + "down_proj", e.w2.detach());
}

bool import_experts(const char* who, FileTensors& files, const std::string& prefix, const std::string& ours,
                    models::moe::GroupedExpertsImpl& e, std::set<std::string>& used, checkpoint::SafetensorsImportResult& r) {
  auto read = [&](const std::string& name) {
    used.insert(name);
    at::Tensor t = files.read(name);
    r.bytes_read += t.nbytes();
    return t;
  };
  const int64_t E = e.w1.size(0), F = e.w1.size(1), D = e.w1.size(2);
  at::Tensor w1, w2, w3;
  if (files.has(prefix + "gate_up_proj")) {
    TORCH_CHECK(files.has(prefix + "down_proj"), who, " from ", files.path(), ": '", prefix, "down_proj' (for '", ours,
                ".w2') is missing next to its gate_up_proj");
    const at::Tensor gate_up = read(prefix + "gate_up_proj");
    TORCH_CHECK(gate_up.sizes() == at::IntArrayRef({E, 2 * F, D}), who, ": '", prefix, "gate_up_proj' in ",
                files.file_of(prefix + "gate_up_proj"), " has shape ", gate_up.sizes(), " but the model's '", ours,
                ".w1' and '.w3' need [", E, ", ", 2 * F, ", ", D, "] (experts, 2 x moe_intermediate_size, hidden)");
    w1 = gate_up.narrow(1, 0, F);
    w3 = gate_up.narrow(1, F, F);
    w2 = read(prefix + "down_proj");
  } else if (files.has(prefix + "0.gate_proj.weight")) {
    std::vector<at::Tensor> gates, ups, downs;
    for (int64_t j = 0; j < E; ++j) {
      const std::string p = prefix + std::to_string(j) + ".";
      for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
        TORCH_CHECK(files.has(p + proj + ".weight"), who, " from ", files.path(), ": '", p, proj, ".weight' (expert ",
                    j, " of ", E, " for '", ours, "') is missing");
      }
      // Each expert's tensor checked before they are stacked (at::stack would name neither tensor nor file, and
      // would promote one integer expert among floating ones silently).
      auto expert = [&](const std::string& name, const at::Tensor& param, std::vector<int64_t> shape) {
        at::Tensor t = read(name);
        checkpoint::detail::check_loadable_dtype(who, name, files.file_of(name), t.scalar_type(), ours,
                                                 param.scalar_type());
        TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), who, ": '", name, "' in ", files.file_of(name), " has shape ",
                    t.sizes(), " but is expert ", j, " of the model's '", ours, "' (", param.sizes(), "): expected ",
                    at::IntArrayRef(shape));
        return t;
      };
      gates.push_back(expert(p + "gate_proj.weight", e.w1, {F, D}));
      ups.push_back(expert(p + "up_proj.weight", e.w3, {F, D}));
      downs.push_back(expert(p + "down_proj.weight", e.w2, {D, F}));
    }
    TORCH_CHECK(!files.has(prefix + std::to_string(E) + ".gate_proj.weight"), who, " from ", files.path(),
                ": the files hold more than the model's ", E, " experts for '", ours, "' ('", prefix, E,
                ".gate_proj.weight')");
    w1 = at::stack(gates), w3 = at::stack(ups), w2 = at::stack(downs);
  } else {
    return false;
  }
  copy_checked(who, prefix + "(gate)", files.path(), ours + ".w1", e.w1, w1);
  copy_checked(who, prefix + "(up)", files.path(), ours + ".w3", e.w3, w3);
  copy_checked(who, prefix + "down_proj", files.path(), ours + ".w2", e.w2, w2);
  return true;
}

bool is_expert_key(const std::string& key) {
  auto l = split_layer(key, "layers.");
  return l && l->second.compare(0, 12, "moe.experts.") == 0;
}

bool is_expert_bias_key(const std::string& key) {
  auto l = split_layer(key, "layers.");
  return l && l->second == "moe.expert_bias";
}

std::string experts_prefix(int64_t layer) { return "model.layers." + std::to_string(layer) + ".mlp.experts."; }

std::function<std::optional<checkpoint::detail::FileSlice>(const std::string&)> stacked_expert_slices(
    int64_t expert_hidden) {
  const int64_t F = expert_hidden;
  return [F](const std::string& key) -> std::optional<checkpoint::detail::FileSlice> {
    auto l = split_layer(key, "layers.");
    if (!l || l->second.compare(0, 12, "moe.experts.") != 0) return std::nullopt;
    const std::string prefix = "model.layers." + l->first + ".mlp.experts.";
    if (l->second == "moe.experts.w1") return checkpoint::detail::FileSlice{prefix + "gate_up_proj", 1, 0};
    if (l->second == "moe.experts.w3") return checkpoint::detail::FileSlice{prefix + "gate_up_proj", 1, F};
    if (l->second == "moe.experts.w2") return checkpoint::detail::FileSlice{prefix + "down_proj", 0, 0};
    return std::nullopt;
  };
}

checkpoint::SafetensorsExportResult export_sharded(const char* who, torch::nn::Module& model, const std::string& dir,
                                       const checkpoint::SafetensorsExportOptions& options, const KeyToFile& to_hf,
                                       const std::function<bool(const std::string&)>& skip, int64_t expert_hidden,
                                       const std::string& config_text,
                                       std::vector<std::pair<std::string, at::Tensor>> extra_tensors) {
  checkpoint::detail::KeyAdapter adapter;
  adapter.file_name = [who, to_hf, skip](const std::string& key) -> std::optional<std::string> {
    if (skip && skip(key)) return std::nullopt;
    auto hf = to_hf(key);
    TORCH_CHECK(hf, who, ": '", key, "' is not a weight the Hugging Face adapter knows");
    return hf;
  };
  if (expert_hidden > 0) adapter.file_slice = stacked_expert_slices(expert_hidden);
  adapter.extra_tensors = std::move(extra_tensors);
  adapter.extra_files.emplace_back("config.json", config_text);
  return checkpoint::detail::export_safetensors(model, dir, options, adapter);
}

checkpoint::SafetensorsImportResult import_sharded(const char* who, torch::nn::Module& model, const FileTensors& files,
                                       checkpoint::detail::KeyAdapter adapter, const checkpoint::SafetensorsImportOptions& options,
                                       const std::function<bool(const std::string&)>& skip,
                                       const std::vector<int64_t>& moe_layers, int64_t expert_hidden) {
  // Per layer, the experts' layout in the files: transformers 5's stacked tensors (each rank reads its rows of
  // them), or one tensor per expert and projection (save_pretrained's, the hub's: each rank reads its experts').
  std::set<std::string> per_expert;  // layer ids
  for (int64_t layer : moe_layers) {
    const std::string prefix = experts_prefix(layer);
    if (!files.has(prefix + "gate_up_proj") && files.has(prefix + "0.gate_proj.weight")) {
      per_expert.insert(std::to_string(layer));
    }
  }
  if (!moe_layers.empty()) adapter.file_slice = stacked_expert_slices(expert_hidden);
  if (!per_expert.empty()) {
    adapter.file_stack = [per_expert](const std::string& key, int64_t experts) {
      std::vector<std::string> names;
      auto l = split_layer(key, "layers.");
      if (!l || !per_expert.count(l->first)) return names;
      const char* proj = l->second == "moe.experts.w1"   ? "gate_proj"
                         : l->second == "moe.experts.w3" ? "up_proj"
                         : l->second == "moe.experts.w2" ? "down_proj"
                                                         : nullptr;
      if (!proj) return names;
      const std::string prefix = "model.layers." + l->first + ".mlp.experts.";
      for (int64_t j = 0; j < experts; ++j) names.push_back(prefix + std::to_string(j) + "." + proj + ".weight");
      return names;
    };
  }
  if (skip) {
    adapter.file_name = [name = adapter.file_name, skip](const std::string& key) -> std::optional<std::string> {
      return skip(key) ? std::nullopt : name(key);
    };
  }
  return checkpoint::detail::import_safetensors(model, files.path(), options, adapter);
}

void finish_whole_import(const char* who, const std::string& path, const FileTensors& files,
                         const std::set<std::string>& used, const checkpoint::detail::KeyAdapter& adapter,
                         const checkpoint::SafetensorsImportOptions& options, checkpoint::SafetensorsImportResult& r) {
  for (const auto& [name, file] : files.where()) {
    if (!used.count(name) && !(adapter.ignorable && adapter.ignorable(name))) r.unexpected.push_back(name);
  }
  if (options.strict && !r.unexpected.empty()) {
    std::string list;
    for (size_t i = 0; i < r.unexpected.size() && i < 20; ++i) list += (i ? ", '" : "'") + r.unexpected[i] + "'";
    if (r.unexpected.size() > 20) list += ", ... (" + std::to_string(r.unexpected.size()) + " in all)";
    TORCH_CHECK(false, who, " from ", path, ": the files hold tensors the model does not have (strict load): ", list);
  }
}

void check_lm_head(const char* who, const std::string& path, bool files_have_lm_head, bool config_tied,
                   const models::llama::LlamaArgs& model, const checkpoint::SafetensorsImportOptions& options) {
  if (files_have_lm_head || config_tied || model.tie_embeddings) return;
  TORCH_CHECK(!options.strict, who, " from ", path, ": config.json says tie_word_embeddings = false but the files ",
              "hold no 'lm_head.weight' (the output layer's weights are missing; transformers would initialise ",
              "them randomly)");
}

}  // namespace fsdp::models::hf::common
