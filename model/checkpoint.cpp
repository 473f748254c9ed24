#include "model/checkpoint.hpp"

#include <fcntl.h>
#include <openssl/evp.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <tuple>

#include "emu/contract.hpp"
#include "model/strict_json.hpp"

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

constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kStateFile = "state.json";
constexpr const char* kManifestFile = "manifest.json";  // written last
constexpr const char* kStepPrefix = "step_";
constexpr const char* kTensorHashPrefix = "sha256:";  // + tensor name, in safetensors metadata
constexpr const char* kAllowUnverified = "FP4SIM_ALLOW_UNVERIFIED_CHECKPOINT";

class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new()) {
    if (!ctx_ || EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr) != 1)
      throw std::runtime_error("OpenSSL: cannot start a SHA-256");
  }
  ~Sha256() { EVP_MD_CTX_free(ctx_); }
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const void* data, size_t n) {
    if (n > 0 && EVP_DigestUpdate(ctx_, data, n) != 1)
      throw std::runtime_error("OpenSSL: SHA-256 update failed");
  }
  std::string hex() {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    if (EVP_DigestFinal_ex(ctx_, md, &len) != 1)
      throw std::runtime_error("OpenSSL: SHA-256 final failed");
    static const char* const kDigits = "0123456789abcdef";
    std::string h;
    for (unsigned int i = 0; i < len; ++i) {
      h += kDigits[md[i] >> 4];
      h += kDigits[md[i] & 15];
    }
    return h;
  }

 private:
  EVP_MD_CTX* ctx_;
};

// ---- the test hook (FP4SIM_FAULT_AT, _STOP_AT, _FAIL_AT, _TRACE) -------------------------------
int64_t env_count(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return 0;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  if (*end != '\0' || n < 1)
    throw std::invalid_argument(std::string(name) + "=" + v + ": expected an integer >= 1");
  return n;
}

struct FaultHook {
  int64_t kill_at = env_count("FP4SIM_FAULT_AT");
  int64_t stop_at = env_count("FP4SIM_FAULT_STOP_AT");
  int64_t fail_at = env_count("FP4SIM_FAULT_FAIL_AT");
  bool trace = std::getenv("FP4SIM_FAULT_TRACE") != nullptr;
  int64_t count = 0;  // operations so far
};

// Called just before each operation of a checkpoint save that touches the disk; true when the
// operation is to fail as on a full disk.
bool fault_point(const std::string& what) {
  static FaultHook hook;
  const int64_t n = ++hook.count;
  if (hook.trace)
    std::fprintf(stderr, "fault point %lld: %s\n", static_cast<long long>(n), what.c_str());
  if (n == hook.kill_at || n == hook.stop_at) {
    std::fflush(nullptr);
    ::raise(n == hook.kill_at ? SIGKILL : SIGSTOP);
  }
  return n == hook.fail_at;
}

std::string injected_failure() {
  return std::string(std::strerror(ENOSPC)) + " (injected by FP4SIM_FAULT_FAIL_AT)";
}

// A file written with checked POSIX calls; `label` (non-empty for the files of a checkpoint) makes
// each call a fault point and the file fsync'ed before close. Keeps the SHA-256 of what it wrote.
class FileWriter {
 public:
  FileWriter(const fs::path& path, std::string label) : path_(path), label_(std::move(label)) {
    if (point("create")) fail("create", injected_failure());
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail("create", std::strerror(errno));
  }
  ~FileWriter() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  void write(const void* data, size_t n, const std::string& what) {
    if (point("write " + what)) fail("write", injected_failure());
    hash_.update(data, n);
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) fail("write", w < 0 ? std::strerror(errno) : "no progress");
      p += w;
      n -= static_cast<size_t>(w);
    }
  }
  // fsync (checkpoint files) and close, each checked; the file's SHA-256
  std::string finish() {
    if (!label_.empty()) {
      if (point("fsync")) fail("fsync", injected_failure());
      if (::fsync(fd_) != 0) fail("fsync", std::strerror(errno));
    }
    if (point("close")) fail("close", injected_failure());
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail("close", std::strerror(errno));
    return hash_.hex();
  }

 private:
  bool point(const std::string& op) { return !label_.empty() && fault_point(label_ + ": " + op); }
  [[noreturn]] void fail(const std::string& op, const std::string& why) {
    throw std::runtime_error(path_.string() + ": " + op + " failed: " + why);
  }
  fs::path path_;
  std::string label_;
  int fd_ = -1;
  Sha256 hash_;
};

