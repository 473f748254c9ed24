#include "emu/ssm.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "emu/ssm_math.hpp"

namespace fp4sim::emu {

// (the elementwise expressions, exp and log1p: emu/ssm_math.hpp, shared with gpu/ssm.cu)

namespace {

// One step of the recurrence: next[p][n] = a * prev[p][n] + dt * (x[p] * b[n]) (P,N). The forward
// pass and the backward pass's recomputation both run this, so their states are the same bits.
// next may be prev.
void scan_step(float* next, const float* prev, float a, float dt, const float* x, const float* b,
               int64_t P, int64_t N) {
  for (int64_t p = 0; p < P; ++p) {
    const float xp = x[p];
    const float* sp = prev + p * N;
    float* np = next + p * N;
    for (int64_t n = 0; n < N; ++n) np[n] = ssm_state_update(a, sp[n], dt, xp, b[n]);
  }
}

}  // namespace

// ---- causal depthwise conv1d + SiLU ------------------------------------------------------------

namespace {
// u (C) of row t of one sequence x (T rows of ld): bias, then the window's terms in increasing k.
// wt (W,C) is the weight transposed, so the loop over channels is contiguous.
void conv_row(float* u, const float* x, int64_t ld, const float* wt, const float* bias, int64_t t,
              int64_t C, int64_t W) {
  for (int64_t c = 0; c < C; ++c) u[c] = bias[c];
  for (int64_t k = 0; k < W; ++k) {
    const int64_t s = t - W + 1 + k;
    if (s < 0) continue;
    const float* xs = x + s * ld;
    const float* wk = wt + k * C;
    for (int64_t c = 0; c < C; ++c) u[c] = u[c] + wk[c] * xs[c];
  }
}

std::vector<float> transpose_weight(const float* weight, int64_t C, int64_t W) {
  std::vector<float> wt(static_cast<size_t>(W * C));
  for (int64_t c = 0; c < C; ++c)
    for (int64_t k = 0; k < W; ++k) wt[static_cast<size_t>(k * C + c)] = weight[c * W + k];
  return wt;
}
}  // namespace

void conv1d_silu_forward(float* out, const float* inp, int64_t ld_inp, const float* weight,
                         const float* bias, int64_t B, int64_t T, int64_t C, int64_t W) {
  const std::vector<float> wt = transpose_weight(weight, C, W);
#pragma omp parallel
  {
    std::vector<float> u(static_cast<size_t>(C));
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        conv_row(u.data(), inp + b * T * ld_inp, ld_inp, wt.data(), bias, t, C, W);
        float* o = out + (b * T + t) * C;
        for (int64_t c = 0; c < C; ++c) o[c] = ssm_silu(u[c]);
      }
  }
}

