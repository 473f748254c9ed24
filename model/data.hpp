// Token data for training: byte-level tokens (vocab 256) by default, stored as uint16 in a small
// binary file with a header that says what it holds. The trainer reads it and draws batches.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fp4sim::model {

constexpr char kTokenFileMagic[8] = {'F', 'P', '4', 'S', 'T', 'O', 'K', '1'};
constexpr uint32_t kTokenFileVersion = 1;
constexpr int kTokenFileHeaderBytes = 64;

struct TokenFile {
  uint32_t vocab = 256;
  std::vector<uint16_t> tokens;
};

// Throws std::runtime_error naming the file: missing, bad magic, other version, truncated, a token
// outside the vocabulary.
TokenFile read_token_file(const std::string& path);
// Writes and syncs the file, every step checked (model/output_file.hpp); a caller that needs it
// to appear whole or not at all stages it (fp4sim data build: tools/npy.hpp's AtomicOutputs).
void write_token_file(const std::string& path, const TokenFile& f);

// Byte-level tokenizer: one token per byte of UTF-8 text.
std::vector<uint16_t> tokenize_bytes(const std::string& text);
std::string detokenize_bytes(const std::vector<uint16_t>& tokens);

// Text files under the inputs (files, or folders searched recursively), in sorted path order.
std::vector<std::string> collect_text_files(const std::vector<std::string>& inputs);

struct CorpusSplit {
  TokenFile train, val;
  int64_t documents = 0, val_documents = 0;
  bool split_documents = false;  // fewer files than val_every: each file split (below)
};

// Each file is a document; document i goes to validation when i % val_every == val_every - 1, so
// the split is fixed by the sorted file list. With fewer files than val_every (a single text file,
// say), each document's last floor(bytes / val_every) bytes go to validation and the rest to
// training instead. Documents (and parts) are joined by a blank line.
CorpusSplit build_corpus(const std::vector<std::string>& files, int val_every);

// Deterministic synthetic tokens (uniform over the vocabulary) for throughput runs.
TokenFile synthetic_tokens(int64_t count, uint32_t vocab, uint64_t seed);

}  // namespace fp4sim::model
