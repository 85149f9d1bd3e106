// Fuzz target: a distributed checkpoint's metadata.json (detail::parse_metadata: JSON, then every structural check
// a reader relies on). Bad input must end in an exception; anything else (crash, sanitizer report, hang) is a
// finding. Accepted metadata must survive a write/re-parse round trip unchanged.
#include "checkpoint/format.h"

#include <cstdint>
#include <exception>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  fsdp::checkpoint::detail::Metadata md;
  try {
    md = fsdp::checkpoint::detail::parse_metadata(text, "fuzz/metadata.json");
  } catch (const std::exception&) {
    return 0;  // rejected with an error: the expected outcome for most inputs
  }
  // Accepted: what a save would write must parse back to the same thing.
  const std::string again = fsdp::checkpoint::detail::to_json_text(md);
  const auto md2 = fsdp::checkpoint::detail::parse_metadata(again, "fuzz/re-written metadata.json");
  if (fsdp::checkpoint::detail::to_json_text(md2) != again) __builtin_trap();
  return 0;
}
