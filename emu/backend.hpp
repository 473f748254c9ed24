// The one interface the model and the tools talk to. CpuBackend (emu/) is the golden reference;
// CudaBackend (gpu/) implements the same ops with the same names and argument order.
#pragma once

#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "emu/gemm.hpp"
#include "emu/layers.hpp"
#include "emu/optim.hpp"
#include "emu/quant_stats.hpp"
#include "emu/quantize.hpp"
#include "emu/tensor.hpp"

namespace fp4sim {

// sum_squares_many's arguments: as many offsets as counts, none negative (std::invalid_argument).
void validate_sum_squares_many(const std::vector<int64_t>& offsets,
                               const std::vector<int64_t>& counts);
// adamw_update_many's arguments: one offset, count and step per tensor, no offset or count negative
// (std::invalid_argument).
void validate_adamw_update_many(const std::vector<int64_t>& offsets,
                                const std::vector<int64_t>& counts,
                                const std::vector<AdamWStep>& steps);

// An activation op whose output goes straight into a quantizer (Backend::quantize_activation):
// GELU (tanh) forward, out = gelu_forward(inp), or backward, out = gelu_backward(inp, dout), over
// rows x cols dense float32 tensors, with the ops' round_bf16 / bf16_dout flags.
enum class ActivationOp { GeluForward, GeluBackward };
struct ActivationSource {
  ActivationOp op = ActivationOp::GeluForward;
  const float* inp = nullptr;   // the op's input (the pre-activation)
  const float* dout = nullptr;  // GeluBackward: the incoming gradient
  float* out = nullptr;         // where the op alone writes its output (rows x cols)
  int64_t rows = 0, cols = 0;
  bool round_bf16 = true;
  bool bf16_dout = true;
  const char* name = "activation";  // for error messages
  // GeluForward into a BF16 linear (Backend::matmul_forward_activation only): the output stored as
  // BF16 bits here instead of out (round_bf16 implied; out unused). Null otherwise.
  uint16_t* out16 = nullptr;
  // The op's input kept as BF16 bits instead of inp (inp null; a BF16 c_fc's output read by the
  // BF16 linears' matmul_*_activation ops, not by quantize_activation). Null otherwise.
  const uint16_t* inp16 = nullptr;
  // GeluBackward: the incoming gradient kept as BF16 bits instead of dout (dout null; a BF16
  // Dgrad's output), for the same ops as inp16. Null otherwise.
  const uint16_t* dout16 = nullptr;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual Device device() const = 0;

