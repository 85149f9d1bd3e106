#pragma once
// fsdp::fully_shard — PyTorch FSDP2's per-parameter sharding for libtorch module trees.
//
//   fsdp::FullyShardOptions opts;
//   opts.mesh = fsdp::init_device_mesh("cpu", {world});
//   for (auto& block : *model->layers) fsdp::fully_shard(block, opts);   // bottom-up
//   fsdp::fully_shard(model, opts);                                       // then the root
//   auto loss = fsdp::nn::call(model, tokens) ...;                        // see the hook rule
//
// The hook rule: libtorch modules have no forward hooks, so a module given to fully_shard must be invoked as
// fsdp::nn::call(module, args...) (by its parent, or by the training loop for the root) instead of
// module->forward(args...). Forgetting it is detected: a gradient that reaches a sharded parameter raises
// an error naming the module, instead of silently producing wrong gradients. See docs/hooks.md.

#include <fsdp/device_mesh.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace fsdp {

class FSDPAllGather;       // fully_shard_extensions.h
class FSDPReduceScatter;   // fully_shard_extensions.h
class AllGatherTransform;  // fully_shard_extensions.h

// Python's MixedPrecisionPolicy. param_dtype: dtype of the unsharded (all-gathered) parameters used in
// forward/backward (floating-point parameters only); reduce_dtype: dtype of gradient reduction (unset =
// param_dtype, as in PyTorch); output_dtype: forward outputs are cast to it; cast_forward_inputs:
// floating-point forward inputs are cast to param_dtype.
// buffer_dtype (not in PyTorch's FSDP2, pytorch#146114; FSDP1's semantics): the floating-point buffers of the
// modules this fully_shard call manages are kept in this dtype (cast once, at fully_shard), so forward reads
// and updates them in it; state dicts report them in their original dtype.
struct MixedPrecisionPolicy {
  std::optional<c10::ScalarType> param_dtype;
  std::optional<c10::ScalarType> reduce_dtype;
  std::optional<c10::ScalarType> output_dtype;
  bool cast_forward_inputs = true;
  std::optional<c10::ScalarType> buffer_dtype;
};

// Python's OffloadPolicy / CPUOffloadPolicy: sharded parameters and gradients live on the CPU; the optimizer
// steps there; all-gather inputs are copied to the compute device, reduced gradients copied back.
struct OffloadPolicy {
  bool cpu_offload = false;
  bool pin_memory = true;
};

// true  = free the unsharded parameters after forward, all-gather again in backward (ZeRO-3);
// false = keep them until backward (ZeRO-2);
// N (int) = keep an N-way sharded copy after forward; backward all-gathers within N ranks (ZeRO++ hpZ).
//           N must divide the shard-group size; 1 == false, shard size == true.
using ReshardAfterForward = std::variant<bool, int>;

// What shard_placement_fn chooses for one parameter (PyTorch's Shard(dim), or its ShardPlacementResult with a
// mesh): the dim to shard on, and the mesh to shard over. An invalid mesh (default) = the call's mesh. A
// parameter on another mesh goes to a parameter group of its own — one per distinct mesh, all in the one
// FSDP state of the call — so e.g. a MoE block's experts shard over an expert mesh and its dense layers over
// the data-parallel mesh, with one all-gather and one reduce-scatter per mesh. The mesh must be 1-D or 2-D
// (HSDP: replicate, shard) on the call's device type. Converts implicitly from a dim, so a function returning
// std::optional<int64_t> still fits.
struct ShardPlacement {
  ShardPlacement() = default;
  ShardPlacement(int64_t shard_dim) : dim(shard_dim) {}  // NOLINT(google-explicit-constructor): Shard(dim)
  ShardPlacement(int64_t shard_dim, DeviceMesh shard_mesh) : dim(shard_dim), mesh(std::move(shard_mesh)) {}
  int64_t dim = 0;
  DeviceMesh mesh;
};

