// The linear layer under a low-precision recipe (DESIGN.md §9, issue 5): y = x W^T + bias with each
// of its three GEMMs (Fprop, Dgrad, Wgrad) in BF16 or in a block-scaled FP4 format, through the
// Backend's quantize and gemm ops, so the emulator and the CUDA backend (exact mode) give the same
// bits. Per GEMM, following the table of §9:
//   Fprop  y  = x W^T     A = x row-wise (1x16, RN),           B = W row-wise (2D, RN)
//   Dgrad  dx = dy W      A = dy row-wise (SR),                B = W column-wise (2D, RN)
//   Wgrad  dW = dy^T x    A = dy column-wise (RHT, SR),        B = x column-wise (RHT, RN)
// Dgrad writes dx (beta = 0), as matmul_backward does; Wgrad accumulates into dW through the GEMM
// epilogue (C = D, beta = 1), as matmul_backward does with +=. Quantized copies are made from the
// FP32 tensors when each GEMM needs them (the backward pass re-quantizes x and W: same bits as
// keeping them, since RN is deterministic and SR draws from the same stream).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "emu/backend.hpp"
#include "emu/matmul.hpp"
#include "model/config.hpp"
#include "model/memory_plan.hpp"

namespace fp4sim::model {

// OptimizerState: Q-AdamW's m (DESIGN.md §13), a role no linear layer's copy takes.
enum class TensorRole : uint64_t { Activation = 0, Weight = 1, Gradient = 2, OptimizerState = 3 };

// The SR stream of one quantized copy, a documented function of where it is used (DESIGN.md §3
// streams; seed = train.seed):
//   stream = step << 32 | micro_batch << 24 | layer << 12 | linear << 4 | role << 1 | copy
// step < 2^32, micro_batch < 256, layer < 4096, linear (0 c_attn, 1 attn c_proj, 2 c_fc,
// 3 mlp c_proj, 4 mamba in_proj, 5 mamba out_proj) < 8, role (TensorRole) < 8, copy 0 =
// row-wise, 1 = column-wise.
uint64_t sr_stream(int64_t step, int64_t micro_batch, int64_t layer, int64_t linear,
                   TensorRole role, int copy);

// What one linear layer does, resolved from the run's RecipeConfig (model/config.hpp).
struct LinearRecipe {
  GemmFormat fprop = GemmFormat::BF16, dgrad = GemmFormat::BF16, wgrad = GemmFormat::BF16;
  bool rht = true;           // on the Wgrad operands
  bool sr_gradients = true;  // SR on dy (both copies)
  bool sr_other = false;     // SR on x and W too (unusual)
  bool weight_2d = true;     // NVFP4 16x16 weight blocks
  bool fos_weights = false, fos_activations = false, fos_gradients = false;
  FourOverSixError fos_error = FourOverSixError::MAE;
  MxScaleRule mx_rule = MxScaleRule::Floor;
  GemmImpl impl = GemmImpl::Exact;
  bool any_quantized() const {
    return fprop != GemmFormat::BF16 || dgrad != GemmFormat::BF16 || wgrad != GemmFormat::BF16;
  }
};

// The linear layers of a recipe unit (a preset's layer h.<l>: attention's two, then the MLP's;
// a pattern block blocks.<i>: its mixer's two), in the order of their `linear` index.
inline constexpr int kLinearsPerUnit = 6;
inline constexpr const char* kLinearNames[kLinearsPerUnit] = {
    "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj", "mamba.in_proj", "mamba.out_proj"};

// The quantized copies' format of a quantized GEMM (BF16 makes none: an error to ask).
QFormat qformat_of(GemmFormat f);

// Linear `linear` of block `layer` at training step `step` under the run's recipe: the recipe's
// format unless the block is high-precision, then recipe.override.h.<layer>.<linear>.<gemm>, then
// the late switch to BF16 (recipe.bf16_from_step: Fprop only, or all three GEMMs).
LinearRecipe resolve_linear_recipe(const RunConfig& c, const std::vector<bool>& high_precision,
                                   int64_t layer, int linear, int64_t step);

struct LinearIds {
  uint64_t seed = 0;
  int64_t step = 0, micro_batch = 0, layer = 0, linear = 0;
};

// Quantization statistics of one quantized copy (issue 5, "visibility"): over the FP32 input of
// the copy and its decoded values. saturated: elements with |x| / (block decode scale) > 6 (they
// clip to +-6); underflow_blocks: blocks with a non-zero amax but a zero stored scale.
struct QuantStat {
  std::string tensor;  // e.g. h.3.mlp.c_fc.fprop.x
  float amax = 0.0f;
  double saturated = 0, underflow_blocks = 0, rel_error = 0;
  int64_t elements = 0;
};

// One quantized copy in a backend's memory (codes, scales, amax and the view onto them).
struct QuantizedCopy {
  BackendBuffer codes, scales, amax;
  QuantizedView view;
  BackendBuffer decoded;      // the view's decoded_bf16, when asked for (empty otherwise)
  BackendBuffer scales_gemm;  // the view's scales_gemm (FP8), when asked for (empty otherwise)
  // label: the memory plan's line (saved for the backward pass, or a GEMM's operand) and the
  // tensor; each buffer is allocated under it.
  QuantizedCopy(Backend& be, int64_t rows, int64_t cols, QFormat f, bool fos,
                bool with_decoded = false, bool with_scales_gemm = false,
                const BufferLabel& label = {});
  size_t bytes() const {
    return codes.bytes() + scales.bytes() + amax.bytes() + decoded.bytes() + scales_gemm.bytes();
  }
};

// The parameters of one linear layer, as views into the backend's memory.
struct LinearWeights {
  TensorView weight;    // [OC, K] float32 master weights (what the quantizers read)
  TensorView bias;      // [OC, 1] float32, or absent
  TensorView weight16;  // [OC, K] the weight's BF16 bits (the BF16 weight shadow), or absent
  TensorView bias16;    // [OC, 1] the bias's BF16 bits, or absent
  // What a BF16 GEMM reads: the BF16 bits where they exist (the same values it rounds to).
  const TensorView& gemm_weight() const { return weight16.present() ? weight16 : weight; }
  // What a BF16 GEMM adds: the bias's BF16 bits where its output is BF16 bits and they exist, else
  // the float32 bias (a float32 output marked bf16_values adds its BF16 rounding itself:
  // Backend::matmul_forward's bias rule, the same values either way).
  const TensorView& bias_for(const TensorView& out) const {
    return out.dtype == DType::BF16 && bias16.present() ? bias16 : bias;
  }
};

// y = x W^T + bias (forward) and its gradients (backward) under recipe r, every view in the
// backend's memory. out: float32 (bf16_values: rounded, the model's BF16 storage) or BF16 bits;
// inp: float32 or BF16 bits.
// stats: when non-null, the row-wise (non-RHT) copies made here append their statistics (computed
// on the backend, Backend::quant_error_sums; one extra pass over x and the copy; x must be
// float32). save_wgrad_input: when non-null and the Wgrad GEMM is quantized, x's column-wise Wgrad
// copy is made here and kept there (else reset), so the backward pass can run without x
// (DESIGN.md §9: saved activations in quantized form); the bits are those linear_backward would
// make from x. saved_wgrad_input (backward): that copy, or null to quantize inp there; inp may be
// absent when the copy is given. save_dgrad_weight / saved_dgrad_weight: the same for W's
// column-wise Dgrad copy, made in the forward pass from the quantize call that makes W's Fprop
// copy when both GEMMs are quantized alike (one amax pass and one read of W instead of two of
// each; W does not change between the passes of a micro-batch). pending_input (forward) /
// pending_dout (backward): x / dy is the output (src.out) of an activation op not yet run; inp /
// dout are then unused. Where the layer's only use of it is one quantize call making both copies
// (both GEMMs quantized alike, no statistics), that call is Backend::quantize_activation, which may
// never store it; where both of the pass's GEMMs are BF16, the pass is
// Backend::matmul_forward_activation (which stores x) / matmul_backward_activation (which may
// never store dy); otherwise the op runs first (run_activation) and the layer proceeds as usual.
// Either way the copies, the GEMMs and the bias gradient are the same bits. linear_backward
// WRITES dinp (= dy W; the old contents are ignored; float32 unrounded, or BF16 bits for a linear
// whose GEMMs are all BF16) and ADDS to dweight and dbias (+=, the parameter gradients accumulate
// over micro-batches). Writing dinp lets a quantized Dgrad GEMM run with beta = 0: no zeroing pass
// before it and no read of the old dinp in its epilogue (and on Hopper's cuBLASLt path, where
// alpha' is a device scalar, it avoids the general-beta kernel that a device beta = 1 forces,
// 20-47% slower on gpt2-124m's Dgrad shapes; docs/performance.md).
void linear_forward(Backend& be, const LinearRecipe& r, const LinearIds& ids, const TensorView& out,
                    const TensorView& inp, const LinearWeights& w, GemmPrecision prec,
                    std::vector<QuantStat>* stats, const std::string& name,
                    std::unique_ptr<QuantizedCopy>* save_wgrad_input = nullptr,
                    std::unique_ptr<QuantizedCopy>* save_dgrad_weight = nullptr,
                    const ActivationSource* pending_input = nullptr);
void linear_backward(Backend& be, const LinearRecipe& r, const LinearIds& ids,
                     const TensorView& dinp, const TensorView& dweight, const TensorView& dbias,
                     const TensorView& dout, const TensorView& inp, const LinearWeights& w,
                     GemmPrecision prec, std::vector<QuantStat>* stats, const std::string& name,
                     const QuantizedCopy* saved_wgrad_input = nullptr,
                     const QuantizedCopy* saved_dgrad_weight = nullptr,
                     const ActivationSource* pending_dout = nullptr);

}  // namespace fp4sim::model
