// Host/device portability layer for the shared scalar numerics.
//
// Every function in emu/*.hpp that both backends call is marked FP4SIM_HD. Rounding is written
// explicitly: on the device through the _rn intrinsics, on the host through plain operators under
// -ffp-contract=off (DESIGN.md §1). Nothing here may depend on the compiler's choice of fusion.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FP4SIM_HD __host__ __device__ __forceinline__
// for rare, large paths (special values) that must not bloat the hot kernels' registers (inline:
// one definition however many .cu files include the header)
#define FP4SIM_HD_NOINLINE inline __host__ __device__ __noinline__
#else
#define FP4SIM_HD inline
#define FP4SIM_HD_NOINLINE inline
#endif
// A loop-unrolling hint for the device pass only (the host compiler would warn on the pragma).
#if defined(__CUDA_ARCH__)
#define FP4SIM_UNROLL _Pragma("unroll")
#else
#define FP4SIM_UNROLL
#endif

namespace fp4sim {

FP4SIM_HD uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

FP4SIM_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

// IEEE binary32 operations, each rounded to nearest-even, never fused.
FP4SIM_HD float fmul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
FP4SIM_HD float fadd_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
FP4SIM_HD float fsub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
FP4SIM_HD float fdiv_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
FP4SIM_HD float fsqrt_rn(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return std::sqrt(x);  // IEEE correctly rounded
#endif
}
// 1 / x correctly rounded: on the device __frcp_rn, the same value as __fdiv_rn(1, x) in fewer
// instructions.
FP4SIM_HD float frcp_rn(float x) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(x);
#else
  return 1.0f / x;
#endif
}
// a + p rounded toward zero, for a finite a >= 0 and p = 2^e > a (the sum stays in p's binade; the
// argument below holds as well for any p in [2^e, 2^(e+1)) with a + p < 2^(e+1), which the offset
// magic numbers of emu/formats.hpp are):
// one FADD.RZ on the device. The host forms the sum in binary64 and cuts its significand to 24
// bits, which is exact: an a >= 2^(e-23) (one FP32 ULP of p) has no bits below 2^(e-46), so the
// binary64 sum (ULP <= 2^(e-51)) is exact; a smaller a is at most 2^(e-23) - 2^(e-47), and the
// binary64 rounding (half ULP <= 2^(e-52)) cannot lift the sum to p + 2^(e-23): both give p.
FP4SIM_HD float fadd_rz_pow2(float a, float p) {
#if defined(__CUDA_ARCH__)
  return __fadd_rz(a, p);
#else
  const double s = static_cast<double>(a) + static_cast<double>(p);
  uint64_t u;
  std::memcpy(&u, &s, sizeof u);
  u &= ~((uint64_t{1} << 29) - 1u);  // 52 - 23 fraction bits dropped: toward zero (s > 0)
  double t;
  std::memcpy(&t, &u, sizeof t);
  return static_cast<float>(t);  // exact: t has 24 significant bits in FP32's range
#endif
}
// fmaf only where the contract names an FMA (the FP8 promotion, DESIGN.md §9).
FP4SIM_HD float ffma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return __builtin_fmaf(a, b, c);
#endif
}

// IEEE binary64 operations, each rounded to nearest-even, never fused (sums of statistics).
FP4SIM_HD double dmul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
FP4SIM_HD double dadd_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

FP4SIM_HD bool f32_isnan(float x) { return (f32_bits(x) & 0x7FFFFFFFu) > 0x7F800000u; }
FP4SIM_HD bool f32_isinf(float x) { return (f32_bits(x) & 0x7FFFFFFFu) == 0x7F800000u; }
FP4SIM_HD float f32_abs(float x) { return f32_from_bits(f32_bits(x) & 0x7FFFFFFFu); }

// fmaxf semantics without relying on libm: a NaN operand is ignored.
FP4SIM_HD float fmax_nan_ignored(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fmaxf(a, b);  // FMNMX: IEEE maxNum, the same result (callers never compare +0 with -0)
#endif
  if (f32_isnan(a)) return b;
  if (f32_isnan(b)) return a;
  return a > b ? a : b;
}
FP4SIM_HD float fmin_nan_ignored(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fminf(a, b);  // FMNMX: IEEE minNum
#endif
  if (f32_isnan(a)) return b;
  if (f32_isnan(b)) return a;
  return a < b ? a : b;
}

// Number of leading zeros, set bits, the high word of a product, host and device.
FP4SIM_HD int clz64(uint64_t v) {
#if defined(__CUDA_ARCH__)
  return __clzll(static_cast<long long>(v));
#else
  return v == 0 ? 64 : __builtin_clzll(v);
#endif
}
FP4SIM_HD int clz32(uint32_t v) {
#if defined(__CUDA_ARCH__)
  return __clz(static_cast<int>(v));
#else
  return v == 0 ? 32 : __builtin_clz(v);
#endif
}
FP4SIM_HD int popcount32(uint32_t v) {
#if defined(__CUDA_ARCH__)
  return __popc(v);
#else
  return __builtin_popcount(v);
#endif
}
FP4SIM_HD uint32_t mulhi32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

// int32 -> FP32 rounded toward zero (exact below 2^24).
FP4SIM_HD float int_to_f32_rz(int32_t v) {
#if defined(__CUDA_ARCH__)
  return __int2float_rz(v);
#else
  uint32_t m = v < 0 ? 0u - static_cast<uint32_t>(v) : static_cast<uint32_t>(v);
  if (m >= (1u << 24)) {
    const int s = (31 - clz32(m)) - 23;  // low bits below the 24-bit significand
    m = (m >> s) << s;                   // truncate: the conversion below is then exact
  }
  const float f = static_cast<float>(m);
  return v < 0 ? -f : f;
#endif
}

// FP32 -> int32 rounded toward zero, for |x| < 2^31 (beyond, the device saturates and the host's
// conversion is undefined: host callers stay in range).
FP4SIM_HD int32_t f32_to_int_rz(float x) {
#if defined(__CUDA_ARCH__)
  return __float2int_rz(x);
#else
  return static_cast<int32_t>(x);
#endif
}

// 2^e as a double, for -1022 <= e <= 1023, built from its bits.
FP4SIM_HD double pow2_double(int e) {
#if defined(__CUDA_ARCH__)
  return __hiloint2double((e + 1023) << 20, 0);
#else
  uint64_t b = static_cast<uint64_t>(e + 1023) << 52;
  double d;
  std::memcpy(&d, &b, sizeof d);
  return d;
#endif
}

// RZ of a double to FP32 (subnormals kept; magnitudes >= 2^128 give FLT_MAX here: callers map them
// to Inf). The device has it as one instruction; the host steps the RN result toward zero.
FP4SIM_HD float double_to_f32_rz(double x) {
#if defined(__CUDA_ARCH__)
  return __double2float_rz(x);
#else
  float r = static_cast<float>(x);
  if (std::fabs(static_cast<double>(r)) > std::fabs(x))
    r = f32_from_bits(f32_bits(r) - 1u);  // toward zero
  return r;
#endif
}

constexpr float kFltMax = 3.40282346638528859812e+38f;

}  // namespace fp4sim
