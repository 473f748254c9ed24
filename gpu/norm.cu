// LayerNorm and RMSNorm, forward and backward, and a residual add fused into the LayerNorm: the
// CUDA twins of emu/norm.hpp (a row-in-registers path for the models' shapes, a general one for the
// rest), their BF16-storage variants and CudaBackend's methods.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "emu/fused.hpp"
#include "emu/op_checks.hpp"
#include "gpu/block_reduce.cuh"
#include "gpu/column_sums.cuh"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/formats_device.cuh"
#include "gpu/layers_state.hpp"
#include "gpu/op_checks.hpp"
#include "gpu/training_ops.cuh"

namespace fp4sim::gpu {

namespace {

// The emulator's default (emu/norm.hpp): the Backend interface does not pass it.
constexpr float kNormEps = 1e-5f;

// o[i] = the stored value of v: FP32 (stored), or BF16 bits (the rounding is the storage;
// round_bf16 implied).
__device__ __forceinline__ void put_stored(float* o, int64_t i, float v, bool round_bf16) {
  o[i] = stored(v, round_bf16);
}
__device__ __forceinline__ void put_stored(uint16_t* o, int64_t i, float v, bool) {
  o[i] = bf16_rne_cvt(v);
}

// The general path of the norms (any C, any alignment): the kernels below, one block per row, and
// the partial column-sum kernels. The row-in-registers kernels after them take the shapes of the
// models (C % 4 == 0, C <= 1024, aligned rows) with the same per-element expressions.

// One block per row n. mean and variance: each thread sums its strided elements in increasing
// index order, then block_sum (fixed tree), FP32 RN; var = sum((x - mean)^2) / C (two passes, as
// the emulator); rstd = 1 / sqrt(var + eps) (IEEE sqrt and division).
// out (N,C) = ((rstd * (x - mean)) * weight) + bias, each step RN (the emulator's order).
// Agreement with the emulator: bounded (the row sums are a tree, not sequential).
// OutT: float, or uint16_t for BF16 bits (Backend::layernorm_forward_bf16).
template <class OutT>
__global__ void layernorm_forward_kernel(OutT* out, float* mean, float* rstd, const float* inp,
                                         const float* weight, const float* bias, int64_t C,
                                         float c_f32, float eps, bool round_bf16) {
  const int64_t n = blockIdx.x;
  const float* x = inp + n * C;
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) s = __fadd_rn(s, x[i]);
  const float m = __fdiv_rn(block_sum(s), c_f32);
  float v = 0.0f;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const float d = __fsub_rn(x[i], m);
    v = __fadd_rn(v, __fmul_rn(d, d));
  }
  v = __fdiv_rn(block_sum(v), c_f32);
  const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(v, eps)));
  OutT* o = out + n * C;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x)
    put_stored(o, i, __fadd_rn(__fmul_rn(__fmul_rn(r, __fsub_rn(x[i], m)), weight[i]), bias[i]),
               round_bf16);
  if (threadIdx.x == 0) {
    mean[n] = m;
    rstd[n] = r;
  }
}

// dinp (N,C) += ((dnorm - mean(dnorm)) - norm * mean(dnorm * norm)) * rstd, norm = (x - mean) *
// rstd, dnorm = weight * dout. One block per row; the two row means are block_sum trees (FP32)
// divided by C. Bounded against the emulator (tree vs sequential row sums).
// DT: float, or uint16_t for dout kept as BF16 bits (Backend::layernorm_backward_bits; read
// widened, bf16_dout then a no-op).
template <class DT>
__global__ void layernorm_backward_dinp_kernel(float* dinp, const DT* dout, const float* inp,
                                               const float* weight, const float* mean,
                                               const float* rstd, int64_t C, float c_f32,
                                               bool round_bf16, bool bf16_dout) {
  const int64_t n = blockIdx.x;
  const float* x = inp + n * C;
  const DT* dy = dout + n * C;
  float* dx = dinp + n * C;
  const float m = mean[n], s = rstd[n];
  float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const float norm = __fmul_rn(__fsub_rn(x[i], m), s);
    const float dnorm = __fmul_rn(weight[i], read_dout(load_f32(dy, i), bf16_dout));
    dnorm_sum = __fadd_rn(dnorm_sum, dnorm);
    dnorm_norm_sum = __fadd_rn(dnorm_norm_sum, __fmul_rn(dnorm, norm));
  }
  const float dnorm_mean = __fdiv_rn(block_sum(dnorm_sum), c_f32);
  const float dnorm_norm_mean = __fdiv_rn(block_sum(dnorm_norm_sum), c_f32);
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const float norm = __fmul_rn(__fsub_rn(x[i], m), s);
    const float dnorm = __fmul_rn(weight[i], read_dout(load_f32(dy, i), bf16_dout));
    dx[i] = stored(__fadd_rn(dx[i], __fmul_rn(__fsub_rn(__fsub_rn(dnorm, dnorm_mean),
                                                        __fmul_rn(norm, dnorm_norm_mean)),
                                              s)),
                   round_bf16);
  }
}

