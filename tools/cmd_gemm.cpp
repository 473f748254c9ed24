// fp4sim gemm | mma | crosscheck gemm: the exact block-scaled FP4 GEMM and one tensor-core MMA.
#include <fmt/core.h>

#include <array>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <stdexcept>
#include <tuple>

#include "emu/contract.hpp"
#include "emu/gemm.hpp"
#include "tools/backends.hpp"
#include "tools/cli_parse.hpp"
#include "tools/commands.hpp"
#include "tools/gemm_run.hpp"
#include "tools/npy.hpp"

namespace fp4sim::cli {
namespace {

// ---- operands
// --------------------------------------------------------------------------------------

std::vector<float> load_f32_matrix(const std::string& path, const char* what, int64_t* rows,
                                   int64_t* cols) {
  const io::NpyArray a = io::read_npy(path);
  if (a.dtype != "<f4" || a.shape.size() != 2)
    throw std::runtime_error(path + ": " + what + " must be a 2-D float32 array, got dtype '" +
                             a.dtype + "' shape " + io::shape_string(a.shape));
  *rows = static_cast<int64_t>(a.shape[0]);
  *cols = static_cast<int64_t>(a.shape[1]);
  std::vector<float> v(a.bytes.size() / 4);
  std::memcpy(v.data(), a.bytes.data(), a.bytes.size());
  return v;
}

// The files `fp4sim quantize` writes: PREFIX.{codes,scales,amax}.npy and PREFIX.meta.json.
QuantizedHost load_quantized(const std::string& prefix, const char* name, bool* rht) {
  io::require_readable_file(prefix + ".meta.json", std::string("operand ") + name +
                                                       "'s meta.json (written by fp4sim quantize)");
  std::ifstream mf(prefix + ".meta.json");
  nlohmann::json meta;
  try {
    mf >> meta;
  } catch (const std::exception& e) {
    throw std::runtime_error(prefix + ".meta.json: not valid JSON (" + e.what() + ")");
  }
  if (!meta.contains("contract_version") || !meta["contract_version"].is_number_integer())
    throw std::runtime_error(prefix +
                             ".meta.json: no contract_version (not written by fp4sim quantize?)");
  if (meta.value("contract_version", -1) != kContractVersion)
    throw std::runtime_error(prefix + ".meta.json: contract_version " +
                             std::to_string(meta.value("contract_version", -1)) +
                             ", this build is " + std::to_string(kContractVersion));
  QuantizedHost q;
  const std::string fmt_name = meta.value("format", "nvfp4");
  if (fmt_name != "nvfp4" && fmt_name != "mxfp4" && fmt_name != "fp8")
    throw std::runtime_error(prefix + ".meta.json: unknown format '" + fmt_name + "'");
  q.format =
      fmt_name == "fp8" ? QFormat::FP8 : (fmt_name == "mxfp4" ? QFormat::MXFP4 : QFormat::NVFP4);
  const bool fp8 = q.format == QFormat::FP8;
  q.four_over_six = meta.value("four_over_six", false);
  const io::NpyArray codes = io::read_npy(prefix + ".codes.npy");
  const io::NpyArray scales = io::read_npy(prefix + ".scales.npy");
  const io::NpyArray amax = io::read_npy(prefix + ".amax.npy");
  if (codes.dtype != "|u1" || codes.shape.size() != 2)
    throw std::runtime_error(prefix + ".codes.npy: expected uint8 [rows, " + (fp8 ? "K" : "K/2") +
                             "], got '" + codes.dtype + "' " + io::shape_string(codes.shape));
  q.rows = static_cast<int64_t>(codes.shape[0]);
  q.cols = static_cast<int64_t>(codes.shape[1]) * (fp8 ? 1 : 2);
  const int64_t block = q.block_size();
  if (scales.dtype != (fp8 ? "<f4" : "|u1") || scales.shape.size() != 2 ||
      static_cast<int64_t>(scales.shape[0]) != q.rows ||
      static_cast<int64_t>(scales.shape[1]) * block != q.cols)
    throw std::runtime_error(prefix + ".scales.npy: expected " + (fp8 ? "float32 " : "uint8 ") +
                             shape_str(q.rows, q.cols / block) + " for " + qformat_name(q.format) +
                             " codes of " + shape_str(q.rows, q.cols) + ", got '" + scales.dtype +
                             "' " + io::shape_string(scales.shape));
  if (amax.dtype != "<f4" || amax.bytes.size() != 4)
    throw std::runtime_error(prefix + ".amax.npy: expected float32 [1]");
  q.codes = codes.bytes;
  q.scales = scales.bytes;
  std::memcpy(&q.amax, amax.bytes.data(), 4);
  // files of one run: the meta's amax is the amax file's, and where the dequantized copy is there,
  // it is what these codes, scales and amax decode to (scales from another run would not be)
  if (meta.contains("amax") && meta["amax"].is_number() &&
      static_cast<float>(meta["amax"].get<double>()) != q.amax)
    throw std::runtime_error(
        prefix + ".meta.json says amax " + fmt::format("{}", meta["amax"].get<double>()) + " but " +
        prefix + ".amax.npy holds " + fmt::format("{}", q.amax) + ": files of different runs?");
  std::error_code ec;
  if (std::filesystem::exists(prefix + ".dequant.npy", ec)) {  // (optional; read_npy says why not)
    const io::NpyArray dq = io::read_npy(prefix + ".dequant.npy");
    if (dq.dtype != "<f4" || dq.shape.size() != 2 || static_cast<int64_t>(dq.shape[0]) != q.rows ||
        static_cast<int64_t>(dq.shape[1]) != q.cols)
      throw std::runtime_error(prefix + ".dequant.npy: expected float32 " +
                               shape_str(q.rows, q.cols) + ", got '" + dq.dtype + "' " +
                               io::shape_string(dq.shape));
    auto emu = make_backend("emu");
    const std::vector<float> want = dequantize_to_host(*emu, q);
    for (size_t i = 0; i < want.size(); ++i) {
      uint32_t a, b;
      std::memcpy(&a, &want[i], 4);
      std::memcpy(&b, dq.bytes.data() + 4 * i, 4);
      const bool both_nan =
          std::isnan(want[i]) && (b & 0x7F800000u) == 0x7F800000u && (b & 0x7FFFFFu) != 0;
      if (a != b && !both_nan)
        throw std::runtime_error(
            prefix + ": codes, scales and amax do not decode to " + prefix + ".dequant.npy at (" +
            std::to_string(static_cast<int64_t>(i) / q.cols) + ", " +
            std::to_string(static_cast<int64_t>(i) % q.cols) + "): files of different runs?");
    }
  }
  *rht = meta.value("rht", false);
  return q;
}

struct GemmArgs {
  std::string a, b, out, a_prefix, b_prefix, c, format = "nvfp4", gemm = "exact",
                                                out_dtype = "fp32", backend;
  float alpha = 1.0f, beta = 0.0f;
  int split_k = 1;
  bool format_given = false;
};

void run_gemm_cmd(const GemmArgs& g) {
  const bool from_prefix =
      !g.a_prefix.empty();  // with b_prefix: the callback checks they go together
  if (!from_prefix && (g.a.empty() || g.b.empty()))
    throw std::invalid_argument("give A.npy and B.npy, or --a-prefix P --b-prefix Q");
  const QFormat fmt =
      g.format == "fp8" ? QFormat::FP8 : (g.format == "mxfp4" ? QFormat::MXFP4 : QFormat::NVFP4);
  {  // D and its meta.json are none of the inputs, and can be written (before any work)
    std::vector<std::string> inputs;
    if (from_prefix) {
      for (const std::string& p : {g.a_prefix, g.b_prefix})
        for (const char* ext :
             {".codes.npy", ".scales.npy", ".amax.npy", ".dequant.npy", ".meta.json"})
          inputs.push_back(p + ext);
    } else {
      inputs = {g.a, g.b};
    }
    if (!g.c.empty()) inputs.push_back(g.c);
    io::check_outputs({g.out, g.out + ".meta.json"}, inputs);
  }
  QuantizedHost qa, qb;
  std::vector<std::string> warnings;  // printed with the result
  if (!g.c.empty() && g.beta == 0.0f)
    throw std::invalid_argument("gemm: --c " + g.c +
                                " with beta 0 would not contribute: give --beta");
  if (from_prefix) {
    if (g.format_given)
      throw std::invalid_argument(
          "gemm: --format does not go with --a-prefix/--b-prefix (their meta.json names "
          "the format)");
    bool rht_a = false, rht_b = false;
    qa = load_quantized(g.a_prefix, "A", &rht_a);
    qb = load_quantized(g.b_prefix, "B", &rht_b);
    if (rht_a != rht_b)
      throw std::invalid_argument("gemm: " + std::string(rht_a ? g.a_prefix : g.b_prefix) +
                                  " is an RHT copy and " + (rht_a ? g.b_prefix : g.a_prefix) +
                                  " is not: both operands of a GEMM need the same transform");
  } else {
    int64_t ma, ka, nb, kb;
    std::vector<float> xa = load_f32_matrix(g.a, "A", &ma, &ka);
    std::vector<float> xb = load_f32_matrix(g.b, "B", &nb, &kb);
    if (ka != kb)
      throw std::invalid_argument("gemm: K differs: A is " + shape_str(ma, ka) + " and B is " +
                                  shape_str(nb, kb) + " (D = A * B^T needs A [M, K], B [N, K])");
    qa = quantize_gemm_operand(xa, ma, ka, fmt, "A", g.a, &warnings);
    qb = quantize_gemm_operand(xb, nb, kb, fmt, "B", g.b, &warnings);
  }
  if (from_prefix)
    for (const auto& [name, prefix, q] :
         {std::tuple{"A", g.a_prefix, &qa}, std::tuple{"B", g.b_prefix, &qb}})
      if (!std::isfinite(q->amax))
        warnings.push_back(
            fmt::format("{}'s amax ({}.amax.npy) is {}: its input held an Inf or "
                        "NaN, and D is not finite",
                        name, prefix, q->amax));
  GemmConfig cfg;
  cfg.alpha = g.alpha;
  cfg.beta = g.beta;
  cfg.split_k = g.split_k;
  cfg.out = g.out_dtype == "bf16" ? GemmOut::BF16 : GemmOut::F32;
  cfg.impl = g.gemm == "cublaslt" ? GemmImpl::CublasLt : GemmImpl::Exact;
  std::vector<float> c;
  if (!g.c.empty()) {
    int64_t cr, cc;
    c = load_f32_matrix(g.c, "C", &cr, &cc);
    if (cr != qa.rows || cc != qb.rows)
      throw std::invalid_argument(g.c + ": C must be " + shape_str(qa.rows, qb.rows) + ", got " +
                                  shape_str(cr, cc));
  }
  const GemmRun run = run_gemm_checked(qa, qb, c.empty() ? nullptr : &c, g.c, cfg, g.backend);
  const std::vector<uint32_t>& bits = run.bits;
  warnings.insert(warnings.end(), run.warnings.begin(), run.warnings.end());
  if (run.cublaslt_vs_exact >= 0)
    fmt::print("  max |cublaslt - exact| = {:.6g}   (exact GEMM on the same backend: {:.1f} ms)\n",
               run.cublaslt_vs_exact, run.ms_exact);
  io::AtomicOutputs out;
  const std::vector<size_t> shape = {static_cast<size_t>(qa.rows), static_cast<size_t>(qb.rows)};
  if (cfg.out == GemmOut::BF16) {
    std::vector<uint16_t> h(bits.begin(), bits.end());
    io::write_npy_u16(out.stage(g.out), h.data(), shape);
  } else {
    io::write_npy_f32(out.stage(g.out), reinterpret_cast<const float*>(bits.data()), shape);
  }
  nlohmann::json meta = {
      {"contract_version", kContractVersion},
      {"generator", "fp4sim gemm"},
      {"format", qformat_name(qa.format)},
      {"gemm", g.gemm},
      {"shape", {qa.rows, qb.rows, qa.cols}},
      {"alpha", g.alpha},
      {"beta", g.beta},
      {"split_k", g.split_k},
      {"out_dtype", g.out_dtype},
      {"backend", run.backend},
      {"a", from_prefix ? g.a_prefix : g.a},
      {"b", from_prefix ? g.b_prefix : g.b},
      {"model", "one CTA walking K in increasing 64-wide chunks (docs/numerics.md §8)"}};
  io::write_text(out.stage(g.out + ".meta.json"), meta.dump(2) + "\n");
  out.commit();
  fmt::print(
      "fp4sim gemm  D[{} x {}] = A[{} x {}] * B[{} x {}]^T  {} {}, backend {}, {:.1f} ms "
      "({:.2f} GFLOP/s)\n",
      qa.rows, qb.rows, qa.rows, qa.cols, qb.rows, qb.cols, qformat_name(qa.format), g.gemm,
      run.backend, run.ms, 2.0 * qa.rows * qb.rows * qa.cols / (run.ms * 1e6));
  for (const std::string& w : warnings) fmt::print("  WARNING  {}\n", w);
  fmt::print("  wrote {} and {}.meta.json\n", g.out, g.out);
}

// ---- one MMA
// ---------------------------------------------------------------------------------------

// "v0,v1,..." (dense) or "k:v,k:v" (sparse) -> 64 E2M1 values, exactly representable.
std::vector<float> parse_e2m1_list(const std::string& s, const char* flag) {
  std::vector<float> v(kGstK, 0.0f);
  std::vector<bool> seen(kGstK, false);
  std::stringstream ss(s);
  std::string item;
  int next = 0;
  while (std::getline(ss, item, ',')) {
    if (item.empty())
      throw std::invalid_argument(std::string(flag) + ": an empty entry in '" + s + "'");
    long long k = next;
    std::string val = item;
    const auto colon = item.find(':');
    if (colon != std::string::npos) {
      k = parse_integer(item.substr(0, colon), flag);
      val = item.substr(colon + 1);
    }
    if (k < 0 || k >= kGstK)
      throw std::invalid_argument(std::string(flag) + ": index " + std::to_string(k) +
                                  " outside 0..63");
    if (seen[static_cast<size_t>(k)])
      throw std::invalid_argument(std::string(flag) + ": index " + std::to_string(k) +
                                  " given twice");
    seen[static_cast<size_t>(k)] = true;
    const double d = parse_number(val, flag);
    const float x = static_cast<float>(d);
    if (static_cast<double>(x) != d || e2m1_to_f32(e2m1_rn_satfinite(x)) != x)
      throw std::invalid_argument(std::string(flag) + ": " + val +
                                  " is not an E2M1 value (±0, 0.5, 1, 1.5, 2, 3, 4, 6)");
    v[static_cast<size_t>(k)] = x;
    next = static_cast<int>(k) + 1;
  }
  return v;
}

// "2^11,1,0.5" or raw bytes "0x38" -> scale bytes of the kind, exactly.
std::vector<uint8_t> parse_scales(const std::string& s, ScaleKind kind, const char* flag) {
  std::vector<uint8_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.rfind("0x", 0) == 0 || item.rfind("0X", 0) == 0) {
      const long long byte = parse_integer(item.substr(2), flag, 16);
      if (byte < 0 || byte > 0xFF)
        throw std::invalid_argument(std::string(flag) + ": " + item + " is not a byte");
      if (kind == ScaleKind::UE4M3_16 && byte > 0x7F)
        throw std::invalid_argument(std::string(flag) + ": " + item +
                                    " has the sign bit set; UE4M3 scales are unsigned");
      out.push_back(static_cast<uint8_t>(byte));
      continue;
    }
    const double v = parse_number(item, flag);
    if (std::signbit(v) && v != 0.0)
      throw std::invalid_argument(std::string(flag) + ": " + item +
                                  " is negative; block scales are unsigned");
    if (kind == ScaleKind::UE4M3_16) {
      const uint8_t b = e4m3_rn_satfinite(static_cast<float>(v));
      if (static_cast<double>(e4m3_to_f32(b)) != v)
        throw std::invalid_argument(std::string(flag) + ": " + item + " is not an E4M3 value");
      out.push_back(b & 0x7F);
    } else {
      int e;
      const double m = std::frexp(v, &e);
      if (m != 0.5 || e - 1 < -127 || e - 1 > 127)
        throw std::invalid_argument(std::string(flag) + ": " + item +
                                    " is not a power of two in 2^-127..2^127");
      out.push_back(static_cast<uint8_t>(e - 1 + 127));
    }
  }
  const size_t want = kind == ScaleKind::UE8M0_32 ? 2 : 4;
  if (out.size() != want)
    throw std::invalid_argument(std::string(flag) + ": expected " + std::to_string(want) +
                                " scales, got " + std::to_string(out.size()));
  return out;
}

