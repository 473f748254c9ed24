// The fast GEMM path (--gemm cublaslt). On Hopper: each operand is dequantized to BF16 without its
// global scale (e2m1 * block scale has at most 6 significant bits, exact in BF16), multiplied by
// cuBLASLt's BF16 GEMM with FP32 accumulation, and the global scales go into alpha, as in the exact
// path. Results differ from the exact GEMM by accumulation order and rounding only; the bound is
// gemm_cublaslt_bound (emu/gemm.hpp). On Blackwell (compute capability 10.x / 12.x, chosen at run
// time) the operands go to cuBLASLt natively: CUDA_R_4F_E2M1 codes, VEC16_UE4M3 (NVFP4) or
// VEC32_UE8M0 (MXFP4) block scales in the 128x4 tiled layout, alpha as a device pointer. That path
// compiles here and its scale layout is tested (Quantize.TiledScaleLayoutCheckValues,
// QuantizeGpu.DequantizeAndTiledScalesMatchEmulator), but no Blackwell GPU has run it yet.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "emu/gemm.hpp"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"

#define FP4SIM_CUBLAS_CHECK(call)                                                           \
  do {                                                                                      \
    cublasStatus_t fp4sim_st_ = (call);                                                     \
    if (fp4sim_st_ != CUBLAS_STATUS_SUCCESS)                                                \
      throw std::runtime_error(std::string("cuBLASLt error ") +                             \
                               std::to_string(static_cast<int>(fp4sim_st_)) + " in " #call); \
  } while (0)

namespace fp4sim::gpu {
namespace {

// out [rows, cols] BF16 bits = e2m1(code) * block scale (no global scale): exact.
__global__ void dequantize_block_scaled_bf16(QuantizedView q, uint16_t* out) {
  const int64_t n = q.rows * q.cols;
  const int64_t block = q.format == QFormat::MXFP4 ? kMxfp4Block : kNvfp4Block;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / q.cols, c = e % q.cols;
    const uint8_t s = q.scales[r * (q.cols / block) + c / block];
    const float sv = q.format == QFormat::MXFP4 ? ue8m0_to_f32(s) : e4m3_to_f32(s);
    const uint8_t code = (q.codes[e / 2] >> (4 * (e & 1))) & 0xFu;
    out[e] = bf16_rne(fmul_rn(e2m1_to_f32(code), sv));
  }
}

__global__ void f32_to_bf16_kernel(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = bf16_rne(in[i]);
}

int grid_for(int64_t n) {
  const int64_t b = (n + 255) / 256;
  return static_cast<int>(b < 132 * 64 ? (b > 0 ? b : 1) : 132 * 64);
}

}  // namespace

struct CublasLtState {
  int cc_major = 0;  // compute capability of the current device
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 64u << 20;
  ~CublasLtState() {
    if (workspace) cudaFree(workspace);
    if (handle) cublasLtDestroy(handle);
  }
};

std::shared_ptr<CublasLtState> make_cublaslt_state() {
  auto s = std::make_shared<CublasLtState>();
  FP4SIM_CUBLAS_CHECK(cublasLtCreate(&s->handle));
  int dev = 0;
  FP4SIM_CUDA_CHECK(cudaGetDevice(&dev));
  FP4SIM_CUDA_CHECK(cudaDeviceGetAttribute(&s->cc_major, cudaDevAttrComputeCapabilityMajor, dev));
  FP4SIM_CUDA_CHECK(cudaMalloc(&s->workspace, s->workspace_bytes));
  return s;
}

// D_rm [M, N] = alpha * A_rm [M, K] * B_rm [N, K]^T + beta * C_rm: in cuBLASLt's column-major
// terms D^T (N x M) = op(B^T as K x N, transposed) * (A^T as K x M): "TN", lda = ldb = K, ldd = N.
void bf16_gemm_tn(CublasLtState& st, const uint16_t* a, const uint16_t* b, const float* c, float* d,
                  int64_t M, int64_t N, int64_t K, float alpha, float beta, cudaStream_t stream) {
  cublasLtMatmulDesc_t op;
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  cublasLtMatrixLayout_t la, lb, lc;
  FP4SIM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, K, N, K));
  FP4SIM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, K, M, K));
  FP4SIM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, N, M, N));
  cublasLtMatmulPreference_t pref;
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &st.workspace_bytes, sizeof st.workspace_bytes));
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(st.handle, op, la, lb, lc, lc, pref, 1, &heur, &found));
  if (found == 0) throw std::runtime_error("cuBLASLt found no BF16 GEMM algorithm for this shape");
  FP4SIM_CUBLAS_CHECK(cublasLtMatmul(st.handle, op, &alpha, b, la, a, lb, &beta, c ? c : d, lc, d, lc,
                                     &heur.algo, st.workspace, st.workspace_bytes, stream));
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(op);
}

