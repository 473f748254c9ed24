// The trainer: loss falls, bitwise resume, bad input stops before any work.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>

#include "model/checkpoint.hpp"
#include "model/gpt.hpp"
#include "model/run_lock.hpp"
#include "model/trainer.hpp"
#include "tests/model/trainer_fixtures.hpp"

namespace fp4sim::model {
namespace {

// Resuming `c` from `resume` throws E with `needle` in its message.
template <typename E>
void expect_resume_error(const RunConfig& c, const std::string& resume, const std::string& needle) {
  TrainOptions o = quiet_options();
  o.resume = resume;
  try {
    train(c, o, *make_cpu_backend());
    ADD_FAILURE() << "expected an error naming '" << needle << "'";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// A 5-step micro run into `out`, leaving its checkpoint at step 5; returns its config.
RunConfig train_five_steps(const std::string& out) {
  RunConfig c = micro_run(out);
  c.train.steps = 5;
  train(c, quiet_options(), *make_cpu_backend());
  return c;
}

// Train 10 steps with a checkpoint at 5, resume from it in a second run: steps 5-9 bit for bit.
// overrides: applied to micro_run's config (a hybrid pattern, a recipe).
void expect_bitwise_resume(bool shuffle, int64_t grad_accum = 1,
                           const std::vector<std::string>& overrides = {}) {
  const ScratchDir scratch(std::string("fp4sim_train") + (shuffle ? "_shuffle" : "") + "_" +
                           std::to_string(grad_accum) + (overrides.empty() ? "" : "_o"));
  const std::string& dir = scratch.path;
  const TrainOptions quiet = quiet_options();
  RunConfig c = micro_run(dir + "/full");
  if (!overrides.empty()) c = config_from_json(to_json(c), overrides);
  c.train.shuffle = shuffle;
  c.train.grad_accum = grad_accum;
  const TrainResult full = train(c, quiet, *make_cpu_backend());
  ASSERT_EQ(full.steps.size(), 10u);
  // the first run also left a checkpoint at step 5; a second run resumes from it
  TrainOptions resume = quiet;
  resume.resume = dir + "/full/checkpoints/step_00000005";
  c.train.out_dir = dir + "/cont";
  const TrainResult cont = train(c, resume, *make_cpu_backend());
  ASSERT_EQ(cont.steps.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(cont.steps[i].step, full.steps[5 + i].step);
    uint32_t a, b;
    std::memcpy(&a, &cont.steps[i].loss, 4);
    std::memcpy(&b, &full.steps[5 + i].loss, 4);
    EXPECT_EQ(a, b) << "step " << cont.steps[i].step << ": " << cont.steps[i].loss << " vs "
                    << full.steps[5 + i].loss;
  }
}

TEST(Trainer, BitwiseResumeFromStep5) { expect_bitwise_resume(false); }
// The Mamba-2 hybrid (DESIGN.md §11-§12): the checkpoint holds every Mamba-2 parameter and its
// moments; BF16 and NVFP4 (its Mamba linears quantized: blocks 0..2 under hp_last 1).
TEST(Trainer, BitwiseResumeFromStep5Hybrid) {
  const std::vector<std::string> hybrid = {"model.pattern=M*-M",
                                           "model.n_layers=4",
                                           "model.norm=rmsnorm",
                                           "model.activation=squared_relu",
                                           "model.positions=none",
                                           "model.bias=false",
                                           "model.tied_embeddings=false",
                                           "model.mamba_head_dim=4",
                                           "model.mamba_groups=2",
                                           "model.mamba_state=8",
                                           "model.mamba_chunk=6",
                                           "recipe.hp_first=0",
                                           "recipe.hp_last=1"};
  expect_bitwise_resume(false, 1, hybrid);
  std::vector<std::string> q = hybrid;
  q.push_back("recipe.name=nvfp4");
  expect_bitwise_resume(false, 1, q);
}
TEST(Trainer, BitwiseResumeFromStep5WithGradAccumulation) {
  expect_bitwise_resume(false, 3);
  expect_bitwise_resume(true, 2);
}

// Two micro-batches of 2 sequences train like one batch of 4 (the same tokens, in file order):
// the same loss, the gradients up to summation order.
TEST(Trainer, GradAccumulationMatchesOneLargeBatch) {
  const ScratchDir scratch("fp4sim_accum");
  auto run = [&](int64_t batch, int64_t accum, const std::string& name) {
    RunConfig c = micro_run(scratch.path + "/" + name);
    c.train.steps = 3;
    c.train.checkpoint_every = 0;
    c.train.eval_every = 0;
    c.train.batch = batch;
    c.train.grad_accum = accum;
    return train(c, quiet_options(), *make_cpu_backend()).steps;
  };
  const auto one = run(4, 1, "one"), two = run(2, 2, "two");
  ASSERT_EQ(one.size(), 3u);
  ASSERT_EQ(two.size(), 3u);
  EXPECT_NEAR(two[0].loss, one[0].loss, 1e-6 * one[0].loss);
  EXPECT_NEAR(two[0].grad_norm, one[0].grad_norm, 1e-5 * one[0].grad_norm);
  EXPECT_NEAR(two[2].loss, one[2].loss, 1e-4 * one[2].loss);
}

// A run resumes in the batch order it began with: another train.shuffle is an error before any
// work.
TEST(Trainer, ResumeWithAnotherShuffleSettingIsAnError) {
  const ScratchDir scratch("fp4sim_resume_shuf");
  const std::string& dir = scratch.path;
  RunConfig c = train_five_steps(dir + "/a");  // file order
  c.train.steps = 10;
  c.train.shuffle = true;
  c.train.out_dir = dir + "/b";
  expect_resume_error<std::invalid_argument>(c, dir + "/a/checkpoints", "train.shuffle");
  EXPECT_FALSE(std::filesystem::exists(dir + "/b"));
}

TEST(Trainer, BitwiseResumeFromStep5Shuffled) { expect_bitwise_resume(true); }

// train.shuffle draws other batches than the file order, and the same seed draws the same ones.
TEST(Trainer, ShuffledBatchesAreReproducibleAndDifferFromFileOrder) {
  const ScratchDir scratch("fp4sim_shuf");
  const std::string& dir = scratch.path;
  const TrainOptions quiet = quiet_options();
  auto first_losses = [&](bool shuffle, uint64_t seed, const std::string& name) {
    RunConfig c = micro_run(dir + "/" + name);
    c.train.steps = 3;
    c.train.checkpoint_every = 0;
    c.train.eval_every = 0;
    c.train.shuffle = shuffle;
    c.train.seed = seed;
    std::vector<float> out;
    for (const StepRecord& r : train(c, quiet, *make_cpu_backend()).steps) out.push_back(r.loss);
    return out;
  };
  const auto ordered = first_losses(false, 7, "a"), shuffled = first_losses(true, 7, "b"),
             again = first_losses(true, 7, "c");
  EXPECT_EQ(shuffled, again);
  EXPECT_NE(shuffled[0], ordered[0]);  // same initial weights, other batch
}

// The step-5 checkpoint of the micro run in dir/a, changed by `edit` and saved as dir/NAME; a
// resume from it must stop with E naming `needle`.
template <class E>
void expect_edited_resume_error(const std::string& dir, const std::string& name,
                                const std::function<void(Checkpoint&)>& edit,
                                const std::string& needle) {
  Checkpoint ck = load_checkpoint(dir + "/a/checkpoints");
  edit(ck);
  save_checkpoint(dir + "/" + name, ck, 0);
  expect_resume_error<E>(micro_run(dir + "/" + name + "_run"), dir + "/" + name, needle);
}

// A non-finite loss stops the run naming the step and the first non-finite tensor: here finite
// weights whose sum overflows (the embeddings' output); a NaN weight (which no checkpoint carries:
// save and load refuse one) is named as the parameter holding it.
TEST(Trainer, NonFiniteLossStopsTheRunNamingTheStep) {
  const ScratchDir scratch("fp4sim_nan");
  const std::string& dir = scratch.path;
  const RunConfig c = train_five_steps(dir + "/a");
  const auto huge_embeddings = [](Checkpoint& ck) {
    const float huge = 3e38f;
    for (const char* name : {"wte", "wpe"}) {
      std::vector<uint8_t>& bytes = ck.model.at(name).bytes;
      for (size_t i = 0; i + 4 <= bytes.size(); i += 4) std::memcpy(bytes.data() + i, &huge, 4);
    }
  };
  // the checkpoint is at step 5, so the first step trained (and the one that goes bad) is step 6,
  // counted from 1 as the step lines print it
  expect_edited_resume_error<std::runtime_error>(dir, "b", huge_embeddings, "step 6:");
  expect_edited_resume_error<std::runtime_error>(
      dir, "c", huge_embeddings, "the first non-finite tensor: the embeddings' output");
  auto be = make_cpu_backend();
  Gpt model(c.model, *be);
  model.init(c.train.seed);
  model.set_recipe(c);
  std::vector<float> params = model.params_to_host();
  for (const ParamTensor& t : model.tensors())
    if (t.name == "ln_f.weight") params[t.offset + 3] = std::nanf("");
  model.params_from_host(params);
  std::vector<int32_t> tokens(static_cast<size_t>(c.train.batch * c.model.seq_len), 1);
  EXPECT_TRUE(
      std::isnan(model.forward(tokens.data(), tokens.data(), c.train.batch, c.model.seq_len)));
  EXPECT_EQ(model.first_nonfinite_in_forward(), "parameter 'ln_f.weight'");
}

// A checkpoint tensor of the right size but another shape is refused, naming both shapes.
TEST(Trainer, CheckpointTensorOfAnotherShapeRefused) {
  const ScratchDir scratch("fp4sim_shape");
  const std::string& dir = scratch.path;
  train_five_steps(dir + "/a");
  expect_edited_resume_error<std::runtime_error>(
      dir, "b",
      [](Checkpoint& ck) {
        ck.model.at("ln_f.weight").shape = {2, 16};
      },
      "tensor 'ln_f.weight' is F32 [2, 16], the model's is F32 [32]");
}

// A run that would write checkpoints into an out_dir holding later steps (here: resuming at 5
// where the first run reached 10) stops before any work instead of mixing the two.
TEST(Trainer, RefusesAnOutDirWithCheckpointsOfLaterSteps) {
  const ScratchDir scratch("fp4sim_later");
  const std::string& dir = scratch.path;
  RunConfig c = micro_run(dir + "/a");
  train(c, quiet_options(), *make_cpu_backend());  // checkpoints at 5 and 10
  expect_resume_error<std::invalid_argument>(c, dir + "/a/checkpoints/step_00000005",
                                             "step_00000010");
  // a fresh run into the same folder is refused the same way
  try {
    train(c, quiet_options(), *make_cpu_backend());
    ADD_FAILURE() << "expected an error naming step_00000010";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("step_00000010"), std::string::npos) << e.what();
  }
  // and so is a fresh run that writes no checkpoints (it would replace the run's log.jsonl)
  RunConfig no_ck = c;
  no_ck.train.checkpoint_every = 0;
  try {
    train(no_ck, quiet_options(), *make_cpu_backend());
    ADD_FAILURE() << "expected an error naming step_00000005";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("step_00000005"), std::string::npos) << e.what();
  }
}

// Resuming into the folder of a longer run without writing checkpoints: the log keeps the
// records up to the resumed step and then the new ones, each step once.
TEST(Trainer, ResumeTrimsTheLogToTheResumedStep) {
  const ScratchDir scratch("fp4sim_log");
  const std::string& dir = scratch.path;
  RunConfig c = micro_run(dir + "/a");
  train(c, quiet_options(), *make_cpu_backend());  // steps 1-10
  c.train.checkpoint_every = 0;
  TrainOptions o = quiet_options();
  o.resume = dir + "/a/checkpoints/step_00000005";
  train(c, o, *make_cpu_backend());  // steps 6-10 again
  std::ifstream in(dir + "/a/log.jsonl");
  std::vector<int64_t> steps;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json rec = nlohmann::json::parse(line);
    if (rec.contains("step")) steps.push_back(rec["step"].get<int64_t>());
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}));
}

