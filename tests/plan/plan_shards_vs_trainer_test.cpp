// fsdp-plan against fsdp-train's real parallelization, reached through the model seam (apps/fsdp-train/
// model_spec.h: the family's build, init_weights and parallelize, as the trainer calls them), on 2 or 4 CPU ranks.
// The planner builds the same model on meta and parallelizes it under a fake world of each rank it plans; the
// trainer here builds it with values on real process groups. For each layout:
//   shards  for every FSDP unit (each block and the root; under PP each stage's) the elements rank 0 holds equal
//           the plan's GroupPlan::shard_numel (rank 0's pieces are the largest: the padded sizes the plan counts),
//           other ranks hold at most that; the units match one to one, the routed experts apart
//   bytes   (data-parallel layouts) one forward + backward of the real model: the bytes and calls its FSDP groups
//           count (fsdp/comm_stats.h) equal the plan's all-gather / reduce-scatter / all-reduce figures; (TP
//           layouts) the bytes and calls its TP group counts equal the plan's tp_* figures (dense, Qwen3's
//           QK-norm, MoE blocks, tp2 x ep2), less the loss's all-reduces (the step's loss is a plain sum)
//   ep      (expert-parallel layouts: ep2, tp2 x ep2, cp2 x ep2, pp2 x ep2 through a real pipeline step) the all-to-alls
//           the EP group counts equal the plan's calls, and its bytes equal the plan's fixed-size count exchange
//           plus the plan's bytes per routed row times the rows this step's real routing moved (routing is
//           data-dependent: the plan assumes balanced routing, each routed row leaving its rank with probability
//           (ep-1)/ep); the ep group's mean stays under the bound of every routed row leaving
//   buffers (PP) the MoE blocks' [E] buffers (expert_bias, tokens_per_expert) each stage's module holds equal
//           the plan's StagePlan::buffer_bytes
// Layouts: 2 ranks: dp2, ddp (replicate 2), tp2 (llama3, qwen3, qwen3 MoE), pp2, ep2 and MoE without EP (qwen3
//          cpu_tiny_moe), MoE cp2 x ep2 (EP borrowing the cp ranks);
//          4 ranks: HSDP 2 x 2, dp2 x tp2, pp2 x dp2, ep2 with the experts' FSDP over 2, MoE over 4 (Shard(0)),
//          MoE tp2 x ep2 (EP borrowing from dp_shard x tp) and pp2 x ep2 (EP inside each stage), pp2 x cp2
//          (FSDP over dp_shard x cp inside each stage, a microbatch's attention at seq / cp);
//          DeepSeek-V3 cpu_tiny (MLA, shared experts, group-limited routing): 2 ranks dp2, ep2, tp2, pp2, cp2,
//          cp2 x ep2; 4 ranks dp4, ep2, dp2 x tp2, tp2 x ep2, pp2 x ep2, pp2 x tp2, pp2 x tp2 x ep2, cp2 x tp2.
#include "attention_memory.h"
#include "config.h"
#include "model_spec.h"
#include "moe_balance.h"
#include "parallel_dims.h"
#include "plan.h"

#include <fsdp/comm_stats.h>
#include <fsdp/fully_shard_layout.h>
#include <fsdp/models/moe.h>
#include <fsdp/models/qwen3.h>
#include <fsdp/pipeline.h>
#include <fsdp/process_group.h>
#include <fsdp/tensor_parallel_spec.h>

#include "comm/dist_env.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace {

constexpr int64_t kVocab = 258;  // the byte-level tokenizer's, as the trainer builds the model
constexpr int64_t kSeq = 16;

struct Layout {
  std::string name, flavor;
  int64_t replicate = 1, tp = 1, ep = 1, pp = 1, cp = 1;
  int64_t shard() const { return fsdp::world()->size() / (replicate * tp * pp * cp); }
  std::string text() const {
    return name + " " + flavor + " replicate " + std::to_string(replicate) + " shard " + std::to_string(shard()) +
           " tp " + std::to_string(tp) + " ep " + std::to_string(ep) + " pp " + std::to_string(pp) + " cp " +
           std::to_string(cp);
  }
};

