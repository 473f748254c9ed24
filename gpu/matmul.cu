// The training matmuls: the linear layer's GEMMs on cuBLASLt with its bias add and bias gradient,
// their BF16-storage and GELU-fused variants, and the BF16 weight shadow: the CUDA twins of
// emu/matmul.hpp and CudaBackend's methods.
//
// Numerics (those of every training op: gpu/training_ops.cuh):
// - matmul: cuBLASLt, FP32 accumulation (CUBLAS_COMPUTE_32F, never TF32); BF16 operands rounded
//   RNE by emu/formats.hpp's bf16_rne. Reproducible run to run on one GPU model, toolkit and
//   workspace size (cuBLAS's reproducibility guarantee); bounded against the emulator's exact
//   tensor-core emulation.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "emu/formats.hpp"
#include "emu/fused.hpp"
#include "emu/op_checks.hpp"
#include "gpu/activation.cuh"
#include "gpu/column_sums.cuh"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/elementwise.cuh"
#include "gpu/formats_device.cuh"
#include "gpu/layers_state.hpp"
#include "gpu/op_checks.hpp"
#include "gpu/training_ops.cuh"

namespace fp4sim::gpu {

namespace {

// (kMatmulCublasLtWorkspaceBytes: gpu/capabilities.hpp, for memory plans)
constexpr size_t kCublasWorkspaceBytes = kMatmulCublasLtWorkspaceBytes;

// The bias value added to an output that is rounded to BF16: the bias's BF16 rounding (the rule of
// Backend::matmul_forward, as a BF16 GEMM epilogue adds a BF16 bias); else the bias.
__device__ __forceinline__ float bias_added(float b, bool round_bf16) {
  return round_bf16 ? bf16_round_cvt(b) : b;
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
        reinterpret_cast<ushort4*>(o)[c] =
            make_ushort4(bf16_rne_cvt(__fadd_rn(v.x, bf16_round_cvt(b.x))),
                         bf16_rne_cvt(__fadd_rn(v.y, bf16_round_cvt(b.y))),
                         bf16_rne_cvt(__fadd_rn(v.z, bf16_round_cvt(b.z))),
                         bf16_rne_cvt(__fadd_rn(v.w, bf16_round_cvt(b.w))));
      } else {
        o[c] = bf16_rne_cvt(__fadd_rn(row[c], bf16_round_cvt(bias[c])));
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
          static_cast<uint32_t>(bf16_rne_cvt(v.x)) |
          (static_cast<uint32_t>(bf16_rne_cvt(v.y)) << 16);
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
        reinterpret_cast<ushort4*>(h)[j] = make_ushort4(bf16_rne_cvt(v[0]), bf16_rne_cvt(v[1]),
                                                        bf16_rne_cvt(v[2]), bf16_rne_cvt(v[3]));
      },
      [&](int64_t i) {
        const float v = gelu_forward_stored(load_f32(inp, i), round_bf16);
        if (out) out[i] = v;
        h[i] = bf16_rne_cvt(v);
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
    table[i] = bf16_rne_cvt(gelu_forward_stored(bf16_to_f32(static_cast<uint16_t>(i)), true));
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

// ---- cuBLASLt ---------------------------------------------------------------------------------

// Largest power of two (<= 256) dividing the address: the alignment cuBLASLt may assume.
uint32_t pointer_alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && (a % align) != 0) align >>= 1;
  return align;
}

}  // namespace

// Where the heuristic's first algorithm for a training matmul (lt_matmul's column-major m x n x k,
// BF16 operands) is measurably not its best (H200, cuBLASLt 13.1, bench_gemm BM_GpuMatmulPicks at
// every index 0..7, docs/performance.md, 2026-11-30), the index its plan takes:
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

