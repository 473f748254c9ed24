// fp4sim qadamw-error: how well Q-AdamW's NVFP4 state (DESIGN.md §13, emu/qadamw.hpp) keeps a
// checkpoint's real AdamW moments, against naive NVFP4 of the same moments. Host arithmetic, the
// emulator's functions: the pipeline's encode and decode of every tile, then the errors.
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "emu/qadamw.hpp"
#include "emu/quantize_block.hpp"
#include "model/checkpoint.hpp"
#include "model/config.hpp"
#include "model/gpt.hpp"
#include "tools/cli_parse.hpp"
#include "tools/commands.hpp"

namespace fp4sim::cli {
namespace {

struct QAdamWErrorArgs {
  std::string checkpoint, json;
  int64_t v_tile = 16;
  uint64_t seed = 0;
};

// Sums over the elements of one or more tensors.
struct Sums {
  double n = 0;                   // elements
  double v2 = 0, vp = 0, vn = 0;  // ||v||², ||v̂_pipe − v||², ||v̂_naive − v||²
  double m2 = 0, mp = 0, mn = 0;  // the same for m
  double d2 = 0, dpv = 0, dnv = 0, dpb = 0, dnb = 0;  // the update direction: v̂ only, both
  double zero_p = 0, zero_n = 0;                      // v̂ = 0 where v > 0
  double vf = 0, dfv = 0, dfb = 0, zero_f = 0;        // the pipeline with v̂ floored (tile_min)
  double blocks = 0, uf_vp = 0, uf_vn = 0, uf_mp = 0, uf_mn = 0;  // scales underflowed to 0
  void add(const Sums& o) {
    double* a = &n;
    const double* b = &o.n;
    for (size_t i = 0; i < sizeof(Sums) / sizeof(double); ++i) a[i] += b[i];
  }
};

// Naive NVFP4 of x (RN, 1x16, standard §5, one amax over the tensor): decoded values, and the
// count of blocks whose scale underflowed (amax_b > 0, scale 0).
std::vector<float> naive_nvfp4(const std::vector<float>& x, double* underflows) {
  float amax = 0.0f;
  for (float e : x) amax = fmax_nan_ignored(amax, f32_abs(e));
  const Nvfp4Global g = nvfp4_global(amax, false);
  std::vector<float> out(x.size());
  for (size_t b = 0; b < x.size() / 16; ++b) {
    uint8_t packed[8];
    const uint8_t s = nvfp4_quantize_1x16(x.data() + 16 * b, g, false, false,
                                          sr_bits_for_chunk(false, 0, 0, 0), packed);
    if (s == 0 && amax_strided(x.data() + 16 * b, 16, 1) > 0.0f) ++*underflows;
    qadamw_decode16(packed, s, amax, kNvfp4Range, out.data() + 16 * b);
  }
  return out;
}

// Q-AdamW's encode then decode of m and v (tile T, SR stream 0 under `seed`); v_hat_floor: v̂
// with optim.v_floor = tile_min.
void pipeline(const std::vector<float>& m, const std::vector<float>& v, int64_t T, uint64_t seed,
              std::vector<float>& m_hat, std::vector<float>& v_hat, std::vector<float>& v_hat_floor,
              Sums& s) {
  const size_t n = m.size();
  std::vector<float> ym(n), yv(n);
  std::vector<uint16_t> mean(n / T), floor(n / T);
  for (size_t k = 0; k < n / T; ++k) {
    float sum = 0.0f, v_min = f32_from_bits(0x7F800000u);
    for (int64_t i = 0; i < T; ++i) {
      sum = fadd_rn(sum, fsqrt_rn(v[k * T + i]));
      if (v[k * T + i] > 0.0f && v[k * T + i] < v_min) v_min = v[k * T + i];
    }
    mean[k] = qadamw_tile_mean(sum, static_cast<int>(T));
    floor[k] = qadamw_floor_bits(v_min);
  }
  float am = 0.0f, av = 0.0f;
  for (size_t b = 0; b < n / 16; ++b) {
    qadamw_m_transformed(m.data() + 16 * b, ym.data() + 16 * b);
    qadamw_v_transformed(v.data() + 16 * b, bf16_to_f32(mean[16 * b / T]), yv.data() + 16 * b);
    am = fmax_nan_ignored(am, amax_strided(ym.data() + 16 * b, 16, 1));
    av = fmax_nan_ignored(av, amax_strided(yv.data() + 16 * b, 16, 1));
  }
  const Nvfp4Global gm = nvfp4_global(am, true), gv = nvfp4_global(av, false);
  m_hat.resize(n);
  v_hat.resize(n);
  v_hat_floor.resize(n);
  for (size_t b = 0; b < n / 16; ++b) {
    uint8_t pm[8], pv[8];
    const uint8_t sm =
        qadamw_encode_m(ym.data() + 16 * b, gm, sr_bits_for_chunk(true, seed, 0, b), pm);
    const uint8_t sv = qadamw_encode_v(yv.data() + 16 * b, gv, pv);
    if (sm == 0 && amax_strided(ym.data() + 16 * b, 16, 1) > 0.0f) ++s.uf_mp;
    if (sv == 0 && amax_strided(yv.data() + 16 * b, 16, 1) > 0.0f) ++s.uf_vp;
    qadamw_decode_m(pm, sm, am, m_hat.data() + 16 * b);
    qadamw_decode_v(pv, sv, av, bf16_to_f32(mean[16 * b / T]), 0.0f, v_hat.data() + 16 * b);
    qadamw_decode_v(pv, sv, av, bf16_to_f32(mean[16 * b / T]), bf16_to_f32(floor[16 * b / T]),
                    v_hat_floor.data() + 16 * b);
  }
}

Sums measure(const std::vector<float>& m, const std::vector<float>& v, int64_t T, uint64_t seed,
             double bc1, double bc2, double eps) {
  Sums s;
  std::vector<float> mp, vp, vf;
  pipeline(m, v, T, seed, mp, vp, vf, s);
  const std::vector<float> mn = naive_nvfp4(m, &s.uf_mn), vn = naive_nvfp4(v, &s.uf_vn);
  auto dir = [&](double mm, double vv) { return (mm / bc1) / (std::sqrt(vv / bc2) + eps); };
  s.n = static_cast<double>(m.size());
  s.blocks = static_cast<double>(m.size() / 16);
  for (size_t i = 0; i < m.size(); ++i) {
    const double d = dir(m[i], v[i]);
    auto sq = [](double x) { return x * x; };
    s.v2 += sq(v[i]);
    s.vp += sq(vp[i] - static_cast<double>(v[i]));
    s.vn += sq(vn[i] - static_cast<double>(v[i]));
    s.m2 += sq(m[i]);
    s.mp += sq(mp[i] - static_cast<double>(m[i]));
    s.mn += sq(mn[i] - static_cast<double>(m[i]));
    s.d2 += sq(d);
    s.dpv += sq(dir(m[i], vp[i]) - d);
    s.dnv += sq(dir(m[i], vn[i]) - d);
    s.dpb += sq(dir(mp[i], vp[i]) - d);
    s.dnb += sq(dir(mn[i], vn[i]) - d);
    s.zero_p += vp[i] == 0.0f && v[i] > 0.0f;
    s.vf += sq(vf[i] - static_cast<double>(v[i]));
    s.dfv += sq(dir(m[i], vf[i]) - d);
    s.dfb += sq(dir(mp[i], vf[i]) - d);
    s.zero_f += vf[i] == 0.0f && v[i] > 0.0f;
    s.zero_n += vn[i] == 0.0f && v[i] > 0.0f;
  }
  return s;
}

std::vector<float> f32_of(const model::StoredTensor& t) {
  std::vector<float> x(t.bytes.size() / 4);
  std::memcpy(x.data(), t.bytes.data(), x.size() * 4);
  return x;
}

nlohmann::json row_json(const Sums& s) {
  auto r = [](double a, double b) { return b > 0 ? std::sqrt(a / b) : 0.0; };
  return {{"elements", s.n},
          {"v_error_pipeline", r(s.vp, s.v2)},
          {"v_error_naive", r(s.vn, s.v2)},
          {"m_error_pipeline", r(s.mp, s.m2)},
          {"m_error_naive", r(s.mn, s.m2)},
          {"direction_error_v_pipeline", r(s.dpv, s.d2)},
          {"direction_error_v_naive", r(s.dnv, s.d2)},
          {"direction_error_both_pipeline", r(s.dpb, s.d2)},
          {"direction_error_both_naive", r(s.dnb, s.d2)},
          {"v_hat_zero_pipeline", s.zero_p},
          {"v_error_pipeline_floor", r(s.vf, s.v2)},
          {"direction_error_v_pipeline_floor", r(s.dfv, s.d2)},
          {"direction_error_both_pipeline_floor", r(s.dfb, s.d2)},
          {"v_hat_zero_pipeline_floor", s.zero_f},
          {"v_hat_zero_naive", s.zero_n},
          {"blocks", s.blocks},
          {"scale_underflow_v_pipeline", s.uf_vp},
          {"scale_underflow_v_naive", s.uf_vn},
          {"scale_underflow_m_pipeline", s.uf_mp},
          {"scale_underflow_m_naive", s.uf_mn}};
}

void run_qadamw_error(const QAdamWErrorArgs& a) {
  const model::Checkpoint ck = model::load_checkpoint(a.checkpoint);
  if (!ck.state.contains("run_config"))
    throw std::runtime_error(a.checkpoint + ": the checkpoint carries no run_config");
  const model::RunConfig c = model::config_from_json(ck.state.at("run_config"), {},
                                                     a.checkpoint + " (state.json run_config)");
  if (c.optim.state != model::OptimState::FP32)
    throw std::runtime_error(a.checkpoint +
                             " stores AdamW's state as optim.state=" + name_of(c.optim.state) +
                             "; qadamw-error measures float32 state (a run with optim.state=fp32)");
  const double t = static_cast<double>(std::max<int64_t>(ck.step, 1));
  const double bc1 = 1.0 - std::pow(c.train.beta1, t), bc2 = 1.0 - std::pow(c.train.beta2, t);
  const std::unique_ptr<Backend> host = make_cpu_backend();
  const model::Gpt gpt(c.model, *host);
  std::map<std::string, Sums> by_kind;
  Sums total;
  size_t skipped = 0, done = 0;
  const std::vector<model::ParamTensor>& ts = gpt.tensors();
  for (const model::ParamTensor& p : ts) {
    ++done;
    const auto im = ck.optimizer.find(p.name + ".exp_avg");
    const auto iv = ck.optimizer.find(p.name + ".exp_avg_sq");
    if (im == ck.optimizer.end() || iv == ck.optimizer.end()) continue;  // (Muon's weights)
    if (im->second.dtype != "F32" || iv->second.dtype != "F32")
      throw std::runtime_error(a.checkpoint + ": '" + im->first + "' or '" + iv->first +
                               "' is not F32");
    const int64_t cols = p.shape.empty() ? 1 : p.shape.back();
    if (cols % a.v_tile != 0) {
      ++skipped;
      continue;
    }
    const Sums s =
        measure(f32_of(im->second), f32_of(iv->second), a.v_tile, a.seed, bc1, bc2, c.train.eps);
    // the kind: the name without its block number ("h.3.attn.c_attn.weight" ->
    // "attn.c_attn.weight")
    std::string kind = p.name;
    if (kind.rfind("h.", 0) == 0) kind = kind.substr(kind.find('.', 2) + 1);
    by_kind[kind].add(s);
    total.add(s);
    std::fprintf(stderr, "qadamw-error: %zu / %zu %s\n", done, ts.size(), p.name.c_str());
  }
  fmt::print(
      "{}: step {}, Q-AdamW (v_tile {}) against naive NVFP4, relative L2 errors; direction = "
      "m/(sqrt(v)+eps) bias-corrected, 'v' with v quantized only, 'both' with m too; 'floor': "
      "the pipeline with optim.v_floor=tile_min (v quantized only)\n",
      a.checkpoint, ck.step, a.v_tile);
  fmt::print("{:<24} {:>10} {:>17} {:>17} {:>17} {:>17} {:>15} {:>19} {:>8} {:>9} {:>9}\n",
             "tensor kind", "elements", "v pipe / naive", "m pipe / naive", "dir v pipe/naive",
             "dir both p/n", "v̂=0 (v>0) p/n", "v scale uf p/n", "v floor", "dir floor", "v̂=0 fl");
  nlohmann::json out = {{"checkpoint", a.checkpoint},
                        {"step", ck.step},
                        {"v_tile", a.v_tile},
                        {"kinds", nlohmann::json::object()}};
  auto line = [&](const std::string& name, const Sums& s) {
    auto r = [](double x, double y) { return y > 0 ? std::sqrt(x / y) : 0.0; };
    fmt::print(
        "{:<24} {:>10.0f} {:>8.4f}/{:<8.4f} {:>8.4f}/{:<8.4f} {:>8.4f}/{:<8.4f} "
        "{:>8.4f}/{:<8.4f} {:>7.0f}/{:<7.0f} {:>9.0f}/{:<9.0f} {:>8.4f} {:>9.4f} {:>9.0f}\n",
        name, s.n, r(s.vp, s.v2), r(s.vn, s.v2), r(s.mp, s.m2), r(s.mn, s.m2), r(s.dpv, s.d2),
        r(s.dnv, s.d2), r(s.dpb, s.d2), r(s.dnb, s.d2), s.zero_p, s.zero_n, s.uf_vp, s.uf_vn,
        r(s.vf, s.v2), r(s.dfv, s.d2), s.zero_f);
  };
  for (const auto& [k, s] : by_kind) {
    line(k, s);
    out["kinds"][k] = row_json(s);
  }
  line("all", total);
  out["all"] = row_json(total);
  fmt::print("m scale underflows (pipeline / naive): {:.0f} / {:.0f} of {:.0f} blocks\n",
             total.uf_mp, total.uf_mn, total.blocks);
  if (skipped)
    fmt::print(
        "{} tensors skipped: their rows are not whole tiles of {} (they keep float32 "
        "state)\n",
        skipped, a.v_tile);
  if (!a.json.empty()) {
    std::ofstream f(a.json);
    f << out.dump(2) << "\n";
    if (!f) throw std::runtime_error("--json " + a.json + ": cannot write the file");
  }
}

}  // namespace

void register_qadamw_error(CLI::App& app) {
  auto a = std::make_shared<QAdamWErrorArgs>();
  auto* cmd = app.add_subcommand(
      "qadamw-error",
      "Q-AdamW's NVFP4 state against naive NVFP4 on a checkpoint's AdamW moments: the errors of "
      "v, m and the update direction, zeroed v and underflowed scales");
  cmd->add_option("--checkpoint", a->checkpoint,
                  "A checkpoint directory, or a run's checkpoints directory (its latest), of a "
                  "run with float32 AdamW state")
      ->required();
  cmd->add_option("--v-tile", a->v_tile, "optim.v_tile: elements per mean of sqrt(v)")
      ->check(at_least("--v-tile", 16))
      ->capture_default_str();
  cmd->add_option("--seed", a->seed, "Philox seed of m's stochastic rounding")
      ->capture_default_str();
  cmd->add_option("--json", a->json, "Also write the table as JSON to this file");
  cmd->callback([a]() {
    if (a->v_tile % 16 != 0)
      throw CLI::ValidationError(
          "--v-tile", std::to_string(a->v_tile) + " is not a multiple of 16 (the NVFP4 block)");
    run_qadamw_error(*a);
  });
}

}  // namespace fp4sim::cli
