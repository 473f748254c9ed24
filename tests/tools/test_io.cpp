// The CLI's file I/O: every write checked (a full disk is /dev/full here, so no root is needed),
// staged outputs named by their final path, npy headers and paths refused with what is wrong.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "model/data.hpp"
#include "model/output_file.hpp"
#include "tests/model/expect_error.hpp"
#include "tools/npy.hpp"

namespace fp4sim {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("fp4sim_test_io_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

// /dev/full takes the open and fails every write with ENOSPC, as a full disk does
constexpr const char* kFull = "/dev/full";

TEST(OutputFile, FullDiskIsAnErrorNamingThePathAndReason) {
  if (!fs::exists(kFull)) GTEST_SKIP() << "no /dev/full";
  test::expect_error_containing<std::runtime_error>(
      [] {
        model::OutputFile f(kFull);
        f.write(std::string("one line\n"));
        f.close();
      },
      {"/dev/full: write failed (No space left on device)"}, "a write to /dev/full passed");
  test::expect_error_containing<std::runtime_error>(
      [] {
        model::OutputFile f(kFull, model::OutputFile::Mode::Append);
        f.write("x", 1);
      },
      {"/dev/full: write failed (No space left on device)"}, "an append to /dev/full passed");
  test::expect_error_containing<std::runtime_error>([] { model::write_whole_file(kFull, "text"); },
                                                    {"/dev/full", "No space left"},
                                                    "write_whole_file to /dev/full passed");
}

TEST(OutputFile, OpenFailureNamesThePathAndReason) {
  test::expect_error_containing<std::runtime_error>(
      [] { model::OutputFile f("/nonexistent-folder/x.npy"); },
      {"/nonexistent-folder/x.npy: cannot open for writing (No such file or directory)"},
      "opening a file in a missing folder passed");
}

TEST(OutputFile, WritesAppendsAndStagedNames) {
  const fs::path d = temp_dir("write");
  const std::string p = (d / "log.jsonl").string();
  {
    model::OutputFile f(p);
    f.write(std::string("a\n"));
    f.close();
  }
  {
    model::OutputFile f(p, model::OutputFile::Mode::Append);
    f.write(std::string("b\n"));
    f.sync();
    f.close();
  }
  std::ifstream in(p);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "a\nb\n");
  // a staged path is shown as its final path until it is forgotten
  const std::string staged = model::staged_path(p);
  EXPECT_NE(staged, p);
  EXPECT_EQ(model::shown_path(staged), p);
  model::forget_staged(staged);
  EXPECT_EQ(model::shown_path(staged), staged);
  fs::remove_all(d);
}

TEST(OutputFile, StagedNamesStayWithinNameMax) {
  const fs::path d = temp_dir("name_max");
  // a final name of 250 bytes fits; its temporary name must too, and two of them must differ
  const std::string base = (d / std::string(250, 'n')).string();
  const size_t name_max = model::name_max_for(base);
  const std::string s1 = model::staged_path(base + "1"), s2 = model::staged_path(base + "2");
  for (const std::string& s : {s1, s2}) {
    EXPECT_LE(fs::path(s).filename().string().size(), name_max) << s;
    EXPECT_EQ(fs::path(s).parent_path(), d);
    model::OutputFile f(s);  // (creating it is what NAME_MAX would refuse)
    f.close();
  }
  EXPECT_NE(s1, s2);
  EXPECT_EQ(model::shown_path(s1), base + "1");
  model::forget_staged(s1);
  model::forget_staged(s2);
  fs::remove_all(d);
}

TEST(Npy, WritersReportAFullDisk) {
  if (!fs::exists(kFull)) GTEST_SKIP() << "no /dev/full";
  const std::vector<float> x(64, 1.0f);
  const std::vector<uint8_t> c(64, 1);
  const std::vector<uint16_t> h(64, 1);
  for (const auto& write : std::vector<std::function<void()>>{
           [&] {
             io::write_npy_f32(kFull, x.data(), {8, 8});
           },
           [&] {
             io::write_npy_u8(kFull, c.data(), {8, 8});
           },
           [&] {
             io::write_npy_u16(kFull, h.data(), {8, 8});
           },
           [&] { io::write_text(kFull, "{}\n"); },
           [&] { model::write_token_file(kFull, model::synthetic_tokens(100, 256, 1)); }})
    test::expect_error_containing<std::runtime_error>(
        write, {"/dev/full: write failed (No space left on device)"},
        "a write to /dev/full passed");
}

TEST(Npy, StagedOutputErrorsNameTheFinalPath) {
  if (!fs::exists(kFull)) GTEST_SKIP() << "no /dev/full";
  // a staged output whose temporary file is a full disk: the message names the user's path
  const fs::path d = temp_dir("staged");
  io::AtomicOutputs out;
  const std::string final_path = (d / "x.npy").string();
  const std::string tmp = out.stage(final_path);
  fs::create_symlink(kFull, tmp);
  const std::vector<float> x(16, 0.5f);
  test::expect_error_containing<std::runtime_error>(
      [&] {
        io::write_npy_f32(tmp, x.data(), {4, 4});
      },
      {final_path + ": write failed (No space left on device)"},
      "a staged write to /dev/full passed");
  fs::remove_all(d);
}

TEST(Npy, WriteReadRoundTrip) {
  const fs::path d = temp_dir("roundtrip");
  const std::vector<float> x = {1, 2, 3, 4, 5, 6};
  const std::string p = (d / "x.npy").string();
  io::write_npy_f32(p, x.data(), {2, 3});
  const io::NpyArray a = io::read_npy(p);
  EXPECT_EQ(a.dtype, "<f4");
  EXPECT_EQ(a.shape, (std::vector<size_t>{2, 3}));
  ASSERT_EQ(a.bytes.size(), 24u);
  EXPECT_EQ(std::memcmp(a.bytes.data(), x.data(), 24), 0);
  fs::remove_all(d);
}

}  // namespace
}  // namespace fp4sim
