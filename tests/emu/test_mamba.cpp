// The Mamba-2 mixer's high-precision ops (emu/ssm.hpp): each forward pass against an independent
// FP64 implementation kept here (ref::), each backward pass and the whole chain (conv -> split ->
// softplus -> scan -> gated norm) against FP64 central differences of that implementation over
// every element of every input and parameter; the scan's groups, its saved-state interval, and
// the write / accumulate rules of the gradients.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "emu/cpu_backend.hpp"
#include "emu/formats.hpp"
#include "emu/ssm.hpp"
#include "emu/ssm_math.hpp"
#include "tests/emu/ssm_chain.hpp"
#include "tests/emu/test_util.hpp"
#include "tests/model/expect_error.hpp"

namespace fp4sim::emu {
namespace {

using Vec = std::vector<float>;
using DVec = std::vector<double>;

using test::randn;
using test::uniform;
DVec widen(const Vec& v) { return DVec(v.begin(), v.end()); }
size_t sz(int64_t n) { return static_cast<size_t>(n); }

// ---- the FP64 reference: the formulas of DESIGN.md §12, written independently of emu/ssm.cpp --

namespace ref {

double silu(double u) { return u / (1.0 + std::exp(-u)); }
double softplus(double u) { return u > 20.0 ? u : std::log1p(std::exp(u)); }

// out (B,T,C) = silu(bias + sum_k w[c,k] x[t-W+1+k]); umag: |bias| + sum_k |w x| (the error scale
// of the pre-activation)
void conv_silu(DVec& out, DVec* umag, const DVec& inp, int64_t ld, const DVec& w, const DVec& bias,
               int64_t B, int64_t T, int64_t C, int64_t W) {
  out.assign(sz(B * T * C), 0.0);
  if (umag) umag->assign(out.size(), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < C; ++c) {
        double u = bias[sz(c)], m = std::fabs(bias[sz(c)]);
        for (int64_t j = 0; j < W; ++j) {  // j: how far back
          if (t - j < 0) break;
          const double term = w[sz(c * W + W - 1 - j)] * inp[sz((b * T + t - j) * ld + c)];
          u += term;
          m += std::fabs(term);
        }
        out[sz((b * T + t) * C + c)] = silu(u);
        if (umag) (*umag)[sz((b * T + t) * C + c)] = m;
      }
}

void dt_a(DVec& dt, DVec& A, const DVec& dt_raw, int64_t ld, const DVec& dt_bias, const DVec& A_log,
          int64_t B, int64_t T, int64_t H) {
  dt.assign(sz(B * T * H), 0.0);
  A.assign(sz(H), 0.0);
  for (int64_t r = 0; r < B * T; ++r)
    for (int64_t h = 0; h < H; ++h)
      dt[sz(r * H + h)] = softplus(dt_raw[sz(r * ld + h)] + dt_bias[sz(h)]);
  for (int64_t h = 0; h < H; ++h) A[sz(h)] = -std::exp(A_log[sz(h)]);
}

// The naive scan: every head keeps its own state and reads its group's B and C, g = h / (H/G).
// y (B,T,H*P); final (B,H,P,N) the last state; ymag, final_mag: the same recurrence on
// magnitudes (|a|, |dt x B|, |S C|, |D x|), the scale of the FP32 rounding errors.
void scan(DVec& y, DVec* final_state, DVec* ymag, const DVec& xbc, const DVec& dt, const DVec& A,
          const DVec& D, const SsmShape& s, DVec* final_mag = nullptr) {
  const int64_t HP = s.H * s.P, Cx = HP + 2 * s.G * s.N;
  y.assign(sz(s.B * s.T * HP), 0.0);
  if (ymag) ymag->assign(y.size(), 0.0);
  if (final_state) final_state->assign(sz(s.B * s.H * s.P * s.N), 0.0);
  if (final_mag) final_mag->assign(sz(s.B * s.H * s.P * s.N), 0.0);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h) {
      const int64_t g = h / (s.H / s.G);
      DVec S(sz(s.P * s.N), 0.0), M(S.size(), 0.0);
      for (int64_t t = 0; t < s.T; ++t) {
        const double* row = &xbc[sz((b * s.T + t) * Cx)];
        const double d = dt[sz((b * s.T + t) * s.H + h)];
        const double a = std::exp(d * A[sz(h)]);
        for (int64_t p = 0; p < s.P; ++p) {
          const double x = row[h * s.P + p];
          double acc = 0.0, mag = 0.0;
          for (int64_t n = 0; n < s.N; ++n) {
            const double Bn = row[HP + g * s.N + n], Cn = row[HP + s.G * s.N + g * s.N + n];
            double& st = S[sz(p * s.N + n)];
            double& mt = M[sz(p * s.N + n)];
            st = a * st + d * x * Bn;
            mt = a * mt + std::fabs(d * x * Bn);
            acc += st * Cn;
            mag += mt * std::fabs(Cn);
          }
          y[sz((b * s.T + t) * HP + h * s.P + p)] = acc + D[sz(h)] * x;
          if (ymag) (*ymag)[sz((b * s.T + t) * HP + h * s.P + p)] = mag + std::fabs(D[sz(h)] * x);
        }
      }
      if (final_state)
        std::copy(S.begin(), S.end(), final_state->begin() + (b * s.H + h) * s.P * s.N);
      if (final_mag) std::copy(M.begin(), M.end(), final_mag->begin() + (b * s.H + h) * s.P * s.N);
    }
}

void gated_norm(DVec& out, const DVec& inp, const DVec& z, int64_t ld, const DVec& w, int64_t N,
                int64_t C, int64_t G, double eps = 1e-5) {
  const int64_t gs = C / G;
  out.assign(sz(N * C), 0.0);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t j = 0; j < G; ++j) {
      double ms = 0.0;
      for (int64_t i = j * gs; i < (j + 1) * gs; ++i) {
        const double g = inp[sz(r * C + i)] * silu(z[sz(r * ld + i)]);
        ms += g * g;
      }
      const double rs = 1.0 / std::sqrt(ms / static_cast<double>(gs) + eps);
      for (int64_t i = j * gs; i < (j + 1) * gs; ++i)
        out[sz(r * C + i)] = inp[sz(r * C + i)] * silu(z[sz(r * ld + i)]) * rs * w[sz(i)];
    }
}

}  // namespace ref

double dot(const DVec& w, const DVec& v) {
  double s = 0.0;
  for (size_t i = 0; i < v.size(); ++i) s += w[i] * v[i];
  return s;
}

// ---- checks -------------------------------------------------------------------------------------

// |got - ref| <= rtol * budget_scale everywhere; prints the worst element and its share of the
// budget.
void expect_within(const char* what, const Vec& got, const DVec& ref, const DVec& scale,
                   double rtol) {
  ASSERT_EQ(got.size(), ref.size());
  size_t worst = 0, bad = 0;
  double worst_frac = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - ref[i]), budget = rtol * scale[i];
    const double frac = err == 0 ? 0 : (budget > 0 ? err / budget : INFINITY);
    if (!(frac <= 1)) ++bad;
    if (!(frac <= worst_frac)) {
      worst_frac = frac;
      worst = i;
    }
  }
  std::printf(
      "[mamba] forward  %-26s worst at %4zu: %+.9e vs %+.9e, %5.1f%% of budget (rtol %.3g)\n", what,
      worst, got[worst], ref[worst], 100 * worst_frac, rtol);
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements outside budget";
}

