// The chunked SSD scan of the Mamba-2 mixer (DESIGN.md §12: "CUDA: the chunked SSD algorithm"),
// forward and backward: the CUDA backend's default ssm_scan_* (gpu/ssm.cu dispatches here unless
// CudaOptions::ssm_sequential). The same outputs as emu::ssm_scan_forward / ssm_scan_backward
// (emu/ssm.hpp), within docs/numerics.md's bound ("The chunked SSD on CUDA"), not bitwise.
//
// Algorithm, per batch b, head h (group g = h / (H/G)) and chunk c of L <= Q steps from t0, with
// the log-decays g_i = fl32(dt_i * A_h) (the emulator's product), their inclusive prefix sums
// within the chunk cum_i (in FP64: exp of a difference of two of them then has the accuracy of the
// difference, not of their magnitude, which grows to Q * max|dt A|), and u_j = dt_j x_j:
//   chunk state   S_c^loc = sum_j exp(cum_{L-1} - cum_j) u_j B_j^T            (P x L by L x N)
//   passing       S_c = exp(cum_{L-1}) S_{c-1} + S_c^loc, S_{-1} = 0  (a thread an element of
//                 P x N, sequential over the chunks): the saved states, S at min((c+1)Q, T) - 1
//   output        y_i = sum_{j<=i} (C_i . B_j) exp(cum_i - cum_j) u_j + exp(cum_i) S_{c-1} C_i
//                       + D x_i                      (one GEMM over K = [the chunk's j | N])
// and the adjoint (its derivation beside the host model in tests/emu/test_ssd_chunked.cpp):
//   Gout_c, the gradient reaching S_c from later chunks (0 for the last), by the reverse passing
//   of dS_c^loc = sum_i exp(cum_i) dy_i C_i^T: Gout_{c-1} = exp(cum_{L-1}) Gout_c + dS_c^loc;
//   M[i,j] = exp(cum_i - cum_j) (dy_i . u_j) for j <= i (Q x Q a head and chunk);
//   du_j = sum_{i>=j} (C_i . B_j) exp(cum_i - cum_j) dy_i + exp(cum_{L-1} - cum_j) Gout B_j,
//     dx_j = dt_j du_j + D dy_j;
//   dC_i = exp(cum_i) S_{c-1}^T dy_i + sum_{j<=i} M[i,j] B_j, dB_j = sum_{i>=j} M[i,j] C_i +
//     exp(cum_{L-1} - cum_j) Gout^T u_j (a head's terms; a group's summed over its heads after);
//   dg_k (the log-decay's gradient) = exp(cum_{L-1}) <Gout, S_{c-1}> + sum_{i>=k} (a_i + r_i) +
//     sum_{j<k} w_j with a_i = C_i . (the S_{c-1} term of dC_i), w_j = u_j . (the Gout term of
//     du_j), r_i = sum_{j<i} W[i,j] - sum_{l>i} W[l,i], W = (C B^T) o M, the diagonal left out;
//   ddt_k = x_k . du_k + A dg_k, dA = sum dg_k dt_k, dD = sum dy . x.
//
// Kernels: the products are small GEMMs, one thread block a 64 x 64 output tile of one chunk (a
// grid's x the chunk, y and z the tiles), 8 warps of 32 x 16 outputs on the BF16 tensor cores at
// FP32 accuracy (ssd_gemm_kernel: each operand split exactly into three BF16 terms), over k-tiles
// of 32 staged in shared memory; each GEMM's operands are functions of the inputs (decays, dt
// scaling, causal masks) evaluated as they are staged, so only C B^T (a group and chunk, Q x Q),
// the chunk states, their gradients and M are kept in scratch. Tiles and k-tiles that the causal
// masks leave empty are skipped.
//
// Numerics: the GEMMs' products exact, their sums in the tensor cores' FP32 accumulators (k-tiles
// in increasing k, the term pairs of a k-step smallest first), exp as CUDA's expf (<= 2 ulp) of an
// FP32-rounded FP64 difference <= 0 (nothing overflows; strong decay underflows to 0 as in the
// emulator); the row sums of the tiles (dD, the x . du and u . du terms, a_i) in FP32 in fixed
// order, then summed over the tiles in tile order; r_i, dg's prefix and suffix sums and dA's sums
// in FP64 (these cancel: under strong decay dg is a small difference of O(1) terms); a group's dB
// and dC summed over its heads in increasing h. Deterministic: no atomics, every order fixed by the
// shapes.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "emu/hd.hpp"
#include "gpu/capabilities.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/ssm_chunked.hpp"
#include "gpu/training_ops.cuh"