// fsync of a folder (its entries: the files in it, a rename); 0 or the errno. EINVAL: a file
// system that cannot sync a folder, which the caller accepts.
int fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno;
  const int rc = ::fsync(fd) == 0 ? 0 : errno;
  ::close(fd);
  return rc;
}

// The safetensors header of `tensors` (in name order, contiguous), padded to 8 bytes.
std::string safetensors_header(const TensorMap& tensors,
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
  return h;
}

// Writes the file; its SHA-256. `label` as FileWriter's.
std::string write_safetensors_file(const fs::path& path, const TensorMap& tensors,
                                   const std::map<std::string, std::string>& metadata,
                                   const std::string& label) {
  const std::string h = safetensors_header(tensors, metadata);
  FileWriter out(path, label);
  const uint64_t n = h.size();
  out.write(&n, 8, "header length");
  out.write(h.data(), h.size(), "header");
  for (const auto& [name, t] : tensors) out.write(t.bytes.data(), t.bytes.size(), "'" + name + "'");
  return out.finish();
}

struct SafetensorsFile {
  TensorMap tensors;
  std::map<std::string, std::string> metadata;
  uint64_t bytes = 0;
  std::string sha256;  // of the whole file
};

SafetensorsFile read_safetensors_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::error_code ec;
  const uint64_t size = static_cast<uint64_t>(fs::file_size(path, ec));
  if (!in || ec) throw std::runtime_error(path + ": cannot open");
  SafetensorsFile f;
  f.bytes = size;
  Sha256 hash;
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  if (in.gcount() != 8 || n > size - 8)
    throw std::runtime_error(path + ": truncated, or not a safetensors file (header length " +
                             std::to_string(n) + " in a file of " + std::to_string(size) +
                             " bytes)");
  std::string h(n, '\0');
  in.read(h.data(), static_cast<std::streamsize>(n));
  if (static_cast<uint64_t>(in.gcount()) != n) throw std::runtime_error(path + ": short read");
  hash.update(&n, 8);
  hash.update(h.data(), h.size());
  const Json header = parse_strict_json(h, path + ": safetensors header");
  if (!header.is_object())
    throw std::runtime_error(path + ": bad safetensors header (not a JSON object)");
  const uint64_t data_start = 8 + n, data_size = size - data_start;
  struct Span {
    uint64_t begin, end;
    std::string name;
    bool operator<(const Span& o) const { return std::tie(begin, end) < std::tie(o.begin, o.end); }
  };
  std::vector<Span> spans;
  for (auto it = header.begin(); it != header.end(); ++it) {
    try {
      if (it.key() == "__metadata__") {
        f.metadata = it->get<std::map<std::string, std::string>>();
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
      if (off[1] > data_size)
        throw std::runtime_error("truncated file (the tensor ends " +
                                 std::to_string(off[1] - data_size) + " bytes past the end)");
      spans.push_back({off[0], off[1], it.key()});
      f.tensors.emplace(it.key(), std::move(t));
    } catch (const std::exception& e) {
      throw std::runtime_error(path + ": tensor '" + it.key() + "': " + e.what());
    }
  }
  // the tensors tile the data section: no gap, no overlap, nothing after the last
  std::sort(spans.begin(), spans.end());
  uint64_t at = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    if (spans[i].begin < at)
      throw std::runtime_error(path + ": tensor '" + spans[i].name + "' overlaps tensor '" +
                               spans[i - 1].name + "'");
    if (spans[i].begin > at)
      throw std::runtime_error(path + ": " + std::to_string(spans[i].begin - at) +
                               " bytes before tensor '" + spans[i].name + "' belong to no tensor");
    at = spans[i].end;
  }
  if (at != data_size)
    throw std::runtime_error(path + ": " + std::to_string(data_size - at) +
                             " trailing bytes after the data (the tensors end at byte " +
                             std::to_string(data_start + at) + " of " + std::to_string(size) + ")");
  for (const Span& s : spans) {  // in file order: one sequential read, hashed as it goes
    StoredTensor& t = f.tensors.at(s.name);
    t.bytes.resize(s.end - s.begin);
    in.read(reinterpret_cast<char*>(t.bytes.data()), static_cast<std::streamsize>(t.bytes.size()));
    if (static_cast<uint64_t>(in.gcount()) != t.bytes.size())
      throw std::runtime_error(path + ": tensor '" + s.name + "': short read");
    hash.update(t.bytes.data(), t.bytes.size());
  }
  f.sha256 = hash.hex();
  return f;
}

