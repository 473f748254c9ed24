// The Mamba-2 mixer's high-precision core on the GPU: the CUDA twins of emu/ssm.hpp (the same
// names, argument orders and shapes, on device pointers and the backend's stream, with the BF16
// rounding of a marked output applied where it is written) and CudaBackend's ssm_conv_*,
// ssm_scan_* and gated_norm_* methods.
//
// Numerics: bitwise the emulator's. Every kernel performs emu/ssm.cpp's FP32 operations in its
// order, each rounded (emu/hd.hpp's _rn operations; the library is built with -fmad=false), the
// elementwise expressions and exp / log1p being the very functions of emu/ssm_math.hpp; every sum
// runs sequentially from +0 in the emulator's order, so each is carried by one thread:
// - conv1d + SiLU: a thread an output element (the window's terms in increasing k); backward: du
//   an element, dinp an element, dweight and dbias in the emulator's two levels (emu/ssm.hpp,
//   kSsmSumRows): a thread block per row block, a thread a channel's partial sums over the block's
//   rows in order, then a thread a channel over the partials in order.
// - dt: a thread an element; ddt_bias the same two levels, a thread a head.
// - the scan: a thread block per (batch, head) carrying the P x N state in shared memory, a thread
//   a state row p (the sum over n of y_t[p]). Backward: a block per (batch, head) too, the chunk's
//   states recomputed into global scratch from the saved state before it (the forward's own
//   update, a thread an element), then per step a thread a row p (the sums over n) and a thread a
//   column n (the sums over p), and one thread the per-step scalars (q, ddt, dA, dD). A group's dB
//   and dC, which the emulator sums over the group's heads in increasing h, are each head's term
//   kept in scratch and summed afterwards in that order, one thread an element.
// - gated RMSNorm: a thread block a tile of (row, group) items, the elementwise terms in parallel
//   into shared memory, then a thread an item's sum in order (a thread an item where one item's
//   group does not fit the tile); dweight the same two levels as the conv's, a thread a channel.
// This is the straightforward parallelisation, kept as the bitwise twin (CudaOptions::
// ssm_sequential); the backend's default scan is the chunked SSD of gpu/ssm_chunked.cu.
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "emu/op_checks.hpp"
#include "emu/ssm_math.hpp"
#include "gpu/capabilities.hpp"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/layers_state.hpp"
#include "gpu/ssm_chunked.hpp"
#include "gpu/training_ops.cuh"

