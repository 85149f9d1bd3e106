// Our side of the pipeline side-by-side against torch.distributed.pipelining + FSDP2 (bench/pipeline/run.py
// drives both; pp_torch.py is the torch side, with the same flags and the same output line).
//
//   fsdprun --nproc-per-node W fsdp-bench-pp --pp P --dp D --schedule 1F1B --microbatches M [--dim 256 --layers 8
//           --global-batch 256 --steps 20 --warmup 3 --lr 0.5 --momentum 0.9]
//
// Mesh (pp, dp) over the W = P x D ranks; a chain of L Linear(D, D) + tanh layers in a ModuleDict keyed by the
// global layer number, split evenly over pp x v stages (the schedule's stage -> rank map); with dp > 1 every layer
// and every stage part is fully_shard'ed over dp with reshard_after_forward = false (TorchTitan under PP). The
// initial weights and the batches are the closed forms of model_init.py, spelled with the same torch ops in
// float64 and cast to float32 (layer_params, step_batch), so both sides hold the same numbers. Loss of a
// microbatch = its summed squared error / (local batch x D); fully_shard averages over dp. SGD with momentum.
//
// Rank 0 prints one line `PPBENCH {json}`: per-step losses (sum of microbatch losses, averaged over dp, handed
// from the last stage to every pp rank), per-step times (max over ranks of zero_grad + Pipeline::step +
// optimizer step, after a barrier), their median after the warm-up; and the bubble: per rank, the idle time of
// the last step (its span from first to last action of last_step_timeline() minus its compute in F/B/I/W; the
// runtime's F/B/I spans include waiting for a received input or gradient and for the all-gather, which are
// excluded here by noting when the stage forward is really called and when the backward reaches the stage
// output, so those waits count as idle) next to
// the simulator's idle for the same pp rank (fsdp::pipeline::simulate on this schedule with the mean measured
// F, B, I, W, UNSHARD, RESHARD and REDUCE_GRAD durations over all ranks and timed steps; P2P latency 0).
#include "../vs_pytorch/bench_util.h"

#include <fsdp/device_mesh.h>
#include <fsdp/fully_shard.h>
#include <fsdp/nn/module_call.h>
#include <fsdp/pipeline.h>
#include <fsdp/pipeline/schedule.h>
#include <fsdp/process_group.h>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace pl = fsdp::pipeline;

struct Options {
  int64_t pp = 1, dp = 1;
  std::string schedule = "1F1B";
  int microbatches = 8;
  int64_t dim = 256, layers = 8, global_batch = 256, steps = 20, warmup = 3;
  double lr = 0.5, momentum = 0.9;
};

// model_init.py's layer_params, op for op: weight[i, j] = sin(0.37 i + 0.11 j + 0.013 i j + 1.3 k) / sqrt(dim),
// bias[i] = 0.1 cos(0.23 i + 0.7 k), in float64, then float32.
std::pair<at::Tensor, at::Tensor> layer_params(int64_t k, int64_t dim) {
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  auto i = at::arange(dim, f64).unsqueeze(1);
  auto j = at::arange(dim, f64).unsqueeze(0);
  auto w = at::sin(i * 0.37 + j * 0.11 + (i * j) * 0.013 + 1.3 * static_cast<double>(k)) *
           (1.0 / std::sqrt(static_cast<double>(dim)));
  auto b = at::cos(at::arange(dim, f64) * 0.23 + 0.7 * static_cast<double>(k)) * 0.1;
  return {w.to(at::kFloat), b.to(at::kFloat)};
}

// model_init.py's step_batch: the step's global inputs and targets.
std::pair<at::Tensor, at::Tensor> step_batch(int64_t step, int64_t global_batch, int64_t dim) {
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  auto b = at::arange(global_batch, f64).unsqueeze(1);
  auto d = at::arange(dim, f64).unsqueeze(0);
  auto x = at::sin(b * 0.71 + d * 0.29 + (b * d) * 0.017 + 0.5 * static_cast<double>(step));
  auto y = at::cos(b * 0.43 + d * 0.19 + (b * d) * 0.007 + 0.3 * static_cast<double>(step)) * 0.5;
  return {x.to(at::kFloat), y.to(at::kFloat)};
}

