// Checkpoint interop through fsdp-train's own options (run under fsdprun with 2 ranks), each against a reference
// the trainer does not produce:
//   checkpoint.format = "dcp"   the saves are PyTorch DCP: torch's dcp_to_torch_save reads the step-3 save and
//                               every tensor equals the libfsdp-format save of the same run; resuming from it
//                               equals the uninterrupted run bit for bit
//   initial_load_path (DCP)     a new job started from that DCP step (full state) continues the uninterrupted run
//                               bit for bit; model only, it trains exactly as one started from the libfsdp save
//   last_save_in_hf             the last save is Hugging Face safetensors + config.json that transformers'
//                               LlamaForCausalLM.from_pretrained loads
//   initial_load_in_hf          a job started from that export trains exactly as one started from the libfsdp
//                               model-only last save of the same run
// Every "started from" run also differs from a fresh start, so the load is what made them equal.
#include "config.h"
#include "train_env.h"
#include "trainer.h"

#include <fsdp/checkpoint/checkpoint.h>
#include <fsdp/checkpoint/safetensors.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

using namespace fsdp_train;
namespace fs = std::filesystem;
namespace ckpt = fsdp::checkpoint;

namespace {

const std::string kPython = FSDP_TEST_PYTHON;
const std::string kTorchSide = std::string(FSDP_SOURCE_DIR) + "/tests/checkpoint/interop/torch_side.py";

std::string shared_dir(const std::string& name) { return test::shared_dir("fsdp_train_interop", name); }

JobConfig base(const std::string& folder) { return test::checkpointed_job(folder); }

TrainEnv dist_env(int64_t stop_after = -1) { return test::world_env(/*verbose=*/true, stop_after); }

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Rank 0 runs a PyTorch-side command; every rank gets its exit status (0 = PyTorch agreed).
int python_on_rank0(const std::string& args, const fs::path& log) {
  int rc = 0;
  if (fsdp::world()->rank() == 0) {
    const std::string cmd = "OMP_NUM_THREADS=1 " + kPython + " " + kTorchSide + " " + args + " > " + log.string() + " 2>&1";
    rc = std::system(cmd.c_str());
    std::cout << "---- " << cmd << " (status " << rc << ")\n" << slurp(log) << std::flush;
  }
  fsdp::world()->barrier().wait();
  return rc;
}

// A new job (empty checkpoint folder of its own) started from `from` (checkpoint.initial_load_path).
TrainSummary start_from(const std::string& name, const std::string& from, bool model_only, bool hf = false) {
  JobConfig c = base(shared_dir(name));
  c.checkpoint.initial_load_path = from;
  c.checkpoint.initial_load_model_only = model_only;
  c.checkpoint.initial_load_in_hf = hf;
  return run_training(c, dist_env(), false);
}

void expect_same_losses(const TrainSummary& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.losses.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got.losses[i], want[i]) << what << ", loss " << i;  // bit for bit
}

}  // namespace

