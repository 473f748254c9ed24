// The exact FP8 GEMM on Hopper's own tensor cores (sm_90a wgmma): the arithmetic DESIGN.md §9
// defines for the fp8 recipe's exact GEMM (per 128-wide k-block, four chained m64nNk32 E4M3
// instructions from +0, then acc = fmaf(s_a * s_b, partial, acc)) is what a Hopper FP8 kernel with
// DeepSeek-style promotion computes, so running the instruction itself must give the emulator's
// bits if the tensor-core model (T-FDPA L = 32, F = 13, RZ to E8M13) is right.
// tests/gpu/test_fp8_gpu.cpp holds it to the emulator bit for bit; gpu/fp8.cu's
// one-thread-an-output kernel is the fallback on other GPUs and the test's second witness.
//
// Shape of the kernel: persistent CTAs, one an SM, each taking 128 x 128 output tiles (work items)
// in turn, warp-specialised (384 threads):
// - Warpgroup 0 produces. One thread loads each 128-wide k-block's codes of A and B by TMA
//   (cp.async.bulk.tensor, 128 x 128 boxes in the 128-byte swizzle wgmma reads, zeros past the
//   edges); all 128 threads stage its scales by cp.async four k-blocks ahead, store them where
//   the multiplying threads read them with few wide loads and vote whether B's 128 scales are one
//   value. A 6-stage ring of full / empty mbarriers connects it to the multiplying warpgroups.
// - Warpgroups 1 and 2 multiply rows 0-63 and 64-127 of the tile: two m64n128k32 accumulators of
//   64 FP32 registers a thread plus the promoted sum (setmaxnreg gives them the registers the
//   producer gives up). They take turns at issuing two k-blocks (named barriers) and promote the
//   first while the second runs, the second while the other warpgroup's turn runs; where B's
//   scales are one value (a 128x128-block weight, every Fprop and Dgrad of the recipe) the
//   promotion needs two products a thread instead of 64.
// - Where a CTA's k-blocks come in aligned fours (K a multiple of 512, e.g. every Wgrad), the
//   producer fetches each row's four scales with one 16-byte copy.
// Both operands are K-major (TN: A [M, K], B [N, K], as every FP8 GEMM of the recipe is). Split-K
// (the contract's: each range's chain from +0, the ranges added in order) writes FP32 partial sums
// that a second kernel adds and stores through the contract's epilogue.
//
// Speed (docs/performance.md, H200): 1.1-1.3x cuBLASLt's block-scaled FP8 GEMM time on the Fprop
// and Dgrad shapes of gpt2-124m, 1.5-3.2x on the Wgrad ones, where both operands' scales vary per
// row (64 products a thread a k-block) and few tiles fill the GPU (a tile's chain over K is serial
// by the contract, so 36 or 144 tiles of 128 x 128 leave SMs idle or a second wave nearly empty).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "emu/gemm.hpp"
#include "emu/quantize.hpp"
#include "gpu/cp_async.cuh"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/formats_device.cuh"

