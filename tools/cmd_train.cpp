// fp4sim train / eval / sample: the training loop (BF16 recipe so far) on either backend.
#include <fmt/core.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <vector>

#include "emu/contract.hpp"
#include "model/checkpoint.hpp"
#include "model/config.hpp"
#include "model/trainer.hpp"
#include "tools/backends.hpp"
#include "tools/cli_parse.hpp"
#include "tools/commands.hpp"
#include "tools/communicators.hpp"

namespace fp4sim::cli {

void register_train(CLI::App& app) {
  struct Args {
    std::string config, backend, resume, dump, memory_limit = "auto";
    std::vector<std::string> overrides;
  };
  auto a = std::make_shared<Args>();
  auto* cmd = app.add_subcommand(
      "train", "Train the configured transformer (recipe.name: bf16, fp8, nvfp4, mxfp4)");
  cmd->add_option("--config", a->config, "configs/tiny.json, configs/small.json, ... or your own")
      ->required();
  cmd->add_option("overrides", a->overrides, "key=value ... (see fp4sim config)");
  cmd->add_option("--backend", a->backend, kBackendHelp)->check(CLI::IsMember({"emu", "cuda"}));
  cmd->add_option(
      "--resume", a->resume,
      "A checkpoint directory, or a run's checkpoints directory or out_dir (its latest)");
  cmd->add_option("--dump", a->dump,
                  "Folder for outside checks: initial weights, step-0 loss and gradients, "
                  "the first 10 batches (validation/torch_gpt_check.py reads them)");
  cmd->add_option("--memory-limit", a->memory_limit,
                  "The memory the run's plan must fit in: auto (the device's free memory on cuda, "
                  "host memory available on emu: the cgroup limit or MemAvailable), none (no "
                  "check), or BYTES (suffixes K, M, G, T)")
      ->capture_default_str();
  cmd->callback([a]() {
    const model::RunConfig c = model::load_config(a->config, a->overrides);
    const model::MemoryLimitSetting limit = model::parse_memory_limit(a->memory_limit);
    // data parallel ranks (mpirun, or FP4SIM_WORLD_SIZE/FP4SIM_RANK/FP4SIM_BOOTSTRAP): started
    // before the backend (a CUDA rank's GPU is its local rank), connected on it
    const Launch launch = detect_launch();
    const std::string backend_name = chosen_backend(a->backend);
    const bool rank0 = launch.rank == 0;
    model::Communicator* comm = nullptr;
    std::unique_ptr<DataParallelLaunch> ranks;
    std::unique_ptr<Backend> backend;
    model::TrainResult r;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      ranks = std::make_unique<DataParallelLaunch>(launch, backend_name);
      backend = make_backend(backend_name);
      comm = ranks->communicator(*backend);
      if (rank0) {
        fmt::print("fp4sim train  (backend {}{}, contract_version {})\n{}\nparameters: {:.3f} M\n",
                   backend->name(), a->backend.empty() ? " by default" : "", kContractVersion,
                   model::to_json(c).dump(2), model::parameter_count(c.model) / 1e6);
        if (comm)
          fmt::print(
              "data parallel: {} ranks through {} ({}), train.grad_reduce={}, "
              "train.grad_comm={}; {} micro-batches of {} x {} a step\n",
              comm->size(), comm->name(), launch.source, name_of(c.train.grad_reduce),
              name_of(c.train.grad_comm), comm->size() * c.train.grad_accum, c.train.batch,
              c.model.seq_len);
      }
      model::TrainOptions opt;
      opt.resume = a->resume;
      opt.dump_dir = a->dump;
      opt.memory_limit = limit;
      opt.comm = comm;
      if (comm) {  // the ranks' executables must be the same build: their bytes' SHA-256
        std::ifstream exe("/proc/self/exe", std::ios::binary);
        const std::string bytes((std::istreambuf_iterator<char>(exe)), {});
        opt.build_id = bytes.empty() ? "unknown" : model::sha256_hex(bytes.data(), bytes.size());
        // (test hook, docs/cli.md: ranks that pretend to be other builds)
        if (const char* id = std::getenv("FP4SIM_TEST_BUILD_ID")) opt.build_id = id;
      }
      r = model::train(c, opt, *backend);
    } catch (const model::CollectiveError& e) {
      // every rank has it: rank 0 says it, then the ranks leave together (a rank leaving first
      // can have mpirun end rank 0 before its message is out)
      if (rank0) {
        std::fflush(stdout);
        std::fprintf(stderr, "fp4sim: error: %s\n", e.what());
        std::fflush(stderr);
      }
      const char here = 1;
      std::vector<char> all(static_cast<size_t>(comm->size()));
      comm->all_gather_host(&here, all.data(), 1);
      throw ReportedError();
    } catch (const std::exception& e) {
      if (launch.kind == Launch::Kind::Single) throw;
      // one rank's failure (at start or later): said with its rank, and the other ranks ended
      // (MPI_Abort: none waits in a collective for this one, and this one does not wait in
      // MPI_Finalize for them)
      std::fflush(stdout);
      std::fprintf(stderr, "fp4sim: error: rank %d: %s\n", launch.rank, e.what());
      std::fflush(stderr);
      abort_other_ranks(1);  // (MPI_Abort: does not return where MPI runs)
      // the file bootstrap has no MPI to end the others: leave at once rather than wait in
      // NCCL's teardown for peers that wait for this rank (they stay until the job is killed)
      if (launch.kind == Launch::Kind::Env) std::_Exit(1);
      throw ReportedError();
    }
    if (!rank0) return;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!r.steps.empty()) {
      const double tokens =
          static_cast<double>(r.steps.size()) * static_cast<double>(c.train.batch) *
          static_cast<double>(c.model.seq_len) * static_cast<double>(c.train.grad_accum) *
          static_cast<double>(comm ? comm->size() : 1);
      fmt::print(
          "done: loss {:.4f} -> {:.4f} over {} steps in {:.1f} s ({:.0f} tokens/s overall, "
          "validation and "
          "checkpoints included); log {}/log.jsonl\n",
          r.steps.front().loss, r.steps.back().loss, r.steps.size(), s, tokens / s,
          c.train.out_dir);
    }
  });
}

}  // namespace fp4sim::cli

