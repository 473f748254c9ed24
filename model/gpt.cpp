#include "model/gpt.hpp"

#include <cmath>
#include <random>
#include <stdexcept>


namespace fp4sim::model {

int64_t ParamTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string Gpt::lname(int64_t l, const char* what) const {
  return "h." + std::to_string(l) + "." + what;
}

void Gpt::add(const std::string& name, std::vector<int64_t> shape) {
  ParamTensor t{name, std::move(shape), 0};
  t.offset = tensors_.empty() ? 0 : tensors_.back().offset + static_cast<size_t>(tensors_.back().numel());
  tensors_.push_back(t);
}

const ParamTensor& Gpt::tensor(const std::string& name) const {
  for (const ParamTensor& t : tensors_)
    if (t.name == name) return t;
  throw std::out_of_range("no parameter named '" + name + "'");
}

Gpt::Gpt(const ModelConfig& cfg, Backend& backend) : cfg_(cfg), be_(backend) {
  validate(RunConfig{cfg, TrainConfig{}, RecipeConfig{}});
  if (backend.device() != Device::Host)
    throw std::invalid_argument("--backend " + backend.name() +
                                ": the model's buffers live in host memory so far; the training stack runs "
                                "on --backend emu (issue 4 in progress)");
  if (cfg.activation == "swiglu")
    throw std::invalid_argument("model.activation swiglu: not wired into the model yet (gelu_tanh, squared_relu)");
  const int64_t C = cfg.d_model, HD = C / cfg.n_heads, QKV = (cfg.n_heads + 2 * cfg.n_kv_heads) * HD;
  add("wte", {cfg.vocab, C});
  if (cfg.positions == "learned") add("wpe", {cfg.max_positions, C});
  for (int64_t l = 0; l < cfg.n_layers; ++l) {
    add(lname(l, "ln_1.weight"), {C});
    if (cfg.norm == "layernorm") add(lname(l, "ln_1.bias"), {C});
    add(lname(l, "attn.c_attn.weight"), {QKV, C});
    if (cfg.bias) add(lname(l, "attn.c_attn.bias"), {QKV});
    add(lname(l, "attn.c_proj.weight"), {C, C});
    if (cfg.bias) add(lname(l, "attn.c_proj.bias"), {C});
    add(lname(l, "ln_2.weight"), {C});
    if (cfg.norm == "layernorm") add(lname(l, "ln_2.bias"), {C});
    add(lname(l, "mlp.c_fc.weight"), {cfg.d_ff, C});
    if (cfg.bias) add(lname(l, "mlp.c_fc.bias"), {cfg.d_ff});
    add(lname(l, "mlp.c_proj.weight"), {C, cfg.d_ff});
    if (cfg.bias) add(lname(l, "mlp.c_proj.bias"), {C});
  }
  add("ln_f.weight", {C});
  if (cfg.norm == "layernorm") add("ln_f.bias", {C});
  if (!cfg.tied_embeddings) add("lm_head.weight", {cfg.vocab, C});
  const size_t n = tensors_.back().offset + static_cast<size_t>(tensors_.back().numel());
  params_.assign(n, 0.0f);
  grads_.assign(n, 0.0f);
}

void Gpt::init(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const float resid_scale = 1.0f / std::sqrt(2.0f * static_cast<float>(cfg_.n_layers));
  for (const ParamTensor& t : tensors_) {
    float* x = params_.data() + t.offset;
    const bool norm_weight = t.name.find("ln_") != std::string::npos && t.name.find(".weight") != std::string::npos;
    const bool bias = t.name.find(".bias") != std::string::npos;
    const bool resid = t.name.find("c_proj.weight") != std::string::npos;
    for (int64_t i = 0; i < t.numel(); ++i)
      x[i] = norm_weight ? 1.0f : (bias ? 0.0f : 0.02f * nd(rng) * (resid ? resid_scale : 1.0f));
  }
}

float Gpt::forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T) {
  const ModelConfig& c = cfg_;
  if (T > c.seq_len)
    throw std::invalid_argument("forward: sequence of " + std::to_string(T) + " tokens exceeds model.seq_len " +
                                std::to_string(c.seq_len));
  const int64_t N = B * T, C = c.d_model, NH = c.n_heads, NKV = c.n_kv_heads, HD = C / NH;
  const int64_t QKV = (NH + 2 * NKV) * HD, F = c.d_ff, V = c.vocab;
  B_ = B;
  T_ = T;
  tokens_.assign(tokens, tokens + N);
  targets_.assign(targets, targets + N);
  pos_.resize(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) {
    if (tokens[i] < 0 || tokens[i] >= V || targets[i] < 0 || targets[i] >= V)
      throw std::invalid_argument("forward: token outside the vocabulary of " + std::to_string(V));
    pos_[static_cast<size_t>(i)] = static_cast<int32_t>(i % T);
  }
  const bool ln = c.norm == "layernorm";
  emb_.resize(static_cast<size_t>(N * C));
  be_.embedding_forward(emb_.data(), tokens_.data(), pos_.data(), p("wte"),
                         c.positions == "learned" ? p("wpe") : nullptr, N, C);
  acts_.resize(static_cast<size_t>(c.n_layers));
  const float* x = emb_.data();
  auto norm_fwd = [&](std::vector<float>& out, std::vector<float>& mean, std::vector<float>& rstd,
                      const float* in, const std::string& pre) {
    out.resize(static_cast<size_t>(N * C));
    mean.resize(static_cast<size_t>(N));
    rstd.resize(static_cast<size_t>(N));
    if (ln) be_.layernorm_forward(out.data(), mean.data(), rstd.data(), in, p(pre + ".weight"), p(pre + ".bias"), N, C);
    else be_.rmsnorm_forward(out.data(), rstd.data(), in, p(pre + ".weight"), N, C);
  };
  for (int64_t l = 0; l < c.n_layers; ++l) {
    LayerActs& a = acts_[static_cast<size_t>(l)];
    norm_fwd(a.ln1, a.ln1_mean, a.ln1_rstd, x, lname(l, "ln_1"));
    a.qkv.resize(static_cast<size_t>(N * QKV));
    be_.matmul_forward(a.qkv.data(), a.ln1.data(), p(lname(l, "attn.c_attn.weight")),
                        c.bias ? p(lname(l, "attn.c_attn.bias")) : nullptr, N, C, QKV, prec_);
    if (c.positions == "rope") be_.rope_forward(a.qkv.data(), B, T, NH, NKV, HD);
    a.att.resize(static_cast<size_t>(B * NH * T * T));
    a.atty.resize(static_cast<size_t>(N * C));
    be_.attention_forward(a.atty.data(), a.att.data(), a.qkv.data(), B, T, NH, NKV, HD);
    a.attproj.resize(static_cast<size_t>(N * C));
    be_.matmul_forward(a.attproj.data(), a.atty.data(), p(lname(l, "attn.c_proj.weight")),
                        c.bias ? p(lname(l, "attn.c_proj.bias")) : nullptr, N, C, C, prec_);
    a.res1.resize(static_cast<size_t>(N * C));
    be_.residual_forward(a.res1.data(), x, a.attproj.data(), N * C);
    norm_fwd(a.ln2, a.ln2_mean, a.ln2_rstd, a.res1.data(), lname(l, "ln_2"));
    a.fc.resize(static_cast<size_t>(N * F));
    be_.matmul_forward(a.fc.data(), a.ln2.data(), p(lname(l, "mlp.c_fc.weight")),
                        c.bias ? p(lname(l, "mlp.c_fc.bias")) : nullptr, N, C, F, prec_);
    a.act.resize(static_cast<size_t>(N * F));
    if (c.activation == "gelu_tanh") be_.gelu_forward(a.act.data(), a.fc.data(), N * F);
    else be_.squared_relu_forward(a.act.data(), a.fc.data(), N * F);
    a.fcproj.resize(static_cast<size_t>(N * C));
    be_.matmul_forward(a.fcproj.data(), a.act.data(), p(lname(l, "mlp.c_proj.weight")),
                        c.bias ? p(lname(l, "mlp.c_proj.bias")) : nullptr, N, F, C, prec_);
    a.res2.resize(static_cast<size_t>(N * C));
    be_.residual_forward(a.res2.data(), a.res1.data(), a.fcproj.data(), N * C);
    x = a.res2.data();
  }
  norm_fwd(lnf_, lnf_mean_, lnf_rstd_, x, "ln_f");
  logits_.resize(static_cast<size_t>(N * V));
  be_.matmul_forward(logits_.data(), lnf_.data(), c.tied_embeddings ? p("wte") : p("lm_head.weight"),
                      nullptr, N, C, V, prec_);
  probs_.resize(static_cast<size_t>(N * V));
  losses_.resize(static_cast<size_t>(N));
  be_.crossentropy_softmax_forward(losses_.data(), probs_.data(), logits_.data(), targets_.data(), N, V);
  double sum = 0;
  for (float v : losses_) sum += v;
  return static_cast<float>(sum / static_cast<double>(N));
}

