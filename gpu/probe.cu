// Native checks for owners of Blackwell GPUs (fp4sim probe): the hardware's FP4 conversions and
// block-scaled MMAs against the model. Compiled for every target; the instructions exist only in
// the sm_100a / sm_120a code (cvt.rn...e2m1x2: both; cvt.rs...e2m1x4: sm_100a; mma.sync ...
// kind::mxf4nvf4.block_scale: sm_120a), elsewhere the kernels report "unsupported".
//
// The MMA probe's register fragment layouts are written from the PTX ISA and have NEVER RUN ON
// HARDWARE here (no Blackwell GPU): a mismatch on a real GPU may be a layout error before it is a
// model error. The "layout" case tells the two apart: its answers are exact, whatever the rounding.
// tcgen05.mma (sm_100a) is not probed: it needs tensor-memory allocation, shared-memory matrix
// descriptors and an mbarrier completion, a different issue path from this warp-level one.
#include <cuda_runtime.h>

#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "emu/formats.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/probe.hpp"

namespace fp4sim::gpu {
namespace {

#if defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM120_ALL)
#define FP4SIM_NATIVE_CVT_RN 1
#endif
#if defined(__CUDA_ARCH_FEAT_SM100_ALL)
#define FP4SIM_NATIVE_CVT_RS 1
#endif

// cvt.rn.satfinite.e2m1x2.f32 d, a, b: a's code in the upper nibble of d, b's in the lower.
__device__ uint32_t native_e2m1x2_rn(float a, float b) {
#if defined(FP4SIM_NATIVE_CVT_RN)
  uint16_t d;
  asm("{.reg .b8 t;\n cvt.rn.satfinite.e2m1x2.f32 t, %1, %2;\n cvt.u16.u8 %0, t;}"
      : "=h"(d)
      : "f"(a), "f"(b));
  return d;
#else
  return 0xFFFFFFFFu;
#endif
}

// cvt.rs.satfinite.e2m1x4.f32 d, {a, b, e, f}, rbits (16-bit result).
__device__ uint32_t native_e2m1x4_rs(float a, float b, float e, float f, uint32_t rbits) {
#if defined(FP4SIM_NATIVE_CVT_RS)
  uint16_t d;
  asm("cvt.rs.satfinite.e2m1x4.f32 %0, {%1, %2, %3, %4}, %5;"
      : "=h"(d)
      : "f"(a), "f"(b), "f"(e), "f"(f), "r"(rbits));
  return d;
#else
  (void)a, (void)b, (void)e, (void)f, (void)rbits;
  return 0xFFFFFFFFu;
#endif
}

// Every FP32 bit pattern through the native RN conversion and the model, in the kernel.
__global__ void cvt_rn_sweep_kernel(unsigned long long* mismatches, unsigned int* first_bad,
                                    int* unsupported) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  unsigned long long bad = 0;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (1ull << 32);
       i += stride) {
    const float x = f32_from_bits(static_cast<uint32_t>(i));
    const uint32_t d = native_e2m1x2_rn(x, 0.0f);
    if (d == 0xFFFFFFFFu) {
      *unsupported = 1;
      return;
    }
    if (((d >> 4) & 0xFu) != e2m1_rn_satfinite(x)) {
      ++bad;
      atomicMin(first_bad, static_cast<unsigned int>(i));
    }
  }
  if (bad) atomicAdd(mismatches, bad);
}

// rbits experiments: out[t] = the 16-bit result for rbits[t], inputs 0.25, 1.25, 2.5, 5 (each half
// way between its two grid points, their code pairs {0,1}, {2,3}, {4,5}, {6,7} disjoint).
__global__ void cvt_rs_experiment_kernel(const uint32_t* rbits, uint32_t* out, int n) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < n) out[t] = native_e2m1x4_rs(0.25f, 1.25f, 2.5f, 5.0f, rbits[t]);
}

// ---- Native MMA: mma.sync.aligned.m16n8k64 ... kind::mxf4nvf4.block_scale (sm_120a) -----------
//
// PTX ISA 9.7.14.5.14 (mma): "mma.sync.aligned.m16n8k64.row.col.kind.block_scale.scale_vec_size
// .f32.e2m1.e2m1.f32.stype d, a, b, c, scale-a-data, {byte-id-a, thread-id-a}, scale-b-data,
// {byte-id-b, thread-id-b}"; .kind::mxf4nvf4 with scale_vec::4X (.ue4m3, or .ue8m0 from
// PTX ISA 9.1) or scale_vec::2X (.ue8m0); .kind::mxf4 with scale_vec::2X (.ue8m0).
// Only sm_120a / sm_121a.
#if defined(__CUDA_ARCH_FEAT_SM120_ALL) || defined(__CUDA_ARCH_FEAT_SM121_ALL)
#define FP4SIM_NATIVE_MMA_FP4 1
#endif
// scale_vec::4X with .ue8m0 arrived in PTX ISA 9.1 (CUDA 13.1); CUDA 13.0's ptxas rejects it.
#if defined(__CUDACC_VER_MAJOR__) && \
    (__CUDACC_VER_MAJOR__ > 13 || (__CUDACC_VER_MAJOR__ == 13 && __CUDACC_VER_MINOR__ >= 1))
#define FP4SIM_PTX_HAS_UE8M0_X4 1
#endif