// "NaN", "+Inf" or "-Inf": element i of t, which first_nonfinite found.
std::string nonfinite_text(const StoredTensor& t, int64_t i) {
  const int64_t w = dtype_bytes(t.dtype);
  uint64_t u = 0;
  std::memcpy(&u, t.bytes.data() + i * w, static_cast<size_t>(w));  // (little-endian hosts)
  const uint64_t sign = u >> (8 * w - 1) & 1;
  const uint64_t mantissa = t.dtype == "F64"   ? u & ((uint64_t{1} << 52) - 1)
                            : t.dtype == "F32" ? u & 0x7fffff
                            : t.dtype == "F16" ? u & 0x3ff
                                               : u & 0x7f;
  return mantissa ? "NaN" : sign ? "-Inf" : "+Inf";
}

// "tensor 'x' holds NaN at element i (of n)" for the first non-finite value of a map, "" when there
// is none.
std::string first_nonfinite_text(const TensorMap& m) {
  for (const auto& [name, t] : m) {
    const int64_t i = first_nonfinite(t);
    if (i >= 0)
      return "tensor '" + name + "' holds " + nonfinite_text(t, i) + " at element " +
             std::to_string(i) + " (of " + std::to_string(numel(t.shape)) + ")";
  }
  return "";
}

std::string read_text_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path.string() + ": cannot open");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw std::runtime_error(path.string() + ": read failed");
  return text.str();
}

// The SHA-256 a manifest carries of itself: of its compact JSON without the "sha256" key.
std::string manifest_self_hash(Json manifest) {
  manifest.erase("sha256");
  const std::string text = manifest.dump();
  return sha256_hex(text.data(), text.size());
}

// "step_00000012"
std::string step_folder_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "%s%08lld", kStepPrefix, static_cast<long long>(step));
  return name;
}

// The PID of a folder named step_*.tmp-PID or step_*.old-PID (a save's temporaries), else 0.
long temporary_owner(const std::string& name) {
  if (name.rfind(kStepPrefix, 0) != 0) return 0;
  for (const char* tag : {".tmp-", ".old-"}) {
    const size_t at = name.rfind(tag);
    if (at == std::string::npos) continue;
    char* end = nullptr;
    const long pid = std::strtol(name.c_str() + at + 5, &end, 10);
    if (end && *end == '\0' && pid > 0) return pid;
  }
  return 0;
}

}  // namespace

std::string sha256_hex(const void* data, size_t n) {
  Sha256 h;
  h.update(data, n);
  return h.hex();
}

StoredTensor f32_tensor(const float* data, const std::vector<int64_t>& shape, int64_t n) {
  StoredTensor s;
  s.dtype = "F32";
  s.shape = shape;
  s.bytes.resize(static_cast<size_t>(n) * 4);
  if (n > 0) std::memcpy(s.bytes.data(), data, s.bytes.size());
  return s;
}

int64_t first_nonfinite(const StoredTensor& t) {
  const int64_t w = dtype_bytes(t.dtype);
  uint64_t exponent = 0;  // the all-ones exponent field of the format
  if (t.dtype == "F64")
    exponent = uint64_t{0x7ff} << 52;
  else if (t.dtype == "F32")
    exponent = 0x7f800000;
  else if (t.dtype == "F16")
    exponent = 0x7c00;
  else if (t.dtype == "BF16")
    exponent = 0x7f80;
  else
    return -1;
  const int64_t n = static_cast<int64_t>(t.bytes.size()) / w;
  for (int64_t i = 0; i < n; ++i) {
    uint64_t u = 0;
    std::memcpy(&u, t.bytes.data() + i * w, static_cast<size_t>(w));  // (little-endian hosts)
    if ((u & exponent) == exponent) return i;
  }
  return -1;
}

