// A device buffer that grows (never shrinks), for the scratch space of kernels queued on one
// stream. Growing first waits for that stream, so no queued kernel still reads the old buffer.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "gpu/cuda_check.hpp"

namespace fp4sim::gpu {

struct DeviceScratch {
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceScratch() = default;
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  ~DeviceScratch() {
    if (ptr) cudaFree(ptr);
  }
  template <class T>
  T* get(size_t count, cudaStream_t stream) {
    const size_t need = count * sizeof(T);
    if (need > bytes) {
      FP4SIM_CUDA_CHECK(cudaStreamSynchronize(stream));
      if (ptr) FP4SIM_CUDA_CHECK(cudaFree(ptr));
      ptr = nullptr;
      bytes = 0;
      FP4SIM_CUDA_CHECK(cudaMalloc(&ptr, need));
      bytes = need;
    }
    return static_cast<T*>(ptr);
  }
};

}  // namespace fp4sim::gpu
