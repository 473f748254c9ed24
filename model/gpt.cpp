#include "model/gpt.hpp"

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>
#include <utility>

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
  t.offset =
      tensors_.empty() ? 0 : tensors_.back().offset + static_cast<size_t>(tensors_.back().numel());
  tensors_.push_back(t);
}

Gpt::TensorSpans Gpt::tensor_spans() const {
  TensorSpans s;
  for (const ParamTensor& t : tensors_) {
    s.offsets.push_back(static_cast<int64_t>(t.offset));
    s.counts.push_back(t.numel());
  }
  return s;
}

const ParamTensor& Gpt::tensor(const std::string& name) const {
  for (const ParamTensor& t : tensors_)
    if (t.name == name) return t;
  throw std::out_of_range("no parameter named '" + name + "'");
}

Gpt::Gpt(const ModelConfig& cfg, Backend& backend) : cfg_(cfg), be_(backend) {
  validate(RunConfig{cfg, TrainConfig{}, RecipeConfig{}});
  run_.model = cfg;
  high_precision_.assign(static_cast<size_t>(cfg.n_layers), true);
  recipes_.assign(static_cast<size_t>(cfg.n_layers * 4), LinearRecipe{});
  const int64_t C = cfg.d_model, HD = C / cfg.n_heads,
                QKV = (cfg.n_heads + 2 * cfg.n_kv_heads) * HD;
  if (!be_.supports_attention_head_dim(HD))
    throw std::invalid_argument(
        "model: head size model.d_model / model.n_heads = " + std::to_string(HD) + " (" +
        std::to_string(C) + " / " + std::to_string(cfg.n_heads) + ") is not one the " + be_.name() +
        " backend's attention takes (16, 32, 64 or 128)");
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
    // SwiGLU: c_fc produces [gate | up], 2 * d_ff rows
    add(lname(l, "mlp.c_fc.weight"), {fc_width(), C});
    if (cfg.bias) add(lname(l, "mlp.c_fc.bias"), {fc_width()});
    add(lname(l, "mlp.c_proj.weight"), {C, cfg.d_ff});
    if (cfg.bias) add(lname(l, "mlp.c_proj.bias"), {C});
  }
  add("ln_f.weight", {C});
  if (cfg.norm == "layernorm") add("ln_f.bias", {C});
  if (!cfg.tied_embeddings) add("lm_head.weight", {cfg.vocab, C});
  n_params_ = tensors_.back().offset + static_cast<size_t>(tensors_.back().numel());
  params_ = BackendBuffer(be_, n_params_ * 4);
  grads_ = BackendBuffer(be_, n_params_ * 4);
  be_.zero(params(), n_params_ * 4);
  be_.zero(grads(), n_params_ * 4);
}

void Gpt::set_recipe(const RunConfig& run) {
  if (run.model.n_layers != cfg_.n_layers)
    throw std::invalid_argument("set_recipe: the run's model.n_layers differs from this model's");
  run_ = run;
  run_.model = cfg_;
  has_recipe_ = true;
  high_precision_ = high_precision_blocks(run_);
  set_step(step_);
}

void Gpt::set_step(int64_t step) {
  step_ = step;
  if (!has_recipe_) return;
  for (int64_t l = 0; l < cfg_.n_layers; ++l)
    for (int i = 0; i < 4; ++i)
      recipes_[static_cast<size_t>(l * 4 + i)] =
          resolve_linear_recipe(run_, high_precision_, l, i, step);
}

std::string Gpt::describe_recipe() const {
  std::string s;
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    s += "block " + std::to_string(l) +
         (high_precision_[static_cast<size_t>(l)] ? " (high precision)" : "") + ":";
    for (int i = 0; i < 4; ++i) {
      const LinearRecipe& r = linear_recipe(l, i);
      s += std::string("  ") + kLinearNames[i] + " " + r.fprop + "/" + r.dgrad + "/" + r.wgrad;
    }
    s += "\n";
  }
  s += "(fprop/dgrad/wgrad per linear layer; embeddings, norms, attention and the output head in "
       "BF16)\n";
  return s;
}

std::vector<QuantStat> Gpt::take_stats() {
  std::vector<QuantStat> out;
  out.swap(stats_);
  return out;
}

void Gpt::store(float* x, int64_t n) {
  if (round_bf16()) be_.round_to_bf16(x, n);
}

bool Gpt::uses_weight_shadow() const {
  // (the BF16 recipe's every matmul reads its weight in BF16: one narrowing pass over all
  // parameters instead of one conversion per matmul; other recipes quantize most weights
  // themselves)
  return bits_on() && std::none_of(recipes_.begin(), recipes_.end(),
                                   [](const LinearRecipe& r) { return r.any_quantized(); });
}

