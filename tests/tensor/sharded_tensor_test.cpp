// ShardedTensor against references built independently from ATen's own at::chunk and from formulas of the
// rank: each rank knows the full tensor and what every rank contributes.

#include "comm/dist_env.h"

#include <fsdp/sharded_tensor.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

using fsdp::Partial;
using fsdp::Placements;
using fsdp::ReduceOp;
using fsdp::Replicate;
using fsdp::Shard;
using fsdp_test::test_world;

namespace {

// Chunk i of k along d with torch.chunk semantics; missing trailing chunks are empty (DTensor's padding).
at::Tensor ref_chunk(const at::Tensor& t, int64_t d, int64_t k, int64_t i) {
  auto cs = t.chunk(k, d);
  if (i < static_cast<int64_t>(cs.size())) return cs[i];
  return t.narrow(d, t.size(d), 0);
}

at::Tensor full_of(std::vector<int64_t> shape, at::ScalarType dt = at::kFloat) {
  int64_t n = 1;
  for (auto s : shape) n *= s;
  // Small integers: exact in bf16.
  return at::arange(n, at::kDouble).remainder(61).sub_(30).reshape(shape).to(dt);
}

void expect_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  EXPECT_TRUE(at::equal(got, want)) << what << "\n got  " << got << "\n want " << want;
}

const std::vector<std::vector<int64_t>> kShapes = {{3, 5}, {1, 4}, {0, 4}, {7}, {10, 3}, {4, 6, 2}, {5, 1}};

}  // namespace

TEST(ShardMath, OffsetAndSizeMatchAtChunk) {
  for (int64_t n = 0; n <= 13; ++n) {
    for (int64_t k = 1; k <= 6; ++k) {
      auto t = at::arange(n);
      int64_t covered = 0;
      for (int64_t i = 0; i < k; ++i) {
        auto c = ref_chunk(t, 0, k, i);
        auto [off, len] = fsdp::shard_offset_and_size(n, k, i);
        EXPECT_EQ(len, c.size(0)) << "n=" << n << " k=" << k << " i=" << i;
        if (len > 0) EXPECT_EQ(off, c[0].item<int64_t>()) << "n=" << n << " k=" << k << " i=" << i;
        if (len == 0) EXPECT_EQ(off, std::min(n, off)) << "offset clamps to n";
        covered += len;
        EXPECT_EQ(fsdp::padded_shard_size(n, k), (n + k - 1) / k);
      }
      EXPECT_EQ(covered, n);
    }
  }
  EXPECT_EQ(fsdp::shard_offset_and_size(3, 4, 3), (std::pair<int64_t, int64_t>{3, 0}));
  EXPECT_EQ(fsdp::shard_offset_and_size(10, 4, 3), (std::pair<int64_t, int64_t>{9, 1}));
  EXPECT_THROW(fsdp::shard_offset_and_size(3, 4, 4), c10::Error);
  EXPECT_THROW(fsdp::shard_offset_and_size(3, 0, 0), c10::Error);
}

TEST(ShardMath, PlacementStrings) {
  EXPECT_EQ(Shard(1).to_string(), "Shard(1)");
  EXPECT_EQ(Replicate().to_string(), "Replicate()");
  EXPECT_EQ(Partial(ReduceOp::Max).to_string(), "Partial(Max)");
  EXPECT_EQ(fsdp::to_string(Placements{Replicate(), Shard(0)}), "(Replicate(), Shard(0))");
  EXPECT_TRUE(Shard(0) == Shard(0));
  EXPECT_FALSE(Shard(0) == Shard(1));
  EXPECT_FALSE(Partial(ReduceOp::Sum) == Partial(ReduceOp::Avg));
}

TEST(ShardedTensor1D, DistributeAndFullTensorRoundTrip) {
  auto w = test_world();
  const int s = w->size();
  auto mesh = fsdp::init_device_mesh("cpu", {s}, {"shard"});
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    for (const auto& shape : kShapes) {
      const auto full = full_of(shape, dt);
      for (int64_t d = 0; d < full.dim(); ++d) {
        const auto what = c10::str("shape ", full.sizes(), " Shard(", d, ") ", dt);
        auto st = fsdp::distribute_tensor(full, mesh, {Shard(d)});
        EXPECT_EQ(st.sizes(), shape) << what;
        EXPECT_EQ(st.dtype(), dt);
        expect_equal(st.local(), ref_chunk(full, d, s, w->rank()), what + " local");
        EXPECT_TRUE(st.local().is_contiguous());
        // Global offset of the local piece from the chunk sizes of the ranks before us.
        int64_t off = 0;
        for (int r = 0; r < w->rank(); ++r) off += ref_chunk(full, d, s, r).size(d);
        EXPECT_EQ(st.local_offset()[d], std::min(off, shape[d])) << what;
        expect_equal(st.full_tensor(), full, what + " full_tensor");
      }
    }
  }
}

