// DeepSeek-V3 (fsdp/models/deepseek_v3.h, fsdp/models/hf_deepseek_v3.h) against Hugging Face transformers'
// DeepseekV3ForCausalLM in the venv (tests/models/deepseek_v3_hf_side.py builds small random models locally):
// imported weights give transformers' logits (with q LoRA and without; sigmoid routing limited to 2 of 4 groups,
// a shared expert, a random load-balancing bias, YaRN with mscale != mscale_all_dim; transformers 5's stacked
// experts and the per-expert hub layout); our exported model gives our logits inside transformers; each feature
// moves the logits (group limit, YaRN, the bias, the shared expert, q LoRA's norm). Plus: the real flavors'
// sizes against the published counts, document masking against documents run alone, a training step (finite
// gradients on every parameter, the loss going down), bad config.json fields refused by name.
#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/models/deepseek_v3.h>
#include <fsdp/models/hf_deepseek_v3.h>

#include "expect_error.h"
#include "models/hf_side.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

namespace fs = std::filesystem;
namespace st = fsdp::checkpoint::safetensors;
namespace hf = fsdp::models::hf;
using namespace fsdp::models::deepseek_v3;
namespace llama = fsdp::models::llama;

// `expr` throws a c10::Error whose message holds `needle`.
#define EXPECT_ERROR_CONTAINS(expr, needle) \
  fsdp_test::expect_error_containing<c10::Error>([&] { (void)(expr); }, needle)

namespace {

const std::string kPython = FSDP_TEST_PYTHON;
const std::string kScript = std::string(FSDP_SOURCE_DIR) + "/tests/models/deepseek_v3_hf_side.py";
constexpr double kTol = 1e-5;

using fsdp_test::hf_side::have_transformers;
using fsdp_test::hf_side::scratch;

void run_python(const std::string& args) {
  const auto r = fsdp_test::hf_side::run_python(kScript, args);
  ASSERT_EQ(r.rc, 0) << r.command << "\n" << r.output;
}

// The args of deepseek_v3_hf_side.py's kinds, written out by hand from its config (not read from config.json).
DeepSeekV3Args args_of(const std::string& kind) {
  DeepSeekV3Args a;
  a.vocab_size = 128, a.dim = 32, a.inter_dim = 64, a.n_layers = 3, a.n_dense_layers = 1, a.n_heads = 4;
  a.q_lora_rank = kind == "lora" ? 16 : 0;
  a.kv_lora_rank = 16, a.qk_nope_head_dim = 8, a.qk_rope_head_dim = 8, a.v_head_dim = 8;
  a.norm_eps = 1e-6, a.latent_norm_eps = 1e-6;
  a.rope_theta = 10000.0;
  llama::RopeScaling s;
  s.type = llama::RopeScaling::Type::Yarn;
  s.factor = 4.0, s.original_max_position_embeddings = 16, s.beta_fast = 32, s.beta_slow = 1;
  s.mscale = 1.0, s.mscale_all_dim = 0.8;
  a.rope_scaling = s;
  a.max_seq_len = 64;
  a.moe.hidden = 16, a.moe.num_experts = 8, a.moe.top_k = 2, a.moe.num_shared_experts = 1;
  a.moe.score_func = "sigmoid", a.moe.route_norm = kind == "lora", a.moe.route_scale = 2.5;
  a.moe.num_expert_groups = 4, a.moe.num_limited_groups = 2;
  return a;
}

struct Reference {
  fs::path dir;
  at::Tensor tokens, logits;
};
const Reference& reference(const std::string& kind) {
  static std::map<std::string, Reference> made;
  auto it = made.find(kind);
  if (it != made.end()) return it->second;
  Reference r;
  r.dir = scratch("ds_" + kind);
  run_python("make --kind " + kind + " --out " + r.dir.string() + " --seed 11");
  const auto ref = st::load_file((r.dir / "ref.safetensors").string());
  r.tokens = ref.at("tokens");
  r.logits = ref.at("logits");
  return made.emplace(kind, r).first->second;
}

at::Tensor forward(DeepSeekV3& m, const at::Tensor& tokens) {
  torch::NoGradGuard no_grad;
  m->eval();
  return m->forward(tokens);
}

double max_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

at::Tensor transformers_logits(const fs::path& dir, const at::Tensor& tokens) {
  const fs::path in = dir / "tokens.safetensors", out = dir / "hf_logits.safetensors";
  st::save_file(in.string(), {{"tokens", tokens}});
  run_python("logits --dir " + dir.string() + " --tokens " + in.string() + " --out " + out.string());
  return st::load_file(out.string()).at("logits");
}

// `dst` gets `src`'s parameters and buffers (same FQNs): the same weights under other args.
void copy_state(DeepSeekV3& dst, DeepSeekV3& src) {
  torch::NoGradGuard no_grad;
  auto from = src->named_parameters();
  for (auto& p : dst->named_parameters()) p.value().copy_(from[p.key()]);
  auto bufs = src->named_buffers();
  for (auto& b : dst->named_buffers()) b.value().copy_(bufs[b.key()]);
}

DeepSeekV3 imported(const std::string& kind, const std::string& layout) {
  const Reference& ref = reference(kind);
  DeepSeekV3 m(args_of(kind));
  const auto r = hf::import_deepseek_v3(*m, (ref.dir / layout).string());
  EXPECT_TRUE(r.missing.empty());
  EXPECT_TRUE(r.unexpected.empty());
  return m;
}

void expect_imported_equal(const std::string& kind, const std::string& layout) {
  if (!have_transformers()) GTEST_SKIP() << kPython << " has no transformers";
  const Reference& ref = reference(kind);
  ASSERT_GT(ref.logits.std().item<double>(), 0.5) << "the reference did not move";
  DeepSeekV3 m = imported(kind, layout);
  const double d = max_diff(forward(m, ref.tokens), ref.logits);
  EXPECT_LT(d, kTol) << kind << " / " << layout;
}

}  // namespace

