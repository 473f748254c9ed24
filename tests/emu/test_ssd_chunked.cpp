// The chunked SSD decomposition of the Mamba-2 scan (the algorithm gpu/ssm_chunked.cu runs, its
// derivation in docs/numerics.md "The chunked SSD on CUDA"), written here on the host in plain
// loops, forward and backward, and held against the emulator's sequential recurrence and its
// adjoint (emu::ssm_scan_forward / ssm_scan_backward):
// - in FP64 (the decays' log-sums in FP64 too), where it must agree to the emulator's own FP32
//   rounding error: this checks the algebra (a wrong term is an O(1) error);
// - in FP32 with the GPU's structure (log-sums in FP64, every product and sum in FP32), whose
//   printed error is what the GPU's chunked kernels are expected to show against the emulator
//   (tests/gpu/test_ssm_gpu.cpp holds them to docs/numerics.md's budget).
// Shapes: a partial last chunk, T < Q, one group and several, T a multiple of Q.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "emu/ssm.hpp"
#include "emu/ssm_math.hpp"
#include "tests/emu/test_util.hpp"

namespace fp4sim::emu {
namespace {

using Vec = std::vector<float>;
size_t sz(int64_t n) { return static_cast<size_t>(n); }

using test::randn;
using test::uniform;

// exp in the working precision R: FP64's, or fp4sim's FP32 exp (the GPU uses CUDA's expf, within
// 2 ulp of it)
double exp_r(double x, double) { return std::exp(x); }
float exp_r(double x, float) { return exp_f32(static_cast<float>(x)); }

// The chunked SSD in precision R. Per batch b, head h (group g = h / (H/G)) and chunk c of L <= Q
// steps starting at t0, with the log-decay g_i = fl32(dt_i * A) (the emulator's product) and its
// inclusive prefix sum within the chunk cum_i = g_0 + ... + g_i (in FP64), u_j = dt_j x_j:
//   y_i = exp(cum_i) S_{c-1} C_i + sum_{j<=i} (C_i . B_j) exp(cum_i - cum_j) u_j + D x_i
//   S_c = exp(cum_{L-1}) S_{c-1} + sum_j exp(cum_{L-1} - cum_j) u_j B_j^T
// (S_{-1} = 0); every exp is of a difference <= 0.
template <class R>
struct Chunked {
  SsmShape s;
  const Vec &xbc, &dt, &A, &D;

  int64_t hpg() const { return s.H / s.G; }
  float x(int64_t b, int64_t t, int64_t h, int64_t p) const {
    return xbc[sz((b * s.T + t) * s.xbc_cols() + h * s.P + p)];
  }
  float Bv(int64_t b, int64_t t, int64_t g, int64_t n) const {
    return xbc[sz((b * s.T + t) * s.xbc_cols() + s.d_inner() + g * s.N + n)];
  }
  float Cv(int64_t b, int64_t t, int64_t g, int64_t n) const {
    return xbc[sz((b * s.T + t) * s.xbc_cols() + s.d_inner() + s.G * s.N + g * s.N + n)];
  }
  float dtv(int64_t b, int64_t t, int64_t h) const { return dt[sz((b * s.T + t) * s.H + h)]; }
  std::vector<double> cum(int64_t b, int64_t h, int64_t t0, int64_t L) const {
    std::vector<double> c(sz(L));
    double acc = 0;
    for (int64_t i = 0; i < L; ++i) {
      const float gi = dtv(b, t0 + i, h) * A[sz(h)];  // (FP32 product, as the emulator's)
      acc += gi;
      c[sz(i)] = acc;
    }
    return c;
  }
  R ex(double v) const { return exp_r(v, R{}); }

