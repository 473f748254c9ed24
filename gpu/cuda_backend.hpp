// The CUDA backend: the same ops as emu::CpuBackend, same names and argument order, bit-identical
// results for the quantizers (they call the same host/device block functions).
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <utility>

#include "emu/backend.hpp"
#include "gpu/device_scratch.hpp"

namespace fp4sim::gpu {

struct CublasLtState;
std::shared_ptr<CublasLtState> make_cublaslt_state();
void gemm_cublaslt_launch(CublasLtState& st, const QuantizedView& a, const QuantizedView& b,
                          const float* c, const GemmConfig& cfg, void* out, cudaStream_t stream);
void fp8_gemm_cublaslt_launch(CublasLtState& st, const QuantizedView& a, const QuantizedView& b,
                              const float* c, const GemmConfig& cfg, void* out,
                              cudaStream_t stream);

// D_rm [M, N] = alpha * A_rm [M, K] * B_rm [N, K]^T (+ beta * C), BF16 operands, FP32 output.
void bf16_gemm_tn(CublasLtState& st, const uint16_t* a, const uint16_t* b, const float* c, float* d,
                  int64_t M, int64_t N, int64_t K, float alpha, float beta, cudaStream_t stream);

// The same GEMM with alpha and beta as host (Host) or device (Device) scalars. The FP4 path on
// Hopper uses Device: alpha' comes from the operands' amax on the device.
enum class Bf16Scalars { Host, Device };
void bf16_gemm_tn_scalars(CublasLtState& st, Bf16Scalars mode, const uint16_t* a, const uint16_t* b,
                          const float* c, float* d, int64_t M, int64_t N, int64_t K,
                          const float* alpha, const float* beta, cudaStream_t stream);

// The head sizes the attention kernels are instantiated for (gpu/attention.cu: a template
// argument).
constexpr bool attention_head_dim_supported(int64_t hd) {
  return hd == 16 || hd == 32 || hd == 64 || hd == 128;
}

bool gpu_available();
std::string describe_gpu();
// The cuBLASLt library loaded at run time, "major.minor.patch" (cublasLtGetVersion).
std::string cublaslt_version();

class CudaBackend final : public Backend {
 public:
  CudaBackend();
  ~CudaBackend() override;
  std::string name() const override { return "cuda"; }
  Device device() const override { return Device::Cuda; }
  void* allocate(size_t bytes) override;
  void release(void* p) override;
  void upload(void* dst, const void* host_src, size_t bytes) override;
  void download(void* host_dst, const void* src, size_t bytes) override;
  void synchronize() override;
  void zero(void* p, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;

  void quantize(const TensorView& x, const QuantizeConfig& cfg, QuantizedView* rowwise,
                QuantizedView* columnwise) override;
  // cuBLASLt on a GPU without FP4 tensor cores (compute capability < 10) multiplies the FP4
  // formats as decoded BF16; the quantizer writes that decode when a view asks (decoded_bf16).
  bool decodes_for_gemm(GemmImpl impl) const override {
    return impl == GemmImpl::CublasLt && cc_major_ < 10;
  }
  bool fp8_scales_for_gemm(GemmImpl impl) const override { return impl == GemmImpl::CublasLt; }
  void dequantize(const QuantizedView& q, const TensorView& out) override;
  QuantErrorSums quant_error_sums(const float* x, const QuantizedView& q) override;
  void scales_to_tiled(const uint8_t* scales, int64_t rows, int64_t k_blocks,
                       uint8_t* out) override;
  void gemm(const QuantizedView& a, const QuantizedView& b, const TensorView* c,
            const GemmConfig& cfg, const TensorView& d) override;

  // training-stack ops (gpu/norm.cu, matmul.cu, attention.cu, elementwise.cu, cross_entropy.cu,
  // embedding.cu, optim.cu): the names, argument orders and semantics of the emu/ headers of the
  // same stems and emu/optim.hpp, on device pointers, on stream_.
  void embedding_forward(float* out, const int32_t* tokens, const int32_t* pos, const float* wte,
                         const float* wpe, int64_t N, int64_t C) override;
  void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                          const int32_t* pos, int64_t N, int64_t C) override;
  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                         const float* weight, const float* bias, int64_t N, int64_t C,
                         bool round_bf16) override;
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                          const float* inp, const float* weight, const float* mean,
                          const float* rstd, int64_t N, int64_t C, bool round_bf16,
                          bool bf16_dout) override;
  void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                       int64_t C, bool round_bf16) override;
  void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                        const float* weight, const float* rstd, int64_t N, int64_t C,
                        bool round_bf16, bool bf16_dout) override;
  void matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                      int64_t N, int64_t K, int64_t OC, emu::GemmPrecision prec,
                      bool round_bf16) override;
  void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                       const float* inp, const float* weight, int64_t N, int64_t K, int64_t OC,
                       emu::GemmPrecision prec) override;
  // (BF16 precision: the GEMMs read dout as it is, no conversion pass)
  void matmul_backward_bf16_dout(float* dinp, float* dweight, const uint16_t* dout,
                                 const float* inp, const float* weight, int64_t N, int64_t K,
                                 int64_t OC, emu::GemmPrecision prec) override;
  // attention: FlashAttention-2 kernels on mma.sync (gpu/attention.cu)
  // (prec must be BF16: the kernels' operands are BF16)
  void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t NH,
                         int64_t NKV, int64_t HD, emu::GemmPrecision prec,
                         bool round_bf16) override;
  void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                          const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                          int64_t HD, emu::GemmPrecision prec, bool round_bf16) override;
  void rope_forward(float* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HD) override;
  void rope_backward(float* dqkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                     int64_t HD) override;
  void gelu_forward(float* out, const float* inp, int64_t n, bool round_bf16) override;
  void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n, bool round_bf16,
                     bool bf16_dout) override;
  void squared_relu_forward(float* out, const float* inp, int64_t n, bool round_bf16) override;
  void squared_relu_backward(float* dinp, const float* inp, const float* dout, int64_t n,
                             bool round_bf16, bool bf16_dout) override;
  void swiglu_forward(float* out, const float* inp, int64_t N, int64_t F, bool round_bf16) override;
  void swiglu_backward(float* dinp, const float* inp, const float* dout, int64_t N, int64_t F,
                       bool round_bf16, bool bf16_dout) override;
  void bias_forward(float* out, const float* bias, int64_t N, int64_t OC, bool round_bf16) override;
  void bias_backward(float* dbias, const float* dout, int64_t N, int64_t OC) override;
  // FP8 with a column-wise copy: the quantizer's tile pass also takes the 64-row partial column
  // sums (gpu/fp8.cu); otherwise Backend's quantize then bias_backward. The same bits either way.
  void quantize_with_bias_backward(const TensorView& x, const QuantizeConfig& cfg,
                                   QuantizedView* rowwise, QuantizedView* columnwise,
                                   float* dbias) override;
  // FP8 (both copies or either, whole 128-row tiles where a column-wise copy or dbias is made): the
  // activation computed inside the quantizer's tile pass, src.out never written; otherwise
  // Backend's composition. The same bits either way.
  void quantize_activation(const ActivationSource& src, const QuantizeConfig& cfg,
                           QuantizedView* rowwise, QuantizedView* columnwise,
                           float* dbias) override;
  // BF16 precision: GELU's pass writes the GEMM's BF16 operand too (forward) or instead of the
  // gradient (backward, with a bias: with the bias gradient's sums); else Backend's composition.
  void matmul_forward_activation(float* out, uint16_t* out16, const ActivationSource& src,
                                 const float* weight, const float* bias, int64_t OC,
                                 emu::GemmPrecision prec, bool round_bf16) override;
  void matmul_backward_activation(float* dinp, float* dweight, float* dbias,
                                  const ActivationSource& src, const float* inp,
                                  const float* weight, int64_t K, emu::GemmPrecision prec) override;
  // BF16-stored activations (Backend's *_bf16 / *_bits ops): read and written as BF16 bits
  // directly. A GEMM writing bits: cuBLASLt's BF16 output where it has no bias (the logits, the
  // Dgrads); with a bias, FP32 with the bias added in cuBLASLt's epilogue, then one narrowing pass
  // (cuBLASLt 13.1 on Hopper lists no algorithm for a BF16 output with an FP32 bias:
  // last_matmul_epilogue_refusal). set_matmul_bf16_epilogue turns both off.
  void set_bf16_weight_shadow(const float* base, const uint16_t* shadow, int64_t n) override;
  void narrow_to_bf16(uint16_t* dst, const float* src, int64_t n) override;
  void widen_bf16(float* dst, const uint16_t* src, int64_t n) override;
  void bias_forward_bf16(uint16_t* out16, float* x, const float* bias, int64_t N,
                         int64_t OC) override;
  void layernorm_forward_bf16(uint16_t* out, float* mean, float* rstd, const float* inp,
                              const float* weight, const float* bias, int64_t N,
                              int64_t C) override;
  void rmsnorm_forward_bf16(uint16_t* out, float* rstd, const float* inp, const float* weight,
                            int64_t N, int64_t C) override;
  void matmul_forward_bf16(float* out, uint16_t* out16, const float* inp, const uint16_t* inp16,
                           const float* weight, const float* bias, int64_t N, int64_t K, int64_t OC,
                           bool round_bf16) override;
  void matmul_backward_bf16_input(float* dinp, float* dweight, float* dbias, const float* dout,
                                  const uint16_t* inp16, const float* weight, int64_t N, int64_t K,
                                  int64_t OC) override;
  void matmul_backward_activation_bf16_input(float* dinp, float* dweight, float* dbias,
                                             const ActivationSource& src, const uint16_t* inp16,
                                             const float* weight, int64_t K) override;
  void attention_forward_bf16(float* out, uint16_t* out16, float* lse, const float* qkv,
                              const uint16_t* qkv16, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                              int64_t HD, bool round_bf16) override;
  void attention_backward_bf16(float* dqkv, uint16_t* dqkv16, const float* dout,
                               const uint16_t* dout16, const float* qkv, const uint16_t* qkv16,
                               const float* out, const uint16_t* out16, const float* lse, int64_t B,
                               int64_t T, int64_t NH, int64_t NKV, int64_t HD,
                               bool round_bf16) override;
  void matmul_backward_bits(float* dinp, uint16_t* dinp16, float* dweight, float* dbias,
                            const float* dout, const uint16_t* dout16, const ActivationSource* src,
                            const float* inp, const uint16_t* inp16, const float* weight, int64_t N,
                            int64_t K, int64_t OC) override;
  void layernorm_backward_bits(float* dinp, float* dweight, float* dbias, const uint16_t* dout16,
                               const float* inp, const float* weight, const float* mean,
                               const float* rstd, int64_t N, int64_t C, bool round_bf16) override;
  void rmsnorm_backward_bits(float* dinp, float* dweight, const uint16_t* dout16, const float* inp,
                             const float* weight, const float* rstd, int64_t N, int64_t C,
                             bool round_bf16) override;
  void residual_forward_bf16(float* out, const float* a, const uint16_t* b16, int64_t n,
                             bool round_bf16) override;
  void residual_layernorm_forward_bf16(float* res, uint16_t* out, float* mean, float* rstd,
                                       const float* a, const uint16_t* b16, const float* weight,
                                       const float* bias, int64_t N, int64_t C,
                                       bool round_bf16) override;
  void round_to_bf16(float* x, int64_t n) override;
  void residual_forward(float* out, const float* a, const float* b, int64_t n,
                        bool round_bf16) override;
  void crossentropy_softmax_forward(float* losses, float* probs, const float* logits,
                                    const int32_t* targets, int64_t N, int64_t V,
                                    bool bf16_logits) override;
  void crossentropy_softmax_backward(float* dlogits, const float* probs, const int32_t* targets,
                                     const float* dlosses, int64_t N, int64_t V,
                                     bool round_bf16) override;
  void crossentropy_softmax_forward_backward(float* losses, float* dlogits, const float* logits,
                                             const int32_t* targets, const float* dlosses,
                                             int64_t N, int64_t V, bool round_bf16) override;
  void crossentropy_softmax_forward_backward_bf16(float* losses, uint16_t* dlogits,
                                                  const float* logits, const int32_t* targets,
                                                  const float* dlosses, int64_t N,
                                                  int64_t V) override;
  void crossentropy_softmax_forward_backward_bits(float* losses, uint16_t* dlogits,
                                                  const uint16_t* logits16, const int32_t* targets,
                                                  const float* dlosses, int64_t N,
                                                  int64_t V) override;
  void adamw_update(float* params, const float* grads, float* m, float* v, int64_t n,
                    const AdamWStep& step) override;
  void adamw_update_many(float* params, const float* grads, float* m, float* v,
                         const std::vector<int64_t>& offsets, const std::vector<int64_t>& counts,
                         const std::vector<AdamWStep>& steps) override;
  void adamw_update_many_bf16(float* params, uint16_t* params16, const float* grads, float* m,
                              float* v, const std::vector<int64_t>& offsets,
                              const std::vector<int64_t>& counts,
                              const std::vector<AdamWStep>& steps) override;
  double sum_squares(const float* x, int64_t n) override;
  void sum_squares_many(const float* base, const std::vector<int64_t>& offsets,
                        const std::vector<int64_t>& counts, double* sums) override;

  // Device memory in use now (total - free, all processes), for the trainer's peak report.
  int64_t device_memory_used() const override;
  bool supports_attention_head_dim(int64_t hd) const override {
    return attention_head_dim_supported(hd);
  }

  cudaStream_t stream() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
  bool stream_ordered_ = false;  // allocate/release through the device's memory pool on stream_
  int cc_major_ = 0;             // compute capability of the device
  std::shared_ptr<CublasLtState> cublaslt_;  // created on first use
  DeviceScratch
      rht_keep_;  // the RHT column-wise copy's transformed input between the quantizer's passes
  DeviceScratch fp8_split_ws_;  // the wgmma FP8 GEMM's split-K partial sums
  unsigned* amax_ws_ =
      nullptr;  // the quantizer's amax workspace (quantize_launch), zeroed at creation

  // The training ops' own cuBLASLt handle and workspace, scratch buffers and RoPE table
  // (gpu/layers_state.hpp). shared_ptr: the type is complete only where that header is included.
  struct LayersState;
  std::shared_ptr<LayersState> layers_;  // created on first use
  LayersState& layers_state();
  void adamw_many(float* params, uint16_t* p16, const float* grads, float* m, float* v,
                  const std::vector<int64_t>& offsets, const std::vector<int64_t>& counts,
                  const std::vector<AdamWStep>& steps);
  // matmul_backward's two GEMMs from dy, dout as the GEMMs read it (gpu/matmul.cu); inp16: the
  // input as BF16 bits instead of inp (BF16 precision)
  void matmul_backward_gemms(float* dinp, float* dweight, const void* dy, const float* inp,
                             const float* weight, int64_t N, int64_t K, int64_t OC,
                             emu::GemmPrecision prec, const uint16_t* inp16 = nullptr);
  // set_bf16_weight_shadow's range, and a weight's GEMM operand through it (gpu/matmul.cu)
  const float* shadow_base_ = nullptr;
  const uint16_t* shadow_ = nullptr;
  int64_t shadow_n_ = 0;
  const void* weight_operand(DeviceScratch& scratch, const float* weight, int64_t count,
                             emu::GemmPrecision prec);
  // GELU's backward pass as the BF16 GEMMs' operand, with dbias's chunk sums (gpu/matmul.cu)
  const uint16_t* gelu_backward_operand(const ActivationSource& src, float* dbias);
  void
  init_device();  // the constructor's part after the stream exists (pool, capability, workspace)
};

