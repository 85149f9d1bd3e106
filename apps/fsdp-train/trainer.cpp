// The training loop (see trainer.h). The only translation unit of the trainer that includes <torch/torch.h>.
#include "trainer.h"

#include "checkpoint_seam.h"
#include "cuda_support.h"
#include "data.h"
#include "device_stats.h"
#include "replica_group_ft.h"
#include "lr_schedule.h"
#include "metrics.h"
#include "metrics_processor.h"
#include "model_spec.h"
#include "parallelize.h"
#include "profiling.h"
#include "tensor_memory.h"
#include "tensorboard.h"
#include "validate.h"

#include <fsdp/activation_checkpoint.h>
#include <fsdp/clip_grad.h>
#include <fsdp/context_parallel.h>
#include <fsdp/materialize.h>
#include <fsdp/models/moe.h>  // the MoE layer (any family): its aux loss
#include <fsdp/tensor_parallel.h>
#include <fsdp/nn/module_call.h>
#include <fsdp/pipeline.h>
#include <fsdp/launch_check.h>

#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <thread>
#include <unordered_set>

namespace fsdp_train {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Sum of a few doubles over the group (identity without a group), on the group's device (NCCL takes CUDA
// tensors only; Gloo on CUDA tensors expects them where its meshes are).
std::vector<double> all_reduce(const fsdp::ProcessGroupPtr& group, std::vector<double> values,
                               fsdp::ReduceOp op = fsdp::ReduceOp::Sum) {
  if (!group) return values;
  auto t = torch::tensor(values, torch::kDouble).to(group->device());
  group->all_reduce(t, op).wait();
  t = t.cpu();
  auto* p = t.data_ptr<double>();
  return std::vector<double>(p, p + values.size());
}

// TorchTitan records the CUDA caching allocator's last 100,000 actions (MEMORY_SNAPSHOT_MAX_ENTRIES).
constexpr size_t kMemorySnapshotMaxEntries = 100000;

// Where this rank trains: its process group's device (resolved at init: cuda:LOCAL_RANK, or the index given);
// without a group, training.device with cuda's index from LOCAL_RANK (0 when unset), as the group would take it.
c10::Device training_device(const JobConfig& config, const TrainEnv& env) {
  const c10::Device asked = mesh_device(config);  // a ConfigError naming the key when CUDA is not there
  if (env.group) return env.group->device();
  if (!asked.is_cuda() || asked.has_index()) return asked;
  const char* local_rank = std::getenv("LOCAL_RANK");
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank ? std::atoi(local_rank) : 0));
}

void set_threads() {
  // torchrun sets OMP_NUM_THREADS for multi-process jobs; without it, share the cores between local ranks.
  if (std::getenv("OMP_NUM_THREADS")) return;
  int local_world = 1;
  if (const char* s = std::getenv("LOCAL_WORLD_SIZE")) local_world = std::max(1, std::atoi(s));
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  torch::set_num_threads(std::max(1, hw / local_world));
}

}  // namespace

double measure_peak_tflops() {
  torch::NoGradGuard ng;
  const int64_t n = 512;
  auto a = torch::randn({n, n}), b = torch::randn({n, n}), c = torch::empty({n, n});
  for (int i = 0; i < 3; ++i) torch::mm_out(c, a, b);
  // Best of five 0.1 s trials: a trial disturbed by another process on a shared machine does not lower the peak.
  double best = 0;
  for (int trial = 0; trial < 5; ++trial) {
    int64_t iters = 0;
    const auto t0 = Clock::now();
    double elapsed = 0;
    while ((elapsed = seconds_since(t0)) < 0.1) {
      torch::mm_out(c, a, b);
      ++iters;
    }
    best = std::max(best, 2.0 * n * n * n * static_cast<double>(iters) / elapsed / 1e12);
  }
  return best;
}

// Before the first collective, through the rendezvous store: every rank builds the same model from the same
// effective configuration. A mismatched launch (different flags, files or binaries per rank) is an error naming
// the ranks and the first differing line, instead of a deadlock or a silently different run.
static void check_launch_matches(const JobConfig& config, const torch::nn::Module& model) {
  std::ostringstream shapes;
  for (const auto& p : model.named_parameters()) shapes << p.key() << " " << p.value().sizes() << " " << p.value().dtype() << "\n";
  fsdp::check_same_on_all_ranks("model parameter shapes", shapes.str());
  // job.dump_folder may differ per rank or per host (local output folders); everything else must not.
  JobConfig compared = config;
  compared.job.dump_folder = "<per rank>";
  fsdp::check_same_on_all_ranks("job configuration (effective TOML, job.dump_folder excepted)", to_toml(compared));
}

// model.attn_mask_type = "block_causal": the tokenizer's EOS, where packed samples split into documents; a
// ConfigError when the tokenizer has none.
static int64_t document_eos(const Tokenizer& tokenizer) {
  if (!tokenizer.eos_id()) {
    throw ConfigError("config error: model.attn_mask_type = \"block_causal\" splits packed samples into documents "
                      "at the tokenizer's EOS, but the tokenizer (" + tokenizer.describe() + ") has no EOS token");
  }
  return static_cast<int64_t>(*tokenizer.eos_id());
}

void check_model_layout(const JobConfig& config, int64_t world_size) {
  // model.name first: an unknown family is one line listing the registered ones, whatever the layout.
  const TrainSpec& spec = train_spec(config.model.name);
  // The rules that need the run's files or environment but no world size, before any process group too.
  if (config.model.attn_mask_type == AttnMaskType::BlockCausal)
    document_eos(*make_tokenizer(config.model.tokenizer_path));
  if (config.fault_tolerance.enable) check_coordinator_given(config);
  resolve_dataset_files(config.training.dataset, config.training.dataset_path);  // a missing file, named
  if (config.validation.enable)
    resolve_dataset_files(config.validation.dataset, config.validation.dataset_path, "validation");
  // Only the family's own rules here. A layout that does not resolve on this rank's WORLD_SIZE is left to the
  // Trainer, after init_distributed: a rank launched with another world size than its peers must be named by the
  // launch check ("world size differs across ranks"), not refused with a batch-divisibility error of its own.
  std::optional<ParallelDims> dims;
  try {
    dims = resolve_parallelism(config, world_size);
  } catch (const ConfigError&) {
    return;
  }
  spec.check_layout(config, *dims);
}