namespace fp4sim::gpu {
namespace {

constexpr int kWgTile = 128;  // output tile rows = cols = k-block width
constexpr int kWgStages = 6;
constexpr int kWgThreads = 384;  // a loading warpgroup, two multiplying ones
// setmaxnreg: 128 x 40 + 256 x 232 <= 64 K (a multiplying thread holds two accumulators and the
// sum)
constexpr int kWgProducerRegs = 40, kWgConsumerRegs = 232;
constexpr int kWgOperandBytes = kWgTile * kWgTile;  // one operand's 128 x 128 codes
// A stage: A's and B's codes, then their scales, laid out so that each multiplying thread reads its
// own with few wide loads: A's row m = 16 q + 8 h + i at float 16 q + 2 i + h (a thread's rows r
// and r + 8 side by side); B's row n = 8 j + 2 c + e at float 36 c + 2 j + e (a thread's 32 columns
// contiguous, the four column groups 36 floats apart so their 16-byte loads hit different banks).
// After them, B's uniformity words: the four producer warps' B scale bits (one each, valid where
// that warp's 32 scales are one value) and their four flags; a k-block whose 128 B scales are one
// value (a 128x128-block copy of the weight) is promoted with two products a thread instead of 64.
constexpr int kWgScaleBStride = 36;
constexpr int kWgScaleBytes = (kWgTile + 4 * kWgScaleBStride + 8) * 4;
constexpr int kWgStageBytes = (2 * kWgOperandBytes + kWgScaleBytes + 1023) / 1024 * 1024;  // 34 KB
// The producer's staging ring for the scales it fetches ahead (A's and B's 128 each a k-block):
// kWgScaleAhead slots of one k-block each, or, where a CTA's k-blocks come in aligned fours (the
// "wide" fetch: each row's four scales are one 16-byte copy, not four 4-byte ones from rows KB
// floats apart), two buffers of four k-blocks, [operand][row][4].
constexpr int kWgScaleAhead = 4;
constexpr int kWgQuadBytes = 2 * kWgTile * 16;
constexpr int kWgStagingBytes = 2 * kWgQuadBytes;
static_assert(kWgStagingBytes >= kWgScaleAhead * 2 * kWgTile * 4, "the one-k-block slots fit too");
// + the stages' full and empty mbarriers, + 1 KB alignment
constexpr size_t kWgSmem =
    static_cast<size_t>(kWgStages) * kWgStageBytes + kWgStagingBytes + 2 * kWgStages * 8 + 1024;
static_assert(kWgProducerRegs * 128 + kWgConsumerRegs * 256 <= 65536, "register file");
static_assert(kWgStageBytes % 1024 == 0, "each stage's tiles start on a 1024-byte swizzle atom");

// True where this build can run the kernel (the sm_90a feature set: wgmma).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FP4SIM_WGMMA 1
#else
#define FP4SIM_WGMMA 0
#endif

#if FP4SIM_WGMMA
// A warpgroup's 64 accumulator registers as asm operands with constraint c ("+f": read and
// written; "=f": written only)
#define FP4SIM_WG_REG64(c, d)                                                                   \
  c(d[0]), c(d[1]), c(d[2]), c(d[3]), c(d[4]), c(d[5]), c(d[6]), c(d[7]), c(d[8]), c(d[9]),     \
      c(d[10]), c(d[11]), c(d[12]), c(d[13]), c(d[14]), c(d[15]), c(d[16]), c(d[17]), c(d[18]), \
      c(d[19]), c(d[20]), c(d[21]), c(d[22]), c(d[23]), c(d[24]), c(d[25]), c(d[26]), c(d[27]), \
      c(d[28]), c(d[29]), c(d[30]), c(d[31]), c(d[32]), c(d[33]), c(d[34]), c(d[35]), c(d[36]), \
      c(d[37]), c(d[38]), c(d[39]), c(d[40]), c(d[41]), c(d[42]), c(d[43]), c(d[44]), c(d[45]), \
      c(d[46]), c(d[47]), c(d[48]), c(d[49]), c(d[50]), c(d[51]), c(d[52]), c(d[53]), c(d[54]), \
      c(d[55]), c(d[56]), c(d[57]), c(d[58]), c(d[59]), c(d[60]), c(d[61]), c(d[62]), c(d[63])
#define FP4SIM_WG_ACC64(d) FP4SIM_WG_REG64("+f", d)

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits for this warpgroup's wgmma groups; d's registers are its results from here on (operands of
// the wait, so the compiler reads none of them before it)
__device__ __forceinline__ void wgmma_wait_all(float (&d)[64]) {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" : FP4SIM_WG_ACC64(d) : : "memory");
}

// Waits until at most one wgmma group of this warpgroup is pending: the older group (d's) is done,
// the newer one may still write its own accumulator (which the caller leaves alone until a wait 0)
__device__ __forceinline__ void wgmma_wait_one(float (&d)[64]) {
  asm volatile("wgmma.wait_group.sync.aligned 1;\n" : FP4SIM_WG_ACC64(d) : : "memory");
}

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart (the
// leading offset is unused in this mode). addr: the shared-window byte address of the first row's
// first k (k steps of 32 codes add 32 bytes: the swizzle is applied to the computed addresses).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// D (64 x 128, FP32, this warpgroup's registers) = A (64 x 32 E4M3) * B (128 x 32 E4M3)^T + D
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], uint64_t desc_a,
                                                      uint64_t desc_b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, "
      "1, 1, 1;\n"
      : FP4SIM_WG_ACC64(d)
      : "l"(desc_a), "l"(desc_b));
}
// The same from +0 (scale-d 0): D = A * B^T, D's previous values not read (so its registers are
// free between the accumulator's last use and this instruction)
#define FP4SIM_WG_OUT64(d) FP4SIM_WG_REG64("=f", d)
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_first(float (&d)[64], uint64_t desc_a,
                                                            uint64_t desc_b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, "
      "0, 1, 1;\n"
      : FP4SIM_WG_OUT64(d)
      : "l"(desc_a), "l"(desc_b));
}
#undef FP4SIM_WG_OUT64
#undef FP4SIM_WG_ACC64
#undef FP4SIM_WG_REG64

