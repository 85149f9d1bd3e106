// Llama 3 model (see include/fsdp/models/llama.h). Shapes and initialisation follow TorchTitan's llama3 model.
#include <fsdp/models/llama.h>
#include <fsdp/nn/module_call.h>

#include "models/model_init.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <cmath>

namespace fsdp::models::llama {

int64_t LlamaArgs::ffn_hidden_dim() const {
  if (explicit_ffn_hidden) return *explicit_ffn_hidden;
  // TorchTitan's FeedForward: hidden = int(2 * 4 * dim / 3); optional multiplier; round up to multiple_of.
  int64_t hidden = 4 * dim;
  hidden = static_cast<int64_t>(2 * hidden / 3);
  if (ffn_dim_multiplier) hidden = static_cast<int64_t>(*ffn_dim_multiplier * static_cast<double>(hidden));
  return multiple_of * ((hidden + multiple_of - 1) / multiple_of);
}

bool LlamaArgs::is_moe_layer(int64_t layer) const {
  if (!moe) return false;
  TORCH_CHECK(moe_layer_step >= 1, "llama: moe_layer_step (Hugging Face's decoder_sparse_step) must be >= 1, got ",
              moe_layer_step);
  for (int64_t d : dense_layers) {
    if (d == layer) return false;
  }
  return (layer + 1) % moe_layer_step == 0;
}

fsdp::models::moe::MoEOptions LlamaArgs::moe_options() const {
  TORCH_CHECK(moe, "llama: moe_options() of a model without MoE layers");
  fsdp::models::moe::MoEOptions o = *moe;
  if (o.dim == 0) o.dim = dim;
  TORCH_CHECK(o.dim == dim, "llama: the MoE layers' dim ", o.dim, " differs from the model's dim ", dim);
  return o;
}

namespace {
// Parameters of the model; with active_only, each MoE layer counts only the top_k routed experts a token passes
// through (its router gate and shared experts in full).
int64_t count_params(const LlamaArgs& a, bool active_only) {
  const int64_t hd = a.head_dim();
  const int64_t attn = a.dim * a.n_heads * hd + 2 * a.dim * a.kv_heads() * hd + a.n_heads * hd * a.dim +
                       (a.qk_norm ? 2 * hd : 0);
  int64_t layers = 0;
  for (int64_t i = 0; i < a.n_layers; ++i) {
    int64_t ffn = 0;
    if (a.is_moe_layer(i)) {
      const auto o = a.moe_options();
      const int64_t experts = active_only ? o.top_k : o.num_experts;
      ffn = experts * 3 * a.dim * o.hidden + a.dim * o.num_experts + 3 * a.dim * o.hidden * o.num_shared_experts;
    } else {
      ffn = 3 * a.dim * a.ffn_hidden_dim();
    }
    layers += attn + ffn + 2 * a.dim;
  }
  const int64_t output = a.tie_embeddings ? 0 : a.vocab_size * a.dim;
  return num_embedding_params(a) + layers + a.dim + output;
}
}  // namespace

int64_t num_embedding_params(const LlamaArgs& a) { return a.vocab_size * a.dim; }
int64_t num_params(const LlamaArgs& a) { return count_params(a, /*active_only=*/false); }
int64_t num_active_params(const LlamaArgs& a) { return count_params(a, /*active_only=*/true); }

double flops_per_token(const LlamaArgs& a, int64_t seq_len) {
  const double dense = 6.0 * static_cast<double>(num_active_params(a) - num_embedding_params(a));
  const double attention = 6.0 * a.n_layers * a.n_heads * a.head_dim() * static_cast<double>(seq_len);
  return dense + attention;
}

std::vector<std::string> llama3_flavor_names() {
  return {"cpu_tiny", "cpu_small", "cpu_medium", "debugmodel", "1B", "3B", "8B", "70B", "405B"};
}

LlamaArgs llama3_flavor(const std::string& name) {
  LlamaArgs a;
  a.rope_theta = 500000;
  a.n_kv_heads.reset();
  a.ffn_dim_multiplier.reset();
  if (name == "debugmodel") {  // TorchTitan's, unchanged (hidden 768; Llama 3.1 RoPE scaling since its PR #1839)
    a.dim = 256, a.n_layers = 6, a.n_heads = 16, a.vocab_size = 2048, a.multiple_of = 256;
    a.rope_scaling = RopeScaling{};
  } else if (name == "cpu_tiny") {  // unit tests: a forward in milliseconds
    a.dim = 64, a.n_layers = 2, a.n_heads = 4, a.n_kv_heads = 2, a.vocab_size = 2048, a.multiple_of = 64;
  } else if (name == "cpu_small") {  // the default trainer config: hundreds of steps in minutes on 2 cores
    a.dim = 128, a.n_layers = 4, a.n_heads = 4, a.n_kv_heads = 2, a.vocab_size = 2048, a.multiple_of = 128;
  } else if (name == "cpu_medium") {
    a.dim = 192, a.n_layers = 6, a.n_heads = 6, a.n_kv_heads = 2, a.vocab_size = 2048, a.multiple_of = 128;
  } else if (name == "1B") {  // Llama 3.2 1B. Meta's checkpoint scales RoPE by 32 (TorchTitan's flavor: 8)
    a.dim = 2048, a.n_layers = 16, a.n_heads = 32, a.n_kv_heads = 8, a.vocab_size = 128256;
    a.ffn_dim_multiplier = 1.5, a.multiple_of = 1024, a.tie_embeddings = true;
    a.rope_scaling = RopeScaling{}, a.rope_scaling->factor = 32.0;
  } else if (name == "3B") {  // Llama 3.2 3B (RoPE as 1B)
    a.dim = 3072, a.n_layers = 28, a.n_heads = 24, a.n_kv_heads = 8, a.vocab_size = 128256;
    a.ffn_dim_multiplier = 1.0, a.multiple_of = 1024, a.tie_embeddings = true;
    a.rope_scaling = RopeScaling{}, a.rope_scaling->factor = 32.0;
  } else if (name == "8B") {  // Llama 3.1 8B
    a.dim = 4096, a.n_layers = 32, a.n_heads = 32, a.n_kv_heads = 8, a.vocab_size = 128256;
    a.ffn_dim_multiplier = 1.3, a.multiple_of = 1024;
    a.rope_scaling = RopeScaling{};
  } else if (name == "70B") {  // Llama 3.1 70B
    a.dim = 8192, a.n_layers = 80, a.n_heads = 64, a.n_kv_heads = 8, a.vocab_size = 128256;
    a.ffn_dim_multiplier = 1.3, a.multiple_of = 4096;
    a.rope_scaling = RopeScaling{};
  } else if (name == "405B") {  // Llama 3.1 405B
    a.dim = 16384, a.n_layers = 126, a.n_heads = 128, a.n_kv_heads = 8, a.vocab_size = 128256;
    a.ffn_dim_multiplier = 1.2, a.multiple_of = 4096;
    a.rope_scaling = RopeScaling{};
  } else {
    std::string known;
    for (const auto& n : llama3_flavor_names()) known += (known.empty() ? "" : ", ") + n;
    TORCH_CHECK(false, "unknown llama3 flavor '", name, "' (known: ", known, ")");
  }
  return a;
}

// ---- building blocks --------------------------------------------------------------------------------------

LinearImpl::LinearImpl(int64_t in_features, int64_t out_features, const at::TensorOptions& options) {
  register_parameter("weight", at::empty({out_features, in_features}, options));
}
at::Tensor LinearImpl::forward(const at::Tensor& x) { return at::linear(x, weight()); }

EmbeddingImpl::EmbeddingImpl(int64_t num_embeddings, int64_t dim, const at::TensorOptions& options) {
  register_parameter("weight", at::empty({num_embeddings, dim}, options));
}
at::Tensor EmbeddingImpl::forward(const at::Tensor& tokens) { return at::embedding(weight(), tokens); }

RMSNormImpl::RMSNormImpl(int64_t dim, double eps_, const at::TensorOptions& options) : eps(eps_) {
  register_parameter("weight", at::ones({dim}, options));
}
at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  // Normalise in float32 (bf16 sums of squares lose too much), then scale in the input's dtype.
  auto xf = x.to(at::kFloat);
  auto normed = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return normed.to(x.scalar_type()) * weight();
}
void RMSNormImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  weight().fill_(1.0);
}

