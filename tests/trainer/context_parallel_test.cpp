// Context parallelism through the trainer (parallelism.context_parallel_degree, run under fsdprun): each sequence
// split over the cp ranks, attention by the library's ring attention, FSDP over dp_shard x cp. The reference is the
// 1-rank trainer (no process group, plain SDPA over whole sequences) on the same global batches with gradient
// accumulation: the loss and grad norm of every step and the parameters after the last step (read back from the
// last checkpoint of each run) agree to 1e-5 (relative; parameters 1e-5 absolute + relative).
//  - np2: cp 2 with the ring (alltoall) and head-tail chunks; cp 2 with allgather and contiguous chunks.
//  - np4: cp 4 (allgather, head-tail) with full activation checkpointing; cp 2 x dp_shard 2 (alltoall, none);
//    cp 2 x tp 2 (alltoall, head-tail); pp 2 x cp 2 (alltoall + head-tail, allgather + none).
// Not vacuous: the plan names CP and the per-rank sequence, the loss falls, the parameters moved from their
// initial values, and the validation loss over held-out samples (each cp rank its chunks) agrees too.
// A sequence length that does not divide is refused naming the rule (also tests/trainer/user_errors_test.cpp),
// and so are the layouts not composed yet.
// block_causal with cp 2 (both layouts; np2; np4: under pp 2), cp 4 with full AC and cp 2 x tp 2 (np4) equals the
// 1-rank block_causal run, and the profiled step's trace shows the masked ring ran (under alltoall its K/V ring
// steps, no K/V all-gather).
#include "config.h"
#include "models/llama3/parallelize_llama.h"
#include "train_env.h"
#include "trainer.h"

#include <fsdp/process_group.h>

#include "comm/dist_env.h"
#include "expect_error.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <utility>
#include <string>

using namespace fsdp_train;

