#include "model/checkpoint.hpp"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "emu/contract.hpp"

namespace fp4sim::model {

namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

int64_t dtype_bytes(const std::string& d) {
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "BF16" || d == "F16" || d == "I16" || d == "U16") return 2;
  if (d == "U8" || d == "I8" || d == "BOOL") return 1;
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  return 0;
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Push a file or folder to the disk; false when it cannot be opened or synced. A checkpoint is
// renamed into place only after its files are durable, so a crash or power loss leaves the
// previous one intact.
bool fsync_path(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return false;
  const int rc = ::fsync(fd);
  ::close(fd);
  return rc == 0;
}

constexpr const char* kStateFile = "state.json";
constexpr const char* kStepPrefix = "step_";

}  // namespace

void write_safetensors(const std::string& path, const TensorMap& tensors,
                       const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (static_cast<int64_t>(t.bytes.size()) != numel(t.shape) * dtype_bytes(t.dtype))
      throw std::invalid_argument("safetensors: tensor '" + name + "' has " +
                                  std::to_string(t.bytes.size()) +
                                  " bytes, its dtype and shape need " +
                                  std::to_string(numel(t.shape) * dtype_bytes(t.dtype)));
    header[name] = {{"dtype", t.dtype},
                    {"shape", t.shape},
                    {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string h = header.dump();
  while (h.size() % 8) h += ' ';  // align the data to 8 bytes
  std::ofstream out(path, std::ios::binary);
  if (!out) throw std::runtime_error(path + ": cannot open for writing");
  const uint64_t n = h.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (const auto& [name, t] : tensors)
    out.write(reinterpret_cast<const char*>(t.bytes.data()),
              static_cast<std::streamsize>(t.bytes.size()));
  out.close();  // (the last buffered bytes are written here: a full disk shows up now)
  if (!out) throw std::runtime_error(path + ": write failed (disk full or I/O error?)");
}

TensorMap read_safetensors(const std::string& path, std::map<std::string, std::string>* metadata) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot open");
  const auto size = static_cast<uint64_t>(fs::file_size(path));
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  if (in.gcount() != 8 || n > size - 8)
    throw std::runtime_error(path + ": truncated, or not a safetensors file (header length " +
                             std::to_string(n) + " in a file of " + std::to_string(size) +
                             " bytes)");
  std::string h(n, '\0');
  in.read(h.data(), static_cast<std::streamsize>(n));
  Json header;
  try {
    header = Json::parse(h);
  } catch (const std::exception& e) {
    throw std::runtime_error(path + ": bad safetensors header (" + e.what() + ")");
  }
  if (!header.is_object())
    throw std::runtime_error(path + ": bad safetensors header (not a JSON object)");
  const uint64_t data_start = 8 + n;
  TensorMap out;
  for (auto it = header.begin(); it != header.end(); ++it) {
    try {
      if (it.key() == "__metadata__") {
        if (metadata) *metadata = it->get<std::map<std::string, std::string>>();
        continue;
      }
      StoredTensor t;
      t.dtype = it->at("dtype").get<std::string>();
      t.shape = it->at("shape").get<std::vector<int64_t>>();
      const auto off = it->at("data_offsets").get<std::vector<uint64_t>>();
      if (dtype_bytes(t.dtype) == 0) throw std::runtime_error("unknown dtype '" + t.dtype + "'");
      uint64_t bytes = static_cast<uint64_t>(dtype_bytes(t.dtype));
      for (int64_t d : t.shape)
        if (d < 0 || __builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes))
          throw std::runtime_error("impossible shape");
      if (off.size() != 2 || off[1] < off[0] || off[1] - off[0] != bytes)
        throw std::runtime_error("offsets do not match its dtype and shape");
      if (off[1] > size - data_start)
        throw std::runtime_error("truncated file (the tensor ends " +
                                 std::to_string(off[1] - (size - data_start)) +
                                 " bytes past the end)");
      t.bytes.resize(off[1] - off[0]);
      in.seekg(static_cast<std::streamoff>(data_start + off[0]));
      in.read(reinterpret_cast<char*>(t.bytes.data()),
              static_cast<std::streamsize>(t.bytes.size()));
      if (static_cast<uint64_t>(in.gcount()) != t.bytes.size())
        throw std::runtime_error("short read");
      out.emplace(it.key(), std::move(t));
    } catch (const std::exception& e) {
      throw std::runtime_error(path + ": tensor '" + it.key() + "': " + e.what());
    }
  }
  return out;
}

int64_t checkpoint_step(const std::string& path) {
  return std::stoll(fs::path(path).filename().string().substr(std::strlen(kStepPrefix)));
}

