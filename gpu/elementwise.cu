// Elementwise ops: GELU, squared ReLU and SwiGLU, the residual add, BF16 rounding, narrowing and
// widening, and RoPE (a rotation of each pair of a query or key head's elements): the CUDA twins of
// emu/elementwise.hpp and CudaBackend's methods.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "emu/op_checks.hpp"
#include "gpu/activation.cuh"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/elementwise.cuh"
#include "gpu/formats_device.cuh"
#include "gpu/layers_state.hpp"
#include "gpu/op_checks.hpp"
#include "gpu/training_ops.cuh"

namespace fp4sim::gpu {

// dst (n) = BF16 RNE bits of src (emu/formats.hpp: NaN -> 0x7FFF), the emulator's operand rounding.
__global__ void round_to_bf16_kernel(uint16_t* dst, const float* src, int64_t n) {
  grid_stride_by4(
      n, aligned16(src) && (reinterpret_cast<uintptr_t>(dst) & 7u) == 0,
      [&](int64_t j) {
        const float4 v = reinterpret_cast<const float4*>(src)[j];
        reinterpret_cast<ushort4*>(dst)[j] = make_ushort4(bf16_rne_cvt(v.x), bf16_rne_cvt(v.y),
                                                          bf16_rne_cvt(v.z), bf16_rne_cvt(v.w));
      },
      [&](int64_t i) { dst[i] = bf16_rne_cvt(src[i]); });
}

// dst[i] = the FP32 value of BF16 bits src[i] (exact).
__global__ void bf16_to_f32_kernel(float* dst, const uint16_t* src, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = bf16_to_f32(src[i]);
}

namespace {

// The emulator's default (emu/elementwise.hpp): the Backend interface does not pass it.
constexpr float kRopeBase = 10000.0f;

// ---- RoPE -------------------------------------------------------------------------------------

// In place on the NH query and NKV key heads of x (B,T,(NH+2NKV)*HD): the pair (2i, 2i+1) at
// position t rotates by the angle whose FP32 cos/sin the host computed exactly as the emulator
// (double pow/cos/sin, rounded to float): cos_sin (T, HD/2, 2). sign = +1 forward, -1 backward
// (multiplies sin; exact). x0' = x0 c - x1 s, x1' = x0 s + x1 c, each product and sum RN: bitwise.
__global__ void rope_kernel(float* x, const float* cos_sin, int64_t B, int64_t T, int64_t NH,
                            int64_t NKV, int64_t HD, float sign) {
  const int64_t half = HD / 2, heads = NH + NKV, W = (NH + 2 * NKV) * HD;
  const int64_t total = B * T * heads * half;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e % half, h = (e / half) % heads, bt = e / (half * heads), t = bt % T;
    const float c = cos_sin[(t * half + i) * 2],
                s = __fmul_rn(sign, cos_sin[(t * half + i) * 2 + 1]);
    float* v = x + bt * W + h * HD;
    const float x0 = v[2 * i], x1 = v[2 * i + 1];
    v[2 * i] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    v[2 * i + 1] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
  }
}

// ---- elementwise ------------------------------------------------------------------------------

// GELU (tanh approximation): gpu/activation.cuh's arithmetic (the emulator's order; CUDA tanhf in
// the forward, tanh_exp2 in the derivative: a few ulp from the emulator, not bitwise), shared with
// the FP8 quantizer's fused pass.
__global__ void gelu_forward_kernel(float* out, const float* inp, int64_t n, bool round_bf16) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[j] = gelu_forward_stored(inp[j], round_bf16);
}

// dinp (n) = +0 + local * dout (written, never read: emu/elementwise.hpp); gpu/activation.cuh.
// (1 - t^2 amplifies an ulp of t where |t| is near 1: further from the emulator than the forward.)
__global__ void gelu_backward_kernel(float* dinp, const float* inp, const float* dout, int64_t n,
                                     bool round_bf16, bool bf16_dout) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dinp[j] = gelu_backward_stored(inp[j], dout[j], round_bf16, bf16_dout);
}

