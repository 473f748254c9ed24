// The fast GEMM path (--gemm cublaslt). On Hopper: each operand is dequantized to BF16 without its
// global scale (e2m1 * block scale has at most 6 significant bits, exact in BF16), multiplied by
// cuBLASLt's BF16 GEMM with FP32 accumulation, and the global scales go into alpha, as in the exact
// path. Results differ from the exact GEMM by accumulation order and rounding only; the bound is
// gemm_cublaslt_bound (emu/gemm.hpp). On Blackwell (compute capability 10.x / 12.x, chosen at run
// time) the operands go to cuBLASLt natively: CUDA_R_4F_E2M1 codes, VEC16_UE4M3 (NVFP4) or
// VEC32_UE8M0 (MXFP4) block scales in the 128x4 tiled layout, alpha as a device pointer. That path
// compiles here and its scale layout is tested (Quantize.TiledScaleLayoutCheckValues,
// QuantizeGpu.DequantizeAndTiledScalesMatchEmulator), but no Blackwell GPU has run it yet.
//
// FP8 operands (DESIGN.md §9) go to cuBLASLt's block-scaled FP8 GEMM (cuBLAS >= 12.9, native on
// Hopper): CUDA_R_8F_E4M3 codes, FP32 block scales in scale mode VEC128_32F for both operands, the
// same TN mapping, alpha and beta as device pointers; see fp8_gemm_cublaslt_launch.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>

#include "emu/gemm.hpp"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/decode_bf16.cuh"
#include "gpu/formats_device.cuh"

