// The device's formulations of the E2M1, E4M3 and BF16 conversions of emu/formats.hpp: one
// rounding addition onto the E2M1 grid ("magic numbers"), eight codes packed by byte permutes, the
// conversion instructions for E4M3 (sm_89+) and BF16 (sm_80+), and the largest BF16 magnitude by
// NaN-propagating FP32 maxima. Each computes the emu/ function it names, bit for bit:
// tests/emu/test_formats_exhaustive.cpp runs the magic-number formulations (host and device alike)
// against emu/ on the host over all 2^32 inputs, tests/gpu/test_formats_gpu.cu every function here
// against emu/ on the device over its whole input space. DeviceFormats gathers them for the steps
// that take the conversions as a template parameter (emu/formats.hpp's ReferenceFormats).
#pragma once

#include <cstdint>

#include "emu/formats.hpp"
#include "emu/hd.hpp"

namespace fp4sim::gpu {

// The GPU's E2M1 formulation: one IEEE addition rounds a value onto the E2M1 grid. The grid's step
// is 0.5 on [0, 2), 1 on [2, 4) and 2 on [4, 6], the FP32 ULP of M = 2^22, 2^23 and 2^24: for c
// clamped to [-6, 6], |c| + M rounds |c| to the step (RN: to nearest, ties to the even step count,
// which has the code's parity; RZ: down), the sum's low bits count the steps q, and the code is q
// plus the region's first code 0, 2 or 4 (= (bits(M) >> 22) - 298). M's bits are max(|c|'s
// exponent bits + 22, 2^22's), one VIADDMNMX on sm_90. The decoded magnitude q * step comes out of
// the same sum. tests/emu/test_formats_exhaustive.cpp holds both roundings equal to emu/'s
// e2m1_rn_satfinite and e2m1_rs_satfinite over all 2^32 inputs on the host,
// tests/gpu/test_formats_gpu.cu on the device.

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

// The quantizer's RN formulation for packing many codes (gpu/quantize_common.cuh): the magic number
// also carries the region's first code. M' = M plus 0, 2 or 4 of its ULPs (an even count: the sum's
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

// DeviceFormats::e2m1_rn_satfinite: e2m1_rn_magic's code.
FP4SIM_HD uint8_t e2m1_rn_satfinite_magic(float x) {
  float mag;
  return static_cast<uint8_t>(e2m1_rn_magic(x, &mag));
}
// DeviceFormats::e2m1_rs_satfinite: e2m1_rs_magic's code.
FP4SIM_HD uint8_t e2m1_rs_satfinite_magic(float y, uint8_t r) {
  float mag;
  return static_cast<uint8_t>(e2m1_rs_magic(y, r, &mag));
}

#if defined(__CUDACC__)

// The sign bits of eight products (the sign half of e2m1x8_rn_scaled_prmt and
// e2m1x8_rs_scaled_prmt): bit 4 i + 3 set where y[i] is negative (a NaN product is the GPU's
// positive canonical NaN).
__device__ __forceinline__ uint32_t e2m1x8_sign_bits_prmt(const float* y) {
  uint32_t xa, xb, ya, yb;  // xa = [S0, S2, S0, S2], xb = [S4, S6, S4, S6]; likewise the odd ones
  asm("prmt.b32 %0, %1, %2, 0xFBFB;" : "=r"(xa) : "r"(f32_bits(y[0])), "r"(f32_bits(y[2])));
  asm("prmt.b32 %0, %1, %2, 0xFBFB;" : "=r"(xb) : "r"(f32_bits(y[4])), "r"(f32_bits(y[6])));
  asm("prmt.b32 %0, %1, %2, 0xFBFB;" : "=r"(ya) : "r"(f32_bits(y[1])), "r"(f32_bits(y[3])));
  asm("prmt.b32 %0, %1, %2, 0xFBFB;" : "=r"(yb) : "r"(f32_bits(y[5])), "r"(f32_bits(y[7])));
  const uint32_t even = (xa & 0x0000FFFFu) | (xb & 0xFFFF0000u);  // byte j: element 2j's sign
  const uint32_t odd = (ya & 0x0000FFFFu) | (yb & 0xFFFF0000u);   // byte j: element 2j + 1's
  return ((even & 0x0F0F0F0Fu) | (odd & 0xF0F0F0F0u)) & 0x88888888u;
}

// emu's e2m1x8_rn_scaled: the offset-magic sums packed by shift-adds (the code is a sum's only bits
// below bit 23: a pair's byte, then a quad's two bytes, are clean) and the eight signs from the
// products' sign bytes by byte permutes (PRMT's sign-replicate mode: 0xFF for a negative product).
// A NaN product is the GPU's positive canonical NaN (0x7FFFFFFF), so a NaN input ends as +6, 0x7,
// as the contract says; tests/gpu/test_formats_gpu.cu checks negative NaNs.
__device__ __forceinline__ uint32_t e2m1x8_rn_scaled_prmt(const float* v, float enc) {
  float y[8];
  uint32_t s[8];
  FP4SIM_UNROLL
  for (int i = 0; i < 8; ++i) {
    y[i] = __fmul_rn(v[i], enc);
    s[i] = e2m1_rn_offset_magic_sum(y[i]);
  }
  const uint32_t q0 = (s[3] * 16u + s[2]) * 256u + (s[1] * 16u + s[0]);
  const uint32_t q1 = (s[7] * 16u + s[6]) * 256u + (s[5] * 16u + s[4]);
  return __byte_perm(q0, q1, 0x5410) | e2m1x8_sign_bits_prmt(y);
}

// emu's e2m1x8_rs_scaled: the offset-magic codes packed pairwise (a pair's byte is clean: a code's
// junk starts at bit 15), the four bytes gathered by permutes.
__device__ __forceinline__ uint32_t e2m1x8_rs_scaled_prmt(const float* v, float enc, uint32_t r0,
                                                          uint32_t r1) {
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
  return __byte_perm(lo, hi, 0x5410) | e2m1x8_sign_bits_prmt(y);
}

// ---- E4M3 by the sm_89+ conversion instructions (emu/ below sm_89)

// emu's e4m3_rn_satfinite: the NaN and Inf cases as emu/ writes them (the NaN code is the
// contract's), every finite input by cvt.rn.satfinite.e4m3x2.f32.
__device__ __forceinline__ uint8_t e4m3_rn_satfinite_cvt(float x) {
  const uint32_t b = f32_bits(x);
  const uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kE4M3NaN;
  const uint32_t sign = (b >> 31) ? E4M3::kSignBit : 0u;
  if (a == 0x7F800000u) return static_cast<uint8_t>(sign | E4M3::kMaxMagCode);
#if __CUDA_ARCH__ >= 890
  uint16_t pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(x));
  return static_cast<uint8_t>(pair & 0xFFu);
#else
  return static_cast<uint8_t>(sign | encode_magnitude_rne<E4M3>(a));
#endif
}

