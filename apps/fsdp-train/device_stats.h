#pragma once
// The training device's memory and peak for the log line, device-generic (TorchTitan's DeviceMemoryMonitor and
// get_peak_flops): the caching allocator's statistics through c10's DeviceAllocator interface
// (c10/core/CachingDeviceAllocator.h, in libtorch 2.11 and later), so no CUDA header is needed here.

#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <string>

namespace fsdp_train {

// One device's caching-allocator figures (bytes): current and peak since the last reset_device_memory_peaks().
struct DeviceMemoryStats {
  int64_t active = 0, max_active = 0;      // blocks in use by tensors (TorchTitan's active_bytes.all)
  int64_t reserved = 0, max_reserved = 0;  // segments the allocator holds from the driver (reserved_bytes.all)
  int64_t allocated = 0, max_allocated = 0;
  int64_t num_alloc_retries = 0, num_ooms = 0;  // cudaMalloc retries after freeing the cache, out-of-memory errors
};

// The figures of `device` (which must carry its index); nullopt on the CPU, which has no caching allocator.
std::optional<DeviceMemoryStats> device_memory_stats(const c10::Device& device);
// Peaks back to the current values (TorchTitan resets them after every logged step: each log line's peak is its
// window's). Nothing on the CPU.
void reset_device_memory_peaks(const c10::Device& device);

// TorchTitan's get_peak_flops: the dense bf16 peak of a device model in TFLOP/s, by its name (A100 312, H100 SXM and
// H200 989, H100 PCIe 756, H100 NVL 835, B200 2250, L40S 362, MI300X/MI325X 1300, MI355X 2500, MI250X 191.5). Unknown names:
// nullopt (TorchTitan then assumes an A100).
std::optional<double> bf16_peak_tflops(const std::string& device_name);

}  // namespace fsdp_train
