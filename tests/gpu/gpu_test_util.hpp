// Shared by the GPU tests: whether a CUDA GPU is present (the tests skip cleanly without one), and
// views into a backend's memory.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "emu/backend.hpp"
#include "tests/emu/quantize_checks.hpp"

#if FP4SIM_HAVE_CUDA
#include "gpu/cuda_backend.hpp"
#endif

namespace fp4sim {

inline bool have_gpu() {
#if FP4SIM_HAVE_CUDA
  return gpu::gpu_available();
#else
  return false;
#endif
}

#if FP4SIM_HAVE_CUDA
// A CUDA backend with the options a test needs (the defaults where none are given).
inline std::unique_ptr<gpu::CudaBackend> cuda_backend(const gpu::CudaOptions& options = {}) {
  return std::make_unique<gpu::CudaBackend>(options);
}
// What `cuda`, a gpu::CudaBackend, did so far.
inline gpu::CudaCounters cuda_counters(const Backend& cuda) {
  return dynamic_cast<const gpu::CudaBackend&>(cuda).counters();
}

// Where the Hopper picks rules apply (pk.rules_active), the plan that reported pk asked for the
// rule's `index` and took it (or the first where the list is shorter); `what` labels the failure
// and the log line. Elsewhere there is nothing to check.
inline void expect_rule_pick(const gpu::CublasLtPlanPick& pk, int index, const std::string& what) {
  if (!pk.rules_active) return;
  EXPECT_EQ(pk.preferred, index) << what;
  EXPECT_EQ(pk.used, pk.found > index ? index : 0) << what;
  std::printf("%s plan: heuristic index %d (%d listed)\n", what.c_str(), pk.used, pk.found);
}
// The same for the cuBLASLt GEMM plan (gpu/gemm_cublaslt.cu) the last GEMM on `cuda` built.
inline void expect_rule_pick(const Backend& cuda, int index, const std::string& what) {
  expect_rule_pick(cuda_counters(cuda).last_cublaslt_plan_pick, index, what);
}
#endif

// A dense rows x cols view of b (its start, or `skip` elements past it) in be's memory.
inline TensorView buffer_view(const Backend& be, const BackendBuffer& b, DType dtype, int64_t rows,
                              int64_t cols, const char* name = "tensor", bool bf16_values = false) {
  return view_of(b.get(), dtype, rows, cols, be.device(), name, bf16_values);
}

// The view rows x cols of v's dtype and device starting `elems` elements past v's start: a pointer
// off alignment, or one segment of a flat tensor.
inline TensorView skip(const TensorView& v, int64_t elems, int64_t rows, int64_t cols) {
  TensorView r = v;
  r.data = static_cast<char*>(v.data) + static_cast<size_t>(elems) * dtype_size(v.dtype);
  r.rows = rows;
  r.cols = cols;
  r.row_stride = 0;
  return r;
}

// v with its bf16_values mark set to `on` (written rounded, or read rounded where the op says so).
inline TensorView marked(TensorView v, bool on = true) {
  v.bf16_values = on;
  return v;
}

// Whether be's GEMM with impl reads an FP4 view's decoded BF16 operand (and its quantizer writes
// it): Capability::GemmDecodedOperand.
inline bool reads_decoded_operand(const Backend& be, GemmImpl impl) {
  return be.supports(Capability::GemmDecodedOperand, static_cast<int64_t>(impl));
}

// D of one GEMM on `be` as bit patterns (F32, or BF16 widened); D starts as NaN patterns so a GEMM
// that reads C when beta = 0 shows. c: F32 [M, N] host values or null.
inline std::vector<uint32_t> run_gemm_bits(Backend& be, QuantizedHost& a, QuantizedHost& b,
                                           const std::vector<float>* c, const GemmConfig& cfg) {
  QuantizedBuffers da = QuantizedBuffers::uploaded(be, a), db = QuantizedBuffers::uploaded(be, b);
  const int64_t M = a.rows, N = b.rows;
  BackendBuffer cb(be, static_cast<size_t>(M * N) * 4), d(be, static_cast<size_t>(M * N) * 4);
  if (c) be.upload(cb.get(), c->data(), c->size() * 4);
  const std::vector<uint8_t> nan_bytes(static_cast<size_t>(M * N) * 4, 0xFF);
  be.upload(d.get(), nan_bytes.data(), nan_bytes.size());
  const TensorView cv = buffer_view(be, cb, DType::F32, M, N, "c"),
                   dv = buffer_view(be, d, cfg.out == GemmOut::BF16 ? DType::BF16 : DType::F32, M,
                                    N, "d");
  be.gemm(da.view, db.view, c ? &cv : nullptr, cfg, dv);
  be.synchronize();
  std::vector<uint32_t> out(static_cast<size_t>(M * N), 0);
  if (cfg.out == GemmOut::BF16) {
    std::vector<uint16_t> h(out.size());
    be.download(h.data(), d.get(), h.size() * 2);
    for (size_t i = 0; i < h.size(); ++i) out[i] = h[i];
  } else {
    be.download(out.data(), d.get(), out.size() * 4);
  }
  return out;
}

// An output gradient x (R x C, dense F32) quantized with qc, and its bias gradient dbias0 + x's
// column sums, on `be`: by one Backend::quantize_activation call (fused: an Identity source, dbias
// given) or by quantize then bias_backward. row and col come shaped by the caller (row is left as
// it is without a row-wise copy); returns dbias's bits.
inline std::vector<uint32_t> quantize_with_bias_on(Backend& be, const std::vector<float>& x,
                                                   int64_t R, int64_t C, const QuantizeConfig& qc,
                                                   const std::vector<float>& dbias0, bool fused,
                                                   QuantizedHost& row, QuantizedHost& col) {
  BackendBuffer xb(be, x.size() * 4), db(be, dbias0.size() * 4);
  be.upload(xb.get(), x.data(), x.size() * 4);
  be.upload(db.get(), dbias0.data(), dbias0.size() * 4);
  const TensorView xv = buffer_view(be, xb, DType::F32, R, C, "dy"),
                   dv = buffer_view(be, db, DType::F32, C, 1, "dbias");
  QuantizedBuffers rq(be, row), cq(be, col);
  QuantizedView* rv = qc.rowwise.enabled ? &rq.view : nullptr;
  if (fused) {
    ActivationSource src;  // (Identity: x itself)
    src.inp = xv;
    be.quantize_activation(src, qc, rv, &cq.view, dv);
  } else {
    be.quantize(xv, qc, rv, &cq.view);
    be.bias_backward(dv, xv);
  }
  be.synchronize();
  if (qc.rowwise.enabled) rq.download_to(be, row);
  cq.download_to(be, col);
  std::vector<uint32_t> d(dbias0.size());
  be.download(d.data(), db.get(), d.size() * 4);
  return d;
}

// The fused call on `cuda` against its own two calls (copies and dbias bit for bit; NaN payloads
// are the GPU's on both sides) and, where `emu` is given (finite inputs), against the emulator's
// fused call. blank(): a fresh pair of host copies (row-wise, column-wise) of the right shapes.
inline void expect_fused_bias_grad_bitwise(
    Backend& cuda, Backend* emu, const std::vector<float>& x, int64_t R, int64_t C,
    const QuantizeConfig& qc, const std::vector<float>& dbias0,
    const std::function<std::pair<QuantizedHost, QuantizedHost>()>& blank,
    const std::string& what) {
  auto [fr, fc] = blank();
  auto [tr, tc] = blank();
  const std::vector<uint32_t> fused =
                                  quantize_with_bias_on(cuda, x, R, C, qc, dbias0, true, fr, fc),
                              two = quantize_with_bias_on(cuda, x, R, C, qc, dbias0, false, tr, tc);
  if (qc.rowwise.enabled)
    test::expect_same_quantized(tr, fr, what + " row-wise (fused vs two calls)");
  test::expect_same_quantized(tc, fc, what + " column-wise (fused vs two calls)");
  for (size_t i = 0; i < fused.size(); ++i)
    ASSERT_EQ(two[i], fused[i]) << what << ": dbias[" << i
                                << "] fused vs quantize + bias_backward on the GPU";
  if (!emu) return;
  auto [er, ec] = blank();
  const std::vector<uint32_t> e = quantize_with_bias_on(*emu, x, R, C, qc, dbias0, true, er, ec);
  if (qc.rowwise.enabled) test::expect_same_quantized(er, fr, what + " row-wise (vs emulator)");
  test::expect_same_quantized(ec, fc, what + " column-wise (vs emulator)");
  for (size_t i = 0; i < fused.size(); ++i)
    ASSERT_EQ(e[i], fused[i]) << what << ": dbias[" << i << "] vs the emulator";
}

}  // namespace fp4sim
