// PyTorch FSDP2 patterns that drive a parameter group in an unusual order (issue 35), modelled on
// test_fully_shard_training.py's ChunkedHeadModel tests: a model embed -> body -> norm -> head whose final norm
// and output head share one group (fully_shard({norm, head}); with tied weights fully_shard({embed, norm,
// head})), a forward that skips the head (only part of the group runs), then the head run on its own, outside
// the root's forward, on detached chunks of the hidden state with one backward per chunk (chunked
// cross-entropy), then the hidden state's backward with the concatenated chunk gradients.
//
// Every test compares with single-process training of the same model on the whole global batch (plain
// libtorch: fsdp::nn::call on a module without hooks is its forward), driven by the same code: losses and
// gathered gradients every step (1e-5), parameters at the end, and checks that the reference moved. The
// reduce-scatter counters show the pattern actually ran (one reduction per chunk).
#include "fully_shard/fsdp_state.h"
#include "fully_shard/fsdp_test_util.h"
#include "fully_shard/runtime_test_util.h"

#include <fsdp/comm_stats.h>

using namespace fsdp_test;

// The runtime tests' world helpers (rank, size, the one 1-D mesh over the world), not copies of them.
using fsdp_rt::nranks;
using fsdp_rt::rank;
using fsdp_rt::world_mesh;

namespace {

// 29 vocabulary rows: 15/14 on 2 ranks, 10/10/9 on 3 (uneven shards). 6 sequences: 3 or 2 per rank.
constexpr int64_t kVocab = 29, kDim = 12, kSeq = 8, kChunks = 4, kBatch = 6;

struct EmbedImpl : torch::nn::Module {
  EmbedImpl() { weight = register_parameter("weight", torch::randn({kVocab, kDim}) * 0.5); }
  torch::Tensor forward(torch::Tensor tokens) { return at::embedding(weight, tokens); }
  torch::Tensor weight;
};
TORCH_MODULE(Embed);

struct BodyImpl : torch::nn::Module {
  BodyImpl() { weight = register_parameter("weight", torch::randn({kDim, kDim}) * 0.3); }
  torch::Tensor forward(torch::Tensor x) {
    auto y = torch::tanh(at::linear(x, weight));
    if (throw_once) {
      throw_once = false;
      throw std::runtime_error("injected failure in body's forward");
    }
    return x + y;
  }
  torch::Tensor weight;
  bool throw_once = false;  // a one-shot failure after the weight was used
};
TORCH_MODULE(Body);

struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl() { weight = register_parameter("weight", 1 + 0.1 * torch::randn({kDim})); }
  torch::Tensor forward(torch::Tensor x) { return x * torch::rsqrt(x.pow(2).mean(-1, true) + 1e-6) * weight; }
  torch::Tensor weight;
};
TORCH_MODULE(RMSNorm);

struct HeadImpl : torch::nn::Module {
  explicit HeadImpl(torch::Tensor w) { weight = register_parameter("weight", std::move(w)); }
  torch::Tensor forward(torch::Tensor h) { return at::linear(h, weight); }
  torch::Tensor weight;
};
TORCH_MODULE(Head);

// PyTorch's ChunkedHeadModel: forward skips the head while skip_head is set.
struct ChunkedLMImpl : torch::nn::Module {
  explicit ChunkedLMImpl(bool tied) {
    embed = register_module("embed", Embed());
    body = register_module("body", Body());
    norm = register_module("norm", RMSNorm());
    head = register_module("head", Head(tied ? embed->weight : torch::randn({kVocab, kDim}) * 0.3));
  }
  torch::Tensor forward(torch::Tensor tokens) {
    auto h = fsdp::nn::call(embed, tokens);
    h = fsdp::nn::call(body, h);
    h = fsdp::nn::call(norm, h);
    return skip_head ? h : fsdp::nn::call(head, h);
  }
  Embed embed{nullptr};
  Body body{nullptr};
  RMSNorm norm{nullptr};
  Head head{nullptr};
  bool skip_head = true;
};
TORCH_MODULE(ChunkedLM);

using Reshard = fsdp::ReshardAfterForward;

