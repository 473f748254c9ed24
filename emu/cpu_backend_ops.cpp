// CpuBackend's layer, optimizer and fused ops: emu/layers.hpp and emu/optim.hpp on host views,
// BF16 storage handled at each op's edges (emu/cpu_backend.hpp).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "emu/cpu_backend.hpp"
#include "emu/formats.hpp"
#include "emu/fused.hpp"
#include "emu/op_checks.hpp"
#include "emu/qadamw.hpp"
#include "emu/workspace.hpp"

namespace fp4sim::emu {

namespace {

// An input's values as float32: BF16 widened, bf16_values rounded (into tmp), else the view's own.
const float* read(const TensorView& v, std::vector<float>& tmp) {
  if (!v.present()) return nullptr;
  const size_t n = static_cast<size_t>(v.numel());
  if (v.dtype == DType::BF16) {
    tmp.resize(n);
    const uint16_t* b = v.as<const uint16_t>();
    for (size_t i = 0; i < n; ++i) tmp[i] = bf16_to_f32(b[i]);
    return tmp.data();
  }
  if (v.bf16_values) {
    tmp.assign(v.as<const float>(), v.as<const float>() + n);
    round_to_bf16(tmp.data(), static_cast<int64_t>(n));
    return tmp.data();
  }
  return v.as<const float>();
}

// Where an op writes output v as float32: the view's own memory, or tmp for a BF16 output.
float* target(const TensorView& v, std::vector<float>& tmp) {
  if (!v.present()) return nullptr;
  if (v.dtype != DType::BF16) return v.as<float>();
  tmp.assign(static_cast<size_t>(v.numel()), 0.0f);
  return tmp.data();
}

// After the op wrote out (float32 at `written`): the output's storage, rounded and narrowed.
void finish(const TensorView& v, float* written) {
  if (!v.present()) return;
  const int64_t n = v.numel();
  if (v.dtype == DType::BF16) {
    uint16_t* b = v.as<uint16_t>();
    for (int64_t i = 0; i < n; ++i) b[i] = bf16_rne(written[i]);
  } else if (v.bf16_values) {
    round_to_bf16(written, n);
  }
}

// After the op wrote a float32 output that may be strided: each row rounded when v.bf16_values.
void finish_rows(const TensorView& v) {
  if (!v.bf16_values) return;
  for (int64_t r = 0; r < v.rows; ++r) round_to_bf16(v.as<float>() + r * v.stride(), v.cols);
}

// A bias as the op adds it: its BF16 rounding where the output is stored as BF16
// (Backend::matmul_forward's rule), else its float32 values.
const float* bias_as_added(const TensorView& bias, bool bf16_out, std::vector<float>& tmp) {
  if (!bias.present()) return nullptr;
  const float* b = read(bias, tmp);
  if (!bf16_out || bias.dtype == DType::BF16) return b;
  if (b != tmp.data()) tmp.assign(b, b + bias.numel());
  round_to_bf16(tmp.data(), bias.numel());
  return tmp.data();
}

}  // namespace

bool CpuBackend::supports(Capability c, int64_t arg) const {
  return (c == Capability::AttentionHeadDim || c == Capability::SsmConvWidth ||
          c == Capability::SsmScanSize || c == Capability::SsmChunk) &&
         arg > 0;
}

void CpuBackend::embedding_forward(const TensorView& out, const TensorView& tokens,
                                   const TensorView& pos, const TensorView& wte,
                                   const TensorView& wpe) {
  op_checks::embedding_forward(out, tokens, pos, wte, wpe);
  const int64_t N = out.rows, C = out.cols;
  emu::embedding_forward(out.as<float>(), tokens.as<const int32_t>(), pos.as<const int32_t>(),
                         wte.as<const float>(), wpe.as<const float>(), N, C);
}

void CpuBackend::embedding_backward(const TensorView& dwte, const TensorView& dwpe,
                                    const TensorView& dout, const TensorView& tokens,
                                    const TensorView& pos) {
  op_checks::embedding_backward(dwte, dwpe, dout, tokens, pos);
  const int64_t N = dout.rows, C = dout.cols;
  emu::embedding_backward(dwte.as<float>(), dwpe.as<float>(), dout.as<const float>(),
                          tokens.as<const int32_t>(), pos.as<const int32_t>(), N, C);
}

void CpuBackend::norm_forward(NormKind kind, const TensorView& out, const TensorView& mean,
                              const TensorView& rstd, const TensorView& inp,
                              const TensorView& weight, const TensorView& bias) {
  op_checks::norm_forward(kind, out, mean, rstd, inp, weight, bias);
  workspace::named("norm_forward", out, workspace::norm_forward(out), [&] {
    const int64_t N = inp.rows, C = inp.cols;
    const bool ln = kind == NormKind::LayerNorm;
    std::vector<float> o;
    float* y = target(out, o);
    if (ln)
      emu::layernorm_forward(y, mean.as<float>(), rstd.as<float>(), inp.as<const float>(),
                             weight.as<const float>(), bias.as<const float>(), N, C);
    else
      emu::rmsnorm_forward(y, rstd.as<float>(), inp.as<const float>(), weight.as<const float>(), N,
                           C);
    finish(out, y);
  });
}

void CpuBackend::norm_backward(NormKind kind, const TensorView& dinp, const TensorView& dweight,
                               const TensorView& dbias, const TensorView& dout,
                               const TensorView& inp, const TensorView& weight,
                               const TensorView& mean, const TensorView& rstd) {
  op_checks::norm_backward(kind, dinp, dweight, dbias, dout, inp, weight, mean, rstd);
  workspace::named("norm_backward", dinp, workspace::norm_backward(dout), [&] {
    const int64_t N = inp.rows, C = inp.cols;
    const bool ln = kind == NormKind::LayerNorm;
    std::vector<float> d;
    const float* dy = read(dout, d);
    if (ln)
      emu::layernorm_backward(dinp.as<float>(), dweight.as<float>(), dbias.as<float>(), dy,
                              inp.as<const float>(), weight.as<const float>(),
                              mean.as<const float>(), rstd.as<const float>(), N, C);
    else
      emu::rmsnorm_backward(dinp.as<float>(), dweight.as<float>(), dy, inp.as<const float>(),
                            weight.as<const float>(), rstd.as<const float>(), N, C);
    finish(dinp, dinp.as<float>());
  });
}

void CpuBackend::matmul_forward(const TensorView& out, const TensorView& inp,
                                const TensorView& weight, const TensorView& bias,
                                GemmPrecision prec) {
  op_checks::matmul_forward(out, inp, weight, bias, prec);
  workspace::named(
      "matmul_forward", out, workspace::matmul_forward(out, inp, weight, bias, prec), [&] {
        const int64_t N = inp.rows, K = inp.cols, OC = weight.rows;
        std::vector<float> x, w, b, o;
        float* y = target(out, o);
        emu::matmul_forward(y, read(inp, x), read(weight, w),
                            bias_as_added(bias, out.bf16_storage(), b), N, K, OC, prec);
        finish(out, y);
      });
}

void CpuBackend::matmul_backward(const TensorView& dinp, const TensorView& dweight,
                                 const TensorView& dbias, const TensorView& dout,
                                 const TensorView& inp, const TensorView& weight,
                                 GemmPrecision prec) {
  op_checks::matmul_backward(dinp, dweight, dbias, dout, inp, weight, prec);
  workspace::named("matmul_backward", dout,
                   workspace::matmul_backward(dinp, dweight, dout, inp, weight, prec), [&] {
                     const int64_t N = dout.rows, OC = dout.cols, K = weight.cols;
                     std::vector<float> d, x, w, dx;
                     float* dxp = target(dinp, dx);
                     emu::matmul_backward(dxp, dweight.as<float>(), dbias.as<float>(),
                                          read(dout, d), read(inp, x), read(weight, w), N, K, OC,
                                          prec);
                     finish(dinp, dxp);
                   });
}

void CpuBackend::bias_forward(const TensorView& out, const TensorView& inp,
                              const TensorView& bias) {
  op_checks::bias_forward(out, inp, bias);
  workspace::named("bias_forward", out, workspace::bias_forward(out, bias), [&] {
    const int64_t N = inp.rows, OC = inp.cols;
    // (a BF16 output: the sums in inp, the scratch, then narrowed)
    float* y = out.dtype == DType::BF16 ? inp.as<float>() : out.as<float>();
    if (y != inp.as<const float>())
      std::memcpy(y, inp.as<const float>(), static_cast<size_t>(N * OC) * sizeof(float));
    std::vector<float> b;
    emu::bias_forward(y, bias_as_added(bias, out.bf16_storage(), b), N, OC);
    finish(out, y);
  });
}

void CpuBackend::bias_backward(const TensorView& dbias, const TensorView& dout) {
  op_checks::bias_backward(dbias, dout);
  emu::bias_backward(dbias.as<float>(), dout.as<const float>(), dout.rows, dout.cols);
}

void CpuBackend::attention_forward(const TensorView& out, const TensorView& lse,
                                   const TensorView& qkv, const AttentionShape& s,
                                   GemmPrecision prec) {
  op_checks::attention_forward(out, lse, qkv, s, prec);
  workspace::named("attention_forward", out,
                   workspace::attention_forward(out, qkv, s, prec, omp_get_max_threads()), [&] {
                     std::vector<float> q, o;
                     float* y = target(out, o);
                     emu::attention_forward(y, lse.as<float>(), read(qkv, q), s.B, s.T, s.NH, s.NKV,
                                            s.HD, prec);
                     finish(out, y);
                   });
}

void CpuBackend::attention_backward(const TensorView& dqkv, const TensorView& dout,
                                    const TensorView& qkv, const TensorView& out,
                                    const TensorView& lse, const AttentionShape& s,
                                    GemmPrecision prec) {
  op_checks::attention_backward(dqkv, dout, qkv, out, lse, s, prec);
  workspace::named(
      "attention_backward", dqkv,
      workspace::attention_backward(dqkv, dout, qkv, out, s, prec, omp_get_max_threads()), [&] {
        std::vector<float> d, q, o, dq;
        float* g = target(dqkv, dq);
        emu::attention_backward(g, read(dout, d), read(qkv, q), read(out, o), lse.as<const float>(),
                                s.B, s.T, s.NH, s.NKV, s.HD, prec);
        finish(dqkv, g);
      });
}

void CpuBackend::rope_forward(const TensorView& qkv, const AttentionShape& s) {
  op_checks::rope("rope_forward", qkv, s);
  emu::rope_forward(qkv.as<float>(), s.B, s.T, s.NH, s.NKV, s.HD);
}

void CpuBackend::rope_backward(const TensorView& dqkv, const AttentionShape& s) {
  op_checks::rope("rope_backward", dqkv, s);
  emu::rope_backward(dqkv.as<float>(), s.B, s.T, s.NH, s.NKV, s.HD);
}

void CpuBackend::activation_forward(Activation act, const TensorView& out, const TensorView& inp) {
  op_checks::activation_forward(act, out, inp);
  const int64_t N = inp.rows, F = act == Activation::SwiGLU ? inp.cols / 2 : inp.cols;
  const float* x = inp.as<const float>();
  float* y = out.as<float>();
  if (act == Activation::GeluTanh)
    emu::gelu_forward(y, x, N * F);
  else if (act == Activation::SquaredRelu)
    emu::squared_relu_forward(y, x, N * F);
  else
    emu::swiglu_forward(y, x, N, F);
  finish(out, y);
}

void CpuBackend::activation_backward(Activation act, const TensorView& dinp, const TensorView& inp,
                                     const TensorView& dout) {
  op_checks::activation_backward(act, dinp, inp, dout);
  workspace::named("activation_backward", dinp, workspace::activation_backward(dout), [&] {
    const int64_t N = inp.rows, F = act == Activation::SwiGLU ? inp.cols / 2 : inp.cols;
    std::vector<float> d;
    const float* dy = read(dout, d);
    if (act == Activation::GeluTanh)
      emu::gelu_backward(dinp.as<float>(), inp.as<const float>(), dy, N * F);
    else if (act == Activation::SquaredRelu)
      emu::squared_relu_backward(dinp.as<float>(), inp.as<const float>(), dy, N * F);
    else
      emu::swiglu_backward(dinp.as<float>(), inp.as<const float>(), dy, N, F);
    finish(dinp, dinp.as<float>());
  });
}

void CpuBackend::convert(const TensorView& dst, const TensorView& src) {
  op_checks::convert(dst, src);
  const int64_t n = src.numel();
  if (src.dtype == DType::BF16 && dst.dtype == DType::F32 && !dst.bf16_values) {
    const uint16_t* s = src.as<const uint16_t>();
    float* d = dst.as<float>();
    for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_f32(s[i]);
  } else if (src.dtype == DType::F32 && dst.dtype == DType::BF16) {
    finish(dst, src.as<float>());  // (src is only read: finish narrows a BF16 view)
  } else {  // (float32 -> float32 holding BF16 values: op_checks::convert allows nothing else)
    if (dst.data != src.data)
      std::memcpy(dst.data, src.data, static_cast<size_t>(n) * sizeof(float));
    round_to_bf16(dst.as<float>(), n);
  }
}

void CpuBackend::residual_forward(const TensorView& out, const TensorView& a, const TensorView& b) {
  op_checks::residual_forward(out, a, b);
  workspace::named("residual_forward", out, workspace::residual_forward(b), [&] {
    const int64_t n = a.numel();
    std::vector<float> t;
    const float* x = a.as<const float>();
    const float* y = read(b, t);
    float* o = out.as<float>();
    for (int64_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
    finish(out, o);
  });
}

void CpuBackend::crossentropy_forward_backward(const TensorView& losses, const TensorView& dlogits,
                                               const TensorView& logits, const TensorView& targets,
                                               const TensorView& dlosses) {
  const int64_t N = logits.rows, V = logits.cols;
  op_checks::crossentropy_forward_backward(losses, dlogits, logits, targets, dlosses);
  workspace::named(
      "crossentropy_forward_backward", logits, workspace::crossentropy(dlogits, logits), [&] {
        const bool round = logits.bf16_storage();
        std::vector<float> z, d;
        float* g = target(dlogits, d);
        // (logits read rounded by the reference itself when round: BF16 bits widen exactly)
        const float* x = logits.dtype == DType::BF16 ? read(logits, z) : logits.as<const float>();
        emu::crossentropy_softmax_forward_backward(losses.as<float>(), g, x,
                                                   targets.as<const int32_t>(),
                                                   dlosses.as<const float>(), N, V, round);
        if (dlogits.dtype == DType::BF16) finish(dlogits, g);  // (exact: g is BF16-rounded)
      });
}

void CpuBackend::adamw_update(const TensorView& params, const TensorView& params16,
                              const TensorView& grads, const TensorView& m, const TensorView& v,
                              const std::vector<Segment>& segments,
                              const std::vector<AdamWStep>& steps) {
  op_checks::adamw_update(params, params16, grads, m, v, segments, steps);
  float* p = params.as<float>();
  const float* g = grads.as<const float>();
  uint16_t* p16 = params16.as<uint16_t>();
  const bool bf16_state = m.dtype == DType::BF16;  // optim.state = bf16: decode, update, RNE
  for (size_t s = 0; s < segments.size(); ++s) {
    const Segment& sg = segments[s];
    for (int64_t i = sg.offset; i < sg.offset + sg.count; ++i) {
      if (bf16_state) {
        uint16_t* m16 = m.as<uint16_t>() + i;
        uint16_t* v16 = v.as<uint16_t>() + i;
        float mi = bf16_to_f32(*m16), vi = bf16_to_f32(*v16);
        adamw_element(p[i], g[i], mi, vi, steps[s]);
        *m16 = bf16_rne(mi);
        *v16 = bf16_rne(vi);
      } else {
        adamw_element(p[i], g[i], m.as<float>()[i], v.as<float>()[i], steps[s]);
      }
      if (p16) p16[i] = bf16_rne(p[i]);
    }
  }
}

void CpuBackend::qadamw_update(const TensorView& params, const TensorView& params16,
                               const TensorView& grads, const QAdamWState& st,
                               const std::vector<Segment>& segments,
                               const std::vector<AdamWStep>& steps, uint64_t seed,
                               const std::vector<uint64_t>& streams) {
  op_checks::qadamw_update(params, params16, grads, st, segments, steps, streams);
  float* p = params.as<float>();
  const float* g = grads.as<const float>();
  uint16_t* p16 = params16.as<uint16_t>();
  float* amax = st.amax.as<float>();
  const int64_t T = st.v_tile, nseg = static_cast<int64_t>(segments.size());
  const int blocks = static_cast<int>(T / 16);
  int64_t base = 0;  // the segment's state offset
  for (int64_t s = 0; s < nseg; ++s) {
    const Segment& sg = segments[s];
    const int64_t tiles = sg.count / T;
    auto tile_state = [&](int64_t k) {
      const int64_t e = base + k * T;
      return QAdamWTile{st.m_codes.as<uint8_t>() + e / 2,
                        st.m_scales.as<uint8_t>() + e / 16,
                        st.v_codes.as<uint8_t>() + e / 2,
                        st.v_scales.as<uint8_t>() + e / 16,
                        st.v_mean.as<uint16_t>() + e / T,
                        st.v_floor.present() ? st.v_floor.as<uint16_t>() + e / T : nullptr};
    };
    QAdamWAmax a{amax[2 * s], amax[2 * s + 1], 0.0f, 0.0f};
    // pass 0: the new amaxes (a max is exact in any order; each tile's own in parallel)
    std::vector<float> tm(tiles), tv(tiles);
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < tiles; ++k)
      qadamw_tile(false, blocks, p + sg.offset + k * T, g + sg.offset + k * T, tile_state(k), a,
                  steps[s], seed, streams[s], static_cast<uint64_t>(k * blocks), &tm[k], &tv[k],
                  nullptr);
    for (int64_t k = 0; k < tiles; ++k) {
      a.m_new = fmax_nan_ignored(a.m_new, tm[k]);
      a.v_new = fmax_nan_ignored(a.v_new, tv[k]);
    }
    // pass 1: encode under them, write the parameters
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < tiles; ++k)
      qadamw_tile(true, blocks, p + sg.offset + k * T, g + sg.offset + k * T, tile_state(k), a,
                  steps[s], seed, streams[s], static_cast<uint64_t>(k * blocks), nullptr, nullptr,
                  p16 ? p16 + sg.offset + k * T : nullptr);
    amax[2 * s] = a.m_new;
    amax[2 * s + 1] = a.v_new;
    amax[2 * nseg + 2 * s] = a.m_new;
    amax[2 * nseg + 2 * s + 1] = a.v_new;
    base += sg.count;
  }
}

