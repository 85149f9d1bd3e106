// Every collective against values each rank computes on its own from a formula of the contributing rank.
// Runs as 1 (by hand), 2, 3 and 4 ranks.

#include "comm/dist_env.h"
#include <fsdp/comm_stats.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>

using fsdp::ReduceOp;
using fsdp_test::test_world;

namespace {

// What rank r contributes at element i: small binary fractions, exact in every dtype tested (bf16 has 8
// significant bits, so values stay below 64 with steps of 0.5).
double contrib(int r, int64_t i) { return 0.5 * ((r * 3 + i) % 11) + r; }

at::Tensor contrib_tensor(int r, int64_t n, at::ScalarType dt, int64_t offset = 0) {
  auto t = at::empty({n}, at::kDouble);
  auto a = t.accessor<double, 1>();
  for (int64_t i = 0; i < n; ++i) a[i] = contrib(r, offset + i);
  return t.to(dt);
}

double reduce_ref(ReduceOp op, int size, int64_t i) {
  double acc = contrib(0, i);
  for (int r = 1; r < size; ++r) {
    const double v = contrib(r, i);
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg: acc += v; break;
      case ReduceOp::Max: acc = std::max(acc, v); break;
      case ReduceOp::Min: acc = std::min(acc, v); break;
    }
  }
  return op == ReduceOp::Avg ? acc / size : acc;
}

at::Tensor reduce_ref_tensor(ReduceOp op, int size, int64_t n, at::ScalarType dt, int64_t offset = 0) {
  auto t = at::empty({n}, at::kDouble);
  auto a = t.accessor<double, 1>();
  for (int64_t i = 0; i < n; ++i) a[i] = reduce_ref(op, size, offset + i);
  return t.to(dt);
}

void expect_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(at::equal(got, want)) << what << "\n got  " << got << "\n want " << want;
}

const at::ScalarType kFloatTypes[] = {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble};
const ReduceOp kOps[] = {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min};

}  // namespace

TEST(Collectives, WorldMatchesEnvironment) {
  auto w = test_world();
  EXPECT_EQ(w->name(), "world");
  EXPECT_EQ(w->backend(), "gloo");
  EXPECT_EQ(w->device(), c10::Device(c10::kCPU));
  ASSERT_EQ(static_cast<int>(w->global_ranks().size()), w->size());
  for (int i = 0; i < w->size(); ++i) EXPECT_EQ(w->global_ranks()[i], i);
  if (std::getenv("WORLD_SIZE")) {
    EXPECT_EQ(w->size(), std::atoi(std::getenv("WORLD_SIZE")));
    EXPECT_EQ(w->rank(), std::atoi(std::getenv("RANK")));
  }
}

TEST(Collectives, AllGatherEveryDtypeUnevenCounts) {
  auto w = test_world();
  const int s = w->size();
  for (auto dt : kFloatTypes) {
    for (int64_t n : {1, 5, 7, 1000}) {
      auto in = contrib_tensor(w->rank(), n, dt);
      auto out = at::full({s * n}, -1.0, at::TensorOptions().dtype(dt));
      w->all_gather_into_tensor(out, in).wait();
      for (int r = 0; r < s; ++r) {
        expect_equal(out.narrow(0, r * n, n), contrib_tensor(r, n, dt),
                     c10::str("all_gather ", dt, " n=", n, " slot ", r));
      }
    }
  }
}

TEST(Collectives, AllGatherInPlaceFromOwnSlot) {
  auto w = test_world();
  const int s = w->size();
  const int64_t n = 6;
  auto out = at::zeros({s * n});
  out.narrow(0, w->rank() * n, n).copy_(contrib_tensor(w->rank(), n, at::kFloat));
  w->all_gather_into_tensor(out, out.narrow(0, w->rank() * n, n)).wait();
  for (int r = 0; r < s; ++r) expect_equal(out.narrow(0, r * n, n), contrib_tensor(r, n, at::kFloat), "in-place");
}

