// The low-precision recipes (issue 5) on the emulator: config checks, which blocks stay in BF16,
// the SR stream function, the quantized linear layer against FP32, 2D weights' exact transpose,
// and bitwise resume under NVFP4 with SR.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <set>
#include <tuple>

#include "emu/cpu_backend.hpp"
#include "emu/fused.hpp"
#include "model/gpt.hpp"
#include "model/linear.hpp"
#include "model/trainer.hpp"
#include "tests/model/model_steps.hpp"

namespace fp4sim::model {
namespace {

uint32_t test_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

// Host views for the linear layer's calls.
TensorView hv(std::vector<float>& v, int64_t rows, int64_t cols, bool bf16_values = false,
              const char* name = "t") {
  TensorView t = host_view(v.data(), rows, cols, name);
  t.bf16_values = bf16_values;
  return t;
}
LinearWeights weights(std::vector<float>& w, std::vector<float>* bias, int64_t OC, int64_t K) {
  LinearWeights lw;
  lw.weight = hv(w, OC, K, false, "t.weight");
  if (bias) lw.bias = hv(*bias, OC, 1, false, "t.bias");
  return lw;
}

RunConfig run_with(std::vector<std::string> overrides, int64_t layers = 2) {
  nlohmann::json j = {{"model",
                       {{"vocab", 32},
                        {"seq_len", 16},
                        {"max_positions", 16},
                        {"d_model", 32},
                        {"n_layers", layers},
                        {"n_heads", 4},
                        {"n_kv_heads", 4},
                        {"d_ff", 64}}},
                      {"train",
                       {{"batch", 2},
                        {"steps", 10},
                        {"lr", 3e-3},
                        {"warmup", 2},
                        {"data", "synthetic"},
                        {"eval_every", 0},
                        {"checkpoint_every", 5}}}};
  return config_from_json(j, overrides);
}

void expect_config_error(std::vector<std::string> overrides, const std::string& needle) {
  try {
    run_with(overrides);
    ADD_FAILURE() << "no error for " << overrides.front();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Recipe, ImpossibleCombinationsAreErrorsNamingTheKey) {
  expect_config_error({"recipe.name=nvfp4", "recipe.four_over_six=activations"}, "recipe.rht");
  expect_config_error({"recipe.name=nvfp4", "recipe.four_over_six=all", "recipe.rht=false"},
                      "stochastic");
  expect_config_error({"recipe.name=mxfp4", "recipe.weight_2d=true"}, "recipe.weight_2d");
  EXPECT_FALSE(
      run_with({"recipe.name=mxfp4"}).recipe.weight_2d);  // MXFP4's default: 1-D weight blocks
  EXPECT_TRUE(run_with({"recipe.name=nvfp4"}).recipe.weight_2d);
  expect_config_error(
      {"recipe.name=mxfp4", "recipe.weight_2d=false", "recipe.four_over_six=weights"}, "MXFP4");
  expect_config_error({"recipe.name=nvfp4", "recipe.hp_layers=[5]"}, "recipe.hp_layers");
  expect_config_error({"recipe.name=nvfp4", "recipe.hp_last=3"}, "n_layers");
  expect_config_error({"recipe.override.h.0.mlp.fc.fprop=bf16"},
                      "recipe.override.h.0.mlp.fc.fprop");
  expect_config_error({"recipe.override.h.7.mlp.c_fc.fprop=bf16"}, "outside");
  expect_config_error({"recipe.override.h.0.mlp.c_fc.wgrad=fp6"}, "not one of");
  expect_config_error({"recipe.name=nvfp4", "model.d_ff=72"}, "model.d_ff");
  expect_config_error({"recipe.name=nvfp4", "recipe.gemm=fast"}, "recipe.gemm");
  expect_config_error({"recipe.name=fp8"}, "multiple of 128");  // d_model 32: the FP8 block is 128
  expect_config_error(
      {"recipe.name=fp8", "model.d_model=128", "model.d_ff=128", "recipe.four_over_six=weights"},
      "FP8");
  // fine: Four Over Six on weights with the rest of the recipe, MXFP4 without 2D
  EXPECT_NO_THROW(run_with({"recipe.name=nvfp4", "recipe.four_over_six=weights"}));
  EXPECT_NO_THROW(run_with({"recipe.name=mxfp4", "recipe.weight_2d=false"}));
}

TEST(Recipe, HighPrecisionBlocksFollowTheSection9Defaults) {
  auto count = [](const std::vector<bool>& v) { return std::count(v.begin(), v.end(), true); };
  RunConfig c = run_with({"recipe.name=nvfp4"});
  EXPECT_EQ(count(high_precision_blocks(c)), 0);  // L = 2: round(4/62) = round(16/62) = 0
  c.model.n_layers = 12;
  std::vector<bool> hp = high_precision_blocks(c);  // round(24/62) = 0, round(96/62) = 2
  EXPECT_EQ(count(hp), 2);
  EXPECT_TRUE(hp[10] && hp[11]);
  c.model.n_layers = 62;
  hp = high_precision_blocks(c);  // the paper: first 2, last 8
  EXPECT_EQ(count(hp), 10);
  EXPECT_TRUE(hp[0] && hp[1] && !hp[2] && !hp[53] && hp[54] && hp[61]);
  c.recipe.hp_first = 0;
  c.recipe.hp_last = 0;
  c.recipe.hp_layers = {7};
  hp = high_precision_blocks(c);
  EXPECT_EQ(count(hp), 1);
  EXPECT_TRUE(hp[7]);
  c.recipe.name = GemmFormat::BF16;
  EXPECT_EQ(count(high_precision_blocks(c)), 62);
}

TEST(Recipe, OverridesAndTheLateSwitchResolvePerGemm) {
  RunConfig c = run_with({"recipe.name=nvfp4", "recipe.override.h.1.mlp.c_fc.wgrad=bf16",
                          "recipe.bf16_from_step=5", "recipe.bf16_switch=forward"});
  const std::vector<bool> hp = high_precision_blocks(c);
  LinearRecipe r = resolve_linear_recipe(c, hp, 1, 2, 0);
  EXPECT_EQ(r.fprop, GemmFormat::NVFP4);
  EXPECT_EQ(r.dgrad, GemmFormat::NVFP4);
  EXPECT_EQ(r.wgrad, GemmFormat::BF16);
  r = resolve_linear_recipe(c, hp, 0, 0, 5);
  EXPECT_EQ(r.fprop, GemmFormat::BF16);
  EXPECT_EQ(r.dgrad, GemmFormat::NVFP4);
  c.recipe.bf16_switch = Bf16Switch::All;
  r = resolve_linear_recipe(c, hp, 0, 0, 5);
  EXPECT_FALSE(r.any_quantized());
  // the override survives a round trip through the saved config
  const RunConfig back =
      config_from_json(to_json(run_with({"recipe.override.h.1.mlp.c_fc.wgrad=bf16"})), {});
  EXPECT_EQ(back.recipe.override_gemms.at("h.1.mlp.c_fc.wgrad"), GemmFormat::BF16);
}

TEST(Recipe, SrStreamsAreDistinctAndFieldsChecked) {
  std::set<uint64_t> seen;
  for (int64_t step : {0, 1, 4095})
    for (int64_t layer : {0, 1, 11})
      for (int64_t lin = 0; lin < 4; ++lin)
        for (TensorRole role : {TensorRole::Activation, TensorRole::Weight, TensorRole::Gradient})
          for (int copy = 0; copy < 2; ++copy)
            EXPECT_TRUE(seen.insert(sr_stream(step, 0, layer, lin, role, copy)).second);
  EXPECT_EQ(sr_stream(3, 1, 2, 1, TensorRole::Gradient, 1),
            (uint64_t{3} << 32) | (1u << 24) | (2u << 12) | (1u << 4) | (2u << 1) | 1u);
  EXPECT_THROW(sr_stream(0, 0, 4096, 0, TensorRole::Weight, 0), std::out_of_range);
}

// The NVFP4 linear layer's three GEMMs against FP32: relative Frobenius error of each output a few
// times NVFP4's per-element error, never exact (the test fails if quantization were silently off).
TEST(Recipe, Nvfp4LinearTracksFp32) {
  auto be = make_cpu_backend();
  const int64_t N = 64, K = 64, OC = 48;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(N * K), w(OC * K), dy(N * OC), bias(OC);
  for (auto& v : x) v = nd(rng);
  for (auto& v : w) v = 0.1f * nd(rng);
  for (auto& v : dy) v = 1e-3f * nd(rng);
  for (auto& v : bias) v = nd(rng);
  RunConfig c = run_with({"recipe.name=nvfp4"});
  LinearRecipe r = resolve_linear_recipe(c, high_precision_blocks(c), 0, 0, 0);
  ASSERT_EQ(r.fprop, GemmFormat::NVFP4);
  const LinearIds ids{1, 0, 0, 0, 0};
  auto rel = [](const std::vector<float>& a, const std::vector<float>& b) {
    double e = 0, n = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      e += (a[i] - b[i]) * static_cast<double>(a[i] - b[i]);
      n += static_cast<double>(b[i]) * b[i];
    }
    return std::sqrt(e / n);
  };
  std::vector<float> y(N * OC), y32(N * OC);
  linear_forward(*be, r, ids, hv(y, N, OC), hv(x, N, K), weights(w, &bias, OC, K),
                 GemmPrecision::BF16, nullptr, "t");
  emu::matmul_forward(y32.data(), x.data(), w.data(), bias.data(), N, K, OC,
                      emu::GemmPrecision::FP32);
  std::vector<float> dx(N * K, 0.5f), dw(OC * K, 0.25f), db(OC, 0.0f), dx32(N * K, 0.5f),
      dw32(OC * K, 0.25f), db32(OC, 0.0f);
  std::vector<QuantStat> stats;
  linear_backward(*be, r, ids, hv(dx, N, K), hv(dw, OC, K), hv(db, OC, 1), hv(dy, N, OC),
                  hv(x, N, K), weights(w, nullptr, OC, K), GemmPrecision::BF16, &stats, "t");
  emu::matmul_backward(dx32.data(), dw32.data(), db32.data(), dy.data(), x.data(), w.data(), N, K,
                       OC, emu::GemmPrecision::FP32);
  // subtract the starting values so the error is that of the products, not hidden by the offsets
  // (linear_backward and emu::matmul_backward write dx; both add to dW)
  for (auto& v : dw) v -= 0.25f;
  for (auto& v : dw32) v -= 0.25f;
  const double ey = rel(y, y32), edx = rel(dx, dx32), edw = rel(dw, dw32);
  std::printf("[nvfp4-linear] relative error vs FP32: fprop %.4f dgrad %.4f wgrad %.4f\n", ey, edx,
              edw);
  for (double e : {ey, edx, edw}) {
    EXPECT_GT(e, 1e-3);  // really quantized
    EXPECT_LT(e, 0.25);  // and still the same product
  }
  EXPECT_EQ(db, db32);          // the bias gradient stays FP32, same order
  ASSERT_EQ(stats.size(), 1u);  // dy row-wise (forward stats were not asked for)
  EXPECT_EQ(stats[0].tensor, "t.dgrad.dy");
  EXPECT_GT(stats[0].rel_error, 0.0);
}

// An NVFP4 recipe with Four Over Six and one GEMM overridden to MXFP4: that GEMM runs without Four
// Over Six instead of failing in the quantizer mid-step (FP8 overrides already did).
TEST(Recipe, FourOverSixSkipsGemmsOverriddenToOtherFormats) {
  auto be = make_cpu_backend();
  const int64_t N = 32, K = 64, OC = 32;
  std::vector<float> x(N * K), w(OC * K), dy(N * OC);
  std::mt19937 rng(8);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto* v : {&x, &w, &dy})
    for (auto& e : *v) e = nd(rng);
  for (const GemmFormat format : {GemmFormat::MXFP4}) {
    const char* fmt = name_of(format);
    RunConfig c =
        run_with({"recipe.name=nvfp4", "recipe.four_over_six=all", "recipe.stochastic_rounding=off",
                  "recipe.rht=false", std::string("recipe.override.h.0.attn.c_attn.wgrad=") + fmt,
                  std::string("recipe.override.h.0.attn.c_attn.fprop=") + fmt});
    const LinearRecipe r = resolve_linear_recipe(c, high_precision_blocks(c), 0, 0, 0);
    ASSERT_EQ(r.wgrad, format);
    ASSERT_TRUE(r.fos_activations);
    const LinearIds ids{1, 0, 0, 0, 0};
    std::vector<float> y(N * OC), dx(N * K, 0.0f), dw(OC * K, 0.0f);
    std::unique_ptr<QuantizedCopy> saved;
    EXPECT_NO_THROW(linear_forward(*be, r, ids, hv(y, N, OC), hv(x, N, K),
                                   weights(w, nullptr, OC, K), GemmPrecision::BF16, nullptr, "t",
                                   &saved))
        << fmt;
    EXPECT_NO_THROW(linear_backward(*be, r, ids, hv(dx, N, K), hv(dw, OC, K), TensorView{},
                                    hv(dy, N, OC), hv(x, N, K), weights(w, nullptr, OC, K),
                                    GemmPrecision::BF16, nullptr, "t", saved.get()))
        << fmt;
    ASSERT_TRUE(saved);
    EXPECT_FALSE(saved->view.four_over_six) << fmt;
  }
}

// linear_backward writes dx (whatever dx held before: here NaN) and adds to dW and db, for a
// quantized Dgrad (beta-0 GEMM) and a BF16 one (Backend::matmul_backward, which writes dinp too).
TEST(Recipe, LinearBackwardWritesDinpAndAccumulatesWeightGradients) {
  auto be = make_cpu_backend();
  const int64_t N = 32, K = 64, OC = 48;
  std::mt19937 rng(12);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(N * K), w(OC * K), dy(N * OC);
  for (auto* v : {&x, &w, &dy})
    for (auto& e : *v) e = nd(rng);
  for (const GemmFormat recipe : {GemmFormat::NVFP4, GemmFormat::BF16}) {
    RunConfig c = run_with({std::string("recipe.name=") + name_of(recipe)});
    const LinearRecipe r = resolve_linear_recipe(c, high_precision_blocks(c), 0, 0, 5);
    ASSERT_EQ(r.dgrad, recipe);
    const LinearIds ids{1, 0, 0, 0, 0};
    auto run = [&](float dx0, float dw0) {
      std::vector<float> y(N * OC), dx(N * K, dx0), dw(OC * K, dw0), db(OC, dw0);
      linear_forward(*be, r, ids, hv(y, N, OC), hv(x, N, K), weights(w, nullptr, OC, K),
                     GemmPrecision::BF16, nullptr, "t");
      linear_backward(*be, r, ids, hv(dx, N, K), hv(dw, OC, K), hv(db, OC, 1), hv(dy, N, OC),
                      hv(x, N, K), weights(w, nullptr, OC, K), GemmPrecision::BF16, nullptr, "t");
      return std::make_tuple(dx, dw, db);
    };
    const auto [dx_a, dw_a, db_a] = run(0.0f, 0.0f);
    const auto [dx_b, dw_b, db_b] = run(std::numeric_limits<float>::quiet_NaN(), 1.0f);
    EXPECT_EQ(0, std::memcmp(dx_a.data(), dx_b.data(), dx_a.size() * 4))
        << name_of(recipe) << ": dx must be written";
    for (size_t i = 0; i < dw_a.size(); ++i)
      ASSERT_EQ(dw_b[i], 1.0f + dw_a[i]) << name_of(recipe) << ": dW must accumulate";
    for (size_t i = 0; i < db_a.size(); ++i)
      ASSERT_EQ(db_b[i], 1.0f + db_a[i]) << name_of(recipe) << ": db must accumulate";
  }
}

// The emulator fusing as the CUDA backend does: quantize_activation and matmul_backward_activation
// never write src.out (the op's output goes to a scratch of their own), so a read of the pending
// buffer after those calls sees the caller's fill; matmul_forward_activation is counted.
class FusingCpuBackend : public emu::CpuBackend {
 public:
  void quantize_activation(const ActivationSource& src, const QuantizeConfig& cfg,
                           QuantizedView* rowwise, QuantizedView* columnwise,
                           const TensorView& dbias) override {
    std::vector<float> own;
    CpuBackend::quantize_activation(elsewhere(src, own), cfg, rowwise, columnwise, dbias);
    if (src.op != ActivationOp::Identity) ++fused_quantize;  // (Identity: quantize + dbias)
  }
  void matmul_forward_activation(const TensorView& out, const ActivationSource& src,
                                 const TensorView& weight, const TensorView& bias,
                                 GemmPrecision prec) override {
    CpuBackend::matmul_forward_activation(out, src, weight, bias, prec);
    ++fused_matmul;
  }
  void matmul_backward_activation(const TensorView& dinp, const TensorView& dweight,
                                  const TensorView& dbias, const ActivationSource& src,
                                  const TensorView& inp, const TensorView& weight,
                                  GemmPrecision prec) override {
    std::vector<float> own;
    CpuBackend::matmul_backward_activation(dinp, dweight, dbias, elsewhere(src, own), inp, weight,
                                           prec);
    ++fused_matmul;
  }
  int fused_quantize = 0, fused_matmul = 0;

