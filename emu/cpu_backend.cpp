#include "emu/cpu_backend.hpp"

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "emu/fp_env.hpp"
#include "emu/rht.hpp"
#include "emu/workspace.hpp"

namespace fp4sim::emu {

void* CpuBackend::allocate(size_t bytes) {
  void* p = std::malloc(bytes ? bytes : 1);
  if (!p) throw std::bad_alloc();
  return p;
}
void CpuBackend::release(void* p) { std::free(p); }
void CpuBackend::upload(void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); }
void CpuBackend::download(void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); }
void CpuBackend::zero(void* p, size_t n) { std::memset(p, 0, n); }
void CpuBackend::copy(void* dst, const void* src, size_t n) { std::memmove(dst, src, n); }

QuantErrorSums CpuBackend::quant_error_sums(const TensorView& x, const QuantizedView& q) {
  check_view("quant_error_sums", x, q.rows, q.cols, ViewRule{});
  return workspace::named("quant_error_sums", x, workspace::quant_error_sums(q),
                          [&] { return fp4sim::quant_error_sums(x.as<const float>(), q); });
}

void CpuBackend::gemm(const QuantizedView& a, const QuantizedView& b, const TensorView* c,
                      const GemmConfig& cfg, const TensorView& d) {
  validate_gemm(a, b, c, cfg, d);
  workspace::named("gemm", d, workspace::gemm(a, b), [&] {
    if (cfg.impl != GemmImpl::Exact)
      throw std::invalid_argument("gemm: --gemm cublaslt runs on the cuda backend only");
    gemm_exact_host(a, b, c ? static_cast<const float*>(c->data) : nullptr, cfg, d.data);
  });
}

void CpuBackend::scales_to_tiled(const uint8_t* scales, int64_t rows, int64_t k_blocks,
                                 uint8_t* out) {
  fp4sim::scales_to_tiled(scales, rows, k_blocks, out);
}

float amax_of(const float* x, int64_t n) {
  float m = 0.0f;
#pragma omp parallel
  {
    float local = 0.0f;
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < n; ++i) local = fmax_nan_ignored(local, f32_abs(x[i]));
#pragma omp critical
    m = fmax_nan_ignored(m, local);
  }
  return m;
}

void rht_columnwise(const float* x, int64_t rows, int64_t cols, float* out) {
  // out is (cols, rows): row c of out holds column c of x, transformed 16 tokens at a time
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < cols; ++c) {
    uint16_t in[kRhtSize], y[kRhtSize];
    for (int64_t r0 = 0; r0 < rows; r0 += kRhtSize) {
      for (int i = 0; i < kRhtSize; ++i) in[i] = bf16_rne(x[(r0 + i) * cols + c]);
      rht16(in, y);
      for (int i = 0; i < kRhtSize; ++i) out[c * rows + r0 + i] = bf16_to_f32(y[i]);
    }
  }
}

