// CUDA quantizers: the same block functions as the emulator (emu/quantize_block.hpp, emu/rht.hpp),
// so every code, scale and amax matches it bit for bit; only the data movement is GPU-specific.
//
// Two passes over the input: (1) amax (NaN ignored) of the input and, with RHT, of the transformed
// column-wise copy; (2) one pass that writes both copies. Where the amax pass kept the transform
// (the training recipe's NVFP4 1x16 RHT copies), a streaming kernel reads x and the kept transform
// without a tile; otherwise a CTA owns a 64-row x 128-column input tile in shared memory (kept in
// the input dtype): each thread quantizes 1x16 (or 1x32) blocks along rows for the row-wise copy
// and the 64-element column strip of one column for the column-wise copy, whose 32 code bytes are
// contiguous in the transposed output.
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "emu/quantize_block.hpp"
#include "emu/rht.hpp"
#include "gpu/amax_finish.cuh"
#include "gpu/cp_async.cuh"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/decode_bf16.cuh"

namespace fp4sim::gpu {
namespace {

constexpr int kTileRows = 64;
constexpr int kTileCols = 128;  // = threads per CTA
constexpr int kThreads = kTileCols;

template <class T>
struct Elem;
template <>
struct Elem<float> {
  static __device__ __forceinline__ float to_f32(float v) { return v; }
};
template <>
struct Elem<uint16_t> {  // BF16 bit pattern
  static __device__ __forceinline__ float to_f32(uint16_t v) { return bf16_to_f32(v); }
};
// The BF16 bits the RHT reads: FP32 input is rounded first, BF16 input passes through.
__device__ __forceinline__ uint16_t rht_input(float v) { return bf16_rne(v); }
__device__ __forceinline__ uint16_t rht_input(uint16_t v) { return v; }

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

// Programmatic dependent launch (sm_90 and later): the quantize pass is launched while the amax
// pass still runs (launch_quantize_pass), so its CTAs take the SMs the amax pass's last CTAs free,
// load their tiles, and only then wait (pdl_wait) for the amax pass to finish and its global amax
// to be visible. The amax passes allow that launch as soon as every CTA of theirs has started
// (pdl_allow_dependents); the quantize pass reads nothing the amax pass writes before its wait.
__device__ __forceinline__ void pdl_allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

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

// The NaN-ignoring max |v| of 16 BF16 values held as eight words (element 2q in word q's low half),
// from a tree of max.xorsign.abs.bf16x2 (per half: max(|a|, |b|), a NaN operand ignored; the sign
// bits it leaves are dropped at the end, and an all-NaN block, whose max is a NaN, gives 0 as
// amax_strided does). BF16 max is exact, so the amax is the FP32 one's value.
__device__ __forceinline__ uint32_t bf16x2_max_abs(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ float bf16x16_abs_max(const uint32_t* w) {
  const uint32_t m =
      bf16x2_max_abs(bf16x2_max_abs(bf16x2_max_abs(w[0], w[1]), bf16x2_max_abs(w[2], w[3])),
                     bf16x2_max_abs(bf16x2_max_abs(w[4], w[5]), bf16x2_max_abs(w[6], w[7])));
  const uint32_t hi = bf16x2_max_abs(m, m << 16);  // high half: the max of both halves
  return fmaxf(0.0f, fabsf(f32_from_bits(hi & 0xFFFF0000u)));
}

// One 16-row chunk of a tile column through the RHT (the amax passes): the max |y| of its outputs
// into m_rht and, with `keep`, the 16 outputs to yt_col (the column's row k * 16 of the
// transposed tile, 16-byte aligned) as two 16-byte stores; without it only max |y|
// (rht16_abs_max: one rounding a chunk instead of 16). in_amax (optional): the inputs' NaN-ignoring
// max |x|, from the same bits.
__device__ __forceinline__ void rht_chunk_amax(const uint16_t (&in)[kRhtSize], float& m_rht,
                                               bool keep, uint16_t* yt_col,
                                               float* in_amax = nullptr) {
  if (keep) {
    uint32_t w[kRhtSize / 2];
    rht16_packed(in, w, in_amax);
    m_rht = fmax_nan_ignored(m_rht, bf16x16_abs_max(w));
    uint4* dst = reinterpret_cast<uint4*>(yt_col);
    dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
    dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
  } else {
    m_rht = fmax_nan_ignored(m_rht, rht16_abs_max(in, in_amax));
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
      // (unrolled: rht16_abs_max's common path is straight-line code, so the two chunks interleave)
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

// The current device's SM count (asked each time: an attribute query, no static cache shared
// across threads or devices).
int current_device_sms() {
  int dev = 0, sms = 0;
  FP4SIM_CUDA_CHECK(cudaGetDevice(&dev));
  FP4SIM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

// CTAs of amax_rht_pipelined_kernel<T> an SM can hold (by its shared memory and registers), times
// the SMs: the persistent grid.
template <class T>
int amax_rht_pipelined_grid() {
  static int ctas = 0;  // (one device per process, as the backend assumes elsewhere)
  if (ctas == 0) {
    int dev = 0, sms = 0, per_sm = 0;
    FP4SIM_CUDA_CHECK(cudaGetDevice(&dev));
    FP4SIM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    FP4SIM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, amax_rht_pipelined_kernel<T>, kThreads, 0));
    ctas = sms * (per_sm > 0 ? per_sm : 1);
  }
  return ctas;
}

struct CopyArgs {
  bool enabled;
  bool sr;
  bool rht;
  bool four_over_six;
  uint64_t stream;
  uint8_t* codes;
  uint8_t* scales;
  const float* amax;
  uint16_t* decoded;  // QuantizedView::decoded_bf16 (null: not written)
};

struct QuantArgs {
  int64_t rows, cols, stride;
  bool vector_ok;
  bool mx;
  bool block_2d;
  bool mse;
  MxScaleRule mx_rule;
  CopyArgs row, col;
  bool col_staged;  // nvfp4_1x16_kernel (64x128 tiles): whole tiles stage the column-wise codes
                    // (host: R % 64 == 0, aligned)
  PhiloxKeys keys;  // philox_round_keys(the call's seed): every SR draw goes through sr_bits_keyed
};

// sr_bits_for_chunk's bits from the call's round keys (a.keys: the same bits, fewer instructions).
__device__ __forceinline__ SrBits sr_bits_keyed(bool enabled, const QuantArgs& a, uint64_t stream,
                                                uint64_t chunk) {
  SrBits s;
  s.enabled = enabled;
  s.bits = enabled ? sr_chunk_bits_keyed(a.keys, stream, chunk) : Philox4x32{{0, 0, 0, 0}};
  return s;
}

// One NVFP4 block of a copy written: its 8 code bytes for the 16 elements from e (the written
// tensor's row-major index of the block's first element), its scale at scale_index and, where the
// copy asks for it, its 16 decoded BF16 values (decode16_bf16) at e.
__device__ __forceinline__ void store_nvfp4_block(const CopyArgs& c, int64_t e, int64_t scale_index,
                                                  const uint8_t* packed, uint8_t s) {
  *reinterpret_cast<uint2*>(c.codes + e / 2) = *reinterpret_cast<const uint2*>(packed);
  c.scales[scale_index] = s;
  if (c.decoded) decode16_bf16(*reinterpret_cast<const uint2*>(packed), s, c.decoded + e);
}

// The recipe's common block (NVFP4 1x16, no Four Over Six), quantized and stored in one pass over
// its 16 values: nvfp4_quantize_1x16's amax, block scale, encode scale and E2M1 rounding (the
// device's e2m1_rn_magic / e2m1_rs_magic, by their step functions), and, with kDec, the decoded
// BF16 operand sign * magnitude * e4m3(s), the same bits decode16_bf16 makes from the codes (an
// exact product: its top 16 bits are its BF16), without decoding the codes again. Without kDec the
// codes come eight a word from e2m1x8_rn_scaled / e2m1x8_rs_scaled; with it they are summed into
// their word unsigned: e2m1_magic_code is steps + (mb >> 22) - 298 | sign << 3, so the word adds
// the first two terms at their nibbles (mod 2^32), subtracts 298 at every nibble once (leaving each
// nibble's code, 0..7) and then ORs the sign bits in. nvfp4_block_1x16_encode returns
// the 8 code bytes and the scale (writing only the decoded values); nvfp4_block_1x16_store stores
// them too.
template <bool kSr, bool kDec>
__device__ __forceinline__ uint2 nvfp4_block_1x16_encode(const float* v, float amax_b,
                                                         const Nvfp4Global& g, const SrBits& sr,
                                                         const CopyArgs& c, int64_t e,
                                                         uint8_t& scale) {
  const uint8_t s = nvfp4_block_scale(amax_b, g.s_enc);
  const float sv = e4m3_to_f32_nonneg(s);  // (the scale's value once: the decode needs it too)
  const float enc =
      nvfp4_encode_from_scale_value(sv, g.s_dec);  // = nvfp4_block_encode_scale(s, g.s_dec)
  if constexpr (!kDec) {  // the common cases: eight codes a word, packed together
    scale = s;
    if constexpr (kSr) {  // (element j's random byte: byte j % 4 of word j / 4,
                          // sr_byte_for_element)
      return make_uint2(e2m1x8_rs_scaled(v, enc, sr.bits.v[0], sr.bits.v[1]),
                        e2m1x8_rs_scaled(v + 8, enc, sr.bits.v[2], sr.bits.v[3]));
    }
    return make_uint2(e2m1x8_rn_scaled(v, enc), e2m1x8_rn_scaled(v + 8, enc));
  }
  uint32_t w[2] = {0u, 0u}, sgn[2] = {0u, 0u}, d[8];
  FP4SIM_UNROLL
  for (int i = 0; i < kNvfp4Block; ++i) {
    const float cl = e2m1_clamp(fmul_rn(v[i], enc));
    const uint32_t mb = e2m1_magic_bits(cl);
    const uint32_t steps =
        kSr ? e2m1_rs_steps(cl, mb, sr_byte_for_element(sr.bits, i)) : e2m1_rn_steps(cl, mb);
    float mag;  // (here, not in the decode below: ptxas then gives the FP32 streaming kernel 40
                // registers, not 48)
    if constexpr (kDec) mag = e2m1_steps_magnitude(mb, steps);
    const uint32_t sign = f32_bits(cl) & 0x80000000u;
    w[i / 8] += (steps + (mb >> 22)) << (4 * (i % 8));
    sgn[i / 8] |= sign >> (28 - 4 * (i % 8));
    if constexpr (kDec) {
      const uint32_t b = f32_bits(fmul_rn(f32_from_bits(f32_bits(mag) | sign), sv)) >> 16;
      if (i % 2 == 0)
        d[i / 2] = b;
      else
        d[i / 2] |= b << 16;
    }
  }
  constexpr uint32_t kBase = kE2M1MagicCodeBase * 0x11111111u;  // 298 off every nibble (mod 2^32)
  if constexpr (kDec) {
    uint4* out = reinterpret_cast<uint4*>(c.decoded + e);
    out[0] = make_uint4(d[0], d[1], d[2], d[3]);
    out[1] = make_uint4(d[4], d[5], d[6], d[7]);
  }
  scale = s;
  return make_uint2((w[0] - kBase) | sgn[0], (w[1] - kBase) | sgn[1]);
}
// (amax_b: the block's NaN-ignoring max |v|, amax_strided's value, which BF16 callers take from
// bf16x16_unpack)
__device__ __forceinline__ uint2 nvfp4_block_1x16_encode(const float* v, float amax_b,
                                                         const Nvfp4Global& g, const SrBits& sr,
                                                         const CopyArgs& c, int64_t e,
                                                         uint8_t& scale) {
  if (sr.enabled) {
    return c.decoded ? nvfp4_block_1x16_encode<true, true>(v, amax_b, g, sr, c, e, scale)
                     : nvfp4_block_1x16_encode<true, false>(v, amax_b, g, sr, c, e, scale);
  }
  return c.decoded ? nvfp4_block_1x16_encode<false, true>(v, amax_b, g, sr, c, e, scale)
                   : nvfp4_block_1x16_encode<false, false>(v, amax_b, g, sr, c, e, scale);
}
// amax_strided's value as a tree (depth 4, not a chain of 16: the column walks wait on it): a
// NaN-ignoring max is associative, an all-NaN block's NaN ends as 0 in the last max.
__device__ __forceinline__ float amax16(const float* v) {
  float m[kNvfp4Block / 2];
  FP4SIM_UNROLL
  for (int i = 0; i < kNvfp4Block / 2; ++i) m[i] = fmaxf(fabsf(v[2 * i]), fabsf(v[2 * i + 1]));
  FP4SIM_UNROLL
  for (int w = kNvfp4Block / 4; w >= 1; w /= 2) {
    FP4SIM_UNROLL
    for (int i = 0; i < w; ++i) m[i] = fmaxf(m[i], m[i + w]);
  }
  return fmaxf(0.0f, m[0]);
}
__device__ __forceinline__ void nvfp4_block_1x16_store(const float* v, float amax_b,
                                                       const Nvfp4Global& g, const SrBits& sr,
                                                       const CopyArgs& c, int64_t e,
                                                       int64_t scale_index) {
  uint8_t s;
  *reinterpret_cast<uint2*>(c.codes + static_cast<uint64_t>(e) / 2) =
      nvfp4_block_1x16_encode(v, amax_b, g, sr, c, e, s);
  c.scales[scale_index] = s;
}

// 16 BF16 values held as eight words (element 2q in word q's low half): their FP32 values (a shift
// or a mask each) and their NaN-ignoring amax (bf16x16_abs_max).
__device__ __forceinline__ float bf16x16_unpack(const uint32_t* w, float* v) {
  FP4SIM_UNROLL
  for (int q = 0; q < kNvfp4Block / 2; ++q) {
    v[2 * q] = f32_from_bits(w[q] << 16);
    v[2 * q + 1] = f32_from_bits(w[q] & 0xFFFF0000u);
  }
  return bf16x16_abs_max(w);
}
// A 1x16 block's FP32 values from its raw elements (FP32, or BF16 16-byte aligned) and its amax.
template <class T>
__device__ __forceinline__ float block16_values(const T* raw, float* v) {
  if constexpr (sizeof(T) == 2) {
    return bf16x16_unpack(reinterpret_cast<const uint32_t*>(raw), v);
  } else {
    FP4SIM_UNROLL
    for (int i = 0; i < kNvfp4Block; ++i) v[i] = Elem<T>::to_f32(raw[i]);
    return amax16(v);
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
          if (row_std) tile_scale[0][k][t / kNvfp4Block] = nvfp4_block_scale(m, g_row.s_enc);
          if (col_std) tile_scale[1][k][t / kNvfp4Block] = nvfp4_block_scale(m, g_col.s_enc);
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
            nvfp4_tile_scale(load, col ? g_col : g_row, ca.four_over_six, a.mse);
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
        s = mxfp4_quantize_1x32(v, a.mx_rule, sr_bits_keyed(a.row.sr, a, a.row.stream, chunk),
                                sr_bits_keyed(a.row.sr, a, a.row.stream, chunk + 1), packed);
        *reinterpret_cast<uint4*>(a.row.codes + (r * C + c) / 2) =
            *reinterpret_cast<uint4*>(packed);
        if (a.row.decoded) decode32_mx_bf16(packed, s, a.row.decoded + r * C + c);
      } else {
        const SrBits bits = sr_bits_keyed(a.row.sr, a, a.row.stream, chunk);
        if (a.block_2d) {
          s = tile_scale[0][tr / kNvfp4Block][tb];
          e2m1_encode16(v, nvfp4_block_encode_scale(s, g_row.s_dec), bits, packed);
        } else {
          s = nvfp4_quantize_1x16(v, g_row, a.row.four_over_six, a.mse, bits, packed);
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
              in[i] =
                  bf16_rne(Elem<T>::to_f32(tile[(k * block + h * kRhtSize + i) * kTileCols + t]));
            rht16(in, y);
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
          s = mxfp4_quantize_1x32(v, a.mx_rule, sr_bits_keyed(a.col.sr, a, a.col.stream, chunk),
                                  sr_bits_keyed(a.col.sr, a, a.col.stream, chunk + 1), packed);
          uint2* dst = reinterpret_cast<uint2*>(a.col.codes + (c * R + r) / 2);
          dst[0] = *reinterpret_cast<uint2*>(packed);
          dst[1] = *reinterpret_cast<uint2*>(packed + 8);
          if (a.col.decoded) decode32_mx_bf16(packed, s, a.col.decoded + c * R + r);
        } else {
          const SrBits bits = sr_bits_keyed(a.col.sr, a, a.col.stream, chunk);
          if (a.block_2d) {
            s = tile_scale[1][k][t / kNvfp4Block];
            e2m1_encode16(v, nvfp4_block_encode_scale(s, g_col.s_dec), bits, packed);
          } else {
            s = nvfp4_quantize_1x16(v, g_col, a.col.four_over_six, a.mse, bits, packed);
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
    const uint8_t s = nvfp4_block_scale(m, g.s_enc);
    const SrBits bits = sr_bits_keyed(a.row.sr, a, a.row.stream,
                                      static_cast<uint64_t>(r * (C / kSrChunk) + c0 / kSrChunk));
    e2m1_encode16(v, nvfp4_block_encode_scale(s, g.s_dec), bits, packed);
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
    const uint8_t s = nvfp4_block_scale(m, g.s_enc);
    const SrBits bits = sr_bits_keyed(a.col.sr, a, a.col.stream,
                                      static_cast<uint64_t>(cc * (R / kSrChunk) + r0 / kSrChunk));
    e2m1_encode16(v, nvfp4_block_encode_scale(s, g.s_dec), bits, packed);
    store_nvfp4_block(a.col, cc * R + r0, cc * (R / kNvfp4Block) + r0 / kNvfp4Block, packed, s);
  }
}

// Which kernel makes NVFP4 2D copies: 1 = nvfp4_2d_kernel where it applies (default), 0 = always
// the tile kernel. Same bits; the tests compare them.
int g_2d_variant = 1;

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

// Which tile shape the common-case kernel uses: 1 = 64x128 (one column per thread), 2 = 64x256
// (a BF16 column pair per thread). Both give the same bits; bench_quantize compares them.
int g_fast_cols_per_thread = 1;
bool g_col_staged = true;  // variant 1 stages whole tiles' column-wise codes (3: it does not)

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
    rht16_packed(in, w);
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

// Whether the tile quantize pass is launched early, as a programmatic dependent of the amax pass
// (set_quantize_early_launch; pdl_wait), and how many 16-byte loads amax_flat_kernel keeps in
// flight a thread (set_quantize_amax_unroll: 1 or 4).
bool g_quantize_pdl = true;
int g_amax_unroll = 4;

// nvfp4_1x16_kernel's launch: with g_quantize_pdl, allowed to start before the kernel ahead of it
// in the stream (the amax pass) has finished; the kernel waits for it before reading its amax.
// Only ever launched right after an amax pass of launch_all (every enabled copy has one): the
// kernel reads x before its wait, which is safe only because the kernel ahead of it (an ordinary
// launch) started after x's producer had finished, and does not write x.
template <class T>
void launch_quantize_pass(void (*kernel)(const T*, QuantArgs), dim3 grid, cudaStream_t stream,
                          const T* x, const QuantArgs& qa) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = g_quantize_pdl ? 1 : 0;
  FP4SIM_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, x, qa));
}

// The streaming kernel's CTAs per SM and copy (set_quantize_kept_ctas_per_sm; 0: one block a
// thread).
int g_kept_ctas_per_sm = 8;
// Whether launch_all keeps the RHT output between its passes when it has scratch for it: 1, 0, or
// kQuantizeKeepRhtAuto (FP32 input only).
int g_keep_rht = kQuantizeKeepRhtDefault;
// The RHT amax pass (set_quantize_rht_amax_variant): 0 = 64-row tiles, 1 = 32-row tiles (64 where
// more than 65535 row tiles would be needed), 2 = the pipelined kernel where the shape allows it,
// else 1 (default).
int g_rht_amax_variant = 2;

// col_partial (or null): where the pipelined RHT amax pass can take x's 64-row chunk column sums
// (an FP32 x, rows % 64 == 0), it writes them there; returns whether it did.
template <class T>
bool launch_all(const TensorView& x, const QuantizeConfig& cfg, QuantizedView* row,
                QuantizedView* col, cudaStream_t stream, DeviceScratch* rht_keep, unsigned* amax_ws,
                float* col_partial) {
  bool sums_written = false;
  const T* xp = static_cast<const T*>(x.data);
  const int64_t R = x.rows, C = x.cols, S = x.stride();
  const bool vector_ok = (reinterpret_cast<uintptr_t>(xp) % 16 == 0) &&
                         (S * static_cast<int64_t>(sizeof(T))) % 16 == 0;
  const bool row_on = cfg.rowwise.enabled, col_on = cfg.columnwise.enabled;
  const bool col_rht = col_on && cfg.columnwise.rht;
  // the common case (1x16 NVFP4, no Four Over Six) runs nvfp4_1x16_kernel, which can read the RHT
  // output the amax pass keeps; the general kernel transforms again
  const bool common_case = cfg.format != QFormat::MXFP4 && !cfg.block_2d &&
                           !cfg.rowwise.four_over_six && !cfg.columnwise.four_over_six;
  // (if the scratch cannot be had, transform twice as before rather than fail)
  uint16_t* rht_out = nullptr;
  const bool keep = g_keep_rht == kQuantizeKeepRhtAuto ? sizeof(T) == 4 : g_keep_rht != 0;
  if (col_rht && common_case && keep && rht_keep) {
    try {
      rht_out = rht_keep->get<uint16_t>(static_cast<size_t>(R * C), stream);
    } catch (const std::runtime_error&) {
      (void)cudaGetLastError();  // the failed allocation's error, not sticky
      rht_out = nullptr;
    }
  }
  // pass 1: amax (a non-RHT column-wise copy's amax is x's, written by the same pass)
  float* amax_plain = row_on ? row->amax : (col_on && !col_rht ? col->amax : nullptr);
  float* amax_plain2 = row_on && col_on && !col_rht ? col->amax : nullptr;
  float* amax_rht = col_rht ? col->amax : nullptr;
  const dim3 grid(static_cast<unsigned>((C + kTileCols - 1) / kTileCols),
                  static_cast<unsigned>((R + kTileRows - 1) / kTileRows));
  if (amax_rht || (amax_plain && (S != C || !vector_ok))) {
    if (amax_rht) {
      AmaxArgs args{amax_plain, amax_plain2, amax_rht, rht_out, amax_ws};
      if (g_rht_amax_variant == 2 && vector_ok && C % kTileCols == 0 && R % kPipeRows == 0 &&
          (C / kTileCols) * (R / kPipeRows) < (int64_t{1} << 31)) {
        const bool sums = col_partial && sizeof(T) == 4 && R % (2 * kPipeRows) == 0;
        if (sums) args.col_partial = col_partial;
        const int64_t tiles = (C / kTileCols) * (R / kPipeRows), items = sums ? tiles / 2 : tiles;
        const int ctas = amax_rht_pipelined_grid<T>();
        amax_rht_pipelined_kernel<T>
            <<<static_cast<unsigned>(items < ctas ? items : ctas), kThreads, 0, stream>>>(xp, R, C,
                                                                                          S, args);
        sums_written = sums;
      } else if (g_rht_amax_variant >= 1 && (R + 31) / 32 <= 65535) {
        const dim3 grid32(grid.x, static_cast<unsigned>((R + 31) / 32));
        amax_tile_kernel<T, true, 32>
            <<<grid32, kThreads, 0, stream>>>(xp, R, C, S, vector_ok, args);
      } else {
        amax_tile_kernel<T, true><<<grid, kThreads, 0, stream>>>(xp, R, C, S, vector_ok, args);
      }
    } else {
      amax_tile_kernel<T, false><<<grid, kThreads, 0, stream>>>(
          xp, R, C, S, vector_ok, AmaxArgs{amax_plain, amax_plain2, amax_rht, nullptr, amax_ws});
    }
    FP4SIM_CUDA_CHECK_LAUNCH();
  } else if (amax_plain) {
    const int sms = current_device_sms();
    const int64_t want = (R * C / (16 / sizeof(T)) + kThreads - 1) / kThreads;
    const int blocks = static_cast<int>(want < sms * 16 ? (want > 0 ? want : 1) : sms * 16);
    const AmaxArgs args{amax_plain, amax_plain2, nullptr, nullptr, amax_ws};
    if (g_amax_unroll == 4)
      amax_flat_kernel<T, 4><<<blocks, kThreads, 0, stream>>>(xp, R * C, args);
    else
      amax_flat_kernel<T, 1><<<blocks, kThreads, 0, stream>>>(xp, R * C, args);
    FP4SIM_CUDA_CHECK_LAUNCH();
  }
  // pass 2: both copies
  QuantArgs qa{};
  qa.rows = R;
  qa.cols = C;
  qa.stride = S;
  qa.vector_ok = vector_ok;
  qa.mx = cfg.format == QFormat::MXFP4;
  qa.block_2d = cfg.block_2d;
  qa.mse = cfg.fos_error == FourOverSixError::MSE;
  qa.mx_rule = cfg.mx_rule;
  qa.keys = philox_round_keys(cfg.seed);
  auto fill = [](CopyArgs& ca, const CopySpec& spec, QuantizedView* q) {
    ca.enabled = spec.enabled;
    ca.sr = spec.rounding == Rounding::SR;
    ca.rht = spec.rht;
    ca.four_over_six = spec.four_over_six;
    ca.stream = spec.stream;
    ca.codes = spec.enabled ? q->codes : nullptr;
    ca.scales = spec.enabled ? q->scales : nullptr;
    ca.amax = spec.enabled ? q->amax : nullptr;
    ca.decoded = spec.enabled ? q->decoded_bf16 : nullptr;
  };
  fill(qa.row, cfg.rowwise, row);
  fill(qa.col, cfg.columnwise, col);
  // (staged column-wise codes: each written row's 32-byte piece of a tile 16-byte aligned, its 4
  // scale bytes one aligned word)
  qa.col_staged = g_col_staged && qa.col.enabled && R % kTileRows == 0 &&
                  reinterpret_cast<uintptr_t>(qa.col.codes) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(qa.col.scales) % 4 == 0;
  if (common_case && rht_out) {  // RHT copy kept by the amax pass: the streaming kernel
    // (CTAs for one 1x16 block a thread, up to g_kept_ctas_per_sm an SM per copy, so each thread
    // spreads its setup, the global scales and the Philox key, over several blocks)
    int per_copy = grid_stride_blocks(R * (C / kNvfp4Block), 256);
    if (g_kept_ctas_per_sm > 0)
      per_copy = std::min(per_copy, current_device_sms() * g_kept_ctas_per_sm);
    const unsigned ctas = static_cast<unsigned>(qa.row.enabled ? 2 * per_copy : per_copy);
    if (vector_ok)
      nvfp4_rht_kept_kernel<T, true><<<ctas, 256, 0, stream>>>(xp, rht_out, qa);
    else
      nvfp4_rht_kept_kernel<T, false><<<ctas, 256, 0, stream>>>(xp, rht_out, qa);
  } else if (common_case) {
    const bool rht = qa.col.enabled && qa.col.rht;
    bool launched = false;
    if constexpr (sizeof(T) == 2) {
      if (g_fast_cols_per_thread == 2) {
        const dim3 fg(static_cast<unsigned>((C + 2 * kThreads - 1) / (2 * kThreads)), grid.y);
        if (rht)
          launch_quantize_pass(nvfp4_1x16_kernel<T, true, 2>, fg, stream, xp, qa);
        else
          launch_quantize_pass(nvfp4_1x16_kernel<T, false, 2>, fg, stream, xp, qa);
        launched = true;
      }
    }
    if (!launched) {
      if (rht)
        launch_quantize_pass(nvfp4_1x16_kernel<T, true, 1>, grid, stream, xp, qa);
      else
        launch_quantize_pass(nvfp4_1x16_kernel<T, false, 1>, grid, stream, xp, qa);
    }
  } else if (g_2d_variant == 1 && cfg.format == QFormat::NVFP4 && cfg.block_2d &&
             !qa.row.four_over_six && !qa.col.four_over_six && !(qa.col.enabled && qa.col.rht) &&
             R % kNvfp4Block == 0 && C % kNvfp4Block == 0 && vector_ok) {
    const int64_t blocks = (R / kNvfp4Block) * (C / kNvfp4Block);
    nvfp4_2d_kernel<T><<<static_cast<unsigned>((blocks + k2dBlocksPerCta - 1) / k2dBlocksPerCta),
                         k2dThreads, 0, stream>>>(xp, qa);
  } else if (qa.mx) {
    quantize_tile_kernel<T, true><<<grid, kThreads, 0, stream>>>(xp, qa);
  } else {
    quantize_tile_kernel<T, false><<<grid, kThreads, 0, stream>>>(xp, qa);
  }
  FP4SIM_CUDA_CHECK_LAUNCH();
  return sums_written;
}

void check_view(const QuantizedView* q, int64_t rows, int64_t cols, const QuantizeConfig& cfg,
                const CopySpec& spec, const char* which) {
  if (!q || q->rows != rows || q->cols != cols || q->format != cfg.format ||
      q->four_over_six != spec.four_over_six || q->device != Device::Cuda)
    throw std::invalid_argument(std::string("quantize (cuda): the ") + which +
                                " output must be a device view of the written shape " +
                                shape_str(rows, cols) + " with matching format and options");
}

__global__ void dequantize_kernel(QuantizedView q, float* out, int64_t out_stride) {
  const int64_t n = q.rows * q.cols;
  const int64_t block = q.block();
  const float range = q.four_over_six ? kFourOverSixRange : kNvfp4Range;
  const float amax = *q.amax;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / q.cols, c = e % q.cols;
    const uint8_t s = q.scales[r * (q.cols / block) + c / block];
    const float factor =
        q.format == QFormat::MXFP4 ? ue8m0_to_f32(s) : nvfp4_decode_factor(s, amax, range);
    const uint8_t code = (q.codes[e / 2] >> (4 * (e & 1))) & 0xFu;
    out[r * out_stride + c] = decode_element(code, factor);
  }
}

// Quantization statistics (emu/quant_stats.hpp): one thread per block, then one per row adding
// its blocks in order, so the sums are the emulator's bit for bit.
__global__ void quant_error_blocks_kernel(const float* x, QuantizedView q,
                                          QuantErrorSums* block_sums) {
  const int64_t per_row = q.cols / q.block(), n = q.rows * per_row;
  const float amax = *q.amax;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    block_sums[i] = quant_block_error(x, q.codes, q.scales, i / per_row, i % per_row, q.cols,
                                      q.format, q.four_over_six, amax);
}

__global__ void quant_error_rows_kernel(const QuantErrorSums* block_sums, int64_t rows,
                                        int64_t per_row, QuantErrorSums* rows_out) {
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    QuantErrorSums s;
    for (int64_t b = 0; b < per_row; ++b) add_error_sums(s, block_sums[r * per_row + b]);
    rows_out[r] = s;
  }
}

__global__ void scales_to_tiled_kernel(const uint8_t* scales, int64_t rows, int64_t k_blocks,
                                       uint8_t* out, int64_t padded_rows, int64_t padded_k) {
  const int64_t n = padded_rows * padded_k;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / padded_k, c = i % padded_k;
    out[tiled_scale_offset(r, c, k_blocks)] =
        (r < rows && c < k_blocks) ? scales[r * k_blocks + c] : uint8_t(0);
  }
}

}  // namespace

