// Checked CUDA calls: every runtime/cuBLASLt call and every launch goes through these.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace fp4sim::gpu {

[[noreturn]] inline void cuda_fail(cudaError_t e, const char* what, const char* file, int line) {
  throw std::runtime_error(std::string("CUDA error: ") + cudaGetErrorString(e) + " (" +
                           cudaGetErrorName(e) + ") in " + what + " at " + file + ":" +
                           std::to_string(line));
}

// Blocks of `threads` for a grid-stride loop over n items: one item per thread, at least one block,
// at most 65535 * 8 (the loop walks the rest).
inline int grid_stride_blocks(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<int>(b < 65535 * 8 ? (b > 0 ? b : 1) : 65535 * 8);
}

}  // namespace fp4sim::gpu

#define FP4SIM_CUDA_CHECK(call)                                                    \
  do {                                                                             \
    cudaError_t fp4sim_err_ = (call);                                              \
    if (fp4sim_err_ != cudaSuccess)                                                \
      ::fp4sim::gpu::cuda_fail(fp4sim_err_, #call, __FILE__, __LINE__);            \
  } while (0)

// After every kernel launch.
#define FP4SIM_CUDA_CHECK_LAUNCH() FP4SIM_CUDA_CHECK(cudaGetLastError())
