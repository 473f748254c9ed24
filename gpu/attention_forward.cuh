// The attention forward kernel, FlashAttention-2's online softmax on mma.sync: for
// gpu/attention.cu, which states its numerics and launches it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/attention_tiles.cuh"
#include "gpu/exp2.cuh"

namespace fp4sim::gpu {

namespace {

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

}  // namespace

}  // namespace fp4sim::gpu
