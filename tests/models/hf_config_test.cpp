// Hugging Face config.json fields (fsdp/models/hf_config.h, docs/interop.md "config.json fields"): every field
// that changes transformers' computation is honoured or refused by name.
//  - Honoured: small random Llama / Qwen3 / Qwen3-MoE models saved by transformers in the venv, their config.json
//    edited as users edit it (YaRN in the top-level rope_scaling form, as Qwen's model cards say, or in
//    rope_parameters; Llama 3 and linear scaling; rms_norm_eps; rope_theta at the top level; norm_topk_prob ...),
//    loaded by one call (hf::load_model): logits equal transformers' on the same files (1e-5), and each edit moved
//    transformers' logits (the field mattered).
//  - Refused: each unsupported value (hidden_act, biases, dropout, sliding windows, partial rotary, other RoPE
//    types, ...) is an error naming the file, the field and its value; wrong types and deep nesting name the file
//    and the field (no crash); strict imports refuse stray tensors on one rank and a config.json saying
//    tie_word_embeddings = false over files without lm_head.weight.
#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/models/hf_config.h>
#include <fsdp/models/hf_llama.h>
#include <fsdp/models/hf_qwen3.h>
#include <fsdp/models/qwen3.h>

#include "expect_error.h"
#include "models/hf_side.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

namespace fs = std::filesystem;
namespace st = fsdp::checkpoint::safetensors;
namespace hf = fsdp::models::hf;
using namespace fsdp::models::llama;
using nlohmann::json;

namespace {

const std::string kPython = FSDP_TEST_PYTHON;
const std::string kScript = std::string(FSDP_SOURCE_DIR) + "/tests/models/hf_config_side.py";
constexpr double kTol = 1e-5;

using fsdp_test::hf_side::have_transformers;
using fsdp_test::hf_side::scratch;
using fsdp_test::hf_side::scratch_root;

std::string quoted(const json& j) {
  std::string s = j.dump(), out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// transformers makes and saves a model of `family` (config kwargs `base`), then config.json gets `edit`.
struct Made {
  fs::path dir;
  at::Tensor tokens, logits, logits_base;
};
Made make(const std::string& name, const std::string& family, const json& base, const json& edit) {
  Made m;
  m.dir = scratch(name);
  const auto r = fsdp_test::hf_side::run_python(
      kScript, "make --family " + family + " --base " + quoted(base) + " --edit " + quoted(edit) + " --out " +
                   m.dir.string() + " --seed 5");
  EXPECT_EQ(r.rc, 0) << r.command << "\n" << r.output;
  if (r.rc != 0) return m;
  const auto ref = st::load_file((m.dir / "ref.safetensors").string());
  m.tokens = ref.at("tokens"), m.logits = ref.at("logits"), m.logits_base = ref.at("logits_base");
  return m;
}

double max_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

at::Tensor forward(Transformer& m, const at::Tensor& tokens) {
  torch::NoGradGuard no_grad;
  m->eval();
  return m->forward(tokens);
}

// The one-call load of a transformers-made directory gives transformers' logits; the edit moved them.
void expect_loaded_equal(const std::string& name, const std::string& family, const json& base, const json& edit,
                         double min_moved = 1e-2) {
  SCOPED_TRACE(name);
  const Made m = make(name, family, base, edit);
  if (!m.logits.defined()) return;
  ASSERT_GT(m.logits.std().item<double>(), 0.3) << "the reference did not move";
  const double moved = max_diff(m.logits, m.logits_base);
  if (!edit.empty()) EXPECT_GT(moved, min_moved) << "the edited field did not change transformers' logits";
  Transformer model = hf::load_model(m.dir.string());
  const at::Tensor ours = forward(model, m.tokens);
  ASSERT_EQ(ours.sizes(), m.logits.sizes());
  const double diff = max_diff(ours, m.logits);
  EXPECT_LT(diff, kTol);
  std::cout << name << ": max |ours - transformers| = " << diff << " (edit moved transformers' logits by " << moved
            << ")\n";
}

json yarn(double factor, int64_t original) {
  return {{"rope_type", "yarn"}, {"factor", factor}, {"original_max_position_embeddings", original}};
}

}  // namespace

// ---- honoured: compared with transformers ----------------------------------------------------------------------

TEST(HfConfig, YarnInTopLevelRopeScalingEqualsTransformers) {
  if (!have_transformers()) GTEST_SKIP() << kPython << " has no transformers";
  // The case: a Qwen3-MoE config.json with YaRN added as Qwen's model cards say (rope_scaling, with the
  // top-level rope_theta of the hub's configs).
  expect_loaded_equal("moe_yarn_scaling", "qwen3_moe", json::object(),
                      {{"rope_scaling", yarn(4.0, 16)}, {"rope_theta", 1e6}});
  // The same on Llama (interleaved RoPE inside: the adapter permutes q/k) with tied embeddings.
  expect_loaded_equal("llama_yarn_scaling_tied", "llama", {{"tie_word_embeddings", true}},
                      {{"rope_scaling", yarn(8.0, 8)}, {"rope_theta", 10000.0}});
}

TEST(HfConfig, YarnInRopeParametersWithItsOptionsEqualsTransformers) {
  if (!have_transformers()) GTEST_SKIP() << kPython << " has no transformers";
  // transformers 5's form; beta_fast/beta_slow, no truncation, DeepSeek-V3's mscale / mscale_all_dim.
  json r = yarn(16.0, 24);
  r["rope_theta"] = 1e6, r["beta_fast"] = 8, r["beta_slow"] = 2, r["truncate"] = false;
  r["mscale"] = 1.0, r["mscale_all_dim"] = 0.5;
  expect_loaded_equal("moe_yarn_parameters", "qwen3_moe", json::object(), {{"rope_parameters", r}});
  // An explicit attention_factor on dense Qwen3.
  json d = yarn(4.0, 32);
  d["rope_theta"] = 1e6, d["attention_factor"] = 0.8;
  expect_loaded_equal("qwen3_yarn_attention_factor", "qwen3", json::object(), {{"rope_parameters", d}});
}

TEST(HfConfig, Llama3AndLinearScalingEqualsTransformers) {
  if (!have_transformers()) GTEST_SKIP() << kPython << " has no transformers";
  const json l3 = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                   {"original_max_position_embeddings", 16}};
  json l3p = l3;
  l3p["rope_theta"] = 10000.0;
  expect_loaded_equal("llama_llama3_parameters", "llama", json::object(), {{"rope_parameters", l3p}});
  // Qwen3 with Llama 3 scaling in the older form (rope_scaling + top-level rope_theta).
  expect_loaded_equal("qwen3_llama3_scaling", "qwen3", json::object(), {{"rope_scaling", l3}, {"rope_theta", 1e6}});
  expect_loaded_equal("llama_linear", "llama", json::object(),
                      {{"rope_parameters", {{"rope_type", "linear"}, {"factor", 4.0}, {"rope_theta", 10000.0}}}});
}