std::vector<std::string> list_checkpoints(const std::string& dir) {
  std::vector<std::string> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    // complete checkpoints only: step_ and digits, with its state.json (temporaries carry a suffix)
    const size_t np = std::strlen(kStepPrefix);
    const bool digits = name.size() > np && name.rfind(kStepPrefix, 0) == 0 &&
                        std::all_of(name.begin() + static_cast<std::ptrdiff_t>(np), name.end(),
                                    [](char ch) { return ch >= '0' && ch <= '9'; });
    if (e.is_directory() && digits && fs::exists(e.path() / kStateFile))
      out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string save_checkpoint(const std::string& dir, const Checkpoint& ck, int keep_last) {
  fs::create_directories(dir);
  char name[32];
  std::snprintf(name, sizeof name, "%s%08lld", kStepPrefix, static_cast<long long>(ck.step));
  const fs::path final_dir = fs::path(dir) / name;
  const fs::path tmp = fs::path(dir) / (std::string(name) + ".tmp-" + std::to_string(::getpid()));
  // the half-written folders of processes that died mid-write (a crash, a kill): never complete
  // checkpoints (state.json is written last and the folder renamed only after it), so removed.
  // (The PID is this host's: two hosts writing one shared folder at once are not supported.)
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
    const std::string f = e.path().filename().string();
    const size_t at = f.rfind(".tmp-");
    if (f.rfind(kStepPrefix, 0) != 0 || at == std::string::npos) continue;
    char* end = nullptr;
    const long pid = std::strtol(f.c_str() + at + 5, &end, 10);
    if (end && *end == '\0' && pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 &&
        errno == ESRCH) {
      std::error_code ec;
      fs::remove_all(e.path(), ec);
    }
  }
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  try {
    const std::map<std::string, std::string> meta = {
        {"contract_version", std::to_string(kContractVersion)}, {"step", std::to_string(ck.step)}};
    write_safetensors((tmp / "model.safetensors").string(), ck.model, meta);
    write_safetensors((tmp / "optimizer.safetensors").string(), ck.optimizer, meta);
    Json state = ck.state;
    state["contract_version"] = kContractVersion;
    state["step"] = ck.step;
    std::ofstream st((tmp / kStateFile).string());  // written last
    st << state.dump(2) << "\n";
    st.close();
    if (!st)
      throw std::runtime_error((tmp / kStateFile).string() +
                               ": write failed (disk full or I/O error?)");
    for (const char* f : {"model.safetensors", "optimizer.safetensors", kStateFile})
      if (!fsync_path(tmp / f))
        throw std::runtime_error((tmp / f).string() + ": fsync failed (disk full or I/O error?)");
  } catch (const std::exception& e) {
    std::error_code ec;
    fs::remove_all(tmp, ec);  // nothing half-written stays; the previous checkpoints are untouched
    throw std::runtime_error("checkpoint " + final_dir.string() + " not written (" + e.what() +
                             "); the earlier checkpoints are untouched");
  }
  fs::remove_all(final_dir);
  fs::rename(tmp, final_dir);  // the checkpoint appears complete, or not at all
  // the rename itself, best effort: some file systems cannot sync a folder (EINVAL), and the
  // files inside are durable already
  (void)fsync_path(dir);
  // keep-last counts this checkpoint and the ones before it; checkpoints of later steps (an
  // earlier run's, which the trainer refuses to mix with this one) are neither counted nor removed
  if (keep_last > 0) {
    std::vector<std::string> older;
    for (const std::string& c : list_checkpoints(dir))
      if (checkpoint_step(c) <= ck.step) older.push_back(c);
    for (size_t i = 0; i + static_cast<size_t>(keep_last) < older.size(); ++i)
      fs::remove_all(older[i]);
  }
  return final_dir.string();
}

Checkpoint load_checkpoint(const std::string& path) {
  fs::path p = path;
  if (!fs::exists(p / kStateFile)) {
    // a checkpoint, a checkpoints directory, or a run's out_dir (its checkpoints/ folder)
    std::vector<std::string> all = list_checkpoints(path);
    if (all.empty() && fs::is_directory(p / "checkpoints"))
      all = list_checkpoints((p / "checkpoints").string());
    if (all.empty())
      throw std::runtime_error(path +
                               ": no complete checkpoint (step_*/state.json) found, here or in " +
                               path + "/checkpoints");
    p = all.back();
  }
  Checkpoint ck;
  std::ifstream in((p / kStateFile).string());
  try {
    in >> ck.state;
  } catch (const std::exception& e) {
    throw std::runtime_error((p / kStateFile).string() + ": corrupt (" + e.what() + ")");
  }
  if (!ck.state.contains("contract_version") || !ck.state["contract_version"].is_number_integer())
    throw std::runtime_error((p / kStateFile).string() +
                             ": no contract_version (not a checkpoint of fp4sim, or "
                             "written before contract versions)");
  // `what` (the checkpoint, or one of its files) written under contract_version `version`
  const std::string ours = std::to_string(kContractVersion);
  auto require_version = [&](const fs::path& what, const std::string& version) {
    if (version != ours)
      throw std::runtime_error(what.string() + ": written under contract_version " + version +
                               ", this build is " + ours);
  };
  require_version(p, std::to_string(ck.state.value("contract_version", -1)));
  ck.step = ck.state.value("step", int64_t{0});
  // each file's own contract_version (its metadata) too: files copied in from another checkpoint
  for (auto [file, map] : {std::pair{"model.safetensors", &ck.model},
                           std::pair{"optimizer.safetensors", &ck.optimizer}}) {
    std::map<std::string, std::string> meta;
    *map = read_safetensors((p / file).string(), &meta);
    const auto it = meta.find("contract_version");
    if (it != meta.end()) require_version(p / file, it->second);
  }
  return ck;
}

}  // namespace fp4sim::model
