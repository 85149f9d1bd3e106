#pragma once
// Llama 3 in libtorch: a small model zoo entry, the C++ counterpart of torchtitan.models.llama3.
//
// The model knows nothing of FSDP or tensor parallelism. It only follows the hook rule of
// <fsdp/nn/module_call.h>: every submodule (blocks, attention, projections, norms, embeddings) is invoked as
// fsdp::nn::call(module, ...), so whatever wraps it (fully_shard, activation checkpointing, tensor-parallel
// styles) sees its forward; head counts are read from the projections' outputs. Module names and parameter FQNs are TorchTitan's:
//   tok_embeddings.weight, layers.<i>.attention.{wq,wk,wv,wo}.weight, layers.<i>.feed_forward.{w1,w2,w3}.weight,
//   layers.<i>.attention_norm.weight, layers.<i>.ffn_norm.weight, norm.weight, output.weight   (no biases)
// and, for Qwen3 (<fsdp/models/qwen3.h>), layers.<i>.attention.{q_norm,k_norm}.weight and in MoE layers
// layers.<i>.moe.{router.gate.weight, experts.w1, experts.w2, experts.w3} (+ buffer moe.expert_bias) instead of
// feed_forward.
//
// Parameters are created directly on LlamaArgs' device, so a "meta" device builds the real 8B/70B shapes
// without allocating (for memory planning); init_weights() later fills them wherever they live.
//
// Models layer (src/models, docs/architecture.md), with its TP plan (<fsdp/models/llama_tp_plan.h>) and the Hugging
// Face adapter (<fsdp/models/hf_llama.h>). The model itself uses only the nn layer; its Linear and Embedding state
// their weight layout (<fsdp/nn/weight_layout.h>) so that tensor-parallel styles can split them.

#include <fsdp/models/moe.h>
#include <fsdp/nn/weight_layout.h>

#include <ATen/core/Generator.h>
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
#include <tuple>
#include <utility>
#include <vector>

