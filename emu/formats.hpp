// Narrow number formats (DESIGN.md §2, §4): bit patterns are the contract.
//
// Each format is a small constexpr descriptor; conversions from FP32 are written once here, for the
// host and the device, on the integer bit pattern (no FP rounding mode is involved anywhere).
#pragma once

#include <cstdint>

#include "emu/hd.hpp"

namespace fp4sim {

// A "fn"-style (no Inf) or IEEE-like minifloat: 1 sign bit, kExpBits, kManBits.
template <int kExpBits_, int kManBits_, int kBias_, uint8_t kMaxMagCode_>
struct MiniFloat {
  static constexpr int kExpBits = kExpBits_;
  static constexpr int kManBits = kManBits_;
  static constexpr int kBias = kBias_;
  static constexpr int kEmin = 1 - kBias_;              // exponent of the smallest normal
  static constexpr uint8_t kMaxMagCode = kMaxMagCode_;  // largest finite magnitude code
  static constexpr uint8_t kSignBit = uint8_t(1u << (kExpBits_ + kManBits_));
};

using E2M1 = MiniFloat<2, 1, 1, 0x7>;    // ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}; no Inf/NaN
using E4M3 = MiniFloat<4, 3, 7, 0x7E>;   // OCP "fn": max 448, 0x7F = NaN, no Inf
using E5M2 = MiniFloat<5, 2, 15, 0x7B>;  // max 57344, 0x7C = Inf, 0x7D..0x7F = NaN

static_assert(E2M1::kSignBit == 0x8, "E2M1 sign is bit 3");
static_assert(E4M3::kSignBit == 0x80 && E5M2::kSignBit == 0x80, "8-bit sign");
static_assert(E4M3::kEmin == -6 && E5M2::kEmin == -14 && E2M1::kEmin == 0, "emin");

constexpr float kE2M1Max = 6.0f;
constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;
constexpr uint8_t kE4M3NaN = 0x7F;
constexpr uint8_t kE2M1NaNCode = 0x7;  // NaN saturates to +6
constexpr uint8_t kUE8M0NaN = 0xFF;
constexpr uint8_t kUE8M0MaxFinite = 0xFE;
constexpr uint16_t kBF16NaN = 0x7FFF;

// Magnitude code of a finite, non-negative FP32 value (given as its bits), rounded to nearest-even
// on the format's grid and saturated to the largest finite code. Codes are monotonic in value, so
// the subnormal and normal ranges share one integer rounding: code = (max(e, emin) - emin) << M + q
// with q the significand rounded to M fraction bits at that exponent.
template <class F>
FP4SIM_HD uint32_t encode_magnitude_rne(uint32_t abs_bits) {
  const int biased = static_cast<int>(abs_bits >> 23);
  if (biased == 0) return 0;  // FP32 subnormals are far below half of every narrow format's minimum
  const uint32_t sig = (abs_bits & 0x7FFFFFu) | 0x800000u;
  const int e = biased - 127;
  if (e > F::kEmin + (1 << F::kExpBits)) return F::kMaxMagCode;  // far beyond the largest finite
  int shift = 23 - F::kManBits;
  const int e_eff = e < F::kEmin ? F::kEmin : e;
  shift += e_eff - e;
  if (shift > 25) return 0;  // below half the smallest subnormal
  uint32_t q = sig >> shift;
  const uint32_t rem = sig & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  const uint32_t code = (static_cast<uint32_t>(e_eff - F::kEmin) << F::kManBits) + q;
  return code > F::kMaxMagCode ? F::kMaxMagCode : code;
}

// Value of a magnitude code (no specials).
template <class F>
FP4SIM_HD float decode_magnitude(uint32_t mag) {
  const uint32_t exp_field = mag >> F::kManBits;
  const uint32_t man = mag & ((1u << F::kManBits) - 1u);
  // subnormal: man * 2^(emin - M); normal: (2^M + man) * 2^(exp - bias - M)
  const uint32_t sig = exp_field == 0 ? man : (man | (1u << F::kManBits));
  const int e = (exp_field == 0 ? F::kEmin : static_cast<int>(exp_field) - F::kBias) - F::kManBits;
  // sig < 2^(M+1) and e in a narrow range: build the FP32 exactly from bits.
  if (sig == 0) return 0.0f;
  const int lz = clz32(sig) - 8;  // normalise sig into 1.xxx (24-bit)
  const uint32_t norm = sig << lz;
  const int exp32 = e + 23 - lz + 127;
  return f32_from_bits((static_cast<uint32_t>(exp32) << 23) | (norm & 0x7FFFFFu));
}

// ---- E2M1
// ----------------------------------------------------------------------------------------

// The GPU's E2M1 formulation: one IEEE addition rounds a value onto the E2M1 grid. The grid's step
// is 0.5 on [0, 2), 1 on [2, 4) and 2 on [4, 6], the FP32 ULP of M = 2^22, 2^23 and 2^24: for c
// clamped to [-6, 6], |c| + M rounds |c| to the step (RN: to nearest, ties to the even step count,
// which has the code's parity; RZ: down), the sum's low bits count the steps q, and the code is q
// plus the region's first code 0, 2 or 4 (= (bits(M) >> 22) - 298). M's bits are max(|c|'s
// exponent bits + 22, 2^22's), one VIADDMNMX on sm_90. The decoded magnitude q * step comes out of
// the same sum. tests/emu/test_formats_exhaustive.cpp holds both roundings equal to the host's
// bit-pattern formulations over all 2^32 inputs, tests/gpu/test_formats_gpu.cu the device's.

// y clamped to [-6, 6], a NaN to +6 (min/max ignore a NaN operand): the satfinite of both
// roundings.
FP4SIM_HD float e2m1_clamp(float y) {
  return fmax_nan_ignored(fmin_nan_ignored(y, kE2M1Max), -kE2M1Max);
}

// bits(M) for c = e2m1_clamp(y): 2^22 (0x4A800000) on [0, 2), 2^23 on [2, 4), 2^24 on [4, 6].
FP4SIM_HD uint32_t e2m1_magic_bits(float c) {
#if defined(__CUDA_ARCH__)
  return __viaddmax_u32(f32_bits(c) & 0x7F800000u, 22u << 23, 0x4A800000u);
#else
  const uint32_t m = (f32_bits(c) & 0x7F800000u) + (22u << 23);
  return m > 0x4A800000u ? m : 0x4A800000u;
#endif
}

FP4SIM_HD float e2m1_abs(float c) {
#if defined(__CUDA_ARCH__)
  return fabsf(c);  // an operand modifier (c is never a NaN here)
#else
  return f32_abs(c);
#endif
}

// The steps of |c| on its region's grid (c = e2m1_clamp(y), mb = e2m1_magic_bits(c)), rounded to
// nearest-even: the low bits of |c| + M.
FP4SIM_HD uint32_t e2m1_rn_steps(float c, uint32_t mb) {
  return f32_bits(fadd_rn(e2m1_abs(c), f32_from_bits(mb))) - mb;
}

// The same with stochastic rounding (DESIGN.md §4) by random byte r: f = floor(|c| * 256 / step)
// from |c| + M / 256 rounded toward zero (its low bits: the steps below |c| times 256 plus
// floor(frac * 256)), and the steps after rounding are (f + r) >> 8.
FP4SIM_HD uint32_t e2m1_rs_steps(float c, uint32_t mb, uint32_t r) {
  const uint32_t fb = mb - (8u << 23);  // M / 256
  return (f32_bits(fadd_rz_pow2(e2m1_abs(c), f32_from_bits(fb))) - fb + r) >> 8;
}

// The rounded magnitude, steps * step (exact: M + steps ULPs, less M).
FP4SIM_HD float e2m1_steps_magnitude(uint32_t mb, uint32_t steps) {
  return fsub_rn(f32_from_bits(mb + steps), f32_from_bits(mb));
}

// The code: steps plus the region's first code 0, 2 or 4, which is (mb >> 22) - 298, and c's sign.
constexpr uint32_t kE2M1MagicCodeBase = 0x4A800000u >> 22;  // 298
FP4SIM_HD uint32_t e2m1_magic_code(float c, uint32_t mb, uint32_t steps) {
  return (steps + (mb >> 22) - kE2M1MagicCodeBase) | ((f32_bits(c) >> 31) << 3);
}

// E2M1 cvt.rn.satfinite code of y; *mag = the rounded magnitude (e2m1_to_f32 of the code,
// unsigned).
FP4SIM_HD uint32_t e2m1_rn_magic(float y, float* mag) {
  const float c = e2m1_clamp(y);
  const uint32_t mb = e2m1_magic_bits(c);
  const uint32_t steps = e2m1_rn_steps(c, mb);
  *mag = e2m1_steps_magnitude(mb, steps);
  return e2m1_magic_code(c, mb, steps);
}

// The quantizer's RN formulation for packing many codes (gpu/quantize.cu): the magic number also
// carries the region's first code. M' = M plus 0, 2 or 4 of its ULPs (an even count: the sum's
// parity, which ties to even, is the step count's), so the sum's low three bits are the magnitude
// code itself and bits 3..22 are zero: e2m1_rn_satfinite(y) & 7 == bits(|y|' + M') & 7, with |y|'
// = fminf(|y|, 6) (a NaN -> 6). bits(M') = max(e + (e >> 22) + K, bits(2^22)) from |y|''s exponent
// bits e = E << 23 (e >> 22 = 2E): E = 128 gives (150 << 23) + 2, E = 129 (151 << 23) + 4, E = 127
// exactly 2^22's bits. The sign is left to the caller (the device packs eight at a time).
// tests/emu/test_formats_exhaustive.cpp holds it equal to e2m1_rn_satfinite over all 2^32 inputs.
constexpr uint32_t kE2M1OffsetMagicK = (22u << 23) - 2u * 127u;
// (both offset formulations: *c = fminf(|y|, 6), a NaN -> 6, and the magic number's bits
// max(e + (e >> kShift) + k, lowest) from c's exponent bits e)
template <int kShift>
FP4SIM_HD uint32_t e2m1_offset_magic_bits(float y, uint32_t k, uint32_t lowest, float* c) {
#if defined(__CUDA_ARCH__)
  *c = fminf(fabsf(y), kE2M1Max);  // FMNMX with an |.| operand
  const uint32_t e = f32_bits(*c) & 0x7F800000u;
  return __viaddmax_u32(e + (e >> kShift), k, lowest);
#else
  *c = fmin_nan_ignored(f32_abs(y), kE2M1Max);
  const uint32_t e = f32_bits(*c) & 0x7F800000u;
  const uint32_t m = e + (e >> kShift) + k;
  return m > lowest ? m : lowest;
#endif
}
FP4SIM_HD uint32_t e2m1_rn_offset_magic_sum(float y) {
  float c;
  const uint32_t mb = e2m1_offset_magic_bits<22>(y, kE2M1OffsetMagicK, 0x4A800000u, &c);
  return f32_bits(fadd_rn(c, f32_from_bits(mb)));
}

// The same for stochastic rounding: F' = M / 256 plus the region's first code in 256-ULP steps (F's
// ULP is the grid step / 256), so bits(|y|' + F' rounded toward zero) = bits(F) + (first code) *
// 256 + floor(|y|' * 256 / step), and adding the random byte r carries into the step count exactly
// when e2m1_rs_satfinite rounds up: the result's low three bits are the magnitude code and bits
// 3..14 are zero. bits(F') = max(e + (e >> 14) + Ksr, bits(2^14)) (e >> 14 = 512 E = 256 * 2E).
constexpr uint32_t kE2M1OffsetMagicKsr = (14u << 23) - 127u * 512u;
FP4SIM_HD uint32_t e2m1_rs_offset_magic_code(float y, uint32_t r) {
  float c;
  const uint32_t fb = e2m1_offset_magic_bits<14>(y, kE2M1OffsetMagicKsr, 0x46800000u, &c);
  return (f32_bits(fadd_rz_pow2(c, f32_from_bits(fb))) + r) >> 8;
}

// E2M1 stochastic rounding of y with random byte r; *mag as e2m1_rn_magic.
FP4SIM_HD uint32_t e2m1_rs_magic(float y, uint32_t r, float* mag) {
  const float c = e2m1_clamp(y);
  const uint32_t mb = e2m1_magic_bits(c);
  const uint32_t steps = e2m1_rs_steps(c, mb, r);
  *mag = e2m1_steps_magnitude(mb, steps);
  return e2m1_magic_code(c, mb, steps);
}

// FP32 -> E2M1 cvt.rn.satfinite: ties to even; |x| > 6 -> ±6; NaN -> +6 (0x7); -0 -> 0x8.
// The device computes it as e2m1_rn_magic. The host works on the bit pattern, which vectorises
// better: below 1 two boundaries (compared as bit patterns; ties to the even code); from 1 up the
// E2M1 codes continue the FP32 bit pattern, code = (bits >> 22) - 252 after rounding the bits to
// one fraction bit (RNE), and everything past 6 (Inf and NaN too) saturates.
// tests/emu/test_formats_exhaustive.cpp holds this one equal to cuda_fp4.h and to e2m1_rn_magic,
// tests/gpu/test_formats_gpu.cu the device's equal to it, all over 2^32 inputs.
FP4SIM_HD uint8_t e2m1_rn_satfinite(float x) {
#if defined(__CUDA_ARCH__)
  float mag;
  return static_cast<uint8_t>(e2m1_rn_magic(x, &mag));
#else
  const uint32_t b = f32_bits(x);
  const uint32_t abits = b & 0x7FFFFFFFu;
  const uint32_t sign = abits > 0x7F800000u ? 0u : (b >> 31);  // NaN -> +6
  uint32_t code;
  if (abits < 0x3F800000u) {
    code = static_cast<uint32_t>(abits > 0x3E800000u) + static_cast<uint32_t>(abits >= 0x3F400000u);
  } else {
    code = ((abits + 0x1FFFFFu + ((abits >> 22) & 1u)) >> 22) - 252u;
    code = code > E2M1::kMaxMagCode ? E2M1::kMaxMagCode : code;
  }
  return static_cast<uint8_t>((sign << 3) | code);
#endif
}

FP4SIM_HD float e2m1_to_f32(uint8_t code) {
  const float m = decode_magnitude<E2M1>(code & 0x7u);
  return (code & 0x8u) ? -m : m;
}

// The sign bits of eight products (the device's half of e2m1x8_rn_scaled and e2m1x8_rs_scaled):
// bit 4 i + 3 set where y[i] is negative (a NaN product is the GPU's positive canonical NaN).
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ uint32_t e2m1x8_sign_bits(const float* y) {
  uint32_t xa, xb, ya, yb;  // xa = [S0, S2, S0, S2], xb = [S4, S6, S4, S6]; likewise the odd ones
  asm("prmt.b32 %0, %1, %2, 0xFBFB;" : "=r"(xa) : "r"(f32_bits(y[0])), "r"(f32_bits(y[2])));
  asm("prmt.b32 %0, %1, %2, 0xFBFB;" : "=r"(xb) : "r"(f32_bits(y[4])), "r"(f32_bits(y[6])));
  asm("prmt.b32 %0, %1, %2, 0xFBFB;" : "=r"(ya) : "r"(f32_bits(y[1])), "r"(f32_bits(y[3])));
  asm("prmt.b32 %0, %1, %2, 0xFBFB;" : "=r"(yb) : "r"(f32_bits(y[5])), "r"(f32_bits(y[7])));
  const uint32_t even = (xa & 0x0000FFFFu) | (xb & 0xFFFF0000u);  // byte j: element 2j's sign
  const uint32_t odd = (ya & 0x0000FFFFu) | (yb & 0xFFFF0000u);   // byte j: element 2j + 1's
  return ((even & 0x0F0F0F0Fu) | (odd & 0xF0F0F0F0u)) & 0x88888888u;
}
#endif

// Eight elements' E2M1 RN codes in one word, element 0 in the low nibble: e2m1_rn_satfinite(
// fmul_rn(v[i], enc)) each. The device packs the offset-magic sums by shift-adds (the code is a
// sum's only bits below bit 23: a pair's byte, then a quad's two bytes, are clean) and the eight
// signs from the products' sign bytes by byte permutes (PRMT's sign-replicate mode: 0xFF for a
// negative product). A NaN product is the GPU's positive canonical NaN (0x7FFFFFFF), so a NaN
// input ends as +6, 0x7, as the contract says; tests/gpu/test_formats_gpu.cu checks negative NaNs.
FP4SIM_HD uint32_t e2m1x8_rn_scaled(const float* v, float enc) {
#if defined(__CUDA_ARCH__)
  float y[8];
  uint32_t s[8];
  FP4SIM_UNROLL
  for (int i = 0; i < 8; ++i) {
    y[i] = __fmul_rn(v[i], enc);
    s[i] = e2m1_rn_offset_magic_sum(y[i]);
  }
  const uint32_t q0 = (s[3] * 16u + s[2]) * 256u + (s[1] * 16u + s[0]);
  const uint32_t q1 = (s[7] * 16u + s[6]) * 256u + (s[5] * 16u + s[4]);
  return __byte_perm(q0, q1, 0x5410) | e2m1x8_sign_bits(y);
#else
  uint32_t w = 0;
  for (int i = 0; i < 8; ++i)
    w |= static_cast<uint32_t>(e2m1_rn_satfinite(fmul_rn(v[i], enc))) << (4 * i);
  return w;
#endif
}

// Stochastic rounding to E2M1 (DESIGN.md §4), rs.satfinite. `r` is the element's random byte.
// Round away from zero iff floor(frac*256) + r >= 256, frac = (a - lo)/step: the carry out of
// adding 8 random bits to the top 8 discarded bits. Computed on the bit pattern, exactly:
//  - [1, 6): the E2M1 codes continue the FP32 bit pattern (one fraction bit), so lo's code is
//    (bits >> 22) - 252 and the top 8 discarded bits are bits 21..14;
//  - [0, 1): step 0.5, floor(512 a) = lo_code * 256 + floor(frac * 256), with 512 a = m24 * 2^(e -
//  141).
// tests/emu/test_formats.cpp holds this equal to the FP32 formulation of the contract.

// The device computes it as e2m1_rs_magic (held equal to this over all 2^32 inputs).
FP4SIM_HD uint8_t e2m1_rs_satfinite(float y, uint8_t r) {
#if defined(__CUDA_ARCH__)
  float mag;
  return static_cast<uint8_t>(e2m1_rs_magic(y, r, &mag));
#endif
  const uint32_t b = f32_bits(y);
  const uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kE2M1NaNCode;
  const uint32_t sign = (b >> 31) << 3;
  if (a >= 0x40C00000u) return static_cast<uint8_t>(sign | E2M1::kMaxMagCode);  // |y| >= 6, Inf
  uint32_t lo_code, top8;
  if (a >= 0x3F800000u) {
    lo_code = (a >> 22) - 252u;
    top8 = (a >> 14) & 0xFFu;
  } else {
    const uint32_t e = a >> 23;  // biased exponent; FP32 subnormals give floor(512 a) = 0
    const uint32_t sh = 141u - e;
    const uint32_t f512 = (e == 0 || sh >= 32u) ? 0u : (((a & 0x7FFFFFu) | 0x800000u) >> sh);
    lo_code = f512 >> 8;
    top8 = f512 & 0xFFu;
  }
  return static_cast<uint8_t>(sign | (lo_code + ((top8 + r) >> 8)));
}

// Eight elements' E2M1 stochastic-rounding codes in one word: e2m1_rs_satfinite(fmul_rn(v[i],
// enc), byte i % 4 of r0 (i < 4) or r1), sr_byte_for_element's bytes. The device packs the
// offset-magic codes pairwise (a pair's byte is clean: a code's junk starts at bit 15) and then
// gathers the four bytes by permutes.
FP4SIM_HD uint32_t e2m1x8_rs_scaled(const float* v, float enc, uint32_t r0, uint32_t r1) {
#if defined(__CUDA_ARCH__)
  float y[8];
  uint32_t t[8];
  FP4SIM_UNROLL
  for (int i = 0; i < 8; ++i) {
    y[i] = __fmul_rn(v[i], enc);
    // (the middle bytes by one byte permute, not a shift and a mask: the SR kernels are bound on
    // the ALU pipe; bytes 0 and 3 keep the mask-and-shift form, whose mask ptxas drops for byte 3
    // and folds the shift into the add, LEA.HI)
    const uint32_t w = i < 4 ? r0 : r1;
    const uint32_t r = (i & 3) == 1 || (i & 3) == 2 ? __byte_perm(w, 0u, 0x4440u | (i & 3))
                                                    : (w >> (8 * (i & 3))) & 0xFFu;
    t[i] = e2m1_rs_offset_magic_code(y[i], r);
  }
  const uint32_t lo = __byte_perm(t[1] * 16u + t[0], t[3] * 16u + t[2], 0x0040);
  const uint32_t hi = __byte_perm(t[5] * 16u + t[4], t[7] * 16u + t[6], 0x0040);
  return __byte_perm(lo, hi, 0x5410) | e2m1x8_sign_bits(y);
#else
  uint32_t w = 0;
  for (int i = 0; i < 8; ++i) {
    const uint8_t r = static_cast<uint8_t>((i < 4 ? r0 : r1) >> (8 * (i & 3)));
    w |= static_cast<uint32_t>(e2m1_rs_satfinite(fmul_rn(v[i], enc), r)) << (4 * i);
  }
  return w;
#endif
}

// ---- E4M3 / UE4M3
// --------------------------------------------------------------------------------

// FP32 -> E4M3 cvt.rn.satfinite: |x| > 448 (Inf included) -> ±448; NaN -> 0x7F. (cuda_fp8.h returns
// 0x7F for NaN of either sign; DESIGN.md §2 reads "0x7F | sign": we follow the hardware headers.)
FP4SIM_HD uint8_t e4m3_rn_satfinite(float x) {
  const uint32_t b = f32_bits(x);
  const uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kE4M3NaN;
  const uint32_t sign = (b >> 31) ? E4M3::kSignBit : 0u;
  if (a == 0x7F800000u) return static_cast<uint8_t>(sign | E4M3::kMaxMagCode);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  // The conversion instruction itself (sm_89+; the NaN case stays above so the NaN code is ours).
  // tests/gpu/test_formats_gpu.cu holds it equal to the formulation below over all 2^32 inputs.
  uint16_t pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(x));
  return static_cast<uint8_t>(pair & 0xFFu);
#else
  return static_cast<uint8_t>(sign | encode_magnitude_rne<E4M3>(a));
#endif
}