// out = max(x, 0)^2 as `x > 0 ? x : 0` (NaN -> 0), squared RN: bitwise.
__global__ void squared_relu_forward_kernel(float* out, const float* inp, int64_t n,
                                            bool round_bf16) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float r = inp[j] > 0.0f ? inp[j] : 0.0f;
    out[j] = stored(__fmul_rn(r, r), round_bf16);
  }
}

// dinp = +0 + (x > 0 ? 2 x : 0) * dout (written): bitwise.
__global__ void squared_relu_backward_kernel(float* dinp, const float* inp, const float* dout,
                                             int64_t n, bool round_bf16, bool bf16_dout) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dinp[j] = stored(__fadd_rn(0.0f, __fmul_rn(inp[j] > 0.0f ? __fmul_rn(2.0f, inp[j]) : 0.0f,
                                               read_dout(dout[j], bf16_dout))),
                     round_bf16);
}

// x = bf16_round(x): the emulator's function, bitwise.
__global__ void round_to_bf16_inplace_kernel(float* x, int64_t n) {
  grid_stride_by4(
      n, aligned16(x),
      [&](int64_t j) {
        float4 v = reinterpret_cast<float4*>(x)[j];
        v.x = bf16_round_cvt(v.x);
        v.y = bf16_round_cvt(v.y);
        v.z = bf16_round_cvt(v.z);
        v.w = bf16_round_cvt(v.w);
        reinterpret_cast<float4*>(x)[j] = v;
      },
      [&](int64_t i) { x[i] = bf16_round_cvt(x[i]); });
}

// out = a + b, FP32 RN (then bf16_round when round_bf16): bitwise.
__global__ void residual_forward_kernel(float* out, const float* a, const float* b, int64_t n,
                                        bool round_bf16) {
  grid_stride_by4(
      n, aligned16(out) && aligned16(a) && aligned16(b),
      [&](int64_t j) {
        const float4 u = reinterpret_cast<const float4*>(a)[j],
                     w = reinterpret_cast<const float4*>(b)[j];
        reinterpret_cast<float4*>(out)[j] = make_float4(
            stored(__fadd_rn(u.x, w.x), round_bf16), stored(__fadd_rn(u.y, w.y), round_bf16),
            stored(__fadd_rn(u.z, w.z), round_bf16), stored(__fadd_rn(u.w, w.w), round_bf16));
      },
      [&](int64_t i) { out[i] = stored(__fadd_rn(a[i], b[i]), round_bf16); });
}

// residual_forward_kernel with b kept as BF16 bits (b16 8-byte aligned for the vector path).
__global__ void residual_forward_bf16_kernel(float* out, const float* a, const uint16_t* b16,
                                             int64_t n, bool round_bf16) {
  grid_stride_by4(
      n, aligned16(out) && aligned16(a) && (reinterpret_cast<uintptr_t>(b16) & 7u) == 0,
      [&](int64_t j) {
        const float4 u = reinterpret_cast<const float4*>(a)[j];
        const uint2 w = reinterpret_cast<const uint2*>(b16)[j];
        const float w0 = __uint_as_float(w.x << 16), w1 = __uint_as_float(w.x & 0xFFFF0000u),
                    w2 = __uint_as_float(w.y << 16), w3 = __uint_as_float(w.y & 0xFFFF0000u);
        reinterpret_cast<float4*>(out)[j] = make_float4(
            stored(__fadd_rn(u.x, w0), round_bf16), stored(__fadd_rn(u.y, w1), round_bf16),
            stored(__fadd_rn(u.z, w2), round_bf16), stored(__fadd_rn(u.w, w3), round_bf16));
      },
      [&](int64_t i) { out[i] = stored(__fadd_rn(a[i], bf16_to_f32(b16[i])), round_bf16); });
}

