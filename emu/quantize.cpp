#include "emu/quantize.hpp"

#include <sstream>
#include <stdexcept>
#include <vector>

#include "emu/quant_stats.hpp"

namespace fp4sim {

std::string shape_str(int64_t rows, int64_t cols) {
  std::ostringstream s;
  s << "[" << rows << ", " << cols << "]";
  return s.str();
}

const char* qformat_name(QFormat f) {
  return f == QFormat::FP8 ? "fp8" : (f == QFormat::MXFP4 ? "mxfp4" : "nvfp4");
}

void QuantizedHost::resize(int64_t r, int64_t c, QFormat f, bool fos) {
  rows = r;
  cols = c;
  format = f;
  four_over_six = fos;
  const int64_t block = qformat_block(f);
  codes.assign(static_cast<size_t>(f == QFormat::FP8 ? r * c : r * c / 2), 0);
  scales.assign(static_cast<size_t>(r * (c / block) * (f == QFormat::FP8 ? 4 : 1)), 0);
  amax = 0.0f;
}

QuantizedView QuantizedHost::view() {
  QuantizedView v;
  v.codes = codes.data();
  v.scales = scales.data();
  v.amax = &amax;
  v.rows = rows;
  v.cols = cols;
  v.format = format;
  v.four_over_six = four_over_six;
  v.device = Device::Host;
  return v;
}

CopyShape written_shape(const TensorView& x, bool columnwise) {
  return columnwise ? CopyShape{x.cols, x.rows} : CopyShape{x.rows, x.cols};
}

namespace {
[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }
}  // namespace

void validate_quantize(const TensorView& x, const QuantizeConfig& cfg) {
  const std::string name = std::string("tensor '") + x.name + "' " + shape_str(x.rows, x.cols);
  if (x.dtype != DType::F32 && x.dtype != DType::BF16)
    fail(name + ": dtype " + dtype_name(x.dtype) +
         " cannot be quantized (expected float32 or bfloat16)");
  if (x.rows <= 0 || x.cols <= 0) fail(name + ": empty tensor");
  if (!cfg.rowwise.enabled && !cfg.columnwise.enabled)
    fail(name + ": no copy requested (enable the row-wise and/or the column-wise copy)");
  const bool mx = cfg.format == QFormat::MXFP4, fp8 = cfg.format == QFormat::FP8;
  const int64_t block = qformat_block(cfg.format);
  const int64_t tile = fp8 ? kFp8Block : kNvfp4Block;
  if (mx && cfg.block_2d)
    fail("--2d: MXFP4 has no 2D (16x16) blocks; 2D applies to NVFP4 (16x16) and FP8 (128x128)");
  if (fp8) {
    for (const CopySpec* s : {&cfg.rowwise, &cfg.columnwise}) {
      if (!s->enabled) continue;
      if (s->rounding == Rounding::SR) fail("--sr: the FP8 recipe rounds to nearest only");
      if (s->rht) fail("--rht: the FP8 recipe has no random Hadamard transform");
      if (s->four_over_six) fail("--four-over-six: applies to NVFP4 only, not FP8");
    }
  }
  if (cfg.block_2d && cfg.columnwise.rht)
    fail(
        "--2d with --rht: 2D tiles are for weights, the RHT for Wgrad activations and gradients; "
        "the combination is not supported");
  if (cfg.rowwise.rht)
    fail(
        "--rht: the random Hadamard transform applies to the column-wise copy only (add "
        "--columnwise)");
  const CopySpec* specs[2] = {&cfg.rowwise, &cfg.columnwise};
  for (int i = 0; i < 2; ++i) {
    const CopySpec& s = *specs[i];
    if (!s.enabled) continue;
    const bool colwise = i == 1;
    const char* which = colwise ? "column-wise" : "row-wise";
    const CopyShape w = written_shape(x, colwise);
    if (w.cols % block != 0) {
      std::ostringstream m;
      m << name << ": the " << which << " copy blocks along "
        << (colwise ? "the rows (dimension 0)" : "the columns (dimension 1)") << ", whose length "
        << w.cols << " is not a multiple of " << block << " (" << qformat_name(cfg.format)
        << " block size); pad the tensor yourself, fp4sim never pads silently";
      fail(m.str());
    }
    if (cfg.block_2d && w.rows % tile != 0) {
      std::ostringstream m;
      m << name << ": --2d needs both dimensions to be multiples of " << tile << " (" << tile << "x"
        << tile << " tiles); the " << which << " copy has " << w.rows << " rows";
      fail(m.str());
    }
    if (s.four_over_six) {
      if (mx) fail("--four-over-six: applies to NVFP4 only, not MXFP4");
      if (s.rounding == Rounding::SR)
        fail(
            "--four-over-six: cannot be combined with stochastic rounding (--sr); it applies to "
            "copies rounded to nearest only");
      if (s.rht) fail("--four-over-six: cannot be combined with --rht");
    }
  }
}

int64_t tiled_scale_bytes(int64_t rows, int64_t k_blocks) {
  return round_up(rows, kTiledRows) * round_up(k_blocks, kTiledCols);
}

void scales_to_tiled(const uint8_t* scales, int64_t rows, int64_t k_blocks, uint8_t* out) {
  const int64_t total = tiled_scale_bytes(rows, k_blocks);
  for (int64_t i = 0; i < total; ++i) out[i] = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < k_blocks; ++c)
      out[tiled_scale_offset(r, c, k_blocks)] = scales[r * k_blocks + c];
}

void validate_quant_error_sums(const float* x, const QuantizedView& q) {
  const std::string what = std::string("quantization statistics of a ") + qformat_name(q.format) +
                           " copy " + shape_str(q.rows, q.cols);
  if (q.rows < 0 || q.cols <= 0 || q.cols % q.block() != 0)
    throw std::invalid_argument(what + ": cols must be a positive multiple of " +
                                std::to_string(q.block()));
  if (!x || !q.codes || !q.scales || !q.amax)
    throw std::invalid_argument(what + ": a buffer is null");
}

QuantErrorSums quant_error_sums(const float* x, const QuantizedView& q) {
  validate_quant_error_sums(x, q);
  const int64_t blocks = q.cols / q.block();
  const float amax = *q.amax;
  std::vector<QuantErrorSums> rows(static_cast<size_t>(q.rows));
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < q.rows; ++r)
    for (int64_t b = 0; b < blocks; ++b)
      add_error_sums(
          rows[static_cast<size_t>(r)],
          quant_block_error(x, q.codes, q.scales, r, b, q.cols, q.format, q.four_over_six, amax));
  return add_rows_in_order(rows.data(), q.rows);
}

}  // namespace fp4sim
