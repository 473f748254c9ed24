// The emulator backend: plain loops in the order the contract names, OpenMP across independent
// blocks only. The golden reference every other backend is checked against.
//
// Views on BF16 storage are handled at the edges of each op: a BF16 input is widened (exactly)
// into a float32 temporary, an input marked bf16_values is read through a rounded copy, a BF16
// output is computed in float32, rounded and narrowed, a bf16_values output is rounded in place;
// between the edges run emu/layers.hpp's reference functions on float32 arrays. The fused ops are
// their compositions (emu/fused.hpp): the emulator fuses nothing.
#pragma once

#include <vector>

#include "emu/backend.hpp"
#include "emu/layers.hpp"

namespace fp4sim::emu {

// (not final: tests derive from it, e.g. to fuse as another backend would)
class CpuBackend : public Backend {
 public:
  CpuBackend() : Backend("emu", Device::Host) {}

  void* allocate(size_t bytes) override;
  void release(void* p) override;
  void upload(void* dst, const void* host_src, size_t bytes) override;
  void download(void* host_dst, const void* src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void zero(void* p, size_t bytes) override;
  void synchronize() override {}
  int64_t device_memory_used() const override { return -1; }
  int64_t device_memory_free() const override { return -1; }
  AllocationPeaks allocation_peaks() const override { return {}; }
  bool supports(Capability c, int64_t arg = 0) const override;

  void quantize(const TensorView& x, const QuantizeConfig& cfg, QuantizedView* rowwise,
                QuantizedView* columnwise) override;
  void dequantize(const QuantizedView& q, const TensorView& out) override;
  QuantErrorSums quant_error_sums(const TensorView& x, const QuantizedView& q) override;
  void gemm(const QuantizedView& a, const QuantizedView& b, const TensorView* c,
            const GemmConfig& cfg, const TensorView& d) override;
  void scales_to_tiled(const uint8_t* scales, int64_t rows, int64_t k_blocks,
                       uint8_t* out) override;

  void embedding_forward(const TensorView& out, const TensorView& tokens, const TensorView& pos,
                         const TensorView& wte, const TensorView& wpe) override;
  void embedding_backward(const TensorView& dwte, const TensorView& dwpe, const TensorView& dout,
                          const TensorView& tokens, const TensorView& pos) override;
  void norm_forward(NormKind kind, const TensorView& out, const TensorView& mean,
                    const TensorView& rstd, const TensorView& inp, const TensorView& weight,
                    const TensorView& bias) override;
  void norm_backward(NormKind kind, const TensorView& dinp, const TensorView& dweight,
                     const TensorView& dbias, const TensorView& dout, const TensorView& inp,
                     const TensorView& weight, const TensorView& mean,
                     const TensorView& rstd) override;
  void matmul_forward(const TensorView& out, const TensorView& inp, const TensorView& weight,
                      const TensorView& bias, GemmPrecision prec) override;
  void matmul_backward(const TensorView& dinp, const TensorView& dweight, const TensorView& dbias,
                       const TensorView& dout, const TensorView& inp, const TensorView& weight,
                       GemmPrecision prec) override;
  void bias_forward(const TensorView& out, const TensorView& inp, const TensorView& bias) override;
  void bias_backward(const TensorView& dbias, const TensorView& dout) override;
  void attention_forward(const TensorView& out, const TensorView& lse, const TensorView& qkv,
                         const AttentionShape& s, GemmPrecision prec) override;
  void attention_backward(const TensorView& dqkv, const TensorView& dout, const TensorView& qkv,
                          const TensorView& out, const TensorView& lse, const AttentionShape& s,
                          GemmPrecision prec) override;
  void rope_forward(const TensorView& qkv, const AttentionShape& s) override;
  void rope_backward(const TensorView& dqkv, const AttentionShape& s) override;
  void activation_forward(Activation act, const TensorView& out, const TensorView& inp) override;
  void activation_backward(Activation act, const TensorView& dinp, const TensorView& inp,
                           const TensorView& dout) override;
  void convert(const TensorView& dst, const TensorView& src) override;
  void residual_forward(const TensorView& out, const TensorView& a, const TensorView& b) override;
  void crossentropy_forward_backward(const TensorView& losses, const TensorView& dlogits,
                                     const TensorView& logits, const TensorView& targets,
                                     const TensorView& dlosses) override;
  void adamw_update(const TensorView& params, const TensorView& params16, const TensorView& grads,
                    const TensorView& m, const TensorView& v, const std::vector<Segment>& segments,
                    const std::vector<AdamWStep>& steps) override;
  void qadamw_update(const TensorView& params, const TensorView& params16, const TensorView& grads,
                     const QAdamWState& st, const std::vector<Segment>& segments,
                     const std::vector<AdamWStep>& steps, uint64_t seed,
                     const std::vector<uint64_t>& streams) override;
  void sum_squares(const TensorView& x, const std::vector<Segment>& segments,
                   double* sums) override;
  void axpby(const TensorView& out, float a, const TensorView& x, float b,
             const TensorView& y) override;
  void transpose(const TensorView& out, const TensorView& x) override;
  void clamp(const TensorView& out, const TensorView& x, float bound) override;
  float frobenius_norm(const TensorView& x) override;
  float abs_quantile(const TensorView& x, double q) override;

  void ssm_conv_forward(const TensorView& out, const TensorView& inp, const TensorView& weight,
                        const TensorView& bias, const SsmShape& s) override;
  void ssm_conv_backward(const TensorView& dinp, const TensorView& dweight, const TensorView& dbias,
                         const TensorView& dout, const TensorView& inp, const TensorView& weight,
                         const TensorView& bias, const SsmShape& s) override;
  void ssm_scan_forward(const TensorView& y, const TensorView& states, const TensorView& dt,
                        const TensorView& A, const TensorView& xbc, const TensorView& dt_raw,
                        const TensorView& dt_bias, const TensorView& A_log, const TensorView& D,
                        const SsmShape& s) override;
  void ssm_scan_backward(const TensorView& dxbc, const TensorView& ddt_raw,
                         const TensorView& ddt_bias, const TensorView& dA_log, const TensorView& dD,
                         const TensorView& dy, const TensorView& xbc, const TensorView& dt,
                         const TensorView& A, const TensorView& dt_raw, const TensorView& dt_bias,
                         const TensorView& A_log, const TensorView& D, const TensorView& states,
                         const SsmShape& s) override;
  void gated_norm_forward(const TensorView& out, const TensorView& rstd, const TensorView& inp,
                          const TensorView& z, const TensorView& weight) override;
  void gated_norm_backward(const TensorView& dinp, const TensorView& dz, const TensorView& dweight,
                           const TensorView& dout, const TensorView& inp, const TensorView& z,
                           const TensorView& weight, const TensorView& rstd) override;

  void residual_norm_forward(NormKind kind, const TensorView& res, const TensorView& out,
                             const TensorView& mean, const TensorView& rstd, const TensorView& a,
                             const TensorView& b, const TensorView& weight,
                             const TensorView& bias) override;
  void matmul_forward_activation(const TensorView& out, const ActivationSource& src,
                                 const TensorView& weight, const TensorView& bias,
                                 GemmPrecision prec) override;
  void matmul_backward_activation(const TensorView& dinp, const TensorView& dweight,
                                  const TensorView& dbias, const ActivationSource& src,
                                  const TensorView& inp, const TensorView& weight,
                                  GemmPrecision prec) override;
  void quantize_activation(const ActivationSource& src, const QuantizeConfig& cfg,
                           QuantizedView* rowwise, QuantizedView* columnwise,
                           const TensorView& dbias) override;
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
