// The rest of FSDP2's API (issue 10) and tied parameters, each against an independent reference:
// single-process training on the same global batch (plain libtorch, no fully_shard), collective counts, or
// analytic values — never fully_shard's own output.
//
//   shard_placement_fn (Shard(1), uneven)      trains equal to single-process; state dicts and checkpoints say Shard(1)
//   tied weights (embedding = output head)     one group trains equal to single-process; two groups rejected at once
//   set_unshard_in_backward(false)             one backward all-gather fewer, same training
//   fsdp::nn::call_method                      a method other than forward runs with the hooks (train, generate)
//   set_all_reduce_hook / force_sum            hook sees the averaged (or, forced, summed) reduction; FSDP and HSDP
//   set_post_optim_event                       waited once by the next root forward (no-op on the CPU)
//   ignored_params                             not sharded, not moved, gradient not reduced (the local gradient)
//   MixedPrecisionPolicy::buffer_dtype         buffers kept in it; state dicts in the original dtype
#include "fully_shard/fsdp_state.h"
#include "fully_shard/fsdp_test_util.h"
#include "fully_shard/runtime_test_util.h"

#include <fsdp/checkpoint/checkpoint.h>
#include <fsdp/comm_stats.h>
#include <fsdp/nn/call_method.h>
#include <fsdp/sharded_tensor.h>

#include <filesystem>
#include <unordered_set>

using namespace fsdp_test;

using fsdp_rt::nranks;
using fsdp_rt::rank;
using fsdp_rt::world_mesh;

namespace {

constexpr int64_t kBatch = 12;  // divisible by 1, 2, 3, 4

// Rows of the global batch this side sees: all of them for the reference, its slice for a rank.
torch::Tensor local_rows(const torch::Tensor& global, bool sharded) {
  if (!sharded) return global;
  const int64_t local = global.size(0) / nranks();
  return global.narrow(0, rank() * local, local);
}

// ---------------------------------------------------------------------------------------------------------
// shard_placement_fn

std::optional<int64_t> dim1_for_matrices(const torch::Tensor& p) {
  return p.dim() == 2 ? std::optional<int64_t>(1) : std::nullopt;
}

std::map<std::string, torch::Tensor> train_mlp(bool sharded, const fsdp::FullyShardOptions& opts, int64_t steps,
                                               MLP* keep = nullptr) {
  MLP model = make_mlp(11, 2);
  std::vector<fsdp::FSDPModule> units;
  if (sharded) units = shard_mlp(model, opts);
  // SGD: Adam's 1/sqrt(v) amplifies last-bit differences of sums taken in another order (see
  // transformer_parity_test.cpp).
  torch::optim::SGD optim(unique_params(*model), torch::optim::SGDOptions(0.2).momentum(0.9));
  for (int64_t step = 0; step < steps; ++step) {
    auto [x, y] = global_batch(step, kBatch, 7, 5);
    optim.zero_grad();
    auto out = fsdp::nn::call(model, local_rows(x, sharded));
    torch::mse_loss(out, local_rows(y, sharded)).backward();
    optim.step();
  }
  if (keep) *keep = model;
  return sharded ? full_params(*model, units) : reference_params(*model);
}

TEST(ShardPlacement, Dim1TrainsEqualToSingleProcess) {
  fsdp::FullyShardOptions opts;
  opts.mesh = world_mesh();
  opts.shard_placement_fn = dim1_for_matrices;
  MLP model{nullptr};
  auto got = train_mlp(true, opts, 6, &model);
  auto ref = train_mlp(false, {}, 6);
  expect_equal_maps(got, ref, 1e-5, "shard on dim 1");

  // The shards really are column blocks (torch.chunk on dim 1, uneven: 19 and 13 columns), and the state
  // dict says so.
  auto sd = fsdp::sharded_state_dict(*model);
  for (const auto& item : model->named_parameters()) {
    const auto& st = sd.at(item.key());
    const auto& p = item.value();
    const int64_t dim = p.dim() == 2 ? 1 : 0;
    EXPECT_EQ(st.placements(), fsdp::Placements{fsdp::Shard(dim)}) << item.key();
    const auto [offset, size] = fsdp::shard_offset_and_size(st.sizes()[dim], nranks(), rank());
    EXPECT_EQ(p.size(dim), size) << item.key();
    if (p.dim() == 2) EXPECT_EQ(p.size(0), st.sizes()[0]) << item.key();
    EXPECT_EQ(st.local_offset()[dim], offset) << item.key();
    // This rank's block of the reference values (training ran identically).
    EXPECT_LE(max_rel_diff(p.detach(), ref.at(item.key()).narrow(dim, offset, size)), 1e-5) << item.key();
  }

  // Checkpoint planning handles Shard(1): save from the dim-1 model, load into a dim-0 sharded one.
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("fsdp_api_test_shard1_" + std::to_string(nranks()))).string();
  fsdp::checkpoint::StateDict to_save;
  to_save.tensors = sd;
  fsdp::checkpoint::save(to_save, dir);
  MLP other = make_mlp(99, 2);
  fsdp::FullyShardOptions dim0;
  dim0.mesh = world_mesh();
  auto other_units = shard_mlp(other, dim0);
  fsdp::checkpoint::StateDict to_load;
  to_load.tensors = fsdp::sharded_state_dict(*other);
  fsdp::checkpoint::load(to_load, dir);
  expect_equal_maps(full_params(*other, other_units), ref, 1e-5, "checkpoint Shard(1) -> Shard(0)");
  // And a full state dict loads back into a dim-1 model.
  MLP again = make_mlp(98, 2);
  auto again_units = shard_mlp(again, opts);
  fsdp::load_full_state_dict(*again, fsdp::full_state_dict(*other, {false, false}));
  expect_equal_maps(full_params(*again, again_units), ref, 1e-5, "full state dict -> Shard(1)");
  test_world()->barrier().wait();
  if (rank() == 0) std::filesystem::remove_all(dir);
}

