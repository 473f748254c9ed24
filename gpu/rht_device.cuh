// The GPU amax pass's formulation of emu/rht.hpp's rht16_abs_max: the largest |y_j| of a chunk's
// transform without rounding each of its 16 outputs. The outputs' rounding (RZ to FP32 of Y_j *
// 2^grid, then RNE to BF16) is monotone in |Y_j| and odd, so the largest |y_j| is the rounding of
// the largest |Y_j| (a monotone function commutes with a maximum), and the largest |Y_j| comes from
// the last butterfly stage without doing it: its pairs (p + q, p - q) have max(|p + q|, |p - q|) =
// |p| + |q|. One rounding a chunk instead of 16. Host and device (the host compiles it for
// tests/emu/test_mma.cpp, which holds it equal to rht16_abs_max on the host, with the reference
// conversions; tests/gpu/test_mma_gpu.cu on the device with gpu::DeviceFormats).
#pragma once

#include <cstdint>

#include "emu/formats.hpp"
#include "emu/hd.hpp"
#include "emu/mma.hpp"
#include "emu/rht.hpp"

namespace fp4sim::gpu {

// max_j |Y_j| (< 2^31) of a chunk's terms, without the last butterfly stage: its pairs (p + q,
// p - q) have max(|p + q|, |p - q|) = |p| + |q|.
FP4SIM_HD int32_t rht16_abs_max_of_terms(int32_t (&u)[kRhtSize]) {
  rht_butterflies<1>(u);
  rht_butterflies<2>(u);
  rht_butterflies<4>(u);
  int32_t ymax = 0;
  FP4SIM_UNROLL
  for (int k = 0; k < kRhtSize / 2; ++k) {
    const int32_t p = u[k] < 0 ? -u[k] : u[k], q = u[k + 8] < 0 ? -u[k + 8] : u[k + 8];
    ymax = p + q > ymax ? p + q : ymax;
  }
  return ymax;
}

// One output Y_j on a fast grid (rht16_grid_fast(grid)), as rht16_packed rounds it.
template <class Fmt>
FP4SIM_HD uint16_t rht16_round_fast(int32_t y, int grid) {
  return Fmt::bf16_rne(fmul_rn(int_to_f32_rz(y), rht16_grid_scale(grid)));
}

// max |y_j| of a chunk on the common path (every input finite, emax in [-99, 124]: the FMUL terms
// and the fast grid). Straight-line code: on the GPU it runs for every chunk, its result kept only
// where the path applies, so a caller's chunks can interleave (elsewhere the sums may wrap; that
// result is discarded).
template <class Fmt>
FP4SIM_HD float rht16_abs_max_common(const uint16_t* x, int emax) {
  int32_t u[kRhtSize];
  rht16_fmul_terms(x, emax, u);
  return bf16_to_f32(rht16_round_fast<Fmt>(rht16_abs_max_of_terms(u), emax - 2 - kBf16FdpaF));
}

// The same off the common path (an Inf or NaN input, all zeros, or inputs near the ends of the BF16
// range): out of line, it is rare. The chunk comes by value (an array whose address reaches a call
// lives in local memory on the GPU, stored there for every chunk).
struct Bf16Chunk {
  uint16_t v[kRhtSize];
};
template <class Fmt>
FP4SIM_HD_NOINLINE float rht16_abs_max_rare(Bf16Chunk chunk, uint32_t amax_bits) {
  const uint16_t* x = chunk.v;
  if (amax_bits >= 0x7F80u) {
    uint32_t w[kRhtSize / 2];
    rht16_special_packed(x, w);
    float m = 0.0f;
    for (int j = 0; j < kRhtSize; ++j)
      m = fmax_nan_ignored(m,
                           f32_abs(bf16_to_f32(static_cast<uint16_t>(w[j / 2] >> (16 * (j % 2))))));
    return m;
  }
  if (amax_bits == 0) return 0.0f;
  int32_t u[kRhtSize];
  const int emax = rht16_terms(x, amax_bits, u);
  const int32_t ymax = rht16_abs_max_of_terms(u);
  const int grid = emax - 2 - kBf16FdpaF;
  return bf16_to_f32(rht16_grid_fast(grid) ? rht16_round_fast<Fmt>(ymax, grid)
                                           : rht16_round_general<Fmt>(ymax, grid));
}

// emu's rht16_abs_max (the NaN-ignoring max |y_j| of rht16's outputs, 0 when every output is NaN;
// in_amax, optional: the NaN-ignoring max |x_i|), with one rounding a chunk.
template <class Fmt = ReferenceFormats>
FP4SIM_HD float rht16_abs_max_rounded_once(const uint16_t* x, float* in_amax = nullptr) {
  const uint32_t amax_bits = Fmt::bf16x16_max_magnitude_bits(x);
  if (in_amax)
    *in_amax =
        amax_bits >= 0x7F80u ? rht16_input_amax(x) : bf16_to_f32(static_cast<uint16_t>(amax_bits));
  const int emax = rht16_emax(amax_bits);
  // the common path: finite inputs, the FMUL terms (emax >= -102) and the fast grid (emax - 27 in
  // [-126, 97])
  const bool common = amax_bits < 0x7F80u && emax >= -99 && emax <= 124;
#if defined(__CUDA_ARCH__)
  // (the GPU computes the common path for every chunk, before the branch: straight-line code that
  // a caller's chunks can interleave)
  const float y = rht16_abs_max_common<Fmt>(x, common ? emax : 0);
  if (common) return y;
#else
  if (common) return rht16_abs_max_common<Fmt>(x, emax);
#endif
  Bf16Chunk c;
  FP4SIM_UNROLL
  for (int i = 0; i < kRhtSize; ++i) c.v[i] = x[i];
  return rht16_abs_max_rare<Fmt>(c, amax_bits);
}

}  // namespace fp4sim::gpu
