// DeepSeek-V3 under fully_shard (1 and 2 ranks through fsdprun): the model built on `meta`, sharded, materialized
// and initialized unit by unit equals the same model initialized unsharded (MLA's latent projections and norms,
// experts, routers, shared experts included); and a forward-backward where each rank takes its part of the global
// batch gives every parameter the gradient of the unsharded model on the whole batch (a plain libtorch reference
// in this process, no fully_shard). The Hugging Face export of the sharded model gathers one tensor at a time (the
// CPU tensor bytes it allocates peak at a few copies of the largest file tensor, far below the model) and the files
// give back every tensor, the load-balancing bias included: into an unsharded model (the whole-model reader) and
// into a sharded one (each rank its own rows), also from the per-expert layout of the hub (each rank its own
// experts' tensors); without load balancing, zeros go out as the bias and come back.
#include "fully_shard/fsdp_test_util.h"

#include "tensor_memory.h"

#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/materialize.h>
#include <fsdp/models/deepseek_v3.h>
#include <fsdp/models/hf_deepseek_v3.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>

using namespace fsdp_test;
namespace ds = fsdp::models::deepseek_v3;
namespace fs = std::filesystem;
namespace tensor_memory = fsdp_train::tensor_memory;

namespace {
std::vector<fsdp::FSDPModule> shard(ds::DeepSeekV3& model) {
  std::vector<fsdp::FSDPModule> units;
  for (size_t i = 0; i < model->layers->size(); ++i) units.push_back(fsdp::fully_shard(model->layers[i]));
  units.push_back(fsdp::fully_shard(model));
  return units;
}

at::Tensor loss_of(const at::Tensor& logits, const at::Tensor& labels) {
  return torch::nn::functional::cross_entropy(logits.flatten(0, 1), labels.flatten());
}
}  // namespace

TEST(DeepSeekV3Sharded, MetaInitEqualsUnshardedInit) {
  auto world = test_world();
  ds::DeepSeekV3Args args = ds::deepseek_v3_flavor("cpu_tiny");
  ds::DeepSeekV3 reference(args);
  reference->init_weights(9);
  args.device = c10::kMeta;
  ds::DeepSeekV3 model(args);
  for (const auto& p : model->parameters()) ASSERT_TRUE(p.is_meta());
  auto units = shard(model);
  fsdp::materialize_module(*model);
  model->init_weights(9, fsdp::full_params_init_scope(*model));
  auto got = fsdp::full_state_dict(*model, {true, false});
  int mla = 0;
  for (const auto& item : reference->named_parameters()) {
    EXPECT_TRUE(torch::equal(got.at(item.key()), item.value())) << item.key();
    mla += item.key().find(".attention.wkv_") != std::string::npos;
  }
  EXPECT_EQ(mla, 2 * 3);  // wkv_a, wkv_b per layer
  auto tokens = torch::randint(0, 2048, {2, 6}, torch::kLong);
  reference->eval();
  model->eval();
  torch::NoGradGuard no_grad;
  EXPECT_LE(max_rel_diff(fsdp::nn::call(model, tokens), reference->forward(tokens)), 1e-5);
}

TEST(DeepSeekV3Sharded, GradientsEqualTheUnshardedModelOnTheWholeBatch) {
  auto world = test_world();
  const int64_t ranks = world->size(), rank = world->rank(), batch = 4;
  ASSERT_EQ(batch % ranks, 0);
  torch::manual_seed(123);  // the same global batch on every rank
  const at::Tensor tokens = torch::randint(0, 2048, {batch, 17}, torch::kLong);
  const at::Tensor inputs = tokens.narrow(1, 0, 16), labels = tokens.narrow(1, 1, 16);

  ds::DeepSeekV3 reference(ds::deepseek_v3_flavor("cpu_tiny"));
  reference->init_weights(4);
  reference->train();
  const at::Tensor ref_loss = loss_of(reference->forward(inputs), labels);
  ref_loss.backward();
  std::map<std::string, torch::Tensor> ref_grads;
  for (const auto& p : reference->named_parameters()) ref_grads[p.key()] = p.value().grad();

  ds::DeepSeekV3 model(ds::deepseek_v3_flavor("cpu_tiny"));
  model->init_weights(4);
  model->train();
  auto units = shard(model);
  const int64_t rows = batch / ranks;
  const at::Tensor local = loss_of(fsdp::nn::call(model, inputs.narrow(0, rank * rows, rows)),
                                   labels.narrow(0, rank * rows, rows));
  local.backward();
  // Gradients are averaged over the ranks: each rank's mean loss over its equal share averages to the whole
  // batch's mean loss.
  auto got = full_grads(*model);
  expect_equal_maps(got, ref_grads, 1e-5, "gradients");
  double moved = 0;
  for (const auto& [name, g] : ref_grads) moved += g.abs().sum().item<double>();
  EXPECT_GT(moved, 0.0);
}

