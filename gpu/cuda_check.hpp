// Checked CUDA calls: every runtime/cuBLASLt call and every launch goes through these.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>

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

#define FP4SIM_CUDA_CHECK(call)                                         \
  do {                                                                  \
    cudaError_t fp4sim_err_ = (call);                                   \
    if (fp4sim_err_ != cudaSuccess)                                     \
      ::fp4sim::gpu::cuda_fail(fp4sim_err_, #call, __FILE__, __LINE__); \
  } while (0)

// After every kernel launch.
#define FP4SIM_CUDA_CHECK_LAUNCH() FP4SIM_CUDA_CHECK(cudaGetLastError())

// Every cuBLASLt call.
#define FP4SIM_CUBLAS_CHECK(call)                                                           \
  do {                                                                                      \
    cublasStatus_t fp4sim_st_ = (call);                                                     \
    if (fp4sim_st_ != CUBLAS_STATUS_SUCCESS)                                                \
      throw std::runtime_error(std::string("cuBLASLt error: ") +                            \
                               cublasLtGetStatusName(fp4sim_st_) + " (" +                   \
                               cublasLtGetStatusString(fp4sim_st_) + ") in " #call " at " + \
                               __FILE__ + ":" + std::to_string(__LINE__));                  \
  } while (0)

namespace fp4sim::gpu {

// Lets `kernel` launch with `bytes` of dynamic shared memory (over the 48 KB default) on the
// current device: a function attribute is per device, so it is set once per kernel and device,
// under a lock (several host threads may launch).
inline void allow_dynamic_smem(const void* kernel, size_t bytes) {
  static std::mutex mutex;
  static std::set<std::pair<const void*, int>> allowed;  // (kernel, device)
  int device = 0;
  FP4SIM_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  if (allowed.count({kernel, device}) != 0) return;
  FP4SIM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(bytes)));
  allowed.insert({kernel, device});
}

}  // namespace fp4sim::gpu
