// Model and optimizer state dicts keyed by FQN (see include/fsdp/checkpoint/optimizer.h).
#include <fsdp/checkpoint/optimizer.h>

#include <fsdp/fully_shard.h>
#include <fsdp/state_dict.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

namespace fsdp::checkpoint {
namespace {

bool uses_fully_shard(torch::nn::Module& model) {
  for (const auto& m : model.modules(/*include_self=*/true)) {
    if (fsdp_module(*m).has_value()) return true;
  }
  return false;
}

// How a parameter's state tensors are laid out: like the parameter in the model state dict.
struct Layout {
  std::string fqn;
  const ShardedTensor* sharded = nullptr;  // fully_shard models
};

struct ParamIndex {
  StateDict model;  // keeps the ShardedTensors Layout points into
  std::unordered_map<const c10::TensorImpl*, Layout> by_impl;
};

ParamIndex index_params(const ModelParts& parts) {
  ParamIndex idx;
  idx.model = model_state_dict(parts);
  for (torch::nn::Module* model : parts) {
    for (const auto& item : model->named_parameters(/*recurse=*/true)) {
      const auto* impl = item.value().unsafeGetTensorImpl();
      if (idx.by_impl.count(impl)) continue;  // tied: first FQN
      Layout l;
      l.fqn = item.key();
      auto it = idx.model.tensors.find(item.key());
      if (it != idx.model.tensors.end()) l.sharded = &it->second;
      idx.by_impl.emplace(impl, l);
    }
  }
  return idx;
}

const Layout& layout_of(const ParamIndex& idx, const at::Tensor& p) {
  auto it = idx.by_impl.find(p.unsafeGetTensorImpl());
  TORCH_CHECK(it != idx.by_impl.end(), "checkpoint: the optimizer holds a parameter of shape ", p.sizes(),
              " that is not a parameter of the model");
  return it->second;
}

// Adds a state tensor of parameter `l` under `key`, laid out like the parameter.
void add_tensor(StateDict& sd, const std::string& key, const Layout& l, const at::Tensor& t) {
  if (!l.sharded) {
    sd.full.emplace(key, t);
    return;
  }
  TORCH_CHECK(t.sizes() == l.sharded->local().sizes(), "checkpoint: optimizer state '", key, "' has shape ", t.sizes(),
              " but the parameter's local shard is ", l.sharded->local().sizes());
  sd.tensors.emplace(key, ShardedTensor::from_local(t, l.sharded->mesh(), l.sharded->placements(), l.sharded->sizes()));
}

void add_step(StateDict& sd, const std::string& key, const Layout& l, int64_t step) {
  at::Tensor t = at::scalar_tensor(step, at::kLong);
  if (!l.sharded) {
    sd.full.emplace(key, t);
    return;
  }
  sd.tensors.emplace(key, ShardedTensor::from_local(t, l.sharded->mesh(),
                                                    Placements(l.sharded->placements().size(), Replicate()), {}));
}

const at::Tensor* find_tensor(const StateDict& sd, const std::string& key) {
  auto t = sd.tensors.find(key);
  if (t != sd.tensors.end()) return &t->second.local();
  auto f = sd.full.find(key);
  if (f != sd.full.end()) return &f->second;
  return nullptr;
}

void copy_state(const StateDict& sd, const std::string& key, at::Tensor& dst) {
  const at::Tensor* src = find_tensor(sd, key);
  if (!src || !dst.defined()) return;
  if (src->is_same(dst)) return;
  TORCH_CHECK(src->sizes() == dst.sizes(), "checkpoint: optimizer state '", key, "' has shape ", src->sizes(),
              " but the optimizer's is ", dst.sizes());
  dst.copy_(*src);
}

std::optional<nlohmann::json> find_value(const StateDict& sd, const std::string& key) {
  auto it = sd.values.find(key);
  if (it == sd.values.end()) return std::nullopt;
  try {
    return nlohmann::json::parse(it->second);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "checkpoint: value '", key, "' is not valid JSON: ", e.what());
  }
}

// What a hyperparameter value must be, in words, checked before converting (nlohmann's own error names neither
// the key nor the rule). Numbers convert to numbers, booleans only from booleans, lists of numbers element-wise.
bool has_type(const nlohmann::json& v, const double*) { return v.is_number(); }
bool has_type(const nlohmann::json& v, const bool*) { return v.is_boolean(); }
bool has_type(const nlohmann::json& v, const std::vector<double>*) {
  return v.is_array() && std::all_of(v.begin(), v.end(), [](const nlohmann::json& x) { return x.is_number(); });
}
const char* type_rule(const double*) { return "must be a number"; }
const char* type_rule(const bool*) { return "must be true or false"; }
const char* type_rule(const std::vector<double>*) { return "must be a list of numbers"; }

template <class T>
void set_if(const StateDict& sd, const std::string& key, T& out) {
  if (auto v = find_value(sd, key)) {
    TORCH_CHECK(has_type(*v, &out), "checkpoint: value '", key, "' ", type_rule(&out), ", is a ", v->type_name());
    out = v->get<T>();
  }
}

// Parameter-state flavours.
// The param_group entries torch.optim has and libtorch does not (their values are what libtorch's optimizers
// do): PyTorch's dcp.load requires every key of its state dict, so a TorchTitan run loading our checkpoint
// needs them. Loading ignores them.
void pytorch_only_entries(StateDict& sd, const std::string& pg, bool sgd, bool decoupled_weight_decay) {
  sd.values[pg + "maximize"] = "false";
  sd.values[pg + "foreach"] = "null";
  sd.values[pg + "differentiable"] = "false";
  sd.values[pg + "fused"] = "null";
  if (sgd) return;
  sd.values[pg + "capturable"] = "false";
  sd.values[pg + "decoupled_weight_decay"] = decoupled_weight_decay ? "true" : "false";
}

template <class State, class Options>
void adam_entries(torch::optim::Optimizer& optim, const ParamIndex& idx, const std::string& prefix, StateDict& sd,
                  bool decoupled_weight_decay) {
  for (auto& group : optim.param_groups()) {
    auto& o = static_cast<Options&>(group.options());
    for (auto& p : group.params()) {
      const Layout& l = layout_of(idx, p);
      auto& slot = optim.state()[p.unsafeGetTensorImpl()];
      if (!slot) {  // what Adam::step creates on first use
        auto s = std::make_unique<State>();
        s->step(0);
        s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
        s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        if (o.amsgrad()) s->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        slot = std::move(s);
      }
      auto& s = static_cast<State&>(*slot);
      const std::string st = prefix + ".state." + l.fqn + ".";
      add_tensor(sd, st + "exp_avg", l, s.exp_avg());
      add_tensor(sd, st + "exp_avg_sq", l, s.exp_avg_sq());
      if (s.max_exp_avg_sq().defined()) add_tensor(sd, st + "max_exp_avg_sq", l, s.max_exp_avg_sq());
      add_step(sd, st + "step", l, s.step());
      const std::string pg = prefix + ".param_groups." + l.fqn + ".";
      sd.values[pg + "lr"] = nlohmann::json(o.lr()).dump();
      sd.values[pg + "betas"] = nlohmann::json({std::get<0>(o.betas()), std::get<1>(o.betas())}).dump();
      sd.values[pg + "eps"] = nlohmann::json(o.eps()).dump();
      sd.values[pg + "weight_decay"] = nlohmann::json(o.weight_decay()).dump();
      sd.values[pg + "amsgrad"] = nlohmann::json(o.amsgrad()).dump();
      pytorch_only_entries(sd, pg, /*sgd=*/false, decoupled_weight_decay);
    }
  }
}

template <class State, class Options>
void adam_load(torch::optim::Optimizer& optim, const ParamIndex& idx, const std::string& prefix, const StateDict& sd) {
  for (auto& group : optim.param_groups()) {
    auto& o = static_cast<Options&>(group.options());
    bool first = true;
    for (auto& p : group.params()) {
      const Layout& l = layout_of(idx, p);
      auto it = optim.state().find(p.unsafeGetTensorImpl());
      const std::string st = prefix + ".state." + l.fqn + ".";
      if (it != optim.state().end()) {
        auto& s = static_cast<State&>(*it->second);
        at::Tensor ea = s.exp_avg(), eas = s.exp_avg_sq(), mx = s.max_exp_avg_sq();
        copy_state(sd, st + "exp_avg", ea);
        copy_state(sd, st + "exp_avg_sq", eas);
        if (!mx.defined() && find_tensor(sd, st + "max_exp_avg_sq")) {
          mx = at::zeros_like(p, at::MemoryFormat::Preserve);
          s.max_exp_avg_sq(mx);
        }
        copy_state(sd, st + "max_exp_avg_sq", mx);
        if (const at::Tensor* step = find_tensor(sd, st + "step")) s.step(step->item<int64_t>());
      }
      if (!first) continue;  // one set of hyperparameters per group (TorchTitan repeats them per parameter)
      first = false;
      const std::string pg = prefix + ".param_groups." + l.fqn + ".";
      double lr = o.lr(), eps = o.eps(), wd = o.weight_decay();
      bool ams = o.amsgrad();
      std::vector<double> betas = {std::get<0>(o.betas()), std::get<1>(o.betas())};
      set_if(sd, pg + "lr", lr);
      set_if(sd, pg + "eps", eps);
      set_if(sd, pg + "weight_decay", wd);
      set_if(sd, pg + "amsgrad", ams);
      set_if(sd, pg + "betas", betas);
      TORCH_CHECK(betas.size() == 2, "checkpoint: value '", pg, "betas' must hold two numbers");
      o.lr(lr).eps(eps).weight_decay(wd).amsgrad(ams).betas({betas[0], betas[1]});
    }
  }
}

void sgd_entries(torch::optim::Optimizer& optim, const ParamIndex& idx, const std::string& prefix, StateDict& sd) {
  for (auto& group : optim.param_groups()) {
    auto& o = static_cast<torch::optim::SGDOptions&>(group.options());
    for (auto& p : group.params()) {
      const Layout& l = layout_of(idx, p);
      if (o.momentum() != 0) {
        auto& slot = optim.state()[p.unsafeGetTensorImpl()];
        if (!slot) {  // PyTorch's _init_optim_state: a zero momentum buffer
          auto s = std::make_unique<torch::optim::SGDParamState>();
          s->momentum_buffer(at::zeros_like(p, at::MemoryFormat::Preserve));
          slot = std::move(s);
        }
        add_tensor(sd, prefix + ".state." + l.fqn + ".momentum_buffer", l,
                   static_cast<torch::optim::SGDParamState&>(*slot).momentum_buffer());
      }
      const std::string pg = prefix + ".param_groups." + l.fqn + ".";
      sd.values[pg + "lr"] = nlohmann::json(o.lr()).dump();
      sd.values[pg + "momentum"] = nlohmann::json(o.momentum()).dump();
      sd.values[pg + "dampening"] = nlohmann::json(o.dampening()).dump();
      sd.values[pg + "weight_decay"] = nlohmann::json(o.weight_decay()).dump();
      sd.values[pg + "nesterov"] = nlohmann::json(o.nesterov()).dump();
      pytorch_only_entries(sd, pg, /*sgd=*/true, false);
    }
  }
}

void sgd_load(torch::optim::Optimizer& optim, const ParamIndex& idx, const std::string& prefix, const StateDict& sd) {
  for (auto& group : optim.param_groups()) {
    auto& o = static_cast<torch::optim::SGDOptions&>(group.options());
    bool first = true;
    for (auto& p : group.params()) {
      const Layout& l = layout_of(idx, p);
      const std::string key = prefix + ".state." + l.fqn + ".momentum_buffer";
      if (find_tensor(sd, key)) {
        auto& slot = optim.state()[p.unsafeGetTensorImpl()];
        if (!slot) {
          auto s = std::make_unique<torch::optim::SGDParamState>();
          s->momentum_buffer(at::zeros_like(p, at::MemoryFormat::Preserve));
          slot = std::move(s);
        }
        at::Tensor buf = static_cast<torch::optim::SGDParamState&>(*slot).momentum_buffer();
        copy_state(sd, key, buf);
      }
      if (!first) continue;
      first = false;
      const std::string pg = prefix + ".param_groups." + l.fqn + ".";
      double lr = o.lr(), momentum = o.momentum(), dampening = o.dampening(), wd = o.weight_decay();
      bool nesterov = o.nesterov();
      set_if(sd, pg + "lr", lr);
      set_if(sd, pg + "momentum", momentum);
      set_if(sd, pg + "dampening", dampening);
      set_if(sd, pg + "weight_decay", wd);
      set_if(sd, pg + "nesterov", nesterov);
      o.lr(lr).momentum(momentum).dampening(dampening).weight_decay(wd).nesterov(nesterov);
    }
  }
}

enum class Kind { Adam, AdamW, SGD };
Kind kind_of(torch::optim::Optimizer& optim) {
  if (dynamic_cast<torch::optim::AdamW*>(&optim)) return Kind::AdamW;
  if (dynamic_cast<torch::optim::Adam*>(&optim)) return Kind::Adam;
  if (dynamic_cast<torch::optim::SGD*>(&optim)) return Kind::SGD;
  TORCH_CHECK(false, "checkpoint: optimizer state dicts support torch::optim::Adam, AdamW and SGD only");
}

}  // namespace