std::unique_ptr<Backend> make_cuda_backend();

// Kernel launchers (gpu/quantize.cu), on `stream`, device pointers. amax_ws: 3 zeroed unsigned ints
// of device memory used by no other stream (the amax pass leaves them zero again). rht_keep (may
// be null): scratch for the RHT-transformed input (BF16, transposed: cols x rows), written by the
// amax pass and read by the quantize pass instead of transforming every element a second time.
// column_partial (may be null): where the RHT amax pass is the pipelined kernel and x is FP32 with
// rows % 64 == 0, x's 64-row chunk column sums [rows / 64, cols] (emu::bias_backward's partial
// sums, for column_sums_finalize) are written there too; returns whether they were.
bool quantize_launch(const TensorView& x, const QuantizeConfig& cfg, QuantizedView* rowwise,
                     QuantizedView* columnwise, cudaStream_t stream, unsigned* amax_ws,
                     DeviceScratch* rht_keep = nullptr, float* column_partial = nullptr);
// Benchmark knob: whether the common-case quantizer keeps the RHT output between its passes (1) or
// transforms twice (0: the amax pass then takes only max |rht(x)|, one rounding a chunk). The
// default (kQuantizeKeepRhtAuto) transforms BF16 input twice and keeps FP32 input's output, as
// measured on the H200 (2026-12-01, row RN + column RHT + SR): 8192^2 BF16 169 us twice against 209
// kept; the training step's FP32 16384 x 768 54.2 against 52.0 kept, 16384 x 3072 175 against 188,
// and gpt2-124m nvfp4 with every FP32 copy twice 286,827 tok/s against 291,143 before. Results are
// identical.
constexpr int kQuantizeKeepRhtAuto = -1;
constexpr int kQuantizeKeepRhtDefault = kQuantizeKeepRhtAuto;
void set_quantize_keep_rht(int keep);
// Benchmark knob: the common-case quantize pass is launched as a programmatic dependent of the amax
// pass (default), so its CTAs load their tiles while the amax pass's last CTAs finish, or after it
// as an ordinary launch. Same bits.
void set_quantize_early_launch(bool early);
// Benchmark knob: 16-byte loads a thread keeps in flight in the contiguous amax pass, 1 or 4
// (default). Same bits.
void set_quantize_amax_unroll(int loads);
// Benchmark knob: the streaming kernel that writes both copies from the kept RHT transform runs
// at most `ctas` CTAs per SM and copy, each thread looping over several 1x16 blocks (default 8);
// 0 = one block a thread (as before). Same bits.
void set_quantize_kept_ctas_per_sm(int ctas);
// Benchmark and test knob: the RHT amax pass, 0 = one 64-row tile a CTA, 1 = one 32-row tile a CTA,
// 2 = persistent CTAs with cp.async double buffering where cols % 128 == 0, rows % 32 == 0 and
// rows are 16-byte aligned, else 1 (default). Same bits.
void set_quantize_rht_amax_variant(int variant);
// Test knob: the kernel of NVFP4 2D copies without Four Over Six or RHT, 1 = one 16x16 block per
// half-warp (default; rows and cols multiples of 16, 16-byte aligned rows), 0 = the general tile
// kernel. Same bits.
void set_quantize_2d_variant(int variant);
// Benchmark knob: the common-case quantize kernel's tile, 1 = 64x128 (default; whole tiles write
// their column-wise codes through shared memory), 2 = 64x256 (BF16 input), 3 = 64x128 with each
// thread storing its column's codes itself. Results are identical; only speed differs.
void set_quantize_tile_variant(int variant);
void gemm_exact_launch(const QuantizedView& a, const QuantizedView& b, const float* c,
                       const GemmConfig& cfg, void* out, cudaStream_t stream);
