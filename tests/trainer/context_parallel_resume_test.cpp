// Checkpoints across context-parallel layouts (issue 38): a checkpoint holds every parameter once under the whole
// model's names whatever the cp degree (the ring splits activations, never weights), so a run saved under cp
// resumes at another layout. cpu_tiny, 6 steps of a global batch of 8 in fp32, stopped after its step-3 save:
//  - np2: a cp 2 save (alltoall, head-tail) resumes on 1 rank (rank 0 alone, no process group) and at dp_shard 2;
//    a 1-rank save resumes at cp 2.
//  - np4: a cp 2 x tp 2 save resumes on 1 rank and at dp_shard 4.
// Each resume trains on like the uninterrupted cp run (steps 4-6: loss and grad norm within 1e-5, the CP parity
// tests' bound: other reduction orders) and loads the weights bit for bit: a resume with a vanishing lr (1e-30)
// saves at step 6 the very weights it loaded, compared with torch::equal against the step-3 save.
// Not vacuous: the step-3 weights differ from step 6's of the uninterrupted run (it trained on), and each layout's
// plan names CP / TP or their absence.
#include "config.h"
#include "train_env.h"
#include "trainer.h"

#include <fsdp/process_group.h>

#include "comm/dist_env.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <string>

using namespace fsdp_train;
namespace fs = std::filesystem;

namespace {

std::string shared_dir(const std::string& name) { return test::shared_dir("fsdp_train_cp_resume", name); }

struct Layout {
  int64_t cp = 1, tp = 1, dp_shard = 1;
  bool one_rank = false;  // rank 0 alone, no process group (the other ranks wait)
  std::string name() const {
    if (one_rank) return "1 rank";
    std::string s = "dp_shard " + std::to_string(dp_shard);
    if (cp > 1) s += " x cp " + std::to_string(cp);
    if (tp > 1) s += " x tp " + std::to_string(tp);
    return s;
  }
};

JobConfig job(const std::string& folder, const Layout& l) {
  JobConfig c = test::checkpointed_job(folder);
  if (l.one_rank) {
    c.training.local_batch_size = 8;  // the same global batch without accumulation
    return c;
  }
  c.parallelism.data_parallel_shard_degree = l.dp_shard;
  c.parallelism.context_parallel_degree = l.cp;
  c.parallelism.tensor_parallel_degree = l.tp;
  c.parallelism.context_parallel_rotate_method = CpRotateMethod::AllToAll;
  c.parallelism.context_parallel_load_balancer = CpLoadBalancer::HeadTail;
  return c;
}

// Runs `l` on its ranks: every rank, or rank 0 alone while the others wait. The summary is rank 0's (empty on the
// other ranks for a 1-rank run).
TrainSummary run(const JobConfig& c, const Layout& l, int64_t stop_after = -1) {
  TrainSummary s;
  if (!l.one_rank) {
    s = run_training(c, test::world_env(false, stop_after), false);
  } else if (fsdp::world()->rank() == 0) {
    TrainEnv single;
    single.verbose = false;
    single.stop_after_step = stop_after;
    s = run_training(c, single, false);
  }
  fsdp::world()->barrier().wait();  // the saves are complete
  return s;
}

void copy_step3(const std::string& from, const std::string& to) {
  if (fsdp::world()->rank() == 0) {
    fs::create_directories(to + "/checkpoint");
    fs::copy(from + "/checkpoint/step-3", to + "/checkpoint/step-3", fs::copy_options::recursive);
  }
  fsdp::world()->barrier().wait();
}

void expect_plan_names_layout(const TrainSummary& s, const Layout& l) {
  if (l.one_rank) return;
  if (l.cp > 1)
    EXPECT_NE(s.plan.find("CP " + std::to_string(l.cp) + " (ring attention"), std::string::npos) << s.plan;
  else
    EXPECT_EQ(s.plan.find("CP "), std::string::npos) << s.plan;
  if (l.tp > 1) EXPECT_NE(s.plan.find("TP " + std::to_string(l.tp) + " ("), std::string::npos) << s.plan;
}

struct Uninterrupted {
  TrainSummary summary;  // rank 0's for a 1-rank run
  std::string dir;
  Layout layout;
};

Uninterrupted train_uninterrupted(const Layout& l, const std::string& tag) {
  Uninterrupted u{{}, shared_dir(tag + "_full"), l};
  u.summary = run(job(u.dir, l), l);
  expect_plan_names_layout(u.summary, l);
  if (fsdp::world()->rank() == 0 || !l.one_rank) {
    EXPECT_EQ(u.summary.losses.size(), 6u);
    if (u.summary.losses.size() == 6u)
      EXPECT_GT(std::abs(u.summary.losses[5] - u.summary.losses[3]), 1e-4 * u.summary.losses[3]) << "it trains on";
  }
  return u;
}

// `saved_at` trains stopped after its step-3 save; that save resumes at each of `resumes`, trains on like the
// uninterrupted run `full` (steps 4-6) and loads the weights bit for bit.
void expect_resumes(const Layout& saved_at, const std::vector<Layout>& resumes, const Uninterrupted& full_run,
                    const std::string& tag) {
  const bool on_rank0 = fsdp::world()->rank() == 0;
  const TrainSummary& full = full_run.summary;
  const bool have_full = on_rank0 || !full_run.layout.one_rank;
  const std::string dir = shared_dir(tag + "_stopped");
  const TrainSummary first = run(job(dir, saved_at), saved_at, /*stop_after=*/3);
  expect_plan_names_layout(first, saved_at);
  if (on_rank0 || !saved_at.one_rank) EXPECT_EQ(first.losses.size(), 3u);
  const auto at3 = test::model_tensors(dir + "/checkpoint/step-3");
  ASSERT_TRUE(at3.count("layers.0.attention.wq.weight"));
  ASSERT_TRUE(at3.count("tok_embeddings.weight"));
  {
    const auto full6 = test::model_tensors(full_run.dir + "/checkpoint/step-6");
    EXPECT_FALSE(torch::equal(full6.at("layers.0.attention.wq.weight"), at3.at("layers.0.attention.wq.weight")))
        << "the weights moved after step 3";
  }

  for (const Layout& to : resumes) {
    SCOPED_TRACE(tag + ": saved at " + saved_at.name() + ", resumed at " + to.name());
    const std::string key = tag + "_to_" + std::to_string(to.cp) + std::to_string(to.tp) +
                            std::to_string(to.dp_shard) + (to.one_rank ? "one" : "");
    const std::string on_dir = shared_dir(key), lr0_dir = shared_dir(key + "_lr0");
    copy_step3(dir, on_dir);
    copy_step3(dir, lr0_dir);
    const TrainSummary on = run(job(on_dir, to), to);
    expect_plan_names_layout(on, to);
    if ((on_rank0 || !to.one_rank) && have_full) {
      EXPECT_EQ(on.losses.size(), 3u) << "resumed after step 3";
      if (on.losses.size() == 3u && full.losses.size() == 6u) {
        for (size_t i = 0; i < 3; ++i) {
          EXPECT_NEAR(on.losses[i], full.losses[i + 3], 1e-5 * full.losses[i + 3]) << "step " << i + 4;
          EXPECT_NEAR(on.grad_norms[i], full.grad_norms[i + 3], 1e-5 * full.grad_norms[i + 3]) << "step " << i + 4;
        }
      }
    }
    JobConfig lr0 = job(lr0_dir, to);
    lr0.optimizer.lr = 1e-30;
    run(lr0, to);
    const auto loaded = test::model_tensors(lr0_dir + "/checkpoint/step-6");
    ASSERT_EQ(loaded.size(), at3.size());
    for (const auto& [name, want] : at3) {
      ASSERT_TRUE(loaded.count(name)) << name;
      EXPECT_TRUE(torch::equal(loaded.at(name), want)) << name << " changed in the reload";
    }
  }
}

}  // namespace

