// The elementwise functions of the Mamba-2 mixer's high-precision core (emu/ssm.hpp), written once
// for the emulator (emu/ssm.cpp) and its CUDA twins (gpu/ssm.cu), so both compute the same bits:
// exp and log1p of an FP32 value, and the SiLU, sigmoid, softplus and scan-update expressions
// built from them, every step rounded (emu/hd.hpp's _rn operations, no contraction).
//
// exp_f32 and log1p_f32 are fp4sim's own rather than the C library's or CUDA's: glibc's expf and
// CUDA's expf are different algorithms (within 1 and 2 ulp of exp), so they differ in the last bit
// for some inputs, and glibc picks its variant at run time by CPU feature. Both functions here
// evaluate in binary64, each step rounded to nearest, and round the binary64 result to FP32 once:
// the binary64 value is within about 2^-50 relative of the exact one, so the FP32 result is the
// correctly rounded exp(x) or log1p(x) except where the exact value lies within 2^-50 relative of
// a midpoint between two floats, and the same bits on every machine either way. Subnormal results
// are rounded, not flushed; a NaN input gives the canonical NaN 0x7FFFFFFF on both backends.
//   exp_f32: x = k ln2 + r, k = rint(x log2e) (|k| <= 185), r = (x - k ln2_hi) - k ln2_lo with
//     ln2_hi of 45 bits (k ln2_hi and the difference exact); e^r by its Taylor polynomial of degree
//     13 (|r| <= 0.3467: truncation below 2^-57 relative), Horner; times 2^k (exact); to FP32.
//     x > 128 gives +Inf, x < -128 gives +0 (FP32's range ends at e^88.73 and e^-103.98).
//   log1p_f32: |x| < 2^-20: x (1 - x/2 + x^2/3 - x^3/4) (the next term is below 2^-80 relative).
//     Else u = 1 + x, exact in binary64 for every FP32 x in that range below 2^53 (and a relative
//     error of 2^-53 above, which moves log u by less than 2^-58), u = m 2^e with m in
//     [sqrt(1/2), sqrt(2)), log u = e ln2 + 2 atanh(s), s = (m - 1) / (m + 1) (|s| <= 0.1716), the
//     atanh series to s^21 (truncation below 2^-57 relative). x = -1: -Inf; x < -1: NaN; +Inf:
//     +Inf.
#pragma once

#include <cstdint>
#include <cstring>

#include "emu/hd.hpp"

namespace fp4sim {

namespace ssm_math_detail {

FP4SIM_HD uint64_t f64_bits(double x) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double_as_longlong(x));
#else
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}
FP4SIM_HD double f64_from_bits(uint64_t u) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(u));
#else
  double x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}
FP4SIM_HD double dsub_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}
FP4SIM_HD double ddiv_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
// binary64 -> binary32, rounded to nearest-even (subnormals rounded, overflow to Inf)
FP4SIM_HD float f64_to_f32_rn(double x) {
#if defined(__CUDA_ARCH__)
  return __double2float_rn(x);
#else
  return static_cast<float>(x);
#endif
}

constexpr double kLog2e = 0x1.71547652b82fep+0;
constexpr double kLn2Hi = 0x1.62e42fefa39p-1;  // 45 significant bits
constexpr double kLn2Lo = 0x1.de6af278ece60p-46;
constexpr double kRoundMagic = 0x1.8p52;  // x + this - this: x rounded to an integer (|x| < 2^51)
constexpr double kSqrt2 = 0x1.6a09e667f3bcdp+0;
constexpr uint32_t kCanonicalNan = 0x7FFFFFFFu;

}  // namespace ssm_math_detail

FP4SIM_HD float exp_f32(float x) {
  using namespace ssm_math_detail;
  if (f32_isnan(x)) return f32_from_bits(kCanonicalNan);
  if (x > 128.0f) return f32_from_bits(0x7F800000u);
  if (x < -128.0f) return 0.0f;
  const double xd = x;
  const double kd = dsub_rn(dadd_rn(dmul_rn(xd, kLog2e), kRoundMagic), kRoundMagic);
  const double r = dsub_rn(dsub_rn(xd, dmul_rn(kd, kLn2Hi)), dmul_rn(kd, kLn2Lo));
  // 1/n! for n = 13 down to 1, then 1
  constexpr double kInvFactorial[13] = {0x1.6124613a86d09p-33,
                                        0x1.1eed8eff8d898p-29,
                                        0x1.ae64567f544e4p-26,
                                        0x1.27e4fb7789f5cp-22,
                                        0x1.71de3a556c734p-19,
                                        0x1.a01a01a01a01ap-16,
                                        0x1.a01a01a01a01ap-13,
                                        0x1.6c16c16c16c17p-10,
                                        0x1.1111111111111p-7,
                                        0x1.5555555555555p-5,
                                        0x1.5555555555555p-3,
                                        0x1.0p-1,
                                        0x1.0p+0};
  double p = kInvFactorial[0];
  FP4SIM_UNROLL
  for (int i = 1; i < 13; ++i) p = dadd_rn(dmul_rn(p, r), kInvFactorial[i]);
  p = dadd_rn(dmul_rn(p, r), 1.0);
  const int k = static_cast<int>(kd);
  const double scale = f64_from_bits(static_cast<uint64_t>(k + 1023) << 52);
  return f64_to_f32_rn(dmul_rn(p, scale));
}