// The FSDP unit a parameter belongs to: "layers.<i>" for a block's, "root" for the rest (the plan's names).
std::string unit_of(const std::string& fqn) {
  if (fqn.rfind("layers.", 0) != 0) return "root";
  return fqn.substr(0, fqn.find('.', 7));
}

// One step's expert-parallel traffic on this rank: the EP group's counters and, from every ep rank's token counts
// per expert (the step's real routing), the rows this rank sent to and received from the other ep ranks.
struct EpStep {
  bool stepped = false;
  fsdp::CommStats stats;
  int64_t moe_layers = 0;   // MoE blocks this rank ran (under PP: its stages')
  int64_t rows_moved = 0;   // over those blocks: rows sent + rows received (dispatch; the combine mirrors them)
  double group_mean_bytes = 0;  // bytes_sent averaged over the ep group
};

// The group the routed experts of `module`'s MoE blocks were split over (what ExpertParallel recorded).
fsdp::ProcessGroupPtr ep_group_of(torch::nn::Module& module) {
  for (auto* moe : fsdp_train::moe_layers(module)) {
    for (const auto& item : moe->experts->named_parameters()) {
      if (auto spec = fsdp::tensor_parallel_spec(*moe->experts.ptr(), item.value())) return spec->mesh.group(0);
    }
  }
  return nullptr;
}

// Reads the EP counters (reset before the step) and the routing of the step just run: ep rank r holds experts
// [r E/ep, (r+1) E/ep); a row leaves its rank unless its expert is one of the rank's own.
EpStep ep_step(torch::nn::Module& module, fsdp::ProcessGroup& ep) {
  EpStep out;
  out.stepped = true;
  out.stats = fsdp::comm_stats(ep);  // a copy, before the collectives below
  const auto moes = fsdp_train::moe_layers(module);
  out.moe_layers = static_cast<int64_t>(moes.size());
  const int64_t n = ep.size(), r = ep.rank(), L = out.moe_layers, E = moes.front()->tokens_per_expert().numel(),
                local = E / n;
  at::Tensor mine = at::empty({L, E});
  for (int64_t l = 0; l < L; ++l) mine[l].copy_(moes[static_cast<size_t>(l)]->tokens_per_expert());
  at::Tensor all = at::empty({n, L, E});
  ep.all_gather_into_tensor(all, mine.contiguous()).wait();
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor counts = all.select(1, l).to(at::kLong);  // [ep, E]
    const int64_t kept = counts[r].slice(0, r * local, (r + 1) * local).sum().item<int64_t>();
    out.rows_moved += counts[r].sum().item<int64_t>() - kept;                                  // sent
    out.rows_moved += counts.slice(1, r * local, (r + 1) * local).sum().item<int64_t>() - kept;  // received
  }
  at::Tensor bytes = at::full({1}, static_cast<double>(out.stats.bytes_sent), at::TensorOptions().dtype(at::kDouble));
  ep.all_reduce(bytes).wait();
  out.group_mean_bytes = bytes.item<double>() / static_cast<double>(n);
  return out;
}

struct Held {
  std::map<std::string, int64_t> units, experts;  // elements this rank holds per unit (experts: the routed ones)
  fsdp::CommStats fsdp_bytes;                     // the data-parallel groups' counters over one step
  bool stepped = false;
  fsdp::CommStats tp_bytes;                       // the TP group's counters over one step (tp > 1)
  fsdp_train::AttentionShape attention;           // the model's, as fsdp-train's start-up log reads it
  bool tp_stepped = false;
  EpStep ep;                                      // expert-parallel layouts: one step's EP traffic
  std::map<int, int64_t> stage_buffers;           // PP: the MoE [E] buffer bytes of each stage this rank holds
};

fsdp::CommStats operator+(fsdp::CommStats a, const fsdp::CommStats& b) {
  a.all_gather_calls += b.all_gather_calls;
  a.reduce_scatter_calls += b.reduce_scatter_calls;
  a.all_reduce_calls += b.all_reduce_calls;
  a.bytes_sent += b.bytes_sent;
  return a;
}

