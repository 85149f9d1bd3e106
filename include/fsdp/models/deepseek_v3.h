#pragma once
// DeepSeek-V3 (and V2-style flavors) in libtorch: the C++ counterpart of torchtitan.models.deepseek_v3 and of
// transformers' DeepseekV3ForCausalLM. What differs from the Llama decoder (<fsdp/models/llama.h>) is the
// attention, multi-head latent attention (MLA):
//   q      = wq(x)                                   (q_lora_rank 0)
//          | wq_b(q_norm(wq_a(x)))                   (q_lora_rank > 0: a low-rank query with its RMSNorm)
//   [c, k_pe] = wkv_a(x)                             (c: the kv latent of kv_lora_rank, k_pe: qk_rope_head_dim)
//   [k_nope, v] = wkv_b(kv_norm(c))                  (per head qk_nope_head_dim and v_head_dim)
//   q = [q_nope, rope(q_pe)], k = [k_nope, rope(k_pe) shared by every head]
// RoPE rotates only the qk_rope_head_dim part (interleaved pairs, TorchTitan's complex RoPE = transformers'
// rope_interleave), with YaRN scaling; the softmax scale is qk_head_dim^-0.5 times YaRN's mscale(factor,
// mscale_all_dim)^2. The first n_dense_layers layers have a dense SwiGLU FFN (inter_dim), the others an MoE block
// (<fsdp/models/moe.h>: sigmoid or softmax scores, group-limited routing, shared experts, the bias-based load
// balancing). FQNs are TorchTitan's:
//   tok_embeddings.weight, norm.weight, output.weight,
//   layers.<i>.attention.{wq | wq_a, q_norm, wq_b}.weight, layers.<i>.attention.{wkv_a, kv_norm, wkv_b, wo}.weight,
//   layers.<i>.attention_norm.weight, layers.<i>.ffn_norm.weight,
//   layers.<i>.feed_forward.{w1,w2,w3}.weight                 (dense layers)
//   layers.<i>.moe.{router.gate.weight, experts.w1/w2/w3, shared_experts.w1/w2/w3.weight} + buffer
//   moe.expert_bias                                           (MoE layers)
// As the Llama model, every submodule is called through fsdp::nn::call (fully_shard, activation checkpointing
// and expert parallelism wrap it unchanged), and parameters are created on the args' device ("meta" builds the
// 671B shapes without memory). Hugging Face weights and config.json: <fsdp/models/hf_deepseek_v3.h>.
// In fsdp-train as model.name = "deepseek_v3" (apps/fsdp-train/models/deepseek_v3/). Pipeline stages:
// <fsdp/models/deepseek_v3_pipeline.h>; tensor parallelism: <fsdp/models/deepseek_v3_tp_plan.h>; context
// parallelism: the hooks below (MLAImpl::kernel, DeepSeekV3Impl::rope_positions / document_mask), filled by the
// trainer's apply_cp with <fsdp/context_parallel.h>'s ring.

#include <fsdp/models/llama.h>
#include <fsdp/models/moe.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::models::deepseek_v3 {

