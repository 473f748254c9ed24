// Layer ops: every backward against central finite differences of its forward (in double over the
// FP32 forward), on random inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "emu/attention.hpp"
#include "emu/cross_entropy.hpp"
#include "emu/elementwise.hpp"
#include "emu/embedding.hpp"
#include "emu/formats.hpp"
#include "emu/matmul.hpp"
#include "emu/mma.hpp"
#include "emu/norm.hpp"

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
  layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), mean.data(),
                     rstd.data(), N, C);
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
      if (kind == 0)
        gelu_forward(out.data(), x.data(), n);
      else
        squared_relu_forward(out.data(), x.data(), n);
      double s = 0;
      for (int64_t i = 0; i < n; ++i) s += static_cast<double>(dout[i]) * out[i];
      return s;
    };
    std::vector<float> dx(n, 0.0f);
    if (kind == 0)
      gelu_backward(dx.data(), x.data(), dout.data(), n);
    else
      squared_relu_backward(dx.data(), x.data(), dout.data(), n);
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

// The activations' and attention's backward passes write their gradient (no zeroing before, no
// read of it): the bits do not depend on what the buffer held, and a product of -0 is stored as
// +0, the value adding it to a zeroed buffer gave.
TEST(Layers, BackwardPassesWriteTheirOutput) {
  auto bits = [](const std::vector<float>& v) {
    std::vector<uint32_t> b(v.size());
    std::memcpy(b.data(), v.data(), v.size() * 4);
    return b;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t N = 3, F = 40, n = N * F;
  std::vector<float> x = randn(n, 31, 2.0f), dout = randn(n, 32), x2 = randn(2 * n, 33, 2.0f);
  x[0] = 1.5f;
  dout[0] = -0.0f;  // local * -0 = -0 for gelu and squared ReLU at x > 0
  for (int kind = 0; kind < 3; ++kind) {
    const int64_t m = kind == 2 ? 2 * n : n;
    std::vector<float> zeroed(static_cast<size_t>(m), 0.0f), garbage(static_cast<size_t>(m), nan);
    for (std::vector<float>* d : {&zeroed, &garbage}) {
      if (kind == 0)
        gelu_backward(d->data(), x.data(), dout.data(), n);
      else if (kind == 1)
        squared_relu_backward(d->data(), x.data(), dout.data(), n);
      else
        swiglu_backward(d->data(), x2.data(), dout.data(), N, F);
    }
    EXPECT_EQ(bits(zeroed), bits(garbage)) << "activation backward " << kind;
    if (kind < 2) {
      EXPECT_EQ(bits(zeroed)[0], 0u) << "activation backward " << kind << ": -0 stored as +0";
    }
  }
  const int64_t B = 2, T = 7, NH = 4, NKV = 2, HD = 16, W = (NH + 2 * NKV) * HD;
  const std::vector<float> qkv = randn(B * T * W, 34), dy = randn(B * T * NH * HD, 35);
  std::vector<float> out(static_cast<size_t>(B * T * NH * HD)),
      lse(static_cast<size_t>(B * NH * T));
  attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, NKV, HD);
  std::vector<float> zeroed(qkv.size(), 0.0f), garbage(qkv.size(), nan);
  for (std::vector<float>* d : {&zeroed, &garbage})
    attention_backward(d->data(), dy.data(), qkv.data(), out.data(), lse.data(), B, T, NH, NKV, HD);
  EXPECT_EQ(bits(zeroed), bits(garbage)) << "attention backward";
}

