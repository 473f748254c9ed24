// The CUDA backend: the same ops as emu::CpuBackend, same names and argument order, bit-identical
// results for the quantizers (they call the same host/device block functions).
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <utility>

#include "emu/backend.hpp"
#include "gpu/capabilities.hpp"
#include "gpu/device_scratch.hpp"

namespace fp4sim::gpu {

// The cuBLASLt heuristic index a plan takes (CudaOptions::cublaslt_heuristic_pick and
// matmul_heuristic_pick): kPlanOwnPick, the plan's own choice, or 0..kMaxHeuristicPick.
constexpr int kPlanOwnPick = -1;
constexpr int kMaxHeuristicPick = 15;
// CudaOptions::quantize_keep_rht's default: keep FP32 input's RHT output, transform BF16 twice.
constexpr int kQuantizeKeepRhtAuto = -1;

// The CUDA backend's tuning options, fixed when it is constructed. "Same bits": the option changes
// only speed; the others say what may differ.
struct CudaOptions {
  // Run on this stream instead of a stream of the backend's own (use_external_stream; the caller's
  // stream outlives the backend, which never destroys it): the Python module runs on the current
  // stream of the tensors it is given (DESIGN.md §15). nullptr with use_external_stream is the
  // legacy default stream.
  bool use_external_stream = false;
  void* external_stream = nullptr;
  // Whether the common-case NVFP4 quantizer keeps the RHT output between its passes (1) or
  // transforms twice (0: the amax pass then takes only max |rht(x)|, one rounding a chunk).
  // kQuantizeKeepRhtAuto (default) transforms BF16 input twice and keeps FP32 input's output, as
  // measured on the H200 (docs/performance.md, row RN + column RHT + SR): 8192^2 BF16 169 us twice
  // against 209 kept; the training step's FP32 16384 x 768 54.2 against 52.0 kept, 16384 x 3072
  // 175 against 188. Same bits.
  int quantize_keep_rht = kQuantizeKeepRhtAuto;
  // The common-case quantize pass is launched as a programmatic dependent of the amax pass (true,
  // default: its CTAs load their tiles while the amax pass's last CTAs finish), or after it as an
  // ordinary launch. Same bits.
  bool quantize_early_launch = true;
  // The streaming kernel that writes both copies from the kept RHT transform runs at most this
  // many CTAs per SM and copy, each thread looping over several 1x16 blocks (default 8); 0: one
  // block a thread. Same bits.
  int quantize_kept_ctas_per_sm = 8;
  // Which of the cuBLASLt heuristic's algorithms a GEMM plan (gpu/gemm_cublaslt.cu) uses:
  // kPlanOwnPick (default) the plan's own choice (fp8_preferred_algo, bf16_preferred_algo);
  // 0..kMaxHeuristicPick that index of the list, where a plan fails if the list is shorter. Not
  // the same bits: cuBLASLt's order of summation may differ in the last bits.
  int cublaslt_heuristic_pick = kPlanOwnPick;
  // The same for the training matmuls (matmul_forward/backward: the BF16 recipe's Linears and
  // every recipe's output head): kPlanOwnPick (default) matmul_preferred_algo's choice (the first
  // where the list is shorter); 0..kMaxHeuristicPick that index (a matmul fails where the list is
  // shorter). Not the same bits, as above.
  int matmul_heuristic_pick = kPlanOwnPick;
  // The cross-entropy kernel caches a row of logits in shared memory where it fits (true,
  // default) or reads them from memory in every pass. Same bits.
  bool crossentropy_cached = true;
  // Whether quantize_activation, matmul_forward_activation and matmul_backward_activation may fuse
  // (true, default); false runs Backend's compositions (the op, then the quantizer or the matmul).
  // Same bits.
  bool activation_fusion = true;
  // Whether a BF16 matmul writing BF16 bits lets cuBLASLt write them (no bias) or add the bias in
  // its epilogue (true, default, where the bias is 16-byte aligned and cuBLASLt lists an
  // algorithm); false: the GEMM writes FP32 through the plans of FP32 outputs, then add_bias_bf16
  // or a narrowing pass. The same rounding (LayersGpu.MatmulBf16EpilogueRoundsLikeAddBias); the
  // accumulation may differ where cuBLASLt picks another algorithm for the other output.
  bool matmul_bf16_epilogue = true;
  // Whether gemm runs exact FP8 GEMMs on the tensor cores where fp8_gemm_wgmma_supported (true,
  // default) or always with the one-thread-an-output model kernel. Same bits.
  bool fp8_wgmma = true;
  // At most this many persistent CTAs for the tensor-core FP8 GEMM (0, default: one an SM), so
  // that small GEMMs exercise CTAs that take several work items in turn. Same bits.
  int fp8_wgmma_max_ctas = 0;
  // Whether the FP8 quantizer's whole tiles write their column-wise codes and row-wise GEMM-layout
  // scales through shared memory as whole lines (true, default) or straight from each thread.
  // Same bits.
  bool fp8_quantize_staged = true;
  // true: attention_ds_scratch_bytes is 0, so the dQ kernel recomputes dS instead of reading the
  // stored bf16(dS) (false, default). Same bits (the same values and sums).
  bool attention_recompute_dq = false;
  // Whether ssm_scan_forward / ssm_scan_backward run the sequential recurrence of gpu/ssm.cu, the
  // emulator's FP32 operations in its order (true: bitwise emu/ssm.cpp's results, a thread block
  // per (batch, head) stepping through T), or the chunked SSD of gpu/ssm_chunked.cu (false,
  // default: GEMMs over chunks of s.chunk steps). Not the same bits: the chunked scan agrees with
  // the emulator within docs/numerics.md's bound ("The chunked SSD on CUDA").
  bool ssm_sequential = false;
};

// What a cuBLASLt GEMM plan chose. rules_active: Hopper with cuBLASLt 13.1.x, where
// fp8_preferred_algo / bf16_preferred_algo / matmul_preferred_algo apply; preferred: the index the
// rule (or the option) asked for; found: how many algorithms the heuristic returned (at most
// preferred + 1); used: the index taken (preferred, or 0 where the list is shorter).
struct CublasLtPlanPick {
  bool rules_active = false;
  int preferred = -1, found = 0, used = -1;
};
using MatmulPlanPick = CublasLtPlanPick;

// What one CudaBackend did (CudaBackend::counters), for tests and benchmarks.
struct CudaCounters {
  // quantize_activation calls with dbias whose tile pass made the column sums (FP8, or the NVFP4
  // RHT amax pass)
  uint64_t fused_bias_backward = 0;
  // quantize_activation calls that computed the activation inside the FP8 tile pass
  uint64_t fused_activation_quantize = 0;
  // matmul_forward_activation / matmul_backward_activation calls that computed the activation in
  // the pass that makes the BF16 GEMM operand
  uint64_t fused_activation_matmul = 0;
  // matmul_backward calls at BF16 precision that took dout's BF16 copy and the bias gradient's
  // column sums from one pass (round_to_bf16_column_partial_kernel)
  uint64_t fused_matmul_bias = 0;
  // BF16 matmul weight operands read as BF16 bits (the model's BF16 weight shadow)
  uint64_t weight_shadow_reads = 0;
  // matmul_forward calls with a BF16 output whose cuBLASLt epilogue wrote it (and added the bias)
  uint64_t matmul_bf16_epilogue = 0;
  // FP8 GEMMs that ran on the tensor cores (fp8_gemm_wgmma_launch)
  uint64_t fp8_wgmma_gemms = 0;
  // the most recently built cuBLASLt GEMM plan's and training-matmul plan's choice
  CublasLtPlanPick last_cublaslt_plan_pick;
  MatmulPlanPick last_matmul_plan_pick;
  // the last BF16-output or bias-epilogue plan cuBLASLt refused (status, algorithms listed,
  // shape), or empty
  std::string last_matmul_epilogue_refusal;
};

struct CublasLtState;
std::shared_ptr<CublasLtState> make_cublaslt_state(int heuristic_pick = kPlanOwnPick);
// What the state's most recently built plan chose.
CublasLtPlanPick cublaslt_last_pick(const CublasLtState& st);
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

// An ActivationSource (emu/backend.hpp) as the kernels take it: each tensor as float32 or BF16
// bits (the *16 pointer, the other null), out's and dout's BF16 storage as flags.
struct ActivationArgs {
  ActivationOp op = ActivationOp::Identity;
  const float* inp = nullptr;
  const float* dout = nullptr;
  float* out = nullptr;
  int64_t rows = 0, cols = 0;
  bool round_bf16 = false;  // out holds BF16 values (written rounded)
  bool bf16_dout = false;   // dout is read rounded
  const char* name = "activation";
  uint16_t* out16 = nullptr;
  const uint16_t* inp16 = nullptr;
  const uint16_t* dout16 = nullptr;
};
ActivationArgs activation_args(const ActivationSource& src);

bool gpu_available();
// cudaSetDevice(device) for this thread; std::invalid_argument naming it where it does not exist.
void set_device(int device);
// Work queued on `consumer` after this waits for the work queued on `producer` so far (an event;
// nothing when they are the same stream).
void stream_wait(void* consumer, void* producer);
std::string describe_gpu();
// The cuBLASLt library loaded at run time, "major.minor.patch" (cublasLtGetVersion).
std::string cublaslt_version();

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const CudaOptions& options = {});
  ~CudaBackend() override;
  const CudaOptions& options() const { return options_; }
  // What this backend did so far (counts and the last plans' picks).
  CudaCounters counters() const;
  void* allocate(size_t bytes) override;
  void release(void* p) override;
  void upload(void* dst, const void* host_src, size_t bytes) override;
  void download(void* host_dst, const void* src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void zero(void* p, size_t bytes) override;
  void synchronize() override;
  // Device memory in use now (total - free, all processes), for the trainer's peak report.
  int64_t device_memory_used() const override;
  // cudaMemGetInfo's free memory, plus what this backend's memory pool holds unused (reused by
  // allocate before the pool asks the device for more).
  int64_t device_memory_free() const override;
  // The stream-ordered pool's used and reserved high-water marks (cudaMemPoolAttrUsedMemHigh,
  // cudaMemPoolAttrReservedMemHigh); -1 without memory pools.
  AllocationPeaks allocation_peaks() const override;
  // cuda_supports (gpu/capabilities.hpp) on this device.
  bool supports(Capability c, int64_t arg = 0) const override;

  void quantize(const TensorView& x, const QuantizeConfig& cfg, QuantizedView* rowwise,
                QuantizedView* columnwise) override;
  void dequantize(const QuantizedView& q, const TensorView& out) override;
  QuantErrorSums quant_error_sums(const TensorView& x, const QuantizedView& q) override;
  void gemm(const QuantizedView& a, const QuantizedView& b, const TensorView* c,
            const GemmConfig& cfg, const TensorView& d) override;
  void scales_to_tiled(const uint8_t* scales, int64_t rows, int64_t k_blocks,
                       uint8_t* out) override;

  // The layer ops (emu/backend.hpp), on device views, on stream(): each dispatches on its views'
  // dtypes to the kernels of its family file (gpu/norm.cu, gpu/matmul.cu, ...).
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
  // BF16 precision: cuBLASLt BF16 GEMMs with FP32 accumulation. A BF16 output: cuBLASLt's BF16
  // output where there is no bias; with a bias, FP32 with the bias added in cuBLASLt's epilogue,
  // then one narrowing pass (cuBLASLt 13.1 on Hopper lists no algorithm for a BF16 output with an
  // FP32 bias: CudaCounters::last_matmul_epilogue_refusal); CudaOptions::matmul_bf16_epilogue
  // turns both off.
  void matmul_forward(const TensorView& out, const TensorView& inp, const TensorView& weight,
                      const TensorView& bias, GemmPrecision prec) override;
  void matmul_backward(const TensorView& dinp, const TensorView& dweight, const TensorView& dbias,
                       const TensorView& dout, const TensorView& inp, const TensorView& weight,
                       GemmPrecision prec) override;
  void bias_forward(const TensorView& out, const TensorView& inp, const TensorView& bias) override;
  void bias_backward(const TensorView& dbias, const TensorView& dout) override;
  // FlashAttention-2 kernels on mma.sync (gpu/attention.cu); prec must be BF16.
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
  // One launch for every segment (and the BF16 bits in the same pass where params16 is given).
  void adamw_update(const TensorView& params, const TensorView& params16, const TensorView& grads,
                    const TensorView& m, const TensorView& v, const std::vector<Segment>& segments,
                    const std::vector<AdamWStep>& steps) override;
  // Q-AdamW (gpu/qadamw.cu): one thread a tile, every segment's tiles in one launch a pass.
  void qadamw_update(const TensorView& params, const TensorView& params16, const TensorView& grads,
                     const QAdamWState& st, const std::vector<Segment>& segments,
                     const std::vector<AdamWStep>& steps, uint64_t seed,
                     const std::vector<uint64_t>& streams) override;
  // One round trip for every segment.
  void sum_squares(const TensorView& x, const std::vector<Segment>& segments,
                   double* sums) override;
  // The optimizers' steps (gpu/optim.cu): elementwise kernels on emu/optim.hpp's functions, a
  // tiled transpose, the norm's row sums one thread a row (the emulator's order, bitwise) and the
  // quantile through CUB's radix sort of |x|'s keys; the last two synchronous.
  void axpby(const TensorView& out, float a, const TensorView& x, float b,
             const TensorView& y) override;
  void transpose(const TensorView& out, const TensorView& x) override;
  void clamp(const TensorView& out, const TensorView& x, float bound) override;
  float frobenius_norm(const TensorView& x) override;
  float abs_quantile(const TensorView& x, double q) override;
  // The Mamba-2 mixer's core (gpu/ssm.cu): bitwise emu/ssm.cpp's results, each sum carried by one
  // thread in the emulator's order, except the scan's default, the chunked SSD
  // (gpu/ssm_chunked.cu, CudaOptions::ssm_sequential), within a stated bound. The conv backward
  // pass takes widths up to 8, the scan P and N up to 1024 each.
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
  // LayerNorm with a BF16 output and a BF16 b: one pass over the rows; else the composition.
  void residual_norm_forward(NormKind kind, const TensorView& res, const TensorView& out,
                             const TensorView& mean, const TensorView& rstd, const TensorView& a,
                             const TensorView& b, const TensorView& weight,
                             const TensorView& bias) override;
  // BF16 precision: GELU's pass writes the GEMM's BF16 operand too (forward) or instead of the
  // gradient (backward, with a bias: with the bias gradient's sums); else the composition.
  void matmul_forward_activation(const TensorView& out, const ActivationSource& src,
                                 const TensorView& weight, const TensorView& bias,
                                 GemmPrecision prec) override;
  void matmul_backward_activation(const TensorView& dinp, const TensorView& dweight,
                                  const TensorView& dbias, const ActivationSource& src,
                                  const TensorView& inp, const TensorView& weight,
                                  GemmPrecision prec) override;
  // FP8 (both copies or either, whole 128-row tiles where a column-wise copy or dbias is made): the
  // activation computed inside the quantizer's tile pass, src.out never written, and (Identity
  // with a column-wise copy) dbias from the tile pass's column sums; else the composition.
  void quantize_activation(const ActivationSource& src, const QuantizeConfig& cfg,
                           QuantizedView* rowwise, QuantizedView* columnwise,
                           const TensorView& dbias) override;

  cudaStream_t stream() const { return stream_; }

 private:
  CudaOptions options_;
  CudaCounters counters_;  // (the plan picks live in cublaslt_ and layers_; counters() adds them)
  cudaStream_t stream_ = nullptr;
  bool stream_ordered_ = false;  // allocate/release through the device's memory pool on stream_
  int cc_major_ = 0;             // compute capability of the device
  std::shared_ptr<CublasLtState> cublaslt_;  // created on first use
  // the RHT column-wise copy's transformed input between the quantizer's passes
  DeviceScratch rht_keep_{"quantizer RHT output"};
  DeviceScratch fp8_split_ws_{"FP8 GEMM split-K partial sums"};
  unsigned* amax_ws_ =
      nullptr;  // the quantizer's amax workspace (quantize_launch), zeroed at creation

  // The training ops' own cuBLASLt handle and workspace, scratch buffers and RoPE table
  // (gpu/layers_state.hpp). shared_ptr: the type is complete only where that header is included.
  struct LayersState;
  std::shared_ptr<LayersState> layers_;  // created on first use
  LayersState& layers_state();
  // adamw_update's launch(es) (gpu/optim.cu); p16 null: no BF16 bits; m and v float32, or BF16
  // bits where bf16_state
  void adamw_many(float* params, uint16_t* p16, const float* grads, void* m, void* v,
                  bool bf16_state, const std::vector<Segment>& segments,
                  const std::vector<AdamWStep>& steps);
  // The matmul family's parts (gpu/matmul.cu): a weight's BF16 GEMM operand (its bits where the
  // view is BF16, else rounded into scratch); matmul_forward and matmul_backward with BF16 views
  // (x16: a BF16 operand made by the caller, in place of inp; src: GELU's fusable backward pass, in
  // place of dout); the two backward GEMMs from dy as the GEMMs read it; GELU's backward pass as
  // the BF16 GEMMs' operand with dbias's chunk sums; dbias += dout's column sums.
  const void* weight_operand(DeviceScratch& scratch, const TensorView& w, GemmPrecision prec);
  void matmul_forward_bits(const TensorView& out, const TensorView& inp, const uint16_t* x16,
                           const TensorView& weight, const TensorView& bias);
  void matmul_backward_bits(const TensorView& dinp, const TensorView& dweight,
                            const TensorView& dbias, const TensorView& dout,
                            const ActivationArgs* src, const TensorView& inp,
                            const TensorView& weight);
  void matmul_backward_gemms(float* dinp, float* dweight, const void* dy, const TensorView& inp,
                             const TensorView& weight, int64_t N, int64_t K, int64_t OC,
                             GemmPrecision prec);
  const uint16_t* gelu_backward_operand(const ActivationArgs& src, float* dbias);
  void bias_backward_launch(float* dbias, const float* dout, int64_t N, int64_t OC);
  // dst (n) = the BF16 bits of src; x (n) rounded to BF16 in place (gpu/elementwise.cu)
  void narrow_to_bf16(uint16_t* dst, const float* src, int64_t n);
  void round_to_bf16(float* x, int64_t n);
  void
  init_device();  // the constructor's part after the stream exists (pool, capability, workspace)
};

