// See metrics_processor.h.
#include "metrics_processor.h"

#include <unistd.h>

#include <filesystem>
#include <iostream>

namespace fsdp_train {
namespace {
double seconds_since(MetricsProcessor::Clock::time_point t) {
  return std::chrono::duration<double>(MetricsProcessor::Clock::now() - t).count();
}
}  // namespace

MetricsProcessor::MetricsProcessor(const JobConfig& config, int rank, bool verbose)
    : say_(rank == 0 && verbose),
      tty_(say_ && isatty(STDOUT_FILENO)),
      lr_tag_(std::string("lr/") + to_string(config.optimizer.name)),  // TorchTitan: lr/<optimizer class>
      log_freq_(config.metrics.log_freq) {
  const bool main_rank = rank == 0;
  const auto& m = config.metrics;
  if (main_rank || m.save_for_all_ranks) {
    const std::string name = main_rank && !m.save_for_all_ranks ? "metrics.jsonl"
                                                                 : "metrics_rank" + std::to_string(rank) + ".jsonl";
    jsonl_ = JsonlWriter((std::filesystem::path(config.job.dump_folder) / name).string());
  }
  if (m.enable_tensorboard && (main_rank || m.save_for_all_ranks))
    tb_ = TensorBoardWriter(tensorboard_log_dir(config.job.dump_folder, m.save_tb_folder, m.save_for_all_ranks, rank));
  start();
}

void MetricsProcessor::start() { t_start_ = t_window_ = Clock::now(); }

void MetricsProcessor::add_step(int64_t local_tokens, double data_seconds) {
  window_tokens_ += local_tokens;
  ++window_steps_;
  window_data_s_ += data_seconds;
}

void MetricsProcessor::exclude(double seconds) {
  t_window_ += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

bool MetricsProcessor::should_log(int64_t step, bool last) const {
  return step == 1 || step % log_freq_ == 0 || last;
}

double MetricsProcessor::elapsed() const { return seconds_since(t_start_); }

void MetricsProcessor::log(StepMetrics& m, double flops_per_token, double peak_tflops) {
  const double dt = seconds_since(t_window_);
  const double steps = static_cast<double>(std::max<int64_t>(window_steps_, 1));
  m.tps = static_cast<double>(window_tokens_) / dt;
  m.tflops = flops_per_token * m.tps / 1e12;
  m.mfu = 100.0 * m.tflops / peak_tflops;
  m.data_s = window_data_s_;
  m.step_s = dt / steps;
  if (!first_window_) {  // the first window holds one-time costs (allocation, lazy init)
    tps_sum_ += m.tps * static_cast<double>(window_steps_);
    mfu_sum_ += m.mfu * static_cast<double>(window_steps_);
    steady_steps_ += window_steps_;
  }
  first_window_ = false;
  jsonl_.write(m);
  if (tb_.is_open()) {  // TorchTitan's scalar names
    const int64_t step = m.step;
    tb_.add_scalar("loss_metrics/global_avg_loss", m.loss, step);
    tb_.add_scalar("loss_metrics/global_max_loss", m.max_loss, step);
    tb_.add_scalar("grad_norm", m.grad_norm, step);
    tb_.add_scalar(lr_tag_, m.lr, step);
    tb_.add_scalar("throughput(tps)", m.tps, step);
    tb_.add_scalar("tflops", m.tflops, step);
    tb_.add_scalar("mfu(%)", m.mfu, step);
    tb_.add_scalar("time_metrics/end_to_end(s)", m.step_s, step);
    tb_.add_scalar("time_metrics/data_loading(s)", m.data_s / steps, step);
    tb_.add_scalar("time_metrics/data_loading(%)", 100.0 * m.data_s / dt, step);
    tb_.add_scalar("memory/max_reserved(GiB)", m.mem_gib, step);  // CPU: this rank's peak RSS
    if (m.device_memory) {
      tb_.add_scalar("memory/max_active(GiB)", m.mem_max_active_gib, step);
      if (m.mem_max_active_pct >= 0) tb_.add_scalar("memory/max_active(%)", m.mem_max_active_pct, step);
      if (m.mem_max_reserved_pct >= 0) tb_.add_scalar("memory/max_reserved(%)", m.mem_max_reserved_pct, step);
      tb_.add_scalar("memory/num_alloc_retries", static_cast<double>(m.mem_alloc_retries), step);
      tb_.add_scalar("memory/num_ooms", static_cast<double>(m.mem_ooms), step);
    }
    for (size_t l = 0; l < m.expert_tokens_min.size(); ++l) {     // per MoE layer, in layer order
      const std::string tag = "moe/layer_" + std::to_string(l) + "/";
      tb_.add_scalar(tag + "expert_tokens_min", m.expert_tokens_min[l], step);
      tb_.add_scalar(tag + "expert_tokens_max", m.expert_tokens_max[l], step);
    }
    if (m.moe_aux_loss >= 0) tb_.add_scalar("moe/aux_loss", m.moe_aux_loss, step);
    tb_.flush();
  }
  if (say_) std::cout << (tty_ ? "\r\033[K" : "") << format_log_line(m) << std::endl;
  t_window_ = Clock::now();
  window_tokens_ = window_steps_ = 0;
  window_data_s_ = 0;
}

void MetricsProcessor::progress(StepMetrics& m) {
  if (!tty_) return;
  m.tps = static_cast<double>(window_tokens_) / seconds_since(t_window_);
  std::cout << "\r\033[K" << format_progress(m, m.eta_s) << std::flush;
}

void MetricsProcessor::log_validation(int64_t step, double loss, double perplexity, int64_t tokens, double tps,
                                      double seconds) {
  jsonl_.write_validation(step, loss, perplexity, tokens, seconds);
  if (tb_.is_open()) {
    tb_.add_scalar("validation_metrics/loss", loss, step);
    tb_.add_scalar("validation_metrics/perplexity", perplexity, step);
    tb_.add_scalar("validation_metrics/throughput(tps)", tps, step);
    tb_.flush();
  }
  if (say_) std::cout << (tty_ ? "\r\033[K" : "") << format_validation_line(step, loss, perplexity, tps, seconds) << std::endl;
  exclude(seconds);
}

std::vector<std::pair<std::string, std::string>> MetricsProcessor::outputs() const {
  std::vector<std::pair<std::string, std::string>> out;
  if (jsonl_.is_open()) out.push_back({"metrics (JSON lines)", jsonl_.path()});
  if (tb_.is_open()) out.push_back({"TensorBoard events", tb_.log_dir()});
  return out;
}

}  // namespace fsdp_train