// The analytic FP32 gradient grad of loss with respect to every element of x, against FP64
// central differences of loss (x in double, step h = 1e-4 * max(1, |x_i|); steps of 1e-5 give the
// same worst errors to two digits, so the differences' own error is far below the FP32 one). The
// error of an element is |grad - fd| / max(|fd|, 1e-2 * max |fd|): relative, with a floor, so an
// element whose gradient nearly cancels (an FP32 sum of many terms) is held to 1% of the tensor's
// largest. Prints the worst element, the tensor's largest gradient and the bound.
void expect_grad(const char* what, DVec& x, const Vec& grad, const std::function<double()>& loss,
                 double bound) {
  ASSERT_EQ(x.size(), grad.size()) << what;
  DVec fd(x.size());
  double fd_max = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i], h = 1e-4 * std::max(1.0, std::fabs(keep));
    x[i] = keep + h;
    const double up = loss();
    x[i] = keep - h;
    const double dn = loss();
    x[i] = keep;
    fd[i] = (up - dn) / (2 * h);
    fd_max = std::max(fd_max, std::fabs(fd[i]));
  }
  size_t worst = 0;
  double worst_err = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double err = std::fabs(grad[i] - fd[i]) / std::max(std::fabs(fd[i]), 1e-2 * fd_max);
    if (!(err <= worst_err)) {
      worst_err = err;
      worst = i;
    }
  }
  std::printf(
      "[mamba] gradient %-26s worst rel err %.3e at %4zu (%+.9e vs fd %+.9e), max %.3e bound "
      "%.0e\n",
      what, worst_err, worst, grad[worst], fd[worst], fd_max, bound);
  EXPECT_LE(worst_err, bound) << what;
  EXPECT_GT(fd_max, 0.0) << what << ": an all-zero gradient checks nothing";
}

// FP32's unit roundoff
constexpr double kU = 0x1p-24;
// The gradients' bound: FP32 backward passes against the exact derivative. The errors are FP32
// sums of up to a few hundred terms with some cancellation; the worst measured over eight input
// seeds was 2.5e-5, the printed one is near 1e-5.
constexpr double kGradBound = 2e-4;

// The small problem of every check: T not a multiple of the chunk, the width or the group size.
constexpr SsmShape kShape{/*B=*/2, /*T=*/19, /*H=*/4, /*P=*/8, /*G=*/2, /*N=*/8, /*chunk=*/5};
constexpr int64_t kW = 4;

// ---- conv1d + SiLU ------------------------------------------------------------------------------

TEST(Mamba, Conv1dSiluMatchesReferenceAndFiniteDifferences) {
  const int64_t B = kShape.B, T = kShape.T, C = kShape.xbc_cols(), W = kW;
  const int64_t ld = C + 5, ld_d = C + 3;  // strided input and gradient: slices of a wider row
  Vec inp = randn(sz(B * T * ld), 1), w = uniform(sz(C * W), 2, -0.5f, 0.5f),
      bias = uniform(sz(C), 3, -0.5f, 0.5f);
  const Vec dout = randn(sz(B * T * C), 4);
  for (int64_t r = 0; r < B * T; ++r)  // the padding holds NaN: never read
    for (int64_t c = C; c < ld; ++c) inp[sz(r * ld + c)] = std::nanf("");
  Vec out(sz(B * T * C));
  conv1d_silu_forward(out.data(), inp.data(), ld, w.data(), bias.data(), B, T, C, W);

  DVec xin = widen(inp), wd = widen(w), bd = widen(bias), ro, umag;
  ref::conv_silu(ro, &umag, xin, ld, wd, bd, B, T, C, W);
  // error of u: W + 1 roundings of terms of total umag; silu adds 3 roundings of |out| and
  // |silu'| <= 1.1 carries u's error
  DVec scale(ro.size());
  for (size_t i = 0; i < ro.size(); ++i) scale[i] = 1.1 * umag[i] + std::fabs(ro[i]);
  expect_within("conv1d_silu", out, ro, scale, 8 * kU);

  const float kSentinel = 7.0f;
  Vec dinp(sz(B * T * ld_d), kSentinel), dw(sz(C * W), 0.0f), db(sz(C), 0.0f);
  conv1d_silu_backward(dinp.data(), ld_d, dw.data(), db.data(), dout.data(), inp.data(), ld,
                       w.data(), bias.data(), B, T, C, W);
  // dinp in the input's layout; the padding of the gradient is left alone
  Vec dx(sz(B * T * ld), 0.0f);
  for (int64_t r = 0; r < B * T; ++r) {
    for (int64_t c = 0; c < C; ++c) dx[sz(r * ld + c)] = dinp[sz(r * ld_d + c)];
    for (int64_t c = C; c < ld_d; ++c) ASSERT_EQ(dinp[sz(r * ld_d + c)], kSentinel);
  }
  for (int64_t r = 0; r < B * T; ++r)  // the padding's finite differences: 0 (never read)
    for (int64_t c = C; c < ld; ++c) xin[sz(r * ld + c)] = 0.0;
  const DVec dd = widen(dout);
  auto loss = [&] {
    DVec o;
    ref::conv_silu(o, nullptr, xin, ld, wd, bd, B, T, C, W);
    return dot(dd, o);
  };
  expect_grad("conv1d_silu dinp", xin, dx, loss, kGradBound);
  expect_grad("conv1d_silu dweight", wd, dw, loss, kGradBound);
  expect_grad("conv1d_silu dbias", bd, db, loss, kGradBound);
}

// ---- dt and A -----------------------------------------------------------------------------------

