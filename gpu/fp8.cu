// The FP8 block format on the GPU (DESIGN.md §9), twins of the emulator's FP8 paths in
// emu/cpu_backend.cpp and emu/gemm.cpp, built from the same host/device functions
// (fp8_block_encode_scale, fp8_quantize_element, fp8_decode_element, tfdpa_fp8_hopper), so the bits
// are the emulator's by construction. Quantization: one tiled pass for both copies; the exact GEMM:
// one thread per output (correctness first).
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "emu/gemm.hpp"
#include "emu/mma.hpp"
#include "gpu/amax_finish.cuh"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"

namespace fp4sim::gpu {
namespace {

// Both copies in one pass over a 128 x 128 input tile in shared memory (FP32, rows padded to 129
// floats so that column reads are free of bank conflicts), 256 threads = 8 warps, warp w owning
// tile rows w, w + 8, ..., w + 120 (and, for the column-wise copy, tile columns likewise):
//  1. load: lane l reads elements 4l..4l+3 of each of its warp's rows (coalesced 16-byte loads,
//     four rows in flight per warp), stores them to the tile and takes each row's block max by
//     shuffles, lane i keeping the warp's i-th row's; the tile's NaN-ignoring max |x| goes to the
//     global amax of both copies (amax_commit: the backend's self-resetting workspace);
//  2. row-wise copy: lanes 0..15 each turn one row's block max into its scale (the division and
//     the stored 1/enc once per row, sixteen rows side by side, instead of once per row by the
//     whole warp); then per row, enc from lane i by a shuffle, the lane's four codes (two pair
//     conversions) as one 4-byte store;
//  3. column-wise (input column c0 + tc is written row c0 + tc, its elements r0.. at columns
//     r0..): the same in two sweeps over the warp's sixteen columns, block maxima (lane i keeping
//     column i's), then scales by lanes 0..15, then codes (lane l: rows l, l + 32, ...).
// A 128x128 tile (2D) uses the tile's amax for every block of both copies. Codes and scales are
// the emulator's functions (fp8_block_encode_scale, fp8_block_decode_scale, fp8_quantize_pair),
// so the bits are the emulator's. Rows past R read as zeros and are not written (the row-wise
// 1x128 copy allows any R; the host checks the dimensions each copy blocks along).
constexpr int kFp8TileThreads = 256;
constexpr int kFp8Warps = kFp8TileThreads / 32;
constexpr int kFp8LinesPerWarp = kFp8Block / kFp8Warps;  // 16 rows (and columns) per warp
constexpr int kFp8TilePitch = kFp8Block + 1;
constexpr size_t kFp8TileSmem = sizeof(float) * kFp8Block * kFp8TilePitch;

struct Fp8TileArgs {
  int64_t rows, cols, stride;
  bool two_d;
  bool vector_ok;  // rows aligned for 4-element loads (16 bytes FP32, 8 bytes BF16)
  QuantizedView row, col;  // codes null = copy disabled
  AmaxArgs amax;           // targets: the enabled copies' amax
};

// Four consecutive elements of row r from column c as FP32 (zeros outside the tensor): one 16-byte
// (FP32) or 8-byte (BF16) load where the caller says the rows are aligned for it.
template <class T>
__device__ __forceinline__ void fp8_load4(const T* x, const Fp8TileArgs& a, int64_t r, int64_t c, float (&v)[4]) {
  if (a.vector_ok && r < a.rows && c + 4 <= a.cols) {
    if constexpr (sizeof(T) == 2) {
      const uint2 u = __ldg(reinterpret_cast<const uint2*>(x + r * a.stride + c));
      v[0] = bf16_to_f32(static_cast<uint16_t>(u.x & 0xFFFFu));
      v[1] = bf16_to_f32(static_cast<uint16_t>(u.x >> 16));
      v[2] = bf16_to_f32(static_cast<uint16_t>(u.y & 0xFFFFu));
      v[3] = bf16_to_f32(static_cast<uint16_t>(u.y >> 16));
    } else {
      const float4 u = __ldg(reinterpret_cast<const float4*>(x + r * a.stride + c));
      v[0] = u.x;
      v[1] = u.y;
      v[2] = u.z;
      v[3] = u.w;
    }
    return;
  }
  for (int k = 0; k < 4; ++k) {
    float e = 0.0f;
    if (r < a.rows && c + k < a.cols) {
      if constexpr (sizeof(T) == 2) e = bf16_to_f32(x[r * a.stride + c + k]);
      else e = x[r * a.stride + c + k];
    }
    v[k] = e;
  }
}

template <class T>
__global__ void __launch_bounds__(kFp8TileThreads) fp8_quantize_tile_kernel(const T* x, Fp8TileArgs a) {
  extern __shared__ float tile[];  // [128][129]
  __shared__ float warp_partial[kFp8Warps];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kFp8Block, c0 = static_cast<int64_t>(blockIdx.x) * kFp8Block;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned full = 0xFFFFFFFFu;
  // 1. load, tile, block maxima of the rows (lane i: the warp's i-th row, tile row warp + 8 i)
  float m = 0.0f, row_max = 0.0f;
  constexpr int kGroup = 4;  // rows whose loads are issued before any is used (memory parallelism)
#pragma unroll 1
  for (int g = 0; g < kFp8LinesPerWarp / kGroup; ++g) {
    float v[kGroup][4];
    FP4SIM_UNROLL
    for (int u = 0; u < kGroup; ++u)
      fp8_load4(x, a, r0 + warp + kFp8Warps * (g * kGroup + u), c0 + 4 * lane, v[u]);
    FP4SIM_UNROLL
    for (int u = 0; u < kGroup; ++u) {
      const int i = g * kGroup + u, tr = warp + kFp8Warps * i;
      float mb = 0.0f;
      FP4SIM_UNROLL
      for (int k = 0; k < 4; ++k) {
        mb = fmax_nan_ignored(mb, f32_abs(v[u][k]));
        tile[tr * kFp8TilePitch + 4 * lane + k] = v[u][k];
      }
      m = fmax_nan_ignored(m, mb);
      if (!a.two_d) {
        mb = warp_max(mb);
        if (lane == i) row_max = mb;
      }
    }
  }
  m = warp_max(m);
  if (lane == 0) warp_partial[warp] = m;
  __syncthreads();
  float tile_amax = 0.0f;
  for (int w = 0; w < kFp8Warps; ++w) tile_amax = fmax_nan_ignored(tile_amax, warp_partial[w]);
  if (threadIdx.x == 0) amax_commit(tile_amax, 0.0f, a.amax);
  const float enc_tile = a.two_d ? fp8_block_encode_scale(tile_amax) : 0.0f;

  // 2. row-wise copy: rows r0.. of the input, written at (r, c0 + 4 lane ..)
  if (a.row.codes) {
    float* scales = reinterpret_cast<float*>(a.row.scales);
    const int64_t kb = a.cols / kFp8Block;
    const float enc_mine = a.two_d ? enc_tile : fp8_block_encode_scale(row_max);
    const int64_t r_mine = r0 + warp + kFp8Warps * lane;
    if (lane < kFp8LinesPerWarp && r_mine < a.rows) scales[r_mine * kb + c0 / kFp8Block] = fp8_block_decode_scale(enc_mine);
#pragma unroll 2
    for (int i = 0; i < kFp8LinesPerWarp; ++i) {
      const int tr = warp + kFp8Warps * i;
      const int64_t r = r0 + tr, c = c0 + 4 * lane;
      if (r >= a.rows) break;  // (warp-uniform)
      const float enc = __shfl_sync(full, enc_mine, i);
      const float* t = tile + tr * kFp8TilePitch + 4 * lane;
      const uint32_t packed = fp8_quantize_pair(t[0], t[1], enc) | (fp8_quantize_pair(t[2], t[3], enc) << 16);
      uint8_t* dst = a.row.codes + r * a.cols + c;
      if (c + 4 <= a.cols) {
        *reinterpret_cast<uint32_t*>(dst) = packed;  // a.cols % 128 == 0 for a row-wise copy
      } else {
        for (int k = 0; k < 4 && c + k < a.cols; ++k) dst[k] = static_cast<uint8_t>(packed >> (8 * k));
      }
    }
  }
  // 3. column-wise copy: tile column tc = warp + 8 i (lane i keeps its block max)
  if (a.col.codes) {
    float* scales = reinterpret_cast<float*>(a.col.scales);
    float col_max = 0.0f;
    if (!a.two_d) {
#pragma unroll 2
      for (int i = 0; i < kFp8LinesPerWarp; ++i) {
        const int tc = warp + kFp8Warps * i;
        float mb = 0.0f;
        FP4SIM_UNROLL
        for (int j = 0; j < kFp8Block / 32; ++j) mb = fmax_nan_ignored(mb, f32_abs(tile[(lane + 32 * j) * kFp8TilePitch + tc]));
        mb = warp_max(mb);
        if (lane == i) col_max = mb;
      }
    }
    const float enc_mine = a.two_d ? enc_tile : fp8_block_encode_scale(col_max);
    const int64_t cc_mine = c0 + warp + kFp8Warps * lane;
    if (lane < kFp8LinesPerWarp && cc_mine < a.cols)
      scales[cc_mine * (a.rows / kFp8Block) + r0 / kFp8Block] = fp8_block_decode_scale(enc_mine);
#pragma unroll 2
    for (int i = 0; i < kFp8LinesPerWarp; ++i) {
      const int tc = warp + kFp8Warps * i;
      const int64_t cc = c0 + tc;
      if (cc >= a.cols) break;  // (warp-uniform; past the last column the tile holds zeros)
      const float enc = __shfl_sync(full, enc_mine, i);
      const float* t = tile + lane * kFp8TilePitch + tc;
      const uint32_t p01 = fp8_quantize_pair(t[0], t[32 * kFp8TilePitch], enc);
      const uint32_t p23 = fp8_quantize_pair(t[64 * kFp8TilePitch], t[96 * kFp8TilePitch], enc);
      uint8_t* dst = a.col.codes + cc * a.rows + r0 + lane;
      dst[0] = static_cast<uint8_t>(p01);
      dst[32] = static_cast<uint8_t>(p01 >> 8);
      dst[64] = static_cast<uint8_t>(p23);
      dst[96] = static_cast<uint8_t>(p23 >> 8);
    }
  }
}

__global__ void fp8_dequantize_kernel(QuantizedView q, float* out, int64_t out_stride) {
  const float* scales = reinterpret_cast<const float*>(q.scales);
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < q.rows * q.cols;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / q.cols, c = e % q.cols;
    out[r * out_stride + c] = fp8_decode_element(q.codes[e], scales[r * (q.cols / kFp8Block) + c / kFp8Block]);
  }
}

// One thread per output: per 128-block four chained Hopper FP8 T-FDPAs from +0, then
// acc = fmaf(s_a * s_b, partial, acc); split-K ranges added in order; the emulator's epilogue.
__global__ void fp8_gemm_exact_kernel(QuantizedView a, QuantizedView b, const float* c, GemmConfig cfg, void* out) {
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
  gemm_store(cfg, cfg.alpha, total, c, idx, out);
}

// One launch of the tile kernel for input element type T; its dynamic shared memory (over the
// 48 KB default) is allowed once per instantiation.
template <class T>
void launch_fp8_tile(const dim3& grid, const void* x, const Fp8TileArgs& a, cudaStream_t stream) {
  static bool attr = false;
  if (!attr) {
    FP4SIM_CUDA_CHECK(cudaFuncSetAttribute(fp8_quantize_tile_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(kFp8TileSmem)));
    attr = true;
  }
  fp8_quantize_tile_kernel<T><<<grid, kFp8TileThreads, kFp8TileSmem, stream>>>(static_cast<const T*>(x), a);
}

}  // namespace