namespace fp4sim::gpu {

namespace {

using emu::SsmShape;

constexpr int kBM = static_cast<int>(kSsdTile), kBN = static_cast<int>(kSsdTile);  // output tile
constexpr int kBK = 32;                                                            // k-tile
constexpr int kGemmThreads = 256;  // 8 warps of 32 x 16 outputs
constexpr int kLd = kBM + 1;       // shared row stride (odd: no bank conflicts either way)
constexpr int kPassThreads = static_cast<int>(kSsdPassElems);
constexpr int kPassWarps = static_cast<int>(kSsdPassWarps);
constexpr int kDgThreads = 128;
static_assert(kBM == 64 && kBN == 64 && kGemmThreads == 256, "the warp tiles assume these");

// (32-bit sizes where the kernels index within a chunk: the staging loops' address arithmetic is
// most of their instructions; require_chunk checks that a chunk's offsets fit)
struct SsdDims {
  int64_t B, T, HP, Cx;
  int H, P, G, N, Q, nc, hpg;
  int Pp, Np, Qp;  // P, N, Q rounded up to the k-tile
};
int round_k(int64_t n) { return static_cast<int>((n + kBK - 1) / kBK * kBK); }
SsdDims ssd_dims(const SsmShape& s) {
  SsdDims d;
  d.B = s.B;
  d.T = s.T;
  d.HP = s.d_inner();
  d.Cx = s.xbc_cols();
  d.H = static_cast<int>(s.H);
  d.P = static_cast<int>(s.P);
  d.G = static_cast<int>(s.G);
  d.N = static_cast<int>(s.N);
  d.Q = static_cast<int>(s.chunk);
  d.nc = static_cast<int>(s.chunks());
  d.hpg = static_cast<int>(s.H / s.G);
  d.Pp = round_k(s.P);
  d.Np = round_k(s.N);
  d.Qp = round_k(s.chunk);
  return d;
}

// exp of a log-decay difference d <= 0
__device__ __forceinline__ float decay(double d) { return expf(static_cast<float>(d)); }

// cum (B,H,T) = the inclusive prefix sums of fl32(dt * A) within each chunk, in FP64; a warp a
// (b, c, h), h fastest: each lane sums a run of ceil(L / 32) steps, the runs' sums are scanned
// across the warp (shuffles), then each lane writes its run's prefixes.
__global__ void ssd_cum_kernel(double* cum, const float* dt, const float* A, SsdDims d) {
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (w >= d.B * d.nc * d.H) return;  // (uniform over the warp)
  const int h = static_cast<int>(w % d.H), c = static_cast<int>((w / d.H) % d.nc);
  const int64_t b = w / (static_cast<int64_t>(d.H) * d.nc), t0 = static_cast<int64_t>(c) * d.Q;
  const int L = static_cast<int>(d.T - t0 < d.Q ? d.T - t0 : d.Q), per = (L + 31) / 32;
  const int s0 = lane * per < L ? lane * per : L, s1 = s0 + per < L ? s0 + per : L;
  const float Ah = A[h];
  const float* dtr = dt + (b * d.T + t0) * d.H + h;
  double run = 0.0;
  for (int t = s0; t < s1; ++t) run += static_cast<double>(fmul_rn(dtr[t * d.H], Ah));
  double incl = run;
  for (int o = 1; o < 32; o *= 2) {
    const double v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  double acc = __shfl_up_sync(0xffffffffu, incl, 1);
  if (lane == 0) acc = 0.0;
  double* out = cum + (b * d.H + h) * d.T + t0;
  for (int t = s0; t < s1; ++t) {
    acc += static_cast<double>(fmul_rn(dtr[t * d.H], Ah));
    out[t] = acc;
  }
}

// ---- the chunk GEMM ----------------------------------------------------------------------------
// Prob supplies, for the chunk z = blockIdx.x: setup(z); tile_needed(m0, n0); prepare(ev, tid)
// (the block's threads fill shared values, synchronised after); k_needed(k0, m0, n0)
// (a k-tile the masks leave empty is skipped); a(m, k), b(k, n) (0 outside the operand);
// a_m_major(k0), b_k_major(k0): which index the threads step through first when staging the
// k-tile (the one along which the source is contiguous); K (a multiple of kBK) and k_split: the
// accumulators as they were before k-tile k_split are kept too (c1: the product over k <
// k_split), or -1; finish(m0, n0, c0, c1, tid): the tile's outputs, c0[m * kLd + n].
//
// The products run on the BF16 tensor cores (mma.sync m16n8k16, FP32 accumulators) at FP32
// accuracy: each staged FP32 operand value v is split exactly into three BF16 terms, hi = bf16(v),
// mid = bf16(v - hi), lo = bf16(v - hi - mid) (v = hi + mid + lo for every finite v whose terms
// stay normal), every product of two terms is exact in FP32, and the six leading term pairs (hi hi,
// hi mid, mid hi, hi lo, mid mid, lo hi) are accumulated; the three left out are below 2^-24 of
// the product. A k-tile whose staged values are all BF16 already (the model's BF16 activations)
// has one term, so its products take one MMA (x, B, C, dy) or three instead of six.

// The staged operand planes: plane q (0 hi, 1 mid, 2 lo) of the A tile [m][k] and of the B tile
// [n][k], k contiguous, a row of kBKp BF16 (20 words: the fragment loads of a warp hit 32 distinct
// banks).
constexpr int kBKp = kBK + 8;
constexpr int kPlane = kBM * kBKp;  // (kBM == kBN)
static_assert(6 * kPlane * 2 <= 2 * kBM * kLd * 4, "the planes fit in the output buffer");

__device__ __forceinline__ uint16_t bf16_bits(float v) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}
__device__ __forceinline__ float bf16_value(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}
// Writes v's three terms to planes[q * kPlane + at]; true when v needs more than one.
__device__ __forceinline__ bool split3(float v, uint16_t* planes, int at) {
  const uint16_t hi = bf16_bits(v);
  uint16_t mid = 0, lo = 0;
  if (isfinite(v)) {
    const float r = v - bf16_value(hi);  // (exact: the rounding error of hi)
    mid = bf16_bits(r);
    lo = bf16_bits(r - bf16_value(mid));
  }
  planes[at] = hi;
  planes[kPlane + at] = mid;
  planes[2 * kPlane + at] = lo;
  return (mid | lo) != 0;
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// A warp's share of the 64 x 64 tile: rows 32 * (warp % 2) .. + 32 (two m16 tiles), columns
// 16 * (warp / 2) .. + 16 (two n8 tiles); acc[mi][ni][4] in the m16n8 accumulator layout.
template <class Prob>
__global__ void __launch_bounds__(kGemmThreads, 3) ssd_gemm_kernel(Prob pr) {
  __shared__ __align__(16) float sm[2 * kBM * kLd];  // the operand planes; then the outputs
  __shared__ float ev[2 * kSsdMaxChunk];             // the chunk's decays (ChunkProb::prepare)
  uint16_t* Ap = reinterpret_cast<uint16_t*>(sm);
  uint16_t* Bp = Ap + 3 * kPlane;
  pr.setup(blockIdx.x);
  const int m0 = static_cast<int>(blockIdx.y) * kBM, n0 = static_cast<int>(blockIdx.z) * kBN;
  if (!pr.tile_needed(m0, n0)) return;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int gid = lane / 4, tig = lane % 4;
  const int wm = 32 * (warp % 2), wn = 16 * (warp / 2);
  pr.prepare(ev, tid);
  __syncthreads();
  float acc[2][2][4], acc1[2][2][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = acc1[i][j][q] = 0.0f;
  for (int k0 = 0; k0 < pr.K; k0 += kBK) {
    if (k0 == pr.k_split) {
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int q = 0; q < 4; ++q) acc1[i][j][q] = acc[i][j][q];
    }
    if (!pr.k_needed(k0, m0, n0)) continue;  // (uniform over the block)
    const bool am = pr.a_m_major(k0), bk = pr.b_k_major(k0);
    bool a_split = false, b_split = false;
    for (int e = tid; e < kBM * kBK; e += kGemmThreads) {
      const int m = am ? e % kBM : e / kBK, k = am ? e / kBM : e % kBK;
      a_split |= split3(pr.a(m0 + m, k0 + k), Ap, m * kBKp + k);
    }
    for (int e = tid; e < kBN * kBK; e += kGemmThreads) {
      const int n = bk ? e / kBK : e % kBN, k = bk ? e % kBK : e / kBN;
      b_split |= split3(pr.b(k0 + k, n0 + n), Bp, n * kBKp + k);
    }
    const int na = __syncthreads_or(a_split) ? 3 : 1;
    const int nb = __syncthreads_or(b_split) ? 3 : 1;
#pragma unroll
    for (int ks = 0; ks < kBK; ks += 16) {
      uint32_t af[3][2][4], bf[3][2][2];
#pragma unroll
      for (int q = 0; q < 3; ++q) {
        if (q >= na && q >= nb) break;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const uint16_t* r = Ap + q * kPlane + (wm + 16 * i + gid) * kBKp + ks + 2 * tig;
          af[q][i][0] = *reinterpret_cast<const uint32_t*>(r);
          af[q][i][1] = *reinterpret_cast<const uint32_t*>(r + 8 * kBKp);
          af[q][i][2] = *reinterpret_cast<const uint32_t*>(r + 8);
          af[q][i][3] = *reinterpret_cast<const uint32_t*>(r + 8 * kBKp + 8);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint16_t* r = Bp + q * kPlane + (wn + 8 * j + gid) * kBKp + ks + 2 * tig;
          bf[q][j][0] = *reinterpret_cast<const uint32_t*>(r);
          bf[q][j][1] = *reinterpret_cast<const uint32_t*>(r + 8);
        }
      }
      // the term pairs (qa, qb), qa + qb <= 2, the small ones first
#pragma unroll
      for (int s = 2; s >= 0; --s)
#pragma unroll
        for (int qa = s; qa >= 0; --qa) {
          const int qb = s - qa;
          if (qa >= na || qb >= nb) continue;
#pragma unroll
          for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j) mma_bf16(acc[i][j], af[qa][i], bf[qb][j]);
        }
    }
    __syncthreads();
  }
  float* c0 = sm;
  float* c1 = sm + kBM * kLd;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int m = wm + 16 * i + gid + 8 * (q / 2), n = wn + 8 * j + 2 * tig + q % 2;
        c0[m * kLd + n] = acc[i][j][q];
        c1[m * kLd + n] = acc1[i][j][q];
      }
  __syncthreads();
  pr.finish(m0, n0, c0, c1, tid);
}

