#pragma once
// Small helpers of the benchmark programs: resident-set sizes from /proc and number formatting for JSON lines.
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>

namespace bench {

// A "VmRSS" / "VmHWM" line of /proc/self/status, in KiB.
inline int64_t rss_kib(const std::string& field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
  }
  TORCH_CHECK(false, "bench: no ", field, " in /proc/self/status");
}

// Resets VmHWM to the current RSS (Linux >= 4.0: "5" to clear_refs), so the peak measured afterwards belongs
// to the phase that follows (training), not to the set-up (loading the full model before sharding it).
inline bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return static_cast<bool>(f);
}

inline std::string fmt(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.12g", v);
  return buf;
}

}  // namespace bench
