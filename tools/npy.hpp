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

// Throws std::runtime_error naming the file: unreadable, not an npy, Fortran order, truncated.
NpyArray read_npy(const std::string& path);

// C-order data of `shape` as an npy file (xtensor's header). The writers here check every write,
// the fsync and the close (model/output_file.hpp), so a full disk is an error with the system's
// reason; errors name the path the user gave, not the staged one.
void write_npy_f32(const std::string& path, const float* data, const std::vector<size_t>& shape);
void write_npy_u8(const std::string& path, const uint8_t* data, const std::vector<size_t>& shape);
void write_npy_u16(const std::string& path, const uint16_t* data, const std::vector<size_t>& shape);

std::string shape_string(const std::vector<size_t>& shape);

// `text` as the whole of `path` (typically an AtomicOutputs staged path).
void write_text(const std::string& path, const std::string& text);

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
