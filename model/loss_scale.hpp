// Dynamic loss scaling (DESIGN.md §14, train.loss_scale = dynamic): the loss gradient is multiplied
// by S, a power of two, so small gradients stay clear of the underflow of the formats they pass
// through; the gradients are divided by S again (exact) before clipping and the optimizer. A step
// whose gradients hold a NaN or an Inf is skipped and S halves (not below 1); after
// kGrowthInterval clean steps S doubles (not above kMaxScale).
#pragma once

#include <cmath>
#include <cstdint>

namespace fp4sim::model {

struct DynamicLossScale {
  static constexpr float kInitialScale = 65536.0f;  // 2^16
  // §14 names no ceiling. 2^24 keeps 1/S, and the clipping factor divided by S, normal FP32
  // numbers, which the exact division by S needs (a clipping factor is well above 2^-100).
  static constexpr float kMaxScale = 16777216.0f;   // 2^24
  static constexpr int64_t kGrowthInterval = 2000;  // clean steps before S doubles
  static constexpr int64_t kMaxSkipsInARow = 10;    // this many skipped steps in a row stop a run

  float scale = kInitialScale;
  int64_t clean_steps = 0;     // clean steps since S last changed (or since the start)
  int64_t skips_in_a_row = 0;  // skipped steps since the last clean one

  // A power of two in [1, kMaxScale]: a scale this class can hold (a checkpoint's is checked).
  static bool valid_scale(double s) {
    if (!(s >= 1.0 && s <= kMaxScale)) return false;
    int e = 0;
    return std::frexp(s, &e) == 0.5;
  }

  void after_clean_step() {
    skips_in_a_row = 0;
    if (++clean_steps < kGrowthInterval) return;
    clean_steps = 0;
    if (scale < kMaxScale) scale *= 2.0f;
  }
  void after_skipped_step() {
    ++skips_in_a_row;
    clean_steps = 0;
    if (scale > 1.0f) scale *= 0.5f;
  }
};

}  // namespace fp4sim::model
