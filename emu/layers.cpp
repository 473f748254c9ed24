#include "emu/layers.hpp"

#include <algorithm>
#include <cmath>

#include "emu/formats.hpp"

namespace fp4sim::emu {

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int64_t N, int64_t C, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    float m = 0.0f;
    for (int64_t i = 0; i < C; ++i) m += x[i];
    m = m / static_cast<float>(C);
    float v = 0.0f;
    for (int64_t i = 0; i < C; ++i) {
      const float d = x[i] - m;
      v += d * d;
    }
    v = v / static_cast<float>(C);
    const float s = 1.0f / std::sqrt(v + eps);
    float* o = out + n * C;
    for (int64_t i = 0; i < C; ++i) o[i] = (s * (x[i] - m)) * weight[i] + bias[i];
    mean[n] = m;
    rstd[n] = s;
  }
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int64_t N, int64_t C) {
  // dweight/dbias sum over rows: kept sequential over n so the order is fixed
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    const float* dy = dout + n * C;
    float* dx = dinp + n * C;
    const float m = mean[n], s = rstd[n];
    float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
    for (int64_t i = 0; i < C; ++i) {
      const float norm = (x[i] - m) * s;
      const float dnorm = weight[i] * dy[i];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean = dnorm_mean / static_cast<float>(C);
    dnorm_norm_mean = dnorm_norm_mean / static_cast<float>(C);
    for (int64_t i = 0; i < C; ++i) {
      const float norm = (x[i] - m) * s;
      const float dnorm = weight[i] * dy[i];
      dbias[i] += dy[i];
      dweight[i] += norm * dy[i];
      dx[i] += ((dnorm - dnorm_mean) - norm * dnorm_norm_mean) * s;
    }
  }
}

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                     int64_t C, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    float ms = 0.0f;
    for (int64_t i = 0; i < C; ++i) ms += x[i] * x[i];
    ms = ms / static_cast<float>(C);
    const float s = 1.0f / std::sqrt(ms + eps);
    for (int64_t i = 0; i < C; ++i) out[n * C + i] = (x[i] * s) * weight[i];
    rstd[n] = s;
  }
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    const float* dy = dout + n * C;
    const float s = rstd[n];
    float dot = 0.0f;  // sum_i dy_i w_i x_i
    for (int64_t i = 0; i < C; ++i) dot += dy[i] * weight[i] * x[i];
    const float k = dot * s * s * s / static_cast<float>(C);
    for (int64_t i = 0; i < C; ++i) {
      dweight[i] += dy[i] * x[i] * s;
      dinp[n * C + i] += dy[i] * weight[i] * s - x[i] * k;
    }
  }
}

namespace {
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluCubic = 0.044715f;
}  // namespace

void gelu_forward(float* out, const float* inp, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float cube = kGeluCubic * x * x * x;
    out[i] = 0.5f * x * (1.0f + std::tanh(kGeluScale * (x + cube)));
  }
}

void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float cube = kGeluCubic * x * x * x;
    const float arg = kGeluScale * (x + cube);
    const float t = std::tanh(arg);
    const float sech2 = 1.0f - t * t;
    const float local =
        0.5f * (1.0f + t) + x * 0.5f * sech2 * kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
    dinp[i] = 0.0f + local * dout[i];  // written (see layers.hpp)
  }
}

void round_to_bf16(float* x, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] = bf16_round(x[i]);
}

void squared_relu_forward(float* out, const float* inp, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float r = inp[i] > 0.0f ? inp[i] : 0.0f;
    out[i] = r * r;
  }
}

void squared_relu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) dinp[i] = 0.0f + (inp[i] > 0.0f ? 2.0f * inp[i] : 0.0f) * dout[i];
}

void swiglu_forward(float* out, const float* inp, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* g = inp + n * 2 * F;
    const float* u = g + F;
    for (int64_t i = 0; i < F; ++i) out[n * F + i] = (g[i] / (1.0f + std::exp(-g[i]))) * u[i];
  }
}

void swiglu_backward(float* dinp, const float* inp, const float* dout, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* g = inp + n * 2 * F;
    const float* u = g + F;
    float* dg = dinp + n * 2 * F;
    float* du = dg + F;
    for (int64_t i = 0; i < F; ++i) {
      const float sig = 1.0f / (1.0f + std::exp(-g[i]));
      const float silu = g[i] * sig;
      const float dy = dout[n * F + i];
      // d silu / dx = sig * (1 + x * (1 - sig))
      dg[i] = 0.0f + (dy * u[i]) * (sig * (1.0f + g[i] * (1.0f - sig)));
      du[i] = 0.0f + dy * silu;
    }
  }
}

