#pragma once
// Test helper shared by tests/comm and tests/tensor: one world per test process.
// Under fsdprun (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set) it joins the real multi-process world; started by
// hand without RANK it makes a 1-rank world so the executable still runs. Collectives get a 60 s timeout so a
// rank that diverges (e.g. after a failed assertion) turns into an error instead of a hang.

#include <fsdp/process_group.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <iostream>

namespace fsdp_test {

inline fsdp::ProcessGroupPtr test_world() {
  if (!fsdp::is_initialized()) {
    fsdp::InitOptions o;
    o.backend = "gloo";
    o.timeout = std::chrono::seconds(60);
    if (std::getenv("RANK") == nullptr) {
      o.rank = 0;
      o.world_size = 1;
    }
    fsdp::init_process_group(o);
  }
  return fsdp::world();
}

// Joins the world before the first test and leaves it after the last one (barrier first, so rank 0 — the
// TCPStore server — does not go away while others still talk to it).
class WorldEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { test_world(); }
  void TearDown() override {
    try {
      if (fsdp::is_initialized()) fsdp::world()->barrier().wait();
    } catch (const std::exception& e) {
      std::cerr << "final barrier failed: " << e.what() << "\n";
    }
    fsdp::destroy_process_group();
  }
};

// Include this header in exactly one .cpp of each test executable.
inline ::testing::Environment* const world_environment =
    ::testing::AddGlobalTestEnvironment(new WorldEnvironment);  // gtest takes ownership

}  // namespace fsdp_test
