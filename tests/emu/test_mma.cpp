// T-FDPA (BF16 instruction) and the 16-point RHT built on it (DESIGN.md §6, §7).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "emu/gst_fdpa_packed.hpp"
#include "emu/mma.hpp"
#include "emu/rht.hpp"
#include "emu/tfdpa_prepared.hpp"
#include "gpu/gst_fdpa_device.cuh"
#include "gpu/rht_device.cuh"
#include "tests/emu/test_util.hpp"

namespace fp4sim {
namespace {

using test::bits;
using test::from_bits;

// Independent slow reference of T-FDPA(16, 25, RZ) for finite BF16 inputs, in long double /
// double arithmetic: every product is exact in double (8-bit x 8-bit significands), truncation is
// std::trunc on the exact quotient by the grid, the sum is exact (< 2^53 grid units), and the
// final RZ to FP32 is done by rounding to nearest then stepping toward zero if that overshot.
float tfdpa_bf16_slow(const float* a, const float* b, float c) {
  auto E = [](float x, int emin) {
    if (x == 0.0f) return -133;
    return std::max(std::ilogb(x), emin);
  };
  int e_max = -133;
  bool all_neg_zero = true;
  for (int k = 0; k < 16; ++k) {
    const bool zero = a[k] == 0.0f || b[k] == 0.0f;
    if (!zero) e_max = std::max(e_max, E(a[k], -126) + E(b[k], -126));
    const bool neg = std::signbit(a[k]) != std::signbit(b[k]);
    if (!(zero && neg)) all_neg_zero = false;
  }
  if (c != 0.0f) e_max = std::max(e_max, E(c, -126));
  if (!(c == 0.0f && std::signbit(c))) all_neg_zero = false;
  const int grid = e_max - 25;
  long double sum = 0;
  for (int k = 0; k < 16; ++k) {
    const long double p = static_cast<long double>(a[k]) * b[k];
    sum += std::trunc(std::ldexp(p, -grid));
  }
  sum += std::trunc(std::ldexp(static_cast<long double>(c), -grid));
  if (sum == 0) return all_neg_zero ? -0.0f : 0.0f;
  const long double exact = std::ldexp(sum, grid);
  float f = static_cast<float>(exact);  // nearest
  if (std::fabs(static_cast<long double>(f)) > std::fabs(exact))
    f = std::nextafter(f, 0.0f);  // step toward zero
  if (std::fabs(exact) >= std::ldexp(1.0L, 128)) f = exact > 0 ? INFINITY : -INFINITY;
  return f;
}

float random_bf16(std::mt19937_64& rng, int spread) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_int_distribution<int> e(-spread, spread);
  float x = std::ldexp(n(rng), e(rng));
  if (rng() % 17 == 0) x = 0.0f;
  if (rng() % 31 == 0) x = -0.0f;
  if (rng() % 29 == 0) x = from_bits(static_cast<uint32_t>(rng() & 0x007F0000u));  // subnormal
  return bf16_round(x);
}

TEST(Tfdpa, Bf16_SimpleExactSums) {
  float a[16], b[16];
  for (int k = 0; k < 16; ++k) a[k] = b[k] = 1.0f;
  EXPECT_EQ(tfdpa_bf16(a, b, 0.0f), 16.0f);
  EXPECT_EQ(tfdpa_bf16(a, b, 1.0f), 17.0f);
}

TEST(Tfdpa, Bf16_SmallTermsTruncatedBelowGrid) {
  float a[16] = {}, b[16] = {};
  a[0] = 1.0f;
  b[0] = 1.0f;
  a[1] = std::ldexp(1.0f, -30);
  b[1] = 1.0f;  // below 2^(0-25): dropped
  EXPECT_EQ(tfdpa_bf16(a, b, 0.0f), 1.0f);
  a[1] = std::ldexp(1.0f, -25);  // on the grid, but RZ to FP32 drops it
  EXPECT_EQ(tfdpa_bf16(a, b, 0.0f), 1.0f);
  a[1] = std::ldexp(1.0f, -23);  // representable in the FP32 result
  EXPECT_EQ(tfdpa_bf16(a, b, 0.0f), 1.0f + std::ldexp(1.0f, -23));
  // -1 + tiny negative: truncation toward zero of each term, RZ of the sum
  a[0] = -1.0f;
  a[1] = -std::ldexp(1.0f, -24);
  EXPECT_EQ(tfdpa_bf16(a, b, 0.0f), -1.0f);  // RZ: -1 - 2^-24 -> -1
}

TEST(Tfdpa, Bf16_SignedZerosAndSpecials) {
  float a[16], b[16];
  for (int k = 0; k < 16; ++k) {
    a[k] = -0.0f;
    b[k] = 1.0f;
  }
  EXPECT_EQ(bits(tfdpa_bf16(a, b, -0.0f)), 0x80000000u);  // all terms -0
  EXPECT_EQ(bits(tfdpa_bf16(a, b, 0.0f)), 0u);            // C = +0
  a[0] = 1.0f;
  a[1] = -1.0f;
  EXPECT_EQ(bits(tfdpa_bf16(a, b, -0.0f)), 0u);  // cancellation -> +0
  a[0] = INFINITY;
  a[1] = 0.0f;
  EXPECT_EQ(bits(tfdpa_bf16(a, b, 0.0f)), 0x7F800000u);
  a[1] = -INFINITY;
  EXPECT_EQ(bits(tfdpa_bf16(a, b, 0.0f)), kCanonicalNaN);
  a[1] = 0.0f;
  b[0] = 0.0f;  // Inf * 0
  EXPECT_EQ(bits(tfdpa_bf16(a, b, 0.0f)), kCanonicalNaN);
  b[0] = 1.0f;
  a[0] = 1.0f;
  EXPECT_EQ(bits(tfdpa_bf16(a, b, NAN)), kCanonicalNaN);
  EXPECT_EQ(bits(tfdpa_bf16(a, b, -INFINITY)), 0xFF800000u);
}

TEST(Tfdpa, Bf16_OverflowToInfUnderRz) {
  float a[16] = {}, b[16] = {};
  a[0] = a[1] = bf16_round(3.0e38f);
  b[0] = b[1] = 1.0f;
  EXPECT_EQ(bits(tfdpa_bf16(a, b, 0.0f)), 0x7F800000u);
}

TEST(Tfdpa, Bf16_SubnormalOutputsKept) {
  float a[16] = {}, b[16] = {};
  a[0] = std::ldexp(1.0f, -70);
  b[0] = std::ldexp(1.0f, -70);  // 2^-140: FP32 subnormal
  EXPECT_EQ(tfdpa_bf16(a, b, 0.0f), std::ldexp(1.0f, -140));
}

TEST(Tfdpa, Bf16_MatchesSlowReferenceOnRandomInputs) {
  std::mt19937_64 rng(11);
  int n = 0;
  for (int trial = 0; trial < 200000; ++trial) {
    float a[16], b[16];
    const int spread = trial % 3 == 0 ? 2 : (trial % 3 == 1 ? 20 : 60);
    for (int k = 0; k < 16; ++k) {
      a[k] = random_bf16(rng, spread);
      b[k] = random_bf16(rng, spread);
    }
    const float c =
        trial % 4 == 0 ? 0.0f
                       : std::ldexp(std::normal_distribution<float>()(rng), (int)(rng() % 40) - 20);
    const float fast = tfdpa_bf16(a, b, c), slow = tfdpa_bf16_slow(a, b, c);
    ASSERT_EQ(bits(fast), bits(slow)) << "trial " << trial;
    ++n;
  }
  EXPECT_EQ(n, 200000);
}

TEST(Tfdpa, Bf16HostFastPathEqualsLiteral) {
  std::mt19937_64 rng(21);
  for (int trial = 0; trial < 1000000; ++trial) {
    float a[16], b[16];
    const int spread = trial % 4 == 0 ? 2 : (trial % 4 == 1 ? 20 : (trial % 4 == 2 ? 60 : 126));
    for (int k = 0; k < 16; ++k) {
      a[k] = random_bf16(rng, spread);
      b[k] = random_bf16(rng, spread);
    }
    if (trial % 1000 == 0) a[3] = INFINITY;
    if (trial % 1001 == 0) b[5] = NAN;
    float c = trial % 3 == 0
                  ? 0.0f
                  : std::ldexp(std::normal_distribution<float>()(rng), (int)(rng() % 80) - 40);
    if (trial % 997 == 0) c = -0.0f;
    if (trial % 991 == 0) c = test::from_bits(static_cast<uint32_t>(rng()));
    ASSERT_EQ(bits(tfdpa_bf16_host(a, b, c)), bits(tfdpa_bf16(a, b, c))) << "trial " << trial;
  }
}

TEST(Rht, SignVectorAndOrthogonality) {
  const int s[16] = {1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1};
  for (int i = 0; i < 16; ++i) EXPECT_EQ(rht_entry(i, 0), 0.25f * s[i]);
  // H H^T = I
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      double d = 0;
      for (int k = 0; k < 16; ++k) d += double(rht_entry(i, k)) * rht_entry(j, k);
      EXPECT_EQ(d, i == j ? 1.0 : 0.0);
    }
}