namespace {

// One row of the softmax cross-entropy: p (V) = softmax(z), *loss = -log p[target]; each logit
// read as bf16_round(z[i]) when bf16_logits.
void crossentropy_forward_row(float* loss, float* p, const float* z, int32_t target, int64_t V,
                              bool bf16_logits) {
  auto logit = [&](int64_t i) { return bf16_logits ? bf16_round(z[i]) : z[i]; };
  float maxv = -INFINITY;
  for (int64_t i = 0; i < V; ++i) maxv = logit(i) > maxv ? logit(i) : maxv;
  float sum = 0.0f;
  for (int64_t i = 0; i < V; ++i) {
    p[i] = std::exp(logit(i) - maxv);
    sum += p[i];
  }
  for (int64_t i = 0; i < V; ++i) p[i] = p[i] / sum;
  *loss = -std::log(p[target]);
}

// d (V) = (p - onehot(target)) * dloss (d may be p itself).
void crossentropy_backward_row(float* d, const float* p, int32_t target, float dloss, int64_t V,
                               bool round_bf16) {
  for (int64_t i = 0; i < V; ++i) {
    const float indicator = i == target ? 1.0f : 0.0f;
    const float v = (p[i] - indicator) * dloss;
    d[i] = round_bf16 ? bf16_round(v) : v;
  }
}

}  // namespace

void crossentropy_softmax_forward(float* losses, float* probs, const float* logits,
                                  const int32_t* targets, int64_t N, int64_t V, bool bf16_logits) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    crossentropy_forward_row(losses + n, probs + n * V, logits + n * V, targets[n], V, bf16_logits);
}

// Row by row: the forward's probabilities in dlogits' row, then the backward's expression on them
// in place: the same operations as the two ops one after the other.
void crossentropy_softmax_forward_backward(float* losses, float* dlogits, const float* logits,
                                           const int32_t* targets, const float* dlosses, int64_t N,
                                           int64_t V, bool round_bf16) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float* d = dlogits + n * V;
    crossentropy_forward_row(losses + n, d, logits + n * V, targets[n], V, round_bf16);
    crossentropy_backward_row(d, d, targets[n], dlosses[n], V, round_bf16);
  }
}

void crossentropy_softmax_backward(float* dlogits, const float* probs, const int32_t* targets,
                                   const float* dlosses, int64_t N, int64_t V, bool round_bf16) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    crossentropy_backward_row(dlogits + n * V, probs + n * V, targets[n], dlosses[n], V,
                              round_bf16);
}

}  // namespace fp4sim::emu

#include <vector>

#include "emu/formats.hpp"
#include "emu/mma.hpp"

