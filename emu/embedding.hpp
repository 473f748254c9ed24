// Reference token and position embeddings of the training stack, forward and backward. The CUDA
// twins (gpu/embedding.cu) keep these names and argument orders.
#pragma once

#include <cstdint>

namespace fp4sim::emu {

// out (N,C) = wte[tokens[n]] + (wpe ? wpe[pos[n]] : 0).
void embedding_forward(float* out, const int32_t* tokens, const int32_t* pos, const float* wte,
                       const float* wpe, int64_t N, int64_t C);
// dwte[tokens[n]] += dout[n]; dwpe[pos[n]] += dout[n] (sequential: rows repeat).
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                        const int32_t* pos, int64_t N, int64_t C);

}  // namespace fp4sim::emu
