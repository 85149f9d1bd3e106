#pragma once
// A fake world: process groups of any (rank, size) without peers, store or network, whose collectives do
// nothing but count (the calls and bytes of fsdp/comm_stats.h, as a real group would). What PyTorch's
// FakeProcessGroup (torch/csrc/distributed/c10d/FakeProcessGroup.hpp, torch.testing._internal.distributed.fake_pg)
// is for: building a rank's meshes and running fully_shard / parallelize_module / apply_expert_parallel on a
// model built on `meta`, to read what that rank would hold, without the other ranks. c10d's own class cannot be
// compiled into this library (its header pulls in Python.h), so src/comm has its own: a collective backend
// whose every collective completes at once and leaves its outputs as they are.
//
//   {
//     fsdp::FakeWorld world(/*rank=*/3, /*world_size=*/8);
//     fsdp::DeviceMesh mesh = fsdp::init_device_mesh("cpu", {2, 4}, {"dp_replicate", "dp_shard"});
//     ...  // fully_shard on meta modules, read their shards
//   }  // the world before (none, or the real one) is back
//
// While a FakeWorld lives, world(), new_group() and init_device_mesh() build fake groups (backend "fake"). It
// sets aside the world that was initialized before (if any) and gives it back, untouched, when it goes; nothing
// may use that real world meanwhile. One FakeWorld at a time; not for concurrent use with real collectives.

#include <fsdp/process_group.h>

#include <memory>

namespace fsdp {

class FakeWorld {
 public:
  FakeWorld(int rank, int world_size, c10::Device device = c10::kCPU);
  ~FakeWorld();
  FakeWorld(const FakeWorld&) = delete;
  FakeWorld& operator=(const FakeWorld&) = delete;

  const ProcessGroupPtr& group() const { return world_; }

  struct SetAside;  // the registry's state before (src/comm/init.cpp)

 private:
  ProcessGroupPtr world_;
  std::unique_ptr<SetAside> set_aside_;
};

}  // namespace fsdp