fsdp_train::JobConfig job_config(const Layout& l) {
  return fsdp_train::load_config(
      {"--model.name", l.name, "--model.flavor", l.flavor, "--training.seq_len", std::to_string(kSeq),
       "--training.local_batch_size", "2", "--validation.local_batch_size", "2", "--training.global_batch_size",
       std::to_string(2 * l.replicate * l.shard()), "--training.mixed_precision_param", "float32",
       "--parallelism.data_parallel_replicate_degree", std::to_string(l.replicate),
       "--parallelism.tensor_parallel_degree", std::to_string(l.tp), "--parallelism.expert_parallel_degree",
       std::to_string(l.ep), "--parallelism.pipeline_parallel_degree", std::to_string(l.pp),
       "--parallelism.num_pp_microbatches", "2", "--parallelism.context_parallel_degree", std::to_string(l.cp)});
}

Held shard_for_real(const Layout& l) {
  auto world = fsdp::world();
  const fsdp_train::JobConfig config = job_config(l);
  const fsdp_train::ParallelDims dims = fsdp_train::resolve_parallelism(config, world->size());
  const fsdp_train::TrainSpec& spec = fsdp_train::train_spec(l.name);
  spec.check_layout(config, dims);
  fsdp_train::ModelShape shape;
  shape.vocab_size = kVocab;
  shape.max_seq_len = kSeq;
  fsdp_train::TrainModel model = spec.build(config, shape);
  model.init_weights(0, {});  // TP and EP layouts need the whole model first (plan_needs_full_init)
  const fsdp_train::ParallelPlan plan = spec.parallelize(model, config, dims, world);
  EXPECT_TRUE(plan.fsdp) << plan.description;
  Held held;
  held.attention = model.attention;
  for (const auto& item : model.module->named_parameters()) {
    held.units[unit_of(item.key())] += item.value().numel();
    if (item.key().find(".moe.experts.") != std::string::npos) held.experts[unit_of(item.key())] += item.value().numel();
  }
  if (l.pp > 1) {
    // Under PP the whole model's modules stay on every rank; only this rank's stages were sharded (and, in
    // fsdp-train, materialized): keep those, and their MoE blocks' [E] buffers.
    std::map<std::string, int64_t> mine;
    for (size_t i = 0; i < plan.stages.size(); ++i) {
      const auto& stage = plan.stages[i];
      for (const auto& item : stage.module->named_parameters()) mine[unit_of(item.key())] += item.value().numel();
      int64_t& buffers = held.stage_buffers[plan.stage_indices[i]];
      for (auto* moe : fsdp_train::moe_layers(*stage.module)) {
        buffers += moe->tokens_per_expert().nbytes() + (moe->expert_bias.defined() ? moe->expert_bias.nbytes() : 0);
      }
    }
    held.units = mine;
    if (l.ep > 1) {
      // One pipeline step (the trainer's stages and schedule, 2 microbatches), counted on this stage's EP group.
      torch::nn::Module& first = *plan.stages.front().module;
      const fsdp::ProcessGroupPtr ep = ep_group_of(first);
      EXPECT_TRUE(ep) << "no expert-parallel block in this rank's stage";
      if (!ep) return held;
      std::vector<fsdp::PipelineStage> stages;
      for (size_t i = 0; i < plan.stages.size(); ++i)
        stages.push_back({plan.stage_indices[i], plan.stages[i].module, nullptr, plan.stages[i].forward});
      fsdp::PipelineOptions options;
      options.microbatches = 2;
      options.num_stages = plan.num_stages;
      fsdp::Pipeline pipeline(std::move(stages), plan.pp_group,
                              [](const at::Tensor& out, const at::Tensor&) { return out.sum(); }, options);
      // A stage's data-parallel ranks get other batches, a TP group shares its batch.
      const int dp_rank = world->rank() % static_cast<int>(world->size() / l.pp) / static_cast<int>(l.tp);
      at::Generator gen = at::detail::createCPUGenerator(7 + dp_rank);
      const at::Tensor tokens = at::randint(kVocab, {2, kSeq}, gen, at::TensorOptions().dtype(at::kLong));
      fsdp::reset_comm_stats(*ep);
      pipeline.step(tokens, tokens);
      held.ep = ep_step(first, *ep);
    }
    return held;
  }
  // Expert parallelism: the EP group's counters over the step below (TP or FSDP).
  const fsdp::ProcessGroupPtr ep = l.ep > 1 ? ep_group_of(*model.module) : nullptr;
  EXPECT_EQ(static_cast<bool>(ep), l.ep > 1);
  if (ep) fsdp::reset_comm_stats(*ep);
  if (l.tp > 1) {
    // One step of the real model counted on the TP group: the sequence-parallel activation collectives of every
    // block, the embedding and the output layer, and the replicated weights' gradient all-reduces. The loss here
    // is a plain sum of the vocabulary-sharded logits, so loss parallel's 3 all-reduces do not run.
    fsdp::ProcessGroup& tp = *plan.tp_mesh.group(0);
    fsdp::reset_comm_stats(tp);
    at::Generator gen = at::detail::createCPUGenerator(7 + world->rank() / l.tp);  // a TP group shares its batch
    // Under CP (cp x tp) each rank's seq / cp tokens of every sequence, as the trainer feeds it.
    const at::Tensor tokens = at::randint(kVocab, {2, kSeq / l.cp}, gen, at::TensorOptions().dtype(at::kLong));
    model.forward(tokens).sum().backward();
    held.tp_bytes = fsdp::comm_stats(tp);
    held.tp_stepped = true;
    if (ep) held.ep = ep_step(*model.module, *ep);
    return held;
  }
  if (l.replicate * l.shard() * l.cp == 1) return held;
  // One step of the real model: forward (the root's and every block's all-gather), backward (re-gathers, the
  // reduce-scatters and HSDP's / DDP's all-reduces), counted on the data-parallel groups FSDP uses.
  std::vector<fsdp::ProcessGroupPtr> groups;
  // Every FSDP parameter group's mesh (the experts' efsdp mesh with EP too). Groups of one rank take a local path
  // that counts calls but sends nothing; the plan counts calls that communicate.
  std::set<const fsdp::ProcessGroup*> seen;
  for (const fsdp::FSDPModule& unit : plan.fsdp_modules) {
    for (const fsdp::ParamGroupLayout& layout : fsdp::param_group_layouts(unit)) {
      for (int64_t d = 0; d < layout.mesh.ndim(); ++d) {
        const fsdp::ProcessGroupPtr g = layout.mesh.group(d);
        if (g->size() > 1 && seen.insert(g.get()).second) groups.push_back(g);
      }
    }
  }
  for (const auto& g : groups) fsdp::reset_comm_stats(*g);
  at::Generator gen = at::detail::createCPUGenerator(7 + world->rank());
  // Under CP the trainer feeds each rank its seq / cp tokens of every sequence (its chunks).
  const at::Tensor tokens = at::randint(kVocab, {2, kSeq / l.cp}, gen, at::TensorOptions().dtype(at::kLong));
  model.forward(tokens).sum().backward();
  for (const auto& g : groups) held.fsdp_bytes = held.fsdp_bytes + fsdp::comm_stats(*g);
  held.stepped = true;
  if (ep) held.ep = ep_step(*model.module, *ep);
  return held;
}

