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

namespace fsdp::checkpoint::hf::common {
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

std::optional<double> rope_theta(const nlohmann::json& c) {
  std::optional<double> theta;
  if (c.contains("rope_theta") && c["rope_theta"].is_number()) theta = c["rope_theta"].get<double>();
  if (c.contains("rope_parameters") && c["rope_parameters"].is_object() &&
      c["rope_parameters"].contains("rope_theta") && c["rope_parameters"]["rope_theta"].is_number())
    theta = c["rope_parameters"]["rope_theta"].get<double>();
  return theta;
}

nlohmann::json decoder_config_json(const nn::llama::LlamaArgs& a, const std::string& dtype) {
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
  c["tie_word_embeddings"] = a.tie_embeddings;
  c["torch_dtype"] = dtype;
  // transformers >= 5 reads rope_parameters; older versions rope_theta (and rope_scaling).
  c["rope_theta"] = a.rope_theta;
  c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", a.rope_theta}};
  return c;
}

void ConfigCheck::expect_decoder_sizes(const nn::llama::LlamaArgs& a) {
  expect_int("hidden_size", a.dim);
  expect_int("num_hidden_layers", a.n_layers);
  expect_int("num_attention_heads", a.n_heads);
  expect_int("num_key_value_heads", a.kv_heads());
  expect_int("vocab_size", a.vocab_size);
  expect_int("head_dim", a.head_dim());
}

ConfigCheck::ConfigCheck(std::string path, std::string who) : path_(std::move(path)), who_(std::move(who)) {
  try {
    config_ = nlohmann::json::parse(checkpoint::detail::read_small_file(path_, 1 << 24));
  } catch (const std::exception& e) {
    TORCH_CHECK(false, who_, ": ", path_, " is not valid JSON: ", e.what());
  }
}

void ConfigCheck::expect_int(const char* field, int64_t ours) {
  if (!config_.contains(field) || config_[field].is_null()) return;
  if (!config_[field].is_number_integer() || config_[field].get<int64_t>() != ours) {
    bad_.push_back(std::string(field) + " = " + config_[field].dump() + " (the model has " + std::to_string(ours) +
                   ")");
  }
}

void ConfigCheck::expect_rope_theta(double ours) {
  const auto theta = rope_theta(config_);
  if (theta && std::abs(*theta - ours) > 1e-9 * std::abs(ours)) {
    std::ostringstream os;
    os << "rope_theta = " << *theta << " (the model has " << ours << ")";
    bad_.push_back(os.str());
  }
}

void ConfigCheck::finish() const {
  std::ostringstream list;
  for (size_t i = 0; i < bad_.size(); ++i) list << (i ? "; " : "") << bad_[i];
  TORCH_CHECK(bad_.empty(), who_, ": ", path_, " does not describe this model: ", list.str());
}

SafetensorsExportResult write_whole_model(const std::string& dir,
                                          std::vector<std::pair<std::string, at::Tensor>> tensors,
                                          const SafetensorsExportOptions& options, const std::string& config_text) {
  SafetensorsExportResult r;
  for (auto& [name, t] : tensors) {
    t = t.detach().to(at::kCPU);
    if (options.dtype && at::isFloatingType(t.scalar_type())) t = t.to(*options.dtype);
    r.total_bytes += t.nbytes();
  }
  fs::create_directories(dir);
  std::map<std::string, std::string> md = options.metadata;
  md.emplace("format", "pt");
  const std::string file = (fs::path(dir) / "model.safetensors").string();
  safetensors::save_file(file, tensors, md);
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
  if (!reader) reader = std::make_unique<safetensors::Reader>(w->second);
  return reader->read(name);
}

void copy_checked(const char* who, const std::string& file_name, const std::string& key, at::Tensor& param,
                  const at::Tensor& t) {
  TORCH_CHECK(t.sizes() == param.sizes(), who, ": '", file_name, "' has shape ", t.sizes(), " but the model's '", key,
              "' is ", param.sizes());
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
                                              bool model_tied) {
  checkpoint::detail::KeyAdapter adapter;
  adapter.file_name = [who, to_hf, files_have_lm_head](const std::string& key) -> std::optional<std::string> {
    if (key == "output.weight" && !files_have_lm_head) return std::string("model.embed_tokens.weight");  // tied
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

SafetensorsImportResult import_whole_model(const char* who, torch::nn::Module& model, FileTensors& files,
                                           const checkpoint::detail::KeyAdapter& adapter,
                                           const SafetensorsImportOptions& options, const TensorMap& from_file,
                                           const std::function<bool(const std::string&)>& skip,
                                           std::set<std::string>& used) {
  SafetensorsImportResult r;
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
    copy_checked(who, *f, item.key(), item.value(), t);
    r.bytes_read += t.nbytes();
  }
  return r;
}

}  // namespace fsdp::checkpoint::hf::common