// Benchmark knob: the exact GEMM kernel, 0 = one thread per output (reference), 1 = tiled,
// 2 = tiled with the lean core, 3 and 4 = 2 at 3 or 4 CTAs per SM, 5 = 4 with fewer integer
// operations per output, 6 = 5 scaling the terms by exponent addition (18.9 TFLOP/s at 8192^3 on
// the H200), 7 = 6 with per-row shared-memory records and all-zero groups folded into the exponents
// (the default: 20.4 TFLOP/s), 8 = 6 with the records only (19.0), 9 = 7 at 3 CTAs per SM (19.1);
// validation/perf.md has the measurements. Results are identical; only speed differs.
constexpr int kGemmExactDefaultVariant = 7;
void set_gemm_exact_variant(int variant);
// Benchmark knob: which of the cuBLASLt heuristic's algorithms a GEMM plan built from now on uses
// (kPlanOwnPick, the default: the plan's own choice, gpu/gemm_cublaslt.cu fp8_preferred_algo and
// bf16_preferred_algo; 0..kMaxHeuristicPick: that index of the list, where a plan fails if the list
// is shorter). Results may differ in the last bits (cuBLASLt's order of summation); speed differs.
constexpr int kPlanOwnPick = -1;
// Whether the plans' heuristic-index rules (gpu/gemm_cublaslt.cu fp8_preferred_algo and
// bf16_preferred_algo, gpu/matmul.cu matmul_preferred_algo) apply: they index the heuristic list of
// the release they were measured on, cuBLASLt 13.1.x on Hopper (compute capability 9.x).
bool cublaslt_picks_measured_here(int cc_major, size_t lt_version);
constexpr int kMaxHeuristicPick = 15;
void set_cublaslt_heuristic_pick(int index);
// Test knob: the Hopper FP4 path's decode of an operand without its decoded copy, 1 = flat over
// both operands' code words, warp-coalesced (default, where the buffers are aligned), 0 = 8
// elements a thread, a grid row per tensor row. Same bits.
void set_fp4_decode_variant(int variant);
// Test hook: what the most recently built cuBLASLt GEMM plan (gpu/gemm_cublaslt.cu) chose.
// rules_active: Hopper with cuBLASLt 13.1.x, where fp8_preferred_algo / bf16_preferred_algo apply;
// preferred: the index the rule (or the knob) asked for; found: how many algorithms the heuristic
// returned (at most preferred + 1); used: the index taken (preferred, or 0 where the list is
// shorter).
struct CublasLtPlanPick {
  bool rules_active = false;
  int preferred = -1, found = 0, used = -1;
};
CublasLtPlanPick last_cublaslt_plan_pick();
// Benchmark knob, the same for the training matmuls (CudaBackend::matmul_forward/backward, the BF16
// recipe's Linears and every recipe's output head): kPlanOwnPick, the default, the plan's own
// choice (gpu/matmul.cu matmul_preferred_algo, falling back to the first where the list is
// shorter); 0..kMaxHeuristicPick that index (a matmul fails where the list is shorter). Plans are
// kept per index, so switching back finds the default's again.
void set_matmul_heuristic_pick(int index);
// The training matmuls' rule (gpu/matmul.cu): the heuristic index a plan for lt_matmul's
// column-major m x n x k (A transposed when transa, B when transb) takes, given whether the rules
// apply (rules_active: Hopper with cuBLASLt 13.1.x) and whether the operands are BF16.
int matmul_preferred_algo(bool rules_active, bool bf16, bool transa, bool transb, int64_t m,
                          int64_t n, int64_t k);