namespace {

constexpr int64_t kSteps = 6;

JobConfig base(const std::string& name, bool per_rank_folder) {
  JobConfig c = load_config({"--model.flavor", "cpu_tiny", "--training.seq_len", "32", "--training.local_batch_size",
                             "2", "--training.global_batch_size", "8", "--training.steps", std::to_string(kSteps),
                             "--lr_scheduler.warmup_steps", "2", "--metrics.peak_tflops", "1"});
  // Validation at steps 1, 3 and 6 over the same 8 held-out samples whatever the layout.
  c.validation.enable = true;
  c.validation.freq = 3;
  c.validation.local_batch_size = 2;
  c.validation.seq_len = 32;
  // The last step's model, for the parameters (model only, fp32).
  c.checkpoint.enable = true;
  c.checkpoint.interval = kSteps;
  c.checkpoint.keep_latest_k = 0;
  c.job.dump_folder = ::testing::TempDir() + "/fsdp_train_cp_" + name;
  if (per_rank_folder) c.job.dump_folder += "_rank" + std::to_string(fsdp::world()->rank());
  if (per_rank_folder || fsdp::world()->rank() == 0) std::filesystem::remove_all(c.job.dump_folder);
  fsdp::world()->barrier().wait();
  return c;
}

struct TrainedRun {
  TrainSummary summary;
  std::map<std::string, at::Tensor> params;  // after the last step
};

TrainedRun train_and_read(const JobConfig& config, const TrainEnv& env) {
  TrainedRun r;
  r.summary = run_training(config, env, false);
  fsdp::world()->barrier().wait();  // the last save is complete on every rank
  r.params = test::model_tensors(config.job.dump_folder + "/checkpoint/step-" + std::to_string(kSteps));
  return r;
}

const TrainedRun& reference() {
  static const TrainedRun ref = [] {
    TrainEnv single;
    single.verbose = false;
    JobConfig c = base("ref", /*per_rank_folder=*/true);
    c.validation.steps = 4;  // 4 batches of 2 samples
    return train_and_read(c, single);
  }();
  return ref;
}

void expect_cp_parity(int64_t cp, int64_t shard, CpRotateMethod rotate, CpLoadBalancer balancer, bool full_ac = false,
                      int64_t tp = 1, int64_t pp = 1) {
  auto world = fsdp::world();
  if (pp * cp * shard * tp != world->size())
    GTEST_SKIP() << "needs pp x cp x dp_shard x tp = world size " << world->size();
  const std::string tag = "pp" + std::to_string(pp) + "_cp" + std::to_string(cp) + "_dp" + std::to_string(shard) +
                          "_tp" + std::to_string(tp) + "_" + to_string(rotate) + "_" + to_string(balancer) +
                          (full_ac ? "_ac" : "");
  SCOPED_TRACE(tag);
  const TrainedRun& ref = reference();
  JobConfig c = base(tag, /*per_rank_folder=*/false);
  c.parallelism.data_parallel_shard_degree = shard;
  c.parallelism.context_parallel_degree = cp;
  c.parallelism.tensor_parallel_degree = tp;
  c.parallelism.pipeline_parallel_degree = pp;  // 1F1B, 2 microbatches of 1 row per local batch
  c.parallelism.context_parallel_rotate_method = rotate;
  c.parallelism.context_parallel_load_balancer = balancer;
  c.validation.steps = 4 / shard;  // the same 8 held-out samples over the data-parallel ranks
  if (full_ac) c.activation_checkpoint.mode = AcMode::Full;
  const TrainedRun got = train_and_read(c, test::world_env());

  const std::string cp_plan = "CP " + std::to_string(cp) + " (ring attention, " + to_string(rotate) + ", " +
                              to_string(balancer) + "; " + std::to_string(32 / cp) + " of 32 tokens per rank";
  EXPECT_NE(got.summary.plan.find(cp_plan), std::string::npos) << got.summary.plan;
  // FSDP shards over the flattened dp_shard x cp ranks (TorchTitan's dp_shard_cp).
  EXPECT_NE(got.summary.plan.find("FSDP mesh DeviceMesh(cpu, shape [" + std::to_string(cp * shard) +
                                  "], dims [dp_shard_cp]"),
            std::string::npos)
      << got.summary.plan;
  if (pp > 1) EXPECT_NE(got.summary.plan.find("PP " + std::to_string(pp) + " ("), std::string::npos) << got.summary.plan;
  if (full_ac) EXPECT_GT(got.summary.ac_recomputes, 0);  // activation checkpointing recomputed the ring attention
  ASSERT_EQ(got.summary.losses.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(ref.summary.losses.size(), got.summary.losses.size());
  for (size_t i = 0; i < ref.summary.losses.size(); ++i) {
    EXPECT_NEAR(got.summary.losses[i], ref.summary.losses[i], 1e-5 * ref.summary.losses[i]) << "step " << i + 1;
    EXPECT_NEAR(got.summary.grad_norms[i], ref.summary.grad_norms[i], 1e-5 * ref.summary.grad_norms[i])
        << "step " << i + 1;
  }
  EXPECT_LT(ref.summary.losses.back(), ref.summary.losses.front() - 0.1);  // the reference trained
  ASSERT_EQ(ref.summary.validation_steps, (std::vector<int64_t>{1, 3, 6}));
  ASSERT_EQ(got.summary.validation_steps, ref.summary.validation_steps);
  for (size_t i = 0; i < ref.summary.validation_losses.size(); ++i) {
    EXPECT_NEAR(got.summary.validation_losses[i], ref.summary.validation_losses[i],
                1e-5 * ref.summary.validation_losses[i])
        << "validation " << i;
  }
  ASSERT_EQ(got.params.size(), ref.params.size());
  ASSERT_FALSE(ref.params.empty());
  for (const auto& [name, want] : ref.params) {
    ASSERT_TRUE(got.params.count(name)) << name;
    const at::Tensor& have = got.params.at(name);
    ASSERT_EQ(have.sizes(), want.sizes()) << name;
    EXPECT_TRUE(torch::allclose(have, want, 1e-5, 1e-5)) << name << ": max difference "
                                                         << (have - want).abs().max().item<double>();
  }
}

}  // namespace

TEST(TrainerContextParallel, Cp2MatchesOneRank) {
  if (fsdp::world()->size() != 2) GTEST_SKIP() << "2 ranks";
  expect_cp_parity(2, 1, CpRotateMethod::AllToAll, CpLoadBalancer::HeadTail);
  expect_cp_parity(2, 1, CpRotateMethod::AllGather, CpLoadBalancer::None);
}

TEST(TrainerContextParallel, Cp4AndCp2TimesDp2MatchOneRank) {
  if (fsdp::world()->size() != 4) GTEST_SKIP() << "4 ranks";
  expect_cp_parity(4, 1, CpRotateMethod::AllGather, CpLoadBalancer::HeadTail, /*full_ac=*/true);
  expect_cp_parity(2, 2, CpRotateMethod::AllToAll, CpLoadBalancer::None);
}

// TP 2 (sequence parallel, loss parallel) inside cp 2: ring attention over the local heads.
TEST(TrainerContextParallel, Cp2TimesTp2MatchesOneRank) {
  if (fsdp::world()->size() != 4) GTEST_SKIP() << "4 ranks";
  expect_cp_parity(2, 1, CpRotateMethod::AllToAll, CpLoadBalancer::HeadTail, /*full_ac=*/false, /*tp=*/2);
}

// PP 2 x CP 2: the stages see this rank's chunks of the rows (cut before the schedule splits them into
// microbatches), each stage's attention runs the ring over its cp ranks, and the last stage's loss adds up over
// cp. Both rotate methods, with and without head-tail load balancing.
TEST(TrainerContextParallel, Pp2TimesCp2MatchesOneRank) {
  if (fsdp::world()->size() != 4) GTEST_SKIP() << "4 ranks";
  expect_cp_parity(2, 1, CpRotateMethod::AllToAll, CpLoadBalancer::HeadTail, /*full_ac=*/false, /*tp=*/1, /*pp=*/2);
  expect_cp_parity(2, 1, CpRotateMethod::AllGather, CpLoadBalancer::None, /*full_ac=*/false, /*tp=*/1, /*pp=*/2);
}

namespace {

// MoE under CP (qwen3 cpu_tiny_moe: 2 layers of 8 experts, top-2): every rank routes the tokens of its chunks;
// with EP the experts are split over ranks borrowed from dp_shard x cp (TorchTitan), the tokens dispatched from
// each rank's chunks. The reference is the 1-rank trainer on the same global batches: loss, grad norm and every
// step's expert loads exactly (summed over dp x cp: each token counted once), and the load-balancing bias.
void expect_moe_cp_parity(int64_t cp, int64_t ep, CpRotateMethod rotate, CpLoadBalancer balancer, int64_t pp = 1,
                          double aux_coeff = 0, int64_t tp = 1) {
  auto world = fsdp::world();
  const std::string tag = "moe_pp" + std::to_string(pp) + "_cp" + std::to_string(cp) + "_tp" + std::to_string(tp) +
                          "_ep" + std::to_string(ep) + "_" + to_string(rotate) + "_" + to_string(balancer) +
                          (aux_coeff > 0 ? "_aux" : "");
  SCOPED_TRACE(tag);
  auto job = [&](const std::string& name, bool per_rank) {
    JobConfig c = base(name, per_rank);
    c.model.name = "qwen3";
    c.model.flavor = "cpu_tiny_moe";
    c.training.seq_len = 16;
    c.training.local_batch_size = pp > 1 ? 2 : 1;  // under PP 2 microbatches of 1 row (1F1B: one per stage)
    c.training.global_batch_size = 4;
    c.validation.enable = false;
    c.checkpoint.enable = false;
    c.model.moe_sequence_aux_loss_coeff = aux_coeff;
    return c;
  };
  TrainEnv single;
  single.verbose = false;
  const TrainSummary ref = run_training(job(tag + "_ref", true), single, false);
  if (aux_coeff > 0) {
    // The balance loss is on and changes the training (not vacuous): the 1-rank run without it differs.
    JobConfig off = job(tag + "_ref_no_aux", true);
    off.model.moe_sequence_aux_loss_coeff = 0;
    const TrainSummary without = run_training(off, single, false);
    EXPECT_GT(std::abs(ref.grad_norms[0] - without.grad_norms[0]), 1e-6 * without.grad_norms[0]);
  }
  JobConfig c = job(tag, false);
  c.parallelism.pipeline_parallel_degree = pp;
  c.parallelism.context_parallel_degree = cp;
  c.parallelism.tensor_parallel_degree = tp;
  c.parallelism.expert_parallel_degree = ep;
  c.parallelism.context_parallel_rotate_method = rotate;
  c.parallelism.context_parallel_load_balancer = balancer;
  c.parallelism.pipeline_parallel_microbatch_size = 1;
  const TrainSummary got = run_training(c, test::world_env(), false);
  EXPECT_NE(got.plan.find("CP " + std::to_string(cp) + " (ring attention"), std::string::npos) << got.plan;
  if (ep > 1) EXPECT_NE(got.plan.find("EP " + std::to_string(ep) + " ("), std::string::npos) << got.plan;
  if (pp > 1) EXPECT_NE(got.plan.find("PP " + std::to_string(pp) + " ("), std::string::npos) << got.plan;
  if (tp > 1) EXPECT_NE(got.plan.find("TP " + std::to_string(tp) + " ("), std::string::npos) << got.plan;
  test::expect_moe_steps_equal(ref, got, 2, /*compare_mean=*/true);
  // Under CP each rank's balance loss is its chunks' share of the whole sequences' (the blocks sum the counts over
  // cp, under cp x tp over the flattened cp x tp ranks); the shares add up to the 1-rank loss.
  ASSERT_EQ(got.aux_losses.size(), ref.aux_losses.size());
  if (aux_coeff > 0) EXPECT_EQ(ref.aux_losses.size(), ref.losses.size());
  for (size_t i = 0; i < ref.aux_losses.size(); ++i) {
    EXPECT_NEAR(got.aux_losses[i], ref.aux_losses[i], 1e-5 * std::abs(ref.aux_losses[i])) << "step " << i + 1;
  }
  EXPECT_LT(got.losses.back(), got.losses.front());
  EXPECT_GT(ref.expert_loads.back().bias_l1, 0.0) << "the load-balancing bias moved";
}

}  // namespace

TEST(TrainerContextParallel, MoeCp2AndCp2TimesEp2MatchOneRank) {
  if (fsdp::world()->size() != 2) GTEST_SKIP() << "2 ranks";
  expect_moe_cp_parity(2, 1, CpRotateMethod::AllToAll, CpLoadBalancer::HeadTail);
  expect_moe_cp_parity(2, 2, CpRotateMethod::AllGather, CpLoadBalancer::None);
  // The sequence balance loss under CP (head-tail chunks: each rank holds two distant pieces of every sequence).
  expect_moe_cp_parity(2, 2, CpRotateMethod::AllToAll, CpLoadBalancer::HeadTail, 1, /*aux_coeff=*/0.05);
}

// 4 ranks: cp 2 x dp_shard 2 with ep 2 (efsdp 2) and ep 4 (every rank holds 2 experts); pp 2 x cp 2 x ep 2 (each
// stage's expert loads summed over its dp_shard x cp ranks).
TEST(TrainerContextParallel, MoeCp2TimesDp2WithEpAndPipelineMatchOneRank) {
  if (fsdp::world()->size() != 4) GTEST_SKIP() << "4 ranks";
  expect_moe_cp_parity(2, 2, CpRotateMethod::AllToAll, CpLoadBalancer::HeadTail);
  expect_moe_cp_parity(2, 4, CpRotateMethod::AllGather, CpLoadBalancer::HeadTail);
  expect_moe_cp_parity(2, 2, CpRotateMethod::AllToAll, CpLoadBalancer::HeadTail, /*pp=*/2);
  // The sequence balance loss under pp 2 x cp 2 (each stage's blocks sum their counts over the stage's cp ranks).
  expect_moe_cp_parity(2, 1, CpRotateMethod::AllGather, CpLoadBalancer::HeadTail, /*pp=*/2, /*aux_coeff=*/0.05);
}

// The sequence balance loss under cp 2 x tp 2 (each rank holds a TP slice of a CP chunk of every sequence: the
// blocks sum their counts over the flattened cp x tp group), alone and with ep 2 (efsdp 2 of cp x tp = 4).
// Summing over cp alone or tp alone (the groups apply_cp and apply_tp set) gives other aux losses and gradients:
// with the cp_tp group replaced by the cp group, both cases fail (docs/context_parallel.md).
TEST(TrainerContextParallel, MoeSequenceAuxLossCp2TimesTp2MatchesOneRank) {
  if (fsdp::world()->size() != 4) GTEST_SKIP() << "4 ranks";
  expect_moe_cp_parity(2, 1, CpRotateMethod::AllToAll, CpLoadBalancer::HeadTail, /*pp=*/1, /*aux_coeff=*/0.05,
                       /*tp=*/2);
  expect_moe_cp_parity(2, 2, CpRotateMethod::AllGather, CpLoadBalancer::None, /*pp=*/1, /*aux_coeff=*/0.05,
                       /*tp=*/2);
}

namespace {

// A JSON Lines corpus of 300 short documents (4-14 characters), so that every packed row of 32 tokens holds
// several and documents cross the chunk boundaries; written by rank 0 into a folder every rank names the same.
std::string short_documents_corpus() { return test::short_documents_corpus("fsdp_train_cp", 300, 4, 11, 17); }

// The profiled step of a block_causal cp run (its Chrome trace, [profiling]) shows the masked ring: every layer's
// attention is block_causal_ring_attention, once per forward per gathered set of document ids (and again when
// activation checkpointing recomputes), K/V moved by the method asked (the ring's send/recv steps under alltoall,
// all-gathers under allgather), and the old all-gathered masked SDPA never ran.
void expect_block_causal_ring_ran(const std::string& trace_path, CpRotateMethod rotate, int64_t n_layers,
                                  bool recomputed) {
  std::ifstream in(trace_path);
  ASSERT_TRUE(in) << "missing " << trace_path;
  const auto trace = nlohmann::json::parse(in);
  std::map<std::string, int64_t> count;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.value("ph", "") == "X") ++count[e.value("name", "")];
  }
  const std::string cp = "fsdp::context_parallel::";
  const int64_t forwards = count[cp + "allgather_document_ids"];
  EXPECT_GE(forwards, 1);
  if (recomputed) {  // activation checkpointing runs each training forward's blocks again in backward
    EXPECT_GT(count[cp + "block_causal_ring_attention"], forwards * n_layers);
  } else {
    EXPECT_EQ(count[cp + "block_causal_ring_attention"], forwards * n_layers);
  }
  EXPECT_GE(count[cp + "block_causal_ring_attention_backward"], n_layers);
  EXPECT_EQ(count[cp + "masked_attention"], 0);
  if (rotate == CpRotateMethod::AllToAll) {
    EXPECT_GT(count[cp + "rotate_kv"], 0);
    EXPECT_GT(count[cp + "rotate_dkv"], 0);
    EXPECT_EQ(count[cp + "allgather_kv"], 0) << "the ring gathers no K/V";
  } else {
    EXPECT_GT(count[cp + "allgather_kv"], 0);
    EXPECT_EQ(count[cp + "rotate_kv"], 0);
  }
}

