// Reference LayerNorm and RMSNorm of the training stack, forward and backward, in the style of
// llm.c's CPU reference: plain loops, FP32 arithmetic with FP32 accumulation in index order, OpenMP
// only across independent rows. Shapes in the comments: N rows (tokens), C channels. The CUDA twins
// (gpu/norm.cu) keep these names and argument orders.
#pragma once

#include <cstdint>

namespace fp4sim::emu {

// out (N,C) = (inp - mean) * rstd * weight + bias; mean, rstd (N) saved for the backward pass.
// mean and variance in FP32 over the row in index order, rstd = 1 / sqrt(var + eps).
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int64_t N, int64_t C, float eps = 1e-5f);
// Accumulates into dinp (N,C), dweight (C), dbias (C).
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int64_t N, int64_t C);

// out (N,C) = inp * rstd * weight, rstd = 1 / sqrt(mean(inp^2) + eps) saved (N).
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                     int64_t C, float eps = 1e-5f);
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C);

}  // namespace fp4sim::emu