namespace {

using training_ops::CublasLt;
using training_ops::LtDescriptors;

// D (col-major m x n, ld m) = op(A) op(B) + beta * D, FP32 accumulation and output
// (CUBLAS_COMPUTE_32F: no TF32), operands BF16 (`bf16`) or FP32. A is stored (m x k) col-major
// with ld lda, or (k x m) when transa; B is (k x n), or (n x k) when transb. beta = 1 accumulates:
// D = fl(acc + D), the emulator's `d += gemm` given the GEMM's FP32 value.
// d_bf16: D stored as BF16 bits (the epilogue's RNE of the FP32 value; beta 0 only). bias (m values
// of D's type, BF16 bits for a BF16 D, or null): D = fl(acc + bias[row]) in the epilogue, then the
// rounding: the bits of add_bias(_bf16) after the GEMM (tests:
// LayersGpu.MatmulBf16EpilogueRoundsLikeAddBias). cuBLASLt 13.1 on Hopper refuses a BF16 D with an
// FP32 bias (2026-12-01), so the bias takes D's type. Returns false, having run nothing,
// where cuBLASLt has no algorithm for such an output (the caller then takes separate passes); the
// FP32 output without an epilogue always runs (or throws).
bool lt_matmul(CublasLt& lt, bool bf16, bool transa, bool transb, int64_t m, int64_t n, int64_t k,
               const void* A, int64_t lda, const void* B, int64_t ldb, void* D, float beta,
               cudaStream_t stream, bool d_bf16 = false, const void* bias = nullptr) {
  if (d_bf16 && beta != 0.0f)
    throw std::logic_error("lt_matmul: a BF16 output takes beta = 0 only");
  if (!lt.handle) {
    FP4SIM_CUBLAS_CHECK(cublasLtCreate(&lt.handle));
    device_malloc(&lt.workspace, kCublasWorkspaceBytes, "the training matmuls' cuBLASLt workspace");
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
  // the rule's index (matmul_preferred_algo), or the option's (lt.pick), which fails the plan
  // where the heuristic's list is shorter; the rule falls back to the first algorithm there
  const bool knob = lt.pick != kPlanOwnPick;
  const int pick =
      knob ? lt.pick : matmul_preferred_algo(lt.rules_active, bf16, transa, transb, m, n, k);
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
      lt.last_epilogue_refusal = std::string(cublasLtGetStatusName(hs)) + ", " +
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
    lt.last_pick = MatmulPlanPick{lt.rules_active, pick, found, used};
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

}  // namespace

// The matmul ops on views. A weight or bias view is float32 (rounded to BF16 into a scratch for a
// BF16 GEMM) or BF16 bits (the model's BF16 weight shadow: read as they are).
const void* CudaBackend::weight_operand(DeviceScratch& scratch, const TensorView& w,
                                        GemmPrecision prec) {
  if (w.dtype == DType::BF16) {
    ++counters_.weight_shadow_reads;
    return w.data;
  }
  return gemm_operand(scratch, w.as<const float>(), w.numel(), prec, stream_);
}

namespace {
// A bias view's float32 values (the bias passes read float32): the view's own, or its BF16 bits
// widened (exactly) into `scratch`.
const float* bias_values(DeviceScratch& scratch, const TensorView& b, cudaStream_t stream) {
  if (!b.present() || b.dtype == DType::F32) return b.as<const float>();
  float* w = scratch.get<float>(static_cast<size_t>(b.numel()), stream);
  bf16_to_f32_kernel<<<elementwise_grid(b.numel()), kThreads, 0, stream>>>(
      w, b.as<const uint16_t>(), b.numel());
  FP4SIM_CUDA_CHECK_LAUNCH();
  return w;
}
bool any_bf16(std::initializer_list<const TensorView*> views) {
  for (const TensorView* v : views)
    if (v->dtype == DType::BF16) return true;
  return false;
}
}  // namespace

// out (N,OC) = inp (N,K) W (OC,K)^T, then + bias. Row-major out is col-major out^T (OC x N) =
// W (op T of the col-major (K x OC) view) * inp^T (the col-major (K x N) view). Float32 views: the
// BF16 rounding of the output rides on the bias pass (one pass instead of two), or has its own
// without a bias. Any BF16 view: matmul_forward_bits.
void CudaBackend::matmul_forward(const TensorView& out, const TensorView& inp,
                                 const TensorView& weight, const TensorView& bias,
                                 GemmPrecision prec) {
  op_checks::matmul_forward(out, inp, weight, bias, prec);
  if (any_bf16({&out, &inp, &weight, &bias})) {
    matmul_forward_bits(out, inp, nullptr, weight, bias);
    return;
  }
  const int64_t N = inp.rows, K = inp.cols, OC = weight.rows;
  if (N == 0 || OC == 0) return;
  float* y = out.as<float>();
  if (K == 0) {
    FP4SIM_CUDA_CHECK(cudaMemsetAsync(y, 0, static_cast<size_t>(N * OC) * sizeof(float), stream_));
  } else {
    LayersState& st = layers_state();
    const bool bf16 = prec == GemmPrecision::BF16;
    const void* w = weight_operand(st.bf16_a, weight, prec);
    const void* x = gemm_operand(st.bf16_b, inp.as<const float>(), N * K, prec, stream_);
    lt_matmul(st.lt, bf16, /*transa=*/true, /*transb=*/false, OC, N, K, w, K, x, K, y, 0.0f,
              stream_);
  }
  if (bias.present()) {
    add_bias(y, bias.as<const float>(), N, OC, out.bf16_values, stream_);
  } else if (out.bf16_values) {
    round_to_bf16(y, N * OC);
  }
}

// The BF16-precision matmul_forward with BF16 views: the GEMM on the BF16 input bits as they are
// (or x16: a BF16 operand made by the caller); a BF16 output written by cuBLASLt's epilogue, the
// bias added there as BF16 bits (RNE(fl32(acc + bf16(bias))): the bits of add_bias_bf16; a BF16
// bias view read as it is where 16-byte aligned, else narrowed into a scratch), where it lists an
// algorithm for that; else (or with the knob off) the float32 GEMM and one add_bias_bf16 /
// narrowing pass.
void CudaBackend::matmul_forward_bits(const TensorView& out, const TensorView& inp,
                                      const uint16_t* x16, const TensorView& weight,
                                      const TensorView& bias) {
  const int64_t N = out.rows, K = weight.cols, OC = weight.rows;
  if (N == 0 || OC == 0) return;
  LayersState& st = layers_state();
  const bool bits_out = out.dtype == DType::BF16;
  uint16_t* const out16 = bits_out ? out.as<uint16_t>() : nullptr;
  if (K == 0) {  // (an empty sum: zeros plus bias)
    float* y =
        bits_out ? st.f32_out.get<float>(static_cast<size_t>(N * OC), stream_) : out.as<float>();
    FP4SIM_CUDA_CHECK(cudaMemsetAsync(y, 0, static_cast<size_t>(N * OC) * sizeof(float), stream_));
    const TensorView yv = view_of(y, DType::F32, N, OC, Device::Cuda, out.name);
    if (bias.present())
      bias_forward(out, yv, bias);
    else if (out.bf16_storage())
      convert(out, yv);
    return;
  }
  const GemmPrecision prec = GemmPrecision::BF16;
  const void* w = weight_operand(st.bf16_a, weight, prec);
  const void* x = x16 ? static_cast<const void*>(x16)
                  : inp.dtype == DType::BF16
                      ? inp.data
                      : gemm_operand(st.bf16_b, inp.as<const float>(), N * K, prec, stream_);
  if (bits_out && options_.matmul_bf16_epilogue) {
    const void* b16 = nullptr;
    if (bias.present()) {
      b16 = bias.dtype == DType::BF16 ? bias.data : weight_operand(st.bias16, bias, prec);
      if (!aligned16(b16))
        b16 = gemm_operand(st.bias16, bias_values(st.bias32, bias, stream_), OC, prec, stream_);
    }
    if (lt_matmul(st.lt, true, /*transa=*/true, /*transb=*/false, OC, N, K, w, K, x, K, out16, 0.0f,
                  stream_,
                  /*d_bf16=*/true, b16)) {
      ++counters_.matmul_bf16_epilogue;
      return;
    }
  }
  float* y =
      bits_out ? st.f32_out.get<float>(static_cast<size_t>(N * OC), stream_) : out.as<float>();
  lt_matmul(st.lt, true, /*transa=*/true, /*transb=*/false, OC, N, K, w, K, x, K, y, 0.0f, stream_);
  const float* b = bias_values(st.bias32, bias, stream_);
  if (bits_out && b)
    add_bias_bf16(out16, y, b, N, OC, stream_);
  else if (bits_out)
    narrow_to_bf16(out16, y, N * OC);
  else if (b)
    add_bias(y, b, N, OC, out.bf16_values, stream_);
  else if (out.bf16_values)
    round_to_bf16(y, N * OC);
}

// The matmul backward passes' cases without a GEMM: nothing to do for N = 0; for OC = 0 an empty
// sum, dinp written as zeros (the emulator's empty chain) and the rest unchanged. True when the
// caller has nothing left to do.
namespace {
bool matmul_backward_empty(const TensorView& dinp, int64_t N, int64_t K, int64_t OC,
                           cudaStream_t stream) {
  if (N == 0) return true;
  if (OC != 0) return false;
  if (dinp.present() && K > 0)
    FP4SIM_CUDA_CHECK(
        cudaMemsetAsync(dinp.data, 0, static_cast<size_t>(N * K) * dtype_size(dinp.dtype), stream));
  return true;
}
}  // namespace

// dinp (N,K) = dout (N,OC) W (OC,K), written: col-major dinp^T (K x N) = W^T (the (K x OC) view,
// op N) * dout^T (the (OC x N) view, op N), beta = 0 (no zeroing before, no read of dinp).
// dweight (OC,K) += dout^T inp: col-major dweight^T (K x OC) = inp^T (the (K x N) view, op N) *
// dout (op T of the (OC x N) view), beta = 1.
// dbias (OC) += column sums of dout (64-row chunks from +0, summed in order; then one addition).
// Float32 views; any BF16 view: matmul_backward_bits (BF16 precision) or, at FP32 precision, a
// BF16 dout widened first (exact).
void CudaBackend::matmul_backward(const TensorView& dinp, const TensorView& dweight,
                                  const TensorView& dbias, const TensorView& dout,
                                  const TensorView& inp, const TensorView& weight,
                                  GemmPrecision prec) {
  op_checks::matmul_backward(dinp, dweight, dbias, dout, inp, weight, prec);
  const int64_t N = dout.rows, K = weight.cols, OC = dout.cols;
  if (prec == GemmPrecision::BF16 && any_bf16({&dinp, &dout, &inp, &weight})) {
    matmul_backward_bits(dinp, dweight, dbias, dout, nullptr, inp, weight);
    return;
  }
  if (matmul_backward_empty(dinp, N, K, OC, stream_)) return;
  LayersState& st = layers_state();
  const float* dy = dout.as<const float>();
  if (dout.dtype == DType::BF16) {  // (FP32 precision: widened, exactly)
    float* wide = st.f32_dout.get<float>(static_cast<size_t>(N * OC), stream_);
    bf16_to_f32_kernel<<<elementwise_grid(N * OC), kThreads, 0, stream_>>>(
        wide, dout.as<const uint16_t>(), N * OC);
    FP4SIM_CUDA_CHECK_LAUNCH();
    dy = wide;
  }
  float* const db = dbias.as<float>();
  if (db && K > 0 && prec == GemmPrecision::BF16 && OC % 2 == 0 && pair_aligned(dy)) {
    // dout's BF16 copy and the bias gradient's chunk sums from one read of dout
    const uint16_t* h =
        bf16_operand_with_bias_grad(&st.bf16_a, st.columns, Bf16PairMemory{dy}, db, N, OC, stream_);
    matmul_backward_gemms(dinp.as<float>(), dweight.as<float>(), h, inp, weight, N, K, OC, prec);
    ++counters_.fused_matmul_bias;
    return;
  }
  if (K > 0)
    matmul_backward_gemms(dinp.as<float>(), dweight.as<float>(),
                          gemm_operand(st.bf16_a, dy, N * OC, prec, stream_), inp, weight, N, K, OC,
                          prec);
  if (db) bias_backward_launch(db, dy, N, OC);
}

// matmul_backward's two GEMMs from dy, dout as the GEMMs read it (BF16 bits, or float32 at FP32
// precision): the Dgrad writes dinp (if any), the Wgrad adds into dweight (if any); K > 0. inp:
// float32 (rounded into a scratch at BF16 precision) or BF16 bits.
void CudaBackend::matmul_backward_gemms(float* dinp, float* dweight, const void* dy,
                                        const TensorView& inp, const TensorView& weight, int64_t N,
                                        int64_t K, int64_t OC, GemmPrecision prec) {
  LayersState& st = layers_state();
  const bool bf16 = prec == GemmPrecision::BF16;
  const void* w = dinp ? weight_operand(st.bf16_b, weight, prec) : nullptr;
  const void* x = !dweight ? nullptr
                  : inp.dtype == DType::BF16
                      ? inp.data
                      : gemm_operand(st.bf16_c, inp.as<const float>(), N * K, prec, stream_);
  if (dinp) lt_matmul(st.lt, bf16, false, false, K, N, OC, w, K, dy, OC, dinp, 0.0f, stream_);
  if (dweight) lt_matmul(st.lt, bf16, false, true, K, OC, N, x, K, dy, OC, dweight, 1.0f, stream_);
}

// BF16 precision: GELU's pass also writes the GEMM's BF16 operand (out's bits are the op's, src.out
// is written as activation_forward would, or is itself the operand when it is BF16 bits); then
// the matmul as matmul_forward. Else the composition.
void CudaBackend::matmul_forward_activation(const TensorView& out, const ActivationSource& src,
                                            const TensorView& weight, const TensorView& bias,
                                            GemmPrecision prec) {
  op_checks::activation_source("matmul_forward_activation", src);
  const int64_t N = src.rows(), K = src.cols(), OC = weight.rows;
  if (!options_.activation_fusion || prec != GemmPrecision::BF16 ||
      src.op != ActivationOp::GeluForward || N == 0 || K == 0 || OC == 0) {
    compose_matmul_forward_activation(*this, out, src, weight, bias, prec);
    return;
  }
  op_checks::matmul_forward(out, as_stored(src.out), weight, bias, prec);
  const ActivationArgs a = activation_args(src);
  LayersState& st = layers_state();
  // (a.out16: the operand is the activation's BF16 storage itself, src.out unwritten)
  uint16_t* x = a.out16 ? a.out16 : st.bf16_b.get<uint16_t>(static_cast<size_t>(N * K), stream_);
  float* const act = a.out16 ? nullptr : a.out;
  const bool rb = a.out16 ? true : a.round_bf16;
  if (a.inp16 && !act) {  // (BF16 in, BF16 bits out: the table, made on first use)
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
    const bool vec = aligned16(x) && aligned16(a.inp16);
    gelu_forward_bf16_lut_kernel<<<static_cast<unsigned>(st.gelu_lut_ctas), kGeluLutThreads,
                                   kGeluLutEntries * 2, stream_>>>(
        x, a.inp16, st.gelu_lut.get<uint16_t>(kGeluLutEntries, stream_), N * K, vec);
  } else if (a.inp16)
    gelu_forward_bf16_copy_kernel<<<elementwise_grid((N * K + 3) / 4), kThreads, 0, stream_>>>(
        act, x, a.inp16, N * K, rb, gelu_copy_vectorized(act, x, a.inp16));
  else
    gelu_forward_bf16_copy_kernel<<<elementwise_grid((N * K + 3) / 4), kThreads, 0, stream_>>>(
        act, x, a.inp, N * K, rb, gelu_copy_vectorized(act, x, a.inp));
  FP4SIM_CUDA_CHECK_LAUNCH();
  matmul_forward_bits(out, TensorView{}, x, weight, bias);  // (x: not st.bf16_b's user there)
  ++counters_.fused_activation_matmul;
}

// BF16 precision with a bias (matmul_backward's fused case): the GEMMs' BF16 operand and the bias
// gradient's chunk sums computed from GELU's backward pass, src.out never written. Else the
// composition.
namespace {
// Whether matmul_backward_activation takes GELU's gradient in the pass that makes the GEMMs'
// operand: BF16 precision, a bias, the pairs' pointers aligned.
bool gelu_backward_fusable(const ActivationArgs& src, const float* dbias, int64_t K,
                           GemmPrecision prec) {
  const int64_t N = src.rows, OC = src.cols;
  const uintptr_t inp_align = src.inp16 ? reinterpret_cast<uintptr_t>(src.inp16) % 4
                                        : reinterpret_cast<uintptr_t>(src.inp) % 8;
  const uintptr_t dout_align = src.dout16 ? reinterpret_cast<uintptr_t>(src.dout16) % 4
                                          : reinterpret_cast<uintptr_t>(src.dout) % 8;
  return dbias && prec == GemmPrecision::BF16 && src.op == ActivationOp::GeluBackward && N != 0 &&
         K != 0 && OC != 0 && OC % 2 == 0 && inp_align == 0 && dout_align == 0;
}
}  // namespace

// The GEMMs' BF16 operand of GELU's backward pass and the bias gradient's sums (one pass).
const uint16_t* CudaBackend::gelu_backward_operand(const ActivationArgs& src, float* dbias) {
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

void CudaBackend::matmul_backward_activation(const TensorView& dinp, const TensorView& dweight,
                                             const TensorView& dbias, const ActivationSource& src,
                                             const TensorView& inp, const TensorView& weight,
                                             GemmPrecision prec) {
  op_checks::activation_source("matmul_backward_activation", src);
  const ActivationArgs a = activation_args(src);
  if (!options_.activation_fusion ||
      !gelu_backward_fusable(a, dbias.as<float>(), weight.cols, prec)) {
    compose_matmul_backward_activation(*this, dinp, dweight, dbias, src, inp, weight, prec);
    return;
  }
  op_checks::matmul_backward(dinp, dweight, dbias, as_stored(src.out), inp, weight, prec);
  matmul_backward_bits(dinp, dweight, dbias, TensorView{}, &a, inp, weight);
}

// The BF16 linear's backward pass with BF16 views: dy's BF16 operand (from GELU's backward pass
// with the bias gradient's sums, or from dout with them, or converted), then the Dgrad into dinp,
// or into BF16 bits as cuBLASLt's BF16 output (no bias: listed; CudaOptions::matmul_bf16_epilogue
// off, or no algorithm: float32 then one narrowing pass), and the Wgrad from inp. src (instead of
// dout): the fusable GELU backward pass.
void CudaBackend::matmul_backward_bits(const TensorView& dinp, const TensorView& dweight,
                                       const TensorView& dbias, const TensorView& dout,
                                       const ActivationArgs* src, const TensorView& inp,
                                       const TensorView& weight) {
  const GemmPrecision prec = GemmPrecision::BF16;
  const int64_t N = src ? src->rows : dout.rows, OC = src ? src->cols : dout.cols, K = weight.cols;
  if (matmul_backward_empty(dinp, N, K, OC, stream_)) return;
  LayersState& st = layers_state();
  const uint16_t* dout16 = dout.dtype == DType::BF16 ? dout.as<const uint16_t>() : nullptr;
  const float* dout32 = dout.dtype == DType::F32 ? dout.as<const float>() : nullptr;
  float* const db = dbias.as<float>();
  // (dout16 with a bias: its column sums read pairs, 4-byte aligned; else, and for an empty K, it
  // is widened for them)
  if (dout16 && db && (K == 0 || !(OC % 2 == 0 && pair_aligned(dout16)))) {
    float* wide = st.f32_dout.get<float>(static_cast<size_t>(N * OC), stream_);
    bf16_to_f32_kernel<<<elementwise_grid(N * OC), kThreads, 0, stream_>>>(wide, dout16, N * OC);
    FP4SIM_CUDA_CHECK_LAUNCH();
    dout16 = nullptr;
    dout32 = wide;
  }
  if (K == 0) {
    if (db) bias_backward_launch(db, dout32, N, OC);
    return;
  }
  const void* dy = nullptr;
  bool dbias_done = false;
  if (src) {
    dy = gelu_backward_operand(*src, db);
    dbias_done = true;
    ++counters_.fused_activation_matmul;
  } else if (dout16) {  // the operand as it is; dbias from its values, the sums of the FP32 path
    dy = dout16;
    if (db)
      bf16_operand_with_bias_grad(nullptr, st.columns, Bf16PairBits{dout16}, db, N, OC, stream_);
    dbias_done = true;
  } else if (db && OC % 2 == 0 && pair_aligned(dout32)) {
    dy = bf16_operand_with_bias_grad(&st.bf16_a, st.columns, Bf16PairMemory{dout32}, db, N, OC,
                                     stream_);
    dbias_done = true;
    ++counters_.fused_matmul_bias;
  } else {
    dy = gemm_operand(st.bf16_a, dout32, N * OC, prec, stream_);
  }
  if (dinp.present()) {
    const void* w = weight_operand(st.bf16_b, weight, prec);
    if (dinp.dtype == DType::F32) {
      lt_matmul(st.lt, true, false, false, K, N, OC, w, K, dy, OC, dinp.as<float>(), 0.0f, stream_);
    } else if (!options_.matmul_bf16_epilogue ||
               !lt_matmul(st.lt, true, false, false, K, N, OC, w, K, dy, OC, dinp.as<uint16_t>(),
                          0.0f, stream_, /*d_bf16=*/true)) {
      float* t = st.f32_out.get<float>(static_cast<size_t>(N * K), stream_);
      lt_matmul(st.lt, true, false, false, K, N, OC, w, K, dy, OC, t, 0.0f, stream_);
      narrow_to_bf16(dinp.as<uint16_t>(), t, N * K);
    }
  }
  if (dweight.present()) {
    const void* x = inp.dtype == DType::BF16
                        ? inp.data
                        : gemm_operand(st.bf16_c, inp.as<const float>(), N * K, prec, stream_);
    lt_matmul(st.lt, true, false, true, K, OC, N, x, K, dy, OC, dweight.as<float>(), 1.0f, stream_);
  }
  if (db && !dbias_done) bias_backward_launch(db, dout32, N, OC);
}

// out = inp + bias: float32 (in place where out is inp; rounded, with the bias's BF16 rounding,
// under bf16_values) or BF16 bits (add_bias_bf16, inp the scratch).
void CudaBackend::bias_forward(const TensorView& out, const TensorView& inp,
                               const TensorView& bias) {
  op_checks::bias_forward(out, inp, bias);
  const int64_t N = inp.rows, OC = inp.cols;
  if (N * OC == 0) return;
  const float* b = bias_values(layers_state().bias32, bias, stream_);
  if (out.dtype == DType::BF16) {
    add_bias_bf16(out.as<uint16_t>(), inp.as<float>(), b, N, OC, stream_);
    return;
  }
  if (out.data != inp.data)
    FP4SIM_CUDA_CHECK(cudaMemcpyAsync(out.data, inp.data, static_cast<size_t>(N * OC) * 4,
                                      cudaMemcpyDeviceToDevice, stream_));
  add_bias(out.as<float>(), b, N, OC, out.bf16_values, stream_);
}

void CudaBackend::bias_backward(const TensorView& dbias, const TensorView& dout) {
  op_checks::bias_backward(dbias, dout);
  bias_backward_launch(dbias.as<float>(), dout.as<const float>(), dout.rows, dout.cols);
}

// dbias (OC) += column sums of dout (N,OC) in emu::bias_backward's chunked order: bitwise.
void CudaBackend::bias_backward_launch(float* dbias, const float* dout, int64_t N, int64_t OC) {
  if (N * OC == 0) return;
  float* partial =
      layers_state().columns.get<float>(static_cast<size_t>(column_chunks(N) * OC), stream_);
  column_partial_kernel<<<column_partial_grid(N, OC), kThreads, 0, stream_>>>(partial, dout, N, OC);
  FP4SIM_CUDA_CHECK_LAUNCH();
  column_sums_finalize(dbias, partial, N, OC, true, stream_);
}

}  // namespace fp4sim::gpu
