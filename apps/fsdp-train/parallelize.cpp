// See parallelize.h.
#include "parallelize.h"

#include "moe_balance.h"

#include <fsdp/context_parallel.h>
#include <fsdp/models/moe.h>
#include <fsdp/replicate.h>

#include <ATen/Context.h>

#include <unordered_set>

namespace fsdp_train {

bool plain_data_parallel(const ParallelDims& dims) {
  return dims.tp == 1 && dims.cp == 1 && dims.dp_shard == 1 && dims.dp_replicate > 1;
}

c10::Device mesh_device(const JobConfig& config) {
  const c10::Device device(config.training.device);  // the form was checked by validate()
  if (device.is_cuda() && !at::hasCUDA()) {
    throw ConfigError("training.device = \"" + config.training.device +
                      "\": CUDA is not available in this process (a CPU build of libtorch, or no GPU visible); "
                      "use \"cpu\"");
  }
  return device;
}

bool plan_uses_fully_shard(const ParallelDims& dims, bool has_group) {
  // Plain data parallelism is fully_shard too: fsdp::replicate over a (dp_replicate, 1) mesh.
  return has_group;
}

bool plan_needs_full_init(const ParallelDims& dims, bool has_group) {
  // Replicas are built whole, then replicate broadcasts replica 0's weights (DDP's guarantee); TP plans need
  // the whole model before they split it.
  return !has_group || plain_data_parallel(dims) || dims.tp > 1 || dims.ep > 1;
}

namespace {

// A second mesh over the world's ranks with the neighbouring dims `first` and `second` of (shape, names) merged
// into one named `merged`: neighbours in row-major order, so the merged dim's slices are the ranks of the two
// dims' slices, in the same order (TorchTitan's _flatten). Collective over the world.
fsdp::DeviceMesh with_dims_merged(const std::string& device_type, const std::vector<int64_t>& shape,
                                  const std::vector<std::string>& names, const std::string& first,
                                  const std::string& second, const std::string& merged) {
  std::vector<int64_t> merged_shape;
  std::vector<std::string> merged_names;
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] == first) continue;
    const bool joined = names[i] == second;
    TORCH_CHECK(!joined || (i > 0 && names[i - 1] == first), "with_dims_merged: ", first, " and ", second,
                " are not neighbours in the mesh");
    merged_shape.push_back(joined ? shape[i - 1] * shape[i] : shape[i]);
    merged_names.push_back(joined ? merged : names[i]);
  }
  return fsdp::init_device_mesh(device_type, merged_shape, merged_names);
}

}  // namespace

