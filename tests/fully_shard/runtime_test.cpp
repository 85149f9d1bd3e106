// The fully_shard runtime under real training code (issue 8): modules used more than once, evaluation
// between steps, exceptions in forward and backward, stale data, parameters that change (freeze/unfreeze,
// 0-dim, dtype), HSDP partial accumulation, module groups, meta init under mixed precision, diagnosis.
// Every training test compares with single-process training on the same global batch (fp32, 1e-5), checks
// that the reference trained, and checks from the collective counters that the feature under test ran.
#include "fully_shard/runtime_test_util.h"
#include "fully_shard/small_llama.h"

#include <fsdp/materialize.h>
#include <fsdp/models/llama.h>
#include <fsdp/comm_stats.h>

#include <c10/core/InferenceMode.h>

using namespace fsdp_rt;
using fsdp::ReshardAfterForward;
using Reshard = std::optional<ReshardAfterForward>;

namespace {
const std::vector<Reshard> kReshardModes = {std::nullopt, ReshardAfterForward(true), ReshardAfterForward(false)};

// Trains ref and sharded for `steps` steps with `body` as the model's block sequence; per step the sharded
// side must issue exactly `groups` reduce-scatters (once per group, however often its module ran).
void train_with_body(const NetImpl::Body& body, int64_t n_blocks, const Reshard& reshard, int64_t groups,
                     const std::string& what, int steps = 4) {
  Trainer ref = make_reference(21, n_blocks);
  Trainer dist = make_sharded(21, n_blocks, reshard);
  ref.net->body = body;
  dist.net->body = body;
  auto init = snapshot(*ref.net);
  auto g = world_mesh().group(0);
  for (int step = 0; step < steps; ++step) {
    auto b = batch(step);
    ref.step(b);
    fsdp::reset_comm_stats(*g);
    dist.step(b);
    auto c = counts(g);
    EXPECT_EQ(c.rs, groups) << what << " step " << step << ": one reduce-scatter per group per backward";
    EXPECT_GE(c.ag, groups) << what << " step " << step;
  }
  expect_parity(*dist.net, *ref.net, 1e-5, what);
  expect_moved(*ref.net, init);
}
}  // namespace

// ---------------------------------------------------------------------------------------------------------
// 1. Repeated use
// ---------------------------------------------------------------------------------------------------------

// A shared encoder applied twice in one forward: enc(enc(x)).
TEST(RuntimeRepeatedUse, SameModuleTwiceInSequence) {
  for (const auto& r : kReshardModes) {
    train_with_body([](NetImpl& m, torch::Tensor h) { return m.block(1, m.block(0, m.block(0, h))); }, 2, r, 3,
                    "enc(enc(x)) reshard=" + reshard_name(r));
  }
}

// A shared encoder applied to two inputs whose results are summed: enc(x1) + enc(x2).
TEST(RuntimeRepeatedUse, SameModuleOnTwoInputsSummed) {
  for (const auto& r : kReshardModes) {
    train_with_body(
        [](NetImpl& m, torch::Tensor h) { return m.block(1, m.block(0, h) + m.block(0, torch::sin(2 * h))); }, 2, r, 3,
        "enc(x1)+enc(x2) reshard=" + reshard_name(r));
  }
}

// Siamese / DPO: two root forwards on different batches, then one backward of the summed loss.
TEST(RuntimeRepeatedUse, TwoRootForwardsOneBackward) {
  for (const auto& r : kReshardModes) {
    const std::string what = "two root forwards reshard=" + reshard_name(r);
    Trainer ref = make_reference(22, 3);
    Trainer dist = make_sharded(22, 3, r);
    auto init = snapshot(*ref.net);
    auto g = world_mesh().group(0);
    for (int step = 0; step < 4; ++step) {
      auto b1 = batch(2 * step), b2 = batch(2 * step + 1);
      for (Trainer* t : {&ref, &dist}) {
        t->opt->zero_grad();
        if (t->sharded) fsdp::reset_comm_stats(*g);
        auto loss = t->loss(b1) + 0.5 * t->loss(b2);
        loss.backward();
        if (t->sharded) {
          EXPECT_EQ(counts(g).rs, 4) << what << " step " << step << ": each group reduced once for both forwards";
        }
        t->opt->step();
      }
    }
    expect_parity(*dist.net, *ref.net, 1e-5, what);
    expect_moved(*ref.net, init);
  }
}

// backward(retain_graph=true) then backward() on the same loss: gradients are 2x, reduced once per backward
// call; the second backward gathers again what the first one resharded.
TEST(RuntimeRepeatedUse, RetainGraphThenSecondBackward) {
  for (const auto& r : kReshardModes) {
    const std::string what = "retain_graph reshard=" + reshard_name(r);
    Trainer ref = make_reference(23, 3);
    Trainer dist = make_sharded(23, 3, r);
    auto init = snapshot(*ref.net);
    auto g = world_mesh().group(0);
    for (int step = 0; step < 3; ++step) {
      auto b = batch(step);
      for (Trainer* t : {&ref, &dist}) {
        t->opt->zero_grad();
        auto loss = t->loss(b);
        if (t->sharded) fsdp::reset_comm_stats(*g);
        loss.backward({}, /*retain_graph=*/true);
        if (t->sharded) {
          EXPECT_EQ(counts(g).rs, 4) << what << " step " << step << " first backward";
          fsdp::reset_comm_stats(*g);
        }
        loss.backward();
        if (t->sharded) {
          EXPECT_EQ(counts(g).rs, 4) << what << " step " << step << " second backward";
          // The synchronized first backward resharded every group: the second one gathers each again.
          EXPECT_EQ(counts(g).ag, 4) << what << " step " << step << " second backward";
        }
        t->opt->step();
      }
    }
    expect_parity(*dist.net, *ref.net, 1e-5, what);
    expect_moved(*ref.net, init);
  }
}