TEST(Collectives, ReduceScatterEveryOpAndDtype) {
  auto w = test_world();
  const int s = w->size();
  for (auto dt : kFloatTypes) {
    for (auto op : kOps) {
      for (int64_t n : {1, 3, 5, 257}) {  // per-rank chunk sizes, not multiples of 4 on purpose
        auto in = contrib_tensor(w->rank(), s * n, dt);
        auto out = at::full({n}, -7.0, at::TensorOptions().dtype(dt));
        w->reduce_scatter_tensor(out, in, op).wait();
        auto want = reduce_ref_tensor(op, s, n, dt, w->rank() * n);
        const auto what = c10::str("reduce_scatter ", fsdp::to_string(op), " ", dt, " n=", n);
        if (op == ReduceOp::Avg && s == 3) {
          // x/3 is inexact: reference rounds once from double, we round once from the dtype's accumulator.
          const double tol = (dt == at::kBFloat16) ? 1e-2 : (dt == at::kHalf ? 1e-3 : 1e-6);
          EXPECT_TRUE(at::allclose(out.to(at::kDouble), want.to(at::kDouble), tol, 0)) << what;
        } else {
          expect_equal(out, want, what);
        }
      }
    }
  }
}

TEST(Collectives, ReduceScatterBf16AccumulatesInFp32) {
  const char* native = std::getenv("FSDP_NATIVE_COLLECTIVES");
  if (native && std::string(native) == "1") {
    GTEST_SKIP() << "FSDP_NATIVE_COLLECTIVES=1: the backend's own reduce-scatter accumulates in the wire dtype "
                    "(as with NCCL in PyTorch); fp32 accumulation is a property of our exchange";
  }
  auto w = test_world();
  const int s = w->size();
  // Rank 0 contributes 256, the others 1 each. Summed in bf16 one addition at a time (spacing 2 at 256) the
  // ones vanish: 256. Accumulated in fp32 and rounded once: bf16(256 + (s-1)).
  auto in = at::full({s * 4}, w->rank() == 0 ? 256.0 : 1.0, at::TensorOptions().dtype(at::kBFloat16));
  auto out = at::empty({4}, at::kBFloat16);
  w->reduce_scatter_tensor(out, in, ReduceOp::Sum).wait();
  auto want = at::full({4}, 256.0 + (s - 1), at::kDouble).to(at::kBFloat16);
  expect_equal(out, want, "bf16 fp32-accumulated sum");
}

TEST(Collectives, ReduceScatterRejectsIndivisibleInput) {
  auto w = test_world();
  auto out = at::empty({3});
  auto in = at::empty({3 * w->size() + 1});
  try {
    w->reduce_scatter_tensor(out, in).wait();
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("padded"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("reduce_scatter_tensor"), std::string::npos) << e.what();
  }
}

TEST(Collectives, NonContiguousAndMisuseAreErrors) {
  auto w = test_world();
  auto t = at::zeros({4, 4}).t();
  EXPECT_THROW(w->all_reduce(t), c10::Error);
  try {
    w->all_reduce(t);
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("contiguous"), std::string::npos) << e.what();
  }
  EXPECT_THROW(w->all_reduce(at::zeros({4}, at::kInt), ReduceOp::Avg), c10::Error);
  EXPECT_THROW(w->all_gather_into_tensor(at::zeros({5}), at::zeros({3})), c10::Error);
  EXPECT_THROW(w->all_gather_into_tensor(at::zeros({w->size() * 3}, at::kDouble), at::zeros({3})), c10::Error);
  EXPECT_THROW(w->broadcast(at::zeros({3}), w->size()), c10::Error);
  EXPECT_THROW(w->all_to_all(at::zeros({w->size() * 2}), at::zeros({w->size() * 3})), c10::Error);
}

TEST(Collectives, AllReduceEveryOpAndDtype) {
  auto w = test_world();
  const int s = w->size();
  for (auto dt : kFloatTypes) {
    for (auto op : kOps) {
      for (int64_t n : {1, 7, 300}) {
        auto t = contrib_tensor(w->rank(), n, dt);
        w->all_reduce(t, op).wait();
        auto want = reduce_ref_tensor(op, s, n, dt);
        const auto what = c10::str("all_reduce ", fsdp::to_string(op), " ", dt, " n=", n);
        if (op == ReduceOp::Avg && s == 3) {
          const double tol = (dt == at::kBFloat16) ? 1e-2 : (dt == at::kHalf ? 1e-3 : 1e-6);
          EXPECT_TRUE(at::allclose(t.to(at::kDouble), want.to(at::kDouble), tol, 0)) << what;
        } else {
          expect_equal(t, want, what);
        }
      }
    }
  }
}

