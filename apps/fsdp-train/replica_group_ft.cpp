// See replica_group_ft.h.
#include "replica_group_ft.h"

#include "data.h"

#include <fsdp/checkpoint/optimizer.h>
#include <fsdp/fault_tolerance.h>
#include <fsdp/fully_shard.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace fsdp_train {
namespace ckpt = fsdp::checkpoint;

namespace {

std::string ids(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

fsdp::ft::ManagerOptions manager_options(const JobConfig& config) {
  const auto& f = config.fault_tolerance;
  check_coordinator_given(config);
  fsdp::ft::ManagerOptions o;
  o.replica_id = static_cast<int>(f.replica_id);
  o.lighthouse = f.lighthouse;
  o.min_replicas = static_cast<int>(f.min_replica_size);
  // A round closes as soon as all group_size groups joined (no join timeout to sit out in the common case).
  o.expected_replicas = static_cast<int>(f.group_size);
  o.join_timeout = std::chrono::milliseconds(f.join_timeout_ms);
  o.quorum_timeout = std::chrono::seconds(f.quorum_timeout_seconds);
  o.timeout = std::chrono::milliseconds(f.process_group_timeout_ms);
  return o;
}

}  // namespace

void check_coordinator_given(const JobConfig& config) {
  const char* env = std::getenv("FSDP_LIGHTHOUSE");
  if (config.fault_tolerance.lighthouse.empty() && !(env && *env))
    throw ConfigError("config error: fault_tolerance.enable needs the coordinator: start fsdp-lighthouse and pass the "
                      "host:port it prints as fault_tolerance.lighthouse or in the environment variable FSDP_LIGHTHOUSE");
}

struct FaultTolerance::Impl {
  const JobConfig& config;
  bool say;
  fsdp::ft::Manager manager;
  std::vector<int> members;
  std::vector<int> last_members;  // of the previous committed step (membership changes are printed)
  int64_t started_from = -1;      // the step of the checkpoint loaded at start-up, -1 = none

  Impl(const JobConfig& c, fsdp::ProcessGroupPtr group, bool s)
      : config(c), say(s), manager(manager_options(c), std::move(group)) {}

