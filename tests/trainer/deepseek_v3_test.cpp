// DeepSeek-V3 through fsdp-train (model.name = "deepseek_v3", models/deepseek_v3/: multi-head latent attention,
// a dense first layer, then MoE layers with a shared expert and sigmoid routing limited to 2 of 4 expert groups).
//   2 ranks: FSDP, expert parallelism 2, EP 2 with full activation checkpointing or op-level SAC, and plain data
//            parallelism
//            (replicate 2: fsdp::replicate) each equal 1 rank with (4 ranks: FSDP, and HSDP 2 x 2 with EP 2)
//            gradient accumulation over the same global batches: the loss and grad norm of every step (1e-5 /
//            1e-4 relative, as the other parity tests) and the expert load of every step exactly (which also shows
//            the load-balancing bias, which steers the routing, was updated identically).
//   tensor parallel: tp 2, with and without the sequence balance loss (2 ranks), and tp 2 x ep 2 (4 ranks) equal
//            1 rank the same way.
//   pipeline: pp 2 under 1F1B, Interleaved1F1B, ZBVZeroBubble, DualPipeV and a CSV schedule file (2 ranks), pp 2 x
//            ep 2 with the sequence balance loss (4 ranks), equal 1 rank the same way (the expert loads summed per
//            stage over its ranks); PP and TP together: pp 2 x tp 2 under both schedules and pp 2 x tp 2 x ep 2 with
//            the balance loss (4 ranks), pp 2 x dp_shard 2 x tp 2 x ep 2 with the balance loss (8 ranks).
//   context parallel: cp 2 (both rotate methods, head-tail and contiguous chunks; block_causal by the masked ring)
//            on 2 ranks, cp 2 x ep 2, cp 2 x tp 2 and pp 2 x cp 2 (CP inside the stages) on 4: loss, grad norm,
//            expert loads and the final parameters equal 1 rank.
//   1 rank:  the trainer's Hugging Face last save loads in transformers' DeepseekV3ForCausalLM with logits equal
//            (1e-5) to the library model holding the same run's libfsdp model-only save (the other format, read
//            tensor by tensor here: no adapter in the reference path); and a job started from that export
//            (initial_load_in_hf) trains exactly as one started from the libfsdp save.
#include "config.h"
#include "train_env.h"
#include "trainer.h"

#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/models/deepseek_v3.h>
#include <fsdp/process_group.h>

#include "comm/dist_env.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

using namespace fsdp_train;
namespace fs = std::filesystem;

