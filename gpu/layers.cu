// CUDA twins of the training-stack layer ops (emu/layers.hpp, emu/optim.hpp), in the manner of
// llm.c's CUDA twins: the same names, argument orders, shapes and accumulate-vs-overwrite
// behaviour as the emulator, on device pointers, on the backend's stream.
//
// Numerics, in one place (each kernel repeats what applies to it):
// - Every FP32 operation is written with the _rn intrinsics (fmul_rn, fadd_rn, ... from
//   emu/hd.hpp) in the emulator's order of operations; the library is also built with
//   -fmad=false -prec-div=true -prec-sqrt=true -ftz=false (DESIGN.md §1). No fast intrinsics.
// - Deterministic: no floating-point atomics. A reduction is either done in the emulator's order
//   (then the result is bitwise the emulator's) or as a fixed tree / fixed chunking that depends
//   only on the shapes (then it is bitwise reproducible run to run, and bounded against the
//   emulator). Which one is stated on each kernel.
// - expf, logf and tanhf are CUDA's accurate versions (<= 2 ulp), not glibc's: results that go
//   through them agree with the emulator within a few ulp, not bitwise. The cross-entropy's
//   exponentials are 2^(x log2 e) by one MUFU.EX2 instead (gpu/exp2.cuh), bounded the same way.
// - matmul: cuBLASLt, FP32 accumulation (CUBLAS_COMPUTE_32F, never TF32); BF16 operands rounded
//   RNE by emu/formats.hpp's bf16_rne. Reproducible run to run on one GPU model, toolkit and
//   workspace size (cuBLAS's reproducibility guarantee); bounded against the emulator's exact
//   tensor-core emulation.
// - attention: FlashAttention-2 kernels on mma.sync in gpu/attention.cu (their numerics are stated
//   there); bounded against the emulator, bitwise reproducible run to run.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <cub/device/device_radix_sort.cuh>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "emu/formats.hpp"
#include "emu/hd.hpp"
#include "emu/optim.hpp"
#include "gpu/activation.cuh"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/exp2.cuh"

namespace fp4sim::gpu {

namespace {

// The emulator's defaults (emu/norm.hpp, emu/elementwise.hpp): the Backend interface passes
// neither.
constexpr float kNormEps = 1e-5f;
constexpr float kRopeBase = 10000.0f;

constexpr int kThreads = 256;  // elementwise and row kernels
constexpr int64_t kColumnChunkRows =
    emu::kColumnChunkRows;  // rows per partial column sum (shared with emu::bias_backward)
constexpr int64_t kMaxGridBlocks = 1 << 16;  // grid-stride cap for elementwise kernels
constexpr int kSumSquaresBlocks = 1024;      // fixed: the FP64 reduction tree is shape-only
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

unsigned elementwise_grid(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxGridBlocks ? blocks : kMaxGridBlocks);
}

void require_rows(const char* op, int64_t rows) {
  if (rows < 0 || rows > INT_MAX)
    throw std::invalid_argument(std::string(op) + ": " + std::to_string(rows) +
                                " rows; expected 0.." + std::to_string(INT_MAX) +
                                " (one block per row)");
}

void require_heads(const char* op, int64_t NH, int64_t NKV, int64_t HD) {
  if (NH <= 0 || NKV <= 0 || NH % NKV != 0 || HD <= 0)
    throw std::invalid_argument(std::string(op) + ": NH=" + std::to_string(NH) +
                                " NKV=" + std::to_string(NKV) + " HD=" + std::to_string(HD) +
                                "; expected NH, NKV, HD > 0 and NH a multiple of NKV");
}

// The attention kernels take BF16 operands; the unrounded FP32 mode is the emulator's alone.
void require_bf16_attention(const char* op, emu::GemmPrecision prec) {
  if (prec != emu::GemmPrecision::BF16)
    throw std::invalid_argument(std::string(op) +
                                ": GemmPrecision::FP32 (no BF16 operand rounding, for gradient "
                                "checks) is emulator-only; the CUDA kernels take BF16 operands");
}

// ---- fixed-order reductions -------------------------------------------------------------------

__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

// Butterfly over the 32 lanes: a fixed tree; every lane ends with the same bits (each pairwise
// sum is computed as x + y on one lane and y + x on its partner, equal by commutativity).
template <class T>
__device__ T warp_sum(T v) {
  for (int off = 16; off > 0; off >>= 1) v = add_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
  return v;
}

// Sum of one value per thread over the block (blockDim.x a multiple of 32): warp butterflies,
// then a butterfly over the warp sums (missing warps contribute +0). The tree depends only on
// blockDim.x; every thread gets the same result. Ends with a barrier so it can be called again.
template <class T>
__device__ T block_sum(T v) {
  __shared__ T warp_sums[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  T total = lane < warps ? warp_sums[lane] : T(0);
  total = warp_sum(total);
  __syncthreads();
  return total;
}

// Max as the emulator writes it (`s > m ? s : m`): NaN values are skipped, and the result is
// exact in any order.
__device__ __forceinline__ float max_skip_nan(float m, float s) { return s > m ? s : m; }

__device__ float block_max(float v) {
  __shared__ float warp_max[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int off = 16; off > 0; off >>= 1) v = max_skip_nan(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  float m = lane < warps ? warp_max[lane] : -INFINITY;
  for (int off = 16; off > 0; off >>= 1) m = max_skip_nan(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  __syncthreads();
  return m;
}

// Column sums over rows in a fixed chunking (the second half of layernorm/rmsnorm/matmul
// backward). partial (chunks, C): chunk k sums rows [k*kColumnChunkRows, (k+1)*kColumnChunkRows)
// in increasing row order (FP32, RN); the finalize pass sums the chunks in increasing order.
// With one chunk (N <= kColumnChunkRows) this is exactly the emulator's sequential loop.
// 32 columns a CTA (a warp's lanes) and 8 warps: the warps load a tile of up to 256 chunks of
// those columns into shared memory together, every load in flight at once, then warp 0 adds the
// tile up in chunk order, a lane a column; the sum starts from chunk 0's value (not 0 + it: -0).
// The same additions in the same order as one thread walking its column, which kept 32 loads in
// flight and was bound by 8 rounds of their latency (~12 us a launch, 98 launches a step).
constexpr int kFinalizeCols = 32, kFinalizeWarps = 8, kFinalizeTile = 256;
// Two arrays of sums in one launch (out2/partial2 non-null: a norm's dweight and dbias): the CTAs
// from `second` on take the second, each CTA the same work as in a launch of its own.
__global__ void __launch_bounds__(kFinalizeCols* kFinalizeWarps)
    column_sums_finalize_kernel(float* out, const float* partial, int64_t chunks, int64_t C,
                                bool add_to_out, float* out2, const float* partial2,
                                unsigned second) {
  __shared__ float tile[kFinalizeTile][kFinalizeCols];
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  unsigned block = blockIdx.x;
  if (out2 && block >= second) {
    out = out2;
    partial = partial2;
    block -= second;
  }
  const int64_t c = static_cast<int64_t>(block) * kFinalizeCols + lane;
  float acc = 0.0f;
  for (int64_t k0 = 0; k0 < chunks; k0 += kFinalizeTile) {
    const int n = static_cast<int>(chunks - k0 < kFinalizeTile ? chunks - k0 : kFinalizeTile);
    __syncthreads();  // (warp 0 is done with the previous tile)
    if (c < C) {
#pragma unroll 8
      for (int r = warp; r < n; r += kFinalizeWarps) tile[r][lane] = partial[(k0 + r) * C + c];
    }
    __syncthreads();
    if (warp == 0 && c < C) {
      int r = 0;
      if (k0 == 0) acc = tile[r++][lane];
#pragma unroll 16
      for (; r < n; ++r) acc = __fadd_rn(acc, tile[r][lane]);
    }
  }
  if (warp == 0 && c < C) out[c] = add_to_out ? __fadd_rn(out[c], acc) : acc;
}

int64_t column_chunks(int64_t N) { return (N + kColumnChunkRows - 1) / kColumnChunkRows; }

dim3 column_partial_grid(int64_t N, int64_t C) {
  return dim3(static_cast<unsigned>(column_chunks(N)),
              static_cast<unsigned>((C + kThreads - 1) / kThreads));
}

// out (and out2, when given: the sums of partial2, the same shape) from the chunk partials.
void column_sums_finalize(float* out, const float* partial, int64_t N, int64_t C, bool add_to_out,
                          cudaStream_t stream, float* out2 = nullptr,
                          const float* partial2 = nullptr) {
  const unsigned blocks = static_cast<unsigned>((C + kFinalizeCols - 1) / kFinalizeCols);
  column_sums_finalize_kernel<<<out2 ? 2 * blocks : blocks, kFinalizeCols * kFinalizeWarps, 0,
                                stream>>>(out, partial, column_chunks(N), C, add_to_out, out2,
                                          partial2, blocks);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

// ---- embedding --------------------------------------------------------------------------------

// out (N,C) = wte[tokens[n]] + (wpe ? wpe[pos[n]] : +0). One FP32 RN addition: bitwise.
__global__ void embedding_forward_kernel(float* out, const int32_t* tokens, const int32_t* pos,
                                         const float* wte, const float* wpe, int64_t N, int64_t C) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < N * C;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = e / C, i = e % C;
    out[e] = __fadd_rn(wte[static_cast<int64_t>(tokens[n]) * C + i],
                       wpe ? wpe[static_cast<int64_t>(pos[n]) * C + i] : 0.0f);
  }
}

__global__ void iota_kernel(int32_t* idx, int64_t N) {
  for (int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; n < N;
       n += static_cast<int64_t>(gridDim.x) * blockDim.x)
    idx[n] = static_cast<int32_t>(n);
}

// dtable[ids[n]] += dout[n] for the rows sorted stably by id: sorted_ids (N), rows (N) the
// original row of each sorted entry. One block per sorted position; the block that starts a run
// of equal ids owns that table row and adds the run's dout rows in increasing n, starting from
// the table's value: exactly the emulator's sequential order, so bitwise.
__global__ void embedding_scatter_kernel(float* dtable, const float* dout,
                                         const int32_t* sorted_ids, const int32_t* rows, int64_t N,
                                         int64_t C) {
  const int64_t j = blockIdx.x;
  const int32_t id = sorted_ids[j];
  if (j > 0 && sorted_ids[j - 1] == id) return;
  float* d = dtable + static_cast<int64_t>(id) * C;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    float acc = d[i];
    for (int64_t k = j; k < N && sorted_ids[k] == id; ++k)
      acc = __fadd_rn(acc, dout[static_cast<int64_t>(rows[k]) * C + i]);
    d[i] = acc;
  }
}

// ---- layernorm / rmsnorm ----------------------------------------------------------------------

// An activation value as stored: bf16_round when the op's round_bf16 is set (the model's BF16
// activations, Backend's contract), else as computed. The same function as round_to_bf16's.
__device__ __forceinline__ float stored(float v, bool round_bf16) {
  return round_bf16 ? bf16_round(v) : v;
}
// An incoming gradient as a backward pass reads it: bf16_round(v) where the caller stores gradients
// in BF16 and left the rounding to the reader (bf16_dout), else v.
__device__ __forceinline__ float read_dout(float v, bool bf16_dout) {
  return bf16_dout ? bf16_round(v) : v;
}
// An input element as FP32: stored FP32, or BF16 bits widened (exact).
__device__ __forceinline__ float load_f32(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_f32(const uint16_t* p, int64_t i) {
  return bf16_to_f32(p[i]);
}
// o[i] = the stored value of v: FP32 (stored), or BF16 bits (the rounding is the storage;
// round_bf16 implied).
__device__ __forceinline__ void put_stored(float* o, int64_t i, float v, bool round_bf16) {
  o[i] = stored(v, round_bf16);
}
__device__ __forceinline__ void put_stored(uint16_t* o, int64_t i, float v, bool) {
  o[i] = bf16_rne(v);
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
  const ushort4 h =
      make_ushort4(bf16_rne(q.v[0]), bf16_rne(q.v[1]), bf16_rne(q.v[2]), bf16_rne(q.v[3]));
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

// ---- matmul -----------------------------------------------------------------------------------

// dst (n) = BF16 RNE bits of src (emu/formats.hpp: NaN -> 0x7FFF), the emulator's operand rounding.
// Memory-bound elementwise kernels move four floats per access where every pointer is 16-byte
// aligned (the vector loop), and one at a time for the rest: each element gets the same
// per-element function either way, so the split changes no bits.
__host__ __device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}
// Whether p takes four elements an access (16 bytes for FP32, 8 for BF16 bits).
template <class T>
bool quad_aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % (4 * sizeof(T)) == 0;
}
// Whether p takes two elements an access (the column-sum kernels' pairs: 8 bytes for FP32, 4 for
// BF16 bits).
template <class T>
bool pair_aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % (2 * sizeof(T)) == 0;
}

// The grid-stride loop of those kernels: quad(j) for the groups of four elements j < n / 4 when
// `vectorized` (the caller's pointers are aligned for it), then one(i) for every element left.
template <class Quad, class One>
__device__ __forceinline__ void grid_stride_by4(int64_t n, bool vectorized, Quad quad, One one) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nv = vectorized ? n / 4 : 0;
  for (int64_t j = t0; j < nv; j += stride) quad(j);
  for (int64_t i = nv * 4 + t0; i < n; i += stride) one(i);
}

__global__ void round_to_bf16_kernel(uint16_t* dst, const float* src, int64_t n) {
  grid_stride_by4(
      n, aligned16(src) && (reinterpret_cast<uintptr_t>(dst) & 7u) == 0,
      [&](int64_t j) {
        const float4 v = reinterpret_cast<const float4*>(src)[j];
        reinterpret_cast<ushort4*>(dst)[j] =
            make_ushort4(bf16_rne(v.x), bf16_rne(v.y), bf16_rne(v.z), bf16_rne(v.w));
      },
      [&](int64_t i) { dst[i] = bf16_rne(src[i]); });
}

// The bias value added to an output that is rounded to BF16: the bias's BF16 rounding (the rule of
// Backend::matmul_forward, as a BF16 GEMM epilogue adds a BF16 bias); else the bias.
__device__ __forceinline__ float bias_added(float b, bool round_bf16) {
  return round_bf16 ? bf16_round(b) : b;
}

