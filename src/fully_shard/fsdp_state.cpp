#include "fully_shard/fsdp_state.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

namespace fsdp {

using detail::TrainingState;

namespace detail {

std::shared_ptr<FSDPState> find_state(const torch::nn::Module& module) {
  for (const auto& child : module.named_children()) {
    if (child.key() == kStateHolderName) {
      if (auto holder = std::dynamic_pointer_cast<FSDPStateHolder>(child.value())) return holder->state;
    }
  }
  return nullptr;
}

namespace {
// Identity in forward; in backward, once the gradients of all of a module's inputs are known (so the
// module's backward has run and its parameters' gradients are accumulated — AccumulateGrad nodes run first
// among ready nodes), reduces the group's gradients. Python's RegisterPostBackwardFunction.
struct PostBackwardNode : torch::autograd::Node {
  std::weak_ptr<FSDPState> state;
  std::string name() const override { return "fsdp::PostBackward"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (auto s = state.lock()) s->post_backward();
    return std::move(grads);
  }
};
}  // namespace
}  // namespace detail

FSDPState::FSDPState(std::vector<std::weak_ptr<torch::nn::Module>> modules,
                     std::unique_ptr<detail::FSDPParamGroup> group, FullyShardOptions options)
    : modules_(std::move(modules)), param_group_(std::move(group)), options_(std::move(options)) {
  name_ = module().name();
}

torch::nn::Module& FSDPState::module() const {
  auto m = modules_.front().lock();
  TORCH_CHECK(m, "fsdp: the module of this FSDP state no longer exists");
  return *m;
}

void FSDPState::attach() {
  std::weak_ptr<FSDPState> weak = weak_from_this();
  auto first = modules_.front().lock();
  auto last = modules_.back().lock();
  nn::register_forward_pre_hook(*first, [weak](torch::nn::Module& m, nn::TensorList& inputs) {
    if (auto s = weak.lock()) s->pre_forward(m, inputs);
  });
  nn::register_forward_hook(*last, [weak](torch::nn::Module& m, const nn::TensorList& in, nn::TensorList& out) {
    if (auto s = weak.lock()) s->post_forward(m, in, out);
  });
  if (!param_group_) return;
  // The forgotten-hook guard: a gradient can only legitimately reach a parameter while it shows its full
  // (unsharded) data, i.e. between pre-forward/pre-backward and reshard. A module run with ->forward()
  // instead of fsdp::nn::call() computes with the shard, and its gradient arrives while sharded.
  for (detail::FSDPParam* p : param_group_->params()) {
    if (!p->requires_grad()) continue;
    p->param().register_hook([weak, p](const at::Tensor& grad) {
      auto s = weak.lock();
      if (!s || p->state() == detail::ShardedState::Unsharded) return;
      TORCH_CHECK(false, "fsdp: parameter '", p->fqn(), "' of FSDP module ", s->name(),
                  " received a gradient while sharded: the module was run without its FSDP hooks. Invoke modules "
                  "given to fully_shard with fsdp::nn::call(module, args...) instead of module->forward(args...) "
                  "(see docs/hooks.md)");
    });
  }
}

std::vector<std::shared_ptr<FSDPState>> FSDPState::subtree_states() {
  std::vector<std::shared_ptr<FSDPState>> out;
  std::unordered_set<const FSDPState*> seen;
  for (auto& weak_module : modules_) {
    auto m = weak_module.lock();
    if (!m) continue;
    for (const auto& sub : m->modules(/*include_self=*/true)) {
      auto s = detail::find_state(*sub);
      if (s && seen.insert(s.get()).second) out.push_back(s);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// Lazy init: the first state to run forward is the root.

void FSDPState::lazy_init() {
  is_root_ = true;
  ctx_ = std::make_shared<detail::RootContext>();
  auto states = subtree_states();
  // Fully qualified names relative to the root, for error messages and state dicts.
  std::unordered_map<const c10::TensorImpl*, std::string> fqn_of;
  std::unordered_map<const torch::nn::Module*, std::string> module_path;
  for (auto& weak_module : modules_) {
    auto m = weak_module.lock();
    for (const auto& item : m->named_parameters(/*recurse=*/true)) {
      fqn_of.emplace(item.value().unsafeGetTensorImpl(), item.key());
    }
    for (const auto& item : m->named_modules("", /*include_self=*/true)) module_path.emplace(item.value().get(), item.key());
  }
  std::unordered_set<const c10::TensorImpl*> owned;
  for (auto& s : states) {
    if (s.get() != this) {
      TORCH_CHECK(!s->is_root_.value_or(false) || s->ctx_ == nullptr || s->training_state_ == TrainingState::Idle,
                  "fsdp: module ", s->name_, " is running as an FSDP root while its parent starts forward");
      s->is_root_ = false;
    }
    s->ctx_ = ctx_;
    ctx_->states.push_back(s);
    auto path = module_path.find(&s->module());
    if (path != module_path.end() && !path->second.empty()) s->name_ = path->second + " (" + s->module().name() + ")";
    if (!s->param_group_) continue;
    s->param_group_->set_default_reshard_after_forward(s.get() == this);
    s->param_group_->set_name(s->name_);
    for (detail::FSDPParam* p : s->param_group_->params()) {
      const c10::TensorImpl* impl = p->param().unsafeGetTensorImpl();
      TORCH_CHECK(owned.insert(impl).second, "fsdp: parameter '", p->fqn(), "' belongs to two FSDP parameter groups");
      auto it = fqn_of.find(impl);
      if (it != fqn_of.end()) p->set_fqn(it->second);
      TORCH_CHECK(!p->param().is_meta(), "fsdp: parameter '", p->fqn(),
                  "' is still on the meta device at the first forward; materialize the model first");
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Forward

void FSDPState::cast_tensors(nn::TensorList& tensors, c10::ScalarType dtype) const {
  for (auto& t : tensors) {
    if (t.defined() && at::isFloatingType(t.scalar_type()) && t.scalar_type() != dtype) t = t.to(dtype);
  }
}

void FSDPState::pre_forward(torch::nn::Module& module, nn::TensorList& inputs) {
  if (!is_root_.has_value()) lazy_init();
  TORCH_CHECK(training_state_ == TrainingState::Idle, "fsdp: ", name_,
              " entered forward again before its previous forward finished (re-entrant calls are not supported)");
  if (is_root_.value()) {
    ctx_->post_forward_order.clear();
  }
  training_state_ = TrainingState::Forward;
  if (param_group_) param_group_->pre_forward();
  prefetch_for_forward();
  const auto& mp = options_.mp_policy;
  if (mp.cast_forward_inputs && mp.param_dtype) cast_tensors(inputs, *mp.param_dtype);
  if (c10::GradMode::is_enabled() && param_group_ && param_group_->needs_post_backward()) register_post_backward(inputs);
}

void FSDPState::post_forward(torch::nn::Module& module, const nn::TensorList& inputs, nn::TensorList& outputs) {
  const bool grad_enabled = c10::GradMode::is_enabled();
  if (param_group_) param_group_->post_forward(grad_enabled);
  ctx_->post_forward_order.push_back(this);
  if (options_.mp_policy.output_dtype) cast_tensors(outputs, *options_.mp_policy.output_dtype);
  if (grad_enabled) register_pre_backward(outputs);
  if (is_root()) ctx_->last_post_forward_order = ctx_->post_forward_order;
  training_state_ = TrainingState::Idle;
}

namespace {
// The states of an explicit prefetch list that still exist.
std::vector<FSDPState*> live_states(const std::vector<std::weak_ptr<FSDPState>>& list) {
  std::vector<FSDPState*> out;
  for (auto& w : list) {
    if (auto s = w.lock()) out.push_back(s.get());
  }
  return out;
}
}  // namespace

void FSDPState::prefetch_for_forward() {
  std::vector<FSDPState*> targets = live_states(forward_prefetch);
  if (forward_prefetch.empty()) {
    // Implicit: the state that ran forward right after this one last time.
    const auto& order = ctx_->last_post_forward_order;
    // Pre-forward order differs from post-forward order for nested states; find the first state after
    // this one (in last iteration's post-forward order) that has not run forward yet in this iteration.
    auto it = std::find(order.begin(), order.end(), this);
    if (it != order.end()) {
      for (auto next = std::next(it); next != order.end(); ++next) {
        FSDPState* s = *next;
        if (s->training_state_ == TrainingState::Idle &&
            std::find(ctx_->post_forward_order.begin(), ctx_->post_forward_order.end(), s) == ctx_->post_forward_order.end()) {
          targets.push_back(s);
          break;
        }
      }
    } else if (is_root() && !order.empty()) {
      // The root runs forward first but posts last: prefetch the first state it runs.
      targets.push_back(order.front());
    }
  }
  for (FSDPState* s : targets) {
    if (s->param_group_ && s != this) s->param_group_->unshard();
  }
}

// ---------------------------------------------------------------------------------------------------------
// Backward

void FSDPState::register_post_backward(nn::TensorList& inputs) {
  std::vector<size_t> indices;
  torch::autograd::variable_list grad_inputs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].defined() && inputs[i].requires_grad()) {
      indices.push_back(i);
      grad_inputs.push_back(inputs[i]);
    }
  }
  if (grad_inputs.empty()) return;  // post-backward then runs from the root's final callback
  auto node = c10::make_intrusive<detail::PostBackwardNode>();
  node->state = weak_from_this();
  node->set_next_edges(torch::autograd::collect_next_edges(grad_inputs));
  for (size_t k = 0; k < indices.size(); ++k) {
    at::Tensor out = inputs[indices[k]].detach();
    torch::autograd::set_history(out, node);
    inputs[indices[k]] = out;
  }
}

void FSDPState::register_pre_backward(nn::TensorList& outputs) {
  std::weak_ptr<FSDPState> weak = weak_from_this();
  for (auto& t : outputs) {
    if (!t.defined() || !t.requires_grad()) continue;
    t.register_hook([weak](const at::Tensor&) {
      if (auto s = weak.lock()) s->pre_backward();
    });
  }
}

void FSDPState::pre_backward() {
  if (!ctx_->final_callback_queued) {
    ctx_->final_callback_queued = true;
    std::weak_ptr<FSDPState> root;
    for (auto& w : ctx_->states) {
      auto s = w.lock();
      if (s && s->is_root()) root = s;
    }
    torch::autograd::Engine::get_default_engine().queue_callback([root] {
      if (auto r = root.lock()) r->root_final_callback();
    });
  }
  if (ran_pre_backward_) return;
  ran_pre_backward_ = true;
  training_state_ = TrainingState::PreBackward;
  if (param_group_) param_group_->pre_backward();
  prefetch_for_backward();
}

void FSDPState::prefetch_for_backward() {
  std::vector<FSDPState*> targets = live_states(backward_prefetch);
  if (backward_prefetch.empty()) {
    // Implicit: backward runs in reverse post-forward order, so the state that posted just before this one
    // is the next to need its parameters.
    const auto& order = ctx_->post_forward_order;
    auto it = std::find(order.begin(), order.end(), this);
    if (it != order.end() && it != order.begin()) targets.push_back(*std::prev(it));
  }
  for (FSDPState* s : targets) {
    if (s->param_group_ && s != this && !s->ran_pre_backward_ && s->param_group_->needs_post_backward()) {
      s->param_group_->unshard();
    }
  }
}

void FSDPState::post_backward() {
  training_state_ = TrainingState::PostBackward;
  if (!param_group_ || !param_group_->needs_post_backward()) return;
  // At most one reduction in flight: finishing the previous group's here bounds gradient memory while
  // its communication still overlapped this group's backward compute.
  if (ctx_->group_with_pending_reduce && ctx_->group_with_pending_reduce != param_group_.get()) {
    ctx_->group_with_pending_reduce->finish_pending_reduce();
  }
  param_group_->post_backward();
  ctx_->group_with_pending_reduce = param_group_.get();
}

void FSDPState::root_final_callback() {
  // Post-backward for groups whose inputs did not require gradients (their hook never fired), in a fixed
  // order so that every rank issues the same collectives.
  std::vector<std::shared_ptr<FSDPState>> states;
  for (auto& w : ctx_->states) {
    if (auto s = w.lock()) states.push_back(s);
  }
  for (auto it = states.rbegin(); it != states.rend(); ++it) {
    if ((*it)->param_group_ && (*it)->param_group_->needs_post_backward()) (*it)->post_backward();
  }
  for (auto& s : states) {
    if (s->param_group_) s->param_group_->end_of_backward();
    s->training_state_ = TrainingState::Idle;
    s->ran_pre_backward_ = false;
  }
  ctx_->group_with_pending_reduce = nullptr;
  ctx_->final_callback_queued = false;
}

// ---------------------------------------------------------------------------------------------------------
// Explicit unshard / reshard

void FSDPState::unshard(bool async_op) {
  if (!param_group_) return;
  param_group_->unshard();
  if (!async_op) param_group_->wait_for_unshard();
}

void FSDPState::wait_for_unshard() {
  if (param_group_) param_group_->wait_for_unshard();
}

void FSDPState::reshard() {
  if (param_group_) param_group_->reshard();
}

}  // namespace fsdp
