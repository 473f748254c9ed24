// fp4sim golden write | check: versioned golden-vector packs of quantizer, GEMM and MMA cases
// (DESIGN.md §15, docs/cli.md). The expected outputs come from the emulator's own functions, the
// ones `fp4sim quantize`, `fp4sim gemm` and `fp4sim mma` call; each case records the command line
// that reproduces it, so a pack can be checked against the CLI as against any kernel.
#include <fmt/core.h>
#include <unistd.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>

#include "emu/contract.hpp"
#include "emu/gemm.hpp"
#include "emu/mma.hpp"
#include "model/checkpoint.hpp"
#include "tools/backends.hpp"
#include "tools/commands.hpp"
#include "tools/golden_cases.hpp"
#include "tools/npy.hpp"

#ifndef FP4SIM_VERSION
#define FP4SIM_VERSION "0.1.0"
#endif

namespace fp4sim::cli {
namespace {

namespace fs = std::filesystem;
using golden::Case;
using golden::make_cases;
using golden::OutputFile;
using nlohmann::json;

constexpr int kPackVersion = 1;
constexpr const char* kPackFormat = "fp4sim golden pack";
constexpr uint64_t kPackByteLimit = 50ull << 20;  // DESIGN.md §15: a pack stays under 50 MB

// ---- files and hashes
// ------------------------------------------------------------------------------

std::string read_file_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) throw std::runtime_error(p.string() + ": cannot open for reading");
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

std::string file_sha256(const fs::path& p) {
  const std::string b = read_file_bytes(p);
  return model::sha256_hex(b.data(), b.size());
}

json case_json(const Case& c) {
  json outs = json::array();
  for (const OutputFile& o : c.outputs)
    outs.push_back(
        {{"file", o.file}, {"dtype", o.dtype}, {"shape", o.shape}, {"optional", o.optional}});
  json j = {{"name", c.name},     {"op", c.op},      {"args", c.args},
            {"inputs", c.inputs}, {"outputs", outs}, {"contract_version", kContractVersion}};
  j.update(c.desc);
  return j;
}

void run_write(std::string dir, const std::string& set) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();  // "pack/" is the folder "pack"
  const fs::path out(dir);
  std::error_code ec;
  if (fs::exists(out, ec))
    throw std::invalid_argument(dir +
                                ": exists; golden write makes a new folder (remove it or "
                                "choose another path)");
  const fs::path parent = out.has_parent_path() ? out.parent_path() : fs::path(".");
  if (!fs::is_directory(parent, ec))
    throw std::invalid_argument(dir + ": the folder " + parent.string() + " does not exist");
  std::vector<Case> cases = make_cases(set);
  const fs::path tmp = fs::path(dir + ".tmp." + std::to_string(::getpid()));
  fs::remove_all(tmp, ec);
  struct Cleanup {
    fs::path p;
    bool keep = false;
    ~Cleanup() {
      std::error_code e;
      if (!keep) fs::remove_all(p, e);
    }
  } cleanup{tmp};
  json files = json::object(), list = json::array();
  uint64_t total = 0;
  for (Case& c : cases) {
    const fs::path cd = tmp / c.name;
    fs::create_directories(cd / "inputs");
    fs::create_directories(cd / "expected");
    c.write(cd);
    io::write_text((cd / "case.json").string(), case_json(c).dump(2) + "\n");
    list.push_back({{"name", c.name}, {"op", c.op}});
  }
  for (const auto& e : fs::recursive_directory_iterator(tmp)) {
    if (!e.is_regular_file()) continue;
    const std::string rel = fs::relative(e.path(), tmp).generic_string();
    const uint64_t bytes = e.file_size();
    total += bytes;
    files[rel] = {{"bytes", bytes}, {"sha256", file_sha256(e.path())}};
  }
  if (total >= kPackByteLimit)
    throw std::runtime_error(
        fmt::format("golden write: the pack would be {} bytes, over the {} "
                    "a pack may hold (DESIGN.md §15)",
                    total, kPackByteLimit));
  const json manifest = {{"format", kPackFormat},
                         {"pack_version", kPackVersion},
                         {"contract_version", kContractVersion},
                         {"fp4sim_version", FP4SIM_VERSION},
                         {"generator", "fp4sim golden write --cases " + set},
                         {"cases", list},
                         {"files", files}};
  io::write_text((tmp / "manifest.json").string(), manifest.dump(2) + "\n");
  fs::rename(tmp, out);
  cleanup.keep = true;
  fmt::print("fp4sim golden write  {}: {} cases, {} files, {} bytes (contract_version {})\n", dir,
             cases.size(), files.size(), total, kContractVersion);
}

