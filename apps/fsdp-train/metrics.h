#pragma once
// Training metrics like TorchTitan's: the per-step record, peak memory from /proc, the rank-0 log line, a
// progress line with ETA when stdout is a terminal, and the JSONL file in job.dump_folder. No torch headers.

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

namespace fsdp_train {

struct StepMetrics {
  int64_t step = 0, total_steps = 0;
  double loss = 0;            // global mean token loss of the step (nats)
  double max_loss = 0;        // highest mean token loss of one data-parallel rank (TorchTitan's global_max_loss)
  double step_s = 0;          // mean wall time per step since the previous log
  double grad_norm = 0;       // before clipping
  double lr = 0;
  double tps = 0;             // tokens/s per rank since the previous log
  double tflops = 0;          // achieved TFLOP/s per rank
  double mfu = 0;             // % of the peak
  double mem_gib = 0;         // this rank's peak: RSS on the CPU, the caching allocator's max reserved on a device
  double mem_max_gib = 0;     // max over ranks
  // On a device (CUDA): TorchTitan's DeviceMemoryMonitor figures of this rank's caching allocator, peaks over the
  // log window (reset after each logged step); device_memory = false on the CPU (the fields are then unused).
  bool device_memory = false;
  double mem_max_active_gib = 0, mem_active_gib = 0, mem_reserved_gib = 0;
  double mem_max_reserved_pct = -1, mem_max_active_pct = -1;  // of the device's memory; -1 = unknown
  int64_t mem_alloc_retries = 0, mem_ooms = 0;
  double data_s = 0;          // time spent loading data since the previous log
  double elapsed_s = 0;       // since the first step started
  double eta_s = -1;          // estimated time to training.steps (-1 = unknown)
  int64_t tokens_seen = 0;    // global tokens so far
  // metrics.tensor_memory: live CPU tensor bytes of this rank (tensor_memory.h) at the step's start (after
  // zero_grad), at the end of its last forward (loss computed) and the step's peak; -1 = not tracked.
  int64_t tensor_start_bytes = -1, tensor_forward_bytes = -1, tensor_peak_bytes = -1;
  // MoE models, per MoE layer: the fewest and most tokens one expert received in the step (all ranks), and the
  // mean per expert (the same for every layer). Empty for dense models.
  std::vector<double> expert_tokens_min, expert_tokens_max;
  double expert_tokens_mean = 0;
  double moe_aux_loss = -1;  // the step's MoE sequence-wise balance loss (added to the loss); -1 = off
  // [fault_tolerance]: the replica groups that trained the step (its quorum); empty = not a fault-tolerant run.
  std::vector<int> ft_replicas;
};

// Peak resident set size of this process in bytes (VmHWM of /proc/self/status); 0 where unavailable.
int64_t peak_rss_bytes();

// "step:  10  loss:  2.3456  grad_norm:  0.812  lr: 3.0e-03  memory: 0.21GiB (max 0.22GiB)  tps: 1,234  tflops: 0.01
//  mfu: 4.2%  elapsed: 12s  eta: 5m40s"; on a device the memory part is the caching allocator's
//  "memory: 12.31GiB(8.81%) (max 12.40GiB) active 10.02GiB" (max reserved, its share of the device, max over
//  ranks, max active), and "  alloc retries: N" is added when the allocator had to free its cache to allocate.
std::string format_log_line(const StepMetrics& m);
// "validate step:  10  loss:  2.5000  perplexity: 12.18  tps: 5,000  time: 0.4s"
std::string format_validation_line(int64_t step, double loss, double perplexity, double tps, double seconds);
// "[ 12/300]  loss 2.3456  1,234 tok/s  ETA 1m20s"
std::string format_progress(const StepMetrics& m, double eta_s);
std::string format_duration(double seconds);

// Appends one JSON object per record.
class JsonlWriter {
 public:
  JsonlWriter() = default;
  // Creates parent folders. The file is not truncated: the first record written (of step s) first keeps the
  // records of steps < s that the file already holds — the history of the run a checkpoint resumed, or a replica
  // group healed into — and drops the rest: later steps, which this run writes again, and a line cut short by a
  // crash. A fresh run's first record is step 1, so its file starts empty. The file is rewritten through a temporary
  // file and a rename: a crash loses nothing; a run that logs nothing leaves it as it was.
  explicit JsonlWriter(const std::string& path);
  bool is_open() const { return out_.is_open(); }
  void write(const StepMetrics& m);
  // {"step", "validation_loss", "validation_perplexity", "validation_tokens", "validation_s"}
  void write_validation(int64_t step, double loss, double perplexity, int64_t tokens, double seconds);
  const std::string& path() const { return path_; }

 private:
  void keep_before(int64_t step);  // see the constructor
  std::string path_;
  std::ofstream out_;
  bool trimmed_ = false;
};

}  // namespace fsdp_train
