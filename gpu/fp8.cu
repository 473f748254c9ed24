// The FP8 block format on the GPU (DESIGN.md §9), twins of the emulator's FP8 paths in
// emu/cpu_backend.cpp and emu/gemm.cpp, built from the same host/device functions
// (fp8_block_encode_scale, fp8_quantize_element, fp8_decode_element, tfdpa_fp8_hopper), so the bits
// are the emulator's by construction. Quantization: one tiled pass for both copies; the exact GEMM:
// one thread per output (correctness first).
#include <cuda_runtime.h>

#include <atomic>
#include <stdexcept>
#include <string>

#include "emu/gemm.hpp"
#include "emu/mma.hpp"
#include "gpu/activation.cuh"
#include "gpu/amax_finish.cuh"
#include "gpu/cp_async.cuh"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/formats_device.cuh"

namespace fp4sim::gpu {
namespace {

// Both copies in one pass over a 128 x 128 input tile in shared memory (FP32, rows of 128 floats,
// unpadded: every shared-memory access below is either a warp's 512 contiguous bytes or 32
// consecutive words of one row, so none has a bank conflict), 512 threads = 16 warps:
//  1. load: warp w takes tile rows w, w + 16, ..., w + 112; lane l reads elements 4l..4l+3 of each
//     (coalesced 16-byte loads; an FP32 tile inside the tensor by cp.async, all 8 rows in flight,
//     else row pairs in flight through registers), stores them as one 16-byte word and
//     takes each row's block max by shuffles (the warp's 8 rows reduced together, 10 shuffles),
//     lane i keeping the warp's i-th row's, and its four columns' maxima over the warp's rows (the
//     warps' partial maxima meet in shared memory); the tile's NaN-ignoring max |x| goes to the
//     global amax of both copies (amax_commit: the backend's self-resetting workspace);
//  2. (the column maxima: thread t takes the sixteen partials of tile column t % 128);
//  3. row-wise copy: lanes 0..7 each turn one row's block max into its scale (the division and
//     the stored 1/enc once per row); then per row, enc from lane i by a shuffle, the lane's four
//     codes (two pair conversions) as one 4-byte store;
//  4. column-wise copy (input column c0 + tc is written as row c0 + tc, its elements r0.. at
//  columns
//     r0..): thread t quantizes a quarter column, tile rows 32 (t / 128) .. + 31 (a warp reads 32
//     consecutive words of a row at a time), and writes its 32 codes (one 32-byte sector) as two
//     16-byte stores; the thread of the first quarter writes the column's scale.
// Where a copy's scales_gemm is set, each scale is also written there, [k-block][written row].
// A 128x128 tile (2D) uses the tile's amax for every block of both copies. Codes and scales are
// the emulator's functions (fp8_block_encode_scale, fp8_block_decode_scale, fp8_quantize_quad),
// so the bits are the emulator's. Rows past R read as zeros and are not written (the row-wise
// 1x128 copy allows any R; the column-wise copy needs R % 128 == 0, which the host checks, as it
// checks the dimensions each copy blocks along).
constexpr int kFp8TileThreads = 512;
constexpr int kFp8Warps = kFp8TileThreads / 32;
constexpr int kFp8LinesPerWarp = kFp8Block / kFp8Warps;  // tile rows per warp
constexpr int kFp8ColParts =
    kFp8TileThreads / kFp8Block;  // threads per tile column (column-wise copy)
constexpr int kFp8PartRows =
    kFp8Block / kFp8ColParts;  // a column-wise thread's share of its column
constexpr size_t kFp8TileSmem = sizeof(float) * kFp8Block * kFp8Block;
static_assert(kFp8TileThreads % kFp8Block == 0 && kFp8PartRows % 16 == 0 && kFp8LinesPerWarp <= 32,
              "whole tile columns per thread group, 16-byte column stores, a scale per lane");
constexpr int kFp8ChunkParts =
    static_cast<int>(emu::kColumnChunkRows) / kFp8PartRows;  // parts per column-sum chunk
static_assert(kFp8ChunkParts >= 1 && kFp8ChunkParts * kFp8PartRows == emu::kColumnChunkRows &&
                  kFp8Block % emu::kColumnChunkRows == 0,
              "a tile's 64-row column-sum chunks are whole parts");

struct Fp8TileArgs {
  int64_t rows, cols, stride;
  bool two_d;
  bool vector_ok;          // rows aligned for 4-element loads (16 bytes FP32, 8 bytes BF16)
  bool col_vector_ok;      // column-wise codes 16-byte aligned (R % 128 == 0 makes every row so)
  QuantizedView row, col;  // codes null = copy disabled
  AmaxArgs amax;           // targets: the enabled copies' amax
  float* col_partial;      // x's 64-row column sums [R / 64, C] (fp8_quantize_launch), or null
  bool staged;  // whole tiles write the column-wise codes and row-wise GEMM scales through
                // shared memory (CudaOptions::fp8_quantize_staged)
};

// Four consecutive elements of row r from column c as FP32 (zeros outside the tensor): one 16-byte
// (FP32) or 8-byte (BF16) load where the caller says the rows are aligned for it.
template <class T>
__device__ __forceinline__ float4 fp8_load4(const T* x, const Fp8TileArgs& a, int64_t r,
                                            int64_t c) {
  if (a.vector_ok && r < a.rows && c + 4 <= a.cols) {
    if constexpr (sizeof(T) == 2) {
      const uint2 u = __ldg(reinterpret_cast<const uint2*>(x + r * a.stride + c));
      return make_float4(bf16_to_f32(static_cast<uint16_t>(u.x & 0xFFFFu)),
                         bf16_to_f32(static_cast<uint16_t>(u.x >> 16)),
                         bf16_to_f32(static_cast<uint16_t>(u.y & 0xFFFFu)),
                         bf16_to_f32(static_cast<uint16_t>(u.y >> 16)));
    } else {
      return __ldg(reinterpret_cast<const float4*>(x + r * a.stride + c));
    }
  }
  float v[4];
  for (int k = 0; k < 4; ++k) {
    float e = 0.0f;
    if (r < a.rows && c + k < a.cols) {
      if constexpr (sizeof(T) == 2)
        e = bf16_to_f32(x[r * a.stride + c + k]);
      else
        e = x[r * a.stride + c + k];
    }
    v[k] = e;
  }
  return make_float4(v[0], v[1], v[2], v[3]);
}

// Where the tile kernel's values come from. load4(a, r, c): four consecutive elements of row r from
// column c as FP32, zeros outside the tensor (the register path: edge and unaligned tiles, and
// sources without kAsync). kAsync: aligned whole tiles copy `x` (FP32) straight to shared memory
// by cp.async; then, where kTransform, each thread rewrites its own four values v as
// transform(v, aux), aux being what prefetch(aux, a, r, c) loaded for row r (issued while the
// cp.async copies are in flight). kPairs: row pairs whose loads the register path issues before any
// is used; kMinBlocks: the kernel's CTAs per SM (launch bounds).
// (3 CTAs per SM holds the FP32 kernel to 40 registers, its smem-limited maximum; the BF16 one,
// which loads through registers, would spill there, so it gets 2)
struct Fp8NoAux {};

// v (four values of row r from column c) with the elements outside the tensor set to +0, as the
// memory source's padding reads: for a source that computes its values on the register path.
__device__ __forceinline__ float4 fp8_zero_outside(const float4& v, const Fp8TileArgs& a, int64_t r,
                                                   int64_t c) {
  const bool in_row = r < a.rows;
  return make_float4(in_row && c < a.cols ? v.x : 0.0f, in_row && c + 1 < a.cols ? v.y : 0.0f,
                     in_row && c + 2 < a.cols ? v.z : 0.0f, in_row && c + 3 < a.cols ? v.w : 0.0f);
}

template <class T>
struct Fp8MemorySource {
  static constexpr bool kAsync = sizeof(T) == 4;
  static constexpr bool kTransform = false;
  static constexpr int kPairs = sizeof(T) == 4 ? 1 : 2;
  static constexpr int kMinBlocks = sizeof(T) == 4 ? 3 : 2;
  using Aux = Fp8NoAux;
  const T* x;
  __device__ __forceinline__ float4 load4(const Fp8TileArgs& a, int64_t r, int64_t c) const {
    return fp8_load4(x, a, r, c);
  }
  __device__ __forceinline__ void prefetch(Aux&, const Fp8TileArgs&, int64_t, int64_t) const {}
  __device__ __forceinline__ float4 transform(const float4& v, const Aux&) const { return v; }
};

// An activation op computed on the way in (Backend::quantize_activation): the tile holds the op's
// stored output, the bits gelu_forward_kernel / gelu_backward_kernel write (gpu/activation.cuh),
// never stored to memory. Inputs dense F32 (a.stride == a.cols; a.vector_ok covers every pointer).
// The pre-activation x takes the cp.async path; the backward pass's incoming gradient is
// prefetched into registers for the warp's 8 rows at once.
struct Fp8GeluForwardSource {
  static constexpr bool kAsync = true;
  static constexpr bool kTransform = true;
  static constexpr int kPairs = 1;
  static constexpr int kMinBlocks = 3;
  using Aux = Fp8NoAux;
  const float* x;
  bool round_bf16;
  __device__ __forceinline__ float4 transform(const float4& v, const Aux&) const {
    return make_float4(gelu_forward_stored(v.x, round_bf16), gelu_forward_stored(v.y, round_bf16),
                       gelu_forward_stored(v.z, round_bf16), gelu_forward_stored(v.w, round_bf16));
  }
  __device__ __forceinline__ void prefetch(Aux&, const Fp8TileArgs&, int64_t, int64_t) const {}
  __device__ __forceinline__ float4 load4(const Fp8TileArgs& a, int64_t r, int64_t c) const {
    return fp8_zero_outside(transform(fp8_load4(x, a, r, c), Aux{}), a, r, c);
  }
};

struct Fp8GeluBackwardSource {
  static constexpr bool kAsync = true;
  static constexpr bool kTransform = true;
  static constexpr int kPairs = 1;
  static constexpr int kMinBlocks = 2;
  using Aux = float4;  // the incoming gradient's four values
  const float* x;
  const float* dout;
  bool round_bf16, bf16_dout;
  __device__ __forceinline__ float4 transform(const float4& v, const Aux& d) const {
    return make_float4(gelu_backward_stored(v.x, d.x, round_bf16, bf16_dout),
                       gelu_backward_stored(v.y, d.y, round_bf16, bf16_dout),
                       gelu_backward_stored(v.z, d.z, round_bf16, bf16_dout),
                       gelu_backward_stored(v.w, d.w, round_bf16, bf16_dout));
  }
  __device__ __forceinline__ void prefetch(Aux& d, const Fp8TileArgs& a, int64_t r,
                                           int64_t c) const {
    d = __ldg(reinterpret_cast<const float4*>(dout + r * a.stride + c));
  }
  __device__ __forceinline__ float4 load4(const Fp8TileArgs& a, int64_t r, int64_t c) const {
    return fp8_zero_outside(transform(fp8_load4(x, a, r, c), fp8_load4(dout, a, r, c)), a, r, c);
  }
};

template <class Src>
__global__ void __launch_bounds__(kFp8TileThreads, Src::kMinBlocks)
    fp8_quantize_tile_kernel(Src src, Fp8TileArgs a) {
  static_assert(Src::kAsync || !Src::kTransform,
                "a transforming source needs kAsync: the rewrite is on the cp.async path");
  extern __shared__ float4 tile4[];  // [128][32] float4 = [128][128] floats
  const float* tile = reinterpret_cast<const float*>(tile4);
  __shared__ float warp_partial[kFp8Warps];
  __shared__ float4
      col_partial[kFp8Warps * kFp8Block / 4];   // [warp][128]: column maxima over a warp's rows
  __shared__ float row_scale_stage[kFp8Block];  // (staged) the row-wise scales, tile row order
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kFp8Block,
                c0 = static_cast<int64_t>(blockIdx.x) * kFp8Block;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned full = 0xFFFFFFFFu;
  // 1. load, tile, block maxima of the rows (lane i: the warp's i-th row, tile row warp + 16 i).
  // An FP32 tile wholly inside an aligned tensor goes straight to shared memory (cp.async: the
  // warp's 8 rows, 4 KB, in flight at once and no registers held), then is read back; otherwise
  // through registers, row pairs' loads issued before any is used.
  float row_max = 0.0f;
  float4 col_max =
      make_float4(0.0f, 0.0f, 0.0f, 0.0f);  // columns 4 lane .. 4 lane + 3 over the warp's rows
  // the warp's i-th row, lane's four values v: into the column maxima; returns the
  // lane's share of the row's block max (from +0, as the emulator's: an all-NaN block has max +0)
  // (fabsf, not the shared f32_abs: the compiler folds it into the max instructions as an operand
  // modifier instead of a separate AND per element; for the NaN-ignoring max the two are the same)
  auto take_row = [&](const float4& v) {
    const float4 av = make_float4(fabsf(v.x), fabsf(v.y), fabsf(v.z), fabsf(v.w));
    col_max = make_float4(fmax_nan_ignored(col_max.x, av.x), fmax_nan_ignored(col_max.y, av.y),
                          fmax_nan_ignored(col_max.z, av.z), fmax_nan_ignored(col_max.w, av.w));
    return fmax_nan_ignored(
        0.0f, fmax_nan_ignored(fmax_nan_ignored(av.x, av.y), fmax_nan_ignored(av.z, av.w)));
  };
  // the row maxima of rows k and k + 4 meet half-reduced: lanes 0-15 keep row k's (adding lane
  // l + 16's), lanes 16-31 row k + 4's (rows_reduce below finishes); one shuffle for two rows
  float half_max[kFp8LinesPerWarp / 2];
  static_assert(kFp8LinesPerWarp == 8, "rows_reduce below is written for 8 rows a warp");
  auto pair_rows = [&](int k, float lo, float hi) {
    if (a.two_d) return;  // (no row maxima: one scale per tile)
    const bool upper = (lane & 16) != 0;
    half_max[k] = fmax_nan_ignored(upper ? hi : lo, __shfl_xor_sync(full, upper ? lo : hi, 16));
  };
  bool async_tile = false;
  if constexpr (Src::kAsync)
    async_tile =
        a.vector_ok && r0 + kFp8Block <= a.rows && c0 + kFp8Block <= a.cols;  // (CTA-uniform)
  if (async_tile) {
    if constexpr (Src::kAsync) {
      FP4SIM_UNROLL
      for (int i = 0; i < kFp8LinesPerWarp; ++i) {
        const int tr = warp + kFp8Warps * i;
        cp_async16(tile4 + tr * (kFp8Block / 4) + lane,
                   src.x + (r0 + tr) * a.stride + c0 + 4 * lane);
      }
      cp_async_commit();
      typename Src::Aux aux[kFp8LinesPerWarp];
      FP4SIM_UNROLL
      for (int i = 0; i < kFp8LinesPerWarp; ++i)
        src.prefetch(aux[i], a, r0 + warp + kFp8Warps * i, c0 + 4 * lane);
      cp_async_wait<0>();
      // (each thread reads back, and rewrites, only the 16 bytes it copied: no barrier)
      FP4SIM_UNROLL
      for (int k = 0; k < kFp8LinesPerWarp / 2; ++k) {
        float4* const plo = tile4 + (warp + kFp8Warps * k) * (kFp8Block / 4) + lane;
        float4* const phi = tile4 + (warp + kFp8Warps * (k + 4)) * (kFp8Block / 4) + lane;
        float4 vlo = *plo, vhi = *phi;
        if constexpr (Src::kTransform) {
          vlo = src.transform(vlo, aux[k]);
          vhi = src.transform(vhi, aux[k + 4]);
          *plo = vlo;
          *phi = vhi;
        }
        pair_rows(k, take_row(vlo), take_row(vhi));
      }
    }
  } else {
    // rows whose loads are issued before any is used (memory parallelism): row pairs (k, k + 4),
    // two pairs at a time for BF16, one for FP32 (which comes here only for edge or unaligned
    // tiles, and would spill at its 40 registers with four rows in flight)
    constexpr int kPairs = Src::kPairs;
    FP4SIM_UNROLL
    for (int g = 0; g < kFp8LinesPerWarp / 2 / kPairs; ++g) {
      float4 v[2 * kPairs];
      FP4SIM_UNROLL
      for (int u = 0; u < 2 * kPairs; ++u) {
        const int i =
            kPairs * g + (u >> 1) + 4 * (u & 1);  // rows k, k + 4 for k = kPairs g + u / 2
        v[u] = src.load4(a, r0 + warp + kFp8Warps * i, c0 + 4 * lane);
      }
      FP4SIM_UNROLL
      for (int u = 0; u < 2 * kPairs; ++u) {
        const int i = kPairs * g + (u >> 1) + 4 * (u & 1);
        tile4[(warp + kFp8Warps * i) * (kFp8Block / 4) + lane] = v[u];
      }
      FP4SIM_UNROLL
      for (int p = 0; p < kPairs; ++p) {
        const float lo = take_row(v[2 * p]);
        const float hi = take_row(v[2 * p + 1]);
        pair_rows(kPairs * g + p, lo, hi);
      }
    }
  }
  // rows_reduce: after pair_rows lane l holds row k + 4 b4 (b = the bits of l) for k = 0..3; two
  // more exchange steps leave it row b2 + 2 b3 + 4 b4, two butterflies complete the sums over all
  // 32 lanes, and lane i takes row i's max from a lane that holds it: 10 shuffles for the warp's 8
  // row maxima instead of 8 x 5 (max is order-free: the same value)
  if (!a.two_d) {
    const bool b3 = (lane & 8) != 0, b2 = (lane & 4) != 0;
    const float q0 = fmax_nan_ignored(b3 ? half_max[2] : half_max[0],
                                      __shfl_xor_sync(full, b3 ? half_max[0] : half_max[2], 8));
    const float q1 = fmax_nan_ignored(b3 ? half_max[3] : half_max[1],
                                      __shfl_xor_sync(full, b3 ? half_max[1] : half_max[3], 8));
    float m = fmax_nan_ignored(b2 ? q1 : q0, __shfl_xor_sync(full, b2 ? q0 : q1, 4));
    m = fmax_nan_ignored(m, __shfl_xor_sync(full, m, 2));
    m = fmax_nan_ignored(m, __shfl_xor_sync(full, m, 1));
    const int src = ((lane & 1) << 2) | (((lane >> 1) & 1) << 3) |
                    (((lane >> 2) & 1) << 4);  // holds row lane % 8
    m = __shfl_sync(full, m, src);
    if (lane < kFp8LinesPerWarp) row_max = m;
  }
  col_partial[warp * (kFp8Block / 4) + lane] = col_max;
  const float m = warp_max(fmax_nan_ignored(fmax_nan_ignored(col_max.x, col_max.y),
                                            fmax_nan_ignored(col_max.z, col_max.w)));
  if (lane == 0) warp_partial[warp] = m;
  __syncthreads();
  float tile_amax = 0.0f;
  for (int w = 0; w < kFp8Warps; ++w) tile_amax = fmax_nan_ignored(tile_amax, warp_partial[w]);
  if (threadIdx.x == 0) amax_commit(tile_amax, 0.0f, a.amax);
  const float enc_tile = a.two_d ? fp8_block_encode_scale(tile_amax) : 0.0f;
  const int tc = threadIdx.x % kFp8Block, part = threadIdx.x / kFp8Block;
  const float* my_col = tile + part * kFp8PartRows * kFp8Block + tc;
  // Whole tiles with both copies (every tile of a training tensor; CTA-uniform) may stage what
  // would otherwise be partial-sector stores in shared memory and write it out in whole lines: the
  // column-wise codes (a thread's 32 codes are one sector, written as two halves, each in a
  // different line from its neighbours') and the row-wise scales' GEMM layout (one 4-byte store a
  // sector otherwise).
  const bool staged = a.staged && r0 + kFp8Block <= a.rows && c0 + kFp8Block <= a.cols &&
                      a.row.codes && a.col.codes && a.col_vector_ok;

  // 3. row-wise copy: rows r0.. of the input, written at (r, c0 + 4 lane ..)
  if (a.row.codes) {
    float* scales = reinterpret_cast<float*>(a.row.scales);
    const int64_t kb = a.cols / kFp8Block;
    const float enc_mine = a.two_d ? enc_tile : fp8_block_encode_scale(row_max);
    const int64_t r_mine = r0 + warp + kFp8Warps * lane;
    if (lane < kFp8LinesPerWarp && r_mine < a.rows) {
      const float s = fp8_block_decode_scale(enc_mine);
      scales[r_mine * kb + c0 / kFp8Block] = s;
      if (staged)
        row_scale_stage[warp + kFp8Warps * lane] = s;
      else if (a.row.scales_gemm)
        a.row.scales_gemm[(c0 / kFp8Block) * a.rows + r_mine] = s;
    }
    if (r0 + kFp8Block <= a.rows && c0 + kFp8Block <= a.cols) {
      // a whole tile (CTA-uniform; every tile of a training tensor): no per-row bounds, one base
      // pointer and a fixed step between the warp's rows (a.cols % 128 == 0: 4-byte aligned words)
      uint32_t* dst = reinterpret_cast<uint32_t*>(a.row.codes + (r0 + warp) * a.cols + c0) + lane;
      const int64_t step = kFp8Warps * (a.cols / 4);
      FP4SIM_UNROLL
      for (int i = 0; i < kFp8LinesPerWarp; ++i) {
        const float enc = __shfl_sync(full, enc_mine, i);
        const float4 t = tile4[(warp + kFp8Warps * i) * (kFp8Block / 4) + lane];
        dst[i * step] = fp8_quantize_quad<DeviceFormats>(t.x, t.y, t.z, t.w, enc);
      }
    } else {
      FP4SIM_UNROLL
      for (int i = 0; i < kFp8LinesPerWarp; ++i) {
        const int tr = warp + kFp8Warps * i;
        const int64_t r = r0 + tr, c = c0 + 4 * lane;
        if (r >= a.rows) break;  // (warp-uniform)
        const float enc = __shfl_sync(full, enc_mine, i);
        const float4 t = tile4[tr * (kFp8Block / 4) + lane];
        const uint32_t packed = fp8_quantize_quad<DeviceFormats>(t.x, t.y, t.z, t.w, enc);
        uint8_t* dst = a.row.codes + r * a.cols + c;
        if (c + 4 <= a.cols) {
          *reinterpret_cast<uint32_t*>(dst) = packed;  // a.cols % 128 == 0 for a row-wise copy
        } else {
          for (int k = 0; k < 4 && c + k < a.cols; ++k)
            dst[k] = static_cast<uint8_t>(packed >> (8 * k));
        }
      }
    }
  }
  // 4. column-wise copy: this thread's part of tile column tc, its codes as 16-byte stores
  if (a.col.codes) {
    const int64_t cc = c0 + tc;
    if (cc >= a.cols) return;  // past the last column the tile holds zeros
    float cm = 0.0f;
    if (!a.two_d) {
      const float* part = reinterpret_cast<const float*>(col_partial) + tc;
      FP4SIM_UNROLL
      for (int w = 0; w < kFp8Warps; ++w) cm = fmax_nan_ignored(cm, part[w * kFp8Block]);
    }
    const float enc = a.two_d ? enc_tile : fp8_block_encode_scale(cm);
    if (part == 0) {
      const float s = fp8_block_decode_scale(enc);
      reinterpret_cast<float*>(a.col.scales)[cc * (a.rows / kFp8Block) + r0 / kFp8Block] = s;
      if (a.col.scales_gemm) a.col.scales_gemm[(r0 / kFp8Block) * a.cols + cc] = s;
    }
    // the first part of each 64-row chunk also sums the chunk's rows of this column, from +0 in
    // increasing row order (emu::bias_backward's partial sums, for column_sums_finalize)
    if (a.col_partial && part % kFp8ChunkParts == 0) {
      float s = 0.0f;
      for (int r = 0; r < emu::kColumnChunkRows; ++r) s = __fadd_rn(s, my_col[r * kFp8Block]);
      a.col_partial[((r0 + part * kFp8PartRows) / emu::kColumnChunkRows) * a.cols + cc] = s;
    }
    if (staged) {
      // the thread's 32 codes, then (every thread done reading the tile) into the tile's first 16
      // KB as [written row][eight 16-byte chunks], chunk j of row i at j ^ (i % 8) (no bank
      // conflicts either way), then out as whole lines: a warp writes four rows' 128 bytes at a
      // time
      uint32_t w[kFp8PartRows / 4];
      FP4SIM_UNROLL
      for (int k = 0; k < kFp8PartRows / 4; ++k) {
        const float* e = my_col + 4 * k * kFp8Block;
        w[k] = fp8_quantize_quad<DeviceFormats>(e[0], e[kFp8Block], e[2 * kFp8Block],
                                                e[3 * kFp8Block], enc);
      }
      constexpr int kChunks = kFp8Block / 16, kPartChunks = kFp8PartRows / 16;
      static_assert(kChunks == 8 && kFp8TileThreads % kChunks == 0,
                    "eight 16-byte chunks a written row");
      uint4* const stage = reinterpret_cast<uint4*>(tile4);
      __syncthreads();
      FP4SIM_UNROLL
      for (int q = 0; q < kPartChunks; ++q)
        stage[tc * kChunks + ((part * kPartChunks + q) ^ (tc % kChunks))] =
            make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
      if (a.row.scales_gemm && threadIdx.x < kFp8Block)
        a.row.scales_gemm[(c0 / kFp8Block) * a.rows + r0 + threadIdx.x] =
            row_scale_stage[threadIdx.x];
      __syncthreads();
      constexpr int kRowsPerPass = kFp8TileThreads / kChunks;
      FP4SIM_UNROLL
      for (int p = 0; p < kFp8Block / kRowsPerPass; ++p) {
        const int i = p * kRowsPerPass + static_cast<int>(threadIdx.x) / kChunks,
                  j = threadIdx.x % kChunks;
        reinterpret_cast<uint4*>(a.col.codes + (c0 + i) * a.rows + r0)[j] =
            stage[i * kChunks + (j ^ (i % kChunks))];
      }
      return;
    }
    uint8_t* dst = a.col.codes + cc * a.rows + r0 + part * kFp8PartRows;
    FP4SIM_UNROLL
    for (int q = 0; q < kFp8PartRows / 16; ++q) {
      uint32_t w[4];
      FP4SIM_UNROLL
      for (int k = 0; k < 4; ++k) {
        const float* e = my_col + (16 * q + 4 * k) * kFp8Block;
        w[k] = fp8_quantize_quad<DeviceFormats>(e[0], e[kFp8Block], e[2 * kFp8Block],
                                                e[3 * kFp8Block], enc);
      }
      if (a.col_vector_ok) {
        reinterpret_cast<uint4*>(dst)[q] = make_uint4(w[0], w[1], w[2], w[3]);
      } else {
        for (int k = 0; k < 16; ++k)
          dst[16 * q + k] = static_cast<uint8_t>(w[k / 4] >> (8 * (k % 4)));
      }
    }
  }
}

__global__ void fp8_dequantize_kernel(QuantizedView q, float* out, int64_t out_stride) {
  const float* scales = reinterpret_cast<const float*>(q.scales);
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < q.rows * q.cols;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / q.cols, c = e % q.cols;
    out[r * out_stride + c] =
        fp8_decode_element(q.codes[e], scales[r * (q.cols / kFp8Block) + c / kFp8Block]);
  }
}

// One thread per output: per 128-block four chained Hopper FP8 T-FDPAs from +0, then
// acc = fmaf(s_a * s_b, partial, acc); split-K ranges added in order; the emulator's epilogue.
__global__ void fp8_gemm_exact_kernel(QuantizedView a, QuantizedView b, const float* c,
                                      GemmConfig cfg, void* out) {
  const int64_t N = b.rows, K = a.cols, kb = K / kFp8Block;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.rows * N) return;
  const int64_t m = idx / N, n = idx % N;
  const float* sa = reinterpret_cast<const float*>(a.scales) + m * kb;
  const float* sb = reinterpret_cast<const float*>(b.scales) + n * kb;
  const float total = split_k_chain(cfg.split_k, kb, [&](int64_t blk, float acc) {
    float partial = 0.0f;
    for (int64_t k0 = blk * kFp8Block; k0 < (blk + 1) * kFp8Block; k0 += kFp8FdpaL) {
      float va[kFp8FdpaL], vb[kFp8FdpaL];
      for (int k = 0; k < kFp8FdpaL; ++k) {
        va[k] = e4m3_to_f32(a.codes[m * K + k0 + k]);
        vb[k] = e4m3_to_f32(b.codes[n * K + k0 + k]);
      }
      partial = tfdpa_fp8_hopper(va, vb, partial, kE4M3Operand, kE4M3Operand);
    }
    return __fmaf_rn(fmul_rn(sa[blk], sb[blk]), partial, acc);
  });
  gemm_store<DeviceFormats>(cfg, cfg.alpha, total, c, idx, out);
}