template <class Prob>
void launch_gemm(const Prob& pr, int64_t chunks, int64_t M, int64_t N, cudaStream_t stream) {
  if (chunks <= 0 || M <= 0 || N <= 0) return;
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(ssd_tiles(M)),
                  static_cast<unsigned>(ssd_tiles(N)));
  ssd_gemm_kernel<Prob><<<grid, kGemmThreads, 0, stream>>>(pr);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

// What every chunk problem shares: the sizes, the inputs, and the chunk of the block (setup).
struct ChunkProb {
  SsdDims d;
  const double* cum_all;
  const float* xbc;
  const float* dt;
  const float* dy = nullptr;  // (the backward problems)
  int K = 0, k_split = -1;
  // the block's chunk (bb: its batch)
  int64_t bb = 0, t0 = 0, zc = 0, zg = 0;
  int h = 0, g = 0, c = 0, L = 0;
  // the chunk's first rows (rows()): of xbc, of dt at head h, of dy at head h; the row strides
  // and the columns of x (head h), B and C (group g) in xbc
  const float* xr = nullptr;
  const float* dtr = nullptr;
  const float* dyr = nullptr;
  int cx = 0, hp = 0, xo = 0, bo = 0, co = 0;
  const double* cum = nullptr;  // the chunk's first step's log-sum
  // exp(cum_i) and exp(cum_{L-1} - cum_i) for i < L, in the block's shared memory (prepare)
  const float* e_in = nullptr;
  const float* e_out = nullptr;
  // z = (b*H + h)*nc + c (a head's chunk)
  __device__ void setup_head(int64_t z) {
    zc = z;
    c = static_cast<int>(z % d.nc);
    const int64_t bh = z / d.nc;
    bb = bh / d.H;
    h = static_cast<int>(bh % d.H);
    g = h / d.hpg;
    zg = (bb * d.G + g) * d.nc + c;
    t0 = static_cast<int64_t>(c) * d.Q;
    L = static_cast<int>(d.T - t0 < d.Q ? d.T - t0 : d.Q);
    cum = cum_all + bh * d.T + t0;
    rows();
  }
  __device__ void rows() {
    const int64_t r0 = bb * d.T + t0;
    xr = xbc + r0 * d.Cx;
    dtr = dt + r0 * d.H + h;
    if (dy) dyr = dy + r0 * d.HP + static_cast<int64_t>(h) * d.P;
    cx = static_cast<int>(d.Cx);
    hp = static_cast<int>(d.HP);
    xo = h * d.P;
    bo = static_cast<int>(d.HP) + g * d.N;
    co = static_cast<int>(d.HP) + (d.G + g) * d.N;
  }
  __device__ void prepare(float* ev, int tid) {
    if (!cum) return;
    for (int i = tid; i < L; i += kGemmThreads) {
      ev[i] = decay(cum[i]);
      ev[kSsdMaxChunk + i] = decay(cum[L - 1] - cum[i]);
    }
    e_in = ev;
    e_out = ev + kSsdMaxChunk;
  }
  __device__ bool a_m_major(int) const { return false; }
  __device__ bool b_k_major(int) const { return false; }
  __device__ float x(int i, int p) const { return xr[i * cx + xo + p]; }
  __device__ float Bv(int i, int n) const { return xr[i * cx + bo + n]; }
  __device__ float Cv(int i, int n) const { return xr[i * cx + co + n]; }
  __device__ float dtv(int i) const { return dtr[i * d.H]; }
  __device__ float dyv(int i, int p) const { return dyr[i * hp + p]; }
  __device__ int64_t bth(int i) const { return (bb * d.T + t0 + i) * d.H + h; }  // (row, head)
};

