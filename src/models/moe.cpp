#include <fsdp/models/moe.h>

#include <fsdp/activation_checkpoint.h>
#include <fsdp/nn/module_call.h>

#include "models/model_init.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/functional/activation.h>

#include <cmath>
#include <limits>

namespace fsdp::models::moe {
namespace {

// Identity on the block's output whose backward also hands `scale` to the balance loss (d(scale * aux)/d(aux)):
// the loss's gradient enters the router through the graph the backward runs, so under activation checkpointing
// it comes from the recomputation, once (TorchTitan's MoE layer does the same with a custom autograd function).
struct TieAuxLoss : torch::autograd::Function<TieAuxLoss> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& out, const at::Tensor& aux,
                            double scale) {
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["aux_dtype"] = static_cast<int64_t>(aux.scalar_type());
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const double scale = ctx->saved_data["scale"].toDouble();
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["aux_dtype"].toInt());
    at::Tensor aux_grad = at::full({}, scale, grads[0].options().dtype(dtype));
    return {grads[0], aux_grad, at::Tensor()};
  }
};

void check_options(const MoEOptions& o) {
  TORCH_CHECK(o.dim > 0 && o.hidden > 0, "moe: dim and hidden must be positive, got ", o.dim, " and ", o.hidden);
  TORCH_CHECK(o.num_experts >= 1, "moe: num_experts must be >= 1, got ", o.num_experts);
  TORCH_CHECK(o.top_k >= 1 && o.top_k <= o.num_experts, "moe: top_k must be in [1, num_experts = ", o.num_experts,
              "], got ", o.top_k);
  TORCH_CHECK(o.score_func == "sigmoid" || o.score_func == "softmax", "moe: score_func must be \"sigmoid\" or ",
              "\"softmax\", got \"", o.score_func, "\"");
  if (o.num_expert_groups > 0) {
    TORCH_CHECK(o.num_experts % o.num_expert_groups == 0 && o.num_experts / o.num_expert_groups >= 2,
                "moe: num_expert_groups = ", o.num_expert_groups, " must divide num_experts = ", o.num_experts,
                " into groups of at least 2 experts");
    TORCH_CHECK(o.num_limited_groups >= 1 && o.num_limited_groups <= o.num_expert_groups, "moe: num_limited_groups ",
                "must be in [1, num_expert_groups = ", o.num_expert_groups, "], got ", o.num_limited_groups);
    TORCH_CHECK(o.top_k <= o.num_limited_groups * (o.num_experts / o.num_expert_groups), "moe: top_k = ", o.top_k,
                " exceeds the experts of ", o.num_limited_groups, " limited groups");
  }
  TORCH_CHECK(o.num_shared_experts >= 0, "moe: num_shared_experts must be >= 0, got ", o.num_shared_experts);
  // at::_grouped_mm needs 16-byte row strides: 4 fp32 or 8 bf16 elements.
  TORCH_CHECK(!o.use_grouped_mm || (o.dim % 8 == 0 && o.hidden % 8 == 0), "moe: grouped GEMM needs dim and hidden ",
              "to be multiples of 8 (16-byte rows in bf16), got ", o.dim, " and ", o.hidden,
              "; use such sizes or use_grouped_mm = false");
}

void trunc_normal(at::Tensor& t, double std, at::Generator& gen) {
  if (fsdp::models::detail::MetaDrawSkipping::skip_draw(t, llama::detail::normal_fill_outputs(t.numel()), gen)) return;
  at::NoGradGuard no_grad;
  at::Tensor v = at::empty(t.sizes(), t.options().device(at::kCPU).dtype(at::kFloat));
  v.normal_(0.0, std, gen);
  v.clamp_(-2 * std, 2 * std);
  t.copy_(v);
}

