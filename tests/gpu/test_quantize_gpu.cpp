// Tier 2 (DESIGN.md §10): CUDA quantizers == emulator, bitwise (codes, scales, amax), on random and
// adversarial fills, shapes that are not multiples of the tile, every option. Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "emu/backend.hpp"
#include "tests/emu/quantize_checks.hpp"
#include "tests/emu/test_util.hpp"
#include "tests/gpu/gpu_test_util.hpp"
#include "tools/backends.hpp"

namespace fp4sim {
namespace {

#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU: " << gpu_description()

struct Case {
  std::string name;
  QuantizeConfig cfg;
};

std::vector<Case> all_configs() {
  std::vector<Case> out;
  auto add = [&](const std::string& n, QuantizeConfig c) { out.push_back({n, c}); };
  QuantizeConfig base;
  base.rowwise.enabled = base.columnwise.enabled = true;
  base.seed = 0x5EED;
  base.rowwise.stream = 1;
  base.columnwise.stream = 2;
  add("nvfp4_rn_both", base);
  {
    QuantizeConfig c = base;
    c.columnwise.rounding = Rounding::SR;
    c.columnwise.rht = true;
    add("nvfp4_col_rht_sr", c);
    c.rowwise.rounding =
        Rounding::SR;  // the recipe's dy: Dgrad copy SR, Wgrad copy RHT + SR, one call
    add("nvfp4_row_sr_col_rht_sr", c);
  }
  {
    QuantizeConfig c = base;
    c.rowwise.rounding = c.columnwise.rounding = Rounding::SR;
    add("nvfp4_sr_both", c);
  }
  {
    QuantizeConfig c = base;
    c.columnwise.rht = true;
    add("nvfp4_col_rht_rn", c);
  }
  {
    QuantizeConfig c = base;
    c.block_2d = true;
    add("nvfp4_2d", c);
    {
      QuantizeConfig d = c;  // (unusual: SR on weights) and single 2D copies
      d.rowwise.rounding = d.columnwise.rounding = Rounding::SR;
      add("nvfp4_2d_sr", d);
      d = c;
      d.columnwise.enabled = false;
      add("nvfp4_2d_row_only", d);
      d = c;
      d.rowwise.enabled = false;
      add("nvfp4_2d_col_only", d);
    }
    c.rowwise.four_over_six = c.columnwise.four_over_six = true;
    add("nvfp4_2d_fos_mae", c);
    c.fos_error = FourOverSixError::MSE;
    add("nvfp4_2d_fos_mse", c);
  }
  {
    QuantizeConfig c = base;
    c.rowwise.four_over_six = c.columnwise.four_over_six = true;
    add("nvfp4_fos_mae", c);
    c.fos_error = FourOverSixError::MSE;
    add("nvfp4_fos_mse", c);
  }
  {
    QuantizeConfig c = base;
    c.format = QFormat::MXFP4;
    add("mxfp4_floor", c);
    c.mx_rule = MxScaleRule::Ceil;
    add("mxfp4_ceil", c);
    c.columnwise.rht = true;
    c.columnwise.rounding = Rounding::SR;
    add("mxfp4_col_rht_sr", c);
  }
  {
    QuantizeConfig c = base;
    c.columnwise.enabled = false;
    add("nvfp4_row_only", c);
    c = base;
    c.rowwise.enabled = false;
    c.columnwise.rht = true;
    add("nvfp4_col_only_rht", c);
  }
  return out;
}

using test::expect_same_quantized;

// A host tensor view of rows x cols (row stride `stride`) over x, or over h (x's BF16 bits) for
// BF16.
TensorView strided_input(const std::vector<float>& x, std::vector<uint16_t>& h, DType dt,
                         int64_t rows, int64_t cols, int64_t stride) {
  TensorView v;
  v.data = dt == DType::BF16 ? static_cast<void*>(h.data()) : const_cast<float*>(x.data());
  v.dtype = dt;
  v.rows = rows;
  v.cols = cols;
  v.row_stride = stride;
  return v;
}

// The host FP environment the emulator runs in, before and after the CUDA runtime is loaded.
TEST(QuantizeGpu, HostFloatingPointEnvironment) {
#if defined(__x86_64__)
  std::printf("[fp-env] MXCSR at start 0x%04x\n", _mm_getcsr());
#endif
  REQUIRE_GPU();
  auto cuda = make_backend("cuda");
#if defined(__x86_64__)
  std::printf("[fp-env] MXCSR after CUDA init 0x%04x\n", _mm_getcsr());
#pragma omp parallel
  {
#pragma omp critical
    std::printf("[fp-env] OpenMP thread MXCSR 0x%04x\n", _mm_getcsr());
  }
#endif
  volatile float amax_b = test::from_bits(0x00fa2ed9u);
  volatile float k = kFltMax;
  const float prod = amax_b * (k * (1.0f / 6.0f));
  std::printf("[fp-env] 2.2976e-38 * (FLT_MAX/6) on the host = %g (expect 1.3031)\n", prod);
  EXPECT_GT(prod, 1.0f);
}

TEST(QuantizeGpu, BitwiseEqualsEmulatorAllFillsAllOptions) {
  REQUIRE_GPU();
  auto emu = make_backend("emu");
  auto cuda = make_backend("cuda");
  // shapes: not multiples of the 64x128 tile, tiny, and rectangular both ways
  const std::pair<int64_t, int64_t> shapes[] = {{64, 128}, {96, 160}, {32, 288},
                                                {320, 64}, {16, 32},  {224, 416}};
  int checked = 0;
  for (const Case& cs : all_configs()) {
    for (const auto& [rows, cols] : shapes) {
      for (test::Fill f : test::all_fills()) {
        for (DType dt : {DType::F32, DType::BF16}) {
          std::vector<float> x =
              test::make_fill(f, static_cast<size_t>(rows * cols), rows * 1000 + cols);
          std::vector<uint16_t> h(x.size());
          TensorView v;
          v.rows = rows;
          v.cols = cols;
          v.dtype = dt;
          if (dt == DType::BF16) {
            for (size_t i = 0; i < x.size(); ++i) h[i] = bf16_rne(x[i]);
            v.data = h.data();
          } else {
            v.data = x.data();
          }
          QuantizeConfig c = cs.cfg;
          // 32-blocks along both dimensions for MXFP4 both copies
          if (c.format == QFormat::MXFP4 && (rows % 32 || cols % 32)) continue;
          const std::string what = cs.name + " " + shape_str(rows, cols) + " " +
                                   test::fill_name(f) + " " + dtype_name(dt);
          const QuantizeResult a = quantize_to_host(*emu, v, c);
          const QuantizeResult b = quantize_to_host(*cuda, v, c);
          if (c.rowwise.enabled && a.rowwise.scales != b.rowwise.scales) {
            // diagnostics for the first block that differs
            for (size_t i = 0; i < a.rowwise.scales.size(); ++i)
              if (a.rowwise.scales[i] != b.rowwise.scales[i]) {
                const int64_t blk = static_cast<int64_t>(i) % (cols / a.rowwise.block_size());
                const int64_t r = static_cast<int64_t>(i) / (cols / a.rowwise.block_size());
                std::printf("block %zu (row %lld): amax emu %08x cuda %08x; values:", i,
                            (long long)r, test::bits(a.rowwise.amax), test::bits(b.rowwise.amax));
                for (int64_t k = 0; k < a.rowwise.block_size(); ++k)
                  std::printf(" %08x", test::bits(x[r * cols + blk * a.rowwise.block_size() + k]));
                std::printf("\n");
                break;
              }
          }
          if (c.rowwise.enabled) expect_same_quantized(a.rowwise, b.rowwise, what + " row-wise");
          if (c.columnwise.enabled)
            expect_same_quantized(a.columnwise, b.columnwise, what + " column-wise");
          if (HasFatalFailure()) return;
          ++checked;
        }
      }
    }
  }
  std::printf("[quantize-gpu] %d configurations bitwise identical (codes, scales, amax)\n",
              checked);
  EXPECT_GT(checked, 1000);
}

TEST(QuantizeGpu, DequantizeAndTiledScalesMatchEmulator) {
  REQUIRE_GPU();
  auto emu = make_backend("emu");
  auto cuda = make_backend("cuda");
  for (QFormat fmt : {QFormat::NVFP4, QFormat::MXFP4}) {
    std::vector<float> x = test::make_fill(test::Fill::Specials, 192 * 96, 77);
    TensorView v;
    v.data = x.data();
    v.rows = 192;
    v.cols = 96;
    QuantizeConfig c;
    c.format = fmt;
    c.rowwise.enabled = true;
    QuantizeResult r = quantize_to_host(*emu, v, c);
    const auto de = dequantize_to_host(*emu, r.rowwise), dg = dequantize_to_host(*cuda, r.rowwise);
    for (size_t i = 0; i < de.size(); ++i) ASSERT_EQ(test::bits(de[i]), test::bits(dg[i])) << i;
    const int64_t kb = 96 / (fmt == QFormat::MXFP4 ? kMxfp4Block : kNvfp4Block);
    std::vector<uint8_t> te(static_cast<size_t>(tiled_scale_bytes(192, kb))), tg(te.size());
    emu->scales_to_tiled(r.rowwise.scales.data(), 192, kb, te.data());
    BackendBuffer s(*cuda, r.rowwise.scales.size()), o(*cuda, tg.size());
    cuda->upload(s.get(), r.rowwise.scales.data(), r.rowwise.scales.size());
    cuda->scales_to_tiled(s.as<uint8_t>(), 192, kb, o.as<uint8_t>());
    cuda->download(tg.data(), o.get(), tg.size());
    EXPECT_EQ(te, tg);
  }
}

// The quantization statistics' error sums on the GPU equal the emulator's bit for bit (same
// per-block function, same order), for every format and option of the recipes' row-wise copies
// and every fill, on copies the emulator made.
TEST(QuantizeGpu, ErrorSumsEqualEmulator) {
  REQUIRE_GPU();
  auto emu = make_backend("emu");
  auto cuda = make_backend("cuda");
  const int64_t n = 256;
  for (const auto& [name, cfg] : test::error_sum_configs())
    for (test::Fill f : test::all_fills()) {
      std::vector<float> x = test::make_fill(f, static_cast<size_t>(n * n), 616);
      QuantizeResult r = quantize_to_host(*emu, host_view(x.data(), n, n), cfg);
      test::expect_error_sums_identical(quant_error_sums_on(*cuda, x, r.rowwise),
                                        quant_error_sums_on(*emu, x, r.rowwise),
                                        name + " " + test::fill_name(f));
    }
  // a large tensor: many blocks per thread of the grid-stride loop, rows longer than one block's
  // threads
  std::vector<float> x = test::make_fill(test::Fill::HeavyTailed, 2048 * 3072, 617);
  QuantizeConfig c;
  c.rowwise.enabled = true;
  QuantizeResult r = quantize_to_host(*emu, host_view(x.data(), 2048, 3072), c);
  test::expect_error_sums_identical(quant_error_sums_on(*cuda, x, r.rowwise),
                                    quant_error_sums_on(*emu, x, r.rowwise), "nvfp4 2048 x 3072");
}

// The CUDA quantizer: both copies from one call equal each from its own call (the recipes'
// combined calls), every format and option pair, bit for bit.
TEST(QuantizeGpu, CopiesFromOneCallEqualSeparateCalls) {
  REQUIRE_GPU();
  auto cuda = make_backend("cuda");
  test::check_copy_pairs(*cuda);
}

// NVFP4 row-wise RN and column-wise RHT + SR copies from one call, with the given seed and streams.
QuantizeConfig rowwise_rn_columnwise_rht_sr(uint64_t seed, uint64_t row_stream,
                                            uint64_t col_stream) {
  QuantizeConfig c;
  c.rowwise.enabled = c.columnwise.enabled = true;
  c.columnwise.rht = true;
  c.columnwise.rounding = Rounding::SR;
  c.seed = seed;
  c.rowwise.stream = row_stream;
  c.columnwise.stream = col_stream;
  return c;
}

TEST(QuantizeGpu, LargeTensorMatchesEmulator) {
  REQUIRE_GPU();
  auto emu = make_backend("emu");
  auto cuda = make_backend("cuda");
  std::vector<float> x = test::make_fill(test::Fill::HeavyTailed, 1024 * 2048, 99);
  std::vector<uint16_t> h(x.size());
  for (size_t i = 0; i < x.size(); ++i) h[i] = bf16_rne(x[i]);
  TensorView v;
  v.data = h.data();
  v.dtype = DType::BF16;
  v.rows = 1024;
  v.cols = 2048;
  const QuantizeConfig c = rowwise_rn_columnwise_rht_sr(1234, 0, 99);
  const QuantizeResult a = quantize_to_host(*emu, v, c), b = quantize_to_host(*cuda, v, c);
  expect_same_quantized(a.rowwise, b.rowwise, "1024x2048 row-wise");
  expect_same_quantized(a.columnwise, b.columnwise, "1024x2048 column-wise rht sr");
#if FP4SIM_HAVE_CUDA
  // both ways of the RHT copy, whichever is the default: the output kept by the amax pass, or
  // transformed twice: the same bits
  for (bool keep : {true, false}) {
    gpu::CudaOptions opt;
    opt.quantize_keep_rht = keep ? 1 : 0;
    const QuantizeResult t = quantize_to_host(*cuda_backend(opt), v, c);
    const std::string how = keep ? ", RHT output kept" : ", RHT transformed twice";
    expect_same_quantized(a.rowwise, t.rowwise, "1024x2048 row-wise" + how);
    expect_same_quantized(a.columnwise, t.columnwise, "1024x2048 column-wise rht sr" + how);
  }
#endif
}

#if FP4SIM_HAVE_CUDA
// The pipelined RHT amax pass (persistent CTAs, cp.async double buffering; the training step's
// shapes: cols % 128 == 0, rows % 32 == 0) on a tensor with more 32 x 128 tiles than the grid has
// CTAs, so CTAs take several tiles: FP32 and BF16 input, dense and strided rows, heavy-tailed
// values with a NaN (finite amax), then with an Inf too, against the emulator, with the RHT output
// kept and transformed twice. (13 column tiles: no multiple of 132, so the persistent grid's walk
// wraps across tile rows.)
TEST(QuantizeGpu, RhtAmaxPipelineMatchesEmulator) {
  REQUIRE_GPU();
  auto emu = make_backend("emu");
  gpu::CudaOptions kept, twice;
  kept.quantize_keep_rht = 1;
  twice.quantize_keep_rht = 0;
  auto cuda_kept = cuda_backend(kept), cuda_twice = cuda_backend(twice);
  const int64_t rows = 4096, cols = 1664, stride = 1792;
  const QuantizeConfig c = rowwise_rn_columnwise_rht_sr(77, 1, 2);
  int checked = 0;
  // finite values with one NaN (which every amax ignores: the amax then depends on every tile,
  // each CTA's several tiles included), then the same with one Inf (which makes both amax Inf)
  for (bool with_inf : {false, true}) {
    std::vector<float> x =
        test::make_fill(test::Fill::HeavyTailed, static_cast<size_t>(rows * stride), 4242);
    x[static_cast<size_t>(2000 * stride + 1000)] = std::nanf("");
    if (with_inf)
      x[static_cast<size_t>(17 * stride + 300)] = std::numeric_limits<float>::infinity();
    std::vector<uint16_t> h(x.size());
    for (size_t i = 0; i < x.size(); ++i) h[i] = bf16_rne(x[i]);
    for (DType dt : {DType::F32, DType::BF16}) {
      for (int64_t st : {cols, stride}) {
        const TensorView v = strided_input(x, h, dt, rows, cols, st);
        const QuantizeResult e = quantize_to_host(*emu, v, c);
        for (bool keep : {true, false}) {  // the RHT output kept by the amax pass, and not
          const QuantizeResult g = quantize_to_host(keep ? *cuda_kept : *cuda_twice, v, c);
          const std::string what = std::string(dtype_name(dt)) + " stride " + std::to_string(st) +
                                   (keep ? " kept" : " twice") +
                                   (with_inf ? " with Inf" : " finite");
          expect_same_quantized(e.rowwise, g.rowwise, what + " row-wise");
          expect_same_quantized(e.columnwise, g.columnwise, what + " column-wise rht sr");
          if (HasFatalFailure()) return;
          if (!with_inf) {
            EXPECT_TRUE(std::isfinite(g.rowwise.amax) && std::isfinite(g.columnwise.amax)) << what;
          }
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 16);
}

// The tile pass launched after the amax pass as an ordinary launch
// (CudaOptions::quantize_early_launch off) gives the default's bits: row + column RN (contiguous
// amax pass) and row RN + column RHT + SR, FP32 and BF16 input, a shape with edge tiles.
TEST(QuantizeGpu, LateQuantizePassGivesSameBits) {
  REQUIRE_GPU();
  auto cuda = make_backend("cuda");
  gpu::CudaOptions late;
  late.quantize_early_launch = false;
  auto cuda_late = cuda_backend(late);
  const int64_t rows = 320, cols = 416;
  const std::vector<float> x =
      test::make_fill(test::Fill::HeavyTailed, static_cast<size_t>(rows * cols), 31);
  std::vector<uint16_t> h(x.size());
  for (size_t i = 0; i < x.size(); ++i) h[i] = bf16_rne(x[i]);
  QuantizeConfig rn = rowwise_rn_columnwise_rht_sr(5, 1, 2);
  rn.columnwise.rht = false;
  rn.columnwise.rounding = Rounding::RN;
  const QuantizeConfig rht = rowwise_rn_columnwise_rht_sr(5, 1, 2);
  int checked = 0;
  const QuantizeConfig* configs[] = {&rn, &rht};
  for (const QuantizeConfig* c : configs) {
    for (DType dt : {DType::F32, DType::BF16}) {
      const TensorView v = strided_input(x, h, dt, rows, cols, cols);
      const QuantizeResult want = quantize_to_host(*cuda, v, *c);
      const QuantizeResult g = quantize_to_host(*cuda_late, v, *c);
      const std::string what =
          std::string(c == &rn ? "row + column RN " : "row RN + column RHT SR ") + dtype_name(dt) +
          " late launch";
      expect_same_quantized(want.rowwise, g.rowwise, what + " row-wise");
      expect_same_quantized(want.columnwise, g.columnwise, what + " column-wise");
      if (HasFatalFailure()) return;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 4);
}

// A linear layer's output gradient in the NVFP4 recipe (row-wise SR copy, column-wise RHT + SR
// copy) with its bias gradient from one call (Backend::quantize_activation with an Identity source
// and dbias: on the GPU the pipelined RHT amax pass also takes the 64-row column sums) == quantize
// then bias_backward, bit for bit: the copies and dbias (which starts non-zero), against the CUDA
// backend's own two calls (NaN payloads are the GPU's there) and, for finite inputs, the
// emulator's. Shapes: many tiles a CTA (GPU against GPU only), a few, three 64-row chunks; 96 rows
// (not whole 64-row chunks) takes the composition's two calls (emu/fused.hpp), and 256 x 400 (not
// whole 128-column tiles: the 32-row RHT amax pass, which takes no sums) takes the fused quantize
// call with bias_backward's own pass.
TEST(QuantizeGpu, RhtAmaxPassColumnSumsEqualBiasBackward) {
  REQUIRE_GPU();
  auto emu = make_backend("emu");
  auto cuda = make_backend("cuda");
  QuantizeConfig qc = rowwise_rn_columnwise_rht_sr(91, 3, 4);
  qc.rowwise.rounding = Rounding::SR;
  struct Shape {
    int64_t R, C;
    test::Fill fill;
    bool fused, against_emu;
  };
  int checked = 0;
  for (const Shape& k : {Shape{16384, 3072, test::Fill::Gaussian, true, false},
                         Shape{4096, 1536, test::Fill::HeavyTailed, true, true},
                         Shape{256, 384, test::Fill::Gaussian, true, true},
                         Shape{192, 128, test::Fill::Specials, true, false},
                         Shape{96, 256, test::Fill::Gaussian, false, true},
                         Shape{256, 400, test::Fill::Gaussian, false, true}}) {
    const std::vector<float> x = test::make_fill(k.fill, static_cast<size_t>(k.R * k.C), 55);
    std::vector<float> dbias0(static_cast<size_t>(k.C));
    for (size_t i = 0; i < dbias0.size(); ++i)
      dbias0[i] = 0.5f * static_cast<float>(static_cast<int>(i % 7) - 3);
    auto blank = [&] {
      std::pair<QuantizedHost, QuantizedHost> p;
      p.first.resize(k.R, k.C, qc.format, false);
      p.second.resize(k.C, k.R, qc.format, false);
      return p;
    };
    const std::string what = std::string(test::fill_name(k.fill)) + " " + std::to_string(k.R) +
                             "x" + std::to_string(k.C);
    SCOPED_TRACE(what);
    const uint64_t before = cuda_counters(*cuda).fused_bias_backward;
    expect_fused_bias_grad_bitwise(*cuda, k.against_emu ? emu.get() : nullptr, x, k.R, k.C, qc,
                                   dbias0, blank, what);
    EXPECT_EQ(cuda_counters(*cuda).fused_bias_backward, before + (k.fused ? 1 : 0))
        << what << ": fused path taken?";
    ++checked;
  }
  EXPECT_EQ(checked, 6);
}

// Strided inputs (row stride != cols), with RHT kept between the passes and transformed twice: the
// emulator's bits.
TEST(QuantizeGpu, RhtPathsAndStridedInputMatchEmulator) {
  REQUIRE_GPU();
  auto emu = make_backend("emu");
  gpu::CudaOptions kept, twice;
  kept.quantize_keep_rht = 1;
  twice.quantize_keep_rht = 0;
  auto cuda_kept = cuda_backend(kept), cuda_twice = cuda_backend(twice);
  const int64_t rows = 112, cols = 400, stride = 416;  // 112: partial 32- and 64-row tiles
  const std::vector<float> x =
      test::make_fill(test::Fill::HeavyTailed, static_cast<size_t>(rows * stride), 7);
  std::vector<uint16_t> h(x.size());
  for (size_t i = 0; i < x.size(); ++i) h[i] = bf16_rne(x[i]);
  int checked = 0;
  for (const Case& cs : all_configs()) {
    if (cs.cfg.format != QFormat::NVFP4) continue;
    for (DType dt : {DType::F32, DType::BF16}) {
      // (stride 402: rows not 16-byte aligned, so every kernel takes its scalar-load path; with RHT
      // kept, the streaming kernel's unaligned instantiation)
      for (int64_t st : {cols, stride, int64_t{402}}) {
        const TensorView v = strided_input(x, h, dt, rows, cols, st);
        const QuantizeResult e = quantize_to_host(*emu, v, cs.cfg);
        for (bool keep : {true, false}) {
          const QuantizeResult g = quantize_to_host(keep ? *cuda_kept : *cuda_twice, v, cs.cfg);
          const std::string what = cs.name + " " + dtype_name(dt) + " stride " +
                                   std::to_string(st) + (keep ? " rht kept" : " rht twice");
          if (cs.cfg.rowwise.enabled)
            expect_same_quantized(e.rowwise, g.rowwise, what + " row-wise");
          if (cs.cfg.columnwise.enabled)
            expect_same_quantized(e.columnwise, g.columnwise, what + " column-wise");
          if (HasFatalFailure()) return;
          ++checked;
        }
      }
    }
  }
  std::printf("[quantize-gpu] %d stride/RHT-path cases bitwise identical\n", checked);
  EXPECT_GT(checked, 50);
}

// The 64x128 tile kernel's whole tiles write their column-wise codes through shared memory (where
// R % 64 == 0): the emulator's bits, on a 192-row input (three whole row tiles) whose 400 columns
// end in a partial tile, dense and strided, every NVFP4 config, the RHT column copy transformed in
// the tile kernel.
TEST(QuantizeGpu, StagedColumnStoresMatchEmulator) {
  REQUIRE_GPU();
  auto emu = make_backend("emu");
  gpu::CudaOptions twice;  // (the tile kernel transforms the RHT column copy itself)
  twice.quantize_keep_rht = 0;
  auto cuda = cuda_backend(twice);
  const int64_t rows = 192, cols = 400, stride = 416;
  const std::vector<float> x =
      test::make_fill(test::Fill::Specials, static_cast<size_t>(rows * stride), 9);
  std::vector<uint16_t> h(x.size());
  for (size_t i = 0; i < x.size(); ++i) h[i] = bf16_rne(x[i]);
  int checked = 0;
  for (const Case& cs : all_configs()) {
    if (cs.cfg.format != QFormat::NVFP4 || !cs.cfg.columnwise.enabled) continue;
    for (DType dt : {DType::F32, DType::BF16}) {
      for (int64_t st : {cols, stride}) {
        const TensorView v = strided_input(x, h, dt, rows, cols, st);
        const QuantizeResult e = quantize_to_host(*emu, v, cs.cfg);
        const QuantizeResult g = quantize_to_host(*cuda, v, cs.cfg);
        const std::string what = cs.name + " " + dtype_name(dt) + " stride " + std::to_string(st);
        if (cs.cfg.rowwise.enabled) expect_same_quantized(e.rowwise, g.rowwise, what + " row-wise");
        expect_same_quantized(e.columnwise, g.columnwise, what + " column-wise");
        if (HasFatalFailure()) return;
        ++checked;
      }
    }
  }
  std::printf("[quantize-gpu] %d staged column-store cases bitwise identical\n", checked);
  EXPECT_GT(checked, 10);
}

// NVFP4 2D copies from their kernel (one 16x16 block per half-warp), FP32 and BF16 input, dense and
// strided rows, three fills: the emulator's codes, scales and amax (the decoded operand of the
// default kernel: DecodedBf16EqualsDecodeOfCodesAndFeedsTheGemm).
TEST(QuantizeGpu, TwoDKernelMatchesEmulator) {
  REQUIRE_GPU();
  auto emu = make_backend("emu");
  auto cuda = make_backend("cuda");
  const int64_t rows = 208, cols = 400, stride = 416;
  int checked = 0;
  for (const Case& cs : all_configs()) {
    if (cs.cfg.format != QFormat::NVFP4 || !cs.cfg.block_2d) continue;
    for (test::Fill f : {test::Fill::HeavyTailed, test::Fill::Specials, test::Fill::Ties}) {
      const std::vector<float> x = test::make_fill(f, static_cast<size_t>(rows * stride), 11);
      std::vector<uint16_t> h(x.size());
      for (size_t i = 0; i < x.size(); ++i) h[i] = bf16_rne(x[i]);
      for (DType dt : {DType::F32, DType::BF16}) {
        for (int64_t st : {cols, stride}) {
          const TensorView v = strided_input(x, h, dt, rows, cols, st);
          const QuantizeResult e = quantize_to_host(*emu, v, cs.cfg);
          const QuantizeResult g = quantize_to_host(*cuda, v, cs.cfg);
          const std::string what = cs.name + " " + dtype_name(dt) + " stride " + std::to_string(st);
          if (cs.cfg.rowwise.enabled)
            expect_same_quantized(e.rowwise, g.rowwise, what + " row-wise");
          if (cs.cfg.columnwise.enabled)
            expect_same_quantized(e.columnwise, g.columnwise, what + " column-wise");
          if (HasFatalFailure()) return;
          ++checked;
        }
      }
    }
  }
  std::printf("[quantize-gpu] %d 2D kernel cases bitwise identical\n", checked);
  EXPECT_GE(checked, 4 * 3 * 2 * 2);
}

// QuantizedView::decoded_bf16: the BF16 operand the quantizer writes for the cuBLASLt GEMM on
// Hopper equals e2m1(code) * block scale of the codes it wrote (every path: the common-case
// kernel with RHT transformed twice, the streaming kernel from the kept transform,
// and the general kernel for 2D, Four Over Six and MXFP4), the codes are unchanged by asking for
// it, and a GEMM reading it gives the same D bits as one that decodes the codes itself.
TEST(QuantizeGpu, DecodedBf16EqualsDecodeOfCodesAndFeedsTheGemm) {
  REQUIRE_GPU();
  auto emu = make_backend("emu");
  auto cuda = make_backend("cuda");
  gpu::CudaOptions twice;
  twice.quantize_keep_rht = 0;
  auto cuda_twice = cuda_backend(twice);
  EXPECT_FALSE(reads_decoded_operand(*cuda, GemmImpl::Exact));
  EXPECT_FALSE(reads_decoded_operand(*emu, GemmImpl::CublasLt));
  if (!reads_decoded_operand(*cuda, GemmImpl::CublasLt))
    GTEST_SKIP()
        << "this GPU multiplies FP4 natively (compute capability >= 10): no decoded operand";
  struct DevCopy {
    QuantizedBuffers q;
    BackendBuffer decoded;
  };
  // (MXFP4 column-wise copies need rows % 32 == 0; the RHT amax pass's partial 32-row tiles are
  // RhtPathsAndStridedInputMatchEmulator's, 112 rows)
  const std::pair<int64_t, int64_t> shapes[] = {{96, 160}, {64, 288}, {224, 416}};
  int checked = 0;
  for (const Case& cs : all_configs()) {
    for (const auto& [rows, cols] : shapes) {
      for (test::Fill f : {test::Fill::HeavyTailed, test::Fill::Specials, test::Fill::Ties}) {
        for (DType dt : {DType::F32, DType::BF16}) {
          std::vector<float> x =
              test::make_fill(f, static_cast<size_t>(rows * cols), rows * 7 + cols);
          std::vector<uint16_t> h(x.size());
          for (size_t i = 0; i < x.size(); ++i) h[i] = bf16_rne(x[i]);
          TensorView hv;
          hv.data = dt == DType::BF16 ? static_cast<void*>(h.data()) : static_cast<void*>(x.data());
          hv.dtype = dt;
          hv.rows = rows;
          hv.cols = cols;
          const QuantizeResult ref = quantize_to_host(*emu, hv, cs.cfg);
          const size_t in_bytes = x.size() * (dt == DType::BF16 ? 2 : 4);
          BackendBuffer xin(*cuda, in_bytes);
          cuda->upload(xin.get(), hv.data, in_bytes);
          TensorView dv = hv;
          dv.data = xin.get();
          dv.device = Device::Cuda;
          // keep: the streaming kernel where the RHT transform is kept (the tiled kernel
          // otherwise); else the tiled kernel, transforming twice (on cuda_twice)
          for (bool keep : {true, false}) {
            gpu::CudaBackend& qb = keep ? static_cast<gpu::CudaBackend&>(*cuda) : *cuda_twice;
            std::vector<std::unique_ptr<DevCopy>> out(2);
            for (int col = 0; col < 2; ++col) {
              const CopySpec& spec = col ? cs.cfg.columnwise : cs.cfg.rowwise;
              if (!spec.enabled) continue;
              QuantizedHost shape;
              shape.resize(col ? cols : rows, col ? rows : cols, cs.cfg.format, spec.four_over_six);
              out[col] = std::make_unique<DevCopy>(
                  DevCopy{QuantizedBuffers(*cuda, shape), BackendBuffer()});
              out[col]->decoded = BackendBuffer(*cuda, static_cast<size_t>(rows * cols) * 2);
              out[col]->q.view.decoded_bf16 = out[col]->decoded.as<uint16_t>();
            }
            cuda->synchronize();  // (cuda's buffers, written on its stream, read on qb's)
            qb.quantize(dv, cs.cfg, out[0] ? &out[0]->q.view : nullptr,
                        out[1] ? &out[1]->q.view : nullptr);
            qb.synchronize();
            for (int col = 0; col < 2; ++col) {
              if (!out[col]) continue;
              const std::string what = cs.name + " " + dtype_name(dt) + " " + std::to_string(rows) +
                                       "x" + std::to_string(cols) +
                                       (keep ? " rht kept" : " rht twice") +
                                       (col ? " column-wise" : " row-wise");
              QuantizedHost got;
              got.resize(out[col]->q.view.rows, out[col]->q.view.cols, cs.cfg.format,
                         out[col]->q.view.four_over_six);
              out[col]->q.download_to(*cuda, got);
              expect_same_quantized(col ? ref.columnwise : ref.rowwise, got, what);
              std::vector<uint16_t> dec(static_cast<size_t>(rows * cols));
              cuda->download(dec.data(), out[col]->decoded.get(), dec.size() * 2);
              const int64_t block = got.block_size();
              int64_t bad = 0;
              for (int64_t r = 0; r < got.rows; ++r) {
                for (int64_t c = 0; c < got.cols; ++c) {
                  const int64_t e = r * got.cols + c;
                  const uint8_t code =
                      (got.codes[static_cast<size_t>(e / 2)] >> (4 * (e & 1))) & 0xFu;
                  const uint8_t sb =
                      got.scales[static_cast<size_t>(r * (got.cols / block) + c / block)];
                  const float sv =
                      cs.cfg.format == QFormat::MXFP4 ? ue8m0_to_f32(sb) : e4m3_to_f32(sb);
                  const float want = fmul_rn(e2m1_to_f32(code), sv);
                  const uint16_t g = dec[static_cast<size_t>(e)];
                  const bool ok = f32_isnan(want)
                                      ? (g & 0x7FFFu) > 0x7F80u
                                      : g == static_cast<uint16_t>(f32_bits(want) >> 16) &&
                                            (f32_bits(want) & 0xFFFFu) == 0u;
                  if (!ok && ++bad <= 3)
                    ADD_FAILURE() << what << ": element (" << r << ", " << c << ") decoded 0x"
                                  << std::hex << g << ", want 0x" << (f32_bits(want) >> 16)
                                  << std::dec;
                }
              }
              ASSERT_EQ(bad, 0) << what;
              ++checked;
            }
            // the GEMM: A = B = the row-wise copy (rows x cols). D from the codes (a copy of them,
            // no decoded operand) is the reference; then the copy's own codes are overwritten with
            // junk, so a GEMM that reads its decoded operand (both, only A, only B) must still give
            // the reference bits, and one that read the junk codes would not (checked too)
            if (out[0] && f == test::Fill::HeavyTailed && keep) {
              GemmConfig g;
              g.impl = GemmImpl::CublasLt;
              const size_t nd = static_cast<size_t>(rows * rows);
              BackendBuffer d(*cuda, nd * 4),
                  codes(*cuda, static_cast<size_t>(out[0]->q.view.code_bytes()));
              cuda->copy(codes.get(), out[0]->q.view.codes, codes.bytes());
              QuantizedView plain = out[0]->q.view;
              plain.decoded_bf16 = nullptr;
              plain.codes = codes.as<uint8_t>();
              const QuantizedView dec = out[0]->q.view;
              QuantizedView junk = dec;
              junk.decoded_bf16 = nullptr;
              auto run = [&](const QuantizedView& a, const QuantizedView& b) {
                TensorView o;
                o.rows = o.cols = rows;
                o.device = Device::Cuda;
                o.data = d.get();
                cuda->gemm(a, b, nullptr, g, o);
                std::vector<uint32_t> bits(nd);
                cuda->download(bits.data(), d.get(), nd * 4);
                return bits;
              };
              const std::vector<uint32_t> want = run(plain, plain);
              const std::vector<uint8_t> garbage(codes.bytes(), 0x77);  // every code 7 (6.0)
              cuda->upload(dec.codes, garbage.data(), garbage.size());
              ASSERT_EQ(run(dec, dec), want) << cs.name << ": D differs with both operands decoded";
              ASSERT_EQ(run(dec, plain), want) << cs.name << ": D differs with only A decoded";
              ASSERT_EQ(run(plain, dec), want) << cs.name << ": D differs with only B decoded";
              ASSERT_NE(run(junk, plain), want)
                  << cs.name << ": the junk codes do not change D (the check could not fail)";
            }
          }
        }
      }
    }
  }
  std::printf("[quantize-gpu] %d decoded BF16 copies equal the decode of their codes\n", checked);
  EXPECT_GT(checked, 200);
}
#endif

}  // namespace
}  // namespace fp4sim
