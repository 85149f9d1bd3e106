#pragma once
// How a module owns its FSDPState: libtorch modules have no slot for extra state, so fully_shard registers a
// child module holding it. The holder has no parameters or buffers, so state dicts and optimizers never see it.
//
// Being a child, it must not get in the way of what libtorch does with a module tree:
// * torch::save writes an empty sub-archive for it; torch::load reads that sub-archive and then puts the loaded
//   values into FSDP's shard storage (load() below) — see docs/hooks.md, "Containers and call forms".
// * it prints as `fsdp::FSDPState(...)`;
// * clone() gives an inert holder (no state): a clone is never sharded.

#include "fully_shard/containers.h"  // check_container_dispatch, for fully_shard.cpp

#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <ostream>

namespace fsdp {
namespace detail {
class FSDPState;

struct FSDPStateHolder : torch::nn::Module {
  FSDPStateHolder() : torch::nn::Module("fsdp::FSDPState") {}

  std::shared_ptr<FSDPState> state;

  // An inert holder (state == nullptr): the clone's parameters are plain tensors FSDP knows nothing of.
  std::shared_ptr<torch::nn::Module> clone(const std::optional<c10::Device>& device = std::nullopt) const override;
  // Writes nothing (an empty sub-archive, so that loading finds one).
  void save(torch::serialize::OutputArchive& archive) const override;
  // Runs after the parent's parameters were read (Module::load reads a module's own parameters, then its
  // children in order, and this holder is registered after the module's own children). InputArchive::read
  // re-points every loaded parameter to a fresh tensor; this copies each into FSDP's shard storage and shows
  // the shard again. A loaded tensor may be this rank's shard (torch::save of an identically sharded model on
  // the same rank) or the full parameter (this rank takes its rows); any other shape is an error naming the
  // parameter.
  void load(torch::serialize::InputArchive& archive) override;
  void pretty_print(std::ostream& stream) const override;

  // module->to(...) after fully_shard (state_holder_to.cpp). libtorch converts a module's children first (this
  // holder is registered after the module's own children) and its direct parameters last: the holder converts
  // the group's shards to the new dtype, keeping every parameter's identity, so the direct parameters then
  // convert as no-ops. A device other than the mesh's is rejected (FSDP's storage stays where the mesh is).
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;
};
constexpr const char* kStateHolderName = "_fsdp_state";

// The state fully_shard attached to `module` itself (not to a descendant), or null.
std::shared_ptr<FSDPState> find_state(const torch::nn::Module& module);

}  // namespace detail
}  // namespace fsdp
