// Subcommands of the fp4sim CLI. Each registers its options on the app and runs when chosen.
#pragma once

#include <CLI/CLI.hpp>

namespace fp4sim::cli {

void register_quantize(CLI::App& app);
void register_make_tensor(CLI::App& app);
void register_info(CLI::App& app);
void register_convert(CLI::App& app);
void register_gemm(CLI::App& app);
void register_probe(CLI::App& app);
void register_data(CLI::App& app);
void register_config(CLI::App& app);
void register_train(CLI::App& app);
void register_golden(CLI::App& app);
void register_eval_sample(CLI::App& app);
void register_ns_error(CLI::App& app);
void register_qadamw_error(CLI::App& app);

}  // namespace fp4sim::cli