TEST(ShardPlacement, NegativeAndInvalidDims) {
  fsdp::FullyShardOptions opts;
  opts.mesh = world_mesh();
  opts.shard_placement_fn = [](const torch::Tensor& p) { return std::optional<int64_t>(p.dim() == 2 ? -1 : 0); };
  auto got = train_mlp(true, opts, 2);
  expect_equal_maps(got, train_mlp(false, {}, 2), 1e-5, "shard on dim -1");

  opts.shard_placement_fn = [](const torch::Tensor&) { return std::optional<int64_t>(2); };
  MLP model = make_mlp(1, 1);
  try {
    fsdp::fully_shard(model->blocks[0], opts);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("has no such dim"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fsdp::fsdp_module(*model->blocks[0]).has_value());
}

// ---------------------------------------------------------------------------------------------------------
// Tied weights: the embedding table is the output head's weight.

struct EmbedImpl : torch::nn::Module {
  EmbedImpl(int64_t vocab, int64_t dim) { weight = register_parameter("weight", torch::randn({vocab, dim}) * 0.5); }
  torch::Tensor forward(torch::Tensor tokens) { return at::embedding(weight, tokens); }
  torch::Tensor weight;
};
TORCH_MODULE(Embed);

struct HeadImpl : torch::nn::Module {
  explicit HeadImpl(torch::Tensor tied) { weight = register_parameter("weight", std::move(tied)); }
  torch::Tensor forward(torch::Tensor h) { return at::linear(h, weight); }
  torch::Tensor weight;
};
TORCH_MODULE(Head);

constexpr int64_t kVocab = 37, kModel = 12, kSeq = 5;  // 37 rows: 13/13/11 on 3 ranks, 19/18 on 2

struct TiedLMImpl : torch::nn::Module {
  explicit TiedLMImpl(bool tied = true) {
    tok = register_module("tok", Embed(kVocab, kModel));
    blocks = register_module("blocks", torch::nn::ModuleList(Block(kModel, 10), Block(kModel, 10)));
    head = register_module("head", Head(tied ? tok->weight : torch::randn({kVocab, kModel}) * 0.3));
  }
  torch::Tensor forward(torch::Tensor tokens) {
    auto h = fsdp::nn::call(tok, tokens);
    for (size_t i = 0; i < blocks->size(); ++i) h = fsdp::nn::call(blocks->ptr<BlockImpl>(i), h);
    return fsdp::nn::call(head, torch::tanh(h));
  }
  Embed tok{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  Head head{nullptr};
};
TORCH_MODULE(TiedLM);

torch::Tensor lm_tokens(int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  return torch::randint(0, kVocab, {kBatch, kSeq + 1}, gen);
}

enum class TiedSharding { None, OneGroupForBoth, CommonParent };

std::map<std::string, torch::Tensor> train_tied(TiedSharding how, int64_t steps, TiedLM* keep = nullptr) {
  torch::manual_seed(21);
  TiedLM model;
  const bool sharded = how != TiedSharding::None;
  if (sharded) {
    fsdp::FullyShardOptions opts;
    opts.mesh = world_mesh();
    for (size_t i = 0; i < model->blocks->size(); ++i) fsdp::fully_shard(model->blocks[i], opts);
    if (how == TiedSharding::OneGroupForBoth) {
      fsdp::fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{model->tok.ptr(), model->head.ptr()}, opts);
    }
    fsdp::fully_shard(model, opts);
  }
  torch::optim::SGD optim(unique_params(*model), torch::optim::SGDOptions(0.5).momentum(0.9));
  for (int64_t step = 0; step < steps; ++step) {
    auto tokens = local_rows(lm_tokens(step), sharded);
    optim.zero_grad();
    auto logits = fsdp::nn::call(model, tokens.narrow(1, 0, kSeq));
    torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), tokens.narrow(1, 1, kSeq).reshape({-1}))
        .backward();
    optim.step();
  }
  if (keep) *keep = model;
  return sharded ? full_params(*model, {}) : reference_params(*model);
}