// rht16_abs_max's two results and those of the GPU amax pass's formulation (gpu/rht_device.cuh,
// here with the reference conversions) against the literal outputs and inputs: the NaN-ignoring
// max |y_j| and max |x_i|, as the amax passes fold them.
void expect_abs_max_matches(const uint16_t* x, const uint16_t* y_ref, int trial) {
  float want_y = 0.0f, want_x = 0.0f;
  for (int j = 0; j < 16; ++j) {
    want_y = fmax_nan_ignored(want_y, f32_abs(bf16_to_f32(y_ref[j])));
    want_x = fmax_nan_ignored(want_x, f32_abs(bf16_to_f32(x[j])));
  }
  float got_x = -1.0f, once_x = -1.0f, packed_x = -1.0f;
  const float got_y = rht16_abs_max(x, &got_x);
  const float once_y = gpu::rht16_abs_max_rounded_once(x, &once_x);
  uint32_t w[8];
  rht16_packed(x, w, &packed_x);
  ASSERT_EQ(f32_bits(got_y), f32_bits(want_y)) << "trial " << trial << ": max |y|";
  ASSERT_EQ(f32_bits(got_x), f32_bits(want_x)) << "trial " << trial << ": max |x| (rht16_abs_max)";
  ASSERT_EQ(f32_bits(once_y), f32_bits(want_y))
      << "trial " << trial << ": max |y| (rht16_abs_max_rounded_once)";
  ASSERT_EQ(f32_bits(once_x), f32_bits(want_x))
      << "trial " << trial << ": max |x| (rht16_abs_max_rounded_once)";
  ASSERT_EQ(f32_bits(packed_x), f32_bits(want_x))
      << "trial " << trial << ": max |x| (rht16_packed)";
}

