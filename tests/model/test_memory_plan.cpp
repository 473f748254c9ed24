// Memory plans (model/memory_plan.hpp): the emulator's plan against the measured peak of a real
// run (resident memory for configs/tiny.json, within 10%; the backend's allocations exactly, over
// recipes and model shapes), runs that do not fit refused before anything is allocated, and
// allocation failures that name the buffer.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <new>
#include <string>
#include <vector>

#include "emu/cpu_backend.hpp"
#include "expect_error.hpp"
#include "gpu/capabilities.hpp"
#include "model/config.hpp"
#include "model/gpt.hpp"
#include "model/memory_plan.hpp"
#include "model/trainer.hpp"

namespace fp4sim::model {
namespace {

namespace fs = std::filesystem;

// The emulator, counting what it allocates: the bytes live and their peak, the calls; allocations
// over fail_above bytes throw std::bad_alloc, as malloc's failure does.
class CountingBackend : public emu::CpuBackend {
 public:
  void* allocate(size_t bytes) override {
    if (bytes > fail_above) throw std::bad_alloc();
    void* p = emu::CpuBackend::allocate(bytes);
    sizes_[p] = bytes;
    live += static_cast<int64_t>(bytes);
    peak = std::max(peak, live);
    ++calls;
    return p;
  }
  void release(void* p) override {
    live -= static_cast<int64_t>(sizes_.at(p));
    sizes_.erase(p);
    emu::CpuBackend::release(p);
  }
  int64_t live = 0, peak = 0, calls = 0;
  size_t fail_above = ~size_t{0};