namespace fp4sim::gpu {
namespace {

constexpr int kDequantThreads = 256;
constexpr int64_t kDequantChunk = 8;  // elements per thread: 4 code bytes in, one 16-byte store out

// The decode pass (gpu/decode_bf16.cuh): one thread decodes 8 consecutive elements of row r (4 code
// bytes, one scale byte) into one 16-byte store. ncu on the H200: with the generic decoders
// (e2m1_to_f32, bf16_rne) and 64-bit divisions the kernel was issue-bound (SM 87%, DRAM 26%,
// 256 us for two 8192 x 8192 operands); rows come from the grid, the block from a shift.
// Both operands in one launch: grid rows [0, a.rows) are a's, the rest b's (rows beyond the grid's
// y extent are walked with a stride); x covers the 8-element chunks of a row.
// alpha' = alpha * (global decode scales of a and b, from their amax) and beta, to out[0..1]: the
// GEMM's device scalars, with no host synchronisation.
__device__ __forceinline__ void write_epilogue_scalars(const QuantizedView& a,
                                                       const QuantizedView& b, float alpha,
                                                       float beta, float* out) {
  out[0] = gemm_epilogue_alpha(alpha, a.format, *a.amax, a.four_over_six, *b.amax, b.four_over_six);
  out[1] = beta;
}

// Its first thread also writes the GEMM's alpha' and beta to `scalars` (write_epilogue_scalars,
// from the amax of a and b, which a view with rows = 0 still carries): one launch fewer before a
// GEMM that decodes an operand.
__global__ void dequantize_block_scaled_bf16(QuantizedView a, uint16_t* da, QuantizedView b,
                                             uint16_t* db, float alpha, float beta,
                                             float* scalars) {
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0)
    write_epilogue_scalars(a, b, alpha, beta, scalars);
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kDequantChunk;
  if (c0 >= a.cols) return;  // a.cols == b.cols == K
  for (int64_t row = blockIdx.y; row < a.rows + b.rows; row += gridDim.y) {
    if (row < a.rows)
      dequantize_chunk_bf16(a, da, row, c0);
    else
      dequantize_chunk_bf16(b, db, row - a.rows, c0);
  }
}

// The same decode over a flat index: a dense operand (rows x K, K a multiple of 16) is a run of
// 4-byte code words of 8 elements each, word w's scale is byte w >> 1 (NVFP4, 16 elements a scale)
// or w >> 2 (MXFP4, 32) and its 8 outputs the 16 bytes at element 8w, whatever the row. Both
// operands' words numbered together (a's first) and walked by a 1-D grid, each warp taking 32 *
// kFlatUnroll consecutive words, lane l the words l, l + 32, ...: every load (128 bytes of codes a
// warp) and every store (512 bytes) is contiguous, kFlatUnroll loads in flight a thread, and no
// thread idles on a short row. The 8-element kernel's 2-D grid left 160 of a CTA's 256 threads
// idle on a weight's K = 768 (96 chunks), and a 32-element-a-thread version (one 16-byte code load,
// four 16-byte stores 64 bytes apart) ran slower still in the training step: 1.79 ms against
// 1.14 ms a nvfp4 step (ncu, 80 launches). Needs 4-byte aligned codes, 16-byte aligned decoded
// buffers and fewer than 2^31 words (dequantize_flat_ok); the first thread writes alpha' and beta.
constexpr int kFlatUnroll = 4;
// Word w of the joint numbering (a's words first) as an index into its own operand.
__device__ __forceinline__ uint32_t flat_index(uint32_t w, uint32_t a_words) {
  return w < a_words ? w : w - a_words;
}
__global__ void dequantize_flat_bf16(QuantizedView a, uint16_t* da, QuantizedView b, uint16_t* db,
                                     float alpha, float beta, float* scalars) {
  if (blockIdx.x == 0 && threadIdx.x == 0) write_epilogue_scalars(a, b, alpha, beta, scalars);
  const uint32_t a_words = static_cast<uint32_t>(a.rows * a.cols / 8);
  const uint32_t total = a_words + static_cast<uint32_t>(b.rows * b.cols / 8);
  const uint32_t lane = threadIdx.x & 31u;
  constexpr uint32_t kSpan = 32u * kFlatUnroll;
  const uint32_t warps = gridDim.x * (blockDim.x / 32u);
  for (uint32_t base = (blockIdx.x * (blockDim.x / 32u) + (threadIdx.x >> 5)) * kSpan; base < total;
       base += warps * kSpan) {
    uint32_t codes[kFlatUnroll];
    uint8_t sbyte[kFlatUnroll];
#pragma unroll
    for (int j = 0; j < kFlatUnroll; ++j) {
      const uint32_t w = base + j * 32u + lane;
      if (w < total) {
        const bool in_a = w < a_words;
        const uint32_t lw = flat_index(w, a_words);
        const QFormat f = in_a ? a.format : b.format;
        codes[j] = reinterpret_cast<const uint32_t*>(in_a ? a.codes : b.codes)[lw];
        sbyte[j] = (in_a ? a.scales : b.scales)[f == QFormat::MXFP4 ? lw >> 2 : lw >> 1];
      }
    }
    // (the decode loop recomputes w's operand and index: keeping them from the load loop in arrays
    // took the kernel from 32 to 37 registers, 8 to 6 CTAs an SM; ptxas)
#pragma unroll
    for (int j = 0; j < kFlatUnroll; ++j) {
      const uint32_t w = base + j * 32u + lane;
      if (w < total) {
        const bool in_a = w < a_words;
        const QFormat f = in_a ? a.format : b.format;
        uint16_t* out = (in_a ? da : db) + static_cast<size_t>(flat_index(w, a_words)) * 8;
        const float sv = block_scale_value(f, sbyte[j]);
        if (f == QFormat::NVFP4)
          decode8_bf16_nvfp4(codes[j], sv, out);
        else
          decode8_bf16(codes[j], sv, out);
      }
    }
  }
}

// Whether dequantize_flat_bf16 can decode the operands (a view with rows = 0 is skipped).
bool dequantize_flat_ok(const QuantizedView& a, const uint16_t* da, const QuantizedView& b,
                        const uint16_t* db) {
  const auto aligned = [](const void* p, uintptr_t n) {
    return reinterpret_cast<uintptr_t>(p) % n == 0;
  };
  const int64_t words = (a.rows * a.cols + b.rows * b.cols) / 8;
  const auto blocks_whole = [](const QuantizedView& q) {
    return q.cols % (q.format == QFormat::MXFP4 ? 32 : 16) == 0;
  };
  return blocks_whole(a) && blocks_whole(b) && words < (int64_t{1} << 31) &&
         (a.rows == 0 || (aligned(a.codes, 4) && aligned(da, 16))) &&
         (b.rows == 0 || (aligned(b.codes, 4) && aligned(db, 16)));
}

__global__ void f32_to_bf16_kernel(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = bf16_rne_cvt(in[i]);
}

int grid_for(int64_t n) {
  const int64_t b = (n + 255) / 256;
  return static_cast<int>(b < 132 * 64 ? (b > 0 ? b : 1) : 132 * 64);
}

// alpha' (and beta) on the device where no decode launch writes them.
__global__ void epilogue_scalars_kernel(QuantizedView a, QuantizedView b, float alpha, float beta,
                                        float* out) {
  write_epilogue_scalars(a, b, alpha, beta, out);
}

// FP8 has no global scales: alpha' = alpha. Written on the device like the FP4 path's scalars (and
// without reading the operands' amax, which the FP8 GEMM never needs).
__global__ void fp8_epilogue_scalars_kernel(float alpha, float beta, float* out) {
  out[0] = alpha;
  out[1] = beta;
}

// Our FP8 scales [rows, k_blocks] (row-major FP32, one per row and 128-wide k-block) -> the layout
// cuBLASLt reads for VEC128_32F: [k_blocks, rows], rows contiguous ("outer-dimension major"),
// i.e. out[b * rows + r] = scales[r * k_blocks + b]. rows is a multiple of 8 here (checked by the
// launcher), so this is also Transformer Engine's GEMM-ready layout [ceil(K/128), roundup(rows,
// 4)]. A pure copy: the scale values are unchanged. One thread per output element (coalesced
// writes).
__global__ void fp8_scales_to_vec128_kernel(const float* scales, int64_t rows, int64_t k_blocks,
                                            float* out, const float* scales2, int64_t rows2,
                                            float* out2) {
  // both operands in one launch (a GEMM's two transposes cost one launch, not two): indices
  // [0, rows * k_blocks) are the first's, the rest the second's (same k_blocks)
  const int64_t n1 = rows * k_blocks, n = n1 + rows2 * k_blocks;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const bool first = j < n1;
    const int64_t i = first ? j : j - n1, R = first ? rows : rows2;
    const int64_t blk = i / R, r = i % R;
    (first ? out : out2)[i] = (first ? scales : scales2)[r * k_blocks + blk];
  }
}

