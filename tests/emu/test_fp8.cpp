// The FP8 block format of the paper's baseline recipe (DESIGN.md §9) on the emulator: the 1x128 and
// 128x128 quantizer's scale rule and special values, the exact transpose of 128x128 weight tiles,
// the exact FP8 GEMM (four chained Hopper FP8 T-FDPAs per 128-block, then one FMA promotion)
// against hand-computed and exactly representable cases, and its bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>

#include "emu/backend.hpp"
#include "emu/gemm.hpp"
#include "emu/mma.hpp"
#include "emu/tfdpa_prepared.hpp"
#include "tests/emu/test_util.hpp"

namespace fp4sim {
namespace {

QuantizeResult fp8_quantize(std::vector<float>& x, int64_t rows, int64_t cols, bool two_d,
                            bool col = false) {
  QuantizeConfig c;
  c.format = QFormat::FP8;
  c.block_2d = two_d;
  c.rowwise.enabled = true;
  c.columnwise.enabled = col;
  return quantize_to_host(*make_cpu_backend(), host_view(x.data(), rows, cols), c);
}

float scale_at(const QuantizedHost& q, int64_t r, int64_t b) {
  float s;
  std::memcpy(&s, &q.scales[4 * static_cast<size_t>(r * (q.cols / kFp8Block) + b)], 4);
  return s;
}

TEST(Fp8, BlockScaleRuleAndSpecials) {
  std::vector<float> x(2 * 256, 0.0f);
  // row 0, block 0: amax 3.5 -> enc = 448 / 3.5 = 128, scale 1/128, 3.5 -> 448 (0x7E)
  x[0] = 3.5f;
  x[1] = -1.0f;  // -> -128 = E4M3 0xF8 (-1.0 * 2^7)
  x[2] = 0.01f;  // 1.28 -> RN on E4M3's grid
  // row 0, block 1: all zero -> enc 1, scale 1, codes 0
  // row 1, block 0: an Inf -> enc = 448 / Inf = 0 -> 1; Inf -> 448 (satfinite), NaN -> 0x7F
  x[256 + 0] = std::numeric_limits<float>::infinity();
  x[256 + 1] = std::numeric_limits<float>::quiet_NaN();
  x[256 + 2] = 2.0f;
  // row 1, block 1: tiny amax, enc overflows FLT_MAX? 448 / 1e-45 = Inf -> FLT_MAX
  x[256 + 128] = 1e-45f;
  QuantizedHost q = fp8_quantize(x, 2, 256, false).rowwise;
  EXPECT_EQ(scale_at(q, 0, 0), 1.0f / 128.0f);
  EXPECT_EQ(q.codes[0], e4m3_rn_satfinite(448.0f));
  EXPECT_EQ(q.codes[1], e4m3_rn_satfinite(-128.0f));
  EXPECT_EQ(q.codes[2], e4m3_rn_satfinite(0.01f * 128.0f));
  EXPECT_EQ(scale_at(q, 0, 1), 1.0f);
  EXPECT_EQ(q.codes[128], 0);
  EXPECT_EQ(scale_at(q, 1, 0), 1.0f);
  EXPECT_EQ(q.codes[256], e4m3_rn_satfinite(448.0f));
  EXPECT_EQ(q.codes[257] & 0x7F, 0x7F);
  EXPECT_EQ(q.codes[258], e4m3_rn_satfinite(2.0f));
  EXPECT_EQ(scale_at(q, 1, 1), 1.0f / std::numeric_limits<float>::max());
  // decode: e4m3 * scale, NaN canonical
  auto be = make_cpu_backend();
  const std::vector<float> d = dequantize_to_host(*be, q);
  EXPECT_EQ(d[0], 3.5f);
  EXPECT_EQ(d[1], -1.0f);
  EXPECT_EQ(test::bits(d[257]), 0x7FFFFFFFu);
}

TEST(Fp8, Tile128IsTheExactTransposeAndErrorIsSmall) {
  const int64_t R = 256, C = 384;
  std::vector<float> x = test::make_fill(test::Fill::HeavyTailed, static_cast<size_t>(R * C), 3);
  const QuantizeResult q = fp8_quantize(x, R, C, true, true);
  auto be = make_cpu_backend();
  QuantizedHost row = q.rowwise, col = q.columnwise;
  const std::vector<float> a = dequantize_to_host(*be, row), b = dequantize_to_host(*be, col);
  double err = 0, ref = 0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      ASSERT_EQ(test::bits(a[r * C + c]), test::bits(b[c * R + r])) << "(" << r << "," << c << ")";
      err += std::pow(a[r * C + c] - x[r * C + c], 2.0);
      ref += std::pow(x[r * C + c], 2.0);
    }
  // one scale per 128x128 tile, written on each of its rows
  EXPECT_EQ(scale_at(row, 0, 1), scale_at(row, 127, 1));
  const double rel = std::sqrt(err / ref);
  std::printf("[fp8] 128x128 tiles, heavy-tailed input: relative error %.4f\n", rel);
  EXPECT_LT(rel, 0.08);
  EXPECT_GT(rel, 0.0);
}

TEST(Fp8, ImpossibleOptionsAreErrors) {
  std::vector<float> x(128 * 100, 1.0f);
  auto be = make_cpu_backend();
  const TensorView v = host_view(x.data(), 100, 128);
  QuantizeConfig c;
  c.format = QFormat::FP8;
  c.rowwise.enabled = true;
  c.rowwise.rounding = Rounding::SR;
  EXPECT_THROW(quantize_to_host(*be, v, c), std::invalid_argument);  // FP8 is RN only
  c.rowwise.rounding = Rounding::RN;
  c.columnwise.enabled = true;  // blocks along 100 rows: not a multiple of 128
  EXPECT_THROW(quantize_to_host(*be, v, c), std::invalid_argument);
  c.columnwise.enabled = false;
  c.block_2d = true;  // 100 rows: not a multiple of the 128-row tile
  EXPECT_THROW(quantize_to_host(*be, v, c), std::invalid_argument);
}

// Backend::quantize_with_bias_backward on the emulator: the copies and dbias of quantize then
// bias_backward, bit for bit (dbias starts non-zero: the column sums are added), and an input
// that is not dense float32 is refused with the tensor's name.
TEST(Fp8, QuantizeWithBiasBackwardIsQuantizeThenBiasBackward) {
  auto be = make_cpu_backend();
  const int64_t R = 256, C = 384;
  std::vector<float> x = test::make_fill(test::Fill::HeavyTailed, static_cast<size_t>(R * C), 41);
  QuantizeConfig c;
  c.format = QFormat::FP8;
  c.rowwise.enabled = c.columnwise.enabled = true;
  TensorView v = host_view(x.data(), R, C, "dy");
  QuantizedHost r1, c1, r2, c2;
  r1.resize(R, C, QFormat::FP8, false);
  c1.resize(C, R, QFormat::FP8, false);
  r2.resize(R, C, QFormat::FP8, false);
  c2.resize(C, R, QFormat::FP8, false);
  std::vector<float> db1(static_cast<size_t>(C), 0.5f), db2 = db1;
  QuantizedView rv1 = r1.view(), cv1 = c1.view(), rv2 = r2.view(), cv2 = c2.view();
  ActivationSource id;
  id.inp = v;
  be->quantize_activation(id, c, &rv1, &cv1, host_view(db1.data(), C, 1, "dbias"));
  be->quantize(v, c, &rv2, &cv2);
  be->bias_backward(host_view(db2.data(), C, 1, "dbias"), v);
  EXPECT_EQ(r1.codes, r2.codes);
  EXPECT_EQ(r1.scales, r2.scales);
  EXPECT_EQ(c1.codes, c2.codes);
  EXPECT_EQ(c1.scales, c2.scales);
  for (int64_t i = 0; i < C; ++i)
    ASSERT_EQ(test::bits(db1[i]), test::bits(db2[i])) << "dbias[" << i << "]";
  // (a view quantize itself accepts: 256 of the 384 columns)
  TensorView strided = v;
  strided.cols = 256;
  strided.row_stride = C;
  try {
    ActivationSource sid;
    sid.inp = strided;
    be->quantize_activation(sid, c, &rv1, &cv1, host_view(db1.data(), C, 1, "dbias"));
    FAIL() << "expected std::invalid_argument for a strided input";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'dy'"), std::string::npos) << e.what();
  }
}

QuantizedHost fp8_operand(int64_t rows, int64_t K, const std::vector<uint8_t>& codes,
                          const std::vector<float>& scales) {
  QuantizedHost q;
  q.resize(rows, K, QFormat::FP8, false);
  q.codes = codes;
  std::memcpy(q.scales.data(), scales.data(), scales.size() * 4);
  return q;
}

float gemm1(QuantizedHost& a, QuantizedHost& b, GemmConfig cfg = {}) {
  float d = 0.0f;
  gemm_exact_host(a.view(), b.view(), nullptr, cfg, &d);
  return d;
}

// Hopper FP8 accumulation: 13 fraction bits on the grid of the 32-wide group's largest product. A
// product of 256 and one of 2^-6 in the same group: the small one falls below 2^(8-13) = 2^-5 and
// is dropped; in separate groups it survives (the partial is E8M13, 256 + 2^-6 needs 15 bits:
// truncated too), and in separate 128-blocks the FMA promotion keeps it (FP32).
TEST(Fp8, GemmModelsHopperAccumulationAndPromotion) {
  const int64_t K = 256;
  auto codes_for = [&](std::vector<std::pair<int, float>> at) {
    std::vector<uint8_t> c(K, 0);
    for (auto [k, v] : at) c[static_cast<size_t>(k)] = e4m3_rn_satfinite(v);
    return c;
  };
  const std::vector<float> ones = {1.0f, 1.0f};
  QuantizedHost b =
      fp8_operand(1, K, codes_for({{0, 16.0f}, {1, 0.125f}, {40, 0.125f}, {128, 0.125f}}), ones);
  // same group: 16*16 + (1/8)*(1/8) = 256 + 2^-6 -> 256
  QuantizedHost a1 = fp8_operand(1, K, codes_for({{0, 16.0f}, {1, 0.125f}}), ones);
  EXPECT_EQ(gemm1(a1, b), 256.0f);
  // other group of the same 128-block: the chained partial is E8M13 (2^-5 quantum at 256): dropped
  QuantizedHost a2 = fp8_operand(1, K, codes_for({{0, 16.0f}, {40, 0.125f}}), ones);
  EXPECT_EQ(gemm1(a2, b), 256.0f);
  // other 128-block: promoted by an FP32 FMA, kept
  QuantizedHost a3 = fp8_operand(1, K, codes_for({{0, 16.0f}, {128, 0.125f}}), ones);
  EXPECT_EQ(gemm1(a3, b), 256.0f + 0.015625f);
  // the block scales multiply in FP32 before the FMA: s_a * s_b * partial
  QuantizedHost a4 = fp8_operand(1, K, codes_for({{0, 16.0f}, {128, 0.125f}}), {0.5f, 3.0f});
  EXPECT_EQ(gemm1(a4, b), 128.0f + 3.0f * 0.015625f);
  // alpha and split-K (two ranges of one block each, added in FP32)
  GemmConfig cfg;
  cfg.alpha = 2.0f;
  cfg.split_k = 2;
  EXPECT_EQ(gemm1(a3, b, cfg), 2.0f * (256.0f + 0.015625f));
}

// The F = 13 boundary and the output rounding, one k-block (the cases `fp4sim probe` runs through a
// Hopper GPU's wgmma): with the largest term 1, 2^-13 is on the grid and 2^-14 below it, a negative
// term is truncated toward zero, a sum past 2 loses its 2^-13 (13 fraction bits, RZ, also when
// negative), the chained partial is a term of the next instruction, and the grid follows the
// largest term, not 1.
TEST(Fp8, GemmHopperF13Boundary) {
  const int64_t K = 128;
  const float t6 = std::ldexp(1.0f, -6), t7 = std::ldexp(1.0f, -7);
  const std::vector<float> one = {1.0f};
  auto gemm_of = [&](std::vector<std::pair<int, float>> a_at,
                     std::vector<std::pair<int, float>> b_at) {
    std::vector<uint8_t> ca(K, 0), cb(K, 0);
    for (auto [k, v] : a_at) ca[static_cast<size_t>(k)] = e4m3_rn_satfinite(v);
    for (auto [k, v] : b_at) cb[static_cast<size_t>(k)] = e4m3_rn_satfinite(v);
    QuantizedHost a = fp8_operand(1, K, ca, one), b = fp8_operand(1, K, cb, one);
    return gemm1(a, b);
  };
  EXPECT_EQ(gemm_of({{0, 1}, {1, t6}}, {{0, 1}, {1, t7}}), 1.0f + std::ldexp(1.0f, -13));
  EXPECT_EQ(gemm_of({{0, 1}, {1, t7}}, {{0, 1}, {1, t7}}), 1.0f);
  EXPECT_EQ(gemm_of({{0, 1}, {1, -t7}}, {{0, 1}, {1, t7}}), 1.0f);
  EXPECT_EQ(gemm_of({{0, 1}, {1, 1}, {2, t6}}, {{0, 1}, {1, 1}, {2, t7}}), 2.0f);
  EXPECT_EQ(gemm_of({{0, -1}, {1, -1}, {2, -t6}}, {{0, 1}, {1, 1}, {2, t7}}), -2.0f);
  EXPECT_EQ(gemm_of({{0, 1}, {32, t7}}, {{0, 1}, {32, t7}}), 1.0f);
  std::vector<std::pair<int, float>> tiny;
  for (int k = 0; k < 32; ++k) tiny.push_back({k, t7});
  EXPECT_EQ(gemm_of(tiny, tiny), std::ldexp(1.0f, -9));
}

// Small integers with power-of-two scales: every step exact, so the GEMM equals the exact sum.
TEST(Fp8, GemmExactOnSmallIntegers) {
  const int64_t M = 5, N = 7, K = 384;
  std::vector<uint8_t> ca(M * K), cb(N * K);
  std::vector<float> va(M * K), vb(N * K);
  for (int64_t i = 0; i < M * K; ++i) {
    va[i] = static_cast<float>(static_cast<int>((i * 7) % 9) - 4);
    ca[i] = e4m3_rn_satfinite(va[i]);
  }
  for (int64_t i = 0; i < N * K; ++i) {
    vb[i] = static_cast<float>(static_cast<int>((i * 5) % 7) - 3);
    cb[i] = e4m3_rn_satfinite(vb[i]);
  }
  std::vector<float> sa(M * 3), sb(N * 3);
  for (size_t i = 0; i < sa.size(); ++i) sa[i] = std::ldexp(1.0f, static_cast<int>(i % 3) - 1);
  for (size_t i = 0; i < sb.size(); ++i) sb[i] = std::ldexp(1.0f, static_cast<int>(i % 2));
  QuantizedHost a = fp8_operand(M, K, ca, sa), b = fp8_operand(N, K, cb, sb);
  std::vector<float> d(M * N);
  gemm_exact_host(a.view(), b.view(), nullptr, GemmConfig{}, d.data());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double want = 0;
      for (int64_t k = 0; k < K; ++k)
        want += static_cast<double>(va[m * K + k]) * vb[n * K + k] * sa[m * 3 + k / 128] *
                sb[n * 3 + k / 128];
      ASSERT_EQ(d[m * N + n], static_cast<float>(want)) << m << "," << n;
    }
  // bad input: K not a multiple of 128, split-K not dividing the 3 blocks, formats mixed
  GemmConfig bad;
  bad.split_k = 2;
  TensorView dv;
  dv.data = d.data();
  dv.rows = M;
  dv.cols = N;
  EXPECT_THROW(validate_gemm(a.view(), b.view(), nullptr, bad, dv), std::invalid_argument);
  QuantizedHost nv;
  nv.resize(N, K, QFormat::NVFP4, false);
  EXPECT_THROW(validate_gemm(a.view(), nv.view(), nullptr, GemmConfig{}, dv),
               std::invalid_argument);
}

