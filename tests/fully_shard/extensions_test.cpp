// FSDP2's extension points (issue 24): custom all-gather / reduce-scatter objects, and a per-parameter
// all-gather transform shown with ZeRO++'s int8 weights.
//
// * The user's allocate() and collective are called (counted) and training equals the built-in path bit for bit.
// * A frozen base all-gathered as int8 with per-row fp32 scales: bytes on the wire equal the analytic count from
//   the layout (about 1/4 of fp32 plus the scales), the forward equals a reference model whose base holds the
//   dequantized weight (quantized here, independently), and the trainable layers beside it train exactly like
//   single-process training of that reference.
#include "fully_shard/fsdp_test_util.h"

#include <fsdp/comm_stats.h>
#include <fsdp/fully_shard_extensions.h>

using namespace fsdp_test;

namespace {

struct CountingAllGather : fsdp::FSDPAllGather {
  int allocations = 0, calls = 0;
  at::Tensor allocate(int64_t numel, c10::ScalarType dtype, c10::Device device) override {
    ++allocations;
    return torch::empty({numel}, torch::TensorOptions().dtype(dtype).device(device));
  }
  fsdp::Work operator()(at::Tensor output, at::Tensor input, fsdp::ProcessGroup& group) override {
    ++calls;
    return group.all_gather_into_tensor(output, input);
  }
};

struct CountingReduceScatter : fsdp::FSDPReduceScatter {
  int allocations = 0, calls = 0;
  at::Tensor allocate(int64_t numel, c10::ScalarType dtype, c10::Device device) override {
    ++allocations;
    return torch::empty({numel}, torch::TensorOptions().dtype(dtype).device(device));
  }
  fsdp::Work operator()(at::Tensor output, at::Tensor input, fsdp::ProcessGroup& group, fsdp::ReduceOp op) override {
    ++calls;
    return group.reduce_scatter_tensor(output, input, op);
  }
};

constexpr int64_t kIn = 7, kOut = 5, kGlobalBatch = 12, kSteps = 5;

std::map<std::string, torch::Tensor> train_mlp(bool custom, std::vector<std::shared_ptr<CountingAllGather>>& ags,
                                               std::vector<std::shared_ptr<CountingReduceScatter>>& rss) {
  auto world = test_world();
  const int64_t rank = world->rank(), n = world->size();
  MLP model = make_mlp(42);
  fsdp::FullyShardOptions opts;
  opts.mesh = fsdp::init_device_mesh("cpu", {n});
  auto units = shard_mlp(model, opts);
  if (custom) {
    for (auto& u : units) {
      ags.push_back(std::make_shared<CountingAllGather>());
      rss.push_back(std::make_shared<CountingReduceScatter>());
      u.set_custom_all_gather(ags.back());
      u.set_custom_reduce_scatter(rss.back());
    }
  }
  torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-2));
  const int64_t local = kGlobalBatch / n;
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step, kGlobalBatch, kIn, kOut);
    optim.zero_grad();
    torch::mse_loss(fsdp::nn::call(model, x.narrow(0, rank * local, local)), y.narrow(0, rank * local, local)).backward();
    optim.step();
  }
  return full_params(*model, units);
}

}  // namespace

TEST(FullyShardExtensions, CustomAllGatherAndReduceScatterAreCalledAndEqualTheBuiltInPathBitForBit) {
  auto world = test_world();
  std::vector<std::shared_ptr<CountingAllGather>> unused_ag, ags;
  std::vector<std::shared_ptr<CountingReduceScatter>> unused_rs, rss;
  const auto builtin = train_mlp(false, unused_ag, unused_rs);
  const auto custom = train_mlp(true, ags, rss);
  const auto initial = initial_mlp_params(42);
  for (const auto& [name, t] : builtin) {
    EXPECT_GT((t - initial.at(name)).abs().max().item<double>(), 1e-3) << name << " did not train";
    EXPECT_TRUE(torch::equal(custom.at(name), t)) << name << ": differs from the built-in path";
  }
  ASSERT_EQ(ags.size(), 4u);
  for (size_t i = 0; i < ags.size(); ++i) {
    // Blocks reshard after forward: gathered in forward and again in backward; the root keeps its parameters.
    const int gathers_per_step = i + 1 < ags.size() ? 2 : 1;
    EXPECT_EQ(ags[i]->calls, gathers_per_step * kSteps) << "group " << i;
    EXPECT_EQ(ags[i]->allocations, ags[i]->calls) << "group " << i;
    EXPECT_EQ(rss[i]->calls, kSteps) << "group " << i;  // one reduce-scatter per group per step
    EXPECT_EQ(rss[i]->allocations, rss[i]->calls) << "group " << i;
  }
}

// ---- int8 frozen base ------------------------------------------------------------------------------------

namespace {

constexpr int64_t kBaseIn = 64, kBaseOut = 22, kHead = 6;

struct AdaptedImpl : torch::nn::Module {
  AdaptedImpl() {
    base = register_module("base", torch::nn::Linear(torch::nn::LinearOptions(kBaseIn, kBaseOut).bias(false)));
    adapter = register_module("adapter", torch::nn::Linear(kBaseIn, kBaseOut));
    head = register_module("head", torch::nn::Linear(kBaseOut, kHead));
    base->weight.requires_grad_(false);  // the frozen base model
  }
  torch::Tensor forward(torch::Tensor x) {
    return head(torch::tanh(fsdp::nn::call(base, x) + adapter(x)));
  }
  torch::nn::Linear base{nullptr}, adapter{nullptr}, head{nullptr};
};
TORCH_MODULE(Adapted);

// The dequantized weight, computed here from the definition: per row r, s = max|w_r| / 127 (1 if the row is
// zero), q = round(w / s) clamped to [-127, 127], w' = q * s.
torch::Tensor int8_rowwise_reference(const torch::Tensor& w) {
  auto s = w.abs().amax(1, /*keepdim=*/true) / 127.0;
  s = torch::where(s > 0, s, torch::ones_like(s));
  return (w / s).round().clamp(-127, 127) * s;
}

int64_t align16(int64_t n) { return (n + 15) / 16 * 16; }

}  // namespace

