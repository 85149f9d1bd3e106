// Mixed precision: param_dtype=bf16 (all-gathered parameters, forward/backward compute, input casting),
// reduce_dtype=fp32 (gradient reduction), fp32 sharded master weights. The reference simulates the same
// ranks in one process by hand: a bf16 copy of the fp32 weights computes each rank's gradient, the fp32 sum
// over ranks divided by the rank count is the master gradient.
#include "fully_shard/fsdp_test_util.h"

using namespace fsdp_test;

namespace {
constexpr int64_t kIn = 7, kOut = 5, kBatch = 24, kSteps = 8;

std::map<std::string, torch::Tensor> reference(int64_t world) {
  MLP master = make_mlp(31);
  MLP compute = make_mlp(31);
  compute->to(torch::kBFloat16);
  torch::optim::SGD optim(master->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto master_params = master->named_parameters();
  auto compute_params = compute->named_parameters();
  const int64_t local = kBatch / world;
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step, kBatch, kIn, kOut);
    std::map<std::string, torch::Tensor> grad_sum;
    for (int64_t r = 0; r < world; ++r) {
      {
        torch::NoGradGuard no_grad;
        for (auto& item : master_params) compute_params[item.key()].copy_(item.value());  // fp32 -> bf16
      }
      for (auto& p : compute->parameters()) p.mutable_grad() = torch::Tensor();
      auto out = compute->forward(x.narrow(0, r * local, local).to(torch::kBFloat16));
      torch::mse_loss(out.to(torch::kFloat), y.narrow(0, r * local, local)).backward();
      for (auto& item : compute_params) {
        auto g = item.value().grad().to(torch::kFloat);
        auto& acc = grad_sum[item.key()];
        acc = acc.defined() ? acc + g : g;
      }
    }
    for (auto& item : master_params) item.value().mutable_grad() = grad_sum[item.key()] / static_cast<double>(world);
    optim.step();
  }
  std::map<std::string, torch::Tensor> out;
  for (auto& item : master_params) out[item.key()] = item.value().detach().clone();
  return out;
}
}  // namespace

TEST(MixedPrecision, Bf16ParamsFp32ReduceMatchesManualCasts) {
  auto world = test_world();
  const int64_t rank = world->rank(), n = world->size();
  MLP model = make_mlp(31);
  fsdp::FullyShardOptions opts;
  opts.mp_policy.param_dtype = torch::kBFloat16;
  opts.mp_policy.reduce_dtype = torch::kFloat;
  auto units = shard_mlp(model, opts);
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const int64_t local = kBatch / n;
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step, kBatch, kIn, kOut);
    optim.zero_grad();
    auto out = fsdp::nn::call(model, x.narrow(0, rank * local, local));  // fp32 input, cast by the policy
    EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
    torch::mse_loss(out.to(torch::kFloat), y.narrow(0, rank * local, local)).backward();
    for (auto& p : model->parameters()) {
      ASSERT_EQ(p.scalar_type(), torch::kFloat);  // sharded master weights stay fp32
      if (p.grad().defined()) ASSERT_EQ(p.grad().scalar_type(), torch::kFloat);
    }
    optim.step();
  }
  auto got = full_params(*model, units);
  auto ref = reference(n);
  double worst = 0;
  for (auto& [name, r] : ref) {
    const double d = max_rel_diff(got.at(name), r);
    worst = std::max(worst, d);
    EXPECT_LE(d, 1e-5) << name;
  }
  // Non-vacuous: bf16 compute must differ from fp32 compute, or the test checks nothing about precision.
  MLP fp32 = make_mlp(31);
  torch::optim::SGD fp32_optim(fp32->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step, kBatch, kIn, kOut);
    fp32_optim.zero_grad();
    torch::mse_loss(fp32->forward(x), y).backward();
    fp32_optim.step();
  }
  double bf16_effect = 0;
  for (const auto& item : fp32->named_parameters()) bf16_effect = std::max(bf16_effect, max_rel_diff(ref[item.key()], item.value()));
  EXPECT_GT(bf16_effect, 1e-4);
  std::cout << "[mixed precision] worst relative difference to manual casts " << worst
            << "; bf16 vs fp32 training differ by " << bf16_effect << "\n";
}

TEST(MixedPrecision, OutputDtypeAndNoInputCast) {
  auto world = test_world();
  MLP model = make_mlp(32);
  fsdp::FullyShardOptions opts;
  opts.mp_policy.param_dtype = torch::kBFloat16;
  opts.mp_policy.output_dtype = torch::kFloat;
  fsdp::fully_shard(model, opts);
  auto out = fsdp::nn::call(model, torch::randn({2, kIn}));
  EXPECT_EQ(out.scalar_type(), torch::kFloat);
  out.sum().backward();

  MLP strict = make_mlp(33);
  fsdp::FullyShardOptions no_cast;
  no_cast.mp_policy.param_dtype = torch::kBFloat16;
  no_cast.mp_policy.cast_forward_inputs = false;
  fsdp::fully_shard(strict, no_cast);
  // fp32 input into bf16 weights without casting is a dtype mismatch in libtorch's linear.
  EXPECT_THROW(fsdp::nn::call(strict, torch::randn({2, kIn})), c10::Error);
}
