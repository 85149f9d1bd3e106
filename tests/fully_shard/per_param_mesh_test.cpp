// Per-parameter meshes (issue 24): shard_placement_fn puts a MoE block's experts on a 2-D (replicate 2, shard 2)
// expert mesh — each expert weight sharded over 2 ranks, replicated over the other pair — and the block's dense
// layers on the 1-D 4-rank mesh, in the same fully_shard call (one FSDP state, two parameter groups) or, the
// older way, in two calls. Each against an independent reference:
//
//   training with clip_grad_norm_ active     equal (1e-5) to single-process plain libtorch on the global batch,
//                                            reported norms equal to libtorch's clip_grad_norm_ on the full model
//                                            (both meshes name their shard dim "shard": keyed by dim name, the
//                                            expert partial would be summed over the 4-rank group, twice too big)
//   collectives per step                     counted per communicator: one all-gather per mesh per block in
//                                            forward, issued before either is waited; one reduce-scatter per mesh
//   distributed checkpoint                   saved from the per-parameter layout, loaded bit for bit into all-on-one
//                                            mesh and into a transposed expert mesh (torch::equal of full tensors)
//   sharded state dict                       says each parameter's own mesh; round trip bit for bit
//   bad meshes, set_all_reduce_hook          clear errors naming the parameter / the module, nothing sharded
#include "fully_shard/fsdp_state.h"
#include "fully_shard/fsdp_test_util.h"

#include <fsdp/comm_stats.h>
#include <fsdp/checkpoint/checkpoint.h>
#include <fsdp/checkpoint/optimizer.h>
#include <fsdp/clip_grad.h>
#include <fsdp/sharded_tensor.h>

#include <filesystem>
#include <unordered_set>

using namespace fsdp_test;

