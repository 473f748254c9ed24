#include "model/memory_plan.hpp"

#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <utility>

#include "emu/fused.hpp"
#include "emu/workspace.hpp"
#include "gpu/capabilities.hpp"
#include "model/config.hpp"
#include "model/data.hpp"
#include "model/data_parallel.hpp"
#include "model/gpt.hpp"
#include "model/optimizer.hpp"

namespace fp4sim::model {
namespace {

namespace fs = std::filesystem;

// Live bytes by line and their total; at the highest total, a copy of the lines and when it was.
class Ledger {
 public:
  void add(const std::string& use, int64_t bytes) {
    if (bytes == 0) return;
    live_[use] += bytes;
    total_ += bytes;
    if (total_ > peak_) {
      peak_ = total_;
      at_peak_ = live_;
      peak_at_ = phase_ + (doing_.empty() ? "" : ": " + doing_);
    }
  }
  void sub(const std::string& use, int64_t bytes) {
    if (bytes == 0) return;
    live_[use] -= bytes;
    total_ -= bytes;
  }
  // bytes held for the time of one op (or one step of the trainer)
  void transient(const std::string& use, int64_t bytes) {
    add(use, bytes);
    sub(use, bytes);
  }
  void set_phase(std::string phase) {
    phase_ = std::move(phase);
    doing_.clear();
  }
  void set_doing(std::string doing) { doing_ = std::move(doing); }
  int64_t peak() const { return peak_; }
  const std::string& peak_at() const { return peak_at_; }
  std::vector<PlanLine> lines_at_peak() const {
    std::vector<PlanLine> out;
    for (const auto& [use, bytes] : at_peak_)
      if (bytes > 0) out.push_back({use, bytes});
    std::stable_sort(out.begin(), out.end(),
                     [](const PlanLine& a, const PlanLine& b) { return a.bytes > b.bytes; });
    return out;
  }

 private:
  std::map<std::string, int64_t> live_, at_peak_;
  int64_t total_ = 0, peak_ = 0;
  std::string phase_, doing_, peak_at_;
};

constexpr int64_t kF32 = 4, kBf16 = 2;

int64_t column_chunks(int64_t rows) {
  return (rows + emu::kColumnChunkRows - 1) / emu::kColumnChunkRows;
}

// A backend that allocates and computes nothing: each allocation is filed in the ledger under its
// label (Backend::allocating) at a distinct address that is never dereferenced; each op adds the
// workspace the target backend takes inside it (emulator: for the op's time; CUDA: its scratch
// buffers grow to the largest need and stay). Fused ops run as the target runs them: composed on
// the emulator (their temporaries allocated here); on CUDA fused where it fuses, else composed.
class PlanningBackend final : public Backend {
 public:
  PlanningBackend(const PlanRequest& req, Ledger& ledger)
      : Backend(req.backend, req.backend == "cuda" ? Device::Cuda : Device::Host),
        cuda_(req.backend == "cuda"),
        opt_(req.cuda),
        caps_(req.run_backend),
        ledger_(ledger),
        threads_(omp_get_max_threads()) {
    if (!caps_ && !cuda_) {
      emu_caps_ = make_cpu_backend();
      caps_ = emu_caps_.get();
    }
  }
  int64_t buffers_peak() const { return buffers_peak_; }
  std::vector<PlanLine> scratch_parts() const {
    std::vector<PlanLine> out;
    for (const auto& [name, bytes] : scratch_)
      if (bytes > 0) out.push_back({name, bytes});
    std::stable_sort(out.begin(), out.end(),
                     [](const PlanLine& a, const PlanLine& b) { return a.bytes > b.bytes; });
    return out;
  }

  void* allocate(size_t bytes) override {
    const BufferLabel* label = allocating();
    const std::string use = label ? label->use : "unlabelled";
    next_ = (next_ + 255) / 256 * 256;  // (cudaMalloc's alignment)
    void* p = reinterpret_cast<void*>(next_);
    next_ += std::max<size_t>(bytes, 1);
    live_[p] = {use, static_cast<int64_t>(bytes)};
    ledger_.set_doing("allocating " + (label && !label->what.empty() ? label->what : use));
    ledger_.add(use, static_cast<int64_t>(bytes));
    buffers_ += static_cast<int64_t>(bytes);
    buffers_peak_ = std::max(buffers_peak_, buffers_);
    return p;
  }
  void release(void* p) override {
    const auto it = live_.find(p);
    if (it == live_.end()) throw std::logic_error("planning backend: release of an unknown buffer");
    ledger_.sub(it->second.first, it->second.second);
    buffers_ -= it->second.second;
    live_.erase(it);
  }
  void upload(void*, const void*, size_t) override {}
  void download(void*, const void*, size_t) override {}
  void copy(void*, const void*, size_t) override {}
  void zero(void*, size_t) override {}
  void synchronize() override {}
  int64_t device_memory_used() const override { return -1; }
  int64_t device_memory_free() const override { return -1; }
  AllocationPeaks allocation_peaks() const override { return {}; }
  bool supports(Capability c, int64_t arg) const override {
    if (caps_) return caps_->supports(c, arg);
    if (c == Capability::SsmChunk && opt_.ssm_sequential) return arg > 0;
    return gpu::cuda_supports(c, arg, opt_.cc_major);
  }