void Gpt::adamw_step(float* m, float* v, const std::vector<int64_t>& offsets,
                     const std::vector<int64_t>& counts, const std::vector<AdamWStep>& steps) {
  float* const w =
      params();  // (a writable view: the shadow is stale from here unless the step writes it)
  // the tensors, by offset, tile [0, n_params) exactly
  std::vector<std::pair<int64_t, int64_t>> segs;
  for (size_t i = 0; i < offsets.size() && i < counts.size(); ++i)
    segs.emplace_back(offsets[i], counts[i]);
  std::sort(segs.begin(), segs.end());
  int64_t end = 0;
  bool tiles = offsets.size() == counts.size();
  for (const auto& sg : segs) {
    tiles = tiles && sg.first == end;
    end = sg.first + sg.second;
  }
  tiles = tiles && end == static_cast<int64_t>(n_params_);
  if (tiles && uses_weight_shadow() && params16_.bytes() == n_params_ * 2) {
    be_.adamw_update_many_bf16(w, params16_.as<uint16_t>(), grads(), m, v, offsets, counts, steps);
    shadow_version_ = params_version_;
  } else {
    be_.adamw_update_many(w, grads(), m, v, offsets, counts, steps);
  }
}

Gpt::WeightShadow::WeightShadow(Gpt& m) : m_(m) {
  if (!m.uses_weight_shadow()) return;
  const int64_t n = static_cast<int64_t>(m.n_params_);
  const float* params = m.params_.as<float>();  // (not params(): reading does not stale the shadow)
  const void* before = m.params16_.get();
  uint16_t* bits = m.bf16_buffer(m.params16_, n);
  // the bits of the parameters as they are unless no writable view was taken since they were made
  // (the backward pass reuses its forward pass's: one narrowing pass a step, not two)
  if (m.shadow_version_ != m.params_version_ || bits != before) {
    m.be_.narrow_to_bf16(bits, params, n);
    m.shadow_version_ = m.params_version_;
  }
  m.be_.set_bf16_weight_shadow(params, bits, n);
  set_ = true;
}

Gpt::WeightShadow::~WeightShadow() {
  if (set_) m_.be_.set_bf16_weight_shadow(nullptr, nullptr, 0);
}

bool Gpt::stores_bits(int64_t l, int linear) const {
  const bool all_bf16 = !linear_recipe(l, linear).any_quantized();
  // (statistics read a quantized linear's FP32 input; GELU's output stays FP32 where a quantizer
  // takes it from the op: Backend::quantize_activation)
  return bits_on() && (all_bf16 || !stats_active_) &&
         (linear != 3 || (all_bf16 && cfg_.activation == "gelu_tanh"));
}

float* Gpt::f32_buffer(BackendBuffer& b, int64_t n) {
  if (b.bytes() != static_cast<size_t>(n) * 4) b = BackendBuffer(be_, static_cast<size_t>(n) * 4);
  return b.as<float>();
}

uint16_t* Gpt::bf16_buffer(BackendBuffer& b, int64_t n) {
  if (b.bytes() != static_cast<size_t>(n) * 2) b = BackendBuffer(be_, static_cast<size_t>(n) * 2);
  return b.as<uint16_t>();
}

void Gpt::linear_fwd(int64_t l, int linear, float* out, const float* inp, int64_t N, int64_t K,
                     int64_t OC, bool round_bf16, const ActivationSource* pending_input,
                     const uint16_t* inp16, uint16_t* out16) {
  const std::string name = lname(l, kLinearNames[linear]);
  const LinearIds ids{run_.train.seed, step_, micro_batch_, l, linear};
  linear_forward(be_, linear_recipe(l, linear), ids, out, inp, p(name + ".weight"),
                 cfg_.bias ? p(name + ".bias") : nullptr, N, K, OC, prec_, round_bf16,
                 stats_active_ ? &stats_ : nullptr, name,
                 inference_ ? nullptr : &acts_[static_cast<size_t>(l)].saved_x[linear],
                 inference_ ? nullptr : &acts_[static_cast<size_t>(l)].saved_w[linear],
                 pending_input, LinearBits{inp16, out16});
}

void Gpt::linear_bwd(int64_t l, int linear, float* dinp, const float* dout, int64_t N, int64_t K,
                     int64_t OC, const ActivationSource* pending_dout, uint16_t* dinp16,
                     const uint16_t* dout16) {
  const std::string name = lname(l, kLinearNames[linear]);
  const LinearIds ids{run_.train.seed, step_, micro_batch_, l, linear};
  LayerActs& a = acts_[static_cast<size_t>(l)];
  const LinearRecipe& r = linear_recipe(l, linear);
  // the input as the forward pass kept it (FP32 or BF16 bits), where the Wgrad reads it (else the
  // saved copy)
  const float* inp = r.wgrad == "bf16" && !a.in16[linear] ? linear_input(l, linear) : nullptr;
  const uint16_t* inp16 = r.wgrad == "bf16" && a.in16[linear] ? linear_input16(l, linear) : nullptr;
  linear_backward(be_, r, ids, dinp, g(name + ".weight"), cfg_.bias ? g(name + ".bias") : nullptr,
                  dout, inp, p(name + ".weight"), N, K, OC, prec_,
                  stats_active_ ? &stats_ : nullptr, name, a.saved_x[linear].get(),
                  a.saved_w[linear].get(), pending_dout, inp16, dinp16, dout16);
}

