// The Mamba-2 mixer's high-precision ops on the emulator (emu/ssm.hpp), Google Benchmark: each op's
// forward and backward pass, and the whole core (conv -> dt -> scan -> gated norm, then the
// backward passes in reverse), at the nemotron-h-tiny training shape: B 8, T 128, d_inner 512,
// head dim 64 (8 heads), state 64, conv width 4, the argument G groups, states saved every 128
// steps. Run with --benchmark_repetitions=3 --benchmark_report_aggregates_only=true and read the
// median; tokens/s counts B*T tokens an iteration.
//
// With a CUDA GPU (BM_GpuScan): the CUDA backend's ssm_scan_forward + ssm_scan_backward (dt's
// softplus included), the chunked SSD (default) and the sequential bitwise twin
// (CudaOptions::ssm_sequential), at the nemotron-h-small shape B 8, T 1024, H 32, P 64, G 8,
// N 128, Q 128; CUDA events around each call after two warm-up calls, the median of the
// iterations (7), and the bandwidth of the bytes that must move. Without a GPU it reports an
// error and the CPU benchmarks run as before.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "emu/ssm.hpp"

#if FP4SIM_HAVE_CUDA
#include <cuda_runtime.h>

#include "emu/backend.hpp"
#include "gpu/cuda_backend.hpp"
#include "tools/gpu_timer.hpp"
#endif

namespace fp4sim::emu {
namespace {

constexpr int64_t kB = 8, kT = 128, kH = 8, kP = 64, kN = 64, kW = 4, kChunk = 128;

std::vector<float> gaussian(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// One mixer core's inputs, parameters, activations and gradients; the in_proj output zx is
// [z | x | B | C | dt_raw], read and its gradient written in place.
struct Core {
  SsmShape s;
  int64_t di, cx, cin, rows;
  std::vector<float> zx, conv_w, conv_b, dt_bias, A_log, D, norm_w;
  std::vector<float> xbc, dt, A, y, states, rstd, out, dout;
  std::vector<float> dzx, dconv_w, dconv_b, ddt_bias, dA_log, dD, dnorm_w, dy, dxbc, ddt, dA;

  explicit Core(int64_t G) {
    s = SsmShape{kB, kT, kH, kP, G, kN, kChunk};
    di = s.d_inner(), cx = s.xbc_cols(), cin = 2 * di + 2 * G * kN + kH, rows = kB * kT;
    zx = gaussian(static_cast<size_t>(rows * cin), 1);
    conv_w = gaussian(static_cast<size_t>(cx * kW), 2, 0.3f);
    conv_b = gaussian(static_cast<size_t>(cx), 3, 0.3f);
    dt_bias.assign(kH, -3.0f);
    A_log.assign(kH, 1.0f);
    D.assign(kH, 1.0f);
    norm_w.assign(static_cast<size_t>(di), 1.0f);
    xbc.resize(static_cast<size_t>(rows * cx));
    dt.resize(static_cast<size_t>(rows * kH));
    A.resize(kH);
    y.resize(static_cast<size_t>(rows * di));
    states.resize(static_cast<size_t>(s.states_size()));
    rstd.resize(static_cast<size_t>(rows * G));
    out.resize(y.size());
    dout = gaussian(y.size(), 4);
    dzx.resize(zx.size());
    dconv_w.assign(conv_w.size(), 0.0f);
    dconv_b.assign(conv_b.size(), 0.0f);
    ddt_bias.assign(kH, 0.0f);
    dA_log.assign(kH, 0.0f);
    dD.assign(kH, 0.0f);
    dnorm_w.assign(norm_w.size(), 0.0f);
    dy.resize(y.size());
    dxbc.resize(xbc.size());
    ddt.resize(dt.size());
    dA.resize(kH);
  }
  void conv_forward() {
    conv1d_silu_forward(xbc.data(), zx.data() + di, cin, conv_w.data(), conv_b.data(), kB, kT, cx,
                        kW);
  }
  void dt_forward() {
    ssm_dt_forward(dt.data(), A.data(), zx.data() + di + cx, cin, dt_bias.data(), A_log.data(), kB,
                   kT, kH);
  }
  void scan_forward() {
    ssm_scan_forward(y.data(), states.data(), xbc.data(), dt.data(), A.data(), D.data(), s);
  }
  void norm_forward() {
    gated_rmsnorm_forward(out.data(), rstd.data(), y.data(), zx.data(), cin, norm_w.data(), rows,
                          di, s.G);
  }
  void norm_backward() {
    gated_rmsnorm_backward(dy.data(), dzx.data(), cin, dnorm_w.data(), dout.data(), y.data(),
                           zx.data(), cin, norm_w.data(), rstd.data(), rows, di, s.G);
  }
  void scan_backward() {
    ssm_scan_backward(dxbc.data(), ddt.data(), dA.data(), dD.data(), dy.data(), xbc.data(),
                      dt.data(), A.data(), D.data(), states.data(), s);
  }
  void dt_backward() {
    ssm_dt_backward(dzx.data() + di + cx, cin, ddt_bias.data(), dA_log.data(), ddt.data(),
                    dA.data(), zx.data() + di + cx, cin, dt_bias.data(), A_log.data(), kB, kT, kH);
  }
  void conv_backward() {
    conv1d_silu_backward(dzx.data() + di, cin, dconv_w.data(), dconv_b.data(), dxbc.data(),
                         zx.data() + di, cin, conv_w.data(), conv_b.data(), kB, kT, cx, kW);
  }
  void forward() {
    conv_forward();
    dt_forward();
    scan_forward();
    norm_forward();
  }
  void backward() {
    norm_backward();
    scan_backward();
    dt_backward();
    conv_backward();
  }
};

enum Part {
  kForward,
  kBackward,
  kStep,
  kConvFwd,
  kConvBwd,
  kScanFwd,
  kScanBwd,
  kNormFwd,
  kNormBwd
};

void BM_MambaCore(benchmark::State& state, Part part) {
  Core c(state.range(0));
  c.forward();
  c.backward();
  for (auto _ : state) {
    switch (part) {
      case kForward:
        c.forward();
        break;
      case kBackward:
        c.backward();
        break;
      case kStep:
        c.forward();
        c.backward();
        break;
      case kConvFwd:
        c.conv_forward();
        break;
      case kConvBwd:
        c.conv_backward();
        break;
      case kScanFwd:
        c.scan_forward();
        break;
      case kScanBwd:
        c.scan_backward();
        break;
      case kNormFwd:
        c.norm_forward();
        break;
      case kNormBwd:
        c.norm_backward();
        break;
    }
    benchmark::DoNotOptimize(c.out.data());
    benchmark::DoNotOptimize(c.dzx.data());
  }
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(kB * kT),
                                                  benchmark::Counter::kIsIterationInvariantRate);
}

BENCHMARK_CAPTURE(BM_MambaCore, forward_backward, kStep)
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_MambaCore, forward, kForward)
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_MambaCore, backward, kBackward)
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_MambaCore, conv_forward, kConvFwd)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_MambaCore, conv_backward, kConvBwd)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_MambaCore, scan_forward, kScanFwd)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_MambaCore, scan_backward, kScanBwd)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_MambaCore, norm_forward, kNormFwd)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_MambaCore, norm_backward, kNormBwd)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