// One side of a comparison: the model, its optimizer, and (sharded) the units bottom-up, the root last.
struct Side {
  ChunkedLM model{nullptr};
  std::unique_ptr<torch::optim::SGD> opt;
  bool sharded = false;
  std::optional<fsdp::FSDPModule> head_unit;  // the group holding the head
  std::optional<fsdp::FSDPModule> root_unit;

  // This side's rows of a global [kBatch, kSeq + 1] token tensor.
  torch::Tensor rows(const torch::Tensor& global) const {
    if (!sharded) return global;
    const int64_t local = global.size(0) / nranks();
    return global.narrow(0, rank() * local, local);
  }
};

// fully_shard as PyTorch's test does: untied, embed and body alone and {norm, head} together; tied, body
// alone and {embed, norm, head} together; then the root (which keeps no parameter of its own).
Side make_side(bool sharded, bool tied, const Reshard& reshard) {
  torch::manual_seed(35);
  Side s;
  s.sharded = sharded;
  s.model = ChunkedLM(tied);
  if (sharded) {
    fsdp::FullyShardOptions o;
    o.mesh = world_mesh();
    o.reshard_after_forward = reshard;
    using Modules = std::vector<std::shared_ptr<torch::nn::Module>>;
    auto& m = s.model;
    if (tied) {
      fsdp::fully_shard(m->body, o);
      s.head_unit = fsdp::fully_shard(Modules{m->embed.ptr(), m->norm.ptr(), m->head.ptr()}, o);
    } else {
      fsdp::fully_shard(m->embed, o);
      fsdp::fully_shard(m->body, o);
      s.head_unit = fsdp::fully_shard(Modules{m->norm.ptr(), m->head.ptr()}, o);
    }
    s.root_unit = fsdp::fully_shard(m, o);
  }
  s.opt = std::make_unique<torch::optim::SGD>(unique_params(*s.model), torch::optim::SGDOptions(0.5).momentum(0.9));
  return s;
}

torch::Tensor tokens_for(int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3500 + step);
  return torch::randint(0, kVocab, {kBatch, kSeq + 1}, gen);
}

// Called with -1 after the root's forward, before the first chunk, then after each chunk's backward with the
// chunk's index.
using ChunkHook = std::function<void(int64_t)>;

// The chunked loss: h = model(tokens) without the head; per chunk of kSeq / kChunks positions, the head on the
// detached chunk, cross-entropy summed over the chunk's tokens / the side's token count, backward; then
// h.backward(the chunks' input gradients). Returns this side's loss (the mean over its tokens).
double chunked_loss_backward(Side& s, const torch::Tensor& global_tokens, const ChunkHook& hook = {}) {
  auto tokens = s.rows(global_tokens);
  auto inputs = tokens.narrow(1, 0, kSeq);
  auto targets = tokens.narrow(1, 1, kSeq);
  const double n_tokens = static_cast<double>(targets.numel());
  s.model->skip_head = true;
  auto h = fsdp::nn::call(s.model, inputs);
  auto detached = h.detach();
  const int64_t len = kSeq / kChunks;
  std::vector<torch::Tensor> h_grads;
  double loss = 0;
  if (hook) hook(-1);
  for (int64_t c = 0; c < kChunks; ++c) {
    auto chunk = detached.narrow(1, c * len, len).contiguous().detach().requires_grad_(true);
    auto logits = fsdp::nn::call(s.model->head, chunk);
    if (s.sharded) {
      // The head's call opened a forward of its own (outside the root's) and, returning, finished its group's:
      // the backward below starts from idle.
      EXPECT_EQ(fsdp::detail::FSDPModuleAccess::state(*s.head_unit).training_state(), fsdp::detail::Phase::Idle)
          << "chunk " << c << ": the head's group is still in " << fsdp::detail::to_string(
                 fsdp::detail::FSDPModuleAccess::state(*s.head_unit).training_state());
    }
    auto chunk_loss = torch::nn::functional::cross_entropy(
                          logits.reshape({-1, kVocab}), targets.narrow(1, c * len, len).reshape({-1}),
                          torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) /
                      n_tokens;
    chunk_loss.backward();
    loss += chunk_loss.item<double>();
    h_grads.push_back(chunk.grad().detach());
    if (hook) hook(c);
  }
  h.backward(torch::cat(h_grads, 1));
  return loss;
}

