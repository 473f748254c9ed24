// safetensors files and atomic checkpoints.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "emu/contract.hpp"
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

// Replaces a checkpoint's state.json by `text` and lists it in manifest.json as the writer would:
// a checkpoint whose files are consistent, as one written by another fp4sim would be.
void reseal_state(const fs::path& where, const std::string& text) {
  std::ofstream(where / "state.json", std::ios::binary | std::ios::trunc) << text;
  nlohmann::json m;
  std::ifstream(where / "manifest.json") >> m;
  m["files"]["state.json"] = {{"bytes", text.size()},
                              {"sha256", sha256_hex(text.data(), text.size())}};
  m.erase("sha256");
  const std::string body = m.dump();
  m["sha256"] = sha256_hex(body.data(), body.size());  // (its own hash: of itself without it)
  std::ofstream(where / "manifest.json", std::ios::trunc) << m.dump(2);
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
    reseal_state(all.back(), s.dump());
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

TEST(Checkpoint, Sha256KnownAnswers) {
  EXPECT_EQ(sha256_hex("", 0), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc", 3),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

// The message of load_checkpoint(path)'s error, "(loaded)" when it loads.
std::string load_error(const fs::path& path) {
  try {
    load_checkpoint(path.string());
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(loaded)";
}

// Every file of a checkpoint carries the step and a SHA-256: the manifest lists each file, the
// safetensors metadata each tensor.
TEST(Checkpoint, ManifestAndTensorHashesWritten) {
  const fs::path d = temp_dir("manifest");
  const fs::path where = save_checkpoint(d.string(), small_checkpoint(7, 3), 0);
  std::ifstream in(where / "manifest.json");
  nlohmann::json m;
  in >> m;
  EXPECT_EQ(m["step"], 7);
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "state.json"}) {
    const std::string bytes = read_bytes(where / f);
    EXPECT_EQ(m["files"][f]["sha256"], sha256_hex(bytes.data(), bytes.size())) << f;
    EXPECT_EQ(m["files"][f]["bytes"], bytes.size()) << f;
  }
  std::map<std::string, std::string> meta;
  const TensorMap t = read_safetensors((where / "model.safetensors").string(), &meta);
  EXPECT_EQ(meta.at("step"), "7");
  EXPECT_EQ(meta.at("sha256:w"), sha256_hex(t.at("w").bytes.data(), t.at("w").bytes.size()));
  EXPECT_EQ(load_checkpoint(where.string()).step, 7);
  fs::remove_all(d);
}

// Every byte of every file, flipped (all bits, and the lowest bit): the load is refused with an
// error naming the file; a flip in a tensor's data names the tensor.
TEST(Checkpoint, EveryFlippedByteIsRefusedNamingTheFile) {
  const fs::path d = temp_dir("flip");
  const fs::path where = save_checkpoint(d.string(), small_checkpoint(3, 1), 0);
  int64_t cases = 0;
  for (const char* f :
       {"model.safetensors", "optimizer.safetensors", "state.json", "manifest.json"}) {
    const std::string good = read_bytes(where / f);
    uint64_t header = 0;
    std::memcpy(&header, good.data(), 8);
    for (size_t i = 0; i < good.size(); ++i)
      for (unsigned char mask : {0xffu, 0x01u}) {
        std::string bad = good;
        bad[i] = static_cast<char>(bad[i] ^ mask);
        write_bytes(where / f, bad);
        const std::string e = load_error(where);
        ++cases;
        EXPECT_NE(e.find(f), std::string::npos)
            << f << " byte " << i << " ^ " << int(mask) << ": " << e;
        const bool in_data =
            std::string(f).find("safetensors") != std::string::npos && i >= 8 + header;
        if (in_data) {
          EXPECT_NE(e.find("tensor 'w"), std::string::npos) << e;
        }
      }
    write_bytes(where / f, good);
  }
  EXPECT_GT(cases, 1000);
  EXPECT_EQ(load_checkpoint(where.string()).step, 3);  // restored: loads again
  fs::remove_all(d);
}

// A file copied in from another checkpoint (each carries its step) is refused naming it.
TEST(Checkpoint, FileOfAnotherStepRefused) {
  const fs::path d = temp_dir("steps");
  const fs::path two = save_checkpoint(d.string(), small_checkpoint(2, 2), 0);
  const fs::path four = save_checkpoint(d.string(), small_checkpoint(4, 4), 0);
  const std::map<std::string, std::string> needles = {
      {"model.safetensors", "model.safetensors holds step 2, its checkpoint's state.json step 4"},
      {"optimizer.safetensors", "optimizer.safetensors holds step 2"},
      {"state.json", "state.json holds step 2, " + (four / "manifest.json").string() + " step 4"},
      {"manifest.json",
       "state.json holds step 4, " + (four / "manifest.json").string() + " step 2"}};
  for (const auto& [f, needle] : needles) {
    const std::string good = read_bytes(four / f);
    fs::copy_file(two / f, four / f, fs::copy_options::overwrite_existing);
    const std::string e = load_error(four);
    EXPECT_NE(e.find(needle), std::string::npos) << e;
    write_bytes(four / f, good);
  }
  EXPECT_EQ(load_checkpoint(four.string()).step, 4);
  fs::remove_all(d);
}

// Bytes after the data, gaps between tensors and overlapping tensors are refused.
TEST(Checkpoint, SafetensorsDataMustTileExactly) {
  const fs::path d = temp_dir("tile");
  const fs::path where = save_checkpoint(d.string(), small_checkpoint(1, 1), 0);
  std::ofstream(where / "model.safetensors", std::ios::binary | std::ios::app) << "junk";
  EXPECT_NE(load_error(where).find("model.safetensors: 4 trailing bytes after the data"),
            std::string::npos)
      << load_error(where);
  auto write_raw = [&](const std::string& name, const std::string& header, size_t data_bytes) {
    std::string h = header;
    while (h.size() % 8) h += ' ';
    std::ofstream out((d / name).string(), std::ios::binary);
    const uint64_t n = h.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << h << std::string(data_bytes, '\0');
  };
  write_raw("gap.safetensors",
            R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
            R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
            12);
  write_raw("overlap.safetensors",
            R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
            R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
            8);
  write_raw("dup.safetensors",
            R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
            R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
            4);
  for (const auto& [name, needle] : std::vector<std::pair<std::string, std::string>>{
           {"gap.safetensors", "4 bytes before tensor 'b' belong to no tensor"},
           {"overlap.safetensors", "overlaps tensor"},
           {"dup.safetensors", "duplicate key 'a'"}})
    test::expect_error_containing<std::runtime_error>(
        [&] { read_safetensors((d / name).string()); }, {name, needle}, name + " was read");
  fs::remove_all(d);
}

// A NaN or Inf in the weights or the optimizer state is never written: the save fails naming the
// file, the tensor and the element, leaves no folder, and the earlier checkpoints stay.
TEST(Checkpoint, NonFiniteValuesAreNeverSaved) {
  const fs::path d = temp_dir("nonfinite");
  save_checkpoint(d.string(), small_checkpoint(1, 1), 0);
  for (const float bad : {std::nanf(""), -INFINITY}) {
    Checkpoint ck = small_checkpoint(2, 2);
    std::memcpy(ck.optimizer.at("w.m").bytes.data() + 8, &bad, 4);
    test::expect_error_containing<std::runtime_error>(
        [&] { save_checkpoint(d.string(), ck, 0); },
        {"step_00000002 not written", "optimizer.safetensors: tensor 'w.m' holds",
         std::isnan(bad) ? "NaN at element 2 (of 4)" : "-Inf at element 2 (of 4)",
         "the earlier checkpoints are untouched"},
        "a non-finite value was saved");
  }
  std::vector<std::string> names;
  for (const fs::directory_entry& e : fs::directory_iterator(d))
    names.push_back(e.path().filename().string());
  EXPECT_EQ(names, std::vector<std::string>{"step_00000001"});
  EXPECT_EQ(load_checkpoint(d.string()).step, 1);
  // first_nonfinite on each floating-point dtype; integers are never non-finite
  StoredTensor bf16{"BF16", {3}, {0x80, 0x3f, 0x00, 0x00, 0x81, 0x7f}};  // 1, 0, NaN
  EXPECT_EQ(first_nonfinite(bf16), 2);
  StoredTensor f16{"F16", {2}, {0x00, 0x3c, 0x00, 0xfc}};  // 1, -Inf
  EXPECT_EQ(first_nonfinite(f16), 1);
  StoredTensor u8{"U8", {2}, {0xff, 0xff}};
  EXPECT_EQ(first_nonfinite(u8), -1);
  fs::remove_all(d);
}

// A checkpoint without manifest.json (written before the hashes) is refused, unless
// FP4SIM_ALLOW_UNVERIFIED_CHECKPOINT=1; then it loads, its steps and values still checked.
TEST(Checkpoint, UnverifiedCheckpointRefusedUnlessAllowed) {
  const fs::path d = temp_dir("legacy");
  const fs::path where = save_checkpoint(d.string(), small_checkpoint(6, 6), 0);
  Checkpoint ck = load_checkpoint(where.string());
  // as the writer before the hashes wrote it: contract_version and step, no hashes, no manifest
  const std::map<std::string, std::string> meta = {
      {"contract_version", std::to_string(kContractVersion)}, {"step", "6"}};
  write_safetensors((where / "model.safetensors").string(), ck.model, meta);
  write_safetensors((where / "optimizer.safetensors").string(), ck.optimizer, meta);
  fs::remove(where / "manifest.json");
  ::unsetenv("FP4SIM_ALLOW_UNVERIFIED_CHECKPOINT");
  EXPECT_NE(load_error(where).find("no manifest.json"), std::string::npos) << load_error(where);
  ::setenv("FP4SIM_ALLOW_UNVERIFIED_CHECKPOINT", "1", 1);
  EXPECT_EQ(load_checkpoint(where.string()).model.at("w").bytes, ck.model.at("w").bytes);
  const float inf = INFINITY;
  std::memcpy(ck.model.at("w").bytes.data() + 12, &inf, 4);
  write_safetensors((where / "model.safetensors").string(), ck.model, meta);
  EXPECT_NE(load_error(where).find("model.safetensors: tensor 'w' holds +Inf at element 3 (of 4)"),
            std::string::npos)
      << load_error(where);
  write_safetensors((where / "model.safetensors").string(), ck.model,
                    {{"contract_version", std::to_string(kContractVersion)}, {"step", "5"}});
  EXPECT_NE(load_error(where).find("model.safetensors holds step 5"), std::string::npos);
  ::unsetenv("FP4SIM_ALLOW_UNVERIFIED_CHECKPOINT");
  fs::remove_all(d);
}

}  // namespace
}  // namespace fp4sim::model
