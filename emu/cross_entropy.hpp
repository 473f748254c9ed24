// Reference softmax cross-entropy of the training stack (forward, backward, and both in one op), in
// the style of llm.c's CPU reference: plain loops, FP32 arithmetic with FP32 accumulation in index
// order, OpenMP only across independent rows. Shapes in the comments: N rows (tokens), V
// vocabulary. The CUDA twins (gpu/cross_entropy.cu) keep these names and argument orders.
#pragma once

#include <cstdint>

namespace fp4sim::emu {

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