namespace {

const std::string kPython = FSDP_TEST_PYTHON;
const std::string kHfSide = std::string(FSDP_SOURCE_DIR) + "/tests/models/deepseek_v3_hf_side.py";

JobConfig base(const std::string& folder, int64_t global_batch, int64_t steps = 8) {
  JobConfig c = load_config({"--model.name", "deepseek_v3", "--model.flavor", "cpu_tiny", "--training.seq_len", "16",
                             "--training.local_batch_size", "1", "--training.global_batch_size",
                             std::to_string(global_batch), "--training.steps", std::to_string(steps),
                             "--lr_scheduler.warmup_steps", "2", "--metrics.peak_tflops", "1"});
  c.job.dump_folder = folder;
  return c;
}

// A folder of this rank's own (the 1-rank references every rank runs), emptied.
std::string own_dir(const std::string& name) {
  const std::string d = ::testing::TempDir() + "/fsdp_train_dsv3_" + name + "_" + std::to_string(::getppid()) +
                        "_rank" + std::to_string(fsdp::world()->rank());
  fs::remove_all(d);
  return d;
}

TrainEnv single_process() {
  TrainEnv env;
  env.verbose = false;
  return env;
}

void expect_parity(const std::string& name, int64_t ep, bool full_ac = false, int64_t replicate = 1, int64_t tp = 1,
                   bool op_sac = false, double aux_coeff = 0) {
  const int64_t world = fsdp::world()->size();
  JobConfig ref_config = base(own_dir(name + "_ref"), world);
  ref_config.model.moe_sequence_aux_loss_coeff = aux_coeff;
  const TrainSummary ref = run_training(ref_config, single_process(), false);
  JobConfig config = base(test::shared_dir("fsdp_train_dsv3", name), world);
  config.model.moe_sequence_aux_loss_coeff = aux_coeff;
  config.parallelism.expert_parallel_degree = ep;
  config.parallelism.data_parallel_replicate_degree = replicate;
  config.parallelism.tensor_parallel_degree = tp;
  if (full_ac) config.activation_checkpoint.mode = AcMode::Full;
  if (op_sac) {
    config.activation_checkpoint.mode = AcMode::Selective;
    config.activation_checkpoint.selective_ac_option = SelectiveAcOption::op();
  }
  const TrainSummary got = run_training(config, test::world_env(), false);
  if (ep > 1) EXPECT_NE(got.plan.find("EP " + std::to_string(ep) + " ("), std::string::npos) << got.plan;
  else EXPECT_EQ(got.plan.find("EP "), std::string::npos) << got.plan;
  // replicate = world: TorchTitan's DDP path (fsdp::replicate), else fully_shard.
  const char* wrapping = replicate == world ? "data parallel (replicate" : replicate > 1 ? "HSDP" : "FSDP";
  EXPECT_NE(got.plan.find(wrapping), std::string::npos) << got.plan;
  if (full_ac) EXPECT_GT(got.ac_recomputes, 0) << "activation checkpointing recomputed nothing";
  if (op_sac) EXPECT_GT(got.ac_mm_reused, 0) << "op-level SAC kept no matmul";
  if (tp > 1) EXPECT_NE(got.plan.find("TP " + std::to_string(tp) + " (sequence parallel, MLA heads split"), std::string::npos) << got.plan;
  ASSERT_EQ(ref.losses.size(), 8u);
  test::expect_moe_steps_equal(ref, got, 2);  // cpu_tiny: 1 dense layer, then 2 MoE layers
  // The sequence balance loss (under TP each MoE block sums its per-sequence counts over the TP ranks).
  ASSERT_EQ(ref.aux_losses.size(), aux_coeff > 0 ? ref.losses.size() : 0u);
  ASSERT_EQ(got.aux_losses.size(), ref.aux_losses.size());
  for (size_t i = 0; i < ref.aux_losses.size(); ++i) {
    EXPECT_GT(ref.aux_losses[i], 0) << "step " << i + 1;
    EXPECT_NEAR(got.aux_losses[i], ref.aux_losses[i], 1e-5 * ref.aux_losses[i]) << "balance loss, step " << i + 1;
  }
  // The reference moved: it learned, and the load-balancing bias left zero.
  EXPECT_LT(ref.losses.back(), ref.losses.front());
  EXPECT_GT(ref.expert_loads.back().bias_l1, 0.0);
}

// pp ranks x (world / pp) data-parallel ranks (ep of them expert parallel, inside each stage) under each of
// `schedules` equal 1 rank: one pipeline step of 1-sample microbatches per optimizer step; with `aux_coeff` the
// sequence balance loss joins each stage's backward and equals the 1-rank value.
void expect_pipeline_parity(const std::string& name, int64_t pp, int64_t ep, const std::vector<std::string>& schedules,
                            double aux_coeff = 0, int64_t tp = 1) {
  const int64_t world = fsdp::world()->size(), dp = world / pp / tp;
  const int64_t global_batch = 2 * world;  // 4 microbatches per pipeline step at pp 2 x dp 1: DualPipeV's minimum
  JobConfig ref_config = base(own_dir(name + "_ref"), global_batch);
  ref_config.model.moe_sequence_aux_loss_coeff = aux_coeff;
  const TrainSummary ref = run_training(ref_config, single_process(), false);
  ASSERT_EQ(ref.losses.size(), 8u);
  EXPECT_LT(ref.losses.back(), ref.losses.front());
  EXPECT_GT(ref.expert_loads.back().bias_l1, 0.0) << "the load-balancing bias moved";
  for (const std::string& schedule : schedules) {
    SCOPED_TRACE(name + " " + schedule);
    const bool csv = schedule.rfind("csv:", 0) == 0;  // "csv:<file>": a schedule file instead of a name
    JobConfig config = base(test::shared_dir("fsdp_train_dsv3", name + "_" + (csv ? "csv" : schedule)), global_batch);
    config.model.moe_sequence_aux_loss_coeff = aux_coeff;
    config.training.local_batch_size = global_batch / dp;
    config.parallelism.pipeline_parallel_degree = pp;
    if (csv) config.parallelism.pipeline_parallel_schedule_csv = schedule.substr(4);
    else config.parallelism.pipeline_parallel_schedule = parse_choice<PipelineSchedule>(schedule).value();
    config.parallelism.pipeline_parallel_microbatch_size = 1;
    config.parallelism.expert_parallel_degree = ep;
    config.parallelism.tensor_parallel_degree = tp;
    const TrainSummary got = run_training(config, test::world_env(), false);
    EXPECT_NE(got.plan.find("PP " + std::to_string(pp) + " (" + (csv ? "CSV " + schedule.substr(4) : schedule)),
              std::string::npos)
        << got.plan;
    if (tp > 1) {
      EXPECT_NE(got.plan.find("TP " + std::to_string(tp) + " (sequence parallel, MLA heads split"), std::string::npos)
          << got.plan;
    }
    if (ep > 1) EXPECT_NE(got.plan.find("EP " + std::to_string(ep) + " ("), std::string::npos) << got.plan;
    if (dp > 1) EXPECT_NE(got.plan.find("dims [pp, dp_shard"), std::string::npos) << got.plan;  // FSDP in each stage
    test::expect_moe_steps_equal(ref, got, 2, /*compare_mean=*/true);  // every token counted once, per stage
    ASSERT_EQ(got.aux_losses.size(), aux_coeff > 0 ? got.losses.size() : 0u);
    ASSERT_EQ(ref.aux_losses.size(), got.aux_losses.size());
    for (size_t i = 0; i < ref.aux_losses.size(); ++i) {
      EXPECT_GT(ref.aux_losses[i], 0) << "step " << i + 1;
      EXPECT_NEAR(got.aux_losses[i], ref.aux_losses[i], 1e-5 * ref.aux_losses[i]) << "balance loss, step " << i + 1;
    }
  }
}

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// The weights of a libfsdp model-only save, put into the library's DeepSeek-V3 by name (every parameter and
// buffer of the model found in the save).
fsdp::models::deepseek_v3::DeepSeekV3 library_model_from(const std::string& checkpoint_dir) {
  const auto tensors = test::model_tensors(checkpoint_dir);
  auto args = fsdp::models::deepseek_v3::deepseek_v3_flavor("cpu_tiny");
  args.vocab_size = tensors.at("tok_embeddings.weight").size(0);  // the tokenizer's (byte-level: 258)
  args.max_seq_len = 16;
  args.moe.sequence_aux_loss_coeff.reset();
  fsdp::models::deepseek_v3::DeepSeekV3 model(args);
  torch::NoGradGuard no_grad;
  int64_t copied = 0;
  for (auto& p : model->named_parameters()) {
    const auto it = tensors.find(p.key());
    EXPECT_NE(it, tensors.end()) << p.key() << " not in " << checkpoint_dir;
    if (it == tensors.end()) continue;
    p.value().copy_(it->second);
    ++copied;
  }
  for (auto& b : model->named_buffers()) {
    const auto it = tensors.find(b.key());
    if (it == tensors.end()) continue;
    b.value().copy_(it->second);
    ++copied;
  }
  EXPECT_GT(copied, static_cast<int64_t>(model->parameters().size())) << "the expert_bias buffers too";
  return model;
}

}  // namespace

