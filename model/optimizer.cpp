#include "model/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "emu/optim.hpp"
#include "model/linear.hpp"
#include "model/memory_plan.hpp"
#include "model/root_table.hpp"

namespace fp4sim::model {

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

int64_t rows_of(const ParamTensor& t) { return t.shape.size() == 2 ? t.shape[0] : 1; }
int64_t cols_of(const ParamTensor& t) { return t.shape.empty() ? 1 : t.shape.back(); }

// rows [row0, row0 + rows) of the float32 matrix at p with `cols` columns, as a dense view
TensorView rows_view(Backend& be, float* p, int64_t row0, int64_t rows, int64_t cols,
                     const char* name) {
  return view_of(p + row0 * cols, DType::F32, rows, cols, be.device(), name);
}

// The first `rows` x `cols` of a scratch buffer
TensorView scratch_view(Backend& be, const BackendBuffer& b, int64_t rows, int64_t cols,
                        const char* name) {
  return view_of(const_cast<void*>(b.get()), DType::F32, rows, cols, be.device(), name);
}

// The leading rows x cols of a quantized copy allocated for more elements
QuantizedView shaped(const QuantizedCopy& q, int64_t rows, int64_t cols) {
  QuantizedView v = q.view;
  v.rows = rows;
  v.cols = cols;
  return v;
}

// NVFP4 1x16 along K, RN, no RHT, no Four Over Six (§13's Q-Root operands)
QuantizeConfig ns_quantize(bool rowwise, bool columnwise) {
  QuantizeConfig q;
  q.format = QFormat::NVFP4;
  q.rowwise.enabled = rowwise;
  q.columnwise.enabled = columnwise;
  q.columnwise.stream = 1;  // (RN draws nothing; the streams only differ, as quantize asks)
  return q;
}

// 0.99, 0.9: as a person writes it
std::string short_number(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}

}  // namespace

RootTable parse_root_table(const std::string& json_text, const std::string& source) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::parse_error& e) {
    throw std::invalid_argument(source + ": not JSON (" + e.what() + ")");
  }
  if (!j.is_object() || !j.contains("shapes") || !j.at("shapes").is_array())
    throw std::invalid_argument(source + ": expected an object with a \"shapes\" array");
  RootTable t;
  const nlohmann::json& shapes = j.at("shapes");
  for (size_t i = 0; i < shapes.size(); ++i) {
    const nlohmann::json& e = shapes[i];
    const std::string where = source + ": shapes[" + std::to_string(i) + "]";
    if (!e.is_object()) throw std::invalid_argument(where + " is not an object");
    for (const auto& [key, value] : e.items())
      if (key != "min" && key != "max" && key != "a" && key != "b" && key != "c")
        throw std::invalid_argument(where + ": unknown key '" + key +
                                    "' (an entry has min, max, a, b, c)");
    RootTableEntry r;
    for (const char* key : {"min", "max"}) {
      if (!e.contains(key))
        throw std::invalid_argument(where + ": key '" + key + "' missing (a shape key: the " + key +
                                    " of the matrix's rows and columns)");
      if (!e.at(key).is_number_integer() || e.at(key).get<int64_t>() < 1)
        throw std::invalid_argument(where + ": shape key '" + key + "' is " + e.at(key).dump() +
                                    ", not a positive integer");
    }
    r.min = e.at("min").get<int64_t>();
    r.max = e.at("max").get<int64_t>();
    if (r.min > r.max)
      throw std::invalid_argument(where + ": shape key min " + std::to_string(r.min) +
                                  " is larger than max " + std::to_string(r.max));
    float* coef[3] = {&r.coef.a, &r.coef.b, &r.coef.c};
    const char* names[3] = {"a", "b", "c"};
    for (int k = 0; k < 3; ++k) {
      if (!e.contains(names[k]) || !e.at(names[k]).is_number() ||
          !std::isfinite(e.at(names[k]).get<double>()))
        throw std::invalid_argument(where + ": coefficient '" + names[k] +
                                    "' missing or not a finite number");
      *coef[k] = e.at(names[k]).get<float>();
    }
    for (const RootTableEntry& o : t)
      if (o.min == r.min && o.max == r.max)
        throw std::invalid_argument(where + ": shape (" + std::to_string(r.min) + ", " +
                                    std::to_string(r.max) + ") is listed twice");
    t.push_back(r);
  }
  return t;
}

const RootTable& builtin_root_table() {
  static const RootTable t =
      parse_root_table(kRootTableJson, "configs/optim/root_ns_coefficients.json (compiled in)");
  return t;
}

RootTable load_root_table(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::invalid_argument("optim.root_table: cannot read '" + path + "'");
  std::stringstream text;
  text << f.rdbuf();
  return parse_root_table(text.str(), "optim.root_table " + path);
}

std::optional<NsCoefficients> root_table_coefficients(const RootTable& t, int64_t rows,
                                                      int64_t cols) {
  const int64_t lo = std::min(rows, cols), hi = std::max(rows, cols);
  for (const RootTableEntry& e : t)
    if (e.min == lo && e.max == hi) return e.coef;
  return std::nullopt;
}

