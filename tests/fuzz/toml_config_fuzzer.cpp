// Fuzz target: fsdp-train's TOML job config (toml++ parse, schema types, unknown keys, value checks) and the
// parallelism resolution over a few world sizes. An accepted config must round-trip through to_toml().
#include "config.h"
#include "fuzz_config.h"

#include <cstdint>
#include <exception>
#include <string>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  fsdp_train::JobConfig config;
  try {
    config = fsdp_train::parse_toml(text, "fuzz.toml");
  } catch (const std::exception&) {
    return 0;
  }
  try {
    fsdp_train::validate(config);
  } catch (const std::exception&) {
  }
  fsdp_fuzz::check_accepted_config(config, {1, 2, 3, 8});
  return 0;
}
