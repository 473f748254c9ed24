#include "emu/embedding.hpp"

namespace fp4sim::emu {

void embedding_forward(float* out, const int32_t* tokens, const int32_t* pos, const float* wte,
                       const float* wpe, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < C; ++i)
      out[n * C + i] = wte[tokens[n] * C + i] + (wpe ? wpe[pos[n] * C + i] : 0.0f);
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                        const int32_t* pos, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < C; ++i) {
      dwte[tokens[n] * C + i] += dout[n * C + i];
      if (dwpe) dwpe[pos[n] * C + i] += dout[n * C + i];
    }
}

}  // namespace fp4sim::emu
