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
// Hooks see the tensors among the arguments and results as a flat list, and may replace them: tensors,
// std::optional, std::vector, std::array, std::tuple, std::pair, std::map and std::unordered_map (their
// values) are walked recursively, and a user type through fsdp::nn::TensorFields<T> (below). On a module with
// hooks, an argument or result type that may hold tensors the hooks cannot see is refused before the forward
// runs (see detail::hides_tensors for the rule and why).

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>
#include <c10/util/Type.h>

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <unordered_map>
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
// Runs when the module's forward (or a forward hook) throws, before the exception leaves call(): lets a hook
// owner undo what its pre-hook did (FSDP reshards and returns to idle). Exceptions from these hooks are dropped.
using ForwardExceptionHook = std::function<void(torch::nn::Module& module)>;
HookHandle register_forward_exception_hook(torch::nn::Module& module, ForwardExceptionHook hook);
void run_forward_exception_hooks(torch::nn::Module& module) noexcept;
bool has_forward_hooks(const torch::nn::Module& module);

// Called (by call()) around forward; exposed for callers that dispatch forward themselves.
void run_forward_pre_hooks(torch::nn::Module& module, TensorList& inputs);
void run_forward_hooks(torch::nn::Module& module, const TensorList& inputs, TensorList& outputs);

// Forward wrappers ("around forward"): what activation checkpointing needs — run the module's forward under its
// own autograd node, and run it again later (during backward). A wrapper gets the input tensors (after the
// pre-hooks) and a callable that runs the module's real forward on given input tensors; the callable keeps the
// module and the non-tensor arguments, so it may be called again after call() returned. The wrapper returns the
// output tensors (it may replace them; the post-hooks see those). The first registered wrapper is outermost.
// `tag` names the wrapper's owner (has_forward_wrapper). Wrapped modules must be owned by a std::shared_ptr
// (holders, register_module) and take copyable arguments.
using ForwardFunction = std::function<TensorList(const TensorList& inputs)>;
using ForwardWrapper =
    std::function<TensorList(torch::nn::Module& module, const TensorList& inputs, const ForwardFunction& forward)>;
// `state` (optional) is an object the wrapper's owner keeps with the module (activation checkpointing keeps its
// counters there); forward_wrapper_state(module, tag) hands it back, null when there is none.
HookHandle register_forward_wrapper(torch::nn::Module& module, ForwardWrapper wrapper, std::string tag,
                                    std::shared_ptr<void> state = nullptr);
bool has_forward_wrapper(const torch::nn::Module& module, const std::string& tag);
std::shared_ptr<void> forward_wrapper_state(const torch::nn::Module& module, const std::string& tag);
bool has_forward_wrappers(const torch::nn::Module& module);
// Runs `forward` inside every wrapper of the module (just `forward` when it has none).
TensorList run_forward_wrappers(torch::nn::Module& module, const TensorList& inputs, const ForwardFunction& forward);

// The way in for user types: specialize TensorFields for a struct (or class) that a module with hooks takes or
// returns, and call `visit` on each member that holds tensors — a tensor, any container call() walks, or
// another type with TensorFields. The hooks then see (and may replace) those tensors, in the order visited:
//
//   struct BlockOutput { at::Tensor hidden; std::vector<at::Tensor> aux; int64_t tokens; };
//   template <>
//   struct fsdp::nn::TensorFields<BlockOutput> {
//     template <class Visit>
//     static void visit(BlockOutput& out, Visit&& visit) { visit(out.hidden); visit(out.aux); }
//   };
//
// A type that holds no tensors (a config struct passed to forward) says so with an empty visit. The order must
// not depend on the values (the same fields every call): activation checkpointing matches the tensors of the
// recomputed forward to the original ones by position.
template <class T>
struct TensorFields;  // no primary definition: only specializations exist