void set_quantize_tile_variant(int variant) {
  if (variant < 1 || variant > 3)
    throw std::invalid_argument(
        "quantize tile variant must be 1 (64x128), 2 (64x256) or 3 (64x128, direct column stores)");
  g_fast_cols_per_thread = variant == 2 ? 2 : 1;
  g_col_staged = variant != 3;
}

void set_quantize_keep_rht(int keep) {
  if (keep != 0 && keep != 1 && keep != kQuantizeKeepRhtAuto)
    throw std::invalid_argument("set_quantize_keep_rht: " + std::to_string(keep) +
                                " is not 0, 1 or kQuantizeKeepRhtAuto");
  g_keep_rht = keep;
}
void set_quantize_early_launch(bool early) { g_quantize_pdl = early; }
void set_quantize_amax_unroll(int loads) {
  if (loads != 1 && loads != 4)
    throw std::invalid_argument("amax unroll must be 1 or 4, not " + std::to_string(loads));
  g_amax_unroll = loads;
}
void set_quantize_kept_ctas_per_sm(int ctas) {
  if (ctas < 0)
    throw std::invalid_argument("set_quantize_kept_ctas_per_sm: " + std::to_string(ctas) + " < 0");
  g_kept_ctas_per_sm = ctas;
}

void set_quantize_rht_amax_variant(int variant) {
  if (variant < 0 || variant > 2)
    throw std::invalid_argument(
        "RHT amax pass variant must be 0 (64-row tiles), 1 (32-row tiles) or 2 (pipelined)");
  g_rht_amax_variant = variant;
}

