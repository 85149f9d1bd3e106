// FSDP1 migration (issue 10): prepare_fully_shard with each FSDP1 ShardingStrategy trains equal to
// single-process training on the same global batch and issues the collectives the strategy names; tied
// weights are sharded with their common parent; removed FSDP1 arguments are mapped or rejected with the reason.
#include "fully_shard/fsdp_test_util.h"

#include <fsdp/activation_checkpoint.h>
#include <fsdp/migration.h>
#include <fsdp/comm_stats.h>

#include <cstdlib>

using namespace fsdp_test;

namespace {

constexpr int64_t kIn = 7, kDim = 10, kHidden = 12, kOut = 5, kGlobalBatch = 12, kSteps = 4;

// Every child is called through fsdp::nn::call (the hook rule): the default wrap rule shards each direct
// child (input, blocks.0, blocks.1, output); the root keeps its own parameter `out_bias` and a buffer.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    input = register_module("input", torch::nn::Linear(kIn, kDim));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) blocks->push_back(Block(kDim, kHidden));
    output = register_module("output", torch::nn::Linear(kDim, kOut));
    out_bias = register_parameter("out_bias", torch::randn({kOut}) * 0.1);
    scale = register_buffer("scale", torch::full({1}, 0.5));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::tanh(fsdp::nn::call(input, x));
    for (size_t i = 0; i < blocks->size(); ++i) x = fsdp::nn::call(blocks->ptr<BlockImpl>(i), x);
    return fsdp::nn::call(output, x) * (1 + scale) + out_bias;
  }
  torch::nn::Linear input{nullptr}, output{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::Tensor out_bias, scale;
};
TORCH_MODULE(Net);
constexpr int64_t kNetGroups = 5;  // input, blocks.0, blocks.1, output, root

Net make_net(uint64_t seed) {
  torch::manual_seed(seed);
  return Net();
}

// A tied language model: the output head's weight IS the embedding's weight (uneven vocabulary of 11 rows).
constexpr int64_t kVocab = 11, kSeq = 3;
struct TiedHeadImpl : torch::nn::Module {
  explicit TiedHeadImpl(torch::Tensor w) { weight = register_parameter("weight", std::move(w)); }
  torch::Tensor forward(torch::Tensor x) { return torch::matmul(x, weight.t()); }
  torch::Tensor weight;
};
TORCH_MODULE(TiedHead);

struct TiedLMImpl : torch::nn::Module {
  TiedLMImpl() {
    emb = register_module("emb", torch::nn::Embedding(kVocab, kDim));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) blocks->push_back(Block(kDim, kHidden));
    head = register_module("head", TiedHead(emb->weight));
  }
  torch::Tensor forward(torch::Tensor tokens) {
    auto h = fsdp::nn::call(emb, tokens);
    for (size_t i = 0; i < blocks->size(); ++i) h = fsdp::nn::call(blocks->ptr<BlockImpl>(i), h);
    return fsdp::nn::call(head, h);
  }
  torch::nn::Embedding emb{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  TiedHead head{nullptr};
};
TORCH_MODULE(TiedLM);

std::map<std::string, torch::Tensor> snapshot(const torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : m.named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

void expect_equal_params(const std::map<std::string, torch::Tensor>& ref, std::map<std::string, torch::Tensor> got,
                         const std::map<std::string, torch::Tensor>& init, const std::string& what) {
  ASSERT_EQ(ref.size(), got.size()) << what;
  double worst = 0, moved = 0;
  for (const auto& [name, r] : ref) {
    ASSERT_TRUE(got.count(name)) << what << ": missing " << name;
    ASSERT_EQ(got[name].sizes(), r.sizes()) << what << ": " << name;
    const double d = max_rel_diff(got[name], r);
    worst = std::max(worst, d);
    EXPECT_LE(d, 1e-5) << what << ": " << name;
    moved = std::max(moved, max_rel_diff(r, init.at(name)));
  }
  EXPECT_GT(moved, 1e-3) << what << ": training did not move the parameters (parity would be vacuous)";
  std::cout << "[migration] " << what << ": worst relative difference " << worst << "\n";
}

// --- strategies ---------------------------------------------------------------------------------------

std::map<std::string, torch::Tensor> train_net_reference() {
  Net model = make_net(42);
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step, kGlobalBatch, kIn, kOut);
    optim.zero_grad();
    torch::mse_loss(model(x), y).backward();
    optim.step();
  }
  return snapshot(*model);
}

