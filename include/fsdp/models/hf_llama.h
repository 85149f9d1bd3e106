#pragma once
// Hugging Face Llama weights to and from our Llama 3 (fsdp::models::llama::Transformer), with TorchTitan's Llama 3
// state-dict adapter semantics (torchtitan/models/llama3/state_dict_adapter.py):
//   tok_embeddings.weight                  <-> model.embed_tokens.weight
//   layers.{i}.attention.w{q,k,v,o}.weight <-> model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
//   layers.{i}.feed_forward.w{1,2,3}.weight<-> model.layers.{i}.mlp.{gate,down,up}_proj.weight
//   layers.{i}.attention_norm.weight       <-> model.layers.{i}.input_layernorm.weight
//   layers.{i}.ffn_norm.weight             <-> model.layers.{i}.post_attention_layernorm.weight
//   norm.weight                            <-> model.norm.weight
//   output.weight                          <-> lm_head.weight   (absent when the embeddings are tied)
// wq/wk rows are permuted between our interleaved RoPE pairs (x[2i], x[2i+1]) and Hugging Face's half-split
// layout (x[i], x[i + head_dim/2]) per head: to HF = view(heads, head_dim/2, 2, dim).transpose(1, 2).
//
// Export is collective and streams one tensor at a time (export_safetensors); it also writes config.json
// (LlamaForCausalLM). Import reads on every rank only the file rows holding its own rows (for wq/wk: the
// permuted rows, read as runs). A file set without lm_head.weight loads output.weight from the embeddings
// when config.json says tie_word_embeddings = true or there is no config.json (tied checkpoints); a config
// saying false over such files is an error (strict). lm_head.weight next to our tied model and rotary
// inv_freq buffers are ignored; any other tensor the model does not have is an error on a strict load, on one
// rank as on N. RoPE scaling ("linear", "llama3", "yarn") is written to config.json in both forms.

#include <fsdp/checkpoint/model_safetensors.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

namespace fsdp::models::llama {
struct LlamaArgs;
class TransformerImpl;
}  // namespace fsdp::models::llama

namespace fsdp::models::hf {

// Our key -> Hugging Face name (nullopt for a key the adapter does not know) and back.
std::optional<std::string> to_hf_name(const std::string& key);
std::optional<std::string> from_hf_name(const std::string& hf_name);
// Row permutations of wq/wk ([n_heads * head_dim, dim]) between the two RoPE layouts.
at::Tensor permute_to_hf(const at::Tensor& w, int64_t n_heads);
at::Tensor permute_from_hf(const at::Tensor& w, int64_t n_heads);
// config.json of a LlamaForCausalLM with these args (dtype: the weights' torch_dtype).
std::string config_json(const models::llama::LlamaArgs& args, const std::string& dtype = "float32");

// `dir` receives config.json, model.safetensors or model-0000i-of-0000N.safetensors + the index.
checkpoint::SafetensorsExportResult export_llama(models::llama::TransformerImpl& model, const std::string& dir,
                                     const checkpoint::SafetensorsExportOptions& options = {});
// `path`: a directory (index or model.safetensors), an index json or one file. When the directory holds a
// config.json, fields we cannot compute are refused by name (<fsdp/models/hf_config.h>) and the others must
// match the model (sizes, heads, norm eps, RoPE base and scaling, tied embeddings): an error names each.
checkpoint::SafetensorsImportResult import_llama(models::llama::TransformerImpl& model, const std::string& path,
                                     const checkpoint::SafetensorsImportOptions& options = {});

}  // namespace fsdp::models::hf