// Partial column sums for dweight (sum_n norm * dout) and dbias (sum_n dout): partial (2, chunks,
// C), chunk 0 starting from the current dweight/dbias (the emulator accumulates straight into
// them), the others from +0. grid (chunks, ceil(C / blockDim)), one thread per column.
template <class DT>
__global__ void layernorm_backward_partial_kernel(float* partial, const float* dweight,
                                                  const float* dbias, const DT* dout,
                                                  const float* inp, const float* mean,
                                                  const float* rstd, int64_t N, int64_t C,
                                                  bool bf16_dout) {
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t k = blockIdx.x, chunks = gridDim.x;
  const int64_t n0 = k * kColumnChunkRows,
                n1 = n0 + kColumnChunkRows < N ? n0 + kColumnChunkRows : N;
  float w = k == 0 ? dweight[c] : 0.0f, b = k == 0 ? dbias[c] : 0.0f;
  for (int64_t n = n0; n < n1; ++n) {
    const float dy = read_dout(load_f32(dout, n * C + c), bf16_dout);
    const float norm = __fmul_rn(__fsub_rn(inp[n * C + c], mean[n]), rstd[n]);
    b = __fadd_rn(b, dy);
    w = __fadd_rn(w, __fmul_rn(norm, dy));
  }
  partial[k * C + c] = w;
  partial[(chunks + k) * C + c] = b;
}

// One block per row: ms = block_sum(x * x) / C (FP32 tree), rstd = 1 / sqrt(ms + eps);
// out (N,C) = (x * rstd) * weight. Bounded against the emulator.
template <class OutT>
__global__ void rmsnorm_forward_kernel(OutT* out, float* rstd, const float* inp,
                                       const float* weight, int64_t C, float c_f32, float eps,
                                       bool round_bf16) {
  const int64_t n = blockIdx.x;
  const float* x = inp + n * C;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) ss = __fadd_rn(ss, __fmul_rn(x[i], x[i]));
  const float ms = __fdiv_rn(block_sum(ss), c_f32);
  const float s = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, eps)));
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x)
    put_stored(out, n * C + i, __fmul_rn(__fmul_rn(x[i], s), weight[i]), round_bf16);
  if (threadIdx.x == 0) rstd[n] = s;
}

// dinp (N,C) += (dout * weight) * rstd - x * k, k = (((dot * rstd) * rstd) * rstd) / C,
// dot = sum_i (dout * weight) * x (block_sum tree, FP32). Bounded against the emulator.
template <class DT>
__global__ void rmsnorm_backward_dinp_kernel(float* dinp, const DT* dout, const float* inp,
                                             const float* weight, const float* rstd, int64_t C,
                                             float c_f32, bool round_bf16, bool bf16_dout) {
  const int64_t n = blockIdx.x;
  const float* x = inp + n * C;
  const DT* dy = dout + n * C;
  const float s = rstd[n];
  float dot = 0.0f;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x)
    dot = __fadd_rn(dot,
                    __fmul_rn(__fmul_rn(read_dout(load_f32(dy, i), bf16_dout), weight[i]), x[i]));
  dot = block_sum(dot);
  const float k = __fdiv_rn(__fmul_rn(__fmul_rn(__fmul_rn(dot, s), s), s), c_f32);
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const float dyw = __fmul_rn(read_dout(load_f32(dy, i), bf16_dout), weight[i]);
    dinp[n * C + i] = stored(
        __fadd_rn(dinp[n * C + i], __fsub_rn(__fmul_rn(dyw, s), __fmul_rn(x[i], k))), round_bf16);
  }
}

// Partial column sums for dweight: sum_n (dout * x) * rstd; partial (chunks, C), chunk 0
// starting from the current dweight.
template <class DT>
__global__ void rmsnorm_backward_partial_kernel(float* partial, const float* dweight,
                                                const DT* dout, const float* inp, const float* rstd,
                                                int64_t N, int64_t C, bool bf16_dout) {
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t k = blockIdx.x;
  const int64_t n0 = k * kColumnChunkRows,
                n1 = n0 + kColumnChunkRows < N ? n0 + kColumnChunkRows : N;
  float w = k == 0 ? dweight[c] : 0.0f;
  for (int64_t n = n0; n < n1; ++n)
    w = __fadd_rn(
        w, __fmul_rn(__fmul_rn(read_dout(load_f32(dout, n * C + c), bf16_dout), inp[n * C + c]),
                     rstd[n]));
  partial[k * C + c] = w;
}

// ---- layernorm / rmsnorm: the row in registers ------------------------------------------------
//
// The norms' fast path, taken when C % 4 == 0, C <= kNormMaxC and inp, weight, bias and dinp are
// 16-byte aligned: a rule on C and those pointers alone (never N, out or dout), so an op and its
// BF16-bits twin take the same path and compute the same bits. The per-element expressions are
// the kernels' above, every step RN; only the trees of the row sums differ (each a function of C
// alone, stated on each kernel; bounded against the emulator). The column sums are the partial
// kernels' very additions (bitwise). out and dout move four elements an access where their own
// alignment allows and one at a time otherwise: the same values either way.
constexpr int kNormMaxQuadsPerLane = 8;                       // float4 a lane
constexpr int64_t kNormMaxC = 32 * 4 * kNormMaxQuadsPerLane;  // 1024
constexpr int kNormRowWarps = 8;                              // rows a block at once, a warp each