// enc(enc(x)) combined with micro-batch accumulation (no gradient sync on the first micro-batch) and with
// another block frozen for some steps: reductions only on the synchronized micro-batch, once per group.
TEST(RuntimeRepeatedUse, WithAccumulationAndFrozenBlock) {
  for (const auto& r : kReshardModes) {
    const std::string what = "enc(enc(x)) + accumulation + freeze reshard=" + reshard_name(r);
    Trainer ref = make_reference(37, 3);
    Trainer dist = make_sharded(37, 3, r);
    auto body = [](NetImpl& m, torch::Tensor h) { return m.run_blocks(m.block(0, h)); };
    ref.net->body = body;
    dist.net->body = body;
    auto init = snapshot(*ref.net);
    auto g = world_mesh().group(0);
    for (int step = 0; step < 6; ++step) {
      const bool frozen = step == 2 || step == 3;
      for (Trainer* t : {&ref, &dist}) {
        for (auto& p : t->net->blocks[1]->parameters()) p.requires_grad_(!frozen);
      }
      auto b = batch(step);
      ref.step(b, 2);
      fsdp::reset_comm_stats(*g);
      dist.step(b, 2);
      EXPECT_EQ(counts(g).rs, frozen ? 3 : 4) << what << " step " << step;
    }
    expect_parity(*dist.net, *ref.net, 1e-5, what);
    expect_moved(*ref.net, init);
  }
}

// ---------------------------------------------------------------------------------------------------------
// 2. Evaluation
// ---------------------------------------------------------------------------------------------------------

// Forwards under NoGradGuard and InferenceMode before and between training steps: the reference's eval
// output, one all-gather per group, no reduction, nothing registered for backward, every parameter back to
// its shard afterwards; training afterwards equals the reference.
TEST(RuntimeEvaluation, NoGradAndInferenceModeBetweenSteps) {
  for (const auto& r : kReshardModes) {
    const std::string what = "eval reshard=" + reshard_name(r);
    Trainer ref = make_reference(24, 3);
    Trainer dist = make_sharded(24, 3, r);
    auto init = snapshot(*ref.net);
    auto g = world_mesh().group(0);
    for (int step = 0; step < 5; ++step) {
      auto eval_x = batch(500 + step).x;  // the whole eval batch on every rank
      torch::Tensor expected;
      {
        torch::NoGradGuard ng;
        expected = ref.forward(eval_x);
      }
      const bool inference = step % 2 == 1;
      fsdp::reset_comm_stats(*g);
      torch::Tensor out;
      out = dist.eval_forward(eval_x, inference);
      auto c = counts(g);
      const std::string at = what + (inference ? " InferenceMode" : " NoGradGuard") + " before step " + std::to_string(step);
      EXPECT_LE(rel(out, expected), 1e-5) << at;
      EXPECT_FALSE(out.requires_grad()) << at;
      EXPECT_EQ(c.ag, 4) << at << ": one all-gather per group";
      EXPECT_EQ(c.rs, 0) << at;
      EXPECT_EQ(c.ar, 0) << at;
      auto ref_params = ref.net->named_parameters();
      for (const auto& item : dist.net->named_parameters()) {
        EXPECT_EQ(item.value().sizes().vec(), shard_sizes(ref_params[item.key()])) << at << ": " << item.key()
                                                                                   << " not resharded after eval";
      }
      auto b = batch(step);
      ref.step(b);
      fsdp::reset_comm_stats(*g);
      dist.step(b);
      EXPECT_EQ(counts(g).rs, 4) << what << " training step " << step;
    }
    expect_parity(*dist.net, *ref.net, 1e-5, what);
    expect_moved(*ref.net, init);
  }
}

// A module used twice in an evaluation forward (under NoGradGuard and InferenceMode), also while another
// block is frozen: the reference's output and no reduction; training in between equals the reference.
TEST(RuntimeEvaluation, RepeatedUseUnderNoGradAndInferenceMode) {
  for (const auto& r : kReshardModes) {
    const std::string what = "eval enc(enc(x)) reshard=" + reshard_name(r);
    Trainer ref = make_reference(36, 3);
    Trainer dist = make_sharded(36, 3, r);
    bool twice = true;
    auto body = [&twice](NetImpl& m, torch::Tensor h) {
      if (twice) h = m.block(0, h);
      return m.run_blocks(h);
    };
    ref.net->body = body;
    dist.net->body = body;
    auto init = snapshot(*ref.net);
    auto g = world_mesh().group(0);
    bool frozen = false;
    for (int step = 0; step < 4; ++step) {
      if (step == 2) {
        frozen = true;
        for (Trainer* t : {&ref, &dist}) {
          for (auto& p : t->net->blocks[1]->parameters()) p.requires_grad_(false);
        }
      }
      twice = true;
      auto x = batch(600 + step).x;
      torch::Tensor expected;
      {
        torch::NoGradGuard ng;
        expected = ref.forward(x);
      }
      for (bool inference : {false, true}) {
        const std::string at = what + (inference ? " InferenceMode" : " NoGradGuard") + " step " + std::to_string(step) +
                               (frozen ? " (block 1 frozen)" : "");
        fsdp::reset_comm_stats(*g);
        torch::Tensor out;
        out = dist.eval_forward(x, inference);
        EXPECT_LE(rel(out, expected), 1e-5) << at;
        EXPECT_EQ(counts(g).rs, 0) << at;
        EXPECT_GE(counts(g).ag, 4) << at;
      }
      twice = step % 2 == 0;
      auto b = batch(step);
      ref.step(b);
      fsdp::reset_comm_stats(*g);
      dist.step(b);
      EXPECT_EQ(counts(g).rs, frozen ? 3 : 4) << what << " training step " << step;
    }
    expect_parity(*dist.net, *ref.net, 1e-5, what);
    expect_moved(*ref.net, init);
  }
}

