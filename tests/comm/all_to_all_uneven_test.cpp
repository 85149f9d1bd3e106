// all_to_all_single with uneven splits (expert parallelism's token exchange), on 1 to 4 ranks. Rank r sends
// rank j (r + 2j) % 3 rows (zero-row splits included; a rank may receive nothing from anyone at 2 ranks' some
// steps), each row holding (r, j, row index); the test writes out what every rank must receive from the same
// rule and checks every value, the byte count, and the argument checks.
#include "comm/dist_env.h"
#include "expect_error.h"

#include <fsdp/all_to_all.h>
#include <fsdp/comm_stats.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <numeric>

namespace {

int64_t rows(int64_t from, int64_t to) { return (from + 2 * to) % 3; }

TEST(AllToAllUneven, EveryRowArrivesWhereTheSplitsSay) {
  auto world = fsdp_test::test_world();
  const int64_t n = world->size(), r = world->rank();
  std::vector<int64_t> in_splits, out_splits;
  std::vector<torch::Tensor> pieces;
  for (int64_t j = 0; j < n; ++j) {
    in_splits.push_back(rows(r, j));
    out_splits.push_back(rows(j, r));
    for (int64_t i = 0; i < rows(r, j); ++i) {
      pieces.push_back(torch::tensor({static_cast<float>(r), static_cast<float>(j), static_cast<float>(i)}).view({1, 3}));
    }
  }
  const int64_t in_rows = std::accumulate(in_splits.begin(), in_splits.end(), int64_t{0});
  const int64_t out_rows = std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0});
  auto input = pieces.empty() ? torch::zeros({0, 3}) : torch::cat(pieces, 0);
  auto output = torch::full({out_rows, 3}, -1.0f);
  fsdp::reset_comm_stats(*world);
  fsdp::all_to_all_single(*world, output, input, out_splits, in_splits).wait();
  EXPECT_EQ(fsdp::comm_stats(*world).all_to_all_calls, 1);
  EXPECT_EQ(fsdp::comm_stats(*world).bytes_sent, (in_rows - rows(r, r)) * 3 * 4);
  int64_t at = 0;
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = 0; i < rows(j, r); ++i, ++at) {
      EXPECT_EQ(output[at][0].item<float>(), static_cast<float>(j)) << "row " << at;
      EXPECT_EQ(output[at][1].item<float>(), static_cast<float>(r)) << "row " << at;
      EXPECT_EQ(output[at][2].item<float>(), static_cast<float>(i)) << "row " << at;
    }
  }
  EXPECT_EQ(at, out_rows);
}

TEST(AllToAllUneven, BadSplitsAreRefusedBeforeAnyTransfer) {
  auto world = fsdp_test::test_world();
  const int64_t n = world->size();
  auto t = torch::zeros({n, 2});
  std::vector<int64_t> ones(static_cast<size_t>(n), 1);
  const auto expect_error = fsdp_test::expect_error_containing<c10::Error>;
  std::vector<int64_t> short_splits(static_cast<size_t>(n + 1), 0);
  expect_error([&] { fsdp::all_to_all_single(*world, t, t, ones, short_splits); }, "entries for");
  std::vector<int64_t> too_many = ones;
  too_many[0] += 1;
  expect_error([&] { fsdp::all_to_all_single(*world, t, t, ones, too_many); }, "sum to");
  auto other = torch::zeros({n, 3});
  expect_error([&] { fsdp::all_to_all_single(*world, other, t, ones, ones); }, "rows of shape");
}

}  // namespace
