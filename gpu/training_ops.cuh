// What the CUDA twins of the training-stack ops (gpu/norm.cu, matmul.cu, elementwise.cu,
// cross_entropy.cu, embedding.cu, optim.cu) share: the launch shape of their elementwise and row
// kernels, the BF16 storage rules and the alignment tests of their vector paths. Each twin has the
// name, argument order, shapes and accumulate-vs-overwrite behaviour of its emulator op (the emu/
// header of the same stem, emu/optim.hpp), in the manner of llm.c's CUDA twins, on device pointers,
// on the backend's stream.
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
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "emu/formats.hpp"
#include "gpu/formats_device.cuh"

namespace fp4sim::gpu {

constexpr int kThreads = 256;                // elementwise and row kernels
constexpr int64_t kMaxGridBlocks = 1 << 16;  // grid-stride cap for elementwise kernels

inline unsigned elementwise_grid(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxGridBlocks ? blocks : kMaxGridBlocks);
}

// An activation value as stored: bf16_round when the op's round_bf16 is set (the model's BF16
// activations, Backend's contract), else as computed. The same function as round_to_bf16's.
__device__ __forceinline__ float stored(float v, bool round_bf16) {
  return round_bf16 ? bf16_round_cvt(v) : v;
}
// An incoming gradient as a backward pass reads it: bf16_round(v) where the caller stores gradients
// in BF16 and left the rounding to the reader (bf16_dout), else v.
__device__ __forceinline__ float read_dout(float v, bool bf16_dout) {
  return bf16_dout ? bf16_round_cvt(v) : v;
}
// An input element as FP32: stored FP32, or BF16 bits widened (exact).
__device__ __forceinline__ float load_f32(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_f32(const uint16_t* p, int64_t i) {
  return bf16_to_f32(p[i]);
}

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

}  // namespace fp4sim::gpu
