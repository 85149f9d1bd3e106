// Pipeline parallelism composed with fully_shard, against single-process training of the whole model on the
// whole global batch (fp32, 1e-5: loss, clipped global grad norm every step, and every parameter at the end),
// for every schedule, at pp = world (2 or 4 ranks) and pp 2 x dp_shard 2 (4 ranks). Also: one all-gather and one
// reduce-scatter per FSDP group per step whatever the number of microbatches (counted on the dp group), P2P
// bytes = the analytic activation and gradient sizes, zero-bubble = its 1F1B counterpart within 1e-6, the
// split backward really ran (I and W actions), and bad configurations are refused with the reason.
#include "comm/dist_env.h"
#include "expect_error.h"

#include <fsdp/clip_grad.h>
#include <fsdp/comm_stats.h>
#include <fsdp/device_mesh.h>
#include <fsdp/fully_shard.h>
#include <fsdp/nn/module_call.h>
#include <fsdp/pipeline.h>
#include <fsdp/pipeline/schedule.h>
#include <fsdp/state_dict.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

namespace {

constexpr int64_t kDim = 16, kLayers = 8, kGlobalBatch = 32, kSteps = 3;
constexpr double kMaxNorm = 0.1;  // low enough that clipping acts (checked on the reference)

// A chain of Linear + tanh layers kept in a ModuleDict keyed by the layer number, so a stage holding layers
// 4..7 names them "layers.4" ... "layers.7", as in the whole model (TorchTitan's split keeps FQNs).
struct ChainImpl : torch::nn::Module {
  explicit ChainImpl(const std::vector<std::pair<std::string, torch::nn::Linear>>& kept) {
    layers = register_module("layers", torch::nn::ModuleDict());
    for (const auto& [name, layer] : kept) layers->update({{name, layer.ptr()}});
  }
  torch::Tensor forward(torch::Tensor x) {
    for (const auto& item : layers->items()) x = torch::tanh(fsdp::nn::call(item.second->as<torch::nn::Linear>(), x));
    return x;
  }
  torch::nn::ModuleDict layers{nullptr};
};
TORCH_MODULE(Chain);

std::vector<std::pair<std::string, torch::nn::Linear>> make_layers(int64_t first, int64_t last) {
  torch::manual_seed(11);
  std::vector<std::pair<std::string, torch::nn::Linear>> all;
  for (int64_t i = 0; i < kLayers; ++i) all.emplace_back(std::to_string(i), torch::nn::Linear(kDim, kDim));
  return {all.begin() + first, all.begin() + last};
}

std::pair<torch::Tensor, torch::Tensor> global_batch(int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  return {torch::randn({kGlobalBatch, kDim}, gen), torch::randn({kGlobalBatch, kDim}, gen) * 0.5};
}

struct Trace {
  std::vector<double> losses, norms;
  std::map<std::string, torch::Tensor> params;
  std::map<std::string, torch::Tensor> initial;
};

Trace train_reference() {
  Chain model(make_layers(0, kLayers));
  Trace t;
  for (const auto& p : model->named_parameters()) t.initial[p.key()] = p.value().detach().clone();
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step);
    optim.zero_grad();
    auto loss = torch::mse_loss(model(x), y);
    loss.backward();
    t.losses.push_back(loss.item<double>());
    t.norms.push_back(torch::nn::utils::clip_grad_norm_(model->parameters(), kMaxNorm));
    optim.step();
  }
  for (const auto& p : model->named_parameters()) t.params[p.key()] = p.value().detach().clone();
  return t;
}

struct Layout {
  int64_t pp = 1, dp = 1;
};

struct PipelineRun {
  Trace trace;
  std::vector<fsdp::CommStats> dp_steps, pp_steps;  // per step, this rank
  int64_t fsdp_groups = 0;                          // parameter groups on this rank
  std::vector<std::string> timeline;                // last step's actions
  std::vector<int> stages;
  int64_t microbatch_rows = 0;
};

