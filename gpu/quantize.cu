// CUDA quantizers: the same block functions as the emulator (emu/quantize_block.hpp, emu/rht.hpp),
// so every code, scale and amax matches it bit for bit; only the data movement is GPU-specific.
//
// Two passes over the input: (1) amax (NaN ignored) of the input and, with RHT, of the transformed
// column-wise copy; (2) one pass that writes both copies. Where the amax pass kept the transform
// (the training recipe's NVFP4 1x16 RHT copies), a streaming kernel reads x and the kept transform
// without a tile; otherwise a CTA owns a 64-row x 128-column input tile in shared memory (kept in
// the input dtype): each thread quantizes 1x16 (or 1x32) blocks along rows for the row-wise copy
// and the 64-element column strip of one column for the column-wise copy, whose 32 code bytes are
// contiguous in the transposed output. The passes are in gpu/quantize_amax.cuh (1),
// gpu/quantize_nvfp4_1x16.cuh and gpu/quantize_tile.cuh (2), their shared pieces in
// gpu/quantize_common.cuh; this file launches them.
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "emu/quantize_block.hpp"
#include "emu/rht.hpp"
#include "gpu/amax_finish.cuh"
#include "gpu/cp_async.cuh"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/decode_bf16.cuh"
#include "gpu/quantize_amax.cuh"
#include "gpu/quantize_common.cuh"
#include "gpu/quantize_nvfp4_1x16.cuh"
#include "gpu/quantize_tile.cuh"

namespace fp4sim::gpu {
namespace {

// The current device's SM count (asked each time: an attribute query, no static cache shared
// across threads or devices).
int current_device_sms() {
  int dev = 0, sms = 0;
  FP4SIM_CUDA_CHECK(cudaGetDevice(&dev));
  FP4SIM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

// CTAs of amax_rht_pipelined_kernel<T> an SM can hold (by its shared memory and registers), times
// the SMs: the persistent grid.
template <class T>
int amax_rht_pipelined_grid() {
  static int ctas = 0;  // (one device per process, as the backend assumes elsewhere)
  if (ctas == 0) {
    int dev = 0, sms = 0, per_sm = 0;
    FP4SIM_CUDA_CHECK(cudaGetDevice(&dev));
    FP4SIM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    FP4SIM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, amax_rht_pipelined_kernel<T>, kThreads, 0));
    ctas = sms * (per_sm > 0 ? per_sm : 1);
  }
  return ctas;
}

// nvfp4_1x16_kernel's launch: with `early` (CudaOptions::quantize_early_launch), allowed to start
// before the kernel ahead of it in the stream (the amax pass) has finished; the kernel waits for it
// before reading its amax. Only ever launched right after an amax pass of launch_all (every enabled
// copy has one): the kernel reads x before its wait, which is safe only because the kernel ahead of
// it (an ordinary launch) started after x's producer had finished, and does not write x.
template <class T>
void launch_quantize_pass(void (*kernel)(const T*, QuantArgs), dim3 grid, cudaStream_t stream,
                          const T* x, const QuantArgs& qa, bool early) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = early ? 1 : 0;
  FP4SIM_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, x, qa));
}

