// Narrow number formats (DESIGN.md §2, §4): bit patterns are the contract.
//
// Each format is a small constexpr descriptor; conversions from FP32 are written once here, for the
// host and the device, on the integer bit pattern (no FP rounding mode is involved anywhere). The
// device's own formulations of some of them (conversion instructions, bit tricks) live in
// gpu/formats_device.cuh, held equal to these by exhaustive tests.
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

// FP32 -> E2M1 cvt.rn.satfinite: ties to even on the grid; |x| > 6 (Inf included) -> ±6 with the
// sign kept; NaN -> +6 (0x7); -0 -> 0x8. tests/emu/test_formats_exhaustive.cpp holds it equal to
// cuda_fp4.h over all 2^32 inputs.
FP4SIM_HD uint8_t e2m1_rn_satfinite(float x) {
  const uint32_t b = f32_bits(x);
  const uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kE2M1NaNCode;
  const uint32_t sign = (b >> 31) ? E2M1::kSignBit : 0u;
  return static_cast<uint8_t>(sign | encode_magnitude_rne<E2M1>(a));
}

FP4SIM_HD float e2m1_to_f32(uint8_t code) {
  const float m = decode_magnitude<E2M1>(code & 0x7u);
  return (code & 0x8u) ? -m : m;
}

// Eight elements' E2M1 RN codes in one word, element 0 in the low nibble: e2m1_rn_satfinite(
// fmul_rn(v[i], enc)) each.
FP4SIM_HD uint32_t e2m1x8_rn_scaled(const float* v, float enc) {
  uint32_t w = 0;
  for (int i = 0; i < 8; ++i)
    w |= static_cast<uint32_t>(e2m1_rn_satfinite(fmul_rn(v[i], enc))) << (4 * i);
  return w;
}