// `prebuilt`: the Pipeline is given the schedule the stages were placed by (the trainer's way) instead of its name.
PipelineRun train_pipeline(const Layout& layout, const std::string& schedule, int microbatches,
                           bool prebuilt = false) {
  auto world = fsdp_test::test_world();
  auto mesh = fsdp::init_device_mesh("cpu", {layout.pp, layout.dp}, {"pp", "dp"});
  auto pp_group = mesh.group("pp");
  auto dp_group = mesh.group("dp");
  const auto kind = fsdp::pipeline::parse_schedule_name(schedule);
  const int v = fsdp::pipeline::default_stages_per_rank(kind);
  const int num_stages = static_cast<int>(layout.pp) * v;
  const int64_t per_stage = kLayers / num_stages;

  fsdp::PipelineOptions options;
  options.schedule = schedule;
  options.microbatches = microbatches;
  options.num_stages = num_stages;
  const auto plan = fsdp::pipeline::build_schedule(
      {kind, static_cast<int>(layout.pp), v, microbatches});
  PipelineRun run;
  run.stages = plan.stages_of_rank(pp_group->rank());
  std::vector<fsdp::PipelineStage> stages;
  std::vector<Chain> parts;
  for (int s : run.stages) {
    Chain part(make_layers(s * per_stage, (s + 1) * per_stage));
    if (layout.dp > 1) {
      fsdp::FullyShardOptions opts;
      opts.mesh = mesh["dp"];
      opts.reshard_after_forward = false;  // TorchTitan's choice under PP
      for (const auto& item : part->layers->items()) fsdp::fully_shard(item.second, opts);
      fsdp::fully_shard(part, opts);
      run.fsdp_groups += static_cast<int64_t>(part->layers->size());
    }
    parts.push_back(part);
    stages.push_back({s, part.ptr(), [part](const at::Tensor& x) { return fsdp::nn::call(part, x); }});
  }
  const int64_t local_batch = kGlobalBatch / layout.dp;
  run.microbatch_rows = local_batch / microbatches;
  // Each microbatch's share of this rank's mean loss; FSDP averages over dp: the global batch's mean.
  auto loss_fn = [local_batch](const at::Tensor& out, const at::Tensor& target) {
    return (out - target).pow(2).sum() / static_cast<double>(local_batch * kDim);
  };
  fsdp::Pipeline pipe = prebuilt ? fsdp::Pipeline(std::move(stages), pp_group, loss_fn, plan)
                                 : fsdp::Pipeline(std::move(stages), pp_group, loss_fn, options);
  EXPECT_EQ(pipe.schedule().actions, plan.actions);
  std::vector<std::shared_ptr<torch::nn::Module>> modules = pipe.modules();
  std::vector<torch::Tensor> params;
  for (const auto& m : modules) {
    for (const auto& p : m->parameters()) params.push_back(p);
  }
  torch::optim::SGD optim(params, torch::optim::SGDOptions(0.05).momentum(0.9));
  const int64_t d = dp_group->rank();
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step);
    x = x.narrow(0, d * local_batch, local_batch);
    y = y.narrow(0, d * local_batch, local_batch);
    optim.zero_grad();
    fsdp::reset_comm_stats(*dp_group);
    fsdp::reset_comm_stats(*pp_group);
    auto result = pipe.step(x, y);
    run.dp_steps.push_back(fsdp::comm_stats(*dp_group));
    run.pp_steps.push_back(fsdp::comm_stats(*pp_group));
    // The loss lives on the last stage's ranks: average over dp there, then hand it to every pp rank.
    auto loss = torch::tensor({result.loss_sum()}, torch::kDouble);
    dp_group->all_reduce(loss, fsdp::ReduceOp::Avg).wait();
    const int last_rank = plan.stage_to_rank.back();
    pp_group->broadcast(loss, last_rank).wait();
    run.trace.losses.push_back(loss.item<double>());
    run.trace.norms.push_back(fsdp::clip_grad_norm_(modules, kMaxNorm, 2.0, pp_group).item<double>());
    optim.step();
  }
  for (const auto& span : pipe.last_step_timeline()) run.timeline.push_back(span.action);
  for (auto& part : parts) {
    auto full = layout.dp > 1 ? fsdp::full_state_dict(*part, {/*cpu_offload=*/true, /*rank0_only=*/false})
                              : std::map<std::string, torch::Tensor>{};
    if (layout.dp == 1) {
      for (const auto& p : part->named_parameters()) full[p.key()] = p.value().detach().clone();
    }
    for (auto& [k, val] : full) run.trace.params[k] = val;
  }
  return run;
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-12); }

