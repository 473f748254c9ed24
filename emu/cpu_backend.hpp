// The emulator backend: plain loops in the order the contract names, OpenMP across independent
// blocks only. The golden reference every other backend is checked against.
#pragma once

#include <stdexcept>

#include "emu/backend.hpp"

namespace fp4sim::emu {

class CpuBackend final : public Backend {
 public:
  std::string name() const override { return "emu"; }
  Device device() const override { return Device::Host; }
  void* allocate(size_t bytes) override;
  void release(void* p) override;
  void upload(void* dst, const void* host_src, size_t bytes) override;
  void download(void* host_dst, const void* src, size_t bytes) override;
  void synchronize() override {}

  void quantize(const TensorView& x, const QuantizeConfig& cfg, QuantizedView* rowwise,
                QuantizedView* columnwise) override;
  void dequantize(const QuantizedView& q, const TensorView& out) override;
  void gemm(const QuantizedView& a, const QuantizedView& b, const TensorView* c,
            const GemmConfig& cfg, const TensorView& d) override {
    validate_gemm(a, b, c, cfg, d);
    if (cfg.impl != GemmImpl::Exact)
      throw std::invalid_argument("gemm: --gemm cublaslt runs on the cuda backend only");
    gemm_exact_host(a, b, c ? static_cast<const float*>(c->data) : nullptr, cfg, d.data);
  }
  void scales_to_tiled(const uint8_t* scales, int64_t rows, int64_t k_blocks,
                       uint8_t* out) override {
    fp4sim::scales_to_tiled(scales, rows, k_blocks, out);
  }
};

// Building blocks, exposed for tests and benchmarks.
// The written tensor w (rows x cols FP32, row-major) of one copy -> codes and scales.
// `written_transposed`: w is the transpose of the input (column-wise copy), used only for the
// Four Over Six tile error order.
void quantize_written(const float* w, int64_t rows, int64_t cols, float amax,
                      const QuantizeConfig& cfg, const CopySpec& spec, bool written_transposed,
                      QuantizedView& out);

// NaN-ignoring amax over a row-major FP32 matrix.
float amax_of(const float* x, int64_t n);

// The column-wise RHT copy as written: out (cols x rows FP32, each value a BF16) where each 16
// consecutive input rows of one column are transformed by rht16.
void rht_columnwise(const float* x, int64_t rows, int64_t cols, float* out);

}  // namespace fp4sim::emu
