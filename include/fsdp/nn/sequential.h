#pragma once
// fsdp::nn::Sequential: torch::nn::Sequential whose forward runs every element through fsdp::nn::call, so
// elements given to fully_shard get their hooks (libtorch's Sequential::forward calls each element's forward()
// directly, and fully_shard rejects a torch::nn::Sequential with sharded elements).
//
// A drop-in: the same constructors, push_back/extend/at/ptr/[]/size/iteration and templated
// forward<Return = at::Tensor>(args...), and the same element names ("0", "1", ... or the names given), so
// parameter FQNs and state-dict keys are those of the torch::nn::Sequential it replaces. An existing
// torch::nn::Sequential converts with fsdp::nn::Sequential(torch_sequential): the elements are taken over (the
// same module objects, not copies) under their names. Convert before fully_shard.
//
// Like any module, a Sequential that is itself given to fully_shard is invoked as fsdp::nn::call(seq, x).

#include <fsdp/nn/module_call.h>

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/named_any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>
#include <torch/ordered_dict.h>

#include <c10/util/Type.h>

#include <initializer_list>
#include <memory>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace fsdp::nn {

namespace detail {
template <class... Ts> struct is_single_torch_sequential : std::false_type {};
template <class T>
struct is_single_torch_sequential<T> : std::is_same<std::decay_t<T>, torch::nn::Sequential> {};
}  // namespace detail

class SequentialImpl : public torch::nn::Cloneable<SequentialImpl> {
 public:
  using Iterator = std::vector<torch::nn::AnyModule>::iterator;
  using ConstIterator = std::vector<torch::nn::AnyModule>::const_iterator;

  SequentialImpl() = default;

  // Elements (holders, shared_ptrs, module values or AnyModules), named "0", "1", ...
  template <typename... Modules,
            typename = std::enable_if_t<!detail::is_single_torch_sequential<Modules...>::value>>
  explicit SequentialImpl(Modules&&... modules) {
    modules_.reserve(sizeof...(Modules));
    push_back(std::forward<Modules>(modules)...);
  }

  explicit SequentialImpl(torch::OrderedDict<std::string, torch::nn::AnyModule>&& ordered_dict);
  explicit SequentialImpl(std::initializer_list<torch::nn::NamedAnyModule> named_modules);

  // Takes over the elements of libtorch's Sequential with their names (the module objects are shared, not
  // copied). `sequential` must not have been given to fully_shard or carry hooks: convert before sharding.
  explicit SequentialImpl(const torch::nn::Sequential& sequential);

  // Clones the elements (under their names), like torch::nn::Sequential::clone. A clone is never sharded.
  std::shared_ptr<torch::nn::Module> clone(const std::optional<torch::Device>& device = std::nullopt) const override;
  void reset() override {}
  void pretty_print(std::ostream& stream) const override { stream << "fsdp::nn::Sequential"; }

  // Runs the elements in order, each through fsdp::nn::call (its forward hooks, if any, around its forward):
  // the first gets `inputs`, every next one the previous one's result. Returns the last result as `Return`.
  template <typename Return = at::Tensor, typename... InputTypes>
  Return forward(InputTypes&&... inputs) {
    TORCH_CHECK(!is_empty(), "Cannot call forward() on an empty fsdp::nn::Sequential");
    auto it = modules_.begin();
    torch::nn::AnyValue value = call_any_value(*it, std::forward<InputTypes>(inputs)...);
    for (++it; it != modules_.end(); ++it) value = call_any_value(*it, std::move(value));
    if (auto* result = value.template try_get<Return>()) return std::move(*result);
    TORCH_CHECK(false, "fsdp::nn::Sequential: the last element returned ", c10::demangle(value.type_info().name()),
                ", but you asked for ", c10::demangle(typeid(Return).name()));
  }

