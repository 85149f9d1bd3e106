#include "trace_merge.h"

#include "trace_file.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <filesystem>
#include <map>
#include <regex>
#include <set>
#include <stdexcept>

namespace fsdp_train {
namespace {

constexpr const char* kWho = "merge-traces";

std::vector<std::string> expand(const std::vector<std::string>& inputs) {
  std::vector<std::string> files;
  for (const auto& in : inputs) {
    if (!std::filesystem::is_directory(in)) {
      files.push_back(in);
      continue;
    }
    std::vector<std::string> found;
    // The traces and timelines of a folder, not its other JSON (profiling.h's rank<r>_comm.json summaries).
    for (const auto& e : std::filesystem::directory_iterator(in)) {
      const std::string name = e.path().filename().string();
      const bool trace = name.find("trace") != std::string::npos || name.find("timeline") != std::string::npos;
      if (e.is_regular_file() && e.path().extension() == ".json" && trace) found.push_back(e.path().string());
    }
    if (found.empty())
      throw std::runtime_error(std::string(kWho) + ": no *trace*.json or *timeline*.json files in folder '" + in + "'");
    std::sort(found.begin(), found.end());
    files.insert(files.end(), found.begin(), found.end());
  }
  if (files.empty()) throw std::runtime_error(std::string(kWho) + ": no input files");
  return files;
}

int rank_of(const nlohmann::json& doc, const std::string& path, size_t position) {
  if (doc.is_object() && doc.contains("distributedInfo")) {
    const auto& info = doc["distributedInfo"];
    if (info.is_object() && info.contains("rank") && info["rank"].is_number_integer()) return info["rank"].get<int>();
  }
  std::smatch m;
  const std::string name = std::filesystem::path(path).filename().string();
  static const std::regex rank_in_name("rank_?([0-9]+)");
  if (std::regex_search(name, m, rank_in_name)) return std::stoi(m[1].str());
  return static_cast<int>(position);
}

int64_t base_ns_of(const nlohmann::json& doc, const std::string& path) {
  if (!doc.is_object() || !doc.contains("baseTimeNanoseconds")) return 0;
  const auto& b = doc["baseTimeNanoseconds"];
  if (!b.is_number_integer())
    throw std::runtime_error(std::string(kWho) + ": " + path + ": \"baseTimeNanoseconds\" is not an integer");
  return b.get<int64_t>();
}

std::string id_text(const nlohmann::json& id) { return id.is_string() ? id.get<std::string>() : id.dump(); }

}  // namespace

MergedTrace merge_traces(const std::vector<std::string>& inputs, const std::string& out_path) {
  const std::vector<std::string> paths = expand(inputs);
  std::vector<TraceFile> files;
  std::vector<int> ranks;
  std::vector<int64_t> bases;
  for (size_t i = 0; i < paths.size(); ++i) {
    files.push_back(read_trace_file(paths[i], kWho));
    ranks.push_back(rank_of(files.back().document, paths[i], i));
    bases.push_back(base_ns_of(files.back().document, paths[i]));
  }
  const int64_t base = *std::min_element(bases.begin(), bases.end());

  // (rank, original pid) -> merged pid, numbered in rank order so Perfetto and chrome://tracing list rank 0 first.
  std::map<std::pair<int, std::string>, int64_t> pids;
  std::map<std::pair<int, std::string>, std::string> process_names;
  for (size_t f = 0; f < files.size(); ++f) {
    for (const auto& e : files[f].events()) {
      if (!e.is_object() || !e.contains("pid")) continue;
      const auto key = std::make_pair(ranks[f], id_text(e["pid"]));
      pids.emplace(key, 0);
      if (e.value("ph", "") == "M" && e.value("name", "") == "process_name" && e.contains("args") &&
          e["args"].contains("name") && e["args"]["name"].is_string())
        process_names.emplace(key, e["args"]["name"].get<std::string>());
    }
  }
  {
    int64_t next = 0;
    int last_rank = -1;
    for (auto& [key, pid] : pids) {
      if (key.first != last_rank) next = static_cast<int64_t>(key.first) * 1000, last_rank = key.first;
      pid = next++;
    }
  }

  nlohmann::json merged_events = nlohmann::json::array();
  for (const auto& [key, pid] : pids) {
    const auto name = process_names.find(key);
    std::string label = "rank " + std::to_string(key.first);
    if (name != process_names.end() && name->second.rfind("rank ", 0) != 0) label += " (" + name->second + ")";
    else if (name == process_names.end() && !key.second.empty() && key.second[0] != '"' &&
             !std::isdigit(static_cast<unsigned char>(key.second[0])))
      label += " (" + key.second + ")";  // Kineto's named rows ("Spans", "Traces")
    merged_events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", pid}, {"tid", 0}, {"args", {{"name", label}}}});
    merged_events.push_back(
        {{"ph", "M"}, {"name", "process_sort_index"}, {"pid", pid}, {"tid", 0}, {"args", {{"sort_index", pid}}}});
  }
  MergedTrace result;
  result.files = files.size();
  for (size_t f = 0; f < files.size(); ++f) {
    // Whole microseconds between the bases (they are whole seconds in Kineto's files): exact in a double.
    const double shift = static_cast<double>((bases[f] - base) / 1000);
    auto& events = files[f].events();
    for (size_t i = 0; i < events.size(); ++i) {
      nlohmann::json& e = events[i];
      if (!e.is_object())
        throw std::runtime_error(std::string(kWho) + ": " + paths[f] + ": traceEvents[" + std::to_string(i) +
                                 "] is not an object");
      if (e.value("ph", "") == "M" && (e.value("name", "") == "process_name" || e.value("name", "") == "process_sort_index"))
        continue;  // replaced by the merged process's own
      if (e.contains("pid")) e["pid"] = pids.at({ranks[f], id_text(e["pid"])});
      if (e.contains("ts")) {
        if (!e["ts"].is_number())
          throw std::runtime_error(std::string(kWho) + ": " + paths[f] + ": traceEvents[" + std::to_string(i) +
                                   "]: \"ts\" is not a number");
        e["ts"] = e["ts"].get<double>() + shift;
      }
      merged_events.push_back(std::move(e));
      ++result.events;
    }
  }
  std::set<int> distinct(ranks.begin(), ranks.end());
  result.ranks.assign(distinct.begin(), distinct.end());

  nlohmann::json out = {{"schemaVersion", 1},
                        {"displayTimeUnit", "ms"},
                        {"baseTimeNanoseconds", base},
                        {"mergedFrom", paths},
                        {"traceEvents", std::move(merged_events)}};
  write_file_whole(out_path, out.dump(), kWho);
  return result;
}

}  // namespace fsdp_train