// Two E4M3 codes at once: lo's in the low byte, hi's in the high byte, each e4m3_rn_satfinite's.
// On sm_89+ one conversion instruction for both (its ±Inf -> ±448 is the contract's; a NaN gets the
// contract's 0x7F whatever the instruction gives). tests/gpu/test_formats_gpu.cu holds it equal to
// the host's pair of e4m3_rn_satfinite over all 2^32 inputs in each byte.
FP4SIM_HD uint32_t e4m3x2_rn_satfinite(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
  // Only a NaN converts to low bits 111 1111 (satfinite stops at 0x7E). Should the instruction
  // keep a NaN's sign (0xFF), clear the sign bit of each byte whose low seven bits are all ones
  // (adding 1 to them carries into bit 7 of that byte only): every NaN ends as the contract's 0x7F.
  const uint32_t p = pair;
  static_assert(kE4M3NaN == 0x7F, "the NaN fix-up below assumes the NaN code 0x7F");
  return p & ~(((p & 0x7F7Fu) + 0x0101u) & 0x8080u);
#else
  return e4m3_rn_satfinite(lo) | (uint32_t{e4m3_rn_satfinite(hi)} << 8);
#endif
}

// Four E4M3 codes in one word, x0's in the low byte, each e4m3_rn_satfinite's: two pair
// conversions joined into one word, and the NaN fix-up of e4m3x2_rn_satfinite once for all four
// bytes (3 integer operations a word instead of 3 a pair: the FP8 quantizer's inner loops).
// tests/gpu/test_formats_gpu.cu holds it equal to the host's over all 2^32 inputs in each byte.
FP4SIM_HD uint32_t e4m3x4_rn_satfinite(float x0, float x1, float x2, float x3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(x1), "f"(x0));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(x3), "f"(x2));
  uint32_t p;
  asm("mov.b32 %0, {%1, %2};" : "=r"(p) : "h"(lo), "h"(hi));
  return p & ~(((p & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u);
#else
  return e4m3x2_rn_satfinite(x0, x1) | (e4m3x2_rn_satfinite(x2, x3) << 16);
#endif
}

// The same decode without branches or a leading-zero count (the GPU's quantizer decodes a block
// scale per 16 elements): a normal code's FP32 bits are its exponent rebased (+120) and its 3
// mantissa bits at the top of the fraction; a subnormal one is man * 2^-9, an exact product.
// tests/emu/test_formats.cpp holds it equal to e4m3_to_f32 for all 256 codes.
FP4SIM_HD float e4m3_to_f32_direct(uint8_t code) {
  const uint32_t mag = code & 0x7Fu, exp_field = mag >> 3, man = mag & 0x7u;
  const float normal = f32_from_bits(((exp_field + 120u) << 23) | (man << 20));
  const float sub = fmul_rn(static_cast<float>(man), 0.001953125f);  // 2^-9
  const float m = exp_field == 0 ? sub : normal;
  const uint32_t bits = f32_bits(m) | (static_cast<uint32_t>(code & 0x80u) << 24);
  return f32_from_bits(mag == 0x7Fu ? 0x7FFFFFFFu : bits);
}

FP4SIM_HD float e4m3_to_f32(uint8_t code) {
#if defined(__CUDA_ARCH__)
  return e4m3_to_f32_direct(code);
#endif
  const uint32_t mag = code & 0x7Fu;
  if (mag == 0x7Fu) return f32_from_bits(0x7FFFFFFFu);
  const float m = decode_magnitude<E4M3>(mag);
  return (code & 0x80u) ? -m : m;
}

// Block-scale forms for a value known to be >= 0 and not a NaN (an NVFP4 block scale before
// rounding: a NaN-ignoring amax times a finite scale) and for the codes such a value gets
// (0..0x7E): on sm_89+ the conversion instructions alone (e4m3x2 -> f16x2 is exact: every E4M3
// value is an FP16 value), without the NaN and Inf cases of e4m3_rn_satfinite and e4m3_to_f32.
// Equal to those on their domains: tests/gpu/test_formats_gpu.cu, over all 2^31 non-negative inputs
// and 127 codes.
FP4SIM_HD uint8_t e4m3_rn_satfinite_nonneg(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t
      pair;  // (min: +Inf would need the contract's 448 spelled out; above 448 satfinite gives it)
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(fminf(x, kE4M3Max)));
  return static_cast<uint8_t>(pair & 0xFFu);
#else
  return e4m3_rn_satfinite(x);
#endif
}
FP4SIM_HD float e4m3_to_f32_nonneg(uint8_t code) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t h2;  // (the code in both bytes: both halves hold its value, whichever byte feeds which)
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(static_cast<uint16_t>(code * 0x0101u)));
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<uint16_t>(h2)));
  return f;
