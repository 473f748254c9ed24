// The attention kernels' building blocks (gpu/attention.cu states their numerics): the CTA shape,
// the m16n8k16 BF16 MMA fragments and ldmatrix loads, the cp.async staging of the K, V, Q and dO
// tiles, the BF16 conversions. Definitions in an anonymous namespace: for gpu/attention.cu's
// kernels (gpu/attention_forward.cuh, gpu/attention_backward.cuh) only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "emu/formats.hpp"
#include "gpu/exp2.cuh"
#include "gpu/formats_device.cuh"

namespace fp4sim::gpu {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 64;      // query rows per CTA, keys per K/V tile (kWarps * kWarpRows)
constexpr int kWarpRows = 16;  // the M of one m16n8k16 MMA
constexpr int kSmemPad = 8;    // BF16 elements of padding per shared row (16 bytes)
static_assert(kTile == kWarps * kWarpRows, "each warp owns 16 rows of a tile");

using bf16 = __nv_bfloat16;

// ---- tensor-core fragments ----------------------------------------------------------------------
// m16n8k16 fragments of one lane (PTX ISA, "Matrix fragments for mma.m16n8k16"), gid = lane / 4,
// tig = lane % 4: A (16x16) a[0] = (gid, 2tig..+1), a[1] = (gid+8, 2tig..), a[2] = (gid, 2tig+8..),
// a[3] = (gid+8, 2tig+8..); B (16x8, k x n) b[0] = (k 2tig..+1, n gid), b[1] = (k 2tig+8.., n gid);
// C (16x8) c[0..1] = (gid, 2tig..+1), c[2..3] = (gid+8, 2tig..+1). The lower half of a register
// holds the lower index.

// Two FP32 values as a BF16 pair (lo in the low half), each rounded RNE.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return (static_cast<uint32_t>(__bfloat16_as_ushort(v.y)) << 16) | __bfloat16_as_ushort(v.x);
}

// d += A * B, BF16 operands, FP32 accumulator.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 BF16 matrices from shared memory; lanes 8i..8i+7 give the row addresses of matrix i,
// register i receives it (row gid, columns 2tig..+1; with .trans rows 2tig..+1, column gid).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const bf16* row) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const bf16* row) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// The transpose of an 8x8 BF16 matrix held as an MMA fragment (lane: row gid, columns 2tig..+1),
// in the same layout.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t a) {
  uint32_t d;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(a));
  return d;
}

// Shared tiles are row-major BF16 [kTile][kStride]. Three ways to read MMA operands from them:
// - load_a: the A fragment of rows r0..r0+15, columns c0..c0+15 (rows are M, columns K).
// - load_b_nk: B fragments of two n8 tiles where the tile's rows n0..n0+15 are N and its columns
//   c0..c0+15 are K (B = tile^T, as K in S = Q K^T): b[0..1] for n0..n0+7, b[2..3] for n0+8..15.
// - load_b_kn: B fragments of two n8 tiles where the tile's rows k0..k0+15 are K and its columns
//   n0..n0+15 are N (as V in O = P V): transposed load, b[0..1] for n0..n0+7, b[2..3] for n0+8..15.
template <int kStride>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16* tile, int r0, int c0,
                                       int lane) {
  ldmatrix_x4(a, tile + (r0 + (lane & 15)) * kStride + c0 + (lane >> 4) * 8);
}
template <int kStride>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const bf16* tile, int n0, int c0,
                                          int lane) {
  ldmatrix_x4(b, tile + (n0 + (lane & 7) + (lane >> 4) * 8) * kStride + c0 + ((lane >> 3) & 1) * 8);
}
template <int kStride>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const bf16* tile, int k0, int n0,
                                          int lane) {
  ldmatrix_x4_trans(
      b, tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * kStride + n0 + (lane >> 4) * 8);
}

// d_lo, d_hi (the two n8 halves of one 16x16 output block) += a (16x16) * B, B the 16x16 block at
// (r0, c0) of a shared tile read by load_b_nk (kRowsAreN: tile rows are B's n) or load_b_kn (rows
// are B's k)
template <int kStride, bool kRowsAreN>
__device__ __forceinline__ void mma_block(float (&d_lo)[4], float (&d_hi)[4],
                                          const uint32_t (&a)[4], const bf16* tile, int r0, int c0,
                                          int lane) {
  uint32_t b[4];
  if constexpr (kRowsAreN)
    load_b_nk<kStride>(b, tile, r0, c0, lane);
  else
    load_b_kn<kStride>(b, tile, r0, c0, lane);
  mma_bf16(d_lo, a, b[0], b[1]);
  mma_bf16(d_hi, a, b[2], b[3]);
}

// ---- staging: BF16 operands, copied global -> shared with cp.async
// ------------------------------- The launchers round qkv and dout to BF16 once per call (bf16_rne:
// the same values the kernels used to round while staging), so a tile is a plain 16-byte copy that
// the copy engine does while the warps compute on the other buffer.