fsdp::plan::Plan plan_of(const Layout& l) {
  fsdp::plan::PlanConfig c;
  fsdp::plan::set_model(c, l.name, l.flavor);
  c.args.vocab_size = kVocab;
  c.replicate = l.replicate;
  c.shard = l.shard();
  c.tp = l.tp;
  c.ep = l.ep;
  c.pp = l.pp;
  c.cp = l.cp;
  c.seq_len = kSeq;
  c.local_batch = 2;
  c.keep_last_block_unsharded = true;  // fsdp-train's default reshard policy
  if (l.pp > 1) c.microbatches = 2;
  return fsdp::plan::make_plan(c);
}

int pp_rank_of(const Layout& l) {
  return fsdp::world()->rank() / (fsdp::world()->size() / static_cast<int>(l.pp));  // the pp dim is outermost
}

// The EP figures of the plan (docs/planner.md, "Communication of MoE blocks") against one counted step. Calls and
// the count exchange do not depend on the routing; the dispatch and combine bytes do: the plan assumes balanced
// routing (each of the T/tp x k rows a rank routes per MoE block and microbatch leaves it with probability
// (ep-1)/ep), so its bytes per moved row are checked against the rows this step's routing really moved.
void check_ep(const Layout& l, const fsdp::plan::Plan& p, const EpStep& ep) {
  if (l.pp > 1 && pp_rank_of(l) != p.pipeline.planned_rank) return;  // Plan::comm is the planned pp rank's
  const auto& cm = p.comm;
  const int64_t k = p.config.args.moe_options().top_k;
  const int64_t routed = ep.moe_layers * (2 * kSeq / l.cp / l.tp) * k;  // rows routed by this rank in the step
  const int64_t balanced = routed * (l.ep - 1) / l.ep;            // of which leave it under balanced routing
  ASSERT_GT(ep.moe_layers, 0);
  ASSERT_GT(ep.rows_moved, 0);  // tokens did cross ranks
  const int64_t rows_bytes = cm.ep_dispatch_bytes + cm.ep_combine_bytes;  // balanced x 2 directions x 2 passes
  ASSERT_EQ(rows_bytes % (2 * balanced), 0) << rows_bytes << " bytes for " << balanced << " rows each way";
  const int64_t per_row = rows_bytes / (2 * balanced);  // one row sent or received: forward and backward
  EXPECT_EQ(ep.stats.all_to_all_calls, cm.ep_all_to_all_calls);
  EXPECT_EQ(ep.stats.all_to_all_calls, 5 * ep.moe_layers * (l.pp > 1 ? 2 : 1));  // per block and microbatch
  EXPECT_EQ(ep.stats.bytes_sent, cm.ep_count_bytes + per_row * ep.rows_moved)
      << "counts " << cm.ep_count_bytes << " + " << per_row << " bytes x " << ep.rows_moved << " rows moved";
  // The group's mean: each moved row is sent by one rank and received by another, so at most every routed row
  // leaving (the bound); the plan's balanced figure is what a uniform router gives.
  EXPECT_LE(ep.group_mean_bytes, static_cast<double>(cm.ep_count_bytes + per_row * 2 * routed));
  EXPECT_GE(ep.group_mean_bytes, static_cast<double>(cm.ep_count_bytes));
  // One line per layout, from the first rank of the pp rank checked.
  const int per_pp = fsdp::world()->size() / static_cast<int>(l.pp);
  if (fsdp::world()->rank() == (l.pp > 1 ? p.pipeline.planned_rank * per_pp : 0)) {
    std::printf("[plan-vs-trainer] %s: ep all-to-all %lld calls, %lld bytes sent (plan: %lld calls, %lld bytes "
                "under balanced routing; the ep group's mean %.0f, %+.1f%% against the plan)\n",
                l.text().c_str(), static_cast<long long>(ep.stats.all_to_all_calls),
                static_cast<long long>(ep.stats.bytes_sent), static_cast<long long>(cm.ep_all_to_all_calls),
                static_cast<long long>(cm.ep_total_bytes), ep.group_mean_bytes,
                100 * (ep.group_mean_bytes / static_cast<double>(cm.ep_total_bytes) - 1));
  }
}

