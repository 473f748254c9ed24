// Causal self-attention with grouped KV heads on the tensor cores: FlashAttention-2 kernels (Dao,
// 2023) on mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, the CUDA twins of
// emu/attention.hpp's attention_forward / attention_backward (same shapes, same saved lse, dqkv
// written as +0 + value). The (B,NH,T,T) probabilities are never stored; for HD <= 64 the backward
// pass stores bf16(dS) (B,NH, causal tiles) in a scratch the dQ kernel reads, and otherwise
// recomputes it in the dQ kernel (the same values either way).
//
// Shapes: qkv (B,T,(NH+2NKV)*HD) FP32 holding the NH query heads, then NKV key heads, then NKV
// value heads; out and dout (B,T,NH*HD); lse and dsum (B,NH,T). Query head h reads KV head
// h / (NH/NKV). HD in {16, 32, 64, 128} (template argument).
//
// Tiling: a tile is kTile = 64 rows; a CTA is 4 warps, each warp owns 16 rows of the tile (the M of
// the m16n8k16 MMA). K, V, Q, dO tiles are staged in shared memory as BF16 rows padded by
// kSmemPad elements (so the 8 rows an ldmatrix phase reads fall on distinct banks).
//
// Numerics (emu/attention.hpp states the contract; this file agrees with it within a bound, not
// bitwise):
// - Operands: q, k, v, dout rounded FP32 -> BF16 RNE once per call into BF16 copies
// (cvt.rn.bf16x2.f32:
//   the value of emu/formats.hpp's bf16_rne for every input, NaN -> canonical NaN; a no-op on
//   BF16-stored activations), which the kernels stage with cp.async, the next tile's copy in flight
//   while the current one is used (two buffers for HD <= 64). P and dS rounded the same way in
//   registers before they feed an MMA.
// - Products exact, sums in FP32 inside the tensor core (its order, not the emulator's
//   sequential one); every MMA chain starts from +0.
// - s = acc * scale (one FP32 multiplication, scale = 1/sqrt(HD) as the emulator computes it).
// - Exponentials in base 2, as FlashAttention computes them: the scores are scaled by
//   scale * log2(e) (both FP32-rounded once, the product once more; one multiplication an element)
//   and exp(x) is ex2.approx.ftz (gpu/exp2.cuh: one MUFU instruction, ~2 ulp; results below
//   2^-126 flush to zero, p that small adds nothing a BF16 P can hold next to the row's largest
//   p = 1): a few ulp from the emulator's expf, more for large |x| where p is tiny.
// - Forward: online softmax per 64-key tile, FP32, in base-2 units u = s * scale * log2(e):
//   m_new = max(m, tile max); the running sum l and the output accumulator are rescaled by
//   2^(m - m_new); p = 2^(u - m_new) (the row's maximum gives exactly 1) is rounded to BF16 for
//   the PV MMA while l sums the unrounded p. So P is rounded relative to the running max, not the
//   final one: each term of out differs from the emulator's by up to one BF16 rounding (2^-8
//   relative) of each side. out = acc / l (IEEE division); lse = (m + log2f(l)) * ln(2), natural
//   units as the emulator saves it.
// - Backward: dsum = rowsum(bf16(dout) * out), FP32 from +0 in increasing i (the emulator's order:
//   bitwise). p = 2^(u - lse * log2(e)) recomputed; dS = p * (dP - dsum), FP32; dq = scale * (sum_j
//   bf16(dS_j) k_j), dk_j = scale * (sum_{h,t} bf16(dS_tj) q_t), dv_j = sum_{h,t} bf16(p_tj)
//   dout_t, each sum FP32 from +0 in registers over a fixed loop order (heads, then query tiles,
//   then 16-row chunks, each in increasing order), then one FP32 multiplication by scale (dq, dk)
//   and the store of +0 + value (BF16-rounded when the caller asks) by the one thread that owns
//   the element; dqkv is never read, so it needs no zeroing.
// - Deterministic: no atomics, no order that depends on scheduling: run to run bitwise.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "emu/formats.hpp"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/exp2.cuh"
#include "gpu/layers_state.hpp"
#include "gpu/op_checks.hpp"

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

// ---- forward ------------------------------------------------------------------------------------

// An output element as the kernels store it: BF16-rounded when kRound (the caller's BF16 storage).
template <bool kRound>
__device__ __forceinline__ float stored_out(float v) {
  return kRound ? bf16_round(v) : v;
}

// One CTA per (b, h, 64-row query tile); grid (B*NH, query tiles), the tiles with the most keys
// first. Warp w owns query rows q_tile*64 + 16w .. +15; each lane two of them (gid, gid + 8).
// kRound: out stored BF16-rounded (the model's BF16 storage of the attention output).
template <int HD, bool kRound, class OutT>
__global__ void __launch_bounds__(kThreads)
    attention_forward_kernel(OutT* out, float* lse, const bf16* qkv, int T, int NH, int NKV,
                             float scale) {
  constexpr int kStride = HD + kSmemPad, kDn = HD / 8, kDk = HD / 16, kS = kStages<HD>;
  __shared__ __align__(16) bf16 k_buf[kS][kTile * kStride];
  __shared__ __align__(16) bf16 v_buf[kS][kTile * kStride];
  const int b = blockIdx.x / NH, h = blockIdx.x % NH, g = h / (NH / NKV);
  const int q_tile = static_cast<int>(gridDim.y) - 1 - static_cast<int>(blockIdx.y);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
  const int64_t W = static_cast<int64_t>(NH + 2 * NKV) * HD;
  const bf16* qkv_b = qkv + static_cast<int64_t>(b) * T * W;
  const int row0 = q_tile * kTile + warp * kWarpRows;
  const int rows[2] = {row0 + gid, row0 + gid + 8};
  auto stage = [&](int kt) {  // K and V of key tile kt into buffer kt % kS
    stage_tile_async<HD>(k_buf[kt % kS], qkv_b + (NH + g) * HD, W, kt * kTile, T);
    stage_tile_async<HD>(v_buf[kt % kS], qkv_b + (NH + NKV + g) * HD, W, kt * kTile, T);
    cp_async_commit();
  };
  if (kS == 2) stage(0);

  uint32_t qa[kDk][4];
  load_a_rows<HD>(qa, qkv_b + h * HD, W, row0, T, lane);
  float o[kDn][4];
#pragma unroll
  for (int n = 0; n < kDn; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const float scale2 = log2_scale(scale);

  for (int kt = 0; kt <= q_tile; ++kt) {
    staged_acquire<kS>(kt, q_tile + 1, stage);  // tile kt + 1 is copied while this one is used
    const bf16* k_s = k_buf[kt % kS];
    const bf16* v_s = v_buf[kt % kS];
    // S (16 x 64 per warp) = Q K^T
    float s[kTile / 8][4];
#pragma unroll
    for (int n = 0; n < kTile / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kDk; ++kk)
#pragma unroll
      for (int np = 0; np < kTile / 16; ++np) {
        mma_block<kStride, true>(s[2 * np], s[2 * np + 1], qa[kk], k_s, np * 16, kk * 16, lane);
      }
    // scale into base-2 units, causal mask (only the diagonal tile has keys above a row: the keys
    // of earlier tiles are below every row of this tile and < T), tile row max over the quad
    if (kt == q_tile) {  // (-inf scales to -inf; the other tiles run no mask code)
#pragma unroll
      for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (kt * kTile + n * 8 + 2 * tig + (e & 1) > rows[e >> 1]) s[n][e] = -INFINITY;
    }
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] = __fmul_rn(s[n][e], scale2);
        tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[n][e]);
      }
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xFFFFFFFFu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xFFFFFFFFu, tile_max[r], 2));
      // every row has key 0 in tile 0 (and key q_tile*64 in its diagonal tile): the max is finite
      const float m_new = fmaxf(m[r], tile_max[r]);
      alpha[r] = exp2_ftz(__fsub_rn(m[r], m_new));  // 2^-inf = 0 on the first tile
      m[r] = m_new;
      l[r] = __fmul_rn(l[r], alpha[r]);
    }
