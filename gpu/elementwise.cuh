// The elementwise kernels of gpu/elementwise.cu that gpu/matmul.cu launches too: the BF16 operand
// rounding and the widening of BF16 bits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fp4sim::gpu {

__global__ void round_to_bf16_kernel(uint16_t* dst, const float* src, int64_t n);
__global__ void bf16_to_f32_kernel(float* dst, const uint16_t* src, int64_t n);

}  // namespace fp4sim::gpu
