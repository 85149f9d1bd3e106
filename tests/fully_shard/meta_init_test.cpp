// Meta-device init: a Llama model built on `meta`, sharded, materialized (each rank allocates only its
// shards) and initialized unit by unit equals the same model initialized unsharded on one process, and
// trains like it.
#include "fully_shard/fsdp_test_util.h"
#include "fully_shard/small_llama.h"

#include <fsdp/materialize.h>
#include <fsdp/models/llama.h>

using namespace fsdp_test;
namespace llama = fsdp::models::llama;

TEST(MetaInit, ShardedInitEqualsUnshardedInit) {
  auto world = test_world();
  llama::Transformer reference(small_llama_args(c10::kCPU));
  reference->init_weights(9);

  llama::Transformer model(small_llama_args(c10::kMeta));
  for (const auto& p : model->parameters()) ASSERT_TRUE(p.is_meta());
  std::vector<fsdp::FSDPModule> units;
  for (size_t i = 0; i < model->layers->size(); ++i) units.push_back(fsdp::fully_shard(model->layers[i]));
  units.push_back(fsdp::fully_shard(model));
  for (const auto& p : model->parameters()) ASSERT_TRUE(p.is_meta()) << "sharding must not allocate";

  // A forward on meta is refused with a clear message.
  try {
    fsdp::nn::call(model, torch::zeros({1, 4}, torch::kLong));
    FAIL() << "expected an error for meta parameters";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("meta"), std::string::npos) << e.what();
  }

  fsdp::materialize_module(*model);
  int64_t local_numel = 0;
  for (const auto& p : model->parameters()) {
    ASSERT_FALSE(p.is_meta());
    local_numel += p.numel();
  }
  // Only shards were allocated: about 1/world of the model (plus rounding of uneven rows).
  int64_t full_numel = 0;
  for (const auto& p : reference->parameters()) full_numel += p.numel();
  EXPECT_LE(local_numel, full_numel / world->size() + 4 * 64 * 40);

  model->init_weights(9, fsdp::full_params_init_scope(*model));
  auto got = fsdp::full_state_dict(*model, {true, false});
  auto ref = reference->named_parameters();
  ASSERT_EQ(got.size(), ref.size());
  for (const auto& item : ref) {
    EXPECT_TRUE(torch::equal(got.at(item.key()), item.value())) << item.key();
  }
  // And the materialized model computes what the reference computes.
  auto tokens = torch::randint(0, 53, {2, 6}, torch::kLong);
  EXPECT_LE(max_rel_diff(fsdp::nn::call(model, tokens), reference->forward(tokens)), 1e-5);
}
