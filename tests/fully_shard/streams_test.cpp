// Streams and events (src/fully_shard/fsdp_streams.h) on the CPU, where the CPU's guard implementation has
// one stream and no events: every FSDP "stream" must be the current stream and nothing may be recorded, so
// CPU training runs exactly as before streams existed. And the hold-and-release order of the buffers kept
// across streams (Python's AllGatherState / ReduceScatterState), which needs no GPU: a held buffer is freed
// only after the waits on its event were issued. What needs a GPU (separate streams really used, parity on
// them) is tests/device/cuda_streams_test.cpp.
#include "fully_shard/fsdp_test_util.h"

#include "fully_shard/fsdp_state.h"
#include "fully_shard/fsdp_streams.h"

#include <torch/torch.h>

#include <memory>

using namespace fsdp_test;
using fsdp::detail::CommStreams;
using fsdp::detail::HeldBuffer;
using fsdp::detail::StreamEvent;

TEST(Streams, CpuHasNoSeparateStreams) {
  CommStreams s(c10::Device(c10::kCPU));
  EXPECT_FALSE(s.separate());
  const c10::Stream current = s.current();
  EXPECT_EQ(current.device_type(), c10::kCPU);  // the CPU guard implementation's one stream
  EXPECT_EQ(s.all_gather_copy_in(), current);
  EXPECT_EQ(s.all_gather(), current);
  EXPECT_EQ(s.reduce_scatter(), current);
  EXPECT_EQ(s.all_reduce(), current);
  // No events on the CPU: recording gives an empty event, and waiting on one is a no-op (counted only).
  StreamEvent e = s.record(current);
  EXPECT_FALSE(e.recorded());
  s.wait(current, e);
  s.wait_stream(s.all_gather(), current);  // same stream: not even a wait
  s.synchronize(e);
  EXPECT_EQ(s.events_recorded(), 0);
  EXPECT_EQ(s.waits_issued(), 1);
}

TEST(Streams, MetaHasNoSeparateStreams) {
  CommStreams s(c10::Device(c10::kMeta));
  EXPECT_FALSE(s.separate());
  EXPECT_EQ(s.all_gather(), s.current());
}

namespace {
// A 16-byte CPU tensor whose deleter records how many waits the streams had issued when it ran.
at::Tensor watched_buffer(const CommStreams& s, std::shared_ptr<int64_t> waits_at_free) {
  void* data = std::malloc(16);
  return at::from_blob(
      data, {16},
      [waits_at_free, &s](void* p) {
        *waits_at_free = s.waits_issued();
        std::free(p);
      },
      at::TensorOptions().dtype(at::kByte));
}
}  // namespace

TEST(Streams, HeldBufferIsFreedOnlyAfterTheWaits) {
  CommStreams s(c10::Device(c10::kCPU));
  auto waits_at_free = std::make_shared<int64_t>(-1);
  HeldBuffer held;
  EXPECT_FALSE(held.holding());
  held.hold(watched_buffer(s, waits_at_free), s.record(s.current()));
  EXPECT_TRUE(held.holding());
  EXPECT_EQ(*waits_at_free, -1) << "the held buffer was freed while held";
  const int64_t waits_before = s.waits_issued();
  // Like the all-gather state: both all-gather streams wait, then the memory goes.
  held.release(s, {s.all_gather_copy_in(), s.all_gather()});
  EXPECT_FALSE(held.holding());
  EXPECT_EQ(*waits_at_free, waits_before + 2) << "freed before (or without) the waits on its event";
  // Releasing an empty hold issues nothing.
  held.release(s, {s.current()});
  EXPECT_EQ(s.waits_issued(), waits_before + 2);
}

TEST(Streams, HoldingTwiceWithoutReleaseIsAnError) {
  CommStreams s(c10::Device(c10::kCPU));
  HeldBuffer held;
  held.hold(at::zeros({4}), StreamEvent());
  EXPECT_THROW(held.hold(at::zeros({4}), StreamEvent()), c10::Error);
}

// A root's tree gets one stream set on the groups' device; on the CPU training never records an event, never
// holds a buffer past its use, and keeps the regular (communicating) path.
TEST(Streams, CpuTrainingUsesTheCurrentStreamOnly) {
  MLP model = make_mlp(5);
  fsdp::FullyShardOptions opts;
  opts.mesh = fsdp::init_device_mesh("cpu", {test_world()->size()}, {"shard"});
  opts.mp_policy.param_dtype = torch::kBFloat16;  // a cast: the all-gather / reduce-scatter path even at world 1
  auto units = shard_mlp(model, opts);
  torch::optim::SGD opt(model->parameters(), 0.1);
  for (int64_t step = 0; step < 2; ++step) {
    auto [x, y] = global_batch(step, 8, 7, 5);
    opt.zero_grad();
    torch::mse_loss(fsdp::nn::call(model, x), y).backward();
    opt.step();
  }
  auto& root = fsdp::detail::FSDPModuleAccess::state(units.back());
  ASSERT_TRUE(root.is_root());
  ASSERT_TRUE(root.root_context() && root.root_context()->comm);
  const auto& comm = *root.root_context()->comm;
  EXPECT_FALSE(comm.streams.separate());
  EXPECT_EQ(comm.streams.device().type(), c10::kCPU);
  EXPECT_EQ(comm.streams.events_recorded(), 0);
  EXPECT_FALSE(comm.all_gather_state.holding());
  EXPECT_FALSE(comm.reduce_scatter_state.holding());
  // The gradients were reduced (not vacuous): every parameter got one.
  for (const auto& p : model->parameters()) EXPECT_TRUE(p.grad().defined());
}
