// cp.async (sm_80+): 16 bytes from global to shared memory without passing through a register, L1
// bypassed (.cg); copies are committed in groups and waited for by group. Used by the quantizers'
// tiled passes (gpu/quantize_amax.cuh, gpu/fp8.cu) and the FP8 tensor-core GEMM's scale staging
// (gpu/fp8_wgmma.cu).
#pragma once
#include <cuda_runtime.h>

namespace fp4sim::gpu {

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
// 4 bytes to a shared-window address through L1 (.ca), zeros written instead where !valid (source
// size 0; src must still be a valid address).
__device__ __forceinline__ void cp_async4_zfill(unsigned smem, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem), "l"(gmem),
               "r"(valid ? 4 : 0)
               : "memory");
}
// 16 bytes to a shared-window address (.cg), zeros where !valid (as cp_async4_zfill).
__device__ __forceinline__ void cp_async16_zfill(unsigned smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace fp4sim::gpu