std::optional<NsCoefficients> root_table_coefficients(int64_t rows, int64_t cols) {
  return root_table_coefficients(builtin_root_table(), rows, cols);
}

NewtonSchulz::NewtonSchulz(Backend& be, int64_t max_small, int64_t max_elems, NsPrecision precision)
    : be_(be), max_small_(max_small), max_elems_(max_elems), precision_(precision) {
  const size_t mn = static_cast<size_t>(max_elems) * 4,
               mm = static_cast<size_t>(max_small * max_small) * 4;
  auto buf = [&](size_t bytes, const char* what) {
    return BackendBuffer(be, bytes, {kUseOptimizerScratch, what});
  };
  x_ = buf(mn, "Newton–Schulz X");
  xt_ = buf(mn, "Newton–Schulz X^T / clamped X");
  bx_ = buf(mn, "Newton–Schulz B X");
  a_ = buf(mm, "Newton–Schulz A");
  aa_ = buf(mm, "Newton–Schulz A A, B");
  if (precision != NsPrecision::NVFP4) {
    at_ = buf(mm, "Newton–Schulz A^T");
    return;
  }
  auto q = [&](int64_t elems, const char* what) {
    return std::make_unique<QuantizedCopy>(be, 1, elems, QFormat::NVFP4, false, false, false,
                                           BufferLabel{kUseOptimizerScratch, what});
  };
  qx_row_ = q(max_elems, "Newton–Schulz X (NVFP4, along its rows)");
  qx_col_ = q(max_elems, "Newton–Schulz X (NVFP4, along its columns)");
  qa_row_ = q(max_small * max_small, "Newton–Schulz A (NVFP4, along its rows)");
  qa_col_ = q(max_small * max_small, "Newton–Schulz A (NVFP4, along its columns)");
  qb_row_ = q(max_small * max_small, "Newton–Schulz B (NVFP4)");
}

size_t NewtonSchulz::bytes() const {
  size_t b = x_.bytes() + xt_.bytes() + bx_.bytes() + a_.bytes() + at_.bytes() + aa_.bytes();
  for (const auto* q : {&qx_row_, &qx_col_, &qa_row_, &qa_col_, &qb_row_})
    if (*q) b += (*q)->bytes();
  return b;
}

void NewtonSchulz::run(const TensorView& g, const TensorView& out, const NsOptions& o) {
  const bool tall = g.rows > g.cols;
  const int64_t m = std::min(g.rows, g.cols), n = std::max(g.rows, g.cols);
  if (m > max_small_ || m * n > max_elems_)
    throw std::logic_error("NewtonSchulz: tensor '" + std::string(g.name) +
                           "' is larger than the " + "scratch it was made for");
  if (o.precision != precision_) throw std::logic_error("NewtonSchulz: made for another precision");
  Backend& be = be_;
  const TensorView X = scratch_view(be, x_, m, n, "Newton–Schulz X");
  const TensorView A = scratch_view(be, a_, m, m, "Newton–Schulz A");
  const TensorView AA = scratch_view(be, aa_, m, m, "Newton–Schulz A A");
  const TensorView BX = scratch_view(be, bx_, m, n, "Newton–Schulz B X");
  if (tall)
    be.transpose(X, g);
  else
    be.copy(X.data, g.data, static_cast<size_t>(m * n) * 4);
  // X / (||X||_F + 1e-7), as X times the FP32 reciprocal of the FP32 sum
  const float norm = be.frobenius_norm(X);
  be.axpby(X, fdiv_rn(1.0f, fadd_rn(norm, 1e-7f)), X, 0.0f, TensorView{});
  const NsCoefficients k = o.coef;
  GemmConfig gc;
  gc.impl = o.impl;
  for (int it = 0; it < o.iterations; ++it) {
    if (o.precision == NsPrecision::NVFP4) {
      // X's two copies (along n for X X^T, along m for B X) from X, or from X clamped to
      // +-quantile(|X|, q); A's two copies for A A; B's one
      TensorView xq = X;
      if (o.clip_quantile < 1.0) {
        xq = scratch_view(be, xt_, m, n, "Newton–Schulz X clamped");
        be.clamp(xq, X, be.abs_quantile(X, o.clip_quantile));
      }
      QuantizedView xr = shaped(*qx_row_, m, n), xc = shaped(*qx_col_, n, m);
      be.quantize(xq, ns_quantize(true, true), &xr, &xc);
      be.gemm(xr, xr, nullptr, gc, A);
      QuantizedView ar = shaped(*qa_row_, m, m), ac = shaped(*qa_col_, m, m);
      be.quantize(A, ns_quantize(true, true), &ar, &ac);
      be.gemm(ar, ac, nullptr, gc, AA);
      be.axpby(AA, k.b, A, k.c, AA);  // B = b A + c A A
      QuantizedView br = shaped(*qb_row_, m, m);
      be.quantize(AA, ns_quantize(true, false), &br, nullptr);
      be.gemm(br, xc, nullptr, gc, BX);
    } else {
      const GemmPrecision p =
          o.precision == NsPrecision::BF16 ? GemmPrecision::BF16 : GemmPrecision::FP32;
      const TensorView At = scratch_view(be, at_, m, m, "Newton–Schulz A^T");
      const TensorView Xt = scratch_view(be, xt_, n, m, "Newton–Schulz X^T");
      be.matmul_forward(A, X, X, TensorView{}, p);  // A = X X^T
      be.transpose(At, A);
      be.matmul_forward(AA, A, At, TensorView{}, p);  // A A
      be.axpby(AA, k.b, A, k.c, AA);                  // B = b A + c A A
      be.transpose(Xt, X);
      be.matmul_forward(BX, AA, Xt, TensorView{}, p);  // B X
    }
    be.axpby(X, k.a, X, 1.0f, BX);  // X = a X + B X
  }
  if (tall)
    be.transpose(out, X);
  else
    be.copy(out.data, X.data, static_cast<size_t>(m * n) * 4);
}