// col_partial (or null): where the pipelined RHT amax pass can take x's 64-row chunk column sums
// (an FP32 x, rows % 64 == 0), it writes them there; returns whether it did.
template <class T>
bool launch_all(const TensorView& x, const QuantizeConfig& cfg, QuantizedView* row,
                QuantizedView* col, cudaStream_t stream, DeviceScratch* rht_keep, unsigned* amax_ws,
                float* col_partial, const CudaOptions& opt) {
  bool sums_written = false;
  const T* xp = static_cast<const T*>(x.data);
  const int64_t R = x.rows, C = x.cols, S = x.stride();
  const bool vector_ok = (reinterpret_cast<uintptr_t>(xp) % 16 == 0) &&
                         (S * static_cast<int64_t>(sizeof(T))) % 16 == 0;
  const bool row_on = cfg.rowwise.enabled, col_on = cfg.columnwise.enabled;
  const bool col_rht = col_on && cfg.columnwise.rht;
  // the common case (1x16 NVFP4, no Four Over Six) runs nvfp4_1x16_kernel, which can read the RHT
  // output the amax pass keeps; the general kernel transforms again
  const bool common_case = cfg.format != QFormat::MXFP4 && !cfg.block_2d &&
                           !cfg.rowwise.four_over_six && !cfg.columnwise.four_over_six;
  // (if the scratch cannot be had, transform twice as before rather than fail)
  uint16_t* rht_out = nullptr;
  const bool keep =
      opt.quantize_keep_rht == kQuantizeKeepRhtAuto ? sizeof(T) == 4 : opt.quantize_keep_rht != 0;
  if (col_rht && common_case && keep && rht_keep) {
    try {
      rht_out = rht_keep->get<uint16_t>(static_cast<size_t>(R * C), stream);
    } catch (const std::runtime_error&) {
      (void)cudaGetLastError();  // the failed allocation's error, not sticky
      rht_out = nullptr;
    }
  }
  // pass 1: amax (a non-RHT column-wise copy's amax is x's, written by the same pass)
  float* amax_plain = row_on ? row->amax : (col_on && !col_rht ? col->amax : nullptr);
  float* amax_plain2 = row_on && col_on && !col_rht ? col->amax : nullptr;
  float* amax_rht = col_rht ? col->amax : nullptr;
  const dim3 grid(static_cast<unsigned>((C + kTileCols - 1) / kTileCols),
                  static_cast<unsigned>((R + kTileRows - 1) / kTileRows));
  if (amax_rht || (amax_plain && (S != C || !vector_ok))) {
    if (amax_rht) {
      AmaxArgs args{amax_plain, amax_plain2, amax_rht, rht_out, amax_ws};
      // (the pipelined kernel where the shape allows it, else 32-row tiles, else 64-row tiles)
      if (vector_ok && C % kTileCols == 0 && R % kPipeRows == 0 &&
          (C / kTileCols) * (R / kPipeRows) < (int64_t{1} << 31)) {
        const bool sums = col_partial && sizeof(T) == 4 && R % (2 * kPipeRows) == 0;
        if (sums) args.col_partial = col_partial;
        const int64_t tiles = (C / kTileCols) * (R / kPipeRows), items = sums ? tiles / 2 : tiles;
        const int ctas = amax_rht_pipelined_grid<T>();
        amax_rht_pipelined_kernel<T>
            <<<static_cast<unsigned>(items < ctas ? items : ctas), kThreads, 0, stream>>>(xp, R, C,
                                                                                          S, args);
        sums_written = sums;
      } else if ((R + 31) / 32 <= 65535) {
        const dim3 grid32(grid.x, static_cast<unsigned>((R + 31) / 32));
        amax_tile_kernel<T, true, 32>
            <<<grid32, kThreads, 0, stream>>>(xp, R, C, S, vector_ok, args);
      } else {
        amax_tile_kernel<T, true><<<grid, kThreads, 0, stream>>>(xp, R, C, S, vector_ok, args);
      }
    } else {
      amax_tile_kernel<T, false><<<grid, kThreads, 0, stream>>>(
          xp, R, C, S, vector_ok, AmaxArgs{amax_plain, amax_plain2, amax_rht, nullptr, amax_ws});
    }
    FP4SIM_CUDA_CHECK_LAUNCH();
  } else if (amax_plain) {
    const int sms = current_device_sms();
    const int64_t want = (R * C / (16 / sizeof(T)) + kThreads - 1) / kThreads;
    const int blocks = static_cast<int>(want < sms * 16 ? (want > 0 ? want : 1) : sms * 16);
    const AmaxArgs args{amax_plain, amax_plain2, nullptr, nullptr, amax_ws};
    amax_flat_kernel<T, 4><<<blocks, kThreads, 0, stream>>>(xp, R * C, args);
    FP4SIM_CUDA_CHECK_LAUNCH();
  }
  // pass 2: both copies
  QuantArgs qa{};
  qa.rows = R;
  qa.cols = C;
  qa.stride = S;
  qa.vector_ok = vector_ok;
  qa.mx = cfg.format == QFormat::MXFP4;
  qa.block_2d = cfg.block_2d;
  qa.mse = cfg.fos_error == FourOverSixError::MSE;
  qa.mx_rule = cfg.mx_rule;
  qa.keys = philox_round_keys(cfg.seed);
  auto fill = [](CopyArgs& ca, const CopySpec& spec, QuantizedView* q) {
    ca.enabled = spec.enabled;
    ca.sr = spec.rounding == Rounding::SR;
    ca.rht = spec.rht;
    ca.four_over_six = spec.four_over_six;
    ca.stream = spec.stream;
    ca.codes = spec.enabled ? q->codes : nullptr;
    ca.scales = spec.enabled ? q->scales : nullptr;
    ca.amax = spec.enabled ? q->amax : nullptr;
    ca.decoded = spec.enabled ? q->decoded_bf16 : nullptr;
  };
  fill(qa.row, cfg.rowwise, row);
  fill(qa.col, cfg.columnwise, col);
  // (staged column-wise codes: each written row's 32-byte piece of a tile 16-byte aligned, its 4
  // scale bytes one aligned word)
  qa.col_staged = qa.col.enabled && R % kTileRows == 0 &&
                  reinterpret_cast<uintptr_t>(qa.col.codes) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(qa.col.scales) % 4 == 0;
  if (common_case && rht_out) {  // RHT copy kept by the amax pass: the streaming kernel
    // (CTAs for one 1x16 block a thread, up to opt.quantize_kept_ctas_per_sm an SM per copy, so
    // each thread
    // spreads its setup, the global scales and the Philox key, over several blocks)
    int per_copy = grid_stride_blocks(R * (C / kNvfp4Block), 256);
    if (opt.quantize_kept_ctas_per_sm > 0)
      per_copy = std::min(per_copy, current_device_sms() * opt.quantize_kept_ctas_per_sm);
    const unsigned ctas = static_cast<unsigned>(qa.row.enabled ? 2 * per_copy : per_copy);
    if (vector_ok)
      nvfp4_rht_kept_kernel<T, true><<<ctas, 256, 0, stream>>>(xp, rht_out, qa);
    else
      nvfp4_rht_kept_kernel<T, false><<<ctas, 256, 0, stream>>>(xp, rht_out, qa);
  } else if (common_case) {
    const bool early = opt.quantize_early_launch;
    if (qa.col.enabled && qa.col.rht)
      launch_quantize_pass(nvfp4_1x16_kernel<T, true, 1>, grid, stream, xp, qa, early);
    else
      launch_quantize_pass(nvfp4_1x16_kernel<T, false, 1>, grid, stream, xp, qa, early);
  } else if (cfg.format == QFormat::NVFP4 && cfg.block_2d && !qa.row.four_over_six &&
             !qa.col.four_over_six && !(qa.col.enabled && qa.col.rht) && R % kNvfp4Block == 0 &&
             C % kNvfp4Block == 0 && vector_ok) {
    const int64_t blocks = (R / kNvfp4Block) * (C / kNvfp4Block);
    nvfp4_2d_kernel<T><<<static_cast<unsigned>((blocks + k2dBlocksPerCta - 1) / k2dBlocksPerCta),
                         k2dThreads, 0, stream>>>(xp, qa);
  } else if (qa.mx) {
    quantize_tile_kernel<T, true><<<grid, kThreads, 0, stream>>>(xp, qa);
  } else {
    quantize_tile_kernel<T, false><<<grid, kThreads, 0, stream>>>(xp, qa);
  }
  FP4SIM_CUDA_CHECK_LAUNCH();
  return sums_written;
}

