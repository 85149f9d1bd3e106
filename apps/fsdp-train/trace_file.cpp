#include "trace_file.h"

#include <unistd.h>


#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace fsdp_train {

std::string json_error_reason(const std::string& what) {
  const size_t column = what.find("column ");
  const size_t colon = column == std::string::npos ? std::string::npos : what.find(": ", column);
  return colon == std::string::npos ? what : what.substr(colon + 2);
}

TraceFile read_trace_file(const std::string& path, const std::string& who) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(who + ": cannot open '" + path + "'");
  std::stringstream buf;
  buf << in.rdbuf();
  const std::string text = buf.str();
  TraceFile file;
  try {
    file.document = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    // e.byte: 1-based offset of the offending character; a trace is often one long line, so the column too.
    const size_t at = std::min<size_t>(e.byte > 0 ? e.byte - 1 : 0, text.size());
    const size_t line = 1 + static_cast<size_t>(std::count(text.begin(), text.begin() + static_cast<long>(at), '\n'));
    const size_t line_start = text.rfind('\n', at == 0 ? 0 : at - 1);
    const size_t column = at - (line_start == std::string::npos ? 0 : line_start + 1) + 1;
    throw std::runtime_error(who + ": " + path + ":" + std::to_string(line) + ":" + std::to_string(column) +
                             ": not JSON: " + json_error_reason(e.what()));
  }
  const nlohmann::json& j = file.document;
  const bool ok = j.is_array() || (j.is_object() && j.contains("traceEvents") && j["traceEvents"].is_array());
  if (!ok)
    throw std::runtime_error(who + ": " + path + ": expected a Chrome trace, {\"traceEvents\": [...]} or an array of events");
  return file;
}

void write_file_whole(const std::string& path, const std::string& text, const std::string& who) {
  // A temporary of this process's own (ranks tracing into one folder never take each other's). fsdp_train_core has
  // no libfsdp: fsdp::util::AtomicFile is the library's writer.
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  std::error_code ec;
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.close();
    if (!out) {
      std::filesystem::remove(tmp, ec);
      throw std::runtime_error(who + ": cannot write '" + tmp + "'");
    }
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    const std::string reason = ec.message();
    std::filesystem::remove(tmp, ec);  // no temporary left behind
    throw std::runtime_error(who + ": cannot rename '" + tmp + "' to '" + path + "': " + reason);
  }
}

}  // namespace fsdp_train
