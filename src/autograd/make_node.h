#pragma once
// Creating a custom autograd Node across libtorch releases. libtorch 2.13 (this project's CPU wheel) owns
// nodes through c10::intrusive_ptr; 2.11 (the lent GPU machines' PyTorch) through std::shared_ptr. The
// ownership model is detected from Node itself, so the same code compiles against both
// (scripts/cuda-compile-check.sh builds against 2.11).

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace fsdp::detail {

template <typename T, typename... Args>
auto make_autograd_node(Args&&... args) {
  static_assert(std::is_base_of_v<torch::autograd::Node, T>, "make_autograd_node: T must derive from Node");
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, torch::autograd::Node>) {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  } else {
    return std::make_shared<T>(std::forward<Args>(args)...);
  }
}

}  // namespace fsdp::detail
