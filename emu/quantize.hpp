// Quantization API shared by both backends (DESIGN.md §5, §6): NVFP4 (1x16 or 16x16, E4M3 scales,
// FP32 global amax) and MXFP4 (1x32, UE8M0 scales); a row-wise and a column-wise (transposed) copy
// from one high-precision input in one call; RN or SR per copy; RHT on the column-wise copy; Four
// Over Six. Each copy is described as the tensor *as written* (rows x cols, blocks along the row).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "emu/quantize_block.hpp"
#include "emu/tensor.hpp"

namespace fp4sim {

// NVFP4 and MXFP4 (E2M1 codes, two per byte); FP8 (E4M3 codes, one per byte, FP32 scale per
// 1x128 block or 128x128 tile: the paper's FP8 baseline, DESIGN.md §9).
enum class QFormat : uint8_t { NVFP4, MXFP4, FP8 };

// Elements per scale (host and device).
FP4SIM_HD int64_t qformat_block(QFormat f) {
  return f == QFormat::FP8 ? kFp8Block : (f == QFormat::MXFP4 ? kMxfp4Block : kNvfp4Block);
}
enum class Rounding : uint8_t { RN, SR };
enum class FourOverSixError : uint8_t { MAE, MSE };

const char* qformat_name(QFormat f);

// One output copy.
struct CopySpec {
  bool enabled = false;
  Rounding rounding = Rounding::RN;
  uint64_t stream = 0;         // SR stream; the row-wise and column-wise copies never share one
  bool rht = false;            // column-wise copy only
  bool four_over_six = false;  // NVFP4, RN, no RHT only
};

struct QuantizeConfig {
  QFormat format = QFormat::NVFP4;
  bool block_2d = false;  // NVFP4 16x16 tiles (weights)
  MxScaleRule mx_rule = MxScaleRule::Floor;
  FourOverSixError fos_error = FourOverSixError::MAE;
  uint64_t seed = 0;
  CopySpec rowwise;
  CopySpec columnwise;
};

// A quantized copy, the tensor as written: rows x cols, blocks along the row.
//   codes   [rows, cols/2]      two E2M1 per byte, element 2i in the low nibble
//                               (FP8: [rows, cols] E4M3)
//   scales  [rows, cols/block]  E4M3 (NVFP4; 2D: one entry per row, repeated down the tile) or
//                               UE8M0 (FP8: FP32 values, 4 bytes each; 2D: repeated down the
//                               128-row tile)
//   amax    [1]                 FP32 amax of the written copy (post-RHT where RHT is on)
struct QuantizedView {
  uint8_t* codes = nullptr;
  uint8_t* scales = nullptr;
  float* amax = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  QFormat format = QFormat::NVFP4;
  bool four_over_six = false;  // decode with 1/1536 instead of 1/2688
  Device device = Device::Host;
  // Optional, CUDA backend only (Backend::decodes_for_gemm): BF16 bits [rows, cols] that the
  // quantizer also writes, e2m1(code) * block scale (NVFP4: the E4M3 value; MXFP4: 2^(byte - 127)),
  // without the global scale. Exact (at most 6 significant bits), so it is the operand a BF16
  // tensor-core GEMM needs on Hopper, made while the codes are still in registers instead of by a
  // second pass over them. Null: not written. The emulator rejects a non-null one.
  uint16_t* decoded_bf16 = nullptr;
  // Optional, CUDA backend only, FP8 only (Backend::fp8_scales_for_gemm): the block scales again,
  // as [cols / 128, rows] (rows contiguous), the layout cuBLASLt's VEC128_32F scale mode reads, so
  // the GEMM needs no re-layout pass. Same values as scales. Null: not written. The emulator
  // rejects a non-null one.
  float* scales_gemm = nullptr;

  FP4SIM_HD int64_t block() const { return qformat_block(format); }
  int64_t code_bytes() const { return format == QFormat::FP8 ? rows * cols : rows * cols / 2; }
  int64_t scale_count() const { return rows * (cols / block()); }
  // FP8 scales are FP32 (4 bytes each, native byte order), the FP4 formats' one byte.
  int64_t scale_bytes() const { return scale_count() * (format == QFormat::FP8 ? 4 : 1); }
};

// Host-owned quantized copy (results of the CLI and of tests).
struct QuantizedHost {
  std::vector<uint8_t> codes;
  std::vector<uint8_t> scales;
  float amax = 0.0f;
  int64_t rows = 0;
  int64_t cols = 0;
  QFormat format = QFormat::NVFP4;
  bool four_over_six = false;

  void resize(int64_t rows, int64_t cols, QFormat format, bool four_over_six);
  int64_t block_size() const { return qformat_block(format); }
  QuantizedView view();
};

// Shape of the copy as written: rows x cols (row-wise) or cols x rows (column-wise).
struct CopyShape {
  int64_t rows;
  int64_t cols;
};
CopyShape written_shape(const TensorView& x, bool columnwise);

// Throws std::invalid_argument naming the tensor, shape or option when the config cannot apply to
// x: blocked dimension not a multiple of 16/32, 2D rows not a multiple of 16, RHT on the row-wise
// copy, RHT token dimension not a multiple of 16, MXFP4 with 2D or Four Over Six, Four Over Six
// with SR or RHT, no copy requested, wrong dtype.
void validate_quantize(const TensorView& x, const QuantizeConfig& cfg);

// Scale matrix [rows, k_blocks] -> padded 128x4 tiled layout (cuBLASLt VEC16_UE4M3 / VEC32_UE8M0).
// out has round_up(rows, 128) * round_up(k_blocks, 4) bytes; padding is zero.
void scales_to_tiled(const uint8_t* scales, int64_t rows, int64_t k_blocks, uint8_t* out);
int64_t tiled_scale_bytes(int64_t rows, int64_t k_blocks);

}  // namespace fp4sim