// TorchTitan's DeepSeekV3ModelArgs (its MoEArgs folded into `moe`). Defaults: TorchTitan's (the 16B shapes).
struct DeepSeekV3Args {
  int64_t dim = 2048;
  int64_t n_layers = 27;
  int64_t n_dense_layers = 1;  // the first layers have a dense FFN, the rest MoE (HF: first_k_dense_replace)
  int64_t n_heads = 16;
  int64_t vocab_size = 102400;
  int64_t inter_dim = 10944;  // dense FFN hidden size (HF: intermediate_size)
  double norm_eps = 1e-5;     // the block and final RMSNorms (HF: rms_norm_eps)
  // MLA's q_norm and kv_norm: TorchTitan uses norm_eps, transformers a fixed 1e-6 (DeepseekV3RMSNorm's default).
  double latent_norm_eps = 1e-5;
  // Multi-head latent attention.
  int64_t q_lora_rank = 0;  // 0: q = wq(x); else q = wq_b(q_norm(wq_a(x)))
  int64_t kv_lora_rank = 512;
  int64_t qk_nope_head_dim = 128;
  int64_t qk_rope_head_dim = 64;
  int64_t v_head_dim = 128;
  // RoPE on the qk_rope_head_dim part. TorchTitan's YaRN (rope_factor 40 over original_seq_len 4096, beta 32/1,
  // mscale) is RopeScaling{Yarn, factor, original_max_position_embeddings, beta_fast, beta_slow,
  // mscale = mscale_all_dim = TorchTitan's mscale}: cos/sin unscaled (mscale / mscale_all_dim = 1) and the
  // softmax scale times mscale(factor)^2. nullopt: plain RoPE, softmax scale qk_head_dim^-0.5.
  double rope_theta = 10000.0;
  std::optional<llama::RopeScaling> rope_scaling;
  int64_t max_seq_len = 4096 * 4;  // the RoPE table computed up front (it grows to the sequences seen)
  fsdp::models::moe::MoEOptions moe;   // moe.dim 0 means `dim`
  llama::AttnMaskType attn_mask_type = llama::AttnMaskType::Causal;
  bool depth_init = true;  // as LlamaArgs::depth_init
  c10::Device device = c10::kCPU;
  c10::ScalarType dtype = c10::kFloat;

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  bool is_moe_layer(int64_t layer) const { return layer >= n_dense_layers; }
  fsdp::models::moe::MoEOptions moe_options() const;  // `moe` with dim filled in
  // qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN with a non-zero mscale_all_dim
  // (transformers' yarn_apply_mscale; TorchTitan's softmax_scale).
  double softmax_scale() const;
};

// TorchTitan's flavors (torchtitan/models/deepseek_v3/flavors.py; every RMSNorm eps 1e-6, YaRN factor 40 over
// 4096 positions, sigmoid scores normalised over the top-k but for 236B, bias load balancing and the sequence
// aux loss at 1e-3): "debugmodel" (6 layers, 1 dense; 8 experts, 2 shared, top 3; q_lora_rank 0), "16B"
// (DeepSeek-V2-Lite's shapes: 27 layers, 64 experts), "236B" (DeepSeek-V2: 160 experts, 8 groups, 3 limited,
// softmax, route scale 16, q_lora_rank 1536) and "671B" (DeepSeek-V3: 61 layers, 3 dense, 256 experts, 8 groups,
// 4 limited, route scale 2.5); plus "cpu_tiny" (ours: a forward in milliseconds, every feature on: q LoRA,
// groups, shared experts, YaRN). block_causal is attn_mask_type on any flavor. Throws naming the known flavors.
DeepSeekV3Args deepseek_v3_flavor(const std::string& name);
std::vector<std::string> deepseek_v3_flavor_names();

// Analytic parameter counts (the expert_bias buffer is not a parameter); num_active_params counts each MoE
// layer's routed experts top_k / E.
int64_t num_params(const DeepSeekV3Args& args);
int64_t num_active_params(const DeepSeekV3Args& args);
// TorchTitan's training FLOPs per token for DeepSeek-V3 (get_moe_model_nparams_and_flops with head_dims =
// qk_head_dim + v_head_dim): 6 * (active params - embedding params) + 6 * n_layers * n_heads * head_dims * seq.
double flops_per_token(const DeepSeekV3Args& args, int64_t seq_len);