// The contract's epilogue (gemm_store) for the aligned pair of outputs idx and idx + 1 of one row,
// C's values c0 and c1 given (ignored where beta is 0), as one 8-byte (F32) or 4-byte (BF16) store.
__device__ __forceinline__ void store_epilogue_pair(const GemmConfig& cfg, void* out, int64_t idx,
                                                    float v0, float v1, float c0, float c1) {
  const float d0 = gemm_epilogue(cfg.alpha, v0, cfg.beta, c0);
  const float d1 = gemm_epilogue(cfg.alpha, v1, cfg.beta, c1);
  if (cfg.out == GemmOut::BF16)
    *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(out) + idx) =
        static_cast<uint32_t>(bf16_rne_cvt(d0)) | (static_cast<uint32_t>(bf16_rne_cvt(d1)) << 16);
  else
    *reinterpret_cast<float2*>(static_cast<float*>(out) + idx) = make_float2(d0, d1);
}

// The contract's epilogue (gemm_store) for outputs idx and idx + 1 of one row, as one 8-byte (F32)
// or 4-byte (BF16) store where both exist and the pair is aligned; ws: the split range's raw sums.
__device__ __forceinline__ void store_pair(const GemmConfig& cfg, const float* c, void* out,
                                           float* ws, int64_t idx, bool both, bool aligned,
                                           float v0, float v1) {
  if (ws) {
    if (both && aligned)
      *reinterpret_cast<float2*>(ws + idx) = make_float2(v0, v1);
    else {
      ws[idx] = v0;
      if (both) ws[idx + 1] = v1;
    }
    return;
  }
  if (!(both && aligned)) {
    gemm_store<DeviceFormats>(cfg, cfg.alpha, v0, c, idx, out);
    if (both) gemm_store<DeviceFormats>(cfg, cfg.alpha, v1, c, idx + 1, out);
    return;
  }
  store_epilogue_pair(cfg, out, idx, v0, v1, c ? c[idx] : 0.0f, c ? c[idx + 1] : 0.0f);
}
#endif  // FP4SIM_WGMMA

// Work items: (split range z, M tile, N tile), N tiles fastest, so the CTAs running at one time
// share A's rows and all of B. A persistent CTA takes items blockIdx.x, + gridDim.x, ...; its
// k-blocks form one stream through the stage ring, so the next item's first k-blocks load while
// the current one finishes and stores.
struct WgItems {
  int gx, gy, per_split;
};

#if FP4SIM_WGMMA
// A position in a CTA's k-block stream: its item, the k-block within the item's range, and the
// item's tile origin and first k-block (divisions once an item, none a k-block).
struct WgCursor {
  int item, kb, m0, n0, kb0;
  __device__ void start(int it, const WgItems& w) {
    item = it;
    kb = 0;
    const int rest = it / w.gx, z = rest / w.gy;
    n0 = (it - rest * w.gx) * kWgTile;
    m0 = (rest - z * w.gy) * kWgTile;
    kb0 = z * w.per_split;
  }
  // true when the next k-block starts a new item
  __device__ bool advance(const WgItems& w) {
    if (++kb < w.per_split) return false;
    start(item + static_cast<int>(gridDim.x), w);
    return true;
  }
};

// The producer warpgroup's share of loading one k-block's scales (128 threads): A's for row t and
// B's for row t of the tile, by cp.async into a staging ring kWgScaleAhead k-blocks ahead (the
// codes come by TMA, one thread, fp8_gemm_wgmma_kernel). Pointers into the scales [rows, KB] are
// set once an item (set_item); a k-block is one float on. Rows past M or N read zeros. (Never the
// GEMM-layout copy scales_gemm: the emulator reads scales, so the kernel reads what it reads.)
struct WgScaleLoader {
  const float* psa;  // A's scale for row m0 + t at the item's first k-block
  const float* psb;  // B's for row n0 + t
  bool sa_ok, sb_ok;
  __device__ void set_item(const QuantizedView& a, const QuantizedView& b, const WgCursor& c,
                           int64_t KB, int t) {
    sa_ok = c.m0 + t < a.rows;
    sb_ok = c.n0 + t < b.rows;
    psa = reinterpret_cast<const float*>(a.scales) + (sa_ok ? (c.m0 + t) * KB + c.kb0 : 0);
    psb = reinterpret_cast<const float*>(b.scales) + (sb_ok ? (c.n0 + t) * KB + c.kb0 : 0);
  }
  // k-block kb of the item's two scales for this thread into its two floats of a staging slot (by
  // cp.async, zeros past the edges); the thread reads them back itself once the copy's group lands
  __device__ void fetch(int kb, uint32_t slot, int t) const {
    cp_async4_zfill(slot + 4 * t, sa_ok ? psa + kb : psa, sa_ok);
    cp_async4_zfill(slot + 4 * (kWgTile + t), sb_ok ? psb + kb : psb, sb_ok);
  }
  // the wide fetch: k-blocks kb .. kb + 3 (kb % 4 == 0, 16-byte aligned) into a quad buffer
  __device__ void fetch4(int kb, uint32_t quad, int t) const {
    cp_async16_zfill(quad + 16 * t, sa_ok ? psa + kb : psa, sa_ok);
    cp_async16_zfill(quad + 16 * (kWgTile + t), sb_ok ? psb + kb : psb, sb_ok);
  }
};