void CpuBackend::sum_squares(const TensorView& x, const std::vector<Segment>& segments,
                             double* sums) {
  op_checks::sum_squares(x, segments);
  const float* p = x.as<const float>();
  for (size_t s = 0; s < segments.size(); ++s) {
    double acc = 0;
    for (int64_t i = segments[s].offset; i < segments[s].offset + segments[s].count; ++i)
      acc += static_cast<double>(p[i]) * p[i];
    sums[s] = acc;
  }
}

void CpuBackend::axpby(const TensorView& out, float a, const TensorView& x, float b,
                       const TensorView& y) {
  op_checks::axpby(out, x, y);
  const int64_t n = x.numel();
  const float* px = x.as<const float>();
  const float* py = y.present() ? y.as<const float>() : nullptr;
  float* po = out.as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i)
    po[i] = py ? axpby_element(a, px[i], b, py[i]) : fmul_rn(a, px[i]);
}

void CpuBackend::transpose(const TensorView& out, const TensorView& x) {
  op_checks::transpose(out, x);
  const int64_t R = x.rows, C = x.cols;
  const float* px = x.as<const float>();
  float* po = out.as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < C; ++c)
    for (int64_t r = 0; r < R; ++r) po[c * R + r] = px[r * C + c];
}

void CpuBackend::clamp(const TensorView& out, const TensorView& x, float bound) {
  op_checks::clamp(out, x, bound);
  const int64_t n = x.numel();
  const float* px = x.as<const float>();
  float* po = out.as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) po[i] = clamp_element(px[i], bound);
}

