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

#include <map>
#include <stdexcept>
#include <string>
#include <tuple>

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

constexpr int kDequantThreads = 256;
constexpr int64_t kDequantChunk = 16;  // elements per thread: one NVFP4 block, half an MXFP4 block

// out [rows, cols] BF16 bits = e2m1(code) * block scale (no global scale): exact, since the product
// has at most 6 significant bits (1 + 3 + carry) and lies inside BF16's range. One thread decodes 16
// consecutive elements of a row (8 code bytes, one scale byte) and writes 32 bytes.
__global__ void dequantize_block_scaled_bf16(QuantizedView q, uint16_t* out) {
  const int64_t chunks_per_row = q.cols / kDequantChunk;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (chunk >= q.rows * chunks_per_row) return;
  const bool mx = q.format == QFormat::MXFP4;
  const int64_t block = mx ? kMxfp4Block : kNvfp4Block;
  const int64_t r = chunk / chunks_per_row, c0 = (chunk - r * chunks_per_row) * kDequantChunk;
  const uint8_t s = q.scales[r * (q.cols / block) + c0 / block];
  const float sv = mx ? ue8m0_to_f32(s) : e4m3_to_f32(s);
  const uint2 codes = *reinterpret_cast<const uint2*>(q.codes + (r * q.cols + c0) / 2);
  uint32_t packed[8];
  FP4SIM_UNROLL
  for (int i = 0; i < 8; ++i) {
    const uint32_t byte = ((i < 4 ? codes.x : codes.y) >> (8 * (i & 3))) & 0xFFu;
    const uint32_t lo = bf16_rne(fmul_rn(e2m1_to_f32(static_cast<uint8_t>(byte & 0xFu)), sv));
    const uint32_t hi = bf16_rne(fmul_rn(e2m1_to_f32(static_cast<uint8_t>(byte >> 4)), sv));
    packed[i] = lo | (hi << 16);
  }
  uint4* dst = reinterpret_cast<uint4*>(out + r * q.cols + c0);
  dst[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  dst[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
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

// alpha' (and beta) on the device, from the operands' amax: no host synchronisation.
__global__ void epilogue_scalars_kernel(QuantizedView a, QuantizedView b, float alpha, float beta,
                                        float* out) {
  out[0] = gemm_epilogue_alpha(alpha, a.format, *a.amax, a.four_over_six, *b.amax, b.four_over_six);
  out[1] = beta;
}

enum class PlanKind { Bf16HostScalars, Bf16DeviceScalars, Nvfp4Native, Mxfp4Native };

// One GEMM shape's cuBLASLt descriptors and chosen algorithm, built once and reused.
struct GemmPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

// A device scratch buffer that only grows (stream-ordered reuse: every user runs on one stream).
struct Scratch {
  void* ptr = nullptr;
  size_t bytes = 0;
  void* get(size_t need) {
    if (need > bytes) {
      if (ptr) FP4SIM_CUDA_CHECK(cudaFree(ptr));  // (synchronises: earlier users are done)
      FP4SIM_CUDA_CHECK(cudaMalloc(&ptr, need));
      bytes = need;
    }
    return ptr;
  }
  ~Scratch() {
    if (ptr) cudaFree(ptr);
  }
};

}  // namespace

struct CublasLtState {
  int cc_major = 0;  // compute capability of the current device
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 64u << 20;
  std::map<std::tuple<PlanKind, int64_t, int64_t, int64_t>, GemmPlan> plans;
  Scratch a_bf16, b_bf16, d_f32, a_tiled, b_tiled, scalars;
  ~CublasLtState() {
    for (auto& kv : plans) {
      cublasLtMatrixLayoutDestroy(kv.second.la);
      cublasLtMatrixLayoutDestroy(kv.second.lb);
      cublasLtMatrixLayoutDestroy(kv.second.lc);
      cublasLtMatmulDescDestroy(kv.second.op);
    }
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

namespace {

// D_rm [M, N] = alpha * A_rm [M, K] * B_rm [N, K]^T + beta * C_rm: in cuBLASLt's column-major
// terms D^T (N x M) = op(B^T as K x N, transposed) * (A^T as K x M): "TN", lda = ldb = K, ldd = N.
// The plan for (kind, M, N, K) is built and its algorithm chosen by the heuristic on first use.
GemmPlan& plan_for(CublasLtState& st, PlanKind kind, int64_t M, int64_t N, int64_t K) {
  const auto key = std::make_tuple(kind, M, N, K);
  auto it = st.plans.find(key);
  if (it != st.plans.end()) return it->second;
  GemmPlan p;
  const bool native = kind == PlanKind::Nvfp4Native || kind == PlanKind::Mxfp4Native;
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  if (kind != PlanKind::Bf16HostScalars) {
    const cublasLtPointerMode_t pm = CUBLASLT_POINTER_MODE_DEVICE;
    FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pm, sizeof pm));
  }
  if (native) {
    const int32_t mode = kind == PlanKind::Mxfp4Native ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0
                                                       : CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3;
    FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof mode));
    FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof mode));
  }
  const cudaDataType_t in = native ? CUDA_R_4F_E2M1 : CUDA_R_16BF;
  FP4SIM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.la, in, K, N, K));
  FP4SIM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.lb, in, K, M, K));
  FP4SIM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.lc, CUDA_R_32F, N, M, N));
  cublasLtMatmulPreference_t pref;
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &st.workspace_bytes, sizeof st.workspace_bytes));
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(st.handle, p.op, p.la, p.lb, p.lc, p.lc, pref, 1, &heur, &found));
  cublasLtMatmulPreferenceDestroy(pref);
  if (found == 0)
    throw std::runtime_error(std::string("cuBLASLt found no ") + (native ? "native FP4" : "BF16") +
                             " GEMM algorithm for M=" + std::to_string(M) + " N=" + std::to_string(N) +
                             " K=" + std::to_string(K));
  p.algo = heur.algo;
  return st.plans.emplace(key, p).first->second;
}

}  // namespace