void quantize_written(const float* w, int64_t rows, int64_t cols, float amax,
                      const QuantizeConfig& cfg, const CopySpec& spec, bool written_transposed,
                      QuantizedView& out) {
  const bool sr = spec.rounding == Rounding::SR;
  const int64_t chunks_per_row = cols / kSrChunk;
  *out.amax = amax;
  if (cfg.format == QFormat::FP8) {
    // 1x128 blocks, or 128x128 tiles (one enc per tile, its scale written on each of its rows);
    // the scale is stored as FP32 bytes
    const int64_t blocks_per_row = cols / kFp8Block, tile = cfg.block_2d ? kFp8Block : 1;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < rows / tile; ++t) {
      for (int64_t b = 0; b < blocks_per_row; ++b) {
        float amax_b = 0.0f;
        for (int64_t i = 0; i < tile; ++i)
          for (int64_t k = 0; k < kFp8Block; ++k)
            amax_b =
                fmax_nan_ignored(amax_b, f32_abs(w[(t * tile + i) * cols + b * kFp8Block + k]));
        const float enc = fp8_block_encode_scale(amax_b), scale = fp8_block_decode_scale(enc);
        for (int64_t i = 0; i < tile; ++i) {
          const int64_t r = t * tile + i;
          for (int64_t k = 0; k < kFp8Block; ++k)
            out.codes[r * cols + b * kFp8Block + k] =
                fp8_quantize_element(w[r * cols + b * kFp8Block + k], enc);
          std::memcpy(out.scales + 4 * (r * blocks_per_row + b), &scale, 4);
        }
      }
    }
    (void)written_transposed;  // the tile's amax is the same read either way
    return;
  }
  if (cfg.format == QFormat::MXFP4) {
    const int64_t blocks_per_row = cols / kMxfp4Block;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t b = 0; b < blocks_per_row; ++b) {
        const uint64_t chunk = static_cast<uint64_t>(r * chunks_per_row + 2 * b);
        const SrBits sr0 = sr_bits_for_chunk(sr, cfg.seed, spec.stream, chunk);
        const SrBits sr1 = sr_bits_for_chunk(sr, cfg.seed, spec.stream, chunk + 1);
        out.scales[r * blocks_per_row + b] =
            mxfp4_quantize_1x32(w + r * cols + b * kMxfp4Block, cfg.mx_rule, sr0, sr1,
                                out.codes + (r * cols + b * kMxfp4Block) / 2);
      }
    }
    return;
  }
  const Nvfp4Global g = nvfp4_global(amax, spec.four_over_six);
  const bool mse = cfg.fos_error == FourOverSixError::MSE;
  const int64_t blocks_per_row = cols / kNvfp4Block;
  if (!cfg.block_2d) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t b = 0; b < blocks_per_row; ++b) {
        const SrBits bits = sr_bits_for_chunk(sr, cfg.seed, spec.stream,
                                              static_cast<uint64_t>(r * chunks_per_row + b));
        out.scales[r * blocks_per_row + b] =
            nvfp4_quantize_1x16(w + r * cols + b * kNvfp4Block, g, spec.four_over_six, mse, bits,
                                out.codes + (r * cols + b * kNvfp4Block) / 2);
      }
    }
    return;
  }
  // 2D: one amax and one scale per 16x16 tile, written on each of its 16 rows
  const int64_t tile_rows = rows / kNvfp4Block;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tile_rows; ++t) {
    for (int64_t u = 0; u < blocks_per_row; ++u) {
      const float* tile = w + (t * kNvfp4Block) * cols + u * kNvfp4Block;
      uint8_t packed[kNvfp4Block * 8];
      // element (a, b) of the input tile; the written tile is its transpose for the column-wise
      // copy
      const auto load = [&](int a, int b) {
        return written_transposed ? tile[b * cols + a] : tile[a * cols + b];
      };
      const uint8_t s = nvfp4_tile_scale(load, g, spec.four_over_six, mse);
      const float enc = nvfp4_block_encode_scale(s, g.s_dec);
      for (int i = 0; i < kNvfp4Block; ++i) {
        const int64_t r = t * kNvfp4Block + i;
        const SrBits bits = sr_bits_for_chunk(sr, cfg.seed, spec.stream,
                                              static_cast<uint64_t>(r * chunks_per_row + u));
        e2m1_encode16(tile + i * cols, enc, bits, packed + i * 8);
      }
      for (int i = 0; i < kNvfp4Block; ++i) {
        const int64_t r = t * kNvfp4Block + i;
        out.scales[r * blocks_per_row + u] = s;
        std::memcpy(out.codes + (r * cols + u * kNvfp4Block) / 2, packed + i * 8, 8);
      }
    }
  }
}

namespace {

void check_output(const QuantizedView* q, const CopyShape& w, const QuantizeConfig& cfg,
                  const CopySpec& spec, const char* which) {
  if (!q)
    throw std::invalid_argument(std::string("quantize: the ") + which +
                                " copy is enabled but no output was given");
  if (q->decoded_bf16)
    throw std::invalid_argument(
        std::string("quantize (emu): the ") + which +
        " output asks for a decoded BF16 copy, which only the CUDA backend writes");
  if (q->scales_gemm)
    throw std::invalid_argument(
        std::string("quantize (emu): the ") + which +
        " output asks for GEMM-layout FP8 scales, which only the CUDA backend writes");
  if (q->rows != w.rows || q->cols != w.cols || q->format != cfg.format ||
      q->four_over_six != spec.four_over_six)
    throw std::invalid_argument(std::string("quantize: the ") + which + " output is " +
                                shape_str(q->rows, q->cols) + ", expected the written shape " +
                                shape_str(w.rows, w.cols) + " with matching format and options");
}

// The input as a contiguous row-major FP32 matrix (BF16 widened exactly).
const float* as_f32(const TensorView& x, std::vector<float>& storage) {
  if (x.dtype == DType::F32 && x.stride() == x.cols) return static_cast<const float*>(x.data);
  storage.resize(static_cast<size_t>(x.numel()));
  for (int64_t r = 0; r < x.rows; ++r) {
    for (int64_t c = 0; c < x.cols; ++c) {
      const int64_t i = r * x.stride() + c;
      storage[r * x.cols + c] = x.dtype == DType::F32
                                    ? static_cast<const float*>(x.data)[i]
                                    : bf16_to_f32(static_cast<const uint16_t*>(x.data)[i]);
    }
  }
  return storage.data();
}

}  // namespace

