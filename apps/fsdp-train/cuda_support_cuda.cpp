// cuda_support.h on a CUDA build of libtorch (compiled only when FSDP_TRAIN_WITH_CUDA).
#include "cuda_support.h"

#include <ATen/cuda/CUDAContext.h>
#include <torch/csrc/cuda/memory_snapshot.h>

#include <optional>

namespace fsdp_train::cuda_support {

bool compiled() { return true; }

std::string device_name(int index) {
  return at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(index))->name;
}

int64_t device_total_bytes(int index) {
  return static_cast<int64_t>(at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(index))->totalGlobalMem);
}

void record_memory_history(bool enable, size_t max_entries) {
  // Every action with its context (enabled = "all", context = "all"), as TorchTitan's
  // _record_memory_history(max_entries=...). Stacks "python": a C++ process has no Python frames, so the
  // entries carry none — C++ unwinding ("all") of every action would cost more than the step it records.
  if (enable)
    torch::cuda::_record_memory_history(std::optional<std::string>("all"), std::optional<std::string>("all"), "python",
                                        max_entries);
  else
    torch::cuda::_record_memory_history(std::nullopt, std::nullopt, "python", max_entries);
}

std::string memory_snapshot_pickle() { return torch::cuda::_memory_snapshot_pickled(); }

}  // namespace fsdp_train::cuda_support
