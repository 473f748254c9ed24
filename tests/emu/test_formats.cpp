// Tier 1 (DESIGN.md §10): every code of every format, every FP32 rounding boundary, against the
// contract's rules and CUDA's host conversions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>

#include "emu/formats.hpp"
#include "tests/emu/test_util.hpp"

#if FP4SIM_HAVE_CUDA_HOST_HEADERS
#include <cuda_bf16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>
#endif

namespace fp4sim {
namespace {

using test::bits;
using test::from_bits;

TEST(Formats, E2M1_AllCodesDecode) {
  const float expect[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (int c = 0; c < 16; ++c) EXPECT_EQ(bits(e2m1_to_f32(c)), bits(expect[c])) << "code " << c;
}

TEST(Formats, E2M1_RoundingTiesToEven) {
  struct Case {
    float x;
    uint8_t code;
  };
  const Case cases[] = {{0.25f, 0},  {0.75f, 2}, {1.25f, 2},   {1.75f, 4},      {2.5f, 4},
                        {3.5f, 6},   {5.0f, 6},  {7.0f, 7},    {-0.0f, 8},      {-0.1f, 8},
                        {-5.0f, 14}, {1e30f, 7}, {-1e30f, 15}, {0.2500001f, 1}, {0.7499999f, 1}};
  for (const auto& c : cases) EXPECT_EQ(e2m1_rn_satfinite(c.x), c.code) << c.x;
  EXPECT_EQ(e2m1_rn_satfinite(std::numeric_limits<float>::quiet_NaN()), 0x7);
  EXPECT_EQ(e2m1_rn_satfinite(-std::numeric_limits<float>::quiet_NaN()), 0x7);
  EXPECT_EQ(e2m1_rn_satfinite(std::numeric_limits<float>::infinity()), 0x7);
  EXPECT_EQ(e2m1_rn_satfinite(-std::numeric_limits<float>::infinity()), 0xF);
}

// Every midpoint and its FP32 neighbours: the threshold chain against the generic integer RNE.
TEST(Formats, E2M1_EveryBoundaryMatchesGenericRne) {
  for (int c = 0; c < 7; ++c) {
    const float mid = (e2m1_to_f32(c) + e2m1_to_f32(c + 1)) / 2;
    for (int d = -2; d <= 2; ++d) {
      for (float s : {1.0f, -1.0f}) {
        const float x = s * from_bits(bits(mid) + d);
        const uint32_t a = bits(x) & 0x7FFFFFFFu;
        const uint8_t generic =
            static_cast<uint8_t>(((bits(x) >> 31) << 3) | encode_magnitude_rne<E2M1>(a));
        EXPECT_EQ(e2m1_rn_satfinite(x), generic) << x;
      }
    }
  }
}

TEST(Formats, E4M3_AllCodesDecode) {
  for (int c = 0; c < 256; ++c) {
    const float v = e4m3_to_f32(static_cast<uint8_t>(c));
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << c;
      continue;
    }
    // value from the definition: s.eeee.mmm, bias 7, subnormal at exponent field 0
    const int e = (c >> 3) & 0xF, m = c & 7;
    const double mag = e == 0 ? m * std::ldexp(1.0, -9) : (8 + m) * std::ldexp(1.0, e - 10);
    EXPECT_EQ(v, static_cast<float>((c & 0x80) ? -mag : mag)) << c;
    // and back: every finite code round-trips
    EXPECT_EQ(e4m3_rn_satfinite(v), c) << c;
  }
  EXPECT_EQ(e4m3_to_f32(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_f32(0x08), std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isnan(ue4m3_to_f32(0xFF)));
  EXPECT_EQ(ue4m3_to_f32(0xFE), 448.0f);  // sign bit masked
}

// e4m3_to_f32's rebased-exponent decode against the generic minifloat decode (decode_magnitude):
// the same bits for every code (-0 and the canonical NaN included).
TEST(Formats, E4M3_DecodeEqualsGeneric) {
  for (int c = 0; c < 256; ++c) {
    const float m = decode_magnitude<E4M3>(c & 0x7Fu);
    const uint32_t expected = (c & 0x7F) == 0x7F ? 0x7FFFFFFFu : f32_bits((c & 0x80) ? -m : m);
    EXPECT_EQ(f32_bits(e4m3_to_f32(static_cast<uint8_t>(c))), expected)
        << "code 0x" << std::hex << c;
  }
}

TEST(Formats, E4M3_SaturatesAndMidpoints) {
  EXPECT_EQ(e4m3_rn_satfinite(464.0f), 0x7E);
  EXPECT_EQ(e4m3_rn_satfinite(1e9f), 0x7E);
  EXPECT_EQ(e4m3_rn_satfinite(-1e9f), 0xFE);
  EXPECT_EQ(e4m3_rn_satfinite(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(e4m3_rn_satfinite(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  // every midpoint between adjacent positive codes: ties to the even code, neighbours to the side
  for (int c = 0; c < 0x7E; ++c) {
    const float lo = e4m3_to_f32(c), hi = e4m3_to_f32(c + 1);
    const float mid = static_cast<float>((static_cast<double>(lo) + hi) / 2);
    EXPECT_EQ(e4m3_rn_satfinite(mid), (c & 1) ? c + 1 : c) << "mid " << mid;
    EXPECT_EQ(e4m3_rn_satfinite(from_bits(bits(mid) - 1)), c) << mid;
    EXPECT_EQ(e4m3_rn_satfinite(from_bits(bits(mid) + 1)), c + 1) << mid;
  }
}

TEST(Formats, E5M2_AllCodesDecode) {
  for (int c = 0; c < 256; ++c) {
    const float v = e5m2_to_f32(static_cast<uint8_t>(c));
    const int e = (c >> 2) & 0x1F, m = c & 3;
    if (e == 31) {
      EXPECT_TRUE(m == 0 ? std::isinf(v) : std::isnan(v)) << c;
      continue;
    }
    const double mag = e == 0 ? m * std::ldexp(1.0, -16) : (4 + m) * std::ldexp(1.0, e - 17);
    EXPECT_EQ(v, static_cast<float>((c & 0x80) ? -mag : mag)) << c;
    EXPECT_EQ(e5m2_rn_satfinite(v), c) << c;
  }
  EXPECT_EQ(e5m2_rn_satfinite(1e9f), 0x7B);
}

TEST(Formats, UE8M0_AllCodesAndRounding) {
  for (int e = 1; e < 255; ++e) EXPECT_EQ(ue8m0_to_f32(e), std::ldexp(1.0f, e - 127)) << e;
  EXPECT_EQ(ue8m0_to_f32(0), std::ldexp(1.0f, -127));
  EXPECT_TRUE(std::isnan(ue8m0_to_f32(0xFF)));
  EXPECT_EQ(ue8m0_rz_satfinite(1.0f), 127);
  EXPECT_EQ(ue8m0_rz_satfinite(1.99f), 127);
  EXPECT_EQ(ue8m0_rp_satfinite(1.0f), 127);
  EXPECT_EQ(ue8m0_rp_satfinite(1.01f), 128);
  EXPECT_EQ(ue8m0_rp_satfinite(-3.0f), 129);  // sign ignored
  EXPECT_EQ(ue8m0_rz_satfinite(0.0f), 0);
  EXPECT_EQ(ue8m0_rz_satfinite(1e-40f), 0);  // subnormal
  EXPECT_EQ(ue8m0_rz_satfinite(std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(ue8m0_rp_satfinite(std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(ue8m0_rp_satfinite(3.0e38f), 0xFE);  // ceil overflows to 2^128 -> satfinite
  EXPECT_EQ(ue8m0_rz_satfinite(std::numeric_limits<float>::quiet_NaN()), 0xFF);
  EXPECT_EQ(ue8m0_rp_satfinite(std::numeric_limits<float>::quiet_NaN()), 0xFF);
  EXPECT_EQ(ue8m0_rp_satfinite(from_bits(0x00400001u)), 1);  // just above 2^-127
  EXPECT_EQ(ue8m0_rp_satfinite(from_bits(0x00400000u)), 0);  // 2^-127 exactly
}

TEST(Formats, BF16_RoundingAndNaN) {
  EXPECT_EQ(bf16_rne(1.0f), 0x3F80);
  EXPECT_EQ(bf16_rne(from_bits(0x3F808000u)), 0x3F80);  // tie to even
  EXPECT_EQ(bf16_rne(from_bits(0x3F818000u)), 0x3F82);  // tie to even (up)
  EXPECT_EQ(bf16_rne(from_bits(0x3F808001u)), 0x3F81);
  EXPECT_EQ(bf16_rne(from_bits(0x7F7FFFFFu)), 0x7F80);  // overflow to Inf
  EXPECT_EQ(bf16_rne(std::numeric_limits<float>::quiet_NaN()), 0x7FFF);
  EXPECT_EQ(bf16_rne(from_bits(0xFFC00000u)), 0x7FFF);
  EXPECT_EQ(bf16_rne(from_bits(0x00000001u)), 0x0000);  // smallest subnormal rounds to 0
  EXPECT_EQ(bf16_rne(from_bits(0x00008001u)), 0x0001);  // subnormals kept, never flushed
  for (uint32_t h = 0; h < 65536; ++h) {
    if ((h & 0x7FFF) > 0x7F80) continue;
    EXPECT_EQ(bf16_rne(bf16_to_f32(static_cast<uint16_t>(h))), h);
  }
}

// The largest magnitude of 16 BF16 patterns: signs dropped, -0 and +0 alike, Inf above every
// finite value, and a NaN of either sign anywhere the canonical 0x7FFF (also beside an Inf).
TEST(Formats, BF16x16_MaxMagnitudeBits) {
  uint16_t x[16] = {};
  EXPECT_EQ(bf16x16_max_magnitude_bits(x), 0u);
  x[3] = 0x8000;  // -0
  EXPECT_EQ(bf16x16_max_magnitude_bits(x), 0u);
  x[7] = 0x0001;   // smallest subnormal
  x[9] = 0xBF80;   // -1
  x[12] = 0x3F00;  // 0.5
  EXPECT_EQ(bf16x16_max_magnitude_bits(x), 0x3F80u);
  x[0] = 0xFF7F;  // -max finite
  EXPECT_EQ(bf16x16_max_magnitude_bits(x), 0x7F7Fu);
  x[15] = 0xFF80;  // -Inf
  EXPECT_EQ(bf16x16_max_magnitude_bits(x), 0x7F80u);
  for (uint16_t nan : {0x7F81, 0x7FC0, 0xFFFF, 0xFF81}) {
    uint16_t y[16];
    for (int i = 0; i < 16; ++i) y[i] = x[i];
    y[5] = nan;
    EXPECT_EQ(bf16x16_max_magnitude_bits(y), 0x7FFFu) << std::hex << nan;
  }
}

// DESIGN.md §4: over r = 0..255 the number of round-ups is exactly floor(frac*256), for many frac
// values in every binade of the E2M1 grid (and the subnormal one).
TEST(Formats, E2M1_StochasticRoundUpCountIsExact) {
  std::mt19937 rng(7);
  const float lows[] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f};
  const float steps[] = {0.5f, 0.5f, 0.5f, 0.5f, 1.0f, 1.0f, 2.0f};
  int checked = 0;
  for (int k = 0; k < 7; ++k) {
    for (int trial = 0; trial < 2000; ++trial) {
      float frac = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
      if (trial < 256) frac = trial / 256.0f;  // exact multiples: the boundary cases
      if (trial == 256) frac = from_bits(1);   // tiniest fraction
      const float a = lows[k] + frac * steps[k];
      if (a >= lows[k] + steps[k]) continue;
      const float exact_frac = (a - lows[k]) / steps[k];
      const int expected = static_cast<int>(std::floor(static_cast<double>(exact_frac) * 256.0));
      for (float sign : {1.0f, -1.0f}) {
        int ups = 0;
        const uint8_t lo_code = e2m1_rn_satfinite(lows[k]);
        for (int r = 0; r < 256; ++r) {
          const uint8_t c = e2m1_rs_satfinite(sign * a, static_cast<uint8_t>(r));
          ASSERT_EQ(c & 0x8, sign < 0 ? 0x8 : 0) << "sign kept";
          if ((c & 7) == lo_code + 1)
            ++ups;
          else
            ASSERT_EQ(c & 7, lo_code) << a << " r=" << r;
        }
        ASSERT_EQ(ups, expected) << "a=" << a << " frac=" << exact_frac;
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 20000);
  // saturation and NaN
  for (int r = 0; r < 256; ++r) {
    EXPECT_EQ(e2m1_rs_satfinite(6.5f, r), 0x7);
    EXPECT_EQ(e2m1_rs_satfinite(-100.0f, r), 0xF);
    EXPECT_EQ(e2m1_rs_satfinite(std::numeric_limits<float>::quiet_NaN(), r), 0x7);
    EXPECT_EQ(e2m1_rs_satfinite(-0.0f, r), 0x8);
  }
  // a negative value rounding to zero keeps its sign: -0.1 with r = 0 -> -0
  EXPECT_EQ(e2m1_rs_satfinite(-0.1f, 0), 0x8);
}

// The contract's FP32 formulation of SR (DESIGN.md §4), literally: lo, step, frac = (a - lo)/step
// (exact), floor(frac * 256) + r >= 256 -> round away from zero.
uint8_t e2m1_rs_contract(float y, uint8_t r) {
  if (std::isnan(y)) return 0x7;
  const uint8_t sign = std::signbit(y) ? 0x8 : 0;
  const float a = std::fabs(y);
  if (a >= 6.0f) return sign | 0x7;
  const float grid[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  int lo = 0;
  while (lo < 7 && grid[lo + 1] <= a) ++lo;
  const float step = grid[lo + 1] - grid[lo];
  const float frac = (a - grid[lo]) / step;
  const int top8 = static_cast<int>(std::floor(static_cast<double>(frac) * 256.0));
  return sign | static_cast<uint8_t>(top8 + r >= 256 ? lo + 1 : lo);
}

TEST(Formats, E2M1_StochasticBitFormulationEqualsContract) {
  std::mt19937_64 rng(99);
  for (int i = 0; i < 3000000; ++i) {
    uint32_t u = static_cast<uint32_t>(rng());
    if (i % 2) u = (u & 0x80FFFFFFu) | ((0x3Cu + (u >> 29)) << 23);  // concentrate on [2^-3, 8)
    const float y = from_bits(u);
    const uint8_t r = static_cast<uint8_t>(rng());
    ASSERT_EQ(e2m1_rs_satfinite(y, r), e2m1_rs_contract(y, r)) << std::hex << u << " r=" << int(r);
  }
}

#if FP4SIM_HAVE_CUDA_HOST_HEADERS
// A quick sample of the exhaustive sweep (test_formats_exhaustive runs all 2^32): 2^24 patterns.
TEST(Formats, SampledBitPatternsMatchCudaHeaders) {
  for (uint64_t i = 0; i < (1ull << 24); ++i) {
    const uint32_t u = static_cast<uint32_t>(i * 0x9E3779B1ull + (i >> 7));
    const float x = from_bits(u);
    ASSERT_EQ(e2m1_rn_satfinite(x), __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest))
        << std::hex << u;
    ASSERT_EQ(e4m3_rn_satfinite(x), __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3))
        << std::hex << u;
    ASSERT_EQ(e5m2_rn_satfinite(x), __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2))
        << std::hex << u;
    ASSERT_EQ(ue8m0_rz_satfinite(x), __nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundZero))
        << std::hex << u;
    ASSERT_EQ(ue8m0_rp_satfinite(x), __nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundPosInf))
        << std::hex << u;
    const __nv_bfloat16 b = __float2bfloat16(x);
    uint16_t bb;
    std::memcpy(&bb, &b, 2);
    ASSERT_EQ(bf16_rne(x), bb) << std::hex << u;
  }
}

TEST(Formats, DecodeMatchesCudaHeaders) {
  for (int c = 0; c < 16; ++c) {
    const __half_raw h = __nv_cvt_fp4_to_halfraw(static_cast<__nv_fp4_storage_t>(c), __NV_E2M1);
    EXPECT_EQ(e2m1_to_f32(c), __half2float(__half(h))) << c;
  }
  for (int c = 0; c < 256; ++c) {
    const float a = e4m3_to_f32(c), b = __half2float(__half(__nv_cvt_fp8_to_halfraw(c, __NV_E4M3)));
    EXPECT_TRUE((std::isnan(a) && std::isnan(b)) || bits(a) == bits(b)) << c;
    const float a5 = e5m2_to_f32(c),
                b5 = __half2float(__half(__nv_cvt_fp8_to_halfraw(c, __NV_E5M2)));
    EXPECT_TRUE((std::isnan(a5) && std::isnan(b5)) || bits(a5) == bits(b5)) << c;
  }
}
#endif

}  // namespace
}  // namespace fp4sim
