#pragma once
// TorchTitan's learning-rate schedule (torchtitan/components/lr_scheduler.py, linear_warmup_stable_decay):
// linear warmup, a stable phase, then linear / sqrt / cosine decay to min_lr_factor. It is a LambdaLR factor:
// the lr of training step s (1-based) is lr * factor(s - 1). No torch headers.

#include "config.h"  // DecayType

#include <cstdint>

namespace fsdp_train {

struct LRSchedule {
  int64_t warmup_steps = 0, stable_steps = 0, decay_steps = 0;
  DecayType decay_type = DecayType::Linear;
  double min_lr_factor = 0.0;

  // TorchTitan's build_lr_schedulers: warmup capped at the step count; decay_ratio unset = decay after warmup;
  // warmup + decay capped at the step count; the rest is stable.
  static LRSchedule build(int64_t training_steps, int64_t warmup_steps, const double* decay_ratio,
                          DecayType decay_type, double min_lr_factor);

  // The multiplicative factor for 0-based scheduler step `current_step`.
  double factor(int64_t current_step) const;
};

}  // namespace fsdp_train