  void quantize(const TensorView& x, const QuantizeConfig& cfg, QuantizedView*,
                QuantizedView*) override {
    op("quantize", x);
    if (!cuda_) return temp(emu::workspace::quantize(x, cfg));
    if (cfg.format == QFormat::FP8) return;
    // (gpu/quantize.cu: the common case keeps the RHT output between its passes)
    const bool common = cfg.format != QFormat::MXFP4 && !cfg.block_2d &&
                        !cfg.rowwise.four_over_six && !cfg.columnwise.four_over_six;
    const bool keep =
        opt_.quantize_keep_rht == -1 ? x.dtype == DType::F32 : opt_.quantize_keep_rht != 0;
    if (cfg.columnwise.enabled && cfg.columnwise.rht && common && keep)
      scratch("quantizer RHT output", x.numel() * kBf16);
  }
  void dequantize(const QuantizedView&, const TensorView&) override {}
  QuantErrorSums quant_error_sums(const TensorView& x, const QuantizedView& q) override {
    op("quant_error_sums", x);
    const int64_t sums = static_cast<int64_t>(sizeof(QuantErrorSums));
    temp(cuda_ ? (q.scale_count() + q.rows) * sums : emu::workspace::quant_error_sums(q));
    return {};
  }
  void gemm(const QuantizedView& a, const QuantizedView& b, const TensorView*,
            const GemmConfig& cfg, const TensorView& d) override {
    op("gemm", d);
    if (!cuda_) return temp(emu::workspace::gemm(a, b));
    const int64_t M = a.rows, N = b.rows, K = a.cols;
    const bool f32_out = d.dtype == DType::F32;
    if (cfg.impl == GemmImpl::CublasLt) {  // (gpu/gemm_cublaslt.cu)
      scratch("the block-scaled GEMMs' cuBLASLt workspace",
              static_cast<int64_t>(gpu::kGemmCublasLtWorkspaceBytes));
      if (!f32_out) scratch("cuBLASLt GEMM FP32 output", M * N * kF32);
      if (a.format == QFormat::FP8) {
        const int64_t kb = K / kFp8Block;
        if (!a.scales_gemm) scratch("cuBLASLt GEMM tiled scales A", M * kb * kF32);
        if (!b.scales_gemm) scratch("cuBLASLt GEMM tiled scales B", N * kb * kF32);
      } else if (opt_.cc_major < 10) {  // (Hopper: BF16 GEMMs over the decoded operands)
        if (!a.decoded_bf16) scratch("cuBLASLt GEMM decoded A", M * K * kBf16);
        if (!b.decoded_bf16) scratch("cuBLASLt GEMM decoded B", N * K * kBf16);
      } else {
        const int64_t kb = K / a.block();
        scratch("cuBLASLt GEMM tiled scales A", tiled_scale_bytes(M, kb));
        scratch("cuBLASLt GEMM tiled scales B", tiled_scale_bytes(N, kb));
      }
    } else if (a.format == QFormat::FP8 && cfg.split_k > 1) {
      scratch("FP8 GEMM split-K partial sums", cfg.split_k * M * N * kF32);
    }
  }
  void scales_to_tiled(const uint8_t*, int64_t, int64_t, uint8_t*) override {}