// Stores this producer thread's two scales of a k-block into the stage's scale area (the layout at
// kWgStageBytes) and its warp's B uniformity words.
__device__ __forceinline__ void store_scales(uint32_t scales, int t, float va, float vb) {
  const int at_a = 16 * (t >> 4) + 2 * (t & 7) + ((t >> 3) & 1);
  const int at_b = kWgTile + kWgScaleBStride * ((t & 7) >> 1) + 2 * (t >> 3) + (t & 1);
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(scales + 4 * at_a), "f"(va) : "memory");
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(scales + 4 * at_b), "f"(vb) : "memory");
  const uint32_t bits = __float_as_uint(vb);
  const bool same = __all_sync(0xFFFFFFFFu, bits == __shfl_sync(0xFFFFFFFFu, bits, 0));
  if ((t & 31) == 0) {
    const uint32_t words = scales + 4 * (kWgTile + 4 * kWgScaleBStride);
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(words + 4 * (t >> 5)), "r"(bits) : "memory");
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(words + 16 + 4 * (t >> 5)), "r"(same ? 1u : 0u)
                 : "memory");
  }
}

// One 128 x 128 box of a tensor map (TMA, 128-byte swizzle) into shared memory, counted on bar
__device__ __forceinline__ void tma_load_tile(uint32_t dst, const CUtensorMap* map, int k, int row,
                                              uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(row), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile(
      "{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar),
      "r"(bytes)
      : "memory");
}

// mbarriers (shared-window addresses) and named barriers
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, "
        "0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar)
               : "memory");
}
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

__device__ __forceinline__ float lds_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint4 lds_u32x4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ float4 lds_f32x4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ float2 lds_f32x2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}
#endif

