// fsdp-plan: sizes and bytes checked against independent hand computations (shapes written out here from the
// Llama 3 definition, not taken from the planner).
#include "plan.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

using namespace fsdp::plan;
namespace llama = fsdp::nn::llama;

namespace {
PlanConfig config(const std::string& flavor, int64_t shard, int64_t replicate = 1) {
  PlanConfig c;
  c.flavor = flavor;
  c.args = llama::llama3_flavor(flavor);
  c.shard = shard;
  c.replicate = replicate;
  c.local_batch = 2;
  c.seq_len = 64;
  return c;
}
}  // namespace

TEST(Plan, DebugmodelSizesByHand) {
  // debugmodel: dim 256, 6 layers, 16 heads (= kv heads), vocab 2048, ffn hidden 768.
  Plan p = make_plan(config("debugmodel", 1));
  const int64_t block = 4 * 256 * 256 + 3 * 256 * 768 + 2 * 256;
  const int64_t root = 2 * 2048 * 256 + 256;
  EXPECT_EQ(p.num_params, 6 * block + root);
  ASSERT_EQ(p.groups.size(), 7u);
  EXPECT_EQ(p.groups[0].numel, block);
  EXPECT_EQ(p.groups.back().numel, root);
  EXPECT_EQ(p.memory.params, (6 * block + root) * 4);
  EXPECT_EQ(p.memory.optimizer, 2 * (6 * block + root) * 4);
  EXPECT_EQ(p.comm.total_bytes, 0);  // one rank: nothing to send
}

TEST(Plan, UnevenShardPaddingAndBytes) {
  // cpu_tiny: dim 64, 4 heads / 2 kv heads (head_dim 16), vocab 2048, ffn hidden 192 (multiple_of 64).
  // Shard 3: every dim-0 is padded up to a multiple of 3.
  Plan p = make_plan(config("cpu_tiny", 3));
  auto pad = [](int64_t d0) { return (d0 + 2) / 3; };
  const int64_t block_shard = pad(64) * 64 + 2 * pad(32) * 64 + pad(64) * 64 + 2 * pad(192) * 64 + pad(64) * 192 +
                              2 * pad(64);
  EXPECT_EQ(p.groups[0].shard_numel, block_shard);
  const int64_t root_shard = 2 * pad(2048) * 64 + pad(64);
  EXPECT_EQ(p.groups.back().shard_numel, root_shard);
  // Bytes: forward + backward all-gather of blocks (16-byte aligned per parameter), forward only of the root,
  // reduce-scatter of every group: (S-1) x per-rank bytes each.
  auto a16 = [](int64_t b) { return (b + 15) / 16 * 16; };
  const int64_t block_ag = a16(pad(64) * 64 * 4) * 2 + a16(pad(32) * 64 * 4) * 2 + a16(pad(192) * 64 * 4) * 2 +
                           a16(pad(64) * 192 * 4) + a16(pad(64) * 4) * 2;
  const int64_t root_ag = a16(pad(2048) * 64 * 4) * 2 + a16(pad(64) * 4);
  EXPECT_EQ(p.comm.all_gather_bytes, 2 * (2 * 2 * block_ag + root_ag));
  EXPECT_EQ(p.comm.reduce_scatter_bytes, 2 * (2 * block_shard + root_shard) * 4);
  EXPECT_EQ(p.comm.all_gather_calls, 2 * 2 + 1);
  EXPECT_EQ(p.comm.reduce_scatter_calls, 3);
  EXPECT_LE(p.comm.optimum_bytes, p.comm.total_bytes);
}

TEST(Plan, ReshardPoliciesAndHsdp) {
  PlanConfig c = config("cpu_small", 4);
  Plan always = make_plan(c);
  c.block_reshard = 0;
  Plan never = make_plan(c);
  c.block_reshard = 2;
  Plan hpz = make_plan(c);
  // Never resharding drops the backward all-gathers of the blocks; hpZ-2 re-gathers half the bytes within pairs.
  const int64_t blocks_ag = 4 * 3 * always.groups[0].all_gather_bytes;  // (S-1) x per-rank, 4 blocks
  EXPECT_EQ(always.comm.all_gather_bytes - never.comm.all_gather_bytes, blocks_ag);
  EXPECT_EQ(hpz.comm.all_gather_bytes - never.comm.all_gather_bytes, 4 * 1 * 2 * always.groups[0].all_gather_bytes);
  // HSDP 2 x 4: all-reduce of every group's shard over 2 replicas, 2(R-1)/R of it.
  PlanConfig h = config("cpu_small", 4, 2);
  Plan hsdp = make_plan(h);
  int64_t shard_numel = 0;
  for (const auto& g : hsdp.groups) shard_numel += g.shard_numel;
  EXPECT_EQ(hsdp.comm.all_reduce_bytes, shard_numel * 4);
  EXPECT_EQ(hsdp.comm.all_reduce_calls, 5);
  EXPECT_THROW(make_plan([] { PlanConfig x = config("cpu_small", 4); x.block_reshard = 3; return x; }()), c10::Error);
}

