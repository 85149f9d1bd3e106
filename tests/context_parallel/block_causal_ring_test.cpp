// The masked ring (fsdp::block_causal_ring_attention) against each document run alone through plain causal
// softmax attention.
//
// Every rank builds the same global q, k, v [batch, heads, seq, head_dim], upstream gradient and document
// boundaries (same seed). Row 0's boundaries are placed by hand so that, at cp 2 and cp 4 with either layout, a
// document spans several ranks' chunks, whole chunks hold no boundary, two documents have length 1 (one of them
// the last token) and query rows of a chunk see no key of other chunks; row 1's are random. The reference, written
// here and not the library's code: every document of every row alone, causal softmax attention in double
// (scores, mask, softmax, weighted sum), the outputs put back in place and differentiated by autograd. Each rank
// feeds its chunks of q, k, v and of the document ids to the masked ring over the cp group (the world: cp 2 at
// np2, cp 4 at np4), with either rotate method and either layout, and must get the reference's output and dq,
// dk, dv rows for its chunks (fp32, 1e-5). Not vacuous: the reference differs from causal attention over the
// whole rows, and K/V traveled by the method asked (counted transfers). The ring's steps are named ranges in
// libtorch's profiler.
#include "comm/dist_env.h"
#include "context_parallel/chunk_attention.h"
#include "expect_error.h"

#include <fsdp/comm_stats.h>
#include <fsdp/context_parallel.h>
#include <fsdp/process_group.h>

#include <gtest/gtest.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace {

constexpr int64_t kBatch = 2, kHeads = 3, kSeq = 48, kHeadDim = 8;

// Where documents start in each row (position 0 always). Row 0 at cp 4 head-tail (8 chunks of 6 positions):
// the document 7..29 spans chunks 1-4 (ranks 1, 2, 3), chunks 2 and 3 hold no boundary, 5 and 47 are length-1
// documents, and the queries of chunk 5 (from 30) see no key of chunks 0-4.
std::vector<std::vector<int64_t>> document_starts() {
  std::vector<std::vector<int64_t>> starts{{0, 5, 6, 7, 30, 47}};
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const auto picks = torch::randperm(kSeq - 1, gen).slice(0, 0, 6) + 1;  // 6 random boundaries in 1..47
  std::vector<int64_t> random{0};
  for (int64_t i = 0; i < picks.size(0); ++i) random.push_back(picks[i].item<int64_t>());
  std::sort(random.begin(), random.end());
  starts.push_back(random);
  return starts;
}

// Document id of every position: the number of document starts at or before it, minus one. [batch, seq] int64.
torch::Tensor document_ids(const std::vector<std::vector<int64_t>>& starts) {
  auto ids = torch::zeros({kBatch, kSeq}, torch::kLong);
  for (int64_t b = 0; b < kBatch; ++b) {
    for (size_t d = 1; d < starts[b].size(); ++d) ids[b].slice(0, starts[b][d]).add_(1);
  }
  return ids;
}

// Causal softmax attention written out, in double, on [heads, L, head_dim].
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t len = q.size(-2);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  scores = scores.masked_fill(torch::ones({len, len}, torch::kBool).triu(1), -std::numeric_limits<double>::infinity());
  return torch::matmul(torch::softmax(scores, -1), v);
}

struct Case {
  torch::Tensor q, k, v, g, ids;                // global
  torch::Tensor out, dq, dk, dv;                // reference, float
  torch::Tensor whole_row_causal;               // causal attention over whole rows (the not-vacuous check)
};

Case make_case() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2025);
  Case c;
  c.q = torch::randn({kBatch, kHeads, kSeq, kHeadDim}, gen);
  c.k = torch::randn({kBatch, kHeads, kSeq, kHeadDim}, gen);
  c.v = torch::randn({kBatch, kHeads, kSeq, kHeadDim}, gen);
  c.g = torch::randn({kBatch, kHeads, kSeq, kHeadDim}, gen);
  const auto starts = document_starts();
  c.ids = document_ids(starts);
  auto q = c.q.to(torch::kDouble).requires_grad_(), k = c.k.to(torch::kDouble).requires_grad_(),
       v = c.v.to(torch::kDouble).requires_grad_();
  std::vector<torch::Tensor> rows;
  for (int64_t b = 0; b < kBatch; ++b) {
    std::vector<torch::Tensor> docs;
    std::vector<int64_t> bounds = starts[b];
    bounds.push_back(kSeq);
    for (size_t d = 0; d + 1 < bounds.size(); ++d) {
      const int64_t s = bounds[d], e = bounds[d + 1];
      docs.push_back(causal_attention(q[b].slice(1, s, e), k[b].slice(1, s, e), v[b].slice(1, s, e)));
    }
    rows.push_back(torch::cat(docs, 1));
  }
  const auto out = torch::stack(rows);
  (out * c.g.to(torch::kDouble)).sum().backward();
  c.out = out.detach().to(torch::kFloat);
  c.dq = q.grad().to(torch::kFloat);
  c.dk = k.grad().to(torch::kFloat);
  c.dv = v.grad().to(torch::kFloat);
  c.whole_row_causal = causal_attention(c.q.to(torch::kDouble), c.k.to(torch::kDouble), c.v.to(torch::kDouble))
                           .to(torch::kFloat);
  return c;
}

