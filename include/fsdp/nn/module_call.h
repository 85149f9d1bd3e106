#pragma once
// Forward hooks for libtorch modules: the C++ counterpart of Python's `module(x)` (which runs
// module._forward_pre_hooks / _forward_hooks) as opposed to `module.forward(x)` (which runs none).
//
// libtorch modules have no forward hooks, so the rule is: a module that may carry hooks (any module given
// to fsdp::fully_shard, activation checkpointing, ...) is invoked through fsdp::nn::call(module, args...)
// instead of module->forward(args...). Model code needs nothing else: call() on a module without hooks is
// exactly forward(). Calling forward() directly on a module that has hooks is what fully_shard reports as an
// error (see docs/hooks.md).
//
// Hooks see the tensors among the arguments and results as a flat list (tensors, optionals, vectors, tuples
// and pairs of those are walked recursively; other types pass through untouched), and may replace them.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace fsdp::nn {

using TensorList = std::vector<at::Tensor>;
// Runs before forward; may replace input tensors (e.g. cast them, or wrap them in an autograd function).
using ForwardPreHook = std::function<void(torch::nn::Module& module, TensorList& inputs)>;
// Runs after forward; may replace output tensors.
using ForwardHook = std::function<void(torch::nn::Module& module, const TensorList& inputs, TensorList& outputs)>;

// Removes its hook when remove() is called (not on destruction: hooks usually live as long as the module).
class HookHandle {
 public:
  HookHandle() = default;
  HookHandle(std::weak_ptr<torch::nn::Module> store, uint64_t id) : store_(std::move(store)), id_(id) {}
  void remove();

 private:
  std::weak_ptr<torch::nn::Module> store_;
  uint64_t id_ = 0;
};

// prepend=true runs the hook before the ones already registered.
HookHandle register_forward_pre_hook(torch::nn::Module& module, ForwardPreHook hook, bool prepend = false);
HookHandle register_forward_hook(torch::nn::Module& module, ForwardHook hook, bool prepend = false);
bool has_forward_hooks(const torch::nn::Module& module);

// Called (by call()) around forward; exposed for callers that dispatch forward themselves.
void run_forward_pre_hooks(torch::nn::Module& module, TensorList& inputs);
void run_forward_hooks(torch::nn::Module& module, const TensorList& inputs, TensorList& outputs);

namespace detail {
// Visit every at::Tensor inside a value (recursively through common containers).
template <class T, class F> void for_each_tensor(T& value, F&& f);

template <class T> struct is_vector : std::false_type {};
template <class T, class A> struct is_vector<std::vector<T, A>> : std::true_type {};
template <class T> struct is_optional : std::false_type {};
template <class T> struct is_optional<std::optional<T>> : std::true_type {};
template <class T> struct is_tuple_like : std::false_type {};
template <class... T> struct is_tuple_like<std::tuple<T...>> : std::true_type {};
template <class A, class B> struct is_tuple_like<std::pair<A, B>> : std::true_type {};

template <class T, class F>
void for_each_tensor(T& value, F&& f) {
  using U = std::decay_t<T>;
  if constexpr (std::is_base_of_v<at::TensorBase, U>) {
    f(static_cast<at::Tensor&>(value));
  } else if constexpr (is_vector<U>::value) {
    for (auto& v : value) for_each_tensor(v, f);
  } else if constexpr (is_optional<U>::value) {
    if (value.has_value()) for_each_tensor(*value, f);
  } else if constexpr (is_tuple_like<U>::value) {
    std::apply([&](auto&... elems) { (for_each_tensor(elems, f), ...); }, value);
  }
}

template <class... Ts>
TensorList gather_tensors(std::tuple<Ts...>& values) {
  TensorList out;
  for_each_tensor(values, [&](at::Tensor& t) { out.push_back(t); });
  return out;
}

template <class T>
void scatter_tensors(T& values, const TensorList& tensors) {
  size_t i = 0;
  for_each_tensor(values, [&](at::Tensor& t) { t = tensors.at(i++); });
}
}  // namespace detail

// Invoke module->forward(args...) with the module's forward hooks around it.
// `module` is a ModuleHolder (torch::nn::Linear, TORCH_MODULE types) or a std::shared_ptr<SomeModuleImpl>.
template <class ModulePtr, class... Args>
auto call(ModulePtr& module, Args&&... args) {
  torch::nn::Module& base = *module;
  if (!has_forward_hooks(base)) return module->forward(std::forward<Args>(args)...);
  // Hooks may replace tensors, so the arguments are copied (tensors are handles: the copy is cheap).
  std::tuple<std::decay_t<Args>...> arg_values(std::forward<Args>(args)...);
  TensorList inputs = detail::gather_tensors(arg_values);
  const size_t n_inputs = inputs.size();
  run_forward_pre_hooks(base, inputs);
  TORCH_CHECK(inputs.size() == n_inputs, "fsdp::nn::call: a forward pre-hook changed the number of input tensors");
  detail::scatter_tensors(arg_values, inputs);
  auto result = std::apply([&](auto&... a) { return module->forward(a...); }, arg_values);
  TensorList outputs;
  detail::for_each_tensor(result, [&](at::Tensor& t) { outputs.push_back(t); });
  const size_t n_outputs = outputs.size();
  run_forward_hooks(base, inputs, outputs);
  TORCH_CHECK(outputs.size() == n_outputs, "fsdp::nn::call: a forward hook changed the number of output tensors");
  detail::scatter_tensors(result, outputs);
  return result;
}

}  // namespace fsdp::nn
