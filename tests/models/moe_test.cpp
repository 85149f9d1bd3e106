// The MoE block (fsdp/models/moe.h) against a reference written here token by token, from TorchTitan's
// definition: for each token, scores = sigmoid/softmax(gate x), the top-k of scores + bias chosen, weights = the
// chosen scores (normalised, scaled), output = sum_k weight_k * w2_e (silu(w1_e x) * w3_e x) + shared(x). No
// grouped GEMM, no permutation, no index tricks: loops over tokens and choices.
#include <fsdp/activation_checkpoint.h>
#include <fsdp/models/moe.h>
#include <fsdp/nn/module_call.h>

#include "expect_error.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <string>
#include <numeric>
#include <vector>

using fsdp::models::moe::MoE;
using fsdp::models::moe::MoEOptions;

namespace {

torch::Tensor swiglu(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& w2, const torch::Tensor& w3) {
  return torch::matmul(torch::silu(torch::matmul(x, w1.t())) * torch::matmul(x, w3.t()), w2.t());
}

// The reference forward on x [T, D], reading the block's parameters (so gradients flow to the same tensors).
torch::Tensor reference(MoE& m, const torch::Tensor& x) {
  const auto& o = m->options();
  const auto gate = m->router->gate->weight;
  std::vector<torch::Tensor> rows;
  for (int64_t t = 0; t < x.size(0); ++t) {
    const auto xt = x[t];
    const auto logits = torch::matmul(gate, xt);
    const auto scores = o.score_func == "sigmoid" ? torch::sigmoid(logits) : torch::softmax(logits, 0);
    std::vector<double> choice(static_cast<size_t>(o.num_experts));
    for (int64_t e = 0; e < o.num_experts; ++e) {
      choice[e] = scores[e].item<double>() + (m->expert_bias.defined() ? m->expert_bias[e].item<double>() : 0.0);
    }
    if (o.num_expert_groups > 0) {
      // DeepSeek-V3: a group's score is the sum of its two best choices; experts outside the best
      // num_limited_groups groups cannot be chosen.
      const int64_t per = o.num_experts / o.num_expert_groups;
      std::vector<std::pair<double, int64_t>> groups;
      for (int64_t g = 0; g < o.num_expert_groups; ++g) {
        std::vector<double> c(choice.begin() + g * per, choice.begin() + (g + 1) * per);
        std::sort(c.rbegin(), c.rend());
        groups.push_back({c[0] + c[1], g});
      }
      std::stable_sort(groups.begin(), groups.end(), [](auto& a, auto& b) { return a.first > b.first; });
      std::vector<bool> kept(static_cast<size_t>(o.num_expert_groups), false);
      for (int64_t i = 0; i < o.num_limited_groups; ++i) kept[static_cast<size_t>(groups[i].second)] = true;
      for (int64_t e = 0; e < o.num_experts; ++e)
        if (!kept[static_cast<size_t>(e / per)]) choice[e] = -1e30;
    }
    std::vector<int64_t> ids(static_cast<size_t>(o.num_experts));
    std::iota(ids.begin(), ids.end(), 0);
    std::stable_sort(ids.begin(), ids.end(), [&](int64_t a, int64_t b) { return choice[a] > choice[b]; });
    ids.resize(static_cast<size_t>(o.top_k));
    std::vector<torch::Tensor> w;
    for (int64_t e : ids) w.push_back(scores[e]);
    torch::Tensor sum = torch::zeros({});
    for (auto& v : w) sum = sum + v;
    torch::Tensor out = torch::zeros({o.dim});
    for (size_t j = 0; j < ids.size(); ++j) {
      torch::Tensor weight = w[j];
      if (o.route_norm) weight = weight / (sum + 1e-20);
      weight = weight * o.route_scale;
      const int64_t e = ids[j];
      out = out + weight * swiglu(xt.unsqueeze(0), m->experts->w1[e], m->experts->w2[e], m->experts->w3[e]).squeeze(0);
    }
    if (m->shared_experts) {
      auto c = m->shared_experts->named_children();
      out = out + swiglu(xt.unsqueeze(0), c["w1"]->as<fsdp::models::moe::Projection>()->weight,
                         c["w2"]->as<fsdp::models::moe::Projection>()->weight,
                         c["w3"]->as<fsdp::models::moe::Projection>()->weight)
                      .squeeze(0);
    }
    rows.push_back(out);
  }
  return torch::stack(rows);
}

MoE make(MoEOptions o, uint64_t seed = 5) {
  MoE m(o);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  m->init_weights(gen, 0.2);  // larger than TorchTitan's 0.02 so that routing and outputs are far from ties
  return m;
}

std::map<std::string, torch::Tensor> grads_of(MoE& m) {
  std::map<std::string, torch::Tensor> g;
  for (const auto& p : m->named_parameters()) {
    g[p.key()] = p.value().grad().defined() ? p.value().grad().clone() : torch::zeros_like(p.value());
  }
  return g;
}

void expect_matches_reference(MoEOptions o, const char* what) {
  SCOPED_TRACE(what);
  MoE m = make(o);
  auto x = torch::randn({2, 7, o.dim}, at::make_generator<at::CPUGeneratorImpl>(9)) * 0.5;
  auto target = torch::randn({2, 7, o.dim}, at::make_generator<at::CPUGeneratorImpl>(10));
  auto out = m->forward(x);
  (out * target).sum().backward();
  const auto got = grads_of(m);
  m->zero_grad();
  auto ref = reference(m, x.reshape({-1, o.dim})).reshape(x.sizes());
  (ref * target).sum().backward();
  const auto want = grads_of(m);
  EXPECT_LE((out - ref).abs().max().item<double>(), 1e-5 * std::max(1.0, ref.abs().max().item<double>()));
  EXPECT_GT(ref.abs().max().item<double>(), 1e-3) << "the reference output is not trivial";
  for (const auto& [name, g] : want) {
    const double scale = std::max(1e-3, g.abs().max().item<double>());
    EXPECT_LE((got.at(name) - g).abs().max().item<double>(), 1e-5 * scale) << name;
  }
  // The router's gate gets a gradient through the weights (the choice itself is not differentiable).
  EXPECT_GT(want.at("router.gate.weight").abs().max().item<double>(), 0.0);
}

MoEOptions base() {
  MoEOptions o;
  o.dim = 16;
  o.hidden = 24;
  o.num_experts = 8;
  o.top_k = 2;
  return o;
}

}  // namespace