TEST(Plan, ActivationCheckpointingOrdersMemory) {
  PlanConfig c = config("8B", 8);
  c.compute_dtype = c10::kBFloat16;
  c.local_batch = 2;
  c.seq_len = 8192;
  Plan none = make_plan(c);
  c.ac = ACMode::Selective;
  Plan sel = make_plan(c);
  c.ac = ACMode::Full;
  Plan full = make_plan(c);
  EXPECT_GT(none.memory.total, sel.memory.total);
  EXPECT_GT(sel.memory.total, full.memory.total);
  // Full AC keeps only each block's bf16 input: 2 x 8192 x 4096 x 2 bytes = 128 MiB per block.
  EXPECT_EQ(full.memory.act_per_layer_checkpointed, int64_t{2} * 8192 * 4096 * 2);
  // 70B and 405B plan without allocating anything.
  PlanConfig big = config("405B", 64);
  EXPECT_GT(make_plan(big).num_params, int64_t{400} * 1000 * 1000 * 1000);
}

// ---- pipeline parallelism (docs/planner.md, "Pipeline parallelism") ----

namespace {
// gtest only (no gmock in the build): "text contains part", printing the text when it does not.
::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected to contain \"" << part << "\", got:\n" << text;
}

std::string error_of(const PlanConfig& c) {
  try {
    make_plan(c);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

PlanConfig pp_config(const std::string& flavor, int64_t pp, const std::string& schedule, int64_t microbatches,
                     int64_t shard = 1) {
  PlanConfig c = config(flavor, shard);
  c.pp = pp;
  c.schedule = schedule;
  c.microbatches = microbatches;
  c.local_batch = microbatches;  // microbatches of one sample
  return c;
}
}  // namespace

TEST(PlanPipeline, TorchTitanSplitOfLlama8B) {
  // TorchTitan's generate_llm_fqn_per_model_part for 32 layers, embedding and norm+output weighted 1 each:
  // 34 effective layers; 4 stages: 34 / 4 = 8, the first 34 % 4 = 2 stages one more (9, 9, 8, 8), minus the
  // embedding on the first and norm+output on the last: 8 | 9 | 8 | 7. 8 stages: 4 r 2 -> 5 5 4 4 4 4 4 4 ->
  // 4 5 4 4 4 4 4 3 (the reference note measured both on TorchTitan).
  EXPECT_EQ(split_layers(4, 32), (std::vector<int64_t>{8, 9, 8, 7}));
  EXPECT_EQ(split_layers(8, 32), (std::vector<int64_t>{4, 5, 4, 4, 4, 4, 4, 3}));
  EXPECT_EQ(split_layers(4, 32, 0, 0), (std::vector<int64_t>{8, 8, 8, 8}));
  EXPECT_EQ(split_layers(1, 32), (std::vector<int64_t>{32}));

  Plan p = make_plan(pp_config("8B", 4, "1F1B", 8));
  ASSERT_TRUE(p.pipeline.enabled);
  ASSERT_EQ(p.pipeline.stages.size(), 4u);
  const std::vector<int64_t> expect_layers = {8, 9, 8, 7}, expect_first = {0, 8, 17, 25};
  for (int s = 0; s < 4; ++s) {
    const StagePlan& st = p.pipeline.stages[s];
    EXPECT_EQ(st.num_layers, expect_layers[s]) << "stage " << s;
    EXPECT_EQ(st.first_layer, expect_first[s]) << "stage " << s;
    EXPECT_EQ(st.rank, s);  // 1F1B: one stage per rank, stage s on rank s
  }
  // FQNs keep the original layer numbers (TorchTitan's ModuleDict keys).
  EXPECT_EQ(p.pipeline.stages[0].fqns.front(), "tok_embeddings");
  EXPECT_EQ(p.pipeline.stages[0].fqns[1], "layers.0");
  EXPECT_EQ(p.pipeline.stages[1].fqns.front(), "layers.8");
  EXPECT_EQ(p.pipeline.stages[3].fqns[p.pipeline.stages[3].fqns.size() - 3], "layers.31");
  EXPECT_EQ(p.pipeline.stages[3].fqns.back(), "output");
  EXPECT_TRUE(Contains(format_plan(p), "stage 0 on pp rank 0: tok_embeddings, layers.0-7 (8 layers"));
  EXPECT_TRUE(Contains(format_plan(p), "stage 3 on pp rank 3: layers.25-31, norm, output (7 layers"));

  // Interleaved1F1B defaults to 2 stages per rank: 8 stages, looped over the ranks (stage s on rank s % 4).
  Plan inter = make_plan(pp_config("8B", 4, "Interleaved1F1B", 8));
  ASSERT_EQ(inter.pipeline.stages.size(), 8u);
  const std::vector<int64_t> eight = {4, 5, 4, 4, 4, 4, 4, 3};
  for (int s = 0; s < 8; ++s) {
    EXPECT_EQ(inter.pipeline.stages[s].num_layers, eight[s]) << "stage " << s;
    EXPECT_EQ(inter.pipeline.stages[s].rank, s % 4) << "stage " << s;
  }
  // ZBVZeroBubble: the V, stages (r, 2p-1-r) on rank r.
  Plan zbv = make_plan(pp_config("8B", 2, "ZBVZeroBubble", 4));
  ASSERT_EQ(zbv.pipeline.stages.size(), 4u);
  EXPECT_EQ(zbv.pipeline.stages[0].rank, 0);
  EXPECT_EQ(zbv.pipeline.stages[1].rank, 1);
  EXPECT_EQ(zbv.pipeline.stages[2].rank, 1);
  EXPECT_EQ(zbv.pipeline.stages[3].rank, 0);
  // TorchTitan's layers_per_stage: ceil(34 / 5) = 7 stages is not a multiple of 2 (error below); ceil(34 / 9) = 4
  // stages over pp 2 = 2 per rank for a multi-stage schedule.
  PlanConfig lps = pp_config("8B", 2, "Interleaved1F1B", 4);
  lps.layers_per_stage = 9;
  Plan by_lps = make_plan(lps);
  EXPECT_EQ(by_lps.pipeline.num_stages, 4);
  EXPECT_EQ(by_lps.pipeline.stages_per_rank, 2);

  // The stages hold the whole model exactly once (debugmodel, by hand as in DebugmodelSizesByHand).
  Plan dbg = make_plan(pp_config("debugmodel", 2, "GPipe", 2));
  const int64_t block = 4 * 256 * 256 + 3 * 256 * 768 + 2 * 256;
  int64_t numel = 0;
  for (const auto& st : dbg.pipeline.stages) numel += st.numel;
  EXPECT_EQ(numel, 6 * block + 2 * 2048 * 256 + 256);
}

TEST(PlanPipeline, PeakMicrobatchesInFlight) {
  // The reference note's table (torch 2.13's orders, p = 4, m = 8): 1F1B p - s = 4, 3, 2, 1; GPipe m = 8;
  // LoopedBFS v m = 16; Interleaved1F1B (v = 2) 11, 9, 7, 5.
  auto peaks = [](const std::string& schedule) {
    Plan p = make_plan(pp_config("8B", 4, schedule, 8));
    std::vector<int64_t> out;
    for (const auto& r : p.pipeline.ranks) out.push_back(r.peak_microbatches_in_flight);
    return out;
  };
  EXPECT_EQ(peaks("1F1B"), (std::vector<int64_t>{4, 3, 2, 1}));
  EXPECT_EQ(peaks("GPipe"), (std::vector<int64_t>{8, 8, 8, 8}));
  EXPECT_EQ(peaks("LoopedBFS"), (std::vector<int64_t>{16, 16, 16, 16}));
  EXPECT_EQ(peaks("Interleaved1F1B"), (std::vector<int64_t>{11, 9, 7, 5}));
}

TEST(PlanPipeline, BubbleFraction) {
  // Equal stages (no less-layers weights: 8 layers each) with F = 1, B = 2 per layer: 1F1B and GPipe leave
  // (p - 1) / (m + p - 1) = 3 / 11 idle at p = 4, m = 8; Interleaved1F1B (v = 2) (p - 1) / (v m + p - 1) = 3 / 19.
  for (const char* schedule : {"1F1B", "GPipe"}) {
    PlanConfig c = pp_config("8B", 4, schedule, 8);
    c.first_stage_less_layers = 0;
    c.last_stage_less_layers = 0;
    Plan p = make_plan(c);
    EXPECT_NEAR(p.pipeline.bubble_fraction, 3.0 / 11.0, 1e-9) << schedule;
    EXPECT_NEAR(p.pipeline.bubble_closed_form, 3.0 / 11.0, 1e-12) << schedule;
  }
  PlanConfig c = pp_config("8B", 4, "Interleaved1F1B", 8);
  c.first_stage_less_layers = 0;
  c.last_stage_less_layers = 0;
  EXPECT_NEAR(make_plan(c).pipeline.bubble_fraction, 3.0 / 19.0, 1e-9);
  // TorchTitan's default weights give unequal stage costs (9, 9, 8, 8 effective layers): the simulation uses
  // them, so the bubble moves off the closed form.
  Plan uneven = make_plan(pp_config("8B", 4, "1F1B", 8));
  EXPECT_GT(std::abs(uneven.pipeline.bubble_fraction - 3.0 / 11.0), 1e-6);
}

TEST(PlanPipeline, PointToPointBytes) {
  // One boundary tensor: [microbatch 1 x seq 64, dim 4096] fp32 = 1 MiB. 1F1B over 4 ranks, 8 microbatches:
  // rank 0 sends 8 activations, ranks 1 and 2 8 activations and 8 gradients, rank 3 8 gradients.
  const int64_t boundary = 1 * 64 * 4096 * 4;
  Plan p = make_plan(pp_config("8B", 4, "1F1B", 8));
  EXPECT_EQ(p.pipeline.boundary_bytes, boundary);
  const std::vector<int64_t> sends = {8, 16, 16, 8};
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(p.pipeline.ranks[r].pp_send_calls, sends[r]) << "rank " << r;
    EXPECT_EQ(p.pipeline.ranks[r].pp_send_bytes, sends[r] * boundary) << "rank " << r;
  }
  EXPECT_EQ(p.comm.pp_send_bytes, sends[p.pipeline.planned_rank] * boundary);
  // Interleaved1F1B, v = 2: rank r holds stages r and r + 4; every neighbour is on another rank. Rank 0: stage 0
  // sends activations, stage 4 activations and gradients (3 m); ranks 1, 2: 4 m; rank 3: stage 3 both, stage 7
  // gradients (3 m).
  Plan inter = make_plan(pp_config("8B", 4, "Interleaved1F1B", 8));
  const std::vector<int64_t> inter_sends = {24, 32, 32, 24};
  for (int r = 0; r < 4; ++r) EXPECT_EQ(inter.pipeline.ranks[r].pp_send_bytes, inter_sends[r] * boundary) << r;
  // ZBV over 2 ranks: stages 1 and 2 share rank 1 (no transfer): rank 0 sends stage 0's activations and stage 3's
  // gradients, rank 1 stage 2's activations and stage 1's gradients: 2 m each.
  Plan zbv = make_plan(pp_config("8B", 2, "ZBVZeroBubble", 4));
  for (int r = 0; r < 2; ++r) EXPECT_EQ(zbv.pipeline.ranks[r].pp_send_bytes, 2 * 4 * boundary) << r;
  // Under TP (sequence parallel) each rank sends its 1/tp of the sequence; bf16 halves it again.
  PlanConfig tp = pp_config("8B", 4, "1F1B", 8);
  tp.tp = 2;
  tp.compute_dtype = c10::kBFloat16;
  EXPECT_EQ(make_plan(tp).pipeline.boundary_bytes, 64 / 2 * 4096 * 2);
}

