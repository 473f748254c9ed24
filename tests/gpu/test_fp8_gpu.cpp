// The FP8 block format on the CUDA backend == the emulator, bit for bit: quantization (1x128 and
// 128x128, row- and column-wise, FP32 and BF16 input, adversarial fills), dequantization, and the
// exact FP8 GEMM (split-K, alpha/beta, BF16 output). Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "emu/backend.hpp"
#include "emu/formats.hpp"
#include "emu/mma.hpp"
#include "tests/emu/quantize_checks.hpp"
#include "tests/emu/test_util.hpp"
#include "tests/gpu/gpu_test_util.hpp"
#include "tools/backends.hpp"

namespace fp4sim {
namespace {

// columnwise: also the transposed copy (it blocks along the rows, so rows must be a multiple of
// 128) pitch: elements from one row to the next (0: cols); x holds rows * pitch values.
QuantizeResult quantize_on(Backend& be, std::vector<float>& x, int64_t rows, int64_t cols,
                           bool bf16, bool two_d, bool columnwise = true, int64_t pitch = 0) {
  std::vector<uint16_t> h;
  TensorView v = host_view(x.data(), rows, cols);
  v.row_stride = pitch;
  if (bf16) {  // the same values as BF16 bit patterns
    h.resize(x.size());
    for (size_t i = 0; i < x.size(); ++i) h[i] = bf16_rne(x[i]);
    v.data = h.data();
    v.dtype = DType::BF16;
  }
  QuantizeConfig c;
  c.format = QFormat::FP8;
  c.block_2d = two_d;
  c.rowwise.enabled = true;
  c.columnwise.enabled = columnwise;
  return quantize_to_host(be, v, c);
}

using test::expect_same_quantized;

// An all-zero FP8 copy of rows x cols on the host (the shape of a quantizer output).
QuantizedHost zero_fp8_host(int64_t rows, int64_t cols) {
  QuantizedHost h;
  h.rows = rows;
  h.cols = cols;
  h.format = QFormat::FP8;
  h.codes.assign(static_cast<size_t>(rows * cols), 0);
  h.scales.assign(static_cast<size_t>(rows * (cols / kFp8Block)) * 4, 0);
  return h;
}

TEST(Fp8Gpu, QuantizeBitwiseEqualsEmulator) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  auto emu = make_backend("emu");
  auto cuda = make_backend("cuda");
  gpu::CudaOptions direct;
  direct.fp8_quantize_staged = false;
  auto cuda_direct = cuda_backend(direct);
  int checked = 0;
  // (staged: whole tiles write the column-wise codes through shared memory, the default; and not)
  for (bool staged : {true, false})
    for (test::Fill fill : {test::Fill::Gaussian, test::Fill::HeavyTailed, test::Fill::Specials,
                            test::Fill::Subnormal, test::Fill::SignedZeros, test::Fill::HugeTiny}) {
      Backend& qb = staged ? *cuda : *cuda_direct;
      for (bool bf16 : {false, true})
        for (bool two_d : {false, true}) {
          // a 256 x 384 input with both copies, and (1x128 only) a 200 x 256 one with the row-wise
          // copy alone: a partial 128-row tile on the GPU
          const bool partial = !two_d && fill != test::Fill::Gaussian;
          const int64_t R = partial ? 200 : 256, C = partial ? 256 : 384;
          std::vector<float> x = test::make_fill(fill, static_cast<size_t>(R * C), 11);
          const QuantizeResult e = quantize_on(*emu, x, R, C, bf16, two_d, !partial),
                               g = quantize_on(qb, x, R, C, bf16, two_d, !partial);
          const std::string what = std::string(test::fill_name(fill)) + (bf16 ? " bf16" : " f32") +
                                   (two_d ? " 2d" : " 1d") + " " + std::to_string(R) + "x" +
                                   std::to_string(C) + (staged ? " staged" : " direct");
          expect_same_quantized(e.rowwise, g.rowwise, what + " row-wise");
          if (!partial) expect_same_quantized(e.columnwise, g.columnwise, what + " column-wise");
          QuantizedHost er = e.rowwise, gr = g.rowwise;
          const std::vector<float> de = dequantize_to_host(*emu, er),
                                   dg = dequantize_to_host(qb, gr);
          for (size_t i = 0; i < de.size(); ++i)
            ASSERT_EQ(test::bits(de[i]), test::bits(dg[i])) << what << " dequant " << i;
          ++checked;
        }
    }
  // rows 129 elements apart (FP32: not 16-byte aligned; BF16: not 8-byte aligned): the kernel's
  // element-by-element loads instead of its vector loads
  for (bool bf16 : {false, true}) {
    const int64_t R = 256, C = 128, P = 129;
    std::vector<float> x = test::make_fill(test::Fill::HeavyTailed, static_cast<size_t>(R * P), 12);
    const QuantizeResult e = quantize_on(*emu, x, R, C, bf16, false, true, P),
                         g = quantize_on(*cuda, x, R, C, bf16, false, true, P);
    const std::string what = std::string("strided") + (bf16 ? " bf16" : " f32");
    expect_same_quantized(e.rowwise, g.rowwise, what + " row-wise");
    expect_same_quantized(e.columnwise, g.columnwise, what + " column-wise");
    ++checked;
  }
  // the column-wise copy alone of a 256 x 200 input: the last 128-column tile is partial, so the
  // kernel's column pairs include lone columns and columns past the tensor
  for (bool bf16 : {false, true}) {
    const int64_t R = 256, C = 200;
    std::vector<float> x = test::make_fill(test::Fill::Gaussian, static_cast<size_t>(R * C), 13);
    std::vector<uint16_t> h(x.size());
    TensorView v = host_view(x.data(), R, C);
    if (bf16) {
      for (size_t i = 0; i < x.size(); ++i) h[i] = bf16_rne(x[i]);
      v.data = h.data();
      v.dtype = DType::BF16;
    }
    QuantizeConfig qc;
    qc.format = QFormat::FP8;
    qc.columnwise.enabled = true;
    const QuantizeResult e = quantize_to_host(*emu, v, qc), g = quantize_to_host(*cuda, v, qc);
    expect_same_quantized(e.columnwise, g.columnwise,
                          std::string("column-only 256x200") + (bf16 ? " bf16" : " f32"));
    ++checked;
  }
  // all-NaN blocks: a column whose rows 0..63 are NaN, one whose 128 rows of the first block all
  // are, and a row whose second 128-column block is: a block max is the NaN-ignoring max from +0,
  // so an all-NaN block has max +0 and scale 1 (a GPU reduction that starts from the first
  // element would give a NaN scale there)
  for (bool bf16 : {false, true}) {
    const int64_t R = 256, C = 256;
    std::vector<float> x = test::make_fill(test::Fill::Gaussian, static_cast<size_t>(R * C), 14);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (int64_t r = 0; r < 64; ++r)
      x[static_cast<size_t>(r * C + 3)] = nan;  // half a column block
    for (int64_t r = 0; r < 128; ++r)
      x[static_cast<size_t>(r * C + 5)] = nan;  // a whole column block
    for (int64_t c = 128; c < 256; ++c)
      x[static_cast<size_t>(130 * C + c)] = nan;  // a whole row block
    const QuantizeResult e = quantize_on(*emu, x, R, C, bf16, false),
                         g = quantize_on(*cuda, x, R, C, bf16, false);
    const std::string what = std::string("NaN blocks") + (bf16 ? " bf16" : " f32");
    expect_same_quantized(e.rowwise, g.rowwise, what + " row-wise");
    expect_same_quantized(e.columnwise, g.columnwise, what + " column-wise");
    ++checked;
  }
  std::printf("[fp8-gpu] %d quantizations bitwise identical (codes, scales, amax, dequant)\n",
              checked);
}

// The scales a copy also gets in cuBLASLt's layout (QuantizedView::scales_gemm, [k-block][row]),
// written by the quantizer itself for both copies and both block shapes: the same bits as its
// row-major scales, re-laid; and the cuBLASLt FP8 GEMM reading them gives the same D, bit for bit,
// as the one that re-lays the row-major scales itself. The emulator refuses such a view.
TEST(Fp8Gpu, GemmLayoutScalesEqualScalesAndGiveTheSameGemm) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  auto emu = make_backend("emu");
  const int64_t R = 256, C = 384;
  for (int variant = 0; variant < 4; ++variant) {
    const bool two_d = (variant & 1) != 0, staged = variant < 2;  // (staged: the kernel's default)
    gpu::CudaOptions opt;
    opt.fp8_quantize_staged = staged;
    auto cuda = cuda_backend(opt);
    std::vector<float> x = test::make_fill(test::Fill::HeavyTailed, static_cast<size_t>(R * C), 21);
    BackendBuffer xb(*cuda, x.size() * 4);
    cuda->upload(xb.get(), x.data(), x.size() * 4);
    TensorView xv;
    xv.data = xb.get();
    xv.rows = R;
    xv.cols = C;
    xv.device = Device::Cuda;
    xv.name = "x";
    QuantizeConfig qc;
    qc.format = QFormat::FP8;
    qc.block_2d = two_d;
    qc.rowwise.enabled = qc.columnwise.enabled = true;
    struct Copy {
      QuantizedBuffers buf;
      BackendBuffer sg;
    };
    auto make = [&](int64_t rows, int64_t cols) {
      Copy c{QuantizedBuffers(*cuda, zero_fp8_host(rows, cols)),
             BackendBuffer(*cuda, static_cast<size_t>(rows * (cols / kFp8Block)) * 4)};
      c.buf.view.scales_gemm = c.sg.as<float>();
      return c;
    };
    Copy row = make(R, C), col = make(C, R);
    cuda->quantize(xv, qc, &row.buf.view, &col.buf.view);
    cuda->synchronize();
    for (Copy* c : {&row, &col}) {
      const QuantizedView& v = c->buf.view;
      const int64_t kb = v.cols / kFp8Block;
      std::vector<uint32_t> s(static_cast<size_t>(v.rows * kb)), t(s.size());
      cuda->download(s.data(), v.scales, s.size() * 4);
      cuda->download(t.data(), v.scales_gemm, t.size() * 4);
      for (int64_t r = 0; r < v.rows; ++r)
        for (int64_t b = 0; b < kb; ++b)
          ASSERT_EQ(t[static_cast<size_t>(b * v.rows + r)], s[static_cast<size_t>(r * kb + b)])
              << (two_d ? "2d " : "1d ") << (staged ? "staged " : "direct ")
              << (c == &row ? "row-wise" : "column-wise") << " scale (" << r << ", " << b << ")";
    }
    // D = x . x^T's row-wise copy against itself (M = N = 256, K = 384), with and without them
    GemmConfig cfg;
    cfg.impl = GemmImpl::CublasLt;
    BackendBuffer d(*cuda, static_cast<size_t>(R * R) * 4);
    TensorView dv;
    dv.data = d.get();
    dv.rows = dv.cols = R;
    dv.device = Device::Cuda;
    std::vector<uint32_t> with(static_cast<size_t>(R * R)), without(with.size());
    cuda->gemm(row.buf.view, row.buf.view, nullptr, cfg, dv);
    cuda->download(with.data(), d.get(), with.size() * 4);
    QuantizedView plain = row.buf.view;
    plain.scales_gemm = nullptr;
    cuda->gemm(plain, plain, nullptr, cfg, dv);
    cuda->download(without.data(), d.get(), without.size() * 4);
    EXPECT_EQ(with, without) << (two_d ? "2d" : "1d")
                             << ": cuBLASLt D with the quantizer's GEMM-layout scales";
  }
  // the emulator writes no GEMM-layout scales and says so
  std::vector<float> x = test::make_fill(test::Fill::Gaussian, static_cast<size_t>(R * C), 22);
  QuantizeConfig qc;
  qc.format = QFormat::FP8;
  qc.rowwise.enabled = true;
  QuantizedHost h = zero_fp8_host(R, C);
  std::vector<float> sg(static_cast<size_t>(R * (C / kFp8Block)));
  QuantizedView v = h.view();
  v.scales_gemm = sg.data();
  EXPECT_THROW(emu->quantize(host_view(x.data(), R, C), qc, &v, nullptr), std::invalid_argument);
}

