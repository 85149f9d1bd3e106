#pragma once
// The [model] moe_* keys over a flavor's MoE layer options, for every family with MoE layers (the MoE layer,
// fsdp/models/moe.h, is shared: model_spec.h).

#include "config.h"

namespace fsdp::models::moe {
struct MoEOptions;
}

namespace fsdp_train {

// A key at its "the flavor's" value keeps the flavor's. moe_sequence_aux_loss_coeff > 0 sets the sequence aux
// loss; 0 leaves the flavor's coefficient to the family. Expert groups the flavor's experts cannot form are a
// ConfigError naming the key (the families' check_layout build these options before any process group).
void apply_moe_overrides(const JobConfig::Model& model, fsdp::models::moe::MoEOptions& options);

}  // namespace fsdp_train