  template <typename ModuleType>
  void push_back(std::shared_ptr<ModuleType> module_ptr) {
    push_back(std::to_string(modules_.size()), std::move(module_ptr));
  }
  template <typename ModuleType>
  void push_back(std::string name, std::shared_ptr<ModuleType> module_ptr) {
    push_back(std::move(name), torch::nn::AnyModule(std::move(module_ptr)));
  }
  template <typename M, typename = torch::detail::enable_if_module_t<M>>
  void push_back(M&& module) {
    push_back(std::to_string(modules_.size()), std::forward<M>(module));
  }
  template <typename M, typename = torch::detail::enable_if_module_t<M>>
  void push_back(std::string name, M&& module) {
    using Type = typename std::remove_reference_t<M>;
    push_back(std::move(name), std::make_shared<Type>(std::forward<M>(module)));
  }
  template <typename M>
  void push_back(const torch::nn::ModuleHolder<M>& module_holder) {
    push_back(std::to_string(modules_.size()), module_holder);
  }
  template <typename M>
  void push_back(std::string name, const torch::nn::ModuleHolder<M>& module_holder) {
    push_back(std::move(name), module_holder.ptr());
  }
  void push_back(torch::nn::AnyModule any_module) {
    push_back(std::to_string(modules_.size()), std::move(any_module));
  }
  void push_back(std::string name, torch::nn::AnyModule any_module);

  template <typename Container>
  void extend(const Container& container) {
    for (const auto& module : container) push_back(module);
  }

  Iterator begin() { return modules_.begin(); }
  ConstIterator begin() const { return modules_.begin(); }
  Iterator end() { return modules_.end(); }
  ConstIterator end() const { return modules_.end(); }

  template <typename T>
  T& at(size_t index) {
    TORCH_CHECK(index < size(), "Index out of range");
    return modules_[index].get<T>();
  }
  template <typename T>
  const T& at(size_t index) const {
    TORCH_CHECK(index < size(), "Index out of range");
    return modules_[index].get<T>();
  }
  std::shared_ptr<torch::nn::Module> ptr(size_t index) const {
    TORCH_CHECK(index < size(), "Index out of range");
    return modules_[index].ptr();
  }
  template <typename T>
  std::shared_ptr<T> ptr(size_t index) const {
    TORCH_CHECK(index < size(), "Index out of range");
    return modules_[index].ptr<T>();
  }
  std::shared_ptr<torch::nn::Module> operator[](size_t index) const { return ptr(index); }
  // The element itself, as the AnyModule that forward dispatches through (fsdp::nn::call(seq->any(i), x)).
  const torch::nn::AnyModule& any(size_t index) const {
    TORCH_CHECK(index < size(), "Index out of range");
    return modules_[index];
  }
  // The element's name (its FQN component): "0", "1", ... unless named.
  const std::string& name_of(size_t index) const {
    TORCH_CHECK(index < size(), "Index out of range");
    return names_[index];
  }

  size_t size() const noexcept { return modules_.size(); }
  bool is_empty() const noexcept { return modules_.empty(); }

 private:
  template <typename First, typename Second, typename... Rest,
            typename = std::enable_if_t<!std::is_same_v<First, std::string> &&
                                        !std::is_same_v<std::decay_t<First>, std::decay_t<const char (&)[]>>>>
  void push_back(First&& first, Second&& second, Rest&&... rest) {
    push_back(std::forward<First>(first));
    push_back(std::forward<Second>(second), std::forward<Rest>(rest)...);
  }
  void push_back() {}

  std::vector<torch::nn::AnyModule> modules_;
  std::vector<std::string> names_;
};

// The holder, as torch::nn::Sequential is for torch::nn::SequentialImpl.
class Sequential : public torch::nn::ModuleHolder<SequentialImpl> {
 public:
  using torch::nn::ModuleHolder<SequentialImpl>::ModuleHolder;
  Sequential() = default;
  Sequential(std::initializer_list<torch::nn::NamedAnyModule> named_modules)
      : ModuleHolder(std::make_shared<SequentialImpl>(named_modules)) {}
  // From libtorch's Sequential (see SequentialImpl(const torch::nn::Sequential&)).
  Sequential(const torch::nn::Sequential& sequential)  // NOLINT: implicit, a drop-in
      : ModuleHolder(std::make_shared<SequentialImpl>(sequential)) {}
};

}  // namespace fsdp::nn