// One launch of the tile kernel for source Src, its dynamic shared memory allowed first
// (allow_dynamic_smem: once per instantiation and device).
template <class Src>
void launch_fp8_tile(const dim3& grid, const Src& src, Fp8TileArgs a, cudaStream_t stream) {
  allow_dynamic_smem(reinterpret_cast<const void*>(fp8_quantize_tile_kernel<Src>), kFp8TileSmem);
  fp8_quantize_tile_kernel<Src><<<grid, kFp8TileThreads, kFp8TileSmem, stream>>>(src, a);
}

// The tile kernel's arguments for a rows x cols input with the given row stride (elements) and
// alignment, and the enabled copies (cfg); x's name for the error messages.
Fp8TileArgs fp8_tile_args(int64_t rows, int64_t cols, int64_t stride, bool vector_ok,
                          const QuantizeConfig& cfg, QuantizedView* rowwise,
                          QuantizedView* columnwise, unsigned* amax_ws, float* column_partial) {
  Fp8TileArgs a{};
  a.rows = rows;
  a.cols = cols;
  a.stride = stride;
  a.two_d = cfg.block_2d;
  a.vector_ok = vector_ok;
  if (cfg.rowwise.enabled) a.row = *rowwise;
  if (cfg.columnwise.enabled) a.col = *columnwise;
  a.col_vector_ok =
      cfg.columnwise.enabled && reinterpret_cast<uintptr_t>(columnwise->codes) % 16 == 0;
  a.col_partial = column_partial;
  if (!cfg.rowwise.enabled) a.row.codes = nullptr;
  if (!cfg.columnwise.enabled) a.col.codes = nullptr;
  // the copies' amax is the input's (no transform): reduced once, written to both
  a.amax = AmaxArgs{cfg.rowwise.enabled ? rowwise->amax : columnwise->amax,
                    cfg.rowwise.enabled && cfg.columnwise.enabled ? columnwise->amax : nullptr,
                    nullptr, nullptr, amax_ws};
  return a;
}