  // y (B,T,H*P); states (B,H,chunks,P,N)
  void forward(std::vector<R>& y, std::vector<R>& states) const {
    const int64_t P = s.P, N = s.N, Q = s.chunk, nc = s.chunks();
    y.assign(sz(s.B * s.T * s.d_inner()), R(0));
    states.assign(sz(s.states_size()), R(0));
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t h = 0; h < s.H; ++h) {
        const int64_t g = h / hpg();
        std::vector<R> Sprev(sz(P * N), R(0));
        for (int64_t c = 0; c < nc; ++c) {
          const int64_t t0 = c * Q, L = std::min(Q, s.T - t0);
          const std::vector<double> cm = cum(b, h, t0, L);
          for (int64_t i = 0; i < L; ++i)
            for (int64_t p = 0; p < P; ++p) {
              R inter = 0, intra = 0;
              for (int64_t n = 0; n < N; ++n) inter += Cv(b, t0 + i, g, n) * Sprev[sz(p * N + n)];
              for (int64_t j = 0; j <= i; ++j) {
                R cb = 0;
                for (int64_t n = 0; n < N; ++n) cb += Cv(b, t0 + i, g, n) * R(Bv(b, t0 + j, g, n));
                intra +=
                    cb * ex(cm[sz(i)] - cm[sz(j)]) * R(dtv(b, t0 + j, h)) * R(x(b, t0 + j, h, p));
              }
              y[sz((b * s.T + t0 + i) * s.d_inner() + h * P + p)] =
                  ex(cm[sz(i)]) * inter + intra + R(D[sz(h)]) * R(x(b, t0 + i, h, p));
            }
          R* S = &states[sz(((b * s.H + h) * nc + c) * P * N)];
          const R decay = ex(cm[sz(L - 1)]);
          for (int64_t p = 0; p < P; ++p)
            for (int64_t n = 0; n < N; ++n) {
              R loc = 0;
              for (int64_t j = 0; j < L; ++j)
                loc += ex(cm[sz(L - 1)] - cm[sz(j)]) * R(dtv(b, t0 + j, h)) *
                       R(x(b, t0 + j, h, p)) * R(Bv(b, t0 + j, g, n));
              S[p * N + n] = decay * Sprev[sz(p * N + n)] + loc;
            }
          std::copy(S, S + P * N, Sprev.begin());
        }
      }
  }