// ---------------------------------------------------------------------------------------------------------
// 3. Exceptions
// ---------------------------------------------------------------------------------------------------------

namespace {
enum class Where { Forward, Backward };

// Step 2 fails on every rank (symmetric); the user catches, zero_grads and goes on (optionally calling the
// documented reset). The reference simply skips step 2.
void exception_then_continue(Where where, bool use_reset, const Reshard& reshard) {
  const std::string what = std::string(where == Where::Forward ? "forward" : "backward") + " exception" +
                           (use_reset ? " + reset()" : "") + " reshard=" + reshard_name(reshard);
  Trainer ref = make_reference(25, 3);
  Trainer dist = make_sharded(25, 3, reshard);
  auto init = snapshot(*ref.net);
  auto g = world_mesh().group(0);
  int caught = 0;
  for (int step = 0; step < 6; ++step) {
    auto b = batch(step);
    if (step == 2) {
      if (where == Where::Forward) dist.net->block_ref(1).throw_in_forward = true;
      else dist.net->throw_in_backward = true;
      try {
        dist.step(b);
        ADD_FAILURE() << what << ": the injected failure did not surface";
      } catch (const std::exception& e) {
        ++caught;
        EXPECT_NE(std::string(e.what()).find("injected failure"), std::string::npos) << what << ": " << e.what();
      }
      dist.opt->zero_grad();
      if (use_reset) {
        if (!call_reset(dist.root())) {
          ADD_FAILURE() << what << ": fsdp::FSDPModule::reset() does not exist (yet)";
        } else {
          // reset() frees the unsharded parameters: every parameter shows its shard again.
          auto ref_params = ref.net->named_parameters();
          for (const auto& item : dist.net->named_parameters()) {
            EXPECT_EQ(item.value().sizes().vec(), shard_sizes(ref_params[item.key()]))
                << what << ": " << item.key() << " still unsharded after reset()";
          }
        }
      }
      continue;  // the reference skips this step
    }
    ref.step(b);
    fsdp::reset_comm_stats(*g);
    dist.step(b);
    EXPECT_EQ(counts(g).rs, 4) << what << " step " << step;
  }
  EXPECT_EQ(caught, 1) << what;
  expect_parity(*dist.net, *ref.net, 1e-5, what);
  expect_moved(*ref.net, init);
}
}  // namespace

TEST(RuntimeExceptions, ForwardExceptionThenContinueWithoutReset) {
  for (const auto& r : kReshardModes) exception_then_continue(Where::Forward, false, r);
}
TEST(RuntimeExceptions, BackwardExceptionThenContinueWithoutReset) {
  for (const auto& r : kReshardModes) exception_then_continue(Where::Backward, false, r);
}
TEST(RuntimeExceptions, ForwardExceptionThenReset) { exception_then_continue(Where::Forward, true, std::nullopt); }
TEST(RuntimeExceptions, BackwardExceptionThenReset) {
  exception_then_continue(Where::Backward, true, ReshardAfterForward(true));
}

// ---------------------------------------------------------------------------------------------------------
// 4. Stale data
// ---------------------------------------------------------------------------------------------------------

namespace {
enum class Change { InPlace, LoadShardedStateDict };

void halve(Trainer& t, Change how) {
  if (t.sharded && how == Change::LoadShardedStateDict) {
    auto sd = fsdp::sharded_state_dict(*t.net);
    fsdp::ShardedStateDict changed;
    for (const auto& [k, st] : sd) {
      changed[k] = fsdp::ShardedTensor::from_local(st.local().detach().clone().mul_(0.5), st.mesh(), st.placements(),
                                                   st.sizes());
    }
    fsdp::load_sharded_state_dict(*t.net, changed);
    return;
  }
  torch::NoGradGuard ng;
  for (auto& p : t.net->parameters()) p.mul_(0.5);
}

// Between steps the shards change on every rank; the next forward (its output) and the training after it
// must see the change. After step 1 an evaluation forward runs before the change as well.
void shards_change_between_steps(const Reshard& blocks, const Reshard& root, Change how, const std::string& what) {
  Trainer ref = make_reference(26, 3);
  Trainer dist = make_sharded(26, 3, mesh_opts(blocks), mesh_opts(root));
  auto init = snapshot(*ref.net);
  auto g = world_mesh().group(0);
  for (int step = 0; step < 5; ++step) {
    auto b = batch(step);
    ref.opt->zero_grad();
    dist.opt->zero_grad();
    auto ref_out = ref.forward(b.x);
    fsdp::reset_comm_stats(*g);
    auto out = dist.forward(dist.rows(b.x));
    EXPECT_EQ(counts(g).ag, 4) << what << " step " << step << ": forward gathers every group";
    EXPECT_LE(rel(out, rank_rows(ref_out)), 1e-5) << what << " step " << step << ": forward saw stale parameters";
    torch::mse_loss(ref_out, b.y).backward();
    torch::mse_loss(out, dist.rows(b.y)).backward();
    ref.opt->step();
    dist.opt->step();
    if (step == 1) {
      torch::NoGradGuard ng;
      auto x = batch(700).x;
      EXPECT_LE(rel(dist.forward(x), ref.forward(x)), 1e-5) << what << " eval after step 1";
    }
    if (step == 1 || step == 2) {
      halve(ref, Change::InPlace);
      halve(dist, how);
    }
  }
  expect_parity(*dist.net, *ref.net, 1e-5, what);
  expect_moved(*ref.net, init);
}
}  // namespace

