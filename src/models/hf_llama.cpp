// Hugging Face Llama <-> our Llama 3 (see include/fsdp/models/hf_llama.h).
#include <fsdp/models/hf_llama.h>

#include "checkpoint/model_safetensors_impl.h"
#include "checkpoint/storage.h"

#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/llama.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <sstream>

namespace fsdp::checkpoint::hf {
namespace fs = std::filesystem;
namespace llama = fsdp::nn::llama;

namespace {

struct Pair {
  const char* ours;
  const char* hf;
};
const Pair kTop[] = {{"tok_embeddings.weight", "model.embed_tokens.weight"},
                     {"norm.weight", "model.norm.weight"},
                     {"output.weight", "lm_head.weight"}};
const Pair kLayer[] = {{"attention.wq.weight", "self_attn.q_proj.weight"},
                       {"attention.wk.weight", "self_attn.k_proj.weight"},
                       {"attention.wv.weight", "self_attn.v_proj.weight"},
                       {"attention.wo.weight", "self_attn.o_proj.weight"},
                       {"feed_forward.w1.weight", "mlp.gate_proj.weight"},
                       {"feed_forward.w2.weight", "mlp.down_proj.weight"},
                       {"feed_forward.w3.weight", "mlp.up_proj.weight"},
                       {"attention_norm.weight", "input_layernorm.weight"},
                       {"ffn_norm.weight", "post_attention_layernorm.weight"}};

// "<prefix><digits>.<rest>" -> (digits, rest).
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

double number(const nlohmann::json& j) { return j.get<double>(); }

// Checks a Hugging Face config.json against the model (what the weights' shapes cannot show: head counts,
// RoPE base, tied embeddings).
void check_config(const std::string& path, const llama::LlamaArgs& a) {
  nlohmann::json c;
  try {
    c = nlohmann::json::parse(detail::read_small_file(path, 1 << 24));
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "import_llama: ", path, " is not valid JSON: ", e.what());
  }
  std::vector<std::string> bad;
  auto expect_int = [&](const char* field, int64_t ours) {
    if (!c.contains(field) || c[field].is_null()) return;
    if (!c[field].is_number_integer() || c[field].get<int64_t>() != ours) {
      bad.push_back(std::string(field) + " = " + c[field].dump() + " (the model has " + std::to_string(ours) + ")");
    }
  };
  expect_int("hidden_size", a.dim);
  expect_int("num_hidden_layers", a.n_layers);
  expect_int("num_attention_heads", a.n_heads);
  expect_int("num_key_value_heads", a.kv_heads());
  expect_int("vocab_size", a.vocab_size);
  expect_int("intermediate_size", a.ffn_hidden_dim());
  expect_int("head_dim", a.head_dim());
  std::optional<double> theta;
  if (c.contains("rope_theta") && c["rope_theta"].is_number()) theta = number(c["rope_theta"]);
  if (c.contains("rope_parameters") && c["rope_parameters"].is_object() && c["rope_parameters"].contains("rope_theta"))
    theta = number(c["rope_parameters"]["rope_theta"]);
  if (theta && std::abs(*theta - a.rope_theta) > 1e-9 * std::abs(a.rope_theta)) {
    std::ostringstream os;
    os << "rope_theta = " << *theta << " (the model has " << a.rope_theta << ")";
    bad.push_back(os.str());
  }
  // Llama 3.1 RoPE scaling: rope_parameters (transformers >= 5) or rope_scaling, rope_type "llama3".
  nlohmann::json scaling;
  for (const char* field : {"rope_scaling", "rope_parameters"}) {
    if (!c.contains(field) || !c[field].is_object()) continue;
    const auto& r = c[field];
    const std::string type = r.value("rope_type", r.value("type", std::string("default")));
    if (type != "default") scaling = r;
  }
  if (!scaling.is_null()) {
    const std::string type = scaling.value("rope_type", scaling.value("type", std::string()));
    if (type != "llama3") {
      bad.push_back("rope type '" + type + "' (only Llama 3.1's \"llama3\" scaling is supported)");
    } else if (!a.rope_scaling) {
      bad.push_back("Llama 3.1 RoPE scaling (the model has plain RoPE)");
    } else {
      const auto& r = *a.rope_scaling;
      auto near = [](double x, double y) { return std::abs(x - y) <= 1e-9 * std::max(1.0, std::abs(y)); };
      if (!near(number(scaling.value("factor", nlohmann::json(0.0))), r.factor) ||
          !near(number(scaling.value("low_freq_factor", nlohmann::json(0.0))), r.low_freq_factor) ||
          !near(number(scaling.value("high_freq_factor", nlohmann::json(0.0))), r.high_freq_factor) ||
          scaling.value("original_max_position_embeddings", int64_t(0)) != r.original_max_position_embeddings) {
        bad.push_back("RoPE scaling " + scaling.dump() + " (the model's differs)");
      }
    }
  } else if (a.rope_scaling) {
    bad.push_back("plain RoPE (the model has Llama 3.1 RoPE scaling)");
  }
  const bool hf_tied = c.value("tie_word_embeddings", false);
  if (a.tie_embeddings && !hf_tied) bad.push_back("tie_word_embeddings = false (the model ties its embeddings)");
  std::ostringstream list;
  for (size_t i = 0; i < bad.size(); ++i) list << (i ? "; " : "") << bad[i];
  TORCH_CHECK(bad.empty(), "import_llama: ", path, " does not describe this model: ", list.str());
}

}  // namespace

