// FSDP's child modules (`_fsdp_state`, `_forward_hooks`) under printing, torch::save / torch::load and clone.
#include "nn/nn_test_util.h"

#include <sstream>

using namespace nn_test;

namespace {

// input -> blocks (ModuleList) -> output.
struct NetImpl : torch::nn::Module {
  explicit NetImpl(int64_t hidden = kHidden) {
    input = register_module("input", torch::nn::Linear(kIn, kDim));
    blocks = register_module("blocks", torch::nn::ModuleList(Block(kDim, hidden), Block(kDim, hidden)));
    output = register_module("output", torch::nn::Linear(kDim, kOut));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::tanh(input(x));
    for (size_t i = 0; i < blocks->size(); ++i) x = fsdp::nn::call(blocks->ptr<BlockImpl>(i), x);
    return output(x);
  }
  // The reference's forward: no fsdp code.
  torch::Tensor plain_forward(torch::Tensor x) {
    x = torch::tanh(input->forward(x));
    for (size_t i = 0; i < blocks->size(); ++i) x = blocks->ptr<BlockImpl>(i)->forward(x);
    return output->forward(x);
  }
  torch::nn::Linear input{nullptr}, output{nullptr};
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(Net);

constexpr int64_t kUnits = 3;  // two blocks and the root

void shard(Net& model) {
  for (size_t i = 0; i < model->blocks->size(); ++i) fsdp::fully_shard(model->blocks[i], shard_options());
  fsdp::fully_shard(model.ptr(), shard_options());
}

Params full(torch::nn::Module& model) { return fsdp::full_state_dict(model, {/*cpu_offload=*/true, /*rank0_only=*/false}); }

std::string printed(const torch::nn::Module& module) {
  std::ostringstream os;
  os << module;
  return os.str();
}

void expect_contains(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "'" << part << "' not in:\n" << text;
}
void expect_lacks(const std::string& text, const std::string& part) {
  EXPECT_EQ(text.find(part), std::string::npos) << "'" << part << "' in:\n" << text;
}

std::shared_ptr<torch::nn::Module> child(const torch::nn::Module& module, const std::string& name) {
  for (const auto& c : module.named_children()) {
    if (c.key() == name) return c.value();
  }
  return nullptr;
}

}  // namespace

TEST(Holders, PrintReadableNames) {
  torch::manual_seed(1);
  Net model;
  shard(model);
  const std::string text = printed(*model);
  expect_contains(text, "(_fsdp_state): fsdp::FSDPState(params=4, shard_size=" + std::to_string(test_world()->size()) + ")");
  expect_contains(text, "(_forward_hooks): fsdp::ForwardHooks(pre=");
  for (const char* mangled : {"FSDPStateHolder", "HookStore", "fsdp::detail", "fsdp::nn::("}) expect_lacks(text, mangled);
  EXPECT_EQ(child(*model, "_fsdp_state")->name(), "fsdp::FSDPState");
  EXPECT_EQ(child(*model, "_forward_hooks")->name(), "fsdp::ForwardHooks");
  std::cout << text << "\n";
}

// torch::save of a sharded model stores this rank's shards; torch::load into an identically sharded model
// (other weights) puts them into FSDP's shard storage, and that model then trains like single-process
// libtorch started from the saved weights.
TEST(Holders, SaveLoadShardedRoundTrip) {
  torch::manual_seed(2);
  Net source;
  const Params init = snapshot(*source);
  Net reference;
  copy_params(*source, *reference);
  const Params ref = train_reference(*reference, [&](torch::Tensor x) { return reference->plain_forward(x); }, Opt::AdamW);

  torch::manual_seed(3);
  Net target;  // other weights
  shard(source);
  shard(target);
  std::stringstream archive;
  torch::save(source, archive);
  torch::load(target, archive);

  const Params a = full(*source), b = full(*target);
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, value] : a) EXPECT_TRUE(torch::equal(value, b.at(name))) << name;

  auto run = train_fsdp(*target, [&](torch::Tensor x) { return fsdp::nn::call(target, x); }, Opt::AdamW);
  expect_parity(run.params, ref, init);
  EXPECT_EQ(run.forward_all_gathers, kUnits);
  EXPECT_EQ(run.reduce_scatters, kUnits);
}

// An archive holding full parameters where the sharded model has its FSDP children (here: an unsharded model
// with placeholders of the same names) loads too: every rank takes its rows.
TEST(Holders, LoadFullParametersIntoShardedModel) {
  torch::manual_seed(4);
  Net unsharded;
  unsharded->register_module("_fsdp_state", std::make_shared<torch::nn::Module>());
  for (size_t i = 0; i < unsharded->blocks->size(); ++i) {
    unsharded->blocks[i]->register_module("_fsdp_state", std::make_shared<torch::nn::Module>());
  }
  std::stringstream archive;
  torch::save(unsharded, archive);
  torch::manual_seed(5);
  Net target;
  shard(target);
  torch::load(target, archive);
  const Params got = full(*target);
  for (const auto& item : unsharded->named_parameters()) EXPECT_TRUE(torch::equal(got.at(item.key()), item.value())) << item.key();
}