 private:
  // src with its output in `own` (as many bytes as src.out's, same dtype and mark)
  static ActivationSource elsewhere(const ActivationSource& src, std::vector<float>& own) {
    if (src.op == ActivationOp::Identity) return src;
    own.assign(static_cast<size_t>(src.out.numel()), 0.0f);
    ActivationSource s = src;
    s.out.data = own.data();
    return s;
  }
};

// FusingCpuBackend that also poisons: where it leaves src.out unwritten it fills it with NaN, so a
// read of that buffer anywhere later in the step (not only in the linear layer) turns the loss or
// a gradient into NaN.
class PoisoningCpuBackend : public FusingCpuBackend {
 public:
  void quantize_activation(const ActivationSource& src, const QuantizeConfig& cfg,
                           QuantizedView* rowwise, QuantizedView* columnwise,
                           const TensorView& dbias) override {
    FusingCpuBackend::quantize_activation(src, cfg, rowwise, columnwise, dbias);
    poison(src);
  }
  void matmul_backward_activation(const TensorView& dinp, const TensorView& dweight,
                                  const TensorView& dbias, const ActivationSource& src,
                                  const TensorView& inp, const TensorView& weight,
                                  GemmPrecision prec) override {
    FusingCpuBackend::matmul_backward_activation(dinp, dweight, dbias, src, inp, weight, prec);
    poison(src);
  }

