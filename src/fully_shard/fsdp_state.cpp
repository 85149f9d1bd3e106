#include "fully_shard/fsdp_state.h"
#include "autograd/make_node.h"
#include "autograd/nested_backward.h"
#include "comm/store_exchange.h"
#include "util/exception_message.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

namespace fsdp {

using detail::Event;
using detail::Phase;

namespace detail {

FSDPState& FSDPModuleAccess::state(const FSDPModule& module) {
  TORCH_CHECK(module.state_, "fsdp: empty FSDPModule handle");
  return *module.state_;
}

namespace {
// Identity in forward; in backward, once the gradients of all of a forward call's inputs are known (so that
// call's backward has run and its parameters' gradients are accumulated — AccumulateGrad nodes run first
// among ready nodes), tells the state. Python's RegisterPostBackwardFunction.
struct PostBackwardNode : torch::autograd::Node {
  std::weak_ptr<FSDPState> state;
  std::string name() const override { return "fsdp::PostBackward"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (auto s = state.lock()) s->post_backward();
    return std::move(grads);
  }
};

// The autograd engine's current backward pass, or -1 outside backward.
int current_backward_pass() { return torch::autograd::get_current_graph_task_id(); }

// After its module returned, a parameter shows only this rank's shard: used by autograd then, its gradient
// would have the shard's shape. Raised by the gradient guard and at the end of the root's forward.
std::string used_outside_forward_message(const FSDPParam& p, const FSDPState& s) {
  return c10::str("fsdp: parameter '", p.fqn(), "' of FSDP module ", s.name(), " was used by autograd outside the "
                  "forward of its FSDP module (after that module returned, the parameter shows only this rank's "
                  "shard). Compute with it inside that module's forward, or gather it explicitly with "
                  "FSDPModule::unshard() before the use and reshard() after backward (see docs/hooks.md)");
}
}  // namespace
}  // namespace detail

FSDPState::FSDPState(std::vector<std::weak_ptr<torch::nn::Module>> modules,
                     std::vector<std::unique_ptr<detail::FSDPParamGroup>> groups, FullyShardOptions options)
    : modules_(std::move(modules)), param_groups_(std::move(groups)), options_(std::move(options)) {
  for (auto& g : param_groups_) {
    TORCH_INTERNAL_ASSERT(g, "fsdp: FSDPState given a null parameter group");
    group_ptrs_.push_back(g.get());
  }
  name_ = module().name();
  name_groups();
}

void FSDPState::name_groups() {
  for (detail::FSDPParamGroup* g : group_ptrs_) {
    if (group_ptrs_.size() == 1) {
      g->set_name(name_);
      continue;
    }
    const DeviceMesh& mesh = g->mesh_info().mesh;
    std::string dims;
    for (int64_t d = 0; d < mesh.ndim(); ++d) dims += c10::str(d ? ", " : "", mesh.dim_names()[d], "=", mesh.size(d));
    g->set_name(c10::str(name_, " on mesh [", dims, "]"));
  }
}

detail::Phase FSDPState::training_state() const {
  // The groups move together (every hook applies the same event to each); they can only disagree after an
  // exception between two groups' steps, which the next reset() repairs.
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(std::all_of(group_ptrs_.begin(), group_ptrs_.end(), [this](const auto* g) {
    return g->phase() == machine().phase();
  }), "fsdp: the parameter groups of ", name_, " are in different phases");
  return machine().phase();
}

torch::nn::Module& FSDPState::module() const {
  auto m = modules_.front().lock();
  TORCH_CHECK(m, "fsdp: the module of this FSDP state no longer exists");
  return *m;
}

void FSDPState::attach() {
  std::weak_ptr<FSDPState> weak = weak_from_this();
  // Every member gets both hooks: a group of modules may run in any order, and only some members may run.
  for (auto& weak_module : modules_) {
    auto m = weak_module.lock();
    nn::register_forward_pre_hook(*m, [weak](torch::nn::Module& mod, nn::TensorList& inputs) {
      if (auto s = weak.lock()) s->pre_forward(mod, inputs);
    });
    nn::register_forward_hook(*m, [weak](torch::nn::Module& mod, const nn::TensorList& in, nn::TensorList& out) {
      if (auto s = weak.lock()) s->post_forward(mod, in, out);
    });
    nn::register_forward_exception_hook(*m, [weak](torch::nn::Module& mod) {
      if (auto s = weak.lock()) s->on_forward_exception(mod);
    });
  }
  // The gradient guard: a gradient can only legitimately reach a parameter while it shows its full
  // (unsharded) data, i.e. between pre-forward/pre-backward and reshard. Registered on every parameter of
  // every group (a frozen one gets it too: requires_grad may be turned on later; the hook then starts firing).
  for (detail::FSDPParamGroup* group : group_ptrs_) {
    for (detail::FSDPParam* p : group->params()) {
      const bool frozen = !p->param().requires_grad();
      // register_hook needs requires_grad; flip it around the registration for frozen parameters.
      if (frozen) p->param().requires_grad_(true);
      p->param().register_hook([weak, p](const at::Tensor&) {
        auto s = weak.lock();
        if (!s || p->state() == detail::ShardedState::Unsharded) return;
        const bool ran_forward_this_step = s->training_state() != Phase::Idle ||
                                           (s->ctx_ && std::find(s->ctx_->backward_order.begin(),
                                                                 s->ctx_->backward_order.end(),
                                                                 s.get()) != s->ctx_->backward_order.end());
        TORCH_CHECK(!ran_forward_this_step, detail::used_outside_forward_message(*p, *s));
        TORCH_CHECK(false, "fsdp: parameter '", p->fqn(), "' of FSDP module ", s->name(),
                    " received a gradient while sharded: the module was run without its FSDP hooks. Invoke modules "
                    "given to fully_shard with fsdp::nn::call(module, args...) instead of module->forward(args...) "
                    "(see docs/hooks.md)");
      });
      if (frozen) p->param().requires_grad_(false);
    }
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

std::vector<std::shared_ptr<FSDPState>> FSDPState::context_states() const {
  std::vector<std::shared_ptr<FSDPState>> out;
  if (!ctx_) return out;
  for (auto& w : ctx_->states) {
    if (auto s = w.lock()) out.push_back(s);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// Lazy init: the first state to run forward is the root.

void FSDPState::lazy_init() {
  if (fsdp_ancestor_) {
    TORCH_CHECK(false, "fsdp: FSDP module ", name_, " runs forward before its FSDP root ", *fsdp_ancestor_,
                " ever did. FSDP initializes lazily from the root (the outermost fully_shard module): run the root's "
                "forward first (fsdp::nn::call(root, ...)); afterwards submodules may also run on their own");
  }
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
  // Validate everything before changing anything: a refused first forward leaves no half-initialized tree.
  std::unordered_set<const c10::TensorImpl*> owned;
  for (auto& s : states) {
    TORCH_CHECK(s.get() == this || !s->is_root_.has_value(), "fsdp: FSDP module ", s->name_,
                " already ran forward as its own root before its ancestor ", name_,
                " did. FSDP requires running forward through the root first");
    for (detail::FSDPParamGroup* g : s->group_ptrs_) {
      for (detail::FSDPParam* p : g->params()) {
        const c10::TensorImpl* impl = p->param().unsafeGetTensorImpl();
        auto it = fqn_of.find(impl);
        const std::string& fqn = it != fqn_of.end() ? it->second : p->fqn();
        TORCH_CHECK(owned.insert(impl).second, "fsdp: parameter '", fqn, "' belongs to two FSDP parameter groups");
        TORCH_CHECK(!p->param().is_meta(), "fsdp: parameter '", fqn,
                    "' is still on the meta device at the first forward; materialize the model first "
                    "(fsdp::materialize_module, then initialize it)");
      }
    }
  }
  is_root_ = true;
  ctx_ = std::make_shared<detail::RootContext>();
  ctx_->is_last_backward = is_last_backward_before_init_;
  // One set of streams for the tree, on the device the groups compute on (the first group's: fully_shard puts
  // every group of a tree on its mesh's device). A tree without parameters has nothing to communicate.
  c10::Device device(c10::kCPU);
  for (auto& s : states) {
    if (!s->group_ptrs_.empty()) {
      device = s->group_ptrs_.front()->mesh_info().device;
      break;
    }
  }
  ctx_->comm = std::make_shared<detail::CommContext>(device);
  for (auto& s : states) {
    if (s.get() != this) s->is_root_ = false;
    s->ctx_ = ctx_;
    ctx_->states.push_back(s);
    auto path = module_path.find(&s->module());
    if (path != module_path.end() && !path->second.empty()) s->name_ = path->second + " (" + s->module().name() + ")";
    s->name_groups();
    for (detail::FSDPParamGroup* g : s->group_ptrs_) {
      g->set_comm_context(ctx_->comm);
      g->set_default_reshard_after_forward(s.get() == this);
      for (detail::FSDPParam* p : g->params()) {
        auto it = fqn_of.find(p->param().unsafeGetTensorImpl());
        if (it != fqn_of.end()) p->set_fqn(it->second);
      }
    }
  }
}

bool FSDPState::needs_recovery() const {
  if (!ctx_) return false;
  const int pass = detail::current_backward_pass();
  // (A backward nested in the recorded one — activation checkpointing's recomputation — is that backward.)
  if (ctx_->backward_graph_task != -1 && !detail::runs_within_backward(ctx_->backward_graph_task)) {
    return true;  // backward died
  }
  // Forward left over (an exception escaped the root's forward), or backward states outside any backward.
  for (auto& s : context_states()) {
    if (detail::is_abandoned(s->training_state(), /*in_backward=*/pass != -1)) return true;
  }
  return false;
}

void FSDPState::root_pre_forward() {
  TORCH_CHECK(!ctx_->unusable, *ctx_->unusable);
  if (needs_recovery()) reset();
  wait_for_post_optim_event();
  ctx_->forward_order.clear();
  for (auto& s : context_states()) s->forward_calls_this_root_forward_ = 0;
}

void FSDPState::finish_open_forwards() {
  for (auto& s : context_states()) {
    if (s.get() != this && s->training_state() == Phase::Forward && s->members_running_.empty()) {
      s->finish_forward();
    }
  }
}

void FSDPState::root_post_forward() {
  // Members of a group of modules that did not all run: their group finishes with the root (post_forward
  // called finish_open_forwards). Forward prefetches nobody consumed (a module skipped this time) are completed
  // and dropped: their data must not survive into a later step, after an optimizer step changed the shards.
  auto states = context_states();
  for (auto& s : states) {
    if (s->training_state() == Phase::Idle) {
      for (detail::FSDPParamGroup* g : s->group_ptrs_) g->drop_unused_unshard();
    }
  }
  ctx_->last_forward_order = ctx_->forward_order;
  // The last group's all-gather output was kept for a next group's copy-out that will not come in this forward.
  release_held_buffers();
  // A sharded parameter that autograd recorded an op on after its module returned: its gradient would have
  // the shard's shape (autograd then fails in backward with a shape error that names no module). Say so now.
  if (c10::GradMode::is_enabled()) {
    for (auto& s : states) {
      for (detail::FSDPParamGroup* g : s->group_ptrs_) {
        const detail::FSDPParam* p = g->used_outside_forward();
        TORCH_CHECK(p == nullptr, detail::used_outside_forward_message(*p, *s));
      }
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
  const bool outermost_root_call = is_root() && members_running_.empty();
  if (training_state() == Phase::PreBackward && !(outermost_root_call && needs_recovery())) {
    // Recomputation during backward (activation checkpointing): pre-backward already gathered the group.
    return;
  }
  if (outermost_root_call) {
    root_pre_forward();
    ctx_->forward_root = this;
  } else if (ctx_->forward_root == nullptr) {
    // A submodule run on its own, outside the root's forward: its call opens (and, returning, closes) a forward.
    ctx_->forward_root = this;
  }
  if (training_state() != Phase::Forward) {
    // The first member of this call group to run: gather the parameters.
    forward_grad_enabled_ = c10::GradMode::is_enabled();
    apply_without_group(Event::PreForward);
    issue_gathers(/*for_backward=*/false);
    for (detail::FSDPParamGroup* g : group_ptrs_) g->pre_forward();
    prefetch_for_forward();
    ++forward_calls_this_root_forward_;
  }
  ++members_running_[&module];
  members_ran_.insert(&module);
  const auto& mp = options_.mp_policy;
  if (mp.cast_forward_inputs && mp.param_dtype) cast_tensors(inputs, *mp.param_dtype);
  if (c10::GradMode::is_enabled() && !group_ptrs_.empty()) {
    bool any_requires_grad = false;
    for (detail::FSDPParamGroup* g : group_ptrs_) {
      for (detail::FSDPParam* p : g->params()) any_requires_grad = any_requires_grad || p->requires_grad();
    }
    if (any_requires_grad) {
      // One post-backward node per call: when it fires, every group's gradients of this use are complete.
      // Every group counts the use (the groups move together; one whose parameters are all frozen reduces
      // nothing and just reshards).
      const bool registered = register_post_backward(inputs);
      for (detail::FSDPParamGroup* g : group_ptrs_) g->record_use(registered);
      calls_.push_back(registered ? CallRecord::UseWithNode : CallRecord::Use);
      return;
    }
  }
  calls_.push_back(CallRecord::NoUse);
}

std::optional<FSDPState::CallRecord> FSDPState::end_call(torch::nn::Module& module) {
  auto running = members_running_.find(&module);
  if (running == members_running_.end()) return std::nullopt;  // pre_forward did nothing for this call
  if (--running->second == 0) members_running_.erase(running);
  // pre_forward pushes one record for every call it counts as running (none if it threw in between).
  if (calls_.empty()) return CallRecord::NoUse;
  CallRecord record = calls_.back();
  calls_.pop_back();
  return record;
}

void FSDPState::on_forward_exception(torch::nn::Module& module) {
  const std::optional<CallRecord> call = end_call(module);
  if (!call) return;
  // The failed call has no outputs, so no backward will ever complete its use.
  if (*call != CallRecord::NoUse) {
    for (detail::FSDPParamGroup* g : group_ptrs_) g->forget_use(*call == CallRecord::UseWithNode);
  }
  if (!members_running_.empty()) return;
  if (ctx_ && ctx_->forward_root == this) ctx_->forward_root = nullptr;
  if (is_root()) {
    // The whole forward is abandoned: release everything now rather than at the next forward.
    reset();
    return;
  }
  // The caller may carry on (catch and retry with a smaller batch): give the parameters back as a forward
  // without gradients would, and return to idle.
  if (training_state() == Phase::Forward) {
    for (detail::FSDPParamGroup* g : group_ptrs_) g->post_forward(/*grad_enabled=*/false);
    apply_without_group(Event::PostForward);
    members_ran_.clear();
  }
}

void FSDPState::post_forward(torch::nn::Module& module, const nn::TensorList& inputs, nn::TensorList& outputs) {
  if (!end_call(module)) return;  // recomputation during backward: pre_forward skipped it
  if (options_.mp_policy.output_dtype) cast_tensors(outputs, *options_.mp_policy.output_dtype);
  if (c10::GradMode::is_enabled()) register_pre_backward(outputs);
  if (!members_running_.empty()) return;  // a member re-entered itself; the outer call finishes
  // A group of modules finishes once every member ran (they may run in any order): finishing earlier would
  // reshard and gather again for the next member. When only some members run, the group finishes when the call
  // that opened the forward returns: the root's, or this group's own call when a member runs on its own outside
  // the root's forward (then the group behaves as a module sharded alone, called on its own, would: its
  // forward ends with the call, and its backward is an ordinary pre-/post-backward).
  const bool closes_forward = ctx_->forward_root == this;
  if (closes_forward || members_ran_.size() == modules_.size()) finish_forward();
  if (!closes_forward) return;
  finish_open_forwards();
  ctx_->forward_root = nullptr;
  if (is_root()) {
    root_post_forward();
  } else {
    release_held_buffers();  // the last all-gather output kept for a next copy-out that will not come
  }
}

void FSDPState::finish_forward() {
  members_ran_.clear();
  for (detail::FSDPParamGroup* g : group_ptrs_) g->post_forward(forward_grad_enabled_);
  apply_without_group(Event::PostForward);
  ctx_->forward_order.push_back(this);
  if (forward_grad_enabled_) {
    backward_order_indices_.push_back(ctx_->backward_order.size());
    ctx_->backward_order.push_back(this);
  }
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
    // Implicit: the state that finished forward right after this call did, last time. The k-th call of this
    // state in this root forward matches its k-th occurrence in the previous forward's order.
    const auto& order = ctx_->last_forward_order;
    if (is_root()) {
      // The root runs forward first but finishes last: prefetch the first state it runs.
      if (!order.empty() && order.front() != this) targets.push_back(order.front());
    } else {
      int seen = 0;
      for (size_t i = 0; i < order.size(); ++i) {
        if (order[i] != this || ++seen != forward_calls_this_root_forward_ + 1) continue;
        if (i + 1 < order.size()) targets.push_back(order[i + 1]);
        break;
      }
    }
  }
  for (FSDPState* s : targets) {
    if (s != this && s->training_state() == Phase::Idle) s->issue_gathers(/*for_backward=*/false);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Backward

bool FSDPState::register_post_backward(nn::TensorList& inputs) {
  std::vector<size_t> indices;
  torch::autograd::variable_list grad_inputs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].defined() && inputs[i].requires_grad()) {
      indices.push_back(i);
      grad_inputs.push_back(inputs[i]);
    }
  }
  if (grad_inputs.empty()) return false;  // this use completes at the end of backward (root's final callback)
  auto node = detail::make_autograd_node<detail::PostBackwardNode>();
  node->state = weak_from_this();
  node->set_next_edges(torch::autograd::collect_next_edges(grad_inputs));
  for (size_t k = 0; k < indices.size(); ++k) {
    at::Tensor out = inputs[indices[k]].detach();
    torch::autograd::set_history(out, node);
    inputs[indices[k]] = out;
  }
  return true;
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

void FSDPState::queue_final_callback() {
  const int pass = detail::current_backward_pass();
  // A backward nested in the recorded one (activation checkpointing recomputing a region whose submodules are
  // sharded) belongs to it: its uses finish at that backward's final callback.
  if (detail::runs_within_backward(ctx_->backward_graph_task)) return;
  if (ctx_->backward_graph_task != -1) {
    // The callback queued for an earlier backward never ran: that backward failed. Recover first.
    reset();
  }
  ctx_->backward_graph_task = pass;
  std::weak_ptr<FSDPState> root = ctx_->states.front();  // lazy_init lists the root first
  torch::autograd::Engine::get_default_engine().queue_callback([root] {
    if (auto r = root.lock()) r->root_final_callback();
  });
}

void FSDPState::pre_backward() {
  queue_final_callback();
  if (training_state() == Phase::PreBackward) return;
  // Idle (first use reached in this backward) or PostBackward (an earlier use of this group: re-armed).
  apply_without_group(Event::PreBackward);
  issue_gathers(/*for_backward=*/true);
  for (detail::FSDPParamGroup* g : group_ptrs_) g->pre_backward();
  prefetch_for_backward();
}

void FSDPState::prefetch_for_backward() {
  std::vector<FSDPState*> targets = live_states(backward_prefetch);
  // Implicit: backward runs in reverse post-forward order; each use of this state pops its own position, and
  // the call that finished just before it is the next to need its parameters.
  std::optional<size_t> position;
  if (!backward_order_indices_.empty()) {
    position = backward_order_indices_.back();
    backward_order_indices_.pop_back();
  }
  if (backward_prefetch.empty() && position && *position > 0 && *position <= ctx_->backward_order.size()) {
    targets.push_back(ctx_->backward_order[*position - 1]);
  }
  for (FSDPState* s : targets) {
    if (s == this || s->training_state() == Phase::PreBackward) continue;
    s->issue_gathers(/*for_backward=*/true);  // no-op when already unsharded or in flight
  }
}

void FSDPState::post_backward() {
  queue_final_callback();
  apply_without_group(Event::PostBackward);
  if (group_ptrs_.empty()) return;
  // At most one state's reductions in flight across the tree: finishing the previous state's here bounds
  // gradient memory while its communication still overlapped this state's backward compute.
  auto& pending = ctx_->groups_with_pending_reduce;
  auto mine = [this](detail::FSDPParamGroup* g) {
    return std::find(group_ptrs_.begin(), group_ptrs_.end(), g) != group_ptrs_.end();
  };
  for (detail::FSDPParamGroup* g : pending) {
    if (!mine(g)) g->finish_pending_reduce();
  }
  pending.erase(std::remove_if(pending.begin(), pending.end(), [&](auto* g) { return !mine(g); }), pending.end());
  // The node fires once per use of the state: every group's gradients of that use are complete. Each
  // group's reduction is issued before the next group's starts, so groups on different meshes overlap.
  for (detail::FSDPParamGroup* g : group_ptrs_) {
    g->post_backward_from_node();
    if (g->has_pending_reduce() && std::find(pending.begin(), pending.end(), g) == pending.end()) pending.push_back(g);
  }
}

void FSDPState::root_final_callback() {
  const bool keep_graph = torch::autograd::get_current_graph_task_keep_graph();
  const bool last = ctx_->is_last_backward;
  // Uses that had no post-backward node, or were deferred, are reduced now — in a fixed order (reverse module
  // order) so that every rank issues the same collectives.
  auto states = context_states();
  for (auto it = states.rbegin(); it != states.rend(); ++it) {
    FSDPState& s = **it;
    for (detail::FSDPParamGroup* g : s.group_ptrs_) g->finish_backward(keep_graph, /*finalize=*/last);
    s.apply_without_group(Event::EndBackward);
    if (!keep_graph && last) s.backward_order_indices_.clear();
  }
  if (!last) {
    // More micro-batches' backwards follow (a pipeline schedule): reductions stay in flight, and the backward
    // order recorded by the forwards not yet run backward is kept for their prefetching.
    ctx_->backward_graph_task = -1;
    return;
  }
  if (keep_graph) {
    // The same graph may run backward again: restore every call's position for backward prefetch.
    for (auto& s : states) s->backward_order_indices_.clear();
    for (size_t i = 0; i < ctx_->backward_order.size(); ++i) ctx_->backward_order[i]->backward_order_indices_.push_back(i);
  } else {
    ctx_->backward_order.clear();
  }
  ctx_->groups_with_pending_reduce.clear();
  ctx_->backward_graph_task = -1;
  release_held_buffers();  // the last reduce-scatter's input: the current stream now waits for it
}

void FSDPState::release_held_buffers() {
  if (!ctx_ || !ctx_->comm) return;
  detail::CommStreams& s = ctx_->comm->streams;
  ctx_->comm->all_gather_state.release(s, {s.all_gather_copy_in(), s.all_gather()});
  ctx_->comm->reduce_scatter_state.release(s, {s.current()});
}

// ---------------------------------------------------------------------------------------------------------
// Recovery, explicit unshard / reshard, conversion

void FSDPState::reset() {
  TORCH_CHECK(!ctx_ || !ctx_->unusable, *ctx_->unusable);
  std::vector<std::shared_ptr<FSDPState>> states = ctx_ ? context_states() : subtree_states();
  // Something was abandoned (not a reset of a tree already idle): the ranks must agree they stopped at the
  // same point before any of them issues another collective.
  bool abandoned = ctx_ && ctx_->backward_graph_task != -1;
  for (auto& s : states) abandoned = abandoned || s->training_state() != Phase::Idle;
  std::exception_ptr failure;
  for (auto& s : states) {
    for (detail::FSDPParamGroup* g : s->group_ptrs_) {
      try {
        g->reset();
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
    }
    s->apply_without_group(Event::Reset);
    s->members_running_.clear();
    s->members_ran_.clear();
    s->calls_.clear();
    s->backward_order_indices_.clear();
  }
  if (ctx_) {
    release_held_buffers();
    ctx_->backward_order.clear();
    ctx_->forward_order.clear();
    ctx_->forward_root = nullptr;
    ctx_->groups_with_pending_reduce.clear();
    ctx_->backward_graph_task = -1;
  }
  if (failure) {
    try {
      std::rethrow_exception(failure);
    } catch (const c10::Error& e) {
      if (ctx_) ctx_->unusable = e.what_without_backtrace();
      throw;
    }
  }
  if (abandoned) check_ranks_in_step(states);
}

// After an abandoned step every rank's issued collectives are complete (the drain above), but that only
// means the peers issued them too — not that they stopped here. A rank that did not raise goes on issuing
// the step's remaining collectives, which the others would pair with their next step's (Gloo matches
// collectives by order: wrong sums, or a hang). So the ranks compare, through the rendezvous store rather
// than the backend, how many collectives each issued on every group: equal counts everywhere means they all
// abandoned the step at the same point (the same exception on every rank: bad input, a shared OOM retry) and
// training can go on; a rank missing or a different count means the group is out of step for good.
void FSDPState::check_ranks_in_step(const std::vector<std::shared_ptr<FSDPState>>& states) {
  std::vector<ProcessGroupPtr> groups;
  for (auto& s : states) {
    for (detail::FSDPParamGroup* pg : s->group_ptrs_) {
      for (const auto& g : {pg->mesh_info().shard_group, pg->mesh_info().replicate_group}) {
        if (g && g->size() > 1 && std::find(groups.begin(), groups.end(), g) == groups.end()) groups.push_back(g);
      }
    }
  }
  try {
    for (const auto& g : groups) check_group_in_step(*g);
  } catch (const c10::Error& e) {
    if (ctx_) ctx_->unusable = e.what_without_backtrace();
    throw;
  }
}

void FSDPState::check_group_in_step(ProcessGroup& group) {
  // A collective of the group already failed here (timeout, peer gone): the ranks are out of step whatever the
  // store would say, and the store may be what is gone (its host, world rank 0, stopped), so do not ask it.
  const auto failure = comm::first_failure(group);
  TORCH_CHECK(!failure, "fsdp: the process group of ", name(), " is unusable after an exception: a collective of "
              "group '", group.name(), "' failed on this rank, so the ranks are out of step. Restart the job "
              "(fsdprun --max-restarts) and resume from a checkpoint. Cause: ", *failure);
  std::vector<std::string> counts;
  try {
    counts = comm::exchange_through_store(group, "FSDP recovery after an exception",
                                          std::to_string(collectives_called(group)), group.timeout());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "fsdp: the process group of ", name(), " is unusable after an exception: not every rank "
                "abandoned the step (only some ranks raised, so the others are still inside it and will issue "
                "collectives this rank never joins). Restart the job (fsdprun --max-restarts) and resume from a "
                "checkpoint. Cause: ", detail::message_of(e));
  }
  std::string listing;
  bool equal = true;
  for (size_t r = 0; r < counts.size(); ++r) {
    listing += c10::str(r ? ", " : "", "rank ", r, ": ", counts[r]);
    equal = equal && counts[r] == counts[0];
  }
  TORCH_CHECK(equal, "fsdp: the process group of ", name(), " is unusable after an exception: the ranks "
              "abandoned the step at different points (collectives issued on group '", group.name(), "': ", listing,
              "), e.g. they raised in different modules or only some of them raised. Restart the job (fsdprun "
              "--max-restarts) and resume from a checkpoint.");
}

void FSDPState::set_is_last_backward(bool is_last_backward) {
  if (ctx_) ctx_->is_last_backward = is_last_backward;
  is_last_backward_before_init_ = is_last_backward;
}

// A schedule's explicit reduction (pipeline parallelism's REDUCE_GRAD): every group of this tree reduces the
// gradients its no-sync backwards accumulated — one reduce-scatter (and HSDP all-reduce) per group — reshards
// and completes, as the end of a last backward would. The backward hooks all ran before (no hook is bypassed:
// they accumulated); this only moves the reduction to the point the caller chooses.
void FSDPState::explicit_post_backward() {
  TORCH_CHECK(!ctx_ || !ctx_->unusable, *ctx_->unusable);
  TORCH_CHECK(detail::current_backward_pass() == -1, "fsdp: FSDPModule::post_backward() on ", name_,
              " inside a backward pass; call it after the micro-batches' backward calls returned");
  TORCH_CHECK(!ctx_ || ctx_->backward_graph_task == -1, "fsdp: FSDPModule::post_backward() on ", name_,
              " after a backward pass that did not finish (an exception escaped it); call reset() first");
  auto states = subtree_states();
  for (auto& s : states) {
    TORCH_CHECK(s->training_state() == Phase::Idle, "fsdp: FSDPModule::post_backward() on ", name_, " while ",
                s->name_, " is in ", detail::to_string(s->training_state()),
                "; call it between steps, after the last micro-batch's backward");
  }
  for (auto it = states.rbegin(); it != states.rend(); ++it) {
    FSDPState& s = **it;
    for (detail::FSDPParamGroup* g : s.group_ptrs_) {
      g->finish_backward(/*keep_graph=*/false, /*finalize=*/true, /*force_sync=*/true);
    }
    s.apply_without_group(Event::EndBackward);
    s.backward_order_indices_.clear();
  }
  if (ctx_ && is_root()) {
    ctx_->backward_order.clear();
    ctx_->groups_with_pending_reduce.clear();
    release_held_buffers();
  }
}

void FSDPState::set_post_optim_event(c10::Event event) {
  // Before the root's lazy init there is no shared context yet: keep it here until then.
  if (ctx_) {
    ctx_->post_optim_event.emplace(std::move(event));
  } else {
    pending_post_optim_event_.emplace(std::move(event));
  }
}

void FSDPState::wait_for_post_optim_event() {
  for (auto& s : context_states()) {
    if (s->pending_post_optim_event_) {
      ctx_->post_optim_event = std::move(s->pending_post_optim_event_);
      s->pending_post_optim_event_.reset();
    }
  }
  if (!ctx_->post_optim_event) return;
  c10::Event event = std::move(*ctx_->post_optim_event);
  ctx_->post_optim_event.reset();
  ++ctx_->post_optim_events_waited;
  // The current stream waits for the event; every all-gather's copy-in stream waits on the current stream
  // before it reads the shards (FSDPParamGroup::unshard), so the all-gathers are ordered after the optimizer
  // step too. An event never recorded (and any CPU event: the CPU runs everything in order) has nothing to
  // wait for.
  if (event.device_type() == c10::DeviceType::CPU || !event.was_marked_for_recording()) return;
  c10::impl::VirtualGuardImpl guard(event.device_type());
  event.block(guard.getStream(c10::Device(event.device_type(), event.device_index())));
}

void FSDPState::issue_gathers(bool for_backward) {
  for (detail::FSDPParamGroup* g : group_ptrs_) {
    if (for_backward) {
      g->unshard_for_backward();  // not with set_unshard_in_backward(false)
    } else {
      g->unshard();
    }
  }
}

void FSDPState::unshard(bool async_op) {
  // Explicit: on the current stream, as in Python; every group's gather issued before any is waited.
  for (detail::FSDPParamGroup* g : group_ptrs_) g->unshard(/*on_comm_streams=*/false);
  if (!async_op) wait_for_unshard();
}

void FSDPState::wait_for_unshard() {
  for (detail::FSDPParamGroup* g : group_ptrs_) g->wait_for_unshard();
}

void FSDPState::reshard() {
  for (detail::FSDPParamGroup* g : group_ptrs_) g->reshard();
}

void FSDPState::convert_dtype(c10::ScalarType dtype) {
  for (detail::FSDPParamGroup* g : group_ptrs_) g->convert_dtype(dtype, options_.mp_policy);
}

}  // namespace fsdp