void Gpt::backward() {
  const ModelConfig& c = cfg_;
  const int64_t B = B_, T = T_, N = B * T, C = c.d_model, NH = c.n_heads, NKV = c.n_kv_heads, HD = C / NH;
  const int64_t QKV = (NH + 2 * NKV) * HD, F = c.d_ff, V = c.vocab;
  const bool ln = c.norm == "layernorm";
  std::fill(grads_.begin(), grads_.end(), 0.0f);
  std::vector<float> dlosses(static_cast<size_t>(N), 1.0f / static_cast<float>(N));
  std::vector<float> dlogits(static_cast<size_t>(N * V), 0.0f);
  be_.crossentropy_softmax_backward(dlogits.data(), probs_.data(), targets_.data(), dlosses.data(), N, V);
  std::vector<float> dlnf(static_cast<size_t>(N * C), 0.0f), dx(static_cast<size_t>(N * C), 0.0f);
  be_.matmul_backward(dlnf.data(), c.tied_embeddings ? g("wte") : g("lm_head.weight"), nullptr, dlogits.data(),
                       lnf_.data(), c.tied_embeddings ? p("wte") : p("lm_head.weight"), N, C, V, prec_);
  auto norm_bwd = [&](float* din, const float* dout, const float* in, const std::vector<float>& mean,
                      const std::vector<float>& rstd, const std::string& pre) {
    if (ln) be_.layernorm_backward(din, g(pre + ".weight"), g(pre + ".bias"), dout, in, p(pre + ".weight"),
                                    mean.data(), rstd.data(), N, C);
    else be_.rmsnorm_backward(din, g(pre + ".weight"), dout, in, p(pre + ".weight"), rstd.data(), N, C);
  };
  const float* last = c.n_layers ? acts_.back().res2.data() : emb_.data();
  norm_bwd(dx.data(), dlnf.data(), last, lnf_mean_, lnf_rstd_, "ln_f");
  // dx now holds d(residual stream) at the top; walk the layers down
  for (int64_t l = c.n_layers - 1; l >= 0; --l) {
    LayerActs& a = acts_[static_cast<size_t>(l)];
    const float* x_in = l == 0 ? emb_.data() : acts_[static_cast<size_t>(l - 1)].res2.data();
    // res2 = res1 + fcproj: d(res1) = dx + (MLP path)
    std::vector<float> dact(static_cast<size_t>(N * F), 0.0f), dfc(static_cast<size_t>(N * F), 0.0f);
    std::vector<float> dln2(static_cast<size_t>(N * C), 0.0f);
    be_.matmul_backward(dact.data(), g(lname(l, "mlp.c_proj.weight")), c.bias ? g(lname(l, "mlp.c_proj.bias")) : nullptr,
                         dx.data(), a.act.data(), p(lname(l, "mlp.c_proj.weight")), N, F, C, prec_);
    if (c.activation == "gelu_tanh") be_.gelu_backward(dfc.data(), a.fc.data(), dact.data(), N * F);
    else be_.squared_relu_backward(dfc.data(), a.fc.data(), dact.data(), N * F);
    be_.matmul_backward(dln2.data(), g(lname(l, "mlp.c_fc.weight")), c.bias ? g(lname(l, "mlp.c_fc.bias")) : nullptr,
                         dfc.data(), a.ln2.data(), p(lname(l, "mlp.c_fc.weight")), N, C, F, prec_);
    norm_bwd(dx.data(), dln2.data(), a.res1.data(), a.ln2_mean, a.ln2_rstd, lname(l, "ln_2"));
    // res1 = x_in + attproj
    std::vector<float> datty(static_cast<size_t>(N * C), 0.0f), dqkv(static_cast<size_t>(N * QKV), 0.0f);
    std::vector<float> dln1(static_cast<size_t>(N * C), 0.0f);
    be_.matmul_backward(datty.data(), g(lname(l, "attn.c_proj.weight")), c.bias ? g(lname(l, "attn.c_proj.bias")) : nullptr,
                         dx.data(), a.atty.data(), p(lname(l, "attn.c_proj.weight")), N, C, C, prec_);
    be_.attention_backward(dqkv.data(), datty.data(), a.qkv.data(), a.att.data(), B, T, NH, NKV, HD);
    if (c.positions == "rope") be_.rope_backward(dqkv.data(), B, T, NH, NKV, HD);
    // the saved qkv is post-RoPE, the GEMM's output is pre-RoPE: the rotation was undone on dqkv
    be_.matmul_backward(dln1.data(), g(lname(l, "attn.c_attn.weight")), c.bias ? g(lname(l, "attn.c_attn.bias")) : nullptr,
                         dqkv.data(), a.ln1.data(), p(lname(l, "attn.c_attn.weight")), N, C, QKV, prec_);
    norm_bwd(dx.data(), dln1.data(), x_in, a.ln1_mean, a.ln1_rstd, lname(l, "ln_1"));
  }
  be_.embedding_backward(g("wte"), c.positions == "learned" ? g("wpe") : nullptr, dx.data(), tokens_.data(),
                          pos_.data(), N, C);
}

}  // namespace fp4sim::model
