// A checkpoint saved by a (dp_shard 2, tp 2) Llama loads into (dp 4, tp 1) and (dp 1, tp 2) layouts equal bit
// for bit. The saver's full parameters are the reference; the checkpoint reader (which assembles chunks by
// their global offsets, independently of the model) must return exactly them, and every loader must end up
// with exactly them. TP_CKPT_DIR names the checkpoint directory; the np4 run saves (and loads at dp 4), the
// np2 run (a ctest fixture after it) loads at (dp 1, tp 2).

#include "tensor_parallel/tp_test_util.h"

#include <fsdp/checkpoint/checkpoint.h>
#include <fsdp/checkpoint/optimizer.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/llama.h>
#include <fsdp/models/llama_tp_plan.h>
#include <fsdp/nn/module_call.h>
#include <fsdp/state_dict.h>

#include <cstdlib>

using namespace fsdp_test;

namespace {

std::string checkpoint_dir() {
  const char* d = std::getenv("TP_CKPT_DIR");
  return d ? std::string(d) : std::string("tp_checkpoint_test.ckpt");
}

// cpu_tiny with an odd vocabulary (2047 = 1024 + 1023 over TP 2, then uneven again over dp) so the strided
// chunks are uneven.
fsdp::models::llama::LlamaArgs model_args() {
  auto a = fsdp::models::llama::llama3_flavor("cpu_tiny");
  a.vocab_size = 2047;
  return a;
}

void expect_equal_to_checkpoint(const std::map<std::string, torch::Tensor>& full, const std::string& what) {
  const auto summary = fsdp::checkpoint::inspect(checkpoint_dir());
  ASSERT_EQ(summary.tensors.size(), full.size()) << what;
  for (const auto& [name, t] : full) {
    auto saved = fsdp::checkpoint::read_tensor(checkpoint_dir(), name);
    EXPECT_TRUE(torch::equal(saved, t)) << what << ": " << name << " differs from the checkpoint";
  }
}

}  // namespace

TEST(TensorParallelCheckpoint, SaveAtDp2Tp2LoadAtDp4Tp1) {
  if (fsdp_test::test_world()->size() != 4) GTEST_SKIP() << "the saver runs on 4 ranks";
  auto args = model_args();
  auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"dp_shard", "tp"});
  fsdp::models::llama::Transformer model(args);
  model->init_weights(31);
  fsdp::parallelize_module(model, mesh["tp"], fsdp::models::llama::tensor_parallel_plan(args, 2));
  fsdp::FullyShardOptions opts;
  opts.mesh = mesh["dp_shard"];
  for (auto& block : model->blocks()) fsdp::fully_shard(block, opts);
  fsdp::fully_shard(model, opts);
  // One step, so the saved values are not just the initialization.
  {
    torch::optim::SGD opt(model->parameters(), 0.5);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
    auto tokens = torch::randint(args.vocab_size, {2, 8}, gen).chunk(2, 0)[mesh.local_rank(0)];
    auto logits = fsdp::nn::call(model, tokens);
    fsdp::loss_parallel_cross_entropy(logits, tokens, mesh["tp"]).backward();
    opt.step();
  }
  const auto saved = fsdp::full_state_dict(*model, {/*cpu_offload=*/true, /*rank0_only=*/false});
  auto sd = fsdp::checkpoint::model_state_dict(*model);
  fsdp::checkpoint::SaveOptions so;
  so.saved_on = "dp_shard 2 x tp 2";
  fsdp::checkpoint::save(sd, checkpoint_dir(), so);
  expect_equal_to_checkpoint(saved, "reader after the (dp 2, tp 2) save");

  // (dp 4, tp 1): plain FSDP over the 4 ranks, another initialization, then the load.
  fsdp::models::llama::Transformer other(args);
  other->init_weights(77);
  fsdp::FullyShardOptions opts4;
  opts4.mesh = fsdp::init_device_mesh("cpu", {4}, {"dp_shard"});
  for (auto& block : other->blocks()) fsdp::fully_shard(block, opts4);
  fsdp::fully_shard(other, opts4);
  const auto before = fsdp::full_state_dict(*other, {true, false});
  EXPECT_FALSE(torch::equal(before.at("output.weight"), saved.at("output.weight"))) << "the loader starts elsewhere";
  auto sd4 = fsdp::checkpoint::model_state_dict(*other);
  fsdp::checkpoint::load(sd4, checkpoint_dir());
  fsdp::checkpoint::load_model_state_dict(*other, sd4);
  const auto loaded = fsdp::full_state_dict(*other, {true, false});
  for (const auto& [name, t] : saved) {
    EXPECT_TRUE(torch::equal(loaded.at(name), t)) << "(dp 4, tp 1): " << name << " not loaded bit for bit";
  }
}

TEST(TensorParallelCheckpoint, LoadAtDp1Tp2) {
  if (fsdp_test::test_world()->size() != 2) GTEST_SKIP() << "the (dp 1, tp 2) loader runs on 2 ranks";
  auto args = model_args();
  auto mesh = fsdp::init_device_mesh("cpu", {1, 2}, {"dp_shard", "tp"});
  fsdp::models::llama::Transformer model(args);
  model->init_weights(78);
  fsdp::parallelize_module(model, mesh["tp"], fsdp::models::llama::tensor_parallel_plan(args, 2));
  fsdp::FullyShardOptions opts;
  opts.mesh = mesh["dp_shard"];
  for (auto& block : model->blocks()) fsdp::fully_shard(block, opts);
  fsdp::fully_shard(model, opts);
  auto sd = fsdp::checkpoint::model_state_dict(*model);
  fsdp::checkpoint::load(sd, checkpoint_dir());
  fsdp::checkpoint::load_model_state_dict(*model, sd);
  expect_equal_to_checkpoint(fsdp::full_state_dict(*model, {true, false}), "(dp 1, tp 2) after the load");
  // The local TP pieces are what the layout says: rank j holds output.weight rows of torch.chunk piece j.
  auto full_output = fsdp::checkpoint::read_tensor(checkpoint_dir(), "output.weight");
  const int64_t j = mesh.local_rank(1);
  EXPECT_TRUE(torch::equal(model->output->weight().detach(), full_output.chunk(2, 0)[j]));
}