#if FP4SIM_WGMMA
// A multiplying warpgroup (rows 64 mwg .. + 63 of each tile), two accumulators: each turn at the
// tensor cores issues two k-blocks (g into acc0, g + 1 into acc1), then promotes g while g + 1
// still runs, then g + 1 while the other warpgroup's turn runs. The promotion per k-block is the
// contract's: total = fmaf(s_a * s_b, acc, total), k-blocks in order. Shaped for ptxas: no wgmma
// group is pending across the loop's back edge (a turn retires both) and no wgmma is under a branch
// (with G odd the last turn's second group re-multiplies the last stage into acc1, whose result
// nobody reads; that stage is released only after both groups are done); each accumulator's first
// wgmma does not read it, so between its promotion and its next k-block its registers hold C for
// the epilogue.
__device__ __forceinline__ void wg_consume(uint32_t smem, uint32_t bars, const float* c,
                                           const GemmConfig& cfg, void* out, float* ws,
                                           const WgItems& items, int G, int64_t M, int64_t N,
                                           bool pair_stores, int mwg, int warp, int lane) {
  const int per = items.per_split;
  WgCursor cur;
  cur.start(static_cast<int>(blockIdx.x), items);
  float total[64], acc0[64], acc1[64];  // (the accumulators: written by their first wgmma)
#pragma unroll
  for (int i = 0; i < 64; ++i) total[i] = 0.0f;
  const int row_in_tile = mwg * 64 + warp * 16 + (lane >> 2);  // and + 8
  const int col_in_n8 = 2 * (lane & 3);                        // and + 1, in each of 16 n8 blocks
  const int my_turn = 1 + mwg, their_turn = 2 - mwg;           // named barriers
  const bool c_pairs = (reinterpret_cast<uintptr_t>(c) & 7u) == 0;
  const int turns = (G + 1) / 2;
  if (mwg == 1) named_bar_arrive(1, 2 * kWgTile);  // warpgroup 1 issues first

  // the k-block in `stage` into acc on the tensor cores (this warpgroup's 64 rows), as one group
  auto issue = [&](float(&acc)[64], uint32_t stage) {
    wgmma_m64n128k32_e4m3_first(acc, sw128_desc(stage + mwg * 64 * kWgTile),
                                sw128_desc(stage + kWgOperandBytes));
#pragma unroll
    for (int k = 1; k < kWgTile / 32; ++k)
      wgmma_m64n128k32_e4m3(acc, sw128_desc(stage + mwg * 64 * kWgTile + 32 * k),
                            sw128_desc(stage + kWgOperandBytes + 32 * k));
    wgmma_commit();
  };
  // total += (s_a * s_b) * acc for the k-block in `stage` (acc done: the caller waited for it)
  auto promote = [&](float(&acc)[64], uint32_t stage) {
    const uint32_t scale_a = stage + 2 * kWgOperandBytes, scale_b = scale_a + 4 * kWgTile;
    const uint32_t words = scale_b + 4 * 4 * kWgScaleBStride;
    const float2 sa = lds_f32x2(scale_a + 4 * (16 * (row_in_tile >> 4) + 2 * (lane >> 2)));
    const uint4 wb = lds_u32x4(words), wf = lds_u32x4(words + 16);
    const bool b_uniform =
        (wf.x & wf.y & wf.z & wf.w) != 0 && wb.x == wb.y && wb.x == wb.z && wb.x == wb.w;
    if (b_uniform) {
      const float sb = __uint_as_float(wb.x), p0 = __fmul_rn(sa.x, sb), p1 = __fmul_rn(sa.y, sb);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        total[4 * j + 0] = __fmaf_rn(p0, acc[4 * j + 0], total[4 * j + 0]);
        total[4 * j + 1] = __fmaf_rn(p0, acc[4 * j + 1], total[4 * j + 1]);
        total[4 * j + 2] = __fmaf_rn(p1, acc[4 * j + 2], total[4 * j + 2]);
        total[4 * j + 3] = __fmaf_rn(p1, acc[4 * j + 3], total[4 * j + 3]);
      }
    } else {
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const float4 sb = lds_f32x4(scale_b + 4 * (kWgScaleBStride * (lane & 3) + 4 * q));
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = 2 * q + e;
          const float b0 = e ? sb.z : sb.x, b1 = e ? sb.w : sb.y;
          total[4 * j + 0] = __fmaf_rn(__fmul_rn(sa.x, b0), acc[4 * j + 0], total[4 * j + 0]);
          total[4 * j + 1] = __fmaf_rn(__fmul_rn(sa.x, b1), acc[4 * j + 1], total[4 * j + 1]);
          total[4 * j + 2] = __fmaf_rn(__fmul_rn(sa.y, b0), acc[4 * j + 2], total[4 * j + 2]);
          total[4 * j + 3] = __fmaf_rn(__fmul_rn(sa.y, b1), acc[4 * j + 3], total[4 * j + 3]);
        }
      }
    }
  };
  // after the item's last k-block: its tile through the contract's epilogue, total back to +0
  // (cv: the accumulator just promoted, free until its next k-block's first wgmma, which does not
  // read it: C's 64 values go there, all in flight together)
  auto finish_item = [&](float(&cv)[64]) {
    if (!ws && pair_stores && c_pairs && cur.m0 + kWgTile <= M && cur.n0 + kWgTile <= N) {
      if (c) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            // (a plain load: C may be D itself, read here by the thread that writes it below)
            const float2 v = *reinterpret_cast<const float2*>(
                c + (cur.m0 + row_in_tile + 8 * h) * N + cur.n0 + 8 * j + col_in_n8);
            cv[4 * j + 2 * h] = v.x;
            cv[4 * j + 2 * h + 1] = v.y;
          }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const int64_t idx = (cur.m0 + row_in_tile + 8 * h) * N + cur.n0 + 8 * j + col_in_n8;
          store_epilogue_pair(cfg, out, idx, total[4 * j + 2 * h], total[4 * j + 2 * h + 1],
                              c ? cv[4 * j + 2 * h] : 0.0f, c ? cv[4 * j + 2 * h + 1] : 0.0f);
        }
    } else {
      float* z_ws = ws ? ws + static_cast<int64_t>(cur.kb0 / per) * M * N : nullptr;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t m = cur.m0 + row_in_tile + 8 * h;
        if (m < M) {
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const int64_t n = cur.n0 + 8 * j + col_in_n8;
            if (n < N)
              store_pair(cfg, c, out, z_ws, m * N + n, n + 1 < N, pair_stores, total[4 * j + 2 * h],
                         total[4 * j + 2 * h + 1]);
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 64; ++i) total[i] = 0.0f;
  };
  auto release = [&](int s) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bars + 8 * (kWgStages + s));  // this warp is done with stage s
  };

  for (int turn = 0; turn < turns; ++turn) {
    const int g0 = 2 * turn, g1 = g0 + 1;
    const bool second = g1 < G;
    const int s0 = g0 % kWgStages, s1 = second ? g1 % kWgStages : s0;
    const uint32_t stage0 = smem + s0 * kWgStageBytes, stage1 = smem + s1 * kWgStageBytes;
    mbar_wait(bars + 8 * s0, (g0 / kWgStages) & 1);
    if (second) mbar_wait(bars + 8 * s1, (g1 / kWgStages) & 1);
    named_bar_sync(my_turn, 2 * kWgTile);
    wgmma_fence();
    issue(acc0, stage0);
    issue(acc1, stage1);
    if (mwg == 0 || turn + 1 < turns) named_bar_arrive(their_turn, 2 * kWgTile);
    wgmma_wait_one(acc0);  // k-block g0 is done; g1 may still run
    promote(acc0, stage0);
    if (second) release(s0);
    if (cur.kb == per - 1) finish_item(acc0);
    cur.advance(items);
    wgmma_wait_all(acc1);
    if (second) {
      promote(acc1, stage1);
      release(s1);
      if (cur.kb == per - 1) finish_item(acc1);
      cur.advance(items);
    } else {
      release(s0);
    }
  }
}
#endif

