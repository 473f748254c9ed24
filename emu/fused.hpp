// The fused ops' compositions from plain ops (emu/backend.hpp), on any backend: what a backend
// that does not fuse an op, or a case of it, runs instead. One function an op; the fused kernels
// of a backend give these bits.
#pragma once

#include "emu/backend.hpp"

namespace fp4sim {

// src's op into src.out (nothing for Identity): activation_forward / activation_backward on
// float32 views, a BF16 input widened into a temporary first, a BF16 output made rounded in a
// float32 temporary and narrowed.
void run_activation(Backend& be, const ActivationSource& src);

// The view without the bf16_values mark: a tensor whose values are already BF16, passed where it
// is read as stored.
inline TensorView as_stored(TensorView v) {
  v.bf16_values = false;
  return v;
}

void compose_residual_norm_forward(Backend& be, NormKind kind, const TensorView& res,
                                   const TensorView& out, const TensorView& mean,
                                   const TensorView& rstd, const TensorView& a, const TensorView& b,
                                   const TensorView& weight, const TensorView& bias);
void compose_matmul_forward_activation(Backend& be, const TensorView& out,
                                       const ActivationSource& src, const TensorView& weight,
                                       const TensorView& bias, GemmPrecision prec);
void compose_matmul_backward_activation(Backend& be, const TensorView& dinp,
                                        const TensorView& dweight, const TensorView& dbias,
                                        const ActivationSource& src, const TensorView& inp,
                                        const TensorView& weight, GemmPrecision prec);
void compose_quantize_activation(Backend& be, const ActivationSource& src,
                                 const QuantizeConfig& cfg, QuantizedView* rowwise,
                                 QuantizedView* columnwise, const TensorView& dbias);

}  // namespace fp4sim
