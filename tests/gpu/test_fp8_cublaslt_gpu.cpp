// FP8 through cuBLASLt's block-scaled FP8 GEMM (--gemm cublaslt: E4M3 codes, VEC128_32F scales,
// gpu/gemm_cublaslt.cu) against the exact FP8 GEMM (DESIGN.md §9; the CUDA twin, itself bitwise
// equal to the emulator, Fp8Gpu.GemmBitwiseEqualsEmulator):
//   - inputs whose every partial sum is exact in any order and at any accumulator width: bitwise
//     equal (this pins down the scale layout, the operand swap, alpha, beta and BF16 output);
//   - random inputs (Gaussian, heavy-tailed, all-positive, block magnitudes spread over 2^±6):
//     every element within fp8_cublaslt_bound, printing the worst difference and diff/bound.
// The exact model is one CTA walking K in order; cuBLASLt picks its own order and split-K. Skips
// without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

#include "emu/backend.hpp"
#include "emu/mma.hpp"
#include "tests/emu/test_util.hpp"
#include "tests/gpu/gpu_test_util.hpp"
#include "tools/backends.hpp"

namespace fp4sim {
namespace {

// Worst-case |D_cublaslt - D_exact| for one output of the FP8 GEMM before the epilogue's own
// roundings (see epilogue_slack), as a formula in K and S = sum_k |a_k b_k| (decoded values, block
// scales included; for an E4M3 subnormal code read |x| as 2^-6, the exponent the tensor core aligns
// it at, so that 2^E(a)+E(b) <= |a||b| holds for every term; S equals the plain sum otherwise).
//
// Exact model, per 128-wide k-block: 4 chained Hopper T-FDPAs (L = 32 products + the running
// partial c, each term truncated toward zero onto the grid 2^(e_max - 13), one RZ to E8M13). With
// 2^e_max no larger than the step's sum of term magnitudes T_i + |c_i|, a step errs by less than 33
// grid units (the truncations) + 1 (the final RZ): 34 * 2^-13 * (T_i + |c_i|). Since |c_i| <= T_1 +
// ... + T_(i-1) (times 1 + 1.7%: the earlier errors), the four steps add up to 34 * 2^-13 * (4 T_1
// + 3 T_2 + 2 T_3 + T_4) <= 4 * 35 * 2^-13 * S_block (35 absorbs the 1.7%). Scaled by s_a * s_b,
// summed over blocks: 140 * 2^-13 * S. The promotion (t = s_a*s_b RN, then one FMA per block) adds
// at most (K/128 + 1) * 2^-24 * S. cuBLASLt on Hopper: its accumulation is not documented; assumed
// the same wgmma arithmetic (F = 13 per 32-wide step). VEC128_32F gives every 128-wide k-block its
// own scale, so partial sums must be promoted to FP32 at least every 128 elements: the same 140 *
// 2^-13 * S. Its promotion order, split-K reduction and two-multiply scaling ((P * s_a) * s_b) add
// at most (3 K/128 + 3) * 2^-24 * S. Both paths err independently, hence the factor 2. About 0.034
// S: a worst case (one large product and 32 just below the grid in every step), so random inputs
// sit far below it; what catches a wrong scale layout is the bitwise test and the spread-magnitude
// fill, where a misplaced scale moves an output by a large multiple of S's dominant block.
static inline double fp8_cublaslt_bound(int64_t k, double sum_abs_scaled, double alpha) {
  const double u13 = std::ldexp(1.0, -kFp8HopperF);  // E8M13 grid relative to the step's e_max
  const double u24 = std::ldexp(1.0, -24);           // FP32 RN
  const double steps_per_block = static_cast<double>(kFp8Block / kFp8FdpaL);  // 4
  const double per_step = kFp8FdpaL + 3.0;  // 33 truncated terms + final RZ + growth slack
  const double blocks = static_cast<double>(k / kFp8Block);
  const double exact_path = steps_per_block * per_step * u13 + (blocks + 1.0) * u24;
  const double cublaslt_path = steps_per_block * per_step * u13 + (3.0 * blocks + 3.0) * u24;
  return (exact_path + cublaslt_path) * sum_abs_scaled * std::fabs(alpha);
}

// The epilogue, both paths: t = alpha * acc (RN), beta * C (RN), t + beta * C (RN), each within
// 2^-24 of its result, |t| <= |D| + |beta C|: 2 * 2^-24 * (2 |D| + 2 |beta C|). With BF16 output
// each path's RNE to BF16 adds at most 2^-8 of its result (half an ulp of an 8-bit significand).
double epilogue_slack(double d_exact, double d_cublaslt, double beta_c, bool bf16_out) {
  const double d = std::max(std::fabs(d_exact), std::fabs(d_cublaslt));
  double s = std::ldexp(1.0, -22) * (d + std::fabs(beta_c));
  if (bf16_out) s += std::ldexp(1.0, -8) * (std::fabs(d_exact) + std::fabs(d_cublaslt));
  return s;
}

QuantizedHost quantize_fp8(Backend& be, std::vector<float>& x, int64_t rows, int64_t cols,
                           bool tiles_128x128) {
  QuantizeConfig c;
  c.format = QFormat::FP8;
  c.block_2d = tiles_128x128;
  c.rowwise.enabled = true;
  return quantize_to_host(be, host_view(x.data(), rows, cols), c).rowwise;
}

float value_of(uint32_t bits, GemmOut out) {
  return out == GemmOut::BF16 ? bf16_to_f32(static_cast<uint16_t>(bits)) : test::from_bits(bits);
}

float fp8_scale(const QuantizedHost& q, int64_t r, int64_t blk) {
  float s;
  std::memcpy(&s, q.scales.data() + (r * (q.cols / kFp8Block) + blk) * sizeof(float), sizeof s);
  return s;
}

// |x| of an E4M3 code as the tensor core aligns it: subnormals read at 2^-6, zeros stay 0.
double aligned_magnitude(uint8_t code) {
  const double v = std::fabs(static_cast<double>(e4m3_to_f32(code)));
  return v == 0.0 ? 0.0 : std::max(v, std::ldexp(1.0, -6));
}

// S[m, n] = sum_k s_a s_b |qa_k| |qb_k| (aligned magnitudes), in double.
std::vector<double> sum_abs_products(const QuantizedHost& a, const QuantizedHost& b) {
  const int64_t M = a.rows, N = b.rows, K = a.cols;
  std::vector<double> ma(static_cast<size_t>(M * K)), mb(static_cast<size_t>(N * K));
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < K; ++k)
      ma[r * K + k] = aligned_magnitude(a.codes[r * K + k]) * fp8_scale(a, r, k / kFp8Block);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t k = 0; k < K; ++k)
      mb[r * K + k] = aligned_magnitude(b.codes[r * K + k]) * fp8_scale(b, r, k / kFp8Block);
  std::vector<double> s(static_cast<size_t>(M * N));
#pragma omp parallel for
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += ma[m * K + k] * mb[n * K + k];
      s[m * N + n] = acc;
    }
  return s;
}