enum class PlanKind { Bf16HostScalars, Bf16DeviceScalars, Nvfp4Native, Mxfp4Native, Fp8Vec128 };

const char* plan_kind_name(PlanKind kind) {
  switch (kind) {
    case PlanKind::Bf16HostScalars:
    case PlanKind::Bf16DeviceScalars:
      return "BF16";
    case PlanKind::Nvfp4Native:
      return "native NVFP4 (VEC16_UE4M3)";
    case PlanKind::Mxfp4Native:
      return "native MXFP4 (VEC32_UE8M0)";
    case PlanKind::Fp8Vec128:
      return "block-scaled FP8 (E4M3, VEC128_32F)";
  }
  return "?";
}

// One GEMM shape's cuBLASLt descriptors and chosen algorithm, built once and reused.
struct GemmPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool host_scalars = false;  // alpha and beta are host pointers (else device pointers)
};

void destroy_plan(GemmPlan& p) {
  if (p.la) cublasLtMatrixLayoutDestroy(p.la);
  if (p.lb) cublasLtMatrixLayoutDestroy(p.lb);
  if (p.lc) cublasLtMatrixLayoutDestroy(p.lc);
  if (p.op) cublasLtMatmulDescDestroy(p.op);
  p = GemmPlan{};
}

}  // namespace

struct CublasLtState {
  int cc_major = 0;    // compute capability of the current device
  size_t version = 0;  // cublasLtGetVersion(): major * 10000 + minor * 100 + patch
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = kGemmCublasLtWorkspaceBytes;  // (gpu/capabilities.hpp)
  std::map<std::tuple<PlanKind, int64_t, int64_t, int64_t>, GemmPlan> plans;
  int heuristic_pick = kPlanOwnPick;  // CudaOptions::cublaslt_heuristic_pick
  CublasLtPlanPick last_pick;         // what the most recently built plan chose
  // (gpu/device_scratch.hpp)
  DeviceScratch a_bf16{"cuBLASLt GEMM decoded A"}, b_bf16{"cuBLASLt GEMM decoded B"},
      d_f32{"cuBLASLt GEMM FP32 output"}, a_tiled{"cuBLASLt GEMM tiled scales A"},
      b_tiled{"cuBLASLt GEMM tiled scales B"}, scalars{"cuBLASLt GEMM scalars"};
  ~CublasLtState() {
    for (auto& kv : plans) destroy_plan(kv.second);
    if (workspace) cudaFree(workspace);
    if (handle) cublasLtDestroy(handle);
  }
};

