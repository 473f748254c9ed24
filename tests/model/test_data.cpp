// Token files and the corpus split.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "model/data.hpp"
#include "tests/model/expect_error.hpp"

namespace fp4sim::model {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir(const char* name) {
  fs::path p = fs::temp_directory_path() /
               (std::string("fp4sim_test_") + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

TEST(Data, TokenFileRoundTrip) {
  const fs::path d = temp_dir("roundtrip");
  TokenFile f = synthetic_tokens(1000, 256, 3);
  write_token_file((d / "a.tokens").string(), f);
  const TokenFile g = read_token_file((d / "a.tokens").string());
  EXPECT_EQ(g.vocab, 256u);
  EXPECT_EQ(g.tokens, f.tokens);
  fs::remove_all(d);
}

TEST(Data, CorruptFilesAreClearErrors) {
  const fs::path d = temp_dir("corrupt");
  write_token_file((d / "a.tokens").string(), synthetic_tokens(1000, 256, 3));
  // truncated
  fs::resize_file(d / "a.tokens", 64 + 500);
  try {
    read_token_file((d / "a.tokens").string());
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
  // truncated inside the header (the magic is there): truncated, not "bad magic"
  fs::resize_file(d / "a.tokens", 30);
  try {
    read_token_file((d / "a.tokens").string());
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("truncated token file (30 bytes"), std::string::npos)
        << e.what();
  }
  // not a token file
  std::ofstream((d / "b.tokens").string())
      << "hello world, this is not a token file at all, not even close......";
  try {
    read_token_file((d / "b.tokens").string());
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("bad magic"), std::string::npos) << e.what();
  }
  // wrong version
  write_token_file((d / "c.tokens").string(), synthetic_tokens(10, 256, 3));
  {
    std::fstream f((d / "c.tokens").string(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    const uint32_t v = 99;
    f.write(reinterpret_cast<const char*>(&v), 4);
  }
  try {
    read_token_file((d / "c.tokens").string());
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("version 99"), std::string::npos) << e.what();
  }
  EXPECT_THROW(read_token_file((d / "missing.tokens").string()), std::runtime_error);
  // a count that disagrees with the file's size: bytes after the tokens, or a huge count (checked
  // before anything is allocated)
  write_token_file((d / "e.tokens").string(), synthetic_tokens(10, 256, 3));
  std::ofstream((d / "e.tokens").string(), std::ios::app | std::ios::binary) << "xy";
  {
    std::fstream f((d / "f.tokens").string(), std::ios::out | std::ios::binary);
    write_token_file((d / "f.tokens").string(), synthetic_tokens(10, 256, 3));
  }
  {
    std::fstream f((d / "f.tokens").string(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(16);
    const uint64_t huge = uint64_t{1} << 60;
    f.write(reinterpret_cast<const char*>(&huge), 8);
  }
  for (const auto& [name, needle] :
       {std::pair<std::string, std::string>{"e.tokens", "bytes after"}, {"f.tokens", "truncated"}})
    test::expect_error_containing<std::runtime_error>([&] { read_token_file((d / name).string()); },
                                                      {needle, name}, name + " was read");
  fs::remove_all(d);
}

TEST(Data, CorpusSplitIsFixedBySortedPaths) {
  const fs::path d = temp_dir("corpus");
  for (int i = 0; i < 10; ++i)
    std::ofstream((d / ("doc" + std::to_string(i) + ".txt")).string()) << "document " << i;
  std::ofstream((d / "ignored.json").string()) << "{}";
  const auto files = collect_text_files({d.string()});
  ASSERT_EQ(files.size(), 10u);
  const CorpusSplit s = build_corpus(files, 5);
  EXPECT_EQ(s.documents, 10);
  EXPECT_EQ(s.val_documents, 2);  // doc4 and doc9
  EXPECT_EQ(detokenize_bytes(s.val.tokens), "document 4\n\ndocument 9");
  EXPECT_EQ(build_corpus(files, 5).train.tokens, s.train.tokens);
  EXPECT_THROW(collect_text_files({(d / "nope").string()}), std::runtime_error);
  // fewer files than val_every (one here): each file's last bytes / val_every bytes to validation
  const CorpusSplit one = build_corpus({files[0]}, 5);  // "document 0": 10 bytes
  EXPECT_TRUE(one.split_documents);
  EXPECT_EQ(detokenize_bytes(one.train.tokens), "document");
  EXPECT_EQ(detokenize_bytes(one.val.tokens), " 0");
  // too little text for a validation part
  std::ofstream((d / "tiny.txt").string()) << "abc";
  EXPECT_THROW(build_corpus({(d / "tiny.txt").string()}, 5), std::runtime_error);
  fs::remove_all(d);
}

}  // namespace
}  // namespace fp4sim::model
