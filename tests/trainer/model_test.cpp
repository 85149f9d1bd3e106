// The Llama 3 model: parameter counts against analytic counts (and the published sizes of the real models),
// TorchTitan's FQNs, tied embeddings, causality, deterministic init, and that blocks run through fsdp::nn::call.
#include <fsdp/models/llama.h>
#include <fsdp/nn/module_call.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

using namespace fsdp::models::llama;

namespace {
int64_t count_params(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}
}  // namespace

TEST(Llama, DebugmodelIsTorchTitans) {
  const LlamaArgs a = llama3_flavor("debugmodel");
  EXPECT_EQ(a.dim, 256);
  EXPECT_EQ(a.n_layers, 6);
  EXPECT_EQ(a.n_heads, 16);
  EXPECT_EQ(a.kv_heads(), 16);
  EXPECT_EQ(a.vocab_size, 2048);
  EXPECT_EQ(a.rope_theta, 500000);
  EXPECT_EQ(a.multiple_of, 256);
  EXPECT_EQ(a.ffn_hidden_dim(), 768);  // int(2 * 1024 / 3) = 682 -> next multiple of 256
  // By hand: per layer attention 4 * 256^2 + FFN 3 * 256 * 768 + two norms 2 * 256 = 852,480;
  // 6 layers + embeddings 2048 * 256 + output 2048 * 256 + final norm 256.
  const int64_t expect = 6 * (4 * 256 * 256 + 3 * 256 * 768 + 2 * 256) + 2 * 2048 * 256 + 256;
  EXPECT_EQ(expect, 6163712);
  EXPECT_EQ(num_params(a), expect);
  Transformer model(a);
  EXPECT_EQ(count_params(*model), expect);
}

TEST(Llama, RealShapesOnMetaMatchPublishedSizes) {
  // Published parameter counts: Llama 3 8B 8,030,261,248; 70B 70,553,706,496; Llama 3.2 1B 1,235,814,400 (tied).
  const std::vector<std::pair<std::string, int64_t>> cases = {
      {"8B", 8030261248LL}, {"70B", 70553706496LL}, {"1B", 1235814400LL}};
  for (const auto& [name, expect] : cases) {
    LlamaArgs a = llama3_flavor(name);
    EXPECT_EQ(num_params(a), expect) << name;
    a.device = c10::Device(c10::kMeta);
    Transformer model(a);  // no memory: every parameter is a meta tensor
    EXPECT_EQ(count_params(*model), expect) << name;
    for (const auto& p : model->parameters()) ASSERT_TRUE(p.is_meta());
  }
  EXPECT_EQ(llama3_flavor("8B").ffn_hidden_dim(), 14336);
  EXPECT_EQ(llama3_flavor("70B").ffn_hidden_dim(), 28672);
  EXPECT_EQ(llama3_flavor("405B").ffn_hidden_dim(), 53248);
  EXPECT_THROW(llama3_flavor("7B"), c10::Error);
}

TEST(Llama, TorchTitanFqnsWithoutBiases) {
  Transformer model(llama3_flavor("cpu_tiny"));
  std::set<std::string> names;
  for (const auto& p : model->named_parameters()) names.insert(p.key());
  for (const char* n : {"tok_embeddings.weight", "norm.weight", "output.weight", "layers.0.attention.wq.weight",
                        "layers.0.attention.wk.weight", "layers.0.attention.wv.weight", "layers.0.attention.wo.weight",
                        "layers.1.feed_forward.w1.weight", "layers.1.feed_forward.w2.weight",
                        "layers.1.feed_forward.w3.weight", "layers.1.attention_norm.weight", "layers.1.ffn_norm.weight"})
    EXPECT_TRUE(names.count(n)) << n;
  EXPECT_EQ(names.size(), 3u + 2u * 9u);  // no biases, nothing else
  // Grouped-query attention: 2 kv heads of 16 for 4 query heads.
  EXPECT_EQ(model->blocks()[0]->attention->wk->weight().sizes(), (std::vector<int64_t>{32, 64}));
}

