// GST-FDPA (DESIGN.md §7) for the exact GEMMs' inner loops: the bits of emu/mma.hpp's
// gst_fdpa_core_bits, computed from what a GEMM precomputes once per operand (the chunk's group
// sums as integers, its scales decoded and packed one a word, or unpacked into significand and
// exponent) instead of from GroupSum and DecodedScale arrays. The emulator's GEMM (emu/gemm.cpp)
// runs gst_fdpa_core_lean for the common case and gst_fdpa_core_packed_bits for the rest; the GPU's
// exact GEMM shares the packing and the packed terms (gpu/gst_fdpa_device.cuh has its own sums).
// tests/emu/test_mma.cpp holds every core here equal to gst_fdpa_core_bits on millions of random
// group sums, scales and C, specials included.
#pragma once

#include <cmath>
#include <cstdint>

#include "emu/hd.hpp"
#include "emu/mma.hpp"

namespace fp4sim {

// A decoded scale packed in one word for the GEMM kernels: sig in bits 0-7, exp + 512 in bits 8-17,
// zero in bit 30, NaN in bit 31 (man_bits is the scale kind's: 3 for UE4M3, 0 for UE8M0).
FP4SIM_HD uint32_t pack_scale(const DecodedScale& d) {
  return d.sig | (static_cast<uint32_t>(d.exp + 512) << 8) | (d.zero ? 1u << 30 : 0u) |
         (d.nan ? 1u << 31 : 0u);
}
FP4SIM_HD DecodedScale unpack_scale(uint32_t w, int man_bits) {
  DecodedScale d;
  d.sig = w & 0xFFu;
  d.exp = static_cast<int>((w >> 8) & 0x3FFu) - 512;
  d.man_bits = man_bits;
  d.zero = ((w >> 30) & 1u) != 0;
  d.nan = (w >> 31) != 0;
  return d;
}

// The packed cores' inputs: p4[g] the group sums, bit g of all_zero / all_neg_zero_groups the
// group flags (all 16 products zero / all -0), wa/wb the groups' packed scales, man_bits the scale
// kind's fraction bits, C the FP32 addend.

// gst_fdpa_core_bits itself on those inputs: the path for NaN scales and a non-finite C.
FP4SIM_HD uint32_t gst_fdpa_core_from_packed(const int32_t* p4, uint32_t all_zero,
                                             uint32_t all_neg_zero_groups, const uint32_t* wa,
                                             const uint32_t* wb, int man_bits, float c) {
  GroupSum gs[kGstGroups];
  DecodedScale sa[kGstGroups], sb[kGstGroups];
  for (int g = 0; g < kGstGroups; ++g) {
    gs[g].p4 = p4[g];
    gs[g].all_zero = ((all_zero >> g) & 1u) != 0;
    gs[g].all_neg_zero = ((all_neg_zero_groups >> g) & 1u) != 0;
    sa[g] = unpack_scale(wa[g], man_bits);
    sb[g] = unpack_scale(wb[g], man_bits);
  }
  return gst_fdpa_core_bits(gs, sa, sb, c, nullptr);
}

// The five terms T_0..T_3 and C before truncation: (-1)^neg[i] * sig[i] * 2^lsb[i], to be cut on
// the grid 2^grid = 2^(e_max - 35); all_neg_zero: every term is -0 (the zero-sum sign rule). Each
// fits an int64 on the grid: a group's |P4| * sig_a * sig_b < 2^19 shifted left by at most 27
// (UE4M3; UE8M0: 2^12 by at most 33), C's 24-bit significand by at most 12.
struct GstPackedTerms {
  uint64_t sig[kGstGroups + 1];
  int lsb[kGstGroups + 1];
  bool neg[kGstGroups + 1];
  int grid;
  bool all_neg_zero;
};
// Whether the packed path applies: no NaN scale, a finite C (else gst_fdpa_core_from_packed).
FP4SIM_HD bool gst_packed_path_applies(const uint32_t* wa, const uint32_t* wb, float c) {
  uint32_t any = 0;
  FP4SIM_UNROLL
  for (int g = 0; g < kGstGroups; ++g) any |= wa[g] | wb[g];
  return ((f32_bits(c) >> 23) & 0xFFu) != 0xFFu && (any >> 31) == 0;
}
// The terms, where gst_packed_path_applies.
FP4SIM_HD GstPackedTerms gst_packed_terms(const int32_t* p4, uint32_t all_zero,
                                          uint32_t all_neg_zero_groups, const uint32_t* wa,
                                          const uint32_t* wb, int man_bits, float c) {
  GstPackedTerms t;
  const uint32_t cb = f32_bits(c);
  const uint32_t c_biased = (cb >> 23) & 0xFFu;
  int e_max = kGstZeroExp;
  bool all_neg_zero = true;
  FP4SIM_UNROLL
  for (int g = 0; g < kGstGroups; ++g) {
    const bool zero_scale = (((wa[g] | wb[g]) >> 30) & 1u) != 0;
    const int exp_sum = static_cast<int>(((wa[g] >> 8) & 0x3FFu) + ((wb[g] >> 8) & 0x3FFu)) - 1024;
    t.neg[g] = p4[g] < 0 || (p4[g] == 0 && ((all_neg_zero_groups >> g) & 1u));
    const uint32_t mag = static_cast<uint32_t>(p4[g] < 0 ? -p4[g] : p4[g]);
    t.sig[g] = zero_scale ? 0u : static_cast<uint64_t>(mag * ((wa[g] & 0xFFu) * (wb[g] & 0xFFu)));
    t.lsb[g] = exp_sum - 2 * man_bits - 2;
    const int align = (((all_zero >> g) & 1u) || zero_scale) ? kGstZeroExp : exp_sum;
    all_neg_zero = all_neg_zero && t.sig[g] == 0 && t.neg[g];
    e_max = align > e_max ? align : e_max;
  }
  t.neg[kGstGroups] = (cb >> 31) != 0;
  if ((cb & 0x7FFFFFFFu) == 0) {
    t.sig[kGstGroups] = 0;
    t.lsb[kGstGroups] = 0;
    all_neg_zero = all_neg_zero && t.neg[kGstGroups];
  } else {
    const int ce = c_biased == 0 ? kFp32Emin : static_cast<int>(c_biased) - 127;
    t.sig[kGstGroups] = c_biased == 0 ? (cb & 0x7FFFFFu) : ((cb & 0x7FFFFFu) | 0x800000u);
    t.lsb[kGstGroups] = ce - kFp32ManBits;
    all_neg_zero = false;
    e_max = ce > e_max ? ce : e_max;
  }
  t.grid = e_max - kGstF;
  t.all_neg_zero = all_neg_zero;
  return t;
}

// gst_fdpa_core_bits from packed inputs, every case: the terms truncated onto the grid and summed
// in int64, then RZ to FP32 (NaN scales and a non-finite C: the readable core).
FP4SIM_HD uint32_t gst_fdpa_core_packed_bits(const int32_t* p4, uint32_t all_zero,
                                             uint32_t all_neg_zero_groups, const uint32_t* wa,
                                             const uint32_t* wb, int man_bits, float c) {
  if (!gst_packed_path_applies(wa, wb, c))
    return gst_fdpa_core_from_packed(p4, all_zero, all_neg_zero_groups, wa, wb, man_bits, c);
  const GstPackedTerms t = gst_packed_terms(p4, all_zero, all_neg_zero_groups, wa, wb, man_bits, c);
  int64_t sum = 0;
  FP4SIM_UNROLL
  for (int i = 0; i <= kGstGroups; ++i) {
    const int sh = t.lsb[i] - t.grid;
    const uint64_t v = sh >= 0 ? (t.sig[i] << sh) : (-sh >= 64 ? 0u : (t.sig[i] >> (-sh)));
    sum += t.neg[i] ? -static_cast<int64_t>(v) : static_cast<int64_t>(v);
  }
  if (sum == 0) return t.all_neg_zero ? 0x80000000u : 0u;
  const bool sum_neg = sum < 0;
  return round_rz_to_f32_bits(sum_neg ? static_cast<uint64_t>(-sum) : static_cast<uint64_t>(sum),
                              t.grid, sum_neg, kFp32ManBits);
}

// The common case from unpacked scales (significand, 0 for a zero scale, and exponent reading per
// group and operand), the group sums signed, the all-zero groups as bits: fewer operations per
// output and chunk than the packed core. It returns false for the rest, which the caller sends to
// gst_fdpa_core_packed_bits: a non-finite C, or an exactly zero sum (whose sign needs the
// per-product signs); NaN scales must be filtered by the caller. The five terms are summed in FP64:
// every term is an integer number of grid units 2^(e_max - 35) below 2^46 after truncation (trunc
// is exact in double: the unshifted term has at most 24 significant bits), so the sum (< 2^49) is
// exact, and RZ to FP32 of sum * 2^grid is one conversion.
FP4SIM_HD bool gst_fdpa_core_lean(const int32_t* p4, const int32_t* sig_a, const int32_t* exp_a,
                                  const int32_t* sig_b, const int32_t* exp_b, uint32_t all_zero,
                                  int man_bits, float c, uint32_t* out_bits) {
  const uint32_t cb = f32_bits(c);
  const uint32_t c_biased = (cb >> 23) & 0xFFu;
  if (c_biased == 0xFFu) return false;
  int e_max = kGstZeroExp;
  int exp_sum[kGstGroups];
  FP4SIM_UNROLL
  for (int g = 0; g < kGstGroups; ++g) {
    exp_sum[g] = exp_a[g] + exp_b[g];
    const bool zero = ((all_zero >> g) & 1u) != 0 || sig_a[g] == 0 || sig_b[g] == 0;
    const int align = zero ? kGstZeroExp : exp_sum[g];
    e_max = align > e_max ? align : e_max;
  }
  const bool c_zero = (cb & 0x7FFFFFFFu) == 0;
  if (!c_zero) {
    const int ce = c_biased == 0 ? kFp32Emin : static_cast<int>(c_biased) - 127;
    e_max = ce > e_max ? ce : e_max;
  }
  const int grid = e_max - kGstF;
  // each term: p4 * sig_a * sig_b * 2^sh, truncated; shifts below -1000 give 0 anyway
  double sum = c_zero ? 0.0 : trunc(static_cast<double>(c) * pow2_double(-grid));
  FP4SIM_UNROLL
  for (int g = 0; g < kGstGroups; ++g) {
    const int sh = exp_sum[g] - 2 * man_bits - 2 - grid;  // the term's lsb on the grid
    const double v = static_cast<double>(p4[g] * sig_a[g] * sig_b[g]);
    sum += sh < -1000 ? 0.0 : trunc(v * pow2_double(sh));
  }
  if (sum == 0.0) return false;
  const double value = sum * pow2_double(grid);  // exact: grid >= -174
  if (fabs(value) >= 0x1p128) {
    *out_bits = value < 0 ? 0xFF800000u : 0x7F800000u;  // overflow -> Inf under RZ
    return true;
  }
  *out_bits = f32_bits(double_to_f32_rz(value));
  return true;
}

}  // namespace fp4sim