  // The adjoint, chunk by chunk in decreasing order, with Gout (P,N) the gradient reaching the
  // chunk's end state S_c from later chunks (0 for the last):
  //   M[i,j] = exp(cum_i - cum_j) (dy_i . u_j)                        (j <= i)
  //   du_j   = sum_{i>=j} (C_i . B_j) exp(cum_i - cum_j) dy_i + exp(cum_{L-1} - cum_j) Gout B_j
  //   dx_j   = dt_j du_j + D dy_j;   ddt_j = x_j . du_j + A dg_j
  //   dC_i   = exp(cum_i) S_{c-1}^T dy_i + sum_{j<=i} M[i,j] B_j          (a head's term)
  //   dB_j   = sum_{i>=j} M[i,j] C_i + exp(cum_{L-1} - cum_j) Gout^T u_j  (a head's term)
  //   dg_k   = (the gradient of the log-decay g_k) the sum of every term's dependence on g_k:
  //            sum_{i>=k} a_i + sum_{j<k} w_j + exp(cum_{L-1}) <Gout, S_{c-1}> + sum_{i>=k} r_i,
  //            a_i = exp(cum_i) dy_i . (S_{c-1} C_i)   (= C_i . the S_{c-1} term of dC_i)
  //            w_j = exp(cum_{L-1} - cum_j) u_j . (Gout B_j)   (= B_j . the Gout term of dB_j)
  //            r_i = sum_{j<i} W[i,j] - sum_{l>i} W[l,i],  W[i,j] = (C_i . B_j) M[i,j]
  //          (the pairs (i, j) with j < k <= i; in exact arithmetic r_i = C_i . dC_i - B_i . dB_i
  //          of the intra-chunk terms, but the diagonal W[i,i], in both and independent of the
  //          decays, is left out: under strong decay it dwarfs dg and FP32 would cancel it badly)
  //   dA += sum_k dg_k dt_k;  dD += sum_i dy_i . x_i
  //   Gout <- exp(cum_{L-1}) Gout + sum_i exp(cum_i) dy_i C_i^T   (the gradient reaching S_{c-1})
  // dB and dC of a group are summed over its heads. states: this forward pass's (or the
  // emulator's: the same quantity).
  void backward(std::vector<R>& dxbc, std::vector<R>& ddt, std::vector<R>& dA, std::vector<R>& dD,
                const Vec& dy, const std::vector<R>& states) const {
    const int64_t P = s.P, N = s.N, Q = s.chunk, nc = s.chunks(), Cx = s.xbc_cols();
    dxbc.assign(sz(s.B * s.T * Cx), R(0));
    ddt.assign(sz(s.B * s.T * s.H), R(0));
    dA.assign(sz(s.H), R(0));
    dD.assign(sz(s.H), R(0));
    auto dyv = [&](int64_t b, int64_t t, int64_t h, int64_t p) {
      return R(dy[sz((b * s.T + t) * s.d_inner() + h * P + p)]);
    };
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t h = 0; h < s.H; ++h) {
        const int64_t g = h / hpg();
        const R Ah = A[sz(h)], Dh = D[sz(h)];
        std::vector<R> Gout(sz(P * N), R(0));
        for (int64_t c = nc - 1; c >= 0; --c) {
          const int64_t t0 = c * Q, L = std::min(Q, s.T - t0);
          const std::vector<double> cm = cum(b, h, t0, L);
          const R* Sp = c ? &states[sz(((b * s.H + h) * nc + c - 1) * P * N)] : nullptr;
          auto sprev = [&](int64_t p, int64_t n) { return Sp ? Sp[p * N + n] : R(0); };
          R gin = 0;
          if (Sp)
            for (int64_t e = 0; e < P * N; ++e) gin += Gout[sz(e)] * Sp[e];
          gin *= ex(cm[sz(L - 1)]);
          std::vector<R> CB(sz(L * L), R(0)), M(sz(L * L), R(0));
          for (int64_t i = 0; i < L; ++i)
            for (int64_t j = 0; j <= i; ++j) {
              R cb = 0, dyu = 0;
              for (int64_t n = 0; n < N; ++n) cb += R(Cv(b, t0 + i, g, n)) * R(Bv(b, t0 + j, g, n));
              for (int64_t p = 0; p < P; ++p)
                dyu += dyv(b, t0 + i, h, p) * R(dtv(b, t0 + j, h)) * R(x(b, t0 + j, h, p));
              CB[sz(i * L + j)] = cb;
              M[sz(i * L + j)] = ex(cm[sz(i)] - cm[sz(j)]) * dyu;
            }
          std::vector<R> a(sz(L), R(0)), w(sz(L), R(0)), ddt_direct(sz(L), R(0));
          std::vector<double> r(sz(L), 0.0);  // (FP64: see dg below)
          for (int64_t j = 0; j < L; ++j) {
            const int64_t t = t0 + j;
            const R ej = ex(cm[sz(L - 1)] - cm[sz(j)]), dtj = dtv(b, t, h);
            R* row = &dxbc[sz((b * s.T + t) * Cx)];
            for (int64_t p = 0; p < P; ++p) {
              R du = 0, inter = 0;
              for (int64_t i = j; i < L; ++i)
                du += CB[sz(i * L + j)] * ex(cm[sz(i)] - cm[sz(j)]) * dyv(b, t0 + i, h, p);
              for (int64_t n = 0; n < N; ++n) inter += Gout[sz(p * N + n)] * R(Bv(b, t, g, n));
              du += ej * inter;
              row[h * P + p] = dtj * du + Dh * dyv(b, t, h, p);
              ddt_direct[sz(j)] += R(x(b, t, h, p)) * du;
              dD[sz(h)] += dyv(b, t, h, p) * R(x(b, t, h, p));
            }
            for (int64_t n = 0; n < N; ++n) {
              R dC = 0, dB = 0, ginter = 0;
              for (int64_t p = 0; p < P; ++p) {
                dC += dyv(b, t, h, p) * sprev(p, n);
                ginter += Gout[sz(p * N + n)] * R(x(b, t, h, p));
              }
              dC *= ex(cm[sz(j)]);
              const R dC_inter = dC, dB_inter = ej * dtj * ginter;
              for (int64_t k = 0; k <= j; ++k) dC += M[sz(j * L + k)] * R(Bv(b, t0 + k, g, n));
              dB = dB_inter;
              for (int64_t i = j; i < L; ++i) dB += M[sz(i * L + j)] * R(Cv(b, t0 + i, g, n));
              row[s.d_inner() + g * N + n] += dB;
              row[s.d_inner() + s.G * N + g * N + n] += dC;
              a[sz(j)] += R(Cv(b, t, g, n)) * dC_inter;
              w[sz(j)] += R(Bv(b, t, g, n)) * dB_inter;
            }
          }
          for (int64_t i = 0; i < L; ++i) {
            for (int64_t j = 0; j < i; ++j)
              r[sz(i)] += double(CB[sz(i * L + j)]) * M[sz(i * L + j)];
            for (int64_t l = i + 1; l < L; ++l)
              r[sz(i)] -= double(CB[sz(l * L + i)]) * M[sz(l * L + i)];
          }
          // r's sums and dg's scans in FP64: the suffix sums of the r_i cancel to the much smaller
          // sum over the pairs spanning k where a step's decay is strong, and do so exactly only
          // when each W[i,j] enters r_i and r_j as the same value and the sums do not round
          std::vector<double> dg(sz(L), gin);
          double suffix = 0, prefix = 0;
          for (int64_t k = L - 1; k >= 0; --k) {
            suffix += a[sz(k)] + r[sz(k)];
            dg[sz(k)] += suffix;
          }
          for (int64_t k = 0; k < L; ++k) {
            dg[sz(k)] += prefix;
            prefix += w[sz(k)];
          }
          for (int64_t k = 0; k < L; ++k) {
            ddt[sz((b * s.T + t0 + k) * s.H + h)] = ddt_direct[sz(k)] + R(dg[sz(k)]) * Ah;
            dA[sz(h)] += R(dg[sz(k)]) * R(dtv(b, t0 + k, h));
          }
          const R decay = ex(cm[sz(L - 1)]);
          for (int64_t p = 0; p < P; ++p)
            for (int64_t n = 0; n < N; ++n) {
              R loc = 0;
              for (int64_t i = 0; i < L; ++i)
                loc += ex(cm[sz(i)]) * dyv(b, t0 + i, h, p) * R(Cv(b, t0 + i, g, n));
              Gout[sz(p * N + n)] = decay * Gout[sz(p * N + n)] + loc;
            }
        }
      }
  }
};