float* Gpt::linear_input(int64_t l, int linear) {
  const int64_t N = B_ * T_, width = linear == 3 ? cfg_.d_ff : cfg_.d_model;
  // the attention output (linear 1's input) is always kept: the attention backward pass reads it
  if (linear != 1 && linear_recipe(l, linear).wgrad != "bf16")
    return scratch_in_[linear].as<float>();
  LayerActs& a = acts_[static_cast<size_t>(l)];
  return f32_buffer(linear == 0   ? a.ln1
                    : linear == 1 ? a.atty
                    : linear == 2 ? a.ln2
                                  : a.act,
                    N * width);
}

uint16_t* Gpt::linear_input16(int64_t l, int linear) {
  const int64_t N = B_ * T_, width = linear == 3 ? cfg_.d_ff : cfg_.d_model;
  // (as linear_input: a quantized Wgrad's input is not kept, except the attention output)
  if (linear != 1 && linear_recipe(l, linear).wgrad != "bf16")
    return bf16_buffer(scratch16_in_[linear], N * width);
  LayerActs& a = acts_[static_cast<size_t>(l)];
  return bf16_buffer(linear == 0   ? a.ln1
                     : linear == 1 ? a.atty
                     : linear == 2 ? a.ln2
                                   : a.act,
                     N * width);
}

size_t Gpt::saved_activation_bytes() const {
  size_t n = emb_.bytes() + lnf_.bytes() + lnf_mean_.bytes() + lnf_rstd_.bytes() + logits_.bytes() +
             losses_.bytes();
  for (const LayerActs& a : acts_) {
    for (const BackendBuffer* b :
         {&a.ln1, &a.ln1_mean, &a.ln1_rstd, &a.qkv, &a.lse, &a.atty, &a.attproj, &a.res1, &a.ln2,
          &a.ln2_mean, &a.ln2_rstd, &a.fc, &a.act, &a.fcproj, &a.res2})
      n += b->bytes();
    for (const auto& q : a.saved_x)
      if (q) n += q->bytes();
    for (const auto& q : a.saved_w)
      if (q) n += q->bytes();
  }
  return n;
}

std::vector<float> Gpt::params_to_host() const {
  std::vector<float> h(n_params_);
  be_.download(h.data(), params(), n_params_ * 4);
  return h;
}

void Gpt::params_from_host(const std::vector<float>& h) {
  if (h.size() != n_params_)
    throw std::invalid_argument("params_from_host: " + std::to_string(h.size()) +
                                " values for a model of " + std::to_string(n_params_) +
                                " parameters");
  be_.upload(params(), h.data(), n_params_ * 4);
}

std::vector<float> Gpt::grads_to_host() const {
  std::vector<float> h(n_params_);
  be_.download(h.data(), grads(), n_params_ * 4);
  return h;
}

std::string Gpt::first_nonfinite_in_forward() const {
  // (a sum of squares in FP64 is finite exactly when every element is: FP32 squares cannot overflow
  // it)
  const TensorSpans spans = tensor_spans();
  std::vector<double> sums(spans.offsets.size());
  be_.sum_squares_many(params(), spans.offsets, spans.counts, sums.data());
  for (size_t i = 0; i < sums.size(); ++i)
    if (!std::isfinite(sums[i])) return "parameter '" + tensors_[i].name + "'";
  const int64_t n = B_ * T_ * cfg_.d_model;
  auto bad = [&](const BackendBuffer& b) {
    if (n == 0 || b.bytes() != static_cast<size_t>(n) * 4) return false;  // (not kept as FP32 here)
    double sum = 0;
    be_.sum_squares_many(b.as<float>(), {0}, {n}, &sum);
    return !std::isfinite(sum);
  };
  if (bad(emb_)) return "the embeddings' output (wte + wpe)";
  for (size_t l = 0; l < acts_.size(); ++l) {
    if (bad(acts_[l].res1))
      return "the residual stream after layer " + std::to_string(l) + "'s attention";
    if (bad(acts_[l].res2))
      return "the residual stream after layer " + std::to_string(l) + "'s MLP";
  }
  return "the logits or the loss (the residual stream is finite)";
}

std::vector<float> Gpt::logits_row_to_host(int64_t row) const {
  if (row < 0 || row >= B_ * T_)
    throw std::out_of_range("logits_row_to_host: row " + std::to_string(row) + " of " +
                            std::to_string(B_ * T_));
  std::vector<float> h(static_cast<size_t>(cfg_.vocab));
  if (logits16_) {  // (kept as BF16 bits)
    std::vector<uint16_t> b(h.size());
    be_.download(b.data(), logits_.as<uint16_t>() + row * cfg_.vocab, b.size() * 2);
    for (size_t i = 0; i < h.size(); ++i) h[i] = bf16_to_f32(b[i]);
    return h;
  }
  be_.download(h.data(), logits_.as<float>() + row * cfg_.vocab, h.size() * 4);
  if (round_bf16())  // the logits' BF16 storage, applied where they are read (see forward)
    for (float& v : h) v = bf16_round(v);
  return h;
}

