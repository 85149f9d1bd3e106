// Tensor parallel over 2 ranks vs single-process training of the same model on the same batch (fp32, 1e-5),
// with the exact collectives per step that the styles imply (the reference's tables: one all-reduce per
// rowwise output in forward and one per colwise input in backward without sequence parallel; per Llama block
// 2 all-gathers + 2 reduce-scatters each way with it), and their bytes against the byte model.

#include "tensor_parallel/tp_test_util.h"

#include <fsdp/models/llama.h>
#include <fsdp/models/llama_tp_plan.h>
#include <fsdp/comm_stats.h>
#include <fsdp/nn/module_call.h>
#include <fsdp/nn/weight_layout.h>

using namespace fsdp_test;

namespace {

// Two colwise -> rowwise pairs with biases; hidden sizes 13 and 11 split unevenly over 2 ranks (7+6, 6+5).
struct PairMLPImpl : torch::nn::Module {
  PairMLPImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 13));
    fc2 = register_module("fc2", torch::nn::Linear(13, 10));
    fc3 = register_module("fc3", torch::nn::Linear(10, 11));
    fc4 = register_module("fc4", torch::nn::Linear(11, 6));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = fsdp::nn::call(fc2, torch::relu(fsdp::nn::call(fc1, x)));
    return fsdp::nn::call(fc4, torch::tanh(fsdp::nn::call(fc3, torch::tanh(h))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr}, fc4{nullptr};
};
TORCH_MODULE(PairMLP);

// A model's own linear layer (not torch::nn::Linear): the styles know no model class, so they split it only
// when it states its weight layout (fsdp::nn::HasWeightLayout).
struct OwnLinearImpl : torch::nn::Module {
  OwnLinearImpl() { weight = register_parameter("weight", torch::randn({5, 4})); }
  torch::Tensor forward(const torch::Tensor& x) { return torch::linear(x, weight); }
  torch::Tensor weight;
};
TORCH_MODULE(OwnLinear);
struct DeclaredOwnLinearImpl : OwnLinearImpl, fsdp::nn::HasWeightLayout {
  fsdp::nn::WeightLayout weight_layout() const override { return fsdp::nn::WeightLayout::Linear; }
};
TORCH_MODULE(DeclaredOwnLinear);

struct Counts {
  int64_t all_gather = 0, reduce_scatter = 0, all_reduce = 0, bytes = 0;
};
Counts counts_of(const fsdp::ProcessGroupPtr& g) {
  const auto& s = fsdp::comm_stats(*g);
  return {s.all_gather_calls, s.reduce_scatter_calls, s.all_reduce_calls, s.bytes_sent};
}
void expect_counts(const Counts& got, const Counts& want, const std::string& what) {
  EXPECT_EQ(got.all_gather, want.all_gather) << what << ": all-gathers";
  EXPECT_EQ(got.reduce_scatter, want.reduce_scatter) << what << ": reduce-scatters";
  EXPECT_EQ(got.all_reduce, want.all_reduce) << what << ": all-reduces";
  EXPECT_EQ(got.bytes, want.bytes) << what << ": bytes sent";
}

fsdp::DeviceMesh tp_mesh() {
  const int world = fsdp_test::test_world()->size();
  return fsdp::init_device_mesh("cpu", {world}, {"tp"});
}

}  // namespace

TEST(TensorParallel, MlpColwiseRowwiseMatchesSingleProcess) {
  const int world = fsdp_test::test_world()->size();
  if (world != 2) GTEST_SKIP() << "tp 2 needs 2 ranks";
  auto mesh = tp_mesh();
  torch::manual_seed(7);
  PairMLP ref;
  torch::manual_seed(7);
  PairMLP model;
  fsdp::parallelize_module(model, mesh,
                           {{"fc1", fsdp::ColwiseParallel{}}, {"fc2", fsdp::RowwiseParallel{}},
                            {"fc3", fsdp::ColwiseParallel{}}, {"fc4", fsdp::RowwiseParallel{}}});
  // The feature ran: this rank holds its torch.chunk piece (13 = 7 + 6).
  const int64_t r = mesh.local_rank(0);
  EXPECT_EQ(model->fc1->weight.size(0), r == 0 ? 7 : 6);
  EXPECT_EQ(model->fc2->weight.size(1), r == 0 ? 7 : 6);
  EXPECT_EQ(model->fc2->bias.size(0), 10);  // rowwise bias: replicated
  EXPECT_EQ(model->fc3->bias.size(0), r == 0 ? 6 : 5);

  torch::optim::SGD ref_opt(ref->parameters(), 0.2), opt(model->parameters(), 0.2);
  const auto initial = snapshot(*ref);
  const int64_t batch = 5;
  auto g = mesh.group(0);
  for (int step = 0; step < 3; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
    auto x = torch::randn({batch, 8}, gen), y = torch::randn({batch, 6}, gen);
    ref_opt.zero_grad();
    auto ref_loss = torch::mse_loss(ref->forward(x), y);
    ref_loss.backward();
    ref_opt.step();
    fsdp::reset_comm_stats(*g);
    opt.zero_grad();
    auto loss = torch::mse_loss(fsdp::nn::call(model, x), y);
    loss.backward();
    opt.step();
    EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-5) << "step " << step;
    // Forward: all-reduce of fc2's and fc4's partial outputs [5, 10] and [5, 6]; backward: all-reduce of fc3's
    // input gradient [5, 10] (fc1's input needs none). Ring all-reduce over 2 ranks sends the tensor's bytes.
    expect_counts(counts_of(g), {0, 0, 3, 4 * batch * (10 + 6 + 10)}, "MLP step " + std::to_string(step));
  }
  EXPECT_GT(max_change(initial, snapshot(*ref)), 1e-3) << "the reference did not train";
  expect_params_close(full_tp_params(*model), snapshot(*ref), 1e-5, "MLP after 3 steps");
}

