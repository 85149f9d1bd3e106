// fsdp-plan's model (see plan.h and docs/planner.md for the formulas and what they assume).
#include "plan.h"

#include <fsdp/pipeline/schedule.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace fsdp::plan {
namespace {

int64_t bytes_of(c10::ScalarType t) { return static_cast<int64_t>(c10::elementSize(t)); }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t align16(int64_t n) { return (n + 15) / 16 * 16; }

// One group's gradient reduction per step: a reduce-scatter over the S shard ranks and, with R > 1 replicas,
// HSDP's all-reduce of the shard over them (docs/comm.md's byte model); `rb` = bytes per reduce-dtype element.
void add_gradient_reduction(CommPlan& cm, const GroupPlan& g, int64_t S, int64_t R, int64_t rb) {
  if (S > 1) {
    cm.reduce_scatter_bytes += (S - 1) * g.shard_numel * rb;
    cm.reduce_scatter_calls += 1;
    cm.optimum_bytes += (S - 1) * g.numel * rb / S;
  }
  if (R > 1) {
    cm.all_reduce_bytes += 2 * (R - 1) * g.shard_numel * rb / R;
    cm.all_reduce_calls += 1;
    cm.optimum_bytes += 2 * (R - 1) * (g.numel / S) * rb / R;
  }
}

struct ParamShape {
  int64_t dim0, row;  // [dim0, row] (1-D: row = 1)
};

// The parameters of one block / of the root, in registration order (src/models/llama.cpp), as one TP rank holds
// them (TorchTitan's plan: colwise wq wk wv w1 w3 split dim 0, rowwise wo w2 split dim 1, the embedding and
// the output projection split the vocabulary, norms replicated; rank 0's torch.chunk piece, the largest).
std::vector<ParamShape> block_params(const nn::llama::LlamaArgs& a, int64_t tp = 1) {
  const int64_t hq = ceil_div(a.n_heads * a.head_dim(), tp), hkv = ceil_div(a.kv_heads() * a.head_dim(), tp),
                f = ceil_div(a.ffn_hidden_dim(), tp);
  return {{hq, a.dim}, {hkv, a.dim}, {hkv, a.dim}, {a.dim, hq},  // attention wq wk wv wo
          {f, a.dim},  {a.dim, f},   {f, a.dim},                 // feed_forward w1 w2 w3
          {a.dim, 1},  {a.dim, 1}};                              // attention_norm, ffn_norm
}
std::vector<ParamShape> root_params(const nn::llama::LlamaArgs& a, int64_t tp = 1) {
  const int64_t v = ceil_div(a.vocab_size, tp);
  std::vector<ParamShape> p = {{v, a.dim}, {a.dim, 1}};
  if (!a.tie_embeddings) p.push_back({v, a.dim});
  return p;
}

GroupPlan group_plan(const std::string& name, const std::vector<ParamShape>& params, int64_t shard,
                     int64_t compute_bytes) {
  GroupPlan g;
  g.name = name;
  for (const auto& p : params) {
    const int64_t shard_numel = ceil_div(p.dim0, shard) * p.row;
    g.numel += p.dim0 * p.row;
    g.shard_numel += shard_numel;
    g.all_gather_bytes += align16(shard_numel * compute_bytes);
  }
  return g;
}

// What autograd saves for a batch of T tokens (docs/planner.md, "Activations"): per block under the configured
// AC, and for the final norm and the loss. The pipeline planner evaluates it at one microbatch's tokens.
struct ActivationModel {
  int64_t full_per_layer = 0;          // a block that saves everything
  int64_t checkpointed_per_layer = 0;  // a checkpointed block: its input only
  std::vector<int64_t> layer_saved;    // per block, under the configured AC
  std::vector<bool> recomputed;        // per block: its backward first recomputes its forward
  int64_t final_norm = 0;
  int64_t logits = 0;                  // T x V (per TP rank) in the compute dtype
  int64_t lsm = 0;                     // T x V x 4: the float32 copy / log-softmax output when upcast
  int64_t lsm_bytes = 0;               // the log-softmax output
  int64_t loss_forward = 0;            // logits, log-softmax output and the float32 copy when upcast
  int64_t grad_workspace = 0;          // gradients in flight through one block's backward
};

ActivationModel activation_model(const PlanConfig& c, int64_t T) {
  const auto& a = c.args;
  const int64_t e = bytes_of(c.compute_dtype), TP = c.tp;
  ActivationModel out;
  // With TP, heads and the FFN hidden dim are split (per token of the whole sequence, which the colwise layers
  // see gathered); norms run on this rank's 1/tp of the tokens (sequence parallel).
  const int64_t D = a.dim, hq = a.n_heads * a.head_dim() / TP, hkv = a.kv_heads() * a.head_dim() / TP,
                F = ceil_div(a.ffn_hidden_dim(), TP), heads = a.n_heads / TP;
  const bool gqa = a.n_heads != a.kv_heads();
  // RMSNorm: float32 input (the input itself in fp32, an upcast copy otherwise), normalized (compute dtype)
  // saved for the weight multiply, output saved by the next linear(s). Under TP (sequence parallel) the norm
  // runs on T/tp tokens and its output is not saved: it is all-gathered (whose backward needs nothing) and the
  // colwise linears save the gathered [T, D] copy instead.
  const int64_t norm = TP > 1 ? (4 * D + e * D) / TP + e * D : 4 * D + 2 * e * D;
  // Attention: q (roped), k and v as SDPA sees them (repeated to n_heads under GQA), SDPA output (= wo
  // input), log-sum-exp (fp32 per head).
  const int64_t attn = e * (hq + 2 * (gqa ? hq : hkv) + hq) + 4 * heads;
  // SwiGLU: w1 out (silu input), silu out, w3 out, product (w2 input).
  const int64_t ffn = 4 * e * F;
  const int64_t full_per_token = 2 * norm + attn + ffn;
  out.full_per_layer = T * full_per_token;
  out.checkpointed_per_layer = T * e * D / TP;  // the block input only (sequence-sharded under TP)
  // Op-level SAC: the block input and a copy of every other matmul output (wq, wv, w1, w2); TorchTitan's policy
  // also keeps the SDPA output and log-sum-exp. Under TP the rowwise w2's matmul output is the full-sequence
  // partial sum [T, D], saved before its reduce-scatter.
  const int64_t op_sac_per_token =
      e * (D / TP + hq + hkv + F + D) + (c.op_sac_saves_attention ? e * hq + 4 * heads : 0);
  out.layer_saved.assign(a.n_layers, out.full_per_layer);
  out.recomputed.assign(a.n_layers, false);
  for (int64_t l = 0; l < a.n_layers; ++l) {
    if (c.ac == ACMode::Full ||
        (c.ac == ACMode::Selective && c.selective == SelectiveKind::Layer &&
         (l + 1) % std::max<int64_t>(c.selective_every, 1) == 0)) {  // TorchTitan: every N-th block
      out.layer_saved[l] = out.checkpointed_per_layer;
      out.recomputed[l] = true;
    } else if (c.ac == ACMode::Selective && c.selective == SelectiveKind::Op) {  // the saved op outputs, the rest recomputed
      out.layer_saved[l] = T * op_sac_per_token;
      out.recomputed[l] = true;
    }
  }
  out.final_norm = T * norm;
  // Logits per rank: vocabulary-sharded under loss parallel, gathered otherwise.
  const int64_t V = TP > 1 && c.loss_parallel ? ceil_div(a.vocab_size, TP) : a.vocab_size;
  out.logits = T * V * e;
  out.lsm = T * V * 4;  // log-softmax output (float32 when upcast; = compute dtype otherwise)
  out.lsm_bytes = c.loss.upcast_logits ? out.lsm : T * V * e;
  out.loss_forward = out.logits + out.lsm_bytes + (c.loss.upcast_logits ? out.lsm : 0);
  out.grad_workspace = T * e * (2 * D / TP + 3 * F);
  return out;
}

std::string gib(int64_t b) {
  char buf[64];
  if (std::llabs(b) >= (int64_t{1} << 30)) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / (1 << 30));
  } else {
    std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(b) / (1 << 20));
  }
  return buf;
}