// A linear layer's output gradient: its FP8 copies and its bias gradient from one call
// (Backend::quantize_activation with an Identity source and dbias; on the GPU the tile pass also
// takes the 64-row column sums) == quantize then bias_backward, bit for bit: the copies, and dbias
// (which starts non-zero: the sums are added). Against the CUDA backend's own two calls (NaN
// payloads are the GPU's there) and, for finite inputs, against the emulator's. Shapes: whole
// tiles, 64-row chunks across several tiles, and (column-wise copy alone) a partial last column
// tile.
TEST(Fp8Gpu, QuantizeActivationWithBiasEqualsQuantizeThenBiasBackward) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  auto emu = make_backend("emu");
  auto cuda = make_backend("cuda");
  struct Case {
    int64_t R, C;
    test::Fill fill;
    bool rowwise;
  };
  int checked = 0;
  for (const Case& k :
       {Case{256, 384, test::Fill::Gaussian, true}, Case{128, 200, test::Fill::HeavyTailed, false},
        Case{512, 128, test::Fill::HugeTiny, true}, Case{256, 256, test::Fill::Specials, true}}) {
    const std::vector<float> x = test::make_fill(k.fill, static_cast<size_t>(k.R * k.C), 31);
    std::vector<float> dbias0(static_cast<size_t>(k.C));
    for (size_t i = 0; i < dbias0.size(); ++i)
      dbias0[i] = 0.25f * static_cast<float>(static_cast<int>(i % 9) - 4);
    QuantizeConfig qc;
    qc.format = QFormat::FP8;
    qc.rowwise.enabled = k.rowwise;
    qc.columnwise.enabled = true;
    // (a row-wise copy of the 200-column case would not block: its host copy is there but unused)
    auto blank = [&] {
      return std::make_pair(zero_fp8_host(k.R, k.rowwise ? k.C : kFp8Block),
                            zero_fp8_host(k.C, k.R));
    };
    const std::string what = std::string(test::fill_name(k.fill)) + " " + std::to_string(k.R) +
                             "x" + std::to_string(k.C);
    SCOPED_TRACE(what);
    const uint64_t fused_before = cuda_counters(*cuda).fused_bias_backward;
    expect_fused_bias_grad_bitwise(*cuda, k.fill != test::Fill::Specials ? emu.get() : nullptr, x,
                                   k.R, k.C, qc, dbias0, blank, what);
    EXPECT_EQ(cuda_counters(*cuda).fused_bias_backward, fused_before + 1)
        << what << ": the fused path did not run";
    ++checked;
  }
  std::printf("[fp8-gpu] %d fused quantize + bias gradients bitwise identical\n", checked);
}