// The mean over ranks of a per-rank value (each rank's loss is the mean over its equal share of tokens).
double mean_over_ranks(double value) {
  auto t = torch::full({1}, value, torch::kDouble);
  test_world()->all_reduce(t).wait();
  return t.item<double>() / static_cast<double>(nranks());
}

// A plain model's gradients by FQN, a tied tensor once under its first name.
std::map<std::string, torch::Tensor> reference_grads(const torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : m.named_parameters()) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second && item.value().grad().defined()) {
      out[item.key()] = item.value().grad().detach().clone();
    }
  }
  return out;
}

// The local shard of the head's gradient (its .grad on this rank), or an empty tensor before the first one.
torch::Tensor head_grad_shard(Side& s) {
  auto g = s.model->head->weight.grad();
  return g.defined() ? g.detach().clone() : torch::Tensor();
}

std::string variant(bool tied, bool reshard) {
  return std::string(tied ? "tied" : "untied") + " reshard_after_forward=" + (reshard ? "true" : "false");
}

// Gradients (gathered) and, after the optimizer step, parameters equal the reference's; the reference moved.
void expect_same_training(torch::nn::Module& dist, const torch::nn::Module& ref,
                          const std::map<std::string, torch::Tensor>& init, const std::string& what) {
  expect_equal_maps(full_params(dist, {}), reference_params(ref), 1e-5, what + " parameters");
  double moved = 0;
  for (const auto& [name, p] : reference_params(ref)) moved = std::max(moved, max_rel_diff(p, init.at(name)));
  EXPECT_GT(moved, 1e-3) << what << ": the reference did not train";
}
void expect_same_training(Side& dist, const Side& ref, const std::map<std::string, torch::Tensor>& init,
                          const std::string& what) {
  expect_same_training(*dist.model, *ref.model, init, what);
}

// One training step of both sides, the reference first: zero_grad, `forward_backward(side)` (which may check
// more on the sharded side), the sharded side's gathered gradients equal to the reference's within `tol`, then
// the optimizer step.
void step_both_and_compare_grads(Side& ref, Side& dist, const std::function<void(Side&)>& forward_backward,
                                 const std::string& at, double tol = 1e-5) {
  std::map<std::string, torch::Tensor> ref_grads;
  for (Side* s : {&ref, &dist}) {
    s->opt->zero_grad();
    forward_backward(*s);
    if (s->sharded) {
      expect_equal_maps(full_grads(*s->model), ref_grads, tol, at);
    } else {
      ref_grads = reference_grads(*s->model);
    }
    s->opt->step();
  }
}

// Mean of h^2 plus a second term on another function of h: a loss of the hidden state only (no head).
torch::Tensor hidden_loss(const torch::Tensor& h, double weight) {
  return h.pow(2).mean() + weight * torch::tanh(h).mean();
}