TEST(Mamba, DtSoftplusMatchesReferenceAndFiniteDifferences) {
  const int64_t B = kShape.B, T = kShape.T, H = kShape.H, ld = H + 3;
  Vec dt_raw = randn(sz(B * T * ld), 5, 3.0f), dt_bias = uniform(sz(H), 6, -4.0f, 1.0f),
      A_log = uniform(sz(H), 7, 0.0f, 2.77f);
  // both softplus branches and the far tail (exp(u) subnormal in FP32 at u = -90), kept a step
  // away from the branch point u = 20
  const float specials[] = {25.0f, 21.5f, 19.0f, -30.0f, -90.0f, 40.0f};
  for (int i = 0; i < 6; ++i) dt_raw[sz(i * 5 * ld + i % H)] = specials[i] - dt_bias[sz(i % H)];
  const Vec wdt = randn(sz(B * T * H), 8), wA = randn(sz(H), 9);
  Vec dt(sz(B * T * H)), A(sz(H));
  ssm_dt_forward(dt.data(), A.data(), dt_raw.data(), ld, dt_bias.data(), A_log.data(), B, T, H);

  DVec raw = widen(dt_raw), bias = widen(dt_bias), alog = widen(A_log), rdt, rA;
  ref::dt_a(rdt, rA, raw, ld, bias, alog, B, T, H);
  // u = dt_raw + dt_bias rounds by <= |u| kU, which moves softplus by <= |u| kU |softplus| (its
  // log-derivative is below 1); exp and log1p add an ulp each (glibc's are within 1 ulp): 4 kU,
  // doubled for other libraries
  DVec scale(rdt.size());
  for (int64_t r = 0; r < B * T; ++r)
    for (int64_t h = 0; h < H; ++h) {
      const double u = raw[sz(r * ld + h)] + bias[sz(h)];
      scale[sz(r * H + h)] = (4 + std::fabs(u)) * std::fabs(rdt[sz(r * H + h)]);
    }
  expect_within("dt = softplus", dt, rdt, scale, 2 * kU);
  DVec ascale(sz(H));
  for (int64_t h = 0; h < H; ++h)
    ascale[sz(h)] = (2 + std::fabs(alog[sz(h)])) * std::fabs(rA[sz(h)]);
  expect_within("A = -exp(A_log)", A, rA, ascale, kU);

  Vec ddt_raw(sz(B * T * ld), 0.0f), ddt_bias(sz(H), 0.0f), dA_log(sz(H), 0.0f);
  ssm_dt_backward(ddt_raw.data(), ld, ddt_bias.data(), dA_log.data(), wdt.data(), wA.data(),
                  dt_raw.data(), ld, dt_bias.data(), A_log.data(), B, T, H);
  const DVec wd = widen(wdt), wa = widen(wA);
  auto loss = [&] {
    DVec d, a;
    ref::dt_a(d, a, raw, ld, bias, alog, B, T, H);
    return dot(wd, d) + dot(wa, a);
  };
  expect_grad("dt ddt_raw", raw, ddt_raw, loss, kGradBound);
  expect_grad("dt ddt_bias", bias, ddt_bias, loss, kGradBound);
  expect_grad("dt dA_log", alog, dA_log, loss, kGradBound);
}

// softplus(u) = u above 20 exactly; below, log1p(exp(u)): relative accuracy far into the tail,
// where log(1 + exp(u)) is 0 in FP32, down to FP32 subnormals (no flush to zero).
TEST(Mamba, SoftplusBranchesAndTail) {
  const float u[] = {20.0f, std::nextafter(20.0f, 30.0f), 25.0f, 1e30f, 0.0f, -30.0f, -90.0f};
  const int n = 7;
  const float zero = 0.0f, a_log = 0.0f;
  float dt[n], A;
  for (int i = 0; i < n; ++i) ssm_dt_forward(&dt[i], &A, &u[i], 1, &zero, &a_log, 1, 1, 1);
  EXPECT_EQ(f32_bits(A), f32_bits(-1.0f));
  for (int i = 1; i < 4; ++i) EXPECT_EQ(f32_bits(dt[i]), f32_bits(u[i])) << u[i];
  EXPECT_EQ(dt[0], 20.0f);  // log1p(exp(20)) = 20 + 2e-9: 20 in FP32, so the branches meet
  EXPECT_EQ(dt[4], std::log1p(1.0f));
  EXPECT_EQ(std::log(1.0f + std::exp(-30.0f)), 0.0f);  // what log1p avoids
  EXPECT_NEAR(dt[5] / std::exp(-30.0), 1.0, 4e-6);     // u = -30 rounds within 2^-20 of itself
  EXPECT_GT(dt[6], 0.0f);
  EXPECT_LT(dt[6], std::numeric_limits<float>::min());  // subnormal, kept
}

// exp_f32 and log1p_f32 (emu/ssm_math.hpp) against binary64 exp and log1p rounded to FP32, over
// every 251st FP32 bit pattern (17 million) and the special values. Over all 2^32 patterns
// (measured once, 2026-12-02; too slow for this suite) exp_f32 equals (float)exp((double)x)
// everywhere, and log1p_f32 differs from (float)log1p((double)x) at one input, 0x1.fb035ap-2,
// where log1p_f32 is the correctly rounded value (the exact one lies 8.5e-18 below the midpoint,
// which the double rounding of the reference crosses).
TEST(Mamba, ExpAndLog1pAreCorrectlyRounded) {
  int64_t checked = 0;
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 251) {
    const float x = f32_from_bits(static_cast<uint32_t>(b));
    if (std::isnan(x)) continue;
    ++checked;
    ASSERT_EQ(f32_bits(exp_f32(x)), f32_bits(static_cast<float>(std::exp(static_cast<double>(x)))))
        << std::hexfloat << x;
    if (x >= -1.0f && b != 0x3EFD81ADu) {
      ASSERT_EQ(f32_bits(log1p_f32(x)),
                f32_bits(static_cast<float>(std::log1p(static_cast<double>(x)))))
          << std::hexfloat << x;
    }
  }
  EXPECT_GT(checked, int64_t{17000000});
  EXPECT_EQ(f32_bits(log1p_f32(0x1.fb035ap-2f)), f32_bits(0x1.9bddc2p-2f));
  const float inf = std::numeric_limits<float>::infinity(), nan = std::nanf("");
  EXPECT_EQ(f32_bits(exp_f32(0.0f)), f32_bits(1.0f));
  EXPECT_EQ(f32_bits(exp_f32(-0.0f)), f32_bits(1.0f));
  EXPECT_EQ(f32_bits(exp_f32(inf)), f32_bits(inf));
  EXPECT_EQ(f32_bits(exp_f32(-inf)), f32_bits(0.0f));
  EXPECT_EQ(f32_bits(exp_f32(nan)), 0x7FFFFFFFu);
  EXPECT_EQ(f32_bits(exp_f32(-103.5f)),
            f32_bits(static_cast<float>(std::exp(-103.5))));  // subnormal
  EXPECT_EQ(f32_bits(log1p_f32(0.0f)), f32_bits(0.0f));
  EXPECT_EQ(f32_bits(log1p_f32(-0.0f)), f32_bits(-0.0f));
  EXPECT_EQ(f32_bits(log1p_f32(-1.0f)), f32_bits(-inf));
  EXPECT_EQ(f32_bits(log1p_f32(-2.0f)), 0x7FFFFFFFu);
  EXPECT_EQ(f32_bits(log1p_f32(inf)), f32_bits(inf));
  EXPECT_EQ(f32_bits(log1p_f32(nan)), 0x7FFFFFFFu);
  EXPECT_EQ(f32_bits(log1p_f32(1e-45f)), f32_bits(1e-45f));  // the smallest subnormal
}

// ---- the scan -----------------------------------------------------------------------------------

struct ScanInputs {
  Vec xbc, dt, A, D, dy;
};
ScanInputs scan_inputs(const SsmShape& s, uint64_t seed) {
  ScanInputs in;
  in.xbc = randn(sz(s.B * s.T * s.xbc_cols()), seed);
  in.dt = uniform(sz(s.B * s.T * s.H), seed + 1, 0.02f, 0.8f);
  in.A = uniform(sz(s.H), seed + 2, -4.0f, -0.5f);
  in.D = uniform(sz(s.H), seed + 3, 0.5f, 1.5f);
  in.dy = randn(sz(s.B * s.T * s.d_inner()), seed + 4);
  return in;
}