#pragma unroll
    for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = exp2_ftz(__fsub_rn(s[n][e], m[e >> 1]));
        s[n][e] = p;
        l[e >> 1] = __fadd_rn(l[e >> 1], p);
      }
#pragma unroll
    for (int n = 0; n < kDn; ++n) {
      o[n][0] = __fmul_rn(o[n][0], alpha[0]);
      o[n][1] = __fmul_rn(o[n][1], alpha[0]);
      o[n][2] = __fmul_rn(o[n][2], alpha[1]);
      o[n][3] = __fmul_rn(o[n][3], alpha[1]);
    }
    // O += bf16(P) V, 16 keys (one k-step) at a time
#pragma unroll
    for (int kc = 0; kc < kTile / 16; ++kc) {
      uint32_t pa[4];
      accumulators_to_a(pa, s[2 * kc], s[2 * kc + 1]);
#pragma unroll
      for (int dn = 0; dn < HD / 16; ++dn) {
        mma_block<kStride, false>(o[2 * dn], o[2 * dn + 1], pa, v_s, kc * 16, dn * 16, lane);
      }
    }
    __syncthreads();  // every warp is done with this buffer before it is staged again
  }
  // the quad's partial row sums (a fixed butterfly), then out = acc / l and lse = m + log(l)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] = __fadd_rn(l[r], __shfl_xor_sync(0xFFFFFFFFu, l[r], 1));
    l[r] = __fadd_rn(l[r], __shfl_xor_sync(0xFFFFFFFFu, l[r], 2));
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (rows[r] >= T) continue;
    OutT* o_row = out + (static_cast<int64_t>(b) * T + rows[r]) * NH * HD + h * HD;
#pragma unroll
    for (int n = 0; n < kDn; ++n) {
      const float v0 = __fdiv_rn(o[n][2 * r], l[r]), v1 = __fdiv_rn(o[n][2 * r + 1], l[r]);
      if constexpr (std::is_same_v<OutT, float>)
        *reinterpret_cast<float2*>(o_row + n * 8 + 2 * tig) =
            make_float2(stored_out<kRound>(v0), stored_out<kRound>(v1));
      else  // BF16 bits: the rounding is the storage (the bits of bf16_round's value)
        *reinterpret_cast<uint32_t*>(o_row + n * 8 + 2 * tig) = pack_bf16x2(v0, v1);
    }
    if (tig == 0)
      lse[(static_cast<int64_t>(b) * NH + h) * T + rows[r]] =
          __fmul_rn(__fadd_rn(m[r], log2f(l[r])), kLn2);
  }
}

// ---- backward -----------------------------------------------------------------------------------

// A gradient element as the backward kernels store it: +0 + v (the emulator's bits for a value
// written where it used to be added to a zeroed dqkv: -0 becomes +0), BF16-rounded when round_bf16.
// (kRound a template argument: a run-time flag cost the HD 64 dK/dV kernel 13 registers, 164 ->
// 177, one CTA per SM fewer.)
template <bool kRound>
__device__ __forceinline__ float written(float v) {
  return stored_out<kRound>(__fadd_rn(0.0f, v));
}
// Two adjacent gradient elements (the first at an even index) as written(): FP32, or (OutT
// uint16_t, kRound) the BF16 bits of the rounded values (cvt.rn.bf16x2: bf16_rne's bits).
template <bool kRound, class OutT>
__device__ __forceinline__ void store_written2(OutT* p, float v0, float v1) {
  if constexpr (std::is_same_v<OutT, float>) {
    *reinterpret_cast<float2*>(p) = make_float2(written<kRound>(v0), written<kRound>(v1));
  } else {
    static_assert(kRound && std::is_same_v<OutT, uint16_t>, "BF16 bits hold the rounded gradient");
    *reinterpret_cast<uint32_t*>(p) = pack_bf16x2(__fadd_rn(0.0f, v0), __fadd_rn(0.0f, v1));
  }
}

// dsum (B,NH,T) = sum_i bf16(dout_i) * out_i over one head's row r = (b*T + t)*NH + h, one thread
// per row, FP32 from +0 in increasing i: the emulator's order, bitwise. A CTA's kRows rows of dout
// and of out are contiguous in memory: they are copied into shared memory with coalesced 16-byte
// loads (rows padded by 16 bytes, so that both the row-wise stores and each thread's 16-byte reads
// of its own row are free of bank conflicts), then each thread sums its row. The same thread writes
// the row's lse in base-2 units, lse2 = lse * log2(e) (B,NH,T), which the backward kernels read.
// Values from FP32 storage or from BF16 bits (widened: the same values), 16 bytes at a time.
__device__ __forceinline__ int values_in(const uint4& u, float (&x)[8], const float*) {
  x[0] = __uint_as_float(u.x), x[1] = __uint_as_float(u.y), x[2] = __uint_as_float(u.z),
  x[3] = __uint_as_float(u.w);
  return 4;
}
__device__ __forceinline__ int values_in(const uint4& u, float (&x)[8], const uint16_t*) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i)
    x[2 * i] = __uint_as_float(w[i] << 16), x[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  return 8;
}

