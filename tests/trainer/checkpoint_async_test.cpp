// fsdp-train checkpoints on one process: an async save that fails in the background raises at the next
// checkpoint call (never silently); keep_latest_k keeps the newest; load_step and exclude_from_loading; a damaged
// newest checkpoint names the earlier ones to resume from; altered train and loader state is refused naming the
// file, the value and the rule.
#include "config.h"
#include "trainer.h"

#include <fsdp/checkpoint/checkpoint.h>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <functional>

using namespace fsdp_train;
namespace fs = std::filesystem;

namespace {
JobConfig tiny(const std::string& name, int64_t steps) {
  JobConfig c = load_config({"--model.flavor", "cpu_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
                             "--training.global_batch_size", "4", "--training.steps", std::to_string(steps),
                             "--lr_scheduler.warmup_steps", "2", "--metrics.peak_tflops", "1"});
  c.job.dump_folder = ::testing::TempDir() + "/fsdp_train_ckpt_" + name + "_" + std::to_string(::getpid());
  fs::remove_all(c.job.dump_folder);
  c.checkpoint.enable = true;
  c.checkpoint.interval = 2;
  return c;
}
TrainEnv quiet() {
  TrainEnv env;
  env.verbose = false;
  return env;
}
}  // namespace

TEST(TrainerCheckpoint, BackgroundSaveErrorSurfacesAtTheNextCheckpointCall) {
  JobConfig c = tiny("async_error", 4);
  c.checkpoint.async_mode = AsyncMode::Async;
  // The checkpoint folder cannot be created: a regular file is in the way.
  fs::create_directories(c.job.dump_folder);
  std::ofstream(fs::path(c.job.dump_folder) / "checkpoint") << "not a directory";
  try {
    run_training(c, quiet(), false);
    FAIL() << "a failed background save went unnoticed";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("step-2"), std::string::npos) << e.what();
  }
}

TEST(TrainerCheckpoint, KeepLatestKAndLoadStep) {
  JobConfig c = tiny("keep", 8);
  c.checkpoint.keep_latest_k = 2;
  c.checkpoint.last_save_model_only = false;
  const TrainSummary full = run_training(c, quiet(), false);
  const std::string folder = c.job.dump_folder + "/checkpoint";
  EXPECT_EQ(fsdp::checkpoint::complete_steps(folder), (std::vector<int64_t>{6, 8}));
  // load_step = 6: the run resumes after step 6 and repeats steps 7 and 8 exactly.
  c.checkpoint.load_step = 6;
  const TrainSummary again = run_training(c, quiet(), false);
  ASSERT_EQ(again.losses.size(), 2u);
  EXPECT_EQ(again.losses[0], full.losses[6]);
  EXPECT_EQ(again.losses[1], full.losses[7]);
  // Excluding the optimizer and the train state: the model is loaded, training restarts at step 1.
  c.checkpoint.exclude_from_loading = {CheckpointPart::Optimizer, CheckpointPart::TrainState, CheckpointPart::LrScheduler,
                                      CheckpointPart::Dataloader};
  const TrainSummary fresh = run_training(c, quiet(), false);
  EXPECT_EQ(fresh.losses.size(), 8u);
  EXPECT_LT(fresh.losses[0], full.losses[0] - 0.1);  // started from the trained weights
}

// The last save is model-only by default (last_save_model_only): an automatic resume with more steps must
// continue from the newest checkpoint that holds the training state (here step 4), not restart from step 1 on
// the final weights — and the continued run equals a run that was never interrupted.
TEST(TrainerCheckpoint, AutomaticResumeSkipsTheModelOnlyLastSave) {
  // decay_ratio = 0: warmup then constant, so the schedule does not depend on training.steps and a 6-step run
  // continued to 8 steps can equal an 8-step run.
  JobConfig uninterrupted = tiny("resume_ref", 8);
  uninterrupted.lr_scheduler.decay_ratio = 0.0;
  const TrainSummary reference = run_training(uninterrupted, quiet(), false);
  ASSERT_EQ(reference.losses.size(), 8u);

  JobConfig c = tiny("resume_model_only", 6);  // saves step-4 (full) and step-6 (model only)
  c.checkpoint.interval = 4;
  c.lr_scheduler.decay_ratio = 0.0;
  run_training(c, quiet(), false);
  const std::string folder = c.job.dump_folder + "/checkpoint";
  ASSERT_EQ(fsdp::checkpoint::complete_steps(folder), (std::vector<int64_t>{4, 6}));
  EXPECT_EQ(fsdp::checkpoint::inspect(fsdp::checkpoint::step_path(folder, 6)).values.count("train_state.step"), 0u);

  c.training.steps = 8;
  const TrainSummary resumed = run_training(c, quiet(), false);
  ASSERT_EQ(resumed.losses.size(), 4u) << "resumed after step 4: steps 5..8";
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(resumed.losses[i], reference.losses[4 + i]) << "step " << 5 + i;
}