// The forward's rounding errors against the magnitude recurrence of ref::scan: per step the state
// takes 4 roundings and exp's (a 1-ulp error in a multiplies the carried state); y adds N + 2. At
// T = 19, (4 + 1) * 19 + N + 2 < 128 roundings of the magnitude.
constexpr double kScanRtol = 128 * kU;

TEST(Mamba, ScanMatchesReferenceAndFiniteDifferences) {
  const SsmShape s = kShape;
  const ScanInputs in = scan_inputs(s, 11);
  Vec y(sz(s.B * s.T * s.d_inner())), states(sz(s.states_size()));
  ssm_scan_forward(y.data(), states.data(), in.xbc.data(), in.dt.data(), in.A.data(), in.D.data(),
                   s);
  DVec xbc = widen(in.xbc), dt = widen(in.dt), A = widen(in.A), D = widen(in.D), ry, rfinal, ymag,
       fmag;
  ref::scan(ry, &rfinal, &ymag, xbc, dt, A, D, s, &fmag);
  expect_within("scan y", y, ry, ymag, kScanRtol);
  // the last saved state of each (b, h) is the final state
  Vec final_state;
  for (int64_t bh = 0; bh < s.B * s.H; ++bh)
    for (int64_t i = 0; i < s.P * s.N; ++i)
      final_state.push_back(states[sz((bh * s.chunks() + s.chunks() - 1) * s.P * s.N + i)]);
  expect_within("scan final state", final_state, rfinal, fmag, kScanRtol);

  Vec dxbc(in.xbc.size(), std::nanf("")), ddt(in.dt.size(), std::nanf("")), dA(sz(s.H)),
      dD(sz(s.H), 0.0f);
  ssm_scan_backward(dxbc.data(), ddt.data(), dA.data(), dD.data(), in.dy.data(), in.xbc.data(),
                    in.dt.data(), in.A.data(), in.D.data(), states.data(), s);
  const DVec dy = widen(in.dy);
  auto loss = [&] {
    DVec o;
    ref::scan(o, nullptr, nullptr, xbc, dt, A, D, s);
    return dot(dy, o);
  };
  expect_grad("scan dxbc (dx, dB, dC)", xbc, dxbc, loss, kGradBound);
  expect_grad("scan ddt", dt, ddt, loss, kGradBound);
  expect_grad("scan dA", A, dA, loss, kGradBound);
  expect_grad("scan dD", D, dD, loss, kGradBound);
}

// Head h reads the B and C of its group h / (H/G): against the naive FP64 scan for every group
// count, and bit for bit against single-group scans of each group's heads alone, forward and
// backward.
TEST(Mamba, ScanHeadsReadTheirGroupsBAndC) {
  for (int64_t G : {1, 2, 4}) {
    SsmShape s = kShape;
    s.G = G;
    const ScanInputs in = scan_inputs(s, 20 + static_cast<uint64_t>(G));
    Vec y(sz(s.B * s.T * s.d_inner())), states(sz(s.states_size()));
    ssm_scan_forward(y.data(), states.data(), in.xbc.data(), in.dt.data(), in.A.data(), in.D.data(),
                     s);
    DVec ry, ymag;
    ref::scan(ry, nullptr, &ymag, widen(in.xbc), widen(in.dt), widen(in.A), widen(in.D), s);
    const std::string what = "scan y, G = " + std::to_string(G);
    expect_within(what.c_str(), y, ry, ymag, kScanRtol);
    Vec dxbc(in.xbc.size()), ddt(in.dt.size()), dA(sz(s.H)), dD(sz(s.H), 0.0f);
    ssm_scan_backward(dxbc.data(), ddt.data(), dA.data(), dD.data(), in.dy.data(), in.xbc.data(),
                      in.dt.data(), in.A.data(), in.D.data(), states.data(), s);

    // group g alone: its heads' x, its B and C, as a scan of one group
    const int64_t hpg = s.H / G, HP = s.d_inner();
    SsmShape one = s;
    one.H = hpg;
    one.G = 1;
    for (int64_t g = 0; g < G; ++g) {
      Vec xbc1, dt1, A1(in.A.begin() + g * hpg, in.A.begin() + (g + 1) * hpg),
          D1(in.D.begin() + g * hpg, in.D.begin() + (g + 1) * hpg), dy1;
      for (int64_t r = 0; r < s.B * s.T; ++r) {
        const float* row = &in.xbc[sz(r * s.xbc_cols())];
        xbc1.insert(xbc1.end(), row + g * hpg * s.P, row + (g + 1) * hpg * s.P);
        xbc1.insert(xbc1.end(), row + HP + g * s.N, row + HP + (g + 1) * s.N);
        xbc1.insert(xbc1.end(), row + HP + (G + g) * s.N, row + HP + (G + g + 1) * s.N);
        dt1.insert(dt1.end(), in.dt.begin() + r * s.H + g * hpg,
                   in.dt.begin() + r * s.H + (g + 1) * hpg);
        dy1.insert(dy1.end(), in.dy.begin() + r * HP + g * hpg * s.P,
                   in.dy.begin() + r * HP + (g + 1) * hpg * s.P);
      }
      Vec y1(sz(one.B * one.T * one.d_inner())), st1(sz(one.states_size()));
      ssm_scan_forward(y1.data(), st1.data(), xbc1.data(), dt1.data(), A1.data(), D1.data(), one);
      Vec dxbc1(xbc1.size()), ddt1(dt1.size()), dA1(sz(hpg)), dD1(sz(hpg), 0.0f);
      ssm_scan_backward(dxbc1.data(), ddt1.data(), dA1.data(), dD1.data(), dy1.data(), xbc1.data(),
                        dt1.data(), A1.data(), D1.data(), st1.data(), one);
      for (int64_t r = 0; r < s.B * s.T; ++r) {
        for (int64_t i = 0; i < hpg * s.P; ++i)
          ASSERT_EQ(f32_bits(y[sz(r * HP + g * hpg * s.P + i)]),
                    f32_bits(y1[sz(r * one.d_inner() + i)]))
              << "G " << G << " group " << g << " y row " << r << " col " << i;
        const float* d = &dxbc[sz(r * s.xbc_cols())];
        const float* d1 = &dxbc1[sz(r * one.xbc_cols())];
        for (int64_t i = 0; i < hpg * s.P; ++i)
          ASSERT_EQ(f32_bits(d[g * hpg * s.P + i]), f32_bits(d1[i])) << "dx, G " << G;
        for (int64_t n = 0; n < s.N; ++n) {
          ASSERT_EQ(f32_bits(d[HP + g * s.N + n]), f32_bits(d1[hpg * s.P + n])) << "dB, G " << G;
          ASSERT_EQ(f32_bits(d[HP + (G + g) * s.N + n]), f32_bits(d1[hpg * s.P + s.N + n]))
              << "dC, G " << G;
        }
        for (int64_t h = 0; h < hpg; ++h)
          ASSERT_EQ(f32_bits(ddt[sz(r * s.H + g * hpg + h)]), f32_bits(ddt1[sz(r * hpg + h)]));
      }
      for (int64_t h = 0; h < hpg; ++h) {
        EXPECT_EQ(f32_bits(dA[sz(g * hpg + h)]), f32_bits(dA1[sz(h)]));
        EXPECT_EQ(f32_bits(dD[sz(g * hpg + h)]), f32_bits(dD1[sz(h)]));
      }
    }
  }
}

