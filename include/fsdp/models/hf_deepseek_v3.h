#pragma once
// Hugging Face DeepseekV3ForCausalLM (config.json model_type "deepseek_v3") <-> our DeepSeek-V3
// (<fsdp/models/deepseek_v3.h>), TorchTitan's deepseek_v3 state-dict adapter names:
//   tok_embeddings.weight <-> model.embed_tokens.weight; norm.weight <-> model.norm.weight;
//   output.weight <-> lm_head.weight; inside layers.{i}. <-> model.layers.{i}.:
//   attention.wq                  <-> self_attn.q_proj            (q_lora_rank 0 / null)
//   attention.{wq_a, q_norm, wq_b} <-> self_attn.{q_a_proj, q_a_layernorm, q_b_proj}
//   attention.{wkv_a, kv_norm, wkv_b, wo} <-> self_attn.{kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}
//   attention_norm, ffn_norm      <-> input_layernorm, post_attention_layernorm
//   feed_forward.w{1,2,3}         <-> mlp.{gate,down,up}_proj                           (dense layers)
//   moe.router.gate.weight        <-> mlp.gate.weight
//   moe.expert_bias (buffer)      <-> mlp.gate.e_score_correction_bias
//   moe.shared_experts.w{1,2,3}   <-> mlp.shared_experts.{gate,down,up}_proj
//   moe.experts.w1 / w3 [E, F, D] <-> mlp.experts.gate_up_proj [E, 2F, D] (w1 rows first), written on export;
//                                     or mlp.experts.{j}.{gate,up}_proj.weight (save_pretrained's, the hub's)
//   moe.experts.w2 [E, D, F]      <-> mlp.experts.down_proj, or mlp.experts.{j}.down_proj.weight
// No weight permutation: transformers' rope_interleave (the default) rotates the same interleaved pairs as ours.
// A sharded model (fully_shard: FSDP, HSDP, DDP, EP, TP; pipeline stages in the options' parts) is exported one
// tensor at a time (rank 0 writes) and imported by each rank reading its own rows, the experts as slices of the
// stacked tensors (or, per-expert layout, its own experts' tensors); an unsharded model must hold every expert.
//
// config.json: every field that changes transformers' computation is honoured (sizes, MLA ranks and head dims,
// q_lora_rank null, first_k_dense_replace, experts, shared experts, top-k, n_group / topk_group,
// routed_scaling_factor, norm_topk_prob, rms_norm_eps, RoPE theta and YaRN with mscale / mscale_all_dim) or
// refused by name (num_key_value_heads != num_attention_heads, hidden_act other than silu, attention_bias,
// attention_dropout, rope_interleave false, tie_word_embeddings, RoPE types other than default and yarn).
// transformers' q_a_layernorm / kv_a_layernorm always use eps 1e-6: the args' latent_norm_eps.

#include <fsdp/checkpoint/model_safetensors.h>
#include <fsdp/models/deepseek_v3.h>

#include <string>

namespace fsdp::models::hf {

// The args a config.json (`path`: the file or its directory) describes; device CPU, dtype float32. Errors name
// the file, the field and the rule.
fsdp::models::deepseek_v3::DeepSeekV3Args read_deepseek_v3_config(const std::string& path);
// config.json of a DeepseekV3ForCausalLM with these args; throws naming what transformers cannot express
// (softmax routing, latent_norm_eps other than 1e-6, RoPE scaling other than YaRN).
std::string deepseek_v3_config_json(const fsdp::models::deepseek_v3::DeepSeekV3Args& args,
                                    const std::string& dtype = "float32");

// `dir` receives config.json and model.safetensors.
checkpoint::SafetensorsExportResult export_deepseek_v3(fsdp::models::deepseek_v3::DeepSeekV3Impl& model, const std::string& dir,
                                           const checkpoint::SafetensorsExportOptions& options = {});
// `path`: a directory, an index json or one .safetensors file. A config.json next to it must describe the model
// (one error listing every mismatch). Strict by default: tensors missing or left over are errors.
checkpoint::SafetensorsImportResult import_deepseek_v3(fsdp::models::deepseek_v3::DeepSeekV3Impl& model, const std::string& path,
                                           const checkpoint::SafetensorsImportOptions& options = {});

}  // namespace fsdp::models::hf
