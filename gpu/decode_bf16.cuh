// Device helpers: FP4 codes -> the BF16 operand of a BF16 tensor-core GEMM, e2m1(code) * block
// scale without the global scale. Exact: the product has at most 6 significant bits (1 + 3 +
// carry) and lies inside BF16's range, so its BF16 RNE is its top 16 bits (a NaN scale gives a
// NaN). Shared by the cuBLASLt GEMM's decode pass (gpu/gemm_cublaslt.cu) and the quantizer, which
// writes the same bits while the codes are still in registers (QuantizedView::decoded_bf16).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "emu/formats.hpp"
#include "emu/quantize.hpp"

namespace fp4sim::gpu {

// E2M1 code -> FP32, by table: the 8 magnitudes' FP32 patterns have only their top two bytes set
// (0, 0.5, 1, 1.5, 2, 3, 4, 6 = 0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0),
// each picked with one byte permute; the sign is bit 3. Equal to e2m1_to_f32 for all 16 codes (the
// cuBLASLt-vs-exact tests would see any difference); a few instructions instead of ~15.
__device__ __forceinline__ float e2m1_to_f32_by_table(uint32_t code) {
  const uint32_t mag = code & 0x7u;
  const uint32_t hi = __byte_perm(0x3F3F3F00u, 0x40404040u, mag) & 0xFFu;
  const uint32_t lo = __byte_perm(0xC0800000u, 0xC0804000u, mag) & 0xFFu;
  return __uint_as_float((hi << 24) | (lo << 16) | ((code & 0x8u) << 28));
}

// The decoded scale of a block: E4M3 (NVFP4) or 2^(byte - 127) (MXFP4).
__device__ __forceinline__ float block_scale_value(QFormat f, uint8_t s) {
  return f == QFormat::MXFP4 ? ue8m0_to_f32(s) : e4m3_to_f32(s);
}

// 4 code bytes (8 elements, element 2i in the low nibble) -> 8 BF16 bit patterns, one 16-byte
// store.
__device__ __forceinline__ void decode8_bf16(uint32_t codes, float sv, uint16_t* out) {
  uint32_t packed[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = __float_as_uint(fmul_rn(e2m1_to_f32_by_table(codes >> (8 * i)), sv)) >> 16;
    const uint32_t hi =
        __float_as_uint(fmul_rn(e2m1_to_f32_by_table(codes >> (8 * i + 4)), sv)) >> 16;
    packed[i] = lo | (hi << 16);
  }
  *reinterpret_cast<uint4*>(out) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// decode8_bf16 for an NVFP4 scale value (E4M3: 4 significant bits, 2^-9..448), two elements an
// instruction: the magnitudes' BF16 bytes by byte permutes from two 8-entry tables (hi: 00 3F 3F 3F
// 40 40 40 40, lo: 00 00 80 C0 00 40 80 C0), the code's sign bit into bit 15 of each half, then one
// packed BF16 multiply by (sv, sv). The product of an E2M1 value and an E4M3 one is exact in BF16
// (<= 6 significant bits, 2^-10..2688: no rounding, no subnormal), so it is decode8_bf16's top 16
// bits; a NaN sv (scale 0x7F) gives a NaN either way. FormatsGpu.Nvfp4DecodeEqualsFp32Formulation
// holds it equal to decode8_bf16 for every scale byte.
__device__ __forceinline__ void decode8_bf16_nvfp4(uint32_t codes, float sv, uint16_t* out) {
  const uint32_t mag = codes & 0x77777777u;  // (a set bit 3 in a selector would replicate a sign)
  const uint32_t sv2 = (__float_as_uint(sv) >> 16) * 0x10001u;  // sv is exact in BF16
  uint32_t packed[4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // codes 4h .. 4h + 3
    const uint32_t sel = mag >> (16 * h);
    const uint32_t hi = __byte_perm(0x3F3F3F00u, 0x40404040u, sel);
    const uint32_t lo = __byte_perm(0xC0800000u, 0xC0804000u, sel);
    const uint32_t c4 = codes >> (16 * h);
#pragma unroll
    for (int p = 0; p < 2; ++p) {  // codes 4h + 2p, 4h + 2p + 1 -> one BF16 pair
      uint32_t m = __byte_perm(lo, hi, p == 0 ? 0x5140u : 0x7362u);
      const uint32_t c2 = c4 >> (8 * p);  // sign bits at 3 and 7 -> 15 and 31
      m |= ((c2 << 12) & 0x8000u) | ((c2 << 24) & 0x80000000u);
      uint32_t r;
      asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(m), "r"(sv2));
      packed[2 * h + p] = r;
    }
  }
  *reinterpret_cast<uint4*>(out) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// One NVFP4 block's 8 code bytes (as a uint2) and E4M3 scale -> 16 BF16 at out (16-byte aligned).
__device__ __forceinline__ void decode16_bf16(uint2 codes, uint8_t scale, uint16_t* out) {
  const float sv = e4m3_to_f32(scale);
  decode8_bf16_nvfp4(codes.x, sv, out);
  decode8_bf16_nvfp4(codes.y, sv, out + 8);
}

// One MXFP4 block's 16 code bytes and UE8M0 scale -> 32 BF16 at out (16-byte aligned).
__device__ __forceinline__ void decode32_mx_bf16(const uint8_t* packed, uint8_t scale,
                                                 uint16_t* out) {
  const float sv = ue8m0_to_f32(scale);
  const uint4 w = *reinterpret_cast<const uint4*>(packed);
  decode8_bf16(w.x, sv, out);
  decode8_bf16(w.y, sv, out + 8);
  decode8_bf16(w.z, sv, out + 16);
  decode8_bf16(w.w, sv, out + 24);
}

// Elements [c0, c0 + 8) of row r of q (c0 a multiple of 8) -> out (row-major, q.cols per row).
__device__ __forceinline__ void dequantize_chunk_bf16(const QuantizedView& q, uint16_t* out,
                                                      int64_t r, int64_t c0) {
  const int block_shift = q.format == QFormat::MXFP4 ? 5 : 4;  // 32 or 16 elements per scale
  const uint8_t s = q.scales[r * (q.cols >> block_shift) + (c0 >> block_shift)];
  const uint32_t codes = *reinterpret_cast<const uint32_t*>(q.codes + ((r * q.cols + c0) >> 1));
  decode8_bf16(codes, block_scale_value(q.format, s), out + r * q.cols + c0);
}

}  // namespace fp4sim::gpu