std::vector<OrthoTensor> orthogonalised_tensors(const Gpt& model) {
  const ModelConfig& c = model.config();
  const int64_t HD = c.d_model / c.n_heads;
  std::vector<OrthoTensor> out;
  const std::vector<ParamTensor>& ts = model.tensors();
  for (size_t i = 0; i < ts.size(); ++i) {
    const std::string& n = ts[i].name;
    if (ts[i].shape.size() != 2) continue;
    OrthoTensor o;
    o.tensor = i;
    auto split = [&](std::initializer_list<std::pair<const char*, int64_t>> parts) {
      int64_t r = 0;
      for (const auto& [name, rows] : parts) {
        o.parts.push_back({name, r, rows});
        r += rows;
      }
      if (r != ts[i].shape[0])
        throw std::logic_error("orthogonalised_tensors: '" + n + "' has " +
                               std::to_string(ts[i].shape[0]) + " rows, its parts " +
                               std::to_string(r));
    };
    if (ends_with(n, ".attn.c_attn.weight")) {
      split({{"q", c.n_heads * HD}, {"k", c.n_kv_heads * HD}, {"v", c.n_kv_heads * HD}});
    } else if (ends_with(n, ".mlp.c_fc.weight") && c.activation == Activation::SwiGLU) {
      split({{"gate", c.d_ff}, {"up", c.d_ff}});
    } else if (ends_with(n, ".mamba.in_proj.weight")) {
      const MambaDims d = mamba_dims(c);
      split({{"z", d.d_inner}, {"x", d.d_inner}, {"B", d.G * d.N}, {"C", d.G * d.N}, {"dt", d.H}});
    } else if (ends_with(n, ".attn.c_proj.weight") || ends_with(n, ".mlp.c_fc.weight") ||
               ends_with(n, ".mlp.c_proj.weight") || ends_with(n, ".mamba.out_proj.weight")) {
      o.parts.push_back({"", 0, ts[i].shape[0]});
    } else {
      continue;
    }
    out.push_back(std::move(o));
  }
  return out;
}

Optimizer::Optimizer(const RunConfig& c, Gpt& model, std::vector<bool> owned)
    : c_(c), model_(model), owned_(std::move(owned)) {
  Backend& be = model.backend();
  const std::vector<ParamTensor>& ts = model.tensors();
  is_ortho_.assign(ts.size(), false);
  if (owned_.empty()) owned_.assign(ts.size(), true);
  if (owned_.size() != ts.size())
    throw std::logic_error("Optimizer: owned has " + std::to_string(owned_.size()) + " flags for " +
                           std::to_string(ts.size()) + " tensors");
  sharded_ = std::find(owned_.begin(), owned_.end(), false) != owned_.end();
  state_offset_.assign(ts.size(), -1);
  for (size_t i = 0; i < ts.size(); ++i)
    if (owned_[i]) {
      state_offset_[i] = sharded_ ? n_state_ : static_cast<int64_t>(ts[i].offset);
      n_state_ += ts[i].numel();
    }
  const size_t n = static_cast<size_t>(n_state_);
  if (c.optim.name != OptimizerName::AdamW) {
    for (OrthoTensor& o : orthogonalised_tensors(model))
      if (owned_[o.tensor]) ortho_.push_back(std::move(o));
  }
  if (c.optim.name == OptimizerName::Root)
    root_table_ =
        c.optim.root_table.empty() ? builtin_root_table() : load_root_table(c.optim.root_table);
  int64_t max_small = 0, max_elems = 0, max_tensor = 0;
  for (const OrthoTensor& o : ortho_) {
    is_ortho_[o.tensor] = true;
    const ParamTensor& t = ts[o.tensor];
    max_tensor = std::max(max_tensor, t.numel());
    for (const MatrixPart& p : o.parts) {
      const int64_t cols = cols_of(t);
      if (c.optim.ns_precision == NsPrecision::NVFP4 && (p.rows % 16 != 0 || cols % 16 != 0))
        throw std::invalid_argument(
            "optim.ns_precision=nvfp4 quantizes the Newton–Schulz products in 16-blocks along "
            "both sides of each matrix: tensor '" +
            t.name + "'" + (p.name.empty() ? "" : " sub-matrix " + p.name) + " is " +
            std::to_string(p.rows) + " x " + std::to_string(cols) +
            " (use optim.ns_precision=fp32 or bf16)");
      max_small = std::max(max_small, std::min(p.rows, cols));
      max_elems = std::max(max_elems, p.rows * cols);
    }
  }
  const std::vector<Segment> spans = model.tensor_spans();
  for (size_t i = 0; i < ts.size(); ++i)
    if (owned_[i] && !is_ortho_[i]) {
      adamw_segs_.push_back(spans[i]);
      adamw_tensors_.push_back(i);
    }
  const bool fp32_state = c.optim.state == OptimState::FP32;
  if (fp32_state || !ortho_.empty()) {
    m_ = BackendBuffer(be, n * 4,
                       {kUseOptimizerState, ortho_.empty() ? "AdamW m"
                                            : fp32_state   ? "AdamW m, momentum"
                                                           : "momentum"});
    be.zero(m_.get(), n * 4);
  }
  if (fp32_state) {
    v_ = BackendBuffer(be, n * 4, {kUseOptimizerState, "AdamW v"});
    be.zero(v_.get(), n * 4);
  }
  allocate_adamw_state();
  if (!ortho_.empty()) {
    g_ = BackendBuffer(be, static_cast<size_t>(max_tensor) * 4, {kUseOptimizerScratch, "g'"});
    ns_ = std::make_unique<NewtonSchulz>(be, max_small, max_elems, c.optim.ns_precision);
  }
}

