#pragma once
// Live CPU tensor memory of this process, exactly: a counting allocator wrapped around libtorch's CPU allocator
// (c10::SetCPUAllocator), so every CPU tensor storage allocated after install() is counted when allocated and
// when its storage is freed. Unlike the RSS (VmHWM) this sees neither malloc's retained pages nor non-tensor
// memory (gloo buffers, oneDNN scratch, code pages): it is the quantity the planner models (docs/planner.md),
// and per step it gives the peak of activations, unsharded parameters in flight and loss tensors above the
// step's starting state. Storages allocated before install() keep their own deleters and are not counted.
#include <cstdint>
#include <vector>

namespace fsdp_train::tensor_memory {

// Installs the counting allocator (once per process; later calls do nothing). Thread-safe.
void install();
bool installed();
// Bytes of live CPU tensor storages allocated since install().
int64_t live_bytes();
// Highest live_bytes() since the last reset_peak() (or install()).
int64_t peak_bytes();
// Sets the peak to the current live bytes.
void reset_peak();

// A timeline of live_bytes() ([profiling] enable_memory_snapshot on the CPU): between start_timeline() and
// stop_timeline(), every counted allocation and free appends its wall-clock time (system_clock, as the profiler's
// traces) and the live bytes right after it. The first sample is taken at start_timeline().
struct Sample {
  int64_t unix_ns = 0;
  int64_t live_bytes = 0;
};
void start_timeline();
std::vector<Sample> stop_timeline();

}  // namespace fsdp_train::tensor_memory