namespace fsdp::models::llama {

// RoPE frequency scaling, as transformers' modeling_rope_utils computes it (rope_type "llama3", "yarn", "linear").
//   Llama3 (Llama 3.1; TorchTitan's RoPE scaling="llama"): frequencies whose wavelength exceeds
//     original_max_position_embeddings / low_freq_factor are divided by `factor`, those shorter than
//     original_max_position_embeddings / high_freq_factor are kept, the band in between is interpolated smoothly.
//   Yarn (Qwen3's long context, DeepSeek-V3): frequencies blended between theta^(-2i/d) / factor and
//     theta^(-2i/d) by a linear ramp over the dimensions between the correction range of beta_fast and beta_slow
//     rotations in original_max_position_embeddings (floor/ceil of it when `truncate`); cos and sin are
//     multiplied by the attention factor (rope_attention_factor).
//   Linear: every frequency divided by `factor`.
// The defaults are Llama 3.1's (and TorchTitan's); `type` comes after the Llama 3 fields so that
// RopeScaling{factor, low, high, context} stays a Llama 3 scaling.
struct RopeScaling {
  enum class Type { Llama3, Yarn, Linear };
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
  Type type = Type::Llama3;
  // YaRN only (transformers' defaults): beta_fast 32, beta_slow 1; attention_factor given, or computed from
  // factor (0.1 ln(factor) + 1), or from mscale / mscale_all_dim when both are set (DeepSeek-V3).
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  bool truncate = true;
  std::optional<double> attention_factor;
  std::optional<double> mscale, mscale_all_dim;
};
// transformers' rope_type name of a scaling type ("llama3", "yarn", "linear").
const char* rope_type_name(RopeScaling::Type type);
// The factor cos and sin are multiplied by: 1 but for YaRN (transformers' attention_factor / "mscale").
double rope_attention_factor(const std::optional<RopeScaling>& scaling);

// How RoPE pairs a head's dimensions: Llama's interleaved pairs (x[2i], x[2i+1]) (TorchTitan's complex RoPE,
// Meta's checkpoints) or Hugging Face's half split (x[i], x[i + head_dim/2]) (rotate_half; TorchTitan's cos_sin
// RoPE, Qwen3's checkpoints: their q/k weights then load without a row permutation).
enum class RopeLayout { Interleaved, HalfSplit };

// Which keys a query attends to (TorchTitan's attn_mask_type). Causal: every earlier position of the sequence.
// BlockCausal: only the earlier positions of its own document, for samples packed from several documents; the
// forward then takes the tokens' document ids (document_ids() below), and attention runs with a boolean
// [batch, 1, seq, seq] mask built once per forward (block_causal_mask()). RoPE positions stay those of the packed
// sequence, as in TorchTitan (attention depends only on the distance between a query and a key, so a document
// attends as it would alone at position 0).
enum class AttnMaskType { Causal, BlockCausal };

// TorchTitan's TransformerModelArgs for llama3, generalised for Qwen3 (<fsdp/models/qwen3.h>): an explicit head
// size and FFN size, QK-norm, the half-split RoPE layout and MoE layers. The defaults are Llama 3's.
struct LlamaArgs {
  int64_t dim = 4096;
  int64_t n_layers = 32;
  int64_t n_heads = 32;
  std::optional<int64_t> n_kv_heads;  // nullopt = n_heads (plain multi-head attention)
  int64_t vocab_size = 128256;
  int64_t multiple_of = 256;                 // FFN hidden size is rounded up to a multiple of this
  std::optional<double> ffn_dim_multiplier;  // applied to 2/3 * 4 * dim before rounding
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  std::optional<RopeScaling> rope_scaling;  // nullopt: plain RoPE (Llama 3.0, Qwen3 and our cpu_* flavors)
  int64_t max_seq_len = 2048;  // RoPE tables are computed lazily for the sequence length actually seen
  bool tie_embeddings = false;  // output.weight is tok_embeddings.weight (Llama 3.2 1B/3B)
  bool depth_init = true;       // TorchTitan: block l's output projections use std 0.02/sqrt(2(l+1))
  c10::Device device = c10::kCPU;  // where parameters are created (kMeta: shapes only)
  c10::ScalarType dtype = c10::kFloat;
  // Qwen3: head_dim is its own setting (128 for every size, so n_heads * head_dim may differ from dim), the
  // dense FFN size is given (Hugging Face's intermediate_size), q and k are RMS-normalised per head (over
  // head_dim, eps = norm_eps) before RoPE; FQNs layers.<i>.attention.{q_norm,k_norm}.weight.
  std::optional<int64_t> explicit_head_dim;    // nullopt: dim / n_heads
  std::optional<int64_t> explicit_ffn_hidden;  // nullopt: TorchTitan's sizing from dim, multiplier, multiple_of
  bool qk_norm = false;
  RopeLayout rope_layout = RopeLayout::Interleaved;
  // Mixture of experts: when set, layer i has a `moe` block (fsdp::models::moe::MoE; FQNs layers.<i>.moe.*) instead
  // of `feed_forward` iff i is not in dense_layers and (i + 1) % moe_layer_step == 0 (Hugging Face's
  // decoder_sparse_step and mlp_only_layers). moe->dim 0 means `dim`.
  std::optional<fsdp::models::moe::MoEOptions> moe;
  int64_t moe_layer_step = 1;
  std::vector<int64_t> dense_layers;
  AttnMaskType attn_mask_type = AttnMaskType::Causal;

