// The optimizer step's time and state (DESIGN.md §13): AdamW and Muon with Newton–Schulz products
// in FP32, BF16 and NVFP4 (exact GEMMs, and cuBLASLt on CUDA) on a preset's parameters (default
// gpt2-124m), random gradients, on the CUDA backend (or the emulator). Each run times --steps
// optimizer steps after one warm-up step (the backend synchronised around each); the variants run
// one after the other --runs times and the table shows each one's median over the runs of its
// median step, its ratio to AdamW's, and the bytes of its state and scratch (Optimizer's buffers).
// usage: bench_optim [--config configs/gpt2-124m.json] [--backend cuda|emu] [--runs 3]
//                    [--steps 5] [--only NAME]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/config.hpp"
#include "model/gpt.hpp"
#include "model/optimizer.hpp"
#include "tools/backends.hpp"

using namespace fp4sim;
using namespace fp4sim::model;

namespace {

struct Variant {
  const char* name;
  std::vector<std::string> overrides;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string config = "configs/gpt2-124m.json", backend_name = default_backend_name(), only;
  int runs = 3, steps = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--config")
      config = next();
    else if (a == "--backend")
      backend_name = next();
    else if (a == "--runs")
      runs = std::stoi(next());
    else if (a == "--steps")
      steps = std::stoi(next());
    else if (a == "--only")
      only = next();
    else {
      std::fprintf(stderr, "bench_optim: unknown argument '%s'\n", a.c_str());
      return 2;
    }
  }
  if (runs < 1 || steps < 1) {
    std::fprintf(stderr, "bench_optim: --runs and --steps must be >= 1\n");
    return 2;
  }
  try {
    auto be = make_backend(backend_name);
    std::vector<Variant> variants = {
        {"adamw", {}},
        {"adamw bf16 state", {"optim.state=bf16"}},
        {"q-adamw", {"optim.state=nvfp4"}},
        {"muon fp32", {"optim.name=muon"}},
        {"muon bf16", {"optim.name=muon", "optim.ns_precision=bf16"}},
        {"muon nvfp4 exact", {"optim.name=muon", "optim.ns_precision=nvfp4"}}};
    if (be->device() == Device::Cuda)
      variants.push_back({"muon nvfp4 cublaslt",
                          {"optim.name=muon", "optim.ns_precision=nvfp4", "recipe.gemm=cublaslt"}});
    if (!only.empty())
      variants.erase(std::remove_if(variants.begin(), variants.end(),
                                    [&](const Variant& v) { return only != v.name; }),
                     variants.end());
    std::map<std::string, std::vector<double>> ms;
    std::map<std::string, int64_t> peak;
    for (int r = 0; r < runs; ++r)
      for (const Variant& v : variants) {
        std::vector<std::string> o = v.overrides;
        o.push_back("train.data=synthetic");
        const RunConfig c = load_config(config, o);
        Gpt model(c.model, *be);
        model.init(c.train.seed);
        const size_t n = model.num_params();
        std::vector<float> g(n);
        std::mt19937_64 rng(7);
        std::normal_distribution<float> d(0.0f, 1e-3f);
        for (float& x : g) x = d(rng);
        be->upload(model.grads(), g.data(), n * 4);
        Optimizer opt(c, model);
        std::vector<double> t;
        for (int s = 0; s <= steps; ++s) {
          be->synchronize();
          const auto t0 = std::chrono::steady_clock::now();
          opt.step(c.train.lr, s + 1, 1.0f);
          be->synchronize();
          const double e =
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                  .count();
          if (s > 0) t.push_back(e);  // (step 0 warms up: plans, scratch)
        }
        ms[v.name].push_back(median(t));
        peak[v.name] = static_cast<int64_t>(opt.state_bytes() + opt.scratch_bytes());
        std::fprintf(stderr, "bench_optim: run %d %s %.2f ms\n", r + 1, v.name, median(t));
      }
    std::printf("optimizer step on %s (%s backend), median of %d runs of the median of %d steps\n",
                config.c_str(), be->name().c_str(), runs, steps);
    std::printf("%-22s %10s %8s %16s\n", "optimizer", "ms/step", "vs adamw", "state+scratch MiB");
    const double base = ms.count("adamw") ? median(ms["adamw"]) : 0.0;
    for (const Variant& v : variants) {
      const double m = median(ms[v.name]);
      std::printf("%-22s %10.3f %8s %16.1f\n", v.name, m,
                  base > 0 ? (std::to_string(m / base).substr(0, 5) + "x").c_str() : "-",
                  static_cast<double>(peak[v.name]) / (1 << 20));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_optim: %s\n", e.what());
    return 1;
  }
  return 0;
}
