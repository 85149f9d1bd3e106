#pragma once
// What the Hugging Face adapters (hf_llama.cpp, hf_qwen3.cpp) share: the decoder's common tensor names, layer
// key parsing, config.json checks, and the one-process (no fully_shard) export and import.

#include "checkpoint/model_safetensors_impl.h"

#include <fsdp/checkpoint/model_safetensors.h>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::nn::llama {
struct LlamaArgs;
}  // namespace fsdp::nn::llama

namespace fsdp::checkpoint::safetensors {
class Reader;
}

namespace fsdp::checkpoint::hf::common {

struct NamePair {
  const char* ours;
  const char* hf;
};
// Names every Llama-style decoder shares: top level (embeddings, final norm, output) and per layer (attention
// projections, dense FFN, the two norms), ours <-> Hugging Face's (inside model.layers.<i>.).
const std::vector<NamePair>& top_names();
const std::vector<NamePair>& layer_names();
// `key` renamed through `top` and `layers` (layer names under "layers.<i>." <-> "model.layers.<i>."); nullopt
// when no pair matches.
std::optional<std::string> to_hf(const std::string& key, const std::vector<NamePair>& top,
                                 const std::vector<NamePair>& layers);
std::optional<std::string> from_hf(const std::string& hf_name, const std::vector<NamePair>& top,
                                   const std::vector<NamePair>& layers);

// "<prefix><digits>.<rest>" -> (digits, rest).
std::optional<std::pair<std::string, std::string>> split_layer(const std::string& key, const std::string& prefix);

bool uses_fully_shard(torch::nn::Module& model);
// config.json's torch_dtype for an export cast to `dtype` (float32 when none).
std::string dtype_name(const std::optional<c10::ScalarType>& dtype);
// Hugging Face's RoPE base: rope_parameters.rope_theta (transformers >= 5) or rope_theta.
std::optional<double> rope_theta(const nlohmann::json& config);

// The config.json fields every decoder of ours writes the same way (sizes, heads, norm eps, RoPE base, tied
// embeddings, dtype); each adapter adds its architecture's own.
nlohmann::json decoder_config_json(const nn::llama::LlamaArgs& args, const std::string& dtype);

// A Hugging Face config.json checked against a model: collects every mismatch, then one error listing them all.
class ConfigCheck {
 public:
  ConfigCheck(std::string path, std::string who);  // parses (error naming the file when it is not JSON)
  const nlohmann::json& config() const { return config_; }
  // An integer field, when present, must equal ours.
  void expect_int(const char* field, int64_t ours);
  void expect_rope_theta(double ours);
  // The sizes every decoder's config.json states the same way (decoder_config_json's): hidden size, layers,
  // heads, kv heads, vocabulary, head_dim.
  void expect_decoder_sizes(const nn::llama::LlamaArgs& args);
  void fail(std::string what) { bad_.push_back(std::move(what)); }
  // Throws "<who>: <path> does not describe this model: <mismatches>" when there are any.
  void finish() const;

 private:
  std::string path_, who_;
  nlohmann::json config_;
  std::vector<std::string> bad_;
};

// One process holding the whole model: writes `tensors` (Hugging Face names, already in the file layout; cast
// to options.dtype) into dir/model.safetensors, and config_text as dir/config.json.
SafetensorsExportResult write_whole_model(const std::string& dir,
                                          std::vector<std::pair<std::string, at::Tensor>> tensors,
                                          const SafetensorsExportOptions& options, const std::string& config_text);

// The tensors of a file set (resolve_files: a directory, an index or one file), read whole, readers opened once.
class FileTensors {
 public:
  explicit FileTensors(const std::string& path);
  ~FileTensors();
  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& where() const { return where_; }
  bool has(const std::string& name) const { return where_.count(name) > 0; }
  at::Tensor read(const std::string& name);  // CPU, the file's dtype; error naming the tensor when absent

 private:
  std::string path_;
  std::map<std::string, std::string> where_;
  std::map<std::string, std::unique_ptr<safetensors::Reader>> readers_;
};

// Copies `t` (file tensor `file_name`) into the model's `key`, with a shape check naming both.
void copy_checked(const char* who, const std::string& file_name, const std::string& key, at::Tensor& param,
                  const at::Tensor& t);

using KeyToFile = std::function<std::optional<std::string>(const std::string& key)>;
using TensorMap = std::function<at::Tensor(const std::string& key, const at::Tensor& t)>;

// Export of a whole model: every parameter for which `skip` (may be null) is false, renamed by `to_hf` (error
// naming a key it does not know) and mapped by `to_file` (may be null), in parameter order.
std::vector<std::pair<std::string, at::Tensor>> whole_model_tensors(const char* who, torch::nn::Module& model,
                                                                    const KeyToFile& to_hf, const TensorMap& to_file,
                                                                    const std::function<bool(const std::string&)>& skip);

// The import adapter of both models: file names by `to_hf` (error naming a key it does not know); our
// output.weight from model.embed_tokens.weight when the files have no lm_head.weight (a tied checkpoint);
// rotary inv_freq buffers, and lm_head.weight next to a tied model, are expected extras.
checkpoint::detail::KeyAdapter import_adapter(const char* who, const KeyToFile& to_hf, bool files_have_lm_head,
                                              bool model_tied);

// Import into a whole model (no fully_shard): every parameter for which `skip` (may be null) is false, read
// whole from adapter.file_name(key), mapped by `from_file` (may be null). Missing tensors: an error naming the
// tensor and the key (strict) or result.missing. File tensors read are added to `used`.
SafetensorsImportResult import_whole_model(const char* who, torch::nn::Module& model, FileTensors& files,
                                           const checkpoint::detail::KeyAdapter& adapter,
                                           const SafetensorsImportOptions& options, const TensorMap& from_file,
                                           const std::function<bool(const std::string&)>& skip,
                                           std::set<std::string>& used);

}  // namespace fsdp::checkpoint::hf::common