// cb (B,G,chunks,Q,Q) = C B^T of a group's chunk: cb[i][j] = C_i . B_j for the tiles holding some
// j <= i (the others are never read).
struct CbProb : ChunkProb {
  float* cb;
  __device__ void setup(int64_t z) {  // z = (b*G + g)*nc + c
    zg = z;
    c = static_cast<int>(z % d.nc);
    bb = z / d.nc / d.G;
    g = static_cast<int>(z / d.nc % d.G);
    t0 = static_cast<int64_t>(c) * d.Q;
    L = static_cast<int>(d.T - t0 < d.Q ? d.T - t0 : d.Q);
    rows();
  }
  __device__ bool tile_needed(int m0, int n0) const { return m0 < L && n0 < L && n0 < m0 + kBM; }
  __device__ bool k_needed(int, int, int) const { return true; }
  __device__ bool b_k_major(int) const { return true; }
  __device__ float a(int i, int n) const { return i < L && n < d.N ? Cv(i, n) : 0.0f; }
  __device__ float b(int n, int j) const { return j < L && n < d.N ? Bv(j, n) : 0.0f; }
  __device__ void finish(int m0, int n0, const float* c0, const float*, int tid) const {
    float* cbz = cb + zg * d.Q * d.Q;
    for (int e = tid; e < kBM * kBN; e += kGemmThreads) {
      const int i = m0 + e / kBN, j = n0 + e % kBN;
      if (i < L && j < L) cbz[i * d.Q + j] = c0[(e / kBN) * kLd + e % kBN];
    }
  }
};

// The chunk-local state into states (B,H,chunks,P,N): sum_j exp(cum_{L-1} - cum_j) dt_j x_j B_j^T.
struct SlocProb : ChunkProb {
  float* states;
  __device__ void setup(int64_t z) { setup_head(z); }
  __device__ bool tile_needed(int, int) const { return true; }
  __device__ bool k_needed(int k0, int, int) const { return k0 < L; }
  __device__ bool a_m_major(int) const { return true; }
  __device__ float a(int p, int j) const {
    return p < d.P && j < L ? e_out[j] * dtv(j) * x(j, p) : 0.0f;
  }
  __device__ float b(int j, int n) const { return j < L && n < d.N ? Bv(j, n) : 0.0f; }
  __device__ void finish(int m0, int n0, const float* c0, const float*, int tid) const {
    float* sz = states + zc * d.P * d.N;
    for (int e = tid; e < kBM * kBN; e += kGemmThreads) {
      const int p = m0 + e / kBN, n = n0 + e % kBN;
      if (p < d.P && n < d.N) sz[p * d.N + n] = c0[(e / kBN) * kLd + e % kBN];
    }
  }
};

// states[c] = exp(cum_{L-1}) states[c-1] + states[c] in increasing c: a thread an element of a
// (b, h)'s P x N state.
__global__ void ssd_pass_forward_kernel(float* states, const double* cum, SsdDims d) {
  const int64_t bh = blockIdx.x, PN = d.P * d.N;
  const int64_t e = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (e >= PN) return;
  float S = 0.0f;
  for (int64_t c = 0; c < d.nc; ++c) {
    const int64_t t_last = (c + 1) * d.Q < d.T ? (c + 1) * d.Q - 1 : d.T - 1;
    float* st = states + (bh * d.nc + c) * PN + e;
    S = decay(cum[bh * d.T + t_last]) * S + *st;
    *st = S;
  }
}

// y = the intra-chunk form over K = [j < Q] and the state term over K = [n < N], + D x.
struct YProb : ChunkProb {
  const float* cb;
  const float* states;
  const float* D;
  float* y;
  bool round_bf16;
  const float* cbz = nullptr;    // the group's chunk of cb
  const float* sprev = nullptr;  // the state entering the chunk (c > 0)
  __device__ void setup(int64_t z) {
    setup_head(z);
    cbz = cb + zg * d.Q * d.Q;
    sprev = states + (zc - 1) * d.P * d.N;
  }
  __device__ bool tile_needed(int m0, int) const { return m0 < L; }
  __device__ bool k_needed(int k0, int m0, int) const {
    return k0 < d.Qp ? k0 < L && k0 < m0 + kBM : c > 0;
  }
  __device__ bool b_k_major(int k0) const { return k0 >= d.Qp; }
  __device__ float a(int i, int k) const {
    if (k < d.Qp) {
      const int j = k;
      return i < L && j <= i ? cbz[i * d.Q + j] * decay(cum[i] - cum[j]) * dtv(j) : 0.0f;
    }
    const int n = k - d.Qp;
    return i < L && n < d.N ? e_in[i] * Cv(i, n) : 0.0f;
  }
  __device__ float b(int k, int p) const {
    if (k < d.Qp) return k < L && p < d.P ? x(k, p) : 0.0f;
    const int n = k - d.Qp;
    return p < d.P && n < d.N ? sprev[p * d.N + n] : 0.0f;
  }
  __device__ void finish(int m0, int n0, const float* c0, const float*, int tid) const {
    const float Dh = D[h];
    float* yr = y + (bb * d.T + t0) * d.HP + xo;
    for (int e = tid; e < kBM * kBN; e += kGemmThreads) {
      const int i = m0 + e / kBN, p = n0 + e % kBN;
      if (i < L && p < d.P)
        yr[i * hp + p] = stored(c0[(e / kBN) * kLd + e % kBN] + Dh * x(i, p), round_bf16);
    }
  }
};

// ---- backward ----------------------------------------------------------------------------------

// ds (B,H,chunks,P,N) = dS^loc_c = sum_i exp(cum_i) dy_i C_i^T
struct DsProb : ChunkProb {
  float* ds;
  __device__ void setup(int64_t z) { setup_head(z); }
  __device__ bool tile_needed(int, int) const { return true; }
  __device__ bool k_needed(int k0, int, int) const { return k0 < L; }
  __device__ bool a_m_major(int) const { return true; }
  __device__ float a(int p, int i) const { return p < d.P && i < L ? e_in[i] * dyv(i, p) : 0.0f; }
  __device__ float b(int i, int n) const { return i < L && n < d.N ? Cv(i, n) : 0.0f; }
  __device__ void finish(int m0, int n0, const float* c0, const float*, int tid) const {
    float* dz = ds + zc * d.P * d.N;
    for (int e = tid; e < kBM * kBN; e += kGemmThreads) {
      const int p = m0 + e / kBN, n = n0 + e % kBN;
      if (p < d.P && n < d.N) dz[p * d.N + n] = c0[(e / kBN) * kLd + e % kBN];
    }
  }
};

