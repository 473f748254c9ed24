#include "emu/backend.hpp"

#include <stdexcept>
#include <vector>

#include "emu/cpu_backend.hpp"
#include "emu/formats.hpp"

namespace fp4sim {

void Backend::missing(const char* op) const {
  throw std::runtime_error("the " + name() + " backend does not implement " + op +
                           " yet (the training stack runs on --backend emu so far)");
}

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<emu::CpuBackend>(); }

// ---- BF16-stored activations: the compositions (FP32 op on widened values, then narrowing) ------

namespace {

// n FP32 values in b's memory (a composition's temporary).
BackendBuffer f32_temp(Backend& b, int64_t n) {
  return BackendBuffer(b, static_cast<size_t>(n) * sizeof(float));
}

// Exactly one of the FP32 and the BF16 pointer of a tensor is set (std::logic_error otherwise).
void one_of(const char* op, const char* tensor, const void* f32, const void* bf16) {
  if ((f32 == nullptr) == (bf16 == nullptr))
    throw std::logic_error(std::string(op) + ": exactly one of " + tensor + " and " + tensor +
                           "16 must be given (FP32 or BF16 storage)");
}

// A tensor of n values given as BF16 bits (x16) or FP32 (x): its FP32 values, widened from x16
// into `keep` (a temporary that must outlive their use), else x itself.
const float* values_of(Backend& b, BackendBuffer& keep, const float* x, const uint16_t* x16,
                       int64_t n) {
  if (!x16) return x;
  keep = f32_temp(b, n);
  b.widen_bf16(keep.as<float>(), x16, n);
  return keep.as<float>();
}

}  // namespace

void Backend::narrow_to_bf16(uint16_t* dst, const float* src, int64_t n) {
  if (n <= 0) return;
  std::vector<float> h(static_cast<size_t>(n));
  download(h.data(), src, h.size() * sizeof(float));
  std::vector<uint16_t> o(h.size());
  for (size_t i = 0; i < h.size(); ++i) o[i] = bf16_rne(h[i]);
  upload(dst, o.data(), o.size() * sizeof(uint16_t));
}

void Backend::widen_bf16(float* dst, const uint16_t* src, int64_t n) {
  if (n <= 0) return;
  std::vector<uint16_t> h(static_cast<size_t>(n));
  download(h.data(), src, h.size() * sizeof(uint16_t));
  std::vector<float> o(h.size());
  for (size_t i = 0; i < h.size(); ++i) o[i] = bf16_to_f32(h[i]);
  upload(dst, o.data(), o.size() * sizeof(float));
}

void Backend::run_activation(const ActivationSource& src) {
  const int64_t n = src.rows * src.cols;
  // an input kept as BF16 bits (inp16, dout16): widened into a temporary, then the op on it
  auto on_widened = [&](const float* ActivationSource::*f32,
                        const uint16_t* ActivationSource::*bits, const char* what) {
    one_of("run_activation", what, src.*f32, src.*bits);
    BackendBuffer t;
    ActivationSource s = src;
    s.*f32 = values_of(*this, t, nullptr, src.*bits, n);
    s.*bits = nullptr;
    run_activation(s);
  };
  if (src.dout16) return on_widened(&ActivationSource::dout, &ActivationSource::dout16, "dout");
  if (src.inp16) return on_widened(&ActivationSource::inp, &ActivationSource::inp16, "inp");
  if (src.out16) {
    if (src.op != ActivationOp::GeluForward)
      throw std::logic_error(std::string("run_activation (") + src.name +
                             "): out16 is for GELU's forward pass only");
    BackendBuffer t = f32_temp(*this, n);
    gelu_forward(t.as<float>(), src.inp, n, true);
    narrow_to_bf16(src.out16, t.as<float>(), n);
    return;
  }
  if (src.op == ActivationOp::GeluForward)
    gelu_forward(src.out, src.inp, n, src.round_bf16);
  else
    gelu_backward(src.out, src.inp, src.dout, n, src.round_bf16, src.bf16_dout);
}

void Backend::matmul_backward_bits(float* dinp, uint16_t* dinp16, float* dweight, float* dbias,
                                   const float* dout, const uint16_t* dout16,
                                   const ActivationSource* src, const float* inp,
                                   const uint16_t* inp16, const float* weight, int64_t N, int64_t K,
                                   int64_t OC) {
  if (dinp && dinp16) throw std::logic_error("matmul_backward_bits: dinp and dinp16 both given");
  if ((dout != nullptr) + (dout16 != nullptr) + (src != nullptr) != 1)
    throw std::logic_error("matmul_backward_bits: exactly one of dout, dout16 and src");
  BackendBuffer t, d;
  if (dout16) dout = values_of(*this, d, nullptr, dout16, N * OC);
  if (dinp16) {
    t = f32_temp(*this, N * K);
    dinp = t.as<float>();
  }
  if (src && inp16)
    matmul_backward_activation_bf16_input(dinp, dweight, dbias, *src, inp16, weight, K);
  else if (src)
    matmul_backward_activation(dinp, dweight, dbias, *src, inp, weight, K,
                               emu::GemmPrecision::BF16);
  else if (inp16)
    matmul_backward_bf16_input(dinp, dweight, dbias, dout, inp16, weight, N, K, OC);
  else
    matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, K, OC, emu::GemmPrecision::BF16);
  if (dinp16) narrow_to_bf16(dinp16, dinp, N * K);
}

