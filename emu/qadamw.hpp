// Q-AdamW (DESIGN.md §13): AdamW whose m and v are stored in NVFP4 between steps, host and device.
// Both backends run qadamw_tile on every tile of every tensor, so their states and parameters
// agree bit for bit by construction.
//
// A tensor's state, its n elements seen in row order (every row a whole number of tiles):
//   m: codes (n/2 bytes, element 2i in the low nibble), one E4M3 scale per 16-block, the amax of
//      its transformed values; a Four Over Six copy (range 1536) of y = m·H per block.
//   v: codes, scales and amax as m's (a standard copy, range 2688), and one BF16 mean per tile of
//      v_tile elements: u = sqrt(v), mu_b = bf16(mean of u over the tile), y = (u − mu_b)·H;
//      with optim.v_floor = tile_min also one BF16 floor per tile: the smallest positive v of the
//      tile rounded toward zero, below which no decoded v̂ of the tile falls.
// H = diag(s)·H16/4 of §6 (its sign vector), applied here in FP32 with RN sums, no BF16 rounding.
//
// One step is two passes over the tensor with the same arithmetic: pass 0 decodes each tile's
// state, updates m and v in FP32 (adamw_element) and takes the amax of the transformed new m and
// new v; pass 1 does it again and encodes the new state under the new amaxes (m: Four Over Six
// scale chosen on RN error, elements rounded by SR under that scale; v: RN), and writes the
// parameters. A tile's state is read before it is rewritten, so pass 1 runs in place.
#pragma once

#include <cstdint>

#include "emu/formats.hpp"
#include "emu/hd.hpp"
#include "emu/optim.hpp"
#include "emu/quantize_block.hpp"
#include "emu/rht.hpp"

