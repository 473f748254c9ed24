// Files written with every step checked, for the training log and every output of the CLI: a full
// disk or an I/O error is an error naming the file and the system's reason (errno), never a short
// or empty file left behind with exit status 0.
#pragma once

#include <cstddef>
#include <string>

namespace fp4sim::model {

// One file written through POSIX calls: open, each write (partial writes resumed), fsync and close
// are checked. Errors are std::runtime_error "PATH: <what> failed (<strerror>)", PATH being
// shown_path(path): the name the user gave, for a staged output.
class OutputFile {
 public:
  enum class Mode { Truncate, Append };
  explicit OutputFile(const std::string& path, Mode mode = Mode::Truncate);
  ~OutputFile();  // (a file left open by an error on the way is closed unchecked)
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  void write(const void* data, size_t bytes);
  void write(const std::string& text) { write(text.data(), text.size()); }
  // The data on the disk (fsync); a file that cannot be synced (a pipe, a character device:
  // EINVAL) is left as it is.
  void sync();
  void close();  // checked; later writes are errors
  const std::string& shown() const { return shown_; }

 private:
  int fd_ = -1;
  std::string shown_;
};

// `text` as the whole of `path`: written, synced and closed, each checked.
void write_whole_file(const std::string& path, const std::string& text);

// Staged outputs (written under a temporary name beside the final one, then renamed into place):
// the temporary name is FINAL.tmp.PID.N, with FINAL's file name shortened where the suffix would
// take it past the folder's NAME_MAX (so every final name that fits can be staged); it is
// remembered so that errors name the final path; forget_staged drops the record once the file
// is renamed or removed.
std::string staged_path(const std::string& final_path);
void forget_staged(const std::string& staged);
// The final path of a staged one, else `path` itself.
std::string shown_path(const std::string& path);

// The longest file name, in bytes, that the folder of `path` takes (pathconf's NAME_MAX; 255
// where it cannot say).
size_t name_max_for(const std::string& path);

}  // namespace fp4sim::model