TrainEnv init_distributed(const JobConfig& config) {
  TrainEnv env;
  const char* ws = std::getenv("WORLD_SIZE");
  // A fault-tolerant replica group of one rank still needs its group: the Manager talks to the others through it.
  const bool ft_single = config.fault_tolerance.enable && !(ws && std::atoi(ws) > 1);
  // On a GPU a launched world of one rank joins its group too (TorchTitan's world-1 run): FSDP then applies, with
  // training.mixed_precision_param, as it would on more ranks. On the CPU one rank stays a plain process.
  const bool cuda_launched = ws && mesh_device(config).is_cuda();
  if ((ws && std::atoi(ws) > 1) || ft_single || cuda_launched) {
    fsdp::InitOptions opts;
    if (ft_single) {
      opts.rank = 0;
      opts.world_size = 1;
    }
    opts.timeout = std::chrono::seconds(config.comm.init_timeout_seconds);
    // The process group works on the mesh's device (training.device): Gloo for the CPU; for CUDA, comm.backend
    // ("auto": NCCL where libfsdp has it, else Gloo on CUDA tensors; "gloo": ranks may share one GPU).
    if (mesh_device(config).is_cuda()) {
      opts.device = config.training.device;
      opts.backend = config.comm.backend;
    } else {
      opts.backend = "gloo";
    }
    env.group = fsdp::init_process_group(opts);
    env.rank = env.group->rank();
    env.world_size = env.group->size();
  }
  return env;
}

namespace {

// TorchTitan's Trainer: the constructor builds everything (data, model, parallelisation, optimizer, schedule,
// metrics, checkpointer) and restores a checkpoint; train() runs the loop, one train_step() per step, with
// validation, checkpointing and logging as separate steps.
class Trainer {
 public:
  Trainer(const JobConfig& config, const TrainEnv& env);
  TrainSummary train(bool compute_entropy);

 private:
  // What one optimizer step produced (before logging).
  struct StepResult {
    double loss = 0, grad_norm = 0, lr = 0;
    double local_loss_sum = 0;  // this rank's summed token loss (for the max-loss metric)
    int64_t local_tokens = 0;
    double aux_loss = -1;       // MoE sequence-wise balance loss of the step (all ranks); -1 = off
    double data_seconds = 0;
    ExpertLoad expert_load;
    bool committed = true;      // [fault_tolerance]: false = the quorum discarded the step (nothing was applied)
  };
  void build_model();
  void build_optimizer();
  void print_header() const;
  std::string attention_memory_text() const;  // the header's attention memory per rank ("" when unknown)
  // `ready`: [fault_tolerance] this rank's state is good for the step (its healing, if any, succeeded).
  StepResult train_step(int64_t step, bool ready = true);
  std::vector<Batch> step_batches(int64_t step);
  // Context parallelism: this rank's chunks of a batch's rows (tokens and labels), of a [B, S] tensor (identity
  // at cp 1).
  Batch context_parallel_chunks(Batch batch) const;
  torch::Tensor context_parallel_chunks(const torch::Tensor& global) const;
  // The step's microbatches through the model (or the pipeline); returns this rank's summed token loss and
  // adds this rank's share of the MoE balance loss to `aux_sum`.
  double forward_backward(std::vector<Batch>& batches, double global_tokens, TrainSummary::TensorMemory& tmem,
                          double& aux_sum);
  double clip_gradients();
  // [fault_tolerance] with MoE: the step's expert counts summed over the quorum's groups before the vote.
  void sum_expert_counts_over_quorum();
  // [fault_tolerance] under fully_shard: the cross-group average as each module's all-reduce hook, but for the
  // blocks that hold an MoE layer (averaged after backward: ft_after_backward_params_).
  void attach_fault_tolerance();
  void validate(int64_t step);
  void log(int64_t step, const StepResult& r, const TrainSummary::TensorMemory& tmem);
  void set_train_timeouts();