void set_quantize_2d_variant(int variant) {
  if (variant != 0 && variant != 1)
    throw std::invalid_argument("2D quantize variant must be 0 (tile) or 1 (half-warp blocks)");
  g_2d_variant = variant;
}

bool quantize_launch(const TensorView& x, const QuantizeConfig& cfg, QuantizedView* rowwise,
                     QuantizedView* columnwise, cudaStream_t stream, unsigned* amax_ws,
                     DeviceScratch* rht_keep, float* column_partial) {
  if (!amax_ws) throw std::logic_error("quantize_launch: no amax workspace");
  if (x.device != Device::Cuda)
    throw std::invalid_argument(std::string("quantize (cuda): tensor '") + x.name +
                                "' is not in device memory");
  if (cfg.rowwise.enabled) check_view(rowwise, x.rows, x.cols, cfg, cfg.rowwise, "row-wise");
  if (cfg.columnwise.enabled)
    check_view(columnwise, x.cols, x.rows, cfg, cfg.columnwise, "column-wise");
  if ((x.rows + kTileRows - 1) / kTileRows >
      65535)  // (the 32-row RHT amax pass falls back to 64 rows)
    throw std::invalid_argument("quantize (cuda): too many rows for one launch: " +
                                shape_str(x.rows, x.cols));
  if (x.dtype == DType::F32)
    return launch_all<float>(x, cfg, rowwise, columnwise, stream, rht_keep, amax_ws,
                             column_partial);
  return launch_all<uint16_t>(x, cfg, rowwise, columnwise, stream, rht_keep, amax_ws,
                              column_partial);
}