// The shared experts: one SwiGLU on every token, w2(silu(w1 x) * w3 x), Linear layers without bias. A module with
// its own forward, called through fsdp::nn::call with the block's input in its original shape [..., S, D], so that
// a tensor-parallel plan can treat it as a dense feed-forward (w1/w3 colwise, w2 rowwise) and gather its
// sequence-sharded input.
class SharedExpertsImpl : public torch::nn::Module {
 public:
  SharedExpertsImpl(int64_t dim, int64_t hidden, const at::TensorOptions& options)
      : torch::nn::Module("SharedExperts") {
    w1 = register_module("w1", Projection(dim, hidden, options));
    w2 = register_module("w2", Projection(hidden, dim, options));
    w3 = register_module("w3", Projection(dim, hidden, options));
  }
  at::Tensor forward(const at::Tensor& x) {
    // Through call(): the plan's hooks sit on the projections.
    return fsdp::nn::call(w2, at::silu(fsdp::nn::call(w1, x)) * fsdp::nn::call(w3, x));
  }
  Projection w1{nullptr}, w2{nullptr}, w3{nullptr};
};

}  // namespace

ProjectionImpl::ProjectionImpl(int64_t in_features, int64_t out_features, const at::TensorOptions& options)
    : torch::nn::Module("Projection") {
  weight = register_parameter("weight", at::empty({out_features, in_features}, options));
}

at::Tensor ProjectionImpl::forward(const at::Tensor& x) { return at::linear(x, weight); }

TokenChoiceRouterImpl::TokenChoiceRouterImpl(const MoEOptions& options, const at::TensorOptions& tensor_options)
    : options_(options) {
  check_options(options_);
  gate = register_module("gate", Projection(options_.dim, options_.num_experts, tensor_options));
}

Routing TokenChoiceRouterImpl::forward(const at::Tensor& x, const at::Tensor& expert_bias) {
  Routing r;
  const at::Tensor logits = fsdp::nn::call(gate, x).to(at::kFloat);
  r.scores = options_.score_func == "sigmoid" ? at::sigmoid(logits) : at::softmax(logits, -1);
  // The bias steers the choice only; the weights are the original scores of the chosen experts.
  at::Tensor choice = expert_bias.defined() ? r.scores.detach() + expert_bias : r.scores.detach();
  if (options_.num_expert_groups > 0) {
    // Group-limited routing: rank the groups by the sum of their two best choice scores, keep the best
    // num_limited_groups, and choose experts only there (the others' scores -inf).
    const int64_t T = choice.size(0), G = options_.num_expert_groups;
    const at::Tensor grouped = choice.view({T, G, -1});
    const at::Tensor group_scores = std::get<0>(at::topk(grouped, 2, /*dim=*/-1)).sum(-1);  // [T, G]
    const at::Tensor keep = std::get<1>(at::topk(group_scores, options_.num_limited_groups, /*dim=*/-1));
    const at::Tensor group_mask = at::ones({T, G}, choice.options().dtype(at::kBool)).scatter_(1, keep, false);
    choice = grouped.masked_fill(group_mask.unsqueeze(-1), -std::numeric_limits<double>::infinity()).view({T, -1});
  }
  r.expert_ids = std::get<1>(at::topk(choice, options_.top_k, /*dim=*/-1, /*largest=*/true, /*sorted=*/true));
  r.weights = r.scores.gather(-1, r.expert_ids);
  if (options_.route_norm) r.weights = r.weights / (r.weights.sum(-1, /*keepdim=*/true) + 1e-20);
  if (options_.route_scale != 1.0) r.weights = r.weights * options_.route_scale;
  return r;
}

GroupedExpertsImpl::GroupedExpertsImpl(const MoEOptions& options, const at::TensorOptions& tensor_options)
    : use_grouped_mm_(options.use_grouped_mm) {
  check_options(options);
  const int64_t E = options.num_experts, F = options.hidden, D = options.dim;
  w1 = register_parameter("w1", at::empty({E, F, D}, tensor_options));
  w2 = register_parameter("w2", at::empty({E, D, F}, tensor_options));
  w3 = register_parameter("w3", at::empty({E, F, D}, tensor_options));
}