  // The state a healing group receives: the model's and the optimizer's entries of a checkpoint (each rank its
  // shards; both sides build the same dict, so the sorted keys line up), in key order. The optimizer's missing
  // state is created first (zeros), so a fresh group has tensors to receive into.
  struct HealingState {
    ckpt::StateDict dict;
    std::vector<at::Tensor> tensors;
    int64_t bytes = 0;
  };
  static HealingState healing_state(TrainState& s) {
    HealingState h;
    h.dict = ckpt::model_state_dict(s.parts);
    h.dict.merge(ckpt::optimizer_state_dict(s.parts, *s.optimizer));
    for (auto& [key, t] : h.dict.tensors) h.tensors.push_back(t.local());
    for (auto& [key, t] : h.dict.full) h.tensors.push_back(t);
    for (const auto& t : h.tensors) h.bytes += static_cast<int64_t>(t.numel() * t.element_size());
    return h;
  }
};

FaultTolerance::FaultTolerance(const JobConfig& config, fsdp::ProcessGroupPtr replica_group, bool say)
    : impl_(std::make_unique<Impl>(config, std::move(replica_group), say)) {}

FaultTolerance::~FaultTolerance() = default;

void FaultTolerance::attach(std::vector<fsdp::FSDPModule>& modules) {
  for (auto& m : modules) m.set_all_reduce_hook([this](at::Tensor& reduced) { impl_->manager.allreduce_average(reduced); });
}

bool FaultTolerance::begin_step(TrainState& state) {
  Impl& m = *impl_;
  const fsdp::ft::Quorum& q = m.manager.start_quorum(state.step);
  m.members = q.replica_ids;
  if (!q.heal && q.heal_targets.empty()) return true;
  const auto t0 = std::chrono::steady_clock::now();
  Impl::HealingState h = Impl::healing_state(state);
  if (!q.heal) {
    // The data position is the step: under the data rule every group's batches are a function of (step, group).
    // Hyperparameters and step counters travel with it (they are values of the dict, not tensors).
    const nlohmann::json blob = {{"values", h.dict.values}, {"ntokens_seen", state.ntokens_seen},
                                 {"data_step", state.step}};
    m.manager.send_state(h.tensors, state.step, blob.dump());
    if (m.say) {
      std::printf("ft: replica %d sends its state at step %lld (%zu tensors, %.2f MB per rank) to replica index %s\n",
                  static_cast<int>(m.config.fault_tolerance.replica_id), static_cast<long long>(state.step),
                  h.tensors.size(), static_cast<double>(h.bytes) / 1e6, ids(q.heal_targets).c_str());
      std::fflush(stdout);
    }
    return m.manager.error().empty();
  }
  const int64_t behind = state.step;
  auto healed = m.manager.receive_state(h.tensors);
  if (!healed) {
    if (m.say) {
      std::printf("ft: replica %d could not heal at step %lld: %s\n", static_cast<int>(m.config.fault_tolerance.replica_id),
                  static_cast<long long>(state.step), m.manager.error().c_str());
      std::fflush(stdout);
    }
    return false;
  }
  const nlohmann::json blob = nlohmann::json::parse(healed->data_position);
  for (const auto& [key, value] : blob.at("values").items()) h.dict.values[key] = value.get<std::string>();
  // Tensors that alias the model and the optimizer were received in place; the rest (step counters) and the values
  // are applied here.
  ckpt::load_model_state_dict(state.parts, h.dict);
  ckpt::load_optimizer_state_dict(state.parts, *state.optimizer, h.dict);
  state.step = healed->step;
  state.ntokens_seen = blob.at("ntokens_seen").get<int64_t>();
  state.data->seek_step(blob.at("data_step").get<int64_t>());
  if (m.say) {
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // Healing is a network transfer; whether this group read a checkpoint before it is said as it happened.
    const std::string disk = m.started_from < 0
                                 ? std::string("no checkpoint read")
                                 : "over the network (this group loaded its checkpoint of step " +
                                       std::to_string(m.started_from) + " at start-up)";
    std::printf("ft: replica %d healed from replica %d: step %lld -> %lld, %zu tensors (%.2f MB per rank) in %.3f s, "
                "%s\n",
                static_cast<int>(m.config.fault_tolerance.replica_id), q.replica_ids.at(q.heal_source),
                static_cast<long long>(behind), static_cast<long long>(state.step), h.tensors.size(),
                static_cast<double>(h.bytes) / 1e6, dt, disk.c_str());
    std::fflush(stdout);
  }
  return true;
}

void FaultTolerance::average_gradients(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty()) return;
  std::vector<at::Tensor> flat;
  for (const auto& g : grads) flat.push_back(g.reshape({-1}));
  at::Tensor buffer = at::cat(flat);
  impl_->manager.allreduce_average(buffer);
  int64_t offset = 0;
  for (auto& g : grads) {
    g.copy_(buffer.narrow(0, offset, g.numel()).view_as(g));
    offset += g.numel();
  }
}

double FaultTolerance::average(double value) {
  at::Tensor t = at::full({1}, value, at::kDouble);
  impl_->manager.allreduce_average(t);
  return t.item<double>();
}

void FaultTolerance::sum_counts(at::Tensor& counts) {
  // The Manager averages; counts times the number of members, rounded back to the integers they are (fp64: exact
  // for any count a step can reach).
  at::Tensor t = counts.to(at::kCPU, at::kDouble);
  impl_->manager.allreduce_average(t);
  t = (t * static_cast<double>(impl_->members.size())).round_();
  counts.copy_(t.to(counts.device(), counts.scalar_type()));
}

bool FaultTolerance::commit(bool local_ok, int64_t step) {
  Impl& m = *impl_;
  const bool ok = m.manager.should_commit(local_ok);
  if (m.say && !ok) {
    std::printf("ft: step %lld discarded by replicas %s (retried with the next quorum): %s\n",
                static_cast<long long>(step), ids(m.members).c_str(), m.manager.error().c_str());
  } else if (m.say && m.members != m.last_members) {
    std::printf("ft: step %lld trained by replicas %s\n", static_cast<long long>(step), ids(m.members).c_str());
  }
  if (ok) m.last_members = m.members;
  std::fflush(stdout);
  return ok;
}

const std::vector<int>& FaultTolerance::members() const { return impl_->members; }

void FaultTolerance::set_started_from(int64_t checkpoint_step) { impl_->started_from = checkpoint_step; }

}  // namespace fsdp_train