void conv1d_silu_backward(float* dinp, int64_t ld_dinp, float* dweight, float* dbias,
                          const float* dout, const float* inp, int64_t ld_inp, const float* weight,
                          const float* bias, int64_t B, int64_t T, int64_t C, int64_t W) {
  const std::vector<float> wt = transpose_weight(weight, C, W);
  // du (B,T,C): the gradient of the pre-activation, u recomputed
  std::vector<float> du(static_cast<size_t>(B * T * C));
#pragma omp parallel
  {
    std::vector<float> u(static_cast<size_t>(C));
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        conv_row(u.data(), inp + b * T * ld_inp, ld_inp, wt.data(), bias, t, C, W);
        const float* dy = dout + (b * T + t) * C;
        float* d = &du[static_cast<size_t>((b * T + t) * C)];
        for (int64_t c = 0; c < C; ++c) d[c] = dy[c] * ssm_silu_grad(u[c]);
      }
  }
  // dinp[b,s,c] = sum_k weight[c,k] * du[b, s+W-1-k, c], from +0 in increasing k
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < T; ++s) {
      float* dx = dinp + (b * T + s) * ld_dinp;
      for (int64_t c = 0; c < C; ++c) dx[c] = 0.0f;
      for (int64_t k = 0; k < W; ++k) {
        const int64_t t = s + W - 1 - k;
        if (t >= T) continue;
        const float* d = &du[static_cast<size_t>((b * T + t) * C)];
        const float* wk = &wt[static_cast<size_t>(k * C)];
        for (int64_t c = 0; c < C; ++c) dx[c] = dx[c] + wk[c] * d[c];
      }
    }
  // dweight, dbias: per channel, the row sums (kSsmSumRows blocks), each added once. A block of
  // channels an iteration; within it the rows run in order, the channels are independent.
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (C + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t c0 = blk * kBlock, nc = std::min(kBlock, C - c0);
    // the partial sums of the current row block (dw: W per channel, then db) and their totals
    std::vector<float> part(static_cast<size_t>((W + 1) * nc), 0.0f), total(part.size(), 0.0f);
    float* const db = &part[static_cast<size_t>(W * nc)];
    auto fold = [&] {
      for (size_t i = 0; i < part.size(); ++i) {
        total[i] = total[i] + part[i];
        part[i] = 0.0f;
      }
    };
    for (int64_t r = 0; r < B * T; ++r) {
      if (r > 0 && r % kSsmSumRows == 0) fold();
      const int64_t b = r / T, t = r % T;
      const float* d = &du[static_cast<size_t>(r * C + c0)];
      for (int64_t c = 0; c < nc; ++c) db[c] = db[c] + d[c];
      for (int64_t k = 0; k < W; ++k) {
        const int64_t s = t - W + 1 + k;
        if (s < 0) continue;
        const float* x = inp + (b * T + s) * ld_inp + c0;
        float* dwk = &part[static_cast<size_t>(k * nc)];
        for (int64_t c = 0; c < nc; ++c) dwk[c] = dwk[c] + d[c] * x[c];
      }
    }
    fold();
    for (int64_t c = 0; c < nc; ++c) {
      dbias[c0 + c] += total[static_cast<size_t>(W * nc + c)];
      for (int64_t k = 0; k < W; ++k)
        dweight[(c0 + c) * W + k] += total[static_cast<size_t>(k * nc + c)];
    }
  }
}

// ---- dt and A ----------------------------------------------------------------------------------

void ssm_dt_forward(float* dt, float* A, const float* dt_raw, int64_t ld_dt_raw,
                    const float* dt_bias, const float* A_log, int64_t B, int64_t T, int64_t H) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < B * T; ++r)
    for (int64_t h = 0; h < H; ++h)
      dt[r * H + h] = ssm_softplus(dt_raw[r * ld_dt_raw + h] + dt_bias[h]);
  for (int64_t h = 0; h < H; ++h) A[h] = -exp_f32(A_log[h]);
}

void ssm_dt_backward(float* ddt_raw, int64_t ld_ddt_raw, float* ddt_bias, float* dA_log,
                     const float* ddt, const float* dA, const float* dt_raw, int64_t ld_dt_raw,
                     const float* dt_bias, const float* A_log, int64_t B, int64_t T, int64_t H) {
  // rows in order, the dt_bias sums in kSsmSumRows blocks (a partial per block, then the total)
  std::vector<float> part(static_cast<size_t>(H), 0.0f), total(part.size(), 0.0f);
  auto fold = [&] {
    for (size_t h = 0; h < part.size(); ++h) {
      total[h] = total[h] + part[h];
      part[h] = 0.0f;
    }
  };
  for (int64_t r = 0; r < B * T; ++r) {
    if (r > 0 && r % kSsmSumRows == 0) fold();
    for (int64_t h = 0; h < H; ++h) {
      const float u = dt_raw[r * ld_dt_raw + h] + dt_bias[h];
      const float du = ssm_softplus_backward(u, ddt[r * H + h]);
      ddt_raw[r * ld_ddt_raw + h] = du;
      part[static_cast<size_t>(h)] = part[static_cast<size_t>(h)] + du;
    }
  }
  fold();
  for (int64_t h = 0; h < H; ++h) {
    ddt_bias[h] += total[static_cast<size_t>(h)];
    dA_log[h] += dA[h] * -exp_f32(A_log[h]);
  }
}

