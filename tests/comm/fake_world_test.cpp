// fsdp::FakeWorld (fsdp/fake_process_group.h) in one process: rank 5 of a world of 8 builds its meshes and
// groups without peers or store, collectives complete at once and are counted by the byte model, fully_shard on a
// meta module gives this rank's shard geometry (fsdp/fully_shard_layout.h, checked against hand counts), and the
// world is gone again after the scope.
#include <fsdp/comm_stats.h>
#include <fsdp/device_mesh.h>
#include <fsdp/fake_process_group.h>
#include <fsdp/fully_shard.h>
#include <fsdp/fully_shard_layout.h>
#include <fsdp/process_group.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

namespace {

// A Linear's parameters on meta: shapes, no storage.
struct MetaLinear : torch::nn::Module {
  MetaLinear(int64_t in, int64_t out) {
    const auto meta = at::TensorOptions().device(at::kMeta);
    weight = register_parameter("weight", at::empty({out, in}, meta));
    bias = register_parameter("bias", at::empty({out}, meta));
  }
  at::Tensor weight, bias;
};

}  // namespace

TEST(FakeWorld, MeshesGroupsAndCountedCollectivesWithoutPeers) {
  ASSERT_FALSE(fsdp::is_initialized());
  {
    fsdp::FakeWorld fake(5, 8);
    ASSERT_TRUE(fsdp::is_initialized());
    EXPECT_EQ(fsdp::world()->rank(), 5);
    EXPECT_EQ(fsdp::world()->size(), 8);
    EXPECT_EQ(fsdp::world()->backend(), "fake");
    const fsdp::DeviceMesh mesh = fsdp::init_device_mesh("cpu", {2, 4}, {"replicate", "shard"});
    EXPECT_EQ(mesh.coordinate(), (std::vector<int64_t>{1, 1}));
    const fsdp::ProcessGroupPtr shard = mesh.group("shard");
    EXPECT_EQ(shard->size(), 4);
    EXPECT_EQ(shard->rank(), 1);
    EXPECT_EQ(shard->global_ranks(), (std::vector<int>{4, 5, 6, 7}));
    EXPECT_EQ(mesh.group("replicate")->global_ranks(), (std::vector<int>{1, 5}));

    // An all-gather of 6 floats per rank: completes at once, leaves the output as it was, counts (4 - 1) x 24 bytes.
    at::Tensor out = at::full({24}, 7.0f);
    fsdp::reset_comm_stats(*shard);
    shard->all_gather_into_tensor(out, at::ones({6})).wait();
    EXPECT_EQ(fsdp::comm_stats(*shard).all_gather_calls, 1);
    EXPECT_EQ(fsdp::comm_stats(*shard).bytes_sent, 3 * 24);
    EXPECT_TRUE(out.eq(7.0f).all().item<bool>());

    // fully_shard of a meta Linear(10 -> 6) over the 4 shard ranks: weight [6, 10] in ceil(6/4) = 2-row pieces,
    // rank 1 holds rows 2..3; bias [6] likewise. Nothing is allocated.
    auto linear = std::make_shared<MetaLinear>(10, 6);
    fsdp::FullyShardOptions opts;
    opts.mesh = mesh;  // HSDP: (replicate, shard)
    const fsdp::FSDPModule unit = fsdp::fully_shard(std::static_pointer_cast<torch::nn::Module>(linear), opts);
    const std::vector<fsdp::ParamGroupLayout> groups = fsdp::param_group_layouts(unit);
    ASSERT_EQ(groups.size(), 1u);
    EXPECT_EQ(groups[0].shard_size, 4);
    EXPECT_EQ(groups[0].replicate_size, 2);
    ASSERT_EQ(groups[0].params.size(), 2u);
    const fsdp::ShardedParamLayout& weight = groups[0].params[0];
    EXPECT_EQ(weight.fqn, "weight");
    EXPECT_EQ(weight.unsharded_sizes, (std::vector<int64_t>{6, 10}));
    EXPECT_EQ(weight.shard_dim, 0);
    EXPECT_EQ(weight.padded_shard_numel, 2 * 10);
    EXPECT_EQ(weight.local_numel, 2 * 10);
    EXPECT_EQ(weight.all_gather_bytes, 2 * 10 * 4);  // 80 bytes, already 16-aligned
    const fsdp::ShardedParamLayout& bias = groups[0].params[1];
    EXPECT_EQ(bias.padded_shard_numel, 2);
    EXPECT_EQ(bias.all_gather_bytes, 16);  // 8 bytes rounded up to 16
    EXPECT_EQ(groups[0].all_gather_bytes, 80 + 16);
  }
  EXPECT_FALSE(fsdp::is_initialized());  // nothing was initialized before: nothing is after
}

TEST(FakeWorld, OneAtATime) {
  fsdp::FakeWorld fake(0, 2);
  EXPECT_THROW(fsdp::FakeWorld(1, 2), c10::Error);
  EXPECT_THROW(fsdp::FakeWorld(2, 2), c10::Error);  // rank outside the world
}