void Optimizer::allocate_adamw_state() {
  Backend& be = model_.backend();
  const size_t n = static_cast<size_t>(n_state_);
  auto zeroed = [&](size_t bytes, const char* what) {
    BackendBuffer b(be, bytes, {kUseOptimizerState, what});
    if (bytes) be.zero(b.get(), bytes);
    return b;
  };
  if (c_.optim.state == OptimState::BF16) {
    m16_ = zeroed(n * 2, "AdamW m (BF16)");
    v16_ = zeroed(n * 2, "AdamW v (BF16)");
  }
  if (c_.optim.state != OptimState::NVFP4) return;
  const std::vector<ParamTensor>& ts = model_.tensors();
  for (size_t i : adamw_tensors_) {
    const ParamTensor& t = ts[i];
    if (cols_of(t) % c_.optim.v_tile == 0) {
      q_tensors_.push_back(i);
      q_segs_.push_back({static_cast<int64_t>(t.offset), t.numel()});
      q_elems_ += t.numel();
    } else {
      fb_tensors_.push_back(i);
      fb_offset_.push_back(fb_elems_);
      fb_elems_ += t.numel();
    }
  }
  const size_t q = static_cast<size_t>(q_elems_);
  qm_codes_ = zeroed(q / 2, "Q-AdamW m codes");
  qm_scales_ = zeroed(q / 16, "Q-AdamW m scales");
  qv_codes_ = zeroed(q / 2, "Q-AdamW v codes");
  qv_scales_ = zeroed(q / 16, "Q-AdamW v scales");
  qv_mean_ = zeroed(q / static_cast<size_t>(c_.optim.v_tile) * 2, "Q-AdamW v tile means");
  if (c_.optim.v_floor == VFloor::TileMin)
    qv_floor_ = zeroed(q / static_cast<size_t>(c_.optim.v_tile) * 2, "Q-AdamW v tile floors");
  q_amax_ = zeroed(q_tensors_.size() * 4 * 4, "Q-AdamW amaxes");
  fb_m_ = zeroed(static_cast<size_t>(fb_elems_) * 4, "AdamW m (float32, Q-AdamW's others)");
  fb_v_ = zeroed(static_cast<size_t>(fb_elems_) * 4, "AdamW v (float32, Q-AdamW's others)");
}

QAdamWState Optimizer::q_state() const {
  const Device d = model_.backend().device();
  const int64_t q = q_elems_;
  QAdamWState st;
  st.m_codes = view_of(qm_codes_.get(), DType::U8, 1, q / 2, d, "Q-AdamW m codes");
  st.m_scales = view_of(qm_scales_.get(), DType::U8, 1, q / 16, d, "Q-AdamW m scales");
  st.v_codes = view_of(qv_codes_.get(), DType::U8, 1, q / 2, d, "Q-AdamW v codes");
  st.v_scales = view_of(qv_scales_.get(), DType::U8, 1, q / 16, d, "Q-AdamW v scales");
  st.v_mean =
      view_of(qv_mean_.get(), DType::BF16, 1, q / c_.optim.v_tile, d, "Q-AdamW v tile means");
  if (qv_floor_.get())
    st.v_floor =
        view_of(qv_floor_.get(), DType::BF16, 1, q / c_.optim.v_tile, d, "Q-AdamW v tile floors");
  st.amax = view_of(q_amax_.get(), DType::F32, 1, static_cast<int64_t>(q_tensors_.size()) * 4, d,
                    "Q-AdamW amaxes");
  st.v_tile = c_.optim.v_tile;
  return st;
}

