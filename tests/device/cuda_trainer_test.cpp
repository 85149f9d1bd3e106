// fsdp-train on CUDA tensors with 2 ranks sharing cuda:0 over Gloo (comm.backend = "gloo", training.device =
// "cuda:0" on both): pipeline parallelism (the activations' send/recv between the stages on CUDA tensors) and
// expert parallelism (the token all-to-alls on CUDA tensors), each against single-process training of the same
// global batch on the CPU (no group: neither the pipeline nor the all-to-all runs there), fp32, every step's
// loss and grad norm within 1e-4. NCCL at world 1 does not apply (both need 2 ranks); one GPU cannot host NCCL
// ranks that share it. Run by scripts/gpu-check.sh on a lent GPU machine; skipped without CUDA.
#include "device/cuda_trainer_util.h"

#include <cmath>

using namespace fsdp_device;

namespace {

void expect_same_curve(const fsdp_train::TrainSummary& ref, const fsdp_train::TrainSummary& got) {
  ASSERT_EQ(ref.losses.size(), got.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_TRUE(std::isfinite(got.losses[i])) << "step " << i + 1;
    EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-4 * ref.losses[i]) << "loss, step " << i + 1;
    EXPECT_NEAR(got.grad_norms[i], ref.grad_norms[i], 1e-4 * ref.grad_norms[i]) << "grad norm, step " << i + 1;
  }
  EXPECT_LT(ref.losses.back(), ref.losses.front()) << "the reference trained";
  EXPECT_EQ(got.device, "cuda:0");
}

}  // namespace

TEST(TrainerOnCuda, PipelineTwoStagesOverGlooEqualsOneCpuProcess) {
  FSDP_REQUIRE_CUDA();
  DeviceWorld dw("gloo", "cuda:0");
  const auto& world = dw.group();
  ASSERT_EQ(world->size(), 2);
  const std::vector<std::string> extra{"--model.flavor", "cpu_tiny", "--training.mixed_precision_param", "float32",
                                       "--parallelism.pipeline_parallel_degree", "2",
                                       "--training.device", "cuda:0", "--comm.backend", "gloo"};
  const auto ref = cpu_reference(trainer_job("pp_ref", extra, 4));
  const auto got = fsdp_train::run_training(trainer_job("pp", extra, 4), device_env(world), false);
  EXPECT_NE(got.plan.find("PP 2"), std::string::npos) << got.plan;
  std::cout << "[trainer cuda] pp 2 over gloo on cuda:0: final loss " << got.losses.back() << " (cpu "
            << ref.losses.back() << "), max reserved " << got.device_max_reserved_bytes << " B\n";
  expect_same_curve(ref, got);
  EXPECT_GT(got.device_max_active_bytes, 0);
}

TEST(TrainerOnCuda, ExpertParallelOverGlooEqualsOneCpuProcess) {
  FSDP_REQUIRE_CUDA();
  DeviceWorld dw("gloo", "cuda:0");
  const auto& world = dw.group();
  ASSERT_EQ(world->size(), 2);
  const std::vector<std::string> extra{"--model.name", "qwen3", "--model.flavor", "cpu_tiny_moe",
                                       "--training.mixed_precision_param", "float32",
                                       "--parallelism.expert_parallel_degree", "2",
                                       "--training.device", "cuda:0", "--comm.backend", "gloo"};
  const auto ref = cpu_reference(trainer_job("ep_ref", extra, 4));
  const auto got = fsdp_train::run_training(trainer_job("ep", extra, 4), device_env(world), false);
  EXPECT_NE(got.plan.find("EP 2 ("), std::string::npos) << got.plan;
  expect_same_curve(ref, got);
  ASSERT_EQ(ref.expert_loads.size(), got.expert_loads.size());
  for (size_t i = 0; i < ref.expert_loads.size(); ++i)
    EXPECT_EQ(got.expert_loads[i].max_tokens, ref.expert_loads[i].max_tokens) << "the same routing, step " << i + 1;
  std::cout << "[trainer cuda] ep 2 over gloo on cuda:0: final loss " << got.losses.back() << " (cpu "
            << ref.losses.back() << ")\n";
}
