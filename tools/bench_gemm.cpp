// GEMM benchmarks (Google Benchmark): TFLOP/s as 2*M*N*K over the time of one GEMM with operands
// already quantized. CPU at 1024^3 (issue 3 bar: >= 2 GFLOP/s on the 2-core machine); the GPU exact
// kernels and the cuBLASLt path at 8192^3; attention's batched BF16 GEMMs for one gpt2-124m layer.
#include <benchmark/benchmark.h>

#include <functional>
#include <random>
#include <string>
#include <vector>

#include "emu/backend.hpp"
#include "emu/matmul.hpp"
#include "tools/backends.hpp"

#if FP4SIM_HAVE_CUDA
#include <cuda_runtime.h>

#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"
#include "tools/gpu_timer.hpp"
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
  state.counters["GFLOPs"] =
      benchmark::Counter(2.0 * n * n * n * state.iterations() / 1e9, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_CpuGemmExact)
    ->Arg(256)
    ->Arg(1024)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Iterations(1);

// The emulator's BF16 GEMM (chained T-FDPA per output, emu::bf16_gemm_tn, the training stack's
// linear layers), on a tiny-preset shape: 1024 tokens x 512 outputs x K 128, Gaussian operands.
void BM_CpuBf16Gemm(benchmark::State& state) {
  const int64_t M = state.range(0), N = state.range(1), K = state.range(2);
  std::mt19937_64 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> a(static_cast<size_t>(M * K)), b(static_cast<size_t>(N * K)),
      d(static_cast<size_t>(M * N));
  for (auto& v : a) v = nd(rng);
  for (auto& v : b) v = nd(rng);
  for (auto _ : state) {
    emu::bf16_gemm_tn(d.data(), a.data(), b.data(), M, N, K);
    benchmark::DoNotOptimize(d.data());
  }
  state.counters["GFLOPs"] =
      benchmark::Counter(2.0 * M * N * K * state.iterations() / 1e9, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_CpuBf16Gemm)
    ->Args({1024, 512, 128})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(1.0);

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
  QuantizedBuffers da = QuantizedBuffers::uploaded(be, a), db = QuantizedBuffers::uploaded(be, b);
  QuantizedView av = da.view, bv = db.view;
  BackendBuffer d(be, static_cast<size_t>(n * n) * sizeof(float));
  TensorView dv;
  dv.data = d.get();
  dv.rows = n;
  dv.cols = n;
  dv.device = Device::Cuda;
  be.gemm(av, bv, nullptr, GemmConfig{}, dv);  // warm-up
  be.synchronize();
  GpuTimer timer;
  double ms = 0;
  for (auto _ : state) {
    ms = timer.ms(be.stream(), 1, [&] { be.gemm(av, bv, nullptr, GemmConfig{}, dv); });
    state.SetIterationTime(ms * 1e-3);
  }
  state.counters["TFLOPs"] = 2.0 * n * n * n / (ms * 1e-3) / 1e12;
}
BENCHMARK(BM_GpuGemmExact)
    ->Arg(2048)
    ->Arg(8192)
    ->UseManualTime()
    ->Iterations(3)
    ->Repetitions(3)
    ->ReportAggregatesOnly(true)
    ->Unit(benchmark::kMillisecond);

// A rows x cols BF16 tensor of seeded Gaussian values on the device and its NVFP4 row-wise copy
// (1x16, RN), quantized on the GPU: the operands of the FP4 GEMM benchmarks.
struct DeviceNvfp4 {
  BackendBuffer in, codes, scales, amax;
  QuantizedView q;
  DeviceNvfp4(Backend& be, int64_t rows, int64_t cols, std::mt19937_64& rng) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<uint16_t> x(static_cast<size_t>(rows * cols));
    for (auto& v : x) v = bf16_rne(nd(rng));
    in = BackendBuffer(be, x.size() * 2);
    be.upload(in.get(), x.data(), x.size() * 2);
    codes = BackendBuffer(be, x.size() / 2);
    scales = BackendBuffer(be, x.size() / 16);
    amax = BackendBuffer(be, 4);
    TensorView tv;
    tv.data = in.get();
    tv.dtype = DType::BF16;
    tv.rows = rows;
    tv.cols = cols;
    tv.device = Device::Cuda;
    QuantizeConfig qc;
    qc.rowwise.enabled = true;
    q.codes = codes.as<uint8_t>();
    q.scales = scales.as<uint8_t>();
    q.amax = amax.as<float>();
    q.rows = rows;
    q.cols = cols;
    q.device = Device::Cuda;
    be.quantize(tv, qc, &q, nullptr);
  }
};