namespace fp4sim::gpu {

namespace {

// The emulator's eps of the gated norm (emu/ssm.hpp's default): the Backend interface does not
// pass it.
constexpr float kGatedNormEps = 1e-5f;
// (gpu/capabilities.hpp: the conv widths the conv kernels take, their taps unrolled and a register
// array a thread in the parameter gradients; the scan's thread blocks have at most kSsmMaxScanSize
// threads)
constexpr int64_t kMaxConvWidth = kSsmMaxConvWidth;
constexpr int64_t kMaxScanThreads = kSsmMaxScanSize;

// q = i / d and r = i % d (i >= 0, d > 0), in 32-bit arithmetic where both fit (64-bit division
// is a long instruction sequence on the GPU, and these kernels divide for every element).
__device__ __forceinline__ void divmod(int64_t i, int64_t d, int64_t& q, int64_t& r) {
  if (i <= 0xFFFFFFFFll && d <= 0xFFFFFFFFll) {
    const uint32_t qq = static_cast<uint32_t>(i) / static_cast<uint32_t>(d);
    q = qq;
    r = i - static_cast<int64_t>(qq) * d;
  } else {
    q = i / d;
    r = i % d;
  }
}

// ---- causal depthwise conv1d + SiLU ------------------------------------------------------------

// The conv's elementwise kernels slide along time: a thread takes one channel c of one batch
// row's run of kConvRun steps (the threads of a warp: consecutive channels, so every load is
// coalesced), its window of inputs in registers: each input loaded once. The sums are the
// emulator's (emu/ssm.cpp's conv_row): u = bias[c] + sum_k weight[c,k] * inp[t - W + 1 + k, c] from
// left to right, the terms before the window start (t - W + 1 + k < 0) skipped, not added as zeros.
constexpr int kConvRun = 16;
dim3 conv_grid(int64_t B, int64_t T, int64_t C) {
  return dim3(static_cast<unsigned>(B * ((T + kConvRun - 1) / kConvRun)),
              static_cast<unsigned>((C + kThreads - 1) / kThreads));
}

// Calls f(t, u) for t = t0 .. t1-1 of channel c: ip points at (b, t = 0, c) of inp (row stride
// ld), wv the channel's W taps.
template <int W, class F>
__device__ __forceinline__ void conv_steps(const float* ip, int64_t ld, const float (&wv)[W],
                                           float bc, int t0, int t1, F f) {
  float win[W];  // win[k] = inp[t - W + 1 + k] for the step t in hand
#pragma unroll
  for (int k = 0; k < W - 1; ++k) {
    const int s = t0 - W + 1 + k;
    win[k] = s >= 0 ? ip[s * ld] : 0.0f;
  }
  const float* pt = ip + t0 * ld;
  for (int t = t0; t < t1; ++t, pt += ld) {
    win[W - 1] = *pt;
    float u = bc;
#pragma unroll
    for (int k = 0; k < W; ++k)
      if (t - W + 1 + k >= 0) u = fadd_rn(u, fmul_rn(wv[k], win[k]));
    f(t, u);
#pragma unroll
    for (int k = 0; k < W - 1; ++k) win[k] = win[k + 1];
  }
}

// The thread's channel, batch row and run of steps; false when it has none.
struct ConvThread {
  int64_t c, b;
  int t0, t1;
};
__device__ __forceinline__ bool conv_thread(int64_t T, int64_t C, ConvThread& th) {
  th.c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const int64_t runs = (T + kConvRun - 1) / kConvRun;
  th.b = blockIdx.x / runs;
  th.t0 = static_cast<int>(blockIdx.x % runs) * kConvRun;
  th.t1 = th.t0 + kConvRun < T ? th.t0 + kConvRun : static_cast<int>(T);
  return th.c < C;
}

template <int W>
__global__ void conv1d_silu_forward_kernel(float* out, const float* inp, int64_t ld_inp,
                                           const float* weight, const float* bias, int64_t T,
                                           int64_t C, bool round_bf16) {
  ConvThread th;
  if (!conv_thread(T, C, th)) return;
  float wv[W];
#pragma unroll
  for (int k = 0; k < W; ++k) wv[k] = weight[th.c * W + k];
  float* o = out + th.b * T * C + th.c;
  conv_steps<W>(inp + th.b * T * ld_inp + th.c, ld_inp, wv, bias[th.c], th.t0, th.t1,
                [&](int t, float u) { o[t * C] = stored(ssm_silu(u), round_bf16); });
}

// du (B*T, C) = dout * silu'(u), u recomputed
template <int W>
__global__ void conv1d_silu_du_kernel(float* du, const float* dout, const float* inp,
                                      int64_t ld_inp, const float* weight, const float* bias,
                                      int64_t T, int64_t C) {
  ConvThread th;
  if (!conv_thread(T, C, th)) return;
  float wv[W];
#pragma unroll
  for (int k = 0; k < W; ++k) wv[k] = weight[th.c * W + k];
  const int64_t base = th.b * T * C + th.c;
  conv_steps<W>(
      inp + th.b * T * ld_inp + th.c, ld_inp, wv, bias[th.c], th.t0, th.t1,
      [&](int t, float u) { du[base + t * C] = fmul_rn(dout[base + t * C], ssm_silu_grad(u)); });
}

// dinp[(b, s), c] = sum_k weight[c,k] * du[(b, s+W-1-k), c] from +0 in increasing k, the terms
// past the end (s+W-1-k >= T) skipped; the window win[j] = du[s + j] slides forward
template <int W>
__global__ void conv1d_silu_dinp_kernel(float* dinp, int64_t ld_dinp, const float* du,
                                        const float* weight, int64_t T, int64_t C,
                                        bool round_bf16) {
  ConvThread th;
  if (!conv_thread(T, C, th)) return;
  float wv[W];
#pragma unroll
  for (int k = 0; k < W; ++k) wv[k] = weight[th.c * W + k];
  const float* dp = du + th.b * T * C + th.c;
  float* o = dinp + th.b * T * ld_dinp + th.c;
  float win[W];
#pragma unroll
  for (int j = 0; j < W - 1; ++j) win[j] = th.t0 + j < T ? dp[(th.t0 + j) * C] : 0.0f;
  for (int s = th.t0; s < th.t1; ++s) {
    win[W - 1] = s + W - 1 < T ? dp[(s + W - 1) * C] : 0.0f;
    float dx = 0.0f;
#pragma unroll
    for (int k = 0; k < W; ++k)
      if (s + W - 1 - k < T) dx = fadd_rn(dx, fmul_rn(wv[k], win[W - 1 - k]));
    o[s * ld_dinp] = stored(dx, round_bf16);
#pragma unroll
    for (int j = 0; j < W - 1; ++j) win[j] = win[j + 1];
  }
}

// f(std::integral_constant<int, W>) for the run time width W (1 .. kMaxConvWidth)
template <class F>
void with_conv_width(int64_t W, F f) {
  switch (W) {
    case 1:
      return f(std::integral_constant<int, 1>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    case 3:
      return f(std::integral_constant<int, 3>{});
    case 4:
      return f(std::integral_constant<int, 4>{});
    case 5:
      return f(std::integral_constant<int, 5>{});
    case 6:
      return f(std::integral_constant<int, 6>{});
    case 7:
      return f(std::integral_constant<int, 7>{});
    case 8:
      return f(std::integral_constant<int, 8>{});
    default:
      throw std::invalid_argument("conv1d_silu: conv width " + std::to_string(W) + " outside 1.." +
                                  std::to_string(kMaxConvWidth));
  }
}
static_assert(kMaxConvWidth == 8, "with_conv_width instantiates the widths up to 8");

// The row blocks of the parameter gradients' two-level sums (emu/ssm.hpp).
constexpr int64_t kSumRows = emu::kSsmSumRows;
int64_t row_blocks(int64_t rows) { return (rows + kSumRows - 1) / kSumRows; }

// Per channel c (x) and row block (y): the block's partial sums from +0 over its rows in order,
// partials[(k * blocks + block) * C + c] for dw[k] (k < W) and k = W for db:
// db = sum of du[r, c], dw[k] = sum of du[r, c] * inp[b, t-W+1+k, c] (terms before t = 0 skipped).
__global__ void conv1d_silu_dparams_partials_kernel(float* partials, const float* du,
                                                    const float* inp, int64_t ld_inp, int64_t rows,
                                                    int64_t T, int64_t C, int64_t W) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t blk = blockIdx.y, blocks = gridDim.y, r0 = blk * kSumRows;
  const int64_t r1 = r0 + kSumRows < rows ? r0 + kSumRows : rows;
  float dw[kMaxConvWidth];
  for (int64_t k = 0; k < kMaxConvWidth; ++k) dw[k] = 0.0f;
  float db = 0.0f;
  int64_t b0, t0;
  divmod(r0, T, b0, t0);
#pragma unroll 4
  for (int64_t r = r0, t = t0; r < r1; ++r, t = t + 1 == T ? 0 : t + 1) {
    const float d = du[r * C + c];
    db = fadd_rn(db, d);
#pragma unroll
    for (int64_t k = 0; k < kMaxConvWidth; ++k) {
      const int64_t s = t - W + 1 + k;
      if (k < W && s >= 0) dw[k] = fadd_rn(dw[k], fmul_rn(d, inp[(r - t + s) * ld_inp + c]));
    }
  }
#pragma unroll
  for (int64_t k = 0; k < kMaxConvWidth; ++k)
    if (k < W) partials[(k * blocks + blk) * C + c] = dw[k];
  partials[(W * blocks + blk) * C + c] = db;
}

// dst[j * ld + c * stride] += the sum from +0 of partials[(j * blocks + b) * C + c] over the
// blocks b in order, for each of `sets` sums j (the second level of emu/ssm.hpp's row sums).
__global__ void sum_partials_kernel(float* dst, int64_t ld, int64_t stride, const float* partials,
                                    int64_t blocks, int64_t C, int64_t sets) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= C * sets) return;
  const int64_t j = i / C, c = i % C;
  float sum = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) sum = fadd_rn(sum, partials[(j * blocks + b) * C + c]);
  float* d = dst + j * ld + c * stride;
  *d = fadd_rn(*d, sum);
}

// Per column c (x) and row block (y): partials[block * C + c] = the sum from +0 of
// terms[r * C + c] over the block's rows in order.
__global__ void column_partials_kernel(float* partials, const float* terms, int64_t rows,
                                       int64_t C) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kSumRows;
  const int64_t r1 = r0 + kSumRows < rows ? r0 + kSumRows : rows;
  float sum = 0.0f;
  for (int64_t r = r0; r < r1; ++r) sum = fadd_rn(sum, terms[r * C + c]);
  partials[static_cast<int64_t>(blockIdx.y) * C + c] = sum;
}