namespace {

// alpha' (and beta) on the device, from the operands' amax: no host synchronisation.
__global__ void epilogue_scalars_kernel(QuantizedView a, QuantizedView b, float alpha, float beta,
                                        float* out) {
  out[0] = gemm_epilogue_alpha(alpha, a.format, *a.amax, a.four_over_six, *b.amax, b.four_over_six);
  out[1] = beta;
}

// Blackwell: cuBLASLt's native block-scaled FP4 GEMM, same TN mapping as bf16_gemm_tn.
void fp4_native_gemm_tn(CublasLtState& st, const QuantizedView& a, const QuantizedView& b,
                        const float* c, float* d, const GemmConfig& cfg, cudaStream_t stream) {
  const int64_t M = a.rows, N = b.rows, K = a.cols;
  const bool mx = a.format == QFormat::MXFP4;
  const int64_t kb = K / (mx ? kMxfp4Block : kNvfp4Block);
  uint8_t *sa = nullptr, *sb = nullptr;
  float* scalars = nullptr;
  FP4SIM_CUDA_CHECK(cudaMallocAsync(&sa, tiled_scale_bytes(M, kb), stream));
  FP4SIM_CUDA_CHECK(cudaMallocAsync(&sb, tiled_scale_bytes(N, kb), stream));
  FP4SIM_CUDA_CHECK(cudaMallocAsync(&scalars, 2 * sizeof(float), stream));
  scales_to_tiled_launch(a.scales, M, kb, sa, stream);
  scales_to_tiled_launch(b.scales, N, kb, sb, stream);
  epilogue_scalars_kernel<<<1, 1, 0, stream>>>(a, b, cfg.alpha, cfg.beta, scalars);
  FP4SIM_CUDA_CHECK_LAUNCH();
  cublasLtMatmulDesc_t op;
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  const cublasLtPointerMode_t pm = CUBLASLT_POINTER_MODE_DEVICE;
  const int32_t mode = mx ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0 : CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3;
  // cuBLASLt's A is our B (N x K) and its B is our A (M x K)
  const void* scale_a = sb;
  const void* scale_b = sa;
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pm, sizeof pm));
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof mode));
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof mode));
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a, sizeof scale_a));
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b, sizeof scale_b));
  cublasLtMatrixLayout_t la, lb, lc;
  FP4SIM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_4F_E2M1, K, N, K));
  FP4SIM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_4F_E2M1, K, M, K));
  FP4SIM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, N, M, N));
  cublasLtMatmulPreference_t pref;
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &st.workspace_bytes, sizeof st.workspace_bytes));
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(st.handle, op, la, lb, lc, lc, pref, 1, &heur, &found));
  if (found == 0) throw std::runtime_error("cuBLASLt found no native FP4 GEMM algorithm for this shape");
  FP4SIM_CUBLAS_CHECK(cublasLtMatmul(st.handle, op, scalars, b.codes, la, a.codes, lb, scalars + 1,
                                     c ? c : d, lc, d, lc, &heur.algo, st.workspace,
                                     st.workspace_bytes, stream));
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(op);
  FP4SIM_CUDA_CHECK(cudaFreeAsync(sa, stream));
  FP4SIM_CUDA_CHECK(cudaFreeAsync(sb, stream));
  FP4SIM_CUDA_CHECK(cudaFreeAsync(scalars, stream));
}

}  // namespace