  int64_t kv_heads() const { return n_kv_heads.value_or(n_heads); }
  int64_t head_dim() const { return explicit_head_dim.value_or(dim / n_heads); }
  int64_t ffn_hidden_dim() const;  // explicit_ffn_hidden, else TorchTitan's FeedForward sizing (768 for debugmodel)
  bool is_moe_layer(int64_t layer) const;
  // The MoE options of this model's MoE layers (dim filled in); requires `moe`.
  fsdp::models::moe::MoEOptions moe_options() const;
};

// Flavors by name: "debugmodel" (exactly TorchTitan's, with its Llama 3.1 RoPE scaling since TorchTitan PR #1839),
// small CPU flavors ("cpu_tiny", "cpu_small", "cpu_medium", plain RoPE), and the real shapes "1B", "3B" (Llama 3.2,
// RoPE scaling factor 32 as in Meta's checkpoints), "8B", "70B", "405B" (Llama 3.1, factor 8). Throws naming the
// known flavors for an unknown name.
LlamaArgs llama3_flavor(const std::string& name);
std::vector<std::string> llama3_flavor_names();

// Parameter counts (analytic, from the args alone; tied embeddings counted once; MoE layers count every expert,
// the router gate and shared experts; the expert_bias buffer is not a parameter).
int64_t num_params(const LlamaArgs& args);
int64_t num_embedding_params(const LlamaArgs& args);  // tok_embeddings (TorchTitan excludes it from FLOPs)
// Parameters a token passes through: num_params with each MoE layer's routed experts counted top_k / E.
int64_t num_active_params(const LlamaArgs& args);
// TorchTitan's training FLOPs per token: 6 * (active params - embedding params)
// + 6 * n_layers * n_heads * head_dim * seq (for MoE: only the top_k experts a token visits, as TorchTitan's
// get_moe_model_nparams_and_flops).
double flops_per_token(const LlamaArgs& args, int64_t seq_len);

// The leaf modules below read their parameter from the module's own registry on every forward (not from a
// cached member as torch::nn::Linear does), so a wrapper that re-registers a parameter under the same name
// (sharding, materialising a meta tensor) is seen by the model without further plumbing.
class ParamModule : public torch::nn::Module {
 public:
  const at::Tensor& weight() const { return parameters_["weight"]; }
  at::Tensor& weight() { return parameters_["weight"]; }
};

// A bias-free linear layer whose weight is created on a chosen device (torch::nn::Linear always allocates on
// the CPU first, which rules out meta-device construction of large models). FQN: <name>.weight.
class LinearImpl : public ParamModule, public fsdp::nn::HasWeightLayout {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, const at::TensorOptions& options);
  at::Tensor forward(const at::Tensor& x);
  fsdp::nn::WeightLayout weight_layout() const override { return fsdp::nn::WeightLayout::Linear; }
};
TORCH_MODULE(Linear);

class EmbeddingImpl : public ParamModule, public fsdp::nn::HasWeightLayout {
 public:
  EmbeddingImpl(int64_t num_embeddings, int64_t dim, const at::TensorOptions& options);
  at::Tensor forward(const at::Tensor& tokens);
  fsdp::nn::WeightLayout weight_layout() const override { return fsdp::nn::WeightLayout::Embedding; }
};
TORCH_MODULE(Embedding);

class RMSNormImpl : public ParamModule {
 public:
  RMSNormImpl(int64_t dim, double eps, const at::TensorOptions& options);
  at::Tensor forward(const at::Tensor& x);
  void reset_parameters();  // weight = 1
  double eps;
};
TORCH_MODULE(RMSNorm);

// Keys and values of every position seen so far, per block, for incremental decoding (generation): a new token
// attends to the cached positions instead of recomputing them.
struct KVCache {
  std::vector<at::Tensor> keys, values;  // per block: [B, capacity, n_kv_heads, head_dim] (after RoPE for keys)
  int64_t length = 0;                    // positions filled
  int64_t capacity() const { return keys.empty() ? 0 : keys.front().size(1); }
};

// Document masking (AttnMaskType::BlockCausal), TorchTitan's rule (torchtitan/models/attention.py,
// get_document_mask_mod): the document id of position t is the number of EOS tokens at positions < t, so an EOS
// belongs to the document it ends and the next document starts right after it. tokens [B, S] (integer) ->
// int64 [B, S]; ids count from 0 in each row.
at::Tensor document_ids(const at::Tensor& tokens, int64_t eos_id);
// The boolean mask attention takes for document ids [B, S]: [B, 1, S, S], true where query q may see key k
// (k <= q and both in the same document). B * S * S bytes (32 MiB at B 8, S 2048).
at::Tensor block_causal_mask(const at::Tensor& document_ids);
// The attention mask a block gets: a block_causal_mask, or nothing (causal attention).
using AttentionMask = std::optional<at::Tensor>;

