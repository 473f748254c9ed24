// A device buffer that grows (never shrinks), for the scratch space of kernels queued on one
// stream. Growing first waits for that stream, so no queued kernel still reads the old buffer.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "emu/backend.hpp"
#include "gpu/cuda_check.hpp"

namespace fp4sim::gpu {

// cudaMalloc(p, bytes) for the buffer `what` (the CUDA backend's own, outside Backend::allocate):
// a failure is an AllocationError naming it, the size and the CUDA error (then cleared: an
// allocation failure leaves the context usable).
inline void device_malloc(void** p, size_t bytes, const std::string& what) {
  const cudaError_t e = cudaMalloc(p, bytes);
  if (e == cudaSuccess) return;
  *p = nullptr;
  (void)cudaGetLastError();
  size_t free_b = 0, total_b = 0;
  const bool info = cudaMemGetInfo(&free_b, &total_b) == cudaSuccess;
  throw AllocationError("cannot allocate " + bytes_text(bytes) + " for " + what +
                            " in the cuda backend's device memory: " + cudaGetErrorString(e) +
                            " (" + cudaGetErrorName(e) + ")" +
                            (info ? ", " + bytes_text(free_b) + " free" : std::string()),
                        bytes);
}

struct DeviceScratch {
  void* ptr = nullptr;
  size_t bytes = 0;
  const char* name = "a scratch buffer";  // what it holds, for a failed allocation's message
  DeviceScratch() = default;
  explicit DeviceScratch(const char* what) : name(what) {}
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
      device_malloc(&ptr, need, std::string("the CUDA backend's scratch '") + name + "'");
      bytes = need;
    }
    return static_cast<T*>(ptr);
  }
};

}  // namespace fp4sim::gpu
