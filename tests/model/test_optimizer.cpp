// Muon and ROOT (DESIGN.md §13, model/optimizer.hpp): the new Backend ops against their formulas,
// Newton–Schulz against a plain reference (bitwise for FP32) and against FP64 (each precision's
// error printed), one optimizer step against a hand-written one, and training: resume bit for
// bit, loss scaling bit for bit, bad input refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "emu/cpu_backend.hpp"
#include "emu/optim.hpp"
#include "model/checkpoint.hpp"
#include "model/gpt.hpp"
#include "model/optimizer.hpp"
#include "model/trainer.hpp"
#include "tests/model/ns_matrices.hpp"
#include "tests/model/trainer_fixtures.hpp"

namespace fp4sim::model {
namespace {

using emu::CpuBackend;
using Vec = std::vector<float>;

Vec randn(size_t n, uint64_t seed, float scale = 1.0f) { return ns_randn(n, seed, scale); }

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

TensorView host(Vec& v, int64_t rows, int64_t cols, const char* name = "x") {
  return view_of(v.data(), DType::F32, rows, cols, Device::Host, name);
}

TEST(OptimizerOps, AxpbyTransposeClampFollowTheirFormulas) {
  CpuBackend be;
  Vec x = randn(6 * 5, 1), y = randn(6 * 5, 2), out(30), t(30);
  be.axpby(host(out, 6, 5), 0.3f, host(x, 6, 5), -1.7f, host(y, 6, 5));
  for (size_t i = 0; i < out.size(); ++i)
    EXPECT_EQ(bits(out[i]), bits(fadd_rn(fmul_rn(0.3f, x[i]), fmul_rn(-1.7f, y[i]))));
  be.axpby(host(out, 6, 5), 0.3f, host(x, 6, 5), -1.7f, TensorView{});
  for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(bits(out[i]), bits(0.3f * x[i]));
  be.transpose(host(t, 5, 6), host(x, 6, 5));
  for (int r = 0; r < 6; ++r)
    for (int c = 0; c < 5; ++c) EXPECT_EQ(t[c * 6 + r], x[r * 5 + c]);
  x[3] = std::numeric_limits<float>::quiet_NaN();
  be.clamp(host(out, 6, 5), host(x, 6, 5), 0.5f);
  for (size_t i = 0; i < out.size(); ++i)
    if (i == 3)
      EXPECT_TRUE(std::isnan(out[i]));
    else
      EXPECT_EQ(out[i], std::min(0.5f, std::max(-0.5f, x[i])));
  EXPECT_THROW(be.transpose(host(t, 6, 5), host(x, 6, 5)), std::invalid_argument);
  EXPECT_THROW(be.clamp(host(out, 6, 5), host(x, 6, 5), -1.0f), std::invalid_argument);
}

TEST(OptimizerOps, FrobeniusNormSumsRowsThenTheRowSums) {
  CpuBackend be;
  Vec x = randn(7 * 300, 3, 10.0f);
  double total = 0;
  for (int r = 0; r < 7; ++r) {
    double s = 0;
    for (int c = 0; c < 300; ++c) s += static_cast<double>(x[r * 300 + c]) * x[r * 300 + c];
    total += s;
  }
  EXPECT_EQ(bits(be.frobenius_norm(host(x, 7, 300))), bits(static_cast<float>(std::sqrt(total))));
}

TEST(OptimizerOps, AbsQuantileInterpolatesTheSortedMagnitudes) {
  CpuBackend be;
  for (const size_t n : {size_t{1}, size_t{2}, size_t{17}, size_t{1000}}) {
    Vec x = randn(n, 10 + n);
    Vec a(n);
    for (size_t i = 0; i < n; ++i) a[i] = std::fabs(x[i]);
    std::sort(a.begin(), a.end());
    for (const double q : {0.0, 0.5, 0.9, 0.99, 1.0}) {
      const double h = q * static_cast<double>(n - 1);
      const size_t lo = static_cast<size_t>(std::floor(h)), hi = std::min(lo + 1, n - 1);
      const float want =
          a[lo] + static_cast<float>(h - std::floor(h)) * (a[hi] - a[lo]);  // (RN each step)
      EXPECT_EQ(bits(be.abs_quantile(host(x, 1, static_cast<int64_t>(n)), q)), bits(want))
          << "n " << n << " q " << q;
    }
  }
  Vec x = randn(4, 1);
  EXPECT_THROW(be.abs_quantile(host(x, 1, 4), 1.5), std::invalid_argument);
  EXPECT_THROW(be.abs_quantile(host(x, 0, 4), 0.5), std::invalid_argument);
}

// ---- Newton–Schulz -----------------------------------------------------------------------------

// NS5 written out in plain FP32 (index-order dot products, each step RN): the emulator's FP32
// matmul is such a loop, so the emulator's FP32 Newton–Schulz equals it bit for bit.
Vec ns_reference_fp32(const Vec& g, int64_t R, int64_t C, NsCoefficients k) {
  const bool tall = R > C;
  const int64_t m = std::min(R, C), n = std::max(R, C);
  Vec X(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) X[i * n + j] = tall ? g[j * C + i] : g[i * n + j];
  double total = 0;
  for (int64_t i = 0; i < m; ++i) {
    double s = 0;
    for (int64_t j = 0; j < n; ++j) s += static_cast<double>(X[i * n + j]) * X[i * n + j];
    total += s;
  }
  const float inv = 1.0f / (static_cast<float>(std::sqrt(total)) + 1e-7f);
  for (float& v : X) v = inv * v;
  Vec A(static_cast<size_t>(m * m)), AA(A.size()), BX(X.size());
  for (int it = 0; it < 5; ++it) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < m; ++j) {
        float s = 0;
        for (int64_t l = 0; l < n; ++l) s += X[i * n + l] * X[j * n + l];
        A[i * m + j] = s;
      }
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < m; ++j) {
        float s = 0;
        for (int64_t l = 0; l < m; ++l) s += A[i * m + l] * A[l * m + j];
        AA[i * m + j] = k.b * A[i * m + j] + k.c * s;  // B = b A + c A A
      }
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        float s = 0;
        for (int64_t l = 0; l < m; ++l) s += AA[i * m + l] * X[l * n + j];
        BX[i * n + j] = s;
      }
    for (size_t i = 0; i < X.size(); ++i) X[i] = k.a * X[i] + BX[i];
  }
  Vec out(g.size());
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) (tall ? out[j * C + i] : out[i * n + j]) = X[i * n + j];
  return out;
}