namespace fp4sim::emu {

namespace {

// One operand prepared for the chained BF16 T-FDPA: BF16 values as doubles (products exact) and
// exponent readings E(x) = max(floor(log2|x|), -126), a large negative number for zeros so that a
// zero product never sets e_max. Rows padded with zeros to a multiple of 16.
struct Bf16Operand {
  std::vector<float> f;                // BF16 values as floats (for the literal fallback)
  std::vector<double> d;               // the same values as doubles
  std::vector<int32_t> e;              // exponent readings
  std::vector<uint8_t> special_chunk;  // per (row, chunk): a NaN or Inf in it
};

Bf16Operand prepare_bf16(const float* x, int64_t rows, int64_t K, int64_t Kp) {
  Bf16Operand o;
  o.f.assign(static_cast<size_t>(rows * Kp), 0.0f);
  o.d.assign(o.f.size(), 0.0);
  o.e.assign(o.f.size(), kBf16ZeroReading);
  o.special_chunk.assign(static_cast<size_t>(rows * (Kp / kBf16FdpaL)), 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const float v = bf16_round(x[r * K + k]);
      const size_t i = static_cast<size_t>(r * Kp + k);
      o.f[i] = v;
      o.d[i] = v;
      const uint32_t u = f32_bits(v) & 0x7FFFFFFFu;
      if (u >= 0x7F800000u)
        o.special_chunk[static_cast<size_t>(r * (Kp / kBf16FdpaL) + k / kBf16FdpaL)] = 1;
      else
        o.e[i] = bf16_exponent_reading(v);
    }
  return o;
}

// The chained T-FDPA of row ra of A and row rb of B (Kp = chunks * 16 prepared values each), from
// +0: the prepared T-FDPA per chunk, the literal one for chunks holding a NaN or Inf.
// (Always inlined: in bf16_gemm_row's AVX-512/AVX2 clones it must be compiled for their target.)
#if defined(__GNUC__)
__attribute__((always_inline))
#endif
inline float
bf16_row_dot(const Bf16Operand& A, int64_t ra, const Bf16Operand& B, int64_t rb, int64_t Kp,
             int64_t chunks) {
  float acc = 0.0f;
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const size_t ia = static_cast<size_t>(ra * Kp + ch * kBf16FdpaL),
                 ib = static_cast<size_t>(rb * Kp + ch * kBf16FdpaL);
    if (A.special_chunk[static_cast<size_t>(ra * chunks + ch)] |
        B.special_chunk[static_cast<size_t>(rb * chunks + ch)]) {
      acc = tfdpa_bf16(&A.f[ia], &B.f[ib], acc);
      continue;
    }
    acc = tfdpa_bf16_prepared(&A.d[ia], &A.e[ia], &B.d[ib], &B.e[ib], &A.f[ia], &B.f[ib], acc);
  }
  return acc;
}

// One output row of bf16_gemm_tn. Compiled also for x86-64-v4 (AVX-512: the 16 truncated terms of a
// chunk convert to int64 eight at a time) and v3 (AVX2), chosen at run time by the CPU; the
// arithmetic is exact in every version (products exact in double, truncation by the int64
// conversion, an int64 sum), so every version gives the same bits. No FMA can appear: the build
// has -ffp-contract=off.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void bf16_gemm_row(float* out_row, const Bf16Operand& A, const Bf16Operand& B, int64_t m, int64_t N, int64_t Kp,
                   int64_t chunks) {
  for (int64_t n = 0; n < N; ++n) out_row[n] = bf16_row_dot(A, m, B, n, Kp, chunks);
}

}  // namespace

// Chained T-FDPA per output (tfdpa_bf16_prepared) with the operands' doubles and exponent readings
// prepared once; chunks holding a NaN or Inf take the literal path.
void bf16_gemm_tn(float* out, const float* a, const float* b, int64_t M, int64_t N, int64_t K) {
  const int64_t Kp = (K + kBf16FdpaL - 1) / kBf16FdpaL * kBf16FdpaL, chunks = Kp / kBf16FdpaL;
  const Bf16Operand A = prepare_bf16(a, M, K, Kp), B = prepare_bf16(b, N, K, Kp);
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < M; ++m) bf16_gemm_row(out + m * N, A, B, m, N, Kp, chunks);
}

void fp32_gemm_tn(float* out, const float* a, const float* b, int64_t M, int64_t N, int64_t K) {
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += a[m * K + k] * b[n * K + k];
      out[m * N + n] = s;
    }
}

namespace {
void gemm_tn(float* out, const float* a, const float* b, int64_t M, int64_t N, int64_t K,
             GemmPrecision p) {
  if (p == GemmPrecision::BF16)
    bf16_gemm_tn(out, a, b, M, N, K);
  else
    fp32_gemm_tn(out, a, b, M, N, K);
}
}  // namespace

void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N,
                    int64_t K, int64_t OC, GemmPrecision prec) {
  gemm_tn(out, inp, weight, N, OC, K, prec);
  if (bias)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < OC; ++o) out[n * OC + o] += bias[o];
}

void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t N, int64_t K, int64_t OC, GemmPrecision prec) {
  // dinp = dout (N,OC) * W (OC,K): TN form with B = W^T (K,OC)
  if (dinp) {
    std::vector<float> wt(static_cast<size_t>(K * OC));
    for (int64_t o = 0; o < OC; ++o)
      for (int64_t k = 0; k < K; ++k) wt[k * OC + o] = weight[o * K + k];
    gemm_tn(dinp, dout, wt.data(), N, K, OC, prec);  // written, not added (emu/layers.hpp)
  }
  // dweight = dout^T (OC,N) * inp (N,K): TN form with A = dout^T, B = inp^T (K,N)
  if (dweight) {
    std::vector<float> dt(static_cast<size_t>(OC * N)), it(static_cast<size_t>(K * N)),
        tw(static_cast<size_t>(OC * K));
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t o = 0; o < OC; ++o) dt[o * N + n] = dout[n * OC + o];
      for (int64_t k = 0; k < K; ++k) it[k * N + n] = inp[n * K + k];
    }
    gemm_tn(tw.data(), dt.data(), it.data(), OC, K, N, prec);
    for (int64_t i = 0; i < OC * K; ++i) dweight[i] += tw[i];
  }
  if (dbias) bias_backward(dbias, dout, N, OC);
}