// GELU (forward, or backward with its incoming gradient) computed inside the FP8 tile pass
// (CudaBackend::quantize_activation) == the GELU kernel, then quantize (and bias_backward), on the
// GPU, bit for bit: codes, scales, GEMM-layout scales, amax and dbias; 1x128 and 128x128 blocks,
// either copy alone, partial tiles, specials (NaN, Inf, huge values that saturate) in the input and
// in the incoming gradient, every combination of the BF16 storage of the op's output (src.out
// marked bf16_values) and of its incoming gradient (src.dout marked: read rounded; backward only),
// and inputs the vector loads cannot take (130 columns, views one float off 16-byte alignment: the
// register path's scalar loads). The fused call leaves the op's output buffer as it was (here a NaN
// pattern).
TEST(Fp8Gpu, QuantizeActivationEqualsOpThenQuantize) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  gpu::CudaOptions unfused;
  unfused.activation_fusion = false;
  auto cuda_fused = cuda_backend(), cuda_unfused = cuda_backend(unfused);
  struct Case {
    int64_t R, C;
    bool row, col, two_d, dbias;
    test::Fill fill;
    int64_t offset = 0;  // floats the input and gradient pointers sit past an aligned allocation
  };
  const Case cases[] = {{256, 384, true, true, false, true, test::Fill::Gaussian},
                        {256, 384, true, true, false, false, test::Fill::HeavyTailed},
                        {128, 200, false, true, false, true, test::Fill::Specials},
                        {200, 256, true, false, false, false, test::Fill::Gaussian},
                        {256, 256, true, true, true, false, test::Fill::Specials},
                        {384, 128, true, true, false, true, test::Fill::HugeTiny},
                        {128, 130, false, true, false, true, test::Fill::Specials, 1},
                        {256, 256, true, true, false, true, test::Fill::Gaussian, 1}};
  int checked = 0;
  for (const Case& k : cases)
    for (ActivationOp op : {ActivationOp::GeluForward, ActivationOp::GeluBackward})
      for (int flags = 0; flags < 4; ++flags) {
        const bool rb = (flags & 1) != 0, bd = (flags & 2) != 0;
        const std::string what =
            std::string(op == ActivationOp::GeluForward ? "forward " : "backward ") +
            test::fill_name(k.fill) + " " + std::to_string(k.R) + "x" + std::to_string(k.C) +
            (k.row ? " row" : "") + (k.col ? " col" : "") + (k.two_d ? " 2D" : "") +
            (k.dbias ? " dbias" : "") + (rb ? " bf16-out" : " fp32-out") +
            (bd ? " bf16-dout" : " fp32-dout") + (k.offset ? " unaligned" : "");
        SCOPED_TRACE(what);
        const size_t n = static_cast<size_t>(k.R * k.C);
        std::vector<float> pre = test::make_fill(k.fill, n, 7 + k.R);
        for (float& v : pre) v *= 3.0f;  // (across GELU's curve, and past FP8's range for HugeTiny)
        const std::vector<float> dout = test::make_fill(
            k.fill == test::Fill::Specials ? test::Fill::Specials : test::Fill::Gaussian, n,
            11 + k.C);
        std::vector<float> dbias0(static_cast<size_t>(k.C));
        for (size_t i = 0; i < dbias0.size(); ++i)
          dbias0[i] = 0.125f * static_cast<float>(static_cast<int>(i % 7) - 3);
        QuantizeConfig qc;
        qc.format = QFormat::FP8;
        qc.block_2d = k.two_d;
        qc.rowwise.enabled = k.row;
        qc.columnwise.enabled = k.col;
        struct Out {
          QuantizedHost row, col;
          std::vector<float> row_sg, col_sg, dbias, act;
        };
        auto go = [&](bool fused) {
          Backend& be = fused ? *cuda_fused : *cuda_unfused;
          Out o;
          o.row = zero_fp8_host(k.R, k.row ? k.C : kFp8Block);
          o.col = zero_fp8_host(k.C, k.col ? k.R : kFp8Block);
          const size_t off = static_cast<size_t>(k.offset);
          BackendBuffer pb(be, (n + off) * 4), db(be, (n + off) * 4), ob(be, n * 4),
              bb(be, dbias0.size() * 4);
          BackendBuffer rsg(be, o.row.scales.size()), csg(be, o.col.scales.size());
          be.upload(pb.as<float>() + off, pre.data(), n * 4);
          be.upload(db.as<float>() + off, dout.data(), n * 4);
          const std::vector<uint8_t> nan_bytes(n * 4, 0xFF);
          be.upload(ob.get(), nan_bytes.data(), n * 4);
          be.upload(bb.get(), dbias0.data(), dbias0.size() * 4);
          QuantizedBuffers rq(be, o.row), cq(be, o.col);
          rq.view.scales_gemm = rsg.as<float>();
          cq.view.scales_gemm = csg.as<float>();
          ActivationSource src;
          src.op = op;
          src.inp = skip(buffer_view(be, pb, DType::F32, k.R, k.C, "pre"), k.offset, k.R, k.C);
          if (op == ActivationOp::GeluBackward)
            src.dout = marked(
                skip(buffer_view(be, db, DType::F32, k.R, k.C, "dout"), k.offset, k.R, k.C), bd);
          src.out = buffer_view(be, ob, DType::F32, k.R, k.C, "act", rb);
          be.quantize_activation(
              src, qc, k.row ? &rq.view : nullptr, k.col ? &cq.view : nullptr,
              k.dbias ? buffer_view(be, bb, DType::F32, k.C, 1, "dbias") : TensorView{});
          be.synchronize();
          if (k.row) rq.download_to(be, o.row);
          if (k.col) cq.download_to(be, o.col);
          o.row_sg.resize(o.row.scales.size() / 4);
          o.col_sg.resize(o.col.scales.size() / 4);
          be.download(o.row_sg.data(), rsg.get(), o.row.scales.size());
          be.download(o.col_sg.data(), csg.get(), o.col.scales.size());
          o.dbias.resize(dbias0.size());
          be.download(o.dbias.data(), bb.get(), dbias0.size() * 4);
          o.act.resize(n);
          be.download(o.act.data(), ob.get(), n * 4);
          return o;
        };
        const uint64_t before = cuda_counters(*cuda_fused).fused_activation_quantize;
        const Out f = go(true);
        EXPECT_EQ(cuda_counters(*cuda_fused).fused_activation_quantize, before + 1)
            << "the fused path did not run";
        const Out t = go(false);
        EXPECT_EQ(cuda_counters(*cuda_unfused).fused_activation_quantize, 0u)
            << "CudaOptions::activation_fusion = false did not turn fusion off";
        if (k.row) test::expect_same_quantized(t.row, f.row, what + " row-wise");
        if (k.col) test::expect_same_quantized(t.col, f.col, what + " column-wise");
        if (k.row) {
          ASSERT_EQ(0, std::memcmp(t.row_sg.data(), f.row_sg.data(), t.row_sg.size() * 4))
              << "row GEMM scales";
        }
        if (k.col) {
          ASSERT_EQ(0, std::memcmp(t.col_sg.data(), f.col_sg.data(), t.col_sg.size() * 4))
              << "col GEMM scales";
        }
        ASSERT_EQ(0, std::memcmp(t.dbias.data(), f.dbias.data(), t.dbias.size() * 4)) << "dbias";
        uint32_t untouched = 0, written = 0;
        for (size_t i = 0; i < n; ++i) {
          uint32_t a, b;
          std::memcpy(&a, &f.act[i], 4);
          std::memcpy(&b, &t.act[i], 4);
          untouched += a == 0xFFFFFFFFu;
          written += b != 0xFFFFFFFFu;
        }
        EXPECT_EQ(untouched, n) << "the fused call wrote the op's output buffer";
        EXPECT_GT(written, n / 2) << "the composition did not write the op's output";
        ++checked;
      }
  std::printf(
      "[fp8-gpu] %d fused activation quantize calls bitwise identical to the op then quantize\n",
      checked);
}

