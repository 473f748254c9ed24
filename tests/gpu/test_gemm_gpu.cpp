// Tier 3 (DESIGN.md §10): the CUDA exact GEMM == the emulator's, bitwise, for shapes, formats,
// split-K, alpha/beta, BF16 output and special values. Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "emu/backend.hpp"
#include "tests/emu/test_util.hpp"
#include "tests/gpu/gpu_test_util.hpp"
#include "tools/backends.hpp"

namespace fp4sim {
namespace {

// The emulator's row-wise copy (1x16 NVFP4 or 1x32 MXFP4, RN) of a rows x K fill: a GEMM operand.
QuantizedHost quantized_operand(Backend& emu, QFormat f, test::Fill fill, int64_t rows, int64_t K,
                                uint64_t seed) {
  std::vector<float> x = test::make_fill(fill, static_cast<size_t>(rows * K), seed);
  TensorView v;
  v.data = x.data();
  v.rows = rows;
  v.cols = K;
  QuantizeConfig qc;
  qc.format = f;
  qc.rowwise.enabled = true;
  return quantize_to_host(emu, v, qc).rowwise;
}

TEST(GemmGpu, ExactBitwiseEqualsEmulator) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU: " << gpu_description();
  auto emu = make_backend("emu");
  auto cuda = make_backend("cuda");
  struct Shape {
    int64_t M, N, K;
  };
  int checked = 0;
  for (QFormat f : {QFormat::NVFP4, QFormat::MXFP4}) {
    for (const Shape& s :
         {Shape{64, 64, 256}, Shape{33, 17, 96}, Shape{128, 96, 320}, Shape{7, 130, 1024}}) {
      if (f == QFormat::MXFP4 && s.K % 32) continue;
      for (test::Fill fill :
           {test::Fill::Gaussian, test::Fill::HeavyTailed, test::Fill::Specials,
            test::Fill::Subnormal, test::Fill::SignedZeros, test::Fill::HugeTiny}) {
        QuantizedHost a = quantized_operand(*emu, f, fill, s.M, s.K, s.M + s.K);
        QuantizedHost b = quantized_operand(*emu, f, fill, s.N, s.K, s.N * 3 + s.K);
        std::vector<float> c =
            test::make_fill(test::Fill::Gaussian, static_cast<size_t>(s.M * s.N), 9);
        for (int variant = 0; variant < 3; ++variant) {
          GemmConfig cfg;
          if (variant == 1) {
            cfg.split_k = gemm_chunks(s.K) % 2 == 0 ? 2 : 1;
            cfg.alpha = 1.5f;
          }
          if (variant == 2) {
            cfg.beta = -0.5f;
            cfg.out = GemmOut::BF16;
          }
          const auto e = run_gemm_bits(*emu, a, b, cfg.beta != 0 ? &c : nullptr, cfg);
          const auto g = run_gemm_bits(*cuda, a, b, cfg.beta != 0 ? &c : nullptr, cfg);
          for (size_t i = 0; i < e.size(); ++i)
            ASSERT_EQ(e[i], g[i]) << qformat_name(f) << " " << s.M << "x" << s.N << "x" << s.K
                                  << " " << test::fill_name(fill) << " variant " << variant
                                  << " at (" << i / s.N << ", " << i % s.N << "): emu 0x"
                                  << std::hex << e[i] << " cuda 0x" << g[i];
          ++checked;
        }
      }
    }
  }
  std::printf("[gemm-gpu] %d GEMMs bitwise identical\n", checked);
}

// |cublaslt - exact| <= gemm_cublaslt_bound for every output, and the bound is no looser than 10x
// the largest difference observed (all-positive operands make the rounding errors add up).
TEST(GemmGpu, CublasLtWithinDocumentedBound) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU: " << gpu_description();
  auto emu = make_backend("emu");
  auto cuda = make_backend("cuda");
  double worst_ratio = 0;
  for (QFormat f : {QFormat::NVFP4, QFormat::MXFP4}) {
    for (int64_t K : {64, 512, 4096}) {
      for (int kind = 0; kind < 5; ++kind) {
        // (M 256 at K 64: a tall output over a short K, for which the Hopper plan takes the
        // heuristic's seventh algorithm, gpu/gemm_cublaslt.cu bf16_preferred_algo)
        const int64_t M = K == 64 ? 256 : 64, N = 48;
        std::vector<float> xa =
            test::make_fill(kind == 2 ? test::Fill::HeavyTailed : test::Fill::Gaussian,
                            static_cast<size_t>(M * K), K + kind);
        std::vector<float> xb =
            test::make_fill(test::Fill::Gaussian, static_cast<size_t>(N * K), 3 * K + kind);
        if (kind == 1) {  // all positive: the roundings all point the same way
          for (auto& v : xa) v = std::fabs(v);
          for (auto& v : xb) v = std::fabs(v);
        }
        if (kind == 3) {  // one large product first, then many small ones below the running sum's
                          // alignment grid: the per-term truncation of each path shows up
          for (int64_t m = 0; m < M; ++m)
            for (int64_t k = 0; k < K; ++k)
              xa[m * K + k] = k == 0 ? 6144.0f : 0.000366f * (1 + (m + k) % 3);
          for (auto& v : xb) v = 1.0f;
        }
        if (kind ==
            4) {  // products just below the wgmma alignment grid: 16 products of 36 make the
                  // running sum 576 (e_max 9, grid 2^(9-25) = 2^-16); every later product is
                  // (6 * 2^-11)^2 = 0.56 of that grid. The modelled Hopper T-FDPA (F = 25, RZ)
                  // drops each of them whole; the exact model keeps their 16-element group sums.
          for (int64_t r = 0; r < M; ++r)
            for (int64_t k = 0; k < K; ++k)
              xa[r * K + k] = k < 16 ? 6.0f : (k < 32 ? 0.0f : 6.0f / 2048.0f);
          for (int64_t r = 0; r < N; ++r)
            for (int64_t k = 0; k < K; ++k)
              xb[r * K + k] = k < 16 ? 6.0f : (k < 32 ? 0.0f : 6.0f / 2048.0f);
        }
        TensorView va, vb;
        va.data = xa.data();
        va.rows = M;
        va.cols = K;
        vb.data = xb.data();
        vb.rows = N;
        vb.cols = K;
        QuantizeConfig qc;
        qc.format = f;
        qc.rowwise.enabled = true;
        QuantizedHost a = quantize_to_host(*emu, va, qc).rowwise,
                      b = quantize_to_host(*emu, vb, qc).rowwise;
        GemmConfig ex, lt;
        lt.impl = GemmImpl::CublasLt;
        const auto de = run_gemm_bits(*cuda, a, b, nullptr, ex),
                   dl = run_gemm_bits(*cuda, a, b, nullptr, lt);
        // (the plan was built by this call; the BF16 rule's index for 256 x 48 x 64)
        if (K == 64 && kind == 0 && f == QFormat::NVFP4)
          expect_rule_pick(*cuda, 6, "[cublaslt-bound] 256x48x64 BF16");
        const float alpha = gemm_epilogue_alpha(1.0f, f, a.amax, false, b.amax, false);
        // operands dequantized with their block scales only
        auto deq = [](QuantizedHost& q, int64_t r, int64_t k) {
          const int64_t e = r * q.cols + k;
          const uint8_t s = q.scales[r * (q.cols / q.block_size()) + k / q.block_size()];
          const double sv = q.format == QFormat::MXFP4 ? ue8m0_to_f32(s) : e4m3_to_f32(s);
          return e2m1_to_f32((q.codes[e / 2] >> (4 * (e & 1))) & 0xF) * sv;
        };
        double max_diff = 0, max_ratio = 0;
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < N; ++n) {
            double sum_abs = 0;
            for (int64_t k = 0; k < K; ++k) sum_abs += std::fabs(deq(a, m, k) * deq(b, n, k));
            const float x = test::from_bits(de[m * N + n]), y = test::from_bits(dl[m * N + n]);
            const double diff = std::fabs(static_cast<double>(x) - y);
            const double bound = gemm_cublaslt_bound(K, sum_abs, alpha, std::fabs(x));
            ASSERT_LE(diff, bound) << qformat_name(f) << " K " << K << " kind " << kind << " at ("
                                   << m << "," << n << "): exact " << x << " cublaslt " << y;
            max_diff = std::max(max_diff, diff);
            max_ratio = std::max(max_ratio, diff / bound);
          }
        std::printf("[cublaslt-bound] %s K=%5lld %-12s max |diff| %.3g  max diff/bound %.3f\n",
                    qformat_name(f), static_cast<long long>(K),
                    kind == 0   ? "gaussian"
                    : kind == 1 ? "positive"
                    : kind == 2 ? "heavy-tailed"
                    : kind == 3 ? "large+small"
                                : "below-grid",
                    max_diff, max_ratio);
        worst_ratio = std::max(worst_ratio, max_ratio);
      }
    }
  }
  std::printf("[cublaslt-bound] largest observed diff/bound: %.3f\n", worst_ratio);
  // Issue 3: the bound may be no looser than 10x the largest difference observed. The below-grid
  // case is built to reach the modelled per-step truncation; if this fails, the hardware keeps more
  // bits than the model's F = 25 (and the bound should be re-derived from what it does).
  EXPECT_GE(worst_ratio, 0.1)
      << "gemm_cublaslt_bound is more than 10x the largest observed difference";
}

}  // namespace
}  // namespace fp4sim