  void embedding_forward(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                         const TensorView&) override {}
  void embedding_backward(const TensorView&, const TensorView&, const TensorView& dout,
                          const TensorView&, const TensorView&) override {
    op("embedding_backward", dout);
    if (!cuda_) return;
    const int64_t N = dout.rows;  // (gpu/embedding.cu: the rows sorted by token)
    scratch("embedding sort keys", N * 4);
    scratch("embedding rows", N * 4);
    scratch("embedding sorted rows", N * 4);
    // cub::DeviceRadixSort::SortPairs's temporary storage (asked of CUB at run time): its
    // alternate key and value buffers plus a little; estimated
    scratch("embedding sort temp", 2 * N * 4 + (int64_t{1} << 20));
  }
  void norm_forward(NormKind, const TensorView& out, const TensorView&, const TensorView&,
                    const TensorView&, const TensorView&, const TensorView&) override {
    op("norm_forward", out);
    if (!cuda_) temp(emu::workspace::norm_forward(out));
  }
  void norm_backward(NormKind kind, const TensorView& dinp, const TensorView&, const TensorView&,
                     const TensorView& dout, const TensorView& inp, const TensorView&,
                     const TensorView&, const TensorView&) override {
    op("norm_backward", dinp);
    if (!cuda_) return temp(emu::workspace::norm_backward(dout));
    const int64_t lines = kind == NormKind::LayerNorm ? 2 : 1;
    scratch("partial column sums", lines * column_chunks(inp.rows) * inp.cols * kF32);
  }
  void matmul_forward(const TensorView& out, const TensorView& inp, const TensorView& weight,
                      const TensorView& bias, GemmPrecision prec) override {
    op("matmul_forward", out);
    if (!cuda_) return temp(emu::workspace::matmul_forward(out, inp, weight, bias, prec));
    const int64_t N = inp.rows, K = inp.cols, OC = weight.rows;
    matmul_workspace();
    const bool any16 = out.dtype == DType::BF16 || inp.dtype == DType::BF16 ||
                       weight.dtype == DType::BF16 || bias.dtype == DType::BF16;
    if (!any16) {  // (gpu/matmul.cu matmul_forward: both operands rounded into scratch)
      if (prec != GemmPrecision::BF16) return;
      scratch("matmul BF16 operand a", OC * K * kBf16);
      scratch("matmul BF16 operand b", N * K * kBf16);
      return;
    }
    forward_bits(out, inp.dtype == DType::F32 ? N * K : 0, weight, bias);
  }
  void matmul_backward(const TensorView& dinp, const TensorView& dweight, const TensorView& dbias,
                       const TensorView& dout, const TensorView& inp, const TensorView& weight,
                       GemmPrecision prec) override {
    op("matmul_backward", dout);
    if (!cuda_)
      return temp(emu::workspace::matmul_backward(dinp, dweight, dout, inp, weight, prec));
    matmul_workspace();
    const int64_t N = dout.rows, OC = dout.cols, K = weight.cols;
    const bool any16 = dinp.dtype == DType::BF16 || dout.dtype == DType::BF16 ||
                       inp.dtype == DType::BF16 || weight.dtype == DType::BF16;
    if (prec == GemmPrecision::BF16 && any16) {
      backward_bits(dinp, dweight, dbias, dout.dtype == DType::BF16, N, OC, inp, weight);
      return;
    }
    if (dout.dtype == DType::BF16) scratch("matmul widened dout", N * OC * kF32);
    if (prec == GemmPrecision::BF16) scratch("matmul BF16 operand a", N * OC * kBf16);
    if (dbias.present()) scratch("partial column sums", column_chunks(N) * OC * kF32);
    if (prec != GemmPrecision::BF16) return;
    if (dinp.present() && weight.dtype == DType::F32)
      scratch("matmul BF16 operand b", OC * K * kBf16);
    if (dweight.present() && inp.dtype == DType::F32)
      scratch("matmul BF16 operand c", N * K * kBf16);
  }
  void bias_forward(const TensorView& out, const TensorView&, const TensorView& bias) override {
    op("bias_forward", out);
    if (!cuda_) return temp(emu::workspace::bias_forward(out, bias));
    if (bias.dtype == DType::BF16) scratch("bias widened", bias.numel() * kF32);
  }
  void bias_backward(const TensorView& dbias, const TensorView& dout) override {
    op("bias_backward", dbias);
    if (cuda_) scratch("partial column sums", column_chunks(dout.rows) * dout.cols * kF32);
  }
  void attention_forward(const TensorView& out, const TensorView&, const TensorView& qkv,
                         const AttentionShape& s, GemmPrecision prec) override {
    op("attention_forward", out);
    if (!cuda_) return temp(emu::workspace::attention_forward(out, qkv, s, prec, threads_));
    if (qkv.dtype == DType::F32) scratch("attention BF16 qkv", qkv.numel() * kBf16);
  }
  void attention_backward(const TensorView& dqkv, const TensorView& dout, const TensorView& qkv,
                          const TensorView& out, const TensorView&, const AttentionShape& s,
                          GemmPrecision prec) override {
    op("attention_backward", dqkv);
    if (!cuda_)
      return temp(emu::workspace::attention_backward(dqkv, dout, qkv, out, s, prec, threads_));
    scratch("attention dsum", 2 * s.B * s.NH * s.T * kF32);
    if (qkv.dtype == DType::F32) scratch("attention BF16 qkv", qkv.numel() * kBf16);
    if (dout.dtype == DType::F32) scratch("attention BF16 dout", dout.numel() * kBf16);
    scratch("attention stored dS",
            gpu::attention_ds_scratch_bytes(s.B, s.T, s.NH, s.HD, opt_.attention_recompute_dq));
  }
  void rope_forward(const TensorView& qkv, const AttentionShape& s) override { rope(qkv, s); }
  void rope_backward(const TensorView& dqkv, const AttentionShape& s) override { rope(dqkv, s); }
  void activation_forward(Activation, const TensorView&, const TensorView&) override {}
  void activation_backward(Activation, const TensorView& dinp, const TensorView&,
                           const TensorView& dout) override {
    op("activation_backward", dinp);
    if (!cuda_) temp(emu::workspace::activation_backward(dout));
  }
  void convert(const TensorView&, const TensorView&) override {}
  void residual_forward(const TensorView& out, const TensorView&, const TensorView& b) override {
    op("residual_forward", out);
    if (!cuda_) temp(emu::workspace::residual_forward(b));
  }
  void crossentropy_forward_backward(const TensorView&, const TensorView& dlogits,
                                     const TensorView& logits, const TensorView&,
                                     const TensorView&) override {
    op("crossentropy_forward_backward", logits);
    if (!cuda_) temp(emu::workspace::crossentropy(dlogits, logits));
  }
  // (gpu/ssm.cu: the scratch buffers ssm_terms, ssm_states, ssm_contrib, ssm_small, ssm_partials)
  void ssm_conv_forward(const TensorView& out, const TensorView&, const TensorView& weight,
                        const TensorView&, const SsmShape& s) override {
    op("ssm_conv_forward", out);
    if (!cuda_) temp(emu::workspace::ssm_conv_forward(s, weight.cols, threads_));
  }
  void ssm_conv_backward(const TensorView& dinp, const TensorView&, const TensorView&,
                         const TensorView&, const TensorView&, const TensorView& weight,
                         const TensorView&, const SsmShape& s) override {
    op("ssm_conv_backward", dinp);
    if (!cuda_) return temp(emu::workspace::ssm_conv_backward(s, weight.cols, threads_));
    scratch("Mamba per-element terms", s.B * s.T * s.xbc_cols() * kF32);
    scratch("Mamba parameter-gradient partial sums",
            gpu::ssm_partials_floats(s.B * s.T, s.xbc_cols(), weight.cols + 1) * kF32);
  }
  // The CUDA scan: the chunked SSD (default; gpu/capabilities.hpp ssd_chunked_*_scratch), or with
  // CudaPlanOptions::ssm_sequential the sequential twin's buffers (the same scratch buffers).
  void ssm_scan_forward(const TensorView& y, const TensorView& states, const TensorView&,
                        const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                        const TensorView&, const TensorView&, const SsmShape& s) override {
    op("ssm_scan_forward", y);
    if (!cuda_) return temp(emu::workspace::ssm_scan_forward(s, threads_));
    if (opt_.ssm_sequential) return;  // (the sequential forward pass keeps no scratch)
    scratch("Mamba scan chunk intermediates",
            gpu::ssd_chunked_forward_scratch(s, states.present()).states);
  }
  void ssm_scan_backward(const TensorView& dxbc, const TensorView&, const TensorView&,
                         const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                         const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                         const TensorView&, const TensorView&, const TensorView&,
                         const SsmShape& s) override {
    op("ssm_scan_backward", dxbc);
    if (!cuda_) return temp(emu::workspace::ssm_scan_backward(s, threads_));
    if (opt_.ssm_sequential) {  // (gpu/ssm.cu's CudaBackend::ssm_scan_backward, sequential path)
      const int64_t BT = s.B * s.T, BH = s.B * s.H;
      scratch("Mamba scan chunk intermediates", gpu::ssm_scan_backward_state_bytes(s));
      scratch("Mamba scan dB and dC terms", BT * s.H * 2 * s.N * kF32);
      scratch("Mamba scan ddt, dA and sums", (BT * s.H + s.H + 2 * BH) * kF32);
      scratch("Mamba per-element terms", BT * s.H * kF32);
      scratch("Mamba parameter-gradient partial sums", gpu::ssm_partials_floats(BT, s.H, 1) * kF32);
      return;
    }
    const gpu::SsdScratchBytes b = gpu::ssd_chunked_backward_scratch(s);
    scratch("Mamba scan chunk intermediates", b.states);
    scratch("Mamba scan dB and dC terms", b.contrib);
    scratch("Mamba scan ddt, dA and sums", b.small);
    scratch("Mamba per-element terms", b.terms);
    scratch("Mamba parameter-gradient partial sums",
            gpu::ssm_partials_floats(s.B * s.T, s.H, 1) * kF32);
  }
  void gated_norm_forward(const TensorView& out, const TensorView& rstd, const TensorView&,
                          const TensorView&, const TensorView&) override {
    op("gated_norm_forward", out);
    if (!cuda_) temp(emu::workspace::gated_norm_forward(out.cols, rstd.cols, threads_));
  }
  void gated_norm_backward(const TensorView& dinp, const TensorView&, const TensorView&,
                           const TensorView& dout, const TensorView&, const TensorView&,
                           const TensorView&, const TensorView& rstd) override {
    op("gated_norm_backward", dinp);
    if (!cuda_) return temp(emu::workspace::gated_norm_backward(dout, rstd.cols, threads_));
    scratch("Mamba per-element terms", dout.rows * dout.cols * kF32);
    scratch("Mamba parameter-gradient partial sums",
            gpu::ssm_partials_floats(dout.rows, dout.cols, 1) * kF32);
  }
  void adamw_update(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                    const TensorView&, const std::vector<Segment>&,
                    const std::vector<AdamWStep>&) override {}
  void qadamw_update(const TensorView&, const TensorView&, const TensorView&, const QAdamWState&,
                     const std::vector<Segment>&, const std::vector<AdamWStep>&, uint64_t,
                     const std::vector<uint64_t>&) override {}
  void sum_squares(const TensorView&, const std::vector<Segment>& segments, double* sums) override {
    std::fill(sums, sums + segments.size(), 0.0);
  }
  void axpby(const TensorView& out, float, const TensorView&, float, const TensorView&) override {
    op("axpby", out);
  }
  void transpose(const TensorView& out, const TensorView&) override { op("transpose", out); }
  void clamp(const TensorView& out, const TensorView&, float) override { op("clamp", out); }
  float frobenius_norm(const TensorView& x) override {
    if (cuda_) scratch("Frobenius norm row sums", (x.rows + 1) * 8);
    return 1.0f;
  }
  float abs_quantile(const TensorView& x, double) override {
    // (the emulator: the keys in a host vector; the CUDA backend: the keys, sorted keys and
    // CUB's temporary storage, estimated as one more copy)
    if (cuda_)
      scratch("quantile keys", 3 * x.numel() * 4);
    else
      temp(x.numel() * 4);
    return 0.0f;
  }