void CpuBackend::quantize(const TensorView& x, const QuantizeConfig& cfg, QuantizedView* rowwise,
                          QuantizedView* columnwise) {
  validate_quantize(x, cfg);
  require_ieee_fp_env();
  workspace::named("quantize", x, workspace::quantize(x, cfg), [&] {
    if (cfg.rowwise.enabled)
      check_output(rowwise, written_shape(x, false), cfg, cfg.rowwise, "row-wise");
    if (cfg.columnwise.enabled)
      check_output(columnwise, written_shape(x, true), cfg, cfg.columnwise, "column-wise");
    std::vector<float> storage;
    const float* xf = as_f32(x, storage);
    const bool need_amax = cfg.rowwise.enabled || !cfg.columnwise.rht;
    const float amax_x = need_amax ? amax_of(xf, x.numel()) : 0.0f;
    if (cfg.rowwise.enabled)
      quantize_written(xf, x.rows, x.cols, amax_x, cfg, cfg.rowwise, false, *rowwise);
    if (cfg.columnwise.enabled) {
      std::vector<float> wt(static_cast<size_t>(x.numel()));
      float amax_c = amax_x;
      if (cfg.columnwise.rht) {
        rht_columnwise(xf, x.rows, x.cols, wt.data());
        amax_c = amax_of(wt.data(), x.numel());
      } else {
#pragma omp parallel for schedule(static)
        for (int64_t c = 0; c < x.cols; ++c)
          for (int64_t r = 0; r < x.rows; ++r) wt[c * x.rows + r] = xf[r * x.cols + c];
      }
      quantize_written(wt.data(), x.cols, x.rows, amax_c, cfg, cfg.columnwise, true, *columnwise);
    }
  });
}

void CpuBackend::dequantize(const QuantizedView& q, const TensorView& out) {
  if (out.dtype != DType::F32 || out.rows != q.rows || out.cols != q.cols)
    throw std::invalid_argument("dequantize: output must be float32 " + shape_str(q.rows, q.cols));
  require_ieee_fp_env();
  const int64_t block = q.block();
  const int64_t blocks_per_row = q.cols / block;
  float* o = static_cast<float*>(out.data);
  const float range = q.four_over_six ? kFourOverSixRange : kNvfp4Range;
  const float amax = *q.amax;
  if (q.format == QFormat::FP8) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < q.rows; ++r)
      for (int64_t b = 0; b < blocks_per_row; ++b) {
        float scale;
        std::memcpy(&scale, q.scales + 4 * (r * blocks_per_row + b), 4);
        for (int64_t i = 0; i < block; ++i)
          o[r * out.stride() + b * block + i] =
              fp8_decode_element(q.codes[r * q.cols + b * block + i], scale);
      }
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < q.rows; ++r) {
    for (int64_t b = 0; b < blocks_per_row; ++b) {
      const uint8_t s = q.scales[r * blocks_per_row + b];
      const float factor =
          q.format == QFormat::MXFP4 ? ue8m0_to_f32(s) : nvfp4_decode_factor(s, amax, range);
      for (int64_t i = 0; i < block; ++i) {
        const int64_t e = r * q.cols + b * block + i;
        const uint8_t code = (q.codes[e / 2] >> (4 * (e & 1))) & 0xFu;
        o[r * out.stride() + b * block + i] = decode_element(code, factor);
      }
    }
  }
}

}  // namespace fp4sim::emu
