// The cases of fp4sim's golden packs (tools/cmd_golden.cpp writes and checks them; DESIGN.md §15):
// deterministic inputs (fixed seeds, edge values), the options as the CLI spells them, and the
// expected outputs from the emulator's own functions, the ones `fp4sim quantize`, `fp4sim gemm`
// and `fp4sim mma` call.
#include "tools/golden_cases.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>

#include "emu/contract.hpp"
#include "emu/gemm.hpp"
#include "emu/mma.hpp"
#include "tools/backends.hpp"
#include "tools/npy.hpp"
#include "tools/quantize_options.hpp"

namespace fp4sim::cli::golden {
namespace {

namespace fs = std::filesystem;

// ---- inputs
// ----------------------------------------------------------------------------------------

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Seeded values with a wide spread of magnitudes (Gaussian times a log-normal factor).
std::vector<float> spread_values(int64_t rows, int64_t cols, uint64_t seed, float spread = 1.5f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (float& x : v) x = nd(rng) * std::exp(spread * nd(rng));
  return v;
}

// Quantizer input with the adversarial rows planted over seeded values: row 0 all zeros, row 1
// one zero block and FP32 subnormals, row 2 E2M1 ties at an exact block scale (the tensor amax is
// 6 * 448, so S_enc is 1), row 3 NaN, row 4 large values (2^8 .. 2^11, the blocks' amax near the
// tensor amax), row 5 values just above and below the rounding boundaries, row 6 a block of equal
// values (every candidate scale is exact: Four Over Six's tie); values beyond the amax are halved.
std::vector<float> mixed_values(int64_t rows, int64_t cols, uint64_t seed) {
  std::vector<float> v = spread_values(rows, cols, seed);
  auto at = [&](int64_t r, int64_t c) -> float& { return v[static_cast<size_t>(r * cols + c)]; };
  const float ties[16] = {6,      0.25f,  0.75f,  1.25f,  1.75f, 2.5f,  3.5f, 5,
                          -0.25f, -0.75f, -1.25f, -1.75f, -2.5f, -3.5f, -5,   0};
  for (int64_t c = 0; c < cols; ++c) {
    at(0, c) = 0.0f;
    at(1, c) = c < 16 ? 0.0f : std::ldexp(static_cast<float>(c % 7 + 1), -140 - (c % 9));
    at(2, c) = std::ldexp(ties[c % 16], -2 * static_cast<int>(c / 16 % 4));
    if (c % 5 == 0) at(3, c) = kNaN;
    at(4, c) = std::ldexp(1.0f + static_cast<float>(c % 13) / 16.0f, 10 - static_cast<int>(c % 3));
    const float grid[8] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5, 6};
    at(5, c) = std::nextafter(grid[c % 8], c % 2 ? kInf : 0.0f) * (c % 3 ? 1.0f : -1.0f);
    at(6, c) = c < 32 ? 3.0f : at(6, c);
  }
  at(7, 0) = 2688.0f;  // the tensor amax: S_enc = 6 * 448 / 2688 = 1
  for (float& x : v)
    if (std::isfinite(x) && std::fabs(x) > 2688.0f) x = std::copysign(2688.0f, x) * 0.5f;
  return v;
}

// Four Over Six ties and near-ties: each 1x16 block is, of 256 seeded candidates, one whose two
// candidate errors (4-max and 6-max scale, by the quantizer's own functions) are equal (even
// blocks: the tie, where the 6-max scale is kept) or closest without being equal, relative to
// their size (odd blocks: a median gap of 0.1% for mae, 0.2% for mse, the smallest under 1e-5);
// element 0 is the tensor amax (2688), so the global scale is known.
std::vector<float> fos_near_tie_values(int64_t rows, int64_t cols, uint64_t seed, bool mse) {
  constexpr float kAmax = 2688.0f;
  constexpr int kCandidates = 256;
  const Nvfp4Global g = nvfp4_global(kAmax, true);
  const SrBits rn = sr_bits_for_chunk(false, 0, 0, 0);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (size_t b = 0; b < v.size(); b += kNvfp4Block) {
    float best[kNvfp4Block] = {}, best_gap = kInf;
    for (int t = 0; t < kCandidates; ++t) {
      float x[kNvfp4Block];
      const float mag = std::ldexp(1.0f, static_cast<int>(rng() % 20) - 8);
      for (float& e : x) e = std::fmin(std::fmax(nd(rng) * mag, -kAmax / 2), kAmax / 2);
      uint8_t map6, map4, p6[kNvfp4Block / 2], p4[kNvfp4Block / 2];
      four_over_six_candidates(amax_strided(x, kNvfp4Block, 1), g.s_enc, &map6, &map4);
      e2m1_encode16(x, nvfp4_block_encode_scale(map6, g.s_dec), rn, p6);
      e2m1_encode16(x, nvfp4_block_encode_scale(map4, g.s_dec), rn, p4);
      const float e6 = four_over_six_row_error(x, p6, map6, g.amax, mse, 0.0f);
      const float e4 = four_over_six_row_error(x, p4, map4, g.amax, mse, 0.0f);
      const float gap = std::fabs(e4 - e6) / std::fmax(e6, FLT_MIN);
      const bool want_tie = (b / kNvfp4Block) % 2 == 0;
      if (e6 > 0.0f && (want_tie ? gap == 0.0f : gap > 0.0f) && gap < best_gap) {
        best_gap = gap;
        std::copy(x, x + kNvfp4Block, best);
      }
    }
    std::copy(best, best + kNvfp4Block, v.begin() + static_cast<std::ptrdiff_t>(b));
  }
  v[0] = kAmax;
  return v;
}

std::vector<float> with_inf(std::vector<float> v) {
  v[3] = kInf;
  v[40] = -kInf;
  v[77] = kNaN;
  return v;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = bf16_rne(v[i]);
  return h;
}

// ---- cases
// -----------------------------------------------------------------------------------------

std::vector<size_t> shape2(int64_t r, int64_t c) {
  return {static_cast<size_t>(r), static_cast<size_t>(c)};
}

// ---- quantizer cases: the options of `fp4sim quantize`, mapped onto QuantizeConfig by that
// command's own quantize_config (tools/quantize_options.hpp).
using QuantizeSpec = QuantizeOptions;

std::vector<std::string> quantize_flags(const QuantizeSpec& s) {
  std::vector<std::string> f = {"--format", s.format};
  if (s.block_2d) f.push_back("--2d");
  if (s.columnwise) f.push_back("--columnwise");
  if (s.rht) f.push_back("--rht");
  if (s.sr)
    f.insert(f.end(),
             {"--sr", "--seed", std::to_string(s.seed), "--stream", std::to_string(s.stream)});
  if (s.fos) f.insert(f.end(), {"--four-over-six", "--error", s.error});
  if (s.mx_rule_given) f.insert(f.end(), {"--mx-rule", s.mx_rule});
  return f;
}

// x: float32 values, or their BF16 bits when bf16 is set.
Case quantize_case(const std::string& name, const QuantizeSpec& s, std::vector<float> x,
                   int64_t rows, int64_t cols, bool bf16 = false) {
  Case c;
  c.name = name;
  c.op = "quantize";
  const QuantizeConfig cfg = quantize_config(s);
  const bool fp8 = s.format == "fp8";
  const int64_t wr = s.columnwise ? cols : rows, wc = s.columnwise ? rows : cols;
  const int64_t block = qformat_block(cfg.format);
  c.inputs = {"x.npy"};
  c.args = {"quantize", "inputs/x.npy", "expected/q"};
  for (const std::string& f : quantize_flags(s)) c.args.push_back(f);
  c.outputs = {{"q.codes.npy", "|u1", shape2(wr, fp8 ? wc : wc / 2)},
               {"q.scales.npy", fp8 ? "<f4" : "|u1", shape2(wr, wc / block)},
               {"q.amax.npy", "<f4", {1}},
               {"q.dequant.npy", "<f4", shape2(wr, wc)}};
  const int64_t tiled = fp8 ? 0 : tiled_scale_bytes(wr, wc / block);
  if (!fp8) c.outputs.push_back({"q.scales_tiled.npy", "|u1", {static_cast<size_t>(tiled)}, true});
  c.desc = {{"input",
             {{"file", "x.npy"},
              {"dtype", bf16 ? "bfloat16 bits as uint16 (<u2)" : "float32 (<f4)"},
              {"shape", {rows, cols}}}},
            {"written_shape", {wr, wc}},
            {"options", quantize_flags(s)}};
  c.write = [=](const fs::path& dir) {
    std::vector<uint16_t> h;
    TensorView v;
    if (bf16) {
      h = to_bf16(x);
      io::write_npy_u16(dir / "inputs/x.npy", h.data(), shape2(rows, cols));
      v = view_of(h.data(), DType::BF16, rows, cols, Device::Host, "x");
    } else {
      io::write_npy_f32(dir / "inputs/x.npy", x.data(), shape2(rows, cols));
      v = view_of(x.data(), DType::F32, rows, cols, Device::Host, "x");
    }
    validate_quantize(v, cfg);
    auto emu = make_backend("emu");
    QuantizeResult res = quantize_to_host(*emu, v, cfg);
    QuantizedHost& q = s.columnwise ? res.columnwise : res.rowwise;
    const std::vector<float> deq = dequantize_to_host(*emu, q);
    const fs::path e = dir / "expected";
    io::write_npy_u8(e / "q.codes.npy", q.codes.data(), shape2(wr, fp8 ? wc : wc / 2));
    if (fp8)
      io::write_npy_f32(e / "q.scales.npy", reinterpret_cast<const float*>(q.scales.data()),
                        shape2(wr, wc / block));
    else
      io::write_npy_u8(e / "q.scales.npy", q.scales.data(), shape2(wr, wc / block));
    io::write_npy_f32(e / "q.amax.npy", &q.amax, {1});
    io::write_npy_f32(e / "q.dequant.npy", deq.data(), shape2(wr, wc));
    if (!fp8) {
      std::vector<uint8_t> t(static_cast<size_t>(tiled));
      emu->scales_to_tiled(q.scales.data(), wr, wc / block, t.data());
      io::write_npy_u8(e / "q.scales_tiled.npy", t.data(), {t.size()});
    }
  };
  return c;
}

void add_quantize_cases(std::vector<Case>& cases) {
  const int64_t R = 64, C = 128;
  const std::vector<float> mixed = mixed_values(R, C, 101);
  auto q = [&](const std::string& name, QuantizeSpec s, const std::vector<float>& x,
               int64_t rows = 64, int64_t cols = 128,
               bool bf16 = false) { cases.push_back(quantize_case(name, s, x, rows, cols, bf16)); };
  QuantizeSpec s;
  q("quantize/nvfp4_1x16_rn_row", s, mixed);
  s.columnwise = true;
  q("quantize/nvfp4_1x16_rn_col", s, mixed);
  s.rht = true;
  q("quantize/nvfp4_1x16_rn_col_rht", s, mixed);
  s.sr = true;
  s.seed = 7;
  s.stream = 4;
  q("quantize/nvfp4_1x16_sr_col_rht", s, mixed);
  s = {};
  s.sr = true;
  s.seed = 7;
  s.stream = 3;
  q("quantize/nvfp4_1x16_sr_row", s, mixed);
  s.seed = 0x0123456789ABCDEFull;
  s.stream = 1ull << 40;
  q("quantize/nvfp4_1x16_sr_row_seed2", s, mixed);
  s = {};
  s.block_2d = true;
  q("quantize/nvfp4_16x16_rn_row", s, mixed);
  s.columnwise = true;
  q("quantize/nvfp4_16x16_rn_col", s, mixed);
  s.sr = true;
  s.seed = 11;
  s.stream = 2;
  q("quantize/nvfp4_16x16_sr_col", s, mixed);
  // Four Over Six: many seeded blocks (some close to the 4-vs-6 tie) and row 6's exact tie
  const std::vector<float> fos_in = mixed_values(R, C, 202);
  for (const char* err : {"mae", "mse"}) {
    s = {};
    s.fos = true;
    s.error = err;
    q(std::string("quantize/nvfp4_fos_") + err + "_row", s, fos_in);
    s.block_2d = true;
    q(std::string("quantize/nvfp4_fos_") + err + "_16x16", s, fos_in);
    s.block_2d = false;
    s.columnwise = true;
    q(std::string("quantize/nvfp4_fos_") + err + "_col", s, fos_in);
  }
  for (const char* err : {"mae", "mse"}) {
    s = {};
    s.fos = true;
    s.error = err;
    q(std::string("quantize/nvfp4_fos_") + err + "_near_ties_row", s,
      fos_near_tie_values(R, C, err[1] == 's' ? 206 : 205, err[1] == 's'));
  }
  s = {};
  q("quantize/nvfp4_bf16_input_row", s, mixed, R, C, true);
  q("quantize/nvfp4_inf_row", s, with_inf(mixed));
  q("quantize/nvfp4_all_zero", s, std::vector<float>(R * C, 0.0f));
  {
    std::vector<float> tiny = spread_values(R, C, 303, 0.5f);
    for (float& x : tiny) x = std::ldexp(x, -130);  // FP32 subnormals and near-subnormals
    q("quantize/nvfp4_subnormal_row", s, tiny);
    std::vector<float> huge = spread_values(R, C, 304, 0.5f);
    for (float& x : huge) x = std::ldexp(std::fmin(std::fmax(x, -8.0f), 8.0f), 124);
    q("quantize/nvfp4_huge_row", s, huge);
  }
  for (const char* rule : {"floor", "ceil"}) {
    s = {};
    s.format = "mxfp4";
    s.mx_rule = rule;
    s.mx_rule_given = true;
    q(std::string("quantize/mxfp4_") + rule + "_row", s, mixed);
    s.columnwise = true;
    q(std::string("quantize/mxfp4_") + rule + "_col", s, mixed);
  }
  s = {};
  s.format = "mxfp4";
  q("quantize/mxfp4_inf_row", s, with_inf(mixed));
  s = {};
  s.format = "fp8";
  const std::vector<float> big = mixed_values(128, 256, 404);
  q("quantize/fp8_1x128_row", s, big, 128, 256);
  s.columnwise = true;
  q("quantize/fp8_1x128_col", s, big, 128, 256);
  s = {};
  s.format = "fp8";
  s.block_2d = true;
  q("quantize/fp8_128x128_row", s, big, 128, 256);
  s.columnwise = true;
  q("quantize/fp8_128x128_col", s, big, 128, 256);
  s = {};
  s.format = "fp8";
  q("quantize/fp8_1x128_inf_row", s, with_inf(big), 128, 256);
}

// ---- GEMM cases: from float operands (quantized RN 1x16 / 1x32 / 1x128 row-wise, as `fp4sim
// gemm A.npy B.npy` does) or from quantized operands given as `fp4sim quantize`'s files, which
// lets a case hold scales no quantizer writes (zero, NaN, subnormal, huge).
struct GemmSpec {
  std::string format = "nvfp4", out_dtype = "fp32";
  float alpha = 1.0f, beta = 0.0f;  // beta != 0: a C operand
  int split_k = 1;
};

std::string num(float v) { return fmt::format("{}", v); }  // shortest text that reads back as v

std::vector<std::string> gemm_flags(const GemmSpec& g, bool with_format) {
  std::vector<std::string> f;
  if (with_format) f.insert(f.end(), {"--format", g.format});
  if (g.alpha != 1.0f) f.push_back("--alpha=" + num(g.alpha));
  if (g.beta != 0.0f) f.insert(f.end(), {"--beta=" + num(g.beta), "--c", "inputs/c.npy"});
  if (g.split_k != 1) f.insert(f.end(), {"--split-k", std::to_string(g.split_k)});
  if (g.out_dtype != "fp32") f.insert(f.end(), {"--out-dtype", g.out_dtype});
  return f;
}

QFormat format_of(const std::string& f) {
  return f == "fp8" ? QFormat::FP8 : (f == "mxfp4" ? QFormat::MXFP4 : QFormat::NVFP4);
}

// D = alpha * A * B^T (+ beta * C) on the emulator, its bits as the output file's.
void write_gemm_output(const fs::path& file, QuantizedHost& qa, QuantizedHost& qb,
                       std::vector<float>& cvals, const GemmSpec& g) {
  GemmConfig cfg;
  cfg.alpha = g.alpha;
  cfg.beta = g.beta;
  cfg.split_k = g.split_k;
  cfg.out = g.out_dtype == "bf16" ? GemmOut::BF16 : GemmOut::F32;
  const int64_t M = qa.rows, N = qb.rows;
  TensorView cv = host_view(cvals.data(), M, N, "C");
  std::vector<uint32_t> d32(static_cast<size_t>(M * N));
  std::vector<uint16_t> d16(static_cast<size_t>(M * N));
  TensorView dv = cfg.out == GemmOut::BF16 ? view_of(d16.data(), DType::BF16, M, N, Device::Host)
                                           : view_of(d32.data(), DType::F32, M, N, Device::Host);
  const QuantizedView va = qa.view(), vb = qb.view();
  validate_gemm(va, vb, g.beta != 0.0f ? &cv : nullptr, cfg, dv);
  auto emu = make_backend("emu");
  emu->gemm(va, vb, g.beta != 0.0f ? &cv : nullptr, cfg, dv);
  if (cfg.out == GemmOut::BF16)
    io::write_npy_u16(file, d16.data(), shape2(M, N));
  else
    io::write_npy_f32(file, reinterpret_cast<const float*>(d32.data()), shape2(M, N));
}

// C with Inf, -Inf and NaN planted (they pass to D through beta * C).
std::vector<float> c_values(int64_t M, int64_t N, uint64_t seed) {
  std::vector<float> c = spread_values(M, N, seed, 0.5f);
  c[1] = kInf;
  c[2] = -kInf;
  c[static_cast<size_t>(N + 3)] = kNaN;
  c[static_cast<size_t>(2 * N + 4)] = std::ldexp(1.0f, -140);
  return c;
}

void fill_gemm_common(Case& c, const GemmSpec& g, int64_t M, int64_t N, int64_t K) {
  c.op = "gemm";
  c.outputs = {{"d.npy", g.out_dtype == "bf16" ? "<u2" : "<f4", shape2(M, N)}};
  c.desc = {
      {"format", g.format},
      {"shape_mnk", {M, N, K}},
      {"alpha", g.alpha},
      {"beta", g.beta},
      {"split_k", g.split_k},
      {"out_dtype", g.out_dtype},
      {"d",
       {{"file", "d.npy"},
        {"dtype", g.out_dtype == "bf16" ? "bfloat16 bits as uint16 (<u2)" : "float32 (<f4)"}}}};
  if (g.beta != 0.0f) c.inputs.push_back("c.npy");
}

Case gemm_float_case(const std::string& name, const GemmSpec& g, int64_t M, int64_t N, int64_t K,
                     uint64_t seed) {
  Case c;
  c.name = name;
  c.inputs = {"a.npy", "b.npy"};
  fill_gemm_common(c, g, M, N, K);
  c.args = {"gemm", "inputs/a.npy", "inputs/b.npy", "expected/d.npy"};
  for (const std::string& f : gemm_flags(g, true)) c.args.push_back(f);
  c.desc["operands"] = "A float32 [M, K] and B float32 [N, K], quantized RN row-wise";
  c.write = [=](const fs::path& dir) {
    std::vector<float> a = spread_values(M, K, seed), b = spread_values(N, K, seed + 1, 0.7f);
    if (g.format != "fp8") {  // cancellation: row 1 of A is row 0 with every other element negated
      for (int64_t k = 0; k < K; ++k) b[static_cast<size_t>(N + k)] = b[static_cast<size_t>(k)];
      for (int64_t k = 0; k < K; ++k)
        a[static_cast<size_t>(K + k)] =
            k % 2 ? -a[static_cast<size_t>(k)] : a[static_cast<size_t>(k)];
    }
    std::vector<float> cv = g.beta != 0.0f ? c_values(M, N, seed + 2) : std::vector<float>{};
    io::write_npy_f32(dir / "inputs/a.npy", a.data(), shape2(M, K));
    io::write_npy_f32(dir / "inputs/b.npy", b.data(), shape2(N, K));
    if (!cv.empty()) io::write_npy_f32(dir / "inputs/c.npy", cv.data(), shape2(M, N));
    auto emu = make_backend("emu");
    auto quant = [&](std::vector<float>& x, int64_t rows) {
      QuantizeConfig qc;
      qc.format = format_of(g.format);
      qc.rowwise.enabled = true;
      return quantize_to_host(*emu, host_view(x.data(), rows, K, "operand"), qc).rowwise;
    };
    QuantizedHost qa = quant(a, M), qb = quant(b, N);
    write_gemm_output(dir / "expected/d.npy", qa, qb, cv, g);
  };
  return c;
}

// A quantized operand with seeded codes and the given scale bytes per row pattern.
using ScaleFill = std::function<uint8_t(int64_t row, int64_t block, std::mt19937_64& rng)>;
QuantizedHost make_operand(QFormat fmt, int64_t rows, int64_t K, float amax, uint64_t seed,
                           const ScaleFill& scale) {
  QuantizedHost q;
  q.resize(rows, K, fmt, false);
  std::mt19937_64 rng(seed);
  for (auto& b : q.codes) b = static_cast<uint8_t>(rng());
  const int64_t bpr = K / q.block_size();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < bpr; ++b) q.scales[static_cast<size_t>(r * bpr + b)] = scale(r, b, rng);
  q.amax = amax;
  return q;
}

