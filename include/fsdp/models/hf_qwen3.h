#pragma once
// Hugging Face Qwen3ForCausalLM / Qwen3MoeForCausalLM weights to and from our decoder with Qwen3 args
// (<fsdp/models/qwen3.h>), with TorchTitan's Qwen3 state-dict adapter names (torchtitan/models/qwen3):
//   tok_embeddings.weight                    <-> model.embed_tokens.weight
//   layers.{i}.attention.w{q,k,v,o}.weight   <-> model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
//   layers.{i}.attention.{q,k}_norm.weight   <-> model.layers.{i}.self_attn.{q,k}_norm.weight
//   layers.{i}.attention_norm.weight         <-> model.layers.{i}.input_layernorm.weight
//   layers.{i}.ffn_norm.weight               <-> model.layers.{i}.post_attention_layernorm.weight
//   layers.{i}.feed_forward.w{1,2,3}.weight  <-> model.layers.{i}.mlp.{gate,down,up}_proj.weight   (dense layers)
//   layers.{i}.moe.router.gate.weight        <-> model.layers.{i}.mlp.gate.weight                 (MoE layers)
//   layers.{i}.moe.experts.w1 [E, F, D] / w3 <-> model.layers.{i}.mlp.experts.gate_up_proj [E, 2F, D] (w1 rows
//                                                first: transformers 5's in-memory layout)
//   layers.{i}.moe.experts.w2 [E, D, F]      <-> model.layers.{i}.mlp.experts.down_proj [E, D, F]
//   norm.weight <-> model.norm.weight; output.weight <-> lm_head.weight (absent when the embeddings are tied)
// No RoPE permutation: Qwen3 uses the half-split layout (RopeLayout::HalfSplit) on both sides. Export writes the
// stacked tensors above, which transformers 5's from_pretrained loads as they are. transformers 5's
// save_pretrained (and the hub's checkpoints) store one tensor per expert instead,
// model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight; import reads both layouts. RoPE scaling
// (rope_type "linear", "llama3", "yarn") is written to and checked against config.json in both forms.
// The load-balancing buffer moe.expert_bias has no Hugging Face counterpart: not exported, left as is (zero
// on a fresh model) on import. config.json: model_type qwen3 or qwen3_moe.
//
// Sharded models (fully_shard: FSDP, EP, TP, pipeline stages) take the streaming, own-rows path of
// <fsdp/checkpoint/model_safetensors.h>, the experts as slices of the stacked tensors; a sharded import reads its
// rows of the stacked layout, or its own experts' tensors of the per-expert one.

#include <fsdp/checkpoint/model_safetensors.h>

#include <optional>
#include <string>

namespace fsdp::models::llama {
struct LlamaArgs;
class TransformerImpl;
}  // namespace fsdp::models::llama

namespace fsdp::models::hf {

// Our key -> Hugging Face name, for every key but the stacked experts (nullopt for them and unknown keys).
std::optional<std::string> qwen3_to_hf_name(const std::string& key);
std::optional<std::string> qwen3_from_hf_name(const std::string& hf_name);
// config.json of a Qwen3ForCausalLM (no MoE layers) or Qwen3MoeForCausalLM with these args. Throws when the
// args are not expressible as one (an MoE router other than Qwen3's: softmax, scale 1, no shared experts).
std::string qwen3_config_json(const models::llama::LlamaArgs& args, const std::string& dtype = "float32");

// `dir` receives config.json and the weights (model.safetensors; for a sharded dense model possibly
// model-0000i-of-0000N.safetensors + the index).
checkpoint::SafetensorsExportResult export_qwen3(models::llama::TransformerImpl& model, const std::string& dir,
                                     const checkpoint::SafetensorsExportOptions& options = {});
// `path`: a directory (index or model.safetensors), an index json or one file. A config.json next to it must
// describe the model: fields we cannot compute are refused by name (<fsdp/models/hf_config.h>), and those we
// can must match (sizes, head_dim, norm eps, RoPE base and scaling, experts, top-k, norm_topk_prob, sparse step,
// dense layers, tied embeddings): an error lists every mismatch. A strict import (the default) refuses file
// tensors the model does not have and a config saying tie_word_embeddings = false over files without
// lm_head.weight, on one rank as on N.
checkpoint::SafetensorsImportResult import_qwen3(models::llama::TransformerImpl& model, const std::string& path,
                                     const checkpoint::SafetensorsImportOptions& options = {});

}  // namespace fsdp::models::hf
