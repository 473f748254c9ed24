// fp4sim config: resolve a run configuration (file + key=value overrides) and print it, exactly as
// the trainer will see it, with the model's parameter count and the memory plan of `fp4sim train`
// on each backend (model/memory_plan.hpp; made without running anything, so the CUDA plan is made
// without a GPU too). Errors name the key.
#include <fmt/core.h>

#include "model/config.hpp"
#include "model/memory_plan.hpp"
#include "tools/commands.hpp"

namespace fp4sim::cli {

void register_config(CLI::App& app) {
  struct Args {
    std::string file, backend = "both";
    std::vector<std::string> overrides;
    bool resume = false;
    int cc_major = 9;
    int ranks = 1;
  };
  auto a = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("config",
                                 "Resolve and print a run configuration (configs/*.json + "
                                 "key=value overrides) and its memory plan; lists the valid keys "
                                 "on a typo");
  cmd->add_option("--config", a->file,
                  "Config file (configs/tiny.json, configs/small.json, "
                  "configs/gpt2-124m.json, or your own)")
      ->required();
  cmd->add_option("overrides", a->overrides,
                  "key=value ... (e.g. model.d_model=256 train.lr=1e-3)");
  cmd->add_option("--backend", a->backend,
                  "The memory plan of `fp4sim train` on emu, cuda or both (the default)")
      ->check(CLI::IsMember({"emu", "cuda", "both"}))
      ->capture_default_str();
  cmd->add_flag("--resume", a->resume,
                "Plan a resumed run (the checkpoint's tensors are read into host memory)");
  cmd->add_option("--ranks", a->ranks,
                  "Plan rank 0 of a data parallel run of this many ranks (train.zero=1's share of "
                  "the optimizer state, the gradient reducer's buffers)")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cmd->add_option("--cuda-cc", a->cc_major,
                  "The cuda plan's compute capability major (9: Hopper, the H200; 10 and up: "
                  "native FP4 GEMMs)")
      ->check(CLI::Range(7, 20))
      ->capture_default_str();
  cmd->callback([a]() {
    const model::RunConfig c = model::load_config(a->file, a->overrides);
    fmt::print("{}\n", model::to_json(c).dump(2));
    fmt::print("parameters: {:.3f} M\n", model::parameter_count(c.model) / 1e6);
    for (const char* backend : {"emu", "cuda"}) {
      if (a->backend != "both" && a->backend != backend) continue;
      model::PlanRequest req;
      req.backend = backend;
      req.resume = a->resume;
      req.cuda.cc_major = a->cc_major;
      req.ranks = a->ranks;
      req.data_parallel = a->ranks > 1;
      fmt::print("{}", model::plan_training(c, req).describe());
    }
  });
}

}  // namespace fp4sim::cli