TEST(Rht, FastPathEqualsLiteralTfdpa) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 300000; ++trial) {
    uint16_t x[16], y_fast[16], y_ref[16];
    const int spread = trial % 4 == 0 ? 1 : (trial % 4 == 1 ? 10 : (trial % 4 == 2 ? 40 : 130));
    for (int i = 0; i < 16; ++i) {
      x[i] = bf16_rne(random_bf16(rng, spread));
      if (trial % 97 == 0 && i == 3) x[i] = 0x7FC0;  // NaN
      if (trial % 89 == 0 && i == 5) x[i] = 0xFF80;  // -Inf
      if (trial % 83 == 0 && i == 7) x[i] = 0x7F80;  // +Inf
    }
    if (trial % 101 == 0)
      for (int i = 0; i < 16; ++i) x[i] = 0x8000;  // all -0
    rht16(x, y_fast);
    rht16_reference(x, y_ref);
    for (int j = 0; j < 16; ++j) ASSERT_EQ(y_fast[j], y_ref[j]) << "trial " << trial << " j " << j;
    ASSERT_NO_FATAL_FAILURE(expect_abs_max_matches(x, y_ref, trial));
  }
}

// Chunks whose largest input sits near either end of the BF16 range, where rht16 changes paths:
// every input below 2^-101 (integer terms), the grid below -126 or above 97 (general rounding),
// and wide spreads inside one chunk (terms truncated to 0).
TEST(Rht, FastPathEqualsLiteralTfdpaAtTheExtremes) {
  std::mt19937_64 rng(4);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (int trial = 0; trial < 200000; ++trial) {
    const int kind = trial % 4;
    // exponent window of the chunk: tiny (down to subnormals), huge, or tiny plus one large input
    const int lo = kind == 1 ? 100 : -140, hi = kind == 1 ? 127 : (kind == 0 ? -95 : -60);
    std::uniform_int_distribution<int> e(lo, hi);
    uint16_t x[16], y_fast[16], y_ref[16];
    for (int i = 0; i < 16; ++i) {
      float v = std::ldexp(n(rng), e(rng));
      if (rng() % 13 == 0) v = from_bits(static_cast<uint32_t>(rng() & 0x807F0000u));  // ±subnormal
      x[i] = bf16_rne(v);
    }
    if (kind == 3) x[rng() % 16] = bf16_rne(std::ldexp(n(rng), static_cast<int>(rng() % 40) - 20));
    rht16(x, y_fast);
    rht16_reference(x, y_ref);
    for (int j = 0; j < 16; ++j) ASSERT_EQ(y_fast[j], y_ref[j]) << "trial " << trial << " j " << j;
    ASSERT_NO_FATAL_FAILURE(expect_abs_max_matches(x, y_ref, trial));
  }
}