// Four consecutive elements as FP32 (16-byte aligned: one shared-memory access).
struct alignas(16) F32x4 {
  float v[4];
};

// p[i..i+3] (i a multiple of 4) as FP32: one access when `vec` (p aligned to four elements), else
// four.
__device__ __forceinline__ F32x4 load_f32x4(const float* p, int64_t i, bool vec) {
  if (vec) {
    const float4 f = *reinterpret_cast<const float4*>(p + i);
    return {{f.x, f.y, f.z, f.w}};
  }
  return {{p[i], p[i + 1], p[i + 2], p[i + 3]}};
}
__device__ __forceinline__ F32x4 load_f32x4(const uint16_t* p, int64_t i, bool vec) {
  const ushort4 h = vec ? *reinterpret_cast<const ushort4*>(p + i)
                        : make_ushort4(p[i], p[i + 1], p[i + 2], p[i + 3]);
  return {{bf16_to_f32(h.x), bf16_to_f32(h.y), bf16_to_f32(h.z), bf16_to_f32(h.w)}};
}
// o[i..i+3] = put_stored's values of q, in one access when `vec`, else four.
__device__ __forceinline__ void put_stored_x4(float* o, int64_t i, const F32x4& q, bool round_bf16,
                                              bool vec) {
  const float4 s = make_float4(stored(q.v[0], round_bf16), stored(q.v[1], round_bf16),
                               stored(q.v[2], round_bf16), stored(q.v[3], round_bf16));
  if (vec) {
    *reinterpret_cast<float4*>(o + i) = s;
  } else {
    o[i] = s.x;
    o[i + 1] = s.y;
    o[i + 2] = s.z;
    o[i + 3] = s.w;
  }
}
__device__ __forceinline__ void put_stored_x4(uint16_t* o, int64_t i, const F32x4& q, bool,
                                              bool vec) {
  const ushort4 h = make_ushort4(bf16_rne_cvt(q.v[0]), bf16_rne_cvt(q.v[1]), bf16_rne_cvt(q.v[2]),
                                 bf16_rne_cvt(q.v[3]));
  if (vec) {
    *reinterpret_cast<ushort4*>(o + i) = h;
  } else {
    o[i] = h.x;
    o[i + 1] = h.y;
    o[i + 2] = h.z;
    o[i + 3] = h.w;
  }
}

// Row n of inp in a warp's registers: lane l holds the quads (4 columns each) l, l + 32, ..., up
// to kQuads of them; those from C / 4 on are +0 and take part in no sum.
template <int kQuads>
__device__ __forceinline__ void load_row_quads(F32x4 (&x)[kQuads], const float* row, int64_t C,
                                               int lane) {
#pragma unroll
  for (int q = 0; q < kQuads; ++q) {
    const int64_t j = lane + 32 * q;
    x[q] = j < C / 4 ? load_f32x4(row, 4 * j, true) : F32x4{};
  }
}

// A residual add fused in front of a norm (residual_layernorm_forward_bf16): out (N,C) = stored(a +
// b16's values, round_bf16), residual_forward_bf16's expression, the norm's input. out null: none.
struct ResidualIn {
  float* out = nullptr;
  const float* a = nullptr;
  const uint16_t* b16 = nullptr;
  bool round_bf16 = false;
};

// LayerNorm forward, a warp a row, the row in registers (load_row_quads). mean: each lane adds its
// elements in increasing column order to +0, then warp_sum; var: the same tree over (x - mean)^2
// (two passes, as the emulator); rstd = 1 / sqrt(var / C + eps). out (N,C) = ((rstd * (x - mean))
// * weight) + bias, each step RN. Bounded against the emulator (tree vs sequential row sums).
// Block: kNormRowWarps warps (rows); grid: ceil(N / kNormRowWarps). OutT: float or BF16 bits.
template <class OutT, int kQuads>
__global__ void __launch_bounds__(kNormRowWarps * 32)
    layernorm_forward_rows_kernel(OutT* out, float* mean, float* rstd, const float* inp,
                                  const float* weight, const float* bias, int64_t N, int64_t C,
                                  float c_f32, float eps, bool round_bf16, bool out_vec,
                                  ResidualIn res = {}) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kNormRowWarps + (threadIdx.x >> 5);
  if (n >= N) return;  // (a whole warp)
  F32x4 x[kQuads];
  if (res.out) {  // the row is residual_forward_bf16's: stored(a + b16), written to res.out, then
                  // normalized
#pragma unroll
    for (int q = 0; q < kQuads; ++q) {
      const int64_t j = lane + 32 * q;
      if (j >= C / 4) {
        x[q] = F32x4{};
        continue;
      }
      const F32x4 u = load_f32x4(res.a + n * C, 4 * j, true),
                  w = load_f32x4(res.b16 + n * C, 4 * j, true);
#pragma unroll
      for (int e = 0; e < 4; ++e) x[q].v[e] = stored(__fadd_rn(u.v[e], w.v[e]), res.round_bf16);
      *reinterpret_cast<float4*>(res.out + n * C + 4 * j) =
          make_float4(x[q].v[0], x[q].v[1], x[q].v[2], x[q].v[3]);
    }
  } else {
    load_row_quads(x, inp + n * C, C, lane);
  }
  float s = 0.0f;