#define FP4SIM_MMA_NVF4_UE4M3_X4                                                                  \
  "mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X.f32.e2m1.e2m1.f32." \
  "ue4m3"
#define FP4SIM_MMA_NVF4_UE8M0_X4                                                                  \
  "mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X.f32.e2m1.e2m1.f32." \
  "ue8m0"
#define FP4SIM_MMA_NVF4_UE8M0_X2                                                                  \
  "mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::2X.f32.e2m1.e2m1.f32." \
  "ue8m0"
#define FP4SIM_MMA_MXF4_UE8M0_X2 \
  "mma.sync.aligned.m16n8k64.row.col.kind::mxf4.block_scale.scale_vec::2X.f32.e2m1.e2m1.f32.ue8m0"
// Operands: d, a (4 x b32), b (2 x b32), c, then scale-a-data {byte-id-a, thread-id-a} and
// scale-b-data {byte-id-b, thread-id-b}. Selectors (PTX ISA 9.7.14.3, Table "Valid values for
// various selector components"): byte-id 0 (4X: all four bytes; 2X: bytes 0 and 1), thread-id-a 0
// (lanes with %laneid % 4 == 0 or 1 give SF_A), thread-id-b 0 (lanes with %laneid % 4 == 0
// give SF_B).
#define FP4SIM_MMA_OPERANDS \
  " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13}, %14, {0, 0}, %15, {0, 0};"

enum MmaVariantId : int {
  kMmaNvf4Ue4m3X4 = 0,  // NVFP4: UE4M3 per 16
  kMmaNvf4Ue8m0X4 = 1,  // UE8M0 per 16
  kMmaNvf4Ue8m0X2 = 2,  // MXFP4 through kind::mxf4nvf4: UE8M0 per 32
  kMmaMxf4Ue8m0X2 = 3,  // MXFP4 through kind::mxf4: UE8M0 per 32
};

constexpr int kTileM = 16, kTileN = 8, kTileK = 64;
constexpr int kScaleSlots = 4;  // scale bytes kept per row of A / column of B (2X uses slots 0, 1)

// One m16n8k64 block-scaled MMA on this lane's fragments; false where the build has no code for it.
template <int V>
__device__ bool native_mma_m16n8k64(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                    const float (&c)[4], uint32_t sfa, uint32_t sfb) {
#if defined(FP4SIM_NATIVE_MMA_FP4)
#define FP4SIM_MMA_ASM(INSTR)                                                                 \
  asm volatile(INSTR FP4SIM_MMA_OPERANDS                                                      \
               : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                               \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), \
                 "f"(c[1]), "f"(c[2]), "f"(c[3]), "r"(sfa), "r"(sfb))
  if constexpr (V == kMmaNvf4Ue4m3X4) {
    FP4SIM_MMA_ASM(FP4SIM_MMA_NVF4_UE4M3_X4);
    return true;
  } else if constexpr (V == kMmaNvf4Ue8m0X2) {
    FP4SIM_MMA_ASM(FP4SIM_MMA_NVF4_UE8M0_X2);
    return true;
  } else if constexpr (V == kMmaMxf4Ue8m0X2) {
    FP4SIM_MMA_ASM(FP4SIM_MMA_MXF4_UE8M0_X2);
    return true;
  } else {
#if defined(FP4SIM_PTX_HAS_UE8M0_X4)
    FP4SIM_MMA_ASM(FP4SIM_MMA_NVF4_UE8M0_X4);
    return true;
#else
    (void)d, (void)a, (void)b, (void)c, (void)sfa, (void)sfb;
    return false;
#endif
  }
#undef FP4SIM_MMA_ASM
#else
  (void)d, (void)a, (void)b, (void)c, (void)sfa, (void)sfb;
  return false;
#endif
}

