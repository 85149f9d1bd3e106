// fsdp-plan: sizes and bytes checked against independent hand computations (shapes written out here from the
// Llama 3 definition, not taken from the planner).
#include "plan.h"

#include <fsdp/models/qwen3.h>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

using namespace fsdp::plan;
namespace llama = fsdp::models::llama;

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

// ---- MoE and expert parallelism (docs/planner.md, "MoE and expert parallelism") ----
// Hand counts from the shapes of src/models/moe.cpp and src/models/llama.cpp written out here; the expected
// sharding is apps/fsdp-train/parallelize.cpp's (experts split on dim 0 over ep ranks, FSDP over efsdp =
// shard / ep, Shard(1) when shard > experts).

namespace {
PlanConfig moe_config(int64_t shard, int64_t ep, int64_t replicate = 1) {
  PlanConfig c;
  c.model = "qwen3";
  c.flavor = "cpu_tiny_moe";
  c.args = llama::qwen3_flavor("cpu_tiny_moe");
  c.shard = shard;
  c.replicate = replicate;
  c.ep = ep;
  c.local_batch = 2;
  c.seq_len = 64;
  return c;
}

// The flavor facts every MoE hand count below is written for (a flavor change fails here, not with odd numbers).
void expect_cpu_tiny_moe(const llama::LlamaArgs& a) {
  ASSERT_TRUE(a.moe.has_value());
  const auto o = a.moe_options();
  ASSERT_EQ(a.dim, 64);
  ASSERT_EQ(a.n_layers, 2);
  ASSERT_EQ(a.n_heads, 4);
  ASSERT_EQ(a.kv_heads(), 2);
  ASSERT_EQ(a.head_dim(), 32);
  ASSERT_EQ(a.vocab_size, 2048);
  ASSERT_FALSE(a.tie_embeddings);
  ASSERT_TRUE(a.qk_norm);
  ASSERT_EQ(o.num_experts, 8);
  ASSERT_EQ(o.top_k, 2);
  ASSERT_EQ(o.hidden, 32);
  ASSERT_EQ(o.num_shared_experts, 0);
  ASSERT_TRUE(o.load_balance_coeff.has_value());
  ASSERT_TRUE(a.is_moe_layer(0) && a.is_moe_layer(1));
}

int64_t up(int64_t n, int64_t d) { return (n + d - 1) / d; }
int64_t a16(int64_t b) { return (b + 15) / 16 * 16; }

// cpu_tiny_moe's parameters per block (not experts): wq [128, 64], wk [64, 64], wv [64, 64], wo [64, 128],
// q_norm [32], k_norm [32], router gate [8, 64], attention_norm [64], ffn_norm [64]; its dim-0 shard over S.
int64_t tiny_moe_dense_numel() { return 128 * 64 + 64 * 64 + 64 * 64 + 64 * 128 + 32 + 32 + 8 * 64 + 64 + 64; }
int64_t tiny_moe_dense_shard(int64_t S) {
  return up(128, S) * 64 + 2 * up(64, S) * 64 + up(64, S) * 128 + 2 * up(32, S) + up(8, S) * 64 + 2 * up(64, S);
}
}  // namespace

