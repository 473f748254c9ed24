#include "model/lora_svd.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>

#include "emu/philox.hpp"

#if FP4SIM_HAVE_LAPACK
#include <cblas.h>
#include <lapacke.h>
extern "C" void openblas_set_num_threads(int);
#endif

namespace fp4sim::model::lora {

#if !FP4SIM_HAVE_LAPACK

bool lora_svd_available() { return false; }
[[noreturn]] static void unavailable() {
  throw std::runtime_error(
      "LoRA-SVD needs LAPACK, and this build found none (Debian: liblapacke-dev, libopenblas-dev; "
      "then reconfigure)");
}
bool cholqr2(float*, int64_t, int64_t, float*, int64_t, bool) { unavailable(); }
Svd randomized_svd(const float*, int64_t, int64_t, int64_t, uint64_t, int, int) { unavailable(); }
Svd truncated_svd(const float*, int64_t, int64_t, int64_t) { unavailable(); }
double svd_residual(const float*, const Svd&) { unavailable(); }
void realign(const float*, int64_t, int64_t, int64_t, float, uint64_t, float*, float*, float*,
             const std::string&) {
  unavailable();
}

#else

bool lora_svd_available() { return true; }

namespace {

// OpenBLAS on one thread, once: the same sums in every run (and no threads beside OpenMP's)
void one_thread() {
  static const bool done = [] {
    openblas_set_num_threads(1);
    return true;
  }();
  (void)done;
}

using Mat = std::vector<double>;  // row-major

// C [m, n] = op(A) · op(B), FP64.
Mat gemm(const Mat& A, bool ta, const Mat& B, bool tb, int64_t m, int64_t n, int64_t kk) {
  Mat C(static_cast<size_t>(m * n), 0.0);
  const int64_t lda = ta ? m : kk, ldb = tb ? kk : n;
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<int>(m), static_cast<int>(n), static_cast<int>(kk), 1.0, A.data(),
              static_cast<int>(lda), B.data(), static_cast<int>(ldb), 0.0, C.data(),
              static_cast<int>(n));
  return C;
}

Mat widen(const float* p, int64_t count) { return Mat(p, p + count); }

// Q [m, c] of A [m, c] (m >= c) by Householder QR; R [c, c] upper where asked, with its diagonal
// made non-negative (Q's columns flipped alike), so that Q·R = A.
Mat householder_q(Mat A, int64_t m, int64_t c, Mat* R = nullptr) {
  std::vector<double> tau(static_cast<size_t>(c));
  int info = LAPACKE_dgeqrf(LAPACK_ROW_MAJOR, static_cast<int>(m), static_cast<int>(c), A.data(),
                            static_cast<int>(c), tau.data());
  if (info != 0) throw std::runtime_error("LAPACKE_dgeqrf failed (" + std::to_string(info) + ")");
  Mat r(static_cast<size_t>(c * c), 0.0);
  for (int64_t i = 0; i < c; ++i)
    for (int64_t j = i; j < c; ++j)
      r[static_cast<size_t>(i * c + j)] = A[static_cast<size_t>(i * c + j)];
  info = LAPACKE_dorgqr(LAPACK_ROW_MAJOR, static_cast<int>(m), static_cast<int>(c),
                        static_cast<int>(c), A.data(), static_cast<int>(c), tau.data());
  if (info != 0) throw std::runtime_error("LAPACKE_dorgqr failed (" + std::to_string(info) + ")");
  for (int64_t i = 0; i < c; ++i)
    if (r[static_cast<size_t>(i * c + i)] < 0) {
      for (int64_t j = i; j < c; ++j)
        r[static_cast<size_t>(i * c + j)] = -r[static_cast<size_t>(i * c + j)];
      for (int64_t row = 0; row < m; ++row)
        A[static_cast<size_t>(row * c + i)] = -A[static_cast<size_t>(row * c + i)];
    }
  if (R) *R = std::move(r);
  return A;
}

// One CholQR pass: R = chol(Aᵀ·A), A ← A·R⁻¹; false (A unchanged) where Aᵀ·A is not positive
// definite.
bool cholqr_pass(Mat& A, int64_t m, int64_t c, Mat& R) {
  R = gemm(A, true, A, false, c, c, m);
  if (LAPACKE_dpotrf(LAPACK_ROW_MAJOR, 'U', static_cast<int>(c), R.data(), static_cast<int>(c)) !=
      0)
    return false;
  for (int64_t i = 0; i < c; ++i)
    for (int64_t j = 0; j < i; ++j) R[static_cast<size_t>(i * c + j)] = 0.0;
  // A ← A·R⁻¹: solve X·R = A (right side, upper)
  cblas_dtrsm(CblasRowMajor, CblasRight, CblasUpper, CblasNoTrans, CblasNonUnit,
              static_cast<int>(m), static_cast<int>(c), 1.0, R.data(), static_cast<int>(c),
              A.data(), static_cast<int>(c));
  return true;
}

// Canonical signs: u_i's entry of largest magnitude (the first of equals) positive; v_i alike.
void canonical_signs(Svd& s) {
  for (int64_t i = 0; i < s.r; ++i) {
    int64_t at = 0;
    for (int64_t row = 1; row < s.n; ++row)
      if (std::fabs(s.U[static_cast<size_t>(row * s.r + i)]) >
          std::fabs(s.U[static_cast<size_t>(at * s.r + i)]))
        at = row;
    if (s.U[static_cast<size_t>(at * s.r + i)] >= 0) continue;
    for (int64_t row = 0; row < s.n; ++row) s.U[static_cast<size_t>(row * s.r + i)] *= -1;
    for (int64_t col = 0; col < s.k; ++col) s.Vt[static_cast<size_t>(i * s.k + col)] *= -1;
  }
}

// The SVD of A [m, c] (FP64, economy), its first r triples.
Svd svd_of(Mat A, int64_t m, int64_t c, int64_t r) {
  const int64_t mn = std::min(m, c);
  Mat S(static_cast<size_t>(mn)), U(static_cast<size_t>(m * mn)), Vt(static_cast<size_t>(mn * c)),
      superb(static_cast<size_t>(std::max<int64_t>(mn - 1, 1)));
  const int info =
      LAPACKE_dgesvd(LAPACK_ROW_MAJOR, 'S', 'S', static_cast<int>(m), static_cast<int>(c), A.data(),
                     static_cast<int>(c), S.data(), U.data(), static_cast<int>(mn), Vt.data(),
                     static_cast<int>(c), superb.data());
  if (info != 0) throw std::runtime_error("LAPACKE_dgesvd failed (" + std::to_string(info) + ")");
  Svd s;
  s.n = m;
  s.k = c;
  s.r = r;
  s.S.assign(S.begin(), S.begin() + r);
  s.U.resize(static_cast<size_t>(m * r));
  for (int64_t row = 0; row < m; ++row)
    for (int64_t i = 0; i < r; ++i)
      s.U[static_cast<size_t>(row * r + i)] = U[static_cast<size_t>(row * mn + i)];
  s.Vt.assign(Vt.begin(), Vt.begin() + r * c);
  return s;
}

// LAPACK and CBLAS count in int
void check_int(int64_t n, const char* what) {
  if (n > static_cast<int64_t>(INT32_MAX))
    throw std::invalid_argument(std::string(what) + " " + std::to_string(n) +
                                " exceeds LAPACK's int dimensions");
}

// max |QᵀQ − I| of Q [m, c]
double orthonormality(const Mat& Q, int64_t m, int64_t c) {
  const Mat G = gemm(Q, true, Q, false, c, c, m);
  double worst = 0;
  for (int64_t i = 0; i < c; ++i)
    for (int64_t j = 0; j < c; ++j)
      worst = std::max(worst, std::fabs(G[static_cast<size_t>(i * c + j)] - (i == j ? 1.0 : 0.0)));
  return worst;
}

void check_rank(int64_t n, int64_t k, int64_t r, int oversample, const char* fn) {
  check_int(n, "rows");
  check_int(k, "columns");
  if (r < 1 || r + oversample > std::min(n, k))
    throw std::invalid_argument(std::string(fn) + ": rank " + std::to_string(r) + " + " +
                                std::to_string(oversample) + " oversampling exceeds min(" +
                                std::to_string(n) + ", " + std::to_string(k) + ") of the [" +
                                std::to_string(n) + ", " + std::to_string(k) +
                                "] weight (recipe.lora_svd_rank must be at most min(N, K) - " +
                                std::to_string(oversample) + ")");
}

}  // namespace