 private:
  static void poison(const ActivationSource& src) {
    if (src.op == ActivationOp::Identity) return;
    if (src.out.dtype == DType::BF16)
      std::fill(src.out.as<uint16_t>(), src.out.as<uint16_t>() + src.out.numel(), uint16_t{0x7FC0});
    else
      std::fill(src.out.as<float>(), src.out.as<float>() + src.out.numel(),
                std::numeric_limits<float>::quiet_NaN());
  }
};

// A pending activation (linear_forward's pending_input, linear_backward's pending_dout: GELU's
// output or gradient, not yet computed) gives the layer the bits of running the op first and
// passing its output, whether the layer hands it to one combined quantize call
// (Backend::quantize_activation, here one that never writes the op's output, as the CUDA
// backend's) or runs it itself (a BF16 GEMM, copies of different formats, or statistics that read
// x): the output, dx, dW and db. The buffers the op would write start as NaN, so any read of them
// that the op did not precede shows.
TEST(Recipe, PendingActivationEqualsRunningItFirst) {
  FusingCpuBackend fusing;
  emu::CpuBackend plain;
  const int64_t N = 128, K = 128, OC = 128;
  std::mt19937 rng(21);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> pre(N * K), w(OC * K), bias(OC), fc(N * OC), dact(N * OC);
  for (auto* v : {&pre, &w, &bias, &fc, &dact})
    for (auto& e : *v) e = nd(rng);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    const char* recipe;
    std::vector<std::string> extra;
    int fused_quantize;  // quantize_activation calls expected without statistics (with them: none)
    int fused_matmul;  // matmul_*_activation calls expected (statistics do not matter: BF16 GEMMs)
  };
  const std::string ov = "recipe.override.h.0.mlp.c_proj.";
  const Case cases[] = {
      {"fp8", {}, 2, 0},
      {"nvfp4", {}, 2, 0},
      {"bf16", {}, 0, 2},
      {"nvfp4", {ov + "wgrad=mxfp4"}, 0, 0},  // copies of two formats: the op runs first
      {"nvfp4", {ov + "fprop=bf16"}, 1, 0},   // forward runs the op, backward fuses
      {"fp8", {ov + "dgrad=bf16"}, 1, 0},     // the reverse
      {"fp8", {ov + "dgrad=bf16", ov + "wgrad=bf16"}, 0, 1}};  // a BF16 backward pass
  for (const Case& k : cases)
    for (bool stats : {false, true}) {
      std::vector<std::string> o = {std::string("recipe.name=") + k.recipe, "model.d_model=128",
                                    "model.d_ff=128", "train.batch=8"};
      o.insert(o.end(), k.extra.begin(), k.extra.end());
      RunConfig c = run_with(o);
      const LinearRecipe r = resolve_linear_recipe(c, high_precision_blocks(c), 0, 3, 5);
      const LinearIds ids{1, 4, 0, 0, 3};
      std::string what = k.recipe;
      for (const std::string& e : k.extra) what += " " + e;
      what += stats ? " with statistics" : "";
      SCOPED_TRACE(what);
      auto run = [&](Backend& be, bool pending) {
        std::vector<float> act(N * K, nan), dfc(N * OC, nan), y(N * OC), dx(N * K),
            dw(OC * K, 0.5f), db(OC, 0.25f);
        ActivationSource fwd, bwd;
        fwd.op = ActivationOp::GeluForward;
        fwd.inp = hv(pre, N, K, false, "pre");
        fwd.out = hv(act, N, K, true, "act");
        bwd.op = ActivationOp::GeluBackward;
        bwd.inp = hv(fc, N, OC, false, "fc");
        bwd.dout = hv(dact, N, OC, true, "dact");
        bwd.out = hv(dfc, N, OC, true, "dfc");
        if (!pending) {
          run_activation(be, fwd);
          run_activation(be, bwd);
        }
        std::vector<QuantStat> st;
        std::unique_ptr<QuantizedCopy> saved_x, saved_w;
        linear_forward(be, r, ids, hv(y, N, OC, true), hv(act, N, K), weights(w, &bias, OC, K),
                       GemmPrecision::BF16, stats ? &st : nullptr, "t", &saved_x, &saved_w,
                       pending ? &fwd : nullptr);
        // (the model passes the input only where the Wgrad GEMM is BF16: linear_input)
        linear_backward(be, r, ids, hv(dx, N, K), hv(dw, OC, K), hv(db, OC, 1), hv(dfc, N, OC),
                        r.wgrad == GemmFormat::BF16 ? hv(act, N, K) : TensorView{},
                        weights(w, nullptr, OC, K), GemmPrecision::BF16, stats ? &st : nullptr, "t",
                        saved_x.get(), saved_w.get(), pending ? &bwd : nullptr);
        return std::make_tuple(y, dx, dw, db);
      };
      const auto [y_a, dx_a, dw_a, db_a] = run(plain, false);
      const int before_q = fusing.fused_quantize, before_m = fusing.fused_matmul;
      const auto [y_b, dx_b, dw_b, db_b] = run(fusing, true);
      EXPECT_EQ(fusing.fused_quantize - before_q, stats ? 0 : k.fused_quantize)
          << "quantize_activation calls";
      EXPECT_EQ(fusing.fused_matmul - before_m, k.fused_matmul) << "matmul_*_activation calls";
      EXPECT_FALSE(std::isnan(y_a[0]) || std::isnan(dx_a[0]) || std::isnan(dw_a[0]) ||
                   std::isnan(db_a[0]));
      EXPECT_EQ(0, std::memcmp(y_a.data(), y_b.data(), y_a.size() * 4)) << "output";
      EXPECT_EQ(0, std::memcmp(dx_a.data(), dx_b.data(), dx_a.size() * 4)) << "dx";
      EXPECT_EQ(0, std::memcmp(dw_a.data(), dw_b.data(), dw_a.size() * 4)) << "dW";
      EXPECT_EQ(0, std::memcmp(db_a.data(), db_b.data(), db_a.size() * 4)) << "db";
    }
}

