// The model seam (apps/fsdp-train/model_spec.h): every registered family answers every entry of its TrainSpec, its
// meta-built model has the shapes, parameter count and FLOPs the model library's own flavor gives (counted here
// from the built module and TorchTitan's formula), its forward and KV-cached forward equal the library model's,
// and its layout check refuses what the family cannot train before any process group exists.
#include "config.h"
#include "model_spec.h"
#include "parallel_dims.h"
#include "trainer.h"

#include <fsdp/models/deepseek_v3.h>
#include <fsdp/models/llama.h>
#include <fsdp/models/qwen3.h>
#include <fsdp/process_group.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <vector>

using namespace fsdp_train;

namespace {

JobConfig job(const std::string& name, const std::string& flavor, std::vector<std::string> more = {}) {
  std::vector<std::string> args{"--model.name", name, "--model.flavor", flavor, "--training.seq_len", "16"};
  args.insert(args.end(), more.begin(), more.end());
  return load_config(args);
}

std::string config_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(ModelSpec, RegistryHoldsEveryFamilyWithEveryEntry) {
  EXPECT_EQ(train_spec_names(), (std::vector<std::string>{"llama3", "qwen3", "deepseek_v3"}));
  for (const auto& name : train_spec_names()) {
    SCOPED_TRACE(name);
    const TrainSpec& spec = train_spec(name);
    EXPECT_EQ(spec.name, name);
    EXPECT_FALSE(spec.flavors.empty());
    EXPECT_TRUE(spec.build && spec.check_layout && spec.parallelize && spec.split_pipeline && spec.tp_plan);
    EXPECT_TRUE(spec.hf.import_weights && spec.hf.export_weights);
  }
  // The model library's flavor lists, family by family.
  EXPECT_EQ(train_spec("llama3").flavors, fsdp::models::llama::llama3_flavor_names());
  EXPECT_EQ(train_spec("qwen3").flavors, fsdp::models::llama::qwen3_flavor_names());
  EXPECT_EQ(train_spec("deepseek_v3").flavors, fsdp::models::deepseek_v3::deepseek_v3_flavor_names());
  for (const std::string flavor : {"cpu_tiny", "debugmodel", "16B", "671B"}) {  // TorchTitan's, and ours
    const auto& f = train_spec("deepseek_v3").flavors;
    EXPECT_NE(std::find(f.begin(), f.end(), flavor), f.end()) << flavor;
  }
  const std::string unknown = config_error_of([] { train_spec("gpt2"); });
  EXPECT_NE(unknown.find("model.name = \"gpt2\""), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("llama3, qwen3, deepseek_v3"), std::string::npos) << unknown;
  // fsdp-train's first check (before any layout rule or process group) is the same one line.
  const std::string unknown_job = config_error_of([] { check_model_layout(job("gpt2", "cpu_tiny"), 1); });
  EXPECT_NE(unknown_job.find("model.name = \"gpt2\" is not a registered model family (llama3, qwen3, deepseek_v3)"),
            std::string::npos)
      << unknown_job;
}

// Built on meta: no storage, the parameter count the module holds, and TorchTitan's FLOPs per token
// (6 x non-embedding parameters + 6 x layers x heads x head_dim x seq) from the module's own shapes.
TEST(ModelSpec, MetaBuildHasTheFlavorsShapesCountsAndFlops) {
  struct Case {
    std::string name, flavor;
    fsdp::models::llama::LlamaArgs args;
  };
  const std::vector<Case> cases{{"llama3", "cpu_tiny", fsdp::models::llama::llama3_flavor("cpu_tiny")},
                                {"llama3", "debugmodel", fsdp::models::llama::llama3_flavor("debugmodel")},
                                {"qwen3", "cpu_tiny", fsdp::models::llama::qwen3_flavor("cpu_tiny")},
                                {"qwen3", "cpu_tiny_moe", fsdp::models::llama::qwen3_flavor("cpu_tiny_moe")}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name + " " + c.flavor);
    ModelShape shape;
    shape.vocab_size = 300;
    shape.max_seq_len = 16;
    shape.device = c10::kMeta;
    const TrainModel model = train_spec(c.name).build(job(c.name, c.flavor), shape);
    int64_t params = 0, embedding = 0, layers = 0;
    for (const auto& p : model.module->named_parameters()) {
      EXPECT_TRUE(p.value().is_meta()) << p.key();
      params += p.value().numel();
      if (p.key() == "tok_embeddings.weight") {
        embedding = p.value().numel();
        EXPECT_EQ(p.value().size(0), 300);  // the vocabulary follows the shape (the tokenizer's)
      }
    }
    for (const auto& child : model.module->named_modules("", false))
      if (child.key().rfind("layers.", 0) == 0 && child.key().find('.', 7) == std::string::npos) ++layers;
    EXPECT_EQ(layers, c.args.n_layers);
    EXPECT_EQ(model.num_params, params);
    EXPECT_NE(model.summary.find("vocab 300"), std::string::npos) << model.summary;
    if (c.args.moe) continue;  // MoE FLOPs count only the top_k experts a token visits (library test)
    const int64_t head_dim = c.args.explicit_head_dim.value_or(c.args.dim / c.args.n_heads);
    const double flops = 6.0 * static_cast<double>(params - embedding) +
                         6.0 * static_cast<double>(c.args.n_layers * c.args.n_heads * head_dim * 16);
    EXPECT_DOUBLE_EQ(model.flops_per_token, flops);
  }
}

