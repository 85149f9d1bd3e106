// State dicts: sharded (no communication, torch.chunk rows, global shapes), full (equals the unsharded
// model), loading both ways, HSDP placements, and bad input.
#include "fully_shard/fsdp_test_util.h"

#include <fsdp/sharded_tensor.h>
#include <fsdp/comm_stats.h>
#include <fsdp/state_dict.h>

using namespace fsdp_test;

namespace {
std::vector<fsdp::FSDPModule> shard(MLP& model, const fsdp::DeviceMesh& mesh) {
  fsdp::FullyShardOptions opts;
  opts.mesh = mesh;
  return shard_mlp(model, opts);
}
}  // namespace

TEST(StateDict, ShardedIsLocalRowsWithoutCommunication) {
  auto world = test_world();
  auto mesh = fsdp::init_device_mesh("cpu", {world->size()}, {"shard"});
  MLP reference = make_mlp(21);
  MLP model = make_mlp(21);
  shard(model, mesh);
  fsdp::reset_comm_stats(*mesh.group(0));
  fsdp::reset_comm_stats(*world);
  auto sd = fsdp::sharded_state_dict(*model);
  EXPECT_EQ(fsdp::comm_stats(*mesh.group(0)).all_gather_calls + fsdp::comm_stats(*mesh.group(0)).all_reduce_calls, 0);
  EXPECT_EQ(fsdp::comm_stats(*world).bytes_sent, 0);
  auto ref = reference->named_parameters();
  ASSERT_EQ(sd.size(), ref.size());
  for (const auto& item : ref) {
    const auto& st = sd.at(item.key());
    EXPECT_EQ(c10::IntArrayRef(st.sizes()), item.value().sizes()) << item.key();
    auto chunks = item.value().chunk(world->size(), 0);
    if (world->rank() < static_cast<int64_t>(chunks.size())) {
      EXPECT_TRUE(torch::equal(st.local(), chunks[world->rank()])) << item.key();
      EXPECT_EQ(st.local_offset()[0], world->rank() * chunks[0].size(0)) << item.key();
    } else {
      EXPECT_EQ(st.local().numel(), 0) << item.key();
    }
    EXPECT_TRUE(st.placements()[0].is_shard(0));
  }
}

TEST(StateDict, FullEqualsUnshardedModelAndLoadsBack) {
  auto world = test_world();
  auto mesh = fsdp::init_device_mesh("cpu", {world->size()}, {"shard"});
  MLP reference = make_mlp(22);
  MLP model = make_mlp(22);
  shard(model, mesh);
  auto full = fsdp::full_state_dict(*model, {/*cpu_offload=*/true, /*rank0_only=*/false});
  auto ref = reference->named_parameters();
  ASSERT_EQ(full.size(), ref.size());
  for (const auto& item : ref) EXPECT_TRUE(torch::equal(full.at(item.key()), item.value())) << item.key();

  // rank0_only: other ranks get nothing but still take part.
  auto r0 = fsdp::full_state_dict(*model);
  EXPECT_EQ(r0.empty(), world->rank() != 0);

  // Load another model's full weights into the sharded model: its outputs become the other model's.
  MLP other = make_mlp(23);
  fsdp::FullStateDict other_sd;
  for (const auto& item : other->named_parameters()) other_sd[item.key()] = item.value().detach().clone();
  fsdp::load_full_state_dict(*model, world->rank() == 0 ? other_sd : fsdp::FullStateDict{}, /*broadcast_from_rank0=*/true);
  auto x = torch::randn({3, 7});
  EXPECT_LE(max_rel_diff(fsdp::nn::call(model, x), other->forward(x)), 1e-6);

  // Sharded round trip: save, scramble, load, same outputs.
  auto sd = fsdp::sharded_state_dict(*model);
  std::map<std::string, fsdp::ShardedTensor> saved;
  for (auto& [k, v] : sd) {
    saved.emplace(k, fsdp::ShardedTensor::from_local(v.local().clone(), v.mesh(), v.placements(), v.sizes()));
  }
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) p.zero_();
  }
  fsdp::load_sharded_state_dict(*model, saved);
  EXPECT_LE(max_rel_diff(fsdp::nn::call(model, x), other->forward(x)), 1e-6);
}

TEST(StateDict, HybridShardPlacements) {
  auto world = test_world();
  const int64_t n = world->size();
  if (n % 2 != 0) GTEST_SKIP() << "HSDP needs an even world here";
  auto mesh = fsdp::init_device_mesh("cpu", {2, n / 2}, {"replicate", "shard"});
  MLP reference = make_mlp(24);
  MLP model = make_mlp(24);
  shard(model, mesh);
  auto sd = fsdp::sharded_state_dict(*model);
  const int64_t shard_rank = world->rank() % (n / 2);
  for (const auto& item : reference->named_parameters()) {
    const auto& st = sd.at(item.key());
    ASSERT_EQ(st.placements().size(), 2u);
    EXPECT_TRUE(st.placements()[0].is_replicate());
    EXPECT_TRUE(st.placements()[1].is_shard(0));
    auto chunks = item.value().chunk(n / 2, 0);
    if (shard_rank < static_cast<int64_t>(chunks.size())) EXPECT_TRUE(torch::equal(st.local(), chunks[shard_rank]));
  }
  auto full = fsdp::full_state_dict(*model, {true, false});
  for (const auto& item : reference->named_parameters()) EXPECT_TRUE(torch::equal(full.at(item.key()), item.value()));
}

TEST(StateDict, BadInputIsRejectedWithTheKey) {
  auto world = test_world();
  auto mesh = fsdp::init_device_mesh("cpu", {world->size()}, {"shard"});
  MLP model = make_mlp(25);
  shard(model, mesh);
  fsdp::FullStateDict sd;
  for (const auto& item : make_mlp(25)->named_parameters()) sd[item.key()] = item.value().detach().clone();
  auto missing = sd;
  missing.erase("output.weight");
  try {
    fsdp::load_full_state_dict(*model, missing);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing key 'output.weight'"), std::string::npos) << e.what();
  }
  auto wrong = sd;
  wrong["input.weight"] = torch::zeros({3, 3});
  try {
    fsdp::load_full_state_dict(*model, wrong);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'input.weight' has shape"), std::string::npos) << e.what();
  }
  auto extra = sd;
  extra["nope.weight"] = torch::zeros({1});
  EXPECT_THROW(fsdp::load_full_state_dict(*model, extra), c10::Error);
}