void check_view(const QuantizedView* q, int64_t rows, int64_t cols, const QuantizeConfig& cfg,
                const CopySpec& spec, const char* which) {
  if (!q || q->rows != rows || q->cols != cols || q->format != cfg.format ||
      q->four_over_six != spec.four_over_six || q->device != Device::Cuda)
    throw std::invalid_argument(std::string("quantize (cuda): the ") + which +
                                " output must be a device view of the written shape " +
                                shape_str(rows, cols) + " with matching format and options");
}

__global__ void dequantize_kernel(QuantizedView q, float* out, int64_t out_stride) {
  const int64_t n = q.rows * q.cols;
  const int64_t block = q.block();
  const float range = q.four_over_six ? kFourOverSixRange : kNvfp4Range;
  const float amax = *q.amax;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / q.cols, c = e % q.cols;
    const uint8_t s = q.scales[r * (q.cols / block) + c / block];
    const float factor =
        q.format == QFormat::MXFP4 ? ue8m0_to_f32(s) : nvfp4_decode_factor(s, amax, range);
    const uint8_t code = (q.codes[e / 2] >> (4 * (e & 1))) & 0xFu;
    out[r * out_stride + c] = decode_element(code, factor);
  }
}

// Quantization statistics (emu/quant_stats.hpp): one thread per block, then one per row adding
// its blocks in order, so the sums are the emulator's bit for bit.
__global__ void quant_error_blocks_kernel(const float* x, QuantizedView q,
                                          QuantErrorSums* block_sums) {
  const int64_t per_row = q.cols / q.block(), n = q.rows * per_row;
  const float amax = *q.amax;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    block_sums[i] = quant_block_error(x, q.codes, q.scales, i / per_row, i % per_row, q.cols,
                                      q.format, q.four_over_six, amax);
}