// SwiGLU on inp (N, 2F) = [gate | up] per row: the emulator's expressions in its order, CUDA expf
// instead of glibc's exp (a few ulp).
__global__ void swiglu_forward_kernel(float* out, const float* inp, int64_t N, int64_t F,
                                      bool round_bf16) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < N * F;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = e / F, i = e - n * F;
    const float g = inp[n * 2 * F + i], u = inp[n * 2 * F + F + i];
    out[e] = stored(__fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u), round_bf16);
  }
}

__global__ void swiglu_backward_kernel(float* dinp, const float* inp, const float* dout, int64_t N,
                                       int64_t F, bool round_bf16, bool bf16_dout) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < N * F;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = e / F, i = e - n * F;
    const float g = inp[n * 2 * F + i], u = inp[n * 2 * F + F + i];
    const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g)));
    const float silu = __fmul_rn(g, sig);
    const float dy = read_dout(dout[e], bf16_dout);
    const float dsilu = __fmul_rn(sig, __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, sig))));
    dinp[n * 2 * F + i] =
        stored(__fadd_rn(0.0f, __fmul_rn(__fmul_rn(dy, u), dsilu)), round_bf16);  // written
    dinp[n * 2 * F + F + i] = stored(__fadd_rn(0.0f, __fmul_rn(dy, silu)), round_bf16);
  }
}

using training_ops::RopeTable;

// The RoPE table covering positions 0..T-1 for head size HD, built on the host with the
// emulator's exact expressions (emu/elementwise.cpp rope_rotate): freq = base^(-2i/HD) in double,
// angle = t * freq, cos and sin in double rounded to float. Rebuilt when HD changes or T grows.
const float* rope_table(RopeTable& tab, int64_t T, int64_t HD, cudaStream_t stream) {
  if (tab.HD != HD || tab.T < T) {
    const int64_t half = HD / 2;
    tab.host.assign(static_cast<size_t>(T * half * 2), 0.0f);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < half; ++i) {
        const double freq = std::pow(static_cast<double>(kRopeBase),
                                     -2.0 * static_cast<double>(i) / static_cast<double>(HD));
        const double ang = static_cast<double>(t) * freq;
        tab.host[static_cast<size_t>((t * half + i) * 2)] = static_cast<float>(std::cos(ang));
        tab.host[static_cast<size_t>((t * half + i) * 2 + 1)] = static_cast<float>(std::sin(ang));
      }
    float* d = tab.device.get<float>(tab.host.size(), stream);  // (syncs the stream if it grows)
    FP4SIM_CUDA_CHECK(cudaMemcpyAsync(d, tab.host.data(), tab.host.size() * sizeof(float),
                                      cudaMemcpyHostToDevice, stream));
    tab.HD = HD;
    tab.T = T;
  }
  return static_cast<const float*>(tab.device.ptr);
}

}  // namespace

void CudaBackend::narrow_to_bf16(uint16_t* dst, const float* src, int64_t n) {
  if (n <= 0) return;
  round_to_bf16_kernel<<<elementwise_grid((n + 3) / 4), kThreads, 0, stream_>>>(dst, src, n);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void CudaBackend::round_to_bf16(float* x, int64_t n) {
  if (n == 0) return;
  round_to_bf16_inplace_kernel<<<elementwise_grid((n + 3) / 4), kThreads, 0, stream_>>>(x, n);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void CudaBackend::convert(const TensorView& dst, const TensorView& src) {
  op_checks::convert(dst, src);
  const int64_t n = src.numel();
  if (n == 0) return;
  if (src.dtype == DType::BF16) {  // widen
    bf16_to_f32_kernel<<<elementwise_grid(n), kThreads, 0, stream_>>>(dst.as<float>(),
                                                                      src.as<const uint16_t>(), n);
    FP4SIM_CUDA_CHECK_LAUNCH();
  } else if (dst.dtype == DType::BF16) {
    narrow_to_bf16(dst.as<uint16_t>(), src.as<const float>(), n);
  } else {  // float32 holding BF16 values
    if (dst.data != src.data)
      FP4SIM_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, static_cast<size_t>(n) * sizeof(float),
                                        cudaMemcpyDeviceToDevice, stream_));
    round_to_bf16(dst.as<float>(), n);
  }
}