void write_operand(const fs::path& prefix, const QuantizedHost& q) {
  const std::string p = prefix.string();
  io::write_npy_u8(p + ".codes.npy", q.codes.data(), shape2(q.rows, q.cols / 2));
  io::write_npy_u8(p + ".scales.npy", q.scales.data(), shape2(q.rows, q.cols / q.block_size()));
  io::write_npy_f32(p + ".amax.npy", &q.amax, {1});
  const json meta = {{"contract_version", kContractVersion},
                     {"generator", "fp4sim golden write"},
                     {"format", qformat_name(q.format)},
                     {"four_over_six", false},
                     {"rht", false}};
  io::write_text(p + ".meta.json", meta.dump(2) + "\n");
}

Case gemm_prefix_case(const std::string& name, const GemmSpec& g, int64_t M, int64_t N, int64_t K,
                      float amax_a, float amax_b, uint64_t seed, const ScaleFill& sa,
                      const ScaleFill& sb) {
  Case c;
  c.name = name;
  for (const char* op : {"a", "b"})
    for (const char* ext : {".codes.npy", ".scales.npy", ".amax.npy", ".meta.json"})
      c.inputs.push_back(std::string(op) + ext);
  fill_gemm_common(c, g, M, N, K);
  c.args = {"gemm", "--a-prefix", "inputs/a", "--b-prefix", "inputs/b", "expected/d.npy"};
  for (const std::string& f : gemm_flags(g, false)) c.args.push_back(f);
  c.desc["operands"] =
      "A [M, K] and B [N, K] quantized, as fp4sim quantize's files (codes, scales, amax, meta)";
  c.write = [=](const fs::path& dir) {
    const QFormat fmt = format_of(g.format);
    QuantizedHost qa = make_operand(fmt, M, K, amax_a, seed, sa);
    QuantizedHost qb = make_operand(fmt, N, K, amax_b, seed + 1, sb);
    write_operand(dir / "inputs/a", qa);
    write_operand(dir / "inputs/b", qb);
    std::vector<float> cv = g.beta != 0.0f ? c_values(M, N, seed + 2) : std::vector<float>{};
    if (!cv.empty()) io::write_npy_f32(dir / "inputs/c.npy", cv.data(), shape2(M, N));
    write_gemm_output(dir / "expected/d.npy", qa, qb, cv, g);
  };
  return c;
}