size_t Optimizer::state_bytes() const {
  size_t b = 0;
  for (const BackendBuffer* x : {&m_, &v_, &m16_, &v16_, &qm_codes_, &qm_scales_, &qv_codes_,
                                 &qv_scales_, &qv_mean_, &qv_floor_, &fb_m_, &fb_v_})
    b += x->bytes();
  return b + q_tensors_.size() * 2 * 4;  // the amaxes kept (the other two a tensor are scratch)
}

void Optimizer::step(double lr, int64_t t, float grad_scale) {
  const TrainConfig& tc = c_.train;
  if (!adamw_segs_.empty()) {
    Backend& be = model_.backend();
    const int64_t n = static_cast<int64_t>(model_.num_params());
    const AdamWStep s = make_adamw_step(static_cast<float>(lr), static_cast<float>(tc.beta1),
                                        static_cast<float>(tc.beta2), static_cast<float>(tc.eps),
                                        static_cast<float>(tc.weight_decay), t, grad_scale);
    // weight decay on matrices only (wte, wpe, the linear weights), not on 1-D tensors (biases,
    // norm weights), as nanoGPT does
    auto step_of = [&](size_t i) {
      AdamWStep si = s;
      if (model_.tensors()[i].shape.size() < 2) si.weight_decay = 0.0f;
      return si;
    };
    std::vector<AdamWStep> steps;
    switch (c_.optim.state) {
      case OptimState::FP32:  // every AdamW tensor in one backend call
      case OptimState::BF16: {
        const bool bf = c_.optim.state == OptimState::BF16;
        const DType dt = bf ? DType::BF16 : DType::F32;
        const void* m = bf ? m16_.get() : m_.get();
        const void* v = bf ? v16_.get() : v_.get();
        if (!sharded_) {
          for (size_t i : adamw_tensors_) steps.push_back(step_of(i));
          model_.adamw_step(view_of(m, dt, 1, n, be.device(), "adamw m"),
                            view_of(v, dt, 1, n, be.device(), "adamw v"), adamw_segs_, steps);
          break;
        }
        // ZeRO-1: the owned tensors' state lies packed, one call a tensor (the same elementwise
        // update: the same bits)
        float* const params = model_.params();
        const size_t es = bf ? 2 : 4;
        for (size_t i : adamw_tensors_) {
          const ParamTensor& pt = model_.tensors()[i];
          const int64_t cnt = pt.numel();
          auto at = [&](const void* base, int64_t off, size_t size, DType d, const char* name) {
            return view_of(static_cast<const char*>(base) + static_cast<size_t>(off) * size, d, 1,
                           cnt, be.device(), name);
          };
          be.adamw_update(at(params, pt.offset, 4, DType::F32, "parameters"), TensorView{},
                          at(model_.grads(), pt.offset, 4, DType::F32, "gradients"),
                          at(m, state_offset_[i], es, dt, "adamw m"),
                          at(v, state_offset_[i], es, dt, "adamw v"), {{0, cnt}}, {step_of(i)});
        }
        break;
      }
      case OptimState::NVFP4: {
        if (!q_segs_.empty()) {
          std::vector<uint64_t> streams;
          for (size_t i : q_tensors_) {
            steps.push_back(step_of(i));
            // m's SR stream: a role no linear layer's copy takes (DESIGN.md §13), the tensor's
            // index as the layer (sr_stream refuses an index past its 12-bit field: 4096 tensors)
            streams.push_back(
                sr_stream(t, 0, static_cast<int64_t>(i), 7, TensorRole::OptimizerState, 0));
          }
          model_.qadamw_step(q_state(), q_segs_, steps, c_.train.seed, streams);
        }
        // the tensors that keep float32 state, one call each on their packed state (params()
        // only where there are any: it marks the BF16 weight shadow the step just wrote stale)
        float* const params = fb_tensors_.empty() ? nullptr : model_.params();
        for (size_t k = 0; k < fb_tensors_.size(); ++k) {
          const ParamTensor& pt = model_.tensors()[fb_tensors_[k]];
          const int64_t cnt = pt.numel();
          auto at = [&](const void* base, int64_t off, const char* name) {
            return view_of(static_cast<const float*>(base) + off, DType::F32, 1, cnt, be.device(),
                           name);
          };
          be.adamw_update(
              at(params, pt.offset, "parameters"), TensorView{},
              at(model_.grads(), pt.offset, "gradients"), at(fb_m_.get(), fb_offset_[k], "adamw m"),
              at(fb_v_.get(), fb_offset_[k], "adamw v"), {{0, cnt}}, {step_of(fb_tensors_[k])});
        }
        break;
      }
    }
  }
  if (!ortho_.empty()) ortho_step(lr, grad_scale);
}

