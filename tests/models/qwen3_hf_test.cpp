// Qwen3 and Qwen3-MoE (fsdp/models/qwen3.h, fsdp/models/hf_qwen3.h) against Hugging Face transformers in the venv
// (tests/models/qwen3_hf_side.py builds small random models locally): imported weights give transformers' logits
// (dense with QK-norm, MoE layers mixed with dense ones, every layer MoE; transformers 5's stacked experts and
// the per-expert hub layout), our exported models give our logits inside transformers, bad files fail naming
// what is wrong. Every comparison checks that its reference moved and that the feature under test ran (QK-norm
// weights and experts change the logits). Plus the flavors' sizes against counts by hand and a transformers
// count, and cached generation against the full forward on an MoE model.
#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/models/hf_qwen3.h>
#include <fsdp/models/qwen3.h>

#include "expect_error.h"
#include "models/hf_side.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>

namespace fs = std::filesystem;
namespace st = fsdp::checkpoint::safetensors;
namespace hf = fsdp::models::hf;
using namespace fsdp::models::llama;

namespace {

const std::string kPython = FSDP_TEST_PYTHON;  // for skip messages
const std::string kScript = std::string(FSDP_SOURCE_DIR) + "/tests/models/qwen3_hf_side.py";
constexpr double kTol = 1e-5;

using fsdp_test::hf_side::have_transformers;
using fsdp_test::hf_side::scratch;

void run_python(const std::string& args) {
  const auto r = fsdp_test::hf_side::run_python(kScript, args);
  ASSERT_EQ(r.rc, 0) << r.command << "\n" << r.output;
}

// The args of tests/models/qwen3_hf_side.py's kinds (vocab 128, hidden 32, intermediate 64, 3 layers, 4 heads,
// 2 kv heads; MoE: 4 experts of 16, top 2, norm_topk_prob).
LlamaArgs args_of(const std::string& kind) {
  LlamaArgs a;
  a.dim = 32, a.n_layers = 3, a.n_heads = 4, a.n_kv_heads = 2, a.vocab_size = 128;
  a.explicit_head_dim = kind == "dense_wide_heads" ? 16 : 8;
  a.explicit_ffn_hidden = 64;
  a.qk_norm = true;
  a.rope_layout = RopeLayout::HalfSplit;
  a.norm_eps = 1e-6;
  a.rope_theta = 1e6;
  a.max_seq_len = 64;
  a.tie_embeddings = kind == "dense_wide_heads";
  if (kind == "moe" || kind == "moe_all") {
    fsdp::models::moe::MoEOptions o;
    o.hidden = 16, o.num_experts = 4, o.top_k = 2, o.score_func = "softmax", o.route_norm = true;
    a.moe = o;
    if (kind == "moe") a.moe_layer_step = 2, a.dense_layers = {2};
  }
  return a;
}

// One python-made model per kind and test binary run.
struct Reference {
  fs::path dir;
  at::Tensor tokens, logits;
};
const Reference& reference(const std::string& kind) {
  static std::map<std::string, Reference> made;
  auto it = made.find(kind);
  if (it != made.end()) return it->second;
  Reference r;
  r.dir = scratch(kind);
  run_python("make --kind " + kind + " --out " + r.dir.string() + " --seed 7");
  const auto ref = st::load_file((r.dir / "ref.safetensors").string());
  r.tokens = ref.at("tokens");
  r.logits = ref.at("logits");
  return made.emplace(kind, r).first->second;
}

at::Tensor forward(Transformer& m, const at::Tensor& tokens) {
  torch::NoGradGuard no_grad;
  m->eval();
  return m->forward(tokens);
}

double max_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

// transformers' logits of the model in `dir` on `tokens`.
at::Tensor transformers_logits(const fs::path& dir, const at::Tensor& tokens) {
  const fs::path in = dir / "tokens.safetensors", out = dir / "hf_logits.safetensors";
  st::save_file(in.string(), {{"tokens", tokens}});
  run_python("logits --dir " + dir.string() + " --tokens " + in.string() + " --out " + out.string());
  return st::load_file(out.string()).at("logits");
}

// Zeroes every MoE layer's expert outputs (w2): the logits must change if the MoE layers ran.
void zero_experts(Transformer& m) {
  torch::NoGradGuard no_grad;
  int n = 0;
  for (auto& b : m->blocks()) {
    if (b->moe) b->moe->experts->w2.zero_(), ++n;
  }
  ASSERT_GT(n, 0);
}

void expect_imported_equal(const std::string& kind, const std::string& layout_dir) {
  if (!have_transformers()) GTEST_SKIP() << kPython << " has no transformers";
  const Reference& ref = reference(kind);
  ASSERT_GT(ref.logits.std().item<double>(), 0.5) << "the reference did not move";
  Transformer m(args_of(kind));
  const auto r = hf::import_qwen3(*m, (ref.dir / layout_dir).string());
  EXPECT_TRUE(r.missing.empty());
  EXPECT_TRUE(r.unexpected.empty());
  const at::Tensor ours = forward(m, ref.tokens);
  ASSERT_EQ(ours.sizes(), ref.logits.sizes());
  const double diff = max_diff(ours, ref.logits);
  EXPECT_LT(diff, kTol) << kind << " from " << layout_dir;
  std::cout << kind << " from " << layout_dir << ": max |ours - transformers| = " << diff << " (logits std "
            << ref.logits.std().item<double>() << ")";
  if (args_of(kind).moe) {
    zero_experts(m);
    const double without = max_diff(forward(m, ref.tokens), ref.logits);
    EXPECT_GT(without, 1e-2) << "the MoE layers did not matter";
    std::cout << "; experts zeroed: " << without;
  }
  std::cout << "\n";
}

}  // namespace

