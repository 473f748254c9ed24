// GELU (tanh approximation) on the device: the one copy of its arithmetic, shared by the activation
// kernels (gpu/elementwise.cu), the matmuls' fused GELU passes (gpu/matmul.cu) and the FP8
// quantizer's fused activation sources (gpu/fp8.cu), so a fused pass computes the very bits the
// separate op stores.
//
// The emulator's order of operations (emu/elementwise.cpp) with _rn intrinsics: cube =
// ((0.044715 x) x) x; gelu = (0.5 x) (1 + tanhf(sqrt(2/pi) (x + cube))); its derivative
// local = 0.5 (1 + t) + (((x 0.5) sech2) sqrt(2/pi)) (1 + (3 0.044715) x x), t the same tanhf,
// sech2 = 1 - t t. The forward's t is CUDA tanhf (<= 2 ulp); the derivative's is tanh_exp2 below
// (one MUFU.EX2 and one MUFU.RCP: tanhf's ~20 instructions made the backward pass compute-bound),
// whose absolute error (~1e-7) is tanhf's where it matters: 1 + t and 1 - t t cancel the same way
// with either. A few ulp of the derivative's terms from the emulator, not bitwise.
#pragma once

#include <cuda_runtime.h>

#include "emu/formats.hpp"
#include "gpu/exp2.cuh"
#include "gpu/formats_device.cuh"

namespace fp4sim::gpu {

// GELU constants, the same FP32 literals as emu/elementwise.cpp.
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluCubic = 0.044715f;

__device__ __forceinline__ float gelu_tanh_value(float x) {
  const float cube = __fmul_rn(__fmul_rn(__fmul_rn(kGeluCubic, x), x), x);
  return __fmul_rn(__fmul_rn(0.5f, x),
                   __fadd_rn(1.0f, tanhf(__fmul_rn(kGeluScale, __fadd_rn(x, cube)))));
}

// tanh(y) = 1 - 2 / (e^(2y) + 1), e^(2y) = 2^(2y log2 e) by exp2_ftz and the reciprocal by
// rcp.approx.ftz (<= 1 ulp; its argument is >= 1): absolute error ~1e-7 over the whole range (its
// relative error is large only for |y| < ~1e-3, where t ~ 0 next to the derivative's 0.5); exactly
// +-1 past |y| ~ 9 (e^(2y) + 1 rounds to e^(2y) or 1), NaN for NaN.
__device__ __forceinline__ float tanh_exp2(float y) {
  const float e = exp2_ftz(__fmul_rn(y, 2.0f * kLog2e));
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(__fadd_rn(e, 1.0f)));
  return __fmaf_rn(-2.0f, r, 1.0f);
}

// d gelu / dx at x
__device__ __forceinline__ float gelu_tanh_local_grad(float x) {
  const float cube = __fmul_rn(__fmul_rn(__fmul_rn(kGeluCubic, x), x), x);
  const float t = tanh_exp2(__fmul_rn(kGeluScale, __fadd_rn(x, cube)));
  const float sech2 = __fsub_rn(1.0f, __fmul_rn(t, t));
  const float poly = __fadd_rn(1.0f, __fmul_rn(__fmul_rn(__fmul_rn(3.0f, kGeluCubic), x), x));
  return __fadd_rn(__fmul_rn(0.5f, __fadd_rn(1.0f, t)),
                   __fmul_rn(__fmul_rn(__fmul_rn(__fmul_rn(x, 0.5f), sech2), kGeluScale), poly));
}

// The stored GELU output: bf16_round when round_bf16 (the model's BF16 activations).
__device__ __forceinline__ float gelu_forward_stored(float x, bool round_bf16) {
  const float v = gelu_tanh_value(x);
  return round_bf16 ? bf16_round_cvt(v) : v;
}

// The stored GELU input gradient, +0 + local * dout (written, never accumulated:
// emu/elementwise.hpp), dout read as bf16_round(dout) when bf16_dout, the result bf16_round-ed when
// round_bf16.
__device__ __forceinline__ float gelu_backward_stored(float x, float dout, bool round_bf16,
                                                      bool bf16_dout) {
  const float v =
      __fadd_rn(0.0f, __fmul_rn(gelu_tanh_local_grad(x), bf16_dout ? bf16_round_cvt(dout) : dout));
  return round_bf16 ? bf16_round_cvt(v) : v;
}

}  // namespace fp4sim::gpu