TEST(HfConfig, NormEpsThetaAndMoeFieldsEqualTransformers) {
  if (!have_transformers()) GTEST_SKIP() << kPython << " has no transformers";
  // rms_norm_eps, and rope_theta at the top level only (the older form).
  expect_loaded_equal("qwen3_eps_theta", "qwen3", json::object(),
                      {{"rms_norm_eps", 0.5}, {"rope_parameters", nullptr}, {"rope_theta", 50.0}});
  expect_loaded_equal("llama_eps", "llama", {{"num_key_value_heads", 4}}, {{"rms_norm_eps", 0.5}});
  // Qwen3-MoE: MoE on layer 1 only (decoder_sparse_step 2, layer 2 in mlp_only_layers), tied, norm_topk_prob
  // turned off in config.json (transformers saves num_local_experts).
  expect_loaded_equal("moe_fields", "qwen3_moe",
                      {{"decoder_sparse_step", 2}, {"mlp_only_layers", {2}}, {"tie_word_embeddings", true},
                       {"num_experts_per_tok", 3}},
                      {{"norm_topk_prob", false}});
  const hf::HfConfig c = hf::read_config((scratch_root() / "moe_fields").string());
  EXPECT_EQ(c.model_type, "qwen3_moe");
  ASSERT_TRUE(c.args.moe.has_value());
  EXPECT_EQ(c.args.moe->num_experts, 4);
  EXPECT_EQ(c.args.moe->top_k, 3);
  EXPECT_FALSE(c.args.moe->route_norm);
  EXPECT_EQ(c.args.moe_layer_step, 2);
  EXPECT_EQ(c.args.dense_layers, std::vector<int64_t>{2});
  EXPECT_TRUE(c.args.tie_embeddings);
}

