#include "model/linear.hpp"

#include <cmath>
#include <memory>
#include <stdexcept>
#include <tuple>
#include <utility>

#include "emu/fused.hpp"

namespace fp4sim::model {

uint64_t sr_stream(int64_t step, int64_t micro_batch, int64_t layer, int64_t linear,
                   TensorRole role, int copy) {
  if (step < 0 || step >= (int64_t{1} << 32) || micro_batch < 0 || micro_batch >= 256 ||
      layer < 0 || layer >= 4096 || linear < 0 || linear >= 8 || copy < 0 || copy > 1)
    throw std::out_of_range(
        "sr_stream: step, micro-batch, layer, linear or copy outside its field");
  return static_cast<uint64_t>(step) << 32 | static_cast<uint64_t>(micro_batch) << 24 |
         static_cast<uint64_t>(layer) << 12 | static_cast<uint64_t>(linear) << 4 |
         static_cast<uint64_t>(role) << 1 | static_cast<uint64_t>(copy);
}

LinearRecipe resolve_linear_recipe(const RunConfig& c, const std::vector<bool>& high_precision,
                                   int64_t layer, int linear, int64_t step) {
  const RecipeConfig& rc = c.recipe;
  LinearRecipe r;
  const GemmFormat base =
      high_precision.at(static_cast<size_t>(layer)) ? GemmFormat::BF16 : rc.name;
  r.fprop = r.dgrad = r.wgrad = base;
  const std::string key = unit_prefix(c.model, layer) + "." + kLinearNames[linear] + ".";
  for (auto [gemm, slot] : {std::pair<const char*, GemmFormat*>{"fprop", &r.fprop},
                            {"dgrad", &r.dgrad},
                            {"wgrad", &r.wgrad}}) {
    const auto it = rc.override_gemms.find(key + gemm);
    if (it != rc.override_gemms.end()) *slot = it->second;
  }
  if (rc.bf16_from_step > 0 && step + 1 >= rc.bf16_from_step) {  // steps count from 1, as printed
    r.fprop = GemmFormat::BF16;
    if (rc.bf16_switch == Bf16Switch::All) r.dgrad = r.wgrad = GemmFormat::BF16;
  }
  r.rht = rc.rht;
  r.sr_gradients = rc.stochastic_rounding != StochasticRounding::Off;
  r.sr_other = rc.stochastic_rounding == StochasticRounding::All;
  r.weight_2d = rc.weight_2d;
  r.fos_weights = rc.four_over_six == FourOverSix::Weights || rc.four_over_six == FourOverSix::All;
  r.fos_activations =
      rc.four_over_six == FourOverSix::Activations || rc.four_over_six == FourOverSix::All;
  r.fos_gradients = rc.four_over_six == FourOverSix::All;
  r.fos_error = rc.fos_error;
  r.mx_rule = rc.mx_scale_rule;
  r.impl = rc.gemm;
  return r;
}

QuantizedCopy::QuantizedCopy(Backend& be, int64_t rows, int64_t cols, QFormat f, bool fos,
                             bool with_decoded, bool with_scales_gemm, const BufferLabel& label) {
  auto part = [&](const char* what) { return BufferLabel{label.use, label.what + what}; };
  view.rows = rows;
  view.cols = cols;
  view.format = f;
  view.four_over_six = fos;
  view.device = be.device();
  codes = BackendBuffer(be, static_cast<size_t>(view.code_bytes()), part(" codes"));
  scales = BackendBuffer(be, static_cast<size_t>(view.scale_bytes()), part(" scales"));
  amax = BackendBuffer(be, sizeof(float), part(" amax"));
  view.codes = codes.as<uint8_t>();
  view.scales = scales.as<uint8_t>();
  view.amax = amax.as<float>();
  if (with_decoded) {
    decoded =
        BackendBuffer(be, static_cast<size_t>(rows * cols) * sizeof(uint16_t), part(" decoded"));
    view.decoded_bf16 = decoded.as<uint16_t>();
  }
  if (with_scales_gemm) {
    scales_gemm =
        BackendBuffer(be, static_cast<size_t>(view.scale_bytes()), part(" scales (GEMM layout)"));
    view.scales_gemm = scales_gemm.as<float>();
  }
}

QFormat qformat_of(GemmFormat f) {
  switch (f) {
    case GemmFormat::FP8:
      return QFormat::FP8;
    case GemmFormat::NVFP4:
      return QFormat::NVFP4;
    case GemmFormat::MXFP4:
      return QFormat::MXFP4;
    case GemmFormat::BF16:
      break;
  }
  throw std::logic_error("qformat_of: a BF16 GEMM has no quantized copies");
}

namespace {

struct CopyRequest {
  GemmFormat format;
  bool columnwise = false;
  bool weight = false;  // 2D blocks when the recipe says so (NVFP4)
  bool rht = false;
  bool sr = false;
  bool fos = false;
  uint64_t stream = 0;
  // the copy is multiplied soon (not saved for the backward pass): where the backend's GEMM reads
  // a decoded BF16 operand, the quantizer writes it too (Backend::decodes_for_gemm)
  bool transient = true;
};

// The memory plan's label of copy q of `name`: saved for the backward pass, or a GEMM's operand.
BufferLabel copy_label(const CopyRequest& q, const std::string& name) {
  return {q.transient ? kUseQuantizedOperands : kUseSavedCopies,
          name + (q.columnwise ? " column-wise copy" : " row-wise copy")};
}

// Whether copy q gets a decoded BF16 buffer: a transient FP4 copy on a backend that reads one.
bool wants_decoded(Backend& be, const LinearRecipe& r, const CopyRequest& q) {
  return q.transient && q.format != GemmFormat::FP8 &&
         be.supports(Capability::GemmDecodedOperand, static_cast<int64_t>(r.impl));
}

// Whether copy q gets its scales also in the GEMM's layout: an FP8 copy (saved or not) on a backend
// whose GEMM reads them (Backend::fp8_scales_for_gemm).
bool wants_scales_gemm(Backend& be, const LinearRecipe& r, const CopyRequest& q) {
  return q.format == GemmFormat::FP8 &&
         be.supports(Capability::GemmFp8Scales, static_cast<int64_t>(r.impl));
}

// The quantizer configuration of one requested copy (only that copy enabled).
QuantizeConfig copy_config(const LinearRecipe& r, uint64_t seed, const CopyRequest& q) {
  QuantizeConfig qc;
  qc.format = qformat_of(q.format);
  const bool fp8 = qc.format == QFormat::FP8;
  // FP8 (§9): 128x128 weight tiles, 1x128 elsewhere, RN, no RHT, no Four Over Six
  qc.block_2d = q.weight && (fp8 || (r.weight_2d && qc.format == QFormat::NVFP4));
  qc.mx_rule = r.mx_rule;
  qc.fos_error = r.fos_error;
  qc.seed = seed;
  CopySpec& spec = q.columnwise ? qc.columnwise : qc.rowwise;
  spec.enabled = true;
  spec.rounding = q.sr && !fp8 ? Rounding::SR : Rounding::RN;
  spec.stream = q.stream;
  spec.rht = q.rht && !fp8;
  // Four Over Six is an NVFP4 technique: a GEMM overridden to MXFP4 or FP8 in an NVFP4 recipe that
  // uses it runs without it (as the recipe check does for whole MXFP4 and FP8 recipes)
  spec.four_over_six = q.fos && qc.format == QFormat::NVFP4;
  return qc;
}

// x (rows, cols; float32 or BF16, in the backend's memory) as the quantizer reads it: as stored,
// under the name of the error messages (name must outlive the view).
TensorView copy_input(const TensorView& x, const std::string& name) {
  TensorView tv = x;
  tv.bf16_values = false;
  tv.name = name.c_str();
  return tv;
}

// x -> one copy: row-wise (rows, cols) or column-wise (cols, rows), blocks along the written row.
// The quantizer reads BF16 input as its float32 values: the same copy either way.
std::unique_ptr<QuantizedCopy> quantize_copy(Backend& be, const LinearRecipe& r, uint64_t seed,
                                             const TensorView& x, const CopyRequest& q,
                                             const std::string& name) {
  const QuantizeConfig qc = copy_config(r, seed, q);
  const CopySpec& spec = q.columnwise ? qc.columnwise : qc.rowwise;
  const TensorView tv = copy_input(x, name);
  const int64_t rows = x.rows, cols = x.cols;
  auto c = std::make_unique<QuantizedCopy>(
      be, q.columnwise ? cols : rows, q.columnwise ? rows : cols, qc.format, spec.four_over_six,
      wants_decoded(be, r, q), wants_scales_gemm(be, r, q), copy_label(q, name));
  be.quantize(tv, qc, q.columnwise ? nullptr : &c->view, q.columnwise ? &c->view : nullptr);
  return c;
}

// Whether one quantize call can make both copies: same format, block shape and Four Over Six.
bool can_combine(const CopyRequest& row_q, const CopyRequest& col_q) {
  return row_q.format == col_q.format && row_q.weight == col_q.weight && row_q.fos == col_q.fos;
}

// A row-wise and a column-wise copy of the same x, in one quantize call where can_combine allows
// (else two): one amax pass and one read of x instead of two each. The bits are those of two
// quantize_copy calls: each copy keeps its own rounding, RHT and SR stream, and its amax is taken
// over the same values.
// dbias (output gradients only; absent otherwise): where the call is combined, dbias also gets x's
// column sums (Backend::quantize_activation) and *dbias_done is set; otherwise the caller still
// owes bias_backward. src: x is the output of that activation, not yet run (x unused).
std::pair<std::unique_ptr<QuantizedCopy>, std::unique_ptr<QuantizedCopy>> quantize_both(
    Backend& be, const LinearRecipe& r, uint64_t seed, const TensorView& x,
    const CopyRequest& row_q, const CopyRequest& col_q, const std::string& name,
    const TensorView& dbias = TensorView{}, bool* dbias_done = nullptr,
    const ActivationSource* src = nullptr) {
  if (dbias_done) *dbias_done = false;
  if (src && !can_combine(row_q, col_q))
    throw std::logic_error("quantize_both (" + name +
                           "): a pending activation needs one combined quantize call");
  if (x.dtype == DType::BF16 && (dbias.present() || src))
    throw std::logic_error("quantize_both (" + name +
                           "): BF16 bits input with a bias gradient or a pending activation");
  if (!can_combine(row_q, col_q))
    return {quantize_copy(be, r, seed, x, row_q, name), quantize_copy(be, r, seed, x, col_q, name)};
  QuantizeConfig qc = copy_config(r, seed, row_q);
  const QuantizeConfig cc = copy_config(r, seed, col_q);
  qc.columnwise = cc.columnwise;
  const int64_t rows = x.rows, cols = x.cols;
  auto row = std::make_unique<QuantizedCopy>(
      be, rows, cols, qc.format, qc.rowwise.four_over_six, wants_decoded(be, r, row_q),
      wants_scales_gemm(be, r, row_q), copy_label(row_q, name));
  auto col = std::make_unique<QuantizedCopy>(
      be, cols, rows, qc.format, qc.columnwise.four_over_six, wants_decoded(be, r, col_q),
      wants_scales_gemm(be, r, col_q), copy_label(col_q, name));
  if (src) {
    be.quantize_activation(*src, qc, &row->view, &col->view, dbias);
    if (dbias_done) *dbias_done = dbias.present();
  } else if (dbias.present()) {
    ActivationSource id;
    id.inp = copy_input(x, name);
    be.quantize_activation(id, qc, &row->view, &col->view, dbias);
    if (dbias_done) *dbias_done = true;
  } else {
    be.quantize(copy_input(x, name), qc, &row->view, &col->view);
  }
  return {std::move(row), std::move(col)};
}

// The SR stream of one copy of a linear layer's GEMM operands (sr_stream's fields from ids).
uint64_t copy_stream(const LinearIds& ids, TensorRole role, int copy) {
  return sr_stream(ids.step, ids.micro_batch, ids.layer, ids.linear, role, copy);
}

// x's Wgrad copy (column-wise, RHT when the recipe says so), made in the forward pass to be saved
// or in the backward pass when it was not.
CopyRequest x_wgrad_request(const LinearRecipe& r, const LinearIds& ids, bool saved) {
  return {r.wgrad,
          true,
          false,
          r.rht,
          r.sr_other,
          r.fos_activations,
          copy_stream(ids, TensorRole::Activation, 1),
          !saved};
}

// W's Dgrad copy (column-wise, 2D blocks when the recipe says so), made in the forward pass to be
// saved or in the backward pass when it was not.
CopyRequest w_dgrad_request(const LinearRecipe& r, const LinearIds& ids, bool saved) {
  return {r.dgrad,
          true,
          true,
          false,
          r.sr_other,
          r.fos_weights,
          copy_stream(ids, TensorRole::Weight, 1),
          !saved};
}

// The copy saved by the forward pass, or one made now by make() and kept alive in own.
template <class Make>
const QuantizedCopy* saved_or_made(const QuantizedCopy* saved, std::unique_ptr<QuantizedCopy>& own,
                                   const Make& make) {
  if (saved) return saved;
  own = make();
  return own.get();
}

// Statistics of a row-wise copy of x (rows, cols): the error sums on the backend, the ratios here.
QuantStat stat_of(Backend& be, const TensorView& x, const QuantizedCopy& q,
                  const std::string& tensor) {
  const QuantErrorSums sums =
      be.quant_error_sums(as_stored(x), q.view);  // on the backend, in one fixed order
  QuantStat st;
  st.tensor = tensor;
  be.download(&st.amax, q.view.amax, 4);
  st.elements = q.view.rows * q.view.cols;
  st.saturated =
      static_cast<double>(sums.saturated) / static_cast<double>(std::max<int64_t>(1, st.elements));
  st.underflow_blocks = static_cast<double>(sums.underflow_blocks) /
                        static_cast<double>(std::max<int64_t>(1, q.view.scale_count()));
  st.rel_error = sums.ref2 > 0 ? std::sqrt(sums.err2 / sums.ref2) : 0.0;
  return st;
}

// A float32 view of p (rows, cols) in the backend's memory, as a GEMM output / accumulator.
TensorView gemm_view(Backend& be, void* p, int64_t rows, int64_t cols, const char* name) {
  return view_of(p, DType::F32, rows, cols, be.device(), name);
}

}  // namespace

void linear_forward(Backend& be, const LinearRecipe& r, const LinearIds& ids, const TensorView& out,
                    const TensorView& inp, const LinearWeights& w, GemmPrecision prec,
                    std::vector<QuantStat>* stats, const std::string& name,
                    std::unique_ptr<QuantizedCopy>* save_wgrad_input,
                    std::unique_ptr<QuantizedCopy>* save_dgrad_weight,
                    const ActivationSource* pending_input) {
  const TensorView& x = pending_input ? pending_input->out : inp;
  const int64_t N = x.rows, OC = w.weight.rows;
  if (stats && r.fprop != GemmFormat::BF16 && x.dtype != DType::F32)
    throw std::logic_error("linear_forward (" + name +
                           "): statistics read the float32 input, not BF16 bits");
  if (pending_input && pending_input->out.dtype == DType::BF16 &&
      (r.fprop != GemmFormat::BF16 || r.wgrad != GemmFormat::BF16))
    throw std::logic_error("linear_forward (" + name +
                           "): a pending input kept as BF16 bits needs BF16 GEMMs");
  // (built only where a copy is made: a BF16 GEMM draws no SR stream)
  auto x_fprop = [&] {
    return CopyRequest{r.fprop,
                       false,
                       false,
                       false,
                       r.sr_other,
                       r.fos_activations,
                       copy_stream(ids, TensorRole::Activation, 0)};
  };
  // a pending input is quantized straight from its op where one call makes both copies and
  // nothing else reads x; otherwise the op runs now
  const bool fuse_input = pending_input && save_wgrad_input && r.wgrad != GemmFormat::BF16 &&
                          r.fprop != GemmFormat::BF16 && !stats &&
                          can_combine(x_fprop(), x_wgrad_request(r, ids, true));
  // (a BF16 layer: Backend::matmul_forward_activation, which writes x too for the backward pass)
  const bool fuse_bf16_input =
      pending_input && r.fprop == GemmFormat::BF16 && r.wgrad == GemmFormat::BF16;
  if (pending_input && !fuse_input && !fuse_bf16_input) run_activation(be, *pending_input);
  // the Wgrad operand x^T, quantized now so the backward pass needs no float32 copy of x; with a
  // quantized Fprop too, both copies come from one quantize call
  std::unique_ptr<QuantizedCopy> xq;
  if (save_dgrad_weight)
    save_dgrad_weight->reset();  // (also when this pass makes none: never a stale W)
  if (save_wgrad_input) {
    save_wgrad_input->reset();
    if (r.wgrad != GemmFormat::BF16 && r.fprop != GemmFormat::BF16) {
      auto both = quantize_both(be, r, ids.seed, x, x_fprop(), x_wgrad_request(r, ids, true),
                                name + " input", TensorView{}, nullptr,
                                fuse_input ? pending_input : nullptr);
      xq = std::move(both.first);
      *save_wgrad_input = std::move(both.second);
    } else if (r.wgrad != GemmFormat::BF16) {
      *save_wgrad_input =
          quantize_copy(be, r, ids.seed, x, x_wgrad_request(r, ids, true), name + " input");
    }
  }
  if (r.fprop == GemmFormat::BF16) {
    const TensorView& bias = w.bias_for(out);
    if (fuse_bf16_input)
      be.matmul_forward_activation(out, *pending_input, w.gemm_weight(), bias, prec);
    else
      be.matmul_forward(out, as_stored(x), w.gemm_weight(), bias, prec);
    return;
  }
  if (!xq) xq = quantize_copy(be, r, ids.seed, x, x_fprop(), name + " input");
  const CopyRequest w_fprop{r.fprop,
                            false,
                            true,
                            false,
                            r.sr_other,
                            r.fos_weights,
                            copy_stream(ids, TensorRole::Weight, 0)};
  std::unique_ptr<QuantizedCopy> wq;
  if (save_dgrad_weight && r.dgrad != GemmFormat::BF16 &&
      can_combine(w_fprop, w_dgrad_request(r, ids, true))) {
    std::tie(wq, *save_dgrad_weight) = quantize_both(
        be, r, ids.seed, w.weight, w_fprop, w_dgrad_request(r, ids, true), name + ".weight");
  } else {
    wq = quantize_copy(be, r, ids.seed, w.weight, w_fprop, name + ".weight");
  }
  GemmConfig g;
  g.impl = r.impl;
  // (a BF16-bits output: the GEMM's float32 values in a temporary, then the bias and the rounding
  // in the pass that writes the bits)
  BackendBuffer y;
  void* acc = out.data;
  if (out.dtype == DType::BF16) {
    y = BackendBuffer(be, static_cast<size_t>(N * OC) * sizeof(float),
                      {kUseOpTemporaries, name + " GEMM output (float32)"});
    acc = y.get();
  }
  const TensorView d = gemm_view(be, acc, N, OC, out.name);
  be.gemm(xq->view, wq->view, nullptr, g, d);
  if (w.bias.present())
    be.bias_forward(out, d, w.bias);
  else if (out.bf16_storage())
    be.convert(out, d);
  if (stats) {
    stats->push_back(stat_of(be, x, *xq, name + ".fprop.x"));
    stats->push_back(stat_of(be, w.weight, *wq, name + ".fprop.w"));
  }
}

void linear_backward(Backend& be, const LinearRecipe& r, const LinearIds& ids,
                     const TensorView& dinp, const TensorView& dweight, const TensorView& dbias,
                     const TensorView& dout, const TensorView& inp, const LinearWeights& w,
                     GemmPrecision prec, std::vector<QuantStat>* stats, const std::string& name,
                     const QuantizedCopy* saved_wgrad_input,
                     const QuantizedCopy* saved_dgrad_weight,
                     const ActivationSource* pending_dout) {
  const TensorView& dy = pending_dout ? pending_dout->out : dout;
  if (!inp.present() && (r.wgrad == GemmFormat::BF16 || !saved_wgrad_input))
    throw std::logic_error(
        "linear_backward (" + name +
        "): no input: the float32 x, its BF16 bits or its saved Wgrad copy is needed");
  // (built only where a copy is made: a BF16 GEMM draws no SR stream)
  auto dy_dgrad = [&] {
    return CopyRequest{r.dgrad,
                       false,
                       false,
                       false,
                       r.sr_gradients,
                       r.fos_gradients,
                       copy_stream(ids, TensorRole::Gradient, 0)};
  };
  auto dy_wgrad = [&] {
    return CopyRequest{r.wgrad,
                       true,
                       false,
                       r.rht,
                       r.sr_gradients,
                       r.fos_gradients,
                       copy_stream(ids, TensorRole::Gradient, 1)};
  };
  // dy's Dgrad and Wgrad copies from one quantize call when both GEMMs are quantized and the
  // copies can share it (else each is made where it is used, and the Dgrad one freed before the
  // Wgrad one exists)
  const bool combine = dinp.present() && dweight.present() && r.dgrad != GemmFormat::BF16 &&
                       r.wgrad != GemmFormat::BF16 && can_combine(dy_dgrad(), dy_wgrad());
  // a pending dout is quantized straight from its op where that one call reads it and nothing else
  // does, or handed to Backend::matmul_backward_activation where both GEMMs are BF16; otherwise the
  // op runs now
  const bool fuse_dout = pending_dout && combine && !stats;
  const bool fuse_bf16_dout =
      pending_dout && r.dgrad == GemmFormat::BF16 && r.wgrad == GemmFormat::BF16;
  if (pending_dout && !fuse_dout && !fuse_bf16_dout) run_activation(be, *pending_dout);
  if (dinp.dtype == DType::BF16 && (r.dgrad != GemmFormat::BF16 || r.wgrad != GemmFormat::BF16))
    throw std::logic_error("linear_backward (" + name +
                           "): a BF16-bits dinp is for a linear whose GEMMs are all BF16");
  if (r.dgrad == GemmFormat::BF16 && r.wgrad == GemmFormat::BF16) {
    if (fuse_bf16_dout)
      be.matmul_backward_activation(dinp, dweight, dbias, *pending_dout, inp, w.gemm_weight(),
                                    prec);
    else
      be.matmul_backward(dinp, dweight, dbias, as_stored(dy), inp, w.gemm_weight(), prec);
    return;
  }
  GemmConfig acc;  // Wgrad: D = alpha' * A B^T + 1 * D, the += of matmul_backward in the epilogue
  acc.impl = r.impl;
  acc.beta = 1.0f;
  GemmConfig put;  // Dgrad: D = alpha' * A B^T, dinp written
  put.impl = r.impl;
  // (dbias from the same call: Backend::quantize_activation; the same bits as bias_backward)
  std::unique_ptr<QuantizedCopy> dyq, dyc;
  bool dbias_done = false;
  if (combine)
    std::tie(dyq, dyc) =
        quantize_both(be, r, ids.seed, dy, dy_dgrad(), dy_wgrad(), name + " output gradient", dbias,
                      &dbias_done, fuse_dout ? pending_dout : nullptr);
  const TensorView absent;
  // Dgrad: dx (N,K) = dy (N,OC) . W (OC,K) = dy_rowwise x (W column-wise (K,OC))^T
  if (dinp.present()) {
    if (r.dgrad == GemmFormat::BF16) {
      be.matmul_backward(dinp, absent, absent, as_stored(dy), inp, w.gemm_weight(), prec);
    } else {
      if (!dyq) dyq = quantize_copy(be, r, ids.seed, dy, dy_dgrad(), name + " output gradient");
      std::unique_ptr<QuantizedCopy> own_w;
      const QuantizedCopy* wq = saved_or_made(saved_dgrad_weight, own_w, [&] {
        return quantize_copy(be, r, ids.seed, w.weight, w_dgrad_request(r, ids, false),
                             name + ".weight");
      });
      be.gemm(dyq->view, wq->view, nullptr, put, as_stored(dinp));
      if (stats) stats->push_back(stat_of(be, dy, *dyq, name + ".dgrad.dy"));
      dyq.reset();
    }
  }
  // Wgrad: dW (OC,K) += dy^T (OC,N) . x (N,K) = (dy column-wise) x (x column-wise)^T, RHT on both
  if (dweight.present()) {
    if (r.wgrad == GemmFormat::BF16) {
      be.matmul_backward(absent, dweight, absent, as_stored(dy), inp, w.gemm_weight(), prec);
    } else {
      if (!dyc) dyc = quantize_copy(be, r, ids.seed, dy, dy_wgrad(), name + " output gradient");
      std::unique_ptr<QuantizedCopy> own_x;
      const QuantizedCopy* xc = saved_or_made(saved_wgrad_input, own_x, [&] {
        return quantize_copy(be, r, ids.seed, inp, x_wgrad_request(r, ids, false), name + " input");
      });
      be.gemm(dyc->view, xc->view, &dweight, acc, dweight);
    }
  }
  if (dbias.present() && !dbias_done) be.bias_backward(dbias, as_stored(dy));
}

}  // namespace fp4sim::model