// The whole model's step with the activations fused as the CUDA backend fuses them (and the
// buffers a fused call leaves unwritten filled with NaN) == the emulator's plain step, bit for bit:
// the loss and every parameter gradient, over two steps (the second reads buffers the first left
// behind), for each recipe; the fused calls really happened.
TEST(Recipe, ModelStepWithFusedActivationsEqualsPlainStep) {
  for (const char* recipe : {"fp8", "nvfp4", "bf16"}) {
    SCOPED_TRACE(recipe);
    const RunConfig c =
        run_with({std::string("recipe.name=") + recipe, "model.d_model=128", "model.d_ff=256",
                  "model.seq_len=64", "model.max_positions=64", "train.batch=2"});
    PoisoningCpuBackend fusing;
    emu::CpuBackend plain;
    const std::vector<float> a = model_steps(plain, c, 2, 64), b = model_steps(fusing, c, 2, 64);
    if (c.recipe.name == GemmFormat::BF16)
      EXPECT_GT(fusing.fused_matmul, 0) << "no fused BF16 matmul call happened";
    else
      EXPECT_GT(fusing.fused_quantize, 0) << "no fused quantize call happened";
    ASSERT_EQ(a.size(), b.size());
    const size_t step2 = a.size() / 2;  // [loss, gradients..., loss, gradients...]
    for (size_t i : {size_t{0}, step2}) {
      EXPECT_FALSE(std::isnan(a[i]));
      EXPECT_EQ(test_bits(a[i]), test_bits(b[i])) << "loss of step " << (i ? 2 : 1);
    }
    size_t differ = 0;
    for (size_t i = 0; i < a.size(); ++i) differ += test_bits(a[i]) != test_bits(b[i]);
    EXPECT_EQ(differ, 0u) << "values (losses and gradients) that differ, of " << a.size();
  }
}

