// Per-block quantization steps (DESIGN.md §5), host and device. Both backends quantize a block by
// calling these functions, so a GPU block and an emulator block agree bit for bit by construction.
// Every FP32 step is rounded to nearest-even, one operation at a time, in the order the contract
// writes it.
#pragma once

#include <cstdint>

#include "emu/formats.hpp"
#include "emu/hd.hpp"
#include "emu/philox.hpp"

namespace fp4sim {

// The block steps take the scalar conversions they call as a template parameter `Fmt`:
// ReferenceFormats (emu/formats.hpp) by default, gpu::DeviceFormats in the GPU's kernels.

constexpr int kNvfp4Block = 16;               // elements per NVFP4 scale (1x16, or a 16x16 tile)
constexpr int kMxfp4Block = 32;               // elements per MXFP4 scale
constexpr int kFp8Block = 128;                // elements per FP8 scale (1x128, or a 128x128 tile)
constexpr int kSrChunk = 16;                  // elements per Philox call
constexpr float kNvfp4Range = 2688.0f;        // 448 * 6: E4M3 max times E2M1 max
constexpr float kFourOverSixRange = 1536.0f;  // 256 * 6
constexpr float kFourOverSixScaleMax = 448.0f;

// Global encode scale S_enc = fminf(range / amax, FLT_MAX), 1 when amax == 0 or the quotient is 0.
// Written with a bit test for the overflow: g++ 13 at -O2 (Ubuntu 24.04, the GPU host) folded the
// plain `if (s > FLT_MAX) ...; if (amax == 0 || s == 0) s = 1` to S_enc = 1 for a tiny normal amax
// (2688 / 2.35e-38 overflows), which test Quantize.Nvfp4_TinyBlockScaleIsExact catches.
FP4SIM_HD float nvfp4_global_encode_scale(float amax, float range) {
  if (f32_bits(amax) == 0u) return 1.0f;  // amax is a NaN-ignoring max of |x|: +0 or positive
  const float s = fdiv_rn(range, amax);
  const uint32_t sb = f32_bits(s);
  if (sb == 0x7F800000u) return kFltMax;  // overflow: +Inf -> FLT_MAX
  if (sb == 0u) return 1.0f;              // amax = +Inf (or a quotient that underflows)
  return s;
}

// enc_b = fminf(1 / (s_b * S_dec), FLT_MAX) from the scale's value s_b; s_b == 0 gives 1/0 = Inf
// -> FLT_MAX.
FP4SIM_HD float nvfp4_encode_from_scale_value(float s_b, float s_dec) {
  const float e = frcp_rn(fmul_rn(s_b, s_dec));
  return e > kFltMax ? kFltMax : e;
}
// The same from the stored scale, a code the block-scale functions made (0..0x7E, never the NaN
// 0x7F): Fmt::e4m3_to_f32_nonneg's domain.
template <class Fmt = ReferenceFormats>
FP4SIM_HD float nvfp4_block_encode_scale(uint8_t scale, float s_dec) {
  return nvfp4_encode_from_scale_value(Fmt::e4m3_to_f32_nonneg(scale), s_dec);
}

// Stored E4M3 scale of a block (standard NVFP4): e4m3_rn_satfinite(amax_b * (S_enc * (1/6))); the
// product is >= 0 and never a NaN (a NaN-ignoring amax, a finite S_enc):
// Fmt::e4m3_rn_satfinite_nonneg's domain.
template <class Fmt = ReferenceFormats>
FP4SIM_HD uint8_t nvfp4_block_scale(float amax_b, float s_enc) {
  return Fmt::e4m3_rn_satfinite_nonneg(fmul_rn(amax_b, fmul_rn(s_enc, 1.0f / 6.0f)));
}

// FP8 block scaling (DESIGN.md §9, the paper's FP8 baseline): enc = fminf(448 / amax_b, FLT_MAX),
// 1 when amax_b == 0 or the quotient is 0 (amax_b = Inf); the stored FP32 scale is 1 / enc.
FP4SIM_HD float fp8_block_encode_scale(float amax_b) {
  return nvfp4_global_encode_scale(amax_b, kE4M3Max);
}
// The stored FP32 scale of a block: 1 / enc, correctly rounded.
FP4SIM_HD float fp8_block_decode_scale(float enc) { return frcp_rn(enc); }
// One element: e4m3_rn_satfinite(x * enc) (NaN -> 0x7F).
FP4SIM_HD uint8_t fp8_quantize_element(float x, float enc) {
  return e4m3_rn_satfinite(fmul_rn(x, enc));
}
// Two elements' codes as one pair (x0's in the low byte): fp8_quantize_element of each.
FP4SIM_HD uint32_t fp8_quantize_pair(float x0, float x1, float enc) {
  return e4m3x2_rn_satfinite(fmul_rn(x0, enc), fmul_rn(x1, enc));
}
// Four elements' codes as one word (x0's in the low byte): fp8_quantize_element of each.
template <class Fmt = ReferenceFormats>
FP4SIM_HD uint32_t fp8_quantize_quad(float x0, float x1, float x2, float x3, float enc) {
  return Fmt::e4m3x4_rn_satfinite(fmul_rn(x0, enc), fmul_rn(x1, enc), fmul_rn(x2, enc),
                                  fmul_rn(x3, enc));
}
// Decoded element: e4m3(code) * scale, a NaN result canonical.
FP4SIM_HD float fp8_decode_element(uint8_t code, float scale) {
  const float v = fmul_rn(e4m3_to_f32(code), scale);
  return f32_isnan(v) ? f32_from_bits(0x7FFFFFFFu) : v;
}

// Decode factor of a block: ((float)s_b * amax) * (1 / range).
FP4SIM_HD float nvfp4_decode_factor(uint8_t scale, float amax, float range) {
  return fmul_rn(fmul_rn(e4m3_to_f32(scale), amax), fdiv_rn(1.0f, range));
}

// Decoded element: e2m1(code) * factor; a NaN result (0 * Inf, or a NaN factor) is the canonical
// 0x7FFFFFFF, because CPUs and GPUs produce different NaN bit patterns for invalid operations.
FP4SIM_HD float decode_element(uint8_t code, float factor) {
  const float v = fmul_rn(e2m1_to_f32(code), factor);
  return f32_isnan(v) ? f32_from_bits(0x7FFFFFFFu) : v;
}

// One element: RN, or SR with the element's random byte.
template <class Fmt = ReferenceFormats>
FP4SIM_HD uint8_t e2m1_quantize(float x, float enc, bool stochastic, uint8_t rbyte) {
  const float y = fmul_rn(x, enc);
  return stochastic ? Fmt::e2m1_rs_satfinite(y, rbyte) : Fmt::e2m1_rn_satfinite(y);
}

// Four Over Six candidate scales for a block: map6 and map4 (DESIGN.md §5).
template <class Fmt = ReferenceFormats>
FP4SIM_HD void four_over_six_candidates(float amax_b, float s_enc, uint8_t* map6, uint8_t* map4) {
  const float base = fmul_rn(fdiv_rn(amax_b, 6.0f), s_enc);
  const float b4 = fmul_rn(base, 1.5f);
  *map6 = Fmt::e4m3_rn_satfinite(base < kFourOverSixScaleMax ? base : kFourOverSixScaleMax);
  *map4 = Fmt::e4m3_rn_satfinite(b4 < kFourOverSixScaleMax ? b4 : kFourOverSixScaleMax);
}

// Error contribution of one element under a Four Over Six candidate scale:
// val = ((e2m1(q) * (float)s) * amax) / 1536, diff = val - x; |diff| (mae) or diff*diff (mse).
FP4SIM_HD float four_over_six_element_error(float x, uint8_t q, uint8_t scale, float amax,
                                            bool mse) {
  const float val =
      fdiv_rn(fmul_rn(fmul_rn(e2m1_to_f32(q), e4m3_to_f32(scale)), amax), kFourOverSixRange);
  const float diff = fsub_rn(val, x);
  return mse ? fmul_rn(diff, diff) : f32_abs(diff);
}

// ---- Whole NVFP4 blocks
// ----------------------------------------------------------------------------

// The per-tensor part of an NVFP4 copy: amax, S_enc, S_dec and the decode range (2688, or 1536 for
// a Four Over Six copy).
struct Nvfp4Global {
  float amax;
  float s_enc;
  float s_dec;
  float range;
};
FP4SIM_HD Nvfp4Global nvfp4_global(float amax, bool four_over_six) {
  Nvfp4Global g;
  g.amax = amax;
  g.range = four_over_six ? kFourOverSixRange : kNvfp4Range;
  g.s_enc = nvfp4_global_encode_scale(amax, g.range);
  g.s_dec = fdiv_rn(1.0f, g.s_enc);
  return g;
}

// Random bits of one chunk, or none for RN.
struct SrBits {
  bool enabled;
  Philox4x32 bits;
};
FP4SIM_HD SrBits sr_bits_for_chunk(bool enabled, uint64_t seed, uint64_t stream, uint64_t chunk) {
  SrBits s;
  s.enabled = enabled;
  s.bits = enabled ? sr_chunk_bits(seed, stream, chunk) : Philox4x32{{0, 0, 0, 0}};
  return s;
}

// 16 values -> 8 packed bytes (element 2i in the low nibble) with encode scale enc. The RN/SR
// choice is made once per chunk, so each unrolled loop stays small (kernels are instruction-cache
// bound when both roundings are inlined per element).
template <class Fmt = ReferenceFormats>
FP4SIM_HD void e2m1_encode16(const float* v, float enc, const SrBits& sr, uint8_t* packed) {
  if (sr.enabled) {
    FP4SIM_UNROLL
    for (int i = 0; i < kNvfp4Block / 2; ++i) {
      const uint8_t lo =
          Fmt::e2m1_rs_satfinite(fmul_rn(v[2 * i], enc), sr_byte_for_element(sr.bits, 2 * i));
      const uint8_t hi = Fmt::e2m1_rs_satfinite(fmul_rn(v[2 * i + 1], enc),
                                                sr_byte_for_element(sr.bits, 2 * i + 1));
      packed[i] = static_cast<uint8_t>(lo | (hi << 4));
    }
  } else {
    FP4SIM_UNROLL
    for (int i = 0; i < kNvfp4Block / 2; ++i) {
      const uint8_t lo = Fmt::e2m1_rn_satfinite(fmul_rn(v[2 * i], enc));
      const uint8_t hi = Fmt::e2m1_rn_satfinite(fmul_rn(v[2 * i + 1], enc));
      packed[i] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

// NaN-ignoring max |v| over n values with stride.
FP4SIM_HD float amax_strided(const float* v, int n, int stride) {
  float m = 0.0f;
  FP4SIM_UNROLL
  for (int i = 0; i < n; ++i) m = fmax_nan_ignored(m, f32_abs(v[i * stride]));
  return m;
}

// Sum of Four Over Six element errors of one 16-value row, in index order, added onto err.
FP4SIM_HD float four_over_six_row_error(const float* v, const uint8_t* packed, uint8_t scale,
                                        float amax, bool mse, float err) {
  FP4SIM_UNROLL
  for (int i = 0; i < kNvfp4Block; ++i) {
    const uint8_t q = (packed[i / 2] >> (4 * (i & 1))) & 0xFu;
    err = fadd_rn(err, four_over_six_element_error(v[i], q, scale, amax, mse));
  }
  return err;
}

// One 1x16 NVFP4 block: returns the stored E4M3 scale, writes 8 packed bytes. With Four Over Six
// (g.range == 1536) both candidate scales are tried and map4 kept iff its error is smaller.
template <class Fmt = ReferenceFormats>
FP4SIM_HD uint8_t nvfp4_quantize_1x16(const float* v, const Nvfp4Global& g, bool four_over_six,
                                      bool mse, const SrBits& sr, uint8_t* packed) {
  const float amax_b = amax_strided(v, kNvfp4Block, 1);
  if (!four_over_six) {
    const uint8_t s = nvfp4_block_scale<Fmt>(amax_b, g.s_enc);
    e2m1_encode16<Fmt>(v, nvfp4_block_encode_scale<Fmt>(s, g.s_dec), sr, packed);
    return s;
  }
  uint8_t map6, map4, p6[kNvfp4Block / 2], p4[kNvfp4Block / 2];
  four_over_six_candidates<Fmt>(amax_b, g.s_enc, &map6, &map4);
  e2m1_encode16<Fmt>(v, nvfp4_block_encode_scale<Fmt>(map6, g.s_dec), sr, p6);
  e2m1_encode16<Fmt>(v, nvfp4_block_encode_scale<Fmt>(map4, g.s_dec), sr, p4);
  const float err6 = four_over_six_row_error(v, p6, map6, g.amax, mse, 0.0f);
  const float err4 = four_over_six_row_error(v, p4, map4, g.amax, mse, 0.0f);
  const bool use4 = err4 < err6;
  for (int i = 0; i < kNvfp4Block / 2; ++i) packed[i] = use4 ? p4[i] : p6[i];
  return use4 ? map4 : map6;
}

// A 16x16 tile is read through load(a, b) = element (a, b) of the *input* tile (a row, b column),
// whatever the layout of the storage behind it.
template <class Load>
FP4SIM_HD float tile16_amax(const Load& load) {
  float m = 0.0f;
  for (int a = 0; a < kNvfp4Block; ++a)
    for (int b = 0; b < kNvfp4Block; ++b) m = fmax_nan_ignored(m, f32_abs(load(a, b)));
  return m;
}

// Four Over Six scale of a 16x16 tile. The error is one sequential FP32 sum over the 256 elements
// in the input's row-major order (a outer, b inner), so the row-wise and the transposed column-wise
// copies choose the same scale and the Dgrad weight stays the exact transpose of the Fprop weight.
template <class Fmt = ReferenceFormats, class Load>
FP4SIM_HD uint8_t nvfp4_tile_four_over_six_scale(const Load& load, const Nvfp4Global& g, bool mse) {
  uint8_t map6, map4;
  four_over_six_candidates<Fmt>(tile16_amax(load), g.s_enc, &map6, &map4);
  const uint8_t maps[2] = {map6, map4};
  float err[2] = {0.0f, 0.0f};
  for (int m = 0; m < 2; ++m) {
    const float enc = nvfp4_block_encode_scale<Fmt>(maps[m], g.s_dec);
    for (int a = 0; a < kNvfp4Block; ++a) {
      for (int b = 0; b < kNvfp4Block; ++b) {
        const float x = load(a, b);
        const uint8_t q = e2m1_quantize<Fmt>(x, enc, false, 0);
        err[m] = fadd_rn(err[m], four_over_six_element_error(x, q, maps[m], g.amax, mse));
      }
    }
  }
  return err[1] < err[0] ? map4 : map6;
}

// The stored scale of a 16x16 tile (2D weights), standard or Four Over Six.
template <class Fmt = ReferenceFormats, class Load>
FP4SIM_HD uint8_t nvfp4_tile_scale(const Load& load, const Nvfp4Global& g, bool four_over_six,
                                   bool mse) {
  return four_over_six ? nvfp4_tile_four_over_six_scale<Fmt>(load, g, mse)
                       : nvfp4_block_scale<Fmt>(tile16_amax(load), g.s_enc);
}

// ---- MXFP4
// ---------------------------------------------------------------------------------------

enum class MxScaleRule : uint8_t { Floor, Ceil };

// Scale byte of a 32-block from its NaN-ignoring amax. `has_inf`: the block holds an Inf;
// `all_nan`: every element is NaN. Both give 0xFF (and all codes 0).
FP4SIM_HD uint8_t mxfp4_block_scale(float amax_b, bool has_inf, bool all_nan, MxScaleRule rule) {
  if (has_inf || all_nan) return kUE8M0NaN;
  if (amax_b == 0.0f) return 0;
  const uint32_t a = f32_bits(amax_b);
  const int biased = static_cast<int>(a >> 23);
  int e;           // floor(log2 amax_b)
  uint32_t man23;  // the significand's fraction, normalised to 23 bits
  if (biased != 0) {
    e = biased - 127;
    man23 = a & 0x7FFFFFu;
  } else {
    const uint32_t m = a & 0x7FFFFFu;
    const int msb = 31 - clz32(m);
    e = -149 + msb;
    man23 = (m << (23 - msb)) & 0x7FFFFFu;
  }
  // floor rule (OCP MX v1.0): x = e - 2. ceil rule: smallest x with 6 * 2^x >= amax_b, i.e.
  // e - 2 when the significand is <= 1.5 (6 * 2^(e-2) = 1.5 * 2^e), else e - 1. Exact comparison.
  int x = e - 2;
  if (rule == MxScaleRule::Ceil && man23 > 0x400000u) x = e - 1;
  if (x < -127) x = -127;
  if (x > 127) x = 127;
  return static_cast<uint8_t>(x + 127);
}

// 2^(127 - byte), the exact reciprocal of the block scale (byte 0..254).
FP4SIM_HD float mxfp4_encode_factor(uint8_t byte) {
  const int k = 127 - static_cast<int>(byte);  // -127..127
  return k >= -126 ? f32_from_bits(static_cast<uint32_t>(k + 127) << 23)
                   : f32_from_bits(0x00400000u);  // 2^-127
}

// One 1x32 MXFP4 block: returns the UE8M0 scale byte, writes 16 packed bytes. The two 16-element
// halves draw their random bits from consecutive chunks (sr0, sr1).
template <class Fmt = ReferenceFormats>
FP4SIM_HD uint8_t mxfp4_quantize_1x32(const float* v, MxScaleRule rule, const SrBits& sr0,
                                      const SrBits& sr1, uint8_t* packed) {
  float amax_b = 0.0f;
  bool has_inf = false, all_nan = true;
  for (int i = 0; i < kMxfp4Block; ++i) {
    if (f32_isinf(v[i])) has_inf = true;
    if (!f32_isnan(v[i])) all_nan = false;
    amax_b = fmax_nan_ignored(amax_b, f32_abs(v[i]));
  }
  const uint8_t byte = mxfp4_block_scale(amax_b, has_inf, all_nan, rule);
  if (byte == kUE8M0NaN) {
    for (int i = 0; i < kMxfp4Block / 2; ++i) packed[i] = 0;
    return byte;
  }
  const float enc = mxfp4_encode_factor(byte);
  e2m1_encode16<Fmt>(v, enc, sr0, packed);
  e2m1_encode16<Fmt>(v + kNvfp4Block, enc, sr1, packed + kNvfp4Block / 2);
  return byte;
}

// ---- cuBLASLt 128x4 tiled scale layout (DESIGN.md §8)
// ---------------------------------------------

constexpr int kTiledRows = 128;
constexpr int kTiledCols = 4;

FP4SIM_HD int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// Offset of scale (r, c) of a [rows, k_blocks] scale matrix in the padded 128x4 tiled layout.
FP4SIM_HD int64_t tiled_scale_offset(int64_t r, int64_t c, int64_t k_blocks) {
  const int64_t col_tiles = (k_blocks + kTiledCols - 1) / kTiledCols;
  return (((r / kTiledRows) * col_tiles + c / kTiledCols) * 32 + r % 32) * 16 +
         ((r % kTiledRows) / 32) * 4 + c % kTiledCols;
}

}  // namespace fp4sim
