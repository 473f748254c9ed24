// A decoder-only language model (GPT-2 / Llama / Nemotron-H family, config-driven) built from
// blocks (DESIGN.md §11): token embedding (+ learned positions) -> blocks -> final norm -> head,
// each block x = x + mixer(norm(x)) with an attention ('*'), MLP ('-') or Mamba-2 ('M', §12)
// mixer; a layer h.<l> of the GPT
// presets is the two blocks "*-", which keep the parameter names, SR streams and per-GEMM override
// keys of layer l. Forward, backward, and the named FP32 parameter tensors the optimizer and
// checkpoints use.
//
// Every buffer (parameters, gradients, activations, scratch) lives in the backend's memory and
// every op goes through Backend, so the same class runs on the emulator and on the CUDA backend.
// The host sees the model through explicit copies (params_to_host, grads_to_host,
// logits_row_to_host) and the per-row losses of each forward. Activations and their gradients are
// stored as BF16 with FP32 compute: as BF16 bits where they feed or leave a BF16 GEMM
// (set_bf16_bits_storage), else in float32 arrays holding BF16 values (views marked bf16_values);
// or float32 with model.activation_dtype = fp32. The GEMMs' precision is the backend's BF16 model
// (T-FDPA on the emulator, cuBLASLt BF16 with FP32 accumulation on the GPU).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "emu/backend.hpp"
#include "emu/matmul.hpp"
#include "model/config.hpp"
#include "model/linear.hpp"
#include "model/memory_plan.hpp"

namespace fp4sim::model {

struct ParamTensor {
  std::string name;
  std::vector<int64_t> shape;
  size_t offset;  // into the flat parameter vector
  int64_t numel() const;
};

class Gpt {
 public:
  Gpt(const ModelConfig& cfg, Backend& backend);

  // GPT-2 style initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers),
  // norm weights 1, biases 0. Deterministic in the seed (drawn on the host, then uploaded).
  void init(uint64_t seed);

  // tokens, targets (B,T) host arrays. Returns the mean cross-entropy loss (FP64 sum of the
  // per-row losses on the host); keeps the activations. The cross-entropy op also forms the loss
  // gradient for backward(grad_micro_batches, ...) (crossentropy_softmax_forward_backward: the bits
  // of the forward and backward ops, and the (N,V) probabilities are never stored); a backward with
  // another micro-batch count forms it again from the kept logits (one more pass).
  float forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T,
                int64_t grad_micro_batches = 1);
  // Gradients of the mean loss of the last forward into grads(), scaled by 1 / micro_batches
  // (gradient accumulation: the mean over all micro-batches' tokens): computed from zero, and with
  // accumulate then added to what grads() held (sum + this micro-batch's, DESIGN.md §16).
  void backward(int64_t micro_batches = 1, bool accumulate = false);

  // The low-precision recipe of the block linear layers (issue 5; BF16 until called). The step
  // selects SR streams and the late BF16 switch; call set_step before each forward.
  void set_recipe(const RunConfig& run);
  void set_step(int64_t step);
  // The micro-batch within the step (gradient accumulation): part of every SR stream.
  void set_micro_batch(int64_t micro_batch) { micro_batch_ = micro_batch; }
  // Loss scaling (DESIGN.md §14): the loss gradient, and so every gradient, times s (a power of
  // two: exact); 1 by default. Call before forward (a change after it forms the loss gradient
  // again in backward).
  void set_loss_scale(float s);
  // Forward passes with no backward pass after them (sampling): the linear layers make only their
  // Fprop copies, not the column-wise Wgrad/Dgrad copies a backward pass reads (those block along
  // the rows, 16 or 128 of them, which a sampling window of any length does not fill); the same
  // outputs bit for bit. backward() after such a pass is an error.
  void set_inference(bool on) { inference_ = on; }
  const LinearRecipe& linear_recipe(int64_t layer, int linear) const {
    return recipes_[static_cast<size_t>(layer * kLinearsPerUnit + linear)];
  }
  // The blocks' pattern, one character a block ('*' attention, '-' MLP, 'M' Mamba-2; §11).
  std::string pattern() const;
  // One line per block: which format each GEMM of each linear layer runs in.
  std::string describe_recipe() const;
  // Quantization statistics of the next forward + backward (then off again).
  void collect_stats_once() { collect_stats_ = true; }
  std::vector<QuantStat> take_stats();