  void residual_norm_forward(NormKind kind, const TensorView& res, const TensorView& out,
                             const TensorView& mean, const TensorView& rstd, const TensorView& a,
                             const TensorView& b, const TensorView& weight,
                             const TensorView& bias) override {
    // (the CUDA backend's fused and composed cases take no scratch)
    compose_residual_norm_forward(*this, kind, res, out, mean, rstd, a, b, weight, bias);
  }
  void matmul_forward_activation(const TensorView& out, const ActivationSource& src,
                                 const TensorView& weight, const TensorView& bias,
                                 GemmPrecision prec) override {
    const int64_t N = src.rows(), K = src.cols(), OC = weight.rows;
    if (!cuda_ || !opt_.activation_fusion || prec != GemmPrecision::BF16 ||
        src.op != ActivationOp::GeluForward || N == 0 || K == 0 || OC == 0) {
      compose_matmul_forward_activation(*this, out, src, weight, bias, prec);
      return;
    }
    op("matmul_forward_activation", out);
    matmul_workspace();
    // (gpu/matmul.cu: GELU writes the GEMM's BF16 operand into scratch unless src.out is it)
    if (src.out.dtype != DType::BF16) scratch("matmul BF16 operand b", N * K * kBf16);
    if (src.inp.dtype == DType::BF16 && src.out.dtype == DType::BF16)
      scratch("GELU table", int64_t{65536} * kBf16);
    forward_bits(out, 0, weight, bias);
  }
  void matmul_backward_activation(const TensorView& dinp, const TensorView& dweight,
                                  const TensorView& dbias, const ActivationSource& src,
                                  const TensorView& inp, const TensorView& weight,
                                  GemmPrecision prec) override {
    const int64_t N = src.rows(), OC = src.cols(), K = weight.cols;
    const bool fusable = dbias.present() && prec == GemmPrecision::BF16 &&
                         src.op == ActivationOp::GeluBackward && N != 0 && K != 0 && OC != 0 &&
                         OC % 2 == 0;
    if (!cuda_ || !opt_.activation_fusion || !fusable) {
      compose_matmul_backward_activation(*this, dinp, dweight, dbias, src, inp, weight, prec);
      return;
    }
    op("matmul_backward_activation", src.out);
    matmul_workspace();
    scratch("matmul BF16 operand a", N * OC * kBf16);
    scratch("partial column sums", column_chunks(N) * OC * kF32);
    backward_gemms(dinp, dweight, N, OC, inp, weight);
  }
  void quantize_activation(const ActivationSource& src, const QuantizeConfig& cfg,
                           QuantizedView* rowwise, QuantizedView* columnwise,
                           const TensorView& dbias) override {
    if (!cuda_) {
      compose_quantize_activation(*this, src, cfg, rowwise, columnwise, dbias);
      return;
    }
    // (gpu/cuda_backend.cu quantize_activation: the cases the quantizer's passes fuse)
    const int64_t R = src.rows(), C = src.cols();
    const bool decoded =
        (rowwise && rowwise->decoded_bf16) || (columnwise && columnwise->decoded_bf16);
    const bool gemm_scales =
        (rowwise && rowwise->scales_gemm) || (columnwise && columnwise->scales_gemm);
    if (src.op == ActivationOp::Identity && dbias.present()) {
      const TensorView& x = src.inp;
      const bool dense_f32 = x.dtype == DType::F32 && x.dense() && R * C > 0;
      const bool nvfp4_fused = cfg.format == QFormat::NVFP4 && cfg.columnwise.enabled &&
                               cfg.columnwise.rht && dense_f32 && R % emu::kColumnChunkRows == 0 &&
                               !gemm_scales;
      const bool fp8_fused = cfg.format == QFormat::FP8 && cfg.columnwise.enabled && dense_f32 &&
                             R % kFp8Block == 0 && !decoded;
      if (nvfp4_fused || fp8_fused) {
        op("quantize_activation", x);
        scratch("partial column sums", column_chunks(R) * C * kF32);
        quantize(x, cfg, rowwise, columnwise);
        return;
      }
    }
    const bool fused = src.op != ActivationOp::Identity && opt_.activation_fusion &&
                       cfg.format == QFormat::FP8 && R * C > 0 && src.inp.dtype != DType::BF16 &&
                       src.out.dtype != DType::BF16 && src.dout.dtype != DType::BF16 &&
                       (!cfg.columnwise.enabled || R % kFp8Block == 0) &&
                       (!dbias.present() || cfg.columnwise.enabled) && !decoded;
    if (!fused) {
      compose_quantize_activation(*this, src, cfg, rowwise, columnwise, dbias);
      return;
    }
    op("quantize_activation", src.inp);
    if (dbias.present()) scratch("partial column sums", column_chunks(R) * C * kF32);
  }

