// A collective that a peer never joins must fail from Work::wait() within the timeout, with a message naming
// the collective, the group and its ranks — and the processes must still exit cleanly afterwards.
// Run with 2 ranks: rank 1 skips one all_reduce on a dedicated group; rank 0 waits on it with a 2 s timeout.
// The stuck op lives on its own group so the world group stays healthy for the final barrier.

#include "comm/dist_env.h"
#include "comm/store_exchange.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <iostream>

using fsdp_test::test_world;

TEST(Timeout, SkippedCollectiveFailsWithContext) {
  auto w = test_world();
  if (w->size() < 2) GTEST_SKIP() << "needs at least 2 ranks";
  std::vector<int> all;
  for (int r = 0; r < w->size(); ++r) all.push_back(r);
  auto g = fsdp::new_group(all, "timeout-probe");
  ASSERT_NE(g, nullptr);
  g->set_timeout(std::chrono::seconds(2));
  // Sanity: the group works while everyone takes part.
  auto ok = at::ones({4});
  g->all_reduce(ok).wait();
  ASSERT_TRUE(at::equal(ok, at::full({4}, static_cast<float>(w->size()))));
  EXPECT_FALSE(fsdp::comm::first_failure(*g).has_value()) << "a healthy group reports a failure";

  if (w->rank() == 0) {
    auto t = at::ones({4});
    const auto start = std::chrono::steady_clock::now();
    auto work = g->all_reduce(t);
    std::string msg;
    try {
      work.wait();
    } catch (const c10::Error& e) {
      msg = e.what_without_backtrace();
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_FALSE(msg.empty()) << "all_reduce without the peer did not fail";
    std::cout << "expected timeout error: " << msg << "\n";
    EXPECT_NE(msg.find("all_reduce"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'timeout-probe'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("world ranks [0, 1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("2000 ms"), std::string::npos) << msg;
    EXPECT_GE(secs, 1.5);
    EXPECT_LT(secs, 20.0);
    // Waiting again reports the same failure instead of hanging.
    EXPECT_THROW(work.wait(), c10::Error);
    // The group remembers it (FSDP's recovery check then declares the group unusable without asking the store).
    ASSERT_TRUE(fsdp::comm::first_failure(*g).has_value());
    EXPECT_NE(fsdp::comm::first_failure(*g)->find("'timeout-probe'"), std::string::npos) << *fsdp::comm::first_failure(*g);
    EXPECT_FALSE(fsdp::comm::first_failure(*w).has_value()) << "the failure leaked to another group";
  }
  // Rank 1 skipped the collective; both meet on the healthy world group. Rank 1 waits here (world timeout)
  // while rank 0 runs into the 2 s timeout above.
  w->barrier().wait();
}

TEST(Timeout, SetTimeoutRejectsNonPositive) {
  auto w = test_world();
  EXPECT_THROW(w->set_timeout(std::chrono::milliseconds(0)), c10::Error);
}