// Test hook: what the most recently built training-matmul plan chose (fields as CublasLtPlanPick).
using MatmulPlanPick = CublasLtPlanPick;
MatmulPlanPick last_matmul_plan_pick();
// Test knob: the cross-entropy kernel caches a row of logits in shared memory where it fits (the
// default) or reads them from memory in every pass. Results are identical; only speed differs.
void set_crossentropy_cached(bool on);
void dequantize_launch(const QuantizedView& q, const TensorView& out, cudaStream_t stream);
// Per-row error sums of copy q against x into rows_out[q.rows] (device memory), each row's blocks
// added in order (emu/quant_stats.hpp); block_sums: scratch of q.scale_count() entries.
void quant_error_rows_launch(const float* x, const QuantizedView& q, QuantErrorSums* block_sums,
                             QuantErrorSums* rows_out, cudaStream_t stream);
// Test hook: how many CudaBackend::quantize_with_bias_backward calls took the fused FP8 path (the
// tile pass's column sums) in this process.
uint64_t fused_bias_backward_count();
// Test hook: how many CudaBackend::quantize_activation calls computed the activation inside the FP8
// tile pass (src.out left unwritten) in this process.
uint64_t fused_activation_quantize_count();
// Test hook: how many CudaBackend::matmul_forward_activation / matmul_backward_activation calls
// computed the activation in the pass that makes the BF16 GEMM operand, in this process.
uint64_t fused_activation_matmul_count();
// Test and benchmark knob: whether CudaBackend::quantize_activation, matmul_forward_activation and
// matmul_backward_activation may fuse (default true); off, they run Backend's compositions (the op,
// then the quantizer or the matmul). Results are identical; only speed differs.
void set_activation_fusion(bool on);
// Test and benchmark knob: whether a BF16 matmul writing BF16 bits (matmul_forward_bf16's out16,
// matmul_backward_bits' dinp16) lets cuBLASLt write them (no bias) or add the bias in its epilogue
// (default true, where the bias is 16-byte aligned and cuBLASLt lists an algorithm); off, the GEMM
// writes FP32 through the plans of FP32 outputs, then add_bias_bf16 or a narrowing pass. The same
// rounding (LayersGpu.MatmulBf16EpilogueRoundsLikeAddBias); the accumulation may differ where
// cuBLASLt picks another algorithm for the other output (bounded, as every cuBLASLt GEMM).
void set_matmul_bf16_epilogue(bool on);
// Test hook: how many matmul_forward_bf16 calls with a BF16 output (out16) had cuBLASLt write it
// (and add the bias, as BF16) in its epilogue, in this process.
uint64_t matmul_bf16_epilogue_count();
// Test hook: the last BF16-output or bias-epilogue plan cuBLASLt refused (status, algorithms
// listed, shape), or empty.
std::string last_matmul_epilogue_refusal();
// Test hook: how many BF16 matmul weight operands were read from set_bf16_weight_shadow's bits.
uint64_t weight_shadow_read_count();
// Test hook: how many CudaBackend::matmul_backward calls at BF16 precision took dout's BF16 copy
// and the bias gradient's column sums from one pass (round_to_bf16_column_partial_kernel) in this
// process.
uint64_t fused_matmul_bias_count();
// The FP8 block format (gpu/fp8.cu). amax_ws: as for quantize_launch.
// column_partial (optional; F32 x with a column-wise copy, R % 128 == 0): the kernel also writes
// x's column sums over each 64-row chunk (emu::kColumnChunkRows), [R / 64, C], each from +0 in
// increasing row order, for column_sums_finalize (gpu/column_sums.cu): the bits of bias_backward's
// first pass.
void fp8_quantize_launch(const TensorView& x, const QuantizeConfig& cfg, QuantizedView* rowwise,
                         QuantizedView* columnwise, cudaStream_t stream, unsigned* amax_ws,
                         float* column_partial = nullptr);
