#include "model/gpt.hpp"

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>
#include <utility>

#include "emu/formats.hpp"
#include "emu/fused.hpp"

namespace fp4sim::model {

int64_t ParamTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string Gpt::lname(int64_t l, const char* what) const {
  return unit_prefix(cfg_, l) + "." + what;
}

void Gpt::add(const std::string& name, std::vector<int64_t> shape) {
  ParamTensor t{name, std::move(shape), 0};
  t.offset =
      tensors_.empty() ? 0 : tensors_.back().offset + static_cast<size_t>(tensors_.back().numel());
  tensors_.push_back(t);
}

std::vector<Segment> Gpt::tensor_spans() const {
  std::vector<Segment> s;
  for (const ParamTensor& t : tensors_) s.push_back({static_cast<int64_t>(t.offset), t.numel()});
  return s;
}

const ParamTensor& Gpt::tensor(const std::string& name) const {
  for (const ParamTensor& t : tensors_)
    if (t.name == name) return t;
  throw std::out_of_range("no parameter named '" + name + "'");
}

Gpt::Gpt(const ModelConfig& cfg, Backend& backend) : cfg_(cfg), be_(backend) {
  validate(RunConfig{cfg, TrainConfig{}, RecipeConfig{}, OptimConfig{}});
  run_.model = cfg;
  high_precision_.assign(static_cast<size_t>(cfg.n_layers), true);
  recipes_.assign(static_cast<size_t>(cfg.n_layers * kLinearsPerUnit), LinearRecipe{});
  // the GPT presets' layer l: the blocks "*-", both in unit l (h.<l>); a model.pattern's block i:
  // unit i (blocks.<i>). Attention's linears are 0 and 1, the MLP's 2 and 3, Mamba-2's 4 and 5
  // (kLinearNames).
  const std::string pattern = block_pattern(cfg);
  for (size_t i = 0; i < pattern.size(); ++i) {
    const int64_t unit =
        cfg.pattern.empty() ? static_cast<int64_t>(i / 2) : static_cast<int64_t>(i);
    if (pattern[i] == '*')
      blocks_.push_back({BlockKind::Attention, unit, 0});
    else if (pattern[i] == 'M')
      blocks_.push_back({BlockKind::Mamba, unit, 4});
    else
      blocks_.push_back({BlockKind::Mlp, unit, 2});
  }
  const int64_t C = cfg.d_model, HD = C / cfg.n_heads,
                QKV = (cfg.n_heads + 2 * cfg.n_kv_heads) * HD;
  const bool has_attention = pattern.find('*') != std::string::npos;
  const bool has_mamba = pattern.find('M') != std::string::npos;
  if (has_attention && !be_.supports(Capability::AttentionHeadDim, HD))
    throw std::invalid_argument(
        "model: head size model.d_model / model.n_heads = " + std::to_string(HD) + " (" +
        std::to_string(C) + " / " + std::to_string(cfg.n_heads) + ") is not one the " + be_.name() +
        " backend's attention takes (16, 32, 64 or 128)");
  const MambaDims md = mamba_dims(cfg);
  if (has_mamba && !be_.supports(Capability::SsmConvWidth, md.W))
    throw std::invalid_argument("model: model.mamba_conv " + std::to_string(md.W) +
                                " is not a conv width the " + be_.name() + " backend takes");
  if (has_mamba && !be_.supports(Capability::SsmChunk, md.Q))
    throw std::invalid_argument("model: model.mamba_chunk " + std::to_string(md.Q) +
                                " is not a chunk the " + be_.name() + " backend's scan takes");
  for (const auto& [key, v] :
       {std::pair<const char*, int64_t>{"model.mamba_head_dim", md.P}, {"model.mamba_state", md.N}})
    if (has_mamba && !be_.supports(Capability::SsmScanSize, v))
      throw std::invalid_argument("model: " + std::string(key) + " " + std::to_string(v) +
                                  " is not a size the " + be_.name() + " backend's scan takes");
  const auto next_offset = [&] {  // the next tensor's offset
    return tensors_.empty()
               ? int64_t{0}
               : static_cast<int64_t>(tensors_.back().offset) + tensors_.back().numel();
  };
  add("wte", {cfg.vocab, C});
  if (cfg.positions == Positions::Learned) add("wpe", {cfg.max_positions, C});
  for (size_t b = 0; b < blocks_.size(); ++b) {
    const int64_t l = blocks_[b].layer;
    const std::string norm = norm_name(b);
    block_offset_.push_back(next_offset());
    add(norm + ".weight", {C});
    if (cfg.norm == NormKind::LayerNorm) add(norm + ".bias", {C});
    if (blocks_[b].kind == BlockKind::Mamba) {
      // (no biases in the projections, as Nemotron-H and mamba_ssm's Mamba2)
      add(lname(l, "mamba.in_proj.weight"), {md.in_proj_width(), C});
      add(lname(l, "mamba.conv.weight"), {md.xbc_cols(), md.W});
      add(lname(l, "mamba.conv.bias"), {md.xbc_cols()});
      add(lname(l, "mamba.dt_bias"), {md.H});
      add(lname(l, "mamba.A_log"), {md.H});
      add(lname(l, "mamba.D"), {md.H});
      add(lname(l, "mamba.norm.weight"), {md.d_inner});
      add(lname(l, "mamba.out_proj.weight"), {C, md.d_inner});
    } else if (blocks_[b].kind == BlockKind::Attention) {
      add(lname(l, "attn.c_attn.weight"), {QKV, C});
      if (cfg.bias) add(lname(l, "attn.c_attn.bias"), {QKV});
      add(lname(l, "attn.c_proj.weight"), {C, C});
      if (cfg.bias) add(lname(l, "attn.c_proj.bias"), {C});
    } else {
      // SwiGLU: c_fc produces [gate | up], 2 * d_ff rows
      add(lname(l, "mlp.c_fc.weight"), {fc_width(), C});
      if (cfg.bias) add(lname(l, "mlp.c_fc.bias"), {fc_width()});
      add(lname(l, "mlp.c_proj.weight"), {C, cfg.d_ff});
      if (cfg.bias) add(lname(l, "mlp.c_proj.bias"), {C});
    }
  }
  tail_offset_ = next_offset();
  add("ln_f.weight", {C});
  if (cfg.norm == NormKind::LayerNorm) add("ln_f.bias", {C});
  if (!cfg.tied_embeddings) add("lm_head.weight", {cfg.vocab, C});
  n_params_ = tensors_.back().offset + static_cast<size_t>(tensors_.back().numel());
  params_ = BackendBuffer(be_, n_params_ * 4, {kUseParameters, "parameters (float32)"});
  grads_ = BackendBuffer(be_, n_params_ * 4, {kUseGradients, "gradients (float32)"});
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
    for (int i = 0; i < kLinearsPerUnit; ++i)
      recipes_[static_cast<size_t>(l * kLinearsPerUnit + i)] =
          resolve_linear_recipe(run_, high_precision_, l, i, step);
}

std::string Gpt::describe_recipe() const {
  std::string s;
  for (size_t b = 0; b < blocks_.size(); ++b) {
    const int64_t l = blocks_[b].layer;
    const bool first_of_unit = b == 0 || blocks_[b - 1].layer != l;
    if (first_of_unit)  // (a preset's layer h.<l> is one line, its two blocks' four linears)
      s += std::string(b ? "\n" : "") + "block " + std::to_string(l) +
           (high_precision_[static_cast<size_t>(l)] ? " (high precision)" : "") + ":";
    for (int i = blocks_[b].linear0; i < blocks_[b].linear0 + 2; ++i) {
      const LinearRecipe& r = linear_recipe(l, i);
      s += std::string("  ") + kLinearNames[i] + " " + name_of(r.fprop) + "/" + name_of(r.dgrad) +
           "/" + name_of(r.wgrad);
    }
  }
  s += "\n";
  s += "(fprop/dgrad/wgrad per linear layer; embeddings, norms, attention and the output head in "
       "BF16)\n";
  return s;
}

std::vector<QuantStat> Gpt::take_stats() {
  std::vector<QuantStat> out;
  out.swap(stats_);
  return out;
}

std::string Gpt::pattern() const {
  std::string p;
  for (const Block& b : blocks_)
    p += b.kind == BlockKind::Attention ? '*' : (b.kind == BlockKind::Mamba ? 'M' : '-');
  return p;
}

AttentionShape Gpt::attention_shape() const {
  return {B_, T_, cfg_.n_heads, cfg_.n_kv_heads, cfg_.d_model / cfg_.n_heads};
}

bool Gpt::uses_weight_shadow() const {
  // (the BF16 recipe's every matmul reads its weight in BF16: one narrowing pass over all
  // parameters instead of one conversion per matmul; other recipes quantize most weights
  // themselves)
  return bits_on() && std::none_of(recipes_.begin(), recipes_.end(),
                                   [](const LinearRecipe& r) { return r.any_quantized(); });
}

TensorView Gpt::shadow_for_step(const std::vector<Segment>& segments) {
  // the segments, by offset, tile [0, n_params) exactly
  std::vector<std::pair<int64_t, int64_t>> segs;
  for (const Segment& s : segments) segs.emplace_back(s.offset, s.count);
  std::sort(segs.begin(), segs.end());
  int64_t end = 0;
  bool tiles = true;
  for (const auto& sg : segs) {
    tiles = tiles && sg.first == end;
    end = sg.first + sg.second;
  }
  tiles = tiles && end == static_cast<int64_t>(n_params_);
  const int64_t n = static_cast<int64_t>(n_params_);
  if (!tiles || !uses_weight_shadow() || params16_.bytes() != n_params_ * 2) return TensorView{};
  shadow_version_ = params_version_;
  return bf16_view(be_, params16_.as<uint16_t>(), 1, n, "parameters (BF16 bits)");
}

void Gpt::adamw_step(const TensorView& m, const TensorView& v, const std::vector<Segment>& segments,
                     const std::vector<AdamWStep>& steps) {
  float* const w =
      params();  // (a writable view: the shadow is stale from here unless the step writes it)
  const int64_t n = static_cast<int64_t>(n_params_);
  const TensorView p16 = shadow_for_step(segments);
  be_.adamw_update(f32_view(be_, w, 1, n, "parameters"), p16,
                   f32_view(be_, grads(), 1, n, "gradients"), m, v, segments, steps);
}

void Gpt::qadamw_step(const QAdamWState& st, const std::vector<Segment>& segments,
                      const std::vector<AdamWStep>& steps, uint64_t seed,
                      const std::vector<uint64_t>& streams) {
  float* const w = params();
  const int64_t n = static_cast<int64_t>(n_params_);
  const TensorView p16 = shadow_for_step(segments);
  be_.qadamw_update(f32_view(be_, w, 1, n, "parameters"), p16,
                    f32_view(be_, grads(), 1, n, "gradients"), st, segments, steps, seed, streams);
}

Gpt::WeightShadow::WeightShadow(Gpt& m) : m_(m) {
  if (!m.uses_weight_shadow()) return;
  const int64_t n = static_cast<int64_t>(m.n_params_);
  const void* before = m.params16_.get();
  if (m.params16_.bytes() != m.n_params_ * 2)
    m.params16_ =
        BackendBuffer(m.be_, m.n_params_ * 2, {kUseWeightShadow, "parameters (BF16 bits)"});
  // the bits of the parameters as they are unless no writable view was taken since they were made
  // (the backward pass reuses its forward pass's: one narrowing pass a step, not two)
  if (m.shadow_version_ != m.params_version_ || m.params16_.get() != before) {
    // (params_, not params(): reading does not stale the shadow)
    m.be_.convert(bf16_view(m.be_, m.params16_.as<uint16_t>(), 1, n, "parameters (BF16 bits)"),
                  f32_view(m.be_, m.params_.as<float>(), 1, n, "parameters"));
    m.shadow_version_ = m.params_version_;
  }
  m.shadow_live_ = true;
}

bool Gpt::stores_bits(int64_t l, int linear) const {
  const bool all_bf16 = !linear_recipe(l, linear).any_quantized();
  // (statistics read a quantized linear's float32 input; GELU's output stays float32 where a
  // quantizer takes it from the op: Backend::quantize_activation)
  return bits_on() && (all_bf16 || !stats_active_) && linear != 5 &&
         (linear != 3 || (all_bf16 && cfg_.activation == Activation::GeluTanh));
}

void Gpt::plan_storage() {
  for (size_t b = 0; b < blocks_.size(); ++b) {
    BlockActs& a = acts_[b];
    const int64_t l = blocks_[b].layer;
    const int l0 = blocks_[b].linear0;
    a.in16[0] = stores_bits(l, l0);
    a.in16[1] = stores_bits(l, l0 + 1);
    a.proj16 = bits_on();
    if (blocks_[b].kind == BlockKind::Attention)
      a.mid16 =
          bits_on() && cfg_.positions != Positions::Rope;  // (RoPE rotates qkv in place in float32)
    else if (blocks_[b].kind == BlockKind::Mamba)
      a.mid16 = false;  // (the SSM ops take float32)
    else  // (c_fc's output as bits: both MLP linears all BF16 with GELU, whose passes read bits)
      a.mid16 = a.in16[1] && !linear_recipe(l, 2).any_quantized();
  }
}

void Gpt::reallocate(BackendBuffer& b, size_t bytes, const char* use, const char* name) {
  b = BackendBuffer();
  b = BackendBuffer(be_, bytes, {use, name});
}

TensorView Gpt::f32(BackendBuffer& b, int64_t rows, int64_t cols, const char* name,
                    const char* use) {
  const size_t bytes = static_cast<size_t>(rows * cols) * sizeof(float);
  if (b.bytes() != bytes) reallocate(b, bytes, use, name);
  return f32_view(be_, b.as<float>(), rows, cols, name);
}

TensorView Gpt::act_view(BackendBuffer& b, int64_t rows, int64_t cols, bool bits, const char* name,
                         const char* use) {
  if (!bits) {
    TensorView v = f32(b, rows, cols, name, use);
    v.bf16_values = round_bf16();
    return v;
  }
  const size_t bytes = static_cast<size_t>(rows * cols) * sizeof(uint16_t);
  if (b.bytes() != bytes) reallocate(b, bytes, use, name);
  return bf16_view(be_, b.as<uint16_t>(), rows, cols, name);
}

TensorView Gpt::linear_input(size_t b, int i) {
  const int linear = blocks_[b].linear0 + i;
  const int64_t l = blocks_[b].layer, N = B_ * T_,
                width = linear == 3   ? cfg_.d_ff
                        : linear == 5 ? mamba_dims(cfg_).d_inner
                                      : cfg_.d_model;
  BlockActs& a = acts_[b];
  const bool bits = a.in16[i];
  static constexpr const char* kNames[kLinearsPerUnit] = {
      "ln_1 output",    "attention output",  "ln_2 output",
      "mlp activation", "mamba norm output", "mamba gated norm output"};
  // the attention output (linear 1's input) is always kept: the attention backward pass reads it
  if (linear != 1 && linear_recipe(l, linear).wgrad != GemmFormat::BF16)
    return act_view(bits ? scratch16_in_[linear] : scratch_in_[linear], N, width, bits,
                    kNames[linear]);
  return act_view(i == 0 ? a.norm : a.y, N, width, bits, kNames[linear]);
}

TensorView Gpt::param(const std::string& name) const {
  const ParamTensor& t = tensor(name);
  const int64_t rows = t.shape[0], cols = t.shape.size() > 1 ? t.shape[1] : 1;
  return f32_view(be_, params_.as<float>() + t.offset, rows, cols, t.name.c_str());
}

TensorView Gpt::param16(const std::string& name) const {
  if (!shadow_live_) return TensorView{};
  const ParamTensor& t = tensor(name);
  const int64_t rows = t.shape[0], cols = t.shape.size() > 1 ? t.shape[1] : 1;
  return bf16_view(be_, params16_.as<uint16_t>() + t.offset, rows, cols, t.name.c_str());
}

TensorView Gpt::grad(const std::string& name) const {
  const ParamTensor& t = tensor(name);
  const int64_t rows = t.shape[0], cols = t.shape.size() > 1 ? t.shape[1] : 1;
  return f32_view(be_, grads() + t.offset, rows, cols, t.name.c_str());
}

LinearWeights Gpt::linear_weights(int64_t l, int linear) const {
  const std::string name = lname(l, kLinearNames[linear]);
  LinearWeights w;
  w.weight = param(name + ".weight");
  w.weight16 = param16(name + ".weight");
  if (cfg_.bias) {
    w.bias = param(name + ".bias");
    w.bias16 = param16(name + ".bias");
  }
  return w;
}

TensorView Gpt::tokens_view() const {
  return i32_view(be_, batch_.as<int32_t>(), B_ * T_, 1, "tokens");
}
TensorView Gpt::targets_view() const {
  return i32_view(be_, batch_.as<int32_t>() + B_ * T_, B_ * T_, 1, "targets");
}

void Gpt::linear_fwd(int64_t l, int linear, size_t b, const TensorView& out, const TensorView& inp,
                     const ActivationSource* pending_input) {
  const std::string name = lname(l, kLinearNames[linear]);
  const LinearIds ids{run_.train.seed, step_, micro_batch_, l, linear};
  BlockActs& a = acts_[b];
  const int i = linear - blocks_[b].linear0;
  if (tap_ && pending_input) {  // (x must exist to be tapped; same bits)
    run_activation(be_, *pending_input);
    pending_input = nullptr;
  }
  linear_forward(be_, linear_recipe(l, linear), ids, out, inp, linear_weights(l, linear), prec_,
                 stats_active_ ? &stats_ : nullptr, name, inference_ ? nullptr : &a.saved_x[i],
                 inference_ ? nullptr : &a.saved_w[i], pending_input);
  if (tap_) {
    tap_(name, "x", inp);
    tap_(name, "y", out);
  }
}

void Gpt::linear_bwd(int64_t l, int linear, size_t b, const TensorView& dinp,
                     const TensorView& dout, const ActivationSource* pending_dout) {
  const std::string name = lname(l, kLinearNames[linear]);
  const LinearIds ids{run_.train.seed, step_, micro_batch_, l, linear};
  BlockActs& a = acts_[b];
  const int i = linear - blocks_[b].linear0;
  const LinearRecipe& r = linear_recipe(l, linear);
  // the input as the forward pass kept it, where the Wgrad reads it (else the saved copy)
  const TensorView inp = r.wgrad == GemmFormat::BF16 ? as_stored(linear_input(b, i)) : TensorView{};
  if (tap_ && pending_dout) {  // (dy must exist to be tapped; same bits)
    run_activation(be_, *pending_dout);
    pending_dout = nullptr;
  }
  const TensorView dbias = cfg_.bias ? grad(name + ".bias") : TensorView{};
  linear_backward(be_, r, ids, dinp, grad(name + ".weight"), dbias, dout, inp,
                  linear_weights(l, linear), prec_, stats_active_ ? &stats_ : nullptr, name,
                  a.saved_x[i].get(), a.saved_w[i].get(), pending_dout);
  if (tap_) {
    tap_(name, "dy", dout);
    tap_(name, "dx", dinp);
    tap_(name, "dweight", grad(name + ".weight"));
    if (dbias.present()) tap_(name, "dbias", dbias);
  }
}

TensorView Gpt::dgrad_view(int64_t l, int i, int64_t width) {
  auto all_bf16 = [&](int k) { return !linear_recipe(l, k).any_quantized(); };
  const bool bits = bits_on() && all_bf16(i) && i != 5 &&
                    (i != 3 || (cfg_.activation == Activation::GeluTanh && all_bf16(2)));
  static constexpr const char* kNames[kLinearsPerUnit] = {
      "ln_1 output gradient",    "attention output gradient",  "ln_2 output gradient",
      "mlp activation gradient", "mamba norm output gradient", "mamba gated norm output gradient"};
  if (bits) return act_view(dinp16_[i], B_ * T_, width, true, kNames[i], kUseActivationGradients);
  return f32(dinp_[i], B_ * T_, width, kNames[i], kUseActivationGradients);
}

TensorView Gpt::stream_in(size_t b) {
  const int64_t N = B_ * T_, C = cfg_.d_model;
  return b == 0 ? f32(emb_, N, C, "embeddings output")
                : f32(acts_[b - 1].res, N, C, "residual stream");
}

Gpt::NormViews Gpt::norm_views(const std::string& pre, BackendBuffer& mean, BackendBuffer& rstd) {
  const int64_t N = B_ * T_;
  const bool ln = norm_kind() == NormKind::LayerNorm;
  NormViews v;
  v.weight = param(pre + ".weight");
  v.dweight = grad(pre + ".weight");
  if (ln) {
    v.bias = param(pre + ".bias");
    v.dbias = grad(pre + ".bias");
    v.mean = f32(mean, N, 1, "norm mean");
  }
  v.rstd = f32(rstd, N, 1, "norm rstd");
  return v;
}

std::string Gpt::norm_name(size_t b) const {
  if (!cfg_.pattern.empty()) return lname(blocks_[b].layer, "norm");
  return lname(blocks_[b].layer, blocks_[b].kind == BlockKind::Attention ? "ln_1" : "ln_2");
}

Gpt::NormViews Gpt::block_norm(size_t b) {
  return norm_views(norm_name(b), acts_[b].mean, acts_[b].rstd);
}

void Gpt::norm_forward(const NormViews& n, const TensorView& out, const TensorView& in) {
  be_.norm_forward(norm_kind(), out, n.mean, n.rstd, in, n.weight, n.bias);
}

void Gpt::norm_backward(const NormViews& n, const TensorView& dout, const TensorView& in) {
  be_.norm_backward(norm_kind(), dx_view(), n.dweight, n.dbias, dout, in, n.weight, n.mean, n.rstd);
}

TensorView Gpt::proj_view(size_t b) {
  BlockActs& a = acts_[b];
  // (kept as BF16 bits in one scratch shared by every block, or in the block's float32 array)
  if (a.proj16) a.proj = BackendBuffer();
  return act_view(a.proj16 ? proj16_ : a.proj, B_ * T_, cfg_.d_model, a.proj16, "c_proj out");
}

void Gpt::init(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  // GPT-2's 1/sqrt(2 L): one factor per residual add, so 1/sqrt(blocks) for a model.pattern
  const float resid_scale = 1.0f / std::sqrt(static_cast<float>(blocks_.size()));
  std::vector<float> h(n_params_);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  auto ends_with = [](const std::string& s, const char* e) {
    const size_t n = std::char_traits<char>::length(e);
    return s.size() >= n && s.compare(s.size() - n, n, e) == 0;
  };
  for (const ParamTensor& t : tensors_) {
    float* x = h.data() + t.offset;
    // the Mamba-2 mixer's own parameters, as mamba_ssm's Mamba2 initialises them (DESIGN.md §12):
    // dt log-uniform in [1e-3, 1e-1] (floor 1e-4) and dt_bias its softplus inverse,
    // A_log = log(U[1, 16]), D = 1, the conv as PyTorch's Conv1d default U(-1/sqrt(W), 1/sqrt(W))
    // for weight and bias (fan_in = W, one input channel a group); the projections as below
    if (ends_with(t.name, ".mamba.dt_bias")) {
      for (int64_t i = 0; i < t.numel(); ++i) {
        const double dt =
            std::max(std::exp(ud(rng) * (std::log(0.1) - std::log(0.001)) + std::log(0.001)), 1e-4);
        x[i] = static_cast<float>(dt + std::log(-std::expm1(-dt)));
      }
      continue;
    }
    if (ends_with(t.name, ".mamba.A_log")) {
      for (int64_t i = 0; i < t.numel(); ++i)
        x[i] = static_cast<float>(std::log(1.0 + 15.0 * ud(rng)));
      continue;
    }
    if (ends_with(t.name, ".mamba.D")) {
      std::fill(x, x + t.numel(), 1.0f);
      continue;
    }
    if (ends_with(t.name, ".mamba.conv.weight") || ends_with(t.name, ".mamba.conv.bias")) {
      const double bound = 1.0 / std::sqrt(static_cast<double>(cfg_.mamba_conv));
      for (int64_t i = 0; i < t.numel(); ++i)
        x[i] = static_cast<float>((2.0 * ud(rng) - 1.0) * bound);
      continue;
    }
    const bool norm_weight =
        (t.name.find("ln_") != std::string::npos || t.name.find(".norm.") != std::string::npos) &&
        t.name.find(".weight") != std::string::npos;
    const bool bias = t.name.find(".bias") != std::string::npos;
    const bool resid = t.name.find("c_proj.weight") != std::string::npos ||
                       t.name.find("out_proj.weight") != std::string::npos;
    for (int64_t i = 0; i < t.numel(); ++i)
      x[i] = norm_weight ? 1.0f : (bias ? 0.0f : 0.02f * nd(rng) * (resid ? resid_scale : 1.0f));
  }
  params_from_host(h);
}

void Gpt::allocate_activations(int64_t B, int64_t T) {
  if (B == alloc_B_ && T == alloc_T_) return;
  const ModelConfig& c = cfg_;
  const int64_t N = B * T, C = c.d_model, NH = c.n_heads, HD = C / NH;
  const int64_t QKV = (NH + 2 * c.n_kv_heads) * HD, FC = fc_width(), V = c.vocab;
  // (each buffer named for the memory plan and for a failed allocation's message)
  auto f32b = [&](int64_t n, const char* what, const char* use = kUseActivations) {
    return BackendBuffer(be_, static_cast<size_t>(n) * 4, {use, what});
  };
  batch_ = f32b(2 * N, "tokens and targets", kUseBatch);
  pos_ = f32b(N, "positions", kUseBatch);
  {
    std::vector<int32_t> pos(static_cast<size_t>(N));
    for (int64_t i = 0; i < N; ++i) pos[static_cast<size_t>(i)] = static_cast<int32_t>(i % T);
    be_.upload(pos_.get(), pos.data(), static_cast<size_t>(N) * 4);
  }
  dlosses_for_ = 0;
  emb_ = f32b(N * C, "embeddings output");
  lnf_ = f32b(N * C, "ln_f output");
  lnf_mean_ = f32b(N, "ln_f mean");
  lnf_rstd_ = f32b(N, "ln_f rstd");
  losses_ = f32b(N, "losses");
  acts_.clear();
  acts_.resize(blocks_.size());
  for (size_t b = 0; b < blocks_.size(); ++b) {
    BlockActs& a = acts_[b];
    a.mean = f32b(N, "norm mean");
    a.rstd = f32b(N, "norm rstd");
    // attention's log-sum-exp rows (B,NH,T), not the (B,NH,T,T) probabilities
    if (blocks_[b].kind == BlockKind::Attention) a.lse = f32b(B * NH * T, "lse");
    a.res = f32b(N * C, "residual stream");
  }
  // (made where first used, by linear_input: only the quantized Wgrads' inputs go there)
  for (BackendBuffer& s : scratch_in_) s = BackendBuffer();
  for (BackendBuffer& s : scratch16_in_) s = BackendBuffer();
  dlosses_ = f32b(N, "dlosses");
  // (BF16 activations: dlogits stored as BF16 bits, the values the cross-entropy op writes rounded
  // anyway, so half the bytes and no conversion pass before the head's GEMMs)
  dlogits_ = round_bf16()
                 ? BackendBuffer(be_, static_cast<size_t>(N * V) * 2, {kUseLogits, "dlogits"})
                 : f32b(N * V, "dlogits", kUseLogits);
  dlnf_ = f32b(N * C, "ln_f output gradient", kUseActivationGradients);
  dx_ = f32b(N * C, "residual stream gradient", kUseActivationGradients);
  dfc_ = f32b(N * FC, "mlp.c_fc output gradient", kUseActivationGradients);
  dqkv_ = f32b(N * QKV, "dqkv", kUseActivationGradients);
  // (the linears' Dgrad outputs: made where first used, by dgrad_view, as float32 or BF16 bits)
  for (BackendBuffer& d : dinp_) d = BackendBuffer();
  for (BackendBuffer& d : dinp16_) d = BackendBuffer();
  for (BackendBuffer* d : {&dzx_, &dxbc_, &dsy_}) *d = BackendBuffer();
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
  const int64_t N = B * T, C = c.d_model, V = c.vocab;
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
  plan_storage();
  const TensorView emb = stream_in(0);
  be_.embedding_forward(emb, tokens_view(), i32_view(be_, pos_.as<int32_t>(), N, 1, "pos"),
                        param("wte"),
                        c.positions == Positions::Learned ? param("wpe") : TensorView{});
  if (round_bf16()) {
    TensorView rounded = emb;
    rounded.bf16_values = true;
    be_.convert(rounded, emb);
  }
  for (size_t b = 0; b < blocks_.size(); ++b) {
    // (block b's norm: made by the residual add of the block before, residual_after)
    if (blocks_[b].kind == BlockKind::Attention)
      attention_block_forward(b, stream_in(b), b > 0);
    else if (blocks_[b].kind == BlockKind::Mamba)
      mamba_block_forward(b, stream_in(b), b > 0);
    else
      mlp_block_forward(b, stream_in(b), b > 0);
  }
  TensorView lnf = f32(lnf_, N, C, "ln_f output");
  lnf.bf16_values = round_bf16();
  norm_forward(norm_views("ln_f", lnf_mean_, lnf_rstd_), lnf, stream_in(blocks_.size()));
  // the logits stay unrounded in memory: their BF16 storage is applied where they are read (the
  // cross-entropy op, logits_row_to_host), which saves a rounding pass over N x V (or kept as BF16
  // bits, the GEMM writing them: no bias, so cuBLASLt's BF16 output serves)
  logits16_ = bits_on();
  const std::string head = c.tied_embeddings ? "wte" : "lm_head.weight";
  const TensorView head_w = shadow_live_ ? param16(head) : param(head);
  const TensorView logits = logits16_ ? act_view(logits_, N, V, true, "logits", kUseLogits)
                                      : f32(logits_, N, V, "logits", kUseLogits);
  be_.matmul_forward(logits, as_stored(lnf), head_w, TensorView{}, prec_);
  loss_gradient(grad_micro_batches);
  std::vector<float> losses(static_cast<size_t>(N));
  be_.download(losses.data(), losses_.get(), losses.size() * 4);
  double sum = 0;
  for (float v : losses) sum += v;
  return static_cast<float>(sum / static_cast<double>(N));
}

void Gpt::loss_gradient(int64_t micro_batches) {
  const int64_t N = B_ * T_, V = cfg_.vocab;
  // the gradient of the mean loss over all micro-batches' tokens: written (not accumulated) and
  // BF16-rounded in the op, so no zeroing or rounding pass over N x V
  if (dlosses_for_ != micro_batches) {  // (the same values every step: uploaded when they change)
    // (times the loss scale, a power of two: the product is exact)
    const std::vector<float> dl(static_cast<size_t>(N),
                                1.0f / static_cast<float>(N * micro_batches) * loss_scale_);
    be_.upload(dlosses_.get(), dl.data(), dl.size() * 4);
    dlosses_for_ = micro_batches;
  }
  TensorView logits = logits16_ ? act_view(logits_, N, V, true, "logits", kUseLogits)
                                : f32(logits_, N, V, "logits", kUseLogits);
  if (!logits16_) logits.bf16_values = round_bf16();  // (read rounded)
  be_.crossentropy_forward_backward(f32(losses_, N, 1, "losses"),
                                    act_view(dlogits_, N, V, round_bf16(), "dlogits", kUseLogits),
                                    logits, targets_view(), f32(dlosses_, N, 1, "dlosses"));
  dlogits_micro_batches_ = micro_batches;
}

void Gpt::set_loss_scale(float s) {
  if (!(s >= 1.0f) || !std::isfinite(s) || std::scalbn(1.0f, std::ilogb(s)) != s)
    throw std::invalid_argument("set_loss_scale: " + std::to_string(s) +
                                " is not a finite power of two >= 1");
  if (s == loss_scale_) return;
  loss_scale_ = s;
  dlosses_for_ = 0;            // uploaded again,
  dlogits_micro_batches_ = 0;  // and the loss gradient formed again, with the new scale
}

void Gpt::backward(int64_t micro_batches, bool accumulate) {
  const ModelConfig& c = cfg_;
  const int64_t N = B_ * T_, C = c.d_model, V = c.vocab;
  if (N == 0) throw std::logic_error("backward: no forward pass to differentiate");
  if (inference_pass_)
    throw std::logic_error("backward: the last forward pass was an inference pass (set_inference)");
  if (micro_batches < 1) throw std::invalid_argument("backward: micro_batches must be >= 1");
  const WeightShadow shadow(*this);
  // A step's gradient is the ordered sum of its micro-batches' gradients, each computed from zero
  // (DESIGN.md §16, contract_version 2): a later micro-batch moves the sum so far aside, writes its
  // own gradient into grads() from zero, then grads() = sum + its gradient (one FP32 add an
  // element, in micro-batch order), so N ranks of one micro-batch each can add theirs alike.
  const auto n = static_cast<int64_t>(n_params_);
  if (accumulate) {
    if (!grad_sum_.get())
      grad_sum_ = BackendBuffer(
          be_, n_params_ * 4, {kUseGradients, "gradients of the earlier micro-batches (float32)"});
    be_.copy(grad_sum_.get(), grads(), n_params_ * 4);
  }
  be_.zero(grads(), n_params_ * 4);
  // grads()[ready_from, n) are final: with accumulate, each range is added to the earlier
  // micro-batches' sum as it completes (elementwise: the bits of one add at the end)
  int64_t ready_from = n;
  const auto ready = [&](int64_t offset) {
    if (accumulate && offset < ready_from) {
      const int64_t len = ready_from - offset;
      const TensorView g = view_of(grads() + offset, DType::F32, 1, len, be_.device(), "gradients");
      be_.axpby(
          g, 1.0f,
          view_of(grad_sum_.as<float>() + offset, DType::F32, 1, len, be_.device(), "gradient sum"),
          1.0f, g);
    }
    ready_from = offset;
    if (grads_ready_) grads_ready_(offset);
  };
  if (dlogits_micro_batches_ != micro_batches) loss_gradient(micro_batches);  // else done
  be_.zero(dx_.get(), static_cast<size_t>(N * C) * 4);  // (dlnf_: written by matmul_backward)
  const std::string head = c.tied_embeddings ? "wte" : "lm_head.weight";
  const TensorView head_w = shadow_live_ ? param16(head) : param(head);
  const TensorView dlnf = f32(dlnf_, N, C, "ln_f output gradient", kUseActivationGradients);
  be_.matmul_backward(dlnf, grad(head), TensorView{},
                      as_stored(act_view(dlogits_, N, V, round_bf16(), "dlogits", kUseLogits)),
                      f32(lnf_, N, C, "ln_f output"), head_w, prec_);
  TensorView dlnf_read = dlnf;
  dlnf_read.bf16_values = round_bf16();
  norm_backward(norm_views("ln_f", lnf_mean_, lnf_rstd_), dlnf_read, stream_in(blocks_.size()));
  ready(tail_offset_);  // ln_f and the untied head
  // dx holds d(residual stream) at the top; walk the blocks down. The norms' backward passes
  // accumulate into dx, which is how the residual branches add up.
  for (size_t b = blocks_.size(); b-- > 0;) {
    if (blocks_[b].kind == BlockKind::Attention)
      attention_block_backward(b, stream_in(b));
    else if (blocks_[b].kind == BlockKind::Mamba)
      mamba_block_backward(b, stream_in(b));
    else
      mlp_block_backward(b, stream_in(b));
    ready(block_offset_[b]);
  }
  be_.embedding_backward(
      grad("wte"), c.positions == Positions::Learned ? grad("wpe") : TensorView{},
      as_stored(dx_view()), tokens_view(), i32_view(be_, pos_.as<int32_t>(), N, 1, "pos"));
  ready(0);  // the embeddings (and a tied head's gradient with them)
  collect_stats_ = stats_active_ = false;
}

TensorView Gpt::dx_view() {
  TensorView v =
      f32(dx_, B_ * T_, cfg_.d_model, "residual stream gradient", kUseActivationGradients);
  v.bf16_values = round_bf16();
  return v;
}

size_t Gpt::saved_activation_bytes() const {
  size_t n = emb_.bytes() + lnf_.bytes() + lnf_mean_.bytes() + lnf_rstd_.bytes() + logits_.bytes() +
             losses_.bytes();
  for (const BlockActs& a : acts_) {
    for (const BackendBuffer* b : {&a.norm, &a.mean, &a.rstd, &a.qkv, &a.lse, &a.fc, &a.y, &a.proj,
                                   &a.res, &a.zx, &a.xbc, &a.dt, &a.A, &a.states, &a.sy, &a.grstd})
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
  const std::vector<Segment> spans = tensor_spans();
  std::vector<double> sums(spans.size());
  be_.sum_squares(f32_view(be_, params(), 1, static_cast<int64_t>(n_params_), "parameters"), spans,
                  sums.data());
  for (size_t i = 0; i < sums.size(); ++i)
    if (!std::isfinite(sums[i])) return "parameter '" + tensors_[i].name + "'";
  const int64_t n = B_ * T_ * cfg_.d_model;
  auto bad = [&](const BackendBuffer& b) {
    if (n == 0 || b.bytes() != static_cast<size_t>(n) * 4) return false;  // (not kept as FP32 here)
    double sum = 0;
    be_.sum_squares(f32_view(be_, b.as<float>(), 1, n, "residual stream"), {{0, n}}, &sum);
    return !std::isfinite(sum);
  };
  if (bad(emb_)) return "the embeddings' output (wte + wpe)";
  for (size_t b = 0; b < acts_.size(); ++b)
    if (bad(acts_[b].res))
      return "the residual stream after " + unit_prefix(cfg_, blocks_[b].layer) + " (" +
             (blocks_[b].kind == BlockKind::Attention ? "attention"
              : blocks_[b].kind == BlockKind::Mamba   ? "Mamba-2"
                                                      : "MLP") +
             ")";
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

}  // namespace fp4sim::model
