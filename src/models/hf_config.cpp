// Hugging Face config.json -> our args (see include/fsdp/models/hf_config.h and docs/interop.md "config.json
// fields"): every field that changes transformers' computation is mapped or refused by name. The rules follow
// transformers 5.24 (configuration_{llama,qwen3,qwen3_moe}.py for the defaults, modeling_rope_utils.py for
// RoPE: standardize_rope_params, _compute_{linear_scaling,llama3,yarn}_parameters).
#include <fsdp/models/hf_config.h>

#include "checkpoint/storage.h"
#include "models/hf_common.h"

#include <fsdp/models/hf_llama.h>
#include <fsdp/models/hf_qwen3.h>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <type_traits>
#include <filesystem>
#include <set>
#include <sstream>

namespace fsdp::models::hf {
namespace fs = std::filesystem;
namespace llama = fsdp::models::llama;

namespace common {

namespace {

const char* kind_of(const nlohmann::json& v) {
  switch (v.type()) {
    case nlohmann::json::value_t::null: return "null";
    case nlohmann::json::value_t::boolean: return "a boolean";
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned: return "an integer";
    case nlohmann::json::value_t::number_float: return "a number";
    case nlohmann::json::value_t::string: return "a string";
    case nlohmann::json::value_t::array: return "an array";
    case nlohmann::json::value_t::object: return "an object";
    default: return "a value";
  }
}

std::string number_text(double v) {
  std::ostringstream os;
  os.precision(10);
  os << v;
  return os.str();
}

}  // namespace

std::string excerpt(const nlohmann::json& v) {
  // Scalars are printed (strings cut), containers only described: dump() of a large or deep value would be
  // unbounded (and recursive).
  if (v.is_string()) {
    const auto& s = v.get_ref<const std::string&>();
    std::string out;
    for (size_t i = 0; i < s.size() && i < 60; ++i) out += (s[i] >= 0x20 && s[i] < 0x7f && s[i] != '"') ? s[i] : '?';
    return "\"" + out + (s.size() > 60 ? "...\"" : "\"");
  }
  if (v.is_array()) return "an array of " + std::to_string(v.size()) + " elements";
  if (v.is_object()) return "an object of " + std::to_string(v.size()) + " fields";
  if (v.is_number_float()) return number_text(v.get<double>());
  return v.dump();  // null, boolean, integer: short
}

ConfigJson::ConfigJson(std::string path, std::string who) : path_(std::move(path)), who_(std::move(who)) {
  std::string text;
  try {
    text = checkpoint::detail::read_small_file(path_, kMaxConfigBytes);
  } catch (const c10::Error& e) {
    fail(std::string("cannot be read within ") + std::to_string(kMaxConfigBytes) + " bytes: " +
         e.what_without_backtrace());
  } catch (const std::exception& e) {
    fail(std::string("cannot be read: ") + e.what());
  }
  // The nesting depth is bounded while parsing (a callback sees each level as it opens), so no deeply nested
  // value is ever built, printed or destroyed recursively.
  const nlohmann::json::parser_callback_t bound = [](int depth, nlohmann::json::parse_event_t event,
                                                     nlohmann::json&) {
    if ((event == nlohmann::json::parse_event_t::object_start ||
         event == nlohmann::json::parse_event_t::array_start) &&
        depth >= kMaxConfigDepth) {
      throw std::length_error("nesting");
    }
    return true;
  };
  try {
    root_ = nlohmann::json::parse(text, bound);
  } catch (const std::length_error&) {
    fail("arrays/objects are nested more than " + std::to_string(kMaxConfigDepth) + " deep (the limit)");
  } catch (const nlohmann::json::exception& e) {
    fail(std::string("is not valid JSON: ") + e.what());
  }
  if (!root_.is_object()) fail(std::string("must hold a JSON object, not ") + kind_of(root_));
}

void ConfigJson::fail(const std::string& what) const { TORCH_CHECK(false, who_, ": ", path_, ": ", what); }

bool ConfigJson::has(const nlohmann::json& obj, const char* field) {
  return obj.is_object() && obj.contains(field) && !obj[field].is_null();
}

const nlohmann::json& ConfigJson::value(const char* field, const nlohmann::json* obj, const std::string& where,
                                        const char* kind) const {
  const nlohmann::json& o = obj ? *obj : root_;
  if (!has(o, field)) fail("field '" + where + field + "' is missing (required: " + kind + ")");
  return o[field];
}

int64_t ConfigJson::get_int(const char* field, std::optional<int64_t> fallback, const nlohmann::json* obj,
                            const std::string& where) const {
  if (!has(obj ? *obj : root_, field) && fallback) return *fallback;
  const auto& v = value(field, obj, where, "an integer");
  // Every integer of a config.json is a count, size or index: bounded, so that no product of them overflows.
  constexpr int64_t kMax = int64_t{1} << 31;
  const bool in_range = v.is_number_unsigned() ? v.get<uint64_t>() <= static_cast<uint64_t>(kMax)
                                               : v.is_number_integer() && v.get<int64_t>() >= -kMax && v.get<int64_t>() <= kMax;
  if (v.is_number_integer() && !in_range) {
    fail("field '" + where + field + "' = " + excerpt(v) + " is out of range (|value| <= 2^31)");
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  fail("field '" + where + field + "' must be an integer, got " + kind_of(v) + " " + excerpt(v));
}

double ConfigJson::get_number(const char* field, std::optional<double> fallback, const nlohmann::json* obj,
                              const std::string& where) const {
  if (!has(obj ? *obj : root_, field) && fallback) return *fallback;
  const auto& v = value(field, obj, where, "a number");
  if (!v.is_number()) fail("field '" + where + field + "' must be a number, got " + kind_of(v) + " " + excerpt(v));
  const double d = v.get<double>();
  if (!std::isfinite(d)) fail("field '" + where + field + "' must be finite");
  return d;
}

bool ConfigJson::get_bool(const char* field, std::optional<bool> fallback, const nlohmann::json* obj,
                          const std::string& where) const {
  if (!has(obj ? *obj : root_, field) && fallback) return *fallback;
  const auto& v = value(field, obj, where, "true or false");
  if (!v.is_boolean()) fail("field '" + where + field + "' must be true or false, got " + kind_of(v) + " " + excerpt(v));
  return v.get<bool>();
}

std::string ConfigJson::get_string(const char* field, std::optional<std::string> fallback, const nlohmann::json* obj,
                                   const std::string& where) const {
  if (!has(obj ? *obj : root_, field) && fallback) return *fallback;
  const auto& v = value(field, obj, where, "a string");
  if (!v.is_string()) fail("field '" + where + field + "' must be a string, got " + kind_of(v) + " " + excerpt(v));
  return v.get<std::string>();
}

namespace {

// A field that must hold one value for our model to compute what transformers computes.
template <typename T>
void require(const ConfigJson& c, const std::string& field, const T& got, const T& supported, const std::string& why) {
  if (got == supported) return;
  std::ostringstream os;
  os << "field '" << field << "' = ";
  if constexpr (std::is_same_v<T, bool>) os << (got ? "true" : "false");
  else if constexpr (std::is_same_v<T, std::string>) os << excerpt(nlohmann::json(got));
  else os << got;
  os << " is not supported (" << why << ")";
  c.fail(os.str());
}

int64_t positive(const ConfigJson& c, const char* field, std::optional<int64_t> fallback = std::nullopt) {
  const int64_t v = c.get_int(field, fallback);
  if (v <= 0) c.fail("field '" + std::string(field) + "' = " + std::to_string(v) + " must be positive");
  return v;
}

// RoPE, as transformers 5 standardizes it: a non-empty top-level rope_scaling replaces rope_parameters
// (convert_rope_params_to_dict), rope_theta comes from the dict, else the top level, else 10000; llama3/yarn
// take original_max_position_embeddings from the dict, else max_position_embeddings.
void parse_rope(const ConfigJson& c, llama::LlamaArgs& a) {
  const nlohmann::json& root = c.root();
  for (const char* field : {"rope_scaling", "rope_parameters"}) {
    if (ConfigJson::has(root, field) && !root[field].is_object()) {
      c.fail("field '" + std::string(field) + "' must be an object or null, got " + kind_of(root[field]) + " " +
             excerpt(root[field]));
    }
  }
  const bool scaling_form = ConfigJson::has(root, "rope_scaling") && !root["rope_scaling"].empty();
  const std::string form = scaling_form ? "rope_scaling" : "rope_parameters";
  const nlohmann::json rope = ConfigJson::has(root, form.c_str()) ? root[form] : nlohmann::json::object();
  const std::string where = form + ".";
  const double top_theta = c.get_number("rope_theta", 10000.0);
  a.rope_theta = c.get_number("rope_theta", top_theta, &rope, where);
  if (!(a.rope_theta > 1)) c.fail("field '" + where + "rope_theta' = " + number_text(a.rope_theta) + " must be > 1");
  if (scaling_form && ConfigJson::has(root, "rope_parameters") && !ConfigJson::has(rope, "rope_theta")) {
    // transformers 5 then drops rope_parameters' rope_theta silently (and uses the top level's or 10000).
    const double dropped = c.get_number("rope_theta", a.rope_theta, &root["rope_parameters"], "rope_parameters.");
    if (dropped != a.rope_theta) {
      c.fail("rope_scaling replaces rope_parameters (as transformers 5 reads it), so rope_parameters.rope_theta = " +
             number_text(dropped) + " is not used and RoPE would use rope_theta = " + number_text(a.rope_theta) +
             "; put the scaling into rope_parameters or add \"rope_theta\" to rope_scaling");
    }
  }
  for (const nlohmann::json* o : {&root, &rope}) {
    const std::string w = o == &root ? "" : where;
    if (ConfigJson::has(*o, "partial_rotary_factor")) {
      const double f = c.get_number("partial_rotary_factor", std::nullopt, o, w);
      require(c, w + "partial_rotary_factor", f, 1.0, "RoPE rotates every dimension of a head");
    }
  }
  std::string type = c.get_string("type", "default", &rope, where);
  type = c.get_string("rope_type", type, &rope, where);
  a.rope_scaling.reset();
  if (type == "default") return;
  llama::RopeScaling s;
  if (type == "llama3") {
    s.type = llama::RopeScaling::Type::Llama3;
  } else if (type == "yarn") {
    s.type = llama::RopeScaling::Type::Yarn;
  } else if (type == "linear") {
    s.type = llama::RopeScaling::Type::Linear;
  } else {
    c.fail("field '" + where + "rope_type' = " + excerpt(nlohmann::json(type)) +
           " is not supported (supported: \"default\", \"linear\", \"llama3\", \"yarn\")");
  }
  const int64_t max_pos = c.get_int("max_position_embeddings", a.max_seq_len);
  // transformers (Llama, Qwen3): the dict's, else max_position_embeddings (a top-level one is Phi-3's layout,
  // not read by these configuration classes).
  s.original_max_position_embeddings = c.get_int("original_max_position_embeddings", max_pos, &rope, where);
  if (s.original_max_position_embeddings <= 0) {
    c.fail("field '" + where + "original_max_position_embeddings' = " +
           std::to_string(s.original_max_position_embeddings) + " must be positive");
  }
  if (s.type == llama::RopeScaling::Type::Yarn && rope.contains("factor") && rope["factor"].is_null()) {
    // "factor": null, as transformers reads it (DeepSeek-V3's convention): the ratio of the two lengths. An
    // absent factor is an error there and here.
    s.factor = static_cast<double>(max_pos) / static_cast<double>(s.original_max_position_embeddings);
  } else {
    s.factor = c.get_number("factor", std::nullopt, &rope, where);
  }
  if (!(s.factor > 0)) c.fail("field '" + where + "factor' = " + number_text(s.factor) + " must be positive");
  if (s.type == llama::RopeScaling::Type::Llama3) {
    s.low_freq_factor = c.get_number("low_freq_factor", std::nullopt, &rope, where);
    s.high_freq_factor = c.get_number("high_freq_factor", std::nullopt, &rope, where);
    if (!(s.high_freq_factor > s.low_freq_factor) || !(s.low_freq_factor > 0)) {
      c.fail("fields '" + where + "low_freq_factor' = " + number_text(s.low_freq_factor) + " and 'high_freq_factor' = " +
             number_text(s.high_freq_factor) + " must satisfy 0 < low < high");
    }
  } else if (s.type == llama::RopeScaling::Type::Yarn) {
    // transformers: `get("beta_fast") or 32`: 0 and null mean the default too.
    s.beta_fast = c.get_number("beta_fast", 32.0, &rope, where);
    s.beta_slow = c.get_number("beta_slow", 1.0, &rope, where);
    if (s.beta_fast == 0) s.beta_fast = 32.0;
    if (s.beta_slow == 0) s.beta_slow = 1.0;
    if (!(s.beta_fast > 0) || !(s.beta_slow > 0)) {
      c.fail("fields '" + where + "beta_fast' = " + number_text(s.beta_fast) + " and 'beta_slow' = " +
             number_text(s.beta_slow) + " must be positive");
    }
    s.truncate = c.get_bool("truncate", true, &rope, where);
    if (ConfigJson::has(rope, "attention_factor")) {
      s.attention_factor = c.get_number("attention_factor", std::nullopt, &rope, where);
      if (!(*s.attention_factor > 0)) c.fail("field '" + where + "attention_factor' must be positive");
    }
    if (ConfigJson::has(rope, "mscale")) s.mscale = c.get_number("mscale", std::nullopt, &rope, where);
    if (ConfigJson::has(rope, "mscale_all_dim")) {
      s.mscale_all_dim = c.get_number("mscale_all_dim", std::nullopt, &rope, where);
    }
  }
  a.rope_scaling = s;
}

}  // namespace

void parse_rope_config(const ConfigJson& c, llama::LlamaArgs& args) { parse_rope(c, args); }

ParsedConfig parse_config(const ConfigJson& c, const std::string& default_model_type) {
  ParsedConfig p;
  p.model_type = default_model_type.empty() ? c.get_string("model_type")
                                            : c.get_string("model_type", default_model_type);
  const bool is_llama = p.model_type == "llama", is_moe = p.model_type == "qwen3_moe";
  if (!is_llama && p.model_type != "qwen3" && !is_moe) {
    c.fail("field 'model_type' = " + excerpt(nlohmann::json(p.model_type)) +
           " is not supported (supported: \"llama\", \"qwen3\", \"qwen3_moe\"; a \"deepseek_v3\" config.json is "
           "read by fsdp::models::hf::read_deepseek_v3_config)");
  }
  llama::LlamaArgs& a = p.args;
  a = llama::LlamaArgs{};
  // The defaults below are the configuration classes' (LlamaConfig, Qwen3Config, Qwen3MoeConfig), used by
  // transformers when a field is absent; the sizes are required.
  a.dim = positive(c, "hidden_size");
  a.n_layers = positive(c, "num_hidden_layers");
  a.n_heads = positive(c, "num_attention_heads");
  a.vocab_size = positive(c, "vocab_size");
  a.n_kv_heads = positive(c, "num_key_value_heads", a.n_heads);
  if (a.n_heads % *a.n_kv_heads != 0) {
    c.fail("field 'num_key_value_heads' = " + std::to_string(*a.n_kv_heads) + " must divide num_attention_heads = " +
           std::to_string(a.n_heads));
  }
  a.explicit_head_dim = positive(c, "head_dim", is_llama ? a.dim / a.n_heads : 128);
  if (*a.explicit_head_dim % 2 != 0) {
    c.fail("field 'head_dim' = " + std::to_string(*a.explicit_head_dim) + " must be even (RoPE rotates pairs)");
  }
  a.norm_eps = c.get_number("rms_norm_eps", 1e-6);
  if (!(a.norm_eps > 0)) c.fail("field 'rms_norm_eps' = " + number_text(a.norm_eps) + " must be positive");
  a.max_seq_len = positive(c, "max_position_embeddings", is_llama ? 2048 : 32768);
  a.tie_embeddings = c.get_bool("tie_word_embeddings", false);
  a.depth_init = true;
  a.multiple_of = 256;
  a.ffn_dim_multiplier.reset();

  // What our decoder cannot compute: refused by name.
  const std::string act = c.get_string("hidden_act", "silu");
  if (act != "swish") require(c, "hidden_act", act, std::string("silu"), "the feed-forward is SwiGLU: silu only");
  require(c, "attention_bias", c.get_bool("attention_bias", false), false, "the attention projections have no bias");
  if (is_llama) require(c, "mlp_bias", c.get_bool("mlp_bias", false), false, "the feed-forward has no bias");
  require(c, "attention_dropout", c.get_number("attention_dropout", 0.0), 0.0, "attention has no dropout");
  if (!is_llama) {
    require(c, "use_sliding_window", c.get_bool("use_sliding_window", false), false,
            "every layer attends to the whole sequence");
    if (p.model_type == "qwen3" && c.has("layer_types")) {
      const auto& types = c.root()["layer_types"];
      if (!types.is_array()) c.fail("field 'layer_types' must be an array, got " + std::string(kind_of(types)));
      for (size_t i = 0; i < types.size(); ++i) {
        if (types[i] != "full_attention") {
          c.fail("field 'layer_types'[" + std::to_string(i) + "] = " + excerpt(types[i]) +
                 " is not supported (only \"full_attention\")");
        }
      }
    }
  }
  parse_rope(c, a);

  if (is_llama) {
    a.qk_norm = false;
    a.rope_layout = llama::RopeLayout::Interleaved;  // the adapter permutes q/k rows from the half split
  } else {
    a.qk_norm = true;
    a.rope_layout = llama::RopeLayout::HalfSplit;
  }
  if (is_moe) {
    require(c, "output_router_logits", c.get_bool("output_router_logits", false), false,
            "the auxiliary load-balancing loss is not implemented; libfsdp balances experts without it");
    models::moe::MoEOptions o;
    o.dim = a.dim;
    const bool has_e = c.has("num_experts"), has_le = c.has("num_local_experts");
    o.num_experts = positive(c, has_le && !has_e ? "num_local_experts" : "num_experts", 128);
    if (has_e && has_le && c.get_int("num_local_experts") != o.num_experts) {
      c.fail("fields 'num_experts' = " + std::to_string(o.num_experts) + " and 'num_local_experts' = " +
             std::to_string(c.get_int("num_local_experts")) + " disagree (transformers reads them as one)");
    }
    o.top_k = positive(c, "num_experts_per_tok", 8);
    if (o.top_k > o.num_experts) {
      c.fail("field 'num_experts_per_tok' = " + std::to_string(o.top_k) + " exceeds the " +
             std::to_string(o.num_experts) + " experts");
    }
    o.hidden = positive(c, "moe_intermediate_size", 768);
    o.score_func = "softmax";
    o.route_norm = c.get_bool("norm_topk_prob", false);
    o.route_scale = 1.0;
    o.num_shared_experts = 0;
    o.load_balance_coeff = 1e-3;  // TorchTitan's Qwen3 (training only; the bias starts at zero)
    a.moe = o;
    a.moe_layer_step = positive(c, "decoder_sparse_step", 1);
    a.dense_layers.clear();
    if (c.has("mlp_only_layers")) {
      const auto& list = c.root()["mlp_only_layers"];
      if (!list.is_array()) c.fail("field 'mlp_only_layers' must be an array, got " + std::string(kind_of(list)));
      std::set<int64_t> seen;
      for (size_t i = 0; i < list.size(); ++i) {
        if (!list[i].is_number_integer() || list[i].get<int64_t>() < 0 || list[i].get<int64_t>() >= a.n_layers) {
          c.fail("field 'mlp_only_layers'[" + std::to_string(i) + "] = " + excerpt(list[i]) +
                 " must be a layer index in [0, " + std::to_string(a.n_layers) + ")");
        }
        if (seen.insert(list[i].get<int64_t>()).second) a.dense_layers.push_back(list[i].get<int64_t>());
      }
    }
  }
  bool any_dense = !a.moe;
  for (int64_t i = 0; i < a.n_layers && !any_dense; ++i) any_dense = !a.is_moe_layer(i);
  // intermediate_size sizes the dense feed-forward: required where there is one.
  a.explicit_ffn_hidden = any_dense ? positive(c, "intermediate_size") : positive(c, "intermediate_size", 6144);
  return p;
}

void check_config_matches(const ConfigJson& c, const ParsedConfig& parsed, const llama::LlamaArgs& model,
                          bool untied_model_may_load_tied) {
  const llama::LlamaArgs& h = parsed.args;
  std::vector<std::string> bad;
  auto field_int = [&](const char* field, int64_t theirs, int64_t ours) {
    if (theirs != ours) {
      bad.push_back(std::string(field) + " = " + std::to_string(theirs) + " (the model has " + std::to_string(ours) +
                    ")");
    }
  };
  auto field_num = [&](const std::string& field, double theirs, double ours) {
    if (std::abs(theirs - ours) > 1e-9 * std::max(1.0, std::abs(ours))) {
      bad.push_back(field + " = " + number_text(theirs) + " (the model has " + number_text(ours) + ")");
    }
  };
  const bool moe_model = model.moe.has_value();
  const std::string ours_type = model.rope_layout == llama::RopeLayout::Interleaved ? "llama"
                                : moe_model                                         ? "qwen3_moe"
                                                                                    : "qwen3";
  if (parsed.model_type != ours_type) {
    bad.push_back("model_type = \"" + parsed.model_type + "\" (the model is " + ours_type + ")");
  }
  field_int("hidden_size", h.dim, model.dim);
  field_int("num_hidden_layers", h.n_layers, model.n_layers);
  field_int("num_attention_heads", h.n_heads, model.n_heads);
  field_int("num_key_value_heads", h.kv_heads(), model.kv_heads());
  field_int("vocab_size", h.vocab_size, model.vocab_size);
  field_int("head_dim", h.head_dim(), model.head_dim());
  bool model_has_dense = !moe_model;
  for (int64_t i = 0; i < model.n_layers && !model_has_dense; ++i) model_has_dense = !model.is_moe_layer(i);
  if (model_has_dense) field_int("intermediate_size", h.ffn_hidden_dim(), model.ffn_hidden_dim());
  field_num("rms_norm_eps", h.norm_eps, model.norm_eps);
  field_num("rope_theta", h.rope_theta, model.rope_theta);
  // RoPE scaling: type, then every parameter that enters the frequencies or the attention factor.
  auto type_of = [](const llama::LlamaArgs& a) {
    return a.rope_scaling ? std::string(llama::rope_type_name(a.rope_scaling->type)) : std::string("default");
  };
  if (type_of(h) != type_of(model)) {
    bad.push_back("rope_type = \"" + type_of(h) + "\" (the model has \"" + type_of(model) + "\")");
  } else if (h.rope_scaling) {
    const auto &t = *h.rope_scaling, &o = *model.rope_scaling;
    field_num("factor", t.factor, o.factor);
    if (t.type != llama::RopeScaling::Type::Linear) {
      field_int("original_max_position_embeddings", t.original_max_position_embeddings,
                o.original_max_position_embeddings);
    }
    if (t.type == llama::RopeScaling::Type::Llama3) {
      field_num("low_freq_factor", t.low_freq_factor, o.low_freq_factor);
      field_num("high_freq_factor", t.high_freq_factor, o.high_freq_factor);
    } else if (t.type == llama::RopeScaling::Type::Yarn) {
      field_num("beta_fast", t.beta_fast, o.beta_fast);
      field_num("beta_slow", t.beta_slow, o.beta_slow);
      if (t.truncate != o.truncate) bad.push_back(std::string("truncate = ") + (t.truncate ? "true" : "false"));
      field_num("YaRN attention factor", llama::rope_attention_factor(h.rope_scaling),
                llama::rope_attention_factor(model.rope_scaling));
    }
  }
  if (h.tie_embeddings != model.tie_embeddings && (model.tie_embeddings || !untied_model_may_load_tied)) {
    bad.push_back(std::string("tie_word_embeddings = ") + (h.tie_embeddings ? "true" : "false") + " (the model " +
                  (model.tie_embeddings ? "ties" : "does not tie") + " its embeddings)");
  }
  if (h.moe && moe_model) {
    const auto theirs = *h.moe, ours = model.moe_options();
    field_int(c.has("num_experts") || !c.has("num_local_experts") ? "num_experts" : "num_local_experts",
              theirs.num_experts, ours.num_experts);
    field_int("num_experts_per_tok", theirs.top_k, ours.top_k);
    field_int("moe_intermediate_size", theirs.hidden, ours.hidden);
    field_int("decoder_sparse_step", h.moe_layer_step, model.moe_layer_step);
    if (theirs.route_norm != ours.route_norm) {
      bad.push_back(std::string("norm_topk_prob = ") + (theirs.route_norm ? "true" : "false") +
                    " (the model's route_norm is " + (ours.route_norm ? "true" : "false") + ")");
    }
    const std::set<int64_t> a(h.dense_layers.begin(), h.dense_layers.end()),
        b(model.dense_layers.begin(), model.dense_layers.end());
    if (a != b) bad.push_back("mlp_only_layers (" + std::to_string(a.size()) + " layers; the model's dense_layers differ)");
  }
  if (bad.empty()) return;
  std::ostringstream list;
  for (size_t i = 0; i < bad.size(); ++i) list << (i ? "; " : "") << bad[i];
  TORCH_CHECK(false, c.who(), ": ", c.path(), " does not describe this model: ", list.str());
}

}  // namespace common

namespace {

std::string config_path(const std::string& path) {
  const fs::path p(path);
  return fs::is_directory(p) ? (p / "config.json").string() : p.string();
}

}  // namespace

HfConfig read_config(const std::string& path) {
  common::ConfigJson c(config_path(path), "hf::read_config");
  common::ParsedConfig p = common::parse_config(c);
  return HfConfig{p.model_type, p.args};
}

checkpoint::SafetensorsImportResult import_hf(models::llama::TransformerImpl& model, const std::string& path,
                                  const checkpoint::SafetensorsImportOptions& options) {
  return model.args().rope_layout == llama::RopeLayout::HalfSplit ? import_qwen3(model, path, options)
                                                                  : import_llama(model, path, options);
}

models::llama::Transformer load_model(const std::string& dir, const checkpoint::SafetensorsImportOptions& options) {
  const HfConfig config = read_config(dir);
  models::llama::Transformer model(config.args);
  import_hf(*model, dir, options);
  return model;
}

}  // namespace fsdp::models::hf
