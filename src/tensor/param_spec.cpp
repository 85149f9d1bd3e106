// TP parameter specs: sharding a parameter in place and recording its global layout (see param_spec.h).

#include "tensor/param_spec.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <map>
#include <ostream>

namespace fsdp {
namespace tp {
namespace {

constexpr const char* kSpecStoreName = "_tensor_parallel";

// Not serialized, prints as fsdp::TensorParallel(names...), clones empty (specs are bound to the original's
// sharded parameters).
struct SpecStore : torch::nn::Module {
  SpecStore() : torch::nn::Module("fsdp::TensorParallel") {}
  bool is_serializable() const override { return false; }
  void save(torch::serialize::OutputArchive&) const override {}
  void load(torch::serialize::InputArchive&) override {}
  std::shared_ptr<torch::nn::Module> clone(const std::optional<c10::Device>& = std::nullopt) const override {
    return std::make_shared<SpecStore>();
  }
  void pretty_print(std::ostream& stream) const override {
    stream << "fsdp::TensorParallel(";
    bool first = true;
    for (const auto& [name, spec] : specs) {
      stream << (first ? "" : ", ") << name << "=" << fsdp::to_string(spec.placements);
      first = false;
    }
    stream << ")";
  }
  std::map<std::string, TensorParallelSpec> specs;
};

std::shared_ptr<SpecStore> find_store(const torch::nn::Module& module) {
  for (const auto& child : module.named_children()) {
    if (child.key() == kSpecStoreName) return std::dynamic_pointer_cast<SpecStore>(child.value());
  }
  return nullptr;
}

}  // namespace

void shard_parameter(torch::nn::Module& owner, const std::string& name, const DeviceMesh& mesh,
                     const Placement& placement) {
  TORCH_CHECK(mesh.valid() && mesh.ndim() == 1, "fsdp::parallelize_module: the TP mesh must be 1-D, got ",
              mesh.valid() ? mesh.to_string() : std::string("an empty mesh"));
  auto own = owner.named_parameters(/*recurse=*/false);
  at::Tensor* param = own.find(name);  // a handle on the module's tensor (same TensorImpl)
  TORCH_CHECK(param != nullptr, "fsdp::parallelize_module: module ", owner.name(), " has no parameter '", name, "'");
  auto store = find_store(owner);
  TORCH_CHECK(!store || store->specs.count(name) == 0, "fsdp::parallelize_module: parameter '", name, "' of ",
              owner.name(), " is already tensor-parallel (", fsdp::to_string(store->specs.at(name).placements),
              "); each module takes one style");
  TensorParallelSpec spec;
  spec.mesh = mesh;
  spec.global_shape = param->sizes().vec();
  Placement p = placement;
  if (p.is_shard()) {
    const int64_t nd = param->dim();
    TORCH_CHECK(p.dim >= -nd && p.dim < nd, "fsdp::parallelize_module: ", p.to_string(), " is out of range for ",
                owner.name(), ".", name, " of shape ", param->sizes());
    if (p.dim < 0) p.dim += nd;
  }
  spec.placements = {p};
  if (p.is_shard()) {
    c10::NoGradGuard no_grad;
    // On meta there are no values to keep: the piece would later be initialized on its own, unlike the whole
    // model's init. Refused, except on a fake mesh (fsdp/fake_process_group.h), which only plans shapes: nothing
    // ever gives those parameters values.
    TORCH_CHECK(!param->is_meta() || mesh.group(0)->backend() == "fake", "fsdp::parallelize_module: ", owner.name(),
                ".", name, " is on the meta device; tensor parallel needs the full values to keep this rank's piece "
                "(initialize before, or use fsdp::full_params_init_scope after fully_shard)");
    const auto [off, len] = shard_offset_and_size(param->size(p.dim), mesh.size(0), mesh.local_rank(0));
    // A copy, not a view: the full tensor is released.
    param->set_data(param->narrow(p.dim, off, len).clone(at::MemoryFormat::Contiguous));
  }
  if (!store) store = owner.register_module(kSpecStoreName, std::make_shared<SpecStore>());
  store->specs.emplace(name, std::move(spec));
}

const TensorParallelSpec* find_spec(const torch::nn::Module& owner, const std::string& name) {
  auto store = find_store(owner);
  if (!store) return nullptr;
  auto it = store->specs.find(name);
  return it == store->specs.end() ? nullptr : &it->second;
}

std::unordered_map<const c10::TensorImpl*, TensorParallelSpec> collect_specs(const torch::nn::Module& root) {
  std::unordered_map<const c10::TensorImpl*, TensorParallelSpec> out;
  for (const auto& m : root.modules(/*include_self=*/true)) {
    auto store = find_store(*m);
    if (!store) continue;
    const auto params = m->named_parameters(/*recurse=*/false);
    for (const auto& [name, spec] : store->specs) {
      if (const at::Tensor* p = params.find(name)) out.emplace(p->unsafeGetTensorImpl(), spec);
    }
  }
  return out;
}

}  // namespace tp

std::optional<TensorParallelSpec> tensor_parallel_spec(const torch::nn::Module& root, const at::Tensor& param) {
  const auto specs = tp::collect_specs(root);
  auto it = specs.find(param.unsafeGetTensorImpl());
  if (it == specs.end()) return std::nullopt;
  return it->second;
}

}  // namespace fsdp
