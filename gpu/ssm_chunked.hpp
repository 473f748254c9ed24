// The chunked SSD scan (gpu/ssm_chunked.cu): the CUDA backend's default Mamba-2 scan, forward and
// backward, within docs/numerics.md's bound of the emulator's sequential recurrence (gpu/ssm.cu
// keeps the bitwise sequential twin, CudaOptions::ssm_sequential). Internal to gpu/: the backend's
// ssm_scan_forward / ssm_scan_backward (gpu/ssm.cu) call these after the dt kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "emu/ssm.hpp"

namespace fp4sim::gpu {

// Device scratch of the sizes gpu/capabilities.hpp's ssd_chunked_*_scratch give (bytes):
// states, contrib, small (the terms buffer stays with the caller's dt backward pass).
struct SsdScratch {
  void* states = nullptr;
  float* contrib = nullptr;
  float* small = nullptr;
};

// emu::ssm_scan_forward's outputs: y (B,T,H*P) (rounded to BF16 values where round_bf16) and, where
// states is not null, states (B,H,chunks,P,N) = S at every chunk's last step. xbc, dt, A, D as the
// emulator's.
void ssd_chunked_forward(float* y, float* states, const float* xbc, const float* dt, const float* A,
                         const float* D, const emu::SsmShape& s, bool round_bf16,
                         const SsdScratch& ws, cudaStream_t stream);

// emu::ssm_scan_backward's outputs: dxbc (B,T,xbc_cols) written (rounded where round_bf16), ddt
// (B,T,H) written, dA (H) written, dD (H) +=. states: ssd_chunked_forward's (or the emulator's).
void ssd_chunked_backward(float* dxbc, float* ddt, float* dA, float* dD, const float* dy,
                          const float* xbc, const float* dt, const float* A, const float* D,
                          const float* states, const emu::SsmShape& s, bool round_bf16,
                          const SsdScratch& ws, cudaStream_t stream);

}  // namespace fp4sim::gpu
