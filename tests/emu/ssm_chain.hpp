// The Mamba-2 core's Backend ops (emu/backend.hpp: ssm_conv_*, ssm_scan_*, gated_norm_*) chained as
// a Mamba block runs them, on any backend: in_proj's output [z | x | B | C | dt_raw] (a row wider
// than that by `pad` NaN columns, so every slice is strided) -> conv + SiLU -> softplus and scan ->
// gated norm, then the backward passes in reverse, the slices' gradients written in place into a
// buffer that starts as NaN (its padding must stay NaN) and the parameter gradients accumulated
// onto 0.25. With bf16_marks every activation and activation gradient the model stores in BF16 is
// a view marked bf16_values (written rounded) and the output gradient is read rounded. Used by
// tests/emu/test_mamba.cpp (CpuBackend against emu/ssm.hpp's functions) and
// tests/gpu/test_ssm_gpu.cpp (CudaBackend against CpuBackend, bitwise).
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "emu/backend.hpp"

namespace fp4sim::test {

struct SsmChainCase {
  SsmShape s;
  int64_t W = 4;
  uint64_t seed = 1;
  bool bf16_marks = false;
  int64_t pad = 3;  // extra columns of the in_proj output buffer (NaN)
  int64_t di() const { return s.d_inner(); }
  int64_t cx() const { return s.xbc_cols(); }
  int64_t cin() const { return 2 * di() + 2 * s.G * s.N + s.H; }  // [z | x | B | C | dt_raw]
  int64_t ld() const { return cin() + pad; }
  int64_t rows() const { return s.B * s.T; }
};

// The chain's inputs, host values: zx (rows, ld), the parameters, the output gradient (rows, di).
struct SsmChainInputs {
  std::vector<float> zx, conv_w, conv_b, dt_bias, A_log, D, norm_w, dout;
};

inline SsmChainInputs ssm_chain_inputs(const SsmChainCase& c) {
  std::mt19937_64 rng(c.seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto uniform = [&](size_t n, float lo, float hi) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng);
    return v;
  };
  const size_t rows = static_cast<size_t>(c.rows()), H = static_cast<size_t>(c.s.H);
  SsmChainInputs in;
  in.zx.assign(rows * static_cast<size_t>(c.ld()), std::nanf(""));
  for (size_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < c.cin(); ++i) in.zx[r * static_cast<size_t>(c.ld()) + i] = nd(rng);
  const float cb = 1.0f / std::sqrt(static_cast<float>(c.W));
  in.conv_w = uniform(static_cast<size_t>(c.cx() * c.W), -cb, cb);
  in.conv_b = uniform(static_cast<size_t>(c.cx()), -cb, cb);
  for (float d : uniform(H, 0.01f, 0.5f)) in.dt_bias.push_back(d + std::log(-std::expm1(-d)));
  for (float a : uniform(H, 1.0f, 16.0f)) in.A_log.push_back(std::log(a));
  in.D = uniform(H, 0.5f, 1.5f);
  in.norm_w = uniform(static_cast<size_t>(c.di()), 0.5f, 1.5f);
  in.dout.resize(rows * static_cast<size_t>(c.di()));
  for (float& x : in.dout) x = nd(rng);
  return in;
}

// What the chain computed, by name, downloaded to the host.
using SsmChainOutputs = std::vector<std::pair<std::string, std::vector<float>>>;

