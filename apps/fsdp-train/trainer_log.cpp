// The Trainer's outputs (trainer_parts.h): the start-up header on the console, each step's metrics (the log line,
// metrics.jsonl, TensorBoard, through MetricsProcessor) and the summary the run returns.
#include "attention_memory.h"
#include "device_stats.h"
#include "metrics.h"
#include "trainer_parts.h"

#include <fsdp/activation_checkpoint.h>

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>

namespace fsdp_train {

// One block's attention memory on this rank (attention_memory.h, the formula fsdp-plan reports): at the tokens of
// a (micro)batch it holds, in the compute dtype; with cp, what a ring-attention call holds beyond it.
std::string Trainer::attention_memory_text() const {
  const AttentionShape& shape = step_.model.attention;
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
  const std::string tb = outputs_.metrics->tensorboard_dir();
  std::cout << "fsdp-train: " << config.job.description << "\n"
            << "  model     " << config.model.name << " " << config.model.flavor << ": " << step_.model.summary << ", " << step_.model.num_params << " parameters"
            << (services_.document_eos
                    ? ", block_causal attention (documents end at EOS " + std::to_string(*services_.document_eos) + ")"
                    : "")
            << "\n"
            << "  tokenizer " << services_.tokenizer->describe() << "\n"
            << "  data      " << to_string(config.training.dataset) << ": " << services_.files.size() << " files\n"
            << "  ranks     " << env_.world_size << " ("
            << (dims.pp > 1 ? "pp " + std::to_string(dims.pp) + " x " : std::string()) << "dp replicate "
            << dims.dp_replicate << " x shard " << dims.dp_shard
            << (dims.cp > 1 ? " x cp " + std::to_string(dims.cp) : std::string())
            << (dims.tp > 1 ? " x tp " + std::to_string(dims.tp) : std::string())
            << (dims.ep > 1 ? ", experts over ep " + std::to_string(dims.ep) + " inside shard" : std::string()) << "); "
            << outputs_.summary.plan << "\n"
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
            << "  peak      " << outputs_.summary.peak_tflops << " TFLOP/s per rank (" << outputs_.peak_source << "), "
            << step_.model.flops_per_token / 1e6 << " MFLOP per token\n"
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
  if (services_.validator)
    std::cout << "  validate  " << to_string(config.validation.dataset) << ": " << services_.validator->files().size() << " files, "
              << services_.validator->num_samples() << " samples of " << config.validation.seq_len + 1 << " tokens, "
              << services_.validator->batches_per_run() << " batches of " << config.validation.local_batch_size
              << " per rank at step 1 and every " << config.validation.freq << " steps\n";
  std::cout << std::flush;
}

void Trainer::log(int64_t step, const StepResult& r, const TrainSummary::TensorMemory& tmem) {
  const int64_t S = config_.training.seq_len;
  StepMetrics m;
  m.step = step;
  m.total_steps = config_.training.steps;
  m.loss = r.loss;
  m.grad_norm = r.grad_norm;
  m.lr = r.lr;
  m.elapsed_s = outputs_.metrics->elapsed();
  m.eta_s = m.elapsed_s / static_cast<double>(step - outputs_.first_step + 1) * static_cast<double>(config_.training.steps - step);
  m.tokens_seen = step * dims_.global_batch_size * S;
  m.expert_tokens_min = r.expert_load.min_tokens;
  m.expert_tokens_max = r.expert_load.max_tokens;
  if (!r.expert_load.empty()) m.expert_tokens_mean = r.expert_load.mean_tokens.front();
  m.moe_aux_loss = r.aux_loss;
  if (services_.ft) m.ft_replicas = services_.ft->members();
  if (track_tensors_) {
    m.tensor_start_bytes = tmem.start;
    m.tensor_forward_bytes = tmem.forward;
    m.tensor_peak_bytes = tmem.peak;
  }
  if (!outputs_.metrics->should_log(step, step == config_.training.steps)) return outputs_.metrics->progress(m);
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
    TrainSummary& summary = outputs_.summary;
    summary.device_max_reserved_bytes = std::max(summary.device_max_reserved_bytes, mem->max_reserved);
    summary.device_max_active_bytes = std::max(summary.device_max_active_bytes, mem->max_active);
    reset_device_memory_peaks(device_);
  } else {
    m.mem_gib = static_cast<double>(peak_rss_bytes()) / kGiB;
  }
  m.mem_max_gib = all_reduce(env_.group, {m.mem_gib}, fsdp::ReduceOp::Max)[0];
  outputs_.metrics->log(m, step_.model.flops_per_token, outputs_.summary.peak_tflops);
}

void Trainer::finish_summary(bool compute_entropy) {
  TrainSummary& summary = outputs_.summary;
  const int64_t S = config_.training.seq_len;
  summary.seconds = outputs_.metrics->elapsed();
  summary.tokens_seen = step_.state.step * dims_.global_batch_size * S;
  summary.dump_folder = config_.job.dump_folder;
  summary.device = device_.str();
  if (main_rank_) {
    const std::filesystem::path dump(config_.job.dump_folder);
    summary.outputs.push_back({"effective config", (dump / "config.toml").string()});
    for (auto& o : outputs_.metrics->outputs()) summary.outputs.push_back(o);
    for (auto& o : services_.profiler->outputs()) summary.outputs.push_back(o);
    if (config_.checkpoint.enable)
      summary.outputs.push_back({"checkpoints", (dump / config_.checkpoint.folder).string()});
  }
  const size_t n = summary.losses.size(), k = std::min<size_t>(10, n);
  for (size_t i = n - k; i < n; ++i) summary.final_loss += summary.losses[i] / static_cast<double>(k);
  summary.mean_tps = outputs_.metrics->mean_tps();
  summary.mean_mfu = outputs_.metrics->mean_mfu();
  if (compute_entropy && main_rank_)
    summary.unigram_entropy = unigram_entropy_nats(services_.files, services_.tokenizer, step_.shape.vocab_size,
                                                   &summary.epoch_tokens, services_.text_options);
  const fsdp::CheckpointStats ac = fsdp::checkpoint_stats(*step_.model.module);
  summary.ac_forwards = ac.forwards;
  summary.ac_recomputes = ac.recomputes;
  summary.ac_mm_reused = ac.mm_reused;
  summary.bad_records = services_.loader->bad_records();
  if (services_.validator) summary.validation_bad_records = services_.validator->bad_records();
}

}  // namespace fsdp_train
