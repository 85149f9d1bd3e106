// TorchTitan's warmup-stable-decay factor at chosen steps, computed by hand from the formula:
//   warmup (s < W):             (s + 1) / (W + 1)
//   stable (W <= s < W + St):   1
//   decay:                      p = (s + 1 - W - St) / (D + 1); linear 1 - p, sqrt 1 - sqrt(p), cosine (1 + cos(pi p)) / 2,
//                               then min + (1 - min) * that.
#include "lr_schedule.h"

#include <gtest/gtest.h>

#include <cmath>

using fsdp_train::DecayType;
using fsdp_train::LRSchedule;

TEST(LRSchedule, WarmupThenLinearDecayWithoutDecayRatio) {
  // steps 10, warmup 2, decay_ratio unset -> decay 8, stable 0.
  auto s = LRSchedule::build(10, 2, nullptr, DecayType::Linear, 0.0);
  EXPECT_EQ(s.warmup_steps, 2);
  EXPECT_EQ(s.decay_steps, 8);
  EXPECT_EQ(s.stable_steps, 0);
  EXPECT_DOUBLE_EQ(s.factor(0), 1.0 / 3);
  EXPECT_DOUBLE_EQ(s.factor(1), 2.0 / 3);
  EXPECT_DOUBLE_EQ(s.factor(2), 1.0 - 1.0 / 9);  // p = (3 - 2) / 9
  EXPECT_DOUBLE_EQ(s.factor(5), 1.0 - 4.0 / 9);
  EXPECT_DOUBLE_EQ(s.factor(9), 1.0 - 8.0 / 9);
  EXPECT_DOUBLE_EQ(s.factor(10), 0.0);  // p = 9 / 9: the step after the last
  EXPECT_DOUBLE_EQ(s.factor(50), 0.0);  // clamped there
}

TEST(LRSchedule, WarmupStableDecayCosineWithFloor) {
  // steps 100, warmup 10, decay_ratio 0.3 -> decay 30, stable 60; cosine to 0.1.
  const double ratio = 0.3;
  auto s = LRSchedule::build(100, 10, &ratio, DecayType::Cosine, 0.1);
  EXPECT_EQ(s.decay_steps, 30);
  EXPECT_EQ(s.stable_steps, 60);
  EXPECT_DOUBLE_EQ(s.factor(4), 5.0 / 11);
  EXPECT_DOUBLE_EQ(s.factor(10), 1.0);
  EXPECT_DOUBLE_EQ(s.factor(69), 1.0);
  // s = 70: p = (71 - 70) / 31; s = 85: p = 16 / 31; s = 99: p = 30 / 31.
  const double pi = 3.14159265358979323846;
  auto cosf = [&](double p) { return 0.1 + 0.9 * 0.5 * (1 + std::cos(pi * p)); };
  EXPECT_NEAR(s.factor(70), cosf(1.0 / 31), 1e-15);
  EXPECT_NEAR(s.factor(85), cosf(16.0 / 31), 1e-15);
  EXPECT_NEAR(s.factor(99), cosf(30.0 / 31), 1e-15);
  EXPECT_NEAR(s.factor(85), 0.1 + 0.45 * (1 + std::cos(pi * 16 / 31)), 1e-15);
}

TEST(LRSchedule, SqrtDecayAndCaps) {
  const double ratio = 0.9;
  // warmup 5 + decay round(9) = 14 > 10 steps -> decay capped at 5, stable 0.
  auto s = LRSchedule::build(10, 5, &ratio, DecayType::Sqrt, 0.0);
  EXPECT_EQ(s.decay_steps, 5);
  EXPECT_EQ(s.stable_steps, 0);
  EXPECT_DOUBLE_EQ(s.factor(5), 1.0 - std::sqrt(1.0 / 6));
  EXPECT_DOUBLE_EQ(s.factor(8), 1.0 - std::sqrt(4.0 / 6));
  // warmup larger than the run is capped at the step count: pure warmup.
  auto w = LRSchedule::build(4, 10, nullptr, DecayType::Linear, 0.0);
  EXPECT_EQ(w.warmup_steps, 4);
  EXPECT_EQ(w.decay_steps, 0);
  EXPECT_DOUBLE_EQ(w.factor(3), 4.0 / 5);
  // Python's round() is half-to-even: 10 * 0.25 = 2.5 -> 2.
  const double quarter = 0.25;
  EXPECT_EQ(LRSchedule::build(10, 0, &quarter, DecayType::Linear, 0.0).decay_steps, 2);
}