TEST(Collectives, AllReduceIntegers) {
  auto w = test_world();
  const int s = w->size();
  auto t = at::full({5}, w->rank() + 1, at::kLong);
  w->all_reduce(t, ReduceOp::Sum).wait();
  expect_equal(t, at::full({5}, s * (s + 1) / 2, at::kLong), "int64 sum");
  auto m = at::full({5}, w->rank() * 10, at::kInt);
  w->all_reduce(m, ReduceOp::Max).wait();
  expect_equal(m, at::full({5}, (s - 1) * 10, at::kInt), "int32 max");
}

TEST(Collectives, BroadcastFromEveryRoot) {
  auto w = test_world();
  for (int root = 0; root < w->size(); ++root) {
    for (auto dt : {at::kFloat, at::kBFloat16}) {
      auto t = w->rank() == root ? contrib_tensor(root, 9, dt) : at::zeros({9}, dt);
      w->broadcast(t, root).wait();
      expect_equal(t, contrib_tensor(root, 9, dt), c10::str("broadcast root ", root, " ", dt));
    }
  }
}

TEST(Collectives, AllToAll) {
  auto w = test_world();
  const int s = w->size();
  const int64_t n = 3;
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    // Element k of the chunk rank r sends to rank j (small integers: exact in bf16).
    auto code = [](int r, int j, int64_t k) { return 16.0 * r + 4.0 * j + k; };
    auto in = at::empty({s * n}, at::kDouble);
    for (int j = 0; j < s; ++j)
      for (int64_t k = 0; k < n; ++k) in[j * n + k] = code(w->rank(), j, k);
    auto out = at::full({s * n}, -1.0, at::TensorOptions().dtype(dt));
    w->all_to_all(out, in.to(dt)).wait();
    auto want = at::empty({s * n}, at::kDouble);
    for (int r = 0; r < s; ++r)
      for (int64_t k = 0; k < n; ++k) want[r * n + k] = code(r, w->rank(), k);
    expect_equal(out, want.to(dt), c10::str("all_to_all ", dt));
  }
}

TEST(Collectives, AsyncWorkCanBeWaitedOutOfOrderAndTwice) {
  auto w = test_world();
  const int s = w->size();
  auto a = contrib_tensor(w->rank(), 64, at::kFloat);
  auto in = contrib_tensor(w->rank(), 64 * s, at::kFloat);
  auto out = at::empty({64});
  auto wa = w->all_reduce(a);
  auto wb = w->reduce_scatter_tensor(out, in);
  wb.wait();
  wa.wait();
  wa.wait();  // no-op
  EXPECT_TRUE(wa.is_completed());
  EXPECT_TRUE(wb.is_completed());
  expect_equal(a, reduce_ref_tensor(ReduceOp::Sum, s, 64, at::kFloat), "async all_reduce");
  expect_equal(out, reduce_ref_tensor(ReduceOp::Sum, s, 64, at::kFloat, w->rank() * 64), "async reduce_scatter");
  fsdp::Work none;
  EXPECT_TRUE(none.is_completed());
  none.wait();
}

TEST(Collectives, StatsCountCallsAndAlgorithmBytes) {
  auto w = test_world();
  const int s = w->size();
  w->barrier().wait();
  fsdp::reset_comm_stats(*w);
  const int64_t n = 1024;  // per-rank chunk; fp32
  auto in = at::ones({s * n});
  auto out = at::empty({n});
  w->reduce_scatter_tensor(out, in).wait();
  const int64_t input_bytes = s * n * 4;
  const int64_t rs_bytes = fsdp::comm_stats(*w).bytes_sent;
  // Ring reduce-scatter optimum: (s-1)/s of the input leaves each rank.
  EXPECT_EQ(rs_bytes, (s - 1) * n * 4);
  EXPECT_EQ(rs_bytes * s, (s - 1) * input_bytes);
  fsdp::reset_comm_stats(*w);
  w->all_reduce(in).wait();
  // A ring all-reduce of the same tensor moves twice the bytes of the reduce-scatter.
  EXPECT_EQ(fsdp::comm_stats(*w).bytes_sent, 2 * rs_bytes);
  fsdp::reset_comm_stats(*w);
  auto gathered = at::empty({s * n});
  w->all_gather_into_tensor(gathered, out).wait();
  EXPECT_EQ(fsdp::comm_stats(*w).bytes_sent, (s - 1) * n * 4);
  fsdp::reset_comm_stats(*w);
  w->broadcast(out, 0).wait();
  EXPECT_EQ(fsdp::comm_stats(*w).bytes_sent, w->rank() == 0 ? (s - 1) * n * 4 : 0);
  w->all_to_all(gathered, in).wait();
  w->barrier().wait();
  const auto& st = fsdp::comm_stats(*w);
  EXPECT_EQ(st.broadcast_calls, 1);
  EXPECT_EQ(st.all_to_all_calls, 1);
  EXPECT_EQ(st.barrier_calls, 1);
  EXPECT_EQ(st.all_gather_calls, 0);
  EXPECT_EQ(st.reduce_scatter_calls, 0);
  fsdp::reset_comm_stats(*w);
  for (int i = 0; i < 3; ++i) w->all_reduce(out).wait();
  EXPECT_EQ(fsdp::comm_stats(*w).all_reduce_calls, 3);
}