namespace detail {
// Visit every at::Tensor inside a value (recursively through common containers).
template <class T, class F> void for_each_tensor(T& value, F&& f);

template <class T> struct is_vector : std::false_type {};
template <class T, class A> struct is_vector<std::vector<T, A>> : std::true_type {};
template <class T> struct is_std_array : std::false_type {};
template <class T, size_t N> struct is_std_array<std::array<T, N>> : std::true_type {};
template <class T> struct is_optional : std::false_type {};
template <class T> struct is_optional<std::optional<T>> : std::true_type {};
template <class T> struct is_tuple_like : std::false_type {};
template <class... T> struct is_tuple_like<std::tuple<T...>> : std::true_type {};
template <class A, class B> struct is_tuple_like<std::pair<A, B>> : std::true_type {};
template <class T> struct is_map : std::false_type {};
template <class K, class V, class C, class A> struct is_map<std::map<K, V, C, A>> : std::true_type {};
template <class K, class V, class H, class E, class A>
struct is_map<std::unordered_map<K, V, H, E, A>> : std::true_type {};

// Whether TensorFields<T> is specialized (with a usable visit).
struct ProbeVisit {
  template <class Field> void operator()(Field&) const {}
};
template <class T, class = void> struct has_tensor_fields : std::false_type {};
template <class T>
struct has_tensor_fields<T, std::void_t<decltype(TensorFields<T>::visit(std::declval<T&>(), std::declval<ProbeVisit>()))>>
    : std::true_type {};

// Types known to hold no tensor.
template <class U>
constexpr bool is_tensor_free_leaf() {
  return std::is_arithmetic_v<U> || std::is_enum_v<U> || std::is_same_v<U, std::string> ||
         std::is_same_v<U, std::string_view> || std::is_same_v<U, const char*> || std::is_same_v<U, std::nullptr_t> ||
         std::is_same_v<U, c10::Device> || std::is_same_v<U, c10::IntArrayRef>;
}

// The rule for what a module with hooks may take and return. A tensor the hooks cannot see is not a harmless
// omission: FSDP's post-forward hook arms the pre-backward gather on the output tensors it is shown, and frees
// the full parameters after forward; an output tensor it was not shown reaches backward with no gather before
// it, and autograd reads the freed storage ("setStorage: ... out of bounds for storage of size 0", naming no
// module). A hidden input misses its mixed-precision cast, and under activation checkpointing its gradient
// (it is kept as a non-tensor argument). So every component type must be either a tensor, a container call()
// walks, a type with TensorFields, or a type known to hold no tensor; anything else "hides tensors" and is
// refused when the module has hooks, before the pre-hooks run (nothing to undo), with the type named. Decided
// on the static type, not on the values: a run-time rule ("no tensor output seen") would also refuse a
// legitimate empty vector, and would miss an output that shows one tensor and hides another. On a module
// without hooks, call() is forward() and any type passes. Map keys are not walked (they identify entries; a
// tensor key is refused).
template <class T>
constexpr bool hides_tensors();
template <class Tuple, size_t... I>
constexpr bool any_hides_tensors(std::index_sequence<I...>) {
  return (false || ... || hides_tensors<std::tuple_element_t<I, Tuple>>());
}
template <class T>
constexpr bool hides_tensors() {
  using U = std::remove_cv_t<std::remove_reference_t<T>>;
  if constexpr (std::is_base_of_v<at::TensorBase, U> || has_tensor_fields<U>::value || is_tensor_free_leaf<U>()) {
    return false;
  } else if constexpr (is_vector<U>::value || is_optional<U>::value || is_std_array<U>::value) {
    return hides_tensors<typename U::value_type>();
  } else if constexpr (is_map<U>::value) {
    return std::is_base_of_v<at::TensorBase, typename U::key_type> || hides_tensors<typename U::mapped_type>();
  } else if constexpr (is_tuple_like<U>::value) {
    return any_hides_tensors<U>(std::make_index_sequence<std::tuple_size_v<U>>{});
  } else {
    return true;
  }
}

// The innermost component of T that hides tensors (for the error message), or "" when none does.
template <class T>
std::string hidden_type_name();
template <class Tuple, size_t... I>
std::string first_hidden_type_name(std::index_sequence<I...>) {
  std::string name;
  ((name = name.empty() ? hidden_type_name<std::tuple_element_t<I, Tuple>>() : name), ...);
  return name;
}
template <class T>
std::string hidden_type_name() {
  using U = std::remove_cv_t<std::remove_reference_t<T>>;
  if constexpr (!hides_tensors<U>()) {
    return "";
  } else if constexpr (is_vector<U>::value || is_optional<U>::value || is_std_array<U>::value) {
    return hidden_type_name<typename U::value_type>();
  } else if constexpr (is_map<U>::value) {
    if constexpr (std::is_base_of_v<at::TensorBase, typename U::key_type>) return c10::demangle(typeid(U).name());
    else return hidden_type_name<typename U::mapped_type>();
  } else if constexpr (is_tuple_like<U>::value) {
    return first_hidden_type_name<U>(std::make_index_sequence<std::tuple_size_v<U>>{});
  } else {
    return c10::demangle(typeid(U).name());
  }
}

template <class T> struct type_tag { using type = T; };

// Refuses a call whose argument or result types hide tensors (see hides_tensors); `what` is "fsdp::nn::call".
std::string hidden_tensors_message(const char* what, const torch::nn::Module& module, const std::string& where,
                                   const std::string& whole_type, const std::string& hidden_type);
template <class Result, class... Args>
void check_tensors_visible(const char* what, const torch::nn::Module& module) {
  if constexpr (hides_tensors<Result>()) {
    TORCH_CHECK(false, hidden_tensors_message(what, module, "returns", c10::demangle(typeid(Result).name()),
                                              hidden_type_name<Result>()));
  }
  if constexpr ((false || ... || hides_tensors<Args>())) {
    size_t index = 0;
    auto one = [&](auto tag) {
      using A = typename decltype(tag)::type;
      if constexpr (hides_tensors<A>()) {
        TORCH_CHECK(false, hidden_tensors_message(what, module, "takes as argument " + std::to_string(index),
                                                  c10::demangle(typeid(A).name()), hidden_type_name<A>()));
      }
      ++index;
    };
    (one(type_tag<Args>{}), ...);
  }
}

template <class T, class F>
void for_each_tensor(T& value, F&& f) {
  using U = std::decay_t<T>;
  if constexpr (std::is_base_of_v<at::TensorBase, U>) {
    f(static_cast<at::Tensor&>(value));
  } else if constexpr (has_tensor_fields<U>::value) {
    TensorFields<U>::visit(value, [&](auto& field) {
      static_assert(!hides_tensors<decltype(field)>(),
                    "fsdp::nn::TensorFields<T>::visit was given a member of a type whose tensors call() cannot see: "
                    "specialize fsdp::nn::TensorFields for that type too");
      for_each_tensor(field, f);
    });
  } else if constexpr (is_vector<U>::value || is_std_array<U>::value) {
    for (auto& v : value) for_each_tensor(v, f);
  } else if constexpr (is_optional<U>::value) {
    if (value.has_value()) for_each_tensor(*value, f);
  } else if constexpr (is_map<U>::value) {
    // Iteration order: sorted keys (std::map); for std::unordered_map the order of this object, which is the
    // same for every run that inserts the same keys the same way (as recomputation does).
    for (auto& entry : value) for_each_tensor(entry.second, f);
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

namespace detail {
// Runs the module's exception hooks when forward or a forward hook throws (the pre-hooks ran: undo them).
class ExceptionHookGuard {
 public:
  explicit ExceptionHookGuard(torch::nn::Module& module) : module_(&module) {}
  ExceptionHookGuard(const ExceptionHookGuard&) = delete;
  ExceptionHookGuard& operator=(const ExceptionHookGuard&) = delete;
  ~ExceptionHookGuard() {
    if (module_) run_forward_exception_hooks(*module_);
  }
  void dismiss() { module_ = nullptr; }

 private:
  torch::nn::Module* module_;
};

template <class T> struct is_shared_ptr : std::false_type {};
template <class T> struct is_shared_ptr<std::shared_ptr<T>> : std::true_type {};

// The module object behind every form call() accepts: a ModuleHolder (lvalue, rvalue or const: a holder is a
// handle, so a const holder still calls the non-const forward, as holder.ptr() would), a std::shared_ptr<Impl>,
// an Impl* (what Module::as<T>() returns) or an Impl&.
template <class M>
decltype(auto) module_object(M&& module) {
  using U = std::remove_cv_t<std::remove_reference_t<M>>;
  if constexpr (std::is_base_of_v<torch::detail::ModuleHolderIndicator, U>) {
    TORCH_CHECK(!module.is_empty(), "fsdp::nn::call: empty module holder");
    return *module.ptr();
  } else if constexpr (is_shared_ptr<U>::value || std::is_pointer_v<U>) {
    using Impl = std::remove_cv_t<std::remove_reference_t<decltype(*module)>>;
    static_assert(std::is_base_of_v<torch::nn::Module, Impl>, "fsdp::nn::call: not a pointer to a module");
    static_assert(!std::is_same_v<Impl, torch::nn::Module>,
                  "fsdp::nn::call needs the module's concrete type, not torch::nn::Module (which has no forward): "
                  "use list->ptr<BlockImpl>(i), list[i]->as<BlockImpl>(), dict->at<BlockImpl>(key), or an AnyModule");
    TORCH_CHECK(module != nullptr, "fsdp::nn::call: null module");
    return const_cast<Impl&>(*module);
  } else {
    static_assert(std::is_base_of_v<torch::nn::Module, U>,
                  "fsdp::nn::call: expects a module holder, std::shared_ptr<Impl>, Impl*, Impl& or AnyModule");
    static_assert(!std::is_same_v<U, torch::nn::Module>,
                  "fsdp::nn::call needs the module's concrete type, not torch::nn::Module (which has no forward)");
    return const_cast<U&>(module);
  }
}

// Tensors inside a type-erased value (AnyModule's inputs and results). Returns false when the value holds a
// type this does not know (then it is left untouched).
template <class F>
bool for_each_tensor_in_any(torch::nn::AnyValue& value, F&& f) {
  bool known = false;
  auto visit = [&](auto* typed) {
    if (typed && !known) {
      known = true;
      for_each_tensor(*typed, f);
    }
  };
  visit(value.try_get<at::Tensor>());
  visit(value.try_get<std::vector<at::Tensor>>());
  visit(value.try_get<std::optional<at::Tensor>>());
  visit(value.try_get<std::tuple<at::Tensor, at::Tensor>>());
  visit(value.try_get<std::tuple<at::Tensor, at::Tensor, at::Tensor>>());
  visit(value.try_get<std::pair<at::Tensor, at::Tensor>>());
  visit(value.try_get<std::map<std::string, at::Tensor>>());
  visit(value.try_get<std::unordered_map<std::string, at::Tensor>>());
  return known;
}

std::string any_type_name(const torch::nn::AnyValue& value);
std::string any_module_name(const torch::nn::AnyModule& module);

// for_each_tensor over call()'s argument tuple, also looking inside AnyValue arguments; false if an AnyValue
// argument holds an unknown type.
template <class... Ts, class F>
bool for_each_argument_tensor(std::tuple<Ts...>& values, F&& f, std::string* unknown_type) {
  bool ok = true;
  std::apply(
      [&](auto&... v) {
        auto one = [&](auto& x) {
          if constexpr (std::is_same_v<std::decay_t<decltype(x)>, torch::nn::AnyValue>) {
            if (!for_each_tensor_in_any(x, f)) {
              ok = false;
              if (unknown_type) *unknown_type = any_type_name(x);
            }
          } else {
            for_each_tensor(x, f);
          }
        };
        (one(v), ...);
      },
      values);
  return ok;
}
}  // namespace detail

namespace detail {
// The module behind `impl` as a shared_ptr, for a forward function that outlives call().
template <class Impl>
std::shared_ptr<Impl> shared_module(Impl& impl) {
  std::shared_ptr<torch::nn::Module> base;
  try {
    base = static_cast<torch::nn::Module&>(impl).shared_from_this();
  } catch (const std::bad_weak_ptr&) {
    TORCH_CHECK(false, "fsdp::nn::call: ", impl.name(), " has a forward wrapper (e.g. activation checkpointing) but ",
                "is not owned by a std::shared_ptr; create it through a module holder or std::make_shared");
  }
  auto typed = std::dynamic_pointer_cast<Impl>(base);
  TORCH_CHECK(typed, "fsdp::nn::call: ", impl.name(), ": module object type mismatch");
  return typed;
}

// The wrapped form of `result = forward(args)`: the module's wrappers receive a forward function that owns copies of
// the module and the non-tensor arguments. `invoke(module, args)` runs the real forward; `visit(result, f)`
// visits the result's tensors.
template <class Module, class ArgTuple, class Invoke, class Visit>
auto forward_through_wrappers(std::shared_ptr<Module> self, torch::nn::Module& base, const ArgTuple& arg_values,
                              const TensorList& inputs, Invoke invoke, Visit visit) {
  using Result = std::decay_t<decltype(invoke(*self, std::declval<ArgTuple&>()))>;
  if constexpr (!std::is_copy_constructible_v<ArgTuple> || !std::is_move_constructible_v<Result>) {
    TORCH_CHECK(false, "fsdp::nn::call: ", base.name(), " has a forward wrapper, which needs copyable arguments");
    return invoke(*self, const_cast<ArgTuple&>(arg_values));
  } else {
    // The tensors are supplied at each run; the kept copy holds only the rest.
    auto kept = std::make_shared<ArgTuple>(arg_values);
    for_each_argument_tensor(*kept, [](at::Tensor& t) { t = at::Tensor(); }, nullptr);
    struct Slot {
      std::optional<Result> value;
      bool capture = true;
    };
    auto slot = std::make_shared<Slot>();
    ForwardFunction forward = [self, kept, slot, invoke, visit](const TensorList& in) {
      ArgTuple args = *kept;
      size_t i = 0;
      for_each_argument_tensor(args, [&](at::Tensor& t) { t = in.at(i++); }, nullptr);
      Result r = invoke(*self, args);
      TensorList out;
      visit(r, [&](at::Tensor& t) { out.push_back(t); });
      if (slot->capture) {  // the first run is call()'s result; later runs (recomputation) only return tensors
        slot->value.emplace(std::move(r));
        slot->capture = false;
      }
      return out;
    };
    TensorList outputs = run_forward_wrappers(base, inputs, forward);
    TORCH_CHECK(slot->value.has_value(), "fsdp::nn::call: a forward wrapper of ", base.name(), " did not run forward");
    Result result = std::move(*slot->value);
    slot->value.reset();
    size_t n = 0;
    visit(result, [&](at::Tensor&) { ++n; });
    TORCH_CHECK(outputs.size() == n, "fsdp::nn::call: a forward wrapper of ", base.name(),
                " changed the number of output tensors");
    size_t i = 0;
    visit(result, [&](at::Tensor& t) { t = outputs.at(i++); });
    return result;
  }
}
}  // namespace detail

// Invoke module->forward(args...) with the module's forward hooks around it.
// `module` is a ModuleHolder (torch::nn::Linear, TORCH_MODULE types; lvalue, temporary or const), a
// std::shared_ptr<SomeModuleImpl>, a SomeModuleImpl* (ModuleList/ModuleDict element: list[i]->as<SomeModuleImpl>())
// or a SomeModuleImpl&. A torch::nn::AnyModule has its own overload below.
template <class M, class... Args,
          std::enable_if_t<!std::is_same_v<std::decay_t<M>, torch::nn::AnyModule>, int> = 0>
auto call(M&& module, Args&&... args) {
  auto& impl = detail::module_object(module);
  torch::nn::Module& base = impl;
  if (!has_forward_hooks(base)) return impl.forward(std::forward<Args>(args)...);
  detail::check_tensors_visible<decltype(impl.forward(std::declval<std::decay_t<Args>&>()...)), std::decay_t<Args>...>(
      "fsdp::nn::call", base);
  // Hooks may replace tensors, so the arguments are copied (tensors are handles: the copy is cheap).
  std::tuple<std::decay_t<Args>...> arg_values(std::forward<Args>(args)...);
  TensorList inputs = detail::gather_tensors(arg_values);
  const size_t n_inputs = inputs.size();
  run_forward_pre_hooks(base, inputs);
  TORCH_CHECK(inputs.size() == n_inputs, "fsdp::nn::call: a forward pre-hook changed the number of input tensors");
  detail::scatter_tensors(arg_values, inputs);
  detail::ExceptionHookGuard guard(base);
  auto run = [](auto& m, auto& a) { return std::apply([&](auto&... x) { return m.forward(x...); }, a); };
  auto result = has_forward_wrappers(base)
                    ? detail::forward_through_wrappers(
                          detail::shared_module(impl), base, arg_values, inputs, run,
                          [](auto& r, auto&& f) { detail::for_each_tensor(r, f); })
                    : run(impl, arg_values);
  TensorList outputs;
  detail::for_each_tensor(result, [&](at::Tensor& t) { outputs.push_back(t); });
  const size_t n_outputs = outputs.size();
  run_forward_hooks(base, inputs, outputs);
  guard.dismiss();
  TORCH_CHECK(outputs.size() == n_outputs, "fsdp::nn::call: a forward hook changed the number of output tensors");
  detail::scatter_tensors(result, outputs);
  return result;
}

// The type-erased form: any.any_forward(args...) with the hooks of any.ptr() around it; returns the AnyValue.
// Arguments may themselves be AnyValues (what fsdp::nn::Sequential passes from one element to the next). When
// the module has hooks, the tensors of AnyValue arguments and of the result must be visible to them: an
// at::Tensor, std::vector<at::Tensor>, std::optional<at::Tensor>, a tuple/pair of 2 or 3 tensors, or a
// std::map / std::unordered_map from std::string to at::Tensor.
template <class... Args>
torch::nn::AnyValue call_any_value(const torch::nn::AnyModule& any, Args&&... args) {
  auto& module = const_cast<torch::nn::AnyModule&>(any);  // AnyModule is a handle, like a module holder
  TORCH_CHECK(!module.is_empty(), "fsdp::nn::call: empty AnyModule");
  const std::shared_ptr<torch::nn::Module> base = module.ptr();
  if (!has_forward_hooks(*base)) return module.any_forward(std::forward<Args>(args)...);
  std::tuple<std::decay_t<Args>...> arg_values(std::forward<Args>(args)...);
  TensorList inputs;
  std::string unknown;
  TORCH_CHECK(detail::for_each_argument_tensor(arg_values, [&](at::Tensor& t) { inputs.push_back(t); }, &unknown),
              "fsdp::nn::call: ", detail::any_module_name(any), " has forward hooks, but an argument is an AnyValue ",
              "holding ", unknown, ", whose tensors its hooks cannot see (supported: Tensor, vector<Tensor>, ",
              "optional<Tensor>, tuple/pair of 2 or 3 Tensors, map/unordered_map<string, Tensor>)");
  const size_t n_inputs = inputs.size();
  run_forward_pre_hooks(*base, inputs);
  TORCH_CHECK(inputs.size() == n_inputs, "fsdp::nn::call: a forward pre-hook changed the number of input tensors");
  size_t i = 0;
  detail::for_each_argument_tensor(arg_values, [&](at::Tensor& t) { t = inputs.at(i++); }, nullptr);
  // Moved: the copies are ours, and an lvalue AnyValue would be wrapped in another AnyValue.
  detail::ExceptionHookGuard guard(*base);
  torch::nn::AnyValue result = [&]() -> torch::nn::AnyValue {
    if (!has_forward_wrappers(*base)) {
      return std::apply([&](auto&... a) { return module.any_forward(std::move(a)...); }, arg_values);
    }
    // A copy of the AnyModule is another handle to the same module, kept by the forward function.
    auto self = std::make_shared<torch::nn::AnyModule>(module);
    auto run = [](torch::nn::AnyModule& m, auto& a) {
      return std::apply([&](auto&... x) { return m.any_forward(std::move(x)...); }, a);  // a is a copy
    };
    auto visit = [](torch::nn::AnyValue& r, auto&& f) { detail::for_each_tensor_in_any(r, f); };
    return detail::forward_through_wrappers(self, *base, arg_values, inputs, run, visit);
  }();
  TensorList outputs;
  TORCH_CHECK(detail::for_each_tensor_in_any(result, [&](at::Tensor& t) { outputs.push_back(t); }),
              "fsdp::nn::call: ", detail::any_module_name(any), " has forward hooks, but its forward returned ",
              detail::any_type_name(result), ", whose tensors its hooks cannot see (supported: Tensor, vector<Tensor>, ",
              "optional<Tensor>, tuple/pair of 2 or 3 Tensors, map/unordered_map<string, Tensor>)");
  const size_t n_outputs = outputs.size();
  run_forward_hooks(*base, inputs, outputs);
  guard.dismiss();
  TORCH_CHECK(outputs.size() == n_outputs, "fsdp::nn::call: a forward hook changed the number of output tensors");
  i = 0;
  detail::for_each_tensor_in_any(result, [&](at::Tensor& t) { t = outputs.at(i++); });
  return result;
}

// AnyModule: like any.forward<Return>(args...) (an at::Tensor by default), with the hooks of any.ptr() around it.
template <class Return = at::Tensor, class... Args>
Return call(const torch::nn::AnyModule& any, Args&&... args) {
  torch::nn::AnyValue result = call_any_value(any, std::forward<Args>(args)...);
  if (auto* value = result.try_get<Return>()) return std::move(*value);
  TORCH_CHECK(false, "fsdp::nn::call: ", detail::any_module_name(any), " returned ", detail::any_type_name(result),
              ", but the caller asked for ", c10::demangle(typeid(Return).name()));
}

}  // namespace fsdp::nn