ParallelMeshes build_meshes(const ParallelDims& dims, const std::string& device_type, bool moe) {
  // TorchTitan's order: pp, dp_replicate, dp_shard, cp, tp (pp outermost; TP innermost: contiguous ranks).
  std::vector<int64_t> shape;
  std::vector<std::string> names;
  auto add = [&](int64_t size, const char* name) {
    shape.push_back(size);
    names.emplace_back(name);
  };
  if (dims.pp > 1) add(dims.pp, "pp");
  if (dims.dp_replicate > 1) add(dims.dp_replicate, "dp_replicate");
  add(dims.dp_shard, "dp_shard");
  if (dims.cp > 1) add(dims.cp, "cp");
  if (dims.tp > 1) add(dims.tp, "tp");
  ParallelMeshes m;
  m.world = fsdp::init_device_mesh(device_type, shape, names);
  const bool only_dp = dims.pp == 1 && dims.tp == 1 && dims.cp == 1;  // the world mesh is the data-parallel mesh
  m.dp = only_dp ? m.world : dims.dp_replicate > 1 ? m.world.slice({"dp_replicate", "dp_shard"}) : m.world["dp_shard"];
  if (dims.tp > 1) m.tp = m.world["tp"];
  if (dims.cp > 1) {
    // FSDP shards over dp_shard x cp (TorchTitan's flattened dp_shard_cp): every cp rank holds different tokens, so
    // the gradients reduce over cp too. dp_shard and cp are neighbours in the world mesh, so the same ranks in the
    // same row-major order with the two dims merged are that flattening (a second mesh over the same ranks).
    m.cp = m.world["cp"];
    const fsdp::DeviceMesh dense = with_dims_merged(device_type, shape, names, "dp_shard", "cp", "dp_shard_cp");
    m.dp = dims.dp_replicate > 1 ? dense.slice({"dp_replicate", "dp_shard_cp"}) : dense["dp_shard_cp"];
    // fully_shard joins a TP parameter's mesh with the data-parallel one: both must be dims of one mesh.
    if (dims.tp > 1) m.tp = dense["tp"];
    // Under cp x tp a sequence is spread over the cp x tp ranks (cp cuts it into chunks, TP's sequence parallelism
    // each chunk into slices): the MoE blocks' sequence balance loss sums its counts over both (cp_tp).
    if (dims.tp > 1 && moe) m.cp_tp = with_dims_merged(device_type, shape, names, "cp", "tp", "cp_tp")["cp_tp"];
  }
  if (dims.ep > 1 || (moe && dims.tp > 1)) {
    // TorchTitan's sparse mesh over the same ranks: [dp_replicate,] efsdp, ep with efsdp x ep = dp_shard x cp x tp
    // (expert parallelism borrows its ranks from FSDP's shard dim, CP and TP; the experts' FSDP takes the rest;
    // the three are neighbours in the world mesh). With TP each TP rank routes its own tokens, so the routed
    // experts' FSDP spans the TP ranks even without EP.
    std::vector<int64_t> sparse_shape{dims.efsdp()};
    std::vector<std::string> sparse_names{"efsdp"};
    if (dims.ep > 1) {
      sparse_shape.push_back(dims.ep);
      sparse_names.emplace_back("ep");
    }
    if (dims.dp_replicate > 1) {
      sparse_shape.insert(sparse_shape.begin(), dims.dp_replicate);
      sparse_names.insert(sparse_names.begin(), "dp_replicate");
    }
    if (dims.pp > 1) {  // inside each pipeline stage's ranks (pp outermost, as in the world mesh)
      sparse_shape.insert(sparse_shape.begin(), dims.pp);
      sparse_names.insert(sparse_names.begin(), "pp");
    }
    const fsdp::DeviceMesh sparse = fsdp::init_device_mesh(device_type, sparse_shape, sparse_names);
    if (dims.ep > 1) m.ep = sparse["ep"];
    m.expert_dp = dims.dp_replicate > 1 ? sparse.slice({"dp_replicate", "efsdp"})
                  : sparse_names.size() == 1 ? sparse
                                             : sparse["efsdp"];
  }
  return m;
}

fsdp::DeviceMesh moe_sequence_mesh(const ParallelMeshes& meshes) {
  // cp_tp exists for MoE models only: a dense model's meshes give none (nothing to sum), never cp or tp alone.
  if (meshes.cp.valid() && meshes.tp.valid()) return meshes.cp_tp;
  if (meshes.cp.valid()) return meshes.cp;
  return meshes.tp;  // invalid without TP
}

void set_moe_sequence_group(const std::vector<std::shared_ptr<torch::nn::Module>>& blocks,
                            const ParallelMeshes& meshes) {
  const fsdp::DeviceMesh mesh = moe_sequence_mesh(meshes);
  if (!mesh.valid()) return;
  for (const auto& block : blocks) {
    for (const auto& child : block->named_children()) {
      if (child.key() != "moe") continue;
      auto* moe = child.value()->as<fsdp::models::moe::MoEImpl>();
      TORCH_CHECK(moe, "set_moe_sequence_group: a block's child \"moe\" is not an MoE layer");
      moe->set_sequence_parallel_group(mesh.group(0));
    }
  }
}

namespace {
c10::ScalarType dtype_of(MixedPrecision p) { return p == MixedPrecision::BFloat16 ? c10::kBFloat16 : c10::kFloat; }
}  // namespace

FsdpOptions fsdp_options(const JobConfig& config, const fsdp::DeviceMesh& dp_mesh, bool pipeline) {
  FsdpOptions o;
  o.mesh = dp_mesh;
  o.param_dtype = config.training.mixed_precision_param;
  o.reduce_dtype = config.training.mixed_precision_reduce;
  o.cpu_offload = config.training.enable_cpu_offload;
  o.reshard_after_forward = config.parallelism.fsdp_reshard_after_forward;
  o.pipeline = pipeline;
  return o;
}

