#include <memory>
#include <stdexcept>
#include <vector>

#include "emu/fused.hpp"
#include "emu/op_checks.hpp"
#include "gpu/column_sums.cuh"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/layers_state.hpp"

namespace fp4sim::gpu {

bool gpu_available() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return n > 0;
}

void set_device(int device) {
  int n = 0;
  FP4SIM_CUDA_CHECK(cudaGetDeviceCount(&n));
  if (device < 0 || device >= n)
    throw std::invalid_argument("CUDA device " + std::to_string(device) + " does not exist (" +
                                std::to_string(n) + " devices)");
  FP4SIM_CUDA_CHECK(cudaSetDevice(device));
}

void stream_wait(void* consumer, void* producer) {
  if (consumer == producer) return;
  cudaEvent_t e = nullptr;
  FP4SIM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  const cudaError_t r1 = cudaEventRecord(e, static_cast<cudaStream_t>(producer));
  const cudaError_t r2 =
      r1 == cudaSuccess ? cudaStreamWaitEvent(static_cast<cudaStream_t>(consumer), e, 0) : r1;
  cudaEventDestroy(e);  // (released once the wait is done)
  FP4SIM_CUDA_CHECK(r2);
}

std::string describe_gpu() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return std::string("none (") + cudaGetErrorString(e) + ")";
  }
  if (n == 0) return "none (no CUDA device)";
  cudaDeviceProp p{};
  FP4SIM_CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  return std::string(p.name) + ", sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
         std::to_string(p.multiProcessorCount) + " SMs, " + std::to_string(p.totalGlobalMem >> 20) +
         " MiB, driver " + std::to_string(driver) + ", runtime " + std::to_string(runtime) +
         (n > 1 ? " (+" + std::to_string(n - 1) + " more)" : "");
}

// Allocations are stream-ordered (cudaMallocAsync / cudaFreeAsync on stream_, from the device's
// default pool), because the training step makes and drops a few hundred quantized copies: with
// cudaMalloc / cudaFree each free waited for the whole device, so the host could not queue ahead
// (the nvfp4 step had ~20 ms of wall time without kernels). The pool keeps what it has
// (release threshold: unlimited), so a step reuses the previous step's memory; cudaMemGetInfo,
// and so the peak memory the trainer reports, counts what the pool holds.
CudaBackend::CudaBackend(const CudaOptions& options)
    : Backend("cuda", Device::Cuda), options_(options) {
  const auto check_pick = [](const char* what, int index) {
    if (index < kPlanOwnPick || index > kMaxHeuristicPick)
      throw std::invalid_argument(
          std::string("CudaOptions::") + what + ": index " + std::to_string(index) +
          " is outside " + std::to_string(kPlanOwnPick) + ".." + std::to_string(kMaxHeuristicPick));
  };
  check_pick("cublaslt_heuristic_pick", options.cublaslt_heuristic_pick);
  check_pick("matmul_heuristic_pick", options.matmul_heuristic_pick);
  if (options.quantize_keep_rht < kQuantizeKeepRhtAuto || options.quantize_keep_rht > 1)
    throw std::invalid_argument(
        "CudaOptions::quantize_keep_rht: " + std::to_string(options.quantize_keep_rht) +
        " is not kQuantizeKeepRhtAuto, 0 or 1");
  if (options.quantize_kept_ctas_per_sm < 0 || options.fp8_wgmma_max_ctas < 0)
    throw std::invalid_argument(
        "CudaOptions: quantize_kept_ctas_per_sm and fp8_wgmma_max_ctas must be >= 0");
  if (options.use_external_stream)
    stream_ = static_cast<cudaStream_t>(options.external_stream);
  else
    FP4SIM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  try {
    init_device();
  } catch (...) {  // the destructor does not run for a constructor that throws
    if (amax_ws_) cudaFree(amax_ws_);
    if (!options_.use_external_stream) cudaStreamDestroy(stream_);
    throw;
  }
}

void CudaBackend::init_device() {
  int dev = 0, pools = 0;
  FP4SIM_CUDA_CHECK(cudaGetDevice(&dev));
  FP4SIM_CUDA_CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, dev));
  FP4SIM_CUDA_CHECK(cudaDeviceGetAttribute(&cc_major_, cudaDevAttrComputeCapabilityMajor, dev));
  stream_ordered_ = pools != 0;
  if (stream_ordered_) {
    cudaMemPool_t pool = nullptr;
    FP4SIM_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
    uint64_t keep = UINT64_MAX;
    FP4SIM_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  }
  FP4SIM_CUDA_CHECK(cudaMalloc(&amax_ws_, 4 * sizeof(unsigned)));
  FP4SIM_CUDA_CHECK(
      cudaMemsetAsync(amax_ws_, 0, 4 * sizeof(unsigned), stream_));  // (ordered before any pass)
}
CudaBackend::~CudaBackend() {
  if (amax_ws_) cudaFree(amax_ws_);
  if (stream_ && !options_.use_external_stream) cudaStreamDestroy(stream_);
}

