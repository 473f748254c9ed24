// A slow, independent, exact reference of the tensor-core arithmetic model (DESIGN.md §7), written
// from the contract's text, and differential tests of emu/mma.hpp against it on random bit
// patterns.
//
// The reference keeps every value exactly as a big two's-complement fixed-point number (Fixed:
// 10 x 64-bit limbs, weight of bit i = 2^(i - 320), so |x| < 2^319 down to a quantum of 2^-320;
// the model's values span 2^-312 (BF16 subnormal products) .. 2^270 (GST sums)). Inputs are decoded
// through std::frexp (FP32 values) or from the DESIGN.md §2 tables (E2M1 codes, scale bytes);
// exponent readings are computed from the exact values: E(x) = max(floor(log2|x|), emin). Each term
// is truncated toward zero onto 2^(e_max - F) on its magnitude, the terms are summed exactly, and
// the final RZ picks the significant bits of the exact sum and rebuilds the float with std::ldexp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>

#include "emu/formats.hpp"
#include "emu/mma.hpp"

namespace fp4sim {
namespace {

// ================================================================================================
// The reference
// ================================================================================================
namespace ref {

[[noreturn]] void internal_error(const char* what) {
  std::fprintf(stderr, "mma reference: internal error: %s\n", what);
  std::abort();
}

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// Exact signed fixed point: value = N * 2^-kLsb, N a two's-complement integer of kLimbs*64 bits.
class Fixed {
 public:
  static constexpr int kLimbs = 10;
  static constexpr int kLsb = 320;
  static constexpr int kBits = 64 * kLimbs;

  Fixed() { std::memset(w_, 0, sizeof w_); }

  // (-1)^neg * m * 2^e, exactly.
  static Fixed dyadic(uint64_t m, int e, bool neg) {
    Fixed r;
    if (m == 0) return r;
    const int pos = e + kLsb;
    if (pos < 0 || pos + 64 > kBits - 1) internal_error("dyadic out of range");
    const int limb = pos / 64, off = pos % 64;
    r.w_[limb] |= m << off;
    if (off != 0) r.w_[limb + 1] |= m >> (64 - off);
    if (neg) r.negate();
    return r;
  }

  bool is_zero() const {
    for (uint64_t x : w_)
      if (x) return false;
    return true;
  }
  bool is_neg() const { return (w_[kLimbs - 1] >> 63) != 0; }

  void negate() {
    unsigned carry = 1;
    for (uint64_t& x : w_) {
      x = ~x;
      const uint64_t s = x + carry;
      carry = (carry && s == 0) ? 1u : 0u;
      x = s;
    }
  }

  Fixed& operator+=(const Fixed& o) {
    unsigned __int128 carry = 0;
    for (int i = 0; i < kLimbs; ++i) {
      const unsigned __int128 s = static_cast<unsigned __int128>(w_[i]) + o.w_[i] + carry;
      w_[i] = static_cast<uint64_t>(s);
      carry = s >> 64;
    }
    return *this;
  }

  // floor(log2 |x|) for x != 0.
  int floor_log2() const {
    Fixed m = magnitude();
    for (int i = kLimbs - 1; i >= 0; --i)
      if (m.w_[i]) return i * 64 + (63 - __builtin_clzll(m.w_[i])) - kLsb;
    internal_error("floor_log2 of zero");
  }

  // Truncate toward zero onto the grid 2^e (keep the multiples of 2^e of |x|, restore the sign).
  // Returns whether any bit was dropped.
  bool truncate_toward_zero(int e) {
    const int pos = e + kLsb;
    if (pos <= 0) return false;
    const bool neg = is_neg();
    Fixed m = magnitude();
    bool dropped = false;
    for (int i = 0; i < kLimbs; ++i) {
      const int lo = i * 64;
      uint64_t mask;  // bits of limb i below pos
      if (pos >= lo + 64)
        mask = ~0ull;
      else if (pos <= lo)
        mask = 0;
      else
        mask = (1ull << (pos - lo)) - 1;
      if (m.w_[i] & mask) dropped = true;
      m.w_[i] &= ~mask;
    }
    if (neg) m.negate();
    *this = m;
    return dropped;
  }

  // x *= m * 2^e, exactly (m < 2^32).
  void scale(uint64_t mul, int e) {
    const bool neg = is_neg();
    Fixed m = magnitude();
    unsigned __int128 carry = 0;
    for (int i = 0; i < kLimbs; ++i) {
      const unsigned __int128 p = static_cast<unsigned __int128>(m.w_[i]) * mul + carry;
      m.w_[i] = static_cast<uint64_t>(p);
      carry = p >> 64;
    }
    if (carry || m.is_neg()) internal_error("scale overflow");
    if (e > 0) m.shift_left(e);
    if (e < 0) m.shift_right_exact(-e);
    if (neg) m.negate();
    *this = m;
  }

  // The n (<= 63) bits of |x| of weights 2^lo .. 2^(lo+n-1), as an integer.
  uint64_t magnitude_bits(int lo, int n) const {
    const Fixed m = magnitude();
    uint64_t r = 0;
    for (int j = n - 1; j >= 0; --j) {
      const int pos = lo + j + kLsb;
      if (pos < 0 || pos >= kBits) internal_error("bit position");
      r = (r << 1) | ((m.w_[pos / 64] >> (pos % 64)) & 1u);
    }
    return r;
  }

