// Fixed-order reductions of the training-op kernels (gpu/norm.cu, cross_entropy.cu, optim.cu):
// trees that depend only on the shapes, so a sum is bitwise reproducible run to run.
#pragma once

#include <cuda_runtime.h>

namespace fp4sim::gpu {

__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

// Butterfly over the 32 lanes: a fixed tree; every lane ends with the same bits (each pairwise
// sum is computed as x + y on one lane and y + x on its partner, equal by commutativity).
template <class T>
__device__ T warp_sum(T v) {
  for (int off = 16; off > 0; off >>= 1) v = add_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
  return v;
}

// Sum of one value per thread over the block (blockDim.x a multiple of 32): warp butterflies,
// then a butterfly over the warp sums (missing warps contribute +0). The tree depends only on
// blockDim.x; every thread gets the same result. Ends with a barrier so it can be called again.
template <class T>
__device__ T block_sum(T v) {
  __shared__ T warp_sums[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  T total = lane < warps ? warp_sums[lane] : T(0);
  total = warp_sum(total);
  __syncthreads();
  return total;
}

}  // namespace fp4sim::gpu