// emu's e4m3x2_rn_satfinite: one conversion instruction for both (its ±Inf -> ±448 is the
// contract's; a NaN gets the contract's 0x7F whatever the instruction gives).
__device__ __forceinline__ uint32_t e4m3x2_rn_satfinite_cvt(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
  uint16_t pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
  // Only a NaN converts to low bits 111 1111 (satfinite stops at 0x7E). Should the instruction
  // keep a NaN's sign (0xFF), clear the sign bit of each byte whose low seven bits are all ones
  // (adding 1 to them carries into bit 7 of that byte only): every NaN ends as the contract's 0x7F.
  const uint32_t p = pair;
  static_assert(kE4M3NaN == 0x7F, "the NaN fix-up below assumes the NaN code 0x7F");
  return p & ~(((p & 0x7F7Fu) + 0x0101u) & 0x8080u);
#else
  return e4m3x2_rn_satfinite(lo, hi);
#endif
}

// emu's e4m3x4_rn_satfinite: two pair conversions joined into one word, and the NaN fix-up of
// e4m3x2_rn_satfinite_cvt once for all four bytes (3 integer operations a word instead of 3 a
// pair: the FP8 quantizer's inner loops).
__device__ __forceinline__ uint32_t e4m3x4_rn_satfinite_cvt(float x0, float x1, float x2,
                                                            float x3) {
#if __CUDA_ARCH__ >= 890
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(x1), "f"(x0));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(x3), "f"(x2));
  uint32_t p;
  asm("mov.b32 %0, {%1, %2};" : "=r"(p) : "h"(lo), "h"(hi));
  return p & ~(((p & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u);
#else
  return e4m3x4_rn_satfinite(x0, x1, x2, x3);
#endif
}

// Block-scale forms for a value known to be >= 0 and not a NaN (an NVFP4 block scale before
// rounding: a NaN-ignoring amax times a finite scale) and for the codes such a value gets
// (0..0x7E): the conversion instructions alone (e4m3x2 -> f16x2 is exact: every E4M3 value is an
// FP16 value), without the NaN and Inf cases. Equal to e4m3_rn_satfinite and e4m3_to_f32 on
// those domains (all 2^31 non-negative inputs, 127 codes).
__device__ __forceinline__ uint8_t e4m3_rn_satfinite_nonneg_cvt(float x) {
#if __CUDA_ARCH__ >= 890
  uint16_t
      pair;  // (min: +Inf would need the contract's 448 spelled out; above 448 satfinite gives it)
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(fminf(x, kE4M3Max)));
  return static_cast<uint8_t>(pair & 0xFFu);
#else
  return e4m3_rn_satfinite(x);
#endif
}
__device__ __forceinline__ float e4m3_to_f32_nonneg_cvt(uint8_t code) {
#if __CUDA_ARCH__ >= 890
  uint32_t h2;  // (the code in both bytes: both halves hold its value, whichever byte feeds which)
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(static_cast<uint16_t>(code * 0x0101u)));
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<uint16_t>(h2)));
  return f;