// ---- transformers' weights in our model ---------------------------------------------------------------------

TEST(Qwen3Hf, DenseWithQkNormEqualsTransformers) {
  expect_imported_equal("dense", "hf");
  if (HasFatalFailure() || IsSkipped()) return;
  // QK-norm ran: with its weights reset to 1 the logits move away from transformers'.
  const Reference& ref = reference("dense");
  Transformer m(args_of("dense"));
  hf::import_qwen3(*m, (ref.dir / "hf").string());
  {
    torch::NoGradGuard no_grad;
    for (auto& b : m->blocks()) b->attention->q_norm->weight().fill_(1.0), b->attention->k_norm->weight().fill_(1.0);
  }
  EXPECT_GT(max_diff(forward(m, ref.tokens), ref.logits), 1e-2);
}

TEST(Qwen3Hf, DenseHeadsWiderThanHiddenTiedEqualsTransformers) {
  expect_imported_equal("dense_wide_heads", "hf");  // 4 heads x 16 = 64 != hidden 32; tied embeddings
}

TEST(Qwen3Hf, MoeStackedEqualsTransformers) {
  expect_imported_equal("moe", "hf");      // layer 1 MoE, layers 0 and 2 dense
  expect_imported_equal("moe_all", "hf");  // every layer MoE
}

TEST(Qwen3Hf, MoePerExpertLayoutEqualsTransformers) {
  expect_imported_equal("moe", "hf_per_expert");
  expect_imported_equal("moe_all", "hf_per_expert");
}

// ---- our weights in transformers ----------------------------------------------------------------------------

TEST(Qwen3Hf, ExportLoadsInTransformers) {
  if (!have_transformers()) GTEST_SKIP() << kPython << " has no transformers";
  for (const std::string kind : {"dense", "dense_wide_heads", "moe", "moe_all"}) {
    SCOPED_TRACE(kind);
    Transformer m(args_of(kind));
    m->init_weights(11);
    {
      // Larger than the init's (tiny expert outputs, unit norms), so every tensor visibly shapes the logits.
      torch::NoGradGuard no_grad;
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
      for (auto& p : m->parameters()) {
        p.copy_(p.dim() == 1 ? 1 + 0.3 * at::randn(p.sizes(), gen) : 0.2 * at::randn(p.sizes(), gen));
      }
    }
    const fs::path dir = scratch("export_" + kind);
    hf::export_qwen3(*m, dir.string());
    const at::Tensor tokens = at::randint(0, 128, {2, 11}, at::make_generator<at::CPUGeneratorImpl>(3), at::kLong);
    const at::Tensor ours = forward(m, tokens);
    ASSERT_GT(ours.std().item<double>(), 0.5);
    const at::Tensor theirs = transformers_logits(dir, tokens);
    ASSERT_EQ(theirs.sizes(), ours.sizes());
    const double diff = max_diff(ours, theirs);
    EXPECT_LT(diff, kTol);
    std::cout << "export " << kind << ": max |ours - transformers(from_pretrained)| = " << diff << "\n";
    if (args_of(kind).moe) {
      // transformers ran the experts we wrote: our logits without them are far from its.
      zero_experts(m);
      EXPECT_GT(max_diff(forward(m, tokens), theirs), 1e-2);
      // ... and our import of our export gives back the same model.
      Transformer back(args_of(kind));
      hf::import_qwen3(*back, dir.string());
      EXPECT_LT(max_diff(forward(back, tokens), theirs), kTol);
    }
  }
}

// ---- bad input -------------------------------------------------------------------------------------------------

