// What the CUDA backend supports and the sizes of the device buffers it keeps, as host-only
// functions of the device's compute capability and the op's shape: CudaBackend uses them, and so
// does the CUDA backend's memory plan (model/memory_plan.hpp), which is made without a GPU (and in
// builds without the CUDA backend).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "emu/backend.hpp"

namespace fp4sim::gpu {

// The head sizes the attention kernels are instantiated for (gpu/attention.cu: a template
// argument).
constexpr bool attention_head_dim_supported(int64_t hd) {
  return hd == 16 || hd == 32 || hd == 64 || hd == 128;
}

// The Mamba-2 ops' limits (gpu/ssm.cu): the conv backward pass keeps a width's gradient sums in
// registers; the scan's thread blocks have P threads (forward) and max(P, N) (backward).
constexpr int64_t kSsmMaxConvWidth = 8;
constexpr int64_t kSsmMaxScanSize = 1024;

// CudaBackend::supports on a device of compute capability cc_major: head sizes 16/32/64/128; the
// cuBLASLt GEMM reads decoded BF16 FP4 operands below compute capability 10 (no FP4 tensor cores)
// and FP8 scales in its own layout; the residual + LayerNorm, activation + matmul and activation +
// quantizer fusions; Mamba-2 conv widths up to 8, head dims and state sizes up to 1024, chunks up
// to kSsdMaxChunk.
// The chunked SSD's longest chunk (gpu/ssm_chunked.cu): the log-decay gradient's kernel keeps a
// chunk's per-step sums in shared memory. (The sequential scan, CudaOptions::ssm_sequential, takes
// any chunk: CudaBackend::supports.)
constexpr int64_t kSsdMaxChunk = 1024;

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
    case Capability::SsmConvWidth:
      return arg > 0 && arg <= kSsmMaxConvWidth;
    case Capability::SsmScanSize:
      return arg > 0 && arg <= kSsmMaxScanSize;
    case Capability::SsmChunk:
      return arg > 0 && arg <= kSsdMaxChunk;
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

// The Mamba-2 ops' parameter-gradient partial sums (gpu/ssm.cu, emu/ssm.hpp's two-level row sums):
// `sums` sums of C channels over `rows` rows, one float per row block, channel and sum.
inline int64_t ssm_partials_floats(int64_t rows, int64_t C, int64_t sums) {
  return (rows + emu::kSsmSumRows - 1) / emu::kSsmSumRows * C * sums;
}

// The Mamba-2 scan's backward pass (gpu/ssm.cu) runs at most this many (batch, head) work items at
// once (a thread block each, twice the SMs of an H200; more wait for a free block), each with
// (chunk + 1) P N floats of recomputed chunk states in scratch, at most kSsmScanStateBytes in all.
constexpr int64_t kSsmScanSlots = 264;
constexpr int64_t kSsmScanStateBytes = int64_t{2} << 30;
inline int64_t ssm_scan_backward_slots(const SsmShape& s) {
  const int64_t per_slot = (s.chunk + 1) * s.P * s.N * static_cast<int64_t>(sizeof(float));
  int64_t slots = std::min(s.B * s.H, kSsmScanSlots);
  slots = std::min(slots, kSsmScanStateBytes / per_slot);
  return slots > 0 ? slots : 1;
}
inline int64_t ssm_scan_backward_state_bytes(const SsmShape& s) {
  return ssm_scan_backward_slots(s) * (s.chunk + 1) * s.P * s.N *
         static_cast<int64_t>(sizeof(float));
}

// The chunked SSD scan (gpu/ssm_chunked.cu, CudaOptions::ssm_sequential false) keeps its
// intermediates in the scan's scratch buffers; the sizes in bytes, by buffer:
// - states: the decays' log-sums (B*H*T doubles), each group's chunk products C B^T (B*G*chunks
//   Q x Q floats); the forward pass adds the chunk states where the caller saves none (forward
//   only), the backward pass the chunk state gradients (B*H*chunks P x N) and each head's
//   decayed dy.u products (B*H*chunks Q x Q);
// - contrib (backward): each head's dB and dC terms (B*T*H 2N floats), summed per group after;
// - small (backward): ddt, dA, the per-tile partial sums of each row (4 tiles-of-P and 1
//   tile-of-N arrays of B*T*H floats each), and per (batch, head, chunk) sums;
// - terms (backward): the softplus backward pass's du (B*T*H floats), as the sequential scan's.
constexpr int64_t kSsdTile = 64;  // the chunk GEMMs' output tile (rows and columns)
struct SsdScratchBytes {
  int64_t states = 0, contrib = 0, small = 0, terms = 0;
};
inline int64_t ssd_tiles(int64_t n) { return (n + kSsdTile - 1) / kSsdTile; }
// The elements of a (P x N) chunk state each thread block of the state-passing kernels takes.
constexpr int64_t kSsdPassElems = 256;
constexpr int64_t kSsdPassWarps = kSsdPassElems / 32;  // (a partial sum of <Gout, S> each)
inline SsdScratchBytes ssd_chunked_forward_scratch(const SsmShape& s, bool saves_states) {
  const int64_t nc = s.chunks(), Q = s.chunk;
  SsdScratchBytes b;
  b.states = 8 * s.B * s.H * s.T + 4 * s.B * s.G * nc * Q * Q;
  if (!saves_states) b.states += 4 * s.states_size();
  return b;
}
inline SsdScratchBytes ssd_chunked_backward_scratch(const SsmShape& s) {
  const int64_t nc = s.chunks(), Q = s.chunk, BT = s.B * s.T, BHC = s.B * s.H * nc;
  const int64_t pass_blocks = (s.P * s.N + kSsdPassElems - 1) / kSsdPassElems;
  SsdScratchBytes b;
  b.states = 8 * s.B * s.H * s.T + 4 * (s.B * s.G * nc * Q * Q + s.states_size() + BHC * Q * Q);
  b.contrib = 4 * BT * s.H * 2 * s.N;
  b.small = 4 * (BT * s.H + s.H + BT * s.H * (3 * ssd_tiles(s.P) + ssd_tiles(s.N)) +
                 BHC * (pass_blocks * kSsdPassWarps + 2));
  b.terms = 4 * BT * s.H;
  return b;
}

}  // namespace fp4sim::gpu