void chunked_training(bool tied, const Reshard& reshard) {
  const std::string what = std::string(tied ? "tied {embed, norm, head}" : "{norm, head}") +
                           " reshard_after_forward=" + (std::get<bool>(reshard) ? "true" : "false");
  Side ref = make_side(false, tied, reshard);
  Side dist = make_side(true, tied, reshard);
  const auto init = reference_params(*ref.model);
  auto world = world_mesh().group(0);
  for (int64_t step = 0; step < 4; ++step) {
    const auto tokens = tokens_for(step);
    ref.opt->zero_grad();
    const double ref_loss = chunked_loss_backward(ref, tokens);
    const auto ref_grads = reference_grads(*ref.model);

    dist.opt->zero_grad();
    torch::Tensor before = head_grad_shard(dist);
    int64_t reductions_before = fsdp::comm_stats(*world).reduce_scatter_calls;
    const double loss = chunked_loss_backward(dist, tokens, [&](int64_t c) {
      if (c < 0) return;
      // Every chunk's backward reduces the head's gradient once and adds to its sharded .grad.
      const int64_t reductions = fsdp::comm_stats(*world).reduce_scatter_calls;
      EXPECT_EQ(reductions - reductions_before, 1) << what << " step " << step << " chunk " << c;
      reductions_before = reductions;
      torch::Tensor now = head_grad_shard(dist);
      ASSERT_TRUE(now.defined()) << what << " step " << step << " chunk " << c << ": no head gradient";
      const double delta = before.defined() ? (now - before).norm().item<double>() : now.norm().item<double>();
      if (now.numel() > 0) {
        EXPECT_GT(delta, 0.0) << what << " step " << step << " chunk " << c << " added nothing";
      }
      before = now;
    });
    const std::string at = what + " step " + std::to_string(step);
    EXPECT_NEAR(mean_over_ranks(loss), ref_loss, 1e-5 * std::abs(ref_loss)) << at << ": loss";
    expect_equal_maps(full_grads(*dist.model), ref_grads, 1e-5, at + " gradients");
    ref.opt->step();
    dist.opt->step();
  }
  expect_same_training(*dist.model, *ref.model, init, what);
  // Between steps the head's group shows its shards again.
  EXPECT_EQ(dist.model->head->weight.size(0), fsdp::shard_offset_and_size(kVocab, nranks(), rank()).second) << what;
}

}  // namespace

// test_fully_shard_training.py::TestFullyShard1DTrainingCompose::test_partial_group_forward_then_standalone
// (reshard_after_forward true/false, with and without weight tying).
TEST(PartialGroupForward, ThenHeadStandalonePerChunkTrainsEqualToSingleProcess) {
  for (bool tied : {false, true}) {
    for (bool reshard : {true, false}) chunked_training(tied, Reshard(reshard));
  }
}


// test_fully_shard_training.py::test_double_partial_forward_then_backward: two partial forwards (the head
// skipped) before one backward of both: every group reduces once; the head gets no gradient (untied).
TEST(PartialGroupForward, TwoPartialForwardsThenOneBackward) {
  for (bool tied : {false, true}) {
    for (bool reshard : {true, false}) {
      const std::string what = "two partial forwards " + variant(tied, reshard);
      Side ref = make_side(false, tied, Reshard(reshard));
      Side dist = make_side(true, tied, Reshard(reshard));
      const auto init = reference_params(*ref.model);
      auto world = world_mesh().group(0);
      for (int64_t step = 0; step < 3; ++step) {
        const auto t1 = tokens_for(10 + 2 * step), t2 = tokens_for(11 + 2 * step);
        step_both_and_compare_grads(ref, dist, [&](Side& s) {
          s.model->skip_head = true;
          auto h1 = fsdp::nn::call(s.model, s.rows(t1).narrow(1, 0, kSeq));
          auto h2 = fsdp::nn::call(s.model, s.rows(t2).narrow(1, 0, kSeq));
          const int64_t rs_before = fsdp::comm_stats(*world).reduce_scatter_calls;
          (hidden_loss(h1, 1.0) + hidden_loss(h2, -0.5)).backward();
          if (s.sharded) {
            // embed, body, {norm, head} (tied: body, {embed, norm, head}); the root holds no parameter.
            EXPECT_EQ(fsdp::comm_stats(*world).reduce_scatter_calls - rs_before, tied ? 2 : 3)
                << what << " step " << step << ": one reduction per group for both forwards";
            EXPECT_EQ(s.model->head->weight.grad().defined(), tied) << what << ": the head ran in no forward";
          }
        }, what + " step " + std::to_string(step));
      }
      expect_same_training(dist, ref, init, what);
    }
  }
}

