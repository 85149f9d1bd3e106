// See device_stats.h.
#include "device_stats.h"

#include <c10/core/CachingDeviceAllocator.h>

#include <algorithm>
#include <cctype>

namespace fsdp_train {
namespace {

constexpr auto kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);

}  // namespace

std::optional<DeviceMemoryStats> device_memory_stats(const c10::Device& device) {
  if (device.is_cpu()) return std::nullopt;
  const auto s = c10::getDeviceAllocator(device.type())->getDeviceStats(device.index());
  DeviceMemoryStats out;
  out.active = s.active_bytes[kAll].current;
  out.max_active = s.active_bytes[kAll].peak;
  out.reserved = s.reserved_bytes[kAll].current;
  out.max_reserved = s.reserved_bytes[kAll].peak;
  out.allocated = s.allocated_bytes[kAll].current;
  out.max_allocated = s.allocated_bytes[kAll].peak;
  out.num_alloc_retries = s.num_alloc_retries;
  out.num_ooms = s.num_ooms;
  return out;
}

void reset_device_memory_peaks(const c10::Device& device) {
  if (device.is_cpu()) return;
  c10::getDeviceAllocator(device.type())->resetPeakStats(device.index());
}

std::optional<double> bf16_peak_tflops(const std::string& device_name) {
  std::string name = device_name;
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char ch) { return std::toupper(ch); });
  auto has = [&](const char* part) { return name.find(part) != std::string::npos; };
  // The order matters where one name contains another's key (TorchTitan's order).
  if (has("A100")) return 312.0;
  if (has("H100")) {
    if (has("NVL")) return 835.0;
    if (has("PCIE")) return 756.0;
    return 989.0;  // SXM (and the HBM3 names of it)
  }
  if (has("H200")) return 989.0;
  if (has("B200")) return 2250.0;
  if (has("MI355X")) return 2500.0;
  if (has("MI300X") || has("MI325X")) return 1300.0;
  if (has("MI250X")) return 191.5;  // per GCD
  if (has("L40S")) return 362.0;
  return std::nullopt;
}

}  // namespace fsdp_train
