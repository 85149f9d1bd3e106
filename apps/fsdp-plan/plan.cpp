// fsdp-plan's model of one rank (see plan.h and docs/planner.md for what it assumes): the parameters' shards come
// from the trainer's model seam (plan_model.cpp), the activations from plan_activations.cpp; here the memory at
// each moment of a step and the bytes of its collectives.
#include "plan_internal.h"

#include <fsdp/models/moe.h>

#include <c10/util/Exception.h>

#include <algorithm>

namespace fsdp::plan {
namespace detail {

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
void add_all_gather(CommPlan& cm, const GroupPlan& g, int64_t S, int64_t e, int64_t hpz) {
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

// The TP dim's collectives of one forward + backward of T tokens through blocks [first, first + count) and, when
// held, the embedding and the output layer with the loss (docs/planner.md, "Tensor parallel"). One sequence-sharded
// activation [T/tp, D] is all-gathered ((tp-1) x its bytes) or reduce-scattered from [T, D] ((tp-1)/tp of that):
// a dense block's attention and feed-forward each all-gather their input and reduce-scatter their output
// (PrepareModuleInput, wo / w2), an MoE block's attention and, if it has them, its shared experts (the router and
// the routed experts work on the local tokens: nothing over TP); backward mirrors each; a recomputed block runs
// its forward's again. The embedding reduce-scatters its output, the output layer all-gathers its input (mirrors
// in backward). All-reduces of replicated weights' gradients (Partial over TP): every parameter the seam's model
// holds Replicate over tp (the units'); the loss's 3 [T] float vectors (loss parallel).
void add_tp_collectives(CommPlan& cm, const PlanConfig& c, const ActivationModel& act, int64_t first, int64_t count,
                        bool has_embedding, bool has_output, int64_t T, const std::vector<GroupPlan>& units) {
  const auto& a = c.args;
  const int64_t TP = c.tp, D = a.dim, e = bytes_of(c.compute_dtype);
  if (TP <= 1) return;
  const int64_t ag_one = (TP - 1) * (T / TP * D * e), rs_one = (TP - 1) * (T * D * e) / TP;
  const auto ar = [&](int64_t bytes) { return 2 * (TP - 1) * bytes / TP; };
  int64_t per_dir = (has_embedding ? 1 : 0) + (has_output ? 1 : 0);
  for (int64_t l = first; l < first + count; ++l) {
    const bool moe = is_moe(a, l);
    const int64_t gathers = moe ? 1 + (a.moe_options().num_shared_experts > 0 ? 1 : 0) : 2;
    per_dir += gathers * (act.recomputed[static_cast<size_t>(l)] ? 3 : 2);
  }
  // The replicated parameters' gradient all-reduces, one per parameter: what the seam's parallelize left
  // Replicate over tp (each block's two norms, Qwen3's q_norm / k_norm, an MoE router's gate, MLA's wq_a, q_norm,
  // wkv_a and kv_norm, the final norm), not a list of names kept here.
  int64_t ar_calls = 0, ar_bytes = 0;
  for (const GroupPlan& g : units) {
    for (int64_t numel : g.tp_replicated_numels) {
      ar_calls += 1;
      ar_bytes += ar(numel * e);
    }
  }
  cm.tp_all_gather_calls += per_dir;
  cm.tp_reduce_scatter_calls += per_dir;
  cm.tp_all_gather_bytes += per_dir * ag_one;
  cm.tp_reduce_scatter_bytes += per_dir * rs_one;
  if (has_output && !c.loss_parallel) {
    cm.tp_all_gather_calls += 1;
    cm.tp_all_gather_bytes += (TP - 1) * T * ceil_div(a.vocab_size, TP) * e;
  }
  if (has_output && c.loss_parallel) {
    ar_calls += 3;
    ar_bytes += ar((T + 1) * 4) + 2 * ar(T * 4);
  }
  cm.tp_all_reduce_calls += ar_calls;
  cm.tp_all_reduce_bytes += ar_bytes;
  cm.tp_total_bytes = cm.tp_all_gather_bytes + cm.tp_reduce_scatter_bytes + cm.tp_all_reduce_bytes;
}

// The MoE blocks' [E] float32 buffers among blocks [first, first + count): tokens_per_expert always, expert_bias
// with load balancing, whole on every rank that holds the block (under PP: the ranks of its stage).
int64_t moe_buffer_bytes(const models::llama::LlamaArgs& a, int64_t first, int64_t count) {
  int64_t bytes = 0;
  for (int64_t l = first; l < first + count; ++l) {
    if (!is_moe(a, l)) continue;
    const models::moe::MoEOptions o = a.moe_options();
    bytes += 4 * o.num_experts * (o.load_balance_coeff ? 2 : 1);
  }
  return bytes;
}

// The ep dim (src/expert_parallel) of one forward + backward of T tokens through blocks [first, first + count): per
// MoE layer and forward, the count exchange (E int64 split in ep pieces, all but this rank's own sent), the
// dispatch and the combine of the rank's routed rows (T/tp tokens x k under TP: the block routes the local slice),
// (ep-1)/ep of them to other ranks under uniform routing; backward sends the dispatch's and the combine's gradients
// back; a recomputed block (full, layer-selective or op-level AC) runs its forward's exchanges once more.
void add_ep_collectives(CommPlan& cm, const PlanConfig& c, const ActivationModel& act, int64_t first, int64_t count,
                        int64_t T) {
  const auto& a = c.args;
  if (c.ep <= 1 || !a.moe) return;
  const models::moe::MoEOptions o = a.moe_options();
  const int64_t ep = c.ep, e = bytes_of(c.compute_dtype);
  const int64_t count_bytes = (ep - 1) * (o.num_experts / ep) * 8;
  const int64_t rows_bytes = T / c.tp * o.top_k * a.dim * e * (ep - 1) / ep;
  for (int64_t l = first; l < first + count; ++l) {
    if (!is_moe(a, l)) continue;
    const int64_t forwards = act.recomputed[static_cast<size_t>(l)] ? 2 : 1;
    cm.ep_count_bytes += forwards * count_bytes;
    cm.ep_dispatch_bytes += (forwards + 1) * rows_bytes;
    cm.ep_combine_bytes += (forwards + 1) * rows_bytes;
    cm.ep_all_to_all_calls += 3 * forwards + 2;
  }
  cm.ep_total_bytes = cm.ep_count_bytes + cm.ep_dispatch_bytes + cm.ep_combine_bytes;
}

}  // namespace detail

namespace {

using detail::is_moe;
using detail::SeamLayout;

// Under PP: the whole model's units from its stages' (each block once, in layer order; the stages' embedding and
// norm + output as one "root"), for the report's per-model figures.
std::vector<GroupPlan> groups_of_stages(const SeamLayout& seam) {
  std::vector<GroupPlan> blocks;
  GroupPlan root;
  root.name = "root";
  for (const auto& stage : seam.stage_groups) {
    for (const GroupPlan& g : stage) {
      if (g.name != "root") {
        blocks.push_back(g);
        continue;
      }
      root.numel += g.numel;
      root.local_numel += g.local_numel;
      root.shard_numel += g.shard_numel;
      root.all_gather_bytes += g.all_gather_bytes;
      root.tp_replicated_numels.insert(root.tp_replicated_numels.end(), g.tp_replicated_numels.begin(),
                                       g.tp_replicated_numels.end());
    }
  }
  blocks.push_back(root);
  return blocks;
}

// MoE and expert parallelism: what the planner models and what it refuses (any other layout the trainer refuses is
// refused by its own check_layout, through the seam).
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
  const int64_t E = a.moe_options().num_experts;
  TORCH_CHECK((c.shard * c.cp * c.tp) % c.ep == 0, "fsdp-plan: --ep ", c.ep, " must divide --shard x --cp x --tp = ",
              c.shard * c.cp * c.tp, " (expert-parallel groups borrow their ranks from dp_shard x cp x tp; the "
              "experts' FSDP runs over the "
              "ranks left)");
  TORCH_CHECK(E % c.ep == 0, "fsdp-plan: --ep ", c.ep, " must divide the ", E, " experts of ", model,
              " (each ep rank holds experts / ep of them)");
  TORCH_CHECK(c.block_reshard <= 1, "fsdp-plan: --reshard ", c.block_reshard, " (hpZ) with MoE layers is not "
              "modelled (the experts shard over another mesh); use true or false");
}

// Context parallelism: what the planner models (the trainer refuses the layouts it does not train, e.g. a
// sequence length that does not split into its chunks, through the seam).
void check_context_parallel(const PlanConfig& c) {
  TORCH_CHECK(c.cp >= 1, "fsdp-plan: cp must be >= 1, got ", c.cp);
  TORCH_CHECK(c.cp_rotate_method == "allgather" || c.cp_rotate_method == "alltoall",
              "fsdp-plan: --cp-rotate-method must be allgather or alltoall, got '", c.cp_rotate_method, "'");
  TORCH_CHECK(c.cp_load_balancer == "headtail" || c.cp_load_balancer == "none",
              "fsdp-plan: --cp-load-balancer must be headtail or none, got '", c.cp_load_balancer, "'");
}

// One block's attention on this rank (docs/planner.md, "Context parallelism"): the sequence it holds, what the
// attention saves and what a ring-attention call holds beyond that (the activation model's, from fsdp-train's
// attention_memory.h).
void attention_memory(const PlanConfig& c, const detail::ActivationModel& act, MemoryPlan& m) {
  m.seq_per_rank = c.seq_len / c.cp;
  m.attention_saved_per_layer = act.attention.saved;
  m.attention_forward_in_flight = act.attention.forward_in_flight;
  m.attention_backward_in_flight = act.attention.backward_in_flight;
}

}  // namespace

Plan make_plan(const PlanConfig& c) {
  using namespace detail;
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
  check_context_parallel(c);
  // FSDP shards over dp_shard x cp (TorchTitan's dp_shard_cp): the cp ranks of a shard group hold other chunks of
  // the same sequences, never other parameters.
  const int64_t S = c.shard * c.cp, R = c.replicate, TP = c.tp;
  TORCH_CHECK(TP >= 1, "fsdp-plan: tp must be >= 1");
  if (TP > 1) {
    TORCH_CHECK(a.n_heads % TP == 0 && a.kv_heads() % TP == 0, "fsdp-plan: tp ", TP, " must divide n_heads ",
                a.n_heads, " and n_kv_heads ", a.kv_heads());
    TORCH_CHECK(!a.tie_embeddings, "fsdp-plan: tensor parallel needs untied embeddings");
    TORCH_CHECK(c.seq_len / c.cp % TP == 0, "fsdp-plan: seq ", c.seq_len, " / cp ", c.cp, " must divide by tp ", TP,
                " (sequence parallel)");
  }
  check_moe(c);

  // The FSDP units and this rank's shards of them, as the trainer's parallelize step makes them (no shape
  // formulas here: the model is built and parallelized through the seam on meta).
  // Under PP the planner's own checks of the pipeline options come first (their messages name fsdp-plan's options).
  const std::optional<PipelineSetup> pipeline = c.pp > 1 ? std::optional<PipelineSetup>(prepare_pipeline(c)) : std::nullopt;
  const SeamLayout seam = layout_from_seam(c, pipeline ? pipeline->stage_fqns : std::vector<std::vector<std::string>>{});
  plan.groups = c.pp > 1 ? groups_of_stages(seam) : seam.groups;
  plan.num_params = seam.num_params;
  plan.parallelize = seam.description;
  const int64_t described = described_num_params(c);
  TORCH_CHECK(plan.num_params == described, "fsdp-plan: the model built through the seam (",
              c.model, " ", c.flavor.empty() ? std::string("(custom)") : c.flavor, ") has ", plan.num_params,
              " parameters, but the model args given describe ",
              described < 0 ? std::string("another model") : std::to_string(described));
  TORCH_CHECK(static_cast<int64_t>(plan.groups.size()) == a.n_layers + 1, "fsdp-plan internal: the trainer made ",
              plan.groups.size(), " FSDP units of ", a.n_layers, " blocks (expected one per block and the root)");
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
  m.buffers = moe_buffer_bytes(a, 0, L);

  // ---- activations saved per block, per token (docs/planner.md, "Activations") ----
  // Tokens this rank holds: under cp its seq / cp of every sequence (every per-token count below is of these).
  const int64_t T = c.local_batch * c.seq_len / c.cp;
  const int64_t D = a.dim;
  const ActivationModel act = activation_model(c, T, seam.attention);
  attention_memory(c, act, m);
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
    const int64_t acts = acts_below + (recomputed[i] ? act.layer_full[i] : 0) + act.layer_workspace[i] +
                         m.attention_backward_in_flight;
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
  add_ep_collectives(cm, c, act, 0, L, T);
  add_tp_collectives(cm, c, act, 0, L, /*has_embedding=*/true, /*has_output=*/true, T, plan.groups);
  if (pipeline) plan_pipeline(c, *pipeline, seam, plan);
  return plan;
}

}  // namespace fsdp::plan