at::Tensor GroupedExpertsImpl::forward(const at::Tensor& x, const at::Tensor& counts) {
  TORCH_CHECK(counts.dim() == 1 && counts.size(0) == w1.size(0), "moe: the experts hold ", w1.size(0),
              " experts but got counts of shape ", counts.sizes());
  if (use_grouped_mm_) {
    // Rows [offs[e-1], offs[e]) use expert e; empty groups are fine (torch 2.13's CPU kernel, measured).
    const at::Tensor offs = counts.cumsum(0).to(at::kInt);
    auto gmm = [&](const at::Tensor& a, const at::Tensor& w) { return at::_grouped_mm(a, w.transpose(-2, -1), offs); };
    const at::Tensor h = at::silu(gmm(x, w1)) * gmm(x, w3);
    return gmm(h, w2);
  }
  // The per-expert loop: one set of matmuls per expert that received tokens. unbind (not w1[e]): its backward
  // stacks the experts' gradients once, where indexing would build a full-size zero gradient per expert.
  std::vector<at::Tensor> outs;
  const at::Tensor sizes = counts.to(at::kLong).cpu().contiguous();
  const int64_t* n_of = sizes.data_ptr<int64_t>();
  const std::vector<at::Tensor> w1s = w1.unbind(0), w2s = w2.unbind(0), w3s = w3.unbind(0);
  int64_t start = 0;
  for (int64_t e = 0; e < sizes.size(0); ++e) {
    const int64_t n = n_of[e];
    if (n == 0) continue;
    const at::Tensor xe = x.narrow(0, start, n);
    const at::Tensor h = at::silu(at::matmul(xe, w1s[e].t())) * at::matmul(xe, w3s[e].t());
    outs.push_back(at::matmul(h, w2s[e].t()));
    start += n;
  }
  return outs.empty() ? at::zeros_like(x) : at::cat(outs, 0);
}

MoEImpl::MoEImpl(const MoEOptions& options, const at::TensorOptions& tensor_options) : options_(options) {
  check_options(options_);
  router = register_module("router", TokenChoiceRouter(options_, tensor_options));
  experts = register_module("experts", GroupedExperts(options_, tensor_options));
  if (options_.num_shared_experts > 0) {
    shared_experts = register_module("shared_experts",
                                     std::make_shared<SharedExpertsImpl>(
                                         options_.dim, options_.hidden * options_.num_shared_experts, tensor_options));
  }
  if (options_.load_balance_coeff) {
    expert_bias = register_buffer("expert_bias", at::zeros({options_.num_experts}, tensor_options.dtype(at::kFloat)));
  }
  tokens_per_expert_ = at::zeros({options_.num_experts});
}

