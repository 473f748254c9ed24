// Learning-rate schedules (issue 4): linear warmup, then cosine decay to min_lr_ratio * lr, or
// warmup-stable-decay (constant, then a linear decay over the last decay_fraction of the steps).
#pragma once

#include <cmath>
#include <cstdint>

namespace fp4sim::model {

// train.schedule (the names, name_of: model/config.hpp).
enum class Schedule : uint8_t { Cosine, Wsd };

// step is 0-based; the result for step s is the rate used to take step s.
inline double learning_rate(Schedule schedule, int64_t step, int64_t steps, int64_t warmup,
                            double lr, double min_lr_ratio, double decay_fraction) {
  const double min_lr = lr * min_lr_ratio;
  if (warmup > 0 && step < warmup)
    return lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (schedule == Schedule::Wsd) {
    const int64_t decay_steps =
        static_cast<int64_t>(std::llround(decay_fraction * static_cast<double>(steps)));
    const int64_t decay_start = steps - decay_steps;
    if (step < decay_start || decay_steps == 0) return lr;
    const double f = static_cast<double>(step - decay_start + 1) / static_cast<double>(decay_steps);
    return lr + (min_lr - lr) * f;
  }
  // cosine from the end of warmup to the last step
  const int64_t span = steps - warmup;
  if (span <= 1) return lr;
  const double f = static_cast<double>(step - warmup) / static_cast<double>(span - 1);
  const double pi = 3.14159265358979323846;
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(pi * f));
}

}  // namespace fp4sim::model