struct FullyShardOptions {
  DeviceMesh mesh;  // invalid (default) = 1-D mesh over the world; 2-D = HSDP (replicate, shard)
  std::optional<ReshardAfterForward> reshard_after_forward;  // nullopt = true for non-root, false for root
  MixedPrecisionPolicy mp_policy;
  OffloadPolicy offload_policy;
  // Not sharded, not moved, gradients not reduced (e.g. parameters managed by another scheme). Also kept
  // out of the groups of later fully_shard calls on ancestors.
  std::vector<at::Tensor> ignored_params;
  // Python's shard_placement_fn: the dim to shard each parameter on (Shard(dim)) and, optionally, the mesh
  // (ShardPlacement above); nullopt or no function = dim 0 on the call's mesh. Negative dims count from the
  // end. Uneven sizes are allowed on any dim (padded internally; PyTorch requires even sizes on dims other
  // than 0). State dicts report Shard(dim) on the parameter's mesh.
  std::function<std::optional<ShardPlacement>(const at::Tensor& param)> shard_placement_fn;
  // What a parameter sends in the all-gather instead of its shard, and how it is rebuilt (PyTorch's
  // fsdp_pre_all_gather / fsdp_post_all_gather): null or no function = its shard. Dim-0 sharded parameters only.
  // E.g. a frozen base as int8: [](const at::Tensor& p) { return p.requires_grad() ? nullptr :
  // std::make_shared<fsdp::Int8RowwiseAllGather>(); } (fully_shard_extensions.h).
  std::function<std::shared_ptr<const AllGatherTransform>(const at::Tensor& param)> all_gather_transform_fn;
};

namespace detail {
class FSDPState;          // internal: what fully_shard attaches to a module
struct FSDPModuleAccess;  // internal access to the state
}

// Waitable result of FSDPModule::unshard(async=true); the next forward also waits on it implicitly.
class UnshardHandle {
 public:
  UnshardHandle() = default;
  explicit UnshardHandle(std::weak_ptr<detail::FSDPState> state) : state_(std::move(state)) {}
  void wait();

 private:
  std::weak_ptr<detail::FSDPState> state_;
};

// A handle on a module's FSDP state (Python's FSDPModule methods). Cheap to copy. The state itself lives
// with the module (it is destroyed with it).
class FSDPModule {
 public:
  FSDPModule() = default;
  explicit FSDPModule(std::shared_ptr<detail::FSDPState> state) : state_(std::move(state)) {}

  torch::nn::Module& module() const;
  bool valid() const { return state_ != nullptr; }

  UnshardHandle unshard(bool async_op = false);
  void reshard();