TEST(TrainerDeepSeekV3, FullyShardEqualsOneRank) {
  if (fsdp::world()->size() < 2) GTEST_SKIP() << "needs 2 ranks";
  expect_parity("fsdp", 1);
}

TEST(TrainerDeepSeekV3, ExpertParallelEqualsOneRank) {
  if (fsdp::world()->size() != 2) GTEST_SKIP() << "ep 2 on 2 ranks";
  expect_parity("ep2", 2);
}

TEST(TrainerDeepSeekV3, ExpertParallelWithFullActivationCheckpointingEqualsOneRank) {
  if (fsdp::world()->size() != 2) GTEST_SKIP() << "ep 2 on 2 ranks";
  expect_parity("ep2_ac", 2, /*full_ac=*/true);
}

// Op-level selective AC: both passes run with gradients, and the MoE layers still count each token once.
TEST(TrainerDeepSeekV3, ExpertParallelWithOpLevelSacEqualsOneRank) {
  if (fsdp::world()->size() != 2) GTEST_SKIP() << "ep 2 on 2 ranks";
  expect_parity("ep2_opsac", 2, false, 1, 1, /*op_sac=*/true);
}

TEST(TrainerDeepSeekV3, DataParallelReplicateEqualsOneRank) {
  if (fsdp::world()->size() < 2) GTEST_SKIP() << "needs 2 ranks";
  expect_parity("ddp", 1, false, /*replicate=*/fsdp::world()->size());
}