struct Counts {
  fsdp::CommStats shard, replicate;  // replicate: 2-D meshes only
  fsdp::CheckpointStats checkpointing;  // what activation checkpointing did over the run
};

// Trains with prepare_fully_shard(cfg); returns the full parameters and the collectives of one steady step.
std::pair<std::map<std::string, torch::Tensor>, Counts> train_net_fsdp(const fsdp::Fsdp1Config& cfg,
                                                                       uint64_t seed = 42) {
  auto world = test_world();
  const int64_t rank = world->rank(), n = world->size();
  Net model = make_net(seed);
  auto prepared = fsdp::prepare_fully_shard(model, cfg);
  EXPECT_EQ(prepared.fqns, (std::vector<std::string>{"blocks.0", "blocks.1", "input", "output", ""}));
  const auto& mesh = prepared.mesh;
  auto shard_group = mesh.group(mesh.ndim() - 1);
  auto replicate_group = mesh.ndim() == 2 ? mesh.group(0) : nullptr;
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));  // after sharding
  const int64_t local = kGlobalBatch / n;
  Counts counts;
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [gx, gy] = global_batch(step, kGlobalBatch, kIn, kOut);
    optim.zero_grad();
    if (step == 1) {  // step 0 is the lazy-init step
      fsdp::reset_comm_stats(*shard_group);
      if (replicate_group) fsdp::reset_comm_stats(*replicate_group);
    }
    torch::mse_loss(fsdp::nn::call(model, gx.narrow(0, rank * local, local)), gy.narrow(0, rank * local, local))
        .backward();
    if (step == 1) {
      counts.shard = fsdp::comm_stats(*shard_group);
      if (replicate_group) counts.replicate = fsdp::comm_stats(*replicate_group);
    }
    optim.step();
  }
  counts.checkpointing = fsdp::checkpoint_stats(model);
  auto params = full_params(*model, prepared.units);
  params.erase("scale");  // the full state dict also holds buffers
  return {params, counts};
}

fsdp::Fsdp1Config strategy(const char* name) {
  fsdp::Fsdp1Config cfg;
  cfg.sharding_strategy = fsdp::parse_sharding_strategy(name);
  return cfg;
}

class Strategies : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    reference_ = train_net_reference();
    init_ = snapshot(*make_net(42));
  }
  static std::map<std::string, torch::Tensor> reference_, init_;
};
std::map<std::string, torch::Tensor> Strategies::reference_, Strategies::init_;

TEST_F(Strategies, FullShard) {
  auto [params, c] = train_net_fsdp(strategy("FULL_SHARD"));
  expect_equal_params(reference_, params, init_, "FULL_SHARD");
  const int64_t n = test_world()->size();
  // ZeRO-3: every group gathered in forward, again in backward except the root (kept, as in FSDP1).
  EXPECT_EQ(c.shard.all_gather_calls, kNetGroups + (kNetGroups - 1));
  EXPECT_EQ(c.shard.reduce_scatter_calls, kNetGroups);
  EXPECT_EQ(c.shard.all_reduce_calls, 0);
  if (n > 1) EXPECT_GT(c.shard.bytes_sent, 0);
}

TEST_F(Strategies, ShardGradOp) {
  auto [params, c] = train_net_fsdp(strategy("SHARD_GRAD_OP"));
  expect_equal_params(reference_, params, init_, "SHARD_GRAD_OP");
  // ZeRO-2: forward all-gathers only, no backward all-gather.
  EXPECT_EQ(c.shard.all_gather_calls, kNetGroups);
  EXPECT_EQ(c.shard.reduce_scatter_calls, kNetGroups);
  EXPECT_EQ(c.shard.all_reduce_calls, 0);
}