namespace {

constexpr int64_t kIn = 7, kDim = 6, kHidden = 5, kExperts = 4, kOut = 3, kBatch = 16;
constexpr double kMaxNorm = 0.05;  // below every step's gradient norm (checked): clipping changes the result

int64_t rank() { return test_world()->rank(); }
int64_t nranks() { return test_world()->size(); }

// The dense mesh over the 4 ranks and the expert mesh (replicate 2, shard 2). Both call their shard dim
// "shard" on purpose (see clip_grad_norm_ above).
fsdp::DeviceMesh dense_mesh() {
  static fsdp::DeviceMesh mesh = fsdp::init_device_mesh("cpu", {nranks()}, {"shard"});
  return mesh;
}
fsdp::DeviceMesh expert_mesh() {
  static fsdp::DeviceMesh mesh = fsdp::init_device_mesh("cpu", {2, nranks() / 2}, {"replicate", "shard"});
  return mesh;
}

// Soft mixture of experts: every token goes through every expert, weighted by the router's softmax (no
// routing discontinuity, so single-process training is a sharp reference). Stacked expert weights.
struct ExpertsImpl : torch::nn::Module {
  ExpertsImpl() {
    w1 = register_parameter("w1", torch::randn({kExperts, kDim, kHidden}) * 0.4);
    w2 = register_parameter("w2", torch::randn({kExperts, kHidden, kDim}) * 0.4);
    bias = register_parameter("bias", torch::randn({kExperts, kDim}) * 0.1);
  }
  torch::Tensor forward(torch::Tensor x, torch::Tensor gate) {
    auto h = torch::relu(torch::einsum("bd,edh->beh", {x, w1}));
    auto y = torch::einsum("beh,ehd->bed", {h, w2}) + bias.unsqueeze(0);
    return (gate.unsqueeze(-1) * y).sum(1);
  }
  torch::Tensor w1, w2, bias;
};
TORCH_MODULE(Experts);

struct MoEBlockImpl : torch::nn::Module {
  MoEBlockImpl() {
    proj = register_module("proj", torch::nn::Linear(kDim, kDim));
    router = register_module("router", torch::nn::Linear(kDim, kExperts));
    experts = register_module("experts", Experts());
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = torch::tanh(proj(x));
    auto gate = torch::softmax(router(h), -1);
    return x + fsdp::nn::call(experts, h, gate);
  }
  torch::nn::Linear proj{nullptr}, router{nullptr};
  Experts experts{nullptr};
};
TORCH_MODULE(MoEBlock);

struct MoEModelImpl : torch::nn::Module {
  MoEModelImpl() {
    input = register_module("input", torch::nn::Linear(kIn, kDim));
    blocks = register_module("blocks", torch::nn::ModuleList(MoEBlock(), MoEBlock()));
    output = register_module("output", torch::nn::Linear(kDim, kOut));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::tanh(input(x));
    for (size_t i = 0; i < blocks->size(); ++i) x = fsdp::nn::call(blocks->ptr<MoEBlockImpl>(i), x);
    return output(x);
  }
  MoEBlock block(size_t i) { return MoEBlock(blocks->ptr<MoEBlockImpl>(i)); }
  torch::nn::Linear input{nullptr}, output{nullptr};
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(MoEModel);

MoEModel make_model(uint64_t seed) {
  torch::manual_seed(seed);
  return MoEModel();
}

// The dim each expert weight shards on: w1 on its expert dim (2 experts per shard), w2 on its hidden dim
// (uneven: 3 and 2 rows), the bias on its expert dim.
int64_t expert_dim(const ExpertsImpl& e, const torch::Tensor& p) { return p.is_same(e.w2) ? 1 : 0; }

enum class Layout {
  OneCall,        // fully_shard(block) with shard_placement_fn choosing the expert mesh for expert weights
  SeparateCalls,  // fully_shard(block->experts, expert mesh), then fully_shard(block, dense mesh)
  AllDense,       // no expert mesh: everything on the 4-rank mesh, dim 0 (another layout to load into)
  Transposed,     // experts on a (2, 2) mesh whose shard pairs are {0, 2} and {1, 3}, all on dim 0
};

std::vector<fsdp::FSDPModule> shard(MoEModel& model, Layout layout) {
  std::vector<fsdp::FSDPModule> units;
  for (size_t i = 0; i < model->blocks->size(); ++i) {
    MoEBlock block = model->block(i);
    const ExpertsImpl* experts = block->experts.get();
    std::unordered_set<const c10::TensorImpl*> expert_params;
    for (const auto& p : block->experts->parameters()) expert_params.insert(p.unsafeGetTensorImpl());
    fsdp::FullyShardOptions dense;
    dense.mesh = dense_mesh();
    switch (layout) {
      case Layout::OneCall: {
        fsdp::FullyShardOptions opts = dense;
        opts.shard_placement_fn = [experts, expert_params](const torch::Tensor& p) -> std::optional<fsdp::ShardPlacement> {
          if (!expert_params.count(p.unsafeGetTensorImpl())) return std::nullopt;  // dim 0, the call's mesh
          return fsdp::ShardPlacement(expert_dim(*experts, p), expert_mesh());
        };
        units.push_back(fsdp::fully_shard(block, opts));
        break;
      }
      case Layout::SeparateCalls: {
        fsdp::FullyShardOptions opts;
        opts.mesh = expert_mesh();
        // An older-style function returning only the dim still fits (implicit conversion to ShardPlacement).
        opts.shard_placement_fn = [experts](const torch::Tensor& p) {
          return std::optional<int64_t>(expert_dim(*experts, p));
        };
        units.push_back(fsdp::fully_shard(block->experts, opts));
        units.push_back(fsdp::fully_shard(block, dense));
        break;
      }
      case Layout::AllDense:
        units.push_back(fsdp::fully_shard(block, dense));
        break;
      case Layout::Transposed: {
        static fsdp::DeviceMesh transposed(c10::kCPU, {2, 2}, {"r", "s"}, {0, 2, 1, 3});
        fsdp::FullyShardOptions opts = dense;
        opts.shard_placement_fn = [expert_params](const torch::Tensor& p) -> std::optional<fsdp::ShardPlacement> {
          if (!expert_params.count(p.unsafeGetTensorImpl())) return std::nullopt;
          return fsdp::ShardPlacement(0, transposed);
        };
        units.push_back(fsdp::fully_shard(block, opts));
        break;
      }
    }
  }
  fsdp::FullyShardOptions root;
  root.mesh = dense_mesh();
  units.push_back(fsdp::fully_shard(model, root));
  return units;
}

torch::Tensor local_rows(const torch::Tensor& global, bool sharded) {
  if (!sharded) return global;
  const int64_t local = global.size(0) / nranks();
  return global.narrow(0, rank() * local, local);
}

std::map<std::string, torch::Tensor> plain_params(torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : m.named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

struct Trained {
  std::map<std::string, torch::Tensor> params;  // full parameters by FQN
  std::vector<double> norms;                    // each step's reported (pre-clipping) gradient norm
};

// `steps` SGD steps on the global batch (each rank its quarter; the reference all of it), clipping to kMaxNorm.
Trained train(std::optional<Layout> layout, int64_t steps, bool clip = true, MoEModel* keep = nullptr) {
  MoEModel model = make_model(5);
  std::vector<fsdp::FSDPModule> units;
  if (layout) units = shard(model, *layout);
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.3).momentum(0.9));
  Trained out;
  for (int64_t step = 0; step < steps; ++step) {
    auto [x, y] = global_batch(step, kBatch, kIn, kOut);
    optim.zero_grad();
    auto pred = fsdp::nn::call(model, local_rows(x, layout.has_value()));
    torch::mse_loss(pred, local_rows(y, layout.has_value())).backward();
    if (clip) {
      out.norms.push_back(layout ? fsdp::clip_grad_norm_(*model, kMaxNorm).item<double>()
                                 : torch::nn::utils::clip_grad_norm_(model->parameters(), kMaxNorm));
    }
    optim.step();
  }
  out.params = layout ? full_params(*model, units) : plain_params(*model);
  if (keep) *keep = model;
  return out;
}

void expect_close(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& ref,
                  double tol, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  for (const auto& [name, r] : ref) {
    ASSERT_TRUE(got.count(name)) << what << ": " << name;
    EXPECT_LE(max_rel_diff(got.at(name), r), tol) << what << ": " << name;
  }
}

void expect_bitwise_equal(const std::map<std::string, torch::Tensor>& got,
                          const std::map<std::string, torch::Tensor>& ref, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  for (const auto& [name, r] : ref) {
    ASSERT_TRUE(got.count(name)) << what << ": " << name;
    EXPECT_TRUE(torch::equal(got.at(name), r)) << what << ": " << name;
  }
}

bool needs_four_ranks() { return nranks() != 4; }

const std::vector<fsdp::detail::FSDPParamGroup*>& groups_of(const fsdp::FSDPModule& unit) {
  return fsdp::detail::FSDPModuleAccess::state(unit).param_groups();
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Training equal to single-process training, clipping included

TEST(PerParamMesh, OneCallTrainsEqualToSingleProcessWithClipping) {
  if (needs_four_ranks()) GTEST_SKIP() << "needs 4 ranks (experts over 2, dense over 4)";
  const int64_t steps = 4;
  const Trained ref = train(std::nullopt, steps);
  // The reference moved, clipping was active at every step, and it changed the result.
  const auto initial = plain_params(*make_model(5));
  EXPECT_GT(max_rel_diff(ref.params.at("blocks.0.experts.w1"), initial.at("blocks.0.experts.w1")), 1e-3);
  for (double n : ref.norms) EXPECT_GT(n, 2 * kMaxNorm);
  const Trained unclipped = train(std::nullopt, steps, /*clip=*/false);
  EXPECT_GT(max_rel_diff(unclipped.params.at("blocks.1.experts.w2"), ref.params.at("blocks.1.experts.w2")), 1e-2);

  MoEModel model{nullptr};
  const Trained got = train(Layout::OneCall, steps, true, &model);
  expect_close(got.params, ref.params, 1e-5, "one fully_shard call, two meshes");
  ASSERT_EQ(got.norms.size(), ref.norms.size());
  for (size_t i = 0; i < ref.norms.size(); ++i) {
    EXPECT_NEAR(got.norms[i], ref.norms[i], 1e-5 * ref.norms[i]) << "gradient norm of step " << i;
  }
  // The feature ran: each block's state holds two groups, on the two meshes.
  for (size_t i = 0; i < model->blocks->size(); ++i) {
    const auto& groups = groups_of(*fsdp::fsdp_module(*model->block(i)));
    ASSERT_EQ(groups.size(), 2u) << "block " << i;
    EXPECT_EQ(groups[0]->mesh_info().shard_size, 4);
    EXPECT_EQ(groups[0]->params().size(), 4u);  // proj and router, weight and bias
    EXPECT_EQ(groups[1]->mesh_info().shard_size, 2);
    EXPECT_EQ(groups[1]->mesh_info().replicate_size, 2);
    EXPECT_EQ(groups[1]->params().size(), 3u);  // w1, w2, bias
    for (auto* p : groups[1]->params()) EXPECT_NE(p->fqn().find("experts."), std::string::npos) << p->fqn();
  }
}

TEST(PerParamMesh, SeparateCallsTrainEqualToSingleProcessWithClipping) {
  if (needs_four_ranks()) GTEST_SKIP() << "needs 4 ranks";
  const int64_t steps = 4;
  const Trained ref = train(std::nullopt, steps);
  const Trained got = train(Layout::SeparateCalls, steps);
  expect_close(got.params, ref.params, 1e-5, "experts sharded in their own call");
  for (size_t i = 0; i < ref.norms.size(); ++i) {
    EXPECT_NEAR(got.norms[i], ref.norms[i], 1e-5 * ref.norms[i]) << "gradient norm of step " << i;
  }
}

// ---------------------------------------------------------------------------------------------------------
// Collectives: one all-gather per mesh per block in forward, overlapping; one reduce-scatter per mesh

TEST(PerParamMesh, OneAllGatherAndReduceScatterPerMeshPerBlock) {
  if (needs_four_ranks()) GTEST_SKIP() << "needs 4 ranks";
  MoEModel model = make_model(5);
  auto units = shard(model, Layout::OneCall);
  fsdp::ProcessGroup& dense = *dense_mesh().group(0);
  fsdp::ProcessGroup& expert_shard = *expert_mesh().group("shard");
  fsdp::ProcessGroup& expert_replicate = *expert_mesh().group("replicate");
  for (auto* g : {&dense, &expert_shard, &expert_replicate}) {
    fsdp::reset_comm_stats(*g);
    fsdp::record_timeline(*g, false);
    fsdp::record_timeline(*g, true);
  }
  // Inside each block's forward (a hook registered after FSDP's), both of its groups show full parameters.
  std::vector<std::string> inside;
  for (size_t i = 0; i < model->blocks->size(); ++i) {
    fsdp::FSDPModule unit = *fsdp::fsdp_module(*model->block(i));
    fsdp::nn::register_forward_pre_hook(*model->block(i), [&inside, unit](torch::nn::Module&, fsdp::nn::TensorList&) {
      for (auto* g : groups_of(unit)) inside.push_back(fsdp::detail::to_string(g->state_machine().state()));
    });
  }
  auto [x, y] = global_batch(0, kBatch, kIn, kOut);
  auto loss = torch::mse_loss(fsdp::nn::call(model, local_rows(x, true)), local_rows(y, true));
  // Forward: the root's group and one per block on the dense mesh, one per block on the expert mesh.
  EXPECT_EQ(fsdp::comm_stats(dense).all_gather_calls, 3);
  EXPECT_EQ(fsdp::comm_stats(expert_shard).all_gather_calls, 2);
  EXPECT_EQ(fsdp::comm_stats(expert_replicate).all_gather_calls, 0);
  ASSERT_EQ(inside.size(), 4u);
  for (const auto& s : inside) EXPECT_EQ(s, "forward, unsharded");
  // Block 0's two gathers overlap: the expert one was issued before the dense one was waited.
  const auto dense_spans = fsdp::comm_timeline(dense);
  const auto expert_spans = fsdp::comm_timeline(expert_shard);
  ASSERT_EQ(dense_spans.size(), 3u);  // root, block 0, block 1
  ASSERT_EQ(expert_spans.size(), 2u);
  EXPECT_LE(expert_spans[0].issued, dense_spans[1].wait_begin);
  loss.backward();
  // Backward: blocks reshard after forward, so each gathers again per mesh (the root kept its parameters);
  // one reduce-scatter per group, and HSDP's all-reduce across the expert replicas.
  EXPECT_EQ(fsdp::comm_stats(dense).all_gather_calls, 5);
  EXPECT_EQ(fsdp::comm_stats(expert_shard).all_gather_calls, 4);
  EXPECT_EQ(fsdp::comm_stats(dense).reduce_scatter_calls, 3);
  EXPECT_EQ(fsdp::comm_stats(expert_shard).reduce_scatter_calls, 2);
  EXPECT_EQ(fsdp::comm_stats(expert_replicate).all_reduce_calls, 2);
  // Every group of every state back at the start, together.
  for (const auto& u : units) {
    for (auto* g : groups_of(u)) {
      EXPECT_TRUE(g->state_machine().state() == fsdp::detail::GroupState{})
          << g->name() << ": " << fsdp::detail::to_string(g->state_machine().state());
    }
  }
  // Groups are named after the module and their mesh.
  const auto& block_groups = groups_of(units[0]);
  EXPECT_NE(block_groups[1]->name().find("replicate=2, shard=2"), std::string::npos) << block_groups[1]->name();
  for (auto* g : {&dense, &expert_shard, &expert_replicate}) fsdp::record_timeline(*g, false);
}

// ---------------------------------------------------------------------------------------------------------
// State dicts and checkpoints

TEST(PerParamMesh, ShardedStateDictSaysEachMeshAndRoundTrips) {
  if (needs_four_ranks()) GTEST_SKIP() << "needs 4 ranks";
  MoEModel model{nullptr};
  train(Layout::OneCall, 2, true, &model);
  auto sd = fsdp::sharded_state_dict(*model);
  for (const auto& [fqn, st] : sd) {
    if (fqn.find("experts.") != std::string::npos) {
      EXPECT_EQ(st.mesh().ndim(), 2) << fqn;
      const int64_t dim = fqn.find("w2") != std::string::npos ? 1 : 0;
      EXPECT_EQ(st.placements(), (fsdp::Placements{fsdp::Replicate(), fsdp::Shard(dim)})) << fqn;
      const auto [offset, size] = fsdp::shard_offset_and_size(st.sizes()[dim], 2, expert_mesh().local_rank(1));
      EXPECT_EQ(st.local().size(dim), size) << fqn;
      EXPECT_EQ(st.local_offset()[dim], offset) << fqn;
    } else {
      EXPECT_EQ(st.mesh().ndim(), 1) << fqn;
      EXPECT_EQ(st.placements(), fsdp::Placements{fsdp::Shard(0)}) << fqn;
    }
  }
  const auto before = full_params(*model, {});
  MoEModel fresh = make_model(77);
  shard(fresh, Layout::OneCall);
  ASSERT_FALSE(torch::equal(full_params(*fresh, {}).at("blocks.0.experts.w1"), before.at("blocks.0.experts.w1")));
  fsdp::load_sharded_state_dict(*fresh, sd);
  expect_bitwise_equal(full_params(*fresh, {}), before, "sharded state dict round trip");
}

TEST(PerParamMesh, CheckpointLoadsIntoOtherLayoutsBitForBit) {
  if (needs_four_ranks()) GTEST_SKIP() << "needs 4 ranks";
  MoEModel model{nullptr};
  train(Layout::OneCall, 2, true, &model);
  const auto saved = full_params(*model, {});
  const std::string dir = (std::filesystem::temp_directory_path() / "fsdp_per_param_mesh_test_ckpt").string();
  fsdp::checkpoint::save(fsdp::checkpoint::model_state_dict(*model), dir);
  for (Layout layout : {Layout::AllDense, Layout::Transposed, Layout::SeparateCalls, Layout::OneCall}) {
    MoEModel other = make_model(99);
    shard(other, layout);
    ASSERT_FALSE(torch::equal(full_params(*other, {}).at("blocks.1.experts.w2"), saved.at("blocks.1.experts.w2")));
    auto sd = fsdp::checkpoint::model_state_dict(*other);
    fsdp::checkpoint::load(sd, dir);
    expect_bitwise_equal(full_params(*other, {}), saved, "checkpoint into layout " + std::to_string(int(layout)));
  }
  test_world()->barrier().wait();
  if (rank() == 0) std::filesystem::remove_all(dir);
}

// ---------------------------------------------------------------------------------------------------------
// Errors

TEST(PerParamMesh, RejectsBadMeshesAndAllReduceHookOnSeveralGroups) {
  if (needs_four_ranks()) GTEST_SKIP() << "needs 4 ranks";
  auto expect_error = [](const std::function<void()>& f, const std::vector<std::string>& parts) {
    try {
      f();
      ADD_FAILURE() << "expected an error containing " << parts.front();
    } catch (const c10::Error& e) {
      for (const auto& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  MoEModel model = make_model(3);
  MoEBlock block = model->block(0);
  const at::Tensor w1 = block->experts->w1;
  auto on_mesh = [w1](fsdp::DeviceMesh mesh) {
    fsdp::FullyShardOptions opts;
    opts.mesh = dense_mesh();
    opts.shard_placement_fn = [w1, mesh](const torch::Tensor& p) -> std::optional<fsdp::ShardPlacement> {
      if (!p.is_same(w1)) return std::nullopt;
      return fsdp::ShardPlacement(0, mesh);
    };
    return opts;
  };
  static fsdp::DeviceMesh three_d = fsdp::init_device_mesh("cpu", {1, 2, 2}, {"a", "b", "c"});
  expect_error([&] { fsdp::fully_shard(block, on_mesh(three_d)); }, {"experts.w1", "1-D (FSDP) or 2-D"});
  static fsdp::DeviceMesh other_type(c10::kMeta, {4}, {"shard"});
  expect_error([&] { fsdp::fully_shard(block, on_mesh(other_type)); }, {"experts.w1", "one device type"});
  fsdp::FullyShardOptions raf_3 = on_mesh(expert_mesh());
  raf_3.reshard_after_forward = fsdp::ReshardAfterForward(4);  // divides 4, not the expert mesh's 2
  expect_error([&] { fsdp::fully_shard(block, raf_3); }, {"experts.w1", "reshard_after_forward=4"});
  EXPECT_FALSE(fsdp::fsdp_module(*block).has_value());  // refused calls shard nothing
  EXPECT_EQ(block->experts->w1.sizes(), (std::vector<int64_t>{kExperts, kDim, kHidden}));

  fsdp::FSDPModule unit = fsdp::fully_shard(block, on_mesh(expert_mesh()));
  ASSERT_EQ(groups_of(unit).size(), 2u);
  expect_error([&] { unit.set_all_reduce_hook([](torch::Tensor&) {}); }, {"set_all_reduce_hook", "2 meshes"});
  // A state with one group still takes a hook (the experts sharded on their own).
  MoEModel separate = make_model(4);
  fsdp::FullyShardOptions expert_opts;
  expert_opts.mesh = expert_mesh();
  fsdp::FSDPModule experts_unit = fsdp::fully_shard(separate->block(0)->experts, expert_opts);
  EXPECT_NO_THROW(experts_unit.set_all_reduce_hook([](torch::Tensor&) {}));
}