template <int HD, class DoutT, class OutT>
struct DsumShape {
  static constexpr int kWidest = sizeof(DoutT) > sizeof(OutT) ? sizeof(DoutT) : sizeof(OutT);
  static constexpr int kRows = HD * kWidest <= 128   ? 128
                               : HD * kWidest <= 256 ? 64
                                                     : 32;  // = threads
  static constexpr int kDyWords =
      HD * static_cast<int>(sizeof(DoutT)) / 4 + 4;  // padded row, 4-byte words
  static constexpr int kOWords = HD * static_cast<int>(sizeof(OutT)) / 4 + 4;
};

// Rows row0..row0+n-1 of src (rows of `chunks` 16-byte chunks, contiguous) into a shared array of
// rows `stride` 4-byte words apart, by R threads.
template <int R>
__device__ __forceinline__ void rows_to_shared(uint32_t* dst, const void* src, int64_t row0, int n,
                                               int chunks, int stride) {
  const uint4* g = reinterpret_cast<const uint4*>(src) + row0 * chunks;
  for (int c = threadIdx.x; c < n * chunks; c += R)
    *reinterpret_cast<uint4*>(dst + (c / chunks) * stride + (c % chunks) * 4) = g[c];
}

template <int HD, class DoutT, class OutT>
__global__ void __launch_bounds__((DsumShape<HD, DoutT, OutT>::kRows))
    attention_dsum_kernel(float* dsum, float* lse2, const float* lse, const DoutT* dout,
                          const OutT* out, int64_t rows, int T, int NH) {
  using Shape = DsumShape<HD, DoutT, OutT>;
  constexpr int R = Shape::kRows;
  constexpr int kDyChunks = HD * static_cast<int>(sizeof(DoutT)) / 16,
                kOChunks = HD * static_cast<int>(sizeof(OutT)) / 16;
  __shared__ __align__(16) uint32_t dy_s[R * Shape::kDyWords];
  __shared__ __align__(16) uint32_t o_s[R * Shape::kOWords];
  for (int64_t row0 = static_cast<int64_t>(blockIdx.x) * R; row0 < rows;
       row0 += static_cast<int64_t>(gridDim.x) * R) {
    const int n = static_cast<int>(rows - row0 < R ? rows - row0 : R);
    rows_to_shared<R>(dy_s, dout, row0, n, kDyChunks, Shape::kDyWords);
    rows_to_shared<R>(o_s, out, row0, n, kOChunks, Shape::kOWords);
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < n) {
      const uint32_t* dy_row = dy_s + threadIdx.x * Shape::kDyWords;
      const uint32_t* o_row = o_s + threadIdx.x * Shape::kOWords;
      float acc = 0.0f, a[8], c[8];
      // (i counts values; each 16-byte chunk holds 4 FP32 or 8 BF16 values)
      constexpr int kA = 16 / static_cast<int>(sizeof(DoutT)),
                    kC = 16 / static_cast<int>(sizeof(OutT));
      constexpr int kStep =
          kA < kC ? kA : kC;  // values consumed per step: both chunks' boundaries align
#pragma unroll
      for (int i = 0; i < HD; i += kStep) {
        if (i % kA == 0)
          values_in(*reinterpret_cast<const uint4*>(dy_row + (i / kA) * 4), a,
                    static_cast<const DoutT*>(nullptr));
        if (i % kC == 0)
          values_in(*reinterpret_cast<const uint4*>(o_row + (i / kC) * 4), c,
                    static_cast<const OutT*>(nullptr));
#pragma unroll
        for (int j = 0; j < kStep; ++j)
          acc = __fadd_rn(acc, __fmul_rn(bf16_round(a[(i + j) % kA]), c[(i + j) % kC]));
      }
      const int64_t r = row0 + threadIdx.x;
      const int64_t h = r % NH, bt = r / NH, t = bt % T, b = bt / T;
      dsum[(b * NH + h) * T + t] = acc;
      lse2[(b * NH + h) * T + t] =
          __fmul_rn(lse[(b * NH + h) * T + t], kLog2e);  // (base 2, for the backward)
    }
    __syncthreads();  // before the next rows overwrite the shared arrays
  }
}

// A warp's dq accumulators (rows row0 + gid and row0 + gid + 8 of head h, the MMA's C layout) into
// dqkv: scale * acc, written as +0 + value (BF16-rounded with kRound) by the lane that holds it;
// rows past T are not written. Both dQ kernels end with it.
template <int HD, bool kRound, class OutT>
__device__ __forceinline__ void store_dq_rows(OutT* dqkv, const float (&dq)[HD / 8][4], int b,
                                              int h, int row0, int T, int64_t W, float scale,
                                              int lane) {
  const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + gid + 8 * r;
    if (row >= T) continue;
    OutT* dq_row = dqkv + (static_cast<int64_t>(b) * T + row) * W + h * HD;
#pragma unroll
    for (int n = 0; n < HD / 8; ++n)
      store_written2<kRound>(dq_row + n * 8 + 2 * tig, __fmul_rn(dq[n][2 * r], scale),
                             __fmul_rn(dq[n][2 * r + 1], scale));
  }
}