TEST(PlanMoE, ParameterBytesPerRankByHand) {
  expect_cpu_tiny_moe(llama::qwen3_flavor("cpu_tiny_moe"));
  // Whole model: 2 blocks of (dense 25,280 + experts 3 x 8 x 32 x 64) + root 2 x 2048 x 64 + 64.
  const int64_t experts_all = 3 * 8 * 32 * 64;
  const int64_t root = 2 * 2048 * 64 + 64;
  EXPECT_EQ(tiny_moe_dense_numel(), 25280);
  const int64_t root_shard = 2 * up(2048, 4) * 64 + up(64, 4);
  for (int64_t ep : {1, 2, 4}) {
    SCOPED_TRACE("ep " + std::to_string(ep));
    Plan p = make_plan(moe_config(4, ep));
    EXPECT_EQ(p.num_params, 2 * (tiny_moe_dense_numel() + experts_all) + root);
    ASSERT_EQ(p.groups.size(), 3u);
    const GroupPlan& b = p.groups[0];
    // This rank's experts: 8 / ep of them, FSDP-sharded on dim 0 over 4 / ep ranks: 8 / 4 = 2 experts' rows.
    const int64_t local_experts = 8 / ep, efsdp = 4 / ep;
    EXPECT_EQ(b.expert_shard, efsdp);
    EXPECT_EQ(b.expert_shard_dim, 0);
    EXPECT_EQ(b.expert_group, ep > 1);
    EXPECT_EQ(b.expert_numel, 3 * local_experts * 32 * 64);
    EXPECT_EQ(b.expert_shard_numel, 3 * up(local_experts, efsdp) * 32 * 64);
    EXPECT_EQ(b.expert_shard_numel, 3 * 2 * 32 * 64);
    EXPECT_EQ(b.local_numel, tiny_moe_dense_numel() + 3 * local_experts * 32 * 64);
    EXPECT_EQ(b.shard_numel, tiny_moe_dense_shard(4) + 3 * 2 * 32 * 64);
    const int64_t per_rank = 2 * (tiny_moe_dense_shard(4) + 3 * 2 * 32 * 64) + root_shard;
    EXPECT_EQ(per_rank, 2 * (6320 + 12288) + 65552);  // the numbers written out once
    EXPECT_EQ(p.memory.params, per_rank * 4);
    EXPECT_EQ(p.memory.grads, per_rank * 4);
    EXPECT_EQ(p.memory.optimizer, 2 * per_rank * 4);
    // expert_bias and tokens_per_expert: [8] float32 each, per MoE layer.
    EXPECT_EQ(p.memory.buffers, 2 * 2 * 8 * 4);
  }
}

TEST(PlanMoE, ShardOneWhenShardsOutnumberExperts) {
  // shard 16 > 8 experts: Shard(1) (F of w1 / w3 [E/ep, 32, 64], D of w2 [E/ep, 64, 32]), whatever ep.
  for (int64_t ep : {1, 2}) {
    const GroupPlan b = make_plan(moe_config(16, ep)).groups[0];
    const int64_t El = 8 / ep, efsdp = 16 / ep;
    EXPECT_EQ(b.expert_shard_dim, 1) << "ep " << ep;
    EXPECT_EQ(b.expert_shard_numel, 2 * El * up(32, efsdp) * 64 + El * up(64, efsdp) * 32) << "ep " << ep;
  }
  // shard 12, ep 4: 2 experts per rank over efsdp 3, uneven: F 32 -> 11 rows, D 64 -> 22 rows per rank.
  const GroupPlan uneven = make_plan(moe_config(12, 4)).groups[0];
  EXPECT_EQ(uneven.expert_shard_dim, 1);
  EXPECT_EQ(uneven.expert_shard, 3);
  EXPECT_EQ(uneven.expert_shard_numel, 2 * 2 * 11 * 64 + 2 * 22 * 32);
  EXPECT_EQ(uneven.expert_all_gather_bytes, 2 * a16(2 * 11 * 64 * 4) + a16(2 * 22 * 32 * 4));
  // shard 8 = experts: dim 0. The replicate dim does not count (tt#4767): HSDP 2 x 4 keeps dim 0.
  EXPECT_EQ(make_plan(moe_config(8, 2)).groups[0].expert_shard_dim, 0);
  EXPECT_EQ(make_plan(moe_config(4, 1, 4)).groups[0].expert_shard_dim, 0);
}