// Built on the CPU and initialised through the seam = the library's model built and initialised directly
// (the same logits); the cached forward over a prompt and then one token = the full forward's last positions.
TEST(ModelSpec, ForwardAndCachedForwardEqualTheLibraryModel) {
  for (const auto& [name, flavor] : std::vector<std::pair<std::string, std::string>>{{"llama3", "cpu_tiny"},
                                                                                      {"qwen3", "cpu_tiny_moe"}}) {
    SCOPED_TRACE(name + " " + flavor);
    ModelShape shape;
    shape.vocab_size = 64;
    shape.max_seq_len = 16;
    const TrainModel model = train_spec(name).build(job(name, flavor), shape);
    model.init_weights(7, {});
    auto args = fsdp::models::llama::model_flavor(name, flavor);
    args.vocab_size = 64;
    args.max_seq_len = 16;
    fsdp::models::llama::Transformer reference(args);
    reference->init_weights(7);
    torch::NoGradGuard no_grad;
    const auto tokens = torch::randint(0, 64, {1, 9}, torch::kLong);
    const auto logits = model.forward(tokens);
    EXPECT_TRUE(torch::equal(logits, reference->forward(tokens)));
    auto cached = model.cached_forward(16);
    const auto prompt_logits = cached(tokens.slice(1, 0, 8));
    const auto next_logits = cached(tokens.slice(1, 8, 9));
    EXPECT_TRUE(torch::allclose(prompt_logits, logits.slice(1, 0, 8), 1e-5, 1e-5));
    EXPECT_TRUE(torch::allclose(next_logits, logits.slice(1, 8, 9), 1e-5, 1e-5));
  }
}

// Refused layouts name the family, the flavor and the layout, from the config and the world size alone: no
// process group exists in this test.
TEST(ModelSpec, LayoutCheckRefusesBeforeAnyProcessGroup) {
  ASSERT_FALSE(fsdp::is_initialized());
  const auto dense_ep = config_error_of(
      [] { check_model_layout(job("llama3", "cpu_tiny", {"--parallelism.expert_parallel_degree", "2"}), 2); });
  EXPECT_NE(dense_ep.find("llama3 cpu_tiny has no MoE layers"), std::string::npos) << dense_ep;
  // The control: the layouts each family does train pass (op-level SAC with MoE counts the experts' tokens once:
  // tests/trainer/ac_test.cpp).
  EXPECT_EQ(config_error_of([] {
              check_model_layout(job("qwen3", "cpu_tiny_moe", {"--activation_checkpoint.mode", "selective",
                                                               "--activation_checkpoint.selective_ac_option", "op"}),
                                 1);
            }),
            "");
  EXPECT_EQ(config_error_of([] {
              check_model_layout(job("qwen3", "cpu_tiny_moe", {"--parallelism.expert_parallel_degree", "2"}), 2);
            }),
            "");
  EXPECT_EQ(config_error_of([] {
              check_model_layout(job("llama3", "cpu_tiny", {"--parallelism.tensor_parallel_degree", "2"}), 2);
            }),
            "");
  EXPECT_EQ(config_error_of([] {
              check_model_layout(job("qwen3", "cpu_tiny_moe",
                                     {"--parallelism.pipeline_parallel_degree", "2",
                                      "--parallelism.expert_parallel_degree", "2"}),
                                 4);
             }),
             "");
  // MoE under PP and TP together, EP borrowing from each stage's dp_shard x tp (issue 37;
  // tests/trainer/moe_pipeline_test.cpp trains it).
  EXPECT_EQ(config_error_of([] {
              check_model_layout(job("qwen3", "cpu_tiny_moe",
                                     {"--parallelism.pipeline_parallel_degree", "2",
                                      "--parallelism.tensor_parallel_degree", "2",
                                      "--parallelism.expert_parallel_degree", "2"}),
                                 8);
            }),
            "");
  // The sequence balance loss under TP (on whole sequences: tests/trainer/moe_parity_test.cpp).
  EXPECT_EQ(config_error_of([] {
              check_model_layout(job("qwen3", "cpu_tiny_moe", {"--parallelism.tensor_parallel_degree", "2",
                                                               "--model.moe_sequence_aux_loss_coeff", "1e-4"}),
                                 2);
            }),
            "");
  // MoE under TP, and EP borrowing its ranks from dp_shard x tp (issue 37).
  EXPECT_EQ(config_error_of([] {
              check_model_layout(job("qwen3", "cpu_tiny_moe", {"--parallelism.tensor_parallel_degree", "2"}), 2);
            }),
            "");
  EXPECT_EQ(config_error_of([] {
              check_model_layout(job("qwen3", "cpu_tiny_moe", {"--parallelism.tensor_parallel_degree", "2",
                                                               "--parallelism.expert_parallel_degree", "4"}),
                                 4);
            }),
            "");
  EXPECT_FALSE(fsdp::is_initialized());
}