bool cholqr2(float* L2, int64_t n, int64_t r, float* L1, int64_t k, bool force_householder) {
  one_thread();
  if (r < 1 || r > n)
    throw std::invalid_argument("cholqr2: L2 is [" + std::to_string(n) + ", " + std::to_string(r) +
                                "]: needs 1 <= r <= n");
  check_int(n, "rows");
  check_int(k, "columns");
  Mat A = widen(L2, n * r), R1, R2, R;
  bool householder = false;
  if (!force_householder && cholqr_pass(A, n, r, R1) && cholqr_pass(A, n, r, R2) &&
      orthonormality(A, n, r) <= 1e-10) {
    R = gemm(R2, false, R1, false, r, r, r);
  } else {
    householder = true;
    A = householder_q(widen(L2, n * r), n, r, &R);
  }
  for (int64_t i = 0; i < n * r; ++i) L2[i] = static_cast<float>(A[static_cast<size_t>(i)]);
  if (L1 && k > 0) {
    const Mat RL = gemm(R, false, widen(L1, r * k), false, r, k, r);
    for (int64_t i = 0; i < r * k; ++i) L1[i] = static_cast<float>(RL[static_cast<size_t>(i)]);
  }
  return householder;
}

Svd randomized_svd(const float* W, int64_t n, int64_t k, int64_t r, uint64_t seed, int oversample,
                   int power_iters) {
  one_thread();
  check_rank(n, k, r, oversample, "randomized_svd");
  const int64_t l = r + oversample;
  const Mat w = widen(W, n * k);
  // Ω [k, l]: standard normals by Box–Muller from Philox (key seed, counter (element pair, "rsvd"))
  Mat omega(static_cast<size_t>(k * l));
  for (int64_t i = 0; i < k * l; i += 2) {
    const Philox4x32 p = philox4x32_10(static_cast<uint32_t>(i), static_cast<uint32_t>(i >> 32), 0u,
                                       0x72737664u /* "rsvd" */, static_cast<uint32_t>(seed),
                                       static_cast<uint32_t>(seed >> 32));
    const double u1 = (static_cast<double>(p.v[0]) + 1.0) / 4294967296.0;  // (0, 1]
    const double u2 = static_cast<double>(p.v[1]) / 4294967296.0;
    const double rad = std::sqrt(-2.0 * std::log(u1)), ang = 6.283185307179586 * u2;
    omega[static_cast<size_t>(i)] = rad * std::cos(ang);
    if (i + 1 < k * l) omega[static_cast<size_t>(i + 1)] = rad * std::sin(ang);
  }
  Mat Q = householder_q(gemm(w, false, omega, false, n, l, k), n, l);
  for (int it = 0; it < power_iters; ++it) {
    const Mat Z = householder_q(gemm(w, true, Q, false, k, l, n), k, l);  // qr(Wᵀ·Q)
    Q = householder_q(gemm(w, false, Z, false, n, l, k), n, l);           // qr(W·Z)
  }
  const Mat B = gemm(Q, true, w, false, l, k, n);  // [l, k]
  Svd b = svd_of(B, l, k, r);
  Svd s;
  s.n = n;
  s.k = k;
  s.r = r;
  s.S = b.S;
  s.Vt = b.Vt;
  s.U = gemm(Q, false, b.U, false, n, r, l);
  canonical_signs(s);
  return s;
}

