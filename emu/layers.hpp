// Reference layer ops of the training stack (issue 4 groundwork), forward and backward, in the
// style of llm.c's CPU reference: plain loops, FP32 arithmetic with FP32 accumulation in index
// order, OpenMP only across independent rows. Shapes in the comments: N rows (tokens), C channels,
// V vocabulary. The CUDA twins will keep these names and argument orders.
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

// Fused softmax + cross-entropy: probs (N,V) = softmax(logits), losses (N) = -log probs[target].
// bf16_logits: each logit is read as bf16_round(logit), the model's BF16 storage of the logits
// applied where they are read (the logits GEMM leaves its output unrounded: no pass over N x V).
void crossentropy_softmax_forward(float* losses, float* probs, const float* logits,
                                  const int32_t* targets, int64_t N, int64_t V, bool bf16_logits);
// dlogits (N,V) = (probs - onehot(target)) * dlosses[n] (RN each; written, not accumulated: the
// logits have no other consumer), then bf16_round when round_bf16 (the model's BF16 storage of the
// gradient, fused into the op instead of a separate pass).
void crossentropy_softmax_backward(float* dlogits, const float* probs, const int32_t* targets,
                                   const float* dlosses, int64_t N, int64_t V, bool round_bf16);
// Both at once for training: losses as crossentropy_softmax_forward with bf16_logits = round_bf16,
// dlogits as crossentropy_softmax_backward applied to the probabilities that forward would write
// (the same bits), without the (N,V) probabilities ever stored. round_bf16 is the model's BF16
// storage on both sides: the logits read rounded, the gradient written rounded.
void crossentropy_softmax_forward_backward(float* losses, float* dlogits, const float* logits,
                                           const int32_t* targets, const float* dlosses, int64_t N,
                                           int64_t V, bool round_bf16);

}  // namespace fp4sim::emu

namespace fp4sim::emu {

// BF16 GEMM as the tensor core computes it (DESIGN.md §8): out (M,N) = A (M,K) * B (N,K)^T with
// both operands rounded to BF16 (RNE) and each output a chain of T-FDPA(L=16, F=25, RZ) over K in
// increasing order from +0 (K padded with zeros to a multiple of 16). Exact emulation: slow.
void bf16_gemm_tn(float* out, const float* a, const float* b, int64_t M, int64_t N, int64_t K);

// out (M,N) = A (M,K) * B (N,K)^T in plain FP32 (index-order sums): for gradient checks, where
// BF16 rounding would make finite differences meaningless.
void fp32_gemm_tn(float* out, const float* a, const float* b, int64_t M, int64_t N, int64_t K);

enum class GemmPrecision { BF16, FP32 };

// out (N,OC) += bias (OC) broadcast over rows (FP32 RN); dbias (OC) += column sums of dout (N,OC)
// in a fixed chunking both backends share: rows in chunks of kColumnChunkRows, each chunk summed in
// FP32 from +0 in increasing n, the chunk sums added in increasing order, then added to dbias (the
// bias half of matmul_forward/backward, also used alone by layers whose GEMMs are quantized).
constexpr int64_t kColumnChunkRows = 64;
void bias_forward(float* out, const float* bias, int64_t N, int64_t OC);
void bias_backward(float* dbias, const float* dout, int64_t N, int64_t OC);

// Linear layer y = x W^T + bias (x (N,K), W (OC,K), y (N,OC)), the GEMMs in BF16 as above.
void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N,
                    int64_t K, int64_t OC, GemmPrecision prec = GemmPrecision::BF16);
// dinp (N,K) = dout W (written: what dinp held does not matter); dweight (OC,K) += dout^T inp;
// dbias (OC) += column sums of dout (FP32, bias_backward's order).
// Any of dinp, dweight, dbias may be null (that product is skipped).
void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t N, int64_t K, int64_t OC,
                     GemmPrecision prec = GemmPrecision::BF16);

}  // namespace fp4sim::emu

