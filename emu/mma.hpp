// The tensor-core arithmetic model (DESIGN.md §7): truncated fused dot-product-add, per output.
//
// T-FDPA(L, F, rho) over L products and an addend C: products exact and not renormalised, each read
// at exponent E(a)+E(b); every term truncated toward zero onto the grid 2^(e_max - F); exact
// integer sum; one final rounding rho (RZ to FP32, or RZ to 13 fraction bits on Hopper FP8). Host
// and device share this code. The sums are exact in int64: with F <= 35 no term reaches 2^47.
//
// This is the readable model, in the contract's order. The GEMMs evaluate the same bits their own
// ways, each held equal to these functions by tests: the emulator's from packed scales and prepared
// operands (emu/gst_fdpa_packed.hpp, emu/tfdpa_prepared.hpp), the GPU's exact GEMM with its own
// variants (gpu/gst_fdpa_device.cuh).
#pragma once

#include <cstdint>

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
// below and by the exact GEMMs' rare paths (they compute the group sums with integer dot products).
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