// dq: one CTA per (b, h, 64-row query tile), grid (B*NH, query tiles), most keys first. Warp w
// owns query rows q_tile*64 + 16w .. +15 and keeps their Q and dO fragments in registers; K and V
// tiles up to the diagonal go through shared memory, 16 keys at a time:
// S = Q K^T, dP = dO V^T, p = exp(s*scale - lse), dS = p (dP - dsum), dq = bf16(dS) K.
// Each dq element is written to dqkv (+0 + value, then BF16-rounded when round_bf16) by the one
// lane that holds it; dqkv is never read.
template <int HD, bool kRound, class OutT>
__global__ void __launch_bounds__(kThreads)
    attention_backward_dq_kernel(OutT* dqkv, const bf16* dout, const bf16* qkv, const float* lse2,
                                 const float* dsum, int T, int NH, int NKV, float scale) {
  constexpr int kStride = HD + kSmemPad, kDn = HD / 8, kDk = HD / 16, kS = kStages<HD>;
  __shared__ __align__(16) bf16 k_buf[kS][kTile * kStride];
  __shared__ __align__(16) bf16 v_buf[kS][kTile * kStride];
  const int b = blockIdx.x / NH, h = blockIdx.x % NH, g = h / (NH / NKV);
  const int q_tile = static_cast<int>(gridDim.y) - 1 - static_cast<int>(blockIdx.y);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
  const int64_t W = static_cast<int64_t>(NH + 2 * NKV) * HD, C = static_cast<int64_t>(NH) * HD;
  const bf16* qkv_b = qkv + static_cast<int64_t>(b) * T * W;
  const int row0 = q_tile * kTile + warp * kWarpRows;
  const int rows[2] = {row0 + gid, row0 + gid + 8};
  auto stage = [&](int kt) {  // K and V of key tile kt into buffer kt % kS
    stage_tile_async<HD>(k_buf[kt % kS], qkv_b + (NH + g) * HD, W, kt * kTile, T);
    stage_tile_async<HD>(v_buf[kt % kS], qkv_b + (NH + NKV + g) * HD, W, kt * kTile, T);
    cp_async_commit();
  };
  if (kS == 2) stage(0);
  float row_lse[2], row_dsum[2];  // (lse in base-2 units)
  const float scale2 = log2_scale(scale);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t i = (static_cast<int64_t>(b) * NH + h) * T + rows[r];
    row_lse[r] = rows[r] < T ? lse2[i] : 0.0f;
    row_dsum[r] = rows[r] < T ? dsum[i] : 0.0f;
  }
  uint32_t qa[kDk][4], da[kDk][4];
  load_a_rows<HD>(qa, qkv_b + h * HD, W, row0, T, lane);
  load_a_rows<HD>(da, dout + static_cast<int64_t>(b) * T * C + h * HD, C, row0, T, lane);
  float dq[kDn][4];
#pragma unroll
  for (int n = 0; n < kDn; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;

  for (int kt = 0; kt <= q_tile; ++kt) {
    staged_acquire<kS>(kt, q_tile + 1, stage);
    const bf16* k_s = k_buf[kt % kS];
    const bf16* v_s = v_buf[kt % kS];
    const bool diagonal = kt == q_tile;
#pragma unroll
    for (int kc = 0; kc < kTile / 16; ++kc) {
      // keys kt*64 + 16kc.. are all above this warp's rows: nothing to add
      if (diagonal && kc > warp) break;
      float s[2][4] = {}, dp[2][4] = {};
#pragma unroll
      for (int kk = 0; kk < kDk; ++kk) {
        mma_block<kStride, true>(s[0], s[1], qa[kk], k_s, kc * 16, kk * 16, lane);
        mma_block<kStride, true>(dp[0], dp[1], da[kk], v_s, kc * 16, kk * 16, lane);
      }
      float ds[2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1, key = kt * kTile + kc * 16 + n * 8 + 2 * tig + (e & 1);
          const bool masked = diagonal && key > rows[r];
          const float p = exp2_ftz(__fsub_rn(__fmul_rn(s[n][e], scale2), row_lse[r]));
          ds[n][e] = masked ? 0.0f : __fmul_rn(p, __fsub_rn(dp[n][e], row_dsum[r]));
        }
      uint32_t dsa[4];
      accumulators_to_a(dsa, ds[0], ds[1]);
#pragma unroll
      for (int dn = 0; dn < HD / 16; ++dn) {
        mma_block<kStride, false>(dq[2 * dn], dq[2 * dn + 1], dsa, k_s, kc * 16, dn * 16, lane);
      }
    }
    __syncthreads();  // every warp is done with this buffer before it is staged again
  }
  store_dq_rows<HD, kRound>(dqkv, dq, b, h, row0, T, W, scale, lane);
}

// The dS^T tiles the dK/dV kernel can leave for the dQ kernel (the stored-dS path): for each (b, h)
// the nt(nt+1)/2 (query tile qt, key tile kt <= qt) pairs in the order (qt, kt), pair index
// qt(qt+1)/2 + kt; a pair is 16 blocks of 16 query rows x 16 keys, block (qc, kc) at 32(4qc + kc)
// uint4s; a block holds, per lane, the A fragment of its bf16(dS^T) (keys x queries) as the dK MMA
// reads it: one 16-byte store a lane, 512 contiguous bytes a warp. Blocks the kernels skip (on the
// diagonal above it, rows past T) are never written nor read as values.
constexpr int kDsBlockUint4 = 32;  // one block: 32 lanes x 16 bytes
constexpr int kDsPairUint4 = (kTile / 16) * (kTile / 16) * kDsBlockUint4;  // 8 KB a tile pair
__host__ __device__ constexpr int64_t ds_pairs(int64_t tiles) { return tiles * (tiles + 1) / 2; }