// Chunks whose largest input sits exactly at the edges of rht16_abs_max_rounded_once's common path
// (emax -99
// and 124 in, -100 and 125 out) and of the FMUL terms (emax -102 / -103), with the other inputs
// spread below it: all of rht16's forms against the literal T-FDPA.
TEST(Rht, PathBoundariesEqualLiteralTfdpa) {
  std::mt19937_64 rng(6);
  int checked = 0;
  for (int emax : {-104, -103, -102, -101, -100, -99, -98, 122, 123, 124, 125, 126, 127}) {
    for (int trial = 0; trial < 400; ++trial) {
      uint16_t x[16], y_fast[16], y_ref[16];
      for (int i = 0; i < 16; ++i) {
        const int e = emax - static_cast<int>(rng() % 30);
        const float m = 1.0f + static_cast<float>(rng() % 128) / 128.0f;
        x[i] = bf16_rne((rng() & 1 ? -1.0f : 1.0f) * std::ldexp(m, e));
      }
      x[rng() % 16] = bf16_rne((rng() & 1 ? -1.0f : 1.0f) *
                               std::ldexp(1.0f + static_cast<float>(rng() % 128) / 128.0f, emax));
      rht16(x, y_fast);
      rht16_reference(x, y_ref);
      for (int j = 0; j < 16; ++j)
        ASSERT_EQ(y_fast[j], y_ref[j]) << "emax " << emax << " trial " << trial << " j " << j;
      ASSERT_NO_FATAL_FAILURE(expect_abs_max_matches(x, y_ref, trial));
      ++checked;
    }
  }
  EXPECT_EQ(checked, 13 * 400);
}

TEST(Rht, ExactOnSmallIntegers) {
  // integers small enough that every step is exact: y = x H exactly, and y H^T = x
  std::mt19937 rng(5);
  for (int trial = 0; trial < 1000; ++trial) {
    uint16_t x[16], y[16];
    double xd[16];
    for (int i = 0; i < 16; ++i) {
      xd[i] = static_cast<int>(rng() % 9) - 4;
      x[i] = bf16_rne(static_cast<float>(xd[i]));
    }
    rht16(x, y);
    for (int j = 0; j < 16; ++j) {
      double e = 0;
      for (int i = 0; i < 16; ++i) e += xd[i] * rht_entry(i, j);
      EXPECT_EQ(bf16_to_f32(y[j]), static_cast<float>(e));
    }
  }
}

}  // namespace
}  // namespace fp4sim