struct MmaArgs {
  std::string a, b, sfa, sfb, kind = "ue8m0-16", c = "0";
};

void run_mma(const MmaArgs& m) {
  const ScaleKind kind = m.kind == "ue4m3"      ? ScaleKind::UE4M3_16
                         : m.kind == "ue8m0-32" ? ScaleKind::UE8M0_32
                                                : ScaleKind::UE8M0_16;
  const std::vector<float> a = parse_e2m1_list(m.a, "--a"), b = parse_e2m1_list(m.b, "--b");
  const std::vector<uint8_t> sfa = parse_scales(m.sfa, kind, "--sfa"),
                             sfb = parse_scales(m.sfb, kind, "--sfb");
  const double c_wide = parse_number(m.c, "--c");
  const float c = static_cast<float>(c_wide);
  if (std::isfinite(c_wide) && !std::isfinite(c))
    throw std::invalid_argument("--c: " + m.c +
                                " is beyond the FP32 range (write inf for an infinite C)");
  if (c_wide != 0.0 && c == 0.0f)
    throw std::invalid_argument("--c: " + m.c + " is below FP32's smallest subnormal (2^-149)");
  uint8_t pa[32] = {}, pb[32] = {};
  for (int k = 0; k < kGstK; ++k) {
    pa[k / 2] |= e2m1_rn_satfinite(a[k]) << (4 * (k & 1));
    pb[k / 2] |= e2m1_rn_satfinite(b[k]) << (4 * (k & 1));
  }
  uint8_t sa[4] = {}, sb[4] = {};
  for (size_t i = 0; i < sfa.size(); ++i) {
    sa[i] = sfa[i];
    sb[i] = sfb[i];
  }
  GstTrace tr{};
  const uint32_t r = gst_fdpa_fp4_bits(pa, pb, sa, sb, kind, c, &tr);
  fmt::print("GST-FDPA (K = 64, groups of {}, F = {}, e_zero = {}), scales {}\n", kGstGroup, kGstF,
             kGstZeroExp, m.kind);
  for (int g = 0; g < kGstGroups; ++g)
    fmt::print("  group {}: sum of products {:>9}   exponent {:>5}   term on the grid {:>16}\n", g,
               tr.p4[g] / 4.0, tr.group_exp[g], tr.truncated[g]);
  fmt::print("  C       : {:>9}   exponent {:>5}   term on the grid {:>16}\n", c, tr.c_exp,
             tr.truncated[kGstGroups]);
  fmt::print("  e_max {}  grid 2^{}\n", tr.e_max, tr.e_max - kGstF);
  float rf;
  std::memcpy(&rf, &r, 4);
  fmt::print("result 0x{:08X}  {:.9g}\n", r, rf);
}