// ---- pipeline parallelism (docs/planner.md, "Pipeline parallelism") ----

std::string layer_range(int64_t first, int64_t count) {
  if (count == 0) return "";
  if (count == 1) return "layers." + std::to_string(first);
  return "layers." + std::to_string(first) + "-" + std::to_string(first + count - 1);
}

// What one pp rank holds and sends over its lowered action list (fsdp::pipeline::build_schedule), walked in order.
struct RankWalk {
  int64_t params = 0, grads = 0, optimizer = 0;  // persistent (sharded) of its stages
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
  const int64_t S = c.shard, R = c.replicate;
  const bool alias = S == 1 && e == pb && rb == pb;
  const size_t n = stages.size();
  RankWalk w;
  for (int s : schedule.stages_of_rank(rank)) {
    w.params += stages[s].shard_numel * pb;
    w.optimizer += c.optim_states * stages[s].shard_numel * ob;
  }
  w.grads = w.params;  // sharded grads: the params' shapes in the param dtype
  const int64_t persist = w.params + w.optimizer + c.runtime_overhead;

  // Transient of a backward (B, I or W) of stage s, on top of what is held: one block's gradients in the compute
  // dtype before they join the accumulated ones, the gradients flowing through it, a checkpointed block's
  // recomputed activations; on the last stage the log-softmax backward (two more T x V tensors) if larger.
  auto backward_transient = [&](const StagePlan& st) {
    bool any_recomputed = false;
    for (int64_t l = st.first_layer; l < st.first_layer + st.num_layers; ++l) any_recomputed |= act.recomputed[l];
    const int64_t block_part = (st.num_layers > 0 ? block_numel * e + act.grad_workspace : 0) +
                               (any_recomputed ? act.full_per_layer : 0);
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
  for (const pl::Action& action : schedule.actions[rank]) {
    const StagePlan& st = stages[action.stage];
    const std::string where = " of stage " + std::to_string(action.stage) + " (microbatch " +
                              std::to_string(action.microbatch) + ")";
    switch (action.type) {
      case pl::ActionType::Unshard:
        unsharded[action.stage] = 1;
        for (const auto& g : st.groups) {
          if (S > 1) {
            cm.all_gather_bytes += (S - 1) * g.all_gather_bytes;
            cm.all_gather_calls += 1;
            cm.optimum_bytes += (S - 1) * g.numel * e / S;
          }
        }
        break;
      case pl::ActionType::Reshard:
        unsharded[action.stage] = 0;
        break;
      case pl::ActionType::Forward:
        in_flight[action.stage] += 1;
        count += 1;
        w.peak_in_flight = std::max(w.peak_in_flight, count);
        // The loss's float32 copy of the logits exists while the last stage's forward computes the loss.
        evaluate("forward" + where, st.has_output && c.loss.upcast_logits ? act.lsm : 0);
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

  // Tensor parallel: docs/planner.md's per-step counts applied to the rank's blocks, once per microbatch (each
  // microbatch runs its own forward and backward), each collective on one microbatch's tokens.
  const int64_t TP = c.tp;
  if (TP > 1) {
    const auto& a = c.args;
    const int64_t T_mb = c.local_batch / c.microbatches * c.seq_len, D = a.dim, m = c.microbatches;
    const int64_t shard_act = T_mb / TP * D * e;
    const int64_t ag_one = (TP - 1) * shard_act, rs_one = (TP - 1) * (T_mb * D * e) / TP;
    int64_t blocks = 0, recomputed_blocks = 0, ends = 0;
    bool has_output = false;
    for (int s : schedule.stages_of_rank(rank)) {
      const StagePlan& st = stages[s];
      blocks += st.num_layers;
      for (int64_t l = st.first_layer; l < st.first_layer + st.num_layers; ++l) recomputed_blocks += act.recomputed[l];
      ends += (st.has_embedding ? 1 : 0) + (st.has_output ? 1 : 0);
      has_output = has_output || st.has_output;
    }
    const int64_t per_dir = m * (4 * blocks + ends + 2 * recomputed_blocks);
    cm.tp_all_gather_calls = per_dir;
    cm.tp_reduce_scatter_calls = per_dir;
    cm.tp_all_gather_bytes = per_dir * ag_one;
    cm.tp_reduce_scatter_bytes = per_dir * rs_one;
    if (has_output && !c.loss_parallel) {
      cm.tp_all_gather_calls += m;
      cm.tp_all_gather_bytes += m * (TP - 1) * T_mb * ceil_div(a.vocab_size, TP) * e;
    }
    const auto ar = [&](int64_t bytes) { return 2 * (TP - 1) * bytes / TP; };
    const int64_t norms = 2 * blocks + (has_output ? 1 : 0);
    cm.tp_all_reduce_calls = m * norms;
    cm.tp_all_reduce_bytes = m * norms * ar(D * e);
    if (has_output && c.loss_parallel) {
      cm.tp_all_reduce_calls += 3 * m;
      cm.tp_all_reduce_bytes += m * (ar((T_mb + 1) * 4) + 2 * ar(T_mb * 4));
    }
    cm.tp_total_bytes = cm.tp_all_gather_bytes + cm.tp_reduce_scatter_bytes + cm.tp_all_reduce_bytes;
  }
  return w;
}

// Fills plan.pipeline and replaces plan.memory / plan.comm by the pp rank with the largest peak.
void plan_pipeline(const PlanConfig& c, Plan& plan) {
  namespace pl = fsdp::pipeline;
  const auto& a = c.args;
  const int64_t e = bytes_of(c.compute_dtype), pb = bytes_of(c.param_dtype), rb = bytes_of(c.reduce_dtype);
  const int64_t S = c.shard, TP = c.tp;
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

  PipelinePlan& pp = plan.pipeline;
  pp.enabled = true;
  pp.schedule = name;
  pp.pp = c.pp;
  pp.stages_per_rank = v;
  pp.num_stages = num_stages;
  pp.microbatches = c.microbatches;
  pp.microbatch_size = c.local_batch / c.microbatches;
  const int64_t T_mb = pp.microbatch_size * c.seq_len;
  const ActivationModel act = activation_model(c, T_mb);
  // One activation (or its gradient) crossing a stage boundary: the residual stream [T_mb, dim], sequence-sharded
  // under TP.
  pp.boundary_bytes = T_mb / TP * a.dim * e;
  const bool alias = S == 1 && e == pb && rb == pb;
  const int64_t block_numel = group_plan("", block_params(a, TP), S, e).numel;

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
    for (int64_t l = st.first_layer; l < st.first_layer + st.num_layers; ++l) {
      st.fqns.push_back("layers." + std::to_string(l));
      st.groups.push_back(group_plan("layers." + std::to_string(l), block_params(a, TP), S, e));
    }
    // The stage's root group: what is left of tok_embeddings / norm + output (nothing on middle stages).
    const int64_t vocab = ceil_div(a.vocab_size, TP);
    std::vector<ParamShape> root;
    if (st.has_embedding) root.push_back({vocab, a.dim});
    if (st.has_output) {
      st.fqns.push_back("norm");
      st.fqns.push_back("output");
      root.push_back({a.dim, 1});
      root.push_back({vocab, a.dim});
    }
    if (!root.empty()) st.groups.push_back(group_plan("root", root, S, e));
    for (const auto& g : st.groups) {
      st.numel += g.numel;
      st.shard_numel += g.shard_numel;
    }
    st.unsharded_param_bytes = alias ? 0 : st.numel * e;
    st.accumulated_grad_bytes = st.numel * rb;
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
  }

  MemoryPlan& mem = plan.memory;
  mem = MemoryPlan{};
  mem.params = w.params;
  mem.grads = w.grads;
  mem.optimizer = w.optimizer;
  mem.runtime = c.runtime_overhead;
  mem.unsharded_peak = w.unsharded;
  mem.activations = w.activations;
  mem.sharded_grads_at_peak = w.sharded_grads;
  mem.total = w.peak;
  mem.peak_moment = w.peak_moment;
  mem.act_per_layer_full = act.full_per_layer;
  mem.act_per_layer_checkpointed = act.checkpointed_per_layer;
  mem.saved_activations = w.activations;
  mem.step_peak = w.peak - (w.params + w.optimizer + c.runtime_overhead);
  plan.comm = w.comm;
}

// The pipeline section of format_plan: stages with their layers, per-rank peaks and sends, the bubble.
void format_pipeline(std::ostringstream& os, const Plan& p) {
  const PipelinePlan& pl = p.pipeline;
  char buf[160];
  os << "pipeline   " << pl.schedule << ", " << pl.num_stages << " stages (" << pl.stages_per_rank << " per rank), "
     << pl.microbatches << " microbatches\n";
  for (const auto& st : pl.stages) {
    std::string parts;
    auto add = [&](const std::string& part) {
      if (part.empty()) return;
      parts += (parts.empty() ? "" : ", ") + part;
    };
    if (st.has_embedding) add("tok_embeddings");
    add(layer_range(st.first_layer, st.num_layers));
    if (st.has_output) add("norm, output");
    os << "  stage " << st.stage << " on pp rank " << st.rank << ": " << parts << " (" << st.num_layers
       << " layers; " << gib(st.activation_bytes_per_microbatch) << " saved per microbatch)\n";
  }
  for (const auto& r : pl.ranks) {
    std::string stages;
    for (int s : r.stages) stages += (stages.empty() ? "" : ",") + std::to_string(s);
    os << "  pp rank " << r.rank << ": stages " << stages << ", peak " << r.peak_microbatches_in_flight
       << " microbatches in flight, peak memory " << gib(r.peak_bytes) << " (" << r.peak_moment << "), sends "
       << gib(r.pp_send_bytes) << "\n";
  }
  std::snprintf(buf, sizeof buf, "%.4f (simulated, F=1 B=2 I=W=1 per effective layer); closed form at equal stages %.4f",
                pl.bubble_fraction, pl.bubble_closed_form);
  os << "  bubble fraction " << buf << "\n";
}

}  // namespace

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

ACMode parse_ac_mode(const std::string& s) {
  if (s == "none") return ACMode::None;
  if (s == "selective") return ACMode::Selective;
  if (s == "full") return ACMode::Full;
  TORCH_CHECK(false, "fsdp-plan: unknown AC mode '", s, "' (none | selective | full)");
}

c10::ScalarType parse_dtype(const std::string& s) {
  if (s == "fp32" || s == "float32" || s == "float") return c10::kFloat;
  if (s == "bf16" || s == "bfloat16") return c10::kBFloat16;
  if (s == "fp16" || s == "float16" || s == "half") return c10::kHalf;
  TORCH_CHECK(false, "fsdp-plan: unknown dtype '", s, "' (fp32 | bf16 | fp16)");
}

Plan make_plan(const PlanConfig& c) {
  const auto& a = c.args;
  TORCH_CHECK(c.shard >= 1 && c.replicate >= 1, "fsdp-plan: mesh degrees must be >= 1");
  TORCH_CHECK(c.pp >= 1 && c.pp <= 65536, "fsdp-plan: pp must be in [1, 65536], got ", c.pp);
  TORCH_CHECK(c.pp > 1 || (c.microbatches == 1 && c.stages_per_rank == 0 && !c.layers_per_stage),
              "fsdp-plan: microbatches (", c.microbatches, "), stages_per_rank (", c.stages_per_rank,
              ") and layers_per_stage apply to pipeline parallelism: they need pp > 1");
  TORCH_CHECK(c.block_reshard >= 0 && (c.block_reshard <= 1 || c.shard % c.block_reshard == 0),
              "fsdp-plan: reshard_after_forward=", c.block_reshard, " must divide the shard degree ", c.shard);
  Plan plan;
  plan.config = c;
  const int64_t e = bytes_of(c.compute_dtype), pb = bytes_of(c.param_dtype), rb = bytes_of(c.reduce_dtype),
                ob = bytes_of(c.optim_dtype);
  const int64_t S = c.shard, R = c.replicate, TP = c.tp;
  TORCH_CHECK(TP >= 1, "fsdp-plan: tp must be >= 1");
  if (TP > 1) {
    TORCH_CHECK(a.n_heads % TP == 0 && a.kv_heads() % TP == 0, "fsdp-plan: tp ", TP, " must divide n_heads ",
                a.n_heads, " and n_kv_heads ", a.kv_heads());
    TORCH_CHECK(!a.tie_embeddings, "fsdp-plan: tensor parallel needs untied embeddings");
    TORCH_CHECK(c.seq_len % TP == 0, "fsdp-plan: seq ", c.seq_len, " must divide by tp ", TP, " (sequence parallel)");
  }

  for (int64_t l = 0; l < a.n_layers; ++l) {
    plan.groups.push_back(group_plan("layers." + std::to_string(l), block_params(a, TP), S, e));
  }
  plan.groups.push_back(group_plan("root", root_params(a, TP), S, e));
  {
    int64_t global = 0;
    for (int64_t l = 0; l < a.n_layers; ++l) global += group_plan("", block_params(a), 1, e).numel;
    global += group_plan("", root_params(a), 1, e).numel;
    plan.num_params = global;
  }
  TORCH_CHECK(plan.num_params == nn::llama::num_params(a), "fsdp-plan internal: parameter shapes give ",
              plan.num_params, " but llama::num_params gives ", nn::llama::num_params(a));
  const GroupPlan& block = plan.groups.front();
  const GroupPlan& root = plan.groups.back();

  // ---- persistent: sharded params, sharded grads (param dtype), optimizer states ----
  int64_t shard_numel = 0;
  for (const auto& g : plan.groups) shard_numel += g.shard_numel;
  MemoryPlan& m = plan.memory;
  m.params = shard_numel * pb;
  m.grads = shard_numel * pb;
  m.optimizer = c.optim_states * shard_numel * ob;

  // ---- activations saved per block, per token (docs/planner.md, "Activations") ----
  const int64_t T = c.local_batch * c.seq_len;
  const int64_t D = a.dim, F = ceil_div(a.ffn_hidden_dim(), TP);
  const ActivationModel act = activation_model(c, T);
  m.act_per_layer_full = act.full_per_layer;
  m.act_per_layer_checkpointed = act.checkpointed_per_layer;
  const std::vector<int64_t>& layer_saved = act.layer_saved;
  const std::vector<bool>& recomputed = act.recomputed;
  int64_t saved_layers_bytes = 0;
  for (int64_t b : layer_saved) saved_layers_bytes += b;

  // ---- root and loss ----
  const int64_t final_norm = act.final_norm;
  const int64_t logits = act.logits;
  const int64_t held_logits = c.loss.free_logits_before_backward ? 0 : logits;
  const int64_t lsm_bytes = act.lsm_bytes;
  // log-softmax backward: its saved output, the incoming gradient (nll backward, dense) and its result.
  const int64_t loss_bwd = held_logits + 3 * lsm_bytes;
  const int64_t loss_fwd = act.loss_forward;
  // A shard group of one rank with nothing cast (a TP-only mesh, replicate x shard 1): the unsharded parameters
  // alias the sharded ones and no all-gather or reduce-scatter buffer exists (fully_shard's size-1 fast path).
  const bool alias = S == 1 && e == pb && rb == pb;
  m.root_unsharded = alias ? 0 : root.numel * e;

  // ---- block groups in flight ----
  const int64_t U = block.numel * e;                    // one block's unsharded params (or grads)
  const int64_t U_params = alias ? 0 : U;               // beyond the sharded params
  const int64_t ag_buffer = alias ? 0 : S * block.all_gather_bytes;  // flat all-gather output (before copy-out)
  const int64_t rs_buffers = alias ? 0 : 2 * S * block.shard_numel * rb + block.shard_numel * rb;  // input, received, output
  const int64_t fwd_in_flight = U_params + (a.n_layers > 1 ? ag_buffer : 0);  // current + prefetched next
  const int64_t bwd_in_flight = U_params + U + rs_buffers + (a.n_layers > 1 ? ag_buffer : 0);  // params, grads, prev RS, prefetch
  // Gradient of the activations flowing through a block's backward (docs/planner.md): the incoming and outgoing
  // residual gradients and the SwiGLU intermediates' gradients.
  const int64_t grad_workspace = T * e * (2 * D / TP + 3 * F);
  m.runtime = c.runtime_overhead;
  // Sharded grads are freed by zero_grad(set_to_none): they exist from the reduce-scatters to the optimizer step.
  const int64_t persist = m.params + m.optimizer + m.runtime;

  struct Moment {
    std::string name;
    int64_t unsharded, acts, loss, sharded_grads;
  };
  std::vector<Moment> moments = {
      {"end of forward (log-softmax computed)", m.root_unsharded, saved_layers_bytes + final_norm, loss_fwd, 0},
      {"start of backward (log-softmax backward)", m.root_unsharded, saved_layers_bytes + final_norm, loss_bwd, 0},
  };
  // Backward of block i (last to first): the blocks below i still hold their activations, block i's are
  // recomputed if checkpointed; the blocks above have been reduce-scattered into sharded gradients; the root's
  // output-projection gradient (unsharded) waits for the root's reduce-scatter at the very end.
  int64_t acts_below = saved_layers_bytes;
  for (int64_t i = a.n_layers - 1; i >= 0; --i) {
    const int64_t acts = acts_below + (recomputed[i] ? m.act_per_layer_full : 0) + grad_workspace;
    moments.push_back({"backward of block " + std::to_string(i), m.root_unsharded + ceil_div(a.vocab_size, TP) * D * e + bwd_in_flight, acts,
                       held_logits, (a.n_layers - 1 - i) * block.shard_numel * pb});
    acts_below -= layer_saved[i];
  }
  // End of backward: the root's gradients packed into its reduce-scatter input (its params already resharded).
  const int64_t root_rs = std::max(root.numel * e + S * root.shard_numel * rb, (2 * S + 1) * root.shard_numel * rb);
  moments.push_back({"end of backward (root reduce-scatter)", root_rs, 0, held_logits,
                     a.n_layers * block.shard_numel * pb});
  int64_t best = -1;
  for (const auto& mo : moments) {
    const int64_t total = persist + mo.unsharded + mo.acts + mo.loss + mo.sharded_grads;
    if (total > best) {
      best = total;
      m.peak_moment = mo.name;
      m.unsharded_peak = mo.unsharded - m.root_unsharded;
      m.activations = mo.acts;
      m.loss = mo.loss;
      m.sharded_grads_at_peak = mo.sharded_grads;
    }
  }
  // Forward of the first block: its own params + prefetched buffer with almost no activations (never the peak
  // when activations dominate, but it is for tiny batches).
  const int64_t fwd_first = persist + m.root_unsharded + fwd_in_flight;
  if (fwd_first > best) {
    best = fwd_first;
    m.peak_moment = "forward of the first block";
    m.unsharded_peak = fwd_in_flight;
    m.activations = 0;
    m.loss = 0;
  }
  // Optimizer step: params, grads, states, one temporary of the largest shard.
  const int64_t optim_step = persist + m.grads + held_logits;
  if (optim_step > best) {
    best = optim_step;
    m.peak_moment = "optimizer step";
    m.unsharded_peak = 0;
    m.activations = 0;
    m.loss = held_logits;
    m.sharded_grads_at_peak = m.grads;
  }
  m.root_unsharded = m.peak_moment == "optimizer step" ? 0 : m.root_unsharded;
  m.total = best;
  m.saved_activations = saved_layers_bytes + final_norm;
  const int64_t blocks_unsharded_after_forward =
      c.block_reshard == 0 ? a.n_layers : (c.keep_last_block_unsharded && a.n_layers > 0 ? 1 : 0);
  m.end_of_forward = (alias ? 0 : root.numel * e) + blocks_unsharded_after_forward * U_params + m.saved_activations +
                     loss_fwd;
  m.step_peak = best - persist;

  // ---- communication per step ----
  CommPlan& cm = plan.comm;
  const int64_t n_groups = static_cast<int64_t>(plan.groups.size());
  for (const auto& g : plan.groups) {
    const bool is_root = &g == &plan.groups.back();
    if (S > 1) {
      cm.all_gather_bytes += (S - 1) * g.all_gather_bytes;  // forward
      cm.all_gather_calls += 1;
      cm.optimum_bytes += (S - 1) * g.numel * e / S;
      const bool kept = c.keep_last_block_unsharded && &g == &plan.groups[plan.groups.size() - 2];
      if (!is_root && c.block_reshard == 1 && !kept) {  // re-gathered in backward
        cm.all_gather_bytes += (S - 1) * g.all_gather_bytes;
        cm.all_gather_calls += 1;
        cm.optimum_bytes += (S - 1) * g.numel * e / S;
      } else if (!is_root && c.block_reshard > 1 && !kept) {  // hpZ: within N ranks, from the N-way copy
        const int64_t N = c.block_reshard;
        cm.all_gather_bytes += (N - 1) * (S / N) * g.all_gather_bytes;
        cm.all_gather_calls += 1;
        cm.optimum_bytes += (N - 1) * g.numel * e / N;
      }
    }
    add_gradient_reduction(cm, g, S, R, rb);
  }
  (void)n_groups;
  cm.total_bytes = cm.all_gather_bytes + cm.reduce_scatter_bytes + cm.all_reduce_bytes;
  if (TP > 1) {
    // Byte model of docs/comm.md over the TP group. One sequence-sharded activation [T/tp, D] is all-gathered
    // ((tp-1) x its bytes) or reduce-scattered from [T, D] ((tp-1)/tp of that): per block 2 + 2 in forward
    // (PrepareModuleInput, wo/w2), the mirrors in backward, the forward ones again when the block is
    // recomputed; the root: the embedding's reduce-scatter and the output layer's input all-gather, and their
    // mirrors. All-reduces: the norm weights' gradients (3 per block pair + final), the loss's 3 [T] vectors.
    const int64_t shard_act = T / TP * D * e;
    const int64_t ag_one = (TP - 1) * shard_act, rs_one = (TP - 1) * (T * D * e) / TP;
    int64_t recomputed_blocks = 0;
    for (bool r : recomputed) recomputed_blocks += r ? 1 : 0;
    const int64_t per_dir = 4 * a.n_layers + 2 + 2 * recomputed_blocks;
    cm.tp_all_gather_calls = per_dir;
    cm.tp_reduce_scatter_calls = per_dir;
    cm.tp_all_gather_bytes = per_dir * ag_one;
    cm.tp_reduce_scatter_bytes = per_dir * rs_one;
    if (!c.loss_parallel) {
      cm.tp_all_gather_calls += 1;
      cm.tp_all_gather_bytes += (TP - 1) * T * ceil_div(a.vocab_size, TP) * e;
    }
    const auto ar = [&](int64_t bytes) { return 2 * (TP - 1) * bytes / TP; };
    cm.tp_all_reduce_calls = 2 * a.n_layers + 1;
    cm.tp_all_reduce_bytes = (2 * a.n_layers + 1) * ar(D * e);
    if (c.loss_parallel) {
      cm.tp_all_reduce_calls += 3;
      cm.tp_all_reduce_bytes += ar((T + 1) * 4) + 2 * ar(T * 4);
    }
    cm.tp_total_bytes = cm.tp_all_gather_bytes + cm.tp_reduce_scatter_bytes + cm.tp_all_reduce_bytes;
  }
  if (c.pp > 1) plan_pipeline(c, plan);
  return plan;
}

std::string format_plan(const Plan& p) {
  const auto& c = p.config;
  const auto& m = p.memory;
  std::ostringstream os;
  auto dt = [](c10::ScalarType t) { return std::string(c10::toString(t)); };
  const char* ac = c.ac == ACMode::None ? "none" : c.ac == ACMode::Full ? "full" : "selective";
  os << "model      llama3 " << (c.flavor.empty() ? "(custom)" : c.flavor) << ": " << p.num_params << " parameters ("
     << static_cast<double>(p.num_params) / 1e9 << " B), " << c.args.n_layers << " blocks + root\n";
  const PipelinePlan& pl = p.pipeline;
  if (pl.enabled) {
    os << "mesh       pp " << c.pp << " x replicate " << c.replicate << " x shard " << c.shard << " x tp " << c.tp
       << " = " << c.pp * c.replicate * c.shard * c.tp << " ranks";
  } else {
    os << "mesh       replicate " << c.replicate << " x shard " << c.shard << " x tp " << c.tp << " = "
       << c.replicate * c.shard * c.tp << " ranks";
  }
  if (c.tp > 1) os << " (TP: sequence parallel, " << (c.loss_parallel ? "loss parallel" : "logits gathered") << ")";
  os << "\n";
  os << "dtypes     params " << dt(c.param_dtype) << ", compute " << dt(c.compute_dtype) << ", reduce "
     << dt(c.reduce_dtype) << ", optimizer states " << dt(c.optim_dtype) << " x " << c.optim_states << "\n";
  os << "batch      local " << c.local_batch << " x seq " << c.seq_len << "; AC " << ac;
  if (c.ac == ACMode::Selective) {
    os << (c.selective == SelectiveKind::Op ? " (op)" : " (every " + std::to_string(c.selective_every) + " layers)");
  }
  if (pl.enabled) {
    os << "; " << pl.microbatches << " microbatches of " << pl.microbatch_size
       << "; FSDP keeps parameters unsharded across microbatches (reshard_after_forward=false under PP)\n";
    format_pipeline(os, p);
  } else {
    os << "; blocks reshard_after_forward=" << (c.block_reshard == 0 ? "false" : c.block_reshard == 1 ? "true" : std::to_string(c.block_reshard)) << "\n";
  }
  if (pl.enabled) {
    os << "memory of pp rank " << pl.planned_rank << " (the largest peak)\n";
    os << "  params (sharded)        " << gib(m.params) << "\n";
    os << "  grads (sharded)         " << gib(m.grads) << "  (from each stage's REDUCE_GRAD to zero_grad)\n";
    os << "  optimizer states        " << gib(m.optimizer) << "\n";
    os << "  sharded grads at peak   " << gib(m.sharded_grads_at_peak) << "\n";
    os << "  unsharded params        " << gib(pl.unsharded_params_at_peak) << "  (its stages between UNSHARD and RESHARD)\n";
    os << "  accumulated grads       " << gib(pl.accumulated_grads_at_peak)
       << "  (unsharded, reduce dtype, first backward to REDUCE_GRAD)\n";
    os << "  activations             " << gib(pl.activations_at_peak) << "  (" << pl.microbatches_at_peak
       << " microbatches in flight; per block and microbatch: " << gib(m.act_per_layer_full) << " saved, "
       << gib(m.act_per_layer_checkpointed) << " checkpointed)\n";
    os << "  transient               " << gib(pl.transient_at_peak) << "  (the running action's gradients, "
       << "recomputation, loss or reduce-scatter buffers)\n";
    if (m.runtime) os << "  runtime overhead        " << gib(m.runtime) << "\n";
    os << "  peak                    " << gib(m.total) << "  at: " << m.peak_moment << "\n";
  } else {
    os << "memory per rank\n";
    os << "  params (sharded)        " << gib(m.params) << "\n";
    os << "  grads (sharded)         " << gib(m.grads) << "  (freed by zero_grad; present at the optimizer step)\n";
    os << "  optimizer states        " << gib(m.optimizer) << "\n";
    os << "  sharded grads at peak   " << gib(m.sharded_grads_at_peak) << "\n";
    os << "  root unsharded params   " << gib(m.root_unsharded) << "\n";
    os << "  blocks in flight        " << gib(m.unsharded_peak) << "\n";
    os << "  activations             " << gib(m.activations) << "  (per block: " << gib(m.act_per_layer_full)
       << " saved, " << gib(m.act_per_layer_checkpointed) << " checkpointed)\n";
    os << "  loss (logits etc.)      " << gib(m.loss) << "\n";
    if (m.runtime) os << "  runtime overhead        " << gib(m.runtime) << "\n";
    os << "  peak                    " << gib(m.total) << "  at: " << m.peak_moment << "\n";
    os << "  AC: saved activations   " << gib(m.saved_activations) << "  (end of forward above params+optimizer: "
       << gib(m.end_of_forward) << "; peak above them: " << gib(m.step_peak) << ")\n";
  }
  const auto& cm = p.comm;
  os << "communication per rank per step\n";
  os << "  all-gather              " << gib(cm.all_gather_bytes) << " (" << cm.all_gather_calls << " calls)\n";
  os << "  reduce-scatter          " << gib(cm.reduce_scatter_bytes) << " (" << cm.reduce_scatter_calls << " calls)\n";
  os << "  all-reduce (HSDP)       " << gib(cm.all_reduce_bytes) << " (" << cm.all_reduce_calls << " calls)\n";
  os << "  total                   " << gib(cm.total_bytes) << "  (optimum without padding: " << gib(cm.optimum_bytes)
     << ")\n";
  if (c.tp > 1) {
    os << "  tp all-gather           " << gib(cm.tp_all_gather_bytes) << " (" << cm.tp_all_gather_calls << " calls)\n";
    os << "  tp reduce-scatter       " << gib(cm.tp_reduce_scatter_bytes) << " (" << cm.tp_reduce_scatter_calls
       << " calls)\n";
    os << "  tp all-reduce           " << gib(cm.tp_all_reduce_bytes) << " (" << cm.tp_all_reduce_calls << " calls)\n";
    os << "  tp total                " << gib(cm.tp_total_bytes) << "\n";
  }
  if (pl.enabled) {
    os << "  pp send                 " << gib(cm.pp_send_bytes) << " (" << cm.pp_send_calls << " sends of "
       << gib(pl.boundary_bytes) << ")\n";
  }
  return os.str();
}

}  // namespace fsdp::plan
