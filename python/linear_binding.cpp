// fp4sim.torch's C++ half (DESIGN.md §15): the trainer's linear layer (model/linear.hpp:
// linear_forward and linear_backward, DESIGN.md §9) on DLPack tensors, host or CUDA, and the
// recipe resolution the trainer uses (model::resolve_linear_recipe over a RunConfig built from the
// recipe.* keys), so a PyTorch model's linear layers compute fp4sim's bits.
#include "python/linear_binding.hpp"

#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "model/config.hpp"
#include "model/linear.hpp"
#include "python/dlpack_args.hpp"

namespace fp4sim::py_args {

namespace {

// A recipe for a model of n_layers recipe units: the RunConfig of the recipe.* keys given (every
// key and value checked as a config file's) and its high-precision blocks (§9's rule).
struct Recipe {
  model::RunConfig config;
  std::vector<bool> high_precision;
  model::LinearRecipe linear(int64_t layer, int linear, int64_t step) const {
    if (layer < 0 || layer >= config.model.n_layers)
      throw py::value_error("fp4sim.torch: layer " + std::to_string(layer) + " outside 0.." +
                            std::to_string(config.model.n_layers - 1));
    if (linear < 0 || linear >= model::kLinearsPerUnit)
      throw py::value_error("fp4sim.torch: linear " + std::to_string(linear) + " outside 0.." +
                            std::to_string(model::kLinearsPerUnit - 1));
    if (step < 0) throw py::value_error("fp4sim.torch: step must be >= 0");
    return model::resolve_linear_recipe(config, high_precision, layer, linear, step);
  }
};

Recipe make_recipe(const py::dict& keys, int64_t n_layers) {
  if (n_layers < 1) throw py::value_error("fp4sim.torch: n_layers must be >= 1");
  nlohmann::json j;
  j["model"]["n_layers"] = n_layers;
  std::vector<std::string> overrides;
  for (const auto& kv : keys) {
    const std::string k = py::str(kv.first).cast<std::string>();
    std::string v;
    if (py::isinstance<py::bool_>(kv.second))
      v = kv.second.cast<bool>() ? "true" : "false";
    else
      v = py::str(kv.second).cast<std::string>();
    overrides.push_back("recipe." + k + "=" + v);
  }
  Recipe r;
  try {
    r.config = model::config_from_json(j, overrides, "fp4sim.torch recipe");
  } catch (const std::invalid_argument& e) {
    throw py::value_error(std::string("fp4sim.torch: ") + e.what());
  }
  r.high_precision = model::high_precision_blocks(r.config);
  return r;
}

// The backend of a call: emu for host tensors, the CUDA backend on the tensors' device and the
// caller's stream for CUDA tensors (all tensors on one device).
Backend& backend_for(const std::vector<const DlTensor*>& ts, const std::string& where,
                     const py::object& backend, uintptr_t stream) {
  const bool cuda = ts[0]->cuda();
  const int dev = ts[0]->device_index();
  for (const DlTensor* t : ts)
    if (t->cuda() != cuda || (cuda && t->device_index() != dev))
      throw py::value_error(where + ": the tensors are on different devices");
  const std::string want = cuda ? "cuda" : "emu";
  if (!backend.is_none() && backend.cast<std::string>() != want)
    throw py::value_error(where + ": backend '" + backend.cast<std::string>() + "' with " +
                          (cuda ? "CUDA" : "host") + " tensors (they run on " + want + ")");
  return module_backend(want, dev, stream);
}

py::list stats_list(const std::vector<model::QuantStat>& s) {
  py::list out;
  for (const auto& q : s) {
    py::dict d;
    d["tensor"] = q.tensor;
    d["amax"] = q.amax;
    d["saturated"] = q.saturated;
    d["underflow_blocks"] = q.underflow_blocks;
    d["rel_error"] = q.rel_error;
    d["elements"] = q.elements;
    out.append(d);
  }
  return out;
}

model::LinearWeights weights(const TensorView& w, const TensorView& b) {
  model::LinearWeights lw;
  lw.weight = w;
  lw.bias = b;
  if (b.present()) {
    lw.bias.rows = b.numel();
    lw.bias.cols = 1;
  }
  return lw;
}

void check_shape(const TensorView& v, int64_t rows, int64_t cols, const std::string& where) {
  if (v.rows != rows || v.cols != cols)
    throw py::value_error(where + ": shape " + shape_str(v.rows, v.cols) + ", expected " +
                          shape_str(rows, cols));
}

py::list linear_forward(const model::LinearRecipe& r, const model::LinearIds& ids,
                        const py::object& x, const py::object& weight, const py::object& bias,
                        const py::object& out, const std::string& name, bool statistics,
                        const py::object& backend, uintptr_t stream) {
  const std::string w = "fp4sim.torch.Linear(" + name + ")";
  const DlTensor dx = dlpack_arg(x, w + ": x"), dw = dlpack_arg(weight, w + ": weight"),
                 dout = dlpack_arg(out, w + ": out");
  DlTensor db;
  std::vector<const DlTensor*> all{&dx, &dw, &dout};
  if (!bias.is_none()) {
    db = dlpack_arg(bias, w + ": bias");
    all.push_back(&db);
  }
  Backend& be = backend_for(all, w, backend, stream);
  const TensorView xv = matrix_view(dx, w + ": x", {DType::F32}, "x");
  const TensorView wv = matrix_view(dw, w + ": weight", {DType::F32}, "weight");
  const TensorView ov = matrix_view(dout, w + ": out", {DType::F32}, "out");
  const TensorView bv =
      bias.is_none() ? TensorView{} : matrix_view(db, w + ": bias", {DType::F32}, "bias");
  check_shape(xv, xv.rows, wv.cols, w + ": x (its last dimension is the weight's in_features)");
  check_shape(ov, xv.rows, wv.rows, w + ": out");
  if (bv.present() && bv.numel() != wv.rows)
    throw py::value_error(w + ": bias has " + std::to_string(bv.numel()) + " elements, expected " +
                          std::to_string(wv.rows));
  std::vector<model::QuantStat> st;
  {
    py::gil_scoped_release release;
    model::linear_forward(be, r, ids, ov, xv, weights(wv, bv), GemmPrecision::BF16,
                          statistics ? &st : nullptr, name);
  }
  return stats_list(st);
}

py::list linear_backward(const model::LinearRecipe& r, const model::LinearIds& ids,
                         const py::object& dout, const py::object& x, const py::object& weight,
                         const py::object& bias, const py::object& dx, const py::object& dweight,
                         const py::object& dbias, const std::string& name, bool statistics,
                         const py::object& backend, uintptr_t stream) {
  const std::string w = "fp4sim.torch.Linear(" + name + ") backward";
  const DlTensor tdy = dlpack_arg(dout, w + ": dout"), tx = dlpack_arg(x, w + ": x"),
                 tw = dlpack_arg(weight, w + ": weight"), tdx = dlpack_arg(dx, w + ": dx"),
                 tdw = dlpack_arg(dweight, w + ": dweight");
  DlTensor tb, tdb;
  std::vector<const DlTensor*> all{&tdy, &tx, &tw, &tdx, &tdw};
  if (!bias.is_none()) {
    tb = dlpack_arg(bias, w + ": bias");
    tdb = dlpack_arg(dbias, w + ": dbias");
    all.push_back(&tb);
    all.push_back(&tdb);
  }
  Backend& be = backend_for(all, w, backend, stream);
  const TensorView dyv = matrix_view(tdy, w + ": dout", {DType::F32}, "dout");
  const TensorView xv = matrix_view(tx, w + ": x", {DType::F32}, "x");
  const TensorView wv = matrix_view(tw, w + ": weight", {DType::F32}, "weight");
  const TensorView dxv = matrix_view(tdx, w + ": dx", {DType::F32}, "dx");
  const TensorView dwv = matrix_view(tdw, w + ": dweight", {DType::F32}, "dweight");
  TensorView bv, dbv;
  if (!bias.is_none()) {
    bv = matrix_view(tb, w + ": bias", {DType::F32}, "bias");
    dbv = matrix_view(tdb, w + ": dbias", {DType::F32}, "dbias");
    dbv.rows = dbv.numel();
    dbv.cols = 1;
  }
  check_shape(xv, xv.rows, wv.cols, w + ": x");
  check_shape(dyv, xv.rows, wv.rows, w + ": dout");
  check_shape(dxv, xv.rows, wv.cols, w + ": dx");
  check_shape(dwv, wv.rows, wv.cols, w + ": dweight");
  if (dbv.present() && dbv.rows != wv.rows)
    throw py::value_error(w + ": dbias has " + std::to_string(dbv.rows) + " elements, expected " +
                          std::to_string(wv.rows));
  std::vector<model::QuantStat> st;
  {
    py::gil_scoped_release release;
    model::linear_backward(be, r, ids, dxv, dwv, dbv, dyv, xv, weights(wv, bv), GemmPrecision::BF16,
                           statistics ? &st : nullptr, name);
  }
  return stats_list(st);
}

}  // namespace

void register_linear(py::module_& m) {
  py::class_<model::LinearRecipe>(m, "LinearRecipe",
                                  "What one linear layer does at one step (DESIGN.md §9)")
      .def_property_readonly("fprop",
                             [](const model::LinearRecipe& r) { return model::name_of(r.fprop); })
      .def_property_readonly("dgrad",
                             [](const model::LinearRecipe& r) { return model::name_of(r.dgrad); })
      .def_property_readonly("wgrad",
                             [](const model::LinearRecipe& r) { return model::name_of(r.wgrad); })
      .def_property_readonly("gemm",
                             [](const model::LinearRecipe& r) { return model::name_of(r.impl); })
      .def_property_readonly("quantized", &model::LinearRecipe::any_quantized)
      .def("__repr__", [](const model::LinearRecipe& r) {
        return std::string("LinearRecipe(fprop=") + model::name_of(r.fprop) +
               ", dgrad=" + model::name_of(r.dgrad) + ", wgrad=" + model::name_of(r.wgrad) +
               ", gemm=" + model::name_of(r.impl) + ")";
      });
  py::class_<Recipe>(m, "Recipe",
                     "A recipe (the recipe.* keys of a config, checked as a config file's) for a "
                     "model of n_layers recipe units, with §9's high-precision blocks")
      .def(py::init(&make_recipe), py::arg("keys"), py::arg("n_layers"))
      .def("linear", &Recipe::linear, py::arg("layer"), py::arg("linear"), py::arg("step"),
           "The LinearRecipe of linear `linear` of block `layer` at `step` (the trainer's rule)")
      .def_property_readonly("high_precision", [](const Recipe& r) { return r.high_precision; })
      .def_property_readonly("name",
                             [](const Recipe& r) { return model::name_of(r.config.recipe.name); })
      .def_property_readonly(
          "keys", [](const Recipe& r) { return model::to_json(r.config).at("recipe").dump(); });
  m.def(
      "linear_forward",
      [](const model::LinearRecipe& r, const py::object& x, const py::object& weight,
         const py::object& bias, const py::object& out, uint64_t seed, int64_t step,
         int64_t micro_batch, int64_t layer, int64_t linear, const std::string& name,
         bool statistics, const py::object& backend, uintptr_t stream) {
        return linear_forward(r, {seed, step, micro_batch, layer, linear}, x, weight, bias, out,
                              name, statistics, backend, stream);
      },
      py::arg("recipe"), py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("out"),
      py::kw_only(), py::arg("seed"), py::arg("step"), py::arg("micro_batch"), py::arg("layer"),
      py::arg("linear"), py::arg("name"), py::arg("statistics") = false,
      py::arg("backend") = py::none(), py::arg("stream") = 0,
      "out = x W^T + bias under the recipe (model/linear.hpp's linear_forward), DLPack tensors; "
      "returns the row-wise copies' statistics when asked");
  m.def(
      "linear_backward",
      [](const model::LinearRecipe& r, const py::object& dout, const py::object& x,
         const py::object& weight, const py::object& bias, const py::object& dx,
         const py::object& dweight, const py::object& dbias, uint64_t seed, int64_t step,
         int64_t micro_batch, int64_t layer, int64_t linear, const std::string& name,
         bool statistics, const py::object& backend, uintptr_t stream) {
        return linear_backward(r, {seed, step, micro_batch, layer, linear}, dout, x, weight, bias,
                               dx, dweight, dbias, name, statistics, backend, stream);
      },
      py::arg("recipe"), py::arg("dout"), py::arg("x"), py::arg("weight"), py::arg("bias"),
      py::arg("dx"), py::arg("dweight"), py::arg("dbias"), py::kw_only(), py::arg("seed"),
      py::arg("step"), py::arg("micro_batch"), py::arg("layer"), py::arg("linear"), py::arg("name"),
      py::arg("statistics") = false, py::arg("backend") = py::none(), py::arg("stream") = 0,
      "dx = dout W (written), dweight += dout^T x, dbias += column sums of dout, under the recipe "
      "(linear_backward)");
}

}  // namespace fp4sim::py_args