TEST(FullyShardExtensions, Int8FrozenBaseAllGatherSendsAQuarterAndTrainsTheAdapterExactly) {
  auto world = test_world();
  const int64_t rank = world->rank(), n = world->size();
  torch::manual_seed(5);
  Adapted model;
  torch::manual_seed(5);
  Adapted reference;
  {
    torch::NoGradGuard no_grad;
    reference->base->weight.copy_(int8_rowwise_reference(reference->base->weight));
  }
  // The quantization really changes the weight (else the comparisons below could not tell).
  EXPECT_GT((reference->base->weight - model->base->weight).abs().max().item<double>(), 1e-5);

  fsdp::FullyShardOptions base_opts;
  base_opts.mesh = fsdp::init_device_mesh("cpu", {n});
  base_opts.all_gather_transform_fn = [](const at::Tensor& p) -> std::shared_ptr<const fsdp::AllGatherTransform> {
    if (p.requires_grad() || p.dim() < 2) return nullptr;
    return std::make_shared<fsdp::Int8RowwiseAllGather>();
  };
  fsdp::FullyShardOptions root_opts;
  root_opts.mesh = base_opts.mesh;
  auto base_unit = fsdp::fully_shard(model->base, base_opts);  // int8 for this module only
  auto root_unit = fsdp::fully_shard(model, root_opts);
  fsdp::ProcessGroup& group = *base_opts.mesh.group(0);

  // Bytes on the wire of one forward without gradients (each group all-gathers once), from the layout:
  // base: int8 rows + one fp32 scale per row; root: adapter and head in fp32; every piece 16-byte aligned.
  auto chunk = [&](int64_t rows) { return (rows + n - 1) / n; };
  const int64_t base_int8 = align16(chunk(kBaseOut) * kBaseIn) + align16(chunk(kBaseOut) * 4);
  const int64_t base_fp32 = align16(chunk(kBaseOut) * kBaseIn * 4);
  const int64_t root_bytes = align16(chunk(kBaseOut) * kBaseIn * 4) + align16(chunk(kBaseOut) * 4) +
                             align16(chunk(kHead) * kBaseOut * 4) + align16(chunk(kHead) * 4);
  auto x = torch::randn({4, kBaseIn});
  fsdp::reset_comm_stats(group);
  torch::Tensor out;
  {
    torch::NoGradGuard no_grad;
    out = fsdp::nn::call(model, x);
  }
  EXPECT_EQ(fsdp::comm_stats(group).all_gather_calls, n > 1 ? 2 : 0);
  EXPECT_EQ(fsdp::comm_stats(group).bytes_sent, (n - 1) * (base_int8 + root_bytes));
  std::cout << "int8 base all-gather: " << base_int8 << " bytes per rank vs " << base_fp32 << " in fp32 ("
            << static_cast<double>(base_int8) / base_fp32 << ")\n";
  EXPECT_LT(static_cast<double>(base_int8) / base_fp32, 0.3);
  // The forward equals the reference built on the dequantized weight.
  torch::Tensor want;
  {
    torch::NoGradGuard no_grad;
    want = reference(x);
  }
  EXPECT_TRUE(torch::allclose(out, want, 1e-6, 1e-6)) << (out - want).abs().max().item<double>();

  // Training: the adapter and head equal single-process training of the reference on the global batch.
  std::vector<torch::Tensor> trainable;
  for (auto& p : model->parameters()) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  std::vector<torch::Tensor> ref_trainable;
  for (auto& p : reference->parameters()) {
    if (p.requires_grad()) ref_trainable.push_back(p);
  }
  ASSERT_EQ(trainable.size(), 4u);
  torch::optim::SGD optim(trainable, torch::optim::SGDOptions(0.1));
  torch::optim::SGD ref_optim(ref_trainable, torch::optim::SGDOptions(0.1));
  const int64_t global = 12, local = global / n;  // 2 and 3 ranks
  for (int64_t step = 0; step < 6; ++step) {
    auto [gx, gy] = global_batch(step, global, kBaseIn, kHead);
    ref_optim.zero_grad();
    torch::mse_loss(reference(gx), gy).backward();
    ref_optim.step();
    optim.zero_grad();
    torch::mse_loss(fsdp::nn::call(model, gx.narrow(0, rank * local, local)), gy.narrow(0, rank * local, local))
        .backward();
    optim.step();
  }
  auto got = fsdp::full_state_dict(*model, {/*cpu_offload=*/true, /*rank0_only=*/false});
  for (const auto& item : reference->named_parameters()) {
    if (!item.value().requires_grad()) continue;
    EXPECT_LT(max_rel_diff(got.at(item.key()), item.value().detach()), 1e-5) << item.key();
  }
  // The frozen base's shards are untouched: the full-precision weight, not the dequantized one.
  torch::manual_seed(5);
  Adapted fresh;
  EXPECT_TRUE(torch::equal(got.at("base.weight"), fresh->base->weight.detach()));
}
