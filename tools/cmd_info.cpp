// fp4sim info: what this build is and which GPU it sees.
#include <fmt/core.h>
#include <omp.h>

#include <CLI/Version.hpp>
#include <nlohmann/json.hpp>

#include "emu/contract.hpp"
#include "model/lora_svd.hpp"
#include "tools/backends.hpp"
#include "tools/commands.hpp"
#include "tools/communicators.hpp"

#ifndef FP4SIM_VERSION
#define FP4SIM_VERSION "0.1.0"
#endif

namespace fp4sim::cli {

void register_info(CLI::App& app) {
  auto* cmd = app.add_subcommand("info",
                                 "Print the build (backends, CUDA archs, library versions, "
                                 "contract_version) and the GPU found");
  cmd->callback([]() {
    fmt::print("fp4sim {}  (contract_version {})\n", FP4SIM_VERSION, kContractVersion);
    fmt::print("backends:        emu{}\n", cuda_backend_built() ? ", cuda" : "");
    fmt::print("default backend: {}\n", default_backend_name());
    if (cuda_backend_built())
      fmt::print("CUDA:            nvcc {}, archs {}, cuBLASLt {}\n", cuda_compiler_version(),
                 cuda_archs(), cublaslt_runtime_version());
    else
      fmt::print("CUDA:            not built (nvcc not found at configure time)\n");
    fmt::print("GPU:             {}\n", gpu_description());
    fmt::print("compiler:        {} {}\n",
#if defined(__clang__)
               "clang", __clang_version__
#elif defined(__GNUC__)
               "g++", __VERSION__
#else
               "unknown", ""
#endif
    );
    fmt::print("OpenMP:          {} (max threads {})\n", _OPENMP, omp_get_max_threads());
    fmt::print("data parallel:   {}\n", data_parallel_description());
    fmt::print("LoRA-SVD:        {}\n", model::lora::lora_svd_available()
                                            ? "LAPACKE + OpenBLAS (one thread)"
                                            : "no LAPACK in this build (liblapacke-dev, "
                                              "libopenblas-dev)");
    fmt::print("libraries:       CLI11 {}, nlohmann_json {}.{}.{}, fmt {}\n", CLI11_VERSION,
               NLOHMANN_JSON_VERSION_MAJOR, NLOHMANN_JSON_VERSION_MINOR,
               NLOHMANN_JSON_VERSION_PATCH, FMT_VERSION);
    fmt::print(
        "fp build:        -ffp-contract=off, no fast-math; device: -fmad=false "
        "-prec-div=true -ftz=false\n");
  });
}

}  // namespace fp4sim::cli