enum class Kind { Gaussian, HeavyTailed, AllPositive, SpreadBlocks };
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Gaussian:
      return "gaussian";
    case Kind::HeavyTailed:
      return "heavy-tailed";
    case Kind::AllPositive:
      return "all-positive";
    case Kind::SpreadBlocks:
      return "spread-blocks";
  }
  return "?";
}

// rows x cols inputs; SpreadBlocks multiplies each 1x128 block (or, for a 128x128-tile operand,
// each tile) by 2^e, e uniform in [-6, 6], so block scales differ by up to 2^12.
std::vector<float> make_input(Kind kind, int64_t rows, int64_t cols, uint64_t seed, bool tiles) {
  std::vector<float> x =
      test::make_fill(kind == Kind::HeavyTailed ? test::Fill::HeavyTailed : test::Fill::Gaussian,
                      static_cast<size_t>(rows * cols), seed);
  if (kind == Kind::AllPositive)
    for (auto& v : x) v = std::fabs(v);
  if (kind == Kind::SpreadBlocks) {
    std::mt19937_64 rng(seed ^ 0x5bd1e995u);
    const int64_t group = tiles ? kFp8Block : 1, kb = cols / kFp8Block;
    std::vector<int> e(static_cast<size_t>((rows + group - 1) / group * kb));
    for (auto& v : e) v = static_cast<int>(rng() % 13) - 6;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        x[r * cols + c] = std::ldexp(x[r * cols + c], e[(r / group) * kb + c / kFp8Block]);
  }
  return x;
}