namespace fp4sim {

// s_i · H16[i][j] < 0: §6's sign of the term x_i of y_j.
FP4SIM_HD bool qadamw_term_negative(int i, int j) {
  return (((kRhtSignMask >> i) ^ (hadamard_odd_mask(j) >> i)) & 1u) != 0;
}

// y = x·H: y_j = 0.25·(sum over i = 0..15 of ±x_i), the sum from i = 0 upwards, each addition RN.
FP4SIM_HD void qadamw_forward16(const float* x, float* y) {
  FP4SIM_UNROLL
  for (int j = 0; j < kNvfp4Block; ++j) {
    float acc = qadamw_term_negative(0, j) ? -x[0] : x[0];
    FP4SIM_UNROLL
    for (int i = 1; i < kNvfp4Block; ++i)
      acc = fadd_rn(acc, qadamw_term_negative(i, j) ? -x[i] : x[i]);
    y[j] = fmul_rn(0.25f, acc);
  }
}

// x = y·Hᵀ: x_i = s_i·0.25·(sum over j = 0..15 of H16[i][j]·y_j), from j = 0 upwards, RN.
FP4SIM_HD void qadamw_inverse16(const float* y, float* x) {
  FP4SIM_UNROLL
  for (int i = 0; i < kNvfp4Block; ++i) {
    float acc = y[0];
    FP4SIM_UNROLL
    for (int j = 1; j < kNvfp4Block; ++j)
      acc = fadd_rn(acc, (hadamard_odd_mask(j) >> i) & 1u ? -y[j] : y[j]);
    const float v = fmul_rn(0.25f, acc);
    x[i] = (kRhtSignMask >> i) & 1u ? -v : v;
  }
}

// The 16 values of one stored block: e2m1(code)·((s_b·amax)·(1/range)) (decode_element).
FP4SIM_HD void qadamw_decode16(const uint8_t* packed, uint8_t scale, float amax, float range,
                               float* out) {
  const float f = nvfp4_decode_factor(scale, amax, range);
  FP4SIM_UNROLL
  for (int i = 0; i < kNvfp4Block; ++i)
    out[i] = decode_element((packed[i / 2] >> (4 * (i & 1))) & 0xFu, f);
}

// max(max(mu + x, 0)², floor), the reconstructed second moment (a NaN stays NaN; floor 0: none).
FP4SIM_HD float qadamw_v_hat(float mu, float x, float floor) {
  float t = fadd_rn(mu, x);
  t = t < 0.0f ? 0.0f : t;
  const float v = fmul_rn(t, t);
  return v < floor ? floor : v;
}

// A tile's stored floor: the BF16 bits of its smallest positive v rounded toward zero (so never
// above it); 0 where no v of the tile is positive. v_min: +Inf for none.
FP4SIM_HD uint16_t qadamw_floor_bits(float v_min) {
  return v_min < f32_from_bits(0x7F800000u) ? static_cast<uint16_t>(f32_bits(v_min) >> 16) : 0;
}

// The state of one tile, in place: v_tile/2 code bytes and v_tile/16 scales of each moment, and
// the tile's BF16 mean of sqrt(v).
struct QAdamWTile {
  uint8_t* m_codes;
  uint8_t* m_scales;
  uint8_t* v_codes;
  uint8_t* v_scales;
  uint16_t* v_mean;
  uint16_t* v_floor;  // the tile's floor (optim.v_floor = tile_min), or null: none
};

// The amaxes of a tensor's state: those its stored encoding was made with (decode), and the new
// ones pass 0 found (encode, pass 1).
struct QAdamWAmax {
  float m_old, v_old, m_new, v_new;
};

// ---- one 16-block of each moment: transform, encode, decode (the step below, and the tools'
// error measurements, fp4sim qadamw-error, compose these)

// y = m·H
FP4SIM_HD void qadamw_m_transformed(const float* m, float* y) { qadamw_forward16(m, y); }
// y = (sqrt(v) − mu)·H, mu the tile's stored BF16 mean as a float
FP4SIM_HD void qadamw_v_transformed(const float* v, float mu, float* y) {
  float r[kNvfp4Block];
  FP4SIM_UNROLL
  for (int i = 0; i < kNvfp4Block; ++i) r[i] = fsub_rn(fsqrt_rn(v[i]), mu);
  qadamw_forward16(r, y);
}
// The stored mean of a tile: bf16(sum / n), sum the tile's sqrt(v) added in index order.
template <class Fmt = ReferenceFormats>
FP4SIM_HD uint16_t qadamw_tile_mean(float sum, int n) {
  return Fmt::bf16_rne(fdiv_rn(sum, static_cast<float>(n)));
}
// m's block of y: its Four Over Six scale chosen on RN copies (gm: range 1536), then the elements
// rounded by SR (sr) under that scale; returns the scale, writes 8 packed bytes.
template <class Fmt = ReferenceFormats>
FP4SIM_HD uint8_t qadamw_encode_m(const float* y, const Nvfp4Global& gm, const SrBits& sr,
                                  uint8_t* packed) {
  uint8_t rn[kNvfp4Block / 2];
  const uint8_t sm =
      nvfp4_quantize_1x16<Fmt>(y, gm, true, false, sr_bits_for_chunk(false, 0, 0, 0), rn);
  e2m1_encode16<Fmt>(y, nvfp4_block_encode_scale<Fmt>(sm, gm.s_dec), sr, packed);
  return sm;
}
// v's block of y: standard NVFP4 (gv: range 2688), RN.
template <class Fmt = ReferenceFormats>
FP4SIM_HD uint8_t qadamw_encode_v(const float* y, const Nvfp4Global& gv, uint8_t* packed) {
  return nvfp4_quantize_1x16<Fmt>(y, gv, false, false, sr_bits_for_chunk(false, 0, 0, 0), packed);
}
// m̂ = deq(q)·Hᵀ of one block (amax: m's, range 1536)
FP4SIM_HD void qadamw_decode_m(const uint8_t* packed, uint8_t scale, float amax, float* m) {
  float y[kNvfp4Block];
  qadamw_decode16(packed, scale, amax, kFourOverSixRange, y);
  qadamw_inverse16(y, m);
}
// v̂ = max(max(mu + deq(q)·Hᵀ, 0)², floor) of one block (amax: v's, range 2688; mu the tile's
// mean; floor the tile's, 0 for none)
FP4SIM_HD void qadamw_decode_v(const uint8_t* packed, uint8_t scale, float amax, float mu,
                               float floor, float* v) {
  float y[kNvfp4Block], r[kNvfp4Block];
  qadamw_decode16(packed, scale, amax, kNvfp4Range, y);
  qadamw_inverse16(y, r);
  FP4SIM_UNROLL
  for (int i = 0; i < kNvfp4Block; ++i) v[i] = qadamw_v_hat(mu, r[i], floor);
}

// ---- the step ------------------------------------------------------------------------------

// Decoded state of block b of a tile (elements 16b..16b+15), then the FP32 AdamW moments of the
// step: the new m and v out; p updated too (pass 1 keeps it, pass 0 throws it away).
FP4SIM_HD void qadamw_block_update(const QAdamWTile& t, int b, float mu_old, float floor_old,
                                   const QAdamWAmax& a, const float* grad, float* p, float* m,
                                   float* v, const AdamWStep& s) {
  qadamw_decode_m(t.m_codes + 8 * b, t.m_scales[b], a.m_old, m);
  qadamw_decode_v(t.v_codes + 8 * b, t.v_scales[b], a.v_old, mu_old, floor_old, v);
  FP4SIM_UNROLL
  for (int i = 0; i < kNvfp4Block; ++i) adamw_element(p[i], grad[i], m[i], v[i], s);
}

// One tile of n = 16·blocks elements: params p, gradients grad (both at the tile's first element),
// its state t, the tensor's amaxes a. Pass 0 (encode false): *amax_m and *amax_v become the
// NaN-ignoring max |y| of the tile's transformed new m and v; nothing is written. Pass 1: the new
// state and parameters are written; SR chunk c of the tile draws sr_chunk_bits(seed, stream,
// chunk0 + c), chunk0 the tile's first 16-block in the tensor. p16 (non-null): the parameters'
// BF16 bits too.
template <class Fmt = ReferenceFormats>
FP4SIM_HD void qadamw_tile(bool encode, int blocks, float* p, const float* grad,
                           const QAdamWTile& t, const QAdamWAmax& a, const AdamWStep& s,
                           uint64_t seed, uint64_t stream, uint64_t chunk0, float* amax_m,
                           float* amax_v, uint16_t* p16) {
  const float mu_old = bf16_to_f32(*t.v_mean);
  const float floor_old = t.v_floor ? bf16_to_f32(*t.v_floor) : 0.0f;
  float v_min = f32_from_bits(0x7F800000u);  // the smallest positive new v of the tile
  // the tile's mean of sqrt(v), in index order; block 0's update is kept for the loop below (the
  // others are computed again there: the same arithmetic, the same bits)
  float sum = 0.0f;
  float p0[kNvfp4Block], m0[kNvfp4Block], v0[kNvfp4Block];
  for (int b = 0; b < blocks; ++b) {
    float pb[kNvfp4Block], m[kNvfp4Block], v[kNvfp4Block];
    FP4SIM_UNROLL
    for (int i = 0; i < kNvfp4Block; ++i) pb[i] = p[16 * b + i];
    qadamw_block_update(t, b, mu_old, floor_old, a, grad + 16 * b, pb, m, v, s);
    FP4SIM_UNROLL
    for (int i = 0; i < kNvfp4Block; ++i) {
      sum = fadd_rn(sum, fsqrt_rn(v[i]));
      if (v[i] > 0.0f && v[i] < v_min) v_min = v[i];
      if (b == 0) {
        p0[i] = pb[i];
        m0[i] = m[i];
        v0[i] = v[i];
      }
    }
  }
  const uint16_t mu_bits = qadamw_tile_mean<Fmt>(sum, 16 * blocks);
  const float mu_new = bf16_to_f32(mu_bits);
  const Nvfp4Global gm = nvfp4_global(a.m_new, true), gv = nvfp4_global(a.v_new, false);
  float am = 0.0f, av = 0.0f;
  for (int b = 0; b < blocks; ++b) {
    float pb[kNvfp4Block], m[kNvfp4Block], v[kNvfp4Block];
    if (b == 0) {
      FP4SIM_UNROLL
      for (int i = 0; i < kNvfp4Block; ++i) {
        pb[i] = p0[i];
        m[i] = m0[i];
        v[i] = v0[i];
      }
    } else {
      FP4SIM_UNROLL
      for (int i = 0; i < kNvfp4Block; ++i) pb[i] = p[16 * b + i];
      qadamw_block_update(t, b, mu_old, floor_old, a, grad + 16 * b, pb, m, v, s);
    }
    float ym[kNvfp4Block], yv[kNvfp4Block];
    qadamw_m_transformed(m, ym);
    qadamw_v_transformed(v, mu_new, yv);
    if (!encode) {
      am = fmax_nan_ignored(am, amax_strided(ym, kNvfp4Block, 1));
      av = fmax_nan_ignored(av, amax_strided(yv, kNvfp4Block, 1));
      continue;
    }
    t.m_scales[b] = qadamw_encode_m<Fmt>(ym, gm, sr_bits_for_chunk(true, seed, stream, chunk0 + b),
                                         t.m_codes + 8 * b);
    t.v_scales[b] = qadamw_encode_v<Fmt>(yv, gv, t.v_codes + 8 * b);
    FP4SIM_UNROLL
    for (int i = 0; i < kNvfp4Block; ++i) {
      p[16 * b + i] = pb[i];
      if (p16) p16[16 * b + i] = Fmt::bf16_rne(pb[i]);
    }
  }
  if (encode) {
    *t.v_mean = mu_bits;
    if (t.v_floor) *t.v_floor = qadamw_floor_bits(v_min);
  } else {
    *amax_m = am;
    *amax_v = av;
  }
}

}  // namespace fp4sim