JobConfig block_causal_job(const std::string& corpus, const std::string& name, bool per_rank, const std::string& mask) {
  JobConfig c = base(name, per_rank);
  c.training.dataset = Dataset::Jsonl;
  c.training.dataset_path = corpus;
  c.validation.dataset = Dataset::Jsonl;
  c.validation.dataset_path = corpus;
  c.validation.steps = 4;
  c.model.attn_mask_type = parse_choice<AttnMaskType>(mask).value();
  return c;
}

// block_causal at cp x tp (the rest of the world: none) with the masked ring equals the 1-rank block_causal run
// `ref` (loss, grad norm, validation, parameters; 1e-5), and its profiled last step shows the ring ran.
void expect_block_causal_cp(const TrainedRun& ref, const std::string& corpus, int64_t cp, int64_t tp,
                            CpRotateMethod rotate, CpLoadBalancer balancer, bool full_ac = false, int64_t pp = 1) {
  const std::string tag = "block_causal_pp" + std::to_string(pp) + "_cp" + std::to_string(cp) + "_tp" +
                          std::to_string(tp) + "_" + to_string(rotate) + "_" + to_string(balancer) +
                          (full_ac ? "_ac" : "");
  SCOPED_TRACE(tag);
  JobConfig c = block_causal_job(corpus, tag, false, "block_causal");
  c.parallelism.pipeline_parallel_degree = pp;
  c.parallelism.context_parallel_degree = cp;
  c.parallelism.tensor_parallel_degree = tp;
  c.parallelism.context_parallel_rotate_method = rotate;
  c.parallelism.context_parallel_load_balancer = balancer;
  if (full_ac) c.activation_checkpoint.mode = AcMode::Full;
  // The last step's trace shows which attention ran.
  c.profiling.enable_profiling = true;
  c.profiling.profile_freq = kSteps;
  const TrainedRun got = train_and_read(c, test::world_env());
  EXPECT_NE(got.summary.plan.find("CP " + std::to_string(cp) + " (ring attention"), std::string::npos)
      << got.summary.plan;
  if (pp > 1) EXPECT_NE(got.summary.plan.find("PP " + std::to_string(pp) + " ("), std::string::npos) << got.summary.plan;
  if (full_ac) EXPECT_GT(got.summary.ac_recomputes, 0);
  // Under PP a rank holds its stage's layers (the split is even here) and builds the stage's mask per microbatch.
  expect_block_causal_ring_ran(c.job.dump_folder + "/profile_traces/iteration_" + std::to_string(kSteps) + "/rank" +
                                   std::to_string(fsdp::world()->rank()) + "_trace.json",
                               rotate, llama3::model_args(c).n_layers / pp, /*recomputed=*/full_ac);
  ASSERT_EQ(got.summary.losses.size(), ref.summary.losses.size());
  for (size_t i = 0; i < ref.summary.losses.size(); ++i) {
    EXPECT_NEAR(got.summary.losses[i], ref.summary.losses[i], 1e-5 * ref.summary.losses[i]) << "step " << i + 1;
    EXPECT_NEAR(got.summary.grad_norms[i], ref.summary.grad_norms[i], 1e-5 * ref.summary.grad_norms[i])
        << "step " << i + 1;
  }
  ASSERT_EQ(got.summary.validation_losses.size(), ref.summary.validation_losses.size());
  for (size_t i = 0; i < ref.summary.validation_losses.size(); ++i) {
    EXPECT_NEAR(got.summary.validation_losses[i], ref.summary.validation_losses[i],
                1e-5 * ref.summary.validation_losses[i])
        << "validation " << i;
  }
  for (const auto& [name, want] : ref.params) {
    ASSERT_TRUE(got.params.count(name)) << name;
    EXPECT_TRUE(torch::allclose(got.params.at(name), want, 1e-5, 1e-5)) << name;
  }
}