  // Every linear layer's tensors in the passes that follow, until set to nullptr (--dump's
  // linears.safetensors): tap(name, what, view) after each Fprop with "x" and "y", after each
  // backward pass with "dy", "dx", "dweight" and (with biases) "dbias" (the gradients as
  // accumulated so far). A pending activation (GELU's forward or backward pass, fused into the
  // quantizer otherwise) is run first so that x or dy exists: the same bits (linear.hpp).
  using LinearTap =
      std::function<void(const std::string& name, const char* what, const TensorView& v)>;
  void set_linear_tap(LinearTap tap) { tap_ = std::move(tap); }

  // The gradients as they complete in the backward passes that follow, until set to nullptr (data
  // parallel training reduces them while the pass goes on, model/data_parallel.hpp):
  // ready(offset) once grads()[offset, num_params()) hold their final values for this pass (with
  // accumulate: summed with the earlier micro-batches'), at falling offsets (the head and ln_f,
  // each block from the last, the embeddings), the last call with 0.
  using GradsReady = std::function<void(int64_t offset)>;
  void set_grads_ready(GradsReady ready) { grads_ready_ = std::move(ready); }

  // FP32 GEMMs instead of the BF16 ones (gradient checks only).
  void set_gemm_precision(GemmPrecision p) { prec_ = p; }
  // BF16 storage as BF16 bits (on by default): the linear layers' inputs (ln_1, the attention
  // output, ln_2; the GELU output where c_proj is all BF16), their outputs qkv (without RoPE), the
  // c_proj outputs and (both MLP linears all BF16) c_fc's, the logits, the Dgrad outputs of
  // all-BF16 linears, and (the BF16 recipe) the weights' bits once a pass are kept as BF16 bits
  // instead of FP32 arrays holding BF16 values (the Backend's *_bf16 / *_bits ops, quantizers
  // reading BF16 input; stores_bits). The same bits either way on the emulator, and on the CUDA
  // backend with CudaOptions::matmul_bf16_epilogue false; with it on (the default) cuBLASLt may
  // pick another algorithm for a BF16 or bias-epilogue output than for the FP32 one, so the sums
  // agree within cuBLASLt's bound, as the CUDA BF16 GEMMs agree with the emulator's (tests). Off:
  // the FP32 arrays.
  void set_bf16_bits_storage(bool on) { bf16_bits_ = on; }

  const ModelConfig& config() const { return cfg_; }
  Backend& backend() const { return be_; }
  size_t num_params() const { return n_params_; }
  // The flat parameter and gradient vectors in the backend's memory (host memory on the emulator).
  // params() on a non-const model is the writable view: taking it marks the BF16 weight shadow
  // stale, so the next forward pass narrows the parameters again (write through it before that
  // pass; a backward pass reads the shadow its forward pass made, the weights it differentiates).
  float* params() {
    ++params_version_;
    return params_.as<float>();
  }
  const float* params() const { return params_.as<float>(); }
  // One AdamW step over the parameter tensors of `segments` (Backend::adamw_update on params()
  // and grads(); m and v [1, n_params], float32 or BF16). Where the BF16 weight shadow is in use
  // and the segments cover every parameter once, the step writes the shadow too (the same bits as
  // the narrowing pass), and the next forward pass makes none.
  void adamw_step(const TensorView& m, const TensorView& v, const std::vector<Segment>& segments,
                  const std::vector<AdamWStep>& steps);
  // The same for Q-AdamW (Backend::qadamw_update): st holds the segments' encoded state.
  void qadamw_step(const QAdamWState& st, const std::vector<Segment>& segments,
                   const std::vector<AdamWStep>& steps, uint64_t seed,
                   const std::vector<uint64_t>& streams);
  float* grads() const { return grads_.as<float>(); }
  std::vector<float> params_to_host() const;
  void params_from_host(const std::vector<float>& host);
  std::vector<float> grads_to_host() const;
  const std::vector<ParamTensor>& tensors() const { return tensors_; }
  // Every parameter tensor's offset and element count in params() / grads(), in tensor order: the
  // segments of Backend::sum_squares and adamw_step.
  std::vector<Segment> tensor_spans() const;
  const ParamTensor& tensor(const std::string& name) const;
  // Bytes of activations kept for the backward pass (backend buffers of the last forward: per-layer
  // activations and saved quantized copies; scratch and gradients excluded).
  size_t saved_activation_bytes() const;
  // Row `row` (0 <= row < B*T) of the logits (B,T,V) of the last forward, as stored (BF16-rounded
  // under BF16 activation storage).
  std::vector<float> logits_row_to_host(int64_t row) const;
  // Where a non-finite value (NaN, Inf) first shows in the last forward pass, for the trainer's
  // stop message: the first parameter tensor holding one ("parameter 'h.0.mlp.c_fc.weight'"), else
  // the first residual-stream tensor holding one, in forward order (the embeddings' output, then
  // each layer's residual after attention and after the MLP), else the logits or the loss.
  std::string first_nonfinite_in_forward() const;