// out (N,OC) += bias (OC), one FP32 RN addition after the GEMM, as the emulator: bitwise given the
// GEMM's value; with round_bf16, the bias rounded to BF16 first and the sum rounded. grid.y walks
// the rows (several per block, so a block has work enough), x the columns, four at a time when
// `vec` (OC a multiple of 4, both pointers 16-byte aligned; the same per-element function either
// way).
__global__ void add_bias_kernel(float* out, const float* bias, int64_t N, int64_t OC,
                                bool round_bf16, bool vec) {
  const int64_t cols = vec ? OC / 4 : OC;
  for (int64_t r = blockIdx.y; r < N; r += gridDim.y) {
    float* row = out + r * OC;
    for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < cols;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      if (vec) {
        float4 v = reinterpret_cast<float4*>(row)[c];
        const float4 b = reinterpret_cast<const float4*>(bias)[c];
        v.x = stored(__fadd_rn(v.x, bias_added(b.x, round_bf16)), round_bf16);
        v.y = stored(__fadd_rn(v.y, bias_added(b.y, round_bf16)), round_bf16);
        v.z = stored(__fadd_rn(v.z, bias_added(b.z, round_bf16)), round_bf16);
        v.w = stored(__fadd_rn(v.w, bias_added(b.w, round_bf16)), round_bf16);
        reinterpret_cast<float4*>(row)[c] = v;
      } else {
        row[c] = stored(__fadd_rn(row[c], bias_added(bias[c], round_bf16)), round_bf16);
      }
    }
  }
}
// out16 (N,OC) = the BF16 bits of in + bf16(bias) (add_bias_kernel's sum, RNE): add_bias with
// rounding and then round_to_bf16_kernel, in one pass. vec: OC % 4 == 0, in and bias 16-byte
// aligned, out16 8-byte aligned.
__global__ void add_bias_bf16_kernel(uint16_t* out16, const float* in, const float* bias, int64_t N,
                                     int64_t OC, bool vec) {
  const int64_t cols = vec ? OC / 4 : OC;
  for (int64_t r = blockIdx.y; r < N; r += gridDim.y) {
    const float* row = in + r * OC;
    uint16_t* o = out16 + r * OC;
    for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < cols;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      if (vec) {
        const float4 v = reinterpret_cast<const float4*>(row)[c];
        const float4 b = reinterpret_cast<const float4*>(bias)[c];
        reinterpret_cast<ushort4*>(o)[c] = make_ushort4(
            bf16_rne(__fadd_rn(v.x, bf16_round(b.x))), bf16_rne(__fadd_rn(v.y, bf16_round(b.y))),
            bf16_rne(__fadd_rn(v.z, bf16_round(b.z))), bf16_rne(__fadd_rn(v.w, bf16_round(b.w))));
      } else {
        o[c] = bf16_rne(__fadd_rn(row[c], bf16_round(bias[c])));
      }
    }
  }
}
constexpr int64_t kBiasRowBlocks = 2048;  // grid.y cap: 8 rows a block at N = 16384
dim3 bias_grid(int64_t N, int64_t cols) {
  const int64_t x = (cols + kThreads - 1) / kThreads, y = N < kBiasRowBlocks ? N : kBiasRowBlocks;
  return dim3(static_cast<unsigned>(x < kMaxGridBlocks ? x : kMaxGridBlocks),
              static_cast<unsigned>(y > 0 ? y : 1));
}
void add_bias(float* out, const float* bias, int64_t N, int64_t OC, bool round_bf16,
              cudaStream_t stream) {
  if (N == 0 || OC == 0) return;
  const bool vec = OC % 4 == 0 && aligned16(out) && aligned16(bias);
  add_bias_kernel<<<bias_grid(N, vec ? OC / 4 : OC), kThreads, 0, stream>>>(out, bias, N, OC,
                                                                            round_bf16, vec);
  FP4SIM_CUDA_CHECK_LAUNCH();
}
void add_bias_bf16(uint16_t* out16, const float* in, const float* bias, int64_t N, int64_t OC,
                   cudaStream_t stream) {
  if (N == 0 || OC == 0) return;
  const bool vec = OC % 4 == 0 && aligned16(in) && aligned16(bias) &&
                   (reinterpret_cast<uintptr_t>(out16) & 7u) == 0;
  add_bias_bf16_kernel<<<bias_grid(N, vec ? OC / 4 : OC), kThreads, 0, stream>>>(out16, in, bias, N,
                                                                                 OC, vec);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

// Partial column sums of dout (N,OC) for dbias: partial (chunks, OC), every chunk from +0 (the
// emulator sums the column from 0 and then adds it to dbias).
__global__ void column_partial_kernel(float* partial, const float* dout, int64_t N, int64_t C) {
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t k = blockIdx.x;
  const int64_t n0 = k * kColumnChunkRows,
                n1 = n0 + kColumnChunkRows < N ? n0 + kColumnChunkRows : N;
  float s = 0.0f;
  for (int64_t n = n0; n < n1; ++n) s = __fadd_rn(s, dout[n * C + c]);
  partial[k * C + c] = s;
}

// column_partial_kernel and round_to_bf16_kernel of the same dout in one pass (matmul_backward at
// BF16 precision with a bias: the Dgrad/Wgrad operand and the bias gradient's chunk sums), two
// adjacent columns a thread (C even, dout 8-byte and h 4-byte aligned): dout is read once instead
// of twice. Rows are loaded 16 at a time before any is used (__restrict__: the stores into h
// cannot alias them), so a thread has 16 loads in flight rather than one. The same sums in the
// same order and the same roundings: the same bits. Src::load2(n, c): dout's elements (n, c) and
// (n, c + 1): from memory, or computed by an activation's backward pass (then never stored).
struct Bf16PairMemory {
  const float* __restrict__ dout;
  __device__ __forceinline__ float2 load2(int64_t n, int64_t c, int64_t C) const {
    return __ldg(reinterpret_cast<const float2*>(dout + n * C + c));
  }
};
// Two consecutive elements as FP32: float2, or a BF16 pair (4-byte aligned) widened.
__device__ __forceinline__ float2 load_pair(const float* p) {
  return __ldg(reinterpret_cast<const float2*>(p));
}
__device__ __forceinline__ float2 load_pair(const uint16_t* p) {
  const uint32_t x = __ldg(reinterpret_cast<const unsigned int*>(p));
  return make_float2(__uint_as_float(x << 16), __uint_as_float(x & 0xFFFF0000u));
}
// dout kept as BF16 bits (4-byte aligned, C even), widened: the operand needs no copy, so the
// kernel is given no h and only sums (Backend::matmul_backward_bits' dout16).
struct Bf16PairBits {
  const uint16_t* __restrict__ dout;
  __device__ __forceinline__ float2 load2(int64_t n, int64_t c, int64_t C) const {
    return load_pair(dout + n * C + c);
  }
};
// GELU's input gradient as gelu_backward_kernel stores it (gpu/activation.cuh), from the
// pre-activation and the incoming gradient, each FP32 (8-byte aligned) or BF16 bits (4-byte
// aligned; read widened: Backend's inp16 / dout16).
template <class InT = float, class DoutT = float>
struct Bf16PairGeluBackward {
  const InT* __restrict__ inp;
  const DoutT* __restrict__ dout;
  bool round_bf16, bf16_dout;
  __device__ __forceinline__ float2 load2(int64_t n, int64_t c, int64_t C) const {
    const float2 x = load_pair(inp + n * C + c), d = load_pair(dout + n * C + c);
    return make_float2(gelu_backward_stored(x.x, d.x, round_bf16, bf16_dout),
                       gelu_backward_stored(x.y, d.y, round_bf16, bf16_dout));
  }
};

// h null: the sums only (the operand exists already).
template <class Src>
__global__ void round_to_bf16_column_partial_kernel(uint16_t* __restrict__ h,
                                                    float* __restrict__ partial, Src src, int64_t N,
                                                    int64_t C) {
  const int64_t c = 2 * (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x);
  if (c >= C) return;
  const int64_t k = blockIdx.x;
  const int64_t n0 = k * kColumnChunkRows,
                n1 = n0 + kColumnChunkRows < N ? n0 + kColumnChunkRows : N;
  constexpr int kAhead = 16;
  float s0 = 0.0f, s1 = 0.0f;
  // row n's pair into the sums and the BF16 copy
  auto take = [&](int64_t n, float2 v) {
    s0 = __fadd_rn(s0, v.x);
    s1 = __fadd_rn(s1, v.y);
    if (h)
      *reinterpret_cast<uint32_t*>(h + n * C + c) =
          static_cast<uint32_t>(bf16_rne(v.x)) | (static_cast<uint32_t>(bf16_rne(v.y)) << 16);
  };
  int64_t n = n0;
  for (; n + kAhead <= n1; n += kAhead) {
    float2 v[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) v[u] = src.load2(n + u, c, C);
#pragma unroll
    for (int u = 0; u < kAhead; ++u) take(n + u, v[u]);
  }
  for (; n < n1; ++n) take(n, src.load2(n, c, C));
  partial[k * C + c] = s0;
  partial[k * C + c + 1] = s1;
}

// gelu_forward_kernel that also writes the stored values' BF16 bits (h), the GEMM operand
// round_to_bf16_kernel would make from out: the same bits, one pass. out null: h only (the
// activation kept as BF16 bits).
// Four elements an access where `vec` (gelu_copy_vectorized: the pointers aligned for it), else
// one: the same per-element function either way.
template <class InT>
__global__ void gelu_forward_bf16_copy_kernel(float* out, uint16_t* h, const InT* inp, int64_t n,
                                              bool round_bf16, bool vec) {
  grid_stride_by4(
      n, vec,
      [&](int64_t j) {
        float x[4];
        if constexpr (std::is_same_v<InT, uint16_t>) {
          const ushort4 u = reinterpret_cast<const ushort4*>(inp)[j];
          x[0] = bf16_to_f32(u.x), x[1] = bf16_to_f32(u.y), x[2] = bf16_to_f32(u.z),
          x[3] = bf16_to_f32(u.w);
        } else {
          const float4 f = reinterpret_cast<const float4*>(inp)[j];
          x[0] = f.x, x[1] = f.y, x[2] = f.z, x[3] = f.w;
        }
        float v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = gelu_forward_stored(x[u], round_bf16);
        if (out) reinterpret_cast<float4*>(out)[j] = make_float4(v[0], v[1], v[2], v[3]);
        reinterpret_cast<ushort4*>(h)[j] =
            make_ushort4(bf16_rne(v[0]), bf16_rne(v[1]), bf16_rne(v[2]), bf16_rne(v[3]));
      },
      [&](int64_t i) {
        const float v = gelu_forward_stored(load_f32(inp, i), round_bf16);
        if (out) out[i] = v;
        h[i] = bf16_rne(v);
      });
}
// GELU's stored BF16 bits as a function of its BF16 input's bits: table[x] = bf16_rne(gelu_forward_
// stored(x, true)), for all 65536 x (that is also bf16_rne(gelu_tanh_value(x)): RNE of a
// BF16-rounded value is the same BF16). Made once by the device itself (the same function, so the
// same bits as gelu_forward_bf16_copy_kernel computes), then the forward pass on BF16 input with
// only BF16 output is a lookup: gelu_forward_bf16_lut_kernel. The arithmetic (tanhf) otherwise made
// that pass compute-bound.
constexpr int kGeluLutEntries = 1 << 16;
constexpr int kGeluLutThreads = 1024;
__global__ void gelu_bf16_table_kernel(uint16_t* table) {
  const int i = static_cast<int>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < kGeluLutEntries)
    table[i] = bf16_rne(gelu_forward_stored(bf16_to_f32(static_cast<uint16_t>(i)), true));
}

// h = table[inp] element by element, the table (128 KB) in shared memory; one CTA an SM. `vec`:
// both pointers 16-byte aligned, eight elements a load, the tail one by one.
__global__ void __launch_bounds__(kGeluLutThreads)
    gelu_forward_bf16_lut_kernel(uint16_t* h, const uint16_t* inp, const uint16_t* table, int64_t n,
                                 bool vec) {
  extern __shared__ uint4 gelu_lut_smem[];
  uint16_t* const lut = reinterpret_cast<uint16_t*>(gelu_lut_smem);
  for (int i = threadIdx.x; i < kGeluLutEntries / 8; i += blockDim.x)
    gelu_lut_smem[i] = reinterpret_cast<const uint4*>(table)[i];
  __syncthreads();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n8 = vec ? n / 8 : 0;
  auto look = [&](uint32_t w) {
    return static_cast<uint32_t>(lut[w & 0xFFFFu]) | static_cast<uint32_t>(lut[w >> 16]) << 16;
  };
  for (int64_t j = t0; j < n8; j += stride) {
    const uint4 u = reinterpret_cast<const uint4*>(inp)[j];
    reinterpret_cast<uint4*>(h)[j] = make_uint4(look(u.x), look(u.y), look(u.z), look(u.w));
  }
  for (int64_t i = n8 * 8 + t0; i < n; i += stride) h[i] = lut[inp[i]];
}

template <class InT>
bool gelu_copy_vectorized(const float* out, const uint16_t* h, const InT* inp) {
  return quad_aligned(h) && quad_aligned(inp) && (!out || quad_aligned(out));
}

// ---- RoPE -------------------------------------------------------------------------------------

// In place on the NH query and NKV key heads of x (B,T,(NH+2NKV)*HD): the pair (2i, 2i+1) at
// position t rotates by the angle whose FP32 cos/sin the host computed exactly as the emulator
// (double pow/cos/sin, rounded to float): cos_sin (T, HD/2, 2). sign = +1 forward, -1 backward
// (multiplies sin; exact). x0' = x0 c - x1 s, x1' = x0 s + x1 c, each product and sum RN: bitwise.
__global__ void rope_kernel(float* x, const float* cos_sin, int64_t B, int64_t T, int64_t NH,
                            int64_t NKV, int64_t HD, float sign) {
  const int64_t half = HD / 2, heads = NH + NKV, W = (NH + 2 * NKV) * HD;
  const int64_t total = B * T * heads * half;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e % half, h = (e / half) % heads, bt = e / (half * heads), t = bt % T;
    const float c = cos_sin[(t * half + i) * 2],
                s = __fmul_rn(sign, cos_sin[(t * half + i) * 2 + 1]);
    float* v = x + bt * W + h * HD;
    const float x0 = v[2 * i], x1 = v[2 * i + 1];
    v[2 * i] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    v[2 * i + 1] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
  }
}

// ---- elementwise ------------------------------------------------------------------------------

// GELU (tanh approximation): gpu/activation.cuh's arithmetic (the emulator's order; CUDA tanhf in
// the forward, tanh_exp2 in the derivative: a few ulp from the emulator, not bitwise), shared with
// the FP8 quantizer's fused pass.
__global__ void gelu_forward_kernel(float* out, const float* inp, int64_t n, bool round_bf16) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[j] = gelu_forward_stored(inp[j], round_bf16);
}

// dinp (n) = +0 + local * dout (written, never read: emu/elementwise.hpp); gpu/activation.cuh.
// (1 - t^2 amplifies an ulp of t where |t| is near 1: further from the emulator than the forward.)
__global__ void gelu_backward_kernel(float* dinp, const float* inp, const float* dout, int64_t n,
                                     bool round_bf16, bool bf16_dout) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dinp[j] = gelu_backward_stored(inp[j], dout[j], round_bf16, bf16_dout);
}

// out = max(x, 0)^2 as `x > 0 ? x : 0` (NaN -> 0), squared RN: bitwise.
__global__ void squared_relu_forward_kernel(float* out, const float* inp, int64_t n,
                                            bool round_bf16) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float r = inp[j] > 0.0f ? inp[j] : 0.0f;
    out[j] = stored(__fmul_rn(r, r), round_bf16);
  }
}

// dinp = +0 + (x > 0 ? 2 x : 0) * dout (written): bitwise.
__global__ void squared_relu_backward_kernel(float* dinp, const float* inp, const float* dout,
                                             int64_t n, bool round_bf16, bool bf16_dout) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dinp[j] = stored(__fadd_rn(0.0f, __fmul_rn(inp[j] > 0.0f ? __fmul_rn(2.0f, inp[j]) : 0.0f,
                                               read_dout(dout[j], bf16_dout))),
                     round_bf16);
}

// dst[i] = the FP32 value of BF16 bits src[i] (exact).
__global__ void bf16_to_f32_kernel(float* dst, const uint16_t* src, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = bf16_to_f32(src[i]);
}

// x = bf16_round(x): the emulator's function, bitwise.
__global__ void round_to_bf16_inplace_kernel(float* x, int64_t n) {
  grid_stride_by4(
      n, aligned16(x),
      [&](int64_t j) {
        float4 v = reinterpret_cast<float4*>(x)[j];
        v.x = bf16_round(v.x);
        v.y = bf16_round(v.y);
        v.z = bf16_round(v.z);
        v.w = bf16_round(v.w);
        reinterpret_cast<float4*>(x)[j] = v;
      },
      [&](int64_t i) { x[i] = bf16_round(x[i]); });
}

// out = a + b, FP32 RN (then bf16_round when round_bf16): bitwise.
__global__ void residual_forward_kernel(float* out, const float* a, const float* b, int64_t n,
                                        bool round_bf16) {
  grid_stride_by4(
      n, aligned16(out) && aligned16(a) && aligned16(b),
      [&](int64_t j) {
        const float4 u = reinterpret_cast<const float4*>(a)[j],
                     w = reinterpret_cast<const float4*>(b)[j];
        reinterpret_cast<float4*>(out)[j] = make_float4(
            stored(__fadd_rn(u.x, w.x), round_bf16), stored(__fadd_rn(u.y, w.y), round_bf16),
            stored(__fadd_rn(u.z, w.z), round_bf16), stored(__fadd_rn(u.w, w.w), round_bf16));
      },
      [&](int64_t i) { out[i] = stored(__fadd_rn(a[i], b[i]), round_bf16); });
}