void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  EXPECT_FALSE(got.isnan().any().item<bool>()) << what << ": NaN";
  EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-5))
      << what << ": max diff " << (got - want).abs().max().item<double>() << " (rank " << fsdp::world()->rank() << ")";
}

void run_case(fsdp::CpRotateMethod method, fsdp::CpLoadBalancer balancer) {
  auto cp = fsdp_test::test_world();
  const int64_t rank = cp->rank(), size = cp->size();
  SCOPED_TRACE(std::string(fsdp::to_string(method)) + " " + fsdp::to_string(balancer) + " cp " +
               std::to_string(size));
  const Case c = make_case();
  // Not vacuous: the documents changed the attention.
  ASSERT_GT((c.whole_row_causal - c.out).abs().max().item<double>(), 1e-2);
  auto shard = [&](const torch::Tensor& t, int64_t dim) {
    return fsdp::context_parallel_shard(t, dim, rank, size, balancer);
  };
  auto q = shard(c.q, 2).requires_grad_(), k = shard(c.k, 2).requires_grad_(), v = shard(c.v, 2).requires_grad_();

  fsdp::reset_comm_stats(*cp);
  const auto all_ids = fsdp::context_parallel_gather_document_ids(shard(c.ids, 1), cp);
  ASSERT_EQ(all_ids.sizes(), (std::vector<int64_t>{size, kBatch, kSeq / size}));
  auto out = fsdp::block_causal_ring_attention(q, k, v, all_ids, cp, {method, balancer});
  (out * shard(c.g, 2)).sum().backward();

  expect_close(out, shard(c.out, 2), "output");
  expect_close(q.grad(), shard(c.dq, 2), "dq");
  expect_close(k.grad(), shard(c.dk, 2), "dk");
  expect_close(v.grad(), shard(c.dv, 2), "dv");

  // K and V traveled by the method asked; the ids were gathered once.
  const auto& stats = fsdp::comm_stats(*cp);
  if (method == fsdp::CpRotateMethod::AllGather) {
    EXPECT_EQ(stats.all_gather_calls, 5) << "the ids, then K and V in forward and in backward";
    EXPECT_EQ(stats.reduce_scatter_calls, 1) << "dK/dV home";
    EXPECT_EQ(stats.send_calls, 0);
  } else {
    EXPECT_EQ(stats.all_gather_calls, 1) << "only the ids: K and V go around the ring";
    EXPECT_EQ(stats.reduce_scatter_calls, 0);
    EXPECT_EQ(stats.send_calls, 4 * (size - 1) + size) << "K, V cp-1 hops each way; dK/dV cp hops";
    EXPECT_EQ(stats.p2p_bytes_sent, (4 * (size - 1) + 2 * size) * q.numel() * 4) << "one rank's chunks per hop";
  }
}

TEST(BlockCausalRing, RingHeadTail) { run_case(fsdp::CpRotateMethod::AllToAll, fsdp::CpLoadBalancer::HeadTail); }
TEST(BlockCausalRing, RingNoBalancing) { run_case(fsdp::CpRotateMethod::AllToAll, fsdp::CpLoadBalancer::None); }
TEST(BlockCausalRing, AllGatherHeadTail) { run_case(fsdp::CpRotateMethod::AllGather, fsdp::CpLoadBalancer::HeadTail); }
TEST(BlockCausalRing, AllGatherNoBalancing) { run_case(fsdp::CpRotateMethod::AllGather, fsdp::CpLoadBalancer::None); }

