#include "emu/cross_entropy.hpp"

#include <cmath>

#include "emu/formats.hpp"

namespace fp4sim::emu {

namespace {

// One row of the softmax cross-entropy: p (V) = softmax(z), *loss = -log p[target]; each logit
// read as bf16_round(z[i]) when bf16_logits.
void crossentropy_forward_row(float* loss, float* p, const float* z, int32_t target, int64_t V,
                              bool bf16_logits) {
  auto logit = [&](int64_t i) { return bf16_logits ? bf16_round(z[i]) : z[i]; };
  float maxv = -INFINITY;
  for (int64_t i = 0; i < V; ++i) maxv = logit(i) > maxv ? logit(i) : maxv;
  float sum = 0.0f;
  for (int64_t i = 0; i < V; ++i) {
    p[i] = std::exp(logit(i) - maxv);
    sum += p[i];
  }
  for (int64_t i = 0; i < V; ++i) p[i] = p[i] / sum;
  *loss = -std::log(p[target]);
}

// d (V) = (p - onehot(target)) * dloss (d may be p itself).
void crossentropy_backward_row(float* d, const float* p, int32_t target, float dloss, int64_t V,
                               bool round_bf16) {
  for (int64_t i = 0; i < V; ++i) {
    const float indicator = i == target ? 1.0f : 0.0f;
    const float v = (p[i] - indicator) * dloss;
    d[i] = round_bf16 ? bf16_round(v) : v;
  }
}

}  // namespace

void crossentropy_softmax_forward(float* losses, float* probs, const float* logits,
                                  const int32_t* targets, int64_t N, int64_t V, bool bf16_logits) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    crossentropy_forward_row(losses + n, probs + n * V, logits + n * V, targets[n], V, bf16_logits);
}

// Row by row: the forward's probabilities in dlogits' row, then the backward's expression on them
// in place: the same operations as the two ops one after the other.
void crossentropy_softmax_forward_backward(float* losses, float* dlogits, const float* logits,
                                           const int32_t* targets, const float* dlosses, int64_t N,
                                           int64_t V, bool round_bf16) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float* d = dlogits + n * V;
    crossentropy_forward_row(losses + n, d, logits + n * V, targets[n], V, round_bf16);
    crossentropy_backward_row(d, d, targets[n], dlosses[n], V, round_bf16);
  }
}

void crossentropy_softmax_backward(float* dlogits, const float* probs, const int32_t* targets,
                                   const float* dlosses, int64_t N, int64_t V, bool round_bf16) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    crossentropy_backward_row(dlogits + n * V, probs + n * V, targets[n], dlosses[n], V,
                              round_bf16);
}

}  // namespace fp4sim::emu