// dst[c] += the two-level row sum of terms (rows x C): partials of row_blocks(rows) * C floats.
void column_sums(float* dst, const float* terms, int64_t rows, int64_t C, float* partials,
                 cudaStream_t stream) {
  const int64_t blocks = row_blocks(rows);
  const dim3 grid(static_cast<unsigned>((C + kThreads - 1) / kThreads),
                  static_cast<unsigned>(blocks));
  column_partials_kernel<<<grid, kThreads, 0, stream>>>(partials, terms, rows, C);
  FP4SIM_CUDA_CHECK_LAUNCH();
  sum_partials_kernel<<<static_cast<unsigned>((C + kThreads - 1) / kThreads), kThreads, 0,
                        stream>>>(dst, 0, 1, partials, blocks, C, 1);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void conv1d_silu_forward(float* out, const float* inp, int64_t ld_inp, const float* weight,
                         const float* bias, int64_t B, int64_t T, int64_t C, int64_t W,
                         bool round_bf16, cudaStream_t stream) {
  if (B * T * C == 0) return;
  with_conv_width(W, [&](auto w) {
    conv1d_silu_forward_kernel<decltype(w)::value><<<conv_grid(B, T, C), kThreads, 0, stream>>>(
        out, inp, ld_inp, weight, bias, T, C, round_bf16);
  });
  FP4SIM_CUDA_CHECK_LAUNCH();
}

// du: scratch of B*T*C floats; partials: of ssm_partials_floats(B*T, C, W + 1)
void conv1d_silu_backward(float* dinp, int64_t ld_dinp, float* dweight, float* dbias,
                          const float* dout, const float* inp, int64_t ld_inp, const float* weight,
                          const float* bias, int64_t B, int64_t T, int64_t C, int64_t W,
                          bool round_bf16, float* du, float* partials, cudaStream_t stream) {
  with_conv_width(W, [&](auto w) {
    constexpr int kW = decltype(w)::value;
    if (B * T * C == 0) return;
    conv1d_silu_du_kernel<kW>
        <<<conv_grid(B, T, C), kThreads, 0, stream>>>(du, dout, inp, ld_inp, weight, bias, T, C);
    FP4SIM_CUDA_CHECK_LAUNCH();
    conv1d_silu_dinp_kernel<kW>
        <<<conv_grid(B, T, C), kThreads, 0, stream>>>(dinp, ld_dinp, du, weight, T, C, round_bf16);
  });
  FP4SIM_CUDA_CHECK_LAUNCH();
  const int64_t blocks = row_blocks(B * T);
  const unsigned ctiles = static_cast<unsigned>((C + kThreads - 1) / kThreads);
  conv1d_silu_dparams_partials_kernel<<<dim3(ctiles, static_cast<unsigned>(blocks)), kThreads, 0,
                                        stream>>>(partials, du, inp, ld_inp, B * T, T, C, W);
  FP4SIM_CUDA_CHECK_LAUNCH();
  // dweight[c * W + k] for the sums k < W, then dbias[c]
  sum_partials_kernel<<<static_cast<unsigned>((C * W + kThreads - 1) / kThreads), kThreads, 0,
                        stream>>>(dweight, 1, W, partials, blocks, C, W);
  FP4SIM_CUDA_CHECK_LAUNCH();
  sum_partials_kernel<<<ctiles, kThreads, 0, stream>>>(dbias, 0, 1, partials + W * blocks * C,
                                                       blocks, C, 1);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

// ---- dt and A ----------------------------------------------------------------------------------

__global__ void ssm_dt_forward_kernel(float* dt, float* A, const float* dt_raw, int64_t ld_dt_raw,
                                      const float* dt_bias, const float* A_log, int64_t H,
                                      int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = i0; i < n; i += stride) {
    const int64_t r = i / H, h = i % H;
    dt[i] = ssm_softplus(fadd_rn(dt_raw[r * ld_dt_raw + h], dt_bias[h]));
  }
  if (i0 < H) A[i0] = -exp_f32(A_log[i0]);
}

// du (B*T, H) = the softplus backward pass of ddt, kept unrounded for the dt_bias sums, and
// ddt_raw = du (rounded when round_bf16)
__global__ void ssm_dt_du_kernel(float* ddt_raw, int64_t ld_ddt_raw, float* du, const float* ddt,
                                 const float* dt_raw, int64_t ld_dt_raw, const float* dt_bias,
                                 int64_t H, int64_t n, bool round_bf16) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const int64_t r = i / H, h = i % H;
    const float d = ssm_softplus_backward(fadd_rn(dt_raw[r * ld_dt_raw + h], dt_bias[h]), ddt[i]);
    du[i] = d;
    ddt_raw[r * ld_ddt_raw + h] = stored(d, round_bf16);
  }
}

// Per head: dA_log += dA * -exp(A_log) (ddt_bias: column_sums of du).
__global__ void ssm_dA_log_kernel(float* dA_log, const float* dA, const float* A_log, int64_t H) {
  const int64_t h = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (h >= H) return;
  dA_log[h] = fadd_rn(dA_log[h], fmul_rn(dA[h], -exp_f32(A_log[h])));
}

