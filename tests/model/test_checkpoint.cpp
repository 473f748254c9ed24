// safetensors files and atomic checkpoints.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "model/checkpoint.hpp"
#include "tests/model/expect_error.hpp"

namespace fp4sim::model {
namespace {

namespace fs = std::filesystem;

StoredTensor f32(std::vector<int64_t> shape, float start) {
  StoredTensor t;
  t.dtype = "F32";
  t.shape = shape;
  int64_t n = 1;
  for (auto d : shape) n *= d;
  t.bytes.resize(static_cast<size_t>(n) * 4);
  for (int64_t i = 0; i < n; ++i) {
    const float v = start + static_cast<float>(i);
    std::memcpy(&t.bytes[static_cast<size_t>(i) * 4], &v, 4);
  }
  return t;
}

// A small checkpoint of `step`: one weight holding the step, its optimizer state, a data position.
Checkpoint small_checkpoint(int64_t step, int64_t data_position) {
  Checkpoint ck;
  ck.step = step;
  ck.model = {{"w", f32({2, 2}, static_cast<float>(step))}};
  ck.optimizer = {{"w.m", f32({2, 2}, 0.0f)}};
  ck.state = {{"data_position", data_position}};
  return ck;
}

fs::path temp_dir(const char* name) {
  fs::path p = fs::temp_directory_path() /
               (std::string("fp4sim_ck_") + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

TEST(Checkpoint, SafetensorsRoundTripAndLayout) {
  const fs::path d = temp_dir("st");
  TensorMap m = {{"wte", f32({4, 3}, 1.0f)}, {"ln.bias", f32({3}, -1.0f)}};
  write_safetensors((d / "a.safetensors").string(), m, {{"note", "x"}});
  std::map<std::string, std::string> meta;
  const TensorMap r = read_safetensors((d / "a.safetensors").string(), &meta);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r.at("wte").bytes, m.at("wte").bytes);
  EXPECT_EQ(r.at("wte").shape, (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(meta.at("note"), "x");
  // layout: 8-byte header length, then a JSON header starting with '{'
  std::ifstream in((d / "a.safetensors").string(), std::ios::binary);
  uint64_t n;
  in.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(in.get(), '{');
  // truncated
  fs::resize_file(d / "a.safetensors", fs::file_size(d / "a.safetensors") - 4);
  EXPECT_THROW(read_safetensors((d / "a.safetensors").string()), std::runtime_error);
  fs::remove_all(d);
}

// keep-last counts the checkpoint just written and the earlier ones only: saving step 15 into a
// folder that already holds step 20 keeps 15 (and leaves 20 alone, for the trainer to refuse).
// Malformed safetensors headers: errors that name the file (and the tensor), no crash.
TEST(Checkpoint, MalformedSafetensorsAreClearErrors) {
  const fs::path d = temp_dir("bad");
  auto write_raw = [&](const std::string& name, const std::string& header, size_t data_bytes) {
    std::string h = header;
    while (h.size() % 8) h += ' ';
    std::ofstream out((d / name).string(), std::ios::binary);
    const uint64_t n = h.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << h << std::string(data_bytes, '\0');
  };
  write_raw("array.safetensors", "[1,2]", 0);
  write_raw("dtype.safetensors", R"({"w":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", 8);
  write_raw("neg.safetensors", R"({"w":{"dtype":"F32","shape":[-2,-2],"data_offsets":[0,16]}})",
            16);
  write_raw("nodtype.safetensors", R"({"w":{"shape":[2],"data_offsets":[0,8]}})", 8);
  write_raw("past.safetensors",
            R"({"w":{"dtype":"F32","shape":[4],"data_offsets":)"
            R"([18446744073709551584,18446744073709551600]}})",
            16);
  for (const auto& [name, needle] :
       std::vector<std::pair<std::string, std::string>>{{"array.safetensors", "not a JSON object"},
                                                        {"dtype.safetensors", "unknown dtype"},
                                                        {"neg.safetensors", "impossible shape"},
                                                        {"nodtype.safetensors", "'w'"},
                                                        {"past.safetensors", "truncated"}})
    test::expect_error_containing<std::runtime_error>(
        [&] { read_safetensors((d / name).string()); }, {name, needle}, name + " was read");
  fs::remove_all(d);
}

TEST(Checkpoint, KeepLastNeverRemovesTheCheckpointJustWritten) {
  const fs::path d = temp_dir("keep");
  for (int64_t step : {5, 20, 10, 15}) {
    const std::string where = save_checkpoint(d.string(), small_checkpoint(step, step), 1);
    EXPECT_TRUE(fs::exists(fs::path(where) / "state.json"))
        << "step " << step << " was removed right after it was written";
  }
  std::vector<std::string> names;
  for (const std::string& c : list_checkpoints(d.string()))
    names.push_back(fs::path(c).filename().string());
  EXPECT_EQ(names, (std::vector<std::string>{"step_00000015", "step_00000020"}));
  fs::remove_all(d);
}

// The half-written folder a dead process left (a crash mid-write) is removed by the next save; one
// of a live process (here: this one) is not, nor is anything not named like a checkpoint's.
TEST(Checkpoint, NextSaveRemovesHalfWrittenFoldersOfDeadProcesses) {
  const fs::path d = temp_dir("stale");
  const fs::path dead = d / "step_00000003.tmp-2147483646",
                 live = d / ("step_00000009.tmp-" + std::to_string(::getpid()));
  const fs::path other = d / "notes.tmp-2147483646";
  for (const fs::path& p : {dead, live, other}) {
    fs::create_directories(p);
    std::ofstream(p / "model.safetensors") << "partial";
  }
  save_checkpoint(d.string(), small_checkpoint(4, 4), 0);
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(other));
  EXPECT_EQ(load_checkpoint(d.string()).step, 4);
  fs::remove_all(d);
}

// A model or optimizer file whose own metadata names another contract version is refused.
TEST(Checkpoint, SafetensorsMetadataVersionChecked) {
  const fs::path d = temp_dir("metaver");
  const std::string where = save_checkpoint(d.string(), small_checkpoint(2, 2), 0);
  const Checkpoint ck = load_checkpoint(where);
  write_safetensors((fs::path(where) / "optimizer.safetensors").string(), ck.optimizer,
                    {{"contract_version", "9"}});
  try {
    load_checkpoint(where);
    ADD_FAILURE() << "expected contract_version 9 to be refused";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer.safetensors: written under contract_version 9"),
              std::string::npos)
        << e.what();
  }
  fs::remove_all(d);
}

TEST(Checkpoint, AtomicKeepLastAndVersionCheck) {
  const fs::path d = temp_dir("run");
  for (int64_t step : {5, 10, 15, 20})
    save_checkpoint(d.string(), small_checkpoint(step, step * 100), 2);
  // a crash mid-write leaves a temporary directory: it is never taken for a checkpoint
  fs::create_directories(d / "step_00000025.tmp-999");
  const auto all = list_checkpoints(d.string());
  ASSERT_EQ(all.size(), 2u);
  const Checkpoint latest = load_checkpoint(d.string());
  EXPECT_EQ(latest.step, 20);
  // a run's out_dir (checkpoints in its checkpoints/ folder) names its latest checkpoint too
  {
    const fs::path run = temp_dir("outdir");
    fs::create_directories(run);
    fs::copy(d, run / "checkpoints", fs::copy_options::recursive);
    EXPECT_EQ(load_checkpoint(run.string()).step, 20);
    fs::remove_all(run);
  }
  EXPECT_EQ(latest.state["data_position"], 2000);
  EXPECT_EQ(latest.model.at("w").bytes, f32({2, 2}, 20.0f).bytes);
  // a checkpoint from another contract version is refused
  {
    std::ifstream in((fs::path(all.back()) / "state.json").string());
    nlohmann::json s;
    in >> s;
    s["contract_version"] = 99;
    std::ofstream((fs::path(all.back()) / "state.json").string()) << s.dump();
  }
  try {
    load_checkpoint(d.string());
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("contract_version 99"), std::string::npos) << e.what();
  }
  EXPECT_THROW(load_checkpoint((d / "nothing").string()), std::runtime_error);
  fs::remove_all(d);
}

}  // namespace
}  // namespace fp4sim::model
