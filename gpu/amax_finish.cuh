// A quantize call's global amax without zeroing its targets first (gpu/quantize_amax.cuh's
// NVFP4/MXFP4 passes and gpu/fp8.cu's FP8 tile pass): each CTA's maxima go to the backend's amax
// workspace by atomicMax on the FP32 bit pattern (non-negative floats order as ints, so the result
// does not depend on the order); the last CTA to finish (a counter, after a fence) copies them to
// the targets and puts the workspace back to zero for the next pass on the stream. This replaces a
// memset per target (and a copy for the second target) per quantize call.
#pragma once

#include <cuda_runtime.h>

#include "emu/hd.hpp"

namespace fp4sim::gpu {

struct AmaxArgs {
  float* amax_plain;   // max |x| (or null)
  float* amax_plain2;  // a second copy of max |x| (a second copy's amax), or null
  float* amax_rht;     // max |rht(x)| of the column-wise copy (or null)
  uint16_t* rht_out;   // where to keep rht(x) (BF16, transposed: cols x rows, dense), or null
  unsigned* ws;        // the backend's amax workspace: {plain, rht, CTAs done}, zero between passes
  float* col_partial =
      nullptr;  // x's 64-row chunk column sums [R / 64, C] (the pipelined RHT pass only), or null
};

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmax_nan_ignored(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

// One thread per CTA (after the CTA's own reduction): this CTA's maxima p (plain) and q (RHT) into
// the workspace; the grid's last CTA writes the targets and zeroes the workspace.
__device__ __forceinline__ void amax_commit(float p, float q, const AmaxArgs& args) {
  unsigned* ws = args.ws;
  if (args.amax_plain) atomicMax(ws, __float_as_uint(p));
  if (args.amax_rht) atomicMax(ws + 1, __float_as_uint(q));
  __threadfence();
  if (atomicAdd(ws + 2, 1u) != gridDim.x * gridDim.y * gridDim.z - 1) return;
  __threadfence();
  const float plain = __uint_as_float(atomicExch(ws, 0u)),
              rht = __uint_as_float(atomicExch(ws + 1, 0u));
  if (args.amax_plain) *args.amax_plain = plain;
  if (args.amax_plain2) *args.amax_plain2 = plain;
  if (args.amax_rht) *args.amax_rht = rht;
  atomicExch(ws + 2, 0u);
}

// Every thread of a Threads-thread CTA calls this with its own maxima, at the end of the pass.
template <int Threads>
__device__ void amax_finish(float m_plain, float m_rht, const AmaxArgs& args) {
  __shared__ float partial[2][Threads / 32];
  m_plain = warp_max(m_plain);
  m_rht = warp_max(m_rht);
  if ((threadIdx.x & 31) == 0) {
    partial[0][threadIdx.x >> 5] = m_plain;
    partial[1][threadIdx.x >> 5] = m_rht;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  float p = partial[0][0], q = partial[1][0];
  for (int w = 1; w < Threads / 32; ++w) {
    p = fmax_nan_ignored(p, partial[0][w]);
    q = fmax_nan_ignored(q, partial[1][w]);
  }
  amax_commit(p, q, args);
}

}  // namespace fp4sim::gpu