TEST(MoE, EqualsTheTokenByTokenReference) {
  MoEOptions o = base();
  expect_matches_reference(o, "sigmoid, top 2, grouped GEMM");
  o.use_grouped_mm = false;
  expect_matches_reference(o, "sigmoid, top 2, per-expert loop");
  o = base();
  o.score_func = "softmax";
  o.route_norm = true;  // Qwen3-MoE's norm_topk_prob
  expect_matches_reference(o, "softmax, normalised top 2");
  o = base();
  o.route_scale = 2.5;
  o.num_shared_experts = 1;
  expect_matches_reference(o, "route scale 2.5, one shared expert");
  o = base();
  o.top_k = 1;
  o.num_experts = 16;  // 14 tokens over 16 experts: some experts receive none
  expect_matches_reference(o, "top 1 of 16 experts (empty experts)");
  o = base();
  o.num_experts = 16;
  o.top_k = 3;
  o.num_expert_groups = 4;
  o.num_limited_groups = 2;
  o.route_norm = true;
  o.route_scale = 2.5;
  expect_matches_reference(o, "DeepSeek-V3 group-limited routing: 4 groups of 4, best 2, top 3");
}

TEST(MoE, EmptyExpertsReallyOccurAndGetZeroGradients) {
  MoEOptions o = base();
  o.top_k = 1;
  o.num_experts = 16;
  MoE m = make(o);
  m->train();
  auto x = torch::randn({14, o.dim}, at::make_generator<at::CPUGeneratorImpl>(9)) * 0.5;
  m->forward(x).sum().backward();
  const auto counts = m->tokens_per_expert();
  EXPECT_EQ(counts.sum().item<double>(), 14.0);
  int64_t empty = 0;
  for (int64_t e = 0; e < o.num_experts; ++e) {
    if (counts[e].item<double>() > 0) continue;
    ++empty;
    EXPECT_EQ(m->experts->w1.grad()[e].abs().max().item<double>(), 0.0) << "expert " << e;
  }
  EXPECT_GT(empty, 0) << "the test needs an expert without tokens";
}

