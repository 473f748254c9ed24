// The view checks of every Backend op (emu/backend.hpp), one function an op with the op's own
// arguments: shapes against each other, dtypes, the bf16_values mark where the op allows it,
// optional views, segment lists. Every backend runs them before any work, so a bad call fails the
// same way, naming the op and the tensor (std::invalid_argument), on the emulator and on the GPU.
#pragma once

#include <vector>

#include "emu/backend.hpp"

namespace fp4sim::op_checks {

void embedding_forward(const TensorView& out, const TensorView& tokens, const TensorView& pos,
                       const TensorView& wte, const TensorView& wpe);
void embedding_backward(const TensorView& dwte, const TensorView& dwpe, const TensorView& dout,
                        const TensorView& tokens, const TensorView& pos);
void norm_forward(NormKind kind, const TensorView& out, const TensorView& mean,
                  const TensorView& rstd, const TensorView& inp, const TensorView& weight,
                  const TensorView& bias);
void norm_backward(NormKind kind, const TensorView& dinp, const TensorView& dweight,
                   const TensorView& dbias, const TensorView& dout, const TensorView& inp,
                   const TensorView& weight, const TensorView& mean, const TensorView& rstd);
void matmul_forward(const TensorView& out, const TensorView& inp, const TensorView& weight,
                    const TensorView& bias, GemmPrecision prec);
void matmul_backward(const TensorView& dinp, const TensorView& dweight, const TensorView& dbias,
                     const TensorView& dout, const TensorView& inp, const TensorView& weight,
                     GemmPrecision prec);
void bias_forward(const TensorView& out, const TensorView& inp, const TensorView& bias);
void bias_backward(const TensorView& dbias, const TensorView& dout);
void attention_forward(const TensorView& out, const TensorView& lse, const TensorView& qkv,
                       const AttentionShape& s, GemmPrecision prec);
void attention_backward(const TensorView& dqkv, const TensorView& dout, const TensorView& qkv,
                        const TensorView& out, const TensorView& lse, const AttentionShape& s,
                        GemmPrecision prec);
void rope(const char* op, const TensorView& qkv, const AttentionShape& s);
void activation_forward(Activation act, const TensorView& out, const TensorView& inp);
void activation_backward(Activation act, const TensorView& dinp, const TensorView& inp,
                         const TensorView& dout);
void convert(const TensorView& dst, const TensorView& src);
void residual_forward(const TensorView& out, const TensorView& a, const TensorView& b);
void crossentropy_forward_backward(const TensorView& losses, const TensorView& dlogits,
                                   const TensorView& logits, const TensorView& targets,
                                   const TensorView& dlosses);
void adamw_update(const TensorView& params, const TensorView& params16, const TensorView& grads,
                  const TensorView& m, const TensorView& v, const std::vector<Segment>& segments,
                  const std::vector<AdamWStep>& steps);
void qadamw_update(const TensorView& params, const TensorView& params16, const TensorView& grads,
                   const QAdamWState& st, const std::vector<Segment>& segments,
                   const std::vector<AdamWStep>& steps, const std::vector<uint64_t>& streams);
void sum_squares(const TensorView& x, const std::vector<Segment>& segments);
void axpby(const TensorView& out, const TensorView& x, const TensorView& y);
void transpose(const TensorView& out, const TensorView& x);
void clamp(const TensorView& out, const TensorView& x, float bound);
void frobenius_norm(const TensorView& x);
void abs_quantile(const TensorView& x, double q);
void ssm_conv_forward(const TensorView& out, const TensorView& inp, const TensorView& weight,
                      const TensorView& bias, const SsmShape& s);
void ssm_conv_backward(const TensorView& dinp, const TensorView& dweight, const TensorView& dbias,
                       const TensorView& dout, const TensorView& inp, const TensorView& weight,
                       const TensorView& bias, const SsmShape& s);
void ssm_scan_forward(const TensorView& y, const TensorView& states, const TensorView& dt,
                      const TensorView& A, const TensorView& xbc, const TensorView& dt_raw,
                      const TensorView& dt_bias, const TensorView& A_log, const TensorView& D,
                      const SsmShape& s);
void ssm_scan_backward(const TensorView& dxbc, const TensorView& ddt_raw,
                       const TensorView& ddt_bias, const TensorView& dA_log, const TensorView& dD,
                       const TensorView& dy, const TensorView& xbc, const TensorView& dt,
                       const TensorView& A, const TensorView& dt_raw, const TensorView& dt_bias,
                       const TensorView& A_log, const TensorView& D, const TensorView& states,
                       const SsmShape& s);
void gated_norm_forward(const TensorView& out, const TensorView& rstd, const TensorView& inp,
                        const TensorView& z, const TensorView& weight);
void gated_norm_backward(const TensorView& dinp, const TensorView& dz, const TensorView& dweight,
                         const TensorView& dout, const TensorView& inp, const TensorView& z,
                         const TensorView& weight, const TensorView& rstd);
void activation_source(const char* op, const ActivationSource& src);

}  // namespace fp4sim::op_checks