void add_gemm_cases(std::vector<Case>& cases) {
  GemmSpec g;
  cases.push_back(gemm_float_case("gemm/nvfp4_f32", g, 48, 40, 256, 501));
  g.alpha = 0.75f;
  g.beta = -1.5f;
  cases.push_back(gemm_float_case("gemm/nvfp4_alpha_beta_f32", g, 48, 40, 256, 502));
  g.out_dtype = "bf16";
  cases.push_back(gemm_float_case("gemm/nvfp4_alpha_beta_bf16", g, 48, 40, 256, 503));
  g = {};
  g.split_k = 2;
  cases.push_back(gemm_float_case("gemm/nvfp4_split_k2", g, 32, 32, 256, 504));
  g = {};
  g.format = "mxfp4";
  cases.push_back(gemm_float_case("gemm/mxfp4_f32", g, 48, 40, 256, 511));
  g.alpha = -2.0f;
  g.beta = 0.5f;
  g.out_dtype = "bf16";
  cases.push_back(gemm_float_case("gemm/mxfp4_alpha_beta_bf16", g, 48, 40, 256, 512));
  g = {};
  g.format = "fp8";
  cases.push_back(gemm_float_case("gemm/fp8_f32", g, 32, 24, 256, 521));
  g.alpha = 0.5f;
  g.beta = 2.0f;
  g.out_dtype = "bf16";
  cases.push_back(gemm_float_case("gemm/fp8_alpha_beta_bf16", g, 32, 24, 256, 522));

  // scale edge cases (rows of A cycle through them; B's scales are ordinary)
  const ScaleFill ordinary_e4m3 = [](int64_t, int64_t, std::mt19937_64& rng) {
    return static_cast<uint8_t>(0x30 + rng() % 0x18);
  };
  const ScaleFill odd_e4m3 = [](int64_t r, int64_t b, std::mt19937_64& rng) -> uint8_t {
    switch (r % 6) {
      case 0:
        return 0x00;  // zero scale
      case 1:
        return b == 1 ? 0x7F : 0x38;  // one NaN scale in the row
      case 2:
        return static_cast<uint8_t>(1 + (b + r) % 7);  // E4M3 subnormals
      case 3:
        return 0x7E;  // 448, the largest
      case 4:
        return b % 2 ? 0x00 : 0x7E;
      default:
        return static_cast<uint8_t>(rng() % 0x7F);
    }
  };
  g = {};
  cases.push_back(gemm_prefix_case("gemm/nvfp4_scales_zero_nan_subnormal", g, 36, 20, 192, 2688.0f,
                                   2688.0f, 601, odd_e4m3, ordinary_e4m3));
  g.beta = 1.0f;
  g.out_dtype = "bf16";
  cases.push_back(gemm_prefix_case("gemm/nvfp4_scales_c_special_bf16", g, 36, 20, 192, 2688.0f,
                                   2688.0f, 602, odd_e4m3, ordinary_e4m3));
  // saturation: amax near FLT_MAX^(1/2) keeps the epilogue factor finite while D overflows FP32
  // (FP32 out: Inf; BF16 out: the conversion's overflow)
  const ScaleFill max_e4m3 = [](int64_t, int64_t, std::mt19937_64&) -> uint8_t { return 0x7E; };
  g = {};
  cases.push_back(gemm_prefix_case("gemm/nvfp4_overflow_f32", g, 16, 16, 128, 1.0e19f, 1.0e19f, 603,
                                   max_e4m3, max_e4m3));
  g.out_dtype = "bf16";
  cases.push_back(gemm_prefix_case("gemm/nvfp4_overflow_bf16", g, 16, 16, 128, 1.0e19f, 1.0e19f,
                                   604, max_e4m3, max_e4m3));
  const ScaleFill ordinary_ue8m0 = [](int64_t, int64_t, std::mt19937_64& rng) {
    return static_cast<uint8_t>(120 + rng() % 14);
  };
  const ScaleFill odd_ue8m0 = [](int64_t r, int64_t b, std::mt19937_64& rng) -> uint8_t {
    switch (r % 6) {
      case 0:
        return 0x00;  // 2^-127, the smallest
      case 1:
        return b == 1 ? 0xFF : 0x7F;  // one NaN scale in the row
      case 2:
        return 0xFE;  // 2^127: D overflows
      case 3:
        return static_cast<uint8_t>(b % 2 ? 1 : 254);  // extremes side by side
      case 4:
        return static_cast<uint8_t>(100 + b);
      default:
        return static_cast<uint8_t>(rng() % 0xFF);
    }
  };
  g = {};
  g.format = "mxfp4";
  cases.push_back(gemm_prefix_case("gemm/mxfp4_scales_extreme_nan", g, 36, 20, 192, 0.0f, 0.0f, 611,
                                   odd_ue8m0, ordinary_ue8m0));
  g.alpha = 0.25f;
  g.beta = -1.0f;
  g.out_dtype = "bf16";
  cases.push_back(gemm_prefix_case("gemm/mxfp4_scales_c_special_bf16", g, 36, 20, 192, 0.0f, 0.0f,
                                   612, odd_ue8m0, ordinary_ue8m0));
}

