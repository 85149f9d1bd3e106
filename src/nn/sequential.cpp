#include <fsdp/nn/sequential.h>

#include <unordered_set>

namespace fsdp::nn {

SequentialImpl::SequentialImpl(torch::OrderedDict<std::string, torch::nn::AnyModule>&& ordered_dict) {
  modules_.reserve(ordered_dict.size());
  for (auto& item : ordered_dict) push_back(item.key(), std::move(item.value()));
}

SequentialImpl::SequentialImpl(std::initializer_list<torch::nn::NamedAnyModule> named_modules) {
  modules_.reserve(named_modules.size());
  for (const auto& named : named_modules) push_back(named.name(), named.module());
}

SequentialImpl::SequentialImpl(const torch::nn::Sequential& sequential) {
  TORCH_CHECK(!sequential.is_empty(), "fsdp::nn::Sequential: converting an empty torch::nn::Sequential holder");
  const torch::nn::SequentialImpl& source = *sequential;
  // fully_shard registers its forward hooks on every module it is given (FSDPState::attach), so "has hooks"
  // also covers "was given to fully_shard" without the nn layer knowing fully_shard (docs/architecture.md).
  TORCH_CHECK(!has_forward_hooks(source),
              "fsdp::nn::Sequential: the torch::nn::Sequential to convert was given to fully_shard (or has hooks); ",
              "convert it before fully_shard");
  // Element names: each element is a child registered under its name; match by identity, in order (the same
  // module may be an element twice, under two names).
  const auto children = source.named_children();
  std::unordered_set<std::string> used;
  modules_.reserve(source.size());
  for (const auto& element : source) {
    const torch::nn::Module* target = element.ptr().get();
    const std::string* name = nullptr;
    for (const auto& child : children) {
      if (child.value().get() == target && !used.count(child.key())) {
        name = &child.key();
        break;
      }
    }
    TORCH_CHECK(name != nullptr, "fsdp::nn::Sequential: an element of the torch::nn::Sequential is not registered ",
                "as its child");
    used.insert(*name);
    push_back(*name, element);  // a shallow copy: the same module object
  }
}

void SequentialImpl::push_back(std::string name, torch::nn::AnyModule any_module) {
  register_module(name, any_module.ptr());  // first: it rejects a duplicate or dotted name
  modules_.push_back(std::move(any_module));
  names_.push_back(std::move(name));
}

std::shared_ptr<torch::nn::Module> SequentialImpl::clone(const std::optional<torch::Device>& device) const {
  auto copy = std::make_shared<SequentialImpl>();
  for (size_t i = 0; i < modules_.size(); ++i) copy->push_back(names_[i], modules_[i].clone(device));
  return copy;
}

}  // namespace fsdp::nn
