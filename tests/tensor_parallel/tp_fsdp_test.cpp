// fully_shard over tensor-parallel parameters on 4 ranks (dp_shard 2 x tp 2, and replicate 2 x tp 2) vs
// single-process training of the same Llama on the whole global batch (fp32, 1e-5); the strided placement
// that lets full_tensor / state dicts reassemble the global tensor; the all-gathers run over data-parallel
// ranks only (the TP group carries exactly the TP collectives).

#include "tensor_parallel/tp_test_util.h"

#include <fsdp/clip_grad.h>
#include <fsdp/comm_stats.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/llama.h>
#include <fsdp/models/llama_tp_plan.h>
#include <fsdp/nn/module_call.h>
#include <fsdp/state_dict.h>

using namespace fsdp_test;

TEST(StridedShard, ChunksReassembleAndRedistribute) {
  // (_StridedShard(0, 2), Shard(0)) on a [dp 2, tp 2] mesh: TP splits rows first, then each TP chunk is split
  // over dp — rank (i, j) holds chunk i of chunk j (torch.chunk sizes), 11 rows -> 6 + 5 -> 3+3, 3+2.
  if (fsdp_test::test_world()->size() != 4) GTEST_SKIP() << "needs 4 ranks";
  auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
  auto full = torch::arange(11 * 3, torch::kFloat).reshape({11, 3});
  const fsdp::Placements placements{fsdp::StridedShard(0, 2), fsdp::Shard(0)};
  auto st = fsdp::distribute_tensor(full, mesh, placements);
  const int64_t i = mesh.local_rank(0), j = mesh.local_rank(1);
  auto tp_chunk = full.chunk(2, 0)[j];
  auto want = tp_chunk.chunk(2, 0)[i];
  EXPECT_TRUE(torch::equal(st.local(), want)) << st.to_string();
  const int64_t tp_offset = j == 0 ? 0 : 6;
  EXPECT_EQ(st.local_offset()[0], tp_offset + 3 * i);  // both TP chunks (6 and 5 rows) split 3 + rest
  EXPECT_TRUE(torch::equal(st.full_tensor(), full));
  auto plain = st.redistribute({fsdp::Shard(0), fsdp::Replicate()});
  EXPECT_TRUE(torch::equal(plain.local(), full.chunk(2, 0)[i]));
  auto back = plain.redistribute(placements);
  EXPECT_TRUE(torch::equal(back.local(), want));
  EXPECT_EQ(placements[0].to_string(), "_StridedShard(dim=0, sf=2)");
}

namespace {

struct Layout {
  bool replicate;  // true: replicate 2 x tp 2 (HSDP with shard size 1); false: dp_shard 2 x tp 2
  bool sequence_parallel;
  bool loss_parallel;
};

void run_2d(const Layout& c) {
  auto world = fsdp::init_device_mesh("cpu", {2, 1, 2}, {"dp_replicate", "dp_shard", "tp"});
  fsdp::DeviceMesh mesh = c.replicate ? world : fsdp::init_device_mesh("cpu", {2, 2}, {"dp_shard", "tp"});
  fsdp::DeviceMesh dp_mesh = c.replicate ? mesh.slice({"dp_replicate", "dp_shard"}) : mesh["dp_shard"];
  fsdp::DeviceMesh tp = mesh["tp"];
  const int64_t dp_rank = mesh.local_rank(0);  // dp_replicate or dp_shard: which half of the batch

  auto args = fsdp::models::llama::llama3_flavor("cpu_tiny");
  const int64_t B = 4, S = 8, V = args.vocab_size;
  fsdp::models::llama::Transformer ref(args), model(args);
  ref->init_weights(21);
  model->init_weights(21);
  fsdp::parallelize_module(model, tp,
                           fsdp::models::llama::tensor_parallel_plan(args, 2, {c.sequence_parallel, c.loss_parallel}));
  fsdp::FullyShardOptions opts;
  opts.mesh = dp_mesh;
  for (auto& block : model->blocks()) fsdp::fully_shard(block, opts);
  fsdp::fully_shard(model, opts);

  // The sharded state dict describes the global tensors over [dp..., tp]: a colwise weight nests FSDP inside
  // TP (strided), a rowwise weight splits two different dims.
  {
    auto sd = fsdp::sharded_state_dict(*model);
    const auto& wq = sd.at("layers.0.attention.wq.weight");
    const auto& wo = sd.at("layers.0.attention.wo.weight");
    EXPECT_EQ(wq.sizes(), (std::vector<int64_t>{args.n_heads * args.head_dim(), args.dim}));
    const fsdp::Placements want_wq = c.replicate
        ? fsdp::Placements{fsdp::Replicate(), fsdp::StridedShard(0, 2), fsdp::Shard(0)}
        : fsdp::Placements{fsdp::StridedShard(0, 2), fsdp::Shard(0)};
    EXPECT_EQ(fsdp::to_string(wq.placements()), fsdp::to_string(want_wq));
    EXPECT_TRUE(wo.placements().back() == fsdp::Shard(1));
  }

  torch::optim::SGD ref_opt(ref->parameters(), 0.5), opt(model->parameters(), 0.5);
  const auto initial = snapshot(*ref);
  auto tp_group = tp.group(0);
  const std::string what = std::string(c.replicate ? "replicate2 x tp2" : "dp_shard2 x tp2") +
                           " sp=" + (c.sequence_parallel ? "1" : "0") + " lp=" + (c.loss_parallel ? "1" : "0");
  for (int step = 0; step < 3; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
    auto tokens = torch::randint(V, {B, S}, gen), targets = torch::randint(V, {B, S}, gen);
    ref_opt.zero_grad();
    auto ref_loss = torch::cross_entropy_loss(ref->forward(tokens).flatten(0, 1), targets.flatten());
    ref_loss.backward();
    const double ref_norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), 1e9);
    ref_opt.step();

