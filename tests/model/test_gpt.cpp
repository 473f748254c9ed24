// The transformer: whole-model gradients against finite differences (FP32 GEMMs), and a short
// training run whose loss must fall (emulated BF16 GEMMs, AdamW).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>

#include "emu/optim.hpp"
#include "model/gpt.hpp"

namespace fp4sim::model {
namespace {

ModelConfig micro(Positions positions, NormKind norm, Activation act, bool tied, int64_t kv) {
  ModelConfig m;
  m.vocab = 16;
  m.seq_len = 8;
  m.max_positions = 8;
  m.d_model = 16;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = kv;
  m.d_ff = 32;
  m.positions = positions;
  m.norm = norm;
  m.activation = act;
  m.tied_embeddings = tied;
  // finite differences need FP32 activations; BF16 storage is tested below
  m.activation_dtype = ActivationStorage::FP32;
  return m;
}

// Central differences (step 1e-3) of the model's loss on (tok, tgt) against the gradients of its
// last backward pass, for every element of the tensors `every` names and about five elements of the
// others; each within 5% relative (floor 1e-2). With richardson, an element that misses is
// estimated again from steps h and h/2 (the extrapolation cancels the h^2 term: strongly curved
// directions). Returns the worst error and the count checked through *worst, *checked.
void expect_finite_differences(Gpt& model, const std::vector<int32_t>& tok,
                               const std::vector<int32_t>& tgt, int64_t B, int64_t T,
                               const std::function<bool(const std::string&)>& every,
                               bool richardson, const std::string& what, double* worst,
                               int* checked) {
  const std::vector<float> grad = model.grads_to_host();
  float* const params = model.params();  // host memory on the emulator
  *worst = 0;
  *checked = 0;
  for (const ParamTensor& t : model.tensors()) {
    const bool all = every && every(t.name);
    for (int64_t i = 0; i < t.numel(); i += all ? 1 : 1 + t.numel() / 5) {
      float& x = params[t.offset + static_cast<size_t>(i)];
      const float keep = x;
      auto central = [&](float h) {
        x = keep + h;
        const double up = model.forward(tok.data(), tgt.data(), B, T);
        x = keep - h;
        const double dn = model.forward(tok.data(), tgt.data(), B, T);
        x = keep;
        return (up - dn) / (2.0 * static_cast<double>(h));
      };
      const double an = grad[t.offset + static_cast<size_t>(i)];
      auto rel = [&](double fd) {
        return std::fabs(fd - an) / std::max(1e-2, std::fabs(fd) + std::fabs(an));
      };
      double fd = central(1e-3f);
      if (richardson && rel(fd) > 0.05) fd = (4.0 * central(5e-4f) - fd) / 3.0;
      const double err = rel(fd);
      if (err > *worst) *worst = err;
      EXPECT_LT(err, 0.05) << what << " " << t.name << "[" << i << "]: fd " << fd << " analytic "
                           << an;
      ++*checked;
    }
  }
}

// `steps` steps on one batch of 4 x 8 tokens of a deterministic pattern (next token = (token * 3 +
// 1) mod 16), each forward, backward and AdamW (lr 1e-2, no weight decay: the optimizer through
// the backend, as the trainer does), set_step before each; *first, *last: the first and last
// step's loss.
void train_next_token_pattern(Gpt& model, Backend& be, int steps, float* first, float* last) {
  const int64_t B = 4, T = 8;
  std::vector<int32_t> tok(B * T), tgt(B * T);
  for (int64_t i = 0; i < B * T; ++i) {
    tok[i] = static_cast<int32_t>((i * 5 + i / T) % 16);
    tgt[i] = (tok[i] * 3 + 1) % 16;
  }
  std::vector<float> mom(model.num_params(), 0.0f), var(model.num_params(), 0.0f);
  for (int step = 1; step <= steps; ++step) {
    model.set_step(step - 1);
    const float loss = model.forward(tok.data(), tgt.data(), B, T);
    if (step == 1) *first = loss;
    *last = loss;
    model.backward();
    const AdamWStep s = make_adamw_step(1e-2f, 0.9f, 0.95f, 1e-8f, 0.0f, step, 1.0f);
    const int64_t n = static_cast<int64_t>(model.num_params());
    be.adamw_update(host_view(model.params(), 1, n), TensorView{}, host_view(model.grads(), 1, n),
                    host_view(mom.data(), 1, n), host_view(var.data(), 1, n), {{0, n}}, {s});
  }
}

TEST(Gpt, GradientsMatchFiniteDifferences) {
  struct Variant {
    Positions pos;
    NormKind norm;
    Activation act;
    bool tied;
    int64_t kv;
  };
  for (const Variant& v :
       {Variant{Positions::Learned, NormKind::LayerNorm, Activation::GeluTanh, true, 4},
        Variant{Positions::Rope, NormKind::RMSNorm, Activation::SquaredRelu, false, 2},
        Variant{Positions::Rope, NormKind::RMSNorm, Activation::SwiGLU, true, 1}}) {
    auto be = make_cpu_backend();
    Gpt model(micro(v.pos, v.norm, v.act, v.tied, v.kv), *be);
    model.set_gemm_precision(emu::GemmPrecision::FP32);
    model.init(7);
    // larger weights than the default init so every path carries signal
    float* const params = model.params();  // host memory on the emulator
    for (size_t i = 0; i < model.num_params(); ++i) params[i] *= 5.0f;
    const int64_t B = 2, T = 8;
    std::mt19937 rng(1);
    std::vector<int32_t> tok(B * T), tgt(B * T);
    for (auto& t : tok) t = static_cast<int32_t>(rng() % 16);
    for (auto& t : tgt) t = static_cast<int32_t>(rng() % 16);
    model.forward(tok.data(), tgt.data(), B, T);
    model.backward();
    double worst = 0;
    int checked = 0;
    expect_finite_differences(model, tok, tgt, B, T, {}, false,
                              std::string(name_of(v.pos)) + "/" + name_of(v.norm), &worst,
                              &checked);
    EXPECT_GT(checked, 100);
    std::printf("[gpt-grad] %s %s %s: %d parameters checked, worst relative error %.2e\n",
                name_of(v.pos), name_of(v.norm), name_of(v.act), checked, worst);
  }
}

// A hybrid (DESIGN.md §11-§12): Mamba-2, attention and MLP blocks, Nemotron-H conventions
// (RMSNorm, squared ReLU, no biases, no position embeddings, untied head, GQA), small enough for
// finite differences over every element of every Mamba-2 parameter tensor (the others sampled).
ModelConfig micro_hybrid(const std::string& pattern) {
  ModelConfig m = micro(Positions::None, NormKind::RMSNorm, Activation::SquaredRelu, false, 2);
  m.bias = false;
  m.pattern = pattern;
  m.n_layers = static_cast<int64_t>(pattern.size());
  m.mamba_expand = 2;    // d_inner 32
  m.mamba_head_dim = 8;  // 4 heads
  m.mamba_groups = 2;
  m.mamba_state = 4;
  m.mamba_conv = 4;
  m.mamba_chunk = 3;  // chunks 3, 3, 2 of T = 8
  return m;
}

TEST(Gpt, HybridGradientsMatchFiniteDifferences) {
  auto be = make_cpu_backend();
  Gpt model(micro_hybrid("M-*M"), *be);
  EXPECT_EQ(model.pattern(), "M-*M");
  EXPECT_EQ(static_cast<size_t>(parameter_count(model.config())), model.num_params());
  model.set_gemm_precision(emu::GemmPrecision::FP32);
  model.init(7);
  float* const params = model.params();
  for (const ParamTensor& t : model.tensors()) {  // larger weights: every path carries signal
    const bool ssm =
        t.name.find(".mamba.") != std::string::npos && t.name.find("_proj") == std::string::npos;
    if (!ssm)
      for (int64_t i = 0; i < t.numel(); ++i) params[t.offset + static_cast<size_t>(i)] *= 5.0f;
  }
  const int64_t B = 2, T = 8;
  std::mt19937 rng(1);
  std::vector<int32_t> tok(B * T), tgt(B * T);
  for (auto& t : tok) t = static_cast<int32_t>(rng() % 16);
  for (auto& t : tgt) t = static_cast<int32_t>(rng() % 16);
  model.forward(tok.data(), tgt.data(), B, T);
  model.backward();
  double worst = 0;
  int checked = 0;
  // every element of every Mamba tensor and of wte; a strongly curved direction (the weights are
  // 5x the init) may need the extrapolated estimate
  expect_finite_differences(
      model, tok, tgt, B, T,
      [](const std::string& n) { return n.find(".mamba.") != std::string::npos || n == "wte"; },
      true, "M-*M", &worst, &checked);
  EXPECT_GT(checked, 1000);
  std::printf("[hybrid-grad] M-*M: %d parameters checked, worst relative error %.2e\n", checked,
              worst);
}

// The hybrid trains (BF16 storage, emulated BF16 GEMMs), and under nvfp4 with its Mamba linears
// quantized (every GEMM of blocks 1..2 under hp_first 0, hp_last 1).
TEST(Gpt, HybridTrains) {
  for (const GemmFormat f : {GemmFormat::BF16, GemmFormat::NVFP4}) {
    ModelConfig m = micro_hybrid("M*M-");
    m.activation_dtype = ActivationStorage::BF16;
    m.d_model = 32;  // d_inner 64, 16 heads of 4: the NVFP4 blocks of 16 fit
    m.mamba_head_dim = 4;
    m.mamba_state = 8;  // G*N 16
    m.d_ff = 64;
    auto be = make_cpu_backend();
    Gpt model(m, *be);
    RunConfig run;
    run.model = m;
    run.train.batch = 4;
    run.recipe.name = f;
    run.recipe.hp_first = 0;
    run.recipe.hp_last = 1;
    validate(run);
    model.set_recipe(run);
    if (f == GemmFormat::NVFP4) {
      EXPECT_NE(model.describe_recipe().find("mamba.in_proj nvfp4/nvfp4/nvfp4"), std::string::npos)
          << model.describe_recipe();
    }
    model.init(3);
    float first = 0, last = 0;
    train_next_token_pattern(model, *be, 60, &first, &last);
    std::printf("[hybrid-train] %s: loss %.4f -> %.4f over 60 steps\n", name_of(f), first, last);
    EXPECT_NEAR(first, std::log(16.0f), 0.2);
    EXPECT_LT(last, 0.35f * first);
  }
}

TEST(Gpt, ShortTrainingRunLowersTheLoss) {
  ModelConfig m = micro(Positions::Learned, NormKind::LayerNorm, Activation::GeluTanh, true, 4);
  m.activation_dtype = ActivationStorage::BF16;  // the default storage (DESIGN.md §9)
  auto be = make_cpu_backend();
  Gpt model(m, *be);
  model.init(3);
  float first = 0, last = 0;
  train_next_token_pattern(model, *be, 60, &first, &last);
  std::printf("[gpt-train] loss %.4f -> %.4f over 60 steps\n", first, last);
  EXPECT_NEAR(first, std::log(16.0f), 0.1);  // an untrained model is close to uniform
  EXPECT_LT(last, 0.25f * first);
}

// model.pattern (DESIGN.md §11): "*-*-" is the 2-layer preset's computation under other names
// (blocks.<i>.norm, blocks.<i>.attn.*, blocks.<i>.mlp.*), so the BF16 recipe (no SR stream, whose
// layer field counts blocks here) gives the same loss and gradients bit for bit; an irregular
// pattern builds, counts its parameters as parameter_count does, and trains.
TEST(Gpt, PatternBlocksMatchThePresetLayout) {
  ModelConfig preset = micro(Positions::Rope, NormKind::RMSNorm, Activation::SquaredRelu, false, 2);
  preset.activation_dtype = ActivationStorage::BF16;
  ModelConfig blocks = preset;
  blocks.pattern = "*-*-";
  blocks.n_layers = 4;
  auto be = make_cpu_backend();
  Gpt a(preset, *be), b(blocks, *be);
  ASSERT_EQ(a.num_params(), b.num_params());
  EXPECT_EQ(b.pattern(), "*-*-");
  EXPECT_EQ(static_cast<size_t>(parameter_count(blocks)), b.num_params());
  EXPECT_NO_THROW(b.tensor("blocks.1.norm.weight"));
  EXPECT_NO_THROW(b.tensor("blocks.3.mlp.c_proj.weight"));
  EXPECT_THROW(b.tensor("blocks.1.attn.c_attn.weight"), std::out_of_range);
  a.init(5);
  b.init(5);
  ASSERT_EQ(a.params_to_host(), b.params_to_host());  // (the tensors come in the same order)
  std::vector<int32_t> tok, tgt;
  for (int64_t i = 0; i < 16; ++i) {
    tok.push_back(static_cast<int32_t>((i * 7) % 16));
    tgt.push_back(static_cast<int32_t>((i * 3 + 1) % 16));
  }
  const float la = a.forward(tok.data(), tgt.data(), 2, 8),
              lb = b.forward(tok.data(), tgt.data(), 2, 8);
  EXPECT_EQ(la, lb);
  a.backward();
  b.backward();
  EXPECT_EQ(a.grads_to_host(), b.grads_to_host());

  ModelConfig odd = preset;
  odd.pattern = "-**--";
  odd.n_layers = 5;
  Gpt c(odd, *be);
  EXPECT_EQ(static_cast<size_t>(parameter_count(odd)), c.num_params());
  c.init(2);
  const float first = c.forward(tok.data(), tgt.data(), 2, 8);
  c.backward();
  std::vector<float> mom(c.num_params(), 0.0f), var(c.num_params(), 0.0f);
  float last = first;
  for (int step = 1; step <= 30; ++step) {
    last = c.forward(tok.data(), tgt.data(), 2, 8);
    c.backward();
    const AdamWStep s = make_adamw_step(1e-2f, 0.9f, 0.95f, 1e-8f, 0.0f, step, 1.0f);
    const int64_t n = static_cast<int64_t>(c.num_params());
    be->adamw_update(host_view(c.params(), 1, n), TensorView{}, host_view(c.grads(), 1, n),
                     host_view(mom.data(), 1, n), host_view(var.data(), 1, n), {{0, n}}, {s});
  }
  std::printf("[gpt-pattern] -**--: loss %.4f -> %.4f over 30 steps\n", first, last);
  EXPECT_LT(last, 0.5f * first);
}

// n tokens and targets over the 16-token vocabulary of micro(): (i * a) % 16 and (i * 3 + c) % 16.
void pattern_batch(int64_t n, int a, int c, std::vector<int32_t>& tok, std::vector<int32_t>& tgt) {
  tok.resize(static_cast<size_t>(n));
  tgt.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    tok[static_cast<size_t>(i)] = static_cast<int32_t>((i * a) % 16);
    tgt[static_cast<size_t>(i)] = static_cast<int32_t>((i * 3 + c) % 16);
  }
}

// BF16 storage of activations: every stored activation is a BF16 value, the loss stays close to
// the FP32-storage loss, and differs from it (the rounding is really applied).
TEST(Gpt, Bf16ActivationStorage) {
  ModelConfig m = micro(Positions::Rope, NormKind::RMSNorm, Activation::SwiGLU, false, 2);
  auto be = make_cpu_backend();
  const int64_t B = 2, T = 8;
  std::vector<int32_t> tok, tgt;
  pattern_batch(B * T, 7, 1, tok, tgt);
  Gpt f32(m, *be);
  f32.init(5);
  m.activation_dtype = ActivationStorage::BF16;
  Gpt b16(m, *be);
  b16.init(5);
  const float l32 = f32.forward(tok.data(), tgt.data(), B, T),
              l16 = b16.forward(tok.data(), tgt.data(), B, T);
  EXPECT_NE(l32, l16);
  EXPECT_NEAR(l16, l32, 0.01 * l32);
  const std::vector<float> logits = b16.logits_row_to_host(3);
  for (float v : logits) EXPECT_EQ(v, bf16_round(v));
  b16.backward();  // gradients of the parameters stay FP32 and finite
  for (float g : b16.grads_to_host()) EXPECT_TRUE(std::isfinite(g));
}

// The emulator backend's bf16_dout (the activations' and norms' backward passes reading dout as
// bf16_round(dout)): the bits of the same pass on a dout rounded beforehand; and the activations'
// passes write dinp whatever it held.
TEST(Gpt, CpuBackwardPassesBf16DoutAndWrite) {
  auto be = make_cpu_backend();
  const int64_t N = 5, F = 48, n = N * F;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.5f);
  std::vector<float> x(static_cast<size_t>(2 * n)), dout(static_cast<size_t>(n));
  for (float& v : x) v = nd(rng);
  for (float& v : dout) v = nd(rng);
  std::vector<float> rounded = dout;
  for (float& v : rounded) v = bf16_round(v);
  for (int kind = 0; kind < 3; ++kind) {
    const size_t m = static_cast<size_t>(kind == 2 ? 2 * n : n);
    auto call = [&](const std::vector<float>& d, bool bf16_dout, float fill) {
      std::vector<float> dinp(m, fill);
      const Activation act = kind == 0   ? Activation::GeluTanh
                             : kind == 1 ? Activation::SquaredRelu
                                         : Activation::SwiGLU;
      const int64_t cols = kind == 2 ? 2 * F : F;
      TensorView dv = host_view(const_cast<float*>(d.data()), N, F, "dout"),
                 di = host_view(dinp.data(), N, cols, "dinp");
      dv.bf16_values = bf16_dout;
      di.bf16_values = true;
      be->activation_backward(act, di, host_view(x.data(), N, cols, "inp"), dv);
      return dinp;
    };
    const std::vector<float> on_read = call(dout, true, NAN), before = call(rounded, false, 0.0f);
    const std::vector<float> raw = call(dout, false, 0.0f);
    EXPECT_EQ(0, std::memcmp(on_read.data(), before.data(), m * 4)) << "kind " << kind;
    EXPECT_NE(0, std::memcmp(on_read.data(), raw.data(), m * 4))
        << "kind " << kind << ": rounding not exercised";
  }
  // the norms: dinp, dweight (and dbias) from a dout read as bf16 equal those from a rounded dout
  const std::vector<float> w(x.begin(), x.begin() + F), mean(static_cast<size_t>(N), 0.25f),
      rstd(static_cast<size_t>(N), 0.75f);
  for (bool layernorm : {true, false}) {
    auto call = [&](const std::vector<float>& d, bool bf16_dout) {
      std::vector<float> out(static_cast<size_t>(n + 2 * F), 0.0f);  // dinp, dweight, dbias
      float* dinp = out.data();
      float* dw = dinp + n;
      TensorView di = host_view(dinp, N, F, "dinp"),
                 dv = host_view(const_cast<float*>(d.data()), N, F, "dout");
      di.bf16_values = true;
      dv.bf16_values = bf16_dout;
      auto c = [](const std::vector<float>& v, int64_t rows, int64_t cols) {
        return host_view(const_cast<float*>(v.data()), rows, cols);
      };
      be->norm_backward(layernorm ? NormKind::LayerNorm : NormKind::RMSNorm, di,
                        host_view(dw, F, 1), layernorm ? host_view(dw + F, F, 1) : TensorView{}, dv,
                        c(x, N, F), c(w, F, 1), layernorm ? c(mean, N, 1) : TensorView{},
                        c(rstd, N, 1));
      return out;
    };
    const std::vector<float> on_read = call(dout, true), before = call(rounded, false),
                             raw = call(dout, false);
    EXPECT_EQ(0, std::memcmp(on_read.data(), before.data(), on_read.size() * 4))
        << "layernorm " << layernorm;
    EXPECT_NE(0, std::memcmp(on_read.data(), raw.data(), on_read.size() * 4))
        << "layernorm " << layernorm;
  }
}