void write_safetensors(const std::string& path, const TensorMap& tensors,
                       const std::map<std::string, std::string>& metadata) {
  (void)write_safetensors_file(path, tensors, metadata, "");
}

TensorMap read_safetensors(const std::string& path, std::map<std::string, std::string>* metadata) {
  SafetensorsFile f = read_safetensors_file(path);
  if (metadata) *metadata = std::move(f.metadata);
  return std::move(f.tensors);
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
  const std::string name = step_folder_name(ck.step);
  const fs::path final_dir = fs::path(dir) / name;
  const std::string pid = std::to_string(::getpid());
  const fs::path tmp = fs::path(dir) / (name + ".tmp-" + pid);
  const std::string not_written = "checkpoint " + final_dir.string() + " not written (";
  const std::string untouched = "); the earlier checkpoints are untouched";
  // a NaN or Inf is never saved: the run stops here, its last good checkpoint the latest
  for (const auto& [file, map] :
       {std::pair{kModelFile, &ck.model}, std::pair{kOptimizerFile, &ck.optimizer}}) {
    const std::string bad = first_nonfinite_text(*map);
    if (!bad.empty())
      throw std::runtime_error(not_written + file + ": " + bad +
                               ": non-finite weights or optimizer state are never saved" +
                               untouched);
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    throw std::runtime_error(not_written + dir + ": cannot create the folder" +
                             (ec ? ": " + ec.message() : std::string()) + untouched);
  // the temporaries of processes that died mid-save (a crash, a kill): never complete checkpoints
  // (the folder is renamed into place only after its manifest is written), so removed.
  // (The PID is this host's: two hosts writing one shared folder at once are not supported.)
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
    const long owner = temporary_owner(e.path().filename().string());
    if (owner > 0 && ::kill(static_cast<pid_t>(owner), 0) != 0 && errno == ESRCH)
      fs::remove_all(e.path(), ec);
  }
  // label of the fault points of this save: "step_00000012: model.safetensors: write 'wte'"
  const auto point = [&](const std::string& what) { return fault_point(name + ": " + what); };
  const auto fail_if = [&](bool injected, const std::string& what) {
    if (injected) throw std::runtime_error(what + " failed: " + injected_failure());
  };
  try {
    fs::remove_all(tmp);
    fail_if(point("create the temporary folder"), tmp.string() + ": create");
    fs::create_directories(tmp);
    // each tensor's SHA-256 and the step in the metadata; each file's SHA-256 in the manifest
    Json files = Json::object();
    for (const auto& [file, map] :
         {std::pair{kModelFile, &ck.model}, std::pair{kOptimizerFile, &ck.optimizer}}) {
      std::map<std::string, std::string> meta = {
          {"contract_version", std::to_string(kContractVersion)},
          {"step", std::to_string(ck.step)}};
      for (const auto& [tensor, t] : *map)
        meta[kTensorHashPrefix + tensor] = sha256_hex(t.bytes.data(), t.bytes.size());
      const std::string digest = write_safetensors_file(tmp / file, *map, meta, name + ": " + file);
      files[file] = {{"bytes", fs::file_size(tmp / file)}, {"sha256", digest}};
    }
    Json state = ck.state;
    state["contract_version"] = kContractVersion;
    state["step"] = ck.step;
    const std::string state_text = state.dump(2) + "\n";
    FileWriter st(tmp / kStateFile, name + ": " + kStateFile);
    st.write(state_text.data(), state_text.size(), "the state");
    files[kStateFile] = {{"bytes", state_text.size()}, {"sha256", st.finish()}};
    Json manifest = {{"contract_version", kContractVersion}, {"step", ck.step}, {"files", files}};
    manifest["sha256"] = manifest_self_hash(manifest);
    const std::string manifest_text = manifest.dump(2) + "\n";
    FileWriter mf(tmp / kManifestFile, name + ": " + kManifestFile);  // written last
    mf.write(manifest_text.data(), manifest_text.size(), "the manifest");
    mf.finish();
    fail_if(point("fsync the temporary folder"), tmp.string() + ": fsync");
    if (const int err = fsync_dir(tmp); err != 0 && err != EINVAL)
      throw std::runtime_error(tmp.string() + ": fsync failed: " + std::strerror(err));
  } catch (const std::exception& e) {
    fs::remove_all(tmp, ec);  // nothing half-written stays; the previous checkpoints are untouched
    throw std::runtime_error(not_written + e.what() + untouched);
  }
  // a checkpoint of this very step already there (an earlier save of it) moves aside first
  const fs::path aside = fs::path(dir) / (name + ".old-" + pid);
  try {
    if (fs::exists(final_dir)) {
      fail_if(point("move the earlier save of this step aside"), final_dir.string() + ": rename");
      fs::remove_all(aside);
      fs::rename(final_dir, aside);
    }
    fail_if(point("rename into place"), tmp.string() + ": rename");
    fs::rename(tmp, final_dir);  // the checkpoint appears complete, or not at all
  } catch (const std::exception& e) {
    fs::remove_all(tmp, ec);
    throw std::runtime_error(not_written + e.what() + untouched);
  }
  // from here on the checkpoint is complete; an error stops the run all the same
  const std::string written = "checkpoint " + final_dir.string() + " written, but ";
  fail_if(point("fsync the checkpoints folder"), written + dir + ": fsync");
  if (const int err = fsync_dir(dir); err != 0 && err != EINVAL)
    throw std::runtime_error(written + dir + ": fsync failed: " + std::strerror(err));
  // older checkpoints go by a rename first, so a kill mid-removal leaves a temporary, never a
  // step folder with files missing
  const auto remove = [&](const fs::path& folder, const fs::path& temporary) {
    if (folder != temporary) {
      fail_if(point("prune " + folder.filename().string() + ": rename"),
              written + folder.string() + ": rename");
      fs::rename(folder, temporary);
    }
    fail_if(point("prune " + folder.filename().string() + ": remove"),
            written + temporary.string() + ": remove");
    fs::remove_all(temporary);
  };
  try {
    if (fs::exists(aside)) remove(aside, aside);
    // keep-last counts this checkpoint and the ones before it; checkpoints of later steps (an
    // earlier run's, which the trainer refuses to mix with this one) are neither counted nor
    // removed
    if (keep_last > 0) {
      std::vector<std::string> older;
      for (const std::string& c : list_checkpoints(dir))
        if (checkpoint_step(c) <= ck.step) older.push_back(c);
      for (size_t i = 0; i + static_cast<size_t>(keep_last) < older.size(); ++i)
        remove(older[i], older[i] + ".old-" + pid);
    }
  } catch (const fs::filesystem_error& e) {
    throw std::runtime_error(written + "pruning failed: " + e.what());
  }
  return final_dir.string();
}