void ssm_dt_forward(float* dt, float* A, const float* dt_raw, int64_t ld_dt_raw,
                    const float* dt_bias, const float* A_log, int64_t B, int64_t T, int64_t H,
                    cudaStream_t stream) {
  const int64_t n = B * T * H;
  ssm_dt_forward_kernel<<<elementwise_grid(n > H ? n : H), kThreads, 0, stream>>>(
      dt, A, dt_raw, ld_dt_raw, dt_bias, A_log, H, n);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

// du: scratch of B*T*H floats; partials: of ssm_partials_floats(B*T, H, 1)
void ssm_dt_backward(float* ddt_raw, int64_t ld_ddt_raw, float* ddt_bias, float* dA_log,
                     const float* ddt, const float* dA, const float* dt_raw, int64_t ld_dt_raw,
                     const float* dt_bias, const float* A_log, int64_t B, int64_t T, int64_t H,
                     bool round_bf16, float* du, float* partials, cudaStream_t stream) {
  const int64_t n = B * T * H;
  ssm_dt_du_kernel<<<elementwise_grid(n), kThreads, 0, stream>>>(
      ddt_raw, ld_ddt_raw, du, ddt, dt_raw, ld_dt_raw, dt_bias, H, n, round_bf16);
  FP4SIM_CUDA_CHECK_LAUNCH();
  column_sums(ddt_bias, du, B * T, H, partials, stream);
  ssm_dA_log_kernel<<<static_cast<unsigned>((H + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      dA_log, dA, A_log, H);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

// ---- the selective scan ------------------------------------------------------------------------

// The scan's sizes as the kernels take them.
struct ScanDims {
  int64_t B, T, H, P, G, N, Q, HP, Cx, nc, heads_per_group;
};
ScanDims scan_dims(const SsmShape& s) {
  return {s.B, s.T, s.H, s.P, s.G, s.N, s.chunk, s.d_inner(), s.xbc_cols(), s.chunks(), s.H / s.G};
}

// Block (b, h) = blockIdx.x / H, % H; thread p = threadIdx.x (blockDim.x == P). Shared: the state
// S [P][N + 1] (padded: a warp's rows in distinct banks), B_t and C_t [N] each.
__global__ void ssm_scan_forward_kernel(float* y, float* states, const float* xbc, const float* dt,
                                        const float* A, const float* D, ScanDims d,
                                        bool round_bf16) {
  extern __shared__ float sm[];
  const int64_t N1 = d.N + 1;
  float* S = sm;
  float* Bs = S + d.P * N1;
  float* Cs = Bs + d.N;
  const int64_t b = blockIdx.x / d.H, h = blockIdx.x % d.H, g = h / d.heads_per_group;
  const int64_t p = threadIdx.x;
  float* Sp = S + p * N1;
  for (int64_t n = 0; n < d.N; ++n) Sp[n] = 0.0f;
  const float Ah = A[h], Dh = D[h];
  for (int64_t t = 0; t < d.T; ++t) {
    const float* row = xbc + (b * d.T + t) * d.Cx;
    for (int64_t n = p; n < d.N; n += d.P) {
      Bs[n] = row[d.HP + g * d.N + n];
      Cs[n] = row[d.HP + d.G * d.N + g * d.N + n];
    }
    __syncthreads();
    const float dtv = dt[(b * d.T + t) * d.H + h];
    const float a = exp_f32(fmul_rn(dtv, Ah));
    const float xp = row[h * d.P + p];
    float acc = 0.0f;
    for (int64_t n = 0; n < d.N; ++n) {
      const float s = ssm_state_update(a, Sp[n], dtv, xp, Bs[n]);
      Sp[n] = s;
      acc = fadd_rn(acc, fmul_rn(s, Cs[n]));
    }
    y[(b * d.T + t) * d.HP + h * d.P + p] = stored(fadd_rn(acc, fmul_rn(Dh, xp)), round_bf16);
    if (states && (t % d.Q == d.Q - 1 || t == d.T - 1)) {
      float* st = states + ((b * d.H + h) * d.nc + t / d.Q) * d.P * d.N + p * d.N;
      for (int64_t n = 0; n < d.N; ++n) st[n] = Sp[n];
    }
    __syncthreads();  // (the next step overwrites Bs and Cs)
  }
}

// Work item w = (b, h) = w / H, % H, for w = blockIdx.x, + gridDim.x, ...; each block has its own
// chunk-state scratch buf [(Q + 1) P N] (buf[i] = S_{t0 - 1 + i}). Shared: the state gradient Gs
// [P][N + 1], dy_t, x_t, r [P], B_t, C_t, the inner sums of q [N], the chunk's decays [Q].
// Writes dx of the head (dxbc's x columns), its dB and dC terms contrib [B*T, H, 2N] (dt * dB_h,
// dC_h), ddt [B*T, H], and the (b, h) sums dA_bh, dD_bh.
__global__ void ssm_scan_backward_kernel(float* dxbc, float* contrib, float* ddt, float* dA_bh,
                                         float* dD_bh, const float* dy, const float* xbc,
                                         const float* dt, const float* A, const float* D,
                                         const float* states, float* bufs, ScanDims d,
                                         bool round_bf16) {
  extern __shared__ float sm[];
  const int64_t N1 = d.N + 1, PN = d.P * d.N;
  float* Gs = sm;
  float* dys = Gs + d.P * N1;
  float* xs = dys + d.P;
  float* rs = xs + d.P;
  float* Bs = rs + d.P;
  float* Cs = Bs + d.N;
  float* qs = Cs + d.N;
  float* as = qs + d.N;
  float* buf = bufs + static_cast<int64_t>(blockIdx.x) * (d.Q + 1) * PN;
  const int64_t tid = threadIdx.x, nt = blockDim.x;
  for (int64_t w = blockIdx.x; w < d.B * d.H; w += gridDim.x) {
    const int64_t b = w / d.H, h = w % d.H, g = h / d.heads_per_group;
    const float Ah = A[h], Dh = D[h];
    for (int64_t e = tid; e < d.P * N1; e += nt) Gs[e] = 0.0f;
    float dA_sum = 0.0f, dD_sum = 0.0f;  // (thread 0's)
    __syncthreads();
    for (int64_t c = d.nc - 1; c >= 0; --c) {
      const int64_t t0 = c * d.Q, L = (t0 + d.Q < d.T ? t0 + d.Q : d.T) - t0;
      for (int64_t i = tid; i < L; i += nt)
        as[i] = exp_f32(fmul_rn(dt[(b * d.T + t0 + i) * d.H + h], Ah));
      __syncthreads();
      // the chunk's states, recomputed by the forward's own update (a thread an element)
      for (int64_t e = tid; e < PN; e += nt) {
        const int64_t p = e / d.N, n = e % d.N;
        float v = c == 0 ? 0.0f : states[((b * d.H + h) * d.nc + c - 1) * PN + e];
        buf[e] = v;
        for (int64_t i = 0; i < L; ++i) {
          const int64_t bt = b * d.T + t0 + i;
          const float* row = xbc + bt * d.Cx;
          v = ssm_state_update(as[i], v, dt[bt * d.H + h], row[h * d.P + p],
                               row[d.HP + g * d.N + n]);
          buf[(i + 1) * PN + e] = v;
        }
      }
      __syncthreads();
      for (int64_t i = L - 1; i >= 0; --i) {
        const int64_t bt = b * d.T + t0 + i;
        const float* row = xbc + bt * d.Cx;
        const float dtv = dt[bt * d.H + h], at = as[i];
        for (int64_t j = tid; j < d.P; j += nt) {
          dys[j] = dy[bt * d.HP + h * d.P + j];
          xs[j] = row[h * d.P + j];
        }
        for (int64_t j = tid; j < d.N; j += nt) {
          Bs[j] = row[d.HP + g * d.N + j];
          Cs[j] = row[d.HP + d.G * d.N + g * d.N + j];
        }
        __syncthreads();
        // a thread a row p: Gs[p][n] += dy[p] C[n]; r = sum_n Gs[p][n] B[n]; dx
        if (tid < d.P) {
          const int64_t p = tid;
          const float dyp = dys[p];
          float* Gp = Gs + p * N1;
          float r = 0.0f;
          for (int64_t n = 0; n < d.N; ++n) {
            const float gv = fadd_rn(Gp[n], fmul_rn(dyp, Cs[n]));
            Gp[n] = gv;
            r = fadd_rn(r, fmul_rn(gv, Bs[n]));
          }
          rs[p] = r;
          dxbc[bt * d.Cx + h * d.P + p] =
              stored(fadd_rn(fmul_rn(Dh, dyp), fmul_rn(dtv, r)), round_bf16);
        }
        __syncthreads();
        // a thread a column n: dC, dB and q's inner sum over p
        if (tid < d.N) {
          const int64_t n = tid;
          const float* St = buf + (i + 1) * PN;
          const float* Sq = buf + i * PN;
          float dC = 0.0f, dB = 0.0f, q = 0.0f;
          for (int64_t p = 0; p < d.P; ++p) {
            const float gv = Gs[p * N1 + n];
            dC = fadd_rn(dC, fmul_rn(St[p * d.N + n], dys[p]));
            dB = fadd_rn(dB, fmul_rn(gv, xs[p]));
            q = fadd_rn(q, fmul_rn(gv, Sq[p * d.N + n]));
          }
          float* cb = contrib + (bt * d.H + h) * 2 * d.N;
          cb[n] = fmul_rn(dtv, dB);
          cb[d.N + n] = dC;
          qs[n] = q;
        }
        __syncthreads();
        if (tid == 0) {
          float q = 0.0f;
          for (int64_t n = 0; n < d.N; ++n) q = fadd_rn(q, qs[n]);
          const float ddtA = fmul_rn(q, at);
          float sum_xr = 0.0f, sum_dyx = 0.0f;
          for (int64_t p = 0; p < d.P; ++p) {
            sum_xr = fadd_rn(sum_xr, fmul_rn(xs[p], rs[p]));
            sum_dyx = fadd_rn(sum_dyx, fmul_rn(dys[p], xs[p]));
          }
          ddt[bt * d.H + h] = fadd_rn(sum_xr, fmul_rn(ddtA, Ah));
          dA_sum = fadd_rn(dA_sum, fmul_rn(ddtA, dtv));
          dD_sum = fadd_rn(dD_sum, sum_dyx);
        }
        // the gradient reaching S_{t-1}
        for (int64_t e = tid; e < PN; e += nt) {
          const int64_t p = e / d.N, n = e % d.N;
          Gs[p * N1 + n] = fmul_rn(at, Gs[p * N1 + n]);
        }
        __syncthreads();
      }
    }
    if (tid == 0) {
      dA_bh[w] = dA_sum;
      dD_bh[w] = dD_sum;
    }
    __syncthreads();  // (the next work item resets Gs)
  }
}

// dB and dC of group g: the heads' terms summed from +0 in increasing h (written rounded when
// round_bf16); a thread an element (bt, g, n).
__global__ void ssm_scan_group_sums_kernel(float* dxbc, const float* contrib, ScanDims d,
                                           int64_t n_items, bool round_bf16) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_items;
       i += stride) {
    const int64_t n = i % d.N, g = (i / d.N) % d.G, bt = i / (d.N * d.G);
    float dB = 0.0f, dC = 0.0f;
    for (int64_t h = g * d.heads_per_group; h < (g + 1) * d.heads_per_group; ++h) {
      const float* cb = contrib + (bt * d.H + h) * 2 * d.N;
      dB = fadd_rn(dB, cb[n]);
      dC = fadd_rn(dC, cb[d.N + n]);
    }
    float* r = dxbc + bt * d.Cx + d.HP;
    r[g * d.N + n] = stored(dB, round_bf16);
    r[d.G * d.N + g * d.N + n] = stored(dC, round_bf16);
  }
}

// dA[h] = sum over b (increasing) of dA_bh; dD[h] += the same sum of dD_bh.
__global__ void ssm_scan_head_sums_kernel(float* dA, float* dD, const float* dA_bh,
                                          const float* dD_bh, int64_t B, int64_t H) {
  const int64_t h = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (h >= H) return;
  float sa = 0.0f, sd = 0.0f;
  for (int64_t b = 0; b < B; ++b) {
    sa = fadd_rn(sa, dA_bh[b * H + h]);
    sd = fadd_rn(sd, dD_bh[b * H + h]);
  }
  dA[h] = sa;
  dD[h] = fadd_rn(dD[h], sd);
}

// Lets `kernel` take `bytes` of dynamic shared memory; std::invalid_argument naming `op` where
// the device has less.
template <class Kernel>
void allow_shared(const char* op, Kernel* kernel, size_t bytes, const char* what) {
  int device = 0, optin = 0;
  FP4SIM_CUDA_CHECK(cudaGetDevice(&device));
  FP4SIM_CUDA_CHECK(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (bytes > static_cast<size_t>(optin))
    throw std::invalid_argument(std::string(op) + ": " + what + " take " + std::to_string(bytes) +
                                " bytes of shared memory, more than the device's " +
                                std::to_string(optin));
  if (bytes > 48 * 1024)
    FP4SIM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(bytes)));
}