TEST(TrainerDeepSeekV3, ExpertParallelUnderHsdpEqualsOneRank) {
  if (fsdp::world()->size() != 4) GTEST_SKIP() << "HSDP 2 x 2 with ep 2 needs 4 ranks";
  expect_parity("hsdp_ep2", 2, false, /*replicate=*/2);
}

// Tensor parallelism (TorchTitan's MLA plan: wq_a / q_norm / wkv_a / kv_norm replicated with their gradients
// all-reduced over TP, wq_b / wkv_b colwise by heads, wo rowwise; the router replicated, the shared expert col/row):
// tp 2 on 2 ranks; tp 2 x dp_shard 2 with EP 2 borrowed from dp_shard x tp on 4.
TEST(TrainerDeepSeekV3, TensorParallelEqualsOneRank) {
  const int64_t n = fsdp::world()->size();
  if (n == 2) {
    expect_parity("tp2", 1, false, 1, /*tp=*/2);
    expect_parity("tp2_aux", 1, false, 1, /*tp=*/2, false, /*aux_coeff=*/1e-3);  // the sequence balance loss too
  } else if (n == 4) {
    expect_parity("tp2_ep2", 2, false, 1, /*tp=*/2);
  } else {
    GTEST_SKIP() << "tp 2 on 2 ranks, tp 2 x ep 2 on 4";
  }
}

// Pipeline parallelism: one stage per rank (1F1B) and two (Interleaved1F1B: embedding + layer 0 | layer 1 |
// layer 2 | norm + output, so the first stage holds the dense layer and the last none); on 4 ranks EP 2 inside each
// stage (over the stage's 2 data-parallel ranks) with the sequence balance loss.
TEST(TrainerDeepSeekV3, PipelineEqualsOneRank) {
  const int64_t n = fsdp::world()->size();
  if (n == 2) {
    expect_pipeline_parity("pp2", 2, 1, {"1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"});
  } else if (n == 4) {
    expect_pipeline_parity("pp2_ep2", 2, 2, {"1F1B"}, /*aux_coeff=*/1e-3);
  } else {
    GTEST_SKIP() << "pp 2 on 2 or 4 ranks";
  }
}

// PP and TP together (np4: pp 2 x tp 2): each stage applies the TP plan of its own modules (MLA split by heads,
// the low-rank projections replicated, the stage's hidden states split on the sequence), under 1F1B and
// Interleaved1F1B (two stages per rank); and with EP 2 borrowed from the stage's dp_shard x tp ranks and the
// sequence balance loss (each MoE block sums its per-sequence counts over TP), the expert loads summed over each
// stage's dp x tp ranks.
TEST(TrainerDeepSeekV3, PipelineWithTensorParallelEqualsOneRank) {
  if (fsdp::world()->size() != 4) GTEST_SKIP() << "pp 2 x tp 2 on 4 ranks";
  expect_pipeline_parity("pp2_tp2", 2, 1, {"1F1B", "Interleaved1F1B"}, 0, /*tp=*/2);
  expect_pipeline_parity("pp2_tp2_ep2", 2, 2, {"1F1B"}, /*aux_coeff=*/1e-3, /*tp=*/2);
}

