// Layer ops: every backward against central finite differences of its forward (in double over the
// FP32 forward), on random inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "emu/formats.hpp"
#include "emu/mma.hpp"

#include <cstring>
#include "emu/layers.hpp"

namespace fp4sim::emu {
namespace {

std::vector<float> randn(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Checks analytic gradient `grad` of scalar loss(x) = sum(dout * f(x)) against finite differences.
void check_grad(const char* what, std::vector<float>& x, const std::vector<float>& grad,
                const std::function<double()>& loss, double tol) {
  double worst = 0;
  for (size_t i = 0; i < x.size(); i += 1 + x.size() / 97) {
    const float keep = x[i];
    const float h = 1e-2f * std::max(1.0f, std::fabs(keep));
    x[i] = keep + h;
    const double up = loss();
    x[i] = keep - h;
    const double dn = loss();
    x[i] = keep;
    const double fd = (up - dn) / (2.0 * h);
    const double err = std::fabs(fd - grad[i]) / std::max(1.0, std::fabs(fd));
    worst = std::max(worst, err);
  }
  EXPECT_LT(worst, tol) << what << ": worst relative gradient error " << worst;
}

TEST(Layers, LayerNormBackwardMatchesFiniteDifferences) {
  const int64_t N = 6, C = 32;
  std::vector<float> x = randn(N * C, 1), w = randn(C, 2), b = randn(C, 3), dout = randn(N * C, 4);
  std::vector<float> out(N * C), mean(N), rstd(N);
  auto loss = [&]() {
    layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
    double s = 0;
    for (int64_t i = 0; i < N * C; ++i) s += static_cast<double>(dout[i]) * out[i];
    return s;
  };
  loss();
  std::vector<float> dx(N * C, 0.0f), dw(C, 0.0f), db(C, 0.0f);
  layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C);
  check_grad("layernorm dx", x, dx, loss, 1e-3);
  check_grad("layernorm dw", w, dw, loss, 1e-3);
  check_grad("layernorm db", b, db, loss, 1e-3);
}

TEST(Layers, RmsNormBackwardMatchesFiniteDifferences) {
  const int64_t N = 5, C = 24;
  std::vector<float> x = randn(N * C, 5), w = randn(C, 6), dout = randn(N * C, 7);
  std::vector<float> out(N * C), rstd(N);
  auto loss = [&]() {
    rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C);
    double s = 0;
    for (int64_t i = 0; i < N * C; ++i) s += static_cast<double>(dout[i]) * out[i];
    return s;
  };
  loss();
  std::vector<float> dx(N * C, 0.0f), dw(C, 0.0f);
  rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);
  check_grad("rmsnorm dx", x, dx, loss, 1e-3);
  check_grad("rmsnorm dw", w, dw, loss, 1e-3);
}

TEST(Layers, ActivationsBackwardMatchFiniteDifferences) {
  const int64_t n = 200;
  std::vector<float> x = randn(n, 8, 2.0f), dout = randn(n, 9), out(n);
  for (int kind = 0; kind < 2; ++kind) {
    auto loss = [&]() {
      if (kind == 0) gelu_forward(out.data(), x.data(), n);
      else squared_relu_forward(out.data(), x.data(), n);
      double s = 0;
      for (int64_t i = 0; i < n; ++i) s += static_cast<double>(dout[i]) * out[i];
      return s;
    };
    std::vector<float> dx(n, 0.0f);
    if (kind == 0) gelu_backward(dx.data(), x.data(), dout.data(), n);
    else squared_relu_backward(dx.data(), x.data(), dout.data(), n);
    check_grad(kind == 0 ? "gelu" : "squared_relu", x, dx, loss, 1e-3);
  }
  // gelu(x) at known points
  const float pts[3] = {0.0f, 1.0f, -1.0f};
  float o[3];
  gelu_forward(o, pts, 3);
  EXPECT_EQ(o[0], 0.0f);
  EXPECT_NEAR(o[1], 0.841192f, 1e-5);
  EXPECT_NEAR(o[2], -0.158808f, 1e-5);
}

