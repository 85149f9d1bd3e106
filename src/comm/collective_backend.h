#pragma once
// How a process group moves bytes: one object per group, chosen once when the group is created
// (make_collective_backend), so no collective asks "NCCL? native? one rank?" on every call.
//
//   size 1                      LocalCollectives: copies or nothing, no communicator
//   Gloo, CPU tensors (default) GlooExchangeCollectives: all-gather and reduce-scatter as our direct
//                               point-to-point exchanges (docs/comm.md); the rest c10d Gloo's own collectives
//   NCCL; Gloo on CUDA tensors; C10dCollectives: c10d's own collective for each call (for Gloo on the CPU this is
//   Gloo CPU with                 the way to test the dispatch NCCL uses; its reduce-scatter cannot Max/Min, and
//   FSDP_NATIVE_COLLECTIVES=1     those calls keep the exchange)
//
// ProcessGroup's public methods do what every way shares — argument checks, counting, the empty-tensor no-op —
// then hand non-empty, checked tensors to the group's backend, which launches the transfers, numbers the
// collective (comm::stamp) and records it on the timeline (comm::trace).
//
// Private to src/comm.

#include <fsdp/process_group.h>

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::comm {

class CollectiveBackend {
 public:
  virtual ~CollectiveBackend() = default;
  // Same contracts as ProcessGroup's methods of the same names. Every rank of `g` calls them in the same order
  // with the same sizes; tensors are already checked, contiguous and not empty.
  virtual Work all_gather_into_tensor(ProcessGroup::Impl& g, at::Tensor output, at::Tensor input) = 0;
  virtual Work reduce_scatter_tensor(ProcessGroup::Impl& g, at::Tensor output, at::Tensor input, ReduceOp op) = 0;
  virtual Work all_reduce(ProcessGroup::Impl& g, at::Tensor tensor, ReduceOp op) = 0;
  virtual Work broadcast(ProcessGroup::Impl& g, at::Tensor tensor, int root) = 0;
  virtual Work all_to_all(ProcessGroup::Impl& g, at::Tensor output, at::Tensor input) = 0;
  // Uneven splits along dim 0 (rows), as c10d's alltoall_base: input rows [sum(in[:j]), +in[j]) go to rank j,
  // rank j's rows land at output rows [sum(out[:j]), +out[j]).
  virtual Work all_to_all_uneven(ProcessGroup::Impl& g, at::Tensor output, at::Tensor input,
                                 std::vector<int64_t> output_splits, std::vector<int64_t> input_splits) = 0;
  virtual Work barrier(ProcessGroup::Impl& g) = 0;
  // Point-to-point: only the two ranks take part; `tag` is already in the point-to-point tag range (it never
  // meets the tags of the exchanges, which every rank numbers alike).
  virtual Work send(ProcessGroup::Impl& g, at::Tensor tensor, int peer, int tag) = 0;
  virtual Work recv(ProcessGroup::Impl& g, at::Tensor tensor, int peer, int tag) = 0;
  // The communicator's own timeout for later calls (each call also passes the group's timeout explicitly).
  virtual void set_timeout(std::chrono::milliseconds timeout) = 0;
};

// `communicator`: the group's c10d backend, null for a size-1 group. `kind`: "gloo" or "nccl". `device`: where the
// group's tensors live. `native_on_gloo_cpu`: FSDP_NATIVE_COLLECTIVES=1 (Gloo on the CPU runs c10d's own
// all-gather and reduce-scatter instead of the exchanges, to test NCCL's dispatch without a GPU).
std::unique_ptr<CollectiveBackend> make_collective_backend(c10::intrusive_ptr<c10d::Backend> communicator,
                                                           const std::string& kind, c10::Device device,
                                                           bool native_on_gloo_cpu);

}  // namespace fsdp::comm
