#include "model/run_lock.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace fp4sim::model {

RunLock::RunLock(const std::string& dir, const std::string& option) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    throw std::runtime_error(option + " " + dir + ": cannot create the folder (" +
                             (ec ? ec.message() : std::string("a file is in the way")) + ")");
  const std::string path = (fs::path(dir) / kFileName).string();
  // (no O_TRUNC: the holder's PID must stay readable until the lock is ours)
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0)
    throw std::runtime_error(option + " " + dir + ": cannot open the lock file " + path + " (" +
                             std::strerror(errno) + ")");
  int rc;
  do rc = ::flock(fd_, LOCK_EX | LOCK_NB);
  while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int err = errno;
    char text[32] = {};
    const ssize_t n = ::pread(fd_, text, sizeof text - 1, 0);
    ::close(fd_);
    fd_ = -1;
    if (err != EWOULDBLOCK)
      throw std::runtime_error(option + " " + dir + ": cannot lock " + path + " (" +
                               std::strerror(err) + ")");
    std::string pid = n > 0 ? std::string(text, static_cast<size_t>(n)) : "";
    while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
    throw std::runtime_error(option + " " + dir + " is in use by another fp4sim (PID " +
                             (pid.empty() ? std::string("unknown") : pid) + ", holding " + path +
                             "): one writer per run folder; wait for it to end, or use another " +
                             option);
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) != 0 ||
      ::pwrite(fd_, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    throw std::runtime_error(option + " " + dir + ": cannot write the PID into " + path + " (" +
                             std::strerror(err) + ")");
  }
}

RunLock::~RunLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock; the file and its PID stay
}

}  // namespace fp4sim::model