    // This data-parallel rank's half of the batch; both TP ranks of it see the same sequences.
    auto my_tokens = tokens.chunk(2, 0)[dp_rank], my_targets = targets.chunk(2, 0)[dp_rank];
    fsdp::reset_comm_stats(*tp_group);
    opt.zero_grad();
    auto logits = fsdp::nn::call(model, my_tokens);
    auto loss = c.loss_parallel ? fsdp::loss_parallel_cross_entropy(logits, my_targets, tp)
                                : torch::cross_entropy_loss(logits.flatten(0, 1), my_targets.flatten());
    loss.backward();
    const auto tp_stats = fsdp::comm_stats(*tp_group);
    auto norm = fsdp::clip_grad_norm_(*model, 1e9);
    opt.step();
    // fp32 sums of squares in another order (per shard, then across ranks): relative 1e-4, as the trainer tests.
    EXPECT_NEAR(norm.item<double>(), ref_norm, 1e-4 * ref_norm) << what << " grad norm, step " << step;
    // The TP group carries only TP collectives (the FSDP all-gathers and reduce-scatters go over dp): with
    // sequence parallel 4 per block each way plus the root's, as on 2 ranks without FSDP.
    const int64_t L = args.n_layers;
    if (c.sequence_parallel) {
      EXPECT_EQ(tp_stats.all_gather_calls, 4 * L + 2 + (c.loss_parallel ? 0 : 1)) << what;
      EXPECT_EQ(tp_stats.reduce_scatter_calls, 4 * L + 2) << what;
    } else {
      EXPECT_EQ(tp_stats.all_gather_calls, c.loss_parallel ? 0 : 1) << what;
      EXPECT_EQ(tp_stats.reduce_scatter_calls, 0) << what;
    }
  }
  // FSDP ran over the data-parallel groups: all-gathers over dp_shard, or all-reduces over the replicas.
  if (c.replicate) {
    EXPECT_GT(fsdp::comm_stats(*mesh.group("dp_replicate")).all_reduce_calls, 0) << "HSDP did not all-reduce over replicas";
  } else {
    EXPECT_GT(fsdp::comm_stats(*mesh.group("dp_shard")).all_gather_calls, 0) << "FSDP did not all-gather over dp_shard";
  }
  EXPECT_GT(max_change(initial, snapshot(*ref)), 1e-3) << "the reference did not train";
  auto full = fsdp::full_state_dict(*model, {/*cpu_offload=*/true, /*rank0_only=*/false});
  expect_params_close(full, snapshot(*ref), 1e-5, what + " after 3 steps");
}

}  // namespace

TEST(FullyShardOverTensorParallel, DpShard2Tp2SequenceAndLossParallel) {
  if (fsdp_test::test_world()->size() != 4) GTEST_SKIP() << "needs 4 ranks";
  run_2d({false, true, true});
}

TEST(FullyShardOverTensorParallel, DpShard2Tp2PlainTp) {
  if (fsdp_test::test_world()->size() != 4) GTEST_SKIP() << "needs 4 ranks";
  run_2d({false, false, false});
}

TEST(FullyShardOverTensorParallel, Replicate2Tp2SequenceAndLossParallel) {
  if (fsdp_test::test_world()->size() != 4) GTEST_SKIP() << "needs 4 ranks";
  run_2d({true, true, true});
}

TEST(FullyShardOverTensorParallel, Replicate2Tp2PlainTp) {
  if (fsdp_test::test_world()->size() != 4) GTEST_SKIP() << "needs 4 ranks";
  run_2d({true, false, false});
}
