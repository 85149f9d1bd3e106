// DeepSeek-V3 under fully_shard (1 and 2 ranks through fsdprun): the model built on `meta`, sharded, materialized
// and initialized unit by unit equals the same model initialized unsharded (MLA's latent projections and norms,
// experts, routers, shared experts included); and a forward-backward where each rank takes its part of the global
// batch gives every parameter the gradient of the unsharded model on the whole batch (a plain libtorch reference
// in this process, no fully_shard).
#include "fully_shard/fsdp_test_util.h"

#include <fsdp/materialize.h>
#include <fsdp/models/deepseek_v3.h>

using namespace fsdp_test;
namespace ds = fsdp::nn::deepseek_v3;

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