TEST(Llama, TiedEmbeddingsAreOneTensorUsedTwice) {
  LlamaArgs a = llama3_flavor("cpu_tiny");
  a.tie_embeddings = true;
  Transformer tied(a);
  tied->init_weights(3);
  for (const auto& p : tied->named_parameters()) EXPECT_NE(p.key(), "output.weight");
  EXPECT_EQ(count_params(*tied), num_params(a));
  // Tokens 0..7 in the input; the output projection still touches every row of the shared matrix, so rows of
  // tokens never seen get gradient only through the tie.
  auto tokens = torch::arange(8, torch::kLong).view({1, 8});
  tied->forward(tokens).sum().backward();
  auto g = tied->tok_embeddings->weight().grad();
  EXPECT_GT(g.slice(0, 100, 200).abs().sum().item<double>(), 0.0);
  // The logits are the final hidden state times the embedding matrix.
  LlamaArgs b = a;
  b.tie_embeddings = false;
  Transformer untied(b);
  untied->init_weights(3);
  untied->forward(tokens).sum().backward();
  EXPECT_EQ(untied->tok_embeddings->weight().grad().slice(0, 100, 200).abs().sum().item<double>(), 0.0);
}

TEST(Llama, CausalFutureTokensDoNotChangeEarlierLogits) {
  Transformer model(llama3_flavor("cpu_tiny"));
  model->init_weights(0);
  torch::NoGradGuard ng;
  auto tokens = torch::randint(0, 2048, {2, 16}, torch::kLong);
  auto before = model->forward(tokens);
  auto changed = tokens.clone();
  changed.index_put_({torch::indexing::Slice(), 10}, (tokens.index({torch::indexing::Slice(), 10}) + 1) % 2048);
  auto after = model->forward(changed);
  EXPECT_TRUE(torch::equal(before.slice(1, 0, 10), after.slice(1, 0, 10)));
  EXPECT_GT((before.slice(1, 10) - after.slice(1, 10)).abs().max().item<double>(), 1e-4);
  EXPECT_EQ(before.sizes(), (std::vector<int64_t>{2, 16, 2048}));
}

TEST(Llama, RopeDependsOnRelativePositionOnly) {
  auto [cos, sin] = precompute_rope(8, 32, 500000);
  auto q = torch::randn({1, 1, 1, 8}), k = torch::randn({1, 1, 1, 8});
  auto at = [&](const torch::Tensor& x, int64_t pos) {
    return apply_rope(x, cos.slice(0, pos, pos + 1), sin.slice(0, pos, pos + 1));
  };
  const double d1 = (at(q, 5) * at(k, 2)).sum().item<double>();
  const double d2 = (at(q, 20) * at(k, 17)).sum().item<double>();
  EXPECT_NEAR(d1, d2, 1e-5);
  EXPECT_NEAR(at(q, 9).norm().item<double>(), q.norm().item<double>(), 1e-5);  // a rotation
  EXPECT_TRUE(torch::allclose(at(q, 0), q));
}