// The reverse passing, in place: ds[c] becomes Gout_c (the gradient reaching S_c from later
// chunks) in decreasing c, Gout_{c-1} = exp(cum_{L-1}) Gout_c + dS^loc_c; and gpart (B,H,chunks,
// blocks x warps) each warp's part of <Gout_c, S_{c-1}> (a fixed shuffle tree over its 32
// elements; 0 for c = 0).
__global__ void ssd_pass_backward_kernel(float* __restrict__ ds, float* __restrict__ gpart,
                                         const float* __restrict__ states,
                                         const double* __restrict__ cum, SsdDims d) {
  const int64_t bh = blockIdx.x, PN = d.P * d.N;
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t e = static_cast<int64_t>(blockIdx.y) * kPassThreads + tid;
  const bool valid = e < PN;
  const int64_t parts = static_cast<int64_t>(gridDim.y) * kPassWarps;  // a chunk's partial sums
  float* dse = ds + bh * d.nc * PN + e;
  const float* ste = states + bh * d.nc * PN + e;
  // the next chunk's loads are issued a step ahead of the chain through G
  float loc_next = valid ? dse[(d.nc - 1) * PN] : 0.0f;
  float st_next = valid && d.nc > 1 ? ste[(d.nc - 2) * PN] : 0.0f;
  float G = 0.0f;
  for (int c = d.nc - 1; c >= 0; --c) {
    const float loc = loc_next, st = st_next;
    if (c > 0 && valid) {
      loc_next = dse[(c - 1) * PN];
      st_next = c > 1 ? ste[(c - 2) * PN] : 0.0f;
    }
    const int64_t t_last = (c + 1) * d.Q < d.T ? (c + 1) * static_cast<int64_t>(d.Q) - 1 : d.T - 1;
    const float dec = decay(cum[bh * d.T + t_last]);
    if (valid) dse[c * PN] = G;
    float v = valid && c > 0 ? G * st : 0.0f;
    for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
    if (tid % 32 == 0) gpart[(bh * d.nc + c) * parts + blockIdx.y * kPassWarps + tid / 32] = v;
    G = dec * G + loc;
  }
}

// m (B,H,chunks,Q,Q) = M[i,j] = exp(cum_i - cum_j) (dy_i . dt_j x_j) for j <= i, 0 above
struct MProb : ChunkProb {
  float* m;
  __device__ void setup(int64_t z) { setup_head(z); }
  __device__ bool tile_needed(int m0, int n0) const { return m0 < L && n0 < L && n0 < m0 + kBM; }
  __device__ bool k_needed(int, int, int) const { return true; }
  __device__ bool b_k_major(int) const { return true; }
  __device__ float a(int i, int p) const { return i < L && p < d.P ? dyv(i, p) : 0.0f; }
  __device__ float b(int p, int j) const { return j < L && p < d.P ? dtv(j) * x(j, p) : 0.0f; }
  __device__ void finish(int m0, int n0, const float* c0, const float*, int tid) const {
    float* mz = m + zc * d.Q * d.Q;
    for (int e = tid; e < kBM * kBN; e += kGemmThreads) {
      const int i = m0 + e / kBN, j = n0 + e % kBN;
      if (i < L && j < L)
        mz[i * d.Q + j] = j <= i ? decay(cum[i] - cum[j]) * c0[(e / kBN) * kLd + e % kBN] : 0.0f;
    }
  }
};

// The partial row sums a GEMM's finish writes, (B*T*H, tiles) each.
struct RowPartials {
  float* xdu;  // sum_p x_j[p] du_j[p]
  float* dyx;  // sum_p dy_j[p] x_j[p]
  float* w;    // dt_j sum_p x_j[p] (the Gout term of du_j)[p]
  float* a;    // sum_n C_i[n] (the S_{c-1} term of dC_i)[n]
  int ptiles, ntiles;
};

// du over K = [n < N: exp(cum_{L-1} - cum_j) B_j . Gout] then [i < Q: (C_i . B_j) exp(cum_i -
// cum_j) dy_i, i >= j]; dx = dt du + D dy into dxbc's x columns; the row partials xdu, dyx, w.
struct DuProb : ChunkProb {
  const float* cb;
  const float* gout;
  const float* D;
  float* dxbc;
  RowPartials rp;
  bool round_bf16;
  const float* cbz = nullptr;  // the group's chunk of cb
  const float* gz = nullptr;   // the gradient reaching the chunk's state
  __device__ void setup(int64_t z) {
    setup_head(z);
    cbz = cb + zg * d.Q * d.Q;
    gz = gout + zc * d.P * d.N;
  }
  __device__ bool tile_needed(int m0, int) const { return m0 < L; }
  __device__ bool k_needed(int k0, int m0, int) const {
    return k0 < d.Np ? c < d.nc - 1 : k0 - d.Np < L && k0 - d.Np + kBK > m0;
  }
  __device__ bool a_m_major(int k0) const { return k0 >= d.Np; }
  __device__ bool b_k_major(int k0) const { return k0 < d.Np; }
  __device__ float a(int j, int k) const {
    if (k < d.Np) return j < L && k < d.N ? e_out[j] * Bv(j, k) : 0.0f;
    const int i = k - d.Np;
    return i < L && j <= i ? cbz[i * d.Q + j] * decay(cum[i] - cum[j]) : 0.0f;
  }
  __device__ float b(int k, int p) const {
    if (k < d.Np) return p < d.P && k < d.N ? gz[p * d.N + k] : 0.0f;
    const int i = k - d.Np;
    return i < L && p < d.P ? dyv(i, p) : 0.0f;
  }
  __device__ void finish(int m0, int n0, const float* c0, const float* c1, int tid) const {
    const float Dh = D[h];
    float* dxr = dxbc + (bb * d.T + t0) * d.Cx + xo;
    for (int e = tid; e < kBM * kBN; e += kGemmThreads) {
      const int j = m0 + e / kBN, p = n0 + e % kBN;
      if (j < L && p < d.P)
        dxr[j * cx + p] =
            stored(dtv(j) * c0[(e / kBN) * kLd + e % kBN] + Dh * dyv(j, p), round_bf16);
    }
    if (tid < kBM && m0 + tid < L) {
      const int j = m0 + tid;
      float xdu = 0.0f, dyx = 0.0f, w = 0.0f;
      for (int n = 0; n < kBN && n0 + n < d.P; ++n) {
        const float xv = x(j, n0 + n);
        xdu += xv * c0[tid * kLd + n];
        dyx += dyv(j, n0 + n) * xv;
        w += xv * c1[tid * kLd + n];
      }
      const int64_t o = bth(j) * rp.ptiles + n0 / kBN;
      rp.xdu[o] = xdu;
      rp.dyx[o] = dyx;
      rp.w[o] = dtv(j) * w;
    }
  }
};