namespace fp4sim::cli {

void register_eval_sample(CLI::App& app) {
  struct EvalArgs {
    std::string checkpoint, data, backend;
    int64_t batches = 16;
    bool all = false;
  };
  auto e = std::make_shared<EvalArgs>();
  auto* ev = app.add_subcommand("eval", "Validation loss and bits per byte of a checkpoint");
  ev->add_option("--checkpoint", e->checkpoint,
                 "A checkpoint directory, or a run's checkpoints directory or out_dir (its latest)")
      ->required();
  ev->add_option("--data", e->data, "Token files prefix (default: the run's train.data)");
  auto* batches_opt = ev->add_option("--batches", e->batches, "Validation batches")
                          ->check(at_least("--batches", 1))
                          ->capture_default_str();
  ev->add_flag("--all", e->all, "Every full batch of the validation split, once")
      ->excludes(batches_opt);
  ev->add_option("--backend", e->backend, kBackendHelp)->check(CLI::IsMember({"emu", "cuda"}));
  ev->callback([e]() {
    auto backend = make_backend(chosen_backend(e->backend));
    model::LoadedModel m = model::load_trained(e->checkpoint, *backend);
    if (!e->data.empty()) m.config.train.data = e->data;
    int64_t used = 0;
    // progress on stderr for long evaluations: a line every tenth of the batches
    const auto progress = [](int64_t done, int64_t total) {
      if (total >= 20 && (done * 10 / total != (done - 1) * 10 / total || done == total))
        std::fprintf(stderr, "eval: %lld / %lld batches\n", static_cast<long long>(done),
                     static_cast<long long>(total));
    };
    const float loss =
        model::evaluate(m.config, m.params, e->all ? model::kAllValidationBatches : e->batches,
                        *backend, &used, progress);
    fmt::print("{}: val loss {:.4f} nats/token over {} batches of {} x {}", e->checkpoint, loss,
               used, m.config.train.batch, m.config.model.seq_len);
    if (m.config.model.vocab == 256) fmt::print(" = {:.4f} bits per byte", loss / std::log(2.0));
    fmt::print("\n");
  });

  struct SampleArgs {
    std::string checkpoint, prompt, backend;
    int64_t tokens = 200;
    float temperature = 0.8f;
    uint64_t seed = 1;
  };
  auto s = std::make_shared<SampleArgs>();
  auto* sm = app.add_subcommand("sample", "Generate text from a checkpoint (byte-level models)");
  sm->add_option("--checkpoint", s->checkpoint,
                 "A checkpoint directory, or a run's checkpoints directory or out_dir (its latest)")
      ->required();
  sm->add_option("--prompt", s->prompt, "Text to continue");
  sm->add_option("--tokens", s->tokens, "Tokens to generate")
      ->check(at_least("--tokens", 0))
      ->capture_default_str();
  sm->add_option("--temperature", s->temperature, "0 = greedy")
      ->check(finite_non_negative("--temperature"))
      ->capture_default_str();
  sm->add_option("--seed", s->seed, "Sampling seed")->capture_default_str();
  sm->add_option("--backend", s->backend, kBackendHelp)->check(CLI::IsMember({"emu", "cuda"}));
  sm->callback([s]() {
    auto backend = make_backend(chosen_backend(s->backend));
    const model::LoadedModel m = model::load_trained(s->checkpoint, *backend);
    if (m.config.model.vocab != 256)
      throw std::invalid_argument(
          "sample: only byte-level (vocab 256) models can be turned back into text");
    std::vector<int32_t> prompt;
    for (unsigned char ch : s->prompt) prompt.push_back(ch);
    const std::vector<int32_t> out =
        model::sample_tokens(m, prompt, s->tokens, s->temperature, s->seed, *backend);
    std::string text = s->prompt;
    for (int32_t t : out) text += static_cast<char>(t);
    fmt::print("{}\n", text);
  });
}

}  // namespace fp4sim::cli