void ssm_scan_forward(float* y, float* states, const float* xbc, const float* dt, const float* A,
                      const float* D, const SsmShape& s, bool round_bf16, cudaStream_t stream) {
  const ScanDims d = scan_dims(s);
  const size_t shared = static_cast<size_t>(d.P * (d.N + 1) + 2 * d.N) * sizeof(float);
  allow_shared("ssm_scan_forward", ssm_scan_forward_kernel, shared,
               "the state P x (N + 1) and B_t, C_t");
  ssm_scan_forward_kernel<<<static_cast<unsigned>(d.B * d.H), static_cast<unsigned>(d.P), shared,
                            stream>>>(y, states, xbc, dt, A, D, d, round_bf16);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

// The scratch of ssm_scan_backward, as the caller provides it (float counts below).
struct ScanBackwardScratch {
  float* bufs;     // slots * (Q + 1) * P * N
  float* contrib;  // B*T * H * 2N
  float* dA_bh;    // B*H
  float* dD_bh;    // B*H
  int64_t slots;
};

// dxbc written (dx, dB, dC), ddt written, dA written, dD +=: emu::ssm_scan_backward.
void ssm_scan_backward(float* dxbc, float* ddt, float* dA, float* dD, const float* dy,
                       const float* xbc, const float* dt, const float* A, const float* D,
                       const float* states, const SsmShape& s, bool round_bf16,
                       const ScanBackwardScratch& ws, cudaStream_t stream) {
  const ScanDims d = scan_dims(s);
  const int64_t threads = ((d.P > d.N ? d.P : d.N) + 31) / 32 * 32;
  const size_t shared =
      static_cast<size_t>(d.P * (d.N + 1) + 3 * d.P + 3 * d.N + d.Q) * sizeof(float);
  allow_shared("ssm_scan_backward", ssm_scan_backward_kernel, shared,
               "the state gradient P x (N + 1), the step's vectors and the chunk's decays");
  ssm_scan_backward_kernel<<<static_cast<unsigned>(ws.slots), static_cast<unsigned>(threads),
                             shared, stream>>>(dxbc, ws.contrib, ddt, ws.dA_bh, ws.dD_bh, dy, xbc,
                                               dt, A, D, states, ws.bufs, d, round_bf16);
  FP4SIM_CUDA_CHECK_LAUNCH();
  const int64_t items = d.B * d.T * d.G * d.N;
  ssm_scan_group_sums_kernel<<<elementwise_grid(items), kThreads, 0, stream>>>(dxbc, ws.contrib, d,
                                                                               items, round_bf16);
  FP4SIM_CUDA_CHECK_LAUNCH();
  ssm_scan_head_sums_kernel<<<static_cast<unsigned>((d.H + kThreads - 1) / kThreads), kThreads, 0,
                              stream>>>(dA, dD, ws.dA_bh, ws.dD_bh, d.B, d.H);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

// ---- gated grouped RMSNorm ---------------------------------------------------------------------

// A thread a (row r, group j) = i / G, % G: ms over the group in increasing i, then the outputs
// (g recomputed: the same bits).
__global__ void gated_rmsnorm_forward_kernel(float* out, float* rstd, const float* inp,
                                             const float* z, int64_t ld_z, const float* weight,
                                             int64_t N, int64_t C, int64_t G, float eps,
                                             bool round_bf16) {
  const int64_t gs = C / G, n_items = N * G;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t it = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; it < n_items;
       it += stride) {
    const int64_t r = it / G, j = it % G;
    const float* x = inp + r * C + j * gs;
    const float* zr = z + r * ld_z + j * gs;
    float ms = 0.0f;
    for (int64_t i = 0; i < gs; ++i) {
      const float gv = fmul_rn(x[i], ssm_silu(zr[i]));
      ms = fadd_rn(ms, fmul_rn(gv, gv));
    }
    ms = fdiv_rn(ms, static_cast<float>(gs));
    const float sc = fdiv_rn(1.0f, __fsqrt_rn(fadd_rn(ms, eps)));
    float* o = out + r * C + j * gs;
    const float* w = weight + j * gs;
    for (int64_t i = 0; i < gs; ++i)
      o[i] = stored(fmul_rn(fmul_rn(fmul_rn(x[i], ssm_silu(zr[i])), sc), w[i]), round_bf16);
    rstd[r * G + j] = sc;
  }
}

// A thread a (row, group): dinp, dz, and the dweight terms dw_terms (N, C) = (dy * g) * s.
__global__ void gated_rmsnorm_backward_kernel(float* dinp, float* dz, int64_t ld_dz,
                                              float* dw_terms, const float* dout, const float* inp,
                                              const float* z, int64_t ld_z, const float* weight,
                                              const float* rstd, int64_t N, int64_t C, int64_t G,
                                              bool round_dinp, bool round_dz, bool bf16_dout) {
  const int64_t gs = C / G, n_items = N * G;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t it = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; it < n_items;
       it += stride) {
    const int64_t r = it / G, j = it % G;
    const float* x = inp + r * C + j * gs;
    const float* zr = z + r * ld_z + j * gs;
    const float* dy = dout + r * C + j * gs;
    const float* w = weight + j * gs;
    const float sc = rstd[r * G + j];
    float dot = 0.0f;
    for (int64_t i = 0; i < gs; ++i) {
      float sz, sig;
      ssm_silu_sigmoid(zr[i], &sz, &sig);
      const float gv = fmul_rn(x[i], sz);
      dot = fadd_rn(dot, fmul_rn(fmul_rn(read_dout(dy[i], bf16_dout), w[i]), gv));
    }
    const float k = fdiv_rn(fmul_rn(fmul_rn(fmul_rn(dot, sc), sc), sc), static_cast<float>(gs));
    float* dx = dinp + r * C + j * gs;
    float* dzr = dz + r * ld_dz + j * gs;
    float* dwt = dw_terms + r * C + j * gs;
    for (int64_t i = 0; i < gs; ++i) {
      float sz, sig;
      ssm_silu_sigmoid(zr[i], &sz, &sig);
      const float gv = fmul_rn(x[i], sz), dyi = read_dout(dy[i], bf16_dout);
      const float dg = fsub_rn(fmul_rn(fmul_rn(dyi, w[i]), sc), fmul_rn(gv, k));
      dx[i] = stored(fmul_rn(dg, sz), round_dinp);
      dzr[i] = stored(fmul_rn(fmul_rn(dg, x[i]), ssm_silu_grad_from(zr[i], sig)), round_dz);
      dwt[i] = fmul_rn(fmul_rn(dyi, gv), sc);
    }
  }
}

