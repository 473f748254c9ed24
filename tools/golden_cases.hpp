// A golden pack's cases (tools/golden_cases.cpp), as tools/cmd_golden.cpp writes them.
#pragma once

#include <cstddef>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace fp4sim::cli::golden {

using json = nlohmann::json;

struct OutputFile {
  std::string file, dtype;
  std::vector<size_t> shape;
  bool optional = false;  // an extra layout a kernel may write (checked only where present)
};

// One case as it is written: its folder's files are written by `write` into a staging folder.
struct Case {
  std::string name, op;
  json desc;                      // shapes, dtypes, options
  std::vector<std::string> args;  // the fp4sim command line, paths relative to the case folder
  std::vector<OutputFile> outputs;
  std::vector<std::string> inputs;
  std::function<void(const std::filesystem::path& case_dir)> write;
};

// The cases of `set`: "all", or a comma-separated list of quantize, gemm, mma
// (std::invalid_argument for another name).
std::vector<Case> make_cases(const std::string& set);

}  // namespace fp4sim::cli::golden
