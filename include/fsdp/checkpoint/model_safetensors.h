#pragma once
// A sharded model to and from safetensors files (the Hugging Face layout), without any rank holding the model:
//
//   fsdp::checkpoint::export_safetensors(*model, "out/");    // collective; rank 0 writes, one tensor at a time
//   fsdp::checkpoint::import_safetensors(*model, "out/");    // every rank reads only the rows of its own shards
//
// Keys are the model's FQNs (parameters and buffers, as fsdp::sharded_state_dict names them). Above
// max_file_bytes the tensors are split over model-0000i-of-0000N.safetensors files with a
// model.safetensors.index.json, as Hugging Face's save_pretrained does. See docs/checkpoint.md.

#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::checkpoint {

struct SafetensorsExportOptions {
  int64_t max_file_bytes = 5'000'000'000;       // Hugging Face's default shard size ("5GB")
  std::optional<c10::ScalarType> dtype;         // floating-point tensors are cast to it (e.g. bf16 for release)
  std::map<std::string, std::string> metadata;  // written into every file's __metadata__ (plus "format": "pt")
  // Pipeline parallelism: the stages this rank trains (modules holding the whole model's FQNs, each given to
  // fully_shard). Their tensors are exported in place of the root's, which (the whole model, the other ranks'
  // stages on `meta`) only names every key and its shape; each key is gathered by its stage's ranks and sent to
  // rank 0 by the lowest of them. Empty: the root holds everything.
  std::vector<torch::nn::Module*> parts;
};
struct SafetensorsExportResult {
  std::vector<std::string> files;  // written, in order (the index json last when there is one)
  int64_t total_bytes = 0;         // tensor data
  double seconds = 0;
};
// Collective over the world (every rank of the model's meshes): each tensor is gathered in turn and written by
// rank 0 before the next is gathered, so rank 0 holds one full tensor at a time and other ranks none. Files
// appear complete or not at all (written under a temporary name, fsynced, renamed); a failure on rank 0
// raises on every rank. Older model*.safetensors files of another split in `dir` are removed after success.
SafetensorsExportResult export_safetensors(torch::nn::Module& root, const std::string& dir,
                                           const SafetensorsExportOptions& options = {});

struct SafetensorsImportOptions {
  // strict: every model key must be in the files and every file tensor must be a model key (each list is in
  // the error). Non-strict: model keys absent from the files keep their values; both lists are in the result.
  bool strict = true;
  // Pipeline parallelism: the stages this rank trains (as SafetensorsExportOptions::parts); only their tensors
  // are read (own rows) and loaded. Empty: the root holds everything.
  std::vector<torch::nn::Module*> parts;
};
struct SafetensorsImportResult {
  std::vector<std::string> missing;     // model keys not in the files (non-strict)
  std::vector<std::string> unexpected;  // file tensors that are not model keys
  int64_t bytes_read = 0;               // by this rank: only the rows of its own pieces
  double seconds = 0;
};
// `path`: a .safetensors file, a model.safetensors.index.json, or a directory holding either (the index wins).
// Global shapes must match the model's; dtypes may differ (values are cast). Collective over the world when it
// is initialized (ranks agree on success: any rank's error raises on every rank); otherwise local.
SafetensorsImportResult import_safetensors(torch::nn::Module& root, const std::string& path,
                                           const SafetensorsImportOptions& options = {});

}  // namespace fsdp::checkpoint