// ---- check
// -----------------------------------------------------------------------------------------

json read_json(const fs::path& p) {
  try {
    return json::parse(read_file_bytes(p));
  } catch (const json::exception& e) {
    throw std::runtime_error(p.string() + ": not valid JSON (" + e.what() + ")");
  }
}

// The pack as written: its manifest's version fields, and every file's size and SHA-256.
json verify_pack(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw std::runtime_error(dir.string() + ": no such folder (the golden pack)");
  const fs::path mpath = dir / "manifest.json";
  if (!fs::is_regular_file(mpath, ec))
    throw std::runtime_error(dir.string() +
                             ": not a golden pack (no manifest.json; write one "
                             "with fp4sim golden write)");
  const json m = read_json(mpath);
  if (!m.is_object() || m.value("format", "") != kPackFormat)
    throw std::runtime_error(mpath.string() + ": not a golden pack manifest (no \"format\": \"" +
                             kPackFormat + "\")");
  if (!m.contains("pack_version") || m["pack_version"] != kPackVersion)
    throw std::runtime_error(mpath.string() + ": pack_version " +
                             (m.contains("pack_version") ? m["pack_version"].dump() : "missing") +
                             ", this fp4sim reads " + std::to_string(kPackVersion));
  if (!m.contains("contract_version") || m["contract_version"] != kContractVersion)
    throw std::runtime_error(
        mpath.string() + ": contract_version " +
        (m.contains("contract_version") ? m["contract_version"].dump() : "missing") +
        ", this fp4sim implements contract_version " + std::to_string(kContractVersion) +
        ": the expected bits follow another contract (write the pack again with this fp4sim)");
  if (!m.contains("files") || !m["files"].is_object() || !m.contains("cases") ||
      !m["cases"].is_array())
    throw std::runtime_error(mpath.string() + ": no \"files\" or \"cases\"");
  for (const auto& [rel, f] : m["files"].items()) {
    const fs::path p = dir / rel;
    if (!fs::is_regular_file(p, ec))
      throw std::runtime_error(p.string() + ": listed in the pack's manifest but missing");
    const uint64_t bytes = fs::file_size(p, ec);
    if (bytes != f.value("bytes", uint64_t{0}))
      throw std::runtime_error(
          fmt::format("{}: {} bytes, the manifest says {}: the pack is corrupted", p.string(),
                      bytes, f.value("bytes", uint64_t{0})));
    const std::string h = file_sha256(p);
    if (h != f.value("sha256", ""))
      throw std::runtime_error(p.string() + ": sha256 " + h + " differs from the manifest's " +
                               f.value("sha256", "") + ": the pack is corrupted");
  }
  return m;
}

size_t npy_element_size(const std::string& dtype) {
  if (dtype == "|u1") return 1;
  if (dtype == "<u2") return 2;
  if (dtype == "<f4" || dtype == "<u4") return 4;
  throw std::runtime_error("dtype '" + dtype + "' is not one a golden pack holds");
}

std::string index_text(size_t i, const std::vector<size_t>& shape) {
  std::vector<size_t> idx(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    idx[d] = shape[d] ? i % shape[d] : 0;
    i = shape[d] ? i / shape[d] : 0;
  }
  std::string s;
  for (size_t v : idx) s += (s.empty() ? "" : ", ") + std::to_string(v);
  return "[" + s + "]";
}

