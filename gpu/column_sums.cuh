// Column sums over rows in the fixed chunking of emu::bias_backward (emu/matmul.hpp): partial sums
// of each kColumnChunkRows-row chunk, added up by column_sums_finalize (gpu/column_sums.cu). Used
// by the norms' weight gradients (gpu/norm.cu), the bias gradient (gpu/matmul.cu) and the
// quantizers' fused bias gradient (CudaBackend::quantize_with_bias_backward, gpu/cuda_backend.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "emu/matmul.hpp"
#include "gpu/training_ops.cuh"

namespace fp4sim::gpu {

constexpr int64_t kColumnChunkRows =
    emu::kColumnChunkRows;  // rows per partial column sum (shared with emu::bias_backward)

inline int64_t column_chunks(int64_t N) { return (N + kColumnChunkRows - 1) / kColumnChunkRows; }

inline dim3 column_partial_grid(int64_t N, int64_t C) {
  return dim3(static_cast<unsigned>(column_chunks(N)),
              static_cast<unsigned>((C + kThreads - 1) / kThreads));
}

// out (and out2, when given: the sums of partial2, the same shape) from the chunk partials.
void column_sums_finalize(float* out, const float* partial, int64_t N, int64_t C, bool add_to_out,
                          cudaStream_t stream, float* out2 = nullptr,
                          const float* partial2 = nullptr);

}  // namespace fp4sim::gpu