// The saved-state interval changes what the forward pass keeps, never a bit of what either pass
// computes.
TEST(Mamba, ScanBitsDoNotDependOnTheStateInterval) {
  SsmShape s = kShape;
  const ScanInputs in = scan_inputs(s, 40);
  Vec y0, dxbc0, ddt0, dA0, dD0, final0;
  for (int64_t chunk : {19, 1, 2, 5, 18, 64}) {
    s.chunk = chunk;
    Vec y(sz(s.B * s.T * s.d_inner())), states(sz(s.states_size()));
    ssm_scan_forward(y.data(), states.data(), in.xbc.data(), in.dt.data(), in.A.data(), in.D.data(),
                     s);
    Vec dxbc(in.xbc.size()), ddt(in.dt.size()), dA(sz(s.H)), dD(sz(s.H), 0.0f), fin;
    ssm_scan_backward(dxbc.data(), ddt.data(), dA.data(), dD.data(), in.dy.data(), in.xbc.data(),
                      in.dt.data(), in.A.data(), in.D.data(), states.data(), s);
    for (int64_t bh = 0; bh < s.B * s.H; ++bh)
      fin.insert(fin.end(), states.begin() + (bh * s.chunks() + s.chunks() - 1) * s.P * s.N,
                 states.begin() + (bh * s.chunks() + s.chunks()) * s.P * s.N);
    Vec no_states(y.size());  // states may be left out
    ssm_scan_forward(no_states.data(), nullptr, in.xbc.data(), in.dt.data(), in.A.data(),
                     in.D.data(), s);
    auto same = [](const Vec& a, const Vec& b) {
      return a.size() == b.size() &&
             std::equal(a.begin(), a.end(), b.begin(),
                        [](float u, float v) { return f32_bits(u) == f32_bits(v); });
    };
    EXPECT_TRUE(same(y, no_states)) << chunk;
    if (y0.empty()) {
      y0 = y, dxbc0 = dxbc, ddt0 = ddt, dA0 = dA, dD0 = dD, final0 = fin;
      continue;
    }
    EXPECT_TRUE(same(y, y0)) << "y, chunk " << chunk;
    EXPECT_TRUE(same(fin, final0)) << "final state, chunk " << chunk;
    EXPECT_TRUE(same(dxbc, dxbc0)) << "dxbc, chunk " << chunk;
    EXPECT_TRUE(same(ddt, ddt0)) << "ddt, chunk " << chunk;
    EXPECT_TRUE(same(dA, dA0)) << "dA, chunk " << chunk;
    EXPECT_TRUE(same(dD, dD0)) << "dD, chunk " << chunk;
  }
}

// ---- gated grouped RMSNorm ----------------------------------------------------------------------

TEST(Mamba, GatedRmsNormMatchesReferenceAndFiniteDifferences) {
  const int64_t N = kShape.B * kShape.T, C = kShape.d_inner(), G = kShape.G, ld = C + 9;
  Vec inp = randn(sz(N * C), 50), z = randn(sz(N * ld), 51, 1.5f),
      w = uniform(sz(C), 52, 0.5f, 1.5f);
  const Vec dout = randn(sz(N * C), 53);
  Vec out(sz(N * C)), rstd(sz(N * G));
  gated_rmsnorm_forward(out.data(), rstd.data(), inp.data(), z.data(), ld, w.data(), N, C, G);
  DVec xd = widen(inp), zd = widen(z), wd = widen(w), ro;
  ref::gated_norm(ro, xd, zd, ld, wd, N, C, G);
  // a sum of C/G squares and about 10 roundings around it, relative to the output
  DVec scale(ro.size());
  for (size_t i = 0; i < ro.size(); ++i) scale[i] = std::fabs(ro[i]);
  expect_within("gated_rmsnorm", out, ro, scale, static_cast<double>(C / G + 16) * kU);

  const float kSentinel = 7.0f;
  Vec dinp(sz(N * C), std::nanf("")), dz(sz(N * ld), kSentinel), dw(sz(C), 0.0f);
  gated_rmsnorm_backward(dinp.data(), dz.data(), ld, dw.data(), dout.data(), inp.data(), z.data(),
                         ld, w.data(), rstd.data(), N, C, G);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t c = C; c < ld; ++c) {
      ASSERT_EQ(dz[sz(r * ld + c)], kSentinel);
      dz[sz(r * ld + c)] = 0.0f;  // the padding's finite differences: 0
    }
  const DVec dd = widen(dout);
  auto loss = [&] {
    DVec o;
    ref::gated_norm(o, xd, zd, ld, wd, N, C, G);
    return dot(dd, o);
  };
  expect_grad("gated_rmsnorm dinp", xd, dinp, loss, kGradBound);
  expect_grad("gated_rmsnorm dz", zd, dz, loss, kGradBound);
  expect_grad("gated_rmsnorm dweight", wd, dw, loss, kGradBound);
}

// ---- the chain ----------------------------------------------------------------------------------

// in_proj's output [z | x | B | C | dt_raw] through conv -> softplus -> scan -> gated norm, with
// every parameter of the mixer's high-precision core, as the model will compose them: the slices
// read and the gradients written in place (row stride = the in_proj output's width).
struct Chain {
  SsmShape s = kShape;
  int64_t W = kW;
  int64_t di() const { return s.d_inner(); }
  int64_t cx() const { return s.xbc_cols(); }
  int64_t cin() const { return 2 * di() + 2 * s.G * s.N + s.H; }
  int64_t rows() const { return s.B * s.T; }
};

struct ChainParams {
  Vec zx, conv_w, conv_b, dt_bias, A_log, D, norm_w;
};

ChainParams chain_params(const Chain& c, uint64_t seed) {
  ChainParams p;
  p.zx = randn(sz(c.rows() * c.cin()), seed);
  const float cb = 1.0f / std::sqrt(static_cast<float>(c.W));  // Conv1d's default bound
  p.conv_w = uniform(sz(c.cx() * c.W), seed + 1, -cb, cb);
  p.conv_b = uniform(sz(c.cx()), seed + 2, -cb, cb);
  // dt in [0.01, 0.5] before dt_raw moves it (dt_bias = dt + log(-expm1(-dt)), mamba_ssm's init)
  const Vec dt = uniform(sz(c.s.H), seed + 3, 0.01f, 0.5f);
  for (float d : dt) p.dt_bias.push_back(d + std::log(-std::expm1(-d)));
  const Vec a = uniform(sz(c.s.H), seed + 4, 1.0f, 16.0f);
  for (float v : a) p.A_log.push_back(std::log(v));
  p.D = uniform(sz(c.s.H), seed + 5, 0.5f, 1.5f);
  p.norm_w = uniform(sz(c.di()), seed + 6, 0.5f, 1.5f);
  return p;
}

struct ChainGrads {
  Vec out, dzx, conv_w, conv_b, dt_bias, A_log, D, norm_w;
};