std::unique_ptr<Backend> make_cuda_backend(const CudaOptions& options = {});

// Kernel launchers (gpu/quantize.cu), on `stream`, device pointers. amax_ws: 3 zeroed unsigned ints
// of device memory used by no other stream (the amax pass leaves them zero again). rht_keep (may
// be null): scratch for the RHT-transformed input (BF16, transposed: cols x rows), written by the
// amax pass and read by the quantize pass instead of transforming every element a second time.
// column_partial (may be null): where the RHT amax pass is the pipelined kernel and x is FP32 with
// rows % 64 == 0, x's 64-row chunk column sums [rows / 64, cols] (emu::bias_backward's partial
// sums, for column_sums_finalize) are written there too; returns whether they were.
// opt: the quantize_* options.
bool quantize_launch(const TensorView& x, const QuantizeConfig& cfg, QuantizedView* rowwise,
                     QuantizedView* columnwise, cudaStream_t stream, unsigned* amax_ws,
                     DeviceScratch* rht_keep = nullptr, float* column_partial = nullptr,
                     const CudaOptions& opt = {});
void gemm_exact_launch(const QuantizedView& a, const QuantizedView& b, const float* c,
                       const GemmConfig& cfg, void* out, cudaStream_t stream);
// Whether the plans' heuristic-index rules (gpu/gemm_cublaslt.cu fp8_preferred_algo and
// bf16_preferred_algo, gpu/matmul.cu matmul_preferred_algo) apply: they index the heuristic list of
// the release they were measured on, cuBLASLt 13.1.x on Hopper (compute capability 9.x).
bool cublaslt_picks_measured_here(int cc_major, size_t lt_version);
// The training matmuls' rule (gpu/matmul.cu): the heuristic index a plan for lt_matmul's
// column-major m x n x k (A transposed when transa, B when transb) takes, given whether the rules
// apply (rules_active: Hopper with cuBLASLt 13.1.x) and whether the operands are BF16.
int matmul_preferred_algo(bool rules_active, bool bf16, bool transa, bool transb, int64_t m,
                          int64_t n, int64_t k);
