// fsdp-plan's model (see plan.h and docs/planner.md for the formulas and what they assume).
#include "plan.h"

#include <fsdp/models/moe.h>
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

// A group's parameters by the mesh they shard over: the dense part over the S shard ranks, and in an MoE block
// the routed experts of this rank over expert_shard (efsdp) ranks. `own_call`: the part is its own FSDP
// parameter group (one collective of its own); the experts of an ep = 1 block travel in the block's.
struct ShardedPart {
  int64_t numel = 0;  // unsharded on this rank
  int64_t shard_numel = 0, all_gather_bytes = 0, ranks = 1;
  bool own_call = true, experts = false;
};

std::vector<ShardedPart> parts_of(const GroupPlan& g, int64_t S) {
  std::vector<ShardedPart> out;
  out.push_back({g.local_numel - g.expert_numel, g.shard_numel - g.expert_shard_numel,
                 g.all_gather_bytes - g.expert_all_gather_bytes, S, true, false});
  if (g.expert_shard > 0) {
    out.push_back({g.expert_numel, g.expert_shard_numel, g.expert_all_gather_bytes, g.expert_shard, g.expert_group,
                   true});
  }
  return out;
}

// One all-gather of a group (each part over its own ranks: (n-1) x slot bytes), `times` the bytes when an hpZ
// re-gather sends (N-1) x S/N slots instead (`hpz` = N > 1, dense blocks only).
void add_all_gather(CommPlan& cm, const GroupPlan& g, int64_t S, int64_t e, int64_t hpz = 0) {
  for (const ShardedPart& p : parts_of(g, S)) {
    if (p.ranks <= 1) continue;
    const int64_t bytes = hpz > 1 ? (hpz - 1) * (p.ranks / hpz) * p.all_gather_bytes : (p.ranks - 1) * p.all_gather_bytes;
    const int64_t optimum = hpz > 1 ? (hpz - 1) * p.numel * e / hpz : (p.ranks - 1) * p.numel * e / p.ranks;
    cm.all_gather_bytes += bytes;
    cm.optimum_bytes += optimum;
    if (p.own_call) cm.all_gather_calls += 1;
    if (p.experts) {
      cm.expert_all_gather_bytes += bytes;
      if (p.own_call) cm.expert_all_gather_calls += 1;
    }
  }
}

// One group's gradient reduction per step: a reduce-scatter over each part's shard ranks and, with R > 1
// replicas, HSDP's all-reduce of the shard over them (docs/comm.md's byte model); `rb` = bytes per reduce-dtype
// element.
void add_gradient_reduction(CommPlan& cm, const GroupPlan& g, int64_t S, int64_t R, int64_t rb) {
  for (const ShardedPart& p : parts_of(g, S)) {
    if (p.ranks > 1) {
      const int64_t bytes = (p.ranks - 1) * p.shard_numel * rb;
      cm.reduce_scatter_bytes += bytes;
      cm.optimum_bytes += (p.ranks - 1) * p.numel * rb / p.ranks;
      if (p.own_call) cm.reduce_scatter_calls += 1;
      if (p.experts) {
        cm.expert_reduce_scatter_bytes += bytes;
        if (p.own_call) cm.expert_reduce_scatter_calls += 1;
      }
    }
    if (R > 1) {
      const int64_t bytes = 2 * (R - 1) * p.shard_numel * rb / R;
      cm.all_reduce_bytes += bytes;
      cm.optimum_bytes += 2 * (R - 1) * (p.numel / p.ranks) * rb / R;
      if (p.own_call) cm.all_reduce_calls += 1;
      if (p.experts) {
        cm.expert_all_reduce_bytes += bytes;
        if (p.own_call) cm.expert_all_reduce_calls += 1;
      }
    }
  }
}

struct ParamShape {
  int64_t dim0, row;  // [dim0, row] (1-D: row = 1)
};

bool is_moe(const nn::llama::LlamaArgs& a, int64_t layer) { return a.moe.has_value() && a.is_moe_layer(layer); }