void bf16_gemm_tn(CublasLtState& st, const uint16_t* a, const uint16_t* b, const float* c, float* d,
                  int64_t M, int64_t N, int64_t K, float alpha, float beta, cudaStream_t stream) {
  GemmPlan& p = plan_for(st, PlanKind::Bf16HostScalars, M, N, K);
  FP4SIM_CUBLAS_CHECK(cublasLtMatmul(st.handle, p.op, &alpha, b, p.la, a, p.lb, &beta, c ? c : d, p.lc, d, p.lc,
                                     &p.algo, st.workspace, st.workspace_bytes, stream));
}

namespace {

// Blackwell: cuBLASLt's native block-scaled FP4 GEMM, same TN mapping as bf16_gemm_tn; scales
// re-laid out into the 128x4 tiles, alpha' and beta as device pointers.
void fp4_native_gemm_tn(CublasLtState& st, const QuantizedView& a, const QuantizedView& b,
                        const float* c, float* d, const float* scalars, cudaStream_t stream) {
  const int64_t M = a.rows, N = b.rows, K = a.cols;
  const bool mx = a.format == QFormat::MXFP4;
  const int64_t kb = K / (mx ? kMxfp4Block : kNvfp4Block);
  auto* sa = static_cast<uint8_t*>(st.a_tiled.get(tiled_scale_bytes(M, kb)));
  auto* sb = static_cast<uint8_t*>(st.b_tiled.get(tiled_scale_bytes(N, kb)));
  scales_to_tiled_launch(a.scales, M, kb, sa, stream);
  scales_to_tiled_launch(b.scales, N, kb, sb, stream);
  GemmPlan& p = plan_for(st, mx ? PlanKind::Mxfp4Native : PlanKind::Nvfp4Native, M, N, K);
  // cuBLASLt's A is our B (N x K) and its B is our A (M x K)
  const void* scale_a = sb;
  const void* scale_b = sa;
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a, sizeof scale_a));
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b, sizeof scale_b));
  FP4SIM_CUBLAS_CHECK(cublasLtMatmul(st.handle, p.op, scalars, b.codes, p.la, a.codes, p.lb, scalars + 1,
                                     c ? c : d, p.lc, d, p.lc, &p.algo, st.workspace, st.workspace_bytes, stream));
}

}  // namespace

void gemm_cublaslt_launch(CublasLtState& st, const QuantizedView& a, const QuantizedView& b,
                          const float* c, const GemmConfig& cfg, void* out, cudaStream_t stream) {
  const int64_t M = a.rows, N = b.rows, K = a.cols;
  // alpha' = alpha * (global decode scales) and beta, computed on the device from the amax values
  auto* scalars = static_cast<float*>(st.scalars.get(2 * sizeof(float)));
  epilogue_scalars_kernel<<<1, 1, 0, stream>>>(a, b, cfg.alpha, cfg.beta, scalars);
  FP4SIM_CUDA_CHECK_LAUNCH();
  const bool f32_out = cfg.out == GemmOut::F32;
  float* d = f32_out ? static_cast<float*>(out)
                     : static_cast<float*>(st.d_f32.get(static_cast<size_t>(M * N) * 4));
  const float* cc = cfg.beta != 0.0f ? c : nullptr;
  if (st.cc_major >= 10) {  // Blackwell: native FP4 (never reached on Hopper)
    fp4_native_gemm_tn(st, a, b, cc, d, scalars, stream);
  } else {
    auto* da = static_cast<uint16_t*>(st.a_bf16.get(static_cast<size_t>(M * K) * 2));
    auto* db = static_cast<uint16_t*>(st.b_bf16.get(static_cast<size_t>(N * K) * 2));
    const int64_t chunks_a = M * (K / kDequantChunk), chunks_b = N * (K / kDequantChunk);
    dequantize_block_scaled_bf16<<<static_cast<unsigned>((chunks_a + kDequantThreads - 1) / kDequantThreads),
                                   kDequantThreads, 0, stream>>>(a, da);
    FP4SIM_CUDA_CHECK_LAUNCH();
    dequantize_block_scaled_bf16<<<static_cast<unsigned>((chunks_b + kDequantThreads - 1) / kDequantThreads),
                                   kDequantThreads, 0, stream>>>(b, db);
    FP4SIM_CUDA_CHECK_LAUNCH();
    GemmPlan& p = plan_for(st, PlanKind::Bf16DeviceScalars, M, N, K);
    FP4SIM_CUBLAS_CHECK(cublasLtMatmul(st.handle, p.op, scalars, db, p.la, da, p.lb, scalars + 1, cc ? cc : d,
                                       p.lc, d, p.lc, &p.algo, st.workspace, st.workspace_bytes, stream));
  }
  if (!f32_out) {
    f32_to_bf16_kernel<<<grid_for(M * N), 256, 0, stream>>>(d, static_cast<uint16_t*>(out), M * N);
    FP4SIM_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace fp4sim::gpu
