#include "tools/npy.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <xtensor/xnpy.hpp>

#include "model/output_file.hpp"

namespace fp4sim::io {

std::string shape_string(const std::vector<size_t>& shape) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << "]";
  return s.str();
}

namespace {

// The header's shape and item size against the file's size, before anything is allocated: a
// corrupt shape (an overflowing product, or more or fewer data bytes than the file holds) is an
// error naming the file, not a crash or a huge allocation. `in` is positioned after the magic.
void check_npy_size(const std::string& path, std::ifstream& in) {
  unsigned char v[2] = {};
  in.read(reinterpret_cast<char*>(v), 2);
  size_t prefix = 0, hlen = 0;
  unsigned char l[4] = {};
  if (v[0] == 1) {
    in.read(reinterpret_cast<char*>(l), 2);
    prefix = 10;
    hlen = static_cast<size_t>(l[0]) | static_cast<size_t>(l[1]) << 8;
  } else if (v[0] == 2 || v[0] == 3) {
    in.read(reinterpret_cast<char*>(l), 4);
    prefix = 12;
    hlen = static_cast<size_t>(l[0]) | static_cast<size_t>(l[1]) << 8 |
           static_cast<size_t>(l[2]) << 16 | static_cast<size_t>(l[3]) << 24;
  } else {
    throw std::runtime_error(path + ": unsupported .npy format version " + std::to_string(v[0]));
  }
  const auto file_bytes = static_cast<size_t>(std::filesystem::file_size(path));
  if (!in || prefix + hlen > file_bytes)
    throw std::runtime_error(path +
                             ": truncated .npy file (the header runs past the end of the file)");
  std::string h(hlen, '\0');
  in.read(h.data(), static_cast<std::streamsize>(hlen));
  // 'descr': '<f4' -> item size 4; 'shape': (a, b, ...)
  const size_t d = h.find("'descr'"), sh = h.find("'shape'");
  if (d == std::string::npos || sh == std::string::npos)
    throw std::runtime_error(path + ": malformed .npy header (no descr or shape)");
  const size_t q0 = h.find('\'', h.find(':', d)),
               q1 = q0 == std::string::npos ? q0 : h.find('\'', q0 + 1);
  const size_t p0 = h.find('(', sh), p1 = p0 == std::string::npos ? p0 : h.find(')', p0);
  if (q1 == std::string::npos || p1 == std::string::npos)
    throw std::runtime_error(path + ": malformed .npy header (descr or shape)");
  const std::string descr = h.substr(q0 + 1, q1 - q0 - 1);
  size_t item = 0;
  for (size_t i = 0; i < descr.size(); ++i)
    if (descr[i] >= '0' && descr[i] <= '9') item = item * 10 + static_cast<size_t>(descr[i] - '0');
  std::vector<size_t> shape;
  std::string dims = h.substr(p0 + 1, p1 - p0 - 1);
  std::stringstream ss(dims);
  for (std::string tok; std::getline(ss, tok, ',');) {
    const size_t a = tok.find_first_not_of(" \t"), b = tok.find_last_not_of(" \tL");
    if (a == std::string::npos) continue;
    const std::string t = tok.substr(a, b - a + 1);
    if (t.empty() || t.find_first_not_of("0123456789") != std::string::npos)
      throw std::runtime_error(path + ": malformed .npy header (shape entry '" + t + "')");
    // every dimension must fit the int64 the commands index with (a zero dimension would let any
    // other through the byte count below)
    if (t.size() > 19 || std::stoull(t) > static_cast<unsigned long long>(INT64_MAX))
      throw std::runtime_error(path + ": .npy shape entry " + t + " is too large (over 2^63 - 1)");
    shape.push_back(static_cast<size_t>(std::stoull(t)));
  }
  size_t need = item;
  for (size_t dim : shape)
    if (__builtin_mul_overflow(need, dim, &need))
      throw std::runtime_error(path + ": .npy shape " + shape_string(shape) +
                               " is too large (its byte count overflows)");
  const size_t have = file_bytes - prefix - hlen;
  if (have < need)
    throw std::runtime_error(path + ": truncated .npy file (" + std::to_string(have) + " of " +
                             std::to_string(need) + " data bytes for shape " + shape_string(shape) +
                             ")");
  if (have > need)
    throw std::runtime_error(path + ": " + std::to_string(have - need) +
                             " bytes after the data of shape " + shape_string(shape) +
                             " (corrupt header or file)");
}

}  // namespace

void require_readable_file(const std::string& path, const std::string& what) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw std::runtime_error(path + ": is a directory, not " + what);
  std::ifstream probe(path, std::ios::binary);
  if (!probe)
    throw std::runtime_error(path + ": cannot open for reading (" + std::strerror(errno) + ")");
}

