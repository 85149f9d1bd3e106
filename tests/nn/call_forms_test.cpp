// fsdp::nn::call accepts every form in which model code holds a module: an lvalue, temporary or const holder,
// a std::shared_ptr<Impl> (lvalue or temporary), an AnyModule, and the elements of ModuleList / ModuleDict
// (list->ptr<Impl>(i), list[i]->as<Impl>(), list[i]->as<Holder>(), dict[key]->as<Impl>(), dict->at<Impl>(key)).
// Each runs the hooks (counted as all-gathers) and the model trains like single-process libtorch.
#include "nn/nn_test_util.h"
#include <fsdp/comm_stats.h>

using namespace nn_test;

namespace {

// One sharded block per call form.
struct FormsNetImpl : torch::nn::Module {
  FormsNetImpl() {
    input = register_module("input", torch::nn::Linear(kIn, kDim));
    a = register_module("a", Block(kDim, kHidden));
    b = register_module("b", Block(kDim, kHidden));
    c = register_module("c", Block(kDim, kHidden));
    d = register_module("d", Block(kDim, kHidden));
    e = register_module("e", Block(kDim, kHidden));
    list = register_module("list", torch::nn::ModuleList(Block(kDim, kHidden), Block(kDim, kHidden),
                                                         Block(kDim, kHidden)));
    dict = register_module("dict", torch::nn::ModuleDict(std::vector<std::pair<std::string, std::shared_ptr<Module>>>{
                                       {"p", Block(kDim, kHidden).ptr()}, {"q", Block(kDim, kHidden).ptr()}}));
    output = register_module("output", torch::nn::Linear(kDim, kOut));
    any_d = torch::nn::AnyModule(d);
  }
  Block block_a() const { return a; }  // a holder returned by value: a temporary at the call site

  // Form i applied to x. Forms 0-9 each call their own block; 10 and 11 call block d again in other ways.
  static constexpr int kForms = 12, kBlocks = 10;
  static const char* form_name(int i) {
    static const char* names[kForms] = {"temporary holder", "const holder", "temporary shared_ptr<Impl>",
                                        "AnyModule", "const lvalue shared_ptr<Impl>", "ModuleList ptr<Impl>(i)",
                                        "ModuleList [i]->as<Impl>()", "ModuleList [i]->as<Holder>()",
                                        "ModuleDict [key]->as<Impl>()", "ModuleDict at<Impl>(key)",
                                        "const AnyModule", "call_any_value"};
    return names[i];
  }
  torch::Tensor apply_form(int i, torch::Tensor x) {
    switch (i) {
      case 0: return fsdp::nn::call(block_a(), x);
      case 1: {
        const Block& const_b = b;
        return fsdp::nn::call(const_b, x);
      }
      case 2: return fsdp::nn::call(c.ptr(), x);
      case 3: return fsdp::nn::call(any_d, x);
      case 4: {
        const std::shared_ptr<BlockImpl> e_ptr = e.ptr();
        return fsdp::nn::call(e_ptr, x);
      }
      case 5: return fsdp::nn::call(list->ptr<BlockImpl>(0), x);
      case 6: return fsdp::nn::call(list[1]->as<BlockImpl>(), x);  // BlockImpl*
      case 7: return fsdp::nn::call(list[2]->as<Block>(), x);      // as<Holder>() is a BlockImpl* too
      case 8: return fsdp::nn::call(dict["p"]->as<BlockImpl>(), x);
      case 9: return fsdp::nn::call(dict->at<BlockImpl>("q"), x);   // BlockImpl&
      case 10: {
        const torch::nn::AnyModule any(d);
        return fsdp::nn::call(any, x);
      }
      case 11: return fsdp::nn::call_any_value(any_d, x).get<torch::Tensor>();
    }
    throw std::logic_error("no such form");
  }

  // only < 0: forms 0-9 in turn (every block once); else just form `only`.
  torch::Tensor forward(torch::Tensor x) {
    x = torch::tanh(input(x));
    if (only >= 0) {
      x = apply_form(only, x);
    } else {
      for (int i = 0; i < kBlocks; ++i) x = apply_form(i, x);
    }
    return output(x);
  }

  // The reference's forward: the same modules, plain forward() calls, no fsdp code.
  torch::Tensor plain_forward(torch::Tensor x) {
    x = torch::tanh(input->forward(x));
    if (only >= 0) {
      x = blocks()[only >= kBlocks ? 3 : only]->forward(x);
    } else {
      for (auto* blk : blocks()) x = blk->forward(x);
    }
    return output->forward(x);
  }