TEST(PlanPipeline, DataParallelBytesOfTheRanksStages) {
  // FSDP 2 under PP: each group of the rank's stages is all-gathered once (UNSHARD) and reduce-scattered once
  // (REDUCE_GRAD) per step, whatever the microbatches. 8B shard 2 (every dim-0 even: no padding; 16-byte aligned).
  Plan p = make_plan(pp_config("8B", 4, "1F1B", 8, /*shard=*/2));
  const int64_t D = 4096, kv = 1024, F = 14336, V = 128256;
  const int64_t block_shard = (D / 2) * D * 2 + (kv / 2) * D * 2 + (F / 2) * D * 2 + (D / 2) * F + 2 * (D / 2);
  const StagePlan& st = p.pipeline.stages[p.pipeline.planned_rank];
  int64_t shard = st.num_layers * block_shard, groups = st.num_layers;
  if (st.has_embedding) {
    shard += (V / 2) * D;
    groups += 1;
  }
  if (st.has_output) {
    shard += (D / 2) + (V / 2) * D;
    groups += 1;
  }
  EXPECT_EQ(p.comm.all_gather_calls, groups);
  EXPECT_EQ(p.comm.reduce_scatter_calls, groups);
  EXPECT_EQ(p.comm.all_gather_bytes, shard * 4);     // (S - 1) x fp32 shard
  EXPECT_EQ(p.comm.reduce_scatter_bytes, shard * 4);
  EXPECT_EQ(p.memory.params, shard * 4);
  EXPECT_EQ(p.memory.optimizer, 2 * shard * 4);
  // More microbatches: more P2P, the same data-parallel bytes.
  Plan more = make_plan(pp_config("8B", 4, "1F1B", 16, 2));
  EXPECT_EQ(more.pipeline.planned_rank, p.pipeline.planned_rank);
  EXPECT_EQ(more.comm.all_gather_bytes, p.comm.all_gather_bytes);
}

