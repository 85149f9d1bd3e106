#include "pipeline/split_backward.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace fsdp::pipeline_detail {
namespace {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;
// c10::intrusive_ptr in libtorch 2.13, std::shared_ptr in 2.11 (src/autograd/make_node.h).
using NodePtr = decltype(Edge::function);

// Keeps the gradients that reach a boundary node during I (the pre-hook sees the node's incoming gradients).
struct CaptureGrads : torch::autograd::FunctionPreHook {
  explicit CaptureGrads(std::shared_ptr<variable_list> slot) : slot_(std::move(slot)) {}
  variable_list operator()(const variable_list& grads) override {
    if (slot_->empty()) *slot_ = grads;  // W may run the node again: keep I's gradients
    return grads;
  }
  std::shared_ptr<variable_list> slot_;
};

struct Boundary {
  NodePtr node;
  std::vector<size_t> params;                // indices into the parameter list, reached off the input chain
  std::shared_ptr<variable_list> captured;   // what reached the node during I
};

}  // namespace

struct SplitBackward::Impl {
  at::Tensor root, grad;
  std::vector<at::Tensor> inputs, params;
  std::vector<Boundary> boundaries;
  bool fallback = false;  // W runs the whole backward to the parameters
  bool input_done = false, weight_done = false;

  // Walks the graph below the root once: which nodes reach an input, which parameters each node reaches, and
  // the boundary nodes (on the input chain, with children that reach parameters off it).
  void plan() {
    if (inputs.empty()) {
      fallback = true;  // the first stage: nothing upstream, I has no work; W is the whole backward
      return;
    }
    std::unordered_map<const Node*, size_t> param_of;  // a parameter's AccumulateGrad -> its index
    for (size_t i = 0; i < params.size(); ++i) {
      if (auto acc = torch::autograd::impl::try_get_grad_accumulator(params[i])) param_of[acc.get()] = i;
    }
    std::unordered_set<const Node*> input_nodes;
    for (const auto& x : inputs) {
      if (auto acc = torch::autograd::impl::try_get_grad_accumulator(x)) input_nodes.insert(acc.get());
    }
    const NodePtr root_fn = root.grad_fn();
    TORCH_CHECK(root_fn, "fsdp pipeline: the stage output has no gradient function (nothing in the stage requires ",
                "grad), so it cannot be backpropagated");
    // Post-order over the graph (iterative: stages may be deep).
    struct Info {
      bool reaches_input = false;
      std::vector<size_t> params;  // sorted, unique
    };
    std::unordered_map<const Node*, Info> info;
    std::unordered_map<const Node*, NodePtr> owner;  // keeps a pointer to every visited node
    std::vector<std::pair<NodePtr, bool>> stack{{root_fn, false}};
    std::vector<NodePtr> order;
    while (!stack.empty()) {
      auto [node, expanded] = stack.back();
      stack.pop_back();
      if (expanded) {
        order.push_back(node);
        continue;
      }
      if (owner.count(node.get())) continue;
      owner[node.get()] = node;
      stack.push_back({node, true});
      for (const Edge& e : node->next_edges()) {
        if (e.function && !owner.count(e.function.get())) stack.push_back({e.function, false});
      }
    }
    for (const NodePtr& node : order) {  // children before parents
      Info& in = info[node.get()];
      if (input_nodes.count(node.get())) in.reaches_input = true;
      if (auto it = param_of.find(node.get()); it != param_of.end()) in.params.push_back(it->second);
      for (const Edge& e : node->next_edges()) {
        if (!e.function) continue;
        const Info& child = info[e.function.get()];
        in.reaches_input = in.reaches_input || child.reaches_input;
        in.params.insert(in.params.end(), child.params.begin(), child.params.end());
      }
      std::sort(in.params.begin(), in.params.end());
      in.params.erase(std::unique(in.params.begin(), in.params.end()), in.params.end());
    }
    for (const NodePtr& node : order) {
      const Info& in = info[node.get()];
      if (!in.reaches_input) continue;
      std::vector<size_t> off_chain, on_chain;
      for (const Edge& e : node->next_edges()) {
        if (!e.function) continue;
        const Info& child = info[e.function.get()];
        auto& into = child.reaches_input ? on_chain : off_chain;
        into.insert(into.end(), child.params.begin(), child.params.end());
      }
      if (off_chain.empty()) continue;
      std::sort(off_chain.begin(), off_chain.end());
      off_chain.erase(std::unique(off_chain.begin(), off_chain.end()), off_chain.end());
      std::sort(on_chain.begin(), on_chain.end());
      for (size_t p : off_chain) {
        // Reachable also through the input chain: the engine started here would run that chain again (and
        // count its share twice, since that chain has boundary nodes of its own).
        if (std::binary_search(on_chain.begin(), on_chain.end(), p)) fallback = true;
      }
      if (fallback) break;
      auto slot = std::make_shared<variable_list>();
      node->add_pre_hook(std::make_unique<CaptureGrads>(slot));
      boundaries.push_back({node, std::move(off_chain), std::move(slot)});
    }
    if (fallback) boundaries.clear();
  }
};