 private:
  enum class BlockKind : uint8_t { Attention, Mlp, Mamba };
  // One block's activations of the last forward pass. Attention: norm = ln_1's output (linear 0's
  // input), qkv, lse (B,NH,T) the per-row log-sum-exp (all the backward pass needs besides y),
  // y = the attention output (linear 1's input). MLP: norm = ln_2's output (linear 2's input),
  // fc = c_fc's output, y = the activation (linear 3's input). res: the residual stream after the
  // block; proj: the block's c_proj output when kept as float32 (read once, by the residual add).
  // Mamba-2 (float32 holding BF16 values, as the SSM ops take): norm = the block norm's output
  // (in_proj's input), zx = in_proj's output [z | x | B | C | dt_raw], xbc = the conv's output,
  // dt (B*T, H) and A (H) from the scan's forward pass, states = the scan's chunk-end states
  // (FP32), sy = the scan's output, grstd (B*T, G) = the gated norm's rstd, y = the gated norm's
  // output (out_proj's input).
  struct BlockActs {
    BackendBuffer norm, mean, rstd, qkv, lse, fc, y, proj, res;
    BackendBuffer zx, xbc, dt, A, states, sy, grstd;
    // x^T of each of the block's linear layers' Wgrad GEMM, quantized in the forward pass when that
    // GEMM is quantized; then the layer's input is not kept: it is written to a scratch buffer
    // shared by all layers (DESIGN.md §9, saved activations in quantized form). The attention
    // output is always kept: the attention backward pass reads it.
    std::unique_ptr<QuantizedCopy> saved_x[2];
    // W's Dgrad copy of each linear layer, from the forward pass's quantize call (linear_forward's
    // save_dgrad_weight), replaced by the next forward pass like saved_x
    std::unique_ptr<QuantizedCopy> saved_w[2];
    // how the last forward stored the block's tensors (Gpt::plan_storage): the inputs of its two
    // linears, qkv / fc, and its c_proj output as BF16 bits
    bool in16[2] = {false, false};
    bool mid16 = false;
    bool proj16 = false;
  };
  struct Block {
    BlockKind kind;
    int64_t layer;  // the recipe unit: h.<layer> (presets) or blocks.<layer> (model.pattern)
    int linear0;    // the unit's index of the block's first linear (0 c_attn, 2 c_fc, 4 in_proj)
  };
  // Whether linear `linear` of layer l keeps its input as BF16 bits in this forward pass: BF16
  // activations and precision; no statistics this step unless all three of its GEMMs are BF16;
  // linear 3 (the activation's output) only with all three BF16 and GELU; linear 5 (out_proj,
  // whose input the gated norm writes as float32) never.
  bool stores_bits(int64_t l, int linear) const;
  // Whether any tensor may be kept as BF16 bits: the switch on, BF16 activations and precision.
  bool bits_on() const { return bf16_bits_ && round_bf16() && prec_ == GemmPrecision::BF16; }
  // The storage of every block's tensors in this forward pass (BlockActs::in16, mid16, proj16).
  void plan_storage();
  // A view of b holding rows x cols as BF16 bits (bits) or as float32 holding BF16 values (float32
  // with model.activation_dtype = fp32), b reallocated only when its size differs (the activation
  // buffers, whose storage may differ between forwards). The view is the writer's: it carries the
  // bf16_values mark where the values are rounded.
  // use: the memory plan's line b counts in (model/memory_plan.hpp).
  TensorView act_view(BackendBuffer& b, int64_t rows, int64_t cols, bool bits, const char* name,
                      const char* use = kUseActivations);
  // A float32 view of b (rows x cols), as stored (no mark), b reallocated to fit.
  TensorView f32(BackendBuffer& b, int64_t rows, int64_t cols, const char* name,
                 const char* use = kUseActivations);
  // b = a new buffer of `bytes` (the old one freed first: its contents are not kept anyway).
  void reallocate(BackendBuffer& b, size_t bytes, const char* use, const char* name);
  // The input of a block's linear `i` (0 or 1): kept in the block's own buffer when the backward
  // pass reads it (a BF16 Wgrad, or the attention output), else in the shared scratch.
  // Its width: d_model, the MLP's d_ff (linear 3) or the Mamba's d_inner (linear 5).
  TensorView linear_input(size_t b, int i);
  TensorView param(const std::string& name) const;
  TensorView param16(const std::string& name) const;
  TensorView grad(const std::string& name) const;
  LinearWeights linear_weights(int64_t l, int linear) const;
  void add(const std::string& name, std::vector<int64_t> shape);
  std::string lname(int64_t l, const char* what) const;
  void allocate_activations(int64_t B, int64_t T);
  int64_t fc_width() const {
    return cfg_.activation == Activation::SwiGLU ? 2 * cfg_.d_ff : cfg_.d_ff;
  }
  NormKind norm_kind() const { return cfg_.norm; }
  AttentionShape attention_shape() const;

