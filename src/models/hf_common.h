#pragma once
// What the Hugging Face adapters (hf_llama.cpp, hf_qwen3.cpp, hf_deepseek_v3.cpp) share: the decoder's common
// tensor names, layer key parsing, config.json checks, the one-process (no fully_shard) export and import, and the
// sharded ones (one tensor gathered at a time; each rank reading its own rows; the MoE experts as slices).

#include "checkpoint/model_safetensors_impl.h"

#include <fsdp/checkpoint/model_safetensors.h>

#include <fsdp/models/llama.h>
#include <fsdp/models/moe.h>

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

namespace fsdp::checkpoint::safetensors {
class Reader;
}

namespace fsdp::models::hf::common {

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
// The config.json fields every decoder of ours writes the same way (sizes, heads, norm eps, RoPE base and
// scaling in both forms, tied embeddings, dtype); each adapter adds its architecture's own.
nlohmann::json decoder_config_json(const models::llama::LlamaArgs& args, const std::string& dtype);

// Deepest nesting of arrays/objects a config.json may have (Hugging Face's are at most 3 deep); deeper is
// refused while parsing, before anything is built from it.
constexpr int kMaxConfigDepth = 32;
// Largest config.json read (Hugging Face's are a few kB).
constexpr int64_t kMaxConfigBytes = 1 << 20;

// A parsed config.json whose errors name the file, the field and the rule: "<who>: <path>: field 'x' ...".
class ConfigJson {
 public:
  ConfigJson(std::string path, std::string who);  // reads and parses (bounded size and depth)
  const std::string& path() const { return path_; }
  const std::string& who() const { return who_; }
  const nlohmann::json& root() const { return root_; }
  // Present and not null (in `obj`, a sub-object of root(); `where` prefixes its field names, e.g. "rope_scaling.").
  static bool has(const nlohmann::json& obj, const char* field);
  bool has(const char* field) const { return has(root_, field); }
  // Typed reads: the field's value, `fallback` when absent or null, an error when absent without fallback or of
  // another type ("field 'x' must be an integer, got a string \"abc\"").
  int64_t get_int(const char* field, std::optional<int64_t> fallback = std::nullopt,
                  const nlohmann::json* obj = nullptr, const std::string& where = "") const;
  double get_number(const char* field, std::optional<double> fallback = std::nullopt,
                    const nlohmann::json* obj = nullptr, const std::string& where = "") const;
  bool get_bool(const char* field, std::optional<bool> fallback = std::nullopt, const nlohmann::json* obj = nullptr,
                const std::string& where = "") const;
  std::string get_string(const char* field, std::optional<std::string> fallback = std::nullopt,
                         const nlohmann::json* obj = nullptr, const std::string& where = "") const;
  // Throws "<who>: <path>: <what>".
  [[noreturn]] void fail(const std::string& what) const;

 private:
  const nlohmann::json& value(const char* field, const nlohmann::json* obj, const std::string& where,
                              const char* kind) const;
  std::string path_, who_;
  nlohmann::json root_;
};

// A short, bounded rendering of an untrusted JSON value for messages (never the whole of a large value).
std::string excerpt(const nlohmann::json& v);

// What a config.json describes, as our args: every field that changes transformers' computation is honoured
// (mapped to the args) or refused with its name and value (docs/interop.md has the table).
struct ParsedConfig {
  std::string model_type;  // "llama", "qwen3" or "qwen3_moe"
  models::llama::LlamaArgs args;
};
// RoPE fields as transformers 5 reads them (rope_parameters or rope_scaling; theta, "default" / "linear" / "llama3"
// / "yarn" with their parameters; partial_rotary_factor refused): args.rope_theta and args.rope_scaling; reads
// args.max_seq_len as max_position_embeddings' fallback.
void parse_rope_config(const ConfigJson& config, models::llama::LlamaArgs& args);
// `default_model_type`: assumed when config.json has no model_type (empty: model_type is required).
ParsedConfig parse_config(const ConfigJson& config, const std::string& default_model_type = "");

// The differences that matter between what config.json describes and a model: one error listing all
// "<field> = <value> (the model has <ours>)". `untied_model_may_load_tied`: a tied checkpoint may fill an untied
// model's output layer with the embeddings (Llama) instead of being an error (Qwen3).
void check_config_matches(const ConfigJson& config, const ParsedConfig& parsed, const models::llama::LlamaArgs& model,
                          bool untied_model_may_load_tied);

// A file set without lm_head.weight next to a config.json that says tie_word_embeddings = false contradicts
// itself: an error (strict), or output.weight left as is and listed missing.
void check_lm_head(const char* who, const std::string& path, bool files_have_lm_head, bool config_tied,
                   const models::llama::LlamaArgs& model, const checkpoint::SafetensorsImportOptions& options);

// One process holding the whole model: writes `tensors` (Hugging Face names, already in the file layout; cast
// to options.dtype) into dir/model.safetensors, and config_text as dir/config.json.
checkpoint::SafetensorsExportResult write_whole_model(const std::string& dir,
                                          std::vector<std::pair<std::string, at::Tensor>> tensors,
                                          const checkpoint::SafetensorsExportOptions& options, const std::string& config_text);

// The tensors of a file set (resolve_files: a directory, an index or one file), read whole, readers opened once.
class FileTensors {
 public:
  explicit FileTensors(const std::string& path);
  ~FileTensors();
  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& where() const { return where_; }
  bool has(const std::string& name) const { return where_.count(name) > 0; }
  at::Tensor read(const std::string& name);  // CPU, the file's dtype; error naming the tensor when absent
  std::string file_of(const std::string& name) const;  // the file holding `name` (path() when none does)