std::optional<std::string> to_hf_name(const std::string& key) {
  for (const auto& p : kTop) {
    if (key == p.ours) return std::string(p.hf);
  }
  if (auto l = split_layer(key, "layers.")) {
    for (const auto& p : kLayer) {
      if (l->second == p.ours) return "model.layers." + l->first + "." + p.hf;
    }
  }
  return std::nullopt;
}

std::optional<std::string> from_hf_name(const std::string& hf_name) {
  for (const auto& p : kTop) {
    if (hf_name == p.hf) return std::string(p.ours);
  }
  if (auto l = split_layer(hf_name, "model.layers.")) {
    for (const auto& p : kLayer) {
      if (l->second == p.hf) return "layers." + l->first + "." + p.ours;
    }
  }
  return std::nullopt;
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
  nlohmann::json c;
  c["architectures"] = {"LlamaForCausalLM"};
  c["model_type"] = "llama";
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
  c["mlp_bias"] = false;
  c["tie_word_embeddings"] = a.tie_embeddings;
  c["torch_dtype"] = dtype;
  // transformers >= 5 reads rope_parameters; older versions rope_theta and rope_scaling.
  c["rope_theta"] = a.rope_theta;
  c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", a.rope_theta}};
  if (a.rope_scaling) {
    const auto& r = *a.rope_scaling;
    nlohmann::json scaling = {{"rope_type", "llama3"},
                              {"factor", r.factor},
                              {"low_freq_factor", r.low_freq_factor},
                              {"high_freq_factor", r.high_freq_factor},
                              {"original_max_position_embeddings", r.original_max_position_embeddings}};
    c["rope_scaling"] = scaling;
    scaling["rope_theta"] = a.rope_theta;
    c["rope_parameters"] = scaling;
  }
  return c.dump(2) + "\n";
}

namespace {
bool uses_fully_shard(torch::nn::Module& model) {
  for (const auto& m : model.modules(/*include_self=*/true)) {
    if (fsdp_module(*m).has_value()) return true;
  }
  return false;
}
}  // namespace