float CpuBackend::frobenius_norm(const TensorView& x) {
  op_checks::frobenius_norm(x);
  const int64_t R = x.rows, C = x.cols;
  const float* px = x.as<const float>();
  std::vector<double> rows(static_cast<size_t>(R));
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    double s = 0.0;
    for (int64_t c = 0; c < C; ++c) {
      const double d = px[r * C + c];
      s += d * d;
    }
    rows[static_cast<size_t>(r)] = s;
  }
  double total = 0.0;
  for (double s : rows) total += s;
  return static_cast<float>(std::sqrt(total));
}

float CpuBackend::abs_quantile(const TensorView& x, double q) {
  op_checks::abs_quantile(x, q);
  const int64_t n = x.numel();
  const float* px = x.as<const float>();
  std::vector<uint32_t> keys(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) keys[static_cast<size_t>(i)] = abs_key(px[i]);
  // the two order statistics the interpolation reads: the lo-th key, then the least key above it
  const int64_t lo = quantile_low(q, n);
  std::nth_element(keys.begin(), keys.begin() + lo, keys.end());
  const uint32_t k_lo = keys[static_cast<size_t>(lo)];
  const uint32_t k_hi = lo + 1 < n ? *std::min_element(keys.begin() + lo + 1, keys.end()) : k_lo;
  return quantile_between(f32_from_bits(k_lo), f32_from_bits(k_hi), q, n);
}