TrainedRun block_causal_reference(const std::string& corpus) {
  TrainEnv single;
  single.verbose = false;
  return train_and_read(block_causal_job(corpus, "block_causal_ref", true, "block_causal"), single);
}

}  // namespace

// model.attn_mask_type = "block_causal" under cp 2: the documents' masks follow the chunks (document ids of the
// whole rows, cut like the tokens) and equal the 1-rank block_causal run (whose equality with the documents run
// one by one is tests/trainer/block_causal_test.cpp's). Not vacuous: the 1-rank causal run on the same data
// differs.
// At 4 ranks the same under pp 2 x cp 2: each stage builds its mask from the microbatch's chunk document ids
// (LlamaStage::document_mask).
TEST(TrainerContextParallel, BlockCausalCp2MatchesOneRank) {
  const int64_t pp = fsdp::world()->size() / 2;
  if (pp != 1 && pp != 2) GTEST_SKIP() << "2 or 4 ranks";
  const std::string corpus = short_documents_corpus();
  TrainEnv single;
  single.verbose = false;
  const TrainedRun ref = block_causal_reference(corpus);
  const TrainedRun causal = train_and_read(block_causal_job(corpus, "causal_ref", true, "causal"), single);
  EXPECT_GT(std::abs(causal.summary.losses[1] - ref.summary.losses[1]), 1e-3) << "the document mask changed nothing";
  expect_block_causal_cp(ref, corpus, 2, 1, CpRotateMethod::AllToAll, CpLoadBalancer::HeadTail, false, pp);
  expect_block_causal_cp(ref, corpus, 2, 1, CpRotateMethod::AllGather, CpLoadBalancer::None, false, pp);
}