// One warp per tile. Inputs laid out plainly, one E2M1 code per byte (low nibble):
//   a_codes (T,16,64): A[m][k];  b_codes (T,8,64): B[k][n] stored as column n, k fastest;
//   sfa (T,16,4): row m's scale byte for k-block s;  sfb (T,8,4): column n's;  c (T,16,8) FP32;
//   d (T,16,8): the FP32 bits of D, row-major. unsupported: set to 1 when the build lacks the code.
// Each lane packs its fragments per PTX ISA 9.7.14.5.11 ("Matrix Fragments for mma.m16n8k64",
// .e2m1 rows; kind::mxf4nvf4 takes the codes unpadded, eight per .b32, element i in bits 4i..4i+3,
// "Elements (low to high)"), with groupID = lane >> 2, threadID_in_group = lane % 4:
//   A: a_i (i = 0..31, register i / 8): row = groupID for 0 <= i < 8 || 16 <= i < 24, else
//      groupID + 8; col = threadID_in_group * 8 + (i & 7), + 32 for i >= 16.
//   B: b_i (i = 0..15, register i / 8): row (k) = threadID_in_group * 8 + (i & 7), + 32 for i >= 8;
//      col = groupID.
//   C/D: c_i (i = 0..3): row = groupID for i < 2, else groupID + 8;
//        col = threadID_in_group * 2 + (i & 1).
// Scale operands, PTX ISA 9.7.14.3 ("Block Scaling for mma.sync") with thread-id-a = 0 and
// thread-id-b = 0: byte j of scale-a-data is SF_A of k-block j (16 wide for 4X; 32 wide for 2X,
// bytes 0 and 1 with byte-id 0). The ISA's text says the lane pair %laneid % 4 == 0, 1 of each quad
// gives SF_A and lane %laneid % 4 == 0 gives SF_B; which row each lane of the pair serves is only
// in its Figure 43, read here as CUTLASS's SM120 block-scaled atom does (SFALayout: lane % 4 == 0
// -> row groupID, lane % 4 == 1 -> row groupID + 8; SF_B from column groupID). Lanes 2 and 3 carry
// copies of lanes 0 and 1 (what thread-id-a = 1 would read), every lane carries its column's SF_B.
template <int V>
__global__ void mma_tile_kernel(const uint8_t* a_codes, const uint8_t* b_codes, const uint8_t* sfa,
                                const uint8_t* sfb, const float* c, uint32_t* d, int* unsupported) {
  const int tile = blockIdx.x;
  const int lane = threadIdx.x;
  const int group = lane >> 2, tig = lane & 3;
  const uint8_t* at = a_codes + tile * kTileM * kTileK;
  const uint8_t* bt = b_codes + tile * kTileN * kTileK;
  uint32_t a[4], b[2];
  for (int r = 0; r < 4; ++r) {
    const int row = group + 8 * (r & 1);
    const int col0 = tig * 8 + 32 * (r >> 1);
    uint32_t w = 0;
    for (int j = 0; j < 8; ++j)
      w |= static_cast<uint32_t>(at[row * kTileK + col0 + j] & 0xFu) << (4 * j);
    a[r] = w;
  }
  for (int r = 0; r < 2; ++r) {
    const int k0 = tig * 8 + 32 * r;
    uint32_t w = 0;
    for (int j = 0; j < 8; ++j)
      w |= static_cast<uint32_t>(bt[group * kTileK + k0 + j] & 0xFu) << (4 * j);
    b[r] = w;
  }
  float cf[4], df[4];
  for (int i = 0; i < 4; ++i)
    cf[i] = c[tile * kTileM * kTileN + (group + 8 * (i >> 1)) * kTileN + tig * 2 + (i & 1)];
  const int sfa_row = group + 8 * (tig & 1);
  uint32_t sa = 0, sb = 0;
  for (int s = 0; s < kScaleSlots; ++s) {
    sa |= static_cast<uint32_t>(sfa[(tile * kTileM + sfa_row) * kScaleSlots + s]) << (8 * s);
    sb |= static_cast<uint32_t>(sfb[(tile * kTileN + group) * kScaleSlots + s]) << (8 * s);
  }
  if (!native_mma_m16n8k64<V>(df, a, b, cf, sa, sb)) {
    if (tile == 0 && lane == 0) *unsupported = 1;
    return;
  }
  for (int i = 0; i < 4; ++i)
    d[tile * kTileM * kTileN + (group + 8 * (i >> 1)) * kTileN + tig * 2 + (i & 1)] =
        f32_bits(df[i]);
}

}  // namespace

NativeProbe run_native_probe() {
  NativeProbe p{};
  int dev = 0;
  FP4SIM_CUDA_CHECK(cudaGetDevice(&dev));
  FP4SIM_CUDA_CHECK(cudaDeviceGetAttribute(&p.cc_major, cudaDevAttrComputeCapabilityMajor, dev));
  FP4SIM_CUDA_CHECK(cudaDeviceGetAttribute(&p.cc_minor, cudaDevAttrComputeCapabilityMinor, dev));
  unsigned long long* mism = nullptr;
  unsigned int* first = nullptr;
  int* unsup = nullptr;
  FP4SIM_CUDA_CHECK(cudaMalloc(&mism, sizeof *mism));
  FP4SIM_CUDA_CHECK(cudaMalloc(&first, sizeof *first));
  FP4SIM_CUDA_CHECK(cudaMalloc(&unsup, sizeof *unsup));
  FP4SIM_CUDA_CHECK(cudaMemset(mism, 0, sizeof *mism));
  FP4SIM_CUDA_CHECK(cudaMemset(first, 0xFF, sizeof *first));
  FP4SIM_CUDA_CHECK(cudaMemset(unsup, 0, sizeof *unsup));
  cvt_rn_sweep_kernel<<<4096, 256>>>(mism, first, unsup);
  FP4SIM_CUDA_CHECK_LAUNCH();
  int u = 0;
  FP4SIM_CUDA_CHECK(cudaMemcpy(&u, unsup, sizeof u, cudaMemcpyDeviceToHost));
  FP4SIM_CUDA_CHECK(
      cudaMemcpy(&p.rn_mismatches, mism, sizeof p.rn_mismatches, cudaMemcpyDeviceToHost));
  FP4SIM_CUDA_CHECK(
      cudaMemcpy(&p.rn_first_mismatch, first, sizeof p.rn_first_mismatch, cudaMemcpyDeviceToHost));
  p.cvt_rn_supported = u == 0;
  // rbits experiments: all zero, all ones, then 0x80 in one byte at a time
  const uint32_t h_rbits[6] = {0u, 0xFFFFFFFFu, 0x80u, 0x8000u, 0x800000u, 0x80000000u};
  uint32_t *d_rbits = nullptr, *d_out = nullptr;
  FP4SIM_CUDA_CHECK(cudaMalloc(&d_rbits, sizeof h_rbits));
  FP4SIM_CUDA_CHECK(cudaMalloc(&d_out, sizeof h_rbits));
  FP4SIM_CUDA_CHECK(cudaMemcpy(d_rbits, h_rbits, sizeof h_rbits, cudaMemcpyHostToDevice));
  cvt_rs_experiment_kernel<<<1, 32>>>(d_rbits, d_out, 6);
  FP4SIM_CUDA_CHECK_LAUNCH();
  FP4SIM_CUDA_CHECK(cudaMemcpy(p.rs_results, d_out, sizeof h_rbits, cudaMemcpyDeviceToHost));
  for (int i = 0; i < 6; ++i) p.rs_rbits[i] = h_rbits[i];
  p.cvt_rs_supported = p.rs_results[0] != 0xFFFFFFFFu;
  cudaFree(mism);
  cudaFree(first);
  cudaFree(unsup);
  cudaFree(d_rbits);
  cudaFree(d_out);
  return p;
}