void CpuBackend::ssm_conv_forward(const TensorView& out, const TensorView& inp,
                                  const TensorView& weight, const TensorView& bias,
                                  const SsmShape& s) {
  op_checks::ssm_conv_forward(out, inp, weight, bias, s);
  const int64_t ws = workspace::ssm_conv_forward(s, weight.cols, omp_get_max_threads());
  workspace::named("ssm_conv_forward", out, ws, [&] {
    emu::conv1d_silu_forward(out.as<float>(), inp.as<const float>(), inp.stride(),
                             weight.as<const float>(), bias.as<const float>(), s.B, s.T,
                             s.xbc_cols(), weight.cols);
    finish(out, out.as<float>());
  });
}

void CpuBackend::ssm_conv_backward(const TensorView& dinp, const TensorView& dweight,
                                   const TensorView& dbias, const TensorView& dout,
                                   const TensorView& inp, const TensorView& weight,
                                   const TensorView& bias, const SsmShape& s) {
  op_checks::ssm_conv_backward(dinp, dweight, dbias, dout, inp, weight, bias, s);
  const int64_t ws = workspace::ssm_conv_backward(s, weight.cols, omp_get_max_threads());
  workspace::named("ssm_conv_backward", dinp, ws, [&] {
    emu::conv1d_silu_backward(dinp.as<float>(), dinp.stride(), dweight.as<float>(),
                              dbias.as<float>(), dout.as<const float>(), inp.as<const float>(),
                              inp.stride(), weight.as<const float>(), bias.as<const float>(), s.B,
                              s.T, s.xbc_cols(), weight.cols);
    finish_rows(dinp);
  });
}

