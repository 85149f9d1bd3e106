// The training loop (see trainer.h). The only translation unit of the trainer that includes <torch/torch.h>.
#include "trainer.h"

#include "checkpoint_seam.h"
#include "data.h"
#include "lr_schedule.h"
#include "metrics.h"
#include "parallelize.h"
#include "tensor_memory.h"
#include "tensorboard.h"
#include "validate.h"

#include <fsdp/activation_checkpoint.h>
#include <fsdp/clip_grad.h>
#include <fsdp/materialize.h>
#include <fsdp/tensor_parallel.h>
#include <fsdp/models/llama.h>
#include <fsdp/nn/module_call.h>
#include <fsdp/pipeline.h>
#include <fsdp/launch_check.h>

#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>
#include <unordered_set>

namespace fsdp_train {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Sum of a few doubles over the group (identity without a group).
std::vector<double> all_reduce(const fsdp::ProcessGroupPtr& group, std::vector<double> values,
                               fsdp::ReduceOp op = fsdp::ReduceOp::Sum) {
  if (!group) return values;
  auto t = torch::tensor(values, torch::kDouble);
  group->all_reduce(t, op).wait();
  auto* p = t.data_ptr<double>();
  return std::vector<double>(p, p + values.size());
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

TrainEnv init_distributed(const JobConfig& config) {
  TrainEnv env;
  const char* ws = std::getenv("WORLD_SIZE");
  if (ws && std::atoi(ws) > 1) {
    fsdp::InitOptions opts;
    opts.timeout = std::chrono::seconds(config.comm.init_timeout_seconds);
    // The process group works on the mesh's device (training.device): Gloo for the CPU; for CUDA, NCCL where
    // libfsdp has it, else Gloo on CUDA tensors.
    if (mesh_device(config).is_cuda()) opts.device = config.training.device;
    else opts.backend = "gloo";
    env.group = fsdp::init_process_group(opts);
    env.rank = env.group->rank();
    env.world_size = env.group->size();
  }
  return env;
}

TrainSummary run_training(const JobConfig& config, const TrainEnv& env, bool compute_entropy) {
  const bool main_rank = env.rank == 0;
  const bool say = main_rank && env.verbose;
  const auto dims = resolve_parallelism(config, env.world_size);
  set_threads();
  torch::manual_seed(static_cast<uint64_t>(config.debug.seed));
  if (config.debug.deterministic) at::globalContext().setDeterministicAlgorithms(true, false);

  // Before the model exists, so that its storages are counted (tensor_memory.h).
  const bool track_tensors = config.metrics.tensor_memory;
  if (track_tensors) tensor_memory::install();

  // ---- tokenizer, data, model ----
  auto tokenizer = make_tokenizer(config.model.tokenizer_path);
  const auto files = resolve_dataset_files(config.training.dataset, config.training.dataset_path);
  fsdp::nn::llama::LlamaArgs args = model_args(config);
  args.vocab_size = tokenizer->vocab_size();  // TorchTitan: the model's vocab follows the tokenizer
  args.max_seq_len = config.training.seq_len;
  // Mesh [pp, dp_replicate, dp_shard, tp]: the tp ranks of a data-parallel rank, and its pp ranks, read the
  // same samples (the first stage needs the tokens, the last the labels).
  const int64_t dp_rank = dims.dp_rank_of(env.rank);
  const TextOptions text_options{config.training.dataset_text_field, config.training.bad_records == "skip", main_rank};
  DataLoader loader(files, tokenizer, args.vocab_size,
                    {config.training.seq_len, dims.local_batch_size, dims.grad_accum_steps, dp_rank, dims.dp_degree()},
                    text_options);
  std::unique_ptr<Validator> validator;
  if (config.validation.enable)
    validator = std::make_unique<Validator>(config.validation, tokenizer, args.vocab_size, dp_rank, dims.dp_degree(),
                                            text_options);

  // With FSDP the model is built on `meta` (no full copy on any rank), sharded, then only the local shards are
  // allocated and initialized unit by unit — the same weights as an unsharded init (TorchTitan's flow).
  const bool meta_init = !plan_needs_full_init(dims, env.group != nullptr);
  const uint64_t seed = static_cast<uint64_t>(config.debug.seed);
  if (meta_init) args.device = c10::kMeta;
  fsdp::nn::llama::Transformer model(args);
  if (env.group) check_launch_matches(config, *model);
  if (!meta_init) model->init_weights(seed);
  const int64_t n_params = fsdp::nn::llama::num_params(args);
  const double flops_per_token = fsdp::nn::llama::flops_per_token(args, config.training.seq_len);

  ParallelPlan plan = parallelize_llama(model, config, dims, env.group);
  const std::vector<fsdp::nn::moe::MoEImpl*> moe_blocks = moe_layers(*model);
  // The summed token loss of flattened logits (training and validation alike): with loss parallel the logits are
  // sharded over the vocabulary and the cross entropy reduces over the TP group.
  const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> loss_sum_of = [&plan](const torch::Tensor& logits, const torch::Tensor& labels) {
    if (plan.loss_parallel)
      return fsdp::loss_parallel_cross_entropy(logits, labels, plan.tp_mesh, -100, fsdp::LossReduction::Sum);
    return torch::nn::functional::cross_entropy(
        logits.to(torch::kFloat), labels,
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum).ignore_index(-100));
  };
  if (meta_init && plan.stages.empty()) {
    fsdp::materialize_module(*model);
    model->init_weights(seed, fsdp::full_params_init_scope(*model));
  } else if (meta_init) {
    // Pipeline stages: only this rank's stages get storage. The whole model's init runs in full order (one
    // generator, the same numbers as an unsharded init); the parts of other ranks' stages stay on `meta`, where
    // the copies are no-ops.
    std::vector<std::function<void(torch::nn::Module&, const std::function<void()>&)>> scopes;
    std::vector<std::unordered_set<const torch::nn::Module*>> held;
    for (auto& stage : plan.stages) {
      fsdp::materialize_module(*stage);
      scopes.push_back(fsdp::full_params_init_scope(*stage));
      held.emplace_back();
      for (const auto& m : stage->modules(/*include_self=*/true)) held.back().insert(m.get());
    }
    model->init_weights(seed, [&](torch::nn::Module& part, const std::function<void()>& fn) {
      for (size_t i = 0; i < held.size(); ++i) {
        if (held[i].count(&part)) return scopes[i](part, fn);
      }
      fn();
    });
  }
  // Pipeline parallelism: the schedule runs the stages; each microbatch's loss is its summed token loss over the
  // step's global token count (set before each step), so the microbatches and ranks add up to the batch's mean.
  double pipeline_global_tokens = 1;
  std::unique_ptr<fsdp::Pipeline> pipeline;
  if (!plan.stages.empty()) {
    std::vector<fsdp::PipelineStage> stages;
    for (size_t i = 0; i < plan.stages.size(); ++i) {
      auto stage = plan.stages[i];
      stages.push_back({plan.stage_indices[i], stage.ptr(),
                        [stage](const torch::Tensor& x) { return fsdp::nn::call(stage, x); }});
    }
    fsdp::PipelineOptions popts;
    popts.schedule = config.parallelism.pipeline_parallel_schedule;
    popts.microbatches = static_cast<int>(dims.pp_microbatches);
    popts.num_stages = plan.num_stages;
    pipeline = std::make_unique<fsdp::Pipeline>(
        std::move(stages), plan.pp_group,
        [&loss_sum_of, &pipeline_global_tokens](const torch::Tensor& logits, const torch::Tensor& labels) {
          return loss_sum_of(logits.reshape({-1, logits.size(-1)}), labels.reshape({-1})) / pipeline_global_tokens;
        },
        popts);
  }
  if (env.group) env.group->set_timeout(std::chrono::seconds(config.comm.init_timeout_seconds));

  // ---- optimizer and schedule ----
  // Under PP only this rank's stages' parameters (the others' stay on `meta`, or are not trained here).
  std::vector<torch::Tensor> params;
  if (plan.stages.empty()) {
    params = model->parameters();
  } else {
    for (auto& stage : plan.stages) {
      for (auto& p : stage->parameters()) params.push_back(p);
    }
  }
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (config.optimizer.name == "AdamW") {
    optimizer = std::make_unique<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(config.optimizer.lr)
                    .betas({config.optimizer.beta1, config.optimizer.beta2})
                    .eps(config.optimizer.eps)
                    .weight_decay(config.optimizer.weight_decay));
  } else {
    optimizer = std::make_unique<torch::optim::Adam>(
        params, torch::optim::AdamOptions(config.optimizer.lr)
                    .betas({config.optimizer.beta1, config.optimizer.beta2})
                    .eps(config.optimizer.eps)
                    .weight_decay(config.optimizer.weight_decay));
  }
  const double* decay_ratio = config.lr_scheduler.decay_ratio ? &*config.lr_scheduler.decay_ratio : nullptr;
  const LRSchedule schedule = LRSchedule::build(config.training.steps, config.lr_scheduler.warmup_steps, decay_ratio,
                                                config.lr_scheduler.decay_type, config.lr_scheduler.min_lr_factor);

