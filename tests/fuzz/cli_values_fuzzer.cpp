// Fuzz target: fsdp-train's command-line values (--section.key value and --section.key=value over the embedded
// default config: every key's text-to-value conversion, choice names, bare boolean flags, unknown keys and
// sections), then validate() and the parallelism resolution. The input is the argument list, one argument per
// line. An accepted config must round-trip through to_toml() like a TOML one.
#include "config.h"
#include "fuzz_config.h"

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args(1);
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == '\n') args.emplace_back();
    else args.back() += static_cast<char>(data[i]);
  }
  if (args.size() > 64) return 0;  // the parser is linear in the argument count; long lists add nothing
  static const fsdp_train::JobConfig defaults =
      fsdp_train::parse_toml(fsdp_train::embedded_default_config(), "<embedded configs/debug.toml>");
  fsdp_train::JobConfig config = defaults;
  try {
    fsdp_train::apply_overrides(config, args);
    fsdp_train::validate(config);
  } catch (const std::exception&) {
    return 0;
  }
  fsdp_fuzz::check_accepted_config(config, {1, 2, 4});
  return 0;
}