namespace {

struct LlamaCase {
  bool sequence_parallel;
  bool loss_parallel;
};

void run_llama_case(const LlamaCase& c) {
  auto mesh = tp_mesh();
  auto args = fsdp::models::llama::llama3_flavor("cpu_tiny");
  const int64_t L = args.n_layers, B = 2, S = 8, D = args.dim, V = args.vocab_size;
  fsdp::models::llama::Transformer ref(args), model(args);
  ref->init_weights(11);
  model->init_weights(11);
  fsdp::parallelize_module(model, mesh,
                           fsdp::models::llama::tensor_parallel_plan(args, 2, {c.sequence_parallel, c.loss_parallel}));
  EXPECT_EQ(model->output->weight().size(0), V / 2);
  EXPECT_EQ(model->blocks()[0]->attention->wo->weight().size(1), D / 2);

  torch::optim::SGD ref_opt(ref->parameters(), 0.5), opt(model->parameters(), 0.5);
  const auto initial = snapshot(*ref);
  auto g = mesh.group(0);
  const std::string what = std::string("llama sp=") + (c.sequence_parallel ? "1" : "0") +
                           " loss_parallel=" + (c.loss_parallel ? "1" : "0");
  for (int step = 0; step < 3; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + step);
    auto tokens = torch::randint(V, {B, S}, gen), targets = torch::randint(V, {B, S}, gen);
    ref_opt.zero_grad();
    auto ref_loss = torch::cross_entropy_loss(ref->forward(tokens).flatten(0, 1), targets.flatten());
    ref_loss.backward();
    ref_opt.step();

    fsdp::reset_comm_stats(*g);
    opt.zero_grad();
    auto logits = fsdp::nn::call(model, tokens);
    auto loss = c.loss_parallel ? fsdp::loss_parallel_cross_entropy(logits, targets, mesh)
                                : torch::cross_entropy_loss(logits.flatten(0, 1), targets.flatten());
    if (c.loss_parallel) EXPECT_EQ(logits.size(-1), V / 2);
    loss.backward();
    opt.step();
    EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-5) << what << " step " << step;

    // Analytic counts (4-byte floats, 2 ranks: an all-gather sends its input, a reduce-scatter half its input,
    // an all-reduce its tensor).
    const int64_t act = B * S * D * 4 / 2;  // one sequence-sharded activation [B, S/2, D] / half of [B, S, D]
    Counts want;
    if (c.sequence_parallel) {
      // Per block: forward 2 all-gathers (PrepareModuleInput) + 2 reduce-scatters (wo, w2); backward the
      // mirrors; the two norms' weight gradients all-reduced. Root: the embedding's reduce-scatter (+ its
      // all-gather in backward), the output layer's input all-gather (+ reduce-scatter in backward), the final
      // norm's all-reduce.
      want.all_gather = 4 * L + 2;
      want.reduce_scatter = 4 * L + 2;
      want.all_reduce = 2 * L + 1;
      want.bytes = (8 * L + 4) * act + (2 * L + 1) * D * 4;
      if (c.loss_parallel) {
        // max (+1 slot for the class count), sum of exponentials, target logit over the B*S tokens.
        want.all_reduce += 3;
        want.bytes += (3 * B * S + 1) * 4;
      } else {
        want.all_gather += 1;  // logits gathered [B, S, V/2]; their gradient is only sliced
        want.bytes += B * S * (V / 2) * 4;
      }
    } else {
      // Forward: the embedding's and each block's wo/w2 partial outputs all-reduced [B, S, D]; backward: the
      // input gradient of every colwise layer that reads a local input (wq, wk, wv, w1, w3, output).
      want.all_reduce = 1 + 2 * L + 5 * L + 1;
      want.bytes = want.all_reduce * B * S * D * 4;
      if (!c.loss_parallel) {
        want.all_gather = 1;
        want.bytes += B * S * (V / 2) * 4;
      } else {
        want.all_reduce += 3;
        want.bytes += (3 * B * S + 1) * 4;
      }
    }
    expect_counts(counts_of(g), want, what + " step " + std::to_string(step));
  }
  EXPECT_GT(max_change(initial, snapshot(*ref)), 1e-3) << "the reference did not train";
  expect_params_close(full_tp_params(*model), snapshot(*ref), 1e-5, what + " after 3 steps");
}

}  // namespace

