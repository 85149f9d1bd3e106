#pragma once
// Shared pieces of the runtime tests (issue 8: repeated use, evaluation, exceptions, stale data, parameter
// changes, HSDP partial accumulation, module groups, diagnosis, the randomized real loop).
//
// Every test trains two copies of the same model built from the same seed:
//   * the reference: plain libtorch on one process, fed the whole global batch (no fully_shard anywhere:
//     fsdp::nn::call on a module without hooks is exactly forward());
//   * the sharded model: fully_shard'ed, each rank fed its contiguous slice of the global batch.
// The loss is a mean over the rows a side sees (torch::mse_loss, as parity_test.cpp does): with equal slices,
// FSDP's average over the data-parallel ranks of the per-rank means is the mean over the global batch, so
// the gradients (and everything after them) equal the reference's.
//
// The same test code drives both sides (a Trainer per side); `sharded` only decides the rows a side sees.

#include "fully_shard/fsdp_test_util.h"

#include <fsdp/sharded_tensor.h>
#include <fsdp/comm_stats.h>
#include <fsdp/state_dict.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace fsdp_rt {

using fsdp_test::test_world;

// Uneven on purpose: none of 7, 19, 13, 5 is a multiple of 2, 3 or 4 (uneven and short trailing shards).
constexpr int64_t kIn = 7, kDim = 19, kHidden = 13, kOut = 5;
// Divisible by 2, 3 and 4, also after splitting into 2 micro-batches (and into 3 on 2 and 4 ranks).
constexpr int64_t kBatch = 24;

inline int64_t rank() { return test_world()->rank(); }
inline int64_t nranks() { return test_world()->size(); }

// One 1-D mesh over the world for the whole executable (its group's counters are what the tests read).
inline fsdp::DeviceMesh world_mesh() {
  static fsdp::DeviceMesh mesh = fsdp::init_device_mesh("cpu", {test_world()->size()}, {"shard"});
  return mesh;
}

// A block: x + scale * fc2(relu(fc1(x))), with an optional learnable 0-dim `scale` and a one-shot failure
// injected in the middle of forward (after fc1 ran, so the block's parameters are in use).
struct RBlockImpl : torch::nn::Module {
  RBlockImpl(int64_t dim, int64_t hidden, bool with_scale) {
    fc1 = register_module("fc1", torch::nn::Linear(dim, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, dim));
    if (with_scale) scale = register_parameter("scale", torch::full({}, 0.8));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = torch::relu(fc1(x));
    if (throw_in_forward) {
      throw_in_forward = false;
      throw std::runtime_error("injected failure in a block's forward");
    }
    h = fc2(h);
    if (scale.defined()) h = h * scale;
    return x + h;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::Tensor scale;
  bool throw_in_forward = false;
};
TORCH_MODULE(RBlock);

// input -> blocks -> output (* optional 0-dim gain). `body` replaces the default run of the blocks (used to
// call blocks twice, in another order, or to skip some); the flags inject one-shot misbehaviour.
struct NetImpl : torch::nn::Module {
  using Body = std::function<torch::Tensor(NetImpl&, torch::Tensor)>;
  NetImpl(int64_t n_blocks, bool with_scale) {
    input = register_module("input", torch::nn::Linear(kIn, kDim));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < n_blocks; ++i) blocks->push_back(RBlock(kDim, kHidden, with_scale));
    output = register_module("output", torch::nn::Linear(kDim, kOut));
    if (with_scale) gain = register_parameter("gain", torch::full({}, 1.1));
  }
  // Runs block i with its hooks (fsdp::nn::call: plain forward() on the reference).
  torch::Tensor block(size_t i, torch::Tensor h) {
    auto b = blocks->ptr<RBlockImpl>(i);
    return fsdp::nn::call(b, h);
  }
  RBlockImpl& block_ref(size_t i) { return *blocks->ptr<RBlockImpl>(i); }
  torch::Tensor run_blocks(torch::Tensor h) {
    for (size_t i = 0; i < blocks->size(); ++i) {
      h = block(i, h);
      if (i == 0 && throw_in_backward) {
        throw_in_backward = false;
        // Fires in backward after the later blocks' backward ran (their reductions are issued).
        h.register_hook([](const torch::Tensor&) -> void { throw std::runtime_error("injected failure in backward"); });
      }
      if (i == 0 && use_weight_outside) {
        use_weight_outside = false;
        // Wrong on purpose: block 0's weight used by autograd outside block 0's forward.
        h = h + 0.01 * block_ref(0).fc1->weight.sum();
      }
    }
    return h;
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = torch::tanh(input(x));
    h = body ? body(*this, h) : run_blocks(h);
    auto out = output(h);
    if (gain.defined()) out = out * gain;
    return out;
  }
  torch::nn::Linear input{nullptr}, output{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::Tensor gain;
  Body body;
  bool throw_in_backward = false;
  bool use_weight_outside = false;
};
TORCH_MODULE(Net);

inline Net make_net(uint64_t seed, int64_t n_blocks, bool with_scale = false) {
  torch::manual_seed(seed);
  return Net(n_blocks, with_scale);
}

enum class OptKind { SGD, AdamW };
inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(OptKind kind, std::vector<torch::Tensor> params,
                                                               double lr = 0.05) {
  if (kind == OptKind::SGD) {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(lr).momentum(0.9));
  }
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(lr / 5).weight_decay(0.1));
}

