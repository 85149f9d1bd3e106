// fsdp-plan's report (format_plan: one quantity per line, GiB / MiB) and the command line's parsers.
#include "plan_internal.h"

#include <fsdp/models/moe.h>

#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>

namespace fsdp::plan {
namespace detail {

std::string gib(int64_t b) {
  char buf[64];
  if (std::llabs(b) >= (int64_t{1} << 30)) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / (1 << 30));
  } else {
    std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(b) / (1 << 20));
  }
  return buf;
}

namespace {

std::string layer_range(int64_t first, int64_t count) {
  if (count == 0) return "";
  if (count == 1) return "layers." + std::to_string(first);
  return "layers." + std::to_string(first) + "-" + std::to_string(first + count - 1);
}

}  // namespace

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

}  // namespace detail

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

std::string format_plan(const Plan& p) {
  using namespace detail;
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
    // A token passes through top_k of each MoE block's E routed experts: the built model's count less the others
    // (the seam's expert parameters, this rank's E/ep of each block times ep; MLA's shapes included).
    const models::moe::MoEOptions o = c.args.moe_options();
    int64_t active = p.num_params;
    for (int64_t l = 0; l < c.args.n_layers; ++l) {
      if (!is_moe(c.args, l)) continue;
      const int64_t experts = p.groups[static_cast<size_t>(l)].expert_numel * c.ep;  // the block's E experts
      active -= experts / o.num_experts * (o.num_experts - o.top_k);
    }
    os << ", " << static_cast<double>(active) / 1e9 << " B active";
  }
  os << "), " << c.args.n_layers << " blocks + root\n";
  if (moe_layers > 0) {
    const models::moe::MoEOptions o = c.args.moe_options();
    os << "MoE        " << moe_layers << " MoE blocks: " << o.num_experts << " experts of hidden " << o.hidden
       << ", top-" << o.top_k;
    if (o.num_shared_experts > 0) os << ", " << o.num_shared_experts << " shared";
    os << "; ep " << c.ep << ": " << o.num_experts / c.ep << " experts per rank, FSDP-sharded over "
       << moe_group->expert_shard << " rank(s) ("
       << (c.ep > 1 ? "efsdp = shard" + std::string(c.cp > 1 ? " x cp" : "") + (c.tp > 1 ? " x tp" : "") + " / ep"
                    : (c.tp > 1 || c.cp > 1 ? "shard" + std::string(c.cp > 1 ? " x cp" : "") + (c.tp > 1 ? " x tp" : "")
                                            : std::string("the shard dim")))
       << ") on dim "
       << moe_group->expert_shard_dim << (moe_group->expert_shard_dim == 1 ? " (shard > experts)" : "")
       << "; routing-dependent terms assume uniform routing\n";
  }
  const PipelinePlan& pl = p.pipeline;
  const std::string cp = c.cp > 1 ? " x cp " + std::to_string(c.cp) : std::string();
  if (pl.enabled) {
    os << "mesh       pp " << c.pp << " x replicate " << c.replicate << " x shard " << c.shard << cp << " x tp " << c.tp
       << " = " << c.pp * c.replicate * c.shard * c.cp * c.tp << " ranks";
  } else {
    os << "mesh       replicate " << c.replicate << " x shard " << c.shard << cp << " x tp " << c.tp << " = "
       << c.replicate * c.shard * c.cp * c.tp << " ranks";
  }
  if (c.tp > 1) os << " (TP: sequence parallel, " << (c.loss_parallel ? "loss parallel" : "logits gathered") << ")";
  os << "\n";
  if (!p.parallelize.empty()) os << "trainer    " << p.parallelize << "\n";
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
  // The sequence each rank holds and its attention memory (fsdp-train's start-up log line says the same).
  os << "attention  " << m.seq_per_rank << " tokens per rank of seq " << c.seq_len;
  if (c.cp > 1) os << " (cp " << c.cp << ", " << c.cp_load_balancer << ", " << c.cp_rotate_method << ")";
  os << "; per block: saved " << gib(m.attention_saved_per_layer);
  if (c.cp > 1) {
    os << ", K/V of other ranks in flight " << gib(m.attention_forward_in_flight) << " (forward), "
       << gib(m.attention_backward_in_flight) << " with the gradient accumulators (backward)";
  }
  os << "\n";
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
    if (m.buffers) os << "  MoE buffers             " << gib(m.buffers) << "  (expert_bias, token counts of its stages' MoE blocks)\n";
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