// An FP32 rows x cols GEMM output on the device and its view.
struct DeviceF32Out {
  BackendBuffer d;
  TensorView v;
  DeviceF32Out(Backend& be, int64_t rows, int64_t cols)
      : d(be, static_cast<size_t>(rows * cols) * 4) {
    v.data = d.get();
    v.rows = rows;
    v.cols = cols;
    v.device = Device::Cuda;
  }
};

// The cuBLASLt NVFP4 path on Hopper (dequantize both operands to BF16 + cuBLASLt BF16 GEMM,
// operands already quantized) against cuBLASLt's BF16 GEMM on the same shape, timed in the same
// repetition.
void BM_GpuGemmCublasLt(benchmark::State& state) {
  if (!gpu::gpu_available()) {
    state.SkipWithError("no CUDA GPU");
    return;
  }
  const int64_t n = state.range(0);
  gpu::CudaBackend be;
  std::mt19937_64 rng(7);
  const DeviceNvfp4 op(be, n, n, rng);  // quantized on the GPU (fast)
  const BackendBuffer& in = op.in;
  const QuantizedView& q = op.q;
  const size_t elements = static_cast<size_t>(n * n);
  const DeviceF32Out out(be, n, n);
  const TensorView& dv = out.v;
  GemmConfig cfg;
  cfg.impl = GemmImpl::CublasLt;
  auto st = gpu::make_cublaslt_state();
  // the FP4 path multiplies two distinct BF16 buffers (its two dequantized operands), so the
  // baseline does too: A = in, B = a copy of it (one shared buffer would favour it through L2)
  BackendBuffer in_b(be, elements * 2);
  be.copy(in_b.get(), in.get(), elements * 2);
  auto fp4_path = [&]() { be.gemm(q, q, nullptr, cfg, dv); };
  auto bf16 = [&]() {
    gpu::bf16_gemm_tn(*st, static_cast<const uint16_t*>(in.get()),
                      static_cast<const uint16_t*>(in_b.get()), nullptr, out.d.as<float>(), n, n, n,
                      1.0f, 0.0f, be.stream());
  };
  GpuTimer timer;
  timer.ms(be.stream(), 2, fp4_path);
  timer.ms(be.stream(), 2, bf16);
  double fp4_ms = 0, bf16_ms = 0;
  for (auto _ : state) {
    bf16_ms = timer.ms(be.stream(), 5, bf16);
    fp4_ms = timer.ms(be.stream(), 5, fp4_path);
    state.SetIterationTime(fp4_ms * 1e-3);
  }
  const double flop = 2.0 * n * n * n;
  state.counters["fp4_path_TFLOPs"] = flop / (fp4_ms * 1e-3) / 1e12;
  state.counters["bf16_TFLOPs"] = flop / (bf16_ms * 1e-3) / 1e12;
  state.counters["ratio_pct"] = 100.0 * bf16_ms / fp4_ms;
}
BENCHMARK(BM_GpuGemmCublasLt)
    ->Arg(8192)
    ->UseManualTime()
    ->Iterations(3)
    ->Repetitions(3)
    ->ReportAggregatesOnly(true)
    ->Unit(benchmark::kMillisecond);