void bias_forward(float* out, const float* bias, int64_t N, int64_t OC) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) out[n * OC + o] += bias[o];
}

void bias_backward(float* dbias, const float* dout, int64_t N, int64_t OC) {
  for (int64_t o = 0; o < OC; ++o) {
    float acc = 0.0f;
    for (int64_t k = 0; k * kColumnChunkRows < N; ++k) {
      float s = 0.0f;
      for (int64_t n = k * kColumnChunkRows; n < std::min(N, (k + 1) * kColumnChunkRows); ++n)
        s += dout[n * OC + o];
      acc = k == 0 ? s : acc + s;
    }
    dbias[o] += acc;
  }
}

}  // namespace fp4sim::emu

namespace fp4sim::emu {

// One (b, h) per iteration; row t's scores, then its probabilities, in p (T). rnd: the BF16
// rounding of an operand (the identity in FP32 mode).
namespace {

// sum_k a(k) * b(k) over k = k0 .. n-1 as the BF16 tensor core chains it (DESIGN.md §8): T-FDPA
// (L = 16, F = 25, RZ) over consecutive 16-term chunks, chunk boundaries at multiples of 16 from 0,
// in increasing k, starting from c; terms before k0 and from n on are zero (a chunk of zero terms
// returns c unchanged, so chunks wholly before k0 are skipped). The operands are BF16 values.
template <class A, class Bf>
float tfdpa_chain(int64_t k0, int64_t n, float c, const A& a, const Bf& b) {
  float x[kBf16FdpaL], y[kBf16FdpaL];
  for (int64_t base = k0 / kBf16FdpaL * kBf16FdpaL; base < n; base += kBf16FdpaL) {
    for (int k = 0; k < kBf16FdpaL; ++k) {
      const int64_t kk = base + k;
      const bool in = kk >= k0 && kk < n;
      x[k] = in ? a(kk) : 0.0f;
      y[k] = in ? b(kk) : 0.0f;
    }
    c = tfdpa_bf16_host(x, y, c);
  }
  return c;
}

// c + sum_k a(k) * b(k), k = k0 .. n-1, in FP32 in increasing k (the FP32 mode)
template <class A, class Bf>
float fp32_chain(int64_t k0, int64_t n, float c, const A& a, const Bf& b) {
  for (int64_t k = k0; k < n; ++k) c += a(k) * b(k);
  return c;
}

// a sum of products as the precision mode computes it: a T-FDPA chain (BF16) or FP32 in order
template <class A, class Bf>
float chain(bool bf16, int64_t k0, int64_t n, float c, const A& a, const Bf& b) {
  return bf16 ? tfdpa_chain(k0, n, c, a, b) : fp32_chain(k0, n, c, a, b);
}

// The operands of one (b, head): rows (T, HD) of qkv or dout rounded once as the precision mode
// reads them, and their transpose (HD, T), so every chain walks contiguous memory.
// For the row-by-row dot products (HD a multiple of 16, BF16 mode) the rows are also prepared as
// bf16_gemm_tn prepares its operands (prepare_bf16), and dot_rows chains them as it does.
struct HeadOperand {
  std::vector<float> rows, cols;  // rows[t * HD + i] == cols[i * T + t]
  Bf16Operand prepared;           // of rows, or empty
};
HeadOperand head_operand(const float* base, int64_t stride, int64_t T, int64_t HD, bool bf16) {
  HeadOperand o;
  o.rows.resize(static_cast<size_t>(T * HD));
  o.cols.resize(o.rows.size());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < HD; ++i) {
      const float x = bf16 ? bf16_round(base[t * stride + i]) : base[t * stride + i];
      o.rows[static_cast<size_t>(t * HD + i)] = x;
      o.cols[static_cast<size_t>(i * T + t)] = x;
    }
  if (bf16 && HD % kBf16FdpaL == 0) o.prepared = prepare_bf16(o.rows.data(), T, HD, HD);
  return o;
}

// chain over i of a_i b_i for row ra of a and row rb of b (both HD long): bf16_row_dot where the
// operands were prepared, else the generic chain
float dot_rows(bool bf16, const HeadOperand& a, int64_t ra, const HeadOperand& b, int64_t rb,
               int64_t HD) {
  if (bf16 && !a.prepared.d.empty() && !b.prepared.d.empty())
    return bf16_row_dot(a.prepared, ra, b.prepared, rb, HD, HD / kBf16FdpaL);
  const float* x = &a.rows[static_cast<size_t>(ra * HD)];
  const float* y = &b.rows[static_cast<size_t>(rb * HD)];
  return chain(
      bf16, 0, HD, 0.0f, [&](int64_t i) { return x[i]; }, [&](int64_t i) { return y[i]; });
}

}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t NH,
                       int64_t NKV, int64_t HD, GemmPrecision prec) {
  const int64_t W = (NH + 2 * NKV) * HD, group = NH / NKV;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
  const bool bf16 = prec == GemmPrecision::BF16;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < NH; ++h) {
      const int64_t g = h / group;
      const HeadOperand q = head_operand(qkv + b * T * W + h * HD, W, T, HD, bf16);
      const HeadOperand k = head_operand(qkv + b * T * W + (NH + g) * HD, W, T, HD, bf16);
      const HeadOperand v = head_operand(qkv + b * T * W + (NH + NKV + g) * HD, W, T, HD, bf16);
      std::vector<float> p(static_cast<size_t>(T)), pb(static_cast<size_t>(T));
      for (int64_t t = 0; t < T; ++t) {
        float m = -INFINITY;
        for (int64_t j = 0; j <= t; ++j) {
          const float s = dot_rows(bf16, q, t, k, j, HD) * scale;
          p[j] = s;
          m = s > m ? s : m;
        }
        float l = 0.0f;
        for (int64_t j = 0; j <= t; ++j) {
          p[j] = std::exp(p[j] - m);
          l += p[j];
          pb[j] = bf16 ? bf16_round(p[j]) : p[j];
        }
        float* o = out + (b * T + t) * NH * HD + h * HD;
        for (int64_t i = 0; i < HD; ++i) {
          const float* vi = &v.cols[static_cast<size_t>(i * T)];  // v_ji = vi[j]
          o[i] = chain(
                     bf16, 0, t + 1, 0.0f, [&](int64_t j) { return pb[j]; },
                     [&](int64_t j) { return vi[j]; }) /
                 l;
        }
        lse[(b * NH + h) * T + t] = m + std::log(l);
      }
    }
  }
}

