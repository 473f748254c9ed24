// The tensor-core arithmetic model (DESIGN.md §7): truncated fused dot-product-add, per output.
//
// T-FDPA(L, F, rho) over L products and an addend C: products exact and not renormalised, each read
// at exponent E(a)+E(b); every term truncated toward zero onto the grid 2^(e_max - F); exact integer
// sum; one final rounding rho (RZ to FP32, or RZ to 13 fraction bits on Hopper FP8). Host and device
// share this code. The sums are exact in int64: with F <= 35 no term reaches 2^47.
#pragma once

#include <cstdint>

#include "emu/formats.hpp"
#include "emu/hd.hpp"

namespace fp4sim {

constexpr int kTfdpaZeroExp = -133;   // exponent a zero product or a zero C reads (T-FDPA)
constexpr int kFp32Emin = -126;       // C's exponent floor
constexpr int kFp32ManBits = 23;      // RZ-FP32 output
constexpr int kE8M13ManBits = 13;     // Hopper FP8 wgmma output (E8M13)
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

// T-FDPA(L, F, RZ) over products a[k]*b[k] (k < L) and C, inputs given as FP32 values exactly
// representable in a format with `in_man_bits` fraction bits and minimum normal exponent `in_emin`.
// Result as FP32 bits. Special values as DESIGN.md §7.
template <int L>
FP4SIM_HD uint32_t tfdpa_bits(const float* a, const float* b, float c, int in_man_bits, int in_emin,
                              int F, int out_man_bits) {
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
    const ExactOperand x = exact_operand(a[k], in_man_bits, in_emin);
    const ExactOperand y = exact_operand(b[k], in_man_bits, in_emin);
    FdpaTerm& t = terms[k];
    t.neg = x.neg != y.neg;
    const bool zero = x.zero || y.zero;
    t.sig = zero ? 0 : static_cast<uint64_t>(x.sig) * y.sig;
    t.lsb_exp = x.exp + y.exp - 2 * in_man_bits;
    t.align_exp = zero ? kTfdpaZeroExp : x.exp + y.exp;
    if (!(zero && t.neg)) all_neg_zero = false;
    if (t.align_exp > e_max) e_max = t.align_exp;
  }
  {
    const ExactOperand z = exact_operand(c, kFp32ManBits, kFp32Emin);
    FdpaTerm& t = terms[L];
    t.neg = z.neg;
    t.sig = z.sig;
    t.lsb_exp = z.exp - kFp32ManBits;
    t.align_exp = z.zero ? kTfdpaZeroExp : z.exp;
    if (!(z.zero && z.neg)) all_neg_zero = false;
    if (t.align_exp > e_max) e_max = t.align_exp;
  }
  return fdpa_truncated_sum_bits(terms, L + 1, e_max, F, out_man_bits, all_neg_zero);
}

// The BF16 x BF16 -> FP32 instruction (Hopper and Blackwell): L = 16, F = 25, RZ-FP32.
constexpr int kBf16FdpaL = 16;
constexpr int kBf16FdpaF = 25;
constexpr int kBf16ManBits = 7;
constexpr int kBf16Emin = -126;
FP4SIM_HD float tfdpa_bf16(const float* a, const float* b, float c) {
  return f32_from_bits(
      tfdpa_bits<kBf16FdpaL>(a, b, c, kBf16ManBits, kBf16Emin, kBf16FdpaF, kFp32ManBits));
}

}  // namespace fp4sim