// How cuBLASLt is handed alpha and beta, on the gpt2-124m GEMM shapes of one layer (batch 16 x
// 1024 tokens) as the FP4 path on Hopper runs them: BF16 operands, TN, FP32 output, beta 0 for
// Fprop and 1 for Dgrad/Wgrad (the backward pass's +=). range(0): shape index into kGpt2Shapes;
// range(1): gpu::Bf16Scalars (0 host scalars, 1 device scalars).
// The FP4 path cannot use host scalars (alpha' comes from the device's amax); mode 0 is the BF16
// recipe's own setting, the baseline.
struct Gpt2Shape {
  const char* name;
  int64_t M, N, K;
  float beta;
};
constexpr Gpt2Shape kGpt2Shapes[] = {
    {"fprop_qkv", 16384, 2304, 768, 0.0f}, {"fprop_proj", 16384, 768, 768, 0.0f},
    {"fprop_fc", 16384, 3072, 768, 0.0f},  {"fprop_fc2", 16384, 768, 3072, 0.0f},
    {"dgrad_qkv", 16384, 768, 2304, 1.0f}, {"dgrad_proj", 16384, 768, 768, 1.0f},
    {"dgrad_fc", 16384, 768, 3072, 1.0f},  {"dgrad_fc2", 16384, 3072, 768, 1.0f},
    {"wgrad_qkv", 2304, 768, 16384, 1.0f}, {"wgrad_proj", 768, 768, 16384, 1.0f},
    {"wgrad_fc", 3072, 768, 16384, 1.0f},  {"wgrad_fc2", 768, 3072, 16384, 1.0f},
};

