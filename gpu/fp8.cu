// The FP8 block format on the GPU (DESIGN.md §9), twins of the emulator's FP8 paths in
// emu/cpu_backend.cpp and emu/gemm.cpp, built from the same host/device functions
// (fp8_block_encode_scale, fp8_quantize_element, fp8_decode_element, tfdpa_fp8_hopper), so the bits
// are the emulator's by construction. Correctness first: one block of 128 threads per quantization
// block, one thread per GEMM output.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "emu/gemm.hpp"
#include "emu/mma.hpp"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"

namespace fp4sim::gpu {
namespace {

__device__ __forceinline__ float load_f32(const void* x, DType t, int64_t i) {
  return t == DType::F32 ? static_cast<const float*>(x)[i] : bf16_to_f32(static_cast<const uint16_t*>(x)[i]);
}

// Global amax of x (NaN ignored). Non-negative floats order as their bit patterns, so an integer
// atomicMax gives the exact (order-free) maximum.
__global__ void fp8_amax_kernel(const void* x, DType t, int64_t rows, int64_t cols, int64_t stride,
                                unsigned int* amax_bits) {
  unsigned int m = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * cols;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = f32_abs(load_f32(x, t, (i / cols) * stride + i % cols));
    if (!f32_isnan(v)) m = max(m, f32_bits(v));
  }
  for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  if ((threadIdx.x & 31) == 0) atomicMax(amax_bits, m);
}

// One thread block per (row group, column block) of the written copy: 1 row (1x128) or 128 rows
// (128x128 tile) by 128 columns; thread k owns column k of the block. Written element (r, c) is
// x[r][c] (row-wise) or x[c][r] (column-wise).
__global__ void fp8_quantize_kernel(const void* x, DType t, int64_t stride, bool transposed, int64_t rows,
                                    int64_t cols, int group, QuantizedView q) {
  __shared__ float warp_max[kFp8Block / 32];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * group, c = static_cast<int64_t>(blockIdx.x) * kFp8Block + threadIdx.x;
  auto at = [&](int64_t r) { return transposed ? load_f32(x, t, c * stride + r) : load_f32(x, t, r * stride + c); };
  float m = 0.0f;
  for (int i = 0; i < group; ++i) m = fmax_nan_ignored(m, f32_abs(at(r0 + i)));
  for (int off = 16; off > 0; off >>= 1) m = fmax_nan_ignored(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  float amax_b = 0.0f;
  for (int w = 0; w < kFp8Block / 32; ++w) amax_b = fmax_nan_ignored(amax_b, warp_max[w]);
  const float enc = fp8_block_encode_scale(amax_b), scale = fdiv_rn(1.0f, enc);
  float* scales = reinterpret_cast<float*>(q.scales);
  for (int i = 0; i < group; ++i) {
    const int64_t r = r0 + i;
    q.codes[r * cols + c] = fp8_quantize_element(at(r), enc);
    if (threadIdx.x == 0) scales[r * (cols / kFp8Block) + blockIdx.x] = scale;
  }
}

__global__ void fp8_dequantize_kernel(QuantizedView q, float* out, int64_t out_stride) {
  const float* scales = reinterpret_cast<const float*>(q.scales);
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < q.rows * q.cols;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / q.cols, c = e % q.cols;
    out[r * out_stride + c] = fp8_decode_element(q.codes[e], scales[r * (q.cols / kFp8Block) + c / kFp8Block]);
  }
}

// One thread per output: per 128-block four chained Hopper FP8 T-FDPAs from +0, then
// acc = fmaf(s_a * s_b, partial, acc); split-K ranges added in order; the emulator's epilogue.
__global__ void fp8_gemm_exact_kernel(QuantizedView a, QuantizedView b, const float* c, GemmConfig cfg, void* out) {
  const int64_t N = b.rows, K = a.cols, kb = K / kFp8Block, per_split = kb / cfg.split_k;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.rows * N) return;
  const int64_t m = idx / N, n = idx % N;
  const float* sa = reinterpret_cast<const float*>(a.scales) + m * kb;
  const float* sb = reinterpret_cast<const float*>(b.scales) + n * kb;
  float total = 0.0f;
  for (int s = 0; s < cfg.split_k; ++s) {
    float acc = 0.0f;
    for (int64_t blk = s * per_split; blk < (s + 1) * per_split; ++blk) {
      float partial = 0.0f;
      for (int64_t k0 = blk * kFp8Block; k0 < (blk + 1) * kFp8Block; k0 += kFp8FdpaL) {
        float va[kFp8FdpaL], vb[kFp8FdpaL];
        for (int k = 0; k < kFp8FdpaL; ++k) {
          va[k] = e4m3_to_f32(a.codes[m * K + k0 + k]);
          vb[k] = e4m3_to_f32(b.codes[n * K + k0 + k]);
        }
        partial = tfdpa_fp8_hopper(va, vb, partial, kE4M3Operand, kE4M3Operand);
      }
      acc = __fmaf_rn(fmul_rn(sa[blk], sb[blk]), partial, acc);
    }
    total = s == 0 ? acc : fadd_rn(total, acc);
  }
  gemm_store(cfg, cfg.alpha, total, c, idx, out);
}