TEST(HfConfig, ImportIntoABuiltModelChecksTheScaling) {
  if (!have_transformers()) GTEST_SKIP() << kPython << " has no transformers";
  const Made m = make("check_yarn", "qwen3_moe", json::object(), {{"rope_scaling", yarn(4.0, 16)}, {"rope_theta", 1e6}});
  if (!m.logits.defined()) return;
  // The model built from the config's args but without the scaling: the import names the difference.
  LlamaArgs plain = hf::read_config(m.dir.string()).args;
  ASSERT_TRUE(plain.rope_scaling && plain.rope_scaling->type == RopeScaling::Type::Yarn);
  plain.rope_scaling.reset();
  Transformer model(plain);
  fsdp_test::expect_error_containing<c10::Error>([&] { hf::import_qwen3(*model, m.dir.string()); },
                                                 "rope_type = \"yarn\" (the model has \"default\")");
  LlamaArgs eps = hf::read_config(m.dir.string()).args;
  eps.norm_eps = 1e-5;
  Transformer model2(eps);
  fsdp_test::expect_error_containing<c10::Error>([&] { hf::import_qwen3(*model2, m.dir.string()); },
                                                 "rms_norm_eps = 1e-06 (the model has 1e-05)");
}

// ---- export: our config.json with scaling, read back by transformers -------------------------------------------

TEST(HfConfig, ExportedScalingReadsBack) {
  // Our own export of a YaRN Qwen3 and a Llama 3 scaled Llama: config.json carries both forms, read back equal.
  LlamaArgs q = qwen3_flavor("cpu_tiny");
  q.rope_scaling = RopeScaling{};
  q.rope_scaling->type = RopeScaling::Type::Yarn;
  q.rope_scaling->factor = 4.0, q.rope_scaling->original_max_position_embeddings = 32;
  q.rope_scaling->mscale = 0.7, q.rope_scaling->mscale_all_dim = 0.3;
  const json c = json::parse(hf::qwen3_config_json(q));
  EXPECT_EQ(c["rope_scaling"]["rope_type"], "yarn");
  EXPECT_EQ(c["rope_parameters"]["rope_type"], "yarn");
  EXPECT_EQ(c["rope_parameters"]["rope_theta"], 1e6);
  const fs::path dir = scratch("export_yarn");
  Transformer model(q);
  model->init_weights(1);
  hf::export_qwen3(*model, dir.string());
  Transformer back = hf::load_model(dir.string());
  const at::Tensor tokens = at::randint(0, q.vocab_size, {2, 40}, at::make_generator<at::CPUGeneratorImpl>(1), at::kLong);
  EXPECT_LT(max_diff(forward(back, tokens), forward(model, tokens)), 1e-6);
  // The YaRN attention factor reached the tables: 0.1 * 0.7 ln 4 + 1 over 0.1 * 0.3 ln 4 + 1.
  const double f = (0.1 * 0.7 * std::log(4.0) + 1) / (0.1 * 0.3 * std::log(4.0) + 1);
  EXPECT_NEAR(rope_attention_factor(back->args().rope_scaling), f, 1e-12);
  auto [cos, sin] = precompute_rope(32, 3, 1e6, back->args().rope_scaling);
  EXPECT_NEAR(cos[0][0].item<double>(), f, 1e-6);  // position 0: cos 1 times the factor
}

// ---- refused: by name ------------------------------------------------------------------------------------------

namespace {

// A valid config.json of `model_type` written from our exporter's own text, then `edit` applied.
fs::path config_with(const std::string& name, const std::string& model_type, const json& edit) {
  json c;
  if (model_type == "llama") {
    c = json::parse(hf::config_json(llama3_flavor("cpu_tiny")));
  } else {
    c = json::parse(hf::qwen3_config_json(qwen3_flavor(model_type == "qwen3" ? "cpu_tiny" : "cpu_tiny_moe")));
  }
  for (auto it = edit.begin(); it != edit.end(); ++it) {
    if (it.value().is_null()) c.erase(it.key());
    else c[it.key()] = it.value();
  }
  const fs::path dir = scratch(name);
  std::ofstream(dir / "config.json") << c.dump(2);
  return dir;
}

void expect_refused(const std::string& model_type, const json& edit, const std::string& needle) {
  SCOPED_TRACE(model_type + " " + edit.dump());
  const fs::path dir = config_with("refused", model_type, edit);
  fsdp_test::expect_error_containing<c10::Error>([&] { hf::read_config(dir.string()); }, needle);
  // ... naming the file.
  fsdp_test::expect_error_containing<c10::Error>([&] { hf::read_config(dir.string()); },
                                                 (dir / "config.json").string() + ": ");
}

}  // namespace