void Backend::layernorm_backward_bits(float* dinp, float* dweight, float* dbias,
                                      const uint16_t* dout16, const float* inp, const float* weight,
                                      const float* mean, const float* rstd, int64_t N, int64_t C,
                                      bool round_bf16) {
  BackendBuffer d;
  layernorm_backward(dinp, dweight, dbias, values_of(*this, d, nullptr, dout16, N * C), inp, weight,
                     mean, rstd, N, C, round_bf16, true);
}

void Backend::rmsnorm_backward_bits(float* dinp, float* dweight, const uint16_t* dout16,
                                    const float* inp, const float* weight, const float* rstd,
                                    int64_t N, int64_t C, bool round_bf16) {
  BackendBuffer d;
  rmsnorm_backward(dinp, dweight, values_of(*this, d, nullptr, dout16, N * C), inp, weight, rstd, N,
                   C, round_bf16, true);
}

void Backend::residual_forward_bf16(float* out, const float* a, const uint16_t* b16, int64_t n,
                                    bool round_bf16) {
  BackendBuffer b;
  residual_forward(out, a, values_of(*this, b, nullptr, b16, n), n, round_bf16);
}

void Backend::crossentropy_softmax_forward_backward_bits(float* losses, uint16_t* dlogits,
                                                         const uint16_t* logits16,
                                                         const int32_t* targets,
                                                         const float* dlosses, int64_t N,
                                                         int64_t V) {
  BackendBuffer z;
  crossentropy_softmax_forward_backward_bf16(
      losses, dlogits, values_of(*this, z, nullptr, logits16, N * V), targets, dlosses, N, V);
}

void Backend::bias_forward_bf16(uint16_t* out16, float* x, const float* bias, int64_t N,
                                int64_t OC) {
  bias_forward(x, bias, N, OC, true);
  narrow_to_bf16(out16, x, N * OC);
}

void Backend::layernorm_forward_bf16(uint16_t* out, float* mean, float* rstd, const float* inp,
                                     const float* weight, const float* bias, int64_t N, int64_t C) {
  BackendBuffer t = f32_temp(*this, N * C);
  layernorm_forward(t.as<float>(), mean, rstd, inp, weight, bias, N, C, true);
  narrow_to_bf16(out, t.as<float>(), N * C);
}

void Backend::residual_layernorm_forward_bf16(float* res, uint16_t* out, float* mean, float* rstd,
                                              const float* a, const uint16_t* b16,
                                              const float* weight, const float* bias, int64_t N,
                                              int64_t C, bool round_bf16) {
  residual_forward_bf16(res, a, b16, N * C, round_bf16);
  layernorm_forward_bf16(out, mean, rstd, res, weight, bias, N, C);
}

void Backend::rmsnorm_forward_bf16(uint16_t* out, float* rstd, const float* inp,
                                   const float* weight, int64_t N, int64_t C) {
  BackendBuffer t = f32_temp(*this, N * C);
  rmsnorm_forward(t.as<float>(), rstd, inp, weight, N, C, true);
  narrow_to_bf16(out, t.as<float>(), N * C);
}

void Backend::matmul_forward_bf16(float* out, uint16_t* out16, const float* inp,
                                  const uint16_t* inp16, const float* weight, const float* bias,
                                  int64_t N, int64_t K, int64_t OC, bool round_bf16) {
  one_of("matmul_forward_bf16", "out", out, out16);
  one_of("matmul_forward_bf16", "inp", inp, inp16);
  BackendBuffer x, y;
  inp = values_of(*this, x, inp, inp16, N * K);
  if (out16) {
    y = f32_temp(*this, N * OC);
    out = y.as<float>();
  }
  matmul_forward(out, inp, weight, bias, N, K, OC, emu::GemmPrecision::BF16,
                 out16 ? true : round_bf16);
  if (out16) narrow_to_bf16(out16, out, N * OC);
}