TEST(Layers, CrossEntropyBackwardMatchesFiniteDifferences) {
  const int64_t N = 4, V = 50;
  std::vector<float> z = randn(N * V, 10, 3.0f), probs(N * V), losses(N);
  const std::vector<int32_t> targets = {3, 0, 49, 17};
  const std::vector<float> dlosses(N, 1.0f / N);
  auto loss = [&]() {
    crossentropy_softmax_forward(losses.data(), probs.data(), z.data(), targets.data(), N, V);
    double s = 0;
    for (int64_t n = 0; n < N; ++n) s += losses[n] / N;
    return s;
  };
  loss();
  std::vector<float> dz(N * V, 0.0f);
  crossentropy_softmax_backward(dz.data(), probs.data(), targets.data(), dlosses.data(), N, V);
  check_grad("cross-entropy", z, dz, loss, 1e-3);
  // uniform logits: loss = log V
  std::vector<float> flat(V, 0.5f), p(V);
  float l;
  const int32_t t = 7;
  crossentropy_softmax_forward(&l, p.data(), flat.data(), &t, 1, V);
  EXPECT_NEAR(l, std::log(50.0f), 1e-5);
}

}  // namespace
}  // namespace fp4sim::emu

namespace fp4sim::emu {
namespace {

TEST(Layers, Bf16GemmIsExactOnSmallIntegersAndCloseOtherwise) {
  const int64_t M = 5, N = 7, K = 40;  // K not a multiple of 16: zero padding
  std::vector<float> a(M * K), b(N * K), out(M * N);
  std::mt19937 rng(3);
  for (auto& v : a) v = static_cast<float>(static_cast<int>(rng() % 9) - 4);
  for (auto& v : b) v = static_cast<float>(static_cast<int>(rng() % 9) - 4);
  bf16_gemm_tn(out.data(), a.data(), b.data(), M, N, K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += static_cast<double>(a[m * K + k]) * b[n * K + k];
      EXPECT_EQ(out[m * N + n], static_cast<float>(s));
    }
  // random values: within the RZ/truncation error of the chain (a few ulps of sum |a||b|)
  std::vector<float> x = randn(M * K, 4), y = randn(N * K, 5);
  bf16_gemm_tn(out.data(), x.data(), y.data(), M, N, K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = static_cast<double>(fp4sim::bf16_round(x[m * K + k])) * fp4sim::bf16_round(y[n * K + k]);
        s += p;
        mag += std::fabs(p);
      }
      EXPECT_LE(std::fabs(out[m * N + n] - s), 8 * 1.2e-7 * mag);
    }
}

// The prepared-operand GEMM against the literal per-output chain of tfdpa_bf16.
TEST(Layers, Bf16GemmEqualsLiteralChain) {
  const int64_t M = 9, N = 11, K = 72;
  std::mt19937_64 rng(17);
  for (int trial = 0; trial < 6; ++trial) {
    std::vector<float> a(M * K), b(N * K), out(M * N);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& v : a) v = std::ldexp(nd(rng), static_cast<int>(rng() % (trial * 20 + 2)) - trial * 10);
    for (auto& v : b) v = std::ldexp(nd(rng), static_cast<int>(rng() % (trial * 20 + 2)) - trial * 10);
    if (trial == 4) { a[5] = INFINITY; b[40] = -INFINITY; }
    if (trial == 5) { a[7] = NAN; for (int64_t k = 0; k < K; ++k) b[3 * K + k] = 0.0f; }
    bf16_gemm_tn(out.data(), a.data(), b.data(), M, N, K);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        float acc = 0.0f;
        for (int64_t k0 = 0; k0 < 80; k0 += 16) {
          float x[16] = {}, y[16] = {};
          for (int i = 0; i < 16 && k0 + i < K; ++i) {
            x[i] = fp4sim::bf16_round(a[m * K + k0 + i]);
            y[i] = fp4sim::bf16_round(b[n * K + k0 + i]);
          }
          acc = fp4sim::tfdpa_bf16(x, y, acc);
        }
        uint32_t g, w;
        std::memcpy(&g, &out[m * N + n], 4);
        std::memcpy(&w, &acc, 4);
        ASSERT_EQ(g, w) << "trial " << trial << " (" << m << "," << n << ")";
      }
  }
}

