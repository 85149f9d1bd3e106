// fsdp::prepare_fully_shard: FSDP1-style settings -> fully_shard calls (docs/migration.md).
#include <fsdp/migration.h>

#include <fsdp/materialize.h>
#include <fsdp/process_group.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <map>
#include <set>
#include <unordered_map>
#include <unordered_set>

namespace fsdp {
namespace {

constexpr const char* kWhere = "prepare_fully_shard: ";

// ---- config checks (before any side effect) -------------------------------------------------------------

// Every removed FSDP1 argument is decided here: accepted (mapped, or a no-op because FSDP2 always behaves
// that way) or rejected with the reason and the FSDP2 replacement.
void check_removed_arguments(const Fsdp1Config& c) {
  if (c.backward_prefetch) {
    TORCH_CHECK(*c.backward_prefetch != BackwardPrefetch::BACKWARD_POST, kWhere,
                "backward_prefetch=BACKWARD_POST is not available in FSDP2: FSDP2 always prefetches like "
                "BACKWARD_PRE (the next group's all-gather is issued when the current group's backward starts). "
                "Drop the argument, or set an explicit order with FSDPModule::set_modules_to_backward_prefetch");
    TORCH_CHECK(*c.backward_prefetch != BackwardPrefetch::NONE, kWhere,
                "backward_prefetch=None (no backward prefetch) is not available in FSDP2: it always prefetches "
                "one group ahead in backward (peak = two unsharded groups). Drop the argument; to save memory use "
                "a finer wrap rule or reshard_after_forward (FULL_SHARD)");
  }
  if (c.use_orig_params) {
    TORCH_CHECK(*c.use_orig_params, kWhere,
                "use_orig_params=false is not available in FSDP2: there is no FlatParameter, every parameter is "
                "sharded on its own and keeps its name (FSDP2 always behaves like use_orig_params=true). Build the "
                "optimizer on model->parameters() after prepare_fully_shard; checkpoints keyed by _flat_param must "
                "be converted");
  }
  if (c.mixed_precision) {
    TORCH_CHECK(!c.mixed_precision->keep_low_precision_grads, kWhere,
                "mixed_precision.keep_low_precision_grads=true is not available in FSDP2: sharded gradients are "
                "always in the parameter's dtype (reduced in reduce_dtype, then cast back). Drop the flag, or keep "
                "low-precision parameters (model->to(kBFloat16)) if the memory matters");
  }
}

// ---- module tree ----------------------------------------------------------------------------------------

bool is_container(const torch::nn::Module& m) {
  // No forward of their own: FSDP's pre-forward would never run for them.
  return dynamic_cast<const torch::nn::ModuleListImpl*>(&m) != nullptr ||
         dynamic_cast<const torch::nn::ModuleDictImpl*>(&m) != nullptr;
}

// a is an ancestor of b or b itself ("" is the root).
bool covers(const std::string& a, const std::string& b) {
  return a.empty() || a == b || (b.size() > a.size() && b.compare(0, a.size(), a) == 0 && b[a.size()] == '.');
}

int64_t depth(const std::string& fqn) {
  return fqn.empty() ? 0 : 1 + static_cast<int64_t>(std::count(fqn.begin(), fqn.end(), '.'));
}

std::string parent_of(const std::string& fqn) {
  const auto dot = fqn.rfind('.');
  return dot == std::string::npos ? std::string() : fqn.substr(0, dot);
}

// Component-wise common prefix.
std::string common_ancestor(const std::string& a, const std::string& b) {
  std::string out = a;
  while (!covers(out, b)) out = parent_of(out);
  return out;
}

struct Tree {
  std::vector<std::string> order;  // pre-order, root "" first
  std::map<std::string, std::shared_ptr<torch::nn::Module>> modules;  // without the root
  const torch::nn::Module* root = nullptr;
  std::set<std::string> ignored;  // roots of ignored subtrees

