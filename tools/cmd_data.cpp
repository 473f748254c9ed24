// fp4sim data build | show: the token files the trainer reads.
#include <fmt/core.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "emu/contract.hpp"
#include "model/data.hpp"
#include "tools/commands.hpp"
#include "tools/npy.hpp"

namespace fp4sim::cli {
namespace {

struct BuildArgs {
  std::vector<std::string> inputs;
  std::string out;
  int val_every = 20;
};

void run_build(const BuildArgs& a) {
  io::check_output_prefix(a.out, "--out");
  const std::vector<std::string> files = model::collect_text_files(a.inputs);
  io::check_outputs({a.out + ".train.tokens", a.out + ".val.tokens", a.out + ".meta.json"}, files);
  fmt::print("fp4sim data build: {} text files\n", files.size());
  const model::CorpusSplit s = model::build_corpus(files, a.val_every);
  // record the files relative to their input folder, so the meta does not depend on where it ran
  std::vector<std::string> names;
  for (const std::string& f : files) {
    std::string n = f;
    for (const std::string& in : a.inputs)
      if (n.rfind(in, 0) == 0 && n.size() > in.size()) {
        n = n.substr(in.size() + (n[in.size()] == '/' ? 1 : 0));
        break;
      }
    names.push_back(n);
  }
  // the three outputs appear together or not at all (tools/npy.hpp's AtomicOutputs)
  io::AtomicOutputs out;
  model::write_token_file(out.stage(a.out + ".train.tokens"), s.train);
  model::write_token_file(out.stage(a.out + ".val.tokens"), s.val);
  nlohmann::json meta = {{"contract_version", kContractVersion},
                         {"generator", "fp4sim data build"},
                         {"tokenizer", "bytes"},
                         {"vocab", 256},
                         {"documents", s.documents},
                         {"val_documents", s.val_documents},
                         {"val_every", a.val_every},
                         {"split", s.split_documents ? "the last 1/val_every of each file"
                                                     : "every val_every-th file"},
                         {"train_tokens", s.train.tokens.size()},
                         {"val_tokens", s.val.tokens.size()},
                         {"files", names}};
  io::write_text(out.stage(a.out + ".meta.json"), meta.dump(2) + "\n");
  out.commit();
  if (s.split_documents)
    fmt::print(
        "  documents   {} (fewer files than --val-every {}: the last 1/{} of each to validation)\n",
        s.documents, a.val_every, a.val_every);
  else
    fmt::print("  documents   {} ({} to validation: every {}th in sorted path order)\n",
               s.documents, s.val_documents, a.val_every);
  fmt::print("  tokens      train {}   val {}   (byte-level, vocab 256)\n", s.train.tokens.size(),
             s.val.tokens.size());
  fmt::print("  wrote       {0}.train.tokens {0}.val.tokens {0}.meta.json\n", a.out);
}

void run_show(const std::string& path) {
  const model::TokenFile f = model::read_token_file(path);
  fmt::print("{}: {} tokens, vocab {}\n", path, f.tokens.size(), f.vocab);
  std::vector<uint16_t> head(f.tokens.begin(),
                             f.tokens.begin() + std::min<size_t>(f.tokens.size(), 240));
  if (f.vocab == 256) fmt::print("first bytes: {}\n", model::detokenize_bytes(head));
}

}  // namespace

void register_data(CLI::App& app) {
  auto* data = app.add_subcommand("data", "Token files for training");
  data->require_subcommand(1);
  auto b = std::make_shared<BuildArgs>();
  auto* build = data->add_subcommand("build",
                                     "Text files or folders (*.txt, recursively) -> a fixed "
                                     "train/validation split of byte-level tokens");
  build->add_option("inputs", b->inputs, "Text files and/or folders")->required();
  build
      ->add_option("--out", b->out,
                   "Output prefix (writes PREFIX.train.tokens, PREFIX.val.tokens, "
                   "PREFIX.meta.json)")
      ->required();
  build->add_option("--val-every", b->val_every,
                    "Every Nth document goes to validation (default 20)");
  build->callback([b]() { run_build(*b); });
  auto path = std::make_shared<std::string>();
  auto* show = data->add_subcommand("show", "Print a token file's size and first bytes");
  show->add_option("file", *path, "A .tokens file")->required();
  show->callback([path]() { run_show(*path); });
}

}  // namespace fp4sim::cli