dim3 fp8_tile_grid(int64_t rows, int64_t cols, const char* name) {
  const int64_t gy = (rows + kFp8Block - 1) / kFp8Block, gx = (cols + kFp8Block - 1) / kFp8Block;
  if (gy > 65535)
    throw std::invalid_argument("quantize (cuda, fp8): tensor '" + std::string(name) + "' " +
                                shape_str(rows, cols) + " has too many rows for one launch");
  return dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
}

}  // namespace

void fp8_quantize_launch(const TensorView& x, const QuantizeConfig& cfg, QuantizedView* rowwise,
                         QuantizedView* columnwise, cudaStream_t stream, unsigned* amax_ws,
                         float* column_partial, bool staged) {
  if (!amax_ws) throw std::logic_error("fp8_quantize_launch: no amax workspace");
  // (whole 128-row tiles, which a column-wise copy needs anyway: a 64-row remainder would sum
  // the tile's zero padding into a chunk past the buffer)
  if (column_partial &&
      (!cfg.columnwise.enabled || x.dtype != DType::F32 || x.rows % kFp8Block != 0))
    throw std::logic_error(
        "fp8_quantize_launch: column sums need a column-wise copy of a float32 input "
        "with whole 128-row tiles");
  const int64_t vec_bytes = 4 * (x.dtype == DType::F32 ? 4 : 2);
  const bool vector_ok = reinterpret_cast<uintptr_t>(x.data) % vec_bytes == 0 &&
                         (x.stride() * (x.dtype == DType::F32 ? 4 : 2)) % vec_bytes == 0;
  Fp8TileArgs a = fp8_tile_args(x.rows, x.cols, x.stride(), vector_ok, cfg, rowwise, columnwise,
                                amax_ws, column_partial);
  a.staged = staged;
  const dim3 grid = fp8_tile_grid(x.rows, x.cols, x.name);
  if (x.dtype == DType::F32)
    launch_fp8_tile(grid, Fp8MemorySource<float>{static_cast<const float*>(x.data)}, a, stream);
  else
    launch_fp8_tile(grid, Fp8MemorySource<uint16_t>{static_cast<const uint16_t*>(x.data)}, a,
                    stream);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void fp8_quantize_activation_launch(const ActivationArgs& src, const QuantizeConfig& cfg,
                                    QuantizedView* rowwise, QuantizedView* columnwise,
                                    cudaStream_t stream, unsigned* amax_ws, float* column_partial,
                                    bool staged) {
  if (!amax_ws) throw std::logic_error("fp8_quantize_activation_launch: no amax workspace");
  if (column_partial && (!cfg.columnwise.enabled || src.rows % kFp8Block != 0))
    throw std::logic_error(
        "fp8_quantize_activation_launch: column sums need a column-wise copy with whole 128-row "
        "tiles");
  const bool backward = src.op == ActivationOp::GeluBackward;
  if (!src.inp || (backward && !src.dout))
    throw std::invalid_argument(std::string("quantize_activation (cuda, fp8): '") + src.name +
                                "' has no input");
  const bool vector_ok = reinterpret_cast<uintptr_t>(src.inp) % 16 == 0 &&
                         (!backward || reinterpret_cast<uintptr_t>(src.dout) % 16 == 0) &&
                         src.cols % 4 == 0;
  Fp8TileArgs a = fp8_tile_args(src.rows, src.cols, src.cols, vector_ok, cfg, rowwise, columnwise,
                                amax_ws, column_partial);
  a.staged = staged;
  const dim3 grid = fp8_tile_grid(src.rows, src.cols, src.name);
  if (backward)
    launch_fp8_tile(grid, Fp8GeluBackwardSource{src.inp, src.dout, src.round_bf16, src.bf16_dout},
                    a, stream);
  else
    launch_fp8_tile(grid, Fp8GeluForwardSource{src.inp, src.round_bf16}, a, stream);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void fp8_dequantize_launch(const QuantizedView& q, const TensorView& out, cudaStream_t stream) {
  fp8_dequantize_kernel<<<grid_stride_blocks(q.rows * q.cols, 256), 256, 0, stream>>>(
      q, static_cast<float*>(out.data), out.stride());
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void fp8_gemm_exact_launch(const QuantizedView& a, const QuantizedView& b, const float* c,
                           const GemmConfig& cfg, void* out, cudaStream_t stream) {
  const int64_t n = a.rows * b.rows;
  fp8_gemm_exact_kernel<<<static_cast<unsigned>((n + 127) / 128), 128, 0, stream>>>(a, b, c, cfg,
                                                                                    out);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

}  // namespace fp4sim::gpu
