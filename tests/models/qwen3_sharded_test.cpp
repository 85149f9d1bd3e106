// Qwen3 under fully_shard (1 and 2 ranks through fsdprun): a Qwen3-MoE model built on `meta`, sharded,
// materialized and initialized unit by unit equals the same model initialized unsharded on one process (the MoE
// experts, router gates and QK-norms included) and computes the same logits; a sharded dense Qwen3 and a sharded
// Qwen3-MoE (experts gathered one tensor at a time into transformers 5's stacked gate_up_proj / down_proj) export
// to Hugging Face files that, imported into an unsharded model (the whole-model reader) and back into a sharded
// one (each rank its own rows of the stacked experts), give back every parameter.
#include "fully_shard/fsdp_test_util.h"

#include "expect_error.h"

#include <fsdp/checkpoint/model_safetensors.h>
#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/materialize.h>
#include <fsdp/models/hf_qwen3.h>
#include <fsdp/models/qwen3.h>

#include <unistd.h>

#include <filesystem>
#include <string>

using namespace fsdp_test;
namespace llama = fsdp::models::llama;
namespace hf = fsdp::models::hf;
namespace fs = std::filesystem;

namespace {
std::vector<fsdp::FSDPModule> shard(llama::Transformer& model) {
  std::vector<fsdp::FSDPModule> units;
  for (size_t i = 0; i < model->layers->size(); ++i) units.push_back(fsdp::fully_shard(model->layers[i]));
  units.push_back(fsdp::fully_shard(model));
  return units;
}
}  // namespace

TEST(Qwen3Sharded, MetaInitOfMoeEqualsUnshardedInit) {
  auto world = test_world();
  llama::LlamaArgs args = llama::qwen3_flavor("cpu_tiny_moe");
  llama::Transformer reference(args);
  reference->init_weights(9);

  args.device = c10::kMeta;
  llama::Transformer model(args);
  for (const auto& p : model->parameters()) ASSERT_TRUE(p.is_meta());
  ASSERT_TRUE(model->blocks()[0]->moe->expert_bias.is_meta());
  auto units = shard(model);
  fsdp::materialize_module(*model);
  model->init_weights(9, fsdp::full_params_init_scope(*model));
  auto got = fsdp::full_state_dict(*model, {true, false});
  auto ref = reference->named_parameters();
  int moe_params = 0;
  for (const auto& item : ref) {
    EXPECT_TRUE(torch::equal(got.at(item.key()), item.value())) << item.key();
    moe_params += item.key().find(".moe.") != std::string::npos;
  }
  EXPECT_EQ(moe_params, 2 * 4);  // per layer: router gate, w1, w2, w3
  auto tokens = torch::randint(0, 2048, {2, 6}, torch::kLong);
  reference->eval();
  model->eval();
  torch::NoGradGuard no_grad;
  EXPECT_LE(max_rel_diff(fsdp::nn::call(model, tokens), reference->forward(tokens)), 1e-5);
}

TEST(Qwen3Sharded, DenseAndMoeExportImport) {
  auto world = test_world();
  for (const char* flavor : {"cpu_tiny", "cpu_tiny_moe"}) {
    SCOPED_TRACE(flavor);
    const fs::path dir =
        fs::temp_directory_path() / ("fsdp_qwen3_sharded_" + std::string(flavor) + "_" + std::to_string(::getppid()));
    llama::Transformer model(llama::qwen3_flavor(flavor));
    model->init_weights(4);
    auto units = shard(model);
    hf::export_qwen3(*model, dir.string());
    auto full = fsdp::full_state_dict(*model, {true, false});
    world->barrier().wait();
    if (std::string(flavor) == "cpu_tiny_moe") {
      EXPECT_TRUE(fs::exists(dir / "model.safetensors"));
      // transformers 5's stacked layout: gate_up_proj [E, 2F, D] holds w1 then w3.
      const auto gate_up =
          fsdp::checkpoint::safetensors::Reader((dir / "model.safetensors").string()).read("model.layers.0.mlp.experts.gate_up_proj");
      const at::Tensor& w1 = full.at("layers.0.moe.experts.w1");
      EXPECT_TRUE(torch::equal(gate_up, torch::cat({w1, full.at("layers.0.moe.experts.w3")}, 1)));
    }
    llama::Transformer whole(llama::qwen3_flavor(flavor));
    hf::import_qwen3(*whole, dir.string());
    size_t compared = 0;
    for (const auto& item : whole->named_parameters()) {
      EXPECT_TRUE(torch::equal(full.at(item.key()), item.value())) << item.key();
      ++compared;
    }
    EXPECT_GT(compared, 0u);
    // Back into a (differently initialized) sharded model: its own rows.
    llama::Transformer again(llama::qwen3_flavor(flavor));
    again->init_weights(5);
    auto units2 = shard(again);
    hf::import_qwen3(*again, dir.string());
    auto again_full = fsdp::full_state_dict(*again, {true, false});
    for (const auto& item : whole->named_parameters()) {
      EXPECT_TRUE(torch::equal(again_full.at(item.key()), full.at(item.key()))) << item.key();
    }
    world->barrier().wait();
    if (world->rank() == 0) fs::remove_all(dir);
  }
}