FP4SIM_HD float log1p_f32(float x) {
  using namespace ssm_math_detail;
  if (f32_isnan(x) || x < -1.0f) return f32_from_bits(kCanonicalNan);
  if (x == -1.0f) return f32_from_bits(0xFF800000u);
  if (f32_isinf(x)) return x;
  const double xd = x;
  if (f32_abs(x) < 0x1p-20f) {
    double p = dadd_rn(dmul_rn(xd, -0.25), 0x1.5555555555555p-2);
    p = dadd_rn(dmul_rn(xd, p), -0.5);
    p = dadd_rn(dmul_rn(xd, p), 1.0);
    return f64_to_f32_rn(dmul_rn(xd, p));
  }
  const double u = dadd_rn(1.0, xd);
  const uint64_t bits = f64_bits(u);
  int e = static_cast<int>((bits >> 52) & 0x7FF) - 1023;  // (u >= 2^-24: a normal binary64)
  double m = f64_from_bits((bits & ((uint64_t{1} << 52) - 1)) | (uint64_t{1023} << 52));
  if (m > kSqrt2) {
    m = dmul_rn(m, 0.5);
    e += 1;
  }
  const double s = ddiv_rn(dsub_rn(m, 1.0), dadd_rn(m, 1.0));
  const double s2 = dmul_rn(s, s);
  // 1/(2j+1) for j = 10 down to 0
  constexpr double kInvOdd[11] = {0x1.8618618618618p-5,
                                  0x1.af286bca1af28p-5,
                                  0x1.e1e1e1e1e1e1ep-5,
                                  0x1.1111111111111p-4,
                                  0x1.3b13b13b13b14p-4,
                                  0x1.745d1745d1746p-4,
                                  0x1.c71c71c71c71cp-4,
                                  0x1.2492492492492p-3,
                                  0x1.999999999999ap-3,
                                  0x1.5555555555555p-2,
                                  0x1.0p+0};
  double q = kInvOdd[0];
  FP4SIM_UNROLL
  for (int i = 1; i < 11; ++i) q = dadd_rn(dmul_rn(q, s2), kInvOdd[i]);
  const double log_m = dmul_rn(dmul_rn(2.0, s), q);
  const double ed = static_cast<double>(e);
  return f64_to_f32_rn(dadd_rn(dmul_rn(ed, kLn2Hi), dadd_rn(dmul_rn(ed, kLn2Lo), log_m)));
}

// ---- the mixer's elementwise expressions (DESIGN.md §12), in FP32, each step rounded ----------

// softplus(u) = u above this, as PyTorch's Softplus(threshold = 20) and mamba_ssm's dt_softplus
constexpr float kSoftplusThreshold = 20.0f;

// 1 / (1 + exp(-u))
FP4SIM_HD float ssm_sigmoid(float u) { return fdiv_rn(1.0f, fadd_rn(1.0f, exp_f32(-u))); }
// u / (1 + exp(-u))
FP4SIM_HD float ssm_silu(float u) { return fdiv_rn(u, fadd_rn(1.0f, exp_f32(-u))); }
// silu(u) and sigmoid(u) from one exp (the bits of ssm_silu and ssm_sigmoid)
FP4SIM_HD void ssm_silu_sigmoid(float u, float* silu, float* sig) {
  const float e1 = fadd_rn(1.0f, exp_f32(-u));
  *silu = fdiv_rn(u, e1);
  *sig = fdiv_rn(1.0f, e1);
}
// d silu / du = sig * (1 + u * (1 - sig)), from sig = sigmoid(u)
FP4SIM_HD float ssm_silu_grad_from(float u, float sig) {
  return fmul_rn(sig, fadd_rn(1.0f, fmul_rn(u, fsub_rn(1.0f, sig))));
}
FP4SIM_HD float ssm_silu_grad(float u) { return ssm_silu_grad_from(u, ssm_sigmoid(u)); }
// u > 20 ? u : log1p(exp(u))
FP4SIM_HD float ssm_softplus(float u) { return u > kSoftplusThreshold ? u : log1p_f32(exp_f32(u)); }
// d softplus / du times g: g above 20, else g * (e / (1 + e)), e = exp(u)
FP4SIM_HD float ssm_softplus_backward(float u, float g) {
  if (u > kSoftplusThreshold) return g;
  const float e = exp_f32(u);
  return fmul_rn(g, fdiv_rn(e, fadd_rn(1.0f, e)));
}
// One element of the state recurrence: a * s + dt * (x * b)
FP4SIM_HD float ssm_state_update(float a, float s, float dt, float x, float b) {
  return fadd_rn(fmul_rn(a, s), fmul_rn(dt, fmul_rn(x, b)));
}

}  // namespace fp4sim
