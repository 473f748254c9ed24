// The one interface the model and the tools talk to. CpuBackend (emu/) is the golden reference;
// CudaBackend (gpu/) implements the same ops with the same names and argument order.
//
// Every op takes non-owning typed views (emu/tensor.hpp): the dtype of a view says what the op
// reads or writes (float32 or BF16 bits), bf16_values marks float32 storage of BF16 values, a
// view with null data is an absent optional operand. Shapes come from the views; each op checks
// them and names the tensor in its error. Outputs first, then inputs (llm.c's order).
//
// Plain ops are pure virtual and implemented by every backend. Fused ops (a residual add feeding a
// norm, an activation feeding a matmul or a quantizer) are pure virtual too: each has one
// composition from plain ops (emu/fused.hpp) that a backend runs for the cases it does not fuse;
// supports(Capability::Fused...) says whether a backend fuses an op at all. Fused or composed, the
// bits are the same.
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
#include "emu/ssm.hpp"
#include "emu/tensor.hpp"

namespace fp4sim {

using emu::GemmPrecision;
using emu::SsmShape;  // the Mamba-2 mixer's sizes (emu/ssm.hpp)

enum class NormKind : uint8_t { LayerNorm, RMSNorm };
enum class Activation : uint8_t { GeluTanh, SquaredRelu, SwiGLU };

// The sizes of causal attention over a packed qkv [B*T, (NH + 2*NKV)*HD] (grouped KV heads).
struct AttentionShape {
  int64_t B = 0, T = 0, NH = 0, NKV = 0, HD = 0;
  int64_t qkv_cols() const { return (NH + 2 * NKV) * HD; }
};

// The elementwise op whose output feeds a fused matmul or quantizer (matmul_forward_activation,
// matmul_backward_activation, quantize_activation), [rows, cols] dense:
//   Identity     x = inp                                  (quantize_activation only)
//   GeluForward  x = gelu_tanh(inp)
//   GeluBackward x = gelu_tanh'(inp) * dout                (dout read rounded when bf16_values)
// out: where the op's output is stored when it must be (float32, bf16_values = rounded, or BF16);
// each fused op says when it is written.
enum class ActivationOp : uint8_t { Identity, GeluForward, GeluBackward };
struct ActivationSource {
  ActivationOp op = ActivationOp::Identity;
  TensorView inp;   // float32 or BF16
  TensorView dout;  // GeluBackward only: float32 (bf16_values: read rounded) or BF16
  TensorView out;   // absent for Identity
  int64_t rows() const { return inp.rows; }
  int64_t cols() const { return inp.cols; }
};

// One tensor of a segmented op (adamw_update, sum_squares): elements [offset, offset + count) of
// the flat vectors the op is given.
struct Segment {
  int64_t offset = 0, count = 0;
};

// The encoded Q-AdamW state of a set of tensors (emu/qadamw.hpp), n elements in all, each tensor's
// part at its state offset: uint8 m_codes, v_codes [1, n/2]; uint8 m_scales, v_scales [1, n/16];
// BF16 v_mean [1, n/v_tile]; float32 amax [1, 4 * tensors]: tensor i's m and v amax at 2i, 2i + 1
// (those the stored encoding was made with), and the op's scratch for the new ones after them;
// BF16 v_floor [1, n/v_tile] the tiles' floors of v̂ (optim.v_floor = tile_min), or absent.
struct QAdamWState {
  TensorView m_codes, m_scales, v_codes, v_scales, v_mean, amax, v_floor;
  int64_t v_tile = 16;
};

enum class Capability : uint8_t {
  AttentionHeadDim,    // arg: a head size the attention ops take
  GemmDecodedOperand,  // arg: GemmImpl; gemm reads an FP4 view's decoded_bf16, quantize writes it
  GemmFp8Scales,       // arg: GemmImpl; gemm reads an FP8 view's scales_gemm, quantize writes it
  FusedResidualNorm,   // residual_norm_forward runs as one pass (for some cases)
  FusedActivationMatmul,    // matmul_*_activation make the GEMM operand in the op's pass
  FusedActivationQuantize,  // quantize_activation computes the op inside the quantizer
  SsmConvWidth,             // arg: a conv width the ssm_conv ops take
  SsmScanSize,              // arg: a head dim P or state size N the ssm_scan ops take
  SsmChunk,                 // arg: a chunk (SsmShape::chunk) the ssm_scan ops take
};

// What a buffer in a backend's memory holds, for memory plans (model/memory_plan.hpp) and for the
// message of a failed allocation: the plan's line it counts in (use: "activations", "parameters",
// ...) and the tensor (what: "h.3 qkv"). A use is a string literal (plans compare the pointers'
// texts, never free them).
struct BufferLabel {
  const char* use = "unlabelled";
  std::string what;
};

// An allocation that failed (host: std::bad_alloc; CUDA: out of device memory, or another CUDA
// error): what names the buffer, its size and the backend; cause is the original message.
class AllocationError : public std::runtime_error {
 public:
  AllocationError(const std::string& message, size_t bytes)
      : std::runtime_error(message), bytes_(bytes) {}
  size_t bytes() const { return bytes_; }