// The same algorithm in FP64 throughout: the exact NS5 result the precisions are measured against.
std::vector<double> ns_reference_fp64(const Vec& g, int64_t R, int64_t C, NsCoefficients k) {
  const bool tall = R > C;
  const int64_t m = std::min(R, C), n = std::max(R, C);
  std::vector<double> X(static_cast<size_t>(m * n)), A(static_cast<size_t>(m * m)), B(A.size()),
      BX(X.size());
  double total = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      X[i * n + j] = tall ? g[j * C + i] : g[i * n + j];
      total += X[i * n + j] * X[i * n + j];
    }
  for (double& v : X) v /= std::sqrt(total) + 1e-7;
  for (int it = 0; it < 5; ++it) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < m; ++j) {
        double s = 0;
        for (int64_t l = 0; l < n; ++l) s += X[i * n + l] * X[j * n + l];
        A[i * m + j] = s;
      }
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < m; ++j) {
        double s = 0;
        for (int64_t l = 0; l < m; ++l) s += A[i * m + l] * A[l * m + j];
        B[i * m + j] = k.b * A[i * m + j] + k.c * s;
      }
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t l = 0; l < m; ++l) s += B[i * m + l] * X[l * n + j];
        BX[i * n + j] = s;
      }
    for (size_t i = 0; i < X.size(); ++i) X[i] = k.a * X[i] + BX[i];
  }
  std::vector<double> out(g.size());
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) (tall ? out[j * C + i] : out[i * n + j]) = X[i * n + j];
  return out;
}