// dk, dv: one CTA per (b, KV head g, 64-key tile), grid (B*NKV, key tiles), the tiles with the
// most query rows (the first) first. Warp w owns keys k_tile*64 + 16w .. +15 and keeps their K and
// V fragments in registers; for each query head h of the group in increasing order and each query
// tile from the diagonal on, Q, dO, lse and dsum go through shared memory (cp.async, the next
// tile's copy in flight), 16 query rows at a time:
// S^T = K Q^T, dP^T = V dO^T, p = exp(s*scale - lse_t), dS = p (dP - dsum_t),
// dv = bf16(P^T) dO, dk = bf16(dS^T) Q. Each dk, dv element is written to dqkv (as dq above) by
// the one lane that holds it. kStoreDs: bf16(dS^T) also goes to ds (the layout above) for
// attention_backward_dq_stored_kernel. Only the diagonal tile and a last tile past T need the mask;
// the other iterations run a copy of the loop body without it.
template <int HD, bool kRound, bool kStoreDs, class OutT>
__global__ void __launch_bounds__(kThreads, kStoreDs ? 3 : 1)
    attention_backward_dkdv_kernel(OutT* dqkv, uint4* ds, const bf16* dout, const bf16* qkv,
                                   const float* lse2, const float* dsum, int T, int NH, int NKV,
                                   float scale) {
  constexpr int kStride = HD + kSmemPad, kDn = HD / 8, kDk = HD / 16, kS = kStages<HD>;
  __shared__ __align__(16) bf16 q_buf[kS][kTile * kStride];
  __shared__ __align__(16) bf16 do_buf[kS][kTile * kStride];
  __shared__ __align__(16) float lse_buf[kS][kTile];
  __shared__ __align__(16) float dsum_buf[kS][kTile];
  const int b = blockIdx.x / NKV, g = blockIdx.x % NKV, group = NH / NKV;
  const int k_tile = static_cast<int>(blockIdx.y);
  const int q_tiles = (T + kTile - 1) / kTile;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
  const int64_t W = static_cast<int64_t>(NH + 2 * NKV) * HD, C = static_cast<int64_t>(NH) * HD;
  const bf16* qkv_b = qkv + static_cast<int64_t>(b) * T * W;
  const bf16* dout_b = dout + static_cast<int64_t>(b) * T * C;
  const int key0 = k_tile * kTile + warp * kWarpRows;
  const int keys[2] = {key0 + gid, key0 + gid + 8};
  // iteration it: query head g * group + it / n_qt, query tile k_tile + it % n_qt (the heads of the
  // group in increasing order, each from the diagonal tile on: the order of the sums)
  const int n_qt = q_tiles - k_tile, n_it = group * n_qt;
  auto stage = [&](int it) {  // Q, dO, lse and dsum of iteration it into buffer it % kS
    const int h = g * group + it / n_qt, qt = k_tile + it % n_qt, buf = it % kS;
    stage_tile_async<HD>(q_buf[buf], qkv_b + h * HD, W, qt * kTile, T);
    stage_tile_async<HD>(do_buf[buf], dout_b + h * HD, C, qt * kTile, T);
    {  // threads 0..63 copy lse, 64..127 dsum (rows past T: zeros)
      static_assert(kThreads == 2 * kTile, "one 4-byte copy a thread");
      const int r = threadIdx.x % kTile, t = qt * kTile + r;
      const int64_t i = (static_cast<int64_t>(b) * NH + h) * T + (t < T ? t : 0);
      if (threadIdx.x < kTile)
        cp_async4(&lse_buf[buf][r], lse2 + i, t < T);
      else
        cp_async4(&dsum_buf[buf][r], dsum + i, t < T);
    }
    cp_async_commit();
  };
  if (kS == 2) stage(0);
  uint32_t ka[kDk][4], va[kDk][4];
  load_a_rows<HD>(ka, qkv_b + (NH + g) * HD, W, key0, T, lane);
  load_a_rows<HD>(va, qkv_b + (NH + NKV + g) * HD, W, key0, T, lane);
  float dk[kDn][4], dv[kDn][4];
#pragma unroll
  for (int n = 0; n < kDn; ++n) {
    dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = 0.0f;
    dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.0f;
  }
  const int64_t pairs = ds_pairs(q_tiles);
  const float scale2 = log2_scale(scale);

  const auto iteration = [&](int it, auto masked_tag) {
    constexpr bool kMasked = decltype(masked_tag)::value;
    staged_acquire<kS>(it, n_it, stage);
    const int qt = k_tile + it % n_qt, buf = it % kS;
    const bf16* q_s = q_buf[buf];
    const bf16* do_s = do_buf[buf];
    const float* lse_s = lse_buf[buf];
    const float* dsum_s = dsum_buf[buf];
    [[maybe_unused]] uint4* ds_pair = nullptr;
    if constexpr (kStoreDs) {
      const int h = g * group + it / n_qt;
      ds_pair =
          ds + ((static_cast<int64_t>(b) * NH + h) * pairs + ds_pairs(qt) + k_tile) * kDsPairUint4 +
          warp * kDsBlockUint4 + lane;
    }
#pragma unroll
    for (int qc = 0; qc < kTile / 16; ++qc) {
      // query rows qt*64 + 16qc.. are all before this warp's keys, or all past T: nothing to add
      if (kMasked && ((qt == k_tile && qc < warp) || qt * kTile + qc * 16 >= T)) continue;
      float st[2][4] = {}, dpt[2][4] = {};
#pragma unroll
      for (int kk = 0; kk < kDk; ++kk) {
        mma_block<kStride, true>(st[0], st[1], ka[kk], q_s, qc * 16, kk * 16, lane);
        mma_block<kStride, true>(dpt[0], dpt[1], va[kk], do_s, qc * 16, kk * 16, lane);
      }
      float p[2][4], ds_v[2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const int qr = qc * 16 + n * 8 + 2 * tig;  // this lane's query rows qr, qr + 1 of the tile
        const float2 row_lse = *reinterpret_cast<const float2*>(lse_s + qr);  // (base 2)
        const float2 row_dsum = *reinterpret_cast<const float2*>(dsum_s + qr);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float l_e = e & 1 ? row_lse.y : row_lse.x, d_e = e & 1 ? row_dsum.y : row_dsum.x;
          const float pe = exp2_ftz(__fsub_rn(__fmul_rn(st[n][e], scale2), l_e));
          const float dse = __fmul_rn(pe, __fsub_rn(dpt[n][e], d_e));
          if constexpr (kMasked) {
            const int t = qt * kTile + qr + (e & 1);
            const bool masked = t >= T || keys[e >> 1] > t;
            p[n][e] = masked ? 0.0f : pe;
            ds_v[n][e] = masked ? 0.0f : dse;
          } else {
            p[n][e] = pe;
            ds_v[n][e] = dse;
          }
        }
      }
      uint32_t pa[4], dsa[4];
      accumulators_to_a(pa, p[0], p[1]);
      accumulators_to_a(dsa, ds_v[0], ds_v[1]);
      if constexpr (kStoreDs)
        ds_pair[qc * (kTile / 16) * kDsBlockUint4] = make_uint4(dsa[0], dsa[1], dsa[2], dsa[3]);
#pragma unroll
      for (int dn = 0; dn < HD / 16; ++dn) {
        mma_block<kStride, false>(dv[2 * dn], dv[2 * dn + 1], pa, do_s, qc * 16, dn * 16, lane);
        mma_block<kStride, false>(dk[2 * dn], dk[2 * dn + 1], dsa, q_s, qc * 16, dn * 16, lane);
      }
    }
    __syncthreads();  // every warp is done with this buffer before it is staged again
  };
  for (int it = 0; it < n_it; ++it) {
    const int qt = k_tile + it % n_qt;
    if (qt == k_tile || (qt + 1) * kTile > T)
      iteration(it, std::true_type{});
    else
      iteration(it, std::false_type{});
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (keys[r] >= T) continue;
    OutT* dk_row = dqkv + (static_cast<int64_t>(b) * T + keys[r]) * W + (NH + g) * HD;
    OutT* dv_row = dqkv + (static_cast<int64_t>(b) * T + keys[r]) * W + (NH + NKV + g) * HD;
#pragma unroll
    for (int n = 0; n < kDn; ++n) {
      store_written2<kRound>(dk_row + n * 8 + 2 * tig, __fmul_rn(dk[n][2 * r], scale),
                             __fmul_rn(dk[n][2 * r + 1], scale));
      store_written2<kRound>(dv_row + n * 8 + 2 * tig, dv[n][2 * r], dv[n][2 * r + 1]);
    }
  }
}

