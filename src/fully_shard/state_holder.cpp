#include "fully_shard/state_holder.h"

#include "fully_shard/fsdp_state.h"

#include <c10/core/GradMode.h>

#include <sstream>
#include <string>
#include <vector>

namespace fsdp::detail {

std::shared_ptr<FSDPState> find_state(const torch::nn::Module& module) {
  for (const auto& child : module.named_children()) {
    if (child.key() == kStateHolderName) {
      if (auto holder = std::dynamic_pointer_cast<FSDPStateHolder>(child.value())) return holder->state;
    }
  }
  return nullptr;
}

std::shared_ptr<torch::nn::Module> FSDPStateHolder::clone(const std::optional<c10::Device>&) const {
  return std::make_shared<FSDPStateHolder>();
}

void FSDPStateHolder::save(torch::serialize::OutputArchive&) const {}

void FSDPStateHolder::load(torch::serialize::InputArchive&) {
  if (!state || state->param_groups().empty()) return;
  c10::NoGradGuard no_grad;
  std::vector<FSDPParam*> params;  // every group's (one per mesh)
  for (FSDPParamGroup* g : state->param_groups()) params.insert(params.end(), g->params().begin(), g->params().end());
  struct Loaded {
    FSDPParam* param;
    at::Tensor rows;  // what goes into the shard
  };
  std::vector<Loaded> loaded;
  std::string error;
  for (FSDPParam* p : params) {
    const at::Tensor& param = p->param();
    const at::Tensor& shard = p->sharded_local();
    if (param.storage().is_alias_of(shard.storage())) continue;  // not loaded (or loaded in place)
    at::Tensor data = param.data();
    const auto full = c10::IntArrayRef(p->unsharded_sizes());
    if (p->state() != ShardedState::Sharded) {
      error = "its parameters are unsharded (between forward and backward): load between steps";
    } else if (data.sizes() == shard.sizes()) {
      loaded.push_back({p, data});
    } else if (full.empty() && data.dim() == 0) {  // a 0-dim parameter, replicated in its one-row shard
      loaded.push_back({p, data.reshape(shard.sizes())});
    } else if (data.sizes() == full) {
      loaded.push_back({p, p->local_part_of(data)});
    } else if (error.empty()) {
      std::ostringstream msg;
      msg << "parameter '" << p->fqn() << "' was loaded with shape " << data.sizes() << ", but this rank's shard is "
          << shard.sizes() << " and the full parameter " << full << ". torch::save of a sharded model stores each "
          << "rank's own shards: load it on the same rank of an identically sharded model (or use the full or "
          << "sharded state dicts of <fsdp/state_dict.h>)";
      error = msg.str();
    }
  }
  if (!error.empty()) {
    // Nothing of this state is half-loaded: every parameter shows its unchanged shard again.
    for (FSDPParam* p : params) {
      if (p->state() == ShardedState::Sharded) p->param().set_data(p->sharded_local());
    }
    TORCH_CHECK(false, "fsdp: torch::load into FSDP module ", state->name(), ": ", error);
  }
  for (auto& l : loaded) {
    l.param->sharded_local().copy_(l.rows);
    l.param->param().set_data(l.param->sharded_local());
  }
}

void FSDPStateHolder::pretty_print(std::ostream& stream) const {
  stream << "fsdp::FSDPState(";
  if (!state) {
    stream << "inert)";
    return;
  }
  const auto& groups = state->param_groups();
  size_t params = 0;
  for (const auto* g : groups) params += g->params().size();
  stream << "params=" << params;
  if (!groups.empty()) {
    stream << ", shard_size=" << groups.front()->mesh_info().shard_size;
    for (size_t i = 1; i < groups.size(); ++i) stream << "/" << groups[i]->mesh_info().shard_size;
  }
  stream << ")";
}

}  // namespace fsdp::detail