namespace {
void rope_launch(const char* op, RopeTable& table, const TensorView& qkv, const AttentionShape& s,
                 float sign, cudaStream_t stream) {
  op_checks::rope(op, qkv, s);
  require_heads(op, s.NH, s.NKV, s.HD);
  const int64_t total = s.B * s.T * (s.NH + s.NKV) * (s.HD / 2);
  if (total == 0) return;
  const float* tab = rope_table(table, s.T, s.HD, stream);
  rope_kernel<<<elementwise_grid(total), kThreads, 0, stream>>>(qkv.as<float>(), tab, s.B, s.T,
                                                                s.NH, s.NKV, s.HD, sign);
  FP4SIM_CUDA_CHECK_LAUNCH();
}
}  // namespace

void CudaBackend::rope_forward(const TensorView& qkv, const AttentionShape& s) {
  rope_launch("rope_forward", layers_state().rope, qkv, s, 1.0f, stream_);
}

void CudaBackend::rope_backward(const TensorView& dqkv, const AttentionShape& s) {
  rope_launch("rope_backward", layers_state().rope, dqkv, s, -1.0f, stream_);
}

void CudaBackend::activation_forward(Activation act, const TensorView& out, const TensorView& inp) {
  op_checks::activation_forward(act, out, inp);
  const int64_t N = out.rows, F = out.cols, n = N * F;
  if (n == 0) return;
  float* y = out.as<float>();
  const float* x = inp.as<const float>();
  const bool rb = out.bf16_values;
  if (act == Activation::GeluTanh)
    gelu_forward_kernel<<<elementwise_grid(n), kThreads, 0, stream_>>>(y, x, n, rb);
  else if (act == Activation::SquaredRelu)
    squared_relu_forward_kernel<<<elementwise_grid(n), kThreads, 0, stream_>>>(y, x, n, rb);
  else
    swiglu_forward_kernel<<<elementwise_grid(n), kThreads, 0, stream_>>>(y, x, N, F, rb);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void CudaBackend::activation_backward(Activation act, const TensorView& dinp, const TensorView& inp,
                                      const TensorView& dout) {
  op_checks::activation_backward(act, dinp, inp, dout);
  const int64_t N = dout.rows, F = dout.cols, n = N * F;
  if (n == 0) return;
  float* dx = dinp.as<float>();
  const float *x = inp.as<const float>(), *dy = dout.as<const float>();
  const bool rb = dinp.bf16_values, bd = dout.bf16_values;
  if (act == Activation::GeluTanh)
    gelu_backward_kernel<<<elementwise_grid(n), kThreads, 0, stream_>>>(dx, x, dy, n, rb, bd);
  else if (act == Activation::SquaredRelu)
    squared_relu_backward_kernel<<<elementwise_grid(n), kThreads, 0, stream_>>>(dx, x, dy, n, rb,
                                                                                bd);
  else
    swiglu_backward_kernel<<<elementwise_grid(n), kThreads, 0, stream_>>>(dx, x, dy, N, F, rb, bd);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void CudaBackend::residual_forward(const TensorView& out, const TensorView& a,
                                   const TensorView& b) {
  op_checks::residual_forward(out, a, b);
  const int64_t n = a.numel();
  if (n == 0) return;
  if (b.dtype == DType::BF16)
    residual_forward_bf16_kernel<<<elementwise_grid((n + 3) / 4), kThreads, 0, stream_>>>(
        out.as<float>(), a.as<const float>(), b.as<const uint16_t>(), n, out.bf16_values);
  else
    residual_forward_kernel<<<elementwise_grid((n + 3) / 4), kThreads, 0, stream_>>>(
        out.as<float>(), a.as<const float>(), b.as<const float>(), n, out.bf16_values);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

}  // namespace fp4sim::gpu