struct Shape {
  int64_t M, N, K;
};

// Checks every element of cuBLASLt's D against the exact D within the bound; returns max
// diff/bound.
double check_within_bound(const std::string& what, QuantizedHost& a, QuantizedHost& b,
                          const std::vector<float>* c, const GemmConfig& cfg, Backend& cuda) {
  GemmConfig ex = cfg, lt = cfg;
  ex.impl = GemmImpl::Exact;
  lt.impl = GemmImpl::CublasLt;
  const auto de = run_gemm_bits(cuda, a, b, c, ex), dl = run_gemm_bits(cuda, a, b, c, lt);
  const std::vector<double> s = sum_abs_products(a, b);
  const int64_t M = a.rows, N = b.rows, K = a.cols;
  double max_diff = 0, max_ratio = 0;
  int64_t worst = 0;
  bool any_nonzero = false;
  for (int64_t i = 0; i < M * N; ++i) {
    const double x = value_of(de[i], cfg.out), y = value_of(dl[i], cfg.out);
    const double beta_c = c ? static_cast<double>(cfg.beta) * (*c)[i] : 0.0;
    const double bound = fp8_cublaslt_bound(K, s[i], cfg.alpha) +
                         epilogue_slack(x, y, beta_c, cfg.out == GemmOut::BF16);
    const double diff = std::fabs(x - y);
    if (!(diff <= bound)) {
      ADD_FAILURE() << what << " at (" << i / N << "," << i % N << "): exact " << x << " cublaslt "
                    << y << " |diff| " << diff << " > bound " << bound << " (S = " << s[i] << ")";
      return diff / bound;
    }
    any_nonzero = any_nonzero || y != 0.0;
    if (bound > 0 && diff / bound > max_ratio) {
      max_ratio = diff / bound;
      worst = i;
    }
    max_diff = std::max(max_diff, diff);
  }
  EXPECT_TRUE(any_nonzero) << what << ": cuBLASLt returned an all-zero D";
  std::printf("[fp8-cublaslt] %-52s max |diff| %.3g  max diff/bound %.2e (at %lld,%lld: S %.3g)\n",
              what.c_str(), max_diff, max_ratio, static_cast<long long>(worst / N),
              static_cast<long long>(worst % N), s[worst]);
  return max_ratio;
}

TEST(Fp8CublasLtGpu, WithinBoundOfExact) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU: " << gpu_description();
  auto emu = make_backend("emu");
  auto cuda = make_backend("cuda");
  double worst = 0;
  int checked = 0;
  for (const Shape& sh : {Shape{128, 96, 256}, Shape{64, 64, 1024}, Shape{256, 128, 4096}}) {
    for (Kind kind : {Kind::Gaussian, Kind::HeavyTailed, Kind::AllPositive, Kind::SpreadBlocks}) {
      for (bool b_tiles : {false, true}) {  // B as a weight in 128x128 tiles (the fp8 recipe's W)
        if (b_tiles && sh.N % kFp8Block != 0) continue;
        std::vector<float> xa = make_input(kind, sh.M, sh.K, sh.M * 7 + sh.K, false);
        std::vector<float> xb = make_input(kind, sh.N, sh.K, sh.N * 13 + sh.K + 1, b_tiles);
        QuantizedHost a = quantize_fp8(*emu, xa, sh.M, sh.K, false),
                      b = quantize_fp8(*emu, xb, sh.N, sh.K, b_tiles);
        const std::string what = std::to_string(sh.M) + "x" + std::to_string(sh.N) + "x" +
                                 std::to_string(sh.K) + " " + kind_name(kind) +
                                 (b_tiles ? " (B 128x128)" : " (B 1x128)");
        worst = std::max(worst, check_within_bound(what, a, b, nullptr, GemmConfig{}, *cuda));
        ++checked;
        if (HasFailure()) return;
      }
    }
  }
  std::printf("[fp8-cublaslt] %d GEMMs within fp8_cublaslt_bound; largest diff/bound %.2e\n",
              checked, worst);
}