  std::vector<BlockImpl*> blocks() {
    return {a.get(), b.get(), c.get(), d.get(), e.get(), list->ptr<BlockImpl>(0).get(), list->ptr<BlockImpl>(1).get(),
            list->ptr<BlockImpl>(2).get(), &dict->at<BlockImpl>("p"), &dict->at<BlockImpl>("q")};
  }

  int only = -1;
  torch::nn::Linear input{nullptr}, output{nullptr};
  Block a{nullptr}, b{nullptr}, c{nullptr}, d{nullptr}, e{nullptr};
  torch::nn::ModuleList list{nullptr};
  torch::nn::ModuleDict dict{nullptr};
  torch::nn::AnyModule any_d;
};
TORCH_MODULE(FormsNet);

}  // namespace

TEST(CallForms, EveryFormRunsTheHooksAndTrains) {
  torch::manual_seed(5);
  FormsNet model;
  const Params init = snapshot(*model);
  FormsNet reference;
  copy_params(*model, *reference);
  const Params ref =
      train_reference(*reference, [&](torch::Tensor x) { return reference->plain_forward(x); }, Opt::AdamW);

  const auto blocks = model->blocks();
  ASSERT_EQ(blocks.size(), 10u);
  for (auto* blk : blocks) fsdp::fully_shard(blk->shared_from_this(), shard_options());
  fsdp::fully_shard(model.ptr(), shard_options());

  auto run = train_fsdp(*model, [&](torch::Tensor x) { return fsdp::nn::call(model, x); }, Opt::AdamW);
  expect_parity(run.params, ref, init);
  // The root and the ten blocks each gathered once in forward: every form ran its module's hooks.
  EXPECT_EQ(run.forward_all_gathers, static_cast<int64_t>(blocks.size()) + 1);
  EXPECT_EQ(run.reduce_scatters, static_cast<int64_t>(blocks.size()) + 1);
}

// Each form alone runs exactly its block's hooks (a probe hook registered after FSDP's counts the calls; the
// all-gather count is not used here because FSDP prefetches the previously recorded order), and gives the
// reference's output.
TEST(CallForms, EachFormAloneRunsItsModulesHooks) {
  torch::manual_seed(6);
  FormsNet model;
  FormsNet reference;
  copy_params(*model, *reference);
  const auto blocks = model->blocks();
  std::vector<int> calls(blocks.size(), 0);
  for (size_t i = 0; i < blocks.size(); ++i) {
    fsdp::fully_shard(blocks[i]->shared_from_this(), shard_options());
    fsdp::nn::register_forward_pre_hook(*blocks[i], [&calls, i](torch::nn::Module&, fsdp::nn::TensorList&) { ++calls[i]; });
  }
  fsdp::fully_shard(model.ptr(), shard_options());
  const auto x = torch::randn({3, kIn});
  for (int form = 0; form < FormsNetImpl::kForms; ++form) {
    const size_t block = form >= FormsNetImpl::kBlocks ? 3 : static_cast<size_t>(form);  // extra forms use d
    model->only = reference->only = form;
    std::fill(calls.begin(), calls.end(), 0);
    auto y = fsdp::nn::call(model, x);
    for (size_t i = 0; i < calls.size(); ++i) {
      EXPECT_EQ(calls[i], i == block ? 1 : 0) << FormsNetImpl::form_name(form) << ", block " << i;
    }
    EXPECT_LE(max_rel_diff(y, reference->plain_forward(x)), 1e-6) << FormsNetImpl::form_name(form);
    y.sum().backward();
    for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
  }
}

// An AnyModule call returns what its forward returns; asking for another type is a clear error.
TEST(CallForms, AnyModuleReturnTypes) {
  struct PairImpl : torch::nn::Module {
    PairImpl() { lin = register_module("lin", torch::nn::Linear(3, 4)); }
    std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x) { return {lin(x), lin(x) * 2}; }
    torch::nn::Linear lin{nullptr};
  };
  auto pair = std::make_shared<PairImpl>();
  fsdp::fully_shard(pair, shard_options());
  torch::nn::AnyModule any(pair);
  auto group = world_mesh().group(0);
  fsdp::reset_comm_stats(*group);
  auto [u, v] = fsdp::nn::call<std::tuple<torch::Tensor, torch::Tensor>>(any, torch::ones({2, 3}));
  EXPECT_EQ(fsdp::comm_stats(*group).all_gather_calls, 1);
  EXPECT_TRUE(torch::allclose(v, u * 2));
  (u.sum() + v.sum()).backward();
  try {
    fsdp::nn::call(any, torch::ones({2, 3}));  // asks for a Tensor
    ADD_FAILURE() << "no error for the wrong return type";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("asked for"), std::string::npos) << e.what();
  }
}
