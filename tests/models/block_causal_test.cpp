// Document masking (AttnMaskType::BlockCausal, TorchTitan's attn_mask_type = "block_causal") against an
// independent reference: the documents of a packed batch run one by one, each alone, through a plain causal model
// with the same weights (SDPA's is_causal path, no mask, positions from 0). The packed loss with block_causal must
// equal the sum of the per-document token losses over the total token count, and so must its gradients (fp32,
// 1e-5 relative), for Llama 3, Qwen3 (QK-norm, half-split RoPE) and Qwen3-MoE, with and without activation
// checkpointing. The mask must have run: the same packed batch with causal attention gives another loss.
#include <fsdp/activation_checkpoint.h>
#include <fsdp/models/llama.h>
#include <fsdp/models/qwen3.h>

#include "expect_error.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

namespace llama = fsdp::models::llama;

namespace {

constexpr int64_t kBos = 256, kEos = 257;  // the byte-level tokenizer's ids (vocab 2048 in the cpu_* flavors)

// A packed batch as fsdp-train's loader makes it: documents (BOS, 3-20 tokens, EOS) joined into one stream, cut
// into rows of S + 1 tokens; inputs are the first S, labels the last S.
struct Packed {
  torch::Tensor inputs, labels;  // [B, S] int64
};
Packed pack(int64_t batch, int64_t seq, uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<int64_t> stream;
  while (static_cast<int64_t>(stream.size()) < batch * (seq + 1)) {
    const int64_t len = torch::randint(3, 21, {1}).item<int64_t>();
    stream.push_back(kBos);
    auto body = torch::randint(0, 256, {len}, torch::kLong);
    for (int64_t i = 0; i < len; ++i) stream.push_back(body[i].item<int64_t>());
    stream.push_back(kEos);
  }
  auto rows = torch::tensor(std::vector<int64_t>(stream.begin(), stream.begin() + batch * (seq + 1))).view({batch, seq + 1});
  return {rows.slice(1, 0, seq).contiguous(), rows.slice(1, 1, seq + 1).contiguous()};
}

torch::Tensor token_loss_sum(const torch::Tensor& logits, const torch::Tensor& labels) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), labels.reshape({-1}),
                                              torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
}

// The reference: each row cut after every EOS (an EOS ends its document), each piece run alone through the causal
// model; summed token losses over the batch's token count.
torch::Tensor per_document_loss(llama::Transformer& causal, const Packed& p, int64_t* documents) {
  torch::Tensor total = torch::zeros({});
  const int64_t batch = p.inputs.size(0), seq = p.inputs.size(1);
  *documents = 0;
  for (int64_t b = 0; b < batch; ++b) {
    int64_t start = 0;
    for (int64_t t = 0; t < seq; ++t) {
      if (p.inputs[b][t].item<int64_t>() != kEos && t + 1 < seq) continue;
      auto tokens = p.inputs[b].slice(0, start, t + 1).unsqueeze(0);
      auto labels = p.labels[b].slice(0, start, t + 1).unsqueeze(0);
      total = total + token_loss_sum(causal(tokens), labels);
      ++*documents;
      start = t + 1;
    }
  }
  return total / static_cast<double>(batch * seq);
}

std::map<std::string, torch::Tensor> grads(llama::Transformer& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m->named_parameters()) {
    if (p.value().grad().defined()) out[p.key()] = p.value().grad().clone();
  }
  return out;
}

void expect_close(const torch::Tensor& got, const torch::Tensor& want, double rel, const std::string& what) {
  const double diff = (got - want).norm().item<double>(), scale = want.norm().item<double>();
  EXPECT_LE(diff, rel * scale) << what << ": |got - want| " << diff << ", |want| " << scale;
}

struct Case {
  const char* model;
  const char* flavor;
};