// The same tile pass over an activation op's output computed on the way in (src's GELU forward or
// backward, gpu/activation.cuh), never stored: the bits of running the op, then
// fp8_quantize_launch on its dense F32 output. column_partial: as above, over the op's output.
void fp8_quantize_activation_launch(const ActivationSource& src, const QuantizeConfig& cfg,
                                    QuantizedView* rowwise, QuantizedView* columnwise,
                                    cudaStream_t stream, unsigned* amax_ws,
                                    float* column_partial = nullptr);
void fp8_dequantize_launch(const QuantizedView& q, const TensorView& out, cudaStream_t stream);
void fp8_gemm_exact_launch(const QuantizedView& a, const QuantizedView& b, const float* c,
                           const GemmConfig& cfg, void* out, cudaStream_t stream);
// The same exact FP8 GEMM on the tensor cores (gpu/fp8_wgmma.cu, sm_90a wgmma): the bits of
// fp8_gemm_exact_launch where Hopper's FP8 accumulation is what DESIGN.md §7 models. Supported
// (fp8_gemm_wgmma_supported) on a compute capability 9.0 device running this build's sm_90a code
// (a plain sm_90 build has only a trap; asked once per device), with K a multiple of 128, 16-byte
// aligned codes and 4-byte aligned scales. split_ws: cfg.split_k > 1, split_k * M * N floats of
// device scratch.
bool fp8_gemm_wgmma_supported(const QuantizedView& a, const QuantizedView& b);
void fp8_gemm_wgmma_launch(const QuantizedView& a, const QuantizedView& b, const float* c,
                           const GemmConfig& cfg, void* out, float* split_ws, cudaStream_t stream);
