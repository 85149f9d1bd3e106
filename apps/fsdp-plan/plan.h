#pragma once
// fsdp-plan: per-rank memory and communication of FSDP (fully_shard per transformer block + root) training
// of a model fsdp-train registers (Llama 3, Qwen3 dense and MoE, DeepSeek-V3), without allocating (any size, 405B and
// 235B-A22B included). The parameters' shards are the trainer's own: the model is built on meta through
// fsdp-train's model seam and parallelized by its family's parallelize step under a fake process group, once per
// rank planned (plan_model.cpp); activations, buffers and collective bytes follow from those shards by the
// formulas of docs/planner.md, which mirror what fully_shard, src/models and src/expert_parallel allocate and
// send. tests/plan/ checks them against hand counts, the trainer's real shards and measured peaks and bytes.

#include <fsdp/models/llama.h>

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::plan {

enum class ACMode { None, Selective, Full };
// Selective AC: "layer" = checkpoint every `selective_every`-th block (TorchTitan's selective_ac_option "N");
// "op" = TorchTitan's op-level policy (save every other matmul output and the attention outputs).
enum class SelectiveKind { Layer, Op };

// How the loss is computed from the logits (affects the largest transient of small-vocabulary models and the
// largest of all at seq 8192 x vocab 128k).
struct LossPath {
  bool upcast_logits = false;   // TorchTitan: pred.float() before cross-entropy (a float32 copy)
  bool free_logits_before_backward = false;  // TorchTitan: `del pred` before loss.backward()
};

struct PlanConfig {
  // The model: fsdp-train's model.name and model.flavor, built through its model seam (apps/fsdp-train/
  // model_spec.h) on meta and parallelized as the trainer does, which gives every parameter shard the plan
  // counts; `args` (the flavor's, with vocab_size = the tokenizer's) give the activation model and must
  // describe the same model (the plan checks the parameter count).
  models::llama::LlamaArgs args;
  // DeepSeek-V3's multi-head latent attention (set_model fills it for deepseek_v3; nullopt: Llama attention):
  // the low-rank projections' widths, for what their norms save (docs/planner.md, "DeepSeek-V3").
  struct LatentAttention {
    int64_t q_lora_rank = 0, kv_lora_rank = 0, qk_rope_head_dim = 0;
    bool operator==(const LatentAttention& o) const {
      return q_lora_rank == o.q_lora_rank && kv_lora_rank == o.kv_lora_rank && qk_rope_head_dim == o.qk_rope_head_dim;
    }
  };
  std::optional<LatentAttention> latent_attention;
  std::string model = "llama3";  // a registered family: fsdp-train's model.name
  std::string flavor;
  // A model of the family built otherwise (e.g. args no flavor has), on `meta`: replaces the family's build;
  // the family's parallelize still runs on it. Empty: the seam's build of model / flavor.
  std::function<std::shared_ptr<torch::nn::Module>()> build_model;
  int64_t replicate = 1;  // HSDP replicate degree (mesh dim 0)
  int64_t shard = 1;      // FSDP shard degree (mesh dim 1)
  // Tensor parallel degree (innermost mesh dim): TorchTitan's Llama plan with sequence parallel (fsdp-train's
  // tensor_parallel_degree). FSDP then shards each rank's TP pieces; activations are split as docs/planner.md
  // says. loss_parallel: the logits stay vocabulary-sharded (else gathered: V per rank).
  int64_t tp = 1;
  bool loss_parallel = true;
  // Expert parallel degree (fsdp-train's parallelism.expert_parallel_degree; MoE models only): each MoE layer's
  // routed experts are split on dim 0 over `ep` ranks borrowed from dp_shard x cp x tp (E/ep experts per rank) and
  // FSDP-sharded over the efsdp = shard x cp x tp / ep ranks left (with the replicate dim: HSDP over them); the
  // rest of the block stays on the dense mesh. Must divide shard x cp x tp and the number of experts; under PP
  // the stage's experts alike. Routed experts are sharded on dim 1 instead of 0 when shard x cp x tp > experts
  // (the trainer's and TorchTitan's rule, whatever ep). docs/planner.md, "MoE and expert parallelism".
  int64_t ep = 1;
  // Context parallelism (fsdp-train's parallelism.context_parallel_degree, context_parallel_rotate_method,
  // context_parallel_load_balancer; docs/planner.md, "Context parallelism"): each rank holds seq / cp tokens of
  // every sequence, FSDP shards over shard x cp (TorchTitan's dp_shard_cp), and ring attention brings the other
  // ranks' K and V: "allgather" every rank's at once for the call, "alltoall" (the ring) two ranks' at a time.
  // The world is pp x replicate x shard x cp x tp ranks; under PP each stage's attention runs the ring over its
  // cp ranks and FSDP inside a stage shards over shard x cp.
  int64_t cp = 1;
  std::string cp_rotate_method = "allgather";  // "allgather" | "alltoall"
  std::string cp_load_balancer = "headtail";   // "headtail" | "none"
  c10::ScalarType param_dtype = c10::kFloat;    // sharded (master) parameters and their gradients
  c10::ScalarType compute_dtype = c10::kFloat;  // MixedPrecisionPolicy.param_dtype: unsharded params, activations
  c10::ScalarType reduce_dtype = c10::kFloat;   // gradient reduce-scatter / all-reduce
  c10::ScalarType optim_dtype = c10::kFloat;    // optimizer states
  int64_t optim_states = 2;                     // AdamW: exp_avg, exp_avg_sq
  int64_t local_batch = 1;
  int64_t seq_len = 2048;
  ACMode ac = ACMode::None;
  SelectiveKind selective = SelectiveKind::Layer;
  int64_t selective_every = 2;
  // Op-level SAC's save list: false = ours (src/activation_checkpoint/selective_op.cpp: a copy of every other
  // matmul output, wq wv w1 w2, everything else recomputed); true = TorchTitan's, which also keeps the SDPA
  // output and its log-sum-exp.
  bool op_sac_saves_attention = false;
  // Blocks' reshard_after_forward: 0 = false, 1 = true, N > 1 = hpZ N-way (must divide shard). The root keeps
  // PyTorch's default (not resharded after forward).
  int64_t block_reshard = 1;
  // TorchTitan's and fsdp-train's default policy: the last block is not resharded after forward (backward starts
  // with it), so its unsharded params stay from its forward to its backward and it is not re-gathered.
  bool keep_last_block_unsharded = false;
  LossPath loss;
  // Fixed allocations of the framework's runtime, added to every moment (0 by default; ~4.5 MiB for libtorch
  // on CPU, measured in tests/plan; on CUDA the context lives outside the allocator's statistics).
  int64_t runtime_overhead = 0;

  // Pipeline parallelism (TorchTitan's [parallelism] pipeline keys; docs/planner.md, "Pipeline parallelism").
  // pp = 1: no pipeline (the other pipeline fields must keep their defaults). The world is
  // pp x replicate x shard x cp x tp ranks; the memory and communication reported are one pp rank's (the one with
  // the largest peak), and FSDP under PP keeps parameters unsharded across microbatches (TorchTitan's
  // reshard_after_forward=false under PP; block_reshard and keep_last_block_unsharded are not used).
  int64_t pp = 1;
  std::string schedule = "1F1B";  // torch's names (fsdp::pipeline::parse_schedule_name), case-insensitive
  int64_t microbatches = 1;       // local_batch is split into this many equal microbatches (must divide)
  int64_t stages_per_rank = 0;    // 0: the schedule's default (1 for GPipe / 1F1B, 2 for the others)
  // TorchTitan's pipeline_parallel_layers_per_stage: stages = ceil((layers + first + last less layers) / this),
  // a multiple of pp; single-stage schedules then need 1 stage per rank, multi-stage ones at least 2.
  std::optional<int64_t> layers_per_stage;
  // TorchTitan's pipeline_parallel_{first,last}_stage_less_layers: the embedding / norm + output count as this
  // many layers when the layers are split over the stages.
  int64_t first_stage_less_layers = 1;
  int64_t last_stage_less_layers = 1;
};

// One fully_shard unit (a transformer block or the root) and its sizes. In an MoE block the routed experts
// (this rank's E/ep of them) are included in every field and also reported apart (expert_*): they shard over
// expert_shard ranks (efsdp = shard/ep with EP, the shard degree without) on expert_shard_dim, in an FSDP
// parameter group of their own when ep > 1 (per-parameter mesh), in the block's group otherwise.
struct GroupPlan {
  std::string name;
  int64_t numel = 0;              // unsharded, the whole model's (every expert)
  int64_t local_numel = 0;        // unsharded on this rank: numel less the experts of the other ep ranks
  int64_t shard_numel = 0;        // per rank, padded (ceil(size / shard) slices of each parameter's shard dim)
  int64_t all_gather_bytes = 0;   // per rank, in the compute dtype, 16-byte aligned per parameter
  int64_t expert_numel = 0;       // routed experts held by this rank (E/ep of them), unsharded; 0: none
  int64_t expert_shard_numel = 0, expert_all_gather_bytes = 0;
  int64_t expert_shard = 0;       // ranks the experts are FSDP-sharded over (efsdp); 0 when no experts
  int64_t expert_shard_dim = 0;   // 0, or 1 when shard > experts (Shard(1): F for w1/w3, D for w2)
  bool expert_group = false;      // the experts form their own FSDP parameter group (ep > 1)
  // Parameters replicated over the TP dim (SequenceParallel's: the norms, Qwen3's q_norm / k_norm, an MoE
  // router's gate, DeepSeek-V3's MLA low-rank projections wq_a / wkv_a and their norms): each one's elements, its
  // gradient all-reduced over tp once per backward. Empty without TP.
  std::vector<int64_t> tp_replicated_numels;
};

struct MemoryPlan {
  // Persistent per rank.
  int64_t params = 0, grads = 0, optimizer = 0;
  // Transient, at the peak moment.
  int64_t root_unsharded = 0;   // root group's unsharded params (kept from forward to backward)
  int64_t unsharded_peak = 0;   // block groups in flight (params, all-gather buffer, grads, reduce-scatter buffers)
  int64_t activations = 0;      // saved activations at the peak
  int64_t loss = 0;             // logits / log-softmax tensors live at the peak
  int64_t runtime = 0;          // PlanConfig::runtime_overhead
  int64_t sharded_grads_at_peak = 0;
  int64_t buffers = 0;          // MoE: expert_bias and the token counts, [E] float32 each per MoE layer (unsharded;
                                // under PP the planned rank's stages' MoE layers only)
  int64_t total = 0;
  std::string peak_moment;      // which moment is the peak
  // Saved activations per block (bytes), and of the checkpointed / recomputed layers. With MoE layers the first
  // is an MoE block's (act_per_moe_layer / act_per_dense_layer: each kind's; 0 when the model has none). The
  // MoE part assumes uniform routing: T k / E rows per expert, T k rows received by each ep rank.
  int64_t act_per_moe_layer = 0, act_per_dense_layer = 0;
  int64_t act_per_layer_full = 0;
  int64_t act_per_layer_checkpointed = 0;
  // Activation checkpointing's view (docs/planner.md, "Activation checkpointing"): what the blocks keep from
  // forward to backward under the configured AC mode (summed over blocks, final norm included), and the bytes
  // above the persistent state (params + optimizer states + runtime) at the end of forward (saved activations,
  // root unsharded params, logits and log-softmax) and at the peak. The trainer's metrics.tensor_memory
  // measures the last two (tests/plan/plan_ac_vs_measured_test).
  int64_t saved_activations = 0;
  int64_t end_of_forward = 0;
  int64_t step_peak = 0;
  // Attention per rank (docs/planner.md, "Context parallelism"): the tokens of each sequence this rank holds
  // (seq / cp); what one block's attention saves for backward (q, k, v as the kernel sees them, its output and
  // log-sum-exp, at those tokens: part of the block's activations); what one attention call holds beyond that
  // while it runs under cp: the other ranks' K and V (all-gather: every rank's, cp x this rank's; ring: at most
  // two ranks' at a time) and, in backward, the float32 dK / dV accumulators (all-gather: every rank's; ring: the
  // one computed on and the one in flight) and dQ. 0 without cp. The backward one joins the backward moments.
  int64_t seq_per_rank = 0;
  int64_t attention_saved_per_layer = 0;
  int64_t attention_forward_in_flight = 0;
  int64_t attention_backward_in_flight = 0;
};

struct CommPlan {
  // Bytes this rank sends per step (our byte model: ring all-gather (n-1) x input, reduce-scatter (n-1)/n of
  // the input, ring all-reduce 2(n-1)/n) and the calls.
  int64_t all_gather_bytes = 0, reduce_scatter_bytes = 0, all_reduce_bytes = 0;
  int64_t all_gather_calls = 0, reduce_scatter_calls = 0, all_reduce_calls = 0;
  int64_t total_bytes = 0;
  int64_t optimum_bytes = 0;  // the same without padding/alignment
  // Over the TP mesh dim (tp > 1): sequence-parallel all-gathers / reduce-scatters of activations (and their
  // mirrors in backward, again for recomputed blocks), norm-gradient and loss-parallel all-reduces. Not in
  // total_bytes (which is the data-parallel dims').
  int64_t tp_all_gather_bytes = 0, tp_reduce_scatter_bytes = 0, tp_all_reduce_bytes = 0;
  int64_t tp_all_gather_calls = 0, tp_reduce_scatter_calls = 0, tp_all_reduce_calls = 0;
  int64_t tp_total_bytes = 0;
  // Over the PP mesh dim (pp > 1): activations sent to the next stage and gradients sent to the previous one,
  // when that stage lives on another pp rank (one [local_batch / microbatches, seq, dim] tensor in the compute
  // dtype each, 1/tp of it under TP). Not in total_bytes.
  int64_t pp_send_bytes = 0, pp_send_calls = 0;
  // The routed experts' share of the data-parallel bytes and calls above (over the efsdp mesh dim, shard/ep
  // ranks; with ep = 1 over the shard dim, inside the blocks' collectives) and of the HSDP all-reduce.
  int64_t expert_all_gather_bytes = 0, expert_reduce_scatter_bytes = 0, expert_all_reduce_bytes = 0;
  int64_t expert_all_gather_calls = 0, expert_reduce_scatter_calls = 0, expert_all_reduce_calls = 0;
  // Over the EP mesh dim (ep > 1), per MoE layer and forward (again in a recomputed forward): the count exchange
  // ((ep-1) E/ep int64), the dispatch and the combine (each T k D e (ep-1)/ep bytes: T k routed rows, of which
  // (ep-1)/ep leave the rank under uniform routing); backward repeats dispatch and combine. Not in total_bytes.
  int64_t ep_count_bytes = 0, ep_dispatch_bytes = 0, ep_combine_bytes = 0;
  int64_t ep_all_to_all_calls = 0;
  int64_t ep_total_bytes = 0;
};

// One pipeline stage: TorchTitan's split (fsdp::plan::split_layers) and what it costs.
struct StagePlan {
  int stage = 0;
  int rank = 0;                      // pp rank that holds it
  int64_t first_layer = 0;           // its blocks are layers.first_layer .. layers.(first_layer + num_layers - 1)
  int64_t num_layers = 0;
  bool has_embedding = false;        // tok_embeddings (stage 0)
  bool has_output = false;           // norm + output (the last stage)
  std::vector<std::string> fqns;     // TorchTitan's module FQNs: "tok_embeddings", "layers.7", ..., "norm", "output"
  std::vector<GroupPlan> groups;     // its FSDP groups: one per block, then "root" (embedding / norm + output)
  int64_t numel = 0, shard_numel = 0;
  int64_t unsharded_param_bytes = 0; // compute dtype, held from its UNSHARD to its RESHARD (0 when aliased)
  int64_t buffer_bytes = 0;          // its MoE blocks' [E] float32 buffers (expert_bias, token counts), persistent
  int64_t accumulated_grad_bytes = 0;// unsharded grads in the reduce dtype, from its first B/W to REDUCE_GRAD
  int64_t activation_bytes_per_microbatch = 0;  // what one microbatch keeps from its F to its B (or W)
  double cost_scale = 0;             // simulator cost: layers + the less-layers weights it carries
};

struct PipelineRankPlan {
  int rank = 0;
  std::vector<int> stages;
  int64_t peak_microbatches_in_flight = 0;  // max over its action list of (F so far - B/W so far), all its stages
  int64_t peak_bytes = 0;                   // its peak memory (Plan::memory.total for the planned rank)
  std::string peak_moment;
  int64_t pp_send_bytes = 0, pp_send_calls = 0;
};

struct PipelinePlan {
  bool enabled = false;  // pp > 1
  std::string schedule;  // torch's spelling
  int64_t pp = 1, stages_per_rank = 1, num_stages = 1, microbatches = 1;
  int64_t microbatch_size = 0;  // local_batch / microbatches
  int64_t boundary_bytes = 0;   // one activation (or gradient) sent between stages
  std::vector<StagePlan> stages;
  std::vector<PipelineRankPlan> ranks;
  int planned_rank = 0;         // the rank with the largest peak: Plan::memory and Plan::comm are its
  // At the planned rank's peak: unsharded params of its active stages, accumulated unsharded grads, the saved
  // activations of its microbatches in flight, and the transient of the action running then.
  int64_t unsharded_params_at_peak = 0, accumulated_grads_at_peak = 0, activations_at_peak = 0,
          transient_at_peak = 0, microbatches_at_peak = 0;
  // fsdp::pipeline::simulate with F = 1, B = 2 (I = W = 1) per effective layer of the stage, no latency, and
  // the closed form of the reference table for equal stages ((p-1)/(m+p-1), (p-1)/(v m+p-1),
  // (p-1)/(3 v m+p-1)).
  double bubble_fraction = 0, bubble_closed_form = 0;  // closed form -1: none (DualPipeV)
};

struct Plan {
  PlanConfig config;
  int64_t num_params = 0;
  std::string parallelize;        // what the trainer's parallelize step did (its ParallelPlan::description)
  std::vector<GroupPlan> groups;  // blocks 0..n-1, then "root"
  MemoryPlan memory;
  CommPlan comm;
  PipelinePlan pipeline;  // enabled when config.pp > 1
};

Plan make_plan(const PlanConfig& config);

// PlanConfig::args of fsdp-train's model.name / model.flavor: a llama3 or qwen3 flavor as it is; a deepseek_v3
// flavor as the Llama-shaped view the activation and communication model reads (dim, layers, heads, vocabulary,
// the dense layers' FFN, the MoE blocks: DeepSeek-V3's MoE is the same module), with head_dim = MLA's v head dim.
// MLA's own shapes (its low-rank projections, q/k and v head dims) are not in the view: the parameters come from
// the seam's model, the attention kernel's shape from its TrainModel::attention. Throws naming the known models.
models::llama::LlamaArgs model_args(const std::string& model, const std::string& flavor);
// Sets config's model, flavor, args (model_args) and, for deepseek_v3, latent_attention.
void set_model(PlanConfig& config, const std::string& model, const std::string& flavor);

// Human-readable report (GiB/MiB), one quantity per line.
std::string format_plan(const Plan& plan);

// TorchTitan's generate_llm_fqn_per_model_part: the number of transformer layers of each of num_stages stages.
// E = num_layers + first_less + last_less effective layers; each stage gets E / num_stages, the first E % num_stages
// stages one more; the first stage's embedding counts as first_less of them, the last stage's norm + output as
// last_less. Throws (as TorchTitan) when a stage would get no effective layer or a weight exceeds E / num_stages.
std::vector<int64_t> split_layers(int64_t num_stages, int64_t num_layers, int64_t first_less = 1,
                                  int64_t last_less = 1);

ACMode parse_ac_mode(const std::string& s);          // none | selective | full
c10::ScalarType parse_dtype(const std::string& s);    // fp32|float32 | bf16|bfloat16 | fp16|float16

}  // namespace fsdp::plan
