// Quantization statistics (issue 5, the per-tensor statistics of the JSONL log): how a quantized
// copy differs from the F32 tensor it was made from. Each block's sums come from one host/device
// function; a row adds its blocks in order and the tensor its rows in order, on both backends, so
// the emulator and the CUDA backend report the same bits.
#pragma once

#include <cstdint>
#include <cstring>

#include "emu/formats.hpp"
#include "emu/hd.hpp"
#include "emu/quantize.hpp"
#include "emu/quantize_block.hpp"

namespace fp4sim {

// Sums over a quantized copy (or one block, or one row of blocks).
struct QuantErrorSums {
  double err2 = 0;  // sum over elements of (decoded - x)^2, in FP64
  double ref2 = 0;  // sum of x^2
  int64_t saturated =
      0;  // elements with |x| > element max * decode factor (|x * enc_b| > 6,
          // or > 448 for FP8, before rounding); blocks with a zero factor never count
  int64_t underflow_blocks = 0;  // blocks with amax_b > 0 whose stored scale is zero (NVFP4: the
                                 // E4M3 byte is 0; MXFP4 and FP8: the decode factor is 0)
};

// Block b (of cols / block) of row r. x: the F32 tensor (rows x cols, row-major, the copy's
// written shape); codes, scales: the copy's; amax: its global amax (NVFP4's decode factor).
FP4SIM_HD QuantErrorSums quant_block_error(const float* x, const uint8_t* codes,
                                           const uint8_t* scales, int64_t r, int64_t b,
                                           int64_t cols, QFormat format, bool four_over_six,
                                           float amax) {
  const bool mx = format == QFormat::MXFP4, fp8 = format == QFormat::FP8;
  const int64_t blk = qformat_block(format);
  const int64_t si = r * (cols / blk) + b;
  uint8_t s = 0;
  float factor;
  if (fp8) {
    std::memcpy(&factor, scales + 4 * si, 4);  // FP32 scale, native byte order
  } else {
    s = scales[si];
    factor = mx ? ue8m0_to_f32(s)
                : nvfp4_decode_factor(s, amax, four_over_six ? kFourOverSixRange : kNvfp4Range);
  }
  const float limit = fmul_rn(fp8 ? kE4M3Max : 6.0f, factor);
  QuantErrorSums e;
  float bmax = 0.0f;
  for (int64_t i = 0; i < blk; ++i) {
    const int64_t k = r * cols + b * blk + i;
    const float xv = x[k];
    const float d =
        fp8 ? fp8_decode_element(codes[k], factor)
            : decode_element(static_cast<uint8_t>((codes[k / 2] >> (4 * (k & 1))) & 0xFu), factor);
    const float ax = f32_abs(xv);
    if (ax > bmax) bmax = ax;  // a NaN is ignored, as fmax does
    if (factor > 0.0f && ax > limit) ++e.saturated;
    const double diff = static_cast<double>(d) - static_cast<double>(xv);
    e.err2 = dadd_rn(e.err2, dmul_rn(diff, diff));
    e.ref2 = dadd_rn(e.ref2, dmul_rn(static_cast<double>(xv), static_cast<double>(xv)));
  }
  if (bmax > 0.0f && ((mx || fp8) ? factor == 0.0f : s == 0)) e.underflow_blocks = 1;
  return e;
}

// a += b, the FP64 sums rounded once each
FP4SIM_HD void add_error_sums(QuantErrorSums& a, const QuantErrorSums& b) {
  a.err2 = dadd_rn(a.err2, b.err2);
  a.ref2 = dadd_rn(a.ref2, b.ref2);
  a.saturated += b.saturated;
  a.underflow_blocks += b.underflow_blocks;
}

// The tensor's sums from its rows' (n of them), added in row order: the last step on both backends.
FP4SIM_HD QuantErrorSums add_rows_in_order(const QuantErrorSums* rows, int64_t n) {
  QuantErrorSums total;
  for (int64_t r = 0; r < n; ++r) add_error_sums(total, rows[r]);
  return total;
}

// Throws std::invalid_argument (naming the copy's shape) unless x and q can be compared: non-null
// buffers, cols a multiple of the format's block. Both backends call it first.
void validate_quant_error_sums(const float* x, const QuantizedView& q);

// The sums of copy q (host memory) against x (host, F32, q.rows x q.cols): every row's blocks
// added in order, then the rows in order (rows in parallel with OpenMP; the result does not depend
// on the thread count). Throws std::invalid_argument naming the copy when its shape is unusable.
QuantErrorSums quant_error_sums(const float* x, const QuantizedView& q);

}  // namespace fp4sim