// ---- the selective scan ------------------------------------------------------------------------

void ssm_scan_forward(float* y, float* states, const float* xbc, const float* dt, const float* A,
                      const float* D, const SsmShape& s) {
  const int64_t T = s.T, H = s.H, P = s.P, N = s.N, Q = s.chunk, HP = s.d_inner(),
                Cx = s.xbc_cols(), nc = s.chunks(), heads_per_group = s.H / s.G;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / heads_per_group;
      std::vector<float> S(static_cast<size_t>(P * N), 0.0f);
      for (int64_t t = 0; t < T; ++t) {
        const float* row = xbc + (b * T + t) * Cx;
        const float* x = row + h * P;
        const float* Bt = row + HP + g * N;
        const float* Ct = row + HP + s.G * N + g * N;
        const float dtv = dt[(b * T + t) * H + h];
        const float a = exp_f32(dtv * A[h]);
        scan_step(S.data(), S.data(), a, dtv, x, Bt, P, N);
        float* yt = y + (b * T + t) * HP + h * P;
        for (int64_t p = 0; p < P; ++p) {
          const float* Sp = &S[static_cast<size_t>(p * N)];
          float acc = 0.0f;
          for (int64_t n = 0; n < N; ++n) acc = acc + Sp[n] * Ct[n];
          yt[p] = acc + D[h] * x[p];
        }
        if (states && (t % Q == Q - 1 || t == T - 1))
          std::memcpy(states + ((b * H + h) * nc + t / Q) * P * N, S.data(),
                      static_cast<size_t>(P * N) * sizeof(float));
      }
    }
}

