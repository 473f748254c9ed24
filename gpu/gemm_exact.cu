// Exact block-scaled FP4 GEMM on the GPU, two kernels with the same bits as the emulator:
//  - gemm_exact_reference_kernel: one thread per output element through the readable per-code
//    GST-FDPA function (emu/mma.hpp), kept as the simplest correct version;
//  - gemm_exact_tiled_kernel: 64 x 64 output tiles; each 64-wide K chunk of both operands is
//    decoded once into shared memory (2 * e2m1 as int8, per-group zero/sign masks, packed scales),
//    each thread computes 4 x 4 outputs: the 16-element group sums with __dp4a (exact integer dot
//    products), then the lean core from unpacked scales for the common case and the packed core,
//    out of line, for the rest (NaN scales, non-finite C, a zero sum): gpu/gst_fdpa_device.cuh's
//    gst_fdpa_core_lean_variant and gst_fdpa_core_packed_fp64. Views whose codes are not 8-byte
//    aligned take the reference kernel. Every formulation is tested equal to the readable core on
//    the CPU, and the tiled kernel bitwise equal to the emulator on the GPU.
#include <cuda_runtime.h>

#include <iterator>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "emu/gemm.hpp"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/formats_device.cuh"
#include "gpu/gst_fdpa_device.cuh"