at::Tensor MoEImpl::forward(const at::Tensor& input) {
  TORCH_CHECK(input.size(-1) == options_.dim, "moe: input has ", input.size(-1), " features, the block ", options_.dim);
  const at::Tensor x = input.reshape({-1, options_.dim});
  const int64_t T = x.size(0), k = options_.top_k, E = options_.num_experts;
  const Routing r = router->forward(x, expert_bias);
  // Every (token, choice) slot sorted by expert (stable: tokens keep their order inside an expert's group).
  const at::Tensor flat_ids = r.expert_ids.reshape({-1});
  const at::Tensor order = at::argsort(flat_ids, /*stable=*/true);
  const at::Tensor token_of_slot = at::floor_divide(order, k);
  const at::Tensor counts = at::bincount(flat_ids, /*weights=*/{}, /*minlength=*/E);
  // Counted once per training forward: in a forward that records a graph or in activation checkpointing's first
  // pass (full AC runs it without gradients, op-level SAC with them), never in the recomputation its backward
  // runs. A no-grad forward outside checkpointing (evaluation) counts nothing.
  const CheckpointPass pass = current_checkpoint_pass();
  if (is_training() && pass != CheckpointPass::Recompute &&
      (at::GradMode::is_enabled() || pass == CheckpointPass::Forward)) {
    at::NoGradGuard no_grad;
    if (tokens_per_expert_.device() != counts.device()) tokens_per_expert_ = tokens_per_expert_.to(counts.device());
    tokens_per_expert_.add_(counts.to(tokens_per_expert_.scalar_type()));
  }
  aux_loss_ = at::Tensor();
  if (is_training() && options_.sequence_aux_loss_coeff) {
    // Sequences are the leading dims of the input up to the last two ([B, S, D]: B sequences of S tokens; a
    // [T, D] input is one sequence).
    const int64_t S = input.dim() >= 3 ? input.size(-2) : T;
    const int64_t B = T / S;
    const at::Tensor chosen = at::zeros({T, E}, r.scores.options()).scatter_(1, r.expert_ids, 1.0).view({B, S, E});
    at::Tensor counts_per_sequence = chosen.sum(1);  // [B, E]
    // Under sequence parallelism the whole sequence's counts and length (set_sequence_parallel_group).
    int64_t whole_S = S;
    if (sequence_group_ && sequence_group_->size() > 1) {
      at::NoGradGuard no_grad;
      at::Tensor on_group = counts_per_sequence.to(sequence_group_->device());
      sequence_group_->all_reduce(on_group, ReduceOp::Sum).wait();
      counts_per_sequence = on_group.to(counts_per_sequence.device());
      whole_S = S * sequence_group_->size();
    }
    const at::Tensor f = counts_per_sequence * (static_cast<double>(E) / static_cast<double>(k * whole_S));  // [B, E]
    const at::Tensor normalised = r.scores / r.scores.sum(-1, /*keepdim=*/true);
    // The mean over the sequence; under sequence parallelism this rank's tokens' share of the whole sequence's.
    const at::Tensor P = whole_S == S ? normalised.view({B, S, E}).mean(1)
                                      : normalised.view({B, S, E}).sum(1) / static_cast<double>(whole_S);  // [B, E]
    aux_loss_ = *options_.sequence_aux_loss_coeff * (f * P).sum(-1).mean();
  }
  const at::Tensor routed = x.index_select(0, token_of_slot);
  // Through call(): expert parallelism wraps the experts' forward with the token exchange.
  at::Tensor out = fsdp::nn::call(experts, routed, counts);
  // Weights after the experts (in fp32, as TorchTitan's combine), then summed back into each token's row.
  const at::Tensor w = r.weights.reshape({-1}).index_select(0, order).unsqueeze(-1);
  out = (out.to(at::kFloat) * w).to(x.scalar_type());
  at::Tensor combined = at::zeros({T, options_.dim}, x.options()).index_add(0, token_of_slot, out);
  if (shared_experts) {
    // The block's input as it came ([B, S, D]: under tensor parallelism this rank's slice of the sequence, which
    // the shared experts' plan gathers and scatters back).
    auto& shared = static_cast<SharedExpertsImpl&>(*shared_experts);
    combined = combined + fsdp::nn::call(shared, input).reshape({T, options_.dim});
  }
  if (aux_loss_grad_scale_ && aux_loss_.defined() && at::GradMode::is_enabled() && aux_loss_.requires_grad())
    combined = TieAuxLoss::apply(combined, aux_loss_, *aux_loss_grad_scale_);
  return combined.reshape(input.sizes());
}

void MoEImpl::update_expert_bias(const at::Tensor& counts_in) {
  if (!options_.load_balance_coeff) return;
  at::NoGradGuard no_grad;
  const at::Tensor c = (counts_in.defined() ? counts_in : tokens_per_expert_).to(at::kFloat);
  at::Tensor delta = *options_.load_balance_coeff * at::sign(c.mean() - c);
  delta = delta - delta.mean();
  expert_bias.add_(delta.to(expert_bias.device()));
  tokens_per_expert_.zero_();
}

void MoEImpl::init_weights(at::Generator& gen, double std) {
  at::NoGradGuard no_grad;
  for (auto& p : parameters()) trunc_normal(p, std, gen);
}

}  // namespace fsdp::models::moe