TEST(PlanMoE, AllToAllBytesOverTheEpDim) {
  // T = 2 x 64 tokens, top-2, D 64, fp32: each rank routes T k = 256 rows of 256 bytes; (ep-1)/ep leave it.
  // Per MoE layer: forward counts ((ep-1) x 8/ep int64) + dispatch + combine, backward dispatch + combine.
  for (int64_t ep : {2, 4}) {
    SCOPED_TRACE("ep " + std::to_string(ep));
    Plan p = make_plan(moe_config(4, ep));
    const int64_t rows = 256 * 64 * 4 * (ep - 1) / ep;
    const int64_t counts = (ep - 1) * (8 / ep) * 8;
    EXPECT_EQ(rows, ep == 2 ? 32768 : 49152);
    EXPECT_EQ(p.comm.ep_count_bytes, 2 * counts);
    EXPECT_EQ(p.comm.ep_dispatch_bytes, 2 * 2 * rows);
    EXPECT_EQ(p.comm.ep_combine_bytes, 2 * 2 * rows);
    EXPECT_EQ(p.comm.ep_all_to_all_calls, 2 * 5);
    EXPECT_EQ(p.comm.ep_total_bytes, 2 * counts + 8 * rows);
    // The ep dim is reported apart from the data-parallel dims.
    EXPECT_TRUE(p.comm.total_bytes == p.comm.all_gather_bytes + p.comm.reduce_scatter_bytes + p.comm.all_reduce_bytes);
    // Full AC recomputes each block's forward: its three exchanges run again.
    PlanConfig c = moe_config(4, ep);
    c.ac = ACMode::Full;
    Plan full = make_plan(c);
    EXPECT_EQ(full.comm.ep_count_bytes, 2 * 2 * counts);
    EXPECT_EQ(full.comm.ep_dispatch_bytes, 2 * 3 * rows);
    EXPECT_EQ(full.comm.ep_all_to_all_calls, 2 * 8);
  }
  // bf16 compute halves the rows' bytes; no EP, no all-to-all.
  PlanConfig bf = moe_config(4, 2);
  bf.compute_dtype = c10::kBFloat16;
  EXPECT_EQ(make_plan(bf).comm.ep_dispatch_bytes, 2 * 2 * (256 * 64 * 2 / 2));
  const Plan none = make_plan(moe_config(4, 1));
  EXPECT_EQ(none.comm.ep_total_bytes, 0);
  EXPECT_EQ(none.comm.ep_all_to_all_calls, 0);
}

TEST(PlanMoE, ExpertCollectivesOverEfsdp) {
  // shard 4, ep 2: experts all-gathered / reduce-scattered over efsdp = 2 ranks in calls of their own; each
  // parameter's slot is 2 experts x 32 x 64 fp32 = 16 KiB.
  Plan p = make_plan(moe_config(4, 2));
  const int64_t slot = 3 * a16(2 * 32 * 64 * 4);
  EXPECT_EQ(p.comm.expert_all_gather_bytes, 2 * 2 * (2 - 1) * slot);  // 2 blocks, forward + backward
  EXPECT_EQ(p.comm.expert_all_gather_calls, 4);
  EXPECT_EQ(p.comm.expert_reduce_scatter_bytes, 2 * (2 - 1) * 3 * 2 * 32 * 64 * 4);
  EXPECT_EQ(p.comm.expert_reduce_scatter_calls, 2);
  // Dense parts over the 4 shard ranks (dim-0 slots of wq wk wv wo q_norm k_norm gate and the 2 norms), root once.
  const int64_t dense_slot = a16(32 * 64 * 4) + 2 * a16(16 * 64 * 4) + a16(16 * 128 * 4) + 2 * a16(8 * 4) +
                             a16(2 * 64 * 4) + 2 * a16(16 * 4);
  const int64_t root_slot = 2 * a16(512 * 64 * 4) + a16(16 * 4);
  EXPECT_EQ(p.comm.all_gather_bytes, 2 * 2 * 3 * dense_slot + 3 * root_slot + p.comm.expert_all_gather_bytes);
  EXPECT_EQ(p.comm.all_gather_calls, 2 * 2 * 2 + 1);
  EXPECT_EQ(p.comm.reduce_scatter_calls, 2 * 2 + 1);
  // ep 1: the experts travel in the blocks' own collectives over the 4 shard ranks.
  Plan one = make_plan(moe_config(4, 1));
  EXPECT_EQ(one.comm.expert_all_gather_bytes, 2 * 2 * 3 * 3 * a16(2 * 32 * 64 * 4));
  EXPECT_EQ(one.comm.expert_all_gather_calls, 0);
  EXPECT_EQ(one.comm.all_gather_calls, 2 * 2 + 1);
  // HSDP 2 x (4, ep 2): the experts' shards are all-reduced over the 2 replicas too, 2 (R-1)/R of them.
  Plan h = make_plan(moe_config(4, 2, 2));
  EXPECT_EQ(h.comm.expert_all_reduce_bytes, 2 * 3 * 2 * 32 * 64 * 4);
  EXPECT_EQ(h.comm.expert_all_reduce_calls, 2);
  EXPECT_EQ(h.comm.all_reduce_calls, 2 * 2 + 1);
}