// Times one shape's GEMM (run): 3 warm-up calls, then 20 per iteration; counters us and TFLOPs. A
// GEMM that cannot be planned (an exception from the warm-up) skips the benchmark with its message.
void time_shape(benchmark::State& state, const Gpt2Shape& s, cudaStream_t stream,
                const std::function<void()>& run) {
  GpuTimer timer;
  try {
    timer.ms(stream, 3, run);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  double ms = 0;
  for (auto _ : state) {
    ms = timer.ms(stream, 20, run);
    state.SetIterationTime(ms * 1e-3);
  }
  state.counters["us"] = ms * 1e3;
  state.counters["TFLOPs"] = 2.0 * s.M * s.N * s.K / (ms * 1e-3) / 1e12;
}

// The registration both per-shape GEMM benchmarks share. Arguments (shape, mode, heuristic index):
// every shape in both modes with the plan's own algorithm (index -1: gpu/gemm_cublaslt.cu
// fp8_preferred_algo and bf16_preferred_algo, else the heuristic's first), then every shape in
// both modes at each index 0..7 of the heuristic's list (filter '<name>/[0-9]+/<mode>/[0-7]'; a
// shape whose list is shorter reports an error instead of a time). Manual time, 3 iterations of 20
// calls, 3 repetitions, aggregates only, microseconds.
void shape_benchmark_registration(benchmark::internal::Benchmark* b) {
  b->ArgsProduct({benchmark::CreateDenseRange(0, 11, 1), {0, 1}, {gpu::kPlanOwnPick}})
      ->ArgsProduct(
          {benchmark::CreateDenseRange(0, 11, 1), {0, 1}, benchmark::CreateDenseRange(0, 7, 1)})
      ->UseManualTime()
      ->Iterations(3)
      ->Repetitions(3)
      ->ReportAggregatesOnly(true)
      ->Unit(benchmark::kMicrosecond);
}

void BM_GpuGemmScalarModes(benchmark::State& state) {
  if (!gpu::gpu_available()) {
    state.SkipWithError("no CUDA GPU");
    return;
  }
  const Gpt2Shape& s = kGpt2Shapes[state.range(0)];
  const auto mode = static_cast<gpu::Bf16Scalars>(state.range(1));
  const int pick = static_cast<int>(state.range(2));
  state.SetLabel(std::string(s.name) + " algo " + std::to_string(pick));
  gpu::CudaBackend be;
  std::mt19937_64 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> ha(static_cast<size_t>(s.M * s.K)), hb(static_cast<size_t>(s.N * s.K));
  for (auto& v : ha) v = bf16_rne(nd(rng));
  for (auto& v : hb) v = bf16_rne(nd(rng));
  BackendBuffer a(be, ha.size() * 2), b(be, hb.size() * 2),
      d(be, static_cast<size_t>(s.M * s.N) * 4);
  be.upload(a.get(), ha.data(), ha.size() * 2);
  be.upload(b.get(), hb.data(), hb.size() * 2);
  be.zero(d.get(), static_cast<size_t>(s.M * s.N) * 4);
  std::vector<float> hs(static_cast<size_t>(s.N), 0.5f);
  hs.push_back(s.beta);  // (alpha per column, then beta)
  BackendBuffer scal(be, hs.size() * 4);
  be.upload(scal.get(), hs.data(), hs.size() * 4);
  const float h_alpha = 0.5f, h_beta = s.beta;
  const float* dev = scal.as<float>();
  const float* alpha = mode == gpu::Bf16Scalars::Host ? &h_alpha : dev;
  const float* beta = mode == gpu::Bf16Scalars::Device ? dev + s.N : &h_beta;
  auto st = gpu::make_cublaslt_state(pick);
  auto run = [&]() {
    gpu::bf16_gemm_tn_scalars(*st, mode, static_cast<const uint16_t*>(a.get()),
                              static_cast<const uint16_t*>(b.get()),
                              s.beta != 0.0f ? d.as<float>() : nullptr, d.as<float>(), s.M, s.N,
                              s.K, alpha, beta, be.stream());
  };
  time_shape(state, s, be.stream(), run);
}
BENCHMARK(BM_GpuGemmScalarModes)->Apply(shape_benchmark_registration);

// The same twelve shapes as the BF16 recipe runs them: CudaBackend::matmul_forward (Fprop shapes)
// and matmul_backward with only dinp (Dgrad, written) or only dweight (Wgrad, accumulated), FP32
// arrays in and out, BF16 GEMMs through the matmuls' own cuBLASLt plans (gpu/matmul.cu lt_matmul,
// NN/NT layouts, host alpha/beta), at heuristic index range(1) (CudaOptions::matmul_heuristic_pick;
// -1 the plan's own choice, gpu/matmul.cu matmul_preferred_algo, which training uses).
// The time includes the matmul's FP32 -> BF16 operand copies, the same at every index. The survey
// the FP4 and FP8 plans' rules came from, for the BF16 recipe: whether its GEMMs have faster
// algorithms too (which would move every recipe's ratio to BF16).
void BM_GpuMatmulPicks(benchmark::State& state) {
  if (!gpu::gpu_available()) {
    state.SkipWithError("no CUDA GPU");
    return;
  }
  const int si = static_cast<int>(state.range(0));
  const Gpt2Shape& s = kGpt2Shapes[si];
  const int pick = static_cast<int>(state.range(1));
  state.SetLabel(std::string(s.name) + " algo " + std::to_string(pick));
  gpu::CudaOptions opt;
  opt.matmul_heuristic_pick = pick;
  gpu::CudaBackend be(opt);
  // the op's (N tokens, K in, OC out) for each kind of shape (kGpt2Shapes lists the GEMM's M x N x
  // K)
  const int64_t N = si < 8 ? s.M : s.K, K = si < 4 ? s.K : s.N,
                OC = si < 4 ? s.N : (si < 8 ? s.K : s.M);
  std::mt19937_64 rng(13);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto filled = [&](int64_t n) {
    std::vector<float> h(static_cast<size_t>(n));
    for (auto& v : h) v = bf16_to_f32(bf16_rne(nd(rng)));
    BackendBuffer b(be, h.size() * 4);
    be.upload(b.get(), h.data(), h.size() * 4);
    return b;
  };
  BackendBuffer x = filled(N * K), w = filled(OC * K), dy = filled(N * OC);
  BackendBuffer y(be, static_cast<size_t>(N * OC) * 4), dx(be, static_cast<size_t>(N * K) * 4),
      dw(be, static_cast<size_t>(OC * K) * 4);
  be.zero(dw.get(), static_cast<size_t>(OC * K) * 4);
  const TensorView xv = f32_view(be, x.as<float>(), N, K, "x"),
                   wv = f32_view(be, w.as<float>(), OC, K, "w"),
                   dyv = f32_view(be, dy.as<float>(), N, OC, "dy"), none;
  auto run = [&]() {
    if (si < 4)
      be.matmul_forward(f32_view(be, y.as<float>(), N, OC, "y"), xv, wv, none, GemmPrecision::BF16);
    else if (si < 8)
      be.matmul_backward(f32_view(be, dx.as<float>(), N, K, "dx"), none, none, dyv, xv, wv,
                         GemmPrecision::BF16);
    else
      be.matmul_backward(none, f32_view(be, dw.as<float>(), OC, K, "dw"), none, dyv, xv, wv,
                         GemmPrecision::BF16);
  };
  time_shape(state, s, be.stream(), run);
}
BENCHMARK(BM_GpuMatmulPicks)
    ->ArgsProduct({benchmark::CreateDenseRange(0, 11, 1), {gpu::kPlanOwnPick}})
    ->ArgsProduct({benchmark::CreateDenseRange(0, 11, 1), benchmark::CreateDenseRange(0, 7, 1)})
    ->UseManualTime()
    ->Iterations(3)
    ->Repetitions(3)
    ->ReportAggregatesOnly(true)
    ->Unit(benchmark::kMicrosecond);

// A rows x k FP8 operand (1x128 blocks, or 128x128 with two_d; with the GEMM-layout scales)
// quantized on be from N(0, 1).
struct Fp8Operand {
  BackendBuffer codes, scales, scales_gemm, amax;
  QuantizedView q;
};
Fp8Operand make_fp8_operand(gpu::CudaBackend& be, std::mt19937_64& rng, int64_t rows, int64_t k,
                            const char* name, bool two_d = false) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> h(static_cast<size_t>(rows * k));
  for (auto& v : h) v = nd(rng);
  BackendBuffer in(be, h.size() * 4);
  be.upload(in.get(), h.data(), h.size() * 4);
  TensorView tv;
  tv.data = in.get();
  tv.rows = rows;
  tv.cols = k;
  tv.device = Device::Cuda;
  tv.name = name;
  const size_t nscales = static_cast<size_t>(rows * (k / kFp8Block));
  Fp8Operand o{BackendBuffer(be, h.size()), BackendBuffer(be, nscales * 4),
               BackendBuffer(be, nscales * 4), BackendBuffer(be, 4), QuantizedView{}};
  o.q.codes = o.codes.as<uint8_t>();
  o.q.scales = o.scales.as<uint8_t>();
  o.q.scales_gemm = o.scales_gemm.as<float>();
  o.q.amax = o.amax.as<float>();
  o.q.rows = rows;
  o.q.cols = k;
  o.q.format = QFormat::FP8;
  o.q.device = Device::Cuda;
  QuantizeConfig qc;
  qc.format = QFormat::FP8;
  qc.rowwise.enabled = true;
  qc.block_2d = two_d;
  be.quantize(tv, qc, &o.q, nullptr);
  be.synchronize();
  return o;
}