TEST(Fp8CublasLtGpu, Bf16OutputAndAlphaBetaWithinBound) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU: " << gpu_description();
  auto emu = make_backend("emu");
  auto cuda = make_backend("cuda");
  const Shape sh{128, 256, 512};
  std::vector<float> xa = make_input(Kind::Gaussian, sh.M, sh.K, 21, false);
  std::vector<float> xb = make_input(Kind::SpreadBlocks, sh.N, sh.K, 22, true);
  QuantizedHost a = quantize_fp8(*emu, xa, sh.M, sh.K, false),
                b = quantize_fp8(*emu, xb, sh.N, sh.K, true);
  std::vector<float> c =
      test::make_fill(test::Fill::Gaussian, static_cast<size_t>(sh.M * sh.N), 23);
  for (float& v : c) v *= 20.0f;  // comparable to the products
  for (int variant = 0; variant < 4; ++variant) {
    GemmConfig cfg;
    cfg.alpha = variant % 2 ? -1.5f : 0.75f;
    if (variant >= 2) cfg.beta = -0.5f;
    cfg.out = variant == 1 || variant == 3 ? GemmOut::BF16 : GemmOut::F32;
    const std::string what = std::string("alpha ") + std::to_string(cfg.alpha).substr(0, 5) +
                             " beta " + std::to_string(cfg.beta).substr(0, 5) +
                             (cfg.out == GemmOut::BF16 ? " bf16" : " f32");
    check_within_bound(what, a, b, cfg.beta != 0 ? &c : nullptr, cfg, *cuda);
    if (HasFailure()) return;
  }
}

// Inputs built so that every partial sum is an exactly representable value in any order and at any
// accumulator width: each 1x128 block (or 128x128 tile) of x has amax 448 * 2^-j, j in {0, 1, 2},
// so enc = 2^j exactly and the stored scale is 2^-j; its codes are 448 (A at the block's k = 0, B
// at k = 1) and small integers in [-2, 2] elsewhere. A block's code products are integers below
// 2 * 448 * 2 + 126 * 4 = 2296 < 2^12 (exact on the E8M13 grid and in any wgmma), the scaled sums
// are multiples of 2^-5 (alpha 0.5 included) below 48 * 2296 < 2^17 for K <= 6144 (48 blocks): 22
// bits, exact in FP32. C holds
// small integers and beta = -2, so the epilogue is exact too. Any difference is a wrong scale,
// operand, layout or epilogue, not rounding.
std::vector<float> make_exact_input(int64_t rows, int64_t cols, int big_at, bool tiles,
                                    uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t group = tiles ? kFp8Block : 1, kb = cols / kFp8Block;
  std::vector<int> j(static_cast<size_t>((rows + group - 1) / group * kb));
  for (auto& v : j) v = static_cast<int>(rng() % 3);
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int e = j[(r / group) * kb + c / kFp8Block];
      const float v = c % kFp8Block == big_at ? ((rng() & 1) ? -448.0f : 448.0f)
                                              : static_cast<float>(static_cast<int>(rng() % 5) - 2);
      x[r * cols + c] = std::ldexp(v, -e);
    }
  return x;
}

