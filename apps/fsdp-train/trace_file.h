#pragma once
// Chrome trace JSON files ({"traceEvents": [...]} or a bare array of events), read whole: what plot-trace and
// merge-traces share. No torch headers.

#include <nlohmann/json.hpp>

#include <string>

namespace fsdp_train {

struct TraceFile {
  nlohmann::json document;  // checked: an object with a "traceEvents" array, or an array
  // The event array inside `document` (computed, so a moved TraceFile stays valid).
  nlohmann::json& events() { return document.is_array() ? document : document["traceEvents"]; }
  const nlohmann::json& events() const { return document.is_array() ? document : document.at("traceEvents"); }
};

// Throws std::runtime_error naming `who` and the file, with line:column for JSON syntax errors.
TraceFile read_trace_file(const std::string& path, const std::string& who);

}  // namespace fsdp_train