// The tiled gated norm: a thread block takes `items` consecutive (row, group) items (it = r * G +
// j); its threads compute the items' elementwise terms in parallel, reading and writing whole rows
// (coalesced), into shared memory, item-major with a row of gs + 1 floats (the pad makes the
// summing threads' reads conflict-free); then one thread an item sums its terms in increasing i
// from +0, the emulator's order, so the bits are the per-item kernels' above. Used where gs + 1
// floats fit kGatedTileFloats for at least one item.
constexpr int64_t kGatedTileFloats = 12288;  // 48 KiB of shared memory a block
constexpr int64_t kGatedTileItems = 32;
int64_t gated_tile_items(int64_t gs) {
  const int64_t n = kGatedTileFloats / (gs + 1);
  return n < kGatedTileItems ? n : kGatedTileItems;
}

__global__ void gated_rmsnorm_forward_tiled_kernel(float* out, float* rstd, const float* inp,
                                                   const float* z, int64_t ld_z,
                                                   const float* weight, int64_t N, int64_t C,
                                                   int64_t G, int64_t items, float eps,
                                                   bool round_bf16) {
  extern __shared__ float sg[];  // [items][gs + 1]: g = x * silu(z)
  __shared__ float ssc[kGatedTileItems];
  const int64_t gs = C / G, it0 = static_cast<int64_t>(blockIdx.x) * items;
  const int64_t n = (it0 + items <= N * G ? items : N * G - it0) * gs;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
    int64_t item, i, r, j;
    divmod(e, gs, item, i);
    divmod(it0 + item, G, r, j);
    sg[item * (gs + 1) + i] = fmul_rn(inp[r * C + j * gs + i], ssm_silu(z[r * ld_z + j * gs + i]));
  }
  __syncthreads();
  if (threadIdx.x < items && it0 + threadIdx.x < N * G) {
    const float* g = sg + threadIdx.x * (gs + 1);
    float ms = 0.0f;
    for (int64_t i = 0; i < gs; ++i) ms = fadd_rn(ms, fmul_rn(g[i], g[i]));
    ms = fdiv_rn(ms, static_cast<float>(gs));
    const float sc = fdiv_rn(1.0f, __fsqrt_rn(fadd_rn(ms, eps)));
    ssc[threadIdx.x] = sc;
    rstd[it0 + threadIdx.x] = sc;  // (rstd (N, G): item it at r * G + j = it)
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
    int64_t item, i, r, j;
    divmod(e, gs, item, i);
    divmod(it0 + item, G, r, j);
    out[r * C + j * gs + i] = stored(
        fmul_rn(fmul_rn(sg[item * (gs + 1) + i], ssc[item]), weight[j * gs + i]), round_bf16);
  }
}