// ws: split_k > 1, the ranges' sums [split_k, M, N]; else the contract's epilogue into out.
// pair_stores: N is even and out (or ws) aligned for one store of two outputs.
//
// Warp-specialised: warpgroup 0 loads (TMA for the codes, the scales from its staging ring; each
// stage's arrival counted on its full mbarrier), warpgroups 1 and 2 multiply rows 0-63 and 64-127
// of the tile (wg_consume) and release each stage on its empty mbarrier once their wgmmas have read
// it and the scales are used. The two multiplying warpgroups take turns at issuing (named barriers
// 1 and 2), so that one's k-blocks run on the tensor cores while the other promotes its own:
// without the turns both would issue together, finish together and promote together, with the
// tensor cores idle.
__global__ void __launch_bounds__(kWgThreads, 1)
    fp8_gemm_wgmma_kernel(const __grid_constant__ CUtensorMap tma_a,
                          const __grid_constant__ CUtensorMap tma_b, QuantizedView a,
                          QuantizedView b, const float* c, GemmConfig cfg, void* out, float* ws,
                          WgItems items, int item_count, bool pair_stores) {
#if FP4SIM_WGMMA
  extern __shared__ uint8_t smem_raw[];
  const uint32_t smem =
      (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) + 1023u) & ~1023u;
  const uint32_t staging = smem + kWgStages * kWgStageBytes;  // the producer's scale ring
  const uint32_t bars = staging + kWgStagingBytes;  // full[s] at bars + 8 s, empty[s] after them
  const int64_t M = a.rows, N = b.rows, K = a.cols, KB = K / kWgTile;
  const int per = items.per_split;
  const int mine = (item_count - static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x) - 1) /
                   static_cast<int>(gridDim.x);  // this CTA's items
  const int G = mine * per;                      // its k-blocks
  const int t = threadIdx.x, wg = t >> 7;
  if (t == 0) {
    for (int s = 0; s < kWgStages; ++s) {
      mbar_init(bars + 8 * s,
                kWgTile + 1);  // the producer's 128 threads' scales, + the TMA's bytes
      mbar_init(bars + 8 * (kWgStages + s), 2 * 4);  // one lane of each multiplying warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // producer
    setmaxnreg_dec<kWgProducerRegs>();
    WgCursor ld, pf;  // the k-block loaded now; the one whose scales are fetched ahead
    ld.start(static_cast<int>(blockIdx.x), items);
    pf.start(static_cast<int>(blockIdx.x), items);
    WgScaleLoader loader;  // follows pf
    loader.set_item(a, b, pf, KB, t);
    // wide: every item's range starts on a multiple of 4 k-blocks and is a multiple of 4 long, and
    // the rows are 16-byte aligned, so a CTA's k-blocks g come in fours with g % 4 == kb % 4 == 0
    const bool wide = per % 4 == 0 && KB % 4 == 0 &&
                      (reinterpret_cast<uintptr_t>(a.scales) & 15u) == 0 &&
                      (reinterpret_cast<uintptr_t>(b.scales) & 15u) == 0;
    auto fetch_next =
        [&](int g) {  // k-block g's scales (wide: with g % 4 == 0, g .. g + 3), one group
          if (g < G) {
            if (!wide)
              loader.fetch(pf.kb, staging + (g % kWgScaleAhead) * 2 * kWgTile * 4, t);
            else if (g % 4 == 0)
              loader.fetch4(pf.kb, staging + ((g / 4) % 2) * kWgQuadBytes, t);
            if (pf.advance(items) && pf.item < item_count) loader.set_item(a, b, pf, KB, t);
          }
          cp_async_commit();
        };
#pragma unroll
    for (int g = 0; g < kWgScaleAhead - 1; ++g) fetch_next(g);
    for (int g = 0; g < G; ++g) {
      fetch_next(g + kWgScaleAhead - 1);
      cp_async_wait<kWgScaleAhead - 1>();  // k-block g's group has landed (wide: g - g % 4's)
      const uint32_t slot = wide ? staging + ((g / 4) % 2) * kWgQuadBytes + 4 * (g % 4)
                                 : staging + (g % kWgScaleAhead) * 2 * kWgTile * 4;
      const int step = wide ? 16 : 4;  // bytes from one row's scale to the next
      const float va = lds_f32(slot + step * t), vb = lds_f32(slot + step * (kWgTile + t));
      const int s = g % kWgStages;
      const uint32_t stage = smem + s * kWgStageBytes, full = bars + 8 * s;
      mbar_wait(bars + 8 * (kWgStages + s), ((g / kWgStages) & 1) ^ 1);  // stage s is free
      if (t == 0) {
        mbar_arrive_expect_tx(full, 2 * kWgOperandBytes);
        const int k = (ld.kb0 + ld.kb) * kWgTile;
        tma_load_tile(stage, &tma_a, k, ld.m0, full);
        tma_load_tile(stage + kWgOperandBytes, &tma_b, k, ld.n0, full);
      }
      store_scales(stage + 2 * kWgOperandBytes, t, va, vb);
      mbar_arrive(full);
      ld.advance(items);
    }
    return;
  }

  setmaxnreg_inc<kWgConsumerRegs>();
  const int mwg = wg - 1, warp = (t >> 5) & 3, lane = t & 31;
  wg_consume(smem, bars, c, cfg, out, ws, items, G, M, N, pair_stores, mwg, warp, lane);
#else
  __trap();  // never launched: fp8_gemm_wgmma_supported asks the device which build it runs
#endif
}