// A head's dC over K = [p < P: exp(cum_i) dy_i[p] S_{c-1}[p]] then [j < Q: M[i,j] B_j, j <= i],
// into contrib (B*T, H, 2N)'s second half; the row partial a.
struct DcProb : ChunkProb {
  const float* m;
  const float* states;
  float* contrib;
  RowPartials rp;
  const float* mz = nullptr;     // the head's chunk of m
  const float* sprev = nullptr;  // the state entering the chunk (c > 0)
  __device__ void setup(int64_t z) {
    setup_head(z);
    mz = m + zc * d.Q * d.Q;
    sprev = states + (zc - 1) * d.P * d.N;
  }
  __device__ bool tile_needed(int m0, int) const { return m0 < L; }
  __device__ bool k_needed(int k0, int m0, int) const {
    return k0 < d.Pp ? c > 0 : k0 - d.Pp < L && k0 - d.Pp < m0 + kBM;
  }
  __device__ float a(int i, int k) const {
    if (k < d.Pp) return i < L && k < d.P ? e_in[i] * dyv(i, k) : 0.0f;
    const int j = k - d.Pp;
    return i < L && j <= i ? mz[i * d.Q + j] : 0.0f;
  }
  __device__ float b(int k, int n) const {
    if (k < d.Pp) return k < d.P && n < d.N ? sprev[k * d.N + n] : 0.0f;
    const int j = k - d.Pp;
    return j < L && n < d.N ? Bv(j, n) : 0.0f;
  }
  __device__ void finish(int m0, int n0, const float* c0, const float* c1, int tid) const {
    float* cr = contrib + bth(0) * 2 * d.N + d.N;  // (row i: + i * H * 2N)
    for (int e = tid; e < kBM * kBN; e += kGemmThreads) {
      const int i = m0 + e / kBN, n = n0 + e % kBN;
      if (i < L && n < d.N) cr[i * d.H * 2 * d.N + n] = c0[(e / kBN) * kLd + e % kBN];
    }
    if (tid < kBM && m0 + tid < L) {
      const int i = m0 + tid;
      float a = 0.0f;
      for (int n = 0; n < kBN && n0 + n < d.N; ++n) a += Cv(i, n0 + n) * c1[tid * kLd + n];
      rp.a[bth(i) * rp.ntiles + n0 / kBN] = a;
    }
  }
};

// A head's dB over K = [p < P: exp(cum_{L-1} - cum_j) dt_j x_j[p] Gout[p]] then [i < Q: M[i,j]
// C_i, i >= j], into contrib's first half.
struct DbProb : ChunkProb {
  const float* m;
  const float* gout;
  float* contrib;
  const float* mz = nullptr;  // the head's chunk of m
  const float* gz = nullptr;  // the gradient reaching the chunk's state
  __device__ void setup(int64_t z) {
    setup_head(z);
    mz = m + zc * d.Q * d.Q;
    gz = gout + zc * d.P * d.N;
  }
  __device__ bool tile_needed(int m0, int) const { return m0 < L; }
  __device__ bool k_needed(int k0, int m0, int) const {
    return k0 < d.Pp ? c < d.nc - 1 : k0 - d.Pp < L && k0 - d.Pp + kBK > m0;
  }
  __device__ bool a_m_major(int k0) const { return k0 >= d.Pp; }
  __device__ float a(int j, int k) const {
    if (k < d.Pp) return j < L && k < d.P ? e_out[j] * dtv(j) * x(j, k) : 0.0f;
    const int i = k - d.Pp;
    return i < L && j <= i ? mz[i * d.Q + j] : 0.0f;
  }
  __device__ float b(int k, int n) const {
    if (k < d.Pp) return k < d.P && n < d.N ? gz[k * d.N + n] : 0.0f;
    const int i = k - d.Pp;
    return i < L && n < d.N ? Cv(i, n) : 0.0f;
  }
  __device__ void finish(int m0, int n0, const float* c0, const float*, int tid) const {
    float* cr = contrib + bth(0) * 2 * d.N;  // (row j: + j * H * 2N)
    for (int e = tid; e < kBM * kBN; e += kGemmThreads) {
      const int j = m0 + e / kBN, n = n0 + e % kBN;
      if (j < L && n < d.N) cr[j * d.H * 2 * d.N + n] = c0[(e / kBN) * kLd + e % kBN];
    }
  }
};

// dB and dC of group g: the heads' terms summed in increasing h; a thread an element (bt, g, n).
__global__ void ssd_group_sums_kernel(float* dxbc, const float* contrib, SsdDims d, int64_t items,
                                      bool round_bf16) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < items;
       i += stride) {
    const int64_t n = i % d.N, g = (i / d.N) % d.G, bt = i / (d.N * d.G);
    float dB = 0.0f, dC = 0.0f;
    for (int64_t h = g * d.hpg; h < (g + 1) * d.hpg; ++h) {
      const float* cb = contrib + (bt * d.H + h) * 2 * d.N;
      dB += cb[n];
      dC += cb[d.N + n];
    }
    float* r = dxbc + bt * d.Cx + d.HP;
    r[g * d.N + n] = stored(dB, round_bf16);
    r[d.G * d.N + g * d.N + n] = stored(dC, round_bf16);
  }
}

