#pragma once
// fsdp::nn::call_method — run a method other than forward with the module's forward hooks around it: the C++
// form of PyTorch's register_fsdp_forward_method(module, "generate"). Python patches the method so that every
// call goes through FSDP's pre-/post-forward; C++ cannot patch a member function, so the call site says it:
//
//   auto tokens = fsdp::nn::call_method(model, &TransformerImpl::generate, prompt, 32);
//   auto loss   = fsdp::nn::call_method(model, &TransformerImpl::loss, x, y);
//
// The method then runs exactly like fsdp::nn::call runs forward: the pre-hooks see (and may replace) the
// tensor arguments — FSDP gathers the module's parameters, casts inputs under mixed precision and sets up its
// backward hooks —, the post-hooks see the tensors of the result, and a throwing method runs the exception
// hooks. Inside the method, the module's own parameters are full; sharded submodules are still invoked with
// fsdp::nn::call. (Forward wrappers such as activation checkpointing wrap forward only.)

#include <fsdp/nn/module_call.h>

#include <tuple>
#include <type_traits>
#include <utility>

namespace fsdp::nn {

// `module`: any form fsdp::nn::call accepts except AnyModule (a holder, std::shared_ptr<Impl>, Impl*, Impl&);
// `method`: a member function of Impl (or of a base of it), e.g. &Impl::generate.
template <class M, class Method, class... Args>
auto call_method(M&& module, Method method, Args&&... args) {
  static_assert(std::is_member_function_pointer_v<Method>, "fsdp::nn::call_method: expects &Impl::method");
  auto& impl = detail::module_object(module);
  torch::nn::Module& base = impl;
  if (!has_forward_hooks(base)) return (impl.*method)(std::forward<Args>(args)...);
  detail::check_tensors_visible<decltype((impl.*method)(std::declval<std::decay_t<Args>&>()...)),
                                std::decay_t<Args>...>("fsdp::nn::call_method", base);
  // Hooks may replace tensors, so the arguments are copied (tensors are handles: the copy is cheap).
  std::tuple<std::decay_t<Args>...> arg_values(std::forward<Args>(args)...);
  TensorList inputs = detail::gather_tensors(arg_values);
  const size_t n_inputs = inputs.size();
  run_forward_pre_hooks(base, inputs);
  TORCH_CHECK(inputs.size() == n_inputs,
              "fsdp::nn::call_method: a forward pre-hook changed the number of input tensors");
  detail::scatter_tensors(arg_values, inputs);
  detail::ExceptionHookGuard guard(base);
  auto result = std::apply([&](auto&... a) { return (impl.*method)(a...); }, arg_values);
  TensorList outputs;
  detail::for_each_tensor(result, [&](at::Tensor& t) { outputs.push_back(t); });
  const size_t n_outputs = outputs.size();
  run_forward_hooks(base, inputs, outputs);
  guard.dismiss();
  TORCH_CHECK(outputs.size() == n_outputs,
              "fsdp::nn::call_method: a forward hook changed the number of output tensors");
  detail::scatter_tensors(result, outputs);
  return result;
}

}  // namespace fsdp::nn