TEST(DeepSeekV3Hf, ImportWithQLoraStackedExpertsEqualsTransformers) { expect_imported_equal("lora", "hf"); }
TEST(DeepSeekV3Hf, ImportWithQLoraPerExpertEqualsTransformers) { expect_imported_equal("lora", "hf_per_expert"); }
TEST(DeepSeekV3Hf, ImportWithoutQLoraEqualsTransformers) { expect_imported_equal("no_lora", "hf_per_expert"); }

TEST(DeepSeekV3Hf, ConfigJsonReadsTheArgsTransformersUses) {
  if (!have_transformers()) GTEST_SKIP() << kPython << " has no transformers";
  for (const std::string kind : {"lora", "no_lora"}) {
    const DeepSeekV3Args got = hf::read_deepseek_v3_config((reference(kind).dir / "hf").string());
    const DeepSeekV3Args want = args_of(kind);
    EXPECT_EQ(got.q_lora_rank, want.q_lora_rank) << kind;
    EXPECT_EQ(got.n_dense_layers, want.n_dense_layers);
    EXPECT_EQ(got.moe.num_expert_groups, 4);
    EXPECT_EQ(got.moe.num_limited_groups, 2);
    EXPECT_EQ(got.moe.route_norm, want.moe.route_norm);
    EXPECT_DOUBLE_EQ(got.moe.route_scale, 2.5);
    ASSERT_TRUE(got.rope_scaling.has_value());
    EXPECT_DOUBLE_EQ(*got.rope_scaling->mscale_all_dim, 0.8);
    EXPECT_DOUBLE_EQ(got.softmax_scale(), want.softmax_scale());
    // A model built from config.json alone loads the files and computes transformers' logits.
    DeepSeekV3 m(got);
    hf::import_deepseek_v3(*m, (reference(kind).dir / "hf_per_expert").string());
    EXPECT_LT(max_diff(forward(m, reference(kind).tokens), reference(kind).logits), kTol) << kind;
  }
}

