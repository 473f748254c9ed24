// T-FDPA (BF16 instruction) and the 16-point RHT built on it (DESIGN.md §6, §7).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "emu/mma.hpp"
#include "emu/rht.hpp"
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
  a[0] = 1.0f; b[0] = 1.0f;
  a[1] = std::ldexp(1.0f, -30); b[1] = 1.0f;  // below 2^(0-25): dropped
  EXPECT_EQ(tfdpa_bf16(a, b, 0.0f), 1.0f);
  a[1] = std::ldexp(1.0f, -25);  // on the grid, but RZ to FP32 drops it
  EXPECT_EQ(tfdpa_bf16(a, b, 0.0f), 1.0f);
  a[1] = std::ldexp(1.0f, -23);  // representable in the FP32 result
  EXPECT_EQ(tfdpa_bf16(a, b, 0.0f), 1.0f + std::ldexp(1.0f, -23));
  // -1 + tiny negative: truncation toward zero of each term, RZ of the sum
  a[0] = -1.0f; a[1] = -std::ldexp(1.0f, -24);
  EXPECT_EQ(tfdpa_bf16(a, b, 0.0f), -1.0f);  // RZ: -1 - 2^-24 -> -1
}

TEST(Tfdpa, Bf16_SignedZerosAndSpecials) {
  float a[16], b[16];
  for (int k = 0; k < 16; ++k) { a[k] = -0.0f; b[k] = 1.0f; }
  EXPECT_EQ(bits(tfdpa_bf16(a, b, -0.0f)), 0x80000000u);  // all terms -0
  EXPECT_EQ(bits(tfdpa_bf16(a, b, 0.0f)), 0u);            // C = +0
  a[0] = 1.0f; a[1] = -1.0f;
  EXPECT_EQ(bits(tfdpa_bf16(a, b, -0.0f)), 0u);  // cancellation -> +0
  a[0] = INFINITY; a[1] = 0.0f;
  EXPECT_EQ(bits(tfdpa_bf16(a, b, 0.0f)), 0x7F800000u);
  a[1] = -INFINITY;
  EXPECT_EQ(bits(tfdpa_bf16(a, b, 0.0f)), kCanonicalNaN);
  a[1] = 0.0f; b[0] = 0.0f;  // Inf * 0
  EXPECT_EQ(bits(tfdpa_bf16(a, b, 0.0f)), kCanonicalNaN);
  b[0] = 1.0f; a[0] = 1.0f;
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
  a[0] = std::ldexp(1.0f, -70); b[0] = std::ldexp(1.0f, -70);  // 2^-140: FP32 subnormal
  EXPECT_EQ(tfdpa_bf16(a, b, 0.0f), std::ldexp(1.0f, -140));
}

TEST(Tfdpa, Bf16_MatchesSlowReferenceOnRandomInputs) {
  std::mt19937_64 rng(11);
  int n = 0;
  for (int trial = 0; trial < 200000; ++trial) {
    float a[16], b[16];
    const int spread = trial % 3 == 0 ? 2 : (trial % 3 == 1 ? 20 : 60);
    for (int k = 0; k < 16; ++k) { a[k] = random_bf16(rng, spread); b[k] = random_bf16(rng, spread); }
    const float c = trial % 4 == 0 ? 0.0f : std::ldexp(std::normal_distribution<float>()(rng), (int)(rng() % 40) - 20);
    const float fast = tfdpa_bf16(a, b, c), slow = tfdpa_bf16_slow(a, b, c);
    ASSERT_EQ(bits(fast), bits(slow)) << "trial " << trial;
    ++n;
  }
  EXPECT_EQ(n, 200000);
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
  }
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