// residual_forward_kernel with b kept as BF16 bits (b16 8-byte aligned for the vector path).
__global__ void residual_forward_bf16_kernel(float* out, const float* a, const uint16_t* b16,
                                             int64_t n, bool round_bf16) {
  grid_stride_by4(
      n, aligned16(out) && aligned16(a) && (reinterpret_cast<uintptr_t>(b16) & 7u) == 0,
      [&](int64_t j) {
        const float4 u = reinterpret_cast<const float4*>(a)[j];
        const uint2 w = reinterpret_cast<const uint2*>(b16)[j];
        const float w0 = __uint_as_float(w.x << 16), w1 = __uint_as_float(w.x & 0xFFFF0000u),
                    w2 = __uint_as_float(w.y << 16), w3 = __uint_as_float(w.y & 0xFFFF0000u);
        reinterpret_cast<float4*>(out)[j] = make_float4(
            stored(__fadd_rn(u.x, w0), round_bf16), stored(__fadd_rn(u.y, w1), round_bf16),
            stored(__fadd_rn(u.z, w2), round_bf16), stored(__fadd_rn(u.w, w3), round_bf16));
      },
      [&](int64_t i) { out[i] = stored(__fadd_rn(a[i], bf16_to_f32(b16[i])), round_bf16); });
}

// SwiGLU on inp (N, 2F) = [gate | up] per row: the emulator's expressions in its order, CUDA expf
// instead of glibc's exp (a few ulp).
__global__ void swiglu_forward_kernel(float* out, const float* inp, int64_t N, int64_t F,
                                      bool round_bf16) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < N * F;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = e / F, i = e - n * F;
    const float g = inp[n * 2 * F + i], u = inp[n * 2 * F + F + i];
    out[e] = stored(__fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u), round_bf16);
  }
}

__global__ void swiglu_backward_kernel(float* dinp, const float* inp, const float* dout, int64_t N,
                                       int64_t F, bool round_bf16, bool bf16_dout) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < N * F;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = e / F, i = e - n * F;
    const float g = inp[n * 2 * F + i], u = inp[n * 2 * F + F + i];
    const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g)));
    const float silu = __fmul_rn(g, sig);
    const float dy = read_dout(dout[e], bf16_dout);
    const float dsilu = __fmul_rn(sig, __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, sig))));
    dinp[n * 2 * F + i] =
        stored(__fadd_rn(0.0f, __fmul_rn(__fmul_rn(dy, u), dsilu)), round_bf16);  // written
    dinp[n * 2 * F + F + i] = stored(__fadd_rn(0.0f, __fmul_rn(dy, silu)), round_bf16);
  }
}

// ---- cross-entropy ----------------------------------------------------------------------------

// One block per row n of logits (N,V): kCeThreads threads, or 256 for V < 4096 (a byte-level
// vocabulary would leave most of them idle). Thread t owns the chunks c = t, t + blockDim, ... of
// kCeVec consecutive logits [kCeVec c, kCeVec c + kCeVec) (the last one cut at V), and walks its
// logits chunk by chunk in increasing index. max: exact; p = exp(z - max) computed as
// exp2_ftz((z - max) log2 e) (gpu/exp2.cuh; as torch.compile's kernels compute it: one MUFU.EX2
// where CUDA's expf takes eight instructions; a few ulp for the probabilities that matter, up to
// |z - max| ulp for the tiny ones, +0 below 2^-126); sum: each thread's sequential sum in that
// order, then block_sum (FP32 tree); probs (N,V) = p / sum; losses (N) = -logf(probs[target])
// (CUDA logf), except where the target's exp2_ftz flushed to +0: then its expf (a finite loss).
// Bounded against the emulator (tree sum, its expf, logf); the tree depends only on V (the thread
// count and the chunking), never on the storage types or the pointers' alignment, so the FP32 and
// the BF16-bits instantiations give the same bits.
// kGrad (crossentropy_softmax_forward_backward): the third pass writes, instead of each
// probability, crossentropy_softmax_backward_kernel's expression on it, (p - onehot) * dlosses[n]
// then bf16_round when round_bf16: the bits of the two kernels in turn, without the probabilities'
// write and read.
// bf16_logits: each logit is read as bf16_round(logit) (the model's BF16 storage of the logits,
// applied here instead of by a pass over them after the GEMM).
// kCached (the row fits in shared memory): the first pass copies the row there as it is stored (In:
// BF16 bits take 2 bytes a logit, so two CTAs share an SM at V = 50304 and one's loads overlap the
// other's arithmetic), the second and third read it from there: the logits are read from memory
// once. Without it the passes read the logits from memory again. The exponentials are computed in
// the second pass and again in the third (the same expression on the same value: the same bits).
// Memory: chunks move as 16-byte vectors (`vec`: V a multiple of the vector's elements and the
// pointers 16-byte aligned), else element by element; kCeBatch chunks are loaded before the first
// is used. The same values in the same order either way.
constexpr int kCeThreads = 512;
constexpr int kCeVec = 8;    // logits a chunk: 16 bytes of BF16 bits
constexpr int kCeBatch = 4;  // chunks a thread has in flight in the first pass

// Out = uint16_t (kGrad with round_bf16 only): the written values stored as BF16 bits, the same
// numbers (each is BF16-rounded) in half the bytes.
// In = uint16_t: the logits kept as BF16 bits (read widened: the values bf16_logits reads).
// (no alignas(16): it made ptxas spill 24 bytes in the cached BF16 kernel; a chunk lives in
// registers, where the 16-byte views of it cost nothing)
template <class T>
struct CeChunk {
  T v[kCeVec];
};

// chunk c of row z (count = its logits: kCeVec, or fewer for the last), as stored
template <class T>
__device__ __forceinline__ CeChunk<T> ce_load(const T* z, int64_t c, int count, bool vec) {
  CeChunk<T> k;
  if (vec && count == kCeVec) {
    static_assert(sizeof(CeChunk<T>) % 16 == 0, "a chunk is whole 16-byte vectors");
#pragma unroll
    for (int q = 0; q < static_cast<int>(sizeof(CeChunk<T>) / 16); ++q)
      reinterpret_cast<uint4*>(&k)[q] = reinterpret_cast<const uint4*>(z + c * kCeVec)[q];
  } else {
#pragma unroll
    for (int u = 0; u < kCeVec; ++u)
      if (u < count) k.v[u] = z[c * kCeVec + u];
  }
  return k;
}

template <class T>
__device__ __forceinline__ void ce_store(T* p, int64_t c, int count, bool vec,
                                         const CeChunk<T>& k) {
  if (vec && count == kCeVec) {
#pragma unroll
    for (int q = 0; q < static_cast<int>(sizeof(CeChunk<T>) / 16); ++q)
      reinterpret_cast<uint4*>(p + c * kCeVec)[q] = reinterpret_cast<const uint4*>(&k)[q];
  } else {
#pragma unroll
    for (int u = 0; u < kCeVec; ++u)
      if (u < count) p[c * kCeVec + u] = k.v[u];
  }
}

// a / b for many a and one b, the bits of __fdiv_rn(a, b): y is the reciprocal that the division's
// fast path refines from rcp.approx (one Newton step), q0 = a y, and the remainder's correction
// q = q0 + y (a - b q0) (Markstein): the fast path's own instructions, with y made once instead of
// for every quotient. Used only where that path is exact and the division takes it: b in [1, 2^24]
// and a in [2^-64, 1], so that a / b and the remainder are normal (a softmax: b >= 1 is the sum
// with the maximum's exp(0) = 1 in it, a <= 1). `fast` false: every quotient by __fdiv_rn.
// (tests/gpu: CeDivisionEqualsFdivRn compares it with __fdiv_rn on 2^26 pairs and the range's ends)
struct SumDivisor {
  static constexpr float kMinDividend = 0x1p-64f;
  float b, y;
  bool fast;
  __device__ __forceinline__ float quotient(float a) const {
    const float q0 = __fmaf_rn(y, a, 0.0f);
    return __fmaf_rn(y, __fmaf_rn(-b, q0, a), q0);
  }
};
__device__ __forceinline__ SumDivisor sum_divisor(float b) {
  float y0;
  asm("rcp.approx.f32 %0, %1;" : "=f"(y0) : "f"(b));
  return {b, __fmaf_rn(y0, __fmaf_rn(-b, y0, 1.0f), y0), b >= 1.0f && b <= 0x1p24f};
}

// The test's entry: for `pairs` pseudo-random (a, b) in the ranges above (every a exponent in
// [-64, 0], b in [1, 2^24]) and the ends of both, the number of quotients that differ from
// __fdiv_rn in any bit.
__global__ void ce_division_check_kernel(unsigned long long* mismatches, int64_t pairs,
                                         uint64_t seed) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < pairs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t x = seed + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;  // splitmix64
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    const uint32_t lo = static_cast<uint32_t>(x), hi = static_cast<uint32_t>(x >> 32);
    // a: exponent -64..0, any mantissa (a = 1 exactly when the exponent is 0 and the mantissa 0)
    const int ea = static_cast<int>(lo % 65u) - 64;
    float a = __uint_as_float((static_cast<uint32_t>(ea + 127) << 23) | (hi & 0x7FFFFFu));
    if (ea == 0) a = 1.0f;
    // b: exponent 0..23, any mantissa, or an end of the range
    const int eb = static_cast<int>((lo >> 8) % 24u);
    float b = __uint_as_float((static_cast<uint32_t>(eb + 127) << 23) |
                              ((hi >> 9) | (lo << 23)) & 0x7FFFFFu);
    if ((lo >> 16) % 64u == 0) b = (lo >> 22) & 1 ? 1.0f : 0x1p24f;
    if ((lo >> 24) % 64u == 1) a = SumDivisor::kMinDividend;
    const SumDivisor d = sum_divisor(b);
    if (!d.fast || __float_as_uint(d.quotient(a)) != __float_as_uint(__fdiv_rn(a, b)))
      atomicAdd(mismatches, 1ull);
  }
}

template <bool kGrad, bool kCached, class Out = float, class In = float>
__global__ void __launch_bounds__(kCeThreads, 2)
    crossentropy_softmax_forward_kernel(float* losses, Out* probs, const In* logits,
                                        const int32_t* targets, int64_t V, const float* dlosses,
                                        bool round_bf16, bool bf16_logits, bool vec_in,
                                        bool vec_out) {
  static_assert(kGrad || std::is_same_v<Out, float>,
                "BF16 output is for the gradient (dlogits) only");
  extern __shared__ uint4 ce_smem[];  // kCached: the row's logits as stored
  In* const row = reinterpret_cast<In*>(ce_smem);
  const int64_t n = blockIdx.x;
  const In* z = logits + n * V;
  Out* p = probs + n * V;
  const int64_t chunks = (V + kCeVec - 1) / kCeVec, step = blockDim.x;
  auto count_of = [&](int64_t c) {
    return static_cast<int>(V - c * kCeVec < kCeVec ? V - c * kCeVec : kCeVec);
  };
  auto value = [&](In s) {
    if constexpr (std::is_same_v<In, uint16_t>)
      return bf16_to_f32(s);
    else
      return bf16_logits ? bf16_round(s) : s;
  };
  // f(c, count, chunk) for this thread's chunks in increasing order: from memory, kCeBatch loads in
  // flight (each chunk is read before this thread writes it, so an output that aliases the logits
  // is still safe), or from the cache
  auto for_each_chunk = [&](bool from_cache, auto&& f) {
    constexpr int batch = kCached ? kCeBatch : 2;  // (the uncached passes: fewer, so no spills)
    int64_t c = threadIdx.x;
    if (!from_cache) {
      for (; c + (batch - 1) * step < chunks; c += batch * step) {
        CeChunk<In> k[batch];
#pragma unroll
        for (int b = 0; b < batch; ++b)
          k[b] = ce_load(z, c + b * step, count_of(c + b * step), vec_in);
#pragma unroll
        for (int b = 0; b < batch; ++b) f(c + b * step, count_of(c + b * step), k[b]);
      }
    }
    for (; c < chunks; c += step)
      f(c, count_of(c),
        from_cache ? ce_load(row, c, count_of(c), true) : ce_load(z, c, count_of(c), vec_in));
  };
  // g(u) on the chunk's logits u < count, in increasing u: a whole chunk (the common case) without
  // a test per logit
  auto each = [&](int count, auto&& g) {
    if (count == kCeVec) {
#pragma unroll
      for (int u = 0; u < kCeVec; ++u) g(u);
    } else {
#pragma unroll
      for (int u = 0; u < kCeVec; ++u)
        if (u < count) g(u);
    }
  };
  float m = -INFINITY;
  for_each_chunk(false, [&](int64_t c, int count, const CeChunk<In>& k) {
    if (kCached) ce_store(row, c, count, true, k);
    each(count, [&](int u) { m = max_skip_nan(m, value(k.v[u])); });
  });
  const float maxv = block_max(m);  // (ends with a barrier: the cached row is complete)
  // e^(z - max) as 2^((z - max) log2 e): one subtraction, one multiplication, one MUFU.EX2
  auto exp_of = [&](In z_u) { return exp2_ftz(__fmul_rn(__fsub_rn(value(z_u), maxv), kLog2e)); };
  float s = 0.0f;
  for_each_chunk(kCached, [&](int64_t, int count, const CeChunk<In>& k) {
    each(count, [&](int u) { s = __fadd_rn(s, exp_of(k.v[u])); });
  });
  const float sum = block_sum(s);
  const int64_t target = targets[n];
  // the loss before the third pass, which may overwrite the logits when the output aliases them
  // (exp_of flushes below 2^-126, a target more than ~87.3 below the row's maximum: there expf's
  // subnormal keeps the loss finite, as the emulator's is, up to a gap of ~103.9)
  if (threadIdx.x == 0) {
    const In zt = kCached ? row[target] : z[target];
    float et = exp_of(zt);
    if (et == 0.0f) et = expf(__fsub_rn(value(zt), maxv));
    losses[n] = -logf(__fdiv_rn(et, sum));
  }
  __syncthreads();
  const float dl = kGrad ? dlosses[n] : 0.0f;
  const SumDivisor div = sum_divisor(sum);
  for_each_chunk(kCached, [&](int64_t c, int count, const CeChunk<In>& k) {
    float prob[kCeVec];
    bool fast =
        div.fast;  // every quotient of the chunk in div's fast range (else all by __fdiv_rn)
    each(count, [&](int u) {
      const float e = exp_of(k.v[u]);
      prob[u] = div.quotient(e);
      fast = fast && e >= SumDivisor::kMinDividend;
    });
    if (!fast) each(count, [&](int u) { prob[u] = __fdiv_rn(exp_of(k.v[u]), sum); });
    const int64_t t_off = target - c * kCeVec;  // the target's place in this chunk, if it is here
    const int tu = t_off >= 0 && t_off < kCeVec ? static_cast<int>(t_off) : -1;
    CeChunk<Out> o;
    auto put = [&](int u, float g) {
      if constexpr (std::is_same_v<Out, uint16_t>)
        o.v[u] = bf16_rne(g);
      else
        o.v[u] = kGrad ? stored(g, round_bf16) : prob[u];
    };
    // (p - onehot) dl; a chunk without the target (all but one of a row's) as p dl: p - 0 is p
    if (!kGrad || tu < 0)
      each(count, [&](int u) { put(u, __fmul_rn(prob[u], dl)); });
    else
      each(count, [&](int u) { put(u, __fmul_rn(__fsub_rn(prob[u], u == tu ? 1.0f : 0.0f), dl)); });
    ce_store(p, c, count, vec_out, o);
  });
}

bool g_crossentropy_cached = true;