// Per chunk z = (b*H + h)*nc + c (a block): r_i, the row partials summed over their tiles, then
// (one thread, in order) dg's sums in FP64, ddt = x . du + A dg, and the chunk's parts of dA and
// dD. Shared: a_i + r_i and w_i (FP64), x . du and dy . x, for the chunk's steps.
__global__ void ssd_dg_kernel(float* ddt, float* dA_part, float* dD_part, const float* cb,
                              const float* m, RowPartials rp, const float* gpart, int pass_parts,
                              const double* cum_all, const float* dt, const float* A, SsdDims d) {
  __shared__ double sar[kSsdMaxChunk], sw[kSsdMaxChunk];
  __shared__ float sxdu[kSsdMaxChunk], sdyx[kSsdMaxChunk];
  const int64_t z = blockIdx.x, c = z % d.nc, bh = z / d.nc, b = bh / d.H, h = bh % d.H;
  const int64_t zg = (b * d.G + h / d.hpg) * d.nc + c, t0 = c * d.Q;
  const int L = static_cast<int>(d.T - t0 < d.Q ? d.T - t0 : d.Q);
  const double* cum = cum_all + bh * d.T + t0;
  const float* cbz = cb + zg * d.Q * d.Q;
  const float* mz = m + z * d.Q * d.Q;
  for (int i = static_cast<int>(threadIdx.x); i < L; i += blockDim.x) {
    double r = 0.0;
    for (int j = 0; j < i; ++j)
      r += static_cast<double>(cbz[i * d.Q + j]) * static_cast<double>(mz[i * d.Q + j]);
    for (int l = i + 1; l < L; ++l)
      r -= static_cast<double>(cbz[l * d.Q + i]) * static_cast<double>(mz[l * d.Q + i]);
    const int64_t row = (b * d.T + t0 + i) * d.H + h;
    float a = 0.0f, w = 0.0f, xdu = 0.0f, dyx = 0.0f;
    for (int t = 0; t < rp.ntiles; ++t) a += rp.a[row * rp.ntiles + t];
    for (int t = 0; t < rp.ptiles; ++t) {
      w += rp.w[row * rp.ptiles + t];
      xdu += rp.xdu[row * rp.ptiles + t];
      dyx += rp.dyx[row * rp.ptiles + t];
    }
    sar[i] = r + static_cast<double>(a);
    sw[i] = w;
    sxdu[i] = xdu;
    sdyx[i] = dyx;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double gin = 0.0;
    if (c > 0) {
      float gsum = 0.0f;
      for (int q = 0; q < pass_parts; ++q) gsum += gpart[z * pass_parts + q];
      gin = static_cast<double>(decay(cum[L - 1])) * static_cast<double>(gsum);
    }
    double pre = 0.0;
    for (int k = 0; k < L; ++k) {  // sw[k] = sum_{j<k} w_j
      const double wk = sw[k];
      sw[k] = pre;
      pre += wk;
    }
    double suf = 0.0, dA_sum = 0.0;
    float dD_sum = 0.0f;
    for (int k = L - 1; k >= 0; --k) {
      suf += sar[k];
      const double dg = gin + suf + sw[k];
      sar[k] = dg;
      dA_sum += dg * static_cast<double>(dt[(b * d.T + t0 + k) * d.H + h]);
      dD_sum += sdyx[k];
    }
    dA_part[z] = static_cast<float>(dA_sum);
    dD_part[z] = dD_sum;
  }
  __syncthreads();
  const float Ah = A[h];
  for (int i = static_cast<int>(threadIdx.x); i < L; i += blockDim.x)
    ddt[(b * d.T + t0 + i) * d.H + h] = sxdu[i] + static_cast<float>(sar[i]) * Ah;
}

// dA[h] = the sum over b, then c (increasing) of dA_part (in FP64); dD[h] += that of dD_part.
__global__ void ssd_head_sums_kernel(float* dA, float* dD, const float* dA_part,
                                     const float* dD_part, SsdDims d) {
  const int64_t h = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (h >= d.H) return;
  double sa = 0.0;
  float sdd = 0.0f;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t c = 0; c < d.nc; ++c) {
      sa += static_cast<double>(dA_part[(b * d.H + h) * d.nc + c]);
      sdd += dD_part[(b * d.H + h) * d.nc + c];
    }
  dA[h] = static_cast<float>(sa);
  dD[h] += sdd;
}

void launch_cum(double* cum, const float* dt, const float* A, const SsdDims& d,
                cudaStream_t stream) {
  const int64_t n = d.B * d.nc * d.H * 32;  // (a warp each)
  ssd_cum_kernel<<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      cum, dt, A, d);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

template <class Prob>
Prob chunk_prob(const SsdDims& d, const double* cum, const float* xbc, const float* dt, int K,
                int k_split = -1) {
  Prob p{};
  p.d = d;
  p.cum_all = cum;
  p.xbc = xbc;
  p.dt = dt;
  p.K = K;
  p.k_split = k_split;
  return p;
}

void require_chunk(const char* op, const SsmShape& s) {
  if (s.chunk > kSsdMaxChunk)
    throw std::invalid_argument(std::string(op) + ": chunk Q = " + std::to_string(s.chunk) +
                                "; the cuda backend's chunked scan takes up to " +
                                std::to_string(kSsdMaxChunk) +
                                " (CudaOptions::ssm_sequential takes any)");
  // the kernels' 32-bit offsets within a chunk: Q rows of xbc, of dB/dC's terms, a Q x Q product
  const int64_t widest = std::max({s.xbc_cols(), 2 * s.H * s.N, s.chunk, s.P * s.N});
  if (s.chunk * widest > INT32_MAX)
    throw std::invalid_argument(std::string(op) + ": chunk Q = " + std::to_string(s.chunk) +
                                " times a row of " + std::to_string(widest) +
                                " floats exceeds the chunked scan's 32-bit offsets; use a smaller "
                                "model.mamba_chunk or CudaOptions::ssm_sequential");
}

}  // namespace

