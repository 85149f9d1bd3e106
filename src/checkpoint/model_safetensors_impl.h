#pragma once
// The streaming export and own-rows import of model_safetensors.cpp, parameterised by how model keys and rows
// map to file tensors. The public export_safetensors/import_safetensors use the identity; the Hugging Face
// Llama adapter (hf_llama.cpp) renames keys and permutes the Q/K rows.

#include <fsdp/checkpoint/model_safetensors.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail {

// A model tensor that is one slice of a file tensor along `dim`, starting at `offset` (Hugging Face's stacked
// MoE gate_up_proj [E, 2F, D] holds our experts.w1 at offset 0 and experts.w3 at offset F of dim 1).
struct FileSlice {
  std::string file_name;
  int64_t dim = 0;
  int64_t offset = 0;
};

struct KeyAdapter {
  // Model key -> tensor name in the files (nullopt: not exported; on import: must not be required).
  std::function<std::optional<std::string>(const std::string& key)> file_name;
  // Model key -> the file tensor it is a slice of (asked before file_name; nullopt: file_name decides). Export
  // gathers the keys of one file tensor one after the other and writes their concatenation, which must cover the
  // file tensor from 0 without gaps; import reads each rank's piece of each slice (its own rows only).
  std::function<std::optional<FileSlice>(const std::string& key)> file_slice;
  // Import: a model key stored as one file tensor per index of its dim 0, `rows` of them (Hugging Face's
  // per-expert layout: experts.w1 [E, F, D] is mlp.experts.<j>.gate_proj.weight [F, D], j < E): each index's
  // tensor name (asked first; empty: not stored so). Each rank reads the tensors of its own indices only.
  std::function<std::vector<std::string>(const std::string& key, int64_t rows)> file_stack;
  // Export: the full model tensor -> what the file holds (e.g. a row permutation). Null: unchanged.
  std::function<at::Tensor(const std::string& key, const at::Tensor& full)> to_file;
  // Import: for model rows [begin, begin + count) of `key`, the file row holding each (in model order). Null
  // or empty result: the same rows.
  std::function<std::vector<int64_t>(const std::string& key, int64_t begin, int64_t count)> file_rows;
  // Import: file tensors that are expected extras (not reported as unexpected), e.g. a tied lm_head.
  std::function<bool(const std::string& file_name)> ignorable;
  // Export: tensors that are no model key (name -> a CPU tensor), written by the writer after the model's; for
  // small ones (DeepSeek-V3's zero e_score_correction_bias of a model without load balancing).
  std::vector<std::pair<std::string, at::Tensor>> extra_tensors;
  // Export: extra files written with the tensors (name -> content), e.g. config.json.
  std::vector<std::pair<std::string, std::string>> extra_files;
};

// Tensor name -> file path, for a .safetensors file, a model.safetensors.index.json, or a directory holding
// either (the index wins).
std::map<std::string, std::string> resolve_files(const std::string& path);

// A file tensor of an integer or bool dtype is never a floating-point model tensor's value (copy_ would convert
// it silently): an error naming `who`, the file tensor, its file, the model key and both dtypes.
void check_loadable_dtype(const std::string& who, const std::string& file_tensor, const std::string& file,
                          c10::ScalarType file_dtype, const std::string& key, c10::ScalarType model_dtype);

SafetensorsExportResult export_safetensors(torch::nn::Module& root, const std::string& dir,
                                           const SafetensorsExportOptions& options, const KeyAdapter& adapter);
SafetensorsImportResult import_safetensors(torch::nn::Module& root, const std::string& path,
                                           const SafetensorsImportOptions& options, const KeyAdapter& adapter);

}  // namespace fsdp::checkpoint::detail