namespace fp4sim::gpu {
namespace {

// Chunk ch of row r: 32 packed code bytes and the chunk's scale bytes, zero-padded past K.
__device__ void gather_chunk(const QuantizedView& q, int64_t r, int64_t ch, uint8_t* packed,
                             uint8_t* scales) {
  const int64_t K = q.cols, k0 = ch * kGemmChunk;
  const int64_t block = q.format == QFormat::MXFP4 ? kMxfp4Block : kNvfp4Block;
  const int64_t spr = K / block;
  if (k0 + kGemmChunk <= K) {
    const uint8_t* src = q.codes + (r * K + k0) / 2;
    for (int i = 0; i < kGemmChunk / 2; ++i) packed[i] = src[i];
  } else {
    for (int i = 0; i < kGemmChunk / 2; ++i)
      packed[i] = (k0 + 2 * i < K) ? q.codes[(r * K + k0) / 2 + i] : uint8_t(0);
  }
  const int nscales = q.format == QFormat::MXFP4 ? 2 : 4;
  for (int s = 0; s < nscales; ++s) {
    const int64_t kk = k0 + s * (kGemmChunk / nscales);
    scales[s] = kk < K ? q.scales[r * spr + kk / block] : uint8_t(0);
  }
}

__global__ void gemm_exact_reference_kernel(QuantizedView a, QuantizedView b, const float* c,
                                            GemmConfig cfg, void* out) {
  const int64_t N = b.rows;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.rows * N) return;
  const int64_t m = idx / N, n = idx % N;
  const ScaleKind kind = a.format == QFormat::MXFP4 ? ScaleKind::UE8M0_32 : ScaleKind::UE4M3_16;
  const float total = split_k_chain(cfg.split_k, gemm_chunks(a.cols), [&](int64_t ch, float acc) {
    uint8_t pa[kGemmChunk / 2], pb[kGemmChunk / 2], sa[4], sb[4];
    gather_chunk(a, m, ch, pa, sa);
    gather_chunk(b, n, ch, pb, sb);
    return f32_from_bits(gst_fdpa_fp4_bits(pa, pb, sa, sb, kind, acc));
  });
  const float alpha =
      gemm_epilogue_alpha(cfg.alpha, a.format, *a.amax, a.four_over_six, *b.amax, b.four_over_six);
  gemm_store<DeviceFormats>(cfg, alpha, total, c, idx, out);
}

constexpr int kTile = 64;           // output rows (of A) and columns (rows of B) per block
constexpr int kTiledThreads = 256;  // 16 x 16 threads, 4 x 4 outputs each
constexpr int kPer = 4;
constexpr int kRowBytes = kGemmChunk + 16;  // int8 row stride in shared memory (80 B: the 16-byte
                                            // loads of 8 consecutive rows hit distinct banks)

// One operand's chunk in shared memory, in one of two layouts behind the same accessors (tw: a
// row's 64 values 2 * e2m1 as int8, zero beyond the tensor; nzm/sign: per-group masks of nonzero
// and negative codes; scale: pack_scale(decode_scale(byte)); sigv/expv/nanv: the scales unpacked
// for the lean core (variant 2): significand (0 for a zero scale), exponent reading, NaN flag).
struct ChunkTile {  // one array per field
  int8_t twice[kTile * kRowBytes];
  uint16_t nonzero[kTile][kGstGroups];
  uint16_t sign[kTile][kGstGroups];
  uint32_t scale[kTile][kGstGroups];
  int32_t sig[kTile][kGstGroups];
  int32_t exp[kTile][kGstGroups];
  uint8_t nan[kTile][kGstGroups];
  __device__ int8_t* tw(int r) { return twice + r * kRowBytes; }
  __device__ uint16_t& nzm(int r, int g) { return nonzero[r][g]; }
  __device__ uint16_t nzm(int r, int g) const { return nonzero[r][g]; }
  __device__ int32_t& sigv(int r, int g) { return sig[r][g]; }
  __device__ int32_t& expv(int r, int g) { return exp[r][g]; }
  __device__ uint8_t& nanv(int r, int g) { return nan[r][g]; }
  __device__ uint32_t nan_word(int r) const {
    return *reinterpret_cast<const uint32_t*>(&nan[r][0]);
  }
};

// kRows (variants 7 and 8): what the common path reads per row in one 112-byte record (the 64
// values, then sig[4], exp[4], nonzero[4], nan[4], 4 bytes free), so one base address per row plus
// immediate offsets reach all of it. The SASS of the array layout spends ~8 of the ~144
// instructions per output and chunk recomputing five arrays' addresses (64 registers leave no room
// to keep them). 112 bytes = 28 words: the 16-byte loads of 8 consecutive rows still hit distinct
// banks, like the 80-byte stride.
constexpr int kRecBytes = 112;
struct ChunkTileRows {
  alignas(16) unsigned char rec[kTile * kRecBytes];
  uint16_t sign[kTile][kGstGroups];
  uint32_t scale[kTile][kGstGroups];
  template <class T>
  __device__ T& at(int r, int off) {
    return *reinterpret_cast<T*>(rec + r * kRecBytes + off);
  }
  template <class T>
  __device__ T at(int r, int off) const {
    return *reinterpret_cast<const T*>(rec + r * kRecBytes + off);
  }
  __device__ int8_t* tw(int r) { return reinterpret_cast<int8_t*>(rec + r * kRecBytes); }
  __device__ uint16_t& nzm(int r, int g) { return at<uint16_t>(r, 96 + 2 * g); }
  __device__ uint16_t nzm(int r, int g) const { return at<uint16_t>(r, 96 + 2 * g); }
  __device__ int32_t& sigv(int r, int g) { return at<int32_t>(r, 64 + 4 * g); }
  __device__ int32_t& expv(int r, int g) { return at<int32_t>(r, 80 + 4 * g); }
  __device__ uint8_t& nanv(int r, int g) { return at<uint8_t>(r, 104 + g); }
  __device__ uint32_t nan_word(int r) const { return at<uint32_t>(r, 104); }
};

// Thread t decodes group (t % 4) of row (t / 4) of the tile: 16 codes (8 bytes) and its scale.
template <bool kLean, bool kBiased, class Tile>
__device__ void load_chunk_tile(const QuantizedView& q, int64_t row0, int64_t ch, ScaleKind kind,
                                Tile& s) {
  const int t = threadIdx.x, r = t / kGstGroups, g = t % kGstGroups;
  const int64_t row = row0 + r, k0 = ch * kGemmChunk + g * kGstGroup;
  const int block_shift = kind == ScaleKind::UE8M0_32 ? 5 : 4;
  uint2 codes = make_uint2(0u, 0u);
  uint8_t sbyte = 0;  // K padding and rows past the tensor: zero codes, scale byte 0x00
  if (row < q.rows && k0 < q.cols) {  // K is a multiple of 16: a group is all in or all out
    codes = *reinterpret_cast<const uint2*>(q.codes + ((row * q.cols + k0) >> 1));
    sbyte = q.scales[row * (q.cols >> block_shift) + (k0 >> block_shift)];
  }
  uint32_t words[4];
  uint32_t nz = 0, sg = 0;
  FP4SIM_UNROLL
  for (int i = 0; i < 16; ++i) {
    const uint32_t code = ((i < 8 ? codes.x : codes.y) >> (4 * (i & 7))) & 0xFu;
    const uint32_t v = static_cast<uint32_t>(e2m1_twice(static_cast<uint8_t>(code))) & 0xFFu;
    if (i % 4 == 0) words[i / 4] = 0;
    words[i / 4] |= v << (8 * (i % 4));
    nz |= ((code & 7u) != 0 ? 1u : 0u) << i;
    sg |= (code >> 3) << i;
  }
  *reinterpret_cast<uint4*>(s.tw(r) + g * kGstGroup) =
      make_uint4(words[0], words[1], words[2], words[3]);
  s.nzm(r, g) = static_cast<uint16_t>(nz);
  s.sign[r][g] = static_cast<uint16_t>(sg);
  const DecodedScale ds = decode_scale(sbyte, kind);
  s.scale[r][g] = pack_scale(ds);
  if constexpr (kLean) {
    const int32_t sig = ds.zero ? 0 : static_cast<int32_t>(ds.sig);
    s.sigv(r, g) = sig;
    // kBiased (variant 5): a zero scale's exponent reading is kGstZeroScaleExp, for
    // gst_fdpa_core_lean_variant<true, ...>
    s.expv(r, g) = kBiased ? gst_zero_scale_biased(sig, ds.exp) : ds.exp;
    s.nanv(r, g) = ds.nan ? 1 : 0;
  }
}

// The packed core for one output from the shared tiles (row ra of A's tile, rb of B's), with A's
// packed scales wa already in registers: variant 1's path for every output.
template <class Tile>
__device__ __forceinline__ float packed_core(const int32_t* p4, const uint32_t* wa, const Tile& sa,
                                             const Tile& sb, int ra, int rb, int man_bits,
                                             float acc) {
  uint32_t all_zero = 0, all_neg_zero = 0, wb[kGstGroups];
  FP4SIM_UNROLL
  for (int g = 0; g < kGstGroups; ++g) {
    const uint32_t nz = static_cast<uint32_t>(sa.nzm(ra, g)) & sb.nzm(rb, g);
    const uint32_t neg = static_cast<uint32_t>(sa.sign[ra][g]) ^ sb.sign[rb][g];
    all_zero |= (nz == 0 ? 1u : 0u) << g;
    all_neg_zero |= (nz == 0 && neg == 0xFFFFu ? 1u : 0u) << g;
    wb[g] = sb.scale[rb][g];
  }
  return f32_from_bits(
      gst_fdpa_core_packed_fp64(p4, all_zero, all_neg_zero, wa, wb, man_bits, acc));
}

// The same for the lean kernels' rare path (NaN scales, non-finite C, a zero sum), out of line so
// its registers do not count against the common path.
template <class Tile>
__device__ __noinline__ float packed_core_from_tiles(const int32_t* p4, const Tile& sa,
                                                     const Tile& sb, int ra, int rb, int man_bits,
                                                     float acc) {
  uint32_t wa[kGstGroups];
  FP4SIM_UNROLL
  for (int g = 0; g < kGstGroups; ++g) wa[g] = sa.scale[ra][g];
  return packed_core(p4, wa, sa, sb, ra, rb, man_bits, acc);
}

// The same with the group sums by value (kFold): a pointer makes the caller store them to local
// memory on every output and chunk, whether the call happens or not.
template <class Tile>
__device__ __noinline__ float packed_core_from_values(int32_t p0, int32_t p1, int32_t p2,
                                                      int32_t p3, const Tile& sa, const Tile& sb,
                                                      int ra, int rb, int man_bits, float acc) {
  const int32_t p4[kGstGroups] = {p0, p1, p2, p3};
  return packed_core_from_tiles(p4, sa, sb, ra, rb, man_bits, acc);
}

// kLean (variant 2): the common case through the lean core from unpacked scales, fewer integer
// instructions per output and chunk; the rest (NaN scales, non-finite C, a zero sum) as variant 1.
// kRows: the ChunkTileRows layout. kFold (needs kBiased): a group whose products are all zero gets
// B's exponent kGstZeroScaleExp instead of a bit in an all-zero mask (the same answers and bits,
// tests/emu/test_mma.cpp), so the core's per-group mask selects fold away; the group sums reach
// the out-of-line path by value.
template <bool kLean, int kMinBlocks, bool kSplit, bool kBiased = false, bool kExpAdd = false,
          bool kRows = false, bool kFold = false>
__global__ void __launch_bounds__(kTiledThreads, kMinBlocks)
    gemm_exact_tiled_kernel(QuantizedView a, QuantizedView b, const float* c, GemmConfig cfg,
                            void* out) {
  static_assert(!kFold || (kLean && kBiased), "kFold needs the biased lean core");
  using Tile = std::conditional_t<kRows, ChunkTileRows, ChunkTile>;
  __shared__ Tile sa, sb;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTile,
                n0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  const ScaleKind kind = a.format == QFormat::MXFP4 ? ScaleKind::UE8M0_32 : ScaleKind::UE4M3_16;
  const int man_bits = kind == ScaleKind::UE4M3_16 ? 3 : 0;
  const int64_t chunks = gemm_chunks(a.cols), per_split = chunks / cfg.split_k;
  float total[kPer][kPer];
  const int splits = kSplit ? cfg.split_k : 1;
  for (int s = 0; s < splits; ++s) {
    float acc[kPer][kPer];
    FP4SIM_UNROLL
    for (int i = 0; i < kPer; ++i) FP4SIM_UNROLL
    for (int j = 0; j < kPer; ++j) acc[i][j] = 0.0f;
    for (int64_t ch = s * per_split; ch < (s + 1) * per_split; ++ch) {
      __syncthreads();  // the previous chunk's readers are done
      load_chunk_tile<kLean, kBiased>(a, m0, ch, kind, sa);
      load_chunk_tile<kLean, kBiased>(b, n0, ch, kind, sb);
      __syncthreads();
#pragma unroll 1
      for (int i = 0; i < kPer; ++i) {
        const int ra = ty + 16 * i;
        const uint4* xa = reinterpret_cast<const uint4*>(sa.tw(ra));
        const uint4 x0 = xa[0], x1 = xa[1], x2 = xa[2], x3 = xa[3];
        uint32_t wa[kGstGroups];
        if constexpr (!kLean) {
          FP4SIM_UNROLL
          for (int g = 0; g < kGstGroups; ++g) wa[g] = sa.scale[ra][g];
        }
        int32_t siga[kGstGroups], expa[kGstGroups];
        uint32_t nza[kGstGroups], nan_a = 0;
        if constexpr (kLean) {
          FP4SIM_UNROLL
          for (int g = 0; g < kGstGroups; ++g) {
            siga[g] = sa.sigv(ra, g);
            expa[g] = sa.expv(ra, g);
            if constexpr (!kFold) nza[g] = sa.nzm(ra, g);  // (kFold reads them where needed)
          }
          nan_a = sa.nan_word(ra);
        }
        FP4SIM_UNROLL
        for (int j = 0; j < kPer; ++j) {
          const int rb = tx + 16 * j;
          const uint4* xb = reinterpret_cast<const uint4*>(sb.tw(rb));
          const uint4 y0 = xb[0], y1 = xb[1], y2 = xb[2], y3 = xb[3];
          int32_t p4[kGstGroups];
          p4[0] = __dp4a(int(x0.w), int(y0.w),
                         __dp4a(int(x0.z), int(y0.z),
                                __dp4a(int(x0.y), int(y0.y), __dp4a(int(x0.x), int(y0.x), 0))));
          p4[1] = __dp4a(int(x1.w), int(y1.w),
                         __dp4a(int(x1.z), int(y1.z),
                                __dp4a(int(x1.y), int(y1.y), __dp4a(int(x1.x), int(y1.x), 0))));
          p4[2] = __dp4a(int(x2.w), int(y2.w),
                         __dp4a(int(x2.z), int(y2.z),
                                __dp4a(int(x2.y), int(y2.y), __dp4a(int(x2.x), int(y2.x), 0))));
          p4[3] = __dp4a(int(x3.w), int(y3.w),
                         __dp4a(int(x3.z), int(y3.z),
                                __dp4a(int(x3.y), int(y3.y), __dp4a(int(x3.x), int(y3.x), 0))));
          if constexpr (kFold) {
            int32_t sigb[kGstGroups], expb[kGstGroups];
            FP4SIM_UNROLL
            for (int g = 0; g < kGstGroups; ++g) {
              sigb[g] = sb.sigv(rb, g);
              expb[g] = sb.expv(rb, g);
            }
            if ((p4[0] == 0) | (p4[1] == 0) | (p4[2] == 0) | (p4[3] == 0)) {  // rare
              FP4SIM_UNROLL
              for (int g = 0; g < kGstGroups; ++g)
                if ((static_cast<uint32_t>(sa.nzm(ra, g)) & sb.nzm(rb, g)) == 0)
                  expb[g] = kGstZeroScaleExp;
            }
            uint32_t bits;
            if ((nan_a | sb.nan_word(rb)) == 0 &&
                gst_fdpa_core_lean_variant<true, kExpAdd>(p4, siga, expa, sigb, expb, 0u, man_bits,
                                                          acc[i][j], &bits)) {
              acc[i][j] = f32_from_bits(bits);
              continue;
            }
            acc[i][j] = packed_core_from_values(p4[0], p4[1], p4[2], p4[3], sa, sb, ra, rb,
                                                man_bits, acc[i][j]);
            continue;
          } else if constexpr (kLean) {
            int32_t sigb[kGstGroups], expb[kGstGroups];
            uint32_t all_zero = 0;
            FP4SIM_UNROLL
            for (int g = 0; g < kGstGroups; ++g) {
              sigb[g] = sb.sigv(rb, g);
              expb[g] = sb.expv(rb, g);
              if constexpr (!kBiased) all_zero |= ((nza[g] & sb.nzm(rb, g)) == 0 ? 1u : 0u) << g;
            }
            // variant 5: a group with a nonzero sum has a nonzero product, so the masks are only
            // needed where some group sum is zero (rare: the branch is almost never taken)
            if constexpr (kBiased) {
              if ((p4[0] == 0) | (p4[1] == 0) | (p4[2] == 0) | (p4[3] == 0)) {
                FP4SIM_UNROLL
                for (int g = 0; g < kGstGroups; ++g)
                  all_zero |= ((nza[g] & sb.nzm(rb, g)) == 0 ? 1u : 0u) << g;
              }
            }
            const uint32_t nan_b = sb.nan_word(rb);
            uint32_t bits;
            if ((nan_a | nan_b) == 0 &&
                gst_fdpa_core_lean_variant<kBiased, kExpAdd>(p4, siga, expa, sigb, expb, all_zero,
                                                             man_bits, acc[i][j], &bits)) {
              acc[i][j] = f32_from_bits(bits);
              continue;
            }
          }
          if constexpr (kLean && !kFold) {
            acc[i][j] = packed_core_from_tiles(p4, sa, sb, ra, rb, man_bits, acc[i][j]);
            continue;
          }
          acc[i][j] = packed_core(p4, wa, sa, sb, ra, rb, man_bits, acc[i][j]);
        }
      }
    }
    FP4SIM_UNROLL
    for (int i = 0; i < kPer; ++i) FP4SIM_UNROLL
    for (int j = 0; j < kPer; ++j)
      total[i][j] = (!kSplit || s == 0) ? acc[i][j] : fadd_rn(total[i][j], acc[i][j]);
  }
  const float alpha =
      gemm_epilogue_alpha(cfg.alpha, a.format, *a.amax, a.four_over_six, *b.amax, b.four_over_six);
  const int64_t N = b.rows;
  FP4SIM_UNROLL
  for (int i = 0; i < kPer; ++i) {
    const int64_t m = m0 + ty + 16 * i;
    FP4SIM_UNROLL
    for (int j = 0; j < kPer; ++j) {
      const int64_t n = n0 + tx + 16 * j;
      if (m >= a.rows || n >= N) continue;
      const int64_t idx = m * N + n;
      gemm_store<DeviceFormats>(cfg, alpha, total[i][j], c, idx, out);
    }
  }
}

// The tiled kernel's instantiation (kLean, 4 CTAs per SM, kBiased, kExpAdd, kRows and kFold), by
// split-K: 20.4 TFLOP/s at 8192^3 on the H200 (docs/performance.md).
using Kernel = void (*)(QuantizedView, QuantizedView, const float*, GemmConfig, void*);
constexpr Kernel kTiled[2] = {gemm_exact_tiled_kernel<true, 4, false, true, true, true, true>,
                              gemm_exact_tiled_kernel<true, 4, true, true, true, true, true>};

}  // namespace

void gemm_exact_launch(const QuantizedView& a, const QuantizedView& b, const float* c,
                       const GemmConfig& cfg, void* out, cudaStream_t stream) {
  // the tiled kernel reads codes 8 bytes at a time; views at odd offsets take the reference kernel
  const bool aligned = reinterpret_cast<uintptr_t>(a.codes) % 8 == 0 &&
                       reinterpret_cast<uintptr_t>(b.codes) % 8 == 0;
  if (aligned) {
    const dim3 grid(static_cast<unsigned>((b.rows + kTile - 1) / kTile),
                    static_cast<unsigned>((a.rows + kTile - 1) / kTile));
    kTiled[cfg.split_k > 1 ? 1 : 0]<<<grid, kTiledThreads, 0, stream>>>(a, b, c, cfg, out);
    FP4SIM_CUDA_CHECK_LAUNCH();
    return;
  }
  const int64_t n = a.rows * b.rows;
  const int threads = 128;
  gemm_exact_reference_kernel<<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0,
                                stream>>>(a, b, c, cfg, out);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

}  // namespace fp4sim::gpu
