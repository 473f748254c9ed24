// fp4sim train: the training loop (first version: the emulator backend, BF16 recipe).
#include <fmt/core.h>

#include "model/config.hpp"
#include "model/trainer.hpp"
#include "tools/backends.hpp"
#include "tools/commands.hpp"

namespace fp4sim::cli {

void register_train(CLI::App& app) {
  struct Args {
    std::string config, backend = "emu", resume;
    std::vector<std::string> overrides;
  };
  auto a = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("train", "Train the configured transformer (emulator backend; BF16 so far)");
  cmd->add_option("--config", a->config, "configs/tiny.json, configs/small.json, ... or your own")->required();
  cmd->add_option("overrides", a->overrides, "key=value ... (see fp4sim config)");
  cmd->add_option("--backend", a->backend, "emu (cuda: not wired into the model yet)")
      ->check(CLI::IsMember({"emu", "cuda"}));
  cmd->add_option("--resume", a->resume, "A checkpoint directory, or a run's checkpoints directory (latest)");
  cmd->callback([a]() {
    const model::RunConfig c = model::load_config(a->config, a->overrides);
    if (a->backend != "emu")
      throw std::invalid_argument("--backend " + a->backend +
                                  ": the model runs on the emulator only so far (issue 4 in progress); use --backend emu");
    if (c.recipe.name != "bf16")
      throw std::invalid_argument("recipe.name " + c.recipe.name + ": only bf16 is wired into training so far (issue 5)");
    fmt::print("fp4sim train  (backend emu, contract_version 1)\n{}\nparameters: {:.3f} M\n",
               model::to_json(c).dump(2), model::parameter_count(c.model) / 1e6);
    model::TrainOptions opt;
    opt.resume = a->resume;
    const model::TrainResult r = model::train(c, opt);
    if (!r.steps.empty())
      fmt::print("done: loss {:.4f} -> {:.4f} over {} steps; log {}/log.jsonl\n", r.steps.front().loss,
                 r.steps.back().loss, r.steps.size(), c.train.out_dir);
  });
}

}  // namespace fp4sim::cli