 private:
  Fixed magnitude() const {
    Fixed m = *this;
    if (m.is_neg()) m.negate();
    return m;
  }
  bool bit(int pos) const { return (w_[pos / 64] >> (pos % 64)) & 1u; }
  void shift_left(int s) {
    for (int k = 0; k < s; ++k) {
      if (bit(kBits - 2)) internal_error("shift_left overflow");
      uint64_t c = 0;
      for (int i = 0; i < kLimbs; ++i) {
        const uint64_t nc = w_[i] >> 63;
        w_[i] = (w_[i] << 1) | c;
        c = nc;
      }
    }
  }
  void shift_right_exact(int s) {
    // word shifts first, then bits
    while (s >= 64) {
      if (w_[0]) internal_error("inexact shift_right");
      for (int i = 0; i + 1 < kLimbs; ++i) w_[i] = w_[i + 1];
      w_[kLimbs - 1] = 0;
      s -= 64;
    }
    if (s == 0) return;
    if (w_[0] & ((1ull << s) - 1)) internal_error("inexact shift_right");
    for (int i = 0; i < kLimbs; ++i) {
      const uint64_t hi = i + 1 < kLimbs ? w_[i + 1] : 0;
      w_[i] = (w_[i] >> s) | (hi << (64 - s));
    }
  }
  uint64_t w_[kLimbs];
};

// A finite nonzero FP32 value as m * 2^e with m < 2^24, via frexp; floor(log2|x|) alongside.
struct Dyadic {
  uint64_t m;
  int e;
  int floor_log2;
};
Dyadic dyadic_of(float x) {
  int ex = 0;
  const double fr = std::frexp(std::fabs(static_cast<double>(x)), &ex);  // [0.5, 1)
  Dyadic d;
  d.m = static_cast<uint64_t>(std::ldexp(fr, 24));
  if (std::ldexp(static_cast<double>(d.m), ex - 24) != std::fabs(static_cast<double>(x)))
    internal_error("dyadic_of inexact");
  d.e = ex - 24;
  d.floor_log2 = ex - 1;
  return d;
}

// One term of a fused dot product: its exact value, its exponent reading, and whether it is -0.
struct Term {
  Fixed v;
  int exp;
  bool neg_zero;
};

// Diagnostics for the generators' coverage counters.
struct Info {
  bool special = false;      // NaN / Inf path
  bool truncated = false;    // some term lost bits on the grid
  bool c_truncated = false;  // C lost bits on the grid
  bool zero_sum = false;     // the exact sum of truncated terms was zero
  bool underflow_to_zero = false;
};

// RZ of the exact sum to `man_bits` fraction bits with FP32's exponent range (subnormal quantum
// 2^(-126 - man_bits)); |sum| >= 2^128 overflows to Inf. Result as FP32 bits.
uint32_t round_rz(const Fixed& s, bool all_neg_zero, int man_bits, Info* info) {
  if (s.is_zero()) {
    if (info) info->zero_sum = true;
    return all_neg_zero ? 0x80000000u : 0u;
  }
  const bool neg = s.is_neg();
  const int p = s.floor_log2();
  if (p >= 128) return neg ? 0xFF800000u : 0x7F800000u;
  const int q = std::max(p, -126) - man_bits;  // quantum of the output at this magnitude
  if (p < q) {
    if (info) info->underflow_to_zero = true;
    return neg ? 0x80000000u : 0u;
  }
  const uint64_t M = s.magnitude_bits(q, p - q + 1);
  const double v = std::ldexp(static_cast<double>(M), q);  // exact, and exact as an FP32
  const float f = static_cast<float>(v);
  if (static_cast<double>(f) != v) internal_error("result not representable");
  return bits_of(neg ? -f : f);
}

uint32_t sum_terms(Term* t, int n, int F, int man_bits, Info* info) {
  int e_max = t[0].exp;
  for (int i = 1; i < n; ++i) e_max = std::max(e_max, t[i].exp);
  Fixed sum;
  bool all_neg_zero = true;
  for (int i = 0; i < n; ++i) {
    all_neg_zero = all_neg_zero && t[i].neg_zero;
    Fixed x = t[i].v;
    const bool dropped = x.truncate_toward_zero(e_max - F);
    if (info && dropped) {
      info->truncated = true;
      if (i == n - 1) info->c_truncated = true;
    }
    sum += x;
  }
  return round_rz(sum, all_neg_zero, man_bits, info);
}

// C as a term (finite): zero reads e_zero; else max(floor(log2|c|), -126).
Term c_term(float c, int e_zero) {
  Term t;
  if (c == 0.0f) {
    t.exp = e_zero;
    t.neg_zero = std::signbit(c);
    return t;
  }
  const Dyadic d = dyadic_of(c);
  t.v = Fixed::dyadic(d.m, d.e, std::signbit(c));
  t.exp = std::max(d.floor_log2, -126);
  t.neg_zero = false;
  return t;
}

constexpr int kTZero = -133;
constexpr int kGZero = -139;

// T-FDPA(L, F, RZ to out_man_bits) over a[k]*b[k] and c, with operand minimum normal exponents.
uint32_t tfdpa(int L, const float* a, const float* b, float c, int emin_a, int emin_b, int F,
               int out_man_bits, Info* info = nullptr) {
  // Special values: NaN anywhere, Inf*0, +Inf with -Inf -> NaN; else any Inf -> that Inf.
  bool nan = std::isnan(c), pinf = false, ninf = false;
  if (std::isinf(c)) (std::signbit(c) ? ninf : pinf) = true;
  for (int k = 0; k < L; ++k) {
    if (std::isnan(a[k]) || std::isnan(b[k])) {
      nan = true;
    } else if (std::isinf(a[k]) || std::isinf(b[k])) {
      if (a[k] == 0.0f || b[k] == 0.0f)
        nan = true;
      else
        (std::signbit(a[k]) != std::signbit(b[k]) ? ninf : pinf) = true;
    }
  }
  if (nan || (pinf && ninf) || pinf || ninf) {
    if (info) info->special = true;
    if (nan || (pinf && ninf)) return 0x7FFFFFFFu;
    return pinf ? 0x7F800000u : 0xFF800000u;
  }
  Term t[64 + 1];
  if (L > 64) internal_error("L");
  for (int k = 0; k < L; ++k) {
    const bool neg = std::signbit(a[k]) != std::signbit(b[k]);
    if (a[k] == 0.0f || b[k] == 0.0f) {
      t[k].exp = kTZero;
      t[k].neg_zero = neg;
      continue;
    }
    const Dyadic x = dyadic_of(a[k]), y = dyadic_of(b[k]);
    t[k].v = Fixed::dyadic(x.m * y.m, x.e + y.e, neg);
    t[k].exp = std::max(x.floor_log2, emin_a) + std::max(y.floor_log2, emin_b);
    t[k].neg_zero = false;
  }
  t[L] = c_term(c, kTZero);
  return sum_terms(t, L + 1, F, out_man_bits, info);
}

// ---- GST-FDPA ----

// E2M1 magnitude codes 0..7 -> 2*|value| (DESIGN.md §2: 0, 0.5, 1, 1.5, 2, 3, 4, 6).
constexpr uint64_t kE2M1Twice[8] = {0, 1, 2, 3, 4, 6, 8, 12};

struct Scale {
  uint64_t m;  // value = m * 2^e
  int e;
  int E;  // exponent reading E(scale)
  bool zero;
  bool nan;
};
Scale scale_value(uint8_t byte, ScaleKind kind) {
  Scale s{};
  if (kind == ScaleKind::UE4M3_16) {
    const unsigned b = byte & 0x7Fu;  // sign masked
    s.nan = b == 0x7Fu;
    const unsigned ef = b >> 3, f = b & 7u;
    if (ef == 0) {  // subnormal: f * 2^-9
      s.m = f;
      s.e = -9;
    } else {  // (8 + f) * 2^(ef - 7 - 3)
      s.m = 8 + f;
      s.e = static_cast<int>(ef) - 10;
    }
    s.zero = s.m == 0;
    if (!s.zero) {
      const int fl = s.e + (63 - __builtin_clzll(s.m));
      s.E = std::max(fl, -6);
    }
  } else {
    s.nan = byte == 0xFFu;
    s.m = 1;
    s.e = static_cast<int>(byte) - 127;  // byte 0 is 2^-127, not zero
    s.E = std::max(s.e, -127);
    s.zero = false;
  }
  return s;
}

uint8_t nibble(const uint8_t* packed, int k) { return (packed[k / 2] >> (4 * (k % 2))) & 0xFu; }

uint32_t gst(const uint8_t* a_packed, const uint8_t* b_packed, const uint8_t* sfa,
             const uint8_t* sfb, ScaleKind kind, uint32_t c_bits, Info* info = nullptr) {
  const float c = float_of(c_bits);
  Scale sa[4], sb[4];
  bool nan = std::isnan(c);
  for (int g = 0; g < 4; ++g) {
    const int idx = kind == ScaleKind::UE8M0_32 ? g / 2 : g;
    sa[g] = scale_value(sfa[idx], kind);
    sb[g] = scale_value(sfb[idx], kind);
    nan = nan || sa[g].nan || sb[g].nan;
  }
  if (nan) {
    if (info) info->special = true;
    return 0x7FFFFFFFu;
  }
  if (std::isinf(c)) {
    if (info) info->special = true;
    return c_bits;
  }
  Term t[5];
  for (int g = 0; g < 4; ++g) {
    Fixed P;
    bool all_zero = true, all_neg_zero = true;
    for (int k = 16 * g; k < 16 * g + 16; ++k) {
      const uint8_t ca = nibble(a_packed, k), cb = nibble(b_packed, k);
      const bool neg = ((ca ^ cb) & 8u) != 0;
      const uint64_t m = kE2M1Twice[ca & 7u] * kE2M1Twice[cb & 7u];  // product = m / 4
      if (m == 0) {
        all_neg_zero = all_neg_zero && neg;
        continue;
      }
      all_zero = false;
      all_neg_zero = false;
      P += Fixed::dyadic(m, -2, neg);
    }
    const bool p_neg = P.is_neg() || (P.is_zero() && all_neg_zero);
    Fixed T = P;
    T.scale(sa[g].m * sb[g].m, sa[g].e + sb[g].e);
    t[g].v = T;
    t[g].exp = (all_zero || sa[g].zero || sb[g].zero) ? kGZero : sa[g].E + sb[g].E;
    t[g].neg_zero = T.is_zero() && p_neg;
  }
  t[4] = c_term(c, kGZero);
  return sum_terms(t, 5, 35, 23, info);
}

}  // namespace ref

// ================================================================================================
// Helpers for the tests
// ================================================================================================

using ref::bits_of;
using ref::float_of;

std::string hex32(uint32_t u) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08" PRIX32, u);
  return buf;
}
std::string hex_bytes(const uint8_t* p, int n) {
  std::string s;
  char buf[4];
  for (int i = 0; i < n; ++i) {
    std::snprintf(buf, sizeof buf, "%02X", p[i]);
    s += buf;
    if (i + 1 < n) s += ' ';
  }
  return s;
}
std::string describe_bits(uint32_t u) {
  std::ostringstream o;
  o << hex32(u) << " (" << float_of(u) << ")";
  return o.str();
}

const char* kind_name(ScaleKind k) {
  switch (k) {
    case ScaleKind::UE4M3_16:
      return "UE4M3_16";
    case ScaleKind::UE8M0_16:
      return "UE8M0_16";
    case ScaleKind::UE8M0_32:
      return "UE8M0_32";
  }
  return "?";
}

// 64 E2M1 codes -> 32 packed bytes (element 2i in the low nibble of byte i).
void pack64(const uint8_t* codes, uint8_t* packed) {
  for (int i = 0; i < 32; ++i)
    packed[i] = static_cast<uint8_t>((codes[2 * i] & 0xF) | ((codes[2 * i + 1] & 0xF) << 4));
}

// FP16 bits -> float, built here: 1.5.10, bias 15, IEEE Inf/NaN.
float fp16_to_f32(uint16_t h) {
  const bool neg = (h >> 15) != 0;
  const int ef = (h >> 10) & 0x1F;
  const int man = h & 0x3FF;
  float v;
  if (ef == 0x1F)
    v = man ? std::numeric_limits<float>::quiet_NaN() : INFINITY;
  else if (ef == 0)
    v = std::ldexp(static_cast<float>(man), -24);
  else
    v = std::ldexp(static_cast<float>(1024 + man), ef - 25);
  return neg ? -v : v;
}
float bf16_code_to_f32(uint32_t c) { return bf16_to_f32(static_cast<uint16_t>(c)); }
float fp16_code_to_f32(uint32_t c) { return fp16_to_f32(static_cast<uint16_t>(c)); }
float e4m3_code_to_f32(uint32_t c) { return e4m3_to_f32(static_cast<uint8_t>(c)); }
float e5m2_code_to_f32(uint32_t c) { return e5m2_to_f32(static_cast<uint8_t>(c)); }

// An operand format of a T-FDPA input, for the generators and the reference.
struct OpFmt {
  const char* name;
  int exp_bits;
  int man_bits;
  int emin;
  bool has_inf;
  float (*decode)(uint32_t);
  OperandFormat fast;  // the fast API's descriptor
};
const OpFmt kBf16{"BF16", 8, 7, -126, true, bf16_code_to_f32, kBf16Operand};
const OpFmt kFp16{"FP16", 5, 10, -14, true, fp16_code_to_f32, kFp16Operand};
const OpFmt kE4M3{"E4M3", 4, 3, -6, false, e4m3_code_to_f32, kE4M3Operand};
const OpFmt kE5M2{"E5M2", 5, 2, -14, true, e5m2_code_to_f32, kE5M2Operand};

int total_bits(const OpFmt& f) { return 1 + f.exp_bits + f.man_bits; }
uint32_t sign_bit(const OpFmt& f) { return 1u << (f.exp_bits + f.man_bits); }
int max_exp_field(const OpFmt& f) { return (1 << f.exp_bits) - 1; }
bool is_special(const OpFmt& f, uint32_t code) { return !std::isfinite(f.decode(code)); }
uint32_t make_code(const OpFmt& f, bool neg, int ef, uint32_t man) {
  return (neg ? sign_bit(f) : 0u) | (static_cast<uint32_t>(ef) << f.man_bits) |
         (man & ((1u << f.man_bits) - 1u));
}

using Rng = std::mt19937_64;
int uni(Rng& r, int lo, int hi) {  // inclusive
  return lo + static_cast<int>(r() % static_cast<uint64_t>(hi - lo + 1));
}
bool chance(Rng& r, int one_in) { return r() % static_cast<uint64_t>(one_in) == 0; }
double unit(Rng& r) { return static_cast<double>(r() >> 11) * 0x1.0p-53; }

// ---- C generator (shared) --------------------------------------------------------------------
// e_ref: an estimate of the largest term's exponent; approx_sum: the terms' sum in double (NaN if
// not known): C near -approx_sum makes the truncation and the zero-sign rules matter.
uint32_t gen_c(Rng& r, int e_ref, double approx_sum) {
  const uint32_t sign = (r() & 1) ? 0x80000000u : 0u;
  const int mode = uni(r, 0, 31);
  if (mode <= 5) return static_cast<uint32_t>(r());                     // any bit pattern
  if (mode <= 7) return sign;                                           // ±0
  if (mode <= 9) return sign | static_cast<uint32_t>(r() & 0x7FFFFFu);  // subnormal (or 0)
  if (mode == 10) {
    switch (uni(r, 0, 3)) {
      case 0:
        return sign | 0x7F800000u;  // ±Inf
      case 1:
        return 0x7FC00000u | sign;  // quiet NaN
      case 2:
        return sign | 0x7F800000u | (1u + (r() & 0x3FFFFFu));  // signalling NaN
      default:
        return sign | 0x7F7FFFFFu;  // ±FLT_MAX
    }
  }
  if (mode <= 12) return sign | (static_cast<uint32_t>(uni(r, 230, 254)) << 23) | (r() & 0x7FFFFFu);
  if (mode <= 14) return sign | (static_cast<uint32_t>(uni(r, 1, 8)) << 23) | (r() & 0x7FFFFFu);
  if (mode <= 25 || std::isnan(approx_sum)) {
    // near the terms: magnitude 2^(e_ref + d), mantissa random or short
    const int d = uni(r, -40, 12);
    uint32_t man = static_cast<uint32_t>(r() & 0x7FFFFFu);
    if (chance(r, 3)) man &= 0x7F0000u;
    if (chance(r, 4)) man = 0;
    const float f = std::ldexp(1.0f + std::ldexp(static_cast<float>(man), -23), e_ref + d);
    return sign | bits_of(f);
  }
  // cancel the terms: C = -(sum rounded to FP32), nudged by a few ulps
  const float f = static_cast<float>(-approx_sum);
  uint32_t u = bits_of(f);
  const int nudge = uni(r, -3, 3);
  if (!chance(r, 2)) u = static_cast<uint32_t>(static_cast<int64_t>(u) + nudge);
  return u;
}

// ---- T-FDPA generator ------------------------------------------------------------------------

uint32_t random_code(Rng& r, const OpFmt& f) {
  return static_cast<uint32_t>(r() & ((1u << total_bits(f)) - 1u));
}

uint32_t clustered_code(Rng& r, const OpFmt& f, int center, int w) {
  const int ef = std::clamp(center + uni(r, -w, w), 0, max_exp_field(f));
  return make_code(f, r() & 1, ef, static_cast<uint32_t>(r()));
}

// Fill L operand codes for a and b; specials only when `specials`.
void gen_tfdpa_codes(Rng& r, const OpFmt& fa, const OpFmt& fb, int L, uint32_t* ca, uint32_t* cb,
                     bool specials) {
  const int mode = uni(r, 0, 7);
  static const int kWidths[] = {0, 0, 1, 1, 2, 3, 4, 8, 16};
  const int wa = kWidths[uni(r, 0, 8)], wb = kWidths[uni(r, 0, 8)];
  const int center_a = uni(r, 0, max_exp_field(fa)), center_b = uni(r, 0, max_exp_field(fb));
  const bool clustered = mode >= 1 && mode != 6 && !(mode == 3 && chance(r, 2));
  for (int k = 0; k < L; ++k) {
    ca[k] = clustered ? clustered_code(r, fa, center_a, wa) : random_code(r, fa);
    cb[k] = clustered ? clustered_code(r, fb, center_b, wb) : random_code(r, fb);
  }
  if (mode == 2) {  // cancelling pairs: (a, b), (-a, b)
    for (int k = 1; k < L; k += 2)
      if (!chance(r, 5)) {
        ca[k] = ca[k - 1] ^ sign_bit(fa);
        cb[k] = cb[k - 1];
      }
  } else if (mode == 3) {  // zero-heavy
    static const double kP[] = {0.5, 0.9, 1.0};
    const double p = kP[uni(r, 0, 2)];
    for (int k = 0; k < L; ++k) {
      if (unit(r) < p) ca[k] = (r() & 1) ? sign_bit(fa) : 0u;
      if (unit(r) < p * 0.5) cb[k] = (r() & 1) ? sign_bit(fb) : 0u;
    }
  } else if (mode == 4) {  // every product -0 (or nearly): one side zero with the opposite sign
    const bool zero_a = r() & 1;
    for (int k = 0; k < L; ++k) {
      if (chance(r, 40)) continue;
      if (zero_a)
        ca[k] = (cb[k] & sign_bit(fb)) ? 0u : sign_bit(fa);
      else
        cb[k] = (ca[k] & sign_bit(fa)) ? 0u : sign_bit(fb);
    }
  } else if (mode == 5) {  // subnormal-heavy
    for (int k = 0; k < L; ++k) {
      if (!chance(r, 3)) ca[k] = make_code(fa, r() & 1, uni(r, 0, 1), static_cast<uint32_t>(r()));
      if (!chance(r, 3)) cb[k] = make_code(fb, r() & 1, uni(r, 0, 1), static_cast<uint32_t>(r()));
    }
  } else if (mode == 6) {  // uniform with zeros and subnormals sprinkled
    for (int k = 0; k < L; ++k) {
      if (chance(r, 10)) ca[k] = (r() & 1) ? sign_bit(fa) : 0u;
      if (chance(r, 10)) cb[k] = make_code(fb, r() & 1, 0, static_cast<uint32_t>(r()));
    }
  }
  // no specials unless asked: redraw them as random finite codes
  for (int k = 0; k < L; ++k) {
    while (is_special(fa, ca[k])) ca[k] = random_code(r, fa);
    while (is_special(fb, cb[k])) cb[k] = random_code(r, fb);
  }
  if (specials) {
    const int n = uni(r, 1, 3);
    for (int i = 0; i < n; ++i) {
      const int k = uni(r, 0, L - 1);
      const bool on_a = r() & 1;
      const OpFmt& f = on_a ? fa : fb;
      uint32_t code;
      const int me = max_exp_field(f);
      if (f.has_inf && !chance(r, 3)) {
        code = make_code(f, r() & 1, me, 0);  // ±Inf
      } else if (f.has_inf) {
        code =
            make_code(f, r() & 1, me, 1u + static_cast<uint32_t>(r() % ((1u << f.man_bits) - 1)));
      } else {
        code = make_code(f, r() & 1, me, 0x7);  // E4M3 NaN
      }
      (on_a ? ca[k] : cb[k]) = code;
      if (chance(r, 3)) {  // Inf * 0
        const OpFmt& g = on_a ? fb : fa;
        (on_a ? cb[k] : ca[k]) = (r() & 1) ? sign_bit(g) : 0u;
      }
    }
  }
}

enum class TInstr { Bf16, Fp16, Fp8Hopper, Fp8Blackwell };

struct TSpec {
  const char* name;
  int L;
  int F;
  int out_man_bits;
};
TSpec tspec(TInstr i) {
  switch (i) {
    case TInstr::Bf16:
      return {"tfdpa_bf16", 16, 25, 23};
    case TInstr::Fp16:
      return {"tfdpa_fp16", 16, 25, 23};
    case TInstr::Fp8Hopper:
      return {"tfdpa_fp8_hopper", 32, 13, 13};
    case TInstr::Fp8Blackwell:
      return {"tfdpa_fp8_blackwell", 32, 25, 23};
  }
  return {};
}

uint32_t fast_tfdpa(TInstr i, const float* a, const float* b, float c, const OpFmt& fa,
                    const OpFmt& fb) {
  switch (i) {
    case TInstr::Bf16:
      return bits_of(tfdpa_bf16(a, b, c));
    case TInstr::Fp16:
      return bits_of(tfdpa_fp16(a, b, c));
    case TInstr::Fp8Hopper:
      return bits_of(tfdpa_fp8_hopper(a, b, c, fa.fast, fb.fast));
    case TInstr::Fp8Blackwell:
      return bits_of(tfdpa_fp8_blackwell(a, b, c, fa.fast, fb.fast));
  }
  return 0;
}

struct Coverage {
  long cases = 0, special = 0, nan = 0, inf = 0, pos_zero = 0, neg_zero = 0, subnormal = 0,
       truncated = 0, c_truncated = 0, zero_sum = 0, underflow = 0;
  void add(uint32_t res, const ref::Info& in) {
    ++cases;
    special += in.special;
    truncated += in.truncated;
    c_truncated += in.c_truncated;
    zero_sum += in.zero_sum;
    underflow += in.underflow_to_zero;
    const uint32_t a = res & 0x7FFFFFFFu;
    if (a > 0x7F800000u)
      ++nan;
    else if (a == 0x7F800000u)
      ++inf;
    else if (res == 0)
      ++pos_zero;
    else if (res == 0x80000000u)
      ++neg_zero;
    else if (a < 0x00800000u)
      ++subnormal;
  }
  void print(const char* what) const {
    std::printf(
        "[ %s ] %ld cases: special %ld, NaN %ld, Inf %ld, +0 %ld, -0 %ld, subnormal %ld, "
        "truncation dropped bits %ld (C %ld), exact zero sums %ld, underflow to 0 %ld\n",
        what, cases, special, nan, inf, pos_zero, neg_zero, subnormal, truncated, c_truncated,
        zero_sum, underflow);
  }
  // Every corner the generators aim at was reached a fair number of times.
  void expect_reached(bool can_underflow) const {
    EXPECT_GT(nan, cases / 1000);
    EXPECT_GT(inf, cases / 1000);
    EXPECT_GT(pos_zero, cases / 1000);
    EXPECT_GT(neg_zero, cases / 1000);
    EXPECT_GT(subnormal, cases / 2000);
    EXPECT_GT(truncated, cases / 4);
    EXPECT_GT(c_truncated, cases / 20);
    EXPECT_GT(zero_sum, cases / 1000);
    if (can_underflow) {
      EXPECT_GT(underflow, 0);
    }
  }
};

constexpr int kMaxReported = 5;

void run_tfdpa_differential(TInstr instr, long n_cases, uint64_t seed) {
  const TSpec sp = tspec(instr);
  Rng r(seed);
  uint32_t ca[32], cb[32];
  float a[32], b[32];
  Coverage cov;
  int mismatches = 0;
  for (long i = 0; i < n_cases && mismatches < kMaxReported; ++i) {
    const OpFmt* fa;
    const OpFmt* fb;
    if (instr == TInstr::Bf16)
      fa = fb = &kBf16;
    else if (instr == TInstr::Fp16)
      fa = fb = &kFp16;
    else {
      fa = (r() & 1) ? &kE4M3 : &kE5M2;
      fb = (r() & 1) ? &kE4M3 : &kE5M2;
    }
    const bool specials = chance(r, 25);
    gen_tfdpa_codes(r, *fa, *fb, sp.L, ca, cb, specials);
    double approx = 0.0;
    int e_ref = -140;
    for (int k = 0; k < sp.L; ++k) {
      a[k] = fa->decode(ca[k]);
      b[k] = fb->decode(cb[k]);
      const double p = static_cast<double>(a[k]) * b[k];
      approx += p;
      if (p != 0.0 && std::isfinite(p)) e_ref = std::max(e_ref, std::ilogb(p));
    }
    if (e_ref == -140) e_ref = uni(r, -150, 10);
    const uint32_t c_bits = gen_c(r, e_ref, approx);
    const float c = float_of(c_bits);
    ref::Info info;
    const uint32_t want =
        ref::tfdpa(sp.L, a, b, c, fa->emin, fb->emin, sp.F, sp.out_man_bits, &info);
    const uint32_t got = fast_tfdpa(instr, a, b, c, *fa, *fb);
    cov.add(want, info);
    if (want != got) {
      ++mismatches;
      std::ostringstream o;
      const int digits = (total_bits(*fa) + 3) / 4;
      o << sp.name << " mismatch (case " << i << ", seed " << seed << ")\n  formats a=" << fa->name
        << " b=" << fb->name << "\n  a codes:";
      for (int k = 0; k < sp.L; ++k) {
        char buf[8];
        std::snprintf(buf, sizeof buf, " %0*X", digits, ca[k]);
        o << buf;
      }
      o << "\n  b codes:";
      for (int k = 0; k < sp.L; ++k) {
        char buf[8];
        std::snprintf(buf, sizeof buf, " %0*X", (total_bits(*fb) + 3) / 4, cb[k]);
        o << buf;
      }
      o << "\n  c = " << describe_bits(c_bits) << "\n  reference " << describe_bits(want)
        << "\n  fast      " << describe_bits(got);
      ADD_FAILURE() << o.str();
    }
  }
  EXPECT_EQ(mismatches, 0) << "stopped after " << kMaxReported << " mismatches";
  cov.print(sp.name);
  if (mismatches == 0) cov.expect_reached(instr == TInstr::Bf16);
}

// ---- GST-FDPA generator ----------------------------------------------------------------------

// 16 codes of one group for a and b.
void gen_group(Rng& r, int mode, uint8_t* a, uint8_t* b) {
  auto any = [&] { return static_cast<uint8_t>(r() & 0xF); };
  auto zero = [&] { return static_cast<uint8_t>((r() & 1) ? 8 : 0); };
  switch (mode) {
    case 0:  // uniform
      for (int k = 0; k < 16; ++k) a[k] = any(), b[k] = any();
      break;
    case 1: {  // zero-heavy
      static const double kP[] = {0.5, 0.8, 0.95};
      const double p = kP[uni(r, 0, 2)];
      for (int k = 0; k < 16; ++k) {
        a[k] = unit(r) < p ? zero() : any();
        b[k] = unit(r) < p * 0.5 ? zero() : any();
      }
      break;
    }
    case 2:  // all codes zero, random signs
      for (int k = 0; k < 16; ++k) a[k] = zero(), b[k] = zero();
      break;
    case 3: {  // every product -0: one side zero with the opposite sign
      const bool za = r() & 1;
      for (int k = 0; k < 16; ++k) {
        const uint8_t x = any();
        const uint8_t z = static_cast<uint8_t>((x & 8) ^ 8);
        a[k] = za ? z : x;
        b[k] = za ? x : z;
      }
      break;
    }
    case 4:    // exactly cancelling pairs
    case 5: {  // nearly cancelling
      for (int j = 0; j < 8; ++j) {
        const uint8_t x = any(), y = any();
        a[2 * j] = x, b[2 * j] = y;
        a[2 * j + 1] = static_cast<uint8_t>(x ^ 8), b[2 * j + 1] = y;
      }
      if (mode == 5) {
        const int k = uni(r, 0, 15);
        a[k] = any();
      }
      break;
    }
    case 6:  // large magnitudes (±4, ±6), sometimes all +6*+6 = 576
      if (chance(r, 4)) {
        for (int k = 0; k < 16; ++k) a[k] = b[k] = 7;
      } else {
        static const uint8_t kBig[] = {6, 7, 14, 15};
        for (int k = 0; k < 16; ++k) a[k] = kBig[uni(r, 0, 3)], b[k] = kBig[uni(r, 0, 3)];
      }
      break;
    default: {  // one nonzero product among zeros
      for (int k = 0; k < 16; ++k) a[k] = zero(), b[k] = zero();
      const int k = uni(r, 0, 15);
      a[k] = static_cast<uint8_t>(1 + uni(r, 0, 6) + ((r() & 1) ? 8 : 0));
      b[k] = static_cast<uint8_t>(1 + uni(r, 0, 6) + ((r() & 1) ? 8 : 0));
      break;
    }
  }
}

uint8_t gen_ue4m3(Rng& r, int mode, int center, int w) {
  const uint8_t sgn = (r() & 1) ? 0x80 : 0x00;
  switch (mode) {
    case 0:
      return static_cast<uint8_t>(r());
    case 1: {
      const int ef = std::clamp(center + uni(r, -w, w), 0, 15);
      return static_cast<uint8_t>(sgn | (ef << 3) | (r() & 7));
    }
    case 2:
      switch (uni(r, 0, 5)) {
        case 0:
          return sgn;  // zero
        case 1:
          return static_cast<uint8_t>(sgn | uni(r, 1, 7));  // subnormal
        case 2:
          return static_cast<uint8_t>(sgn | uni(r, 0x70, 0x7E));  // huge
        case 3:
          return static_cast<uint8_t>(sgn | 0x38);  // 1.0
        case 4:
          return static_cast<uint8_t>(sgn | uni(r, 0x08, 0x0F));  // smallest normals
        default:
          return static_cast<uint8_t>(r());
      }
    default:
      return static_cast<uint8_t>(sgn | (center << 3) | (center & 7));  // one value for all
  }
}

uint8_t gen_ue8m0(Rng& r, int mode, int center, int w) {
  switch (mode) {
    case 0:
      return static_cast<uint8_t>(r());
    case 1:
      return static_cast<uint8_t>(std::clamp(center + uni(r, -w, w), 0, 254));
    case 2: {
      static const uint8_t kX[] = {0x00, 0x01, 0x02, 0x7F, 0x80, 0xFD, 0xFE};
      return chance(r, 3) ? static_cast<uint8_t>(r()) : kX[uni(r, 0, 6)];
    }
    default:
      return static_cast<uint8_t>(std::clamp(center + uni(r, -w, w), 0, 254));
  }
}

uint32_t fast_gst(const uint8_t* ap, const uint8_t* bp, const uint8_t* sfa, const uint8_t* sfb,
                  ScaleKind kind, uint32_t c_bits) {
  return gst_fdpa_fp4_bits(ap, bp, sfa, sfb, kind, float_of(c_bits));
}

void run_gst_differential(ScaleKind kind, long n_cases, uint64_t seed) {
  Rng r(seed);
  uint8_t ca[64], cb[64], ap[32], bp[32], sfa[4], sfb[4];
  Coverage cov;
  int mismatches = 0;
  const bool ue4m3 = kind == ScaleKind::UE4M3_16;
  const int n_used = kind == ScaleKind::UE8M0_32 ? 2 : 4;
  static const int kW[] = {0, 0, 1, 2, 3, 4, 8, 20};
  for (long i = 0; i < n_cases && mismatches < kMaxReported; ++i) {
    // codes
    const bool same_mode = r() & 1;
    const int mode0 = uni(r, 0, 7);
    for (int g = 0; g < 4; ++g)
      gen_group(r, same_mode ? mode0 : uni(r, 0, 7), ca + 16 * g, cb + 16 * g);
    pack64(ca, ap);
    pack64(cb, bp);
    // scales
    const int smode = uni(r, 0, 3);
    const int wa = kW[uni(r, 0, 7)], wb = kW[uni(r, 0, 7)];
    int center_a, center_b;
    if (ue4m3) {
      center_a = uni(r, 0, 15), center_b = uni(r, 0, 15);
    } else if (smode == 3) {  // sum of the two exponents anywhere in [-254, 254]
      const int target = uni(r, 0, 508);
      center_a = uni(r, std::max(0, target - 254), std::min(254, target));
      center_b = target - center_a;
    } else {
      center_a = uni(r, 0, 254), center_b = uni(r, 0, 254);
    }
    for (int j = 0; j < 4; ++j) {
      if (ue4m3) {
        sfa[j] = gen_ue4m3(r, smode, center_a, wa);
        sfb[j] = gen_ue4m3(r, smode, center_b, wb);
      } else {
        sfa[j] = gen_ue8m0(r, smode, center_a, wa);
        sfb[j] = gen_ue8m0(r, smode, center_b, wb);
      }
    }
    // NaN scales only occasionally (unused 32-block bytes 2, 3 keep anything, 0xFF included)
    for (int j = 0; j < n_used; ++j) {
      if (ue4m3) {
        while ((sfa[j] & 0x7F) == 0x7F) sfa[j] = static_cast<uint8_t>(r());
        while ((sfb[j] & 0x7F) == 0x7F) sfb[j] = static_cast<uint8_t>(r());
      } else {
        while (sfa[j] == 0xFF) sfa[j] = static_cast<uint8_t>(r());
        while (sfb[j] == 0xFF) sfb[j] = static_cast<uint8_t>(r());
      }
    }
    if (kind == ScaleKind::UE8M0_32 && chance(r, 4)) sfa[2 + (r() & 1)] = 0xFF;
    if (chance(r, 60)) {
      uint8_t* s = (r() & 1) ? sfa : sfb;
      s[uni(r, 0, n_used - 1)] = ue4m3 ? static_cast<uint8_t>(0x7F | (r() & 0x80)) : 0xFF;
    }
    // C near the group terms (a double estimate, generator only)
    double approx = 0.0;
    int e_ref = -1000;
    for (int g = 0; g < 4; ++g) {
      const int idx = kind == ScaleKind::UE8M0_32 ? g / 2 : g;
      const ref::Scale sa = ref::scale_value(sfa[idx], kind), sb = ref::scale_value(sfb[idx], kind);
      if (sa.nan || sb.nan) continue;
      double p = 0.0;
      for (int k = 16 * g; k < 16 * g + 16; ++k)
        p += e2m1_to_f32(ca[k]) * static_cast<double>(e2m1_to_f32(cb[k]));
      const double t = p * std::ldexp(static_cast<double>(sa.m * sb.m), sa.e + sb.e);
      approx += t;
      if (t != 0.0)
        e_ref = std::max(e_ref, std::ilogb(t));
      else if (!sa.zero && !sb.zero)
        e_ref = std::max(e_ref, sa.E + sb.E);
    }
    if (e_ref == -1000) e_ref = uni(r, -160, 20);
    e_ref = std::clamp(e_ref, -170, 140);
    const uint32_t c_bits = gen_c(r, e_ref, approx);

    ref::Info info;
    const uint32_t want = ref::gst(ap, bp, sfa, sfb, kind, c_bits, &info);
    const uint32_t got = fast_gst(ap, bp, sfa, sfb, kind, c_bits);
    cov.add(want, info);
    if (want != got) {
      ++mismatches;
      ADD_FAILURE() << "gst_fdpa_fp4_bits mismatch (case " << i << ", seed " << seed << ", kind "
                    << kind_name(kind) << ")\n  a_packed: " << hex_bytes(ap, 32)
                    << "\n  b_packed: " << hex_bytes(bp, 32) << "\n  sfa: " << hex_bytes(sfa, 4)
                    << "\n  sfb: " << hex_bytes(sfb, 4) << "\n  c = " << describe_bits(c_bits)
                    << "\n  reference " << describe_bits(want) << "\n  fast      "
                    << describe_bits(got);
    }
  }
  EXPECT_EQ(mismatches, 0) << "stopped after " << kMaxReported << " mismatches";
  cov.print(kind_name(kind));
  if (mismatches == 0) cov.expect_reached(!ue4m3);
}

// ================================================================================================
// Hand-checked cases of the reference itself (expected values worked out by hand from §7)
// ================================================================================================

// E2M1 codes of the values used below
constexpr uint8_t kP05 = 0x1, kP1 = 0x2, kP4 = 0x6, kP6 = 0x7;
constexpr uint8_t kN05 = 0x9, kN1 = 0xA, kN4 = 0xE;

struct Chunk {
  uint8_t codes_a[64] = {};
  uint8_t codes_b[64] = {};
  uint8_t a[32], b[32];
  void set(int k, uint8_t ca, uint8_t cb) {
    codes_a[k] = ca;
    codes_b[k] = cb;
  }
  void pack() {
    pack64(codes_a, a);
    pack64(codes_b, b);
  }
};

uint32_t b32(float x) { return bits_of(x); }
uint8_t ue8(int e) { return static_cast<uint8_t>(e + 127); }

TEST(MmaReference, Gst_WorkedVectorAndProbes_Reference) {
  const ScaleKind K = ScaleKind::UE8M0_16;
  {  // worked vector -> -0.875
    Chunk ch;
    ch.set(0, kN4, kP4);
    ch.set(16, kN1, kP1);
    ch.set(17, kN1, kP05);
    ch.set(18, kN05, kP05);
    ch.pack();
    const uint8_t sfa[4] = {ue8(11), ue8(0), ue8(0), ue8(0)};
    const uint8_t sfb[4] = {ue8(8), ue8(-1), ue8(0), ue8(0)};
    EXPECT_EQ(ref::gst(ch.a, ch.b, sfa, sfb, K, b32(8388608.0f)), b32(-0.875f));
    EXPECT_EQ(fast_gst(ch.a, ch.b, sfa, sfb, K, b32(8388608.0f)), b32(-0.875f));
  }
  // Probe 1: +1 in g0, -1 in g2 at exponent 0, +1 in g1 at -35 -> 2^-35; at -36 -> +0
  for (int e1 : {-35, -36}) {
    Chunk ch;
    ch.set(0, kP1, kP1);
    ch.set(16, kP1, kP1);
    ch.set(32, kN1, kP1);
    ch.pack();
    const uint8_t sfa[4] = {ue8(0), ue8(e1), ue8(0), ue8(0)};
    const uint8_t sfb[4] = {ue8(0), ue8(0), ue8(0), ue8(0)};
    EXPECT_EQ(ref::gst(ch.a, ch.b, sfa, sfb, K, 0u), e1 == -35 ? b32(std::ldexp(1.0f, -35)) : 0u);
  }
  {  // Probe 2: g0 = 0.25 - 0.25 at exponent 0, +1 in g1 at -36 -> +0
    Chunk ch;
    ch.set(0, kP05, kP05);
    ch.set(1, kN05, kP05);
    ch.set(16, kP1, kP1);
    ch.pack();
    const uint8_t sfa[4] = {ue8(0), ue8(-36), ue8(0), ue8(0)};
    const uint8_t sfb[4] = {ue8(0), ue8(0), ue8(0), ue8(0)};
    EXPECT_EQ(ref::gst(ch.a, ch.b, sfa, sfb, K, 0u), 0u);
    // without the cancelled group, the 2^-36 survives
    Chunk ch2;
    ch2.set(16, kP1, kP1);
    ch2.pack();
    EXPECT_EQ(ref::gst(ch2.a, ch2.b, sfa, sfb, K, 0u), b32(std::ldexp(1.0f, -36)));
  }
  {  // Probe 3: g0 = +36, g1 = -36 (exponent 0), +1 in g2 at -35 -> 2^-35
    Chunk ch;
    ch.set(0, kP6, kP6);
    ch.set(16, kP6 | 8, kP6);
    ch.set(32, kP1, kP1);
    ch.pack();
    const uint8_t sfa[4] = {ue8(0), ue8(0), ue8(-35), ue8(0)};
    const uint8_t sfb[4] = {ue8(0), ue8(0), ue8(0), ue8(0)};
    EXPECT_EQ(ref::gst(ch.a, ch.b, sfa, sfb, K, 0u), b32(std::ldexp(1.0f, -35)));
  }
  {  // Probe 4: c = 1 + 2^-23, +1 in g0, -1 in g1 at exponent 13 -> 1.0
    Chunk ch;
    ch.set(0, kP1, kP1);
    ch.set(16, kN1, kP1);
    ch.pack();
    const uint8_t sfa[4] = {ue8(13), ue8(13), ue8(0), ue8(0)};
    const uint8_t sfb[4] = {ue8(0), ue8(0), ue8(0), ue8(0)};
    EXPECT_EQ(ref::gst(ch.a, ch.b, sfa, sfb, K, b32(1.0f + std::ldexp(1.0f, -23))), b32(1.0f));
  }
}

TEST(MmaReference, Gst_ScaleDecodingAndZeroRules_Reference) {
  {  // UE8M0 byte 0 is 2^-127 (not zero): +1 * 2^-127 * 2^0 = 2^-127 = FP32 0x00400000
    Chunk ch;
    ch.set(3, kP1, kP1);
    ch.pack();
    const uint8_t sfa[4] = {0x00, 0x7F, 0x7F, 0x7F}, sfb[4] = {0x7F, 0x7F, 0x7F, 0x7F};
    EXPECT_EQ(ref::gst(ch.a, ch.b, sfa, sfb, ScaleKind::UE8M0_16, 0u), 0x00400000u);
  }
  {  // UE4M3 subnormal scales read E = -6: T0 = +2^-20, T1 = -2^-20 (scales 0x01 = 2^-9 each,
     // e_g = -12), C = 2^-47 + 2^-48: grid 2^(-12-35) keeps only 2^-47. (Reading floor(log2) = -9
     // instead would put the grid at 2^-53 and keep 2^-48 too.)
    Chunk ch;
    ch.set(0, kP05, kP05);
    ch.set(16, kN05, kP05);
    ch.pack();
    const uint8_t s[4] = {0x01, 0x81, 0x38, 0x38};  // sign bit masked: 0x81 == 0x01
    const float c = std::ldexp(1.0f, -47) + std::ldexp(1.0f, -48);
    EXPECT_EQ(ref::gst(ch.a, ch.b, s, s, ScaleKind::UE4M3_16, b32(c)), b32(std::ldexp(1.0f, -47)));
  }
  {  // UE4M3: sign masked (0xB8 is 1.0), 0x7F/0xFF NaN, 0x00/0x80 zero
    Chunk ch;
    ch.set(0, kP1, kP1);
    ch.pack();
    const uint8_t one[4] = {0xB8, 0x38, 0x38, 0x38};
    EXPECT_EQ(ref::gst(ch.a, ch.b, one, one, ScaleKind::UE4M3_16, 0u), b32(1.0f));
    const uint8_t nan_s[4] = {0x38, 0x38, 0x38, 0xFF};  // NaN in a group with no products: NaN
    EXPECT_EQ(ref::gst(ch.a, ch.b, nan_s, one, ScaleKind::UE4M3_16, 0u), 0x7FFFFFFFu);
    const uint8_t zero_s[4] = {0x80, 0x38, 0x38, 0x38};
    EXPECT_EQ(ref::gst(ch.a, ch.b, zero_s, one, ScaleKind::UE4M3_16, b32(-0.0f)), 0u);
    // negative group under a zero scale stays -0; with C = -0 the result is -0
    Chunk n;
    for (int k = 1; k < 64; ++k) n.set(k, 0x0, 0x8);  // every other product -0
    n.set(0, kN1, kP1);
    n.pack();
    EXPECT_EQ(ref::gst(n.a, n.b, zero_s, one, ScaleKind::UE4M3_16, b32(-0.0f)), 0x80000000u);
    EXPECT_EQ(ref::gst(n.a, n.b, zero_s, one, ScaleKind::UE4M3_16, b32(0.0f)), 0u);
  }
  {  // all products -0 (codes +0 x -0) and C = -0 -> -0; a cancelled group -> +0
    Chunk z;
    for (int k = 0; k < 64; ++k) z.set(k, 0x0, 0x8);
    z.pack();
    const uint8_t s[4] = {0x7F, 0x7F, 0x7F, 0x7F};
    EXPECT_EQ(ref::gst(z.a, z.b, s, s, ScaleKind::UE8M0_16, b32(-0.0f)), 0x80000000u);
    EXPECT_EQ(ref::gst(z.a, z.b, s, s, ScaleKind::UE8M0_16, b32(0.0f)), 0u);
    z.set(5, 0x0, 0x0);  // one +0 product
    z.pack();
    EXPECT_EQ(ref::gst(z.a, z.b, s, s, ScaleKind::UE8M0_16, b32(-0.0f)), 0u);
  }
  {  // nonzero sum underflowing under RZ keeps its sign: -0.25 * 2^-127 * 2^-25 = -2^-154
    Chunk ch;
    ch.set(0, kN05, kP05);
    ch.pack();
    const uint8_t sfa[4] = {ue8(-127), 0x7F, 0x7F, 0x7F}, sfb[4] = {ue8(-25), 0x7F, 0x7F, 0x7F};
    EXPECT_EQ(ref::gst(ch.a, ch.b, sfa, sfb, ScaleKind::UE8M0_16, b32(0.0f)), 0x80000000u);
  }
  {  // UE8M0_32: groups 2, 3 use byte 1; bytes 2, 3 unused (0xFF there is no NaN)
    Chunk ch;
    ch.set(40, kP1, kP1);
    ch.set(63, kP1, kP1);
    ch.pack();
    const uint8_t sfa[4] = {ue8(0), ue8(3), 0xFF, 0xFF}, sfb[4] = {ue8(0), ue8(0), 0xFF, 0xFF};
    EXPECT_EQ(ref::gst(ch.a, ch.b, sfa, sfb, ScaleKind::UE8M0_32, 0u), b32(16.0f));
  }
  {  // overflow -> Inf: 576 * 2^127 * 2^127; C = -Inf -> -Inf; NaN C -> NaN
    Chunk ch;
    for (int k = 0; k < 16; ++k) ch.set(k, kP6, kP6);
    ch.pack();
    const uint8_t s[4] = {0xFE, 0x7F, 0x7F, 0x7F};
    EXPECT_EQ(ref::gst(ch.a, ch.b, s, s, ScaleKind::UE8M0_16, 0u), 0x7F800000u);
    EXPECT_EQ(ref::gst(ch.a, ch.b, s, s, ScaleKind::UE8M0_16, 0xFF800000u), 0xFF800000u);
    EXPECT_EQ(ref::gst(ch.a, ch.b, s, s, ScaleKind::UE8M0_16, 0x7FC00001u), 0x7FFFFFFFu);
  }
}

TEST(MmaReference, Tfdpa_HandChecked_Reference) {
  float a[32] = {}, b[32] = {};
  auto bf16 = [](int L, const float* x, const float* y, float c) {
    return ref::tfdpa(L, x, y, c, -126, -126, 25, 23);
  };
  // BF16: a term below the grid 2^(0-25) is dropped; on the grid it survives when FP32 has room
  a[0] = 1.0f, b[0] = 1.0f;
  a[1] = -1.0f, b[1] = 1.0f;
  a[2] = std::ldexp(1.0f, -24), b[2] = 1.5f;  // 2^-24 + 2^-25: on the grid
  EXPECT_EQ(bf16(16, a, b, 0.0f), b32(std::ldexp(1.5f, -24)));
  a[2] = std::ldexp(1.0f, -25);  // 2^-25 + 2^-26: truncated to 2^-25
  EXPECT_EQ(bf16(16, a, b, 0.0f), b32(std::ldexp(1.0f, -25)));
  // negative terms truncate toward zero: 1 - (1.5 * 2^-25) -> 1 - 2^-25 -> RZ -> 1 - 2^-24
  a[1] = 0.0f;
  a[2] = -std::ldexp(1.0f, -25);
  EXPECT_EQ(bf16(16, a, b, 0.0f), 0x3F7FFFFFu);
  // FP16 subnormal operand reads E = -14: 2^-24 * 1 reads -14, C = 2^-40 + 2^-45 is below the grid
  // 2^(-14-25) and vanishes (reading -24 would keep it)
  for (auto& x : a) x = 0.0f;
  for (auto& x : b) x = 0.0f;
  a[0] = std::ldexp(1.0f, -24), b[0] = 1.0f;
  const float c16 = std::ldexp(1.0f, -40) + std::ldexp(1.0f, -45);
  EXPECT_EQ(ref::tfdpa(16, a, b, c16, -14, -14, 25, 23), b32(std::ldexp(1.0f, -24)));
  // FP8 Hopper: 32 x 1.875^2 = 112.5, + C = 2^-13 on the grid; RZ to 13 fraction bits drops it
  for (int k = 0; k < 32; ++k) a[k] = b[k] = 1.875f;
  const float c13 = std::ldexp(1.0f, -13);
  EXPECT_EQ(ref::tfdpa(32, a, b, c13, -6, -6, 13, 13), b32(112.5f));
  EXPECT_EQ(ref::tfdpa(32, a, b, c13, -6, -6, 25, 23), b32(112.5f + c13));  // Blackwell keeps it
  EXPECT_EQ(ref::tfdpa(32, a, b, std::ldexp(1.0f, -7), -6, -6, 13, 13), b32(112.5f + 0.0078125f));
  // FP8 Hopper subnormal outputs on the grid 2^-139: C = 2^-130 + 2^-140 -> 2^-130
  for (auto& x : a) x = 0.0f;
  EXPECT_EQ(ref::tfdpa(32, a, b, float_of(0x00080200u), -6, -14, 13, 13), 0x00080000u);
  EXPECT_EQ(ref::tfdpa(32, a, b, float_of(0x00080400u), -6, -14, 13, 13), 0x00080400u);
  EXPECT_EQ(ref::tfdpa(32, a, b, float_of(0x00080200u), -6, -14, 25, 23), 0x00080200u);
  // signs of zeros: -2^-133 * 2^-20 with C = +0 is a nonzero sum (grid 2^(-133-25)) that RZ
  // underflows: -0. All products -0 and C = -0: -0; C = +0: +0. 1 - 1 with C = -0: +0.
  for (auto& x : b) x = 0.0f;
  a[0] = -std::ldexp(1.0f, -133), b[0] = std::ldexp(1.0f, -20);
  EXPECT_EQ(bf16(16, a, b, 0.0f), 0x80000000u);
  a[0] = 0.0f;
  for (int k = 0; k < 16; ++k) a[k] = -0.0f, b[k] = (k % 2) ? 3.0f : 0.0f;
  EXPECT_EQ(bf16(16, a, b, -0.0f), 0x80000000u);
  EXPECT_EQ(bf16(16, a, b, 0.0f), 0u);
  a[0] = 1.0f, b[0] = 1.0f, a[1] = -1.0f, b[1] = 1.0f;
  EXPECT_EQ(bf16(16, a, b, -0.0f), 0u);
  // specials
  for (auto& x : a) x = 0.0f;
  for (auto& x : b) x = 0.0f;
  a[0] = INFINITY, b[0] = 2.0f;
  EXPECT_EQ(bf16(16, a, b, 1.0f), 0x7F800000u);
  EXPECT_EQ(bf16(16, a, b, -INFINITY), 0x7FFFFFFFu);  // +Inf with -Inf
  b[0] = 0.0f;
  EXPECT_EQ(bf16(16, a, b, 1.0f), 0x7FFFFFFFu);  // Inf * 0
  a[0] = -2.0f, b[0] = 3.0f;
  EXPECT_EQ(bf16(16, a, b, -INFINITY), 0xFF800000u);
  EXPECT_EQ(bf16(16, a, b, std::numeric_limits<float>::quiet_NaN()), 0x7FFFFFFFu);
  // overflow -> Inf even under RZ: 2^64 * 2^64 = 2^128; 2^127 + C = 2^127
  a[0] = b[0] = std::ldexp(1.0f, 64);
  EXPECT_EQ(bf16(16, a, b, 0.0f), 0x7F800000u);
  a[0] = -a[0];
  EXPECT_EQ(bf16(16, a, b, 0.0f), 0xFF800000u);
  a[0] = std::ldexp(1.0f, 127), b[0] = 1.0f;
  EXPECT_EQ(bf16(16, a, b, std::ldexp(1.0f, 127)), 0x7F800000u);
  EXPECT_EQ(bf16(16, a, b, std::ldexp(-1.0f, 126)), b32(std::ldexp(1.0f, 126)));
  EXPECT_EQ(bf16(16, a, b, std::numeric_limits<float>::max()), 0x7F800000u);
}

TEST(MmaReference, FixedPoint_SelfCheck) {
  using ref::Fixed;
  Fixed x = Fixed::dyadic(3, -300, false);
  x += Fixed::dyadic(1, 250, true);  // 3*2^-300 - 2^250
  EXPECT_TRUE(x.is_neg());
  EXPECT_EQ(x.floor_log2(), 249);
  Fixed y = x;
  EXPECT_TRUE(y.truncate_toward_zero(0));  // toward zero: -(2^250 - 1)... -> -2^250 + 1
  Fixed z = Fixed::dyadic(1, 250, false);
  z += y;
  EXPECT_FALSE(z.is_zero());
  EXPECT_EQ(z.floor_log2(), 0);          // 2^250 - (2^250 - 1) = 1
  Fixed s = Fixed::dyadic(5, -2, true);  // -1.25
  s.scale(3, -250);                      // -3.75 * 2^-250
  EXPECT_EQ(s.floor_log2(), -249);
  EXPECT_EQ(s.magnitude_bits(-252, 4), 15u);  // 3.75 * 2^-250 = 15 * 2^-252
}

// ================================================================================================
// Differential tests on random bit patterns
// ================================================================================================

TEST(MmaReference, Gst_UE4M3_16_RandomBitPatterns_MatchFast) {
  run_gst_differential(ScaleKind::UE4M3_16, 400000, 0x6A57001ull);
}
TEST(MmaReference, Gst_UE8M0_16_RandomBitPatterns_MatchFast) {
  run_gst_differential(ScaleKind::UE8M0_16, 400000, 0x6A57002ull);
}
TEST(MmaReference, Gst_UE8M0_32_RandomBitPatterns_MatchFast) {
  run_gst_differential(ScaleKind::UE8M0_32, 400000, 0x6A57003ull);
}
TEST(MmaReference, Tfdpa_Bf16_RandomBitPatterns_MatchFast) {
  run_tfdpa_differential(TInstr::Bf16, 300000, 0x7F0A001ull);
}
TEST(MmaReference, Tfdpa_Fp16_RandomBitPatterns_MatchFast) {
  run_tfdpa_differential(TInstr::Fp16, 300000, 0x7F0A002ull);
}
TEST(MmaReference, Tfdpa_Fp8Hopper_RandomBitPatterns_MatchFast) {
  run_tfdpa_differential(TInstr::Fp8Hopper, 300000, 0x7F0A003ull);
}
TEST(MmaReference, Tfdpa_Fp8Blackwell_RandomBitPatterns_MatchFast) {
  run_tfdpa_differential(TInstr::Fp8Blackwell, 300000, 0x7F0A004ull);
}

}  // namespace
}  // namespace fp4sim