void check(const Layout& l) {
  SCOPED_TRACE(l.text());
  const fsdp::plan::Plan p = plan_of(l);
  const Held held = shard_for_real(l);
  const bool rank0 = fsdp::world()->rank() == 0;
  std::vector<fsdp::plan::GroupPlan> units = p.groups;
  if (l.pp > 1) {
    // This rank's stages only (pp rank = rank / (world / pp): the pp dim is outermost).
    units.clear();
    const int pp_rank = pp_rank_of(l);
    for (const auto& st : p.pipeline.stages) {
      if (st.rank != pp_rank) continue;
      units.insert(units.end(), st.groups.begin(), st.groups.end());
    }
  }
  ASSERT_EQ(held.units.size(), units.size());
  int64_t total = 0;
  for (const auto& g : units) {
    ASSERT_TRUE(held.units.count(g.name)) << g.name << " is planned but fsdp-train has no such unit";
    // Under PP each stage's first data-parallel rank holds the padded sizes the plan counts.
    const bool largest = l.pp > 1 ? fsdp::world()->rank() % (fsdp::world()->size() / l.pp) == 0 : rank0;
    if (largest) EXPECT_EQ(held.units.at(g.name), g.shard_numel) << g.name;
    else EXPECT_LE(held.units.at(g.name), g.shard_numel) << g.name;
    if (largest && g.expert_shard > 0) EXPECT_EQ(held.experts.at(g.name), g.expert_shard_numel) << g.name;
    total += held.units.at(g.name);
  }
  // Not vacuous: the layout actually split the model (each rank holds less than the whole), or, replicated
  // (DDP), every rank holds all of it.
  if (l.shard() * l.cp * l.tp * l.pp * l.ep > 1) EXPECT_LT(total, p.num_params);  // FSDP shards over shard x cp
  else EXPECT_EQ(total, p.num_params);
  EXPECT_GT(total, 0);
  // fsdp-train's start-up log line (its model's attention shape, attention_memory.h) gives the plan's attention
  // bytes per block (float32, 2 x kSeq tokens, under PP one of the 2 microbatches, under CP seq / cp of each
  // sequence; this rank's heads under TP).
  const fsdp_train::AttentionShape& s = held.attention;
  ASSERT_GT(s.heads, 0);
  const int64_t tokens = 2 * kSeq / (l.pp > 1 ? 2 : 1) / l.cp;
  const fsdp_train::AttentionMemory attention =
      fsdp_train::attention_memory({s.heads / l.tp, s.qk_head_dim, s.v_head_dim}, tokens, 4, l.cp, true);
  EXPECT_EQ(attention.saved, p.memory.attention_saved_per_layer);
  EXPECT_EQ(attention.backward_in_flight, p.memory.attention_backward_in_flight);
  EXPECT_EQ(p.memory.seq_per_rank, kSeq / l.cp);
  if (l.pp > 1) {
    // The MoE blocks' [E] buffers each stage holds (none for a dense model; under MoE fewer than the whole
    // model's: each stage counts its own blocks').
    int64_t whole = 0;
    for (const auto& st : p.pipeline.stages) whole += st.buffer_bytes;
    for (const auto& [stage, bytes] : held.stage_buffers) {
      const auto& st = p.pipeline.stages.at(static_cast<size_t>(stage));
      EXPECT_EQ(bytes, st.buffer_bytes) << "stage " << stage;
      if (l.name != "llama3") {  // an MoE model (Qwen3-MoE, DeepSeek-V3): each stage holds MoE blocks
        EXPECT_GT(bytes, 0) << "stage " << stage;
        EXPECT_LT(bytes, whole) << "stage " << stage;
      }
    }
    if (pp_rank_of(l) == p.pipeline.planned_rank) {
      int64_t mine = 0;
      for (const auto& [stage, bytes] : held.stage_buffers) mine += bytes;
      EXPECT_EQ(p.memory.buffers, mine);
    }
  }
  if (held.ep.stepped) check_ep(l, p, held.ep);
  if (held.tp_stepped) {
    // The TP dim's figures of the plan, less the loss's 3 all-reduces of [T] floats (T = 2 x kSeq / cp tokens).
    const auto& cm = p.comm;
    const int64_t T = 2 * kSeq / l.cp;
    const auto ar = [&](int64_t bytes) { return 2 * (l.tp - 1) * bytes / l.tp; };
    const int64_t loss_bytes = ar((T + 1) * 4) + 2 * ar(T * 4);
    EXPECT_GT(held.tp_bytes.bytes_sent, 0);
    EXPECT_EQ(held.tp_bytes.all_gather_calls, cm.tp_all_gather_calls);
    EXPECT_EQ(held.tp_bytes.reduce_scatter_calls, cm.tp_reduce_scatter_calls);
    EXPECT_EQ(held.tp_bytes.all_reduce_calls, cm.tp_all_reduce_calls - 3);
    EXPECT_EQ(held.tp_bytes.bytes_sent, cm.tp_total_bytes - loss_bytes)
        << "tp all-gather " << cm.tp_all_gather_bytes << " + reduce-scatter " << cm.tp_reduce_scatter_bytes
        << " + all-reduce " << cm.tp_all_reduce_bytes << " (loss " << loss_bytes << ")";
  }
  if (!held.stepped) return;
  // The bytes: every rank sends the same (padded shards, equal slots), so every rank checks.
  const auto& cm = p.comm;
  EXPECT_GT(held.fsdp_bytes.bytes_sent, 0);
  EXPECT_EQ(held.fsdp_bytes.bytes_sent, cm.total_bytes)
      << "all-gather " << cm.all_gather_bytes << " + reduce-scatter " << cm.reduce_scatter_bytes << " + all-reduce "
      << cm.all_reduce_bytes;
  EXPECT_EQ(held.fsdp_bytes.all_gather_calls, cm.all_gather_calls);
  EXPECT_EQ(held.fsdp_bytes.reduce_scatter_calls, cm.reduce_scatter_calls);
  EXPECT_EQ(held.fsdp_bytes.all_reduce_calls, cm.all_reduce_calls);
}