inline SsmChainOutputs run_ssm_chain(Backend& be, const SsmChainCase& c, const SsmChainInputs& in) {
  const SsmShape& s = c.s;
  const int64_t R = c.rows(), di = c.di(), cx = c.cx(), ld = c.ld(), H = s.H;
  std::vector<std::unique_ptr<BackendBuffer>> bufs;
  auto buffer = [&](const std::vector<float>& h) {
    bufs.push_back(std::make_unique<BackendBuffer>(be, h.size() * sizeof(float)));
    be.upload(bufs.back()->get(), h.data(), h.size() * sizeof(float));
    return bufs.back()->as<float>();
  };
  auto filled = [&](size_t n, float v) { return buffer(std::vector<float>(n, v)); };
  auto dense = [&](float* p, int64_t rows, int64_t cols, const char* name, bool mark = false) {
    return f32_view(be, p, rows, cols, name, mark);
  };
  // columns [col, col + cols) of a (R, ld) buffer
  auto slice = [&](float* p, int64_t col, int64_t cols, const char* name, bool mark = false) {
    TensorView v = f32_view(be, p + col, R, cols, name, mark);
    v.row_stride = ld;
    return v;
  };
  const bool m = c.bf16_marks;
  const float nan = std::nanf("");
  float* zx = buffer(in.zx);
  float* conv_w = buffer(in.conv_w);
  float* conv_b = buffer(in.conv_b);
  float* dt_bias = buffer(in.dt_bias);
  float* A_log = buffer(in.A_log);
  float* D = buffer(in.D);
  float* norm_w = buffer(in.norm_w);
  float* dout = buffer(in.dout);
  float* xbc = filled(static_cast<size_t>(R * cx), nan);
  float* dt = filled(static_cast<size_t>(R * H), nan);
  float* A = filled(static_cast<size_t>(H), nan);
  float* states = filled(static_cast<size_t>(s.states_size()), nan);
  float* y = filled(static_cast<size_t>(R * di), nan);
  float* rstd = filled(static_cast<size_t>(R * s.G), nan);
  float* out = filled(static_cast<size_t>(R * di), nan);
  float* dy = filled(static_cast<size_t>(R * di), nan);
  float* dxbc = filled(static_cast<size_t>(R * cx), nan);
  float* dzx = filled(static_cast<size_t>(R * ld), nan);
  const float k = 0.25f;  // the parameter gradients' previous value
  float* dconv_w = filled(in.conv_w.size(), k);
  float* dconv_b = filled(in.conv_b.size(), k);
  float* ddt_bias = filled(static_cast<size_t>(H), k);
  float* dA_log = filled(static_cast<size_t>(H), k);
  float* dD = filled(static_cast<size_t>(H), k);
  float* dnorm_w = filled(in.norm_w.size(), k);

  const TensorView vxbc = dense(xbc, R, cx, "xbc"), vdt = dense(dt, R, H, "dt"),
                   vA = dense(A, H, 1, "A"), vy = dense(y, R, di, "y"),
                   vrstd = dense(rstd, R, s.G, "rstd"),
                   vstates = dense(states, s.B * H * s.chunks(), s.P * s.N, "states");
  const TensorView vcw = dense(conv_w, cx, c.W, "conv1d.weight"),
                   vcb = dense(conv_b, cx, 1, "conv1d.bias"),
                   vdtb = dense(dt_bias, H, 1, "dt_bias"), vAl = dense(A_log, H, 1, "A_log"),
                   vD = dense(D, H, 1, "D"), vnw = dense(norm_w, di, 1, "norm.weight");
  const TensorView vz = slice(zx, 0, di, "z"), vx = slice(zx, di, cx, "xBC"),
                   vdtr = slice(zx, di + cx, H, "dt_raw");
  be.ssm_conv_forward(dense(xbc, R, cx, "xbc", m), vx, vcw, vcb, s);
  be.ssm_scan_forward(dense(y, R, di, "y", m), vstates, vdt, vA, vxbc, vdtr, vdtb, vAl, vD, s);
  be.gated_norm_forward(dense(out, R, di, "out", m), vrstd, vy, vz, vnw);

  be.gated_norm_backward(dense(dy, R, di, "dy", m), slice(dzx, 0, di, "dz", m),
                         dense(dnorm_w, di, 1, "dnorm.weight"), dense(dout, R, di, "dout", m), vy,
                         vz, vnw, vrstd);
  be.ssm_scan_backward(dense(dxbc, R, cx, "dxbc", m), slice(dzx, di + cx, H, "ddt_raw", m),
                       dense(ddt_bias, H, 1, "ddt_bias"), dense(dA_log, H, 1, "dA_log"),
                       dense(dD, H, 1, "dD"), dense(dy, R, di, "dy"), vxbc, vdt, vA, vdtr, vdtb,
                       vAl, vD, vstates, s);
  be.ssm_conv_backward(slice(dzx, di, cx, "dxBC", m), dense(dconv_w, cx, c.W, "dconv1d.weight"),
                       dense(dconv_b, cx, 1, "dconv1d.bias"), dense(dxbc, R, cx, "dxbc"), vx, vcw,
                       vcb, s);
  be.synchronize();

  SsmChainOutputs o;
  auto get = [&](const char* name, const float* p, size_t n) {
    std::vector<float> h(n);
    be.download(h.data(), p, n * sizeof(float));
    o.emplace_back(name, std::move(h));
  };
  get("xbc", xbc, static_cast<size_t>(R * cx));
  get("dt", dt, static_cast<size_t>(R * H));
  get("A", A, static_cast<size_t>(H));
  get("states", states, static_cast<size_t>(s.states_size()));
  get("y", y, static_cast<size_t>(R * di));
  get("rstd", rstd, static_cast<size_t>(R * s.G));
  get("out", out, static_cast<size_t>(R * di));
  get("dy", dy, static_cast<size_t>(R * di));
  get("dxbc", dxbc, static_cast<size_t>(R * cx));
  get("dzx", dzx, static_cast<size_t>(R * ld));
  get("dconv1d.weight", dconv_w, in.conv_w.size());
  get("dconv1d.bias", dconv_b, in.conv_b.size());
  get("ddt_bias", ddt_bias, static_cast<size_t>(H));
  get("dA_log", dA_log, static_cast<size_t>(H));
  get("dD", dD, static_cast<size_t>(H));
  get("dnorm.weight", dnorm_w, in.norm_w.size());
  return o;
}

inline const std::vector<float>& ssm_output(const SsmChainOutputs& o, const std::string& name) {
  for (const auto& [n, v] : o)
    if (n == name) return v;
  throw std::out_of_range("no chain output " + name);
}

}  // namespace fp4sim::test