TEST_F(Strategies, NoShard) {
  auto [params, c] = train_net_fsdp(strategy("NO_SHARD"));
  expect_equal_params(reference_, params, init_, "NO_SHARD");
  const int64_t n = test_world()->size();
  // DDP: gradients all-reduced once per group across every rank; the shard dim has size 1, so nothing is
  // gathered at all (the unsharded parameters are the shards, FSDPParam::aliases_shard) and the shard
  // group's "reduce-scatter" is a local copy that sends nothing.
  EXPECT_EQ(c.replicate.all_reduce_calls, n > 1 ? kNetGroups : 0);
  EXPECT_EQ(c.replicate.all_gather_calls, 0);
  EXPECT_EQ(c.replicate.reduce_scatter_calls, 0);
  EXPECT_EQ(c.shard.bytes_sent, 0);
  EXPECT_EQ(c.shard.all_reduce_calls, 0);
  EXPECT_EQ(c.shard.all_gather_calls, 0) << "a shard group of one rank gathers nothing";
  // The wire traffic is DDP's: one all-reduce of every gradient (plus at most the 16-byte alignment of each
  // parameter inside its group's buffer).
  int64_t param_bytes = 0, n_params = 0;
  for (const auto& p : make_net(42)->parameters()) {
    param_bytes += p.numel() * 4;
    ++n_params;
  }
  const int64_t ddp = 2 * (n - 1) * param_bytes / n;
  EXPECT_GE(c.replicate.bytes_sent, ddp);
  EXPECT_LE(c.replicate.bytes_sent, 2 * (n - 1) * (param_bytes + 16 * n_params) / n);
}

// HSDP with 2 replicas (world 4: 2 x 2; world 2: 2 x 1).
TEST_F(Strategies, HybridShard) {
  const int64_t n = test_world()->size();
  if (n % 2 != 0) GTEST_SKIP() << "needs an even world";
  for (const char* name : {"HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"}) {
    auto cfg = strategy(name);
    cfg.hybrid_replicate_degree = 2;
    auto [params, c] = train_net_fsdp(cfg);
    expect_equal_params(reference_, params, init_, name);
    const bool zero3 = std::string(name) == "HYBRID_SHARD";
    // World 2 = 2 x 1: a shard group of one rank gathers nothing (the parameters alias the shards).
    EXPECT_EQ(c.shard.all_gather_calls, n == 2 ? 0 : kNetGroups + (zero3 ? kNetGroups - 1 : 0)) << name;
    EXPECT_EQ(c.shard.reduce_scatter_calls, kNetGroups) << name;
    EXPECT_EQ(c.replicate.all_reduce_calls, kNetGroups) << name;
    EXPECT_EQ(c.replicate.all_gather_calls + c.replicate.reduce_scatter_calls, 0) << name;
    if (n == 4) EXPECT_GT(c.shard.bytes_sent, 0) << name;
  }
}

// FSDP1's sync_module_states: ranks built with different seeds train like rank 0's model.
TEST_F(Strategies, SyncModuleStates) {
  auto cfg = strategy("FULL_SHARD");
  cfg.sync_module_states = true;
  auto [params, c] = train_net_fsdp(cfg, 42 + 1000 * test_world()->rank());
  expect_equal_params(reference_, params, init_, "FULL_SHARD + sync_module_states");
}

// Activation checkpointing through the config: the innermost wrapped modules (or a predicate's choice) are
// checkpointed before sharding; training is unchanged and backward recomputes.
TEST_F(Strategies, ActivationCheckpointing) {
  auto cfg = strategy("FULL_SHARD");
  cfg.activation_checkpointing = true;
  std::vector<std::string> notes;
  Net probe = make_net(1);
  fsdp::plan_fully_shard(*probe, cfg, &notes);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0], "activation checkpointing: 'input', 'blocks.0', 'blocks.1', 'output'");
  auto [params, c] = train_net_fsdp(cfg);
  expect_equal_params(reference_, params, init_, "FULL_SHARD + activation checkpointing");
  const auto& stats = c.checkpointing;
  EXPECT_EQ(stats.forwards, 4 * kSteps);
  EXPECT_EQ(stats.recomputes, 4 * kSteps);

  auto sel = strategy("SHARD_GRAD_OP");
  sel.activation_checkpointing = fsdp::WrapPolicy(
      [](const std::string& fqn, const torch::nn::Module&) { return fqn.rfind("blocks.", 0) == 0; });
  sel.activation_checkpointing_options.policy = fsdp::CheckpointPolicy::SelectiveOp;
  auto [params2, c2] = train_net_fsdp(sel);
  expect_equal_params(reference_, params2, init_, "SHARD_GRAD_OP + op-level SAC on the blocks");
  EXPECT_EQ(c2.checkpointing.recomputes, 2 * kSteps);
}