#else
  return e4m3_to_f32(code);
#endif
}

// UE4M3: the scale as the tensor core reads it, sign bit masked; 0x7F after masking is NaN.
FP4SIM_HD float ue4m3_to_f32(uint8_t code) { return e4m3_to_f32(code & 0x7Fu); }

// ---- E5M2
// ----------------------------------------------------------------------------------------

// FP32 -> E5M2 cvt.rn.satfinite: |x| > 57344 (Inf included) -> ±57344; NaN -> 0x7F.
FP4SIM_HD uint8_t e5m2_rn_satfinite(float x) {
  const uint32_t b = f32_bits(x);
  const uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7Fu;
  const uint32_t sign = (b >> 31) ? E5M2::kSignBit : 0u;
  if (a == 0x7F800000u) return static_cast<uint8_t>(sign | E5M2::kMaxMagCode);
  return static_cast<uint8_t>(sign | encode_magnitude_rne<E5M2>(a));
}

FP4SIM_HD float e5m2_to_f32(uint8_t code) {
  const uint32_t mag = code & 0x7Fu;
  const bool neg = (code & 0x80u) != 0;
  if (mag == 0x7Cu) return f32_from_bits(neg ? 0xFF800000u : 0x7F800000u);
  if (mag > 0x7Cu) return f32_from_bits(0x7FFFFFFFu);
  const float m = decode_magnitude<E5M2>(mag);
  return neg ? -m : m;
}