__global__ void gated_rmsnorm_backward_tiled_kernel(
    float* dinp, float* dz, int64_t ld_dz, float* dw_terms, const float* dout, const float* inp,
    const float* z, int64_t ld_z, const float* weight, const float* rstd, int64_t N, int64_t C,
    int64_t G, int64_t items, bool round_dinp, bool round_dz, bool bf16_dout) {
  extern __shared__ float st[];  // [items][gs + 1]: (dy * w) * g
  __shared__ float sk[kGatedTileItems];
  const int64_t gs = C / G, it0 = static_cast<int64_t>(blockIdx.x) * items;
  const int64_t n = (it0 + items <= N * G ? items : N * G - it0) * gs;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
    int64_t item, i, r, j;
    divmod(e, gs, item, i);
    divmod(it0 + item, G, r, j);
    float sz, sig;
    ssm_silu_sigmoid(z[r * ld_z + j * gs + i], &sz, &sig);
    const float gv = fmul_rn(inp[r * C + j * gs + i], sz);
    st[item * (gs + 1) + i] =
        fmul_rn(fmul_rn(read_dout(dout[r * C + j * gs + i], bf16_dout), weight[j * gs + i]), gv);
  }
  __syncthreads();
  if (threadIdx.x < items && it0 + threadIdx.x < N * G) {
    const float* t = st + threadIdx.x * (gs + 1);
    float dot = 0.0f;
    for (int64_t i = 0; i < gs; ++i) dot = fadd_rn(dot, t[i]);
    const float sc = rstd[it0 + threadIdx.x];
    sk[threadIdx.x] = fdiv_rn(fmul_rn(fmul_rn(fmul_rn(dot, sc), sc), sc), static_cast<float>(gs));
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
    int64_t item, i, r, j;
    divmod(e, gs, item, i);
    divmod(it0 + item, G, r, j);
    const float sc = rstd[it0 + item], k = sk[item], x = inp[r * C + j * gs + i],
                zi = z[r * ld_z + j * gs + i];
    float sz, sig;
    ssm_silu_sigmoid(zi, &sz, &sig);
    const float gv = fmul_rn(x, sz), dyi = read_dout(dout[r * C + j * gs + i], bf16_dout);
    const float dg = fsub_rn(fmul_rn(fmul_rn(dyi, weight[j * gs + i]), sc), fmul_rn(gv, k));
    dinp[r * C + j * gs + i] = stored(fmul_rn(dg, sz), round_dinp);
    dz[r * ld_dz + j * gs + i] =
        stored(fmul_rn(fmul_rn(dg, x), ssm_silu_grad_from(zi, sig)), round_dz);
    dw_terms[r * C + j * gs + i] = fmul_rn(fmul_rn(dyi, gv), sc);
  }
}

void gated_rmsnorm_forward(float* out, float* rstd, const float* inp, const float* z, int64_t ld_z,
                           const float* weight, int64_t N, int64_t C, int64_t G, bool round_bf16,
                           cudaStream_t stream) {
  const int64_t items = gated_tile_items(C / G);
  if (items > 0) {
    const size_t smem = static_cast<size_t>(items * (C / G + 1)) * sizeof(float);
    gated_rmsnorm_forward_tiled_kernel<<<static_cast<unsigned>((N * G + items - 1) / items),
                                         kThreads, smem, stream>>>(
        out, rstd, inp, z, ld_z, weight, N, C, G, items, kGatedNormEps, round_bf16);
  } else {
    gated_rmsnorm_forward_kernel<<<elementwise_grid(N * G), kThreads, 0, stream>>>(
        out, rstd, inp, z, ld_z, weight, N, C, G, kGatedNormEps, round_bf16);
  }
  FP4SIM_CUDA_CHECK_LAUNCH();
}

// dw_terms: scratch of N*C floats; partials: of ssm_partials_floats(N, C, 1)
void gated_rmsnorm_backward(float* dinp, float* dz, int64_t ld_dz, float* dweight,
                            const float* dout, const float* inp, const float* z, int64_t ld_z,
                            const float* weight, const float* rstd, int64_t N, int64_t C, int64_t G,
                            bool round_dinp, bool round_dz, bool bf16_dout, float* dw_terms,
                            float* partials, cudaStream_t stream) {
  const int64_t items = gated_tile_items(C / G);
  if (items > 0) {
    const size_t smem = static_cast<size_t>(items * (C / G + 1)) * sizeof(float);
    gated_rmsnorm_backward_tiled_kernel<<<static_cast<unsigned>((N * G + items - 1) / items),
                                          kThreads, smem, stream>>>(
        dinp, dz, ld_dz, dw_terms, dout, inp, z, ld_z, weight, rstd, N, C, G, items, round_dinp,
        round_dz, bf16_dout);
  } else {
    gated_rmsnorm_backward_kernel<<<elementwise_grid(N * G), kThreads, 0, stream>>>(
        dinp, dz, ld_dz, dw_terms, dout, inp, z, ld_z, weight, rstd, N, C, G, round_dinp, round_dz,
        bf16_dout);
  }
  FP4SIM_CUDA_CHECK_LAUNCH();
  column_sums(dweight, dw_terms, N, C, partials, stream);
}

// The launch limits of the scan kernels: P threads a forward block, max(P, N) a backward block.
void require_scan_threads(const char* op, const SsmShape& s) {
  if (s.P > kMaxScanThreads || s.N > kMaxScanThreads)
    throw std::invalid_argument(std::string(op) + ": head dim P = " + std::to_string(s.P) +
                                " and state N = " + std::to_string(s.N) + " must be at most " +
                                std::to_string(kMaxScanThreads) + " on the cuda backend");
}

}  // namespace

namespace {
// The conv kernels unroll over kMaxConvWidth taps (a register array in the parameter gradients).
void require_conv_width(const char* op, const TensorView& weight) {
  if (weight.cols > kMaxConvWidth)
    throw std::invalid_argument(std::string(op) + ": conv width " + std::to_string(weight.cols) +
                                " (tensor '" + weight.name + "'); the cuda backend takes up to " +
                                std::to_string(kMaxConvWidth));
}
}  // namespace

void CudaBackend::ssm_conv_forward(const TensorView& out, const TensorView& inp,
                                   const TensorView& weight, const TensorView& bias,
                                   const SsmShape& s) {
  op_checks::ssm_conv_forward(out, inp, weight, bias, s);
  require_conv_width("ssm_conv_forward", weight);
  conv1d_silu_forward(out.as<float>(), inp.as<const float>(), inp.stride(),
                      weight.as<const float>(), bias.as<const float>(), s.B, s.T, s.xbc_cols(),
                      weight.cols, out.bf16_values, stream_);
}

void CudaBackend::ssm_conv_backward(const TensorView& dinp, const TensorView& dweight,
                                    const TensorView& dbias, const TensorView& dout,
                                    const TensorView& inp, const TensorView& weight,
                                    const TensorView& bias, const SsmShape& s) {
  op_checks::ssm_conv_backward(dinp, dweight, dbias, dout, inp, weight, bias, s);
  require_conv_width("ssm_conv_backward", weight);
  const int64_t C = s.xbc_cols();
  float* du = layers_state().ssm_terms.get<float>(static_cast<size_t>(s.B * s.T * C), stream_);
  float* partials = layers_state().ssm_partials.get<float>(
      static_cast<size_t>(ssm_partials_floats(s.B * s.T, C, weight.cols + 1)), stream_);
  conv1d_silu_backward(dinp.as<float>(), dinp.stride(), dweight.as<float>(), dbias.as<float>(),
                       dout.as<const float>(), inp.as<const float>(), inp.stride(),
                       weight.as<const float>(), bias.as<const float>(), s.B, s.T, C, weight.cols,
                       dinp.bf16_values, du, partials, stream_);
}

