// parallelize_module: FQN patterns of a plan matched against the module tree, each match given its style.

#include "tensor_parallel/styles.h"

#include <fsdp/tensor_parallel.h>

#include <fnmatch.h>

#include <sstream>

namespace fsdp {
namespace {

std::vector<std::string> split_fqn(const std::string& fqn) {
  std::vector<std::string> parts;
  if (fqn.empty()) return parts;
  std::string part;
  std::istringstream in(fqn);
  while (std::getline(in, part, '.')) parts.push_back(part);
  return parts;
}

// Dot-separated, segment by segment, fnmatch within a segment ('*' never crosses a dot).
bool fqn_matches(const std::string& pattern, const std::string& fqn) {
  const auto p = split_fqn(pattern), f = split_fqn(fqn);
  if (p.size() != f.size()) return false;
  for (size_t i = 0; i < p.size(); ++i) {
    if (::fnmatch(p[i].c_str(), f[i].c_str(), 0) != 0) return false;
  }
  return true;
}

// Our own bookkeeping children (forward hooks, TP specs) are not part of the model.
bool is_internal(const torch::nn::Module& m) {
  return m.name() == "fsdp::ForwardHooks" || m.name() == "fsdp::TensorParallel";
}

}  // namespace

void parallelize_module(const std::shared_ptr<torch::nn::Module>& module, const DeviceMesh& tp_mesh,
                        const ParallelizePlan& plan) {
  TORCH_CHECK(module != nullptr, "fsdp::parallelize_module: null module");
  TORCH_CHECK(tp_mesh.valid() && tp_mesh.ndim() == 1, "fsdp::parallelize_module: the TP mesh must be 1-D, got ",
              tp_mesh.valid() ? tp_mesh.to_string() : std::string("an empty mesh"),
              " (pass a sub-mesh: mesh[\"tp\"])");
  // Matched before anything is applied: applying adds bookkeeping children.
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> modules;
  for (const auto& item : module->named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    if (!is_internal(*item.value())) modules.emplace_back(item.key(), item.value());
  }
  for (const auto& [pattern, style] : plan) {
    bool matched = false;
    for (const auto& [fqn, m] : modules) {
      if (!fqn_matches(pattern, fqn)) continue;
      matched = true;
      const std::string where = fqn.empty() ? std::string("<root>") : fqn;
      std::visit(
          [&](const auto& s) {
            using S = std::decay_t<decltype(s)>;
            if constexpr (std::is_same_v<S, ColwiseParallel>) {
              tp::apply_colwise(*m, where, tp_mesh, s);
            } else if constexpr (std::is_same_v<S, RowwiseParallel>) {
              tp::apply_rowwise(*m, where, tp_mesh, s);
            } else if constexpr (std::is_same_v<S, SequenceParallel>) {
              tp::apply_sequence_parallel(*m, where, tp_mesh, s);
            } else if constexpr (std::is_same_v<S, PrepareModuleInput>) {
              tp::apply_prepare_module_input(*m, where, tp_mesh, s);
            } else {
              apply_expert_parallel(m, tp_mesh);
            }
          },
          style);
    }
    TORCH_CHECK(matched, "fsdp::parallelize_module: plan pattern '", pattern, "' matches no module of ",
                module->name(), " (patterns are dot-separated FQNs relative to it, '*' within one segment)");
  }
}

}  // namespace fsdp
