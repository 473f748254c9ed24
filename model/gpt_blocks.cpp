// The blocks' forward and backward passes of Gpt (model/gpt.hpp): attention, MLP and Mamba-2,
// each from its pre-norm to its residual add; gpt.cpp holds the model around them (parameters,
// the embeddings, the head and the loss, the pass over the blocks).
#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "emu/formats.hpp"
#include "emu/fused.hpp"
#include "model/gpt.hpp"  // (the class whose member functions these are)

namespace fp4sim::model {

void Gpt::attention_block_forward(size_t b, const TensorView& in, bool norm_done) {
  BlockActs& a = acts_[b];
  const int64_t l = blocks_[b].layer, N = B_ * T_;
  const AttentionShape s = attention_shape();
  const bool rope = cfg_.positions == Positions::Rope;
  const TensorView ln1 = linear_input(b, 0);
  if (!norm_done) norm_forward(block_norm(b), ln1, in);
  // RoPE rotates the GEMM's output: then the rounding comes after it (so c_attn's output, and the
  // bias it adds, stay float32 until then: Backend::matmul_forward's bias rule)
  TensorView qkv = act_view(a.qkv, N, s.qkv_cols(), a.mid16, "qkv");
  if (rope) qkv.bf16_values = false;
  linear_fwd(l, 0, b, qkv, as_stored(ln1));
  if (rope) {
    be_.rope_forward(qkv, s);
    if (round_bf16()) be_.convert(act_view(a.qkv, N, s.qkv_cols(), false, "qkv"), qkv);
  }
  const TensorView atty = linear_input(b, 1);
  be_.attention_forward(atty, f32(a.lse, s.B * s.NH, s.T, "lse"), as_stored(qkv), s, prec_);
  // the c_proj output: read once, by the residual add
  linear_fwd(l, 1, b, proj_view(b), as_stored(atty));
  residual_after(b, in);
}

void Gpt::mlp_block_forward(size_t b, const TensorView& in, bool norm_done) {
  BlockActs& a = acts_[b];
  const int64_t l = blocks_[b].layer, N = B_ * T_;
  const TensorView ln2 = linear_input(b, 0);
  if (!norm_done) norm_forward(block_norm(b), ln2, in);
  const TensorView fc = act_view(a.fc, N, fc_width(), a.mid16, "mlp.c_fc out");
  linear_fwd(l, 2, b, fc, as_stored(ln2));
  // GELU's output goes to c_proj as a pending activation (linear_forward: computed in the pass
  // that makes the GEMM's operand, or run first); the others run here
  const TensorView act = linear_input(b, 1);
  ActivationSource gelu;
  const ActivationSource* pending = nullptr;
  if (cfg_.activation == Activation::GeluTanh) {
    gelu.op = ActivationOp::GeluForward;
    gelu.inp = as_stored(fc);
    gelu.out = act;
    pending = &gelu;
  } else {
    be_.activation_forward(cfg_.activation, act, as_stored(fc));
  }
  linear_fwd(l, 3, b, proj_view(b), as_stored(act), pending);
  residual_after(b, in);
}

SsmShape Gpt::ssm_shape() const {
  const MambaDims d = mamba_dims(cfg_);
  SsmShape s;
  s.B = B_;
  s.T = T_;
  s.H = d.H;
  s.P = d.P;
  s.G = d.G;
  s.N = d.N;
  s.chunk = d.Q;
  return s;
}

TensorView Gpt::mamba_param(size_t b, const char* what) const {
  return param(lname(blocks_[b].layer, "mamba.") + what);
}

TensorView Gpt::mamba_grad(size_t b, const char* what) const {
  return grad(lname(blocks_[b].layer, "mamba.") + what);
}

TensorView Gpt::columns(TensorView v, int64_t col, int64_t cols) {
  v.row_stride = v.stride();
  v.data = static_cast<float*>(v.data) + col;
  v.cols = cols;
  return v;
}

void Gpt::mamba_block_forward(size_t b, const TensorView& in, bool norm_done) {
  BlockActs& a = acts_[b];
  const int64_t l = blocks_[b].layer, N = B_ * T_;
  const MambaDims d = mamba_dims(cfg_);
  const SsmShape s = ssm_shape();
  const TensorView nx = linear_input(b, 0);
  if (!norm_done) norm_forward(block_norm(b), nx, in);
  // in_proj: [z | x | B | C | dt_raw], stored BF16 (float32 holding BF16 values: the SSM ops take
  // float32), its slices read in place
  const TensorView zx = act_view(a.zx, N, d.in_proj_width(), false, "mamba.in_proj out");
  linear_fwd(l, 4, b, zx, as_stored(nx));
  const TensorView zxs = as_stored(zx);
  const TensorView xbc = act_view(a.xbc, N, d.xbc_cols(), false, "mamba conv out");
  be_.ssm_conv_forward(xbc, columns(zxs, d.xbc_col(), d.xbc_cols()), mamba_param(b, "conv.weight"),
                       mamba_param(b, "conv.bias"), s);
  const TensorView sy = act_view(a.sy, N, d.d_inner, false, "mamba scan out");
  be_.ssm_scan_forward(sy, f32(a.states, s.B * s.H * s.chunks(), s.P * s.N, "mamba states"),
                       f32(a.dt, N, s.H, "mamba dt"), f32(a.A, s.H, 1, "mamba A"), as_stored(xbc),
                       columns(zxs, d.dt_col(), d.H), mamba_param(b, "dt_bias"),
                       mamba_param(b, "A_log"), mamba_param(b, "D"), s);
  const TensorView gy = linear_input(b, 1);
  be_.gated_norm_forward(gy, f32(a.grstd, N, s.G, "mamba gated norm rstd"), as_stored(sy),
                         columns(zxs, d.z_col(), d.d_inner), mamba_param(b, "norm.weight"));
  linear_fwd(l, 5, b, proj_view(b), as_stored(gy));
  residual_after(b, in);
}

void Gpt::residual_after(size_t b, const TensorView& in) {
  TensorView res = stream_in(b + 1);
  res.bf16_values = round_bf16();
  const TensorView proj = as_stored(proj_view(b));
  if (b + 1 == blocks_.size()) {
    be_.residual_forward(res, in, proj);
    return;
  }
  // the next block's norm reads this sum next: one fused op (its composition where the backend
  // does not fuse the case: the same bits)
  const NormViews n = block_norm(b + 1);
  be_.residual_norm_forward(norm_kind(), res, linear_input(b + 1, 0), n.mean, n.rstd, in, proj,
                            n.weight, n.bias);
}

namespace {
// The reader's view of a gradient written unrounded (float32: read rounded under BF16 storage) or
// as BF16 bits.
TensorView read_rounded(TensorView v, bool round_bf16) {
  if (v.dtype == DType::F32) v.bf16_values = round_bf16;
  return v;
}
}  // namespace

void Gpt::mlp_block_backward(size_t b, const TensorView& in) {
  BlockActs& a = acts_[b];
  const int64_t l = blocks_[b].layer, N = B_ * T_, C = cfg_.d_model, F = cfg_.d_ff;
  const bool rb = round_bf16();
  // (the Dgrad outputs: written by linear_bwd; dfc_ by the activation's backward pass: no zeroing)
  const TensorView dact = dgrad_view(l, 3, F);
  linear_bwd(l, 3, b, dact, as_stored(dx_view()));
  TensorView dfc = f32(dfc_, N, fc_width(), "mlp.c_fc output gradient", kUseActivationGradients);
  dfc.bf16_values = rb;
  const TensorView fc = as_stored(act_view(a.fc, N, fc_width(), a.mid16, "mlp.c_fc out"));
  // (GELU's gradient: a pending output gradient of c_fc, as in the forward pass)
  ActivationSource dgelu;
  const ActivationSource* pending = nullptr;
  if (cfg_.activation == Activation::GeluTanh) {
    dgelu.op = ActivationOp::GeluBackward;
    dgelu.inp = fc;
    dgelu.dout = read_rounded(dact, rb);
    dgelu.out = dfc;
    pending = &dgelu;
  } else {
    be_.activation_backward(cfg_.activation, dfc, fc, read_rounded(dact, rb));
  }
  const TensorView dln2 = dgrad_view(l, 2, C);
  linear_bwd(l, 2, b, dln2, as_stored(dfc), pending);
  norm_backward(block_norm(b), read_rounded(dln2, rb), in);
}

void Gpt::mamba_block_backward(size_t b, const TensorView& in) {
  BlockActs& a = acts_[b];
  const int64_t l = blocks_[b].layer, N = B_ * T_, C = cfg_.d_model;
  const MambaDims d = mamba_dims(cfg_);
  const SsmShape s = ssm_shape();
  const bool rb = round_bf16();
  const TensorView dgy = dgrad_view(l, 5, d.d_inner);
  linear_bwd(l, 5, b, dgy, as_stored(dx_view()));
  // the in_proj output's gradient, its slices written in place by the three ops (every column:
  // z's by the gated norm, [x | B | C]'s by the conv, dt_raw's by the scan)
  TensorView dzx =
      f32(dzx_, N, d.in_proj_width(), "mamba.in_proj output gradient", kUseActivationGradients);
  dzx.bf16_values = rb;
  const TensorView zxs =
      as_stored(act_view(a.zx, N, d.in_proj_width(), false, "mamba.in_proj out"));
  TensorView dsy = f32(dsy_, N, d.d_inner, "mamba scan out gradient", kUseActivationGradients);
  dsy.bf16_values = rb;
  be_.gated_norm_backward(dsy, columns(dzx, d.z_col(), d.d_inner), mamba_grad(b, "norm.weight"),
                          read_rounded(dgy, rb),
                          as_stored(act_view(a.sy, N, d.d_inner, false, "mamba scan out")),
                          columns(zxs, d.z_col(), d.d_inner), mamba_param(b, "norm.weight"),
                          f32(a.grstd, N, s.G, "mamba gated norm rstd"));
  TensorView dxbc = f32(dxbc_, N, d.xbc_cols(), "mamba conv out gradient", kUseActivationGradients);
  dxbc.bf16_values = rb;
  const TensorView xbc = as_stored(act_view(a.xbc, N, d.xbc_cols(), false, "mamba conv out"));
  be_.ssm_scan_backward(dxbc, columns(dzx, d.dt_col(), d.H), mamba_grad(b, "dt_bias"),
                        mamba_grad(b, "A_log"), mamba_grad(b, "D"), as_stored(dsy), xbc,
                        f32(a.dt, N, s.H, "mamba dt"), f32(a.A, s.H, 1, "mamba A"),
                        columns(zxs, d.dt_col(), d.H), mamba_param(b, "dt_bias"),
                        mamba_param(b, "A_log"), mamba_param(b, "D"),
                        f32(a.states, s.B * s.H * s.chunks(), s.P * s.N, "mamba states"), s);
  be_.ssm_conv_backward(columns(dzx, d.xbc_col(), d.xbc_cols()), mamba_grad(b, "conv.weight"),
                        mamba_grad(b, "conv.bias"), as_stored(dxbc),
                        columns(zxs, d.xbc_col(), d.xbc_cols()), mamba_param(b, "conv.weight"),
                        mamba_param(b, "conv.bias"), s);
  const TensorView dnx = dgrad_view(l, 4, C);
  linear_bwd(l, 4, b, dnx, as_stored(dzx));
  norm_backward(block_norm(b), read_rounded(dnx, rb), in);
}

void Gpt::attention_block_backward(size_t b, const TensorView& in) {
  BlockActs& a = acts_[b];
  const int64_t l = blocks_[b].layer, N = B_ * T_, C = cfg_.d_model;
  const AttentionShape s = attention_shape();
  const bool rb = round_bf16();
  const bool rope = cfg_.positions == Positions::Rope;
  const bool bits = a.in16[1] || a.mid16;
  const TensorView datty =
      bits ? dgrad_view(l, 1, C)
           : f32(dinp_[1], N, C, "attention output gradient", kUseActivationGradients);
  linear_bwd(l, 1, b, datty, as_stored(dx_view()));
  // (no rounding pass over datty with BF16 attention: attention_backward is its only reader and
  // reads it as bf16(dout) on both backends, so the pass would change no bit it computes)
  if (prec_ != GemmPrecision::BF16 && rb) be_.convert(read_rounded(datty, true), datty);
  // the BF16 storage of dqkv rides on the attention's own write, except with RoPE: the saved qkv
  // is post-RoPE, the GEMM's output pre-RoPE, so the gradient is rotated back first. Where c_attn's
  // GEMMs are all BF16 and dqkv is stored BF16, the attention writes it as bits (in dqkv_'s memory)
  // and c_attn's backward reads them: the same values, half the bytes, no narrowing pass
  const bool dqkv16 = bits && bits_on() && rb && !rope && !linear_recipe(l, 0).any_quantized();
  TensorView dqkv = dqkv16 ? bf16_view(be_, dqkv_.as<uint16_t>(), N, s.qkv_cols(), "dqkv")
                           : f32(dqkv_, N, s.qkv_cols(), "dqkv", kUseActivationGradients);
  if (!dqkv16) dqkv.bf16_values = rb && !rope;
  be_.attention_backward(
      dqkv, as_stored(datty), as_stored(act_view(a.qkv, N, s.qkv_cols(), a.mid16, "qkv")),
      as_stored(linear_input(b, 1)), f32(a.lse, s.B * s.NH, s.T, "lse"), s, prec_);
  if (rope) {
    be_.rope_backward(dqkv, s);
    if (rb) be_.convert(read_rounded(dqkv, true), dqkv);
  }
  const TensorView dln1 = dgrad_view(l, 0, C);
  linear_bwd(l, 0, b, dln1, as_stored(dqkv));
  norm_backward(block_norm(b), read_rounded(dln1, rb), in);
}

}  // namespace fp4sim::model