 private:
  size_t bytes_;
};

// "1.50 GiB (1610612736 bytes)", "512 B (512 bytes)": sizes in messages and plans.
std::string bytes_text(uint64_t bytes);

class Backend {
 public:
  virtual ~Backend() = default;
  const std::string& name() const { return name_; }
  Device device() const { return device_; }

  // ---- memory (host memory on the emulator); all stream-ordered on the CUDA backend ------------
  virtual void* allocate(size_t bytes) = 0;
  virtual void release(void* p) = 0;
  // allocate(bytes) for the buffer `label` describes; any failure (std::bad_alloc, a CUDA error)
  // is rethrown as AllocationError naming the buffer, the size and the backend. While allocate
  // runs, allocating() is the label (a planning backend files the buffer under it), else null.
  void* allocate_labelled(size_t bytes, const BufferLabel& label);
  const BufferLabel* allocating() const { return allocating_; }
  virtual void upload(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void download(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void zero(void* p, size_t bytes) = 0;
  virtual void synchronize() = 0;
  // Device memory in use (bytes), or -1 where the backend has no separate memory (the emulator).
  virtual int64_t device_memory_used() const = 0;
  // Device memory free for this process's allocations now (bytes), or -1 where the backend has no
  // separate memory (the emulator: host memory, model/memory_plan.hpp's host_memory_available).
  virtual int64_t device_memory_free() const = 0;
  // The high-water marks of the memory allocate() handed out (allocated) and of what the backend's
  // allocator held for it (reserved), bytes, since the process started; -1 where not tracked (the
  // emulator). A memory plan's buffers_peak predicts allocated.
  struct AllocationPeaks {
    int64_t allocated = -1, reserved = -1;
  };
  virtual AllocationPeaks allocation_peaks() const = 0;
  virtual bool supports(Capability c, int64_t arg = 0) const = 0;

  // ---- quantization and the exact GEMM (DESIGN.md §5-§8) ---------------------------------------
  // Quantize x (float32 or BF16, rows x cols) into the requested copies. Either output may be null
  // when its copy is disabled; each view's rows/cols must be the written shape.
  virtual void quantize(const TensorView& x, const QuantizeConfig& cfg, QuantizedView* rowwise,
                        QuantizedView* columnwise) = 0;
  // out (float32, q.rows x q.cols) = decode(q). NVFP4: e2m1 * ((s_b * amax) * (1/2688 or 1/1536));
  // MXFP4: e2m1 * 2^(byte - 127), byte 0xFF -> NaN.
  virtual void dequantize(const QuantizedView& q, const TensorView& out) = 0;
  // Error sums of copy q against the float32 x (q.rows x q.cols) it was quantized from, for the
  // quantization statistics (emu/quant_stats.hpp): the same bits on every backend. Synchronous.
  virtual QuantErrorSums quant_error_sums(const TensorView& x, const QuantizedView& q) = 0;
  // Exact block-scaled GEMM (DESIGN.md §8): d = alpha * a * b^T (+ beta * c), bit-identical on
  // every backend. a [M, K], b [N, K] row-wise copies; c float32 [M, N] or null; d float32 or BF16.
  virtual void gemm(const QuantizedView& a, const QuantizedView& b, const TensorView* c,
                    const GemmConfig& cfg, const TensorView& d) = 0;
  // Scale matrix [rows, k_blocks] -> the cuBLASLt 128x4 tiled layout, padded with zeros to
  // round_up(rows, 128) x round_up(k_blocks, 4) (DESIGN.md §8).
  virtual void scales_to_tiled(const uint8_t* scales, int64_t rows, int64_t k_blocks,
                               uint8_t* out) = 0;

  // ---- layer ops: emu/layers.hpp's reference functions on views ---------------------------------
  // out [N, C] float32 = wte[tokens] + wpe[pos] (wpe absent: no positions). tokens, pos [N, 1]
  // int32.
  virtual void embedding_forward(const TensorView& out, const TensorView& tokens,
                                 const TensorView& pos, const TensorView& wte,
                                 const TensorView& wpe) = 0;
  // dwte, dwpe (absent: none) += the rows of dout [N, C] float32, in token order.
  virtual void embedding_backward(const TensorView& dwte, const TensorView& dwpe,
                                  const TensorView& dout, const TensorView& tokens,
                                  const TensorView& pos) = 0;
  // out [N, C] = norm(inp) * weight (+ bias), mean and rstd [N, 1] float32 saved (RMSNorm: mean
  // and bias absent). inp float32; out float32 (bf16_values: rounded) or BF16.
  virtual void norm_forward(NormKind kind, const TensorView& out, const TensorView& mean,
                            const TensorView& rstd, const TensorView& inp, const TensorView& weight,
                            const TensorView& bias) = 0;
  // dinp [N, C] float32 += the input gradient, then rounded when dinp.bf16_values; dweight (and
  // dbias) += the parameter gradients. dout float32 (bf16_values: read rounded, for every use) or
  // BF16.
  virtual void norm_backward(NormKind kind, const TensorView& dinp, const TensorView& dweight,
                             const TensorView& dbias, const TensorView& dout, const TensorView& inp,
                             const TensorView& weight, const TensorView& mean,
                             const TensorView& rstd) = 0;
  // out [N, OC] = inp [N, K] weight [OC, K]^T (+ bias [OC, 1]), at prec (BF16: the backend's BF16
  // GEMM; FP32: gradient checks, float32 views only). out float32 (bf16_values: rounded) or BF16;
  // inp and weight float32 or BF16; bias float32 or BF16. An output stored as BF16 adds the bias's
  // BF16 rounding, RNE(fl32(acc + bf16(bias))), as a BF16 GEMM's epilogue does (cuBLASLt,
  // Transformer Engine, PyTorch autocast); a plain float32 output adds the float32 bias.
  virtual void matmul_forward(const TensorView& out, const TensorView& inp,
                              const TensorView& weight, const TensorView& bias,
                              GemmPrecision prec) = 0;
  // The backward pass of matmul_forward: dinp [N, K] = dout weight (written, not accumulated;
  // float32 unrounded, or BF16; absent: no Dgrad), dweight [OC, K] += dout^T inp, dbias [OC, 1] +=
  // dout's column sums (absent: none). dout float32 or BF16; inp and weight float32 or BF16.
  virtual void matmul_backward(const TensorView& dinp, const TensorView& dweight,
                               const TensorView& dbias, const TensorView& dout,
                               const TensorView& inp, const TensorView& weight,
                               GemmPrecision prec) = 0;
  // out [N, OC] = inp + bias, float32 RN per element. out float32 (bf16_values: rounded, the
  // bias's BF16 rounding added; out may be inp) or BF16 (then inp is scratch: its contents
  // afterwards are unspecified).
  virtual void bias_forward(const TensorView& out, const TensorView& inp,
                            const TensorView& bias) = 0;
  // dbias [OC, 1] += dout [N, OC]'s column sums (float32, emu::bias_backward's order).
  virtual void bias_backward(const TensorView& dbias, const TensorView& dout) = 0;
  // Causal attention (emu/layers.hpp): out [B*T, NH*HD], lse [B*NH, T] the saved log-sum-exp rows.
  // qkv float32 or BF16; out float32 (bf16_values: rounded) or BF16.
  virtual void attention_forward(const TensorView& out, const TensorView& lse,
                                 const TensorView& qkv, const AttentionShape& s,
                                 GemmPrecision prec) = 0;
  // dqkv written (not accumulated): float32 (bf16_values: rounded) or BF16. dout, qkv, out float32
  // or BF16.
  virtual void attention_backward(const TensorView& dqkv, const TensorView& dout,
                                  const TensorView& qkv, const TensorView& out,
                                  const TensorView& lse, const AttentionShape& s,
                                  GemmPrecision prec) = 0;
  // RoPE on the Q and K heads of qkv (float32, in place), and its inverse on dqkv.
  virtual void rope_forward(const TensorView& qkv, const AttentionShape& s) = 0;
  virtual void rope_backward(const TensorView& dqkv, const AttentionShape& s) = 0;
  // out = act(inp): GELU (tanh) and squared ReLU elementwise; SwiGLU out [N, F] from inp [N, 2F]
  // = [gate | up]. float32 views; out.bf16_values: rounded.
  virtual void activation_forward(Activation act, const TensorView& out, const TensorView& inp) = 0;
  // dinp = act'(inp) * dout, written. float32 views; dinp.bf16_values: rounded; dout.bf16_values:
  // read rounded.
  virtual void activation_backward(Activation act, const TensorView& dinp, const TensorView& inp,
                                   const TensorView& dout) = 0;
  // dst = src, same shape: BF16 -> float32 (exact), float32 -> BF16 (RNE), or float32 -> float32
  // with dst.bf16_values (rounded; dst may be src: rounding in place).
  virtual void convert(const TensorView& dst, const TensorView& src) = 0;
  // out = a + b (the residual stream; float32 RN). out float32 (bf16_values: rounded); a float32;
  // b float32 or BF16.
  virtual void residual_forward(const TensorView& out, const TensorView& a,
                                const TensorView& b) = 0;
  // The softmax cross-entropy loss and its gradient in one op that never stores the probabilities
  // (emu::crossentropy_softmax_forward_backward): losses [N, 1] float32, dlogits [N, V] = (softmax
  // - onehot) * dlosses, written. logits [N, V] and dlogits share a storage precision: both float32
  // (FP32 activations), or logits read rounded (bf16_values, or BF16) and dlogits rounded
  // (bf16_values, or BF16).
  virtual void crossentropy_forward_backward(const TensorView& losses, const TensorView& dlogits,
                                             const TensorView& logits, const TensorView& targets,
                                             const TensorView& dlosses) = 0;
  // One AdamW step (emu/optim.hpp's adamw_element) on every element of every segment, steps[i]
  // for segment i; params16 (BF16, as many elements as params; absent: none) then holds the BF16
  // bits of every updated element. Segments must not overlap (std::invalid_argument for unequal
  // list lengths or a negative entry).
  virtual void adamw_update(const TensorView& params, const TensorView& params16,
                            const TensorView& grads, const TensorView& m, const TensorView& v,
                            const std::vector<Segment>& segments,
                            const std::vector<AdamWStep>& steps) = 0;
  // One Q-AdamW step (emu/qadamw.hpp, DESIGN.md §13) on every segment: params and grads as for
  // adamw_update, the state of segment i at state offset o_i = the counts of the segments before
  // it (st's arrays hold them in segment order); streams[i] is segment i's SR stream for m. Each
  // count a multiple of st.v_tile, itself a multiple of 16 (std::invalid_argument otherwise).
  virtual void qadamw_update(const TensorView& params, const TensorView& params16,
                             const TensorView& grads, const QAdamWState& st,
                             const std::vector<Segment>& segments,
                             const std::vector<AdamWStep>& steps, uint64_t seed,
                             const std::vector<uint64_t>& streams) = 0;
  // sums[i] = sum of x^2 over segment i, in FP64, in index order (the gradient norm). Synchronous.
  virtual void sum_squares(const TensorView& x, const std::vector<Segment>& segments,
                           double* sums) = 0;

  // ---- the orthogonalising optimizers' steps (DESIGN.md §13, model/optimizer.hpp) --------------
  // out = a * x + b * y per element (emu/optim.hpp's axpby_element); y absent: out = a * x (one
  // RN product). Float32 views of one shape; out may be x or y.
  virtual void axpby(const TensorView& out, float a, const TensorView& x, float b,
                     const TensorView& y) = 0;
  // out [cols, rows] = x [rows, cols] transposed, float32 (out not x).
  virtual void transpose(const TensorView& out, const TensorView& x) = 0;
  // out = x clamped to [-bound, bound] per element (emu/optim.hpp's clamp_element), float32 of
  // one shape; out may be x.
  virtual void clamp(const TensorView& out, const TensorView& x, float bound) = 0;
  // ||x||_F of float32 x [rows, cols] in §13's order: each row's squares summed in FP64 in index
  // order, the row sums added in row order, sqrt in FP64, rounded to FP32. Synchronous.
  virtual float frobenius_norm(const TensorView& x) = 0;
  // The q-quantile (0 <= q <= 1) of |x| over the elements of float32 x (at least one), as §13
  // fixes it: the values in emu/optim.hpp's abs_key order, then quantile_between. Synchronous.
  virtual float abs_quantile(const TensorView& x, double q) = 0;

  // ---- the Mamba-2 mixer's high-precision core (DESIGN.md §12): emu/ssm.hpp's functions --------
  // s gives the sizes (B, T, H, P, G, N, chunk); the rows of every activation are the B*T tokens.
  // Every view is float32 (BF16 bits are refused); a view that slices a column range of a wider
  // row (the in_proj output [z | x | B | C | dt_raw] and its gradient) may have a row stride where
  // the op says "strided". An output marked bf16_values is written rounded (the model's BF16
  // storage); inputs are read as stored unless the op says otherwise. Input gradients are written;
  // parameter gradients are summed and added once (+=), emu/ssm.hpp's rules.
  // out [B*T, C] = silu(bias + the causal depthwise conv of inp [B*T, C] (strided) with weight
  // [C, W]), C = s.xbc_cols(); bias [C, 1]. out: bf16_values allowed.
  virtual void ssm_conv_forward(const TensorView& out, const TensorView& inp,
                                const TensorView& weight, const TensorView& bias,
                                const SsmShape& s) = 0;
  // dinp [B*T, C] (strided; bf16_values: rounded) written; dweight [C, W], dbias [C, 1] +=.
  virtual void ssm_conv_backward(const TensorView& dinp, const TensorView& dweight,
                                 const TensorView& dbias, const TensorView& dout,
                                 const TensorView& inp, const TensorView& weight,
                                 const TensorView& bias, const SsmShape& s) = 0;
  // dt [B*T, H] = softplus(dt_raw + dt_bias) and A [H, 1] = -exp(A_log) (saved for the backward
  // pass), then the selective scan: y [B*T, H*P] (bf16_values allowed) from xbc [B*T, xbc_cols]
  // (the conv output), dt, A and D [H, 1]; states [B*H*chunks, P*N] the state at the end of every
  // chunk of s.chunk steps (absent: forward only). dt_raw [B*T, H] strided; dt_bias, A_log [H, 1].
  virtual void ssm_scan_forward(const TensorView& y, const TensorView& states, const TensorView& dt,
                                const TensorView& A, const TensorView& xbc,
                                const TensorView& dt_raw, const TensorView& dt_bias,
                                const TensorView& A_log, const TensorView& D,
                                const SsmShape& s) = 0;
  // The scan's reverse recurrence, then softplus's and exp's backward passes: dxbc [B*T,
  // xbc_cols] (bf16_values allowed) and ddt_raw [B*T, H] (strided; bf16_values allowed) written;
  // ddt_bias, dA_log, dD [H, 1] +=. dy [B*T, H*P]; the rest as the forward pass had them.
  virtual void ssm_scan_backward(const TensorView& dxbc, const TensorView& ddt_raw,
                                 const TensorView& ddt_bias, const TensorView& dA_log,
                                 const TensorView& dD, const TensorView& dy, const TensorView& xbc,
                                 const TensorView& dt, const TensorView& A,
                                 const TensorView& dt_raw, const TensorView& dt_bias,
                                 const TensorView& A_log, const TensorView& D,
                                 const TensorView& states, const SsmShape& s) = 0;
  // Mamba-2's gated grouped RMSNorm: out [N, C] (bf16_values allowed) = rmsnorm(inp * silu(z)) *
  // weight over each of the G groups of C/G channels, G = rstd.cols; rstd [N, G] saved. inp [N,
  // C], z [N, C] strided, weight [C, 1].
  virtual void gated_norm_forward(const TensorView& out, const TensorView& rstd,
                                  const TensorView& inp, const TensorView& z,
                                  const TensorView& weight) = 0;
  // dinp [N, C] (bf16_values allowed) and dz [N, C] (strided; bf16_values allowed) written;
  // dweight [C, 1] +=. dout [N, C]: bf16_values allowed (read rounded).
  virtual void gated_norm_backward(const TensorView& dinp, const TensorView& dz,
                                   const TensorView& dweight, const TensorView& dout,
                                   const TensorView& inp, const TensorView& z,
                                   const TensorView& weight, const TensorView& rstd) = 0;

  // ---- fused ops: one composition each (emu/fused.hpp)
  // ------------------------------------------- residual_forward(res, a, b), then
  // norm_forward(kind, out, mean, rstd, res, weight, bias).
  virtual void residual_norm_forward(NormKind kind, const TensorView& res, const TensorView& out,
                                     const TensorView& mean, const TensorView& rstd,
                                     const TensorView& a, const TensorView& b,
                                     const TensorView& weight, const TensorView& bias) = 0;
  // The op of src into src.out, then matmul_forward(out, src.out, weight, bias, prec): a linear
  // layer whose input an activation makes. src.out is written (the backward pass reads it); a
  // fusing backend makes the GEMM's operand in the op's pass. src.op is GeluForward.
  virtual void matmul_forward_activation(const TensorView& out, const ActivationSource& src,
                                         const TensorView& weight, const TensorView& bias,
                                         GemmPrecision prec) = 0;
  // The op of src into src.out, then matmul_backward(dinp, dweight, dbias, src.out, inp, weight,
  // prec): a linear layer's backward pass whose output gradient an activation's backward makes. A
  // fusing backend may leave src.out unwritten. src.op is GeluBackward.
  virtual void matmul_backward_activation(const TensorView& dinp, const TensorView& dweight,
                                          const TensorView& dbias, const ActivationSource& src,
                                          const TensorView& inp, const TensorView& weight,
                                          GemmPrecision prec) = 0;
  // The op of src (into src.out unless Identity), then quantize(x, cfg, rowwise, columnwise) of
  // its output x, and bias_backward(dbias, x) where dbias is present: the copies of a tensor that
  // only quantized GEMMs read. A fusing backend may compute the op inside the quantizer and leave
  // src.out unwritten.
  virtual void quantize_activation(const ActivationSource& src, const QuantizeConfig& cfg,
                                   QuantizedView* rowwise, QuantizedView* columnwise,
                                   const TensorView& dbias) = 0;

 protected:
  Backend(std::string name, Device device) : name_(std::move(name)), device_(device) {}
  // "cannot allocate <size> for '<what>' (<use>) in the <name> backend's <host|device> memory:
  // <cause>"
  std::string allocation_failure(const BufferLabel& label, size_t bytes,
                                 const std::string& cause) const;

 private:
  std::string name_;
  Device device_;
  const BufferLabel* allocating_ = nullptr;
};

// Views into a backend's memory.
inline TensorView f32_view(const Backend& b, const float* p, int64_t rows, int64_t cols,
                           const char* name = "tensor", bool bf16_values = false) {
  return view_of(p, DType::F32, rows, cols, b.device(), name, bf16_values);
}
inline TensorView bf16_view(const Backend& b, const uint16_t* p, int64_t rows, int64_t cols,
                            const char* name = "tensor") {
  return view_of(p, DType::BF16, rows, cols, b.device(), name);
}
inline TensorView i32_view(const Backend& b, const int32_t* p, int64_t rows, int64_t cols,
                           const char* name = "tensor") {
  return view_of(p, DType::I32, rows, cols, b.device(), name);
}

// The checks every backend's op runs on its views (std::invalid_argument naming op and tensor):
// present, the shape, one of the allowed dtypes, dense (or, where strided is allowed, a row stride
// of at least the row), and no bf16_values mark unless allowed.
struct ViewRule {
  bool f32 = true, bf16 = false, i32 = false;
  bool bf16_values = false;
  bool optional = false;
  bool strided = false;
  bool u8 = false;
};
void check_view(const char* op, const TensorView& v, int64_t rows, int64_t cols,
                const ViewRule& rule);

// RAII allocation in a backend's memory.
class BackendBuffer {
 public:
  BackendBuffer() = default;
  BackendBuffer(Backend& b, size_t bytes, const BufferLabel& label = {})
      : backend_(&b), bytes_(bytes) {
    ptr_ = bytes ? b.allocate_labelled(bytes, label) : nullptr;
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

// The segments of a segmented op (adamw_update, sum_squares): none negative (std::invalid_argument
// naming op); steps (adamw_update) one a segment.
void validate_segments(const char* op, const std::vector<Segment>& segments);

std::unique_ptr<Backend> make_cpu_backend();

}  // namespace fp4sim