// The host GEMM's prepared FP8 T-FDPA equals the literal model on random E4M3 operands (all codes,
// zeros and subnormals included, NaN codes excluded as the GEMM routes them) and C bit patterns.
TEST(Fp8, PreparedTfdpaEqualsLiteral) {
  std::mt19937_64 rng(8);
  int64_t cases = 0;
  for (int it = 0; it < 300000; ++it) {
    float a[kFp8FdpaL], b[kFp8FdpaL];
    double ad[kFp8FdpaL], bd[kFp8FdpaL];
    int32_t ae[kFp8FdpaL], be[kFp8FdpaL];
    const int mode = it % 4;  // 0 any, 1 small range, 2 sparse, 3 cancelling pairs
    for (int k = 0; k < kFp8FdpaL; ++k) {
      uint8_t ca = static_cast<uint8_t>(rng()), cb = static_cast<uint8_t>(rng());
      if (mode == 1)
        ca = static_cast<uint8_t>((ca & 0x87) | 0x30),
        cb = static_cast<uint8_t>((cb & 0x87) | 0x30);
      if (mode == 2 && rng() % 4) ca = 0;
      if (mode == 3 && k % 2) {  // this product cancels the previous one exactly
        ca = e4m3_rn_satfinite(-a[k - 1]);
        cb = e4m3_rn_satfinite(b[k - 1]);
      }
      if ((ca & 0x7F) == 0x7F) ca = 0x7E;
      if ((cb & 0x7F) == 0x7F) cb = 0x7E;
      a[k] = e4m3_to_f32(ca);
      b[k] = e4m3_to_f32(cb);
      ad[k] = a[k];
      bd[k] = b[k];
      ae[k] = e4m3_exponent_reading(a[k]);
      be[k] = e4m3_exponent_reading(b[k]);
    }
    const uint64_t rc = rng();
    uint32_t cb32 = static_cast<uint32_t>(rc >> 32);
    if (rc % 5 == 0) cb32 &= 0x807FFFFFu;                        // subnormal or zero
    if (rc % 5 == 1) cb32 = (cb32 & 0x80000000u) | 0x7F800000u;  // Inf
    if (rc % 5 == 2) cb32 = (cb32 & 0x83FFFFFFu) | 0x40000000u;  // moderate
    const float c = test::from_bits(cb32);
    const uint32_t want = test::bits(tfdpa_fp8_hopper(a, b, c, kE4M3Operand, kE4M3Operand));
    const uint32_t got = test::bits(tfdpa_fp8_hopper_prepared(ad, ae, bd, be, a, b, c));
    ASSERT_EQ(got, want) << "case " << it << " c 0x" << std::hex << cb32;
    ++cases;
  }
  std::printf("[fp8] prepared T-FDPA == literal on %lld cases\n", static_cast<long long>(cases));
}

}  // namespace
}  // namespace fp4sim