TEST(PlanMoE, UnshardedBuffersHoldThisRanksExperts) {
  // Without resharding every block stays unsharded after forward: dense + this rank's 8/ep experts, fp32.
  for (int64_t ep : {1, 2}) {
    PlanConfig c = moe_config(4, ep);
    Plan keep = make_plan(c);
    c.block_reshard = 0;
    Plan never = make_plan(c);
    EXPECT_EQ(never.memory.end_of_forward - keep.memory.end_of_forward,
              2 * (tiny_moe_dense_numel() + 3 * (8 / ep) * 32 * 64) * 4)
        << "ep " << ep;
  }
  // shard 2 = ep 2: the experts' FSDP group has one rank and nothing is cast, so they alias their shard (no
  // unsharded copy); the dense part still has one.
  PlanConfig c = moe_config(2, 2);
  Plan keep = make_plan(c);
  c.block_reshard = 0;
  Plan never = make_plan(c);
  EXPECT_EQ(never.memory.end_of_forward - keep.memory.end_of_forward, 2 * tiny_moe_dense_numel() * 4);
  EXPECT_EQ(never.comm.expert_all_gather_bytes, 0);
  EXPECT_EQ(never.comm.expert_reduce_scatter_bytes, 0);
}

TEST(PlanMoE, DenseQwen3CountsQkNorm) {
  // qwen3 cpu_tiny: dim 64, 2 layers, 4 / 2 heads of 32, FFN 192, vocab 2048, QK-norm [32] x 2 per block.
  PlanConfig c;
  c.model = "qwen3";
  c.flavor = "cpu_tiny";
  c.args = llama::qwen3_flavor("cpu_tiny");
  ASSERT_EQ(c.args.ffn_hidden_dim(), 192);
  ASSERT_EQ(c.args.head_dim(), 32);
  ASSERT_TRUE(c.args.qk_norm);
  c.local_batch = 1;
  c.seq_len = 16;
  Plan p = make_plan(c);
  const int64_t block = 128 * 64 + 2 * 64 * 64 + 64 * 128 + 2 * 32 + 3 * 64 * 192 + 2 * 64;
  EXPECT_EQ(p.num_params, 2 * block + 2 * 2048 * 64 + 64);
  // QK-norm's saved bytes per token (fp32): float32 input and normalized q / k (Hq 128 + Hkv 64, 4 + 4 bytes
  // each), one float32 rsqrt per head row (4 + 2 heads): this much more than the same block without it.
  PlanConfig no_qk = c;
  no_qk.args.qk_norm = false;
  no_qk.args.rope_layout = llama::RopeLayout::Interleaved;
  no_qk.flavor.clear();
  no_qk.build_model = [args = no_qk.args]() {  // no flavor has these args: built here, parallelized by the family
    llama::LlamaArgs meta = args;
    meta.device = c10::Device(c10::kMeta);
    return std::static_pointer_cast<torch::nn::Module>(llama::Transformer(meta).ptr());
  };
  EXPECT_EQ(p.memory.act_per_dense_layer - make_plan(no_qk).memory.act_per_dense_layer,
            16 * ((4 + 4) * (128 + 64) + 4 * (4 + 2)));
}

