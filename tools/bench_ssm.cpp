// The Mamba-2 mixer's high-precision ops on the emulator (emu/ssm.hpp), Google Benchmark: each op's
// forward and backward pass, and the whole core (conv -> dt -> scan -> gated norm, then the
// backward passes in reverse), at the nemotron-h-tiny training shape: B 8, T 128, d_inner 512,
// head dim 64 (8 heads), state 64, conv width 4, the argument G groups, states saved every 128
// steps. Run with --benchmark_repetitions=3 --benchmark_report_aggregates_only=true and read the
// median; tokens/s counts B*T tokens an iteration.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "emu/ssm.hpp"

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

}  // namespace
}  // namespace fp4sim::emu

BENCHMARK_MAIN();
