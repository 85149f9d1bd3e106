// Hugging Face DeepseekV3ForCausalLM <-> our DeepSeek-V3 (see include/fsdp/models/hf_deepseek_v3.h).
#include <fsdp/models/hf_deepseek_v3.h>

#include "checkpoint/model_safetensors_impl.h"
#include "models/hf_common.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <set>
#include <sstream>

namespace fsdp::models::hf {
namespace fs = std::filesystem;
namespace ds = fsdp::models::deepseek_v3;
namespace llama = fsdp::models::llama;

namespace {

constexpr double kHfLatentNormEps = 1e-6;  // DeepseekV3RMSNorm's default, which q/kv_a_layernorm keep

const std::vector<common::NamePair>& top_names() {
  static const std::vector<common::NamePair> names = {{"tok_embeddings.weight", "model.embed_tokens.weight"},
                                                      {"norm.weight", "model.norm.weight"},
                                                      {"output.weight", "lm_head.weight"}};
  return names;
}

const std::vector<common::NamePair>& layer_names() {
  static const std::vector<common::NamePair> names = {
      {"attention.wq.weight", "self_attn.q_proj.weight"},
      {"attention.wq_a.weight", "self_attn.q_a_proj.weight"},
      {"attention.q_norm.weight", "self_attn.q_a_layernorm.weight"},
      {"attention.wq_b.weight", "self_attn.q_b_proj.weight"},
      {"attention.wkv_a.weight", "self_attn.kv_a_proj_with_mqa.weight"},
      {"attention.kv_norm.weight", "self_attn.kv_a_layernorm.weight"},
      {"attention.wkv_b.weight", "self_attn.kv_b_proj.weight"},
      {"attention.wo.weight", "self_attn.o_proj.weight"},
      {"attention_norm.weight", "input_layernorm.weight"},
      {"ffn_norm.weight", "post_attention_layernorm.weight"},
      {"feed_forward.w1.weight", "mlp.gate_proj.weight"},
      {"feed_forward.w2.weight", "mlp.down_proj.weight"},
      {"feed_forward.w3.weight", "mlp.up_proj.weight"},
      {"moe.router.gate.weight", "mlp.gate.weight"},
      // A buffer: named here for the sharded path (its state holds buffers); the whole-model path maps it apart.
      {"moe.expert_bias", "mlp.gate.e_score_correction_bias"},
      {"moe.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"},
      {"moe.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"},
      {"moe.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"},
  };
  return names;
}

std::optional<std::string> to_hf_name(const std::string& key) { return common::to_hf(key, top_names(), layer_names()); }

std::string mlp_prefix(int64_t layer) { return "model.layers." + std::to_string(layer) + ".mlp."; }

std::string num(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

// An unsharded model must hold every expert (expert parallelism without fully_shard leaves each process a slice
// and nothing to gather them with).
void check_every_expert(const char* who, ds::DeepSeekV3Impl& model) {
  for (auto& block : model.blocks()) {
    if (!block->moe) continue;
    const int64_t E = block->moe->options().num_experts;
    TORCH_CHECK(block->moe->experts->w1.size(0) == E, who, ": layer ", block->layer_id, " holds ",
                block->moe->experts->w1.size(0), " of its ", E, " experts (split by expert parallelism without ",
                "fully_shard?); the Hugging Face adapter needs every expert in this process or a sharded model");
  }
}

// The differences that matter between two args, "field = theirs (the model has ours)".
std::vector<std::string> differences(const ds::DeepSeekV3Args& cfg, const ds::DeepSeekV3Args& m) {
  std::vector<std::string> out;
  auto cmp = [&](const char* field, auto theirs, auto ours) {
    if (theirs != ours) {
      std::ostringstream os;
      os << field << " = " << theirs << " (the model has " << ours << ")";
      out.push_back(os.str());
    }
  };
  cmp("hidden_size", cfg.dim, m.dim);
  cmp("num_hidden_layers", cfg.n_layers, m.n_layers);
  cmp("num_attention_heads", cfg.n_heads, m.n_heads);
  cmp("vocab_size", cfg.vocab_size, m.vocab_size);
  cmp("first_k_dense_replace", cfg.n_dense_layers, m.n_dense_layers);
  if (m.n_dense_layers > 0) cmp("intermediate_size", cfg.inter_dim, m.inter_dim);
  cmp("q_lora_rank (0 = null)", cfg.q_lora_rank, m.q_lora_rank);
  cmp("kv_lora_rank", cfg.kv_lora_rank, m.kv_lora_rank);
  cmp("qk_nope_head_dim", cfg.qk_nope_head_dim, m.qk_nope_head_dim);
  cmp("qk_rope_head_dim", cfg.qk_rope_head_dim, m.qk_rope_head_dim);
  cmp("v_head_dim", cfg.v_head_dim, m.v_head_dim);
  cmp("rms_norm_eps", cfg.norm_eps, m.norm_eps);
  cmp("q_a_layernorm / kv_a_layernorm eps (transformers: 1e-6)", cfg.latent_norm_eps, m.latent_norm_eps);
  cmp("rope_theta", cfg.rope_theta, m.rope_theta);
  cmp("softmax scale (qk_head_dim, YaRN mscale_all_dim)", cfg.softmax_scale(), m.softmax_scale());
  cmp("rope_type", std::string(cfg.rope_scaling ? "yarn" : "default"),
      std::string(m.rope_scaling ? llama::rope_type_name(m.rope_scaling->type) : "default"));
  if (cfg.rope_scaling && m.rope_scaling) {
    const auto &a = *cfg.rope_scaling, &b = *m.rope_scaling;
    cmp("rope factor", a.factor, b.factor);
    cmp("rope original_max_position_embeddings", a.original_max_position_embeddings,
        b.original_max_position_embeddings);
    cmp("rope beta_fast", a.beta_fast, b.beta_fast);
    cmp("rope beta_slow", a.beta_slow, b.beta_slow);
    cmp("rope truncate", a.truncate, b.truncate);
    cmp("rope attention factor (attention_factor, mscale, mscale_all_dim)", llama::rope_attention_factor(a),
        llama::rope_attention_factor(b));
  }
  if (m.n_dense_layers < m.n_layers) {
    const auto a = cfg.moe_options(), b = m.moe_options();
    cmp("n_routed_experts", a.num_experts, b.num_experts);
    cmp("n_shared_experts", a.num_shared_experts, b.num_shared_experts);
    cmp("moe_intermediate_size", a.hidden, b.hidden);
    cmp("num_experts_per_tok", a.top_k, b.top_k);
    cmp("score function (transformers: sigmoid)", a.score_func, b.score_func);
    cmp("norm_topk_prob", a.route_norm, b.route_norm);
    cmp("routed_scaling_factor", a.route_scale, b.route_scale);
    cmp("n_group (1 = no groups)", std::max<int64_t>(a.num_expert_groups, 1), std::max<int64_t>(b.num_expert_groups, 1));
    if (a.num_expert_groups > 1 || b.num_expert_groups > 1) cmp("topk_group", a.num_limited_groups, b.num_limited_groups);
  }
  return out;
}

}  // namespace

ds::DeepSeekV3Args read_deepseek_v3_config(const std::string& path) {
  const std::string file = fs::is_directory(path) ? (fs::path(path) / "config.json").string() : path;
  common::ConfigJson c(file, "read_deepseek_v3_config");
  const nlohmann::json& root = c.root();
  const std::string type = c.get_string("model_type");
  if (type != "deepseek_v3") {
    c.fail("field 'model_type' = \"" + type + "\" is not supported here (this reader takes \"deepseek_v3\"; " +
           "fsdp::models::hf::read_config reads llama / qwen3 / qwen3_moe)");
  }
  auto positive = [&](const char* field, std::optional<int64_t> fallback) {
    const int64_t v = c.get_int(field, fallback);
    if (v <= 0) c.fail("field '" + std::string(field) + "' = " + std::to_string(v) + " must be positive");
    return v;
  };
  auto refuse_unless = [&](bool ok, const std::string& field, const std::string& value, const std::string& why) {
    if (!ok) c.fail("field '" + field + "' = " + value + " is not supported (" + why + ")");
  };
  // Defaults: DeepseekV3Config's (transformers 5), used by transformers when a field is absent.
  ds::DeepSeekV3Args a;
  a.dim = positive("hidden_size", std::nullopt);
  a.n_layers = positive("num_hidden_layers", std::nullopt);
  a.n_heads = positive("num_attention_heads", std::nullopt);
  a.vocab_size = positive("vocab_size", std::nullopt);
  const int64_t kv_heads = positive("num_key_value_heads", a.n_heads);
  refuse_unless(kv_heads == a.n_heads, "num_key_value_heads", std::to_string(kv_heads),
                "MLA expands its latent to every one of the num_attention_heads = " + std::to_string(a.n_heads) +
                    " heads");
  a.inter_dim = positive("intermediate_size", 18432);
  a.n_dense_layers = c.get_int("first_k_dense_replace", 3);
  if (a.n_dense_layers < 0) c.fail("field 'first_k_dense_replace' must be >= 0");
  a.n_dense_layers = std::min(a.n_dense_layers, a.n_layers);
  // q_lora_rank null: a plain q projection (transformers' q_proj); our 0.
  if (root.contains("q_lora_rank") && root["q_lora_rank"].is_null()) {
    a.q_lora_rank = 0;
  } else {
    a.q_lora_rank = positive("q_lora_rank", 1536);
  }
  a.kv_lora_rank = positive("kv_lora_rank", 512);
  a.qk_rope_head_dim = positive("qk_rope_head_dim", 64);
  if (a.qk_rope_head_dim % 2 != 0) c.fail("field 'qk_rope_head_dim' must be even (RoPE rotates pairs)");
  a.qk_nope_head_dim = c.get_int("qk_nope_head_dim", 128);
  if (a.qk_nope_head_dim < 0) c.fail("field 'qk_nope_head_dim' must be >= 0");
  a.v_head_dim = positive("v_head_dim", 128);
  a.norm_eps = c.get_number("rms_norm_eps", 1e-6);
  if (!(a.norm_eps > 0)) c.fail("field 'rms_norm_eps' must be positive");
  a.latent_norm_eps = kHfLatentNormEps;
  a.max_seq_len = positive("max_position_embeddings", 4096);

  const std::string act = c.get_string("hidden_act", "silu");
  refuse_unless(act == "silu" || act == "swish", "hidden_act", "\"" + act + "\"", "the FFNs are SwiGLU: silu only");
  refuse_unless(!c.get_bool("attention_bias", false), "attention_bias", "true", "the projections have no bias");
  refuse_unless(c.get_number("attention_dropout", 0.0) == 0.0, "attention_dropout",
                num(c.get_number("attention_dropout", 0.0)), "attention has no dropout");
  refuse_unless(c.get_bool("rope_interleave", true), "rope_interleave", "false",
                "RoPE rotates interleaved pairs, as DeepSeek's checkpoints and TorchTitan");
  refuse_unless(!c.get_bool("tie_word_embeddings", false), "tie_word_embeddings", "true",
                "DeepSeek-V3's output layer is its own");

  llama::LlamaArgs rope;
  rope.max_seq_len = a.max_seq_len;
  common::parse_rope_config(c, rope);
  if (rope.rope_scaling && rope.rope_scaling->type != llama::RopeScaling::Type::Yarn) {
    c.fail(std::string("field 'rope_type' = \"") + llama::rope_type_name(rope.rope_scaling->type) +
           "\" is not supported for deepseek_v3 (supported: \"default\", \"yarn\")");
  }
  a.rope_theta = rope.rope_theta;
  a.rope_scaling = rope.rope_scaling;

  fsdp::models::moe::MoEOptions& o = a.moe;
  o.dim = a.dim;
  const bool has_e = c.has("n_routed_experts"), has_le = c.has("num_local_experts");
  o.num_experts = positive(has_le && !has_e ? "num_local_experts" : "n_routed_experts", 256);
  o.num_shared_experts = c.get_int("n_shared_experts", 1);
  if (o.num_shared_experts < 0) c.fail("field 'n_shared_experts' must be >= 0");
  o.hidden = positive("moe_intermediate_size", 2048);
  o.top_k = positive("num_experts_per_tok", 8);
  if (o.top_k > o.num_experts) c.fail("field 'num_experts_per_tok' exceeds n_routed_experts");
  o.score_func = "sigmoid";
  o.route_norm = c.get_bool("norm_topk_prob", true);
  o.route_scale = c.get_number("routed_scaling_factor", 2.5);
  const int64_t groups = positive("n_group", 8), limited = positive("topk_group", 4);
  if (o.num_experts % groups != 0 || o.num_experts / groups < 2) {
    c.fail("field 'n_group' = " + std::to_string(groups) + " must divide n_routed_experts = " +
           std::to_string(o.num_experts) + " into groups of at least 2 experts");
  }
  if (limited > groups) c.fail("field 'topk_group' = " + std::to_string(limited) + " exceeds n_group");
  if (groups > 1) {
    o.num_expert_groups = groups, o.num_limited_groups = limited;
    if (o.top_k > limited * (o.num_experts / groups)) {
      c.fail("field 'num_experts_per_tok' exceeds the experts of topk_group groups");
    }
  }
  o.load_balance_coeff = 1e-3;  // TorchTitan's (training only; the bias itself comes with the weights)
  return a;
}

std::string deepseek_v3_config_json(const ds::DeepSeekV3Args& a, const std::string& dtype) {
  const auto o = a.moe_options();
  TORCH_CHECK(a.n_dense_layers == a.n_layers || o.score_func == "sigmoid", "deepseek_v3_config_json: transformers' ",
              "DeepseekV3 routes by sigmoid scores; the model has score_func \"", o.score_func, "\"");
  TORCH_CHECK(a.latent_norm_eps == kHfLatentNormEps, "deepseek_v3_config_json: transformers' q_a_layernorm and ",
              "kv_a_layernorm use eps 1e-6; the model has latent_norm_eps ", a.latent_norm_eps);
  TORCH_CHECK(!a.rope_scaling || a.rope_scaling->type == llama::RopeScaling::Type::Yarn, "deepseek_v3_config_json: ",
              "RoPE scaling \"", a.rope_scaling ? llama::rope_type_name(a.rope_scaling->type) : "", "\" is not ",
              "DeepSeek-V3's (yarn)");
  nlohmann::json c;
  c["architectures"] = {"DeepseekV3ForCausalLM"};
  c["model_type"] = "deepseek_v3";
  c["vocab_size"] = a.vocab_size;
  c["hidden_size"] = a.dim;
  c["intermediate_size"] = a.inter_dim;
  c["moe_intermediate_size"] = o.hidden;
  c["num_hidden_layers"] = a.n_layers;
  c["num_attention_heads"] = a.n_heads;
  c["num_key_value_heads"] = a.n_heads;
  c["n_shared_experts"] = o.num_shared_experts;
  c["n_routed_experts"] = o.num_experts;
  c["routed_scaling_factor"] = o.route_scale;
  c["kv_lora_rank"] = a.kv_lora_rank;
  c["q_lora_rank"] = a.q_lora_rank == 0 ? nlohmann::json(nullptr) : nlohmann::json(a.q_lora_rank);
  c["qk_rope_head_dim"] = a.qk_rope_head_dim;
  c["qk_nope_head_dim"] = a.qk_nope_head_dim;
  c["v_head_dim"] = a.v_head_dim;
  c["n_group"] = o.num_expert_groups > 0 ? o.num_expert_groups : 1;
  c["topk_group"] = o.num_expert_groups > 0 ? o.num_limited_groups : 1;
  c["num_experts_per_tok"] = o.top_k;
  c["first_k_dense_replace"] = a.n_dense_layers;
  c["norm_topk_prob"] = o.route_norm;
  c["hidden_act"] = "silu";
  c["max_position_embeddings"] = a.max_seq_len;
  c["rms_norm_eps"] = a.norm_eps;
  c["tie_word_embeddings"] = false;
  c["rope_interleave"] = true;
  c["attention_bias"] = false;
  c["attention_dropout"] = 0.0;
  c["num_nextn_predict_layers"] = 0;  // no multi-token-prediction layers
  nlohmann::json rope = {{"rope_type", a.rope_scaling ? "yarn" : "default"}, {"rope_theta", a.rope_theta}};
  if (a.rope_scaling) {
    const auto& s = *a.rope_scaling;
    rope["factor"] = s.factor;
    rope["original_max_position_embeddings"] = s.original_max_position_embeddings;
    rope["beta_fast"] = s.beta_fast;
    rope["beta_slow"] = s.beta_slow;
    rope["truncate"] = s.truncate;
    if (s.attention_factor) rope["attention_factor"] = *s.attention_factor;
    if (s.mscale) rope["mscale"] = *s.mscale;
    if (s.mscale_all_dim) rope["mscale_all_dim"] = *s.mscale_all_dim;
  }
  c["rope_parameters"] = rope;
  c["torch_dtype"] = dtype;
  return c.dump(2) + "\n";
}

checkpoint::SafetensorsExportResult export_deepseek_v3(ds::DeepSeekV3Impl& model, const std::string& dir,
                                           const checkpoint::SafetensorsExportOptions& options) {
  const ds::DeepSeekV3Args& args = model.args();
  const std::string config = deepseek_v3_config_json(args, common::dtype_name(options.dtype));
  const int64_t E = args.moe.num_experts;
  // The load-balancing bias is the router's e_score_correction_bias (a float32 buffer there too); a model
  // without load balancing exports zeros, which is what transformers' router then adds.
  auto zero_bias = [E] { return at::zeros({E}, at::kFloat); };
  if (common::uses_fully_shard(model)) {
    // Sharded (FSDP, HSDP, DDP, EP, TP, pipeline stages): one tensor gathered at a time, the experts as slices of
    // the stacked tensors, the bias buffer by name (replicated: no gather); zeros written for a model without one.
    std::vector<std::pair<std::string, at::Tensor>> zeros;
    for (auto& block : model.blocks()) {
      if (block->moe && !block->moe->expert_bias.defined()) {
        zeros.emplace_back(mlp_prefix(block->layer_id) + "gate.e_score_correction_bias", zero_bias());
      }
    }
    return common::export_sharded("export_deepseek_v3", model, dir, options, to_hf_name, nullptr,
                                  common::moe_layer_ids(model).empty() ? 0 : args.moe.hidden, config, std::move(zeros));
  }
  check_every_expert("export_deepseek_v3", model);
  auto tensors = common::whole_model_tensors("export_deepseek_v3", model, to_hf_name, nullptr, common::is_expert_key);
  for (auto& block : model.blocks()) {
    if (!block->moe) continue;
    const std::string p = mlp_prefix(block->layer_id);
    common::append_stacked_experts(tensors, common::experts_prefix(block->layer_id), *block->moe->experts);
    tensors.emplace_back(p + "gate.e_score_correction_bias", block->moe->expert_bias.defined()
                                                                   ? block->moe->expert_bias.detach().to(at::kCPU)
                                                                   : zero_bias());
  }
  return common::write_whole_model(dir, std::move(tensors), options, config);
}

checkpoint::SafetensorsImportResult import_deepseek_v3(ds::DeepSeekV3Impl& model, const std::string& path,
                                           const checkpoint::SafetensorsImportOptions& options) {
  const bool sharded = common::uses_fully_shard(model);
  if (!sharded) check_every_expert("import_deepseek_v3", model);
  const fs::path dir = fs::is_directory(path) ? fs::path(path) : fs::path(path).parent_path();
  if (fs::is_regular_file(dir / "config.json")) {
    const ds::DeepSeekV3Args cfg = read_deepseek_v3_config((dir / "config.json").string());
    const auto diffs = differences(cfg, model.args());
    if (!diffs.empty()) {
      std::string list;
      for (const auto& d : diffs) list += (list.empty() ? "" : "; ") + d;
      TORCH_CHECK(false, "import_deepseek_v3: ", (dir / "config.json").string(), " describes another model: ", list);
    }
  }
  common::FileTensors files(path);
  checkpoint::detail::KeyAdapter adapter = common::import_adapter("import_deepseek_v3", to_hf_name, /*files_have_lm_head=*/true,
                                                      /*model_tied=*/false, /*lm_head_from_embeddings=*/false);
  std::set<std::string> used;
  checkpoint::SafetensorsImportResult r;
  c10::NoGradGuard no_grad;
  auto read = [&](const std::string& name) {
    used.insert(name);
    at::Tensor t = files.read(name);
    r.bytes_read += t.nbytes();
    return t;
  };
  // A model without load balancing routes without a bias: only an all-zero one loads into it (read whole: [E]).
  std::set<std::string> zero_biases;
  for (auto& block : model.blocks()) {
    const std::string bias_name = mlp_prefix(block->layer_id) + "gate.e_score_correction_bias";
    if (!block->moe || block->moe->expert_bias.defined() || !files.has(bias_name)) continue;
    const at::Tensor bias = read(bias_name);
    TORCH_CHECK(bias.eq(0).all().item<bool>(), "import_deepseek_v3 from ", path, ": '", bias_name, "' is not zero ",
                "but the model has no load-balancing bias (load_balance_coeff unset) to hold it");
    zero_biases.insert(bias_name);
  }
  if (sharded) {
    // Each rank reads its own rows (under PP: of its stages); the bias buffer by name, the experts as slices.
    adapter.ignorable = [ignorable = adapter.ignorable, zero_biases](const std::string& name) {
      return zero_biases.count(name) > 0 || ignorable(name);
    };
    checkpoint::SafetensorsImportResult sharded_result =
        common::import_sharded("import_deepseek_v3", model, files, adapter, options, nullptr,
                               common::moe_layer_ids(model), model.args().moe.hidden);
    sharded_result.bytes_read += r.bytes_read;
    return sharded_result;
  }
  checkpoint::SafetensorsImportResult whole = common::import_whole_model("import_deepseek_v3", model, files, adapter, options,
                                                             nullptr, common::is_expert_key, used);
  whole.bytes_read += r.bytes_read;
  r = std::move(whole);
  for (auto& block : model.blocks()) {
    if (!block->moe) continue;
    const std::string p = mlp_prefix(block->layer_id), experts = common::experts_prefix(block->layer_id);
    const std::string ours = "layers." + std::to_string(block->layer_id) + ".moe.experts";
    if (!common::import_experts("import_deepseek_v3", files, experts, ours, *block->moe->experts, used, r)) {
      TORCH_CHECK(!options.strict, "import_deepseek_v3 from ", path, ": the experts of layer ", block->layer_id,
                  " are missing: neither '", experts, "gate_up_proj' nor '", experts, "0.gate_proj.weight'");
      r.missing.push_back(experts + "gate_up_proj");
      r.missing.push_back(experts + "down_proj");
    }
    const std::string bias_name = p + "gate.e_score_correction_bias";
    if (!block->moe->expert_bias.defined()) continue;  // zero (checked above) or absent: nothing to hold
    if (!files.has(bias_name)) {
      TORCH_CHECK(!options.strict, "import_deepseek_v3 from ", path, ": '", bias_name, "' (for 'layers.",
                  block->layer_id, ".moe.expert_bias') is missing");
      r.missing.push_back(bias_name);
    } else {
      common::copy_checked("import_deepseek_v3", bias_name, files.file_of(bias_name),
                           "layers." + std::to_string(block->layer_id) + ".moe.expert_bias", block->moe->expert_bias,
                           read(bias_name));
    }
  }
  common::finish_whole_import("import_deepseek_v3", path, files, used, adapter, options, r);
  return r;
}

}  // namespace fsdp::models::hf