// DeepSeek-V3 through the seam, built on meta: cpu_tiny and TorchTitan's debugmodel have the library flavor's
// layers and MoE layers, the parameter count the module holds, and TorchTitan's MoE FLOPs per token
// (get_moe_model_nparams_and_flops: 6 x (parameters a token uses - embedding) + 6 x layers x heads x
// (qk_head_dim + v_head_dim) x seq), counted here from the built module: each MoE layer's routed experts
// weighted top_k / experts. (Not the 16B / 671B here: the MoE layer makes its router and shared experts on the
// CPU before placing them on meta, gigabytes for those shapes; models_deepseek_v3_test checks their sizes.)
TEST(ModelSpec, DeepSeekV3MetaBuildHasTheFlavorsShapesCountsAndFlops) {
  for (const std::string flavor : {"cpu_tiny", "debugmodel"}) {
    SCOPED_TRACE(flavor);
    const auto args = fsdp::models::deepseek_v3::deepseek_v3_flavor(flavor);
    ModelShape shape;
    shape.vocab_size = 300;
    shape.max_seq_len = 16;
    shape.device = c10::kMeta;
    const TrainModel model = train_spec("deepseek_v3").build(job("deepseek_v3", flavor), shape);
    double params = 0, active = 0, embedding = 0;
    int64_t layers = 0, moe_layers = 0;
    for (const auto& p : model.module->named_parameters()) {
      EXPECT_TRUE(p.value().is_meta()) << p.key();
      const auto n = static_cast<double>(p.value().numel());
      params += n;
      const bool routed = p.key().find(".moe.experts.") != std::string::npos;
      active += routed ? n * static_cast<double>(args.moe.top_k) / static_cast<double>(args.moe.num_experts) : n;
      if (p.key() == "tok_embeddings.weight") {
        embedding = n;
        EXPECT_EQ(p.value().size(0), 300);
      }
      if (p.key().find(".moe.router.gate.weight") != std::string::npos) ++moe_layers;
    }
    for (const auto& child : model.module->named_modules("", false))
      if (child.key().rfind("layers.", 0) == 0 && child.key().find('.', 7) == std::string::npos) ++layers;
    EXPECT_EQ(layers, args.n_layers);
    EXPECT_EQ(moe_layers, args.n_layers - args.n_dense_layers);
    EXPECT_EQ(static_cast<double>(model.num_params), params);
    EXPECT_NE(model.summary.find("vocab 300"), std::string::npos) << model.summary;
    const double flops = 6.0 * (active - embedding) +
                         6.0 * static_cast<double>(args.n_layers * args.n_heads) *
                             static_cast<double>(args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim) * 16;
    EXPECT_NEAR(model.flops_per_token, flops, 1e-9 * flops);
  }
}