void CudaBackend::ssm_scan_forward(const TensorView& y, const TensorView& states,
                                   const TensorView& dt, const TensorView& A, const TensorView& xbc,
                                   const TensorView& dt_raw, const TensorView& dt_bias,
                                   const TensorView& A_log, const TensorView& D,
                                   const SsmShape& s) {
  op_checks::ssm_scan_forward(y, states, dt, A, xbc, dt_raw, dt_bias, A_log, D, s);
  require_scan_threads("ssm_scan_forward", s);
  gpu::ssm_dt_forward(dt.as<float>(), A.as<float>(), dt_raw.as<const float>(), dt_raw.stride(),
                      dt_bias.as<const float>(), A_log.as<const float>(), s.B, s.T, s.H, stream_);
  if (options_.ssm_sequential) {
    gpu::ssm_scan_forward(y.as<float>(), states.as<float>(), xbc.as<const float>(),
                          dt.as<const float>(), A.as<const float>(), D.as<const float>(), s,
                          y.bf16_values, stream_);
    return;
  }
  const SsdScratchBytes need = ssd_chunked_forward_scratch(s, states.present());
  SsdScratch ws;
  ws.states = layers_state().ssm_states.get<char>(static_cast<size_t>(need.states), stream_);
  ssd_chunked_forward(y.as<float>(), states.present() ? states.as<float>() : nullptr,
                      xbc.as<const float>(), dt.as<const float>(), A.as<const float>(),
                      D.as<const float>(), s, y.bf16_values, ws, stream_);
}

void CudaBackend::ssm_scan_backward(
    const TensorView& dxbc, const TensorView& ddt_raw, const TensorView& ddt_bias,
    const TensorView& dA_log, const TensorView& dD, const TensorView& dy, const TensorView& xbc,
    const TensorView& dt, const TensorView& A, const TensorView& dt_raw, const TensorView& dt_bias,
    const TensorView& A_log, const TensorView& D, const TensorView& states, const SsmShape& s) {
  op_checks::ssm_scan_backward(dxbc, ddt_raw, ddt_bias, dA_log, dD, dy, xbc, dt, A, dt_raw, dt_bias,
                               A_log, D, states, s);
  require_scan_threads("ssm_scan_backward", s);
  LayersState& st = layers_state();
  const int64_t BT = s.B * s.T, BH = s.B * s.H;
  if (!options_.ssm_sequential) {
    // ddt (B*T, H) and dA (H), then the chunked scan's partial sums, in the small buffer
    const SsdScratchBytes need = ssd_chunked_backward_scratch(s);
    float* small = st.ssm_small.get<float>(static_cast<size_t>(need.small) / 4, stream_);
    float* ddt = small;
    float* dA = ddt + BT * s.H;
    SsdScratch ws;
    ws.states = st.ssm_states.get<char>(static_cast<size_t>(need.states), stream_);
    ws.contrib = st.ssm_contrib.get<float>(static_cast<size_t>(need.contrib) / 4, stream_);
    ws.small = dA + s.H;
    ssd_chunked_backward(dxbc.as<float>(), ddt, dA, dD.as<float>(), dy.as<const float>(),
                         xbc.as<const float>(), dt.as<const float>(), A.as<const float>(),
                         D.as<const float>(), states.as<const float>(), s, dxbc.bf16_values, ws,
                         stream_);
    float* du = st.ssm_terms.get<float>(static_cast<size_t>(need.terms) / 4, stream_);
    float* partials =
        st.ssm_partials.get<float>(static_cast<size_t>(ssm_partials_floats(BT, s.H, 1)), stream_);
    gpu::ssm_dt_backward(ddt_raw.as<float>(), ddt_raw.stride(), ddt_bias.as<float>(),
                         dA_log.as<float>(), ddt, dA, dt_raw.as<const float>(), dt_raw.stride(),
                         dt_bias.as<const float>(), A_log.as<const float>(), s.B, s.T, s.H,
                         ddt_raw.bf16_values, du, partials, stream_);
    return;
  }
  ScanBackwardScratch ws;
  ws.slots = ssm_scan_backward_slots(s);  // (gpu/capabilities.hpp)
  ws.bufs =
      st.ssm_states.get<float>(static_cast<size_t>(ws.slots * (s.chunk + 1) * s.P * s.N), stream_);
  ws.contrib = st.ssm_contrib.get<float>(static_cast<size_t>(BT * s.H * 2 * s.N), stream_);
  // ddt (B*T, H), dA (H), dA_bh, dD_bh (B*H) in one buffer; the softplus backward pass's du
  // (B*T, H) in the terms buffer
  float* small = st.ssm_small.get<float>(static_cast<size_t>(BT * s.H + s.H + 2 * BH), stream_);
  float* ddt = small;
  float* dA = ddt + BT * s.H;
  ws.dA_bh = dA + s.H;
  ws.dD_bh = ws.dA_bh + BH;
  gpu::ssm_scan_backward(dxbc.as<float>(), ddt, dA, dD.as<float>(), dy.as<const float>(),
                         xbc.as<const float>(), dt.as<const float>(), A.as<const float>(),
                         D.as<const float>(), states.as<const float>(), s, dxbc.bf16_values, ws,
                         stream_);
  float* du = st.ssm_terms.get<float>(static_cast<size_t>(BT * s.H), stream_);
  float* partials =
      st.ssm_partials.get<float>(static_cast<size_t>(ssm_partials_floats(BT, s.H, 1)), stream_);
  gpu::ssm_dt_backward(ddt_raw.as<float>(), ddt_raw.stride(), ddt_bias.as<float>(),
                       dA_log.as<float>(), ddt, dA, dt_raw.as<const float>(), dt_raw.stride(),
                       dt_bias.as<const float>(), A_log.as<const float>(), s.B, s.T, s.H,
                       ddt_raw.bf16_values, du, partials, stream_);
}

void CudaBackend::gated_norm_forward(const TensorView& out, const TensorView& rstd,
                                     const TensorView& inp, const TensorView& z,
                                     const TensorView& weight) {
  op_checks::gated_norm_forward(out, rstd, inp, z, weight);
  if (inp.rows == 0) return;
  gated_rmsnorm_forward(out.as<float>(), rstd.as<float>(), inp.as<const float>(),
                        z.as<const float>(), z.stride(), weight.as<const float>(), inp.rows,
                        inp.cols, rstd.cols, out.bf16_values, stream_);
}

void CudaBackend::gated_norm_backward(const TensorView& dinp, const TensorView& dz,
                                      const TensorView& dweight, const TensorView& dout,
                                      const TensorView& inp, const TensorView& z,
                                      const TensorView& weight, const TensorView& rstd) {
  op_checks::gated_norm_backward(dinp, dz, dweight, dout, inp, z, weight, rstd);
  const int64_t N = inp.rows, C = inp.cols;
  if (N == 0) return;
  float* terms = layers_state().ssm_terms.get<float>(static_cast<size_t>(N * C), stream_);
  float* partials = layers_state().ssm_partials.get<float>(
      static_cast<size_t>(ssm_partials_floats(N, C, 1)), stream_);
  gated_rmsnorm_backward(dinp.as<float>(), dz.as<float>(), dz.stride(), dweight.as<float>(),
                         dout.as<const float>(), inp.as<const float>(), z.as<const float>(),
                         z.stride(), weight.as<const float>(), rstd.as<const float>(), N, C,
                         rstd.cols, dinp.bf16_values, dz.bf16_values, dout.bf16_values, terms,
                         partials, stream_);
}

}  // namespace fp4sim::gpu
