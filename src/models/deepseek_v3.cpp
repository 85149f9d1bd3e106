// DeepSeek-V3 model (see include/fsdp/models/deepseek_v3.h). Shapes, flavors and init follow TorchTitan's
// torchtitan/models/deepseek_v3; the attention's arithmetic also transformers' DeepseekV3Attention.
#include <fsdp/models/deepseek_v3.h>
#include <fsdp/nn/module_call.h>

#include "models/model_init.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <tuple>

namespace fsdp::models::deepseek_v3 {

using llama::AttentionMask;

fsdp::models::moe::MoEOptions DeepSeekV3Args::moe_options() const {
  fsdp::models::moe::MoEOptions o = moe;
  if (o.dim == 0) o.dim = dim;
  TORCH_CHECK(o.dim == dim, "deepseek_v3: the MoE layers' dim ", o.dim, " differs from the model's dim ", dim);
  return o;
}

double DeepSeekV3Args::softmax_scale() const {
  double scale = 1.0 / std::sqrt(static_cast<double>(qk_head_dim()));
  if (rope_scaling && rope_scaling->type == llama::RopeScaling::Type::Yarn && rope_scaling->mscale_all_dim &&
      *rope_scaling->mscale_all_dim != 0 && rope_scaling->factor > 1) {
    const double m = 0.1 * *rope_scaling->mscale_all_dim * std::log(rope_scaling->factor) + 1.0;
    scale *= m * m;
  }
  return scale;
}

namespace {

// TorchTitan's YaRN for DeepSeek: rope_factor 40 over original_seq_len 4096, beta_fast 32, beta_slow 1, its
// mscale both in the numerator and denominator of the cos/sin factor (= 1) and squared into the softmax scale.
llama::RopeScaling torchtitan_yarn(double mscale) {
  llama::RopeScaling s;
  s.type = llama::RopeScaling::Type::Yarn;
  s.factor = 40.0;
  s.original_max_position_embeddings = 4096;
  s.beta_fast = 32.0;
  s.beta_slow = 1.0;
  s.truncate = true;
  s.mscale = mscale;
  s.mscale_all_dim = mscale;
  return s;
}

// TorchTitan's MoE of the DeepSeek flavors (torchtitan/models/deepseek_v3/flavors.py): expert scores applied
// after the experts, sigmoid scores normalised over the chosen experts (DeepSeek-V2's 236B: softmax, not
// normalised), load balancing by bias (coefficient 1e-3) and the sequence-wise aux loss (1e-3).
fsdp::models::moe::MoEOptions moe_args(int64_t experts, int64_t shared, int64_t top_k, int64_t hidden) {
  fsdp::models::moe::MoEOptions o;
  o.hidden = hidden;
  o.num_experts = experts;
  o.num_shared_experts = shared;
  o.top_k = top_k;
  o.score_func = "sigmoid";
  o.route_norm = true;
  o.route_scale = 1.0;
  o.load_balance_coeff = 1e-3;
  o.sequence_aux_loss_coeff = 1e-3;
  return o;
}

void set_mla(DeepSeekV3Args& a, int64_t q_lora_rank, int64_t kv_lora_rank, int64_t nope, int64_t rope, int64_t v) {
  a.q_lora_rank = q_lora_rank, a.kv_lora_rank = kv_lora_rank;
  a.qk_nope_head_dim = nope, a.qk_rope_head_dim = rope, a.v_head_dim = v;
}

}  // namespace

std::vector<std::string> deepseek_v3_flavor_names() { return {"cpu_tiny", "debugmodel", "16B", "236B", "671B"}; }

DeepSeekV3Args deepseek_v3_flavor(const std::string& name) {
  DeepSeekV3Args a;
  a.rope_theta = 10000.0;
  a.norm_eps = a.latent_norm_eps = 1e-6;  // every RMSNorm of TorchTitan's flavors
  a.max_seq_len = 16384;                  // TorchTitan's max context length of every flavor
  if (name == "debugmodel") {
    a.vocab_size = 2048, a.dim = 256, a.inter_dim = 1024, a.n_layers = 6, a.n_dense_layers = 1, a.n_heads = 16;
    a.moe = moe_args(8, 2, 3, 256);
    set_mla(a, 0, 512, 128, 64, 128);
    a.rope_scaling = torchtitan_yarn(0.70);
  } else if (name == "cpu_tiny") {
    // Ours, for tests: every feature of the 671B on (q LoRA, expert groups, sigmoid routing normalised and
    // scaled, a shared expert, YaRN) at sizes a CPU runs in milliseconds; no aux loss.
    a.vocab_size = 2048, a.dim = 64, a.inter_dim = 192, a.n_layers = 3, a.n_dense_layers = 1, a.n_heads = 4;
    a.moe = moe_args(8, 1, 2, 32);
    a.moe.route_scale = 2.5, a.moe.sequence_aux_loss_coeff.reset();
    a.moe.num_expert_groups = 4, a.moe.num_limited_groups = 2;
    set_mla(a, 32, 32, 16, 8, 16);
    a.rope_scaling = torchtitan_yarn(1.0);
    a.rope_scaling->factor = 4.0, a.rope_scaling->original_max_position_embeddings = 64;
    a.max_seq_len = 256;
  } else if (name == "16B") {  // DeepSeek-V2-Lite's shapes
    a.vocab_size = 102400, a.dim = 2048, a.inter_dim = 10944, a.n_layers = 27, a.n_dense_layers = 1, a.n_heads = 16;
    a.moe = moe_args(64, 2, 6, 1408);
    set_mla(a, 0, 512, 128, 64, 128);
    a.rope_scaling = torchtitan_yarn(0.70);
  } else if (name == "236B") {  // DeepSeek-V2's
    a.vocab_size = 102400, a.dim = 5120, a.inter_dim = 12288, a.n_layers = 60, a.n_dense_layers = 1, a.n_heads = 128;
    a.moe = moe_args(160, 2, 6, 1536);
    a.moe.score_func = "softmax", a.moe.route_norm = false, a.moe.route_scale = 16.0;
    a.moe.num_expert_groups = 8, a.moe.num_limited_groups = 3;
    set_mla(a, 1536, 512, 128, 64, 128);
    a.rope_scaling = torchtitan_yarn(1.0);
  } else if (name == "671B") {
    a.vocab_size = 129280, a.dim = 7168, a.inter_dim = 18432, a.n_layers = 61, a.n_dense_layers = 3, a.n_heads = 128;
    a.moe = moe_args(256, 1, 8, 2048);
    a.moe.route_scale = 2.5;
    a.moe.num_expert_groups = 8, a.moe.num_limited_groups = 4;
    set_mla(a, 1536, 512, 128, 64, 128);
    a.rope_scaling = torchtitan_yarn(1.0);
  } else {
    std::string known;
    for (const auto& n : deepseek_v3_flavor_names()) known += (known.empty() ? "" : ", ") + n;
    TORCH_CHECK(false, "unknown deepseek_v3 flavor '", name, "' (known: ", known, ")");
  }
  return a;
}

namespace {
int64_t count_params(const DeepSeekV3Args& a, bool active_only) {
  const int64_t H = a.n_heads;
  int64_t attn = a.q_lora_rank == 0 ? a.dim * H * a.qk_head_dim()
                                    : a.dim * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * H * a.qk_head_dim();
  attn += a.dim * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank +
          a.kv_lora_rank * H * (a.qk_nope_head_dim + a.v_head_dim) + H * a.v_head_dim * a.dim;
  int64_t layers = 0;
  for (int64_t i = 0; i < a.n_layers; ++i) {
    int64_t ffn = 3 * a.dim * a.inter_dim;
    if (a.is_moe_layer(i)) {
      const auto o = a.moe_options();
      const int64_t experts = active_only ? o.top_k : o.num_experts;
      ffn = experts * 3 * a.dim * o.hidden + a.dim * o.num_experts + 3 * a.dim * o.hidden * o.num_shared_experts;
    }
    layers += attn + ffn + 2 * a.dim;
  }
  return 2 * a.vocab_size * a.dim + layers + a.dim;  // embeddings, output (never tied), final norm
}
}  // namespace

int64_t num_params(const DeepSeekV3Args& a) { return count_params(a, false); }
int64_t num_active_params(const DeepSeekV3Args& a) { return count_params(a, true); }

double flops_per_token(const DeepSeekV3Args& a, int64_t seq_len) {
  const double dense = 6.0 * static_cast<double>(num_active_params(a) - a.vocab_size * a.dim);
  const double head_dims = static_cast<double>(a.qk_head_dim() + a.v_head_dim);
  return dense + 6.0 * static_cast<double>(a.n_layers * a.n_heads) * head_dims * static_cast<double>(seq_len);
}

// ---- multi-head latent attention ---------------------------------------------------------------------------

MLAImpl::MLAImpl(const DeepSeekV3Args& a)
    : q_lora_rank(a.q_lora_rank),
      kv_lora_rank(a.kv_lora_rank),
      qk_nope_head_dim(a.qk_nope_head_dim),
      qk_rope_head_dim(a.qk_rope_head_dim),
      v_head_dim(a.v_head_dim),
      softmax_scale(a.softmax_scale()) {
  TORCH_CHECK(a.n_heads > 0 && a.kv_lora_rank > 0 && a.qk_nope_head_dim >= 0 && a.v_head_dim > 0 &&
                  a.q_lora_rank >= 0,
              "deepseek_v3: n_heads, kv_lora_rank and v_head_dim must be positive, q_lora_rank and qk_nope_head_dim ",
              ">= 0; got ", a.n_heads, ", ", a.kv_lora_rank, ", ", a.v_head_dim, ", ", a.q_lora_rank, ", ",
              a.qk_nope_head_dim);
  TORCH_CHECK(a.qk_rope_head_dim > 0 && a.qk_rope_head_dim % 2 == 0, "deepseek_v3: qk_rope_head_dim ",
              a.qk_rope_head_dim, " must be positive and even (RoPE rotates pairs)");
  auto opts = at::TensorOptions().device(a.device).dtype(a.dtype);
  const int64_t H = a.n_heads;
  if (q_lora_rank == 0) {
    wq = register_module("wq", llama::Linear(a.dim, H * a.qk_head_dim(), opts));
  } else {
    wq_a = register_module("wq_a", llama::Linear(a.dim, q_lora_rank, opts));
    q_norm = register_module("q_norm", llama::RMSNorm(q_lora_rank, a.latent_norm_eps, opts));
    wq_b = register_module("wq_b", llama::Linear(q_lora_rank, H * a.qk_head_dim(), opts));
  }
  wkv_a = register_module("wkv_a", llama::Linear(a.dim, kv_lora_rank + qk_rope_head_dim, opts));
  kv_norm = register_module("kv_norm", llama::RMSNorm(kv_lora_rank, a.latent_norm_eps, opts));
  wkv_b = register_module("wkv_b", llama::Linear(kv_lora_rank, H * (qk_nope_head_dim + v_head_dim), opts));
  wo = register_module("wo", llama::Linear(H * v_head_dim, a.dim, opts));
}

at::Tensor MLAImpl::forward(const at::Tensor& x, const at::Tensor& rope_cos, const at::Tensor& rope_sin,
                            const AttentionMask& mask) {
  const int64_t bs = x.size(0), seq = x.size(1), qk_head_dim = qk_nope_head_dim + qk_rope_head_dim;
  using fsdp::nn::call;
  // Heads from the projections' outputs (-1): a tensor-parallel wrapper may give each rank a slice of them.
  at::Tensor q = q_lora_rank == 0 ? call(wq, x) : call(wq_b, call(q_norm, call(wq_a, x)));
  q = q.view({bs, seq, -1, qk_head_dim});
  auto q_nope = q.narrow(-1, 0, qk_nope_head_dim);
  auto q_pe = llama::apply_rope(q.narrow(-1, qk_nope_head_dim, qk_rope_head_dim), rope_cos, rope_sin);
  // The kv latent and the one RoPE key every head shares.
  const at::Tensor kv = call(wkv_a, x);
  const at::Tensor latent = kv.narrow(-1, 0, kv_lora_rank);
  auto k_pe = llama::apply_rope(kv.narrow(-1, kv_lora_rank, qk_rope_head_dim).unsqueeze(2), rope_cos, rope_sin);
  const at::Tensor kv_heads = call(wkv_b, call(kv_norm, latent)).view({bs, seq, -1, qk_nope_head_dim + v_head_dim});
  const int64_t heads = kv_heads.size(2);
  auto k_nope = kv_heads.narrow(-1, 0, qk_nope_head_dim);
  auto v = kv_heads.narrow(-1, qk_nope_head_dim, v_head_dim);
  auto qh = at::cat({q_nope, q_pe}, -1).transpose(1, 2);                                      // [B, H, S, qk]
  auto kh = at::cat({k_nope, k_pe.expand({bs, seq, heads, qk_rope_head_dim})}, -1).transpose(1, 2);
  auto vh = v.transpose(1, 2);                                                                   // [B, H, S, v]
  at::Tensor out;
  if (kernel) {
    out = kernel(qh, kh, vh, mask);
  } else if (mask) {
    TORCH_CHECK(mask->dim() == 4 && mask->size(2) == seq && mask->size(3) == seq, "deepseek_v3 attention: the mask ",
                mask->sizes(), " does not fit ", seq, " positions");
    out = at::scaled_dot_product_attention(qh, kh, vh, *mask, 0.0, /*is_causal=*/false, softmax_scale);
  } else {
    out = at::scaled_dot_product_attention(qh, kh, vh, /*attn_mask=*/{}, 0.0, /*is_causal=*/true, softmax_scale);
  }
  return call(wo, out.transpose(1, 2).reshape({bs, seq, -1}));
}

void MLAImpl::init_weights(double init_std, at::Generator& gen) {
  for (auto* l : {&wq, &wq_a, &wq_b, &wkv_a, &wkv_b}) {
    if (*l) llama::detail::trunc_normal_((*l)->weight(), 0.02, -2.0, 2.0, gen);
  }
  if (q_norm) q_norm->reset_parameters();
  kv_norm->reset_parameters();
  llama::detail::trunc_normal_(wo->weight(), init_std, -2.0, 2.0, gen);
}

// ---- blocks and model -----------------------------------------------------------------------------------------

TransformerBlockImpl::TransformerBlockImpl(int64_t id, const DeepSeekV3Args& a) : layer_id(id) {
  auto opts = at::TensorOptions().device(a.device).dtype(a.dtype);
  attention = register_module("attention", MLA(a));
  if (a.is_moe_layer(id)) {
    moe = register_module("moe", fsdp::models::moe::MoE(a.moe_options(), opts));
  } else {
    feed_forward = register_module("feed_forward", llama::FeedForward(a.dim, a.inter_dim, opts));
  }
  attention_norm = register_module("attention_norm", llama::RMSNorm(a.dim, a.norm_eps, opts));
  ffn_norm = register_module("ffn_norm", llama::RMSNorm(a.dim, a.norm_eps, opts));
  weight_init_std = a.depth_init ? 0.02 / std::sqrt(2.0 * static_cast<double>(id + 1))
                                 : 0.02 / std::sqrt(2.0 * static_cast<double>(a.n_layers));
}

at::Tensor TransformerBlockImpl::forward(const at::Tensor& x, const at::Tensor& rope_cos, const at::Tensor& rope_sin,
                                         const AttentionMask& mask) {
  using fsdp::nn::call;
  auto normed = call(attention_norm, x);
  auto h = x + (mask ? call(attention, normed, rope_cos, rope_sin, mask) : call(attention, normed, rope_cos, rope_sin));
  if (moe) return h + call(moe, call(ffn_norm, h));
  return h + call(feed_forward, call(ffn_norm, h));
}

void TransformerBlockImpl::init_weights(at::Generator& gen) {
  attention_norm->reset_parameters();
  ffn_norm->reset_parameters();
  attention->init_weights(weight_init_std, gen);
  if (moe) {
    moe->init_weights(gen, weight_init_std);
  } else {
    feed_forward->init_weights(weight_init_std, gen);
  }
}

DeepSeekV3Impl::DeepSeekV3Impl(DeepSeekV3Args a) : args_(std::move(a)) {
  TORCH_CHECK(args_.n_dense_layers >= 0 && args_.n_dense_layers <= args_.n_layers, "deepseek_v3: n_dense_layers ",
              args_.n_dense_layers, " must be in [0, n_layers = ", args_.n_layers, "]");
  auto opts = at::TensorOptions().device(args_.device).dtype(args_.dtype);
  tok_embeddings = register_module("tok_embeddings", llama::Embedding(args_.vocab_size, args_.dim, opts));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < args_.n_layers; ++i) {
    blocks_.emplace_back(i, args_);
    layers->push_back(blocks_.back());
  }
  norm = register_module("norm", llama::RMSNorm(args_.dim, args_.norm_eps, opts));
  output = register_module("output", llama::Linear(args_.dim, args_.vocab_size, opts));
}

