#include "emu/op_checks.hpp"

#include <string>
#include <utility>

namespace fp4sim::op_checks {

namespace {

constexpr ViewRule kF32{};                                               // float32, as stored
constexpr ViewRule kF32Opt{true, false, false, false, true};             // float32 or absent
constexpr ViewRule kF32Marked{true, false, false, true, false};          // float32, bf16_values ok
constexpr ViewRule kAny{true, true, false, false, false};                // float32 or BF16
constexpr ViewRule kAnyOpt{true, true, false, false, true};              // float32, BF16 or absent
constexpr ViewRule kAnyMarked{true, true, false, true, false};           // float32 (marked) or BF16
constexpr ViewRule kI32{false, false, true, false, false};               // int32
constexpr ViewRule kBf16Opt{false, true, false, false, true};            // BF16 or absent
constexpr ViewRule kU8{false, false, false, false, false, false, true};  // uint8
constexpr ViewRule kBf16{false, true, false, false, false};              // BF16
constexpr ViewRule kF32Strided{true, false, false, false, false, true};  // float32, row stride
constexpr ViewRule kF32MarkedStrided{true, false, false, true, false, true};  // ... bf16_values ok

// FP32 precision (gradient checks) reads and writes float32 views only.
void fp32_views_only(const char* op, GemmPrecision prec,
                     std::initializer_list<const TensorView*> views) {
  if (prec != GemmPrecision::FP32) return;
  for (const TensorView* v : views)
    if (v->present() && v->dtype != DType::F32)
      throw std::invalid_argument(std::string(op) + ": tensor '" + v->name +
                                  "' is bfloat16; FP32 precision takes float32 views");
}

void segments_within(const char* op, const TensorView& x, const std::vector<Segment>& segments) {
  validate_segments(op, segments);
  for (size_t s = 0; s < segments.size(); ++s)
    if (segments[s].offset + segments[s].count > x.numel())
      throw std::invalid_argument(std::string(op) + ": tensor " + std::to_string(s) +
                                  " ends past '" + x.name + "'");
}

// The mixer's sizes: positive, the heads a multiple of the groups.
void ssm_shape(const char* op, const SsmShape& s) {
  const std::pair<const char*, int64_t> sizes[] = {
      {"B", s.B}, {"T", s.T}, {"H", s.H}, {"P", s.P}, {"G", s.G}, {"N", s.N}, {"chunk", s.chunk}};
  for (const auto& [what, v] : sizes)
    if (v <= 0)
      throw std::invalid_argument(std::string(op) + ": size " + what + " = " + std::to_string(v) +
                                  " must be positive");
  if (s.H % s.G != 0)
    throw std::invalid_argument(std::string(op) + ": " + std::to_string(s.H) +
                                " heads are not a multiple of " + std::to_string(s.G) + " groups");
}

// The conv's inputs: inp [B*T, C] strided, weight [C, W] (W >= 1), bias [C, 1].
void conv_views(const char* op, const TensorView& inp, const TensorView& weight,
                const TensorView& bias, const SsmShape& s) {
  ssm_shape(op, s);
  const int64_t C = s.xbc_cols();
  check_view(op, weight, C, weight.cols, kF32);
  if (weight.cols < 1)
    throw std::invalid_argument(std::string(op) + ": tensor '" + weight.name +
                                "' has no columns (the conv width)");
  check_view(op, inp, s.B * s.T, C, kF32Strided);
  check_view(op, bias, C, 1, kF32);
}

// The gated norm's inputs: inp [N, C], z [N, C] strided, weight [C, 1], rstd [N, G], C % G == 0.
void gated_norm_views(const char* op, const TensorView& rstd, const TensorView& inp,
                      const TensorView& z, const TensorView& weight) {
  const int64_t N = inp.rows, C = inp.cols, G = rstd.cols;
  if (G < 1 || C % G != 0)
    throw std::invalid_argument(std::string(op) + ": " + std::to_string(C) +
                                " channels are not a multiple of the " + std::to_string(G) +
                                " groups (the columns of tensor '" + rstd.name + "')");
  check_view(op, rstd, N, G, kF32);
  check_view(op, inp, N, C, kF32);
  check_view(op, z, N, C, kF32Strided);
  check_view(op, weight, C, 1, kF32);
}

}  // namespace

void embedding_forward(const TensorView& out, const TensorView& tokens, const TensorView& pos,
                       const TensorView& wte, const TensorView& wpe) {
  const int64_t N = out.rows, C = out.cols;
  check_view("embedding_forward", out, N, C, kF32);
  check_view("embedding_forward", tokens, N, 1, kI32);
  check_view("embedding_forward", pos, N, 1, kI32);
  check_view("embedding_forward", wte, wte.rows, C, kF32);
  check_view("embedding_forward", wpe, wpe.rows, C, kF32Opt);
}

void embedding_backward(const TensorView& dwte, const TensorView& dwpe, const TensorView& dout,
                        const TensorView& tokens, const TensorView& pos) {
  const int64_t N = dout.rows, C = dout.cols;
  check_view("embedding_backward", dout, N, C, kF32);
  check_view("embedding_backward", dwte, dwte.rows, C, kF32);
  check_view("embedding_backward", dwpe, dwpe.rows, C, kF32Opt);
  check_view("embedding_backward", tokens, N, 1, kI32);
  check_view("embedding_backward", pos, N, 1, kI32);
}

void norm_forward(NormKind kind, const TensorView& out, const TensorView& mean,
                  const TensorView& rstd, const TensorView& inp, const TensorView& weight,
                  const TensorView& bias) {
  const int64_t N = inp.rows, C = inp.cols;
  const bool ln = kind == NormKind::LayerNorm;
  check_view("norm_forward", out, N, C, kAnyMarked);
  check_view("norm_forward", inp, N, C, kF32);
  check_view("norm_forward", weight, C, 1, kF32);
  check_view("norm_forward", rstd, N, 1, kF32);
  check_view("norm_forward", mean, N, 1, ln ? kF32 : kF32Opt);
  check_view("norm_forward", bias, C, 1, ln ? kF32 : kF32Opt);
}

void norm_backward(NormKind kind, const TensorView& dinp, const TensorView& dweight,
                   const TensorView& dbias, const TensorView& dout, const TensorView& inp,
                   const TensorView& weight, const TensorView& mean, const TensorView& rstd) {
  const int64_t N = inp.rows, C = inp.cols;
  const bool ln = kind == NormKind::LayerNorm;
  check_view("norm_backward", dinp, N, C, kF32Marked);
  check_view("norm_backward", dweight, C, 1, kF32);
  check_view("norm_backward", dbias, C, 1, ln ? kF32 : kF32Opt);
  check_view("norm_backward", dout, N, C, kAnyMarked);
  check_view("norm_backward", inp, N, C, kF32);
  check_view("norm_backward", weight, C, 1, kF32);
  check_view("norm_backward", mean, N, 1, ln ? kF32 : kF32Opt);
  check_view("norm_backward", rstd, N, 1, kF32);
}

void matmul_forward(const TensorView& out, const TensorView& inp, const TensorView& weight,
                    const TensorView& bias, GemmPrecision prec) {
  const int64_t N = inp.rows, K = inp.cols, OC = weight.rows;
  check_view("matmul_forward", out, N, OC, kAnyMarked);
  check_view("matmul_forward", inp, N, K, kAny);
  check_view("matmul_forward", weight, OC, K, kAny);
  check_view("matmul_forward", bias, OC, 1, kAnyOpt);
  fp32_views_only("matmul_forward", prec, {&out, &inp, &weight, &bias});
}

void matmul_backward(const TensorView& dinp, const TensorView& dweight, const TensorView& dbias,
                     const TensorView& dout, const TensorView& inp, const TensorView& weight,
                     GemmPrecision prec) {
  const int64_t N = dout.rows, OC = dout.cols, K = weight.cols;
  check_view("matmul_backward", dinp, N, K, kAnyOpt);
  check_view("matmul_backward", dweight, OC, K, kF32Opt);
  check_view("matmul_backward", dbias, OC, 1, kF32Opt);
  check_view("matmul_backward", dout, N, OC, kAny);
  check_view("matmul_backward", inp, N, K, dweight.present() ? kAny : kAnyOpt);
  check_view("matmul_backward", weight, OC, K, kAny);
  // (a BF16 dout at FP32 precision is widened, exactly: the output head's BF16 dlogits)
  fp32_views_only("matmul_backward", prec, {&dinp, &inp, &weight});
}

void bias_forward(const TensorView& out, const TensorView& inp, const TensorView& bias) {
  const int64_t N = inp.rows, OC = inp.cols;
  check_view("bias_forward", out, N, OC, kAnyMarked);
  check_view("bias_forward", inp, N, OC, kF32);
  check_view("bias_forward", bias, OC, 1, kAny);
}

void bias_backward(const TensorView& dbias, const TensorView& dout) {
  check_view("bias_backward", dbias, dout.cols, 1, kF32);
  check_view("bias_backward", dout, dout.rows, dout.cols, kF32);
}

void attention_forward(const TensorView& out, const TensorView& lse, const TensorView& qkv,
                       const AttentionShape& s, GemmPrecision prec) {
  check_view("attention_forward", out, s.B * s.T, s.NH * s.HD, kAnyMarked);
  check_view("attention_forward", lse, s.B * s.NH, s.T, kF32);
  check_view("attention_forward", qkv, s.B * s.T, s.qkv_cols(), kAny);
  fp32_views_only("attention_forward", prec, {&out, &qkv});
}

void attention_backward(const TensorView& dqkv, const TensorView& dout, const TensorView& qkv,
                        const TensorView& out, const TensorView& lse, const AttentionShape& s,
                        GemmPrecision prec) {
  check_view("attention_backward", dqkv, s.B * s.T, s.qkv_cols(), kAnyMarked);
  check_view("attention_backward", dout, s.B * s.T, s.NH * s.HD, kAny);
  check_view("attention_backward", qkv, s.B * s.T, s.qkv_cols(), kAny);
  check_view("attention_backward", out, s.B * s.T, s.NH * s.HD, kAny);
  check_view("attention_backward", lse, s.B * s.NH, s.T, kF32);
  fp32_views_only("attention_backward", prec, {&dqkv, &dout, &qkv, &out});
}

void rope(const char* op, const TensorView& qkv, const AttentionShape& s) {
  check_view(op, qkv, s.B * s.T, s.qkv_cols(), kF32);
}

void activation_forward(Activation act, const TensorView& out, const TensorView& inp) {
  const int64_t N = inp.rows, F = act == Activation::SwiGLU ? inp.cols / 2 : inp.cols;
  check_view("activation_forward", out, N, F, kF32Marked);
  check_view("activation_forward", inp, N, act == Activation::SwiGLU ? 2 * F : F, kF32);
}

void activation_backward(Activation act, const TensorView& dinp, const TensorView& inp,
                         const TensorView& dout) {
  const int64_t N = inp.rows, F = act == Activation::SwiGLU ? inp.cols / 2 : inp.cols;
  check_view("activation_backward", dinp, N, inp.cols, kF32Marked);
  check_view("activation_backward", inp, N, act == Activation::SwiGLU ? 2 * F : F, kF32);
  check_view("activation_backward", dout, N, F, kF32Marked);
}

void convert(const TensorView& dst, const TensorView& src) {
  check_view("convert", src, dst.rows, dst.cols, kAny);
  check_view("convert", dst, dst.rows, dst.cols, kAnyMarked);
  const bool widen = src.dtype == DType::BF16 && dst.dtype == DType::F32 && !dst.bf16_values;
  const bool narrow = src.dtype == DType::F32 && dst.dtype == DType::BF16;
  const bool round = src.dtype == DType::F32 && dst.bf16_values;
  if (!widen && !narrow && !round)
    throw std::invalid_argument(std::string("convert: '") + src.name + "' (" +
                                dtype_name(src.dtype) + ") to '" + dst.name + "' (" +
                                dtype_name(dst.dtype) +
                                "): expected bfloat16 -> float32, float32 -> bfloat16 or float32 "
                                "-> float32 holding BF16 values");
}

void residual_forward(const TensorView& out, const TensorView& a, const TensorView& b) {
  check_view("residual_forward", out, a.rows, a.cols, kF32Marked);
  check_view("residual_forward", a, a.rows, a.cols, kF32);
  check_view("residual_forward", b, a.rows, a.cols, kAny);
}

void crossentropy_forward_backward(const TensorView& losses, const TensorView& dlogits,
                                   const TensorView& logits, const TensorView& targets,
                                   const TensorView& dlosses) {
  const int64_t N = logits.rows, V = logits.cols;
  const char* op = "crossentropy_forward_backward";
  check_view(op, losses, N, 1, kF32);
  check_view(op, dlogits, N, V, kAnyMarked);
  check_view(op, logits, N, V, kAnyMarked);
  check_view(op, targets, N, 1, kI32);
  check_view(op, dlosses, N, 1, kF32);
  if (dlogits.bf16_storage() != logits.bf16_storage())
    throw std::invalid_argument(std::string(op) +
                                ": logits and dlogits must share a storage precision (both BF16 "
                                "or both float32)");
}

void adamw_update(const TensorView& params, const TensorView& params16, const TensorView& grads,
                  const TensorView& m, const TensorView& v, const std::vector<Segment>& segments,
                  const std::vector<AdamWStep>& steps) {
  for (const TensorView* t : {&params, &grads})
    check_view("adamw_update", *t, params.rows, params.cols, kF32);
  // the moments: both float32, or both BF16 (optim.state = bf16)
  check_view("adamw_update", m, params.rows, params.cols, kAny);
  check_view("adamw_update", v, params.rows, params.cols, m.dtype == DType::BF16 ? kBf16 : kF32);
  check_view("adamw_update", params16, params.rows, params.cols, kBf16Opt);
  segments_within("adamw_update", params, segments);
  if (steps.size() != segments.size())
    throw std::invalid_argument("adamw_update: " + std::to_string(segments.size()) +
                                " tensors but " + std::to_string(steps.size()) +
                                " steps (one a tensor)");
}

void qadamw_update(const TensorView& params, const TensorView& params16, const TensorView& grads,
                   const QAdamWState& st, const std::vector<Segment>& segments,
                   const std::vector<AdamWStep>& steps, const std::vector<uint64_t>& streams) {
  const char* op = "qadamw_update";
  check_view(op, params, params.rows, params.cols, kF32);
  check_view(op, grads, params.rows, params.cols, kF32);
  check_view(op, params16, params.rows, params.cols, kBf16Opt);
  segments_within(op, params, segments);
  if (steps.size() != segments.size() || streams.size() != segments.size())
    throw std::invalid_argument(std::string(op) + ": " + std::to_string(segments.size()) +
                                " tensors but " + std::to_string(steps.size()) + " steps and " +
                                std::to_string(streams.size()) + " streams (one each a tensor)");
  if (st.v_tile < 16 || st.v_tile % 16 != 0)
    throw std::invalid_argument(std::string(op) + ": v_tile " + std::to_string(st.v_tile) +
                                " is not a positive multiple of 16");
  int64_t n = 0;
  for (size_t s = 0; s < segments.size(); ++s) {
    if (segments[s].count % st.v_tile != 0)
      throw std::invalid_argument(std::string(op) + ": tensor " + std::to_string(s) + " has " +
                                  std::to_string(segments[s].count) +
                                  " elements, not a multiple of v_tile " +
                                  std::to_string(st.v_tile));
    n += segments[s].count;
  }
  for (const TensorView* t : {&st.m_codes, &st.v_codes}) check_view(op, *t, 1, n / 2, kU8);
  for (const TensorView* t : {&st.m_scales, &st.v_scales}) check_view(op, *t, 1, n / 16, kU8);
  check_view(op, st.v_mean, 1, n / st.v_tile, kBf16);
  check_view(op, st.v_floor, 1, n / st.v_tile, kBf16Opt);
  check_view(op, st.amax, 1, 4 * static_cast<int64_t>(segments.size()), kF32);
}

void sum_squares(const TensorView& x, const std::vector<Segment>& segments) {
  check_view("sum_squares", x, x.rows, x.cols, kF32);
  segments_within("sum_squares", x, segments);
}

void axpby(const TensorView& out, const TensorView& x, const TensorView& y) {
  check_view("axpby", x, x.rows, x.cols, kF32);
  check_view("axpby", out, x.rows, x.cols, kF32);
  check_view("axpby", y, x.rows, x.cols, kF32Opt);
}

void transpose(const TensorView& out, const TensorView& x) {
  check_view("transpose", x, x.rows, x.cols, kF32);
  check_view("transpose", out, x.cols, x.rows, kF32);
  if (out.data == x.data && x.numel() > 0)
    throw std::invalid_argument(std::string("transpose: tensor '") + out.name + "' is tensor '" +
                                x.name + "' (the op does not transpose in place)");
}

void clamp(const TensorView& out, const TensorView& x, float bound) {
  check_view("clamp", x, x.rows, x.cols, kF32);
  check_view("clamp", out, x.rows, x.cols, kF32);
  if (!(bound >= 0.0f))
    throw std::invalid_argument("clamp: bound " + std::to_string(bound) + " for tensor '" + x.name +
                                "' is not a number >= 0");
}

void frobenius_norm(const TensorView& x) { check_view("frobenius_norm", x, x.rows, x.cols, kF32); }

void abs_quantile(const TensorView& x, double q) {
  check_view("abs_quantile", x, x.rows, x.cols, kF32);
  if (x.numel() < 1)
    throw std::invalid_argument(std::string("abs_quantile: tensor '") + x.name +
                                "' has no elements");
  if (!(q >= 0.0 && q <= 1.0))
    throw std::invalid_argument("abs_quantile: quantile " + std::to_string(q) + " of tensor '" +
                                x.name + "' is outside [0, 1]");
}

void ssm_conv_forward(const TensorView& out, const TensorView& inp, const TensorView& weight,
                      const TensorView& bias, const SsmShape& s) {
  const char* op = "ssm_conv_forward";
  conv_views(op, inp, weight, bias, s);
  check_view(op, out, s.B * s.T, s.xbc_cols(), kF32Marked);
}

void ssm_conv_backward(const TensorView& dinp, const TensorView& dweight, const TensorView& dbias,
                       const TensorView& dout, const TensorView& inp, const TensorView& weight,
                       const TensorView& bias, const SsmShape& s) {
  const char* op = "ssm_conv_backward";
  conv_views(op, inp, weight, bias, s);
  const int64_t N = s.B * s.T, C = s.xbc_cols();
  check_view(op, dout, N, C, kF32);
  check_view(op, dinp, N, C, kF32MarkedStrided);
  check_view(op, dweight, C, weight.cols, kF32);
  check_view(op, dbias, C, 1, kF32);
}

void ssm_scan_forward(const TensorView& y, const TensorView& states, const TensorView& dt,
                      const TensorView& A, const TensorView& xbc, const TensorView& dt_raw,
                      const TensorView& dt_bias, const TensorView& A_log, const TensorView& D,
                      const SsmShape& s) {
  const char* op = "ssm_scan_forward";
  ssm_shape(op, s);
  const int64_t N = s.B * s.T;
  check_view(op, y, N, s.d_inner(), kF32Marked);
  check_view(op, states, s.B * s.H * s.chunks(), s.P * s.N, kF32Opt);
  check_view(op, dt, N, s.H, kF32);
  check_view(op, A, s.H, 1, kF32);
  check_view(op, xbc, N, s.xbc_cols(), kF32);
  check_view(op, dt_raw, N, s.H, kF32Strided);
  for (const TensorView* v : {&dt_bias, &A_log, &D}) check_view(op, *v, s.H, 1, kF32);
}

void ssm_scan_backward(const TensorView& dxbc, const TensorView& ddt_raw,
                       const TensorView& ddt_bias, const TensorView& dA_log, const TensorView& dD,
                       const TensorView& dy, const TensorView& xbc, const TensorView& dt,
                       const TensorView& A, const TensorView& dt_raw, const TensorView& dt_bias,
                       const TensorView& A_log, const TensorView& D, const TensorView& states,
                       const SsmShape& s) {
  const char* op = "ssm_scan_backward";
  ssm_shape(op, s);
  const int64_t N = s.B * s.T;
  check_view(op, dxbc, N, s.xbc_cols(), kF32Marked);
  check_view(op, ddt_raw, N, s.H, kF32MarkedStrided);
  for (const TensorView* v : {&ddt_bias, &dA_log, &dD}) check_view(op, *v, s.H, 1, kF32);
  check_view(op, dy, N, s.d_inner(), kF32);
  check_view(op, xbc, N, s.xbc_cols(), kF32);
  check_view(op, dt, N, s.H, kF32);
  check_view(op, A, s.H, 1, kF32);
  check_view(op, dt_raw, N, s.H, kF32Strided);
  for (const TensorView* v : {&dt_bias, &A_log, &D}) check_view(op, *v, s.H, 1, kF32);
  check_view(op, states, s.B * s.H * s.chunks(), s.P * s.N, kF32);
}

void gated_norm_forward(const TensorView& out, const TensorView& rstd, const TensorView& inp,
                        const TensorView& z, const TensorView& weight) {
  const char* op = "gated_norm_forward";
  gated_norm_views(op, rstd, inp, z, weight);
  check_view(op, out, inp.rows, inp.cols, kF32Marked);
}

void gated_norm_backward(const TensorView& dinp, const TensorView& dz, const TensorView& dweight,
                         const TensorView& dout, const TensorView& inp, const TensorView& z,
                         const TensorView& weight, const TensorView& rstd) {
  const char* op = "gated_norm_backward";
  gated_norm_views(op, rstd, inp, z, weight);
  const int64_t N = inp.rows, C = inp.cols;
  check_view(op, dout, N, C, kF32Marked);
  check_view(op, dinp, N, C, kF32Marked);
  check_view(op, dz, N, C, kF32MarkedStrided);
  check_view(op, dweight, C, 1, kF32);
}

void activation_source(const char* op, const ActivationSource& src) {
  const int64_t N = src.inp.rows, C = src.inp.cols;
  check_view(op, src.inp, N, C, kAny);
  if (src.op == ActivationOp::Identity) return;
  check_view(op, src.out, N, C, kAnyMarked);
  if (src.op == ActivationOp::GeluBackward) check_view(op, src.dout, N, C, kAnyMarked);
}

}  // namespace fp4sim::op_checks
