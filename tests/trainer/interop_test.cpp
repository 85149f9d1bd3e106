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
#include "model_spec.h"
#include "train_env.h"
#include "trainer.h"

#include <fsdp/checkpoint/checkpoint.h>
#include <fsdp/checkpoint/safetensors.h>
#include <gtest/gtest.h>

#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <vector>

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

// ---- Hugging Face load and save of sharded models (ranks holding pieces: expert parallelism, pipeline stages) ----
//
// last_save_in_hf: each tensor gathered on its own (the experts' w1 / w3 as slices of gate_up_proj), under PP
// sent by its stage to rank 0; transformers loads the export (Qwen3MoeForCausalLM, LlamaForCausalLM,
// DeepseekV3ForCausalLM with the trained e_score_correction_bias equal to ours) and its
// logits equal our model's, built on one process from the libfsdp model-only save of the same run (1e-5).
// initial_load_in_hf: each rank reads its own pieces; the first step's loss and grad norm equal those of one
// process started from the same files (the whole-model import), and differ from a fresh start.
namespace {

JobConfig sharded_job(const std::string& folder, const std::vector<std::string>& model_args,
                      const std::vector<std::string>& layout_args) {
  std::vector<std::string> args = {"--training.seq_len", "32", "--training.local_batch_size", "2",
                                   "--training.global_batch_size", "8", "--training.steps", "4",
                                   "--lr_scheduler.warmup_steps", "2", "--metrics.peak_tflops", "1",
                                   "--training.mixed_precision_param", "float32"};
  args.insert(args.end(), model_args.begin(), model_args.end());
  args.insert(args.end(), layout_args.begin(), layout_args.end());
  JobConfig c = load_config(args);
  c.job.dump_folder = folder;
  c.checkpoint.enable = true;
  c.checkpoint.interval = c.training.steps;
  c.checkpoint.last_save_model_only = true;
  return c;
}

// Our logits for `tokens` [B, S] from the model (`config`'s family and flavor) whose whole tensors are `tensors`,
// on this process alone (no fully_shard).
at::Tensor our_logits(const std::string& family, const JobConfig& config,
                      const std::map<std::string, at::Tensor>& tensors, const at::Tensor& tokens) {
  ModelShape shape;
  shape.vocab_size = tensors.at("tok_embeddings.weight").size(0);
  shape.max_seq_len = config.training.seq_len;
  TrainModel model = train_spec(family).build(config, shape);
  torch::NoGradGuard no_grad;
  size_t copied = 0;
  for (auto& item : model.module->named_parameters(/*recurse=*/true)) {
    EXPECT_TRUE(tensors.count(item.key())) << item.key() << " is not in the libfsdp save";
    if (!tensors.count(item.key())) continue;
    item.value().copy_(tensors.at(item.key()));
    ++copied;
  }
  // Buffers that change the computation (the MoE load-balancing bias steers the routing) come from the save too.
  for (auto& item : model.module->named_buffers(/*recurse=*/true)) {
    EXPECT_TRUE(tensors.count(item.key())) << item.key() << " is not in the libfsdp save";
    if (tensors.count(item.key())) item.value().copy_(tensors.at(item.key()));
  }
  EXPECT_GT(copied, 0u);
  model.module->eval();
  return model.forward(tokens).to(at::kFloat);
}

void expect_hf_export_and_load(const std::string& name, const std::string& family,
                               const std::vector<std::string>& model_args,
                               const std::vector<std::string>& layout_args, const std::string& architecture,
                               const std::string& expect_in_plan) {
  // The same run twice: last save in the libfsdp format (model only) and as Hugging Face safetensors.
  const std::string ours_dir = shared_dir(name + "_ours");
  const JobConfig ours_cfg = sharded_job(ours_dir, model_args, layout_args);
  const TrainSummary ours = run_training(ours_cfg, dist_env(), false);
  EXPECT_NE(ours.plan.find(expect_in_plan), std::string::npos) << ours.plan;
  const std::string hf_run = shared_dir(name + "_hf");
  JobConfig hf_cfg = sharded_job(hf_run, model_args, layout_args);
  hf_cfg.checkpoint.last_save_in_hf = true;
  const TrainSummary exported = run_training(hf_cfg, dist_env(), false);
  expect_same_losses(exported, ours.losses, "the exporting run");
  fsdp::world()->barrier().wait();
  const std::string step = "/checkpoint/step-" + std::to_string(ours_cfg.training.steps);
  const std::string hf_dir = hf_run + step;
  ASSERT_TRUE(fs::exists(hf_dir + "/config.json")) << hf_dir;

  // transformers' logits of the export = ours of the libfsdp save (rank 0 compares; every rank learns the result).
  if (fsdp::world()->rank() == 0) {
    const int64_t B = 2, S = 16;
    std::vector<int64_t> ids(static_cast<size_t>(B * S));
    for (int64_t i = 0; i < B * S; ++i) ids[static_cast<size_t>(i)] = (i * 37 + 11) % 256;
    const std::string tokens = hf_run + "_tokens.bin";
    std::ofstream(tokens, std::ios::binary).write(reinterpret_cast<const char*>(ids.data()),
                                                  static_cast<std::streamsize>(ids.size() * sizeof(int64_t)));
    const std::string logits_file = hf_run + "_logits.st";
    const std::string log = hf_run + "_logits.log";
    const std::string cmd = "OMP_NUM_THREADS=1 " + kPython + " " + kTorchSide + " hf-logits --architecture " +
                            architecture + " --dir " + hf_dir + " --tokens " + tokens + " --logits " + logits_file +
                            " > " + log + " 2>&1";
    const int rc = std::system(cmd.c_str());
    std::cout << "---- " << cmd << " (status " << rc << ")\n" << slurp(log) << std::flush;
    EXPECT_EQ(rc, 0) << architecture << ".from_pretrained could not load the trainer's Hugging Face export";
    if (rc == 0) {
      const at::Tensor theirs = ckpt::safetensors::Reader(logits_file).read("logits");
      const at::Tensor mine =
          our_logits(family, ours_cfg, test::model_tensors(ours_dir + step), at::tensor(ids, at::kLong).view({B, S}));
      // (No ASSERT on rank 0 alone: the other ranks wait for it at the barrier below.)
      EXPECT_EQ(theirs.sizes(), mine.sizes());
      if (theirs.sizes() == mine.sizes()) {
        const double diff = (theirs - mine).abs().max().item<double>();
        const double scale = mine.abs().max().item<double>();
        std::cout << name << ": max |logits diff| " << diff << " (max |logit| " << scale << ")\n";
        EXPECT_GT(scale, 0.0);
        EXPECT_LE(diff, 1e-5 * std::max(1.0, scale)) << "transformers' logits of the export differ from ours";
      }
    }
    // DeepSeek-V3's load-balancing biases (trained, not zero) are the routers' e_score_correction_bias: the
    // routing choice only, which these logits need not show.
    if (architecture == "DeepseekV3ForCausalLM") {
      const auto saved = test::model_tensors(ours_dir + step);
      ckpt::safetensors::Reader files(hf_dir + "/model.safetensors");
      int biases = 0;
      for (const auto& [key, t] : saved) {
        const std::string suffix = ".moe.expert_bias";
        if (key.size() <= suffix.size() || key.compare(key.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
        const std::string layer = key.substr(0, key.size() - suffix.size());  // "layers.<i>"
        const at::Tensor bias = files.read("model." + layer + ".mlp.gate.e_score_correction_bias");
        EXPECT_TRUE(torch::equal(bias, t)) << key;
        EXPECT_GT(t.abs().sum().item<double>(), 0.0) << key << " was trained";
        ++biases;
      }
      EXPECT_EQ(biases, 2) << "cpu_tiny's two MoE layers";
    }
  }
  fsdp::world()->barrier().wait();

  // Started from the export on these ranks = one process started from it (step 1), unlike a fresh start.
  JobConfig from_hf = sharded_job(shared_dir(name + "_from_hf"), model_args, layout_args);
  from_hf.checkpoint.initial_load_path = hf_dir;
  from_hf.checkpoint.initial_load_model_only = true;
  from_hf.checkpoint.initial_load_in_hf = true;
  const TrainSummary got = run_training(from_hf, dist_env(), false);
  JobConfig one = sharded_job(::testing::TempDir() + "/fsdp_train_interop_" + name + "_one_rank" +
                                  std::to_string(fsdp::world()->rank()) + "_" + std::to_string(::getppid()),
                              model_args, {});
  fs::remove_all(one.job.dump_folder);
  one.checkpoint.initial_load_path = hf_dir;
  one.checkpoint.initial_load_model_only = true;
  one.checkpoint.initial_load_in_hf = true;
  TrainEnv single;
  single.verbose = false;
  const TrainSummary want = run_training(one, single, false);
  ASSERT_FALSE(got.losses.empty());
  ASSERT_FALSE(want.losses.empty());
  EXPECT_NEAR(got.losses[0], want.losses[0], 1e-5 * want.losses[0]) << "step 1 loss after initial_load_in_hf";
  EXPECT_NEAR(got.grad_norms[0], want.grad_norms[0], 1e-4 * want.grad_norms[0]) << "step 1 grad norm";
  EXPECT_GT(std::abs(got.losses[0] - ours.losses[0]), 1e-3 * ours.losses[0]) << "the trained weights were loaded";
}

}  // namespace

TEST(TrainerInteropSharded, HuggingFaceSaveAndLoadOfExpertParallelMoE) {
  // Qwen3-MoE with ep 2 x dp_shard 2 over these ranks (every rank holds half of the experts); load balancing off:
  // its bias steers the routing and Qwen3-MoE has no tensor for it.
  const std::string ep = std::to_string(fsdp::world()->size());
  expect_hf_export_and_load("ep_moe", "qwen3", {"--model.name", "qwen3", "--model.flavor", "cpu_tiny_moe",
                                                "--model.moe_load_balance_coeff", "0"},
                            {"--parallelism.expert_parallel_degree", ep}, "Qwen3MoeForCausalLM", "EP " + ep);
}

TEST(TrainerInteropSharded, HuggingFaceSaveAndLoadUnderPipelineParallelism) {
  // Llama 3 (dense) in 2 pipeline stages: each rank holds half of the layers, the other half on `meta`.
  expect_hf_export_and_load("pp2_dense", "llama3", {"--model.name", "llama3", "--model.flavor", "cpu_tiny"},
                            {"--parallelism.pipeline_parallel_degree", "2"},
                            "LlamaForCausalLM", "PP 2");
}

TEST(TrainerInteropSharded, HuggingFaceSaveAndLoadOfPipelinedMoE) {
  // Qwen3-MoE in 2 pipeline stages (issue 37's acceptance case): the same save/load path as the dense model above
  // (any family, the experts as slices of Hugging Face's stacked tensors).
  const std::vector<std::string> model = {"--model.name", "qwen3", "--model.flavor", "cpu_tiny_moe",
                                          "--model.moe_load_balance_coeff", "0"};
  const std::vector<std::string> layout = {"--parallelism.pipeline_parallel_degree", "2"};
  expect_hf_export_and_load("pp2_moe", "qwen3", model, layout, "Qwen3MoeForCausalLM", "PP 2");
}

// DeepSeek-V3 (issue 37), load balancing on: its bias is the routers' e_score_correction_bias (compared with the
// trained one). Expert parallel over these ranks (each holds half of the experts, the stacked tensors gathered one
// slice at a time), in 2 pipeline stages, and tensor parallel (MLA's projections split by heads or rowwise).
TEST(TrainerInteropSharded, HuggingFaceSaveAndLoadOfExpertParallelDeepSeekV3) {
  const std::string ep = std::to_string(fsdp::world()->size());
  expect_hf_export_and_load("ep_dsv3", "deepseek_v3", {"--model.name", "deepseek_v3", "--model.flavor", "cpu_tiny"},
                            {"--parallelism.expert_parallel_degree", ep}, "DeepseekV3ForCausalLM", "EP " + ep);
}

TEST(TrainerInteropSharded, HuggingFaceSaveAndLoadOfPipelinedDeepSeekV3) {
  expect_hf_export_and_load("pp2_dsv3", "deepseek_v3", {"--model.name", "deepseek_v3", "--model.flavor", "cpu_tiny"},
                            {"--parallelism.pipeline_parallel_degree", "2"}, "DeepseekV3ForCausalLM", "PP 2");
}

TEST(TrainerInteropSharded, HuggingFaceSaveAndLoadOfTensorParallelDeepSeekV3) {
  const std::string tp = std::to_string(fsdp::world()->size());
  expect_hf_export_and_load("tp_dsv3", "deepseek_v3", {"--model.name", "deepseek_v3", "--model.flavor", "cpu_tiny"},
                            {"--parallelism.tensor_parallel_degree", tp}, "DeepseekV3ForCausalLM", "TP " + tp);
}