// The attention over q, k, v [B, H, S, D] (grouped KV heads already repeated; possibly non-contiguous views) with
// the forward's mask (nothing: causal) -> [B, H, S, D]. Unset: libtorch's SDPA. A parallelism that splits the
// sequence over ranks puts its own here (context parallelism: ring attention over the cp ranks).
using AttentionKernel = std::function<at::Tensor(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const AttentionMask& mask)>;

// Grouped-query causal self-attention with rotary position embeddings.
class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const LlamaArgs& args);
  // x: [B, S, dim]; rope_cos/rope_sin: [S, head_dim/2] (float32); mask: a block_causal_mask [B, 1, S, S] (with
  // sequence parallelism S is the full length: attention sees the whole sequence), or nothing for causal.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& rope_cos, const at::Tensor& rope_sin,
                     const AttentionMask& mask = std::nullopt);
  // x holds positions [start, start + S); rope tables for those positions. Writes their keys/values into
  // cache_k/cache_v at [start, start + S) and attends causally over [0, start + S).
  at::Tensor forward_cached(const at::Tensor& x, const at::Tensor& rope_cos, const at::Tensor& rope_sin,
                            at::Tensor& cache_k, at::Tensor& cache_v, int64_t start);
  void init_weights(double init_std, at::Generator& gen);
  int64_t n_heads, n_kv_heads, head_dim;
  RopeLayout rope_layout;
  Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr};
  RMSNorm q_norm{nullptr}, k_norm{nullptr};  // QK-norm (null without)
  AttentionKernel kernel;                    // unset: SDPA (see AttentionKernel)

 private:
  // Projected q, k, v of x as [B, S, heads, head_dim], with QK-norm and RoPE applied to q and k. `hooked`: the
  // submodules run through fsdp::nn::call (false on the unsharded generation path).
  std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv(const at::Tensor& x, const at::Tensor& rope_cos,
                                                     const at::Tensor& rope_sin, bool hooked);
};
TORCH_MODULE(Attention);

// SwiGLU: w2(silu(w1 x) * w3 x).
class FeedForwardImpl : public torch::nn::Module {
 public:
  FeedForwardImpl(int64_t dim, int64_t hidden_dim, const at::TensorOptions& options);
  at::Tensor forward(const at::Tensor& x);
  void init_weights(double init_std, at::Generator& gen);
  Linear w1{nullptr}, w2{nullptr}, w3{nullptr};
};
TORCH_MODULE(FeedForward);

class TransformerBlockImpl : public torch::nn::Module {
 public:
  TransformerBlockImpl(int64_t layer_id, const LlamaArgs& args);
  // mask: as AttentionImpl::forward's (an argument, so activation checkpointing's recomputation sees it too).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& rope_cos, const at::Tensor& rope_sin,
                     const AttentionMask& mask = std::nullopt);
  at::Tensor forward_cached(const at::Tensor& x, const at::Tensor& rope_cos, const at::Tensor& rope_sin,
                            at::Tensor& cache_k, at::Tensor& cache_v, int64_t start);
  void init_weights(at::Generator& gen);
  int64_t layer_id;
  double weight_init_std;
  Attention attention{nullptr};
  FeedForward feed_forward{nullptr};  // dense layers (null in an MoE layer)
  fsdp::models::moe::MoE moe{nullptr};    // MoE layers (null in a dense layer)
  RMSNorm attention_norm{nullptr}, ffn_norm{nullptr};
};
TORCH_MODULE(TransformerBlock);