// dq from the stored dS (the dK/dV kernel's kStoreDs): one CTA per (b, h, 64-row query tile), grid
// (B*NH, query tiles), most keys first. Warp w owns query rows q_tile*64 + 16w .. +15; for each key
// tile up to the diagonal, K and the warp's four dS^T blocks go through shared memory (cp.async,
// the next tile's copy in flight); each block is transposed in registers (movmatrix) into the A
// fragment of dS, and dq = bf16(dS) K: the same BF16 values in the same MMA chain (key tiles, then
// 16-key chunks, in increasing order) as attention_backward_dq_kernel, which recomputes them. Each
// dq element is written to dqkv (+0 + value, BF16-rounded when round_bf16) by the lane that holds
// it.
template <int HD, bool kRound, class OutT>
__global__ void __launch_bounds__(kThreads)
    attention_backward_dq_stored_kernel(OutT* dqkv, const uint4* ds, const bf16* qkv, int T, int NH,
                                        int NKV, float scale) {
  constexpr int kStride = HD + kSmemPad, kDn = HD / 8, kS = kStages<HD>, kBlocks = kTile / 16;
  __shared__ __align__(16) bf16 k_buf[kS][kTile * kStride];
  __shared__ __align__(16) uint4 ds_buf[kS][kDsPairUint4];
  const int b = blockIdx.x / NH, h = blockIdx.x % NH, g = h / (NH / NKV);
  const int q_tile = static_cast<int>(gridDim.y) - 1 - static_cast<int>(blockIdx.y);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t W = static_cast<int64_t>(NH + 2 * NKV) * HD;
  const bf16* qkv_b = qkv + static_cast<int64_t>(b) * T * W;
  const uint4* ds_row =
      ds +
      ((static_cast<int64_t>(b) * NH + h) * ds_pairs(gridDim.y) + ds_pairs(q_tile)) * kDsPairUint4;
  // this warp's blocks (qc = warp, kc = 0..3): 4 x 512 contiguous bytes, each lane copies its own
  const int own = warp * kBlocks * kDsBlockUint4 + lane;
  auto stage = [&](int kt) {  // K of key tile kt and the dS^T blocks of pair (q_tile, kt) into
                              // buffer kt % kS
    stage_tile_async<HD>(k_buf[kt % kS], qkv_b + (NH + g) * HD, W, kt * kTile, T);
#pragma unroll
    for (int kc = 0; kc < kBlocks; ++kc) {
      const int i = own + kc * kDsBlockUint4;
      cp_async16(reinterpret_cast<bf16*>(&ds_buf[kt % kS][i]),
                 reinterpret_cast<const bf16*>(ds_row + kt * kDsPairUint4 + i),
                 kt < q_tile || kc <= warp);  // (above the diagonal: never written, not read)
    }
    cp_async_commit();
  };
  if (kS == 2) stage(0);
  float dq[kDn][4];
#pragma unroll
  for (int n = 0; n < kDn; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;

  for (int kt = 0; kt <= q_tile; ++kt) {
    staged_acquire<kS>(kt, q_tile + 1, stage);
    const bf16* k_s = k_buf[kt % kS];
    const bool diagonal = kt == q_tile;
#pragma unroll
    for (int kc = 0; kc < kBlocks; ++kc) {
      if (diagonal && kc > warp) break;  // keys above this warp's rows: nothing to add
      const uint4 t = ds_buf[kt % kS][own + kc * kDsBlockUint4];
      // dS^T's fragment: x = (keys 0-7, queries 0-7), y = (keys 8-15, q 0-7), z = (k 0-7, q 8-15),
      // w = (k 8-15, q 8-15); dS's: (q 0-7, k 0-7), (q 8-15, k 0-7), (q 0-7, k 8-15), (q 8-15, k
      // 8-15)
      uint32_t dsa[4];
      dsa[0] = movmatrix_trans(t.x), dsa[1] = movmatrix_trans(t.z), dsa[2] = movmatrix_trans(t.y),
      dsa[3] = movmatrix_trans(t.w);
#pragma unroll
      for (int dn = 0; dn < HD / 16; ++dn) {
        mma_block<kStride, false>(dq[2 * dn], dq[2 * dn + 1], dsa, k_s, kc * 16, dn * 16, lane);
      }
    }
    __syncthreads();  // every warp is done with this buffer before it is staged again
  }
  store_dq_rows<HD, kRound>(dqkv, dq, b, h, q_tile * kTile + warp * kWarpRows, T, W, scale, lane);
}

// ---- host side ----------------------------------------------------------------------------------

void require_aligned(const char* op, const char* tensor, const void* p) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0)
    throw std::invalid_argument(std::string(op) + ": " + tensor +
                                " must be 16-byte aligned (vector and cp.async loads)");
}