void Backend::matmul_backward_bf16_input(float* dinp, float* dweight, float* dbias,
                                         const float* dout, const uint16_t* inp16,
                                         const float* weight, int64_t N, int64_t K, int64_t OC) {
  BackendBuffer x;
  matmul_backward(dinp, dweight, dbias, dout, values_of(*this, x, nullptr, inp16, N * K), weight, N,
                  K, OC, emu::GemmPrecision::BF16);
}

void Backend::matmul_backward_activation_bf16_input(float* dinp, float* dweight, float* dbias,
                                                    const ActivationSource& src,
                                                    const uint16_t* inp16, const float* weight,
                                                    int64_t K) {
  BackendBuffer x;
  matmul_backward_activation(dinp, dweight, dbias, src,
                             values_of(*this, x, nullptr, inp16, src.rows * K), weight, K,
                             emu::GemmPrecision::BF16);
}

void Backend::attention_forward_bf16(float* out, uint16_t* out16, float* lse, const float* qkv,
                                     const uint16_t* qkv16, int64_t B, int64_t T, int64_t NH,
                                     int64_t NKV, int64_t HD, bool round_bf16) {
  one_of("attention_forward_bf16", "out", out, out16);
  one_of("attention_forward_bf16", "qkv", qkv, qkv16);
  BackendBuffer q, o;
  qkv = values_of(*this, q, qkv, qkv16, B * T * (NH + 2 * NKV) * HD);
  if (out16) {
    o = f32_temp(*this, B * T * NH * HD);
    out = o.as<float>();
  }
  attention_forward(out, lse, qkv, B, T, NH, NKV, HD, emu::GemmPrecision::BF16,
                    out16 ? true : round_bf16);
  if (out16) narrow_to_bf16(out16, out, B * T * NH * HD);
}

void Backend::attention_backward_bf16(float* dqkv, uint16_t* dqkv16, const float* dout,
                                      const uint16_t* dout16, const float* qkv,
                                      const uint16_t* qkv16, const float* out,
                                      const uint16_t* out16, const float* lse, int64_t B, int64_t T,
                                      int64_t NH, int64_t NKV, int64_t HD, bool round_bf16) {
  one_of("attention_backward_bf16", "dqkv", dqkv, dqkv16);
  one_of("attention_backward_bf16", "dout", dout, dout16);
  one_of("attention_backward_bf16", "qkv", qkv, qkv16);
  one_of("attention_backward_bf16", "out", out, out16);
  BackendBuffer q, o, d;
  dout = values_of(*this, d, dout, dout16, B * T * NH * HD);
  qkv = values_of(*this, q, qkv, qkv16, B * T * (NH + 2 * NKV) * HD);
  out = values_of(*this, o, out, out16, B * T * NH * HD);
  BackendBuffer g;
  const int64_t n = B * T * (NH + 2 * NKV) * HD;
  if (dqkv16) {
    g = f32_temp(*this, n);
    dqkv = g.as<float>();
  }
  attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, NKV, HD, emu::GemmPrecision::BF16,
                     dqkv16 || round_bf16);
  if (dqkv16) narrow_to_bf16(dqkv16, dqkv, n);
}

QuantizedBuffers::QuantizedBuffers(Backend& b, const QuantizedHost& h)
    : codes(b, h.codes.size()), scales(b, h.scales.size()), amax(b, sizeof(float)) {
  view.codes = codes.as<uint8_t>();
  view.scales = scales.as<uint8_t>();
  view.amax = amax.as<float>();
  view.rows = h.rows;
  view.cols = h.cols;
  view.format = h.format;
  view.four_over_six = h.four_over_six;
  view.device = b.device();
}

QuantizedBuffers QuantizedBuffers::uploaded(Backend& b, const QuantizedHost& h) {
  QuantizedBuffers q(b, h);
  q.upload_from(b, h);
  return q;
}

void QuantizedBuffers::upload_from(Backend& b, const QuantizedHost& h) {
  b.upload(codes.get(), h.codes.data(), h.codes.size());
  b.upload(scales.get(), h.scales.data(), h.scales.size());
  b.upload(amax.get(), &h.amax, sizeof(float));
}

void QuantizedBuffers::download_to(Backend& b, QuantizedHost& h) {
  b.download(h.codes.data(), codes.get(), h.codes.size());
  b.download(h.scales.data(), scales.get(), h.scales.size());
  b.download(&h.amax, amax.get(), sizeof(float));
}