std::shared_ptr<CublasLtState> make_cublaslt_state(int heuristic_pick) {
  if (heuristic_pick < kPlanOwnPick || heuristic_pick > kMaxHeuristicPick)
    throw std::invalid_argument(
        "make_cublaslt_state: heuristic index " + std::to_string(heuristic_pick) + " is outside " +
        std::to_string(kPlanOwnPick) + ".." + std::to_string(kMaxHeuristicPick));
  auto s = std::make_shared<CublasLtState>();
  s->heuristic_pick = heuristic_pick;
  FP4SIM_CUBLAS_CHECK(cublasLtCreate(&s->handle));
  int dev = 0;
  FP4SIM_CUDA_CHECK(cudaGetDevice(&dev));
  FP4SIM_CUDA_CHECK(cudaDeviceGetAttribute(&s->cc_major, cudaDevAttrComputeCapabilityMajor, dev));
  s->version = cublasLtGetVersion();
  device_malloc(&s->workspace, s->workspace_bytes, "the block-scaled GEMMs' cuBLASLt workspace");
  return s;
}

std::string cublaslt_version() {
  const size_t v = cublasLtGetVersion();
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

CublasLtPlanPick cublaslt_last_pick(const CublasLtState& st) { return st.last_pick; }

bool cublaslt_picks_measured_here(int cc_major, size_t lt_version) {
  return cc_major == 9 && lt_version / 100 == 1301;
}

namespace {

// Where the heuristic's first block-scaled FP8 algorithm is measurably not its best (H200,
// cuBLASLt 13.1, `scripts/gpu_check.sh picks`: bench_gemm's BM_GpuGemmFp8 at every index of the
// heuristic's list, docs/performance.md), the index the FP8 plan takes instead:
// - 1 where K is at least 4 max(M, N) and the output has at least 2^21 elements (gpt2-124m's MLP
//   Wgrads, 3072 x 768 and 768 x 3072 over K = 16384 tokens: a 192x64 split-K kernel first, 145 /
//   153 us, the second 109 / 115 us; on the smaller Wgrads, 2304 x 768 and 768 x 768, the first was
//   the fastest of the list);
// - 6 for a tall output over a short K (M >= 4 max(N, K), K < 3072: gpt2-124m's Fprops of the QKV,
//   projection and FC layers and the Dgrads of the QKV, projection and FC2 layers; fprop qkv
//   16384 x 2304 x 768 92.6 -> 82.3 us, fprop fc 16384 x 3072 x 768 119.6 -> 108.5 us, dgrad proj
//   46.5 -> 43.6 us, none slower; at K = 3072, fprop fc2 and dgrad fc, index 6 was 2-5% slower).
// 0 (the heuristic's first) everywhere else, and where the list is shorter than the index. A
// fixed rule, not a timing at run time, so that every run of a configuration multiplies with the
// same algorithm and gets the same bits (resume stays bitwise); it indexes the heuristic list of
// the cuBLASLt release it was measured on (13.1.x), and other releases keep their first choice.
bool picks_measured_here(const CublasLtState& st) {
  return cublaslt_picks_measured_here(st.cc_major, st.version);
}

int fp8_preferred_algo(const CublasLtState& st, int64_t M, int64_t N, int64_t K) {
  if (!picks_measured_here(st)) return 0;
  if (K >= 4 * std::max(M, N) && M * N >= (int64_t{1} << 21)) return 1;
  if (M >= 4 * std::max(N, K) && K < 3072) return 6;
  return 0;
}

// The same for the BF16 plans (TN, FP32 out: the FP4 path's GEMMs on Hopper, decoded operands,
// alpha' and beta on the device; and the host-scalar plan): index 6 for a tall output over a short
// K (M >= 4 max(N, K), K <= 1024). H200, cuBLASLt 13.1, bench_gemm BM_GpuGemmScalarModes at every
// index, beta 0 (as the FP4 path's Fprops and Dgrads run), device scalars: 16384 x 2304 x 768 103.0
// -> 91.5 us, 16384 x 768 x 768 38.7 -> 34.6 us, 16384 x 3072 x 768 131.9 -> 112.8 us (host
// scalars: 101.8 -> 89.5, 38.8 -> 34.3, 132.6 -> 110.3); at K = 3072 index 6 was no faster, and the
// Wgrads (K = 16384) ran fastest at index 0. Same conditions as fp8_preferred_algo.
int bf16_preferred_algo(const CublasLtState& st, int64_t M, int64_t N, int64_t K) {
  if (!picks_measured_here(st)) return 0;
  return M >= 4 * std::max(N, K) && K <= 1024 ? 6 : 0;
}

// D_rm [M, N] = alpha * A_rm [M, K] * B_rm [N, K]^T + beta * C_rm: in cuBLASLt's column-major
// terms D^T (N x M) = op(B^T as K x N, transposed) * (A^T as K x M): "TN", lda = ldb = K, ldd = N.
// (TN is also the only FP8 layout Hopper's FP8 kernels take.) Builds the descriptors for `kind` and
// asks the heuristic for one algorithm; false (descriptors destroyed, status kept) when it has
// none.
bool try_build_plan(CublasLtState& st, PlanKind kind, int64_t M, int64_t N, int64_t K,
                    bool host_scalars, GemmPlan& p, cublasStatus_t& status) {
  const bool fp4_native = kind == PlanKind::Nvfp4Native || kind == PlanKind::Mxfp4Native;
  const bool fp8 = kind == PlanKind::Fp8Vec128;
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  FP4SIM_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  FP4SIM_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  p.host_scalars = host_scalars;
  if (!host_scalars) {
    // (a device beta makes cuBLASLt run its general-beta kernels: as fast as the beta-0 ones when
    // beta is 0 at run time, 20-47% slower than its beta-1 ones on gpt2-124m's Dgrad shapes when
    // it is 1; H200, bench_gemm BM_GpuGemmScalarModes. A device alpha vector with a host beta,
    // CUBLASLT_POINTER_MODE_ALPHA_DEVICE_VECTOR_BETA_HOST, finds no algorithm: status 15.)
    const cublasLtPointerMode_t pm = CUBLASLT_POINTER_MODE_DEVICE;
    FP4SIM_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pm, sizeof pm));
  }
  if (fp4_native || fp8) {
    const int32_t mode =
        fp8 ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
            : (kind == PlanKind::Mxfp4Native ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0
                                             : CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3);
    FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                                       &mode, sizeof mode));
    FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                                                       &mode, sizeof mode));
    // The heuristic rejects block-scaled modes while the scale pointers are unset (measured on the
    // H200, cuBLASLt 13.1: status 7 for VEC128_32F without them, an algorithm with them). Any
    // aligned device address will do here; every launch sets the real ones before cublasLtMatmul.
    const void* placeholder = st.workspace;
    FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                       &placeholder, sizeof placeholder));
    FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                       &placeholder, sizeof placeholder));
  }
  if (fp8) {
    // No "fast accumulation": partial sums are promoted to FP32 at every scale block (block-scaled
    // FP8 accepts only this mode; set explicitly rather than relying on the default).
    const int8_t fast_accum = 0;
    FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                                                       &fast_accum, sizeof fast_accum));
  }
  const cudaDataType_t in = fp8 ? CUDA_R_8F_E4M3 : (fp4_native ? CUDA_R_4F_E2M1 : CUDA_R_16BF);
  FP4SIM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.la, in, K, N, K));
  FP4SIM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.lb, in, K, M, K));
  FP4SIM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.lc, CUDA_R_32F, N, M, N));
  cublasLtMatmulPreference_t pref;
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  FP4SIM_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &st.workspace_bytes, sizeof st.workspace_bytes));
  // the heuristic's first algorithm (an option can ask for a later one of its list, and
  // fails the plan where the list is shorter), except for the shapes of fp8_preferred_algo and
  // bf16_preferred_algo, which fall back to the first where the list is shorter
  const bool bf16 = kind == PlanKind::Bf16HostScalars || kind == PlanKind::Bf16DeviceScalars;
  const bool knob = st.heuristic_pick != kPlanOwnPick;
  const int pick = knob   ? st.heuristic_pick
                   : fp8  ? fp8_preferred_algo(st, M, N, K)
                   : bf16 ? bf16_preferred_algo(st, M, N, K)
                          : 0;
  cublasLtMatmulHeuristicResult_t heur[kMaxHeuristicPick + 1]{};
  int found = 0;
  status = cublasLtMatmulAlgoGetHeuristic(st.handle, p.op, p.la, p.lb, p.lc, p.lc, pref, pick + 1,
                                          heur, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (status != CUBLAS_STATUS_SUCCESS || found == 0 || (knob && found <= pick)) {
    if (status == CUBLAS_STATUS_SUCCESS) status = CUBLAS_STATUS_NOT_SUPPORTED;
    destroy_plan(p);
    return false;
  }
  const int used = found > pick ? pick : 0;
  p.algo = heur[used].algo;
  st.last_pick = CublasLtPlanPick{picks_measured_here(st), pick, found, used};
  return true;
}