TEST(Migration, ActivationCheckpointingOfAShardedParentRejected) {
  // The wrap rule shards the blocks one by one; checkpointing their container's owner would recompute them
  // from inside another region: rejected before anything is modified.
  Net model = make_net(1);
  fsdp::Fsdp1Config cfg;
  cfg.auto_wrap_policy = fsdp::module_wrap_policy<BlockImpl>();
  cfg.activation_checkpointing = fsdp::WrapPolicy([](const std::string& fqn, const torch::nn::Module&) {
    return fqn == "blocks";
  });
  EXPECT_THROW(fsdp::plan_fully_shard(*model, cfg), c10::Error);  // a container
  struct OuterImpl : torch::nn::Module {
    OuterImpl() { inner = register_module("inner", Net()); }
    Net inner{nullptr};
  };
  auto outer = std::make_shared<OuterImpl>();
  fsdp::Fsdp1Config c2;
  c2.auto_wrap_policy = fsdp::module_wrap_policy<BlockImpl>();
  c2.activation_checkpointing = fsdp::WrapPolicy([](const std::string& fqn, const torch::nn::Module&) {
    return fqn == "inner";
  });
  try {
    fsdp::plan_fully_shard(*outer, c2);
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("contains modules that are sharded on their own"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(fsdp::is_checkpointed(*outer->inner));
}

// --- tied weights --------------------------------------------------------------------------------------

TEST(Migration, TiedWeightsShardTheCommonParent) {
  auto world = test_world();
  const int64_t rank = world->rank(), n = world->size();
  const int64_t batch = 4 * n;  // global batch divisible by any tested world size
  auto make = [] {
    torch::manual_seed(7);
    return TiedLM();
  };
  auto batch_at = [&](int64_t step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
    auto tokens = torch::randint(kVocab, {batch, kSeq}, gen);
    auto targets = torch::randint(kVocab, {batch, kSeq}, gen);
    return std::make_pair(tokens, targets);
  };
  auto loss_of = [](const torch::Tensor& logits, const torch::Tensor& targets) {
    return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), targets.reshape({-1}));
  };

  TiedLM ref = make();
  auto init = snapshot(*ref);
  {
    torch::optim::AdamW optim(unique_params(*ref), torch::optim::AdamWOptions(2e-2));
    for (int64_t step = 0; step < kSteps; ++step) {
      auto [tokens, targets] = batch_at(step);
      optim.zero_grad();
      loss_of(ref(tokens), targets).backward();
      optim.step();
    }
  }

  TiedLM model = make();
  std::vector<std::string> notes;
  auto plan = fsdp::plan_fully_shard(*model, {}, &notes);
  // emb and head share their weight: neither is wrapped alone; the common parent (the root) holds it.
  EXPECT_EQ(plan, (std::vector<std::string>{"blocks.0", "blocks.1", ""}));
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find("emb.weight"), std::string::npos) << notes[0];
  EXPECT_NE(notes[0].find("'head'"), std::string::npos) << notes[0];

  auto prepared = fsdp::prepare_fully_shard(model, {});
  EXPECT_EQ(prepared.fqns, plan);
  EXPECT_TRUE(model->emb->weight.is_same(model->head->weight)) << "the tie survives sharding";
  torch::optim::AdamW optim(unique_params(*model), torch::optim::AdamWOptions(2e-2));
  const int64_t local = batch / n;
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [tokens, targets] = batch_at(step);
    optim.zero_grad();
    loss_of(fsdp::nn::call(model, tokens.narrow(0, rank * local, local)), targets.narrow(0, rank * local, local))
        .backward();
    optim.step();
  }
  // The full state dict lists a tied tensor once (under its first FQN).
  auto ref_params = snapshot(*ref);
  ASSERT_TRUE(torch::equal(ref_params["head.weight"], ref_params["emb.weight"]));
  ref_params.erase("head.weight");
  expect_equal_params(ref_params, full_params(*model, prepared.units), init, "tied embedding/head");
}

