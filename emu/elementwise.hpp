// Reference elementwise ops of the training stack: the activations (GELU, squared ReLU, SwiGLU),
// the BF16 rounding of stored activations, and RoPE (each pair of a head's elements rotated),
// forward and backward, in the style of llm.c's CPU reference: plain loops, FP32 arithmetic,
// OpenMP only across independent elements. The CUDA twins (gpu/elementwise.cu) keep these names and
// argument orders.
#pragma once

#include <cstdint>

namespace fp4sim::emu {

// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). n elements.
void gelu_forward(float* out, const float* inp, int64_t n);
// The activations' backward passes write dinp = +0 + local * dout (the bits of accumulating into a
// zeroed dinp: -0 becomes +0) and never read dinp, so the caller needs no zeroing pass.
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n);

// x (n) rounded to BF16 in place (RNE), as the activations' BF16 storage (DESIGN.md §9).
void round_to_bf16(float* x, int64_t n);

// Squared ReLU: max(x, 0)^2.
void squared_relu_forward(float* out, const float* inp, int64_t n);
void squared_relu_backward(float* dinp, const float* inp, const float* dout, int64_t n);

// SwiGLU: inp (N, 2F) holds [gate | up] per row; out (N,F) = silu(gate) * up,
// silu(x) = x / (1 + exp(-x)). The backward pass writes both halves of dinp (N, 2F), as above.
void swiglu_forward(float* out, const float* inp, int64_t N, int64_t F);
void swiglu_backward(float* dinp, const float* inp, const float* dout, int64_t N, int64_t F);

// Rotary position embedding on the query and key heads of qkv, in place: pairs (2i, 2i+1) of each
// head at position t rotate by t * base^(-2i/HD). The backward pass rotates the gradient back
// (rope_backward on dqkv).
void rope_forward(float* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HD,
                  float base = 10000.0f);
void rope_backward(float* dqkv, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HD,
                   float base = 10000.0f);

}  // namespace fp4sim::emu
