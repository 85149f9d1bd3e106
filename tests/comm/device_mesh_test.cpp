// DeviceMesh: layout, coordinates, per-dim groups checked against the row-major formula, all_reduce over each
// dim against the analytic sum, sub-meshes sharing the parent's groups, and error messages.

#include "comm/dist_env.h"

#include <fsdp/device_mesh.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

using fsdp_test::test_world;

namespace {

std::string mesh_error(std::vector<int64_t> shape, std::vector<std::string> names, const std::string& type = "cpu") {
  try {
    fsdp::init_device_mesh(type, std::move(shape), std::move(names));
  } catch (const c10::Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST(DeviceMesh, OneDimOverTheWorld) {
  auto w = test_world();
  auto mesh = fsdp::init_device_mesh("cpu", {w->size()}, {"shard"});
  EXPECT_EQ(mesh.ndim(), 1);
  EXPECT_EQ(mesh.size(), w->size());
  EXPECT_EQ(mesh.device_type(), c10::kCPU);
  EXPECT_EQ(mesh.coordinate(), std::vector<int64_t>{w->rank()});
  auto g = mesh.group("shard");
  EXPECT_EQ(g->size(), w->size());
  EXPECT_EQ(g->rank(), w->rank());
  EXPECT_EQ(g->name(), "mesh[shard]#0");
  auto t = at::full({2}, static_cast<double>(w->rank() + 1));
  g->all_reduce(t).wait();
  const double s = w->size();
  EXPECT_TRUE(at::equal(t, at::full({2}, s * (s + 1) / 2)));
  // Default dim names.
  auto unnamed = fsdp::init_device_mesh("cpu", {w->size()});
  EXPECT_EQ(unnamed.dim_names(), std::vector<std::string>{"dim0"});
}

TEST(DeviceMesh, TwoDimGroupsAndAllReducePerDim) {
  auto w = test_world();
  const int s = w->size();
  if (s % 2 != 0) GTEST_SKIP() << "needs an even world";
  const int64_t R = s / 2, S = 2;  // (replicate, shard)
  auto mesh = fsdp::init_device_mesh("cpu", {R, S}, {"replicate", "shard"});
  const int r = w->rank();
  const int64_t a = r / S, b = r % S;  // row-major coordinate
  EXPECT_EQ(mesh.coordinate(), (std::vector<int64_t>{a, b}));
  EXPECT_EQ(mesh.local_rank(0), a);
  EXPECT_EQ(mesh.local_rank(1), b);
  EXPECT_EQ(mesh.dim_index("shard"), 1);
  std::vector<int> shard_ranks, repl_ranks;
  for (int64_t j = 0; j < S; ++j) shard_ranks.push_back(static_cast<int>(a * S + j));
  for (int64_t i = 0; i < R; ++i) repl_ranks.push_back(static_cast<int>(i * S + b));
  auto gs = mesh.group("shard");
  auto gr = mesh.group("replicate");
  EXPECT_EQ(gs->global_ranks(), shard_ranks);
  EXPECT_EQ(gr->global_ranks(), repl_ranks);
  EXPECT_EQ(gs->rank(), b);
  EXPECT_EQ(gr->rank(), a);
  EXPECT_EQ(gs->name(), c10::str("mesh[shard]#", a));
  EXPECT_EQ(gr->name(), c10::str("mesh[replicate]#", b));

  auto ts = at::full({3}, static_cast<double>(r + 1));
  gs->all_reduce(ts).wait();
  double want_s = 0;
  for (int q : shard_ranks) want_s += q + 1;
  EXPECT_TRUE(at::equal(ts, at::full({3}, want_s))) << ts;
  auto tr = at::full({3}, static_cast<double>(r + 1));
  gr->all_reduce(tr).wait();
  double want_r = 0;
  for (int q : repl_ranks) want_r += q + 1;
  EXPECT_TRUE(at::equal(tr, at::full({3}, want_r))) << tr;

  // Sub-meshes share the parent's communicators.
  auto sub = mesh["shard"];
  EXPECT_EQ(sub.ndim(), 1);
  EXPECT_EQ(sub.shape(), std::vector<int64_t>{S});
  EXPECT_EQ(sub.ranks(), shard_ranks);
  EXPECT_EQ(sub.coordinate(), std::vector<int64_t>{b});
  EXPECT_EQ(sub.group(0).get(), gs.get());
  auto subr = mesh["replicate"];
  EXPECT_EQ(subr.ranks(), repl_ranks);
  EXPECT_EQ(subr.group(0).get(), gr.get());
  // Transposed view over both dims: element (i, j) is parent (replicate=j, shard=i).
  auto tr2 = mesh.slice({"shard", "replicate"});
  EXPECT_EQ(tr2.shape(), (std::vector<int64_t>{S, R}));
  EXPECT_EQ(tr2.coordinate(), (std::vector<int64_t>{b, a}));
  std::vector<int> want_ranks;
  for (int64_t i = 0; i < S; ++i)
    for (int64_t j = 0; j < R; ++j) want_ranks.push_back(static_cast<int>(j * S + i));
  EXPECT_EQ(tr2.ranks(), want_ranks);
  EXPECT_EQ(tr2.group("shard").get(), gs.get());
  EXPECT_TRUE(contains(mesh.to_string(), "replicate")) << mesh.to_string();
}

TEST(DeviceMesh, CustomRankLayout) {
  auto w = test_world();
  const int s = w->size();
  std::vector<int> rev;
  for (int q = s - 1; q >= 0; --q) rev.push_back(q);
  fsdp::DeviceMesh mesh(c10::kCPU, {s}, {"x"}, rev);
  EXPECT_EQ(mesh.coordinate(), std::vector<int64_t>{s - 1 - w->rank()});
  EXPECT_EQ(mesh.group("x")->rank(), s - 1 - w->rank());
  EXPECT_EQ(mesh.ranks(), rev);
}

TEST(DeviceMesh, SizeOneDims) {
  auto w = test_world();
  const int s = w->size();
  auto mesh = fsdp::init_device_mesh("cpu", {1, s, 1}, {"a", "b", "c"});
  EXPECT_EQ(mesh.group("a")->size(), 1);
  EXPECT_EQ(mesh.group("c")->size(), 1);
  EXPECT_EQ(mesh.group("b")->size(), s);
  EXPECT_EQ(mesh.coordinate(), (std::vector<int64_t>{0, w->rank(), 0}));
}

TEST(DeviceMesh, BadShapesGiveClearErrors) {
  auto w = test_world();
  const int64_t s = w->size();
  auto e = mesh_error({s + 1}, {"x"});
  EXPECT_TRUE(contains(e, c10::str("holds ", s + 1, " ranks but the world has ", s))) << e;
  e = mesh_error({s, 1}, {"x", "x"});
  EXPECT_TRUE(contains(e, "'x' appears twice")) << e;
  e = mesh_error({s, 0}, {"x", "y"});
  EXPECT_TRUE(contains(e, "dim 1 has size 0")) << e;
  e = mesh_error({s, -1}, {"x", "y"});
  EXPECT_TRUE(contains(e, "sizes must be positive")) << e;
  e = mesh_error({s, 1}, {"x"});
  EXPECT_TRUE(contains(e, "has 2 dims but 1 names")) << e;
  e = mesh_error({}, {});
  EXPECT_TRUE(contains(e, "at least one dim")) << e;
  e = mesh_error({s}, {"x"}, "bogus");
  EXPECT_TRUE(contains(e, "unknown device type 'bogus'")) << e;
  EXPECT_THROW(fsdp::DeviceMesh(c10::kCPU, {s}, {"x"}, std::vector<int>(s, s)), c10::Error);  // not a permutation
  auto mesh = fsdp::init_device_mesh("cpu", {s}, {"shard"});
  try {
    mesh.dim_index("replicate");
    FAIL();
  } catch (const c10::Error& err) {
    EXPECT_TRUE(contains(err.what(), "no dim named 'replicate'; its dims are [shard]")) << err.what();
  }
  EXPECT_THROW(mesh.slice({"shard", "shard"}), c10::Error);
  fsdp::DeviceMesh empty;
  EXPECT_FALSE(empty.valid());
  EXPECT_THROW(empty.ndim(), c10::Error);
}