// The plan for (kind, M, N, K), built on first use. Alpha and beta go as device pointers for the
// FP4 kinds (alpha' depends on the operands' amax, on the device), as host pointers for
// Bf16HostScalars and (when the heuristic has an algorithm for them, else device) for FP8.
GemmPlan& plan_for(CublasLtState& st, PlanKind kind, int64_t M, int64_t N, int64_t K) {
  const auto key = std::make_tuple(kind, M, N, K);
  auto it = st.plans.find(key);
  if (it != st.plans.end()) return it->second;
  GemmPlan p;
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  // FP8 has no global scale, so its alpha and beta are known on the host: host scalars let cuBLASLt
  // run its beta-0 / beta-1 kernels (a device beta forces its slower general-beta ones) and need
  // no kernel to write them; device pointers only where the heuristic has nothing for host ones
  const bool fp8 = kind == PlanKind::Fp8Vec128;
  bool ok = try_build_plan(st, kind, M, N, K, kind == PlanKind::Bf16HostScalars || fp8, p, status);
  if (!ok && fp8) ok = try_build_plan(st, kind, M, N, K, false, p, status);
  if (!ok) {
    std::string msg = std::string("cuBLASLt found no ") + plan_kind_name(kind) +
                      " GEMM algorithm for M=" + std::to_string(M) + " N=" + std::to_string(N) +
                      " K=" + std::to_string(K) + " (heuristic status " +
                      std::to_string(static_cast<int>(status)) + ", compute capability " +
                      std::to_string(st.cc_major) + ".x)";
    if (kind == PlanKind::Fp8Vec128)
      msg +=
          "; cuBLASLt's block-scaled FP8 needs cuBLAS >= 12.9 and is native on Hopper (sm_90); use "
          "--gemm exact";
    throw std::runtime_error(msg);
  }
  return st.plans.emplace(key, p).first->second;
}

}  // namespace

