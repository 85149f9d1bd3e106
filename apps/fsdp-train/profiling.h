#pragma once
// TorchTitan's [profiling] (torchtitan/tools/profiling.py) for fsdp-train: every profile_freq steps, the step is
// recorded on every rank
//   - enable_profiling: by libtorch's own profiler (Kineto, CPU activities, shapes; on a CUDA device also the
//     device's kernels and copies), saved as a Chrome/Perfetto
//     trace <dump>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json. libfsdp names its work in it:
//     FSDP::pre_forward / all_gather_copy_in / all_gather / all_gather_copy_out / post_backward /
//     reduce_scatter_copy_in / reduce_scatter / post_reduce on the training thread, "fsdp::wait(<collective>)"
//     where the training thread waited, each collective's transfer as "fsdp::<collective>" (bytes, group, ...) on
//     a thread of its own per kind, and the pipeline's actions as "PP:<action>". Beside it rank<r>_comm.json: the
//     same step's collectives as fsdp::record_timeline saw them, and the overlap figure from them.
//   - enable_memory_snapshot: on the CPU, the live tensor bytes (tensor_memory.h) at every allocation and free of
//     the step, as a Chrome trace counter track <save_memory_snapshot_folder>/iteration_<step>/
//     rank<r>_memory_timeline.json (on the same clock as the trace: `fsdp-train merge-traces` overlays them).
//     On a CUDA device instead TorchTitan's pickle: the caching allocator records its history (the last 100,000
//     actions) from the trainer's start, and each profiled step ends with <save_memory_snapshot_folder>/
//     iteration_<step>/rank<r>_memory_snapshot.pickle (torch.cuda.memory._snapshot()'s dict, which PyTorch's
//     memory visualizer loads); an out-of-memory error writes iteration_<step>_exit/ before the run stops.

#include "config.h"

#include <fsdp/process_group.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fsdp_train {

class StepProfiler {
 public:
  // `groups`: the process groups whose collectives rank<r>_comm.json times (duplicates and nulls are ignored).
  // `device`: the training device (CUDA: device activities in the trace, the caching allocator's snapshot).
  StepProfiler(const JobConfig& config, int rank, std::vector<fsdp::ProcessGroupPtr> groups, const c10::Device& device);
  ~StepProfiler();  // a recording still open (the step threw) is stopped and dropped
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  // Whether `step` is recorded (profiling or memory timeline on, and step % profile_freq == 0).
  bool records(int64_t step) const;
  // Around one training step (from before its data to after its optimizer step).
  void begin_step(int64_t step);
  void end_step(int64_t step);

  // After an out-of-memory error in `step` (CUDA with enable_memory_snapshot; nothing otherwise): the snapshot into
  // iteration_<step>_exit/, as TorchTitan does on its way out. Never throws: the error is what the run reports.
  void dump_memory_snapshot_on_oom(int64_t step);

  // What was written where (for the end-of-run summary): the folders, once something was written.
  std::vector<std::pair<std::string, std::string>> outputs() const;
  // The last recorded step's hidden share of communication by record_timeline (1 - exposed / in flight), or -1.
  double last_hidden_fraction() const { return last_hidden_fraction_; }

 private:
  struct Recording;
  std::string write_cuda_snapshot(const std::string& iteration_folder);  // returns the file written
  const JobConfig::Profiling options_;
  const std::string dump_folder_;
  const int rank_;
  const bool cuda_;
  std::vector<fsdp::ProcessGroupPtr> groups_;
  std::unique_ptr<Recording> recording_;
  bool wrote_traces_ = false, wrote_memory_ = false;
  double last_hidden_fraction_ = -1;
};

}  // namespace fsdp_train
