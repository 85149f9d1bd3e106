#pragma once
// Chrome trace JSON files ({"traceEvents": [...]} or a bare array of events), read and written whole: what
// plot-trace, merge-traces and [profiling] (profiling.h) share. No torch headers.

#include <nlohmann/json.hpp>

#include <string>

namespace fsdp_train {

struct TraceFile {
  nlohmann::json document;  // checked: an object with a "traceEvents" array, or an array
  // The event array inside `document` (computed, so a moved TraceFile stays valid).
  nlohmann::json& events() { return document.is_array() ? document : document["traceEvents"]; }
  const nlohmann::json& events() const { return document.is_array() ? document : document.at("traceEvents"); }
};

// nlohmann::json's parse error message without its "[json.exception...] parse error at line L, column C: "
// prefix (positions within the text it was given, which the callers replace with the file's line and column).
std::string json_error_reason(const std::string& what);

// Throws std::runtime_error naming `who` and the file, with line:column for JSON syntax errors.
TraceFile read_trace_file(const std::string& path, const std::string& who);

// Writes `text` to `path` through a temporary of this process's own (`path`.tmp<pid>) and a rename, so a reader
// never sees half a file; throws std::runtime_error naming `who` and the file, leaving no temporary behind.
void write_file_whole(const std::string& path, const std::string& text, const std::string& who);

}  // namespace fsdp_train
