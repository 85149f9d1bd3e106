// The model as the trainer makes it, read back (plan_internal.h, layout_from_seam): fsdp-train's model seam builds
// the family's model on meta (TrainSpec::build: no storage, any size), its parallelize step (TorchTitan's order:
// pipeline split, TP, EP, AC, fully_shard per block and root) runs under a fsdp::FakeWorld of the planned rank,
// and each FSDP unit's parameter groups (fsdp/fully_shard_layout.h) give the shards this rank holds: the shapes,
// TP splits, expert placements and shard dims are the trainer's own, never re-derived here.
#include "plan_internal.h"

#include "config.h"
#include "model_spec.h"
#include "parallel_dims.h"
#include "parallelize.h"

#include <fsdp/fake_process_group.h>
#include <fsdp/models/deepseek_v3.h>
#include <fsdp/models/qwen3.h>
#include <fsdp/fully_shard_layout.h>
#include <fsdp/pipeline/schedule.h>

#include <c10/util/Exception.h>

#include <map>
#include <numeric>

namespace fsdp::plan::detail {
namespace {

std::string flavor_text(const PlanConfig& c) { return c.flavor.empty() ? std::string("(custom)") : c.flavor; }

// The trainer's job config of the plan: the same keys fsdp-train would be given for this layout. Dtypes the
// trainer does not take (fp16) leave its default: the planner sizes the bytes itself from the shards' elements.
fsdp_train::JobConfig job_config(const PlanConfig& c) {
  const int64_t dp = c.replicate * c.shard;
  std::vector<std::string> args = {
      "--model.name", c.model,
      "--training.seq_len", std::to_string(c.seq_len),
      "--training.local_batch_size", std::to_string(c.local_batch),
      "--training.global_batch_size", std::to_string(c.local_batch * dp),
      "--validation.local_batch_size", std::to_string(c.local_batch),
      "--validation.seq_len", std::to_string(c.seq_len),
      "--parallelism.data_parallel_replicate_degree", std::to_string(c.replicate),
      "--parallelism.data_parallel_shard_degree", std::to_string(c.shard),
      "--parallelism.tensor_parallel_degree", std::to_string(c.tp),
      "--parallelism.expert_parallel_degree", std::to_string(c.ep),
      "--parallelism.disable_loss_parallel", c.loss_parallel ? "false" : "true",
      "--parallelism.pipeline_parallel_degree", std::to_string(c.pp),
      "--parallelism.context_parallel_degree", std::to_string(c.cp),
      "--parallelism.context_parallel_rotate_method", c.cp_rotate_method,
      "--parallelism.context_parallel_load_balancer", c.cp_load_balancer};
  if (!c.flavor.empty()) args.insert(args.end(), {"--model.flavor", c.flavor});
  if (c.compute_dtype == c10::kBFloat16) args.insert(args.end(), {"--training.mixed_precision_param", "bfloat16"});
  if (c.compute_dtype == c10::kFloat) args.insert(args.end(), {"--training.mixed_precision_param", "float32"});
  if (c.pp > 1) {
    args.insert(args.end(), {"--parallelism.pipeline_parallel_schedule",
                             pipeline::schedule_name(pipeline::parse_schedule_name(c.schedule)),
                             "--parallelism.num_pp_microbatches", std::to_string(c.microbatches),
                             "--parallelism.pipeline_parallel_first_stage_less_layers",
                             std::to_string(c.first_stage_less_layers),
                             "--parallelism.pipeline_parallel_last_stage_less_layers",
                             std::to_string(c.last_stage_less_layers)});
    if (c.layers_per_stage) {
      args.insert(args.end(), {"--parallelism.pipeline_parallel_layers_per_stage", std::to_string(*c.layers_per_stage)});
    }
  }
  if (c.ac != ACMode::None) {
    args.insert(args.end(), {"--activation_checkpoint.mode", c.ac == ACMode::Full ? "full" : "selective"});
    if (c.ac == ACMode::Selective) {
      args.insert(args.end(), {"--activation_checkpoint.selective_ac_option",
                               c.selective == SelectiveKind::Op ? "op" : std::to_string(c.selective_every)});
    }
  }
  return fsdp_train::load_config(args);
}

// One FSDP unit's shards on this rank as the planner counts them: every parameter group of the unit (the call's
// mesh first; a second mesh is the routed experts' own, with expert parallelism), each parameter's padded rows in
// the compute dtype, 16-byte aligned as fully_shard packs its all-gather slot.
GroupPlan group_of(const std::string& name, const std::vector<ParamGroupLayout>& layouts, const PlanConfig& c) {
  const int64_t e = bytes_of(c.compute_dtype);
  GroupPlan g;
  g.name = name;
  for (size_t k = 0; k < layouts.size(); ++k) {
    const ParamGroupLayout& layout = layouts[k];
    const bool own_mesh = k > 0;
    for (const ShardedParamLayout& p : layout.params) {
      const int64_t numel = std::accumulate(p.unsharded_sizes.begin(), p.unsharded_sizes.end(), int64_t{1},
                                            std::multiplies<int64_t>());
      const int64_t all_gather = align16(p.padded_shard_numel * e);
      g.local_numel += numel;
      g.shard_numel += p.padded_shard_numel;
      // Replicate on the TP dim (the last of its global placements): its gradient is all-reduced over tp.
      if (p.global_placements && !p.global_placements->empty() && p.global_placements->back().is_replicate()) {
        g.tp_replicated_numels.push_back(numel);
      }
      g.all_gather_bytes += all_gather;
      // The routed experts: the group on their own mesh, or (ep = 1) the MoE block's experts module.
      if (!own_mesh && p.fqn.find("moe.experts.") == std::string::npos) continue;
      g.expert_numel += numel;
      g.expert_shard_numel += p.padded_shard_numel;
      g.expert_all_gather_bytes += all_gather;
      g.expert_shard = layout.shard_size;
      g.expert_shard_dim = p.shard_dim;
      g.expert_group = own_mesh;
    }
  }
  // The whole model's count: the other ep ranks hold the other experts, as many as this one.
  g.numel = g.local_numel + g.expert_numel * (c.ep - 1);
  return g;
}

struct RankUnits {
  std::vector<GroupPlan> groups;              // in the trainer's order
  std::vector<int> stages;                    // PP: the stages the rank holds ...
  std::vector<std::vector<GroupPlan>> per_stage;  // ... and their units
  int64_t num_params = 0;
  std::string description;
  fsdp_train::AttentionShape attention;
};

// Builds and parallelizes the model as world rank `rank` of `world` would, and reads its units back.
RankUnits units_of_rank(const PlanConfig& c, const fsdp_train::JobConfig& config, const fsdp_train::ParallelDims& dims,
                        const fsdp_train::TrainSpec& spec, int rank, int world) {
  FakeWorld fake(rank, world);
  fsdp_train::ModelShape shape;
  shape.vocab_size = c.args.vocab_size;  // the tokenizer's (fsdp-train: the model's vocabulary follows it)
  shape.max_seq_len = c.seq_len;
  shape.device = c10::Device(c10::kMeta);
  fsdp_train::TrainModel model;
  if (c.build_model) {
    model.module = c.build_model();
  } else {
    model = spec.build(config, shape);
  }
  RankUnits out;
  for (const auto& p : model.module->parameters()) out.num_params += p.numel();
  fsdp_train::ParallelPlan plan = spec.parallelize(model, config, dims, fake.group());
  TORCH_CHECK(plan.fsdp, "fsdp-plan internal: the trainer's parallelize applied no fully_shard (", plan.description,
              ")");
  out.description = plan.description;
  out.attention = model.attention;  // heads 0 for a model built otherwise (no TrainModel around it)
  // Unit names: the whole model's FQN of the module given to fully_shard; the root (or a pipeline stage, which is
  // no module of the whole model) is "root".
  std::map<const torch::nn::Module*, std::string> fqn_of;
  for (const auto& item : model.module->named_modules()) fqn_of[item.value().get()] = item.key();
  std::map<const torch::nn::Module*, size_t> stage_of;
  for (size_t i = 0; i < plan.stages.size(); ++i) stage_of[plan.stages[i].module.get()] = i;
  out.stages = plan.stage_indices;
  out.per_stage.resize(plan.stages.size());
  size_t stage = 0;
  for (const FSDPModule& unit : plan.fsdp_modules) {
    const torch::nn::Module* m = &unit.module();
    const auto named = fqn_of.find(m);
    const std::string name = named == fqn_of.end() || named->second.empty() ? "root" : named->second;
    const std::vector<ParamGroupLayout> layouts = param_group_layouts(unit);
    // A unit left without parameters (a middle pipeline stage's own, its blocks sharded apart) has no group and
    // sends nothing.
    if (!layouts.empty()) {
      GroupPlan g = group_of(name, layouts, c);
      if (!plan.stages.empty()) {
        TORCH_CHECK(stage < plan.stages.size(), "fsdp-plan internal: FSDP unit ", name, " after the rank's last stage");
        out.per_stage[stage].push_back(g);
      }
      out.groups.push_back(std::move(g));
    }
    if (stage_of.count(m)) stage += 1;  // a stage's own unit closes it (its blocks come first)
  }
  return out;
}

}  // namespace

SeamLayout layout_from_seam(const PlanConfig& c, const std::vector<std::vector<std::string>>& stage_fqns) {
  const int64_t world = c.pp * c.replicate * c.shard * c.cp * c.tp;
  TORCH_CHECK(world >= 1 && world <= (int64_t{1} << 24), "fsdp-plan: pp x replicate x shard x cp x tp = ", world,
              " ranks is out of range");
  TORCH_CHECK(!c.flavor.empty() || c.build_model, "fsdp-plan: no model.flavor for ", c.model,
              " (the model is built through the trainer's model seam: name a flavor, or give PlanConfig::build_model)");
  SeamLayout out;
  try {
    fsdp_train::JobConfig config = job_config(c);
    config.parallelism.module_fqns_per_model_part = stage_fqns;
    const fsdp_train::ParallelDims dims = fsdp_train::resolve_parallelism(config, world);
    const fsdp_train::TrainSpec& spec = fsdp_train::train_spec(c.model);
    spec.check_layout(config, dims);  // what the trainer refuses, the planner refuses alike
    if (c.pp == 1) {
      RankUnits r = units_of_rank(c, config, dims, spec, 0, static_cast<int>(world));
      out.groups = std::move(r.groups);
      out.num_params = r.num_params;
      out.description = std::move(r.description);
      out.attention = r.attention;
      return out;
    }
    // Each pp rank holds its own stages: plan the first rank of each pp coordinate (mesh [pp, ...]: pp outermost).
    const int64_t per_pp = world / c.pp;
    for (int64_t p = 0; p < c.pp; ++p) {
      RankUnits r = units_of_rank(c, config, dims, spec, static_cast<int>(p * per_pp), static_cast<int>(world));
      if (p == 0) {
        out.num_params = r.num_params;
        out.description = r.description;
        out.attention = r.attention;
      }
      for (size_t i = 0; i < r.stages.size(); ++i) {
        const size_t s = static_cast<size_t>(r.stages[i]);
        if (out.stage_groups.size() <= s) out.stage_groups.resize(s + 1);
        out.stage_groups[s] = std::move(r.per_stage[i]);
      }
    }
  } catch (const fsdp_train::ConfigError& e) {
    // The trainer's own words for a layout it refuses ("config error: parallelism...: ..."), from the planner.
    std::string msg = e.what();
    if (msg.rfind("config error: ", 0) == 0) msg = msg.substr(14);
    TORCH_CHECK(false, "fsdp-plan: ", c.model, " ", flavor_text(c), ": the trainer refuses this layout: ", msg);
  }
  return out;
}

namespace {

// DeepSeek-V3's args as the planner's Llama-shaped view (plan.h, model_args).
models::llama::LlamaArgs deepseek_v3_view(const models::deepseek_v3::DeepSeekV3Args& d) {
  models::llama::LlamaArgs v;
  v.dim = d.dim;
  v.n_layers = d.n_layers;
  v.n_heads = d.n_heads;
  v.vocab_size = d.vocab_size;
  v.norm_eps = d.norm_eps;
  v.max_seq_len = d.max_seq_len;
  v.explicit_ffn_hidden = d.inter_dim;
  // wo's input per head (the SDPA output): what the op-level SAC model counts as the attention's width.
  v.explicit_head_dim = d.v_head_dim;
  v.moe = d.moe;
  for (int64_t l = 0; l < d.n_dense_layers; ++l) v.dense_layers.push_back(l);
  v.moe_layer_step = 1;
  v.attn_mask_type = d.attn_mask_type;
  return v;
}

PlanConfig::LatentAttention latent_attention_of(const models::deepseek_v3::DeepSeekV3Args& d) {
  return {d.q_lora_rank, d.kv_lora_rank, d.qk_rope_head_dim};
}

bool same_view(const models::llama::LlamaArgs& a, const models::llama::LlamaArgs& b) {
  return a.dim == b.dim && a.n_layers == b.n_layers && a.n_heads == b.n_heads && a.vocab_size == b.vocab_size &&
         a.explicit_ffn_hidden == b.explicit_ffn_hidden && a.explicit_head_dim == b.explicit_head_dim &&
         a.dense_layers == b.dense_layers &&
         a.moe.has_value() == b.moe.has_value() &&
         (!a.moe || (a.moe->num_experts == b.moe->num_experts && a.moe->top_k == b.moe->top_k &&
                     a.moe->hidden == b.moe->hidden && a.moe->num_shared_experts == b.moe->num_shared_experts));
}

}  // namespace

int64_t described_num_params(const PlanConfig& c) {
  if (c.model != "deepseek_v3" || c.flavor.empty()) return models::llama::num_params(c.args);
  models::deepseek_v3::DeepSeekV3Args d = models::deepseek_v3::deepseek_v3_flavor(c.flavor);
  d.vocab_size = c.args.vocab_size;  // the tokenizer's, as the trainer builds it
  const bool same_latent = c.latent_attention && *c.latent_attention == latent_attention_of(d);
  return same_view(deepseek_v3_view(d), c.args) && same_latent ? models::deepseek_v3::num_params(d) : -1;
}

}  // namespace fsdp::plan::detail

namespace fsdp::plan {

models::llama::LlamaArgs model_args(const std::string& model, const std::string& flavor) {
  if (model == "deepseek_v3") return detail::deepseek_v3_view(models::deepseek_v3::deepseek_v3_flavor(flavor));
  TORCH_CHECK(model == "llama3" || model == "qwen3", "unknown model '", model,
              "' (known: llama3, qwen3, deepseek_v3)");
  return models::llama::model_flavor(model, flavor);
}

void set_model(PlanConfig& config, const std::string& model, const std::string& flavor) {
  config.model = model;
  config.flavor = flavor;
  config.args = model_args(model, flavor);
  config.latent_attention.reset();
  if (model == "deepseek_v3") {
    config.latent_attention = detail::latent_attention_of(models::deepseek_v3::deepseek_v3_flavor(flavor));
  }
}

}  // namespace fsdp::plan