// ---- UE8M0
// ---------------------------------------------------------------------------------------

// rz: the exponent field of |x| truncated to BF16 (zero/subnormal -> 0x00); satfinite: Inf -> 0xFE.
FP4SIM_HD uint8_t ue8m0_rz_satfinite(float x) {
  const uint32_t a = f32_bits(x) & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kUE8M0NaN;
  const uint32_t e = a >> 23;
  return static_cast<uint8_t>(e == 0xFFu ? kUE8M0MaxFinite : e);
}

// rp: ceil(log2|x|) biased by 127, clamped below at 0x00; overflow and Inf -> 0xFE; NaN -> 0xFF.
FP4SIM_HD uint8_t ue8m0_rp_satfinite(float x) {
  const uint32_t a = f32_bits(x) & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kUE8M0NaN;
  if (a == 0x7F800000u) return kUE8M0MaxFinite;
  if (a == 0) return 0;
  const uint32_t e = a >> 23;
  const uint32_t man = a & 0x7FFFFFu;
  int32_t r;
  if (e != 0) {
    r = static_cast<int32_t>(e) + (man != 0 ? 1 : 0);
  } else {
    // subnormal: x = man * 2^-149, ceil(log2 x) = -149 + ceil(log2 man)
    const int floor_log2 = 31 - clz32(man);
    const int ceil_log2 = floor_log2 + ((man & (man - 1u)) != 0 ? 1 : 0);
    r = -149 + ceil_log2 + 127;
  }
  if (r < 0) r = 0;
  if (r > kUE8M0MaxFinite) r = kUE8M0MaxFinite;
  return static_cast<uint8_t>(r);
}

