// fsdp::nn::Sequential with sharded elements trains like single-process libtorch; it converts from
// torch::nn::Sequential keeping names; fully_shard rejects a torch::nn::Sequential with sharded elements.
#include "nn/nn_test_util.h"

using namespace nn_test;

namespace {

torch::nn::AnyModule tanh_layer() {
  return torch::nn::AnyModule(torch::nn::Functional([](torch::Tensor t) { return torch::tanh(t); }));
}

// The FSDP side: input -> layers (fsdp::nn::Sequential: Block, ReLU, Block, tanh, Linear).
struct SeqNetImpl : torch::nn::Module {
  explicit SeqNetImpl(bool call_layers = false) : call_layers(call_layers) {
    input = register_module("input", torch::nn::Linear(kIn, kDim));
    layers = register_module("layers", fsdp::nn::Sequential(Block(kDim, kHidden), torch::nn::ReLU(),
                                                            Block(kDim, kHidden), tanh_layer(),
                                                            torch::nn::Linear(kDim, kOut)));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::tanh(input(x));
    // A Sequential given to fully_shard is itself called through its hooks, like any sharded module.
    return call_layers ? fsdp::nn::call(layers, x) : layers->forward(x);
  }
  bool call_layers;
  torch::nn::Linear input{nullptr};
  fsdp::nn::Sequential layers{nullptr};
};
TORCH_MODULE(SeqNet);

// The reference: the same model with libtorch's Sequential, plain forward.
struct RefNetImpl : torch::nn::Module {
  RefNetImpl() {
    input = register_module("input", torch::nn::Linear(kIn, kDim));
    layers = register_module("layers", torch::nn::Sequential(Block(kDim, kHidden), torch::nn::ReLU(),
                                                             Block(kDim, kHidden), tanh_layer(),
                                                             torch::nn::Linear(kDim, kOut)));
  }
  torch::Tensor forward(torch::Tensor x) { return layers->forward(torch::tanh(input->forward(x))); }
  torch::nn::Linear input{nullptr};
  torch::nn::Sequential layers{nullptr};
};
TORCH_MODULE(RefNet);

const std::vector<size_t> kShardedElements = {0, 2, 4};  // the elements with parameters

// Reference trained from `model`'s current (unsharded) parameters.
Params reference_from(const torch::nn::Module& model, Opt opt) {
  RefNet ref;
  copy_params(model, *ref);
  return train_reference(*ref, [&](torch::Tensor x) { return ref->forward(x); }, opt);
}

void run_sequential_parity(Opt opt, bool shard_sequential_too) {
  torch::manual_seed(7);
  SeqNet model(shard_sequential_too);
  const Params init = snapshot(*model);
  const Params ref = reference_from(*model, opt);

  for (size_t i : kShardedElements) fsdp::fully_shard(model->layers[i], shard_options());
  if (shard_sequential_too) fsdp::fully_shard(model->layers.ptr(), shard_options());
  fsdp::fully_shard(model.ptr(), shard_options());
  // Units with parameters: the elements and the root (a sharded Sequential whose elements are all sharded
  // manages no parameter of its own, so it issues no collective).
  const int64_t units = static_cast<int64_t>(kShardedElements.size()) + 1;

  auto run = train_fsdp(*model, [&](torch::Tensor x) { return fsdp::nn::call(model, x); }, opt);
  expect_parity(run.params, ref, init);
  // Every unit's hooks ran: one all-gather each in forward, one reduce-scatter each in backward.
  EXPECT_EQ(run.forward_all_gathers, units);
  EXPECT_EQ(run.reduce_scatters, units);
}

}  // namespace

TEST(FsdpSequential, ShardedElementsTrainLikeSingleProcessSGD) { run_sequential_parity(Opt::SGD, false); }
TEST(FsdpSequential, ShardedElementsTrainLikeSingleProcessAdamW) { run_sequential_parity(Opt::AdamW, false); }
TEST(FsdpSequential, ShardedElementsInsideShardedSequential) { run_sequential_parity(Opt::AdamW, true); }

// Same names as torch::nn::Sequential ("0", "1", ... or the given ones), so FQNs and state-dict keys match.
TEST(FsdpSequential, SameNamesAsTorchSequential) {
  torch::manual_seed(1);
  SeqNet ours;
  RefNet theirs;
  std::vector<std::string> a, b;
  for (const auto& p : ours->named_parameters()) a.push_back(p.key());
  for (const auto& p : theirs->named_parameters()) b.push_back(p.key());
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.front(), "input.weight");
  EXPECT_EQ(a.back(), "layers.4.bias");

  fsdp::nn::Sequential named({{"embed", torch::nn::Linear(3, 4)}, {"act", torch::nn::ReLU()}});
  named->push_back("proj", torch::nn::Linear(4, 2));
  named->push_back(torch::nn::Linear(2, 2));  // unnamed: its index
  std::vector<std::string> names;
  for (const auto& c : named->named_children()) names.push_back(c.key());
  EXPECT_EQ(names, (std::vector<std::string>{"embed", "act", "proj", "3"}));
  EXPECT_EQ(named->name_of(2), "proj");
  EXPECT_EQ(named->forward(torch::ones({1, 3})).sizes(), (std::vector<int64_t>{1, 2}));
}

