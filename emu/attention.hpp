// Reference causal self-attention of the training stack, forward and backward. The CUDA twins
// (gpu/attention.cu) keep these names and argument orders.
#pragma once

#include <cstdint>

#include "emu/matmul.hpp"

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

}  // namespace fp4sim::emu