void bf16_gemm_tn(CublasLtState& st, const uint16_t* a, const uint16_t* b, const float* c, float* d,
                  int64_t M, int64_t N, int64_t K, float alpha, float beta, cudaStream_t stream) {
  bf16_gemm_tn_scalars(st, Bf16Scalars::Host, a, b, c, d, M, N, K, &alpha, &beta, stream);
}

void bf16_gemm_tn_scalars(CublasLtState& st, Bf16Scalars mode, const uint16_t* a, const uint16_t* b,
                          const float* c, float* d, int64_t M, int64_t N, int64_t K,
                          const float* alpha, const float* beta, cudaStream_t stream) {
  GemmPlan& p = plan_for(
      st, mode == Bf16Scalars::Host ? PlanKind::Bf16HostScalars : PlanKind::Bf16DeviceScalars, M, N,
      K);
  FP4SIM_CUBLAS_CHECK(cublasLtMatmul(st.handle, p.op, alpha, b, p.la, a, p.lb, beta, c ? c : d,
                                     p.lc, d, p.lc, &p.algo, st.workspace, st.workspace_bytes,
                                     stream));
}

namespace {

// Blackwell: cuBLASLt's native block-scaled FP4 GEMM, same TN mapping as bf16_gemm_tn; scales
// re-laid out into the 128x4 tiles, alpha' and beta as device pointers.
void fp4_native_gemm_tn(CublasLtState& st, const QuantizedView& a, const QuantizedView& b,
                        const float* c, float* d, const float* scalars, cudaStream_t stream) {
  const int64_t M = a.rows, N = b.rows, K = a.cols;
  const bool mx = a.format == QFormat::MXFP4;
  const int64_t kb = K / (mx ? kMxfp4Block : kNvfp4Block);
  auto* sa = st.a_tiled.get<uint8_t>(tiled_scale_bytes(M, kb), stream);
  auto* sb = st.b_tiled.get<uint8_t>(tiled_scale_bytes(N, kb), stream);
  scales_to_tiled_launch(a.scales, M, kb, sa, stream);
  scales_to_tiled_launch(b.scales, N, kb, sb, stream);
  GemmPlan& p = plan_for(st, mx ? PlanKind::Mxfp4Native : PlanKind::Nvfp4Native, M, N, K);
  // cuBLASLt's A is our B (N x K) and its B is our A (M x K)
  const void* scale_a = sb;
  const void* scale_b = sa;
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                     &scale_a, sizeof scale_a));
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                     &scale_b, sizeof scale_b));
  FP4SIM_CUBLAS_CHECK(cublasLtMatmul(st.handle, p.op, scalars, b.codes, p.la, a.codes, p.lb,
                                     scalars + 1, c ? c : d, p.lc, d, p.lc, &p.algo, st.workspace,
                                     st.workspace_bytes, stream));
}

}  // namespace