// A state.json with a data position outside the training split, or without its config: a clear
// error naming the checkpoint, before any work; one edited by hand is refused by its SHA-256.
TEST(Trainer, CorruptCheckpointStateIsAClearError) {
  const ScratchDir scratch("fp4sim_state");
  const std::string& dir = scratch.path;
  train_five_steps(dir + "/a");
  expect_edited_resume_error<std::runtime_error>(
      dir, "b", [](Checkpoint& ck) { ck.state["data_position"] = -5; }, "data_position -5");
  expect_edited_resume_error<std::runtime_error>(
      dir, "c", [](Checkpoint& ck) { ck.state.erase("config"); }, "no 'config'");
  const std::string state = dir + "/a/checkpoints/step_00000005/state.json";
  nlohmann::json j;
  std::ifstream(state) >> j;
  j["data_position"] = 0;
  std::ofstream(state) << j.dump(2) << "\n";
  expect_resume_error<std::runtime_error>(micro_run(dir + "/d"), dir + "/a/checkpoints",
                                          "state.json: its SHA-256 differs from manifest.json's");
}

// One writer per run folder: a second run into a folder whose lock is held (here by this process,
// through another open file) is refused at once naming the holder's PID; a lock file left by a dead
// process (its PID in the file, no lock held) does not block, and holds the new writer's PID after.
TEST(Trainer, OneWriterPerRunFolder) {
  const ScratchDir scratch("fp4sim_lock");
  const std::string& dir = scratch.path;
  RunConfig c = micro_run(dir + "/a");
  c.train.steps = 2;
  const std::string lock_file = dir + "/a/" + RunLock::kFileName;
  {
    const RunLock held(dir + "/a", "train.out_dir");
    for (const bool resume : {false, true}) {
      TrainOptions o = quiet_options();
      if (resume) o.resume = dir + "/a";
      try {
        train(c, o, *make_cpu_backend());
        ADD_FAILURE() << "a second writer was let in";
      } catch (const std::runtime_error& e) {
        EXPECT_NE(std::string(e.what()).find("train.out_dir " + dir +
                                             "/a is in use by another "
                                             "fp4sim (PID " +
                                             std::to_string(::getpid()) + ","),
                  std::string::npos)
            << e.what();
      }
    }
    EXPECT_FALSE(std::filesystem::exists(dir + "/a/log.jsonl"));  // refused before any output
  }
  std::ofstream(lock_file) << "2147483646\n";  // a dead writer's
  train(c, quiet_options(), *make_cpu_backend());
  std::ifstream in(lock_file);
  std::string pid;
  std::getline(in, pid);
  EXPECT_EQ(pid, std::to_string(::getpid()));
}

TEST(Trainer, MissingDataIsAnErrorBeforeAnyWork) {
  RunConfig c = micro_run("/tmp/unused");
  c.train.data = "/nonexistent/corpus";
  EXPECT_THROW(train(c, quiet_options(), *make_cpu_backend()), std::runtime_error);
}

}  // namespace
}  // namespace fp4sim::model