  // The storage of activations and activation gradients: rounded to BF16 unless
  // model.activation_dtype = fp32 (DESIGN.md §9).
  bool round_bf16() const { return cfg_.activation_dtype == ActivationStorage::BF16; }
  // x = x + mixer(norm(x)) for block b: in = the residual stream before it. The block's norm
  // output is made here unless norm_done (the block before fused it into its residual add).
  void attention_block_forward(size_t b, const TensorView& in, bool norm_done);
  void mlp_block_forward(size_t b, const TensorView& in, bool norm_done);
  void mamba_block_forward(size_t b, const TensorView& in, bool norm_done);
  // The Mamba-2 op sizes and the views of block b's mixer parameters and gradients.
  SsmShape ssm_shape() const;
  TensorView mamba_param(size_t b, const char* what) const;
  TensorView mamba_grad(size_t b, const char* what) const;
  // A column slice [col, col + cols) of a (B*T, width) float32 view (row stride kept).
  static TensorView columns(TensorView v, int64_t col, int64_t cols);
  // The residual add after block b, fused with the next block's norm where one follows.
  void residual_after(size_t b, const TensorView& in);
  // dx (the residual stream's gradient) += the block's contribution; in: the block's input.
  void attention_block_backward(size_t b, const TensorView& in);
  void mlp_block_backward(size_t b, const TensorView& in);
  void mamba_block_backward(size_t b, const TensorView& in);
  void linear_fwd(int64_t l, int linear, size_t b, const TensorView& out, const TensorView& inp,
                  const ActivationSource* pending_input = nullptr);
  void linear_bwd(int64_t l, int linear, size_t b, const TensorView& dinp, const TensorView& dout,
                  const ActivationSource* pending_dout = nullptr);
  // The Dgrad output of linear i of layer l as the writer's view: BF16 bits where all three of its
  // GEMMs are BF16 with BF16 storage (linear 3 also needs c_fc all BF16 with GELU, whose fused
  // backward pass reads it; linear 5's, which the gated norm's backward pass reads as float32,
  // never), else float32 unrounded (its BF16 storage applied where it is read).
  TensorView dgrad_view(int64_t l, int i, int64_t width);
  // The residual stream entering block b (the embeddings' output for block 0; b = the block count:
  // the last block's output), as stored.
  TensorView stream_in(size_t b);
  // One norm's views: its parameters and gradients by name prefix ("h.3.ln_1", "ln_f"), its saved
  // mean (LayerNorm only: absent for RMSNorm, as the bias) and rstd; block b's own norm.
  struct NormViews {
    TensorView weight, bias, dweight, dbias, mean, rstd;
  };
  NormViews norm_views(const std::string& pre, BackendBuffer& mean, BackendBuffer& rstd);
  NormViews block_norm(size_t b);
  // Block b's norm parameters' name prefix: h.<l>.ln_1 / h.<l>.ln_2 (presets), blocks.<i>.norm.
  std::string norm_name(size_t b) const;
  // out = the norm of `in`; dx (dx_view) += its input gradient from dout, the parameter gradients
  // accumulated.
  void norm_forward(const NormViews& n, const TensorView& out, const TensorView& in);
  void norm_backward(const NormViews& n, const TensorView& dout, const TensorView& in);
  // Block b's c_proj output as its writer's view (BF16 bits in the shared scratch, or the block's
  // float32 array), read once by the residual add.
  TensorView proj_view(size_t b);
  // The residual stream's gradient (float32; bf16_values under BF16 storage: rounded where
  // written).
  TensorView dx_view();