// Each feature changes the logits, so that the equality above could not hold without it.
TEST(DeepSeekV3Hf, EveryFeatureMovesTheLogits) {
  if (!have_transformers()) GTEST_SKIP() << kPython << " has no transformers";
  const Reference& ref = reference("lora");
  DeepSeekV3 base = imported("lora", "hf");
  const at::Tensor want = forward(base, ref.tokens);
  auto moved_by = [&](const std::string& what, const std::function<void(DeepSeekV3Args&)>& change_args,
                      const std::function<void(DeepSeekV3&)>& change_weights) {
    DeepSeekV3Args a = args_of("lora");
    if (change_args) change_args(a);
    DeepSeekV3 m(a);
    copy_state(m, base);
    if (change_weights) change_weights(m);
    const double d = max_diff(forward(m, ref.tokens), want);
    EXPECT_GT(d, 1e-3) << what << " did not change the logits";
  };
  moved_by("group-limited routing off", [](DeepSeekV3Args& a) { a.moe.num_expert_groups = 0; }, nullptr);
  moved_by("YaRN off", [](DeepSeekV3Args& a) { a.rope_scaling.reset(); }, nullptr);
  moved_by("mscale_all_dim (softmax scale)", [](DeepSeekV3Args& a) { a.rope_scaling->mscale_all_dim = 1.0; }, nullptr);
  moved_by("route scale 1", [](DeepSeekV3Args& a) { a.moe.route_scale = 1.0; }, nullptr);
  moved_by("load-balancing bias zeroed", nullptr, [](DeepSeekV3& m) {
    torch::NoGradGuard g;
    for (auto& b : m->blocks()) if (b->moe) b->moe->expert_bias.zero_();
  });
  moved_by("shared expert zeroed", nullptr, [](DeepSeekV3& m) {
    torch::NoGradGuard g;
    for (auto& b : m->blocks()) if (b->moe) m->named_parameters()["layers." + std::to_string(b->layer_id) +
                                                                  ".moe.shared_experts.w2.weight"].zero_();
  });
  moved_by("q LoRA norm weights reset", nullptr, [](DeepSeekV3& m) {
    for (auto& b : m->blocks()) b->attention->q_norm->reset_parameters();
  });
}

TEST(DeepSeekV3Hf, ExportLoadsInTransformersWithOurLogits) {
  if (!have_transformers()) GTEST_SKIP() << kPython << " has no transformers";
  const at::Tensor tokens = torch::randint(0, 128, {2, 9}, torch::kLong);
  for (const std::string kind : {"lora", "no_lora"}) {
    DeepSeekV3 m(args_of(kind));
    m->init_weights(5);
    {
      // Norms and the bias away from 1 and 0, so a swapped norm or a dropped bias would show.
      torch::NoGradGuard g;
      for (auto& p : m->named_parameters()) {
        if (p.value().dim() == 1) p.value().add_(0.3 * torch::randn_like(p.value()));
      }
      for (auto& b : m->blocks()) if (b->moe) b->moe->expert_bias.copy_(0.3 * torch::randn({8}));
    }
    const at::Tensor ours = forward(m, tokens);
    ASSERT_GT(ours.std().item<double>(), 0.1);
    const fs::path dir = scratch("ds_export_" + kind);
    hf::export_deepseek_v3(*m, dir.string());
    const at::Tensor theirs = transformers_logits(dir, tokens);
    EXPECT_LT(max_diff(ours, theirs), kTol) << kind;
    // And back: our import of our export gives the same logits again.
    DeepSeekV3 back(args_of(kind));
    hf::import_deepseek_v3(*back, dir.string());
    EXPECT_EQ(max_diff(forward(back, tokens), ours), 0.0) << kind;
  }
}