// A tie below the root: the wrap rule picks leaves, the tie moves the group to their parent `trunk`.
TEST(Migration, TiedWeightsPlanPicksTheLowestCommonAncestor) {
  struct TrunkImpl : torch::nn::Module {
    TrunkImpl() {
      a = register_module("a", torch::nn::Linear(4, 4));
      b = register_module("b", TiedHead(a->weight));
    }
    torch::nn::Linear a{nullptr};
    TiedHead b{nullptr};
  };
  struct RootImpl : torch::nn::Module {
    RootImpl() {
      trunk = register_module("trunk", std::make_shared<TrunkImpl>());
      other = register_module("other", torch::nn::Linear(4, 4));
    }
    std::shared_ptr<TrunkImpl> trunk;
    torch::nn::Linear other{nullptr};
  };
  auto root = std::make_shared<RootImpl>();
  fsdp::Fsdp1Config cfg;
  cfg.auto_wrap_policy = fsdp::module_wrap_policy<torch::nn::LinearImpl, TiedHeadImpl>();
  std::vector<std::string> notes;
  EXPECT_EQ(fsdp::plan_fully_shard(*root, cfg, &notes), (std::vector<std::string>{"trunk", "other", ""}));
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find("instead of 'trunk.a', 'trunk.b'"), std::string::npos) << notes[0];
  // Default rule (direct children): the tie stays inside `trunk`, nothing to move.
  notes.clear();
  EXPECT_EQ(fsdp::plan_fully_shard(*root, {}, &notes), (std::vector<std::string>{"trunk", "other", ""}));
  EXPECT_TRUE(notes.empty());
}

// FSDP1's param_init_fn on a meta-device model: after sharding, every module that held meta tensors is
// initialized once with its full parameters visible; the result equals initializing the unsharded model.
struct DeviceLinearImpl : torch::nn::Module {  // built straight on `device` (libtorch's Linear has no device option)
  DeviceLinearImpl(int64_t in, int64_t out, c10::Device device) {
    weight = register_parameter("weight", torch::empty({out, in}, torch::TensorOptions(device)));
    bias = register_parameter("bias", torch::empty({out}, torch::TensorOptions(device)));
  }
  torch::Tensor forward(torch::Tensor x) { return torch::addmm(bias, x, weight.t()); }
  torch::Tensor weight, bias;
};
TORCH_MODULE(DeviceLinear);
struct DeviceNetImpl : torch::nn::Module {
  explicit DeviceNetImpl(c10::Device device) {
    l1 = register_module("l1", DeviceLinear(kIn, kDim, device));
    l2 = register_module("l2", DeviceLinear(kDim, kOut, device));
    gain = register_parameter("gain", torch::empty({kOut}, torch::TensorOptions(device)));
    shift = register_buffer("shift", torch::empty({kOut}, torch::TensorOptions(device)));
  }
  torch::Tensor forward(torch::Tensor x) {
    return fsdp::nn::call(l2, torch::tanh(fsdp::nn::call(l1, x))) * gain + shift;
  }
  DeviceLinear l1{nullptr}, l2{nullptr};
  torch::Tensor gain, shift;
};
TORCH_MODULE(DeviceNet);

TEST(Migration, ParamInitFnOnMetaModel) {
  auto init_fn = [](torch::nn::Module& m) {
    torch::NoGradGuard no_grad;
    auto fill = [](const torch::Tensor& t, double phase) {
      auto values = torch::arange(t.numel(), torch::kFloat).mul(0.37).add(phase).sin().mul(0.2);
      t.copy_(values.reshape(t.sizes()));
    };
    for (const auto& p : m.named_parameters(/*recurse=*/false)) fill(p.value(), static_cast<double>(p.key().size()));
    for (const auto& b : m.named_buffers(/*recurse=*/false)) fill(b.value(), 1.0);
  };
  DeviceNet ref(c10::Device(c10::kCPU));
  for (const auto& item : ref->named_modules()) init_fn(*item.value());

  DeviceNet model(c10::Device(c10::kMeta));
  fsdp::Fsdp1Config cfg;
  cfg.param_init_fn = init_fn;
  cfg.sync_module_states = true;  // meta tensors are skipped by the broadcast
  auto prepared = fsdp::prepare_fully_shard(model, cfg);
  EXPECT_EQ(prepared.fqns, (std::vector<std::string>{"l1", "l2", ""}));
  for (const auto& p : model->parameters()) EXPECT_FALSE(p.is_meta());
  auto got = full_params(*model, prepared.units);
  int64_t compared = 0;
  for (const auto& item : ref->named_parameters()) {
    ASSERT_TRUE(got.count(item.key())) << item.key();
    EXPECT_TRUE(torch::equal(got[item.key()], item.value())) << item.key();
    ++compared;
  }
  EXPECT_EQ(compared, 5);
  EXPECT_TRUE(torch::equal(model->shift, ref->shift));
  // And it trains: one forward/backward on the materialized shards.
  fsdp::nn::call(model, torch::randn({2, kIn})).sum().backward();
  EXPECT_TRUE(model->l1->weight.grad().defined());
}