TEST(HfConfig, UnsupportedFieldsAreRefusedByName) {
  for (const char* t : {"llama", "qwen3", "qwen3_moe"}) {
    expect_refused(t, {{"hidden_act", "gelu"}}, "field 'hidden_act' = \"gelu\" is not supported");
    expect_refused(t, {{"attention_bias", true}}, "field 'attention_bias' = true is not supported");
    expect_refused(t, {{"attention_dropout", 0.1}}, "field 'attention_dropout' = 0.1 is not supported");
    expect_refused(t, {{"partial_rotary_factor", 0.5}}, "field 'partial_rotary_factor' = 0.5 is not supported");
    expect_refused(t, {{"rope_scaling", {{"rope_type", "dynamic"}, {"factor", 2.0}}}},
                   "field 'rope_scaling.rope_type' = \"dynamic\" is not supported");
    expect_refused(t, {{"rope_parameters", {{"rope_type", "longrope"}, {"rope_theta", 1e4}}}},
                   "field 'rope_parameters.rope_type' = \"longrope\" is not supported");
    expect_refused(t, {{"rope_parameters", {{"rope_type", "yarn"}, {"rope_theta", 1e4}}}},
                   "field 'rope_parameters.factor' is missing");
  }
  expect_refused("llama", {{"mlp_bias", true}}, "field 'mlp_bias' = true is not supported");
  expect_refused("qwen3", {{"use_sliding_window", true}}, "field 'use_sliding_window' = true is not supported");
  expect_refused("qwen3_moe", {{"use_sliding_window", true}}, "field 'use_sliding_window' = true is not supported");
  expect_refused("qwen3", {{"layer_types", {"full_attention", "sliding_attention"}}},
                 "field 'layer_types'[1] = \"sliding_attention\" is not supported");
  expect_refused("qwen3_moe", {{"output_router_logits", true}}, "field 'output_router_logits' = true");
  expect_refused("qwen3_moe", {{"num_local_experts", 16}}, "'num_experts' = 8 and 'num_local_experts' = 16 disagree");
  expect_refused("qwen3_moe", {{"mlp_only_layers", {5}}}, "field 'mlp_only_layers'[0] = 5 must be a layer index");
  expect_refused("llama", {{"model_type", "mistral"}}, "field 'model_type' = \"mistral\" is not supported");
  expect_refused("llama", {{"hidden_size", nullptr}}, "field 'hidden_size' is missing");
  // transformers 5 lets rope_scaling replace rope_parameters and so drops its rope_theta (RoPE silently runs at
  // 10000): refused, saying so.
  expect_refused("qwen3", {{"rope_theta", nullptr}, {"rope_scaling", yarn(4.0, 16)}},
                 "rope_parameters.rope_theta = 1000000 is not used");
}

TEST(HfConfig, BadValuesNameFileFieldAndRule) {
  // A wrong type: not nlohmann's bare type_error, but the file, the field and what it must be.
  expect_refused("qwen3", {{"tie_word_embeddings", "yes"}},
                 "field 'tie_word_embeddings' must be true or false, got a string \"yes\"");
  expect_refused("llama", {{"num_attention_heads", 4.5}}, "field 'num_attention_heads' must be an integer, got a number");
  expect_refused("llama", {{"num_key_value_heads", 3}}, "'num_key_value_heads' = 3 must divide num_attention_heads");
  expect_refused("llama", {{"rms_norm_eps", -1}}, "field 'rms_norm_eps' = -1 must be positive");
  // A long string value is printed cut, never whole.
  expect_refused("llama", {{"hidden_act", std::string(100000, 'x')}}, "xxx...\" is not supported");
  // 100,000 nested arrays (crashed the recursive dump of the old check): refused while parsing, no crash.
  {
    const fs::path dir = scratch("deep");
    std::ofstream(dir / "config.json") << "{\"hidden_size\": " << std::string(100000, '[') << "}";
    fsdp_test::expect_error_containing<c10::Error>([&] { hf::read_config(dir.string()); },
                                                   "nested more than 32 deep");
    Transformer m(qwen3_flavor("cpu_tiny"));
    fsdp_test::expect_error_containing<c10::Error>([&] { hf::import_qwen3(*m, dir.string()); },
                                                   "nested more than 32 deep");
    std::ofstream(dir / "config.json") << "{\"model_type\": \"llama\", \"hidden_size\": "
                                       << std::string(20, '[') << std::string(20, ']') << "}";
    fsdp_test::expect_error_containing<c10::Error>([&] { hf::read_config(dir.string()); },
                                                   "field 'hidden_size' must be an integer, got an array");
  }
  // Not JSON, not an object, too large.
  {
    const fs::path dir = scratch("bad_json");
    std::ofstream(dir / "config.json") << "{\"hidden_size\": 3,";
    fsdp_test::expect_error_containing<c10::Error>([&] { hf::read_config(dir.string()); }, "is not valid JSON");
    std::ofstream(dir / "config.json") << "[1, 2]";
    fsdp_test::expect_error_containing<c10::Error>([&] { hf::read_config(dir.string()); },
                                                   "must hold a JSON object, not an array");
    fs::resize_file(dir / "config.json", 100 << 20);
    fsdp_test::expect_error_containing<c10::Error>([&] { hf::read_config(dir.string()); },
                                                   "cannot be read within 1048576 bytes");
  }
}

