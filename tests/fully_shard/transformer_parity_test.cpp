// Parity for a small Llama-architecture transformer (the project's model zoo entry): N-rank FSDP training
// equals single-process training on the same global batch, fp32, 20 SGD-momentum steps, every reshard mode.
// (SGD: Adam's 1/sqrt(v) amplifies the last-bit differences of fp32 sums taken in another order on elements
// whose gradients are near zero, so Adam parity at 1e-5 is shown on the MLP in parity_test.cpp.)
#include "fully_shard/fsdp_test_util.h"

#include <fsdp/clip_grad.h>
#include <fsdp/models/llama.h>

using namespace fsdp_test;
namespace llama = fsdp::models::llama;

namespace {

llama::LlamaArgs tiny_args() {
  llama::LlamaArgs a;
  a.dim = 48;  // 48 / 4 heads = head_dim 12; shapes like [48, 48] shard unevenly over 3 and 5 ranks
  a.n_layers = 3;
  a.n_heads = 4;
  a.n_kv_heads = 2;  // grouped-query attention
  a.vocab_size = 61;
  a.multiple_of = 16;
  a.rope_theta = 10000.0;
  a.max_seq_len = 16;
  return a;
}

constexpr int64_t kBatch = 12, kSeq = 10, kSteps = 20;

torch::Tensor tokens_for(int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(77 + step);
  return torch::randint(0, tiny_args().vocab_size, {kBatch, kSeq + 1}, gen);
}

torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(torch::kFloat),
                                              targets.reshape({-1}));
}

std::map<std::string, torch::Tensor> train(bool sharded, std::optional<fsdp::ReshardAfterForward> reshard,
                                           bool tied) {
  auto args = tiny_args();
  args.tie_embeddings = tied;
  llama::Transformer model(args);
  model->init_weights(5);
  std::vector<fsdp::FSDPModule> units;
  int64_t rank = 0, n = 1;
  if (sharded) {
    auto world = test_world();
    rank = world->rank();
    n = world->size();
    fsdp::FullyShardOptions opts;
    opts.reshard_after_forward = reshard;
    for (size_t i = 0; i < model->layers->size(); ++i) units.push_back(fsdp::fully_shard(model->layers[i], opts));
    units.push_back(fsdp::fully_shard(model, opts));
  }
  // Deduplicated parameters (tied embeddings appear under two names in libtorch).
  std::vector<torch::Tensor> params;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (auto& p : model->parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) params.push_back(p);
  }
  torch::optim::SGD optim(params, torch::optim::SGDOptions(0.3).momentum(0.9));
  const int64_t local = kBatch / n;
  for (int64_t step = 0; step < kSteps; ++step) {
    auto tokens = tokens_for(step).narrow(0, rank * local, local);
    auto inputs = tokens.narrow(1, 0, kSeq), targets = tokens.narrow(1, 1, kSeq);
    optim.zero_grad();
    auto logits = sharded ? fsdp::nn::call(model, inputs) : model->forward(inputs);
    lm_loss(logits, targets).backward();
    if (sharded) {
      fsdp::clip_grad_norm_(*model, 1.0);
    } else {
      torch::nn::utils::clip_grad_norm_(params, 1.0);
    }
    optim.step();
  }
  if (sharded) return full_params(*model, units);
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : model->named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

void expect_transformer_parity(std::optional<fsdp::ReshardAfterForward> reshard, bool tied = false) {
  auto ref = train(false, std::nullopt, tied);
  auto got = train(true, reshard, tied);
  ASSERT_EQ(ref.size(), got.size());
  double worst = 0;
  for (auto& [name, r] : ref) {
    ASSERT_TRUE(got.count(name)) << name;
    const double d = max_rel_diff(got[name], r);
    worst = std::max(worst, d);
    EXPECT_LE(d, 1e-5) << name;
  }
  // Non-vacuous: training moved the weights.
  auto args = tiny_args();
  args.tie_embeddings = tied;
  llama::Transformer init(args);
  init->init_weights(5);
  double moved = 0;
  for (const auto& item : init->named_parameters()) moved = std::max(moved, max_rel_diff(ref[item.key()], item.value()));
  EXPECT_GT(moved, 1e-2);
  std::cout << "[transformer parity] " << ref.size() << " tensors, worst relative difference " << worst
            << ", training moved parameters by " << moved << "\n";
}

}  // namespace

TEST(TransformerParity, Default) { expect_transformer_parity(std::nullopt); }
TEST(TransformerParity, ReshardAlways) { expect_transformer_parity(fsdp::ReshardAfterForward(true)); }
TEST(TransformerParity, ReshardNever) { expect_transformer_parity(fsdp::ReshardAfterForward(false)); }
TEST(TransformerParity, ReshardToSmallerGroup) {
  const int n = test_world()->size();
  expect_transformer_parity(fsdp::ReshardAfterForward(n % 2 == 0 && n > 2 ? 2 : n));
}
// Tied embeddings (one parameter used by the embedding and the output projection) are sharded once and
// updated on every rank, uneven shards included (PyTorch issue 176076).
TEST(TransformerParity, TiedEmbeddings) { expect_transformer_parity(std::nullopt, /*tied=*/true); }