TEST(ShardedTensor1D, ThreeRowsOverMoreRanksLeavesEmptyShards) {
  auto w = test_world();
  const int s = w->size();
  auto mesh = fsdp::init_device_mesh("cpu", {s});
  const auto full = full_of({3, 2});
  auto st = fsdp::distribute_tensor(full, mesh, {Shard(0)});
  const int64_t cs = (3 + s - 1) / s;
  const int64_t expect_rows = std::max<int64_t>(0, std::min<int64_t>(cs, 3 - w->rank() * cs));
  EXPECT_EQ(st.local().size(0), expect_rows);
  EXPECT_EQ(st.local().size(1), 2);
  expect_equal(st.full_tensor(), full, "3 rows");
}

TEST(ShardedTensor1D, FromLocalChecksAndInfersShapes) {
  auto w = test_world();
  const int s = w->size();
  auto mesh = fsdp::init_device_mesh("cpu", {s});
  auto local = at::full({2, 3}, static_cast<double>(w->rank()));
  auto st = fsdp::ShardedTensor::from_local(local, mesh, {Shard(0)});  // even: inferred
  EXPECT_EQ(st.sizes(), (std::vector<int64_t>{2 * s, 3}));
  EXPECT_EQ(st.strides(), (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(st.numel(), 6 * s);
  auto full = st.full_tensor();
  for (int r = 0; r < s; ++r) expect_equal(full.narrow(0, 2 * r, 2), at::full({2, 3}, static_cast<double>(r)), "row");
  // Uneven: 2s-1 rows; the last rank holds one row fewer.
  const int64_t rows = 2 * s - 1;
  auto piece = full_of({rows, 3}).chunk(s, 0);
  auto mine = w->rank() < static_cast<int>(piece.size()) ? piece[w->rank()] : at::empty({0, 3});
  auto ust = fsdp::ShardedTensor::from_local(mine.contiguous(), mesh, {Shard(0)}, {rows, 3});
  expect_equal(ust.full_tensor(), full_of({rows, 3}), "uneven from_local");
  // Wrong local shape for the declared global shape.
  try {
    fsdp::ShardedTensor::from_local(at::zeros({5, 3}), mesh, {Shard(0)}, {rows, 3});
    if (s > 1) ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("is not the chunk"), std::string::npos) << e.what();
  }
  EXPECT_THROW(fsdp::ShardedTensor::from_local(local, mesh, {Shard(0), Shard(1)}), c10::Error);
  EXPECT_THROW(fsdp::ShardedTensor::from_local(local, mesh, {Shard(2)}), c10::Error);
  auto neg = fsdp::ShardedTensor::from_local(local, mesh, {Shard(-1)});
  EXPECT_EQ(neg.placements()[0], Shard(1));
}

TEST(ShardedTensor1D, RedistributeShardReplicateShard) {
  auto w = test_world();
  const int s = w->size();
  auto mesh = fsdp::init_device_mesh("cpu", {s});
  const auto full = full_of({5, 7});
  auto st = fsdp::distribute_tensor(full, mesh, {Shard(0)});
  auto rep = st.redistribute({Replicate()});
  expect_equal(rep.local(), full, "Shard(0) -> Replicate");
  auto s1 = st.redistribute({Shard(1)});
  expect_equal(s1.local(), ref_chunk(full, 1, s, w->rank()).contiguous(), "Shard(0) -> Shard(1)");
  auto back = rep.redistribute({Shard(0)});
  expect_equal(back.local(), ref_chunk(full, 0, s, w->rank()).contiguous(), "Replicate -> Shard(0)");
  auto same = st.redistribute({Shard(0)});
  expect_equal(same.local(), st.local(), "no-op");
}

TEST(ShardedTensor1D, PartialReductions) {
  auto w = test_world();
  const int s = w->size();
  const int r = w->rank();
  auto mesh = fsdp::init_device_mesh("cpu", {s});
  const std::vector<int64_t> shape = {5, 3};
  const auto full = full_of(shape);
  // Rank r holds full * (r + 1): the Sum is full * s(s+1)/2, the Max full * s where full >= 0 ...
  auto contrib = full * (r + 1);
  auto sum = fsdp::ShardedTensor::from_local(contrib, mesh, {Partial(ReduceOp::Sum)}, shape);
  expect_equal(sum.full_tensor(), full * (s * (s + 1) / 2), "Partial(Sum) -> Replicate");
  auto avg = fsdp::ShardedTensor::from_local(contrib, mesh, {Partial(ReduceOp::Avg)}, shape);
  expect_equal(avg.full_tensor(), full * ((s + 1) / 2.0), "Partial(Avg) -> Replicate");
  // ... so use full + r for Max/Min.
  auto shifted = full + r;
  auto mx = fsdp::ShardedTensor::from_local(shifted, mesh, {Partial(ReduceOp::Max)}, shape);
  expect_equal(mx.full_tensor(), full + (s - 1), "Partial(Max) -> Replicate");
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    auto c = contrib.to(dt);
    auto rs = fsdp::ShardedTensor::from_local(c, mesh, {Partial(ReduceOp::Sum)}, shape).redistribute({Shard(0)});
    expect_equal(rs.local(), ref_chunk((full * (s * (s + 1) / 2)).to(dt), 0, s, r).contiguous(),
                 c10::str("Partial(Sum) -> Shard(0) (reduce-scatter, uneven) ", dt));
    auto rs1 = fsdp::ShardedTensor::from_local(c, mesh, {Partial(ReduceOp::Sum)}, shape).redistribute({Shard(1)});
    expect_equal(rs1.local(), ref_chunk((full * (s * (s + 1) / 2)).to(dt), 1, s, r).contiguous(),
                 c10::str("Partial(Sum) -> Shard(1) ", dt));
  }
  auto mn = fsdp::ShardedTensor::from_local(shifted, mesh, {Partial(ReduceOp::Min)}, shape).redistribute({Shard(0)});
  expect_equal(mn.local(), ref_chunk(full, 0, s, r).contiguous(), "Partial(Min) -> Shard(0)");
  // Replicate -> Partial -> Replicate is the identity for every op.
  for (auto op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
    auto p = fsdp::distribute_tensor(full, mesh, {Partial(op)});
    expect_equal(p.full_tensor(), full, c10::str("Replicate -> Partial(", fsdp::to_string(op), ") -> Replicate"));
  }
  EXPECT_THROW(sum.redistribute({Partial(ReduceOp::Max)}), c10::Error);
}