// The most dynamic shared memory the cached cross-entropy kernel may use on the current device: the
// per-block opt-in limit less the kernel's static shared memory (block_max and block_sum), allowed
// once per instantiation and device (V = 50304 needs 98.3 KiB as BF16 bits, 196.5 KiB as FP32, of
// the H200's 227 KiB); the cache is guarded (several host threads may launch).
template <bool kGrad, class Out, class In>
size_t crossentropy_cache_bytes() {
  static std::mutex mutex;
  static std::map<int, size_t> limits;  // by device
  int device = 0;
  FP4SIM_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  const auto it = limits.find(device);
  if (it != limits.end()) return it->second;
  int optin = 0;
  FP4SIM_CUDA_CHECK(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes fa{};
  FP4SIM_CUDA_CHECK(
      cudaFuncGetAttributes(&fa, crossentropy_softmax_forward_kernel<kGrad, true, Out, In>));
  const size_t dynamic = static_cast<size_t>(optin) > fa.sharedSizeBytes
                             ? static_cast<size_t>(optin) - fa.sharedSizeBytes
                             : 0;
  FP4SIM_CUDA_CHECK(cudaFuncSetAttribute(crossentropy_softmax_forward_kernel<kGrad, true, Out, In>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(dynamic)));
  // (the most shared memory an SM has, so two CTAs of a BF16 row fit side by side)
  FP4SIM_CUDA_CHECK(cudaFuncSetAttribute(crossentropy_softmax_forward_kernel<kGrad, true, Out, In>,
                                         cudaFuncAttributePreferredSharedMemoryCarveout,
                                         static_cast<int>(cudaSharedmemCarveoutMaxShared)));
  limits[device] = dynamic;
  return dynamic;
}

// Launches the cross-entropy kernel, with the row cached in shared memory when it fits.
template <bool kGrad, class Out = float, class In = float>
void launch_crossentropy(float* losses, Out* out, const In* logits, const int32_t* targets,
                         int64_t N, int64_t V, const float* dlosses, bool round_bf16,
                         bool bf16_logits, cudaStream_t stream) {
  // (a row's chunks are whole 16-byte vectors when V is a multiple of a vector's elements)
  const bool vec_in = V % static_cast<int64_t>(16 / sizeof(In)) == 0 && aligned16(logits);
  const bool vec_out = V % static_cast<int64_t>(16 / sizeof(Out)) == 0 && aligned16(out);
  const size_t bytes = (static_cast<size_t>((V + kCeVec - 1) / kCeVec) * kCeVec) * sizeof(In);
  const unsigned threads = V >= 4096 ? kCeThreads : 256;
  if (g_crossentropy_cached && bytes <= crossentropy_cache_bytes<kGrad, Out, In>()) {
    crossentropy_softmax_forward_kernel<kGrad, true, Out, In>
        <<<static_cast<unsigned>(N), threads, bytes, stream>>>(
            losses, out, logits, targets, V, dlosses, round_bf16, bf16_logits, vec_in, vec_out);
  } else {
    crossentropy_softmax_forward_kernel<kGrad, false, Out, In>
        <<<static_cast<unsigned>(N), threads, 0, stream>>>(
            losses, out, logits, targets, V, dlosses, round_bf16, bf16_logits, vec_in, vec_out);
  }
  FP4SIM_CUDA_CHECK_LAUNCH();
}

// dlogits (N,V) = (probs - onehot(target)) * dlosses[n], each step RN, then bf16_round when
// round_bf16: bitwise. Written, not accumulated (no zeroing pass before, no rounding pass after).
__global__ void crossentropy_softmax_backward_kernel(float* dlogits, const float* probs,
                                                     const int32_t* targets, const float* dlosses,
                                                     int64_t N, int64_t V, bool round_bf16) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < N * V;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = e / V, i = e % V;
    const float indicator = i == targets[n] ? 1.0f : 0.0f;
    dlogits[e] = stored(__fmul_rn(__fsub_rn(probs[e], indicator), dlosses[n]), round_bf16);
  }
}

// ---- optimizer --------------------------------------------------------------------------------

// emu/optim.hpp's adamw_element on every element: bitwise.
__global__ void adamw_kernel(float* params, const float* grads, float* m, float* v, int64_t n,
                             AdamWStep step) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x)
    adamw_element(params[j], grads[j], m[j], v[j], step);
}

// adamw_update_many's one launch: CTA b updates the element range of work item b, a piece of at
// most kAdamWItemElems elements of one tensor, with that tensor's step (one of up to kAdamWSteps
// distinct ones, passed by value). adamw_element on every element: bitwise. Four elements a load
// where `vec` (the four arrays 16-byte aligned; the range's head and tail one by one).
constexpr int kAdamWSteps = 4;
constexpr int64_t kAdamWItemElems = 4 * 4 * kThreads;  // four float4s a thread
struct AdamWSteps {
  AdamWStep s[kAdamWSteps];
};
struct AdamWItem {
  int64_t begin, end;  // elements [begin, end) of the flat arrays
  int64_t step;        // index into AdamWSteps
};
// p16 (non-null): the BF16 bits of each updated parameter too (bf16_rne: narrow_to_bf16's), 8-byte
// aligned when `vec`.
__global__ void adamw_many_kernel(float* params, const float* grads, float* m, float* v,
                                  const AdamWItem* items, AdamWSteps steps, bool vec,
                                  uint16_t* p16) {
  const AdamWItem it = items[blockIdx.x];
  const AdamWStep s = steps.s[it.step];
  const int64_t a4 =
      vec ? (it.begin + 3) / 4 * 4 < it.end ? (it.begin + 3) / 4 * 4 : it.end : it.end;
  const int64_t nv = (it.end - a4) / 4, e4 = a4 + 4 * nv;
  auto one = [&](int64_t i) {
    adamw_element(params[i], grads[i], m[i], v[i], s);
    if (p16) p16[i] = bf16_rne(params[i]);
  };
  for (int64_t i = it.begin + threadIdx.x; i < a4; i += blockDim.x) one(i);
  for (int64_t j = threadIdx.x; j < nv; j += blockDim.x) {
    const int64_t i = a4 + 4 * j;
    float4 p = *reinterpret_cast<float4*>(params + i), mm = *reinterpret_cast<float4*>(m + i),
           vv = *reinterpret_cast<float4*>(v + i);
    const float4 g = *reinterpret_cast<const float4*>(grads + i);
    adamw_element(p.x, g.x, mm.x, vv.x, s);
    adamw_element(p.y, g.y, mm.y, vv.y, s);
    adamw_element(p.z, g.z, mm.z, vv.z, s);
    adamw_element(p.w, g.w, mm.w, vv.w, s);
    *reinterpret_cast<float4*>(params + i) = p;
    *reinterpret_cast<float4*>(m + i) = mm;
    *reinterpret_cast<float4*>(v + i) = vv;
    if (p16)
      *reinterpret_cast<uint2*>(p16 + i) = make_uint2(
          static_cast<uint32_t>(bf16_rne(p.x)) | static_cast<uint32_t>(bf16_rne(p.y)) << 16,
          static_cast<uint32_t>(bf16_rne(p.z)) | static_cast<uint32_t>(bf16_rne(p.w)) << 16);
  }
  for (int64_t i = e4 + threadIdx.x; i < it.end; i += blockDim.x) one(i);
}

// sum x^2 in FP64 of tensor y = blockIdx.y, elements [offset, offset + count) of base (seg: the
// (offset, count) pairs): each product (double)x * (double)x is exact; each thread of a fixed grid
// (kSumSquaresBlocks x kThreads per tensor) sums its grid-strided elements in increasing index,
// block_sum per block into partial (tensor, kSumSquaresBlocks); a second pass, one block per
// tensor, sums a tensor's partials the same way. The tree depends only on the count:
// deterministic, identical on every GPU, and the same whether a tensor is summed alone or with
// others.
__global__ void sum_squares_partial_kernel(double* partial, const float* base, const int64_t* seg) {
  const float* x = base + seg[2 * blockIdx.y];
  const int64_t n = seg[2 * blockIdx.y + 1];
  double s = 0.0;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double d = static_cast<double>(x[j]);
    s = __dadd_rn(s, __dmul_rn(d, d));
  }
  s = block_sum(s);
  if (threadIdx.x == 0) partial[static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x] = s;
}

__global__ void sum_partials_kernel(double* out, const double* partial, int64_t per_tensor) {
  const double* p = partial + static_cast<int64_t>(blockIdx.x) * per_tensor;
  double s = 0.0;
  for (int64_t j = threadIdx.x; j < per_tensor; j += blockDim.x) s = __dadd_rn(s, p[j]);
  s = block_sum(s);
  if (threadIdx.x == 0) out[blockIdx.x] = s;
}

// ---- cuBLASLt ---------------------------------------------------------------------------------

// Largest power of two (<= 256) dividing the address: the alignment cuBLASLt may assume.
uint32_t pointer_alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && (a % align) != 0) align >>= 1;
  return align;
}

}  // namespace

void set_crossentropy_cached(bool on) { g_crossentropy_cached = on; }

namespace {
uint64_t g_fused_bias_backward = 0;         // fused_bias_backward_count
uint64_t g_fused_activation_quantize = 0;   // fused_activation_quantize_count
uint64_t g_fused_activation_matmul = 0;     // fused_activation_matmul_count
bool g_activation_fusion = true;            // set_activation_fusion
bool g_matmul_bf16_epilogue = true;         // set_matmul_bf16_epilogue
uint64_t g_matmul_bf16_epilogue_calls = 0;  // matmul_bf16_epilogue_count
std::string g_last_epilogue_refusal;        // last_matmul_epilogue_refusal
uint64_t g_weight_shadow_reads = 0;         // weight_shadow_read_count
uint64_t g_fused_matmul_bias = 0;           // fused_matmul_bias_count
int g_matmul_pick = kPlanOwnPick;           // set_matmul_heuristic_pick
MatmulPlanPick g_last_matmul_pick;          // last_matmul_plan_pick
}  // namespace

void set_matmul_heuristic_pick(int index) {
  if (index < kPlanOwnPick || index > kMaxHeuristicPick)
    throw std::invalid_argument("set_matmul_heuristic_pick: index " + std::to_string(index) +
                                " is outside " + std::to_string(kPlanOwnPick) + ".." +
                                std::to_string(kMaxHeuristicPick));
  g_matmul_pick = index;
}

MatmulPlanPick last_matmul_plan_pick() { return g_last_matmul_pick; }

// Where the heuristic's first algorithm for a training matmul (lt_matmul's column-major m x n x k,
// BF16 operands) is measurably not its best (H200, cuBLASLt 13.1, bench_gemm BM_GpuMatmulPicks at
// every index 0..7, validation/perf.md, twelfth and thirteenth sessions), the index its plan takes:
// - 1 for a Wgrad (NT: !transa, transb) whose k is at least 4 max(m, n) over at least 2^21 outputs:
//   gpt2-124m's MLP Wgrads, 768 x 3072 and 3072 x 768 over k = 16384 tokens, 208.0 -> 202.3 and
//   214.0 -> 201.9 us (the smaller Wgrads, 768 x 2304 and 768 x 768, ran best at 0 or within 1%);
// - 6 for a tall output over a short k (n >= 4 max(m, k), k <= 1024): the Fprops of the QKV,
//   projection and FC layers and the Dgrads of the projection and FC2 layers, 130.9 -> 115.6,
//   65.8 -> 60.8, 161.7 -> 140.1, 67.9 -> 62.5 and 163.0 -> 139.8 us (at k = 2304 and 3072 no index
//   was more than 2% faster than 0).
// 0 everywhere else, for FP32 operands, and off Hopper or off cuBLASLt 13.1.x (the list's order is
// the release's). The same fixed-rule approach as the FP8 and FP4 plans' fp8_preferred_algo and
// bf16_preferred_algo (gpu/gemm_cublaslt.cu): no timing at run time, so every run of a
// configuration multiplies with the same algorithm and gets the same bits.
int matmul_preferred_algo(bool rules_active, bool bf16, bool transa, bool transb, int64_t m,
                          int64_t n, int64_t k) {
  if (!rules_active || !bf16) return 0;
  if (!transa && transb && k >= 4 * std::max(m, n) && m * n >= (int64_t{1} << 21)) return 1;
  if (n >= 4 * std::max(m, k) && k <= 1024) return 6;
  return 0;
}

// State of the training ops, owned by CudaBackend::LayersState (below).
namespace training_ops {

using gpu::DeviceScratch;  // gpu/device_scratch.hpp

// One matmul's cuBLASLt descriptors, destroyed with it.
struct LtDescriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  LtDescriptors() = default;
  LtDescriptors(const LtDescriptors&) = delete;
  LtDescriptors& operator=(const LtDescriptors&) = delete;
  ~LtDescriptors() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (ld) cublasLtMatrixLayoutDestroy(ld);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// The matmuls' own cuBLASLt handle and workspace (gpu/gemm_cublaslt.cu keeps its own), and their
// plans: descriptors and the heuristic's algorithm per (operand type, transposes, m, n, k, leading
// dimensions, pointer alignments), built on a matmul's first call with them and reused after (the
// heuristic answers the same for the same question, so the algorithm, and the bits, are those of a
// per-call query; the host skips four descriptor builds and a heuristic query a GEMM).
struct CublasLt {
  struct Plan {
    std::unique_ptr<LtDescriptors> d;
    cublasLtMatmulAlgo_t algo{};
    bool supported =
        true;  // false: a BF16-output or bias-epilogue question cuBLASLt has no algorithm for
  };
  // (the last two: D stored as BF16, a bias epilogue)
  using PlanKey = std::tuple<bool, bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t,
                             uint32_t, uint32_t, uint32_t, int, bool, bool>;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  bool rules_active = false;  // matmul_preferred_algo's rules apply (Hopper, cuBLASLt 13.1.x)
  std::map<PlanKey, Plan> plans;
  CublasLt() = default;
  CublasLt(const CublasLt&) = delete;
  CublasLt& operator=(const CublasLt&) = delete;
  ~CublasLt() {
    plans.clear();  // (the descriptors before the handle, as they were made)
    if (workspace) cudaFree(workspace);
    if (handle) cublasLtDestroy(handle);
  }
};

// The RoPE cos/sin table (T, HD/2, 2) for head size HD and positions 0..T-1.
struct RopeTable {
  DeviceScratch device;
  std::vector<float> host;  // kept: the source of the asynchronous upload
  int64_t T = 0, HD = 0;
};

}  // namespace training_ops

struct CudaBackend::LayersState {
  training_ops::CublasLt lt;                           // created on the first matmul
  training_ops::DeviceScratch bf16_a, bf16_b, bf16_c;  // BF16 operands of the matmuls
  training_ops::DeviceScratch
      f32_out;  // matmul_forward_bf16's FP32 output where the epilogue does not write BF16
  training_ops::DeviceScratch
      f32_dout;  // matmul_backward_bf16_dout's dout widened, FP32 GEMMs only (kept, as
                 // the others; no training configuration pairs BF16 activations with them)
  training_ops::DeviceScratch bias16;   // a bias's BF16 bits for the BF16-output epilogue
  training_ops::DeviceScratch columns;  // partial column sums
  training_ops::DeviceScratch
      att_dsum;  // attention backward rowsum(dO*O), then lse*log2(e): 2 x (B,NH,T)
  training_ops::DeviceScratch att_qkv16, att_dout16;  // attention's BF16 copies of qkv and dout
  training_ops::DeviceScratch att_ds;                 // attention backward's stored bf16(dS) tiles
  training_ops::DeviceScratch gelu_lut;               // GELU's BF16 output bits by input bits
  int gelu_lut_ctas = 0;  // the table's kernel's grid, one CTA an SM (0: the table is not made yet)
  training_ops::DeviceScratch sort_keys, sort_rows_in, sort_rows_out, sort_temp;  // embedding bwd
  training_ops::DeviceScratch sums;         // sum_squares partials and results
  training_ops::DeviceScratch segments;     // sum_squares (offset, count) pairs
  training_ops::DeviceScratch adamw_items;  // adamw_update_many's work items (AdamWItem)
  std::vector<int64_t> adamw_key;           // the (offset, count, step index) they were made for
  int64_t adamw_item_count = 0;
  training_ops::RopeTable rope;
  std::vector<int64_t> host_segments;
};