// test_fully_shard_training.py::test_partial_group_forward_grad_accum_chunked: three micro-batches of chunked
// loss, gradient sync and the last-backward flag only on the last one: no reduction before it, and the
// accumulated gradients equal single-process training on the three micro-batches.
TEST(PartialGroupForward, ChunkedLossWithGradientAccumulation) {
  constexpr int64_t kMicro = 3;
  for (bool tied : {false, true}) {
    for (bool reshard : {true, false}) {
      const std::string what = "chunked accumulation " + variant(tied, reshard);
      Side ref = make_side(false, tied, Reshard(reshard));
      Side dist = make_side(true, tied, Reshard(reshard));
      const auto init = reference_params(*ref.model);
      auto world = world_mesh().group(0);
      for (int64_t step = 0; step < 3; ++step) {
        step_both_and_compare_grads(ref, dist, [&](Side& s) {
          for (int64_t m = 0; m < kMicro; ++m) {
            const bool last = m == kMicro - 1;
            if (s.sharded) {
              s.root_unit->set_requires_gradient_sync(last);
              s.root_unit->set_is_last_backward(last);
            }
            const int64_t rs_before = fsdp::comm_stats(*world).reduce_scatter_calls;
            chunked_loss_backward(s, tokens_for(100 + kMicro * step + m));
            if (s.sharded && !last) {
              EXPECT_EQ(fsdp::comm_stats(*world).reduce_scatter_calls, rs_before) << what << " micro-batch " << m;
            }
          }
        }, what + " step " + std::to_string(step), kMicro * 1e-5);
      }
      expect_same_training(dist, ref, init, what);
    }
  }
}

// test_fully_shard_training.py::test_partial_group_reshard_toggle (torchtitan's ChunkedCELoss): the head's
// group keeps its parameters after forward during the chunk loop (set_reshard_after_forward(false)), then the
// policy is restored and head.reshard() called before the hidden state's backward.
TEST(PartialGroupForward, ReshardToggleAroundTheChunkLoop) {
  for (bool tied : {false, true}) {
    for (bool reshard : {true, false}) {
      const std::string what = "reshard toggle " + variant(tied, reshard);
      Side ref = make_side(false, tied, Reshard(reshard));
      Side dist = make_side(true, tied, Reshard(reshard));
      const auto init = reference_params(*ref.model);
      const int64_t shard_rows = fsdp::shard_offset_and_size(kVocab, nranks(), rank()).second;
      for (int64_t step = 0; step < 3; ++step) {
        const auto tokens = tokens_for(200 + step);
        step_both_and_compare_grads(ref, dist, [&](Side& s) {
          if (!s.sharded) {
            chunked_loss_backward(s, tokens);
            return;
          }
          // Set after the root's forward, before the first chunk; restored after the last chunk's backward.
          chunked_loss_backward(s, tokens, [&](int64_t c) {
            if (c < 0) {
              s.head_unit->set_reshard_after_forward(false);
              s.head_unit->set_reshard_after_backward(false);
            }
            if (c == kChunks - 1) {
              s.head_unit->set_reshard_after_forward(reshard);
              s.head_unit->set_reshard_after_backward(true);
              s.head_unit->reshard();
              EXPECT_EQ(s.model->head->weight.size(0), shard_rows) << what << ": head.reshard() left it unsharded";
            }
          });
        }, what + " step " + std::to_string(step));
      }
      expect_same_training(dist, ref, init, what);
    }
  }
}

// test_fully_shard_training.py::test_non_root_forward_backward: a training step through the root, then one
// through a non-root module alone (its own forward and backward, outside the root's forward).
TEST(PartialGroupForward, NonRootForwardBackwardAfterARootStep) {
  for (bool reshard : {true, false}) {
    const std::string what = "non-root step " + variant(false, reshard);
    Side ref = make_side(false, false, Reshard(reshard));
    Side dist = make_side(true, false, Reshard(reshard));
    const auto init = reference_params(*ref.model);
    auto world = world_mesh().group(0);
    for (int64_t step = 0; step < 3; ++step) {
      const auto tokens = tokens_for(300 + step);
      auto x = torch::randn({kBatch, kSeq, kDim}, at::make_generator<at::CPUGeneratorImpl>(400 + step));
      std::vector<double> losses;
      for (Side* s : {&ref, &dist}) {
        s->opt->zero_grad();
        losses.push_back(chunked_loss_backward(*s, tokens));
        s->opt->step();
        s->opt->zero_grad();
        const int64_t rs_before = fsdp::comm_stats(*world).reduce_scatter_calls;
        auto loss = hidden_loss(fsdp::nn::call(s->model->body, s->rows(x)), 0.3);
        loss.backward();
        losses.push_back(loss.item<double>());
        if (s->sharded) {
          EXPECT_EQ(fsdp::comm_stats(*world).reduce_scatter_calls - rs_before, 1) << what << ": body reduced once";
          EXPECT_FALSE(s->model->embed->weight.grad().defined()) << what << ": embed took no part";
        }
        s->opt->step();
      }
      EXPECT_NEAR(mean_over_ranks(losses[2]), losses[0], 1e-5 * std::abs(losses[0])) << what << " step " << step;
      EXPECT_NEAR(mean_over_ranks(losses[3]), losses[1], 1e-5 * std::abs(losses[1])) << what << " step " << step;
    }
    expect_same_training(dist, ref, init, what);
  }
}