void Optimizer::ortho_step(double lr, float grad_scale) {
  Backend& be = model_.backend();
  const OptimConfig& oc = c_.optim;
  const bool root = oc.name == OptimizerName::Root;
  const float mu = static_cast<float>(oc.momentum);
  // p * (1 - lr * wd): the factor rounded once from FP64
  const float decay = static_cast<float>(1.0 - lr * c_.train.weight_decay);
  float* const params = model_.params();  // (marks the BF16 weight shadow stale)
  for (const OrthoTensor& o : ortho_) {
    const ParamTensor& t = model_.tensors()[o.tensor];
    const int64_t R = rows_of(t), C = cols_of(t);
    const TensorView grad = rows_view(be, model_.grads() + t.offset, 0, R, C, "gradient");
    const TensorView buf =
        rows_view(be, m_.as<float>() + state_offset_[o.tensor], 0, R, C, "momentum");
    const TensorView g = rows_view(be, g_.as<float>(), 0, R, C, "g'");
    be.axpby(g, grad_scale, grad, 0.0f, TensorView{});  // g = grad * grad_scale
    be.axpby(buf, mu, buf, 1.0f, g);                    // buf = mu * buf + g
    be.axpby(g, 1.0f, g, mu, buf);                      // g' = g + mu * buf
    for (const MatrixPart& p : o.parts) {
      const TensorView gp = rows_view(be, g_.as<float>(), p.row0, p.rows, C, "g' sub-matrix");
      NsOptions ns;
      ns.precision = oc.ns_precision;
      ns.impl = c_.recipe.gemm;
      ns.clip_quantile = oc.ns_precision == NsPrecision::NVFP4 ? oc.ns_clip_quantile : 1.0;
      if (root) {
        // the soft threshold eps = quantile(|g'|, 0.9) + 1e-9, and the shape's coefficients
        const float eps = fadd_rn(be.abs_quantile(gp, 0.9), 1e-9f);
        be.clamp(gp, gp, eps);
        if (const std::optional<NsCoefficients> k = root_table_coefficients(root_table_, p.rows, C))
          ns.coef = *k;
      }
      ns_->run(gp, gp, ns);
      const float step =
          static_cast<float>(lr * 0.2 * std::sqrt(static_cast<double>(std::max(p.rows, C))));
      const TensorView w = rows_view(be, params + t.offset, p.row0, p.rows, C, "weight");
      be.axpby(w, decay, w, -step, gp);
    }
  }
}

size_t Optimizer::scratch_bytes() const { return g_.bytes() + (ns_ ? ns_->bytes() : 0); }

namespace {

StoredTensor stored(const std::string& dtype, std::vector<int64_t> shape, const void* data,
                    size_t bytes) {
  StoredTensor t{dtype, std::move(shape), std::vector<uint8_t>(bytes)};
  if (bytes) std::memcpy(t.bytes.data(), data, bytes);
  return t;
}

template <class T>
std::vector<T> download_all(Backend& be, const BackendBuffer& b) {
  std::vector<T> h(b.bytes() / sizeof(T));
  if (b.bytes()) be.download(h.data(), b.get(), b.bytes());
  return h;
}

}  // namespace