TEST(DeepSeekV3Sharded, HuggingFaceExportGathersOneTensorAtATimeAndImportsBack) {
  auto world = test_world();
  ds::DeepSeekV3Args args = ds::deepseek_v3_flavor("cpu_tiny");
  args.vocab_size = 256;  // the embeddings smaller than one layer's stacked experts
  args.n_layers = 6;      // a model many times its largest tensor, so "one at a time" is a real bound
  ds::DeepSeekV3 model(args);
  model->init_weights(4);
  {
    // A bias that is not zero (as after training): it steers the routing, so it must come back.
    torch::NoGradGuard no_grad;
    for (auto& block : model->blocks()) {
      if (!block->moe) continue;
      auto& bias = block->moe->expert_bias;
      bias.copy_(torch::arange(bias.size(0), torch::kFloat) * 0.01 * static_cast<double>(block->layer_id + 1));
    }
  }
  std::map<std::string, at::Tensor> want;  // the whole tensors, before sharding
  int64_t model_bytes = 0, largest_file_tensor = 0;
  for (const auto& item : model->named_parameters()) {
    want[item.key()] = item.value().detach().clone();
    model_bytes += item.value().nbytes();
    // w1 and w3 are one file tensor (gate_up_proj): twice w1's bytes.
    const bool w1 = item.key().size() > 14 && item.key().compare(item.key().size() - 14, 14, "moe.experts.w1") == 0;
    largest_file_tensor = std::max<int64_t>(largest_file_tensor, (w1 ? 2 : 1) * item.value().nbytes());
  }
  for (const auto& item : model->named_buffers()) want[item.key()] = item.value().detach().clone();
  auto units = shard(model);
  const fs::path dir = fs::temp_directory_path() / ("fsdp_dsv3_sharded_hf_" + std::to_string(::getppid()));
  world->barrier().wait();
  if (world->rank() == 0) fs::remove_all(dir);
  world->barrier().wait();

  tensor_memory::install();
  const int64_t before = tensor_memory::live_bytes();
  tensor_memory::reset_peak();
  fsdp::models::hf::export_deepseek_v3(*model, dir.string());
  const int64_t peak = tensor_memory::peak_bytes() - before;
  std::printf("rank %d: export peak %lld bytes; largest file tensor %lld, model %lld\n", world->rank(),
              static_cast<long long>(peak), static_cast<long long>(largest_file_tensor),
              static_cast<long long>(model_bytes));
  // Every rank gathers each tensor in turn (the writer writes it before the next): at most the two slices of one
  // stacked tensor and their concatenation at once, and the bound is far below the whole model.
  EXPECT_LE(peak, 3 * largest_file_tensor);
  EXPECT_LT(3 * largest_file_tensor, model_bytes / 2);
  EXPECT_GE(peak, largest_file_tensor) << "the export held the stacked experts it wrote";
  world->barrier().wait();
  ASSERT_TRUE(fs::exists(dir / "config.json"));

  // Into an unsharded model (the one-process reader): every parameter and the biases.
  ds::DeepSeekV3 whole(args);
  fsdp::models::hf::import_deepseek_v3(*whole, dir.string());
  size_t compared = 0;
  for (const auto& item : whole->named_parameters()) {
    EXPECT_TRUE(torch::equal(item.value(), want.at(item.key()))) << item.key();
    ++compared;
  }
  for (const auto& item : whole->named_buffers()) {
    EXPECT_TRUE(torch::equal(item.value(), want.at(item.key()))) << item.key();
    EXPECT_GT(item.value().abs().sum().item<double>(), 0.0) << item.key();
    ++compared;
  }
  EXPECT_EQ(compared, want.size());
  // Into a sharded model initialized otherwise: each rank its own rows.
  ds::DeepSeekV3 again(args);
  again->init_weights(5);
  auto units2 = shard(again);
  const auto r = fsdp::models::hf::import_deepseek_v3(*again, dir.string());
  EXPECT_TRUE(r.missing.empty());
  EXPECT_TRUE(r.unexpected.empty());
  const auto got = fsdp::full_state_dict(*again, {true, false});
  EXPECT_EQ(got.size(), want.size());
  for (const auto& [name, t] : want) {
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_TRUE(torch::equal(got.at(name), t)) << name;
  }
  world->barrier().wait();

  // The same weights with the experts one tensor per expert and projection ({j}.{gate,up,down}_proj.weight, what
  // save_pretrained and the hub write; cut here from the stacked export): a sharded import reads each rank's own
  // experts only.
  const fs::path per_expert = dir.string() + "_per_expert";
  int64_t file_bytes = 0;
  if (world->rank() == 0) {
    fs::remove_all(per_expert);
    fs::create_directories(per_expert);
    fsdp::checkpoint::safetensors::Reader stacked((dir / "model.safetensors").string());
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& name : stacked.names()) {
      const at::Tensor t = stacked.read(name);
      const std::string gate_up = "gate_up_proj", down = "down_proj";
      const size_t cut = name.rfind("experts.");
      if (cut == std::string::npos || name.find('.', cut + 8) != std::string::npos) {
        tensors.emplace_back(name, t);
        continue;
      }
      const std::string prefix = name.substr(0, cut + 8), what = name.substr(cut + 8);
      for (int64_t j = 0; j < t.size(0); ++j) {
        const std::string p = prefix + std::to_string(j) + ".";
        if (what == gate_up) {
          const int64_t F = t.size(1) / 2;
          tensors.emplace_back(p + "gate_proj.weight", t[j].narrow(0, 0, F).contiguous());
          tensors.emplace_back(p + "up_proj.weight", t[j].narrow(0, F, F).contiguous());
        } else {
          EXPECT_EQ(what, down);
          tensors.emplace_back(p + "down_proj.weight", t[j].contiguous());
        }
      }
    }
    fsdp::checkpoint::safetensors::save_file((per_expert / "model.safetensors").string(), tensors);
    fs::copy_file(dir / "config.json", per_expert / "config.json");
  }
  world->barrier().wait();
  for (const auto& entry : fs::directory_iterator(per_expert)) {
    if (entry.path().extension() == ".safetensors") file_bytes += static_cast<int64_t>(fs::file_size(entry.path()));
  }
  {
    ds::DeepSeekV3 from_hub_layout(args);
    from_hub_layout->init_weights(6);
    auto units5 = shard(from_hub_layout);
    const auto r3 = fsdp::models::hf::import_deepseek_v3(*from_hub_layout, per_expert.string());
    EXPECT_TRUE(r3.missing.empty());
    EXPECT_TRUE(r3.unexpected.empty());
    // Each rank read its own rows only (on 2 ranks, about half of the files' bytes).
    if (world->size() > 1) EXPECT_LT(r3.bytes_read, file_bytes * 3 / 4);
    const auto from_hub = fsdp::full_state_dict(*from_hub_layout, {true, false});
    for (const auto& [name, t] : want) EXPECT_TRUE(torch::equal(from_hub.at(name), t)) << name;
  }
  world->barrier().wait();
  if (world->rank() == 0) fs::remove_all(per_expert);

  // Without load balancing (no bias buffer): the sharded export writes zeros for transformers' router (rank 0,
  // not a model key), and a sharded import takes them back (only zeros load into such a model).
  ds::DeepSeekV3Args unbalanced = args;
  unbalanced.moe.load_balance_coeff.reset();
  ds::DeepSeekV3 plain(unbalanced);
  plain->init_weights(4);
  ASSERT_FALSE(plain->blocks()[1]->moe->expert_bias.defined());
  auto units3 = shard(plain);
  fsdp::models::hf::export_deepseek_v3(*plain, dir.string());
  world->barrier().wait();
  const at::Tensor zeros = fsdp::checkpoint::safetensors::Reader((dir / "model.safetensors").string())
                               .read("model.layers.1.mlp.gate.e_score_correction_bias");
  EXPECT_TRUE(torch::equal(zeros, torch::zeros({unbalanced.moe.num_experts}, torch::kFloat)));
  ds::DeepSeekV3 plain_again(unbalanced);
  plain_again->init_weights(5);
  auto units4 = shard(plain_again);
  const auto r2 = fsdp::models::hf::import_deepseek_v3(*plain_again, dir.string());
  EXPECT_TRUE(r2.unexpected.empty());
  const auto plain_got = fsdp::full_state_dict(*plain_again, {true, false});
  const auto plain_want = fsdp::full_state_dict(*plain, {true, false});
  for (const auto& [name, t] : plain_want) EXPECT_TRUE(torch::equal(plain_got.at(name), t)) << name;
  world->barrier().wait();
  if (world->rank() == 0) fs::remove_all(dir);
}