void check_against_documents(const Case& c, bool checkpointed) {
  SCOPED_TRACE(std::string(c.model) + " " + c.flavor + (checkpointed ? " (activation checkpointing)" : ""));
  llama::LlamaArgs args = llama::model_flavor(c.model, c.flavor);
  llama::Transformer causal(args);
  args.attn_mask_type = llama::AttnMaskType::BlockCausal;
  llama::Transformer packed(args);
  causal->init_weights(7);
  packed->init_weights(7);
  if (checkpointed) {
    for (auto& block : packed->blocks()) fsdp::checkpoint_module(block);
  }

  const Packed p = pack(/*batch=*/2, /*seq=*/64, /*seed=*/11);
  const auto ids = llama::document_ids(p.inputs, kEos);
  auto loss = token_loss_sum(packed(p.inputs, ids), p.labels) / static_cast<double>(p.inputs.numel());
  loss.backward();

  int64_t documents = 0;
  auto want = per_document_loss(causal, p, &documents);
  want.backward();
  ASSERT_GE(documents, 8) << "the packed rows must hold several documents each";

  expect_close(loss.detach(), want.detach(), 1e-5, "loss");
  const auto got_grads = grads(packed), want_grads = grads(causal);
  ASSERT_EQ(got_grads.size(), want_grads.size());
  for (const auto& [name, g] : want_grads) {
    ASSERT_TRUE(got_grads.count(name)) << name;
    expect_close(got_grads.at(name), g, 1e-5, "grad of " + name);
  }
  if (checkpointed) {
    EXPECT_EQ(fsdp::checkpoint_stats(packed).recomputes, args.n_layers) << "every block recomputed in backward";
  }

  // The mask ran: the same packed batch attending across documents gives other logits (by far more than the
  // 1e-5 the equality above allows; an untrained model's loss moves little, its logits do).
  torch::NoGradGuard no_grad;
  const auto within = packed(p.inputs, ids), across = causal(p.inputs);
  const double moved = (across - within).norm().item<double>() / within.norm().item<double>();
  EXPECT_GT(moved, 1e-3) << "causal and block_causal logits differ by " << moved << " (relative)";
}

}  // namespace

// TorchTitan's get_document_mask_mod: id(t) = number of EOS at positions < t (an EOS ends its document).
TEST(BlockCausal, DocumentIdsCountEosBefore) {
  const auto tokens = torch::tensor({5, 257, 7, 8, 257, 257, 9, 257}, torch::kLong).view({1, 8});
  const auto ids = llama::document_ids(torch::cat({tokens, tokens.flip(1)}), 257);
  EXPECT_TRUE(ids[0].equal(torch::tensor({0, 0, 1, 1, 1, 2, 3, 3}, torch::kLong)));
  EXPECT_TRUE(ids[1].equal(torch::tensor({0, 1, 1, 2, 3, 3, 3, 4}, torch::kLong)));  // 257 9 257 257 8 7 257 5

  // The mask: k <= q within a document, counted by hand for row 0's first five positions.
  const auto mask = llama::block_causal_mask(ids).squeeze(1);
  ASSERT_EQ(mask.sizes(), (c10::IntArrayRef{2, 8, 8}));
  const std::vector<std::vector<int>> want = {
      {1, 0, 0, 0, 0}, {1, 1, 0, 0, 0}, {0, 0, 1, 0, 0}, {0, 0, 1, 1, 0}, {0, 0, 1, 1, 1}};
  for (int q = 0; q < 5; ++q)
    for (int k = 0; k < 5; ++k) EXPECT_EQ(mask[0][q][k].item<bool>(), want[q][k] == 1) << "q " << q << " k " << k;
  // Pairs k <= q per document of n tokens: n (n + 1) / 2; documents of 2, 3, 1, 2 and of 1, 2, 1, 3, 1 tokens.
  EXPECT_EQ(mask.sum().item<int64_t>(), (3 + 6 + 1 + 3) + (1 + 3 + 1 + 6 + 1));
}

TEST(BlockCausal, PackedEqualsDocumentsAlone) {
  for (const Case& c : {Case{"llama3", "cpu_tiny"}, Case{"qwen3", "cpu_tiny"}, Case{"qwen3", "cpu_tiny_moe"}}) {
    check_against_documents(c, /*checkpointed=*/false);
  }
}

TEST(BlockCausal, PackedEqualsDocumentsAloneUnderActivationCheckpointing) {
  check_against_documents(Case{"llama3", "cpu_tiny"}, /*checkpointed=*/true);
}

TEST(BlockCausal, MissingOrUnexpectedDocumentIdsRefused) {
  llama::LlamaArgs args = llama::llama3_flavor("cpu_tiny");
  llama::Transformer causal(args);
  args.attn_mask_type = llama::AttnMaskType::BlockCausal;
  llama::Transformer packed(args);
  const auto tokens = torch::zeros({1, 4}, torch::kLong);
  using fsdp_test::expect_error_containing;
  expect_error_containing<c10::Error>([&] { packed(tokens); }, "needs the tokens' document ids");
  expect_error_containing<c10::Error>([&] { causal(tokens, llama::document_ids(tokens, kEos)); },
                                      "document ids given to a causal model");
  expect_error_containing<c10::Error>([&] { packed(tokens, torch::zeros({1, 3}, torch::kLong)); },
                                      "do not match the tokens");
}