// BF16 activations kept as BF16 bits (Gpt::set_bf16_bits_storage: the linears' inputs, qkv, the
// attention output, through the Backend's *_bf16 ops and quantizers reading BF16) give the bits of
// the FP32 arrays holding the same values: losses and every gradient over 2 steps, for GPT-2's
// layer (GELU, LayerNorm, learned positions), a Llama-style one (SwiGLU, RMSNorm, RoPE: qkv stays
// FP32), NVFP4 with a BF16 high-precision block, FP8, and NVFP4 with single GEMMs overridden to
// BF16 (mixed linears); statistics on step 2 (quantized linears then keep FP32 inputs).
TEST(Recipe, Bf16BitsStorageEqualsFp32Arrays) {
  const std::vector<std::vector<std::string>> cases = {
      {"recipe.name=bf16"},
      {"recipe.name=bf16", "model.activation=swiglu", "model.norm=rmsnorm", "model.positions=rope",
       "model.n_kv_heads=2", "model.bias=false", "model.tied_embeddings=false"},
      {"recipe.name=nvfp4", "model.n_layers=3", "recipe.hp_first=1", "recipe.hp_last=0"},
      {"recipe.name=fp8"},
      {"recipe.name=nvfp4", "recipe.override.h.0.attn.c_attn.wgrad=bf16",
       "recipe.override.h.1.mlp.c_fc.fprop=bf16"},
  };
  for (const auto& ov : cases) {
    SCOPED_TRACE(ov.size() > 1 ? ov[1] : ov[0]);
    std::vector<std::string> all = {"model.d_model=128", "model.d_ff=256", "model.seq_len=64",
                                    "model.max_positions=64", "train.batch=2"};
    all.insert(all.end(), ov.begin(), ov.end());
    const RunConfig c = run_with(all);
    emu::CpuBackend be;
    auto steps = [&](bool bits) {  // (and the bytes kept: the bits storage must keep fewer)
      size_t bytes = 0;
      std::vector<float> out = model_steps(
          be, c, 2, 64, [&](Gpt& m) { m.set_bf16_bits_storage(bits); }, 2, 1, &bytes);
      return std::make_pair(out, bytes);
    };
    const auto [plain, plain_bytes] = steps(false);
    const auto [bits, bits_bytes] = steps(true);
    ASSERT_EQ(plain.size(), bits.size());
    EXPECT_FALSE(std::isnan(plain[0]));
    size_t differ = 0;
    for (size_t i = 0; i < plain.size(); ++i) differ += test_bits(plain[i]) != test_bits(bits[i]);
    EXPECT_EQ(differ, 0u) << "values that differ, of " << plain.size();
    EXPECT_LT(bits_bytes, plain_bytes) << "BF16 bits must keep fewer activation bytes";
  }
}