// --- removed arguments and bad configs ------------------------------------------------------------------

// Runs prepare_fully_shard expecting an error containing every fragment, and the model left unsharded.
void expect_rejected(const fsdp::Fsdp1Config& cfg, std::vector<std::string> fragments) {
  Net model = make_net(1);
  try {
    fsdp::prepare_fully_shard(model, cfg);
    ADD_FAILURE() << "accepted; expected an error mentioning " << fragments.front();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "'" << f << "' not in: " << msg;
  }
  EXPECT_FALSE(fsdp::fsdp_module(*model)) << "a rejected config must leave the model untouched";
  EXPECT_FALSE(fsdp::fsdp_module(*model->input));
}

TEST(Migration, RemovedArgumentsRejectedWithTheReason) {
  {
    fsdp::Fsdp1Config c;
    c.backward_prefetch = fsdp::BackwardPrefetch::BACKWARD_POST;
    expect_rejected(c, {"backward_prefetch=BACKWARD_POST", "BACKWARD_PRE", "set_modules_to_backward_prefetch"});
  }
  {
    fsdp::Fsdp1Config c;
    c.backward_prefetch = fsdp::BackwardPrefetch::NONE;
    expect_rejected(c, {"backward_prefetch=None", "prefetches"});
  }
  {
    fsdp::Fsdp1Config c;
    c.use_orig_params = false;
    expect_rejected(c, {"use_orig_params=false", "FlatParameter"});
  }
  {
    fsdp::Fsdp1Config c;
    c.mixed_precision = fsdp::Fsdp1MixedPrecision{};
    c.mixed_precision->keep_low_precision_grads = true;
    expect_rejected(c, {"keep_low_precision_grads", "reduce_dtype"});
  }
}

TEST(Migration, BadTopologiesRejected) {
  const int64_t n = test_world()->size();
  {
    auto c = strategy("HYBRID_SHARD");
    c.hybrid_replicate_degree = n + 1;
    expect_rejected(c, {"HYBRID_SHARD", "hybrid_replicate_degree=" + std::to_string(n + 1), "must divide"});
  }
  {
    // FSDP1's default (shard within a node) needs LOCAL_WORLD_SIZE; without it the replicate size is missing.
    const char* saved = std::getenv("LOCAL_WORLD_SIZE");
    const std::string keep = saved ? saved : "";
    unsetenv("LOCAL_WORLD_SIZE");
    expect_rejected(strategy("_HYBRID_SHARD_ZERO2"), {"_HYBRID_SHARD_ZERO2 needs a replicate size",
                                                       "hybrid_replicate_degree"});
    if (saved) setenv("LOCAL_WORLD_SIZE", keep.c_str(), 1);
  }
  {
    auto c = strategy("SHARD_GRAD_OP");
    c.hybrid_replicate_degree = 2;
    if (n >= 2) expect_rejected(c, {"only meaningful with HYBRID_SHARD"});
  }
  EXPECT_THROW(fsdp::parse_sharding_strategy("FULLSHARD"), c10::Error);
  EXPECT_EQ(fsdp::parse_sharding_strategy("ShardingStrategy._HYBRID_SHARD_ZERO2"),
            fsdp::ShardingStrategy::HYBRID_SHARD_ZERO2);
  EXPECT_EQ(fsdp::parse_sharding_strategy("3"), fsdp::ShardingStrategy::NO_SHARD);
  EXPECT_STREQ(fsdp::to_string(fsdp::ShardingStrategy::HYBRID_SHARD_ZERO2), "_HYBRID_SHARD_ZERO2");
}