namespace fp4sim {
namespace {

// Build one 64-wide chunk from per-k E2M1 values (value 0 elsewhere).
struct Chunk {
  uint8_t a[32] = {}, b[32] = {};
  void set(int k, float av, float bv) {
    const uint8_t ca = e2m1_rn_satfinite(av), cb = e2m1_rn_satfinite(bv);
    ASSERT_EQ(e2m1_to_f32(ca), av);
    ASSERT_EQ(e2m1_to_f32(cb), bv);
    a[k / 2] = static_cast<uint8_t>((a[k / 2] & ~(0xF << (4 * (k & 1)))) | (ca << (4 * (k & 1))));
    b[k / 2] = static_cast<uint8_t>((b[k / 2] & ~(0xF << (4 * (k & 1)))) | (cb << (4 * (k & 1))));
  }
};

uint8_t ue8m0(int exp) { return static_cast<uint8_t>(exp + 127); }

// DESIGN.md §7 worked vector: -0.875.
TEST(Gst, WorkedVector) {
  Chunk ch;
  ch.set(0, -4, 4);
  ch.set(16, -1, 1);
  ch.set(17, -1, 0.5f);
  ch.set(18, -0.5f, 0.5f);
  const uint8_t sfa[4] = {ue8m0(11), ue8m0(0), ue8m0(0), ue8m0(0)};
  const uint8_t sfb[4] = {ue8m0(8), ue8m0(-1), ue8m0(0), ue8m0(0)};
  EXPECT_EQ(gst_fdpa_fp4(ch.a, ch.b, sfa, sfb, ScaleKind::UE8M0_16, std::ldexp(1.0f, 23)), -0.875f);
}

// Probe 1: F = 35.
TEST(Gst, Probe1_AlignmentWidthIs35) {
  for (int e1 : {-35, -36}) {
    Chunk ch;
    ch.set(0, 1, 1);
    ch.set(32, -1, 1);
    ch.set(16, 1, 1);
    const uint8_t sfa[4] = {ue8m0(0), ue8m0(e1), ue8m0(0), ue8m0(0)};
    const uint8_t sfb[4] = {ue8m0(0), ue8m0(0), ue8m0(0), ue8m0(0)};
    const float r = gst_fdpa_fp4(ch.a, ch.b, sfa, sfb, ScaleKind::UE8M0_16, 0.0f);
    EXPECT_EQ(r, e1 == -35 ? std::ldexp(1.0f, -35) : 0.0f) << e1;
  }
}

// Probe 2: a cancelled group keeps its exponent.
TEST(Gst, Probe2_CancelledGroupKeepsExponent) {
  Chunk ch;
  ch.set(0, 0.5f, 0.5f);
  ch.set(1, -0.5f, 0.5f);
  ch.set(16, 1, 1);
  const uint8_t sfa[4] = {ue8m0(0), ue8m0(-36), ue8m0(0), ue8m0(0)};
  const uint8_t sfb[4] = {ue8m0(0), ue8m0(0), ue8m0(0), ue8m0(0)};
  const float r = gst_fdpa_fp4(ch.a, ch.b, sfa, sfb, ScaleKind::UE8M0_16, 0.0f);
  EXPECT_EQ(test::bits(r), 0u);  // +0, not 2^-36
}

// Probe 3: alignment by scale exponent, not by the group sum's magnitude.
TEST(Gst, Probe3_AlignmentByScaleExponent) {
  Chunk ch;
  ch.set(0, 6, 6);
  ch.set(16, -6, 6);
  ch.set(32, 1, 1);
  const uint8_t sfa[4] = {ue8m0(0), ue8m0(0), ue8m0(-35), ue8m0(0)};
  const uint8_t sfb[4] = {ue8m0(0), ue8m0(0), ue8m0(0), ue8m0(0)};
  EXPECT_EQ(gst_fdpa_fp4(ch.a, ch.b, sfa, sfb, ScaleKind::UE8M0_16, 0.0f), std::ldexp(1.0f, -35));
}

// Probe 4: C is truncated too.
TEST(Gst, Probe4_CIsTruncated) {
  Chunk ch;
  ch.set(0, 1, 1);
  ch.set(16, -1, 1);
  const uint8_t sfa[4] = {ue8m0(13), ue8m0(13), ue8m0(0), ue8m0(0)};
  const uint8_t sfb[4] = {ue8m0(0), ue8m0(0), ue8m0(0), ue8m0(0)};
  EXPECT_EQ(gst_fdpa_fp4(ch.a, ch.b, sfa, sfb, ScaleKind::UE8M0_16, 1.0f + std::ldexp(1.0f, -23)),
            1.0f);
}

TEST(Gst, OrderInsideGroupDoesNotMatterMovingAcrossGroupsCan) {
  std::mt19937 rng(1);
  for (int trial = 0; trial < 2000; ++trial) {
    Chunk ch;
    for (int k = 0; k < 64; ++k) ch.set(k, e2m1_to_f32(rng() % 16), e2m1_to_f32(rng() % 16));
    uint8_t sfa[4], sfb[4];
    for (int g = 0; g < 4; ++g) {
      sfa[g] = static_cast<uint8_t>(rng() % 0x7F);
      sfb[g] = static_cast<uint8_t>(rng() % 0x7F);
    }
    const float c =
        std::ldexp(std::normal_distribution<float>()(rng), static_cast<int>(rng() % 20) - 10);
    const float r = gst_fdpa_fp4(ch.a, ch.b, sfa, sfb, ScaleKind::UE4M3_16, c);
    // permute within each group: identical bits
    Chunk p = ch;
    for (int g = 0; g < 4; ++g)
      for (int i = 0; i < 16; ++i) {
        const int src = g * 16 + i, dst = g * 16 + (i * 7) % 16;
        p.set(dst, e2m1_to_f32((ch.a[src / 2] >> (4 * (src & 1))) & 0xF),
              e2m1_to_f32((ch.b[src / 2] >> (4 * (src & 1))) & 0xF));
      }
    ASSERT_EQ(test::bits(gst_fdpa_fp4(p.a, p.b, sfa, sfb, ScaleKind::UE4M3_16, c)), test::bits(r));
  }
  // moving a product between groups of different scale exponents changes the result:
  // 1 at exponent 0 and 2^-36 in another group: moving the small product into group 0 keeps it
  Chunk x;
  x.set(0, 1, 1);
  x.set(16, 1, 1);
  const uint8_t s0[4] = {ue8m0(0), ue8m0(-36), ue8m0(0), ue8m0(0)},
                s1[4] = {ue8m0(0), ue8m0(0), ue8m0(0), ue8m0(0)};
  EXPECT_EQ(gst_fdpa_fp4(x.a, x.b, s0, s1, ScaleKind::UE8M0_16, 0.0f), 1.0f);
  Chunk y;
  y.set(0, 1, 1);
  y.set(1, 1, 1);
  const uint8_t t0[4] = {ue8m0(0), ue8m0(0), ue8m0(0), ue8m0(0)};
  EXPECT_EQ(gst_fdpa_fp4(y.a, y.b, t0, s1, ScaleKind::UE8M0_16, 0.0f), 2.0f);
}

TEST(Gst, SpecialValuesAndSignedZeros) {
  Chunk ch;
  ch.set(0, 1, 1);
  uint8_t one[4] = {0x38, 0x38, 0x38, 0x38};  // UE4M3 1.0
  uint8_t nan_s[4] = {0x38, 0x7F, 0x38, 0x38};
  EXPECT_EQ(gst_fdpa_fp4_bits(ch.a, ch.b, nan_s, one, ScaleKind::UE4M3_16, 0.0f), kCanonicalNaN);
  EXPECT_EQ(gst_fdpa_fp4_bits(ch.a, ch.b, one, one, ScaleKind::UE4M3_16, NAN), kCanonicalNaN);
  EXPECT_EQ(gst_fdpa_fp4_bits(ch.a, ch.b, one, one, ScaleKind::UE4M3_16, -INFINITY), 0xFF800000u);
  uint8_t sneg[4] = {0xB8, 0xB8, 0xB8, 0xB8};  // sign bit masked: still 1.0
  EXPECT_EQ(gst_fdpa_fp4(ch.a, ch.b, sneg, one, ScaleKind::UE4M3_16, 0.0f), 1.0f);
  // all products -0 and C = -0 -> -0; C = +0 -> +0
  Chunk z;
  for (int k = 0; k < 64; ++k) z.set(k, -0.0f, 0.0f);
  EXPECT_EQ(gst_fdpa_fp4_bits(z.a, z.b, one, one, ScaleKind::UE4M3_16, -0.0f), 0x80000000u);
  EXPECT_EQ(gst_fdpa_fp4_bits(z.a, z.b, one, one, ScaleKind::UE4M3_16, 0.0f), 0u);
  // a cancelled group is +0
  Chunk cz = z;
  cz.set(0, 1, 1);
  cz.set(1, -1, 1);
  EXPECT_EQ(gst_fdpa_fp4_bits(cz.a, cz.b, one, one, ScaleKind::UE4M3_16, -0.0f), 0u);
  // UE8M0 32-blocks: two groups share a scale byte
  Chunk m;
  m.set(0, 1, 1);
  m.set(16, 1, 1);
  const uint8_t two[2] = {ue8m0(1), ue8m0(5)}, unit[2] = {ue8m0(0), ue8m0(0)};
  EXPECT_EQ(gst_fdpa_fp4(m.a, m.b, two, unit, ScaleKind::UE8M0_32, 0.0f), 4.0f);
  // overflow -> Inf even under RZ
  Chunk o;
  for (int k = 0; k < 64; ++k) o.set(k, 6, 6);
  const uint8_t big[4] = {0xFE, 0xFE, 0xFE, 0xFE};
  EXPECT_EQ(gst_fdpa_fp4_bits(o.a, o.b, big, big, ScaleKind::UE8M0_16, 0.0f), 0x7F800000u);
}

}  // namespace
}  // namespace fp4sim