TEST(TiedWeights, EmbeddingEqualsOutputHeadTrainsEqualToSingleProcess) {
  auto ref = train_tied(TiedSharding::None, 6);
  ASSERT_EQ(ref.count("head.weight"), 0u);  // one tensor, listed under its first name
  torch::manual_seed(21);
  TiedLM init;
  for (auto how : {TiedSharding::OneGroupForBoth, TiedSharding::CommonParent}) {
    TiedLM model{nullptr};
    auto got = train_tied(how, 6, &model);
    const std::string what = how == TiedSharding::OneGroupForBoth ? "fully_shard({tok, head})" : "common parent";
    expect_equal_maps(got, ref, 1e-5, what);
    // Still one tensor, sharded once; every vocabulary row was updated — on the last rank's short shard too
    // (PyTorch #176076 skipped those).
    EXPECT_TRUE(model->head->weight.is_same(model->tok->weight)) << what;
    auto moved = (got.at("tok.weight") - init->tok->weight).abs().amax(1);
    EXPECT_GT(moved.min().item<double>(), 1e-4) << what;
  }
}

TEST(TiedWeights, TwoGroupsRejectedAtTheSecondCall) {
  torch::manual_seed(21);
  TiedLM model;
  fsdp::FullyShardOptions opts;
  opts.mesh = world_mesh();
  fsdp::fully_shard(model->tok, opts);
  const auto shard_sizes = model->tok->weight.sizes().vec();
  try {
    fsdp::fully_shard(model->head, opts);
    FAIL() << "expected the second fully_shard to be rejected";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'weight' is already managed"), std::string::npos) << msg;
    EXPECT_NE(msg.find("fully_shard({"), std::string::npos) << msg;       // the fix: one call for both
    EXPECT_NE(msg.find("common parent"), std::string::npos) << msg;       // or shard the common parent
  }
  // Nothing changed by the refused call: no FSDP state on head, the tied tensor still shows tok's shard.
  EXPECT_FALSE(fsdp::fsdp_module(*model->head).has_value());
  EXPECT_TRUE(model->head->weight.is_same(model->tok->weight));
  EXPECT_EQ(model->tok->weight.sizes().vec(), shard_sizes);
  // Sharding the head's parent instead is fine: the tied tensor stays in tok's group.
  EXPECT_NO_THROW(fsdp::fully_shard(model, opts));
}