// DeepSeek-V3 built on the CPU and initialised through the seam = the library model built and initialised
// directly (the same logits); its cached forward (a re-run, no KV cache) = the full forward's positions.
TEST(ModelSpec, DeepSeekV3ForwardEqualsTheLibraryModel) {
  ModelShape shape;
  shape.vocab_size = 64;
  shape.max_seq_len = 16;
  const TrainModel model = train_spec("deepseek_v3").build(job("deepseek_v3", "cpu_tiny"), shape);
  model.init_weights(7, {});
  auto args = fsdp::models::deepseek_v3::deepseek_v3_flavor("cpu_tiny");
  args.vocab_size = 64;
  args.max_seq_len = 16;
  fsdp::models::deepseek_v3::DeepSeekV3 reference(args);
  reference->init_weights(7);
  torch::NoGradGuard no_grad;
  const auto tokens = torch::randint(0, 64, {1, 9}, torch::kLong);
  const auto logits = model.forward(tokens);
  EXPECT_TRUE(torch::equal(logits, reference->forward(tokens)));
  // No KV cache (MLA's latent cache is not written): generate re-runs the sequence and says so.
  EXPECT_FALSE(model.cached_forward);
}

// DeepSeek-V3's refused layouts (one line naming the family, the flavor and the layout; no process group), and
// the layouts it trains pass.
TEST(ModelSpec, DeepSeekV3LayoutCheck) {
  ASSERT_FALSE(fsdp::is_initialized());
  const auto refused = [](std::vector<std::string> more, int64_t world) {
    return config_error_of([&] { check_model_layout(job("deepseek_v3", "cpu_tiny", more), world); });
  };
  const auto tp = refused({"--parallelism.tensor_parallel_degree", "8", "--training.local_batch_size", "1",
                           "--training.global_batch_size", "1"},
                          8);
  EXPECT_NE(tp.find("tensor_parallel_degree = 8 does not divide the 4 attention heads of deepseek_v3 cpu_tiny"),
            std::string::npos)
      << tp;
  const auto ep = refused({"--parallelism.expert_parallel_degree", "3", "--training.local_batch_size", "1",
                           "--training.global_batch_size", "3"},
                          3);
  EXPECT_NE(ep.find("does not divide the 8 experts of deepseek_v3 cpu_tiny"), std::string::npos) << ep;
  // Context parallelism runs with FSDP / HSDP / TP / EP and inside pipeline stages (DeepSeekV3Stage's CP hooks).
  EXPECT_EQ(refused({"--parallelism.context_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2"}, 4),
            "");
  const auto flavor = config_error_of([] { train_spec("deepseek_v3").check_layout(job("deepseek_v3", "tiny"), {}); });
  EXPECT_NE(flavor.find("model.flavor"), std::string::npos) << flavor;
  EXPECT_NE(flavor.find("cpu_tiny, debugmodel, 16B, 236B, 671B"), std::string::npos) << flavor;
  // The control: FSDP, EP, HSDP with EP, AC, Hugging Face on 1 rank and PP pass.
  EXPECT_EQ(refused({"--parallelism.expert_parallel_degree", "2"}, 2), "");
  EXPECT_EQ(refused({"--parallelism.expert_parallel_degree", "2", "--parallelism.data_parallel_replicate_degree", "2"}, 4),
            "");
  EXPECT_EQ(refused({"--activation_checkpoint.mode", "full", "--checkpoint.last_save_in_hf"}, 1), "");
  // Hugging Face load/save on several ranks: the adapter's sharded path (issue 37), in every layout it trains.
  EXPECT_EQ(refused({"--checkpoint.last_save_in_hf", "--parallelism.expert_parallel_degree", "2"}, 2), "");
  EXPECT_EQ(refused({"--checkpoint.last_save_in_hf", "--parallelism.pipeline_parallel_degree", "2"}, 2), "");
  EXPECT_EQ(refused({"--checkpoint.last_save_in_hf", "--parallelism.tensor_parallel_degree", "2"}, 2), "");
  EXPECT_EQ(refused({"--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"}, 1),
            "");
  // Tensor parallelism (with EP from dp_shard x tp) and pipeline parallelism (with EP inside the stages).
  EXPECT_EQ(refused({"--parallelism.tensor_parallel_degree", "2"}, 2), "");
  EXPECT_EQ(refused({"--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"}, 4), "");
  EXPECT_EQ(refused({"--parallelism.pipeline_parallel_degree", "2"}, 2), "");
  EXPECT_EQ(refused({"--parallelism.pipeline_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"}, 4), "");
  // PP and TP together (the stages apply their modules' TP plan), TP with the sequence balance loss, CP with EP.
  EXPECT_EQ(refused({"--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"}, 4), "");
  EXPECT_EQ(refused({"--parallelism.tensor_parallel_degree", "2", "--model.moe_sequence_aux_loss_coeff", "0.001"}, 2), "");
  EXPECT_EQ(refused({"--parallelism.context_parallel_degree", "2"}, 2), "");
  EXPECT_EQ(refused({"--parallelism.context_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"}, 4), "");
  EXPECT_FALSE(fsdp::is_initialized());
}
