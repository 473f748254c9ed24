// One writer per run folder: an exclusive advisory lock (flock) on DIR/fp4sim.lock, held for the
// object's lifetime, with the holder's PID written in the file. The kernel drops a flock when its
// holder dies (kill -9 included), so a lock file left by a dead process never blocks; its stale
// PID is overwritten by the next holder.
#pragma once

#include <string>

namespace fp4sim::model {

class RunLock {
 public:
  // Creates `dir` when missing and takes the lock, or throws std::runtime_error at once naming
  // `option` (e.g. "train.out_dir"), the folder and the holder's PID.
  RunLock(const std::string& dir, const std::string& option);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

  static constexpr const char* kFileName = "fp4sim.lock";

 private:
  int fd_ = -1;
};

}  // namespace fp4sim::model