void gemm_cublaslt_launch(CublasLtState& st, const QuantizedView& a, const QuantizedView& b,
                          const float* c, const GemmConfig& cfg, void* out, cudaStream_t stream) {
  if (a.format == QFormat::FP8) {  // (epilogue_scalars_kernel below would read the FP4 global amax)
    fp8_gemm_cublaslt_launch(st, a, b, c, cfg, out, stream);
    return;
  }
  const int64_t M = a.rows, N = b.rows, K = a.cols;
  // alpha' = alpha * (global decode scales) and beta, computed on the device from the amax values:
  // by the decode kernel where one runs (Hopper, an operand without its decoded copy), else here
  auto* scalars = st.scalars.get<float>(2, stream);
  const bool decode = st.cc_major < 10 && (!a.decoded_bf16 || !b.decoded_bf16);
  if (!decode) {
    epilogue_scalars_kernel<<<1, 1, 0, stream>>>(a, b, cfg.alpha, cfg.beta, scalars);
    FP4SIM_CUDA_CHECK_LAUNCH();
  }
  const bool f32_out = cfg.out == GemmOut::F32;
  float* d =
      f32_out ? static_cast<float*>(out) : st.d_f32.get<float>(static_cast<size_t>(M * N), stream);
  const float* cc = cfg.beta != 0.0f ? c : nullptr;
  if (st.cc_major >= 10) {  // Blackwell: native FP4 (never reached on Hopper)
    fp4_native_gemm_tn(st, a, b, cc, d, scalars, stream);
  } else {
    // an operand whose quantizer already wrote its decoded BF16 copy is read from there (same
    // bits); the others are decoded into scratch, both in one launch (a view with rows = 0 is
    // skipped)
    const uint16_t* da = a.decoded_bf16;
    const uint16_t* db = b.decoded_bf16;
    if (decode) {
      QuantizedView pa = a, pb = b;
      uint16_t* wa = nullptr;
      uint16_t* wb = nullptr;
      if (da)
        pa.rows = 0;
      else
        da = wa = st.a_bf16.get<uint16_t>(static_cast<size_t>(M * K), stream);
      if (db)
        pb.rows = 0;
      else
        db = wb = st.b_bf16.get<uint16_t>(static_cast<size_t>(N * K), stream);
      const int64_t rows = pa.rows + pb.rows;
      if (dequantize_flat_ok(pa, wa, pb, wb)) {
        dequantize_flat_bf16<<<grid_stride_blocks(rows * K / 8 / kFlatUnroll, kDequantThreads),
                               kDequantThreads, 0, stream>>>(pa, wa, pb, wb, cfg.alpha, cfg.beta,
                                                             scalars);
      } else {
        const dim3 grid(
            static_cast<unsigned>((K / kDequantChunk + kDequantThreads - 1) / kDequantThreads),
            static_cast<unsigned>(rows < 65535 ? rows : 65535));
        dequantize_block_scaled_bf16<<<grid, kDequantThreads, 0, stream>>>(
            pa, wa, pb, wb, cfg.alpha, cfg.beta, scalars);
      }
      FP4SIM_CUDA_CHECK_LAUNCH();
    }
    bf16_gemm_tn_scalars(st, Bf16Scalars::Device, da, db, cc, d, M, N, K, scalars, scalars + 1,
                         stream);
  }
  if (!f32_out) {
    f32_to_bf16_kernel<<<grid_for(M * N), 256, 0, stream>>>(d, static_cast<uint16_t*>(out), M * N);
    FP4SIM_CUDA_CHECK_LAUNCH();
  }
}