void CpuBackend::ssm_scan_forward(const TensorView& y, const TensorView& states,
                                  const TensorView& dt, const TensorView& A, const TensorView& xbc,
                                  const TensorView& dt_raw, const TensorView& dt_bias,
                                  const TensorView& A_log, const TensorView& D, const SsmShape& s) {
  op_checks::ssm_scan_forward(y, states, dt, A, xbc, dt_raw, dt_bias, A_log, D, s);
  const int64_t ws = workspace::ssm_scan_forward(s, omp_get_max_threads());
  workspace::named("ssm_scan_forward", y, ws, [&] {
    emu::ssm_dt_forward(dt.as<float>(), A.as<float>(), dt_raw.as<const float>(), dt_raw.stride(),
                        dt_bias.as<const float>(), A_log.as<const float>(), s.B, s.T, s.H);
    emu::ssm_scan_forward(y.as<float>(), states.as<float>(), xbc.as<const float>(),
                          dt.as<const float>(), A.as<const float>(), D.as<const float>(), s);
    finish(y, y.as<float>());
  });
}

void CpuBackend::ssm_scan_backward(const TensorView& dxbc, const TensorView& ddt_raw,
                                   const TensorView& ddt_bias, const TensorView& dA_log,
                                   const TensorView& dD, const TensorView& dy,
                                   const TensorView& xbc, const TensorView& dt, const TensorView& A,
                                   const TensorView& dt_raw, const TensorView& dt_bias,
                                   const TensorView& A_log, const TensorView& D,
                                   const TensorView& states, const SsmShape& s) {
  op_checks::ssm_scan_backward(dxbc, ddt_raw, ddt_bias, dA_log, dD, dy, xbc, dt, A, dt_raw, dt_bias,
                               A_log, D, states, s);
  const int64_t ws = workspace::ssm_scan_backward(s, omp_get_max_threads());
  workspace::named("ssm_scan_backward", dxbc, ws, [&] {
    // the gradients of dt and A, from the scan to softplus's and exp's backward passes (float32)
    std::vector<float> ddt(static_cast<size_t>(s.B * s.T * s.H)), dA(static_cast<size_t>(s.H));
    emu::ssm_scan_backward(dxbc.as<float>(), ddt.data(), dA.data(), dD.as<float>(),
                           dy.as<const float>(), xbc.as<const float>(), dt.as<const float>(),
                           A.as<const float>(), D.as<const float>(), states.as<const float>(), s);
    finish(dxbc, dxbc.as<float>());
    emu::ssm_dt_backward(ddt_raw.as<float>(), ddt_raw.stride(), ddt_bias.as<float>(),
                         dA_log.as<float>(), ddt.data(), dA.data(), dt_raw.as<const float>(),
                         dt_raw.stride(), dt_bias.as<const float>(), A_log.as<const float>(), s.B,
                         s.T, s.H);
    finish_rows(ddt_raw);
  });
}