namespace fp4sim::emu {

// Causal self-attention with grouped KV heads, in the FlashAttention form: the (B,NH,T,T)
// probabilities are never stored; the backward pass recomputes them from lse.
// qkv (B,T,(NH + 2*NKV)*HD): the NH query heads, then NKV key heads, then NKV value heads; query
// head h reads KV head h / (NH/NKV). out (B,T,NH*HD); lse (B,NH,T) the per-row log-sum-exp of the
// scaled scores (natural log), saved for backward. Query row t sees keys j <= t.
// Numerics (both backends; the CUDA twin agrees within a bound, not bitwise: its sums are the
// tensor core's in its own order, its exp is 2^x by ex2.approx.ftz on base-2 scores, its softmax is
// online):
// - q, k, v (and dout in the backward) are rounded to BF16 (RNE, bf16_round) before use: a no-op
//   for BF16-stored activations. scale = 1/sqrt(HD) in FP32.
// - Every sum of products is one of attention's batched BF16 GEMMs (DESIGN.md §8): a T-FDPA chain
//   (L = 16, F = 25, RZ) over chunks of 16 consecutive indices of the summed dimension, chunk
//   boundaries at multiples of 16 from index 0, in increasing order, from +0; indices outside the
//   causal range are zero terms.
// - s_j = (chain over i of q_i k_ji) * scale; m = max_{j<=t} s_j; p_j = exp(s_j - m) (FP32);
//   l = sum_j p_j (FP32, increasing j, p unrounded); lse = m + log(l).
// - out_i = (chain over j of bf16(p_j) v_ji) / l: P rounded to BF16 before the PV product, as it
//   is fed to a tensor core; one FP32 division.
// prec = FP32 drops every BF16 rounding (q, k, v, dout, P, dS stay FP32) and sums in FP32 in
// increasing index instead of the chains, as matmul's FP32 mode: for gradient checks only, where
// the roundings would make finite differences meaningless; the CUDA kernels refuse it.
void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t NH,
                       int64_t NKV, int64_t HD, GemmPrecision prec = GemmPrecision::BF16);
// dqkv (B,T,(NH+2NKV)*HD) = gradients, every element written as +0 + its value (the bits of adding
// it to a zeroed dqkv: -0 becomes +0), nothing read from dqkv; dout (B,T,NH*HD); out and lse from
// attention_forward.
// Numerics, per query row t of head h (q, k, v, dout rounded to BF16 as above; "chain" as above):
// - p_j = exp(s_j - lse) (s_j recomputed as in the forward pass); dP_j = chain over i of
//   dout_i v_ji; Dsum = sum_i dout_i out_i (FP32, increasing i: not a GEMM); dS_j = p_j * (dP_j -
//   Dsum) (FP32).
// - dq = scale * (chain over j of bf16(dS_j) k_j), one FP32 multiplication, written (+0 + dq).
// - dk_j = scale * (sum over h, t of bf16(dS_tj) q_t), dv_j = sum over h, t of bf16(p_tj) dout_t:
//   one chain continued over the KV head's query heads h in increasing order, each over t (chunks
//   of 16 t from 0; t < j are zero terms); then the scale multiplication (dk only), written
//   (+0 + value). So a KV head's gradient sums over its query heads (GQA), and scale is
//   applied once to each sum, never to a BF16 operand.
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HD,
                        GemmPrecision prec = GemmPrecision::BF16);

// Rotary position embedding on the query and key heads of qkv, in place: pairs (2i, 2i+1) of each
// head at position t rotate by t * base^(-2i/HD). The backward pass rotates the gradient back
// (rope_backward on dqkv).
void rope_forward(float* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HD,
                  float base = 10000.0f);
void rope_backward(float* dqkv, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HD,
                   float base = 10000.0f);

}  // namespace fp4sim::emu

namespace fp4sim::emu {

// out (N,C) = wte[tokens[n]] + (wpe ? wpe[pos[n]] : 0).
void embedding_forward(float* out, const int32_t* tokens, const int32_t* pos, const float* wte,
                       const float* wpe, int64_t N, int64_t C);
// dwte[tokens[n]] += dout[n]; dwpe[pos[n]] += dout[n] (sequential: rows repeat).
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                        const int32_t* pos, int64_t N, int64_t C);

}  // namespace fp4sim::emu
