#pragma once
// Writing PyTorch DCP checkpoints (save with Format::PytorchDcp) and converting between the two formats
// (convert): see include/fsdp/checkpoint/checkpoint.h and docs/interop.md.

#include <fsdp/checkpoint/checkpoint.h>

namespace fsdp::checkpoint::detail {

// Collective like save(): each rank appends its pieces (each one torch.save archive) to __<rank>_0.distcp,
// rank 0 also the values after gathering them from every rank, then writes .metadata and commits the
// directory with one rename (the same crash safety as libfsdp's format).
SaveResult save_dcp(const StateDict& state, const std::string& path, const SaveOptions& options);

}  // namespace fsdp::checkpoint::detail
