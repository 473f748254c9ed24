// CUDA-event timing for the benchmarks (tools/bench_*.cpp): the mean time of `reps` calls of f on
// stream s, events recorded around them and synchronised.
#pragma once

#include <cuda_runtime.h>

#include "gpu/cuda_check.hpp"

namespace fp4sim {

struct GpuTimer {
  cudaEvent_t a, b;
  GpuTimer() {
    FP4SIM_CUDA_CHECK(cudaEventCreate(&a));
    FP4SIM_CUDA_CHECK(cudaEventCreate(&b));
  }
  ~GpuTimer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  GpuTimer(const GpuTimer&) = delete;
  GpuTimer& operator=(const GpuTimer&) = delete;
  template <class F>
  double ms(cudaStream_t s, int reps, F&& f) {
    FP4SIM_CUDA_CHECK(cudaEventRecord(a, s));
    for (int i = 0; i < reps; ++i) f();
    FP4SIM_CUDA_CHECK(cudaEventRecord(b, s));
    FP4SIM_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    FP4SIM_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    return static_cast<double>(t) / reps;
  }
};

}  // namespace fp4sim