void CpuBackend::gated_norm_forward(const TensorView& out, const TensorView& rstd,
                                    const TensorView& inp, const TensorView& z,
                                    const TensorView& weight) {
  op_checks::gated_norm_forward(out, rstd, inp, z, weight);
  const int64_t ws = workspace::gated_norm_forward(inp.cols, rstd.cols, omp_get_max_threads());
  workspace::named("gated_norm_forward", out, ws, [&] {
    emu::gated_rmsnorm_forward(out.as<float>(), rstd.as<float>(), inp.as<const float>(),
                               z.as<const float>(), z.stride(), weight.as<const float>(), inp.rows,
                               inp.cols, rstd.cols);
    finish(out, out.as<float>());
  });
}

void CpuBackend::gated_norm_backward(const TensorView& dinp, const TensorView& dz,
                                     const TensorView& dweight, const TensorView& dout,
                                     const TensorView& inp, const TensorView& z,
                                     const TensorView& weight, const TensorView& rstd) {
  op_checks::gated_norm_backward(dinp, dz, dweight, dout, inp, z, weight, rstd);
  const int64_t ws = workspace::gated_norm_backward(dout, rstd.cols, omp_get_max_threads());
  workspace::named("gated_norm_backward", dinp, ws, [&] {
    std::vector<float> d;
    emu::gated_rmsnorm_backward(dinp.as<float>(), dz.as<float>(), dz.stride(), dweight.as<float>(),
                                read(dout, d), inp.as<const float>(), z.as<const float>(),
                                z.stride(), weight.as<const float>(), rstd.as<const float>(),
                                inp.rows, inp.cols, rstd.cols);
    finish(dinp, dinp.as<float>());
    finish_rows(dz);
  });
}