// The loss gradient formed in the forward's cross-entropy op for 3 micro-batches equals the one a
// backward for 3 micro-batches forms again after a forward made for 1: the same gradients, bit for
// bit.
TEST(Gpt, LossGradientFromForwardEqualsTheOneBackwardForms) {
  ModelConfig m = micro(Positions::Learned, NormKind::LayerNorm, Activation::GeluTanh, true, 2);
  m.activation_dtype = ActivationStorage::BF16;
  auto be = make_cpu_backend();
  const int64_t B = 2, T = 8;
  std::vector<int32_t> tok, tgt;
  pattern_batch(B * T, 5, 2, tok, tgt);
  Gpt a(m, *be), b(m, *be);
  a.init(9);
  b.init(9);
  const float la = a.forward(tok.data(), tgt.data(), B, T, 3),
              lb = b.forward(tok.data(), tgt.data(), B, T);
  EXPECT_EQ(la, lb);
  a.backward(3);
  b.backward(3);
  const std::vector<float> ga = a.grads_to_host(), gb = b.grads_to_host();
  ASSERT_EQ(ga.size(), gb.size());
  size_t nonzero = 0;
  for (size_t i = 0; i < ga.size(); ++i) {
    ASSERT_EQ(f32_bits(ga[i]), f32_bits(gb[i])) << i;
    nonzero += ga[i] != 0.0f;
  }
  EXPECT_GT(nonzero, ga.size() / 2);
  EXPECT_THROW(a.forward(tok.data(), tgt.data(), B, T, 0), std::invalid_argument);
}