CudaBackend::LayersState& CudaBackend::layers_state() {
  if (!layers_) {
    layers_ = std::make_shared<LayersState>();
    layers_->lt.pick = options_.matmul_heuristic_pick;
  }
  return *layers_;
}

CudaCounters CudaBackend::counters() const {
  CudaCounters c = counters_;
  if (cublaslt_) c.last_cublaslt_plan_pick = cublaslt_last_pick(*cublaslt_);
  if (layers_) {
    c.last_matmul_plan_pick = layers_->lt.last_pick;
    c.last_matmul_epilogue_refusal = layers_->lt.last_epilogue_refusal;
  }
  return c;
}

// Memory from allocate() is ready in stream_'s order: every op of this backend runs on stream_,
// and upload/download synchronise it.
// A failure throws the CUDA error with the free memory (Backend::allocate_labelled adds what the
// buffer is and its size) and clears it: an allocation failure leaves the context usable.
void* CudaBackend::allocate(size_t bytes) {
  void* p = nullptr;
  const cudaError_t e = stream_ordered_ ? cudaMallocAsync(&p, bytes ? bytes : 1, stream_)
                                        : cudaMalloc(&p, bytes ? bytes : 1);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    const bool info = cudaMemGetInfo(&free_b, &total_b) == cudaSuccess;
    throw std::runtime_error(std::string(cudaGetErrorString(e)) + " (" + cudaGetErrorName(e) + ")" +
                             (info ? ", " + bytes_text(free_b) + " free" : std::string()));
  }
  return p;
}
void CudaBackend::release(void* p) {
  if (stream_ordered_)
    cudaFreeAsync(p, stream_);
  else
    cudaFree(p);
}
void CudaBackend::upload(void* dst, const void* src, size_t n) {
  FP4SIM_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, stream_));
  FP4SIM_CUDA_CHECK(cudaStreamSynchronize(stream_));
}
void CudaBackend::download(void* dst, const void* src, size_t n) {
  FP4SIM_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, stream_));
  FP4SIM_CUDA_CHECK(cudaStreamSynchronize(stream_));
}
int64_t CudaBackend::device_memory_used() const {
  size_t free_b = 0, total_b = 0;
  FP4SIM_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return static_cast<int64_t>(total_b - free_b);
}
Backend::AllocationPeaks CudaBackend::allocation_peaks() const {
  if (!stream_ordered_) return {};
  int dev = 0;
  cudaMemPool_t pool = nullptr;
  FP4SIM_CUDA_CHECK(cudaGetDevice(&dev));
  FP4SIM_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
  uint64_t used = 0, reserved = 0;
  FP4SIM_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &used));
  FP4SIM_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &reserved));
  return {static_cast<int64_t>(used), static_cast<int64_t>(reserved)};
}

int64_t CudaBackend::device_memory_free() const {
  size_t free_b = 0, total_b = 0;
  FP4SIM_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  uint64_t reserved = 0, used = 0;
  if (stream_ordered_) {
    int dev = 0;
    cudaMemPool_t pool = nullptr;
    FP4SIM_CUDA_CHECK(cudaGetDevice(&dev));
    FP4SIM_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
    FP4SIM_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved));
    FP4SIM_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used));
  }
  return static_cast<int64_t>(free_b + (reserved > used ? reserved - used : 0));
}

bool CudaBackend::supports(Capability c, int64_t arg) const {
  if (c == Capability::SsmChunk && options_.ssm_sequential) return arg > 0;
  return cuda_supports(c, arg, cc_major_);
}

void CudaBackend::synchronize() { FP4SIM_CUDA_CHECK(cudaStreamSynchronize(stream_)); }
void CudaBackend::zero(void* p, size_t n) { FP4SIM_CUDA_CHECK(cudaMemsetAsync(p, 0, n, stream_)); }
void CudaBackend::copy(void* dst, const void* src, size_t n) {
  FP4SIM_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, stream_));
}