ChainGrads chain_fp32(const Chain& c, const ChainParams& p, const Vec& dout) {
  const int64_t di = c.di(), cx = c.cx(), cin = c.cin(), R = c.rows(), H = c.s.H;
  Vec xbc(sz(R * cx)), dt(sz(R * H)), A(sz(H)), y(sz(R * di)), states(sz(c.s.states_size())),
      rstd(sz(R * c.s.G));
  ChainGrads g;
  g.out.resize(sz(R * di));
  conv1d_silu_forward(xbc.data(), p.zx.data() + di, cin, p.conv_w.data(), p.conv_b.data(), c.s.B,
                      c.s.T, cx, c.W);
  ssm_dt_forward(dt.data(), A.data(), p.zx.data() + di + cx, cin, p.dt_bias.data(), p.A_log.data(),
                 c.s.B, c.s.T, H);
  ssm_scan_forward(y.data(), states.data(), xbc.data(), dt.data(), A.data(), p.D.data(), c.s);
  gated_rmsnorm_forward(g.out.data(), rstd.data(), y.data(), p.zx.data(), cin, p.norm_w.data(), R,
                        di, c.s.G);

  g.dzx.assign(p.zx.size(), std::nanf(""));  // every column is written by one backward pass
  g.conv_w.assign(p.conv_w.size(), 0.0f);
  g.conv_b.assign(p.conv_b.size(), 0.0f);
  g.dt_bias.assign(sz(H), 0.0f);
  g.A_log.assign(sz(H), 0.0f);
  g.D.assign(sz(H), 0.0f);
  g.norm_w.assign(sz(di), 0.0f);
  Vec dy(y.size()), dxbc(xbc.size()), ddt(dt.size()), dA(sz(H));
  gated_rmsnorm_backward(dy.data(), g.dzx.data(), cin, g.norm_w.data(), dout.data(), y.data(),
                         p.zx.data(), cin, p.norm_w.data(), rstd.data(), R, di, c.s.G);
  ssm_scan_backward(dxbc.data(), ddt.data(), dA.data(), g.D.data(), dy.data(), xbc.data(),
                    dt.data(), A.data(), p.D.data(), states.data(), c.s);
  ssm_dt_backward(g.dzx.data() + di + cx, cin, g.dt_bias.data(), g.A_log.data(), ddt.data(),
                  dA.data(), p.zx.data() + di + cx, cin, p.dt_bias.data(), p.A_log.data(), c.s.B,
                  c.s.T, H);
  conv1d_silu_backward(g.dzx.data() + di, cin, g.conv_w.data(), g.conv_b.data(), dxbc.data(),
                       p.zx.data() + di, cin, p.conv_w.data(), p.conv_b.data(), c.s.B, c.s.T, cx,
                       c.W);
  return g;
}

struct ChainParams64 {
  DVec zx, conv_w, conv_b, dt_bias, A_log, D, norm_w;
};

DVec chain_fp64(const Chain& c, const ChainParams64& p) {
  const int64_t di = c.di(), cx = c.cx(), cin = c.cin(), R = c.rows();
  DVec xbc, dt, A, y, out;
  DVec xbc_in(sz(R * cx)), dt_raw(sz(R * c.s.H));  // the split, in double
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = 0; i < cx; ++i) xbc_in[sz(r * cx + i)] = p.zx[sz(r * cin + di + i)];
    for (int64_t h = 0; h < c.s.H; ++h) dt_raw[sz(r * c.s.H + h)] = p.zx[sz(r * cin + di + cx + h)];
  }
  ref::conv_silu(xbc, nullptr, xbc_in, cx, p.conv_w, p.conv_b, c.s.B, c.s.T, cx, c.W);
  ref::dt_a(dt, A, dt_raw, c.s.H, p.dt_bias, p.A_log, c.s.B, c.s.T, c.s.H);
  ref::scan(y, nullptr, nullptr, xbc, dt, A, p.D, c.s);
  ref::gated_norm(out, y, p.zx, cin, p.norm_w, R, di, c.s.G);
  return out;
}

TEST(Mamba, ChainMatchesFiniteDifferences) {
  const Chain c;
  const ChainParams p = chain_params(c, 60);
  const Vec dout = randn(sz(c.rows() * c.di()), 67);
  const ChainGrads g = chain_fp32(c, p, dout);
  ChainParams64 q{widen(p.zx),    widen(p.conv_w), widen(p.conv_b), widen(p.dt_bias),
                  widen(p.A_log), widen(p.D),      widen(p.norm_w)};
  const DVec out64 = chain_fp64(c, q);
  // the chain's output against FP64: the norm divides by the rms, so relative to the output's
  // scale (the norm weight's, here ~1), errors of the scan's magnitude ratio, a few hundred kU
  expect_within("chain out", g.out, out64, DVec(out64.size(), 1.0), 1024 * kU);
  const DVec dd = widen(dout);
  auto loss = [&] { return dot(dd, chain_fp64(c, q)); };
  expect_grad("chain d[z|x|B|C|dt_raw]", q.zx, g.dzx, loss, kGradBound);
  expect_grad("chain dconv_weight", q.conv_w, g.conv_w, loss, kGradBound);
  expect_grad("chain dconv_bias", q.conv_b, g.conv_b, loss, kGradBound);
  expect_grad("chain ddt_bias", q.dt_bias, g.dt_bias, loss, kGradBound);
  expect_grad("chain dA_log", q.A_log, g.A_log, loss, kGradBound);
  expect_grad("chain dD", q.D, g.D, loss, kGradBound);
  expect_grad("chain dnorm_weight", q.norm_w, g.norm_w, loss, kGradBound);
}