// ---------------------------------------------------------------------------------------------------------
// set_unshard_in_backward(false): the embedding's backward needs only the token ids, not the table.

TEST(UnshardInBackward, SkipsTheBackwardAllGatherAndTrainsTheSame) {
  const int64_t steps = 4;
  // Reference: an untied model on one process.
  auto train = [&](bool sharded, bool unshard_in_backward, std::vector<int64_t>* backward_gathers) {
    torch::manual_seed(31);
    TiedLM model(/*tied=*/false);
    if (sharded) {
      fsdp::FullyShardOptions opts;
      opts.mesh = world_mesh();
      auto tok = fsdp::fully_shard(model->tok, opts);
      for (size_t i = 0; i < model->blocks->size(); ++i) fsdp::fully_shard(model->blocks[i], opts);
      fsdp::fully_shard(model, opts);
      tok.set_unshard_in_backward(unshard_in_backward);
    }
    torch::optim::SGD optim(unique_params(*model), torch::optim::SGDOptions(0.5).momentum(0.9));
    auto group = world_mesh().group(0);
    for (int64_t step = 0; step < steps; ++step) {
      auto tokens = local_rows(lm_tokens(step), sharded);
      optim.zero_grad();
      auto logits = fsdp::nn::call(model, tokens.narrow(1, 0, kSeq));
      auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}),
                                                       tokens.narrow(1, 1, kSeq).reshape({-1}));
      const int64_t before = fsdp::comm_stats(*group).all_gather_calls;
      loss.backward();
      if (backward_gathers) backward_gathers->push_back(fsdp::comm_stats(*group).all_gather_calls - before);
      optim.step();
    }
    return sharded ? full_params(*model, {}) : reference_params(*model);
  };
  auto ref = train(false, true, nullptr);
  std::vector<int64_t> with, without;
  expect_equal_maps(train(true, true, &with), ref, 1e-5, "unshard_in_backward=true");
  expect_equal_maps(train(true, false, &without), ref, 1e-5, "unshard_in_backward=false");
  // Groups: tok, 2 blocks (resharded after forward), root (kept): backward gathers 3, or 2 without tok's.
  for (int64_t step = 0; step < steps; ++step) {
    EXPECT_EQ(with[step], 3) << step;
    EXPECT_EQ(without[step], 2) << step;
  }
}

// ---------------------------------------------------------------------------------------------------------
// fsdp::nn::call_method (register_fsdp_forward_method)

struct MethodMLPImpl : MLPImpl {
  MethodMLPImpl() : MLPImpl(7, 19, 13, 5, 2) {}
  torch::Tensor loss(torch::Tensor x, torch::Tensor y) { return torch::mse_loss(forward(x), y); }
  // Autoregressive-style: feeds its output back `steps` times.
  torch::Tensor generate(torch::Tensor x, int64_t steps) {
    for (int64_t i = 0; i < steps; ++i) x = torch::cat({torch::tanh(forward(x)), x.narrow(1, 5, 2)}, 1);
    return x;
  }
};

