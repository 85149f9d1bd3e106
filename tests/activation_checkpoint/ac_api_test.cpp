// checkpoint_module's semantics on one process: PyTorch's non-reentrant properties (parameters get gradients
// when no input requires grad, gradients reach inputs, torch::autograd::grad, retain_graph), RNG replay, the
// mechanics (FQNs unchanged, evaluation skips it, double application rejected), and op-level SAC computing
// only the matmuls it did not keep.
#include "activation_checkpoint/ac_test_model.h"

#include <fsdp/activation_checkpoint.h>

#include <ATen/record_function.h>
#include <gtest/gtest.h>

#include <atomic>

using namespace ac_test;

namespace {
std::vector<std::shared_ptr<torch::nn::Module>> blocks_of(Model& m) {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (size_t i = 0; i < m->blocks->size(); ++i) out.push_back(m->blocks[i]);
  return out;
}

void expect_same_grads(Model& a, Model& b) {
  auto pa = a->named_parameters(), pb = b->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& item : pa) {
    const auto& g = item.value().grad();
    const auto& h = pb[item.key()].grad();
    ASSERT_TRUE(g.defined() && h.defined()) << item.key();
    EXPECT_LE((g - h).abs().max().item<double>(), 1e-6) << item.key();
    EXPECT_GT(g.abs().sum().item<double>(), 0.0) << item.key();
  }
}
}  // namespace

TEST(ActivationCheckpoint, ParametersGetGradientsWhenInputsDoNot) {
  for (auto policy : {fsdp::CheckpointPolicy::Full, fsdp::CheckpointPolicy::SelectiveOp}) {
    torch::manual_seed(3);
    Block ref(6, 9);
    torch::manual_seed(3);
    Block ac(6, 9);
    fsdp::checkpoint_module(ac, {policy});
    auto x = torch::randn({2, 4, 6});  // requires no grad: a block fed by data
    torch::manual_seed(5);
    fsdp::nn::call(ref, x).pow(2).sum().backward();
    torch::manual_seed(5);
    fsdp::nn::call(ac, x).pow(2).sum().backward();
    for (const auto& item : ref->named_parameters()) {
      const auto& h = ac->named_parameters()[item.key()].grad();
      ASSERT_TRUE(h.defined()) << item.key();
      EXPECT_LE((h - item.value().grad()).abs().max().item<double>(), 1e-6) << item.key();
    }
  }
}

TEST(ActivationCheckpoint, AutogradGradRetainGraphAndInputGradients) {
  for (auto policy : {fsdp::CheckpointPolicy::Full, fsdp::CheckpointPolicy::SelectiveOp}) {
    torch::manual_seed(3);
    Block ref(6, 9);
    torch::manual_seed(3);
    Block ac(6, 9);
    fsdp::checkpoint_module(ac, {policy});
    auto x = torch::randn({2, 4, 6}).requires_grad_(true);
    auto run = [&](Block& b) {
      torch::manual_seed(5);
      auto loss = fsdp::nn::call(b, x * 2).pow(2).sum();
      std::vector<torch::Tensor> wrt{x, b->wq->weight, b->ffn->w1->bias};
      auto first = torch::autograd::grad({loss}, wrt, {}, /*retain_graph=*/true);
      auto second = torch::autograd::grad({loss}, wrt);  // the graph (and the region) is used twice
      for (size_t i = 0; i < first.size(); ++i) EXPECT_TRUE(first[i].equal(second[i]));
      return first;
    };
    auto g_ref = run(ref);
    auto g_ac = run(ac);
    EXPECT_EQ(fsdp::checkpoint_stats(ac).recomputes, 2);
    for (size_t i = 0; i < g_ref.size(); ++i) {
      EXPECT_LE((g_ref[i] - g_ac[i]).abs().max().item<double>(), 1e-6) << i;
      EXPECT_GT(g_ref[i].abs().sum().item<double>(), 0.0);
    }
    EXPECT_FALSE(ac->wq->weight.grad().defined()) << "autograd::grad must not accumulate into .grad";
  }
}

TEST(ActivationCheckpoint, DropoutReplaysAndTheGeneratorContinuesAsWithout) {
  Model ref = make_model(3);
  Model ac = make_model(3);
  fsdp::checkpoint_every_kth(blocks_of(ac), 1);
  auto x = torch::randn({2, 5, 5});
  torch::manual_seed(77);
  fsdp::nn::call(ref, x).sum().backward();
  const auto next_ref = torch::rand({4});
  torch::manual_seed(77);
  fsdp::nn::call(ac, x).sum().backward();
  const auto next_ac = torch::rand({4});
  EXPECT_EQ(fsdp::checkpoint_stats(ac).recomputes, 3);
  expect_same_grads(ref, ac);
  EXPECT_TRUE(next_ref.equal(next_ac)) << "recomputation must not advance the global generator";

  // Without RNG preservation the recomputation draws new masks: the gradients differ (dropout is on).
  Model loose = make_model(3);
  fsdp::checkpoint_every_kth(blocks_of(loose), 1, {fsdp::CheckpointPolicy::Full, /*preserve_rng_state=*/false});
  torch::manual_seed(77);
  fsdp::nn::call(loose, x).sum().backward();
  EXPECT_GT((loose->blocks[0]->as<BlockImpl>()->wq->weight.grad() - ref->blocks[0]->as<BlockImpl>()->wq->weight.grad())
                .abs()
                .max()
                .item<double>(),
            1e-4);
}