TEST(PlanMoE, BadOptionsSayWhy) {
  EXPECT_TRUE(Contains(error_of(moe_config(6, 4)), "--ep 4 must divide --shard x --cp x --tp = 6"));
  EXPECT_TRUE(Contains(error_of(moe_config(6, 3)), "--ep 3 must divide the 8 experts of qwen3 cpu_tiny_moe"));
  {
    PlanConfig c = config("cpu_tiny", 4);
    c.ep = 2;
    EXPECT_TRUE(Contains(error_of(c), "--ep 2 needs an MoE model, but llama3 cpu_tiny has no MoE layers"));
    c.ep = 0;
    EXPECT_TRUE(Contains(error_of(c), "ep must be >= 1"));
  }
  {
    PlanConfig c = moe_config(4, 2);
    c.ac = ACMode::Selective;
    c.selective = SelectiveKind::Layer;
    EXPECT_TRUE(Contains(error_of(c), "<no error>"));
    c.ac = ACMode::None;
    c.block_reshard = 2;
    EXPECT_TRUE(Contains(error_of(c), "(hpZ) with MoE layers is not modelled"));
  }
}

// MoE under TP (EP borrowing from dp_shard x tp), under PP and with op-level SAC: planned, with the activations and
// the TP / EP collectives of docs/planner.md counted by hand on cpu_tiny_moe (dim 64, 2 MoE blocks, 4 / 2 heads of
// 32, 8 experts of hidden 32, top-2, route_norm, no shared experts), fp32, T = 2 x 64 tokens.
TEST(PlanMoE, TensorPipelineAndOpSacByHand) {
  expect_cpu_tiny_moe(llama::qwen3_flavor("cpu_tiny_moe"));
  const int64_t T = 128, e = 4, D = 64, k = 2, E = 8, F = 32;
  // The routed part per routed token (router scores, ids, route_norm, slot indices, weights, rows, SwiGLU, float32
  // outputs, weighted outputs) and the ep > 1 permutations.
  const int64_t routed = 4 * E + 8 * k + (4 * k + 4) + 16 * k + 4 * k + k * D * e + 4 * k * F * e + 4 * k * D +
                         k * D * e + 16 * k;
  {
    PlanConfig c = moe_config(2, 2);
    c.tp = 2;
    Plan p = make_plan(c);
    // Per token of T at tp 2: heads 2 (Hq 64, Hkv 32, SDPA sees k, v repeated to 64), the attention norm (local
    // float32 input and normalized, the gathered output saved by wq / wk / wv), the ffn_norm (local: its output is
    // the router's input), QK-norm; the routed part on the local T / 2 tokens.
    const int64_t attn_norm = (4 * D + e * D) / 2 + e * D, ffn_norm = (4 * D + 2 * e * D) / 2;
    const int64_t attn = e * (64 + 2 * 64 + 64) + 4 * 2, qk = (4 + e) * (64 + 32) + 4 * (2 + 1);
    EXPECT_EQ(p.memory.act_per_moe_layer, T * (attn_norm + ffn_norm + attn + qk) + T / 2 * routed);
    // TP: per MoE block only the attention all-gathers its input and reduce-scatters its output (no shared
    // experts), twice (forward, backward mirror); the embedding and output layer one each way. All-reduces: 2 norms,
    // q_norm, k_norm and the router gate per block, the final norm, the loss's 3.
    EXPECT_EQ(p.comm.tp_all_gather_calls, 2 * 2 + 2);
    EXPECT_EQ(p.comm.tp_all_gather_bytes, (2 * 2 + 2) * (T / 2) * D * e);
    EXPECT_EQ(p.comm.tp_all_reduce_calls, 2 * 5 + 1 + 3);
    EXPECT_EQ(p.comm.tp_all_reduce_bytes,
              2 * (2 * D * e + 2 * 32 * e + E * D * e) + D * e + (T + 1) * 4 + 2 * T * 4);  // 2 (tp-1)/tp = 1
    // EP 2 over dp_shard x tp = 4 ranks (efsdp 2): each rank routes its T / 2 tokens, half the rows leave.
    EXPECT_EQ(p.groups[0].expert_shard, 2);
    EXPECT_EQ(p.comm.ep_dispatch_bytes, 2 * 2 * (T / 2) * k * D * e / 2);
    EXPECT_EQ(p.comm.ep_all_to_all_calls, 2 * 5);
  }
  {
    PlanConfig c = moe_config(2, 2);
    c.pp = 2;
    c.local_batch = 2;
    c.microbatches = 2;
    Plan p = make_plan(c);
    ASSERT_TRUE(p.pipeline.enabled);
    // 1F1B over 2 ranks, 1 block per stage: each rank's one MoE block per microbatch of 64 tokens.
    EXPECT_EQ(p.comm.ep_all_to_all_calls, 2 * 5);
    EXPECT_EQ(p.comm.ep_dispatch_bytes, 2 * 2 * 64 * k * D * e / 2);
  }
  {
    PlanConfig c = moe_config(4, 2);
    c.ac = ACMode::Selective;
    c.selective = SelectiveKind::Op;
    Plan p = make_plan(c);
    // Kept: the block input, wq and wv outputs, the router gate's logits (the grouped GEMM is recomputed).
    EXPECT_EQ(p.memory.saved_activations,
              2 * T * e * (D + 128 + 64 + E) + T * (4 + 2 * e) * D);
    // Recomputed: the ep exchanges run again in each block's recomputation.
    EXPECT_EQ(p.comm.ep_all_to_all_calls, 2 * 8);
  }
}

