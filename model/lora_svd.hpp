// LoRA-SVD's linear algebra (DESIGN.md §13, issue 37): a quantized linear's weight is
// W = W_res + β·L2·L1 (L2 [n, r], L1 [r, k], float32 masters). After each update CholQR2 keeps L2
// orthonormal without changing the product; at step 0 and every recipe.lora_svd_realign steps a
// seeded randomized SVD of W gives L2 = U_r, L1 = Σ_r V_rᵀ / β and W_res = W − β·L2·L1.
//
// On the host in FP64 through LAPACK and CBLAS (Debian's OpenBLAS and LAPACKE), with OpenBLAS on
// one thread so that every run gives the same bits; matrices row-major. Built where CMake finds
// them (FP4SIM_HAVE_LAPACK); lora_svd_available() says whether this build has them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fp4sim::model::lora {

// Whether this build has LAPACK (else every function below throws std::runtime_error).
bool lora_svd_available();

// [Q, R] = CholQR2(L2): twice G = L2ᵀ·L2 (FP64), R_i = chol(G) (upper, LAPACKE_dpotrf),
// L2 ← L2·R_i⁻¹; R = R_2·R_1. Where a Gram matrix is not positive definite, Householder QR
// instead (LAPACKE_dgeqrf/dorgqr; R's diagonal made non-negative). Then L2 ← Q and L1 ← R·L1
// (L1 [r, k]; absent when k is 0), each rounded once to float32. Returns true where the
// Householder fallback ran.
// Also the fallback where CholQR2's Q is not orthonormal to 1e-10 in FP64 (a condition number
// past ~1e8, where the Gram matrix is still positive definite). force_householder: always the
// fallback (tests compare the two).
bool cholqr2(float* L2, int64_t n, int64_t r, float* L1, int64_t k, bool force_householder = false);

// A rank-r SVD W ≈ U·diag(S)·Vt: U [n, r], S [r] (descending), Vt [r, k], FP64. Each singular
// pair's signs canonical: the entry of u_i of largest magnitude (the first of equals) positive.
struct Svd {
  int64_t n = 0, k = 0, r = 0;
  std::vector<double> U, S, Vt;
};

inline constexpr int kOversample = 8;  // the randomized SVD's extra columns
inline constexpr int kPowerIters = 2;  // its power iterations (a QR between each)

// The randomized SVD of W [n, k] (float32; Halko, Martinsson and Tropp): Ω [k, r + p] of standard
// normals from Philox (key seed; Box–Muller), Y = W·Ω, Q = qr(Y); `power_iters` times
// Q = qr(W·qr(Wᵀ·Q)); B = Qᵀ·W, B's SVD (LAPACKE_dgesvd), U = Q·U_B, the first r. Needs
// r + oversample <= min(n, k) (std::invalid_argument naming the shapes otherwise).
Svd randomized_svd(const float* W, int64_t n, int64_t k, int64_t r, uint64_t seed,
                   int oversample = kOversample, int power_iters = kPowerIters);

// The exact rank-r truncation of W's SVD (LAPACKE_dgesvd), canonical signs: the reference the
// randomized SVD is measured against.
Svd truncated_svd(const float* W, int64_t n, int64_t k, int64_t r);

// ‖W − U·diag(S)·Vt‖_F in FP64.
double svd_residual(const float* W, const Svd& s);

// Realignment: W [n, k] -> L2 = U_r [n, r], L1 = Σ_r·V_rᵀ / β [r, k] (float32, each rounded once
// from FP64), W_res = W − β·L2·L1 with the float32 factors (the product in FP64, the difference
// rounded once), so that W_res + β·L2·L1 is W up to float32 rounding. `what` names the weight in
// errors.
void realign(const float* W, int64_t n, int64_t k, int64_t r, float beta, uint64_t seed,
             float* W_res, float* L2, float* L1, const std::string& what);

}  // namespace fp4sim::model::lora