std::vector<fsdp::FSDPModule> fully_shard_blocks_then_root(const std::vector<std::shared_ptr<torch::nn::Module>>& blocks,
                                                           const std::shared_ptr<torch::nn::Module>& root,
                                                           const FsdpOptions& o,
                                                           const ExpertsOfBlock& experts_of_block) {
  fsdp::FullyShardOptions base;
  base.mesh = o.mesh;
  if (o.param_dtype != MixedPrecision::Float32 || o.reduce_dtype != MixedPrecision::Float32) {
    base.mp_policy.param_dtype = dtype_of(o.param_dtype);
    base.mp_policy.reduce_dtype = dtype_of(o.reduce_dtype);
  }
  base.offload_policy.cpu_offload = o.cpu_offload;
  const ReshardAfterForward policy = o.reshard_after_forward;
  const bool own_expert_placement = o.experts_mesh.valid() || o.experts_shard_dim != 0;
  std::vector<fsdp::FSDPModule> out;
  for (size_t i = 0; i < blocks.size(); ++i) {
    fsdp::FullyShardOptions opts = base;
    const std::shared_ptr<torch::nn::Module> experts =
        own_expert_placement && experts_of_block ? experts_of_block(*blocks[i]) : nullptr;
    if (experts) {
      std::unordered_set<const c10::TensorImpl*> expert_params;
      for (const auto& p : experts->parameters()) expert_params.insert(p.unsafeGetTensorImpl());
      opts.shard_placement_fn = [expert_params, mesh = o.experts_mesh,
                                 dim = o.experts_shard_dim](const at::Tensor& p) -> std::optional<fsdp::ShardPlacement> {
        if (!expert_params.count(p.unsafeGetTensorImpl())) return std::nullopt;
        return mesh.valid() ? fsdp::ShardPlacement{dim, mesh} : fsdp::ShardPlacement{dim};
      };
    }
    if (o.pipeline) {
      // Under PP TorchTitan keeps parameters across microbatches (default -> false); "always" reshards anyway.
      opts.reshard_after_forward = policy == ReshardAfterForward::Always;
    } else if (policy == ReshardAfterForward::Always) {
      opts.reshard_after_forward = true;
    } else if (policy == ReshardAfterForward::Never) {
      opts.reshard_after_forward = false;
    } else {
      opts.reshard_after_forward = i + 1 < blocks.size();  // backward starts with the last block: keep it
    }
    out.push_back(fsdp::fully_shard(blocks[i], opts));
  }
  fsdp::FullyShardOptions root_opts = base;
  if (o.pipeline) root_opts.reshard_after_forward = policy == ReshardAfterForward::Always;
  else if (policy == ReshardAfterForward::Always) root_opts.reshard_after_forward = true;
  // (default / never without PP: the root's option is left as is; FSDP2's root rule keeps the root unsharded.)
  out.push_back(fsdp::fully_shard(root, root_opts));
  return out;
}

std::vector<fsdp::FSDPModule> replicate_blocks_then_root(const std::vector<std::shared_ptr<torch::nn::Module>>& blocks,
                                                         const std::shared_ptr<torch::nn::Module>& root,
                                                         const fsdp::DeviceMesh& mesh) {
  // Every block, then the root (bottom-up): one gradient all-reduce per block, issued as soon as its backward is
  // done (DDP's buckets, overlapping the rest of backward), rather than one flat all-reduce after backward.
  fsdp::ReplicateOptions opts;
  opts.mesh = mesh;
  std::vector<fsdp::FSDPModule> out;
  for (const auto& block : blocks) out.push_back(fsdp::replicate(block, opts));
  out.push_back(fsdp::replicate(root, opts));
  return out;
}

void set_sum_gradients(ParallelPlan& plan) {
  for (auto& m : plan.fsdp_modules) m.set_gradient_divide_factor(1.0);
  plan.fsdp = true;
}