StateDict model_state_dict(torch::nn::Module& model) {
  StateDict sd;
  if (uses_fully_shard(model)) {
    for (auto& [k, v] : sharded_state_dict(model)) sd.tensors.emplace(k, std::move(v));
    return sd;
  }
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) sd.full.emplace(item.key(), item.value().detach());
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) sd.full.emplace(item.key(), item.value().detach());
  return sd;
}

StateDict model_state_dict(const ModelParts& parts) {
  TORCH_CHECK(!parts.empty(), "checkpoint::model_state_dict: no model parts");
  if (parts.size() == 1) return model_state_dict(*parts.front());
  StateDict sd;
  for (torch::nn::Module* part : parts) {
    TORCH_CHECK(part, "checkpoint::model_state_dict: a null model part");
    sd.merge(model_state_dict(*part));  // an FQN in two parts is an error naming it
  }
  return sd;
}

void load_model_state_dict(const ModelParts& parts, const StateDict& state) {
  for (torch::nn::Module* part : parts) load_model_state_dict(*part, state);
}

void load_model_state_dict(torch::nn::Module& model, const StateDict& state) {
  // Only the model's own keys: `state` may also hold optimizer and trainer entries.
  StateDict mine = model_state_dict(model);
  if (!mine.tensors.empty()) {
    ShardedStateDict sd;
    for (const auto& [k, v] : mine.tensors) {
      auto it = state.tensors.find(k);
      TORCH_CHECK(it != state.tensors.end(), "checkpoint::load_model_state_dict: missing key '", k, "'");
      sd.emplace(k, it->second);
    }
    load_sharded_state_dict(model, sd);
    return;
  }
  c10::NoGradGuard no_grad;
  for (auto& [k, dst] : mine.full) {
    auto it = state.full.find(k);
    TORCH_CHECK(it != state.full.end(), "checkpoint::load_model_state_dict: missing key '", k, "'");
    if (!it->second.is_same(dst)) dst.copy_(it->second);
  }
}