// Rows [m*mb + r*local, +local) of a global tensor: micro-batch m of `micro`, this rank's part of it.
inline torch::Tensor rank_rows(const torch::Tensor& global, int64_t m = 0, int64_t micro = 1) {
  const int64_t n = nranks();
  const int64_t mb = global.size(0) / micro;
  EXPECT_EQ(global.size(0) % (micro * n), 0) << "batch " << global.size(0) << " not divisible into " << micro
                                             << " micro-batches of " << n << " ranks";
  const int64_t local = mb / n;
  return global.narrow(0, m * mb + rank() * local, local);
}
inline torch::Tensor micro_rows(const torch::Tensor& global, int64_t m, int64_t micro) {
  const int64_t mb = global.size(0) / micro;
  return global.narrow(0, m * mb, mb);
}

struct Batch {
  torch::Tensor x, y;
};
inline Batch batch(int64_t step, torch::ScalarType dtype = torch::kFloat) {
  auto [x, y] = fsdp_test::global_batch(step, kBatch, kIn, kOut);
  return {x.to(dtype), y.to(dtype)};
}

// One side of a comparison.
struct Trainer {
  Net net{nullptr};
  std::unique_ptr<torch::optim::Optimizer> opt;
  bool sharded = false;
  std::vector<fsdp::FSDPModule> units;  // sharded only: blocks (or groups) first, the root last

  fsdp::FSDPModule& root() { return units.back(); }
  // The rows of a global batch this side trains on.
  torch::Tensor rows(const torch::Tensor& global, int64_t m = 0, int64_t micro = 1) const {
    return sharded ? rank_rows(global, m, micro) : micro_rows(global, m, micro);
  }
  torch::Tensor forward(const torch::Tensor& x) { return fsdp::nn::call(net, x); }
  // An evaluation forward under c10::InferenceMode or torch::NoGradGuard.
  torch::Tensor eval_forward(const torch::Tensor& x, bool inference) {
    if (inference) {
      c10::InferenceMode im;
      return forward(x);
    }
    torch::NoGradGuard ng;
    return forward(x);
  }
  torch::Tensor loss(const Batch& b, int64_t m = 0, int64_t micro = 1) {
    return torch::mse_loss(forward(rows(b.x, m, micro)), rows(b.y, m, micro)) / static_cast<double>(micro);
  }
  // zero_grad; `micro` micro-batches (gradient sync only on the last one); optimizer step.
  void step(const Batch& b, int64_t micro = 1) {
    opt->zero_grad();
    for (int64_t m = 0; m < micro; ++m) {
      if (sharded) root().set_requires_gradient_sync(m == micro - 1);
      loss(b, m, micro).backward();
    }
    opt->step();
  }
};

inline Trainer make_reference(uint64_t seed, int64_t n_blocks, bool with_scale = false, OptKind opt = OptKind::SGD) {
  Trainer t;
  t.net = make_net(seed, n_blocks, with_scale);
  t.opt = make_optimizer(opt, t.net->parameters());
  return t;
}

// fully_shard every block with `block_opts`, then the root with `root_opts` (bottom-up); the optimizer is
// built on the sharded parameters.
inline Trainer make_sharded(uint64_t seed, int64_t n_blocks, const fsdp::FullyShardOptions& block_opts,
                            const fsdp::FullyShardOptions& root_opts, bool with_scale = false,
                            OptKind opt = OptKind::SGD) {
  Trainer t;
  t.sharded = true;
  t.net = make_net(seed, n_blocks, with_scale);
  for (size_t i = 0; i < t.net->blocks->size(); ++i) t.units.push_back(fsdp::fully_shard(t.net->blocks[i], block_opts));
  t.units.push_back(fsdp::fully_shard(t.net, root_opts));
  t.opt = make_optimizer(opt, t.net->parameters());
  return t;
}