Vec run_ns(Backend& be, Vec g, int64_t R, int64_t C, const NsOptions& o) {
  NewtonSchulz ns(be, std::min(R, C), R * C, o.precision);
  ns.run(host(g, R, C, "g"), host(g, R, C, "g"), o);
  return g;
}

TEST(NewtonSchulz, Fp32EqualsThePlainReferenceBitForBit) {
  CpuBackend be;
  for (const auto& [R, C] : {std::pair<int64_t, int64_t>{24, 40}, {40, 24}}) {
    const Vec g = momentum_like(R, C, 7);
    const Vec got = run_ns(be, g, R, C, NsOptions{});
    const Vec want = ns_reference_fp32(g, R, C, kMuonNs);
    for (size_t i = 0; i < g.size(); ++i)
      ASSERT_EQ(bits(got[i]), bits(want[i])) << R << "x" << C << " element " << i;
  }
}

double rel_error(const Vec& x, const std::vector<double>& ref) {
  double d = 0, r = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    d += (x[i] - ref[i]) * (x[i] - ref[i]);
    r += ref[i] * ref[i];
  }
  return std::sqrt(d / r);
}

// ||X_p - X_fp64||_F / ||X_fp64||_F after 5 iterations on a 64 x 192 momentum-like matrix: FP32
// and BF16 within budgets (the measured values are printed).
TEST(NewtonSchulz, Fp32AndBf16AgainstFp64) {
  CpuBackend be;
  const int64_t R = 64, C = 192;
  const Vec g = momentum_like(R, C, 11);
  const std::vector<double> ref = ns_reference_fp64(g, R, C, kMuonNs);
  for (const auto& [name, p, budget] :
       {std::tuple<const char*, NsPrecision, double>{"fp32", NsPrecision::FP32, 1e-5},
        {"bf16", NsPrecision::BF16, 5e-2}}) {
    NsOptions o;
    o.precision = p;
    const double e = rel_error(run_ns(be, g, R, C, o), ref);
    std::printf("[optimizer] NS5 %dx%d %s: rel. error vs FP64 %.3e (budget %.0e)\n",
                static_cast<int>(R), static_cast<int>(C), name, e, budget);
    EXPECT_LT(e, budget) << name;
  }
}

// NVFP4 products (Q-Root): one iteration on a Gaussian 64 x 192 matrix is within the error of its
// three quantized products (budget 1e-2); five iterations are printed, not bounded: they amplify
// the products' errors (a Gaussian matrix's NS5 in NVFP4 leaves the polynomial's basin and grows
// without bound, as an independent NumPy model of the same quantizers does too; docs/numerics.md).
TEST(NewtonSchulz, Nvfp4AgainstFp32) {
  CpuBackend be;
  const int64_t R = 64, C = 192;
  const Vec gauss = randn(static_cast<size_t>(R * C), 21), low = momentum_like(R, C, 11);
  for (const auto& [what, g] :
       {std::pair<const char*, const Vec&>{"gaussian", gauss}, {"momentum-like", low}})
    for (const int its : {1, 5})
      for (const double clip : {1.0, 0.99}) {
        NsOptions o32, oq;
        o32.iterations = oq.iterations = its;
        oq.precision = NsPrecision::NVFP4;
        oq.clip_quantile = clip;
        const Vec x32 = run_ns(be, g, R, C, o32), xq = run_ns(be, g, R, C, oq);
        const double e = rel_error(xq, std::vector<double>(x32.begin(), x32.end()));
        std::printf("[optimizer] NS%d %dx%d %s nvfp4 clip %.2f: rel. error vs FP32 %.3e%s\n", its,
                    static_cast<int>(R), static_cast<int>(C), what, clip, e,
                    its == 1 && clip == 1.0 && g.data() == gauss.data() ? " (budget 1e-2)" : "");
        if (its == 1 && clip == 1.0 && g.data() == gauss.data()) {
          EXPECT_LT(e, 1e-2);
        }
      }
}

