// 16-point random Hadamard transform (DESIGN.md §6), host and device.
//
// H = diag(s) * H16 / 4 with H16 the Sylvester Hadamard matrix and s the fixed sign vector (mask
// 0xD7E8: bit i set where s_i = -1). Each output is what the Blackwell tensor core computes:
//   y_j = bf16_rne( T-FDPA(x[0..15], H[:, j], c = +0; L = 16, F = 25, RZ-FP32) ).
// rht16_reference evaluates exactly that (16 T-FDPAs); rht16 computes the same bits with one
// integer fast Walsh-Hadamard transform, because every product x_i * H_ij has the same magnitude
// |x_i|/4 for all j, so its truncation onto the grid does not depend on j. Tests hold the two
// equal. rht16_abs_max is the amax §6 takes over a chunk's outputs. The conversions the transform
// calls come as a template parameter (ReferenceFormats; the GPU's kernels pass gpu::DeviceFormats),
// and the GPU's amax pass has its own formulation of rht16_abs_max (gpu/rht_device.cuh).
#pragma once

#include <cstdint>

#include "emu/formats.hpp"
#include "emu/hd.hpp"
#include "emu/mma.hpp"

namespace fp4sim {

constexpr int kRhtSize = 16;
constexpr uint32_t kRhtSignMask = 0xD7E8u;

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

// The NaN-ignoring max |x_i| of a chunk, in order (the transform's own path takes it from the
// largest magnitude's bits where every input is finite).
FP4SIM_HD float rht16_input_amax(const uint16_t* x) {
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

// E(x) of the chunk's largest magnitude (its BF16 bits amax_bits, bf16x16_max_magnitude_bits):
// max(floor(log2|x|), -126), subnormals included.
FP4SIM_HD int rht16_emax(uint32_t amax_bits) {
  return static_cast<int>(amax_bits >> 7 > 1u ? amax_bits >> 7 : 1u) - 127;
}

// The terms for emax >= -102 as one FP32 product each: a power-of-two scaling, exact whenever the
// result is normal; results below 1 (subnormal ones included) truncate to 0 either way. 2^(25 -
// emax) is a normal FP32 for emax >= -102. Truncation toward zero keeps the sign: u_i = sign *
// floor(|.|). The sign s_i rides on the factor (-2^(25 - emax) where s_i = -1), an exact negation.
// (The GPU's amax pass runs it for every chunk: where it does not apply the device's conversion
// saturates, and its result is discarded; gpu/rht_device.cuh.)
FP4SIM_HD void rht16_fmul_terms(const uint16_t* x, int emax, int32_t (&u)[kRhtSize]) {
  const float pow2 = f32_from_bits(static_cast<uint32_t>(25 - emax + 127) << 23);
  const float npow2 = -pow2;
  FP4SIM_UNROLL
  for (int i = 0; i < kRhtSize; ++i)
    u[i] = f32_to_int_rz(fmul_rn(bf16_to_f32(x[i]), ((kRhtSignMask >> i) & 1u) ? npow2 : pow2));
}

// The terms of a finite, nonzero chunk (amax_bits = bf16x16_max_magnitude_bits(x), below 0x7F80,
// not 0): term i on the grid 2^(emax - 2 - 25), |x_i|/4 truncated there, i.e. floor(|x_i| * 2^(25
// - emax)) (< 2^26), with the sign of x_i * s_i. Returns emax.
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

// Same bits as rht16_reference (see the header comment), the 16 outputs packed two a word (element
// 2k in word k's low half). in_amax (optional): the NaN-ignoring max |x_i|, from the same bits.
template <class Fmt = ReferenceFormats>
FP4SIM_HD void rht16_packed(const uint16_t* x, uint32_t* w, float* in_amax = nullptr) {
  const uint32_t amax_bits = Fmt::bf16x16_max_magnitude_bits(x);
  if (amax_bits >= 0x7F80u) {  // Inf or NaN: rare, take the literal path's outcome
    if (in_amax) *in_amax = rht16_input_amax(x);
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

// The amax DESIGN.md §6 takes over a chunk's transform: the NaN-ignoring max |y_j| of rht16's BF16
// outputs, j = 0..15 (0 when every output is NaN). in_amax (optional): the NaN-ignoring max |x_i|.
// The GPU's amax pass computes the same bits with one rounding a chunk
// (gpu::rht16_abs_max_rounded_once).
FP4SIM_HD float rht16_abs_max(const uint16_t* x, float* in_amax = nullptr) {
  if (in_amax) *in_amax = rht16_input_amax(x);
  uint16_t y[kRhtSize];
  rht16(x, y);
  float m = 0.0f;
  for (int j = 0; j < kRhtSize; ++j) m = fmax_nan_ignored(m, f32_abs(bf16_to_f32(y[j])));
  return m;
}

}  // namespace fp4sim
