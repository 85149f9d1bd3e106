// fsdp::ft::Manager in one process (docs/reliability.md, "Replica-group fault tolerance"): bad input and calls out of
// order are clear errors; one replica forms a quorum of its own and keeps its group while the membership holds; two
// replicas (two Managers on two threads, as two replica groups would be) agree on the membership, the step to train
// and who heals from whom, average exactly, heal with a checked transfer, and a "not ok" vote discards the step for
// both. The coordinator is a c10d TCPStore served in this process (what fsdp-lighthouse serves).

#include <fsdp/fault_tolerance.h>
#include <fsdp/process_group.h>

#include "expect_error.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <future>
#include <memory>
#include <string>

namespace {

using fsdp::ft::Manager;
using fsdp::ft::ManagerOptions;

// A fresh coordinator per test (its own port), so the rounds of one test never meet another's.
struct Lighthouse {
  std::unique_ptr<c10d::TCPStore> store;
  std::string address;
  Lighthouse() {
    c10d::TCPStoreOptions so;
    so.port = 0;
    so.isServer = true;
    so.waitWorkers = false;
    store = std::make_unique<c10d::TCPStore>("127.0.0.1", so);
    address = "127.0.0.1:" + std::to_string(store->getPort());
  }
};

fsdp::ProcessGroupPtr world() {
  if (!fsdp::is_initialized()) {
    fsdp::InitOptions init;
    init.rank = 0;
    init.world_size = 1;
    init.backend = "gloo";
    fsdp::init_process_group(init);
  }
  return fsdp::world();
}

ManagerOptions options(const Lighthouse& l, int replica_id, int expected) {
  ManagerOptions o;
  o.replica_id = replica_id;
  o.lighthouse = l.address;
  o.expected_replicas = expected;
  o.join_timeout = std::chrono::milliseconds(500);
  o.quorum_timeout = std::chrono::seconds(20);
  o.timeout = std::chrono::seconds(2);
  return o;
}

TEST(FtManager, BadOptionsAreClearErrors) {
  Lighthouse l;
  auto o = options(l, 0, 1);
  o.replica_id = -1;
  fsdp_test::expect_error_containing<c10::Error>([&] { Manager m(o, world()); }, "replica_id must be >= 0");
  o = options(l, 0, 1);
  o.min_replicas = 0;
  fsdp_test::expect_error_containing<c10::Error>([&] { Manager m(o, world()); }, "min_replicas must be >= 1");
  o = options(l, 0, 1);
  fsdp_test::expect_error_containing<c10::Error>([&] { Manager m(o, nullptr); }, "replica_group is null");
  o.lighthouse = "no-port-here";
  fsdp_test::expect_error_containing<c10::Error>([&] { Manager m(o, world()); }, "'no-port-here' is not host:port");
  o.lighthouse = "";
  ::unsetenv("FSDP_LIGHTHOUSE");
  fsdp_test::expect_error_containing<c10::Error>([&] { Manager m(o, world()); }, "FSDP_LIGHTHOUSE");
  // Nothing listens on port 1: the error names the address.
  o.lighthouse = "127.0.0.1:1";
  o.timeout = std::chrono::milliseconds(300);
  fsdp_test::expect_error_containing<c10::Error>([&] { Manager m(o, world()); },
                                                 "cannot reach the coordinator (fsdp-lighthouse) at 127.0.0.1:1");
}

TEST(FtManager, OneReplicaFormsItsOwnQuorumAndKeepsItsGroup) {
  Lighthouse l;
  Manager m(options(l, 7, 1), world());
  at::Tensor t = at::ones({3});
  fsdp_test::expect_error_containing<c10::Error>([&] { m.allreduce_average(t); }, "no step in progress");
  const auto& q = m.start_quorum(0);
  EXPECT_EQ(q.replica_ids, std::vector<int>{7});
  EXPECT_EQ(q.replica_index, 0);
  EXPECT_FALSE(q.heal);
  EXPECT_TRUE(q.group_rebuilt);
  ASSERT_NE(m.quorum_group(), nullptr);
  fsdp_test::expect_error_containing<c10::Error>([&] { m.start_quorum(0); }, "call should_commit first");
  std::vector<at::Tensor> none;
  fsdp_test::expect_error_containing<c10::Error>([&] { m.receive_state(none); }, "is not behind");
  m.allreduce_average(t);
  EXPECT_TRUE(at::equal(t, at::ones({3})));  // one participant: the average is the tensor
  EXPECT_TRUE(m.should_commit(true));
  const int64_t first_id = m.quorum().id;
  // Same membership, committed: the group is kept.
  EXPECT_FALSE(m.start_quorum(1).group_rebuilt);
  EXPECT_GT(m.quorum().id, first_id);
  // A "not ok" vote discards the step, says why, and the next round makes its group anew.
  EXPECT_FALSE(m.should_commit(false));
  EXPECT_NE(m.error().find("voted not ok"), std::string::npos) << m.error();
  EXPECT_TRUE(m.start_quorum(1).group_rebuilt);
  EXPECT_TRUE(m.error().empty());
  EXPECT_TRUE(m.should_commit(true));
}

TEST(FtManager, TwoReplicasAgreeAverageHealAndVote) {
  Lighthouse l;
  // Replica 0 is at step 3, replica 1 at step 0 (a restarted replica): both train step 3, replica 1 heals from 0.
  auto replica = [&](int id, int64_t step) {
    Manager m(options(l, id, 2), world());
    const fsdp::ft::Quorum q = m.start_quorum(step);
    // Healing: 2 tensors and a data position from replica 0 to replica 1.
    at::Tensor a = at::full({2, 3}, id == 0 ? 1.5f : 0.f), b = at::full({4}, id == 0 ? int64_t{42} : int64_t{0});
    std::vector<at::Tensor> state = {a, b};
    int64_t healed_step = -1;
    std::string position;
    if (q.heal) {
      auto h = m.receive_state(state);
      if (h) {
        healed_step = h->step;
        position = h->data_position;
      }
    } else {
      m.send_state(state, step, "batch 17");
    }
    // The average over the participants: (10 + 20) / 2 on replica 0's and 1's values.
    at::Tensor g = at::full({5}, id == 0 ? 10.f : 20.f);
    m.allreduce_average(g);
    const bool committed = m.should_commit(true);
    // A second step where replica 1 votes "not ok": discarded for both.
    m.start_quorum(q.max_step + 1);
    const bool second = m.should_commit(id == 0);
    return std::make_tuple(q, healed_step, position, state, g, committed, second, m.error());
  };
  auto f0 = std::async(std::launch::async, replica, 0, 3);
  auto f1 = std::async(std::launch::async, replica, 1, 0);
  auto [q0, h0, p0, s0, g0, c0, second0, e0] = f0.get();
  auto [q1, h1, p1, s1, g1, c1, second1, e1] = f1.get();
  EXPECT_EQ(q0.id, q1.id);
  EXPECT_EQ(q0.replica_ids, (std::vector<int>{0, 1}));
  EXPECT_EQ(q1.replica_ids, (std::vector<int>{0, 1}));
  EXPECT_EQ(q0.max_step, 3);
  EXPECT_EQ(q1.max_step, 3);
  EXPECT_FALSE(q0.heal);
  EXPECT_EQ(q0.heal_targets, std::vector<int>{1});
  EXPECT_TRUE(q1.heal);
  EXPECT_EQ(q1.heal_source, 0);
  EXPECT_EQ(h1, 3);
  EXPECT_EQ(p1, "batch 17");
  EXPECT_TRUE(at::equal(s1[0], at::full({2, 3}, 1.5f)));
  EXPECT_TRUE(at::equal(s1[1], at::full({4}, int64_t{42})));
  EXPECT_TRUE(at::equal(g0, at::full({5}, 15.f)));
  EXPECT_TRUE(at::equal(g1, at::full({5}, 15.f)));
  EXPECT_TRUE(c0);
  EXPECT_TRUE(c1);
  EXPECT_FALSE(second0);  // replica 0 voted ok, but replica 1 did not: nobody applies the step
  EXPECT_FALSE(second1);
  EXPECT_NE(e0.find("member 1 rank 0 voted not ok"), std::string::npos) << e0;
}

TEST(FtManager, HealingStateMismatchIsAClearError) {
  Lighthouse l;
  auto replica = [&](int id, int64_t step) -> std::string {
    Manager m(options(l, id, 2), world());
    const auto& q = m.start_quorum(step);
    std::vector<at::Tensor> state = {at::zeros({4})};
    if (id == 0) state.push_back(at::zeros({2}));  // the source has one tensor more than the healer expects
    std::string error;
    try {
      if (q.heal) {
        m.receive_state(state);
      } else {
        m.send_state(state, step, "");
      }
    } catch (const c10::Error& e) {
      error = e.what();
    }
    m.should_commit(error.empty());
    return error;
  };
  auto f0 = std::async(std::launch::async, replica, 0, 2);
  auto f1 = std::async(std::launch::async, replica, 1, 0);
  f0.get();
  const std::string e1 = f1.get();
  EXPECT_NE(e1.find("sends 2 tensors, this replica expects 1"), std::string::npos) << e1;
}

}  // namespace
