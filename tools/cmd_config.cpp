// fp4sim config: resolve a run configuration (file + key=value overrides) and print it, exactly as
// the trainer will see it, with the model's parameter count. Errors name the key.
#include <fmt/core.h>

#include "model/config.hpp"
#include "tools/commands.hpp"

namespace fp4sim::cli {

void register_config(CLI::App& app) {
  auto file = std::make_shared<std::string>();
  auto overrides = std::make_shared<std::vector<std::string>>();
  auto* cmd = app.add_subcommand("config",
                                 "Resolve and print a run configuration (configs/*.json + "
                                 "key=value overrides); lists the valid keys on a typo");
  cmd->add_option("--config", *file,
                  "Config file (configs/tiny.json, configs/small.json, "
                  "configs/gpt2-124m.json, or your own)")
      ->required();
  cmd->add_option("overrides", *overrides, "key=value ... (e.g. model.d_model=256 train.lr=1e-3)");
  cmd->callback([file, overrides]() {
    const model::RunConfig c = model::load_config(*file, *overrides);
    fmt::print("{}\n", model::to_json(c).dump(2));
    fmt::print("parameters: {:.3f} M\n", model::parameter_count(c.model) / 1e6);
  });
}

}  // namespace fp4sim::cli