// Shape s's FP8 operands (A [M, K], B [N, K]) and a zeroed FP32 D [M, N] on be. As in the fp8
// recipe, B is a 128x128-block copy (the weight) in the Fprop and Dgrad shapes, 1x128 in Wgrad's.
struct Fp8Problem {
  Fp8Operand a, b;
  BackendBuffer d;
  TensorView dv;
};
Fp8Problem make_fp8_problem(gpu::CudaBackend& be, const Gpt2Shape& s) {
  std::mt19937_64 rng(11);
  Fp8Operand a = make_fp8_operand(be, rng, s.M, s.K, s.name);
  Fp8Operand b =
      make_fp8_operand(be, rng, s.N, s.K, s.name, std::string(s.name).rfind("wgrad", 0) != 0);
  Fp8Problem p{std::move(a), std::move(b), BackendBuffer(be, static_cast<size_t>(s.M * s.N) * 4),
               TensorView{}};
  be.zero(p.d.get(), static_cast<size_t>(s.M * s.N) * 4);
  p.dv.data = p.d.get();
  p.dv.rows = s.M;
  p.dv.cols = s.N;
  p.dv.device = Device::Cuda;
  return p;
}

// The same twelve shapes through the FP8 recipe's GEMM (cuBLASLt block-scaled FP8, E4M3 codes,
// FP32 block scales in cuBLASLt's layout as the quantizer writes them, host alpha/beta): how the
// FP8 GEMMs compare with the BF16 ones above (BM_GpuGemmScalarModes mode 0, the BF16 recipe's
// setting), and what beta 1 (the backward pass's +=) costs against beta 0 on the same shape.
// range(0): shape index into kGpt2Shapes; range(1): 0 the shape's beta, 1 beta 0.
void BM_GpuGemmFp8(benchmark::State& state) {
  if (!gpu::gpu_available()) {
    state.SkipWithError("no CUDA GPU");
    return;
  }
  const Gpt2Shape& s = kGpt2Shapes[state.range(0)];
  const float beta = state.range(1) == 0 ? s.beta : 0.0f;
  const int pick = static_cast<int>(state.range(2));
  state.SetLabel(std::string(s.name) + (beta != 0.0f ? " beta 1" : " beta 0") + " algo " +
                 std::to_string(pick));
  gpu::CudaOptions opt;
  opt.cublaslt_heuristic_pick = pick;
  gpu::CudaBackend be(opt);
  Fp8Problem p = make_fp8_problem(be, s);
  GemmConfig cfg;
  cfg.impl = GemmImpl::CublasLt;
  cfg.alpha = 0.5f;
  cfg.beta = beta;
  auto run = [&]() { be.gemm(p.a.q, p.b.q, beta != 0.0f ? &p.dv : nullptr, cfg, p.dv); };
  time_shape(state, s, be.stream(), run);
}
BENCHMARK(BM_GpuGemmFp8)->Apply(shape_benchmark_registration);

