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
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"

namespace fp4sim::gpu {
namespace {

// Both copies in one pass over a 128 x 128 input tile in shared memory (FP32, rows padded to 129
// floats so that column reads are free of bank conflicts), 256 threads = 8 warps:
//  - the tile's NaN-ignoring max |x| goes to the global amax (one integer atomicMax on the bit
//    pattern per CTA: non-negative floats order as their bits, so the result is order-free);
//  - a 1x128 block is one warp's row (row-wise copy) or column (column-wise copy: input column c is
//    row c of the written C x R tensor, its 128-block the tile's 128 rows), 4 elements per lane,
//    the block amax by shuffles; a 128x128 tile (2D) uses the tile's amax for every row;
//  - then enc = fp8_block_encode_scale(amax_b), scale = 1 / enc, codes fp8_quantize_element(x, enc):
//    the emulator's functions, so the bits are the emulator's.
// Rows past R read as zeros and are not written (the row-wise 1x128 copy allows any R; the host
// checks the dimensions each copy blocks along).
constexpr int kFp8TileThreads = 256;
constexpr int kFp8TilePitch = kFp8Block + 1;
constexpr size_t kFp8TileSmem = sizeof(float) * kFp8Block * kFp8TilePitch;

__device__ __forceinline__ float warp_max_nan_ignored(float m) {
  for (int off = 16; off > 0; off >>= 1) m = fmax_nan_ignored(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  return m;
}

struct Fp8TileArgs {
  int64_t rows, cols, stride;
  bool two_d;
  bool vector_ok;  // rows aligned for 4-element loads (16 bytes FP32, 8 bytes BF16)
  QuantizedView row, col;  // codes null = copy disabled
  unsigned int* amax_bits;
};

// One 1x128 block of a written copy, by one warp: lane reads elements lane + 32 j of a tile line
// (a row: step 1; a column: step kFp8TilePitch), the block amax is the line's (or, under 2D, the
// tile's), and the lane writes its four codes at dst[lane + 32 j]; lane 0 writes the FP32 scale.
__device__ __forceinline__ void fp8_quantize_line(const float* line, int step, bool two_d, float tile_amax,
                                                  uint8_t* dst, float* scale, int lane) {
  float v[kFp8Block / 32];
  float mb = 0.0f;
  for (int j = 0; j < kFp8Block / 32; ++j) {
    v[j] = line[(lane + 32 * j) * step];
    mb = fmax_nan_ignored(mb, f32_abs(v[j]));
  }
  const float enc = fp8_block_encode_scale(two_d ? tile_amax : warp_max_nan_ignored(mb));
  for (int j = 0; j < kFp8Block / 32; ++j) dst[lane + 32 * j] = fp8_quantize_element(v[j], enc);
  if (lane == 0) *scale = fdiv_rn(1.0f, enc);
}

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

// One warp's row of a tile after its load: the tile max, the shared-memory copy (when needed) and
// the row-wise 1x128 block from registers (row_now).
__device__ __forceinline__ void fp8_row_chunk(const Fp8TileArgs& a, const float (&v)[4], int tr, int64_t r,
                                              int64_t c, int64_t c0, int lane, bool need_tile, bool row_now,
                                              float* tile, float& m) {
  float mb = 0.0f;
  FP4SIM_UNROLL
  for (int k = 0; k < 4; ++k) mb = fmax_nan_ignored(mb, f32_abs(v[k]));
  m = fmax_nan_ignored(m, mb);
  if (need_tile) {
    FP4SIM_UNROLL
    for (int k = 0; k < 4; ++k) tile[tr * kFp8TilePitch + 4 * lane + k] = v[k];
  }
  if (row_now && r < a.rows) {  // (r is the same for the whole warp: the shuffles are safe)
    const float enc = fp8_block_encode_scale(warp_max_nan_ignored(mb));
    uint32_t packed = 0;
    FP4SIM_UNROLL
    for (int k = 0; k < 4; ++k) packed |= static_cast<uint32_t>(fp8_quantize_element(v[k], enc)) << (8 * k);
    uint8_t* dst = a.row.codes + r * a.cols + c;
    if (c + 4 <= a.cols) {
      *reinterpret_cast<uint32_t*>(dst) = packed;  // a.cols % 128 == 0 for a row-wise copy
    } else {
      for (int k = 0; k < 4 && c + k < a.cols; ++k) dst[k] = static_cast<uint8_t>(packed >> (8 * k));
    }
    if (lane == 0) reinterpret_cast<float*>(a.row.scales)[r * (a.cols / kFp8Block) + c0 / kFp8Block] = fdiv_rn(1.0f, enc);
  }
}

// Warp w reads tile rows w, w + 8, ..., lane l the four elements 4l..4l+3 of each (coalesced
// 16-byte loads). A 1x128 row-wise block is then one warp's registers: its amax by shuffles, its
// four codes per lane written as one 4-byte store, so the row-wise copy never goes through shared
// memory (2D copies, whose scale is the tile's amax, still do). The tile goes to shared memory for
// the column-wise copy (and the 2D row-wise one) only.
template <class T>
__global__ void __launch_bounds__(kFp8TileThreads) fp8_quantize_tile_kernel(const T* x, Fp8TileArgs a) {
  extern __shared__ float tile[];  // [128][129]
  __shared__ float warp_partial[kFp8TileThreads / 32];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kFp8Block, c0 = static_cast<int64_t>(blockIdx.x) * kFp8Block;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool row_now = a.row.codes && !a.two_d;  // row-wise 1x128 from registers
  const bool need_tile = a.col.codes || (a.row.codes && a.two_d);
  float m = 0.0f;
  // rows in groups of kGroup, each group's loads issued before any is used (memory parallelism: a
  // warp would otherwise wait for one row's load before it asks for the next)
  constexpr int kWarpsPerTile = kFp8TileThreads / 32, kGroup = 4;
#pragma unroll 1
  for (int g = 0; g < kFp8Block / (kWarpsPerTile * kGroup); ++g) {
    float v[kGroup][4];
    FP4SIM_UNROLL
    for (int u = 0; u < kGroup; ++u)
      fp8_load4(x, a, r0 + warp + kWarpsPerTile * (g * kGroup + u), c0 + 4 * lane, v[u]);
    FP4SIM_UNROLL
    for (int u = 0; u < kGroup; ++u) {
      const int tr = warp + kWarpsPerTile * (g * kGroup + u);
      const int64_t r = r0 + tr, c = c0 + 4 * lane;
      fp8_row_chunk(a, v[u], tr, r, c, c0, lane, need_tile, row_now, tile, m);
    }
  }
  m = warp_max_nan_ignored(m);
  if (lane == 0) warp_partial[warp] = m;
  __syncthreads();
  float tile_amax = 0.0f;
  for (int w = 0; w < kFp8TileThreads / 32; ++w) tile_amax = fmax_nan_ignored(tile_amax, warp_partial[w]);
  if (threadIdx.x == 0) atomicMax(a.amax_bits, f32_bits(tile_amax));

  // row-wise 2D: rows r0.. of the input, written at (r, c0 + k), with the tile's amax
  if (a.row.codes && a.two_d) {
    float* scales = reinterpret_cast<float*>(a.row.scales);
    for (int tr = warp; tr < kFp8Block; tr += kFp8TileThreads / 32) {
      const int64_t r = r0 + tr;
      if (r >= a.rows) break;
      fp8_quantize_line(tile + tr * kFp8TilePitch, 1, a.two_d, tile_amax, a.row.codes + r * a.cols + c0,
                        scales + r * (a.cols / kFp8Block) + c0 / kFp8Block, lane);
    }
  }
  // column-wise: input column c0 + tc is written row c0 + tc, its elements r0.. at columns r0..
  // Two columns (tc, tc + 8) per warp and iteration, their loads, shuffles and stores interleaved
  // (one column's chain of shuffle, scale and store latencies would otherwise run alone).
  if (a.col.codes) {
    float* scales = reinterpret_cast<float*>(a.col.scales);
#pragma unroll 1
    for (int jj = 0; jj < kFp8Block / (2 * kWarpsPerTile); ++jj) {
      const int tc0 = warp + 2 * kWarpsPerTile * jj, tc1 = tc0 + kWarpsPerTile;
      const int64_t cc0 = c0 + tc0, cc1 = c0 + tc1;
      if (cc0 >= a.cols) break;
      const bool second = cc1 < a.cols;  // (warp-uniform; past the last column the tile holds zeros)
      float v0[kFp8Block / 32], v1[kFp8Block / 32];
      float mb0 = 0.0f, mb1 = 0.0f;
      FP4SIM_UNROLL
      for (int j = 0; j < kFp8Block / 32; ++j) {
        v0[j] = tile[(lane + 32 * j) * kFp8TilePitch + tc0];
        v1[j] = tile[(lane + 32 * j) * kFp8TilePitch + tc1];
        mb0 = fmax_nan_ignored(mb0, f32_abs(v0[j]));
        mb1 = fmax_nan_ignored(mb1, f32_abs(v1[j]));
      }
      FP4SIM_UNROLL
      for (int off = 16; off > 0; off >>= 1) {
        mb0 = fmax_nan_ignored(mb0, __shfl_xor_sync(0xFFFFFFFFu, mb0, off));
        mb1 = fmax_nan_ignored(mb1, __shfl_xor_sync(0xFFFFFFFFu, mb1, off));
      }
      const float enc0 = fp8_block_encode_scale(a.two_d ? tile_amax : mb0);
      const float enc1 = fp8_block_encode_scale(a.two_d ? tile_amax : mb1);
      uint8_t* dst0 = a.col.codes + cc0 * a.rows + r0;
      uint8_t* dst1 = a.col.codes + cc1 * a.rows + r0;
      FP4SIM_UNROLL
      for (int j = 0; j < kFp8Block / 32; ++j) {
        dst0[lane + 32 * j] = fp8_quantize_element(v0[j], enc0);
        if (second) dst1[lane + 32 * j] = fp8_quantize_element(v1[j], enc1);
      }
      if (lane == 0) {
        scales[cc0 * (a.rows / kFp8Block) + r0 / kFp8Block] = fdiv_rn(1.0f, enc0);
        if (second) scales[cc1 * (a.rows / kFp8Block) + r0 / kFp8Block] = fdiv_rn(1.0f, enc1);
      }
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

int blocks_for(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<int>(b < 65535 * 8 ? (b > 0 ? b : 1) : 65535 * 8);
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
                         QuantizedView* columnwise, cudaStream_t stream) {
  // the copies' amax is the input's (no transform): reduced once, into the row-wise copy's (or the
  // column-wise copy's) amax, then copied
  unsigned int* amax_bits = reinterpret_cast<unsigned int*>(cfg.rowwise.enabled ? rowwise->amax : columnwise->amax);
  FP4SIM_CUDA_CHECK(cudaMemsetAsync(amax_bits, 0, sizeof(float), stream));
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
  a.amax_bits = amax_bits;
  const int64_t gy = (x.rows + kFp8Block - 1) / kFp8Block, gx = (x.cols + kFp8Block - 1) / kFp8Block;
  if (gy > 65535)
    throw std::invalid_argument("quantize (cuda, fp8): tensor '" + std::string(x.name) + "' " +
                                shape_str(x.rows, x.cols) + " has too many rows for one launch");
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
  if (x.dtype == DType::F32) launch_fp8_tile<float>(grid, x.data, a, stream);
  else launch_fp8_tile<uint16_t>(grid, x.data, a, stream);
  FP4SIM_CUDA_CHECK_LAUNCH();
  if (cfg.rowwise.enabled && cfg.columnwise.enabled)
    FP4SIM_CUDA_CHECK(cudaMemcpyAsync(columnwise->amax, rowwise->amax, sizeof(float), cudaMemcpyDeviceToDevice, stream));
}

void fp8_dequantize_launch(const QuantizedView& q, const TensorView& out, cudaStream_t stream) {
  fp8_dequantize_kernel<<<blocks_for(q.rows * q.cols, 256), 256, 0, stream>>>(q, static_cast<float*>(out.data),
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
