#pragma once
// The coordinator's side of a collective save, shared by both formats: every rank sends a JSON report (its
// error or "", the tensors it declares, its chunks); the coordinator parses them all and merges the tensor
// declarations, which must agree across ranks. Private to src/checkpoint.

#include <fsdp/checkpoint/safetensors.h>

#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail {

// Every rank's report, parsed; raises the first rank's error (lowest rank first).
inline std::vector<nlohmann::json> parse_rank_reports(const std::vector<std::string>& all) {
  std::vector<nlohmann::json> reports;
  reports.reserve(all.size());
  for (const auto& s : all) reports.push_back(nlohmann::json::parse(s));
  for (const auto& r : reports) TORCH_CHECK(r["error"].get<std::string>().empty(), r["error"].get<std::string>());
  return reports;
}

// Adds the tensor a report declares ({"fqn", "dtype", "shape"}) to `tensors`, or checks it against the entry an
// earlier rank declared (same dtype and global shape). `Map` maps fqn -> an entry with a `dtype` and a shape
// member (`shape_of`: TensorMeta::shape, dcp::TensorEntry::size). Returns the entry.
template <class Map, class Entry = typename Map::mapped_type>
Entry& declare_tensor(Map& tensors, const nlohmann::json& d, std::vector<int64_t> Entry::*shape_of) {
  const std::string fqn = d["fqn"].get<std::string>();
  const auto dtype = safetensors::dtype_from_name(d["dtype"].get<std::string>());
  const auto shape = d["shape"].get<std::vector<int64_t>>();
  auto [it, fresh] = tensors.try_emplace(fqn);
  Entry& e = it->second;
  if (fresh) {
    e.dtype = dtype;
    e.*shape_of = shape;
  }
  TORCH_CHECK(e.dtype == dtype && e.*shape_of == shape, "checkpoint: ranks disagree on tensor '", fqn, "': ",
              safetensors::dtype_name(e.dtype), c10::IntArrayRef(e.*shape_of), " vs ", d["dtype"].get<std::string>(),
              c10::IntArrayRef(shape));
  return e;
}

}  // namespace fsdp::checkpoint::detail