namespace {

// test_fully_shard_autograd.py's DoubleLinear: the root returns two outputs, one of them from its own
// parameters (lin2); lin1 is sharded alone.
struct TwoOutputsImpl : torch::nn::Module {
  TwoOutputsImpl() {
    lin1 = register_module("lin1", Body());
    lin2 = register_module("lin2", Body());
  }
  std::pair<torch::Tensor, torch::Tensor> forward(torch::Tensor x) {
    return {fsdp::nn::call(lin1, x), fsdp::nn::call(lin2, x)};
  }
  Body lin1{nullptr}, lin2{nullptr};
};
TORCH_MODULE(TwoOutputs);

// Trains a plain model `ref` on the whole batch and its sharded copy `dist` on this rank's rows, with SGD,
// on random [kBatch, kDim] inputs: per step the loss (mean over the ranks), the gathered gradients (1e-5) and
// `check(step, reduce-scatters of the step's backward)`; at the end the parameters, and that ref moved.
template <class Holder>
void train_plain_against_reference(
    Holder& ref, Holder& dist, int64_t steps, uint64_t seed,
    const std::function<torch::Tensor(Holder&, const torch::Tensor&, int64_t)>& loss_of,
    const std::function<void(int64_t, int64_t)>& check, const std::string& what) {
  torch::optim::SGD ref_opt(unique_params(*ref), torch::optim::SGDOptions(0.2).momentum(0.9));
  torch::optim::SGD dist_opt(unique_params(*dist), torch::optim::SGDOptions(0.2).momentum(0.9));
  const auto init = reference_params(*ref);
  auto world = world_mesh().group(0);
  const int64_t local = kBatch / nranks();
  for (int64_t step = 0; step < steps; ++step) {
    auto x = torch::randn({kBatch, kDim}, at::make_generator<at::CPUGeneratorImpl>(seed + step));
    ref_opt.zero_grad();
    torch::Tensor ref_loss = loss_of(ref, x, step);
    ref_loss.backward();
    const auto ref_grads = reference_grads(*ref);
    dist_opt.zero_grad();
    torch::Tensor loss = loss_of(dist, x.narrow(0, rank() * local, local), step);
    const int64_t rs_before = fsdp::comm_stats(*world).reduce_scatter_calls;
    loss.backward();
    check(step, fsdp::comm_stats(*world).reduce_scatter_calls - rs_before);
    const std::string at = what + " step " + std::to_string(step);
    const double expected = ref_loss.item<double>();
    EXPECT_NEAR(mean_over_ranks(loss.item<double>()), expected, 1e-5 * std::abs(expected)) << at;
    expect_equal_maps(full_grads(*dist), ref_grads, 1e-5, at);
    ref_opt.step();
    dist_opt.step();
  }
  expect_same_training(*dist, *ref, init, what);
}

}  // namespace

