// Pipeline parallelism (docs/planner.md, "Pipeline parallelism"): TorchTitan's stage split, the schedule's lowered
// action list walked per pp rank (what each holds and sends at every action), the bubble. The stages' FSDP units
// come from the seam (plan_model.cpp): what the trainer's split and parallelize give each stage.
#include "plan_internal.h"

#include <fsdp/pipeline/schedule.h>

#include <c10/util/Exception.h>

#include <algorithm>

namespace fsdp::plan {
namespace detail {
namespace {

// What one pp rank holds and sends over its lowered action list (fsdp::pipeline::build_schedule), walked in order.
struct RankWalk {
  int64_t params = 0, grads = 0, optimizer = 0;  // persistent (sharded) of its stages
  int64_t buffers = 0;                           // persistent: its stages' MoE [E] buffers
  int64_t peak = -1;
  std::string peak_moment;
  int64_t unsharded = 0, accumulated = 0, activations = 0, transient = 0, sharded_grads = 0, microbatches = 0;
  int64_t peak_in_flight = 0;  // unweighted: max over time of its microbatches between F and B (or W)
  CommPlan comm;
};

RankWalk walk_rank(const PlanConfig& c, const fsdp::pipeline::PipelineSchedule& schedule, int rank,
                   const std::vector<StagePlan>& stages, const ActivationModel& act, int64_t block_numel,
                   int64_t boundary_bytes) {
  namespace pl = fsdp::pipeline;
  const int64_t e = bytes_of(c.compute_dtype), pb = bytes_of(c.param_dtype), rb = bytes_of(c.reduce_dtype),
                ob = bytes_of(c.optim_dtype);
  // FSDP shards each stage over dp_shard x cp (dp_shard_cp under context parallelism, as without PP).
  const int64_t S = c.shard * c.cp, R = c.replicate;
  const bool alias = S == 1 && e == pb && rb == pb;
  const size_t n = stages.size();
  RankWalk w;
  for (int s : schedule.stages_of_rank(rank)) {
    w.params += stages[s].shard_numel * pb;
    w.optimizer += c.optim_states * stages[s].shard_numel * ob;
    w.buffers += stages[s].buffer_bytes;
  }
  w.grads = w.params;  // sharded grads: the params' shapes in the param dtype
  const int64_t persist = w.params + w.optimizer + w.buffers + c.runtime_overhead;

  // Transient of a backward (B, I or W) of stage s, on top of what is held: one block's gradients in the compute
  // dtype before they join the accumulated ones, the gradients flowing through it, what a ring-attention backward
  // holds under cp, a checkpointed block's recomputed activations; on the last stage the log-softmax backward
  // (two more T x V tensors) if larger.
  auto backward_transient = [&](const StagePlan& st) {
    bool any_recomputed = false;
    for (int64_t l = st.first_layer; l < st.first_layer + st.num_layers; ++l) any_recomputed |= act.recomputed[l];
    const int64_t block_part =
        (st.num_layers > 0 ? block_numel * e + act.grad_workspace + act.attention.backward_in_flight : 0) +
        (any_recomputed ? act.largest_full : 0);
    return std::max(block_part, st.has_output ? 2 * act.lsm_bytes : int64_t{0});
  };
  // Reduce-scatter buffers of the stage's largest group (input, our all-to-all receive buffer, output).
  auto reduce_transient = [&](const StagePlan& st) {
    int64_t largest = 0;
    for (const auto& g : st.groups) largest = std::max(largest, g.shard_numel);
    return alias ? int64_t{0} : (2 * S + 1) * largest * rb;
  };

  std::vector<char> unsharded(n, 0), accumulating(n, 0), reduced(n, 0);
  std::vector<int64_t> in_flight(n, 0);
  int64_t count = 0;
  auto evaluate = [&](const std::string& moment, int64_t transient) {
    int64_t held_params = 0, held_grads = 0, held_acts = 0, sharded_grads = 0;
    for (size_t s = 0; s < n; ++s) {
      if (unsharded[s]) held_params += stages[s].unsharded_param_bytes;
      if (accumulating[s]) held_grads += stages[s].accumulated_grad_bytes;
      if (reduced[s]) sharded_grads += stages[s].shard_numel * pb;
      held_acts += in_flight[s] * stages[s].activation_bytes_per_microbatch;
    }
    const int64_t total = persist + held_params + held_grads + held_acts + sharded_grads + transient;
    if (total > w.peak) {
      w.peak = total;
      w.peak_moment = moment;
      w.unsharded = held_params;
      w.accumulated = held_grads;
      w.activations = held_acts;
      w.transient = transient;
      w.sharded_grads = sharded_grads;
      w.microbatches = count;
    }
  };

  CommPlan& cm = w.comm;
  std::vector<pl::Action> walked;  // DualPipeV's OVERLAP_F_B as its parts, in the order they run
  for (const pl::Action& listed : schedule.actions[rank])
    for (const pl::Action& part : listed.leaves()) walked.push_back(part);
  for (const pl::Action& action : walked) {
    const StagePlan& st = stages[action.stage];
    const std::string where = " of stage " + std::to_string(action.stage) + " (microbatch " +
                              std::to_string(action.microbatch) + ")";
    switch (action.type) {
      case pl::ActionType::Unshard:
        unsharded[action.stage] = 1;
        for (const auto& g : st.groups) add_all_gather(cm, g, S, e);
        break;
      case pl::ActionType::Reshard:
        unsharded[action.stage] = 0;
        break;
      case pl::ActionType::Forward:
        in_flight[action.stage] += 1;
        count += 1;
        w.peak_in_flight = std::max(w.peak_in_flight, count);
        // The loss's float32 copy of the logits exists while the last stage's forward computes the loss; under cp
        // a ring-attention forward holds the other ranks' K and V while a block runs.
        evaluate("forward" + where, std::max(st.has_output && c.loss.upcast_logits ? act.lsm : int64_t{0},
                                             st.num_layers > 0 ? act.attention.forward_in_flight : int64_t{0}));
        break;
      case pl::ActionType::Backward:
      case pl::ActionType::BackwardWeight:
        accumulating[action.stage] = 1;
        evaluate(std::string(action.type == pl::ActionType::Backward ? "backward" : "weight backward (W)") + where,
                 backward_transient(st));
        in_flight[action.stage] -= 1;  // its saved activations are released
        count -= 1;
        break;
      case pl::ActionType::BackwardInput:  // I: the activations stay until W
        evaluate("input backward (I)" + where, backward_transient(st));
        break;
      case pl::ActionType::ReduceGrad:
        accumulating[action.stage] = 0;
        reduced[action.stage] = 1;
        evaluate("REDUCE_GRAD of stage " + std::to_string(action.stage), reduce_transient(st));
        for (const auto& g : st.groups) add_gradient_reduction(cm, g, S, R, rb);
        break;
      case pl::ActionType::SendF:
      case pl::ActionType::SendB:
        cm.pp_send_bytes += boundary_bytes;
        cm.pp_send_calls += 1;
        break;
      case pl::ActionType::RecvF:
      case pl::ActionType::RecvB:
      case pl::ActionType::OverlapFB:  // expanded above
        break;
    }
  }
  cm.total_bytes = cm.all_gather_bytes + cm.reduce_scatter_bytes + cm.all_reduce_bytes;
  // Optimizer step: params, sharded grads and states of all its stages.
  const int64_t optim_step = persist + w.grads;
  if (optim_step > w.peak) {
    w.peak = optim_step;
    w.peak_moment = "optimizer step";
    w.unsharded = w.accumulated = w.activations = w.transient = w.microbatches = 0;
    w.sharded_grads = w.grads;
  }

  // Tensor and expert parallel: docs/planner.md's per-step counts applied to the rank's blocks, once per microbatch
  // (each microbatch runs its own forward and backward), each collective on one microbatch's tokens (this cp
  // rank's seq / cp of each sequence).
  const int64_t T_mb = c.local_batch / c.microbatches * c.seq_len / c.cp;
  for (int64_t mb = 0; mb < c.microbatches; ++mb) {
    for (int s : schedule.stages_of_rank(rank)) {
      const StagePlan& st = stages[s];
      add_tp_collectives(cm, c, act, st.first_layer, st.num_layers, st.has_embedding, st.has_output, T_mb,
                         st.groups);
      add_ep_collectives(cm, c, act, st.first_layer, st.num_layers, T_mb);
    }
  }
  return w;
}

}  // namespace

PipelineSetup prepare_pipeline(const PlanConfig& c) {
  namespace pl = fsdp::pipeline;
  const auto& a = c.args;
  TORCH_CHECK(c.microbatches >= 1 && c.microbatches <= 1000000, "fsdp-plan: microbatches must be in [1, 1e6], got ",
              c.microbatches);
  TORCH_CHECK(c.local_batch % c.microbatches == 0, "fsdp-plan: local batch ", c.local_batch,
              " does not split into ", c.microbatches, " equal microbatches (microbatches must divide the local batch)");
  TORCH_CHECK(!a.tie_embeddings, "fsdp-plan: pipeline parallelism needs untied embeddings (tok_embeddings lives on "
              "the first stage, output on the last)");
  TORCH_CHECK(c.first_stage_less_layers >= 0 && c.last_stage_less_layers >= 0,
              "fsdp-plan: first/last stage less layers must be >= 0, got ", c.first_stage_less_layers, " / ",
              c.last_stage_less_layers);
  const pl::ScheduleKind kind = pl::parse_schedule_name(c.schedule);  // an unknown name lists the valid ones
  const std::string name = pl::schedule_name(kind);
  const bool single = pl::is_single_stage_kind(kind);
  TORCH_CHECK(c.stages_per_rank >= 0 && c.stages_per_rank <= 1024,
              "fsdp-plan: stages_per_rank must be in [0, 1024] (0: the schedule's default), got ", c.stages_per_rank);
  int64_t v = c.stages_per_rank;
  if (c.layers_per_stage) {
    // TorchTitan's pipeline_llm: the number of stages from the layers per stage, then the per-rank checks.
    const int64_t lps = *c.layers_per_stage;
    const int64_t effective = a.n_layers + c.first_stage_less_layers + c.last_stage_less_layers;
    TORCH_CHECK(lps >= 1, "fsdp-plan: layers_per_stage must be >= 1, got ", lps);
    const int64_t num_stages = ceil_div(effective, lps);
    TORCH_CHECK(num_stages % c.pp == 0, "fsdp-plan: layers_per_stage ", lps, " gives ceil((", a.n_layers,
                " layers + ", c.first_stage_less_layers, " + ", c.last_stage_less_layers, ") / ", lps, ") = ",
                num_stages, " stages, not a multiple of pp ", c.pp);
    const int64_t implied = num_stages / c.pp;
    TORCH_CHECK(!single || implied == 1, "fsdp-plan: ", name, " runs one stage per rank, but layers_per_stage ",
                lps, " gives ", num_stages, " stages over pp ", c.pp, " (", implied, " per rank)");
    TORCH_CHECK(single || implied >= 2, "fsdp-plan: ", name,
                " is a multi-stage schedule and needs at least 2 stages per rank (TorchTitan), but layers_per_stage ",
                lps, " gives ", num_stages, " stages over pp ", c.pp);
    TORCH_CHECK(v == 0 || v == implied, "fsdp-plan: stages_per_rank ", v, " contradicts layers_per_stage ", lps,
                ", which gives ", implied, " stages per rank");
    v = implied;
  } else if (v == 0) {
    v = pl::default_stages_per_rank(kind);
  }
  const int64_t num_stages = c.pp * v;
  const std::vector<int64_t> layers =
      split_layers(num_stages, a.n_layers, c.first_stage_less_layers, c.last_stage_less_layers);

  pl::ScheduleSpec spec;
  spec.kind = kind;
  spec.pp = static_cast<int>(c.pp);
  spec.stages_per_rank = static_cast<int>(v);
  spec.microbatches = static_cast<int>(c.microbatches);
  pl::PipelineSchedule schedule;
  try {
    schedule = pl::build_schedule(spec);
  } catch (const c10::Error& err) {
    TORCH_CHECK(false, "fsdp-plan: schedule ", name, " with pp ", c.pp, ", ", v, " stage(s) per rank and ",
                c.microbatches, " microbatches is refused: ", err.what_without_backtrace());
  }
  PipelineSetup out{kind, name, v, num_stages, layers, std::move(schedule), {}};
  if (c.stages_per_rank != 0 && !c.layers_per_stage) {
    // The trainer has no stages-per-rank key: TorchTitan's way to ask for other stages is to list them.
    int64_t next = 0;
    for (int64_t s = 0; s < num_stages; ++s) {
      std::vector<std::string> fqns;
      if (s == 0) fqns.push_back("tok_embeddings");
      for (int64_t l = next; l < next + layers[s]; ++l) fqns.push_back("layers." + std::to_string(l));
      next += layers[s];
      if (s == num_stages - 1) fqns.insert(fqns.end(), {"norm", "output"});
      out.stage_fqns.push_back(std::move(fqns));
    }
  }
  return out;
}

// Fills plan.pipeline and replaces plan.memory / plan.comm by the pp rank with the largest peak.
void plan_pipeline(const PlanConfig& c, const PipelineSetup& setup, const SeamLayout& seam, Plan& plan) {
  namespace pl = fsdp::pipeline;
  const auto& a = c.args;
  const int64_t e = bytes_of(c.compute_dtype), pb = bytes_of(c.param_dtype), rb = bytes_of(c.reduce_dtype);
  const int64_t S = c.shard * c.cp, TP = c.tp;  // FSDP inside a stage shards over dp_shard x cp
  const pl::ScheduleKind kind = setup.kind;
  const std::string& name = setup.name;
  const int64_t v = setup.v, num_stages = setup.num_stages;
  const std::vector<int64_t>& layers = setup.layers;
  const pl::PipelineSchedule& schedule = setup.schedule;

  PipelinePlan& pp = plan.pipeline;
  pp.enabled = true;
  pp.schedule = name;
  pp.pp = c.pp;
  pp.stages_per_rank = v;
  pp.num_stages = num_stages;
  pp.microbatches = c.microbatches;
  pp.microbatch_size = c.local_batch / c.microbatches;
  // A microbatch's tokens on this rank: its sequences' seq / cp each under context parallelism (the trainer cuts
  // the cp chunks before the schedule splits the rows into microbatches; each stage's attention runs the ring).
  const int64_t T_mb = pp.microbatch_size * c.seq_len / c.cp;
  const ActivationModel act = activation_model(c, T_mb, seam.attention);
  // One activation (or its gradient) crossing a stage boundary: the residual stream [T_mb, dim] (this cp rank's
  // chunks), sequence-sharded under TP.
  pp.boundary_bytes = T_mb / TP * a.dim * e;
  const bool alias = S == 1 && e == pb && rb == pb;
  TORCH_CHECK(static_cast<int64_t>(seam.stage_groups.size()) == num_stages, "fsdp-plan internal: the trainer's split "
              "gives ", seam.stage_groups.size(), " stages, the planner's ", num_stages);
  int64_t block_numel = 0;  // the largest block's unsharded parameters on this rank (MoE blocks: its experts)

  int64_t next_layer = 0;
  for (int64_t s = 0; s < num_stages; ++s) {
    StagePlan st;
    st.stage = static_cast<int>(s);
    st.rank = schedule.stage_to_rank[s];
    st.first_layer = next_layer;
    st.num_layers = layers[s];
    next_layer += layers[s];
    st.has_embedding = s == 0;
    st.has_output = s == num_stages - 1;
    if (st.has_embedding) st.fqns.push_back("tok_embeddings");
    for (int64_t l = st.first_layer; l < st.first_layer + st.num_layers; ++l) st.fqns.push_back("layers." + std::to_string(l));
    if (st.has_output) {
      st.fqns.push_back("norm");
      st.fqns.push_back("output");
    }
    // Its FSDP units as the trainer's parallelize made them: its blocks, then what is left of tok_embeddings /
    // norm + output (none on middle stages).
    st.groups = seam.stage_groups[static_cast<size_t>(s)];
    int64_t blocks = 0;
    for (const auto& g : st.groups) {
      if (g.name == "root") continue;
      TORCH_CHECK(g.name == "layers." + std::to_string(st.first_layer + blocks), "fsdp-plan internal: stage ", s,
                  " of the trainer holds ", g.name, " where the planner's split puts layers.",
                  st.first_layer + blocks);
      blocks += 1;
      block_numel = std::max(block_numel, g.local_numel);
    }
    TORCH_CHECK(blocks == st.num_layers, "fsdp-plan internal: stage ", s, " of the trainer holds ", blocks,
                " blocks, the planner's split ", st.num_layers);
    int64_t local_numel = 0;  // unsharded on this rank: under EP only its own experts
    for (const auto& g : st.groups) {
      st.numel += g.numel;
      st.shard_numel += g.shard_numel;
      local_numel += g.local_numel;
    }
    st.unsharded_param_bytes = alias ? 0 : local_numel * e;
    st.buffer_bytes = moe_buffer_bytes(a, st.first_layer, st.num_layers);
    st.accumulated_grad_bytes = local_numel * rb;
    // One microbatch's saved activations on this stage: its blocks' (per-block formula at T_mb tokens); the
    // received input, kept for the stage's backward, unless a block already counts it (a checkpointed first
    // block saves its input; in fp32 the first norm saves the input itself); the stage output, kept until its
    // backward; on the last stage the final norm, the logits and the log-softmax output.
    int64_t saved = 0;
    for (int64_t l = st.first_layer; l < st.first_layer + st.num_layers; ++l) saved += act.layer_saved[l];
    const bool input_counted = e == 4 || (st.num_layers > 0 && act.recomputed[st.first_layer]);
    if (s > 0 && !input_counted) saved += pp.boundary_bytes;
    saved += st.has_output ? act.final_norm + act.logits + act.lsm_bytes : pp.boundary_bytes;
    st.activation_bytes_per_microbatch = saved;
    st.cost_scale = static_cast<double>(st.num_layers + (st.has_embedding ? c.first_stage_less_layers : 0) +
                                        (st.has_output ? c.last_stage_less_layers : 0));
    pp.stages.push_back(std::move(st));
  }

  std::vector<RankWalk> walks;
  for (int r = 0; r < static_cast<int>(c.pp); ++r) {
    walks.push_back(walk_rank(c, schedule, r, pp.stages, act, block_numel, pp.boundary_bytes));
    PipelineRankPlan rp;
    rp.rank = r;
    rp.stages = schedule.stages_of_rank(r);
    rp.peak_microbatches_in_flight = walks.back().peak_in_flight;
    rp.peak_bytes = walks.back().peak;
    rp.peak_moment = walks.back().peak_moment;
    rp.pp_send_bytes = walks.back().comm.pp_send_bytes;
    rp.pp_send_calls = walks.back().comm.pp_send_calls;
    pp.ranks.push_back(std::move(rp));
    if (walks.back().peak > walks[pp.planned_rank].peak) pp.planned_rank = r;
  }
  const RankWalk& w = walks[pp.planned_rank];
  pp.unsharded_params_at_peak = w.unsharded;
  pp.accumulated_grads_at_peak = w.accumulated;
  pp.activations_at_peak = w.activations;
  pp.transient_at_peak = w.transient;
  pp.microbatches_at_peak = w.microbatches;

  pl::SimCosts costs;  // F = 1, B = 2, I = W = 1 per effective layer, no latency
  for (const auto& st : pp.stages) costs.stage_scale.push_back(st.cost_scale);
  pp.bubble_fraction = pl::simulate(schedule, costs).bubble_fraction;
  const double p = static_cast<double>(c.pp), m = static_cast<double>(c.microbatches), vv = static_cast<double>(v);
  switch (kind) {
    case pl::ScheduleKind::GPipe:
    case pl::ScheduleKind::OneFOneB:
      pp.bubble_closed_form = (p - 1) / (m + p - 1);
      break;
    case pl::ScheduleKind::LoopedBFS:
    case pl::ScheduleKind::Interleaved1F1B:
      pp.bubble_closed_form = (p - 1) / (vv * m + p - 1);
      break;
    case pl::ScheduleKind::InterleavedZeroBubble:
    case pl::ScheduleKind::ZBVZeroBubble:
      pp.bubble_closed_form = (p - 1) / (3 * vv * m + p - 1);
      break;
    case pl::ScheduleKind::DualPipeV:  // no closed form: the simulated value only
    case pl::ScheduleKind::Csv:
      pp.bubble_closed_form = -1;
      break;
  }

  MemoryPlan& mem = plan.memory;
  const MemoryPlan whole = mem;
  mem = MemoryPlan{};
  mem.seq_per_rank = whole.seq_per_rank;  // the attention of a microbatch: per sequence, as without PP
  mem.attention_saved_per_layer = act.attention.saved;
  mem.attention_forward_in_flight = act.attention.forward_in_flight;
  mem.attention_backward_in_flight = act.attention.backward_in_flight;
  mem.params = w.params;
  mem.grads = w.grads;
  mem.optimizer = w.optimizer;
  mem.runtime = c.runtime_overhead;
  mem.buffers = w.buffers;
  mem.unsharded_peak = w.unsharded;
  mem.activations = w.activations;
  mem.sharded_grads_at_peak = w.sharded_grads;
  mem.total = w.peak;
  mem.peak_moment = w.peak_moment;
  mem.act_per_layer_full = act.full_per_layer;
  mem.act_per_layer_checkpointed = act.checkpointed_per_layer;
  mem.saved_activations = w.activations;
  mem.step_peak = w.peak - (w.params + w.optimizer + w.buffers + c.runtime_overhead);
  plan.comm = w.comm;
}

}  // namespace detail

std::vector<int64_t> split_layers(int64_t num_stages, int64_t num_layers, int64_t first_less, int64_t last_less) {
  TORCH_CHECK(num_stages >= 1, "fsdp-plan: the number of pipeline stages must be >= 1, got ", num_stages);
  TORCH_CHECK(num_layers >= 0 && first_less >= 0 && last_less >= 0, "fsdp-plan: layers (", num_layers,
              ") and first/last stage less layers (", first_less, ", ", last_less, ") must be >= 0");
  if (num_stages == 1) return {num_layers};
  const int64_t effective = num_layers + first_less + last_less;
  TORCH_CHECK(num_stages <= effective, "fsdp-plan: ", num_stages, " pipeline stages for ", effective,
              " effective layers (", num_layers, " layers + first_stage_less_layers ", first_less,
              " + last_stage_less_layers ", last_less, ") would leave a stage empty; use fewer stages");
  const int64_t per_stage = effective / num_stages, extra = effective % num_stages;
  TORCH_CHECK(first_less <= per_stage, "fsdp-plan: first_stage_less_layers ", first_less, " exceeds the ", per_stage,
              " effective layers per stage (", num_layers, " layers over ", num_stages, " stages)");
  TORCH_CHECK(last_less <= per_stage, "fsdp-plan: last_stage_less_layers ", last_less, " exceeds the ", per_stage,
              " effective layers per stage (", num_layers, " layers over ", num_stages, " stages)");
  std::vector<int64_t> layers(num_stages);
  for (int64_t s = 0; s < num_stages; ++s) {
    layers[s] = per_stage + (s < extra ? 1 : 0);
    if (s == 0) layers[s] -= first_less;
    if (s == num_stages - 1) layers[s] -= last_less;
  }
  return layers;
}

}  // namespace fsdp::plan