// The exact FP8 GEMM (bit for bit the emulator's) against cuBLASLt's block-scaled FP8 GEMM, per
// gpt2-124m shape at the shape's beta, FP32 out. range(0): shape index into kGpt2Shapes; range(1):
// 0 cuBLASLt (the plan's own algorithm), 1 exact on the tensor cores (gpu/fp8_wgmma.cu; the
// benchmark errors where the GPU cannot), 2 exact with the one-thread-an-output model kernel
// (gpu/fp8.cu; registered for fprop_proj only: it is two orders of magnitude slower); range(2):
// split-K of the exact GEMM.
void BM_GpuGemmFp8Exact(benchmark::State& state) {
  if (!gpu::gpu_available()) {
    state.SkipWithError("no CUDA GPU");
    return;
  }
  const Gpt2Shape& s = kGpt2Shapes[state.range(0)];
  const int path = static_cast<int>(state.range(1));
  const int split = static_cast<int>(state.range(2));
  state.SetLabel(std::string(s.name) +
                 (path == 0   ? " cublaslt"
                  : path == 1 ? " wgmma"
                              : " model") +
                 " split " + std::to_string(split));
  gpu::CudaOptions opt;
  opt.fp8_wgmma = path == 1;
  gpu::CudaBackend be(opt);
  Fp8Problem p = make_fp8_problem(be, s);
  if (path == 1 && !gpu::fp8_gemm_wgmma_supported(p.a.q, p.b.q)) {
    state.SkipWithError("this GPU has no wgmma FP8 path (compute capability 9.0 only)");
    return;
  }
  GemmConfig cfg;
  cfg.impl = path == 0 ? GemmImpl::CublasLt : GemmImpl::Exact;
  cfg.alpha = 0.5f;
  cfg.beta = s.beta;
  cfg.split_k = path == 0 ? 1 : split;
  auto run = [&]() { be.gemm(p.a.q, p.b.q, s.beta != 0.0f ? &p.dv : nullptr, cfg, p.dv); };
  time_shape(state, s, be.stream(), run);
}
// {shape, path (0 cuBLASLt, 1 tensor cores, 2 model kernel), split}
BENCHMARK(BM_GpuGemmFp8Exact)
    ->ArgsProduct({benchmark::CreateDenseRange(0, 11, 1), {0, 1}, {1}})
    ->ArgsProduct({{8, 9, 10, 11}, {1}, {2, 4, 8}})
    ->Args({1, 2, 1})
    ->UseManualTime()
    ->Iterations(3)
    ->Repetitions(3)
    ->ReportAggregatesOnly(true)
    ->Unit(benchmark::kMicrosecond);