TEST(TensorParallel, LlamaPlainTpMatchesSingleProcess) {
  if (fsdp_test::test_world()->size() != 2) GTEST_SKIP() << "tp 2 needs 2 ranks";
  run_llama_case({false, false});
}

TEST(TensorParallel, LlamaSequenceParallelMatchesSingleProcess) {
  if (fsdp_test::test_world()->size() != 2) GTEST_SKIP() << "tp 2 needs 2 ranks";
  run_llama_case({true, false});
}

TEST(TensorParallel, LlamaSequenceAndLossParallelMatchesSingleProcess) {
  if (fsdp_test::test_world()->size() != 2) GTEST_SKIP() << "tp 2 needs 2 ranks";
  run_llama_case({true, true});
}

TEST(TensorParallel, LlamaLossParallelWithoutSequenceParallelMatchesSingleProcess) {
  if (fsdp_test::test_world()->size() != 2) GTEST_SKIP() << "tp 2 needs 2 ranks";
  run_llama_case({false, true});
}

TEST(TensorParallel, LossParallelMatchesCrossEntropyOnUnevenClasses) {
  // 7 classes over 2 ranks (4 + 3), with an ignored target: value and logits gradient equal PyTorch's.
  if (fsdp_test::test_world()->size() != 2) GTEST_SKIP() << "tp 2 needs 2 ranks";
  auto mesh = tp_mesh();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  auto full = torch::randn({6, 7}, gen).requires_grad_(true);
  auto target = torch::tensor({0, 3, 4, 6, -100, 2}, torch::kLong);
  auto ref = torch::nn::functional::cross_entropy(full, target);
  ref.backward();
  const int64_t r = mesh.local_rank(0);
  auto local = full.detach().narrow(1, r == 0 ? 0 : 4, r == 0 ? 4 : 3).clone().requires_grad_(true);
  auto loss = fsdp::loss_parallel_cross_entropy(local, target, mesh);
  loss.backward();
  EXPECT_NEAR(loss.item<double>(), ref.item<double>(), 1e-6);
  auto want_grad = full.grad().narrow(1, r == 0 ? 0 : 4, r == 0 ? 4 : 3);
  EXPECT_LE((local.grad() - want_grad).abs().max().item<double>(), 1e-6);
}

TEST(TensorParallel, StylesSplitAnyModuleThatStatesItsWeightLayout) {
  if (fsdp_test::test_world()->size() != 2) GTEST_SKIP() << "tp 2 needs 2 ranks";
  auto mesh = tp_mesh();
  torch::manual_seed(3);
  OwnLinear undeclared;
  try {
    fsdp::parallelize_module(undeclared, mesh, {{"", fsdp::ColwiseParallel{}}});
    FAIL() << "a module of unknown layout was split";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("applies to Linear and Embedding modules"), std::string::npos) << e.what();
  }
  EXPECT_EQ(undeclared->weight.sizes(), torch::IntArrayRef({5, 4}));  // left whole

  torch::manual_seed(3);
  DeclaredOwnLinear declared;
  const torch::Tensor full_weight = declared->weight.detach().clone();
  const torch::Tensor x = torch::randn({3, 4});
  const torch::Tensor want = torch::linear(x, full_weight);  // the unsharded layer
  fsdp::parallelize_module(declared, mesh, {{"", fsdp::ColwiseParallel{fsdp::Replicate(), fsdp::Replicate()}}});
  // Colwise on a Linear layout: output rows split 3 + 2 (torch.chunk), the gathered output equals the whole layer's.
  const int64_t r = mesh.local_rank(0);
  EXPECT_TRUE(torch::equal(declared->weight, full_weight.chunk(2, 0)[r]));
  const torch::Tensor y = fsdp::nn::call(declared, x);
  EXPECT_LE((y - want).abs().max().item<double>(), 1e-6);
}

TEST(TensorParallel, PlanErrorsNameTheProblem) {
  auto mesh = tp_mesh();
  torch::manual_seed(1);
  PairMLP model;
  try {
    fsdp::parallelize_module(model, mesh, {{"fc9", fsdp::ColwiseParallel{}}});
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'fc9' matches no module"), std::string::npos) << e.what();
  }
  auto args = fsdp::models::llama::llama3_flavor("cpu_tiny");
  args.n_kv_heads = 1;
  try {
    fsdp::models::llama::tensor_parallel_plan(args, 2);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("n_kv_heads 1"), std::string::npos) << e.what();
  }
}