  const torch::nn::Module& at(const std::string& fqn) const { return fqn.empty() ? *root : *modules.at(fqn); }
  bool is_ignored(const std::string& fqn) const {
    for (const auto& ig : ignored) {
      if (covers(ig, fqn)) return true;
    }
    return false;
  }
};

Tree read_tree(const torch::nn::Module& model, const Fsdp1Config& c) {
  Tree t;
  t.root = &model;
  t.order.push_back("");
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    t.order.push_back(item.key());
    t.modules[item.key()] = item.value();
  }
  for (const auto& ig : c.ignored_modules) {
    TORCH_CHECK(ig != nullptr, kWhere, "ignored_modules holds a null module");
    TORCH_CHECK(ig.get() != &model, kWhere, "ignored_modules holds the model itself: nothing would be sharded");
    bool found = false;
    for (const auto& [fqn, m] : t.modules) {
      if (m.get() == ig.get()) {
        t.ignored.insert(fqn);
        found = true;
      }
    }
    TORCH_CHECK(found, kWhere, "ignored_modules holds a module (", ig->name(), ") that is not part of the model");
  }
  return t;
}

bool has_parameters(const torch::nn::Module& m) { return !m.parameters(/*recurse=*/true).empty(); }

// The default rule: direct children with parameters, looking through containers.
void default_candidates(const Tree& t, const std::string& fqn, std::vector<std::string>& out) {
  for (const auto& child : t.at(fqn).named_children()) {
    const std::string name = fqn.empty() ? child.key() : fqn + "." + child.key();
    if (t.is_ignored(name) || !has_parameters(*child.value())) continue;
    if (is_container(*child.value())) {
      default_candidates(t, name, out);
    } else {
      out.push_back(name);
    }
  }
}

struct Plan {
  std::vector<std::string> fqns;        // bottom-up, root last
  std::vector<std::string> checkpoint;  // activation checkpointing, pre-order
  std::vector<std::string> notes;
};

// Modules to checkpoint. checkpoint_module refuses a module with sharded descendants (its recomputation would
// re-enter their FSDP hooks from inside another region), so `true` picks the innermost wrapped modules and a
// predicate's choice is checked here, before anything is modified.
std::vector<std::string> checkpoint_targets(const Tree& t, const Fsdp1Config& c,
                                           const std::vector<std::string>& wrapped) {
  auto has_wrapped_below = [&](const std::string& fqn) {
    return std::any_of(wrapped.begin(), wrapped.end(),
                       [&](const std::string& w) { return !w.empty() && w != fqn && covers(fqn, w); });
  };
  std::vector<std::string> out;
  if (std::holds_alternative<bool>(c.activation_checkpointing)) {
    if (!std::get<bool>(c.activation_checkpointing)) return out;
    for (const auto& fqn : t.order) {
      const bool is_wrapped = std::find(wrapped.begin(), wrapped.end(), fqn) != wrapped.end();
      if (fqn.empty() || !is_wrapped || has_wrapped_below(fqn)) continue;
      TORCH_CHECK(!is_checkpointed(t.at(fqn)), kWhere, "activation_checkpointing=true would checkpoint '", fqn,
                  "' again (checkpoint_module was applied to it before): leave activation_checkpointing off");
      out.push_back(fqn);
    }
    return out;
  }
  const WrapPolicy& pick = std::get<WrapPolicy>(c.activation_checkpointing);
  if (!pick) return out;
  for (const auto& fqn : t.order) {
    if (fqn.empty() || t.is_ignored(fqn) || !pick(fqn, t.at(fqn))) continue;
    TORCH_CHECK(!is_checkpointed(t.at(fqn)), kWhere, "activation_checkpointing selected '", fqn,
                "', which is already checkpointed (checkpoint_module was applied to it before)");
    TORCH_CHECK(!is_container(t.at(fqn)), kWhere, "activation_checkpointing selected '", fqn,
                "', a ModuleList/ModuleDict: it has no forward to checkpoint. Select its elements instead");
    TORCH_CHECK(!has_wrapped_below(fqn), kWhere, "activation_checkpointing selected '", fqn,
                "', which contains modules that are sharded on their own: checkpoint those modules instead (or "
                "change the wrap rule so that '", fqn, "' is sharded as one unit)");
    out.push_back(fqn);
  }
  return out;
}

Plan make_plan(const Tree& t, const Fsdp1Config& c, const std::unordered_set<const c10::TensorImpl*>& ignored_params) {
  Plan plan;
  std::set<std::string> wrap;
  if (c.auto_wrap_policy) {
    for (const auto& fqn : t.order) {
      if (fqn.empty() || t.is_ignored(fqn) || !c.auto_wrap_policy(fqn, t.at(fqn))) continue;
      TORCH_CHECK(!is_container(t.at(fqn)), kWhere, "the wrap rule selected '", fqn,
                  "', a ModuleList/ModuleDict: containers have no forward of their own, so FSDP's hooks would "
                  "never run for it. Select its elements instead");
      if (!has_parameters(t.at(fqn))) continue;  // an empty group would only add hook overhead
      wrap.insert(fqn);
    }
  } else {
    std::vector<std::string> direct;
    default_candidates(t, "", direct);
    wrap.insert(direct.begin(), direct.end());
  }

  // Tied parameters: where each parameter is registered (modules that hold it directly).
  // `keys` keeps first-registration (pre-order) order: every rank must resolve ties in the same order, and
  // TensorImpl addresses differ between processes.
  std::vector<const c10::TensorImpl*> keys;
  std::unordered_map<const c10::TensorImpl*, std::vector<std::string>> sites;
  std::unordered_map<const c10::TensorImpl*, std::string> first_name;
  for (const auto& fqn : t.order) {
    for (const auto& p : t.at(fqn).named_parameters(/*recurse=*/false)) {
      const c10::TensorImpl* key = p.value().unsafeGetTensorImpl();
      if (ignored_params.count(key) || t.is_ignored(fqn)) continue;
      if (!sites.count(key)) keys.push_back(key);
      auto& s = sites[key];
      if (std::find(s.begin(), s.end(), fqn) == s.end()) s.push_back(fqn);
      first_name.emplace(key, fqn.empty() ? p.key() : fqn + "." + p.key());
    }
  }
  auto owner = [&](const std::string& site) {  // the deepest wrapped module that covers `site`
    std::string best;
    for (const auto& w : wrap) {
      if (covers(w, site) && depth(w) > depth(best)) best = w;
    }
    return best;
  };
  // A parameter whose sites fall into different groups would be sharded twice (or used outside its group's
  // forward): wrap the sites' common ancestor instead and unwrap what lies between it and the sites. Repeat
  // until stable, since a new wrap can split another tie.
  for (bool changed = true; changed;) {
    changed = false;
    for (const c10::TensorImpl* key : keys) {
      const std::vector<std::string>& where = sites.at(key);
      if (where.size() < 2) continue;
      std::set<std::string> owners;
      for (const auto& s : where) owners.insert(owner(s));
      if (owners.size() < 2) continue;
      std::string lca = where.front();
      for (const auto& s : where) lca = common_ancestor(lca, s);
      while (!lca.empty() && is_container(t.at(lca))) lca = parent_of(lca);
      std::vector<std::string> dropped;
      for (auto it = wrap.begin(); it != wrap.end();) {
        const bool between = *it != lca && covers(lca, *it) &&
                             std::any_of(where.begin(), where.end(), [&](const auto& s) { return covers(*it, s); });
        if (between) {
          dropped.push_back(*it);
          it = wrap.erase(it);
        } else {
          ++it;
        }
      }
      if (!lca.empty()) wrap.insert(lca);
      std::string sites_str, dropped_str;
      for (const auto& s : where) sites_str += (sites_str.empty() ? "'" : ", '") + s + "'";
      for (const auto& d : dropped) dropped_str += (dropped_str.empty() ? "'" : ", '") + d + "'";
      plan.notes.push_back(c10::str("parameter ", first_name[key], " is shared by ", sites_str, ": sharded with ",
                                    lca.empty() ? std::string("the root") : "'" + lca + "'",
                                    dropped.empty() ? "" : " instead of " + dropped_str));
      changed = true;
      break;  // `owner` changed: rescan
    }
  }

  std::vector<std::string> ordered;
  for (const auto& fqn : t.order) {
    if (!fqn.empty() && wrap.count(fqn)) ordered.push_back(fqn);
  }
  // Bottom-up: deeper modules first (fully_shard requires children before their parents), pre-order otherwise.
  std::stable_sort(ordered.begin(), ordered.end(),
                   [](const std::string& a, const std::string& b) { return depth(a) > depth(b); });
  ordered.push_back("");
  plan.fqns = std::move(ordered);
  plan.checkpoint = checkpoint_targets(t, c, plan.fqns);
  if (!plan.checkpoint.empty()) {
    std::string list;
    for (const auto& f : plan.checkpoint) list += (list.empty() ? "'" : ", '") + f + "'";
    plan.notes.push_back("activation checkpointing: " + list);
  }
  return plan;
}

std::unordered_set<const c10::TensorImpl*> ignored_param_set(const Fsdp1Config& c) {
  std::unordered_set<const c10::TensorImpl*> out;
  for (const auto& m : c.ignored_modules) {
    if (!m) continue;
    for (const auto& p : m->parameters(/*recurse=*/true)) out.insert(p.unsafeGetTensorImpl());
  }
  for (const auto& p : c.ignored_states) {
    TORCH_CHECK(p.defined(), kWhere, "ignored_states holds an undefined tensor");
    out.insert(p.unsafeGetTensorImpl());
  }
  return out;
}

// ---- topology -------------------------------------------------------------------------------------------

int64_t env_int(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  return end != nullptr && *end == '\0' && x > 0 ? x : 0;
}

c10::DeviceType mesh_device_type(const Fsdp1Config& c) {
  if (c.device_id) return c.device_id->type();
  return world()->device().type();
}

DeviceMesh make_mesh(const Fsdp1Config& c) {
  const ShardingStrategy s = c.sharding_strategy;
  const bool hybrid = s == ShardingStrategy::HYBRID_SHARD || s == ShardingStrategy::HYBRID_SHARD_ZERO2;
  if (c.device_mesh.valid()) {
    const DeviceMesh& m = c.device_mesh;
    if (hybrid) {
      TORCH_CHECK(m.ndim() == 2, kWhere, to_string(s), " needs a 2-D (replicate, shard) device_mesh, got ",
                  m.to_string());
      TORCH_CHECK(c.hybrid_replicate_degree == 0 || c.hybrid_replicate_degree == m.size(0), kWhere,
                  "hybrid_replicate_degree=", c.hybrid_replicate_degree, " disagrees with device_mesh ",
                  m.to_string(), " (replicate dim ", m.size(0), ")");
      return m;
    }
    if (s == ShardingStrategy::NO_SHARD) {
      if (m.ndim() == 2) {
        TORCH_CHECK(m.size(1) == 1, kWhere, "NO_SHARD replicates every parameter: a 2-D device_mesh must have a "
                    "shard dim of size 1, got ", m.to_string(), " (use HYBRID_SHARD to shard within groups)");
        return m;
      }
      TORCH_CHECK(m.ndim() == 1, kWhere, "NO_SHARD needs a 1-D device_mesh, got ", m.to_string());
      // Same ranks, seen as (replicate = all, shard = 1). Collective over the world, like the mesh itself.
      return DeviceMesh(m.device_type(), {m.size(), 1}, {"replicate", "shard"}, m.ranks());
    }
    TORCH_CHECK(m.ndim() == 1, kWhere, to_string(s), " shards over a 1-D device_mesh, got ", m.to_string(),
                ": a 2-D mesh is HSDP, use HYBRID_SHARD (or _HYBRID_SHARD_ZERO2)");
    return m;
  }
  const int64_t world_size = world()->size();
  const c10::DeviceType type = mesh_device_type(c);
  switch (s) {
    case ShardingStrategy::FULL_SHARD:
    case ShardingStrategy::SHARD_GRAD_OP:
      TORCH_CHECK(c.hybrid_replicate_degree == 0 || c.hybrid_replicate_degree == 1, kWhere,
                  "hybrid_replicate_degree=", c.hybrid_replicate_degree, " is only meaningful with HYBRID_SHARD or "
                  "_HYBRID_SHARD_ZERO2 (", to_string(s), " shards over the whole world)");
      return DeviceMesh(type, {world_size}, {"shard"});
    case ShardingStrategy::NO_SHARD:
      TORCH_CHECK(c.hybrid_replicate_degree == 0 || c.hybrid_replicate_degree == world_size, kWhere,
                  "NO_SHARD replicates over the whole world; hybrid_replicate_degree=", c.hybrid_replicate_degree,
                  " would leave some parameters sharded (use HYBRID_SHARD)");
      return DeviceMesh(type, {world_size, 1}, {"replicate", "shard"});
    case ShardingStrategy::HYBRID_SHARD:
    case ShardingStrategy::HYBRID_SHARD_ZERO2: {
      int64_t replicas = c.hybrid_replicate_degree;
      if (replicas == 0) {
        // FSDP1's default: shard within a node, replicate across nodes.
        const int64_t local = env_int("LOCAL_WORLD_SIZE");
        TORCH_CHECK(local > 0, kWhere, to_string(s), " needs a replicate size: set hybrid_replicate_degree (a "
                    "divisor of the world size ", world_size, ") or device_mesh; FSDP1's default (shard within a "
                    "node) needs LOCAL_WORLD_SIZE, which is not set");
        TORCH_CHECK(world_size % local == 0, kWhere, to_string(s), ": LOCAL_WORLD_SIZE=", local,
                    " does not divide the world size ", world_size, "; set hybrid_replicate_degree");
        replicas = world_size / local;
      }
      TORCH_CHECK(replicas > 0 && world_size % replicas == 0, kWhere, to_string(s), ": hybrid_replicate_degree=",
                  replicas, " must divide the world size ", world_size, " (replicas x shard size = world)");
      return DeviceMesh(type, {replicas, world_size / replicas}, {"replicate", "shard"});
    }
  }
  TORCH_CHECK(false, kWhere, "unknown sharding strategy");
}

// ---- side effects before sharding ---------------------------------------------------------------------

void broadcast_from_rank0(torch::nn::Module& model) {
  c10::NoGradGuard no_grad;
  auto group = world();
  auto sync = [&](const at::Tensor& t) {
    if (!t.defined() || t.is_meta() || t.numel() == 0) return;
    at::Tensor data = t.detach();
    if (data.is_contiguous()) {
      group->broadcast(data, 0).wait();
    } else {
      at::Tensor tmp = data.contiguous();
      group->broadcast(tmp, 0).wait();
      data.copy_(tmp);
    }
  };
  for (const auto& p : model.parameters(/*recurse=*/true)) sync(p);
  for (const auto& b : model.buffers(/*recurse=*/true)) sync(b);
}

bool holds_meta_directly(const torch::nn::Module& m) {
  for (const auto& p : m.parameters(/*recurse=*/false)) {
    if (p.defined() && p.is_meta()) return true;
  }
  for (const auto& b : m.buffers(/*recurse=*/false)) {
    if (b.defined() && b.is_meta()) return true;
  }
  return false;
}

}  // namespace