// One output file against the pack's: "" when identical, else the first difference.
std::string compare_output(const fs::path& want_path, const fs::path& got_path) {
  const io::NpyArray want = io::read_npy(want_path.string());
  io::NpyArray got;
  try {
    got = io::read_npy(got_path.string());
  } catch (const std::exception& e) {
    return e.what();
  }
  if (got.dtype != want.dtype || got.shape != want.shape)
    return fmt::format("{}: dtype '{}' shape {}, expected '{}' {}", got_path.string(), got.dtype,
                       io::shape_string(got.shape), want.dtype, io::shape_string(want.shape));
  const size_t es = npy_element_size(want.dtype);
  const size_t n = want.bytes.size() / es;
  size_t first = n, count = 0;
  for (size_t i = 0; i < n; ++i)
    if (std::memcmp(want.bytes.data() + i * es, got.bytes.data() + i * es, es) != 0) {
      if (first == n) first = i;
      ++count;
    }
  if (count == 0) return "";
  uint32_t w = 0, g = 0;
  std::memcpy(&w, want.bytes.data() + first * es, es);
  std::memcpy(&g, got.bytes.data() + first * es, es);
  return fmt::format(
      "{}: {} of {} elements differ; first at index {} {}: expected 0x{:0{}X}, got "
      "0x{:0{}X}",
      got_path.string(), count, n, first, index_text(first, want.shape), w, 2 * es, g, 2 * es);
}

void run_check(const std::string& dir, const std::string& outputs) {
  const fs::path pack(dir), out(outputs);
  const json m = verify_pack(pack);
  std::error_code ec;
  if (!fs::is_directory(out, ec))
    throw std::runtime_error(outputs + ": no such folder (--outputs, the kernel's outputs)");
  int passed = 0, failed = 0;
  for (const json& entry : m["cases"]) {
    const std::string name = entry.value("name", "");
    const json c = read_json(pack / name / "case.json");
    std::vector<std::string> problems;
    int skipped = 0;
    for (const json& oj : c.at("outputs")) {
      OutputFile o{oj.at("file").get<std::string>(), oj.at("dtype").get<std::string>(),
                   oj.at("shape").get<std::vector<size_t>>(), oj.value("optional", false)};
      const fs::path want = pack / name / "expected" / o.file;
      const fs::path got = out / name / "expected" / o.file;
      if (!fs::exists(got, ec)) {
        if (o.optional) {
          ++skipped;
          continue;
        }
        problems.push_back(got.string() + ": missing");
        continue;
      }
      const std::string d = compare_output(want, got);
      if (!d.empty()) problems.push_back(d);
    }
    if (problems.empty()) {
      ++passed;
      fmt::print("PASS  {}{}\n", name,
                 skipped ? fmt::format("  ({} optional file(s) not written)", skipped) : "");
    } else {
      ++failed;
      fmt::print("FAIL  {}\n", name);
      for (const std::string& p : problems) fmt::print("        {}\n", p);
    }
  }
  fmt::print("fp4sim golden check  {} against {}: {} passed, {} failed of {} cases\n", outputs, dir,
             passed, failed, passed + failed);
  if (failed)
    throw std::runtime_error(
        fmt::format("{} of {} golden case(s) failed", failed, passed + failed));
}

}  // namespace

void register_golden(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "golden", "Golden-vector packs: write one from the emulator, or check a kernel's outputs");
  cmd->require_subcommand(1);
  auto w = std::make_shared<std::pair<std::string, std::string>>("", "all");
  auto* wc = cmd->add_subcommand(
      "write",
      "Write a versioned pack of quantizer, GEMM and MMA cases (inputs, expected outputs)");
  wc->add_option("dir", w->first, "The pack's folder (must not exist)")->required();
  wc->add_option("--cases", w->second, "all | quantize | gemm | mma, comma-separated");
  wc->callback([w]() { run_write(w->first, w->second); });
  auto c = std::make_shared<std::pair<std::string, std::string>>();
  auto* cc = cmd->add_subcommand(
      "check", "Compare outputs (a folder mirroring the pack's cases) with the pack bit for bit");
  cc->add_option("dir", c->first, "The pack's folder")->required();
  cc->add_option("--outputs", c->second, "Folder of outputs: OUT/<case>/expected/<file>")
      ->required();
  cc->callback([c]() { run_check(c->first, c->second); });
}

}  // namespace fp4sim::cli
