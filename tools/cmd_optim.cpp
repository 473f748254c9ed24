// fp4sim ns-error: the Newton–Schulz error of each precision on a checkpoint's momentum matrices
// (DESIGN.md §13, Q-Root): ||X_p - X_fp32||_F / ||X_fp32||_F after NS5 of every orthogonalised
// sub-matrix, by shape.
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

#include "model/checkpoint.hpp"
#include "model/config.hpp"
#include "model/gpt.hpp"
#include "model/optimizer.hpp"
#include "tools/backends.hpp"
#include "tools/cli_parse.hpp"
#include "tools/commands.hpp"

namespace fp4sim::cli {
namespace {

using model::NsPrecision;

struct NsErrorArgs {
  std::string checkpoint, backend, json;
  int64_t per_shape = 4;
  double clip = 0.99;
};

double rel_error(const std::vector<float>& x, const std::vector<float>& ref) {
  double d = 0, r = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double e = static_cast<double>(x[i]) - ref[i];
    d += e * e;
    r += static_cast<double>(ref[i]) * ref[i];
  }
  return r > 0 ? std::sqrt(d / r) : 0.0;
}

// One way to run NS5, a column of the table
struct Variant {
  std::string name;
  NsPrecision precision;
  GemmImpl impl;
  double clip;
};

void run_ns_error(const NsErrorArgs& a) {
  auto backend = make_backend(chosen_backend(a.backend));
  Backend& be = *backend;
  const model::Checkpoint ck = model::load_checkpoint(a.checkpoint);
  if (!ck.state.contains("run_config"))
    throw std::runtime_error(a.checkpoint + ": the checkpoint carries no run_config");
  const model::RunConfig c = model::config_from_json(ck.state.at("run_config"), {},
                                                     a.checkpoint + " (state.json run_config)");
  model::Gpt gpt(c.model, be);
  std::vector<Variant> variants = {{"bf16", NsPrecision::BF16, GemmImpl::Exact, 1.0},
                                   {"nvfp4", NsPrecision::NVFP4, GemmImpl::Exact, 1.0}};
  if (a.clip < 1.0)
    variants.push_back(
        {fmt::format("nvfp4 clip {:g}", a.clip), NsPrecision::NVFP4, GemmImpl::Exact, a.clip});
  if (be.device() == Device::Cuda)
    variants.push_back({"nvfp4 cublaslt", NsPrecision::NVFP4, GemmImpl::CublasLt, 1.0});
  // the matrices: Muon's momentum where the checkpoint has it, else AdamW's first moment
  struct Group {
    std::string source;
    std::vector<std::vector<double>> errors;  // per matrix, per variant
    std::vector<std::string> names;
  };
  std::map<std::string, Group> by_shape;  // "768 x 3072 (c_fc)" -> matrices
  const std::vector<model::OrthoTensor> ortho = model::orthogonalised_tensors(gpt);
  size_t done = 0, total = 0;
  for (const model::OrthoTensor& o : ortho) total += o.parts.size();
  for (const model::OrthoTensor& o : ortho) {
    const model::ParamTensor& t = gpt.tensors()[o.tensor];
    std::string source = ".momentum_buffer";
    auto it = ck.optimizer.find(t.name + source);
    if (it == ck.optimizer.end()) {
      source = ".exp_avg";
      it = ck.optimizer.find(t.name + source);
    }
    if (it == ck.optimizer.end())
      throw std::runtime_error(a.checkpoint + ": no optimizer tensor '" + t.name +
                               ".momentum_buffer' or '.exp_avg'");
    if (it->second.dtype != "F32" || it->second.shape != t.shape)
      throw std::runtime_error(a.checkpoint + ": '" + it->first +
                               "' is not F32 of the weight's shape");
    const int64_t C = t.shape[1];
    for (const model::MatrixPart& p : o.parts) {
      ++done;
      const std::string kind = t.name.substr(t.name.find('.', t.name.find('.') + 1) + 1);
      const std::string key =
          fmt::format("{} x {} {}{}", p.rows, C, kind.substr(0, kind.rfind(".weight")),
                      p.name.empty() ? "" : " " + p.name);
      Group& g = by_shape[key];
      if (static_cast<int64_t>(g.errors.size()) >= a.per_shape) continue;
      g.source = source.substr(1);
      std::vector<float> m(static_cast<size_t>(p.rows * C));
      std::memcpy(m.data(), it->second.bytes.data() + static_cast<size_t>(p.row0 * C) * 4,
                  m.size() * 4);
      auto ns_of = [&](const model::NsOptions& opt) {
        BackendBuffer b(be, m.size() * 4);
        be.upload(b.get(), m.data(), m.size() * 4);
        const TensorView v = view_of(b.get(), DType::F32, p.rows, C, be.device(), "momentum");
        model::NewtonSchulz ns(be, std::min(p.rows, C), p.rows * C, opt.precision);
        ns.run(v, v, opt);
        std::vector<float> out(m.size());
        be.download(out.data(), b.get(), out.size() * 4);
        return out;
      };
      const std::vector<float> ref = ns_of(model::NsOptions{});
      std::vector<double> errs;
      for (const Variant& v : variants) {
        model::NsOptions opt;
        opt.precision = v.precision;
        opt.impl = v.impl;
        opt.clip_quantile = v.clip;
        errs.push_back(rel_error(ns_of(opt), ref));
      }
      g.errors.push_back(errs);
      g.names.push_back(t.name + (p.name.empty() ? "" : ":" + p.name));
      std::fprintf(stderr, "ns-error: %zu / %zu %s\n", done, total, g.names.back().c_str());
    }
  }
  // the table: per shape the mean (max) over its matrices, every variant against FP32
  fmt::print("{}: NS5 ||X - X_fp32||_F / ||X_fp32||_F on {} backend, step {}\n", a.checkpoint,
             be.name(), ck.step);
  std::string head = fmt::format("{:<36} {:>3} {:<16}", "matrix (shape, kind)", "n", "source");
  for (const Variant& v : variants) head += fmt::format(" {:>21}", v.name + " mean (max)");
  fmt::print("{}\n", head);
  nlohmann::json out = {{"checkpoint", a.checkpoint},
                        {"step", ck.step},
                        {"backend", be.name()},
                        {"shapes", nlohmann::json::array()}};
  for (const auto& [key, g] : by_shape) {
    std::string line = fmt::format("{:<36} {:>3} {:<16}", key, g.errors.size(), g.source);
    nlohmann::json row = {{"matrix", key}, {"source", g.source}, {"tensors", g.names}};
    for (size_t v = 0; v < variants.size(); ++v) {
      double mean = 0, mx = 0;
      for (const std::vector<double>& e : g.errors) {
        mean += e[v];
        mx = std::max(mx, e[v]);
      }
      mean /= static_cast<double>(g.errors.size());
      line += fmt::format(" {:>10.3e} ({:.3e})", mean, mx);
      row[variants[v].name] = {{"mean", mean}, {"max", mx}};
    }
    out["shapes"].push_back(row);
    fmt::print("{}\n", line);
  }
  if (!a.json.empty()) {
    std::ofstream f(a.json);
    f << out.dump(2) << "\n";
    if (!f) throw std::runtime_error("--json " + a.json + ": cannot write the file");
  }
}

}  // namespace

void register_ns_error(CLI::App& app) {
  auto a = std::make_shared<NsErrorArgs>();
  auto* cmd = app.add_subcommand(
      "ns-error",
      "Newton–Schulz error of BF16 and NVFP4 products (Q-Root) against FP32 on a checkpoint's "
      "momentum matrices");
  cmd->add_option("--checkpoint", a->checkpoint,
                  "A checkpoint directory, or a run's checkpoints directory (its latest); Muon's "
                  "momentum_buffer tensors, else AdamW's exp_avg")
      ->required();
  cmd->add_option("--per-shape", a->per_shape, "Matrices measured per shape and kind")
      ->check(at_least("--per-shape", 1))
      ->capture_default_str();
  cmd->add_option("--clip", a->clip,
                  "optim.ns_clip_quantile of the clipped NVFP4 column (1: no such column)")
      ->check(CLI::Range(0.0, 1.0).description("within (0, 1]"))
      ->capture_default_str();
  cmd->add_option("--json", a->json, "Also write the table as JSON to this file");
  cmd->add_option("--backend", a->backend, kBackendHelp)->check(CLI::IsMember({"emu", "cuda"}));
  cmd->callback([a]() { run_ns_error(*a); });
}

}  // namespace fp4sim::cli