TEST(DeepSeekV3Hf, BadConfigFieldsAreRefusedByName) {
  if (!have_transformers()) GTEST_SKIP() << kPython << " has no transformers";
  const fs::path src = reference("lora").dir / "hf" / "config.json";
  auto edited = [&](const std::string& field, const nlohmann::json& value) {
    std::ifstream in(src);
    nlohmann::json c = nlohmann::json::parse(in);
    c[field] = value;
    const fs::path dir = scratch("ds_bad_" + field);
    std::ofstream(dir / "config.json") << c.dump(2);
    return dir.string();
  };
  EXPECT_ERROR_CONTAINS(hf::read_deepseek_v3_config(edited("rope_interleave", false)), "'rope_interleave'");
  EXPECT_ERROR_CONTAINS(hf::read_deepseek_v3_config(edited("num_key_value_heads", 2)), "'num_key_value_heads'");
  EXPECT_ERROR_CONTAINS(hf::read_deepseek_v3_config(edited("attention_bias", true)), "'attention_bias'");
  EXPECT_ERROR_CONTAINS(hf::read_deepseek_v3_config(edited("hidden_act", "gelu")), "'hidden_act'");
  EXPECT_ERROR_CONTAINS(hf::read_deepseek_v3_config(edited("n_group", 3)), "'n_group'");
  EXPECT_ERROR_CONTAINS(hf::read_deepseek_v3_config(edited("model_type", "qwen3")), "'model_type'");
  // A config.json describing another model than the one imported into: the mismatch named.
  DeepSeekV3Args other = args_of("lora");
  other.moe.num_limited_groups = 3;
  DeepSeekV3 m(other);
  EXPECT_ERROR_CONTAINS(hf::import_deepseek_v3(*m, (reference("lora").dir / "hf").string()), "topk_group = 2");
}

// The real flavors, built on meta, against the published sizes (DeepSeek-V3: 671B parameters without its MTP
// module; DeepSeek-V2-Lite, TorchTitan's 16B: 15.7B with 2.4B active; DeepSeek-V2: 236B, 21B active).
TEST(DeepSeekV3Flavors, RealFlavorsHaveThePublishedSizes) {
  auto built = [](const std::string& name) {
    DeepSeekV3Args a = deepseek_v3_flavor(name);
    a.device = c10::kMeta;
    DeepSeekV3 m(a);
    int64_t n = 0;
    for (const auto& p : m->parameters()) {
      EXPECT_TRUE(p.is_meta());
      n += p.numel();
    }
    EXPECT_EQ(n, num_params(a)) << name;
    // The published activated counts leave out the input embedding (a lookup, not a matmul).
    const double active = static_cast<double>(num_active_params(a) - a.vocab_size * a.dim);
    return std::pair<double, double>(static_cast<double>(num_params(a)), active);
  };
  auto [v3, v3_active] = built("671B");
  EXPECT_NEAR(v3 / 1e9, 671.0, 0.5);
  EXPECT_NEAR(v3_active / 1e9, 37.0, 0.5);
  auto [v2, v2_active] = built("236B");
  EXPECT_NEAR(v2 / 1e9, 236.0, 0.5);
  EXPECT_NEAR(v2_active / 1e9, 21.0, 0.5);
  auto [lite, lite_active] = built("16B");
  EXPECT_NEAR(lite / 1e9, 15.7, 0.05);
  EXPECT_NEAR(lite_active / 1e9, 2.4, 0.1);
  built("debugmodel");
}

// TorchTitan's FLOP count, computed as its get_moe_model_nparams_and_flops does: from the built model's named
// parameters (embedding, router, shared experts, routed experts scaled by top_k / E, the rest dense).
TEST(DeepSeekV3Flavors, FlopsPerTokenFollowTorchTitansCount) {
  for (const std::string name : {"debugmodel", "16B"}) {
    DeepSeekV3Args a = deepseek_v3_flavor(name);
    a.device = c10::kMeta;
    DeepSeekV3 m(a);
    double embedding = 0, router = 0, shared = 0, experts = 0, dense = 0;
    for (const auto& p : m->named_parameters()) {
      const double n = static_cast<double>(p.value().numel());
      const std::string& k = p.key();
      if (k.find("tok_embeddings") != std::string::npos) embedding += n;
      else if (k.find("moe.shared_experts") != std::string::npos) shared += n;
      else if (k.find("moe.router") != std::string::npos) router += n;
      else if (k.find("moe.experts") != std::string::npos) experts += n;
      else dense += n;
    }
    const double active = dense + router + shared + experts * a.moe.top_k / a.moe.num_experts;
    const int64_t seq = 4096;
    const double want = 6 * active + 6.0 * a.n_layers * a.n_heads * (a.qk_head_dim() + a.v_head_dim) * seq;
    EXPECT_NEAR(flops_per_token(a, seq) / want, 1.0, 1e-12) << name;
    EXPECT_GT(embedding, 0);
  }
}