// 16 bytes global -> shared, asynchronously; zero-filled (nothing read) when !valid.
__device__ __forceinline__ void cp_async16(bf16* smem, const bf16* gmem, bool valid) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n)
               : "memory");
}
// 4 bytes global -> shared, asynchronously (through L1); zero-filled when !valid.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int n = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(n)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// wait until at most N of this thread's committed groups are still in flight
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Buffers per staged operand: two (copy the next tile while computing on this one) where they fit
// in the 48 KB of static shared memory, one for HD = 128.
template <int HD>
constexpr int kStages = HD <= 64 ? 2 : 1;

// The top of iteration i of n of a staged loop: with two buffers, start copying i + 1 (or, on the
// last iteration, commit an empty group, so that wait<1> still means "all but the newest") and wait
// for i, whose copy began an iteration earlier; with one buffer, copy i and wait for it. Then the
// barrier that makes the copies visible to every warp. The buffer i + 1 goes to was last read in
// iteration i - 1, which every warp has left: the loops end with a barrier.
template <int kS, class Stage>
__device__ __forceinline__ void staged_acquire(int i, int n, const Stage& stage) {
  if (kS == 2) {
    if (i + 1 < n)
      stage(i + 1);
    else
      cp_async_commit();
    cp_async_wait<1>();
  } else {
    stage(i);
    cp_async_wait<0>();
  }
  __syncthreads();
}

// Rows row0..row0+kTile-1 of one head (HD BF16 columns starting at src, rows row_stride apart) into
// a shared tile, asynchronously; rows >= T are zeros. The caller commits and waits.
template <int HD>
__device__ __forceinline__ void stage_tile_async(bf16* tile, const bf16* src, int64_t row_stride,
                                                 int row0, int T) {
  constexpr int kStride = HD + kSmemPad, kChunksPerRow = HD / 8;
  for (int e = threadIdx.x; e < kTile * kChunksPerRow; e += kThreads) {
    const int r = e / kChunksPerRow, c = (e % kChunksPerRow) * 8;
    const bool valid = row0 + r < T;
    cp_async16(tile + r * kStride + c,
               src + (valid ? static_cast<int64_t>(row0 + r) * row_stride + c : 0), valid);
  }
}

// The A fragments (HD/16 of them, along HD) of the 16 rows row0..row0+15 of one head, straight
// from the BF16 copy in global memory (rows >= T are zeros): Q in the forward and dQ kernels, dO in
// the dQ kernel, K and V in the dK/dV kernel. Loaded once per CTA. (Two BF16 values per 4-byte
// load, the lower column in the low half, as the fragment wants.)
template <int HD>
__device__ __forceinline__ void load_a_rows(uint32_t (&a)[HD / 16][4], const bf16* src,
                                            int64_t row_stride, int row0, int T, int lane) {
  const int gid = lane >> 2, tig = lane & 3;
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + gid + half * 8;
    const bf16* p = src + static_cast<int64_t>(row) * row_stride + 2 * tig;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      a[kk][half] = row < T ? *reinterpret_cast<const uint32_t*>(p + kk * 16) : 0u;
      a[kk][half + 2] = row < T ? *reinterpret_cast<const uint32_t*>(p + kk * 16 + 8) : 0u;
    }
  }
}

// FP32 -> BF16 (RNE; NaN -> the canonical NaN, as bf16_rne), four at a time: n % 4 == 0 and both
// pointers 16-byte / 8-byte aligned (the launchers' shapes guarantee it).
__global__ void to_bf16_kernel(bf16* dst, const float* src, int64_t n4) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 v = reinterpret_cast<const float4*>(src)[i];
    reinterpret_cast<uint2*>(dst)[i] = make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
  }
}

// The A fragment (16 rows x 16 columns) made of two n8 accumulator tiles c0 (columns 0..7) and c1
// (columns 8..15), rounded to BF16: the FlashAttention-2 register reuse of P and dS.
__device__ __forceinline__ void accumulators_to_a(uint32_t (&a)[4], const float (&c0)[4],
                                                  const float (&c1)[4]) {
  a[0] = pack_bf16x2(c0[0], c0[1]);
  a[1] = pack_bf16x2(c0[2], c0[3]);
  a[2] = pack_bf16x2(c1[0], c1[1]);
  a[3] = pack_bf16x2(c1[2], c1[3]);
}

// The scores' factor into base-2 units: scale * log2(e), FP32 (the same value in every kernel)
__device__ __forceinline__ float log2_scale(float scale) { return __fmul_rn(scale, kLog2e); }

// An output element as the kernels store it: BF16-rounded when kRound (the caller's BF16 storage).
template <bool kRound>
__device__ __forceinline__ float stored_out(float v) {
  return kRound ? bf16_round_cvt(v) : v;
}

}  // namespace

}  // namespace fp4sim::gpu
