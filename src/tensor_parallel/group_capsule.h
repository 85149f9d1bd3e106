#pragma once
// A process group carried in an autograd context (custom autograd functions of the parallel layer: tensor- and
// expert-parallel collectives), so backward reaches the same group even after the caller's handles are gone.

#include <fsdp/process_group.h>

#include <ATen/core/ivalue.h>
#include <torch/autograd.h>
#include <torch/custom_class.h>

#include <utility>

namespace fsdp::detail {

struct GroupCapsule : torch::CustomClassHolder {
  explicit GroupCapsule(ProcessGroupPtr g) : group(std::move(g)) {}
  ProcessGroupPtr group;
};

inline void save_group(torch::autograd::AutogradContext* ctx, const ProcessGroupPtr& group) {
  ctx->saved_data["group"] = at::IValue::make_capsule(c10::make_intrusive<GroupCapsule>(group));
}

inline ProcessGroupPtr saved_group(torch::autograd::AutogradContext* ctx) {
  auto holder = ctx->saved_data.at("group").toCapsule();
  return c10::static_intrusive_pointer_cast<GroupCapsule>(holder)->group;
}

}  // namespace fsdp::detail
