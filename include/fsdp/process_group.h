#pragma once
// Process groups and collectives: a thin, typed layer over PyTorch's own c10d engine (Gloo on CPU, NCCL on
// CUDA). Every collective is asynchronous and returns a Work handle; nothing here blocks unless you wait().
//
// Why a layer at all: c10d's Gloo backend emulates reduce-scatter with a full all-reduce (twice the bytes)
// and has dropped the reduce op (AVG became SUM, PyTorch issue 162338). Ours is a direct exchange of chunks,
// reduced piece by piece as they arrive (docs/comm.md), which moves exactly the bytes of a ring reduce-scatter
// and honours every op. The layer also
// counts calls and bytes per collective (read them through fsdp/comm_stats.h, for tests and benchmarks) and
// turns timeouts into errors that name the collective and the group.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {

enum class ReduceOp { Sum, Avg, Max, Min };
const char* to_string(ReduceOp op);

// A pending collective. wait() blocks until the result is in the output tensors (running any local
// post-processing such as the reduce-scatter's local sum) and rethrows failures with context.
// Default-constructed Work is already complete. Copyable; waiting twice is a no-op.
class Work {
 public:
  struct Impl;
  Work() = default;
  explicit Work(std::shared_ptr<Impl> impl);
  void wait();
  bool is_completed() const;
  bool valid() const { return impl_ != nullptr; }

 private:
  std::shared_ptr<Impl> impl_;
};

namespace detail {
struct ProcessGroupAccess;  // internal: src/comm/process_group_impl.h
}

class ProcessGroup {
 public:
  struct Impl;
  explicit ProcessGroup(std::unique_ptr<Impl> impl);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const;                       // rank within this group
  int size() const;
  const std::string& name() const;        // e.g. "world", "mesh[shard]#0"
  const std::vector<int>& global_ranks() const;  // group rank -> world rank
  const std::string& backend() const;     // "gloo" or "nccl"
  c10::Device device() const;             // where this group's tensors live

  // output.numel() == size() * input.numel(); output is rank-major (rank r's input at [r*n, (r+1)*n)).
  // input may alias output's own slot (in-place all-gather).
  Work all_gather_into_tensor(at::Tensor output, at::Tensor input);
  // input.numel() == size() * output.numel(); rank r receives op over ranks of input[r*n, (r+1)*n).
  Work reduce_scatter_tensor(at::Tensor output, at::Tensor input, ReduceOp op = ReduceOp::Sum);
  Work all_reduce(at::Tensor tensor, ReduceOp op = ReduceOp::Sum);
  Work broadcast(at::Tensor tensor, int root);  // root is a group rank
  // Equal splits: input and output have size() * n elements; chunk r of input goes to rank r.
  Work all_to_all(at::Tensor output, at::Tensor input);
  Work barrier();

  // Point-to-point (pipeline parallelism). `peer` is a group rank other than this one; `tag` (0 <= tag < 2^28)
  // pairs a send with the receive of the same tag from the same peer, so the two sides may post in different
  // orders (Gloo matches by tag; NCCL ignores tags and pairs sends and receives in posting order, which the
  // pipeline schedules keep). The tensor must stay unchanged (send) or unread (recv) until the Work completes.
  Work send(at::Tensor tensor, int peer, int tag = 0);
  Work recv(at::Tensor tensor, int peer, int tag = 0);

  // Collective timeout for later calls.
  void set_timeout(std::chrono::milliseconds timeout);
  std::chrono::milliseconds timeout() const;

 private:
  // Counters, the timeline (fsdp/comm_stats.h) and the library's own out-of-band helpers reach the state here.
  friend struct detail::ProcessGroupAccess;
  std::unique_ptr<Impl> impl_;
};

using ProcessGroupPtr = std::shared_ptr<ProcessGroup>;

struct InitOptions {
  // "auto" = nccl when CUDA is available and libtorch has it, else gloo.
  std::string backend = "auto";
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // Empty = read torchrun's variables: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (LOCAL_RANK picks the device).
  int rank = -1;
  int world_size = -1;
  std::string master_addr;
  int master_port = -1;
  // The device every group's collectives work on. Empty = the backend's own: the CPU for Gloo, cuda:LOCAL_RANK
  // for NCCL. "cuda" / "cuda:N" with Gloo = Gloo on CUDA tensors (c10d Gloo's own CUDA collectives, which stage
  // through host memory): meshes are then "cuda" meshes, and several ranks may share one GPU ("cuda:0" on all)
  // — what a one-GPU machine can test. With NCCL, "cuda:N" overrides LOCAL_RANK.
  std::string device;
};

// Rendezvous through a c10d TCPStore (rank 0 serves) and register the world group. Throws with the missing
// variable's name when the environment is incomplete. Calling it twice is an error.
ProcessGroupPtr init_process_group(const InitOptions& options = {});
bool is_initialized();
ProcessGroupPtr world();  // the registered world group; error when not initialized
// A group over the given world ranks. Collective over the whole world (every rank must call it in the same
// order, also ranks not in `ranks`, which get nullptr), like torch.distributed.new_group.
ProcessGroupPtr new_group(const std::vector<int>& ranks, const std::string& name = "");
void destroy_process_group();

// torchrun's variables, parsed once: LOCAL_RANK (0 when absent) etc.
int env_rank();
int env_world_size();
int env_local_rank();

}  // namespace fsdp