// Under weight_2d the Dgrad weight (column-wise copy) is exactly the transpose of the Fprop weight.
TEST(Recipe, Weight2dDgradCopyIsTheExactTranspose) {
  auto be = make_cpu_backend();
  const int64_t OC = 48, K = 64;
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> w(OC * K);
  for (auto& v : w) v = nd(rng) * (1.0f + 10.0f * static_cast<float>(rng() % 3));
  TensorView tv;
  tv.data = w.data();
  tv.rows = OC;
  tv.cols = K;
  QuantizeConfig row, col;
  row.block_2d = col.block_2d = true;
  row.rowwise.enabled = true;
  col.columnwise.enabled = true;
  const QuantizedHost fw =
      quantize_to_host(*be, tv, row).rowwise;  // separate calls, as the layer does
  QuantizedHost dw = quantize_to_host(*be, tv, col).columnwise;
  QuantizedHost fwc = fw;
  const std::vector<float> a = dequantize_to_host(*be, fwc), b = dequantize_to_host(*be, dw);
  for (int64_t o = 0; o < OC; ++o)
    for (int64_t k = 0; k < K; ++k) {
      uint32_t x, y;
      std::memcpy(&x, &a[o * K + k], 4);
      std::memcpy(&y, &b[k * OC + o], 4);
      ASSERT_EQ(x, y) << "(" << o << "," << k << ")";
    }
}