// One GEMM of host copies a and b on backend be (C from c when cfg.beta != 0), D's bytes back. D
// starts out_offset elements into its buffer (1: only 4-byte aligned for F32, 2-byte for BF16).
// in_place: D starts as C and is C (FP32 out only), as when a GEMM accumulates into its output.
std::vector<uint8_t> run_fp8_gemm(Backend& be, const QuantizedHost& a, const QuantizedHost& b,
                                  const std::vector<float>& c, const GemmConfig& cfg,
                                  int64_t out_offset = 0, bool in_place = false) {
  const size_t elem = cfg.out == GemmOut::BF16 ? 2 : 4,
               skip = static_cast<size_t>(out_offset) * elem;
  QuantizedBuffers da = QuantizedBuffers::uploaded(be, a), db = QuantizedBuffers::uploaded(be, b);
  BackendBuffer cb(be, c.size() * 4), d(be, c.size() * elem + skip);
  be.upload(cb.get(), c.data(), c.size() * 4);
  TensorView cv, dv;
  cv.data = cb.get();
  cv.rows = a.rows;
  cv.cols = b.rows;
  cv.device = be.device();
  dv.data = static_cast<uint8_t*>(d.get()) + skip;
  dv.rows = a.rows;
  dv.cols = b.rows;
  dv.device = be.device();
  if (in_place) {
    be.upload(dv.data, c.data(), c.size() * 4);
    cv.data = dv.data;
  }
  dv.dtype = cfg.out == GemmOut::BF16 ? DType::BF16 : DType::F32;
  be.gemm(da.view, db.view, cfg.beta != 0 ? &cv : nullptr, cfg, dv);
  be.synchronize();
  std::vector<uint8_t> out(c.size() * elem);
  be.download(out.data(), dv.data, out.size());
  return out;
}