void dequantize_launch(const QuantizedView& q, const TensorView& out, cudaStream_t stream);
// Per-row error sums of copy q against x into rows_out[q.rows] (device memory), each row's blocks
// added in order (emu/quant_stats.hpp); block_sums: scratch of q.scale_count() entries.
void quant_error_rows_launch(const float* x, const QuantizedView& q, QuantErrorSums* block_sums,
                             QuantErrorSums* rows_out, cudaStream_t stream);
// The FP8 block format (gpu/fp8.cu). amax_ws: as for quantize_launch. staged: as
// CudaOptions::fp8_quantize_staged.
// column_partial (optional; F32 x with a column-wise copy, R % 128 == 0): the kernel also writes
// x's column sums over each 64-row chunk (emu::kColumnChunkRows), [R / 64, C], each from +0 in
// increasing row order, for column_sums_finalize (gpu/column_sums.cu): the bits of bias_backward's
// first pass.
void fp8_quantize_launch(const TensorView& x, const QuantizeConfig& cfg, QuantizedView* rowwise,
                         QuantizedView* columnwise, cudaStream_t stream, unsigned* amax_ws,
                         float* column_partial = nullptr, bool staged = true);
// The same tile pass over an activation op's output computed on the way in (src's GELU forward or
// backward, gpu/activation.cuh), never stored: the bits of running the op, then
// fp8_quantize_launch on its dense F32 output. column_partial: as above, over the op's output.
void fp8_quantize_activation_launch(const ActivationArgs& src, const QuantizeConfig& cfg,
                                    QuantizedView* rowwise, QuantizedView* columnwise,
                                    cudaStream_t stream, unsigned* amax_ws,
                                    float* column_partial = nullptr, bool staged = true);
