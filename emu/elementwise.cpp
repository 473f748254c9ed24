#include "emu/elementwise.hpp"

#include <cmath>

#include "emu/formats.hpp"

namespace fp4sim::emu {

namespace {
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluCubic = 0.044715f;
}  // namespace

void gelu_forward(float* out, const float* inp, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float cube = kGeluCubic * x * x * x;
    out[i] = 0.5f * x * (1.0f + std::tanh(kGeluScale * (x + cube)));
  }
}

void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float cube = kGeluCubic * x * x * x;
    const float arg = kGeluScale * (x + cube);
    const float t = std::tanh(arg);
    const float sech2 = 1.0f - t * t;
    const float local =
        0.5f * (1.0f + t) + x * 0.5f * sech2 * kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
    dinp[i] = 0.0f + local * dout[i];  // written (see elementwise.hpp)
  }
}

void round_to_bf16(float* x, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] = bf16_round(x[i]);
}

void squared_relu_forward(float* out, const float* inp, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float r = inp[i] > 0.0f ? inp[i] : 0.0f;
    out[i] = r * r;
  }
}

void squared_relu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) dinp[i] = 0.0f + (inp[i] > 0.0f ? 2.0f * inp[i] : 0.0f) * dout[i];
}

void swiglu_forward(float* out, const float* inp, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* g = inp + n * 2 * F;
    const float* u = g + F;
    for (int64_t i = 0; i < F; ++i) out[n * F + i] = (g[i] / (1.0f + std::exp(-g[i]))) * u[i];
  }
}

void swiglu_backward(float* dinp, const float* inp, const float* dout, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* g = inp + n * 2 * F;
    const float* u = g + F;
    float* dg = dinp + n * 2 * F;
    float* du = dg + F;
    for (int64_t i = 0; i < F; ++i) {
      const float sig = 1.0f / (1.0f + std::exp(-g[i]));
      const float silu = g[i] * sig;
      const float dy = dout[n * F + i];
      // d silu / dx = sig * (1 + x * (1 - sig))
      dg[i] = 0.0f + (dy * u[i]) * (sig * (1.0f + g[i] * (1.0f - sig)));
      du[i] = 0.0f + dy * silu;
    }
  }
}

namespace {
void rope_rotate(float* x, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HD, float base,
                 float sign) {
  const int64_t W = (NH + 2 * NKV) * HD;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < NH + NKV; ++h) {  // query heads, then key heads
        float* v = x + (b * T + t) * W + h * HD;
        for (int64_t i = 0; i < HD / 2; ++i) {
          const double freq = std::pow(static_cast<double>(base),
                                       -2.0 * static_cast<double>(i) / static_cast<double>(HD));
          const double ang = static_cast<double>(t) * freq;
          const float c = static_cast<float>(std::cos(ang)),
                      s = sign * static_cast<float>(std::sin(ang));
          const float x0 = v[2 * i], x1 = v[2 * i + 1];
          v[2 * i] = x0 * c - x1 * s;
          v[2 * i + 1] = x0 * s + x1 * c;
        }
      }
}
}  // namespace

void rope_forward(float* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HD,
                  float base) {
  rope_rotate(qkv, B, T, NH, NKV, HD, base, 1.0f);
}
void rope_backward(float* dqkv, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HD,
                   float base) {
  rope_rotate(dqkv, B, T, NH, NKV, HD, base, -1.0f);
}

}  // namespace fp4sim::emu