TEST(CallMethod, TrainsAndGeneratesWithTheHooks) {
  auto run = [](bool sharded, torch::Tensor* generated, int64_t* root_gathers) {
    torch::manual_seed(41);
    auto model = std::make_shared<MethodMLPImpl>();
    std::vector<fsdp::FSDPModule> units;
    if (sharded) {
      fsdp::FullyShardOptions opts;
      opts.mesh = world_mesh();
      for (size_t i = 0; i < model->blocks->size(); ++i) units.push_back(fsdp::fully_shard(model->blocks[i], opts));
      units.push_back(fsdp::fully_shard(model, opts));
    }
    torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.2).momentum(0.9));
    auto group = world_mesh().group(0);
    const int64_t before = fsdp::comm_stats(*group).all_gather_calls;
    for (int64_t step = 0; step < 4; ++step) {
      auto [x, y] = global_batch(step, kBatch, 7, 5);
      optim.zero_grad();
      fsdp::nn::call_method(model, &MethodMLPImpl::loss, local_rows(x, sharded), local_rows(y, sharded)).backward();
      optim.step();
    }
    if (root_gathers) *root_gathers = fsdp::comm_stats(*group).all_gather_calls - before;
    {
      torch::NoGradGuard no_grad;
      auto [x, y] = global_batch(100, kBatch, 7, 5);
      *generated = fsdp::nn::call_method(model, &MethodMLPImpl::generate, x, int64_t{3});
    }
    if (sharded) {
      // Between calls every parameter shows its shard again.
      for (const auto& u : units) EXPECT_FALSE(fsdp::detail::FSDPModuleAccess::state(u).param_group()->is_unsharded());
    }
    return sharded ? full_params(*model, units) : reference_params(*model);
  };
  torch::Tensor gen_ref, gen_got;
  int64_t gathers = 0;
  auto ref = run(false, &gen_ref, nullptr);
  auto got = run(true, &gen_got, &gathers);
  expect_equal_maps(got, ref, 1e-5, "training through call_method(loss)");
  EXPECT_LE(max_rel_diff(gen_got, gen_ref), 1e-5);
  // Per step: 3 groups gathered in forward, the 2 blocks again in backward.
  EXPECT_EQ(gathers, 4 * (3 + 2));
}

// ---------------------------------------------------------------------------------------------------------
// set_all_reduce_hook and set_force_sum_reduction_for_comms

struct HookRun {
  std::map<std::string, torch::Tensor> grads;
  std::vector<torch::Tensor> seen;  // what the hooks were given, in call order
  int64_t all_reduces = 0;
};

// One forward/backward of the MLP on the global batch (each rank its rows), a hook on every group that records
// its input and then doubles it.
HookRun hook_run(const fsdp::DeviceMesh& mesh, bool force_sum, bool all_reduce = true) {
  MLP model = make_mlp(51, 2);
  fsdp::FullyShardOptions opts;
  opts.mesh = mesh;
  auto units = shard_mlp(model, opts);
  HookRun run;
  for (auto& u : units) {
    u.set_all_reduce_hook([&run](at::Tensor& t) {
      run.seen.push_back(t.clone());
      t.mul_(2);
    });
    u.set_force_sum_reduction_for_comms(force_sum, /*recurse=*/false);
    u.set_requires_all_reduce(all_reduce, false);
  }
  auto [x, y] = global_batch(0, kBatch, 7, 5);
  const auto replicate = mesh.ndim() == 2 ? mesh.group(0) : nullptr;
  const int64_t ar_before = replicate ? fsdp::comm_stats(*replicate).all_reduce_calls : 0;
  torch::mse_loss(fsdp::nn::call(model, local_rows(x, true)), local_rows(y, true)).backward();
  run.all_reduces = replicate ? fsdp::comm_stats(*replicate).all_reduce_calls - ar_before : 0;
  run.grads = full_grads(*model);
  return run;
}

std::map<std::string, torch::Tensor> reference_grads(uint64_t seed = 51) {
  MLP model = make_mlp(seed, 2);
  auto [x, y] = global_batch(0, kBatch, 7, 5);
  torch::mse_loss(model->forward(x), y).backward();
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : model->named_parameters()) out[item.key()] = item.value().grad().clone();
  return out;
}