__global__ void quant_error_rows_kernel(const QuantErrorSums* block_sums, int64_t rows,
                                        int64_t per_row, QuantErrorSums* rows_out) {
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    QuantErrorSums s;
    for (int64_t b = 0; b < per_row; ++b) add_error_sums(s, block_sums[r * per_row + b]);
    rows_out[r] = s;
  }
}

__global__ void scales_to_tiled_kernel(const uint8_t* scales, int64_t rows, int64_t k_blocks,
                                       uint8_t* out, int64_t padded_rows, int64_t padded_k) {
  const int64_t n = padded_rows * padded_k;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / padded_k, c = i % padded_k;
    out[tiled_scale_offset(r, c, k_blocks)] =
        (r < rows && c < k_blocks) ? scales[r * k_blocks + c] : uint8_t(0);
  }
}

}  // namespace

bool quantize_launch(const TensorView& x, const QuantizeConfig& cfg, QuantizedView* rowwise,
                     QuantizedView* columnwise, cudaStream_t stream, unsigned* amax_ws,
                     DeviceScratch* rht_keep, float* column_partial, const CudaOptions& opt) {
  if (!amax_ws) throw std::logic_error("quantize_launch: no amax workspace");
  if (x.device != Device::Cuda)
    throw std::invalid_argument(std::string("quantize (cuda): tensor '") + x.name +
                                "' is not in device memory");
  if (cfg.rowwise.enabled) check_view(rowwise, x.rows, x.cols, cfg, cfg.rowwise, "row-wise");
  if (cfg.columnwise.enabled)
    check_view(columnwise, x.cols, x.rows, cfg, cfg.columnwise, "column-wise");
  if ((x.rows + kTileRows - 1) / kTileRows >
      65535)  // (the 32-row RHT amax pass falls back to 64 rows)
    throw std::invalid_argument("quantize (cuda): too many rows for one launch: " +
                                shape_str(x.rows, x.cols));
  if (x.dtype == DType::F32)
    return launch_all<float>(x, cfg, rowwise, columnwise, stream, rht_keep, amax_ws, column_partial,
                             opt);
  return launch_all<uint16_t>(x, cfg, rowwise, columnwise, stream, rht_keep, amax_ws,
                              column_partial, opt);
}

void dequantize_launch(const QuantizedView& q, const TensorView& out, cudaStream_t stream) {
  const int64_t n = q.rows * q.cols;
  dequantize_kernel<<<grid_stride_blocks(n, 256), 256, 0, stream>>>(
      q, static_cast<float*>(out.data), out.stride());
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void quant_error_rows_launch(const float* x, const QuantizedView& q, QuantErrorSums* block_sums,
                             QuantErrorSums* rows_out, cudaStream_t stream) {
  if (q.rows == 0) return;
  quant_error_blocks_kernel<<<grid_stride_blocks(q.scale_count(), 256), 256, 0, stream>>>(
      x, q, block_sums);
  FP4SIM_CUDA_CHECK_LAUNCH();
  quant_error_rows_kernel<<<grid_stride_blocks(q.rows, 128), 128, 0, stream>>>(
      block_sums, q.rows, q.cols / q.block(), rows_out);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void scales_to_tiled_launch(const uint8_t* scales, int64_t rows, int64_t k_blocks, uint8_t* out,
                            cudaStream_t stream) {
  const int64_t pr = round_up(rows, kTiledRows), pk = round_up(k_blocks, kTiledCols);
  scales_to_tiled_kernel<<<grid_stride_blocks(pr * pk, 256), 256, 0, stream>>>(
      scales, rows, k_blocks, out, pr, pk);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

}  // namespace fp4sim::gpu
