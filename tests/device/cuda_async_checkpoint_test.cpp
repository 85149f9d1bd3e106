// Async checkpoint staging of GPU tensors (issue 9, async_with_pinned_mem): AsyncSaver copies device tensors
// on a side stream of their device, ordered after an event recorded on the caller's stream at save(). Checked
// here, for both async modes and both staging kinds:
// * the checkpoint holds the state as of save() in stream order: a write still queued on the GPU when save()
//   is called (behind ~20 matrix products) is in it — a side stream that did not wait would read the old value;
// * a change made after wait_staged() (the optimizer step) is not in it;
// * pinned staging buffers are allocated for async_with_pinned_mem, pageable ones for async.
// The reference is a clone taken on the caller's stream at save(), moved to the CPU. One process (a 1-rank
// world, Gloo on cuda:0); skipped without CUDA. Written after the first GPU run (2026-11-23); not yet run.
#include "device/device_util.h"

#include <fsdp/checkpoint/async_save.h>
#include <fsdp/checkpoint/checkpoint.h>

#include <filesystem>
#include <unistd.h>

namespace fs = std::filesystem;
namespace ckpt = fsdp::checkpoint;

namespace {

// Queues a long chain of GPU work that ends by overwriting `target` (no host synchronisation).
void queue_slow_overwrite(torch::Tensor& target, const torch::Tensor& mix, double shift) {
  torch::Tensor t = target.to(torch::kFloat);
  for (int i = 0; i < 20; ++i) t = torch::tanh(t.matmul(mix));
  target.copy_(t + shift);
}

}  // namespace

TEST(CudaAsyncCheckpoint, SnapshotIsTheStateAsOfSaveInStreamOrder) {
  FSDP_REQUIRE_CUDA();
  fsdp_device::DeviceWorld dw("gloo", "cuda:0");
  const torch::Device device = dw.group()->device();
  ASSERT_TRUE(device.is_cuda()) << device;
  const auto mesh = fsdp::init_device_mesh("cuda", {1}, {"shard"});
  const fs::path dir = fs::temp_directory_path() / ("fsdp_cuda_async_ckpt_" + std::to_string(::getpid()));
  fs::remove_all(dir);

  torch::manual_seed(3);
  const torch::Tensor mix = (torch::randn({1024, 1024}) / 32.0).to(device);
  int case_no = 0;
  for (const auto mode : {ckpt::AsyncMode::AsyncWithPinnedMem, ckpt::AsyncMode::Async}) {
    for (const auto staging : {ckpt::Staging::Blocking, ckpt::Staging::Background}) {
      SCOPED_TRACE(testing::Message() << "mode " << static_cast<int>(mode) << ", staging " << static_cast<int>(staging));
      ckpt::StateDict live;
      live.tensors["w"] = fsdp::ShardedTensor::from_local(torch::randn({4096, 1024}).to(device), mesh,
                                                          {fsdp::Shard(0)}, {4096, 1024});
      live.full["b"] = torch::randn({2048}).to(device).to(torch::kBFloat16);
      live.full["step"] = torch::scalar_tensor(int64_t{7}, torch::kLong);  // a CPU tensor beside them
      torch::Tensor w = live.tensors.at("w").local();
      torch::Tensor b = live.full.at("b");
      const torch::Tensor w_before = w.cpu();

      ckpt::AsyncSaverOptions o;
      o.mode = mode;
      o.staging = staging;
      ckpt::AsyncSaver saver(nullptr, o);
      const std::string path = ckpt::step_path(dir.string(), ++case_no);
      queue_slow_overwrite(w, mix, 1.0);  // still running on the GPU when save() is called
      b.add_(1);
      const torch::Tensor w_want = w.clone(), b_want = b.clone();  // on the caller's stream: the state as of save()
      EXPECT_TRUE(saver.save(live, path).background);
      torch::Tensor busy = mix;
      for (int i = 0; i < 10; ++i) busy = busy.matmul(mix);  // forward/backward: reads only
      saver.wait_staged();
      w.add_(100.0);  // the optimizer step, after wait_staged()
      b.mul_(-1);
      saver.wait();
      EXPECT_GT(saver.staging_bytes_allocated(), 0);

      ckpt::StateDict got;
      got.tensors["w"] = fsdp::ShardedTensor::from_local(torch::zeros({4096, 1024}), mesh, {fsdp::Shard(0)}, {4096, 1024});
      got.full["b"] = torch::zeros({2048}, torch::kBFloat16);
      got.full["step"] = torch::scalar_tensor(int64_t{0}, torch::kLong);
      ckpt::load(got, path);
      EXPECT_FALSE(torch::equal(w_want.cpu(), w_before)) << "the queued overwrite changed nothing: vacuous";
      EXPECT_TRUE(torch::equal(got.tensors.at("w").local(), w_want.cpu()))
          << "the snapshot missed the write queued before save() (or took the change after wait_staged())";
      EXPECT_TRUE(torch::equal(got.full.at("b"), b_want.cpu()));
      EXPECT_EQ(got.full.at("step").item<int64_t>(), 7);
    }
  }
  fs::remove_all(dir);
}