#pragma unroll
  for (int q = 0; q < kQuads; ++q)
    if (lane + 32 * q < C / 4)
#pragma unroll
      for (int e = 0; e < 4; ++e) s = __fadd_rn(s, x[q].v[e]);
  const float m = __fdiv_rn(warp_sum(s), c_f32);
  float v = 0.0f;
#pragma unroll
  for (int q = 0; q < kQuads; ++q)
    if (lane + 32 * q < C / 4)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float d = __fsub_rn(x[q].v[e], m);
        v = __fadd_rn(v, __fmul_rn(d, d));
      }
  v = __fdiv_rn(warp_sum(v), c_f32);
  const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(v, eps)));
#pragma unroll
  for (int q = 0; q < kQuads; ++q) {
    const int64_t j = lane + 32 * q;
    if (j >= C / 4) continue;
    const F32x4 w = load_f32x4(weight, 4 * j, true), b = load_f32x4(bias, 4 * j, true);
    F32x4 o;
#pragma unroll
    for (int e = 0; e < 4; ++e)
      o.v[e] = __fadd_rn(__fmul_rn(__fmul_rn(r, __fsub_rn(x[q].v[e], m)), w.v[e]), b.v[e]);
    put_stored_x4(out + n * C, 4 * j, o, round_bf16, out_vec);
  }
  if (lane == 0) {
    mean[n] = m;
    rstd[n] = r;
  }
}

// RMSNorm forward, laid out as layernorm_forward_rows_kernel: ms = (sum of x * x: each lane in
// column order from +0, then warp_sum) / C, rstd = 1 / sqrt(ms + eps); out (N,C) = (x * rstd) *
// weight. Bounded against the emulator.
template <class OutT, int kQuads>
__global__ void __launch_bounds__(kNormRowWarps * 32)
    rmsnorm_forward_rows_kernel(OutT* out, float* rstd, const float* inp, const float* weight,
                                int64_t N, int64_t C, float c_f32, float eps, bool round_bf16,
                                bool out_vec) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kNormRowWarps + (threadIdx.x >> 5);
  if (n >= N) return;  // (a whole warp)
  F32x4 x[kQuads];
  load_row_quads(x, inp + n * C, C, lane);
  float ss = 0.0f;
#pragma unroll
  for (int q = 0; q < kQuads; ++q)
    if (lane + 32 * q < C / 4)
#pragma unroll
      for (int e = 0; e < 4; ++e) ss = __fadd_rn(ss, __fmul_rn(x[q].v[e], x[q].v[e]));
  const float ms = __fdiv_rn(warp_sum(ss), c_f32);
  const float s = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, eps)));
#pragma unroll
  for (int q = 0; q < kQuads; ++q) {
    const int64_t j = lane + 32 * q;
    if (j >= C / 4) continue;
    const F32x4 w = load_f32x4(weight, 4 * j, true);
    F32x4 o;
#pragma unroll
    for (int e = 0; e < 4; ++e) o.v[e] = __fmul_rn(__fmul_rn(x[q].v[e], s), w.v[e]);
    put_stored_x4(out + n * C, 4 * j, o, round_bf16, out_vec);
  }
  if (lane == 0) rstd[n] = s;
}

// The backward kernels below: one block of kNormRowWarps warps per chunk k of kColumnChunkRows
// rows (the column sums' chunking). The chunk's rows go kNormRowWarps at a time, a warp a row, the
// row's x, dout and dinp in registers as in the forward kernels (load_row_quads; the row sums are
// the forward's tree: each lane in column order from +0, then warp_sum), and each row's column-sum
// terms go to shared memory; after a barrier, thread t < C / 4 adds those of its quad of columns
// to its running sums, the group's rows in increasing order, so every column sum is the sequential
// one of the partial kernels; a second barrier frees the terms for the next group. (Prefetching
// later rows to L2 made it slower on an H200.) Block: kNormRowWarps * 32 threads, two blocks an
// SM; dynamic shared memory norm_terms_bytes; grid: chunks.