TEST(RuntimeStaleData, InPlaceChangeSeenDefaultReshard) {
  shards_change_between_steps(std::nullopt, std::nullopt, Change::InPlace, "in-place change, default reshard");
}
TEST(RuntimeStaleData, InPlaceChangeSeenNoReshard) {
  shards_change_between_steps(ReshardAfterForward(false), ReshardAfterForward(false), Change::InPlace,
                              "in-place change, reshard_after_forward=false");
}
TEST(RuntimeStaleData, InPlaceChangeSeenHpZ) {
  // hpZ: an N-way copy kept after forward. N=2 divides 2 and 4; 3 ranks run the default policy.
  const Reshard r = nranks() % 2 == 0 ? Reshard(ReshardAfterForward(2)) : Reshard(std::nullopt);
  shards_change_between_steps(r, r, Change::InPlace, "in-place change, reshard=" + reshard_name(r));
}
TEST(RuntimeStaleData, LoadShardedStateDictSeen) {
  shards_change_between_steps(std::nullopt, std::nullopt, Change::LoadShardedStateDict,
                              "load_sharded_state_dict, default reshard");
  const Reshard r = nranks() % 2 == 0 ? Reshard(ReshardAfterForward(2)) : Reshard(ReshardAfterForward(false));
  shards_change_between_steps(r, r, Change::LoadShardedStateDict, "load_sharded_state_dict, reshard=" + reshard_name(r));
}

// A forward that skips blocks on some steps leaves the prefetches issued from the previous step's order
// unused (block 2 in forward and backward; blocks 1 and 2 on every third step). Shards change after every
// step; the next step must never see a stale prefetched copy.
TEST(RuntimeStaleData, UnusedPrefetchesNeverLeak) {
  for (const auto& r : {Reshard(ReshardAfterForward(true)), Reshard(std::nullopt)}) {
    const std::string what = "unused prefetches reshard=" + reshard_name(r);
    Trainer ref = make_reference(27, 4);
    Trainer dist = make_sharded(27, 4, r);
    auto init = snapshot(*ref.net);
    auto g = world_mesh().group(0);
    int step_now = 0;
    auto body = [&step_now](NetImpl& m, torch::Tensor h) {
      for (size_t i = 0; i < m.blocks->size(); ++i) {
        if (step_now % 2 == 1 && i == 2) continue;
        if (step_now % 3 == 2 && (i == 1 || i == 2)) continue;
        h = m.block(i, h);
      }
      return h;
    };
    ref.net->body = body;
    dist.net->body = body;
    for (step_now = 0; step_now < 8; ++step_now) {
      auto b = batch(step_now);
      ref.opt->zero_grad();
      dist.opt->zero_grad();
      auto ref_out = ref.forward(b.x);
      auto out = dist.forward(dist.rows(b.x));
      EXPECT_LE(rel(out, rank_rows(ref_out)), 1e-5) << what << " step " << step_now << ": stale forward";
      torch::mse_loss(ref_out, b.y).backward();
      fsdp::reset_comm_stats(*g);
      torch::mse_loss(out, dist.rows(b.y)).backward();
      const int64_t skipped = step_now % 3 == 2 ? 2 : (step_now % 2 == 1 ? 1 : 0);
      EXPECT_EQ(counts(g).rs, 5 - skipped) << what << " step " << step_now << ": groups with gradients";
      ref.opt->step();
      dist.opt->step();
      // Between steps every parameter shows its shard (nothing left gathered by an unused prefetch).
      auto ref_params = ref.net->named_parameters();
      for (const auto& item : dist.net->named_parameters()) {
        EXPECT_EQ(item.value().sizes().vec(), shard_sizes(ref_params[item.key()]))
            << what << " after step " << step_now << ": " << item.key() << " left unsharded";
      }
      torch::NoGradGuard ng;
      for (Trainer* t : {&ref, &dist}) {
        for (auto& p : t->net->parameters()) p.mul_(0.8);
      }
    }
    expect_parity(*dist.net, *ref.net, 1e-5, what);
    expect_moved(*ref.net, init);
  }
}

// ---------------------------------------------------------------------------------------------------------
// 5. Parameters change
// ---------------------------------------------------------------------------------------------------------