namespace fp4sim {
namespace {

// The GEMMs' GST-FDPA cores equal the readable one, bit for bit, on random group sums, scale bytes
// (zeros, subnormals and NaNs included) and C bit patterns (zeros, subnormals, huge, Inf, NaN): the
// emulator's packed core (int64 sum) and lean core (emu/gst_fdpa_packed.hpp), and the GPU GEMM's
// packed core in FP64 and lean variants (gpu/gst_fdpa_device.cuh, compiled for the host here).
TEST(Gst, FastCoreEqualsReadableCore) {
  std::mt19937_64 rng(2026);
  int64_t cases = 0, specials = 0, lean_cases = 0;
  for (ScaleKind kind : {ScaleKind::UE4M3_16, ScaleKind::UE8M0_16, ScaleKind::UE8M0_32}) {
    for (int it = 0; it < 1000000; ++it) {
      GroupSum gs[kGstGroups];
      DecodedScale sa[kGstGroups], sb[kGstGroups];
      for (int g = 0; g < kGstGroups; ++g) {
        const uint64_t r = rng();
        const int mode = static_cast<int>(r % 8);
        gs[g].p4 = mode == 0 ? 0 : static_cast<int32_t>((r >> 8) % 4609) - 2304;
        if (mode == 1)
          gs[g].p4 = static_cast<int32_t>((r >> 8) % 9) - 4;  // small, cancellation-prone
        gs[g].all_zero = gs[g].p4 == 0 && ((r >> 40) & 1);
        gs[g].all_neg_zero = gs[g].all_zero && ((r >> 41) & 1);
        auto byte = [&](uint64_t x) {
          const int m = static_cast<int>(x % 16);
          if (m == 0) return uint8_t{0};
          if (m == 1) return uint8_t{0x7F};
          if (m == 2) return uint8_t{0xFF};
          if (m == 3) return static_cast<uint8_t>(x >> 8 & 0x07);  // UE4M3 subnormal
          if (kind != ScaleKind::UE4M3_16 && m < 8)
            return static_cast<uint8_t>(100 + (x >> 8) % 56);
          return static_cast<uint8_t>(x >> 8);
        };
        sa[g] = decode_scale(byte(r >> 42), kind);
        sb[g] = decode_scale(byte(rng()), kind);
      }
      if (kind == ScaleKind::UE8M0_32) {  // two groups share a scale
        sa[1] = sa[0], sa[3] = sa[2], sb[1] = sb[0], sb[3] = sb[2];
      }
      const uint64_t rc = rng();
      uint32_t cbits;
      switch (rc % 8) {
        case 0:
          cbits = static_cast<uint32_t>(rc >> 32) & 0x80000000u;
          break;  // +-0
        case 1:
          cbits = static_cast<uint32_t>(rc >> 32) & 0x807FFFFFu;
          break;  // subnormal
        case 2:
          cbits = (static_cast<uint32_t>(rc >> 32) & 0x80000000u) | 0x7F800000u;
          break;  // Inf
        case 3:
          cbits = 0x7FC00000u | static_cast<uint32_t>(rc >> 40);
          break;  // NaN
        default:
          cbits = static_cast<uint32_t>(rc >> 32);
      }
      const float c = from_bits(cbits);
      const uint32_t want = gst_fdpa_core_bits(gs, sa, sb, c, nullptr);
      int32_t p4[kGstGroups];
      uint32_t wa[kGstGroups], wb[kGstGroups], az = 0, anz = 0;
      for (int g = 0; g < kGstGroups; ++g) {
        p4[g] = gs[g].p4;
        az |= gs[g].all_zero ? 1u << g : 0u;
        anz |= gs[g].all_neg_zero ? 1u << g : 0u;
        wa[g] = pack_scale(sa[g]);
        wb[g] = pack_scale(sb[g]);
      }
      const uint32_t packed = gst_fdpa_core_packed_bits(p4, az, anz, wa, wb, sa[0].man_bits, c);
      ASSERT_EQ(packed, want) << "packed core, kind " << static_cast<int>(kind) << " case " << it;
      const uint32_t dbl = gpu::gst_fdpa_core_packed_fp64(p4, az, anz, wa, wb, sa[0].man_bits, c);
      ASSERT_EQ(dbl, want) << "packed core in FP64, kind " << static_cast<int>(kind) << " case "
                           << it << " c " << std::hex << cbits;
      // the lean core: NaN scales are the caller's to filter; where it answers, the same bits
      bool any_nan = false;
      int32_t siga[kGstGroups], expa[kGstGroups], sigb[kGstGroups], expb[kGstGroups];
      for (int g = 0; g < kGstGroups; ++g) {
        any_nan = any_nan || sa[g].nan || sb[g].nan;
        siga[g] = sa[g].zero ? 0 : static_cast<int32_t>(sa[g].sig);
        sigb[g] = sb[g].zero ? 0 : static_cast<int32_t>(sb[g].sig);
        expa[g] = sa[g].exp;
        expb[g] = sb[g].exp;
      }
      uint32_t lean = 0;
      if (!any_nan &&
          gst_fdpa_core_lean(p4, siga, expa, sigb, expb, az, sa[0].man_bits, c, &lean)) {
        ASSERT_EQ(lean, want) << "lean core, kind " << static_cast<int>(kind) << " case " << it;
        ++lean_cases;
      }
      // the same with zero scales' exponents biased (the GPU's variant 5): the same answers
      int32_t expza[kGstGroups], expzb[kGstGroups];
      for (int g = 0; g < kGstGroups; ++g) {
        expza[g] = gpu::gst_zero_scale_biased(siga[g], expa[g]);
        expzb[g] = gpu::gst_zero_scale_biased(sigb[g], expb[g]);
      }
      uint32_t biased = 0, plain = 0;
      const bool lean_ok =
          !any_nan && gst_fdpa_core_lean(p4, siga, expa, sigb, expb, az, sa[0].man_bits, c, &lean);
      const bool biased_ok =
          !any_nan && gpu::gst_fdpa_core_lean_variant<true, false>(p4, siga, expza, sigb, expzb, az,
                                                                   sa[0].man_bits, c, &biased);
      ASSERT_EQ(lean_ok, biased_ok) << "biased lean core answers differently, case " << it;
      // the GPU's template without its variants: emu's lean core
      const bool plain_ok =
          !any_nan && gpu::gst_fdpa_core_lean_variant<false, false>(p4, siga, expa, sigb, expb, az,
                                                                    sa[0].man_bits, c, &plain);
      ASSERT_EQ(lean_ok, plain_ok) << "plain lean variant answers differently, case " << it;
      if (lean_ok) {
        ASSERT_EQ(biased, lean) << "biased lean core, kind " << static_cast<int>(kind) << " case "
                                << it;
        ASSERT_EQ(plain, lean) << "plain lean variant, kind " << static_cast<int>(kind) << " case "
                               << it;
      }
      // scaling by exponent addition (the GPU's variant 6), with and without biased zero
      // scales, and with all_zero = 0 where no group sum is zero (no group can be all-zero there)
      uint32_t expadd = 0, expadd_biased = 0;
      const bool expadd_ok =
          !any_nan && gpu::gst_fdpa_core_lean_variant<false, true>(p4, siga, expa, sigb, expb, az,
                                                                   sa[0].man_bits, c, &expadd);
      ASSERT_EQ(lean_ok, expadd_ok) << "exponent-add lean core answers differently, case " << it;
      const bool no_zero_sum = p4[0] != 0 && p4[1] != 0 && p4[2] != 0 && p4[3] != 0;
      const bool expadd_biased_ok =
          !any_nan && gpu::gst_fdpa_core_lean_variant<true, true>(
                          p4, siga, expza, sigb, expzb, no_zero_sum ? 0u : az, sa[0].man_bits, c,
                          &expadd_biased);
      ASSERT_EQ(lean_ok, expadd_biased_ok)
          << "biased exponent-add lean core answers differently, case " << it;
      // all-zero groups folded into B's exponent (the GPU's variant 7): kGstZeroScaleExp where the
      // group's products are all zero, and no mask: the same answers and bits
      int32_t expfb[kGstGroups];
      for (int g = 0; g < kGstGroups; ++g)
        expfb[g] = ((az >> g) & 1u) ? gpu::kGstZeroScaleExp : expzb[g];
      uint32_t folded = 0;
      const bool folded_ok =
          !any_nan && gpu::gst_fdpa_core_lean_variant<true, true>(p4, siga, expza, sigb, expfb, 0u,
                                                                  sa[0].man_bits, c, &folded);
      ASSERT_EQ(lean_ok, folded_ok) << "folded-zero lean core answers differently, case " << it;
      if (lean_ok) {
        ASSERT_EQ(folded, lean) << "folded-zero lean core, kind " << static_cast<int>(kind)
                                << " case " << it;
        ASSERT_EQ(expadd, lean) << "exponent-add lean core, kind " << static_cast<int>(kind)
                                << " case " << it;
        ASSERT_EQ(expadd_biased, lean)
            << "biased exponent-add lean core, kind " << static_cast<int>(kind) << " case " << it;
      }
      ++cases;
      specials += std::isnan(c) || std::isinf(c);
    }
  }
  std::printf(
      "[gst-fast-core] %lld cases bitwise equal (%lld with non-finite C; the lean core answered "
      "%lld)\n",
      static_cast<long long>(cases), static_cast<long long>(specials),
      static_cast<long long>(lean_cases));
  EXPECT_GT(lean_cases, cases / 5);
}

}  // namespace
}  // namespace fp4sim