// Meshes: FSDP1's hybrid default (shard within a node = LOCAL_WORLD_SIZE, set by fsdprun), a 1-D mesh given
// for NO_SHARD (seen as (n, 1)), and a 2-D mesh given for a non-hybrid strategy (rejected).
TEST(Migration, MeshesFromTheStrategy) {
  const int64_t n = test_world()->size();
  if (const char* local = std::getenv("LOCAL_WORLD_SIZE"); local != nullptr && std::atoll(local) == n) {
    Net model = make_net(1);
    auto prepared = fsdp::prepare_fully_shard(model, strategy("HYBRID_SHARD"));
    EXPECT_EQ(prepared.mesh.shape(), (std::vector<int64_t>{1, n}));  // one node: one replica
  }
  {
    Net model = make_net(1);
    auto c = strategy("NO_SHARD");
    c.device_mesh = fsdp::init_device_mesh("cpu", {n});
    auto prepared = fsdp::prepare_fully_shard(model, c);
    EXPECT_EQ(prepared.mesh.shape(), (std::vector<int64_t>{n, 1}));
    auto full = make_net(1)->named_parameters();
    for (const auto& item : model->named_parameters()) {
      EXPECT_EQ(item.value().sizes(), full[item.key()].sizes()) << item.key() << ": NO_SHARD keeps whole tensors";
    }
  }
  if (n % 2 == 0) {
    auto c = strategy("FULL_SHARD");
    c.device_mesh = fsdp::init_device_mesh("cpu", {2, n / 2}, {"replicate", "shard"});
    expect_rejected(c, {"FULL_SHARD shards over a 1-D device_mesh", "use HYBRID_SHARD"});
  }
}

// ignored_modules: never wrapped, parameters neither sharded nor reduced.
TEST(Migration, IgnoredModules) {
  const int64_t n = test_world()->size();
  Net model = make_net(1);
  fsdp::Fsdp1Config c;
  c.ignored_modules = {model->output.ptr()};
  EXPECT_EQ(fsdp::plan_fully_shard(*model, c), (std::vector<std::string>{"blocks.0", "blocks.1", "input", ""}));
  auto prepared = fsdp::prepare_fully_shard(model, c);
  EXPECT_EQ(model->output->weight.size(0), kOut) << "ignored: not sharded";
  if (n > 1) EXPECT_LT(model->input->weight.size(0), kDim) << "sharded";
  fsdp::nn::call(model, torch::randn({2, kIn})).sum().backward();
  EXPECT_TRUE(model->output->weight.grad().defined());
}

// Accepted removed arguments (no-ops in FSDP2) and the mixed-precision mapping: bf16 compute, fp32 shards and
// gradients, buffers cast to buffer_dtype.
TEST(Migration, AcceptedArgumentsAndMixedPrecision) {
  auto world = test_world();
  Net model = make_net(3);
  fsdp::Fsdp1Config c;
  c.backward_prefetch = fsdp::BackwardPrefetch::BACKWARD_PRE;
  c.forward_prefetch = true;
  c.limit_all_gathers = true;
  c.use_orig_params = true;
  c.device_id = c10::Device(c10::kCPU);
  c.mixed_precision = fsdp::Fsdp1MixedPrecision{torch::kBFloat16, torch::kFloat32, torch::kBFloat16};
  auto prepared = fsdp::prepare_fully_shard(model, c);
  EXPECT_EQ(model->scale.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(fsdp::full_state_dict(*model, {true, false}).at("scale").scalar_type(), torch::kFloat32)
      << "FSDP1: state dicts hold buffers in their original dtype";
  auto out = fsdp::nn::call(model, torch::randn({2, kIn}));
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);  // FSDP1 returns the compute dtype too
  out.to(torch::kFloat32).sum().backward();
  for (const auto& p : model->parameters()) {
    EXPECT_EQ(p.scalar_type(), torch::kFloat32);
    if (p.numel() > 0) {
      ASSERT_TRUE(p.grad().defined());
      EXPECT_EQ(p.grad().scalar_type(), torch::kFloat32);
    }
  }
}

}  // namespace