TEST(NewtonSchulz, RootTableKeysTheShape) {
  const std::optional<NsCoefficients> k = root_table_coefficients(3072, 2048);
  ASSERT_TRUE(k.has_value());
  EXPECT_EQ(k->a, 3.4509f);
  EXPECT_EQ(k->b, -4.5790f);
  EXPECT_EQ(k->c, 1.9325f);
  EXPECT_TRUE(root_table_coefficients(2048, 2048).has_value());
  EXPECT_FALSE(root_table_coefficients(768, 768).has_value());
}

// ---- one optimizer step ------------------------------------------------------------------------

// One Muon (or ROOT) step on the micro GPT from known gradients, against the step written out:
// the c_attn K sub-matrix (a fused weight's part) and an AdamW tensor (ln_1's weight).
void expect_step_as_written(const std::string& name) {
  CpuBackend be;
  const RunConfig c = micro_run("unused", {"optim.name=" + name});
  Gpt model(c.model, be);
  model.init(5);
  const size_t n = model.num_params();
  const Vec grads = randn(n, 99, 0.01f);
  std::memcpy(model.grads(), grads.data(), n * 4);
  const Vec before = model.params_to_host();
  Optimizer opt(c, model);
  const double lr = 2e-3;
  const float grad_scale = 0.75f;
  opt.step(lr, 1, grad_scale);
  const Vec after = model.params_to_host();

  const ParamTensor& qkv = model.tensor("h.0.attn.c_attn.weight");
  const int64_t C = qkv.shape[1], rows = 32, row0 = 32;  // K: rows 32..63 (4 heads of 8)
  const float mu = 0.95f;
  Vec g(static_cast<size_t>(rows * C));
  for (int64_t i = 0; i < rows * C; ++i) {
    const float gr = fmul_rn(grads[qkv.offset + row0 * C + i], grad_scale);
    const float buf = fadd_rn(fmul_rn(mu, 0.0f), gr);
    g[i] = fadd_rn(gr, fmul_rn(mu, buf));
  }
  if (name == "root") {
    CpuBackend b2;
    const float eps = fadd_rn(b2.abs_quantile(host(g, rows, C), 0.9), 1e-9f);
    for (float& v : g) v = clamp_element(v, eps);
  }
  const Vec X = ns_reference_fp32(g, rows, C, kMuonNs);
  const float decay = static_cast<float>(1.0 - lr * c.train.weight_decay);
  const float step = static_cast<float>(lr * 0.2 * std::sqrt(32.0));
  for (int64_t i = 0; i < rows * C; ++i) {
    const size_t at = qkv.offset + static_cast<size_t>(row0 * C + i);
    ASSERT_EQ(bits(after[at]), bits(fadd_rn(fmul_rn(decay, before[at]), fmul_rn(-step, X[i]))))
        << name << " c_attn K element " << i;
  }
  const ParamTensor& ln = model.tensor("h.0.ln_1.weight");
  const AdamWStep s =
      make_adamw_step(static_cast<float>(lr), 0.9f, 0.95f, 1e-8f, 0.0f, 1, grad_scale);
  for (int64_t i = 0; i < ln.numel(); ++i) {
    float p = before[ln.offset + i], m = 0, v = 0;
    adamw_element(p, grads[ln.offset + i], m, v, s);
    ASSERT_EQ(bits(after[ln.offset + i]), bits(p)) << "ln_1 element " << i;
  }
}
TEST(Optimizer, MuonStepAsWritten) { expect_step_as_written("muon"); }
TEST(Optimizer, RootStepAsWritten) { expect_step_as_written("root"); }

