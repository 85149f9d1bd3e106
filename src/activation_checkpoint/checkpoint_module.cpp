// fsdp::checkpoint_module: activation checkpointing as a forward wrapper (fsdp::nn::call's "around forward").
//
// The region is one autograd node (CheckpointNode) whose inputs are the region's input tensors *and* the
// module's parameters: its forward keeps only the inputs (plus, for SelectiveOp, every second matmul output);
// its backward runs the forward again with gradients on and differentiates the recomputed graph with
// torch::autograd::grad, returning gradients for the inputs and the parameters. So parameters get their
// gradients through the ordinary graph (AccumulateGrad, hooks, torch::autograd::grad(loss, params) all work)
// even when no input requires grad — the properties of PyTorch's non-reentrant checkpoint.
//
// With fully_shard on the same module the FSDP hooks run outside the region (pre-hooks before the wrapper,
// post-hooks after): the saved inputs are the already cast ones (mixed precision applies in recomputation,
// unlike PyTorch bug #159359), and FSDP's pre-backward hook on the region's outputs re-gathers the parameters
// before this node's backward reads them.
//
// A region whose submodules were given to fully_shard is different: their FSDP hooks run inside the region, in
// the recomputation too, so their backward must run as it would without checkpointing — gathered by their own
// pre-backward hooks, their gradients accumulated into the unsharded parameters and reduce-scattered by their
// post-backward. So for such a region the node takes no parameter edges: its backward differentiates the
// recomputed graph with torch::autograd::backward (every leaf accumulates, FSDP's hooks fire) inside a
// NestedBackwardScope (so FSDP counts that nested backward as part of the running one), and returns the
// gradients the region's inputs accumulated. The recomputed children gather their parameters again.
#include <fsdp/activation_checkpoint.h>

#include "autograd/make_node.h"
#include "autograd/nested_backward.h"
#include "activation_checkpoint/rng_state.h"
#include "activation_checkpoint/selective_op.h"
#include "activation_checkpoint/stats.h"

#include <fsdp/fully_shard.h>
#include <fsdp/nn/module_call.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <optional>
#include <string>
#include <vector>

namespace fsdp {
namespace {
constexpr const char* kWrapperTag = "fsdp::checkpoint";

thread_local CheckpointPass tls_pass = CheckpointPass::None;

// Sets the calling thread's pass for one scope (nested regions restore the outer one).
class PassScope {
 public:
  explicit PassScope(CheckpointPass pass) : saved_(tls_pass) { tls_pass = pass; }
  ~PassScope() { tls_pass = saved_; }
  PassScope(const PassScope&) = delete;
  PassScope& operator=(const PassScope&) = delete;

 private:
  CheckpointPass saved_;
};

bool is_differentiable(const at::Tensor& t) {
  return t.defined() && (at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()));
}

struct CheckpointNode : torch::autograd::Node {
  std::string module_name;
  nn::ForwardFunction forward;  // the module's real forward (and inner wrappers); null once released
  std::vector<at::Tensor> inputs;
  std::vector<int64_t> input_versions;
  std::vector<bool> input_requires_grad;
  std::vector<at::Tensor> params;
  std::optional<c10::Device> device;
  detail::RngStash rng;
  std::shared_ptr<detail::MatmulStash> matmuls;  // SelectiveOp only
  std::shared_ptr<detail::CheckpointCounters> counters;  // the module's
  std::vector<size_t> differentiable_outputs;    // node input k = region output tensor differentiable_outputs[k]
  size_t n_outputs = 0;
  // Submodules are sharded: no parameter edges; backward accumulates into every leaf (see the file comment).
  bool accumulate_leaves = false;

  std::string name() const override { return "fsdp::CheckpointBackward"; }