namespace {
void set_block_requires_grad(Trainer& t, size_t i, bool on) {
  for (auto& p : t.net->blocks[i]->parameters()) p.requires_grad_(on);
}

// Block 1 frozen for steps [freeze_from, unfreeze_at), optionally frozen before fully_shard already;
// block 0's fc1.weight frozen alone during the same steps (a partly frozen group still reduces).
void freeze_unfreeze(bool frozen_before_shard, OptKind opt, const std::string& what) {
  Trainer ref = make_reference(28, 3, false, opt);
  Trainer dist;
  if (frozen_before_shard) {
    // Freeze before fully_shard: build by hand so the flags are set first.
    dist.sharded = true;
    dist.net = make_net(28, 3);
    for (auto& p : dist.net->blocks[1]->parameters()) p.requires_grad_(false);
    auto o = mesh_opts();
    for (size_t i = 0; i < 3; ++i) dist.units.push_back(fsdp::fully_shard(dist.net->blocks[i], o));
    dist.units.push_back(fsdp::fully_shard(dist.net, o));
    dist.opt = make_optimizer(opt, dist.net->parameters());
    set_block_requires_grad(ref, 1, false);
  } else {
    dist = make_sharded(28, 3, std::nullopt, false, opt);
  }
  auto init = snapshot(*ref.net);
  auto g = world_mesh().group(0);
  const int freeze_from = frozen_before_shard ? 0 : 2, unfreeze_at = 5;
  for (int step = 0; step < 8; ++step) {
    if (step == freeze_from && !frozen_before_shard) {
      for (Trainer* t : {&ref, &dist}) set_block_requires_grad(*t, 1, false);
    }
    if (step == freeze_from) {
      for (Trainer* t : {&ref, &dist}) t->net->block_ref(0).fc1->weight.requires_grad_(false);
    }
    if (step == unfreeze_at) {
      for (Trainer* t : {&ref, &dist}) {
        set_block_requires_grad(*t, 1, true);
        t->net->block_ref(0).fc1->weight.requires_grad_(true);
      }
    }
    const bool frozen = step >= freeze_from && step < unfreeze_at;
    auto b = batch(step);
    ref.step(b);
    auto before = snapshot(*dist.net->blocks[1]);
    dist.opt->zero_grad();
    fsdp::reset_comm_stats(*g);
    dist.loss(b).backward();
    EXPECT_EQ(counts(g).rs, frozen ? 3 : 4) << what << " step " << step << ": groups with gradients";
    if (frozen) {
      for (const auto& item : dist.net->blocks[1]->named_parameters()) {
        EXPECT_FALSE(item.value().grad().defined()) << what << " step " << step << ": frozen " << item.key() << " has a grad";
      }
      EXPECT_FALSE(dist.net->block_ref(0).fc1->weight.grad().defined()) << what << " step " << step;
      EXPECT_TRUE(dist.net->block_ref(0).fc2->weight.grad().defined()) << what << " step " << step;
    }
    dist.opt->step();
    if (frozen) {
      for (const auto& item : dist.net->blocks[1]->named_parameters()) {
        EXPECT_TRUE(torch::equal(item.value(), before.at(item.key()))) << what << " step " << step << ": frozen "
                                                                       << item.key() << " changed";
      }
    }
  }
  expect_parity(*dist.net, *ref.net, 1e-5, what);
  expect_moved(*ref.net, init);
  // Block 1 trained after unfreezing (and, frozen from the start, only then).
  EXPECT_FALSE(torch::equal(ref.net->block_ref(1).fc1->weight, init.at("blocks.1.fc1.weight"))) << what;
}
}  // namespace

TEST(RuntimeParamsChange, FreezeThenUnfreezeAfterFullyShard) {
  freeze_unfreeze(false, OptKind::SGD, "freeze/unfreeze after fully_shard, SGD");
  freeze_unfreeze(false, OptKind::AdamW, "freeze/unfreeze after fully_shard, AdamW");
}
TEST(RuntimeParamsChange, FrozenBeforeFullyShardThenUnfrozen) {
  freeze_unfreeze(true, OptKind::SGD, "frozen before fully_shard, unfrozen later");
}

// Learnable 0-dim parameters in a sharded block and on the root: parity, and both state dicts hold them as
// shape [] with the right value.
TEST(RuntimeParamsChange, ZeroDimParameters) {
  Trainer ref = make_reference(29, 2, /*with_scale=*/true);
  Trainer dist = make_sharded(29, 2, std::nullopt, /*with_scale=*/true);
  auto init = snapshot(*ref.net);
  const std::vector<std::string> scalars = {"gain", "blocks.0.scale", "blocks.1.scale"};
  auto check_state_dicts = [&](const std::string& when) {
    auto ref_params = ref.net->named_parameters();
    auto sharded = fsdp::sharded_state_dict(*dist.net);
    for (const auto& k : scalars) {
      auto it = sharded.find(k);
      if (it == sharded.end()) {
        ADD_FAILURE() << when << ": " << k << " missing from sharded_state_dict";
        continue;
      }
      EXPECT_TRUE(it->second.sizes().empty()) << when << ": " << k << " global shape " << it->second.to_string();
    }
    for (const auto& [k, st] : sharded) {  // collective, same order on every rank
      auto full = st.full_tensor();
      if (std::find(scalars.begin(), scalars.end(), k) == scalars.end()) continue;
      EXPECT_EQ(full.dim(), 0) << when << ": " << k;
      EXPECT_LE(rel(full, ref_params[k]), 1e-5) << when << ": " << k << " " << full << " vs " << ref_params[k];
    }
    auto full = fsdp::full_state_dict(*dist.net, {true, false});
    for (const auto& k : scalars) {
      auto it = full.find(k);
      if (it == full.end()) {
        ADD_FAILURE() << when << ": " << k << " missing from full_state_dict";
        continue;
      }
      EXPECT_EQ(it->second.dim(), 0) << when << ": " << k;
      EXPECT_LE(rel(it->second, ref_params[k]), 1e-5) << when << ": " << k;
    }
  };
  check_state_dicts("before training");
  auto g = world_mesh().group(0);
  for (int step = 0; step < 5; ++step) {
    auto b = batch(step);
    ref.step(b);
    fsdp::reset_comm_stats(*g);
    dist.step(b);
    EXPECT_EQ(counts(g).rs, 3) << "step " << step;
  }
  check_state_dicts("after training");
  expect_parity(*dist.net, *ref.net, 1e-5, "0-dim parameters");
  expect_moved(*ref.net, init);
  for (const auto& k : scalars) EXPECT_NE(ref.net->named_parameters()[k].item<double>(), init.at(k).item<double>()) << k;
}

