// The quantizer's general second pass (gpu/quantize.cu): a 64x128 input tile a CTA, every format
// and option (MXFP4, 2D scales, Four Over Six, RHT); and the half-warp kernel of the NVFP4 2D
// copies without Four Over Six or RHT.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "emu/quantize_block.hpp"
#include "emu/rht.hpp"
#include "gpu/decode_bf16.cuh"
#include "gpu/quantize_common.cuh"

namespace fp4sim::gpu {
namespace {

// Load the input tile [r0, r0+64) x [c0, c0+128) into shared memory (zeros outside the tensor).
template <class T>
__device__ void load_tile(T* tile, const T* x, int64_t rows, int64_t cols, int64_t stride,
                          int64_t r0, int64_t c0, bool vector_ok) {
  constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte load
  constexpr int kVecPerRow = kTileCols / kVec;
  for (int i = threadIdx.x; i < kTileRows * kVecPerRow; i += kThreads) {
    const int tr = i / kVecPerRow;
    const int tc = (i % kVecPerRow) * kVec;
    const int64_t r = r0 + tr, c = c0 + tc;
    T* dst = tile + tr * kTileCols + tc;
    if (vector_ok && r < rows && c + kVec <= cols) {
      *reinterpret_cast<uint4*>(dst) = __ldg(reinterpret_cast<const uint4*>(x + r * stride + c));
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k)
        dst[k] = (r < rows && c + k < cols) ? x[r * stride + c + k] : T(0);
    }
  }
}

template <class T, bool kMx>
__global__ void __launch_bounds__(kThreads) quantize_tile_kernel(const T* x, QuantArgs a) {
  __shared__ __align__(16) T tile[kTileRows * kTileCols];
  __shared__ uint8_t tile_scale[2][kTileRows / kNvfp4Block][kTileCols / kNvfp4Block];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTileRows;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTileCols;
  load_tile(tile, x, a.rows, a.cols, a.stride, r0, c0, a.vector_ok);
  __syncthreads();
  const int t = threadIdx.x;
  const int64_t R = a.rows, C = a.cols;

  // Global scales (amax already reduced by the previous pass).
  const Nvfp4Global g_row = nvfp4_global(a.row.enabled ? *a.row.amax : 0.0f, a.row.four_over_six);
  const Nvfp4Global g_col = nvfp4_global(a.col.enabled ? *a.col.amax : 0.0f, a.col.four_over_six);

  // 2D: one scale per 16x16 tile and copy (each copy has its own global scale and options)
  if (a.block_2d) {
    constexpr int kTilesR = kTileRows / kNvfp4Block, kTilesC = kTileCols / kNvfp4Block;
    // standard copies: a 16x16 tile's amax is the max of its 16 columns' 16-row maxima (thread t
    // owns tile column t; max is order-free), so 128 threads find it in 16 steps and a 4-step
    // shuffle instead of 64 threads walking 256 values each; the scale is nvfp4_tile_scale's
    const bool row_std = a.row.enabled && !a.row.four_over_six,
               col_std = a.col.enabled && !a.col.four_over_six;
    if (row_std || col_std) {
      FP4SIM_UNROLL
      for (int k = 0; k < kTilesR; ++k) {
        float m = 0.0f;
        FP4SIM_UNROLL
        for (int i = 0; i < kNvfp4Block; ++i)
          m = fmax_nan_ignored(
              m, f32_abs(Elem<T>::to_f32(tile[(k * kNvfp4Block + i) * kTileCols + t])));
        FP4SIM_UNROLL
        for (int o = kNvfp4Block / 2; o > 0; o >>= 1)
          m = fmax_nan_ignored(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
        if ((t & (kNvfp4Block - 1)) == 0) {
          if (row_std)
            tile_scale[0][k][t / kNvfp4Block] = nvfp4_block_scale<DeviceFormats>(m, g_row.s_enc);
          if (col_std)
            tile_scale[1][k][t / kNvfp4Block] = nvfp4_block_scale<DeviceFormats>(m, g_col.s_enc);
        }
      }
    }
    // Four Over Six copies: one thread per tile and copy tries both candidate scales
    if (t < 2 * kTilesR * kTilesC) {
      const bool col = t >= kTilesR * kTilesC;
      const int idx = col ? t - kTilesR * kTilesC : t;
      const int tr = idx / kTilesC, tc = idx % kTilesC;
      const CopyArgs& ca = col ? a.col : a.row;
      if (ca.enabled && ca.four_over_six) {
        const T* base = tile + (tr * kNvfp4Block) * kTileCols + tc * kNvfp4Block;
        const auto load = [&](int i, int j) { return Elem<T>::to_f32(base[i * kTileCols + j]); };
        tile_scale[col][tr][tc] =
            nvfp4_tile_scale<DeviceFormats>(load, col ? g_col : g_row, ca.four_over_six, a.mse);
      }
    }
    __syncthreads();
  }

  // ---- row-wise copy: blocks along the row ----
  if (a.row.enabled) {
    constexpr int block = kMx ? kMxfp4Block : kNvfp4Block;
    constexpr int blocks_per_tile_row = kTileCols / block;
    const int64_t chunks_per_row = C / kSrChunk;
    const int64_t scales_per_row = C / block;
    for (int u = t; u < kTileRows * blocks_per_tile_row; u += kThreads) {
      const int tr = u / blocks_per_tile_row, tb = u % blocks_per_tile_row;
      const int64_t r = r0 + tr, c = c0 + tb * block;
      if (r >= R || c >= C) continue;
      float v[block];
      for (int i = 0; i < block; ++i) v[i] = Elem<T>::to_f32(tile[tr * kTileCols + tb * block + i]);
      const uint64_t chunk = static_cast<uint64_t>(r * chunks_per_row + c / kSrChunk);
      alignas(16) uint8_t packed[block / 2];
      uint8_t s;
      if constexpr (kMx) {
        s = mxfp4_quantize_1x32<DeviceFormats>(
            v, a.mx_rule, sr_bits_keyed(a.row.sr, a, a.row.stream, chunk),
            sr_bits_keyed(a.row.sr, a, a.row.stream, chunk + 1), packed);
        *reinterpret_cast<uint4*>(a.row.codes + (r * C + c) / 2) =
            *reinterpret_cast<uint4*>(packed);
        if (a.row.decoded) decode32_mx_bf16(packed, s, a.row.decoded + r * C + c);
      } else {
        const SrBits bits = sr_bits_keyed(a.row.sr, a, a.row.stream, chunk);
        if (a.block_2d) {
          s = tile_scale[0][tr / kNvfp4Block][tb];
          e2m1_encode16<DeviceFormats>(v, nvfp4_block_encode_scale<DeviceFormats>(s, g_row.s_dec),
                                       bits, packed);
        } else {
          s = nvfp4_quantize_1x16<DeviceFormats>(v, g_row, a.row.four_over_six, a.mse, bits,
                                                 packed);
        }
        *reinterpret_cast<uint2*>(a.row.codes + (r * C + c) / 2) =
            *reinterpret_cast<uint2*>(packed);
        if (a.row.decoded)
          decode16_bf16(*reinterpret_cast<const uint2*>(packed), s, a.row.decoded + r * C + c);
      }
      a.row.scales[r * scales_per_row + c / block] = s;
    }
  }

  // ---- column-wise copy: the written tensor is C x R, blocks along the input's rows ----
  if (a.col.enabled) {
    const int64_t c = c0 + t;
    if (c < C) {
      constexpr int block = kMx ? kMxfp4Block : kNvfp4Block;
      const int64_t chunks_per_row = R / kSrChunk;  // of the written tensor
      const int64_t scales_per_row = R / block;
      for (int k = 0; k < kTileRows / block; ++k) {
        const int64_t r = r0 + k * block;  // written column
        if (r >= R) break;
        float v[block];
        if (a.col.rht) {
          for (int h = 0; h < block / kRhtSize; ++h) {
            uint16_t in[kRhtSize], y[kRhtSize];
#pragma unroll
            for (int i = 0; i < kRhtSize; ++i)
              in[i] = bf16_rne_cvt(
                  Elem<T>::to_f32(tile[(k * block + h * kRhtSize + i) * kTileCols + t]));
            rht16<DeviceFormats>(in, y);
#pragma unroll
            for (int i = 0; i < kRhtSize; ++i) v[h * kRhtSize + i] = bf16_to_f32(y[i]);
          }
        } else {
          for (int i = 0; i < block; ++i)
            v[i] = Elem<T>::to_f32(tile[(k * block + i) * kTileCols + t]);
        }
        const uint64_t chunk = static_cast<uint64_t>(c * chunks_per_row + r / kSrChunk);
        alignas(16) uint8_t packed[block / 2];
        uint8_t s;
        if constexpr (kMx) {
          s = mxfp4_quantize_1x32<DeviceFormats>(
              v, a.mx_rule, sr_bits_keyed(a.col.sr, a, a.col.stream, chunk),
              sr_bits_keyed(a.col.sr, a, a.col.stream, chunk + 1), packed);
          uint2* dst = reinterpret_cast<uint2*>(a.col.codes + (c * R + r) / 2);
          dst[0] = *reinterpret_cast<uint2*>(packed);
          dst[1] = *reinterpret_cast<uint2*>(packed + 8);
          if (a.col.decoded) decode32_mx_bf16(packed, s, a.col.decoded + c * R + r);
        } else {
          const SrBits bits = sr_bits_keyed(a.col.sr, a, a.col.stream, chunk);
          if (a.block_2d) {
            s = tile_scale[1][k][t / kNvfp4Block];
            e2m1_encode16<DeviceFormats>(v, nvfp4_block_encode_scale<DeviceFormats>(s, g_col.s_dec),
                                         bits, packed);
          } else {
            s = nvfp4_quantize_1x16<DeviceFormats>(v, g_col, a.col.four_over_six, a.mse, bits,
                                                   packed);
          }
          *reinterpret_cast<uint2*>(a.col.codes + (c * R + r) / 2) =
              *reinterpret_cast<uint2*>(packed);
          if (a.col.decoded)
            decode16_bf16(*reinterpret_cast<const uint2*>(packed), s, a.col.decoded + c * R + r);
        }
        a.col.scales[c * scales_per_row + r / block] = s;
      }
    }
  }
}

// ---- NVFP4 2D copies (16x16 blocks) without Four Over Six or RHT: the recipe's weights ----
//
// A half-warp owns one 16x16 block: lane j loads the block's row j (16-byte loads), the block's
// amax is the half-warp's max of the lanes' row maxima (max is order-free: the tile kernel's
// value), lane j quantizes row j for the row-wise copy and, after a transpose through shared
// memory, input column j for the column-wise copy. Same block functions, SR chunks and bits as
// quantize_tile_kernel's 2D path; 16 blocks per 256-thread CTA instead of a 64x128 tile per
// 128-thread CTA, so a weight matrix of a few million elements spreads over every SM instead of
// leaving each of ~200 CTAs a long serial loop (the tile kernel took 21-26 us per gpt2-124m
// weight, one wave at a few warps per SM). Needs rows and cols multiples of 16 and 16-byte rows.
constexpr int k2dThreads = 256;
constexpr int k2dBlocksPerCta = k2dThreads / kNvfp4Block;

template <class T>
__global__ void __launch_bounds__(k2dThreads) nvfp4_2d_kernel(const T* x, QuantArgs a) {
  __shared__ float blk[k2dBlocksPerCta][kNvfp4Block]
                      [kNvfp4Block + 1];  // (padded: conflict-free both ways)
  const int hw = static_cast<int>(threadIdx.x) / kNvfp4Block,
            j = static_cast<int>(threadIdx.x) % kNvfp4Block;
  const unsigned half = 0xFFFFu << (threadIdx.x & 16u);  // this half-warp's lanes
  const int64_t R = a.rows, C = a.cols, bcols = C / kNvfp4Block;
  const int64_t b = static_cast<int64_t>(blockIdx.x) * k2dBlocksPerCta + hw;
  if (b >= (R / kNvfp4Block) * bcols) return;  // (half-warp uniform)
  const int64_t r0 = (b / bcols) * kNvfp4Block, c0 = (b % bcols) * kNvfp4Block;
  const int64_t r = r0 + j;
  constexpr int kVec = 16 / sizeof(T);
  alignas(16) T raw[kNvfp4Block];
  FP4SIM_UNROLL
  for (int q = 0; q < kNvfp4Block / kVec; ++q)
    reinterpret_cast<uint4*>(raw)[q] =
        __ldg(reinterpret_cast<const uint4*>(x + r * a.stride + c0) + q);
  float v[kNvfp4Block];
  float m = 0.0f;
  FP4SIM_UNROLL
  for (int i = 0; i < kNvfp4Block; ++i) {
    v[i] = Elem<T>::to_f32(raw[i]);
    m = fmax_nan_ignored(m, f32_abs(v[i]));
  }
  FP4SIM_UNROLL
  for (int o = kNvfp4Block / 2; o > 0; o >>= 1)
    m = fmax_nan_ignored(m, __shfl_xor_sync(half, m, o));
  alignas(8) uint8_t packed[kNvfp4Block / 2];
  if (a.row.enabled) {
    const Nvfp4Global g = nvfp4_global(*a.row.amax, false);
    const uint8_t s = nvfp4_block_scale<DeviceFormats>(m, g.s_enc);
    const SrBits bits = sr_bits_keyed(a.row.sr, a, a.row.stream,
                                      static_cast<uint64_t>(r * (C / kSrChunk) + c0 / kSrChunk));
    e2m1_encode16<DeviceFormats>(v, nvfp4_block_encode_scale<DeviceFormats>(s, g.s_dec), bits,
                                 packed);
    store_nvfp4_block(a.row, r * C + c0, r * bcols + c0 / kNvfp4Block, packed, s);
  }
  if (a.col.enabled) {
    FP4SIM_UNROLL
    for (int i = 0; i < kNvfp4Block; ++i) blk[hw][j][i] = v[i];
    __syncwarp(half);
    FP4SIM_UNROLL
    for (int i = 0; i < kNvfp4Block; ++i) v[i] = blk[hw][i][j];
    const int64_t cc = c0 + j;  // input column j = row cc of the written (C x R) copy, columns r0..
    const Nvfp4Global g = nvfp4_global(*a.col.amax, false);
    const uint8_t s = nvfp4_block_scale<DeviceFormats>(m, g.s_enc);
    const SrBits bits = sr_bits_keyed(a.col.sr, a, a.col.stream,
                                      static_cast<uint64_t>(cc * (R / kSrChunk) + r0 / kSrChunk));
    e2m1_encode16<DeviceFormats>(v, nvfp4_block_encode_scale<DeviceFormats>(s, g.s_dec), bits,
                                 packed);
    store_nvfp4_block(a.col, cc * R + r0, cc * (R / kNvfp4Block) + r0 / kNvfp4Block, packed, s);
  }
}

}  // namespace
}  // namespace fp4sim::gpu