// A damaged newest checkpoint stops the automatic resume with the checksum error and says how to go on: verify
// it, or resume from an earlier complete one with load_step (listed, model-only ones marked). Following that
// advice continues exactly as the run that was never interrupted.
TEST(TrainerCheckpoint, DamagedNewestCheckpointNamesTheEarlierOnes) {
  JobConfig c = tiny("damaged", 8);
  c.checkpoint.last_save_model_only = false;
  c.lr_scheduler.decay_ratio = 0.0;
  const TrainSummary full = run_training(c, quiet(), false);
  ASSERT_EQ(full.losses.size(), 8u);
  ASSERT_NE(full.losses[6], full.losses[0]);  // it trains: a restart from scratch would not match
  const std::string folder = c.job.dump_folder + "/checkpoint";
  ASSERT_EQ(fsdp::checkpoint::complete_steps(folder), (std::vector<int64_t>{2, 4, 6, 8}));
  // Flip bytes inside step-8's data file (past any header: the file is raw tensor bytes).
  fs::path data;
  for (const auto& e : fs::directory_iterator(fsdp::checkpoint::step_path(folder, 8))) {
    if (e.path().extension() == ".bin") data = e.path();
  }
  ASSERT_FALSE(data.empty());
  {
    std::fstream f(data, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    const char junk[4] = {'\x7f', '\x7f', '\x7f', '\x7f'};
    f.write(junk, sizeof junk);
  }
  c.training.steps = 10;
  try {
    run_training(c, quiet(), false);
    FAIL() << "a damaged checkpoint was loaded";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("checksum mismatch"), std::string::npos) << msg;
    EXPECT_NE(msg.find("fsdp-ckpt verify " + fsdp::checkpoint::step_path(folder, 8)), std::string::npos) << msg;
    EXPECT_NE(msg.find("--checkpoint.load_step N (complete: 2, 4, 6)"), std::string::npos) << msg;
  }
  // The advice works: resuming from step 6 repeats steps 7 and 8 of the first run bit for bit.
  c.checkpoint.load_step = 6;
  c.training.steps = 8;
  const TrainSummary again = run_training(c, quiet(), false);
  ASSERT_EQ(again.losses.size(), 2u);
  EXPECT_EQ(again.losses[0], full.losses[6]);
  EXPECT_EQ(again.losses[1], full.losses[7]);
}