inline fsdp::FullyShardOptions mesh_opts(std::optional<fsdp::ReshardAfterForward> reshard = std::nullopt) {
  fsdp::FullyShardOptions o;
  o.mesh = world_mesh();
  o.reshard_after_forward = reshard;
  return o;
}
inline Trainer make_sharded(uint64_t seed, int64_t n_blocks, std::optional<fsdp::ReshardAfterForward> reshard = std::nullopt,
                            bool with_scale = false, OptKind opt = OptKind::SGD) {
  auto o = mesh_opts(reshard);
  return make_sharded(seed, n_blocks, o, o, with_scale, opt);
}

inline std::string reshard_name(const std::optional<fsdp::ReshardAfterForward>& r) {
  if (!r) return "default";
  if (std::holds_alternative<bool>(*r)) return std::get<bool>(*r) ? "true" : "false";
  return "int " + std::to_string(std::get<int>(*r));
}

inline std::map<std::string, torch::Tensor> snapshot(torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : m.named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

// The reference must have trained: parity with an untouched model would prove nothing.
inline void expect_moved(torch::nn::Module& ref, const std::map<std::string, torch::Tensor>& init, double min = 1e-3) {
  double moved = 0;
  for (const auto& item : ref.named_parameters()) {
    moved = std::max(moved, fsdp_test::max_rel_diff(item.value().detach().to(torch::kDouble),
                                                    init.at(item.key()).to(torch::kDouble)));
  }
  EXPECT_GT(moved, min) << "the reference did not train";
}

// Every parameter of the sharded model, gathered (full_state_dict on every rank), equals the reference's:
// same names, shapes and dtypes, max relative difference <= tol. Returns the worst difference.
inline double expect_parity(torch::nn::Module& sharded, torch::nn::Module& ref, double tol, const std::string& what) {
  auto got = fsdp::full_state_dict(sharded, {/*cpu_offload=*/true, /*rank0_only=*/false});
  double worst = 0;
  size_t n = 0;
  for (const auto& item : ref.named_parameters()) {
    ++n;
    auto it = got.find(item.key());
    if (it == got.end()) {
      ADD_FAILURE() << what << ": parameter " << item.key() << " missing from full_state_dict";
      continue;
    }
    const auto& r = item.value();
    EXPECT_EQ(it->second.sizes(), r.sizes()) << what << ": " << item.key();
    EXPECT_EQ(it->second.scalar_type(), r.scalar_type()) << what << ": " << item.key();
    if (it->second.sizes() != r.sizes()) continue;
    const double d = fsdp_test::max_rel_diff(it->second.to(torch::kDouble), r.detach().to(torch::kDouble));
    worst = std::max(worst, d);
    EXPECT_LE(d, tol) << what << ": " << item.key();
  }
  EXPECT_EQ(got.size(), n + ref.named_buffers().size()) << what << ": unexpected entries in full_state_dict";
  std::cout << "[" << what << "] worst relative difference " << worst << "\n";
  return worst;
}

// The local rows a rank should show for a full parameter of `full` (torch.chunk over the world).
inline std::vector<int64_t> shard_sizes(const torch::Tensor& full, int64_t shard_world = -1, int64_t shard_rank = -1) {
  if (shard_world < 0) shard_world = nranks();
  if (shard_rank < 0) shard_rank = rank();
  auto sizes = full.sizes().vec();
  if (sizes.empty()) return sizes;
  sizes[0] = fsdp::shard_offset_and_size(sizes[0], shard_world, shard_rank).second;
  return sizes;
}

struct Counts {
  int64_t ag = 0, rs = 0, ar = 0;
};
inline Counts counts(const fsdp::ProcessGroupPtr& g) {
  const auto& s = fsdp::comm_stats(*g);
  return {s.all_gather_calls, s.reduce_scatter_calls, s.all_reduce_calls};
}

// FSDPModule::reset() (the documented reset after an exception), if the runtime has it yet.
template <class T, class = void>
struct has_reset : std::false_type {};
template <class T>
struct has_reset<T, std::void_t<decltype(std::declval<T&>().reset())>> : std::true_type {};
template <class T>
bool call_reset(T& unit) {
  if constexpr (has_reset<T>::value) {
    unit.reset();
    return true;
  } else {
    (void)unit;
    return false;
  }
}

inline double rel(const torch::Tensor& a, const torch::Tensor& b) {
  return fsdp_test::max_rel_diff(a.detach().to(torch::kDouble), b.detach().to(torch::kDouble));
}

}  // namespace fsdp_rt