TEST(AllReduceHook, SeesTheAveragedReductionOrTheSumWhenForced) {
  auto doubled = reference_grads();
  for (auto& [name, g] : doubled) g = g * 2;
  HookRun avg = hook_run(world_mesh(), /*force_sum=*/false);
  HookRun sum = hook_run(world_mesh(), /*force_sum=*/true);
  // Called once per group (3) per backward; its in-place change reaches the gradients.
  ASSERT_EQ(avg.seen.size(), 3u);
  ASSERT_EQ(sum.seen.size(), 3u);
  expect_equal_maps(avg.grads, doubled, 1e-5, "hook doubles (Avg)");
  expect_equal_maps(sum.grads, doubled, 1e-5, "hook doubles (forced Sum)");
  // Default: averaged inside the collective; forced Sum: the hook sees the sum, divided only afterwards.
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_LE(max_rel_diff(sum.seen[i], avg.seen[i] * static_cast<double>(nranks())), 1e-5) << i;
  }
}

TEST(AllReduceHook, HsdpSeesTheAllReducedOutput) {
  // (replicate = world, shard = 1): the reduce-scatter is the identity, the all-reduce averages across replicas.
  auto mesh = fsdp::init_device_mesh("cpu", {nranks(), 1}, {"replicate", "shard"});
  auto doubled = reference_grads();
  for (auto& [name, g] : doubled) g = g * 2;
  HookRun run = hook_run(mesh, false);
  ASSERT_EQ(run.seen.size(), 3u);
  EXPECT_EQ(run.all_reduces, nranks() > 1 ? 3 : 0);
  expect_equal_maps(run.grads, doubled, 1e-5, "HSDP hook");
  // The hook's input is already the global mean: each group's flat output holds the reference gradients.
  const auto ref = reference_grads();
  // (The root's group is reduced last, at the end of backward; input.weight is its first parameter.)
  EXPECT_LE(max_rel_diff(run.seen.back().narrow(0, 0, ref.at("input.weight").numel()),
                         ref.at("input.weight").reshape({-1})),
            1e-5);
  // Without the all-reduce (HSDP accumulation) nothing is finished, so the hook is not called (as in PyTorch).
  if (nranks() > 1) {
    HookRun partial = hook_run(mesh, false, /*all_reduce=*/false);
    EXPECT_EQ(partial.seen.size(), 0u);
    EXPECT_EQ(partial.all_reduces, 0);
  }
}

TEST(ForceSum, DivideFactorsMatchPyTorch) {
  using fsdp::detail::gradient_division;
  // fp32/bf16, not forced: averaged inside the collectives (Avg), nothing divided locally.
  auto d = gradient_division(c10::kFloat, 4, 2, std::nullopt, false);
  EXPECT_EQ(d.reduce_scatter_op, fsdp::ReduceOp::Avg);
  EXPECT_EQ(d.all_reduce_op, fsdp::ReduceOp::Avg);
  EXPECT_FALSE(d.pre_divide || d.post_divide);
  // A custom factor equal to the shard size: Avg; another one: pre-multiplied sum.
  EXPECT_EQ(gradient_division(c10::kBFloat16, 4, 1, 4.0, false).reduce_scatter_op, fsdp::ReduceOp::Avg);
  d = gradient_division(c10::kFloat, 4, 1, 3.0, false);
  EXPECT_EQ(d.reduce_scatter_op, fsdp::ReduceOp::Sum);
  EXPECT_EQ(d.pre_divide.value_or(0), 3.0);
  // Forced: Sum only, divided afterwards.
  d = gradient_division(c10::kFloat, 4, 2, std::nullopt, true);
  EXPECT_EQ(d.reduce_scatter_op, fsdp::ReduceOp::Sum);
  EXPECT_EQ(d.all_reduce_op, fsdp::ReduceOp::Sum);
  EXPECT_FALSE(d.pre_divide);
  EXPECT_EQ(d.post_divide.value_or(0), 8.0);
  // fp16: Sum with ~sqrt(N) before and the rest after, forced or not (8 = 4 * 2, 16 = 4 * 4).
  d = gradient_division(c10::kHalf, 8, 1, std::nullopt, false);
  EXPECT_EQ(d.pre_divide.value_or(0), 4.0);
  EXPECT_EQ(d.post_divide.value_or(0), 2.0);
  d = gradient_division(c10::kHalf, 16, 1, std::nullopt, true);
  EXPECT_EQ(d.pre_divide.value_or(0), 4.0);
  EXPECT_EQ(d.post_divide.value_or(0), 4.0);
  // One rank: nothing to divide.
  d = gradient_division(c10::kFloat, 1, 1, std::nullopt, false);
  EXPECT_EQ(d.reduce_scatter_op, fsdp::ReduceOp::Sum);
  EXPECT_FALSE(d.pre_divide || d.post_divide);
}