namespace {


// Context parallelism: cp ranks (the rest of the world dp_shard; ep of them expert parallel) under `rotate` and
// `balancer` equal 1 rank on the same global batches: loss, grad norm and expert loads of every step (as
// expect_parity) and the parameters after the last step (model-only saves read back, 1e-5). MLA's q/k head dim
// (qk_nope + qk_rope = 24) differs from v's (16): the ring pads v. `corpus`: block_causal over these documents.
// `pp_schedule`: under pipeline parallelism of degree 2 with this schedule too (1-row microbatches).
void expect_cp_parity(const std::string& name, int64_t cp, int64_t ep, CpRotateMethod rotate, CpLoadBalancer balancer,
                      const std::string& corpus = "", int64_t tp = 1, double aux_coeff = 0,
                      const std::string& pp_schedule = "") {
  const int64_t world = fsdp::world()->size(), steps = 6, pp = pp_schedule.empty() ? 1 : 2;
  auto job = [&](const std::string& folder) {
    JobConfig c = base(folder, world, steps);
    c.checkpoint.enable = true;
    c.checkpoint.interval = steps;
    c.checkpoint.keep_latest_k = 0;
    c.model.moe_sequence_aux_loss_coeff = aux_coeff;
    if (!corpus.empty()) {
      c.training.dataset = Dataset::Jsonl;
      c.training.dataset_path = corpus;
      c.model.attn_mask_type = AttnMaskType::BlockCausal;
    }
    return c;
  };
  const std::string ref_dir = own_dir(name + "_ref");
  const TrainSummary ref = run_training(job(ref_dir), single_process(), false);
  const auto ref_params = test::model_tensors(ref_dir + "/checkpoint/step-" + std::to_string(steps));
  JobConfig config = job(test::shared_dir("fsdp_train_dsv3", name));
  config.parallelism.context_parallel_degree = cp;
  config.parallelism.expert_parallel_degree = ep;
  config.parallelism.tensor_parallel_degree = tp;
  config.parallelism.context_parallel_rotate_method = rotate;
  config.parallelism.context_parallel_load_balancer = balancer;
  if (pp > 1) {
    config.parallelism.pipeline_parallel_degree = pp;
    config.parallelism.pipeline_parallel_schedule = parse_choice<PipelineSchedule>(pp_schedule).value();
    config.parallelism.pipeline_parallel_microbatch_size = 1;
    // The global batch (world rows) over the world / (pp cp tp) data-parallel ranks in one pipeline step each.
    config.training.local_batch_size = world / (world / (pp * cp * tp));
  }
  const TrainSummary got = run_training(config, test::world_env(), false);
  fsdp::world()->barrier().wait();  // the last save is complete on every rank
  const std::string cp_plan = "CP " + std::to_string(cp) + " (ring attention, " + to_string(rotate) + ", " +
                              to_string(balancer) + "; 8 of 16 tokens per rank; FSDP over dp_shard x cp = " +
                              std::to_string(world / tp / pp) + " ranks)";
  EXPECT_NE(got.plan.find(cp_plan), std::string::npos) << got.plan;
  if (pp > 1) EXPECT_NE(got.plan.find("PP " + std::to_string(pp) + " (" + pp_schedule), std::string::npos) << got.plan;
  if (tp > 1) EXPECT_NE(got.plan.find("TP " + std::to_string(tp) + " (sequence parallel, MLA heads split"), std::string::npos) << got.plan;
  if (aux_coeff > 0) {
    ASSERT_EQ(got.aux_losses.size(), ref.aux_losses.size());
    for (size_t i = 0; i < ref.aux_losses.size(); ++i) {
      EXPECT_GT(ref.aux_losses[i], 0) << "step " << i + 1;
      EXPECT_NEAR(got.aux_losses[i], ref.aux_losses[i], 1e-5 * ref.aux_losses[i]) << "balance loss, step " << i + 1;
    }
  }
  if (ep > 1) EXPECT_NE(got.plan.find("EP " + std::to_string(ep) + " ("), std::string::npos) << got.plan;
  ASSERT_EQ(ref.losses.size(), static_cast<size_t>(steps));
  test::expect_moe_steps_equal(ref, got, 2, /*compare_mean=*/true);
  EXPECT_LT(ref.losses.back(), ref.losses.front());
  EXPECT_GT(ref.expert_loads.back().bias_l1, 0.0);
  const auto got_params = test::model_tensors(config.job.dump_folder + "/checkpoint/step-" + std::to_string(steps));
  ASSERT_FALSE(ref_params.empty());
  ASSERT_EQ(got_params.size(), ref_params.size());
  for (const auto& [key, want] : ref_params) {
    ASSERT_TRUE(got_params.count(key)) << key;
    const at::Tensor& have = got_params.at(key);
    ASSERT_EQ(have.sizes(), want.sizes()) << key;
    EXPECT_TRUE(torch::allclose(have, want, 1e-5, 1e-5)) << key << ": max difference "
                                                         << (have - want).abs().max().item<double>();
  }
}

}  // namespace

