// fp4sim quantize: golden vectors for kernel authors, and a one-screen account of what the
// quantizer did. fp4sim make-tensor: sample inputs.
#include <fmt/core.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <stdexcept>

#include "emu/contract.hpp"
#include "emu/cpu_backend.hpp"
#include "tools/backends.hpp"
#include "tools/commands.hpp"
#include "tools/npy.hpp"
#include "tools/quantize_options.hpp"

namespace fp4sim::cli {
namespace {

struct QuantizeArgs : QuantizeOptions {
  std::string input, prefix, backend;
};

// Input as a 2-D float32 or bf16 (uint16) tensor.
struct InputTensor {
  io::NpyArray npy;
  TensorView view;
};

InputTensor load_input(const std::string& path) {
  InputTensor t;
  t.npy = io::read_npy(path);
  const auto& a = t.npy;
  if (a.shape.size() != 2)
    throw std::runtime_error(path + ": expected a 2-D array (rows x cols), got shape " +
                             io::shape_string(a.shape));
  if (a.dtype == "<f4") {
    t.view.dtype = DType::F32;
  } else if (a.dtype == "<u2") {
    t.view.dtype = DType::BF16;  // bfloat16 bit patterns stored as uint16
  } else {
    throw std::runtime_error(path + ": dtype '" + a.dtype +
                             "' not supported (expected float32 '<f4', or bfloat16 bit patterns "
                             "stored as uint16 '<u2')");
  }
  t.view.data = const_cast<uint8_t*>(a.bytes.data());
  t.view.rows = static_cast<int64_t>(a.shape[0]);
  t.view.cols = static_cast<int64_t>(a.shape[1]);
  t.view.name = "input";
  return t;
}

// What the quantizer did, against the written tensor's high-precision values.
struct Stats {
  double sum_sq_err = 0, sum_sq_ref = 0, max_abs_err = 0;
  int64_t saturated = 0, flushed = 0, nonzero = 0, nan = 0, inf = 0;
  int64_t nonfinite_out = 0;  // finite inputs whose decoded value is Inf or NaN
  int64_t finite_err = 0;     // elements whose error is finite (the error figures' population)
  int64_t underflow_blocks = 0, blocks = 0;
  std::map<int, int64_t> scale_exponents;  // floor(log2 scale) histogram
};

Stats compute_stats(const float* ref, const QuantizedHost& q, const std::vector<float>& deq) {
  Stats st;
  const int64_t block = q.block_size();
  const int64_t bpr = q.cols / block;
  const Nvfp4Global g = nvfp4_global(q.amax, q.four_over_six);
  const bool fp8 = q.format == QFormat::FP8, mx = q.format == QFormat::MXFP4;
  const float elem_max = fp8 ? kE4M3Max : kE2M1Max;
  for (int64_t r = 0; r < q.rows; ++r) {
    for (int64_t b = 0; b < bpr; ++b) {
      const uint8_t s = fp8 ? 0 : q.scales[r * bpr + b];
      float fp8_scale = 0.0f;
      if (fp8) std::memcpy(&fp8_scale, &q.scales[4 * static_cast<size_t>(r * bpr + b)], 4);
      float fp8_amax = 0.0f;  // FP8: the block's own enc, as the quantizer computed it
      if (fp8)
        for (int64_t i = 0; i < block; ++i)
          fp8_amax = fmax_nan_ignored(fp8_amax, f32_abs(ref[r * q.cols + b * block + i]));
      const float enc = fp8  ? fp8_block_encode_scale(fp8_amax)
                        : mx ? (s == kUE8M0NaN ? 0.0f : mxfp4_encode_factor(s))
                             : nvfp4_block_encode_scale(s, g.s_dec);
      float amax_b = 0.0f;
      for (int64_t i = 0; i < block; ++i) {
        const int64_t e = r * q.cols + b * block + i;
        const float x = ref[e];
        if (std::isnan(x)) {
          ++st.nan;
          continue;
        }
        amax_b = std::fmax(amax_b, std::fabs(x));
        if (std::isinf(x))
          ++st.inf;
        else if (!std::isfinite(deq[e]))
          ++st.nonfinite_out;
        if (x != 0.0f) ++st.nonzero;
        const uint8_t code = fp8 ? q.codes[e] : (q.codes[e / 2] >> (4 * (e & 1))) & 0xF;
        if (x != 0.0f && (code & (fp8 ? 0x7F : 7)) == 0) ++st.flushed;
        if (std::fabs(fmul_rn(x, enc)) > elem_max) ++st.saturated;
        const double err = static_cast<double>(deq[e]) - x;
        if (std::isfinite(err)) {  // numerator and denominator over the same elements
          ++st.finite_err;
          st.sum_sq_err += err * err;
          st.max_abs_err = std::max(st.max_abs_err, std::fabs(err));
          st.sum_sq_ref += static_cast<double>(x) * x;
        }
      }
      ++st.blocks;
      const float sv = fp8 ? fp8_scale : mx ? ue8m0_to_f32(s) : e4m3_to_f32(s);
      if (amax_b > 0.0f && (mx || fp8 ? false : sv == 0.0f)) ++st.underflow_blocks;
      if (sv > 0.0f && std::isfinite(sv)) ++st.scale_exponents[std::ilogb(sv)];
    }
  }
  return st;
}

void run_quantize(const QuantizeArgs& a) {
  const QuantizeConfig cfg = quantize_config(a);

  io::check_output_prefix(a.prefix, "OUT_PREFIX");
  std::vector<std::string> outputs;
  for (const char* ext : {".codes.npy", ".scales.npy", ".amax.npy", ".dequant.npy", ".meta.json"})
    outputs.push_back(a.prefix + ext);
  io::check_outputs(outputs, {a.input});
  InputTensor in = load_input(a.input);
  validate_quantize(in.view, cfg);  // all input errors before any work or output
  const std::string backend_name = a.backend.empty() ? default_backend_name() : a.backend;
  auto backend = make_backend(backend_name);

  const auto t0 = std::chrono::steady_clock::now();
  QuantizeResult res = quantize_to_host(*backend, in.view, cfg);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  QuantizedHost& q = a.columnwise ? res.columnwise : res.rowwise;
  const std::vector<float> deq = dequantize_to_host(*backend, q);

  // the written tensor's high-precision values (transposed, and RHT'd, for the column-wise copy)
  std::vector<float> x(static_cast<size_t>(in.view.numel()));
  for (int64_t i = 0; i < in.view.numel(); ++i)
    x[i] = in.view.dtype == DType::F32
               ? reinterpret_cast<const float*>(in.npy.bytes.data())[i]
               : bf16_to_f32(reinterpret_cast<const uint16_t*>(in.npy.bytes.data())[i]);
  std::vector<float> ref(x.size());
  if (!a.columnwise) {
    ref = x;
  } else if (a.rht) {
    emu::rht_columnwise(x.data(), in.view.rows, in.view.cols, ref.data());
  } else {
    for (int64_t r = 0; r < in.view.rows; ++r)
      for (int64_t c = 0; c < in.view.cols; ++c)
        ref[c * in.view.rows + r] = x[r * in.view.cols + c];
  }
  const Stats st = compute_stats(ref.data(), q, deq);

  // outputs: staged, then renamed together
  io::AtomicOutputs out;
  const auto R = static_cast<size_t>(q.rows), C = static_cast<size_t>(q.cols);
  const size_t block = static_cast<size_t>(q.block_size());
  const bool fp8 = cfg.format == QFormat::FP8;
  io::write_npy_u8(out.stage(a.prefix + ".codes.npy"), q.codes.data(), {R, fp8 ? C : C / 2});
  if (fp8)
    io::write_npy_f32(out.stage(a.prefix + ".scales.npy"),
                      reinterpret_cast<const float*>(q.scales.data()), {R, C / block});
  else
    io::write_npy_u8(out.stage(a.prefix + ".scales.npy"), q.scales.data(), {R, C / block});
  io::write_npy_f32(out.stage(a.prefix + ".amax.npy"), &q.amax, {1});
  io::write_npy_f32(out.stage(a.prefix + ".dequant.npy"), deq.data(), {R, C});
  nlohmann::json meta = quantize_meta(a, in.view.dtype, in.view.rows, in.view.cols, q,
                                      backend->name(), "fp4sim quantize");
  meta["input"] = a.input;
  io::write_text(out.stage(a.prefix + ".meta.json"), meta.dump(2) + "\n");
  out.commit();

  // one-screen summary
  const Nvfp4Global g = nvfp4_global(q.amax, q.four_over_six);
  fmt::print("fp4sim quantize  {} -> {}.*   (backend {}, {:.1f} ms)\n", a.input, a.prefix,
             backend->name(), ms);
  fmt::print("  input        {} x {} {}\n", in.view.rows, in.view.cols, dtype_name(in.view.dtype));
  fmt::print("  copy         {} {} {} {}{}{}   written {} x {}\n", a.format,
             quantize_block_name(cfg.format, a.block_2d), a.columnwise ? "column-wise" : "row-wise",
             a.sr ? "SR" : "RN", a.rht ? " +RHT" : "", a.fos ? " +4/6(" + a.error + ")" : "",
             q.rows, q.cols);
  if (cfg.format == QFormat::NVFP4)
    fmt::print("  amax         {:.6g}   S_enc {:.6g}   S_dec {:.6g}\n", q.amax, g.s_enc, g.s_dec);
  else
    fmt::print("  amax         {:.6g}   ({}: no global scale)\n", q.amax, fp8 ? "FP8" : "MXFP4");
  fmt::print("  blocks       {}   underflowed (amax_b > 0, scale 0): {}\n", st.blocks,
             st.underflow_blocks);
  std::string hist;
  for (const auto& [e, n] : st.scale_exponents) hist += fmt::format(" 2^{}:{}", e, n);
  fmt::print("  scale exps  {}\n", hist.empty() ? " (all zero)" : hist);
  const double n = static_cast<double>(in.view.numel());
  fmt::print("  saturated    {} ({:.3f}%)  |x*enc_b| > {} before rounding\n", st.saturated,
             100.0 * st.saturated / n, fp8 ? 448 : 6);
  fmt::print("  flushed      {} ({:.3f}% of nonzeros)  nonzero -> 0\n", st.flushed,
             st.nonzero ? 100.0 * st.flushed / st.nonzero : 0.0);
  if (st.nan) fmt::print("  NaN inputs   {} (encoded as {})\n", st.nan, fp8 ? "NaN (0x7F)" : "+6");
  if (st.inf) fmt::print("  Inf inputs   {}\n", st.inf);
  if (st.nonfinite_out)
    fmt::print(
        "  WARNING      {} finite inputs decode to Inf or NaN{}; the error figures below leave "
        "them out\n",
        st.nonfinite_out, std::isfinite(q.amax) ? "" : " (the tensor's amax is not finite)");
  if (st.finite_err == 0 && (st.nonfinite_out || st.inf))
    fmt::print("  error        n/a (no element decodes to a finite value)\n");
  else
    fmt::print("  error        rel ||xq - x||/||x|| = {:.4g}   rmse {:.4g}   max |err| {:.4g}{}\n",
               st.sum_sq_ref > 0 ? std::sqrt(st.sum_sq_err / st.sum_sq_ref) : 0.0,
               std::sqrt(st.sum_sq_err / static_cast<double>(st.finite_err ? st.finite_err : 1)),
               st.max_abs_err, st.nonfinite_out || st.inf ? "   (finite values only)" : "");
  fmt::print(
      "  wrote        {0}.codes.npy {0}.scales.npy {0}.amax.npy {0}.dequant.npy "
      "{0}.meta.json\n",
      a.prefix);
}

struct MakeTensorArgs {
  std::string path, kind = "gaussian", dtype = "f32";
  int64_t rows = 256, cols = 1024;
  uint64_t seed = 1;
};

void run_make_tensor(const MakeTensorArgs& a) {
  if (a.rows <= 0 || a.cols <= 0)
    throw std::invalid_argument("--rows/--cols: must be positive, got " +
                                shape_str(a.rows, a.cols));
  io::check_outputs({a.path}, {});
  // the sizes before any allocation: rows x cols elements of 4 bytes (the float32 values drawn
  // first) must fit 64 bits, and the allocation failing is an error that says what it was for
  int64_t n = 0, bytes = 0;
  if (__builtin_mul_overflow(a.rows, a.cols, &n) || __builtin_mul_overflow(n, int64_t{4}, &bytes))
    throw std::invalid_argument("--rows/--cols: " + shape_str(a.rows, a.cols) +
                                " is too large (its byte count overflows 64 bits)");
  std::vector<float> v;
  try {
    v.resize(static_cast<size_t>(n));
  } catch (const std::exception&) {  // (bad_alloc, or length_error past max_size)
    throw std::runtime_error("make-tensor: cannot allocate " + std::to_string(bytes) +
                             " bytes for the " + shape_str(a.rows, a.cols) + " tensor");
  }
  std::mt19937_64 rng(a.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& x : v) {
    x = normal(rng);
    if (a.kind == "heavy-tailed") x = x * std::exp(1.5f * normal(rng));  // log-normal spread
  }
  if (a.kind == "outliers")
    for (size_t i = 0; i < v.size(); i += 997) v[i] *= 100.0f;  // sparse large outliers
  io::AtomicOutputs out;
  const std::vector<size_t> shape = {static_cast<size_t>(a.rows), static_cast<size_t>(a.cols)};
  if (a.dtype == "bf16") {
    std::vector<uint16_t> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) h[i] = bf16_rne(v[i]);
    io::write_npy_u16(out.stage(a.path), h.data(), shape);
  } else {
    io::write_npy_f32(out.stage(a.path), v.data(), shape);
  }
  out.commit();
  fmt::print("wrote {} ({} x {} {}, {}, seed {})\n", a.path, a.rows, a.cols,
             a.dtype == "bf16" ? "bfloat16 as uint16" : "float32", a.kind, a.seed);
}

}  // namespace

