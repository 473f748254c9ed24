// The CUDA backend: the same ops as emu::CpuBackend, same names and argument order, bit-identical
// results for the quantizers (they call the same host/device block functions).
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <string>

#include "emu/backend.hpp"

namespace fp4sim::gpu {

struct CublasLtState;
std::shared_ptr<CublasLtState> make_cublaslt_state();
void gemm_cublaslt_launch(CublasLtState& st, const QuantizedView& a, const QuantizedView& b,
                          const float* c, const GemmConfig& cfg, void* out, cudaStream_t stream);

// D_rm [M, N] = alpha * A_rm [M, K] * B_rm [N, K]^T (+ beta * C), BF16 operands, FP32 output.
void bf16_gemm_tn(CublasLtState& st, const uint16_t* a, const uint16_t* b, const float* c, float* d,
                  int64_t M, int64_t N, int64_t K, float alpha, float beta, cudaStream_t stream);

bool gpu_available();
std::string describe_gpu();

class CudaBackend final : public Backend {
 public:
  CudaBackend();
  ~CudaBackend() override;
  std::string name() const override { return "cuda"; }
  Device device() const override { return Device::Cuda; }
  void* allocate(size_t bytes) override;
  void release(void* p) override;
  void upload(void* dst, const void* host_src, size_t bytes) override;
  void download(void* host_dst, const void* src, size_t bytes) override;
  void synchronize() override;
  void zero(void* p, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;

  void quantize(const TensorView& x, const QuantizeConfig& cfg, QuantizedView* rowwise,
                QuantizedView* columnwise) override;
  void dequantize(const QuantizedView& q, const TensorView& out) override;
  void scales_to_tiled(const uint8_t* scales, int64_t rows, int64_t k_blocks,
                       uint8_t* out) override;
  void gemm(const QuantizedView& a, const QuantizedView& b, const TensorView* c,
            const GemmConfig& cfg, const TensorView& d) override;

  cudaStream_t stream() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<CublasLtState> cublaslt_;  // created on first use
};

std::unique_ptr<Backend> make_cuda_backend();

// Kernel launchers (gpu/quantize.cu), on `stream`, device pointers.
void quantize_launch(const TensorView& x, const QuantizeConfig& cfg, QuantizedView* rowwise,
                     QuantizedView* columnwise, cudaStream_t stream);
// Benchmark knob: the common-case quantize kernel's tile, 1 = 64x128, 2 = 64x256 (BF16 input).
// Results are identical; only speed differs.
void set_quantize_tile_variant(int cols_per_thread);
void gemm_exact_launch(const QuantizedView& a, const QuantizedView& b, const float* c,
                       const GemmConfig& cfg, void* out, cudaStream_t stream);
void dequantize_launch(const QuantizedView& q, const TensorView& out, cudaStream_t stream);
void scales_to_tiled_launch(const uint8_t* scales, int64_t rows, int64_t k_blocks, uint8_t* out,
                            cudaStream_t stream);

}  // namespace fp4sim::gpu