 private:
  std::map<void*, size_t> sizes_;
};

std::string scratch_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / (name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p.string();
}

TrainOptions quiet() {
  TrainOptions o;
  o.print = false;
  return o;
}

// A small model under `recipe` (with the given extra overrides): a few steps in seconds.
RunConfig small_run(const std::string& out, const std::vector<std::string>& overrides) {
  nlohmann::json j = {{"model",
                       {{"vocab", 64},
                        {"seq_len", 32},
                        {"max_positions", 32},
                        {"d_model", 64},
                        {"n_layers", 2},
                        {"n_heads", 4},
                        {"n_kv_heads", 4},
                        {"d_ff", 128}}},
                      {"train",
                       {{"batch", 2},
                        {"steps", 3},
                        {"warmup", 1},
                        {"data", "synthetic"},
                        {"eval_every", 2},
                        {"eval_batches", 1},
                        {"out_dir", out}}}};
  return config_from_json(j, overrides);
}

// The plan's count of the backend's buffers is the count of a real run's allocations, exactly: the
// plan runs the code that allocates (the model, its linear layers, the fused ops' compositions, the
// trainer's moments), on every recipe and storage the steps switch between.
TEST(MemoryPlan, BuffersEqualARealRunsAllocations) {
  const std::vector<std::vector<std::string>> cases = {
      {},
      {"recipe.name=nvfp4", "recipe.hp_first=0", "recipe.hp_last=0", "recipe.stats_every=2"},
      {"recipe.name=nvfp4", "recipe.hp_first=0", "recipe.hp_last=1", "recipe.bf16_from_step=2"},
      {"recipe.name=mxfp4", "recipe.hp_first=0", "recipe.hp_last=0"},
      {"recipe.name=fp8", "recipe.hp_first=0", "recipe.hp_last=0", "model.d_model=128",
       "model.d_ff=256", "train.batch=4"},
      {"model.activation_dtype=fp32"},
      {"model.activation=swiglu", "model.norm=rmsnorm", "model.positions=rope",
       "model.n_kv_heads=2", "model.bias=false", "train.grad_accum=2"},
  };
  for (const std::vector<std::string>& overrides : cases) {
    std::string tag;
    for (const std::string& o : overrides) tag += o + " ";
    const std::string out = scratch_dir("mp_buffers");
    const RunConfig c = small_run(out, overrides);
    CountingBackend be;
    const TrainResult r = train(c, quiet(), be);
    PlanRequest req;
    const MemoryPlan plan = plan_training(c, req);
    EXPECT_EQ(plan.buffers_peak, be.peak) << tag;
    EXPECT_EQ(r.planned_memory, plan.peak) << tag;
    EXPECT_EQ(be.live, 0) << tag;
    fs::remove_all(out);
  }
}

// configs/tiny.json on the emulator: the plan within 10% of the peak resident memory the run adds
// to the process (VmHWM, reset before the run, minus VmRSS before it).
TEST(MemoryPlan, TinyPlanWithinTenPercentOfMeasuredPeak) {
  const std::string out = scratch_dir("mp_tiny");
  const std::string corpus = std::string(FP4SIM_SOURCE_DIR) + "/data/corpus";
  const bool have_corpus = fs::exists(corpus + ".train.tokens");
  RunConfig c = load_config(
      std::string(FP4SIM_SOURCE_DIR) + "/configs/tiny.json",
      {"train.steps=2", "train.warmup=1", "train.eval_every=2", "train.eval_batches=1",
       "train.out_dir=" + out, "train.data=" + (have_corpus ? corpus : std::string("synthetic"))});
  {
    std::ofstream reset("/proc/self/clear_refs");
    reset << "5";  // (resets VmHWM to the current resident size)
    reset.close();
    if (!reset) GTEST_SKIP() << "cannot reset the peak resident size (/proc/self/clear_refs)";
  }
  const int64_t before = resident_bytes();
  ASSERT_LT(peak_resident_bytes() - before, int64_t{1} << 20) << "VmHWM was not reset";
  emu::CpuBackend be;
  const TrainResult r = train(c, quiet(), be);
  const int64_t grown = peak_resident_bytes() - before;
  const double rel =
      static_cast<double>(grown - r.planned_memory) / static_cast<double>(r.planned_memory);
  std::printf(
      "tiny on the emulator (%s data): plan %lld bytes, measured peak %lld bytes above "
      "the %lld before the run: %+.2f%% (budget +-10%%)\n",
      have_corpus ? "corpus" : "synthetic", static_cast<long long>(r.planned_memory),
      static_cast<long long>(grown), static_cast<long long>(before), 100.0 * rel);
  EXPECT_LT(std::abs(rel), 0.10);
  fs::remove_all(out);
}

TEST(MemoryPlan, RunThatDoesNotFitIsRefusedBeforeAnyAllocation) {
  const std::string out = scratch_dir("mp_refuse");
  const RunConfig c = small_run(out, {});
  CountingBackend be;
  TrainOptions o = quiet();
  o.memory_limit = parse_memory_limit("64K");
  test::expect_error_containing<std::runtime_error>(
      [&] { train(c, o, be); },
      {"memory plan: the run needs", "64.00 KiB (65536 bytes)", "--memory-limit",
       "nothing was allocated", "parameters", "activations"},
      "a run over its memory limit was not refused");
  EXPECT_EQ(be.calls, 0);
  EXPECT_FALSE(fs::exists(out)) << "the refused run made its out_dir";
  o.memory_limit = parse_memory_limit("none");  // the override runs it
  EXPECT_NO_THROW(train(c, o, be));
  fs::remove_all(out);
}

TEST(MemoryPlan, MemoryLimitFlagIsParsedStrictly) {
  EXPECT_EQ(parse_memory_limit("auto").kind, MemoryLimitSetting::Kind::Auto);
  EXPECT_EQ(parse_memory_limit("none").kind, MemoryLimitSetting::Kind::None);
  EXPECT_EQ(parse_memory_limit("4096").bytes, 4096);
  EXPECT_EQ(parse_memory_limit("512M").bytes, int64_t{512} << 20);
  EXPECT_EQ(parse_memory_limit("1.5GiB").bytes, int64_t{3} << 29);
  EXPECT_EQ(parse_memory_limit("2T").bytes, int64_t{2} << 40);
  for (const char* bad : {"", "abc", "0", "-1", "5X", "1e30", "12 G", "nan"})
    test::expect_error_containing<std::invalid_argument>(
        [&] { parse_memory_limit(bad); }, {"--memory-limit", std::string("'") + bad + "'"},
        std::string("--memory-limit ") + bad + " accepted");
}

TEST(MemoryPlan, HostMemoryAvailableSaysWhereItComesFrom) {
  const MemoryLimit m = host_memory_available();
  ASSERT_GT(m.bytes, 0);
  EXPECT_FALSE(m.source.empty());
}

// The CUDA plan is made without a GPU: gpt2-124m's device buffers, line by line where they follow
// from the shapes alone.
TEST(MemoryPlan, CudaPlanOfGpt2WithoutAGpu) {
  const RunConfig c = load_config(std::string(FP4SIM_SOURCE_DIR) + "/configs/gpt2-124m.json", {});
  PlanRequest req;
  req.backend = "cuda";
  const MemoryPlan p = plan_training(c, req);
  std::map<std::string, int64_t> line;
  for (const PlanLine& l : p.lines) line[l.use] = l.bytes;
  const int64_t n = parameter_count(c.model), N = 16 * 1024, V = 50304;
  EXPECT_EQ(line[kUseParameters], 4 * n);
  EXPECT_EQ(line[kUseGradients], 4 * n);
  EXPECT_EQ(line[kUseOptimizerState], 8 * n);
  EXPECT_EQ(line[kUseWeightShadow], 2 * n);
  EXPECT_EQ(line[kUseLogits], N * V * 2 * 2);  // the logits and dlogits as BF16 bits
  std::map<std::string, int64_t> part;
  for (const PlanLine& l : p.workspace_parts) part[l.use] = l.bytes;
  EXPECT_EQ(part["attention stored dS"], 16 * 12 * (16 * 17 / 2) * 8192);
  EXPECT_EQ(part["the training matmuls' cuBLASLt workspace"], int64_t{32} << 20);
  EXPECT_EQ(p.host_lines.size(), 2u);  // the synthetic tokens, Gpt::init's host vector
  EXPECT_GT(p.peak, 8 * n + N * V * 4);
  std::printf("%s", p.describe().c_str());
}

// The hybrid's CUDA plan: the chunked scan's scratch by default, the sequential twin's with
// CudaPlanOptions::ssm_sequential (its recomputed chunk states), the parameter-gradient partials.
TEST(MemoryPlan, CudaPlanOfTheHybridFollowsTheScan) {
  const RunConfig c =
      load_config(std::string(FP4SIM_SOURCE_DIR) + "/configs/nemotron-h-small.json", {});
  PlanRequest req;
  req.backend = "cuda";
  auto parts = [&] {
    std::map<std::string, int64_t> part;
    for (const PlanLine& l : plan_training(c, req).workspace_parts) part[l.use] = l.bytes;
    return part;
  };
  SsmShape s;
  s.B = 8;
  s.T = 1024;
  s.H = 32;
  s.P = 64;
  s.G = 8;
  s.N = 128;
  s.chunk = 128;
  const std::map<std::string, int64_t> chunked = parts();
  const gpu::SsdScratchBytes b = gpu::ssd_chunked_backward_scratch(s);
  EXPECT_EQ(chunked.at("Mamba scan chunk intermediates"), b.states);
  EXPECT_EQ(chunked.at("Mamba scan dB and dC terms"), b.contrib);
  // (the largest of the conv's, the dt's and the gated norm's partials: the conv's W + 1 sums)
  EXPECT_EQ(chunked.at("Mamba parameter-gradient partial sums"),
            gpu::ssm_partials_floats(s.B * s.T, s.xbc_cols(), 5) * 4);
  // a chunk longer than the chunked SSD takes is refused when the model is made (the sequential
  // scan takes it)
  const RunConfig long_chunk =
      load_config(std::string(FP4SIM_SOURCE_DIR) + "/configs/nemotron-h-small.json",
                  {"model.mamba_chunk=2048"});
  try {
    plan_training(long_chunk, req);
    ADD_FAILURE() << "expected model.mamba_chunk 2048 to be refused on cuda";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("model.mamba_chunk 2048 is not a chunk the cuda backend"),
              std::string::npos)
        << e.what();
  }
  req.cuda.ssm_sequential = true;
  EXPECT_NO_THROW(plan_training(long_chunk, req));
  const std::map<std::string, int64_t> sequential = parts();
  EXPECT_EQ(sequential.at("Mamba scan chunk intermediates"), gpu::ssm_scan_backward_state_bytes(s));
  EXPECT_EQ(sequential.at("Mamba scan dB and dC terms"), s.B * s.T * s.H * 2 * s.N * 4);
}

// An allocation that fails names the buffer, its size and the backend, instead of a bare
// std::bad_alloc.
TEST(MemoryPlan, AllocationFailureNamesTheBuffer) {
  const RunConfig c = small_run(scratch_dir("mp_fail"), {});
  CountingBackend be;
  be.fail_above = 1000;
  const int64_t n = parameter_count(c.model);
  test::expect_error_containing<AllocationError>(
      [&] { Gpt m(c.model, be); },
      {"cannot allocate", "'parameters (float32)'", std::to_string(4 * n) + " bytes",
       "emu backend's host memory", "std::bad_alloc"},
      "a failed allocation was not reported");
}

}  // namespace
}  // namespace fp4sim::model
