#pragma once
// PyTorch Distributed Checkpoint (DCP) format, FileSystemWriter layout as torch 2.13 and TorchTitan write it
// (facts: shared/reference/dcp-and-torchtitan-checkpoints.md sections 1-2):
//   <dir>/.metadata          pickle of torch.distributed.checkpoint.metadata.Metadata (rank 0 writes it last)
//   <dir>/__<r>_<i>.distcp   items appended without header or index: each item is a complete torch.save zip
//                            archive (a tensor chunk, or a non-tensor value pickled by torch.save)
// The metadata maps every key to its global shape, dtype and chunks, and every chunk (or value) to
// (file, offset, length). No I/O and no collectives here: this layer turns bytes into these records and back.
//
// Reading `.metadata` goes through the restricted pickle reader (pickle.h) admitting exactly the DCP metadata
// classes, torch.Size, dtypes, torch.serialization._get_layout and pathlib.PosixPath: nothing is executed.
// Tensor items are read with libtorch's own torch.save reader (torch::jit::pickle_load). Value items are read
// with the restricted reader admitting no global at all: plain data (None, bool, int, float, str, lists,
// tuples, dicts with str keys) becomes JSON text; anything else (bytes, objects) is reported, not loaded.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail::dcp {

constexpr const char* kMetadataFile = ".metadata";
constexpr const char* kVersion = "1.0.0";  // CURRENT_DCP_VERSION in torch 2.13

struct Item {
  std::string file;  // plain file name inside the checkpoint directory
  int64_t offset = 0, length = 0;
};
struct Chunk {
  std::vector<int64_t> offsets, sizes;  // global coordinates
  Item item;
};
struct TensorEntry {
  c10::ScalarType dtype = c10::kFloat;
  std::vector<int64_t> size;  // global shape
  std::vector<Chunk> chunks;
};
struct Metadata {
  std::map<std::string, TensorEntry> tensors;
  std::map<std::string, Item> values;  // BytesStorageMetadata entries (non-tensor items)
  std::string version;
};

// Decodes and checks a `.metadata` pickle: every key with its entry, every chunk and value with its storage
// record, file names plain. Anything outside the DCP subset is an error naming it (and the byte offset).
Metadata parse_metadata(const std::string& bytes, const std::string& where);
// The `.metadata` pickle PyTorch's FileSystemReader reads. `checkpoint_id` is recorded as the PosixPath
// FileSystemWriter would record. planner_data maps each flat key to the path dcp.load's flattening produces
// for a TorchTitan-style state dict (optimizer, train_state, lr_scheduler, dataloader as nested dicts).
std::string metadata_pickle(const Metadata& md, const std::string& checkpoint_id);

// One tensor item (a torch.save archive) -> a CPU tensor, through libtorch's reader.
at::Tensor read_tensor_item(const void* data, size_t n, const std::string& where);
// A tensor as a torch.save archive that torch.load(weights_only=True) reads (libtorch's writer).
std::string tensor_item(const at::Tensor& t);

// One value item -> JSON text. Throws ValueNotPlainData (with the reason) when it holds anything else.
struct ValueNotPlainData : std::runtime_error {
  using std::runtime_error::runtime_error;
};
std::string read_value_item(const void* data, size_t n, const std::string& where);
// JSON text -> a torch.save archive of the equivalent Python value (object -> dict, array -> list).
std::string value_item(const std::string& json_text);

// "torch.float32" names.
std::string torch_dtype_name(c10::ScalarType t);

}  // namespace fsdp::checkpoint::detail::dcp