SplitBackward::SplitBackward(at::Tensor root, at::Tensor grad, std::vector<at::Tensor> inputs,
                             std::vector<at::Tensor> params)
    : impl_(std::make_unique<Impl>()) {
  impl_->root = std::move(root);
  impl_->grad = std::move(grad);
  impl_->inputs = std::move(inputs);
  for (auto& p : params) {
    if (p.requires_grad()) impl_->params.push_back(std::move(p));
  }
  impl_->plan();
}

SplitBackward::~SplitBackward() = default;

bool SplitBackward::fallback_used() const { return impl_->fallback; }

std::vector<at::Tensor> SplitBackward::backward_input() {
  Impl& s = *impl_;
  TORCH_CHECK(!s.input_done, "fsdp pipeline: backward_input (I) ran twice for one microbatch");
  s.input_done = true;
  if (s.inputs.empty()) return {};
  variable_list grad_outputs;
  if (s.grad.defined()) grad_outputs.push_back(s.grad);
  // retain_graph: W runs on the same graph.
  return torch::autograd::grad({s.root}, s.inputs, grad_outputs, /*retain_graph=*/true, /*create_graph=*/false,
                               /*allow_unused=*/true);
}

void SplitBackward::backward_weight() {
  Impl& s = *impl_;
  TORCH_CHECK(s.input_done || s.inputs.empty(), "fsdp pipeline: backward_weight (W) before backward_input (I)");
  TORCH_CHECK(!s.weight_done, "fsdp pipeline: backward_weight (W) ran twice for one microbatch");
  s.weight_done = true;
  if (s.params.empty()) return;
  if (s.fallback) {
    variable_list grad_outputs;
    if (s.grad.defined()) grad_outputs.push_back(s.grad);
    // Accumulates into .grad of the parameters only (the inputs' gradients were sent by I).
    torch::autograd::backward({s.root}, grad_outputs, /*retain_graph=*/false, /*create_graph=*/false, s.params);
  } else {
    c10::NoGradGuard no_grad_mode_for_results;  // the engine computes first-order gradients
    auto& engine = torch::autograd::Engine::get_default_engine();
    for (Boundary& b : s.boundaries) {
      const variable_list& got = *b.captured;
      torch::autograd::edge_list roots;
      variable_list root_grads;
      for (size_t i = 0; i < got.size(); ++i) {
        if (!got[i].defined()) continue;
        roots.emplace_back(b.node, static_cast<uint32_t>(i));
        root_grads.push_back(got[i]);
      }
      if (roots.empty()) continue;  // nothing flowed through this node in I (e.g. an unused branch)
      torch::autograd::edge_list outputs;
      for (size_t p : b.params) outputs.push_back(torch::autograd::impl::gradient_edge(s.params[p]));
      variable_list grads = engine.execute(roots, root_grads, /*keep_graph=*/true, /*create_graph=*/false,
                                           /*accumulate_grad=*/false, outputs);
      for (size_t k = 0; k < b.params.size(); ++k) {
        if (!grads[k].defined()) continue;
        at::Tensor& param = s.params[b.params[k]];
        if (param.grad().defined()) {
          param.mutable_grad().add_(grads[k]);
        } else {
          // A fresh tensor in the parameter's layout, as AccumulateGrad would store it: the engine's result may be
          // a view (a transposed weight's gradient), which zero_grad() could not detach in place.
          param.mutable_grad() = at::empty_like(param, at::MemoryFormat::Preserve).copy_(grads[k]);
        }
      }
    }
  }
  // The graph and what the hooks kept go with this microbatch.
  s.boundaries.clear();
  s.root = at::Tensor();
  s.grad = at::Tensor();
  s.inputs.clear();
}

}  // namespace fsdp::pipeline_detail