void expect_parity(const Layout& layout, const std::string& schedule, int microbatches, const Trace& ref) {
  SCOPED_TRACE(schedule + " pp " + std::to_string(layout.pp) + " x dp " + std::to_string(layout.dp) + ", " +
               std::to_string(microbatches) + " microbatches");
  const PipelineRun run = train_pipeline(layout, schedule, microbatches);
  for (int64_t s = 0; s < kSteps; ++s) {
    EXPECT_LT(rel(run.trace.losses[s], ref.losses[s]), 1e-5) << "loss, step " << s;
    EXPECT_LT(rel(run.trace.norms[s], ref.norms[s]), 1e-5) << "grad norm, step " << s;
  }
  EXPECT_FALSE(run.trace.params.empty());
  for (const auto& [fqn, w] : run.trace.params) {
    ASSERT_TRUE(ref.params.count(fqn)) << fqn;
    const auto& want = ref.params.at(fqn);
    EXPECT_LT((w - want).abs().max().item<double>() / want.abs().max().item<double>(), 1e-5) << fqn;
  }
  // Collectives per step (a steady one): one all-gather and one reduce-scatter per FSDP group.
  if (layout.dp > 1) {
    for (int64_t s = 1; s < kSteps; ++s) {
      EXPECT_EQ(run.dp_steps[s].all_gather_calls, run.fsdp_groups) << "step " << s;
      EXPECT_EQ(run.dp_steps[s].reduce_scatter_calls, run.fsdp_groups) << "step " << s;
    }
  }
  // P2P bytes (steady step, no shape headers): one activation per microbatch to each remote next stage, one
  // gradient per microbatch to each remote previous stage.
  const auto plan = fsdp::pipeline::build_schedule(
      {fsdp::pipeline::parse_schedule_name(schedule), static_cast<int>(layout.pp),
       fsdp::pipeline::default_stages_per_rank(fsdp::pipeline::parse_schedule_name(schedule)), microbatches});
  const int me = plan.stage_to_rank[run.stages.front()];
  int64_t sends = 0;
  for (int s : run.stages) {
    if (s + 1 < plan.num_stages && plan.stage_to_rank[s + 1] != me) sends += microbatches;
    if (s > 0 && plan.stage_to_rank[s - 1] != me) sends += microbatches;
  }
  const int64_t bytes = run.microbatch_rows * kDim * 4;
  EXPECT_EQ(run.pp_steps.back().p2p_bytes_sent, sends * bytes);
  EXPECT_EQ(run.pp_steps.back().send_calls, sends);
  EXPECT_EQ(run.pp_steps.back().p2p_bytes_received, sends * bytes);  // symmetric: what goes out comes back
  // The split backward ran where the schedule asks for it.
  // (DualPipeV splits the backward of its warm-up and drain microbatches.)
  const bool zero_bubble = schedule.find("ZeroBubble") != std::string::npos || schedule == "DualPipeV";
  const bool has_w = std::any_of(run.timeline.begin(), run.timeline.end(),
                                 [](const std::string& a) { return a.find('W') != std::string::npos; });
  EXPECT_EQ(has_w, zero_bubble);
  // DualPipeV ran its overlapped forward-backward pairs (each one action of the timeline).
  const bool has_overlap = std::any_of(run.timeline.begin(), run.timeline.end(),
                                       [](const std::string& a) { return a.find("OVERLAP_F_B") != std::string::npos; });
  EXPECT_EQ(has_overlap, schedule == "DualPipeV");
}

class Pipelines : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    reference_ = train_reference();
    bool moved = false;
    for (const auto& [fqn, w] : reference_.params) moved = moved || !torch::allclose(w, reference_.initial.at(fqn));
    ASSERT_TRUE(moved) << "the reference did not train";
    ASSERT_GT(*std::max_element(reference_.norms.begin(), reference_.norms.end()), kMaxNorm)
        << "clipping never acted in the reference";
  }
  static Trace reference_;
};
Trace Pipelines::reference_;

const std::vector<std::string> kSchedules = {"GPipe", "1F1B", "LoopedBFS", "Interleaved1F1B",
                                             "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"};

TEST_F(Pipelines, EveryScheduleEqualsSingleProcessAtPpEqualWorld) {
  const int64_t n = fsdp_test::test_world()->size();
  for (const auto& schedule : kSchedules) expect_parity({n, 1}, schedule, static_cast<int>(2 * n), reference_);
}