  // Memory the backend's ops read and write (host memory for the emulator).
  virtual void* allocate(size_t bytes) = 0;
  virtual void release(void* p) = 0;
  virtual void upload(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void download(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void synchronize() = 0;
  // Set `bytes` bytes at p to zero; copy within this backend's memory (both stream-ordered).
  virtual void zero(void* p, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  // Device memory in use (bytes), or -1 where the backend has no separate memory (the emulator).
  virtual int64_t device_memory_used() const { return -1; }
  // Whether the attention ops take heads of hd elements (models check it before any work): every
  // size on the emulator.
  virtual bool supports_attention_head_dim(int64_t hd) const { return hd > 0; }

  // Quantize x (F32 or BF16, rows x cols) into the requested copies (DESIGN.md §5, §6). Either
  // output may be null when its copy is disabled. Outputs live in this backend's memory; each
  // view's rows/cols must be the written shape.
  virtual void quantize(const TensorView& x, const QuantizeConfig& cfg, QuantizedView* rowwise,
                        QuantizedView* columnwise) = 0;
  // Whether gemm with this impl reads a view's decoded_bf16 (and quantize writes it) for the FP4
  // formats: the CUDA backend's cuBLASLt GEMM on a GPU without FP4 tensor cores. Callers set
  // decoded_bf16 only where this is true; the results are the same bits either way.
  virtual bool decodes_for_gemm(GemmImpl impl) const {
    (void)impl;
    return false;
  }

  // Whether gemm with this impl reads an FP8 view's scales_gemm (and quantize writes it): the CUDA
  // backend's cuBLASLt GEMM. Callers set scales_gemm only where this is true; the results are the
  // same bits either way.
  virtual bool fp8_scales_for_gemm(GemmImpl impl) const {
    (void)impl;
    return false;
  }

  // out (F32, q.rows x q.cols) = decode(q). NVFP4: e2m1 * ((s_b * amax) * (1/2688 or 1/1536));
  // MXFP4: e2m1 * 2^(byte - 127), byte 0xFF -> NaN.
  virtual void dequantize(const QuantizedView& q, const TensorView& out) = 0;

  // Error sums of copy q against the F32 tensor x (q.rows x q.cols, this backend's memory) it was
  // quantized from, for the quantization statistics (emu/quant_stats.hpp): the same bits on every
  // backend. Synchronous: the sums are on the host when it returns.
  virtual QuantErrorSums quant_error_sums(const float* x, const QuantizedView& q) = 0;

  // Exact block-scaled FP4 GEMM (DESIGN.md §8): d = alpha * a * b^T (+ beta * c), bit-identical
  // on every backend. a [M, K], b [N, K] row-wise copies; c F32 [M, N] or null; d F32 or BF16.
  virtual void gemm(const QuantizedView& a, const QuantizedView& b, const TensorView* c,
                    const GemmConfig& cfg, const TensorView& d) = 0;

  // Scale matrix [rows, k_blocks] (this backend's memory) -> the cuBLASLt 128x4 tiled layout,
  // padded with zeros to round_up(rows, 128) x round_up(k_blocks, 4) (DESIGN.md §8).
  virtual void scales_to_tiled(const uint8_t* scales, int64_t rows, int64_t k_blocks,
                               uint8_t* out) = 0;

  // ---- training-stack ops (issue 4): the names, argument orders and semantics of emu/layers.hpp
  // and emu/optim.hpp, on this backend's memory. A backend that lacks one says so by name.
  // round_bf16 (last argument where present): every value the op writes to its activation output
  // (out, or dinp for the backward ops; not mean/rstd or the parameter gradients) is rounded to
  // BF16 (bf16_round) in the same op, the storage of BF16 activations, with the bits of the op
  // followed by round_to_bf16 over that output; an op that adds a bias adds the bias's BF16
  // rounding then (matmul_forward), so its output is that of the op on the rounded bias, then
  // round_to_bf16.
  virtual void embedding_forward(float* /*out*/, const int32_t* /*tokens*/, const int32_t* /*pos*/,
                                 const float* /*wte*/, const float* /*wpe*/, int64_t /*N*/,
                                 int64_t /*C*/) {
    missing("embedding_forward");
  }
  virtual void embedding_backward(float* /*dwte*/, float* /*dwpe*/, const float* /*dout*/,
                                  const int32_t* /*tokens*/, const int32_t* /*pos*/, int64_t /*N*/,
                                  int64_t /*C*/) {
    missing("embedding_backward");
  }
  virtual void layernorm_forward(float* /*out*/, float* /*mean*/, float* /*rstd*/,
                                 const float* /*inp*/, const float* /*weight*/,
                                 const float* /*bias*/, int64_t /*N*/, int64_t /*C*/,
                                 bool /*round_bf16*/) {
    missing("layernorm_forward");
  }
  // The norms' backward passes: bf16_dout reads dout as bf16_round(dout), as the activations' do
  // (below), for every use of it (dinp and the weight and bias gradients).
  virtual void layernorm_backward(float* /*dinp*/, float* /*dweight*/, float* /*dbias*/,
                                  const float* /*dout*/, const float* /*inp*/,
                                  const float* /*weight*/, const float* /*mean*/,
                                  const float* /*rstd*/, int64_t /*N*/, int64_t /*C*/,
                                  bool /*round_bf16*/, bool /*bf16_dout*/) {
    missing("layernorm_backward");
  }
  virtual void rmsnorm_forward(float* /*out*/, float* /*rstd*/, const float* /*inp*/,
                               const float* /*weight*/, int64_t /*N*/, int64_t /*C*/,
                               bool /*round_bf16*/) {
    missing("rmsnorm_forward");
  }
  virtual void rmsnorm_backward(float* /*dinp*/, float* /*dweight*/, const float* /*dout*/,
                                const float* /*inp*/, const float* /*weight*/,
                                const float* /*rstd*/, int64_t /*N*/, int64_t /*C*/,
                                bool /*round_bf16*/, bool /*bf16_dout*/) {
    missing("rmsnorm_backward");
  }
  // out (N,OC) = inp (N,K) W (OC,K)^T, then + bias (FP32, RN), then RNE to BF16 when round_bf16.
  // With round_bf16 the bias added is the bias's BF16 rounding: out = RNE(fl32(acc + bf16(bias))),
  // as a BF16 GEMM's epilogue adds the bias in the output's type (cuBLASLt, Transformer Engine,
  // PyTorch autocast). The same rule holds for every op below that adds a bias to a BF16 output
  // (bias_forward, bias_forward_bf16, matmul_forward_bf16, matmul_forward_activation). It is the
  // op's rule: an output the op leaves in FP32 gets the FP32 bias, even if the caller rounds it
  // later (model/gpt.cpp: c_attn's output before RoPE).
  virtual void matmul_forward(float* /*out*/, const float* /*inp*/, const float* /*weight*/,
                              const float* /*bias*/, int64_t /*N*/, int64_t /*K*/, int64_t /*OC*/,
                              emu::GemmPrecision /*prec*/, bool /*round_bf16*/) {
    missing("matmul_forward");
  }
  virtual void matmul_backward(float* /*dinp*/, float* /*dweight*/, float* /*dbias*/,
                               const float* /*dout*/, const float* /*inp*/, const float* /*weight*/,
                               int64_t /*N*/, int64_t /*K*/, int64_t /*OC*/,
                               emu::GemmPrecision /*prec*/) {
    missing("matmul_backward");
  }
  // matmul_backward without dbias, dout (N,OC) stored as BF16 bits: the same bits as
  // matmul_backward on dout's values as FP32 (the output head's Dgrad and Wgrad, whose dout the
  // cross-entropy op wrote in BF16: crossentropy_softmax_forward_backward_bf16).
  virtual void matmul_backward_bf16_dout(float* /*dinp*/, float* /*dweight*/,
                                         const uint16_t* /*dout*/, const float* /*inp*/,
                                         const float* /*weight*/, int64_t /*N*/, int64_t /*K*/,
                                         int64_t /*OC*/, emu::GemmPrecision /*prec*/) {
    missing("matmul_backward_bf16_dout");
  }
  // out (N,OC) += bias (FP32, RN), then RNE to BF16 when round_bf16, the bias then rounded to BF16
  // first (matmul_forward's rule).
  virtual void bias_forward(float* /*out*/, const float* /*bias*/, int64_t /*N*/, int64_t /*OC*/,
                            bool /*round_bf16*/) {
    missing("bias_forward");
  }
  virtual void bias_backward(float* /*dbias*/, const float* /*dout*/, int64_t /*N*/,
                             int64_t /*OC*/) {
    missing("bias_backward");
  }
  // quantize(x, cfg, rowwise, columnwise), then bias_backward(dbias, x, x.rows, x.cols): the
  // quantized copies of a linear layer's output gradient and its bias gradient (dbias += x's column
  // sums in bias_backward's order), x dense F32. A backend may take the column sums in the quantize
  // pass instead of a pass of their own (the CUDA backend does for FP8 with a column-wise copy);
  // the bits are those of the two calls either way.
  virtual void quantize_with_bias_backward(const TensorView& x, const QuantizeConfig& cfg,
                                           QuantizedView* rowwise, QuantizedView* columnwise,
                                           float* dbias) {
    if (x.dtype != DType::F32 || x.stride() != x.cols)
      throw std::invalid_argument(std::string("quantize_with_bias_backward: tensor '") + x.name +
                                  "' must be dense float32 (the bias gradient's input)");
    quantize(x, cfg, rowwise, columnwise);
    bias_backward(dbias, static_cast<const float*>(x.data), x.rows, x.cols);
  }
  // The activation op alone (gelu_forward / gelu_backward into src.out, or into src.out16 as BF16
  // bits: gelu_forward with round_bf16, then narrow_to_bf16), from src.inp or src.inp16's values.
  void run_activation(const ActivationSource& src);
  // run_activation(src), then quantize(out, cfg, rowwise, columnwise) of src.out as a rows x cols
  // tensor, or quantize_with_bias_backward(..., dbias) where dbias is set: the copies of an
  // activation (or of its gradient) that only a quantized GEMM reads. A backend may compute the op
  // inside the quantize pass instead and leave src.out unwritten (the CUDA backend does for FP8);
  // the copies, their amax and dbias are the composition's bits either way.
  virtual void quantize_activation(const ActivationSource& src, const QuantizeConfig& cfg,
                                   QuantizedView* rowwise, QuantizedView* columnwise,
                                   float* dbias) {
    if (src.out16 || src.inp16 || src.dout16)
      throw std::logic_error(
          std::string("quantize_activation (") + src.name +
          "): BF16-bits input or output (inp16, out16) are for BF16 linears only");
    run_activation(src);
    TensorView v;
    v.data = src.out;
    v.rows = src.rows;
    v.cols = src.cols;
    v.device = device();
    v.name = src.name;
    if (dbias)
      quantize_with_bias_backward(v, cfg, rowwise, columnwise, dbias);
    else
      quantize(v, cfg, rowwise, columnwise);
  }
  // run_activation(src), then matmul_forward(out, src.out, weight, bias, src.rows, src.cols, OC,
  // prec, round_bf16): a BF16 linear layer whose input an activation op makes. src.out is written
  // (the backward pass reads it); a backend may make the GEMM's operand in the op's pass instead of
  // reading src.out back (the CUDA backend does at BF16 precision). The same bits either way.
  // With src.out16 or out16 (BF16 precision only: the op's output, the matmul's output kept as
  // BF16 bits; out null with out16) the matmul is matmul_forward_bf16.
  virtual void matmul_forward_activation(float* out, uint16_t* out16, const ActivationSource& src,
                                         const float* weight, const float* bias, int64_t OC,
                                         emu::GemmPrecision prec, bool round_bf16) {
    run_activation(src);
    if (src.out16 || out16) {
      if (prec != emu::GemmPrecision::BF16)
        throw std::logic_error(std::string("matmul_forward_activation (") + src.name +
                               "): BF16 bits need BF16 precision");
      matmul_forward_bf16(out, out16, src.out16 ? nullptr : src.out, src.out16, weight, bias,
                          src.rows, src.cols, OC, round_bf16);
      return;
    }
    matmul_forward(out, src.out, weight, bias, src.rows, src.cols, OC, prec, round_bf16);
  }
  // run_activation(src), then matmul_backward(dinp, dweight, dbias, src.out, inp, weight, src.rows,
  // K, src.cols, prec): a BF16 linear layer's backward pass whose output gradient an activation's
  // backward pass makes. A backend may take the GEMMs' operand and the bias gradient's sums in the
  // op's pass and leave src.out unwritten (the CUDA backend does at BF16 precision with a bias).
  // The same bits either way.
  virtual void matmul_backward_activation(float* dinp, float* dweight, float* dbias,
                                          const ActivationSource& src, const float* inp,
                                          const float* weight, int64_t K, emu::GemmPrecision prec) {
    run_activation(src);
    matmul_backward(dinp, dweight, dbias, src.out, inp, weight, src.rows, K, src.cols, prec);
  }
  // out (n) = a + b16's values (residual_forward with b kept as BF16 bits: a linear's output).
  virtual void residual_forward_bf16(float* out, const float* a, const uint16_t* b16, int64_t n,
                                     bool round_bf16);
  // ---- BF16-stored activations. Where the model stores an activation rounded to BF16 anyway (a
  // BF16 linear layer's input, its output when attention reads it, attention's output), it may
  // keep it as BF16 bits (uint16_t, half the bytes) instead of FP32 values. Each op below is the
  // FP32 op on the widened values, followed by narrowing where it writes BF16: the same bits.
  // The defaults here compose exactly that (through temporaries); a backend may read and write the
  // BF16 bits directly (the CUDA backend does). In each pair of pointers exactly one is set.
  // A BF16 shadow of the weights (n values from base; shadow their bits, narrow_to_bf16): until
  // cleared (n = 0), the BF16 matmuls may read a weight lying within [base, base + n) as the bits
  // at its offset in shadow instead of rounding the FP32 values themselves (the same bits). The
  // caller keeps shadow current while it is set (model/gpt.cpp: refreshed and set for each
  // forward and backward pass, cleared after). The emulator rounds as before (a no-op here).
  virtual void set_bf16_weight_shadow(const float* /*base*/, const uint16_t* /*shadow*/,
                                      int64_t /*n*/) {}
  // dst (n) = the BF16 bits of src (bf16_rne; src usually BF16-representable already).
  virtual void narrow_to_bf16(uint16_t* dst, const float* src, int64_t n);
  // dst (n) = src's BF16 values as FP32 (exact).
  virtual void widen_bf16(float* dst, const uint16_t* src, int64_t n);
  // out16 (N,OC) = the BF16 bits of bias_forward(x, bias, N, OC, round_bf16 = true): a quantized
  // GEMM's FP32 output x (a temporary: its contents afterwards are unspecified) to BF16 storage.
  virtual void bias_forward_bf16(uint16_t* out16, float* x, const float* bias, int64_t N,
                                 int64_t OC);
  // layernorm_forward / rmsnorm_forward with round_bf16, out stored as BF16 bits.
  virtual void layernorm_forward_bf16(uint16_t* out, float* mean, float* rstd, const float* inp,
                                      const float* weight, const float* bias, int64_t N, int64_t C);
  virtual void rmsnorm_forward_bf16(uint16_t* out, float* rstd, const float* inp,
                                    const float* weight, int64_t N, int64_t C);
  // residual_forward_bf16(res, a, b16, N * C, round_bf16) and then layernorm_forward_bf16(out,
  // mean, rstd, res, weight, bias, N, C): the residual add whose result a LayerNorm reads next, in
  // one call (a backend may do both in one pass over the rows: the same bits).
  virtual void residual_layernorm_forward_bf16(float* res, uint16_t* out, float* mean, float* rstd,
                                               const float* a, const uint16_t* b16,
                                               const float* weight, const float* bias, int64_t N,
                                               int64_t C, bool round_bf16);
  // matmul_forward at BF16 precision: inp16 in place of inp; out16 in place of out (rounded:
  // round_bf16 is then implied).
  virtual void matmul_forward_bf16(float* out, uint16_t* out16, const float* inp,
                                   const uint16_t* inp16, const float* weight, const float* bias,
                                   int64_t N, int64_t K, int64_t OC, bool round_bf16);
  // matmul_backward / matmul_backward_activation at BF16 precision with the input stored as BF16.
  virtual void matmul_backward_bf16_input(float* dinp, float* dweight, float* dbias,
                                          const float* dout, const uint16_t* inp16,
                                          const float* weight, int64_t N, int64_t K, int64_t OC);
  virtual void matmul_backward_activation_bf16_input(float* dinp, float* dweight, float* dbias,
                                                     const ActivationSource& src,
                                                     const uint16_t* inp16, const float* weight,
                                                     int64_t K);
  // A BF16 linear layer's backward pass (matmul_backward at BF16 precision, or
  // matmul_backward_activation with src, GELU's pending gradient, in place of dout), with BF16-bits
  // storage: inp16 in place of inp; dinp16 in place of dinp (the Dgrad output rounded to BF16:
  // the value its readers, reading it rounded, see). dinp and dinp16 both null: no Dgrad. dy is one
  // of dout, dout16 (dout's BF16 bits: the attention backward pass's dqkv16) and src.
  virtual void matmul_backward_bits(float* dinp, uint16_t* dinp16, float* dweight, float* dbias,
                                    const float* dout, const uint16_t* dout16,
                                    const ActivationSource* src, const float* inp,
                                    const uint16_t* inp16, const float* weight, int64_t N,
                                    int64_t K, int64_t OC);
  // layernorm_backward / rmsnorm_backward with dout kept as BF16 bits (bf16_dout implied).
  virtual void layernorm_backward_bits(float* dinp, float* dweight, float* dbias,
                                       const uint16_t* dout16, const float* inp,
                                       const float* weight, const float* mean, const float* rstd,
                                       int64_t N, int64_t C, bool round_bf16);
  virtual void rmsnorm_backward_bits(float* dinp, float* dweight, const uint16_t* dout16,
                                     const float* inp, const float* weight, const float* rstd,
                                     int64_t N, int64_t C, bool round_bf16);
  // attention_forward / attention_backward at BF16 precision: qkv16 in place of qkv, out16 in place
  // of out (attention_forward: rounded, round_bf16 implied), dout16 in place of dout, dqkv16 in
  // place of dqkv (rounded, round_bf16 implied).
  virtual void attention_forward_bf16(float* out, uint16_t* out16, float* lse, const float* qkv,
                                      const uint16_t* qkv16, int64_t B, int64_t T, int64_t NH,
                                      int64_t NKV, int64_t HD, bool round_bf16);
  virtual void attention_backward_bf16(float* dqkv, uint16_t* dqkv16, const float* dout,
                                       const uint16_t* dout16, const float* qkv,
                                       const uint16_t* qkv16, const float* out,
                                       const uint16_t* out16, const float* lse, int64_t B,
                                       int64_t T, int64_t NH, int64_t NKV, int64_t HD,
                                       bool round_bf16);
  // lse (B,NH,T): the saved log-sum-exp rows, not the (B,NH,T,T) probabilities; prec FP32 (no
  // BF16 operand rounding) is for gradient checks on the emulator only (emu/layers.hpp); out
  // BF16-rounded when round_bf16 (lse never)
  virtual void attention_forward(float* /*out*/, float* /*lse*/, const float* /*qkv*/,
                                 int64_t /*B*/, int64_t /*T*/, int64_t /*NH*/, int64_t /*NKV*/,
                                 int64_t /*HD*/, emu::GemmPrecision /*prec*/, bool /*round_bf16*/) {
    missing("attention_forward");
  }
  // dqkv written, not accumulated (emu/layers.hpp), then BF16-rounded when round_bf16
  virtual void attention_backward(float* /*dqkv*/, const float* /*dout*/, const float* /*qkv*/,
                                  const float* /*out*/, const float* /*lse*/, int64_t /*B*/,
                                  int64_t /*T*/, int64_t /*NH*/, int64_t /*NKV*/, int64_t /*HD*/,
                                  emu::GemmPrecision /*prec*/, bool /*round_bf16*/) {
    missing("attention_backward");
  }
  virtual void rope_forward(float* /*qkv*/, int64_t /*B*/, int64_t /*T*/, int64_t /*NH*/,
                            int64_t /*NKV*/, int64_t /*HD*/) {
    missing("rope_forward");
  }
  virtual void rope_backward(float* /*dqkv*/, int64_t /*B*/, int64_t /*T*/, int64_t /*NH*/,
                             int64_t /*NKV*/, int64_t /*HD*/) {
    missing("rope_backward");
  }
  virtual void gelu_forward(float* /*out*/, const float* /*inp*/, int64_t /*n*/,
                            bool /*round_bf16*/) {
    missing("gelu_forward");
  }
  // The activations' backward passes write dinp (not accumulated; emu/layers.hpp), BF16-rounded
  // when round_bf16; bf16_dout: dout is read as bf16_round(dout) (the incoming gradient's BF16
  // storage applied where it is read: the caller needs no rounding pass over it).
  virtual void gelu_backward(float* /*dinp*/, const float* /*inp*/, const float* /*dout*/,
                             int64_t /*n*/, bool /*round_bf16*/, bool /*bf16_dout*/) {
    missing("gelu_backward");
  }
  virtual void squared_relu_forward(float* /*out*/, const float* /*inp*/, int64_t /*n*/,
                                    bool /*round_bf16*/) {
    missing("squared_relu_forward");
  }
  virtual void squared_relu_backward(float* /*dinp*/, const float* /*inp*/, const float* /*dout*/,
                                     int64_t /*n*/, bool /*round_bf16*/, bool /*bf16_dout*/) {
    missing("squared_relu_backward");
  }
  virtual void swiglu_forward(float* /*out*/, const float* /*inp*/, int64_t /*N*/, int64_t /*F*/,
                              bool /*round_bf16*/) {
    missing("swiglu_forward");
  }
  virtual void swiglu_backward(float* /*dinp*/, const float* /*inp*/, const float* /*dout*/,
                               int64_t /*N*/, int64_t /*F*/, bool /*round_bf16*/,
                               bool /*bf16_dout*/) {
    missing("swiglu_backward");
  }
  // x (n) = bf16_round(x) in place (RNE; NaN -> the canonical BF16 NaN): BF16 storage of
  // activations.
  virtual void round_to_bf16(float* /*x*/, int64_t /*n*/) { missing("round_to_bf16"); }
  // out (n) = a + b (the residual stream; FP32 RN).
  virtual void residual_forward(float* /*out*/, const float* /*a*/, const float* /*b*/,
                                int64_t /*n*/, bool /*round_bf16*/) {
    missing("residual_forward");
  }
  // bf16_logits: each logit read as bf16_round(logit) (emu/layers.hpp)
  virtual void crossentropy_softmax_forward(float* /*losses*/, float* /*probs*/,
                                            const float* /*logits*/, const int32_t* /*targets*/,
                                            int64_t /*N*/, int64_t /*V*/, bool /*bf16_logits*/) {
    missing("crossentropy_softmax_forward");
  }
  // dlogits = (probs - onehot) * dlosses, written (not accumulated), BF16-rounded when round_bf16
  // (emu/layers.hpp)
  virtual void crossentropy_softmax_backward(float* /*dlogits*/, const float* /*probs*/,
                                             const int32_t* /*targets*/, const float* /*dlosses*/,
                                             int64_t /*N*/, int64_t /*V*/, bool /*round_bf16*/) {
    missing("crossentropy_softmax_backward");
  }
  // losses as crossentropy_softmax_forward and dlogits as crossentropy_softmax_backward on its
  // probabilities, in one op that never stores them (emu/layers.hpp): training's path. round_bf16:
  // the logits read rounded to BF16 and dlogits written rounded.
  virtual void crossentropy_softmax_forward_backward(float* /*losses*/, float* /*dlogits*/,
                                                     const float* /*logits*/,
                                                     const int32_t* /*targets*/,
                                                     const float* /*dlosses*/, int64_t /*N*/,
                                                     int64_t /*V*/, bool /*round_bf16*/) {
    missing("crossentropy_softmax_forward_backward");
  }
  // crossentropy_softmax_forward_backward with round_bf16, dlogits stored as BF16 bits (the values
  // it writes are BF16-rounded: the same numbers in half the memory, and no conversion before the
  // GEMM).
  virtual void crossentropy_softmax_forward_backward_bf16(float* /*losses*/, uint16_t* /*dlogits*/,
                                                          const float* /*logits*/,
                                                          const int32_t* /*targets*/,
                                                          const float* /*dlosses*/, int64_t /*N*/,
                                                          int64_t /*V*/) {
    missing("crossentropy_softmax_forward_backward_bf16");
  }
  // crossentropy_softmax_forward_backward_bf16 with the logits kept as BF16 bits (logits16: the
  // head GEMM's output stored rounded, which the op reads rounded anyway): the same bits.
  virtual void crossentropy_softmax_forward_backward_bits(float* losses, uint16_t* dlogits,
                                                          const uint16_t* logits16,
                                                          const int32_t* targets,
                                                          const float* dlosses, int64_t N,
                                                          int64_t V);
  // One AdamW step over n elements (emu/optim.hpp's adamw_element on each).
  virtual void adamw_update(float* /*params*/, const float* /*grads*/, float* /*m*/, float* /*v*/,
                            int64_t /*n*/, const AdamWStep& /*step*/) {
    missing("adamw_update");
  }
  // adamw_update(params + offsets[i], grads + offsets[i], m + offsets[i], v + offsets[i],
  // counts[i], steps[i]) for every tensor i, in one call: the same bits (each element's update
  // depends on that element alone). The optimizer step over all parameter tensors; the CUDA backend
  // makes one launch. Tensors must not overlap. std::invalid_argument for unequal list lengths or a
  // negative entry.
  virtual void adamw_update_many(float* params, const float* grads, float* m, float* v,
                                 const std::vector<int64_t>& offsets,
                                 const std::vector<int64_t>& counts,
                                 const std::vector<AdamWStep>& steps);
  // adamw_update_many, then params16 (as many elements as params, the same offsets) = the BF16 bits
  // of every updated tensor (narrow_to_bf16): the BF16 weight shadow kept current by the step
  // itself. The CUDA backend writes the bits in the update's own pass.
  virtual void adamw_update_many_bf16(float* params, uint16_t* params16, const float* grads,
                                      float* m, float* v, const std::vector<int64_t>& offsets,
                                      const std::vector<int64_t>& counts,
                                      const std::vector<AdamWStep>& steps);
  // sum of x_i^2 in FP64 (the global gradient norm).
  virtual double sum_squares(const float* /*x*/, int64_t /*n*/) { missing("sum_squares"); }
  // sums[i] = sum_squares(base + offsets[i], counts[i]) for every i, the same bits, in one call
  // (the gradient norm over all parameter tensors; the CUDA backend makes one round trip for all).
  virtual void sum_squares_many(const float* base, const std::vector<int64_t>& offsets,
                                const std::vector<int64_t>& counts, double* sums) {
    validate_sum_squares_many(offsets, counts);
    for (size_t i = 0; i < offsets.size(); ++i) sums[i] = sum_squares(base + offsets[i], counts[i]);
  }

 protected:
  [[noreturn]] void missing(const char* op) const;
};

// RAII allocation in a backend's memory.
class BackendBuffer {
 public:
  BackendBuffer() = default;
  BackendBuffer(Backend& b, size_t bytes) : backend_(&b), bytes_(bytes) {
    ptr_ = bytes ? b.allocate(bytes) : nullptr;
  }
  ~BackendBuffer() {
    if (ptr_) backend_->release(ptr_);
  }
  BackendBuffer(const BackendBuffer&) = delete;
  BackendBuffer& operator=(const BackendBuffer&) = delete;
  BackendBuffer(BackendBuffer&& o) noexcept { *this = std::move(o); }
  BackendBuffer& operator=(BackendBuffer&& o) noexcept {
    std::swap(backend_, o.backend_);
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  void* get() const { return ptr_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  Backend* backend_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A quantized copy in a backend's memory, shaped like a QuantizedHost; `view` points into it.
struct QuantizedBuffers {
  BackendBuffer codes, scales, amax;
  QuantizedView view;

  QuantizedBuffers(Backend& b, const QuantizedHost& h);  // allocated, not filled
  static QuantizedBuffers uploaded(Backend& b, const QuantizedHost& h);
  void upload_from(Backend& b, const QuantizedHost& h);
  void download_to(Backend& b, QuantizedHost& h);
};

// Quantize a host tensor on any backend and bring both copies back to the host.
struct QuantizeResult {
  QuantizedHost rowwise;
  QuantizedHost columnwise;
};
QuantizeResult quantize_to_host(Backend& backend, const TensorView& host_x,
                                const QuantizeConfig& cfg);

// Dequantize a host copy on any backend; returns rows*cols floats.
std::vector<float> dequantize_to_host(Backend& backend, QuantizedHost& q);

// Error sums (Backend::quant_error_sums) of a host copy against host x (q.rows * q.cols floats),
// on any backend.
QuantErrorSums quant_error_sums_on(Backend& backend, const std::vector<float>& x, QuantizedHost& q);

std::unique_ptr<Backend> make_cpu_backend();

}  // namespace fp4sim