// ---- Native MMA probe, host side ---------------------------------------------------------------

namespace {

// The test tiles of one variant, laid out as mma_tile_kernel reads them.
struct MmaTileSet {
  std::vector<uint8_t> a, b, sfa, sfb;  // (T,16,64), (T,8,64), (T,16,4), (T,8,4)
  std::vector<float> c;                 // (T,16,8)
  std::vector<std::string> case_name;   // per tile
  std::vector<int> case_class;          // per tile: index into MmaTileSet::kClassNames
  static constexpr const char* kClassNames[4] = {"layout (exact, no rounding involved)",
                                                 "worked vector + probes", "random", "specials"};
  int count() const { return static_cast<int>(case_name.size()); }
  // A zero tile (all codes +0, C = +0) with every scale byte `unit`; returns its index.
  int add(const std::string& name, int cls, uint8_t unit) {
    a.insert(a.end(), kTileM * kTileK, 0);
    b.insert(b.end(), kTileN * kTileK, 0);
    sfa.insert(sfa.end(), kTileM * kScaleSlots, unit);
    sfb.insert(sfb.end(), kTileN * kScaleSlots, unit);
    c.insert(c.end(), kTileM * kTileN, 0.0f);
    case_name.push_back(name);
    case_class.push_back(cls);
    return count() - 1;
  }
  uint8_t& a_at(int t, int m, int k) { return a[(t * kTileM + m) * kTileK + k]; }
  uint8_t& b_at(int t, int k, int n) { return b[(t * kTileN + n) * kTileK + k]; }
  uint8_t& sfa_at(int t, int m, int s) { return sfa[(t * kTileM + m) * kScaleSlots + s]; }
  uint8_t& sfb_at(int t, int n, int s) { return sfb[(t * kTileN + n) * kScaleSlots + s]; }
  float& c_at(int t, int m, int n) { return c[(t * kTileM + m) * kTileN + n]; }
};

bool is_ue4m3(ScaleKind kind) { return kind == ScaleKind::UE4M3_16; }
uint8_t unit_scale(ScaleKind kind) { return is_ue4m3(kind) ? 0x38 : 127; }  // 1.0

// A named single-output case at row 0 / column 0 of its tile: products a_k * b_k at the given k,
// the row's / column's scale bytes per slot, and C.
struct NamedCase {
  const char* name;
  std::vector<std::tuple<int, float, float>> products;  // (k, a_k, b_k)
  uint8_t sa[kScaleSlots], sb[kScaleSlots];
  float c;
};

// DESIGN.md §7's worked vector and four probes in each scale kind. UE8M0 per 16 takes them as
// written. UE8M0 per 32 cannot give groups 0 and 1 different scales, so what DESIGN.md puts in
// group 1 moves to group 2 (scale slot 1). UE4M3 spans scale exponents -6..8 only (a group's
// exponent -12..16), so its forms set the maximum at 16 (scales 256 * 256) and put the small group
// at exponent -12 (subnormal scales 2^-9, read at emin -6) with bits below the grid:
// 20.75 * 2^-18 = 83 * 2^-20 truncates to 82 * 2^-20 on the grid 2^(16-35) (F = 34 would give 80,
// F = 36 83, alignment by the cancelled groups' magnitudes 64, a cancelled group read as zero 83).
std::vector<NamedCase> named_cases(ScaleKind kind) {
  const float two23 = std::ldexp(1.0f, 23), c4 = 1.0f + std::ldexp(1.0f, -23);
  if (kind == ScaleKind::UE8M0_16) {
    return {
        {"worked vector (-0.875)",
         {{0, -4, 4}, {16, -1, 1}, {17, -1, 0.5f}, {18, -0.5f, 0.5f}},
         {127 + 11, 127, 127, 127},
         {127 + 8, 126, 127, 127},
         two23},
        {"probe 1, g1 at 2^-35 (2^-35)",
         {{0, 1, 1}, {32, -1, 1}, {16, 1, 1}},
         {127, 92, 127, 127},
         {127, 127, 127, 127},
         0.0f},
        {"probe 1, g1 at 2^-36 (0)",
         {{0, 1, 1}, {32, -1, 1}, {16, 1, 1}},
         {127, 91, 127, 127},
         {127, 127, 127, 127},
         0.0f},
        {"probe 2, cancelled group keeps its exponent (0)",
         {{0, 0.5f, 0.5f}, {1, -0.5f, 0.5f}, {16, 1, 1}},
         {127, 91, 127, 127},
         {127, 127, 127, 127},
         0.0f},
        {"probe 3, alignment by scale exponent (2^-35)",
         {{0, 6, 6}, {16, -6, 6}, {32, 1, 1}},
         {127, 127, 92, 127},
         {127, 127, 127, 127},
         0.0f},
        {"probe 4, C is truncated too (1.0)",
         {{0, 1, 1}, {16, -1, 1}},
         {140, 140, 127, 127},
         {127, 127, 127, 127},
         c4},
    };
  }
  if (kind == ScaleKind::UE8M0_32) {
    return {
        {"worked vector, g1 -> g2 (-0.875)",
         {{0, -4, 4}, {32, -1, 1}, {33, -1, 0.5f}, {34, -0.5f, 0.5f}},
         {127 + 11, 127, 127, 127},
         {127 + 8, 126, 127, 127},
         two23},
        {"probe 1, g1 -> g2 at 2^-35 (2^-35)",
         {{0, 1, 1}, {16, -1, 1}, {32, 1, 1}},
         {127, 92, 127, 127},
         {127, 127, 127, 127},
         0.0f},
        {"probe 1, g1 -> g2 at 2^-36 (0)",
         {{0, 1, 1}, {16, -1, 1}, {32, 1, 1}},
         {127, 91, 127, 127},
         {127, 127, 127, 127},
         0.0f},
        {"probe 2, g1 -> g2, cancelled group (0)",
         {{0, 0.5f, 0.5f}, {1, -0.5f, 0.5f}, {32, 1, 1}},
         {127, 91, 127, 127},
         {127, 127, 127, 127},
         0.0f},
        {"probe 3, alignment by scale exponent (2^-35)",
         {{0, 6, 6}, {16, -6, 6}, {32, 1, 1}},
         {127, 92, 127, 127},
         {127, 127, 127, 127},
         0.0f},
        {"probe 4, C is truncated too (1.0)",
         {{0, 1, 1}, {16, -1, 1}},
         {140, 127, 127, 127},
         {127, 127, 127, 127},
         c4},
    };
  }
  // UE4M3: 0x78 = 256, 0x60 = 32, 0x38 = 1, 0x30 = 0.5, 0x01 = 2^-9 (subnormal)
  const std::vector<std::tuple<int, float, float>> small_g1 = {
      {16, 4, 4}, {17, 4, 1}, {18, 0.5f, 1.5f}};
  std::vector<std::tuple<int, float, float>> p1 = {{0, 1, 1}, {32, -1, 1}};
  p1.insert(p1.end(), small_g1.begin(), small_g1.end());
  std::vector<std::tuple<int, float, float>> p2 = {{0, 0.5f, 0.5f}, {1, -0.5f, 0.5f}};
  p2.insert(p2.end(), small_g1.begin(), small_g1.end());
  return {
      {"worked vector, UE4M3 form: c = 2^20 (-0.875)",
       {{0, -4, 4}, {16, -1, 1}, {17, -1, 0.5f}, {18, -0.5f, 0.5f}},
       {0x78, 0x38, 0x38, 0x38},
       {0x78, 0x30, 0x38, 0x38},
       std::ldexp(1.0f, 20)},
      {"probe 1, F = 35: 83*2^-20 at 2^(16-35) (82*2^-20)",
       p1,
       {0x78, 0x01, 0x78, 0x38},
       {0x78, 0x01, 0x78, 0x38},
       0.0f},
      {"probe 1, 2^-20 below the grid 2^-19 (0)",
       {{0, 1, 1}, {32, -1, 1}, {16, 0.5f, 0.5f}},
       {0x78, 0x01, 0x78, 0x38},
       {0x78, 0x01, 0x78, 0x38},
       0.0f},
      {"probe 2, cancelled group keeps its exponent (82*2^-20)",
       p2,
       {0x78, 0x01, 0x38, 0x38},
       {0x78, 0x01, 0x38, 0x38},
       0.0f},
      {"probe 3, alignment by scale exponent (82*2^-20)",
       {{0, 6, 6}, {16, -6, 6}, {32, 4, 4}, {33, 4, 1}, {34, 0.5f, 1.5f}},
       {0x78, 0x78, 0x01, 0x38},
       {0x78, 0x78, 0x01, 0x38},
       0.0f},
      {"probe 4, C is truncated too (1.0)",
       {{0, 1, 1}, {16, -1, 1}},
       {0x78, 0x78, 0x38, 0x38},
       {0x60, 0x60, 0x38, 0x38},
       c4},
  };
}

// Nonzero E2M1 codes other than -0 (0x8), for cases that need every product nonzero.
constexpr uint8_t kNonzeroCodes[14] = {1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15};

// The layout case: no rounding or alignment rule can change its answers. Row m of A is nonzero only
// at k = 8*(m%8) + j (j = 0..7), column n of B only at k = 8*i + n (i = 0..7), so output (m, n) has
// exactly one nonzero product, at k = 8*(m%8) + n (k-block (m%8)/2 of 16, (m%8)/4 of 32), with
// codes and scales that depend on the position; C[m][n] = 512 * (8m + n + 1) tags each output. All
// scales lie in [0.5, 2], so |product| <= 144 < 256 and D = C + product is exact in FP32 (21
// significant bits at most) and far above any truncation grid: a native D decodes as
// round(D / 512) - 1 = the C element it added, D - C = the product it used.
void add_layout_case(MmaTileSet& set, ScaleKind kind) {
  const int t = set.add("layout", 0, unit_scale(kind));
  for (int m = 0; m < kTileM; ++m)
    for (int j = 0; j < 8; ++j)
      set.a_at(t, m, 8 * (m % 8) + j) = kNonzeroCodes[(5 * m + 3 * j) % 14];
  for (int n = 0; n < kTileN; ++n)
    for (int i = 0; i < 8; ++i) set.b_at(t, 8 * i + n, n) = kNonzeroCodes[(3 * i + 5 * n + 1) % 14];
  // scales in [0.5, 2]: UE4M3 0.5, 1, 1.5, 2; UE8M0 2^-1, 2^0, 2^1
  const uint8_t ue4m3[4] = {0x30, 0x38, 0x3C, 0x40};
  const uint8_t ue8m0[3] = {126, 127, 128};
  for (int s = 0; s < kScaleSlots; ++s) {
    for (int m = 0; m < kTileM; ++m)
      set.sfa_at(t, m, s) = is_ue4m3(kind) ? ue4m3[(m + 3 * s) % 4] : ue8m0[(m + s) % 3];
    for (int n = 0; n < kTileN; ++n)
      set.sfb_at(t, n, s) =
          is_ue4m3(kind) ? ue4m3[(2 * n + s + 1) % 4] : ue8m0[(2 * n + s + 1) % 3];
  }
  for (int m = 0; m < kTileM; ++m)
    for (int n = 0; n < kTileN; ++n) set.c_at(t, m, n) = 512.0f * static_cast<float>(8 * m + n + 1);
}

void add_named_cases(MmaTileSet& set, ScaleKind kind) {
  for (const NamedCase& nc : named_cases(kind)) {
    const int t = set.add(nc.name, 1, unit_scale(kind));
    for (const auto& [k, x, y] : nc.products) {
      set.a_at(t, 0, k) = e2m1_rn_satfinite(x);
      set.b_at(t, k, 0) = e2m1_rn_satfinite(y);
    }
    for (int s = 0; s < kScaleSlots; ++s) {
      set.sfa_at(t, 0, s) = nc.sa[s];
      set.sfb_at(t, 0, s) = nc.sb[s];
    }
    set.c_at(t, 0, 0) = nc.c;
  }
}

// A random scale byte: UE4M3 zero (1/8), subnormal (1/8) or any finite normal, sign bit clear;
// UE8M0 mostly within 2^+-20 of 1, sometimes anywhere in 2^-127..2^127.
uint8_t random_scale(std::mt19937& rng, ScaleKind kind) {
  const uint32_t r = rng();
  if (is_ue4m3(kind)) {
    switch (r % 8) {
      case 0:
        return 0x00;
      case 1:
        return static_cast<uint8_t>(1 + (r >> 8) % 7);
      default:
        return static_cast<uint8_t>(0x08 + (r >> 8) % (0x7F - 0x08));
    }
  }
  if (r % 8 == 0) return static_cast<uint8_t>((r >> 8) % 0xFF);
  return static_cast<uint8_t>(127 - 20 + static_cast<int>((r >> 8) % 41));
}

// A random C: +-0, subnormal, near the products (2^-40..2^40), large (2^20..2^60), any finite.
float random_c(std::mt19937& rng) {
  const uint32_t r = rng(), bits = rng();
  const uint32_t sign = bits & 0x80000000u;
  switch (r % 8) {
    case 0:
      return f32_from_bits(sign);
    case 1:
      return f32_from_bits(sign | (bits & 0x7FFFFFu) | 1u);
    case 2:
      return f32_from_bits(sign | (static_cast<uint32_t>(127 + 20 + (r >> 8) % 41) << 23) |
                           (bits & 0x7FFFFFu));
    case 3: {
      const uint32_t e = 1 + (r >> 8) % 254;
      return f32_from_bits(sign | (e << 23) | (bits & 0x7FFFFFu));
    }
    default:
      return f32_from_bits(sign | (static_cast<uint32_t>(127 - 40 + (r >> 8) % 81) << 23) |
                           (bits & 0x7FFFFFu));
  }
}

// Random E2M1 codes for one 16-wide group of a row/column: all zero (+-0), sparse or dense.
void random_group(std::mt19937& rng, uint8_t* codes, int stride) {
  const uint32_t mode = rng() % 4;
  for (int k = 0; k < kGstGroup; ++k) {
    const uint32_t r = rng();
    uint8_t code = static_cast<uint8_t>(r & 0xFu);
    if (mode == 0) code &= 0x8u;                         // +0 / -0 only
    if (mode == 1 && ((r >> 4) % 4) != 0) code &= 0x8u;  // sparse
    codes[k * stride] = code;
  }
}

void add_random_cases(MmaTileSet& set, ScaleKind kind, std::mt19937& rng, int tiles) {
  for (int i = 0; i < tiles; ++i) {
    const int t = set.add("random #" + std::to_string(i), 2, unit_scale(kind));
    for (int m = 0; m < kTileM; ++m)
      for (int g = 0; g < kGstGroups; ++g) random_group(rng, &set.a_at(t, m, g * kGstGroup), 1);
    for (int n = 0; n < kTileN; ++n)
      for (int g = 0; g < kGstGroups; ++g) random_group(rng, &set.b_at(t, g * kGstGroup, n), 1);
    for (int s = 0; s < kScaleSlots; ++s) {
      for (int m = 0; m < kTileM; ++m) set.sfa_at(t, m, s) = random_scale(rng, kind);
      for (int n = 0; n < kTileN; ++n) set.sfb_at(t, n, s) = random_scale(rng, kind);
    }
    for (int m = 0; m < kTileM; ++m)
      for (int n = 0; n < kTileN; ++n) set.c_at(t, m, n) = random_c(rng);
  }
}

// Specials, kept apart so that they cannot hide the random verdict: UE4M3 scales with the sign bit
// set (the model masks it), NaN scales (UE4M3 0x7F / 0xFF, UE8M0 0xFF), C = +-Inf / NaN, and all
// products -0 (signs of zero).
void add_special_cases(MmaTileSet& set, ScaleKind kind, std::mt19937& rng, int tiles) {
  const float specials_c[4] = {INFINITY, -INFINITY, NAN, -0.0f};
  for (int i = 0; i < tiles; ++i) {
    const int t = set.add("specials #" + std::to_string(i), 3, unit_scale(kind));
    for (int m = 0; m < kTileM; ++m)
      for (int g = 0; g < kGstGroups; ++g) random_group(rng, &set.a_at(t, m, g * kGstGroup), 1);
    for (int n = 0; n < kTileN; ++n)
      for (int g = 0; g < kGstGroups; ++g) random_group(rng, &set.b_at(t, g * kGstGroup, n), 1);
    for (int s = 0; s < kScaleSlots; ++s) {
      for (int m = 0; m < kTileM; ++m) {
        uint8_t v = random_scale(rng, kind);
        const uint32_t r = rng() % 16;
        if (is_ue4m3(kind) && r < 6) v |= 0x80u;                             // sign bit set
        if (r == 15) v = is_ue4m3(kind) ? (rng() & 1 ? 0x7F : 0xFF) : 0xFF;  // NaN
        set.sfa_at(t, m, s) = v;
      }
      for (int n = 0; n < kTileN; ++n) {
        uint8_t v = random_scale(rng, kind);
        if (is_ue4m3(kind) && rng() % 4 == 0) v |= 0x80u;
        set.sfb_at(t, n, s) = v;
      }
    }
    for (int m = 0; m < kTileM; ++m)
      for (int n = 0; n < kTileN; ++n) {
        const uint32_t r = rng() % 4;
        set.c_at(t, m, n) = r == 0 ? specials_c[rng() % 4] : random_c(rng);
      }
    if (i % 4 == 0) {  // every product of row 0 is -0: A's row 0 all -0, B without sign bits
      for (int k = 0; k < kTileK; ++k) set.a_at(t, 0, k) = 0x8;
      for (int n = 0; n < kTileN; ++n)
        for (int k = 0; k < kTileK; ++k) set.b_at(t, k, n) &= 0x7u;
      for (int n = 0; n < kTileN; ++n) set.c_at(t, 0, n) = n % 2 ? -0.0f : 0.0f;
    }
  }
}

// The model's answer for output (m, n) of tile t.
uint32_t model_output(MmaTileSet& set, int t, int m, int n, ScaleKind kind) {
  uint8_t ap[kTileK / 2] = {}, bp[kTileK / 2] = {};
  for (int k = 0; k < kTileK; ++k) {
    ap[k / 2] |= static_cast<uint8_t>((set.a_at(t, m, k) & 0xFu) << (4 * (k & 1)));
    bp[k / 2] |= static_cast<uint8_t>((set.b_at(t, k, n) & 0xFu) << (4 * (k & 1)));
  }
  return gst_fdpa_fp4_bits(ap, bp, &set.sfa_at(t, m, 0), &set.sfb_at(t, n, 0), kind,
                           set.c_at(t, m, n));
}

template <typename T>
T* device_copy(const std::vector<T>& h) {
  T* d = nullptr;
  FP4SIM_CUDA_CHECK(cudaMalloc(&d, h.size() * sizeof(T)));
  FP4SIM_CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// Runs every tile of `set` through variant V; false (and why) where it cannot run here.
template <int V>
bool run_mma_tiles(const MmaTileSet& set, std::vector<uint32_t>& d_out, std::string& why_not) {
  uint8_t* da = device_copy(set.a);
  uint8_t* db = device_copy(set.b);
  uint8_t* dsa = device_copy(set.sfa);
  uint8_t* dsb = device_copy(set.sfb);
  float* dc = device_copy(set.c);
  uint32_t* dd = nullptr;
  int* unsup = nullptr;
  d_out.assign(set.c.size(), 0xFFFFFFFFu);
  FP4SIM_CUDA_CHECK(cudaMalloc(&dd, d_out.size() * sizeof(uint32_t)));
  FP4SIM_CUDA_CHECK(cudaMalloc(&unsup, sizeof(int)));
  FP4SIM_CUDA_CHECK(cudaMemset(unsup, 0, sizeof(int)));
  mma_tile_kernel<V><<<set.count(), 32>>>(da, db, dsa, dsb, dc, dd, unsup);
  const cudaError_t launch = cudaGetLastError();
  bool ran = false;
  if (launch == cudaErrorNoKernelImageForDevice || launch == cudaErrorInvalidDeviceFunction) {
    why_not = "this build has no code for this GPU (" + std::string(cudaGetErrorName(launch)) + ")";
  } else {
    FP4SIM_CUDA_CHECK(launch);
    int u = 0;
    FP4SIM_CUDA_CHECK(cudaMemcpy(&u, unsup, sizeof u, cudaMemcpyDeviceToHost));
    FP4SIM_CUDA_CHECK(
        cudaMemcpy(d_out.data(), dd, d_out.size() * sizeof(uint32_t), cudaMemcpyDeviceToHost));
    ran = u == 0;
  }
  cudaFree(da);
  cudaFree(db);
  cudaFree(dsa);
  cudaFree(dsb);
  cudaFree(dc);
  cudaFree(dd);
  cudaFree(unsup);
  return ran;
}

constexpr int kRandomTiles = 256;  // x 128 outputs
constexpr int kSpecialTiles = 32;
constexpr int kMismatchesKept = 8;
constexpr uint32_t kMmaProbeSeed = 20250917u;

}  // namespace

NativeMmaProbe run_native_mma_probe() {
  NativeMmaProbe p{};
  int dev = 0;
  FP4SIM_CUDA_CHECK(cudaGetDevice(&dev));
  FP4SIM_CUDA_CHECK(cudaDeviceGetAttribute(&p.cc_major, cudaDevAttrComputeCapabilityMajor, dev));
  FP4SIM_CUDA_CHECK(cudaDeviceGetAttribute(&p.cc_minor, cudaDevAttrComputeCapabilityMinor, dev));
  struct Spec {
    int id;
    const char* label;
    const char* instruction;
    ScaleKind kind;
  };
  const Spec specs[] = {
      {kMmaNvf4Ue4m3X4, "NVFP4, UE4M3 scale per 16", FP4SIM_MMA_NVF4_UE4M3_X4, ScaleKind::UE4M3_16},
      {kMmaNvf4Ue8m0X4, "UE8M0 scale per 16", FP4SIM_MMA_NVF4_UE8M0_X4, ScaleKind::UE8M0_16},
      {kMmaNvf4Ue8m0X2, "MXFP4 (kind::mxf4nvf4), UE8M0 scale per 32", FP4SIM_MMA_NVF4_UE8M0_X2,
       ScaleKind::UE8M0_32},
      {kMmaMxf4Ue8m0X2, "MXFP4 (kind::mxf4), UE8M0 scale per 32", FP4SIM_MMA_MXF4_UE8M0_X2,
       ScaleKind::UE8M0_32},
  };
  const std::string gpu_name = "sm_" + std::to_string(p.cc_major * 10 + p.cc_minor);
  for (const Spec& s : specs) {
    NativeMmaVariantResult v;
    v.label = s.label;
    v.instruction = s.instruction;
    v.kind = s.kind;
    MmaTileSet set;
    std::mt19937 rng(kMmaProbeSeed + static_cast<uint32_t>(s.id));
    add_layout_case(set, s.kind);
    add_named_cases(set, s.kind);
    add_random_cases(set, s.kind, rng, kRandomTiles);
    add_special_cases(set, s.kind, rng, kSpecialTiles);
    std::vector<uint32_t> native;
    bool ran = false;
    switch (s.id) {
      case kMmaNvf4Ue4m3X4:
        ran = run_mma_tiles<kMmaNvf4Ue4m3X4>(set, native, v.why_not);
        break;
      case kMmaNvf4Ue8m0X4:
        ran = run_mma_tiles<kMmaNvf4Ue8m0X4>(set, native, v.why_not);
        break;
      case kMmaNvf4Ue8m0X2:
        ran = run_mma_tiles<kMmaNvf4Ue8m0X2>(set, native, v.why_not);
        break;
      default:
        ran = run_mma_tiles<kMmaMxf4Ue8m0X2>(set, native, v.why_not);
        break;
    }
    if (!ran) {
#if !defined(FP4SIM_PTX_HAS_UE8M0_X4)
      if (s.id == kMmaNvf4Ue8m0X4 && p.cc_major == 12) {
        v.why_not =
            "not in this build: scale_vec::4X with .ue8m0 needs PTX ISA 9.1 (CUDA 13.1), this "
            "build's CUDA is " +
            std::to_string(__CUDACC_VER_MAJOR__) + "." + std::to_string(__CUDACC_VER_MINOR__);
      }
#endif
      if (v.why_not.empty())
        v.why_not = "not in this build's code for " + gpu_name +
                    " (mma.sync ... kind::mxf4nvf4 / kind::mxf4 exist only on sm_120a / sm_121a)";
      p.variants.push_back(std::move(v));
      continue;
    }
    v.supported = true;
    for (const char* name : MmaTileSet::kClassNames) v.classes.push_back(MmaCaseClass{name, 0, 0});
    for (int t = 0; t < set.count(); ++t) {
      MmaCaseClass& cls = v.classes[set.case_class[t]];
      for (int m = 0; m < kTileM; ++m)
        for (int n = 0; n < kTileN; ++n) {
          const uint32_t model = model_output(set, t, m, n, s.kind);
          const uint32_t got = native[(t * kTileM + m) * kTileN + n];
          ++cls.outputs;
          if (got == model) {
            ++cls.equal;
          } else if (static_cast<int>(v.first_mismatches.size()) < kMismatchesKept) {
            v.first_mismatches.push_back(MmaMismatch{set.case_name[t], m, n, got, model});
          }
          if (set.case_class[t] == 1 && m == 0 && n == 0)
            v.named.push_back(MmaNamedResult{set.case_name[t], got, model});
        }
    }
    p.variants.push_back(std::move(v));
  }
  return p;
}

}  // namespace fp4sim::gpu