  void release_variables() override {
    forward = nullptr;
    inputs.clear();
    matmuls.reset();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    TORCH_CHECK(forward, "fsdp: backward through the checkpointed forward of ", module_name, " a second time, but its ",
                "saved inputs were freed by the first backward; pass retain_graph=true to the first one");
    for (size_t i = 0; i < inputs.size(); ++i) {
      TORCH_CHECK(!inputs[i].defined() || static_cast<int64_t>(inputs[i]._version()) == input_versions[i],
                  "fsdp: input tensor ", i, " of the checkpointed module ", module_name, " was modified in place after ",
                  "the module's forward began; the recomputation in backward would see the new values");
    }
    nn::TensorList detached(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (!inputs[i].defined()) continue;
      detached[i] = inputs[i].detach();
      if (input_requires_grad[i]) detached[i].requires_grad_(true);
    }
    // The engine runs this with grad mode = create_graph; the recomputation always records a graph.
    const bool create_graph = c10::GradMode::is_enabled();
    nn::TensorList outs;
    {
      detail::RngFork fork(rng, device);
      at::AutoGradMode grad_on(true);
      detail::SelectiveOpScope scope(matmuls.get(), detail::SelectiveOpMode::Replay);
      PassScope pass(CheckpointPass::Recompute);
      outs = forward(detached);
      scope.check_complete();
    }
    ++counters->recomputes;
    TORCH_CHECK(outs.size() == n_outputs, "fsdp: the recomputed forward of ", module_name, " returned ", outs.size(),
                " tensors, the original forward ", n_outputs);

    torch::autograd::variable_list roots, root_grads;
    for (size_t k = 0; k < differentiable_outputs.size() && k < grads.size(); ++k) {
      const at::Tensor& out = outs[differentiable_outputs[k]];
      if (!grads[k].defined() || !out.defined() || !out.requires_grad()) continue;
      roots.push_back(out);
      root_grads.push_back(grads[k]);
    }
    torch::autograd::variable_list result(num_outputs());
    torch::autograd::variable_list targets;
    std::vector<size_t> slots;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (input_requires_grad[i] && task_should_compute_output(i)) {
        targets.push_back(detached[i]);
        slots.push_back(i);
      }
    }
    for (size_t j = 0; j < params.size(); ++j) {
      const size_t slot = inputs.size() + j;
      if (next_edge(slot).is_valid() && task_should_compute_output(slot)) {
        targets.push_back(params[j]);
        slots.push_back(slot);
      }
    }
    if (accumulate_leaves) {
      if (roots.empty()) return result;
      {
        detail::NestedBackwardScope nested;
        torch::autograd::backward(roots, root_grads, /*retain_graph=*/create_graph, create_graph);
      }
      for (size_t i = 0; i < inputs.size(); ++i) {
        if (input_requires_grad[i] && task_should_compute_output(i)) result[i] = detached[i].grad();
      }
      return result;
    }
    if (roots.empty() || targets.empty()) return result;
    auto g = torch::autograd::grad(roots, targets, root_grads, /*retain_graph=*/create_graph, create_graph,
                                   /*allow_unused=*/true);
    for (size_t k = 0; k < slots.size(); ++k) result[slots[k]] = g[k];
    return result;
  }
};

std::optional<c10::Device> region_device(const nn::TensorList& inputs, const std::vector<at::Tensor>& params) {
  for (const std::vector<at::Tensor>* list : std::initializer_list<const std::vector<at::Tensor>*>{&inputs, &params}) {
    for (const auto& t : *list) {
      if (t.defined() && !t.device().is_cpu()) return t.device();
    }
  }
  return std::nullopt;
}

// The path of the first descendant of `module` that was given to fully_shard, if any.
std::optional<std::string> sharded_descendant(torch::nn::Module& module) {
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    if (fsdp_module(*item.value())) return item.key();
  }
  return std::nullopt;
}

nn::TensorList checkpoint_forward(torch::nn::Module& module, const nn::TensorList& inputs,
                                  const nn::ForwardFunction& forward, const CheckpointOptions& options,
                                  const std::shared_ptr<detail::CheckpointCounters>& counters) {
  if (!c10::GradMode::is_enabled()) return forward(inputs);  // evaluation: nothing to save or recompute
  const std::optional<std::string> sharded = sharded_descendant(module);
  // SelectiveOp's recording forward runs with gradients on and then drops its graph: the sharded submodules'
  // FSDP hooks would count backward uses that never come.
  TORCH_CHECK(!sharded || options.policy == CheckpointPolicy::Full, "fsdp: the checkpointed module ", module.name(),
              " contains '", *sharded, "', which was given to fully_shard; op-level selective checkpointing ",
              "(CheckpointPolicy::SelectiveOp) of a module with sharded submodules is not supported: use ",
              "CheckpointPolicy::Full, or checkpoint the sharded submodules themselves");
  std::vector<at::Tensor> params = module.parameters(/*recurse=*/true);
  bool needs_grad = false;
  for (const std::vector<at::Tensor>* list : std::initializer_list<const std::vector<at::Tensor>*>{&inputs, &params}) {
    for (const auto& t : *list) needs_grad = needs_grad || (t.defined() && t.requires_grad());
  }
  if (!needs_grad) return forward(inputs);

  auto node = detail::make_autograd_node<CheckpointNode>();
  node->module_name = module.name();
  node->counters = counters;
  node->device = region_device(inputs, params);
  if (options.preserve_rng_state) node->rng = detail::RngStash::capture(node->device);
  node->inputs = inputs;
  for (const auto& t : inputs) {
    node->input_versions.push_back(t.defined() ? static_cast<int64_t>(t._version()) : 0);
    node->input_requires_grad.push_back(t.defined() && t.requires_grad());
  }

  nn::TensorList outputs;
  if (options.policy == CheckpointPolicy::SelectiveOp) {
    // Forward with gradients on, on detached inputs, exactly as the recomputation will run it: ops such as
    // matmul choose their decomposition by requires_grad, and the two passes must count the same matmuls. The
    // graph built here is dropped with the outputs' history below.
    node->matmuls = std::make_shared<detail::MatmulStash>();
    node->matmuls->counters = counters;
    nn::TensorList detached(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (!inputs[i].defined()) continue;
      detached[i] = inputs[i].detach();
      if (node->input_requires_grad[i]) detached[i].requires_grad_(true);
    }
    detail::SelectiveOpScope scope(node->matmuls.get(), detail::SelectiveOpMode::Record);
    PassScope pass(CheckpointPass::Forward);
    outputs = forward(detached);
  } else {
    at::NoGradGuard no_grad;
    detail::SelectiveOpScope hide(nullptr, detail::SelectiveOpMode::Record);  // not counted by an enclosing op SAC
    PassScope pass(CheckpointPass::Forward);
    outputs = forward(inputs);
  }
  ++counters->forwards;

  torch::autograd::edge_list edges = torch::autograd::collect_next_edges(inputs);
  if (sharded) {
    // No edges to the (sharded, at this point) parameters: their gradients accumulate in the node's backward.
    node->accumulate_leaves = true;
  } else {
    for (auto& e : torch::autograd::collect_next_edges(params)) edges.push_back(std::move(e));
    node->params = std::move(params);
  }
  node->set_next_edges(std::move(edges));
  node->n_outputs = outputs.size();
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].defined()) continue;
    // New tensor objects: an output may be an input (or share its object with another output).
    outputs[i] = outputs[i].detach();
    if (!is_differentiable(outputs[i])) continue;
    node->differentiable_outputs.push_back(i);
    torch::autograd::set_history(outputs[i], node);
  }
  node->forward = forward;
  return outputs;
}
}  // namespace