  // ---- metrics ----
  TrainSummary summary;
  summary.plan = plan.description + "; " + plan.activation_checkpointing;
  if (config.metrics.peak_tflops > 0) {
    summary.peak_tflops = config.metrics.peak_tflops;
  } else {
    if (env.group) env.group->barrier().wait();  // all ranks measure together: the peak under the same sharing
    summary.peak_tflops = measure_peak_tflops();
    summary.peak_tflops = all_reduce(env.group, {summary.peak_tflops}, fsdp::ReduceOp::Min)[0];
  }
  JsonlWriter jsonl;
  if (main_rank || config.metrics.save_for_all_ranks) {
    const std::string name = main_rank && !config.metrics.save_for_all_ranks ? "metrics.jsonl"
                                                                              : "metrics_rank" + std::to_string(env.rank) + ".jsonl";
    jsonl = JsonlWriter((std::filesystem::path(config.job.dump_folder) / name).string());
  }
  TensorBoardWriter tb;
  if (config.metrics.enable_tensorboard && (main_rank || config.metrics.save_for_all_ranks))
    tb = TensorBoardWriter(tensorboard_log_dir(config.job.dump_folder, config.metrics.save_tb_folder,
                                               config.metrics.save_for_all_ranks, env.rank));
  const std::string lr_tag = "lr/" + config.optimizer.name;  // TorchTitan: lr/<optimizer class>
  if (main_rank) {
    std::filesystem::create_directories(config.job.dump_folder);
    std::ofstream(std::filesystem::path(config.job.dump_folder) / "config.toml") << to_toml(config);
  }
  if (say) {
    std::cout << "fsdp-train: " << config.job.description << "\n"
              << "  model     " << config.model.name << " " << config.model.flavor << ": dim " << args.dim << ", "
              << args.n_layers << " layers, " << args.n_heads << " heads (" << args.kv_heads() << " kv), "
              << (args.moe ? std::to_string(args.moe->num_experts) + " experts (top-" + std::to_string(args.moe->top_k) +
                                 ", " + args.moe->score_func + ", hidden " + std::to_string(args.moe->hidden) +
                                 (args.moe->num_shared_experts ? ", shared " + std::to_string(args.moe->num_shared_experts) : "") + ")"
                           : "ffn " + std::to_string(args.ffn_hidden_dim()))
              << ", vocab " << args.vocab_size << ", " << n_params << " parameters\n"
              << "  tokenizer " << tokenizer->describe() << "\n"
              << "  data      " << config.training.dataset << ": " << files.size() << " files\n"
              << "  ranks     " << env.world_size << " ("
              << (dims.pp > 1 ? "pp " + std::to_string(dims.pp) + " x " : std::string()) << "dp replicate "
              << dims.dp_replicate << " x shard " << dims.dp_shard
              << (dims.tp > 1 ? " x tp " + std::to_string(dims.tp) : std::string())
              << (dims.ep > 1 ? ", experts over ep " + std::to_string(dims.ep) + " inside shard" : std::string()) << "); "
              << summary.plan << "\n"
              << "  batch     global " << dims.global_batch_size << " x " << config.training.seq_len << " tokens = local "
              << dims.local_batch_size << " x " << dims.grad_accum_steps << " accumulation x " << dims.dp_degree()
              << " ranks; " << torch::get_num_threads() << " threads per rank\n"
              << "  peak      " << summary.peak_tflops << " TFLOP/s per rank ("
              << (config.metrics.peak_tflops > 0 ? "metrics.peak_tflops" : "measured") << "), "
              << flops_per_token / 1e6 << " MFLOP per token\n"
              << "  output    " << config.job.dump_folder << "/metrics.jsonl"
              << (tb.is_open() ? ", TensorBoard " + tb.log_dir() : std::string()) << "\n";
    if (validator)
      std::cout << "  validate  " << config.validation.dataset << ": " << validator->files().size() << " files, "
                << validator->num_samples() << " samples of " << config.validation.seq_len + 1 << " tokens, "
                << validator->batches_per_run() << " batches of " << config.validation.local_batch_size
                << " per rank at step 1 and every " << config.validation.freq << " steps\n";
    std::cout << std::flush;
  }