void register_quantize(CLI::App& app) {
  auto args = std::make_shared<QuantizeArgs>();
  auto* cmd = app.add_subcommand(
      "quantize",
      "Quantize a 2-D float32 (or bf16-as-uint16) .npy to NVFP4, MXFP4 or FP8 and write codes, "
      "scales, amax, dequantized values and a meta.json");
  cmd->add_option("input", args->input, "Input .npy, shape [rows, cols]")->required();
  cmd->add_option("out_prefix", args->prefix, "Output prefix (writes PREFIX.codes.npy, ...)")
      ->required();
  cmd->add_option("--format", args->format,
                  "nvfp4 | mxfp4 | fp8 (E4M3, FP32 scale per 1x128, or 128x128 with --2d)")
      ->check(CLI::IsMember({"nvfp4", "mxfp4", "fp8"}));
  cmd->add_flag("--2d", args->block_2d, "NVFP4 16x16 tiles (weights) instead of 1x16");
  cmd->add_flag("--columnwise", args->columnwise,
                "Write the column-wise copy (the transpose, cols x rows)");
  cmd->add_flag("--rht", args->rht, "16-point random Hadamard transform (column-wise copy only)");
  auto* sr = cmd->add_flag("--sr", args->sr, "Stochastic rounding (Philox4x32-10)");
  // unsigned 64-bit: a leading '-' would wrap around silently
  const CLI::Validator no_sign(
      [](const std::string& v) -> std::string {
        return !v.empty() && v[0] == '-' ? "must be a non-negative integer, got '" + v + "'" : "";
      },
      "UINT64");
  cmd->add_option("--seed", args->seed, "SR seed (Philox key)")->needs(sr)->check(no_sign);
  cmd->add_option("--stream", args->stream, "SR stream (Philox counter words 2-3)")
      ->needs(sr)
      ->check(no_sign);
  auto* fos =
      cmd->add_flag("--four-over-six", args->fos,
                    "Four Over Six: per block, keep the 4-max scale when its error is lower");
  cmd->add_option("--error", args->error, "Four Over Six error metric: mae | mse")
      ->check(CLI::IsMember({"mae", "mse"}))
      ->needs(fos);
  auto* mx_rule =
      cmd->add_option("--mx-rule", args->mx_rule, "MXFP4 scale rule: floor (OCP) | ceil")
          ->check(CLI::IsMember({"floor", "ceil"}));
  cmd->add_option("--backend", args->backend, "emu | cuda (default: cuda when a GPU is present)")
      ->check(CLI::IsMember({"emu", "cuda"}));
  cmd->callback([args, mx_rule]() {
    args->mx_rule_given = mx_rule->count() > 0;
    run_quantize(*args);
  });
}

void register_make_tensor(CLI::App& app) {
  auto args = std::make_shared<MakeTensorArgs>();
  auto* cmd = app.add_subcommand("make-tensor", "Write a seeded random 2-D .npy to quantize");
  cmd->add_option("output", args->path, "Output .npy")->required();
  cmd->add_option("--rows", args->rows, "Rows");
  cmd->add_option("--cols", args->cols, "Columns");
  cmd->add_option("--kind", args->kind, "gaussian | heavy-tailed | outliers")
      ->check(CLI::IsMember({"gaussian", "heavy-tailed", "outliers"}));
  cmd->add_option("--dtype", args->dtype, "f32 | bf16 (stored as uint16)")
      ->check(CLI::IsMember({"f32", "bf16"}));
  cmd->add_option("--seed", args->seed, "Seed");
  cmd->callback([args]() { run_make_tensor(*args); });
}

}  // namespace fp4sim::cli