// The parameters of one block / of the root (src/models/llama.cpp, src/models/moe.cpp), as one TP rank holds
// them (TorchTitan's plan: colwise wq wk wv w1 w3 split dim 0, rowwise wo w2 split dim 1, the embedding and
// the output projection split the vocabulary, norms replicated; rank 0's torch.chunk piece, the largest). An
// MoE block's routed experts are not here (expert_params): they shard over another mesh.
std::vector<ParamShape> block_params(const nn::llama::LlamaArgs& a, int64_t layer, int64_t tp = 1) {
  const int64_t hq = ceil_div(a.n_heads * a.head_dim(), tp), hkv = ceil_div(a.kv_heads() * a.head_dim(), tp),
                f = ceil_div(a.ffn_hidden_dim(), tp), D = a.dim;
  std::vector<ParamShape> p = {{hq, D}, {hkv, D}, {hkv, D}, {D, hq}};  // attention wq wk wv wo
  if (a.qk_norm) p.insert(p.end(), {{a.head_dim(), 1}, {a.head_dim(), 1}});  // q_norm, k_norm (whole under TP)
  if (is_moe(a, layer)) {
    const nn::moe::MoEOptions o = a.moe_options();
    p.push_back({o.num_experts, D});  // router.gate
    if (o.num_shared_experts > 0) {
      const int64_t fs = o.hidden * o.num_shared_experts;
      p.insert(p.end(), {{fs, D}, {D, fs}, {fs, D}});  // shared_experts w1 w2 w3
    }
  } else {
    p.insert(p.end(), {{f, D}, {D, f}, {f, D}});  // feed_forward w1 w2 w3
  }
  p.insert(p.end(), {{D, 1}, {D, 1}});  // attention_norm, ffn_norm
  return p;
}

// Where the routed experts shard (apps/fsdp-train/parallelize.cpp, TorchTitan's apply_fsdp): dim 1 when the
// shard degree exceeds the number of experts (tt#1561), else dim 0; over efsdp = S / ep ranks.
int64_t expert_shard_dim(const PlanConfig& c) { return c.shard > c.args.moe_options().num_experts ? 1 : 0; }

// This rank's routed experts (E/ep of them) as ParamShapes whose dim0 is the FSDP shard dim: w1 [E/ep, F, D],
// w2 [E/ep, D, F], w3 [E/ep, F, D]; Shard(1) cuts F of w1 / w3 and D of w2.
std::vector<ParamShape> expert_params(const nn::moe::MoEOptions& o, int64_t ep, int64_t dim) {
  const int64_t El = o.num_experts / ep, F = o.hidden, D = o.dim;
  if (dim == 0) return {{El, F * D}, {El, D * F}, {El, F * D}};
  return {{F, El * D}, {D, El * F}, {F, El * D}};
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
  g.local_numel = g.numel;
  return g;
}

// Block `layer`'s group: its dense parameters over the S shard ranks, plus in an MoE block this rank's routed
// experts over efsdp = S / ep ranks (expert_params).
GroupPlan block_group(const PlanConfig& c, int64_t layer, int64_t tp) {
  const int64_t e = bytes_of(c.compute_dtype);
  GroupPlan g = group_plan("layers." + std::to_string(layer), block_params(c.args, layer, tp), c.shard, e);
  if (!is_moe(c.args, layer)) return g;
  const int64_t dim = expert_shard_dim(c), efsdp = c.shard / c.ep;
  const GroupPlan x = group_plan("", expert_params(c.args.moe_options(), c.ep, dim), efsdp, e);
  g.expert_numel = x.numel;
  g.expert_shard_numel = x.shard_numel;
  g.expert_all_gather_bytes = x.all_gather_bytes;
  g.expert_shard = efsdp;
  g.expert_shard_dim = dim;
  g.expert_group = c.ep > 1;
  g.numel += x.numel * c.ep;
  g.local_numel += x.numel;
  g.shard_numel += x.shard_numel;
  g.all_gather_bytes += x.all_gather_bytes;
  return g;
}