TEST(PlanMoE, BigFlavorsPlanWithoutAllocating) {
  PlanConfig c;
  c.model = "qwen3";
  c.flavor = "30B-A3B";
  c.args = llama::qwen3_flavor("30B-A3B");
  c.shard = 8;
  c.ep = 4;
  c.compute_dtype = c10::kBFloat16;
  c.seq_len = 4096;
  c.ac = ACMode::Full;
  Plan p = make_plan(c);
  // 48 layers x 128 experts x 3 x 768 x 2048 routed-expert parameters alone.
  EXPECT_GT(p.num_params, int64_t{48} * 128 * 3 * 768 * 2048);
  // 32 experts per rank, over efsdp 2 on dim 0: 16 experts' weights per rank and layer.
  EXPECT_EQ(p.groups[0].expert_shard_numel, int64_t{16} * 3 * 768 * 2048);
  EXPECT_TRUE(Contains(format_plan(p), "ep all-to-all"));
  EXPECT_TRUE(Contains(format_plan(p), "32 experts per rank"));
}

// Context parallelism: the sequence per rank and the attention memory of one block against a hand count of what
// src/context_parallel holds (llama3 cpu_tiny: 4 heads of 16, 2 KV heads repeated to 4 for the kernel; fp32;
// 2 sequences of 256 tokens): saved q, k, v, output (Hq = 64 wide each) and the float32 log-sum-exp per head at
// the rank's 2 x 256 / cp tokens; in flight, the other ranks' K and V (all-gather: cp x this rank's; ring: at most
// two ranks'), and in backward also dQ and the float32 dK / dV accumulators (all-gather: every rank's and the
// reduce-scatter output; ring: the one computed on and the one in flight).
TEST(PlanContextParallel, SequencePerRankAndAttentionMemoryByHand) {
  const int64_t e = 4, Hq = 64, heads = 4;
  int64_t saved_cp1 = 0;
  for (int64_t cp : {1, 2, 4}) {
    for (const std::string method : {"allgather", "alltoall"}) {
      SCOPED_TRACE("cp " + std::to_string(cp) + " " + method);
      PlanConfig c = config("cpu_tiny", 2);
      c.seq_len = 256;
      c.cp = cp;
      c.cp_rotate_method = method;
      const Plan p = make_plan(c);
      const int64_t T = 2 * 256 / cp, kv = T * 2 * Hq;
      EXPECT_EQ(p.memory.seq_per_rank, 256 / cp);
      EXPECT_EQ(p.memory.attention_saved_per_layer, T * (e * 4 * Hq + 4 * heads));
      if (cp == 1) {
        saved_cp1 = p.memory.attention_saved_per_layer;
        EXPECT_EQ(p.memory.attention_forward_in_flight, 0);
        EXPECT_EQ(p.memory.attention_backward_in_flight, 0);
        continue;
      }
      EXPECT_EQ(p.memory.attention_saved_per_layer * cp, saved_cp1);  // falls as 1/cp
      const int64_t others = method == "allgather" ? cp : std::min<int64_t>(2, cp - 1);
      EXPECT_EQ(p.memory.attention_forward_in_flight, others * kv * e);
      EXPECT_EQ(p.memory.attention_backward_in_flight,
                others * kv * e + T * Hq * 4 + (method == "allgather" ? (cp + 1) * kv * 4 : 2 * kv * 4));
      // FSDP shards over shard x cp: the shards of shard 2 x cp are those of shard 2 cp ranks without cp.
      EXPECT_EQ(p.groups[0].shard_numel, make_plan(config("cpu_tiny", 2 * cp)).groups[0].shard_numel);
      EXPECT_TRUE(Contains(format_plan(p), std::to_string(256 / cp) + " tokens per rank of seq 256 (cp " +
                                               std::to_string(cp)));
    }
  }
  // A sequence that does not split into the head-tail chunks: the trainer's rule, through the seam.
  PlanConfig c = config("cpu_tiny", 2);
  c.seq_len = 100;
  c.cp = 4;
  EXPECT_TRUE(Contains(error_of(c), "context_parallel_degree")) << error_of(c);
  c.seq_len = 256;
  c.cp_rotate_method = "ring";
  EXPECT_TRUE(Contains(error_of(c), "--cp-rotate-method must be allgather or alltoall"));
}

