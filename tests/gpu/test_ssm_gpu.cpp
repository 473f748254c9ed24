// The CUDA twins of the Mamba-2 core's ops (gpu/ssm.cu) against the emulator, bitwise, with the
// sequential scan (CudaOptions::ssm_sequential): the ops chained as a Mamba block runs them
// (tests/emu/ssm_chain.hpp: strided slices of a wider in_proj buffer, input gradients written over
// NaN, parameter gradients added onto 0.25), forward and backward, every output compared bit for
// bit, with and without the BF16 storage marks, on shapes with T not a multiple of the chunk or of
// anything else, one group and several, N below and above P. The default chunked SSD scan
// (gpu/ssm_chunked.cu) against the emulator's scan within docs/numerics.md's budget, each output's
// error printed. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "emu/backend.hpp"
#include "emu/formats.hpp"
#include "tests/emu/ssm_chain.hpp"
#include "tests/gpu/gpu_test_util.hpp"
#include "tools/backends.hpp"

namespace fp4sim {
namespace {

#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU: " << gpu_description()

struct Shape {
  const char* name;
  SsmShape s;
  int64_t W;
};

// (B, T, H, P, G, N, chunk)
const Shape kShapes[] = {
    {"small, T 19 over chunks of 5", {2, 19, 4, 8, 2, 8, 5}, 4},
    {"G 3, T 37 over chunks of 16, W 3", {1, 37, 6, 16, 3, 32, 16}, 3},
    {"G 1, P 64, T 130 over chunks of 128", {2, 130, 8, 64, 1, 64, 128}, 4},
    {"G 8, N 128 > P 32, T 77 over chunks of 32", {2, 77, 16, 32, 8, 128, 32}, 4},
    {"T 3 < W 5", {2, 3, 2, 8, 1, 16, 4}, 5},
};

void expect_bitwise(const test::SsmChainOutputs& emu, const test::SsmChainOutputs& cuda,
                    const std::string& what) {
  ASSERT_EQ(emu.size(), cuda.size());
  for (size_t k = 0; k < emu.size(); ++k) {
    const std::vector<float>& a = emu[k].second;
    const std::vector<float>& b = cuda[k].second;
    ASSERT_EQ(a.size(), b.size()) << emu[k].first;
    size_t differ = 0, first = 0;
    for (size_t i = 0; i < a.size(); ++i)
      if (f32_bits(a[i]) != f32_bits(b[i]) && differ++ == 0) first = i;
    std::printf("[ssm] %-44s %-15s %8zu values: %s\n", what.c_str(), emu[k].first.c_str(), a.size(),
                differ ? "NOT OK" : "OK (bitwise)");
    EXPECT_EQ(differ, 0u) << what << " " << emu[k].first << ": " << differ
                          << " values differ, the first at " << first << " (emu " << a[first]
                          << ", cuda " << b[first] << ")";
  }
}

// The CUDA backend with the bitwise sequential scan.
std::unique_ptr<Backend> sequential_cuda() {
  gpu::CudaOptions o;
  o.ssm_sequential = true;
  return gpu::make_cuda_backend(o);
}

TEST(SsmGpu, ChainMatchesEmulatorBitwise) {
  REQUIRE_GPU();
  auto emu = make_backend("emu");
  auto cuda = sequential_cuda();
  for (const Shape& sh : kShapes)
    for (bool marks : {false, true}) {
      test::SsmChainCase c;
      c.s = sh.s;
      c.W = sh.W;
      c.seed = 900 + static_cast<uint64_t>(&sh - kShapes);
      c.bf16_marks = marks;
      const test::SsmChainInputs in = test::ssm_chain_inputs(c);
      expect_bitwise(test::run_ssm_chain(*emu, c, in), test::run_ssm_chain(*cuda, c, in),
                     std::string(sh.name) + (marks ? ", BF16 marks" : ""));
    }
}

// The same call twice gives the same bits (no atomics, no order that depends on scheduling).
// (both scans: the chunked one is deterministic too)
TEST(SsmGpu, RepeatsBitwise) {
  REQUIRE_GPU();
  test::SsmChainCase c;
  c.s = kShapes[3].s;
  c.seed = 950;
  const test::SsmChainInputs in = test::ssm_chain_inputs(c);
  auto seq = sequential_cuda();
  expect_bitwise(test::run_ssm_chain(*seq, c, in), test::run_ssm_chain(*seq, c, in),
                 "cuda sequential twice");
  auto chunked = make_backend("cuda");
  expect_bitwise(test::run_ssm_chain(*chunked, c, in), test::run_ssm_chain(*chunked, c, in),
                 "cuda chunked twice");
}

// The CUDA conv backward pass keeps a conv width's gradient sums in registers: wider convs are a
// named error, not a wrong answer.
TEST(SsmGpu, WideConvIsANamedError) {
  REQUIRE_GPU();
  auto cuda = make_backend("cuda");
  test::SsmChainCase c;
  c.s = kShapes[0].s;
  c.W = 9;
  const test::SsmChainInputs in = test::ssm_chain_inputs(c);
  try {
    test::run_ssm_chain(*cuda, c, in);
    ADD_FAILURE() << "a conv of width 9 ran";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("conv width 9"), std::string::npos) << e.what();
  }
}

// ---- the chunked SSD scan ---------------------------------------------------------------------

// The scan ops alone on one backend: inputs as host values (dt_raw a strided slice of a wider
// buffer), parameter gradients from 0; outputs downloaded by name.
struct ScanCase {
  const char* name;
  SsmShape s;
};
struct ScanInputs {
  std::vector<float> xbc, dt_raw, dt_bias, A_log, D, dy;
  int64_t ld_dt = 0;
};
ScanInputs scan_inputs(const SsmShape& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> u01(0.0f, 1.0f);
  const size_t R = static_cast<size_t>(s.B * s.T), H = static_cast<size_t>(s.H);
  ScanInputs in;
  in.ld_dt = s.H + 5;
  in.xbc.resize(R * static_cast<size_t>(s.xbc_cols()));
  for (float& v : in.xbc) v = nd(rng);
  in.dt_raw.assign(R * static_cast<size_t>(in.ld_dt), std::nanf(""));
  for (size_t r = 0; r < R; ++r)
    for (size_t h = 0; h < H; ++h) in.dt_raw[r * static_cast<size_t>(in.ld_dt) + h] = nd(rng);
  for (size_t h = 0; h < H; ++h) {  // mamba_ssm's init: dt in [1e-3, 1e-1] log-uniform
    const float dt = std::exp(std::log(1e-3f) + u01(rng) * (std::log(1e-1f) - std::log(1e-3f)));
    in.dt_bias.push_back(dt + std::log(-std::expm1(-dt)));
    in.A_log.push_back(std::log(1.0f + 15.0f * u01(rng)));
    in.D.push_back(0.5f + u01(rng));
  }
  in.dy.resize(R * static_cast<size_t>(s.d_inner()));
  for (float& v : in.dy) v = nd(rng);
  return in;
}

test::SsmChainOutputs run_scan(Backend& be, const SsmShape& s, const ScanInputs& in) {
  const int64_t R = s.B * s.T, H = s.H, di = s.d_inner(), cx = s.xbc_cols();
  std::vector<std::unique_ptr<BackendBuffer>> bufs;
  auto buffer = [&](const std::vector<float>& h) {
    bufs.push_back(std::make_unique<BackendBuffer>(be, h.size() * sizeof(float)));
    be.upload(bufs.back()->get(), h.data(), h.size() * sizeof(float));
    return bufs.back()->as<float>();
  };
  auto filled = [&](int64_t n, float v) {
    return buffer(std::vector<float>(static_cast<size_t>(n), v));
  };
  auto view = [&](float* p, int64_t rows, int64_t cols, const char* name) {
    return f32_view(be, p, rows, cols, name);
  };
  const float nan = std::nanf("");
  float* xbc = buffer(in.xbc);
  float* dt_raw = buffer(in.dt_raw);
  float* dt_bias = buffer(in.dt_bias);
  float* A_log = buffer(in.A_log);
  float* D = buffer(in.D);
  float* dy = buffer(in.dy);
  float* dt = filled(R * H, nan);
  float* A = filled(H, nan);
  float* y = filled(R * di, nan);
  float* states = filled(s.states_size(), nan);
  float* dxbc = filled(R * cx, nan);
  float* ddt_raw = filled(R * in.ld_dt, nan);
  float* ddt_bias = filled(H, 0.0f);
  float* dA_log = filled(H, 0.0f);
  float* dD = filled(H, 0.0f);
  TensorView vdtr = view(dt_raw, R, H, "dt_raw"), vddtr = view(ddt_raw, R, H, "ddt_raw");
  vdtr.row_stride = vddtr.row_stride = in.ld_dt;
  const TensorView vxbc = view(xbc, R, cx, "xbc"), vdt = view(dt, R, H, "dt"),
                   vA = view(A, H, 1, "A"), vdtb = view(dt_bias, H, 1, "dt_bias"),
                   vAl = view(A_log, H, 1, "A_log"), vD = view(D, H, 1, "D"),
                   vstates = view(states, s.B * H * s.chunks(), s.P * s.N, "states");
  be.ssm_scan_forward(view(y, R, di, "y"), vstates, vdt, vA, vxbc, vdtr, vdtb, vAl, vD, s);
  be.ssm_scan_backward(view(dxbc, R, cx, "dxbc"), vddtr, view(ddt_bias, H, 1, "ddt_bias"),
                       view(dA_log, H, 1, "dA_log"), view(dD, H, 1, "dD"), view(dy, R, di, "dy"),
                       vxbc, vdt, vA, vdtr, vdtb, vAl, vD, vstates, s);
  be.synchronize();
  test::SsmChainOutputs o;
  auto get = [&](const char* name, const float* p, int64_t n) {
    std::vector<float> h(static_cast<size_t>(n));
    be.download(h.data(), p, h.size() * sizeof(float));
    o.emplace_back(name, std::move(h));
  };
  get("y", y, R * di);
  get("states", states, s.states_size());
  get("dxbc", dxbc, R * cx);
  get("ddt_raw", ddt_raw, R * in.ld_dt);
  get("ddt_bias", ddt_bias, H);
  get("dA_log", dA_log, H);
  get("dD", dD, H);
  return o;
}

// docs/numerics.md "The chunked SSD on CUDA": max |cuda - emu| / max |emu| per output, within
// kSsdBudget for the per-element outputs and kSsdSumBudget for the parameter gradients (sums over
// the B*T rows that partly cancel, normalised by the result rather than by the terms).
constexpr double kSsdBudget = 1e-5;
constexpr double kSsdSumBudget = 3e-5;

// (B, T, H, P, G, N, chunk)
const ScanCase kScanCases[] = {
    {"small preset, B 2, T 300, Q 128", {2, 300, 32, 64, 8, 128, 128}},
    {"Q 64, T 200 (partial chunk), G 1", {2, 200, 8, 64, 1, 64, 64}},
    {"Q 64, T 150 (partial chunk), G 8, P 32", {1, 150, 16, 32, 8, 128, 64}},
    {"T 50 < Q 128, G 2, P 16, N 32", {2, 50, 4, 16, 2, 32, 128}},
    {"P 80, N 16, Q 32, T 97", {1, 97, 4, 80, 2, 16, 32}},
    {"P 128, N 64, G 4, T 256 = 2 chunks", {1, 256, 8, 128, 4, 64, 128}},
};

TEST(SsmGpu, ChunkedScanWithinBudget) {
  REQUIRE_GPU();
  auto emu = make_backend("emu");
  auto cuda = make_backend("cuda");  // (default CudaOptions: the chunked scan)
  for (const ScanCase& sc : kScanCases) {
    const SsmShape& s = sc.s;
    const ScanInputs in = scan_inputs(s, 1200 + static_cast<uint64_t>(&sc - kScanCases));
    const test::SsmChainOutputs e = run_scan(*emu, s, in), g = run_scan(*cuda, s, in);
    for (size_t k = 0; k < e.size(); ++k) {
      const std::string& what = e[k].first;
      const std::vector<float>& a = g[k].second;
      const std::vector<float>& b = e[k].second;
      ASSERT_EQ(a.size(), b.size()) << what;
      double num = 0, den = 0;
      size_t worst = 0, nonfinite = 0;
      for (size_t i = 0; i < b.size(); ++i) {
        if (std::isnan(b[i])) {  // (ddt_raw's padding columns: left alone on both)
          if (!std::isnan(a[i])) ++nonfinite;
          continue;
        }
        if (!std::isfinite(a[i])) ++nonfinite;
        const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
        if (d > num) num = d, worst = i;
        den = std::max(den, std::fabs(static_cast<double>(b[i])));
      }
      const bool sum = what == "ddt_bias" || what == "dA_log" || what == "dD";
      const double budget = sum ? kSsdSumBudget : kSsdBudget, err = num / (den + 1e-30);
      std::printf(
          "ssd chunked %-40s %-9s rel err %.3g (budget %.3g)%s, worst at %zu: %+.8e vs "
          "emu %+.8e\n",
          sc.name, what.c_str(), err, budget, err <= budget ? "" : " NOT OK", worst, a[worst],
          b[worst]);
      EXPECT_EQ(nonfinite, 0u) << sc.name << " " << what;
      EXPECT_GT(den, 0.0) << sc.name << " " << what << ": all zero";
      EXPECT_LE(err, budget) << sc.name << " " << what;
    }
  }
}

}  // namespace
}  // namespace fp4sim