 private:
  std::string path_;
  std::map<std::string, std::string> where_;
  std::map<std::string, std::unique_ptr<checkpoint::safetensors::Reader>> readers_;
};

// Copies `t` (file tensor `file_name` of `file`) into the model's `key`, with shape and dtype checks naming them
// (an integer or bool tensor is refused for a floating-point parameter).
void copy_checked(const char* who, const std::string& file_name, const std::string& file, const std::string& key,
                  at::Tensor& param, const at::Tensor& t);

using KeyToFile = std::function<std::optional<std::string>(const std::string& key)>;
using TensorMap = std::function<at::Tensor(const std::string& key, const at::Tensor& t)>;

// Export of a whole model: every parameter for which `skip` (may be null) is false, renamed by `to_hf` (error
// naming a key it does not know) and mapped by `to_file` (may be null), in parameter order.
std::vector<std::pair<std::string, at::Tensor>> whole_model_tensors(const char* who, torch::nn::Module& model,
                                                                    const KeyToFile& to_hf, const TensorMap& to_file,
                                                                    const std::function<bool(const std::string&)>& skip);

// The import adapter of both models: file names by `to_hf` (error naming a key it does not know); our
// output.weight from model.embed_tokens.weight when the files have no lm_head.weight (a tied checkpoint);
// rotary inv_freq buffers, and lm_head.weight next to a tied model, are expected extras. `lm_head_from_embeddings`
// false (a config.json saying the embeddings are not tied): output.weight is lm_head.weight, never the embeddings.
checkpoint::detail::KeyAdapter import_adapter(const char* who, const KeyToFile& to_hf, bool files_have_lm_head,
                                              bool model_tied, bool lm_head_from_embeddings = true);

// Import into a whole model (no fully_shard): every parameter for which `skip` (may be null) is false, read
// whole from adapter.file_name(key), mapped by `from_file` (may be null). Missing tensors: an error naming the
// tensor and the key (strict) or result.missing. File tensors read are added to `used`.
checkpoint::SafetensorsImportResult import_whole_model(const char* who, torch::nn::Module& model, FileTensors& files,
                                           const checkpoint::detail::KeyAdapter& adapter,
                                           const checkpoint::SafetensorsImportOptions& options, const TensorMap& from_file,
                                           const std::function<bool(const std::string&)>& skip,
                                           std::set<std::string>& used);
// One MoE layer's routed experts, ours stacked (w1 / w3 [E, F, D], w2 [E, D, F]) <-> Hugging Face's names under
// `prefix` ("model.layers.<i>.mlp.experts."). Export: transformers 5's stacked gate_up_proj [E, 2F, D] (w1 rows
// first) and down_proj [E, D, F], appended to `tensors`.
void append_stacked_experts(std::vector<std::pair<std::string, at::Tensor>>& tensors, const std::string& prefix,
                            const models::moe::GroupedExpertsImpl& experts);
// Import: those stacked tensors, or one tensor per expert and projection ({j}.{gate,up,down}_proj.weight, what
// save_pretrained and the hub hold), copied into `experts` (`ours`: its FQN, for errors naming both sides). False
// when neither layout is in the files (the caller decides: an error or a missing entry). Tensors read go into
// `used` and their bytes into r.bytes_read.
bool import_experts(const char* who, FileTensors& files, const std::string& prefix, const std::string& ours,
                    models::moe::GroupedExpertsImpl& experts, std::set<std::string>& used, checkpoint::SafetensorsImportResult& r);

// ---- Sharded models (fully_shard: FSDP, HSDP, DDP, EP, TP; pipeline stages in options.parts) ----
// Both MoE adapters (Qwen3-MoE, DeepSeek-V3) keep their routed experts under the same names on both sides:
// ours layers.<i>.moe.experts.{w1,w2,w3}, Hugging Face's model.layers.<i>.mlp.experts.{gate_up_proj,down_proj}.

// "layers.<i>.moe.experts.*": the stacked expert weights (mapped per layer, not by name).
bool is_expert_key(const std::string& key);
// "layers.<i>.moe.expert_bias": the load-balancing bias buffer.
bool is_expert_bias_key(const std::string& key);
// "model.layers.<i>.mlp.experts.": where Hugging Face keeps layer i's routed experts.
std::string experts_prefix(int64_t layer);
// The layer ids of a model's MoE blocks (any model whose blocks() have layer_id and moe).
template <typename Model>
std::vector<int64_t> moe_layer_ids(Model& model) {
  std::vector<int64_t> ids;
  for (auto& block : model.blocks()) {
    if (block->moe) ids.push_back(block->layer_id);
  }
  return ids;
}

// The routed experts (hidden size `expert_hidden`, F) as slices of transformers 5's stacked tensors: w1 and w3
// are rows [0, F) and [F, 2F) of gate_up_proj [E, 2F, D] (dim 1), w2 is all of down_proj [E, D, F]. Gathered
// (export) or read (import) one key at a time: the writer holds at most one layer's w1 and w3 (and their
// concatenation) whole, and an importing rank reads only its own experts' rows.
std::function<std::optional<checkpoint::detail::FileSlice>(const std::string&)> stacked_expert_slices(
    int64_t expert_hidden);

// Export of a sharded model through the streaming path (<fsdp/checkpoint/model_safetensors.h>): one tensor
// gathered at a time (under PP by its stage's ranks, sent to rank 0), rank 0 writing it before the next. Keys
// for which `skip` (may be null) is true are not written; the others are named by `to_hf` (an error naming a key
// it does not know), the routed experts as stacked_expert_slices when `expert_hidden` > 0. `extra_tensors`:
// tensors no model key holds (small: DeepSeek-V3's zero e_score_correction_bias of a model without load
// balancing), written by rank 0 after the model's. config_text is written as config.json.
checkpoint::SafetensorsExportResult export_sharded(const char* who, torch::nn::Module& model, const std::string& dir,
                                       const checkpoint::SafetensorsExportOptions& options, const KeyToFile& to_hf,
                                       const std::function<bool(const std::string&)>& skip, int64_t expert_hidden,
                                       const std::string& config_text,
                                       std::vector<std::pair<std::string, at::Tensor>> extra_tensors = {});

// Import into a sharded model: every rank reads only its own rows (under PP: of its stages, options.parts)
// through `adapter` (import_adapter's names), keys for which `skip` (may be null) is true left as they are, the
// routed experts of `moe_layers` (layer ids, hidden size `expert_hidden`) as slices of the stacked tensors or,
// for a layer whose files hold one tensor per expert and projection (save_pretrained's, the hub's:
// {j}.{gate,up,down}_proj.weight), each rank reading the tensors of its own experts only (KeyAdapter::file_stack).
checkpoint::SafetensorsImportResult import_sharded(const char* who, torch::nn::Module& model, const FileTensors& files,
                                       checkpoint::detail::KeyAdapter adapter, const checkpoint::SafetensorsImportOptions& options,
                                       const std::function<bool(const std::string&)>& skip,
                                       const std::vector<int64_t>& moe_layers, int64_t expert_hidden);

// After import_whole_model and any tensors read apart: file tensors neither `used` nor ignorable go to
// r.unexpected, an error naming them on a strict load (as import_safetensors on any number of ranks).
void finish_whole_import(const char* who, const std::string& path, const FileTensors& files,
                         const std::set<std::string>& used, const checkpoint::detail::KeyAdapter& adapter,
                         const checkpoint::SafetensorsImportOptions& options, checkpoint::SafetensorsImportResult& r);

}  // namespace fsdp::models::hf::common