// cp 2 on 2 ranks, the ring (alltoall) with head-tail chunks and all-gather with contiguous ones; block_causal
// under cp 2 (the masked ring) over short documents, whose 1-rank run differs from the causal one.
TEST(TrainerDeepSeekV3, ContextParallelEqualsOneRank) {
  if (fsdp::world()->size() != 2) GTEST_SKIP() << "cp 2 on 2 ranks";
  expect_cp_parity("cp2_ring", 2, 1, CpRotateMethod::AllToAll, CpLoadBalancer::HeadTail);
  expect_cp_parity("cp2_allgather", 2, 1, CpRotateMethod::AllGather, CpLoadBalancer::None);
  // 200 documents of 3-9 characters: several per packed row of 16 tokens, crossing the cp chunks' boundaries.
  const std::string corpus = test::short_documents_corpus("fsdp_train_dsv3", 200, 3, 7, 29);
  expect_cp_parity("cp2_block_causal", 2, 1, CpRotateMethod::AllToAll, CpLoadBalancer::HeadTail, corpus);
  // Not vacuous: the documents mattered (block_causal on 1 rank trains otherwise than causal on the same rows).
  JobConfig causal = base(own_dir("docs_causal"), 2, 2), masked = base(own_dir("docs_masked"), 2, 2);
  for (JobConfig* c : {&causal, &masked}) {
    c->training.dataset = Dataset::Jsonl;
    c->training.dataset_path = corpus;
  }
  masked.model.attn_mask_type = AttnMaskType::BlockCausal;
  const TrainSummary a = run_training(causal, single_process(), false), b = run_training(masked, single_process(), false);
  EXPECT_GT(std::abs(a.losses[0] - b.losses[0]), 1e-4 * a.losses[0]);
}

// cp 2 x ep 2 on 4 ranks (dp_shard 2; EP borrowed from dp_shard x cp), both rotate methods.
TEST(TrainerDeepSeekV3, ContextParallelWithExpertParallelEqualsOneRank) {
  if (fsdp::world()->size() != 4) GTEST_SKIP() << "cp 2 x ep 2 on 4 ranks";
  expect_cp_parity("cp2_ep2_ring", 2, 2, CpRotateMethod::AllToAll, CpLoadBalancer::HeadTail);
  expect_cp_parity("cp2_ep2_allgather", 2, 2, CpRotateMethod::AllGather, CpLoadBalancer::None);
}

// cp 2 x tp 2 on 4 ranks: MLA's heads split over tp, each rank's heads through the ring over cp; with the sequence
// balance loss, whose per-sequence counts each MoE block sums over the flattened cp x tp group.
TEST(TrainerDeepSeekV3, ContextParallelWithTensorParallelEqualsOneRank) {
  if (fsdp::world()->size() != 4) GTEST_SKIP() << "cp 2 x tp 2 on 4 ranks";
  expect_cp_parity("cp2_tp2_ring", 2, 1, CpRotateMethod::AllToAll, CpLoadBalancer::HeadTail, "", 2, 1e-3);
  expect_cp_parity("cp2_tp2_allgather", 2, 1, CpRotateMethod::AllGather, CpLoadBalancer::None, "", 2);
}