// test_fully_shard_autograd.py::test_unused_forward_output: a backward through only some of the forward's
// outputs: in the later steps the second output (the root's own parameters) is left out of the loss, so the
// root's group gets no gradient, reduces nothing and is left as training without it would leave it.
TEST(PartialGroupForward, BackwardThroughOnlySomeOutputs) {
  for (bool reshard : {true, false}) {
    const std::string what = std::string("unused output reshard_after_forward=") + (reshard ? "true" : "false");
    torch::manual_seed(36);
    TwoOutputs ref;
    torch::manual_seed(36);
    TwoOutputs dist;
    fsdp::FullyShardOptions o;
    o.mesh = world_mesh();
    o.reshard_after_forward = Reshard(reshard);
    fsdp::fully_shard(dist->lin1, o);
    fsdp::fully_shard(dist, o);
    auto both_outputs = [](int64_t step) { return step < 3; };
    train_plain_against_reference<TwoOutputs>(
        ref, dist, 6, 600,
        [&](TwoOutputs& m, const torch::Tensor& x, int64_t step) {
          auto [out1, out2] = fsdp::nn::call(m, x);
          return both_outputs(step) ? (out1 * out2).mean() : out1.pow(2).mean();
        },
        [&](int64_t step, int64_t reductions) {
          EXPECT_EQ(reductions, both_outputs(step) ? 2 : 1) << what << " step " << step;
          EXPECT_EQ(dist->lin2->weight.grad().defined(), both_outputs(step)) << what << " step " << step;
        },
        what);
  }
}

// test_fully_shard_training.py::test_reset_iter_state_after_exception: the body raises inside a forward that
// skips the head (after embed ran, before the head's group did); the step is abandoned on every rank, and the
// next steps of chunked training equal single-process training that skipped the failed step — with and
// without an explicit reset() (the next root forward recovers by itself).
TEST(PartialGroupForward, ExceptionInAPartialForwardThenChunkedTraining) {
  for (bool explicit_reset : {false, true}) {
    const std::string what = std::string("exception in partial forward, ") + (explicit_reset ? "reset()" : "no reset");
    Side ref = make_side(false, false, Reshard(true));
    Side dist = make_side(true, false, Reshard(true));
    const auto init = reference_params(*ref.model);
    for (int64_t step = 0; step < 4; ++step) {
      const auto tokens = tokens_for(700 + step);
      if (step == 1) {
        dist.model->body->throw_once = true;
        dist.model->skip_head = true;
        EXPECT_THROW(fsdp::nn::call(dist.model, dist.rows(tokens).narrow(1, 0, kSeq)), std::exception) << what;
        if (explicit_reset) dist.root_unit->reset();
        continue;  // the reference skips the failed step
      }
      step_both_and_compare_grads(ref, dist, [&](Side& s) { chunked_loss_backward(s, tokens); },
                                  what + " step " + std::to_string(step));
    }
    expect_same_training(dist, ref, init, what);
  }
}

namespace {

// test_fully_shard_frozen.py's MultiForwardModule: a trainable layer and a frozen one, each called three times
// in one forward, the trainable one also once more per round under no_grad (its result added in place).
struct MultiForwardImpl : torch::nn::Module {
  MultiForwardImpl() {
    layer0 = register_module("layer0", Body());
    with_grad = register_module("with_grad", Body());
    no_grad = register_module("no_grad", Body());
    no_grad->weight.requires_grad_(false);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = fsdp::nn::call(layer0, x);
    for (int i = 0; i < 3; ++i) {
      x = fsdp::nn::call(no_grad, torch::relu(fsdp::nn::call(with_grad, x)));
      torch::NoGradGuard guard;
      x.add_(torch::relu(fsdp::nn::call(with_grad, x)));
    }
    return x;
  }
  Body layer0{nullptr}, with_grad{nullptr}, no_grad{nullptr};
};
TORCH_MODULE(MultiForward);

}  // namespace

// test_fully_shard_frozen.py::test_multi_forward_mixed_requires_grad: modules used several times in one
// forward, with and without gradients, one of them frozen (a group with no gradient).
TEST(PartialGroupForward, MultiForwardMixedRequiresGrad) {
  for (bool reshard : {true, false}) {
    const std::string what = std::string("multi-forward mixed requires_grad reshard_after_forward=") +
                             (reshard ? "true" : "false");
    torch::manual_seed(37);
    MultiForward ref;
    torch::manual_seed(37);
    MultiForward dist;
    fsdp::FullyShardOptions o;
    o.mesh = world_mesh();
    o.reshard_after_forward = Reshard(reshard);
    for (auto m : {dist->layer0.ptr(), dist->with_grad.ptr(), dist->no_grad.ptr()}) fsdp::fully_shard(m, o);
    fsdp::fully_shard(dist, o);
    train_plain_against_reference<MultiForward>(
        ref, dist, 5, 800,
        [](MultiForward& m, const torch::Tensor& x, int64_t) { return torch::tanh(fsdp::nn::call(m, x)).pow(2).mean(); },
        [&](int64_t step, int64_t reductions) {
          // layer0 and with_grad reduce once each; the frozen layer and the parameter-less root reduce nothing.
          EXPECT_EQ(reductions, 2) << what << " step " << step;
          EXPECT_FALSE(dist->no_grad->weight.grad().defined()) << what << " step " << step;
        },
        what);
  }
}