void fp8_dequantize_launch(const QuantizedView& q, const TensorView& out, cudaStream_t stream);
void fp8_gemm_exact_launch(const QuantizedView& a, const QuantizedView& b, const float* c,
                           const GemmConfig& cfg, void* out, cudaStream_t stream);
// The same exact FP8 GEMM on the tensor cores (gpu/fp8_wgmma.cu, sm_90a wgmma): the bits of
// fp8_gemm_exact_launch where Hopper's FP8 accumulation is what DESIGN.md §7 models. Supported
// (fp8_gemm_wgmma_supported) on a compute capability 9.0 device running this build's sm_90a code
// (a plain sm_90 build has only a trap; asked once per device), with K a multiple of 128, 16-byte
// aligned codes and 4-byte aligned scales. split_ws: cfg.split_k > 1, split_k * M * N floats of
// device scratch. max_ctas: as CudaOptions::fp8_wgmma_max_ctas.
bool fp8_gemm_wgmma_supported(const QuantizedView& a, const QuantizedView& b);
void fp8_gemm_wgmma_launch(const QuantizedView& a, const QuantizedView& b, const float* c,
                           const GemmConfig& cfg, void* out, float* split_ws, cudaStream_t stream,
                           int max_ctas = 0);
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
// The backward pass's dS scratch: attention_ds_scratch_bytes(B, T, NH, HD) bytes (16-byte aligned;
// gpu/capabilities.hpp) passed as `ds` make the dK/dV kernel store bf16(dS) and the dQ kernel a
// plain GEMM over it (the same values and sums as recomputing it); 0 where that path is not taken
// (HD > 64, more than 1 GiB of scratch, or recompute_dq: CudaOptions::attention_recompute_dq), and
// then ds may be null.
// Tests: the cross-entropy kernel's division by the row's sum (one reciprocal a row, then three
// FMAs a quotient) against __fdiv_rn on `pairs` pseudo-random pairs of its fast range: the number
// of quotients that differ in any bit (0 expected).
int64_t ce_division_mismatches(int64_t pairs, uint64_t seed);
void scales_to_tiled_launch(const uint8_t* scales, int64_t rows, int64_t k_blocks, uint8_t* out,
                            cudaStream_t stream);

}  // namespace fp4sim::gpu
