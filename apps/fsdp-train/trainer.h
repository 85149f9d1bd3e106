#pragma once
// The training loop of fsdp-train (TorchTitan's train.py in C++): build tokenizer, data, model, parallelize,
// AdamW + warmup-stable-decay, then for each step: grad-accumulation micro-batches, loss = sum of token losses /
// GLOBAL valid-token count, clip_grad_norm_, optimizer step; metrics on rank 0.

#include "config.h"
#include "moe_balance.h"

#include <fsdp/process_group.h>

#include <string>
#include <utility>
#include <vector>

namespace fsdp_train {

struct TrainEnv {
  int rank = 0;
  int world_size = 1;
  fsdp::ProcessGroupPtr group;  // world group; null = single process without any process group
  bool verbose = true;          // rank-0 console output
  int64_t stop_after_step = -1; // tests: return after this step (and its checkpoint), as if killed
  // The model family's layout check (check_model_layout: its pipeline split builds a throwaway schedule) already
  // ran for this config on world_size ranks, before the process group (check_and_init_distributed): the Trainer
  // does not run it again. False (any other caller of run_training): the Trainer runs it.
  bool layout_checked = false;
};

struct TrainSummary {
  std::vector<double> losses;       // global loss of every step (identical on every rank)
  std::vector<double> grad_norms;
  std::vector<int64_t> validation_steps;  // [validation]: the steps validated and their global losses
  std::vector<double> validation_losses;
  double final_loss = 0;            // mean of the last min(10, steps) losses
  double unigram_entropy = 0;       // of one epoch of the stream (nats); computed when compute_entropy
  int64_t epoch_tokens = 0;
  double seconds = 0;               // wall time from the first step to the end
  int64_t tokens_seen = 0;          // global training tokens up to the last step (steps before a resume included)
  std::vector<std::pair<std::string, std::string>> outputs;  // rank 0: what was written where
  std::string dump_folder;          // job.dump_folder, or under [fault_tolerance] this replica group's folder in it
  double mean_tps = 0;              // tokens/s per rank after the first step
  bool layout_checked_by_trainer = false;  // the Trainer ran the layout check (TrainEnv::layout_checked was false)
  double mean_mfu = 0;
  double peak_tflops = 0;
  std::string plan;                 // how the model was parallelised
  // What activation checkpointing did in this rank's model over the run (fsdp::checkpoint_stats).
  int64_t ac_forwards = 0, ac_recomputes = 0, ac_mm_reused = 0;
  int64_t bad_records = 0;          // JSON Lines records skipped by this rank's training stream so far
  int64_t validation_bad_records = 0;
  // On a device: where this rank trained ("cuda:0") and the highest max reserved / max active bytes of its caching
  // allocator over the logged windows (the log line's memory figures); 0 on the CPU.
  std::string device = "cpu";
  int64_t device_max_reserved_bytes = 0, device_max_active_bytes = 0;
  // metrics.tensor_memory: this rank's live CPU tensor bytes of every step (empty otherwise).
  struct TensorMemory {
    int64_t start = 0;    // after zero_grad: sharded params + optimizer states (+ anything kept across steps)
    int64_t forward = 0;  // end of the (last micro-batch's) forward: loss computed, backward not started
    int64_t peak = 0;     // highest during the step (forward, backward, clipping, optimizer step)
  };
  std::vector<TensorMemory> tensor_memory;
  // MoE models: every step's expert load (all ranks) and bias after the update (empty for dense models).
  std::vector<ExpertLoad> expert_loads;
  std::vector<double> aux_losses;  // model.moe_sequence_aux_loss_coeff > 0: the balance loss of every step
};

// TorchTitan's env handling: init_process_group when WORLD_SIZE > 1 (RANK, MASTER_ADDR, MASTER_PORT from the
// launcher), or when launched at all (WORLD_SIZE set) on a CUDA training.device — FSDP applies at world size 1 then
// as under torchrun —, else a single process without collectives. The backend: Gloo on the CPU, comm.backend on CUDA.
TrainEnv init_distributed(const JobConfig& config);
// fsdp-train's start: check_model_layout on WORLD_SIZE's ranks before any process group exists (a refused layout
// is one line, no rendezvous), then init_distributed; the env records the check (TrainEnv::layout_checked).
TrainEnv check_and_init_distributed(const JobConfig& config);

TrainSummary run_training(const JobConfig& config, const TrainEnv& env, bool compute_entropy = true);

// Peak fp32 matmul TFLOP/s of this process with its current thread count (a ~0.5 s benchmark).
double measure_peak_tflops();

}  // namespace fsdp_train