// fsdp::nn::Sequential(torch_sequential): the same module objects under the same names; in a parent,
// replace_module keeps every FQN.
TEST(FsdpSequential, ConvertsTorchSequentialKeepingNames) {
  torch::manual_seed(2);
  torch::nn::Sequential torch_seq({{"embed", torch::nn::Linear(3, 4)}, {"act", torch::nn::ReLU()}});
  torch_seq->push_back(torch::nn::Linear(4, 2));  // named "2"
  auto parent = std::make_shared<torch::nn::Module>();
  parent->register_module("layers", torch_seq);
  const auto keys_before = parent->named_parameters().keys();
  const auto x = torch::randn({5, 3});
  const auto y_before = torch_seq->forward(x);

  fsdp::nn::Sequential converted(torch_seq);
  ASSERT_EQ(converted->size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(converted->ptr(i).get(), torch_seq->ptr(i).get()) << i;
  EXPECT_EQ(converted->name_of(0), "embed");
  EXPECT_EQ(converted->name_of(1), "act");
  EXPECT_EQ(converted->name_of(2), "2");
  parent->replace_module("layers", converted);
  EXPECT_EQ(parent->named_parameters().keys(), keys_before);
  EXPECT_TRUE(torch::equal(converted->forward(x), y_before));

  // Cloning keeps the names and copies the elements.
  auto clone = std::dynamic_pointer_cast<fsdp::nn::SequentialImpl>(converted->clone());
  ASSERT_TRUE(clone);
  EXPECT_EQ(clone->name_of(0), "embed");
  EXPECT_NE(clone->ptr(0).get(), converted->ptr(0).get());
  EXPECT_TRUE(torch::equal(clone->forward(x), y_before));

  // A torch::nn::Sequential that was itself given to fully_shard cannot be converted.
  torch::nn::Sequential sharded(torch::nn::Linear(3, 4));
  fsdp::fully_shard(sharded.ptr(), shard_options());
  try {
    fsdp::nn::Sequential bad(sharded);
    ADD_FAILURE() << "converted a sharded torch::nn::Sequential";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("convert it before fully_shard"), std::string::npos) << e.what();
  }
}

namespace {
// A model written with libtorch's Sequential; `fsdp_layers` is set when rebuilt with fsdp::nn::Sequential.
struct TorchSeqNetImpl : torch::nn::Module {
  TorchSeqNetImpl() {
    input = register_module("input", torch::nn::Linear(kIn, kDim));
    layers = register_module("layers", torch::nn::Sequential(Block(kDim, kHidden), torch::nn::ReLU(),
                                                             Block(kDim, kHidden), tanh_layer(),
                                                             torch::nn::Linear(kDim, kOut)));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::tanh(input(x));
    return fsdp_layers.is_empty() ? layers->forward(x) : fsdp_layers->forward(x);
  }
  torch::nn::Linear input{nullptr};
  torch::nn::Sequential layers{nullptr};
  fsdp::nn::Sequential fsdp_layers{nullptr};
};
TORCH_MODULE(TorchSeqNet);
}  // namespace

// fully_shard of an ancestor of a torch::nn::Sequential with sharded elements fails at once, naming the
// element and the alternatives, and leaves the module untouched; rebuilt with fsdp::nn::Sequential (taking
// over the already sharded elements) it trains correctly.
TEST(TorchSequential, ShardedElementsAreRejectedThenRebuilt) {
  torch::manual_seed(11);
  TorchSeqNet model;
  const Params init = snapshot(*model);
  const Params ref = reference_from(*model, Opt::AdamW);

  for (size_t i : kShardedElements) fsdp::fully_shard(model->layers[i], shard_options());  // no error yet

  auto expect_rejected = [&](const std::shared_ptr<torch::nn::Module>& target, const std::string& path) {
    try {
      fsdp::fully_shard(target, shard_options());
      ADD_FAILURE() << "fully_shard accepted a torch::nn::Sequential with sharded elements";
    } catch (const c10::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("'" + path + "'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("torch::nn::Sequential"), std::string::npos) << msg;
      EXPECT_NE(msg.find("fsdp::nn::Sequential"), std::string::npos) << msg;
      EXPECT_NE(msg.find("fsdp::nn::call"), std::string::npos) << msg;
      EXPECT_NE(msg.find("shard the whole Sequential"), std::string::npos) << msg;
    }
    // Nothing half-applied: no FSDP state, no hooks, full-size parameters.
    EXPECT_FALSE(fsdp::fsdp_module(*target).has_value());
    EXPECT_FALSE(fsdp::nn::has_forward_hooks(*target));
  };
  expect_rejected(model.ptr(), "layers.0");
  expect_rejected(model->layers.ptr(), "0");
  EXPECT_EQ(model->input->weight.sizes(), (std::vector<int64_t>{kDim, kIn}));

  // Rebuild: same elements (already sharded), same names.
  model->fsdp_layers = fsdp::nn::Sequential(model->layers);
  model->replace_module("layers", model->fsdp_layers);
  model->layers = nullptr;
  fsdp::fully_shard(model.ptr(), shard_options());
  auto run = train_fsdp(*model, [&](torch::Tensor x) { return fsdp::nn::call(model, x); }, Opt::AdamW);
  expect_parity(run.params, ref, init);
  EXPECT_EQ(run.forward_all_gathers, static_cast<int64_t>(kShardedElements.size()) + 1);
}

// The undetectable case: elements sharded, no ancestor of the Sequential ever sharded. The first forward
// fails in libtorch (the element computes with its shards) — documented in docs/hooks.md.
TEST(TorchSequential, UnshardedAncestorFailsInForward) {
  if (test_world()->size() == 1) GTEST_SKIP() << "one rank: shards are full parameters";
  torch::nn::Sequential seq(torch::nn::Linear(kIn, kDim), torch::nn::ReLU(), torch::nn::Linear(kDim, kOut));
  fsdp::fully_shard(seq[0], shard_options());
  EXPECT_THROW(seq->forward(torch::randn({2, kIn})), c10::Error);
}