const char* rope_type_name(RopeScaling::Type type) {
  switch (type) {
    case RopeScaling::Type::Llama3: return "llama3";
    case RopeScaling::Type::Yarn: return "yarn";
    case RopeScaling::Type::Linear: return "linear";
  }
  return "?";
}

double rope_attention_factor(const std::optional<RopeScaling>& scaling) {
  if (!scaling || scaling->type != RopeScaling::Type::Yarn) return 1.0;
  const RopeScaling& s = *scaling;
  if (s.attention_factor) return *s.attention_factor;
  // transformers' _compute_yarn_parameters.get_mscale: 0.1 * mscale * ln(scale) + 1 above scale 1.
  auto get_mscale = [](double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
  if (s.mscale && s.mscale_all_dim && *s.mscale != 0 && *s.mscale_all_dim != 0) {
    return get_mscale(s.factor, *s.mscale) / get_mscale(s.factor, *s.mscale_all_dim);
  }
  return get_mscale(s.factor, 1.0);
}

namespace {

// transformers' _compute_yarn_parameters (modeling_rope_utils.py) on the plain frequencies.
at::Tensor yarn_frequencies(const at::Tensor& freqs, int64_t head_dim, double theta, const RopeScaling& s) {
  const double dim = static_cast<double>(head_dim);
  const double pi = std::acos(-1.0);
  // The dimension at which a frequency makes `rotations` turns in the original context.
  auto correction_dim = [&](double rotations) {
    return dim * std::log(static_cast<double>(s.original_max_position_embeddings) / (rotations * 2 * pi)) /
           (2 * std::log(theta));
  };
  double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
  if (s.truncate) low = std::floor(low), high = std::ceil(high);
  low = std::max(low, 0.0), high = std::min(high, dim - 1);
  if (low == high) high += 0.001;  // transformers: prevents a singularity
  const int64_t half = head_dim / 2;
  auto ramp = ((at::arange(half, freqs.options()) - low) / (high - low)).clamp(0.0, 1.0);
  auto extrapolation = 1.0 - ramp;  // weight of the unscaled frequency
  return freqs / s.factor * (1.0 - extrapolation) + freqs * extrapolation;
}

}  // namespace

at::Tensor rope_frequencies(int64_t head_dim, double theta, const std::optional<RopeScaling>& scaling) {
  // TorchTitan: freqs = 1 / theta^(arange(0, dim, 2)[: dim/2] / dim). In float64 (TorchTitan: float32), so the
  // tables are the exact values rounded once, whatever the device.
  auto opts = at::TensorOptions().dtype(at::kDouble);
  auto exponents = at::arange(0, head_dim, 2, opts).slice(0, 0, head_dim / 2) / static_cast<double>(head_dim);
  auto freqs = 1.0 / at::pow(theta, exponents);
  if (!scaling) return freqs;
  const RopeScaling& s = *scaling;
  TORCH_CHECK(s.factor > 0 && s.original_max_position_embeddings > 0, "llama: bad RoPE scaling (",
              rope_type_name(s.type), ", factor ", s.factor, ", original_max_position_embeddings ",
              s.original_max_position_embeddings, "): need factor > 0 and a positive context length");
  if (s.type == RopeScaling::Type::Linear) return freqs / s.factor;
  if (s.type == RopeScaling::Type::Yarn) return yarn_frequencies(freqs, head_dim, theta, s);
  TORCH_CHECK(s.high_freq_factor > s.low_freq_factor, "llama: bad RoPE scaling (llama3, low_freq_factor ",
              s.low_freq_factor, ", high_freq_factor ", s.high_freq_factor, "): need high > low");
  // Llama 3.1: long wavelengths (low frequencies) are stretched by `factor`, short ones kept, the band between
  // blended linearly in original_context / wavelength.
  const double context = static_cast<double>(s.original_max_position_embeddings);
  const double low_freq_wavelen = context / s.low_freq_factor, high_freq_wavelen = context / s.high_freq_factor;
  auto wavelen = 2.0 * std::acos(-1.0) / freqs;
  auto smooth = (context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  auto smoothed = (1.0 - smooth) * freqs / s.factor + smooth * freqs;
  auto scaled = at::where(wavelen > low_freq_wavelen, freqs / s.factor, freqs);
  auto medium = wavelen.ge(high_freq_wavelen).logical_and(wavelen.le(low_freq_wavelen));
  return at::where(medium, smoothed, scaled);
}

std::pair<at::Tensor, at::Tensor> precompute_rope(int64_t head_dim, int64_t seq_len, double theta,
                                                  const std::optional<RopeScaling>& scaling) {
  auto freqs = rope_frequencies(head_dim, theta, scaling);
  auto angles = at::outer(at::arange(seq_len, freqs.options()), freqs);
  // YaRN's attention factor scales q and k through their rotation (transformers: cos/sin * attention_scaling).
  const double m = rope_attention_factor(scaling);
  return {(angles.cos() * m).to(at::kFloat), (angles.sin() * m).to(at::kFloat)};
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, RopeLayout layout) {
  const auto sizes = x.sizes();
  if (layout == RopeLayout::HalfSplit) {
    // Pairs (x[i], x[i + D/2]): rotate_half's x * cos + (-x2, x1) * sin, per half.
    auto xf = x.to(at::kFloat);
    auto x1 = xf.narrow(-1, 0, sizes[3] / 2), x2 = xf.narrow(-1, sizes[3] / 2, sizes[3] / 2);
    auto c = cos.view({1, sizes[1], 1, sizes[3] / 2});
    auto s = sin.view({1, sizes[1], 1, sizes[3] / 2});
    return at::cat({x1 * c - x2 * s, x2 * c + x1 * s}, -1).to(x.scalar_type());
  }
  // x: [B, S, H, D] viewed as D/2 complex numbers (re, im) = (x[2i], x[2i+1]); multiply by e^{i*angle}.
  auto xf = x.to(at::kFloat).reshape({sizes[0], sizes[1], sizes[2], sizes[3] / 2, 2});
  auto re = xf.select(-1, 0), im = xf.select(-1, 1);
  auto c = cos.view({1, sizes[1], 1, sizes[3] / 2});
  auto s = sin.view({1, sizes[1], 1, sizes[3] / 2});
  auto out = at::stack({re * c - im * s, re * s + im * c}, -1);
  return out.flatten(3).to(x.scalar_type());
}

// A truncated normal N(0, std) cut at [a, b], drawn on the CPU from `gen` and copied into `param`. It samples by
// inverse CDF (uniform in [cdf(a), cdf(b)], then erfinv), the algorithm torch.nn.init.trunc_normal_ used before
// PyTorch switched to rejection sampling (torch 2.13's _no_grad_trunc_normal_ redraws normals outside [a, b], or
// accepts uniform proposals by the density for narrow cuts). Same distribution, different numbers: our init
// matches TorchTitan's in law, not bit for bit, for the same seed.
void detail::trunc_normal_(at::Tensor& param, double std, double a, double b, at::Generator& gen) {
  // uniform_ on a float CPU tensor: one 32-bit output an element.
  if (fsdp::models::detail::MetaDrawSkipping::skip_draw(param, static_cast<uint64_t>(param.numel()), gen)) return;
  auto norm_cdf = [](double v) { return (1.0 + std::erf(v / std::sqrt(2.0))) / 2.0; };
  const double lo = norm_cdf(a / std), hi = norm_cdf(b / std);
  auto t = at::empty(param.sizes(), at::TensorOptions().dtype(at::kFloat));
  t.uniform_(2 * lo - 1, 2 * hi - 1, gen);
  t.erfinv_().mul_(std * std::sqrt(2.0)).clamp_(a, b);
  torch::NoGradGuard no_grad;
  param.copy_(t);
}

std::optional<uint64_t> detail::normal_fill_outputs(int64_t numel) {
  if (numel < 16) return std::nullopt;
  return static_cast<uint64_t>(numel) + (numel % 16 != 0 ? 16 : 0);
}

void detail::normal_(at::Tensor& param, double std, at::Generator& gen) {
  if (fsdp::models::detail::MetaDrawSkipping::skip_draw(param, normal_fill_outputs(param.numel()), gen)) return;
  auto t = at::empty(param.sizes(), at::TensorOptions().dtype(at::kFloat));
  t.normal_(0.0, std, gen);
  torch::NoGradGuard no_grad;
  param.copy_(t);
}


AttentionImpl::AttentionImpl(const LlamaArgs& a)
    : n_heads(a.n_heads), n_kv_heads(a.kv_heads()), head_dim(a.head_dim()), rope_layout(a.rope_layout) {
  TORCH_CHECK(a.explicit_head_dim || a.dim % a.n_heads == 0, "llama: dim ", a.dim, " is not divisible by n_heads ",
              a.n_heads);
  TORCH_CHECK(head_dim > 0, "llama: head_dim must be positive, got ", head_dim);
  TORCH_CHECK(n_heads % n_kv_heads == 0, "llama: n_heads ", n_heads, " is not divisible by n_kv_heads ", n_kv_heads);
  TORCH_CHECK(head_dim % 2 == 0, "llama: head_dim ", head_dim, " must be even for RoPE");
  auto opts = at::TensorOptions().device(a.device).dtype(a.dtype);
  wq = register_module("wq", Linear(a.dim, n_heads * head_dim, opts));
  wk = register_module("wk", Linear(a.dim, n_kv_heads * head_dim, opts));
  wv = register_module("wv", Linear(a.dim, n_kv_heads * head_dim, opts));
  wo = register_module("wo", Linear(n_heads * head_dim, a.dim, opts));
  if (a.qk_norm) {
    q_norm = register_module("q_norm", RMSNorm(head_dim, a.norm_eps, opts));
    k_norm = register_module("k_norm", RMSNorm(head_dim, a.norm_eps, opts));
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> AttentionImpl::qkv(const at::Tensor& x, const at::Tensor& rope_cos,
                                                                  const at::Tensor& rope_sin, bool hooked) {
  const int64_t bs = x.size(0), seq = x.size(1);
  auto run = [hooked](auto& module, const at::Tensor& in) { return hooked ? fsdp::nn::call(module, in) : module(in); };
  // Head counts come from the projections' outputs (-1), as in TorchTitan: a tensor-parallel wrapper may give
  // each rank a slice of the heads.
  auto xq = run(wq, x).view({bs, seq, -1, head_dim});
  auto xk = run(wk, x).view({bs, seq, -1, head_dim});
  auto xv = run(wv, x).view({bs, seq, -1, head_dim});
  if (q_norm) {  // Qwen3: per head, before RoPE
    xq = run(q_norm, xq);
    xk = run(k_norm, xk);
  }
  return {apply_rope(xq, rope_cos, rope_sin, rope_layout), apply_rope(xk, rope_cos, rope_sin, rope_layout), xv};
}

at::Tensor document_ids(const at::Tensor& tokens, int64_t eos_id) {
  TORCH_CHECK(tokens.dim() == 2 && !at::isFloatingType(tokens.scalar_type()),
              "llama document_ids: tokens must be integer [batch, seq], got ", tokens.scalar_type(), " ", tokens.sizes());
  // Exclusive cumulative count of EOS: position t's id counts the EOS strictly before it.
  auto eos = tokens.eq(eos_id).to(at::kLong);
  return eos.cumsum(1) - eos;
}

at::Tensor block_causal_mask(const at::Tensor& ids) {
  TORCH_CHECK(ids.dim() == 2, "llama block_causal_mask: document ids must be [batch, seq], got ", ids.sizes());
  const int64_t seq = ids.size(1);
  auto same_document = ids.unsqueeze(2).eq(ids.unsqueeze(1));  // [B, S(q), S(k)]
  auto causal = at::ones({seq, seq}, ids.options().dtype(at::kBool)).tril();
  return same_document.logical_and_(causal).unsqueeze(1);
}

AttentionMask attention_mask_for(const LlamaArgs& args, const std::optional<at::Tensor>& ids, const char* who) {
  const bool block_causal = args.attn_mask_type == AttnMaskType::BlockCausal;
  TORCH_CHECK(block_causal == (ids.has_value() && ids->defined()), who, ": ",
              block_causal ? "a block_causal model needs the tokens' document ids (fsdp::models::llama::document_ids)"
                           : "document ids given to a causal model (attn_mask_type is causal)");
  if (!block_causal) return std::nullopt;
  return block_causal_mask(*ids);
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, const at::Tensor& rope_cos, const at::Tensor& rope_sin,
                                  const AttentionMask& mask) {
  const int64_t bs = x.size(0), seq = x.size(1);
  auto [xq, xk, xv] = qkv(x, rope_cos, rope_sin, /*hooked=*/true);
  const int64_t n_rep = xq.size(2) / xk.size(2);
  if (n_rep > 1) {  // grouped-query attention: each kv head serves n_rep query heads (TorchTitan's repeat_kv)
    xk = xk.repeat_interleave(n_rep, /*dim=*/2);
    xv = xv.repeat_interleave(n_rep, /*dim=*/2);
  }
  auto q = xq.transpose(1, 2), k = xk.transpose(1, 2), v = xv.transpose(1, 2);  // [B, H, S, D]
  at::Tensor out;
  if (kernel) {
    out = kernel(q, k, v, mask);
  } else if (mask) {  // block_causal: the mask holds the causal structure too (every row sees at least its own position)
    TORCH_CHECK(mask->dim() == 4 && mask->size(2) == q.size(2) && mask->size(3) == k.size(2),
                "llama attention: the mask ", mask->sizes(), " does not fit ", q.size(2), " queries and ", k.size(2),
                " keys");
    out = at::scaled_dot_product_attention(q, k, v, *mask, /*dropout_p=*/0.0, /*is_causal=*/false);
  } else {
    out = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
  }
  return fsdp::nn::call(wo, out.transpose(1, 2).reshape({bs, seq, -1}));
}

at::Tensor AttentionImpl::forward_cached(const at::Tensor& x, const at::Tensor& rope_cos, const at::Tensor& rope_sin,
                                         at::Tensor& cache_k, at::Tensor& cache_v, int64_t start) {
  const int64_t bs = x.size(0), seq = x.size(1), end = start + seq;
  TORCH_CHECK(end <= cache_k.size(1), "llama: KV cache holds ", cache_k.size(1), " positions, need ", end);
  auto [xq, xk, xv] = qkv(x, rope_cos, rope_sin, /*hooked=*/false);
  cache_k.slice(1, start, end).copy_(xk);
  cache_v.slice(1, start, end).copy_(xv);
  auto keys = cache_k.slice(1, 0, end), values = cache_v.slice(1, 0, end);
  const int64_t n_rep = n_heads / n_kv_heads;
  if (n_rep > 1) {
    keys = keys.repeat_interleave(n_rep, /*dim=*/2);
    values = values.repeat_interleave(n_rep, /*dim=*/2);
  }
  auto q = xq.transpose(1, 2), k = keys.transpose(1, 2), v = values.transpose(1, 2);  // [B, H, S or end, D]
  at::Tensor out;
  if (seq == 1) {  // one new position sees every cached one
    out = at::scaled_dot_product_attention(q, k, v);
  } else {  // query i (position start + i) sees keys [0, start + i]
    auto allowed = at::ones({seq, end}, at::TensorOptions().dtype(at::kBool).device(x.device())).tril(start);
    out = at::scaled_dot_product_attention(q, k, v, allowed);
  }
  return wo(out.transpose(1, 2).reshape({bs, seq, n_heads * head_dim}));
}

void AttentionImpl::init_weights(double init_std, at::Generator& gen) {
  for (auto* l : {&wq, &wk, &wv}) detail::trunc_normal_((*l)->weight(), 0.02, -2.0, 2.0, gen);
  detail::trunc_normal_(wo->weight(), init_std, -2.0, 2.0, gen);
  if (q_norm) {
    q_norm->reset_parameters();
    k_norm->reset_parameters();
  }
}

FeedForwardImpl::FeedForwardImpl(int64_t dim, int64_t hidden, const at::TensorOptions& opts) {
  w1 = register_module("w1", Linear(dim, hidden, opts));
  w2 = register_module("w2", Linear(hidden, dim, opts));
  w3 = register_module("w3", Linear(dim, hidden, opts));
}

at::Tensor FeedForwardImpl::forward(const at::Tensor& x) {
  return fsdp::nn::call(w2, at::silu(fsdp::nn::call(w1, x)) * fsdp::nn::call(w3, x));
}

void FeedForwardImpl::init_weights(double init_std, at::Generator& gen) {
  detail::trunc_normal_(w1->weight(), 0.02, -2.0, 2.0, gen);
  detail::trunc_normal_(w2->weight(), init_std, -2.0, 2.0, gen);
  detail::trunc_normal_(w3->weight(), init_std, -2.0, 2.0, gen);
}

TransformerBlockImpl::TransformerBlockImpl(int64_t id, const LlamaArgs& a) : layer_id(id) {
  auto opts = at::TensorOptions().device(a.device).dtype(a.dtype);
  attention = register_module("attention", Attention(a));
  if (a.is_moe_layer(id)) {
    moe = register_module("moe", fsdp::models::moe::MoE(a.moe_options(), opts));
  } else {
    feed_forward = register_module("feed_forward", FeedForward(a.dim, a.ffn_hidden_dim(), opts));
  }
  attention_norm = register_module("attention_norm", RMSNorm(a.dim, a.norm_eps, opts));
  ffn_norm = register_module("ffn_norm", RMSNorm(a.dim, a.norm_eps, opts));
  weight_init_std = a.depth_init ? 0.02 / std::sqrt(2.0 * static_cast<double>(id + 1))
                                 : 0.02 / std::sqrt(2.0 * static_cast<double>(a.n_layers));
}

at::Tensor TransformerBlockImpl::forward(const at::Tensor& x, const at::Tensor& rope_cos, const at::Tensor& rope_sin,
                                         const AttentionMask& mask) {
  // Without a mask the attention keeps its three-argument call (what hooks and TP input styles saw before).
  auto normed = fsdp::nn::call(attention_norm, x);
  auto h = x + (mask ? fsdp::nn::call(attention, normed, rope_cos, rope_sin, mask)
                     : fsdp::nn::call(attention, normed, rope_cos, rope_sin));
  if (moe) return h + fsdp::nn::call(moe, fsdp::nn::call(ffn_norm, h));
  return h + fsdp::nn::call(feed_forward, fsdp::nn::call(ffn_norm, h));
}

at::Tensor TransformerBlockImpl::forward_cached(const at::Tensor& x, const at::Tensor& rope_cos,
                                                const at::Tensor& rope_sin, at::Tensor& cache_k, at::Tensor& cache_v,
                                                int64_t start) {
  auto h = x + attention->forward_cached(attention_norm(x), rope_cos, rope_sin, cache_k, cache_v, start);
  return h + (moe ? moe(ffn_norm(h)) : feed_forward(ffn_norm(h)));
}

void TransformerBlockImpl::init_weights(at::Generator& gen) {
  attention_norm->reset_parameters();
  ffn_norm->reset_parameters();
  attention->init_weights(weight_init_std, gen);
  // MoE: one std for the gate and every expert (MoE::init_weights); the depth-scaled one, which TorchTitan's
  // Qwen3 gives the gate, w2 and w3 (its w1 keeps 0.02).
  if (moe) {
    moe->init_weights(gen, weight_init_std);
  } else {
    feed_forward->init_weights(weight_init_std, gen);
  }
}

TransformerImpl::TransformerImpl(LlamaArgs a) : args_(std::move(a)) {
  auto opts = at::TensorOptions().device(args_.device).dtype(args_.dtype);
  tok_embeddings = register_module("tok_embeddings", Embedding(args_.vocab_size, args_.dim, opts));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < args_.n_layers; ++i) {
    blocks_.emplace_back(i, args_);
    layers->push_back(blocks_.back());
  }
  norm = register_module("norm", RMSNorm(args_.dim, args_.norm_eps, opts));
  if (!args_.tie_embeddings) {
    // Tied: no output layer. One tensor under two names would appear twice in parameters() (libtorch does not
    // de-duplicate), so the optimizer would step it twice; forward() uses tok_embeddings.weight instead.
    output = register_module("output", Linear(args_.dim, args_.vocab_size, opts));
  }
}

std::pair<at::Tensor, at::Tensor> TransformerImpl::rope_tables(int64_t seq_len, c10::Device device) {
  if (!rope_cos_.defined() || rope_cos_.size(0) < seq_len || rope_cos_.device() != device) {
    auto [c, s] = precompute_rope(args_.head_dim(), std::max(seq_len, args_.max_seq_len), args_.rope_theta,
                                  args_.rope_scaling);
    rope_cos_ = c.to(device);
    rope_sin_ = s.to(device);
  }
  return {rope_cos_.slice(0, 0, seq_len), rope_sin_.slice(0, 0, seq_len)};
}

at::Tensor TransformerImpl::forward(const at::Tensor& tokens, const std::optional<at::Tensor>& document_ids) {
  TORCH_CHECK(tokens.dim() == 2, "llama: tokens must be [batch, seq], got ", tokens.sizes());
  const bool given_ids = document_ids.has_value() && document_ids->defined();
  if (given_ids) {
    TORCH_CHECK(document_ids->sizes() == tokens.sizes(), "llama: document ids ", document_ids->sizes(),
                " do not match the tokens ", tokens.sizes());
  }
  const AttentionMask mask = document_mask && given_ids && args_.attn_mask_type == AttnMaskType::BlockCausal
                                 ? AttentionMask(document_mask(*document_ids))
                                 : attention_mask_for(args_, document_ids, "llama");
  auto h = fsdp::nn::call(tok_embeddings, tokens);
  auto [cos, sin] = rope_tables(tokens.size(1), h.device());
  if (rope_positions) {
    const at::Tensor positions = rope_positions(tokens.size(1)).to(h.device());
    TORCH_CHECK(positions.dim() == 1 && positions.size(0) == tokens.size(1), "llama: rope_positions gave ",
                positions.sizes(), " for ", tokens.size(1), " tokens");
    std::tie(cos, sin) = rope_tables(positions.max().item<int64_t>() + 1, h.device());
    cos = cos.index_select(0, positions);
    sin = sin.index_select(0, positions);
  }
  for (auto& block : blocks_) h = mask ? fsdp::nn::call(block, h, cos, sin, mask) : fsdp::nn::call(block, h, cos, sin);
  h = fsdp::nn::call(norm, h);
  if (args_.tie_embeddings) return at::linear(h, tok_embeddings->weight());
  return fsdp::nn::call(output, h);
}

KVCache TransformerImpl::make_kv_cache(int64_t batch, int64_t capacity) const {
  const auto& w = tok_embeddings->weight();
  KVCache cache;
  for (int64_t i = 0; i < args_.n_layers; ++i) {
    cache.keys.push_back(at::zeros({batch, capacity, args_.kv_heads(), args_.head_dim()}, w.options()));
    cache.values.push_back(at::zeros({batch, capacity, args_.kv_heads(), args_.head_dim()}, w.options()));
  }
  return cache;
}

at::Tensor TransformerImpl::forward_cached(const at::Tensor& tokens, KVCache& cache) {
  TORCH_CHECK(tokens.dim() == 2, "llama: tokens must be [batch, seq], got ", tokens.sizes());
  TORCH_CHECK(static_cast<int64_t>(cache.keys.size()) == args_.n_layers, "llama: KV cache has ", cache.keys.size(),
              " layers, the model ", args_.n_layers);
  const int64_t start = cache.length, end = start + tokens.size(1);
  auto h = tok_embeddings(tokens);
  auto [cos, sin] = rope_tables(end, h.device());
  cos = cos.slice(0, start, end);
  sin = sin.slice(0, start, end);
  for (size_t i = 0; i < blocks_.size(); ++i)
    h = blocks_[i]->forward_cached(h, cos, sin, cache.keys[i], cache.values[i], start);
  cache.length = end;
  h = norm(h);
  if (args_.tie_embeddings) return at::linear(h, tok_embeddings->weight());
  return output(h);
}

void TransformerImpl::init_weights(uint64_t seed) {
  init_weights(seed, [](torch::nn::Module&, const std::function<void()>& fn) { fn(); });
}

void TransformerImpl::init_weights(uint64_t seed, const InitScope& scope) {
  // One generator drawn in a fixed order: the same numbers whatever the scope does around each part. Parts left on
  // meta (other pipeline ranks' stages) draw nothing; the generator jumps past their numbers.
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  fsdp::models::detail::MetaDrawSkipping skip_meta_parts(gen);
  scope(*tok_embeddings, [&] { detail::normal_(tok_embeddings->weight(), 1.0, gen); });
  for (auto& block : blocks_) scope(*block, [&] { block->init_weights(gen); });
  scope(*norm, [&] { norm->reset_parameters(); });
  if (!args_.tie_embeddings) {
    const double std = std::pow(static_cast<double>(args_.dim), -0.5);
    scope(*output, [&] { detail::trunc_normal_(output->weight(), std, -3 * std, 3 * std, gen); });
  }
}

}  // namespace fsdp::models::llama