// Multi-head latent attention (see the top of this file).
class MLAImpl : public torch::nn::Module {
 public:
  explicit MLAImpl(const DeepSeekV3Args& args);
  // x [B, S, dim]; rope_cos/rope_sin [S, qk_rope_head_dim/2]; mask: a llama::block_causal_mask [B, 1, S, S] (or,
  // with a `kernel` that masks by itself, what DeepSeekV3Impl::document_mask gave), or nothing for causal attention.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& rope_cos, const at::Tensor& rope_sin,
                     const llama::AttentionMask& mask = std::nullopt);
  void init_weights(double init_std, at::Generator& gen);
  int64_t q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim;
  double softmax_scale;
  // The attention over q, k [B, H, S, qk_head_dim] and v [B, H, S, v_head_dim] with the forward's mask (nothing:
  // causal), scaled by softmax_scale -> [B, H, S, v_head_dim]; unset: libtorch's SDPA. Context parallelism puts
  // ring attention here (the kernel closes over softmax_scale: llama::AttentionKernel takes no scale).
  llama::AttentionKernel kernel;
  llama::Linear wq{nullptr}, wq_a{nullptr}, wq_b{nullptr}, wkv_a{nullptr}, wkv_b{nullptr}, wo{nullptr};
  llama::RMSNorm q_norm{nullptr}, kv_norm{nullptr};  // q_norm null without q LoRA
};
TORCH_MODULE(MLA);

class TransformerBlockImpl : public torch::nn::Module {
 public:
  TransformerBlockImpl(int64_t layer_id, const DeepSeekV3Args& args);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& rope_cos, const at::Tensor& rope_sin,
                     const llama::AttentionMask& mask = std::nullopt);
  void init_weights(at::Generator& gen);
  int64_t layer_id;
  double weight_init_std;
  MLA attention{nullptr};
  llama::FeedForward feed_forward{nullptr};  // dense layers (null in an MoE layer)
  fsdp::models::moe::MoE moe{nullptr};           // MoE layers (null in a dense layer)
  llama::RMSNorm attention_norm{nullptr}, ffn_norm{nullptr};
};
TORCH_MODULE(TransformerBlock);

class DeepSeekV3Impl : public torch::nn::Module {
 public:
  explicit DeepSeekV3Impl(DeepSeekV3Args args);
  // tokens [B, S] int64 -> logits [B, S, vocab]. document_ids (llama::document_ids of the tokens): given exactly
  // when args().attn_mask_type is BlockCausal.
  at::Tensor forward(const at::Tensor& tokens, const std::optional<at::Tensor>& document_ids = std::nullopt);
  // TorchTitan's init: embeddings N(0,1); wq/wq_a/wq_b/wkv_a/wkv_b and w1 trunc_normal(0.02); wo, w2, w3, the
  // router and experts with the depth-scaled std; norms 1; output trunc_normal(dim^-0.5, cut at 3 std).
  // Deterministic for a seed (a private CPU generator); `scope` as llama::TransformerImpl::init_weights.
  void init_weights(uint64_t seed);
  void init_weights(uint64_t seed, const llama::TransformerImpl::InitScope& scope);
  const DeepSeekV3Args& args() const { return args_; }
  std::vector<TransformerBlock>& blocks() { return blocks_; }
  // Context parallelism, as llama::TransformerImpl's: the global positions (int64 [S]) of the S tokens forward()
  // is given, for RoPE (unset: 0 .. S-1), and block_causal's mask of the forward's document ids as the attention
  // kernel takes it (unset: llama::block_causal_mask(ids)).
  std::function<at::Tensor(int64_t seq_len)> rope_positions;
  std::function<at::Tensor(const at::Tensor& document_ids)> document_mask;

  llama::Embedding tok_embeddings{nullptr};
  torch::nn::ModuleList layers{nullptr};
  llama::RMSNorm norm{nullptr};
  llama::Linear output{nullptr};

 private:
  std::pair<at::Tensor, at::Tensor> rope_tables(int64_t seq_len, c10::Device device);
  DeepSeekV3Args args_;
  std::vector<TransformerBlock> blocks_;
  at::Tensor rope_cos_, rope_sin_;  // derived, never checkpointed (TorchTitan's non-persistent freqs_cis)
};
TORCH_MODULE(DeepSeekV3);

}  // namespace fsdp::models::deepseek_v3