// Attention's batched BF16 GEMMs on the tensor cores (gpu/attention.cu), one gpt2-124m layer:
// B 16, NH 12, T 1024, HD 64. range(0): 0 forward, 1 backward. TFLOP/s counts the causal half of
// the score matrix: forward 2 GEMMs (QK^T, PV), backward 5 (QK^T, dO V^T, dQ, dK, dV), each
// 2 * B * NH * (T (T + 1) / 2) * HD.
void BM_GpuAttention(benchmark::State& state) {
  if (!gpu::gpu_available()) {
    state.SkipWithError("no CUDA GPU");
    return;
  }
  const bool backward = state.range(0) == 1;
  const int64_t B = 16, T = 1024, NH = 12, NKV = 12, HD = 64, W = (NH + 2 * NKV) * HD, C = NH * HD;
  gpu::CudaBackend be;
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto upload = [&](BackendBuffer& buf, int64_t n) {
    std::vector<float> h(static_cast<size_t>(n));
    for (auto& v : h) v = nd(rng);
    be.upload(buf.get(), h.data(), h.size() * sizeof(float));
  };
  BackendBuffer qkv(be, static_cast<size_t>(B * T * W) * 4),
      dout(be, static_cast<size_t>(B * T * C) * 4);
  BackendBuffer out(be, static_cast<size_t>(B * T * C) * 4),
      lse(be, static_cast<size_t>(B * NH * T) * 4);
  BackendBuffer dqkv(be, static_cast<size_t>(B * T * W) * 4);
  upload(qkv, B * T * W);
  upload(dout, B * T * C);
  const AttentionShape sh{B, T, NH, NKV, HD};
  const TensorView qkv_v = f32_view(be, qkv.as<float>(), B * T, W, "qkv"),
                   out_v = f32_view(be, out.as<float>(), B * T, C, "out"),
                   lse_v = f32_view(be, lse.as<float>(), B * NH, T, "lse"),
                   dout_v = f32_view(be, dout.as<float>(), B * T, C, "dout"),
                   dqkv_v = f32_view(be, dqkv.as<float>(), B * T, W, "dqkv");
  // warm-up, and the saved state for backward
  be.attention_forward(out_v, lse_v, qkv_v, sh, GemmPrecision::BF16);
  be.synchronize();
  auto call = [&] {
    if (backward)
      be.attention_backward(dqkv_v, dout_v, qkv_v, out_v, lse_v, sh, GemmPrecision::BF16);
    else
      be.attention_forward(out_v, lse_v, qkv_v, sh, GemmPrecision::BF16);
  };
  call();
  be.synchronize();
  GpuTimer timer;
  double ms = 0;
  for (auto _ : state) {
    ms = timer.ms(be.stream(), 1, call);
    state.SetIterationTime(ms * 1e-3);
  }
  const double gemm = 2.0 * static_cast<double>(B * NH) * static_cast<double>(T * (T + 1) / 2) * HD;
  state.counters["TFLOPs"] = (backward ? 5 : 2) * gemm / (ms * 1e-3) / 1e12;
  state.counters["ms"] = ms;
}
BENCHMARK(BM_GpuAttention)
    ->Arg(0)
    ->Arg(1)
    ->UseManualTime()
    ->Iterations(10)
    ->Repetitions(3)
    ->ReportAggregatesOnly(true)
    ->Unit(benchmark::kMillisecond);
#endif

}  // namespace
}  // namespace fp4sim

BENCHMARK_MAIN();
