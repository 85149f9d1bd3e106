#pragma once
// What the multi-rank trainer tests share: the TrainEnv of this rank of the fsdprun world, and one scratch
// folder per job that every rank names the same.
#include "trainer.h"

#include <fsdp/process_group.h>

#include "comm/dist_env.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

namespace fsdp_train::test {

// This rank of the world group runs the job (every rank of the test calls run_training with its own).
inline TrainEnv world_env(bool verbose = false, int64_t stop_after_step = -1) {
  auto world = fsdp::world();
  TrainEnv env;
  env.rank = world->rank();
  env.world_size = world->size();
  env.group = world;
  env.verbose = verbose && world->rank() == 0;
  env.stop_after_step = stop_after_step;
  return env;
}

// The same folder on every rank (fsdprun, every rank's parent, makes it unique per launch); rank 0 clears it and
// every rank waits for that. Collective.
inline std::string shared_dir(const std::string& prefix, const std::string& name) {
  const std::string d = ::testing::TempDir() + "/" + prefix + "_" + name + "_" + std::to_string(::getppid());
  if (fsdp::world()->rank() == 0) std::filesystem::remove_all(d);
  fsdp::world()->barrier().wait();
  return d;
}

}  // namespace fsdp_train::test