int blocks_for(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<int>(b < 65535 * 8 ? (b > 0 ? b : 1) : 65535 * 8);
}

}  // namespace

void fp8_quantize_launch(const TensorView& x, const QuantizeConfig& cfg, QuantizedView* rowwise,
                         QuantizedView* columnwise, cudaStream_t stream) {
  // the copies' amax is the input's (no transform): computed once
  unsigned int* amax_bits = reinterpret_cast<unsigned int*>(cfg.rowwise.enabled ? rowwise->amax : columnwise->amax);
  FP4SIM_CUDA_CHECK(cudaMemsetAsync(amax_bits, 0, sizeof(float), stream));
  fp8_amax_kernel<<<blocks_for(x.numel(), 256), 256, 0, stream>>>(x.data, x.dtype, x.rows, x.cols, x.stride(),
                                                                  amax_bits);
  FP4SIM_CUDA_CHECK_LAUNCH();
  const int group = cfg.block_2d ? kFp8Block : 1;
  for (int copy = 0; copy < 2; ++copy) {
    const bool col = copy == 1;
    if (!(col ? cfg.columnwise.enabled : cfg.rowwise.enabled)) continue;
    QuantizedView& q = col ? *columnwise : *rowwise;
    if (col && cfg.rowwise.enabled)
      FP4SIM_CUDA_CHECK(cudaMemcpyAsync(q.amax, rowwise->amax, sizeof(float), cudaMemcpyDeviceToDevice, stream));
    const dim3 grid(static_cast<unsigned>(q.cols / kFp8Block), static_cast<unsigned>(q.rows / group));
    if (grid.y > 65535)
      throw std::invalid_argument("quantize (cuda, fp8): too many rows for one launch: " + shape_str(q.rows, q.cols));
    fp8_quantize_kernel<<<grid, kFp8Block, 0, stream>>>(x.data, x.dtype, x.stride(), col, q.rows, q.cols, group, q);
    FP4SIM_CUDA_CHECK_LAUNCH();
  }
}

void fp8_dequantize_launch(const QuantizedView& q, const TensorView& out, cudaStream_t stream) {
  fp8_dequantize_kernel<<<blocks_for(q.rows * q.cols, 256), 256, 0, stream>>>(q, static_cast<float*>(out.data),
                                                                             out.stride());
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void fp8_gemm_exact_launch(const QuantizedView& a, const QuantizedView& b, const float* c, const GemmConfig& cfg,
                           void* out, cudaStream_t stream) {
  const int64_t n = a.rows * b.rows;
  fp8_gemm_exact_kernel<<<static_cast<unsigned>((n + 127) / 128), 128, 0, stream>>>(a, b, c, cfg, out);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

}  // namespace fp4sim::gpu
