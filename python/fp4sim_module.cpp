// The fp4sim Python module (_fp4sim, imported by python/fp4sim/__init__.py): the CLI's quantize,
// dequantize, convert, gemm and mma through the same code (tools/quantize_options.hpp maps the
// keyword arguments onto a QuantizeConfig and builds the meta; tools/gemm_run the GEMM's checks),
// so the results are the CLI's bits. numpy arrays on the host; CUDA DLPack tensors (the *_device
// functions) on the CUDA backend, on the caller's stream (python/dlpack_args.hpp); fp4sim.torch's
// linear layer in python/linear_binding.cpp. DESIGN.md §15.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>

#include "emu/contract.hpp"
#include "emu/formats.hpp"
#include "emu/mma.hpp"
#include "model/linear.hpp"
#include "python/dlpack_args.hpp"
#include "python/linear_binding.hpp"
#include "tools/backends.hpp"
#include "tools/convert_values.hpp"
#include "tools/gemm_run.hpp"
#include "tools/quantize_options.hpp"

#ifndef FP4SIM_VERSION
#define FP4SIM_VERSION "0.1.0"
#endif

namespace py = pybind11;

namespace fp4sim {
namespace {

// A 2-D C-contiguous float32 or bfloat16-as-uint16 array as a TensorView named `name`; TypeError
// or ValueError naming the argument otherwise (no silent conversion: the bits are the point).
TensorView host_view(const py::array& a, const char* name) {
  const std::string n = std::string("fp4sim.quantize: ") + name;
  DType dt;
  if (a.dtype().is(py::dtype::of<float>()))
    dt = DType::F32;
  else if (a.dtype().is(py::dtype::of<uint16_t>()))
    dt = DType::BF16;
  else
    throw py::type_error(n + ": dtype " + py::str(a.dtype()).cast<std::string>() +
                         " not supported (float32, or bfloat16 bit patterns as uint16)");
  if (a.ndim() != 2)
    throw py::value_error(n + ": expected a 2-D array (rows x cols), got " +
                          std::to_string(a.ndim()) + " dimensions");
  if (!(a.flags() & py::array::c_style))
    throw py::value_error(n +
                          ": the array is not C-contiguous (numpy.ascontiguousarray makes a "
                          "contiguous copy)");
  TensorView v;
  v.dtype = dt;
  v.data = const_cast<void*>(a.data());
  v.rows = static_cast<int64_t>(a.shape(0));
  v.cols = static_cast<int64_t>(a.shape(1));
  v.name = name;
  return v;
}

// A JSON value as Python objects (the meta dicts; no json.loads of a dumped string per call).
py::object to_python(const nlohmann::json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::object: {
      py::dict d;
      for (auto it = j.begin(); it != j.end(); ++it) d[py::str(it.key())] = to_python(it.value());
      return py::object(std::move(d));
    }
    case nlohmann::json::value_t::array: {
      py::list l;
      for (const auto& v : j) l.append(to_python(v));
      return py::object(std::move(l));
    }
    case nlohmann::json::value_t::string:
      return py::str(j.get<std::string>());
    case nlohmann::json::value_t::boolean:
      return py::bool_(j.get<bool>());
    case nlohmann::json::value_t::number_integer:
      return py::int_(j.get<int64_t>());
    case nlohmann::json::value_t::number_unsigned:
      return py::int_(j.get<uint64_t>());
    case nlohmann::json::value_t::number_float:
      return py::float_(j.get<double>());
    default:
      return py::none();
  }
}

// A numpy array that takes over v's memory (no copy): the vector lives in a capsule the array owns.
template <class T>
py::array_t<T> owned_numpy(std::vector<T>&& v, std::vector<py::ssize_t> shape) {
  auto* heap = new std::vector<T>(std::move(v));
  py::capsule owner(heap, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>(shape, heap->data(), owner);
}

template <class T>
py::array_t<T> to_numpy(const T* data, std::vector<py::ssize_t> shape) {
  py::array_t<T> out(shape);
  std::memcpy(out.mutable_data(), data, static_cast<size_t>(out.size()) * sizeof(T));
  return out;
}

// The keyword arguments of fp4sim.quantize as the CLI's options and their QuantizeConfig.
std::pair<cli::QuantizeOptions, QuantizeConfig> quantize_options(
    const std::string& format, bool block_2d, bool columnwise, bool rht, bool sr, uint64_t seed,
    uint64_t stream, bool four_over_six, const std::string& error, const py::object& mx_rule) {
  cli::QuantizeOptions o;
  if (!sr && (seed != 0 || stream != 0))
    throw py::value_error("fp4sim.quantize: seed and stream apply to sr=True only");
  if (!four_over_six && error != "mae")
    throw py::value_error("fp4sim.quantize: error applies to four_over_six=True only");
  o.format = format;
  o.block_2d = block_2d;
  o.columnwise = columnwise;
  o.rht = rht;
  o.sr = sr;
  o.seed = seed;
  o.stream = stream;
  o.fos = four_over_six;
  o.error = error;
  if (!mx_rule.is_none()) {
    o.mx_rule = mx_rule.cast<std::string>();
    o.mx_rule_given = true;
  }
  try {
    return {o, cli::quantize_config(o)};
  } catch (const std::invalid_argument& e) {  // (unknown values; the CLI's messages name its flags)
    throw py::value_error(std::string("fp4sim.quantize: ") + e.what());
  }
}

py::dict quantize(const py::array& x, const std::string& format, bool block_2d, bool columnwise,
                  bool rht, bool sr, uint64_t seed, uint64_t stream, bool four_over_six,
                  const std::string& error, const py::object& mx_rule, const py::object& backend) {
  const auto [o, cfg] = quantize_options(format, block_2d, columnwise, rht, sr, seed, stream,
                                         four_over_six, error, mx_rule);
  const std::string be_name =
      backend.is_none() ? default_backend_name() : backend.cast<std::string>();
  const TensorView in = host_view(x, "x");
  validate_quantize(in, cfg);  // (std::invalid_argument: ValueError, naming the tensor)
  auto be = make_backend(be_name);
  QuantizedHost q;
  std::vector<float> deq;
  {
    py::gil_scoped_release release;
    QuantizeResult res = quantize_to_host(*be, in, cfg);
    q = std::move(columnwise ? res.columnwise : res.rowwise);
    deq = dequantize_to_host(*be, q);
  }
  const auto R = static_cast<py::ssize_t>(q.rows), C = static_cast<py::ssize_t>(q.cols);
  const auto block = static_cast<py::ssize_t>(q.block_size());
  const bool fp8 = q.format == QFormat::FP8;
  const nlohmann::json meta =
      cli::quantize_meta(o, in.dtype, in.rows, in.cols, q, be->name(), "fp4sim.quantize");
  py::dict out;
  out["codes"] = owned_numpy(std::move(q.codes), {R, fp8 ? C : C / 2});
  if (fp8)
    out["scales"] = to_numpy(reinterpret_cast<const float*>(q.scales.data()), {R, C / block});
  else
    out["scales"] = owned_numpy(std::move(q.scales), {R, C / block});
  out["amax"] = to_numpy(&q.amax, {1});
  out["dequant"] = owned_numpy(std::move(deq), {R, C});
  out["meta"] = to_python(meta);
  return out;
}

// A C-contiguous array of dtype T with `shape` (TypeError / ValueError naming `name`).
template <class T>
const T* checked(const py::array& a, const char* fn, const char* name, const char* want,
                 const std::vector<py::ssize_t>& shape) {
  const std::string n = std::string("fp4sim.") + fn + ": " + name;
  if (!a.dtype().is(py::dtype::of<T>()))
    throw py::type_error(n + ": dtype " + py::str(a.dtype()).cast<std::string>() + ", expected " +
                         want);
  if (!(a.flags() & py::array::c_style))
    throw py::value_error(n + ": the array is not C-contiguous");
  std::vector<py::ssize_t> got(a.shape(), a.shape() + a.ndim());
  if (got != shape) {
    auto str = [](const std::vector<py::ssize_t>& v) {
      std::string r = "(";
      for (size_t i = 0; i < v.size(); ++i) r += (i ? ", " : "") + std::to_string(v[i]);
      return r + (v.size() == 1 ? ",)" : ")");
    };
    throw py::value_error(n + ": shape " + str(got) + ", expected " + str(shape));
  }
  return static_cast<const T*>(a.data());
}

// A copy's codes, scales and amax (quantize's layout) as a QuantizedHost; fn names the function
// in errors, what the copy ("" or "a: ").
QuantizedHost host_copy(const py::array& codes, const py::array& scales, const py::array& amax,
                        const std::string& format, bool four_over_six, const char* fn,
                        const std::string& what = "") {
  const std::string where = std::string("fp4sim.") + fn + ": " + what;
  QuantizedHost q;
  const QFormat f =
      format == "nvfp4"   ? QFormat::NVFP4
      : format == "mxfp4" ? QFormat::MXFP4
      : format == "fp8"
          ? QFormat::FP8
          : throw py::value_error(where + "format '" + format + "' (nvfp4, mxfp4 or fp8)");
  if (four_over_six && f != QFormat::NVFP4)
    throw py::value_error(where + "four_over_six applies to nvfp4 only");
  if (codes.ndim() != 2) throw py::value_error(where + "codes: expected a 2-D array");
  const py::ssize_t R = codes.shape(0), C = f == QFormat::FP8 ? codes.shape(1) : 2 * codes.shape(1);
  q.resize(R, C, f, four_over_six);
  const py::ssize_t blocks = C / q.block_size();
  if (C % q.block_size() != 0)
    throw py::value_error(where + "codes: " + std::to_string(C) +
                          " columns are not a multiple of the " + format + " block");
  const std::string cn = what + "codes", sn = what + "scales", an = what + "amax";
  const uint8_t* c = checked<uint8_t>(codes, fn, cn.c_str(), "uint8", {R, codes.shape(1)});
  std::memcpy(q.codes.data(), c, q.codes.size());
  if (f == QFormat::FP8) {
    const float* sc = checked<float>(scales, fn, sn.c_str(), "float32", {R, blocks});
    std::memcpy(q.scales.data(), sc, q.scales.size());
  } else {
    const uint8_t* sc = checked<uint8_t>(scales, fn, sn.c_str(), "uint8", {R, blocks});
    std::memcpy(q.scales.data(), sc, q.scales.size());
  }
  q.amax = *checked<float>(amax, fn, an.c_str(), "float32", {1});
  return q;
}

// The dequantized float32 [rows, cols] of a copy's codes, scales and amax (the layout quantize
// returns), as `fp4sim quantize` computes its dequant file.
py::array_t<float> dequantize(const py::array& codes, const py::array& scales,
                              const py::array& amax, const std::string& format, bool four_over_six,
                              const py::object& backend) {
  QuantizedHost q = host_copy(codes, scales, amax, format, four_over_six, "dequantize");
  const auto R = static_cast<py::ssize_t>(q.rows), C = static_cast<py::ssize_t>(q.cols);
  auto be = make_backend(backend.is_none() ? default_backend_name() : backend.cast<std::string>());
  std::vector<float> deq;
  {
    py::gil_scoped_release release;
    deq = dequantize_to_host(*be, q);
  }
  return owned_numpy(std::move(deq), {R, C});
}

// fp4sim convert: float32 -> codes (uint8; uint16 BF16 bits for bf16), or codes -> float32.
py::array convert(const py::array& x, const std::string& format, bool decode) {
  std::vector<py::ssize_t> shape(x.shape(), x.shape() + x.ndim());
  size_t n = 1;
  for (py::ssize_t d : shape) n *= static_cast<size_t>(d);
  try {
    if (!decode) {
      const float* in = checked<float>(x, "convert", "x", "float32", shape);
      const std::vector<uint8_t> o = cli::encode_values(format, in, n);
      if (format == "bf16") return to_numpy(reinterpret_cast<const uint16_t*>(o.data()), shape);
      return to_numpy(o.data(), shape);
    }
    const uint8_t* in = format == "bf16"
                            ? reinterpret_cast<const uint8_t*>(
                                  checked<uint16_t>(x, "convert", "x", "uint16 (BF16 bits)", shape))
                            : checked<uint8_t>(x, "convert", "x", "uint8 codes", shape);
    const std::vector<float> o = cli::decode_values(format, in, n, "x");
    return to_numpy(o.data(), shape);
  } catch (const std::invalid_argument& e) {
    throw py::value_error(std::string("fp4sim.convert: ") + e.what());
  }
}

// fp4sim.gemm's keyword options as the operands' format and the GEMM's config (ValueError naming
// the option; the host and the CUDA path share them).
std::pair<QFormat, GemmConfig> gemm_options(const py::object& format_obj,
                                            const std::string& gemm_impl,
                                            const std::string& out_dtype, float alpha, float beta,
                                            int split_k, bool has_c) {
  const std::string fn = "fp4sim.gemm: ";
  const std::string format = format_obj.is_none() ? "nvfp4" : format_obj.cast<std::string>();
  if (format != "nvfp4" && format != "mxfp4" && format != "fp8")
    throw py::value_error(fn + "format '" + format + "' (nvfp4, mxfp4 or fp8)");
  if (gemm_impl != "exact" && gemm_impl != "cublaslt")
    throw py::value_error(fn + "gemm '" + gemm_impl + "' (exact or cublaslt)");
  if (out_dtype != "fp32" && out_dtype != "bf16")
    throw py::value_error(fn + "out_dtype '" + out_dtype + "' (fp32 or bf16)");
  if (split_k < 1) throw py::value_error(fn + "split_k must be >= 1");
  if (has_c && beta == 0.0f)
    throw py::value_error(fn + "c with beta 0 would not contribute: give beta");
  GemmConfig cfg;
  cfg.alpha = alpha;
  cfg.beta = beta;
  cfg.split_k = split_k;
  cfg.out = out_dtype == "bf16" ? GemmOut::BF16 : GemmOut::F32;
  cfg.impl = gemm_impl == "cublaslt" ? GemmImpl::CublasLt : GemmImpl::Exact;
  const QFormat fmt =
      format == "fp8" ? QFormat::FP8 : (format == "mxfp4" ? QFormat::MXFP4 : QFormat::NVFP4);
  return {fmt, cfg};
}

// fp4sim gemm: a [M, K] and b [N, K] float32 arrays quantized as the CLI quantizes them, or
// quantize's results (dicts of codes, scales, amax and meta) used as they are (as the CLI's
// --a-prefix/--b-prefix files); then D = alpha * A * B^T (+ beta * C) through tools/gemm_run (the
// CLI's code).
py::dict gemm(const py::object& a_obj, const py::object& b_obj, const py::object& c_obj,
              const py::object& format_obj, const std::string& gemm_impl,
              const std::string& out_dtype, float alpha, float beta, int split_k,
              const py::object& backend) {
  const char* fn = "fp4sim.gemm: ";
  const bool quantized = py::isinstance<py::dict>(a_obj);
  if (quantized != py::isinstance<py::dict>(b_obj))
    throw py::value_error(std::string(fn) +
                          "a and b must both be arrays or both be quantize's results");
  if (quantized && !format_obj.is_none())
    throw py::value_error(std::string(fn) +
                          "format does not go with quantized operands (their meta names it)");
  const auto [fmt, cfg] =
      gemm_options(format_obj, gemm_impl, out_dtype, alpha, beta, split_k, !c_obj.is_none());
  std::vector<std::string> warnings;
  QuantizedHost qa, qb;
  std::vector<float> xa, xb;
  int64_t M, K, N;
  if (quantized) {
    bool rht[2];
    QuantizedHost* qs[2] = {&qa, &qb};
    const py::object objs[2] = {a_obj, b_obj};
    for (int i = 0; i < 2; ++i) {
      const py::dict d = objs[i].cast<py::dict>();
      const std::string what = i ? "b: " : "a: ";
      for (const char* key : {"codes", "scales", "amax", "meta"})
        if (!d.contains(key))
          throw py::value_error(std::string(fn) + what + "no '" + key +
                                "' (pass fp4sim.quantize's result)");
      const py::dict meta = d["meta"].cast<py::dict>();
      const auto get = [&](const char* k, const py::object& dflt) {
        return meta.contains(k) ? py::reinterpret_borrow<py::object>(meta[k]) : dflt;
      };
      *qs[i] = host_copy(d["codes"].cast<py::array>(), d["scales"].cast<py::array>(),
                         d["amax"].cast<py::array>(),
                         get("format", py::str("nvfp4")).cast<std::string>(),
                         get("four_over_six", py::bool_(false)).cast<bool>(), "gemm", what);
      rht[i] = get("rht", py::bool_(false)).cast<bool>();
      if (!std::isfinite(qs[i]->amax))
        warnings.push_back(std::string(i ? "B" : "A") + "'s amax is " +
                           std::to_string(qs[i]->amax) +
                           ": its input held an Inf or NaN, and D is not finite");
    }
    if (rht[0] != rht[1])
      throw py::value_error(std::string(fn) + (rht[0] ? "a" : "b") + " is an RHT copy and " +
                            (rht[0] ? "b" : "a") +
                            " is not: both operands of a GEMM need the same transform");
    M = qa.rows;
    K = qa.cols;
    N = qb.rows;
  } else {
    auto matrix = [&](const py::array& x, const char* name) {
      if (x.ndim() != 2)
        throw py::value_error(std::string(fn) + name + ": expected a 2-D array, got " +
                              std::to_string(x.ndim()) + " dimensions");
      const float* p = checked<float>(x, "gemm", name, "float32", {x.shape(0), x.shape(1)});
      return std::vector<float>(p, p + x.shape(0) * x.shape(1));
    };
    const py::array a = a_obj.cast<py::array>(), b = b_obj.cast<py::array>();
    xa = matrix(a, "a");
    xb = matrix(b, "b");
    M = a.shape(0);
    K = a.shape(1);
    N = b.shape(0);
    if (b.shape(1) != K)
      throw py::value_error(std::string(fn) + "K differs: a is " + shape_str(M, K) + " and b is " +
                            shape_str(N, b.shape(1)) + " (D = a * b^T needs a [M, K], b [N, K])");
  }
  std::vector<float> c;
  if (!c_obj.is_none()) {
    const py::array ca = c_obj.cast<py::array>();
    const float* cp = checked<float>(ca, "gemm", "c", "float32", {M, N});
    c.assign(cp, cp + M * N);
  }
  cli::GemmRun run;
  {
    py::gil_scoped_release release;
    if (!quantized) {
      qa = cli::quantize_gemm_operand(xa, M, K, fmt, "A", "a", &warnings);
      qb = cli::quantize_gemm_operand(xb, N, K, fmt, "B", "b", &warnings);
    }
    run = cli::run_gemm_checked(qa, qb, c.empty() ? nullptr : &c, "c", cfg,
                                backend.is_none() ? "" : backend.cast<std::string>());
  }
  warnings.insert(warnings.end(), run.warnings.begin(), run.warnings.end());
  py::dict out;
  if (cfg.out == GemmOut::BF16) {
    std::vector<uint16_t> h(run.bits.begin(), run.bits.end());
    out["d"] = owned_numpy(std::move(h), {M, N});
  } else {
    out["d"] = to_numpy(reinterpret_cast<const float*>(run.bits.data()), {M, N});
  }
  out["warnings"] = warnings;
  out["backend"] = run.backend;
  if (run.cublaslt_vs_exact >= 0) out["cublaslt_vs_exact"] = run.cublaslt_vs_exact;
  return out;
}

// One Blackwell block-scaled FP4 MMA dot product (GST-FDPA, K = 64; `fp4sim mma`): a and b 64
// float32 E2M1 values each, sfa and sfb the raw scale bytes (4, or 2 for ue8m0-32), c FP32.
py::dict mma(const py::array& a, const py::array& b, const py::array& sfa, const py::array& sfb,
             const std::string& scale, double c_wide) {
  const ScaleKind kind = scale == "ue4m3"      ? ScaleKind::UE4M3_16
                         : scale == "ue8m0-16" ? ScaleKind::UE8M0_16
                         : scale == "ue8m0-32"
                             ? ScaleKind::UE8M0_32
                             : throw py::value_error("fp4sim.mma: scale '" + scale +
                                                     "' (ue4m3, ue8m0-16 or ue8m0-32)");
  const py::ssize_t want = kind == ScaleKind::UE8M0_32 ? 2 : 4;
  const float* av = checked<float>(a, "mma", "a", "float32", {kGstK});
  const float* bv = checked<float>(b, "mma", "b", "float32", {kGstK});
  const uint8_t* sa_in = checked<uint8_t>(sfa, "mma", "sfa", "uint8 scale bytes", {want});
  const uint8_t* sb_in = checked<uint8_t>(sfb, "mma", "sfb", "uint8 scale bytes", {want});
  const float c = static_cast<float>(c_wide);
  if (std::isfinite(c_wide) && !std::isfinite(c))
    throw py::value_error("fp4sim.mma: c = " + std::to_string(c_wide) +
                          " is beyond the FP32 range (pass inf for an infinite C)");
  if (c_wide != 0.0 && c == 0.0f)
    throw py::value_error("fp4sim.mma: c is below FP32's smallest subnormal (2^-149)");
  uint8_t pa[32] = {}, pb[32] = {}, sa[4] = {}, sb[4] = {};
  for (int k = 0; k < kGstK; ++k)
    for (const auto& [x, packed, name] : {std::tuple{av[k], pa, "a"}, std::tuple{bv[k], pb, "b"}}) {
      if (e2m1_to_f32(e2m1_rn_satfinite(x)) != x)
        throw py::value_error(std::string("fp4sim.mma: ") + name + "[" + std::to_string(k) +
                              "] = " + std::to_string(x) +
                              " is not an E2M1 value (±0, 0.5, 1, 1.5, 2, 3, 4, 6)");
      packed[k / 2] |= static_cast<uint8_t>(e2m1_rn_satfinite(x) << (4 * (k & 1)));
    }
  for (py::ssize_t i = 0; i < want; ++i) {
    if (kind == ScaleKind::UE4M3_16 && (sa_in[i] > 0x7F || sb_in[i] > 0x7F))
      throw py::value_error(
          "fp4sim.mma: a UE4M3 scale byte has the sign bit set (sfa or sfb "
          "element " +
          std::to_string(i) + "); UE4M3 scales are unsigned");
    sa[i] = sa_in[i];
    sb[i] = sb_in[i];
  }
  GstTrace tr{};
  const uint32_t r = gst_fdpa_fp4_bits(pa, pb, sa, sb, kind, c, &tr);
  py::dict out;
  out["d"] = py::float_(static_cast<double>(f32_from_bits(r)));
  out["bits"] = r;
  py::list sums, exps, grid;
  for (int g = 0; g < kGstGroups; ++g) {
    sums.append(tr.p4[g] / 4.0);
    exps.append(tr.group_exp[g]);
  }
  for (int g = 0; g <= kGstGroups; ++g) grid.append(tr.truncated[g]);
  out["group_sums"] = sums;  // each group's exact sum of products
  out["group_exponents"] = exps;
  out["c_exponent"] = tr.c_exp;
  out["e_max"] = tr.e_max;
  out["terms_on_grid"] = grid;  // each term on the grid 2^(e_max - 35), C last
  return out;
}

// For the speed measurement (validation/bench_python.py): the median seconds of `repeats` runs
// of the C++ work behind fp4sim.quantize (op "quantize": quantize_to_host then
// dequantize_to_host, NVFP4 1x16 RN) or fp4sim.gemm (op "gemm": both operands' quantization and
// the exact GEMM of x with itself), on one backend made once, with no Python objects involved.
double cpp_seconds(const std::string& op, const py::array& x, int repeats,
                   const py::object& backend) {
  const TensorView in = host_view(x, "x");
  if (in.dtype != DType::F32) throw py::type_error("_cpp_seconds: x must be float32");
  const std::string be_name =
      backend.is_none() ? default_backend_name() : backend.cast<std::string>();
  std::vector<double> t;
  {
    py::gil_scoped_release release;
    auto be = make_backend(be_name);
    QuantizeConfig cfg;
    cfg.format = QFormat::NVFP4;
    cfg.rowwise.enabled = true;
    for (int r = 0; r < repeats; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      if (op == "quantize") {
        QuantizeResult res = quantize_to_host(*be, in, cfg);
        const std::vector<float> deq = dequantize_to_host(*be, res.rowwise);
      } else {
        std::vector<float> xa(in.as<const float>(), in.as<const float>() + in.numel()), xb = xa;
        std::vector<std::string> w;
        QuantizedHost qa =
            cli::quantize_gemm_operand(xa, in.rows, in.cols, QFormat::NVFP4, "A", "x", &w);
        QuantizedHost qb =
            cli::quantize_gemm_operand(xb, in.rows, in.cols, QFormat::NVFP4, "B", "x", &w);
        double ms;
        cli::run_gemm_on(*be, qa, qb, nullptr, GemmConfig{}, &ms);
      }
      t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// ---- CUDA tensors (DLPack): the same work on device memory, the results as DeviceArrays ----

using py_args::DeviceArray;
using py_args::DlTensor;

std::shared_ptr<DeviceArray> device_array(Backend& be, DType t, std::vector<int64_t> shape, int dev,
                                          uintptr_t stream, const char* label) {
  return std::make_shared<DeviceArray>(be, t, std::move(shape), dev, stream, label);
}

// A result in device memory: a DeviceArray made here, or the caller's tensor (`given`, a DLPack
// tensor of exactly this dtype, shape and device, e.g. from torch's allocator: no export after).
struct Result {
  std::shared_ptr<DeviceArray> array;
  DlTensor given;
  void* data = nullptr;
  py::object object() const { return array ? py::cast(array) : py::object(py::none()); }
};

Result result_slot(Backend& be, const py::object& given, DType t, std::vector<int64_t> shape,
                   int dev, uintptr_t stream, const std::string& where, const char* label) {
  Result r;
  if (given.is_none()) {
    r.array = device_array(be, t, std::move(shape), dev, stream, label);
    r.data = r.array->data();
    return r;
  }
  r.given = py_args::dlpack_arg(given, where);
  const TensorView v = py_args::matrix_view(r.given, where, {t}, label);
  if (!r.given.cuda() || r.given.device_index() != dev)
    throw py::value_error(where + ": not on CUDA device " + std::to_string(dev));
  if (r.given.shape != shape) {
    std::string want;
    for (int64_t d : shape) want += (want.empty() ? "" : ", ") + std::to_string(d);
    throw py::value_error(where + ": the output's shape is not (" + want + ")");
  }
  r.data = v.data;
  return r;
}

// A CUDA DLPack tensor of 2 dimensions (ValueError naming `where` otherwise).
DlTensor cuda_matrix(const py::object& x, const std::string& where) {
  DlTensor d = py_args::dlpack_arg(x, where);
  if (!d.cuda()) throw py::value_error(where + ": not a CUDA tensor");
  if (d.t->ndim != 2)
    throw py::value_error(where + ": expected a 2-D tensor (rows x cols), got " +
                          std::to_string(d.t->ndim) + " dimensions");
  return d;
}

// One quantization of CUDA tensors of a fixed shape, its options parsed and checked and its outputs
// in place (made here as DeviceArrays, or the caller's tensors from `outs`): fp4sim.quantize runs
// it once, fp4sim.Quantizer (CudaQuantizer) on every call.
struct DeviceQuantize {
  cli::QuantizeOptions o;
  QuantizeConfig cfg;
  DType dtype = DType::F32;
  int64_t in_rows = 0, in_cols = 0;
  int device = 0;
  QuantizedView q;
  Result codes, scales, amax, deq;

  DeviceQuantize(const TensorView& in, int dev, uintptr_t stream, const std::string& format,
                 bool block_2d, bool columnwise, bool rht, bool sr, uint64_t seed,
                 uint64_t sr_stream, bool four_over_six, const std::string& error,
                 const py::object& mx_rule, const py::object& outs) {
    std::tie(o, cfg) = quantize_options(format, block_2d, columnwise, rht, sr, seed, sr_stream,
                                        four_over_six, error, mx_rule);
    validate_quantize(in, cfg);
    dtype = in.dtype;
    in_rows = in.rows;
    in_cols = in.cols;
    device = dev;
    Backend& be = py_args::module_backend("cuda", dev, stream);
    const CopyShape cs = written_shape(in, columnwise);
    q.rows = cs.rows;
    q.cols = cs.cols;
    q.format = cfg.format;
    q.four_over_six = (columnwise ? cfg.columnwise : cfg.rowwise).four_over_six;
    q.device = Device::Cuda;
    const bool fp8 = q.format == QFormat::FP8;
    const int64_t R = q.rows, C = q.cols, blocks = C / q.block();
    if (!outs.is_none() && py::len(outs) != 4)
      throw py::value_error("fp4sim.quantize: outs must be (codes, scales, amax, dequant)");
    const auto out_obj = [&](int i) {
      return outs.is_none() ? py::object(py::none()) : py::object(outs.cast<py::tuple>()[i]);
    };
    const std::string w = "fp4sim.quantize: out ";
    codes = result_slot(be, out_obj(0), DType::U8, {R, fp8 ? C : C / 2}, dev, stream, w + "codes",
                        "codes");
    scales = result_slot(be, out_obj(1), fp8 ? DType::F32 : DType::U8, {R, blocks}, dev, stream,
                         w + "scales", "scales");
    amax = result_slot(be, out_obj(2), DType::F32, {1}, dev, stream, w + "amax", "amax");
    deq = result_slot(be, out_obj(3), DType::F32, {R, C}, dev, stream, w + "dequant", "dequant");
    q.codes = static_cast<uint8_t*>(codes.data);
    q.scales = static_cast<uint8_t*>(scales.data);
    q.amax = static_cast<float*>(amax.data);
  }

  // Quantize `in` (the construction's dtype and shape) under `c` (cfg, or cfg with another SR
  // stream) and dequantize, enqueued on `be`'s stream (no synchronization). Call without the GIL.
  void run(Backend& be, const TensorView& in, const QuantizeConfig& c) const {
    const bool columnwise = c.columnwise.enabled;
    QuantizedView out = q;
    be.quantize(in, c, columnwise ? nullptr : &out, columnwise ? &out : nullptr);
    be.dequantize(out, view_of(deq.data, DType::F32, q.rows, q.cols, Device::Cuda, "dequantized"));
  }
};

py::dict quantize_device(const py::object& x, uintptr_t stream, const std::string& format,
                         bool block_2d, bool columnwise, bool rht, bool sr, uint64_t seed,
                         uint64_t sr_stream, bool four_over_six, const std::string& error,
                         const py::object& mx_rule, const py::object& outs) {
  const DlTensor d = cuda_matrix(x, "fp4sim.quantize: x");
  const TensorView in =
      py_args::matrix_view(d, "fp4sim.quantize: x", {DType::F32, DType::BF16}, "x");
  const DeviceQuantize dq(in, d.device_index(), stream, format, block_2d, columnwise, rht, sr, seed,
                          sr_stream, four_over_six, error, mx_rule, outs);
  Backend& be = py_args::module_backend("cuda", dq.device, stream);
  QuantizedHost meta_q;  // (what the meta reads: shape, format, amax)
  {
    py::gil_scoped_release release;
    dq.run(be, in, dq.cfg);
    be.download(&meta_q.amax, dq.q.amax, sizeof(float));  // (4 bytes for the meta: synchronizes)
  }
  meta_q.rows = dq.q.rows;
  meta_q.cols = dq.q.cols;
  meta_q.format = dq.q.format;
  meta_q.four_over_six = dq.q.four_over_six;
  const nlohmann::json meta =
      cli::quantize_meta(dq.o, in.dtype, in.rows, in.cols, meta_q, be.name(), "fp4sim.quantize");
  py::dict out;
  out["codes"] = dq.codes.object();  // (None where the caller gave the tensor)
  out["scales"] = dq.scales.object();
  out["amax"] = dq.amax.object();
  out["dequant"] = dq.deq.object();
  out["meta"] = to_python(meta);
  return out;
}

// fp4sim.Quantizer's engine: a DeviceQuantize made once for tensors like `like`; each call checks
// x against it and enqueues the quantization on the caller's stream, with no synchronization, no
// allocation and no meta (DESIGN.md §15: the repeated-call path of a CUDA quantizer).
class CudaQuantizer {
 public:
  CudaQuantizer(const py::object& like, uintptr_t stream, const std::string& format, bool block_2d,
                bool columnwise, bool rht, bool sr, uint64_t seed, uint64_t sr_stream,
                bool four_over_six, const std::string& error, const py::object& mx_rule,
                const py::object& outs)
      : dq_(view_of_like(like), cuda_matrix(like, "fp4sim.Quantizer: like").device_index(), stream,
            format, block_2d, columnwise, rht, sr, seed, sr_stream, four_over_six, error, mx_rule,
            outs),
        stream_(stream),
        sr_(sr) {}

  // sr_stream: this call's SR stream (None: the one it was made with).
  void call(const py::object& x, uintptr_t stream, const py::object& sr_stream) const {
    if (stream != stream_)  // (its outputs belong to the stream they were made on)
      throw py::value_error("fp4sim.Quantizer: made on CUDA stream " + std::to_string(stream_) +
                            ", called on stream " + std::to_string(stream) +
                            ": make a Quantizer for each stream");
    if (!sr_stream.is_none() && !sr_)
      throw py::value_error("fp4sim.Quantizer: stream applies to sr=True only");
    const DlTensor d = cuda_matrix(x, "fp4sim.Quantizer: x");
    const TensorView in =
        py_args::matrix_view(d, "fp4sim.Quantizer: x", {DType::F32, DType::BF16}, "x");
    if (in.dtype != dq_.dtype || in.rows != dq_.in_rows || in.cols != dq_.in_cols ||
        d.device_index() != dq_.device)
      throw py::value_error("fp4sim.Quantizer: x is " + shape_str(in.rows, in.cols) + " " +
                            dtype_name(in.dtype) + " on cuda:" + std::to_string(d.device_index()) +
                            "; this quantizer was made for " + shape_str(dq_.in_rows, dq_.in_cols) +
                            " " + dtype_name(dq_.dtype) + " on cuda:" + std::to_string(dq_.device));
    QuantizeConfig c = dq_.cfg;
    if (!sr_stream.is_none())
      (c.columnwise.enabled ? c.columnwise : c.rowwise).stream = sr_stream.cast<uint64_t>();
    Backend& be = py_args::module_backend("cuda", dq_.device, stream);
    py::gil_scoped_release release;
    dq_.run(be, in, c);
  }

  py::tuple outputs() const {
    return py::make_tuple(dq_.codes.object(), dq_.scales.object(), dq_.amax.object(),
                          dq_.deq.object());
  }

 private:
  static TensorView view_of_like(const py::object& like) {
    return py_args::matrix_view(cuda_matrix(like, "fp4sim.Quantizer: like"),
                                "fp4sim.Quantizer: like", {DType::F32, DType::BF16}, "x");
  }
  DeviceQuantize dq_;
  uintptr_t stream_;
  bool sr_;
};

py::object dequantize_device(const py::object& codes, const py::object& scales,
                             const py::object& amax, uintptr_t stream, const std::string& format,
                             bool four_over_six, const py::object& out_given) {
  const char* fn = "fp4sim.dequantize: ";
  const QFormat f = format == "nvfp4"   ? QFormat::NVFP4
                    : format == "mxfp4" ? QFormat::MXFP4
                    : format == "fp8"   ? QFormat::FP8
                                        : throw py::value_error(fn + std::string("format '") +
                                                                format + "' (nvfp4, mxfp4 or fp8)");
  if (four_over_six && f != QFormat::NVFP4)
    throw py::value_error(std::string(fn) + "four_over_six applies to nvfp4 only");
  const DlTensor dc = cuda_matrix(codes, std::string(fn) + "codes");
  const DlTensor ds = cuda_matrix(scales, std::string(fn) + "scales");
  const DlTensor da = py_args::dlpack_arg(amax, std::string(fn) + "amax");
  QuantizedView q;
  q.format = f;
  q.four_over_six = four_over_six;
  q.device = Device::Cuda;
  q.rows = dc.shape[0];
  q.cols = f == QFormat::FP8 ? dc.shape[1] : 2 * dc.shape[1];
  if (q.cols % q.block() != 0)
    throw py::value_error(std::string(fn) + "codes: " + std::to_string(q.cols) +
                          " columns are not a multiple of the " + format + " block");
  const auto want = [&](const DlTensor& t, const std::string& name, DType dt, int64_t r,
                        int64_t c) {
    const TensorView v = py_args::matrix_view(t, fn + name, {dt}, "operand");
    if (!t.cuda() || t.device_index() != dc.device_index())
      throw py::value_error(fn + name + ": not on the codes' CUDA device");
    if (v.rows != r || v.cols != c)
      throw py::value_error(fn + name + ": shape " + shape_str(v.rows, v.cols) + ", expected " +
                            shape_str(r, c));
    return v.data;
  };
  q.codes = static_cast<uint8_t*>(want(dc, "codes", DType::U8, q.rows, dc.shape[1]));
  q.scales = static_cast<uint8_t*>(
      want(ds, "scales", f == QFormat::FP8 ? DType::F32 : DType::U8, q.rows, q.cols / q.block()));
  q.amax = static_cast<float*>(want(da, "amax", DType::F32, 1, 1));
  const int dev = dc.device_index();
  Backend& be = py_args::module_backend("cuda", dev, stream);
  const Result out = result_slot(be, out_given, DType::F32, {q.rows, q.cols}, dev, stream,
                                 std::string(fn) + "out", "dequantized");
  {
    py::gil_scoped_release release;
    be.dequantize(q, view_of(out.data, DType::F32, q.rows, q.cols, Device::Cuda, "dequantized"));
  }
  return out.object();
}

py::dict gemm_device(const py::object& a, const py::object& b, const py::object& c,
                     uintptr_t stream, const py::object& format_obj, const std::string& gemm_impl,
                     const std::string& out_dtype, float alpha, float beta, int split_k,
                     const py::object& out_given) {
  const std::string fn = "fp4sim.gemm: ";
  const auto [fmt, cfg] =
      gemm_options(format_obj, gemm_impl, out_dtype, alpha, beta, split_k, !c.is_none());
  const DlTensor ta = cuda_matrix(a, fn + "a"), tb = cuda_matrix(b, fn + "b");
  const TensorView av = py_args::matrix_view(ta, fn + "a", {DType::F32}, "a");
  const TensorView bv = py_args::matrix_view(tb, fn + "b", {DType::F32}, "b");
  if (tb.device_index() != ta.device_index())
    throw py::value_error(fn + "a and b are on different CUDA devices");
  if (bv.cols != av.cols)
    throw py::value_error(fn + "K differs: a is " + shape_str(av.rows, av.cols) + " and b is " +
                          shape_str(bv.rows, bv.cols) + " (D = a * b^T needs a [M, K], b [N, K])");
  const int64_t M = av.rows, K = av.cols, N = bv.rows;
  DlTensor tc;
  TensorView cv;
  if (!c.is_none()) {
    tc = cuda_matrix(c, fn + "c");
    cv = py_args::matrix_view(tc, fn + "c", {DType::F32}, "c");
    if (cv.rows != M || cv.cols != N)
      throw py::value_error(fn + "c: shape " + shape_str(cv.rows, cv.cols) + ", expected " +
                            shape_str(M, N));
  }
  const int dev = ta.device_index();
  Backend& be = py_args::module_backend("cuda", dev, stream);
  // the operands quantized as the CLI quantizes them (RN, row-wise; the CUDA quantizer is bitwise
  // the emulator's)
  QuantizeConfig qc;
  qc.format = fmt;
  qc.rowwise.enabled = true;
  validate_quantize(av, qc);
  validate_quantize(bv, qc);
  model::QuantizedCopy ca(be, M, K, fmt, false), cb(be, N, K, fmt, false);
  const QuantizedView &qa = ca.view, &qb = cb.view;
  float amax[2];
  {
    py::gil_scoped_release release;
    be.quantize(av, qc, &ca.view, nullptr);
    be.quantize(bv, qc, &cb.view, nullptr);
    be.download(&amax[0], qa.amax, 4);
    be.download(&amax[1], qb.amax, 4);
  }
  std::vector<std::string> warnings;
  for (int i = 0; i < 2; ++i)
    if (!std::isfinite(amax[i]))
      warnings.push_back(std::string(i ? "B" : "A") + "'s amax is " + std::to_string(amax[i]) +
                         ": its input held an Inf or NaN, and D is not finite");
  cli::check_gemm(qa, amax[0], qb, amax[1], cv.present(), cfg, &warnings);
  const DType dt = cfg.out == GemmOut::BF16 ? DType::BF16 : DType::F32;
  const Result d = result_slot(be, out_given, dt, {M, N}, dev, stream, fn + "out", "d");
  const TensorView dv = view_of(d.data, dt, M, N, Device::Cuda, "D");
  double vs_exact = -1;
  {
    py::gil_scoped_release release;
    be.gemm(qa, qb, cv.present() ? &cv : nullptr, cfg, dv);
    if (cfg.impl == GemmImpl::CublasLt) {  // the distance to the exact GEMM, as the CLI reports
      GemmConfig ex = cfg;
      ex.impl = GemmImpl::Exact;
      const size_t bytes = static_cast<size_t>(M * N) * dtype_size(dv.dtype);
      BackendBuffer e(be, bytes);
      TensorView evw = dv;
      evw.data = e.get();
      be.gemm(qa, qb, cv.present() ? &cv : nullptr, ex, evw);
      std::vector<uint8_t> hx(bytes), hy(bytes);
      be.download(hx.data(), dv.data, bytes);
      be.download(hy.data(), e.get(), bytes);
      double worst = 0;
      for (int64_t i = 0; i < M * N; ++i) {
        float x, y;
        if (dv.dtype == DType::BF16) {
          uint16_t u, v;
          std::memcpy(&u, &hx[2 * i], 2);
          std::memcpy(&v, &hy[2 * i], 2);
          x = bf16_to_f32(u);
          y = bf16_to_f32(v);
        } else {
          std::memcpy(&x, &hx[4 * i], 4);
          std::memcpy(&y, &hy[4 * i], 4);
        }
        if (std::isfinite(x) && std::isfinite(y))
          worst = std::max(worst, std::fabs(static_cast<double>(x) - y));
      }
      vs_exact = worst;
    }
  }
  py::dict out;
  out["d"] = d.object();
  out["warnings"] = warnings;
  out["backend"] = be.name();
  if (vs_exact >= 0) out["cublaslt_vs_exact"] = vs_exact;
  return out;
}

// fp4sim.Gemm's engine: the options parsed once, the operands' quantized copies and D made once
// for a [M, K] and b [N, K] like the construction's (and c [M, N] where made with one); each call
// quantizes a and b (RN, row-wise, as fp4sim.gemm does) and enqueues the GEMM on the caller's
// stream, with no synchronization, no allocation and no warnings (those need the amaxes on the
// host: fp4sim.gemm reports them).
class CudaGemm {
 public:
  CudaGemm(const py::object& a, const py::object& b, const py::object& c, uintptr_t stream,
           const py::object& format_obj, const std::string& gemm_impl, const std::string& out_dtype,
           float alpha, float beta, int split_k, const py::object& out_given)
      : with_c_(!c.is_none()), stream_(stream) {
    std::tie(fmt_, cfg_) =
        gemm_options(format_obj, gemm_impl, out_dtype, alpha, beta, split_k, with_c_);
    dev_ = cuda_matrix(a, fn + "a").device_index();
    const TensorView av = operand(a, "a"), bv = operand(b, "b");
    if (bv.cols != av.cols)
      throw py::value_error(fn + "K differs: a is " + shape_str(av.rows, av.cols) + " and b is " +
                            shape_str(bv.rows, bv.cols) +
                            " (D = a * b^T needs a [M, K], b [N, K])");
    M_ = av.rows;
    N_ = bv.rows;
    K_ = av.cols;
    qc_.format = fmt_;
    qc_.rowwise.enabled = true;
    validate_quantize(av, qc_);
    validate_quantize(bv, qc_);
    Backend& be = py_args::module_backend("cuda", dev_, stream);
    ca_ = std::make_unique<model::QuantizedCopy>(be, M_, K_, fmt_, false);
    cb_ = std::make_unique<model::QuantizedCopy>(be, N_, K_, fmt_, false);
    dt_ = cfg_.out == GemmOut::BF16 ? DType::BF16 : DType::F32;
    d_ = result_slot(be, out_given, dt_, {M_, N_}, dev_, stream, fn + "out", "d");
    // every check of the GEMM itself (beta without c, split-K, shapes) once, here
    const TensorView cv = c_view(c);
    try {
      validate_gemm(ca_->view, cb_->view, with_c_ ? &cv : nullptr, cfg_,
                    view_of(d_.data, dt_, M_, N_, Device::Cuda, "D"));
    } catch (const std::invalid_argument& e) {
      throw py::value_error(fn + e.what());
    }
  }

  void call(const py::object& a, const py::object& b, const py::object& c, uintptr_t stream) const {
    if (stream != stream_)
      throw py::value_error(fn + "made on CUDA stream " + std::to_string(stream_) +
                            ", called on stream " + std::to_string(stream) +
                            ": make a Gemm for each stream");
    const TensorView av = operand(a, "a"), bv = operand(b, "b");
    if (av.rows != M_ || bv.rows != N_ || av.cols != K_ || bv.cols != K_)
      throw py::value_error(fn + "a is " + shape_str(av.rows, av.cols) + " and b " +
                            shape_str(bv.rows, bv.cols) + "; this GEMM was made for " +
                            shape_str(M_, K_) + " and " + shape_str(N_, K_));
    if (c.is_none() == with_c_)
      throw py::value_error(fn + (with_c_ ? "made with c: pass c" : "made without c: no c"));
    const TensorView cv = c_view(c);
    Backend& be = py_args::module_backend("cuda", dev_, stream);
    py::gil_scoped_release release;
    be.quantize(av, qc_, &ca_->view, nullptr);
    be.quantize(bv, qc_, &cb_->view, nullptr);
    be.gemm(ca_->view, cb_->view, with_c_ ? &cv : nullptr, cfg_,
            view_of(d_.data, dt_, M_, N_, Device::Cuda, "D"));
  }

  py::object output() const { return d_.object(); }

 private:
  // c [M, N] where the GEMM has one (else an absent view)
  TensorView c_view(const py::object& c) const {
    if (!with_c_) return TensorView{};
    const TensorView cv = operand(c, "c");
    if (cv.rows != M_ || cv.cols != N_)
      throw py::value_error(fn + "c: shape " + shape_str(cv.rows, cv.cols) + ", expected " +
                            shape_str(M_, N_));
    return cv;
  }
  TensorView operand(const py::object& x, const char* name) const {
    const DlTensor t = cuda_matrix(x, fn + name);
    if (t.device_index() != dev_)
      throw py::value_error(fn + name + ": not on cuda:" + std::to_string(dev_) + " (a's device)");
    return py_args::matrix_view(t, fn + name, {DType::F32}, name);
  }
  const std::string fn = "fp4sim.Gemm: ";
  bool with_c_;
  uintptr_t stream_;
  QFormat fmt_;
  GemmConfig cfg_;
  QuantizeConfig qc_;
  int64_t M_ = 0, N_ = 0, K_ = 0;
  int dev_ = 0;
  DType dt_ = DType::F32;
  std::unique_ptr<model::QuantizedCopy> ca_, cb_;
  Result d_;
};

// The C++ work behind fp4sim.quantize on a CUDA tensor (quantize, dequantize, the amax read),
// timed as validation/bench_python.py compares it: the median seconds of `repeats` runs. op
// "quantize_stream" is fp4sim.Quantizer's work instead: outputs made once, `repeats` quantize +
// dequantize enqueued back to back, one synchronization; the mean seconds a call.
double cpp_seconds_device(const std::string& op, const py::object& x, int repeats,
                          uintptr_t stream) {
  const DlTensor d = cuda_matrix(x, "_cpp_seconds_device: x");
  const TensorView in = py_args::matrix_view(d, "_cpp_seconds_device: x", {DType::F32}, "x");
  Backend& be = py_args::module_backend("cuda", d.device_index(), stream);
  std::vector<double> t;
  py::gil_scoped_release release;
  QuantizeConfig cfg;
  cfg.format = QFormat::NVFP4;
  cfg.rowwise.enabled = true;
  if (op == "quantize_stream") {
    model::QuantizedCopy q(be, in.rows, in.cols, QFormat::NVFP4, false);
    BackendBuffer deq(be, static_cast<size_t>(in.numel()) * 4);
    const TensorView dv = view_of(deq.get(), DType::F32, in.rows, in.cols, Device::Cuda, "deq");
    be.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < repeats; ++r) {
      be.quantize(in, cfg, &q.view, nullptr);
      be.dequantize(q.view, dv);
    }
    be.synchronize();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / repeats;
  }
  if (op == "gemm_stream") {  // fp4sim.Gemm's work: x times itself, copies and D made once
    model::QuantizedCopy q(be, in.rows, in.cols, QFormat::NVFP4, false),
        q2(be, in.rows, in.cols, QFormat::NVFP4, false);
    BackendBuffer dd(be, static_cast<size_t>(in.rows * in.rows) * 4);
    const TensorView dv = view_of(dd.get(), DType::F32, in.rows, in.rows, Device::Cuda, "D");
    be.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < repeats; ++r) {
      be.quantize(in, cfg, &q.view, nullptr);
      be.quantize(in, cfg, &q2.view, nullptr);
      be.gemm(q.view, q2.view, nullptr, GemmConfig{}, dv);
    }
    be.synchronize();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / repeats;
  }
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    model::QuantizedCopy q(be, in.rows, in.cols, QFormat::NVFP4, false);
    be.quantize(in, cfg, &q.view, nullptr);
    float a = 0;
    if (op == "quantize") {
      BackendBuffer deq(be, static_cast<size_t>(in.numel()) * 4);
      be.dequantize(q.view, view_of(deq.get(), DType::F32, in.rows, in.cols, Device::Cuda, "deq"));
      be.download(&a, q.view.amax, 4);
    } else {  // gemm: x times itself, both operands quantized
      model::QuantizedCopy q2(be, in.rows, in.cols, QFormat::NVFP4, false);
      BackendBuffer dd(be, static_cast<size_t>(in.rows * in.rows) * 4);
      be.quantize(in, cfg, &q2.view, nullptr);
      be.download(&a, q.view.amax, 4);
      be.download(&a, q2.view.amax, 4);
      be.gemm(q.view, q2.view, nullptr, GemmConfig{},
              view_of(dd.get(), DType::F32, in.rows, in.rows, Device::Cuda, "D"));
    }
    be.synchronize();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

py::dict info() {
  py::dict d;
  d["version"] = FP4SIM_VERSION;
  d["contract_version"] = kContractVersion;
  py::list backends;
  backends.append("emu");
  if (cuda_backend_built()) backends.append("cuda");
  d["backends"] = backends;
  d["default_backend"] = default_backend_name();
  d["cuda"] = cuda_backend_unavailable_reason().empty() ? std::string("available")
                                                        : cuda_backend_unavailable_reason();
  return d;
}

}  // namespace
}  // namespace fp4sim

PYBIND11_MODULE(_fp4sim, m) {
  m.doc() = "fp4sim: bit-exact NVFP4 / MXFP4 / FP8 quantization (the CLI's code)";
  // (pybind11 raises std::invalid_argument as ValueError, std::runtime_error as RuntimeError)
  m.def("quantize", &fp4sim::quantize, py::arg("x"), py::kw_only(), py::arg("format") = "nvfp4",
        py::arg("block_2d") = false, py::arg("columnwise") = false, py::arg("rht") = false,
        py::arg("sr") = false, py::arg("seed") = 0, py::arg("stream") = 0,
        py::arg("four_over_six") = false, py::arg("error") = "mae", py::arg("mx_rule") = py::none(),
        py::arg("backend") = py::none(),
        "Quantize a 2-D float32 (or bfloat16-as-uint16) array as `fp4sim quantize` does; returns "
        "a dict of codes, scales, amax, dequant (numpy arrays) and meta (the CLI's meta.json)");
  m.def("dequantize", &fp4sim::dequantize, py::arg("codes"), py::arg("scales"), py::arg("amax"),
        py::kw_only(), py::arg("format") = "nvfp4", py::arg("four_over_six") = false,
        py::arg("backend") = py::none(),
        "Dequantize a copy's codes, scales and amax (quantize's layout) to float32, as "
        "`fp4sim quantize` writes its dequant file");
  m.def("convert", &fp4sim::convert, py::arg("x"), py::kw_only(), py::arg("format"),
        py::arg("decode") = false,
        "fp4sim convert: float32 -> codes (e2m1, e4m3, e5m2, bf16, ue8m0_rz, ue8m0_rp), or with "
        "decode=True codes -> float32 (e2m1, e4m3, e5m2, bf16, ue8m0)");
  m.def("gemm", &fp4sim::gemm, py::arg("a"), py::arg("b"), py::kw_only(), py::arg("c") = py::none(),
        py::arg("format") = py::none(), py::arg("gemm") = "exact", py::arg("out_dtype") = "fp32",
        py::arg("alpha") = 1.0f, py::arg("beta") = 0.0f, py::arg("split_k") = 1,
        py::arg("backend") = py::none(),
        "fp4sim gemm on float32 arrays: D = alpha * a * b^T (+ beta * c), a and b quantized RN "
        "row-wise as the CLI does; returns d (float32, or uint16 BF16 bits), warnings, backend");
  m.def("mma", &fp4sim::mma, py::arg("a"), py::arg("b"), py::arg("sfa"), py::arg("sfb"),
        py::kw_only(), py::arg("scale") = "ue8m0-16", py::arg("c") = 0.0,
        "One block-scaled FP4 MMA dot product (GST-FDPA, K = 64) as `fp4sim mma`: a, b 64 "
        "float32 E2M1 values, sfa, sfb the scale bytes; returns d, its bits and the trace");
  m.def("_cpp_seconds", &fp4sim::cpp_seconds, py::arg("op"), py::arg("x"), py::arg("repeats"),
        py::arg("backend") = py::none(),
        "The median seconds of the C++ work behind quantize or gemm (validation/bench_python.py)");
  fp4sim::py_args::register_device_array(m);
  fp4sim::py_args::register_linear(m);
  m.def("_quantize_device", &fp4sim::quantize_device, py::arg("x"), py::arg("stream"),
        py::kw_only(), py::arg("format") = "nvfp4", py::arg("block_2d") = false,
        py::arg("columnwise") = false, py::arg("rht") = false, py::arg("sr") = false,
        py::arg("seed") = 0, py::arg("sr_stream") = 0, py::arg("four_over_six") = false,
        py::arg("error") = "mae", py::arg("mx_rule") = py::none(), py::arg("outs") = py::none(),
        "quantize on a CUDA DLPack tensor, on `stream`; the results are DeviceArrays, or written "
        "into outs = (codes, scales, amax, dequant) (then None in the dict)");
  py::class_<fp4sim::CudaQuantizer>(m, "_CudaQuantizer")
      .def(py::init<const py::object&, uintptr_t, const std::string&, bool, bool, bool, bool,
                    uint64_t, uint64_t, bool, const std::string&, const py::object&,
                    const py::object&>(),
           py::arg("like"), py::arg("stream"), py::kw_only(), py::arg("format") = "nvfp4",
           py::arg("block_2d") = false, py::arg("columnwise") = false, py::arg("rht") = false,
           py::arg("sr") = false, py::arg("seed") = 0, py::arg("sr_stream") = 0,
           py::arg("four_over_six") = false, py::arg("error") = "mae",
           py::arg("mx_rule") = py::none(), py::arg("outs") = py::none())
      .def("__call__", &fp4sim::CudaQuantizer::call, py::arg("x"), py::arg("stream"),
           py::arg("sr_stream") = py::none())
      .def("outputs", &fp4sim::CudaQuantizer::outputs,
           "(codes, scales, amax, dequant): DeviceArrays, None where outs gave the tensor");
  py::class_<fp4sim::CudaGemm>(m, "_CudaGemm")
      .def(py::init<const py::object&, const py::object&, const py::object&, uintptr_t,
                    const py::object&, const std::string&, const std::string&, float, float, int,
                    const py::object&>(),
           py::arg("a"), py::arg("b"), py::arg("c"), py::arg("stream"), py::kw_only(),
           py::arg("format") = py::none(), py::arg("gemm") = "exact", py::arg("out_dtype") = "fp32",
           py::arg("alpha") = 1.0f, py::arg("beta") = 0.0f, py::arg("split_k") = 1,
           py::arg("out") = py::none())
      .def("__call__", &fp4sim::CudaGemm::call, py::arg("a"), py::arg("b"), py::arg("c"),
           py::arg("stream"))
      .def("output", &fp4sim::CudaGemm::output, "D: a DeviceArray, None where out gave the tensor");
  m.def("_dequantize_device", &fp4sim::dequantize_device, py::arg("codes"), py::arg("scales"),
        py::arg("amax"), py::arg("stream"), py::kw_only(), py::arg("format") = "nvfp4",
        py::arg("four_over_six") = false, py::arg("out") = py::none(),
        "dequantize on CUDA DLPack tensors (into out where given, then None is returned)");
  m.def("_gemm_device", &fp4sim::gemm_device, py::arg("a"), py::arg("b"), py::arg("c"),
        py::arg("stream"), py::kw_only(), py::arg("format") = py::none(), py::arg("gemm") = "exact",
        py::arg("out_dtype") = "fp32", py::arg("alpha") = 1.0f, py::arg("beta") = 0.0f,
        py::arg("split_k") = 1, py::arg("out") = py::none(),
        "gemm on CUDA DLPack tensors (D into out where given, then d is None)");
  m.def("_cpp_seconds_device", &fp4sim::cpp_seconds_device, py::arg("op"), py::arg("x"),
        py::arg("repeats"), py::arg("stream") = 0,
        "The median seconds of the C++ work behind quantize or gemm on a CUDA tensor");
  m.def("info", &fp4sim::info, "Version, contract_version and the backends of this build");
  m.attr("contract_version") = fp4sim::kContractVersion;
}