TEST(MoE, BiasSteersTheChoiceNotTheWeightsAndUpdatesByItsFormula) {
  MoEOptions o = base();
  o.top_k = 1;
  o.load_balance_coeff = 0.5;
  MoE m = make(o);
  m->train();
  auto x = torch::randn({32, o.dim}, at::make_generator<at::CPUGeneratorImpl>(3));
  m->forward(x);
  const auto c = m->tokens_per_expert().clone();
  EXPECT_EQ(c.sum().item<double>(), 32.0);
  // delta = coeff * sign(mean(c) - c), centred.
  auto delta = 0.5 * torch::sign(c.mean() - c);
  delta = delta - delta.mean();
  m->update_expert_bias();
  EXPECT_TRUE(torch::allclose(m->expert_bias, delta));
  EXPECT_EQ(m->tokens_per_expert().sum().item<double>(), 0.0);
  EXPECT_GT(m->expert_bias.abs().max().item<double>(), 0.0);
  // A large bias on one expert sends every token there, with that expert's original score as the weight.
  {
    torch::NoGradGuard no_grad;
    m->expert_bias.zero_();
    m->expert_bias[3] = 100.0;
  }
  auto routing = m->router->forward(x, m->expert_bias);
  EXPECT_TRUE((routing.expert_ids == 3).all().item<bool>());
  EXPECT_TRUE(torch::allclose(routing.weights.squeeze(-1), routing.scores.select(1, 3)));
  // And the block still equals the reference with that bias.
  auto out = m->forward(x);
  EXPECT_LE((out - reference(m, x)).abs().max().item<double>(), 1e-5);
}

TEST(MoE, BadOptionsAreRefusedWithTheReason) {
  auto expect_error = [](MoEOptions o, const std::string& needle) {
    fsdp_test::expect_error_containing<c10::Error>([&] { MoE m(o); }, needle);
  };
  MoEOptions o = base();
  o.top_k = 9;
  expect_error(o, "top_k must be in [1, num_experts = 8]");
  o = base();
  o.score_func = "relu";
  expect_error(o, "score_func");
  o = base();
  o.dim = 12;
  expect_error(o, "multiples of 8");
  o = base();
  o.num_expert_groups = 3;
  o.num_limited_groups = 1;
  expect_error(o, "must divide num_experts = 8");
  o = base();
  o.num_expert_groups = 4;
  o.num_limited_groups = 1;
  o.top_k = 3;
  expect_error(o, "exceeds the experts of 1 limited groups");
}