void CpuBackend::residual_norm_forward(NormKind kind, const TensorView& res, const TensorView& out,
                                       const TensorView& mean, const TensorView& rstd,
                                       const TensorView& a, const TensorView& b,
                                       const TensorView& weight, const TensorView& bias) {
  compose_residual_norm_forward(*this, kind, res, out, mean, rstd, a, b, weight, bias);
}

void CpuBackend::matmul_forward_activation(const TensorView& out, const ActivationSource& src,
                                           const TensorView& weight, const TensorView& bias,
                                           GemmPrecision prec) {
  compose_matmul_forward_activation(*this, out, src, weight, bias, prec);
}

void CpuBackend::matmul_backward_activation(const TensorView& dinp, const TensorView& dweight,
                                            const TensorView& dbias, const ActivationSource& src,
                                            const TensorView& inp, const TensorView& weight,
                                            GemmPrecision prec) {
  compose_matmul_backward_activation(*this, dinp, dweight, dbias, src, inp, weight, prec);
}

void CpuBackend::quantize_activation(const ActivationSource& src, const QuantizeConfig& cfg,
                                     QuantizedView* rowwise, QuantizedView* columnwise,
                                     const TensorView& dbias) {
  compose_quantize_activation(*this, src, cfg, rowwise, columnwise, dbias);
}

}  // namespace fp4sim::emu