TEST(Fp8CublasLtGpu, ExactlyRepresentableBitwiseEqualsExact) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU: " << gpu_description();
  auto emu = make_backend("emu");
  auto cuda = make_backend("cuda");
  int checked = 0;
  // (1536 x 1536 x 6144: a long-K GEMM for which the plan takes the heuristic's second algorithm,
  // 48 k-blocks keep every sum exact, see above; 2048 x 256 x 512: a tall output over a short K,
  // for which it takes the seventh; gpu/gemm_cublaslt.cu fp8_preferred_algo, on Hopper with
  // cuBLASLt 13.1)
  for (const Shape& sh : {Shape{128, 128, 512}, Shape{64, 256, 4096}, Shape{24, 128, 128},
                          Shape{1536, 1536, 6144}, Shape{2048, 256, 512}}) {
    const bool long_k = sh.K > 4096;
    for (bool b_tiles : {false, true}) {
      std::vector<float> xa = make_exact_input(sh.M, sh.K, 0, false, sh.M + sh.K);
      std::vector<float> xb = make_exact_input(sh.N, sh.K, 1, b_tiles, sh.N * 3 + sh.K);
      QuantizedHost a = quantize_fp8(*emu, xa, sh.M, sh.K, false),
                    b = quantize_fp8(*emu, xb, sh.N, sh.K, b_tiles);
      std::vector<float> c(static_cast<size_t>(sh.M * sh.N));
      for (size_t i = 0; i < c.size(); ++i)
        c[i] = static_cast<float>(static_cast<int>(i * 7 % 17) - 8);
      for (int variant = 0; variant < (long_k ? 2 : 3); ++variant) {
        GemmConfig cfg;
        if (variant >= 1) {
          cfg.alpha = 0.5f;
          cfg.beta = -2.0f;
        }
        if (variant == 2) cfg.out = GemmOut::BF16;
        GemmConfig lt = cfg;
        lt.impl = GemmImpl::CublasLt;
        const std::vector<float>* cp = cfg.beta != 0 ? &c : nullptr;
        const auto de = run_gemm_bits(*cuda, a, b, cp, cfg),
                   dl = run_gemm_bits(*cuda, a, b, cp, lt);
        // (the plan was built by this call; the FP8 rule's index for 2048 x 256 x 512)
        if (sh.M == 2048 && !b_tiles && variant == 0)
          expect_rule_pick(*cuda, 6, "[fp8-cublaslt] 2048x256x512");
        const std::string what = std::to_string(sh.M) + "x" + std::to_string(sh.N) + "x" +
                                 std::to_string(sh.K) + (b_tiles ? " B 128x128" : " B 1x128") +
                                 " variant " + std::to_string(variant);
        bool any_nonzero = false;
        for (size_t i = 0; i < de.size(); ++i) {
          ASSERT_EQ(de[i], dl[i])
              << what << " at (" << i / sh.N << "," << i % sh.N << "): exact "
              << value_of(de[i], cfg.out) << " cublaslt " << value_of(dl[i], cfg.out)
              << " (every sum here is exact: a scale layout, operand or epilogue error)";
          any_nonzero = any_nonzero || value_of(de[i], cfg.out) != 0.0f;
        }
        ASSERT_TRUE(any_nonzero) << what << ": all-zero result proves nothing";
        ++checked;
      }
    }
  }
  std::printf("[fp8-cublaslt] %d exactly representable GEMMs bitwise identical to the exact path\n",
              checked);
}

// Shapes cuBLASLt's block-scaled FP8 does not take are refused with the shape in the message.
TEST(Fp8CublasLtGpu, RejectsRowsNotMultipleOf8) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU: " << gpu_description();
  auto emu = make_backend("emu");
  auto cuda = make_backend("cuda");
  std::vector<float> xa = make_input(Kind::Gaussian, 12, 128, 1, false),
                     xb = make_input(Kind::Gaussian, 16, 128, 2, false);
  QuantizedHost a = quantize_fp8(*emu, xa, 12, 128, false),
                b = quantize_fp8(*emu, xb, 16, 128, false);
  GemmConfig cfg;
  cfg.impl = GemmImpl::CublasLt;
  try {
    run_gemm_bits(*cuda, a, b, nullptr, cfg);
    FAIL() << "expected std::invalid_argument for A with 12 rows";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("12"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace fp4sim
