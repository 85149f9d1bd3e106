// Meta-device initialization: materialize shards, run full-parameter initializers unit by unit.
#include <fsdp/materialize.h>

#include "fully_shard/fsdp_state.h"
#include "fully_shard/storage.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <unordered_map>
#include <unordered_set>

namespace fsdp {

void materialize_module(torch::nn::Module& root, c10::Device device) {
  c10::NoGradGuard no_grad;
  std::unordered_set<const c10::TensorImpl*> managed;
  for (const auto& sub : root.modules(/*include_self=*/true)) {
    auto s = detail::find_state(*sub);
    if (!s) continue;
    for (auto* g : s->param_groups()) {
      g->materialize();
      for (auto* p : g->params()) managed.insert(p->param().unsafeGetTensorImpl());
    }
  }
  auto materialize_plain = [&](at::Tensor t) {
    if (t.is_meta() && !managed.count(t.unsafeGetTensorImpl())) {
      detail::replace_data(t, at::zeros(t.sizes(), t.options().device(device)));
    }
  };
  for (const auto& p : root.parameters(/*recurse=*/true)) materialize_plain(p);
  for (const auto& b : root.buffers(/*recurse=*/true)) materialize_plain(b);
}

namespace {
// Runs `init` while the state's parameters — every group's, one per mesh; only those of `part` when given —
// show full data.
void with_full_params(const FSDPState& state, const torch::nn::Module* part, const std::function<void()>& init) {
  const auto& groups = state.param_groups();
  for (auto* group : groups) {
    for (auto* p : group->params()) {
      TORCH_CHECK(!p->param().is_meta(), "fsdp::init_with_full_params: parameter '", p->fqn(),
                  "' is still on meta; call fsdp::materialize_module first");
    }
  }
  std::unordered_set<const c10::TensorImpl*> part_params;
  if (part) {
    for (const auto& t : part->parameters(/*recurse=*/true)) part_params.insert(t.unsafeGetTensorImpl());
  }
  // Full parameters in their original dtype, no all-gather for freshly materialized shards (known zeros).
  // Groups that began are ended whatever happens, in reverse order.
  size_t begun = 0;
  auto end_begun = [&] {
    while (begun > 0) groups[--begun]->end_full_init();
  };
  try {
    for (; begun < groups.size(); ++begun) groups[begun]->begin_full_init(part ? &part_params : nullptr);
    c10::NoGradGuard no_grad;
    init();
  } catch (...) {
    end_begun();
    throw;
  }
  end_begun();
}
}  // namespace

void init_with_full_params(const FSDPModule& unit, const std::function<void()>& init) {
  with_full_params(detail::FSDPModuleAccess::state(unit), nullptr, init);
}

std::function<void(torch::nn::Module&, const std::function<void()>&)> full_params_init_scope(torch::nn::Module& root) {
  // parent links, to find the closest sharded ancestor of a part
  auto parent = std::make_shared<std::unordered_map<const torch::nn::Module*, const torch::nn::Module*>>();
  for (const auto& m : root.modules(/*include_self=*/true)) {
    for (const auto& child : m->children()) parent->emplace(child.get(), m.get());
  }
  return [parent](torch::nn::Module& part, const std::function<void()>& fn) {
    for (const torch::nn::Module* m = &part; m != nullptr;) {
      if (auto state = detail::find_state(*m)) {
        with_full_params(*state, &part, fn);
        return;
      }
      auto it = parent->find(m);
      m = it == parent->end() ? nullptr : it->second;
    }
    c10::NoGradGuard no_grad;
    fn();
  };
}

}  // namespace fsdp