ShardingStrategy parse_sharding_strategy(std::string_view name) {
  std::string s(name);
  if (auto dot = s.rfind('.'); dot != std::string::npos) s = s.substr(dot + 1);  // "ShardingStrategy.X"
  for (auto& ch : s) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  while (!s.empty() && s.front() == '_') s.erase(s.begin());
  if (s == "FULL_SHARD" || s == "1") return ShardingStrategy::FULL_SHARD;
  if (s == "SHARD_GRAD_OP" || s == "2") return ShardingStrategy::SHARD_GRAD_OP;
  if (s == "NO_SHARD" || s == "3") return ShardingStrategy::NO_SHARD;
  if (s == "HYBRID_SHARD" || s == "4") return ShardingStrategy::HYBRID_SHARD;
  if (s == "HYBRID_SHARD_ZERO2" || s == "5") return ShardingStrategy::HYBRID_SHARD_ZERO2;
  TORCH_CHECK(false, "unknown FSDP1 sharding strategy '", std::string(name), "'; expected one of FULL_SHARD, "
              "SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, _HYBRID_SHARD_ZERO2 (or their enum values 1-5)");
}

const char* to_string(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::FULL_SHARD: return "FULL_SHARD";
    case ShardingStrategy::SHARD_GRAD_OP: return "SHARD_GRAD_OP";
    case ShardingStrategy::NO_SHARD: return "NO_SHARD";
    case ShardingStrategy::HYBRID_SHARD: return "HYBRID_SHARD";
    case ShardingStrategy::HYBRID_SHARD_ZERO2: return "_HYBRID_SHARD_ZERO2";
  }
  return "?";
}