// TorchTitan's debugmodel and 671B as transformers builds them from our config.json: the same parameter count.
TEST(DeepSeekV3Flavors, TransformersCountsTheFlavorsAsWeDo) {
  if (!have_transformers()) GTEST_SKIP() << kPython << " has no transformers";
  for (const std::string name : {"debugmodel", "671B"}) {
    const DeepSeekV3Args a = deepseek_v3_flavor(name);
    const fs::path dir = scratch("ds_count_" + name);
    std::ofstream(dir / "config.json") << hf::deepseek_v3_config_json(a);
    run_python("count --dir " + dir.string());
    std::ifstream in(dir / "count");
    int64_t theirs = 0;
    in >> theirs;
    EXPECT_EQ(num_params(a), theirs) << name;
  }
  EXPECT_ERROR_CONTAINS(deepseek_v3_flavor("7B"), "known: cpu_tiny");
}

// block_causal: a packed row of two documents gives each document the logits it has alone (attention depends
// only on distances, the MoE is per token), and differs from causal attention over the packed row.
TEST(DeepSeekV3Model, BlockCausalEqualsDocumentsAlone) {
  DeepSeekV3Args a = deepseek_v3_flavor("cpu_tiny");
  a.attn_mask_type = llama::AttnMaskType::BlockCausal;
  DeepSeekV3 packed(a);
  packed->init_weights(3);
  a.attn_mask_type = llama::AttnMaskType::Causal;
  DeepSeekV3 plain(a);
  copy_state(plain, packed);
  const int64_t eos = 0;
  at::Tensor doc1 = torch::randint(1, 2048, {1, 5}, torch::kLong), doc2 = torch::randint(1, 2048, {1, 7}, torch::kLong);
  doc1.index_put_({0, 4}, eos);
  const at::Tensor tokens = torch::cat({doc1, doc2}, 1);
  torch::NoGradGuard g;
  packed->eval(), plain->eval();
  const at::Tensor got = packed->forward(tokens, llama::document_ids(tokens, eos));
  const at::Tensor alone = torch::cat({plain->forward(doc1), plain->forward(doc2)}, 1);
  EXPECT_LT(max_diff(got, alone), 1e-5);
  EXPECT_GT(max_diff(plain->forward(tokens), alone), 1e-3) << "the mask made no difference";
  EXPECT_ERROR_CONTAINS(packed->forward(tokens), "document ids");
}

// Training smoke: every parameter gets a finite, non-zero gradient, and AdamW steps on one batch lower its loss.
TEST(DeepSeekV3Model, GradientsAreFiniteAndTrainingLowersTheLoss) {
  DeepSeekV3 m(deepseek_v3_flavor("cpu_tiny"));
  m->init_weights(1);
  m->train();
  const at::Tensor tokens = torch::randint(0, 2048, {2, 17}, torch::kLong);
  const at::Tensor inputs = tokens.narrow(1, 0, 16), labels = tokens.narrow(1, 1, 16);
  auto loss_of = [&] {
    return torch::nn::functional::cross_entropy(m->forward(inputs).flatten(0, 1), labels.flatten());
  };
  torch::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(3e-3));
  const double first = loss_of().item<double>();
  for (int step = 0; step < 5; ++step) {
    opt.zero_grad();
    at::Tensor loss = loss_of();
    loss.backward();
    if (step == 0) {
      for (const auto& p : m->named_parameters()) {
        ASSERT_TRUE(p.value().grad().defined()) << p.key();
        EXPECT_TRUE(p.value().grad().isfinite().all().item<bool>()) << p.key();
        EXPECT_GT(p.value().grad().abs().sum().item<double>(), 0.0) << p.key();
      }
    }
    opt.step();
    for (auto& b : m->blocks()) if (b->moe) b->moe->update_expert_bias();
  }
  const double last = loss_of().item<double>();
  EXPECT_LT(last, first - 0.1) << "first " << first << ", last " << last;
}
