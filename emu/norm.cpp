#include "emu/norm.hpp"

#include <cmath>

namespace fp4sim::emu {

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int64_t N, int64_t C, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    float m = 0.0f;
    for (int64_t i = 0; i < C; ++i) m += x[i];
    m = m / static_cast<float>(C);
    float v = 0.0f;
    for (int64_t i = 0; i < C; ++i) {
      const float d = x[i] - m;
      v += d * d;
    }
    v = v / static_cast<float>(C);
    const float s = 1.0f / std::sqrt(v + eps);
    float* o = out + n * C;
    for (int64_t i = 0; i < C; ++i) o[i] = (s * (x[i] - m)) * weight[i] + bias[i];
    mean[n] = m;
    rstd[n] = s;
  }
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int64_t N, int64_t C) {
  // dweight/dbias sum over rows: kept sequential over n so the order is fixed
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    const float* dy = dout + n * C;
    float* dx = dinp + n * C;
    const float m = mean[n], s = rstd[n];
    float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
    for (int64_t i = 0; i < C; ++i) {
      const float norm = (x[i] - m) * s;
      const float dnorm = weight[i] * dy[i];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean = dnorm_mean / static_cast<float>(C);
    dnorm_norm_mean = dnorm_norm_mean / static_cast<float>(C);
    for (int64_t i = 0; i < C; ++i) {
      const float norm = (x[i] - m) * s;
      const float dnorm = weight[i] * dy[i];
      dbias[i] += dy[i];
      dweight[i] += norm * dy[i];
      dx[i] += ((dnorm - dnorm_mean) - norm * dnorm_norm_mean) * s;
    }
  }
}

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                     int64_t C, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    float ms = 0.0f;
    for (int64_t i = 0; i < C; ++i) ms += x[i] * x[i];
    ms = ms / static_cast<float>(C);
    const float s = 1.0f / std::sqrt(ms + eps);
    for (int64_t i = 0; i < C; ++i) out[n * C + i] = (x[i] * s) * weight[i];
    rstd[n] = s;
  }
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    const float* dy = dout + n * C;
    const float s = rstd[n];
    float dot = 0.0f;  // sum_i dy_i w_i x_i
    for (int64_t i = 0; i < C; ++i) dot += dy[i] * weight[i] * x[i];
    const float k = dot * s * s * s / static_cast<float>(C);
    for (int64_t i = 0; i < C; ++i) {
      dweight[i] += dy[i] * x[i] * s;
      dinp[n * C + i] += dy[i] * weight[i] * s - x[i] * k;
    }
  }
}

}  // namespace fp4sim::emu