namespace {

// A step folder, verified: manifest, steps, hashes, values.
Checkpoint load_checkpoint_folder(const fs::path& p) {
  // `what` (the checkpoint, or one of its files) written under contract_version `version`
  const std::string ours = std::to_string(kContractVersion);
  auto require_version = [&](const fs::path& what, const std::string& version) {
    if (version != ours)
      throw std::runtime_error(what.string() + ": written under contract_version " + version +
                               ", this build is " + ours);
  };
  // the manifest (every file's size and SHA-256, the step) verifies itself before anything else is
  // believed, so that a damaged byte anywhere is reported as damage, not as another version
  Json files;
  int64_t manifest_step = 0;
  const fs::path manifest_path = p / kManifestFile;
  const bool verified = fs::exists(manifest_path);
  if (verified) {
    Json manifest;
    try {
      manifest = read_strict_json_file(manifest_path.string());
    } catch (const StrictJsonError& e) {
      throw std::runtime_error(std::string("corrupt checkpoint: ") + e.what());
    }
    const std::string bad = manifest_path.string() + ": corrupt checkpoint (";
    if (!manifest.is_object() || !manifest.contains("sha256") || !manifest["sha256"].is_string())
      throw std::runtime_error(bad + "no sha256 of itself)");
    if (manifest_self_hash(manifest) != manifest["sha256"].get<std::string>())
      throw std::runtime_error(bad + "its content does not match its own SHA-256)");
    require_version(manifest_path, manifest.value("contract_version", Json(-1)).dump());
    if (!manifest.contains("step") || !manifest["step"].is_number_integer() ||
        !manifest.contains("files") || !manifest["files"].is_object())
      throw std::runtime_error(bad + "no step or no files)");
    manifest_step = manifest["step"].get<int64_t>();
    files = manifest["files"];
  } else if (const char* allow = std::getenv(kAllowUnverified);
             allow && std::string(allow) == "1") {
    std::fprintf(stderr,
                 "warning: %s has no %s (written before checkpoint hashes): its files are not "
                 "verified (%s=1)\n",
                 p.c_str(), kManifestFile, kAllowUnverified);
  } else {
    throw std::runtime_error(
        p.string() + ": no " + kManifestFile +
        ": a checkpoint written before checkpoint hashes, or one whose manifest was removed; its "
        "files cannot be verified, so it is refused (" +
        kAllowUnverified + "=1 loads it with a warning)");
  }
  // `file` of `bytes` bytes and SHA-256 `sha256` is the one the manifest lists
  auto require_listed = [&](const std::string& file, uint64_t bytes, const std::string& sha256) {
    if (!verified) return;
    const std::string where = (p / file).string() + ": ";
    if (!files.contains(file) || !files[file].is_object() || !files[file].contains("sha256") ||
        !files[file].contains("bytes"))
      throw std::runtime_error(where + kManifestFile + " does not list it (corrupt checkpoint)");
    if (files[file]["bytes"] != bytes || files[file]["sha256"] != sha256)
      throw std::runtime_error(where + "its SHA-256 differs from " + kManifestFile + "'s" +
                               (files[file]["bytes"] != bytes
                                    ? " (" + std::to_string(bytes) + " bytes, " + kManifestFile +
                                          " lists " + files[file]["bytes"].dump() + ")"
                                    : std::string()) +
                               ": a damaged or replaced file");
  };

  Checkpoint ck;
  const fs::path state_path = p / kStateFile;
  const std::string state_text = read_text_file(state_path);
  try {
    require_listed(kStateFile, state_text.size(), sha256_hex(state_text.data(), state_text.size()));
  } catch (const std::runtime_error&) {
    // a state.json of another step (state.json or manifest.json copied in): say so
    const Json other = Json::parse(state_text, nullptr, /*allow_exceptions=*/false);
    if (other.is_object() && other.contains("step") && other["step"].is_number_integer() &&
        other["step"].get<int64_t>() != manifest_step)
      throw std::runtime_error(state_path.string() + " holds step " + other["step"].dump() + ", " +
                               manifest_path.string() + " step " + std::to_string(manifest_step) +
                               ": files of two checkpoints (one copied in from another?)");
    throw;
  }
  try {
    ck.state = parse_strict_json(state_text, state_path.string());
  } catch (const StrictJsonError& e) {
    throw std::runtime_error(std::string("corrupt checkpoint: ") + e.what());
  }
  if (!ck.state.is_object() || !ck.state.contains("contract_version") ||
      !ck.state["contract_version"].is_number_integer())
    throw std::runtime_error(state_path.string() +
                             ": no contract_version (not a checkpoint of fp4sim, or "
                             "written before contract versions)");
  require_version(p, std::to_string(ck.state.value("contract_version", -1)));
  if (!ck.state.contains("step") || !ck.state["step"].is_number_integer())
    throw std::runtime_error(state_path.string() + ": no integer 'step' (corrupt checkpoint)");
  ck.step = ck.state["step"].get<int64_t>();
  // `file` holds step `step` (its own metadata, the folder's name), else another checkpoint's
  auto require_step = [&](const std::string& what, int64_t step) {
    if (step != ck.step)
      throw std::runtime_error((p / what).string() + " holds step " + std::to_string(step) +
                               ", its checkpoint's state.json step " + std::to_string(ck.step) +
                               " (a file copied in from another checkpoint?)");
  };
  if (verified) require_step(kManifestFile, manifest_step);
  const std::string folder = p.filename().string();
  if (folder.rfind(kStepPrefix, 0) == 0 && folder.size() > std::strlen(kStepPrefix) &&
      std::all_of(folder.begin() + static_cast<std::ptrdiff_t>(std::strlen(kStepPrefix)),
                  folder.end(), [](char ch) { return ch >= '0' && ch <= '9'; }) &&
      checkpoint_step(p.string()) != ck.step)
    throw std::runtime_error(state_path.string() + ": step " + std::to_string(ck.step) +
                             " in a folder named " + folder + " (a state.json of another step?)");
  // each file's own contract_version and step (its metadata) too: files copied in from another
  // checkpoint; then each tensor's SHA-256, the file's, and every value finite
  for (auto [file, map] :
       {std::pair{kModelFile, &ck.model}, std::pair{kOptimizerFile, &ck.optimizer}}) {
    const std::string where = (p / file).string();
    SafetensorsFile f = read_safetensors_file(where);
    const auto version = f.metadata.find("contract_version");
    if (version != f.metadata.end()) require_version(p / file, version->second);
    const auto step = f.metadata.find("step");
    if (step != f.metadata.end()) {
      char* end = nullptr;
      const long long s = std::strtoll(step->second.c_str(), &end, 10);
      if (step->second.empty() || *end != '\0')
        throw std::runtime_error(where + ": step '" + step->second + "' in its metadata");
      require_step(file, s);
    } else if (verified) {
      throw std::runtime_error(where + ": no step in its metadata (corrupt checkpoint)");
    }
    for (const auto& [key, value] : f.metadata) {
      if (key.rfind(kTensorHashPrefix, 0) != 0) continue;
      const std::string tensor = key.substr(std::strlen(kTensorHashPrefix));
      if (!f.tensors.count(tensor))
        throw std::runtime_error(where + ": its metadata has a SHA-256 of tensor '" + tensor +
                                 "', which it does not hold (corrupt checkpoint)");
    }
    for (const auto& [tensor, t] : f.tensors) {
      const auto h = f.metadata.find(kTensorHashPrefix + tensor);
      if (h == f.metadata.end()) {
        if (verified)
          throw std::runtime_error(where + ": tensor '" + tensor +
                                   "' has no SHA-256 in the metadata (corrupt checkpoint)");
        continue;
      }
      if (sha256_hex(t.bytes.data(), t.bytes.size()) != h->second)
        throw std::runtime_error(where + ": tensor '" + tensor +
                                 "': its data do not match its SHA-256 (a damaged file)");
    }
    require_listed(file, f.bytes, f.sha256);
    const std::string bad = first_nonfinite_text(f.tensors);
    if (!bad.empty())
      throw std::runtime_error(where + ": " + bad +
                               ": non-finite weights or optimizer state are refused");
    *map = std::move(f.tensors);
  }
  return ck;
}

}  // namespace

Checkpoint load_checkpoint(const std::string& path) {
  fs::path p = path;
  std::vector<std::string> all;
  if (!fs::exists(p / kStateFile)) {
    // a checkpoint, a checkpoints directory, or a run's out_dir (its checkpoints/ folder)
    all = list_checkpoints(path);
    if (all.empty() && fs::is_directory(p / "checkpoints"))
      all = list_checkpoints((p / "checkpoints").string());
    if (all.empty())
      throw std::runtime_error(path +
                               ": no complete checkpoint (step_*/state.json) found, here or in " +
                               path + "/checkpoints");
    p = all.back();
  }
  if (all.size() < 2) return load_checkpoint_folder(p);
  try {
    return load_checkpoint_folder(p);
  } catch (const std::runtime_error& e) {  // no silent fallback to an older one: say it exists
    throw std::runtime_error(std::string(e.what()) + " [" + p.filename().string() +
                             " is the latest checkpoint in " + path + "; the one before it is " +
                             fs::path(all[all.size() - 2]).filename().string() +
                             ": remove the latest, or name that one, to use it]");
  }
}

}  // namespace fp4sim::model