// Saved state is input like any other: a checkpoint whose metadata.json was altered (by hand, a bad tool or an
// attacker) is refused before anything trains, with one line naming the file, the value and the rule — never a
// crash, a bare JSON library message, or a run that goes on with other data (before: train_state.step = -100 ran
// steps -99..0 with a negative learning rate; stream.file = 1e8 crashed; 100,000 nested '[' overflowed the stack).
TEST(TrainerCheckpoint, AlteredTrainAndLoaderStateIsRefusedNamingFileKeyAndRule) {
  JobConfig c = tiny("altered", 2);
  c.checkpoint.last_save_model_only = false;
  run_training(c, quiet(), false);
  const std::string folder = c.job.dump_folder + "/checkpoint";
  const std::string pristine = c.job.dump_folder + "/pristine-step-2";
  fs::copy(fsdp::checkpoint::step_path(folder, 2), pristine, fs::copy_options::recursive);
  const std::string md_path = fsdp::checkpoint::step_path(folder, 2) + "/metadata.json";
  auto read_text = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  const nlohmann::json md = nlohmann::json::parse(read_text(pristine + "/metadata.json"));
  ASSERT_TRUE(md["values"].contains("dataloader.dp_rank_0")) << md["values"].dump();
  c.training.steps = 4;
  // Resumes from step-2 with its metadata.json replaced by `text`; returns the error ("" if it trained).
  auto resume_with = [&](const std::string& text) -> std::string {
    fs::remove_all(fsdp::checkpoint::step_path(folder, 2));
    fs::remove_all(fsdp::checkpoint::step_path(folder, 4));
    fs::copy(pristine, fsdp::checkpoint::step_path(folder, 2), fs::copy_options::recursive);
    std::ofstream(md_path, std::ios::binary | std::ios::trunc) << text;
    try {
      const TrainSummary r = run_training(c, quiet(), false);
      EXPECT_EQ(r.losses.size(), 2u);
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    } catch (const std::exception& e) {
      return std::string("not a c10::Error: ") + e.what();
    }
    return "";
  };
  auto edited = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = md;
    edit(j["values"]);
    return resume_with(j.dump(1));
  };
  auto expect_refused = [&](const std::string& msg, std::initializer_list<const char*> parts) {
    EXPECT_FALSE(msg.empty()) << "resumed";
    EXPECT_NE(msg.find(md_path), std::string::npos) << msg;
    for (const char* p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "not one line: " << msg;
  };
  EXPECT_EQ(edited([](nlohmann::json&) {}), "");  // the unaltered copy resumes
  expect_refused(edited([](auto& v) { v["train_state.step"] = -100; }), {"train_state.step = -100", ">= 0"});
  expect_refused(edited([](auto& v) { v["train_state.step"] = "2"; }), {"train_state.step must be an integer, is a string"});
  expect_refused(edited([](auto& v) { v["train_state.step"] = 5; }), {"train_state.step = 5", "disagree"});
  expect_refused(edited([](auto& v) { v["train_state.ntokens_seen"] = -1; }), {"train_state.ntokens_seen = -1"});
  expect_refused(edited([](auto& v) { v["dataloader.dp_rank_0"]["stream"]["file"] = 100000000; }),
                 {"dataloader.dp_rank_0.stream.file = 100000000", "must be in [0, "});
  expect_refused(edited([](auto& v) { v["dataloader.dp_rank_0"]["stream"]["consumed"] = -1000; }),
                 {"dataloader.dp_rank_0.stream.consumed = -1000", ">= 0"});
  expect_refused(edited([](auto& v) { v["dataloader.dp_rank_0"]["micro"] = -5; }), {"dataloader.dp_rank_0.micro = -5"});
  expect_refused(edited([](auto& v) { v["dataloader.dp_rank_0"]["next_sample"] = 4e18; }),
                 {"dataloader.dp_rank_0.next_sample: must be an integer"});
  expect_refused(edited([](auto& v) { v["dataloader.dp_rank_0"]["next_sample"] = int64_t(4000000000000000000); }),
                 {"dataloader.dp_rank_0.next_sample = 4000000000000000000"});
  expect_refused(edited([](auto& v) { v["dataloader.world_size"] = "one"; }), {"dataloader.world_size must be an integer"});
  expect_refused(edited([](auto& v) { v["dataloader.dp_rank_x"] = v["dataloader.dp_rank_0"]; }),
                 {"'dataloader.dp_rank_x' is not named"});
  expect_refused(edited([](auto& v) { v["rng.cpu"] = "zz"; }), {"rng.cpu", "hex"});
  expect_refused(edited([](auto& v) {
                   for (auto it = v.begin(); it != v.end(); ++it) {
                     const std::string& k = it.key();
                     if (k.size() > 8 && k.compare(k.size() - 8, 8, ".amsgrad") == 0) it.value() = "yes";
                   }
                 }),
                 {"amsgrad' must be true or false, is a string"});
  // 100,000 levels of '[' in a value: refused by its nesting depth before anything recurses.
  std::string deep = md.dump(1);
  const auto values = deep.find("\"values\": {");
  ASSERT_NE(values, std::string::npos);
  deep.insert(values + 11, "\"deep\": " + std::string(100000, '[') + std::string(100000, ']') + ",");
  expect_refused(resume_with(deep), {"nested deeper than 64"});
}
