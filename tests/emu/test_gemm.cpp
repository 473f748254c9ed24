// Tier 3 on the emulator: the exact GEMM against the literal per-output GST-FDPA chain, against a
// double-precision product of the dequantized operands, and its bad-input errors.
#include <gtest/gtest.h>

#include <cmath>

#include "emu/backend.hpp"
#include "emu/gemm.hpp"
#include "tests/emu/test_util.hpp"

namespace fp4sim {
namespace {

struct Operands {
  std::vector<float> xa, xb;
  QuantizeResult qa, qb;
};

Operands make_operands(int64_t M, int64_t N, int64_t K, QFormat fmt, uint64_t seed,
                       test::Fill fill = test::Fill::Gaussian) {
  auto be = make_cpu_backend();
  Operands o;
  o.xa = test::make_fill(fill, static_cast<size_t>(M * K), seed);
  o.xb = test::make_fill(fill, static_cast<size_t>(N * K), seed + 1);
  QuantizeConfig c;
  c.format = fmt;
  c.rowwise.enabled = true;
  TensorView va, vb;
  va.data = o.xa.data();
  va.rows = M;
  va.cols = K;
  va.name = "A";
  vb.data = o.xb.data();
  vb.rows = N;
  vb.cols = K;
  vb.name = "B";
  o.qa = quantize_to_host(*be, va, c);
  o.qb = quantize_to_host(*be, vb, c);
  return o;
}

// The literal contract: per output, the chunks in increasing k, each GST-FDPA from packed codes.
float literal_output(QuantizedHost& a, QuantizedHost& b, int64_t m, int64_t n,
                     const GemmConfig& cfg, float cval) {
  const int64_t K = a.cols, chunks = gemm_chunks(K), per = chunks / cfg.split_k;
  const int64_t block = a.block_size(), spr = K / block;
  const int nsc = a.format == QFormat::MXFP4 ? 2 : 4;
  float total = 0.0f;
  for (int s = 0; s < cfg.split_k; ++s) {
    float acc = 0.0f;
    for (int64_t ch = s * per; ch < (s + 1) * per; ++ch) {
      uint8_t pa[32] = {}, pb[32] = {}, sa[4] = {}, sb[4] = {};
      for (int k = 0; k < 64; ++k) {
        const int64_t kk = ch * 64 + k;
        if (kk >= K) break;
        const int64_t ea = m * K + kk, eb = n * K + kk;
        pa[k / 2] |= ((a.codes[ea / 2] >> (4 * (ea & 1))) & 0xF) << (4 * (k & 1));
        pb[k / 2] |= ((b.codes[eb / 2] >> (4 * (eb & 1))) & 0xF) << (4 * (k & 1));
      }
      for (int i = 0; i < nsc; ++i) {
        const int64_t kk = ch * 64 + i * (64 / nsc);
        sa[i] = kk < K ? a.scales[m * spr + kk / block] : 0;
        sb[i] = kk < K ? b.scales[n * spr + kk / block] : 0;
      }
      acc = gst_fdpa_fp4(pa, pb, sa, sb, scale_kind_of(a.format), acc);
    }
    total = s == 0 ? acc : total + acc;
  }
  const float alpha =
      gemm_epilogue_alpha(cfg.alpha, a.format, a.amax, a.four_over_six, b.amax, b.four_over_six);
  const float t = alpha * total;
  const float d = cfg.beta != 0.0f ? t + cfg.beta * cval : t;
  return std::isnan(d) ? test::from_bits(0x7FFFFFFFu) : d;
}

TEST(Gemm, ExactMatchesLiteralChain_AllOptions) {
  auto be = make_cpu_backend();
  struct Shape {
    int64_t M, N, K;
    QFormat f;
  };
  for (const Shape& sh : {Shape{17, 9, 80, QFormat::NVFP4}, Shape{8, 12, 256, QFormat::NVFP4},
                          Shape{5, 7, 96, QFormat::MXFP4}, Shape{6, 4, 384, QFormat::MXFP4}}) {
    for (test::Fill fill : {test::Fill::Gaussian, test::Fill::HeavyTailed, test::Fill::Specials,
                            test::Fill::SignedZeros, test::Fill::Subnormal}) {
      Operands o = make_operands(sh.M, sh.N, sh.K, sh.f, sh.M * 31 + sh.K, fill);
      for (int split : {1, 2}) {
        if (gemm_chunks(sh.K) % split) continue;
        for (bool bf16 : {false, true}) {
          GemmConfig cfg;
          cfg.split_k = split;
          cfg.alpha = 0.75f;
          cfg.beta = bf16 ? 0.5f : 0.0f;
          cfg.out = bf16 ? GemmOut::BF16 : GemmOut::F32;
          std::vector<float> c =
              test::make_fill(test::Fill::Gaussian, static_cast<size_t>(sh.M * sh.N), 5);
          TensorView cv;
          cv.data = c.data();
          cv.rows = sh.M;
          cv.cols = sh.N;
          std::vector<float> d32(static_cast<size_t>(sh.M * sh.N));
          std::vector<uint16_t> d16(d32.size());
          TensorView dv;
          dv.data = bf16 ? static_cast<void*>(d16.data()) : static_cast<void*>(d32.data());
          dv.dtype = bf16 ? DType::BF16 : DType::F32;
          dv.rows = sh.M;
          dv.cols = sh.N;
          QuantizedView a = o.qa.rowwise.view(), b = o.qb.rowwise.view();
          be->gemm(a, b, cfg.beta != 0.0f ? &cv : nullptr, cfg, dv);
          for (int64_t m = 0; m < sh.M; ++m)
            for (int64_t n = 0; n < sh.N; ++n) {
              const float want =
                  literal_output(o.qa.rowwise, o.qb.rowwise, m, n, cfg, c[m * sh.N + n]);
              const uint32_t got =
                  bf16 ? static_cast<uint32_t>(d16[m * sh.N + n]) : test::bits(d32[m * sh.N + n]);
              const uint32_t exp = bf16 ? bf16_rne(want) : test::bits(want);
              const bool both_nan = std::isnan(want) && (bf16 ? (got & 0x7FFF) > 0x7F80
                                                              : std::isnan(d32[m * sh.N + n]));
              ASSERT_TRUE(got == exp || both_nan)
                  << test::fill_name(fill) << " split " << split << " bf16 " << bf16 << " at (" << m
                  << "," << n << "): got 0x" << std::hex << got << " want 0x" << exp;
            }
        }
      }
    }
  }
}

TEST(Gemm, CloseToDoubleProductOfDequantizedOperands) {
  auto be = make_cpu_backend();
  for (QFormat f : {QFormat::NVFP4, QFormat::MXFP4}) {
    const int64_t M = 16, N = 24, K = 512;
    Operands o = make_operands(M, N, K, f, 77);
    const auto da = dequantize_to_host(*be, o.qa.rowwise),
               db = dequantize_to_host(*be, o.qb.rowwise);
    std::vector<float> d(static_cast<size_t>(M * N));
    TensorView dv;
    dv.data = d.data();
    dv.rows = M;
    dv.cols = N;
    QuantizedView a = o.qa.rowwise.view(), b = o.qb.rowwise.view();
    be->gemm(a, b, nullptr, GemmConfig{}, dv);
    double worst = 0;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double ref = 0, mag = 0;
        for (int64_t k = 0; k < K; ++k) {
          ref += static_cast<double>(da[m * K + k]) * db[n * K + k];
          mag += std::fabs(static_cast<double>(da[m * K + k]) * db[n * K + k]);
        }
        worst = std::max(worst, std::fabs(d[m * N + n] - ref) / mag);
      }
    // the dequantized values carry their own FP32 rounding of the decode factor: a few ulps of
    // sum |a||b| is the expected distance, far above it would mean a wrong scale or alignment
    EXPECT_LT(worst, 1e-5) << qformat_name(f);
    EXPECT_GT(std::fabs(d[0]), 0.0f);  // refuse an all-zero result
  }
}

TEST(Gemm, BadInputIsAClearError) {
  auto be = make_cpu_backend();
  Operands o = make_operands(4, 4, 64, QFormat::NVFP4, 1);
  Operands p = make_operands(4, 4, 128, QFormat::NVFP4, 2);
  Operands mx = make_operands(4, 4, 64, QFormat::MXFP4, 3);
  std::vector<float> d(16);
  TensorView dv;
  dv.data = d.data();
  dv.rows = 4;
  dv.cols = 4;
  QuantizedView a = o.qa.rowwise.view(), b = o.qb.rowwise.view(), b2 = p.qb.rowwise.view(),
                bm = mx.qb.rowwise.view();
  auto expect_error = [&](const QuantizedView& x, const QuantizedView& y, GemmConfig cfg,
                          const char* needle) {
    try {
      be->gemm(x, y, nullptr, cfg, dv);
      FAIL() << "expected error " << needle;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(a, b2, GemmConfig{}, "K differs");
  expect_error(a, bm, GemmConfig{}, "nvfp4");
  GemmConfig s3;
  s3.split_k = 3;
  expect_error(a, b, s3, "--split-k 3");
  GemmConfig beta;
  beta.beta = 1.0f;
  expect_error(a, b, beta, "--beta needs C");
}

}  // namespace
}  // namespace fp4sim