TEST(Layers, CrossEntropyBackwardMatchesFiniteDifferences) {
  const int64_t N = 4, V = 50;
  std::vector<float> z = randn(N * V, 10, 3.0f), probs(N * V), losses(N);
  const std::vector<int32_t> targets = {3, 0, 49, 17};
  const std::vector<float> dlosses(N, 1.0f / N);
  auto loss = [&]() {
    crossentropy_softmax_forward(losses.data(), probs.data(), z.data(), targets.data(), N, V,
                                 false);
    double s = 0;
    for (int64_t n = 0; n < N; ++n) s += losses[n] / N;
    return s;
  };
  loss();
  std::vector<float> dz(N * V, 0.0f);
  crossentropy_softmax_backward(dz.data(), probs.data(), targets.data(), dlosses.data(), N, V,
                                false);
  check_grad("cross-entropy", z, dz, loss, 1e-3);
  // the gradient is written, not accumulated (whatever the output held is gone), and with
  // round_bf16 it is the same values rounded to BF16
  loss();  // probs of the unperturbed logits again (check_grad evaluated others)
  std::vector<float> over(N * V, std::nanf("")), rounded(N * V, 7.0f);
  crossentropy_softmax_backward(over.data(), probs.data(), targets.data(), dlosses.data(), N, V,
                                false);
  crossentropy_softmax_backward(rounded.data(), probs.data(), targets.data(), dlosses.data(), N, V,
                                true);
  for (int64_t i = 0; i < N * V; ++i) {
    const float want = (probs[i] - (i % V == targets[i / V] ? 1.0f : 0.0f)) * dlosses[i / V];
    ASSERT_EQ(f32_bits(over[i]), f32_bits(want)) << i;
    ASSERT_EQ(f32_bits(rounded[i]), f32_bits(bf16_round(want))) << i;
  }
  // the fused op: the forward's losses and the backward's gradient on its probabilities, bit for
  // bit (over an output that held something else); with round_bf16 on BF16-read logits, so against
  // the unfused ops on the logits rounded beforehand
  {
    std::vector<float> fl(N, -1.0f), fd(N * V, std::nanf(""));
    crossentropy_softmax_forward_backward(fl.data(), fd.data(), z.data(), targets.data(),
                                          dlosses.data(), N, V, false);
    for (int64_t n = 0; n < N; ++n) ASSERT_EQ(f32_bits(fl[n]), f32_bits(losses[n])) << n;
    for (int64_t i = 0; i < N * V; ++i) ASSERT_EQ(f32_bits(fd[i]), f32_bits(over[i])) << i;
  }
  {
    std::vector<float> zr(z), rl(N), rp(N * V), rd(N * V), fl(N, -1.0f), fd(N * V, std::nanf("")),
        bl(N), bp(N * V);
    for (float& v : zr) v = bf16_round(v);
    crossentropy_softmax_forward(rl.data(), rp.data(), zr.data(), targets.data(), N, V, false);
    crossentropy_softmax_backward(rd.data(), rp.data(), targets.data(), dlosses.data(), N, V, true);
    crossentropy_softmax_forward_backward(fl.data(), fd.data(), z.data(), targets.data(),
                                          dlosses.data(), N, V, true);
    crossentropy_softmax_forward(bl.data(), bp.data(), z.data(), targets.data(), N, V,
                                 true);  // bf16_logits
    for (int64_t n = 0; n < N; ++n) {
      ASSERT_EQ(f32_bits(fl[n]), f32_bits(rl[n])) << n;
      ASSERT_EQ(f32_bits(bl[n]), f32_bits(rl[n])) << n;
    }
    for (int64_t i = 0; i < N * V; ++i) {
      ASSERT_EQ(f32_bits(fd[i]), f32_bits(rd[i])) << i;
      ASSERT_EQ(f32_bits(bp[i]), f32_bits(rp[i])) << i;
    }
    bool differs = false;  // z (random FP32) is not BF16-exact, so the rounding really happened
    for (int64_t n = 0; n < N; ++n) differs = differs || fl[n] != losses[n];
    EXPECT_TRUE(differs);
  }
  // uniform logits: loss = log V
  std::vector<float> flat(V, 0.5f), p(V);
  float l;
  const int32_t t = 7;
  crossentropy_softmax_forward(&l, p.data(), flat.data(), &t, 1, V, false);
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
        const double p = static_cast<double>(fp4sim::bf16_round(x[m * K + k])) *
                         fp4sim::bf16_round(y[n * K + k]);
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
    for (auto& v : a)
      v = std::ldexp(nd(rng), static_cast<int>(rng() % (trial * 20 + 2)) - trial * 10);
    for (auto& v : b)
      v = std::ldexp(nd(rng), static_cast<int>(rng() % (trial * 20 + 2)) - trial * 10);
    if (trial == 4) {
      a[5] = INFINITY;
      b[40] = -INFINITY;
    }
    if (trial == 5) {
      a[7] = NAN;
      for (int64_t k = 0; k < K; ++k) b[3 * K + k] = 0.0f;
    }
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
  // dx starts as NaN: matmul_backward writes it (dw and db start at zero and are added to)
  std::vector<float> y(N * OC), dx(N * K, std::numeric_limits<float>::quiet_NaN()),
      dw(OC * K, 0.0f), db(OC, 0.0f);
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
  EXPECT_EQ(y[0] - 0.5f, [&] {
    double s = 0;
    for (int64_t k = 0; k < K; ++k) s += x[k] * w[k];
    return static_cast<float>(s);
  }());
}

}  // namespace
}  // namespace fp4sim::emu