  const JobConfig& config_;
  const TrainEnv& env_;
  const bool main_rank_, say_;
  const ParallelDims dims_;
  const bool track_tensors_;
  const TrainSpec& spec_;  // model.name's family (model_spec.h)
  const c10::Device device_;  // where this rank's model, batches and loss live (training_device)
  const bool device_memory_;  // the log's memory from the device's caching allocator (device_stats.h)
  const int64_t device_total_bytes_;  // the device's whole memory (0 on the CPU): the log's percentages
  std::string peak_source_;   // where summary_.peak_tflops came from (the header says it)
  std::shared_ptr<const Tokenizer> tokenizer_;
  // model.attn_mask_type = block_causal: the EOS that ends each packed document (nullopt: causal attention).
  std::optional<int64_t> document_eos_;
  // The document ids the model's forward takes for these tokens (nothing for causal attention).
  torch::Tensor document_ids_of(const torch::Tensor& tokens) const {
    return model_.document_ids ? model_.document_ids(tokens) : torch::Tensor();
  }
  std::vector<std::string> files_;
  ModelShape shape_;
  TextOptions text_options_;
  std::unique_ptr<DataLoader> loader_;
  std::unique_ptr<Validator> validator_;
  TrainModel model_;
  ParallelPlan plan_;
  std::vector<fsdp::nn::moe::MoEImpl*> moe_blocks_;
  std::vector<bool> moe_held_;  // under PP: whether this rank's stages hold moe_blocks_[l]
  // The summed token loss of flattened logits (training and validation alike): with loss parallel the logits are
  // sharded over the vocabulary and the cross entropy reduces over the TP group.
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> loss_sum_of_;
  double pipeline_global_tokens_ = 1;
  std::unique_ptr<fsdp::Pipeline> pipeline_;
  std::vector<torch::Tensor> params_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::optional<LRSchedule> schedule_;
  TrainSummary summary_;
  std::unique_ptr<MetricsProcessor> metrics_;
  std::unique_ptr<StepProfiler> profiler_;
  std::vector<fsdp::ProcessGroupPtr> profiled_groups() const;
  std::unique_ptr<Checkpointer> checkpointer_;
  TrainState state_;
  int64_t first_step_ = 1;
  bool train_timeouts_set_ = false;
  std::unique_ptr<FaultTolerance> ft_;  // [fault_tolerance]
  std::vector<torch::Tensor> ft_after_backward_params_;  // their gradients averaged over the quorum after backward
  // The batches of a step not yet committed: a step the quorum discards is retried on the same data.
  int64_t pending_step_ = -1;
  std::vector<Batch> pending_batches_;
};

Trainer::Trainer(const JobConfig& config, const TrainEnv& env)
    : config_(config),
      env_(env),
      main_rank_(env.rank == 0),
      say_(main_rank_ && env.verbose),
      dims_(resolve_parallelism(config, env.world_size)),
      track_tensors_(config.metrics.tensor_memory),
      spec_(train_spec(config.model.name)),
      device_(training_device(config, env)),
      device_memory_(!device_.is_cpu()),
      device_total_bytes_(device_.is_cuda() ? cuda_support::device_total_bytes(device_.index()) : 0) {
  spec_.check_layout(config, dims_);  // fsdp-train's main checked it before the process group; tests call here
  set_threads();
  torch::manual_seed(static_cast<uint64_t>(config.debug.seed));
  if (config.debug.deterministic) at::globalContext().setDeterministicAlgorithms(true, false);
  // Before the model exists, so that its storages are counted (tensor_memory.h); on a GPU the snapshot is the
  // caching allocator's, recorded from here on (TorchTitan starts it before the model too).
  if (track_tensors_ || (config.profiling.enable_memory_snapshot && device_.is_cpu())) tensor_memory::install();
  if (config.profiling.enable_memory_snapshot && device_.is_cuda())
    cuda_support::record_memory_history(true, kMemorySnapshotMaxEntries);

  // First, before anything slow: the coordinator must be reachable.
  if (config.fault_tolerance.enable) {
    TORCH_CHECK(env.group, "fault_tolerance.enable needs the replica group's process group");
    ft_ = std::make_unique<FaultTolerance>(config, env.group, say_);
  }

  // ---- tokenizer, data ----
  tokenizer_ = make_tokenizer(config.model.tokenizer_path);
  files_ = resolve_dataset_files(config.training.dataset, config.training.dataset_path);
  if (config.model.attn_mask_type == AttnMaskType::BlockCausal) {
    document_eos_ = document_eos(*tokenizer_);
    shape_.eos_id = *document_eos_;
  }
  shape_.vocab_size = tokenizer_->vocab_size();  // TorchTitan: the model's vocab follows the tokenizer
  shape_.max_seq_len = config.training.seq_len;
  // Mesh [pp, dp_replicate, dp_shard, tp]: the tp ranks of a data-parallel rank, and its pp ranks, read the
  // same samples (the first stage needs the tokens, the last the labels).
  // [fault_tolerance]: every global batch is split over all replica groups (data_rank_of, data_degree); a group's
  // validation runs on its own ranks over the whole held-out set.
  const int64_t dp_rank = dims_.dp_rank_of(env.rank);
  text_options_ = TextOptions{config.training.dataset_text_field, config.training.bad_records == BadRecords::Skip, main_rank_};
  loader_ = std::make_unique<DataLoader>(files_, tokenizer_, shape_.vocab_size,
                                         LoaderOptions{config.training.seq_len, dims_.local_batch_size,
                                                       dims_.grad_accum_steps, dims_.data_rank_of(env.rank),
                                                       dims_.data_degree()},
                                         text_options_);
  if (config.validation.enable)
    validator_ = std::make_unique<Validator>(config.validation, tokenizer_, shape_.vocab_size, dp_rank, dims_.dp_degree(),
                                             text_options_);

  build_model();
  build_optimizer();
  if (ft_) {
    if (plan_.fsdp) attach_fault_tolerance();
  }

  // ---- metrics ----
  summary_.plan = plan_.description + "; " + plan_.activation_checkpointing;
  if (config.metrics.peak_tflops > 0) {
    summary_.peak_tflops = config.metrics.peak_tflops;
    peak_source_ = "metrics.peak_tflops";
  } else if (device_.is_cuda()) {
    // TorchTitan's MFU: against the device's dense bf16 peak from its name; an unknown device as an A100.
    const std::string name = cuda_support::device_name(device_.index());
    const auto peak = bf16_peak_tflops(name);
    summary_.peak_tflops = peak.value_or(312.0);
    peak_source_ = peak ? name + " bf16 peak" : name + ": unknown device, an A100's bf16 peak assumed (set metrics.peak_tflops)";
  } else {
    peak_source_ = "measured";
    if (env.group) env.group->barrier().wait();  // all ranks measure together: the peak under the same sharing
    summary_.peak_tflops = measure_peak_tflops();
    summary_.peak_tflops = all_reduce(env.group, {summary_.peak_tflops}, fsdp::ReduceOp::Min)[0];
  }
  metrics_ = std::make_unique<MetricsProcessor>(config, env.rank, env.verbose);
  profiler_ = std::make_unique<StepProfiler>(config, env.rank, profiled_groups(), device_);
  if (main_rank_) {
    std::filesystem::create_directories(config.job.dump_folder);
    std::ofstream(std::filesystem::path(config.job.dump_folder) / "config.toml") << to_toml(config);
  }
  print_header();

  // ---- checkpoint ----
  checkpointer_ = make_checkpointer(config, env.rank, env.group);
  state_.model = model_.module.get();
  if (plan_.stages.empty()) {
    state_.parts = {model_.module.get()};
  } else {
    for (auto& stage : plan_.stages) state_.parts.push_back(stage.module.get());
  }
  state_.optimizer = optimizer_.get();
  state_.data = loader_.get();
  const bool loaded = checkpointer_->load(state_);
  if (ft_) ft_->set_started_from(loaded ? state_.step : -1);
  first_step_ = state_.step + 1;
}

void Trainer::build_model() {
  const auto& config = config_;
  // With FSDP the model is built on `meta` (no full copy on any rank), sharded, then only the local shards are
  // allocated and initialized unit by unit — the same weights as an unsharded init (TorchTitan's flow).
  const bool meta_init = !plan_needs_full_init(dims_, env_.group != nullptr);
  const uint64_t seed = static_cast<uint64_t>(config.debug.seed);
  if (meta_init) shape_.device = c10::kMeta;
  model_ = spec_.build(config, shape_);
  if (env_.group) check_launch_matches(config, *model_.module);
  if (!meta_init) model_.init_weights(seed, {});

  plan_ = spec_.parallelize(model_, config, dims_, env_.group);
  // Each cp rank is fed chunks of the sequences: a family that did not put ring attention in would train on them
  // as if they were whole sequences.
  TORCH_CHECK(dims_.cp == 1 || plan_.cp_mesh.valid(), "parallelism.context_parallel_degree > 1: the ",
              config.model.name, " family does not apply context parallelism");
  moe_blocks_ = moe_layers(*model_.module);
  moe_held_.assign(moe_blocks_.size(), plan_.stages.empty());
  for (auto& stage : plan_.stages) {
    for (auto* moe : moe_layers(*stage.module)) {
      for (size_t l = 0; l < moe_blocks_.size(); ++l) moe_held_[l] = moe_held_[l] || moe_blocks_[l] == moe;
    }
  }
  loss_sum_of_ = [this](const torch::Tensor& logits, const torch::Tensor& labels) {
    if (plan_.loss_parallel)
      return fsdp::loss_parallel_cross_entropy(logits, labels, plan_.tp_mesh, -100, fsdp::LossReduction::Sum);
    return torch::nn::functional::cross_entropy(
        logits.to(torch::kFloat), labels,
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum).ignore_index(-100));
  };
  // A single process (no group, so no fully_shard to place the parameters): the whole model on the device.
  if (!env_.group && !device_.is_cpu()) model_.module->to(device_);
  if (meta_init && plan_.stages.empty()) {
    fsdp::materialize_module(*model_.module, device_);
    model_.init_weights(seed, fsdp::full_params_init_scope(*model_.module));
  } else if (meta_init) {
    // Pipeline stages: only this rank's stages get storage. The whole model's init runs in full order (one
    // generator, the same numbers as an unsharded init); the parts of other ranks' stages stay on `meta` and draw
    // nothing: the generator jumps past their numbers (src/models/generator_skip.h).
    std::vector<std::function<void(torch::nn::Module&, const std::function<void()>&)>> scopes;
    std::vector<std::unordered_set<const torch::nn::Module*>> held;
    for (auto& stage : plan_.stages) {
      fsdp::materialize_module(*stage.module, device_);
      scopes.push_back(fsdp::full_params_init_scope(*stage.module));
      held.emplace_back();
      for (const auto& m : stage.module->modules(/*include_self=*/true)) held.back().insert(m.get());
    }
    model_.init_weights(seed, [&](torch::nn::Module& part, const std::function<void()>& fn) {
      for (size_t i = 0; i < held.size(); ++i) {
        if (held[i].count(&part)) return scopes[i](part, fn);
      }
      fn();
    });
  }
  // Pipeline parallelism: the schedule runs the stages; each microbatch's loss is its summed token loss over the
  // step's global token count (set before each step), so the microbatches and ranks add up to the batch's mean.
  if (!plan_.stages.empty()) {
    std::vector<fsdp::PipelineStage> stages;
    for (size_t i = 0; i < plan_.stages.size(); ++i) {
      const ModelStage& stage = plan_.stages[i];
      // block_causal: every stage gets its microbatch's document ids alongside (the pipeline's context).
      stages.push_back({plan_.stage_indices[i], stage.module, nullptr, stage.forward});
    }
    fsdp::PipelineOptions popts;
    popts.schedule = to_string(config.parallelism.pipeline_parallel_schedule);
    popts.microbatches = static_cast<int>(dims_.pp_microbatches);
    popts.num_stages = plan_.num_stages;
    popts.schedule_csv = config.parallelism.pipeline_parallel_schedule_csv;
    pipeline_ = std::make_unique<fsdp::Pipeline>(
        std::move(stages), plan_.pp_group,
        [this](const torch::Tensor& logits, const torch::Tensor& labels) {
          return loss_sum_of_(logits.reshape({-1, logits.size(-1)}), labels.reshape({-1})) / pipeline_global_tokens_;
        },
        popts);
  }
  if (env_.group) env_.group->set_timeout(std::chrono::seconds(config.comm.init_timeout_seconds));
}