// LayerNorm backward, fused. dinp (N,C) += ((dnorm - mean(dnorm)) - norm * mean(dnorm * norm)) *
// rstd, norm = (x - mean) * rstd, dnorm = weight * dout, each step RN (bounded: the row sums'
// tree). partial_w / partial_b (chunks, C): sums over the chunk's rows, increasing, of norm * dout
// and of dout, chunk 0 starting from dweight / dbias and the others from +0: the additions of
// layernorm_backward_partial_kernel, bitwise (with one chunk, partial_w / partial_b may be dweight
// / dbias themselves: each thread reads its columns before it writes them).
template <class DT, int kQuads>
__global__ void __launch_bounds__(kNormRowWarps * 32, 2)
    layernorm_backward_chunk_kernel(float* dinp, float* partial_w, float* partial_b,
                                    const float* dweight, const float* dbias, const DT* dout,
                                    const float* inp, const float* weight, const float* mean,
                                    const float* rstd, int64_t N, int64_t C, float c_f32,
                                    bool round_bf16, bool bf16_dout, bool dout_vec) {
  extern __shared__ F32x4
      terms[];  // [2][kNormRowWarps][C / 4]: norm * dout and dout of the group's rows
  const int t = static_cast<int>(threadIdx.x), lane = t & 31, warp = t >> 5;
  const int cols = static_cast<int>(C), quads = cols / 4;
  const int64_t k = blockIdx.x, n0 = k * kColumnChunkRows;
  const int rows = static_cast<int>(N - n0 < kColumnChunkRows ? N - n0 : kColumnChunkRows);
  // the chunk's rows: offsets below rows * C <= kColumnChunkRows * kNormMaxC fit an int
  const float* x_chunk = inp + n0 * C;
  const DT* dy_chunk = dout + n0 * C;
  float* dx_chunk = dinp + n0 * C;
  F32x4* nd_terms = terms;
  F32x4* dy_terms = terms + kNormRowWarps * quads;
  F32x4 col_w{}, col_b{};
  if (k == 0 && t < quads) {
    col_w = load_f32x4(dweight, 4 * t, false);
    col_b = load_f32x4(dbias, 4 * t, false);
  }
  for (int g = 0; g < rows; g += kNormRowWarps) {
    const int r = g + warp;
    if (r < rows) {
      F32x4 norm[kQuads], dy[kQuads], dx_row[kQuads];
      load_row_quads(norm, x_chunk + r * cols, C, lane);
#pragma unroll
      for (int q = 0; q < kQuads; ++q) {
        const int j = lane + 32 * q;
        if (j >= quads) break;
        dy[q] = load_f32x4(dy_chunk, r * cols + 4 * j, dout_vec);
        dx_row[q] = load_f32x4(dx_chunk, r * cols + 4 * j, true);
      }
      const float m = mean[n0 + r], s = rstd[n0 + r];
      float a = 0.0f, b = 0.0f;
#pragma unroll
      for (int q = 0; q < kQuads; ++q) {
        const int j = lane + 32 * q;
        if (j >= quads) break;
        const F32x4 w = load_f32x4(weight, 4 * j, true);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          norm[q].v[e] = __fmul_rn(__fsub_rn(norm[q].v[e], m), s);
          dy[q].v[e] = read_dout(dy[q].v[e], bf16_dout);
          const float dnorm = __fmul_rn(w.v[e], dy[q].v[e]);
          a = __fadd_rn(a, dnorm);
          b = __fadd_rn(b, __fmul_rn(dnorm, norm[q].v[e]));
        }
      }
      const float dnorm_mean = __fdiv_rn(warp_sum(a), c_f32),
                  dnorm_norm_mean = __fdiv_rn(warp_sum(b), c_f32);
#pragma unroll
      for (int q = 0; q < kQuads; ++q) {
        const int j = lane + 32 * q;
        if (j >= quads) break;
        const F32x4 w = load_f32x4(weight, 4 * j, true);
        F32x4& dx = dx_row[q];
        F32x4 nd;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float dnorm = __fmul_rn(w.v[e], dy[q].v[e]);
          dx.v[e] = stored(
              __fadd_rn(dx.v[e], __fmul_rn(__fsub_rn(__fsub_rn(dnorm, dnorm_mean),
                                                     __fmul_rn(norm[q].v[e], dnorm_norm_mean)),
                                           s)),
              round_bf16);
          nd.v[e] = __fmul_rn(norm[q].v[e], dy[q].v[e]);
        }
        put_stored_x4(dx_chunk, r * cols + 4 * j, dx, false, true);
        nd_terms[warp * quads + j] = nd;
        dy_terms[warp * quads + j] = dy[q];
      }
    }
    __syncthreads();
    if (t < quads) {
      const int group_rows = rows - g < kNormRowWarps ? rows - g : kNormRowWarps;
      for (int i = 0; i < group_rows; ++i) {
        const F32x4 nd = nd_terms[i * quads + t], d = dy_terms[i * quads + t];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          col_b.v[e] = __fadd_rn(col_b.v[e], d.v[e]);
          col_w.v[e] = __fadd_rn(col_w.v[e], nd.v[e]);
        }
      }
    }
    __syncthreads();  // (the next group's rows overwrite the terms)
  }
  if (t < quads) {
    put_stored_x4(partial_w, k * C + 4 * t, col_w, false, false);
    put_stored_x4(partial_b, k * C + 4 * t, col_b, false, false);
  }
}