namespace fp4sim::emu {
namespace {

// ---- attention ----------------------------------------------------------------------------------

struct AttnShape {
  int64_t B, T, NH, NKV, HD;
};

// The attention contract (emu/layers.hpp) in double without the roundings of P and dS: q, k, v,
// dout rounded to BF16 as the contract says (with `bf16`), everything after that exact up to
// double rounding. mag_* is the sum of the absolute values of the terms of each element, the
// scale of its rounding error.
struct AttnReference {
  std::vector<double> out, lse, out_mag;  // forward: (B,T,NH*HD), (B,NH,T), (B,T,NH*HD)
  std::vector<double> dqkv, dqkv_mag;     // backward: (B,T,(NH+2NKV)*HD), from 0
};

AttnReference attention_reference(const AttnShape& sh, const std::vector<float>& qkv, bool bf16,
                                  const std::vector<float>* dout = nullptr,
                                  const std::vector<float>* out = nullptr,
                                  const std::vector<float>* lse = nullptr) {
  const int64_t B = sh.B, T = sh.T, NH = sh.NH, NKV = sh.NKV, HD = sh.HD;
  const int64_t W = (NH + 2 * NKV) * HD, C = NH * HD;
  const double scale = 1.0f / std::sqrt(static_cast<float>(HD));  // the FP32 scale, as the contract
  auto rnd = [bf16](float x) { return static_cast<double>(bf16 ? fp4sim::bf16_round(x) : x); };
  auto q = [&](int64_t b, int64_t t, int64_t h, int64_t i) {
    return rnd(qkv[(b * T + t) * W + h * HD + i]);
  };
  auto k = [&](int64_t b, int64_t t, int64_t g, int64_t i) {
    return rnd(qkv[(b * T + t) * W + (NH + g) * HD + i]);
  };
  auto v = [&](int64_t b, int64_t t, int64_t g, int64_t i) {
    return rnd(qkv[(b * T + t) * W + (NH + NKV + g) * HD + i]);
  };
  AttnReference r;
  r.out.assign(B * T * C, 0.0);
  r.out_mag.assign(B * T * C, 0.0);
  r.lse.assign(B * NH * T, 0.0);
  if (dout) {
    r.dqkv.assign(B * T * W, 0.0);
    r.dqkv_mag.assign(B * T * W, 0.0);
  }
  std::vector<double> s(T), p(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h) {
      const int64_t g = h / (NH / NKV);
      for (int64_t t = 0; t < T; ++t) {
        double m = -INFINITY;
        for (int64_t j = 0; j <= t; ++j) {
          s[j] = 0;
          for (int64_t i = 0; i < HD; ++i) s[j] += q(b, t, h, i) * k(b, j, g, i);
          s[j] *= scale;
          m = std::max(m, s[j]);
        }
        double l = 0;
        for (int64_t j = 0; j <= t; ++j) l += std::exp(s[j] - m);
        const int64_t row = (b * NH + h) * T + t;
        r.lse[row] = m + std::log(l);
        for (int64_t j = 0; j <= t; ++j) p[j] = std::exp(s[j] - m) / l;
        for (int64_t i = 0; i < HD; ++i)
          for (int64_t j = 0; j <= t; ++j) {
            r.out[(b * T + t) * C + h * HD + i] += p[j] * v(b, j, g, i);
            r.out_mag[(b * T + t) * C + h * HD + i] += p[j] * std::fabs(v(b, j, g, i));
          }
        if (!dout) continue;
        // backward from the given out and lse, as the contract: p = exp(s - lse)
        const float* dy = dout->data() + (b * T + t) * C + h * HD;
        const float* o = out->data() + (b * T + t) * C + h * HD;
        double dsum = 0, dsum_mag = 0;
        for (int64_t i = 0; i < HD; ++i) {
          dsum += rnd(dy[i]) * o[i];
          dsum_mag += std::fabs(rnd(dy[i]) * o[i]);
        }
        for (int64_t j = 0; j <= t; ++j) {
          const double pj = std::exp(s[j] - static_cast<double>((*lse)[row]));
          double dp = 0, dp_mag = 0;
          for (int64_t i = 0; i < HD; ++i) {
            dp += rnd(dy[i]) * v(b, j, g, i);
            dp_mag += std::fabs(rnd(dy[i]) * v(b, j, g, i));
          }
          const double ds = pj * (dp - dsum), ds_mag = pj * (dp_mag + dsum_mag);
          for (int64_t i = 0; i < HD; ++i) {
            const int64_t iq = (b * T + t) * W + h * HD + i,
                          ik = (b * T + j) * W + (NH + g) * HD + i,
                          iv = (b * T + j) * W + (NH + NKV + g) * HD + i;
            r.dqkv[iq] += scale * ds * k(b, j, g, i);
            r.dqkv_mag[iq] += scale * ds_mag * std::fabs(k(b, j, g, i));
            r.dqkv[ik] += scale * ds * q(b, t, h, i);
            r.dqkv_mag[ik] += scale * ds_mag * std::fabs(q(b, t, h, i));
            r.dqkv[iv] += pj * rnd(dy[i]);
            r.dqkv_mag[iv] += pj * std::fabs(rnd(dy[i]));
          }
        }
      }
    }
  return r;
}

// |got - ref| <= rtol * mag everywhere; prints the worst element and its share of the budget.
void expect_within(const char* what, const std::vector<float>& got, const std::vector<double>& ref,
                   const std::vector<double>& mag, double rtol) {
  ASSERT_EQ(got.size(), ref.size());
  size_t worst = 0, bad = 0;
  double worst_frac = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - ref[i]), budget = rtol * mag[i];
    const double frac = err == 0 ? 0 : (budget > 0 ? err / budget : INFINITY);
    if (!(frac <= 1)) ++bad;
    if (!(frac <= worst_frac)) {
      worst_frac = frac;
      worst = i;
    }
  }
  std::printf("[attention] %-40s worst at %zu: %+.9e vs %+.9e, %.1f%% of budget (rtol %.3g)\n",
              what, worst, got[worst], ref[worst], 100 * worst_frac, rtol);
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements outside " << rtol
                     << " * mag; worst " << got[worst] << " vs " << ref[worst] << " (mag "
                     << mag[worst] << ")";
}