#if FP4SIM_HAVE_CUDA

// The nemotron-h-small Mamba layer's scan: (B, T, H, P, G, N, chunk)
constexpr SsmShape kGpuShape{8, 1024, 32, 64, 8, 128, 128};

enum GpuPart { kGpuForwardBackward, kGpuForward, kGpuBackward };

// range(0): 0 the chunked SSD, 1 the sequential scan; range(1): a GpuPart.
void BM_GpuScan(benchmark::State& state) {
  if (!gpu::gpu_available()) {
    state.SkipWithError("no CUDA GPU");
    return;
  }
  const bool sequential = state.range(0) != 0;
  const auto part = static_cast<GpuPart>(state.range(1));
  gpu::CudaOptions opt;
  opt.ssm_sequential = sequential;
  gpu::CudaBackend be(opt);
  const SsmShape s = kGpuShape;
  const int64_t R = s.B * s.T, H = s.H, di = s.d_inner(), cx = s.xbc_cols();
  std::vector<std::unique_ptr<BackendBuffer>> bufs;
  auto buffer = [&](const std::vector<float>& h) {
    bufs.push_back(std::make_unique<BackendBuffer>(be, h.size() * sizeof(float)));
    be.upload(bufs.back()->get(), h.data(), h.size() * sizeof(float));
    return bufs.back()->as<float>();
  };
  auto sized = [&](int64_t n) { return buffer(std::vector<float>(static_cast<size_t>(n), 0.0f)); };
  auto view = [&](float* p, int64_t rows, int64_t cols, const char* name) {
    return f32_view(be, p, rows, cols, name);
  };
  std::vector<float> dt_bias(static_cast<size_t>(H)), A_log(static_cast<size_t>(H));
  for (int64_t h = 0; h < H; ++h) {  // dt from 1e-3 to 1e-1 over the heads, A from -1 to -16
    const float dt = 1e-3f * std::pow(100.0f, static_cast<float>(h) / (H - 1));
    dt_bias[static_cast<size_t>(h)] = dt + std::log(-std::expm1(-dt));
    A_log[static_cast<size_t>(h)] = std::log(1.0f + 15.0f * static_cast<float>(h) / (H - 1));
  }
  const TensorView xbc = view(buffer(gaussian(static_cast<size_t>(R * cx), 11)), R, cx, "xbc"),
                   dt_raw = view(buffer(gaussian(static_cast<size_t>(R * H), 12)), R, H, "dt_raw"),
                   vdtb = view(buffer(dt_bias), H, 1, "dt_bias"),
                   vAl = view(buffer(A_log), H, 1, "A_log"),
                   vD = view(buffer(std::vector<float>(static_cast<size_t>(H), 1.0f)), H, 1, "D"),
                   dy = view(buffer(gaussian(static_cast<size_t>(R * di), 13)), R, di, "dy"),
                   dt = view(sized(R * H), R, H, "dt"), A = view(sized(H), H, 1, "A"),
                   y = view(sized(R * di), R, di, "y"),
                   states = view(sized(s.states_size()), s.B * H * s.chunks(), s.P * s.N, "states"),
                   dxbc = view(sized(R * cx), R, cx, "dxbc"),
                   ddt_raw = view(sized(R * H), R, H, "ddt_raw"),
                   ddt_bias = view(sized(H), H, 1, "ddt_bias"),
                   dA_log = view(sized(H), H, 1, "dA_log"), dD = view(sized(H), H, 1, "dD");
  auto forward = [&] { be.ssm_scan_forward(y, states, dt, A, xbc, dt_raw, vdtb, vAl, vD, s); };
  auto backward = [&] {
    be.ssm_scan_backward(dxbc, ddt_raw, ddt_bias, dA_log, dD, dy, xbc, dt, A, dt_raw, vdtb, vAl, vD,
                         states, s);
  };
  auto run = [&] {
    if (part != kGpuBackward) forward();
    if (part != kGpuForward) backward();
  };
  forward();
  backward();
  run();  // warm-up (the scratch buffers allocated)
  be.synchronize();
  GpuTimer timer;
  std::vector<double> ms;
  for (auto _ : state) {
    ms.push_back(timer.ms(be.stream(), 1, run));
    state.SetIterationTime(ms.back() * 1e-3);
  }
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  // The bytes that must move (FP32, the per-head parameters left out): the forward pass reads xbc
  // (R x cx) and dt_raw (R x H), writes dt (R x H), y (R x di) and the states; the backward pass
  // reads dy (R x di), xbc, dt, the states and dt_raw, writes dxbc (R x cx) and ddt_raw (R x H).
  const double fwd = 4.0 * (R * cx + 2 * R * H + R * di + s.states_size());
  const double bwd = 4.0 * (R * di + 2 * R * cx + 3 * R * H + s.states_size());
  const double bytes = (part != kGpuBackward ? fwd : 0) + (part != kGpuForward ? bwd : 0);
  state.counters["median_ms"] = median;
  state.counters["GBps"] = bytes / (median * 1e-3) / 1e9;
  state.counters["tokens/s"] = static_cast<double>(R) / (median * 1e-3);
  const char* parts[] = {"forward+backward", "forward", "backward"};
  state.SetLabel(std::string(sequential ? "sequential" : "chunked") + " " + parts[part]);
}
BENCHMARK(BM_GpuScan)
    ->Args({0, kGpuForwardBackward})
    ->Args({0, kGpuForward})
    ->Args({0, kGpuBackward})
    ->Args({1, kGpuForwardBackward})
    ->Args({1, kGpuForward})
    ->Args({1, kGpuBackward})
    ->UseManualTime()
    ->Iterations(7)
    ->Unit(benchmark::kMillisecond);

#endif

}  // namespace
}  // namespace fp4sim::emu

BENCHMARK_MAIN();
