// Fuzz target: PyTorch DCP's .metadata pickle through the restricted pickle reader (src/checkpoint/pickle.cpp) and
// the DCP layer's checks (dcp::parse_metadata), and the same bytes as a non-tensor value item's pickle (no global
// admitted). Bad input must end in an exception and nothing may be executed; anything else (crash, sanitizer
// report, hang) is a finding. Accepted metadata must survive a write/re-parse round trip unchanged.
#include "checkpoint/dcp_format.h"
#include "checkpoint/pickle.h"

#include <cstdint>
#include <exception>
#include <string>

namespace dcp = fsdp::checkpoint::detail::dcp;
namespace pk = fsdp::checkpoint::detail::pickle;

namespace {

bool same(const dcp::Metadata& a, const dcp::Metadata& b) {
  if (a.tensors.size() != b.tensors.size() || a.values.size() != b.values.size()) return false;
  for (const auto& [k, t] : a.tensors) {
    auto it = b.tensors.find(k);
    if (it == b.tensors.end() || it->second.dtype != t.dtype || it->second.size != t.size ||
        it->second.chunks.size() != t.chunks.size())
      return false;
    for (size_t i = 0; i < t.chunks.size(); ++i) {
      const auto &x = t.chunks[i], &y = it->second.chunks[i];
      if (x.offsets != y.offsets || x.sizes != y.sizes || x.item.file != y.item.file ||
          x.item.offset != y.item.offset || x.item.length != y.item.length)
        return false;
    }
  }
  for (const auto& [k, v] : a.values) {
    auto it = b.values.find(k);
    if (it == b.values.end() || it->second.file != v.file || it->second.offset != v.offset ||
        it->second.length != v.length)
      return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  try {
    pk::Tree t = pk::parse(data, size, [](const std::string&, const std::string&) { return false; }, "fuzz/value");
    (void)pk::describe(t, t.root);
  } catch (const std::exception&) {
  }
  dcp::Metadata md;
  try {
    md = dcp::parse_metadata(bytes, "fuzz/.metadata");
  } catch (const std::exception&) {
    return 0;  // rejected with an error: the expected outcome for most inputs
  }
  // Accepted: what our DCP writer makes of it must read back the same.
  const std::string again = dcp::metadata_pickle(md, "/fuzz/ckpt");
  const dcp::Metadata md2 = dcp::parse_metadata(again, "fuzz/re-written .metadata");
  if (!same(md, md2)) __builtin_trap();
  return 0;
}