// The masked ring at cp 4 with full activation checkpointing (the blocks' recomputation runs it again), and
// inside cp 2 x tp 2 (on the local heads).
TEST(TrainerContextParallel, BlockCausalCp4AndCp2TimesTp2MatchOneRank) {
  if (fsdp::world()->size() != 4) GTEST_SKIP() << "4 ranks";
  const std::string corpus = short_documents_corpus();
  const TrainedRun ref = block_causal_reference(corpus);
  expect_block_causal_cp(ref, corpus, 4, 1, CpRotateMethod::AllToAll, CpLoadBalancer::HeadTail, /*full_ac=*/true);
  expect_block_causal_cp(ref, corpus, 2, 2, CpRotateMethod::AllToAll, CpLoadBalancer::None);
}

TEST(TrainerContextParallel, BadLayoutsAreRefusedNamingTheRule) {
  const int64_t n = fsdp::world()->size();
  auto refused = [&](const std::vector<std::string>& args, const std::string& needle) {
    std::vector<std::string> all = {"--model.flavor", "cpu_tiny", "--training.seq_len", "32",
                                    "--parallelism.context_parallel_degree", std::to_string(n)};
    all.insert(all.end(), args.begin(), args.end());
    fsdp_test::expect_error_containing<ConfigError>(
        [&] {
          JobConfig c = load_config(all);
          c.job.dump_folder = ::testing::TempDir() + "/fsdp_train_cp_refused";
          run_training(c, test::world_env(), false);
        },
        needle);
  };
  const std::string cp = std::to_string(n);
  refused({"--training.seq_len", "30"}, "training.seq_len (30) must be divisible by 2 x "
                                        "parallelism.context_parallel_degree = " + std::to_string(2 * n));
  refused({"--training.seq_len", std::to_string(n * 3 + 1), "--parallelism.context_parallel_load_balancer", "none"},
          "training.seq_len (" + std::to_string(n * 3 + 1) +
              ") must be divisible by parallelism.context_parallel_degree = " + cp +
              " (context_parallel_load_balancer = \"none\" cuts each sequence into cp chunks)");
  refused({"--parallelism.context_parallel_degree", "3", "--training.seq_len", "48", "--validation.seq_len", "48"},
          "parallelism.context_parallel_degree (3) must divide the world size (" + cp + ")");
  refused({"--model.name", "qwen3", "--model.flavor", "cpu_tiny_moe", "--parallelism.expert_parallel_degree",
           std::to_string(2 * n)},
          "parallelism.expert_parallel_degree (" + std::to_string(2 * n) + ") must divide the data-parallel shard "
          "degree x context_parallel_degree (1 x " + cp + " = " + cp + "): expert parallelism borrows its ranks from "
          "FSDP's shard dim, the CP ranks");
}
