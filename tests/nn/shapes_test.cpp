// Every shape of forward the hooks accept (issue 24): sharded modules that return their activations in a
// std::map, a std::unordered_map with int keys, and a user struct made visible through fsdp::nn::TensorFields
// (taking a struct argument too) train like single-process libtorch (SGD, same global batch, 1e-6), also with
// activation checkpointing on those modules. The pre-backward gather ran for every block (counted all-gathers
// in backward): without it backward would read freed parameters. A type whose tensors the hooks cannot see is
// refused before the module's hooks run, naming the module and the type; without hooks it passes.
#include "nn/nn_test_util.h"

#include <fsdp/comm_stats.h>
#include <fsdp/activation_checkpoint.h>

#include <unordered_map>

using namespace nn_test;

namespace {

// A user output type: two tensors, a vector of tensors, and a non-tensor field.
struct BlockOutput {
  torch::Tensor hidden;
  std::vector<torch::Tensor> aux;
  int64_t calls = 0;
};
// A user argument type.
struct BlockInput {
  torch::Tensor x;
  double scale = 1.0;
};
// Holds a tensor and has no TensorFields: refused on a module with hooks.
struct Opaque {
  torch::Tensor t;
};

}  // namespace

template <>
struct fsdp::nn::TensorFields<BlockOutput> {
  template <class Visit>
  static void visit(BlockOutput& out, Visit&& visit) {
    visit(out.hidden);
    visit(out.aux);
  }
};
template <>
struct fsdp::nn::TensorFields<BlockInput> {
  template <class Visit>
  static void visit(BlockInput& in, Visit&& visit) {
    visit(in.x);
  }
};

namespace {

struct MapBlockImpl : torch::nn::Module {
  MapBlockImpl() {
    fc = register_module("fc", torch::nn::Linear(kDim, kHidden));
    gate = register_module("gate", torch::nn::Linear(kHidden, kDim));
    value = register_module("value", torch::nn::Linear(kHidden, kDim));
  }
  std::map<std::string, torch::Tensor> forward(torch::Tensor x) {
    auto h = torch::relu(fc(x));
    return {{"gate", torch::sigmoid(gate(h))}, {"value", value(h)}};
  }
  torch::nn::Linear fc{nullptr}, gate{nullptr}, value{nullptr};
};
TORCH_MODULE(MapBlock);

struct IntMapBlockImpl : torch::nn::Module {
  IntMapBlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(kDim, kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, kDim));
  }
  std::unordered_map<int, torch::Tensor> forward(torch::Tensor x) {
    auto h = torch::tanh(fc1(x));
    return {{0, fc2(h)}, {1, h}, {2, x}};
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(IntMapBlock);

struct StructBlockImpl : torch::nn::Module {
  StructBlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(kDim, kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, kDim));
    side = register_module("side", torch::nn::Linear(kHidden, kDim));
  }
  BlockOutput forward(BlockInput in) {
    auto h = torch::relu(fc1(in.x * in.scale));
    return BlockOutput{in.x + fc2(h), {side(h), torch::tanh(side(h))}, 1};
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, side{nullptr};
};
TORCH_MODULE(StructBlock);

struct ShapesNetImpl : torch::nn::Module {
  ShapesNetImpl() {
    input = register_module("input", torch::nn::Linear(kIn, kDim));
    map_block = register_module("map_block", MapBlock());
    int_map_block = register_module("int_map_block", IntMapBlock());
    struct_block = register_module("struct_block", StructBlock());
    output = register_module("output", torch::nn::Linear(kDim, kOut));
  }
  // `plain`: the reference's forward (forward() calls, no fsdp code on the path).
  torch::Tensor run(torch::Tensor x, bool plain) {
    x = torch::tanh(input(x));
    auto m = plain ? map_block->forward(x) : fsdp::nn::call(map_block, x);
    x = x + m.at("gate") * m.at("value");
    auto u = plain ? int_map_block->forward(x) : fsdp::nn::call(int_map_block, x);
    x = u.at(0) + 0.5 * u.at(2) + 0.1 * u.at(1).sum(-1, /*keepdim=*/true);
    BlockInput in{x, 0.75};
    auto s = plain ? struct_block->forward(in) : fsdp::nn::call(struct_block, in);
    EXPECT_EQ(s.calls, 1);
    x = s.hidden + 0.5 * s.aux[0] - 0.25 * s.aux[1];
    return output(x);
  }
  torch::Tensor forward(torch::Tensor x) { return run(x, /*plain=*/false); }
  torch::nn::Linear input{nullptr}, output{nullptr};
  MapBlock map_block{nullptr};
  IntMapBlock int_map_block{nullptr};
  StructBlock struct_block{nullptr};
};
TORCH_MODULE(ShapesNet);

// Max relative difference per parameter <= 1e-6, and the reference moved.
void expect_parity_1e6(const Params& got, const Params& ref, const Params& init) {
  ASSERT_EQ(got.size(), ref.size());
  double worst = 0, moved = 0;
  for (const auto& [name, r] : ref) {
    ASSERT_TRUE(got.count(name)) << name;
    const double d = max_rel_diff(got.at(name), r);
    worst = std::max(worst, d);
    EXPECT_LE(d, 1e-6) << name;
    moved = std::max(moved, max_rel_diff(r, init.at(name)));
  }
  EXPECT_GT(moved, 1e-2) << "the reference did not train";
  std::cout << "[parity] " << ref.size() << " parameters, worst relative difference " << worst
            << ", training moved them by up to " << moved << "\n";
}