void Gpt::init(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const float resid_scale = 1.0f / std::sqrt(2.0f * static_cast<float>(cfg_.n_layers));
  std::vector<float> h(n_params_);
  for (const ParamTensor& t : tensors_) {
    float* x = h.data() + t.offset;
    const bool norm_weight =
        t.name.find("ln_") != std::string::npos && t.name.find(".weight") != std::string::npos;
    const bool bias = t.name.find(".bias") != std::string::npos;
    const bool resid = t.name.find("c_proj.weight") != std::string::npos;
    for (int64_t i = 0; i < t.numel(); ++i)
      x[i] = norm_weight ? 1.0f : (bias ? 0.0f : 0.02f * nd(rng) * (resid ? resid_scale : 1.0f));
  }
  params_from_host(h);
}

void Gpt::allocate_activations(int64_t B, int64_t T) {
  if (B == alloc_B_ && T == alloc_T_) return;
  const ModelConfig& c = cfg_;
  const int64_t N = B * T, C = c.d_model, NH = c.n_heads, HD = C / NH;
  const int64_t QKV = (NH + 2 * c.n_kv_heads) * HD, F = c.d_ff, FC = fc_width(), V = c.vocab;
  auto f32 = [&](int64_t n) { return BackendBuffer(be_, static_cast<size_t>(n) * 4); };
  batch_ = f32(2 * N);
  pos_ = f32(N);
  {
    std::vector<int32_t> pos(static_cast<size_t>(N));
    for (int64_t i = 0; i < N; ++i) pos[static_cast<size_t>(i)] = static_cast<int32_t>(i % T);
    be_.upload(pos_.get(), pos.data(), static_cast<size_t>(N) * 4);
  }
  dlosses_for_ = 0;
  emb_ = f32(N * C);
  lnf_ = f32(N * C);
  lnf_mean_ = f32(N);
  lnf_rstd_ = f32(N);
  losses_ = f32(N);
  acts_.clear();
  acts_.resize(static_cast<size_t>(c.n_layers));
  for (LayerActs& a : acts_) {
    a.ln1_mean = f32(N);
    a.ln1_rstd = f32(N);
    a.lse =
        f32(B * NH * T);  // attention's log-sum-exp rows (B,NH,T), not the (B,NH,T,T) probabilities
    a.res1 = f32(N * C);
    a.ln2_mean = f32(N);
    a.ln2_rstd = f32(N);
    a.res2 = f32(N * C);
  }
  for (int i : {0, 2, 3})
    scratch_in_[i] = f32(N * (i == 3 ? F : C));  // (linear 1's input is always kept)
  dlosses_ = f32(N);
  // (BF16 activations: dlogits stored as BF16 bits, the values the cross-entropy op writes rounded
  // anyway, so half the bytes and no conversion pass before the head's GEMMs)
  dlogits_ = round_bf16() ? BackendBuffer(be_, static_cast<size_t>(N * V) * 2) : f32(N * V);
  dlnf_ = f32(N * C);
  dx_ = f32(N * C);
  dact_ = f32(N * F);
  dfc_ = f32(N * FC);
  dln2_ = f32(N * C);
  datty_ = f32(N * C);
  dqkv_ = f32(N * QKV);
  dln1_ = f32(N * C);
  alloc_B_ = B;
  alloc_T_ = T;
}

