// The finalize pass of the chunked column sums (gpu/column_sums.cuh): each column's chunk partials
// added in increasing chunk order, written or added to the output.
#include <cuda_runtime.h>

#include "gpu/column_sums.cuh"
#include "gpu/cuda_check.hpp"

namespace fp4sim::gpu {

namespace {

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

}  // namespace

void column_sums_finalize(float* out, const float* partial, int64_t N, int64_t C, bool add_to_out,
                          cudaStream_t stream, float* out2, const float* partial2) {
  const unsigned blocks = static_cast<unsigned>((C + kFinalizeCols - 1) / kFinalizeCols);
  column_sums_finalize_kernel<<<out2 ? 2 * blocks : blocks, kFinalizeCols * kFinalizeWarps, 0,
                                stream>>>(out, partial, column_chunks(N), C, add_to_out, out2,
                                          partial2, blocks);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

}  // namespace fp4sim::gpu