void CudaBackend::quantize(const TensorView& x, const QuantizeConfig& cfg, QuantizedView* rowwise,
                           QuantizedView* columnwise) {
  validate_quantize(x, cfg);
  if (cfg.format != QFormat::FP8 &&
      ((rowwise && rowwise->scales_gemm) || (columnwise && columnwise->scales_gemm)))
    throw std::invalid_argument(std::string("quantize (cuda): tensor '") + x.name +
                                "': GEMM-layout scales (scales_gemm) exist for FP8 only");
  if (cfg.format == QFormat::FP8) {
    if ((rowwise && rowwise->decoded_bf16) || (columnwise && columnwise->decoded_bf16))
      throw std::invalid_argument(
          std::string("quantize (cuda): tensor '") + x.name +
          "': a decoded BF16 copy exists for the FP4 formats only, not FP8");
    if (x.device != Device::Cuda)
      throw std::invalid_argument(std::string("quantize (cuda): tensor '") + x.name +
                                  "' is not in device memory");
    fp8_quantize_launch(x, cfg, rowwise, columnwise, stream_, amax_ws_, nullptr,
                        options_.fp8_quantize_staged);
    return;
  }
  quantize_launch(x, cfg, rowwise, columnwise, stream_, amax_ws_, &rht_keep_, nullptr, options_);
}

ActivationArgs activation_args(const ActivationSource& src) {
  ActivationArgs a;
  a.op = src.op;
  a.rows = src.rows();
  a.cols = src.cols();
  a.name = src.inp.name;
  auto split = [](const TensorView& v, const float*& f, const uint16_t*& b) {
    f = v.dtype == DType::F32 ? v.as<const float>() : nullptr;
    b = v.dtype == DType::BF16 ? v.as<const uint16_t>() : nullptr;
  };
  split(src.inp, a.inp, a.inp16);
  split(src.dout, a.dout, a.dout16);
  a.out = src.out.dtype == DType::F32 ? src.out.as<float>() : nullptr;
  a.out16 = src.out.dtype == DType::BF16 ? src.out.as<uint16_t>() : nullptr;
  a.round_bf16 = src.out.bf16_storage();
  a.bf16_dout = src.dout.bf16_storage();
  return a;
}

// Identity with dbias (a linear layer's output gradient): FP8 with a column-wise copy of a dense
// float32 x whose rows fill whole 128-row tiles: the tile pass writes the chunks' column sums
// (gpu/fp8.cu) in place of column_partial_kernel's pass over x, then the same finalize as
// bias_backward. NVFP4 with an RHT column-wise copy of a dense float32 x (rows % 64 == 0): the
// pipelined RHT amax pass takes the sums where it runs (gpu/quantize.cu), else bias_backward's own
// pass. GELU (forward or backward) into FP8 copies (both or either, whole 128-row tiles where a
// column-wise copy or dbias is made): the activation computed inside the quantizer's tile pass,
// src.out never written. Otherwise the composition. Bitwise either way.
void CudaBackend::quantize_activation(const ActivationSource& src, const QuantizeConfig& cfg,
                                      QuantizedView* rowwise, QuantizedView* columnwise,
                                      const TensorView& dbias) {
  op_checks::activation_source("quantize_activation", src);
  float* const db = dbias.as<float>();
  if (db) check_view("quantize_activation", dbias, src.cols(), 1, ViewRule{});
  const int64_t R = src.rows(), C = src.cols();
  const bool no_decoded =
      !(rowwise && rowwise->decoded_bf16) && !(columnwise && columnwise->decoded_bf16);
  const bool no_gemm_scales =
      !(rowwise && rowwise->scales_gemm) && !(columnwise && columnwise->scales_gemm);
  if (src.op == ActivationOp::Identity && db) {
    const TensorView& x = src.inp;
    const bool dense_f32 =
        x.dtype == DType::F32 && x.dense() && x.device == Device::Cuda && R * C > 0;
    if (cfg.format == QFormat::NVFP4 && cfg.columnwise.enabled && cfg.columnwise.rht && dense_f32 &&
        R % emu::kColumnChunkRows == 0 && no_gemm_scales) {
      validate_quantize(x, cfg);
      float* partial =
          layers_state().columns.get<float>(static_cast<size_t>(column_chunks(R) * C), stream_);
      if (quantize_launch(x, cfg, rowwise, columnwise, stream_, amax_ws_, &rht_keep_, partial,
                          options_)) {
        column_sums_finalize(db, partial, R, C, true, stream_);
        ++counters_.fused_bias_backward;
      } else {
        bias_backward_launch(db, x.as<const float>(), R, C);
      }
      return;
    }
    if (cfg.format == QFormat::FP8 && cfg.columnwise.enabled && dense_f32 && R % kFp8Block == 0 &&
        no_decoded) {
      validate_quantize(x, cfg);
      float* partial =
          layers_state().columns.get<float>(static_cast<size_t>(column_chunks(R) * C), stream_);
      fp8_quantize_launch(x, cfg, rowwise, columnwise, stream_, amax_ws_, partial,
                          options_.fp8_quantize_staged);
      column_sums_finalize(db, partial, R, C, true, stream_);
      ++counters_.fused_bias_backward;
      return;
    }
  }
  const ActivationArgs a = activation_args(src);
  const bool fused = src.op != ActivationOp::Identity && options_.activation_fusion &&
                     cfg.format == QFormat::FP8 && R * C > 0 && !a.inp16 && !a.out16 && !a.dout16 &&
                     (!cfg.columnwise.enabled || R % kFp8Block == 0) &&
                     (!db || cfg.columnwise.enabled) && no_decoded;
  if (!fused) {
    compose_quantize_activation(*this, src, cfg, rowwise, columnwise, dbias);
    return;
  }
  // (the op's output as quantize would see it: for the checks only, never written)
  validate_quantize(as_stored(src.out), cfg);
  float* partial =
      db ? layers_state().columns.get<float>(static_cast<size_t>(column_chunks(R) * C), stream_)
         : nullptr;
  fp8_quantize_activation_launch(a, cfg, rowwise, columnwise, stream_, amax_ws_, partial,
                                 options_.fp8_quantize_staged);
  if (db) column_sums_finalize(db, partial, R, C, true, stream_);
  ++counters_.fused_activation_quantize;
}

