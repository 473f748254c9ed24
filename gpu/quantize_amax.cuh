// The quantizer's first pass (gpu/quantize.cu): the global amax of the input and, for an RHT
// column-wise copy, of its transform (kept for the second pass where asked): flat, tiled, or
// pipelined with cp.async.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "emu/rht.hpp"
#include "gpu/amax_finish.cuh"
#include "gpu/cp_async.cuh"
#include "gpu/quantize_common.cuh"
#include "gpu/rht_device.cuh"

namespace fp4sim::gpu {
namespace {

// Plain amax over a contiguous array, 16-byte loads, kUnroll of them in flight a thread.
template <class T, int kUnroll>
__global__ void __launch_bounds__(kThreads) amax_flat_kernel(const T* x, int64_t n, AmaxArgs args) {
  pdl_allow_dependents();
  constexpr int kVec = 16 / sizeof(T);
  float m = 0.0f;
  const int64_t nvec = n / kVec;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  auto take = [&](const uint4& u) {
    const T* e = reinterpret_cast<const T*>(&u);
    FP4SIM_UNROLL
    for (int k = 0; k < kVec; ++k) m = fmax_nan_ignored(m, f32_abs(Elem<T>::to_f32(e[k])));
  };
  int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  for (; i + (kUnroll - 1) * step < nvec; i += kUnroll * step) {
    uint4 u[kUnroll];
    FP4SIM_UNROLL
    for (int j = 0; j < kUnroll; ++j)
      u[j] = __ldg(reinterpret_cast<const uint4*>(x) + i + j * step);
    FP4SIM_UNROLL
    for (int j = 0; j < kUnroll; ++j) take(u[j]);
  }
  for (; i < nvec; i += step) take(__ldg(reinterpret_cast<const uint4*>(x) + i));
  for (int64_t i = nvec * kVec + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += step)
    m = fmax_nan_ignored(m, f32_abs(Elem<T>::to_f32(x[i])));
  amax_finish<kThreads>(m, 0.0f, args);
}

// One 16-row chunk of a tile column through the RHT (the amax passes): the max |y| of its outputs
// into m_rht and, with `keep`, the 16 outputs to yt_col (the column's row k * 16 of the
// transposed tile, 16-byte aligned) as two 16-byte stores; without it only max |y|
// (rht16_abs_max_rounded_once: one rounding a chunk instead of 16). in_amax (optional): the inputs'
// NaN-ignoring max |x|, from the same bits.
__device__ __forceinline__ void rht_chunk_amax(const uint16_t (&in)[kRhtSize], float& m_rht,
                                               bool keep, uint16_t* yt_col,
                                               float* in_amax = nullptr) {
  if (keep) {
    uint32_t w[kRhtSize / 2];
    rht16_packed<DeviceFormats>(in, w, in_amax);
    m_rht = fmax_nan_ignored(m_rht, bf16x16_abs_max(w));
    uint4* dst = reinterpret_cast<uint4*>(yt_col);
    dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
    dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
  } else {
    m_rht = fmax_nan_ignored(m_rht, rht16_abs_max_rounded_once<DeviceFormats>(in, in_amax));
  }
}

// The kept transform of a kRows x kTileCols tile, transposed in shared memory (yt: column t's rows
// contiguous, kYtStride apart), out to rht_out (cols x rows, the written copy's order): kRows / 8
// threads write a column's kRows rows (one 128-byte line at 64 rows). Whole 8-row parts: rows % 16
// == 0 for an RHT copy; columns past `cols` are skipped.
template <int kRows, int kYtStride>
__device__ __forceinline__ void store_rht_transposed(const uint16_t* yt, uint16_t* rht_out,
                                                     int64_t rows, int64_t cols, int64_t r0,
                                                     int64_t c0) {
  constexpr int kParts = kRows / 8;
  FP4SIM_UNROLL
  for (int u = threadIdx.x; u < kTileCols * kParts; u += kThreads) {
    const int col = u / kParts, part = u % kParts;
    const int64_t cc = c0 + col, r = r0 + part * 8;
    if (cc < cols && r < rows)
      *reinterpret_cast<uint4*>(rht_out + cc * rows + r) =
          *reinterpret_cast<const uint4*>(yt + col * kYtStride + part * 8);
  }
}

// Tiled amax: the plain amax (any stride) and/or the amax of the RHT column-wise copy. The tile
// (kRows x kTileCols) is loaded as in the quantize pass; the RHT amax is taken over the transformed
// BF16 outputs. kRows = 64 (plain; the RHT pass before 2026-11-30) or 32 (the RHT pass, default:
// 18 KB of shared memory a CTA instead of 34, so 8 CTAs an SM instead of 6, at 58 registers; ncu
// had the 64-row RHT pass at 32% achieved occupancy and 45% issue-active in the training step,
// 5.32 ms a nvfp4 step, 4.87 ms on 32 rows).
template <class T, bool kRht, int kRows = kTileRows>
__global__ void __launch_bounds__(kThreads, kRows == 32 ? 8 : 6)
    amax_tile_kernel(const T* x, int64_t rows, int64_t cols, int64_t stride, bool vector_ok,
                     AmaxArgs args) {
  static_assert(kRows % kRhtSize == 0 && kRows % 8 == 0, "whole RHT chunks and 8-row output parts");
  // the tile holds the RHT's BF16 inputs (an FP32 input is rounded as it is stored): 16 KB at 64
  // rows, so the shared memory no longer limits the CTAs per SM (the FP32 tile did, at 6)
  __shared__ __align__(16) uint16_t tile[kRht ? kRows * kTileCols : 8];
  // rht(x) of the tile, transposed (column t's kRows rows contiguous; rows padded by 8 elements so
  // that the per-column 32-byte stores and the cooperative 16-byte reads are (nearly)
  // conflict-free)
  constexpr int kYtStride = kRows + 8;
  __shared__ __align__(16) uint16_t yt[kRht ? kTileCols * kYtStride : 8];
  pdl_allow_dependents();
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRows;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTileCols;
  const int t = threadIdx.x;
  // coalesced: consecutive threads read consecutive 16-byte vectors of a row (the plain amax does
  // not care which thread sees which value), stored at the same place in the tile
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kVecPerRow = kTileCols / kVec;
  float m_plain = 0.0f, m_rht = 0.0f;
  FP4SIM_UNROLL
  for (int k = 0; k < kRows * kVecPerRow / kThreads; ++k) {
    const int i = t + k * kThreads;
    const int tr = i / kVecPerRow, tc = (i % kVecPerRow) * kVec;
    const int64_t r = r0 + tr, c = c0 + tc;
    alignas(16) T raw[kVec];
    if (vector_ok && r < rows && c + kVec <= cols) {
      *reinterpret_cast<uint4*>(raw) = __ldg(reinterpret_cast<const uint4*>(x + r * stride + c));
    } else {
      FP4SIM_UNROLL
      for (int q = 0; q < kVec; ++q)
        raw[q] = (r < rows && c + q < cols) ? x[r * stride + c + q] : T(0);
    }
    FP4SIM_UNROLL
    for (int q = 0; q < kVec; ++q)
      m_plain = fmax_nan_ignored(m_plain, f32_abs(Elem<T>::to_f32(raw[q])));
    if constexpr (kRht) {
      uint16_t* dst = tile + tr * kTileCols + tc;
      if constexpr (sizeof(T) == 2) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(raw);
      } else {
        uint32_t lo = 0, hi = 0;
        lo = static_cast<uint32_t>(rht_input(raw[0])) | static_cast<uint32_t>(rht_input(raw[1]))
                                                            << 16;
        hi = static_cast<uint32_t>(rht_input(raw[2])) | static_cast<uint32_t>(rht_input(raw[3]))
                                                            << 16;
        *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
      }
    }
  }
  if constexpr (kRht) {
    __syncthreads();
    const int64_t c = c0 + t;
    if (c < cols) {
#pragma unroll 1
      for (int k = 0; k < kRows / kRhtSize; ++k) {
        if (r0 + (k + 1) * kRhtSize > rows) break;  // rows % 16 == 0 for an RHT copy
        uint16_t in[kRhtSize];
        FP4SIM_UNROLL
        for (int i = 0; i < kRhtSize; ++i) in[i] = tile[(k * kRhtSize + i) * kTileCols + t];
        rht_chunk_amax(in, m_rht, args.rht_out != nullptr, yt + t * kYtStride + k * kRhtSize);
      }
    }
    if (args.rht_out) {
      __syncthreads();
      store_rht_transposed<kRows, kYtStride>(yt, args.rht_out, rows, cols, r0, c0);
    }
  }
  amax_finish<kThreads>(m_plain, m_rht, args);
}

// The RHT amax pass, pipelined (the training step's shapes: cols % 128 == 0, rows % 32 == 0,
// 16-byte aligned rows): persistent CTAs walk 32 x 128 tiles, each tile's input copied to shared
// memory by cp.async while the CTA transforms the previous one (two buffers), so a CTA always has
// loads in flight. ncu on the training step had amax_tile_kernel's warps stalled on their loads
// for 41% of the cycles (L1TEX scoreboard), DRAM 33% busy, issue 51%: each CTA loaded, then only
// computed. Per tile the same work as amax_tile_kernel<T, true, 32>: the plain amax over the raw
// values, rht16 of each column's 16-row chunks over the BF16 inputs, the RHT amax over its BF16
// outputs, and the outputs kept transposed (rht_out) when asked. Same bits (max is order-free).
// 5 CTAs an SM for FP32 input (42 KB of shared memory a CTA), 8 for BF16 (26 KB, 64 registers).
constexpr int kPipeRows = 32;
template <class T>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 2 ? 8 : 5)
    amax_rht_pipelined_kernel(const T* x, int64_t rows, int64_t cols, int64_t stride,
                              AmaxArgs args) {
  pdl_allow_dependents();
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kVecPerRow = kTileCols / kVec;
  constexpr int kCopies = kPipeRows * kVecPerRow / kThreads;  // 16-byte copies a thread per tile
  constexpr int kYtStride = kPipeRows + 8;
  __shared__ __align__(16) T raw[2][kPipeRows * kTileCols];
  __shared__ __align__(16) uint16_t yt[kTileCols * kYtStride];
  const int t = threadIdx.x;
  const uint32_t tiles_x = static_cast<uint32_t>(cols / kTileCols);
  const uint32_t ntiles = tiles_x * static_cast<uint32_t>(rows / kPipeRows);
  // thread t copies the 16-byte vectors t, t + kThreads, ... of a tile (row-major): rows
  // t / kVecPerRow + k * kRowsPerCopy, the same columns in each
  constexpr int kRowsPerCopy = kThreads / kVecPerRow;
  const T* const xt = x + (t / kVecPerRow) * stride + (t % kVecPerRow) * kVec;
  const int64_t copy_step = kRowsPerCopy * stride;
  // a tile by its row tile and column tile
  auto issue = [&](uint32_t row_tile, uint32_t col_tile, int buf) {
    const T* g = xt + static_cast<int64_t>(row_tile) * kPipeRows * stride +
                 static_cast<int64_t>(col_tile) * kTileCols;
    T* sm = raw[buf] + t * kVec;
    FP4SIM_UNROLL
    for (int k = 0; k < kCopies; ++k) cp_async16(sm + k * kThreads * kVec, g + k * copy_step);
  };
  float m_plain = 0.0f, m_rht = 0.0f;
  // The CTA's sequence of tiles, s = 0, 1, ...: item blockIdx.x + (s / sub) grid, its row tile
  // sub (item / tiles_x) + s % sub. With column sums (args.col_partial) sub = 2, so a CTA takes the
  // two 32-row tiles of a 64-row chunk one after the other and thread t carries column t's sum
  // from the first into the second (rows % 64 == 0, checked by the host); else sub = 1, the tiles
  // in grid-stride order.
  const uint32_t sub = args.col_partial ? 2u : 1u;
  const uint32_t per_cta = ntiles / sub > blockIdx.x
                               ? (ntiles / sub - blockIdx.x + gridDim.x - 1) / gridDim.x * sub
                               : 0u;
  // The items walked without a division a step: (item / tiles_x, item % tiles_x) advance by the
  // grid's quotient and remainder (the divisions by a run-time tiles_x were ~60 instructions a
  // tile, ~15% of the pass, ncu 2026-12-01).
  const uint32_t step_q = gridDim.x / tiles_x, step_r = gridDim.x % tiles_x;
  uint32_t item_q = blockIdx.x / tiles_x, item_r = blockIdx.x % tiles_x;  // step s's item
  uint32_t next_q = item_q, next_r = item_r;                              // step s + 1's item
  auto advance = [&](uint32_t& q, uint32_t& r) {
    q += step_q;
    r += step_r;
    if (r >= tiles_x) {
      r -= tiles_x;
      ++q;
    }
  };
  if (sub == 1u) advance(next_q, next_r);
  float col_sum = 0.0f;
  if (per_cta > 0) issue(item_q * sub, item_r, 0);
  cp_async_commit();
#pragma unroll 1
  for (uint32_t s = 0; s < per_cta; ++s) {
    const int buf = static_cast<int>(s & 1u);
    const uint32_t row_tile = item_q * sub + s % sub, col_tile = item_r;
    // the next tile into the other buffer (free: the previous iteration ended with a barrier)
    if (s + 1 < per_cta) issue(next_q * sub + (s + 1) % sub, next_r, buf ^ 1);
    item_q = next_q;  // (step s + 1's item, and s + 2's below)
    item_r = next_r;
    if ((s + 2) % sub == 0) advance(next_q, next_r);
    cp_async_commit();
    cp_async_wait<1>();  // this thread's copies of the current tile have landed
    __syncthreads();     // and everyone's
    const T* tl = raw[buf];
    if (s % sub == 0) col_sum = 0.0f;
    // the column's chunks of this tile (keep: rht_chunk_amax with the outputs kept)
    auto chunk = [&](int k, bool keep) {
      uint16_t in[kRhtSize];
      FP4SIM_UNROLL
      for (int i = 0; i < kRhtSize; ++i) {
        const T v = tl[(k * kRhtSize + i) * kTileCols + t];
        // (BF16 input: the plain amax comes from the RHT's own max of the input bits)
        if constexpr (sizeof(T) == 4)
          m_plain = fmax_nan_ignored(m_plain, f32_abs(Elem<T>::to_f32(v)));
        in[i] = rht_input(v);
        if (sub == 2u)
          col_sum = __fadd_rn(col_sum, Elem<T>::to_f32(v));  // rows in increasing order, from +0
      }
      float chunk_plain = 0.0f;
      rht_chunk_amax(in, m_rht, keep, yt + t * kYtStride + k * kRhtSize,
                     sizeof(T) == 2 ? &chunk_plain : nullptr);
      if constexpr (sizeof(T) == 2) m_plain = fmax_nan_ignored(m_plain, chunk_plain);
    };
    if (args.rht_out) {
#pragma unroll 1
      for (int k = 0; k < kPipeRows / kRhtSize; ++k) chunk(k, true);
    } else {
      // (unrolled: rht16_abs_max_rounded_once's common path is straight-line code, so the two
      // chunks interleave)
      FP4SIM_UNROLL
      for (int k = 0; k < kPipeRows / kRhtSize; ++k) chunk(k, false);
    }
    if (sub == 2u && s % 2 == 1)
      args.col_partial[static_cast<int64_t>(row_tile / 2) * cols +
                       static_cast<int64_t>(col_tile) * kTileCols + t] = col_sum;
    if (args.rht_out) {
      __syncthreads();
      store_rht_transposed<kPipeRows, kYtStride>(yt, args.rht_out, rows, cols,
                                                 static_cast<int64_t>(row_tile) * kPipeRows,
                                                 static_cast<int64_t>(col_tile) * kTileCols);
    }
    __syncthreads();  // raw[buf] and yt are free for the next tile
  }
  amax_finish<kThreads>(m_plain, m_rht, args);
}

}  // namespace
}  // namespace fp4sim::gpu
