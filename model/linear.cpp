#include "model/linear.hpp"

#include <cmath>
#include <memory>
#include <stdexcept>
#include <tuple>
#include <utility>

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
  const std::string base = high_precision.at(static_cast<size_t>(layer)) ? "bf16" : rc.name;
  r.fprop = r.dgrad = r.wgrad = base;
  const std::string key = "h." + std::to_string(layer) + "." + kLinearNames[linear] + ".";
  for (auto [gemm, slot] : {std::pair<const char*, std::string*>{"fprop", &r.fprop},
                            {"dgrad", &r.dgrad},
                            {"wgrad", &r.wgrad}}) {
    const auto it = rc.override_gemms.find(key + gemm);
    if (it != rc.override_gemms.end()) *slot = it->second;
  }
  if (rc.bf16_from_step > 0 && step + 1 >= rc.bf16_from_step) {  // steps count from 1, as printed
    r.fprop = "bf16";
    if (rc.bf16_switch == "all") r.dgrad = r.wgrad = "bf16";
  }
  r.rht = rc.rht;
  r.sr_gradients = rc.stochastic_rounding != "off";
  r.sr_other = rc.stochastic_rounding == "all";
  r.weight_2d = rc.weight_2d;
  r.fos_weights = rc.four_over_six == "weights" || rc.four_over_six == "all";
  r.fos_activations = rc.four_over_six == "activations" || rc.four_over_six == "all";
  r.fos_gradients = rc.four_over_six == "all";
  r.fos_error = rc.fos_error == "mse" ? FourOverSixError::MSE : FourOverSixError::MAE;
  r.mx_rule = rc.mx_scale_rule == "ceil" ? MxScaleRule::Ceil : MxScaleRule::Floor;
  r.impl = rc.gemm == "cublaslt" ? GemmImpl::CublasLt : GemmImpl::Exact;
  return r;
}

QuantizedCopy::QuantizedCopy(Backend& be, int64_t rows, int64_t cols, QFormat f, bool fos,
                             bool with_decoded, bool with_scales_gemm) {
  view.rows = rows;
  view.cols = cols;
  view.format = f;
  view.four_over_six = fos;
  view.device = be.device();
  codes = BackendBuffer(be, static_cast<size_t>(view.code_bytes()));
  scales = BackendBuffer(be, static_cast<size_t>(view.scale_bytes()));
  amax = BackendBuffer(be, sizeof(float));
  view.codes = codes.as<uint8_t>();
  view.scales = scales.as<uint8_t>();
  view.amax = amax.as<float>();
  if (with_decoded) {
    decoded = BackendBuffer(be, static_cast<size_t>(rows * cols) * sizeof(uint16_t));
    view.decoded_bf16 = decoded.as<uint16_t>();
  }
  if (with_scales_gemm) {
    scales_gemm = BackendBuffer(be, static_cast<size_t>(view.scale_bytes()));
    view.scales_gemm = scales_gemm.as<float>();
  }
}