// max |a - b| / max |b| (0 where both are 0)
template <class R>
double rel_err(const std::vector<R>& a, const Vec& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    num = std::max(num, std::fabs(static_cast<double>(a[i]) - b[i]));
    den = std::max(den, std::fabs(static_cast<double>(b[i])));
  }
  return den > 0 ? num / den : num;
}

struct Case {
  const char* name;
  SsmShape s;
  float dt_hi, A_lo;  // dt ~ U[0.02, dt_hi], A ~ U[A_lo, -0.5]
};

// (B, T, H, P, G, N, chunk)
const Case kCases[] = {
    {"T 19 over chunks of 5 (partial), G 2", {2, 19, 4, 8, 2, 8, 5}, 0.8f, -4.0f},
    {"T 7 < Q 16, G 1", {1, 7, 2, 4, 1, 4, 16}, 0.8f, -4.0f},
    {"T 37 over 16, G 3, N 32 > P 16", {1, 37, 6, 16, 3, 32, 16}, 0.8f, -4.0f},
    {"T 64 = 2 chunks of 32, G 4 = H", {1, 64, 4, 8, 4, 16, 32}, 0.8f, -4.0f},
    {"T 150 over 128, strong decay", {1, 150, 2, 8, 1, 8, 128}, 3.0f, -16.0f},
};