TEST(Qwen3Hf, BadFilesNameWhatIsWrong) {
  if (!have_transformers()) GTEST_SKIP() << kPython << " has no transformers";
  const Reference& ref = reference("moe");
  // config.json of 4 experts, a model of 8.
  LlamaArgs eight = args_of("moe");
  eight.moe->num_experts = 8;
  Transformer m8(eight);
  fsdp_test::expect_error_containing<c10::Error>([&] { hf::import_qwen3(*m8, (ref.dir / "hf").string()); },
                                                 "num_local_experts = 4 (the model has 8)");
  // A dense Qwen3 checkpoint into an MoE model.
  Transformer moe(args_of("moe"));
  fsdp_test::expect_error_containing<c10::Error>(
      [&] { hf::import_qwen3(*moe, (reference("dense").dir / "hf").string()); }, "model_type = \"qwen3\"");
  // One expert's up_proj gone from the per-expert layout.
  const fs::path dir = scratch("missing_expert");
  fs::copy_file(ref.dir / "hf_per_expert" / "config.json", dir / "config.json");
  auto tensors = st::load_file((ref.dir / "hf_per_expert" / "model.safetensors").string());
  ASSERT_EQ(tensors.erase("model.layers.1.mlp.experts.3.up_proj.weight"), 1u);
  st::save_file((dir / "model.safetensors").string(), {tensors.begin(), tensors.end()});
  fsdp_test::expect_error_containing<c10::Error>([&] { hf::import_qwen3(*moe, dir.string()); },
                                                 "'model.layers.1.mlp.experts.3.up_proj.weight' (expert 3 of 4");
  // A Llama-style model is not a Qwen3.
  Transformer llama(llama3_flavor("cpu_tiny"));
  fsdp_test::expect_error_containing<c10::Error>([&] { hf::export_qwen3(*llama, dir.string()); },
                                                 "half-split RoPE");
}

// ---- flavors ---------------------------------------------------------------------------------------------------