// RMSNorm backward, fused, laid out as layernorm_backward_chunk_kernel. dinp (N,C) += (dout *
// weight) * rstd - x * kk, kk = (((dot * rstd) * rstd) * rstd) / C, dot = sum of (dout * weight) *
// x (the row sums' tree; bounded). partial_w (chunks, C): sums over the chunk's rows, increasing,
// of (dout * x) * rstd, chunk 0 starting from dweight, the others from +0: the additions of
// rmsnorm_backward_partial_kernel, bitwise (partial_w may be dweight itself with one chunk).
template <class DT, int kQuads>
__global__ void __launch_bounds__(kNormRowWarps * 32, 2)
    rmsnorm_backward_chunk_kernel(float* dinp, float* partial_w, const float* dweight,
                                  const DT* dout, const float* inp, const float* weight,
                                  const float* rstd, int64_t N, int64_t C, float c_f32,
                                  bool round_bf16, bool bf16_dout, bool dout_vec) {
  extern __shared__ F32x4 terms[];  // [kNormRowWarps][C / 4]: (dout * x) * rstd of the group's rows
  const int t = static_cast<int>(threadIdx.x), lane = t & 31, warp = t >> 5;
  const int cols = static_cast<int>(C), quads = cols / 4;
  const int64_t k = blockIdx.x, n0 = k * kColumnChunkRows;
  const int rows = static_cast<int>(N - n0 < kColumnChunkRows ? N - n0 : kColumnChunkRows);
  const float* x_chunk = inp + n0 * C;
  const DT* dy_chunk = dout + n0 * C;
  float* dx_chunk = dinp + n0 * C;
  F32x4 col_w{};
  if (k == 0 && t < quads) col_w = load_f32x4(dweight, 4 * t, false);
  for (int g = 0; g < rows; g += kNormRowWarps) {
    const int r = g + warp;
    if (r < rows) {
      F32x4 x[kQuads], dy[kQuads], dx_row[kQuads];
      load_row_quads(x, x_chunk + r * cols, C, lane);
#pragma unroll
      for (int q = 0; q < kQuads; ++q) {
        const int j = lane + 32 * q;
        if (j >= quads) break;
        dy[q] = load_f32x4(dy_chunk, r * cols + 4 * j, dout_vec);
        dx_row[q] = load_f32x4(dx_chunk, r * cols + 4 * j, true);
      }
      const float s = rstd[n0 + r];
      float dot = 0.0f;
#pragma unroll
      for (int q = 0; q < kQuads; ++q) {
        const int j = lane + 32 * q;
        if (j >= quads) break;
        const F32x4 w = load_f32x4(weight, 4 * j, true);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          dy[q].v[e] = read_dout(dy[q].v[e], bf16_dout);
          dot = __fadd_rn(dot, __fmul_rn(__fmul_rn(dy[q].v[e], w.v[e]), x[q].v[e]));
        }
      }
      dot = warp_sum(dot);
      const float kk = __fdiv_rn(__fmul_rn(__fmul_rn(__fmul_rn(dot, s), s), s), c_f32);
#pragma unroll
      for (int q = 0; q < kQuads; ++q) {
        const int j = lane + 32 * q;
        if (j >= quads) break;
        const F32x4 w = load_f32x4(weight, 4 * j, true);
        F32x4& dx = dx_row[q];
        F32x4 term;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float dyw = __fmul_rn(dy[q].v[e], w.v[e]);
          dx.v[e] =
              stored(__fadd_rn(dx.v[e], __fsub_rn(__fmul_rn(dyw, s), __fmul_rn(x[q].v[e], kk))),
                     round_bf16);
          term.v[e] = __fmul_rn(__fmul_rn(dy[q].v[e], x[q].v[e]), s);
        }
        put_stored_x4(dx_chunk, r * cols + 4 * j, dx, false, true);
        terms[warp * quads + j] = term;
      }
    }
    __syncthreads();
    if (t < quads) {
      const int group_rows = rows - g < kNormRowWarps ? rows - g : kNormRowWarps;
      for (int i = 0; i < group_rows; ++i) {
        const F32x4 term = terms[i * quads + t];
#pragma unroll
        for (int e = 0; e < 4; ++e) col_w.v[e] = __fadd_rn(col_w.v[e], term.v[e]);
      }
    }
    __syncthreads();  // (the next group's rows overwrite the terms)
  }
  if (t < quads) put_stored_x4(partial_w, k * C + 4 * t, col_w, false, false);
}

}  // namespace

// The norms' launches, shared by the FP32 and BF16-bits entry points (the same path and the same
// bits for both): the row-in-registers kernels where norm_rows_fit, the general ones otherwise.
namespace {
// The fast path's rule: C alone and the 16-byte alignment of `aligned` (inp, weight, bias, dinp).
template <class... P>
bool norm_rows_fit(int64_t C, const P*... aligned) {
  return C % 4 == 0 && C <= kNormMaxC && (aligned16(aligned) && ...);
}

// f(std::integral_constant<int, kQuads>) for the fewest instantiated quads a lane (1, 2, 4, 6 or
// 8) that cover C / 4 (C <= kNormMaxC).
template <class F>
void with_row_quads(int64_t C, F f) {
  const int64_t need = (C / 4 + 31) / 32;
  if (need <= 1)
    f(std::integral_constant<int, 1>{});
  else if (need <= 2)
    f(std::integral_constant<int, 2>{});
  else if (need <= 4)
    f(std::integral_constant<int, 4>{});
  else if (need <= 6)
    f(std::integral_constant<int, 6>{});
  else
    f(std::integral_constant<int, kNormMaxQuadsPerLane>{});
}

unsigned norm_rows_grid(int64_t N) {
  return static_cast<unsigned>((N + kNormRowWarps - 1) / kNormRowWarps);
}
// The backward kernels' shared memory: `arrays` rows of column-sum terms (C floats) a warp.
size_t norm_terms_bytes(int64_t C, int arrays) {
  return static_cast<size_t>(arrays) * kNormRowWarps * static_cast<size_t>(C) * sizeof(float);
}
// Lets `kernel` take `bytes` of dynamic shared memory (beyond the default 48 KiB).
template <class Kernel>
void allow_shared_bytes(Kernel* kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    FP4SIM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(bytes)));
}