// What autograd saves for a batch of T tokens (docs/planner.md, "Activations"): per block under the configured
// AC, and for the final norm and the loss. The pipeline planner evaluates it at one microbatch's tokens.
struct ActivationModel {
  int64_t full_per_layer = 0;          // a block that saves everything (the first block; blocks alike without MoE)
  int64_t moe_per_layer = 0, dense_per_layer = 0;  // an MoE / a dense block that saves everything (0: none)
  std::vector<int64_t> layer_full;     // per block: everything it saves (what a recomputation rebuilds)
  std::vector<int64_t> layer_workspace;  // per block: gradients in flight through its backward
  int64_t checkpointed_per_layer = 0;  // a checkpointed block: its input only
  std::vector<int64_t> layer_saved;    // per block, under the configured AC
  std::vector<bool> recomputed;        // per block: its backward first recomputes its forward
  int64_t final_norm = 0;
  int64_t logits = 0;                  // T x V (per TP rank) in the compute dtype
  int64_t lsm = 0;                     // T x V x 4: the float32 copy / log-softmax output when upcast
  int64_t lsm_bytes = 0;               // the log-softmax output
  int64_t loss_forward = 0;            // logits, log-softmax output and the float32 copy when upcast
  int64_t grad_workspace = 0;          // gradients in flight through one block's backward (the first block's)
};

// What an MoE feed-forward (src/models/moe.cpp; with ep > 1 src/expert_parallel) saves for backward, per token,
// under uniform routing (each ep rank receives, and its experts compute, T k rows in all). k = top_k, E experts,
// F = expert hidden, Fs = shared experts' hidden, e = compute dtype bytes. docs/planner.md lists the tensors.
int64_t moe_saved_per_token(const PlanConfig& c) {
  const nn::moe::MoEOptions o = c.args.moe_options();
  const int64_t e = bytes_of(c.compute_dtype), k = o.top_k, E = o.num_experts, F = o.hidden, D = c.args.dim,
                Fs = o.hidden * o.num_shared_experts;
  return 4 * E                            // router scores (softmax / sigmoid output, float32)
         + 8 * k                          // chosen expert ids (gather's index)
         + (o.route_norm ? 4 * k + 4 : 0)  // chosen scores and their sum (the normalising division)
         + 8 * k + 8 * k                  // slot -> token index (index_select, index_add), expert order (weights')
         + 4 * k                          // each slot's weight (float32) for the weight multiply
         + k * D * e                      // the experts' input rows (grouped GEMM's saved input)
         + 4 * k * F * e                  // SwiGLU of the rows: w1 out, silu out, w3 out, product
         + 4 * k * D                      // expert outputs in float32, the weight multiply's other operand
         + k * D * e                      // the weighted outputs (index_add's source: its backward expands to it)
         + (c.ep > 1 ? 16 * k : 0)        // EP: the regrouping permutation and its inverse (index_select's indices)
         + 4 * Fs * e;                    // shared experts' SwiGLU (their input is the norm's saved output)
}