void fp8_quantize_launch(const TensorView& x, const QuantizeConfig& cfg, QuantizedView* rowwise,
                         QuantizedView* columnwise, cudaStream_t stream, unsigned* amax_ws) {
  if (!amax_ws) throw std::logic_error("fp8_quantize_launch: no amax workspace");
  Fp8TileArgs a{};
  a.rows = x.rows;
  a.cols = x.cols;
  a.stride = x.stride();
  a.two_d = cfg.block_2d;
  const int64_t vec_bytes = 4 * (x.dtype == DType::F32 ? 4 : 2);
  a.vector_ok = reinterpret_cast<uintptr_t>(x.data) % vec_bytes == 0 &&
                (a.stride * (x.dtype == DType::F32 ? 4 : 2)) % vec_bytes == 0;
  if (cfg.rowwise.enabled) a.row = *rowwise;
  if (cfg.columnwise.enabled) a.col = *columnwise;
  if (!cfg.rowwise.enabled) a.row.codes = nullptr;
  if (!cfg.columnwise.enabled) a.col.codes = nullptr;
  // the copies' amax is the input's (no transform): reduced once, written to both
  a.amax = AmaxArgs{cfg.rowwise.enabled ? rowwise->amax : columnwise->amax,
                    cfg.rowwise.enabled && cfg.columnwise.enabled ? columnwise->amax : nullptr, nullptr, nullptr,
                    amax_ws};
  const int64_t gy = (x.rows + kFp8Block - 1) / kFp8Block, gx = (x.cols + kFp8Block - 1) / kFp8Block;
  if (gy > 65535)
    throw std::invalid_argument("quantize (cuda, fp8): tensor '" + std::string(x.name) + "' " +
                                shape_str(x.rows, x.cols) + " has too many rows for one launch");
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
  if (x.dtype == DType::F32) launch_fp8_tile<float>(grid, x.data, a, stream);
  else launch_fp8_tile<uint16_t>(grid, x.data, a, stream);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void fp8_dequantize_launch(const QuantizedView& q, const TensorView& out, cudaStream_t stream) {
  fp8_dequantize_kernel<<<grid_stride_blocks(q.rows * q.cols, 256), 256, 0, stream>>>(q, static_cast<float*>(out.data),
                                                                             out.stride());
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void fp8_gemm_exact_launch(const QuantizedView& a, const QuantizedView& b, const float* c, const GemmConfig& cfg,
                           void* out, cudaStream_t stream) {
  const int64_t n = a.rows * b.rows;
  fp8_gemm_exact_kernel<<<static_cast<unsigned>((n + 127) / 128), 128, 0, stream>>>(a, b, c, cfg, out);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

}  // namespace fp4sim::gpu
