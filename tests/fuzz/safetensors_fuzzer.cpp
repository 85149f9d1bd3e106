// Fuzz target: safetensors files (u64 header length, JSON header, offsets, lazy positioned reads of whole tensors
// and dim-0 row ranges) and model.safetensors.index.json. The first input byte picks which; the rest is the file.
#include <fsdp/checkpoint/safetensors.h>

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <exception>

#include "fuzz_input.h"

namespace st = fsdp::checkpoint::safetensors;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool index = data[0] & 1;
  try {
    if (index) {
      const auto path = fsdp_fuzz::write_scratch("model.safetensors.index.json", data + 1, size - 1);
      (void)st::read_index(path);
      return 0;
    }
    const auto path = fsdp_fuzz::write_scratch("model.safetensors", data + 1, size - 1);
    st::Reader reader(path);
    for (const auto& name : reader.names()) {
      const auto& info = reader.info(name);
      at::Tensor t = reader.read(name);
      if (t.numel() != info.numel()) __builtin_trap();
      if (!info.shape.empty() && info.shape[0] > 0) {
        const int64_t rows = info.shape[0];
        (void)reader.read_rows(name, rows / 2, std::min<int64_t>(rows - rows / 2, 2));
      }
    }
    (void)reader.metadata();
  } catch (const std::exception&) {
  }
  return 0;
}