float Gpt::forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T,
                   int64_t grad_micro_batches) {
  if (grad_micro_batches < 1)
    throw std::invalid_argument("forward: grad_micro_batches must be >= 1");
  const ModelConfig& c = cfg_;
  inference_pass_ = inference_;
  if (T > c.seq_len)
    throw std::invalid_argument("forward: sequence of " + std::to_string(T) +
                                " tokens exceeds model.seq_len " + std::to_string(c.seq_len));
  const int64_t N = B * T, C = c.d_model, NH = c.n_heads, NKV = c.n_kv_heads, HD = C / NH;
  const int64_t QKV = (NH + 2 * NKV) * HD, F = c.d_ff, FC = fc_width(), V = c.vocab;
  for (int64_t i = 0; i < N; ++i) {
    if (tokens[i] < 0 || tokens[i] >= V || targets[i] < 0 || targets[i] >= V)
      throw std::invalid_argument(
          "forward: token " +
          std::to_string(tokens[i] < 0 || tokens[i] >= V ? tokens[i] : targets[i]) +
          " at position " + std::to_string(i) + " is outside the vocabulary of " +
          std::to_string(V));
  }
  allocate_activations(B, T);
  const WeightShadow shadow(*this);
  stats_active_ = collect_stats_;
  B_ = B;
  T_ = T;
  host_batch_.resize(static_cast<size_t>(2 * N));
  std::copy(tokens, tokens + N, host_batch_.begin());
  std::copy(targets, targets + N, host_batch_.begin() + N);
  be_.upload(batch_.get(), host_batch_.data(), host_batch_.size() * 4);
  const bool ln = c.norm == "layernorm", rb = round_bf16();
  auto F32 = [](const BackendBuffer& b) { return b.as<float>(); };
  be_.embedding_forward(F32(emb_), tokens_dev(), pos_.as<int32_t>(), p("wte"),
                        c.positions == "learned" ? p("wpe") : nullptr, N, C);
  store(F32(emb_), N * C);
  const float* x = F32(emb_);
  auto norm_fwd = [&](float* out, BackendBuffer& mean, BackendBuffer& rstd, const float* in,
                      const std::string& pre) {
    if (ln)
      be_.layernorm_forward(out, F32(mean), F32(rstd), in, p(pre + ".weight"), p(pre + ".bias"), N,
                            C, rb);
    else
      be_.rmsnorm_forward(out, F32(rstd), in, p(pre + ".weight"), N, C, rb);
  };
  auto norm_fwd16 = [&](uint16_t* out, BackendBuffer& mean, BackendBuffer& rstd, const float* in,
                        const std::string& pre) {
    if (ln)
      be_.layernorm_forward_bf16(out, F32(mean), F32(rstd), in, p(pre + ".weight"),
                                 p(pre + ".bias"), N, C);
    else
      be_.rmsnorm_forward_bf16(out, F32(rstd), in, p(pre + ".weight"), N, C);
  };
  // a residual add that a LayerNorm with BF16-bits output reads next is one backend call
  // (residual_layernorm_forward_bf16: the same bits as the two ops): ln_2 after the attention's
  // residual, and the next layer's ln_1 after the MLP's (ln1_done: made by the layer before)
  auto fused_norm = [&](int64_t l, int i) { return ln && stores_bits(l, i); };
  // res = in + proj16, then LayerNorm `pre` of it into out16 (mean, rstd): one backend call
  auto residual_norm16 = [&](float* res, const float* in, const uint16_t* proj16, uint16_t* out16,
                             BackendBuffer& mean, BackendBuffer& rstd, const std::string& pre) {
    be_.residual_layernorm_forward_bf16(res, out16, F32(mean), F32(rstd), in, proj16,
                                        p(pre + ".weight"), p(pre + ".bias"), N, C, rb);
  };
  bool ln1_done = false;
  for (int64_t l = 0; l < c.n_layers; ++l) {
    LayerActs& a = acts_[static_cast<size_t>(l)];
    for (int i = 0; i < 4; ++i) a.in16[i] = stores_bits(l, i);
    // (RoPE rotates qkv in place in FP32)
    a.qkv16 = bits_on() && c.positions != "rope";
    a.proj16 = bits_on();
    // (c_fc's output as bits: both MLP linears all BF16 with GELU, whose BF16 passes read the bits)
    a.fc16 = a.in16[3] && !linear_recipe(l, 2).any_quantized();
    float* const qkv = a.qkv16 ? nullptr : f32_buffer(a.qkv, N * QKV);
    uint16_t* const qkv16 = a.qkv16 ? bf16_buffer(a.qkv, N * QKV) : nullptr;
    // linear i's input made by a norm, into its BF16 bits or its FP32 buffer (a.in16[i])
    auto norm_input = [&](int i, BackendBuffer& mean, BackendBuffer& rstd, const float* in,
                          const std::string& pre) -> std::pair<float*, uint16_t*> {
      if (!a.in16[i]) {
        float* const y = linear_input(l, i);
        norm_fwd(y, mean, rstd, in, pre);
        return {y, nullptr};
      }
      uint16_t* const y16 = linear_input16(l, i);
      norm_fwd16(y16, mean, rstd, in, pre);
      return {nullptr, y16};
    };
    const auto ln1 = ln1_done ? std::pair<float*, uint16_t*>{nullptr, linear_input16(l, 0)}
                              : norm_input(0, a.ln1_mean, a.ln1_rstd, x, lname(l, "ln_1"));
    ln1_done = false;
    // RoPE rotates the GEMM's output: then the rounding comes after it (so c_attn's output, and the
    // bias it adds, stay FP32 until then: Backend::matmul_forward's bias rule covers an output the
    // op rounds itself)
    linear_fwd(l, 0, qkv, ln1.first, N, C, QKV, rb && c.positions != "rope", nullptr, ln1.second,
               qkv16);
    if (c.positions == "rope") {
      be_.rope_forward(qkv, B, T, NH, NKV, HD);
      store(qkv, N * QKV);
    }
    // c_proj's and the MLP's c_proj's outputs: read once, by the residual add (kept as BF16 bits in
    // one scratch shared by both and by every layer, or in the layer's FP32 arrays)
    uint16_t* const proj16 = a.proj16 ? bf16_buffer(proj16_, N * C) : nullptr;
    if (a.proj16) {
      a.attproj = BackendBuffer();
      a.fcproj = BackendBuffer();
    }
    float* const attproj = a.proj16 ? nullptr : f32_buffer(a.attproj, N * C);
    float* const fcproj = a.proj16 ? nullptr : f32_buffer(a.fcproj, N * C);
    auto residual = [&](float* out, const float* in, const float* b) {
      if (a.proj16)
        be_.residual_forward_bf16(out, in, proj16, N * C, rb);
      else
        be_.residual_forward(out, in, b, N * C, rb);
    };
    if (a.in16[1] || a.qkv16) {
      uint16_t* const atty16 = a.in16[1] ? linear_input16(l, 1) : nullptr;
      float* const atty = a.in16[1] ? nullptr : linear_input(l, 1);
      be_.attention_forward_bf16(atty, atty16, F32(a.lse), qkv, qkv16, B, T, NH, NKV, HD, rb);
      linear_fwd(l, 1, attproj, atty, N, C, C, rb, nullptr, atty16, proj16);
    } else {
      float* const atty = linear_input(l, 1);
      be_.attention_forward(atty, F32(a.lse), qkv, B, T, NH, NKV, HD, prec_, rb);
      linear_fwd(l, 1, attproj, atty, N, C, C, rb, nullptr, nullptr, proj16);
    }
    std::pair<float*, uint16_t*> ln2;
    if (a.proj16 && fused_norm(l, 2)) {
      ln2 = {nullptr, linear_input16(l, 2)};
      residual_norm16(F32(a.res1), x, proj16, ln2.second, a.ln2_mean, a.ln2_rstd, lname(l, "ln_2"));
    } else {
      residual(F32(a.res1), x, attproj);
      ln2 = norm_input(2, a.ln2_mean, a.ln2_rstd, F32(a.res1), lname(l, "ln_2"));
    }
    float* const fc = a.fc16 ? nullptr : f32_buffer(a.fc, N * FC);
    uint16_t* const fc16 = a.fc16 ? bf16_buffer(a.fc, N * FC) : nullptr;
    linear_fwd(l, 2, fc, ln2.first, N, C, FC, rb, nullptr, ln2.second, fc16);
    // GELU's output goes to c_proj as a pending activation (linear_forward: computed in the pass
    // that makes the GEMM's operand, or run first; kept as BF16 bits where linear 3 stores bits)
    float* const act = a.in16[3] ? nullptr : linear_input(l, 3);
    ActivationSource gelu;
    const ActivationSource* pending = nullptr;
    if (c.activation == "gelu_tanh") {
      gelu = ActivationSource{ActivationOp::GeluForward, fc, nullptr, act, N, F, rb, false,
                              "mlp activation"};
      if (a.in16[3]) gelu.out16 = linear_input16(l, 3);
      gelu.inp16 = fc16;
      pending = &gelu;
    } else if (c.activation == "squared_relu") {
      be_.squared_relu_forward(act, fc, N * F, rb);
    } else {
      be_.swiglu_forward(act, fc, N, F, rb);
    }
    linear_fwd(l, 3, fcproj, act, N, F, C, rb, pending, nullptr, proj16);
    if (a.proj16 && l + 1 < c.n_layers && fused_norm(l + 1, 0)) {
      LayerActs& next = acts_[static_cast<size_t>(l + 1)];
      residual_norm16(F32(a.res2), F32(a.res1), proj16, linear_input16(l + 1, 0), next.ln1_mean,
                      next.ln1_rstd, lname(l + 1, "ln_1"));
      ln1_done = true;
    } else {
      residual(F32(a.res2), F32(a.res1), fcproj);
    }
    x = F32(a.res2);
  }
  norm_fwd(F32(lnf_), lnf_mean_, lnf_rstd_, x, "ln_f");
  // the logits stay unrounded in memory: their BF16 storage is applied where they are read (the
  // cross-entropy op, logits_row_to_host), which saves a rounding pass over N x V
  // (or kept as BF16 bits, the GEMM writing them: no bias, so cuBLASLt's BF16 output serves)
  logits16_ = bits_on();
  const float* head_w = c.tied_embeddings ? p("wte") : p("lm_head.weight");
  if (logits16_)
    be_.matmul_forward_bf16(nullptr, bf16_buffer(logits_, N * V), F32(lnf_), nullptr, head_w,
                            nullptr, N, C, V, true);
  else
    be_.matmul_forward(f32_buffer(logits_, N * V), F32(lnf_), head_w, nullptr, N, C, V, prec_,
                       false);
  loss_gradient(grad_micro_batches);
  std::vector<float> losses(static_cast<size_t>(N));
  be_.download(losses.data(), F32(losses_), losses.size() * 4);
  double sum = 0;
  for (float v : losses) sum += v;
  return static_cast<float>(sum / static_cast<double>(N));
}