TEST(ForceSum, TrainsEqualToSingleProcess) {
  fsdp::FullyShardOptions opts;
  opts.mesh = world_mesh();
  MLP model = make_mlp(11, 2);
  auto units = shard_mlp(model, opts);
  units.back().set_force_sum_reduction_for_comms(true);
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.2).momentum(0.9));
  for (int64_t step = 0; step < 4; ++step) {
    auto [x, y] = global_batch(step, kBatch, 7, 5);
    optim.zero_grad();
    torch::mse_loss(fsdp::nn::call(model, local_rows(x, true)), local_rows(y, true)).backward();
    optim.step();
  }
  expect_equal_maps(full_params(*model, units), train_mlp(false, {}, 4), 1e-5, "forced Sum");
}

// ---------------------------------------------------------------------------------------------------------
// set_post_optim_event

TEST(PostOptimEvent, WaitedOnceByTheNextRootForward) {
  MLP model = make_mlp(61, 2);
  fsdp::FullyShardOptions opts;
  opts.mesh = world_mesh();
  auto units = shard_mlp(model, opts);
  // Set before the first forward, on a non-root module: kept until the root's context exists.
  units.front().set_post_optim_event(c10::Event(c10::DeviceType::CPU));
  auto x = torch::randn({4, 7});
  fsdp::nn::call(model, x).sum().backward();
  auto& ctx = *fsdp::detail::FSDPModuleAccess::state(units.back()).root_context();
  EXPECT_EQ(ctx.post_optim_events_waited, 1);
  fsdp::nn::call(model, x).sum().backward();
  EXPECT_EQ(ctx.post_optim_events_waited, 1);  // used once
  units.back().set_post_optim_event(c10::Event(c10::DeviceType::CPU));
  fsdp::nn::call(model, x).sum().backward();
  EXPECT_EQ(ctx.post_optim_events_waited, 2);
  EXPECT_FALSE(ctx.post_optim_event.has_value());
}

// ---------------------------------------------------------------------------------------------------------
// ignored_params

TEST(IgnoredParams, NotShardedNotMovedGradientNotReduced) {
  MLP model = make_mlp(71, 2);
  torch::Tensor ignored = model->blocks[0]->as<BlockImpl>()->fc1->weight;
  const void* data_before = ignored.data_ptr();
  const auto full_shape = ignored.sizes().vec();
  fsdp::FullyShardOptions block_opts;
  block_opts.mesh = world_mesh();
  block_opts.ignored_params = {ignored};
  fsdp::FullyShardOptions opts;
  opts.mesh = world_mesh();
  fsdp::fully_shard(model->blocks[0], block_opts);
  fsdp::fully_shard(model->blocks[1], opts);
  fsdp::fully_shard(model, opts);  // the root's call leaves the block's ignored parameter alone too
  EXPECT_EQ(ignored.sizes().vec(), full_shape);
  EXPECT_EQ(ignored.data_ptr(), data_before);  // same storage: not copied, not moved

  auto [x, y] = global_batch(0, kBatch, 7, 5);
  torch::mse_loss(fsdp::nn::call(model, local_rows(x, true)), local_rows(y, true)).backward();
  // Reference: the ignored parameter's gradient is this rank's own (its rows' mean loss), not reduced;
  // every other gradient is the global one.
  MLP local_ref = make_mlp(71, 2);
  torch::mse_loss(local_ref->forward(local_rows(x, true)), local_rows(y, true)).backward();
  EXPECT_LE(max_rel_diff(ignored.grad(), local_ref->blocks[0]->as<BlockImpl>()->fc1->weight.grad()), 1e-6);
  auto global_ref = reference_grads(71);
  auto grads = full_grads(*model);
  for (const auto& [name, g] : global_ref) {
    if (name == "blocks.0.fc1.weight") continue;
    EXPECT_LE(max_rel_diff(grads.at(name), g), 1e-5) << name;
  }
  if (nranks() > 1) {
    // Ranks saw different rows: the unreduced gradients differ across ranks.
    auto all = torch::empty({nranks(), ignored.numel()});
    test_world()->all_gather_into_tensor(all.view({-1}), ignored.grad().reshape({-1}).contiguous()).wait();
    EXPECT_GT((all[0] - all[1]).abs().max().item<double>(), 1e-6);
  }
}