QuantizeResult quantize_to_host(Backend& backend, const TensorView& host_x,
                                const QuantizeConfig& cfg) {
  validate_quantize(host_x, cfg);
  QuantizeResult res;
  const CopyShape rs = written_shape(host_x, false), cs = written_shape(host_x, true);
  if (cfg.rowwise.enabled)
    res.rowwise.resize(rs.rows, rs.cols, cfg.format, cfg.rowwise.four_over_six);
  if (cfg.columnwise.enabled)
    res.columnwise.resize(cs.rows, cs.cols, cfg.format, cfg.columnwise.four_over_six);
  const size_t in_bytes =
      static_cast<size_t>(host_x.rows * host_x.stride()) * dtype_size(host_x.dtype);
  BackendBuffer in(backend, in_bytes);
  backend.upload(in.get(), host_x.data, in_bytes);
  TensorView x = host_x;
  x.data = in.get();
  x.device = backend.device();
  QuantizedBuffers row(backend, res.rowwise), col(backend, res.columnwise);
  backend.quantize(x, cfg, cfg.rowwise.enabled ? &row.view : nullptr,
                   cfg.columnwise.enabled ? &col.view : nullptr);
  backend.synchronize();
  if (cfg.rowwise.enabled) row.download_to(backend, res.rowwise);
  if (cfg.columnwise.enabled) col.download_to(backend, res.columnwise);
  return res;
}

std::vector<float> dequantize_to_host(Backend& backend, QuantizedHost& q) {
  QuantizedBuffers in = QuantizedBuffers::uploaded(backend, q);
  BackendBuffer out(backend, static_cast<size_t>(q.rows * q.cols) * sizeof(float));
  TensorView o;
  o.data = out.get();
  o.dtype = DType::F32;
  o.rows = q.rows;
  o.cols = q.cols;
  o.device = backend.device();
  o.name = "dequantized";
  backend.dequantize(in.view, o);
  backend.synchronize();
  std::vector<float> host(static_cast<size_t>(q.rows * q.cols));
  backend.download(host.data(), out.get(), host.size() * sizeof(float));
  return host;
}

QuantErrorSums quant_error_sums_on(Backend& backend, const std::vector<float>& x,
                                   QuantizedHost& q) {
  if (static_cast<int64_t>(x.size()) != q.rows * q.cols)
    throw std::invalid_argument("quant_error_sums_on: x has " + std::to_string(x.size()) +
                                " values, the copy is " + shape_str(q.rows, q.cols));
  QuantizedBuffers in = QuantizedBuffers::uploaded(backend, q);
  BackendBuffer xb(backend, x.size() * sizeof(float));
  backend.upload(xb.get(), x.data(), x.size() * sizeof(float));
  return backend.quant_error_sums(xb.as<float>(), in.view);
}

void Backend::adamw_update_many(float* params, const float* grads, float* m, float* v,
                                const std::vector<int64_t>& offsets,
                                const std::vector<int64_t>& counts,
                                const std::vector<AdamWStep>& steps) {
  validate_adamw_update_many(offsets, counts, steps);
  for (size_t i = 0; i < offsets.size(); ++i)
    adamw_update(params + offsets[i], grads + offsets[i], m + offsets[i], v + offsets[i], counts[i],
                 steps[i]);
}

void Backend::adamw_update_many_bf16(float* params, uint16_t* params16, const float* grads,
                                     float* m, float* v, const std::vector<int64_t>& offsets,
                                     const std::vector<int64_t>& counts,
                                     const std::vector<AdamWStep>& steps) {
  adamw_update_many(params, grads, m, v, offsets, counts, steps);
  for (size_t i = 0; i < offsets.size(); ++i)
    narrow_to_bf16(params16 + offsets[i], params + offsets[i], counts[i]);
}

namespace {
// The tensors of a *_many op (op names it in the message): as many offsets as counts, none
// negative.
void validate_tensor_segments(const std::string& op, const std::vector<int64_t>& offsets,
                              const std::vector<int64_t>& counts) {
  if (offsets.size() != counts.size())
    throw std::invalid_argument(op + ": " + std::to_string(offsets.size()) + " offsets but " +
                                std::to_string(counts.size()) + " counts");
  for (size_t i = 0; i < offsets.size(); ++i)
    if (offsets[i] < 0 || counts[i] < 0)
      throw std::invalid_argument(op + ": tensor " + std::to_string(i) + " has offset " +
                                  std::to_string(offsets[i]) + " and count " +
                                  std::to_string(counts[i]));
}
}  // namespace

void validate_adamw_update_many(const std::vector<int64_t>& offsets,
                                const std::vector<int64_t>& counts,
                                const std::vector<AdamWStep>& steps) {
  validate_tensor_segments("adamw_update_many", offsets, counts);
  if (steps.size() != offsets.size())
    throw std::invalid_argument("adamw_update_many: " + std::to_string(offsets.size()) +
                                " tensors but " + std::to_string(steps.size()) +
                                " steps (one a tensor)");
}

void validate_sum_squares_many(const std::vector<int64_t>& offsets,
                               const std::vector<int64_t>& counts) {
  validate_tensor_segments("sum_squares_many", offsets, counts);
}

}  // namespace fp4sim