TEST(ShardedTensor2D, HsdpReplicateShard) {
  auto w = test_world();
  const int s = w->size();
  if (s % 2 != 0) GTEST_SKIP() << "needs an even world";
  const int64_t R = s / 2, S = 2;
  const int64_t a = w->rank() / S, b = w->rank() % S;
  auto mesh = fsdp::init_device_mesh("cpu", {R, S}, {"replicate", "shard"});
  for (const auto& shape : std::vector<std::vector<int64_t>>{{3, 4}, {1, 2}, {5, 3}, {8}}) {
    const auto full = full_of(shape);
    const auto what = c10::str("shape ", full.sizes());
    auto st = fsdp::distribute_tensor(full, mesh, {Replicate(), Shard(0)});
    expect_equal(st.local(), ref_chunk(full, 0, S, b), what + " (Replicate, Shard(0)) local");
    expect_equal(st.full_tensor(), full, what + " full_tensor");
    // Nested: Shard(0) twice = chunk of a chunk.
    auto nested = fsdp::distribute_tensor(full, mesh, {Shard(0), Shard(0)});
    auto want_nested = ref_chunk(ref_chunk(full, 0, R, a), 0, S, b);
    expect_equal(nested.local(), want_nested, what + " (Shard(0), Shard(0)) local");
    expect_equal(nested.full_tensor(), full, what + " nested full_tensor");
    auto to_hsdp = nested.redistribute({Replicate(), Shard(0)});
    expect_equal(to_hsdp.local(), ref_chunk(full, 0, S, b).contiguous(), what + " nested -> HSDP");
    auto from_hsdp = st.redistribute({Shard(0), Shard(0)});
    expect_equal(from_hsdp.local(), want_nested.contiguous(), what + " HSDP -> nested");
    if (full.dim() == 2) {
      auto cross = fsdp::distribute_tensor(full, mesh, {Shard(1), Shard(0)});
      expect_equal(cross.local(), ref_chunk(ref_chunk(full, 1, R, a), 0, S, b), what + " (Shard(1), Shard(0))");
      expect_equal(cross.full_tensor(), full, what + " (Shard(1), Shard(0)) full");
      auto swapped = cross.redistribute({Shard(0), Shard(1)});
      expect_equal(swapped.local(), ref_chunk(ref_chunk(full, 0, R, a), 1, S, b).contiguous(), what + " swap");
    }
  }
  // HSDP gradient reduction: Partial(Sum) over replicas, already sharded within the replica.
  const auto full = full_of({5, 3});
  auto grad_piece = ref_chunk(full, 0, S, b) * static_cast<double>(a + 1);
  auto g = fsdp::ShardedTensor::from_local(grad_piece.contiguous(), mesh, {Partial(ReduceOp::Sum), Shard(0)}, {5, 3});
  auto reduced = g.redistribute({Replicate(), Shard(0)});
  expect_equal(reduced.local(), (ref_chunk(full, 0, S, b) * static_cast<double>(R * (R + 1) / 2)).contiguous(),
               "(Partial, Shard(0)) -> (Replicate, Shard(0))");
  // Unsharded gradient, reduce-scatter within the replica and all-reduce across replicas in one call.
  auto unsharded = fsdp::ShardedTensor::from_local(full * static_cast<double>(w->rank() + 1), mesh,
                                                   {Partial(ReduceOp::Sum), Partial(ReduceOp::Sum)}, {5, 3});
  auto hsdp = unsharded.redistribute({Replicate(), Shard(0)});
  expect_equal(hsdp.local(), ref_chunk(full * static_cast<double>(s * (s + 1) / 2), 0, S, b).contiguous(),
               "(Partial, Partial) -> (Replicate, Shard(0))");
}
