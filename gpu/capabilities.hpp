// What the CUDA backend supports and the sizes of the device buffers it keeps, as host-only
// functions of the device's compute capability and the op's shape: CudaBackend uses them, and so
// does the CUDA backend's memory plan (model/memory_plan.hpp), which is made without a GPU (and in
// builds without the CUDA backend).
#pragma once

#include <cstddef>
#include <cstdint>

#include "emu/backend.hpp"

namespace fp4sim::gpu {

// The head sizes the attention kernels are instantiated for (gpu/attention.cu: a template
// argument).
constexpr bool attention_head_dim_supported(int64_t hd) {
  return hd == 16 || hd == 32 || hd == 64 || hd == 128;
}

// CudaBackend::supports on a device of compute capability cc_major: head sizes 16/32/64/128; the
// cuBLASLt GEMM reads decoded BF16 FP4 operands below compute capability 10 (no FP4 tensor cores)
// and FP8 scales in its own layout; the residual + LayerNorm, activation + matmul and activation +
// quantizer fusions.
inline bool cuda_supports(Capability c, int64_t arg, int cc_major) {
  switch (c) {
    case Capability::AttentionHeadDim:
      return attention_head_dim_supported(arg);
    case Capability::GemmDecodedOperand:
      return static_cast<GemmImpl>(arg) == GemmImpl::CublasLt && cc_major < 10;
    case Capability::GemmFp8Scales:
      return static_cast<GemmImpl>(arg) == GemmImpl::CublasLt;
    case Capability::FusedResidualNorm:
    case Capability::FusedActivationMatmul:
    case Capability::FusedActivationQuantize:
      return true;
  }
  return false;
}

// The cuBLASLt workspaces, allocated once: the training matmuls' (gpu/matmul.cu, on the first
// matmul) and the block-scaled GEMMs' (gpu/gemm_cublaslt.cu, on the first GEMM with recipe.gemm
// cublaslt).
constexpr size_t kMatmulCublasLtWorkspaceBytes = size_t{32} << 20;
constexpr size_t kGemmCublasLtWorkspaceBytes = size_t{64} << 20;

// The attention backward pass's stored-dS scratch (gpu/attention_backward.cuh): for each (b, h)
// the tile pairs (query tile, key tile <= it) of 64-row tiles, 8 KiB a pair; none for HD > 64,
// over 1 GiB, or with CudaOptions::attention_recompute_dq (the dQ kernel recomputes dS).
constexpr int64_t kAttentionTileRows = 64;
constexpr int64_t kAttentionDsPairBytes = 8192;
constexpr int64_t kAttentionMaxDsBytes = int64_t{1} << 30;
constexpr int64_t attention_ds_scratch_bytes(int64_t B, int64_t T, int64_t NH, int64_t HD,
                                             bool recompute_dq = false) {
  if (HD > 64 || B <= 0 || T <= 0 || recompute_dq) return 0;
  const int64_t tiles = (T + kAttentionTileRows - 1) / kAttentionTileRows;
  const int64_t bytes = B * NH * (tiles * (tiles + 1) / 2) * kAttentionDsPairBytes;
  return bytes <= kAttentionMaxDsBytes ? bytes : 0;
}

}  // namespace fp4sim::gpu