// One (b, g) per iteration: it owns the KV head's dk and dv and the dq of the group's query heads,
// so the iterations are independent and each sum has the fixed order the header states. P and dS
// of the group's heads are kept for the (b, g) (group * T * T floats each, transposed to (j, t) so
// that dk and dv chain over t in contiguous memory).
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HD,
                        GemmPrecision prec) {
  const int64_t W = (NH + 2 * NKV) * HD, group = NH / NKV;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
  const bool bf16 = prec == GemmPrecision::BF16;
  auto rnd = [bf16](float x) { return bf16 ? bf16_round(x) : x; };
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < NKV; ++g) {
      const HeadOperand k = head_operand(qkv + b * T * W + (NH + g) * HD, W, T, HD, bf16);
      const HeadOperand v = head_operand(qkv + b * T * W + (NH + NKV + g) * HD, W, T, HD, bf16);
      // pbt, dsbt (group, T (j), T (t)): bf16(p_tj) and bf16(dS_tj) of the group's heads, 0 above
      // the diagonal; q, dy: the group's query and output-gradient heads
      std::vector<float> pbt(static_cast<size_t>(group * T * T), 0.0f), dsbt(pbt.size(), 0.0f);
      std::vector<float> ds(static_cast<size_t>(T));
      std::vector<HeadOperand> q, dy;
      for (int64_t hh = 0; hh < group; ++hh) {
        const int64_t h = g * group + hh;
        q.push_back(head_operand(qkv + b * T * W + h * HD, W, T, HD, bf16));
        dy.push_back(head_operand(dout + b * T * NH * HD + h * HD, NH * HD, T, HD, bf16));
        for (int64_t t = 0; t < T; ++t) {
          const float* dyt = &dy[hh].rows[static_cast<size_t>(t * HD)];
          const float* o = out + (b * T + t) * NH * HD + h * HD;
          const float row_lse = lse[(b * NH + h) * T + t];
          float dsum = 0.0f;  // FP32 in increasing i on both backends (the CUDA twin: bitwise)
          for (int64_t i = 0; i < HD; ++i) dsum += dyt[i] * o[i];
          for (int64_t j = 0; j <= t; ++j) {
            const float s = dot_rows(bf16, q[static_cast<size_t>(hh)], t, k, j, HD);
            const float dp = dot_rows(bf16, dy[static_cast<size_t>(hh)], t, v, j, HD);
            const float p = std::exp(s * scale - row_lse);
            ds[j] = rnd(p * (dp - dsum));
            pbt[static_cast<size_t>((hh * T + j) * T + t)] = rnd(p);
            dsbt[static_cast<size_t>((hh * T + j) * T + t)] = ds[j];
          }
          // dq_t = scale * sum_j bf16(dS_tj) k_j
          float* dq = dqkv + (b * T + t) * W + h * HD;
          for (int64_t i = 0; i < HD; ++i) {
            const float* ki = &k.cols[static_cast<size_t>(i * T)];
            dq[i] = 0.0f + chain(
                               bf16, 0, t + 1, 0.0f, [&](int64_t j) { return ds[j]; },
                               [&](int64_t j) { return ki[j]; }) *
                               scale;
          }
        }
      }
      // dk_j = scale * sum_{h,t} bf16(dS_tj) q_t and dv_j = sum_{h,t} bf16(p_tj) dout_t: one chain
      // per head over t = j .. T-1 (chunks of 16 t from 0), heads in increasing order, continued
      for (int64_t j = 0; j < T; ++j) {
        float* dk = dqkv + (b * T + j) * W + (NH + g) * HD;
        float* dv = dqkv + (b * T + j) * W + (NH + NKV + g) * HD;
        for (int64_t i = 0; i < HD; ++i) {
          float sk = 0.0f, sv = 0.0f;
          for (int64_t hh = 0; hh < group; ++hh) {
            const float* ds_j = &dsbt[static_cast<size_t>((hh * T + j) * T)];
            const float* p_j = &pbt[static_cast<size_t>((hh * T + j) * T)];
            const float* qi = &q[static_cast<size_t>(hh)].cols[static_cast<size_t>(i * T)];
            const float* dyi = &dy[static_cast<size_t>(hh)].cols[static_cast<size_t>(i * T)];
            sk = chain(
                bf16, j, T, sk, [&](int64_t t) { return ds_j[t]; },
                [&](int64_t t) { return qi[t]; });
            sv = chain(
                bf16, j, T, sv, [&](int64_t t) { return p_j[t]; },
                [&](int64_t t) { return dyi[t]; });
          }
          dk[i] = 0.0f + sk * scale;
          dv[i] = 0.0f + sv;
        }
      }
    }
  }
}