// As a bf16 model calls it: the chunk masks take the queries' dtype (CPU flash requires it); bf16 tolerance.
TEST(BlockCausalRing, RingBf16) {
  auto cp = fsdp_test::test_world();
  const auto balancer = fsdp::CpLoadBalancer::HeadTail;
  const Case c = make_case();
  auto shard = [&](const torch::Tensor& t, int64_t dim) {
    return fsdp::context_parallel_shard(t, dim, cp->rank(), cp->size(), balancer);
  };
  auto leaf = [&](const torch::Tensor& t) { return shard(t, 2).to(torch::kBFloat16).requires_grad_(); };
  auto q = leaf(c.q), k = leaf(c.k), v = leaf(c.v);
  const auto all_ids = fsdp::context_parallel_gather_document_ids(shard(c.ids, 1), cp);
  auto out = fsdp::block_causal_ring_attention(q, k, v, all_ids, cp, {fsdp::CpRotateMethod::AllToAll, balancer});
  ASSERT_EQ(out.scalar_type(), torch::kBFloat16);
  (out.to(torch::kFloat) * shard(c.g, 2)).sum().backward();
  auto close = [](const torch::Tensor& got, const torch::Tensor& want, const char* what) {
    EXPECT_TRUE(torch::allclose(got.to(torch::kFloat), want, 3e-2, 3e-2))
        << what << ": max diff " << (got.to(torch::kFloat) - want).abs().max().item<double>();
  };
  close(out, shard(c.out, 2), "output");
  close(q.grad(), shard(c.dq, 2), "dq");
  close(k.grad(), shard(c.dk, 2), "dk");
  close(v.grad(), shard(c.dv, 2), "dv");
}

// The masked chunk kernel: CPU flash and the math path other devices take agree (forward and backward), and a
// query row that sees no key of the chunk comes back as out 0, log-sum-exp -inf (flash alone reports 0 there), so
// that it merges as nothing.
TEST(BlockCausalRing, MaskedChunkKernelRowsWithoutKeys) {
  namespace d = fsdp::detail;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  auto q = torch::randn({2, 3, 5, 8}, gen), k = torch::randn({2, 3, 5, 8}, gen), v = torch::randn({2, 3, 5, 8}, gen);
  auto visible = torch::rand({2, 1, 5, 5}, gen).gt(0.4);
  visible[0][0][2].fill_(false);  // batch 0, query 2: no key
  const auto mask = torch::zeros({2, 1, 5, 5}).masked_fill(visible.logical_not(), -INFINITY);
  const auto flash = d::attend(q, k, v, false, 0.3, mask), math = d::attend_math(q, k, v, false, 0.3, mask);
  EXPECT_TRUE(flash.lse[0].select(1, 2).isneginf().all().item<bool>());
  EXPECT_TRUE(math.lse[0].select(1, 2).isneginf().all().item<bool>());
  EXPECT_TRUE(flash.out[0].select(1, 2).eq(0).all().item<bool>());
  EXPECT_FALSE(math.out.isnan().any().item<bool>());
  expect_close(math.out, flash.out, "masked out");
  const auto finite = flash.lse.isfinite();
  EXPECT_TRUE(torch::allclose(math.lse.masked_select(finite), flash.lse.masked_select(finite), 1e-5, 1e-5));
  // Backward against a global output and log-sum-exp (the masked chunk merged with a fully visible one, so every
  // row's is finite): the masked pair's dq, dk, dv agree between the two paths.
  auto k1 = torch::randn({2, 3, 5, 8}, gen), v1 = torch::randn({2, 3, 5, 8}, gen);
  auto dout = torch::randn({2, 3, 5, 8}, gen);
  const auto other = d::attend(q, k1, v1, false, 0.3);
  const auto lse = torch::logaddexp(flash.lse, other.lse);
  const auto out =
      flash.out * (flash.lse - lse).exp().unsqueeze(-1) + other.out * (other.lse - lse).exp().unsqueeze(-1);
  const auto gf = d::attend_backward(dout, q, k, v, out, lse, false, 0.3, mask);
  const auto gm = d::attend_backward_math(dout, q, k, v, out, lse, false, 0.3, mask);
  expect_close(gm.dq, gf.dq, "masked dq");
  expect_close(gm.dk, gf.dk, "masked dk");
  expect_close(gm.dv, gf.dv, "masked dv");
}

