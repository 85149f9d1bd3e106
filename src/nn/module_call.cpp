#include <fsdp/nn/module_call.h>

#include <c10/util/Type.h>

#include <algorithm>
#include <mutex>
#include <ostream>

namespace fsdp::nn {
namespace {

// The hooks of one module live in a child module registered under this name: libtorch modules have no slot
// for extra state, and a child keeps the hooks' lifetime tied to the module without any global registry.
// It holds no parameters or buffers, so state dicts and optimizers never see it.
constexpr const char* kHookStoreName = "_forward_hooks";

// Being a child, the store must stay out of the way of everything libtorch does with a module tree: it is not
// serialized (torch::save writes no sub-archive for it, torch::load reads none), it prints as
// `fsdp::ForwardHooks(pre=N, post=M)`, and a clone of it is an empty store (hooks are bound to the original).
struct HookStore : torch::nn::Module {
  HookStore() : torch::nn::Module("fsdp::ForwardHooks") {}

  bool is_serializable() const override { return false; }
  void save(torch::serialize::OutputArchive&) const override {}
  void load(torch::serialize::InputArchive&) override {}
  std::shared_ptr<torch::nn::Module> clone(const std::optional<c10::Device>& = std::nullopt) const override {
    return std::make_shared<HookStore>();
  }
  void pretty_print(std::ostream& stream) const override {
    stream << "fsdp::ForwardHooks(pre=" << pre_hooks.size() << ", post=" << post_hooks.size();
    for (const auto& w : wrappers) stream << ", " << w.tag;
    stream << ")";
  }