// FP8 (E4M3 codes, FP32 scale per row and 128-wide k-block) through cuBLASLt's block-scaled FP8
// GEMM: D = alpha * sum_blocks (s_a * s_b * A_blk . B_blk) (+ beta * C). Scale mode VEC128_32F (one
// FP32 scale per 128 consecutive K elements of each row) for BOTH operands, also for a weight
// quantized in 128x128 tiles: QuantizedView does not record which it is, and a tile copy stores its
// tile's scale on each of the tile's 128 rows, so the per-row reading is exactly the tile scaling
// (BLK128x128_32F would only save scale traffic, and would need a compacted [rows/128, K/128]
// array). Numerics: cuBLASLt's own (Hopper: FP8 wgmma partial sums promoted to FP32 with the scales
// applied at every 128-block, in an order and with a split-K of its choosing), compared with the
// exact model within a bound (tests/gpu/test_fp8_cublaslt_gpu.cpp). Unverified on hardware so far.
void fp8_gemm_cublaslt_launch(CublasLtState& st, const QuantizedView& a, const QuantizedView& b,
                              const float* c, const GemmConfig& cfg, void* out,
                              cudaStream_t stream) {
  const int64_t M = a.rows, N = b.rows, K = a.cols;
  if (a.format != QFormat::FP8 || b.format != QFormat::FP8)
    throw std::invalid_argument("gemm (cublaslt, fp8): both operands must be fp8");
  // Transformer Engine's requirement for cuBLASLt's FP8 block scaling (outer dimensions multiples
  // of 8); it also makes the VEC128_32F scale stride (rows) equal to its GEMM-ready roundup(rows,
  // 4).
  constexpr int64_t kOuterAlign = 8;
  if (M % kOuterAlign != 0 || N % kOuterAlign != 0 || K % kFp8Block != 0)
    throw std::invalid_argument(
        "gemm (cublaslt, fp8): A " + shape_str(M, K) + ", B " + shape_str(N, K) +
        ": cuBLASLt's block-scaled FP8 needs the rows of A and B to be multiples of 8 "
        "and K a multiple of 128; use --gemm exact");
  const int64_t kb = K / kFp8Block;
  // the scales in cuBLASLt's layout: as the quantizer wrote them (scales_gemm), else re-laid here
  const float* sa = a.scales_gemm;
  const float* sb = b.scales_gemm;
  if (!sa || !sb) {
    float* ta = st.a_tiled.get<float>(static_cast<size_t>(M * kb), stream);
    float* tb = st.b_tiled.get<float>(static_cast<size_t>(N * kb), stream);
    fp8_scales_to_vec128_kernel<<<grid_for((M + N) * kb), 256, 0, stream>>>(
        reinterpret_cast<const float*>(a.scales), M, kb, ta,
        reinterpret_cast<const float*>(b.scales), N, tb);
    FP4SIM_CUDA_CHECK_LAUNCH();
    sa = ta;
    sb = tb;
  }
  GemmPlan& p = plan_for(st, PlanKind::Fp8Vec128, M, N, K);
  auto* scalars = st.scalars.get<float>(2, stream);
  if (!p.host_scalars) {  // (with host scalars the plan reads alpha and beta from the host)
    fp8_epilogue_scalars_kernel<<<1, 1, 0, stream>>>(cfg.alpha, cfg.beta, scalars);
    FP4SIM_CUDA_CHECK_LAUNCH();
  }
  const bool f32_out = cfg.out == GemmOut::F32;
  float* d =
      f32_out ? static_cast<float*>(out) : st.d_f32.get<float>(static_cast<size_t>(M * N), stream);
  const float* cc = cfg.beta != 0.0f ? c : nullptr;
  // cuBLASLt's A is our B (N x K) and its B is our A (M x K): the scale pointers swap with them
  const void* scale_a = sb;
  const void* scale_b = sa;
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                     &scale_a, sizeof scale_a));
  FP4SIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                     &scale_b, sizeof scale_b));
  const float host_alpha = cfg.alpha, host_beta = cfg.beta;
  const void* alpha_p = p.host_scalars ? static_cast<const void*>(&host_alpha) : scalars;
  const void* beta_p = p.host_scalars ? static_cast<const void*>(&host_beta) : scalars + 1;
  FP4SIM_CUBLAS_CHECK(cublasLtMatmul(st.handle, p.op, alpha_p, b.codes, p.la, a.codes, p.lb, beta_p,
                                     cc ? cc : d, p.lc, d, p.lc, &p.algo, st.workspace,
                                     st.workspace_bytes, stream));
  if (!f32_out) {
    f32_to_bf16_kernel<<<grid_for(M * N), 256, 0, stream>>>(d, static_cast<uint16_t*>(out), M * N);
    FP4SIM_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace fp4sim::gpu