TEST(Optimizer, SplitsFusedWeightsIntoTheirSubMatrices) {
  CpuBackend be;
  const RunConfig c =
      micro_run("unused", {"optim.name=muon", "model.n_kv_heads=2", "model.activation=swiglu"});
  Gpt model(c.model, be);
  const std::vector<OrthoTensor> ts = orthogonalised_tensors(model);
  ASSERT_EQ(ts.size(), 8u);  // 2 layers x (c_attn, attn.c_proj, c_fc, mlp.c_proj)
  const OrthoTensor& qkv = ts[0];
  EXPECT_EQ(model.tensors()[qkv.tensor].name, "h.0.attn.c_attn.weight");
  ASSERT_EQ(qkv.parts.size(), 3u);
  EXPECT_EQ(qkv.parts[1].name, "k");
  EXPECT_EQ(qkv.parts[1].row0, 32);
  EXPECT_EQ(qkv.parts[1].rows, 16);  // 2 KV heads of 8
  const OrthoTensor& fc = ts[2];
  EXPECT_EQ(model.tensors()[fc.tensor].name, "h.0.mlp.c_fc.weight");
  ASSERT_EQ(fc.parts.size(), 2u);
  EXPECT_EQ(fc.parts[1].name, "up");
  EXPECT_EQ(fc.parts[1].row0, 64);
}

// ---- training ----------------------------------------------------------------------------------

std::vector<TrainResult> train_and_resume(const std::string& dir,
                                          const std::vector<std::string>& o) {
  RunConfig c = micro_run(dir + "/full", o);
  const TrainResult full = train(c, quiet_options(), *make_cpu_backend());
  TrainOptions resume = quiet_options();
  resume.resume = dir + "/full/checkpoints/step_00000005";
  c.train.out_dir = dir + "/cont";
  return {full, train(c, resume, *make_cpu_backend())};
}

void expect_resume_bitwise(const std::string& tag, const std::vector<std::string>& o) {
  const ScratchDir scratch("fp4sim_optim_" + tag);
  const std::vector<TrainResult> r = train_and_resume(scratch.path, o);
  ASSERT_EQ(r[0].steps.size(), 10u);
  ASSERT_EQ(r[1].steps.size(), 5u);
  for (size_t i = 0; i < 5; ++i)
    EXPECT_EQ(bits(r[1].steps[i].loss), bits(r[0].steps[5 + i].loss)) << tag << " step " << 6 + i;
  EXPECT_LT(r[0].steps.back().loss, r[0].steps.front().loss) << tag;
  const Checkpoint a = load_checkpoint(scratch.path + "/full/checkpoints");
  const Checkpoint b = load_checkpoint(scratch.path + "/cont/checkpoints");
  EXPECT_TRUE(a.optimizer.count("h.0.attn.c_attn.weight.momentum_buffer"));
  EXPECT_FALSE(a.optimizer.count("h.0.attn.c_attn.weight.exp_avg"));
  EXPECT_TRUE(a.optimizer.count("h.0.ln_1.weight.exp_avg"));
  for (const auto& [name, t] : a.model) EXPECT_EQ(t.bytes, b.model.at(name).bytes) << name;
  for (const auto& [name, t] : a.optimizer) EXPECT_EQ(t.bytes, b.optimizer.at(name).bytes) << name;
}
TEST(OptimizerTraining, MuonResumesBitwise) { expect_resume_bitwise("muon", {"optim.name=muon"}); }
TEST(OptimizerTraining, RootNvfp4ResumesBitwise) {
  expect_resume_bitwise("root_nvfp4",
                        {"optim.name=root", "optim.ns_precision=nvfp4", "recipe.name=nvfp4"});
}
TEST(OptimizerTraining, MuonBf16ResumesBitwise) {
  expect_resume_bitwise("muon_bf16", {"optim.name=muon", "optim.ns_precision=bf16"});
}