CudaBackend::LayersState& CudaBackend::layers_state() {
  if (!layers_) layers_ = std::make_shared<LayersState>();
  return *layers_;
}

namespace {

using training_ops::CublasLt;
using training_ops::LtDescriptors;
using training_ops::RopeTable;

// D (col-major m x n, ld m) = op(A) op(B) + beta * D, FP32 accumulation and output
// (CUBLAS_COMPUTE_32F: no TF32), operands BF16 (`bf16`) or FP32. A is stored (m x k) col-major
// with ld lda, or (k x m) when transa; B is (k x n), or (n x k) when transb. beta = 1 accumulates:
// D = fl(acc + D), the emulator's `d += gemm` given the GEMM's FP32 value.
// d_bf16: D stored as BF16 bits (the epilogue's RNE of the FP32 value; beta 0 only). bias (m values
// of D's type, BF16 bits for a BF16 D, or null): D = fl(acc + bias[row]) in the epilogue, then the
// rounding: the bits of add_bias(_bf16) after the GEMM (tests:
// LayersGpu.MatmulBf16EpilogueRoundsLikeAddBias). cuBLASLt 13.1 on Hopper refuses a BF16 D with an
// FP32 bias (twenty-second session), so the bias takes D's type. Returns false, having run nothing,
// where cuBLASLt has no algorithm for such an output (the caller then takes separate passes); the
// FP32 output without an epilogue always runs (or throws).
bool lt_matmul(CublasLt& lt, bool bf16, bool transa, bool transb, int64_t m, int64_t n, int64_t k,
               const void* A, int64_t lda, const void* B, int64_t ldb, void* D, float beta,
               cudaStream_t stream, bool d_bf16 = false, const void* bias = nullptr) {
  if (d_bf16 && beta != 0.0f)
    throw std::logic_error("lt_matmul: a BF16 output takes beta = 0 only");
  if (!lt.handle) {
    FP4SIM_CUBLAS_CHECK(cublasLtCreate(&lt.handle));
    FP4SIM_CUDA_CHECK(cudaMalloc(&lt.workspace, kCublasWorkspaceBytes));
    int dev = 0, cc_major = 0;
    FP4SIM_CUDA_CHECK(cudaGetDevice(&dev));
    FP4SIM_CUDA_CHECK(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, dev));
    lt.rules_active = cublaslt_picks_measured_here(cc_major, cublasLtGetVersion());
  }
  // The caller's pointers may sit at any float offset inside a larger buffer: the heuristic is
  // told, so it never picks a kernel that assumes 256-byte alignment (and the plan is per
  // alignment).
  const uint32_t align_a = pointer_alignment(A), align_b = pointer_alignment(B),
                 align_d = pointer_alignment(D);
  // the rule's index (matmul_preferred_algo), or the benchmark knob's, which fails the plan where
  // the heuristic's list is shorter; the rule falls back to the first algorithm there
  const bool knob = g_matmul_pick != kPlanOwnPick;
  const int pick =
      knob ? g_matmul_pick : matmul_preferred_algo(lt.rules_active, bf16, transa, transb, m, n, k);
  const CublasLt::PlanKey key{bf16,    transa,
                              transb,  m,
                              n,       k,
                              lda,     ldb,
                              align_a, align_b,
                              align_d, knob ? pick : -1 - pick,
                              d_bf16,  bias != nullptr};
  auto it = lt.plans.find(key);
  if (it == lt.plans.end()) {
    const cudaDataType_t in_type = bf16 ? CUDA_R_16BF : CUDA_R_32F;
    auto owned = std::make_unique<LtDescriptors>();
    LtDescriptors& d = *owned;
    FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = transa ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t tb = transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    FP4SIM_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    FP4SIM_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    FP4SIM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.la, in_type,
                                                   static_cast<uint64_t>(transa ? k : m),
                                                   static_cast<uint64_t>(transa ? m : k), lda));
    FP4SIM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.lb, in_type,
                                                   static_cast<uint64_t>(transb ? n : k),
                                                   static_cast<uint64_t>(transb ? k : n), ldb));
    FP4SIM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.ld, d_bf16 ? CUDA_R_16BF : CUDA_R_32F,
                                                   static_cast<uint64_t>(m),
                                                   static_cast<uint64_t>(n), m));
    if (bias) {
      const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
      const cudaDataType_t bias_type = d_bf16 ? CUDA_R_16BF : CUDA_R_32F;
      FP4SIM_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
      FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                         &bias_type, sizeof bias_type));
      FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                         &bias, sizeof bias));
    }
    FP4SIM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&d.pref));
    const size_t ws = kCublasWorkspaceBytes;
    FP4SIM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    FP4SIM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof align_a));
    FP4SIM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof align_b));
    FP4SIM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d, sizeof align_d));
    FP4SIM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, sizeof align_d));
    cublasLtMatmulHeuristicResult_t heur[kMaxHeuristicPick + 1]{};
    int found = 0;
    const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(lt.handle, d.op, d.la, d.lb, d.ld,
                                                             d.ld, d.pref, pick + 1, heur, &found);
    if ((d_bf16 || bias) && (hs != CUBLAS_STATUS_SUCCESS || found == 0)) {
      g_last_epilogue_refusal = std::string(cublasLtGetStatusName(hs)) + ", " +
                                std::to_string(found) + " algorithms for m=" + std::to_string(m) +
                                " n=" + std::to_string(n) + " k=" + std::to_string(k) +
                                (d_bf16 ? " BF16 D" : " FP32 D") + (bias ? " + bias" : "");
      // (remembered: the question is not asked again)
      lt.plans.emplace(key, CublasLt::Plan{std::move(owned), {}, false});
      return false;
    }
    FP4SIM_CUBLAS_CHECK(hs);
    if (found == 0 || (knob && found <= pick))
      throw std::runtime_error(
          std::string("matmul: cuBLASLt has no ") + (bf16 ? "BF16" : "FP32") + " algorithm" +
          (pick ? " at heuristic index " + std::to_string(pick) : std::string()) +
          " for m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
          " (it lists " + std::to_string(found) + ")");
    const int used = found > pick ? pick : 0;
    g_last_matmul_pick = MatmulPlanPick{lt.rules_active, pick, found, used};
    it = lt.plans.emplace(key, CublasLt::Plan{std::move(owned), heur[used].algo}).first;
  }
  if (!it->second.supported) return false;
  const LtDescriptors& d = *it->second.d;
  if (bias)  // (the plan's descriptor, pointed at this call's bias)
    FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                       &bias, sizeof bias));
  const float alpha = 1.0f;
  FP4SIM_CUBLAS_CHECK(cublasLtMatmul(lt.handle, d.op, &alpha, A, d.la, B, d.lb, &beta, D, d.ld, D,
                                     d.ld, &it->second.algo, lt.workspace, kCublasWorkspaceBytes,
                                     stream));
  return true;
}

// The GEMM operand x (count FP32 values) as the matmul reads it: its BF16 bits in `scratch` for
// GemmPrecision::BF16, x itself for FP32.
const void* gemm_operand(DeviceScratch& scratch, const float* x, int64_t count,
                         emu::GemmPrecision prec, cudaStream_t stream) {
  if (prec == emu::GemmPrecision::FP32) return x;
  uint16_t* h = scratch.get<uint16_t>(static_cast<size_t>(count), stream);
  round_to_bf16_kernel<<<elementwise_grid((count + 3) / 4), kThreads, 0, stream>>>(h, x, count);
  FP4SIM_CUDA_CHECK_LAUNCH();
  return h;
}

// dout's BF16 GEMM operand (in `operand`) and dbias += dout's column sums (partials in `columns`),
// from one pass over the source (round_to_bf16_column_partial_kernel: dout read from memory, or
// computed by GELU's backward pass), then column_sums_finalize: matmul_backward's fused case and
// matmul_backward_activation's, the same launches so the same bits. OC even, the source's pointers
// 8-byte aligned.
// (operand null: dbias only, h not written: Bf16PairBits, whose operand is its source.)
template <class Src>
const uint16_t* bf16_operand_with_bias_grad(DeviceScratch* operand, DeviceScratch& columns,
                                            const Src& src, float* dbias, int64_t N, int64_t OC,
                                            cudaStream_t stream) {
  uint16_t* h = operand ? operand->get<uint16_t>(static_cast<size_t>(N * OC), stream) : nullptr;
  float* partial = columns.get<float>(static_cast<size_t>(column_chunks(N) * OC), stream);
  const dim3 grid(static_cast<unsigned>(column_chunks(N)),
                  static_cast<unsigned>((OC / 2 + kThreads - 1) / kThreads));
  round_to_bf16_column_partial_kernel<<<grid, kThreads, 0, stream>>>(h, partial, src, N, OC);
  FP4SIM_CUDA_CHECK_LAUNCH();
  column_sums_finalize(dbias, partial, N, OC, true, stream);
  return h;
}

// The RoPE table covering positions 0..T-1 for head size HD, built on the host with the
// emulator's exact expressions (emu/elementwise.cpp rope_rotate): freq = base^(-2i/HD) in double,
// angle = t * freq, cos and sin in double rounded to float. Rebuilt when HD changes or T grows.
const float* rope_table(RopeTable& tab, int64_t T, int64_t HD, cudaStream_t stream) {
  if (tab.HD != HD || tab.T < T) {
    const int64_t half = HD / 2;
    tab.host.assign(static_cast<size_t>(T * half * 2), 0.0f);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < half; ++i) {
        const double freq = std::pow(static_cast<double>(kRopeBase),
                                     -2.0 * static_cast<double>(i) / static_cast<double>(HD));
        const double ang = static_cast<double>(t) * freq;
        tab.host[static_cast<size_t>((t * half + i) * 2)] = static_cast<float>(std::cos(ang));
        tab.host[static_cast<size_t>((t * half + i) * 2 + 1)] = static_cast<float>(std::sin(ang));
      }
    float* d = tab.device.get<float>(tab.host.size(), stream);  // (syncs the stream if it grows)
    FP4SIM_CUDA_CHECK(cudaMemcpyAsync(d, tab.host.data(), tab.host.size() * sizeof(float),
                                      cudaMemcpyHostToDevice, stream));
    tab.HD = HD;
    tab.T = T;
  }
  return static_cast<const float*>(tab.device.ptr);
}

}  // namespace

// ---- CudaBackend: the training ops --------------------------------------------------------------

void CudaBackend::embedding_forward(float* out, const int32_t* tokens, const int32_t* pos,
                                    const float* wte, const float* wpe, int64_t N, int64_t C) {
  if (N * C == 0) return;
  embedding_forward_kernel<<<elementwise_grid(N * C), kThreads, 0, stream_>>>(out, tokens, pos, wte,
                                                                              wpe, N, C);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

// Bitwise: rows are sorted stably by id (CUB radix sort: deterministic), then each table row adds
// its dout rows in increasing n (embedding_scatter_kernel).
void CudaBackend::embedding_backward(float* dwte, float* dwpe, const float* dout,
                                     const int32_t* tokens, const int32_t* pos, int64_t N,
                                     int64_t C) {
  require_rows("embedding_backward", N);
  if (N * C == 0) return;
  LayersState& st = layers_state();
  int32_t* rows_in = st.sort_rows_in.get<int32_t>(static_cast<size_t>(N), stream_);
  int32_t* rows_out = st.sort_rows_out.get<int32_t>(static_cast<size_t>(N), stream_);
  int32_t* keys_out = st.sort_keys.get<int32_t>(static_cast<size_t>(N), stream_);
  iota_kernel<<<elementwise_grid(N), kThreads, 0, stream_>>>(rows_in, N);
  FP4SIM_CUDA_CHECK_LAUNCH();
  const int n = static_cast<int>(N);
  for (int table = 0; table < 2; ++table) {
    float* dtable = table == 0 ? dwte : dwpe;
    const int32_t* ids = table == 0 ? tokens : pos;
    if (!dtable) continue;
    size_t temp_bytes = 0;
    FP4SIM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, ids, keys_out, rows_in,
                                                      rows_out, n, 0, 32, stream_));
    void* temp = st.sort_temp.get<unsigned char>(temp_bytes, stream_);
    FP4SIM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, ids, keys_out, rows_in,
                                                      rows_out, n, 0, 32, stream_));
    embedding_scatter_kernel<<<static_cast<unsigned>(N), kThreads, 0, stream_>>>(
        dtable, dout, keys_out, rows_out, N, C);
    FP4SIM_CUDA_CHECK_LAUNCH();
  }
}

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

void CudaBackend::layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                                    const float* weight, const float* bias, int64_t N, int64_t C,
                                    bool round_bf16) {
  require_rows("layernorm_forward", N);
  if (N == 0 || C == 0) return;
  layernorm_forward_launch(out, mean, rstd, inp, weight, bias, N, C, round_bf16, stream_);
}

void CudaBackend::layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                                     const float* inp, const float* weight, const float* mean,
                                     const float* rstd, int64_t N, int64_t C, bool round_bf16,
                                     bool bf16_dout) {
  require_rows("layernorm_backward", N);
  if (N == 0 || C == 0) return;
  float* partial =
      layers_state().columns.get<float>(static_cast<size_t>(2 * column_chunks(N) * C), stream_);
  layernorm_backward_launch(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, round_bf16,
                            bf16_dout, partial, stream_);
}

void CudaBackend::layernorm_backward_bits(float* dinp, float* dweight, float* dbias,
                                          const uint16_t* dout16, const float* inp,
                                          const float* weight, const float* mean, const float* rstd,
                                          int64_t N, int64_t C, bool round_bf16) {
  require_rows("layernorm_backward_bits", N);
  if (N == 0 || C == 0) return;
  float* partial =
      layers_state().columns.get<float>(static_cast<size_t>(2 * column_chunks(N) * C), stream_);
  layernorm_backward_launch(dinp, dweight, dbias, dout16, inp, weight, mean, rstd, N, C, round_bf16,
                            true, partial, stream_);
}

void CudaBackend::rmsnorm_backward_bits(float* dinp, float* dweight, const uint16_t* dout16,
                                        const float* inp, const float* weight, const float* rstd,
                                        int64_t N, int64_t C, bool round_bf16) {
  require_rows("rmsnorm_backward_bits", N);
  if (N == 0 || C == 0) return;
  float* partial =
      layers_state().columns.get<float>(static_cast<size_t>(column_chunks(N) * C), stream_);
  rmsnorm_backward_launch(dinp, dweight, dout16, inp, weight, rstd, N, C, round_bf16, true, partial,
                          stream_);
}

void CudaBackend::rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight,
                                  int64_t N, int64_t C, bool round_bf16) {
  require_rows("rmsnorm_forward", N);
  if (N == 0 || C == 0) return;
  rmsnorm_forward_launch(out, rstd, inp, weight, N, C, round_bf16, stream_);
}

void CudaBackend::rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                                   const float* weight, const float* rstd, int64_t N, int64_t C,
                                   bool round_bf16, bool bf16_dout) {
  require_rows("rmsnorm_backward", N);
  if (N == 0 || C == 0) return;
  float* partial =
      layers_state().columns.get<float>(static_cast<size_t>(column_chunks(N) * C), stream_);
  rmsnorm_backward_launch(dinp, dweight, dout, inp, weight, rstd, N, C, round_bf16, bf16_dout,
                          partial, stream_);
}

