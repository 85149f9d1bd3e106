// The Trainer's build phase (trainer_parts.h): the data, the model and its parallelisation, the pipeline, the
// optimizer and learning-rate schedule, the peak FLOP/s for MFU, the checkpointer and the restored state.
#include "cuda_support.h"
#include "device_stats.h"
#include "trainer_parts.h"

#include <fsdp/launch_check.h>
#include <fsdp/materialize.h>
#include <fsdp/tensor_parallel.h>
#include <fsdp/util/timer.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <sstream>
#include <unordered_set>

namespace fsdp_train {

double measure_peak_tflops() {
  torch::NoGradGuard ng;
  const int64_t n = 512;
  auto a = torch::randn({n, n}), b = torch::randn({n, n}), c = torch::empty({n, n});
  for (int i = 0; i < 3; ++i) torch::mm_out(c, a, b);
  // Best of five 0.1 s trials: a trial disturbed by another process on a shared machine does not lower the peak.
  double best = 0;
  for (int trial = 0; trial < 5; ++trial) {
    int64_t iters = 0;
    const auto t0 = fsdp::util::SteadyClock::now();
    double elapsed = 0;
    while ((elapsed = fsdp::util::seconds_since(t0)) < 0.1) {
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

int64_t document_eos(const Tokenizer& tokenizer) {
  if (!tokenizer.eos_id()) {
    throw ConfigError("config error: model.attn_mask_type = \"block_causal\" splits packed samples into documents "
                      "at the tokenizer's EOS, but the tokenizer (" + tokenizer.describe() + ") has no EOS token");
  }
  return static_cast<int64_t>(*tokenizer.eos_id());
}

void Trainer::build_data() {
  const JobConfig& config = config_;
  const TrainEnv& env = env_;
  services_.tokenizer = make_tokenizer(config.model.tokenizer_path);
  services_.files = resolve_dataset_files(config.training.dataset, config.training.dataset_path);
  if (config.model.attn_mask_type == AttnMaskType::BlockCausal) {
    services_.document_eos = document_eos(*services_.tokenizer);
    step_.shape.eos_id = *services_.document_eos;
  }
  step_.shape.vocab_size = services_.tokenizer->vocab_size();  // TorchTitan: the model's vocab follows the tokenizer
  step_.shape.max_seq_len = config.training.seq_len;
  // Mesh [pp, dp_replicate, dp_shard, tp]: the tp ranks of a data-parallel rank, and its pp ranks, read the
  // same samples (the first stage needs the tokens, the last the labels).
  // [fault_tolerance]: every global batch is split over all replica groups (data_rank_of, data_degree); a group's
  // validation runs on its own ranks over the whole held-out set.
  const int64_t dp_rank = dims_.dp_rank_of(env.rank);
  services_.text_options = TextOptions{config.training.dataset_text_field,
                                        config.training.bad_records == BadRecords::Skip, main_rank_};
  services_.loader = std::make_unique<DataLoader>(services_.files, services_.tokenizer, step_.shape.vocab_size,
                                                  LoaderOptions{config.training.seq_len, dims_.local_batch_size,
                                                                dims_.grad_accum_steps, dims_.data_rank_of(env.rank),
                                                                dims_.data_degree()},
                                                  services_.text_options);
  if (config.validation.enable)
    services_.validator = std::make_unique<Validator>(config.validation, services_.tokenizer, step_.shape.vocab_size,
                                                      dp_rank, dims_.dp_degree(), services_.text_options);
}

void Trainer::build_model() {
  const auto& config = config_;
  // With FSDP the model is built on `meta` (no full copy on any rank), sharded, then only the local shards are
  // allocated and initialized unit by unit — the same weights as an unsharded init (TorchTitan's flow).
  const bool meta_init = !plan_needs_full_init(dims_, env_.group != nullptr);
  const uint64_t seed = static_cast<uint64_t>(config.debug.seed);
  if (meta_init) step_.shape.device = c10::kMeta;
  step_.model = spec_.build(config, step_.shape);
  if (env_.group) check_launch_matches(config, *step_.model.module);
  if (!meta_init) step_.model.init_weights(seed, {});

  step_.plan = spec_.parallelize(step_.model, config, dims_, env_.group);
  // Each cp rank is fed chunks of the sequences: a family that did not put ring attention in would train on them
  // as if they were whole sequences.
  TORCH_CHECK(dims_.cp == 1 || step_.plan.cp_mesh.valid(), "parallelism.context_parallel_degree > 1: the ",
              config.model.name, " family does not apply context parallelism");
  step_.moe_blocks = moe_layers(*step_.model.module);
  step_.moe_held.assign(step_.moe_blocks.size(), step_.plan.stages.empty());
  for (auto& stage : step_.plan.stages) {
    for (auto* moe : moe_layers(*stage.module)) {
      for (size_t l = 0; l < step_.moe_blocks.size(); ++l)
        step_.moe_held[l] = step_.moe_held[l] || step_.moe_blocks[l] == moe;
    }
  }
  step_.loss_sum_of = [this](const torch::Tensor& logits, const torch::Tensor& labels) {
    if (step_.plan.loss_parallel)
      return fsdp::loss_parallel_cross_entropy(logits, labels, step_.plan.tp_mesh, -100, fsdp::LossReduction::Sum);
    return torch::nn::functional::cross_entropy(
        logits.to(torch::kFloat), labels,
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum).ignore_index(-100));
  };
  // A single process (no group, so no fully_shard to place the parameters): the whole model on the device.
  if (!env_.group && !device_.is_cpu()) step_.model.module->to(device_);
  if (meta_init && step_.plan.stages.empty()) {
    fsdp::materialize_module(*step_.model.module, device_);
    step_.model.init_weights(seed, fsdp::full_params_init_scope(*step_.model.module));
  } else if (meta_init) {
    // Pipeline stages: only this rank's stages get storage. The whole model's init runs in full order (one
    // generator, the same numbers as an unsharded init); the parts of other ranks' stages stay on `meta` and draw
    // nothing: the generator jumps past their numbers (src/models/generator_skip.h).
    std::vector<std::function<void(torch::nn::Module&, const std::function<void()>&)>> scopes;
    std::vector<std::unordered_set<const torch::nn::Module*>> held;
    for (auto& stage : step_.plan.stages) {
      fsdp::materialize_module(*stage.module, device_);
      scopes.push_back(fsdp::full_params_init_scope(*stage.module));
      held.emplace_back();
      for (const auto& m : stage.module->modules(/*include_self=*/true)) held.back().insert(m.get());
    }
    step_.model.init_weights(seed, [&](torch::nn::Module& part, const std::function<void()>& fn) {
      for (size_t i = 0; i < held.size(); ++i) {
        if (held[i].count(&part)) return scopes[i](part, fn);
      }
      fn();
    });
  }
  if (env_.group) env_.group->set_timeout(std::chrono::seconds(config.comm.init_timeout_seconds));
}

void Trainer::build_pipeline() {
  // Pipeline parallelism: the schedule runs the stages; each microbatch's loss is its summed token loss over the
  // step's global token count (set before each step), so the microbatches and ranks add up to the batch's mean.
  // The schedule is the one the family's split placed the stages by (plan.pipeline_schedule), not built again.
  if (!step_.plan.stages.empty()) {
    TORCH_CHECK(!step_.plan.pipeline_schedule.actions.empty(), "the ", config_.model.name,
                " family's pipeline split gave stages but no ParallelPlan::pipeline_schedule");
    std::vector<fsdp::PipelineStage> stages;
    for (size_t i = 0; i < step_.plan.stages.size(); ++i) {
      const ModelStage& stage = step_.plan.stages[i];
      // block_causal: every stage gets its microbatch's document ids alongside (the pipeline's context).
      stages.push_back({step_.plan.stage_indices[i], stage.module, nullptr, stage.forward});
    }
    step_.pipeline = std::make_unique<fsdp::Pipeline>(
        std::move(stages), step_.plan.pp_group,
        [this](const torch::Tensor& logits, const torch::Tensor& labels) {
          return step_.loss_sum_of(logits.reshape({-1, logits.size(-1)}), labels.reshape({-1})) /
                 step_.pipeline_global_tokens;
        },
        step_.plan.pipeline_schedule);
  }
}

void Trainer::build_optimizer() {
  const auto& o = config_.optimizer;
  // Under PP only this rank's stages' parameters (the others' stay on `meta`, or are not trained here).
  if (step_.plan.stages.empty()) {
    step_.params = step_.model.module->parameters();
  } else {
    for (auto& stage : step_.plan.stages) {
      for (auto& p : stage.module->parameters()) step_.params.push_back(p);
    }
  }
  if (o.name == OptimizerName::AdamW) {
    step_.optimizer = std::make_unique<torch::optim::AdamW>(
        step_.params, torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
  } else {
    step_.optimizer = std::make_unique<torch::optim::Adam>(
        step_.params, torch::optim::AdamOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
  }
  const auto& s = config_.lr_scheduler;
  const double* decay_ratio = s.decay_ratio ? &*s.decay_ratio : nullptr;
  step_.lr_schedule =
      LRSchedule::build(config_.training.steps, s.warmup_steps, decay_ratio, s.decay_type, s.min_lr_factor);
}

// The peak FLOP/s the MFU is measured against: metrics.peak_tflops, the device's bf16 peak, or on the CPU measured
// by every rank together (the lowest).
void Trainer::build_peak_tflops() {
  const JobConfig& config = config_;
  const TrainEnv& env = env_;
  if (config.metrics.peak_tflops > 0) {
    outputs_.summary.peak_tflops = config.metrics.peak_tflops;
    outputs_.peak_source = "metrics.peak_tflops";
  } else if (device_.is_cuda()) {
    // TorchTitan's MFU: against the device's dense bf16 peak from its name; an unknown device as an A100.
    const std::string name = cuda_support::device_name(device_.index());
    const auto peak = bf16_peak_tflops(name);
    outputs_.summary.peak_tflops = peak.value_or(312.0);
    outputs_.peak_source = peak ? name + " bf16 peak" : name + ": unknown device, an A100's bf16 peak assumed (set metrics.peak_tflops)";
  } else {
    outputs_.peak_source = "measured";
    if (env.group) env.group->barrier().wait();  // all ranks measure together: the peak under the same sharing
    outputs_.summary.peak_tflops = measure_peak_tflops();
    outputs_.summary.peak_tflops = all_reduce(env.group, {outputs_.summary.peak_tflops}, fsdp::ReduceOp::Min)[0];
  }
}

// The checkpointer, and the state a checkpoint holds restored when there is one.
void Trainer::build_checkpointer_and_restore() {
  const JobConfig& config = config_;
  const TrainEnv& env = env_;
  services_.checkpointer = make_checkpointer(config, env.rank, env.group);
  step_.state.model = step_.model.module.get();
  if (step_.plan.stages.empty()) {
    step_.state.parts = {step_.model.module.get()};
  } else {
    for (auto& stage : step_.plan.stages) step_.state.parts.push_back(stage.module.get());
  }
  step_.state.optimizer = step_.optimizer.get();
  step_.state.data = services_.loader.get();
  const bool loaded = services_.checkpointer->load(step_.state);
  if (services_.ft) services_.ft->set_started_from(loaded ? step_.state.step : -1);
  outputs_.first_step = step_.state.step + 1;
}

}  // namespace fsdp_train
