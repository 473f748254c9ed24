// Shared by the GPU tests: whether a CUDA GPU is present (the tests skip cleanly without one).
#pragma once

#if FP4SIM_HAVE_CUDA
#include "gpu/cuda_backend.hpp"
#endif

namespace fp4sim {

inline bool have_gpu() {
#if FP4SIM_HAVE_CUDA
  return gpu::gpu_available();
#else
  return false;
#endif
}

}  // namespace fp4sim
