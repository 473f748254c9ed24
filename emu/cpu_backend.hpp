// The emulator backend: plain loops in the order the contract names, OpenMP across independent
// blocks only. The golden reference every other backend is checked against.
#pragma once

#include <stdexcept>
#include <vector>

#include "emu/backend.hpp"
#include "emu/layers.hpp"

namespace fp4sim::emu {

// dout (n) as a backward pass reads it: a BF16-rounded copy in `rounded` when bf16_dout (the
// caller's BF16 storage of the gradient, applied where it is read), else dout itself.
inline const float* read_as_bf16(const float* dout, int64_t n, bool bf16_dout,
                                 std::vector<float>& rounded) {
  if (!bf16_dout) return dout;
  rounded.assign(dout, dout + n);
  round_to_bf16(rounded.data(), n);
  return rounded.data();
}

// The bias a linear adds when its output is rounded to BF16: the bias's BF16 rounding (a copy in
// `rounded`), as a BF16 GEMM's epilogue adds a BF16 bias (Backend::matmul_forward); else bias
// itself.
inline const float* bias_as_added(const float* bias, int64_t OC, bool round_bf16,
                                  std::vector<float>& rounded) {
  return bias ? read_as_bf16(bias, OC, round_bf16, rounded) : nullptr;
}

// (not final: tests derive from it, e.g. to fuse as another backend would)
class CpuBackend : public Backend {
 public:
  std::string name() const override { return "emu"; }
  Device device() const override { return Device::Host; }
  void* allocate(size_t bytes) override;
  void release(void* p) override;
  void upload(void* dst, const void* host_src, size_t bytes) override;
  void download(void* host_dst, const void* src, size_t bytes) override;
  void synchronize() override {}
  void zero(void* p, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;

  void quantize(const TensorView& x, const QuantizeConfig& cfg, QuantizedView* rowwise,
                QuantizedView* columnwise) override;
  void dequantize(const QuantizedView& q, const TensorView& out) override;
  QuantErrorSums quant_error_sums(const float* x, const QuantizedView& q) override {
    return fp4sim::quant_error_sums(x, q);
  }
  void gemm(const QuantizedView& a, const QuantizedView& b, const TensorView* c,
            const GemmConfig& cfg, const TensorView& d) override {
    validate_gemm(a, b, c, cfg, d);
    if (cfg.impl != GemmImpl::Exact)
      throw std::invalid_argument("gemm: --gemm cublaslt runs on the cuda backend only");
    gemm_exact_host(a, b, c ? static_cast<const float*>(c->data) : nullptr, cfg, d.data);
  }
  void scales_to_tiled(const uint8_t* scales, int64_t rows, int64_t k_blocks,
                       uint8_t* out) override {
    fp4sim::scales_to_tiled(scales, rows, k_blocks, out);
  }

  // training-stack ops: emu/layers.hpp and emu/optim.hpp on host memory
  void embedding_forward(float* out, const int32_t* tokens, const int32_t* pos, const float* wte,
                         const float* wpe, int64_t N, int64_t C) override {
    emu::embedding_forward(out, tokens, pos, wte, wpe, N, C);
  }
  void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                          const int32_t* pos, int64_t N, int64_t C) override {
    emu::embedding_backward(dwte, dwpe, dout, tokens, pos, N, C);
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                         const float* weight, const float* bias, int64_t N, int64_t C,
                         bool round_bf16) override {
    emu::layernorm_forward(out, mean, rstd, inp, weight, bias, N, C);
    if (round_bf16) emu::round_to_bf16(out, N * C);
  }
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                          const float* inp, const float* weight, const float* mean,
                          const float* rstd, int64_t N, int64_t C, bool round_bf16,
                          bool bf16_dout) override {
    std::vector<float> rounded;
    emu::layernorm_backward(dinp, dweight, dbias, read_as_bf16(dout, N * C, bf16_dout, rounded),
                            inp, weight, mean, rstd, N, C);
    if (round_bf16) emu::round_to_bf16(dinp, N * C);
  }
  void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                       int64_t C, bool round_bf16) override {
    emu::rmsnorm_forward(out, rstd, inp, weight, N, C);
    if (round_bf16) emu::round_to_bf16(out, N * C);
  }
  void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                        const float* weight, const float* rstd, int64_t N, int64_t C,
                        bool round_bf16, bool bf16_dout) override {
    std::vector<float> rounded;
    emu::rmsnorm_backward(dinp, dweight, read_as_bf16(dout, N * C, bf16_dout, rounded), inp, weight,
                          rstd, N, C);
    if (round_bf16) emu::round_to_bf16(dinp, N * C);
  }
  void matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                      int64_t N, int64_t K, int64_t OC, emu::GemmPrecision prec,
                      bool round_bf16) override {
    std::vector<float> b16;
    emu::matmul_forward(out, inp, weight, bias_as_added(bias, OC, round_bf16, b16), N, K, OC, prec);
    if (round_bf16) emu::round_to_bf16(out, N * OC);
  }
  void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                       const float* inp, const float* weight, int64_t N, int64_t K, int64_t OC,
                       emu::GemmPrecision prec) override {
    emu::matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, K, OC, prec);
  }
  void matmul_backward_bf16_dout(float* dinp, float* dweight, const uint16_t* dout,
                                 const float* inp, const float* weight, int64_t N, int64_t K,
                                 int64_t OC, emu::GemmPrecision prec) override {
    std::vector<float> d(
        static_cast<size_t>(N * OC));  // (a temporary FP32 copy: the emulator's twins
    for (size_t i = 0; i < d.size(); ++i)
      d[i] = bf16_to_f32(dout[i]);  // trade memory for one code path)
    emu::matmul_backward(dinp, dweight, nullptr, d.data(), inp, weight, N, K, OC, prec);
  }
  void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t NH,
                         int64_t NKV, int64_t HD, emu::GemmPrecision prec,
                         bool round_bf16) override {
    emu::attention_forward(out, lse, qkv, B, T, NH, NKV, HD, prec);
    if (round_bf16) emu::round_to_bf16(out, B * T * NH * HD);
  }
  void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                          const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                          int64_t HD, emu::GemmPrecision prec, bool round_bf16) override {
    emu::attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, NKV, HD, prec);
    if (round_bf16) emu::round_to_bf16(dqkv, B * T * (NH + 2 * NKV) * HD);
  }
  void rope_forward(float* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                    int64_t HD) override {
    emu::rope_forward(qkv, B, T, NH, NKV, HD);
  }
  void rope_backward(float* dqkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                     int64_t HD) override {
    emu::rope_backward(dqkv, B, T, NH, NKV, HD);
  }
  void gelu_forward(float* out, const float* inp, int64_t n, bool round_bf16) override {
    emu::gelu_forward(out, inp, n);
    if (round_bf16) emu::round_to_bf16(out, n);
  }
  void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n, bool round_bf16,
                     bool bf16_dout) override {
    std::vector<float> rounded;
    emu::gelu_backward(dinp, inp, read_as_bf16(dout, n, bf16_dout, rounded), n);
    if (round_bf16) emu::round_to_bf16(dinp, n);
  }
  void squared_relu_forward(float* out, const float* inp, int64_t n, bool round_bf16) override {
    emu::squared_relu_forward(out, inp, n);
    if (round_bf16) emu::round_to_bf16(out, n);
  }
  void squared_relu_backward(float* dinp, const float* inp, const float* dout, int64_t n,
                             bool round_bf16, bool bf16_dout) override {
    std::vector<float> rounded;
    emu::squared_relu_backward(dinp, inp, read_as_bf16(dout, n, bf16_dout, rounded), n);
    if (round_bf16) emu::round_to_bf16(dinp, n);
  }
  void bias_forward(float* out, const float* bias, int64_t N, int64_t OC,
                    bool round_bf16) override {
    std::vector<float> b16;
    emu::bias_forward(out, bias_as_added(bias, OC, round_bf16, b16), N, OC);
    if (round_bf16) emu::round_to_bf16(out, N * OC);
  }
  void bias_backward(float* dbias, const float* dout, int64_t N, int64_t OC) override {
    emu::bias_backward(dbias, dout, N, OC);
  }
  void round_to_bf16(float* x, int64_t n) override { emu::round_to_bf16(x, n); }
  void swiglu_forward(float* out, const float* inp, int64_t N, int64_t F,
                      bool round_bf16) override {
    emu::swiglu_forward(out, inp, N, F);
    if (round_bf16) emu::round_to_bf16(out, N * F);
  }
  void swiglu_backward(float* dinp, const float* inp, const float* dout, int64_t N, int64_t F,
                       bool round_bf16, bool bf16_dout) override {
    std::vector<float> rounded;
    emu::swiglu_backward(dinp, inp, read_as_bf16(dout, N * F, bf16_dout, rounded), N, F);
    if (round_bf16) emu::round_to_bf16(dinp, N * 2 * F);
  }
  void residual_forward(float* out, const float* a, const float* b, int64_t n,
                        bool round_bf16) override {
    for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
    if (round_bf16) emu::round_to_bf16(out, n);
  }
  void crossentropy_softmax_forward(float* losses, float* probs, const float* logits,
                                    const int32_t* targets, int64_t N, int64_t V,
                                    bool bf16_logits) override {
    emu::crossentropy_softmax_forward(losses, probs, logits, targets, N, V, bf16_logits);
  }
  void crossentropy_softmax_backward(float* dlogits, const float* probs, const int32_t* targets,
                                     const float* dlosses, int64_t N, int64_t V,
                                     bool round_bf16) override {
    emu::crossentropy_softmax_backward(dlogits, probs, targets, dlosses, N, V, round_bf16);
  }
  void crossentropy_softmax_forward_backward(float* losses, float* dlogits, const float* logits,
                                             const int32_t* targets, const float* dlosses,
                                             int64_t N, int64_t V, bool round_bf16) override {
    emu::crossentropy_softmax_forward_backward(losses, dlogits, logits, targets, dlosses, N, V,
                                               round_bf16);
  }
  void crossentropy_softmax_forward_backward_bf16(float* losses, uint16_t* dlogits,
                                                  const float* logits, const int32_t* targets,
                                                  const float* dlosses, int64_t N,
                                                  int64_t V) override {
    std::vector<float> d(static_cast<size_t>(N * V));
    emu::crossentropy_softmax_forward_backward(losses, d.data(), logits, targets, dlosses, N, V,
                                               true);
    for (size_t i = 0; i < d.size(); ++i)
      dlogits[i] = bf16_rne(d[i]);  // (exact: d is BF16-rounded)
  }
  void adamw_update(float* params, const float* grads, float* m, float* v, int64_t n,
                    const AdamWStep& step) override {
    for (int64_t i = 0; i < n; ++i) adamw_element(params[i], grads[i], m[i], v[i], step);
  }
  double sum_squares(const float* x, int64_t n) override {
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
    return s;
  }
};

// Building blocks, exposed for tests and benchmarks.
// The written tensor w (rows x cols FP32, row-major) of one copy -> codes and scales.
// `written_transposed`: w is the transpose of the input (column-wise copy), used only for the
// Four Over Six tile error order.
void quantize_written(const float* w, int64_t rows, int64_t cols, float amax,
                      const QuantizeConfig& cfg, const CopySpec& spec, bool written_transposed,
                      QuantizedView& out);

// NaN-ignoring amax over a row-major FP32 matrix.
float amax_of(const float* x, int64_t n);

// The column-wise RHT copy as written: out (cols x rows FP32, each value a BF16) where each 16
// consecutive input rows of one column are transformed by rht16.
void rht_columnwise(const float* x, int64_t rows, int64_t cols, float* out);

}  // namespace fp4sim::emu