TEST(Recipe, Nvfp4TrainingResumesBitwise) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("fp4sim_recipe_" + std::to_string(::getpid())))
          .string();
  std::filesystem::remove_all(dir);
  TrainOptions quiet;
  quiet.print = false;
  auto cfg = [&](const std::string& out) {
    return run_with({"recipe.name=nvfp4", "recipe.stats_every=3", "train.out_dir=" + out});
  };
  const TrainResult full = train(cfg(dir + "/full"), quiet, *make_cpu_backend());
  TrainOptions resume = quiet;
  resume.resume = dir + "/full/checkpoints/step_00000005";
  const TrainResult cont = train(cfg(dir + "/cont"), resume, *make_cpu_backend());
  ASSERT_EQ(cont.steps.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    uint32_t a, b;
    std::memcpy(&a, &cont.steps[i].loss, 4);
    std::memcpy(&b, &full.steps[5 + i].loss, 4);
    EXPECT_EQ(a, b) << "step " << cont.steps[i].step;
  }
  // and NVFP4 is really on: the losses differ from the BF16 run's
  const TrainResult bf16 =
      train(run_with({"train.out_dir=" + dir + "/bf16"}), quiet, *make_cpu_backend());
  EXPECT_NE(bf16.steps.back().loss, full.steps.back().loss);
  EXPECT_NEAR(bf16.steps.back().loss, full.steps.back().loss, 0.05 * bf16.steps.back().loss);
  std::filesystem::remove_all(dir);
}