// module->to(kFloat64) after fully_shard (and after a first fp32 forward/backward, so the runtime has
// initialized its buffers): training continues in float64 equal to the reference converted likewise.
TEST(RuntimeParamsChange, ToFloat64AfterFullyShard) {
  Trainer ref = make_reference(30, 2);
  Trainer dist = make_sharded(30, 2);
  auto b0 = batch(0);
  for (Trainer* t : {&ref, &dist}) {
    t->loss(b0).backward();  // fp32 lazy init; no optimizer step: both sides keep identical parameters
    t->opt->zero_grad();
    t->net->to(torch::kFloat64);
    t->opt = std::make_unique<torch::optim::SGD>(t->net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  for (const auto& p : dist.net->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat64);
  auto init = snapshot(*ref.net);
  auto g = world_mesh().group(0);
  for (int step = 1; step < 5; ++step) {
    auto b = batch(step, torch::kFloat64);
    ref.step(b);
    fsdp::reset_comm_stats(*g);
    dist.step(b);
    EXPECT_EQ(counts(g).rs, 3) << "step " << step;
    for (const auto& p : dist.net->parameters()) {
      if (p.grad().defined()) EXPECT_EQ(p.grad().scalar_type(), torch::kFloat64);
    }
  }
  expect_parity(*dist.net, *ref.net, 1e-10, "to(kFloat64)");
  expect_moved(*ref.net, init);
}

// ---------------------------------------------------------------------------------------------------------
// 6. HSDP partial accumulation
// ---------------------------------------------------------------------------------------------------------

// 2x2 mesh; 3 micro-batches per step, the replicate all-reduce only on the last one. Equal to the reference,
// and the two replicas hold identical shards.
TEST(RuntimeHsdp, PartialAccumulationKeepsReplicasEqual) {
  if (nranks() != 4) GTEST_SKIP() << "needs 4 ranks for a 2x2 (replicate, shard) mesh";
  auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
  fsdp::FullyShardOptions o;
  o.mesh = mesh;
  Trainer ref = make_reference(31, 3);
  Trainer dist = make_sharded(31, 3, o, o);
  auto init = snapshot(*ref.net);
  auto shard_g = mesh.group("shard"), rep_g = mesh.group("replicate");
  constexpr int kMicro = 3;
  for (int step = 0; step < 4; ++step) {
    auto b = batch(step);
    ref.step(b, kMicro);
    dist.opt->zero_grad();
    fsdp::reset_comm_stats(*shard_g);
    fsdp::reset_comm_stats(*rep_g);
    for (int m = 0; m < kMicro; ++m) {
      dist.root().set_requires_all_reduce(m == kMicro - 1);
      dist.loss(b, m, kMicro).backward();
    }
    EXPECT_EQ(counts(shard_g).rs, 4 * kMicro) << "step " << step << ": a reduce-scatter per group per micro-batch";
    EXPECT_EQ(counts(rep_g).ar, 4) << "step " << step << ": one replicate all-reduce per group, last micro-batch";
    dist.opt->step();
  }
  dist.root().set_requires_all_reduce(true);
  expect_parity(*dist.net, *ref.net, 1e-5, "HSDP partial accumulation");
  expect_moved(*ref.net, init);
  // Replicas: this rank's shards equal those of the rank holding the same shard in the other replica.
  std::vector<torch::Tensor> locals;
  for (const auto& p : dist.net->parameters()) locals.push_back(p.detach().reshape({-1}));
  auto mine = torch::cat(locals);
  auto theirs = mine.clone();
  rep_g->broadcast(theirs, 0).wait();
  EXPECT_TRUE(torch::equal(mine, theirs)) << "replicas diverged: max difference " << (mine - theirs).abs().max().item<double>();
}

// ---------------------------------------------------------------------------------------------------------
// 7. Groups of modules
// ---------------------------------------------------------------------------------------------------------

// fully_shard({a, b}) as one group: steps where b runs before a, where only a runs, and where a then b run.
TEST(RuntimeGroups, TwoModulesOneGroupAnyOrder) {
  for (const auto& r : {Reshard(std::nullopt), Reshard(ReshardAfterForward(false))}) {
    const std::string what = "group {a, b} reshard=" + reshard_name(r);
    Trainer ref = make_reference(32, 3);
    Trainer dist;
    dist.sharded = true;
    dist.net = make_net(32, 3);
    auto o = mesh_opts(r);
    dist.units.push_back(fsdp::fully_shard(
        std::vector<std::shared_ptr<torch::nn::Module>>{dist.net->blocks[0], dist.net->blocks[1]}, o));
    dist.units.push_back(fsdp::fully_shard(dist.net->blocks[2], o));
    dist.units.push_back(fsdp::fully_shard(dist.net, o));
    dist.opt = make_optimizer(OptKind::SGD, dist.net->parameters());
    auto init = snapshot(*ref.net);
    auto g = world_mesh().group(0);
    int pattern = 0;
    auto body = [&pattern](NetImpl& m, torch::Tensor h) {
      if (pattern == 0) h = m.block(0, m.block(1, h));  // b before a
      if (pattern == 1) h = m.block(0, h);              // only a
      if (pattern == 2) h = m.block(1, m.block(0, h));  // a then b
      return m.block(2, h);
    };
    ref.net->body = body;
    dist.net->body = body;
    for (int step = 0; step < 6; ++step) {
      pattern = step % 3;
      auto b = batch(step);
      ref.step(b);
      fsdp::reset_comm_stats(*g);
      dist.step(b);
      EXPECT_EQ(counts(g).rs, 3) << what << " step " << step << " pattern " << pattern;
    }
    expect_parity(*dist.net, *ref.net, 1e-5, what);
    expect_moved(*ref.net, init);
  }
}

// ---------------------------------------------------------------------------------------------------------
// 8. Meta-device init under mixed precision
// ---------------------------------------------------------------------------------------------------------

namespace {
namespace llama = fsdp::models::llama;
fsdp::FullyShardOptions bf16_opts() {
  auto o = mesh_opts();
  o.mp_policy.param_dtype = torch::kBFloat16;
  return o;
}
}  // namespace

// Llama on meta, bf16 compute: full_params_init_scope writes fp32 shards equal to an fp32 unsharded init
// bit for bit, without any all-gather.
TEST(RuntimeMetaInit, MixedPrecisionScopeInitIsExactAndGathersNothing) {
  llama::Transformer reference(fsdp_test::small_llama_args(c10::kCPU));
  reference->init_weights(9);
  llama::Transformer model(fsdp_test::small_llama_args(c10::kMeta));
  auto o = bf16_opts();
  for (size_t i = 0; i < model->layers->size(); ++i) fsdp::fully_shard(model->layers[i], o);
  fsdp::fully_shard(model, o);
  fsdp::materialize_module(*model);
  auto g = world_mesh().group(0);
  fsdp::reset_comm_stats(*g);
  model->init_weights(9, fsdp::full_params_init_scope(*model));
  EXPECT_EQ(counts(g).ag, 0) << "initialization all-gathered (uninitialized) parameters";
  for (const auto& p : model->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat) << "shards must stay fp32";
  auto got = fsdp::full_state_dict(*model, {true, false});
  auto ref = reference->named_parameters();
  ASSERT_EQ(got.size(), ref.size() + reference->named_buffers().size());
  for (const auto& item : ref) {
    ASSERT_TRUE(got.count(item.key())) << item.key();
    EXPECT_EQ(got.at(item.key()).scalar_type(), torch::kFloat) << item.key();
    EXPECT_TRUE(torch::equal(got.at(item.key()), item.value()))
        << item.key() << ": max difference " << (got.at(item.key()) - item.value()).abs().max().item<double>();
  }
}

namespace {
// A small MLP whose parameters are created on a given device (torch::nn::Linear always allocates on the CPU):
// uneven sizes as elsewhere.
struct DevLinearImpl : torch::nn::Module {
  DevLinearImpl(int64_t in, int64_t out, c10::Device device) {
    auto o = torch::TensorOptions().device(device);
    weight = register_parameter("weight", torch::empty({out, in}, o));
    bias = register_parameter("bias", torch::empty({out}, o));
  }
  torch::Tensor forward(torch::Tensor x) { return torch::linear(x, weight, bias); }
  torch::Tensor weight, bias;
};
TORCH_MODULE(DevLinear);
struct DevBlockImpl : torch::nn::Module {
  explicit DevBlockImpl(c10::Device device) {
    fc1 = register_module("fc1", DevLinear(kDim, kHidden, device));
    fc2 = register_module("fc2", DevLinear(kHidden, kDim, device));
  }
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::relu(fc1(x))); }
  DevLinear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(DevBlock);
struct DevNetImpl : torch::nn::Module {
  explicit DevNetImpl(c10::Device device) {
    input = register_module("input", DevLinear(kIn, kDim, device));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) blocks->push_back(DevBlock(device));
    output = register_module("output", DevLinear(kDim, kOut, device));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = torch::tanh(input(x));
    for (size_t i = 0; i < blocks->size(); ++i) {
      auto b = blocks->ptr<DevBlockImpl>(i);
      h = fsdp::nn::call(b, h);
    }
    return output(h);
  }
  DevLinear input{nullptr}, output{nullptr};
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(DevNet);
}  // namespace

// A small MLP built on meta, bf16 compute, initialized unit by unit with init_with_full_params from one
// generator: the fp32 shards equal the same init of an unsharded fp32 model exactly, with no all-gather; the
// model then computes what the reference computes (to bf16 precision).
TEST(RuntimeMetaInit, MixedPrecisionInitWithFullParamsIsExact) {
  using Scope = std::function<void(torch::nn::Module&, const std::function<void()>&)>;
  auto draw = [](torch::nn::Module& part, at::Generator& gen) {
    for (auto& p : part.parameters()) p.copy_(torch::randn(p.sizes(), gen) * 0.3);
  };
  auto init_all = [&](DevNetImpl& net, const Scope& scope) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(77);
    for (size_t i = 0; i < net.blocks->size(); ++i) {
      scope(*net.blocks[i], [&] { draw(*net.blocks[i], gen); });
    }
    scope(net, [&] {
      draw(*net.input, gen);
      draw(*net.output, gen);
    });
  };
  DevNet reference(c10::Device(c10::kCPU));
  {
    torch::NoGradGuard ng;
    init_all(*reference, [](torch::nn::Module&, const std::function<void()>& fn) { fn(); });
  }
  DevNet model(c10::Device(c10::kMeta));
  for (const auto& p : model->parameters()) ASSERT_TRUE(p.is_meta());
  auto o = bf16_opts();
  std::vector<fsdp::FSDPModule> units;
  for (size_t i = 0; i < model->blocks->size(); ++i) units.push_back(fsdp::fully_shard(model->blocks[i], o));
  units.push_back(fsdp::fully_shard(model, o));
  fsdp::materialize_module(*model);
  auto g = world_mesh().group(0);
  fsdp::reset_comm_stats(*g);
  init_all(*model, [&](torch::nn::Module& part, const std::function<void()>& fn) {
    for (size_t i = 0; i < model->blocks->size(); ++i) {
      if (&part == model->blocks[i].get()) return fsdp::init_with_full_params(units[i], fn);
    }
    fsdp::init_with_full_params(units.back(), fn);
  });
  EXPECT_EQ(counts(g).ag, 0) << "initialization all-gathered (uninitialized) parameters";
  for (const auto& p : model->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat) << "shards must stay fp32";
  auto got = fsdp::full_state_dict(*model, {true, false});
  for (const auto& item : reference->named_parameters()) {
    ASSERT_TRUE(got.count(item.key())) << item.key();
    EXPECT_EQ(got.at(item.key()).scalar_type(), torch::kFloat) << item.key();
    EXPECT_TRUE(torch::equal(got.at(item.key()), item.value()))
        << item.key() << ": max difference " << (got.at(item.key()) - item.value()).abs().max().item<double>();
  }
  auto x = batch(0).x;
  torch::NoGradGuard ng;
  EXPECT_LE(rel(fsdp::nn::call(model, x).to(torch::kFloat), reference->forward(x)), 5e-2);
}