  ModelConfig cfg_;
  Backend& be_;
  RunConfig run_;
  bool has_recipe_ = false;
  std::vector<bool> high_precision_;
  std::vector<Block> blocks_;
  // the linear inputs that are not kept, by linear index (0, 2, 3, 4, 5; float32 or BF16 bits)
  BackendBuffer scratch_in_[kLinearsPerUnit], scratch16_in_[kLinearsPerUnit];
  BackendBuffer proj16_;   // the c_proj outputs as BF16 bits until the residual add reads them
  bool logits16_ = false;  // the last forward kept the logits as BF16 bits
  // The parameters' BF16 bits, current while a forward or backward pass runs (WeightShadow: made at
  // the pass's start unless the optimizer step wrote them). The BF16 recipe only: every BF16 GEMM
  // reads its weights from them (LinearWeights::weight16).
  BackendBuffer params16_;
  // The BF16 shadow as a step's params16 where `segments` cover every parameter once and the
  // shadow is in use (then marked current), else an absent view.
  TensorView shadow_for_step(const std::vector<Segment>& segments);
  bool shadow_live_ = false;  // a pass is running with params16_ current
  // params() hands out writable views (params_version_ counts them); params16_ holds the bits of
  // the version shadow_version_ (none when it differs: the shadow is remade)
  uint64_t params_version_ = 0, shadow_version_ = ~uint64_t{0};
  bool uses_weight_shadow()
      const;  // the BF16 recipe with BF16 bits: every matmul reads BF16 weights
  class WeightShadow {
   public:
    explicit WeightShadow(Gpt& m);
    ~WeightShadow() { m_.shadow_live_ = false; }
    WeightShadow(const WeightShadow&) = delete;
    WeightShadow& operator=(const WeightShadow&) = delete;

   private:
    Gpt& m_;
  };
  std::vector<LinearRecipe> recipes_;  // [layer * kLinearsPerUnit + linear]
  int64_t step_ = 0, micro_batch_ = 0;
  bool collect_stats_ = false, stats_active_ = false;
  bool inference_ = false, inference_pass_ = false;  // (set_inference; the last forward pass's)
  std::vector<QuantStat> stats_;
  GemmPrecision prec_ = GemmPrecision::BF16;
  LinearTap tap_;
  GradsReady grads_ready_;
  std::vector<int64_t> block_offset_;  // each block's first parameter's offset
  int64_t tail_offset_ = 0;            // ln_f's (ln_f and the untied head come last)
  bool bf16_bits_ = true;
  std::vector<ParamTensor> tensors_;
  size_t n_params_ = 0;
  BackendBuffer params_, grads_;
  BackendBuffer grad_sum_;  // the earlier micro-batches' gradients (backward with accumulate)
  // activations of the last forward, sized for (B_, T_)
  int64_t B_ = 0, T_ = 0, alloc_B_ = 0, alloc_T_ = 0;
  // the batch's tokens then its targets (2N int32, one upload a forward pass), the positions i % T
  // (uploaded when the buffers are sized)
  BackendBuffer batch_, pos_;
  std::vector<int32_t> host_batch_;
  TensorView tokens_view() const;
  TensorView targets_view() const;
  int64_t dlosses_for_ = 0;  // the micro-batch count dlosses_ holds S/(N * count) for (0: none)
  float loss_scale_ = 1.0f;  // S of set_loss_scale
  BackendBuffer emb_, lnf_, lnf_mean_, lnf_rstd_, logits_, losses_;
  int64_t dlogits_micro_batches_ = 0;  // the micro-batch count dlogits_ was formed for (0: none)
  // dlogits_ (and losses_) from the kept logits, for the mean over micro_batches micro-batches
  void loss_gradient(int64_t micro_batches);
  std::vector<BlockActs> acts_;  // one a block
  // backward scratch
  BackendBuffer dlosses_, dlogits_, dlnf_, dx_, dfc_, dqkv_;
  // the Mamba-2 blocks' backward scratch: the in_proj output's gradient, the conv output's, the
  // scan output's
  BackendBuffer dzx_, dxbc_, dsy_;
  // the Dgrad outputs of linears 0..5 as float32 or BF16 bits (dgrad_view)
  BackendBuffer dinp_[kLinearsPerUnit], dinp16_[kLinearsPerUnit];
};

}  // namespace fp4sim::model