void Gpt::loss_gradient(int64_t micro_batches) {
  const int64_t N = B_ * T_, V = cfg_.vocab;
  // the gradient of the mean loss over all micro-batches' tokens: written (not accumulated) and
  // BF16-rounded in the op, so no zeroing or rounding pass over N x V
  if (dlosses_for_ != micro_batches) {  // (the same values every step: uploaded when they change)
    const std::vector<float> dl(static_cast<size_t>(N),
                                1.0f / static_cast<float>(N * micro_batches));
    be_.upload(dlosses_.get(), dl.data(), dl.size() * 4);
    dlosses_for_ = micro_batches;
  }
  if (logits16_)
    be_.crossentropy_softmax_forward_backward_bits(losses_.as<float>(), dlogits_.as<uint16_t>(),
                                                   logits_.as<uint16_t>(), targets_dev(),
                                                   dlosses_.as<float>(), N, V);
  else if (round_bf16())
    be_.crossentropy_softmax_forward_backward_bf16(losses_.as<float>(), dlogits_.as<uint16_t>(),
                                                   logits_.as<float>(), targets_dev(),
                                                   dlosses_.as<float>(), N, V);
  else
    be_.crossentropy_softmax_forward_backward(losses_.as<float>(), dlogits_.as<float>(),
                                              logits_.as<float>(), targets_dev(),
                                              dlosses_.as<float>(), N, V, false);
  dlogits_micro_batches_ = micro_batches;
}

