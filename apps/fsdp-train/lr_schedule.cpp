// See lr_schedule.h.
#include "lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace fsdp_train {

LRSchedule LRSchedule::build(int64_t training_steps, int64_t warmup_steps, const double* decay_ratio,
                             DecayType decay_type, double min_lr_factor) {
  LRSchedule s;
  s.warmup_steps = std::min(warmup_steps, training_steps);
  if (decay_ratio) {
    // Python round(): half to even (nearbyint in the default rounding mode).
    s.decay_steps = static_cast<int64_t>(std::nearbyint(static_cast<double>(training_steps) * *decay_ratio));
    s.decay_steps = std::min(s.decay_steps, training_steps - s.warmup_steps);
  } else {
    s.decay_steps = training_steps - s.warmup_steps;
  }
  s.stable_steps = training_steps - s.warmup_steps - s.decay_steps;
  s.decay_type = decay_type;
  s.min_lr_factor = min_lr_factor;
  return s;
}

double LRSchedule::factor(int64_t step) const {
  const int64_t warmup_stable = warmup_steps + stable_steps;
  // Past the last step the factor is undefined; TorchTitan clamps to the end of the schedule.
  step = std::min(step, warmup_stable + decay_steps);
  if (step < warmup_steps) return static_cast<double>(step + 1) / static_cast<double>(warmup_steps + 1);
  if (step < warmup_stable || decay_steps == 0) return 1.0;
  const double progress = static_cast<double>(step + 1 - warmup_stable) / static_cast<double>(decay_steps + 1);
  double adj = 1.0 - progress;  // linear
  if (decay_type == DecayType::Sqrt) adj = 1.0 - std::sqrt(progress);
  else if (decay_type == DecayType::Cosine) adj = 0.5 * (1.0 + std::cos(M_PI * progress));
  return min_lr_factor + (1.0 - min_lr_factor) * adj;
}

}  // namespace fsdp_train