// ---- MMA cases: one GST-FDPA (K = 64) as `fp4sim mma` runs it
struct MmaSpec {
  std::string kind;  // ue4m3 | ue8m0-16 | ue8m0-32
  std::vector<float> a, b;
  std::vector<uint8_t> sfa, sfb;
  float c;
};

ScaleKind scale_kind(const std::string& k) {
  return k == "ue4m3" ? ScaleKind::UE4M3_16
                      : (k == "ue8m0-32" ? ScaleKind::UE8M0_32 : ScaleKind::UE8M0_16);
}

std::string join_values(const std::vector<float>& v) {
  std::string s;
  for (float x : v) s += (s.empty() ? "" : ",") + num(x);
  return s;
}
std::string join_bytes(const std::vector<uint8_t>& v) {
  std::string s;
  for (uint8_t x : v) s += fmt::format("{}0x{:02X}", s.empty() ? "" : ",", x);
  return s;
}
// C as `fp4sim mma --c` reads it, exactly: hexadecimal floating point, inf, -inf or nan.
std::string c_text(float c) {
  if (std::isnan(c)) return "nan";
  if (std::isinf(c)) return c > 0 ? "inf" : "-inf";
  return fmt::format("{:a}", static_cast<double>(c));
}

Case mma_case(const std::string& name, const MmaSpec& m) {
  Case c;
  c.name = name;
  c.op = "mma";
  c.inputs = {"a.npy", "b.npy", "sfa.npy", "sfb.npy", "c.npy"};
  c.outputs = {{"d.npy", "<f4", {1}}};
  c.args = {"mma",
            "--a=" + join_values(m.a),
            "--b=" + join_values(m.b),
            "--sfa=" + join_bytes(m.sfa),
            "--sfb=" + join_bytes(m.sfb),
            "--scale",
            m.kind,
            "--c=" + c_text(m.c)};
  c.desc = {
      {"scale_kind", m.kind},
      {"files",
       {{"a.npy", "float32 [64] E2M1 values"},
        {"b.npy", "float32 [64] E2M1 values"},
        {"sfa.npy", "uint8 scale bytes [4] (ue8m0-32: [2])"},
        {"sfb.npy", "uint8 scale bytes"},
        {"c.npy", "float32 [1]"},
        {"d.npy", "float32 [1], the FP32 result bits (fp4sim mma prints them as 'result')"}}}};
  c.write = [=](const fs::path& dir) {
    std::vector<float> a = m.a, b = m.b, cc = {m.c};
    io::write_npy_f32(dir / "inputs/a.npy", a.data(), {a.size()});
    io::write_npy_f32(dir / "inputs/b.npy", b.data(), {b.size()});
    io::write_npy_u8(dir / "inputs/sfa.npy", m.sfa.data(), {m.sfa.size()});
    io::write_npy_u8(dir / "inputs/sfb.npy", m.sfb.data(), {m.sfb.size()});
    io::write_npy_f32(dir / "inputs/c.npy", cc.data(), {1});
    uint8_t pa[32] = {}, pb[32] = {}, sa[4] = {}, sb[4] = {};
    for (int k = 0; k < kGstK; ++k) {
      pa[k / 2] |= e2m1_rn_satfinite(a[static_cast<size_t>(k)]) << (4 * (k & 1));
      pb[k / 2] |= e2m1_rn_satfinite(b[static_cast<size_t>(k)]) << (4 * (k & 1));
    }
    for (size_t i = 0; i < m.sfa.size(); ++i) {
      sa[i] = m.sfa[i];
      sb[i] = m.sfb[i];
    }
    const uint32_t r = gst_fdpa_fp4_bits(pa, pb, sa, sb, scale_kind(m.kind), m.c);
    float d;
    std::memcpy(&d, &r, 4);
    io::write_npy_f32(dir / "expected/d.npy", &d, {1});
  };
  return c;
}

