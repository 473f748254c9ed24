// Exponentials in base 2 on the device: the one copy shared by the attention kernels
// (gpu/attention.cu) and the cross-entropy kernel (gpu/cross_entropy.cu), which both compute e^x as
// 2^(x log2 e) with one MUFU.EX2, as FlashAttention and torch.compile's generated kernels do.
#pragma once

#include <cuda_runtime.h>

namespace fp4sim::gpu {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// 2^x with one MUFU.EX2 (ex2.approx.ftz: about 2 ulp, 2.05 the worst measured; an integer power of
// two exact, so 2^0 = 1; subnormal results flushed to +0, 2^-inf = +0: tests/gpu/
// test_formats_gpu.cu, FormatsGpu.Exp2FtzExactPowersAndAboutTwoUlp). exp2f is the same instruction
// with a rescaling around it for subnormal results (four instructions), expf eight with its
// two-part reduction of x log2 e.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace fp4sim::gpu