ActivationModel activation_model(const PlanConfig& c, int64_t T) {
  const auto& a = c.args;
  const int64_t e = bytes_of(c.compute_dtype), TP = c.tp;
  ActivationModel out;
  // With TP, heads and the FFN hidden dim are split (per token of the whole sequence, which the colwise layers
  // see gathered); norms run on this rank's 1/tp of the tokens (sequence parallel).
  const int64_t D = a.dim, hq = a.n_heads * a.head_dim() / TP, hkv = a.kv_heads() * a.head_dim() / TP,
                F = ceil_div(a.ffn_hidden_dim(), TP), heads = a.n_heads / TP;
  const bool gqa = a.n_heads != a.kv_heads();
  // QK-norm (Qwen3): q_norm / k_norm over head_dim save their float32 input (wq / wk out, which RoPE alone would
  // not keep), the normalized tensor (compute dtype) and one float32 rsqrt per head row; their output goes to
  // RoPE, whose roped result SDPA saves (counted in attn).
  const int64_t qk = a.qk_norm ? (4 + e) * (hq + hkv) + 4 * (heads + a.kv_heads() / TP) : 0;
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
  const int64_t full_per_token = 2 * norm + attn + qk + ffn;
  const int64_t moe_per_token = a.moe ? 2 * norm + attn + qk + moe_saved_per_token(c) : 0;
  // Gradients in flight through a block's backward: the incoming and outgoing residual gradients and the SwiGLU
  // intermediates' (dense); an MoE block's over its T k rows (3 F of SwiGLU, the rows' D, the float32 outputs'
  // 4 D) and the shared experts'. Rough (docs/planner.md).
  const int64_t dense_workspace = T * e * (2 * D / TP + 3 * F);
  int64_t moe_workspace = 0;
  if (a.moe) {
    const nn::moe::MoEOptions o = a.moe_options();
    moe_workspace = T * (e * 2 * D + o.top_k * (e * (3 * o.hidden + D) + 4 * D) + 3 * e * o.hidden * o.num_shared_experts);
  }
  for (int64_t l = 0; l < a.n_layers; ++l) {
    out.layer_full.push_back(T * (is_moe(a, l) ? moe_per_token : full_per_token));
    out.layer_workspace.push_back(is_moe(a, l) ? moe_workspace : dense_workspace);
    (is_moe(a, l) ? out.moe_per_layer : out.dense_per_layer) = out.layer_full.back();
  }
  out.full_per_layer = a.n_layers > 0 ? out.layer_full.front() : T * full_per_token;
  out.checkpointed_per_layer = T * e * D / TP;  // the block input only (sequence-sharded under TP)
  // Op-level SAC: the block input and a copy of every other matmul output (wq, wv, w1, w2); TorchTitan's policy
  // also keeps the SDPA output and log-sum-exp. Under TP the rowwise w2's matmul output is the full-sequence
  // partial sum [T, D], saved before its reduce-scatter.
  const int64_t op_sac_per_token =
      e * (D / TP + hq + hkv + F + D) + (c.op_sac_saves_attention ? e * hq + 4 * heads : 0);
  out.layer_saved = out.layer_full;
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
  out.grad_workspace = a.n_layers > 0 ? out.layer_workspace.front() : dense_workspace;
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
  const int64_t block_numel = group_plan("", block_params(a, 0, TP), S, e).numel;  // blocks alike (no MoE under PP)

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
      st.groups.push_back(group_plan("layers." + std::to_string(l), block_params(a, l, TP), S, e));
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
    case pl::ScheduleKind::DualPipeV:  // no closed form: the simulated value only
    case pl::ScheduleKind::Csv:
      pp.bubble_closed_form = -1;
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
  if (pl.bubble_closed_form < 0)
    std::snprintf(buf, sizeof buf, "%.4f (simulated, F=1 B=2 I=W=1 per effective layer); no closed form",
                  pl.bubble_fraction);
  else
    std::snprintf(buf, sizeof buf,
                  "%.4f (simulated, F=1 B=2 I=W=1 per effective layer); closed form at equal stages %.4f",
                  pl.bubble_fraction, pl.bubble_closed_form);
  os << "  bubble fraction " << buf << "\n";
}