namespace {

QFormat format_of(const std::string& name) {
  return name == "fp8" ? QFormat::FP8 : (name == "mxfp4" ? QFormat::MXFP4 : QFormat::NVFP4);
}

struct CopyRequest {
  const std::string* format;
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

// Whether copy q gets a decoded BF16 buffer: a transient FP4 copy on a backend that reads one.
bool wants_decoded(Backend& be, const LinearRecipe& r, const CopyRequest& q) {
  return q.transient && *q.format != "fp8" && be.decodes_for_gemm(r.impl);
}

// Whether copy q gets its scales also in the GEMM's layout: an FP8 copy (saved or not) on a backend
// whose GEMM reads them (Backend::fp8_scales_for_gemm).
bool wants_scales_gemm(Backend& be, const LinearRecipe& r, const CopyRequest& q) {
  return *q.format == "fp8" && be.fp8_scales_for_gemm(r.impl);
}

// The quantizer configuration of one requested copy (only that copy enabled).
QuantizeConfig copy_config(const LinearRecipe& r, uint64_t seed, const CopyRequest& q) {
  QuantizeConfig qc;
  qc.format = format_of(*q.format);
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

// x (rows, cols) FP32 in the backend's memory, or x16 its BF16 bits (x null), as the quantizer's
// input (name: the error messages').
TensorView copy_input(Backend& be, const float* x, int64_t rows, int64_t cols,
                      const std::string& name, const uint16_t* x16 = nullptr) {
  TensorView tv;
  tv.data = x16 ? static_cast<void*>(const_cast<uint16_t*>(x16))
                : static_cast<void*>(const_cast<float*>(x));
  tv.dtype = x16 ? DType::BF16 : DType::F32;
  tv.rows = rows;
  tv.cols = cols;
  tv.device = be.device();
  tv.name = name.c_str();
  return tv;
}

// x (rows, cols) FP32 in the backend's memory (or x16, its BF16 bits) -> one copy: row-wise (rows,
// cols) or column-wise (cols, rows), blocks along the written row. The quantizer reads BF16 input
// as its FP32 values: the same copy either way.
std::unique_ptr<QuantizedCopy> quantize_copy(Backend& be, const LinearRecipe& r, uint64_t seed,
                                             const float* x, int64_t rows, int64_t cols,
                                             const CopyRequest& q, const std::string& name,
                                             const uint16_t* x16 = nullptr) {
  const QuantizeConfig qc = copy_config(r, seed, q);
  const CopySpec& spec = q.columnwise ? qc.columnwise : qc.rowwise;
  const TensorView tv = copy_input(be, x, rows, cols, name, x16);
  auto c = std::make_unique<QuantizedCopy>(
      be, q.columnwise ? cols : rows, q.columnwise ? rows : cols, qc.format, spec.four_over_six,
      wants_decoded(be, r, q), wants_scales_gemm(be, r, q));
  be.quantize(tv, qc, q.columnwise ? nullptr : &c->view, q.columnwise ? &c->view : nullptr);
  return c;
}

// Whether one quantize call can make both copies: same format, block shape and Four Over Six.
bool can_combine(const CopyRequest& row_q, const CopyRequest& col_q) {
  return *row_q.format == *col_q.format && row_q.weight == col_q.weight && row_q.fos == col_q.fos;
}

// A row-wise and a column-wise copy of the same x, in one quantize call where can_combine allows
// (else two): one amax pass and one read of x instead of two each. The bits are those of two
// quantize_copy calls: each copy keeps its own rounding, RHT and SR stream, and its amax is taken
// over the same values.
// dbias (output gradients only; null otherwise): where the call is combined, dbias also gets x's
// column sums (Backend::quantize_with_bias_backward) and *dbias_done is set; otherwise the caller
// still owes bias_backward.
std::pair<std::unique_ptr<QuantizedCopy>, std::unique_ptr<QuantizedCopy>> quantize_both(
    Backend& be, const LinearRecipe& r, uint64_t seed, const float* x, int64_t rows, int64_t cols,
    const CopyRequest& row_q, const CopyRequest& col_q, const std::string& name,
    float* dbias = nullptr, bool* dbias_done = nullptr, const ActivationSource* src = nullptr,
    const uint16_t* x16 = nullptr) {
  if (dbias_done) *dbias_done = false;
  if (src && !can_combine(row_q, col_q))
    throw std::logic_error("quantize_both (" + name +
                           "): a pending activation needs one combined quantize call");
  if (x16 && (dbias || src))
    throw std::logic_error("quantize_both (" + name +
                           "): BF16 bits input with a bias gradient or a pending activation");
  if (!can_combine(row_q, col_q))
    return {quantize_copy(be, r, seed, x, rows, cols, row_q, name, x16),
            quantize_copy(be, r, seed, x, rows, cols, col_q, name, x16)};
  QuantizeConfig qc = copy_config(r, seed, row_q);
  const QuantizeConfig cc = copy_config(r, seed, col_q);
  qc.columnwise = cc.columnwise;
  const TensorView tv = copy_input(be, x, rows, cols, name, x16);
  auto row =
      std::make_unique<QuantizedCopy>(be, rows, cols, qc.format, qc.rowwise.four_over_six,
                                      wants_decoded(be, r, row_q), wants_scales_gemm(be, r, row_q));
  auto col =
      std::make_unique<QuantizedCopy>(be, cols, rows, qc.format, qc.columnwise.four_over_six,
                                      wants_decoded(be, r, col_q), wants_scales_gemm(be, r, col_q));
  if (src) {
    be.quantize_activation(*src, qc, &row->view, &col->view, dbias);
    if (dbias_done) *dbias_done = dbias != nullptr;
  } else if (dbias) {
    be.quantize_with_bias_backward(tv, qc, &row->view, &col->view, dbias);
    if (dbias_done) *dbias_done = true;
  } else {
    be.quantize(tv, qc, &row->view, &col->view);
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
  return {&r.wgrad,
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
  return {&r.dgrad,
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
QuantStat stat_of(Backend& be, const float* x, const QuantizedCopy& q, const std::string& tensor) {
  const QuantErrorSums sums = be.quant_error_sums(x, q.view);  // on the backend, in one fixed order
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

// d (rows, cols) in the backend's memory as a GEMM output / accumulator view.
TensorView f32_view(Backend& be, float* p, int64_t rows, int64_t cols) {
  TensorView v;
  v.data = p;
  v.rows = rows;
  v.cols = cols;
  v.device = be.device();
  return v;
}

}  // namespace

void linear_forward(Backend& be, const LinearRecipe& r, const LinearIds& ids, float* out,
                    const float* inp, const float* weight, const float* bias, int64_t N, int64_t K,
                    int64_t OC, emu::GemmPrecision prec, bool round_bf16,
                    std::vector<QuantStat>* stats, const std::string& name,
                    std::unique_ptr<QuantizedCopy>* save_wgrad_input,
                    std::unique_ptr<QuantizedCopy>* save_dgrad_weight,
                    const ActivationSource* pending_input, const LinearBits& bits) {
  const uint16_t* inp16 = bits.inp16;
  uint16_t* out16 = bits.out16;
  const bool any_bits = inp16 || out16 || (pending_input && pending_input->out16);
  if (any_bits && prec != emu::GemmPrecision::BF16)
    throw std::logic_error("linear_forward (" + name + "): BF16 bits storage needs BF16 precision");
  if ((inp16 && (inp || (stats && r.fprop != "bf16"))) || (out16 && out))
    throw std::logic_error("linear_forward (" + name +
                           "): BF16 bits and FP32 arrays for the same tensor, or bits "
                           "input with statistics (they read the FP32 input)");
  if (pending_input && pending_input->out16 && (r.fprop != "bf16" || r.wgrad != "bf16"))
    throw std::logic_error("linear_forward (" + name +
                           "): a pending input kept as BF16 bits needs BF16 GEMMs");
  // (built only where a copy is made: a BF16 GEMM draws no SR stream)
  auto x_fprop = [&] {
    return CopyRequest{&r.fprop,
                       false,
                       false,
                       false,
                       r.sr_other,
                       r.fos_activations,
                       copy_stream(ids, TensorRole::Activation, 0)};
  };
  // a pending input is quantized straight from its op where one call makes both copies and
  // nothing else reads x; otherwise the op runs now
  const bool fuse_input = pending_input && save_wgrad_input && r.wgrad != "bf16" &&
                          r.fprop != "bf16" && !stats &&
                          can_combine(x_fprop(), x_wgrad_request(r, ids, true));
  // (a BF16 layer: Backend::matmul_forward_activation, which writes x too for the backward pass)
  const bool fuse_bf16_input = pending_input && r.fprop == "bf16" && r.wgrad == "bf16";
  if (pending_input && (pending_input->rows != N || pending_input->cols != K))
    throw std::logic_error("linear_forward (" + name + "): the pending input's shape is not N x K");
  if (pending_input && !fuse_input && !fuse_bf16_input) be.run_activation(*pending_input);
  // the Wgrad operand x^T, quantized now so the backward pass needs no FP32 copy of x; with a
  // quantized Fprop too, both copies come from one quantize call
  std::unique_ptr<QuantizedCopy> xq;
  if (save_dgrad_weight)
    save_dgrad_weight->reset();  // (also when this pass makes none: never a stale W)
  if (save_wgrad_input) {
    save_wgrad_input->reset();
    if (r.wgrad != "bf16" && r.fprop != "bf16") {
      auto both = quantize_both(be, r, ids.seed, inp, N, K, x_fprop(),
                                x_wgrad_request(r, ids, true), name + " input", nullptr, nullptr,
                                fuse_input ? pending_input : nullptr, inp16);
      xq = std::move(both.first);
      *save_wgrad_input = std::move(both.second);
    } else if (r.wgrad != "bf16") {
      *save_wgrad_input = quantize_copy(be, r, ids.seed, inp, N, K, x_wgrad_request(r, ids, true),
                                        name + " input", inp16);
    }
  }
  if (r.fprop == "bf16") {
    if (fuse_bf16_input)
      be.matmul_forward_activation(out, out16, *pending_input, weight, bias, OC, prec, round_bf16);
    else if (inp16 || out16)
      be.matmul_forward_bf16(out, out16, inp, inp16, weight, bias, N, K, OC, round_bf16);
    else
      be.matmul_forward(out, inp, weight, bias, N, K, OC, prec, round_bf16);
    return;
  }
  if (!xq) xq = quantize_copy(be, r, ids.seed, inp, N, K, x_fprop(), name + " input", inp16);
  const CopyRequest w_fprop{&r.fprop,
                            false,
                            true,
                            false,
                            r.sr_other,
                            r.fos_weights,
                            copy_stream(ids, TensorRole::Weight, 0)};
  std::unique_ptr<QuantizedCopy> wq;
  if (save_dgrad_weight && r.dgrad != "bf16" &&
      can_combine(w_fprop, w_dgrad_request(r, ids, true))) {
    std::tie(wq, *save_dgrad_weight) = quantize_both(
        be, r, ids.seed, weight, OC, K, w_fprop, w_dgrad_request(r, ids, true), name + ".weight");
  } else {
    wq = quantize_copy(be, r, ids.seed, weight, OC, K, w_fprop, name + ".weight");
  }
  GemmConfig g;
  g.impl = r.impl;
  // (a BF16-bits output: the GEMM's FP32 values in a temporary, then the bias and the rounding in
  // the pass that writes the bits)
  BackendBuffer y;
  if (out16) {
    y = BackendBuffer(be, static_cast<size_t>(N * OC) * sizeof(float));
    out = y.as<float>();
  }
  be.gemm(xq->view, wq->view, nullptr, g, f32_view(be, out, N, OC));
  if (out16) {
    if (bias)
      be.bias_forward_bf16(out16, out, bias, N, OC);
    else
      be.narrow_to_bf16(out16, out, N * OC);
  } else if (bias) {
    be.bias_forward(out, bias, N, OC, round_bf16);
  } else if (round_bf16) {
    be.round_to_bf16(out, N * OC);
  }
  if (stats) {
    stats->push_back(stat_of(be, inp, *xq, name + ".fprop.x"));
    stats->push_back(stat_of(be, weight, *wq, name + ".fprop.w"));
  }
}

void linear_backward(Backend& be, const LinearRecipe& r, const LinearIds& ids, float* dinp,
                     float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t N, int64_t K, int64_t OC, emu::GemmPrecision prec,
                     std::vector<QuantStat>* stats, const std::string& name,
                     const QuantizedCopy* saved_wgrad_input,
                     const QuantizedCopy* saved_dgrad_weight, const ActivationSource* pending_dout,
                     const uint16_t* inp16, uint16_t* dinp16, const uint16_t* dout16) {
  if (!inp && !inp16 && (r.wgrad == "bf16" || !saved_wgrad_input))
    throw std::logic_error(
        "linear_backward (" + name +
        "): no input: the FP32 x, its BF16 bits or its saved Wgrad copy is needed");
  if (inp16 && (inp || prec != emu::GemmPrecision::BF16))
    throw std::logic_error("linear_backward (" + name +
                           "): BF16 bits input with an FP32 one, or at FP32 precision");
  // (built only where a copy is made: a BF16 GEMM draws no SR stream)
  auto dy_dgrad = [&] {
    return CopyRequest{&r.dgrad,
                       false,
                       false,
                       false,
                       r.sr_gradients,
                       r.fos_gradients,
                       copy_stream(ids, TensorRole::Gradient, 0)};
  };
  auto dy_wgrad = [&] {
    return CopyRequest{&r.wgrad,
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
  const bool combine = dinp && dweight && r.dgrad != "bf16" && r.wgrad != "bf16" &&
                       can_combine(dy_dgrad(), dy_wgrad());
  // a pending dout is quantized straight from its op where that one call reads it and nothing else
  // does, or handed to Backend::matmul_backward_activation where both GEMMs are BF16; otherwise the
  // op runs now
  const bool fuse_dout = pending_dout && combine && !stats;
  const bool fuse_bf16_dout = pending_dout && r.dgrad == "bf16" && r.wgrad == "bf16";
  if (pending_dout && (pending_dout->rows != N || pending_dout->cols != OC))
    throw std::logic_error("linear_backward (" + name +
                           "): the pending output gradient's shape is not N x OC");
  if (pending_dout && !fuse_dout && !fuse_bf16_dout) be.run_activation(*pending_dout);
  if (dinp16 &&
      (dinp || r.dgrad != "bf16" || r.wgrad != "bf16" || prec != emu::GemmPrecision::BF16))
    throw std::logic_error("linear_backward (" + name +
                           "): dinp16 is for a linear whose GEMMs are all BF16, without dinp");
  if (dout16 && (dout || pending_dout || r.dgrad != "bf16" || r.wgrad != "bf16" ||
                 prec != emu::GemmPrecision::BF16))
    throw std::logic_error("linear_backward (" + name +
                           "): dout16 is for a linear whose GEMMs are all BF16, without dout");
  if (r.dgrad == "bf16" && r.wgrad == "bf16") {
    if (inp16 || dinp16 || dout16 ||
        (pending_dout && (pending_dout->inp16 || pending_dout->dout16)))
      be.matmul_backward_bits(dinp, dinp16, dweight, dbias, fuse_bf16_dout ? nullptr : dout, dout16,
                              fuse_bf16_dout ? pending_dout : nullptr, inp, inp16, weight, N, K,
                              OC);
    else if (fuse_bf16_dout)
      be.matmul_backward_activation(dinp, dweight, dbias, *pending_dout, inp, weight, K, prec);
    else
      be.matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, K, OC, prec);
    return;
  }
  GemmConfig acc;  // Wgrad: D = alpha' * A B^T + 1 * D, the += of matmul_backward in the epilogue
  acc.impl = r.impl;
  acc.beta = 1.0f;
  GemmConfig put;  // Dgrad: D = alpha' * A B^T, dinp written
  put.impl = r.impl;
  // (dbias from the same call: Backend::quantize_with_bias_backward; the same bits as
  // bias_backward)
  std::unique_ptr<QuantizedCopy> dyq, dyc;
  bool dbias_done = false;
  if (combine)
    std::tie(dyq, dyc) = quantize_both(be, r, ids.seed, dout, N, OC, dy_dgrad(), dy_wgrad(),
                                       name + " output gradient", dbias, &dbias_done,
                                       fuse_dout ? pending_dout : nullptr);
  // Dgrad: dx (N,K) = dy (N,OC) . W (OC,K) = dy_rowwise x (W column-wise (K,OC))^T
  if (dinp) {
    if (r.dgrad == "bf16") {
      if (inp16)
        be.matmul_backward_bf16_input(dinp, nullptr, nullptr, dout, inp16, weight, N, K, OC);
      else
        be.matmul_backward(dinp, nullptr, nullptr, dout, inp, weight, N, K, OC, prec);
    } else {
      if (!dyq)
        dyq = quantize_copy(be, r, ids.seed, dout, N, OC, dy_dgrad(), name + " output gradient");
      std::unique_ptr<QuantizedCopy> own_w;
      const QuantizedCopy* wq = saved_or_made(saved_dgrad_weight, own_w, [&] {
        return quantize_copy(be, r, ids.seed, weight, OC, K, w_dgrad_request(r, ids, false),
                             name + ".weight");
      });
      const TensorView d = f32_view(be, dinp, N, K);
      be.gemm(dyq->view, wq->view, nullptr, put, d);
      if (stats) stats->push_back(stat_of(be, dout, *dyq, name + ".dgrad.dy"));
      dyq.reset();
    }
  }
  // Wgrad: dW (OC,K) += dy^T (OC,N) . x (N,K) = (dy column-wise) x (x column-wise)^T, RHT on both
  if (dweight) {
    if (r.wgrad == "bf16") {
      if (inp16)
        be.matmul_backward_bf16_input(nullptr, dweight, nullptr, dout, inp16, weight, N, K, OC);
      else
        be.matmul_backward(nullptr, dweight, nullptr, dout, inp, weight, N, K, OC, prec);
    } else {
      if (!dyc)
        dyc = quantize_copy(be, r, ids.seed, dout, N, OC, dy_wgrad(), name + " output gradient");
      std::unique_ptr<QuantizedCopy> own_x;
      const QuantizedCopy* xc = saved_or_made(saved_wgrad_input, own_x, [&] {
        return quantize_copy(be, r, ids.seed, inp, N, K, x_wgrad_request(r, ids, false),
                             name + " input", inp16);
      });
      const TensorView d = f32_view(be, dweight, OC, K);
      be.gemm(dyc->view, xc->view, &d, acc, d);
    }
  }
  if (dbias && !dbias_done) be.bias_backward(dbias, dout, N, OC);
}

}  // namespace fp4sim::model