bool two() { return fsdp::world()->size() == 2; }
bool four() { return fsdp::world()->size() == 4; }

}  // namespace

TEST(PlanShardsVsTrainer, DataParallel) { check({"llama3", "cpu_tiny"}); }
TEST(PlanShardsVsTrainer, ReplicateOnly) {
  if (!two()) GTEST_SKIP() << "2 ranks";
  check({"llama3", "cpu_tiny", /*replicate=*/2});
}
TEST(PlanShardsVsTrainer, Hsdp) {
  if (!four()) GTEST_SKIP() << "4 ranks";
  check({"llama3", "cpu_tiny", /*replicate=*/2});
}
TEST(PlanShardsVsTrainer, TensorParallel) { check({"llama3", "cpu_tiny", 1, /*tp=*/2}); }
// TP bytes of Qwen3: the q_norm / k_norm gradient all-reduces; of Qwen3-MoE: an MoE block's collectives (attention
// only) and its router gate's all-reduce.
TEST(PlanShardsVsTrainer, TensorParallelQwen3) { check({"qwen3", "cpu_tiny", 1, /*tp=*/2}); }
TEST(PlanShardsVsTrainer, MoETensorParallel) { check({"qwen3", "cpu_tiny_moe", 1, /*tp=*/2}); }
TEST(PlanShardsVsTrainer, Pipeline) { check({"llama3", "cpu_tiny", 1, 1, 1, /*pp=*/2}); }
TEST(PlanShardsVsTrainer, ExpertParallel) { check({"qwen3", "cpu_tiny_moe", 1, 1, /*ep=*/2}); }
TEST(PlanShardsVsTrainer, MoEWithoutExpertParallel) { check({"qwen3", "cpu_tiny_moe"}); }
TEST(PlanShardsVsTrainer, MoETensorParallelWithExpertParallel) {
  if (!four()) GTEST_SKIP() << "4 ranks";
  check({"qwen3", "cpu_tiny_moe", 1, /*tp=*/2, /*ep=*/2});
}
TEST(PlanShardsVsTrainer, MoEPipelineWithExpertParallel) {
  if (!four()) GTEST_SKIP() << "4 ranks";
  check({"qwen3", "cpu_tiny_moe", 1, 1, /*ep=*/2, /*pp=*/2});
}
// MoE with pipeline and tensor parallelism together (pp 2 x tp 2, EP 2 borrowing the TP ranks): each stage's TP
// shards and its experts' placement equal the trainer's.
TEST(PlanShardsVsTrainer, MoEPipelineWithTensorAndExpertParallel) {
  if (!four()) GTEST_SKIP() << "4 ranks";
  check({"qwen3", "cpu_tiny_moe", 1, /*tp=*/2, /*ep=*/2, /*pp=*/2});
}
// Pipeline and context parallelism together (pp 2 x cp 2): each stage's FSDP over dp_shard x cp, a microbatch's
// attention at seq / cp on each rank.
TEST(PlanShardsVsTrainer, PipelineWithContextParallel) {
  if (!four()) GTEST_SKIP() << "4 ranks";
  check({"llama3", "cpu_tiny", 1, 1, 1, /*pp=*/2, /*cp=*/2});
}
// MoE with context parallelism and EP borrowing the cp ranks (cp 2 x ep 2 on 2 ranks, dp_shard 1): the experts'
// placement, FSDP over dp_shard x cp, the EP all-to-alls of a real step on this rank's seq / cp tokens.
TEST(PlanShardsVsTrainer, MoEContextParallelWithExpertParallel) {
  if (!two()) GTEST_SKIP() << "2 ranks";
  check({"qwen3", "cpu_tiny_moe", 1, 1, /*ep=*/2, 1, /*cp=*/2});
}