void ssm_scan_backward(float* dxbc, float* ddt, float* dA, float* dD, const float* dy,
                       const float* xbc, const float* dt, const float* A, const float* D,
                       const float* states, const SsmShape& s) {
  const int64_t T = s.T, H = s.H, P = s.P, N = s.N, G = s.G, Q = s.chunk, HP = s.d_inner(),
                Cx = s.xbc_cols(), nc = s.chunks(), heads_per_group = s.H / s.G;
  // per (b, h): the sums over t of dA and dD, added over b in order afterwards
  std::vector<float> dA_bh(static_cast<size_t>(s.B * H)), dD_bh(dA_bh.size());
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t g = 0; g < G; ++g) {
      // buf: the states of one chunk, buf[i] = S_{t0-1+i} (buf[0] the state before the chunk);
      // a: the chunk's decays; Gs (P,N): the state gradient; per step: qn (N) the inner sums of
      // q, dBs, dCs (N) this head's dB and dC
      std::vector<float> buf(static_cast<size_t>((Q + 1) * P * N)), a(static_cast<size_t>(Q)),
          Gs(static_cast<size_t>(P * N)), qn(static_cast<size_t>(N)), dBs(qn.size()),
          dCs(qn.size());
      for (int64_t t = 0; t < T; ++t) {
        float* bc = dxbc + (b * T + t) * Cx + HP;
        for (int64_t n = 0; n < N; ++n) bc[g * N + n] = bc[G * N + g * N + n] = 0.0f;
      }
      for (int64_t h = g * heads_per_group; h < (g + 1) * heads_per_group; ++h) {
        std::fill(Gs.begin(), Gs.end(), 0.0f);
        float dA_sum = 0.0f, dD_sum = 0.0f;
        for (int64_t c = nc - 1; c >= 0; --c) {
          const int64_t t0 = c * Q, t1 = std::min(T, t0 + Q);
          if (c == 0)
            std::fill(buf.begin(), buf.begin() + P * N, 0.0f);
          else
            std::memcpy(buf.data(), states + ((b * H + h) * nc + c - 1) * P * N,
                        static_cast<size_t>(P * N) * sizeof(float));
          for (int64_t t = t0; t < t1; ++t) {  // the forward's steps, recomputed
            const float* row = xbc + (b * T + t) * Cx;
            const float dtv = dt[(b * T + t) * H + h];
            a[t - t0] = exp_f32(dtv * A[h]);
            scan_step(&buf[static_cast<size_t>((t - t0 + 1) * P * N)],
                      &buf[static_cast<size_t>((t - t0) * P * N)], a[t - t0], dtv, row + h * P,
                      row + HP + g * N, P, N);
          }
          for (int64_t t = t1 - 1; t >= t0; --t) {
            const float* row = xbc + (b * T + t) * Cx;
            const float* x = row + h * P;
            const float* Bt = row + HP + g * N;
            const float* Ct = row + HP + G * N + g * N;
            const float* dyt = dy + (b * T + t) * HP + h * P;
            const float* St = &buf[static_cast<size_t>((t - t0 + 1) * P * N)];
            const float* Sprev = &buf[static_cast<size_t>((t - t0) * P * N)];
            const float dtv = dt[(b * T + t) * H + h], at = a[t - t0];
            float* drow = dxbc + (b * T + t) * Cx;
            std::fill(qn.begin(), qn.end(), 0.0f);
            std::fill(dBs.begin(), dBs.end(), 0.0f);
            std::fill(dCs.begin(), dCs.end(), 0.0f);
            float sum_xr = 0.0f, sum_dyx = 0.0f;
            for (int64_t p = 0; p < P; ++p) {
              float* Gp = &Gs[static_cast<size_t>(p * N)];
              const float* Sp = St + p * N;
              const float* Spp = Sprev + p * N;
              const float dyp = dyt[p], xp = x[p];
              for (int64_t n = 0; n < N; ++n) {
                Gp[n] = Gp[n] + dyp * Ct[n];
                dCs[n] = dCs[n] + Sp[n] * dyp;
                dBs[n] = dBs[n] + Gp[n] * xp;
                qn[n] = qn[n] + Gp[n] * Spp[n];
              }
              float r = 0.0f;
              for (int64_t n = 0; n < N; ++n) r = r + Gp[n] * Bt[n];
              for (int64_t n = 0; n < N; ++n) Gp[n] = at * Gp[n];
              drow[h * P + p] = D[h] * dyp + dtv * r;
              sum_xr = sum_xr + xp * r;
              sum_dyx = sum_dyx + dyp * xp;
            }
            float q = 0.0f;
            for (int64_t n = 0; n < N; ++n) q = q + qn[n];
            const float ddtA = q * at;
            ddt[(b * T + t) * H + h] = sum_xr + ddtA * A[h];
            dA_sum = dA_sum + ddtA * dtv;
            dD_sum = dD_sum + sum_dyx;
            float* dB = drow + HP + g * N;
            float* dC = drow + HP + G * N + g * N;
            for (int64_t n = 0; n < N; ++n) {
              dB[n] = dB[n] + dtv * dBs[n];
              dC[n] = dC[n] + dCs[n];
            }
          }
        }
        dA_bh[static_cast<size_t>(b * H + h)] = dA_sum;
        dD_bh[static_cast<size_t>(b * H + h)] = dD_sum;
      }
    }
  for (int64_t h = 0; h < H; ++h) {
    float sa = 0.0f, sd = 0.0f;
    for (int64_t b = 0; b < s.B; ++b) {
      sa = sa + dA_bh[static_cast<size_t>(b * H + h)];
      sd = sd + dD_bh[static_cast<size_t>(b * H + h)];
    }
    dA[h] = sa;
    dD[h] += sd;
  }
}

// ---- gated grouped RMSNorm ---------------------------------------------------------------------