TEST(Qwen3, FlavorSizes) {
  // debugmodel_moe: transformers' Qwen3MoeConfig with the same sizes counts 315,758,848 parameters
  // (shared/reference/moe-expert-parallel.md, measured on meta).
  EXPECT_EQ(num_params(qwen3_flavor("debugmodel_moe")), 315758848);
  // By hand, debugmodel_moe per layer: attention 256*2048 + 2*256*1024 + 2048*256 + QK-norm 2*128, experts
  // 64*3*256*768, gate 256*64, norms 2*256; embeddings and output 2*2048*256, final norm 256.
  const int64_t attn = 256 * 2048 + 2 * 256 * 1024 + 2048 * 256 + 2 * 128;
  EXPECT_EQ(num_params(qwen3_flavor("debugmodel_moe")),
            8 * (attn + 64 * 3 * 256 * 768 + 256 * 64 + 2 * 256) + 2 * 2048 * 256 + 256);
  // Active: 8 of 64 experts.
  EXPECT_EQ(num_active_params(qwen3_flavor("debugmodel_moe")),
            8 * (attn + 8 * 3 * 256 * 768 + 256 * 64 + 2 * 256) + 2 * 2048 * 256 + 256);
  // The released models' stated sizes: 30B-A3B 30.5B total / 3.3B active, 235B-A22B 235B / 22B, 0.6B (tied
  // embeddings), 8B 8.2B.
  EXPECT_NEAR(num_params(qwen3_flavor("30B-A3B")) / 1e9, 30.5, 0.05);
  EXPECT_NEAR(num_active_params(qwen3_flavor("30B-A3B")) / 1e9, 3.3, 0.1);
  EXPECT_NEAR(num_params(qwen3_flavor("235B-A22B")) / 1e9, 235.1, 0.1);
  EXPECT_NEAR(num_active_params(qwen3_flavor("235B-A22B")) / 1e9, 22.0, 0.25);
  EXPECT_NEAR(num_params(qwen3_flavor("0.6B")) / 1e9, 0.596, 0.005);
  EXPECT_NEAR(num_params(qwen3_flavor("8B")) / 1e9, 8.19, 0.01);
  // Constructed models (the MoE ones on meta: no memory) have exactly the counted parameters, TorchTitan's FQNs.
  for (const auto& name : qwen3_flavor_names()) {
    SCOPED_TRACE(name);
    LlamaArgs a = qwen3_flavor(name);
    if (num_params(a) > 100'000'000) {
      if (!a.moe) continue;  // dense real sizes: counted above
      if (num_params(a) > 2'000'000'000) continue;
      a.device = c10::kMeta;
    }
    Transformer m(a);
    int64_t n = 0;
    for (const auto& p : m->parameters()) {
      n += p.numel();
      EXPECT_EQ(p.device(), a.device);
    }
    EXPECT_EQ(n, num_params(a));
    const auto params = m->named_parameters();
    EXPECT_TRUE(params.contains("layers.0.attention.q_norm.weight"));
    EXPECT_TRUE(params.contains(a.moe ? "layers.0.moe.experts.w1" : "layers.0.feed_forward.w1.weight"));
    EXPECT_EQ(m->named_buffers().contains("layers.0.moe.expert_bias"), a.moe.has_value());
  }
  EXPECT_EQ(model_flavor("qwen3", "cpu_tiny_moe").moe->num_experts, 8);
  EXPECT_EQ(model_flavor("llama3", "cpu_tiny").dim, 64);
  fsdp_test::expect_error_containing<c10::Error>([] { model_flavor("gpt2", "small"); },
                                                 "unknown model 'gpt2' (known: llama3, qwen3)");
  fsdp_test::expect_error_containing<c10::Error>([] { qwen3_flavor("7B"); }, "unknown qwen3 flavor '7B'");
}

TEST(Qwen3, MoeLayerRuleIsHuggingFaces) {
  LlamaArgs a = qwen3_flavor("cpu_small_moe");  // 4 layers
  a.moe_layer_step = 2;
  a.dense_layers = {3};
  // (i + 1) % 2 == 0 -> layers 1, 3; layer 3 listed dense.
  EXPECT_FALSE(a.is_moe_layer(0));
  EXPECT_TRUE(a.is_moe_layer(1));
  EXPECT_FALSE(a.is_moe_layer(2));
  EXPECT_FALSE(a.is_moe_layer(3));
  Transformer m(a);
  EXPECT_TRUE(m->blocks()[1]->moe && !m->blocks()[1]->feed_forward);
  EXPECT_TRUE(!m->blocks()[3]->moe && m->blocks()[3]->feed_forward);
  int64_t n = 0;
  for (const auto& p : m->parameters()) n += p.numel();
  EXPECT_EQ(n, num_params(a));
}

TEST(Qwen3, InitIsDeterministicAndCoversMoe) {
  auto init = [](uint64_t seed) {
    Transformer m(qwen3_flavor("cpu_tiny_moe"));
    m->init_weights(seed);
    return m;
  };
  Transformer a = init(3), b = init(3), c = init(4);
  const auto pa = a->named_parameters(), pb = b->named_parameters(), pc = c->named_parameters();
  for (const auto& item : pa) {
    EXPECT_TRUE(item.value().equal(pb[item.key()])) << item.key();
    if (item.key().find("norm") == std::string::npos) EXPECT_FALSE(item.value().equal(pc[item.key()])) << item.key();
  }
  EXPECT_GT(a->blocks()[0]->moe->experts->w1.abs().sum().item<double>(), 0);
  // The scoped init visits every part: a scope that records the parts sees both blocks (MoE inside).
  int parts = 0;
  a->init_weights(3, [&](torch::nn::Module&, const std::function<void()>& fn) { ++parts, fn(); });
  EXPECT_EQ(parts, 1 + 2 + 1 + 1);
  for (const auto& item : a->named_parameters()) EXPECT_TRUE(item.value().equal(pb[item.key()])) << item.key();
}

TEST(Qwen3, CachedGenerationEqualsForwardWithMoe) {
  Transformer m(qwen3_flavor("cpu_tiny_moe"));
  m->init_weights(1);
  m->eval();
  torch::NoGradGuard no_grad;
  const at::Tensor tokens = at::randint(0, 2048, {2, 7}, at::make_generator<at::CPUGeneratorImpl>(2), at::kLong);
  const at::Tensor full = m->forward(tokens);
  KVCache cache = m->make_kv_cache(2, 7);
  const at::Tensor first = m->forward_cached(tokens.slice(1, 0, 4), cache);
  const at::Tensor rest = m->forward_cached(tokens.slice(1, 4, 7), cache);
  EXPECT_LT(max_diff(at::cat({first, rest}, 1), full), 1e-5);
}

TEST(Qwen3Hf, ExportRefusesSplitExperts) {
  // What expert parallelism leaves on a rank: half of each layer's experts, no fully_shard.
  Transformer m(args_of("moe_all"));
  {
    torch::NoGradGuard no_grad;
    for (auto& b : m->blocks()) {
      for (at::Tensor* w : {&b->moe->experts->w1, &b->moe->experts->w2, &b->moe->experts->w3})
        w->set_data(w->narrow(0, 0, 2).clone());
    }
  }
  fsdp_test::expect_error_containing<c10::Error>(
      [&] { hf::export_qwen3(*m, scratch("split_experts").string()); }, "layer 0 holds 2 of its 4 experts");
}