// ---- crosscheck
// ------------------------------------------------------------------------------------

struct CrossArgs {
  std::string shapes = "128x128x256,96x80x320,64x64x1024", format = "nvfp4";
  int split_k = 1;
};

void run_crosscheck(const CrossArgs& x) {
  // every shape checked before any work: MxNxK, three positive integers and nothing else
  std::vector<std::pair<std::string, std::array<int64_t, 3>>> shapes;
  {
    std::stringstream ss(x.shapes);
    std::string item;
    while (std::getline(ss, item, ',')) {
      long M = 0, N = 0, K = 0;
      int used = 0;
      if (std::sscanf(item.c_str(), "%ldx%ldx%ld%n", &M, &N, &K, &used) != 3 ||
          used != static_cast<int>(item.size()) || M <= 0 || N <= 0 || K <= 0)
        throw std::invalid_argument("--shapes: '" + item + "' is not MxNxK with positive integers");
      long mk = 0, nk = 0, mn = 0, bytes = 0;  // A, B and D as float32, before any allocation
      if (__builtin_mul_overflow(M, K, &mk) || __builtin_mul_overflow(N, K, &nk) ||
          __builtin_mul_overflow(M, N, &mn) || __builtin_mul_overflow(mk, 4L, &bytes) ||
          __builtin_mul_overflow(nk, 4L, &bytes) || __builtin_mul_overflow(mn, 4L, &bytes))
        throw std::invalid_argument("--shapes: '" + item +
                                    "' is too large (a matrix's byte count overflows 64 bits)");
      shapes.push_back({item, {M, N, K}});
    }
    if (shapes.empty()) throw std::invalid_argument("--shapes: no shape given");
  }
  const std::string why = cuda_backend_unavailable_reason();
  if (!why.empty())
    throw std::runtime_error("crosscheck compares the emu and cuda backends and needs a GPU: " +
                             why);
  auto emu = make_backend("emu");
  auto cuda = make_backend("cuda");
  const QFormat fmt =
      x.format == "fp8" ? QFormat::FP8 : (x.format == "mxfp4" ? QFormat::MXFP4 : QFormat::NVFP4);
  int bad = 0;
  for (const auto& [item, mnk] : shapes) {
    const int64_t M = mnk[0], N = mnk[1], K = mnk[2];
    std::mt19937_64 rng(static_cast<uint64_t>(M * 1000003 + N * 1009 + K));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> xa(static_cast<size_t>(M * K)), xb(static_cast<size_t>(N * K));
    for (auto& v : xa) v = nd(rng) * std::exp(2.0f * nd(rng));
    for (auto& v : xb) v = nd(rng);
    std::vector<std::string> unused;  // (random normal operands: finite)
    QuantizedHost qa = quantize_gemm_operand(xa, M, K, fmt, "A", "random", &unused),
                  qb = quantize_gemm_operand(xb, N, K, fmt, "B", "random", &unused);
    GemmConfig cfg;
    cfg.split_k = x.split_k;
    double ms_e = 0, ms_c = 0;
    const auto de = run_gemm_on(*emu, qa, qb, nullptr, cfg, &ms_e);
    const auto dc = run_gemm_on(*cuda, qa, qb, nullptr, cfg, &ms_c);
    size_t first = de.size();
    for (size_t i = 0; i < de.size(); ++i)
      if (de[i] != dc[i]) {
        first = i;
        break;
      }
    if (first == de.size()) {
      fmt::print("  {:>16}  {}  bitwise identical ({} outputs)  emu {:.1f} ms, cuda {:.1f} ms\n",
                 item, qformat_name(fmt), de.size(), ms_e, ms_c);
    } else {
      ++bad;
      fmt::print("  {:>16}  {}  DIFFERENT at ({}, {}): emu 0x{:08X} cuda 0x{:08X}\n", item,
                 qformat_name(fmt), first / N, first % N, de[first], dc[first]);
    }
  }
  if (bad) throw std::runtime_error(std::to_string(bad) + " shape(s) differ between emu and cuda");
}

}  // namespace