 private:
  void op(const char* name, const TensorView& t) {
    ledger_.set_doing(std::string(name) + " of '" + (t.name ? t.name : "?") + "'");
  }
  // The emulator's temporaries of one op.
  void temp(int64_t bytes) { ledger_.transient(kUseWorkspace, bytes); }
  // A CUDA scratch buffer (gpu/device_scratch.hpp): grown to the largest need, kept.
  void scratch(const std::string& name, int64_t bytes) {
    int64_t& have = scratch_[name];
    if (bytes <= have) return;
    ledger_.add(kUseWorkspace, bytes - have);
    have = bytes;
  }
  void matmul_workspace() {
    scratch("the training matmuls' cuBLASLt workspace",
            static_cast<int64_t>(gpu::kMatmulCublasLtWorkspaceBytes));
  }
  void rope(const TensorView& x, const AttentionShape& s) {
    op("rope", x);
    if (cuda_) scratch("RoPE table", s.T * s.HD * kF32);  // (T x HD/2 cos, sin pairs)
  }
  // gpu/matmul.cu matmul_forward_bits: the weight and (x_f32_elems) the input rounded into scratch;
  // a BF16 output from cuBLASLt's epilogue (the bias as BF16 bits), or float32 and a pass.
  void forward_bits(const TensorView& out, int64_t x_f32_elems, const TensorView& weight,
                    const TensorView& bias) {
    const int64_t N = out.rows, OC = weight.rows;
    if (weight.dtype == DType::F32) scratch("matmul BF16 operand a", weight.numel() * kBf16);
    if (x_f32_elems > 0) scratch("matmul BF16 operand b", x_f32_elems * kBf16);
    const bool bits_out = out.dtype == DType::BF16;
    if (bits_out && opt_.matmul_bf16_epilogue) {
      if (bias.present() && bias.dtype == DType::F32) scratch("bias BF16 bits", OC * kBf16);
      return;
    }
    if (bits_out) scratch("matmul FP32 output", N * OC * kF32);
    if (bias.dtype == DType::BF16) scratch("bias widened", OC * kF32);
  }
  // gpu/matmul.cu matmul_backward_bits from dout (BF16 bits, or float32 rounded into scratch).
  void backward_bits(const TensorView& dinp, const TensorView& dweight, const TensorView& dbias,
                     bool dout16, int64_t N, int64_t OC, const TensorView& inp,
                     const TensorView& weight) {
    if (dbias.present()) scratch("partial column sums", column_chunks(N) * OC * kF32);
    if (dout16 && dbias.present() && OC % 2 != 0) scratch("matmul widened dout", N * OC * kF32);
    if (!dout16) scratch("matmul BF16 operand a", N * OC * kBf16);
    backward_gemms(dinp, dweight, N, OC, inp, weight);
  }
  void backward_gemms(const TensorView& dinp, const TensorView& dweight, int64_t N, int64_t OC,
                      const TensorView& inp, const TensorView& weight) {
    const int64_t K = weight.cols;
    (void)OC;
    if (dinp.present()) {
      if (weight.dtype == DType::F32) scratch("matmul BF16 operand b", weight.numel() * kBf16);
      if (dinp.dtype == DType::BF16 && !opt_.matmul_bf16_epilogue)
        scratch("matmul FP32 output", N * K * kF32);
    }
    if (dweight.present() && inp.dtype == DType::F32)
      scratch("matmul BF16 operand c", N * K * kBf16);
  }