// The rounding of P and dS to BF16 (RNE, 8 significant bits) moves each term by at most 2^-8 of
// itself: out, dq, dk, dv stay within 2^-8 of the sum of their terms' magnitudes from the
// unrounded formula (a missing or doubled rounding, a wrong scale or mask, shows far above). The
// FP32 arithmetic around it (HD-term dot products, row sums over <= 70 keys, exp/log within 1 ulp)
// adds less than 2^-14 of the same magnitude at these sizes: the FP32 mode checks that part alone.
constexpr double kBf16TermRtol = 0x1p-8;
constexpr double kFp32Rtol = 0x1p-14;

const AttnShape kEmuAttnShapes[] = {
    {2, 37, 6, 2, 24},  // GQA, group of 3
    {1, 70, 4, 4, 64},  // MHA, more than one 64-key tile
    {2, 5, 3, 1, 7},    // MQA, odd head size
    {1, 1, 2, 1, 4},    // one position
};

std::string shape_tag(const AttnShape& s) {
  return " B" + std::to_string(s.B) + " T" + std::to_string(s.T) + " NH" + std::to_string(s.NH) +
         " NKV" + std::to_string(s.NKV) + " HD" + std::to_string(s.HD);
}

// The FlashAttention-form forward against a direct softmax: the FP32 mode within FP32 rounding, the
// BF16 mode within the P rounding (and not equal to the FP32 mode: the rounding is really there);
// lse has no BF16 rounding in it, so it is within FP32 rounding in both modes.
// The scores and the PV sums are T-FDPA chains (DESIGN.md §8), not FP32 sums: 1 + 15 products of
// 2^-24 keeps the small terms inside the 25-bit window (RZ to 1 + 7 * 2^-23), where an FP32
// sequential sum loses each of them (1 + 2^-24 rounds to 1).
TEST(Layers, AttentionSumsAreTfdpaChains) {
  const int64_t HD = 16, W = 3 * HD;
  const float tiny = std::ldexp(1.0f, -12);  // a BF16 value; tiny * tiny = 2^-24
  const float chained = 1.0f + 7.0f * std::ldexp(1.0f, -23);
  // scores: T = 1, so lse = m + log(1) = s_0 = chain(q, k) * (1/sqrt(16)) exactly
  {
    std::vector<float> qkv(static_cast<size_t>(W), 0.0f), out(static_cast<size_t>(HD)), lse(1);
    for (int64_t i = 0; i < HD; ++i) qkv[i] = qkv[HD + i] = i == 0 ? 1.0f : tiny;
    attention_forward(out.data(), lse.data(), qkv.data(), 1, 1, 1, 1, HD);
    EXPECT_EQ(f32_bits(lse[0]), f32_bits(chained * 0.25f)) << lse[0];
  }
  // PV: 16 equal keys, so every p_j = 1 and l = 16 at t = 15; v_0 = 1, v_j = 2^-24 for j > 0
  {
    const int64_t T = 16;
    std::vector<float> qkv(static_cast<size_t>(T * W), 0.0f), out(static_cast<size_t>(T * HD)),
        lse(T);
    for (int64_t j = 0; j < T; ++j) qkv[j * W + 2 * HD] = j == 0 ? 1.0f : tiny * tiny;
    attention_forward(out.data(), lse.data(), qkv.data(), 1, T, 1, 1, HD);
    EXPECT_EQ(f32_bits(out[(T - 1) * HD]), f32_bits(chained / 16.0f)) << out[(T - 1) * HD];
  }
}