namespace {
void rope_rotate(float* x, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HD, float base,
                 float sign) {
  const int64_t W = (NH + 2 * NKV) * HD;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < NH + NKV; ++h) {  // query heads, then key heads
        float* v = x + (b * T + t) * W + h * HD;
        for (int64_t i = 0; i < HD / 2; ++i) {
          const double freq = std::pow(static_cast<double>(base),
                                       -2.0 * static_cast<double>(i) / static_cast<double>(HD));
          const double ang = static_cast<double>(t) * freq;
          const float c = static_cast<float>(std::cos(ang)),
                      s = sign * static_cast<float>(std::sin(ang));
          const float x0 = v[2 * i], x1 = v[2 * i + 1];
          v[2 * i] = x0 * c - x1 * s;
          v[2 * i + 1] = x0 * s + x1 * c;
        }
      }
}
}  // namespace

void rope_forward(float* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HD,
                  float base) {
  rope_rotate(qkv, B, T, NH, NKV, HD, base, 1.0f);
}
void rope_backward(float* dqkv, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HD,
                   float base) {
  rope_rotate(dqkv, B, T, NH, NKV, HD, base, -1.0f);
}

}  // namespace fp4sim::emu

namespace fp4sim::emu {

void embedding_forward(float* out, const int32_t* tokens, const int32_t* pos, const float* wte,
                       const float* wpe, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < C; ++i)
      out[n * C + i] = wte[tokens[n] * C + i] + (wpe ? wpe[pos[n] * C + i] : 0.0f);
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                        const int32_t* pos, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < C; ++i) {
      dwte[tokens[n] * C + i] += dout[n * C + i];
      if (dwpe) dwpe[pos[n] * C + i] += dout[n * C + i];
    }
}

}  // namespace fp4sim::emu
