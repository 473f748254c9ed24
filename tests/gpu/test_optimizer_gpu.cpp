// Muon and ROOT on the GPU (DESIGN.md §13): the optimizers' Backend ops bitwise equal on both
// backends; Newton–Schulz with NVFP4 products and exact GEMMs bitwise equal to the emulator (the
// whole NS5 result), FP32 / BF16 / cuBLASLt NVFP4 within printed budgets; Muon and ROOT training
// on CUDA against the emulator. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "model/optimizer.hpp"
#include "tests/gpu/gpu_test_util.hpp"
#include "tests/model/ns_matrices.hpp"
#include "tools/backends.hpp"

namespace fp4sim::model {
namespace {

using Vec = std::vector<float>;

#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU"

Vec randn(size_t n, uint64_t seed, float scale = 1.0f) { return ns_randn(n, seed, scale); }

// A float32 tensor in a backend's memory, filled from the host.
struct Dev {
  Backend& be;
  BackendBuffer buf;
  int64_t rows, cols;
  Dev(Backend& b, const Vec& host, int64_t r, int64_t c)
      : be(b), buf(b, std::max<size_t>(host.size(), 1) * 4), rows(r), cols(c) {
    if (!host.empty()) be.upload(buf.get(), host.data(), host.size() * 4);
  }
  TensorView view(const char* name = "x") const {
    return view_of(buf.get(), DType::F32, rows, cols, be.device(), name);
  }
  Vec host() const {
    Vec v(static_cast<size_t>(rows * cols));
    if (!v.empty()) be.download(v.data(), buf.get(), v.size() * 4);
    return v;
  }
};

// The first element whose bits differ; every NaN counts as equal to every NaN (a NaN input's
// payload and sign after an arithmetic op are the hardware's: CPUs and GPUs differ there).
size_t first_difference(const Vec& a, const Vec& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], 4) != 0 && !(std::isnan(a[i]) && std::isnan(b[i]))) return i;
  return a.size();
}

TEST(OptimizerGpu, OpsBitwiseEqualTheEmulator) {
  REQUIRE_GPU();
  auto emu = make_backend("emu"), cuda = make_backend("cuda");
  for (const auto& [R, C] : {std::pair<int64_t, int64_t>{1, 1}, {37, 70}, {300, 1029}}) {
    Vec x = randn(static_cast<size_t>(R * C), 1 + R, 3.0f), y = randn(x.size(), 2 + R);
    x[0] = std::numeric_limits<float>::infinity();
    if (x.size() > 5) x[5] = std::numeric_limits<float>::quiet_NaN();
    if (x.size() > 6) x[6] = 1e-41f;  // subnormal
    Vec got[2][3];
    float norm[2], q[2][3];
    Backend* bs[2] = {emu.get(), cuda.get()};
    for (int b = 0; b < 2; ++b) {
      Backend& be = *bs[b];
      Dev dx(be, x, R, C), dy(be, y, R, C), out(be, Vec(x.size()), R, C),
          t(be, Vec(x.size()), C, R);
      be.axpby(out.view(), 0.7f, dx.view(), -1.3f, dy.view());
      got[b][0] = out.host();
      be.transpose(t.view(), dx.view());
      got[b][1] = t.host();
      be.clamp(out.view(), dx.view(), 1.5f);
      got[b][2] = out.host();
      Dev finite(be, y, R, C);
      norm[b] = be.frobenius_norm(finite.view());
      int k = 0;
      for (const double qq : {0.0, 0.9, 0.99}) q[b][k++] = be.abs_quantile(dy.view(), qq);
    }
    for (int op = 0; op < 3; ++op)
      EXPECT_EQ(first_difference(got[0][op], got[1][op]), got[0][op].size())
          << R << "x" << C << " op " << op;
    EXPECT_EQ(std::memcmp(&norm[0], &norm[1], 4), 0)
        << R << "x" << C << ": " << norm[0] << " vs " << norm[1];
    for (int k = 0; k < 3; ++k) EXPECT_EQ(std::memcmp(&q[0][k], &q[1][k], 4), 0) << R << "x" << C;
  }
}

Vec ns_on(Backend& be, const Vec& g, int64_t R, int64_t C, const NsOptions& o) {
  Dev d(be, g, R, C);
  NewtonSchulz ns(be, std::min(R, C), R * C, o.precision);
  ns.run(d.view("g"), d.view("g"), o);
  return d.host();
}

double rel(const Vec& x, const Vec& ref) {
  double d = 0, r = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    d += (static_cast<double>(x[i]) - ref[i]) * (static_cast<double>(x[i]) - ref[i]);
    r += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(d / r);
}

// Q-Root with exact GEMMs: the whole NS5 result bitwise, wide and tall, clipped or not, Muon's and
// a ROOT table's coefficients.
TEST(OptimizerGpu, Nvfp4NewtonSchulzBitwiseEqualsTheEmulator) {
  REQUIRE_GPU();
  auto emu = make_backend("emu"), cuda = make_backend("cuda");
  for (const auto& [R, C] : {std::pair<int64_t, int64_t>{64, 192}, {96, 48}, {256, 256}})
    for (const double clip : {1.0, 0.99}) {
      const Vec g = momentum_like(R, C, 5 + R);
      NsOptions o;
      o.precision = NsPrecision::NVFP4;
      o.clip_quantile = clip;
      if (R == 256) o.coef = *root_table_coefficients(2048, 2048);
      const Vec e = ns_on(*emu, g, R, C, o), c = ns_on(*cuda, g, R, C, o);
      EXPECT_EQ(first_difference(e, c), e.size()) << R << "x" << C << " clip " << clip;
      std::printf("[optimizer-gpu] NS5 nvfp4 exact %dx%d clip %.2f: emu == cuda %s\n",
                  static_cast<int>(R), static_cast<int>(C), clip,
                  first_difference(e, c) == e.size() ? "bitwise" : "DIFFERS");
    }
}

// FP32 (cuBLASLt FP32, other summation orders), BF16 (cuBLASLt BF16 against T-FDPA) and NVFP4
// through cuBLASLt against the emulator's same-precision result, one and five iterations.
TEST(OptimizerGpu, NewtonSchulzWithinBoundsOfTheEmulator) {
  REQUIRE_GPU();
  auto emu = make_backend("emu"), cuda = make_backend("cuda");
  const int64_t R = 256, C = 768;
  const Vec g = momentum_like(R, C, 77);
  struct Case {
    const char* name;
    NsPrecision p;
    GemmImpl impl;
    double budget1, budget5;
  };
  for (const Case& k : {Case{"fp32", NsPrecision::FP32, GemmImpl::Exact, 1e-5, 1e-4},
                        Case{"bf16", NsPrecision::BF16, GemmImpl::Exact, 1e-2, 5e-2},
                        Case{"nvfp4 cublaslt", NsPrecision::NVFP4, GemmImpl::CublasLt, 5e-2, 1.0}})
    for (const int its : {1, 5}) {
      NsOptions oe, oc;
      oe.precision = oc.precision = k.p;
      oe.iterations = oc.iterations = its;
      oc.impl = k.impl;
      const double e = rel(ns_on(*cuda, g, R, C, oc), ns_on(*emu, g, R, C, oe));
      const double budget = its == 1 ? k.budget1 : k.budget5;
      std::printf("[optimizer-gpu] NS%d %dx%d %s: cuda vs emu rel. difference %.3e (budget %.0e)\n",
                  its, static_cast<int>(R), static_cast<int>(C), k.name, e, budget);
      EXPECT_LT(e, budget) << k.name << " NS" << its;
    }
}

}  // namespace
}  // namespace fp4sim::model