TEST(PlanPipeline, MemoryOfOneRankByHand) {
  // debugmodel (dim 256, 16 heads = kv heads, head_dim 16, ffn 768, vocab 2048, 6 layers) over pp 2 with 1F1B,
  // 2 microbatches of 1 x 64 tokens, fp32, one shard (parameters alias their shards: no unsharded copies).
  // Split: 8 effective layers -> 3 | 3. Rank 0 runs F0 F1 B0 B1: its peak is B0 with both microbatches' stage-0
  // activations saved, stage 0's accumulated gradients and B0's transient.
  PlanConfig c = pp_config("debugmodel", 2, "1F1B", 2);
  Plan p = make_plan(c);
  const int64_t T = 64, D = 256, Fh = 768, V = 2048, e = 4;
  const int64_t block = 4 * D * D + 3 * D * Fh + 2 * D;
  const int64_t per_token = 2 * (4 * D + 2 * e * D) + (e * 4 * D + 4 * 16) + 4 * e * Fh;  // norms, attention, SwiGLU
  const int64_t per_block = T * per_token;
  const int64_t boundary = T * D * e;
  const int64_t workspace = T * e * (2 * D + 3 * Fh);
  // Stage 0: embedding + 3 blocks; saves its blocks' activations and its output (sent on, kept for backward).
  const int64_t numel0 = 3 * block + V * D;
  const int64_t acts0 = 3 * per_block + boundary;
  const int64_t peak0 = numel0 * 4 /*params*/ + 2 * numel0 * 4 /*AdamW*/ + 2 * acts0 + numel0 * 4 /*accumulated*/ +
                        block * e + workspace;
  // Stage 1: 3 blocks + norm + output; its fp32 input is the first norm's saved input (not counted twice); the
  // final norm, logits and log-softmax output per microbatch; one microbatch in flight.
  const int64_t numel1 = 3 * block + D + V * D;
  const int64_t acts1 = 3 * per_block + T * (4 * D + 2 * e * D) + 2 * T * V * e;
  const int64_t peak1 = numel1 * 4 + 2 * numel1 * 4 + acts1 + numel1 * 4 + block * e + workspace;
  ASSERT_EQ(p.pipeline.ranks.size(), 2u);
  EXPECT_EQ(p.pipeline.stages[0].activation_bytes_per_microbatch, acts0);
  EXPECT_EQ(p.pipeline.stages[1].activation_bytes_per_microbatch, acts1);
  EXPECT_EQ(p.pipeline.ranks[0].peak_bytes, peak0);
  EXPECT_EQ(p.pipeline.ranks[1].peak_bytes, peak1);
  ASSERT_GT(peak0, peak1);
  EXPECT_EQ(p.pipeline.planned_rank, 0);
  EXPECT_EQ(p.memory.total, peak0);
  EXPECT_EQ(p.pipeline.microbatches_at_peak, 2);
  EXPECT_EQ(p.pipeline.activations_at_peak, 2 * acts0);
  EXPECT_TRUE(Contains(p.memory.peak_moment, "backward of stage 0 (microbatch 0)"));
  // The per-block activation formula at one microbatch's tokens is the pp = 1 formula at that batch.
  PlanConfig one = config("debugmodel", 1);
  one.local_batch = 1;
  EXPECT_EQ(p.memory.act_per_layer_full, make_plan(one).memory.act_per_layer_full);
  EXPECT_EQ(p.memory.act_per_layer_full, per_block);
}

