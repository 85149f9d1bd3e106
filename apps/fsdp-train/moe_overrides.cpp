// See moe_overrides.h.
#include "moe_overrides.h"

#include <fsdp/models/moe.h>

namespace fsdp_train {

void apply_moe_overrides(const JobConfig::Model& m, fsdp::models::moe::MoEOptions& o) {
  if (m.moe_score_func != MoeScoreFunc::FlavorDefault) o.score_func = to_string(m.moe_score_func);  // libfsdp's names
  if (m.moe_shared_experts >= 0) o.num_shared_experts = m.moe_shared_experts;
  if (m.moe_route_norm != MoeRouteNorm::FlavorDefault) o.route_norm = m.moe_route_norm == MoeRouteNorm::On;
  if (m.moe_route_scale != 0) o.route_scale = m.moe_route_scale;
  if (m.moe_load_balance_coeff == 0) o.load_balance_coeff.reset();
  else if (m.moe_load_balance_coeff > 0) o.load_balance_coeff = m.moe_load_balance_coeff;
  if (m.moe_sequence_aux_loss_coeff > 0) o.sequence_aux_loss_coeff = m.moe_sequence_aux_loss_coeff;
  if (m.moe_num_expert_groups > 0) {
    o.num_expert_groups = m.moe_num_expert_groups;
    o.num_limited_groups = m.moe_num_limited_groups;
    // The MoE layer's rules for the groups (fsdp/models/moe.h), in the keys' words and before any process group
    // (every family's check_layout builds these options); the layer used to refuse them after the rendezvous.
    const int64_t experts = o.num_experts, groups = o.num_expert_groups, limited = o.num_limited_groups;
    if (experts % groups != 0 || experts / groups < 2) {
      throw ConfigError("config error: model.moe_num_expert_groups = " + std::to_string(groups) + " must divide the " +
                        std::to_string(experts) + " routed experts into groups of at least 2 experts");
    }
    if (limited < 1 || limited > groups) {
      throw ConfigError("config error: model.moe_num_limited_groups = " + std::to_string(limited) +
                        " must be in [1, model.moe_num_expert_groups = " + std::to_string(groups) + "]");
    }
    if (o.top_k > limited * (experts / groups)) {
      throw ConfigError("config error: model.moe_num_limited_groups = " + std::to_string(limited) + " groups of " +
                        std::to_string(experts / groups) + " experts hold fewer than the top_k = " +
                        std::to_string(o.top_k) + " experts each token is routed to");
    }
  }
}

}  // namespace fsdp_train