TEST(Llama, InitIsDeterministicAndFollowsTorchTitanScales) {
  const LlamaArgs a = llama3_flavor("debugmodel");
  Transformer m1(a), m2(a), m3(a);
  m1->init_weights(42);
  m2->init_weights(42);
  m3->init_weights(43);
  auto p1 = m1->parameters(), p2 = m2->parameters(), p3 = m3->parameters();
  for (size_t i = 0; i < p1.size(); ++i) EXPECT_TRUE(torch::equal(p1[i], p2[i]));
  EXPECT_FALSE(torch::equal(p1[0], p3[0]));
  auto std_of = [](const torch::Tensor& t) { return t.std().item<double>(); };
  EXPECT_NEAR(std_of(m1->tok_embeddings->weight()), 1.0, 0.01);
  EXPECT_NEAR(std_of(m1->blocks()[0]->attention->wq->weight()), 0.02, 0.001);
  // depth init: block 3's output projections use 0.02 / sqrt(2 * 4).
  EXPECT_NEAR(std_of(m1->blocks()[3]->attention->wo->weight()), 0.02 / std::sqrt(8.0), 0.0005);
  EXPECT_NEAR(std_of(m1->blocks()[3]->feed_forward->w3->weight()), 0.02 / std::sqrt(8.0), 0.0005);
  const double out_std = 1.0 / 16;  // dim^-0.5, truncated at 3 std (which lowers the std by ~1.4%)
  EXPECT_NEAR(std_of(m1->output->weight()), out_std * 0.986, out_std * 0.02);
  EXPECT_LE(m1->output->weight().abs().max().item<double>(), 3 * out_std + 1e-7);
  EXPECT_TRUE(torch::equal(m1->norm->weight(), torch::ones({256})));
}

TEST(Llama, BlocksAreInvokedThroughModuleCall) {
  Transformer model(llama3_flavor("cpu_tiny"));
  model->init_weights(0);
  std::vector<int64_t> order;
  for (auto& block : model->blocks()) {
    const int64_t id = block->layer_id;
    fsdp::nn::register_forward_pre_hook(*block, [&order, id](torch::nn::Module&, fsdp::nn::TensorList&) { order.push_back(id); });
  }
  torch::NoGradGuard ng;
  model->forward(torch::zeros({1, 4}, torch::kLong));
  EXPECT_EQ(order, (std::vector<int64_t>{0, 1}));
}

// ---- Llama 3.1 RoPE scaling against an independent Python transcription of TorchTitan's formula ----------------

namespace {
// Runs tests/trainer/rope_reference.py (standard library only) and reads one frequency per line.
std::vector<double> python_rope_frequencies(const std::string& args) {
  const std::string cmd = std::string(FSDP_TEST_PYTHON) + " " + FSDP_SOURCE_DIR + "/tests/trainer/rope_reference.py " + args;
  std::vector<double> out;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return out;
  char line[128];
  while (fgets(line, sizeof line, pipe)) out.push_back(std::stod(line));
  EXPECT_EQ(pclose(pipe), 0) << cmd;
  return out;
}
}  // namespace