class TransformerImpl : public torch::nn::Module {
 public:
  explicit TransformerImpl(LlamaArgs args);
  // tokens: [B, S] int64 -> logits [B, S, vocab] (in the dtype the blocks computed in). document_ids: the
  // tokens' document_ids() [B, S], given exactly when args().attn_mask_type is BlockCausal (an error otherwise).
  at::Tensor forward(const at::Tensor& tokens, const std::optional<at::Tensor>& document_ids = std::nullopt);
  // Incremental decoding for generation on an unsharded model (blocks are called directly: no module hooks).
  // An empty cache for `batch` sequences of up to `capacity` positions (zeros, the parameters' dtype/device).
  KVCache make_kv_cache(int64_t batch, int64_t capacity) const;
  // tokens [B, S] at positions [cache.length, cache.length + S) -> logits [B, S, vocab]; the cache grows by S.
  // Equal to forward() over the whole sequence, restricted to the new positions.
  at::Tensor forward_cached(const at::Tensor& tokens, KVCache& cache);
  // TorchTitan's init_weights: embeddings N(0,1); wq/wk/wv/w1 trunc_normal(0.02); wo/w2/w3 trunc_normal with the
  // depth-scaled std; norms 1; output trunc_normal(dim^-0.5, cut at 3 std). Deterministic for a seed: it draws
  // from a private CPU generator (so the result does not depend on the device or on other RNG users) and
  // copies into the parameters wherever they live. With tied embeddings there is no output layer: the logits
  // are computed with tok_embeddings.weight, which is then the only copy of that matrix.
  void init_weights(uint64_t seed);
  // The same initialization, with each part (tok_embeddings, every block, norm, output) initialized inside
  // scope(part, fn). A sharding wrapper passes a scope that shows the part's full parameters during fn
  // (fsdp::full_params_init_scope): meta-device init then gives exactly the unsharded result.
  using InitScope = std::function<void(torch::nn::Module& part, const std::function<void()>& fn)>;
  void init_weights(uint64_t seed, const InitScope& scope);

  const LlamaArgs& args() const { return args_; }
  std::vector<TransformerBlock>& blocks() { return blocks_; }  // typed view of `layers`
  // The positions (int64 [S]) of the S tokens forward() is given, for RoPE; unset: 0 .. S-1. Context parallelism
  // sets it: a rank holds chunks of each sequence, and RoPE must see their global positions.
  std::function<at::Tensor(int64_t seq_len)> rope_positions;
  // block_causal: the attention mask of the forward's document ids, handed to every block; unset:
  // block_causal_mask(ids). A kernel that masks by itself sets what it takes (CP: every cp rank's document ids).
  std::function<at::Tensor(const at::Tensor& document_ids)> document_mask;

  Embedding tok_embeddings{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};
  Linear output{nullptr};

 private:
  std::pair<at::Tensor, at::Tensor> rope_tables(int64_t seq_len, c10::Device device);
  LlamaArgs args_;
  std::vector<TransformerBlock> blocks_;
  // RoPE cos/sin cache (not a buffer: it is derived, never checkpointed or sharded, as TorchTitan's
  // non-persistent freqs_cis).
  at::Tensor rope_cos_, rope_sin_;
};
TORCH_MODULE(Transformer);

// The attention mask of a forward: nothing for a Causal model; for a BlockCausal one the block_causal_mask of
// `document_ids` [B, S] (required). `who` names the caller in errors.
AttentionMask attention_mask_for(const LlamaArgs& args, const std::optional<at::Tensor>& document_ids,
                                 const char* who);

// RoPE inverse frequencies theta^(-2i/head_dim), i < head_dim/2, in float64, with the scaling if given
// (Llama 3.1's: TorchTitan's ComplexRoPE._precompute_cache formula; YaRN and linear: transformers').
at::Tensor rope_frequencies(int64_t head_dim, double theta, const std::optional<RopeScaling>& scaling = std::nullopt);
// RoPE tables for positions [0, seq_len): cos/sin of pos * frequency_i, times rope_attention_factor(scaling),
// shape [seq_len, head_dim/2] (float32, computed in float64).
std::pair<at::Tensor, at::Tensor> precompute_rope(int64_t head_dim, int64_t seq_len, double theta,
                                                  const std::optional<RopeScaling>& scaling = std::nullopt);
// Rotates the pairs of x [B, S, H, head_dim] by the angles in cos/sin: interleaved pairs (x[..., 2i],
// x[..., 2i+1]) like TorchTitan's complex multiply by freqs_cis, or half-split pairs (x[..., i],
// x[..., i + head_dim/2]) like Hugging Face's rotate_half; computed in float32 and returned in x's dtype.
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                      RopeLayout layout = RopeLayout::Interleaved);

}  // namespace fsdp::models::llama
