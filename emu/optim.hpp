// AdamW with decoupled weight decay, FP32 master weights and states (issue 4), one element at a
// time in a fixed order of IEEE operations, host and device, so both backends agree bit for bit:
//   g  = grad * grad_scale                      (grad_scale: global-norm clipping factor, or 1)
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g * g
//   p  = p - lr * weight_decay * p              (decoupled decay, as torch.optim.AdamW)
//   p  = p - lr * (m / bc1) / (sqrt(v / bc2) + eps),   bc1 = 1 - beta1^t, bc2 = 1 - beta2^t
// (each product and sum rounded separately; bc1 and bc2 computed once per step on the host).
#pragma once

#include <cmath>
#include <cstdint>

#include "emu/hd.hpp"

namespace fp4sim {

struct AdamWStep {
  float lr;
  float beta1, beta2, eps;
  float weight_decay;
  float bias_correction1;  // 1 - beta1^t
  float bias_correction2;  // 1 - beta2^t
  float grad_scale;        // clipping factor
};

FP4SIM_HD void adamw_element(float& p, float grad, float& m, float& v, const AdamWStep& s) {
  const float g = fmul_rn(grad, s.grad_scale);
  m = fadd_rn(fmul_rn(s.beta1, m), fmul_rn(fsub_rn(1.0f, s.beta1), g));
  v = fadd_rn(fmul_rn(s.beta2, v), fmul_rn(fsub_rn(1.0f, s.beta2), fmul_rn(g, g)));
  p = fsub_rn(p, fmul_rn(fmul_rn(s.lr, s.weight_decay), p));
  const float m_hat = fdiv_rn(m, s.bias_correction1);
  const float v_hat = fdiv_rn(v, s.bias_correction2);
  p = fsub_rn(p, fmul_rn(s.lr, fdiv_rn(m_hat, fadd_rn(fsqrt_rn(v_hat), s.eps))));
}

// The step's constants from the hyper-parameters and the (1-based) step number t.
inline AdamWStep make_adamw_step(float lr, float beta1, float beta2, float eps, float weight_decay,
                                 int64_t t, float grad_scale) {
  AdamWStep s;
  s.lr = lr;
  s.beta1 = beta1;
  s.beta2 = beta2;
  s.eps = eps;
  s.weight_decay = weight_decay;
  s.bias_correction1 =
      static_cast<float>(1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(t)));
  s.bias_correction2 =
      static_cast<float>(1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(t)));
  s.grad_scale = grad_scale;
  return s;
}

// Global-norm clipping factor: min(1, max_norm / (norm + 1e-6)); max_norm <= 0 disables it.
inline float clip_factor(double global_norm, double max_norm) {
  if (max_norm <= 0.0 || !(global_norm > max_norm)) return 1.0f;
  return static_cast<float>(max_norm / (global_norm + 1e-6));
}

}  // namespace fp4sim

// ---- the orthogonalising optimizers' elementwise steps (DESIGN.md §13, model/optimizer.hpp) ----
namespace fp4sim {

// a * x + b * y, each product and the sum RN: the Newton–Schulz combinations b·A + c·A² and
// a·X + B·X, Muon's momentum, and its update p·(1 − lr·wd) − lr·scale·X.
FP4SIM_HD float axpby_element(float a, float x, float b, float y) {
  return fadd_rn(fmul_rn(a, x), fmul_rn(b, y));
}

// x clamped to [-bound, bound]; a NaN stays NaN (ROOT's soft threshold, Q-Root's clipping).
FP4SIM_HD float clamp_element(float x, float bound) {
  return x > bound ? bound : (x < -bound ? -bound : x);
}

// The sort key of |x|: its bits without the sign. Keys order as the magnitudes do, with every NaN
// above +Inf, so a sort by key is one order on every backend.
FP4SIM_HD uint32_t abs_key(float x) { return f32_bits(x) & 0x7fffffffu; }

// §13's quantile of n >= 1 values sorted ascending, v_lo = v[quantile_low(q, n)] and v_hi = the
// next one (the last where there is none): h = q·(n − 1) in FP64, lo = floor(h), and
// v_lo + f32(h − lo)·(v_hi − v_lo) in FP32, each step RN.
inline int64_t quantile_low(double q, int64_t n) {
  return static_cast<int64_t>(std::floor(q * static_cast<double>(n - 1)));
}
inline float quantile_between(float v_lo, float v_hi, double q, int64_t n) {
  const double h = q * static_cast<double>(n - 1);
  const float frac = static_cast<float>(h - std::floor(h));
  return fadd_rn(v_lo, fmul_rn(frac, fsub_rn(v_hi, v_lo)));
}

}  // namespace fp4sim