SafetensorsExportResult export_llama(llama::TransformerImpl& model, const std::string& dir,
                                     const SafetensorsExportOptions& options) {
  const llama::LlamaArgs args = model.args();
  if (!uses_fully_shard(model)) {
    // One process holding the whole model (no fully_shard): one model.safetensors + config.json.
    SafetensorsExportResult r;
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& item : model.named_parameters(/*recurse=*/true)) {
      auto hf = to_hf_name(item.key());
      TORCH_CHECK(hf, "export_llama: '", item.key(), "' is not a Llama 3 weight the Hugging Face adapter knows");
      at::Tensor t = item.value().detach().to(at::kCPU);
      if (const int64_t heads = permuted_heads(item.key(), args)) t = permute_to_hf(t, heads);
      if (options.dtype && at::isFloatingType(t.scalar_type())) t = t.to(*options.dtype);
      r.total_bytes += t.nbytes();
      tensors.emplace_back(*hf, t);
    }
    fs::create_directories(dir);
    std::map<std::string, std::string> md = options.metadata;
    md.emplace("format", "pt");
    const std::string file = (fs::path(dir) / "model.safetensors").string();
    safetensors::save_file(file, tensors, md);
    std::string dtype = options.dtype == c10::kBFloat16 ? "bfloat16" : options.dtype == c10::kHalf ? "float16" : "float32";
    detail::write_file_atomic((fs::path(dir) / "config.json").string(), config_json(args, dtype));
    r.files = {file, (fs::path(dir) / "config.json").string()};
    return r;
  }
  detail::KeyAdapter adapter;
  adapter.file_name = [](const std::string& key) {
    auto hf = to_hf_name(key);
    TORCH_CHECK(hf, "export_llama: '", key, "' is not a Llama 3 weight the Hugging Face adapter knows");
    return hf;
  };
  adapter.to_file = [args](const std::string& key, const at::Tensor& full) {
    const int64_t heads = permuted_heads(key, args);
    return heads ? permute_to_hf(full, heads) : full;
  };
  std::string dtype = "float32";
  if (options.dtype == c10::kBFloat16) dtype = "bfloat16";
  else if (options.dtype == c10::kHalf) dtype = "float16";
  adapter.extra_files.emplace_back("config.json", config_json(args, dtype));
  return detail::export_safetensors(model, dir, options, adapter);
}

SafetensorsImportResult import_llama(llama::TransformerImpl& model, const std::string& path,
                                     const SafetensorsImportOptions& options) {
  const llama::LlamaArgs args = model.args();
  const fs::path dir = fs::is_directory(path) ? fs::path(path) : fs::path(path).parent_path();
  if (fs::is_regular_file(dir / "config.json")) check_config((dir / "config.json").string(), args);
  const auto where = detail::resolve_files(path);
  const bool has_lm_head = where.count("lm_head.weight") > 0;
  detail::KeyAdapter adapter;
  adapter.file_name = [has_lm_head](const std::string& key) -> std::optional<std::string> {
    if (key == "output.weight" && !has_lm_head) return std::string("model.embed_tokens.weight");  // tied checkpoint
    auto hf = to_hf_name(key);
    TORCH_CHECK(hf, "import_llama: '", key, "' is not a Llama 3 weight the Hugging Face adapter knows");
    return hf;
  };
  adapter.file_rows = [args](const std::string& key, int64_t begin, int64_t count) {
    std::vector<int64_t> rows;
    if (!permuted_heads(key, args)) return rows;
    for (int64_t r = begin; r < begin + count; ++r) rows.push_back(hf_row(r, args.head_dim()));
    return rows;
  };
  if (!uses_fully_shard(model)) {
    // One process holding the whole model: every tensor read whole.
    SafetensorsImportResult r;
    c10::NoGradGuard no_grad;
    for (auto& item : model.named_parameters(/*recurse=*/true)) {
      auto f = adapter.file_name(item.key());
      auto w = where.find(*f);
      if (w == where.end()) {
        TORCH_CHECK(!options.strict, "import_llama from ", path, ": '", *f, "' (for '", item.key(), "') is missing");
        r.missing.push_back(*f);
        continue;
      }
      at::Tensor t = safetensors::Reader(w->second).read(*f);
      if (const int64_t heads = permuted_heads(item.key(), args)) t = permute_from_hf(t, heads);
      TORCH_CHECK(t.sizes() == item.value().sizes(), "import_llama: '", *f, "' has shape ", t.sizes(),
                  " but the model's '", item.key(), "' is ", item.value().sizes());
      item.value().copy_(t);
      r.bytes_read += t.nbytes();
    }
    return r;
  }
  const bool tied = args.tie_embeddings;
  adapter.ignorable = [tied](const std::string& name) {
    const std::string inv = "rotary_emb.inv_freq";
    if (name.size() >= inv.size() && name.compare(name.size() - inv.size(), inv.size(), inv) == 0) return true;
    return tied && name == "lm_head.weight";
  };
  return detail::import_safetensors(model, path, options, adapter);
}

}  // namespace fsdp::checkpoint::hf
