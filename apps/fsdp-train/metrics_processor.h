#pragma once
// TorchTitan's MetricsProcessor: one StepMetrics record goes to the console log line, metrics.jsonl and
// TensorBoard (TorchTitan's scalar names), and the throughput window between two logged steps is kept here. The
// trainer fills a record (loss, grad norm, lr, memory, expert load); the processor completes its throughput
// fields from the window and writes it. No torch headers, no collectives: values that need the other ranks
// (max loss, max memory) are reduced by the caller.

#include "config.h"
#include "metrics.h"
#include "tensorboard.h"

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fsdp_train {

class MetricsProcessor {
 public:
  using Clock = std::chrono::steady_clock;
  // rank 0 writes metrics.jsonl (and TensorBoard with metrics.enable_tensorboard); with
  // metrics.save_for_all_ranks every rank writes its own. `verbose`: console output on rank 0.
  MetricsProcessor(const JobConfig& config, int rank, bool verbose);

  // Throughput accounting: the first step starts the clock; each step adds its local tokens and data time.
  void start();
  void add_step(int64_t local_tokens, double data_seconds);
  // Time spent outside training (validation) is left out of the current window.
  void exclude(double seconds);
  bool should_log(int64_t step, bool last) const;
  double elapsed() const;

  // Fills m.tps, tflops, mfu, step_s and data_s from the window since the previous log, writes the record
  // everywhere and starts a new window. flops_per_token / peak_tflops: for MFU.
  void log(StepMetrics& m, double flops_per_token, double peak_tflops);
  // Between logged steps on a terminal: the progress line with ETA (rank 0).
  void progress(StepMetrics& m);
  void log_validation(int64_t step, double loss, double perplexity, int64_t tokens, double tps, double seconds);

  // Mean tokens/s per rank and MFU over every logged window but the first (one-time costs).
  double mean_tps() const { return steady_steps_ ? tps_sum_ / static_cast<double>(steady_steps_) : 0; }
  double mean_mfu() const { return steady_steps_ ? mfu_sum_ / static_cast<double>(steady_steps_) : 0; }
  // What was written where (rank 0).
  std::vector<std::pair<std::string, std::string>> outputs() const;
  std::string tensorboard_dir() const { return tb_.is_open() ? tb_.log_dir() : std::string(); }

 private:
  bool say_, tty_;
  std::string lr_tag_;
  int64_t log_freq_;
  JsonlWriter jsonl_;
  TensorBoardWriter tb_;
  Clock::time_point t_start_, t_window_;
  int64_t window_tokens_ = 0, window_steps_ = 0;
  double window_data_s_ = 0;
  bool first_window_ = true;
  double tps_sum_ = 0, mfu_sum_ = 0;
  int64_t steady_steps_ = 0;
};

}  // namespace fsdp_train
