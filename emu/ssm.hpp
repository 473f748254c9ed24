// Reference ops of the Mamba-2 mixer's high-precision core (DESIGN.md §12), forward and backward:
// the causal depthwise conv1d + SiLU over [x | B | C], dt = softplus(dt_raw + dt_bias) with
// A = -exp(A_log), the selective scan (the state recurrence and the D skip), and the gated grouped
// RMSNorm. The in_proj and out_proj GEMMs around them are recipe linear layers (emu/matmul.hpp and
// the quantized GEMMs); nothing here is quantized.
//
// In the style of llm.c's CPU reference: plain loops, FP32 arithmetic, every operation rounded
// (host code is built with -ffp-contract=off, so no FMA), in the order DESIGN.md §12 writes it;
// every sum runs from +0 in the order its comment names; OpenMP only across independent outputs,
// so the bits do not depend on the thread count. Each backward pass is the exact reverse-mode
// adjoint of its forward pass's sequence of operations, evaluated in FP32 on the forward's values
// (recomputed bit for bit where they are not saved). exp and log1p are fp4sim's own
// (emu/ssm_math.hpp: binary64 inside, one FP32 rounding; the C library's differ between libraries
// and CPUs), and every elementwise expression (SiLU, sigmoid, softplus, the state update) is
// written once there. The CUDA twins (gpu/ssm.cu) keep these names and argument orders, call the
// same expressions and perform the same FP32 operations in the same order: bitwise the same
// results.
//
// Gradients: an input's gradient is written (every element, nothing read from the buffer before);
// a parameter's gradient (conv weight and bias, dt_bias, A_log, D, norm weight) is summed over the
// batch in the order named, and that sum is then added once to the caller's buffer (+=), so
// micro-batches accumulate as the other ops' parameter gradients do. The sums over the B*T rows
// (r = b*T + t; conv weight and bias, dt_bias, norm weight) run in kSsmSumRows blocks: per block
// of consecutive rows a partial sum from +0 in increasing r, then the partials from +0 in
// increasing block order (a fixed two-level order, which the CUDA twins evaluate with a thread
// block per row block and get the same bits).
//
// Layouts: activations are (B,T,channels) row-major, one row a token. The in_proj output is split
// as [z | x | B | C | dt_raw] (2*d_inner + 2*G*N + H columns); the ops that read a column slice of
// it (conv1d: [x | B | C]; dt: dt_raw; the gated norm: z) take a pointer to the slice's first
// element and `ld`, its row stride in elements (ld >= the slice's width), and write the slice's
// gradient into the in_proj output gradient the same way, so no split copy is needed. Everything
// else is dense.
#pragma once

#include <cstdint>

