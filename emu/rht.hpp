// 16-point random Hadamard transform (DESIGN.md §6), host and device.
//
// H = diag(s) * H16 / 4 with H16 the Sylvester Hadamard matrix and s the fixed sign vector (mask
// 0xD7E8: bit i set where s_i = -1). Each output is what the Blackwell tensor core computes:
//   y_j = bf16_rne( T-FDPA(x[0..15], H[:, j], c = +0; L = 16, F = 25, RZ-FP32) ).
// rht16_reference evaluates exactly that (16 T-FDPAs); rht16 computes the same bits with one
// integer fast Walsh-Hadamard transform, because every product x_i * H_ij has the same magnitude
// |x_i|/4 for all j, so its truncation onto the grid does not depend on j. Tests hold the two
// equal. The conversions the transform calls come as a template parameter (ReferenceFormats; the
// GPU's kernels pass gpu::DeviceFormats).
#pragma once

#include <cstdint>

#include "emu/formats.hpp"
#include "emu/hd.hpp"
#include "emu/mma.hpp"

namespace fp4sim {

constexpr int kRhtSize = 16;
constexpr uint32_t kRhtSignMask = 0xD7E8u;

FP4SIM_HD int popcount32(uint32_t v) {
#if defined(__CUDA_ARCH__)
  return __popc(v);
#else
  return __builtin_popcount(v);
#endif
}

// Bit i set where H16[i][j] = -1, i.e. popcount(i & j) is odd.
FP4SIM_HD constexpr uint32_t hadamard_odd_mask(int j) {
  uint32_t m = 0;
  for (int i = 0; i < kRhtSize; ++i)
    m |= static_cast<uint32_t>(__builtin_popcount(static_cast<unsigned>(i & j)) & 1) << i;
  return m;
}

// H[i][j] as a float: ±0.25
FP4SIM_HD float rht_entry(int i, int j) {
  const int neg = ((kRhtSignMask >> i) & 1) ^ (popcount32(static_cast<uint32_t>(i & j)) & 1);
  return neg ? -0.25f : 0.25f;
}

// x: 16 BF16 bit patterns; y: 16 BF16 bit patterns. Literal evaluation of the contract.
FP4SIM_HD void rht16_reference(const uint16_t* x, uint16_t* y) {
  float xf[kRhtSize], h[kRhtSize];
  for (int i = 0; i < kRhtSize; ++i) xf[i] = bf16_to_f32(x[i]);
  for (int j = 0; j < kRhtSize; ++j) {
    for (int i = 0; i < kRhtSize; ++i) h[i] = rht_entry(i, j);
    y[j] = bf16_rne(tfdpa_bf16(xf, h, 0.0f));
  }
}

// Rounds Y * 2^grid (RZ to FP32, then RNE to BF16) for any grid, subnormal and overflowing results
// included. Out of line: it only runs for inputs near the extremes of the BF16 range. It takes one
// value, not the array: an array whose address reaches a call lives in local memory on the GPU,
// and rht16's u[] would then be stored and reloaded on every call, not only the rare ones.
template <class Fmt = ReferenceFormats>
FP4SIM_HD_NOINLINE uint16_t rht16_round_general(int32_t v, int grid) {
  const bool neg = v < 0;
  const uint64_t mag =
      neg ? static_cast<uint64_t>(-static_cast<int64_t>(v)) : static_cast<uint64_t>(v);
  return Fmt::bf16_rne(
      f32_from_bits(mag == 0 ? 0u : round_rz_to_f32_bits(mag, grid, neg, kFp32ManBits)));
}

// One stage of the in-place Walsh-Hadamard transform: (u_k, u_k+span) <- (u_k + u_k+span,
// u_k - u_k+span) for every k whose `span` bit is clear. No overflow: |u_i| < 2^26, so |Y| < 2^30.
template <int kSpan>
FP4SIM_HD void rht_butterflies(int32_t (&u)[kRhtSize]) {
  FP4SIM_UNROLL
  for (int k = 0; k < kRhtSize; ++k) {
    if ((k & kSpan) == 0) {
      const int32_t p = u[k], q = u[k + kSpan];
      u[k] = p + q;
      u[k + kSpan] = p - q;
    }
  }
}

// The largest input magnitude's BF16 bits (magnitudes order as their bit patterns; NaN above Inf).
// On the GPU, as a NaN-propagating FP32 max tree of |x_i| (max.NaN: a NaN anywhere gives the
// canonical NaN 0x7FFFFFFF, whose top half, 0x7FFF, is above Inf's as the integer max of a NaN's
// bits is; otherwise the max magnitude exactly): 15 FMNMX on the FP32 values the terms use anyway,
// instead of 16 masks and 6 three-way integer maxima on the ALU pipe the quantize kernels are
// bound on. Where the result is >= 0x7F80 the callers only test that (the emax they also derive
// from it is then not used).
FP4SIM_HD uint32_t rht16_input_max_bits(const uint16_t* x) {
#if defined(__CUDA_ARCH__)
  auto max_nan = [](float a, float b) {
    float d;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
  };
  float m[kRhtSize / 2];
  FP4SIM_UNROLL
  for (int i = 0; i < kRhtSize / 2; ++i)
    m[i] = max_nan(fabsf(bf16_to_f32(x[2 * i])), fabsf(bf16_to_f32(x[2 * i + 1])));
  FP4SIM_UNROLL
  for (int w = kRhtSize / 4; w >= 1; w /= 2) {
    FP4SIM_UNROLL
    for (int i = 0; i < w; ++i) m[i] = max_nan(m[i], m[i + w]);
  }
  return f32_bits(m[0]) >> 16;
#else
  uint32_t amax_bits = 0;
  for (int i = 0; i < kRhtSize; ++i) {
    const uint32_t a = x[i] & 0x7FFFu;
    amax_bits = a > amax_bits ? a : amax_bits;
  }
  return amax_bits;
#endif
}

// The NaN-ignoring max |x_i| of a chunk with an Inf or NaN input (the rare path).
FP4SIM_HD float rht16_input_amax_special(const uint16_t* x) {
  float m = 0.0f;
  for (int i = 0; i < kRhtSize; ++i) m = fmax_nan_ignored(m, f32_abs(bf16_to_f32(x[i])));
  return m;
}

// Outputs of a chunk with an Inf or NaN input, packed two a word (element 2k in word k's low half):
// the literal path's outcome, any NaN -> every output NaN; otherwise each output is the Inf of its
// products' sign, or NaN when +Inf and -Inf meet (H has no zeros: no Inf * 0). Written with bit
// masks and unrolled loops so that nothing is indexed at run time.
FP4SIM_HD void rht16_special_packed(const uint16_t* x, uint32_t* w) {
  bool any_nan = false;
  uint32_t inf_mask = 0, neg_mask = 0;  // bit i: x_i is ±Inf; sign(x_i) xor s_i
  FP4SIM_UNROLL
  for (int i = 0; i < kRhtSize; ++i) {
    const uint32_t a = x[i] & 0x7FFFu;
    any_nan = any_nan || a > 0x7F80u;
    if (a == 0x7F80u) inf_mask |= 1u << i;
    neg_mask |= ((static_cast<uint32_t>(x[i] >> 15) ^ (kRhtSignMask >> i)) & 1u) << i;
  }
  FP4SIM_UNROLL
  for (int j = 0; j < kRhtSize; ++j) {
    const uint32_t neg_j = neg_mask ^ hadamard_odd_mask(j);  // product sign for each i
    const bool pos = (inf_mask & ~neg_j) != 0, neg = (inf_mask & neg_j) != 0;
    const uint32_t y = (any_nan || (pos && neg)) ? kBF16NaN : (pos ? 0x7F80u : 0xFF80u);
    if (j % 2 == 0)
      w[j / 2] = y;
    else
      w[j / 2] |= y << 16;
  }
}

// E(x) of the chunk's largest magnitude (its BF16 bits amax_bits): max(floor(log2|x|), -126),
// subnormals included.
FP4SIM_HD int rht16_emax(uint32_t amax_bits) {
  return static_cast<int>(amax_bits >> 7 > 1u ? amax_bits >> 7 : 1u) - 127;
}

// The terms for emax >= -102 as one FP32 product each: a power-of-two scaling, exact whenever the
// result is normal; results below 1 (subnormal ones included) truncate to 0 either way. 2^(25 -
// emax) is a normal FP32 for emax >= -102. Truncation toward zero keeps the sign: u_i = sign *
// floor(|.|). The sign s_i rides on the factor (-2^(25 - emax) where s_i = -1), an exact negation.
// (rht16_abs_max_common runs it for every chunk on the GPU: where it does not apply the conversion
// saturates, and its result is discarded.)
FP4SIM_HD void rht16_fmul_terms(const uint16_t* x, int emax, int32_t (&u)[kRhtSize]) {
  const float pow2 = f32_from_bits(static_cast<uint32_t>(25 - emax + 127) << 23);
  const float npow2 = -pow2;
  FP4SIM_UNROLL
  for (int i = 0; i < kRhtSize; ++i) {
    const float term = fmul_rn(bf16_to_f32(x[i]), ((kRhtSignMask >> i) & 1u) ? npow2 : pow2);
#if defined(__CUDA_ARCH__)
    u[i] = __float2int_rz(term);
#else
    u[i] = static_cast<int32_t>(term);
#endif
  }
}

// The terms of a finite, nonzero chunk (amax_bits = rht16_input_max_bits(x), below 0x7F80, not 0):
// term i on the grid 2^(emax - 2 - 25), |x_i|/4 truncated there, i.e. floor(|x_i| * 2^(25 - emax))
// (< 2^26), with the sign of x_i * s_i. Returns emax.
FP4SIM_HD int rht16_terms(const uint16_t* x, uint32_t amax_bits, int32_t (&u)[kRhtSize]) {
  const int emax = rht16_emax(amax_bits);
  if (emax >= -102) {
    rht16_fmul_terms(x, emax, u);
  } else {
    // every input below 2^-101 (2^(25 - emax) would overflow FP32): the same terms on integers,
    // |x_i|/4 = sig_i * 2^(E_i - 9), i.e. sig_i << 18 >> d_i with d_i = emax - E_i >= 0
    FP4SIM_UNROLL
    for (int i = 0; i < kRhtSize; ++i) {
      const uint32_t a = x[i] & 0x7FFFu;
      const uint32_t biased = a >> 7;
      const uint32_t sig = biased == 0 ? a : ((a & 0x7Fu) | 0x80u);
      const int e = biased == 0 ? -126 : static_cast<int>(biased) - 127;
      const int d = emax - e;
      const uint32_t t = d > 31 ? 0u : ((sig << 18) >> d);
      const uint32_t neg = (x[i] >> 15) ^ ((kRhtSignMask >> i) & 1u);
      u[i] = neg ? -static_cast<int32_t>(t) : static_cast<int32_t>(t);
    }
  }
  return emax;
}

// value = Y * 2^grid, RZ to FP32, then RNE to BF16. |Y| < 2^31, so RZ(Y) * 2^grid is exact and
// equals the RZ of the product whenever the result stays normal: grid in [-126, 97] (and Y = 0
// gives +0, as the contract's zero-sum rule does with C = +0). Outside that range (inputs within a
// few binades of the BF16 extremes) the chunk takes the general rounding. Both are monotone in
// |Y| and odd in Y.
FP4SIM_HD bool rht16_grid_fast(int grid) { return grid >= -126 && grid <= 97; }
FP4SIM_HD float rht16_grid_scale(int grid) {
  return f32_from_bits(static_cast<uint32_t>(grid + 127) << 23);
}
// One output Y_j on a fast grid (rht16_grid_fast(grid)).
template <class Fmt = ReferenceFormats>
FP4SIM_HD uint16_t rht16_round_fast(int32_t y, int grid) {
  return Fmt::bf16_rne(fmul_rn(int_to_f32_rz(y), rht16_grid_scale(grid)));
}

// Same bits as rht16_reference (see the header comment), the 16 outputs packed two a word (element
// 2k in word k's low half). in_amax (optional): the NaN-ignoring max |x_i|, from the same bits.
template <class Fmt = ReferenceFormats>
FP4SIM_HD void rht16_packed(const uint16_t* x, uint32_t* w, float* in_amax = nullptr) {
  const uint32_t amax_bits = rht16_input_max_bits(x);
  if (amax_bits >= 0x7F80u) {  // Inf or NaN: rare, take the literal path's outcome
    if (in_amax) *in_amax = rht16_input_amax_special(x);
    rht16_special_packed(x, w);
    return;
  }
  if (in_amax) *in_amax = bf16_to_f32(static_cast<uint16_t>(amax_bits));
  if (amax_bits == 0) {  // all products zero; C = +0 is not -0, so every output is +0
    FP4SIM_UNROLL
    for (int k = 0; k < kRhtSize / 2; ++k) w[k] = 0;
    return;
  }
  int32_t u[kRhtSize];
  const int emax = rht16_terms(x, amax_bits, u);
  // in-place Walsh-Hadamard butterflies: Y_j = sum_i u_i (-1)^popcount(i & j); |Y| < 2^31
  // (one stage per call with a constant span: nested loops whose bounds depend on the outer ones
  // were not fully unrolled by nvcc, which then indexed u[] at run time through select chains)
  rht_butterflies<1>(u);
  rht_butterflies<2>(u);
  rht_butterflies<4>(u);
  rht_butterflies<8>(u);
  const int grid = emax - 2 - kBf16FdpaF;
  if (rht16_grid_fast(grid)) {
    const float pow2 = rht16_grid_scale(grid);
    FP4SIM_UNROLL
    for (int k = 0; k < kRhtSize / 2; ++k)
      w[k] = Fmt::bf16x2_rne(fmul_rn(int_to_f32_rz(u[2 * k]), pow2),
                             fmul_rn(int_to_f32_rz(u[2 * k + 1]), pow2));
  } else {
    FP4SIM_UNROLL
    for (int k = 0; k < kRhtSize / 2; ++k)
      w[k] = static_cast<uint32_t>(rht16_round_general<Fmt>(u[2 * k], grid)) |
             static_cast<uint32_t>(rht16_round_general<Fmt>(u[2 * k + 1], grid)) << 16;
  }
}

// Same bits as rht16_reference, one output a BF16 element.
template <class Fmt = ReferenceFormats>
FP4SIM_HD void rht16(const uint16_t* x, uint16_t* y) {
  uint32_t w[kRhtSize / 2];
  rht16_packed<Fmt>(x, w);
  FP4SIM_UNROLL
  for (int k = 0; k < kRhtSize / 2; ++k) {
    y[2 * k] = static_cast<uint16_t>(w[k]);
    y[2 * k + 1] = static_cast<uint16_t>(w[k] >> 16);
  }
}

// max_j |Y_j| (< 2^31) of a chunk's terms, without the last butterfly stage: its pairs (p + q,
// p - q) have max(|p + q|, |p - q|) = |p| + |q|. Since the outputs' rounding is monotone in |Y|
// and odd, the chunk's max |y_j| is the rounding of this.
FP4SIM_HD int32_t rht16_abs_max_of_terms(int32_t (&u)[kRhtSize]) {
  rht_butterflies<1>(u);
  rht_butterflies<2>(u);
  rht_butterflies<4>(u);
  int32_t ymax = 0;
  FP4SIM_UNROLL
  for (int k = 0; k < kRhtSize / 2; ++k) {
    const int32_t p = u[k] < 0 ? -u[k] : u[k], q = u[k + 8] < 0 ? -u[k + 8] : u[k + 8];
    ymax = p + q > ymax ? p + q : ymax;
  }
  return ymax;
}

// max |y_j| of a chunk on the common path (every input finite, emax in [-99, 124]: the FMUL terms
// and the fast grid). Straight-line code: on the GPU it runs for every chunk, its result kept only
// where the path applies, so a caller's chunks can interleave (elsewhere the sums may wrap; that
// result is discarded).
template <class Fmt = ReferenceFormats>
FP4SIM_HD float rht16_abs_max_common(const uint16_t* x, int emax) {
  int32_t u[kRhtSize];
  rht16_fmul_terms(x, emax, u);
  return bf16_to_f32(rht16_round_fast<Fmt>(rht16_abs_max_of_terms(u), emax - 2 - kBf16FdpaF));
}

// rht16_abs_max off the common path (an Inf or NaN input, all zeros, or inputs near the ends of
// the BF16 range): out of line, it is rare. The chunk comes by value (an array whose address
// reaches a call lives in local memory on the GPU, stored there for every chunk).
struct Bf16Chunk {
  uint16_t v[kRhtSize];
};
template <class Fmt = ReferenceFormats>
FP4SIM_HD_NOINLINE float rht16_abs_max_rare(Bf16Chunk chunk, uint32_t amax_bits) {
  const uint16_t* x = chunk.v;
  if (amax_bits >= 0x7F80u) {
    uint32_t w[kRhtSize / 2];
    rht16_special_packed(x, w);
    float m = 0.0f;
    for (int j = 0; j < kRhtSize; ++j)
      m = fmax_nan_ignored(m,
                           f32_abs(bf16_to_f32(static_cast<uint16_t>(w[j / 2] >> (16 * (j % 2))))));
    return m;
  }
  if (amax_bits == 0) return 0.0f;
  int32_t u[kRhtSize];
  const int emax = rht16_terms(x, amax_bits, u);
  const int32_t ymax = rht16_abs_max_of_terms(u);
  const int grid = emax - 2 - kBf16FdpaF;
  return bf16_to_f32(rht16_grid_fast(grid) ? rht16_round_fast<Fmt>(ymax, grid)
                                           : rht16_round_general<Fmt>(ymax, grid));
}

// The NaN-ignoring max |y_j| of rht16's outputs (0 when every output is NaN), without rounding
// each output (rht16_abs_max_common). in_amax (optional): the NaN-ignoring max |x_i|.
template <class Fmt = ReferenceFormats>
FP4SIM_HD float rht16_abs_max(const uint16_t* x, float* in_amax = nullptr) {
  const uint32_t amax_bits = rht16_input_max_bits(x);
  if (in_amax)
    *in_amax = amax_bits >= 0x7F80u ? rht16_input_amax_special(x)
                                    : bf16_to_f32(static_cast<uint16_t>(amax_bits));
  const int emax = rht16_emax(amax_bits);
  // the common path: finite inputs, the FMUL terms (emax >= -102) and the fast grid (emax - 27 in
  // [-126, 97])
  const bool common = amax_bits < 0x7F80u && emax >= -99 && emax <= 124;
#if defined(__CUDA_ARCH__)
  // (the GPU computes the common path for every chunk, before the branch: straight-line code that
  // a caller's chunks can interleave)
  const float y = rht16_abs_max_common<Fmt>(x, common ? emax : 0);
  if (common) return y;
#else
  if (common) return rht16_abs_max_common<Fmt>(x, emax);
#endif
  Bf16Chunk c;
  FP4SIM_UNROLL
  for (int i = 0; i < kRhtSize; ++i) c.v[i] = x[i];
  return rht16_abs_max_rare<Fmt>(c, amax_bits);
}

}  // namespace fp4sim
