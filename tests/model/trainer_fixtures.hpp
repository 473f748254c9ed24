// What the trainer tests share: the micro run's config, a scratch folder, quiet options.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "model/config.hpp"
#include "model/trainer.hpp"

namespace fp4sim::model {

// The micro run: a 2-layer GPT of width 32 on synthetic tokens, 10 steps, validation (2 batches)
// and checkpoints every 5 steps; `overrides` (key=value, as on the command line) applied.
inline RunConfig micro_run(const std::string& out, const std::vector<std::string>& overrides = {}) {
  nlohmann::json j = {{"model",
                       {{"vocab", 32},
                        {"seq_len", 16},
                        {"max_positions", 16},
                        {"d_model", 32},
                        {"n_layers", 2},
                        {"n_heads", 4},
                        {"n_kv_heads", 4},
                        {"d_ff", 64}}},
                      {"train",
                       {{"batch", 2},
                        {"steps", 10},
                        {"lr", 3e-3},
                        {"warmup", 2},
                        {"data", "synthetic"},
                        {"eval_every", 5},
                        {"eval_batches", 2},
                        {"checkpoint_every", 5},
                        {"out_dir", out}}}};
  return config_from_json(j, overrides);
}

// A fresh scratch folder under the temp directory, removed when the test ends.
struct ScratchDir {
  std::string path;
  explicit ScratchDir(const std::string& name)
      : path((std::filesystem::temp_directory_path() / (name + "_" + std::to_string(::getpid())))
                 .string()) {
    std::filesystem::remove_all(path);
  }
  ~ScratchDir() { std::filesystem::remove_all(path); }
};

inline TrainOptions quiet_options() {
  TrainOptions o;
  o.print = false;
  return o;
}

}  // namespace fp4sim::model