TEST(ActivationCheckpoint, FqnsUnchangedEvaluationSkipsAndTwiceIsAnError) {
  Model ref = make_model(2);
  Model ac = make_model(2);
  EXPECT_EQ(fsdp::checkpoint_every_kth(blocks_of(ac), 2), 1u);  // block 1 only (counted from 1, like TorchTitan)
  EXPECT_FALSE(fsdp::is_checkpointed(*ac->blocks[0]));
  EXPECT_TRUE(fsdp::is_checkpointed(*ac->blocks[1]));
  EXPECT_EQ(ref->named_parameters().keys(), ac->named_parameters().keys());
  EXPECT_THROW(fsdp::checkpoint_module(ac->blocks[1]), c10::Error);
  torch::NoGradGuard no_grad;
  ac->eval();
  ref->eval();
  auto x = torch::randn({2, 5, 5});
  EXPECT_TRUE(fsdp::nn::call(ac, x).equal(fsdp::nn::call(ref, x)));
  EXPECT_EQ(fsdp::checkpoint_stats(ac).forwards, 0);
}

// Each checkpointed module keeps its own counters: two models in one process never see each other's work, a
// parent sums its checkpointed descendants, and a reset clears only the tree it is given.
TEST(ActivationCheckpoint, StatsBelongToTheirModel) {
  Model first = make_model(3);
  Model second = make_model(2);
  fsdp::checkpoint_every_kth(blocks_of(first), 1);
  fsdp::checkpoint_every_kth(blocks_of(second), 1);
  auto x = torch::randn({2, 5, 5});
  fsdp::nn::call(first, x).sum().backward();
  EXPECT_EQ(fsdp::checkpoint_stats(first).forwards, 3);
  EXPECT_EQ(fsdp::checkpoint_stats(first).recomputes, 3);
  EXPECT_EQ(fsdp::checkpoint_stats(*first->blocks[1]).recomputes, 1);
  EXPECT_EQ(fsdp::checkpoint_stats(second).forwards, 0);
  fsdp::nn::call(second, x).sum().backward();
  EXPECT_EQ(fsdp::checkpoint_stats(second).recomputes, 2);
  fsdp::reset_checkpoint_stats(second);
  EXPECT_EQ(fsdp::checkpoint_stats(second).recomputes, 0);
  EXPECT_EQ(fsdp::checkpoint_stats(first).recomputes, 3);
}

namespace {
// Counts matmul kernels that really run on the CPU: RecordFunction callbacks see every dispatched op, including
// the kept matmuls that op SAC answers without computing — so this counts dispatches; the kernel counts below
// separate computed from reused.
std::atomic<int64_t> g_matmul_dispatches{0};
}  // namespace

TEST(ActivationCheckpoint, SelectiveOpRecomputesOnlyTheMatmulsItDidNotKeep) {
  Model ref = make_model(2);
  Model ac = make_model(2);
  fsdp::checkpoint_every_kth(blocks_of(ac), 1, {fsdp::CheckpointPolicy::SelectiveOp});
  auto x = torch::randn({2, 5, 5});
  auto handle = at::addGlobalCallback(at::RecordFunctionCallback(
      [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
        const std::string name = fn.name();
        if (name == "aten::mm" || name == "aten::addmm" || name == "aten::bmm") ++g_matmul_dispatches;
        return nullptr;
      }));
  torch::manual_seed(1);
  auto loss_ref = fsdp::nn::call(ref, x).sum();
  torch::manual_seed(1);
  auto loss_ac = fsdp::nn::call(ac, x).sum();
  const auto at_forward = fsdp::checkpoint_stats(ac);
  EXPECT_EQ(at_forward.mm_saved, 4 * 2);  // 1st, 3rd, 5th, 7th matmul of each block
  g_matmul_dispatches = 0;
  loss_ref.backward();
  const int64_t backward_ref = g_matmul_dispatches.exchange(0);
  loss_ac.backward();
  const int64_t backward_ac = g_matmul_dispatches.exchange(0);
  at::removeCallback(handle);
  const auto s = fsdp::checkpoint_stats(ac);
  EXPECT_EQ(s.recomputes, 2);
  EXPECT_EQ(s.mm_reused, 4 * 2);
  EXPECT_EQ(s.mm_recomputed, 3 * 2);
  // The recomputation dispatches each block's 7 matmuls again (4 answered from the kept outputs), on top of the
  // backward's own matmuls.
  EXPECT_EQ(backward_ac - backward_ref, kMatmulsPerBlock * 2);
  EXPECT_LE((loss_ac - loss_ref).abs().item<double>(), 1e-6);
  expect_same_grads(ref, ac);
}