Svd truncated_svd(const float* W, int64_t n, int64_t k, int64_t r) {
  one_thread();
  check_rank(n, k, r, 0, "truncated_svd");
  Svd s = svd_of(widen(W, n * k), n, k, r);
  canonical_signs(s);
  return s;
}

double svd_residual(const float* W, const Svd& s) {
  one_thread();
  Mat US = s.U;
  for (int64_t row = 0; row < s.n; ++row)
    for (int64_t i = 0; i < s.r; ++i)
      US[static_cast<size_t>(row * s.r + i)] *= s.S[static_cast<size_t>(i)];
  const Mat P = gemm(US, false, s.Vt, false, s.n, s.k, s.r);
  double sq = 0;
  for (int64_t i = 0; i < s.n * s.k; ++i) {
    const double d = static_cast<double>(W[i]) - P[static_cast<size_t>(i)];
    sq += d * d;
  }
  return std::sqrt(sq);
}

void realign(const float* W, int64_t n, int64_t k, int64_t r, float beta, uint64_t seed,
             float* W_res, float* L2, float* L1, const std::string& what) {
  if (!(beta > 0) || !std::isfinite(beta))
    throw std::invalid_argument(what + ": recipe.lora_svd_beta must be positive, got " +
                                std::to_string(beta));
  for (int64_t i = 0; i < n * k; ++i)
    if (!std::isfinite(W[i]))
      throw std::invalid_argument(what + ": element " + std::to_string(i) + " is " +
                                  std::to_string(W[i]) + ": no SVD of a non-finite weight");
  Svd s;
  try {
    s = randomized_svd(W, n, k, r, seed);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(what + ": " + e.what());
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(what + ": " + e.what());
  }
  for (int64_t i = 0; i < n * r; ++i) L2[i] = static_cast<float>(s.U[static_cast<size_t>(i)]);
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < k; ++j)
      L1[i * k + j] = static_cast<float>(s.S[static_cast<size_t>(i)] *
                                         s.Vt[static_cast<size_t>(i * k + j)] / beta);
  // W_res = W − β·L2·L1 with the float32 factors: the product in FP64, the difference rounded once
  const Mat P = gemm(widen(L2, n * r), false, widen(L1, r * k), false, n, k, r);
  for (int64_t i = 0; i < n * k; ++i)
    W_res[i] = static_cast<float>(static_cast<double>(W[i]) -
                                  static_cast<double>(beta) * P[static_cast<size_t>(i)]);
}

#endif

}  // namespace fp4sim::model::lora