TEST(OptimizerTraining, ResumeWithAnotherOptimizerIsAnError) {
  const ScratchDir scratch("fp4sim_optim_switch");
  RunConfig c = micro_run(scratch.path + "/a");
  c.train.steps = 5;
  train(c, quiet_options(), *make_cpu_backend());
  RunConfig m = micro_run(scratch.path + "/b", {"optim.name=muon"});
  TrainOptions o = quiet_options();
  o.resume = scratch.path + "/a/checkpoints/step_00000005";
  try {
    train(m, o, *make_cpu_backend());
    ADD_FAILURE() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("resume with optim.name=adamw"), std::string::npos)
        << e.what();
  }
}

TEST(NewtonSchulz, RootTableFileIsCheckedAndUsed) {
  auto refused = [](const std::string& text, const std::string& needle) {
    try {
      parse_root_table(text, "t.json");
      ADD_FAILURE() << "expected an error for " << text;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused("{", "t.json: not JSON");
  refused("{\"shape\": []}", "\"shapes\" array");
  refused("{\"shapes\": [{\"min\": 32, \"max\": 16, \"a\": 3, \"b\": -4, \"c\": 2}]}",
          "shapes[0]: shape key min 32 is larger than max 16");
  refused("{\"shapes\": [{\"min\": \"32\", \"max\": 64, \"a\": 3, \"b\": -4, \"c\": 2}]}",
          "shape key 'min' is \"32\", not a positive integer");
  refused("{\"shapes\": [{\"min\": 32, \"a\": 3, \"b\": -4, \"c\": 2}]}", "key 'max' missing");
  refused("{\"shapes\": [{\"min\": 32, \"max\": 32, \"rows\": 1, \"a\": 3, \"b\": -4, \"c\": 2}]}",
          "unknown key 'rows'");
  refused("{\"shapes\": [{\"min\": 32, \"max\": 32, \"a\": 3, \"b\": -4}]}",
          "coefficient 'c' missing");
  refused(
      "{\"shapes\": [{\"min\": 8, \"max\": 8, \"a\": 3, \"b\": -4, \"c\": 2}, "
      "{\"min\": 8, \"max\": 8, \"a\": 3, \"b\": -4, \"c\": 2}]}",
      "shapes[1]: shape (8, 8) is listed twice");
  EXPECT_EQ(builtin_root_table().size(), 4u);
  // a user table: micro_run's 32 x 32 sub-matrices (q, k, v, attn.c_proj) take its coefficients
  const ScratchDir scratch("fp4sim_root_table");
  const std::string path = scratch.path + "/root.json";
  std::filesystem::create_directories(scratch.path);
  {
    std::ofstream f(path);
    f << "{\"shapes\": [{\"min\": 32, \"max\": 32, \"a\": 3.0, \"b\": -3.2, \"c\": 1.2}]}";
  }
  CpuBackend be;
  const RunConfig c = micro_run("unused", {"optim.name=root", "optim.root_table=" + path});
  Gpt model(c.model, be);
  const Optimizer opt(c, model);
  EXPECT_NE(opt.describe().find("ROOT's table has coefficients for 8 of them"), std::string::npos)
      << opt.describe();
  const RunConfig bad = micro_run("unused", {"optim.name=root", "optim.root_table=/nonexistent"});
  EXPECT_THROW(Optimizer(bad, model), std::invalid_argument);
}

TEST(OptimizerTraining, Nvfp4ProductsNeedSixteenBlocks) {
  CpuBackend be;
  const RunConfig c = micro_run("unused", {"optim.name=muon", "optim.ns_precision=nvfp4",
                                           "model.d_model=40", "model.d_ff=80"});
  Gpt model(c.model, be);
  try {
    Optimizer opt(c, model);
    ADD_FAILURE() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'h.0.attn.c_attn.weight' sub-matrix q is 40 x 40"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(micro_run("unused", {"optim.ns_clip_quantile=0"}), std::invalid_argument);
  EXPECT_THROW(micro_run("unused", {"optim.momentum=1"}), std::invalid_argument);
  EXPECT_THROW(micro_run("unused", {"optim.name=lion"}), std::invalid_argument);
}

}  // namespace
}  // namespace fp4sim::model
