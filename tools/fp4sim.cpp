// fp4sim: emulation-first simulator of NVFP4 LLM pretraining. See README.md for every command.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "model/communicator.hpp"
#include "tools/commands.hpp"
#include "tools/communicators.hpp"

int main(int argc, char** argv) {
  CLI::App app{"fp4sim: bit-exact NVFP4/MXFP4 emulation (CPU golden reference + CUDA backend)"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Print help for every subcommand");
  fp4sim::cli::register_quantize(app);
  fp4sim::cli::register_make_tensor(app);
  fp4sim::cli::register_convert(app);
  fp4sim::cli::register_gemm(app);
  fp4sim::cli::register_probe(app);
  fp4sim::cli::register_data(app);
  fp4sim::cli::register_config(app);
  fp4sim::cli::register_train(app);
  fp4sim::cli::register_eval_sample(app);
  fp4sim::cli::register_ns_error(app);
  fp4sim::cli::register_qadamw_error(app);
  fp4sim::cli::register_golden(app);
  fp4sim::cli::register_info(app);
  // an unknown first word is a mistyped command: say so, rather than CLI11's "a subcommand is
  // required"
  if (argc > 1 && argv[1][0] != '-') {
    bool known = false;
    std::string names;
    for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
      known = known || sub->check_name(argv[1]);
      names += (names.empty() ? "" : ", ") + sub->get_name();
    }
    if (!known) {
      std::fprintf(stderr, "fp4sim: error: unknown command '%s'; the commands are: %s\n", argv[1],
                   names.c_str());
      return 109;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const fp4sim::ReportedError&) {  // (printed where it happened)
    return 1;
  } catch (const fp4sim::model::CollectiveError& e) {  // every rank has it: rank 0 says it
    std::fflush(stdout);
    if (fp4sim::process_rank() == 0) std::fprintf(stderr, "fp4sim: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "fp4sim: error: %s\n", e.what());
    return 1;
  }
  // what was printed reached its file (stdout on a full disk, say): else an error, not exit 0
  errno = 0;
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    std::fprintf(stderr, "fp4sim: error: standard output: write failed (%s)\n",
                 errno ? std::strerror(errno) : "an earlier write failed");
    return 1;
  }
  return 0;
}
