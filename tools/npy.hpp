// .npy reading and writing for the CLI (xtensor's npy I/O behind this one header). Errors name the
// file and what was expected.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fp4sim::io {

struct NpyArray {
  std::string path;
  std::string dtype;  // numpy typestring: "<f4", "<u2", "|u1", ...
  std::vector<size_t> shape;
  std::vector<uint8_t> bytes;  // C-order data
};

// Throws std::runtime_error naming the file: a directory, unreadable (with the system's reason),
// not an npy, Fortran order, truncated.
NpyArray read_npy(const std::string& path);
// `path` is a file that opens for reading, else std::runtime_error: "PATH: is a directory, not
// WHAT", or "PATH: cannot open for reading (REASON)".
void require_readable_file(const std::string& path, const std::string& what);

// C-order data of `shape` as an npy file (xtensor's header). The writers here check every write,
// the fsync and the close (model/output_file.hpp), so a full disk is an error with the system's
// reason; errors name the path the user gave, not the staged one.
void write_npy_f32(const std::string& path, const float* data, const std::vector<size_t>& shape);
void write_npy_u8(const std::string& path, const uint8_t* data, const std::vector<size_t>& shape);
void write_npy_u16(const std::string& path, const uint16_t* data, const std::vector<size_t>& shape);

std::string shape_string(const std::vector<size_t>& shape);

// `text` as the whole of `path` (typically an AtomicOutputs staged path).
void write_text(const std::string& path, const std::string& text);

// Before any work, every output path of a command: a file name (not ending in '/'), within the
// folder's NAME_MAX, in a folder that exists, not a folder itself, and none of `inputs` (the same
// file by name, or by device and inode: links followed), so no command overwrites what it reads.
// Errors (std::invalid_argument) name the output, and the input it would replace.
void check_outputs(const std::vector<std::string>& outputs, const std::vector<std::string>& inputs);
// An output prefix (PREFIX.codes.npy, ...): it must end in a file-name part, so "runs/" (which
// would write the hidden files runs/.codes.npy, ...) is refused; `what` names the argument.
void check_output_prefix(const std::string& prefix, const std::string& what);

// Files written under temporary names and renamed into place only when every one is complete, so
// a failure never leaves partial outputs behind; a rename that fails in commit() takes back the
// files already moved, so a prefix never mixes one run's files with another's.
class AtomicOutputs {
 public:
  ~AtomicOutputs();
  // The temporary path to write `final_path` to.
  std::string stage(const std::string& final_path);
  void commit();  // rename every staged file into place

 private:
  std::vector<std::pair<std::string, std::string>> files_;  // (tmp, final)
  bool committed_ = false;
};

}  // namespace fp4sim::io