TEST(TrainerDeepSeekV3, HuggingFaceSaveLoadsInTransformersAndBack) {
  if (fsdp::world()->size() != 1) GTEST_SKIP() << "Hugging Face load/save of deepseek_v3 runs on 1 rank";
  if (std::system((kPython + " -c 'import transformers' > /dev/null 2>&1").c_str()) != 0)
    GTEST_SKIP() << "no transformers in the venv";
  const auto saving = [](const std::string& name, bool hf) {
    JobConfig c = base(own_dir(name), 2, 4);
    c.checkpoint.enable = true;
    c.checkpoint.interval = 4;
    c.checkpoint.last_save_in_hf = hf;
    return run_training(c, single_process(), false);
  };
  const TrainSummary ours = saving("save_ours", false);
  const TrainSummary exported = saving("save_hf", true);
  ASSERT_EQ(exported.losses, ours.losses) << "the two runs are the same run";
  const std::string libfsdp_save = ours.dump_folder + "/checkpoint/step-4";
  const std::string hf_save = exported.dump_folder + "/checkpoint/step-4";
  ASSERT_TRUE(fs::exists(hf_save + "/config.json")) << hf_save;
  ASSERT_TRUE(fs::exists(hf_save + "/model.safetensors") || fs::exists(hf_save + "/model.safetensors.index.json"));
  EXPECT_NE(slurp(hf_save + "/config.json").find("\"deepseek_v3\""), std::string::npos);

  // Our logits: the library model with the libfsdp save's tensors. Theirs: transformers on the export.
  auto model = library_model_from(libfsdp_save);
  const auto tokens = torch::randint(0, model->args().vocab_size, {2, 12}, torch::TensorOptions().dtype(torch::kLong));
  torch::Tensor logits;
  {
    torch::NoGradGuard no_grad;
    model->eval();
    logits = model->forward(tokens);
  }
  const std::string io = own_dir("logits");
  fs::create_directories(io);
  fsdp::checkpoint::safetensors::save_file(io + "/tokens.safetensors", {{"tokens", tokens}});
  const std::string cmd = "OMP_NUM_THREADS=1 " + kPython + " " + kHfSide + " logits --dir " + hf_save + " --tokens " +
                          io + "/tokens.safetensors --out " + io + "/hf_logits.safetensors > " + io + "/hf.log 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd << "\n" << slurp(io + "/hf.log");
  EXPECT_NE(slurp(io + "/hf.log").find("DeepseekV3ForCausalLM"), std::string::npos) << slurp(io + "/hf.log");
  const auto hf_logits = fsdp::checkpoint::safetensors::load_file(io + "/hf_logits.safetensors").at("logits");
  ASSERT_EQ(hf_logits.sizes(), logits.sizes());
  const double diff = (hf_logits - logits).abs().max().item<double>();
  EXPECT_LE(diff, 1e-5) << "max |transformers - ours| on the trained weights";
  // Not vacuous: the trained weights are not a fresh init's (their logits differ by far more than the tolerance).
  {
    fsdp::models::deepseek_v3::DeepSeekV3 fresh(model->args());
    fresh->init_weights(0);
    torch::NoGradGuard no_grad;
    EXPECT_GT((fresh->forward(tokens) - logits).abs().max().item<double>(), 1e-2);
  }

  // The other way: a job started from the export equals one started from the libfsdp save, bit for bit, and
  // both start below a fresh run (the trained weights were loaded).
  const auto start_from = [](const std::string& name, const std::string& from, bool hf) {
    JobConfig c = base(own_dir(name), 2, 3);
    c.checkpoint.enable = true;
    c.checkpoint.initial_load_path = from;
    c.checkpoint.initial_load_model_only = true;
    c.checkpoint.initial_load_in_hf = hf;
    return run_training(c, single_process(), false);
  };
  const TrainSummary from_hf = start_from("from_hf", hf_save, true);
  const TrainSummary from_ours = start_from("from_ours", libfsdp_save, false);
  ASSERT_EQ(from_hf.losses.size(), 3u);
  EXPECT_EQ(from_hf.losses, from_ours.losses);
  EXPECT_LT(from_hf.losses.front(), ours.losses.front());
}