TEST_F(Pipelines, EveryScheduleWithFullyShardPp2Dp2) {
  const int64_t n = fsdp_test::test_world()->size();
  if (n != 4) GTEST_SKIP() << "needs 4 ranks";
  for (const auto& schedule : kSchedules) expect_parity({2, 2}, schedule, 4, reference_);
}

TEST_F(Pipelines, ZeroBubbleEqualsItsOneFOneBWithin1e6) {
  const int64_t n = fsdp_test::test_world()->size();
  const PipelineRun a = train_pipeline({n, 1}, "Interleaved1F1B", static_cast<int>(2 * n));
  const PipelineRun b = train_pipeline({n, 1}, "InterleavedZeroBubble", static_cast<int>(2 * n));
  for (const auto& [fqn, w] : a.trace.params) {
    EXPECT_LE((b.trace.params.at(fqn) - w).abs().max().item<double>(), 1e-6) << fqn;
  }
}

// The trainer hands the Pipeline the schedule its stages were placed by (built once): every schedule trains exactly as
// when the Pipeline builds it from the name, and as one process.
TEST_F(Pipelines, APrebuiltScheduleTrainsAsTheNamedOne) {
  const int64_t n = fsdp_test::test_world()->size();
  for (const auto& schedule : kSchedules) {
    SCOPED_TRACE(schedule);
    const PipelineRun named = train_pipeline({n, 1}, schedule, static_cast<int>(2 * n));
    const PipelineRun prebuilt = train_pipeline({n, 1}, schedule, static_cast<int>(2 * n), /*prebuilt=*/true);
    EXPECT_EQ(prebuilt.timeline, named.timeline);
    EXPECT_EQ(prebuilt.trace.losses, named.trace.losses);
    ASSERT_FALSE(named.trace.params.empty());
    for (const auto& [fqn, w] : named.trace.params) EXPECT_TRUE(torch::equal(prebuilt.trace.params.at(fqn), w)) << fqn;
    // ... and it trained: the weights moved from the reference's initial ones.
    const auto& [fqn, w] = *named.trace.params.begin();
    EXPECT_FALSE(torch::equal(w, reference_.initial.at(fqn))) << fqn;
  }
}

TEST_F(Pipelines, BadConfigurationsAreRefusedWithTheReason) {
  auto world = fsdp_test::test_world();
  const auto expect_error = fsdp_test::expect_error_containing<c10::Error>;
  auto loss = [](const at::Tensor& o, const at::Tensor& t) { return (o - t).pow(2).sum(); };
  const int n = world->size();
  Chain part(make_layers(0, 1));
  auto fwd = [part](const at::Tensor& x) { return fsdp::nn::call(part, x); };
  fsdp::PipelineOptions few;
  few.schedule = "1F1B";
  few.microbatches = n - 1;  // 1F1B needs at least as many microbatches as stages
  expect_error([&] { fsdp::Pipeline(std::vector<fsdp::PipelineStage>{{world->rank(), part.ptr(), fwd}}, world, loss, few); },
               "microbatch");
  fsdp::PipelineOptions wrong_stage;
  wrong_stage.microbatches = n;
  expect_error([&] { fsdp::Pipeline(std::vector<fsdp::PipelineStage>{{(world->rank() + 1) % n, part.ptr(), fwd}}, world, loss, wrong_stage); },
               "places stages");
  fsdp::PipelineOptions odd;
  odd.microbatches = n;
  odd.num_stages = 2 * n + 1;
  expect_error([&] { fsdp::Pipeline(std::vector<fsdp::PipelineStage>{{world->rank(), part.ptr(), fwd}}, world, loss, odd); },
               "evenly");
  // A schedule built for another number of pipeline ranks than the group's.
  const auto other_pp = fsdp::pipeline::build_schedule({fsdp::pipeline::ScheduleKind::GPipe, n + 1, 1, n + 1});
  expect_error([&] { fsdp::Pipeline(std::vector<fsdp::PipelineStage>{{world->rank(), part.ptr(), fwd}}, world, loss, other_pp); },
               "schedule was built for " + std::to_string(n + 1) + " pipeline ranks, but the pipeline group has " +
                   std::to_string(n));
  expect_error([&] { fsdp::PipelineOptions o; o.schedule = "2F2B"; o.microbatches = n;
                     fsdp::Pipeline(std::vector<fsdp::PipelineStage>{{world->rank(), part.ptr(), fwd}}, world, loss, o); },
               "2F2B");
}

}  // namespace
