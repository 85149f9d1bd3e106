#include "comm/profiling.h"

#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <chrono>
#include <cstring>

namespace fsdp::comm {

std::optional<at::ThreadLocalState> listening_profiler() {
  // A profiler registers its callbacks on the thread that enabled it (and on threads it was carried to); a probe
  // RecordFunction is active exactly when some callback would record a user-scope range here.
  at::RecordFunction probe(at::RecordScope::USER_SCOPE);
  if (!probe.isActive()) return std::nullopt;
  return at::ThreadLocalState();
}

int64_t profiler_clock_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void report_transfer(const TransferWatch& watch) {
  const at::ThreadLocalStateGuard state(watch.profiler);
  const TransferInfo& info = watch.info;
  torch::autograd::profiler::reportBackendEventToActiveKinetoProfiler(
      watch.issued_us, watch.completed_us.load(), /*debug_handle=*/-1, at::RecordScope::USER_SCOPE,
      c10::str("fsdp::", info.collective),
      c10::str("bytes=", info.bytes, " group=", info.group, " group_size=", info.group_size, " | ", info.what));
}

WaitRange::WaitRange(const char* collective) {
  if (range_.isActive()) range_.before(c10::str("fsdp::wait(", collective, ")"));
}

std::string lane_name(const char* collective, const std::string& group) {
  const char* code = collective;
  if (std::strcmp(collective, "all_gather_into_tensor") == 0) code = "ag";
  else if (std::strcmp(collective, "reduce_scatter_tensor") == 0) code = "rs";
  else if (std::strcmp(collective, "all_reduce") == 0) code = "ar";
  else if (std::strcmp(collective, "all_to_all") == 0) code = "a2a";
  return c10::str(code, " ", group).substr(0, 15);
}

}  // namespace fsdp::comm