// A CSV schedule (parallelism.pipeline_parallel_schedule_csv, the format of torch's _dump_csv) on 2 ranks: a
// V-shaped GPipe no schedule name gives. Rank 0 holds stages 0 and 3 (embedding + the dense layer 0 | norm +
// output: no MoE layer), rank 1 stages 1 and 2 (both MoE layers); 4 microbatches of 1 sample per step.
TEST(TrainerDeepSeekV3, PipelineFromACsvScheduleEqualsOneRank) {
  if (fsdp::world()->size() != 2) GTEST_SKIP() << "pp 2 on 2 ranks";
  const std::string dir = test::shared_dir("fsdp_train_dsv3", "csv_file");
  fs::create_directories(dir);
  const std::string v_gpipe = test::write_shared_file(
      dir + "/v_gpipe.csv",
      "0F0,0F1,0F2,0F3,3F0,3F1,3F2,3F3,3B0,3B1,3B2,3B3,0B0,0B1,0B2,0B3\n"
      "1F0,2F0,1F1,2F1,1F2,2F2,1F3,2F3,2B0,1B0,2B1,1B1,2B2,1B2,2B3,1B3\n");
  expect_pipeline_parity("pp2", 2, 1, {"csv:" + v_gpipe});
}

// The acceptance's largest layout (8 ranks, its own registration trainer_deepseek_v3_pp_dp_tp_ep_test): pp 2 x
// dp_shard 2 x tp 2, EP 2 borrowed from each stage's dp_shard x tp ranks (the experts' FSDP over the 2 left), with
// the sequence balance loss (each MoE block sums its per-sequence counts over TP); 8 microbatches per step, the
// expert loads summed over each stage's 4 ranks.
TEST(TrainerDeepSeekV3, PipelineDataTensorExpertParallelOnEightRanksEqualsOneRank) {
  if (fsdp::world()->size() != 8) GTEST_SKIP() << "pp 2 x dp_shard 2 x tp 2 on 8 ranks";
  expect_pipeline_parity("pp2_dp2_tp2_ep2", 2, 2, {"1F1B"}, /*aux_coeff=*/1e-3, /*tp=*/2);
}

// CP inside pipeline stages (np4: pp 2 x cp 2): each stage's MLA runs the ring over the stage's cp ranks at MLA's
// softmax scale, RoPE at the chunks' global positions (DeepSeekV3Stage::rope_positions), block_causal by the
// masked ring (DeepSeekV3Stage::document_mask); FSDP over the stage's dp_shard x cp. Under 1F1B (one stage per
// rank) and Interleaved1F1B (two), both rotate methods; loss, grad norm, expert loads and the final parameters
// equal 1 rank. Checked by hand once: with the stages' rope_positions left unset (RoPE at 0 .. 7 on every cp rank)
// every case fails: the final parameters in all four (up to 1e-2 apart), the loss from step 5 on under head-tail
// chunks (contiguous chunks leave cp rank 0 its true positions 0 .. 7, and only the parameters tell).
TEST(TrainerDeepSeekV3, ContextParallelInsidePipelineStagesEqualsOneRank) {
  if (fsdp::world()->size() != 4) GTEST_SKIP() << "pp 2 x cp 2 on 4 ranks";
  expect_cp_parity("pp2_cp2_1f1b_ring", 2, 1, CpRotateMethod::AllToAll, CpLoadBalancer::HeadTail, "", 1, 0, "1F1B");
  expect_cp_parity("pp2_cp2_interleaved_allgather", 2, 1, CpRotateMethod::AllGather, CpLoadBalancer::None, "", 1, 0,
                   "Interleaved1F1B");
  const std::string corpus = test::short_documents_corpus("fsdp_train_dsv3", 200, 3, 7, 29);
  expect_cp_parity("pp2_cp2_block_causal", 2, 1, CpRotateMethod::AllToAll, CpLoadBalancer::HeadTail, corpus, 1, 0,
                   "Interleaved1F1B");
  // The sequence balance loss: each stage's MoE blocks sum their per-sequence counts over the stage's cp ranks.
  expect_cp_parity("pp2_cp2_aux", 2, 1, CpRotateMethod::AllGather, CpLoadBalancer::HeadTail, "", 1, 1e-3, "1F1B");
}