TEST(Layers, AttentionForwardMatchesSoftmaxReference) {
  uint64_t seed = 40;
  for (const AttnShape& sh : kEmuAttnShapes) {
    const int64_t W = (sh.NH + 2 * sh.NKV) * sh.HD;
    const std::vector<float> qkv = randn(sh.B * sh.T * W, ++seed, 1.5f);
    for (const GemmPrecision prec : {GemmPrecision::FP32, GemmPrecision::BF16}) {
      const bool bf16 = prec == GemmPrecision::BF16;
      const std::string tag = std::string(bf16 ? "bf16" : "fp32") + shape_tag(sh);
      std::vector<float> out(sh.B * sh.T * sh.NH * sh.HD, NAN), lse(sh.B * sh.NH * sh.T, NAN);
      attention_forward(out.data(), lse.data(), qkv.data(), sh.B, sh.T, sh.NH, sh.NKV, sh.HD, prec);
      const AttnReference ref = attention_reference(sh, qkv, bf16);
      expect_within(("out " + tag).c_str(), out, ref.out, ref.out_mag,
                    bf16 ? kBf16TermRtol + kFp32Rtol : kFp32Rtol);
      std::vector<double> lse_mag(lse.size());
      for (size_t i = 0; i < lse.size(); ++i) lse_mag[i] = std::fabs(ref.lse[i]) + 1.0;
      expect_within(("lse " + tag).c_str(), lse, ref.lse, lse_mag, kFp32Rtol);
      // row 0 attends to key 0 alone: p = 1 exactly, out = v_0 (its operand rounding)
      for (int64_t h = 0; h < sh.NH; ++h)
        for (int64_t i = 0; i < sh.HD; ++i) {
          const float v0 = qkv[(sh.NH + sh.NKV + h / (sh.NH / sh.NKV)) * sh.HD + i];
          EXPECT_EQ(out[h * sh.HD + i], bf16 ? fp4sim::bf16_round(v0) : v0) << tag;
        }
    }
    std::vector<float> o32(sh.B * sh.T * sh.NH * sh.HD), o16(o32.size()), l(sh.B * sh.NH * sh.T);
    attention_forward(o32.data(), l.data(), qkv.data(), sh.B, sh.T, sh.NH, sh.NKV, sh.HD,
                      GemmPrecision::FP32);
    attention_forward(o16.data(), l.data(), qkv.data(), sh.B, sh.T, sh.NH, sh.NKV, sh.HD,
                      GemmPrecision::BF16);
    if (sh.T > 1) {
      EXPECT_NE(o32, o16) << shape_tag(sh);
    }
  }
}