// The CUDA backend's options with the tensor-core FP8 GEMM on or off and its CTA cap.
gpu::CudaOptions fp8_wgmma_options(bool on, int max_ctas = 0) {
  gpu::CudaOptions o;
  o.fp8_wgmma = on;
  o.fp8_wgmma_max_ctas = max_ctas;
  return o;
}

// Whether this GPU runs exact FP8 GEMMs on its tensor cores: compute capability 9.0 and a build
// with sm_90a code (fp4sim info's archs). Then the tests require the tensor-core path to have run.
bool gpu_has_fp8_wgmma() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  const std::string archs = "," + cuda_archs() + ",";
  return major == 9 && minor == 0 && archs.find(",90a,") != std::string::npos;
}

// Quantized inputs through the exact GEMM, both CUDA paths (the tensor cores where the GPU has
// them, and the one-thread-an-output model kernel) against the emulator. Shapes with one tile,
// several tiles with partial edges, split-K, D not aligned for paired stores, C read by whole
// tiles (FP32 and BF16 out, and C being D), CTAs taking several work items; B in 128x128 blocks
// where N allows (one scale a k-block and tile: the tensor-core kernel's one-product promotion).
TEST(Fp8Gpu, GemmBitwiseEqualsEmulator) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  auto emu = make_backend("emu");
  // the tensor cores with a CTA an SM (here: one work item each), with 1 and 3 CTAs (each taking
  // several items in turn, the loader crossing items inside its prefetch window), and the model
  // kernel (-1)
  const int modes[] = {0, 1, 3, -1};
  std::unique_ptr<gpu::CudaBackend> cudas[4];
  for (int i = 0; i < 4; ++i)
    cudas[i] = cuda_backend(fp8_wgmma_options(modes[i] >= 0, modes[i] > 0 ? modes[i] : 0));
  struct Shape {
    int64_t M, N, K;
  };
  int checked = 0, wgmma_cases = 0;
  for (const Shape& s : {Shape{64, 48, 256}, Shape{33, 17, 384}, Shape{5, 130, 512},
                         Shape{200, 260, 768}, Shape{256, 384, 1024}}) {
    for (test::Fill fill : {test::Fill::Gaussian, test::Fill::HeavyTailed, test::Fill::Specials}) {
      std::vector<float> xa = test::make_fill(fill, static_cast<size_t>(s.M * s.K), s.M + s.K);
      std::vector<float> xb = test::make_fill(fill, static_cast<size_t>(s.N * s.K), s.N + 3 * s.K);
      QuantizedHost a = quantize_on(*emu, xa, s.M, s.K, false, false, false).rowwise;
      QuantizedHost b = quantize_on(*emu, xb, s.N, s.K, false, s.N % 128 == 0, false).rowwise;
      std::vector<float> c =
          test::make_fill(test::Fill::Gaussian, static_cast<size_t>(s.M * s.N), 5);
      for (int variant = 0; variant < 8; ++variant) {
        GemmConfig cfg;
        if (variant == 1) {
          cfg.split_k = (s.K / 128) % 2 == 0 ? 2 : 1;
          cfg.alpha = 1.5f;
        }
        if (variant == 2 || variant == 5) {
          cfg.beta = -0.5f;
          cfg.out = GemmOut::BF16;
        }
        if (variant == 3) {
          cfg.split_k = static_cast<int>(s.K / 128);
          cfg.beta = 1.0f;
        }
        if (variant == 6) cfg.beta = 1.0f;  // FP32 out with C, one range (Dgrad's form)
        if (variant == 7) {
          cfg.alpha = 2.0f;
          cfg.beta = 0.75f;
        }  // the same into D = C itself
        const int64_t offset =
            variant == 4 || variant == 5 ? 1 : 0;  // D off the pair-store alignment
        const bool in_place = variant == 7;
        const std::vector<uint8_t> want = run_fp8_gemm(*emu, a, b, c, cfg, offset, in_place);
        for (int i = 0; i < 4; ++i) {
          const int mode = modes[i];
          ASSERT_EQ(want, run_fp8_gemm(*cudas[i], a, b, c, cfg, offset, in_place))
              << s.M << "x" << s.N << "x" << s.K << " " << test::fill_name(fill) << " variant "
              << variant
              << (mode < 0
                      ? " (model kernel)"
                      : " (tensor cores where supported, CTA cap " + std::to_string(mode) + ")");
          ++checked;
          if (mode >= 0) ++wgmma_cases;
        }
      }
    }
  }
  uint64_t on_tensor_cores = 0;
  for (const auto& cuda : cudas) on_tensor_cores += cuda->counters().fp8_wgmma_gemms;
  if (gpu_has_fp8_wgmma()) {
    EXPECT_EQ(on_tensor_cores, static_cast<uint64_t>(wgmma_cases));
  }
  std::printf("[fp8-gpu] %d FP8 GEMMs bitwise identical (%llu on the tensor cores)\n", checked,
              static_cast<unsigned long long>(on_tensor_cores));
}