std::string pipeline_moe_setup(ParallelPlan& plan, FsdpOptions& fsdp, int64_t num_experts, const JobConfig& config,
                               const ParallelDims& dims, const ParallelMeshes& meshes) {
  if (num_experts == 0) return "";
  for (int64_t d = 0; d < meshes.dp.ndim(); ++d) plan.stage_dp_groups.push_back(meshes.dp.group(d));
  // Under TP each rank of the stage routes its own slice of the sequence: the counts sum over dp x tp.
  if (dims.tp > 1) plan.stage_dp_groups.push_back(meshes.tp.group(0));
  if (config.model.moe_sequence_aux_loss_coeff > 0) plan.stage_aux_loss = std::make_shared<at::Tensor>();
  fsdp.experts_shard_dim = dims.dp_shard * dims.cp * dims.tp > num_experts ? 1 : 0;  // as without PP (tt#1561)
  if (dims.ep == 1 && dims.tp == 1) return fsdp.experts_shard_dim == 1 ? "experts Shard(1) + " : "";
  fsdp.experts_mesh = meshes.expert_dp;  // efsdp: the stage's dp_shard x cp x tp ranks EP does not take
  if (dims.ep == 1) {
    return "experts' FSDP over " + fsdp.experts_mesh.to_string() + ", Shard(" + std::to_string(fsdp.experts_shard_dim) +
           ") + ";
  }
  return "EP " + std::to_string(dims.ep) + " (experts' FSDP over " + fsdp.experts_mesh.to_string() + ", Shard(" +
         std::to_string(fsdp.experts_shard_dim) + ")) + ";
}

ModelStage pipeline_stage(std::shared_ptr<torch::nn::Module> module,
                          std::function<at::Tensor(const at::Tensor& input, const at::Tensor& document_ids)> call,
                          const ParallelPlan& plan, const ParallelDims& dims) {
  // The sequence balance loss (model.moe_sequence_aux_loss_coeff) of the stage's MoE layers joins the stage's
  // backward per microbatch (moe_balance.h); x's rows are the microbatch's sequences, weighted by this replica
  // group's batch ([fault_tolerance]: the quorum's gradient average makes it the share of the global batch).
  const std::vector<fsdp::models::moe::MoEImpl*> stage_moes = moe_layers(*module);
  const double batch = static_cast<double>(dims.global_batch_size / dims.ft_groups);
  return {module, [call = std::move(call), stage_moes, batch, aux = plan.stage_aux_loss](const at::Tensor& x,
                                                                                          const at::Tensor& ids) {
            // Microbatches are equal in size, so the scale a layer's recomputation (activation checkpointing) ties
            // its loss with is this microbatch's even if a later forward set it.
            const double share = static_cast<double>(x.size(0)) / batch;
            if (aux)
              for (auto* moe : stage_moes) moe->set_aux_loss_grad_scale(share);
            at::Tensor out = call(x, ids);
            if (aux && !stage_moes.empty()) record_sequence_aux_loss(stage_moes, share, *aux);
            return out;
          }};
}

ParallelMeshes start_pipeline_plan(ParallelPlan& plan, const JobConfig& config, const ParallelDims& dims, bool moe,
                                   const PipelineSplit& split) {
  const ParallelMeshes meshes = build_meshes(dims, mesh_device(config).is_cuda() ? "cuda" : "cpu", moe);
  plan.mesh = meshes.world;
  plan.pp_group = plan.mesh.group("pp");
  if (dims.tp > 1) {
    plan.tp_mesh = meshes.tp;
    plan.loss_parallel = !config.parallelism.disable_loss_parallel;
  }
  if (dims.cp > 1) {
    plan.cp_mesh = meshes.cp;
    plan.fsdp_mesh = meshes.dp;  // dp_shard_cp
  }
  plan.num_stages = static_cast<int>(split.num_stages);
  plan.stage_indices = split.schedule.stages_of_rank(plan.pp_group->rank());
  plan.pipeline_schedule = split.schedule;
  return meshes;
}

void finish_pipeline_plan(ParallelPlan& plan, const JobConfig& config, const ParallelDims& dims,
                          const std::string& layers, const std::string& parts) {
  plan.holds_first_stage = plan.stage_indices.front() == 0;
  plan.holds_last_stage = plan.stage_indices.back() == plan.num_stages - 1;
  set_sum_gradients(plan);
  plan.description = pipeline_description(plan, config, dims, layers, parts);
}

std::string stage_layers_text(int s, int64_t begin, int64_t end, int num_stages) {
  return "stage " + std::to_string(s) + " = layers " + std::to_string(begin) + ".." + std::to_string(end - 1) +
         (s == 0 ? " + tok_embeddings" : "") + (s == num_stages - 1 ? " + norm, output" : "");
}