std::vector<std::string> plan_fully_shard(const torch::nn::Module& model, const Fsdp1Config& config,
                                          std::vector<std::string>* notes) {
  check_removed_arguments(config);
  Tree tree = read_tree(model, config);
  Plan plan = make_plan(tree, config, ignored_param_set(config));
  if (notes) *notes = plan.notes;
  return plan.fqns;
}

PreparedModule prepare_fully_shard(const std::shared_ptr<torch::nn::Module>& model, const Fsdp1Config& config) {
  TORCH_CHECK(model != nullptr, kWhere, "null model");
  // Every check first: a rejected config leaves the model untouched.
  check_removed_arguments(config);
  Tree tree = read_tree(*model, config);
  for (const auto& fqn : tree.order) {
    TORCH_CHECK(!fsdp_module(tree.at(fqn)), kWhere, "module '", fqn.empty() ? std::string("<root>") : fqn,
                "' is already sharded: prepare_fully_shard applies fully_shard to the whole model itself");
  }
  const auto ignored = ignored_param_set(config);
  Plan plan = make_plan(tree, config, ignored);

  PreparedModule out;
  out.notes = plan.notes;
  out.mesh = make_mesh(config);
  const ShardingStrategy s = config.sharding_strategy;
  const bool zero3 = s == ShardingStrategy::FULL_SHARD || s == ShardingStrategy::HYBRID_SHARD;

  FullyShardOptions opts;
  opts.mesh = out.mesh;
  // FULL_SHARD / HYBRID_SHARD free after forward (the root keeps its parameters for backward, as in FSDP1);
  // SHARD_GRAD_OP / _HYBRID_SHARD_ZERO2 keep them until backward; NO_SHARD has nothing to free (shard dim 1),
  // and keeping avoids copying the full parameters in again for backward.
  opts.reshard_after_forward = ReshardAfterForward(zero3);
  opts.offload_policy.cpu_offload = config.cpu_offload;
  opts.ignored_params.assign(config.ignored_states.begin(), config.ignored_states.end());
  for (const auto& m : config.ignored_modules) {
    for (const auto& p : m->parameters(/*recurse=*/true)) opts.ignored_params.push_back(p);
  }
  bool cast_root_inputs = false;
  if (config.mixed_precision) {
    const auto& mp = *config.mixed_precision;
    opts.mp_policy.param_dtype = mp.param_dtype;
    opts.mp_policy.reduce_dtype = mp.reduce_dtype;
    opts.mp_policy.cast_forward_inputs = mp.cast_forward_inputs;
    cast_root_inputs = mp.cast_forward_inputs || mp.cast_root_forward_inputs;
    // FSDP1's semantics (kept in buffer_dtype for training, original dtype in state dicts); every unit sets it,
    // so every buffer is covered by the unit that manages it.
    opts.mp_policy.buffer_dtype = mp.buffer_dtype;
  }
  if (config.device_id) {
    bool any_meta = false;
    for (const auto& p : model->parameters()) any_meta = any_meta || p.is_meta();
    // Meta parameters stay on meta: param_init_fn materializes them on device_id after sharding.
    if (!any_meta) model->to(*config.device_id);
  }
  if (config.sync_module_states) broadcast_from_rank0(*model);

  std::vector<std::shared_ptr<torch::nn::Module>> to_init;  // FSDP1: modules holding meta tensors directly
  if (config.param_init_fn) {
    for (const auto& fqn : tree.order) {
      if (!tree.is_ignored(fqn) && holds_meta_directly(tree.at(fqn))) {
        to_init.push_back(fqn.empty() ? std::shared_ptr<torch::nn::Module>() : tree.modules.at(fqn));
      }
    }
  }

  // Before sharding, as Composer and TorchTitan do (either order works with checkpoint_module).
  for (const auto& fqn : plan.checkpoint) {
    checkpoint_module(tree.modules.at(fqn), config.activation_checkpointing_options);
    out.checkpointed.push_back(fqn);
  }

  for (const auto& fqn : plan.fqns) {
    FullyShardOptions unit_opts = opts;
    if (fqn.empty()) {
      if (zero3) unit_opts.reshard_after_forward.reset();  // root default: keep for backward
      unit_opts.mp_policy.cast_forward_inputs = cast_root_inputs;
      out.units.push_back(fully_shard(model, unit_opts));
    } else {
      out.units.push_back(fully_shard(tree.modules.at(fqn), unit_opts));
    }
    out.fqns.push_back(fqn);
  }

  if (config.param_init_fn && !to_init.empty()) {
    materialize_module(*model, config.device_id.value_or(c10::Device(c10::kCPU)));
    auto scope = full_params_init_scope(*model);
    for (const auto& m : to_init) {
      torch::nn::Module& target = m ? *m : *model;
      scope(target, [&] { config.param_init_fn(target); });
    }
  }
  return out;
}

}  // namespace fsdp