void Gpt::backward(int64_t micro_batches, bool accumulate) {
  const ModelConfig& c = cfg_;
  const int64_t B = B_, T = T_, N = B * T, C = c.d_model, NH = c.n_heads, NKV = c.n_kv_heads,
                HD = C / NH;
  const int64_t QKV = (NH + 2 * NKV) * HD, F = c.d_ff, FC = fc_width(), V = c.vocab;
  if (N == 0) throw std::logic_error("backward: no forward pass to differentiate");
  if (inference_pass_)
    throw std::logic_error("backward: the last forward pass was an inference pass (set_inference)");
  const bool ln = c.norm == "layernorm", rb = round_bf16();
  auto F32 = [](const BackendBuffer& b) { return b.as<float>(); };
  auto zero = [&](const BackendBuffer& b, int64_t n) {
    be_.zero(b.get(), static_cast<size_t>(n) * 4);
  };
  if (micro_batches < 1) throw std::invalid_argument("backward: micro_batches must be >= 1");
  const WeightShadow shadow(*this);
  if (!accumulate) be_.zero(grads(), n_params_ * 4);
  if (dlogits_micro_batches_ != micro_batches)
    loss_gradient(micro_batches);  // else the forward formed it
  zero(dx_, N * C);                // (dlnf_: written by matmul_backward)
  float* head_dw = c.tied_embeddings ? g("wte") : g("lm_head.weight");
  const float* head_w = c.tied_embeddings ? p("wte") : p("lm_head.weight");
  if (round_bf16())
    be_.matmul_backward_bf16_dout(F32(dlnf_), head_dw, dlogits_.as<uint16_t>(), F32(lnf_), head_w,
                                  N, C, V, prec_);
  else
    be_.matmul_backward(F32(dlnf_), head_dw, nullptr, F32(dlogits_), F32(lnf_), head_w, N, C, V,
                        prec_);
  auto norm_bwd = [&](float* din, const float* dout, const float* in, const BackendBuffer& mean,
                      const BackendBuffer& rstd, const std::string& pre,
                      const uint16_t* dout16 = nullptr) {
    // (dout is a Dgrad output: its BF16 storage is applied where the norm reads it, rb: no pass;
    // or it was written as BF16 bits)
    if (dout16 && ln)
      be_.layernorm_backward_bits(din, g(pre + ".weight"), g(pre + ".bias"), dout16, in,
                                  p(pre + ".weight"), F32(mean), F32(rstd), N, C, rb);
    else if (dout16)
      be_.rmsnorm_backward_bits(din, g(pre + ".weight"), dout16, in, p(pre + ".weight"), F32(rstd),
                                N, C, rb);
    else if (ln)
      be_.layernorm_backward(din, g(pre + ".weight"), g(pre + ".bias"), dout, in,
                             p(pre + ".weight"), F32(mean), F32(rstd), N, C, rb, rb);
    else
      be_.rmsnorm_backward(din, g(pre + ".weight"), dout, in, p(pre + ".weight"), F32(rstd), N, C,
                           rb, rb);
  };
  // Dgrad output i as BF16 bits (see dinp16_), or null
  auto all_bf16 = [&](int64_t l, int i) { return !linear_recipe(l, i).any_quantized(); };
  auto dinp16 = [&](int64_t l, int i, int64_t width) -> uint16_t* {
    const bool bits =
        bits_on() && all_bf16(l, i) && (i != 3 || (c.activation == "gelu_tanh" && all_bf16(l, 2)));
    return bits ? bf16_buffer(dinp16_[i], N * width) : nullptr;
  };
  const float* last = c.n_layers ? F32(acts_.back().res2) : F32(emb_);
  norm_bwd(F32(dx_), F32(dlnf_), last, lnf_mean_, lnf_rstd_, "ln_f");
  // dx holds d(residual stream) at the top; walk the layers down. The norms' backward passes
  // accumulate into dx, which is how the residual branches add up.
  for (int64_t l = c.n_layers - 1; l >= 0; --l) {
    LayerActs& a = acts_[static_cast<size_t>(l)];
    const float* x_in = l == 0 ? F32(emb_) : F32(acts_[static_cast<size_t>(l - 1)].res2);
    // (dact_, dln2_, datty_, dln1_: written by linear_bwd; dfc_ by the activation's backward pass;
    // dqkv_ by attention_backward: no zeroing)
    uint16_t* const dact16 = dinp16(l, 3, F);
    linear_bwd(l, 3, dact16 ? nullptr : F32(dact_), F32(dx_), N, F, C, nullptr, dact16);
    // (dact_'s BF16 storage is applied where the activation's backward pass reads it, rb: no pass)
    // (GELU's gradient: a pending output gradient of c_fc, as in the forward pass)
    ActivationSource dgelu;
    const ActivationSource* pending = nullptr;
    if (c.activation == "gelu_tanh") {
      dgelu = ActivationSource{ActivationOp::GeluBackward,
                               a.fc16 ? nullptr : F32(a.fc),
                               dact16 ? nullptr : F32(dact_),
                               F32(dfc_),
                               N,
                               F,
                               rb,
                               rb,
                               "mlp activation gradient"};
      dgelu.inp16 = a.fc16 ? a.fc.as<uint16_t>() : nullptr;
      dgelu.dout16 = dact16;
      pending = &dgelu;
    } else if (c.activation == "squared_relu") {
      be_.squared_relu_backward(F32(dfc_), F32(a.fc), F32(dact_), N * F, rb, rb);
    } else {
      be_.swiglu_backward(F32(dfc_), F32(a.fc), F32(dact_), N, F, rb, rb);
    }
    uint16_t* const dln2_16 = dinp16(l, 2, C);
    linear_bwd(l, 2, dln2_16 ? nullptr : F32(dln2_), F32(dfc_), N, C, FC, pending, dln2_16);
    norm_bwd(F32(dx_), F32(dln2_), F32(a.res1), a.ln2_mean, a.ln2_rstd, lname(l, "ln_2"), dln2_16);
    uint16_t* const datty16 = a.in16[1] || a.qkv16 ? dinp16(l, 1, C) : nullptr;
    linear_bwd(l, 1, datty16 ? nullptr : F32(datty_), F32(dx_), N, C, C, nullptr, datty16);
    // (no rounding pass over datty_ with BF16 attention: attention_backward is its only reader and
    // reads it as bf16(dout) on both backends, so the pass would change no bit it computes)
    if (prec_ != emu::GemmPrecision::BF16) store(F32(datty_), N * C);
    // the BF16 storage of dqkv rides on the attention's own write, except with RoPE: the saved qkv
    // is post-RoPE, the GEMM's output pre-RoPE, so the gradient is rotated back first. Where
    // c_attn's GEMMs are all BF16 and dqkv is stored BF16, the attention writes it as bits (dqkv16,
    // in dqkv_'s memory) and c_attn's backward reads them: the same values, half the bytes, no
    // narrowing pass
    const bool rope = c.positions == "rope";
    uint16_t* const dqkv16 = (a.in16[1] || a.qkv16) && bits_on() && rb && !rope && all_bf16(l, 0)
                                 ? dqkv_.as<uint16_t>()
                                 : nullptr;
    if (a.in16[1] || a.qkv16)
      be_.attention_backward_bf16(
          dqkv16 ? nullptr : F32(dqkv_), dqkv16, datty16 ? nullptr : F32(datty_), datty16,
          a.qkv16 ? nullptr : F32(a.qkv), a.qkv16 ? a.qkv.as<uint16_t>() : nullptr,
          a.in16[1] ? nullptr : linear_input(l, 1), a.in16[1] ? linear_input16(l, 1) : nullptr,
          F32(a.lse), B, T, NH, NKV, HD, rb && !rope);
    else
      be_.attention_backward(F32(dqkv_), F32(datty_), F32(a.qkv), linear_input(l, 1), F32(a.lse), B,
                             T, NH, NKV, HD, prec_, rb && !rope);
    if (rope) {
      be_.rope_backward(F32(dqkv_), B, T, NH, NKV, HD);
      store(F32(dqkv_), N * QKV);
    }
    uint16_t* const dln1_16 = dinp16(l, 0, C);
    linear_bwd(l, 0, dln1_16 ? nullptr : F32(dln1_), dqkv16 ? nullptr : F32(dqkv_), N, C, QKV,
               nullptr, dln1_16, dqkv16);
    norm_bwd(F32(dx_), F32(dln1_), x_in, a.ln1_mean, a.ln1_rstd, lname(l, "ln_1"), dln1_16);
  }
  be_.embedding_backward(g("wte"), c.positions == "learned" ? g("wpe") : nullptr, F32(dx_),
                         tokens_dev(), pos_.as<int32_t>(), N, C);
  collect_stats_ = stats_active_ = false;
}

}  // namespace fp4sim::model