void add_mma_cases(std::vector<Case>& cases) {
  const float e2m1[16] = {-6, -4, -3, -2, -1.5f, -1, -0.5f, -0.0f, 0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  std::mt19937_64 rng(700);
  auto values = [&]() {
    std::vector<float> v(kGstK);
    for (float& x : v) x = e2m1[rng() % 16];
    return v;
  };
  auto scales = [&](const std::string& kind, uint8_t lo, uint8_t span) {
    std::vector<uint8_t> s(kind == "ue8m0-32" ? 2 : 4);
    for (uint8_t& x : s) x = static_cast<uint8_t>(lo + rng() % span);
    return s;
  };
  for (const std::string kind : {"ue4m3", "ue8m0-16", "ue8m0-32"}) {
    const bool e4 = kind == "ue4m3";
    const uint8_t one = e4 ? 0x38 : 0x7F, nan = e4 ? 0x7F : 0xFF;
    const uint8_t lo = e4 ? 0x28 : 0x70, span = e4 ? 0x20 : 0x18;
    const std::string k = "mma/" + kind + "_";
    auto add = [&](const std::string& name, MmaSpec m) {
      m.kind = kind;
      cases.push_back(mma_case(k + name, m));
    };
    for (int i = 0; i < 3; ++i)
      add("random" + std::to_string(i),
          {kind, values(), values(), scales(kind, lo, span), scales(kind, lo, span),
           std::ldexp(static_cast<float>(static_cast<int>(rng() % 2001) - 1000), -7)});
    const size_t ns = e4 || kind == "ue8m0-16" ? 4 : 2;
    std::vector<uint8_t> ones(ns, one);
    MmaSpec m{kind, values(), values(), ones, ones, 0.0f};
    m.sfa[0] = 0x00;  // a zero (UE4M3) / 2^-127 (UE8M0) scale
    add("zero_scale", m);
    m = {kind, values(), values(), ones, ones, 1.0f};
    m.sfb[ns - 1] = nan;
    add("nan_scale", m);
    if (e4) {
      m = {kind, values(), values(), {0x01, 0x02, 0x05, 0x07}, {0x03, 0x38, 0x01, 0x06}, 0.0f};
      add("subnormal_scales", m);
    } else {
      m = {kind, values(), values(), std::vector<uint8_t>(ns, 0xFE), std::vector<uint8_t>(ns, 0xFE),
           0.0f};
      add("overflow", m);
      m = {kind,
           values(),
           values(),
           std::vector<uint8_t>(ns, 0x01),
           std::vector<uint8_t>(ns, 0x02),
           std::ldexp(1.0f, -149)};
      add("tiny_scales_subnormal_c", m);
    }
    for (const float cval : {kInf, -kInf, kNaN}) {
      m = {kind, values(), values(), ones, ones, cval};
      add(std::isnan(cval) ? "c_nan" : (cval > 0 ? "c_inf" : "c_minus_inf"), m);
    }
    // cancellation: B = A with the second half negated, so the groups cancel to exactly 0, and a
    // C far below the products' grid (truncated away) or on it
    std::vector<float> a = values(), b = a;
    for (int i = kGstK / 2; i < kGstK; ++i)
      b[static_cast<size_t>(i)] = -a[static_cast<size_t>(i - kGstK / 2)];
    for (int i = 0; i < kGstK / 2; ++i)
      a[static_cast<size_t>(i + kGstK / 2)] = a[static_cast<size_t>(i)];
    add("cancellation_tiny_c", {kind, a, b, ones, ones, std::ldexp(1.0f, -60)});
    add("cancellation_c", {kind, a, b, ones, ones, 0.75f});
    // signed zeros: every product -0 (A all -0, B positive) with C = -0, and with C = +0
    const std::vector<float> neg_zero(kGstK, -0.0f), pos(kGstK, 1.5f);
    add("negative_zero_products_c_neg_zero", {kind, neg_zero, pos, ones, ones, -0.0f});
    add("negative_zero_products_c_zero", {kind, neg_zero, pos, ones, ones, 0.0f});
  }
}

}  // namespace

std::vector<Case> make_cases(const std::string& set) {
  std::set<std::string> want;
  std::stringstream ss(set);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item != "all" && item != "quantize" && item != "gemm" && item != "mma")
      throw std::invalid_argument("--cases: unknown set '" + item +
                                  "' (expected all, quantize, gemm, mma, comma-separated)");
    want.insert(item);
  }
  if (want.empty()) throw std::invalid_argument("--cases: no set given");
  std::vector<Case> cases;
  const bool all = want.count("all") > 0;
  if (all || want.count("quantize")) add_quantize_cases(cases);
  if (all || want.count("gemm")) add_gemm_cases(cases);
  if (all || want.count("mma")) add_mma_cases(cases);
  return cases;
}

}  // namespace fp4sim::cli::golden
