// Native checks for owners of Blackwell GPUs (fp4sim probe): the hardware's FP4 conversions against
// the model. Compiled for every target; the instructions exist only in the sm_100a / sm_120a code
// (cvt.rn...e2m1x2: both; cvt.rs...e2m1x4: sm_100a), elsewhere the kernels report "unsupported".
// Not yet here: the MMA probe (mma ... kind::mxf4nvf4.block_scale / tcgen05.mma), whose register
// fragment layouts need a Blackwell GPU to be got right.
#include <cuda_runtime.h>

#include "emu/formats.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/probe.hpp"

namespace fp4sim::gpu {
namespace {

#if defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM120_ALL)
#define FP4SIM_NATIVE_CVT_RN 1
#endif
#if defined(__CUDA_ARCH_FEAT_SM100_ALL)
#define FP4SIM_NATIVE_CVT_RS 1
#endif

// cvt.rn.satfinite.e2m1x2.f32 d, a, b: a's code in the upper nibble of d, b's in the lower.
__device__ uint32_t native_e2m1x2_rn(float a, float b) {
#if defined(FP4SIM_NATIVE_CVT_RN)
  uint16_t d;
  asm("{.reg .b8 t;\n cvt.rn.satfinite.e2m1x2.f32 t, %1, %2;\n cvt.u16.u8 %0, t;}"
      : "=h"(d)
      : "f"(a), "f"(b));
  return d;
#else
  return 0xFFFFFFFFu;
#endif
}

// cvt.rs.satfinite.e2m1x4.f32 d, {a, b, e, f}, rbits (16-bit result).
__device__ uint32_t native_e2m1x4_rs(float a, float b, float e, float f, uint32_t rbits) {
#if defined(FP4SIM_NATIVE_CVT_RS)
  uint16_t d;
  asm("cvt.rs.satfinite.e2m1x4.f32 %0, {%1, %2, %3, %4}, %5;"
      : "=h"(d)
      : "f"(a), "f"(b), "f"(e), "f"(f), "r"(rbits));
  return d;
#else
  (void)a, (void)b, (void)e, (void)f, (void)rbits;
  return 0xFFFFFFFFu;
#endif
}

// Every FP32 bit pattern through the native RN conversion and the model, in the kernel.
__global__ void cvt_rn_sweep_kernel(unsigned long long* mismatches, unsigned int* first_bad,
                                    int* unsupported) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  unsigned long long bad = 0;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (1ull << 32);
       i += stride) {
    const float x = f32_from_bits(static_cast<uint32_t>(i));
    const uint32_t d = native_e2m1x2_rn(x, 0.0f);
    if (d == 0xFFFFFFFFu) {
      *unsupported = 1;
      return;
    }
    if (((d >> 4) & 0xFu) != e2m1_rn_satfinite(x)) {
      ++bad;
      atomicMin(first_bad, static_cast<unsigned int>(i));
    }
  }
  if (bad) atomicAdd(mismatches, bad);
}

// rbits experiments: out[t] = the 16-bit result for rbits[t], inputs 0.25, 1.25, 2.5, 5 (each half
// way between its two grid points, their code pairs {0,1}, {2,3}, {4,5}, {6,7} disjoint).
__global__ void cvt_rs_experiment_kernel(const uint32_t* rbits, uint32_t* out, int n) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < n) out[t] = native_e2m1x4_rs(0.25f, 1.25f, 2.5f, 5.0f, rbits[t]);
}

}  // namespace

NativeProbe run_native_probe() {
  NativeProbe p{};
  int dev = 0;
  FP4SIM_CUDA_CHECK(cudaGetDevice(&dev));
  FP4SIM_CUDA_CHECK(cudaDeviceGetAttribute(&p.cc_major, cudaDevAttrComputeCapabilityMajor, dev));
  FP4SIM_CUDA_CHECK(cudaDeviceGetAttribute(&p.cc_minor, cudaDevAttrComputeCapabilityMinor, dev));
  unsigned long long* mism = nullptr;
  unsigned int* first = nullptr;
  int* unsup = nullptr;
  FP4SIM_CUDA_CHECK(cudaMalloc(&mism, sizeof *mism));
  FP4SIM_CUDA_CHECK(cudaMalloc(&first, sizeof *first));
  FP4SIM_CUDA_CHECK(cudaMalloc(&unsup, sizeof *unsup));
  FP4SIM_CUDA_CHECK(cudaMemset(mism, 0, sizeof *mism));
  FP4SIM_CUDA_CHECK(cudaMemset(first, 0xFF, sizeof *first));
  FP4SIM_CUDA_CHECK(cudaMemset(unsup, 0, sizeof *unsup));
  cvt_rn_sweep_kernel<<<4096, 256>>>(mism, first, unsup);
  FP4SIM_CUDA_CHECK_LAUNCH();
  int u = 0;
  FP4SIM_CUDA_CHECK(cudaMemcpy(&u, unsup, sizeof u, cudaMemcpyDeviceToHost));
  FP4SIM_CUDA_CHECK(cudaMemcpy(&p.rn_mismatches, mism, sizeof p.rn_mismatches, cudaMemcpyDeviceToHost));
  FP4SIM_CUDA_CHECK(cudaMemcpy(&p.rn_first_mismatch, first, sizeof p.rn_first_mismatch, cudaMemcpyDeviceToHost));
  p.cvt_rn_supported = u == 0;
  // rbits experiments: all zero, all ones, then 0x80 in one byte at a time
  const uint32_t h_rbits[6] = {0u, 0xFFFFFFFFu, 0x80u, 0x8000u, 0x800000u, 0x80000000u};
  uint32_t *d_rbits = nullptr, *d_out = nullptr;
  FP4SIM_CUDA_CHECK(cudaMalloc(&d_rbits, sizeof h_rbits));
  FP4SIM_CUDA_CHECK(cudaMalloc(&d_out, sizeof h_rbits));
  FP4SIM_CUDA_CHECK(cudaMemcpy(d_rbits, h_rbits, sizeof h_rbits, cudaMemcpyHostToDevice));
  cvt_rs_experiment_kernel<<<1, 32>>>(d_rbits, d_out, 6);
  FP4SIM_CUDA_CHECK_LAUNCH();
  FP4SIM_CUDA_CHECK(cudaMemcpy(p.rs_results, d_out, sizeof h_rbits, cudaMemcpyDeviceToHost));
  for (int i = 0; i < 6; ++i) p.rs_rbits[i] = h_rbits[i];
  p.cvt_rs_supported = p.rs_results[0] != 0xFFFFFFFFu;
  cudaFree(mism);
  cudaFree(first);
  cudaFree(unsup);
  cudaFree(d_rbits);
  cudaFree(d_out);
  return p;
}

}  // namespace fp4sim::gpu