// DeepSeek-V3 (cpu_tiny: 3 layers, the first dense, then MoE blocks of 8 routed experts, a shared expert, top-2
// over 4 expert groups of which 2 are kept; MLA with q LoRA) through the same seam: its shards in every layout the
// trainer runs, the FSDP bytes of the data-parallel ones, the EP all-to-alls of the expert-parallel ones (routing
// group-limited: the rows counted are those the step really moved), the MoE buffers of each pipeline stage.
// pp x cp too (the stages' MLA through the ring, FSDP over dp_shard x cp in each stage).
TEST(PlanShardsVsTrainer, DeepSeekV3DataParallel) { check({"deepseek_v3", "cpu_tiny"}); }
TEST(PlanShardsVsTrainer, DeepSeekV3ExpertParallel) { check({"deepseek_v3", "cpu_tiny", 1, 1, /*ep=*/2}); }
TEST(PlanShardsVsTrainer, DeepSeekV3TensorParallel) { check({"deepseek_v3", "cpu_tiny", 1, /*tp=*/2}); }
TEST(PlanShardsVsTrainer, DeepSeekV3Pipeline) {
  if (!two()) GTEST_SKIP() << "2 ranks";
  check({"deepseek_v3", "cpu_tiny", 1, 1, 1, /*pp=*/2});
}
TEST(PlanShardsVsTrainer, DeepSeekV3ContextParallel) {
  if (!two()) GTEST_SKIP() << "2 ranks";
  check({"deepseek_v3", "cpu_tiny", 1, 1, 1, 1, /*cp=*/2});
}
TEST(PlanShardsVsTrainer, DeepSeekV3ContextParallelWithExpertParallel) {
  if (!two()) GTEST_SKIP() << "2 ranks";
  check({"deepseek_v3", "cpu_tiny", 1, 1, /*ep=*/2, 1, /*cp=*/2});
}
TEST(PlanShardsVsTrainer, DeepSeekV3TensorParallelWithExpertParallel) {
  if (!four()) GTEST_SKIP() << "4 ranks";
  check({"deepseek_v3", "cpu_tiny", 1, /*tp=*/2, /*ep=*/2});
}
TEST(PlanShardsVsTrainer, DeepSeekV3PipelineWithExpertParallel) {
  if (!four()) GTEST_SKIP() << "4 ranks";
  check({"deepseek_v3", "cpu_tiny", 1, 1, /*ep=*/2, /*pp=*/2});
}
TEST(PlanShardsVsTrainer, DeepSeekV3PipelineWithTensorParallel) {
  if (!four()) GTEST_SKIP() << "4 ranks";
  check({"deepseek_v3", "cpu_tiny", 1, /*tp=*/2, 1, /*pp=*/2});
}
TEST(PlanShardsVsTrainer, DeepSeekV3PipelineWithTensorAndExpertParallel) {
  if (!four()) GTEST_SKIP() << "4 ranks";
  check({"deepseek_v3", "cpu_tiny", 1, /*tp=*/2, /*ep=*/2, /*pp=*/2});
}
TEST(PlanShardsVsTrainer, DeepSeekV3ContextParallelWithTensorParallel) {
  if (!four()) GTEST_SKIP() << "4 ranks";
  check({"deepseek_v3", "cpu_tiny", 1, /*tp=*/2, 1, 1, /*cp=*/2});
}
TEST(PlanShardsVsTrainer, DeepSeekV3PipelineWithContextParallel) {
  if (!four()) GTEST_SKIP() << "4 ranks";
  check({"deepseek_v3", "cpu_tiny", 1, 1, 1, /*pp=*/2, /*cp=*/2});
}