// The FP64 decomposition against the emulator: within the emulator's FP32 rounding error, which
// for these sizes (chains of at most T steps of 4 roundings, sums of at most N or P terms) stays
// below 2e-6 of each output's largest magnitude; a wrong or missing term is an O(1) error.
constexpr double kAlgebraTol = 2e-6;

TEST(SsdChunked, DecompositionMatchesSequentialScan) {
  for (const Case& cs : kCases) {
    const SsmShape& s = cs.s;
    const uint64_t seed = 700 + static_cast<uint64_t>(&cs - kCases);
    const Vec xbc = randn(sz(s.B * s.T * s.xbc_cols()), seed);
    const Vec dt = uniform(sz(s.B * s.T * s.H), seed + 1, 0.02f, cs.dt_hi);
    const Vec A = uniform(sz(s.H), seed + 2, cs.A_lo, -0.5f);
    const Vec D = uniform(sz(s.H), seed + 3, 0.5f, 1.5f);
    const Vec dy = randn(sz(s.B * s.T * s.d_inner()), seed + 4);

    Vec y(sz(s.B * s.T * s.d_inner())), states(sz(s.states_size()));
    ssm_scan_forward(y.data(), states.data(), xbc.data(), dt.data(), A.data(), D.data(), s);
    Vec dxbc(xbc.size()), ddt(dt.size()), dA(sz(s.H)), dD(sz(s.H), 0.0f);
    ssm_scan_backward(dxbc.data(), ddt.data(), dA.data(), dD.data(), dy.data(), xbc.data(),
                      dt.data(), A.data(), D.data(), states.data(), s);

    const Chunked<double> c64{s, xbc, dt, A, D};
    std::vector<double> y64, st64, dxbc64, ddt64, dA64, dD64;
    c64.forward(y64, st64);
    c64.backward(dxbc64, ddt64, dA64, dD64, dy, st64);
    const Chunked<float> c32{s, xbc, dt, A, D};
    std::vector<float> y32, st32, dxbc32, ddt32, dA32, dD32;
    c32.forward(y32, st32);
    c32.backward(dxbc32, ddt32, dA32, dD32, dy, st32);

    const std::pair<const char*, std::pair<double, double>> errs[] = {
        {"y", {rel_err(y64, y), rel_err(y32, y)}},
        {"states", {rel_err(st64, states), rel_err(st32, states)}},
        {"dxbc", {rel_err(dxbc64, dxbc), rel_err(dxbc32, dxbc)}},
        {"ddt", {rel_err(ddt64, ddt), rel_err(ddt32, ddt)}},
        {"dA", {rel_err(dA64, dA), rel_err(dA32, dA)}},
        {"dD", {rel_err(dD64, dD), rel_err(dD32, dD)}},
    };
    for (int64_t h = 0; h < s.H; ++h)
      std::printf("dA[%ld] emu %.9g f64 %.9g f32 %.9g A %g\n", (long)h, dA[h], dA64[h], dA32[h],
                  A[h]);
    for (const auto& [what, e] : errs) {
      std::printf("[ssd] %-40s %-6s rel err FP64 %.3g (tol %.3g), FP32 %.3g\n", cs.name, what,
                  e.first, kAlgebraTol, e.second);
      EXPECT_LE(e.first, kAlgebraTol) << cs.name << " " << what;
    }
  }
}

}  // namespace
}  // namespace fp4sim::emu
