// Exact FP4 GEMM benchmarks (Google Benchmark): TFLOP/s as 2*M*N*K over the time of one GEMM with
// operands already quantized. CPU at 1024^3 (issue 3 bar: >= 2 GFLOP/s on the 2-core machine);
// the GPU exact kernel (one thread per output, no tiling yet) at 2048^3.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "emu/backend.hpp"
#include "tools/backends.hpp"

#if FP4SIM_HAVE_CUDA
#include <cuda_runtime.h>

#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"
#endif

namespace fp4sim {
namespace {

QuantizedHost quantized_gaussian(Backend& be, int64_t rows, int64_t k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(rows * k));
  for (auto& v : x) v = nd(rng);
  TensorView t;
  t.data = x.data();
  t.rows = rows;
  t.cols = k;
  QuantizeConfig c;
  c.rowwise.enabled = true;
  return quantize_to_host(be, t, c).rowwise;
}

void BM_CpuGemmExact(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto be = make_backend("emu");
  QuantizedHost a = quantized_gaussian(*be, n, n, 1), b = quantized_gaussian(*be, n, n, 2);
  std::vector<float> d(static_cast<size_t>(n * n));
  TensorView dv;
  dv.data = d.data();
  dv.rows = n;
  dv.cols = n;
  QuantizedView av = a.view(), bv = b.view();
  for (auto _ : state) {
    be->gemm(av, bv, nullptr, GemmConfig{}, dv);
    benchmark::DoNotOptimize(d.data());
  }
  state.counters["GFLOPs"] = benchmark::Counter(2.0 * n * n * n * state.iterations() / 1e9,
                                                benchmark::Counter::kIsRate);
}
BENCHMARK(BM_CpuGemmExact)->Arg(256)->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(1);

#if FP4SIM_HAVE_CUDA
void BM_GpuGemmExact(benchmark::State& state) {
  if (!gpu::gpu_available()) {
    state.SkipWithError("no CUDA GPU");
    return;
  }
  const int64_t n = state.range(0);
  auto cpu = make_backend("emu");
  gpu::CudaBackend be;
  QuantizedHost a = quantized_gaussian(*cpu, n, n, 1), b = quantized_gaussian(*cpu, n, n, 2);
  auto upload = [&](QuantizedHost& h, std::vector<BackendBuffer>& keep) {
    keep.emplace_back(be, h.codes.size());
    keep.emplace_back(be, h.scales.size());
    keep.emplace_back(be, sizeof(float));
    be.upload(keep[keep.size() - 3].get(), h.codes.data(), h.codes.size());
    be.upload(keep[keep.size() - 2].get(), h.scales.data(), h.scales.size());
    be.upload(keep[keep.size() - 1].get(), &h.amax, sizeof(float));
    QuantizedView v = h.view();
    v.codes = keep[keep.size() - 3].as<uint8_t>();
    v.scales = keep[keep.size() - 2].as<uint8_t>();
    v.amax = keep[keep.size() - 1].as<float>();
    v.device = Device::Cuda;
    return v;
  };
  std::vector<BackendBuffer> keep;
  keep.reserve(6);
  QuantizedView av = upload(a, keep), bv = upload(b, keep);
  BackendBuffer d(be, static_cast<size_t>(n * n) * sizeof(float));
  TensorView dv;
  dv.data = d.get();
  dv.rows = n;
  dv.cols = n;
  dv.device = Device::Cuda;
  be.gemm(av, bv, nullptr, GemmConfig{}, dv);  // warm-up
  be.synchronize();
  cudaEvent_t e0, e1;
  FP4SIM_CUDA_CHECK(cudaEventCreate(&e0));
  FP4SIM_CUDA_CHECK(cudaEventCreate(&e1));
  double ms = 0;
  for (auto _ : state) {
    FP4SIM_CUDA_CHECK(cudaEventRecord(e0, be.stream()));
    be.gemm(av, bv, nullptr, GemmConfig{}, dv);
    FP4SIM_CUDA_CHECK(cudaEventRecord(e1, be.stream()));
    FP4SIM_CUDA_CHECK(cudaEventSynchronize(e1));
    float t = 0;
    FP4SIM_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    ms = t;
    state.SetIterationTime(t * 1e-3);
  }
  state.counters["TFLOPs"] = 2.0 * n * n * n / (ms * 1e-3) / 1e12;
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}
BENCHMARK(BM_GpuGemmExact)->Arg(2048)->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);
#endif

}  // namespace
}  // namespace fp4sim

BENCHMARK_MAIN();
