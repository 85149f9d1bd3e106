#pragma once
// The few things fsdp-train takes from libtorch's CUDA library (libtorch_cuda), behind a header without CUDA
// includes: cuda_support_cuda.cpp implements them when the libtorch being built against has CUDA
// (FSDP_TRAIN_WITH_CUDA, set in CMakeLists.txt from the Torch package), cuda_support_none.cpp otherwise. The
// caching allocator's statistics need no CUDA header at all: device_stats.h reads them through c10's
// device-generic DeviceAllocator.

#include <cstddef>
#include <cstdint>
#include <string>

namespace fsdp_train::cuda_support {

// Whether this build links libtorch's CUDA library (false: every function below is refused or empty).
bool compiled();
// The device's name as the driver reports it ("NVIDIA H100 80GB HBM3"); "" without CUDA.
std::string device_name(int index);
// The device's whole memory in bytes (TorchTitan's get_device_properties().total_memory); 0 without CUDA.
int64_t device_total_bytes(int index);
// torch.cuda.memory._record_memory_history(max_entries=...): the caching allocator keeps its last `max_entries`
// actions (alloc, free, segment map/unmap, ...) for memory_snapshot_pickle(); enable = false stops recording.
void record_memory_history(bool enable, size_t max_entries);
// torch.cuda.memory._snapshot() pickled, as torch.cuda.memory._dump_snapshot writes it: a dict with
// "segments", "device_traces", "allocator_settings", ... that https://pytorch.org/memory_viz loads.
std::string memory_snapshot_pickle();

}  // namespace fsdp_train::cuda_support
