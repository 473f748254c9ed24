// The quantizer's second pass in the recipe's common case (gpu/quantize.cu): NVFP4 1x16 without 2D
// scales or Four Over Six, RN or SR, RHT optional; the tile kernel, and the streaming kernel of the
// RHT copies whose transform the first pass kept.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "emu/rht.hpp"
#include "gpu/quantize_common.cuh"

namespace fp4sim::gpu {
namespace {

// ---- The recipe's common case: NVFP4 1x16 (no 2D, no Four Over Six), RN or SR, RHT optional ----
//
// A CTA owns a 64-row tile, 128 columns wide (tile variant 2: 256 for BF16 input, a column pair a
// thread). Each thread loads whole 1x16 row blocks into the shared tile (16-byte loads); after one
// barrier it quantizes those blocks for the row-wise copy, then walks its column(s) for the
// column-wise copy, whose 32 code bytes and 4 scale bytes per column are contiguous in the
// transposed output (whole tiles stage the codes in shared memory and store whole sectors).
template <class T, int kPer>
struct FastTile {
  static constexpr int kColsPerThread = kPer;
  static constexpr int kCols = kThreads * kColsPerThread;
  static constexpr int kRowUnits = kTileRows * (kCols / kNvfp4Block) / kThreads;  // per thread
  // (8 CTAs an SM for the 64x128 tile: 64 registers. 8192^2 BF16 row + column RN, H200,
  // bench_quantize medians of 3, after the packed E2M1 encode: 134 / 131 / 128 / 128 / 132 us at
  // 6 / 7 / 8 / 10 / 12 CTAs an SM, row RN alone 89.3 / 87.0 / 85.5 / 88.1 / 91.8 us. Before that
  // encode, 10 had measured slower than 6: 213 against 204 us.)
  // (FP32 tiles, 32 KiB: shared memory holds 6 CTAs an SM, so they keep 6 and 80 registers.)
  static constexpr int kMinBlocks = kPer == 2 ? 4 : sizeof(T) == 2 ? 8 : 6;
};
// (The RHT-in-tile variant at 7 and 6 CTAs an SM, 72 and 80 registers: 173 and 175 us against 172
// at 8 for 8192^2 BF16 row RN + column RHT + SR, H200, 2026-12-01.)

// v = the 16 values of tile column tcol's k-th block (rows 16 k ..), RHT-transformed where asked
// and returns their amax (amax_strided's value)
template <class T, bool kColRht, int kCols>
__device__ __forceinline__ float tile_column_block(const T* tile, int tcol, int k, float* v) {
  const T* col = tile + (k * kNvfp4Block) * kCols + tcol;
  if constexpr (kColRht) {
    uint16_t in[kRhtSize];
    uint32_t w[kRhtSize / 2];
    FP4SIM_UNROLL
    for (int i = 0; i < kRhtSize; ++i) in[i] = rht_input(col[i * kCols]);
    rht16_packed<DeviceFormats>(in, w);
    return bf16x16_unpack(w, v);
  } else {
    FP4SIM_UNROLL
    for (int i = 0; i < kNvfp4Block; ++i) v[i] = Elem<T>::to_f32(col[i * kCols]);
    return amax16(v);
  }
}

// A whole tile's row-wise copy (CTA-uniform: the tile lies inside the tensor), the rounding and the
// decoded operand fixed at compile time: thread t's blocks are column block tb of rows tr0 +
// kRowStep k, and each output moves by a fixed stride from one to the next (no per-block bounds
// tests, 64-bit index products or rounding branches: those were ~3 instructions an element).
template <class T, int kPer, bool kSr, bool kDec>
__device__ __forceinline__ void tile_rows_whole(const T* tile, int64_t r0, int64_t c0,
                                                const QuantArgs& a, const Nvfp4Global& g) {
  using Tile = FastTile<T, kPer>;
  constexpr int kCols = Tile::kCols;
  constexpr int kBlocksPerTileRow = kCols / kNvfp4Block;
  constexpr int kRowStep = kThreads / kBlocksPerTileRow;
  constexpr int kVec = 16 / sizeof(T);
  const int t = threadIdx.x;
  const int tr0 = static_cast<int>(static_cast<unsigned>(t) / kBlocksPerTileRow);
  const int tb = static_cast<int>(static_cast<unsigned>(t) % kBlocksPerTileRow);
  const int64_t C = a.cols;
  const int64_t e0 = (r0 + tr0) * C + c0 + tb * kNvfp4Block;  // the first block's first element
  const int64_t e_step = kRowStep * C;
  uint2* codes = reinterpret_cast<uint2*>(a.row.codes) + e0 / kNvfp4Block;
  uint8_t* scales = a.row.scales + e0 / kNvfp4Block;
  const T* src = tile + tr0 * kCols + tb * kNvfp4Block;
  static_assert(kSrChunk == kNvfp4Block, "one Philox chunk a block");
  const uint64_t chunk0 = static_cast<uint64_t>(e0) / kSrChunk,
                 chunk_step = static_cast<uint64_t>(e_step) / kSrChunk;
#pragma unroll 1
  for (int k = 0; k < Tile::kRowUnits; ++k) {
    alignas(16) T raw[kNvfp4Block];
    FP4SIM_UNROLL
    for (int q = 0; q < kNvfp4Block / kVec; ++q)
      reinterpret_cast<uint4*>(raw)[q] =
          reinterpret_cast<const uint4*>(src + k * kRowStep * kCols)[q];
    float v[kNvfp4Block];
    const float amax_b = block16_values(raw, v);
    const int64_t e = e0 + k * e_step;
    SrBits bits{};
    if constexpr (kSr) bits = sr_bits_keyed(true, a, a.row.stream, chunk0 + k * chunk_step);
    uint8_t s;
    codes[k * (e_step / kNvfp4Block)] =
        nvfp4_block_1x16_encode<kSr, kDec>(v, amax_b, g, bits, a.row, e, s);
    scales[k * (e_step / kNvfp4Block)] = s;
  }
}

// A whole 64x128 tile's column-wise copy through shared memory, the rounding and the decoded
// operand fixed at compile time: a thread's four blocks are one 32-byte sector of its written row,
// which four 8-byte stores (each a quarter sector of a line no neighbour writes) would otherwise
// send out; here they go to shared memory, and a warp then writes 16 whole sectors a store; the
// four scale bytes go out as one word. (col_stage: [tile column][block ^ (column / 4 % 4)], the
// caller's shared array)
constexpr int kColBlocks = kTileRows / kNvfp4Block;
static_assert(kColBlocks == 4, "a column's codes in a tile: one 32-byte sector");
template <class T, bool kColRht, bool kSr, bool kDec>
__device__ __forceinline__ void tile_cols_staged(const T* tile, int64_t r0, int64_t c0,
                                                 const QuantArgs& a, const Nvfp4Global& g,
                                                 uint2 (*col_stage)[kColBlocks]) {
  constexpr int kCols = FastTile<T, 1>::kCols;
  const int t = threadIdx.x;
  const int64_t R = a.rows;
  const int64_t e0 = (c0 + t) * R + r0;  // the column's first block's first element, written order
  const uint64_t chunk0 = static_cast<uint64_t>(e0) / kSrChunk;  // (its blocks: chunks chunk0 + k)
  uint32_t scales = 0;
#pragma unroll 1
  for (int k = 0; k < kColBlocks; ++k) {
    float v[kNvfp4Block];
    const float amax_b = tile_column_block<T, kColRht, kCols>(tile, t, k, v);
    const int64_t e = e0 + k * kNvfp4Block;
    SrBits bits{};
    if constexpr (kSr) bits = sr_bits_keyed(true, a, a.col.stream, chunk0 + k);
    uint8_t s;
    col_stage[t][k ^ ((t >> 2) & 3)] =
        nvfp4_block_1x16_encode<kSr, kDec>(v, amax_b, g, bits, a.col, e, s);
    scales |= static_cast<uint32_t>(s) << (8 * k);
  }
  *reinterpret_cast<uint32_t*>(a.col.scales + e0 / kNvfp4Block) = scales;
  __syncwarp();
  // lanes 2i and 2i + 1: the two 16-byte halves of the warp's written row i (16 rows a store)
  const int lane = t & 31;
  FP4SIM_UNROLL
  for (int h = 0; h < 2; ++h) {
    const int tc = (t & ~31) + 16 * h + lane / 2, half = lane & 1, f = (tc >> 2) & 3;
    const uint2 lo = col_stage[tc][(2 * half) ^ f], hi = col_stage[tc][(2 * half + 1) ^ f];
    reinterpret_cast<uint4*>(a.col.codes + ((c0 + tc) * R + r0) / 2)[half] =
        make_uint4(lo.x, lo.y, hi.x, hi.y);
  }
}

// Calls f(std::integral_constant<bool, sr>, std::integral_constant<bool, dec>) for a copy's
// rounding and decoded operand: the four specialisations of a whole tile's loop.
template <class F>
__device__ __forceinline__ void with_copy_kind(const CopyArgs& c, const F& f) {
  using std::integral_constant;
  if (c.sr) {
    if (c.decoded)
      f(integral_constant<bool, true>{}, integral_constant<bool, true>{});
    else
      f(integral_constant<bool, true>{}, integral_constant<bool, false>{});
  } else {
    if (c.decoded)
      f(integral_constant<bool, false>{}, integral_constant<bool, true>{});
    else
      f(integral_constant<bool, false>{}, integral_constant<bool, false>{});
  }
}

// One tile's quantization from the tile in shared memory (rows r0.., columns c0..): the row-wise
// copy's blocks, then the column-wise copy's (nvfp4_1x16_kernel, after its loads). Whole tiles take
// the specialised loops above; tiles on the tensor's edge the general ones below.
// (globals: the row-wise and column-wise copies' nvfp4_global, which one thread computed for the
// CTA)
template <class T, bool kColRht, int kPer>
__device__ __forceinline__ void nvfp4_1x16_tile(const T* tile, int64_t r0, int64_t c0,
                                                const QuantArgs& a, const Nvfp4Global* globals) {
  using Tile = FastTile<T, kPer>;
  constexpr int kCols = Tile::kCols;
  constexpr int kBlocksPerTileRow = kCols / kNvfp4Block;
  constexpr int kVec = 16 / sizeof(T);
  const int t = threadIdx.x;
  const int64_t R = a.rows, C = a.cols;
  const bool whole = r0 + kTileRows <= R && c0 + kCols <= C;  // (CTA-uniform)

  // ---- row-wise copy: one 1x16 block per iteration (loops kept rolled: I-cache) ----
  if (a.row.enabled && whole) {
    const Nvfp4Global g = globals[0];
    with_copy_kind(a.row, [&](auto sr, auto dec) {
      tile_rows_whole<T, kPer, decltype(sr)::value, decltype(dec)::value>(tile, r0, c0, a, g);
    });
  } else if (a.row.enabled) {
    const Nvfp4Global g = globals[0];
    const int64_t chunks_per_row = C / kSrChunk;
    // thread t's blocks: column block t % 8 (BF16; 16 for the 64x256 tile) of rows t / 8 + 16 k
    const int tr0 = static_cast<int>(static_cast<unsigned>(t) / kBlocksPerTileRow);
    const int tb = static_cast<int>(static_cast<unsigned>(t) % kBlocksPerTileRow);
#pragma unroll 1
    for (int k = 0; k < Tile::kRowUnits; ++k) {
      const int tr = tr0 + k * (kThreads / kBlocksPerTileRow);
      const int64_t r = r0 + tr, c = c0 + tb * kNvfp4Block;
      if (r >= R || c >= C) continue;
      alignas(16) T raw[kNvfp4Block];
      const T* src = tile + tr * kCols + tb * kNvfp4Block;
      FP4SIM_UNROLL
      for (int q = 0; q < kNvfp4Block / kVec; ++q)
        reinterpret_cast<uint4*>(raw)[q] = reinterpret_cast<const uint4*>(src)[q];
      float v[kNvfp4Block];
      const float amax_b = block16_values(raw, v);
      const SrBits bits = sr_bits_keyed(a.row.sr, a, a.row.stream,
                                        static_cast<uint64_t>(r * chunks_per_row + c / kSrChunk));
      nvfp4_block_1x16_store(v, amax_b, g, bits, a.row, r * C + c,
                             r * (C / kNvfp4Block) + c / kNvfp4Block);
    }
  }
  if (!a.col.enabled) return;

  // ---- column-wise copy: column c of the input is row c of the written (C x R) tensor ----
  const Nvfp4Global g = globals[1];
  if constexpr (kPer == 1) {
    if (a.col_staged && whole) {
      __shared__ uint2 col_stage[kThreads][kColBlocks];
      with_copy_kind(a.col, [&](auto sr, auto dec) {
        tile_cols_staged<T, kColRht, decltype(sr)::value, decltype(dec)::value>(tile, r0, c0, a, g,
                                                                                col_stage);
      });
      return;
    }
  }
  const int64_t chunks_per_row = R / kSrChunk;
#pragma unroll 1
  for (int w = 0; w < kPer * (kTileRows / kNvfp4Block); ++w) {
    const int j = w / (kTileRows / kNvfp4Block), k = w % (kTileRows / kNvfp4Block);
    const int64_t c = c0 + kPer * t + j;
    const int64_t r = r0 + k * kNvfp4Block;
    if (c >= C || r >= R) continue;
    float v[kNvfp4Block];
    const float amax_b = tile_column_block<T, kColRht, kCols>(tile, kPer * t + j, k, v);
    const SrBits bits = sr_bits_keyed(a.col.sr, a, a.col.stream,
                                      static_cast<uint64_t>(c * chunks_per_row + r / kSrChunk));
    // the 4 chunks of a column land in one 32-byte sector, written by this thread in turn
    nvfp4_block_1x16_store(v, amax_b, g, bits, a.col, c * R + r,
                           c * (R / kNvfp4Block) + r / kNvfp4Block);
  }
}

template <class T, bool kColRht, int kPer>
__global__ void __launch_bounds__(kThreads, FastTile<T, kPer>::kMinBlocks)
    nvfp4_1x16_kernel(const T* x, QuantArgs a) {
  using Tile = FastTile<T, kPer>;
  constexpr int kCols = Tile::kCols;
  constexpr int kBlocksPerTileRow = kCols / kNvfp4Block;
  constexpr int kVec = 16 / sizeof(T);
  __shared__ __align__(16) T tile[kTileRows * kCols];
  // Tiles in the reverse of the amax pass's order: the last ones it read are still in L2.
  const int64_t r0 = static_cast<int64_t>(gridDim.y - 1 - blockIdx.y) * kTileRows;
  const int64_t c0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * kCols;
  const int t = threadIdx.x;
  const int64_t R = a.rows, C = a.cols;

  // ---- load the tile: every 16-byte load issued before any is used (small, unrolled code); a
  // thread loads whole 1x16 blocks (a load a warp spanning 512-byte pieces of 1 KB of rows: this
  // measured faster than a warp loading 512 contiguous bytes a load, 143 against 156 us for row +
  // column RN at 8192^2 BF16, H200) ----
  const int tr0 =
      static_cast<int>(static_cast<unsigned>(t) / kBlocksPerTileRow);  // rows tr0 + kRowStep k
  const int tb = static_cast<int>(static_cast<unsigned>(t) % kBlocksPerTileRow);  // column block tb
  constexpr int kRowStep = kThreads / kBlocksPerTileRow;
  if (a.vector_ok && r0 + kTileRows <= R && c0 + kCols <= C) {  // a whole tile (CTA-uniform)
    const T* src = x + (r0 + tr0) * a.stride + c0 + tb * kNvfp4Block;
    T* dst = tile + tr0 * kCols + tb * kNvfp4Block;
    FP4SIM_UNROLL
    for (int k = 0; k < Tile::kRowUnits; ++k) {
      FP4SIM_UNROLL
      for (int q = 0; q < kNvfp4Block / kVec; ++q)
        reinterpret_cast<uint4*>(dst + k * kRowStep * kCols)[q] =
            __ldg(reinterpret_cast<const uint4*>(src + k * kRowStep * a.stride) + q);
    }
  } else {
    FP4SIM_UNROLL
    for (int k = 0; k < Tile::kRowUnits; ++k) {
      const int tr = tr0 + k * kRowStep;
      const int64_t r = r0 + tr, c = c0 + tb * kNvfp4Block;
      const int64_t valid = (r < R) ? (C - c) : 0;
      T* dst = tile + tr * kCols + tb * kNvfp4Block;
      const T* src = x + r * a.stride + c;
      if (a.vector_ok && valid >= kNvfp4Block) {
        FP4SIM_UNROLL
        for (int q = 0; q < kNvfp4Block / kVec; ++q)
          reinterpret_cast<uint4*>(dst)[q] = __ldg(reinterpret_cast<const uint4*>(src) + q);
      } else {
        for (int i = 0; i < kNvfp4Block; ++i) dst[i] = i < valid ? src[i] : T(0);
      }
    }
  }
  // The copies' global scales: one thread's divisions for the CTA, while the loads are in flight
  // (and, launched early, once the amax pass has finished: pdl_wait).
  __shared__ __align__(16) Nvfp4Global globals[2];
  pdl_wait();
  if (t == 0) {
    if (a.row.enabled) globals[0] = nvfp4_global(*a.row.amax, false);
    if (a.col.enabled) globals[1] = nvfp4_global(*a.col.amax, false);
  }
  __syncthreads();
  nvfp4_1x16_tile<T, kColRht, kPer>(tile, r0, c0, a, globals);
}

// ---- The recipe's RHT copies: the amax pass kept rht(x) (BF16, transposed: C x R), so neither
// copy needs a shared-memory tile. One streaming launch, one 1x16 block per thread, no barrier: a
// thread's loads are all issued before its arithmetic, and the many resident warps (about 45
// registers each instead of the tiled kernel's 80, no shared memory) hide the memory latency the
// tiled kernel's serial column loop exposed. Same block functions, same SR chunks, same bits.

// Calls body(i) for i in [0, n) over CTAs cta of ctas (a share of the grid); 32-bit index
// arithmetic (the bodies divide i) where n allows it, which is every training tensor.
template <class Body>
__device__ __forceinline__ void grid_loop(int64_t n, uint32_t cta, uint32_t ctas,
                                          const Body& body) {
  if (n <= INT32_MAX - static_cast<int64_t>(ctas) * blockDim.x) {
    for (uint32_t i = cta * blockDim.x + threadIdx.x; i < static_cast<uint32_t>(n);
         i += ctas * blockDim.x)
      body(i);
  } else {
    for (int64_t i = static_cast<int64_t>(cta) * blockDim.x + threadIdx.x; i < n;
         i += static_cast<int64_t>(ctas) * blockDim.x)
      body(i);
  }
}

// Row-wise copy of x: thread i quantizes block i % (C / 16) of row i / (C / 16); a warp's 16-byte
// loads cover a contiguous 2 KiB (FP32) or 1 KiB (BF16) of a row.
// (kVectorOk: a.vector_ok, a template argument so the scalar loads are not issued predicated off)
template <class T, bool kVectorOk>
__device__ __forceinline__ void nvfp4_rows(const T* x, const QuantArgs& a, uint32_t cta,
                                           uint32_t ctas) {
  const Nvfp4Global g = nvfp4_global(*a.row.amax, false);
  const int64_t bpr = a.cols / kNvfp4Block;
  grid_loop(a.rows * bpr, cta, ctas, [&](auto i) {
    using I = decltype(i);
    const int64_t r = i / static_cast<I>(bpr),
                  c = static_cast<int64_t>(i % static_cast<I>(bpr)) * kNvfp4Block;
    const T* src = x + r * a.stride + c;
    alignas(16) T raw[kNvfp4Block];
    if constexpr (kVectorOk) {
      constexpr int kVec = 16 / sizeof(T);
      FP4SIM_UNROLL
      for (int q = 0; q < kNvfp4Block / kVec; ++q)
        reinterpret_cast<uint4*>(raw)[q] = __ldg(reinterpret_cast<const uint4*>(src) + q);
    } else {
      FP4SIM_UNROLL
      for (int q = 0; q < kNvfp4Block; ++q) raw[q] = src[q];
    }
    float v[kNvfp4Block];
    const float amax_b = block16_values(raw, v);
    const SrBits bits =
        sr_bits_keyed(a.row.sr, a, a.row.stream, static_cast<uint64_t>(i));  // (chunk i: block i)
    nvfp4_block_1x16_store(v, amax_b, g, bits, a.row, r * a.cols + c, static_cast<int64_t>(i));
  });
}

// Column-wise RHT copy from the kept rht(x), which the amax pass stored transposed (C x R, the
// written copy's order): thread i quantizes block i of the written tensor, 16 contiguous values,
// so a warp reads 1 KiB and writes 256 code bytes, 32 scale bytes (and 1 KiB decoded) contiguously.
__device__ __forceinline__ void nvfp4_cols_rht(const uint16_t* rht_t, const QuantArgs& a,
                                               uint32_t cta, uint32_t ctas) {
  const int64_t R = a.rows, C = a.cols;
  const Nvfp4Global g = nvfp4_global(*a.col.amax, false);
  grid_loop((R / kNvfp4Block) * C, cta, ctas, [&](auto i) {
    using I = decltype(i);
    const int64_t c = i / static_cast<I>(R / kNvfp4Block);
    const int64_t r = static_cast<int64_t>(i % static_cast<I>(R / kNvfp4Block)) * kNvfp4Block;
    const uint4* src = reinterpret_cast<const uint4*>(rht_t + c * R + r);
    const uint4 lo = __ldg(src), hi = __ldg(src + 1);
    const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    float v[kNvfp4Block];
    const float amax_b = bf16x16_unpack(w, v);
    const SrBits bits =
        sr_bits_keyed(a.col.sr, a, a.col.stream, static_cast<uint64_t>(i));  // (chunk i: block i)
    nvfp4_block_1x16_store(v, amax_b, g, bits, a.col, c * R + r, static_cast<int64_t>(i));
  });
}

// Both in one launch: with a row-wise copy, even CTAs take rows and odd ones columns, so the
// memory-heavy row work and the arithmetic-heavy SR column work share the SMs throughout.
template <class T, bool kVectorOk>
__global__ void __launch_bounds__(256)
    nvfp4_rht_kept_kernel(const T* x, const uint16_t* rht_t, QuantArgs a) {
  if (!a.row.enabled) {
    nvfp4_cols_rht(rht_t, a, blockIdx.x, gridDim.x);
  } else if (blockIdx.x & 1u) {
    nvfp4_cols_rht(rht_t, a, blockIdx.x >> 1, gridDim.x >> 1);
  } else {
    nvfp4_rows<T, kVectorOk>(x, a, blockIdx.x >> 1, gridDim.x >> 1);
  }
}

}  // namespace
}  // namespace fp4sim::gpu