// out (N,OC) = inp (N,K) W (OC,K)^T, then + bias. Row-major out is col-major out^T (OC x N) =
// W (op T of the col-major (K x OC) view) * inp^T (the col-major (K x N) view). The BF16 rounding
// of the output rides on the bias pass (one pass instead of two), or has its own without a bias.
void CudaBackend::matmul_forward(float* out, const float* inp, const float* weight,
                                 const float* bias, int64_t N, int64_t K, int64_t OC,
                                 emu::GemmPrecision prec, bool round_bf16) {
  if (N == 0 || OC == 0) return;
  if (K == 0) {
    FP4SIM_CUDA_CHECK(
        cudaMemsetAsync(out, 0, static_cast<size_t>(N * OC) * sizeof(float), stream_));
  } else {
    LayersState& st = layers_state();
    const bool bf16 = prec == emu::GemmPrecision::BF16;
    const void* w = weight_operand(st.bf16_a, weight, OC * K, prec);
    const void* x = gemm_operand(st.bf16_b, inp, N * K, prec, stream_);
    lt_matmul(st.lt, bf16, /*transa=*/true, /*transb=*/false, OC, N, K, w, K, x, K, out, 0.0f,
              stream_);
  }
  if (bias) {
    add_bias(out, bias, N, OC, round_bf16, stream_);
  } else if (round_bf16) {
    round_to_bf16(out, N * OC);
  }
}

// The matmul backward passes' cases without a GEMM: nothing to do for N = 0; for OC = 0 an empty
// sum, dinp written as zeros (the emulator's empty chain) and the rest unchanged. True when the
// caller has nothing left to do.
namespace {
bool matmul_backward_empty(float* dinp, int64_t N, int64_t K, int64_t OC, cudaStream_t stream) {
  if (N == 0) return true;
  if (OC != 0) return false;
  if (dinp && K > 0)
    FP4SIM_CUDA_CHECK(cudaMemsetAsync(dinp, 0, static_cast<size_t>(N * K) * sizeof(float), stream));
  return true;
}
}  // namespace

// dinp (N,K) = dout (N,OC) W (OC,K), written: col-major dinp^T (K x N) = W^T (the (K x OC) view,
// op N) * dout^T (the (OC x N) view, op N), beta = 0 (no zeroing before, no read of dinp).
// dweight (OC,K) += dout^T inp: col-major dweight^T (K x OC) = inp^T (the (K x N) view, op N) *
// dout (op T of the (OC x N) view), beta = 1.
// dbias (OC) += column sums of dout (64-row chunks from +0, summed in order; then one addition).
void CudaBackend::matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                                  const float* inp, const float* weight, int64_t N, int64_t K,
                                  int64_t OC, emu::GemmPrecision prec) {
  if (matmul_backward_empty(dinp, N, K, OC, stream_)) return;
  LayersState& st = layers_state();
  if (dbias && K > 0 && prec == emu::GemmPrecision::BF16 && OC % 2 == 0 && pair_aligned(dout)) {
    // dout's BF16 copy and the bias gradient's chunk sums from one read of dout
    const uint16_t* h = bf16_operand_with_bias_grad(&st.bf16_a, st.columns, Bf16PairMemory{dout},
                                                    dbias, N, OC, stream_);
    matmul_backward_gemms(dinp, dweight, h, inp, weight, N, K, OC, prec);
    ++g_fused_matmul_bias;
    return;
  }
  if (K > 0)
    matmul_backward_gemms(dinp, dweight, gemm_operand(st.bf16_a, dout, N * OC, prec, stream_), inp,
                          weight, N, K, OC, prec);
  if (dbias) bias_backward(dbias, dout, N, OC);
}

// matmul_backward's two GEMMs from dy, dout as the GEMMs read it (BF16 bits, or FP32 at FP32
// precision): the Dgrad writes dinp (if any), the Wgrad adds into dweight (if any); K > 0.
void CudaBackend::matmul_backward_gemms(float* dinp, float* dweight, const void* dy,
                                        const float* inp, const float* weight, int64_t N, int64_t K,
                                        int64_t OC, emu::GemmPrecision prec,
                                        const uint16_t* inp16) {
  LayersState& st = layers_state();
  const bool bf16 = prec == emu::GemmPrecision::BF16;
  const void* w = dinp ? weight_operand(st.bf16_b, weight, OC * K, prec) : nullptr;
  const void* x = !dweight ? nullptr
                  : inp16  ? static_cast<const void*>(inp16)
                           : gemm_operand(st.bf16_c, inp, N * K, prec, stream_);
  if (dinp) lt_matmul(st.lt, bf16, false, false, K, N, OC, w, K, dy, OC, dinp, 0.0f, stream_);
  if (dweight) lt_matmul(st.lt, bf16, false, true, K, OC, N, x, K, dy, OC, dweight, 1.0f, stream_);
}

// matmul_backward (no dbias) with dout in BF16 bits: at BF16 precision the GEMMs read it as it is;
// at FP32 precision it is widened first (exact).
void CudaBackend::matmul_backward_bf16_dout(float* dinp, float* dweight, const uint16_t* dout,
                                            const float* inp, const float* weight, int64_t N,
                                            int64_t K, int64_t OC, emu::GemmPrecision prec) {
  if (matmul_backward_empty(dinp, N, K, OC, stream_) || K == 0) return;
  const void* dy = dout;
  if (prec == emu::GemmPrecision::FP32) {
    float* wide = layers_state().f32_dout.get<float>(static_cast<size_t>(N * OC),
                                                     stream_);  // (FP32 GEMMs only)
    bf16_to_f32_kernel<<<elementwise_grid(N * OC), kThreads, 0, stream_>>>(wide, dout, N * OC);
    FP4SIM_CUDA_CHECK_LAUNCH();
    dy = wide;
  }
  matmul_backward_gemms(dinp, dweight, dy, inp, weight, N, K, OC, prec);
}

// BF16 precision: GELU's pass also writes the GEMM's BF16 operand (out's bits are the op's, src.out
// is written as gelu_forward would); then the matmul as matmul_forward. Else Backend's composition.
void CudaBackend::matmul_forward_activation(float* out, uint16_t* out16,
                                            const ActivationSource& src, const float* weight,
                                            const float* bias, int64_t OC, emu::GemmPrecision prec,
                                            bool round_bf16) {
  const int64_t N = src.rows, K = src.cols;
  if (!g_activation_fusion || prec != emu::GemmPrecision::BF16 ||
      src.op != ActivationOp::GeluForward || N == 0 || K == 0 || OC == 0) {
    Backend::matmul_forward_activation(out, out16, src, weight, bias, OC, prec, round_bf16);
    return;
  }
  LayersState& st = layers_state();
  // (src.out16: the operand is the activation's BF16 storage itself, src.out unwritten)
  uint16_t* x =
      src.out16 ? src.out16 : st.bf16_b.get<uint16_t>(static_cast<size_t>(N * K), stream_);
  float* const act = src.out16 ? nullptr : src.out;
  const bool rb = src.out16 ? true : src.round_bf16;
  if (src.inp16 && !act) {  // (BF16 in, BF16 bits out: the table, made on first use)
    if (st.gelu_lut_ctas == 0) {
      gelu_bf16_table_kernel<<<kGeluLutEntries / kThreads, kThreads, 0, stream_>>>(
          st.gelu_lut.get<uint16_t>(kGeluLutEntries, stream_));
      FP4SIM_CUDA_CHECK_LAUNCH();
      FP4SIM_CUDA_CHECK(cudaFuncSetAttribute(gelu_forward_bf16_lut_kernel,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             kGeluLutEntries * 2));
      int device = 0;
      FP4SIM_CUDA_CHECK(cudaGetDevice(&device));
      FP4SIM_CUDA_CHECK(
          cudaDeviceGetAttribute(&st.gelu_lut_ctas, cudaDevAttrMultiProcessorCount, device));
    }
    const bool vec = aligned16(x) && aligned16(src.inp16);
    gelu_forward_bf16_lut_kernel<<<static_cast<unsigned>(st.gelu_lut_ctas), kGeluLutThreads,
                                   kGeluLutEntries * 2, stream_>>>(
        x, src.inp16, st.gelu_lut.get<uint16_t>(kGeluLutEntries, stream_), N * K, vec);
  } else if (src.inp16)
    gelu_forward_bf16_copy_kernel<<<elementwise_grid((N * K + 3) / 4), kThreads, 0, stream_>>>(
        act, x, src.inp16, N * K, rb, gelu_copy_vectorized(act, x, src.inp16));
  else
    gelu_forward_bf16_copy_kernel<<<elementwise_grid((N * K + 3) / 4), kThreads, 0, stream_>>>(
        act, x, src.inp, N * K, rb, gelu_copy_vectorized(act, x, src.inp));
  FP4SIM_CUDA_CHECK_LAUNCH();
  matmul_forward_bf16(out, out16, nullptr, x, weight, bias, N, K, OC,
                      round_bf16);  // (x: not st.bf16_b's user there)
  ++g_fused_activation_matmul;
}

// BF16 precision with a bias (matmul_backward's fused case): the GEMMs' BF16 operand and the bias
// gradient's chunk sums computed from GELU's backward pass, src.out never written. Else Backend's
// composition.
namespace {
// Whether matmul_backward_activation(_bf16_input) takes GELU's gradient in the pass that makes the
// GEMMs' operand: BF16 precision, a bias, the pairs' pointers aligned.
bool gelu_backward_fusable(const ActivationSource& src, const float* dbias, int64_t K,
                           emu::GemmPrecision prec) {
  const int64_t N = src.rows, OC = src.cols;
  const uintptr_t inp_align = src.inp16 ? reinterpret_cast<uintptr_t>(src.inp16) % 4
                                        : reinterpret_cast<uintptr_t>(src.inp) % 8;
  const uintptr_t dout_align = src.dout16 ? reinterpret_cast<uintptr_t>(src.dout16) % 4
                                          : reinterpret_cast<uintptr_t>(src.dout) % 8;
  return g_activation_fusion && dbias && prec == emu::GemmPrecision::BF16 &&
         src.op == ActivationOp::GeluBackward && N != 0 && K != 0 && OC != 0 && OC % 2 == 0 &&
         inp_align == 0 && dout_align == 0;
}
}  // namespace

// The GEMMs' BF16 operand of GELU's backward pass and the bias gradient's sums (one pass).
const uint16_t* CudaBackend::gelu_backward_operand(const ActivationSource& src, float* dbias) {
  LayersState& st = layers_state();
  auto make = [&](auto pair) {
    return bf16_operand_with_bias_grad(&st.bf16_a, st.columns, pair, dbias, src.rows, src.cols,
                                       stream_);
  };
  const bool rb = src.round_bf16, bd = src.bf16_dout;
  if (src.inp16 && src.dout16)
    return make(Bf16PairGeluBackward<uint16_t, uint16_t>{src.inp16, src.dout16, rb, bd});
  if (src.inp16) return make(Bf16PairGeluBackward<uint16_t, float>{src.inp16, src.dout, rb, bd});
  if (src.dout16) return make(Bf16PairGeluBackward<float, uint16_t>{src.inp, src.dout16, rb, bd});
  return make(Bf16PairGeluBackward<float, float>{src.inp, src.dout, rb, bd});
}

void CudaBackend::matmul_backward_activation(float* dinp, float* dweight, float* dbias,
                                             const ActivationSource& src, const float* inp,
                                             const float* weight, int64_t K,
                                             emu::GemmPrecision prec) {
  const int64_t N = src.rows, OC = src.cols;
  if (!gelu_backward_fusable(src, dbias, K, prec)) {
    Backend::matmul_backward_activation(dinp, dweight, dbias, src, inp, weight, K, prec);
    return;
  }
  const uint16_t* h = gelu_backward_operand(src, dbias);
  matmul_backward_gemms(dinp, dweight, h, inp, weight, N, K, OC, prec);
  ++g_fused_activation_matmul;
}

// ---- BF16-stored activations
// ---------------------------------------------------------------------

namespace {
void require_one_of(const char* op, const char* tensor, const void* f32, const void* bf16) {
  if ((f32 == nullptr) == (bf16 == nullptr))
    throw std::logic_error(std::string(op) + ": exactly one of " + tensor + " and " + tensor +
                           "16 must be given (FP32 or BF16 storage)");
}
}  // namespace

void CudaBackend::set_bf16_weight_shadow(const float* base, const uint16_t* shadow, int64_t n) {
  shadow_base_ = n > 0 ? base : nullptr;
  shadow_ = n > 0 ? shadow : nullptr;
  shadow_n_ = n > 0 ? n : 0;
}

// A weight's BF16 GEMM operand: its bits in the shadow where the whole weight lies in its range,
// else rounded into `scratch` (gemm_operand).
const void* CudaBackend::weight_operand(DeviceScratch& scratch, const float* weight, int64_t count,
                                        emu::GemmPrecision prec) {
  if (prec == emu::GemmPrecision::BF16 && shadow_ && weight >= shadow_base_ && count <= shadow_n_ &&
      weight - shadow_base_ <= shadow_n_ - count) {
    ++g_weight_shadow_reads;
    return shadow_ + (weight - shadow_base_);
  }
  return gemm_operand(scratch, weight, count, prec, stream_);
}