void Trainer::build_optimizer() {
  const auto& o = config_.optimizer;
  // Under PP only this rank's stages' parameters (the others' stay on `meta`, or are not trained here).
  if (plan_.stages.empty()) {
    params_ = model_.module->parameters();
  } else {
    for (auto& stage : plan_.stages) {
      for (auto& p : stage.module->parameters()) params_.push_back(p);
    }
  }
  if (o.name == OptimizerName::AdamW) {
    optimizer_ = std::make_unique<torch::optim::AdamW>(
        params_, torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
  } else {
    optimizer_ = std::make_unique<torch::optim::Adam>(
        params_, torch::optim::AdamOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
  }
  const auto& s = config_.lr_scheduler;
  const double* decay_ratio = s.decay_ratio ? &*s.decay_ratio : nullptr;
  schedule_ = LRSchedule::build(config_.training.steps, s.warmup_steps, decay_ratio, s.decay_type, s.min_lr_factor);
}

// One block's attention memory on this rank (attention_memory.h, the formula fsdp-plan reports): at the tokens of
// a (micro)batch it holds, in the compute dtype; with cp, what a ring-attention call holds beyond it.
std::string Trainer::attention_memory_text() const {
  const AttentionShape& shape = model_.attention;
  if (shape.heads == 0) return "";
  const AttentionShape per_rank{shape.heads / std::max<int64_t>(dims_.tp, 1), shape.qk_head_dim, shape.v_head_dim};
  const int64_t tokens = dims_.local_batch_size / std::max<int64_t>(dims_.pp_microbatches, 1) *
                         config_.training.seq_len / dims_.cp;
  const int64_t e = config_.training.mixed_precision_param == MixedPrecision::BFloat16 ? 2 : 4;
  const CpRotateMethod method = config_.parallelism.context_parallel_rotate_method;
  const AttentionMemory m = attention_memory(per_rank, tokens, e, dims_.cp, method == CpRotateMethod::AllGather);
  auto mib = [](int64_t bytes) {
    char text[32];
    std::snprintf(text, sizeof text, "%.2f MiB", static_cast<double>(bytes) / (1 << 20));
    return std::string(text);
  };
  std::string out = "; attention per block " + mib(m.saved) + " saved";
  if (dims_.cp > 1) {
    out += " + " + mib(m.forward_in_flight) + " / " + mib(m.backward_in_flight) + " in flight (forward / backward, " +
           to_string(method) + ")";
  }
  return out;
}

void Trainer::print_header() const {
  if (!say_) return;
  const auto& config = config_;
  const auto& dims = dims_;
  const std::string tb = metrics_->tensorboard_dir();
  std::cout << "fsdp-train: " << config.job.description << "\n"
            << "  model     " << config.model.name << " " << config.model.flavor << ": " << model_.summary << ", " << model_.num_params << " parameters"
            << (document_eos_ ? ", block_causal attention (documents end at EOS " + std::to_string(*document_eos_) + ")" : "")
            << "\n"
            << "  tokenizer " << tokenizer_->describe() << "\n"
            << "  data      " << to_string(config.training.dataset) << ": " << files_.size() << " files\n"
            << "  ranks     " << env_.world_size << " ("
            << (dims.pp > 1 ? "pp " + std::to_string(dims.pp) + " x " : std::string()) << "dp replicate "
            << dims.dp_replicate << " x shard " << dims.dp_shard
            << (dims.cp > 1 ? " x cp " + std::to_string(dims.cp) : std::string())
            << (dims.tp > 1 ? " x tp " + std::to_string(dims.tp) : std::string())
            << (dims.ep > 1 ? ", experts over ep " + std::to_string(dims.ep) + " inside shard" : std::string()) << "); "
            << summary_.plan << "\n"
            << "  batch     global " << dims.global_batch_size << " x " << config.training.seq_len << " tokens = local "
            << dims.local_batch_size << " x " << dims.grad_accum_steps << " accumulation x " << dims.dp_degree()
            << " ranks; " << torch::get_num_threads() << " threads per rank"
            << (dims.cp > 1 ? "; sequence per rank " + std::to_string(config.training.seq_len / dims.cp) + " tokens (cp " +
                                  std::to_string(dims.cp) + ", " +
                                  to_string(config.parallelism.context_parallel_load_balancer) + ")"
                            : std::string())
            << attention_memory_text() << "\n"
            << "  device    " << device_.str()
            << (env_.group ? " (" + env_.group->backend() + ")" : std::string())
            << (device_memory_ ? "; memory from its caching allocator" : "; memory = peak RSS") << "\n"
            << "  peak      " << summary_.peak_tflops << " TFLOP/s per rank (" << peak_source_ << "), "
            << model_.flops_per_token / 1e6 << " MFLOP per token\n"
            << "  output    " << config.job.dump_folder << "/metrics.jsonl"
            << (tb.empty() ? std::string() : ", TensorBoard " + tb) << "\n";
  if (config.fault_tolerance.enable) {
    const auto& f = config.fault_tolerance;
    const char* env_lighthouse = std::getenv("FSDP_LIGHTHOUSE");
    std::cout << "  ft        replica group " << f.replica_id << " of " << f.group_size << " (a step needs "
              << f.min_replica_size << "), lighthouse "
              << (!f.lighthouse.empty() ? f.lighthouse : env_lighthouse ? std::string(env_lighthouse) + " (FSDP_LIGHTHOUSE)" : "?")
              << "; reads data rank " << dims.data_rank_of(0) << ".." << dims.data_rank_of(dims.dp_degree() - 1)
              << " of " << dims.data_degree() << "\n";
  }
  if (validator_)
    std::cout << "  validate  " << to_string(config.validation.dataset) << ": " << validator_->files().size() << " files, "
              << validator_->num_samples() << " samples of " << config.validation.seq_len + 1 << " tokens, "
              << validator_->batches_per_run() << " batches of " << config.validation.local_batch_size
              << " per rank at step 1 and every " << config.validation.freq << " steps\n";
  std::cout << std::flush;
}

double Trainer::forward_backward(std::vector<Batch>& batches, double global_tokens, TrainSummary::TensorMemory& tmem,
                                 double& aux_sum) {
  double local_loss_sum = 0;
  const bool aux_on = config_.model.moe_sequence_aux_loss_coeff > 0 && !moe_blocks_.empty();
  for (auto& b : batches) {
    // The host batch onto the training device (no copy on the CPU).
    auto inputs = torch::from_blob(b.inputs.data(), {b.batch, b.seq_len}, torch::kLong).to(device_);
    if (pipeline_) {
      // The first stage takes the tokens, the last the labels; each rank runs its part of the schedule.
      pipeline_global_tokens_ = global_tokens;
      auto labels = torch::from_blob(b.labels.data(), {b.batch, b.seq_len}, torch::kLong).to(device_);
      // Under CP the rows are this rank's chunks already, and so are their document ids (cut from the whole rows).
      const torch::Tensor ids =
          b.document_ids.empty()
              ? document_ids_of(inputs)
              : torch::from_blob(b.document_ids.data(), {b.batch, b.seq_len}, torch::kLong).to(device_);
      const auto result = pipeline_->step(plan_.holds_first_stage ? inputs : torch::Tensor(),
                                          plan_.holds_last_stage ? labels : torch::Tensor(), ids);
      local_loss_sum += result.loss_sum() * global_tokens;  // 0 off the last stage
      continue;
    }
    auto labels = torch::from_blob(b.labels.data(), {b.batch * b.seq_len}, torch::kLong).to(device_);
    // Each MoE layer's balance loss is the mean over this microbatch's sequences: weighted by the microbatch's
    // share of the global batch, the sum over microbatches and ranks is the mean over every sequence of the
    // step (what one process computes on the whole batch). The layers tie it to their output (TorchTitan's
    // autograd function), so its gradient comes from the graph the backward runs, also under activation
    // checkpointing, where the first pass has no graph and the recomputation must not add it twice.
    // [fault_tolerance]: the share of this replica group's batch (the quorum's average of the gradients makes it
    // the mean over every member's sequences).
    const double aux_weight =
        static_cast<double>(b.batch) / static_cast<double>(dims_.global_batch_size / dims_.ft_groups);
    if (aux_on)
      for (auto* moe : moe_blocks_) moe->set_aux_loss_grad_scale(aux_weight);
    auto logits = b.document_ids.empty()
                      ? model_.forward(inputs)
                      : model_.forward_with_document_ids(
                            inputs, torch::from_blob(b.document_ids.data(), {b.batch, b.seq_len}, torch::kLong).to(device_));
    auto loss_sum = loss_sum_of_(logits.reshape({-1, logits.size(-1)}), labels);
    if (track_tensors_) tmem.forward = tensor_memory::live_bytes();
    // Divided by the global count: summed over micro-batches and ranks, this is the full-batch gradient.
    torch::Tensor loss = loss_sum / global_tokens;
    if (aux_on) {
      // The value only (its gradient flows through the layers' outputs, above).
      double aux = 0;
      for (auto* moe : moe_blocks_)
        if (moe->aux_loss().defined()) aux += moe->aux_loss().detach().to(torch::kDouble).item<double>();
      aux_sum += aux * aux_weight;
    }
    loss.backward();
    local_loss_sum += loss_sum.item<double>();
  }
  return local_loss_sum;
}

void Trainer::attach_fault_tolerance() {
  // FSDP's all-reduce hook takes a module with one parameter group. A block whose routed experts shard apart (over
  // the expert-parallel mesh's data ranks, or on dim 1) has two, so every block holding an MoE layer has its
  // gradients averaged after backward instead, in one flat all-reduce of its parameters' local gradients: the
  // average is element-wise and the same-coordinates ranks of two groups hold the same shards, so it is the same
  // average, only not overlapped with backward. (The blocks are the modules with an MoE layer as a direct child;
  // the root's and a stage's own parameters are outside every block.)
  std::vector<fsdp::FSDPModule> hooked;
  for (auto& m : plan_.fsdp_modules) {
    bool holds_moe = false;
    for (const auto& child : m.module().children()) holds_moe = holds_moe || child->as<fsdp::nn::moe::MoEImpl>();
    if (!holds_moe) {
      hooked.push_back(m);
      continue;
    }
    for (const auto& p : m.module().parameters()) ft_after_backward_params_.push_back(p);
  }
  ft_->attach(hooked);
}

void Trainer::sum_expert_counts_over_quorum() {
  if (moe_blocks_.empty()) return;
  // Each layer's local counts summed over the same-coordinates ranks of the quorum's groups; the data-parallel sum
  // after the vote (update_expert_load_balance) then covers every rank of every member: the bias moves on the
  // whole quorum's batch, the same in every group (what one process training on that batch computes).
  std::vector<at::Tensor> rows;
  for (auto* moe : moe_blocks_) rows.push_back(moe->tokens_per_expert().to(at::kCPU, at::kDouble));
  at::Tensor counts = at::stack(rows);
  ft_->sum_counts(counts);
  for (size_t l = 0; l < moe_blocks_.size(); ++l)
    moe_blocks_[l]->tokens_per_expert().copy_(counts[static_cast<int64_t>(l)]);
}

double Trainer::clip_gradients() {
  if (pipeline_) {
    // Over every stage of every pp rank (TorchTitan's clip_grad_norm_ with pp_mesh).
    std::vector<std::shared_ptr<torch::nn::Module>> parts;
    for (auto& stage : plan_.stages) parts.push_back(stage.module);
    return fsdp::clip_grad_norm_(parts, config_.training.max_norm, 2.0, plan_.pp_group).item<double>();
  }
  if (plan_.fsdp) return fsdp::clip_grad_norm_(*model_.module, config_.training.max_norm).item<double>();
  return torch::nn::utils::clip_grad_norm_(params_, config_.training.max_norm);
}

torch::Tensor Trainer::context_parallel_chunks(const torch::Tensor& global) const {
  if (dims_.cp == 1) return global;
  const auto balancer = config_.parallelism.context_parallel_load_balancer == CpLoadBalancer::HeadTail
                            ? fsdp::CpLoadBalancer::HeadTail
                            : fsdp::CpLoadBalancer::None;
  return fsdp::context_parallel_shard(global, /*seq_dim=*/1, dims_.cp_rank_of(env_.rank), dims_.cp, balancer);
}

Batch Trainer::context_parallel_chunks(Batch b) const {
  if (dims_.cp == 1) return b;
  // The cp ranks of a data-parallel rank read the same samples; each keeps its chunks of every row, for the
  // tokens and the labels alike (the positions follow in the model: apply_cp).
  auto cut = [&](std::vector<int64_t>& v) {
    const auto t = context_parallel_chunks(torch::from_blob(v.data(), {b.batch, b.seq_len}, torch::kLong));
    v.assign(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
  };
  if (model_.document_ids) {
    // block_causal: a chunk's document ids count the EOS of the whole row before it.
    const auto ids =
        model_.document_ids(torch::from_blob(b.inputs.data(), {b.batch, b.seq_len}, torch::kLong)).contiguous();
    b.document_ids.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
    cut(b.document_ids);
  }
  cut(b.inputs);
  cut(b.labels);
  b.seq_len /= dims_.cp;
  return b;
}

std::vector<Batch> Trainer::step_batches(int64_t step) {
  if (pending_step_ == step) return pending_batches_;  // a retried step (fault tolerance): the same data
  std::vector<Batch> batches;
  for (int64_t m = 0; m < dims_.grad_accum_steps; ++m) batches.push_back(context_parallel_chunks(loader_->next()));
  if (ft_) {
    pending_step_ = step;
    pending_batches_ = batches;
  }
  return batches;
}

Trainer::StepResult Trainer::train_step(int64_t step, bool ready) {
  StepResult r;
  r.lr = config_.optimizer.lr * schedule_->factor(step - 1);
  for (auto& group : optimizer_->param_groups()) group.options().set_lr(r.lr);
  optimizer_->zero_grad();

  // Data first, so that the global token count is known before any backward.
  const auto t_data = Clock::now();
  std::vector<Batch> batches = step_batches(step);
  for (const Batch& b : batches)
    for (int64_t l : b.labels) r.local_tokens += l != -100;
  r.data_seconds = seconds_since(t_data);
  // The TP and PP ranks of a data-parallel rank hold the same tokens: count them once.
  const double global_tokens =
      all_reduce(env_.group, {static_cast<double>(r.local_tokens)})[0] / static_cast<double>(dims_.tp * dims_.pp);

  TrainSummary::TensorMemory tmem;
  if (track_tensors_) {
    tmem.start = tensor_memory::live_bytes();
    tensor_memory::reset_peak();
  }
  double aux_sum = 0;
  r.local_loss_sum = forward_backward(batches, global_tokens, tmem, aux_sum);
  if (plan_.stage_aux_loss && plan_.stage_aux_loss->defined()) {
    // Under PP the stages attached their layers' balance loss to each microbatch's backward (parallelize).
    aux_sum += plan_.stage_aux_loss->item<double>();
    *plan_.stage_aux_loss = torch::Tensor();
  }
  if (config_.model.moe_sequence_aux_loss_coeff > 0 && !moe_blocks_.empty()) {
    // Under TP each rank's balance loss is its tokens' share of the whole sequences' (MoEImpl's sequence
    // parallel group): the sum over the TP ranks is the loss.
    r.aux_loss = all_reduce(env_.group, {aux_sum})[0];
    summary_.aux_losses.push_back(r.aux_loss);
  }
  auto global_loss = [&] {
    return all_reduce(env_.group, {r.local_loss_sum})[0] / static_cast<double>(dims_.tp) / global_tokens;
  };
  if (ft_) {
    // The loss of this replica group's batch averaged over the quorum's groups, as their gradients are; before the
    // vote, so that a failure here discards the step too.
    if (!plan_.fsdp) ft_->average_gradients(params_);
    if (!ft_after_backward_params_.empty()) ft_->average_gradients(ft_after_backward_params_);
    r.loss = ft_->average(global_loss());
    if (r.aux_loss >= 0) summary_.aux_losses.back() = r.aux_loss = ft_->average(r.aux_loss);
    sum_expert_counts_over_quorum();
  }
  r.grad_norm = clip_gradients();
  if (ft_ && !(r.committed = ft_->commit(ready, step))) {
    optimizer_->zero_grad();  // the step is dropped: no update, its gradients gone
    // Its expert counts and balance loss too: the retry counts its batches again.
    for (auto* moe : moe_blocks_) moe->tokens_per_expert().zero_();
    if (r.aux_loss >= 0) summary_.aux_losses.pop_back();
    return r;
  }
  pending_step_ = -1;
  // MoE: the step's expert load over the data-parallel ranks drives the load-balancing bias (TorchTitan runs
  // this as an optimizer step pre-hook; gradient accumulation has summed every microbatch's counts).
  // Without PP over plan_.dp_group, the world here: under TP each rank routes its own slice of the sequence, so
  // the sum over dp x tp counts every token once. Under PP over each stage's data-parallel ranks (its MoE layers
  // live there only), shared over the stages.
  r.expert_load = pipeline_ ? update_expert_load_balance(moe_blocks_, moe_held_, plan_.stage_dp_groups, plan_.pp_group)
                            : update_expert_load_balance(moe_blocks_, plan_.dp_group);
  if (!r.expert_load.empty()) summary_.expert_loads.push_back(r.expert_load);
  checkpointer_->before_optimizer_step();  // an async save's background snapshot is complete
  optimizer_->step();
  if (track_tensors_) {
    tmem.peak = tensor_memory::peak_bytes();
    summary_.tensor_memory.push_back(tmem);
  }
  if (!ft_) r.loss = global_loss();
  summary_.losses.push_back(r.loss);
  summary_.grad_norms.push_back(r.grad_norm);
  return r;
}

// The groups whose collectives a profiled step times (profiling.h): the world and every group of the meshes.
std::vector<fsdp::ProcessGroupPtr> Trainer::profiled_groups() const {
  std::vector<fsdp::ProcessGroupPtr> groups{env_.group, plan_.dp_group, plan_.pp_group};
  for (const fsdp::DeviceMesh* mesh : {&plan_.mesh, &plan_.tp_mesh, &plan_.fsdp_mesh}) {
    if (!mesh->valid()) continue;
    for (int64_t d = 0; d < mesh->ndim(); ++d) groups.push_back(mesh->group(d));
  }
  return groups;
}

// Every group the step uses (the mesh's groups carry FSDP's all-gathers and reduce-scatters), not only the
// world: a rank that stops participating must make the others fail within comm.train_timeout_seconds.
void Trainer::set_train_timeouts() {
  if (!env_.group) return;
  const std::chrono::seconds t(config_.comm.train_timeout_seconds);
  env_.group->set_timeout(t);
  if (plan_.dp_group) plan_.dp_group->set_timeout(t);
  for (const fsdp::DeviceMesh* mesh : {&plan_.mesh, &plan_.fsdp_mesh}) {
    if (!mesh->valid()) continue;
    for (int64_t d = 0; d < mesh->ndim(); ++d)
      if (auto g = mesh->group(d)) g->set_timeout(t);
  }
}

void Trainer::validate(int64_t step) {
  Validator::BatchLoss batch_loss;
  if (pipeline_) {
    // The forward-only schedule: the last stage's ranks get each microbatch's loss (here: the summed token loss,
    // pipeline_global_tokens_ = 1).
    // Under CP each rank its chunks of the rows, and of their document ids.
    batch_loss = [this](const torch::Tensor& x, const torch::Tensor& y) {
      pipeline_global_tokens_ = 1;
      const torch::Tensor xd = context_parallel_chunks(x).to(device_);
      const torch::Tensor ids = model_.document_ids ? context_parallel_chunks(model_.document_ids(x)).to(device_)
                                                    : torch::Tensor();
      return pipeline_->eval(plan_.holds_first_stage ? xd : torch::Tensor(),
                             plan_.holds_last_stage ? context_parallel_chunks(y).to(device_) : torch::Tensor(), ids)
          .loss_sum();
    };
  } else {
    batch_loss = [this](const torch::Tensor& x, const torch::Tensor& y) {
      // Context parallelism: each cp rank its chunks of the rows (block_causal: and of the rows' document ids);
      // the losses add up over the cp ranks.
      const torch::Tensor xd = context_parallel_chunks(x).to(device_);
      auto logits = dims_.cp > 1 && model_.document_ids
                        ? model_.forward_with_document_ids(xd, context_parallel_chunks(model_.document_ids(x)).to(device_))
                        : model_.forward(xd);
      return loss_sum_of_(logits.reshape({-1, logits.size(-1)}), context_parallel_chunks(y).to(device_).reshape({-1}))
          .item<double>();
    };
  }
  // Each cp rank counts its data-parallel rank's whole batch (it is given the full rows).
  const ValidationResult v =
      validator_->validate(batch_loss, env_.group, dims_.tp, dims_.tp * dims_.pp * dims_.cp);
  summary_.validation_steps.push_back(step);
  summary_.validation_losses.push_back(v.loss);
  metrics_->log_validation(step, v.loss, v.perplexity, v.tokens, v.tps, v.seconds);
}

void Trainer::log(int64_t step, const StepResult& r, const TrainSummary::TensorMemory& tmem) {
  const int64_t S = config_.training.seq_len;
  StepMetrics m;
  m.step = step;
  m.total_steps = config_.training.steps;
  m.loss = r.loss;
  m.grad_norm = r.grad_norm;
  m.lr = r.lr;
  m.elapsed_s = metrics_->elapsed();
  m.eta_s = m.elapsed_s / static_cast<double>(step - first_step_ + 1) * static_cast<double>(config_.training.steps - step);
  m.tokens_seen = step * dims_.global_batch_size * S;
  m.expert_tokens_min = r.expert_load.min_tokens;
  m.expert_tokens_max = r.expert_load.max_tokens;
  if (!r.expert_load.empty()) m.expert_tokens_mean = r.expert_load.mean_tokens.front();
  m.moe_aux_loss = r.aux_loss;
  if (ft_) m.ft_replicas = ft_->members();
  if (track_tensors_) {
    m.tensor_start_bytes = tmem.start;
    m.tensor_forward_bytes = tmem.forward;
    m.tensor_peak_bytes = tmem.peak;
  }
  if (!metrics_->should_log(step, step == config_.training.steps)) return metrics_->progress(m);
  // Collective: every rank logs the same steps.
  m.max_loss = all_reduce(env_.group, {r.local_tokens > 0 ? r.local_loss_sum / static_cast<double>(r.local_tokens) : 0.0},
                          fsdp::ReduceOp::Max)[0];
  constexpr double kGiB = 1 << 30;
  if (const auto mem = device_memory_stats(device_)) {
    // TorchTitan's DeviceMemoryMonitor: this window's peaks, then reset, so each line shows its own window.
    m.device_memory = true;
    m.mem_gib = static_cast<double>(mem->max_reserved) / kGiB;
    m.mem_max_active_gib = static_cast<double>(mem->max_active) / kGiB;
    m.mem_reserved_gib = static_cast<double>(mem->reserved) / kGiB;
    m.mem_active_gib = static_cast<double>(mem->active) / kGiB;
    if (device_total_bytes_ > 0) {
      m.mem_max_reserved_pct = 100.0 * static_cast<double>(mem->max_reserved) / static_cast<double>(device_total_bytes_);
      m.mem_max_active_pct = 100.0 * static_cast<double>(mem->max_active) / static_cast<double>(device_total_bytes_);
    }
    m.mem_alloc_retries = mem->num_alloc_retries;
    m.mem_ooms = mem->num_ooms;
    summary_.device_max_reserved_bytes = std::max(summary_.device_max_reserved_bytes, mem->max_reserved);
    summary_.device_max_active_bytes = std::max(summary_.device_max_active_bytes, mem->max_active);
    reset_device_memory_peaks(device_);
  } else {
    m.mem_gib = static_cast<double>(peak_rss_bytes()) / kGiB;
  }
  m.mem_max_gib = all_reduce(env_.group, {m.mem_gib}, fsdp::ReduceOp::Max)[0];
  metrics_->log(m, model_.flops_per_token, summary_.peak_tflops);
}

TrainSummary Trainer::train(bool compute_entropy) {
  const int64_t S = config_.training.seq_len;
  // Tokens per rank (TorchTitan's tps): the tp ranks of a data-parallel rank share its tokens (each does 1/tp of
  // their FLOPs), so tokens/s per rank x world size = global tokens/s and MFU stays comparable across layouts.
  // Under PP each pp rank runs 1/pp of the layers of its data-parallel rank's tokens: count them so as well.
  // Under CP each cp rank holds 1/cp of every sequence.
  const int64_t tokens_per_step_local =
      dims_.local_batch_size * dims_.grad_accum_steps * S / dims_.tp / dims_.pp / dims_.cp;
  metrics_->start();
  bool trained_here = false;
  for (int64_t step = state_.step + 1; step <= config_.training.steps;) {
    bool ready = true;
    if (ft_) {
      // The quorum of this step; a group behind it heals first and continues from the sender's step.
      ready = ft_->begin_step(state_);
      step = state_.step + 1;
      if (!trained_here) first_step_ = step;
      if (step > config_.training.steps) break;
    }
    profiler_->begin_step(step);
    StepResult r;
    try {
      r = train_step(step, ready);
    } catch (const c10::OutOfMemoryError&) {
      // TorchTitan dumps the memory snapshot as it exits on an out-of-memory error: what filled the device.
      profiler_->dump_memory_snapshot_on_oom(step);
      throw;
    }
    profiler_->end_step(step);
    if (!train_timeouts_set_) {
      set_train_timeouts();
      train_timeouts_set_ = true;
    }
    if (!r.committed) continue;  // discarded by the quorum: the same step again, with the next quorum
    trained_here = true;
    state_.step = step;
    state_.ntokens_seen = step * dims_.global_batch_size * S;
    const bool last = step == config_.training.steps;
    checkpointer_->maybe_save(state_, last);
    if (step == env_.stop_after_step) break;  // a test's "crash" right after this step's checkpoint
    metrics_->add_step(tokens_per_step_local, r.data_seconds);
    if (validator_ && validator_->should_validate(step)) validate(step);
    log(step, r, summary_.tensor_memory.empty() ? TrainSummary::TensorMemory{} : summary_.tensor_memory.back());
    ++step;
  }

  checkpointer_->wait();  // a background save or purge finishes (and reports its error) before the job ends
  summary_.seconds = metrics_->elapsed();
  summary_.tokens_seen = state_.step * dims_.global_batch_size * S;
  summary_.dump_folder = config_.job.dump_folder;
  summary_.device = device_.str();
  if (main_rank_) {
    const std::filesystem::path dump(config_.job.dump_folder);
    summary_.outputs.push_back({"effective config", (dump / "config.toml").string()});
    for (auto& o : metrics_->outputs()) summary_.outputs.push_back(o);
    for (auto& o : profiler_->outputs()) summary_.outputs.push_back(o);
    if (config_.checkpoint.enable)
      summary_.outputs.push_back({"checkpoints", (dump / config_.checkpoint.folder).string()});
  }
  const size_t n = summary_.losses.size(), k = std::min<size_t>(10, n);
  for (size_t i = n - k; i < n; ++i) summary_.final_loss += summary_.losses[i] / static_cast<double>(k);
  summary_.mean_tps = metrics_->mean_tps();
  summary_.mean_mfu = metrics_->mean_mfu();
  if (compute_entropy && main_rank_)
    summary_.unigram_entropy =
        unigram_entropy_nats(files_, tokenizer_, shape_.vocab_size, &summary_.epoch_tokens, text_options_);
  const fsdp::CheckpointStats ac = fsdp::checkpoint_stats(*model_.module);
  summary_.ac_forwards = ac.forwards;
  summary_.ac_recomputes = ac.recomputes;
  summary_.ac_mm_reused = ac.mm_reused;
  summary_.bad_records = loader_->bad_records();
  if (validator_) summary_.validation_bad_records = validator_->bad_records();
  return summary_;
}

}  // namespace

TrainSummary run_training(const JobConfig& config, const TrainEnv& env, bool compute_entropy) {
  if (!config.fault_tolerance.enable) return Trainer(config, env).train(compute_entropy);
  // Each replica group writes its own metrics, traces and checkpoints (its fallback when no other group is alive).
  JobConfig per_group = config;
  per_group.job.dump_folder = (std::filesystem::path(config.job.dump_folder) /
                               ("replica_" + std::to_string(config.fault_tolerance.replica_id))).string();
  return Trainer(per_group, env).train(compute_entropy);
}

}  // namespace fsdp_train