// The whole mixer, as the model composes it (model/gpt.cpp's Mamba-2 block): u (the block norm's
// output, D wide) -> in_proj -> the chain -> out_proj, against FP64 central differences of the
// same mixer in double (the projections FP64 sums here, the chain ref:: as above), every element
// of the input and of every parameter: in_proj, out_proj and the core's. The projections run here
// as FP32 loops (the model's recipe linears have their own tests); the point is the composition:
// the slices' gradients summed into in_proj's output gradient and carried through both GEMMs.
TEST(Mamba, WholeMixerMatchesFiniteDifferences) {
  const Chain c;
  const int64_t R = c.rows(), D = 12, cin = c.cin(), di = c.di();
  ChainParams p = chain_params(c, 80);
  const Vec u = randn(sz(R * D), 81), w_in = uniform(sz(cin * D), 82, -0.4f, 0.4f),
            w_out = uniform(sz(D * di), 83, -0.3f, 0.3f), dO = randn(sz(R * D), 84);
  // FP32: zx = u w_in^T; the chain; o = out w_out^T; then the adjoints (each sum from +0 in order)
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < cin; ++j) {
      float acc = 0.0f;
      for (int64_t k = 0; k < D; ++k) acc += u[sz(r * D + k)] * w_in[sz(j * D + k)];
      p.zx[sz(r * cin + j)] = acc;
    }
  Vec dchain(sz(R * di));  // d(out) = dO w_out
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < di; ++i) {
      float acc = 0.0f;
      for (int64_t m = 0; m < D; ++m) acc += dO[sz(r * D + m)] * w_out[sz(m * di + i)];
      dchain[sz(r * di + i)] = acc;
    }
  const ChainGrads g = chain_fp32(c, p, dchain);
  Vec dw_out(sz(D * di)), du(sz(R * D)), dw_in(sz(cin * D));
  for (int64_t m = 0; m < D; ++m)
    for (int64_t i = 0; i < di; ++i) {
      float acc = 0.0f;
      for (int64_t r = 0; r < R; ++r) acc += dO[sz(r * D + m)] * g.out[sz(r * di + i)];
      dw_out[sz(m * di + i)] = acc;
    }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < D; ++k) {
      float acc = 0.0f;
      for (int64_t j = 0; j < cin; ++j) acc += g.dzx[sz(r * cin + j)] * w_in[sz(j * D + k)];
      du[sz(r * D + k)] = acc;
    }
  for (int64_t j = 0; j < cin; ++j)
    for (int64_t k = 0; k < D; ++k) {
      float acc = 0.0f;
      for (int64_t r = 0; r < R; ++r) acc += g.dzx[sz(r * cin + j)] * u[sz(r * D + k)];
      dw_in[sz(j * D + k)] = acc;
    }
  // FP64
  DVec u64 = widen(u), w_in64 = widen(w_in), w_out64 = widen(w_out);
  const DVec dO64 = widen(dO);
  ChainParams64 q{DVec{},         widen(p.conv_w), widen(p.conv_b), widen(p.dt_bias),
                  widen(p.A_log), widen(p.D),      widen(p.norm_w)};
  auto loss = [&] {
    q.zx.assign(sz(R * cin), 0.0);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < cin; ++j)
        for (int64_t k = 0; k < D; ++k)
          q.zx[sz(r * cin + j)] += u64[sz(r * D + k)] * w_in64[sz(j * D + k)];
    const DVec out = chain_fp64(c, q);
    double l = 0.0;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t m = 0; m < D; ++m) {
        double o = 0.0;
        for (int64_t i = 0; i < di; ++i) o += out[sz(r * di + i)] * w_out64[sz(m * di + i)];
        l += dO64[sz(r * D + m)] * o;
      }
    return l;
  };
  expect_grad("mixer d(input)", u64, du, loss, kGradBound);
  expect_grad("mixer din_proj.weight", w_in64, dw_in, loss, kGradBound);
  expect_grad("mixer dout_proj.weight", w_out64, dw_out, loss, kGradBound);
  expect_grad("mixer dconv_weight", q.conv_w, g.conv_w, loss, kGradBound);
  expect_grad("mixer dconv_bias", q.conv_b, g.conv_b, loss, kGradBound);
  expect_grad("mixer ddt_bias", q.dt_bias, g.dt_bias, loss, kGradBound);
  expect_grad("mixer dA_log", q.A_log, g.A_log, loss, kGradBound);
  expect_grad("mixer dD", q.D, g.D, loss, kGradBound);
  expect_grad("mixer dnorm_weight", q.norm_w, g.norm_w, loss, kGradBound);
}

// Input gradients are written (the buffers' previous contents do not matter: the chain starts
// them at NaN); parameter gradients are their sum added once to the buffer.
TEST(Mamba, ParameterGradientsAreAddedOnce) {
  const Chain c;
  const ChainParams p = chain_params(c, 70);
  const Vec dout = randn(sz(c.rows() * c.di()), 77);
  const ChainGrads g = chain_fp32(c, p, dout);
  for (float v : g.dzx) ASSERT_FALSE(std::isnan(v));
  // the same backward passes into parameter buffers that already hold 0.25
  const int64_t di = c.di(), cx = c.cx(), cin = c.cin(), R = c.rows(), H = c.s.H;
  Vec xbc(sz(R * cx)), dt(sz(R * H)), A(sz(H)), y(sz(R * di)), states(sz(c.s.states_size())),
      rstd(sz(R * c.s.G)), out(sz(R * di));
  conv1d_silu_forward(xbc.data(), p.zx.data() + di, cin, p.conv_w.data(), p.conv_b.data(), c.s.B,
                      c.s.T, cx, c.W);
  ssm_dt_forward(dt.data(), A.data(), p.zx.data() + di + cx, cin, p.dt_bias.data(), p.A_log.data(),
                 c.s.B, c.s.T, H);
  ssm_scan_forward(y.data(), states.data(), xbc.data(), dt.data(), A.data(), p.D.data(), c.s);
  gated_rmsnorm_forward(out.data(), rstd.data(), y.data(), p.zx.data(), cin, p.norm_w.data(), R, di,
                        c.s.G);
  const float k = 0.25f;
  Vec dzx(p.zx.size(), 3.0f), dcw(p.conv_w.size(), k), dcb(p.conv_b.size(), k), ddb(sz(H), k),
      dal(sz(H), k), dD(sz(H), k), dnw(sz(di), k), dy(y.size(), -1.0f), dxbc(xbc.size(), 5.0f),
      ddt(dt.size(), 9.0f), dA(sz(H), 2.0f);
  gated_rmsnorm_backward(dy.data(), dzx.data(), cin, dnw.data(), dout.data(), y.data(), p.zx.data(),
                         cin, p.norm_w.data(), rstd.data(), R, di, c.s.G);
  ssm_scan_backward(dxbc.data(), ddt.data(), dA.data(), dD.data(), dy.data(), xbc.data(), dt.data(),
                    A.data(), p.D.data(), states.data(), c.s);
  ssm_dt_backward(dzx.data() + di + cx, cin, ddb.data(), dal.data(), ddt.data(), dA.data(),
                  p.zx.data() + di + cx, cin, p.dt_bias.data(), p.A_log.data(), c.s.B, c.s.T, H);
  conv1d_silu_backward(dzx.data() + di, cin, dcw.data(), dcb.data(), dxbc.data(), p.zx.data() + di,
                       cin, p.conv_w.data(), p.conv_b.data(), c.s.B, c.s.T, cx, c.W);
  for (size_t i = 0; i < dzx.size(); ++i) ASSERT_EQ(f32_bits(dzx[i]), f32_bits(g.dzx[i])) << i;
  auto added = [k](const Vec& got, const Vec& from_zero, const char* what) {
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(f32_bits(got[i]), f32_bits(k + from_zero[i])) << what << " " << i;
  };
  added(dcw, g.conv_w, "conv weight");
  added(dcb, g.conv_b, "conv bias");
  added(ddb, g.dt_bias, "dt_bias");
  added(dal, g.A_log, "A_log");
  added(dD, g.D, "D");
  added(dnw, g.norm_w, "norm weight");
}

// ---- the Backend ops (emu/backend.hpp: ssm_conv_*, ssm_scan_*, gated_norm_*) on CpuBackend ----