StateDict optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optim, const std::string& prefix) {
  return optimizer_state_dict(ModelParts{&model}, optim, prefix);
}

void load_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optim, const StateDict& state,
                               const std::string& prefix) {
  load_optimizer_state_dict(ModelParts{&model}, optim, state, prefix);
}

StateDict optimizer_state_dict(const ModelParts& parts, torch::optim::Optimizer& optim, const std::string& prefix) {
  const ParamIndex idx = index_params(parts);
  StateDict sd;
  c10::NoGradGuard no_grad;
  switch (kind_of(optim)) {
    case Kind::AdamW:
      adam_entries<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(optim, idx, prefix, sd, true);
      break;
    case Kind::Adam:
      adam_entries<torch::optim::AdamParamState, torch::optim::AdamOptions>(optim, idx, prefix, sd, false);
      break;
    case Kind::SGD:
      sgd_entries(optim, idx, prefix, sd);
      break;
  }
  return sd;
}

void load_optimizer_state_dict(const ModelParts& parts, torch::optim::Optimizer& optim, const StateDict& state,
                               const std::string& prefix) {
  const ParamIndex idx = index_params(parts);
  c10::NoGradGuard no_grad;
  switch (kind_of(optim)) {
    case Kind::AdamW:
      adam_load<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(optim, idx, prefix, state);
      break;
    case Kind::Adam:
      adam_load<torch::optim::AdamParamState, torch::optim::AdamOptions>(optim, idx, prefix, state);
      break;
    case Kind::SGD:
      sgd_load(optim, idx, prefix, state);
      break;
  }
}

}  // namespace fsdp::checkpoint
