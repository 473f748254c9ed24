// The tensor-core arithmetic model (DESIGN.md §7): truncated fused dot-product-add, per output.
//
// T-FDPA(L, F, rho) over L products and an addend C: products exact and not renormalised, each read
// at exponent E(a)+E(b); every term truncated toward zero onto the grid 2^(e_max - F); exact
// integer sum; one final rounding rho (RZ to FP32, or RZ to 13 fraction bits on Hopper FP8). Host
// and device share this code. The sums are exact in int64: with F <= 35 no term reaches 2^47.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "emu/formats.hpp"
#include "emu/hd.hpp"

namespace fp4sim {

constexpr int kTfdpaZeroExp = -133;  // exponent a zero product or a zero C reads (T-FDPA)
constexpr int kFp32Emin = -126;      // C's exponent floor
constexpr int kFp32ManBits = 23;     // RZ-FP32 output
constexpr int kE8M13ManBits = 13;    // Hopper FP8 wgmma output (E8M13)
constexpr uint32_t kCanonicalNaN = 0x7FFFFFFFu;

// One exact term of a fused dot product: value = (-1)^neg * sig * 2^lsb_exp, aligned at align_exp.
struct FdpaTerm {
  uint64_t sig;
  int lsb_exp;
  int align_exp;
  bool neg;
};

// RZ of (-1)^neg * mag * 2^lsb_exp to a binary float with `man_bits` fraction bits and FP32's
// exponent range (subnormals kept at quantum 2^(-126 - man_bits)); overflow -> ±Inf even under RZ.
// Returned as FP32 bits (for man_bits < 23 the result is an FP32 value on the narrower grid).
FP4SIM_HD uint32_t round_rz_to_f32_bits(uint64_t mag, int lsb_exp, bool neg, int man_bits) {
  const uint32_t sign = neg ? 0x80000000u : 0u;
  if (mag == 0) return sign;
  const int msb = 63 - clz64(mag);
  int exp = msb + lsb_exp;  // floor(log2 |value|)
  if (exp > 127) return sign | 0x7F800000u;
  // quantum of the output at this exponent
  const int quantum_exp = (exp < kFp32Emin ? kFp32Emin : exp) - man_bits;
  const int drop = quantum_exp - lsb_exp;  // bits to truncate
  uint64_t q;
  if (drop >= 64) {
    q = 0;
  } else if (drop > 0) {
    q = mag >> drop;
  } else {
    q = mag << (-drop);  // fits: the value has at most man_bits+1 significant bits here
  }
  if (q == 0) return sign;  // underflow keeps the sign
  // value = q * 2^quantum_exp; q < 2^(man_bits+1); place it into FP32 bits (q aligned to 23 bits).
  const uint64_t q23 = q << (kFp32ManBits - man_bits);
  const int qmsb = 63 - clz64(q23);
  if (qmsb < kFp32ManBits) {
    // subnormal output: quantum_exp == -126 - man_bits, FP32 value q23 * 2^-149
    return sign | static_cast<uint32_t>(q23);
  }
  const int biased = exp + 127;
  return sign | (static_cast<uint32_t>(biased) << 23) | (static_cast<uint32_t>(q23) & 0x7FFFFFu);
}

// Exponent reading and integer significand of a finite FP32 value x that is representable in a
// format with `man_bits` fraction bits and minimum normal exponent `emin`:
// |x| = sig * 2^(E - man_bits), E = max(floor(log2|x|), emin).
struct ExactOperand {
  uint32_t sig;
  int exp;  // E(x)
  bool neg;
  bool zero;
};
FP4SIM_HD ExactOperand exact_operand(float x, int man_bits, int emin) {
  const uint32_t b = f32_bits(x);
  ExactOperand r;
  r.neg = (b >> 31) != 0;
  const uint32_t a = b & 0x7FFFFFFFu;
  r.zero = a == 0;
  if (r.zero) {
    r.sig = 0;
    r.exp = emin;
    return r;
  }
  const int biased = static_cast<int>(a >> 23);
  const uint32_t m24 = biased == 0 ? (a & 0x7FFFFFu) : ((a & 0x7FFFFFu) | 0x800000u);
  const int lsb = (biased == 0 ? kFp32Emin : biased - 127) - kFp32ManBits;  // |x| = m24 * 2^lsb
  const int fl = biased == 0 ? (63 - clz64(m24)) + lsb : biased - 127;
  r.exp = fl < emin ? emin : fl;
  // sig = m24 * 2^(lsb - (E - man_bits)); exact for representable x (the shift only drops zeros)
  const int sh = lsb - (r.exp - man_bits);
  r.sig = sh >= 0 ? (m24 << sh) : (sh <= -32 ? 0u : (m24 >> (-sh)));
  return r;
}

// The addend C as a term: FP32, exponent max(floor(log2|c|), -126), a zero C reads zero_exp.
FP4SIM_HD void add_c_term(float c, int zero_exp, FdpaTerm& t, int& e_max, bool& all_neg_zero) {
  const ExactOperand z = exact_operand(c, kFp32ManBits, kFp32Emin);
  t.neg = z.neg;
  t.sig = z.sig;
  t.lsb_exp = z.exp - kFp32ManBits;
  t.align_exp = z.zero ? zero_exp : z.exp;
  if (!(z.zero && z.neg)) all_neg_zero = false;
  if (t.align_exp > e_max) e_max = t.align_exp;
}

// Shared core: truncate each term onto 2^(e_max - F), sum exactly, round RZ. `all_neg_zero` tells
// the zero-sum sign rule whether every term (products and C) is -0.
FP4SIM_HD uint32_t fdpa_truncated_sum_bits(const FdpaTerm* terms, int n, int e_max, int F,
                                           int out_man_bits, bool all_neg_zero) {
  const int grid = e_max - F;
  int64_t sum = 0;
  for (int i = 0; i < n; ++i) {
    const FdpaTerm& t = terms[i];
    if (t.sig == 0) continue;
    const int s = t.lsb_exp - grid;
    uint64_t v;
    if (s >= 0) {
      v = t.sig << s;
    } else {
      v = (-s) >= 64 ? 0 : (t.sig >> (-s));
    }
    sum += t.neg ? -static_cast<int64_t>(v) : static_cast<int64_t>(v);
  }
  if (sum == 0) return all_neg_zero ? 0x80000000u : 0u;
  const bool neg = sum < 0;
  const uint64_t mag = neg ? static_cast<uint64_t>(-sum) : static_cast<uint64_t>(sum);
  return round_rz_to_f32_bits(mag, grid, neg, out_man_bits);
}

// Operand format of a T-FDPA input: fraction bits and minimum normal exponent.
struct OperandFormat {
  int man_bits;
  int emin;
};
constexpr OperandFormat kBf16Operand{7, -126};
constexpr OperandFormat kFp16Operand{10, -14};
constexpr OperandFormat kE4M3Operand{3, -6};
constexpr OperandFormat kE5M2Operand{2, -14};

// T-FDPA(L, F, RZ) over products a[k]*b[k] (k < L) and C, inputs given as FP32 values exactly
// representable in their formats (fa, fb). Result as FP32 bits (on the narrower grid of
// out_man_bits fraction bits when < 23). Special values as DESIGN.md §7.
template <int L>
FP4SIM_HD uint32_t tfdpa_bits(const float* a, const float* b, float c, OperandFormat fa,
                              OperandFormat fb, int F, int out_man_bits) {
  // special values first
  bool any_nan = f32_isnan(c);
  bool pos_inf = false, neg_inf = false;
  if (f32_isinf(c)) (f32_bits(c) >> 31 ? neg_inf : pos_inf) = true;
  for (int k = 0; k < L; ++k) {
    const float x = a[k], y = b[k];
    if (f32_isnan(x) || f32_isnan(y)) {
      any_nan = true;
    } else if (f32_isinf(x) || f32_isinf(y)) {
      if (f32_abs(x) == 0.0f || f32_abs(y) == 0.0f) {
        any_nan = true;  // Inf * 0
      } else {
        const bool neg = ((f32_bits(x) ^ f32_bits(y)) >> 31) != 0;
        (neg ? neg_inf : pos_inf) = true;
      }
    }
  }
  if (any_nan || (pos_inf && neg_inf)) return kCanonicalNaN;
  if (pos_inf) return 0x7F800000u;
  if (neg_inf) return 0xFF800000u;

  FdpaTerm terms[L + 1];
  int e_max = kTfdpaZeroExp;
  bool all_neg_zero = true;
  for (int k = 0; k < L; ++k) {
    const ExactOperand x = exact_operand(a[k], fa.man_bits, fa.emin);
    const ExactOperand y = exact_operand(b[k], fb.man_bits, fb.emin);
    FdpaTerm& t = terms[k];
    t.neg = x.neg != y.neg;
    const bool zero = x.zero || y.zero;
    t.sig = zero ? 0 : static_cast<uint64_t>(x.sig) * y.sig;
    t.lsb_exp = x.exp + y.exp - fa.man_bits - fb.man_bits;
    t.align_exp = zero ? kTfdpaZeroExp : x.exp + y.exp;
    if (!(zero && t.neg)) all_neg_zero = false;
    if (t.align_exp > e_max) e_max = t.align_exp;
  }
  add_c_term(c, kTfdpaZeroExp, terms[L], e_max, all_neg_zero);
  return fdpa_truncated_sum_bits(terms, L + 1, e_max, F, out_man_bits, all_neg_zero);
}

// ---- The instruction table of DESIGN.md §7
// -------------------------------------------------------

// BF16/FP16 -> FP32 (Hopper and Blackwell): L = 16, F = 25, RZ-FP32.
constexpr int kBf16FdpaL = 16;
constexpr int kBf16FdpaF = 25;
constexpr int kBf16ManBits = 7;
constexpr int kBf16Emin = -126;
FP4SIM_HD float tfdpa_bf16(const float* a, const float* b, float c) {
  return f32_from_bits(
      tfdpa_bits<kBf16FdpaL>(a, b, c, kBf16Operand, kBf16Operand, kBf16FdpaF, kFp32ManBits));
}
FP4SIM_HD float tfdpa_fp16(const float* a, const float* b, float c) {
  return f32_from_bits(
      tfdpa_bits<kBf16FdpaL>(a, b, c, kFp16Operand, kFp16Operand, kBf16FdpaF, kFp32ManBits));
}

// FP8 (E4M3/E5M2, any mix) -> FP32: L = 32. Hopper wgmma: F = 13, RZ to 13 fraction bits (E8M13;
// subnormal outputs on the grid 2^(-126-13)). Blackwell f8f6f4: F = 25, RZ-FP32.
constexpr int kFp8FdpaL = 32;
constexpr int kFp8HopperF = 13;
constexpr int kFp8BlackwellF = 25;
FP4SIM_HD float tfdpa_fp8_hopper(const float* a, const float* b, float c, OperandFormat fa,
                                 OperandFormat fb) {
  return f32_from_bits(tfdpa_bits<kFp8FdpaL>(a, b, c, fa, fb, kFp8HopperF, kE8M13ManBits));
}
FP4SIM_HD float tfdpa_fp8_blackwell(const float* a, const float* b, float c, OperandFormat fa,
                                    OperandFormat fb) {
  return f32_from_bits(tfdpa_bits<kFp8FdpaL>(a, b, c, fa, fb, kFp8BlackwellF, kFp32ManBits));
}

// ---- GST-FDPA: Blackwell block-scaled FP4, K = 64 (DESIGN.md §7)
// ---------------------------------

constexpr int kGstK = 64;      // products per instruction
constexpr int kGstGroup = 16;  // G: products summed exactly before scaling (also for 32-blocks)
constexpr int kGstGroups = kGstK / kGstGroup;
constexpr int kGstF = 35;          // alignment grid 2^(e_max - 35)
constexpr int kGstZeroExp = -139;  // exponent of an all-zero group, a zero-scale group, a zero C

enum class ScaleKind : uint8_t {
  UE4M3_16,  // NVFP4: E4M3 bits with the sign masked, one per 16 elements
  UE8M0_16,  // 2^(e-127), one per 16 elements
  UE8M0_32,  // MXFP4: 2^(e-127), one per 32 elements (two groups share it)
};

// A decoded block scale: value = sig * 2^(exp - man_bits), exponent reading exp = E(scale).
struct DecodedScale {
  uint32_t sig;
  int exp;
  int man_bits;
  bool zero;
  bool nan;
};

FP4SIM_HD DecodedScale decode_scale(uint8_t byte, ScaleKind kind) {
  DecodedScale d;
  if (kind == ScaleKind::UE4M3_16) {
    const uint32_t m = byte & 0x7Fu;  // sign bit masked
    d.nan = m == 0x7Fu;
    d.zero = m == 0;
    const uint32_t e = m >> 3, f = m & 7u;
    d.sig = e == 0 ? f : (f | 8u);
    d.exp = e == 0 ? -6 : static_cast<int>(e) - 7;  // E(x) = max(floor(log2 x), emin = -6)
    d.man_bits = 3;
  } else {
    d.nan = byte == 0xFFu;
    d.zero = false;  // UE8M0 has no zero: byte 0 is 2^-127
    d.sig = 1;
    d.exp = static_cast<int>(byte) - 127;
    d.man_bits = 0;
  }
  return d;
}

// Which scale byte serves group g (0..3) of the 64-wide chunk: 16-blocks one each, 32-blocks
// one per two groups.
FP4SIM_HD int scale_index_for_group(int g, ScaleKind kind) {
  return kind == ScaleKind::UE8M0_32 ? g / 2 : g;
}

// One group's exact sum, in quarters: P4 = 4 * sum(a_k * b_k) over 16 E2M1 products
// (|P4| <= 2304), and whether the group reads as -0 (all 16 products are -0) / all zero.
struct GroupSum {
  int32_t p4;
  bool all_zero;      // every product is zero
  bool all_neg_zero;  // every product is -0
};

// 2 * e2m1(code) as an integer: {0, 1, 2, 3, 4, 6, 8, 12}, negated for the sign bit.
FP4SIM_HD int32_t e2m1_twice(uint8_t code) {
  constexpr uint32_t kTwiceNibbles = 0xC8643210u;  // nibble c = 2 * |e2m1(c)|
  const int32_t m = static_cast<int32_t>((kTwiceNibbles >> (4 * (code & 7u))) & 0xFu);
  return (code & 8u) ? -m : m;
}

// Per-group details for `fp4sim mma` (optional output of gst_fdpa_fp4).
struct GstTrace {
  int32_t p4[kGstGroups];
  int group_exp[kGstGroups];
  int c_exp;
  int e_max;
  int64_t truncated[kGstGroups + 1];  // each term on the grid 2^(e_max - F), C last
};

// The core of GST-FDPA once the group sums are known. Shared by the readable per-code function
// below and by the exact GEMMs (which compute the group sums with integer dot products).
FP4SIM_HD uint32_t gst_fdpa_core_bits(const GroupSum* groups, const DecodedScale* sa,
                                      const DecodedScale* sb, float c, GstTrace* trace) {
  // NaN scale or NaN C -> NaN; C = ±Inf -> C
  if (f32_isnan(c)) return kCanonicalNaN;
  for (int g = 0; g < kGstGroups; ++g)
    if (sa[g].nan || sb[g].nan) return kCanonicalNaN;
  if (f32_isinf(c)) return f32_bits(c);
  FdpaTerm terms[kGstGroups + 1];
  int e_max = kGstZeroExp;
  bool all_neg_zero = true;
  for (int g = 0; g < kGstGroups; ++g) {
    const GroupSum& p = groups[g];
    FdpaTerm& t = terms[g];
    const bool zero_scale = sa[g].zero || sb[g].zero;
    // T_g = P_g * sfa * sfb exactly: P4 * sig_a * sig_b * 2^(Ea - ma + Eb - mb - 2)
    t.neg = p.p4 < 0 || (p.p4 == 0 && p.all_neg_zero);
    const uint32_t mag = static_cast<uint32_t>(p.p4 < 0 ? -p.p4 : p.p4);
    t.sig = zero_scale ? 0 : static_cast<uint64_t>(mag) * sa[g].sig * sb[g].sig;
    t.lsb_exp = sa[g].exp - sa[g].man_bits + sb[g].exp - sb[g].man_bits - 2;
    // the group's exponent is its scales' only; all-zero products or a zero scale read e_zero
    t.align_exp = (p.all_zero || zero_scale) ? kGstZeroExp : sa[g].exp + sb[g].exp;
    if (!(t.sig == 0 && t.neg)) all_neg_zero = false;
    if (t.align_exp > e_max) e_max = t.align_exp;
    if (trace) {
      trace->p4[g] = p.p4;
      trace->group_exp[g] = t.align_exp;
    }
  }
  add_c_term(c, kGstZeroExp, terms[kGstGroups], e_max, all_neg_zero);
  if (trace) trace->c_exp = terms[kGstGroups].align_exp;
  if (trace) {
    trace->e_max = e_max;
    const int grid = e_max - kGstF;
    for (int i = 0; i <= kGstGroups; ++i) {
      const int sh = terms[i].lsb_exp - grid;
      const uint64_t v = sh >= 0 ? (terms[i].sig << sh) : ((-sh) >= 64 ? 0 : terms[i].sig >> (-sh));
      trace->truncated[i] = terms[i].neg ? -static_cast<int64_t>(v) : static_cast<int64_t>(v);
    }
  }
  return fdpa_truncated_sum_bits(terms, kGstGroups + 1, e_max, kGstF, kFp32ManBits, all_neg_zero);
}

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

// The five-term truncated sum of GST-FDPA in double arithmetic, for finite C and non-NaN scales:
// every term is an integer number of grid units 2^(e_max - 35) below 2^46 after truncation (trunc
// is exact in double: the unshifted term has at most 24 significant bits), so the sum (< 2^49) is
// exact, and RZ to FP32 of sum * 2^grid is one conversion. Used by the GPU GEMM, whose FP64 units
// do this in fewer instructions than 64-bit integer shifts; equal to the integer formulation
// (tests/emu/test_mma.cpp). Signed zeros: an exactly zero sum takes the caller's rule.
FP4SIM_HD double pow2_double(int e) {  // 2^e for -1022 <= e <= 1023
#if defined(__CUDA_ARCH__)
  return __hiloint2double((e + 1023) << 20, 0);
#else
  uint64_t b = static_cast<uint64_t>(e + 1023) << 52;
  double d;
  std::memcpy(&d, &b, sizeof d);
  return d;
#endif
}

// gst_fdpa_core_bits for the GEMMs' inner loop (both backends): the same bits
// (tests/emu/test_mma.cpp compares them on millions of random group sums, scales and C, specials
// included), with packed scales, C decoded from its bit pattern and the five terms kept in
// registers. p4[g] the group sums, bit g of all_zero / all_neg_zero the group flags, wa/wb the
// groups' packed scales, man_bits the scale kind's fraction bits. Each term fits an int64 on the
// 2^(e_max - 35) grid: a group's |P4| * sig_a * sig_b < 2^19 shifted left by at most 27 (UE4M3;
// UE8M0: 2^12 by at most 33), C's 24-bit significand by at most 12. NaN scales and non-finite C
// take the readable path. use_double: the same sum in FP64 (see above); the GPU kernel passes true.
FP4SIM_HD uint32_t gst_fdpa_core_packed_bits(const int32_t* p4, uint32_t all_zero,
                                             uint32_t all_neg_zero_groups, const uint32_t* wa,
                                             const uint32_t* wb, int man_bits, float c,
                                             bool use_double = false) {
  const uint32_t cb = f32_bits(c);
  const uint32_t c_biased = (cb >> 23) & 0xFFu;
  uint32_t any = 0;
  FP4SIM_UNROLL
  for (int g = 0; g < kGstGroups; ++g) any |= wa[g] | wb[g];
  if (c_biased == 0xFFu || (any >> 31) != 0) {  // NaN scale or non-finite C: the readable path
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
  uint64_t sig[kGstGroups + 1];
  int lsb[kGstGroups + 1];
  bool neg[kGstGroups + 1];
  int e_max = kGstZeroExp;
  bool all_neg_zero = true;
  FP4SIM_UNROLL
  for (int g = 0; g < kGstGroups; ++g) {
    const bool zero_scale = (((wa[g] | wb[g]) >> 30) & 1u) != 0;
    const int exp_sum = static_cast<int>(((wa[g] >> 8) & 0x3FFu) + ((wb[g] >> 8) & 0x3FFu)) - 1024;
    neg[g] = p4[g] < 0 || (p4[g] == 0 && ((all_neg_zero_groups >> g) & 1u));
    const uint32_t mag = static_cast<uint32_t>(p4[g] < 0 ? -p4[g] : p4[g]);
    sig[g] = zero_scale ? 0u : static_cast<uint64_t>(mag * ((wa[g] & 0xFFu) * (wb[g] & 0xFFu)));
    lsb[g] = exp_sum - 2 * man_bits - 2;
    const int align = (((all_zero >> g) & 1u) || zero_scale) ? kGstZeroExp : exp_sum;
    all_neg_zero = all_neg_zero && sig[g] == 0 && neg[g];
    e_max = align > e_max ? align : e_max;
  }
  neg[kGstGroups] = (cb >> 31) != 0;
  if ((cb & 0x7FFFFFFFu) == 0) {
    sig[kGstGroups] = 0;
    lsb[kGstGroups] = 0;
    all_neg_zero = all_neg_zero && neg[kGstGroups];
  } else {
    const int ce = c_biased == 0 ? kFp32Emin : static_cast<int>(c_biased) - 127;
    sig[kGstGroups] = c_biased == 0 ? (cb & 0x7FFFFFu) : ((cb & 0x7FFFFFu) | 0x800000u);
    lsb[kGstGroups] = ce - kFp32ManBits;
    all_neg_zero = false;
    e_max = ce > e_max ? ce : e_max;
  }
  const int grid = e_max - kGstF;
  if (use_double) {
    // each term: (-1)^neg * sig * 2^(lsb - grid), truncated; shifts below -1022 give 0 anyway
    double sum = 0.0;
    FP4SIM_UNROLL
    for (int i = 0; i <= kGstGroups; ++i) {
      const int sh = lsb[i] - grid;
      const double v = sh < -1000 ? 0.0 : trunc(static_cast<double>(sig[i]) * pow2_double(sh));
      sum += neg[i] ? -v : v;
    }
    if (sum == 0.0) return all_neg_zero ? 0x80000000u : 0u;
    const double value = sum * pow2_double(grid);  // exact: grid >= -174
    if (fabs(value) >= 0x1p128)
      return value < 0 ? 0xFF800000u : 0x7F800000u;  // overflow -> Inf under RZ
    return f32_bits(double_to_f32_rz(value));
  }
  int64_t sum = 0;
  FP4SIM_UNROLL
  for (int i = 0; i <= kGstGroups; ++i) {
    const int sh = lsb[i] - grid;
    const uint64_t v = sh >= 0 ? (sig[i] << sh) : (-sh >= 64 ? 0u : (sig[i] >> (-sh)));
    sum += neg[i] ? -static_cast<int64_t>(v) : static_cast<int64_t>(v);
  }
  if (sum == 0) return all_neg_zero ? 0x80000000u : 0u;
  const bool sum_neg = sum < 0;
  return round_rz_to_f32_bits(sum_neg ? static_cast<uint64_t>(-sum) : static_cast<uint64_t>(sum),
                              grid, sum_neg, kFp32ManBits);
}

// The lean GST-FDPA core of the GPU GEMM's second kernel: the scales arrive unpacked (significand,
// 0 for a zero scale, and exponent reading per group and operand), the group sums signed, the
// all-zero groups as bits. It covers the common case only and returns false for the rest, which
// the caller sends to gst_fdpa_core_packed_bits: a non-finite C, or an exactly zero sum (whose sign
// needs the per-product signs). NaN scales must be filtered by the caller. The five terms are
// summed in FP64 as in gst_fdpa_core_packed_bits (exact). Equal to the readable core wherever it
// returns true (tests/emu/test_mma.cpp).
//
// kZeroScaleBiased: the caller passes kGstZeroScaleExp as the exponent reading of a zero scale
// (gst_zero_scale_biased), which puts the group's exponent sum far below kGstZeroExp, so it can
// neither win the maximum nor leave a term (sh < -1000): the zero-scale tests drop out of the loop.
//
// kExpAdd (the GPU's variant 6): each term, C and the final sum are scaled by 2^sh by adding
// sh to the exponent field of the double (ldexp_exact) instead of multiplying by a constructed
// 2^sh, and a term is zero exactly when its integer p4 * sig_a * sig_b is (a zero scale has sig 0),
// so the sh < -1000 test goes too. Exact because nothing leaves the normal range (F = kGstF = 35):
// a nonzero term is an integer in [1, 2^19] whose group takes part in e_max, so sh <= 35 - 2 (and
// sh >= -475 for the widest exponents, UE8M0: exp_sum >= -254, e_max <= 254); C scaled lies in
// [2^-368, 2^36); the final sum is an integer in [1, 2^49) and grid >= -254 - 35. Adding to the
// exponent field of a normal double that stays normal never carries into the sign bit, so negative
// values work alike. Same bits (tests/emu/test_mma.cpp).
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

template <bool kZeroScaleBiased = false, bool kExpAdd = false>
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

// The exact group sums of one 64-wide chunk from packed E2M1 codes (element 2i in the low nibble).
FP4SIM_HD void gst_group_sums(const uint8_t* a_packed, const uint8_t* b_packed, GroupSum* groups) {
  for (int g = 0; g < kGstGroups; ++g) {
    int32_t p4 = 0;
    bool all_zero = true, all_neg_zero = true;
    for (int k = g * kGstGroup; k < (g + 1) * kGstGroup; ++k) {
      const uint8_t ca = (a_packed[k / 2] >> (4 * (k & 1))) & 0xFu;
      const uint8_t cb = (b_packed[k / 2] >> (4 * (k & 1))) & 0xFu;
      const int32_t prod = e2m1_twice(ca) * e2m1_twice(cb);
      p4 += prod;
      const bool zero = prod == 0;
      const bool neg = ((ca ^ cb) & 8u) != 0;
      if (!zero) all_zero = false;
      if (!(zero && neg)) all_neg_zero = false;
    }
    groups[g].p4 = p4;
    groups[g].all_zero = all_zero;
    groups[g].all_neg_zero = all_neg_zero;
  }
}

// GST-FDPA over one 64-wide chunk: a, b packed E2M1 codes (32 bytes each), sfa/sfb the scale
// bytes of the chunk (4 for 16-blocks, 2 for UE8M0 32-blocks), C the FP32 addend. FP32 bits.
FP4SIM_HD uint32_t gst_fdpa_fp4_bits(const uint8_t* a_packed, const uint8_t* b_packed,
                                     const uint8_t* sfa, const uint8_t* sfb, ScaleKind kind,
                                     float c, GstTrace* trace = nullptr) {
  GroupSum groups[kGstGroups];
  gst_group_sums(a_packed, b_packed, groups);
  DecodedScale da[kGstGroups], db[kGstGroups];
  for (int g = 0; g < kGstGroups; ++g) {
    da[g] = decode_scale(sfa[scale_index_for_group(g, kind)], kind);
    db[g] = decode_scale(sfb[scale_index_for_group(g, kind)], kind);
  }
  return gst_fdpa_core_bits(groups, da, db, c, trace);
}

FP4SIM_HD float gst_fdpa_fp4(const uint8_t* a_packed, const uint8_t* b_packed, const uint8_t* sfa,
                             const uint8_t* sfb, ScaleKind kind, float c) {
  return f32_from_bits(gst_fdpa_fp4_bits(a_packed, b_packed, sfa, sfb, kind, c));
}

}  // namespace fp4sim

#if !defined(__CUDACC__)
#include <cmath>

namespace fp4sim {

// The BF16 T-FDPA (L = 16, F = 25, RZ) evaluated with doubles, for the host's emulated BF16 GEMMs:
// each product of two BF16 values is exact in double; scaling by 2^-(e_max - 25) and truncation
// toward zero (the int64 conversion) give the truncated terms exactly; their sum (< 2^32 grid
// units) is exact in int64; the final RZ to FP32
// steps the nearest float toward zero when it overshoots. Special values, and an exactly zero sum
// (whose sign has its own rule), take the literal path. Equal to tfdpa_bf16 on every input
// (tests/emu/test_mma.cpp checks millions of random cases).
//
// The operands come prepared: values as doubles (ad, bd), exponent readings E(x) =
// max(floor(log2|x|), -126) with kBf16ZeroReading for zeros (ae, be_), and the floats (af, bf) for
// the literal path. The caller guarantees no NaN/Inf among the 16 + 16 operands.
constexpr int32_t kBf16ZeroReading = -100000;

inline int32_t bf16_exponent_reading(float x) {
  const uint32_t u = f32_bits(x) & 0x7FFFFFFFu;
  if (u == 0) return kBf16ZeroReading;
  return (u >> 23) ? static_cast<int32_t>(u >> 23) - 127 : kFp32Emin;
}

inline float tfdpa_bf16_prepared(const double* ad, const int32_t* ae, const double* bd,
                                 const int32_t* be_, const float* af, const float* bf, float c) {
  const uint32_t uc = f32_bits(c) & 0x7FFFFFFFu;
  if (uc >= 0x7F800000u) return tfdpa_bf16(af, bf, c);  // an Inf/NaN accumulator: the literal rules
  int32_t e_max = kTfdpaZeroExp;
  for (int k = 0; k < kBf16FdpaL; ++k) {
    const int32_t e = ae[k] + be_[k];
    e_max = e > e_max ? e : e_max;
  }
  if (uc != 0) {
    const int32_t ec = bf16_exponent_reading(c);
    e_max = ec > e_max ? ec : e_max;
  }
  const int grid = e_max - kBf16FdpaF;
  // each term below 2^27 grid units: truncation toward zero is the int64 conversion (exact), and
  // the sum of 17 terms is exact in int64 (faster than std::trunc, a libm call without SSE4.1)
  // (terms first, then their sum: two simple loops the compiler vectorises where the CPU can
  // convert doubles to int64 in vector registers)
  const double down = pow2_double(-grid);
  int64_t terms[kBf16FdpaL];
#pragma omp simd
  for (int k = 0; k < kBf16FdpaL; ++k) terms[k] = static_cast<int64_t>(ad[k] * bd[k] * down);
  int64_t sum = static_cast<int64_t>(static_cast<double>(c) * down);
#pragma omp simd reduction(+ : sum)
  for (int k = 0; k < kBf16FdpaL; ++k) sum += terms[k];
  if (sum == 0) return tfdpa_bf16(af, bf, c);                         // the signed-zero rule
  const double exact = static_cast<double>(sum) * pow2_double(grid);  // exact: |sum| < 2^32
  if (std::fabs(exact) >= 0x1p128) return exact > 0 ? INFINITY : -INFINITY;
  return double_to_f32_rz(exact);
}

// The Hopper FP8 T-FDPA (L = 32, F = 13, RZ to E8M13) the same way, for the host's FP8 GEMM:
// products of E4M3 values are exact in double, every truncated term is below 2^15 grid units and
// their sum below 2^21, so the sum is exact; the RZ to 13 fraction bits is round_rz_to_f32_bits.
// Operands prepared as above with E4M3's emin (-6) and kFp8ZeroReading for zeros; the caller
// guarantees no NaN among the operands (E4M3 has no Inf). A non-finite C and an exactly zero sum
// take the literal path. Equal to tfdpa_fp8_hopper (tests/emu/test_fp8.cpp).
constexpr int32_t kFp8ZeroReading = -100000;
inline int32_t e4m3_exponent_reading(float x) {
  const uint32_t u = f32_bits(x) & 0x7FFFFFFFu;
  if (u == 0) return kFp8ZeroReading;
  const int fl = static_cast<int>(u >> 23) - 127;  // E4M3 values are FP32 normals
  return fl < kE4M3Operand.emin ? kE4M3Operand.emin : fl;
}

inline float tfdpa_fp8_hopper_prepared(const double* ad, const int32_t* ae, const double* bd,
                                       const int32_t* be_, const float* af, const float* bf,
                                       float c) {
  const uint32_t uc = f32_bits(c) & 0x7FFFFFFFu;
  if (uc >= 0x7F800000u) return tfdpa_fp8_hopper(af, bf, c, kE4M3Operand, kE4M3Operand);
  int32_t e_max = kTfdpaZeroExp;
  for (int k = 0; k < kFp8FdpaL; ++k) {
    const int32_t e = ae[k] + be_[k];
    e_max = e > e_max ? e : e_max;
  }
  if (uc != 0) {
    const int32_t ec = bf16_exponent_reading(c);  // max(floor(log2|c|), -126)
    e_max = ec > e_max ? ec : e_max;
  }
  const int grid = e_max - kFp8HopperF;
  const double down = pow2_double(-grid);  // terms below 2^15 grid units: int64 truncation is exact
  int64_t sum = static_cast<int64_t>(static_cast<double>(c) * down);
  for (int k = 0; k < kFp8FdpaL; ++k) sum += static_cast<int64_t>(ad[k] * bd[k] * down);
  if (sum == 0)
    return tfdpa_fp8_hopper(af, bf, c, kE4M3Operand, kE4M3Operand);  // the signed-zero rule
  const bool neg = sum < 0;
  return f32_from_bits(
      round_rz_to_f32_bits(static_cast<uint64_t>(neg ? -sum : sum), grid, neg, kE8M13ManBits));
}

// The same for one chunk of plain floats (BF16 values): prepares the operands, then as above.
inline float tfdpa_bf16_host(const float* a, const float* b, float c) {
  double ad[kBf16FdpaL], bd[kBf16FdpaL];
  int32_t ae[kBf16FdpaL], be_[kBf16FdpaL];
  for (int k = 0; k < kBf16FdpaL; ++k) {
    if (f32_isnan(a[k]) || f32_isinf(a[k]) || f32_isnan(b[k]) || f32_isinf(b[k]))
      return tfdpa_bf16(a, b, c);
    ad[k] = a[k];
    bd[k] = b[k];
    ae[k] = bf16_exponent_reading(a[k]);
    be_[k] = bf16_exponent_reading(b[k]);
  }
  return tfdpa_bf16_prepared(ad, ae, bd, be_, a, b, c);
}

}  // namespace fp4sim
#endif