void train_and_compare(bool checkpoint) {
  torch::manual_seed(21);
  ShapesNet model;
  const Params init = snapshot(*model);
  ShapesNet reference;
  copy_params(*model, *reference);
  const Params ref =
      train_reference(*reference, [&](torch::Tensor x) { return reference->run(x, /*plain=*/true); }, Opt::SGD);

  if (checkpoint) {
    fsdp::checkpoint_module(model->map_block);
    fsdp::checkpoint_module(model->struct_block);
  }
  fsdp::fully_shard(model->map_block, shard_options());
  fsdp::fully_shard(model->int_map_block, shard_options());
  fsdp::fully_shard(model->struct_block, shard_options());
  fsdp::fully_shard(model, shard_options());
  fsdp::reset_checkpoint_stats(model);

  auto world = test_world();
  const int64_t rank = world->rank(), local = kGlobalBatch / world->size();
  auto optim = make_optimizer(Opt::SGD, model->parameters());
  auto group = world_mesh().group(0);
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [gx, gy] = global_batch(step);
    optim->zero_grad();
    fsdp::reset_comm_stats(*group);
    auto out = fsdp::nn::call(model, gx.narrow(0, rank * local, local));
    const int64_t forward_gathers = fsdp::comm_stats(*group).all_gather_calls;
    torch::mse_loss(out, gy.narrow(0, rank * local, local)).backward();
    // Root + 3 blocks gathered in forward; the 3 blocks (resharded after forward) again in backward — only
    // their pre-backward hooks, armed on the map / struct outputs, do that.
    EXPECT_EQ(forward_gathers, 4) << "step " << step;
    EXPECT_EQ(fsdp::comm_stats(*group).all_gather_calls - forward_gathers, 3) << "step " << step;
    EXPECT_EQ(fsdp::comm_stats(*group).reduce_scatter_calls, 4) << "step " << step;
    optim->step();
  }
  if (checkpoint) {
    EXPECT_EQ(fsdp::checkpoint_stats(model).recomputes, 2 * kSteps) << "checkpointing did not run";
  }
  const Params got = fsdp::full_state_dict(*model, {/*cpu_offload=*/true, /*rank0_only=*/false});
  expect_parity_1e6(got, ref, init);
}

struct OpaqueOutImpl : torch::nn::Module {
  OpaqueOutImpl() { fc = register_module("fc", torch::nn::Linear(kIn, kOut)); }
  std::tuple<torch::Tensor, std::optional<Opaque>> forward(torch::Tensor x) { return {fc(x), Opaque{fc(x)}}; }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(OpaqueOut);

struct OpaqueInImpl : torch::nn::Module {
  OpaqueInImpl() { fc = register_module("fc", torch::nn::Linear(kIn, kOut)); }
  torch::Tensor forward(torch::Tensor x, Opaque extra) { return fc(x) + extra.t; }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(OpaqueIn);

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

}  // namespace

TEST(ForwardShapes, MapUnorderedMapAndStructOutputsTrainLikeSingleProcess) { train_and_compare(false); }

TEST(ForwardShapes, WithActivationCheckpointingOnTheMapAndStructModules) { train_and_compare(true); }

TEST(ForwardShapes, HiddenTensorsAreRefusedBeforeTheHooksRun) {
  auto x = torch::randn({4, kIn});
  // Without hooks any type passes: call() is forward().
  OpaqueOut out_module;
  OpaqueIn in_module;
  EXPECT_TRUE(std::get<1>(fsdp::nn::call(out_module, x)).has_value());
  EXPECT_EQ(fsdp::nn::call(in_module, x, Opaque{torch::ones({4, kOut})}).sizes(), (std::vector<int64_t>{4, kOut}));

  fsdp::fully_shard(out_module, shard_options());
  fsdp::fully_shard(in_module, shard_options());
  auto group = world_mesh().group(0);
  fsdp::reset_comm_stats(*group);
  const std::string out_error = error_of([&] { fsdp::nn::call(out_module, x); });
  EXPECT_EQ(out_error.rfind("fsdp::nn::call: ", 0), 0u) << out_error;
  EXPECT_NE(out_error.find("OpaqueOutImpl has forward hooks"), std::string::npos) << out_error;
  EXPECT_NE(out_error.find("which holds "), std::string::npos) << out_error;
  EXPECT_NE(out_error.find("Opaque: a type whose tensors the hooks cannot see"), std::string::npos) << out_error;
  EXPECT_NE(out_error.find("fsdp::nn::TensorFields<"), std::string::npos) << out_error;
  const std::string in_error = error_of([&] { fsdp::nn::call(in_module, x, Opaque{torch::ones({4, kOut})}); });
  EXPECT_NE(in_error.find("OpaqueInImpl has forward hooks"), std::string::npos) << in_error;
  EXPECT_NE(in_error.find("takes as argument 1"), std::string::npos) << in_error;
  // Refused before the pre-hooks: nothing was gathered, nothing is left to undo.
  EXPECT_EQ(fsdp::comm_stats(*group).all_gather_calls, 0);
  for (const auto& p : out_module->parameters()) EXPECT_LT(p.numel(), kIn * kOut) << "left unsharded";
}