void gemm_cublaslt_launch(CublasLtState& st, const QuantizedView& a, const QuantizedView& b,
                          const float* c, const GemmConfig& cfg, void* out, cudaStream_t stream) {
  const int64_t M = a.rows, N = b.rows, K = a.cols;
  if (st.cc_major >= 10) {  // Blackwell: native FP4 (never reached on Hopper)
    float* d = cfg.out == GemmOut::F32 ? static_cast<float*>(out) : nullptr;
    float* d32 = nullptr;
    if (!d) {
      FP4SIM_CUDA_CHECK(cudaMallocAsync(&d32, static_cast<size_t>(M * N) * 4, stream));
      d = d32;
    }
    fp4_native_gemm_tn(st, a, b, cfg.beta != 0.0f ? c : nullptr, d, cfg, stream);
    if (d32) {
      f32_to_bf16_kernel<<<grid_for(M * N), 256, 0, stream>>>(d32, static_cast<uint16_t*>(out), M * N);
      FP4SIM_CUDA_CHECK_LAUNCH();
      FP4SIM_CUDA_CHECK(cudaFreeAsync(d32, stream));
    }
    return;
  }
  uint16_t *da = nullptr, *db = nullptr;
  float* d32 = nullptr;
  FP4SIM_CUDA_CHECK(cudaMallocAsync(&da, static_cast<size_t>(M * K) * 2, stream));
  FP4SIM_CUDA_CHECK(cudaMallocAsync(&db, static_cast<size_t>(N * K) * 2, stream));
  dequantize_block_scaled_bf16<<<grid_for(M * K), 256, 0, stream>>>(a, da);
  FP4SIM_CUDA_CHECK_LAUNCH();
  dequantize_block_scaled_bf16<<<grid_for(N * K), 256, 0, stream>>>(b, db);
  FP4SIM_CUDA_CHECK_LAUNCH();
  // the epilogue's alpha from the operands' amax (device memory): one small synchronising read
  float amax_a = 0, amax_b = 0;
  FP4SIM_CUDA_CHECK(cudaMemcpyAsync(&amax_a, a.amax, 4, cudaMemcpyDeviceToHost, stream));
  FP4SIM_CUDA_CHECK(cudaMemcpyAsync(&amax_b, b.amax, 4, cudaMemcpyDeviceToHost, stream));
  FP4SIM_CUDA_CHECK(cudaStreamSynchronize(stream));
  const float alpha =
      gemm_epilogue_alpha(cfg.alpha, a.format, amax_a, a.four_over_six, amax_b, b.four_over_six);
  float* d = cfg.out == GemmOut::F32 ? static_cast<float*>(out) : nullptr;
  if (!d) {
    FP4SIM_CUDA_CHECK(cudaMallocAsync(&d32, static_cast<size_t>(M * N) * 4, stream));
    d = d32;
  }
  bf16_gemm_tn(st, da, db, cfg.beta != 0.0f ? c : nullptr, d, M, N, K, alpha,
               cfg.beta != 0.0f ? cfg.beta : 0.0f, stream);
  if (d32) {
    f32_to_bf16_kernel<<<grid_for(M * N), 256, 0, stream>>>(d32, static_cast<uint16_t*>(out), M * N);
    FP4SIM_CUDA_CHECK_LAUNCH();
    FP4SIM_CUDA_CHECK(cudaFreeAsync(d32, stream));
  }
  FP4SIM_CUDA_CHECK(cudaFreeAsync(da, stream));
  FP4SIM_CUDA_CHECK(cudaFreeAsync(db, stream));
}

}  // namespace fp4sim::gpu