TEST(PlanPipeline, PpOneIsThePlanWithoutPipeline) {
  // pp = 1 leaves the model untouched: no pipeline section, no P2P, the numbers DebugmodelSizesByHand checks.
  PlanConfig c = config("debugmodel", 1);
  Plan p = make_plan(c);
  EXPECT_FALSE(p.pipeline.enabled);
  EXPECT_EQ(p.comm.pp_send_bytes, 0);
  const int64_t block = 4 * 256 * 256 + 3 * 256 * 768 + 2 * 256;
  EXPECT_EQ(p.memory.params, (6 * block + 2 * 2048 * 256 + 256) * 4);
  const std::string text = format_plan(p);
  EXPECT_TRUE(Contains(text, "memory per rank\n"));
  EXPECT_EQ(text.find("pipeline"), std::string::npos) << text;
  EXPECT_EQ(text.find("pp send"), std::string::npos) << text;
  // The schedule name is not used at pp = 1.
  c.schedule = "GPipe";
  Plan same = make_plan(c);
  EXPECT_EQ(same.memory.total, p.memory.total);
  EXPECT_EQ(same.comm.total_bytes, p.comm.total_bytes);
  EXPECT_EQ(format_plan(same), text);
  // pp > 1 does change it (the pipeline ran).
  Plan piped = make_plan(pp_config("debugmodel", 2, "GPipe", 2));
  EXPECT_TRUE(piped.pipeline.enabled);
  EXPECT_LT(piped.memory.params, p.memory.params);
}