TEST(Layers, MatmulBackwardIsTheTransposedGemms) {
  // exact on small integers: dinp = dout W, dW = dout^T inp, dbias = column sums
  const int64_t N = 3, K = 20, OC = 4;
  std::vector<float> x(N * K), w(OC * K), bias(OC, 0.5f), dout(N * OC);
  std::mt19937 rng(9);
  for (auto& v : x) v = static_cast<float>(static_cast<int>(rng() % 5) - 2);
  for (auto& v : w) v = static_cast<float>(static_cast<int>(rng() % 5) - 2);
  for (auto& v : dout) v = static_cast<float>(static_cast<int>(rng() % 5) - 2);
  std::vector<float> y(N * OC), dx(N * K, 0.0f), dw(OC * K, 0.0f), db(OC, 0.0f);
  matmul_forward(y.data(), x.data(), w.data(), bias.data(), N, K, OC);
  matmul_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), N, K, OC);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      double s = 0;
      for (int64_t o = 0; o < OC; ++o) s += dout[n * OC + o] * w[o * K + k];
      EXPECT_EQ(dx[n * K + k], static_cast<float>(s));
    }
  for (int64_t o = 0; o < OC; ++o) {
    double sb = 0;
    for (int64_t n = 0; n < N; ++n) sb += dout[n * OC + o];
    EXPECT_EQ(db[o], static_cast<float>(sb));
    for (int64_t k = 0; k < K; ++k) {
      double s = 0;
      for (int64_t n = 0; n < N; ++n) s += dout[n * OC + o] * x[n * K + k];
      EXPECT_EQ(dw[o * K + k], static_cast<float>(s));
    }
  }
  EXPECT_EQ(y[0] - 0.5f, [&] { double s = 0; for (int64_t k = 0; k < K; ++k) s += x[k] * w[k]; return static_cast<float>(s); }());
}

}  // namespace
}  // namespace fp4sim::emu

namespace fp4sim::emu {
namespace {

TEST(Layers, AttentionBackwardMatchesFiniteDifferences_Gqa) {
  const int64_t B = 2, T = 5, NH = 4, NKV = 2, HD = 8, W = (NH + 2 * NKV) * HD;
  std::vector<float> qkv = randn(B * T * W, 11), dout = randn(B * T * NH * HD, 12);
  std::vector<float> out(B * T * NH * HD), att(B * NH * T * T);
  auto loss = [&]() {
    attention_forward(out.data(), att.data(), qkv.data(), B, T, NH, NKV, HD);
    double s = 0;
    for (size_t i = 0; i < out.size(); ++i) s += static_cast<double>(dout[i]) * out[i];
    return s;
  };
  loss();
  // causal: the first position attends only to itself
  EXPECT_EQ(att[0], 1.0f);
  EXPECT_EQ(att[1], 0.0f);
  std::vector<float> dqkv(qkv.size(), 0.0f);
  attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, NH, NKV, HD);
  check_grad("attention dqkv", qkv, dqkv, loss, 1e-3);
}

TEST(Layers, RopeRotatesAndUnrotates) {
  const int64_t B = 1, T = 6, NH = 2, NKV = 1, HD = 8, W = (NH + 2 * NKV) * HD;
  std::vector<float> x = randn(B * T * W, 13), y = x;
  rope_forward(y.data(), B, T, NH, NKV, HD);
  for (int64_t i = 0; i < W; ++i) EXPECT_EQ(y[i], x[i]);  // position 0: no rotation
  // norms of each rotated pair are kept; values (last NKV heads) untouched
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < (NH + NKV) * HD; i += 2) {
      const float* a = &x[t * W + i];
      const float* b = &y[t * W + i];
      EXPECT_NEAR(a[0] * a[0] + a[1] * a[1], b[0] * b[0] + b[1] * b[1], 1e-4);
    }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = (NH + NKV) * HD; i < W; ++i) EXPECT_EQ(y[t * W + i], x[t * W + i]);
  rope_backward(y.data(), B, T, NH, NKV, HD);  // the transpose of a rotation is its inverse
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i], x[i], 1e-5);
}

}  // namespace
}  // namespace fp4sim::emu