NpyArray read_npy(const std::string& path) {
  require_readable_file(path, "a .npy file");
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw std::runtime_error(path + ": cannot open for reading (" + std::strerror(errno) + ")");
  char magic[6] = {};
  in.read(magic, 6);
  if (!in || std::string(magic, 6) != "\x93NUMPY")
    throw std::runtime_error(path + ": not a .npy file (bad magic bytes)");
  check_npy_size(path, in);
  in.clear();
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
    throw std::runtime_error(path +
                             ": Fortran-ordered arrays are not supported (save with C order)");
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
  size_t bytes = sizeof(T);
  for (size_t d : shape)
    if (__builtin_mul_overflow(bytes, d, &bytes))
      throw std::invalid_argument(model::shown_path(path) + ": shape " + shape_string(shape) +
                                  " is too large (its byte count overflows)");
  std::ostringstream header;  // xtensor's header: magic, version, dict, padding to 64 bytes
  xt::detail::write_header(header, xt::detail::build_typestring<T>(), false, shape);
  model::OutputFile out(path);
  out.write(header.str());
  out.write(data, bytes);
  out.sync();
  out.close();
}
}  // namespace

void write_text(const std::string& path, const std::string& text) {
  model::write_whole_file(path, text);
}

void write_npy_f32(const std::string& p, const float* d, const std::vector<size_t>& s) {
  write_npy(p, d, s);
}
void write_npy_u8(const std::string& p, const uint8_t* d, const std::vector<size_t>& s) {
  write_npy(p, d, s);
}
void write_npy_u16(const std::string& p, const uint16_t* d, const std::vector<size_t>& s) {
  write_npy(p, d, s);
}

namespace {
// The same file: by device and inode where both exist, else by their resolved names.
bool same_file(const std::string& a, const std::string& b) {
  std::error_code ec1, ec2;
  if (std::filesystem::exists(a, ec1) && std::filesystem::exists(b, ec2))
    return std::filesystem::equivalent(a, b, ec1) && !ec1;
  const auto ca = std::filesystem::weakly_canonical(a, ec1),
             cb = std::filesystem::weakly_canonical(b, ec2);
  return !ec1 && !ec2 ? ca == cb : a == b;
}
}  // namespace

void check_outputs(const std::vector<std::string>& outputs,
                   const std::vector<std::string>& inputs) {
  namespace fs = std::filesystem;
  for (const std::string& out : outputs) {
    const size_t slash = out.rfind('/');
    const std::string name = out.substr(slash == std::string::npos ? 0 : slash + 1);
    const std::string dir = slash == std::string::npos ? "." : out.substr(0, slash + 1);
    if (name.empty() || name == "." || name == "..")
      throw std::invalid_argument(out + ": names a folder, not a file; nothing was written");
    const size_t name_max = model::name_max_for(out);
    if (name.size() > name_max)
      throw std::invalid_argument(out + ": the file name is " + std::to_string(name.size()) +
                                  " bytes, its folder takes at most " + std::to_string(name_max) +
                                  "; nothing was written");
    std::error_code ec;
    if (!fs::is_directory(dir, ec))
      throw std::invalid_argument(out + ": the folder " + dir +
                                  (fs::exists(dir, ec) ? " is not a folder" : " does not exist") +
                                  " (output folders must exist); nothing was written");
    if (fs::is_directory(out, ec))
      throw std::invalid_argument(out + ": is a directory; nothing was written");
    for (const std::string& in : inputs)
      if (same_file(out, in))
        throw std::invalid_argument(out + ": is " + (in == out ? "an input" : "the input " + in) +
                                    " of this command; writing it would replace what is read. "
                                    "Give another output name; nothing was written");
  }
}

void check_output_prefix(const std::string& prefix, const std::string& what) {
  const size_t slash = prefix.rfind('/');
  const std::string name = prefix.substr(slash == std::string::npos ? 0 : slash + 1);
  if (name.empty() || name == "." || name == "..")
    throw std::invalid_argument(what + " '" + prefix +
                                "' ends in a folder, not a file-name prefix (it would write "
                                "hidden files such as '" +
                                prefix + (name.empty() ? "" : "/") +
                                ".meta.json'): give one such as '" + prefix +
                                (name.empty() ? "" : "/") + "x'");
}

AtomicOutputs::~AtomicOutputs() {
  for (auto& f : files_) {
    if (!committed_) std::remove(f.first.c_str());
    model::forget_staged(f.first);
  }
}

std::string AtomicOutputs::stage(const std::string& final_path) {
  const std::string tmp = model::staged_path(final_path);
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
      // ones (files of an earlier run under those names were replaced by them, so they are gone
      // too)
      for (size_t j = 0; j < i; ++j) std::remove(files_[j].second.c_str());
      throw std::runtime_error(
          files_[i].second + ": cannot move the finished file into place (" + std::strerror(err) +
          "); no output of this run was kept" +
          (i ? ", and the " + std::to_string(i) + " it had already moved are removed" : ""));
    }
  }
  committed_ = true;
}

}  // namespace fp4sim::io