TEST(Llama, RopeScalingOfThe8BFlavorEqualsTorchTitansFormula) {
  const LlamaArgs a = llama3_flavor("8B");
  ASSERT_TRUE(a.rope_scaling.has_value());
  EXPECT_EQ(a.rope_scaling->factor, 8.0);
  EXPECT_EQ(a.rope_scaling->low_freq_factor, 1.0);
  EXPECT_EQ(a.rope_scaling->high_freq_factor, 4.0);
  EXPECT_EQ(a.rope_scaling->original_max_position_embeddings, 8192);
  const auto expect = python_rope_frequencies("128 500000 8 1 4 8192");
  const auto plain = python_rope_frequencies("128 500000");
  ASSERT_EQ(expect.size(), 64u);
  ASSERT_EQ(plain.size(), 64u);
  auto ours = rope_frequencies(a.head_dim(), a.rope_theta, a.rope_scaling);
  ASSERT_EQ(ours.numel(), 64);
  int kept = 0, divided = 0, blended = 0;
  for (int i = 0; i < 64; ++i) {
    const double v = ours[i].item<double>();
    EXPECT_NEAR(v, expect[i], 1e-12 * expect[i]) << "frequency " << i;
    // The reference moved, in all three bands of the formula.
    if (expect[i] == plain[i]) ++kept;
    else if (std::abs(expect[i] - plain[i] / 8) <= 1e-15 * plain[i]) ++divided;
    else ++blended;
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(blended, 0);
  // The tables the model uses are cos/sin of position x those frequencies.
  auto [cos, sin] = precompute_rope(a.head_dim(), 4097, a.rope_theta, a.rope_scaling);
  for (int i : {0, 20, 40, 63}) {
    EXPECT_NEAR(cos[4096][i].item<double>(), std::cos(4096 * expect[i]), 1e-6) << i;
    EXPECT_NEAR(sin[4096][i].item<double>(), std::sin(4096 * expect[i]), 1e-6) << i;
  }
}

TEST(Llama, RopeScalingFlavors) {
  // TorchTitan applies Llama 3.1 scaling to debugmodel (PR #1839) and every real flavor; Llama 3.2 1B/3B
  // checkpoints use factor 32. Our cpu_* flavors keep plain RoPE.
  const LlamaArgs dbg = llama3_flavor("debugmodel");
  ASSERT_TRUE(dbg.rope_scaling.has_value());
  const auto expect = python_rope_frequencies("16 500000 8 1 4 8192");
  auto ours = rope_frequencies(16, 500000, dbg.rope_scaling);
  ASSERT_EQ(expect.size(), 8u);
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(ours[i].item<double>(), expect[i], 1e-12 * expect[i]) << i;
  for (const char* name : {"70B", "405B"}) EXPECT_EQ(llama3_flavor(name).rope_scaling->factor, 8.0) << name;
  for (const char* name : {"1B", "3B"}) EXPECT_EQ(llama3_flavor(name).rope_scaling->factor, 32.0) << name;
  for (const char* name : {"cpu_tiny", "cpu_small", "cpu_medium"}) EXPECT_FALSE(llama3_flavor(name).rope_scaling) << name;
  // The model's forward uses the scaled tables: switching scaling off changes the logits.
  LlamaArgs a = llama3_flavor("cpu_tiny");
  a.rope_scaling = RopeScaling{};
  a.rope_theta = 10000;  // head_dim 16: the last two frequencies are scaled (wavelengths 6283 and 19869)
  Transformer scaled(a);
  a.rope_scaling.reset();
  Transformer plain_model(a);
  scaled->init_weights(5);
  plain_model->init_weights(5);
  torch::NoGradGuard ng;
  auto tokens = torch::randint(0, 2048, {1, 12}, torch::kLong);
  EXPECT_GT((scaled->forward(tokens) - plain_model->forward(tokens)).abs().max().item<double>(), 1e-6);
  EXPECT_THROW(rope_frequencies(16, 500000, RopeScaling{8.0, 4.0, 1.0, 8192}), c10::Error);
}

// ---- KV cache -------------------------------------------------------------------------------------------------

TEST(Llama, KvCacheGivesTheFullForwardsLogits) {
  LlamaArgs a = llama3_flavor("cpu_tiny");  // grouped-query attention (4 heads, 2 kv heads)
  a.rope_scaling = RopeScaling{};           // the scaled tables too
  Transformer model(a);
  model->init_weights(11);
  torch::NoGradGuard ng;
  auto tokens = torch::randint(0, 2048, {2, 12}, torch::kLong);
  auto full = model->forward(tokens);
  // Prefill 5 positions, then 4 more at once (a masked block starting at 5), then one at a time.
  KVCache cache = model->make_kv_cache(2, 12);
  std::vector<torch::Tensor> parts;
  parts.push_back(model->forward_cached(tokens.slice(1, 0, 5), cache));
  parts.push_back(model->forward_cached(tokens.slice(1, 5, 9), cache));
  for (int64_t p = 9; p < 12; ++p) parts.push_back(model->forward_cached(tokens.slice(1, p, p + 1), cache));
  EXPECT_EQ(cache.length, 12);
  auto cached = torch::cat(parts, 1);
  EXPECT_LT((cached - full).abs().max().item<double>(), 2e-5);
  EXPECT_GT(full.abs().max().item<double>(), 0.1);  // not trivially zero
  EXPECT_THROW(model->forward_cached(tokens.slice(1, 0, 1), cache), c10::Error);  // full
}