TEST(TrainerInterop, DcpFormatSavesResumesAndStartsNewJobs) {
  // The uninterrupted run, saving in the libfsdp format (steps 3 and 6; step 6 is model-only).
  const std::string ours = shared_dir("libfsdp");
  const TrainSummary full = run_training(base(ours), dist_env(), false);
  ASSERT_EQ(full.losses.size(), 6u);
  ASSERT_NE(full.losses[3], full.losses[0]);  // it trains

  // The same run saving PyTorch DCP, stopped right after its step-3 save.
  const std::string dcp_run = shared_dir("dcp");
  JobConfig dcp_cfg = base(dcp_run);
  dcp_cfg.checkpoint.format = CheckpointFormat::Dcp;
  ASSERT_EQ(run_training(dcp_cfg, dist_env(/*stop_after=*/3), false).losses.size(), 3u);
  fsdp::world()->barrier().wait();
  const std::string dcp_step3 = dcp_run + "/checkpoint/step-3";
  ASSERT_TRUE(fs::exists(dcp_step3 + "/.metadata")) << "not a DCP layout: " << dcp_step3;
  EXPECT_FALSE(fs::exists(dcp_step3 + "/metadata.json"));
  EXPECT_EQ(ckpt::detect_format(dcp_step3), ckpt::Format::PytorchDcp);

  // PyTorch reads it: every tensor of the libfsdp step-3 save (model and optimizer, TorchTitan keys) equals what
  // dcp_to_torch_save returns for the DCP step-3 save.
  const std::string ref = ours + "/step3_tensors.safetensors";
  if (fsdp::world()->rank() == 0) {
    const std::string lib_step3 = ours + "/checkpoint/step-3";
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& t : ckpt::inspect(lib_step3).tensors) tensors.emplace_back(t.name, ckpt::read_tensor(lib_step3, t.name));
    ASSERT_GT(tensors.size(), 10u);
    bool has_optimizer = false;
    for (const auto& [name, t] : tensors) has_optimizer |= name.rfind("optimizer.state.", 0) == 0;
    EXPECT_TRUE(has_optimizer);
    fsdp::checkpoint::safetensors::save_file(ref, tensors);
  }
  EXPECT_EQ(python_on_rank0("dcp-read --dir " + dcp_step3 + " --ref " + ref, dcp_run + "_read.log"), 0)
      << "torch's dcp_to_torch_save disagrees with the libfsdp save of the same run";

  // Resumed from the DCP step: the uninterrupted run's steps 4..6, bit for bit.
  const TrainSummary resumed = run_training(dcp_cfg, dist_env(), false);
  expect_same_losses(resumed, {full.losses.begin() + 3, full.losses.end()}, "resumed from the DCP save");
  fsdp::world()->barrier().wait();
  EXPECT_EQ(ckpt::detect_format(dcp_run + "/checkpoint/step-6"), ckpt::Format::PytorchDcp);

  // A new job (empty checkpoint folder) started from the DCP step with its whole state continues the run.
  expect_same_losses(start_from("from_dcp_full", dcp_step3, /*model_only=*/false),
                     {full.losses.begin() + 3, full.losses.end()}, "initial_load_path = the DCP save, whole state");

  // Model only (TorchTitan's default): step 1 again with the step-3 weights and a fresh optimizer; the same as
  // starting from the libfsdp save, and not the same as a fresh start.
  const TrainSummary a = start_from("from_dcp_model", dcp_step3, /*model_only=*/true);
  const TrainSummary b = start_from("from_ours_model", ours + "/checkpoint/step-3", /*model_only=*/true);
  ASSERT_EQ(a.losses.size(), 6u);
  expect_same_losses(a, b.losses, "model-only initial load: DCP vs libfsdp");
  EXPECT_NE(a.losses[0], full.losses[0]);  // the weights were loaded
  EXPECT_LT(a.losses[0], full.losses[0]);
}

TEST(TrainerInterop, HuggingFaceLastSaveAndInitialLoad) {
  // The same run twice: last save in the libfsdp format (model only) and as Hugging Face safetensors.
  const std::string ours = shared_dir("hf_ours");
  const TrainSummary full = run_training(base(ours), dist_env(), false);
  const std::string hf_run = shared_dir("hf_export");
  JobConfig hf_cfg = base(hf_run);
  hf_cfg.checkpoint.last_save_in_hf = true;
  const TrainSummary exported = run_training(hf_cfg, dist_env(), false);
  expect_same_losses(exported, full.losses, "the exporting run");
  fsdp::world()->barrier().wait();
  const std::string hf_dir = hf_run + "/checkpoint/step-6";
  ASSERT_TRUE(fs::exists(hf_dir + "/config.json")) << hf_dir;
  ASSERT_TRUE(fs::exists(hf_dir + "/model.safetensors") || fs::exists(hf_dir + "/model.safetensors.index.json"));
  // The step-3 save is still a libfsdp checkpoint; only the last save is Hugging Face.
  EXPECT_EQ(ckpt::detect_format(hf_run + "/checkpoint/step-3"), ckpt::Format::Libfsdp);

  // transformers loads the export and runs it (logits of a few token ids).
  const std::string tokens = hf_run + "_tokens.bin";
  if (fsdp::world()->rank() == 0) {
    std::ofstream f(tokens, std::ios::binary);
    for (int64_t i = 0; i < 2 * 16; ++i) {
      const int64_t id = (i * 37 + 11) % 256;
      f.write(reinterpret_cast<const char*>(&id), sizeof id);
    }
  }
  EXPECT_EQ(python_on_rank0("hf-logits --dir " + hf_dir + " --tokens " + tokens + " --logits " + hf_run + "_logits.st",
                            hf_run + "_logits.log"),
            0)
      << "LlamaForCausalLM.from_pretrained could not load the trainer's Hugging Face export";

  // Started from the export (initial_load_in_hf) = started from the libfsdp model-only last save, bit for bit.
  const TrainSummary a = start_from("from_hf", hf_dir, /*model_only=*/true, /*hf=*/true);
  const TrainSummary b = start_from("from_ours_last", ours + "/checkpoint/step-6", /*model_only=*/true);
  ASSERT_EQ(a.losses.size(), 6u);
  expect_same_losses(a, b.losses, "initial load: Hugging Face export vs libfsdp model-only save");
  EXPECT_LT(a.losses[0], full.losses[0]);  // the trained weights were loaded, not a fresh start
}