// ---- strict imports on one rank -------------------------------------------------------------------------------

namespace {

// Our export of a random untied cpu_tiny Llama (or Qwen3), then `change` applied to its tensors.
fs::path exported(const std::string& name, bool qwen, const std::function<void(std::map<std::string, at::Tensor>&)>& change) {
  Transformer m(qwen ? qwen3_flavor("cpu_tiny") : llama3_flavor("cpu_tiny"));
  m->init_weights(3);
  const fs::path dir = scratch(name);
  if (qwen) hf::export_qwen3(*m, dir.string());
  else hf::export_llama(*m, dir.string());
  const std::string file = (dir / "model.safetensors").string();
  auto tensors = st::load_file(file);
  change(tensors);
  st::save_file(file, {tensors.begin(), tensors.end()});
  return dir;
}

}  // namespace

TEST(HfConfig, StrayTensorsAreAnErrorOnOneRank) {
  for (bool qwen : {false, true}) {
    SCOPED_TRACE(qwen ? "qwen3" : "llama");
    const fs::path dir = exported("stray", qwen, [](auto& t) {
      t["model.layers.7.self_attn.q_proj.weight"] = at::zeros({4, 4});  // a layer the model does not have
      t["stray"] = at::zeros({2});
    });
    Transformer m(qwen ? qwen3_flavor("cpu_tiny") : llama3_flavor("cpu_tiny"));
    fsdp_test::expect_error_containing<c10::Error>(
        [&] { hf::import_hf(*m, dir.string()); },
        "the files hold tensors the model does not have (strict load): 'model.layers.7.self_attn.q_proj.weight', "
        "'stray'");
    fsdp::checkpoint::SafetensorsImportOptions lenient;
    lenient.strict = false;
    const auto r = hf::import_hf(*m, dir.string(), lenient);
    EXPECT_EQ(r.unexpected, (std::vector<std::string>{"model.layers.7.self_attn.q_proj.weight", "stray"}));
  }
}

TEST(HfConfig, UntiedConfigWithoutLmHeadIsAnError) {
  for (bool qwen : {false, true}) {
    SCOPED_TRACE(qwen ? "qwen3" : "llama");
    const fs::path dir = exported("no_lm_head", qwen, [](auto& t) { ASSERT_EQ(t.erase("lm_head.weight"), 1u); });
    Transformer m(qwen ? qwen3_flavor("cpu_tiny") : llama3_flavor("cpu_tiny"));
    fsdp_test::expect_error_containing<c10::Error>(
        [&] { hf::import_hf(*m, dir.string()); },
        "config.json says tie_word_embeddings = false but the files hold no 'lm_head.weight'");
    // Non-strict: the output layer is listed missing and left as it was (not taken from the embeddings).
    fsdp::checkpoint::SafetensorsImportOptions lenient;
    lenient.strict = false;
    const at::Tensor before = m->output->weight().clone();
    const auto r = hf::import_hf(*m, dir.string(), lenient);
    EXPECT_EQ(r.missing, std::vector<std::string>{"lm_head.weight"});
    EXPECT_TRUE(m->output->weight().equal(before));
    // A config saying the embeddings are tied: the output layer is the embeddings (as transformers ties them).
    if (!qwen) {
      json c = json::parse(std::ifstream(dir / "config.json"));
      c["tie_word_embeddings"] = true;
      std::ofstream(dir / "config.json") << c.dump();
      hf::import_hf(*m, dir.string());
      EXPECT_TRUE(m->output->weight().equal(m->tok_embeddings->weight()));
    }
  }
}