  // false: backward accumulates the gradients on the unsharded parameters (in the reduce dtype) instead of
  // reducing them (no-sync micro-batches); the first backward with sync on, or post_backward(), reduces the sum.
  void set_requires_gradient_sync(bool requires_sync, bool recurse = true);
  // false: the end of the next backward does not complete its reductions nor forget the backward order, because
  // more micro-batches' backwards follow (PyTorch's set_is_last_backward; a flag of the whole FSDP tree). Set it
  // true again before the last one, or finish with post_backward().
  void set_is_last_backward(bool is_last_backward);
  // Reduces now what the backwards of this module's tree accumulated — one reduce-scatter (plus HSDP's
  // all-reduce) per group, whatever set_requires_gradient_sync says — reshards, and completes the reductions,
  // as the end of a last backward would. For schedules that choose where the reduction runs (pipeline
  // parallelism's REDUCE_GRAD after a stage's last micro-batch). Call it outside backward, with every state idle.
  void post_backward();
  void set_requires_all_reduce(bool requires_all_reduce, bool recurse = true);  // HSDP replicate-dim all-reduce
  void set_reshard_after_forward(ReshardAfterForward value, bool recurse = true);
  void set_reshard_after_backward(bool value, bool recurse = true);
  void set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules);
  void set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules);
  void set_gradient_divide_factor(double factor);
  // false: backward does not all-gather this module's parameters (nor prefetch them); their gradients are
  // still computed and reduced. Only for parameters that backward does not read (e.g. an embedding table):
  // backward sees them full-sized but without data. (No effect while they are still unsharded from forward,
  // i.e. reshard_after_forward=false.) Applies to this module's groups (one per mesh), not to its children.
  void set_unshard_in_backward(bool unshard_in_backward);
  // Called with this module's group's reduced gradients — the flat reduce-scatter output (FSDP) or, for HSDP,
  // the output of the replicate all-reduce — before they are divided (when the division is not part of the
  // collective: see set_force_sum_reduction_for_comms) and added to the sharded .grad. May modify the tensor
  // in place. Python's set_all_reduce_hook (torchft runs its own cross-replica all-reduce here). Empty
  // function = none. An error on a module whose parameters span several meshes (several groups), as in PyTorch.
  using AllReduceHook = std::function<void(at::Tensor& reduce_output)>;
  void set_all_reduce_hook(AllReduceHook hook);
  // A user object that allocates this module's group's all-gather output and runs the all-gather (or its
  // reduce-scatter), instead of the process group's own (PyTorch's set_custom_all_gather /
  // set_custom_reduce_scatter; fully_shard_extensions.h). Not recursive. nullptr = the built-in one again.
  void set_custom_all_gather(std::shared_ptr<FSDPAllGather> comm);
  void set_custom_reduce_scatter(std::shared_ptr<FSDPReduceScatter> comm);
  // true: gradient reductions use only Sum collectives, dividing locally afterwards (the all-reduce hook then
  // sees sums); false (default, as in PyTorch): fp32/bf16 reductions average inside the collective (Avg).
  // fp16 and other low-range reduce dtypes always sum, pre-divided by about sqrt(N) to avoid overflow.
  void set_force_sum_reduction_for_comms(bool enable, bool recurse = true);
  // The next root forward's all-gathers wait on this event (recorded after the optimizer step) instead of
  // all earlier work; used once, set it every step. A real wait on CUDA; on the CPU there is nothing
  // asynchronous to wait for (no-op).
  void set_post_optim_event(c10::Event event);

  // Returns every FSDP state in this module's tree to idle after an exception inside forward or backward:
  // waits for the collectives this rank issued, frees unsharded parameters, drops the gradients FSDP holds
  // internally (unreduced, no-sync accumulated, HSDP partial), keeps sharded .grad as they are (call the
  // optimizer's zero_grad() to skip the step). The next root forward does this by itself when it finds the
  // previous forward or backward abandoned; call it to release memory at once. The ranks then check through
  // the rendezvous store that every one of them abandoned the step at the same point; if not (only some ranks
  // raised, or in different modules), throws an error saying the process group is unusable and why, and every
  // later use of the model repeats it without issuing a collective: restart the job and resume.
  void reset();

 private:
  friend struct detail::FSDPModuleAccess;
  std::shared_ptr<detail::FSDPState> state_;
};

FSDPModule fully_shard(const std::shared_ptr<torch::nn::Module>& module, const FullyShardOptions& options = {});
// Several modules share one parameter group (pre-forward on the first, post-forward on the last).
FSDPModule fully_shard(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                       const FullyShardOptions& options = {});
template <class Impl>
FSDPModule fully_shard(const torch::nn::ModuleHolder<Impl>& module, const FullyShardOptions& options = {}) {
  return fully_shard(std::static_pointer_cast<torch::nn::Module>(module.ptr()), options);
}

// A module given to fully_shard whose parameters are also used by another sharded module (tied weights) must
// share one call: fully_shard({embedding, output}), or shard their common parent. A parameter that would
// land in two parameter groups is rejected at the second fully_shard call.

// The FSDP handle of a module that fully_shard was applied to, or nullopt.
std::optional<FSDPModule> fsdp_module(const torch::nn::Module& module);

}  // namespace fsdp