std::string cp_description(const JobConfig& config, const ParallelDims& dims) {
  if (dims.cp == 1) return "";
  const auto& p = config.parallelism;
  return "CP " + std::to_string(dims.cp) + " (ring attention, " + to_string(p.context_parallel_rotate_method) + ", " +
         to_string(p.context_parallel_load_balancer) + "; " + std::to_string(config.training.seq_len / dims.cp) +
         " of " + std::to_string(config.training.seq_len) + " tokens per rank; FSDP over dp_shard x cp = " +
         std::to_string(dims.dp_shard * dims.cp) + " ranks) + ";
}

namespace {
fsdp::ContextParallelOptions ring_options(const CpHooks& hooks) {
  return {hooks.rotate_method == CpRotateMethod::AllToAll ? fsdp::CpRotateMethod::AllToAll
                                                           : fsdp::CpRotateMethod::AllGather,
          hooks.load_balancer == CpLoadBalancer::HeadTail ? fsdp::CpLoadBalancer::HeadTail : fsdp::CpLoadBalancer::None};
}
}  // namespace

CpHooks cp_hooks(const fsdp::DeviceMesh& cp_mesh, CpRotateMethod rotate_method, CpLoadBalancer load_balancer) {
  CpHooks hooks;
  hooks.group = cp_mesh.group(0);
  hooks.rotate_method = rotate_method;
  hooks.load_balancer = load_balancer;
  const fsdp::CpLoadBalancer balancer = ring_options(hooks).load_balancer;
  hooks.rope_positions = [rank = hooks.group->rank(), size = hooks.group->size(), balancer](int64_t local_len) {
    return fsdp::context_parallel_positions(local_len * size, rank, size, balancer);
  };
  // block_causal: every cp rank's document ids (of the whole rows, cut like the tokens), gathered once per forward
  // and handed to every block in the mask's place; the blocks' ring then masks each chunk pair by them.
  hooks.document_mask = [group = hooks.group](const at::Tensor& document_ids) {
    return fsdp::context_parallel_gather_document_ids(document_ids, group);
  };
  return hooks;
}

CpHooks::AttentionKernel CpHooks::ring_attention(std::optional<double> scale) const {
  return [group = group, options = ring_options(*this), scale](const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& v,
                                                               const std::optional<at::Tensor>& all_document_ids) {
    if (all_document_ids) return fsdp::block_causal_ring_attention(q, k, v, *all_document_ids, group, options, scale);
    return fsdp::ring_attention(q, k, v, group, options, scale);
  };
}

std::string pipeline_description(const ParallelPlan& plan, const JobConfig& config, const ParallelDims& dims,
                                 const std::string& layers, const std::string& parts) {
  const auto& p = config.parallelism;
  const bool always = p.fsdp_reshard_after_forward == ReshardAfterForward::Always;
  const std::string schedule_text = p.pipeline_parallel_schedule_csv.empty()
                                        ? std::string(to_string(p.pipeline_parallel_schedule))
                                        : "CSV " + p.pipeline_parallel_schedule_csv;
  return "PP " + std::to_string(dims.pp) + " (" + schedule_text + ", " + std::to_string(plan.num_stages) +
         " stages, " + std::to_string(dims.pp_microbatches) + " microbatches; this rank: " + layers + ") + " + parts +
         (dims.dp_replicate > 1 ? "HSDP" : "FSDP") + " mesh " +
         (plan.fsdp_mesh.valid() ? plan.fsdp_mesh : plan.mesh).to_string() + ", reshard_after_forward " +
         (always ? "always" : "false (PP)");
}

PipelineSplitOptions pipeline_split_options(const JobConfig& config, const ParallelDims& dims) {
  const auto& p = config.parallelism;
  PipelineSplitOptions so;
  so.schedule = p.pipeline_parallel_schedule;
  so.pp = dims.pp;
  so.microbatches = dims.pp_microbatches;
  so.layers_per_stage = p.pipeline_parallel_layers_per_stage;
  so.first_stage_less_layers = p.pipeline_parallel_first_stage_less_layers;
  so.last_stage_less_layers = p.pipeline_parallel_last_stage_less_layers;
  so.module_fqns_per_model_part = p.module_fqns_per_model_part;
  so.schedule_csv = p.pipeline_parallel_schedule_csv;
  return so;
}

}  // namespace fsdp_train