void gated_rmsnorm_forward(float* out, float* rstd, const float* inp, const float* z, int64_t ld_z,
                           const float* weight, int64_t N, int64_t C, int64_t G, float eps) {
  const int64_t gs = C / G;
#pragma omp parallel
  {
    std::vector<float> g(static_cast<size_t>(gs));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < N; ++r)
      for (int64_t j = 0; j < G; ++j) {
        const float* x = inp + r * C + j * gs;
        const float* zr = z + r * ld_z + j * gs;
        float ms = 0.0f;
        for (int64_t i = 0; i < gs; ++i) {
          g[i] = x[i] * ssm_silu(zr[i]);
          ms = ms + g[i] * g[i];
        }
        ms = ms / static_cast<float>(gs);
        const float sc = 1.0f / std::sqrt(ms + eps);
        float* o = out + r * C + j * gs;
        const float* w = weight + j * gs;
        for (int64_t i = 0; i < gs; ++i) o[i] = (g[i] * sc) * w[i];
        rstd[r * G + j] = sc;
      }
  }
}

void gated_rmsnorm_backward(float* dinp, float* dz, int64_t ld_dz, float* dweight,
                            const float* dout, const float* inp, const float* z, int64_t ld_z,
                            const float* weight, const float* rstd, int64_t N, int64_t C,
                            int64_t G) {
  const int64_t gs = C / G;
  // dw_terms (N,C): (dy_i * g_i) * s of every row, summed over rows per channel afterwards
  std::vector<float> dw_terms(static_cast<size_t>(N * C));
#pragma omp parallel
  {
    // g, and silu(z) and sigmoid(z) from one exp(-z) (ssm_silu_sigmoid)
    std::vector<float> g(static_cast<size_t>(gs)), sz(g.size()), sig(g.size());
#pragma omp for schedule(static)
    for (int64_t r = 0; r < N; ++r)
      for (int64_t j = 0; j < G; ++j) {
        const float* x = inp + r * C + j * gs;
        const float* zr = z + r * ld_z + j * gs;
        const float* dy = dout + r * C + j * gs;
        const float* w = weight + j * gs;
        const float sc = rstd[r * G + j];
        float dot = 0.0f;
        for (int64_t i = 0; i < gs; ++i) {
          ssm_silu_sigmoid(zr[i], &sz[i], &sig[i]);
          g[i] = x[i] * sz[i];
          dot = dot + (dy[i] * w[i]) * g[i];
        }
        const float k = dot * sc * sc * sc / static_cast<float>(gs);
        float* dx = dinp + r * C + j * gs;
        float* dzr = dz + r * ld_dz + j * gs;
        float* dwt = &dw_terms[static_cast<size_t>(r * C + j * gs)];
        for (int64_t i = 0; i < gs; ++i) {
          const float dg = (dy[i] * w[i]) * sc - g[i] * k;
          dx[i] = dg * sz[i];
          dzr[i] = (dg * x[i]) * ssm_silu_grad_from(zr[i], sig[i]);
          dwt[i] = (dy[i] * g[i]) * sc;
        }
      }
  }
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (C + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t c0 = blk * kBlock, nc = std::min(kBlock, C - c0);
    // the row sums in kSsmSumRows blocks: a partial per block, then the total
    std::vector<float> part(static_cast<size_t>(nc), 0.0f), total(part.size(), 0.0f);
    for (int64_t r = 0; r < N; ++r) {
      if (r > 0 && r % kSsmSumRows == 0)
        for (int64_t c = 0; c < nc; ++c) {
          total[c] = total[c] + part[c];
          part[c] = 0.0f;
        }
      const float* d = &dw_terms[static_cast<size_t>(r * C + c0)];
      for (int64_t c = 0; c < nc; ++c) part[c] = part[c] + d[c];
    }
    for (int64_t c = 0; c < nc; ++c) dweight[c0 + c] += total[c] + part[c];
  }
}

}  // namespace fp4sim::emu