// In libtorch's profiler the masked ring and its transfers are named ranges (as fsdp-train's [profiling] records),
// and the flash kernels ran once per chunk pair with a visible key: empty pairs were skipped.
TEST(BlockCausalRing, RingStepsAreNamedRangesInTheProfiler) {
  namespace kineto = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  using torch::profiler::impl::ProfilerConfig;
  using torch::profiler::impl::ProfilerState;
  auto cp = fsdp_test::test_world();
  const auto balancer = fsdp::CpLoadBalancer::HeadTail;
  const Case c = make_case();
  auto shard = [&](const torch::Tensor& t, int64_t dim) {
    return fsdp::context_parallel_shard(t, dim, cp->rank(), cp->size(), balancer);
  };
  auto q = shard(c.q, 2).requires_grad_(), k = shard(c.k, 2).requires_grad_(), v = shard(c.v, 2).requires_grad_();
  const ProfilerConfig config(ProfilerState::KINETO, /*report_input_shapes=*/false, /*profile_memory=*/false);
  const std::set<ActivityType> activities{ActivityType::CPU};
  kineto::prepareProfiler(config, activities);
  kineto::enableProfiler(config, activities);
  const auto all_ids = fsdp::context_parallel_gather_document_ids(shard(c.ids, 1), cp);
  auto out = fsdp::block_causal_ring_attention(q, k, v, all_ids, cp, {fsdp::CpRotateMethod::AllToAll, balancer});
  out.backward(shard(c.g, 2));
  fsdp::flush_profiler_reports(*cp, std::chrono::seconds(10));
  auto result = kineto::disableProfiler();
  std::set<std::string> names;
  std::map<std::string, int64_t> calls;
  for (const auto& e : result->events()) {
    names.insert(e.name());
    ++calls[e.name()];
  }
  // Chunk pairs where no query sees a key ran no kernel: one flash forward and one backward per pair with a
  // visible key, counted here from the ids (head-tail: rank r holds chunks r and 2cp-1-r).
  const int64_t n = cp->size(), r = cp->rank(), chunk = kSeq / (2 * n);
  int64_t pairs_seen = 0, pairs_not_future = 0;
  for (int64_t qc : {r, 2 * n - 1 - r}) {
    for (int64_t kc = 0; kc <= qc; ++kc) {
      ++pairs_not_future;
      const auto qi = c.ids.slice(1, qc * chunk, (qc + 1) * chunk), ki = c.ids.slice(1, kc * chunk, (kc + 1) * chunk);
      auto visible = qi.unsqueeze(2).eq(ki.unsqueeze(1));
      if (kc == qc) visible.logical_and_(torch::ones({chunk, chunk}, torch::kBool).tril());
      pairs_seen += visible.any().item<bool>() ? 1 : 0;
    }
  }
  auto skipped = torch::tensor({pairs_not_future - pairs_seen}, torch::kLong);
  cp->all_reduce(skipped).wait();
  EXPECT_GT(skipped.item<int64_t>(), 0) << "these documents leave some pairs empty on some rank";
  EXPECT_EQ(calls["aten::_scaled_dot_product_flash_attention_for_cpu"], pairs_seen);
  EXPECT_EQ(calls["aten::_scaled_dot_product_flash_attention_for_cpu_backward"], pairs_seen);
  for (const char* want : {"fsdp::context_parallel::allgather_document_ids",
                           "fsdp::context_parallel::block_causal_ring_attention",
                           "fsdp::context_parallel::block_causal_ring_attention_backward",
                           "fsdp::context_parallel::rotate_kv", "fsdp::context_parallel::rotate_dkv", "fsdp::send",
                           "fsdp::recv"}) {
    EXPECT_TRUE(names.count(want)) << want;
  }
  EXPECT_FALSE(names.count("fsdp::context_parallel::allgather_kv")) << "the ring gathers no K/V";
}

TEST(BlockCausalRing, BadDocumentIdsAreRefused) {
  auto cp = fsdp_test::test_world();
  auto q = torch::zeros({1, 2, 4, 4});
  const std::string shape_rule = "every cp rank's, int64 [cp " + std::to_string(cp->size());
  const auto one_rank_ids = torch::zeros({1, 4}, torch::kLong);
  fsdp_test::expect_message_has(fsdp_test::error_of([&] {
                                  fsdp::block_causal_ring_attention(q, q, q, one_rank_ids, cp, {});
                                }),
                                {shape_rule.c_str(), "context_parallel_gather_document_ids"});
}

}  // namespace