  const bool cuda_;
  const CudaPlanOptions opt_;
  const Backend* caps_;
  std::unique_ptr<Backend> emu_caps_;
  Ledger& ledger_;
  const int threads_;
  uintptr_t next_ = uintptr_t{1} << 44;
  std::unordered_map<void*, std::pair<std::string, int64_t>> live_;
  std::map<std::string, int64_t> scratch_;
  int64_t buffers_ = 0, buffers_peak_ = 0;
};

// The token data the trainer reads (model/trainer.cpp load_data): two bytes a token of each split;
// the synthetic splits' sizes as load_data draws them. A missing file counts 0 (load_data then
// names it).
int64_t token_data_bytes(const RunConfig& c) {
  if (c.train.data == "synthetic") {
    const int64_t n = std::max<int64_t>(c.train.batch * (c.model.seq_len + 1) * 64, 1 << 16);
    return 2 * (n + n / 8);
  }
  int64_t bytes = 0;
  for (const char* split : {".train.tokens", ".val.tokens"}) {
    std::error_code ec;
    const auto size = fs::file_size(c.train.data + split, ec);
    if (!ec && size > static_cast<uintmax_t>(kTokenFileHeaderBytes))
      bytes += static_cast<int64_t>(size) - kTokenFileHeaderBytes;
  }
  return bytes;
}

std::string fixed(double v, int digits) {
  char b[64];
  std::snprintf(b, sizeof b, "%.*f", digits, v);
  return b;
}

// "123.45 MiB"
std::string short_bytes(int64_t bytes) {
  const std::string t = bytes_text(static_cast<uint64_t>(std::max<int64_t>(bytes, 0)));
  return t.substr(0, t.find(" ("));
}

}  // namespace

MemoryPlan plan_training(const RunConfig& c, const PlanRequest& req) {
  if (req.backend != "emu" && req.backend != "cuda")
    throw std::invalid_argument("memory plan: unknown backend '" + req.backend +
                                "' (valid: emu, cuda)");
  const bool cuda = req.backend == "cuda";
  Ledger backend_mem, host_only;
  Ledger& host = cuda ? host_only : backend_mem;  // (the emulator's memory is the host's)
  PlanningBackend pb(req, backend_mem);
  MemoryPlan plan;
  plan.backend = req.backend;
  plan.target = cuda ? "device memory (compute capability " + std::to_string(req.cuda.cc_major) +
                           ".x, default CudaOptions)"
                     : "host memory";
  // the trainer's order (model/trainer.cpp train): the data, the model, its initial weights made
  // on the host, the AdamW moments, a checkpoint's tensors on resume, then the steps
  host.set_phase("loading the token data");
  host.add(kUseTokenData, token_data_bytes(c));
  backend_mem.set_phase("building the model");
  Gpt model(c.model, pb);
  const int64_t n = static_cast<int64_t>(model.num_params());
  host.set_phase("initialisation");
  host.transient(kUseHostCopies, n * kF32);  // (Gpt::init's host vector)
  model.set_recipe(c);
  backend_mem.set_phase("allocating the optimizer state");
  if (req.ranks < 1 || req.rank < 0 || req.rank >= req.ranks)
    throw std::invalid_argument("memory plan: rank " + std::to_string(req.rank) + " of " +
                                std::to_string(req.ranks));
  std::vector<bool> owned;  // ZeRO-1: this rank's share of the state (model/data_parallel.hpp)
  if (req.ranks > 1 && c.train.zero == 1) {
    std::vector<int64_t> numels;
    for (const ParamTensor& t : model.tensors()) numels.push_back(t.numel());
    for (int o : shard_tensors(numels, req.ranks)) owned.push_back(o == req.rank);
  }
  Optimizer optimizer(c, model, owned);
  // the gradient reducer's buffers (the trainer makes it with the optimizer), on a communicator
  // that only knows the world's size
  struct PlanningRanks final : Communicator {
    int n, r;
    PlanningRanks(int n_, int r_) : n(n_), r(r_) {}
    int rank() const override { return r; }
    int size() const override { return n; }
    const char* name() const override { return "plan"; }
    [[noreturn]] static void none() { throw std::logic_error("memory plan: no communication"); }
    void all_gather_host(const void*, void*, size_t) override { none(); }
    void all_gather(const TensorView&, const TensorView&) override { none(); }
    void all_reduce_sum(const TensorView&) override { none(); }
    void broadcast(const TensorView&, int) override { none(); }
  } planning_ranks(req.ranks, req.rank);
  std::optional<GradientReducer> reducer;
  if (req.ranks > 1 || req.data_parallel) {
    reducer.emplace(planning_ranks, pb, n, c.train.grad_reduce, c.train.grad_comm);
    plan.notes.push_back(
        "data parallel: the plan of rank " + std::to_string(req.rank) + " of " +
        std::to_string(req.ranks) + " (train.grad_reduce=" + name_of(c.train.grad_reduce) +
        "'s buffers" +
        (c.train.zero == 1 ? "; ZeRO-1: this rank's share of the optimizer state" : "") +
        "); under ZeRO-1 a checkpoint gathers every rank's state through each rank's host memory");
  }
  if (req.resume) {  // the checkpoint's F32 tensors, and the float32 vectors they are copied into
    host.set_phase("resuming from a checkpoint");
    host.transient(kUseHostCopies, 2 * 3 * n * kF32);
  }
  // the steps whose buffers differ: the first two, the first statistics step after the first and
  // the one after it, the first validation, the two around the late BF16 switch (each followed by
  // a validation pass where the run's schedule has one)
  const int64_t first = 0, steps = c.train.steps;
  std::vector<int64_t> planned = {first, first + 1};
  if (c.recipe.stats_every > 0 && c.recipe.name != GemmFormat::BF16)
    for (int64_t s : {c.recipe.stats_every, c.recipe.stats_every + 1}) planned.push_back(s);
  if (c.train.eval_every > 0) planned.push_back(c.train.eval_every - 1);
  if (c.recipe.bf16_from_step > 0)
    for (int64_t s : {c.recipe.bf16_from_step - 2, c.recipe.bf16_from_step - 1})
      planned.push_back(s);
  std::sort(planned.begin(), planned.end());
  planned.erase(std::unique(planned.begin(), planned.end()), planned.end());
  const int64_t B = c.train.batch, T = c.model.seq_len, A = c.train.grad_accum;
  const std::vector<int32_t> tokens(static_cast<size_t>(B * T), 0);
  const std::vector<Segment> spans = model.tensor_spans();
  std::vector<double> sums(spans.size());
  for (int64_t step : planned) {
    if (step < 0 || step >= steps) continue;
    const std::string name = "step " + std::to_string(step + 1);
    model.set_step(step);
    const bool stats_now = c.recipe.stats_every > 0 && c.recipe.name != GemmFormat::BF16 &&
                           step % c.recipe.stats_every == 0;
    for (int64_t mb = 0; mb < A; ++mb) {
      const std::string micro = A > 1 ? ", micro-batch " + std::to_string(mb + 1) : "";
      model.set_micro_batch(mb);
      if (stats_now && mb == 0) model.collect_stats_once();
      backend_mem.set_phase(name + micro + ", forward pass");
      model.forward(tokens.data(), tokens.data(), B, T, A);
      backend_mem.set_phase(name + micro + ", backward pass");
      model.backward(A, mb > 0);
    }
    backend_mem.set_phase(name + ", optimizer step");
    pb.sum_squares(f32_view(pb, model.grads(), 1, n, "gradients"), spans, sums.data());
    optimizer.step(c.train.lr, step + 1, 1.0f);
    if (c.train.eval_every > 0 && (step + 1) % c.train.eval_every == 0) {
      backend_mem.set_phase(name + ", validation");
      model.forward(tokens.data(), tokens.data(), B, T);
    }
    if (c.train.checkpoint_every > 0) {  // (float32 host copies, then the checkpoint's tensors)
      host.set_phase(name + ", checkpoint");
      host.transient(kUseHostCopies, 2 * 3 * n * kF32);
    }
  }
  plan.lines = backend_mem.lines_at_peak();
  plan.peak = backend_mem.peak();
  plan.peak_at = backend_mem.peak_at();
  plan.buffers_peak = pb.buffers_peak();
  if (cuda) {
    plan.host_lines = host_only.lines_at_peak();
    plan.host_peak = host_only.peak();
    plan.host_peak_at = host_only.peak_at();
    plan.workspace_parts = pb.scratch_parts();
    plan.notes.push_back(
        "not counted: the CUDA context, the kernels' modules and cuBLASLt's own allocations, and "
        "the memory pool's rounding (cudaMallocAsync)");
    plan.notes.push_back(
        "estimated: CUB's radix-sort temporary storage (embedding backward), asked of CUB at run "
        "time");
  } else {
    plan.notes.push_back(
        "not counted: the program, its libraries and thread stacks (the process's "
        "memory before the run)");
  }
  return plan;
}

std::string MemoryPlan::describe() const {
  std::ostringstream o;
  o << "memory plan (" << backend << " backend, " << target << "): peak " << short_bytes(peak)
    << " (" << peak << " bytes), in " << (peak_at.empty() ? "(nothing)" : peak_at) << "\n";
  auto list = [&](const std::vector<PlanLine>& lines, int64_t total) {
    for (const PlanLine& l : lines)
      o << "  " << l.use << std::string(l.use.size() < 44 ? 44 - l.use.size() : 1, ' ')
        << short_bytes(l.bytes) << "  ("
        << fixed(100.0 * static_cast<double>(l.bytes) /
                     static_cast<double>(std::max<int64_t>(total, 1)),
                 1)
        << "%)\n";
  };
  list(lines, peak);
  for (const PlanLine& w : workspace_parts)
    o << "      " << w.use << ": " << short_bytes(w.bytes) << "\n";
  if (backend == "cuda") {
    o << "  host memory beside: peak " << short_bytes(host_peak) << " (" << host_peak
      << " bytes), in " << (host_peak_at.empty() ? "(nothing)" : host_peak_at) << "\n";
    for (const PlanLine& l : host_lines)
      o << "    " << l.use << ": " << short_bytes(l.bytes) << "\n";
  }
  for (const std::string& n : notes) o << "  (" << n << ")\n";
  return o.str();
}

namespace {

// The first number in file `path` (a cgroup file: "max" or a byte count), -1 for none or "max".
int64_t read_number(const std::string& path) {
  std::ifstream in(path);
  std::string word;
  if (!(in >> word) || word == "max") return -1;
  try {
    size_t used = 0;
    const long long v = std::stoll(word, &used);
    return used == word.size() && v >= 0 ? v : -1;
  } catch (const std::exception&) {
    return -1;
  }
}

// The value of `key` in a "key value" file (memory.stat), -1 when absent.
int64_t read_keyed(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  std::string k;
  long long v = 0;
  while (in >> k >> v)
    if (k == key) return v;
  return -1;
}

}  // namespace

MemoryLimit host_memory_available() {
  MemoryLimit best;
  {  // MemAvailable (kB)
    std::ifstream in("/proc/meminfo");
    std::string key;
    long long kb = 0;
    std::string unit;
    while (in >> key >> kb) {
      std::getline(in, unit);
      if (key == "MemAvailable:") {
        best = {static_cast<int64_t>(kb) * 1024, "MemAvailable (/proc/meminfo)"};
        break;
      }
    }
  }
  // this process's memory cgroup (v2 "0::PATH", v1 "N:memory:PATH" or "N:...,memory,...:PATH") and
  // its ancestors: a limit anywhere up the tree binds
  std::ifstream cg("/proc/self/cgroup");
  std::string line;
  while (std::getline(cg, line)) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    const bool v2 = controllers.empty();
    bool memory = v2;
    std::stringstream list(controllers);
    for (std::string c; std::getline(list, c, ',');) memory = memory || c == "memory";
    if (!memory) continue;
    const std::string root = v2 ? "/sys/fs/cgroup" : "/sys/fs/cgroup/memory";
    for (fs::path p = fs::path(root) / fs::path(path).relative_path();;) {
      const std::string dir = p.string();
      const int64_t limit = read_number(dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes"));
      const int64_t usage = read_number(dir + (v2 ? "/memory.current" : "/memory.usage_in_bytes"));
      // (v1 reports "no limit" as a huge page-rounded number)
      if (limit >= 0 && limit < (int64_t{1} << 60) && usage >= 0) {
        const int64_t cache = std::max<int64_t>(
            0, read_keyed(dir + "/memory.stat", v2 ? "inactive_file" : "total_inactive_file"));
        const int64_t free_here = std::max<int64_t>(0, limit - usage + cache);
        if (best.bytes < 0 || free_here < best.bytes)
          best = {free_here, std::string("cgroup ") + dir + " (limit " + short_bytes(limit) +
                                 ", in use " + short_bytes(usage) + ")"};
      }
      if (dir == root || !p.has_parent_path() || p.parent_path() == p) break;
      p = p.parent_path();
      if (p.string().size() < root.size()) break;
    }
  }
  return best;
}

MemoryLimitSetting parse_memory_limit(const std::string& text) {
  if (text == "auto") return {};
  if (text == "none") return {MemoryLimitSetting::Kind::None, 0};
  size_t used = 0;
  double v = -1;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string suffix = text.substr(used);
  double scale = 1;
  for (const auto& [name, s] :
       std::vector<std::pair<std::string, double>>{{"", 1.0},
                                                   {"K", 1024.0},
                                                   {"KiB", 1024.0},
                                                   {"M", 1048576.0},
                                                   {"MiB", 1048576.0},
                                                   {"G", 1073741824.0},
                                                   {"GiB", 1073741824.0},
                                                   {"T", 1099511627776.0},
                                                   {"TiB", 1099511627776.0}})
    if (suffix == name) {
      scale = s;
      suffix = "ok";
    }
  if (used == 0 || suffix != "ok" || !(v > 0) || v * scale >= 9.2e18)
    throw std::invalid_argument("--memory-limit: '" + text +
                                "' is not auto, none or a positive size in bytes (suffixes K, M, "
                                "G, T: powers of 1024)");
  return {MemoryLimitSetting::Kind::Bytes, static_cast<int64_t>(v * scale)};
}

std::string check_memory_plan(const MemoryPlan& plan, const MemoryLimitSetting& setting,
                              const Backend& be) {
  if (setting.kind == MemoryLimitSetting::Kind::None) return "";
  const bool device = be.device() != Device::Host;
  MemoryLimit limit;
  if (setting.kind == MemoryLimitSetting::Kind::Bytes) {
    limit = {setting.bytes, "--memory-limit"};
  } else if (device) {
    limit = {be.device_memory_free(), "the device's free memory (cudaMemGetInfo)"};
  } else {
    limit = host_memory_available();
  }
  std::string said;
  auto refuse = [&](const std::string& what, int64_t need, const MemoryLimit& l) {
    throw std::runtime_error(
        "memory plan: the run needs " + bytes_text(static_cast<uint64_t>(need)) + " of " + what +
        " at its peak, more than the " + bytes_text(static_cast<uint64_t>(l.bytes)) +
        " available (" + l.source +
        "); nothing was allocated. Make the model or train.batch smaller, or pass --memory-limit "
        "BYTES|none to override.\n" +
        plan.describe());
  };
  const std::string what = device ? "device memory" : "host memory";
  if (limit.bytes >= 0) {
    if (plan.peak > limit.bytes) refuse(what, plan.peak, limit);
    said += "memory limit (" + what + "): " + short_bytes(limit.bytes) + " (" + limit.source +
            "); the plan takes " +
            fixed(100.0 * static_cast<double>(plan.peak) / static_cast<double>(limit.bytes), 1) +
            "%\n";
  }
  if (device) {
    const MemoryLimit host = host_memory_available();
    if (host.bytes >= 0) {
      if (plan.host_peak > host.bytes) refuse("host memory", plan.host_peak, host);
      said +=
          "memory limit (host memory): " + short_bytes(host.bytes) + " (" + host.source +
          "); the plan takes " +
          fixed(100.0 * static_cast<double>(plan.host_peak) / static_cast<double>(host.bytes), 1) +
          "%\n";
    }
  }
  return said;
}

MemoryPlan plan_run(const RunConfig& c, const Backend& be, bool resume, bool data_parallel,
                    int ranks, int rank, const MemoryLimitSetting& setting, bool print) {
  PlanRequest req;
  req.data_parallel = data_parallel;
  req.ranks = ranks;
  req.rank = rank;
  req.backend = be.device() == Device::Host ? "emu" : "cuda";
  req.resume = resume;
  req.run_backend = &be;
  // (the GEMMs' decoded operands exist below compute capability 10: gpu/capabilities.hpp)
  req.cuda.cc_major =
      be.supports(Capability::GemmDecodedOperand, static_cast<int64_t>(GemmImpl::CublasLt)) ? 9
                                                                                            : 10;
  const MemoryPlan plan = plan_training(c, req);
  if (print) std::printf("%s", plan.describe().c_str());
  const std::string limits = check_memory_plan(plan, setting, be);
  if (print) std::printf("%s", limits.c_str());
  return plan;
}

MeasuredMemory memory_at_start(const Backend& be) {
  MeasuredMemory m;
  m.start = be.device() == Device::Host ? resident_bytes() : be.device_memory_used();
  return m;
}

std::string measured_against_plan(const MemoryPlan& plan, const Backend& be,
                                  const MeasuredMemory& m) {
  const bool device = be.device() != Device::Host;
  const int64_t peak = device ? m.peak : peak_resident_bytes();
  if (peak < 0 || m.start < 0) return "";
  const int64_t grown = peak - m.start;
  // the allocator's own high-water marks, where the backend keeps them: what allocate() handed out
  // is what the plan's buffers predict, apart from the backend's workspace and the CUDA context
  const Backend::AllocationPeaks pools = be.allocation_peaks();
  const std::string pool_line =
      pools.allocated < 0
          ? std::string()
          : "memory pool high-water marks: " + short_bytes(pools.allocated) + " (" +
                std::to_string(pools.allocated) + " bytes) allocated, " +
                short_bytes(pools.reserved) +
                " reserved; the plan's buffers (no workspace): " + short_bytes(plan.buffers_peak) +
                " (" + std::to_string(plan.buffers_peak) + " bytes)\n";
  const std::string pct = plan.peak > 0 ? (grown >= plan.peak ? "+" : "") +
                                              fixed(100.0 * static_cast<double>(grown - plan.peak) /
                                                        static_cast<double>(plan.peak),
                                                    1) +
                                              " %"
                                        : std::string("n/a");
  return std::string(device ? "peak device memory in use: " : "peak resident memory: ") +
         fixed(static_cast<double>(peak) / (1 << 30), 3) + " GiB" +
         (device ? " (cudaMemGetInfo after each step, the CUDA context and other processes "
                   "included), "
                 : " (VmHWM), ") +
         short_bytes(grown) + " (" + std::to_string(grown) + " bytes) above the " +
         short_bytes(m.start) +
         " in use at the start of the run; the plan: " + short_bytes(plan.peak) + " (" +
         std::to_string(plan.peak) + " bytes; growth - plan: " + pct + ")\n" + pool_line;
}

namespace {
int64_t status_kb(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string k;
  while (in >> k) {
    if (k == key) {
      long long kb = 0;
      in >> kb;
      return static_cast<int64_t>(kb) * 1024;
    }
    std::string rest;
    std::getline(in, rest);
  }
  return -1;
}
}  // namespace

int64_t resident_bytes() { return status_kb("VmRSS:"); }
int64_t peak_resident_bytes() { return status_kb("VmHWM:"); }

}  // namespace fp4sim::model