// MoE and expert parallelism: what the planner models and what it refuses (as fsdp-train refuses it).
void check_moe(const PlanConfig& c) {
  const auto& a = c.args;
  TORCH_CHECK(c.ep >= 1, "fsdp-plan: ep must be >= 1, got ", c.ep);
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < a.n_layers; ++l) moe_layers += is_moe(a, l) ? 1 : 0;
  const std::string model = c.model + " " + (c.flavor.empty() ? std::string("(custom)") : c.flavor);
  if (moe_layers == 0) {
    TORCH_CHECK(c.ep == 1, "fsdp-plan: --ep ", c.ep, " needs an MoE model, but ", model,
                " has no MoE layers (use --model qwen3 with a *_moe flavor, 30B-A3B or 235B-A22B)");
    return;
  }
  TORCH_CHECK(c.tp == 1 && c.pp == 1, "fsdp-plan: ", model, " has MoE layers; MoE with ",
              c.tp > 1 ? "tensor" : "pipeline", " parallelism is not planned (fsdp-train refuses it too): use "
              "--shard, --replicate and --ep");
  const int64_t E = a.moe_options().num_experts;
  TORCH_CHECK(c.shard % c.ep == 0, "fsdp-plan: --ep ", c.ep, " must divide --shard ", c.shard,
              " (expert-parallel groups are ep consecutive ranks of a shard group; the experts' FSDP runs over the "
              "shard / ep ranks left)");
  TORCH_CHECK(E % c.ep == 0, "fsdp-plan: --ep ", c.ep, " must divide the ", E, " experts of ", model,
              " (each ep rank holds experts / ep of them)");
  TORCH_CHECK(!(c.ac == ACMode::Selective && c.selective == SelectiveKind::Op), "fsdp-plan: op-level selective AC ",
              "with an MoE model is not supported (fsdp-train refuses it: the second forward with gradients would "
              "count the experts' tokens twice); use --ac full or --selective layer");
  TORCH_CHECK(c.block_reshard <= 1, "fsdp-plan: --reshard ", c.block_reshard, " (hpZ) with MoE layers is not "
              "modelled (the experts shard over another mesh); use true or false");
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
  check_moe(c);

  for (int64_t l = 0; l < a.n_layers; ++l) plan.groups.push_back(block_group(c, l, TP));
  plan.groups.push_back(group_plan("root", root_params(a, TP), S, e));
  {
    int64_t global = 0;
    for (int64_t l = 0; l < a.n_layers; ++l) global += block_group(c, l, 1).numel;
    global += group_plan("", root_params(a), 1, e).numel;
    plan.num_params = global;
  }
  TORCH_CHECK(plan.num_params == nn::llama::num_params(a), "fsdp-plan internal: parameter shapes give ",
              plan.num_params, " but llama::num_params gives ", nn::llama::num_params(a));
  const GroupPlan& root = plan.groups.back();
  const int64_t L = a.n_layers;
  auto block = [&](int64_t i) -> const GroupPlan& { return plan.groups[static_cast<size_t>(i)]; };

  // ---- persistent: sharded params, sharded grads (param dtype), optimizer states, MoE buffers ----
  int64_t shard_numel = 0;
  for (const auto& g : plan.groups) shard_numel += g.shard_numel;
  MemoryPlan& m = plan.memory;
  m.params = shard_numel * pb;
  m.grads = shard_numel * pb;
  m.optimizer = c.optim_states * shard_numel * ob;
  for (int64_t l = 0; l < L; ++l) {
    if (!is_moe(a, l)) continue;
    const nn::moe::MoEOptions o = a.moe_options();
    // tokens_per_expert always, expert_bias with load balancing; float32 [E], whole on every rank.
    m.buffers += 4 * o.num_experts * (o.load_balance_coeff ? 2 : 1);
  }

  // ---- activations saved per block, per token (docs/planner.md, "Activations") ----
  const int64_t T = c.local_batch * c.seq_len;
  const int64_t D = a.dim;
  const ActivationModel act = activation_model(c, T);
  m.act_per_layer_full = act.full_per_layer;
  m.act_per_moe_layer = act.moe_per_layer;
  m.act_per_dense_layer = act.dense_per_layer;
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
  // A shard group of one rank with nothing cast (a TP-only mesh, replicate x shard 1; the experts' efsdp group
  // when ep = shard): the unsharded parameters alias the sharded ones and no all-gather or reduce-scatter buffer
  // exists (fully_shard's size-1 fast path).
  auto aliased = [&](int64_t ranks) { return ranks == 1 && e == pb && rb == pb; };
  const bool alias = aliased(S);
  m.root_unsharded = alias ? 0 : root.numel * e;

  // ---- block groups in flight (each part over its own mesh: dense over S, experts over efsdp) ----
  auto unsharded_grads = [&](const GroupPlan& g) { return g.local_numel * e; };  // one block's unsharded grads
  auto unsharded_params = [&](const GroupPlan& g) {  // beyond the sharded params
    int64_t b = 0;
    for (const ShardedPart& p : parts_of(g, S)) b += aliased(p.ranks) ? 0 : p.numel * e;
    return b;
  };
  auto ag_buffer = [&](const GroupPlan& g) {  // flat all-gather output (before copy-out)
    int64_t b = 0;
    for (const ShardedPart& p : parts_of(g, S)) b += aliased(p.ranks) ? 0 : p.ranks * p.all_gather_bytes;
    return b;
  };
  auto rs_buffers = [&](const GroupPlan& g) {  // reduce-scatter input, our all-to-all receive buffer, output
    int64_t b = 0;
    for (const ShardedPart& p : parts_of(g, S)) b += aliased(p.ranks) ? 0 : (2 * p.ranks + 1) * p.shard_numel * rb;
    return b;
  };
  // Forward of block 0: its params + the prefetched next block's all-gather buffer.
  const int64_t fwd_in_flight = L > 0 ? unsharded_params(block(0)) + (L > 1 ? ag_buffer(block(1)) : 0) : 0;
  // Backward of block i: its params and grads, the pending reduce-scatter of the block after it (its own for the
  // last block), the all-gather buffer prefetched for the block before it (its own for block 0). Blocks alike:
  // U + U + RS + AG of any block.
  auto bwd_in_flight = [&](int64_t i) {
    const GroupPlan& prev = block(i + 1 < L ? i + 1 : i);
    const GroupPlan& next = block(i > 0 ? i - 1 : i);
    return unsharded_params(block(i)) + unsharded_grads(block(i)) + rs_buffers(prev) + (L > 1 ? ag_buffer(next) : 0);
  };
  m.runtime = c.runtime_overhead;
  // Sharded grads are freed by zero_grad(set_to_none): they exist from the reduce-scatters to the optimizer step.
  const int64_t persist = m.params + m.optimizer + m.runtime + m.buffers;

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
  int64_t shards_above = 0;
  for (int64_t i = L - 1; i >= 0; --i) {
    const int64_t acts = acts_below + (recomputed[i] ? act.layer_full[i] : 0) + act.layer_workspace[i];
    moments.push_back({"backward of block " + std::to_string(i),
                       m.root_unsharded + ceil_div(a.vocab_size, TP) * D * e + bwd_in_flight(i), acts, held_logits,
                       shards_above * pb});
    acts_below -= layer_saved[i];
    shards_above += block(i).shard_numel;
  }
  // End of backward: the root's gradients packed into its reduce-scatter input (its params already resharded).
  const int64_t root_rs = std::max(root.numel * e + S * root.shard_numel * rb, (2 * S + 1) * root.shard_numel * rb);
  moments.push_back({"end of backward (root reduce-scatter)", root_rs, 0, held_logits, shards_above * pb});
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
  int64_t blocks_unsharded_after_forward = 0;
  if (c.block_reshard == 0) {
    for (int64_t i = 0; i < L; ++i) blocks_unsharded_after_forward += unsharded_params(block(i));
  } else if (c.keep_last_block_unsharded && L > 0) {
    blocks_unsharded_after_forward = unsharded_params(block(L - 1));
  }
  m.end_of_forward = (alias ? 0 : root.numel * e) + blocks_unsharded_after_forward + m.saved_activations + loss_fwd;
  m.step_peak = best - persist;

  // ---- communication per step ----
  CommPlan& cm = plan.comm;
  for (const auto& g : plan.groups) {
    const bool is_root = &g == &plan.groups.back();
    add_all_gather(cm, g, S, e);  // forward
    const bool kept = c.keep_last_block_unsharded && &g == &plan.groups[plan.groups.size() - 2];
    if (!is_root && c.block_reshard == 1 && !kept) {  // re-gathered in backward
      add_all_gather(cm, g, S, e);
    } else if (!is_root && c.block_reshard > 1 && !kept && S > 1) {  // hpZ: within N ranks, from the N-way copy
      add_all_gather(cm, g, S, e, c.block_reshard);
    }
    add_gradient_reduction(cm, g, S, R, rb);
  }
  cm.total_bytes = cm.all_gather_bytes + cm.reduce_scatter_bytes + cm.all_reduce_bytes;
  if (c.ep > 1) {
    // The ep dim (src/expert_parallel): per MoE layer and forward, the count exchange (E int64 split in ep
    // pieces, all but this rank's own sent), the dispatch and the combine of the T k routed rows, (ep-1)/ep of
    // them to other ranks under uniform routing; backward sends the dispatch's and the combine's gradients back;
    // a recomputed block (full / layer-selective AC) runs its forward exchanges once more.
    const nn::moe::MoEOptions o = a.moe_options();
    const int64_t ep = c.ep;
    const int64_t count_bytes = (ep - 1) * (o.num_experts / ep) * 8;
    const int64_t rows_bytes = T * o.top_k * D * e * (ep - 1) / ep;
    for (int64_t l = 0; l < L; ++l) {
      if (!is_moe(a, l)) continue;
      const int64_t forwards = recomputed[l] ? 2 : 1;
      cm.ep_count_bytes += forwards * count_bytes;
      cm.ep_dispatch_bytes += (forwards + 1) * rows_bytes;
      cm.ep_combine_bytes += (forwards + 1) * rows_bytes;
      cm.ep_all_to_all_calls += 3 * forwards + 2;
    }
    cm.ep_total_bytes = cm.ep_count_bytes + cm.ep_dispatch_bytes + cm.ep_combine_bytes;
  }
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
  os << "model      " << c.model << " " << (c.flavor.empty() ? "(custom)" : c.flavor) << ": " << p.num_params
     << " parameters (" << static_cast<double>(p.num_params) / 1e9 << " B";
  int64_t moe_layers = 0, expert_shard_numel = 0;
  const GroupPlan* moe_group = nullptr;
  for (int64_t l = 0; l < c.args.n_layers; ++l) {
    if (!is_moe(c.args, l)) continue;
    moe_layers += 1;
    moe_group = &p.groups[static_cast<size_t>(l)];
    expert_shard_numel += moe_group->expert_shard_numel;
  }
  if (moe_layers > 0) {
    os << ", " << static_cast<double>(nn::llama::num_active_params(c.args)) / 1e9 << " B active";
  }
  os << "), " << c.args.n_layers << " blocks + root\n";
  if (moe_layers > 0) {
    const nn::moe::MoEOptions o = c.args.moe_options();
    os << "MoE        " << moe_layers << " MoE blocks: " << o.num_experts << " experts of hidden " << o.hidden
       << ", top-" << o.top_k;
    if (o.num_shared_experts > 0) os << ", " << o.num_shared_experts << " shared";
    os << "; ep " << c.ep << ": " << o.num_experts / c.ep << " experts per rank, FSDP-sharded over "
       << moe_group->expert_shard << " rank(s) (" << (c.ep > 1 ? "efsdp = shard / ep" : "the shard dim") << ") on dim "
       << moe_group->expert_shard_dim << (moe_group->expert_shard_dim == 1 ? " (shard > experts)" : "")
       << "; routing-dependent terms assume uniform routing\n";
  }
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
    os << "  params (sharded)        " << gib(m.params);
    if (moe_layers > 0) os << "  (routed experts: " << gib(expert_shard_numel * bytes_of(c.param_dtype)) << ")";
    os << "\n";
    os << "  grads (sharded)         " << gib(m.grads) << "  (freed by zero_grad; present at the optimizer step)\n";
    os << "  optimizer states        " << gib(m.optimizer) << "\n";
    os << "  sharded grads at peak   " << gib(m.sharded_grads_at_peak) << "\n";
    os << "  root unsharded params   " << gib(m.root_unsharded) << "\n";
    os << "  blocks in flight        " << gib(m.unsharded_peak) << "\n";
    os << "  activations             " << gib(m.activations) << "  (per block: ";
    if (moe_layers > 0) {
      os << gib(m.act_per_moe_layer) << " saved by an MoE block";
      if (m.act_per_dense_layer > 0) os << ", " << gib(m.act_per_dense_layer) << " by a dense one";
    } else {
      os << gib(m.act_per_layer_full) << " saved";
    }
    os << ", " << gib(m.act_per_layer_checkpointed) << " checkpointed)\n";
    os << "  loss (logits etc.)      " << gib(m.loss) << "\n";
    if (m.buffers) os << "  MoE buffers             " << gib(m.buffers) << "  (expert_bias, token counts)\n";
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
  if (moe_layers > 0) {
    const std::string where = c.ep > 1 ? " (efsdp dim, own calls)" : " (shard dim, inside the blocks' calls)";
    os << "  of which routed experts: all-gather " << gib(cm.expert_all_gather_bytes) << ", reduce-scatter "
       << gib(cm.expert_reduce_scatter_bytes) << ", all-reduce " << gib(cm.expert_all_reduce_bytes) << where << "\n";
  }
  if (c.ep > 1) {
    os << "  ep all-to-all           " << gib(cm.ep_total_bytes) << " (" << cm.ep_all_to_all_calls
       << " calls: counts " << gib(cm.ep_count_bytes) << ", dispatch " << gib(cm.ep_dispatch_bytes) << ", combine "
       << gib(cm.ep_combine_bytes) << "; uniform routing; not in total)\n";
  }
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