// test_fully_shard_comm.py::test_backward_misprefetch: body is told to prefetch, in backward, the head's group,
// whose backward already ran (backward goes head -> body -> embed): the wasted all-gather is completed and
// dropped at the end of backward, and training (full forwards through the head) equals single-process.
TEST(PartialGroupForward, BackwardMisprefetchIsDroppedAndTrainsTheSame) {
  const std::string what = "backward misprefetch";
  Side ref = make_side(false, false, Reshard(true));
  Side dist = make_side(true, false, Reshard(true));
  auto body_unit = fsdp::fsdp_module(*dist.model->body);
  ASSERT_TRUE(body_unit.has_value());
  body_unit->set_modules_to_backward_prefetch({*dist.head_unit});
  const auto init = reference_params(*ref.model);
  const int64_t shard_rows = fsdp::shard_offset_and_size(kVocab, nranks(), rank()).second;
  for (int64_t step = 0; step < 3; ++step) {
    const auto tokens = tokens_for(900 + step);
    step_both_and_compare_grads(ref, dist, [&](Side& s) {
      s.model->skip_head = false;
      auto t = s.rows(tokens);
      auto logits = fsdp::nn::call(s.model, t.narrow(1, 0, kSeq));
      torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), t.narrow(1, 1, kSeq).reshape({-1})).backward();
      // Nothing left gathered by the misprefetch.
      if (s.sharded) EXPECT_EQ(s.model->head->weight.size(0), shard_rows) << what << " step " << step;
    }, what + " step " + std::to_string(step));
  }
  expect_same_training(dist, ref, init, what);
}

// test_fully_shard_comm.py::test_manual_reshard_with_reshard_after_forward_false: every group kept after
// forward (reshard_after_forward=false) is resharded by hand between forward and backward; backward gathers
// each again (one all-gather per group) and training equals single-process.
TEST(PartialGroupForward, ManualReshardBetweenForwardAndBackward) {
  const std::string what = "manual reshard before backward";
  Side ref = make_side(false, false, Reshard(false));
  Side dist = make_side(true, false, Reshard(false));
  const auto init = reference_params(*ref.model);
  auto world = world_mesh().group(0);
  std::vector<fsdp::FSDPModule> units;
  for (torch::nn::Module* m : {static_cast<torch::nn::Module*>(dist.model->embed.get()),
                               static_cast<torch::nn::Module*>(dist.model->body.get())}) {
    units.push_back(*fsdp::fsdp_module(*m));
  }
  units.push_back(*dist.head_unit);
  for (int64_t step = 0; step < 3; ++step) {
    const auto tokens = tokens_for(950 + step);
    step_both_and_compare_grads(ref, dist, [&](Side& s) {
      s.model->skip_head = false;
      auto t = s.rows(tokens);
      auto logits = fsdp::nn::call(s.model, t.narrow(1, 0, kSeq));
      auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), t.narrow(1, 1, kSeq).reshape({-1}));
      if (!s.sharded) {
        loss.backward();
        return;
      }
      for (auto& u : units) u.reshard();
      EXPECT_EQ(s.model->head->weight.size(0), fsdp::shard_offset_and_size(kVocab, nranks(), rank()).second) << what;
      const int64_t ag_before = fsdp::comm_stats(*world).all_gather_calls;
      loss.backward();
      EXPECT_EQ(fsdp::comm_stats(*world).all_gather_calls - ag_before, 3) << what << " step " << step;
    }, what + " step " + std::to_string(step));
  }
  expect_same_training(dist, ref, init, what);
}