// DeepSeek-V3's sequence-wise balance loss against its definition, token by token: for each sequence,
// alpha * sum_i f_i P_i, f_i = E / (k S) * #tokens choosing i, P_i = mean_t s_it / sum_j s_jt; mean over sequences.
TEST(MoE, SequenceAuxLossEqualsItsDefinition) {
  MoEOptions o = base();
  o.sequence_aux_loss_coeff = 1e-2;
  MoE m = make(o);
  m->train();
  const int64_t B = 3, S = 5, E = o.num_experts, k = o.top_k;
  auto x = torch::randn({B, S, o.dim}, at::make_generator<at::CPUGeneratorImpl>(4));
  m->forward(x);
  ASSERT_TRUE(m->aux_loss().defined());
  double want = 0;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<double> f(E, 0.0), P(E, 0.0);
    for (int64_t t = 0; t < S; ++t) {
      auto scores = torch::sigmoid(torch::matmul(m->router->gate->weight, x[b][t]));
      std::vector<int64_t> ids(E);
      std::iota(ids.begin(), ids.end(), 0);
      std::stable_sort(ids.begin(), ids.end(), [&](int64_t a, int64_t c) {
        return scores[a].item<double>() + m->expert_bias[a].item<double>() >
               scores[c].item<double>() + m->expert_bias[c].item<double>();
      });
      for (int64_t j = 0; j < k; ++j) f[ids[j]] += static_cast<double>(E) / static_cast<double>(k * S);
      const double total = scores.sum().item<double>();
      for (int64_t i = 0; i < E; ++i) P[i] += scores[i].item<double>() / total / static_cast<double>(S);
    }
    double sum = 0;
    for (int64_t i = 0; i < E; ++i) sum += f[i] * P[i];
    want += 1e-2 * sum / static_cast<double>(B);
  }
  EXPECT_NEAR(m->aux_loss().item<double>(), want, 1e-7);
  EXPECT_GT(want, 0.0);
  // It trains the router: its gradient reaches the gate.
  m->aux_loss().backward();
  EXPECT_GT(m->router->gate->weight.grad().abs().max().item<double>(), 0.0);
  // Evaluation computes none.
  m->eval();
  m->forward(x);
  EXPECT_FALSE(m->aux_loss().defined());
}

// Under activation checkpointing (full, op-level selective) the block counts each token once and, with
// set_aux_loss_grad_scale(w), its output's backward adds w * d(aux)/d(params) exactly once: gradients and counts
// equal a forward without checkpointing whose loss adds w * aux_loss() by hand (the reference). Without the tie
// the balance loss's gradient is lost under full AC (its first pass has no graph): the reference moves with it.
TEST(MoE, BalanceLossAndTokenCountsUnderActivationCheckpointing) {
  MoEOptions o = base();
  o.sequence_aux_loss_coeff = 0.5;
  const double w = 0.75;
  auto x = torch::randn({3, 5, o.dim}, at::make_generator<at::CPUGeneratorImpl>(7));
  MoE ref = make(o);
  ref->train();
  const torch::Tensor ref_out = ref->forward(x);  // before aux_loss(), which the forward sets
  (ref_out.pow(2).sum() + w * ref->aux_loss()).backward();
  const auto want = grads_of(ref);
  const torch::Tensor want_counts = ref->tokens_per_expert().clone();
  EXPECT_EQ(want_counts.sum().item<double>(), 3.0 * 5 * o.top_k);
  MoE no_aux = make(o);
  no_aux->train();
  no_aux->forward(x).pow(2).sum().backward();
  EXPECT_GT((grads_of(no_aux)["router.gate.weight"] - want.at("router.gate.weight")).abs().max().item<double>(), 1e-4);

  for (const char* policy : {"none", "full", "op"}) {
    SCOPED_TRACE(policy);
    MoE m = make(o);
    m->train();
    m->set_aux_loss_grad_scale(w);
    const std::string p(policy);
    if (p != "none") {
      fsdp::checkpoint_module(m, {p == "full" ? fsdp::CheckpointPolicy::Full : fsdp::CheckpointPolicy::SelectiveOp});
    }
    EXPECT_EQ(fsdp::current_checkpoint_pass(), fsdp::CheckpointPass::None);
    fsdp::nn::call(m, x).pow(2).sum().backward();
    if (p != "none") EXPECT_EQ(fsdp::checkpoint_stats(m).recomputes, 1);
    EXPECT_TRUE(torch::equal(m->tokens_per_expert(), want_counts)) << m->tokens_per_expert() << want_counts;
    EXPECT_NEAR(m->aux_loss().item<double>(), ref->aux_loss().item<double>(), 1e-7);
    for (const auto& [name, g] : grads_of(m)) {
      EXPECT_TRUE(torch::allclose(g, want.at(name), 1e-5, 1e-6)) << name;
    }
  }
}