// The split ranges' sums added in order (split_k_chain), then the contract's epilogue.
__global__ void fp8_split_reduce_kernel(const float* ws, int split, int64_t mn, const float* c,
                                        GemmConfig cfg, void* out) {
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < mn;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float total = ws[idx];
    for (int s = 1; s < split; ++s) total = __fadd_rn(total, ws[s * mn + idx]);
    gemm_store<DeviceFormats>(cfg, cfg.alpha, total, c, idx, out);
  }
}

// Writes 1 where the code running on this device is the sm_90a build (the wgmma kernel's real
// body), 0 where it is another build for the device (a plain sm_90 one: the body is the trap).
__global__ void fp8_wgmma_built_kernel(int* out) { *out = FP4SIM_WGMMA; }

// What the launcher needs to know of a device, asked once per device and cached (the exact FP8
// GEMM asks on every call): whether it runs this build's wgmma kernel (compute capability 9.0 and
// the sm_90a code, found by one synchronous launch of fp8_wgmma_built_kernel), and its SM count.
struct WgmmaDevice {
  bool runs_wgmma = false;
  int sms = 0;
};
WgmmaDevice wgmma_device(int device) {
  static std::mutex mutex;
  static std::map<int, WgmmaDevice> known;
  std::lock_guard<std::mutex> lock(mutex);
  const auto it = known.find(device);
  if (it != known.end()) return it->second;
  int major = 0, minor = 0;
  WgmmaDevice d;
  FP4SIM_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  FP4SIM_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  FP4SIM_CUDA_CHECK(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device));
  if (major == 9 && minor == 0) {
    int* flag = nullptr;
    int host = 0;
    FP4SIM_CUDA_CHECK(cudaMalloc(&flag, sizeof(int)));
    fp8_wgmma_built_kernel<<<1, 1>>>(flag);
    const cudaError_t launched = cudaGetLastError();
    const cudaError_t copied = launched == cudaSuccess
                                   ? cudaMemcpy(&host, flag, sizeof(int), cudaMemcpyDeviceToHost)
                                   : launched;
    cudaFree(flag);
    FP4SIM_CUDA_CHECK(copied);
    d.runs_wgmma = host == 1;
  }
  known[device] = d;
  return d;
}