  struct Entry {
    uint64_t id;
    ForwardPreHook pre;
    ForwardHook post;
    ForwardExceptionHook on_exception;
  };
  std::vector<Entry> pre_hooks;
  std::vector<Entry> post_hooks;
  std::vector<Entry> exception_hooks;
  struct Wrapper {
    uint64_t id;
    ForwardWrapper wrap;
    std::string tag;
    std::shared_ptr<void> state;
  };
  std::vector<Wrapper> wrappers;
  uint64_t next_id = 1;
};

std::shared_ptr<HookStore> find_store(const torch::nn::Module& module) {
  // named_children() is the only public lookup; modules have few children, so this stays cheap.
  for (const auto& child : module.named_children()) {
    if (child.key() == kHookStoreName) return std::dynamic_pointer_cast<HookStore>(child.value());
  }
  return nullptr;
}

std::shared_ptr<HookStore> get_or_create_store(torch::nn::Module& module) {
  if (auto store = find_store(module)) return store;
  return module.register_module(kHookStoreName, std::make_shared<HookStore>());
}

}  // namespace

void HookHandle::remove() {
  auto base = store_.lock();
  if (!base) return;
  auto store = std::dynamic_pointer_cast<HookStore>(base);
  auto by_id = [&](const HookStore::Entry& e) { return e.id == id_; };
  store->pre_hooks.erase(std::remove_if(store->pre_hooks.begin(), store->pre_hooks.end(), by_id), store->pre_hooks.end());
  store->post_hooks.erase(std::remove_if(store->post_hooks.begin(), store->post_hooks.end(), by_id),
                          store->post_hooks.end());
  store->exception_hooks.erase(std::remove_if(store->exception_hooks.begin(), store->exception_hooks.end(), by_id),
                               store->exception_hooks.end());
  store->wrappers.erase(std::remove_if(store->wrappers.begin(), store->wrappers.end(),
                                       [&](const HookStore::Wrapper& w) { return w.id == id_; }),
                        store->wrappers.end());
  store_.reset();
}

namespace {
HookHandle add_hook(torch::nn::Module& module, ForwardPreHook pre, ForwardHook post, bool prepend) {
  auto store = get_or_create_store(module);
  auto& list = pre ? store->pre_hooks : store->post_hooks;
  HookStore::Entry entry{store->next_id++, std::move(pre), std::move(post), nullptr};
  const uint64_t id = entry.id;
  list.insert(prepend ? list.begin() : list.end(), std::move(entry));
  return HookHandle(store, id);
}
}  // namespace

HookHandle register_forward_pre_hook(torch::nn::Module& module, ForwardPreHook hook, bool prepend) {
  TORCH_CHECK(hook, "fsdp::nn::register_forward_pre_hook: empty hook");
  return add_hook(module, std::move(hook), nullptr, prepend);
}

HookHandle register_forward_hook(torch::nn::Module& module, ForwardHook hook, bool prepend) {
  TORCH_CHECK(hook, "fsdp::nn::register_forward_hook: empty hook");
  return add_hook(module, nullptr, std::move(hook), prepend);
}

HookHandle register_forward_exception_hook(torch::nn::Module& module, ForwardExceptionHook hook) {
  TORCH_CHECK(hook, "fsdp::nn::register_forward_exception_hook: empty hook");
  auto store = get_or_create_store(module);
  HookStore::Entry entry{store->next_id++, nullptr, nullptr, std::move(hook)};
  const uint64_t id = entry.id;
  store->exception_hooks.push_back(std::move(entry));
  return HookHandle(store, id);
}

void run_forward_exception_hooks(torch::nn::Module& module) noexcept {
  auto store = find_store(module);
  if (!store) return;
  auto hooks = store->exception_hooks;
  for (auto& entry : hooks) {
    try {
      entry.on_exception(module);
    } catch (...) {
      // The original exception is the one to report; cleanup failures must not replace it.
    }
  }
}

bool has_forward_hooks(const torch::nn::Module& module) {
  auto store = find_store(module);
  return store && (!store->pre_hooks.empty() || !store->post_hooks.empty() || !store->wrappers.empty());
}

HookHandle register_forward_wrapper(torch::nn::Module& module, ForwardWrapper wrapper, std::string tag,
                                    std::shared_ptr<void> state) {
  TORCH_CHECK(wrapper, "fsdp::nn::register_forward_wrapper: empty wrapper");
  auto store = get_or_create_store(module);
  const uint64_t id = store->next_id++;
  store->wrappers.push_back({id, std::move(wrapper), std::move(tag), std::move(state)});
  return HookHandle(store, id);
}

bool has_forward_wrapper(const torch::nn::Module& module, const std::string& tag) {
  auto store = find_store(module);
  if (!store) return false;
  return std::any_of(store->wrappers.begin(), store->wrappers.end(), [&](const auto& w) { return w.tag == tag; });
}

std::shared_ptr<void> forward_wrapper_state(const torch::nn::Module& module, const std::string& tag) {
  auto store = find_store(module);
  if (!store) return nullptr;
  for (const auto& w : store->wrappers) {
    if (w.tag == tag) return w.state;
  }
  return nullptr;
}

bool has_forward_wrappers(const torch::nn::Module& module) {
  auto store = find_store(module);
  return store && !store->wrappers.empty();
}

TensorList run_forward_wrappers(torch::nn::Module& module, const TensorList& inputs, const ForwardFunction& forward) {
  auto store = find_store(module);
  if (!store || store->wrappers.empty()) return forward(inputs);
  // Innermost first: each wrapper's forward function runs the next wrapper in. Copies: the functions may run
  // again later (recomputation in backward), after a wrapper was removed.
  ForwardFunction chain = forward;
  for (auto it = store->wrappers.rbegin(); it != store->wrappers.rend(); ++it) {
    chain = [wrap = it->wrap, inner = std::move(chain), &module](const TensorList& in) { return wrap(module, in, inner); };
  }
  return chain(inputs);
}

namespace detail {
std::string any_type_name(const torch::nn::AnyValue& value) { return c10::demangle(value.type_info().name()); }
std::string any_module_name(const torch::nn::AnyModule& module) {
  return module.is_empty() ? std::string("an empty AnyModule") : module.ptr()->name();
}
std::string hidden_tensors_message(const char* what, const torch::nn::Module& module, const std::string& where,
                                   const std::string& whole_type, const std::string& hidden_type) {
  std::string of = whole_type == hidden_type ? std::string() : c10::str(", which holds ", hidden_type);
  return c10::str(what, ": ", module.name(), " has forward hooks (fully_shard, activation checkpointing, ...), but ",
                  "its forward ", where, " ", whole_type, of, ": a type whose tensors the hooks cannot see. FSDP ",
                  "would not arm the gather before backward for tensors it is not shown, and backward would read ",
                  "freed parameters. Pass and return tensors as Tensor, std::vector, std::array, std::optional, ",
                  "std::tuple, std::pair, std::map or std::unordered_map of those, or specialize ",
                  "fsdp::nn::TensorFields<", hidden_type, "> to visit its tensors (an empty visit if it holds ",
                  "none); see docs/hooks.md");
}
}  // namespace detail

void run_forward_pre_hooks(torch::nn::Module& module, TensorList& inputs) {
  auto store = find_store(module);
  if (!store) return;
  // Copy: a hook may register or remove hooks.
  auto hooks = store->pre_hooks;
  for (auto& entry : hooks) entry.pre(module, inputs);
}

void run_forward_hooks(torch::nn::Module& module, const TensorList& inputs, TensorList& outputs) {
  auto store = find_store(module);
  if (!store) return;
  auto hooks = store->post_hooks;
  for (auto& entry : hooks) entry.post(module, inputs, outputs);
}

}  // namespace fsdp::nn