namespace fp4sim::emu {

// The rows of a parameter gradient's partial sums (see "Gradients" above).
inline constexpr int64_t kSsmSumRows = 256;

// ---- causal depthwise conv1d + SiLU ------------------------------------------------------------
// out (B,T,C) = silu(u), u[b,t,c] = bias[c] + sum_{k=0..W-1} weight[c,k] * inp[b, t-W+1+k, c],
// the sum evaluated left to right: u = bias; u = u + weight[c,k] * inp[...] for k = 0..W-1,
// skipping the terms before the sequence start (inp is 0 there; every window starts at t = 0, no
// reset at document boundaries). silu(u) = u / (1 + exp(-u)). inp (B,T,C) with row stride
// ld_inp; weight (C,W) (PyTorch's Conv1d weight (C,1,W)); bias (C). C = d_inner + 2*G*N.
// Nothing but out is saved: the backward pass recomputes u from inp.
void conv1d_silu_forward(float* out, const float* inp, int64_t ld_inp, const float* weight,
                         const float* bias, int64_t B, int64_t T, int64_t C, int64_t W);
// du = dout * silu'(u), silu'(u) = sig * (1 + u * (1 - sig)), sig = 1 / (1 + exp(-u)), u
// recomputed as in the forward pass. dinp (B,T,C), row stride ld_dinp, written:
// dinp[b,s,c] = sum_{k=0..W-1} weight[c,k] * du[b, s+W-1-k, c] from +0 in increasing k (terms past
// the sequence end skipped). dweight (C,W) += the row sum (rows r = b*T + t in kSsmSumRows
// blocks) of du[b,t,c] * inp[b,t-W+1+k,c]; dbias (C) += the row sum of du[b,t,c].
void conv1d_silu_backward(float* dinp, int64_t ld_dinp, float* dweight, float* dbias,
                          const float* dout, const float* inp, int64_t ld_inp, const float* weight,
                          const float* bias, int64_t B, int64_t T, int64_t C, int64_t W);

// ---- dt and A ----------------------------------------------------------------------------------
// dt (B,T,H) = softplus(dt_raw + dt_bias[h]), the sum in FP32; softplus(u) = u for u > 20 (as
// PyTorch's threshold, and mamba_ssm's dt_softplus), else log1p(exp(u)): exp_f32 then
// log1p_f32 (emu/ssm_math.hpp), each rounded to FP32. log1p keeps softplus's relative accuracy for
// u << 0, where softplus(u) ~ exp(u) and log(1 + exp(u)) would round 1 + exp(u) to 1 (giving 0)
// once exp(u) < 2^-24; for u <= 20, exp(u) <= 4.9e8 cannot overflow, and log1p(exp(20)) rounds to
// 20 in FP32, so the two branches meet. A (H) = -exp(A_log[h]). dt_raw (B,T,H) with row stride
// ld_dt_raw.
void ssm_dt_forward(float* dt, float* A, const float* dt_raw, int64_t ld_dt_raw,
                    const float* dt_bias, const float* A_log, int64_t B, int64_t T, int64_t H);
// du = ddt * (u > 20 ? 1 : e / (1 + e)), e = exp(u), u = dt_raw + dt_bias recomputed. ddt_raw
// (B,T,H), row stride ld_ddt_raw, written = du; ddt_bias (H) += the row sum (kSsmSumRows blocks)
// of du;
// dA_log (H) += dA * A, A = -exp(A_log) recomputed. ddt (B,T,H), dA (H) from ssm_scan_backward.
void ssm_dt_backward(float* ddt_raw, int64_t ld_ddt_raw, float* ddt_bias, float* dA_log,
                     const float* ddt, const float* dA, const float* dt_raw, int64_t ld_dt_raw,
                     const float* dt_bias, const float* A_log, int64_t B, int64_t T, int64_t H);

// ---- the selective scan ------------------------------------------------------------------------
// Sizes: H heads of P channels (d_inner = H*P), G groups of B and C (H % G == 0; head h reads the
// group g = h / (H/G)), state N, and `chunk` (Q >= 1): the interval of the states the forward
// pass saves for the backward pass (the config's SSD chunk, which the CUDA chunked scan also
// uses). These functions do not check sizes: their callers do.
struct SsmShape {
  int64_t B = 0, T = 0, H = 0, P = 0, G = 0, N = 0, chunk = 128;
  int64_t d_inner() const { return H * P; }
  int64_t xbc_cols() const { return H * P + 2 * G * N; }  // the conv channels [x | B | C]
  int64_t chunks() const { return (T + chunk - 1) / chunk; }
  // floats of the saved states: B*H*chunks*P*N
  int64_t states_size() const { return B * H * chunks() * P * N; }
};

// Per batch b and head h (group g = h / (H/G)), S (P,N) = 0, then for t = 0..T-1 in order:
//   a = exp(dt_t * A_h)                          (the product, then exp, each rounded)
//   S[p][n] = a * S[p][n] + dt_t * (x_t[p] * B_t[n])
//   y_t[p] = (sum_n S[p][n] * C_t[n]) + D_h * x_t[p]   (the sum from +0 in increasing n)
// xbc (B,T,xbc_cols): the conv output [x (H*P: head h at columns h*P..) | B (G*N) | C (G*N)];
// dt (B,T,H); A, D (H). y (B,T,H*P).
// Saved for the backward pass: states (B,H,chunks,P,N) = S at the end of every chunk of Q steps
// (states[b,h,c] = S_t for t = min((c+1)Q, T) - 1; the last is the final state), FP32. That is
// 4*P*N*ceil(T/Q) bytes per batch and head instead of 4*P*N*T for every state: for T 4096, Q 128,
// H 8, P 64, N 64 it is 512 KiB per sequence against 16 MiB. states may be null (forward only).
void ssm_scan_forward(float* y, float* states, const float* xbc, const float* dt, const float* A,
                      const float* D, const SsmShape& s);
// The reverse recurrence. Per batch b and group g, for the group's heads h in increasing order, for
// the chunks in decreasing order: the chunk's states are recomputed from the saved state before
// it (zero for the first chunk) by the forward's own step, bit for bit; then for t in decreasing
// order, with Gs (P,N) the gradient reaching S_t from later steps (0 at t = T-1):
//   Gs[p][n] = Gs[p][n] + dy_t[p] * C_t[n]
//   dC_t[n] = sum_p S_t[p][n] * dy_t[p]            (from +0, increasing p)
//   r[p] = sum_n Gs[p][n] * B_t[n]                 (from +0, increasing n)
//   dx_t[p] = D_h * dy_t[p] + dt_t * r[p]
//   dB_t[n] = dt_t * (sum_p Gs[p][n] * x_t[p])     (from +0, increasing p)
//   q = sum_n (sum_p Gs[p][n] * S_{t-1}[p][n])     (inner from +0 in increasing p, outer likewise)
//   ddtA = q * a        (the gradient of dt_t * A_h; a = exp(dt_t * A_h) recomputed)
//   ddt_t = (sum_p x_t[p] * r[p]) + ddtA * A_h     (the sum from +0, increasing p)
//   dA_h (sum) += ddtA * dt_t;  dD_h (sum) += sum_p dy_t[p] * x_t[p]  (from +0, increasing p)
//   Gs[p][n] = a * Gs[p][n]                         (the gradient reaching S_{t-1})
// dxbc (B,T,xbc_cols) written: dx per head; dB and dC of a group summed over its heads, from +0 in
// increasing h. ddt (B,T,H) written. dA (H) written (not a parameter: ssm_dt_backward turns it
// into dA_log): per b the sum over t in decreasing order, then over b in increasing order. dD (H)
// += the same kind of sum. dy (B,T,H*P); states from ssm_scan_forward with the same shape.
void ssm_scan_backward(float* dxbc, float* ddt, float* dA, float* dD, const float* dy,
                       const float* xbc, const float* dt, const float* A, const float* D,
                       const float* states, const SsmShape& s);

// ---- gated grouped RMSNorm (Mamba-2's RMSNormGated, norm_before_gate = False) ------------------
// Per row (N rows, C = d_inner channels) and group j of gs = C/G channels (C % G == 0):
//   g_i = inp_i * silu(z_i), silu(z) = z / (1 + exp(-z))
//   ms = (sum_i g_i * g_i) / gs (from +0, increasing i); s = 1 / sqrt(ms + eps)
//   out_i = (g_i * s) * weight_i            (rmsnorm_forward's order, on g)
// rstd (N,G) = s saved; g is recomputed by the backward pass. inp, out (N,C) dense; z (N,C) with
// row stride ld_z; weight (C).
void gated_rmsnorm_forward(float* out, float* rstd, const float* inp, const float* z, int64_t ld_z,
                           const float* weight, int64_t N, int64_t C, int64_t G, float eps = 1e-5f);
// Per row and group, g recomputed, dy = dout (rmsnorm_backward's order, on g):
//   k = (((sum_i (dy_i * weight_i) * g_i) * s) * s * s) / gs
//   dg_i = (dy_i * weight_i) * s - g_i * k
//   dinp_i = dg_i * silu(z_i);  dz_i = (dg_i * inp_i) * silu'(z_i)
// with silu'(z) = sig * (1 + z * (1 - sig)), sig = 1 / (1 + exp(-z)). dinp (N,C) dense and dz (N,C)
// with row stride ld_dz written; dweight (C) += the row sum (kSsmSumRows blocks) of
// (dy_i * g_i) * s.
void gated_rmsnorm_backward(float* dinp, float* dz, int64_t ld_dz, float* dweight,
                            const float* dout, const float* inp, const float* z, int64_t ld_z,
                            const float* weight, const float* rstd, int64_t N, int64_t C,
                            int64_t G);

}  // namespace fp4sim::emu
