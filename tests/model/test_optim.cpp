// AdamW element update, clipping factor and learning-rate schedules.
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "emu/cpu_backend.hpp"
#include "emu/optim.hpp"
#include "model/schedule.hpp"

namespace fp4sim {
namespace {

// Reference in double, torch.optim.AdamW's update rule.
void adamw_double(double& p, double g, double& m, double& v, double lr, double b1, double b2,
                  double eps, double wd, int t) {
  m = b1 * m + (1 - b1) * g;
  v = b2 * v + (1 - b2) * g * g;
  p -= lr * wd * p;
  const double mh = m / (1 - std::pow(b1, t)), vh = v / (1 - std::pow(b2, t));
  p -= lr * mh / (std::sqrt(vh) + eps);
}

TEST(Optim, AdamWTracksTheDoubleReference) {
  float p = 0.5f, m = 0.0f, v = 0.0f;
  double pd = 0.5, md = 0.0, vd = 0.0;
  for (int t = 1; t <= 200; ++t) {
    const double g = std::sin(0.1 * t) + 0.3;
    const AdamWStep s = make_adamw_step(1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, t, 1.0f);
    adamw_element(p, static_cast<float>(g), m, v, s);
    adamw_double(pd, static_cast<float>(g), md, vd, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, t);
  }
  EXPECT_NEAR(p, pd, 1e-6 * std::fabs(pd) + 1e-7);
  EXPECT_NEAR(m, md, 1e-6);
}

TEST(Optim, FirstStepMovesByLrTimesSign) {
  // bias-corrected first step: m_hat = g, v_hat = g^2 -> p -= lr * g / (|g| + eps)
  float p = 1.0f, m = 0.0f, v = 0.0f;
  adamw_element(p, -3.0f, m, v, make_adamw_step(0.01f, 0.9f, 0.999f, 1e-8f, 0.0f, 1, 1.0f));
  EXPECT_NEAR(p, 1.01f, 1e-6);
}

// Backend::adamw_update (the trainer's one call for all tensors) on the emulator: each tensor
// updated with its own step, the elements between tensors untouched; mismatched lists or a negative
// offset are refused before anything is written.
TEST(Optim, AdamWUpdateUpdatesEachTensorWithItsStep) {
  emu::CpuBackend be;
  std::vector<float> p(10, 1.0f), m(10, 0.0f), v(10, 0.0f), g(10, 0.5f);
  auto h = [](std::vector<float>& x) { return host_view(x.data(), 1, 10); };
  const std::vector<Segment> segments{{0, 4}, {6, 3}};
  const std::vector<AdamWStep> steps{make_adamw_step(0.01f, 0.9f, 0.999f, 1e-8f, 0.0f, 1, 1.0f),
                                     make_adamw_step(0.02f, 0.9f, 0.999f, 1e-8f, 0.5f, 1, 1.0f)};
  be.adamw_update(h(p), TensorView{}, h(g), h(m), h(v), segments, steps);
  for (int i = 0; i < 10; ++i) {
    float pe = 1.0f, me = 0.0f, ve = 0.0f;
    if (i < 4) adamw_element(pe, 0.5f, me, ve, steps[0]);
    if (i >= 6 && i < 9) adamw_element(pe, 0.5f, me, ve, steps[1]);
    EXPECT_EQ(p[i], pe) << i;
    EXPECT_EQ(m[i], me) << i;
  }
  EXPECT_NE(p[0], p[6]);  // (the two steps differ)
  const std::vector<float> before = p;
  EXPECT_THROW(be.adamw_update(h(p), TensorView{}, h(g), h(m), h(v), segments, {steps[0]}),
               std::invalid_argument);
  EXPECT_THROW(be.adamw_update(h(p), TensorView{}, h(g), h(m), h(v), {{0, 4}, {0, -1}}, steps),
               std::invalid_argument);
  EXPECT_THROW(be.adamw_update(h(p), TensorView{}, h(g), h(m), h(v), {{0, 4}, {8, 3}}, steps),
               std::invalid_argument);
  EXPECT_EQ(p, before);
}

TEST(Optim, ClipFactor) {
  EXPECT_EQ(clip_factor(0.5, 1.0), 1.0f);
  EXPECT_NEAR(clip_factor(4.0, 1.0), 0.25f, 1e-6);
  EXPECT_EQ(clip_factor(100.0, 0.0), 1.0f);  // disabled
  EXPECT_EQ(clip_factor(NAN, 1.0), 1.0f);    // a NaN norm is the trainer's to report, not to hide
}

TEST(Schedule, WarmupCosineAndWsd) {
  using model::learning_rate;
  using model::Schedule;
  EXPECT_DOUBLE_EQ(learning_rate(Schedule::Cosine, 0, 100, 10, 1.0, 0.1, 0.2), 0.1);
  EXPECT_DOUBLE_EQ(learning_rate(Schedule::Cosine, 9, 100, 10, 1.0, 0.1, 0.2), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(Schedule::Cosine, 10, 100, 10, 1.0, 0.1, 0.2), 1.0);
  EXPECT_NEAR(learning_rate(Schedule::Cosine, 99, 100, 10, 1.0, 0.1, 0.2), 0.1, 1e-12);
  for (int s = 11; s < 100; ++s)
    EXPECT_LE(learning_rate(Schedule::Cosine, s, 100, 10, 1.0, 0.1, 0.2),
              learning_rate(Schedule::Cosine, s - 1, 100, 10, 1.0, 0.1, 0.2));
  EXPECT_DOUBLE_EQ(learning_rate(Schedule::Wsd, 50, 100, 10, 1.0, 0.1, 0.2), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(Schedule::Wsd, 79, 100, 10, 1.0, 0.1, 0.2), 1.0);
  EXPECT_NEAR(learning_rate(Schedule::Wsd, 99, 100, 10, 1.0, 0.1, 0.2), 0.1, 1e-12);
  EXPECT_GT(learning_rate(Schedule::Wsd, 85, 100, 10, 1.0, 0.1, 0.2), 0.1);
}

}  // namespace
}  // namespace fp4sim