void register_gemm(CLI::App& app) {
  auto g = std::make_shared<GemmArgs>();
  auto* cmd = app.add_subcommand("gemm",
                                 "Block-scaled GEMM D = alpha*A*B^T (+ beta*C) in NVFP4, MXFP4 or "
                                 "FP8: the exact tensor-core model, or cuBLASLt");
  cmd->add_option("a", g->a, "A.npy (float32 [M, K]), quantized RN 1x16 (or MXFP4)");
  cmd->add_option("b", g->b, "B.npy (float32 [N, K])");
  cmd->add_option("out", g->out, "Output D.npy (float32, or bfloat16 bits as uint16)");
  cmd->add_option("--a-prefix", g->a_prefix,
                  "Take A already quantized: files written by fp4sim quantize");
  cmd->add_option("--b-prefix", g->b_prefix, "Take B already quantized");
  auto* format_opt = cmd->add_option("--format", g->format,
                                     "nvfp4 | mxfp4 | fp8 (1x128 E4M3 blocks); not with prefixes")
                         ->check(CLI::IsMember({"nvfp4", "mxfp4", "fp8"}));
  cmd->add_option("--gemm", g->gemm, "exact | cublaslt")
      ->check(CLI::IsMember({"exact", "cublaslt"}));
  cmd->add_option("--out-dtype", g->out_dtype, "fp32 | bf16")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  cmd->add_option("--c", g->c, "C.npy (float32 [M, N]) for beta");
  cmd->add_option("--alpha", g->alpha, "alpha");
  cmd->add_option("--beta", g->beta, "beta (needs --c)");
  cmd->add_option("--split-k", g->split_k, "Split K into S equal ranges added in order");
  cmd->add_option("--backend", g->backend, "emu | cuda")->check(CLI::IsMember({"emu", "cuda"}));
  cmd->callback([g, format_opt]() {
    // positional a, b, out: with prefixes only OUT is given, CLI11 fills `a` first
    GemmArgs x = *g;
    x.format_given = format_opt->count() > 0;
    const bool prefixes = !x.a_prefix.empty() || !x.b_prefix.empty();
    if (prefixes && (x.a_prefix.empty() || x.b_prefix.empty()))
      throw std::invalid_argument("gemm: --a-prefix and --b-prefix go together");
    if (prefixes && !x.b.empty())
      throw std::invalid_argument(
          "gemm: with --a-prefix/--b-prefix give only the output D.npy, not A.npy and B.npy");
    if (prefixes && x.out.empty()) std::swap(x.out, x.a);
    if (x.out.empty()) throw std::invalid_argument("gemm: give the output path D.npy");
    run_gemm_cmd(x);
  });

  auto m = std::make_shared<MmaArgs>();
  auto* mma = app.add_subcommand("mma",
                                 "One Blackwell block-scaled FP4 MMA (GST-FDPA, K = 64) on given "
                                 "codes, scales and C, with each group's exponent and truncation");
  mma->add_option("--a", m->a, "64 E2M1 values: dense 'v0,v1,...' or sparse 'k:v,k:v'")->required();
  mma->add_option("--b", m->b, "64 E2M1 values, as --a")->required();
  mma->add_option("--sfa", m->sfa, "A's scales: 4 values (2 for ue8m0-32), e.g. 2^11,1,1,1 or 0x38")
      ->required();
  mma->add_option("--sfb", m->sfb, "B's scales")->required();
  mma->add_option("--scale", m->kind, "ue4m3 | ue8m0-16 | ue8m0-32")
      ->check(CLI::IsMember({"ue4m3", "ue8m0-16", "ue8m0-32"}));
  mma->add_option("--c", m->c, "C (FP32; 2^N accepted)");
  mma->callback([m]() { run_mma(*m); });

  auto x = std::make_shared<CrossArgs>();
  auto* cc = app.add_subcommand("crosscheck", "Run an op on both backends and compare bit for bit");
  auto* ccg = cc->add_subcommand("gemm", "Exact GEMM, emu vs cuda, on seeded random operands");
  ccg->add_option("--shapes", x->shapes, "Comma-separated MxNxK");
  ccg->add_option("--format", x->format, "nvfp4 | mxfp4 | fp8")
      ->check(CLI::IsMember({"nvfp4", "mxfp4", "fp8"}));
  ccg->add_option("--split-k", x->split_k, "split-K");
  cc->require_subcommand(1);
  ccg->callback([x]() { run_crosscheck(*x); });
}

}  // namespace fp4sim::cli