  auto checkpointer = make_checkpointer(config, env.rank, env.group);
  TrainState state;
  state.model = model.ptr().get();
  if (plan.stages.empty()) {
    state.parts = {model.ptr().get()};
  } else {
    for (auto& stage : plan.stages) state.parts.push_back(stage.ptr().get());
  }
  state.optimizer = optimizer.get();
  state.data = &loader;
  checkpointer->load(state);
  const int64_t first_step = state.step + 1;

  const bool tty = say && isatty(STDOUT_FILENO);
  const int64_t S = config.training.seq_len;
  // Tokens per rank (TorchTitan's tps): the tp ranks of a data-parallel rank share its tokens (each does 1/tp of
  // their FLOPs), so tokens/s per rank x world size = global tokens/s and MFU stays comparable across layouts.
  // Under PP each pp rank runs 1/pp of the layers of its data-parallel rank's tokens: count them so as well.
  const int64_t tokens_per_step_local = dims.local_batch_size * dims.grad_accum_steps * S / dims.tp / dims.pp;
  const auto t_start = Clock::now();
  auto t_window = t_start;
  int64_t window_tokens = 0, window_steps = 0;
  double window_data_s = 0, tps_sum = 0, mfu_sum = 0;
  int64_t tps_count = 0;
  bool first_window = true;