// torch::save of a plain (unsharded) model, torch::load into a sharded one: libtorch finds no sub-archive for
// the FSDP holder and raises a clear error naming it (documented: load before fully_shard, or use the state
// dicts of <fsdp/state_dict.h>). Never a crash.
TEST(Holders, LoadUnshardedArchiveIntoShardedModelIsAnError) {
  torch::manual_seed(6);
  Net unsharded;
  std::stringstream archive;
  torch::save(unsharded, archive);
  Net target;
  shard(target);
  try {
    torch::load(target, archive);
    ADD_FAILURE() << "loaded an unsharded archive into a sharded model";
  } catch (const c10::Error& e) {
    expect_contains(e.what(), "_fsdp_state");
  }
  // The supported way: load into the unsharded model, then shard it.
  archive.clear();
  archive.seekg(0);
  Net fresh;
  torch::load(fresh, archive);
  shard(fresh);
  const Params got = full(*fresh);
  for (const auto& item : unsharded->named_parameters()) EXPECT_TRUE(torch::equal(got.at(item.key()), item.value())) << item.key();
}

// A shard archive whose shapes fit neither this rank's shard nor the full parameter: an error naming the
// parameter, and the group's parameters still show their (unchanged) shards.
TEST(Holders, LoadMismatchedShardsIsAnError) {
  torch::manual_seed(7);
  Net source(/*hidden=*/kHidden + 4);
  shard(source);
  std::stringstream archive;
  torch::save(source, archive);
  Net target;
  shard(target);
  const Params before = snapshot(*target->blocks[0]);  // this rank's shards
  try {
    torch::load(target, archive);
    ADD_FAILURE() << "loaded mismatched shards";
  } catch (const c10::Error& e) {
    expect_contains(e.what(), "fc1.weight");
    expect_contains(e.what(), "was loaded with shape");
  }
  // blocks.0's group is intact: its holder showed the unchanged shards again before reporting.
  const Params after = snapshot(*target->blocks[0]);
  for (const auto& [name, value] : before) {
    EXPECT_EQ(after.at(name).sizes(), value.sizes()) << name;
    EXPECT_TRUE(torch::equal(after.at(name), value)) << name;
  }
}

// clone(): the holders clone to inert ones (no state, no hooks); a sharded container clones to an unsharded
// copy holding copies of this rank's shards. A module class deriving from torch::nn::Cloneable that was itself
// given to fully_shard cannot be cloned: Cloneable::clone requires reset() to recreate every child, and FSDP's
// children are not recreated (libtorch's error; documented in docs/hooks.md).
TEST(Holders, Clone) {
  torch::manual_seed(8);
  Net model;
  shard(model);
  auto holder = child(*model, "_fsdp_state");
  auto holder_clone = holder->clone();
  EXPECT_EQ(printed(*holder_clone), "fsdp::FSDPState(inert)");
  auto hooks_clone = child(*model, "_forward_hooks")->clone();
  EXPECT_EQ(printed(*hooks_clone), "fsdp::ForwardHooks(pre=0, post=0)");

  for (bool ours : {true, false}) {
    std::shared_ptr<torch::nn::Module> seq;
    if (ours) {
      seq = fsdp::nn::Sequential(torch::nn::Linear(kIn, kDim), torch::nn::ReLU(), torch::nn::Linear(kDim, kOut)).ptr();
    } else {
      seq = torch::nn::Sequential(torch::nn::Linear(kIn, kDim), torch::nn::ReLU(), torch::nn::Linear(kDim, kOut)).ptr();
    }
    fsdp::fully_shard(seq, shard_options());
    std::shared_ptr<torch::nn::Module> copy;
    ASSERT_NO_THROW(copy = seq->clone()) << (ours ? "fsdp" : "torch");
    EXPECT_FALSE(fsdp::fsdp_module(*copy).has_value());
    EXPECT_FALSE(fsdp::nn::has_forward_hooks(*copy));
    EXPECT_FALSE(child(*copy, "_fsdp_state"));
    auto src = seq->named_parameters();
    for (const auto& item : copy->named_parameters()) {
      EXPECT_TRUE(torch::equal(item.value(), src[item.key()])) << item.key();
      EXPECT_FALSE(item.value().is_same(src[item.key()])) << item.key();
    }
  }

  torch::nn::Linear linear(kIn, kDim);
  fsdp::fully_shard(linear.ptr(), shard_options());
  try {
    linear->clone();
    ADD_FAILURE() << "Cloneable::clone of a sharded module did not throw (update docs/hooks.md)";
  } catch (const c10::Error& e) {
    expect_contains(e.what(), "same number of child modules");
  }
}