void CudaBackend::dequantize(const QuantizedView& q, const TensorView& out) {
  if (out.dtype != DType::F32 || out.rows != q.rows || out.cols != q.cols)
    throw std::invalid_argument("dequantize: output must be float32 " + shape_str(q.rows, q.cols));
  if (q.format == QFormat::FP8)
    fp8_dequantize_launch(q, out, stream_);
  else
    dequantize_launch(q, out, stream_);
}

QuantErrorSums CudaBackend::quant_error_sums(const TensorView& xv, const QuantizedView& q) {
  check_view("quant_error_sums", xv, q.rows, q.cols, ViewRule{});
  const float* x = xv.as<const float>();
  validate_quant_error_sums(x, q);
  if (q.rows == 0) return {};
  // scratch for this call only (a statistics step is rare; nothing stays allocated between them)
  DeviceScratch blocks{"quantization statistics blocks"}, rows{"quantization statistics rows"};
  auto* block_sums = blocks.get<QuantErrorSums>(static_cast<size_t>(q.scale_count()), stream_);
  auto* row_sums = rows.get<QuantErrorSums>(static_cast<size_t>(q.rows), stream_);
  quant_error_rows_launch(x, q, block_sums, row_sums, stream_);
  std::vector<QuantErrorSums> host(static_cast<size_t>(q.rows));
  download(host.data(), row_sums, host.size() * sizeof(QuantErrorSums));
  return add_rows_in_order(host.data(), q.rows);
}

void CudaBackend::scales_to_tiled(const uint8_t* scales, int64_t rows, int64_t k_blocks,
                                  uint8_t* out) {
  scales_to_tiled_launch(scales, rows, k_blocks, out, stream_);
}

void CudaBackend::gemm(const QuantizedView& a, const QuantizedView& b, const TensorView* c,
                       const GemmConfig& cfg, const TensorView& d) {
  validate_gemm(a, b, c, cfg, d);
  const float* cp = c ? static_cast<const float*>(c->data) : nullptr;
  if (cfg.impl == GemmImpl::CublasLt) {
    if (cfg.split_k != 1)
      throw std::invalid_argument(
          "gemm: --split-k models the exact GEMM only; cuBLASLt chooses its own");
    if (!cublaslt_) cublaslt_ = make_cublaslt_state(options_.cublaslt_heuristic_pick);
    if (a.format == QFormat::FP8)
      fp8_gemm_cublaslt_launch(*cublaslt_, a, b, cp, cfg, d.data, stream_);
    else
      gemm_cublaslt_launch(*cublaslt_, a, b, cp, cfg, d.data, stream_);
    return;
  }
  if (a.format == QFormat::FP8) {
    if (options_.fp8_wgmma && fp8_gemm_wgmma_supported(a, b)) {
      float* ws = cfg.split_k > 1 ? fp8_split_ws_.get<float>(
                                        static_cast<size_t>(cfg.split_k * a.rows * b.rows), stream_)
                                  : nullptr;
      fp8_gemm_wgmma_launch(a, b, cp, cfg, d.data, ws, stream_, options_.fp8_wgmma_max_ctas);
      ++counters_.fp8_wgmma_gemms;
    } else {
      fp8_gemm_exact_launch(a, b, cp, cfg, d.data, stream_);
    }
  } else {
    gemm_exact_launch(a, b, cp, cfg, d.data, stream_);
  }
}

std::unique_ptr<Backend> make_cuda_backend(const CudaOptions& options) {
  return std::make_unique<CudaBackend>(options);
}

}  // namespace fp4sim::gpu
