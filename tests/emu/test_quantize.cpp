// Tier 2 on the emulator: the worked vector, the algorithm's properties, and bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "emu/backend.hpp"
#include "emu/cpu_backend.hpp"
#include "tests/emu/quantize_checks.hpp"
#include "tests/emu/test_util.hpp"

namespace fp4sim {
namespace {

QuantizeConfig rowwise_rn() {
  QuantizeConfig c;
  c.rowwise.enabled = true;
  return c;
}

std::vector<float> worked_vector() {
  std::vector<float> x(32);
  for (int i = 0; i < 16; ++i) {
    x[i] = 0.25f * static_cast<float>(i) - 2.0f;
    x[16 + i] = 0.001f * static_cast<float>(i + 1);
  }
  return x;
}

// DESIGN.md §5 worked vector: amax 2, S_enc 1344, scales 7E 46, the packed codes below.
// A tensor's two copies from one call equal each copy from its own call (model/linear.cpp relies
// on it), for every format and option pair the recipes combine.
TEST(Quantize, CopiesFromOneCallEqualSeparateCalls) {
  auto be = make_cpu_backend();
  test::check_copy_pairs(*be);
}

TEST(Quantize, Nvfp4_WorkedVector) {
  auto be = make_cpu_backend();
  std::vector<float> x = worked_vector();
  const QuantizeResult r = quantize_to_host(*be, host_view(x.data(), 1, 32), rowwise_rn());
  EXPECT_EQ(r.rowwise.amax, 2.0f);
  EXPECT_EQ(nvfp4_global(2.0f, false).s_enc, 1344.0f);
  ASSERT_EQ(r.rowwise.scales.size(), 2u);
  EXPECT_EQ(r.rowwise.scales[0], 0x7E);
  EXPECT_EQ(r.rowwise.scales[1], 0x46);
  const uint8_t expect[16] = {0xFF, 0xEE, 0xCD, 0xAB, 0x20, 0x43, 0x65, 0x76,
                              0x21, 0x32, 0x44, 0x55, 0x65, 0x66, 0x76, 0x77};
  for (int i = 0; i < 16; ++i) EXPECT_EQ(r.rowwise.codes[i], expect[i]) << "byte " << i;
}

TEST(Quantize, Nvfp4_WorkedVectorDequantize) {
  auto be = make_cpu_backend();
  std::vector<float> x = worked_vector();
  QuantizeResult r = quantize_to_host(*be, host_view(x.data(), 1, 32), rowwise_rn());
  const std::vector<float> d = dequantize_to_host(*be, r.rowwise);
  // block 0: scale 0x7E = 448 -> factor (448 * 2) * (1/2688) = 1/3
  const float f0 = (448.0f * 2.0f) * (1.0f / 2688.0f);
  EXPECT_EQ(d[0], -6.0f * f0);
  EXPECT_EQ(d[8], 0.0f);
  // relative error of a 4-bit quantizer on this row stays modest
  double num = 0, den = 0;
  for (int i = 0; i < 32; ++i) {
    num += (d[i] - x[i]) * (d[i] - x[i]);
    den += x[i] * x[i];
  }
  EXPECT_LT(std::sqrt(num / den), 0.2);
}

TEST(Quantize, Nvfp4_ZeroBlockAndZeroTensor) {
  auto be = make_cpu_backend();
  std::vector<float> x(32, 0.0f);
  QuantizeResult r = quantize_to_host(*be, host_view(x.data(), 1, 32), rowwise_rn());
  EXPECT_EQ(r.rowwise.amax, 0.0f);
  for (uint8_t s : r.rowwise.scales) EXPECT_EQ(s, 0);
  for (uint8_t c : r.rowwise.codes) EXPECT_EQ(c, 0);
  x[0] = -0.0f;
  r = quantize_to_host(*be, host_view(x.data(), 1, 32), rowwise_rn());
  EXPECT_EQ(r.rowwise.codes[0] & 0xF, 0x8);  // -0 keeps its sign
}

TEST(Quantize, Nvfp4_InfSetsGlobalScaleOneNaNEncodesSix) {
  auto be = make_cpu_backend();
  std::vector<float> x(16, 1.0f);
  x[3] = std::numeric_limits<float>::quiet_NaN();
  QuantizeResult r = quantize_to_host(*be, host_view(x.data(), 1, 16), rowwise_rn());
  EXPECT_EQ(r.rowwise.amax, 1.0f);  // NaN ignored
  EXPECT_EQ((r.rowwise.codes[1] >> 4) & 0xF, 0x7);
  x[5] = std::numeric_limits<float>::infinity();
  r = quantize_to_host(*be, host_view(x.data(), 1, 16), rowwise_rn());
  EXPECT_TRUE(std::isinf(r.rowwise.amax));
  EXPECT_EQ(nvfp4_global(r.rowwise.amax, false).s_enc, 1.0f);
}

TEST(Quantize, Nvfp4_2D_ColumnwiseIsExactTranspose) {
  auto be = make_cpu_backend();
  for (bool fos : {false, true}) {
    for (test::Fill f : test::all_fills()) {
      std::vector<float> x = test::make_fill(f, 48 * 80, 21);
      QuantizeConfig c;
      c.block_2d = true;
      c.rowwise.enabled = c.columnwise.enabled = true;
      c.rowwise.four_over_six = c.columnwise.four_over_six = fos;
      const QuantizeResult r = quantize_to_host(*be, host_view(x.data(), 48, 80), c);
      for (int64_t i = 0; i < 48; ++i) {
        for (int64_t j = 0; j < 80; ++j) {
          const int64_t e = i * 80 + j, et = j * 48 + i;
          const int a = (r.rowwise.codes[e / 2] >> (4 * (e & 1))) & 0xF;
          const int b = (r.columnwise.codes[et / 2] >> (4 * (et & 1))) & 0xF;
          ASSERT_EQ(a, b) << test::fill_name(f) << " fos " << fos << " at " << i << "," << j;
          ASSERT_EQ(r.rowwise.scales[i * 5 + j / 16], r.columnwise.scales[j * 3 + i / 16]);
        }
      }
    }
  }
}

TEST(Quantize, Nvfp4_2D_ScaleRepeatedDownTile) {
  auto be = make_cpu_backend();
  std::vector<float> x = test::make_fill(test::Fill::HeavyTailed, 32 * 32, 4);
  QuantizeConfig c = rowwise_rn();
  c.block_2d = true;
  const QuantizeResult r = quantize_to_host(*be, host_view(x.data(), 32, 32), c);
  for (int i = 0; i < 32; ++i)
    for (int b = 0; b < 2; ++b)
      EXPECT_EQ(r.rowwise.scales[i * 2 + b], r.rowwise.scales[(i / 16) * 32 + b]);
}

TEST(Quantize, FourOverSix_NeverWorseThanSixOnItsMetric) {
  auto be = make_cpu_backend();
  std::vector<float> x = test::make_fill(test::Fill::Gaussian, 64 * 256, 9);
  QuantizeConfig plain = rowwise_rn(), fos = rowwise_rn();
  fos.rowwise.four_over_six = true;
  QuantizeResult a = quantize_to_host(*be, host_view(x.data(), 64, 256), plain);
  QuantizeResult b = quantize_to_host(*be, host_view(x.data(), 64, 256), fos);
  const auto da = dequantize_to_host(*be, a.rowwise), db = dequantize_to_host(*be, b.rowwise);
  double ea = 0, eb = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    ea += std::fabs(da[i] - x[i]);
    eb += std::fabs(db[i] - x[i]);
  }
  EXPECT_LT(eb, ea);  // choosing per block lowers the total absolute error on Gaussian data
  int map4 = 0;
  for (size_t blk = 0; blk < b.rowwise.scales.size(); ++blk) {
    // the chosen scale is one of the two candidates
    float amax_b = 0;
    for (int i = 0; i < 16; ++i) amax_b = std::fmax(amax_b, std::fabs(x[blk * 16 + i]));
    uint8_t m6, m4;
    four_over_six_candidates(amax_b, nvfp4_global(b.rowwise.amax, true).s_enc, &m6, &m4);
    ASSERT_TRUE(b.rowwise.scales[blk] == m6 || b.rowwise.scales[blk] == m4);
    if (b.rowwise.scales[blk] == m4 && m4 != m6) ++map4;
  }
  EXPECT_GT(map4, 0);
}

TEST(Quantize, Mxfp4_ScaleRules) {
  // amax 5: floor(log2 5) = 2 -> floor rule x = 0 (byte 127); ceil: 6*2^0 >= 5 -> x = 0
  // amax 7: e = 2, significand 1.75 > 1.5 -> ceil x = 1 (byte 128), floor x = 0
  EXPECT_EQ(mxfp4_block_scale(5.0f, false, false, MxScaleRule::Floor), 127);
  EXPECT_EQ(mxfp4_block_scale(5.0f, false, false, MxScaleRule::Ceil), 127);
  EXPECT_EQ(mxfp4_block_scale(7.0f, false, false, MxScaleRule::Floor), 127);
  EXPECT_EQ(mxfp4_block_scale(7.0f, false, false, MxScaleRule::Ceil), 128);
  EXPECT_EQ(mxfp4_block_scale(6.0f, false, false, MxScaleRule::Ceil), 127);  // 6*2^0 >= 6 exactly
  EXPECT_EQ(mxfp4_block_scale(0.0f, false, false, MxScaleRule::Floor), 0);
  EXPECT_EQ(mxfp4_block_scale(1.0f, true, false, MxScaleRule::Floor), 0xFF);
  EXPECT_EQ(mxfp4_block_scale(0.0f, false, true, MxScaleRule::Floor), 0xFF);
  EXPECT_EQ(mxfp4_block_scale(1e-42f, false, false, MxScaleRule::Floor), 0);  // clamps at -127
  // every normal binade: the ceil rule's x is the smallest with 6*2^x >= amax
  for (int e = -120; e < 120; ++e) {
    for (float m : {1.0f, 1.25f, 1.5f, 1.5000001f, 1.75f, 1.9999999f}) {
      const float amax = std::ldexp(m, e);
      const int x = mxfp4_block_scale(amax, false, false, MxScaleRule::Ceil) - 127;
      EXPECT_GE(6.0 * std::ldexp(1.0, x), amax);
      EXPECT_LT(6.0 * std::ldexp(1.0, x - 1), amax);
    }
  }
}

TEST(Quantize, Mxfp4_InfBlockIsNaNScaleAndZeroCodes) {
  auto be = make_cpu_backend();
  std::vector<float> x = test::make_fill(test::Fill::Gaussian, 64, 2);
  x[40] = std::numeric_limits<float>::infinity();
  QuantizeConfig c = rowwise_rn();
  c.format = QFormat::MXFP4;
  QuantizeResult r = quantize_to_host(*be, host_view(x.data(), 1, 64), c);
  EXPECT_NE(r.rowwise.scales[0], 0xFF);
  EXPECT_EQ(r.rowwise.scales[1], 0xFF);
  for (int i = 16; i < 32; ++i) EXPECT_EQ(r.rowwise.codes[i], 0);
  const auto d = dequantize_to_host(*be, r.rowwise);
  EXPECT_TRUE(std::isnan(d[40]));
}

TEST(Quantize, StochasticRounding_DeterministicPerStreamAndUnbiased) {
  auto be = make_cpu_backend();
  // each block: amax 1 (scale 448 exactly, enc 6) and 0.3 -> 1.8, between the grid points 1.5 and 2
  std::vector<float> x(64 * 64, 0.3f);
  for (size_t i = 0; i < x.size(); i += 16) x[i] = 1.0f;
  QuantizeConfig c = rowwise_rn();
  c.rowwise.rounding = Rounding::SR;
  c.seed = 42;
  c.rowwise.stream = 7;
  QuantizeResult a = quantize_to_host(*be, host_view(x.data(), 64, 64), c);
  QuantizeResult b = quantize_to_host(*be, host_view(x.data(), 64, 64), c);
  EXPECT_EQ(a.rowwise.codes, b.rowwise.codes);
  c.rowwise.stream = 8;
  QuantizeResult d = quantize_to_host(*be, host_view(x.data(), 64, 64), c);
  EXPECT_NE(a.rowwise.codes, d.rowwise.codes);
  const auto v = dequantize_to_host(*be, a.rowwise);
  double mean = 0;
  for (size_t i = 0; i < v.size(); ++i)
    if (i % 16) mean += v[i];
  mean /= static_cast<double>(v.size() - v.size() / 16);
  // SR is unbiased up to the 8-bit randomness: E[q] = 1.5 + 0.5 * floor(0.6 * 256) / 256
  EXPECT_NEAR(mean * 6.0, 1.5 + 0.5 * 153.0 / 256.0, 0.01);
  // while RN puts every such element on 2 (1.8 rounds to the nearest grid point)
  c.rowwise.rounding = Rounding::RN;
  QuantizeResult rn = quantize_to_host(*be, host_view(x.data(), 64, 64), c);
  EXPECT_EQ(rn.rowwise.codes[0] >> 4, 0x4);
}

TEST(Quantize, Rht_ColumnwiseAmaxIsOverTransformedValues) {
  auto be = make_cpu_backend();
  std::vector<float> x = test::make_fill(test::Fill::Gaussian, 32 * 16, 5);
  QuantizeConfig c;
  c.columnwise.enabled = true;
  c.columnwise.rht = true;
  const QuantizeResult r = quantize_to_host(*be, host_view(x.data(), 32, 16), c);
  std::vector<float> t(x.size());
  emu::rht_columnwise(x.data(), 32, 16, t.data());
  float m = 0;
  for (float v : t) m = std::fmax(m, std::fabs(v));
  EXPECT_EQ(r.columnwise.amax, m);
  EXPECT_EQ(r.columnwise.rows, 16);
  EXPECT_EQ(r.columnwise.cols, 32);
}

TEST(Quantize, Bf16InputMatchesItsFloatWidening) {
  auto be = make_cpu_backend();
  std::vector<float> x = test::make_fill(test::Fill::HeavyTailed, 32 * 64, 8);
  std::vector<uint16_t> h(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    h[i] = bf16_rne(x[i]);
    x[i] = bf16_to_f32(h[i]);
  }
  TensorView hv;
  hv.data = h.data();
  hv.dtype = DType::BF16;
  hv.rows = 32;
  hv.cols = 64;
  QuantizeConfig c = rowwise_rn();
  c.columnwise.enabled = true;
  const QuantizeResult a = quantize_to_host(*be, hv, c),
                       b = quantize_to_host(*be, host_view(x.data(), 32, 64), c);
  EXPECT_EQ(a.rowwise.codes, b.rowwise.codes);
  EXPECT_EQ(a.columnwise.scales, b.columnwise.scales);
}

TEST(Quantize, TiledScaleLayoutCheckValues) {
  EXPECT_EQ(tiled_scale_offset(5, 2, 8), 82);
  EXPECT_EQ(tiled_scale_offset(5, 5, 8), 593);
  // a permutation of the padded matrix
  const int64_t rows = 300, kb = 10;
  const int64_t n = tiled_scale_bytes(rows, kb);
  EXPECT_EQ(n, 384 * 12);
  std::vector<int> seen(static_cast<size_t>(n), 0);
  for (int64_t r = 0; r < 384; ++r)
    for (int64_t c = 0; c < 12; ++c) ++seen[static_cast<size_t>(tiled_scale_offset(r, c, kb))];
  for (int s : seen) ASSERT_EQ(s, 1);
}

TEST(Quantize, BadInputNamesTensorShapeAndFlag) {
  auto be = make_cpu_backend();
  std::vector<float> x(24 * 40, 1.0f);
  auto expect_error = [&](int64_t rows, int64_t cols, const QuantizeConfig& c, const char* needle) {
    try {
      quantize_to_host(*be, host_view(x.data(), rows, cols, "weight"), c);
      FAIL() << "expected an error containing '" << needle << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(24, 40, rowwise_rn(), "not a multiple of 16");
  expect_error(24, 40, rowwise_rn(), "'weight' [24, 40]");
  QuantizeConfig c = rowwise_rn();
  c.format = QFormat::MXFP4;
  expect_error(24, 32 + 16, c, "not a multiple of 32");
  c.block_2d = true;
  expect_error(32, 32, c, "--2d");
  QuantizeConfig d;
  d.columnwise.enabled = true;
  expect_error(24, 32, d, "column-wise copy blocks along the rows");
  d = rowwise_rn();
  d.rowwise.rht = true;
  expect_error(32, 32, d, "--rht");
  d = rowwise_rn();
  d.rowwise.four_over_six = true;
  d.rowwise.rounding = Rounding::SR;
  expect_error(32, 32, d, "--four-over-six");
  d = rowwise_rn();
  d.block_2d = true;
  expect_error(24, 32, d, "multiples of 16");
  QuantizeConfig none;
  expect_error(32, 32, none, "no copy requested");
}

// The quantization statistics' error sums (emu/quant_stats.hpp) equal a reference summed element
// by element from the dequantized copy, for every format and fill; the fills reach both counters,
// so the test cannot pass with them stuck at zero.
TEST(QuantStats, ErrorSumsMatchDequantizedReference) {
  auto be = make_cpu_backend();
  const int64_t n = 256;
  int64_t saturated = 0;
  for (const auto& [name, cfg] : test::error_sum_configs())
    for (int fill = -1; fill < static_cast<int>(test::all_fills().size()); ++fill) {
      // fill -1: columns 16-31 of every row 1e-9 times the rest, so NVFP4's E4M3 block scales
      // underflow there (every row's second 1x16 block, every 16x16 tile in that column range)
      std::vector<float> x = test::make_fill(
          fill < 0 ? test::Fill::Gaussian : test::all_fills()[static_cast<size_t>(fill)],
          static_cast<size_t>(n * n), 515);
      if (fill < 0)
        for (int64_t r = 0; r < n; ++r)
          for (int64_t c = 16; c < 32; ++c) x[static_cast<size_t>(r * n + c)] *= 1e-9f;
      const std::string what =
          name + " " +
          (fill < 0 ? "tiny_second_block"
                    : test::fill_name(test::all_fills()[static_cast<size_t>(fill)]));
      QuantizeResult r = quantize_to_host(*be, host_view(x.data(), n, n), cfg);
      const QuantErrorSums got = quant_error_sums_on(*be, x, r.rowwise);
      test::expect_error_sums_near(got, test::reference_error_sums(*be, x, r.rowwise), what);
      saturated += got.saturated;
      if (fill < 0 && cfg.format == QFormat::NVFP4) {
        EXPECT_EQ(got.underflow_blocks, n) << what;
      }
    }
  EXPECT_GT(saturated, 0);
  QuantizedHost q;
  q.resize(2, 32, QFormat::NVFP4, false);
  std::vector<float> x(64, 1.0f);
  EXPECT_THROW(quant_error_sums_on(*be, std::vector<float>(63, 1.0f), q), std::invalid_argument);
  QuantizedView bad = q.view();
  bad.cols = 24;
  try {
    be->quant_error_sums(host_view(x.data(), 2, 24, "x"), bad);
    ADD_FAILURE() << "cols 24 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[2, 24]"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace fp4sim

#if defined(__x86_64__)
#include <xmmintrin.h>
namespace fp4sim {
namespace {
// A library that leaves FTZ/DAZ set must not change the emulator's bits (emu/fp_env.hpp).
TEST(Quantize, SubnormalsSurviveAFlushToZeroHost) {
  auto be = make_cpu_backend();
  std::vector<float> x = test::make_fill(test::Fill::Subnormal, 64 * 128, 64128);
  QuantizeConfig c = rowwise_rn();
  const QuantizeResult ieee = quantize_to_host(*be, host_view(x.data(), 64, 128), c);
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040u);
  const QuantizeResult ftz_host = quantize_to_host(*be, host_view(x.data(), 64, 128), c);
  _mm_setcsr(csr);
  float amax_b = 0;
  for (int i = 0; i < 16; ++i) amax_b = std::fmax(amax_b, std::fabs(x[i]));
  EXPECT_EQ(ieee.rowwise.scales[0],
            nvfp4_block_scale(amax_b, nvfp4_global(ieee.rowwise.amax, false).s_enc))
      << "amax " << ieee.rowwise.amax << " amax_b " << amax_b;
  if (amax_b > 1e-38f) {
    EXPECT_NE(ieee.rowwise.scales[0], 0);
  }
  EXPECT_EQ(ieee.rowwise.scales, ftz_host.rowwise.scales);
  EXPECT_EQ(ieee.rowwise.codes, ftz_host.rowwise.codes);
}
// The block that once differed between the GPU host's emulator (0x00) and the GPU (0x3A): FP32
// values near the normal/subnormal boundary with a global amax just under 2^-125.
TEST(Quantize, Nvfp4_TinyBlockScaleIsExact) {
  const uint32_t block0[16] = {0x806d902a, 0x8009132f, 0x004db46a, 0x806c2c2f,
                               0x80b6b750, 0x80f8065d, 0x80e3c11c, 0x001174fd,
                               0x802f6fbc, 0x00ca7d67, 0x8047d0ba, 0x00bae1cf,
                               0x80156dcf, 0x80fa2ed9, 0x006cda04, 0x80450eeb};
  std::vector<float> x(32, 0.0f);
  for (int i = 0; i < 16; ++i) x[i] = test::from_bits(block0[i]);
  x[16] = test::from_bits(0x00fff77eu);
  auto be = make_cpu_backend();
  const QuantizeResult r = quantize_to_host(*be, host_view(x.data(), 1, 32), rowwise_rn());
  // S_enc = FLT_MAX (2688 / amax overflows); 2.2976e-38 * (FLT_MAX / 6) = 1.3031 -> E4M3 1.25
  const Nvfp4Global g = nvfp4_global(r.rowwise.amax, false);
  const float amax_b = test::from_bits(0x00fa2ed9u);
  const float q = fdiv_rn(kNvfp4Range, r.rowwise.amax);
  const float prod = fmul_rn(amax_b, fmul_rn(g.s_enc, 1.0f / 6.0f));
  EXPECT_EQ(g.s_enc, kFltMax) << "2688/amax = " << q << " (bits " << std::hex << test::bits(q)
                              << ")";
  EXPECT_EQ(r.rowwise.scales[0], 0x3A)
      << "amax " << std::hex << test::bits(r.rowwise.amax) << " s_enc " << test::bits(g.s_enc)
      << " product " << test::bits(prod) << " scale from product " << int(e4m3_rn_satfinite(prod));
}

}  // namespace
}  // namespace fp4sim
#endif