// Stochastic rounding to E2M1 (DESIGN.md §4), rs.satfinite. `r` is the element's random byte.
// Round away from zero iff floor(frac*256) + r >= 256, frac = (a - lo)/step: the carry out of
// adding 8 random bits to the top 8 discarded bits. Computed on the bit pattern, exactly:
//  - [1, 6): the E2M1 codes continue the FP32 bit pattern (one fraction bit), so lo's code is
//    (bits >> 22) - 252 and the top 8 discarded bits are bits 21..14;
//  - [0, 1): step 0.5, floor(512 a) = lo_code * 256 + floor(frac * 256), with 512 a = m24 * 2^(e -
//  141).
// tests/emu/test_formats.cpp holds this equal to the FP32 formulation of the contract.
FP4SIM_HD uint8_t e2m1_rs_satfinite(float y, uint8_t r) {
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
// enc), byte i % 4 of r0 (i < 4) or r1), sr_byte_for_element's bytes.
FP4SIM_HD uint32_t e2m1x8_rs_scaled(const float* v, float enc, uint32_t r0, uint32_t r1) {
  uint32_t w = 0;
  for (int i = 0; i < 8; ++i) {
    const uint8_t r = static_cast<uint8_t>((i < 4 ? r0 : r1) >> (8 * (i & 3)));
    w |= static_cast<uint32_t>(e2m1_rs_satfinite(fmul_rn(v[i], enc), r)) << (4 * i);
  }
  return w;
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
  return static_cast<uint8_t>(sign | encode_magnitude_rne<E4M3>(a));
}

// Two E4M3 codes in one word: lo's in the low byte, hi's in the next, each e4m3_rn_satfinite's.
FP4SIM_HD uint32_t e4m3x2_rn_satfinite(float lo, float hi) {
  return e4m3_rn_satfinite(lo) | (uint32_t{e4m3_rn_satfinite(hi)} << 8);
}

// Four E4M3 codes in one word, x0's in the low byte, each e4m3_rn_satfinite's.
FP4SIM_HD uint32_t e4m3x4_rn_satfinite(float x0, float x1, float x2, float x3) {
  return e4m3x2_rn_satfinite(x0, x1) | (e4m3x2_rn_satfinite(x2, x3) << 16);
}

// E4M3 -> FP32: 0x7F / 0xFF are NaN (the canonical 0x7FFFFFFF); a normal code's FP32 bits are its
// exponent rebased (bias 7 -> 127: +120) and its 3 mantissa bits at the top of the fraction; a
// subnormal one is man * 2^-9, an exact product. tests/emu/test_formats.cpp holds it equal to the
// generic decode_magnitude<E4M3> for all 256 codes.
FP4SIM_HD float e4m3_to_f32(uint8_t code) {
  const uint32_t mag = code & 0x7Fu, exp_field = mag >> 3, man = mag & 0x7u;
  const float normal = f32_from_bits(((exp_field + 120u) << 23) | (man << 20));
  const float sub = fmul_rn(static_cast<float>(man), 0.001953125f);  // 2^-9
  const float m = exp_field == 0 ? sub : normal;
  const uint32_t bits = f32_bits(m) | (static_cast<uint32_t>(code & 0x80u) << 24);
  return f32_from_bits(mag == 0x7Fu ? 0x7FFFFFFFu : bits);
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

// FP32 -> BF16 round-to-nearest-even; every NaN -> 0x7FFF; overflow rounds to Inf: the bits plus
// 0x7FFF plus the kept half's lowest bit (ties to even), truncated to the top half.
// tests/emu/test_formats_exhaustive.cpp holds it equal to cuda_bf16.h over all 2^32 inputs.
FP4SIM_HD uint16_t bf16_rne(float x) {
  const uint32_t b = f32_bits(x);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return kBF16NaN;
  const uint32_t lsb = (b >> 16) & 1u;
  return static_cast<uint16_t>((b + 0x7FFFu + lsb) >> 16);
}

FP4SIM_HD float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

// Two FP32 -> BF16 RNE, packed: lo's bf16_rne in the low half, hi's in the high half.
FP4SIM_HD uint32_t bf16x2_rne(float lo, float hi) {
  return static_cast<uint32_t>(bf16_rne(lo)) | static_cast<uint32_t>(bf16_rne(hi)) << 16;
}

// Round an FP32 to the nearest BF16 value, kept as FP32 (NaN -> the canonical BF16 NaN).
FP4SIM_HD float bf16_round(float x) { return bf16_to_f32(bf16_rne(x)); }

// The largest magnitude among 16 BF16 values (bit patterns), as BF16 bits: the integer maximum of
// the magnitudes' bits, in order (magnitudes order as their bit patterns do); a NaN among them,
// whose bits are above Inf's, gives the canonical NaN's 0x7FFF.
FP4SIM_HD uint32_t bf16x16_max_magnitude_bits(const uint16_t* x) {
  uint32_t m = 0;
  for (int i = 0; i < 16; ++i) {
    const uint32_t a = x[i] & 0x7FFFu;
    m = a > m ? a : m;
  }
  return m > 0x7F80u ? kBF16NaN : m;
}

// ---- The conversions as a template parameter
// ------------------------------------------------------

// The scalar steps above that the device formulates its own way, as a template parameter `Fmt` of
// the steps that call them (emu/quantize_block.hpp's block steps, emu/rht.hpp's transform,
// emu/gemm.hpp's store): by default these, the reference; GPU kernels pass gpu::DeviceFormats
// (gpu/formats_device.cuh), the device's formulations of the same functions, held equal to these
// bit for bit by the exhaustive tests. The _nonneg members serve a block scale before rounding
// (>= 0, never a NaN) and the codes it gets (0..0x7E), where the device drops the NaN and Inf
// cases.
struct ReferenceFormats {
  FP4SIM_HD static uint8_t e2m1_rn_satfinite(float x) { return fp4sim::e2m1_rn_satfinite(x); }
  FP4SIM_HD static uint8_t e2m1_rs_satfinite(float y, uint8_t r) {
    return fp4sim::e2m1_rs_satfinite(y, r);
  }
  FP4SIM_HD static uint8_t e4m3_rn_satfinite(float x) { return fp4sim::e4m3_rn_satfinite(x); }
  FP4SIM_HD static uint32_t e4m3x4_rn_satfinite(float x0, float x1, float x2, float x3) {
    return fp4sim::e4m3x4_rn_satfinite(x0, x1, x2, x3);
  }
  FP4SIM_HD static uint8_t e4m3_rn_satfinite_nonneg(float x) {
    return fp4sim::e4m3_rn_satfinite(x);
  }
  FP4SIM_HD static float e4m3_to_f32_nonneg(uint8_t code) { return fp4sim::e4m3_to_f32(code); }
  FP4SIM_HD static uint16_t bf16_rne(float x) { return fp4sim::bf16_rne(x); }
  FP4SIM_HD static uint32_t bf16x2_rne(float lo, float hi) { return fp4sim::bf16x2_rne(lo, hi); }
  FP4SIM_HD static uint32_t bf16x16_max_magnitude_bits(const uint16_t* x) {
    return fp4sim::bf16x16_max_magnitude_bits(x);
  }
};

}  // namespace fp4sim