// The quantization statistics only read: a run that logs them every step trains bit for bit like
// one that does not (NVFP4 with SR and RHT, and FP8), and the log carries them.
TEST(Recipe, StatisticsDoNotChangeTraining) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("fp4sim_stats_" + std::to_string(::getpid())))
          .string();
  std::filesystem::remove_all(dir);
  TrainOptions quiet;
  quiet.print = false;
  for (const GemmFormat format : {GemmFormat::NVFP4, GemmFormat::FP8}) {
    const std::string recipe = name_of(format);
    auto cfg = [&](int every) {
      std::vector<std::string> o = {"recipe.name=" + recipe,
                                    "recipe.stats_every=" + std::to_string(every), "train.steps=4",
                                    "train.checkpoint_every=0",
                                    "train.out_dir=" + dir + "/" + recipe + std::to_string(every)};
      if (format == GemmFormat::FP8)  // FP8's 128-element blocks: d 128, 128 tokens a batch
        o.insert(o.end(), {"model.d_model=128", "model.d_ff=256", "train.batch=8"});
      return run_with(o);
    };
    const TrainResult with = train(cfg(1), quiet, *make_cpu_backend());
    const TrainResult without = train(cfg(0), quiet, *make_cpu_backend());
    ASSERT_EQ(with.steps.size(), without.steps.size());
    for (size_t i = 0; i < with.steps.size(); ++i) {
      EXPECT_EQ(with.steps[i].loss, without.steps[i].loss) << recipe << " step " << i + 1;
      EXPECT_EQ(with.steps[i].grad_norm, without.steps[i].grad_norm) << recipe << " step " << i + 1;
    }
    std::ifstream log(dir + "/" + recipe + "1/log.jsonl");
    std::string line;
    int with_stats = 0;
    while (std::getline(log, line)) with_stats += line.find("\"quant_stats\"") != std::string::npos;
    EXPECT_EQ(with_stats, 4) << recipe;
  }
  std::filesystem::remove_all(dir);
}

// Saved activations in quantized form (DESIGN.md §9): with quantized Wgrad GEMMs the layers keep
// their inputs' Wgrad copies (4 or 8 bits plus scales) instead of the FP32 inputs (BF16 with the
// inputs in FP32 arrays; with BF16 bits storage, the default, BF16 keeps 2 bytes an input value).
TEST(Recipe, QuantizedWgradKeepsLessActivationMemory) {
  auto bytes = [](const std::vector<std::string>& o, bool bits = false) {
    RunConfig c = run_with(o);
    auto be = make_cpu_backend();
    Gpt m(c.model, *be);
    m.init(1);
    m.set_recipe(c);
    m.set_bf16_bits_storage(bits);
    const int64_t B = 2, T = 16;
    std::vector<int32_t> tok(B * T, 3), tgt(B * T, 5);
    m.forward(tok.data(), tgt.data(), B, T);
    m.backward();
    return m.saved_activation_bytes();
  };
  const size_t bf16 = bytes({}), nvfp4 = bytes({"recipe.name=nvfp4"}),
               mx = bytes({"recipe.name=mxfp4", "recipe.weight_2d=false"});
  std::printf(
      "[recipe] saved activation bytes: bf16 %zu (with BF16 bits storage %zu), nvfp4 %zu (%.1f%%), "
      "mxfp4 %zu\n",
      bf16, bytes({}, true), nvfp4, 100.0 * static_cast<double>(nvfp4) / static_cast<double>(bf16),
      mx);
  EXPECT_LT(nvfp4, bf16);
  EXPECT_LT(mx, bf16);
}

// The late switch to BF16 mid-run: the layers start keeping FP32 inputs again, and a resume across
// the switch is still bit for bit.
TEST(Recipe, LateSwitchToBf16ResumesBitwise) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("fp4sim_switch_" + std::to_string(::getpid())))
          .string();
  std::filesystem::remove_all(dir);
  TrainOptions quiet;
  quiet.print = false;
  auto cfg = [&](const std::string& out) {
    return run_with({"recipe.name=nvfp4", "recipe.bf16_from_step=4", "recipe.bf16_switch=all",
                     "train.out_dir=" + out});
  };
  const TrainResult full = train(cfg(dir + "/full"), quiet, *make_cpu_backend());
  TrainOptions resume = quiet;
  resume.resume = dir + "/full/checkpoints/step_00000005";
  const TrainResult cont = train(cfg(dir + "/cont"), resume, *make_cpu_backend());
  ASSERT_EQ(cont.steps.size(), 5u);
  for (size_t i = 0; i < 5; ++i)
    EXPECT_EQ(test_bits(cont.steps[i].loss), test_bits(full.steps[5 + i].loss));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace fp4sim::model