void Optimizer::save(TensorMap& out) const {
  Backend& be = model_.backend();
  const std::vector<ParamTensor>& ts = model_.tensors();
  const std::vector<float> hm = download_all<float>(be, m_), hv = download_all<float>(be, v_);
  const std::vector<uint16_t> hm16 = download_all<uint16_t>(be, m16_),
                              hv16 = download_all<uint16_t>(be, v16_);
  for (size_t i = 0; i < ts.size(); ++i) {
    if (!owned_[i]) continue;
    const ParamTensor& t = ts[i];
    const size_t o = static_cast<size_t>(state_offset_[i]);
    if (is_ortho_[i]) {
      out[t.name + ".momentum_buffer"] = f32_tensor(hm.data() + o, t.shape, t.numel());
    } else if (c_.optim.state == OptimState::FP32) {
      out[t.name + ".exp_avg"] = f32_tensor(hm.data() + o, t.shape, t.numel());
      out[t.name + ".exp_avg_sq"] = f32_tensor(hv.data() + o, t.shape, t.numel());
    } else if (c_.optim.state == OptimState::BF16) {
      const size_t bytes = static_cast<size_t>(t.numel()) * 2;
      out[t.name + ".exp_avg"] = stored("BF16", t.shape, hm16.data() + o, bytes);
      out[t.name + ".exp_avg_sq"] = stored("BF16", t.shape, hv16.data() + o, bytes);
    }
  }
  if (c_.optim.state != OptimState::NVFP4) return;
  const std::vector<uint8_t> mc = download_all<uint8_t>(be, qm_codes_),
                             ms = download_all<uint8_t>(be, qm_scales_),
                             vc = download_all<uint8_t>(be, qv_codes_),
                             vs = download_all<uint8_t>(be, qv_scales_);
  const std::vector<uint16_t> mean = download_all<uint16_t>(be, qv_mean_),
                              floor = download_all<uint16_t>(be, qv_floor_);
  const std::vector<float> amax = download_all<float>(be, q_amax_);
  const int64_t T = c_.optim.v_tile;
  int64_t o = 0;  // the tensor's state offset
  for (size_t k = 0; k < q_tensors_.size(); ++k) {
    const ParamTensor& t = ts[q_tensors_[k]];
    const int64_t cnt = t.numel();
    const std::string& w = t.name;
    out[w + ".exp_avg.codes"] = stored("U8", {cnt / 2}, mc.data() + o / 2, cnt / 2);
    out[w + ".exp_avg.scales"] = stored("U8", {cnt / 16}, ms.data() + o / 16, cnt / 16);
    out[w + ".exp_avg_sq.codes"] = stored("U8", {cnt / 2}, vc.data() + o / 2, cnt / 2);
    out[w + ".exp_avg_sq.scales"] = stored("U8", {cnt / 16}, vs.data() + o / 16, cnt / 16);
    out[w + ".exp_avg_sq.tile_mean"] =
        stored("BF16", {cnt / T}, mean.data() + o / T, static_cast<size_t>(cnt / T) * 2);
    if (!floor.empty())
      out[w + ".exp_avg_sq.tile_floor"] =
          stored("BF16", {cnt / T}, floor.data() + o / T, static_cast<size_t>(cnt / T) * 2);
    out[w + ".qadamw_amax"] = stored("F32", {2}, amax.data() + 2 * k, 8);
    o += cnt;
  }
  const std::vector<float> fm = download_all<float>(be, fb_m_), fv = download_all<float>(be, fb_v_);
  for (size_t k = 0; k < fb_tensors_.size(); ++k) {
    const ParamTensor& t = ts[fb_tensors_[k]];
    out[t.name + ".exp_avg"] = f32_tensor(fm.data() + fb_offset_[k], t.shape, t.numel());
    out[t.name + ".exp_avg_sq"] = f32_tensor(fv.data() + fb_offset_[k], t.shape, t.numel());
  }
}

void Optimizer::load(const TensorMap& in, const std::string& where) {
  Backend& be = model_.backend();
  const std::vector<ParamTensor>& ts = model_.tensors();
  // the named tensor's bytes, refused unless it has this dtype and shape
  auto take = [&](const std::string& name, const char* dtype, const std::vector<int64_t>& shape,
                  void* dst, size_t bytes) {
    const auto it = in.find(name);
    if (it == in.end())
      throw std::runtime_error(where + ": optimizer tensor '" + name +
                               "' missing (optim.name=" + name_of(c_.optim.name) +
                               ", optim.state=" + name_of(c_.optim.state) + " reads it)");
    const StoredTensor& st = it->second;
    if (st.dtype != dtype || st.shape != shape || st.bytes.size() != bytes) {
      std::string want;
      for (int64_t d : shape) want += (want.empty() ? "" : ", ") + std::to_string(d);
      throw std::runtime_error(where + ": optimizer tensor '" + name + "' is not " + dtype + " [" +
                               want + "]");
    }
    if (bytes) std::memcpy(dst, st.bytes.data(), bytes);
  };
  auto upload = [&](const BackendBuffer& b, const void* h) {
    if (b.bytes()) be.upload(b.get(), h, b.bytes());
  };
  std::vector<float> hm(m_.bytes() / 4, 0.0f), hv(v_.bytes() / 4, 0.0f);
  std::vector<uint16_t> hm16(m16_.bytes() / 2, 0), hv16(v16_.bytes() / 2, 0);
  for (size_t i = 0; i < ts.size(); ++i) {
    if (!owned_[i]) continue;
    const ParamTensor& t = ts[i];
    const size_t cnt = static_cast<size_t>(t.numel()), o = static_cast<size_t>(state_offset_[i]);
    if (is_ortho_[i]) {
      take(t.name + ".momentum_buffer", "F32", t.shape, hm.data() + o, cnt * 4);
    } else if (c_.optim.state == OptimState::FP32) {
      take(t.name + ".exp_avg", "F32", t.shape, hm.data() + o, cnt * 4);
      take(t.name + ".exp_avg_sq", "F32", t.shape, hv.data() + o, cnt * 4);
    } else if (c_.optim.state == OptimState::BF16) {
      take(t.name + ".exp_avg", "BF16", t.shape, hm16.data() + o, cnt * 2);
      take(t.name + ".exp_avg_sq", "BF16", t.shape, hv16.data() + o, cnt * 2);
    }
  }
  upload(m_, hm.data());
  upload(v_, hv.data());
  upload(m16_, hm16.data());
  upload(v16_, hv16.data());
  if (c_.optim.state != OptimState::NVFP4) return;
  const int64_t T = c_.optim.v_tile;
  std::vector<uint8_t> mc(qm_codes_.bytes()), ms(qm_scales_.bytes()), vc(qv_codes_.bytes()),
      vs(qv_scales_.bytes());
  std::vector<uint16_t> mean(qv_mean_.bytes() / 2), floor(qv_floor_.bytes() / 2);
  std::vector<float> amax(q_amax_.bytes() / 4, 0.0f);
  int64_t o = 0;
  for (size_t k = 0; k < q_tensors_.size(); ++k) {
    const ParamTensor& t = ts[q_tensors_[k]];
    const int64_t cnt = t.numel();
    const std::string& w = t.name;
    take(w + ".exp_avg.codes", "U8", {cnt / 2}, mc.data() + o / 2, cnt / 2);
    take(w + ".exp_avg.scales", "U8", {cnt / 16}, ms.data() + o / 16, cnt / 16);
    take(w + ".exp_avg_sq.codes", "U8", {cnt / 2}, vc.data() + o / 2, cnt / 2);
    take(w + ".exp_avg_sq.scales", "U8", {cnt / 16}, vs.data() + o / 16, cnt / 16);
    take(w + ".exp_avg_sq.tile_mean", "BF16", {cnt / T}, mean.data() + o / T,
         static_cast<size_t>(cnt / T) * 2);
    if (!floor.empty())
      take(w + ".exp_avg_sq.tile_floor", "BF16", {cnt / T}, floor.data() + o / T,
           static_cast<size_t>(cnt / T) * 2);
    take(w + ".qadamw_amax", "F32", {2}, amax.data() + 2 * k, 8);
    o += cnt;
  }
  upload(qm_codes_, mc.data());
  upload(qm_scales_, ms.data());
  upload(qv_codes_, vc.data());
  upload(qv_scales_, vs.data());
  upload(qv_mean_, mean.data());
  upload(qv_floor_, floor.data());
  upload(q_amax_, amax.data());
  std::vector<float> fm(fb_m_.bytes() / 4), fv(fb_v_.bytes() / 4);
  for (size_t k = 0; k < fb_tensors_.size(); ++k) {
    const ParamTensor& t = ts[fb_tensors_[k]];
    const size_t cnt = static_cast<size_t>(t.numel());
    take(t.name + ".exp_avg", "F32", t.shape, fm.data() + fb_offset_[k], cnt * 4);
    take(t.name + ".exp_avg_sq", "F32", t.shape, fv.data() + fb_offset_[k], cnt * 4);
  }
  upload(fb_m_, fm.data());
  upload(fb_v_, fv.data());
}

