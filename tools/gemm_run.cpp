#include "tools/gemm_run.hpp"

#include <fmt/core.h>

#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "emu/gemm.hpp"
#include "tools/backends.hpp"

namespace fp4sim::cli {

namespace {

// NaN and Inf among a float operand's values: quantized as `fp4sim quantize` does (NVFP4 and
// MXFP4 encode NaN as +6, FP8 keeps it; an Inf makes the amax Inf), so D no longer says what the
// inputs do, and the command says so.
struct NonFinite {
  int64_t nan = 0, inf = 0;
};
NonFinite count_nonfinite(const std::vector<float>& x) {
  NonFinite n;
  for (float v : x) {
    n.nan += std::isnan(v);
    n.inf += std::isinf(v);
  }
  return n;
}

}  // namespace

std::vector<uint32_t> run_gemm_on(Backend& be, QuantizedHost& a, QuantizedHost& b,
                                  std::vector<float>* c, const GemmConfig& cfg, double* ms) {
  QuantizedBuffers da = QuantizedBuffers::uploaded(be, a), db = QuantizedBuffers::uploaded(be, b);
  const int64_t M = a.rows, N = b.rows;
  BackendBuffer cbuf(be, c ? c->size() * 4 : 0);
  TensorView cv;
  if (c) {
    be.upload(cbuf.get(), c->data(), c->size() * 4);
    cv.data = cbuf.get();
    cv.rows = M;
    cv.cols = N;
    cv.device = be.device();
  }
  const size_t esize = cfg.out == GemmOut::BF16 ? 2 : 4;
  BackendBuffer d(be, static_cast<size_t>(M * N) * esize);
  TensorView dv;
  dv.data = d.get();
  dv.dtype = cfg.out == GemmOut::BF16 ? DType::BF16 : DType::F32;
  dv.rows = M;
  dv.cols = N;
  dv.device = be.device();
  const auto t0 = std::chrono::steady_clock::now();
  be.gemm(da.view, db.view, c ? &cv : nullptr, cfg, dv);
  be.synchronize();
  *ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::vector<uint32_t> bits(static_cast<size_t>(M * N));
  if (esize == 4) {
    be.download(bits.data(), d.get(), bits.size() * 4);
  } else {
    std::vector<uint16_t> h(bits.size());
    be.download(h.data(), d.get(), h.size() * 2);
    for (size_t i = 0; i < h.size(); ++i) bits[i] = h[i];
  }
  return bits;
}

QuantizedHost quantize_gemm_operand(std::vector<float>& x, int64_t rows, int64_t cols, QFormat fmt,
                                    const char* name, const std::string& source,
                                    std::vector<std::string>* warnings) {
  const NonFinite n = count_nonfinite(x);
  if (n.nan || n.inf)
    warnings->push_back(fmt::format(
        "{} ({}) holds {} NaN and {} Inf of {} values, quantized as `fp4sim quantize` does "
        "(NaN to +6 x the block scale in NVFP4 and MXFP4; an Inf makes the amax Inf): D does "
        "not follow from them",
        name, source, n.nan, n.inf, x.size()));
  auto emu = make_backend("emu");
  const TensorView t = host_view(x.data(), rows, cols, name);
  QuantizeConfig c;
  c.format = fmt;
  c.rowwise.enabled = true;
  return quantize_to_host(*emu, t, c).rowwise;
}

void check_gemm(const QuantizedView& a, float amax_a, const QuantizedView& b, float amax_b,
                bool has_c, const GemmConfig& cfg, std::vector<std::string>* warnings) {
  {  // all shape errors before any work or output
    TensorView dv;
    dv.rows = a.rows;
    dv.cols = b.rows;
    dv.dtype = cfg.out == GemmOut::BF16 ? DType::BF16 : DType::F32;
    TensorView cv;
    cv.rows = a.rows;
    cv.cols = b.rows;
    validate_gemm(a, b, has_c ? &cv : nullptr, cfg, dv);
    int64_t mn = 0, d_bytes = 0;  // D's 4-byte elements, before anything is allocated for them
    if (__builtin_mul_overflow(a.rows, b.rows, &mn) ||
        __builtin_mul_overflow(mn, int64_t{4}, &d_bytes))
      throw std::invalid_argument("gemm: D " + shape_str(a.rows, b.rows) +
                                  " is too large (its byte count overflows 64 bits)");
  }
  // NVFP4's epilogue scale in the contract's (Transformer Engine's) order, against the same
  // factor in double: the order overflows when amax_A * amax_B passes FLT_MAX although the factor
  // is finite (docs/numerics.md §8). The bits stay the contract's; the command says so.
  if (a.format == QFormat::NVFP4) {
    const float alpha_eff =
        gemm_epilogue_alpha(cfg.alpha, a.format, amax_a, a.four_over_six, amax_b, b.four_over_six);
    const double ma = a.four_over_six ? 256.0 : kE4M3Max, mb = b.four_over_six ? 256.0 : kE4M3Max;
    const double factor = static_cast<double>(cfg.alpha) * amax_a * amax_b / (36.0 * ma * mb);
    if (std::isfinite(factor) && std::fabs(factor) <= FLT_MAX && !std::isfinite(alpha_eff))
      warnings->push_back(fmt::format(
          "the epilogue scale ((alpha * amax_A) * amax_B) * k = (({:g} * {:g}) * {:g}) * k "
          "overflows FP32 to {} although the factor is {:.6g}: D is Inf or NaN wherever the "
          "accumulator is not 0. The contract keeps Transformer Engine's order "
          "(docs/numerics.md §8); scale the inputs (or alpha) down so that alpha * amax_A * "
          "amax_B stays below {:g}",
          cfg.alpha, amax_a, amax_b, alpha_eff, factor, FLT_MAX));
    // (an underflow matters where D could be nonzero in FP32: |D| <= alpha amax_A amax_B K)
    const double d_bound =
        std::fabs(static_cast<double>(cfg.alpha) * amax_a * amax_b) * static_cast<double>(a.cols);
    if (alpha_eff == 0.0f && std::isfinite(d_bound) && d_bound >= FLT_TRUE_MIN)
      warnings->push_back(fmt::format(
          "the epilogue scale ((alpha * amax_A) * amax_B) * k = (({:g} * {:g}) * {:g}) * k "
          "underflows FP32 to 0 (the factor is {:.6g}): D is 0 where its values could reach "
          "{:.6g}",
          cfg.alpha, amax_a, amax_b, factor, d_bound));
  }
}

GemmRun run_gemm_checked(QuantizedHost& qa, QuantizedHost& qb, std::vector<float>* c,
                         const std::string& c_source, const GemmConfig& cfg,
                         const std::string& backend_name) {
  GemmRun run;
  std::vector<std::string>& warnings = run.warnings;
  if (c) {
    if (static_cast<int64_t>(c->size()) != qa.rows * qb.rows)
      throw std::invalid_argument(c_source + ": C must be " + shape_str(qa.rows, qb.rows) + " (" +
                                  std::to_string(qa.rows * qb.rows) + " values), got " +
                                  std::to_string(c->size()));
    const NonFinite nc = count_nonfinite(*c);
    if (nc.nan || nc.inf)
      warnings.push_back(
          fmt::format("C ({}) holds {} NaN and {} Inf of {} values; they pass to D "
                      "through beta * C",
                      c_source, nc.nan, nc.inf, c->size()));
  }
  check_gemm(qa.view(), qa.amax, qb.view(), qb.amax, c != nullptr, cfg, &warnings);
  const std::string bname = backend_name.empty() ? default_backend_name() : backend_name;
  if (cfg.impl == GemmImpl::CublasLt && bname != "cuda")
    throw std::invalid_argument("--gemm cublaslt needs --backend cuda (a GPU)");
  auto be = make_backend(bname);
  run.backend = be->name();
  run.bits = run_gemm_on(*be, qa, qb, c, cfg, &run.ms);
  if (cfg.impl == GemmImpl::CublasLt) {  // both ran: report the distance
    GemmConfig ex = cfg;
    ex.impl = GemmImpl::Exact;
    const std::vector<uint32_t> eb = run_gemm_on(*be, qa, qb, c, ex, &run.ms_exact);
    double worst = 0;
    for (size_t i = 0; i < run.bits.size(); ++i) {
      float x, y;
      const uint32_t bx = cfg.out == GemmOut::BF16 ? run.bits[i] << 16 : run.bits[i];
      const uint32_t by = cfg.out == GemmOut::BF16 ? eb[i] << 16 : eb[i];
      std::memcpy(&x, &bx, 4);
      std::memcpy(&y, &by, 4);
      if (std::isfinite(x) && std::isfinite(y))
        worst = std::max(worst, std::fabs(static_cast<double>(x) - y));
    }
    run.cublaslt_vs_exact = worst;
  }
  int64_t d_nonfinite = 0;
  for (uint32_t b : run.bits) {
    const uint32_t exp_mask = cfg.out == GemmOut::BF16 ? 0x7F80u : 0x7F800000u;
    d_nonfinite += (b & exp_mask) == exp_mask;
  }
  if (d_nonfinite)
    warnings.push_back(
        fmt::format("D holds {} Inf or NaN of {} values", d_nonfinite, run.bits.size()));
  return run;
}

}  // namespace fp4sim::cli
