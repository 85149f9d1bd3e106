// A randomized "real loop" (issue 8): 50 steps whose pattern a seeded RNG (identical on every rank) picks:
// evaluation forwards (NoGradGuard / InferenceMode), micro-batch accumulation without gradient sync on all
// but the last micro-batch, a module used twice in one forward, an injected exception in forward or backward
// (the step is skipped by both sides after zero_grad), freezing and unfreezing a block. The final parameters
// equal the single-process reference's (1e-5), and every pattern occurred.
#include "fully_shard/runtime_test_util.h"
#include <fsdp/comm_stats.h>

#include <c10/core/InferenceMode.h>

#include <random>

using namespace fsdp_rt;

TEST(RuntimeRealLoop, FiftyRandomStepsEqualReference) {
  constexpr int kSteps = 50, kGroups = 4;
  Trainer ref = make_reference(40, 3);
  Trainer dist = make_sharded(40, 3);
  auto init = snapshot(*ref.net);
  auto g = world_mesh().group(0);

  bool repeat = false;  // this step's forward runs block 0 twice
  auto body = [&repeat](NetImpl& m, torch::Tensor h) {
    if (repeat) h = m.block(0, h);
    return m.run_blocks(h);  // also where the backward failure is injected
  };
  ref.net->body = body;
  dist.net->body = body;

  std::map<std::string, int> seen;
  bool frozen = false;
  std::mt19937 rng(20261122);  // same seed, same sequence on every rank
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int step = 0; step < kSteps; ++step) {
    const bool do_eval = u(rng) < 0.3;
    const bool toggle_freeze = u(rng) < 0.12;
    const double kind = u(rng);
    const bool exception = kind < 0.12;
    const bool accumulate = !exception && (kind < 0.4 || kind > 0.85);
    const bool repeat_step = !exception && kind >= 0.25 && kind < 0.6;
    const std::string at = "step " + std::to_string(step);

    if (toggle_freeze) {
      frozen = !frozen;
      ++seen[frozen ? "freeze" : "unfreeze"];
      for (Trainer* t : {&ref, &dist}) {
        for (auto& p : t->net->blocks[1]->parameters()) p.requires_grad_(!frozen);
      }
    }

    if (do_eval) {
      const bool inference = seen["eval NoGradGuard"] > seen["eval InferenceMode"];
      ++seen[inference ? "eval InferenceMode" : "eval NoGradGuard"];
      // Every third evaluation runs block 0 twice as well.
      repeat = (seen["eval NoGradGuard"] + seen["eval InferenceMode"]) % 3 == 0;
      if (repeat) ++seen["eval with repeated use"];
      auto x = batch(1000 + step).x;
      torch::Tensor expected, out;
      {
        torch::NoGradGuard ng;
        expected = ref.forward(x);
      }
      fsdp::reset_comm_stats(*g);
      out = dist.eval_forward(x, inference);
      EXPECT_LE(rel(out, expected), 1e-5) << at << " eval";
      EXPECT_EQ(counts(g).rs, 0) << at << " eval";
      if (repeat) {
        EXPECT_GE(counts(g).ag, kGroups) << at << " eval";
      } else {
        EXPECT_EQ(counts(g).ag, kGroups) << at << " eval: one all-gather per group";
      }
    }
    repeat = repeat_step;

    auto b = batch(step);
    if (exception) {
      const bool in_forward = seen["exception in forward"] <= seen["exception in backward"];
      ++seen[in_forward ? "exception in forward" : "exception in backward"];
      // Some failures hit the last micro-batch of an accumulation (after a no-sync micro-batch whose
      // gradients FSDP holds unreduced): the whole step is skipped, those gradients must not leak.
      const int64_t micro = kind < 0.03 ? 2 : 1;
      if (micro > 1) ++seen["exception during accumulation"];
      bool caught = false;
      try {
        dist.opt->zero_grad();
        for (int64_t m = 0; m < micro; ++m) {
          dist.root().set_requires_gradient_sync(m == micro - 1);
          if (m == micro - 1) {
            if (in_forward) dist.net->block_ref(2).throw_in_forward = true;
            else dist.net->throw_in_backward = true;
          }
          dist.loss(b, m, micro).backward();
        }
      } catch (const std::exception& e) {
        caught = true;
        EXPECT_NE(std::string(e.what()).find("injected failure"), std::string::npos) << at << ": " << e.what();
      }
      EXPECT_TRUE(caught) << at << ": injected failure did not surface";
      dist.root().set_requires_gradient_sync(true);
      dist.opt->zero_grad();
      continue;  // skipped by both sides
    }
    if (accumulate) ++seen["accumulation"];
    if (repeat) ++seen["repeated use"];
    if (!accumulate && !repeat) ++seen["plain"];
    const int64_t micro = accumulate ? 2 : 1;
    ref.step(b, micro);
    fsdp::reset_comm_stats(*g);
    dist.step(b, micro);  // set_requires_gradient_sync(false) on all but the last micro-batch
    EXPECT_EQ(counts(g).rs, kGroups - (frozen ? 1 : 0)) << at << ": reductions only on the synchronized backward";
    if (frozen) {
      for (const auto& p : dist.net->blocks[1]->parameters()) EXPECT_FALSE(p.grad().defined()) << at;
    }
  }
  repeat = false;
  for (const char* pattern : {"eval NoGradGuard", "eval InferenceMode", "eval with repeated use", "accumulation",
                              "repeated use", "exception in forward", "exception in backward",
                              "exception during accumulation", "freeze", "unfreeze", "plain"}) {
    EXPECT_GE(seen[pattern], 1) << "pattern never occurred: " << pattern;
  }
  std::cout << "[real loop] patterns:";
  for (const auto& [k, v] : seen) std::cout << " " << k << "=" << v;
  std::cout << "\n";
  expect_parity(*dist.net, *ref.net, 1e-5, "real loop");
  expect_moved(*ref.net, init);
}