// The backward formula is the gradient: the FP32 mode (no BF16 rounding, so the forward is smooth)
// against central finite differences of its forward.
TEST(Layers, AttentionBackwardMatchesFiniteDifferences_Gqa) {
  const int64_t B = 2, T = 5, NH = 4, NKV = 2, HD = 8, W = (NH + 2 * NKV) * HD;
  std::vector<float> qkv = randn(B * T * W, 11), dout = randn(B * T * NH * HD, 12);
  std::vector<float> out(B * T * NH * HD), lse(B * NH * T);
  auto loss = [&]() {
    attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, NKV, HD, GemmPrecision::FP32);
    double s = 0;
    for (size_t i = 0; i < out.size(); ++i) s += static_cast<double>(dout[i]) * out[i];
    return s;
  };
  loss();
  std::vector<float> dqkv(qkv.size(), 0.0f);
  attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, NH, NKV,
                     HD, GemmPrecision::FP32);
  check_grad("attention dqkv", qkv, dqkv, loss, 1e-3);
}

// The BF16 backward against the same formula in double without the P and dS roundings, from the
// emulator's out and lse, written over a dqkv of random values (none of which may survive); the
// FP32 mode within FP32 rounding.
TEST(Layers, AttentionBackwardMatchesDoubleReference) {
  uint64_t seed = 60;
  for (const AttnShape& sh : kEmuAttnShapes) {
    const int64_t W = (sh.NH + 2 * sh.NKV) * sh.HD, C = sh.NH * sh.HD;
    const std::vector<float> qkv = randn(sh.B * sh.T * W, ++seed, 1.5f),
                             dout = randn(sh.B * sh.T * C, ++seed);
    const std::vector<float> dqkv0 = randn(qkv.size(), ++seed);
    for (const GemmPrecision prec : {GemmPrecision::FP32, GemmPrecision::BF16}) {
      const bool bf16 = prec == GemmPrecision::BF16;
      const std::string tag = std::string(bf16 ? "bf16" : "fp32") + shape_tag(sh);
      std::vector<float> out(sh.B * sh.T * C), lse(sh.B * sh.NH * sh.T), dqkv = dqkv0;
      attention_forward(out.data(), lse.data(), qkv.data(), sh.B, sh.T, sh.NH, sh.NKV, sh.HD, prec);
      attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), sh.B, sh.T,
                         sh.NH, sh.NKV, sh.HD, prec);
      AttnReference ref = attention_reference(sh, qkv, bf16, &dout, &out, &lse);
      const double rtol = bf16 ? kBf16TermRtol + kFp32Rtol : kFp32Rtol;
      expect_within(("dqkv " + tag).c_str(), dqkv, ref.dqkv, ref.dqkv_mag, rtol);
    }
  }
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