// ---------------------------------------------------------------------------------------------------------
// 9. Diagnosis
// ---------------------------------------------------------------------------------------------------------

// The root's forward uses block 0's weight after block 0 ran (it shows only this rank's shard then): an
// error that names the situation and the fix; the next correct steps train like the reference.
TEST(RuntimeDiagnosis, ParameterUsedOutsideItsModulesForward) {
  if (nranks() == 1) GTEST_SKIP() << "with one rank the shard is the whole parameter";
  Trainer ref = make_reference(34, 3);
  Trainer dist = make_sharded(34, 3);
  auto init = snapshot(*ref.net);
  auto g = world_mesh().group(0);
  bool raised = false;
  for (int step = 0; step < 5; ++step) {
    auto b = batch(step);
    if (step == 1) {
      dist.net->use_weight_outside = true;
      try {
        dist.step(b);
      } catch (const std::exception& e) {
        raised = true;
        const std::string msg = e.what();
        EXPECT_NE(msg.find("outside the forward of its FSDP module"), std::string::npos) << msg;
        EXPECT_NE(msg.find("unshard()"), std::string::npos) << msg;
      }
      dist.net->use_weight_outside = false;
      dist.opt->zero_grad();
      continue;  // the reference skips the failed step
    }
    ref.step(b);
    fsdp::reset_comm_stats(*g);
    dist.step(b);
    EXPECT_EQ(counts(g).rs, 4) << "step " << step;
  }
  EXPECT_TRUE(raised) << "using a sharded parameter outside its module's forward raised nothing";
  expect_parity(*dist.net, *ref.net, 1e-5, "after the outside-forward error");
  expect_moved(*ref.net, init);
}

// A sharded child run before its root's first forward is an error (as in PyTorch); then training works.
TEST(RuntimeDiagnosis, ChildBeforeRootIsAnError) {
  Trainer ref = make_reference(35, 3);
  Trainer dist = make_sharded(35, 3);
  auto init = snapshot(*ref.net);
  bool raised = false;
  try {
    auto y = dist.net->block(0, torch::randn({3, kDim}));
    y.sum().backward();
  } catch (const std::exception& e) {
    raised = true;
    EXPECT_NE(std::string(e.what()).find("before its FSDP root"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(raised) << "running a sharded child before its root raised nothing";
  for (const auto& p : dist.net->parameters()) EXPECT_FALSE(p.grad().defined());
  dist.opt->zero_grad();
  auto g = world_mesh().group(0);
  for (int step = 0; step < 4; ++step) {
    auto b = batch(step);
    ref.step(b);
    fsdp::reset_comm_stats(*g);
    dist.step(b);
    EXPECT_EQ(counts(g).rs, 4) << "step " << step;
  }
  expect_parity(*dist.net, *ref.net, 1e-5, "after the child-before-root error");
  expect_moved(*ref.net, init);
}