// The ops chained on strided slices of a wider in_proj buffer (tests/emu/ssm_chain.hpp) are the
// functions above, bit for bit: the chain's output, every slice of the in_proj gradient (its
// padding untouched) and the parameter gradients added once onto what the buffers held.
TEST(Mamba, BackendOpsAreTheFunctions) {
  const Chain c;
  test::SsmChainCase bc;
  bc.s = c.s;
  bc.W = c.W;
  bc.seed = 80;
  const test::SsmChainInputs in = test::ssm_chain_inputs(bc);
  emu::CpuBackend cpu;
  const test::SsmChainOutputs o = test::run_ssm_chain(cpu, bc, in);

  ChainParams p{
      Vec(sz(c.rows() * c.cin())), in.conv_w, in.conv_b, in.dt_bias, in.A_log, in.D, in.norm_w};
  for (int64_t r = 0; r < c.rows(); ++r)
    for (int64_t i = 0; i < c.cin(); ++i) p.zx[sz(r * c.cin() + i)] = in.zx[sz(r * bc.ld() + i)];
  const ChainGrads g = chain_fp32(c, p, in.dout);
  auto same = [](const Vec& got, const Vec& want, float plus, const char* what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(f32_bits(got[i]), f32_bits(plus + want[i])) << what << " " << i;
  };
  same(test::ssm_output(o, "out"), g.out, 0.0f, "out");
  const Vec dzx = test::ssm_output(o, "dzx");
  for (int64_t r = 0; r < c.rows(); ++r) {
    for (int64_t i = 0; i < c.cin(); ++i)
      ASSERT_EQ(f32_bits(dzx[sz(r * bc.ld() + i)]), f32_bits(g.dzx[sz(r * c.cin() + i)]))
          << "dzx row " << r << " column " << i;
    for (int64_t i = c.cin(); i < bc.ld(); ++i)
      ASSERT_TRUE(std::isnan(dzx[sz(r * bc.ld() + i)])) << "padding written, row " << r;
  }
  same(test::ssm_output(o, "dconv1d.weight"), g.conv_w, 0.25f, "conv weight");
  same(test::ssm_output(o, "dconv1d.bias"), g.conv_b, 0.25f, "conv bias");
  same(test::ssm_output(o, "ddt_bias"), g.dt_bias, 0.25f, "dt_bias");
  same(test::ssm_output(o, "dA_log"), g.A_log, 0.25f, "A_log");
  same(test::ssm_output(o, "dD"), g.D, 0.25f, "D");
  same(test::ssm_output(o, "dnorm.weight"), g.norm_w, 0.25f, "norm weight");
}

// With the model's BF16 storage marks, every stored activation and activation gradient holds BF16
// values (the strided slices too, their padding untouched), the first op's output is the unmarked
// one rounded, and dt, A, the states and rstd stay float32.
TEST(Mamba, BackendOpsRoundMarkedOutputs) {
  test::SsmChainCase bc;
  bc.s = kShape;
  bc.W = kW;
  bc.seed = 81;
  const test::SsmChainInputs in = test::ssm_chain_inputs(bc);
  emu::CpuBackend cpu;
  const test::SsmChainOutputs plain = test::run_ssm_chain(cpu, bc, in);
  bc.bf16_marks = true;
  const test::SsmChainOutputs marked = test::run_ssm_chain(cpu, bc, in);
  const Vec x0 = test::ssm_output(plain, "xbc");
  const Vec x1 = test::ssm_output(marked, "xbc");
  for (size_t i = 0; i < x0.size(); ++i) ASSERT_EQ(f32_bits(x1[i]), f32_bits(bf16_round(x0[i])));
  auto bf16_values = [](const Vec& v) {
    int64_t not_bf16 = 0;
    for (float x : v) not_bf16 += std::isnan(x) || (f32_bits(x) & 0xFFFFu) != 0;
    return not_bf16;
  };
  for (const char* name : {"xbc", "y", "out", "dy", "dxbc"})
    EXPECT_EQ(bf16_values(test::ssm_output(marked, name)), 0) << name;
  for (const char* name : {"dt", "states", "rstd"})
    EXPECT_GT(bf16_values(test::ssm_output(marked, name)), 0) << name << " is float32";
  const Vec dzx = test::ssm_output(marked, "dzx");
  for (int64_t r = 0; r < bc.rows(); ++r) {
    const Vec row(dzx.begin() + r * bc.ld(), dzx.begin() + r * bc.ld() + bc.cin());
    ASSERT_EQ(bf16_values(row), 0) << "dzx row " << r;
    for (int64_t i = bc.cin(); i < bc.ld(); ++i) ASSERT_TRUE(std::isnan(dzx[sz(r * bc.ld() + i)]));
  }
}

// Bad views fail before any work, naming the op and the tensor (emu/op_checks.cpp, which the CUDA
// backend runs too).
TEST(Mamba, BackendOpsCheckTheirViews) {
  emu::CpuBackend cpu;
  const SsmShape s = kShape;
  const int64_t R = s.B * s.T, cx = s.xbc_cols();
  Vec a(sz(R * (cx + 8))), w(sz(cx * kW)), bias(sz(cx));
  const TensorView x = f32_view(cpu, a.data(), R, cx, "xbc"),
                   weight = f32_view(cpu, w.data(), cx, kW, "weight"),
                   vb = f32_view(cpu, bias.data(), cx, 1, "bias");
  using test::expect_error_containing;
  TensorView strided = x;
  strided.row_stride = cx + 8;
  // the conv's output must be dense; its input may be strided
  expect_error_containing<std::invalid_argument>(
      [&] { cpu.ssm_conv_forward(strided, strided, weight, vb, s); },
      {"ssm_conv_forward", "xbc", "dense"}, "a strided conv output");
  TensorView narrow = strided;
  narrow.row_stride = cx - 1;
  expect_error_containing<std::invalid_argument>(
      [&] { cpu.ssm_conv_forward(x, narrow, weight, vb, s); }, {"ssm_conv_forward", "row stride"},
      "a row stride below the row");
  expect_error_containing<std::invalid_argument>(
      [&] { cpu.ssm_conv_forward(x, x, f32_view(cpu, w.data(), cx - 1, kW, "weight"), vb, s); },
      {"ssm_conv_forward", "weight", "expected"}, "a weight of the wrong shape");
  std::vector<uint16_t> h(sz(R * cx));
  expect_error_containing<std::invalid_argument>(
      [&] { cpu.ssm_conv_forward(bf16_view(cpu, h.data(), R, cx, "xbc16"), x, weight, vb, s); },
      {"ssm_conv_forward", "xbc16", "bfloat16"}, "BF16 bits");
  SsmShape odd = s;
  odd.G = 3;
  expect_error_containing<std::invalid_argument>(
      [&] { cpu.ssm_scan_forward(x, TensorView{}, x, x, x, x, x, x, x, odd); },
      {"ssm_scan_forward", "4 heads", "3 groups"}, "heads not a multiple of the groups");
  const int64_t C = s.d_inner();
  Vec g(sz(R * C)), r(sz(R * 3)), nw(sz(C));
  expect_error_containing<std::invalid_argument>(
      [&] {
        const TensorView v = f32_view(cpu, g.data(), R, C, "y");
        cpu.gated_norm_forward(v, f32_view(cpu, r.data(), R, 3, "rstd"), v, v,
                               f32_view(cpu, nw.data(), C, 1, "norm.weight"));
      },
      {"gated_norm_forward", "32 channels", "3 groups", "rstd"}, "channels not a multiple of G");
}

}  // namespace
}  // namespace fp4sim::emu
