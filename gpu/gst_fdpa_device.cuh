// The exact GPU GEMM's formulations of GST-FDPA (DESIGN.md §7; gpu/gemm_exact.cu): the bits of
// emu/mma.hpp's gst_fdpa_core_bits, computed the ways that kernel's variants do. Host and device:
// tests/emu/test_mma.cpp holds each equal to the readable core on the host over millions of random
// group sums, scales and C (specials included), tests/gpu/test_gemm_gpu.cpp the kernel equal to the
// emulator's GEMM.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "emu/gst_fdpa_packed.hpp"
#include "emu/hd.hpp"
#include "emu/mma.hpp"

namespace fp4sim::gpu {

// emu's gst_fdpa_core_packed_bits with the five terms summed in FP64 instead of int64, whose
// shifts the GPU spends more instructions on than its FP64 units on this: every term is an integer
// number of grid units 2^(e_max - 35) below 2^46 after truncation (trunc is exact in double: the
// unshifted term has at most 24 significant bits), so the sum (< 2^49) is exact, and RZ to FP32 of
// sum * 2^grid is one conversion. The kernel's rare path (NaN scales, non-finite C, a zero sum).
FP4SIM_HD uint32_t gst_fdpa_core_packed_fp64(const int32_t* p4, uint32_t all_zero,
                                             uint32_t all_neg_zero_groups, const uint32_t* wa,
                                             const uint32_t* wb, int man_bits, float c) {
  if (!gst_packed_path_applies(wa, wb, c))
    return gst_fdpa_core_from_packed(p4, all_zero, all_neg_zero_groups, wa, wb, man_bits, c);
  const GstPackedTerms t = gst_packed_terms(p4, all_zero, all_neg_zero_groups, wa, wb, man_bits, c);
  // each term: (-1)^neg * sig * 2^(lsb - grid), truncated; shifts below -1022 give 0 anyway
  double sum = 0.0;
  FP4SIM_UNROLL
  for (int i = 0; i <= kGstGroups; ++i) {
    const int sh = t.lsb[i] - t.grid;
    const double v = sh < -1000 ? 0.0 : trunc(static_cast<double>(t.sig[i]) * pow2_double(sh));
    sum += t.neg[i] ? -v : v;
  }
  if (sum == 0.0) return t.all_neg_zero ? 0x80000000u : 0u;
  const double value = sum * pow2_double(t.grid);  // exact: grid >= -174
  if (fabs(value) >= 0x1p128)
    return value < 0 ? 0xFF800000u : 0x7F800000u;  // overflow -> Inf under RZ
  return f32_bits(double_to_f32_rz(value));
}

// The kernel's lean core: emu's gst_fdpa_core_lean (the common case from unpacked scales; false
// for a non-finite C or an exactly zero sum, which the caller sends to gst_fdpa_core_packed_fp64;
// NaN scales filtered by the caller) in the variants the kernel's template parameters select;
// <false, false> is emu's function itself.
//
// kZeroScaleBiased: the caller passes kGstZeroScaleExp as the exponent reading of a zero scale
// (gst_zero_scale_biased), which puts the group's exponent sum far below kGstZeroExp, so it can
// neither win the maximum nor leave a term (sh < -1000): the zero-scale tests drop out of the loop.
//
// kExpAdd (the kernel's variant 6): each term, C and the final sum are scaled by 2^sh by adding
// sh to the exponent field of the double (ldexp_exact) instead of multiplying by a constructed
// 2^sh, and a term is zero exactly when its integer p4 * sig_a * sig_b is (a zero scale has sig 0),
// so the sh < -1000 test goes too. Exact because nothing leaves the normal range (F = kGstF = 35):
// a nonzero term is an integer in [1, 2^19] whose group takes part in e_max, so sh <= 35 - 2 (and
// sh >= -475 for the widest exponents, UE8M0: exp_sum >= -254, e_max <= 254); C scaled lies in
// [2^-368, 2^36); the final sum is an integer in [1, 2^49) and grid >= -254 - 35. Adding to the
// exponent field of a normal double that stays normal never carries into the sign bit, so negative
// values work alike.
constexpr int32_t kGstZeroScaleExp = -(1 << 20);
FP4SIM_HD int32_t gst_zero_scale_biased(int32_t sig, int32_t exp) {
  return sig == 0 ? kGstZeroScaleExp : exp;
}

// x * 2^e for a finite nonzero double x when the result stays normal: e added to the exponent
// field.
FP4SIM_HD double ldexp_exact(double x, int e) {
#if defined(__CUDA_ARCH__)
  // (e << 20 on a negative int is undefined in C++17: shift the unsigned bits)
  return __hiloint2double(__double2hiint(x) + static_cast<int>(static_cast<unsigned>(e) << 20),
                          __double2loint(x));
#else
  uint64_t b;
  std::memcpy(&b, &x, sizeof b);
  b += static_cast<uint64_t>(static_cast<int64_t>(e)) << 52;
  double d;
  std::memcpy(&d, &b, sizeof d);
  return d;
#endif
}

// The integer term v * 2^sh for |v| < 2^31 under kExpAdd's range condition (v == 0 gives +0).
FP4SIM_HD double scaled_term(int32_t v, int sh) {
  const double d = static_cast<double>(v);
#if defined(__CUDA_ARCH__)
  return __hiloint2double(
      v == 0 ? 0 : __double2hiint(d) + static_cast<int>(static_cast<unsigned>(sh) << 20),
      __double2loint(d));
#else
  return v == 0 ? 0.0 : ldexp_exact(d, sh);
#endif
}

template <bool kZeroScaleBiased, bool kExpAdd>
FP4SIM_HD bool gst_fdpa_core_lean_variant(const int32_t* p4, const int32_t* sig_a,
                                          const int32_t* exp_a, const int32_t* sig_b,
                                          const int32_t* exp_b, uint32_t all_zero, int man_bits,
                                          float c, uint32_t* out_bits) {
  const uint32_t cb = f32_bits(c);
  const uint32_t c_biased = (cb >> 23) & 0xFFu;
  if (c_biased == 0xFFu) return false;
  int e_max = kGstZeroExp;
  int exp_sum[kGstGroups];
  FP4SIM_UNROLL
  for (int g = 0; g < kGstGroups; ++g) {
    exp_sum[g] = exp_a[g] + exp_b[g];
    const bool zero =
        ((all_zero >> g) & 1u) != 0 || (!kZeroScaleBiased && (sig_a[g] == 0 || sig_b[g] == 0));
    const int align = zero ? kGstZeroExp : exp_sum[g];
    e_max = align > e_max ? align : e_max;
  }
  const bool c_zero = (cb & 0x7FFFFFFFu) == 0;
  if (!c_zero) {
    const int ce = c_biased == 0 ? kFp32Emin : static_cast<int>(c_biased) - 127;
    e_max = ce > e_max ? ce : e_max;
  }
  const int grid = e_max - kGstF;
  double sum;
  if constexpr (kExpAdd)
    sum = c_zero ? 0.0 : trunc(ldexp_exact(static_cast<double>(c), -grid));
  else
    sum = c_zero ? 0.0 : trunc(static_cast<double>(c) * pow2_double(-grid));
  FP4SIM_UNROLL
  for (int g = 0; g < kGstGroups; ++g) {
    const int sh = exp_sum[g] - 2 * man_bits - 2 - grid;  // the term's lsb on the grid
    if constexpr (kExpAdd) {
      sum += trunc(scaled_term(p4[g] * sig_a[g] * sig_b[g], sh));
    } else {
      const double v = static_cast<double>(p4[g] * sig_a[g] * sig_b[g]);
      sum += sh < -1000 ? 0.0 : trunc(v * pow2_double(sh));
    }
  }
  if (sum == 0.0) return false;
  const double value = kExpAdd ? ldexp_exact(sum, grid) : sum * pow2_double(grid);
  if (fabs(value) >= 0x1p128) {
    *out_bits = value < 0 ? 0xFF800000u : 0x7F800000u;
    return true;
  }
  *out_bits = f32_bits(double_to_f32_rz(value));
  return true;
}

}  // namespace fp4sim::gpu