// dst (n FP32 values, n % 4 == 0) as BF16 bits.
void to_bf16(bf16* dst, const float* src, int64_t n, cudaStream_t stream) {
  const int64_t n4 = n / 4;
  const int64_t blocks = (n4 + 255) / 256;
  to_bf16_kernel<<<static_cast<unsigned>(blocks < 132 * 32 ? (blocks > 0 ? blocks : 1) : 132 * 32),
                   256, 0, stream>>>(dst, src, n4);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

template <int HD>
void forward_for(float* out, uint16_t* out16, float* lse, const bf16* qkv, int64_t B, int64_t T,
                 int64_t NH, int64_t NKV, bool round_bf16, cudaStream_t stream) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));  // as the emulator, on the host
  const dim3 grid(static_cast<unsigned>(B * NH), static_cast<unsigned>((T + kTile - 1) / kTile));
  const int t = static_cast<int>(T), nh = static_cast<int>(NH), nkv = static_cast<int>(NKV);
  if (out16)
    attention_forward_kernel<HD, true, uint16_t>
        <<<grid, kThreads, 0, stream>>>(out16, lse, qkv, t, nh, nkv, scale);
  else if (round_bf16)
    attention_forward_kernel<HD, true, float>
        <<<grid, kThreads, 0, stream>>>(out, lse, qkv, t, nh, nkv, scale);
  else
    attention_forward_kernel<HD, false, float>
        <<<grid, kThreads, 0, stream>>>(out, lse, qkv, t, nh, nkv, scale);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

template <int HD, bool kRound, class OutT>
void backward_kernels(OutT* dqkv, const float* dsum, uint4* ds, const bf16* dout16,
                      const bf16* qkv16, const float* lse2, int64_t B, int64_t T, int64_t NH,
                      int64_t NKV, float scale, cudaStream_t stream) {
  const int64_t tiles = (T + kTile - 1) / kTile;
  const int t = static_cast<int>(T), nh = static_cast<int>(NH), nkv = static_cast<int>(NKV);
  const dim3 kv_grid(static_cast<unsigned>(B * NKV), static_cast<unsigned>(tiles));
  const dim3 q_grid(static_cast<unsigned>(B * NH), static_cast<unsigned>(tiles));
  if constexpr (HD <= 64) {
    if (ds) {
      attention_backward_dkdv_kernel<HD, kRound, true, OutT><<<kv_grid, kThreads, 0, stream>>>(
          dqkv, ds, dout16, qkv16, lse2, dsum, t, nh, nkv, scale);
      FP4SIM_CUDA_CHECK_LAUNCH();
      attention_backward_dq_stored_kernel<HD, kRound, OutT>
          <<<q_grid, kThreads, 0, stream>>>(dqkv, ds, qkv16, t, nh, nkv, scale);
      FP4SIM_CUDA_CHECK_LAUNCH();
      return;
    }
  }
  attention_backward_dkdv_kernel<HD, kRound, false, OutT><<<kv_grid, kThreads, 0, stream>>>(
      dqkv, nullptr, dout16, qkv16, lse2, dsum, t, nh, nkv, scale);
  FP4SIM_CUDA_CHECK_LAUNCH();
  attention_backward_dq_kernel<HD, kRound, OutT>
      <<<q_grid, kThreads, 0, stream>>>(dqkv, dout16, qkv16, lse2, dsum, t, nh, nkv, scale);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

template <int HD, class DoutT, class OutT>
void dsum_launch(float* dsum, float* lse2, const float* lse, const DoutT* dout, const OutT* out,
                 int64_t rows, int T, int NH, cudaStream_t stream) {
  constexpr int R = DsumShape<HD, DoutT, OutT>::kRows;
  const int64_t blocks = (rows + R - 1) / R;
  attention_dsum_kernel<HD, DoutT, OutT>
      <<<static_cast<unsigned>(blocks < 65536 ? blocks : 65536), R, 0, stream>>>(
          dsum, lse2, lse, dout, out, rows, T, NH);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

template <int HD>
void backward_for(float* dqkv, uint16_t* dqkv16, float* dsum, uint4* ds, const float* dout,
                  const bf16* dout16, bool dout_bits, const bf16* qkv16, const float* out,
                  const uint16_t* out16, const float* lse, int64_t B, int64_t T, int64_t NH,
                  int64_t NKV, bool round_bf16, cudaStream_t stream) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
  const int64_t rows = B * T * NH;
  const int t = static_cast<int>(T), nh = static_cast<int>(NH);
  // (dout_bits: dout given as BF16 bits, read from dout16; the bits bf16_round(dout) would give)
  const uint16_t* d16 = reinterpret_cast<const uint16_t*>(dout16);
  // dsum's scratch holds rows values of dsum, then rows of lse2 = lse * log2(e)
  float* lse2 = dsum + rows;
  if (dout_bits && out16)
    dsum_launch<HD>(dsum, lse2, lse, d16, out16, rows, t, nh, stream);
  else if (dout_bits)
    dsum_launch<HD>(dsum, lse2, lse, d16, out, rows, t, nh, stream);
  else if (out16)
    dsum_launch<HD>(dsum, lse2, lse, dout, out16, rows, t, nh, stream);
  else
    dsum_launch<HD>(dsum, lse2, lse, dout, out, rows, t, nh, stream);
  if (dqkv16)
    backward_kernels<HD, true>(dqkv16, dsum, ds, dout16, qkv16, lse2, B, T, NH, NKV, scale, stream);
  else if (round_bf16)
    backward_kernels<HD, true>(dqkv, dsum, ds, dout16, qkv16, lse2, B, T, NH, NKV, scale, stream);
  else
    backward_kernels<HD, false>(dqkv, dsum, ds, dout16, qkv16, lse2, B, T, NH, NKV, scale, stream);
}

std::atomic<bool> g_recompute_dq{false};  // set_attention_recompute_dq

}  // namespace

void set_attention_recompute_dq(bool on) { g_recompute_dq = on; }

int64_t attention_ds_scratch_bytes(int64_t B, int64_t T, int64_t NH, int64_t HD) {
  constexpr int64_t kMaxDsBytes = int64_t{1} << 30;
  if (HD > 64 || B <= 0 || T <= 0 || g_recompute_dq) return 0;
  const int64_t bytes = B * NH * ds_pairs((T + kTile - 1) / kTile) * kDsPairUint4 * 16;
  return bytes <= kMaxDsBytes ? bytes : 0;
}