  for (int64_t step = state.step + 1; step <= config.training.steps; ++step) {
    const double lr = config.optimizer.lr * schedule.factor(step - 1);
    for (auto& group : optimizer->param_groups()) group.options().set_lr(lr);
    optimizer->zero_grad();

    // Data first, so that the global token count is known before any backward.
    const auto t_data = Clock::now();
    std::vector<Batch> batches;
    int64_t local_tokens = 0;
    for (int64_t m = 0; m < dims.grad_accum_steps; ++m) {
      batches.push_back(loader.next());
      for (int64_t l : batches.back().labels) local_tokens += l != -100;
    }
    window_data_s += seconds_since(t_data);
    // The TP and PP ranks of a data-parallel rank hold the same tokens: count them once.
    const double global_tokens = all_reduce(env.group, {static_cast<double>(local_tokens)})[0] / dims.tp / dims.pp;

    TrainSummary::TensorMemory tmem;
    if (track_tensors) {
      tmem.start = tensor_memory::live_bytes();
      tensor_memory::reset_peak();
    }
    double local_loss_sum = 0;
    for (auto& b : batches) {
      if (pipeline) {
        // The first stage takes the tokens, the last the labels; each rank runs its part of the schedule.
        pipeline_global_tokens = global_tokens;
        auto inputs = torch::from_blob(b.inputs.data(), {b.batch, b.seq_len}, torch::kLong);
        auto labels = torch::from_blob(b.labels.data(), {b.batch, b.seq_len}, torch::kLong);
        const auto result = pipeline->step(plan.holds_first_stage ? inputs : torch::Tensor(),
                                           plan.holds_last_stage ? labels : torch::Tensor());
        local_loss_sum += result.loss_sum() * global_tokens;  // 0 off the last stage
        continue;
      }
      auto inputs = torch::from_blob(b.inputs.data(), {b.batch, b.seq_len}, torch::kLong);
      auto labels = torch::from_blob(b.labels.data(), {b.batch * b.seq_len}, torch::kLong);
      auto logits = fsdp::nn::call(model, inputs);
      auto loss_sum = loss_sum_of(logits.reshape({-1, logits.size(-1)}), labels);
      if (track_tensors) tmem.forward = tensor_memory::live_bytes();
      // Divided by the global count: summed over micro-batches and ranks, this is the full-batch gradient.
      (loss_sum / global_tokens).backward();
      local_loss_sum += loss_sum.item<double>();
    }
    double grad_norm;
    if (pipeline) {
      // Over every stage of every pp rank (TorchTitan's clip_grad_norm_ with pp_mesh).
      std::vector<std::shared_ptr<torch::nn::Module>> parts;
      for (auto& stage : plan.stages) parts.push_back(stage.ptr());
      grad_norm = fsdp::clip_grad_norm_(parts, config.training.max_norm, 2.0, plan.pp_group).item<double>();
    } else if (plan.fsdp) {
      grad_norm = fsdp::clip_grad_norm_(*model, config.training.max_norm).item<double>();
    } else {
      grad_norm = torch::nn::utils::clip_grad_norm_(params, config.training.max_norm);
    }
    // MoE: the step's expert load over the data-parallel ranks drives the load-balancing bias (TorchTitan runs
    // this as an optimizer step pre-hook; gradient accumulation has summed every microbatch's counts).
    const ExpertLoad expert_load = update_expert_load_balance(moe_blocks, plan.dp_group);
    if (!expert_load.empty()) summary.expert_loads.push_back(expert_load);
    checkpointer->before_optimizer_step();  // an async save's background snapshot is complete
    optimizer->step();
    if (track_tensors) {
      tmem.peak = tensor_memory::peak_bytes();
      summary.tensor_memory.push_back(tmem);
    }
    const double loss = all_reduce(env.group, {local_loss_sum})[0] / dims.tp / global_tokens;
    summary.losses.push_back(loss);
    summary.grad_norms.push_back(grad_norm);
    if (step == 1 && env.group) {
      // Every group the step uses (the mesh's groups carry FSDP's all-gathers and reduce-scatters), not only the
      // world: a rank that stops participating must make the others fail within comm.train_timeout_seconds.
      const std::chrono::seconds t(config.comm.train_timeout_seconds);
      env.group->set_timeout(t);
      if (plan.dp_group) plan.dp_group->set_timeout(t);
      if (plan.mesh.valid())
        for (int64_t d = 0; d < plan.mesh.ndim(); ++d)
          if (auto g = plan.mesh.group(d)) g->set_timeout(t);
    }

    state.step = step;
    state.ntokens_seen = step * dims.global_batch_size * S;
    const bool last = step == config.training.steps;
    checkpointer->maybe_save(state, last);
    if (step == env.stop_after_step) break;  // a test's "crash" right after this step's checkpoint

    window_tokens += tokens_per_step_local;
    ++window_steps;
    StepMetrics m;
    m.step = step;
    m.total_steps = config.training.steps;
    m.loss = loss;
    m.grad_norm = grad_norm;
    m.lr = lr;
    m.elapsed_s = seconds_since(t_start);
    m.eta_s = m.elapsed_s / static_cast<double>(step - first_step + 1) * static_cast<double>(config.training.steps - step);
    m.tokens_seen = step * dims.global_batch_size * S;
    m.expert_tokens_min = expert_load.min_tokens;
    m.expert_tokens_max = expert_load.max_tokens;
    if (!expert_load.empty()) m.expert_tokens_mean = expert_load.mean_tokens.front();
    if (track_tensors) {
      m.tensor_start_bytes = tmem.start;
      m.tensor_forward_bytes = tmem.forward;
      m.tensor_peak_bytes = tmem.peak;
    }
    if (validator && validator->should_validate(step)) {
      Validator::BatchLoss batch_loss;
      if (pipeline) {
        // The forward-only schedule: the last stage's ranks get each microbatch's loss (here: the summed token
        // loss, pipeline_global_tokens = 1).
        batch_loss = [&](const torch::Tensor& x, const torch::Tensor& y) {
          pipeline_global_tokens = 1;
          return pipeline->eval(plan.holds_first_stage ? x : torch::Tensor(), plan.holds_last_stage ? y : torch::Tensor())
              .loss_sum();
        };
      } else {
        batch_loss = [&](const torch::Tensor& x, const torch::Tensor& y) {
          auto logits = fsdp::nn::call(model, x);
          return loss_sum_of(logits.reshape({-1, logits.size(-1)}), y.reshape({-1})).item<double>();
        };
      }
      const ValidationResult v = validator->validate(batch_loss, env.group, dims.tp, dims.tp * dims.pp);
      summary.validation_steps.push_back(step);
      summary.validation_losses.push_back(v.loss);
      jsonl.write_validation(step, v.loss, v.perplexity, v.tokens, v.seconds);
      if (tb.is_open()) {
        tb.add_scalar("validation_metrics/loss", v.loss, step);
        tb.add_scalar("validation_metrics/perplexity", v.perplexity, step);
        tb.add_scalar("validation_metrics/throughput(tps)", v.tps, step);
        tb.flush();
      }
      if (say)
        std::cout << (tty ? "\r\033[K" : "") << format_validation_line(step, v.loss, v.perplexity, v.tps, v.seconds)
                  << std::endl;
      t_window += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(v.seconds));
    }
    const bool log_now = step == 1 || step % config.metrics.log_freq == 0 || last;
    if (log_now) {
      const double dt = seconds_since(t_window);
      m.tps = static_cast<double>(window_tokens) / dt;
      m.tflops = flops_per_token * m.tps / 1e12;
      m.mfu = 100.0 * m.tflops / summary.peak_tflops;
      m.data_s = window_data_s;
      m.step_s = dt / static_cast<double>(window_steps);
      m.max_loss = all_reduce(env.group, {local_tokens > 0 ? local_loss_sum / static_cast<double>(local_tokens) : 0.0},
                              fsdp::ReduceOp::Max)[0];
      m.mem_gib = static_cast<double>(peak_rss_bytes()) / (1 << 30);
      m.mem_max_gib = all_reduce(env.group, {m.mem_gib}, fsdp::ReduceOp::Max)[0];
      if (!first_window) {  // the first window holds one-time costs (allocation, lazy init)
        tps_sum += m.tps * static_cast<double>(window_steps);
        mfu_sum += m.mfu * static_cast<double>(window_steps);
        tps_count += window_steps;
      }
      first_window = false;
      jsonl.write(m);
      if (tb.is_open()) {  // TorchTitan's scalar names
        tb.add_scalar("loss_metrics/global_avg_loss", m.loss, step);
        tb.add_scalar("loss_metrics/global_max_loss", m.max_loss, step);
        tb.add_scalar("grad_norm", m.grad_norm, step);
        tb.add_scalar(lr_tag, m.lr, step);
        tb.add_scalar("throughput(tps)", m.tps, step);
        tb.add_scalar("tflops", m.tflops, step);
        tb.add_scalar("mfu(%)", m.mfu, step);
        tb.add_scalar("time_metrics/end_to_end(s)", m.step_s, step);
        tb.add_scalar("time_metrics/data_loading(s)", m.data_s / static_cast<double>(window_steps), step);
        tb.add_scalar("time_metrics/data_loading(%)", 100.0 * m.data_s / dt, step);
        tb.add_scalar("memory/max_reserved(GiB)", m.mem_gib, step);  // CPU: this rank's peak RSS
        for (size_t l = 0; l < m.expert_tokens_min.size(); ++l) {  // per MoE layer, in layer order
          const std::string tag = "moe/layer_" + std::to_string(l) + "/";
          tb.add_scalar(tag + "expert_tokens_min", m.expert_tokens_min[l], step);
          tb.add_scalar(tag + "expert_tokens_max", m.expert_tokens_max[l], step);
        }
        tb.flush();
      }
      if (say) std::cout << (tty ? "\r\033[K" : "") << format_log_line(m) << std::endl;
      t_window = Clock::now();
      window_tokens = window_steps = 0;
      window_data_s = 0;
    } else if (tty) {
      m.tps = static_cast<double>(window_tokens) / seconds_since(t_window);
      std::cout << "\r\033[K" << format_progress(m, m.eta_s) << std::flush;
    }
  }

  checkpointer->wait();  // a background save or purge finishes (and reports its error) before the job ends
  summary.seconds = seconds_since(t_start);
  summary.tokens_seen = state.step * dims.global_batch_size * S;
  if (main_rank) {
    const std::filesystem::path dump(config.job.dump_folder);
    summary.outputs.push_back({"effective config", (dump / "config.toml").string()});
    if (jsonl.is_open()) summary.outputs.push_back({"metrics (JSON lines)", jsonl.path()});
    if (tb.is_open()) summary.outputs.push_back({"TensorBoard events", tb.log_dir()});
    if (config.checkpoint.enable) summary.outputs.push_back({"checkpoints", (dump / config.checkpoint.folder).string()});
  }
  const size_t n = summary.losses.size(), k = std::min<size_t>(10, n);
  for (size_t i = n - k; i < n; ++i) summary.final_loss += summary.losses[i] / static_cast<double>(k);
  if (tps_count > 0) {
    summary.mean_tps = tps_sum / static_cast<double>(tps_count);
    summary.mean_mfu = mfu_sum / static_cast<double>(tps_count);
  }
  if (compute_entropy && main_rank)
    summary.unigram_entropy =
        unigram_entropy_nats(files, tokenizer, args.vocab_size, &summary.epoch_tokens, text_options);
  const fsdp::CheckpointStats ac = fsdp::checkpoint_stats(*model);
  summary.ac_forwards = ac.forwards;
  summary.ac_recomputes = ac.recomputes;
  summary.ac_mm_reused = ac.mm_reused;
  summary.bad_records = loader.bad_records();
  if (validator) summary.validation_bad_records = validator->bad_records();
  return summary;
}

}  // namespace fsdp_train
