#include "emu/fused.hpp"

#include <string>

namespace fp4sim {

namespace {

// A float32 temporary shaped like v in be's memory, and a view onto it.
struct F32Temp {
  BackendBuffer buf;
  TensorView view;
  F32Temp(Backend& be, const TensorView& like, bool bf16_values)
      : buf(be, static_cast<size_t>(like.numel()) * sizeof(float),
            {"op temporaries", std::string(like.name) + " (float32 temporary)"}) {
    view =
        view_of(buf.get(), DType::F32, like.rows, like.cols, be.device(), like.name, bf16_values);
  }
};

// v as a float32 view: v itself, or its BF16 values widened into t.
TensorView widened(Backend& be, const TensorView& v, std::unique_ptr<F32Temp>& t) {
  if (v.dtype != DType::BF16) return v;
  t = std::make_unique<F32Temp>(be, v, false);
  be.convert(t->view, v);
  return t->view;
}

}  // namespace

void run_activation(Backend& be, const ActivationSource& src) {
  if (src.op == ActivationOp::Identity) return;
  std::unique_ptr<F32Temp> in_t, dout_t, out_t;
  const TensorView inp = widened(be, src.inp, in_t);
  TensorView out = src.out;
  if (out.dtype == DType::BF16) {
    out_t = std::make_unique<F32Temp>(be, out, true);
    out = out_t->view;
  }
  if (src.op == ActivationOp::GeluForward) {
    be.activation_forward(Activation::GeluTanh, out, inp);
  } else {
    be.activation_backward(Activation::GeluTanh, out, inp, widened(be, src.dout, dout_t));
  }
  if (out_t) be.convert(src.out, as_stored(out));
}

void compose_residual_norm_forward(Backend& be, NormKind kind, const TensorView& res,
                                   const TensorView& out, const TensorView& mean,
                                   const TensorView& rstd, const TensorView& a, const TensorView& b,
                                   const TensorView& weight, const TensorView& bias) {
  be.residual_forward(res, a, b);
  be.norm_forward(kind, out, mean, rstd, as_stored(res), weight, bias);
}

void compose_matmul_forward_activation(Backend& be, const TensorView& out,
                                       const ActivationSource& src, const TensorView& weight,
                                       const TensorView& bias, GemmPrecision prec) {
  run_activation(be, src);
  be.matmul_forward(out, as_stored(src.out), weight, bias, prec);
}

void compose_matmul_backward_activation(Backend& be, const TensorView& dinp,
                                        const TensorView& dweight, const TensorView& dbias,
                                        const ActivationSource& src, const TensorView& inp,
                                        const TensorView& weight, GemmPrecision prec) {
  run_activation(be, src);
  be.matmul_backward(dinp, dweight, dbias, as_stored(src.out), inp, weight, prec);
}

void compose_quantize_activation(Backend& be, const ActivationSource& src,
                                 const QuantizeConfig& cfg, QuantizedView* rowwise,
                                 QuantizedView* columnwise, const TensorView& dbias) {
  const TensorView x = as_stored(src.op == ActivationOp::Identity ? src.inp : src.out);
  if (dbias.present() && (x.dtype != DType::F32 || !x.dense()))
    throw std::invalid_argument(std::string("quantize_activation: tensor '") + x.name +
                                "' must be dense float32 (the bias gradient's input)");
  run_activation(be, src);
  be.quantize(x, cfg, rowwise, columnwise);
  if (dbias.present()) be.bias_backward(dbias, x);
}

}  // namespace fp4sim
