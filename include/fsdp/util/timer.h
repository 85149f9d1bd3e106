#pragma once
// A utility, not part of the training API: the one way the library and its tools time a phase ("saved in N s").
// Steady clock, so a wall-clock jump (NTP) never gives a negative or inflated duration.
#include <chrono>

namespace fsdp::util {

using SteadyClock = std::chrono::steady_clock;

// Seconds from `start` (a SteadyClock::now() taken earlier) until now.
inline double seconds_since(SteadyClock::time_point start) {
  return std::chrono::duration<double>(SteadyClock::now() - start).count();
}

}  // namespace fsdp::util