// res (res.out set): the row kernel's residual input, for which the caller checked norm_rows_fit.
template <class OutT>
void layernorm_forward_launch(OutT* out, float* mean, float* rstd, const float* inp,
                              const float* weight, const float* bias, int64_t N, int64_t C,
                              bool round_bf16, cudaStream_t stream, ResidualIn res = {}) {
  const float c_f32 = static_cast<float>(C);
  if (res.out || norm_rows_fit(C, inp, weight, bias)) {
    with_row_quads(C, [&](auto quads) {
      layernorm_forward_rows_kernel<OutT, decltype(quads)::value>
          <<<norm_rows_grid(N), kNormRowWarps * 32, 0, stream>>>(out, mean, rstd, inp, weight, bias,
                                                                 N, C, c_f32, kNormEps, round_bf16,
                                                                 quad_aligned(out), res);
    });
  } else {
    layernorm_forward_kernel<<<static_cast<unsigned>(N), kThreads, 0, stream>>>(
        out, mean, rstd, inp, weight, bias, C, c_f32, kNormEps, round_bf16);
  }
  FP4SIM_CUDA_CHECK_LAUNCH();
}

template <class OutT>
void rmsnorm_forward_launch(OutT* out, float* rstd, const float* inp, const float* weight,
                            int64_t N, int64_t C, bool round_bf16, cudaStream_t stream) {
  const float c_f32 = static_cast<float>(C);
  if (norm_rows_fit(C, inp, weight)) {
    with_row_quads(C, [&](auto quads) {
      rmsnorm_forward_rows_kernel<OutT, decltype(quads)::value>
          <<<norm_rows_grid(N), kNormRowWarps * 32, 0, stream>>>(
              out, rstd, inp, weight, N, C, c_f32, kNormEps, round_bf16, quad_aligned(out));
    });
  } else {
    rmsnorm_forward_kernel<<<static_cast<unsigned>(N), kThreads, 0, stream>>>(
        out, rstd, inp, weight, C, c_f32, kNormEps, round_bf16);
  }
  FP4SIM_CUDA_CHECK_LAUNCH();
}

// The backward launches for dout stored as DT. dinp: bounded vs the emulator (row-sum trees).
// dweight/dbias: fixed 64-row chunks, chunk 0 seeded with the current value, chunks summed in order
// (bitwise the emulator's when N <= 64). partial: 2 x chunks x C floats of scratch for LayerNorm,
// chunks x C for RMSNorm; with one chunk the fused kernels write dweight/dbias in place (the
// finalize of one chunk is a copy).
template <class DT>
void layernorm_backward_launch(float* dinp, float* dweight, float* dbias, const DT* dout,
                               const float* inp, const float* weight, const float* mean,
                               const float* rstd, int64_t N, int64_t C, bool round_bf16,
                               bool bf16_dout, float* partial, cudaStream_t stream) {
  const int64_t chunks = column_chunks(N);
  if (norm_rows_fit(C, inp, weight, dinp)) {
    const bool one = chunks == 1;
    const size_t smem = norm_terms_bytes(C, 2);
    with_row_quads(C, [&](auto quads) {
      auto* kernel = layernorm_backward_chunk_kernel<DT, decltype(quads)::value>;
      allow_shared_bytes(kernel, smem);
      kernel<<<static_cast<unsigned>(chunks), kNormRowWarps * 32, smem, stream>>>(
          dinp, one ? dweight : partial, one ? dbias : partial + chunks * C, dweight, dbias, dout,
          inp, weight, mean, rstd, N, C, static_cast<float>(C), round_bf16, bf16_dout,
          quad_aligned(dout));
    });
    FP4SIM_CUDA_CHECK_LAUNCH();
    if (one) return;
  } else {
    layernorm_backward_dinp_kernel<<<static_cast<unsigned>(N), kThreads, 0, stream>>>(
        dinp, dout, inp, weight, mean, rstd, C, static_cast<float>(C), round_bf16, bf16_dout);
    FP4SIM_CUDA_CHECK_LAUNCH();
    layernorm_backward_partial_kernel<<<column_partial_grid(N, C), kThreads, 0, stream>>>(
        partial, dweight, dbias, dout, inp, mean, rstd, N, C, bf16_dout);
    FP4SIM_CUDA_CHECK_LAUNCH();
  }
  column_sums_finalize(dweight, partial, N, C, false, stream, dbias, partial + chunks * C);
}
template <class DT>
void rmsnorm_backward_launch(float* dinp, float* dweight, const DT* dout, const float* inp,
                             const float* weight, const float* rstd, int64_t N, int64_t C,
                             bool round_bf16, bool bf16_dout, float* partial, cudaStream_t stream) {
  const int64_t chunks = column_chunks(N);
  if (norm_rows_fit(C, inp, weight, dinp)) {
    const bool one = chunks == 1;
    const size_t smem = norm_terms_bytes(C, 1);
    with_row_quads(C, [&](auto quads) {
      auto* kernel = rmsnorm_backward_chunk_kernel<DT, decltype(quads)::value>;
      allow_shared_bytes(kernel, smem);
      kernel<<<static_cast<unsigned>(chunks), kNormRowWarps * 32, smem, stream>>>(
          dinp, one ? dweight : partial, dweight, dout, inp, weight, rstd, N, C,
          static_cast<float>(C), round_bf16, bf16_dout, quad_aligned(dout));
    });
    FP4SIM_CUDA_CHECK_LAUNCH();
    if (one) return;
  } else {
    rmsnorm_backward_dinp_kernel<<<static_cast<unsigned>(N), kThreads, 0, stream>>>(
        dinp, dout, inp, weight, rstd, C, static_cast<float>(C), round_bf16, bf16_dout);
    FP4SIM_CUDA_CHECK_LAUNCH();
    rmsnorm_backward_partial_kernel<<<column_partial_grid(N, C), kThreads, 0, stream>>>(
        partial, dweight, dout, inp, rstd, N, C, bf16_dout);
    FP4SIM_CUDA_CHECK_LAUNCH();
  }
  column_sums_finalize(dweight, partial, N, C, false, stream);
}
}  // namespace