void CudaBackend::narrow_to_bf16(uint16_t* dst, const float* src, int64_t n) {
  if (n <= 0) return;
  round_to_bf16_kernel<<<elementwise_grid((n + 3) / 4), kThreads, 0, stream_>>>(dst, src, n);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void CudaBackend::widen_bf16(float* dst, const uint16_t* src, int64_t n) {
  if (n <= 0) return;
  bf16_to_f32_kernel<<<elementwise_grid(n), kThreads, 0, stream_>>>(dst, src, n);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void CudaBackend::bias_forward_bf16(uint16_t* out16, float* x, const float* bias, int64_t N,
                                    int64_t OC) {
  add_bias_bf16(out16, x, bias, N, OC, stream_);
}

void CudaBackend::layernorm_forward_bf16(uint16_t* out, float* mean, float* rstd, const float* inp,
                                         const float* weight, const float* bias, int64_t N,
                                         int64_t C) {
  require_rows("layernorm_forward_bf16", N);
  if (N == 0 || C == 0) return;
  layernorm_forward_launch(out, mean, rstd, inp, weight, bias, N, C, true, stream_);
}

// One pass: the row kernel adds the residual as it loads the row (residual_forward_bf16's
// expression), writes it, and normalizes it from registers; the base class's two calls where the
// row kernel does not apply (C > 1024, C % 4, pointers not 16-byte aligned).
void CudaBackend::residual_layernorm_forward_bf16(float* res, uint16_t* out, float* mean,
                                                  float* rstd, const float* a, const uint16_t* b16,
                                                  const float* weight, const float* bias, int64_t N,
                                                  int64_t C, bool round_bf16) {
  require_rows("residual_layernorm_forward_bf16", N);
  if (N == 0 || C == 0) return;
  if (!norm_rows_fit(C, res, a, b16, weight, bias)) {
    Backend::residual_layernorm_forward_bf16(res, out, mean, rstd, a, b16, weight, bias, N, C,
                                             round_bf16);
    return;
  }
  layernorm_forward_launch(out, mean, rstd, nullptr, weight, bias, N, C, true, stream_,
                           ResidualIn{res, a, b16, round_bf16});
}

void CudaBackend::rmsnorm_forward_bf16(uint16_t* out, float* rstd, const float* inp,
                                       const float* weight, int64_t N, int64_t C) {
  require_rows("rmsnorm_forward_bf16", N);
  if (N == 0 || C == 0) return;
  rmsnorm_forward_launch(out, rstd, inp, weight, N, C, true, stream_);
}

// matmul_forward's GEMM on the BF16 input bits as they are; a BF16 output (out16) written by
// cuBLASLt's epilogue, the bias added there as BF16 bits (RNE(fl32(acc + bf16(bias))): the bits of
// add_bias_bf16; the bias's bits from the weight shadow where it covers them 16-byte aligned, else
// narrowed into a scratch), where it lists an algorithm for that; else (or with the knob off) the
// FP32 GEMM and one add_bias_bf16 / narrowing pass.
void CudaBackend::matmul_forward_bf16(float* out, uint16_t* out16, const float* inp,
                                      const uint16_t* inp16, const float* weight, const float* bias,
                                      int64_t N, int64_t K, int64_t OC, bool round_bf16) {
  require_one_of("matmul_forward_bf16", "out", out, out16);
  require_one_of("matmul_forward_bf16", "inp", inp, inp16);
  if (N == 0 || OC == 0) return;
  if (K == 0) {  // (an empty sum: the composition's zeros plus bias)
    Backend::matmul_forward_bf16(out, out16, inp, inp16, weight, bias, N, K, OC, round_bf16);
    return;
  }
  LayersState& st = layers_state();
  const emu::GemmPrecision prec = emu::GemmPrecision::BF16;
  const void* w = weight_operand(st.bf16_a, weight, OC * K, prec);
  const void* x =
      inp16 ? static_cast<const void*>(inp16) : gemm_operand(st.bf16_b, inp, N * K, prec, stream_);
  if (out16 && g_matmul_bf16_epilogue) {
    const void* b16 = nullptr;
    if (bias) {
      b16 = weight_operand(st.bias16, bias, OC, prec);
      if (!aligned16(b16)) b16 = gemm_operand(st.bias16, bias, OC, prec, stream_);
    }
    if (lt_matmul(st.lt, true, /*transa=*/true, /*transb=*/false, OC, N, K, w, K, x, K, out16, 0.0f,
                  stream_,
                  /*d_bf16=*/true, b16)) {
      ++g_matmul_bf16_epilogue_calls;
      return;
    }
  }
  float* y = out16 ? st.f32_out.get<float>(static_cast<size_t>(N * OC), stream_) : out;
  lt_matmul(st.lt, true, /*transa=*/true, /*transb=*/false, OC, N, K, w, K, x, K, y, 0.0f, stream_);
  if (out16 && bias)
    add_bias_bf16(out16, y, bias, N, OC, stream_);
  else if (out16)
    narrow_to_bf16(out16, y, N * OC);
  else if (bias)
    add_bias(y, bias, N, OC, round_bf16, stream_);
  else if (round_bf16)
    round_to_bf16(y, N * OC);
}

void CudaBackend::matmul_backward_bf16_input(float* dinp, float* dweight, float* dbias,
                                             const float* dout, const uint16_t* inp16,
                                             const float* weight, int64_t N, int64_t K,
                                             int64_t OC) {
  const emu::GemmPrecision prec = emu::GemmPrecision::BF16;
  if (matmul_backward_empty(dinp, N, K, OC, stream_)) return;
  LayersState& st = layers_state();
  if (dbias && K > 0 && OC % 2 == 0 && pair_aligned(dout)) {
    const uint16_t* h = bf16_operand_with_bias_grad(&st.bf16_a, st.columns, Bf16PairMemory{dout},
                                                    dbias, N, OC, stream_);
    matmul_backward_gemms(dinp, dweight, h, nullptr, weight, N, K, OC, prec, inp16);
    ++g_fused_matmul_bias;
    return;
  }
  if (K > 0)
    matmul_backward_gemms(dinp, dweight, gemm_operand(st.bf16_a, dout, N * OC, prec, stream_),
                          nullptr, weight, N, K, OC, prec, inp16);
  if (dbias) bias_backward(dbias, dout, N, OC);
}

void CudaBackend::matmul_backward_activation_bf16_input(float* dinp, float* dweight, float* dbias,
                                                        const ActivationSource& src,
                                                        const uint16_t* inp16, const float* weight,
                                                        int64_t K) {
  const int64_t N = src.rows, OC = src.cols;
  if (!gelu_backward_fusable(src, dbias, K, emu::GemmPrecision::BF16)) {
    Backend::matmul_backward_activation_bf16_input(dinp, dweight, dbias, src, inp16, weight, K);
    return;
  }
  const uint16_t* h = gelu_backward_operand(src, dbias);
  matmul_backward_gemms(dinp, dweight, h, nullptr, weight, N, K, OC, emu::GemmPrecision::BF16,
                        inp16);
  ++g_fused_activation_matmul;
}

// The BF16 linear's backward pass: dy's BF16 operand (from GELU's backward pass with the bias
// gradient's sums, or from dout with them, or converted), then the Dgrad into dinp, or into dinp16
// as cuBLASLt's BF16 output (no bias: listed; the knob set_matmul_bf16_epilogue off, or no
// algorithm: FP32 then one narrowing pass), and the Wgrad from inp or inp16.
void CudaBackend::matmul_backward_bits(float* dinp, uint16_t* dinp16, float* dweight, float* dbias,
                                       const float* dout, const uint16_t* dout16,
                                       const ActivationSource* src, const float* inp,
                                       const uint16_t* inp16, const float* weight, int64_t N,
                                       int64_t K, int64_t OC) {
  const emu::GemmPrecision prec = emu::GemmPrecision::BF16;
  if (dinp && dinp16) throw std::logic_error("matmul_backward_bits: dinp and dinp16 both given");
  if ((dout != nullptr) + (dout16 != nullptr) + (src != nullptr) != 1)
    throw std::logic_error("matmul_backward_bits: exactly one of dout, dout16 and src");
  if (src && (src->rows != N || src->cols != OC))
    throw std::logic_error("matmul_backward_bits: the pending gradient's shape is not N x OC");
  // (dout16 with a bias: its column sums read pairs, 4-byte aligned)
  const bool bits_pairs = dout16 && OC % 2 == 0 && pair_aligned(dout16);
  if (N == 0 || K == 0 || OC == 0 || (src && !gelu_backward_fusable(*src, dbias, K, prec)) ||
      (dout16 && dbias && !bits_pairs)) {
    Backend::matmul_backward_bits(dinp, dinp16, dweight, dbias, dout, dout16, src, inp, inp16,
                                  weight, N, K, OC);
    return;
  }
  LayersState& st = layers_state();
  const void* dy = nullptr;
  bool dbias_done = false;
  if (src) {
    dy = gelu_backward_operand(*src, dbias);
    dbias_done = true;
    ++g_fused_activation_matmul;
  } else if (dout16) {  // the operand as it is; dbias from its values, the sums of the FP32 path
    dy = dout16;
    if (dbias)
      bf16_operand_with_bias_grad(nullptr, st.columns, Bf16PairBits{dout16}, dbias, N, OC, stream_);
    dbias_done = true;
  } else if (dbias && OC % 2 == 0 && pair_aligned(dout)) {
    dy = bf16_operand_with_bias_grad(&st.bf16_a, st.columns, Bf16PairMemory{dout}, dbias, N, OC,
                                     stream_);
    dbias_done = true;
    ++g_fused_matmul_bias;
  } else {
    dy = gemm_operand(st.bf16_a, dout, N * OC, prec, stream_);
  }
  if (dinp || dinp16) {
    const void* w = weight_operand(st.bf16_b, weight, OC * K, prec);
    if (dinp) {
      lt_matmul(st.lt, true, false, false, K, N, OC, w, K, dy, OC, dinp, 0.0f, stream_);
    } else if (!g_matmul_bf16_epilogue || !lt_matmul(st.lt, true, false, false, K, N, OC, w, K, dy,
                                                     OC, dinp16, 0.0f, stream_, /*d_bf16=*/true)) {
      float* t = st.f32_out.get<float>(static_cast<size_t>(N * K), stream_);
      lt_matmul(st.lt, true, false, false, K, N, OC, w, K, dy, OC, t, 0.0f, stream_);
      narrow_to_bf16(dinp16, t, N * K);
    }
  }
  if (dweight) {
    const void* x = inp16 ? static_cast<const void*>(inp16)
                          : gemm_operand(st.bf16_c, inp, N * K, prec, stream_);
    lt_matmul(st.lt, true, false, true, K, OC, N, x, K, dy, OC, dweight, 1.0f, stream_);
  }
  if (dbias && !dbias_done) bias_backward(dbias, dout, N, OC);
}

namespace {
// The attention backward pass's dS scratch from `scratch`, or null where the dQ kernel recomputes
// dS (attention_ds_scratch_bytes 0).
void* attention_ds_scratch(DeviceScratch& scratch, int64_t B, int64_t T, int64_t NH, int64_t HD,
                           cudaStream_t stream) {
  const int64_t bytes = attention_ds_scratch_bytes(B, T, NH, HD);
  return bytes > 0 ? scratch.get<uint8_t>(static_cast<size_t>(bytes), stream) : nullptr;
}
}  // namespace

void CudaBackend::attention_forward_bf16(float* out, uint16_t* out16, float* lse, const float* qkv,
                                         const uint16_t* qkv16, int64_t B, int64_t T, int64_t NH,
                                         int64_t NKV, int64_t HD, bool round_bf16) {
  require_one_of("attention_forward_bf16", "out", out, out16);
  require_one_of("attention_forward_bf16", "qkv", qkv, qkv16);
  require_heads("attention_forward_bf16", NH, NKV, HD);
  attention_check_shape("attention_forward_bf16", B, T, NH, NKV,
                        HD);  // before any scratch is sized
  uint16_t* scratch = nullptr;
  if (!qkv16) {
    const size_t qkv_n = B > 0 && T > 0 ? static_cast<size_t>(B * T * (NH + 2 * NKV) * HD) : 0;
    scratch = layers_state().att_qkv16.get<uint16_t>(qkv_n, stream_);
  }
  attention_forward_launch(out, out16, lse, qkv, qkv16, scratch, B, T, NH, NKV, HD, round_bf16,
                           stream_);
}

void CudaBackend::attention_backward_bf16(float* dqkv, uint16_t* dqkv16, const float* dout,
                                          const uint16_t* dout16, const float* qkv,
                                          const uint16_t* qkv16, const float* out,
                                          const uint16_t* out16, const float* lse, int64_t B,
                                          int64_t T, int64_t NH, int64_t NKV, int64_t HD,
                                          bool round_bf16) {
  require_one_of("attention_backward_bf16", "dqkv", dqkv, dqkv16);
  require_one_of("attention_backward_bf16", "dout", dout, dout16);
  require_one_of("attention_backward_bf16", "qkv", qkv, qkv16);
  require_one_of("attention_backward_bf16", "out", out, out16);
  require_heads("attention_backward_bf16", NH, NKV, HD);
  attention_check_shape("attention_backward_bf16", B, T, NH, NKV,
                        HD);  // before any scratch is sized
  if (B * T == 0) return;
  LayersState& st = layers_state();
  float* dsum = st.att_dsum.get<float>(static_cast<size_t>(2 * B * NH * T), stream_);
  const size_t bt = static_cast<size_t>(B * T);
  uint16_t* scratch =
      qkv16 ? nullptr
            : st.att_qkv16.get<uint16_t>(bt * static_cast<size_t>((NH + 2 * NKV) * HD), stream_);
  uint16_t* dscratch =
      dout16 ? nullptr : st.att_dout16.get<uint16_t>(bt * static_cast<size_t>(NH * HD), stream_);
  void* ds = attention_ds_scratch(st.att_ds, B, T, NH, HD, stream_);
  attention_backward_launch(dqkv, dqkv16, dsum, dout, dout16, qkv, qkv16, out, out16, lse, scratch,
                            dscratch, ds, B, T, NH, NKV, HD, round_bf16, stream_);
}

// The kernels are in gpu/attention.cu; here the checks and the backward pass's scratch.
void CudaBackend::attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                                    int64_t NH, int64_t NKV, int64_t HD, emu::GemmPrecision prec,
                                    bool round_bf16) {
  require_heads("attention_forward", NH, NKV, HD);
  require_bf16_attention("attention_forward", prec);
  attention_check_shape("attention_forward", B, T, NH, NKV, HD);  // before any scratch is sized
  const size_t qkv_n = B > 0 && T > 0 ? static_cast<size_t>(B * T * (NH + 2 * NKV) * HD) : 0;
  uint16_t* qkv16 = layers_state().att_qkv16.get<uint16_t>(qkv_n, stream_);
  attention_forward_launch(out, nullptr, lse, qkv, nullptr, qkv16, B, T, NH, NKV, HD, round_bf16,
                           stream_);
}

void CudaBackend::attention_backward(float* dqkv, const float* dout, const float* qkv,
                                     const float* out, const float* lse, int64_t B, int64_t T,
                                     int64_t NH, int64_t NKV, int64_t HD, emu::GemmPrecision prec,
                                     bool round_bf16) {
  require_heads("attention_backward", NH, NKV, HD);
  require_bf16_attention("attention_backward", prec);
  attention_check_shape("attention_backward", B, T, NH, NKV, HD);  // before any scratch is sized
  if (B * T == 0) return;
  LayersState& st = layers_state();
  float* dsum = st.att_dsum.get<float>(static_cast<size_t>(2 * B * NH * T), stream_);
  const size_t bt = B > 0 && T > 0 ? static_cast<size_t>(B * T) : 0;  // (B * T == 0 returned above)
  uint16_t* qkv16 =
      st.att_qkv16.get<uint16_t>(bt * static_cast<size_t>((NH + 2 * NKV) * HD), stream_);
  uint16_t* dout16 = st.att_dout16.get<uint16_t>(bt * static_cast<size_t>(NH * HD), stream_);
  void* ds = attention_ds_scratch(st.att_ds, B, T, NH, HD, stream_);
  attention_backward_launch(dqkv, nullptr, dsum, dout, nullptr, qkv, nullptr, out, nullptr, lse,
                            qkv16, dout16, ds, B, T, NH, NKV, HD, round_bf16, stream_);
}

void CudaBackend::rope_forward(float* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                               int64_t HD) {
  require_heads("rope_forward", NH, NKV, HD);
  const int64_t total = B * T * (NH + NKV) * (HD / 2);
  if (total == 0) return;
  const float* tab = rope_table(layers_state().rope, T, HD, stream_);
  rope_kernel<<<elementwise_grid(total), kThreads, 0, stream_>>>(qkv, tab, B, T, NH, NKV, HD, 1.0f);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void CudaBackend::rope_backward(float* dqkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                                int64_t HD) {
  require_heads("rope_backward", NH, NKV, HD);
  const int64_t total = B * T * (NH + NKV) * (HD / 2);
  if (total == 0) return;
  const float* tab = rope_table(layers_state().rope, T, HD, stream_);
  rope_kernel<<<elementwise_grid(total), kThreads, 0, stream_>>>(dqkv, tab, B, T, NH, NKV, HD,
                                                                 -1.0f);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void CudaBackend::gelu_forward(float* out, const float* inp, int64_t n, bool round_bf16) {
  if (n == 0) return;
  gelu_forward_kernel<<<elementwise_grid(n), kThreads, 0, stream_>>>(out, inp, n, round_bf16);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void CudaBackend::gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n,
                                bool round_bf16, bool bf16_dout) {
  if (n == 0) return;
  gelu_backward_kernel<<<elementwise_grid(n), kThreads, 0, stream_>>>(dinp, inp, dout, n,
                                                                      round_bf16, bf16_dout);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void CudaBackend::squared_relu_forward(float* out, const float* inp, int64_t n, bool round_bf16) {
  if (n == 0) return;
  squared_relu_forward_kernel<<<elementwise_grid(n), kThreads, 0, stream_>>>(out, inp, n,
                                                                             round_bf16);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void CudaBackend::squared_relu_backward(float* dinp, const float* inp, const float* dout, int64_t n,
                                        bool round_bf16, bool bf16_dout) {
  if (n == 0) return;
  squared_relu_backward_kernel<<<elementwise_grid(n), kThreads, 0, stream_>>>(
      dinp, inp, dout, n, round_bf16, bf16_dout);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void CudaBackend::swiglu_forward(float* out, const float* inp, int64_t N, int64_t F,
                                 bool round_bf16) {
  if (N * F == 0) return;
  swiglu_forward_kernel<<<elementwise_grid(N * F), kThreads, 0, stream_>>>(out, inp, N, F,
                                                                           round_bf16);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void CudaBackend::swiglu_backward(float* dinp, const float* inp, const float* dout, int64_t N,
                                  int64_t F, bool round_bf16, bool bf16_dout) {
  if (N * F == 0) return;
  swiglu_backward_kernel<<<elementwise_grid(N * F), kThreads, 0, stream_>>>(dinp, inp, dout, N, F,
                                                                            round_bf16, bf16_dout);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void CudaBackend::bias_forward(float* out, const float* bias, int64_t N, int64_t OC,
                               bool round_bf16) {
  if (N * OC == 0) return;
  add_bias(out, bias, N, OC, round_bf16, stream_);
}

// dbias (OC) += column sums of dout (N,OC) in emu::bias_backward's chunked order: bitwise.
void CudaBackend::bias_backward(float* dbias, const float* dout, int64_t N, int64_t OC) {
  if (N * OC == 0) return;
  float* partial =
      layers_state().columns.get<float>(static_cast<size_t>(column_chunks(N) * OC), stream_);
  column_partial_kernel<<<column_partial_grid(N, OC), kThreads, 0, stream_>>>(partial, dout, N, OC);
  FP4SIM_CUDA_CHECK_LAUNCH();
  column_sums_finalize(dbias, partial, N, OC, true, stream_);
}

uint64_t fused_bias_backward_count() { return g_fused_bias_backward; }
uint64_t fused_activation_quantize_count() { return g_fused_activation_quantize; }
uint64_t fused_activation_matmul_count() { return g_fused_activation_matmul; }
void set_activation_fusion(bool on) { g_activation_fusion = on; }
void set_matmul_bf16_epilogue(bool on) { g_matmul_bf16_epilogue = on; }
std::string last_matmul_epilogue_refusal() { return g_last_epilogue_refusal; }
uint64_t weight_shadow_read_count() { return g_weight_shadow_reads; }
uint64_t matmul_bf16_epilogue_count() { return g_matmul_bf16_epilogue_calls; }
uint64_t fused_matmul_bias_count() { return g_fused_matmul_bias; }

// FP8 with a column-wise copy of a dense F32 x whose rows fill whole 128-row tiles: the tile pass
// writes the chunks' column sums (gpu/fp8.cu) in place of column_partial_kernel's pass over x,
// then the same finalize as bias_backward. NVFP4 with an RHT column-wise copy of a dense F32 x
// (rows % 64 == 0): the pipelined RHT amax pass takes the sums where it runs (gpu/quantize.cu),
// else bias_backward's own pass. Otherwise the base class's two calls. Bitwise either way.
void CudaBackend::quantize_with_bias_backward(const TensorView& x, const QuantizeConfig& cfg,
                                              QuantizedView* rowwise, QuantizedView* columnwise,
                                              float* dbias) {
  if (cfg.format == QFormat::NVFP4 && cfg.columnwise.enabled && cfg.columnwise.rht &&
      x.dtype == DType::F32 && x.stride() == x.cols && x.rows % emu::kColumnChunkRows == 0 &&
      x.device == Device::Cuda && x.rows * x.cols > 0 && !(rowwise && rowwise->scales_gemm) &&
      !(columnwise && columnwise->scales_gemm)) {
    validate_quantize(x, cfg);
    float* partial = layers_state().columns.get<float>(
        static_cast<size_t>(column_chunks(x.rows) * x.cols), stream_);
    if (quantize_launch(x, cfg, rowwise, columnwise, stream_, amax_ws_, &rht_keep_, partial)) {
      column_sums_finalize(dbias, partial, x.rows, x.cols, true, stream_);
      ++g_fused_bias_backward;
    } else {
      bias_backward(dbias, static_cast<const float*>(x.data), x.rows, x.cols);
    }
    return;
  }
  const bool fused = cfg.format == QFormat::FP8 && cfg.columnwise.enabled &&
                     x.dtype == DType::F32 && x.stride() == x.cols && x.rows % kFp8Block == 0 &&
                     x.device == Device::Cuda && x.rows * x.cols > 0 &&
                     !(rowwise && rowwise->decoded_bf16) &&
                     !(columnwise && columnwise->decoded_bf16);
  if (!fused) {
    Backend::quantize_with_bias_backward(x, cfg, rowwise, columnwise, dbias);
    return;
  }
  validate_quantize(x, cfg);
  float* partial = layers_state().columns.get<float>(
      static_cast<size_t>(column_chunks(x.rows) * x.cols), stream_);
  fp8_quantize_launch(x, cfg, rowwise, columnwise, stream_, amax_ws_, partial);
  column_sums_finalize(dbias, partial, x.rows, x.cols, true, stream_);
  ++g_fused_bias_backward;
}

void CudaBackend::quantize_activation(const ActivationSource& src, const QuantizeConfig& cfg,
                                      QuantizedView* rowwise, QuantizedView* columnwise,
                                      float* dbias) {
  if (src.inp16 || src.out16 || src.dout16) {  // (Backend's throws, saying why)
    Backend::quantize_activation(src, cfg, rowwise, columnwise, dbias);
    return;
  }
  const bool fused = g_activation_fusion && cfg.format == QFormat::FP8 && src.rows * src.cols > 0 &&
                     (!cfg.columnwise.enabled || src.rows % kFp8Block == 0) &&
                     (!dbias || cfg.columnwise.enabled) && !(rowwise && rowwise->decoded_bf16) &&
                     !(columnwise && columnwise->decoded_bf16);
  if (!fused) {
    Backend::quantize_activation(src, cfg, rowwise, columnwise, dbias);
    return;
  }
  TensorView v;  // (the op's output as quantize would see it: for the checks only, never written)
  v.data = src.out;
  v.rows = src.rows;
  v.cols = src.cols;
  v.device = Device::Cuda;
  v.name = src.name;
  validate_quantize(v, cfg);
  float* partial = dbias ? layers_state().columns.get<float>(
                               static_cast<size_t>(column_chunks(src.rows) * src.cols), stream_)
                         : nullptr;
  fp8_quantize_activation_launch(src, cfg, rowwise, columnwise, stream_, amax_ws_, partial);
  if (dbias) column_sums_finalize(dbias, partial, src.rows, src.cols, true, stream_);
  ++g_fused_activation_quantize;
}

void CudaBackend::round_to_bf16(float* x, int64_t n) {
  if (n == 0) return;
  round_to_bf16_inplace_kernel<<<elementwise_grid((n + 3) / 4), kThreads, 0, stream_>>>(x, n);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void CudaBackend::residual_forward(float* out, const float* a, const float* b, int64_t n,
                                   bool round_bf16) {
  if (n == 0) return;
  residual_forward_kernel<<<elementwise_grid((n + 3) / 4), kThreads, 0, stream_>>>(out, a, b, n,
                                                                                   round_bf16);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void CudaBackend::residual_forward_bf16(float* out, const float* a, const uint16_t* b16, int64_t n,
                                        bool round_bf16) {
  if (n == 0) return;
  residual_forward_bf16_kernel<<<elementwise_grid((n + 3) / 4), kThreads, 0, stream_>>>(
      out, a, b16, n, round_bf16);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void CudaBackend::crossentropy_softmax_forward(float* losses, float* probs, const float* logits,
                                               const int32_t* targets, int64_t N, int64_t V,
                                               bool bf16_logits) {
  require_rows("crossentropy_softmax_forward", N);
  if (N == 0) return;
  launch_crossentropy<false>(losses, probs, logits, targets, N, V, nullptr, false, bf16_logits,
                             stream_);
}

void CudaBackend::crossentropy_softmax_forward_backward(float* losses, float* dlogits,
                                                        const float* logits, const int32_t* targets,
                                                        const float* dlosses, int64_t N, int64_t V,
                                                        bool round_bf16) {
  require_rows("crossentropy_softmax_forward_backward", N);
  if (N == 0) return;
  launch_crossentropy<true>(losses, dlogits, logits, targets, N, V, dlosses, round_bf16, round_bf16,
                            stream_);
}

void CudaBackend::crossentropy_softmax_forward_backward_bf16(float* losses, uint16_t* dlogits,
                                                             const float* logits,
                                                             const int32_t* targets,
                                                             const float* dlosses, int64_t N,
                                                             int64_t V) {
  require_rows("crossentropy_softmax_forward_backward_bf16", N);
  if (N == 0) return;
  launch_crossentropy<true, uint16_t>(losses, dlogits, logits, targets, N, V, dlosses, true, true,
                                      stream_);
}

void CudaBackend::crossentropy_softmax_forward_backward_bits(float* losses, uint16_t* dlogits,
                                                             const uint16_t* logits16,
                                                             const int32_t* targets,
                                                             const float* dlosses, int64_t N,
                                                             int64_t V) {
  require_rows("crossentropy_softmax_forward_backward_bits", N);
  if (N == 0) return;
  launch_crossentropy<true, uint16_t, uint16_t>(losses, dlogits, logits16, targets, N, V, dlosses,
                                                true, true, stream_);
}

void CudaBackend::crossentropy_softmax_backward(float* dlogits, const float* probs,
                                                const int32_t* targets, const float* dlosses,
                                                int64_t N, int64_t V, bool round_bf16) {
  if (N * V == 0) return;
  crossentropy_softmax_backward_kernel<<<elementwise_grid(N * V), kThreads, 0, stream_>>>(
      dlogits, probs, targets, dlosses, N, V, round_bf16);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void CudaBackend::adamw_update(float* params, const float* grads, float* m, float* v, int64_t n,
                               const AdamWStep& step) {
  if (n == 0) return;
  adamw_kernel<<<elementwise_grid(n), kThreads, 0, stream_>>>(params, grads, m, v, n, step);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

// One launch over all tensors (adamw_many_kernel): the work items (pieces of kAdamWItemElems
// elements of one tensor) are made and uploaded once for a layout, then reused while the offsets,
// counts and the pattern of distinct steps stay the same; the steps travel as a kernel parameter.
// More than kAdamWSteps distinct steps: one adamw_update per tensor.
void CudaBackend::adamw_update_many(float* params, const float* grads, float* m, float* v,
                                    const std::vector<int64_t>& offsets,
                                    const std::vector<int64_t>& counts,
                                    const std::vector<AdamWStep>& steps) {
  adamw_many(params, nullptr, grads, m, v, offsets, counts, steps);
}

void CudaBackend::adamw_update_many_bf16(float* params, uint16_t* params16, const float* grads,
                                         float* m, float* v, const std::vector<int64_t>& offsets,
                                         const std::vector<int64_t>& counts,
                                         const std::vector<AdamWStep>& steps) {
  if (!params16) throw std::invalid_argument("adamw_update_many_bf16: params16 is null");
  adamw_many(params, params16, grads, m, v, offsets, counts, steps);
}

// adamw_update_many (p16 null) or adamw_update_many_bf16 (the bits written in the same pass).
void CudaBackend::adamw_many(float* params, uint16_t* p16, const float* grads, float* m, float* v,
                             const std::vector<int64_t>& offsets,
                             const std::vector<int64_t>& counts,
                             const std::vector<AdamWStep>& steps) {
  validate_adamw_update_many(offsets, counts, steps);
  AdamWSteps distinct{};
  int n_distinct = 0;
  std::vector<int64_t> key;
  key.reserve(3 * offsets.size());
  for (size_t i = 0; i < offsets.size(); ++i) {
    int k = 0;
    while (k < n_distinct && std::memcmp(&distinct.s[k], &steps[i], sizeof(AdamWStep)) != 0) ++k;
    if (k == n_distinct) {
      if (n_distinct == kAdamWSteps) {
        if (p16)
          Backend::adamw_update_many_bf16(params, p16, grads, m, v, offsets, counts, steps);
        else
          Backend::adamw_update_many(params, grads, m, v, offsets, counts, steps);
        return;
      }
      distinct.s[n_distinct++] = steps[i];
    }
    key.insert(key.end(), {offsets[i], counts[i], k});
  }
  LayersState& st = layers_state();
  if (key != st.adamw_key) {
    std::vector<AdamWItem> items;
    for (size_t i = 0; i < offsets.size(); ++i)
      for (int64_t b = 0; b < counts[i]; b += kAdamWItemElems)
        items.push_back({offsets[i] + b, offsets[i] + std::min(counts[i], b + kAdamWItemElems),
                         key[3 * i + 2]});
    AdamWItem* dev = st.adamw_items.get<AdamWItem>(items.size(), stream_);
    if (!items.empty())
      FP4SIM_CUDA_CHECK(cudaMemcpyAsync(dev, items.data(), items.size() * sizeof(AdamWItem),
                                        cudaMemcpyHostToDevice, stream_));
    FP4SIM_CUDA_CHECK(cudaStreamSynchronize(stream_));  // (items is a host temporary)
    st.adamw_key = std::move(key);
    st.adamw_item_count = static_cast<int64_t>(items.size());
  }
  if (st.adamw_item_count == 0) return;
  const bool vec =
      aligned16(params) && aligned16(grads) && aligned16(m) && aligned16(v) && quad_aligned(p16);
  adamw_many_kernel<<<static_cast<unsigned>(st.adamw_item_count), kThreads, 0, stream_>>>(
      params, grads, m, v,
      st.adamw_items.get<AdamWItem>(static_cast<size_t>(st.adamw_item_count), stream_), distinct,
      vec, p16);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

double CudaBackend::sum_squares(const float* x, int64_t n) {
  double s = 0.0;
  sum_squares_many(x, {0}, {n}, &s);
  return s;
}

// All tensors in two launches and one copy back (the gradient norm: one round trip per step
// instead of one per parameter tensor).
void CudaBackend::sum_squares_many(const float* base, const std::vector<int64_t>& offsets,
                                   const std::vector<int64_t>& counts, double* sums) {
  validate_sum_squares_many(offsets, counts);
  LayersState& st = layers_state();
  constexpr size_t kMaxTensors = 65535;  // grid.y per launch
  for (size_t first = 0; first < offsets.size(); first += kMaxTensors) {
    const size_t tensors = std::min(kMaxTensors, offsets.size() - first);
    st.host_segments.resize(2 * tensors);
    for (size_t i = 0; i < tensors; ++i) {
      st.host_segments[2 * i] = offsets[first + i];
      st.host_segments[2 * i + 1] = counts[first + i];
    }
    int64_t* seg = st.segments.get<int64_t>(2 * tensors, stream_);
    FP4SIM_CUDA_CHECK(cudaMemcpyAsync(seg, st.host_segments.data(), 2 * tensors * sizeof(int64_t),
                                      cudaMemcpyHostToDevice, stream_));
    double* partial = st.sums.get<double>(tensors * (kSumSquaresBlocks + 1), stream_);
    double* out = partial + tensors * kSumSquaresBlocks;
    sum_squares_partial_kernel<<<dim3(kSumSquaresBlocks, static_cast<unsigned>(tensors)), kThreads,
                                 0, stream_>>>(partial, base, seg);
    FP4SIM_CUDA_CHECK_LAUNCH();
    sum_partials_kernel<<<static_cast<unsigned>(tensors), kThreads, 0, stream_>>>(
        out, partial, kSumSquaresBlocks);
    FP4SIM_CUDA_CHECK_LAUNCH();
    FP4SIM_CUDA_CHECK(cudaMemcpyAsync(sums + first, out, tensors * sizeof(double),
                                      cudaMemcpyDeviceToHost, stream_));
    FP4SIM_CUDA_CHECK(cudaStreamSynchronize(stream_));  // before the next batch reuses the buffers
  }
}

int64_t ce_division_mismatches(int64_t pairs, uint64_t seed) {
  unsigned long long* d = nullptr;
  FP4SIM_CUDA_CHECK(cudaMalloc(&d, sizeof(unsigned long long)));
  unsigned long long h = 0;
  cudaError_t err = cudaMemset(d, 0, sizeof(h));
  if (err == cudaSuccess) {
    ce_division_check_kernel<<<1024, kThreads>>>(d, pairs, seed);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) err = cudaMemcpy(&h, d, sizeof(h), cudaMemcpyDeviceToHost);
  cudaFree(d);
  FP4SIM_CUDA_CHECK(err);
  return static_cast<int64_t>(h);
}

}  // namespace fp4sim::gpu