TEST(PlanPipeline, BadConfigurationsSayWhy) {
  {
    PlanConfig c = pp_config("8B", 2, "1F1B", 4);
    c.local_batch = 6;
    EXPECT_TRUE(Contains(error_of(c), "local batch 6 does not split into 4 equal microbatches"));
  }
  // 1F1B needs m >= pp (the schedule's reason, with the planner's context).
  EXPECT_TRUE(Contains(error_of(pp_config("8B", 4, "1F1B", 2)), "1F1B needs at least as many microbatches"));
  EXPECT_TRUE(Contains(error_of(pp_config("8B", 4, "1F1B", 2)), "fsdp-plan: schedule 1F1B with pp 4"));
  EXPECT_TRUE(Contains(error_of(pp_config("8B", 2, "Bogus", 2)), "unknown pipeline schedule \"Bogus\""));
  {
    PlanConfig c = pp_config("8B", 2, "ZBVZeroBubble", 4);
    c.stages_per_rank = 3;
    EXPECT_TRUE(Contains(error_of(c), "ZBVZeroBubble requires exactly 2 stages per rank"));
  }
  {
    PlanConfig c = pp_config("8B", 2, "Interleaved1F1B", 4);
    c.layers_per_stage = 5;  // ceil(34 / 5) = 7 stages
    EXPECT_TRUE(Contains(error_of(c), "= 7 stages, not a multiple of pp 2"));
    c.layers_per_stage = 17;  // 2 stages: 1 per rank
    EXPECT_TRUE(Contains(error_of(c), "needs at least 2 stages per rank"));
    c.schedule = "1F1B";
    c.layers_per_stage = 9;  // 4 stages: 2 per rank
    EXPECT_TRUE(Contains(error_of(c), "1F1B runs one stage per rank"));
    c.schedule = "Interleaved1F1B";
    c.stages_per_rank = 3;
    EXPECT_TRUE(Contains(error_of(c), "stages_per_rank 3 contradicts layers_per_stage 9"));
  }
  {
    // debugmodel: 6 layers + 2 = 8 effective layers cannot fill 4 x 4 = 16 stages.
    PlanConfig c = pp_config("debugmodel", 4, "Interleaved1F1B", 4);
    c.stages_per_rank = 4;
    EXPECT_TRUE(Contains(error_of(c), "16 pipeline stages for 8 effective layers"));
  }
  EXPECT_TRUE(Contains(error_of([] {
                         PlanConfig c = pp_config("8B", 4, "1F1B", 8);
                         c.first_stage_less_layers = 12;  // 45 effective layers / 4 stages = 11 per stage
                         return c;
                       }()),
                       "first_stage_less_layers 12 exceeds the 11 effective layers per stage"));
  EXPECT_TRUE(Contains(error_of(pp_config("1B", 2, "1F1B", 2)), "pipeline parallelism needs untied embeddings"));
  {
    PlanConfig c = config("debugmodel", 1);
    c.microbatches = 2;
    EXPECT_TRUE(Contains(error_of(c), "they need pp > 1"));
  }
}
