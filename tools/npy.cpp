#include "tools/npy.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <unistd.h>

#include <xtensor/xadapt.hpp>
#include <xtensor/xnpy.hpp>

namespace fp4sim::io {

std::string shape_string(const std::vector<size_t>& shape) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << "]";
  return s.str();
}

NpyArray read_npy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot open file for reading");
  char magic[6] = {};
  in.read(magic, 6);
  if (!in || std::string(magic, 6) != "\x93NUMPY")
    throw std::runtime_error(path + ": not a .npy file (bad magic bytes)");
  in.seekg(0);
  std::unique_ptr<xt::detail::npy_file> f;
  try {
    f = std::make_unique<xt::detail::npy_file>(xt::detail::load_npy_file(in));
  } catch (const std::exception& e) {
    throw std::runtime_error(path + ": malformed .npy header (" + e.what() + ")");
  }
  const size_t n = f->n_bytes();
  // load_npy_file reads the data last and does not check for a short read
  if (static_cast<size_t>(in.gcount()) != n)
    throw std::runtime_error(path + ": truncated .npy file (" + std::to_string(in.gcount()) +
                             " of " + std::to_string(n) + " data bytes for shape " +
                             shape_string(f->m_shape) + ")");
  if (f->m_fortran_order)
    throw std::runtime_error(path + ": Fortran-ordered arrays are not supported (save with C order)");
  NpyArray a;
  a.path = path;
  a.dtype = f->m_typestring;
  a.shape = f->m_shape;
  a.bytes.assign(f->ptr(), f->ptr() + n);
  return a;
}

namespace {
template <class T>
void write_npy(const std::string& path, const T* data, const std::vector<size_t>& shape) {
  size_t n = 1;
  for (size_t d : shape) n *= d;
  auto view = xt::adapt(data, n, xt::no_ownership(), shape);
  std::ofstream probe(path, std::ios::binary);
  if (!probe) throw std::runtime_error(path + ": cannot open file for writing");
  probe.close();
  xt::dump_npy(path, view);
}
}  // namespace

void write_npy_f32(const std::string& p, const float* d, const std::vector<size_t>& s) {
  write_npy(p, d, s);
}
void write_npy_u8(const std::string& p, const uint8_t* d, const std::vector<size_t>& s) {
  write_npy(p, d, s);
}
void write_npy_u16(const std::string& p, const uint16_t* d, const std::vector<size_t>& s) {
  write_npy(p, d, s);
}

AtomicOutputs::~AtomicOutputs() {
  if (committed_) return;
  for (auto& f : files_) std::remove(f.first.c_str());
}

std::string AtomicOutputs::stage(const std::string& final_path) {
  const std::string tmp = final_path + ".tmp." + std::to_string(::getpid());
  files_.emplace_back(tmp, final_path);
  return tmp;
}

void AtomicOutputs::commit() {
  // what can be checked before anything moves: every final path is free or a plain file
  for (auto& f : files_) {
    std::error_code ec;
    if (std::filesystem::is_directory(f.second, ec))
      throw std::runtime_error(f.second + ": is a directory; nothing was written");
  }
  for (size_t i = 0; i < files_.size(); ++i) {
    if (std::rename(files_[i].first.c_str(), files_[i].second.c_str()) != 0) {
      const int err = errno;
      // take back the outputs already moved, so the prefix never mixes this run's files with older
      // ones (files of an earlier run under those names were replaced by them, so they are gone too)
      for (size_t j = 0; j < i; ++j) std::remove(files_[j].second.c_str());
      throw std::runtime_error(files_[i].second + ": cannot move the finished file into place (" +
                               std::strerror(err) + "); no output of this run was kept" +
                               (i ? ", and the " + std::to_string(i) + " it had already moved are removed" : ""));
    }
  }
  committed_ = true;
}

}  // namespace fp4sim::io