TEST(Groups, NewGroupOfEvenRanks) {
  auto w = test_world();
  const int s = w->size();
  std::vector<int> evens;
  for (int r = 0; r < s; r += 2) evens.push_back(r);
  auto g = fsdp::new_group(evens, "evens");
  if (w->rank() % 2 == 1) {
    EXPECT_EQ(g, nullptr);
    return;
  }
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(g->name(), "evens");
  EXPECT_EQ(g->size(), static_cast<int>(evens.size()));
  EXPECT_EQ(g->rank(), w->rank() / 2);
  EXPECT_EQ(g->global_ranks(), evens);
  auto t = at::full({3}, static_cast<double>(w->rank() + 1));
  g->all_reduce(t).wait();
  double want = 0;
  for (int r : evens) want += r + 1;
  expect_equal(t, at::full({3}, want), "sum over even ranks");
}

TEST(Groups, ReversedOrderGroupRanksFollowTheList) {
  auto w = test_world();
  const int s = w->size();
  std::vector<int> rev;
  for (int r = s - 1; r >= 0; --r) rev.push_back(r);
  auto g = fsdp::new_group(rev);
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(g->rank(), s - 1 - w->rank());
  // Group rank 0 (world rank s-1) broadcasts.
  auto t = at::full({2}, static_cast<double>(w->rank()));
  g->broadcast(t, 0).wait();
  expect_equal(t, at::full({2}, static_cast<double>(s - 1)), "broadcast from group rank 0");
}

TEST(Groups, SingleRankGroupsTakeTheFastPath) {
  auto w = test_world();
  const int s = w->size();
  fsdp::ProcessGroupPtr mine;
  for (int r = 0; r < s; ++r) {
    auto g = fsdp::new_group({r});
    if (r == w->rank()) mine = g;
    else EXPECT_EQ(g, nullptr);
  }
  ASSERT_NE(mine, nullptr);
  EXPECT_EQ(mine->size(), 1);
  EXPECT_EQ(mine->rank(), 0);
  auto in = contrib_tensor(w->rank(), 5, at::kFloat);
  auto out = at::empty({5});
  mine->all_gather_into_tensor(out, in).wait();
  expect_equal(out, in, "size-1 all_gather");
  auto rs = at::empty({5});
  mine->reduce_scatter_tensor(rs, in, ReduceOp::Avg).wait();
  expect_equal(rs, in, "size-1 reduce_scatter");
  auto ar = in.clone();
  mine->all_reduce(ar, ReduceOp::Avg).wait();
  expect_equal(ar, in, "size-1 all_reduce");
  mine->barrier().wait();
  EXPECT_EQ(fsdp::comm_stats(*mine).bytes_sent, 0);
  EXPECT_EQ(fsdp::comm_stats(*mine).all_gather_calls, 1);
  EXPECT_EQ(fsdp::comm_stats(*mine).reduce_scatter_calls, 1);
}

TEST(Groups, NewGroupValidatesRanks) {
  auto w = test_world();
  EXPECT_THROW(fsdp::new_group({}), c10::Error);
  EXPECT_THROW(fsdp::new_group({0, 0}), c10::Error);
  EXPECT_THROW(fsdp::new_group({w->size()}), c10::Error);
  EXPECT_THROW(fsdp::init_process_group(), c10::Error);  // already initialized
}