// Layers [first, last) kept under their global numbers, so FQNs are layers.K.* on every stage.
struct ChainImpl : torch::nn::Module {
  ChainImpl(int64_t first, int64_t last, int64_t dim) {
    layers = register_module("layers", torch::nn::ModuleDict());
    torch::NoGradGuard no_grad;
    for (int64_t k = first; k < last; ++k) {
      torch::nn::Linear lin(dim, dim);
      auto [w, b] = layer_params(k, dim);
      lin->weight.copy_(w);
      lin->bias.copy_(b);
      layers->update({{std::to_string(k), lin.ptr()}});
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (const auto& item : layers->items()) x = at::tanh(fsdp::nn::call(item.second->as<torch::nn::Linear>(), x));
    return x;
  }
  torch::nn::ModuleDict layers{nullptr};
};
TORCH_MODULE(Chain);

using Clock = std::chrono::steady_clock;
double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// When each stage's forward started and when each backward reached the stage output, in this rank's last step.
struct ComputeEvents {
  std::vector<std::pair<int, Clock::time_point>> forward, backward;
  void clear() {
    forward.clear();
    backward.clear();
  }
  // The first event of `stage` inside [start, end]; `end` when none (e.g. the first stage's empty I).
  static Clock::time_point first_in(const std::vector<std::pair<int, Clock::time_point>>& list, int stage,
                                    Clock::time_point start, Clock::time_point end) {
    for (const auto& [s, t] : list) {
      if (s == stage && t >= start && t <= end) return t;
    }
    return end;
  }
};

// Index of an action type in the per-type cost accumulators.
enum CostKind { kF, kB, kI, kW, kUnshard, kReshard, kReduceGrad, kNumCostKinds };
int cost_kind(pl::ActionType t) {
  switch (t) {
    case pl::ActionType::Forward: return kF;
    case pl::ActionType::Backward: return kB;
    case pl::ActionType::BackwardInput: return kI;
    case pl::ActionType::BackwardWeight: return kW;
    case pl::ActionType::Unshard: return kUnshard;
    case pl::ActionType::Reshard: return kReshard;
    case pl::ActionType::ReduceGrad: return kReduceGrad;
    default: return -1;  // P2P: not a cost of the simulator (latency 0)
  }
}

template <typename T>
std::string json_array(const std::vector<T>& v) {
  std::ostringstream s;
  s << "[";
  for (size_t k = 0; k < v.size(); ++k) s << (k ? ", " : "") << bench::fmt(static_cast<double>(v[k]));
  s << "]";
  return s.str();
}

int run(const Options& o) {
  // A CPU benchmark (the torch side is Gloo on CPU too): Gloo whatever the build, so a CUDA libtorch on a one-GPU
  // machine does not pick NCCL and hand ranks 1..3 devices cuda:1..3 that are not there.
  fsdp::InitOptions init;
  init.backend = "gloo";
  auto world = fsdp::init_process_group(init);
  const int rank = world->rank(), W = world->size();
  TORCH_CHECK(o.pp * o.dp == W, "fsdp-bench-pp: --pp ", o.pp, " x --dp ", o.dp, " != world size ", W);
  TORCH_CHECK(o.global_batch % o.dp == 0 && (o.global_batch / o.dp) % o.microbatches == 0, "fsdp-bench-pp: global batch ",
              o.global_batch, " must split evenly over dp ", o.dp, " and then over ", o.microbatches, " microbatches");
  const auto kind = pl::parse_schedule_name(o.schedule);
  const int v = pl::default_stages_per_rank(kind);
  const int num_stages = static_cast<int>(o.pp) * v;
  TORCH_CHECK(o.layers % num_stages == 0, "fsdp-bench-pp: ", o.layers, " layers do not split evenly over ", num_stages,
              " stages (pp ", o.pp, " x ", v, " per rank for ", o.schedule, ")");
  const int64_t per_stage = o.layers / num_stages;

  auto mesh = fsdp::init_device_mesh("cpu", {o.pp, o.dp}, {"pp", "dp"});
  auto pp_group = mesh.group("pp");
  auto dp_group = mesh.group("dp");
  const int pp_rank = pp_group->rank(), dp_rank = dp_group->rank();

  fsdp::PipelineOptions popts;
  popts.schedule = o.schedule;
  popts.microbatches = o.microbatches;
  popts.num_stages = num_stages;
  const auto plan = pl::build_schedule({kind, static_cast<int>(o.pp), v, o.microbatches});
  auto events = std::make_shared<ComputeEvents>();
  std::vector<fsdp::PipelineStage> stages;
  for (int s : plan.stages_of_rank(pp_rank)) {
    Chain part(s * per_stage, (s + 1) * per_stage, o.dim);
    if (o.dp > 1) {  // TorchTitan applies FSDP only when dp_shard > 1; so does pp_torch.py
      fsdp::FullyShardOptions fs;
      fs.mesh = mesh["dp"];
      fs.reshard_after_forward = false;
      for (const auto& item : part->layers->items()) fsdp::fully_shard(item.second, fs);
      fsdp::fully_shard(part, fs);
    }
    // The runtime's action spans include the waits for a received input or gradient and for the all-gather
    // (inside F/B/I). To measure compute alone, note when the stage's forward really starts and when the
    // backward reaches its output (a hook on the output, which the B/I backward starts from).
    stages.push_back({s, part.ptr(), [part, events, s](const at::Tensor& x) {
                        events->forward.push_back({s, Clock::now()});
                        at::Tensor out = fsdp::nn::call(part, x);
                        if (out.requires_grad()) {
                          out.register_hook([events, s](const at::Tensor&) { events->backward.push_back({s, Clock::now()}); });
                        }
                        return out;
                      }});
  }
  const int64_t local_batch = o.global_batch / o.dp;
  const double denom = static_cast<double>(local_batch * o.dim);
  auto loss_fn = [denom](const at::Tensor& out, const at::Tensor& target) {
    return (out - target).pow(2).sum() / denom;  // this microbatch's share of the dp rank's mean
  };
  fsdp::Pipeline pipe(std::move(stages), pp_group, loss_fn, popts);
  std::vector<at::Tensor> params;
  for (const auto& m : pipe.modules()) {
    for (const auto& p : m->parameters()) params.push_back(p);
  }
  torch::optim::SGD optim(params, torch::optim::SGDOptions(o.lr).momentum(o.momentum));
  const int last_rank = pipe.schedule().stage_to_rank.back();
  const int64_t warmup = o.steps > o.warmup ? o.warmup : 0;

  std::vector<double> losses, times;
  // Per action kind, over the timed steps of this rank: summed duration and count (the simulator's costs).
  auto cost_sums = at::zeros({2, kNumCostKinds}, at::kDouble);
  double idle_last = 0, span_last = 0, busy_last = 0, wait_last = 0;
  for (int64_t step = 0; step < o.steps; ++step) {
    auto [x, y] = step_batch(step, o.global_batch, o.dim);
    x = x.narrow(0, dp_rank * local_batch, local_batch).contiguous();
    y = y.narrow(0, dp_rank * local_batch, local_batch).contiguous();
    world->barrier().wait();  // every step starts together (as on the torch side)
    const auto t0 = std::chrono::steady_clock::now();
    optim.zero_grad();
    events->clear();
    auto result = pipe.step(x, y);
    optim.step();
    times.push_back(seconds(std::chrono::steady_clock::now() - t0));

    auto loss = at::tensor({result.loss_sum()}, at::kDouble);
    dp_group->all_reduce(loss, fsdp::ReduceOp::Avg).wait();
    pp_group->broadcast(loss, last_rank).wait();
    losses.push_back(loss.item<double>());

    // Compute time of each F/B/I/W = from its real start (forward called; backward at the stage output; the last
    // stage's B/I and every W wait for nothing) to the action's end. Idle = the step's span minus compute.
    const auto& timeline = pipe.last_step_timeline();
    TORCH_CHECK(!timeline.empty(), "fsdp-bench-pp: the pipeline recorded no actions for step ", step);
    double busy = 0, waits = 0;
    auto first = timeline.front().start, last = timeline.front().end;
    for (const auto& span : timeline) {
      const auto action = pl::Action::parse(span.action);
      first = std::min(first, span.start);
      last = std::max(last, span.end);
      auto start = span.start;
      if (action.type == pl::ActionType::Forward) {
        start = ComputeEvents::first_in(events->forward, action.stage, span.start, span.end);
      } else if (action.type == pl::ActionType::OverlapFB && action.sub_actions.front().type == pl::ActionType::Forward) {
        // DualPipeV's pair runs its forward first: busy from the forward's real start to the backward's end (a wait
        // between the parts counts as busy; the pair's parts are not in the per-type means below).
        start = ComputeEvents::first_in(events->forward, action.sub_actions.front().stage, span.start, span.end);
      } else if ((action.type == pl::ActionType::Backward || action.type == pl::ActionType::BackwardInput) &&
                 action.stage != num_stages - 1) {
        start = ComputeEvents::first_in(events->backward, action.stage, span.start, span.end);
      }
      const double d = seconds(span.end - start);
      if (pl::is_compute(action.type)) {
        busy += d;
        waits += seconds(start - span.start);
      }
      const int k = cost_kind(action.type);
      if (k >= 0 && step >= warmup) {
        cost_sums[0][k] += pl::is_compute(action.type) ? d : seconds(span.end - span.start);
        cost_sums[1][k] += 1.0;
      }
    }
    span_last = seconds(last - first);
    if (step + 1 == o.steps && std::getenv("FSDP_PP_BENCH_BREAKDOWN")) {
      // Where this rank's last step went, per action type (the span of each action, waits included).
      std::map<std::string, double> by_type;
      for (const auto& span : timeline) {
        const auto action = pl::Action::parse(span.action);
        by_type[pl::action_type_token(action.type)] += seconds(span.end - span.start);
        if (std::getenv("FSDP_PP_BENCH_BREAKDOWN")[0] == '2') {
          std::cerr << "  " << span.action << " " << seconds(span.start - first) * 1e3 << " +"
                    << seconds(span.end - span.start) * 1e3 << " ms\n";
        }
      }
      std::ostringstream os;
      os << "rank " << rank << " (pp " << pp_rank << ") last step span " << span_last * 1e3 << " ms:";
      for (const auto& [type, t] : by_type) os << " " << type << " " << t * 1e3;
      std::cerr << os.str() << " ms\n";
    }
    busy_last = busy;
    wait_last = waits;
    idle_last = span_last - busy;
  }

  // Step time = the slowest rank's, per step.
  auto t = at::tensor(times, at::kDouble);
  world->all_reduce(t, fsdp::ReduceOp::Max).wait();
  // Mean cost per action kind over every rank's timed steps.
  const at::Tensor local_sums = cost_sums.clone();
  world->all_reduce(cost_sums, fsdp::ReduceOp::Sum).wait();
  auto mean = [&](int k) {
    const double n = cost_sums[1][k].item<double>();
    return n > 0 ? cost_sums[0][k].item<double>() / n : 0.0;
  };
  // Stages differ (the last one computes the loss and starts backward from it): each pp rank's compute time over
  // what the global means predict for its actions scales its stages' costs in the simulator (SimCosts::
  // stage_scale; averaged over the dp ranks of a pp rank).
  double predicted = 0, actual = 0;
  for (int k : {kF, kB, kI, kW}) {
    predicted += local_sums[1][k].item<double>() * mean(k);
    actual += local_sums[0][k].item<double>();
  }
  auto ratio_by_pp = at::zeros({2, o.pp}, at::kDouble);
  ratio_by_pp[0][pp_rank] = predicted > 0 ? actual / predicted : 1.0;
  ratio_by_pp[1][pp_rank] = 1.0;
  world->all_reduce(ratio_by_pp, fsdp::ReduceOp::Sum).wait();
  // One-way transfer time of one microbatch's activation between two neighbouring pp ranks (half the median
  // round trip of 21 ping-pongs between pp ranks 0 and 1, after training): the simulator's p2p_latency. Without
  // it the simulator charges nothing for the transfers, which on Gloo's loopback TCP cost about as much as a
  // small model's microbatch compute.
  double p2p_latency = 0;
  if (o.pp > 1) {
    at::Tensor buf = at::zeros({local_batch / o.microbatches, o.dim});
    constexpr int kPing = (1 << 27) + 1, kPong = (1 << 27) + 2;  // above the pipeline's tags
    std::vector<double> rtts;
    for (int i = 0; i < 21; ++i) {
      if (pp_rank == 0) {
        const auto t0 = std::chrono::steady_clock::now();
        pp_group->send(buf, 1, kPing).wait();
        pp_group->recv(buf, 1, kPong).wait();
        rtts.push_back(seconds(std::chrono::steady_clock::now() - t0));
      } else if (pp_rank == 1) {
        pp_group->recv(buf, 0, kPing).wait();
        pp_group->send(buf, 0, kPong).wait();
      }
    }
    if (!rtts.empty()) {
      std::sort(rtts.begin(), rtts.end());
      p2p_latency = rtts[rtts.size() / 2] / 2;
    }
    auto l = at::tensor({p2p_latency}, at::kDouble);
    world->all_reduce(l, fsdp::ReduceOp::Max).wait();
    p2p_latency = l.item<double>();
  }
  pl::SimCosts costs;
  costs.p2p_latency = p2p_latency;
  for (int st = 0; st < num_stages; ++st) {
    const int r = pipe.schedule().stage_to_rank[st];
    costs.stage_scale.push_back(ratio_by_pp[0][r].item<double>() / ratio_by_pp[1][r].item<double>());
  }
  costs.forward = mean(kF);
  costs.backward = mean(kB);
  costs.backward_input = mean(kI);
  costs.backward_weight = mean(kW);
  costs.unshard = mean(kUnshard);
  costs.reshard = mean(kReshard);
  costs.reduce_grad = mean(kReduceGrad);
  const auto sim = pl::simulate(pipe.schedule(), costs);
  // This rank's measured last step, gathered to every rank: [idle, span, busy, pp rank, waits inside compute
  // actions] per world rank.
  auto mine = at::tensor({idle_last, span_last, busy_last, static_cast<double>(pp_rank), wait_last}, at::kDouble);
  auto all = at::empty({W * 5}, at::kDouble);
  world->all_gather_into_tensor(all, mine).wait();
  all = all.view({W, 5});

  if (rank == 0) {
    std::vector<double> step_times(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
    std::vector<double> timed(step_times.begin() + warmup, step_times.end());
    std::sort(timed.begin(), timed.end());
    const size_t n = timed.size();
    const double median = n == 0 ? 0.0 : (n % 2 ? timed[n / 2] : 0.5 * (timed[n / 2 - 1] + timed[n / 2]));
    std::vector<double> idle, span, busy, rank_pp, wait;
    for (int r = 0; r < W; ++r) {
      idle.push_back(all[r][0].item<double>());
      span.push_back(all[r][1].item<double>());
      busy.push_back(all[r][2].item<double>());
      rank_pp.push_back(all[r][3].item<double>());
      wait.push_back(all[r][4].item<double>());
    }
    std::ostringstream j;
    j << "{\"side\": \"ours\", \"torch\": \"" << TORCH_VERSION << "\", \"pp\": " << o.pp << ", \"dp\": " << o.dp
      << ", \"schedule\": \"" << o.schedule << "\", \"stages_per_rank\": " << v
      << ", \"microbatches\": " << o.microbatches << ", \"dim\": " << o.dim << ", \"layers\": " << o.layers
      << ", \"global_batch\": " << o.global_batch << ", \"steps\": " << o.steps << ", \"warmup\": " << warmup
      << ", \"losses\": " << json_array(losses) << ", \"step_times\": " << json_array(step_times)
      << ", \"median_step_s\": " << bench::fmt(median) << ", \"threads\": " << at::get_num_threads()
      << ", \"measured_idle_s\": " << json_array(idle) << ", \"measured_span_s\": " << json_array(span)
      << ", \"measured_busy_s\": " << json_array(busy)
      << ", \"measured_wait_in_compute_actions_s\": " << json_array(wait) << ", \"pp_rank_of_rank\": " << json_array(rank_pp)
      << ", \"sim_idle_s\": " << json_array(sim.idle) << ", \"sim_busy_s\": " << json_array(sim.busy)
      << ", \"sim_makespan_s\": " << bench::fmt(sim.makespan)
      << ", \"sim_bubble_fraction\": " << bench::fmt(sim.bubble_fraction) << ", \"costs_s\": {\"F\": "
      << bench::fmt(costs.forward) << ", \"B\": " << bench::fmt(costs.backward)
      << ", \"I\": " << bench::fmt(costs.backward_input) << ", \"W\": " << bench::fmt(costs.backward_weight)
      << ", \"UNSHARD\": " << bench::fmt(costs.unshard) << ", \"RESHARD\": " << bench::fmt(costs.reshard)
      << ", \"REDUCE_GRAD\": " << bench::fmt(costs.reduce_grad) << ", \"P2P_LATENCY\": " << bench::fmt(costs.p2p_latency)
      << "}}";
    std::cout << "PPBENCH " << j.str() << std::endl;
  }
  world->barrier().wait();
  fsdp::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"libfsdp side of the pipeline comparison with torch.distributed.pipelining + FSDP2 (run under fsdprun)"};
  Options o;
  app.add_option("--pp", o.pp, "pipeline ranks")->required();
  app.add_option("--dp", o.dp, "data-parallel (FSDP) ranks");
  app.add_option("--schedule", o.schedule, "GPipe, 1F1B, LoopedBFS, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV");
  app.add_option("--microbatches", o.microbatches);
  app.add_option("--dim", o.dim);
  app.add_option("--layers", o.layers);
  app.add_option("--global-batch", o.global_batch);
  app.add_option("--steps", o.steps);
  app.add_option("--warmup", o.warmup, "steps left out of the median step time");
  app.add_option("--lr", o.lr);
  app.add_option("--momentum", o.momentum);
  CLI11_PARSE(app, argc, argv);
  try {
    return run(o);
  } catch (const c10::Error& e) {
    std::cerr << "fsdp-bench-pp: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "fsdp-bench-pp: " << e.what() << "\n";
    return 1;
  }
}