void checkpoint_module(const std::shared_ptr<torch::nn::Module>& module, const CheckpointOptions& options) {
  TORCH_CHECK(module, "fsdp::checkpoint_module: null module");
  TORCH_CHECK(!is_checkpointed(*module), "fsdp::checkpoint_module: ", module->name(), " is already checkpointed");
  if (options.policy == CheckpointPolicy::SelectiveOp) detail::ensure_selective_op_kernels();
  // The wrapper must not capture the module (the module owns the wrapper).
  auto counters = std::make_shared<detail::CheckpointCounters>();
  nn::register_forward_wrapper(
      *module,
      [options, counters](torch::nn::Module& m, const nn::TensorList& inputs, const nn::ForwardFunction& forward) {
        return checkpoint_forward(m, inputs, forward, options, counters);
      },
      kWrapperTag, counters);
}

bool is_checkpointed(const torch::nn::Module& module) { return nn::has_forward_wrapper(module, kWrapperTag); }

CheckpointPass current_checkpoint_pass() { return tls_pass; }

size_t checkpoint_every_kth(const std::vector<std::shared_ptr<torch::nn::Module>>& modules, int64_t k,
                            const CheckpointOptions& options) {
  TORCH_CHECK(k >= 0, "fsdp::checkpoint_every_kth: k must be >= 0 (0 = every module), got ", k);
  size_t n = 0;
  for (size_t i = 0; i < modules.size(); ++i) {
    if (k > 1 && (static_cast<int64_t>(i) + 1) % k != 0) continue;
    checkpoint_module(modules[i], options);
    ++n;
  }
  return n;
}

namespace {
// The counters of every checkpointed module in `root`'s tree (root included).
std::vector<std::shared_ptr<detail::CheckpointCounters>> counters_in(const torch::nn::Module& root) {
  std::vector<std::shared_ptr<detail::CheckpointCounters>> found;
  auto visit = [&](const torch::nn::Module& m) {
    if (auto state = nn::forward_wrapper_state(m, kWrapperTag)) {
      found.push_back(std::static_pointer_cast<detail::CheckpointCounters>(state));
    }
  };
  visit(root);
  for (const auto& child : root.modules(/*include_self=*/false)) visit(*child);
  return found;
}
}  // namespace

CheckpointStats checkpoint_stats(const torch::nn::Module& root) {
  CheckpointStats total;
  for (const auto& c : counters_in(root)) {
    total.forwards += c->forwards.load();
    total.recomputes += c->recomputes.load();
    total.mm_saved += c->mm_saved.load();
    total.mm_reused += c->mm_reused.load();
    total.mm_recomputed += c->mm_recomputed.load();
  }
  return total;
}

void reset_checkpoint_stats(const torch::nn::Module& root) {
  for (const auto& c : counters_in(root)) {
    c->forwards = 0;
    c->recomputes = 0;
    c->mm_saved = 0;
    c->mm_reused = 0;
    c->mm_recomputed = 0;
  }
}

}  // namespace fsdp