// Test and benchmark knob: whether CudaBackend::gemm runs exact FP8 GEMMs on the tensor cores where
// supported (default true) or always with the one-thread-an-output model kernel.
void set_fp8_wgmma(bool on);
bool fp8_wgmma_enabled();
// Test hook: how many FP8 GEMMs ran on the tensor cores (fp8_gemm_wgmma_launch) in this process.
uint64_t fp8_wgmma_gemm_count();
// Test and benchmark knob: whether the FP8 quantizer's whole tiles write their column-wise codes
// and row-wise GEMM-layout scales through shared memory as whole lines (default true) or straight
// from each thread. The bits do not depend on it.
void set_fp8_quantize_staged(bool on);
// Test knob: at most n persistent CTAs for the tensor-core FP8 GEMM (0, the default: one an SM), so
// small GEMMs exercise CTAs that take several work items in turn.
void set_fp8_wgmma_max_ctas(int n);
// Causal attention with grouped KV heads (gpu/attention.cu): FlashAttention-2 kernels on
// mma.sync BF16 -> FP32, the contract of emu/attention.hpp's attention_forward/backward within a
// bound (tests/gpu/test_layers_gpu.cpp). HD in {16, 32, 64, 128}, else std::invalid_argument. dsum
// (B,NH,T): the backward pass's scratch for rowsum(dout * out). qkv16 (and dout16): scratch for the
// BF16 copies of qkv (and dout) the kernels read, as many elements as the FP32 tensors, 16-byte
// aligned.
// The launchers' shape checks (HD, NH/NKV, T's tile count), std::invalid_argument naming `op`:
// callers run them before sizing scratch from the shape.
void attention_check_shape(const char* op, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                           int64_t HD);
// qkv_in16 / out16 / dout_in16 / dqkv16: qkv read / out written / dout read / dqkv written as BF16
// bits instead (Backend::attention_*_bf16; then qkv / out / dout / dqkv is null, and qkv and dout
// are not converted into the scratch; dqkv16 implies round_bf16).
void attention_forward_launch(float* out, uint16_t* out16, float* lse, const float* qkv,
                              const uint16_t* qkv_in16, uint16_t* qkv16, int64_t B, int64_t T,
                              int64_t NH, int64_t NKV, int64_t HD, bool round_bf16,
                              cudaStream_t stream);