std::string Optimizer::describe() const {
  std::string s = "optimizer " + std::string(name_of(c_.optim.name)) + ": AdamW on " +
                  std::to_string(adamw_tensors_.size()) + " tensors";
  if (sharded_)
    s += " (ZeRO-1: the state of " +
         std::to_string(std::count(owned_.begin(), owned_.end(), true)) + " of " +
         std::to_string(owned_.size()) + " tensors on this rank)";
  if (c_.optim.state == OptimState::BF16) s += " (state in BF16)";
  if (c_.optim.state == OptimState::NVFP4) {
    s += " (Q-AdamW: state in NVFP4 for " + std::to_string(q_tensors_.size()) + ", v tiles of " +
         std::to_string(c_.optim.v_tile);
    if (c_.optim.v_floor == VFloor::TileMin) s += ", v̂ floored at its tile's smallest v";
    if (!fb_tensors_.empty()) {
      s += "; float32 for " + std::to_string(fb_tensors_.size()) +
           ", whose rows are not whole tiles:";
      for (size_t k = 0; k < fb_tensors_.size() && k < 3; ++k)
        s += " " + model_.tensors()[fb_tensors_[k]].name;
      if (fb_tensors_.size() > 3) s += " ...";
    }
    s += ")";
  }
  if (ortho_.empty()) return s;
  size_t parts = 0, root_table = 0;
  for (const OrthoTensor& o : ortho_) {
    parts += o.parts.size();
    for (const MatrixPart& p : o.parts)
      if (root_table_coefficients(root_table_, p.rows, cols_of(model_.tensors()[o.tensor])))
        ++root_table;
  }
  s += ", " + std::string(name_of(c_.optim.name)) + " on " + std::to_string(ortho_.size()) +
       " weights (" + std::to_string(parts) + " sub-matrices), Newton–Schulz products in " +
       name_of(c_.optim.ns_precision);
  if (c_.optim.ns_precision == NsPrecision::NVFP4)
    s +=
        std::string(" (") + name_of(c_.recipe.gemm) + " GEMMs" +
        (c_.optim.ns_clip_quantile < 1.0 ? ", X's copies clipped at its " +
                                               short_number(c_.optim.ns_clip_quantile) + " quantile"
                                         : std::string()) +
        ")";
  if (c_.optim.name == OptimizerName::Root)
    s += "; ROOT's table has coefficients for " + std::to_string(root_table) + " of them" +
         (root_table < parts ? " (the others: Muon's, so Muon plus the soft threshold)" : "");
  return s;
}

}  // namespace fp4sim::model
