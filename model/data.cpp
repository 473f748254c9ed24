#include "model/data.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>

#include "model/output_file.hpp"

namespace fp4sim::model {

namespace fs = std::filesystem;

TokenFile read_token_file(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec))
    throw std::runtime_error(path + ": is a directory, not a token file");
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw std::runtime_error(path + ": cannot open token file (" + std::strerror(errno) + ")");
  char header[kTokenFileHeaderBytes] = {};
  in.read(header, kTokenFileHeaderBytes);
  if (in.gcount() >= 8 && std::memcmp(header, kTokenFileMagic, 8) == 0 &&
      in.gcount() != kTokenFileHeaderBytes)
    throw std::runtime_error(path + ": truncated token file (" + std::to_string(in.gcount()) +
                             " bytes, the header alone is " +
                             std::to_string(kTokenFileHeaderBytes) + ")");
  if (in.gcount() != kTokenFileHeaderBytes || std::memcmp(header, kTokenFileMagic, 8) != 0)
    throw std::runtime_error(path +
                             ": not an fp4sim token file (bad magic); build one with "
                             "`fp4sim data build`");
  uint32_t version, vocab;
  uint64_t count;
  std::memcpy(&version, header + 8, 4);
  std::memcpy(&vocab, header + 12, 4);
  std::memcpy(&count, header + 16, 8);
  if (version != kTokenFileVersion)
    throw std::runtime_error(path + ": token file version " + std::to_string(version) +
                             ", this build reads version " + std::to_string(kTokenFileVersion));
  // the count against the file's size before anything is allocated (a corrupt count would
  // otherwise ask for terabytes, or leave trailing bytes unread)
  const auto data_bytes = static_cast<uint64_t>(fs::file_size(path)) - kTokenFileHeaderBytes;
  if (count > data_bytes / 2)
    throw std::runtime_error(path + ": truncated token file (" + std::to_string(data_bytes / 2) +
                             " of " + std::to_string(count) + " tokens)");
  if (count * 2 != data_bytes)
    throw std::runtime_error(path + ": " + std::to_string(data_bytes - count * 2) +
                             " bytes after the " + std::to_string(count) +
                             " tokens the header announces (corrupt file)");
  TokenFile f;
  f.vocab = vocab;
  f.tokens.resize(count);
  in.read(reinterpret_cast<char*>(f.tokens.data()), static_cast<std::streamsize>(count * 2));
  if (static_cast<uint64_t>(in.gcount()) != count * 2)
    throw std::runtime_error(path + ": truncated token file (" + std::to_string(in.gcount() / 2) +
                             " of " + std::to_string(count) + " tokens)");
  for (uint64_t i = 0; i < count; ++i)
    if (f.tokens[i] >= vocab)
      throw std::runtime_error(path + ": token " + std::to_string(f.tokens[i]) + " at position " +
                               std::to_string(i) + " is outside the vocabulary of " +
                               std::to_string(vocab));
  return f;
}

void write_token_file(const std::string& path, const TokenFile& f) {
  char header[kTokenFileHeaderBytes] = {};
  std::memcpy(header, kTokenFileMagic, 8);
  const uint64_t count = f.tokens.size();
  std::memcpy(header + 8, &kTokenFileVersion, 4);
  std::memcpy(header + 12, &f.vocab, 4);
  std::memcpy(header + 16, &count, 8);
  OutputFile out(path);
  out.write(header, kTokenFileHeaderBytes);
  out.write(f.tokens.data(), count * 2);
  out.sync();
  out.close();
}

std::vector<uint16_t> tokenize_bytes(const std::string& text) {
  std::vector<uint16_t> t(text.size());
  for (size_t i = 0; i < text.size(); ++i) t[i] = static_cast<unsigned char>(text[i]);
  return t;
}

std::string detokenize_bytes(const std::vector<uint16_t>& tokens) {
  std::string s(tokens.size(), '\0');
  for (size_t i = 0; i < tokens.size(); ++i) s[i] = static_cast<char>(tokens[i] & 0xFF);
  return s;
}

std::vector<std::string> collect_text_files(const std::vector<std::string>& inputs) {
  std::vector<std::string> files;
  for (const std::string& in : inputs) {
    std::error_code ec;
    const fs::file_status st = fs::status(in, ec);
    if (ec || !fs::exists(st)) throw std::runtime_error(in + ": no such file or folder");
    if (fs::is_directory(st)) {
      for (const auto& e : fs::recursive_directory_iterator(in))
        if (e.is_regular_file() && e.path().extension() == ".txt")
          files.push_back(e.path().string());
    } else {
      files.push_back(in);
    }
  }
  std::sort(files.begin(), files.end());
  files.erase(std::unique(files.begin(), files.end()), files.end());
  if (files.empty()) throw std::runtime_error("no .txt files found under the given inputs");
  return files;
}

CorpusSplit build_corpus(const std::vector<std::string>& files, int val_every) {
  if (val_every < 2) throw std::invalid_argument("--val-every must be at least 2");
  CorpusSplit s;
  s.split_documents = files.size() < static_cast<size_t>(val_every);
  auto append = [](TokenFile& dst, const std::string& text) {
    if (!dst.tokens.empty()) {
      dst.tokens.push_back('\n');
      dst.tokens.push_back('\n');
    }
    const std::vector<uint16_t> t = tokenize_bytes(text);
    dst.tokens.insert(dst.tokens.end(), t.begin(), t.end());
  };
  for (size_t i = 0; i < files.size(); ++i) {
    std::ifstream in(files[i], std::ios::binary);
    if (!in) throw std::runtime_error(files[i] + ": cannot read");
    std::stringstream ss;
    ss << in.rdbuf();
    std::string text = ss.str();
    if (text.empty()) continue;
    ++s.documents;
    if (s.split_documents) {  // the document's last 1/val_every bytes to validation
      const size_t cut = text.size() - text.size() / static_cast<size_t>(val_every);
      append(s.train, text.substr(0, cut));
      if (cut < text.size()) {
        append(s.val, text.substr(cut));
        ++s.val_documents;
      }
      continue;
    }
    const bool val = static_cast<int>(i % static_cast<size_t>(val_every)) == val_every - 1;
    append(val ? s.val : s.train, text);
    if (val) ++s.val_documents;
  }
  if (s.train.tokens.empty() || s.val.tokens.empty())
    throw std::runtime_error(
        s.split_documents
            ? "the corpus needs at least " + std::to_string(val_every) +
                  " bytes of text to have both a training and a validation split"
            : "the corpus needs at least " + std::to_string(val_every) +
                  " non-empty documents in its first " + std::to_string(val_every) +
                  " files to have both a training and a validation split (validation takes "
                  "every " +
                  std::to_string(val_every) + "th file in sorted path order)");
  return s;
}

TokenFile synthetic_tokens(int64_t count, uint32_t vocab, uint64_t seed) {
  TokenFile f;
  f.vocab = vocab;
  f.tokens.resize(static_cast<size_t>(count));
  std::mt19937_64 rng(seed);
  for (auto& t : f.tokens) t = static_cast<uint16_t>(rng() % vocab);
  return f;
}

}  // namespace fp4sim::model