TEST(PlanContextParallel, WithPipelineByHand) {
  // pp 2 x cp 2 (llama3 cpu_tiny: dim 64, 4 heads of 16, 2 kv heads; 1F1B, 2 microbatches of one 256-token
  // sequence): each microbatch holds 256 / cp = 128 tokens per rank, so the boundary tensor, the stage
  // activations and the attention are those of a 128-token sequence without cp; FSDP inside each stage shards
  // over shard x cp = 2 ranks, as pp 2 x shard 2 does; the ring's in-flight bytes join the backward.
  PlanConfig c = pp_config("cpu_tiny", 2, "1F1B", 2);
  c.seq_len = 256;
  c.cp = 2;
  c.cp_rotate_method = "alltoall";
  const Plan p = make_plan(c);
  PlanConfig half = pp_config("cpu_tiny", 2, "1F1B", 2, /*shard=*/2);
  half.seq_len = 128;
  const Plan q = make_plan(half);
  EXPECT_EQ(p.pipeline.boundary_bytes, 128 * 64 * 4);
  EXPECT_EQ(p.memory.seq_per_rank, 128);
  // Saved attention of one block at 128 tokens: q, k, v (kv repeated to the 4 heads), output, fp32 lse.
  EXPECT_EQ(p.memory.attention_saved_per_layer, 128 * (4 * (64 + 2 * 64 + 64) + 4 * 4));
  EXPECT_EQ(p.memory.attention_saved_per_layer, q.memory.attention_saved_per_layer);
  EXPECT_GT(p.memory.attention_backward_in_flight, 0);
  EXPECT_EQ(q.memory.attention_backward_in_flight, 0);
  ASSERT_EQ(p.pipeline.stages.size(), q.pipeline.stages.size());
  for (size_t s = 0; s < p.pipeline.stages.size(); ++s) {
    EXPECT_EQ(p.pipeline.stages[s].activation_bytes_per_microbatch, q.pipeline.stages[s].activation_bytes_per_microbatch);
    EXPECT_EQ(p.pipeline.stages[s].shard_numel, q.pipeline.stages[s].shard_numel);
  }
  EXPECT_EQ(p.comm.all_gather_bytes, q.comm.all_gather_bytes);
  EXPECT_EQ(p.comm.reduce_scatter_bytes, q.comm.reduce_scatter_bytes);
  EXPECT_EQ(p.comm.pp_send_bytes, q.comm.pp_send_bytes);
  // The peak at a backward carries the ring's in-flight bytes on top of what the cp-free plan holds there.
  EXPECT_GE(p.memory.total, q.memory.total);
  EXPECT_TRUE(Contains(format_plan(p), "pp 2 x replicate 1 x shard 1 x cp 2 x tp 1 = 4 ranks")) << format_plan(p);
}