// cuTensorMapEncodeTiled, from the driver through the runtime (no link to libcuda)
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    FP4SIM_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                       cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || !p)
      throw std::runtime_error("gemm (cuda, fp8): the driver has no cuTensorMapEncodeTiled (TMA)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// The TMA view of an operand's codes [rows, K]: 128 x 128 boxes (128 rows of 128 bytes), 128-byte
// swizzle, rows past the end read as zeros
CUtensorMap codes_tensor_map(const QuantizedView& v, const char* name) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(v.cols), static_cast<cuuint64_t>(v.rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(v.cols)};
  const cuuint32_t box[2] = {kWgTile, kWgTile}, unit[2] = {1, 1};
  const CUresult r =
      tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, v.codes, dims, strides, box,
                           unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error(
        std::string("gemm (cuda, fp8): cuTensorMapEncodeTiled failed (CUresult ") +
        std::to_string(static_cast<int>(r)) + ") for operand " + name + ", " +
        std::to_string(v.rows) + " x " + std::to_string(v.cols));
  return map;
}

int current_device() {
  int device = 0;
  FP4SIM_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

}  // namespace

bool fp8_gemm_wgmma_supported(const QuantizedView& a, const QuantizedView& b) {
  const auto aligned = [](const void* p, uintptr_t n) {
    return reinterpret_cast<uintptr_t>(p) % n == 0;
  };
  return a.cols % kWgTile == 0 && aligned(a.codes, 16) && aligned(b.codes, 16) &&
         aligned(a.scales, 4) && aligned(b.scales, 4) && wgmma_device(current_device()).runs_wgmma;
}

void fp8_gemm_wgmma_launch(const QuantizedView& a, const QuantizedView& b, const float* c,
                           const GemmConfig& cfg, void* out, float* split_ws, cudaStream_t stream,
                           int max_ctas) {
  const int64_t M = a.rows, N = b.rows, KB = a.cols / kWgTile;
  const int split = cfg.split_k;
  if (split < 1 || KB % split != 0)
    throw std::invalid_argument("gemm (cuda, fp8): split-K " + std::to_string(split) +
                                " does not divide " + std::to_string(KB) + " k-blocks");
  if (split > 1 && !split_ws)
    throw std::logic_error("fp8_gemm_wgmma_launch: split-K without a workspace");
  const int64_t gx = (N + kWgTile - 1) / kWgTile, gy = (M + kWgTile - 1) / kWgTile;
  const int sms = wgmma_device(current_device()).sms;
  const int64_t items64 = gx * gy * split, cap = max_ctas > 0 ? max_ctas : sms;
  const int64_t grid64 = std::min<int64_t>(items64, std::min<int64_t>(sms, cap));  // one CTA an SM
  // the kernel keeps tile origins (tiles x 128 plus a row), TMA's k coordinate, item indices (one
  // grid's worth past the last) and a CTA's k-block count (plus the scale look-ahead) in int
  const int64_t int_max = std::numeric_limits<int>::max() - 1024;
  if (gx * kWgTile >= int_max || gy * kWgTile >= int_max || a.cols >= int_max ||
      items64 + grid64 >= int_max || (items64 + grid64 - 1) / grid64 * (KB / split) >= int_max)
    throw std::invalid_argument("gemm (cuda, fp8): " + std::to_string(M) + " x " +
                                std::to_string(N) + " x " + std::to_string(a.cols) +
                                " is too large for one launch of the tensor-core kernel");
  const WgItems items{static_cast<int>(gx), static_cast<int>(gy), static_cast<int>(KB / split)};
  const int item_count = static_cast<int>(items64);
  allow_dynamic_smem(reinterpret_cast<const void*>(fp8_gemm_wgmma_kernel), kWgSmem);
  const unsigned grid = static_cast<unsigned>(grid64);
  float* ws = split > 1 ? split_ws : nullptr;
  const uintptr_t pair_bytes =
      ws || cfg.out == GemmOut::F32 ? 8 : 4;  // a float2, or two BF16 values
  const bool pair_stores =
      N % 2 == 0 &&
      reinterpret_cast<uintptr_t>(ws ? static_cast<void*>(ws) : out) % pair_bytes == 0;
  const CUtensorMap tma_a = codes_tensor_map(a, "A"), tma_b = codes_tensor_map(b, "B");
  fp8_gemm_wgmma_kernel<<<grid, kWgThreads, kWgSmem, stream>>>(tma_a, tma_b, a, b, c, cfg, out, ws,
                                                               items, item_count, pair_stores);
  FP4SIM_CUDA_CHECK_LAUNCH();
  if (split > 1) {
    fp8_split_reduce_kernel<<<grid_stride_blocks(M * N, 256), 256, 0, stream>>>(split_ws, split,
                                                                                M * N, c, cfg, out);
    FP4SIM_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace fp4sim::gpu