#else
  return e4m3_to_f32(code);
#endif
}

// ---- BF16 by the sm_80+ conversion instructions (emu/ below sm_80)

// emu's bf16_rne: one cvt.rn.bf16.f32 instead of six integer operations, which matters wherever a
// kernel converts every element (the RHT's inputs, the quantizer's, the elementwise, norm and
// optimizer outputs, the GEMM epilogues). The instruction gives every NaN the canonical 0x7FFF, as
// emu/ does.
__device__ __forceinline__ uint16_t bf16_rne_cvt(float x) {
#if __CUDA_ARCH__ >= 800
  uint16_t h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
#else
  return bf16_rne(x);
#endif
}

// emu's bf16x2_rne: one cvt.rn.bf16x2.f32 for both (the pair form of bf16_rne_cvt's instruction,
// its NaN 0x7FFF in either half).
__device__ __forceinline__ uint32_t bf16x2_rne_cvt(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#else
  return bf16x2_rne(lo, hi);
#endif
}

// emu's bf16_round by bf16_rne_cvt.
__device__ __forceinline__ float bf16_round_cvt(float x) { return bf16_to_f32(bf16_rne_cvt(x)); }

// emu's bf16x16_max_magnitude_bits as a tree of NaN-propagating FP32 maxima of |x_i| (max.NaN: a
// NaN operand gives the canonical NaN 0x7FFFFFFF, whose top half is the reference's 0x7FFF; else
// the larger magnitude): 15 FMNMX on FP32 values that a caller such as the RHT has anyway, instead
// of 16 masks and 6 three-way integer maxima on the ALU pipe the quantize kernels are bound on.
// The order of a maximum does not matter: both are the maximum under one total order (magnitudes
// by value, every NaN one value above Inf), so any bracketing gives the same result. Every partial
// result of the tree is |c| for some BF16 pattern c (max.NaN returns an operand or the canonical
// NaN, |0x7FFF|), so the tree equals the reference on every chunk once its pairwise step does on
// every pair of BF16 patterns: tests/gpu/test_formats_gpu.cu checks all 2^32 pairs.
__device__ __forceinline__ float fmax_nan_propagating(float a, float b) {
#if __CUDA_ARCH__ >= 800
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
#else
  return f32_isnan(a) || f32_isnan(b) ? f32_from_bits(0x7FFFFFFFu) : fmaxf(a, b);
#endif
}
__device__ __forceinline__ uint32_t bf16x16_max_magnitude_bits_fmnmx(const uint16_t* x) {
  float m[8];
  FP4SIM_UNROLL
  for (int i = 0; i < 8; ++i)
    m[i] = fmax_nan_propagating(fabsf(bf16_to_f32(x[2 * i])), fabsf(bf16_to_f32(x[2 * i + 1])));
  FP4SIM_UNROLL
  for (int w = 4; w >= 1; w /= 2) {
    FP4SIM_UNROLL
    for (int i = 0; i < w; ++i) m[i] = fmax_nan_propagating(m[i], m[i + w]);
  }
  return f32_bits(m[0]) >> 16;
}

// The device's conversions for the steps that take them as a template parameter (emu/formats.hpp's
// ReferenceFormats; the members' names and arguments are its).
struct DeviceFormats {
  __device__ static uint8_t e2m1_rn_satfinite(float x) { return e2m1_rn_satfinite_magic(x); }
  __device__ static uint8_t e2m1_rs_satfinite(float y, uint8_t r) {
    return e2m1_rs_satfinite_magic(y, r);
  }
  __device__ static uint8_t e4m3_rn_satfinite(float x) { return e4m3_rn_satfinite_cvt(x); }
  __device__ static uint32_t e4m3x4_rn_satfinite(float x0, float x1, float x2, float x3) {
    return e4m3x4_rn_satfinite_cvt(x0, x1, x2, x3);
  }
  __device__ static uint8_t e4m3_rn_satfinite_nonneg(float x) {
    return e4m3_rn_satfinite_nonneg_cvt(x);
  }
  __device__ static float e4m3_to_f32_nonneg(uint8_t code) { return e4m3_to_f32_nonneg_cvt(code); }
  __device__ static uint16_t bf16_rne(float x) { return bf16_rne_cvt(x); }
  __device__ static uint32_t bf16x2_rne(float lo, float hi) { return bf16x2_rne_cvt(lo, hi); }
  __device__ static uint32_t bf16x16_max_magnitude_bits(const uint16_t* x) {
    return bf16x16_max_magnitude_bits_fmnmx(x);
  }
};

#endif  // __CUDACC__

}  // namespace fp4sim::gpu