void attention_check_shape(const char* op, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                           int64_t HD) {
  if (!attention_head_dim_supported(HD))
    throw std::invalid_argument(std::string(op) + ": head dim HD=" + std::to_string(HD) +
                                " is not supported by the CUDA attention kernels; expected 16, 32, "
                                "64 or 128");
  if (NH <= 0 || NKV <= 0 || NH % NKV != 0)
    throw std::invalid_argument(std::string(op) + ": NH=" + std::to_string(NH) +
                                " NKV=" + std::to_string(NKV) +
                                "; expected NH, NKV > 0 and NH a multiple of NKV");
  const int64_t tiles = (T + kTile - 1) / kTile;
  if (B < 0 || T < 0 || tiles > 65535 || B * NH > INT_MAX)
    throw std::invalid_argument(std::string(op) + ": B=" + std::to_string(B) +
                                " T=" + std::to_string(T) + " NH=" + std::to_string(NH) +
                                "; expected T <= " + std::to_string(65535 * kTile) +
                                " and B*NH < 2^31 (one CTA per head and 64-row tile)");
}

// qkv (FP32, converted into the qkv16 scratch here) or qkv_in16 (BF16 bits, read as they are);
// out (FP32, BF16-rounded when round_bf16) or out16 (BF16 bits).
void attention_forward_launch(float* out, uint16_t* out16, float* lse, const float* qkv,
                              const uint16_t* qkv_in16, uint16_t* qkv16, int64_t B, int64_t T,
                              int64_t NH, int64_t NKV, int64_t HD, bool round_bf16,
                              cudaStream_t stream) {
  attention_check_shape("attention_forward", B, T, NH, NKV, HD);
  if (B * T == 0) return;
  require_aligned("attention_forward", out16 ? "out16" : "out",
                  out16 ? static_cast<const void*>(out16) : out);
  const bf16* q16 = reinterpret_cast<const bf16*>(qkv_in16);
  if (!qkv_in16) {
    require_aligned("attention_forward", "qkv", qkv);
    require_aligned("attention_forward", "qkv16 (scratch)", qkv16);
    to_bf16(reinterpret_cast<bf16*>(qkv16), qkv, B * T * (NH + 2 * NKV) * HD, stream);
    q16 = reinterpret_cast<const bf16*>(qkv16);
  } else {
    require_aligned("attention_forward", "qkv16", qkv_in16);
  }
  switch (HD) {
    case 16:
      forward_for<16>(out, out16, lse, q16, B, T, NH, NKV, round_bf16, stream);
      break;
    case 32:
      forward_for<32>(out, out16, lse, q16, B, T, NH, NKV, round_bf16, stream);
      break;
    case 64:
      forward_for<64>(out, out16, lse, q16, B, T, NH, NKV, round_bf16, stream);
      break;
    default:
      forward_for<128>(out, out16, lse, q16, B, T, NH, NKV, round_bf16, stream);
      break;
  }
}

// qkv / qkv_in16 and out / out16 as attention_forward_launch's (one of each pair); dqkv or dqkv16.
void attention_backward_launch(float* dqkv, uint16_t* dqkv16, float* dsum, const float* dout,
                               const uint16_t* dout_in16, const float* qkv,
                               const uint16_t* qkv_in16, const float* out, const uint16_t* out16,
                               const float* lse, uint16_t* qkv16, uint16_t* dout16, void* ds,
                               int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HD,
                               bool round_bf16, cudaStream_t stream) {
  attention_check_shape("attention_backward", B, T, NH, NKV, HD);
  if (B * T == 0) return;
  require_aligned("attention_backward", dqkv16 ? "dqkv16" : "dqkv",
                  dqkv16 ? static_cast<const void*>(dqkv16) : dqkv);
  require_aligned("attention_backward", dout_in16 ? "dout16" : "dout",
                  dout_in16 ? static_cast<const void*>(dout_in16) : dout);
  require_aligned("attention_backward", out16 ? "out16" : "out",
                  out16 ? static_cast<const void*>(out16) : out);
  if (!dout_in16) require_aligned("attention_backward", "dout16 (scratch)", dout16);
  const bf16* q16 = reinterpret_cast<const bf16*>(qkv_in16);
  if (!qkv_in16) {
    require_aligned("attention_backward", "qkv", qkv);
    require_aligned("attention_backward", "qkv16 (scratch)", qkv16);
    to_bf16(reinterpret_cast<bf16*>(qkv16), qkv, B * T * (NH + 2 * NKV) * HD, stream);
    q16 = reinterpret_cast<const bf16*>(qkv16);
  } else {
    require_aligned("attention_backward", "qkv16", qkv_in16);
  }
  const bf16* d16 = reinterpret_cast<const bf16*>(dout_in16);
  if (!dout_in16) {
    to_bf16(reinterpret_cast<bf16*>(dout16), dout, B * T * NH * HD, stream);
    d16 = reinterpret_cast<const bf16*>(dout16);
  }
  const bool bits = dout_in16 != nullptr;
  if (ds) require_aligned("attention_backward", "ds (scratch)", ds);
  uint4* ds4 = static_cast<uint4*>(ds);
  switch (HD) {
    case 16:
      backward_for<16>(dqkv, dqkv16, dsum, ds4, dout, d16, bits, q16, out, out16, lse, B, T, NH,
                       NKV, round_bf16, stream);
      break;
    case 32:
      backward_for<32>(dqkv, dqkv16, dsum, ds4, dout, d16, bits, q16, out, out16, lse, B, T, NH,
                       NKV, round_bf16, stream);
      break;
    case 64:
      backward_for<64>(dqkv, dqkv16, dsum, ds4, dout, d16, bits, q16, out, out16, lse, B, T, NH,
                       NKV, round_bf16, stream);
      break;
    default:
      backward_for<128>(dqkv, dqkv16, dsum, ds4, dout, d16, bits, q16, out, out16, lse, B, T, NH,
                        NKV, round_bf16, stream);
      break;
  }
}

namespace {

// The attention kernels take BF16 operands; the unrounded FP32 mode is the emulator's alone.
void require_bf16_attention(const char* op, emu::GemmPrecision prec) {
  if (prec != emu::GemmPrecision::BF16)
    throw std::invalid_argument(std::string(op) +
                                ": GemmPrecision::FP32 (no BF16 operand rounding, for gradient "
                                "checks) is emulator-only; the CUDA kernels take BF16 operands");
}

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

// The checks and the backward pass's scratch; the kernels run through the launchers above.
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
}  // namespace fp4sim::gpu
