// What the passes of the quantizer (gpu/quantize.cu) share: the tile shape, the input element
// types, programmatic dependent launch, the copies' kernel arguments and the NVFP4 1x16 block's
// encode and store. Definitions in an anonymous namespace: for gpu/quantize.cu and the pass headers
// it includes only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "emu/quantize_block.hpp"
#include "gpu/cuda_backend.hpp"
#include "gpu/decode_bf16.cuh"
#include "gpu/formats_device.cuh"

namespace fp4sim::gpu {
namespace {

constexpr int kTileRows = 64;
constexpr int kTileCols = 128;  // = threads per CTA
constexpr int kThreads = kTileCols;

template <class T>
struct Elem;
template <>
struct Elem<float> {
  static __device__ __forceinline__ float to_f32(float v) { return v; }
};
template <>
struct Elem<uint16_t> {  // BF16 bit pattern
  static __device__ __forceinline__ float to_f32(uint16_t v) { return bf16_to_f32(v); }
};
// The BF16 bits the RHT reads: FP32 input is rounded first, BF16 input passes through.
__device__ __forceinline__ uint16_t rht_input(float v) { return bf16_rne_cvt(v); }
__device__ __forceinline__ uint16_t rht_input(uint16_t v) { return v; }

// Programmatic dependent launch (sm_90 and later): the quantize pass is launched while the amax
// pass still runs (launch_quantize_pass), so its CTAs take the SMs the amax pass's last CTAs free,
// load their tiles, and only then wait (pdl_wait) for the amax pass to finish and its global amax
// to be visible. The amax passes allow that launch as soon as every CTA of theirs has started
// (pdl_allow_dependents); the quantize pass reads nothing the amax pass writes before its wait.
__device__ __forceinline__ void pdl_allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The NaN-ignoring max |v| of 16 BF16 values held as eight words (element 2q in word q's low half),
// from a tree of max.xorsign.abs.bf16x2 (per half: max(|a|, |b|), a NaN operand ignored; the sign
// bits it leaves are dropped at the end, and an all-NaN block, whose max is a NaN, gives 0 as
// amax_strided does). BF16 max is exact, so the amax is the FP32 one's value.
__device__ __forceinline__ uint32_t bf16x2_max_abs(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ float bf16x16_abs_max(const uint32_t* w) {
  const uint32_t m =
      bf16x2_max_abs(bf16x2_max_abs(bf16x2_max_abs(w[0], w[1]), bf16x2_max_abs(w[2], w[3])),
                     bf16x2_max_abs(bf16x2_max_abs(w[4], w[5]), bf16x2_max_abs(w[6], w[7])));
  const uint32_t hi = bf16x2_max_abs(m, m << 16);  // high half: the max of both halves
  return fmaxf(0.0f, fabsf(f32_from_bits(hi & 0xFFFF0000u)));
}

struct CopyArgs {
  bool enabled;
  bool sr;
  bool rht;
  bool four_over_six;
  uint64_t stream;
  uint8_t* codes;
  uint8_t* scales;
  const float* amax;
  uint16_t* decoded;  // QuantizedView::decoded_bf16 (null: not written)
};

struct QuantArgs {
  int64_t rows, cols, stride;
  bool vector_ok;
  bool mx;
  bool block_2d;
  bool mse;
  MxScaleRule mx_rule;
  CopyArgs row, col;
  bool col_staged;  // nvfp4_1x16_kernel (64x128 tiles): whole tiles stage the column-wise codes
                    // (host: R % 64 == 0, aligned)
  PhiloxKeys keys;  // philox_round_keys(the call's seed): every SR draw goes through sr_bits_keyed
};

// sr_bits_for_chunk's bits from the call's round keys (a.keys: the same bits, fewer instructions).
__device__ __forceinline__ SrBits sr_bits_keyed(bool enabled, const QuantArgs& a, uint64_t stream,
                                                uint64_t chunk) {
  SrBits s;
  s.enabled = enabled;
  s.bits = enabled ? sr_chunk_bits_keyed(a.keys, stream, chunk) : Philox4x32{{0, 0, 0, 0}};
  return s;
}

// One NVFP4 block of a copy written: its 8 code bytes for the 16 elements from e (the written
// tensor's row-major index of the block's first element), its scale at scale_index and, where the
// copy asks for it, its 16 decoded BF16 values (decode16_bf16) at e.
__device__ __forceinline__ void store_nvfp4_block(const CopyArgs& c, int64_t e, int64_t scale_index,
                                                  const uint8_t* packed, uint8_t s) {
  *reinterpret_cast<uint2*>(c.codes + e / 2) = *reinterpret_cast<const uint2*>(packed);
  c.scales[scale_index] = s;
  if (c.decoded) decode16_bf16(*reinterpret_cast<const uint2*>(packed), s, c.decoded + e);
}

// The recipe's common block (NVFP4 1x16, no Four Over Six), quantized and stored in one pass over
// its 16 values: nvfp4_quantize_1x16's amax, block scale, encode scale and E2M1 rounding (the
// device's e2m1_rn_magic / e2m1_rs_magic, by their step functions), and, with kDec, the decoded
// BF16 operand sign * magnitude * e4m3(s), the same bits decode16_bf16 makes from the codes (an
// exact product: its top 16 bits are its BF16), without decoding the codes again. Without kDec the
// codes come eight a word from e2m1x8_rn_scaled_prmt / e2m1x8_rs_scaled_prmt; with it they are
// summed into their word unsigned: e2m1_magic_code is steps + (mb >> 22) - 298 | sign << 3, so the
// word adds the first two terms at their nibbles (mod 2^32), subtracts 298 at every nibble once
// (leaving each nibble's code, 0..7) and then ORs the sign bits in. nvfp4_block_1x16_encode returns
// the 8 code bytes and the scale (writing only the decoded values); nvfp4_block_1x16_store stores
// them too.
template <bool kSr, bool kDec>
__device__ __forceinline__ uint2 nvfp4_block_1x16_encode(const float* v, float amax_b,
                                                         const Nvfp4Global& g, const SrBits& sr,
                                                         const CopyArgs& c, int64_t e,
                                                         uint8_t& scale) {
  const uint8_t s = nvfp4_block_scale<DeviceFormats>(amax_b, g.s_enc);
  const float sv = e4m3_to_f32_nonneg_cvt(s);  // (the scale's value once: the decode needs it too)
  const float enc =
      nvfp4_encode_from_scale_value(sv, g.s_dec);  // = nvfp4_block_encode_scale(s, g.s_dec)
  if constexpr (!kDec) {  // the common cases: eight codes a word, packed together
    scale = s;
    if constexpr (kSr) {  // (element j's random byte: byte j % 4 of word j / 4,
                          // sr_byte_for_element)
      return make_uint2(e2m1x8_rs_scaled_prmt(v, enc, sr.bits.v[0], sr.bits.v[1]),
                        e2m1x8_rs_scaled_prmt(v + 8, enc, sr.bits.v[2], sr.bits.v[3]));
    }
    return make_uint2(e2m1x8_rn_scaled_prmt(v, enc), e2m1x8_rn_scaled_prmt(v + 8, enc));
  }
  uint32_t w[2] = {0u, 0u}, sgn[2] = {0u, 0u}, d[8];
  FP4SIM_UNROLL
  for (int i = 0; i < kNvfp4Block; ++i) {
    const float cl = e2m1_clamp(fmul_rn(v[i], enc));
    const uint32_t mb = e2m1_magic_bits(cl);
    const uint32_t steps =
        kSr ? e2m1_rs_steps(cl, mb, sr_byte_for_element(sr.bits, i)) : e2m1_rn_steps(cl, mb);
    float mag;  // (here, not in the decode below: ptxas then gives the FP32 streaming kernel 40
                // registers, not 48)
    if constexpr (kDec) mag = e2m1_steps_magnitude(mb, steps);
    const uint32_t sign = f32_bits(cl) & 0x80000000u;
    w[i / 8] += (steps + (mb >> 22)) << (4 * (i % 8));
    sgn[i / 8] |= sign >> (28 - 4 * (i % 8));
    if constexpr (kDec) {
      const uint32_t b = f32_bits(fmul_rn(f32_from_bits(f32_bits(mag) | sign), sv)) >> 16;
      if (i % 2 == 0)
        d[i / 2] = b;
      else
        d[i / 2] |= b << 16;
    }
  }
  constexpr uint32_t kBase = kE2M1MagicCodeBase * 0x11111111u;  // 298 off every nibble (mod 2^32)
  if constexpr (kDec) {
    uint4* out = reinterpret_cast<uint4*>(c.decoded + e);
    out[0] = make_uint4(d[0], d[1], d[2], d[3]);
    out[1] = make_uint4(d[4], d[5], d[6], d[7]);
  }
  scale = s;
  return make_uint2((w[0] - kBase) | sgn[0], (w[1] - kBase) | sgn[1]);
}
// (amax_b: the block's NaN-ignoring max |v|, amax_strided's value, which BF16 callers take from
// bf16x16_unpack)
__device__ __forceinline__ uint2 nvfp4_block_1x16_encode(const float* v, float amax_b,
                                                         const Nvfp4Global& g, const SrBits& sr,
                                                         const CopyArgs& c, int64_t e,
                                                         uint8_t& scale) {
  if (sr.enabled) {
    return c.decoded ? nvfp4_block_1x16_encode<true, true>(v, amax_b, g, sr, c, e, scale)
                     : nvfp4_block_1x16_encode<true, false>(v, amax_b, g, sr, c, e, scale);
  }
  return c.decoded ? nvfp4_block_1x16_encode<false, true>(v, amax_b, g, sr, c, e, scale)
                   : nvfp4_block_1x16_encode<false, false>(v, amax_b, g, sr, c, e, scale);
}
// amax_strided's value as a tree (depth 4, not a chain of 16: the column walks wait on it): a
// NaN-ignoring max is associative, an all-NaN block's NaN ends as 0 in the last max.
__device__ __forceinline__ float amax16(const float* v) {
  float m[kNvfp4Block / 2];
  FP4SIM_UNROLL
  for (int i = 0; i < kNvfp4Block / 2; ++i) m[i] = fmaxf(fabsf(v[2 * i]), fabsf(v[2 * i + 1]));
  FP4SIM_UNROLL
  for (int w = kNvfp4Block / 4; w >= 1; w /= 2) {
    FP4SIM_UNROLL
    for (int i = 0; i < w; ++i) m[i] = fmaxf(m[i], m[i + w]);
  }
  return fmaxf(0.0f, m[0]);
}
__device__ __forceinline__ void nvfp4_block_1x16_store(const float* v, float amax_b,
                                                       const Nvfp4Global& g, const SrBits& sr,
                                                       const CopyArgs& c, int64_t e,
                                                       int64_t scale_index) {
  uint8_t s;
  *reinterpret_cast<uint2*>(c.codes + static_cast<uint64_t>(e) / 2) =
      nvfp4_block_1x16_encode(v, amax_b, g, sr, c, e, s);
  c.scales[scale_index] = s;
}

// 16 BF16 values held as eight words (element 2q in word q's low half): their FP32 values (a shift
// or a mask each) and their NaN-ignoring amax (bf16x16_abs_max).
__device__ __forceinline__ float bf16x16_unpack(const uint32_t* w, float* v) {
  FP4SIM_UNROLL
  for (int q = 0; q < kNvfp4Block / 2; ++q) {
    v[2 * q] = f32_from_bits(w[q] << 16);
    v[2 * q + 1] = f32_from_bits(w[q] & 0xFFFF0000u);
  }
  return bf16x16_abs_max(w);
}
// A 1x16 block's FP32 values from its raw elements (FP32, or BF16 16-byte aligned) and its amax.
template <class T>
__device__ __forceinline__ float block16_values(const T* raw, float* v) {
  if constexpr (sizeof(T) == 2) {
    return bf16x16_unpack(reinterpret_cast<const uint32_t*>(raw), v);
  } else {
    FP4SIM_UNROLL
    for (int i = 0; i < kNvfp4Block; ++i) v[i] = Elem<T>::to_f32(raw[i]);
    return amax16(v);
  }
}

}  // namespace
}  // namespace fp4sim::gpu
