#include "model/output_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>

namespace fp4sim::model {
namespace {

std::runtime_error system_error(const std::string& shown, const std::string& what, int err) {
  return std::runtime_error(shown + ": " + what + " (" + std::strerror(err) + ")");
}

// staged path -> final path, for the error messages
std::mutex& staged_mutex() {
  static std::mutex m;
  return m;
}
std::map<std::string, std::string>& staged_names() {
  static std::map<std::string, std::string> names;
  return names;
}

}  // namespace

OutputFile::OutputFile(const std::string& path, Mode mode) : shown_(shown_path(path)) {
  const int flags = O_WRONLY | O_CREAT | O_CLOEXEC | (mode == Mode::Append ? O_APPEND : O_TRUNC);
  do {
    fd_ = ::open(path.c_str(), flags, 0666);  // (less the umask, as fopen)
  } while (fd_ < 0 && errno == EINTR);
  if (fd_ < 0) throw system_error(shown_, "cannot open for writing", errno);
}

OutputFile::~OutputFile() {
  if (fd_ >= 0) ::close(fd_);
}

void OutputFile::write(const void* data, size_t bytes) {
  if (fd_ < 0) throw std::logic_error(shown_ + ": written after close");
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw system_error(shown_, "write failed", errno);
    if (n == 0) throw system_error(shown_, "write failed", EIO);  // (no progress: never loop)
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void OutputFile::sync() {
  if (fd_ < 0) throw std::logic_error(shown_ + ": synced after close");
  if (::fsync(fd_) != 0 && errno != EINVAL) throw system_error(shown_, "fsync failed", errno);
}

void OutputFile::close() {
  if (fd_ < 0) return;
  const int fd = fd_;
  fd_ = -1;
  // (close is not retried on EINTR: Linux releases the descriptor either way)
  if (::close(fd) != 0 && errno != EINTR) throw system_error(shown_, "close failed", errno);
}

void write_whole_file(const std::string& path, const std::string& text) {
  OutputFile f(path);
  f.write(text);
  f.sync();
  f.close();
}

size_t name_max_for(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
  const long n = ::pathconf(dir.c_str(), _PC_NAME_MAX);
  return n > 0 ? static_cast<size_t>(n) : 255;
}

std::string staged_path(const std::string& final_path) {
  static unsigned counter = 0;
  std::lock_guard<std::mutex> lock(staged_mutex());
  // (the counter keeps two shortened names of one prefix apart)
  const std::string suffix = ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  const size_t name_at = final_path.rfind('/') == std::string::npos ? 0 : final_path.rfind('/') + 1;
  std::string name = final_path.substr(name_at);
  const size_t name_max = name_max_for(final_path);
  if (name.size() + suffix.size() > name_max)
    name.resize(name_max > suffix.size() ? name_max - suffix.size() : 0);
  const std::string staged = final_path.substr(0, name_at) + name + suffix;
  staged_names()[staged] = final_path;
  return staged;
}

void forget_staged(const std::string& staged) {
  std::lock_guard<std::mutex> lock(staged_mutex());
  staged_names().erase(staged);
}

std::string shown_path(const std::string& path) {
  std::lock_guard<std::mutex> lock(staged_mutex());
  const auto it = staged_names().find(path);
  return it == staged_names().end() ? path : it->second;
}

}  // namespace fp4sim::model