// 2^(e-127); 0xFF is NaN; 0x00 is 2^-127 (an FP32 subnormal), never zero.
FP4SIM_HD float ue8m0_to_f32(uint8_t e) {
  if (e == kUE8M0NaN) return f32_from_bits(0x7FFFFFFFu);
  if (e == 0) return f32_from_bits(0x00400000u);
  return f32_from_bits(static_cast<uint32_t>(e) << 23);
}

// ---- BF16
// ----------------------------------------------------------------------------------------

// FP32 -> BF16 round-to-nearest-even; every NaN -> 0x7FFF; overflow rounds to Inf.
FP4SIM_HD uint16_t bf16_rne(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  // The conversion instruction (sm_80+): one instruction instead of six integer ones, which
  // matters in the RHT and quantizer kernels (it converts every input and every RHT output).
  // tests/gpu/test_formats_gpu.cu holds it equal to the formulation below over all 2^32 inputs,
  // NaN -> 0x7FFF included.
  uint16_t h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
#endif
  const uint32_t b = f32_bits(x);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return kBF16NaN;
  const uint32_t lsb = (b >> 16) & 1u;
  return static_cast<uint16_t>((b + 0x7FFFu + lsb) >> 16);
}

FP4SIM_HD float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

// Two FP32 -> BF16 RNE, packed: lo in the low half. On the GPU one conversion instruction for both
// (cvt.rn.bf16x2.f32, the pair form of bf16_rne's; callers pass no NaN).
FP4SIM_HD uint32_t bf16x2_rne(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#endif
  return static_cast<uint32_t>(bf16_rne(lo)) | static_cast<uint32_t>(bf16_rne(hi)) << 16;
}

// Round an FP32 to the nearest BF16 value, kept as FP32 (NaN -> the canonical BF16 NaN).
FP4SIM_HD float bf16_round(float x) { return bf16_to_f32(bf16_rne(x)); }

}  // namespace fp4sim