// The norm ops on views: the launchers above, templated on the output's (or dout's) storage.
void CudaBackend::norm_forward(NormKind kind, const TensorView& out, const TensorView& mean,
                               const TensorView& rstd, const TensorView& inp,
                               const TensorView& weight, const TensorView& bias) {
  op_checks::norm_forward(kind, out, mean, rstd, inp, weight, bias);
  const int64_t N = inp.rows, C = inp.cols;
  require_rows("norm_forward", N);
  if (N == 0 || C == 0) return;
  const bool rb = out.bf16_storage();
  auto launch = [&](auto* y) {
    if (kind == NormKind::LayerNorm)
      layernorm_forward_launch(y, mean.as<float>(), rstd.as<float>(), inp.as<const float>(),
                               weight.as<const float>(), bias.as<const float>(), N, C, rb, stream_);
    else
      rmsnorm_forward_launch(y, rstd.as<float>(), inp.as<const float>(), weight.as<const float>(),
                             N, C, rb, stream_);
  };
  if (out.dtype == DType::BF16)
    launch(out.as<uint16_t>());
  else
    launch(out.as<float>());
}

void CudaBackend::norm_backward(NormKind kind, const TensorView& dinp, const TensorView& dweight,
                                const TensorView& dbias, const TensorView& dout,
                                const TensorView& inp, const TensorView& weight,
                                const TensorView& mean, const TensorView& rstd) {
  op_checks::norm_backward(kind, dinp, dweight, dbias, dout, inp, weight, mean, rstd);
  const int64_t N = inp.rows, C = inp.cols;
  require_rows("norm_backward", N);
  if (N == 0 || C == 0) return;
  const bool ln = kind == NormKind::LayerNorm;
  float* partial = layers_state().columns.get<float>(
      static_cast<size_t>((ln ? 2 : 1) * column_chunks(N) * C), stream_);
  auto launch = [&](const auto* dy) {
    if (ln)
      layernorm_backward_launch(dinp.as<float>(), dweight.as<float>(), dbias.as<float>(), dy,
                                inp.as<const float>(), weight.as<const float>(),
                                mean.as<const float>(), rstd.as<const float>(), N, C,
                                dinp.bf16_values, dout.bf16_storage(), partial, stream_);
    else
      rmsnorm_backward_launch(dinp.as<float>(), dweight.as<float>(), dy, inp.as<const float>(),
                              weight.as<const float>(), rstd.as<const float>(), N, C,
                              dinp.bf16_values, dout.bf16_storage(), partial, stream_);
  };
  if (dout.dtype == DType::BF16)
    launch(dout.as<const uint16_t>());
  else
    launch(dout.as<const float>());
}

// One pass for LayerNorm into BF16 bits with a BF16 b: the row kernel adds the residual as it
// loads the row (residual_forward's expression), writes it, and normalizes it from registers. The
// composition elsewhere, and where the row kernel does not apply (C > 1024, C % 4, pointers not
// 16-byte aligned).
void CudaBackend::residual_norm_forward(NormKind kind, const TensorView& res, const TensorView& out,
                                        const TensorView& mean, const TensorView& rstd,
                                        const TensorView& a, const TensorView& b,
                                        const TensorView& weight, const TensorView& bias) {
  const int64_t N = a.rows, C = a.cols;
  if (kind != NormKind::LayerNorm || out.dtype != DType::BF16 || b.dtype != DType::BF16 || N == 0 ||
      C == 0 ||
      !norm_rows_fit(C, res.as<float>(), a.as<const float>(), b.as<const uint16_t>(),
                     weight.as<const float>(), bias.as<const float>())) {
    compose_residual_norm_forward(*this, kind, res, out, mean, rstd, a, b, weight, bias);
    return;
  }
  op_checks::residual_forward(res, a, b);
  op_checks::norm_forward(kind, out, mean, rstd, as_stored(res), weight, bias);
  require_rows("residual_norm_forward", N);
  layernorm_forward_launch(
      out.as<uint16_t>(), mean.as<float>(), rstd.as<float>(), nullptr, weight.as<const float>(),
      bias.as<const float>(), N, C, true, stream_,
      ResidualIn{res.as<float>(), a.as<const float>(), b.as<const uint16_t>(), res.bf16_values});
}

}  // namespace fp4sim::gpu
