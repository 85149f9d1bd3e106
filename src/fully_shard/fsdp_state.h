#pragma once
// FSDPState: what fully_shard attaches to a module (Python's FSDPState): the forward hooks that unshard and
// reshard its parameter group, the autograd hooks that run pre-/post-backward, and — for the root, the
// first state to run forward — the context shared by every state under it (forward order for prefetching,
// the end-of-backward callback).

#include "fully_shard/fsdp_param_group.h"

#include <fsdp/fully_shard.h>
#include <fsdp/nn/module_call.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

namespace detail {
enum class TrainingState { Idle, Forward, PreBackward, PostBackward };

// Shared by the root and every state below it; created at the root's lazy init.
struct RootContext {
  std::vector<std::weak_ptr<FSDPState>> states;  // every state in the root's tree, root first (module order)
  std::vector<FSDPState*> post_forward_order;    // this forward's states in post-forward order
  std::vector<FSDPState*> last_post_forward_order;  // the previous forward's, for implicit forward prefetch
  bool final_callback_queued = false;
  FSDPParamGroup* group_with_pending_reduce = nullptr;
};
}  // namespace detail

class FSDPState : public std::enable_shared_from_this<FSDPState> {
 public:
  FSDPState(std::vector<std::weak_ptr<torch::nn::Module>> modules, std::unique_ptr<detail::FSDPParamGroup> group,
            FullyShardOptions options);

  // Installs the forward hooks and the sharded-gradient guard; called once by fully_shard.
  void attach();

  torch::nn::Module& module() const;  // the first module
  detail::FSDPParamGroup* param_group() const { return param_group_.get(); }
  bool is_root() const { return is_root_.value_or(false); }
  const std::string& name() const { return name_; }
  const FullyShardOptions& options() const { return options_; }

  // Hooks (public for the autograd node and the final callback).
  void pre_forward(torch::nn::Module& module, nn::TensorList& inputs);
  void post_forward(torch::nn::Module& module, const nn::TensorList& inputs, nn::TensorList& outputs);
  void pre_backward();
  void post_backward();

  // FSDPModule API.
  void unshard(bool async_op);
  void wait_for_unshard();
  void reshard();
  std::vector<std::shared_ptr<FSDPState>> subtree_states();  // this state and every state below it
  std::vector<std::weak_ptr<FSDPState>> forward_prefetch;   // explicit; empty = implicit
  std::vector<std::weak_ptr<FSDPState>> backward_prefetch;
  std::optional<bool> is_last_backward;

 private:
  void lazy_init();
  void root_final_callback();
  void prefetch_for_forward();
  void prefetch_for_backward();
  void register_post_backward(nn::TensorList& inputs);
  void register_pre_backward(nn::TensorList& outputs);
  void cast_tensors(nn::TensorList& tensors, c10::ScalarType dtype) const;

  std::vector<std::weak_ptr<torch::nn::Module>> modules_;
  std::unique_ptr<detail::FSDPParamGroup> param_group_;
  FullyShardOptions options_;
  std::string name_;
  std::optional<bool> is_root_;
  std::shared_ptr<detail::RootContext> ctx_;
  detail::TrainingState training_state_ = detail::TrainingState::Idle;
  bool ran_pre_backward_ = false;
};

namespace detail {
// The child module through which a module owns its FSDPState (libtorch modules have no slot for it).
struct FSDPStateHolder : torch::nn::Module {
  std::shared_ptr<FSDPState> state;
};
constexpr const char* kStateHolderName = "_fsdp_state";
std::shared_ptr<FSDPState> find_state(const torch::nn::Module& module);
}  // namespace detail

}  // namespace fsdp