void ssd_chunked_forward(float* y, float* states, const float* xbc, const float* dt, const float* A,
                         const float* D, const SsmShape& s, bool round_bf16, const SsdScratch& ws,
                         cudaStream_t stream) {
  require_chunk("ssm_scan_forward", s);
  const SsdDims d = ssd_dims(s);
  if (d.B * d.T == 0) return;
  double* cum = static_cast<double*>(ws.states);
  float* cb = reinterpret_cast<float*>(cum + d.B * d.H * d.T);
  float* st = states ? states : cb + d.B * d.G * d.nc * d.Q * d.Q;
  const int64_t BHC = d.B * d.H * d.nc;
  launch_cum(cum, dt, A, d, stream);

  CbProb cbp = chunk_prob<CbProb>(d, cum, xbc, dt, d.Np);
  cbp.cb = cb;
  launch_gemm(cbp, d.B * d.G * d.nc, d.Q, d.Q, stream);

  SlocProb sl = chunk_prob<SlocProb>(d, cum, xbc, dt, d.Qp);
  sl.states = st;
  launch_gemm(sl, BHC, d.P, d.N, stream);

  const dim3 pass_grid(static_cast<unsigned>(d.B * d.H),
                       static_cast<unsigned>((d.P * d.N + kPassThreads - 1) / kPassThreads));
  ssd_pass_forward_kernel<<<pass_grid, kPassThreads, 0, stream>>>(st, cum, d);
  FP4SIM_CUDA_CHECK_LAUNCH();

  YProb yp = chunk_prob<YProb>(d, cum, xbc, dt, d.Qp + d.Np);
  yp.cb = cb;
  yp.states = st;
  yp.D = D;
  yp.y = y;
  yp.round_bf16 = round_bf16;
  launch_gemm(yp, BHC, d.Q, d.P, stream);
}

void ssd_chunked_backward(float* dxbc, float* ddt, float* dA, float* dD, const float* dy,
                          const float* xbc, const float* dt, const float* A, const float* D,
                          const float* states, const SsmShape& s, bool round_bf16,
                          const SsdScratch& ws, cudaStream_t stream) {
  require_chunk("ssm_scan_backward", s);
  const SsdDims d = ssd_dims(s);
  if (d.B * d.T == 0) {
    FP4SIM_CUDA_CHECK(cudaMemsetAsync(dA, 0, static_cast<size_t>(d.H) * sizeof(float), stream));
    return;
  }
  const int64_t BHC = d.B * d.H * d.nc, BTH = d.B * d.T * d.H;
  double* cum = static_cast<double*>(ws.states);
  float* cb = reinterpret_cast<float*>(cum + d.B * d.H * d.T);
  float* ds = cb + d.B * d.G * d.nc * d.Q * d.Q;
  float* m = ds + BHC * d.P * d.N;
  RowPartials rp;
  rp.ptiles = static_cast<int>(ssd_tiles(d.P));
  rp.ntiles = static_cast<int>(ssd_tiles(d.N));
  rp.xdu = ws.small;
  rp.dyx = rp.xdu + BTH * rp.ptiles;
  rp.w = rp.dyx + BTH * rp.ptiles;
  rp.a = rp.w + BTH * rp.ptiles;
  const int pass_blocks = static_cast<int>((d.P * d.N + kPassThreads - 1) / kPassThreads);
  const int pass_parts = pass_blocks * kPassWarps;
  float* gpart = rp.a + BTH * rp.ntiles;
  float* dA_part = gpart + BHC * pass_parts;
  float* dD_part = dA_part + BHC;

  launch_cum(cum, dt, A, d, stream);
  CbProb cbp = chunk_prob<CbProb>(d, cum, xbc, dt, d.Np);
  cbp.cb = cb;
  launch_gemm(cbp, d.B * d.G * d.nc, d.Q, d.Q, stream);

  DsProb dsp = chunk_prob<DsProb>(d, cum, xbc, dt, d.Qp);
  dsp.dy = dy;
  dsp.ds = ds;
  launch_gemm(dsp, BHC, d.P, d.N, stream);

  const dim3 pass_grid(static_cast<unsigned>(d.B * d.H), static_cast<unsigned>(pass_blocks));
  ssd_pass_backward_kernel<<<pass_grid, kPassThreads, 0, stream>>>(ds, gpart, states, cum, d);
  FP4SIM_CUDA_CHECK_LAUNCH();

  MProb mp = chunk_prob<MProb>(d, cum, xbc, dt, d.Pp);
  mp.dy = dy;
  mp.m = m;
  launch_gemm(mp, BHC, d.Q, d.Q, stream);

  DuProb du = chunk_prob<DuProb>(d, cum, xbc, dt, d.Np + d.Qp, d.Np);
  du.cb = cb;
  du.gout = ds;
  du.dy = dy;
  du.D = D;
  du.dxbc = dxbc;
  du.rp = rp;
  du.round_bf16 = round_bf16;
  launch_gemm(du, BHC, d.Q, d.P, stream);

  DcProb dc = chunk_prob<DcProb>(d, cum, xbc, dt, d.Pp + d.Qp, d.Pp);
  dc.m = m;
  dc.states = states;
  dc.dy = dy;
  dc.contrib = ws.contrib;
  dc.rp = rp;
  launch_gemm(dc, BHC, d.Q, d.N, stream);

  DbProb db = chunk_prob<DbProb>(d, cum, xbc, dt, d.Pp + d.Qp);
  db.m = m;
  db.gout = ds;
  db.contrib = ws.contrib;
  launch_gemm(db, BHC, d.Q, d.N, stream);

  const int64_t items = d.B * d.T * d.G * d.N;
  ssd_group_sums_kernel<<<elementwise_grid(items), kThreads, 0, stream>>>(dxbc, ws.contrib, d,
                                                                          items, round_bf16);
  FP4SIM_CUDA_CHECK_LAUNCH();

  ssd_dg_kernel<<<static_cast<unsigned>(BHC), kDgThreads, 0, stream>>>(
      ddt, dA_part, dD_part, cb, m, rp, gpart, pass_parts, cum, dt, A, d);
  FP4SIM_CUDA_CHECK_LAUNCH();
  ssd_head_sums_kernel<<<static_cast<unsigned>((d.H + kThreads - 1) / kThreads), kThreads, 0,
                         stream>>>(dA, dD, dA_part, dD_part, d);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

}  // namespace fp4sim::gpu
