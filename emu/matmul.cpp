#include "emu/matmul.hpp"

#include <algorithm>
#include <vector>

#include "emu/bf16_operand.hpp"

namespace fp4sim::emu {

namespace {

// One output row of bf16_gemm_tn. Compiled also for x86-64-v4 (AVX-512: the 16 truncated terms of a
// chunk convert to int64 eight at a time) and v3 (AVX2), chosen at run time by the CPU; the
// arithmetic is exact in every version (products exact in double, truncation by the int64
// conversion, an int64 sum), so every version gives the same bits. No FMA can appear: the build
// has -ffp-contract=off.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void bf16_gemm_row(float* out_row, const Bf16Operand& A, const Bf16Operand& B, int64_t m,
                   int64_t N, int64_t Kp, int64_t chunks) {
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
    gemm_tn(dinp, dout, wt.data(), N, K, OC, prec);  // written, not added (emu/matmul.hpp)
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