void dequantize_launch(const QuantizedView& q, const TensorView& out, cudaStream_t stream) {
  const int64_t n = q.rows * q.cols;
  dequantize_kernel<<<grid_stride_blocks(n, 256), 256, 0, stream>>>(
      q, static_cast<float*>(out.data), out.stride());
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void quant_error_rows_launch(const float* x, const QuantizedView& q, QuantErrorSums* block_sums,
                             QuantErrorSums* rows_out, cudaStream_t stream) {
  if (q.rows == 0) return;
  quant_error_blocks_kernel<<<grid_stride_blocks(q.scale_count(), 256), 256, 0, stream>>>(
      x, q, block_sums);
  FP4SIM_CUDA_CHECK_LAUNCH();
  quant_error_rows_kernel<<<grid_stride_blocks(q.rows, 128), 128, 0, stream>>>(
      block_sums, q.rows, q.cols / q.block(), rows_out);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void scales_to_tiled_launch(const uint8_t* scales, int64_t rows, int64_t k_blocks, uint8_t* out,
                            cudaStream_t stream) {
  const int64_t pr = round_up(rows, kTiledRows), pk = round_up(k_blocks, kTiledCols);
  scales_to_tiled_kernel<<<grid_stride_blocks(pr * pk, 256), 256, 0, stream>>>(
      scales, rows, k_blocks, out, pr, pk);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

}  // namespace fp4sim::gpu
