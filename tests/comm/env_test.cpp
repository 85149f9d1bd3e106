// Single process: init_process_group's handling of the environment and options, the byte model, and the
// 1-rank world (no communication at all).

#include "comm/byte_model.h"

#include <fsdp/device_mesh.h>
#include <fsdp/process_group.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>

namespace {

std::string init_error(const fsdp::InitOptions& o = {}) {
  try {
    fsdp::init_process_group(o);
  } catch (const c10::Error& e) {
    return e.what();
  }
  fsdp::destroy_process_group();
  return "";
}

void clear_env() {
  for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"}) unsetenv(v);
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST(InitEnv, MissingVariablesAreNamed) {
  clear_env();
  EXPECT_TRUE(contains(init_error(), "RANK")) << init_error();
  setenv("RANK", "0", 1);
  EXPECT_TRUE(contains(init_error(), "WORLD_SIZE")) << init_error();
  setenv("WORLD_SIZE", "2", 1);
  EXPECT_TRUE(contains(init_error(), "MASTER_ADDR")) << init_error();
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  EXPECT_TRUE(contains(init_error(), "MASTER_PORT")) << init_error();
  setenv("RANK", "zero", 1);
  EXPECT_TRUE(contains(init_error(), "RANK='zero' is not an integer")) << init_error();
  setenv("RANK", "2", 1);
  EXPECT_TRUE(contains(init_error(), "outside the world")) << init_error();
  clear_env();
  EXPECT_FALSE(fsdp::is_initialized());
}

TEST(InitEnv, LocalRankDefaultsToZero) {
  clear_env();
  EXPECT_EQ(fsdp::env_local_rank(), 0);
  setenv("LOCAL_RANK", "3", 1);
  EXPECT_EQ(fsdp::env_local_rank(), 3);
  clear_env();
}

TEST(InitEnv, BackendChoice) {
  clear_env();
#ifdef FSDP_TEST_WITH_NCCL
  const bool nccl_usable = at::hasCUDA();  // scripts/gpu-check.sh's build on a GPU machine
#else
  const bool nccl_usable = false;
#endif
  fsdp::InitOptions o;
  o.rank = 0;
  o.world_size = 1;
  o.backend = "nccl";
  if (!nccl_usable) {
    EXPECT_TRUE(contains(init_error(o), "nccl")) << init_error(o);
  } else {
    EXPECT_EQ(init_error(o), "");
  }
#ifndef FSDP_TEST_WITH_NCCL
  EXPECT_TRUE(contains(init_error(o), "unavailable")) << init_error(o);
#endif
  o.backend = "mpi";
  EXPECT_TRUE(contains(init_error(o), "unknown backend 'mpi'")) << init_error(o);
  o.backend = "auto";
  auto w = fsdp::init_process_group(o);
  EXPECT_EQ(w->backend(), nccl_usable ? "nccl" : "gloo");
  fsdp::destroy_process_group();
}

// InitOptions.device: the CPU stays Gloo's default; a bad or unavailable device is an error naming it.
TEST(InitEnv, DeviceChoice) {
  clear_env();
  fsdp::InitOptions o;
  o.rank = 0;
  o.world_size = 1;
  o.backend = "gloo";
  o.device = "tpu:0";
  EXPECT_TRUE(contains(init_error(o), "InitOptions.device 'tpu:0' is not a device")) << init_error(o);
  o.device = "cuda:0";
  if (!at::hasCUDA()) {
    EXPECT_TRUE(contains(init_error(o), "InitOptions.device 'cuda:0' (backend gloo): CUDA is not available"))
        << init_error(o);
  }
  o.device = "cpu";
  auto w = fsdp::init_process_group(o);
  EXPECT_EQ(w->device(), c10::Device(c10::kCPU));
  EXPECT_THROW(fsdp::init_device_mesh("cuda", {1}, {"shard"}), c10::Error);  // the world works on the CPU
  fsdp::destroy_process_group();
}

TEST(InitEnv, WorldQueriesBeforeInitFail) {
  clear_env();
  EXPECT_FALSE(fsdp::is_initialized());
  EXPECT_THROW(fsdp::world(), c10::Error);
  EXPECT_THROW(fsdp::new_group({0}), c10::Error);
}

TEST(InitEnv, OneRankWorldFromOptionsAndReinit) {
  clear_env();
  fsdp::InitOptions o;
  o.rank = 0;
  o.world_size = 1;
  o.backend = "gloo";
  auto w = fsdp::init_process_group(o);
  EXPECT_TRUE(fsdp::is_initialized());
  EXPECT_EQ(w->size(), 1);
  EXPECT_THROW(fsdp::init_process_group(o), c10::Error);
  auto t = at::arange(4).to(at::kFloat);
  w->all_reduce(t, fsdp::ReduceOp::Avg).wait();
  EXPECT_TRUE(at::equal(t, at::arange(4).to(at::kFloat)));
  auto mesh = fsdp::init_device_mesh("cpu", {1, 1}, {"replicate", "shard"});
  EXPECT_EQ(mesh.size(), 1);
  EXPECT_EQ(mesh.group("shard")->size(), 1);
  fsdp::destroy_process_group();
  EXPECT_FALSE(fsdp::is_initialized());
  // Groups handed out before destroy stay usable.
  w->all_reduce(t).wait();
  w = fsdp::init_process_group(o);
  EXPECT_TRUE(fsdp::is_initialized());
  fsdp::destroy_process_group();
}

TEST(ByteModel, RingFormulas) {
  using namespace fsdp::comm;
  for (int64_t s : {2, 3, 4, 8}) {
    const int64_t chunk = 1000 * 4;  // bytes per rank-chunk
    EXPECT_EQ(reduce_scatter_bytes(s * chunk, s), (s - 1) * chunk);
    EXPECT_EQ(all_gather_bytes(chunk, s), (s - 1) * chunk);
    EXPECT_EQ(all_reduce_bytes(s * chunk, s), 2 * (s - 1) * chunk);
    // FSDP identity: reduce-scatter + all-gather of the shard == one all-reduce of the full tensor.
    EXPECT_EQ(reduce_scatter_bytes(s * chunk, s) + all_gather_bytes(chunk, s), all_reduce_bytes(s * chunk, s));
    EXPECT_EQ(all_to_all_bytes(s * chunk, s), (s - 1) * chunk);
    EXPECT_EQ(broadcast_bytes(chunk, s, true), (s - 1) * chunk);
    EXPECT_EQ(broadcast_bytes(chunk, s, false), 0);
  }
}
