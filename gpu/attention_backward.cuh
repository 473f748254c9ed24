// The attention backward kernels: dsum = rowsum(dO * O), then dK/dV (storing bf16(dS) for the dQ
// kernel, or not) and dQ, on mma.sync: for gpu/attention.cu, which states their numerics and
// launches them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "gpu/attention_tiles.cuh"
#include "gpu/exp2.cuh"
#include "gpu/formats_device.cuh"

namespace fp4sim::gpu {

namespace {

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
          acc = __fadd_rn(acc, __fmul_rn(bf16_round_cvt(a[(i + j) % kA]), c[(i + j) % kC]));
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

}  // namespace

}  // namespace fp4sim::gpu