// ---------------------------------------------------------------------------------------------------------
// MixedPrecisionPolicy::buffer_dtype

struct ScaledMLPImpl : torch::nn::Module {
  ScaledMLPImpl() {
    torch::manual_seed(81);
    mlp = register_module("mlp", MLP(7, 19, 13, 5, 2));
    scale = register_buffer("scale", torch::rand({7}) + 0.5);
  }
  torch::Tensor forward(torch::Tensor x) { return fsdp::nn::call(mlp, x * scale); }
  MLP mlp{nullptr};
  torch::Tensor scale;
};
TORCH_MODULE(ScaledMLP);

TEST(BufferDtype, BuffersKeptInItStateDictsInTheOriginalDtype) {
  ScaledMLP model;
  const torch::Tensor scale_fp32 = model->scale.clone();
  fsdp::FullyShardOptions opts;
  opts.mesh = world_mesh();
  opts.mp_policy.buffer_dtype = torch::kBFloat16;
  for (size_t i = 0; i < model->mlp->blocks->size(); ++i) fsdp::fully_shard(model->mlp->blocks[i], opts);
  fsdp::fully_shard(model, opts);
  EXPECT_EQ(model->scale.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(model->mlp->output->weight.scalar_type(), torch::kFloat);  // parameters untouched

  // Reference: the same model on one process with the buffer rounded through bf16 (what forward reads).
  ScaledMLP ref;
  ref->scale.copy_(scale_fp32.to(torch::kBFloat16).to(torch::kFloat));
  torch::optim::SGD opt_got(model->parameters(), 0.1), opt_ref(ref->parameters(), 0.1);
  for (int64_t step = 0; step < 3; ++step) {
    auto [x, y] = global_batch(step, kBatch, 7, 5);
    opt_got.zero_grad();
    opt_ref.zero_grad();
    torch::mse_loss(fsdp::nn::call(model, local_rows(x, true)), local_rows(y, true)).backward();
    torch::mse_loss(ref->forward(x), y).backward();
    opt_got.step();
    opt_ref.step();
  }
  auto full = fsdp::full_state_dict(*model, {false, false});
  EXPECT_EQ(full.at("scale").scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::equal(full.at("scale"), ref->scale));
  EXPECT_EQ(fsdp::sharded_state_dict(*model).at("scale").local().scalar_type(), torch::kFloat);
  for (const auto& item : ref->named_parameters()) {
    EXPECT_LE(max_rel_diff(full.at(item.key()), item.value()), 1e-5) << item.key();
  }
  // Loading an fp32 value keeps the buffer in bf16.
  full.at("scale") = torch::full({7}, 1.25);
  fsdp::load_full_state_dict(*model, full);
  EXPECT_EQ(model->scale.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(model->scale.to(torch::kFloat), torch::full({7}, 1.25)));
}

}  // namespace