// np2: cp 2 -> 1 rank and dp_shard 2; 1 rank -> cp 2.
TEST(TrainerContextParallelResume, Cp2ResumesOnOneRankAndAtDp2AndOneRankResumesAtCp2) {
  if (fsdp::world()->size() != 2) GTEST_SKIP() << "2 ranks";
  const Layout cp2{2, 1, 1}, dp2{1, 1, 2}, one{1, 1, 1, /*one_rank=*/true};
  const Uninterrupted full = train_uninterrupted(cp2, "cp2");
  expect_resumes(cp2, {one, dp2}, full, "cp2");
  // The 1-rank save's resume at cp 2 against the same uninterrupted cp 2 run (the 1-rank run equals it to 1e-5,
  // trainer_context_parallel_test).
  expect_resumes(one, {cp2}, full, "one");
}

// np4: cp 2 x tp 2 -> 1 rank and dp_shard 4.
TEST(TrainerContextParallelResume, Cp2TimesTp2ResumesOnOneRankAndAtDp4) {
  if (fsdp::world()->size() != 4) GTEST_SKIP() << "4 ranks";
  const Layout cp2_tp2{2, 2, 1}, dp4{1, 1, 4}, one{1, 1, 1, /*one_rank=*/true};
  expect_resumes(cp2_tp2, {one, dp4}, train_uninterrupted(cp2_tp2, "cp2_tp2"), "cp2_tp2");
}
