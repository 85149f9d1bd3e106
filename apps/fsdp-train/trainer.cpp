// The training run (see trainer.h, trainer_parts.h): the rules checked before any process group, the process
// group, the Trainer's build sequence (its phases in trainer_build.cpp) and the step loop (the step in
// trainer_step.cpp, validation in trainer_validation.cpp, the outputs in trainer_log.cpp).
#include "trainer.h"

#include "cuda_support.h"
#include "tensor_memory.h"
#include "trainer_parts.h"

#include <fsdp/launch_check.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

namespace fsdp_train {
namespace {

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

bool check_model_layout(const JobConfig& config, int64_t world_size) {
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
    return false;
  }
  spec.check_layout(config, *dims);  // under PP its split builds a throwaway schedule: once per run (TrainEnv)
  return true;
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

TrainEnv check_and_init_distributed(const JobConfig& config) {
  const char* world_size_text = std::getenv("WORLD_SIZE");
  const int64_t world_size = world_size_text && std::atoi(world_size_text) > 1 ? std::atoi(world_size_text) : 1;
  const bool checked = check_model_layout(config, world_size);
  TrainEnv env = init_distributed(config);
  // The Trainer resolves the layout on the group's size: the check stands for it only on the same world.
  env.layout_checked = checked && env.world_size == world_size;
  return env;
}

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
  // fsdp-train's start checked it before the process group (env.layout_checked); other callers get it here.
  if (!env.layout_checked) {
    spec_.check_layout(config, dims_);
    outputs_.summary.layout_checked_by_trainer = true;
  }
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
    services_.ft = std::make_unique<FaultTolerance>(config, env.group, say_);
  }

  build_data();
  build_model();
  build_pipeline();
  build_optimizer();
  if (services_.ft) {
    if (step_.plan.fsdp) attach_fault_tolerance();
  }

  // ---- metrics ----
  outputs_.summary.plan = step_.plan.description + "; " + step_.plan.activation_checkpointing;
  build_peak_tflops();
  // The checkpoint (or Hugging Face weights) is input too: read and checked before the job writes anything, so
  // that a corrupt or mismatched one leaves the dump folder as it was (no config.toml overwritten, no metrics).
  build_checkpointer_and_restore();
  outputs_.metrics = std::make_unique<MetricsProcessor>(config, env.rank, env.verbose);
  services_.profiler = std::make_unique<StepProfiler>(config, env.rank, profiled_groups(), device_);
  if (main_rank_) {
    std::filesystem::create_directories(config.job.dump_folder);
    std::ofstream(std::filesystem::path(config.job.dump_folder) / "config.toml") << to_toml(config);
  }
  print_header();
}

Trainer::~Trainer() = default;

TrainSummary Trainer::train(bool compute_entropy) {
  const int64_t S = config_.training.seq_len;
  // Tokens per rank (TorchTitan's tps): the tp ranks of a data-parallel rank share its tokens (each does 1/tp of
  // their FLOPs), so tokens/s per rank x world size = global tokens/s and MFU stays comparable across layouts.
  // Under PP each pp rank runs 1/pp of the layers of its data-parallel rank's tokens: count them so as well.
  // Under CP each cp rank holds 1/cp of every sequence.
  const int64_t tokens_per_step_local =
      dims_.local_batch_size * dims_.grad_accum_steps * S / dims_.tp / dims_.pp / dims_.cp;
  outputs_.metrics->start();
  bool trained_here = false;
  for (int64_t step = step_.state.step + 1; step <= config_.training.steps;) {
    bool ready = true;
    if (services_.ft) {
      // The quorum of this step; a group behind it heals first and continues from the sender's step.
      ready = services_.ft->begin_step(step_.state);
      step = step_.state.step + 1;
      if (!trained_here) outputs_.first_step = step;
      if (step > config_.training.steps) break;
    }
    services_.profiler->begin_step(step);
    StepResult r;
    try {
      r = train_step(step, ready);
    } catch (const c10::OutOfMemoryError&) {
      // TorchTitan dumps the memory snapshot as it exits on an out-of-memory error: what filled the device.
      services_.profiler->dump_memory_snapshot_on_oom(step);
      throw;
    }
    services_.profiler->end_step(step);
    if (!services_.train_timeouts_set) {
      set_train_timeouts();
      services_.train_timeouts_set = true;
    }
    if (!r.committed) continue;  // discarded by the quorum: the same step again, with the next quorum
    trained_here = true;
    step_.state.step = step;
    step_.state.ntokens_seen = step * dims_.global_batch_size * S;
    const bool last = step == config_.training.steps;
    services_.checkpointer->maybe_save(step_.state, last);
    if (step == env_.stop_after_step) break;  // a test's "crash" right after this step's checkpoint
    outputs_.metrics->add_step(tokens_per_step_local, r.data_seconds);
    if (services_.validator && services_.validator->should_validate(step)) validate(step);
    const auto& tensor_memory = outputs_.summary.tensor_memory;
    log(step, r, tensor_memory.empty() ? TrainSummary::TensorMemory{} : tensor_memory.back());
    ++step;
  }

  services_.checkpointer->wait();  // a background save or purge finishes (and reports its error) before the job ends
  finish_summary(compute_entropy);
  return outputs_.summary;
}

TrainSummary run_training(const JobConfig& config, const TrainEnv& env, bool compute_entropy) {
  if (!config.fault_tolerance.enable) return Trainer(config, env).train(compute_entropy);
  // Each replica group writes its own metrics, traces and checkpoints (its fallback when no other group is alive).
  JobConfig per_group = config;
  per_group.job.dump_folder = (std::filesystem::path(config.job.dump_folder) /
                               ("replica_" + std::to_string(config.fault_tolerance.replica_id))).string();
  return Trainer(per_group, env).train(compute_entropy);
}

}  // namespace fsdp_train
