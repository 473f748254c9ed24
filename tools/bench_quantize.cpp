// Quantizer benchmarks (Google Benchmark).
//
// CPU: the emulator's elements/s (OpenMP) for the common copies.
// GPU: time per call with CUDA events after warm-up on an 8192x8192 BF16 input (256 MiB of data
// per pass, far beyond L2), and the bandwidth achieved counting the bytes actually moved: the
// amax pass reads the input once, the quantize pass reads it again and writes codes + scales of
// each copy. Each repetition also times a device-to-device copy of the same bytes (read + write)
// so the ratio `pct_of_copy_bw` compares against the bandwidth measured in the same run.
// Run with --benchmark_repetitions=5 (the script scripts/gpu_check.sh does) and read the median.
#include <benchmark/benchmark.h>

#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "emu/backend.hpp"
#include "emu/cpu_backend.hpp"
#include "tools/backends.hpp"

#if FP4SIM_HAVE_CUDA
#include <cuda_runtime.h>

#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"
#include "tools/gpu_timer.hpp"
#endif

namespace fp4sim {
namespace {

std::vector<float> gaussian(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

QuantizeConfig config_for(int mode) {
  QuantizeConfig c;
  c.seed = 1;
  c.rowwise.stream = 1;
  c.columnwise.stream = 2;
  switch (mode) {
    case 0:
      c.rowwise.enabled = true;
      break;  // row-wise RN
    case 1:
      c.rowwise.enabled = c.columnwise.enabled = true;
      break;  // both RN
    case 2:   // both, col RHT+SR
      c.rowwise.enabled = c.columnwise.enabled = true;
      c.columnwise.rht = true;
      c.columnwise.rounding = Rounding::SR;
      break;
  }
  return c;
}
const char* mode_name(int mode) {
  return mode == 0 ? "row_rn" : (mode == 1 ? "row+col_rn" : "row_rn+col_rht_sr");
}

// ---- CPU ----------------------------------------------------------------------------------------

void BM_CpuQuantize(benchmark::State& state) {
  const int64_t rows = state.range(0), cols = state.range(1);
  const int mode = static_cast<int>(state.range(2));
  std::vector<float> x = gaussian(static_cast<size_t>(rows * cols), 3);
  emu::CpuBackend be;
  const QuantizeConfig cfg = config_for(mode);
  QuantizedHost row, col;
  row.resize(rows, cols, QFormat::NVFP4, false);
  col.resize(cols, rows, QFormat::NVFP4, false);
  QuantizedView rv = row.view(), cv = col.view();
  TensorView v;
  v.data = x.data();
  v.rows = rows;
  v.cols = cols;
  for (auto _ : state) {
    be.quantize(v, cfg, &rv, cfg.columnwise.enabled ? &cv : nullptr);
    benchmark::DoNotOptimize(row.codes.data());
  }
  state.SetItemsProcessed(state.iterations() * rows * cols);
  state.SetLabel(mode_name(mode));
}
BENCHMARK(BM_CpuQuantize)
    ->Args({1024, 4096, 0})
    ->Args({1024, 4096, 1})
    ->Args({1024, 4096, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// ---- GPU ----------------------------------------------------------------------------------------
#if FP4SIM_HAVE_CUDA

// A GPU quantize benchmark's device buffers: the input (uploaded from the host) and a copy target
// of the same size, and the row-wise (rows x cols) and column-wise (cols x rows) copies' codes,
// scales and amax, sized for `format`.
struct GpuQuantizeBuffers {
  size_t in_bytes;
  BackendBuffer in, copy_dst, rc, rs, ra, cc, cs, ca;
  QuantizedView rv, cv;
  TensorView v;
  GpuQuantizeBuffers(Backend& be, const void* host, int64_t rows, int64_t cols, DType dtype,
                     QFormat format)
      : in_bytes(static_cast<size_t>(rows * cols) * (dtype == DType::F32 ? 4 : 2)),
        in(be, in_bytes),
        copy_dst(be, in_bytes),
        rc(be, code_bytes(rows, cols, format)),
        rs(be, scale_bytes(rows, cols, format)),
        ra(be, 4),
        cc(be, code_bytes(rows, cols, format)),
        cs(be, scale_bytes(rows, cols, format)),
        ca(be, 4) {
    be.upload(in.get(), host, in_bytes);
    for (auto [q, c, sc, am, r, k] :
         {std::tuple{&rv, &rc, &rs, &ra, rows, cols}, std::tuple{&cv, &cc, &cs, &ca, cols, rows}}) {
      q->format = format;
      q->codes = c->as<uint8_t>();
      q->scales = sc->as<uint8_t>();
      q->amax = am->as<float>();
      q->rows = r;
      q->cols = k;
      q->device = Device::Cuda;
    }
    v.data = in.get();
    v.dtype = dtype;
    v.rows = rows;
    v.cols = cols;
    v.device = Device::Cuda;
  }
  static size_t code_bytes(int64_t rows, int64_t cols, QFormat f) {
    return static_cast<size_t>(rows * cols) / (f == QFormat::FP8 ? 1 : 2);
  }
  static size_t scale_bytes(int64_t rows, int64_t cols, QFormat f) {
    return f == QFormat::FP8 ? static_cast<size_t>(rows * cols) / kFp8Block * 4
                             : static_cast<size_t>(rows * cols) / 16;
  }
};

// Times `quantize` (10 calls, after 3 warm-ups) and a device-to-device copy of the input in each
// repetition; counters: ms, GB/s for `bytes` moved, the copy's GB/s (read + write) and the ratio.
template <class F>
void time_against_copy(benchmark::State& state, gpu::CudaBackend& be, const GpuQuantizeBuffers& b,
                       double bytes, F&& quantize) {
  auto copy = [&]() {
    FP4SIM_CUDA_CHECK(cudaMemcpyAsync(b.copy_dst.get(), b.in.get(), b.in_bytes,
                                      cudaMemcpyDeviceToDevice, be.stream()));
  };
  GpuTimer timer;
  for (int i = 0; i < 3; ++i) {
    quantize();
    copy();
  }  // warm-up
  be.synchronize();
  double last_ms = 0, copy_bw = 0;
  for (auto _ : state) {
    const double copy_ms = timer.ms(be.stream(), 10, copy);
    copy_bw = 2.0 * static_cast<double>(b.in_bytes) / (copy_ms * 1e-3);  // read + write
    last_ms = timer.ms(be.stream(), 10, quantize);
    state.SetIterationTime(last_ms * 1e-3);
  }
  state.counters["ms"] = last_ms;
  state.counters["GBps"] = bytes / (last_ms * 1e-3) / 1e9;
  state.counters["copy_GBps"] = copy_bw / 1e9;
  state.counters["pct_of_copy_bw"] = 100.0 * (bytes / (last_ms * 1e-3)) / copy_bw;
}

void BM_GpuQuantize(benchmark::State& state) {
  if (!gpu::gpu_available()) {
    state.SkipWithError("no CUDA GPU");
    return;
  }
  const int64_t rows = state.range(0), cols = state.range(1);
  const int mode = static_cast<int>(state.range(2));
  gpu::CudaOptions opt;
  opt.quantize_keep_rht = state.range(3) != 0;
  opt.quantize_early_launch = state.range(4) != 0;
  gpu::CudaBackend be(opt);
  const QuantizeConfig cfg = config_for(mode);
  const size_t n = static_cast<size_t>(rows * cols);
  std::vector<float> xf = gaussian(n, 5);
  std::vector<uint16_t> xh(n);
  for (size_t i = 0; i < n; ++i) xh[i] = bf16_rne(xf[i]);
  GpuQuantizeBuffers b(be, xh.data(), rows, cols, DType::BF16, QFormat::NVFP4);
  const int copies = cfg.columnwise.enabled ? 2 : 1;
  // bytes moved: amax pass reads input; quantize pass reads input, writes codes + scales per copy
  // (not counted: with RHT the transformed input kept between the passes, written and read once)
  const double bytes = 2.0 * n * 2 + copies * (n / 2.0 + n / 16.0);
  time_against_copy(state, be, b, bytes, [&]() {
    be.quantize(b.v, cfg, &b.rv, cfg.columnwise.enabled ? &b.cv : nullptr);
  });
  state.SetLabel(
      std::string(mode_name(mode)) +
      (mode == 2 ? (state.range(3) != 0 ? " rht-kept" : " rht-twice (default for BF16)") : "") +
      (state.range(4) == 0 ? " serial" : ""));
}
// {rows, cols, mode, keep the RHT output between the passes (CudaOptions::quantize_keep_rht),
// the quantize pass launched early (1, the default) or after the amax pass (0). The contiguous
// amax pass on 8 or 4 CTAs an SM instead of 16, room for the early pass's first tiles, measured
// the same: 117.6 / 119 against 117.9 us for row + column RN (docs/performance.md)}
BENCHMARK(BM_GpuQuantize)
    ->Args({8192, 8192, 0, 1, 1})
    ->Args({8192, 8192, 1, 1, 1})
    ->Args({8192, 8192, 1, 1, 0})
    ->Args({8192, 8192, 2, 1, 1})
    ->Args({8192, 8192, 2, 0, 1})
    ->UseManualTime()
    ->Iterations(5)
    ->Unit(benchmark::kMicrosecond);

// The training step's NVFP4 quantize of an FP32 activation or gradient (16384 tokens x cols):
// row-wise RN + column-wise RHT + SR, the transform kept between the passes, timed against a copy.
// Bytes as BM_GpuQuantize counts them, plus the kept transform (BF16, written once and read once).
void time_rht_train_quantize(benchmark::State& state, int64_t cols,
                             const gpu::CudaOptions& opt = {}) {
  const int64_t rows = 16384;
  gpu::CudaBackend be(opt);
  const QuantizeConfig cfg = config_for(2);
  const size_t n = static_cast<size_t>(rows * cols);
  const std::vector<float> xf = gaussian(n, 8);
  GpuQuantizeBuffers b(be, xf.data(), rows, cols, DType::F32, QFormat::NVFP4);
  const double bytes = 2.0 * n * 4 + 2 * (n / 2.0 + n / 16.0) + 2.0 * n * 2;
  time_against_copy(state, be, b, bytes, [&]() { be.quantize(b.v, cfg, &b.rv, &b.cv); });
}
// The same training-step quantize with the RHT transform kept between the passes (1) or computed
// again in the tile kernel (0, CudaOptions::quantize_keep_rht); compare the times (ms): the byte
// count, and so pct_of_copy_bw, includes the kept transform either way.
void BM_GpuQuantizeTrainKeep(benchmark::State& state) {
  if (!gpu::gpu_available()) {
    state.SkipWithError("no CUDA GPU");
    return;
  }
  gpu::CudaOptions opt;
  opt.quantize_keep_rht = state.range(1) != 0;
  time_rht_train_quantize(state, state.range(0), opt);
  state.SetLabel(state.range(1) != 0 ? "kept" : "rht-twice");
}
// {cols, keep the transform}
BENCHMARK(BM_GpuQuantizeTrainKeep)
    ->ArgsProduct({{768, 3072}, {1, 0}})
    ->UseManualTime()
    ->Iterations(5)
    ->Repetitions(3)
    ->ReportAggregatesOnly(true)
    ->Unit(benchmark::kMicrosecond);

// The same training-step quantize (FP32 16384 x cols, row RN + column RHT + SR, the pipelined amax
// pass) with the streaming kernel's grid capped at `ctas` CTAs per SM and copy (0: one 1x16 block a
// thread), CudaOptions::quantize_kept_ctas_per_sm.
void BM_GpuQuantizeKeptGrid(benchmark::State& state) {
  if (!gpu::gpu_available()) {
    state.SkipWithError("no CUDA GPU");
    return;
  }
  gpu::CudaOptions opt;
  opt.quantize_kept_ctas_per_sm = static_cast<int>(state.range(1));
  time_rht_train_quantize(state, state.range(0), opt);
}
// {cols, CTAs per SM and copy}
BENCHMARK(BM_GpuQuantizeKeptGrid)
    ->Args({768, 0})
    ->Args({768, 2})
    ->Args({768, 4})
    ->Args({768, 8})
    ->Args({3072, 0})
    ->Args({3072, 2})
    ->Args({3072, 4})
    ->Args({3072, 8})
    ->UseManualTime()
    ->Iterations(5)
    ->Repetitions(3)
    ->ReportAggregatesOnly(true)
    ->Unit(benchmark::kMicrosecond);

// The FP8 block quantizer (1x128, row-wise + column-wise copies, one tiled pass with the amax)
// on an FP32 input of 16384 x cols (gpt2-124m's activations: 768; its largest activation gradient:
// 3072), against a device copy of the same FP32 input in the same repetition. Bytes: the input read
// once, 1-byte codes + FP32 scales per copy. {cols, staged stores
// (CudaOptions::fp8_quantize_staged)}.
void BM_GpuQuantizeFp8(benchmark::State& state) {
  if (!gpu::gpu_available()) {
    state.SkipWithError("no CUDA GPU");
    return;
  }
  const int64_t rows = 16384, cols = state.range(0);
  gpu::CudaOptions opt;
  opt.fp8_quantize_staged = state.range(1) != 0;
  gpu::CudaBackend be(opt);
  QuantizeConfig cfg;
  cfg.format = QFormat::FP8;
  cfg.rowwise.enabled = cfg.columnwise.enabled = true;
  const size_t n = static_cast<size_t>(rows * cols);
  const std::vector<float> xf = gaussian(n, 6);
  GpuQuantizeBuffers b(be, xf.data(), rows, cols, DType::F32, QFormat::FP8);
  const double bytes = 4.0 * n + 2 * (n + n / 128.0 * 4);
  time_against_copy(state, be, b, bytes, [&]() { be.quantize(b.v, cfg, &b.rv, &b.cv); });
  state.SetLabel(state.range(1) != 0 ? "staged stores" : "direct stores");
}
BENCHMARK(BM_GpuQuantizeFp8)
    ->ArgsProduct({{768, 3072}, {0, 1}})
    ->UseManualTime()
    ->Iterations(5)
    ->Repetitions(3)
    ->ReportAggregatesOnly(true)
    ->Unit(benchmark::kMicrosecond);

// GELU (forward; or backward with its incoming gradient and the bias gradient) into FP8 row- and
// column-wise copies of a 16384x3072 activation (gpt2-124m's MLP, batch 16 x 1024), through
// CudaBackend::quantize_activation: {op 0 forward / 1 backward, 1 fused in the tile pass / 0 the
// op kernel then the quantizer, staged stores in the FP8 tile pass
// (CudaOptions::fp8_quantize_staged)}. Bytes: the fused pass's (the op's inputs read once, the
// copies written), for both rows, so pct_of_copy_bw compares their times.
void BM_GpuQuantizeActivationFp8(benchmark::State& state) {
  if (!gpu::gpu_available()) {
    state.SkipWithError("no CUDA GPU");
    return;
  }
  const int64_t rows = 16384, cols = 3072;
  const bool backward = state.range(0) != 0, fused = state.range(1) != 0;
  gpu::CudaOptions opt;
  opt.activation_fusion = fused;
  opt.fp8_quantize_staged = state.range(2) != 0;
  gpu::CudaBackend be(opt);
  QuantizeConfig cfg;
  cfg.format = QFormat::FP8;
  cfg.rowwise.enabled = cfg.columnwise.enabled = true;
  const size_t n = static_cast<size_t>(rows * cols);
  const std::vector<float> pre = gaussian(n, 7), dout = gaussian(n, 8);
  GpuQuantizeBuffers b(be, pre.data(), rows, cols, DType::F32, QFormat::FP8);
  BackendBuffer d(be, n * 4), out(be, n * 4), dbias(be, static_cast<size_t>(cols) * 4);
  be.upload(d.get(), dout.data(), n * 4);
  be.zero(dbias.get(), static_cast<size_t>(cols) * 4);
  ActivationSource src;
  src.op = backward ? ActivationOp::GeluBackward : ActivationOp::GeluForward;
  src.inp = f32_view(be, b.in.as<float>(), rows, cols, "pre");
  if (backward) src.dout = f32_view(be, d.as<float>(), rows, cols, "dout", true);
  src.out = f32_view(be, out.as<float>(), rows, cols, "act", true);
  const double bytes = (backward ? 8.0 : 4.0) * n + 2 * (n + n / 128.0 * 4);
  time_against_copy(state, be, b, bytes, [&]() {
    be.quantize_activation(
        src, cfg, &b.rv, &b.cv,
        backward ? f32_view(be, dbias.as<float>(), cols, 1, "dbias") : TensorView{});
  });
  state.SetLabel(std::string(backward ? "gelu backward + dbias" : "gelu forward") +
                 (fused ? " fused" : " op then quantize") +
                 (state.range(2) != 0 ? ", staged stores" : ", direct stores"));
}
BENCHMARK(BM_GpuQuantizeActivationFp8)
    ->Args({0, 1, 0})
    ->Args({0, 1, 1})
    ->Args({0, 0, 1})
    ->Args({1, 1, 0})
    ->Args({1, 1, 1})
    ->Args({1, 0, 1})
    ->UseManualTime()
    ->Iterations(5)
    ->Repetitions(3)
    ->ReportAggregatesOnly(true)
    ->Unit(benchmark::kMicrosecond);

#endif

}  // namespace
}  // namespace fp4sim

BENCHMARK_MAIN();