// The accumulation model itself, on raw codes: every finite E4M3 code (and a few NaNs) at random,
// so the 32 products of one instruction span 2^-18..2^17 and the F = 13 alignment truncation, the
// RZ to E8M13, cancellation and signed zeros all occur; random FP32 block scales. The tensor cores
// (where the GPU has wgmma) must give the emulator's bits; elsewhere the model kernel must.
TEST(Fp8Gpu, TensorCoreAccumulationEqualsModelOnRawCodes) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  auto emu = make_backend("emu");
  auto cuda = cuda_backend(), cuda_3ctas = cuda_backend(fp8_wgmma_options(true, 3));
  std::mt19937 rng(20261130);
  const int64_t M = 192, N = 160, K = 512;
  auto make = [&](int64_t rows, int pattern) {
    QuantizedHost q = zero_fp8_host(rows, K);
    std::uniform_int_distribution<int> code(0, 255), small(0, 15);
    std::uniform_real_distribution<float> expo(-12.0f, 12.0f);
    for (size_t i = 0; i < q.codes.size(); ++i) {
      uint8_t v = static_cast<uint8_t>(code(rng));
      if (pattern == 1)
        v = static_cast<uint8_t>(small(rng) | (code(rng) & 0x80));  // subnormals and ±0
      if (pattern == 2 && i % 32 != 0)
        v = static_cast<uint8_t>(code(rng) & 0x9F);                      // one big, 31 tiny
      if ((v & 0x7F) == 0x7F && (pattern != 0 || i % 997 != 0)) v ^= 1;  // NaN only now and then
      q.codes[i] = v;
    }
    std::vector<float> sc(static_cast<size_t>(rows * (K / 128)));
    for (float& f : sc)
      f = std::ldexp(1.0f + static_cast<float>(code(rng)) / 256.0f, static_cast<int>(expo(rng)));
    std::memcpy(q.scales.data(), sc.data(), sc.size() * 4);
    return q;
  };
  // The same chain with the Blackwell f8f6f4 accumulation (F = 25, RZ to FP32) in place of
  // Hopper's, for output (m, n): where it differs from the emulator's, these data tell the two
  // models apart.
  auto blackwell_chain = [&](const QuantizedHost& a, const QuantizedHost& b, int64_t m, int64_t n) {
    const float* sa = reinterpret_cast<const float*>(a.scales.data());
    const float* sb = reinterpret_cast<const float*>(b.scales.data());
    float acc = 0.0f;
    for (int64_t blk = 0; blk < K / 128; ++blk) {
      float partial = 0.0f;
      for (int64_t k0 = blk * 128; k0 < (blk + 1) * 128; k0 += kFp8FdpaL) {
        float va[kFp8FdpaL], vb[kFp8FdpaL];
        for (int k = 0; k < kFp8FdpaL; ++k) {
          va[k] = e4m3_to_f32(a.codes[static_cast<size_t>(m * K + k0 + k)]);
          vb[k] = e4m3_to_f32(b.codes[static_cast<size_t>(n * K + k0 + k)]);
        }
        partial = tfdpa_fp8_blackwell(va, vb, partial, kE4M3Operand, kE4M3Operand);
      }
      acc = std::fma(sa[m * (K / 128) + blk] * sb[n * (K / 128) + blk], partial, acc);
    }
    return acc;
  };
  int checked = 0;
  for (int pattern = 0; pattern < 3; ++pattern) {
    QuantizedHost a = make(M, pattern), b = make(N, pattern);
    std::vector<float> c(static_cast<size_t>(M * N), 0.0f);
    for (const int split : {1, 4}) {
      GemmConfig cfg;
      cfg.split_k = split;
      const std::vector<uint8_t> want = run_fp8_gemm(*emu, a, b, c, cfg);
      // (split 4: 16 work items on 3 CTAs)
      const std::vector<uint8_t> got = run_fp8_gemm(split == 4 ? *cuda_3ctas : *cuda, a, b, c, cfg);
      size_t differ = 0, first = want.size();
      for (size_t i = 0; i < want.size(); i += 4)
        if (std::memcmp(&want[i], &got[i], 4) != 0 && differ++ == 0) first = i / 4;
      EXPECT_EQ(differ, 0u) << "pattern " << pattern << " split " << split
                            << ": first difference at output " << first;
      if (split == 1 && pattern != 1) {  // (subnormal codes alone: products too small to truncate)
        int64_t sensitive = 0, finite = 0;
        for (int64_t i = 0; i < 512; ++i) {
          const int64_t m = (i * 37) % M, n = (i * 53) % N;
          float model = 0.0f;
          std::memcpy(&model, &want[static_cast<size_t>(4 * (m * N + n))], 4);
          if (!std::isfinite(model)) continue;
          ++finite;
          const float other = blackwell_chain(a, b, m, n);
          if (std::memcmp(&model, &other, 4) != 0) ++sensitive;
        }
        EXPECT_GT(sensitive * 4, finite)
            << "pattern " << pattern << ": the data hardly tell F = 13 from F = 25";
        std::printf(
            "[fp8-gpu] pattern %d: %lld of %lld sampled outputs differ between the Hopper and "
            "Blackwell models\n",
            pattern, static_cast<long long>(sensitive), static_cast<long long>(finite));
      }
      ++checked;
    }
  }
  if (gpu_has_fp8_wgmma()) {
    EXPECT_EQ(cuda->counters().fp8_wgmma_gemms + cuda_3ctas->counters().fp8_wgmma_gemms,
              static_cast<uint64_t>(checked));
  }
  std::printf("[fp8-gpu] %d raw-code FP8 GEMMs (%s) bitwise identical to the model\n", checked,
              gpu_has_fp8_wgmma() ? "tensor cores" : "model kernel");
}

}  // namespace
}  // namespace fp4sim