void attention_backward_launch(float* dqkv, uint16_t* dqkv16, float* dsum, const float* dout,
                               const uint16_t* dout_in16, const float* qkv,
                               const uint16_t* qkv_in16, const float* out, const uint16_t* out16,
                               const float* lse, uint16_t* qkv16, uint16_t* dout16, void* ds,
                               int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HD,
                               bool round_bf16, cudaStream_t stream);
// The backward pass's dS scratch: attention_ds_scratch_bytes(B, T, NH, HD) bytes (16-byte aligned)
// passed as `ds` make the dK/dV kernel store bf16(dS) and the dQ kernel a plain GEMM over it (the
// same values and sums as recomputing it); 0 where that path is not taken (HD > 64, more than
// 1 GiB of scratch, or set_attention_recompute_dq), and then ds may be null.
int64_t attention_ds_scratch_bytes(int64_t B, int64_t T, int64_t NH, int64_t HD);
// Tests: the cross-entropy kernel's division by the row's sum (one reciprocal a row, then three
// FMAs a quotient) against __fdiv_rn on `pairs` pseudo-random pairs of its fast range: the number
// of quotients that differ in any bit (0 expected).
int64_t ce_division_mismatches(int64_t pairs, uint64_t seed);
// Tests: true makes attention_ds_scratch_bytes 0, so the dQ kernel recomputes dS (to compare the
// two paths); false (the default) restores the stored-dS path.
void set_attention_recompute_dq(bool on);
void scales_to_tiled_launch(const uint8_t* scales, int64_t rows, int64_t k_blocks, uint8_t* out,
                            cudaStream_t stream);

}  // namespace fp4sim::gpu
