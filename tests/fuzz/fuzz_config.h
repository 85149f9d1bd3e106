#pragma once
// What the two job-config harnesses (toml_config, cli_values) check on a config the parsers accepted: the
// parallelism resolution over a few world sizes must not crash, and to_toml() must write a file that parses back
// to the same config.
#include "config.h"
#include "parallel_dims.h"

#include <cstdint>
#include <exception>
#include <initializer_list>
#include <string>

namespace fsdp_fuzz {

inline void check_accepted_config(const fsdp_train::JobConfig& config, std::initializer_list<int64_t> worlds) {
  for (int64_t world : worlds) {
    try {
      (void)fsdp_train::resolve_parallelism(config, world);
    } catch (const std::exception&) {
    }
  }
  const std::string written = fsdp_train::to_toml(config);
  const auto again = fsdp_train::parse_toml(written, "fuzz config re-written");  // must not throw
  if (fsdp_train::to_toml(again) != written) __builtin_trap();
}

}  // namespace fsdp_fuzz
