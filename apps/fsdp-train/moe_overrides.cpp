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
  }
}

}  // namespace fsdp_train