// A step's gradient is the ordered sum of the micro-batches' gradients, each computed from zero
// (DESIGN.md §16, contract_version 2): accumulating two micro-batches gives exactly g0 + g1 (one
// FP32 add an element) of the two computed alone, under the nvfp4 recipe (SR streams per
// micro-batch) as under BF16.
TEST(Gpt, GradAccumulationIsTheOrderedSumOfMicroBatchGradients) {
  for (const char* recipe : {"bf16", "nvfp4"}) {
    auto be = make_cpu_backend();
    ModelConfig mc = micro(Positions::Learned, NormKind::LayerNorm, Activation::GeluTanh, true, 4);
    Gpt model(mc, *be);
    model.init(3);
    RunConfig run;
    run.model = mc;
    run.recipe.name = std::string(recipe) == "nvfp4" ? GemmFormat::NVFP4 : GemmFormat::BF16;
    run.recipe.hp_first = run.recipe.hp_last = 0;
    model.set_recipe(run);
    model.set_step(0);
    const int64_t B = 4, T = 8;
    std::mt19937 rng(5);
    std::vector<int32_t> tok[2], tgt[2];
    for (int m = 0; m < 2; ++m) {
      tok[m].resize(B * T);
      tgt[m].resize(B * T);
      for (auto& t : tok[m]) t = static_cast<int32_t>(rng() % 16);
      for (auto& t : tgt[m]) t = static_cast<int32_t>(rng() % 16);
    }
    const size_t n = model.num_params();
    auto pass = [&](int m, bool accumulate) {
      model.set_micro_batch(m);
      model.forward(tok[m].data(), tgt[m].data(), B, T, 2);
      model.backward(2, accumulate);
      return std::vector<float>(model.grads(), model.grads() + n);
    };
    const std::vector<float> g0 = pass(0, false), g1 = pass(1, false);
    pass(0, false);
    const std::vector<float> sum = pass(1, true);
    size_t differ = 0;
    for (size_t i = 0; i < n; ++i) {
      const float want = g0[i] + g1[i];
      differ += std::memcmp(&want, &sum[i], 4) != 0;
    }
    EXPECT_EQ(differ, 0u) << recipe << ": " << differ << " of " << n << " gradients differ";
  }
}

}  // namespace
}  // namespace fp4sim::model