std::pair<at::Tensor, at::Tensor> DeepSeekV3Impl::rope_tables(int64_t seq_len, c10::Device device) {
  if (!rope_cos_.defined() || rope_cos_.size(0) < seq_len || rope_cos_.device() != device) {
    auto [c, s] = llama::precompute_rope(args_.qk_rope_head_dim, std::max(seq_len, args_.max_seq_len),
                                         args_.rope_theta, args_.rope_scaling);
    rope_cos_ = c.to(device);
    rope_sin_ = s.to(device);
  }
  return {rope_cos_.slice(0, 0, seq_len), rope_sin_.slice(0, 0, seq_len)};
}

at::Tensor DeepSeekV3Impl::forward(const at::Tensor& tokens, const std::optional<at::Tensor>& document_ids) {
  TORCH_CHECK(tokens.dim() == 2, "deepseek_v3: tokens must be [batch, seq], got ", tokens.sizes());
  const bool block_causal = args_.attn_mask_type == llama::AttnMaskType::BlockCausal;
  TORCH_CHECK(block_causal == (document_ids.has_value() && document_ids->defined()), "deepseek_v3: ",
              block_causal ? "a block_causal model needs the tokens' document ids (fsdp::models::llama::document_ids)"
                           : "document ids given to a causal model (attn_mask_type is causal)");
  AttentionMask mask;
  if (block_causal) {
    TORCH_CHECK(document_ids->sizes() == tokens.sizes(), "deepseek_v3: document ids ", document_ids->sizes(),
                " do not match the tokens ", tokens.sizes());
    mask = document_mask ? document_mask(*document_ids) : llama::block_causal_mask(*document_ids);
  }
  auto h = fsdp::nn::call(tok_embeddings, tokens);
  auto [cos, sin] = rope_tables(tokens.size(1), h.device());
  if (rope_positions) {  // context parallel: this rank's chunks at their global positions
    const at::Tensor positions = rope_positions(tokens.size(1)).to(h.device());
    TORCH_CHECK(positions.dim() == 1 && positions.size(0) == tokens.size(1), "deepseek_v3: rope_positions gave ",
                positions.sizes(), " for ", tokens.size(1), " tokens");
    std::tie(cos, sin) = rope_tables(positions.max().item<int64_t>() + 1, h.device());
    cos = cos.index_select(0, positions);
    sin = sin.index_select(0, positions);
  }
  for (auto& block : blocks_) h = mask ? fsdp::nn::call(block, h, cos, sin, mask) : fsdp::nn::call(block, h, cos, sin);
  return fsdp::nn::call(output, fsdp::nn::call(norm, h));
}

void DeepSeekV3Impl::init_weights(uint64_t seed) {
  init_weights(seed, [](torch::nn::Module&, const std::function<void()>& fn) { fn(); });
}

void DeepSeekV3Impl::init_weights(uint64_t seed, const llama::TransformerImpl::InitScope& scope) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  fsdp::models::detail::MetaDrawSkipping skip_meta_parts(gen);  // as llama's: meta parts draw nothing
  scope(*tok_embeddings, [&] { llama::detail::normal_(tok_embeddings->weight(), 1.0, gen); });
  for (auto& block : blocks_) scope(*block, [&] { block->init_weights(gen); });
  scope(*norm, [&] { norm->reset_parameters(); });
  const double std = std::pow(static_cast<double>(args_.dim), -0.5);
  scope(*output, [&] { llama::detail::trunc_normal_(output->weight(), std, -3 * std, 3 * std, gen); });
}

}  // namespace fsdp::models::deepseek_v3
