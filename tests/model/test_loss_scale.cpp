// Dynamic loss scaling (DESIGN.md §14, train.loss_scale): without overflow it trains bit for bit
// like no scaling; a step with non-finite gradients is skipped (S halves, the optimizer stays);
// 10 skips in a row stop the run; a resume across a skip is bitwise; S doubles after 2000 clean
// steps; a bad value is a config error naming the key.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>

#include "model/checkpoint.hpp"
#include "model/loss_scale.hpp"
#include "model/trainer.hpp"
#include "tests/model/expect_error.hpp"
#include "tests/model/model_steps.hpp"
#include "tests/model/trainer_fixtures.hpp"

namespace fp4sim::model {
namespace {

// The trainer tests' micro run (trainer_fixtures.hpp) without validation, a checkpoint every step,
// all kept, with `overrides` applied.
RunConfig micro_run_every_step(const std::string& out, std::vector<std::string> overrides = {}) {
  overrides.insert(overrides.begin(),
                   {"train.eval_every=0", "train.checkpoint_every=1", "train.keep_last=0"});
  return micro_run(out, overrides);
}

using fp4sim::model::quiet_options;  // (trainer_fixtures.hpp's, beside this overload)
TrainOptions quiet_options(const std::vector<int64_t>& nonfinite_steps) {
  TrainOptions o = quiet_options();
  o.nonfinite_gradient_steps = nonfinite_steps;
  return o;
}

uint32_t bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

std::string step_dir(const std::string& out, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%08lld", static_cast<long long>(step));
  return out + "/checkpoints/" + name;
}

// The tensors of two checkpoint files equal byte for byte: the first difference, or "".
std::string first_difference(const TensorMap& a, const TensorMap& b) {
  if (a.size() != b.size())
    return "tensor counts " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
  for (const auto& [name, t] : a) {
    const auto it = b.find(name);
    if (it == b.end()) return "'" + name + "' missing";
    if (t.bytes != it->second.bytes) {
      for (size_t i = 0; i + 4 <= t.bytes.size(); i += 4)
        if (std::memcmp(t.bytes.data() + i, it->second.bytes.data() + i, 4) != 0) {
          float x, y;
          std::memcpy(&x, t.bytes.data() + i, 4);
          std::memcpy(&y, it->second.bytes.data() + i, 4);
          return "'" + name + "' element " + std::to_string(i / 4) + ": " + std::to_string(x) +
                 " vs " + std::to_string(y);
        }
      return "'" + name + "' bytes differ";
    }
  }
  return "";
}

std::vector<nlohmann::json> log_lines(const std::string& out) {
  std::ifstream f(out + "/log.jsonl");
  std::vector<nlohmann::json> lines;
  std::string text;
  while (std::getline(f, text)) lines.push_back(nlohmann::json::parse(text));
  return lines;
}

// Recipes whose shapes fit the micro config's (FP8's 128-element blocks need d_model 128 and 128
// tokens a batch).
std::vector<std::string> recipe_overrides(const std::string& recipe) {
  std::vector<std::string> o = {"recipe.name=" + recipe};
  if (recipe == "fp8") o.insert(o.end(), {"model.d_model=128", "model.d_ff=256", "train.batch=8"});
  return o;
}

// (1) No overflow: every loss, gradient norm and final weight (and AdamW moment) of `dynamic` is
// `off`'s, bit for bit, over 10 steps (one test a recipe, so they run in parallel).
void expect_dynamic_equals_off(const std::string& recipe,
                               const std::vector<std::string>& optim = {}) {
  const ScratchDir scratch("fp4sim_ls_equal_" + recipe + (optim.empty() ? "" : "_optim"));
  std::vector<TrainResult> r;
  std::vector<std::string> outs;
  for (const char* mode : {"off", "dynamic"}) {
    outs.push_back(scratch.path + "/" + mode);
    std::vector<std::string> o = recipe_overrides(recipe);
    o.push_back(std::string("train.loss_scale=") + mode);
    o.insert(o.end(), optim.begin(), optim.end());
    o.push_back("train.checkpoint_every=10");
    r.push_back(train(micro_run_every_step(outs.back(), o), quiet_options(), *make_cpu_backend()));
  }
  ASSERT_EQ(r[0].steps.size(), 10u);
  ASSERT_EQ(r[1].steps.size(), 10u);
  for (size_t i = 0; i < 10; ++i) {
    EXPECT_FALSE(r[1].steps[i].skipped) << recipe << " step " << i + 1;
    EXPECT_EQ(r[1].steps[i].loss_scale, DynamicLossScale::kInitialScale);
    EXPECT_EQ(bits(r[0].steps[i].loss), bits(r[1].steps[i].loss))
        << recipe << " step " << i + 1 << ": loss " << r[0].steps[i].loss << " vs "
        << r[1].steps[i].loss;
    EXPECT_EQ(r[0].steps[i].grad_norm, r[1].steps[i].grad_norm) << recipe << " step " << i + 1;
  }
  const Checkpoint a = load_checkpoint(outs[0] + "/checkpoints");
  const Checkpoint b = load_checkpoint(outs[1] + "/checkpoints");
  EXPECT_EQ(first_difference(a.model, b.model), "") << recipe << ": final weights";
  EXPECT_EQ(first_difference(a.optimizer, b.optimizer), "") << recipe << ": AdamW moments";
  EXPECT_EQ(b.state.at("optimizer_step"), 10);
  EXPECT_EQ(b.state.at("loss_scale").at("scale"), DynamicLossScale::kInitialScale);
  EXPECT_EQ(b.state.at("loss_scale").at("clean_steps"), 10);
}
TEST(LossScale, DynamicTrainsBitForBitLikeOffBf16) { expect_dynamic_equals_off("bf16"); }
// exact GEMMs, RHT and SR on the gradients
TEST(LossScale, DynamicTrainsBitForBitLikeOffNvfp4) { expect_dynamic_equals_off("nvfp4"); }
TEST(LossScale, DynamicTrainsBitForBitLikeOffFp8) { expect_dynamic_equals_off("fp8"); }
TEST(LossScale, DynamicTrainsBitForBitLikeOffMxfp4) { expect_dynamic_equals_off("mxfp4"); }
// Muon's momentum and ROOT's quantile read g = grad * (clip / S): the same bits as without scaling
TEST(LossScale, DynamicTrainsBitForBitLikeOffMuonAndRoot) {
  expect_dynamic_equals_off("bf16", {"optim.name=muon"});
  expect_dynamic_equals_off("nvfp4", {"optim.name=root", "optim.ns_precision=nvfp4"});
}

// The loss scale reaches every gradient exactly: under 2^16 each gradient element is 2^16 times
// the unscaled one, bit for bit (NVFP4 with RHT and SR on the gradients), and the loss is the same.
TEST(LossScale, GradientsAreTheUnscaledTimesS) {
  const RunConfig c = micro_run_every_step("", {"recipe.name=nvfp4"});
  auto be = make_cpu_backend();
  const std::vector<float> plain = model_steps(*be, c, 2, 16);
  const std::vector<float> scaled =
      model_steps(*be, c, 2, 16, [](Gpt& m) { m.set_loss_scale(65536.0f); });
  ASSERT_EQ(plain.size(), scaled.size());
  const size_t per_step = plain.size() / 2;
  size_t nonzero = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    const float expect = i % per_step == 0 ? plain[i] : plain[i] * 65536.0f;  // (the loss first)
    ASSERT_EQ(bits(scaled[i]), bits(expect))
        << "value " << i << ": " << scaled[i] << " vs " << expect;
    nonzero += plain[i] != 0.0f;
  }
  EXPECT_GT(nonzero, plain.size() / 2);
  Gpt m(c.model, *be);
  EXPECT_THROW(m.set_loss_scale(3.0f), std::invalid_argument);
  EXPECT_THROW(m.set_loss_scale(0.5f), std::invalid_argument);
}

// (2) An overflow at step 4 (the test hook's +Inf gradient) skips exactly that step: the log marks
// it, S halves from step 5 on, the weights and moments after it are those before it, AdamW's step
// count stays, and the following steps train.
TEST(LossScale, NonFiniteGradientSkipsTheStepAndHalvesTheScale) {
  const ScratchDir scratch("fp4sim_ls_skip");
  const std::string out = scratch.path + "/run";
  const TrainResult r =
      train(micro_run_every_step(out, {"train.loss_scale=dynamic", "recipe.name=nvfp4"}),
            quiet_options({4}), *make_cpu_backend());
  ASSERT_EQ(r.steps.size(), 10u);
  for (size_t i = 0; i < 10; ++i) {
    EXPECT_EQ(r.steps[i].skipped, i == 3) << "step " << i + 1;
    EXPECT_EQ(r.steps[i].loss_scale, i < 4 ? 65536.0f : 32768.0f) << "step " << i + 1;
    EXPECT_TRUE(std::isfinite(r.steps[i].loss)) << "step " << i + 1;
  }
  EXPECT_FALSE(std::isfinite(r.steps[3].grad_norm));
  const std::vector<nlohmann::json> log = log_lines(out);
  ASSERT_EQ(log.size(), 10u);
  for (size_t i = 0; i < 10; ++i) {
    EXPECT_EQ(log[i].value("skipped", false), i == 3) << log[i].dump();
    EXPECT_EQ(log[i].at("loss_scale"), i < 4 ? 65536.0 : 32768.0) << log[i].dump();
  }
  EXPECT_TRUE(log[3].at("grad_norm").is_null()) << log[3].dump();
  const Checkpoint before = load_checkpoint(step_dir(out, 3));
  const Checkpoint skipped = load_checkpoint(step_dir(out, 4));
  const Checkpoint after = load_checkpoint(step_dir(out, 5));
  EXPECT_EQ(first_difference(before.model, skipped.model), "") << "weights across the skip";
  EXPECT_EQ(first_difference(before.optimizer, skipped.optimizer), "") << "moments across it";
  EXPECT_NE(first_difference(skipped.model, after.model), "") << "step 5 trains";
  EXPECT_EQ(before.state.at("optimizer_step"), 3);
  EXPECT_EQ(skipped.state.at("optimizer_step"), 3);
  EXPECT_EQ(after.state.at("optimizer_step"), 4);
  EXPECT_EQ(skipped.state.at("loss_scale").at("scale"), 32768.0);
  EXPECT_EQ(skipped.state.at("loss_scale").at("clean_steps"), 0);
  EXPECT_EQ(skipped.state.at("loss_scale").at("skips_in_a_row"), 1);
  EXPECT_EQ(after.state.at("loss_scale").at("skips_in_a_row"), 0);
  // the data position, the schedule and the SR step advanced over the skip: step 5's loss is
  // that of another batch than step 4's
  EXPECT_NE(r.steps[4].loss, r.steps[3].loss);
  EXPECT_NE(r.steps[4].lr, r.steps[3].lr);
  EXPECT_NE(before.state.at("data_position"), skipped.state.at("data_position"));
}

// Without loss scaling the same fault stops the run at once, naming the step and the tensor.
TEST(LossScale, NonFiniteGradientWithoutScalingStops) {
  const ScratchDir scratch("fp4sim_ls_off_stop");
  test::expect_error_containing<std::runtime_error>(
      [&] {
        train(micro_run_every_step(scratch.path + "/run"), quiet_options({3}), *make_cpu_backend());
      },
      {"step 3: gradient of 'wte' is not finite"}, "expected the NaN stop at step 3");
}

// (3) 10 skips in a row stop the run with the NaN-stop message naming the step (the 10th) and the
// tensor; S has halved 9 times by then.
TEST(LossScale, TenSkipsInARowStopTheRun) {
  const ScratchDir scratch("fp4sim_ls_ten");
  RunConfig c = micro_run_every_step(scratch.path + "/run", {"train.loss_scale=dynamic"});
  c.train.steps = 15;
  test::expect_error_containing<std::runtime_error>(
      [&] {
        train(c, quiet_options({3, 4, 5, 6, 7, 8, 9, 10, 11, 12}), *make_cpu_backend());
      },
      {"step 12: gradient of 'wte' is not finite", "10th step in a row skipped", "loss scale 128"},
      "expected 10 skips in a row to stop the run");
  // 9 in a row, then a clean step, then more: the count starts again and the run ends
  c.train.out_dir = scratch.path + "/run2";
  const TrainResult r =
      train(c, quiet_options({2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13}), *make_cpu_backend());
  ASSERT_EQ(r.steps.size(), 15u);
  EXPECT_FALSE(r.steps[10].skipped);
  EXPECT_EQ(r.steps[10].loss_scale, 65536.0f / 512.0f);
  EXPECT_EQ(r.steps[14].loss_scale, 65536.0f / 2048.0f);
}

// (4) A resume from the checkpoint right after a skipped step continues bit for bit (S, its
// counts and AdamW's step count come from the checkpoint), and so does one from before it.
TEST(LossScale, BitwiseResumeAcrossASkip) {
  const ScratchDir scratch("fp4sim_ls_resume");
  const std::vector<std::string> o = {"train.loss_scale=dynamic", "recipe.name=nvfp4"};
  const RunConfig full_c = micro_run_every_step(scratch.path + "/full", o);
  const TrainResult full = train(full_c, quiet_options({4}), *make_cpu_backend());
  ASSERT_EQ(full.steps.size(), 10u);
  for (const int64_t from : {4, 3}) {
    RunConfig c = micro_run_every_step(scratch.path + "/cont" + std::to_string(from), o);
    TrainOptions resume = quiet_options({4});
    resume.resume = step_dir(full_c.train.out_dir, from);
    const TrainResult cont = train(c, resume, *make_cpu_backend());
    ASSERT_EQ(cont.steps.size(), static_cast<size_t>(10 - from));
    for (size_t i = 0; i < cont.steps.size(); ++i) {
      const StepRecord& e = full.steps[static_cast<size_t>(from) + i];
      EXPECT_EQ(cont.steps[i].step, e.step);
      EXPECT_EQ(bits(cont.steps[i].loss), bits(e.loss))
          << "from " << from << ", step " << e.step << ": " << cont.steps[i].loss << " vs "
          << e.loss;
      EXPECT_EQ(cont.steps[i].skipped, e.skipped) << "step " << e.step;
      EXPECT_EQ(cont.steps[i].loss_scale, e.loss_scale) << "step " << e.step;
    }
    EXPECT_EQ(first_difference(load_checkpoint(full_c.train.out_dir + "/checkpoints").model,
                               load_checkpoint(c.train.out_dir + "/checkpoints").model),
              "")
        << "final weights, resumed from step " << from;
  }
}

// A checkpoint without the loss-scaling fields (as written before them) loads: AdamW's step count
// is the step, S starts at 2^16; bad values are refused as a corrupt checkpoint.
TEST(LossScale, CheckpointWithoutTheFieldsLoadsWithDefaults) {
  const ScratchDir scratch("fp4sim_ls_old");
  const std::vector<std::string> o = {"train.loss_scale=dynamic"};
  const RunConfig full_c = micro_run_every_step(scratch.path + "/full", o);
  const TrainResult full = train(full_c, quiet_options(), *make_cpu_backend());
  Checkpoint ck = load_checkpoint(step_dir(full_c.train.out_dir, 5));
  ck.state.erase("optimizer_step");
  ck.state.erase("loss_scale");
  save_checkpoint(scratch.path + "/old", ck, 0);
  RunConfig c = micro_run_every_step(scratch.path + "/cont", o);
  TrainOptions resume = quiet_options();
  resume.resume = scratch.path + "/old";
  const TrainResult cont = train(c, resume, *make_cpu_backend());
  ASSERT_EQ(cont.steps.size(), 5u);
  for (size_t i = 0; i < 5; ++i)
    EXPECT_EQ(bits(cont.steps[i].loss), bits(full.steps[5 + i].loss)) << "step " << i + 6;
  auto refused = [&](const std::string& name, const std::function<void(Checkpoint&)>& edit,
                     const std::string& needle) {
    Checkpoint bad = load_checkpoint(step_dir(full_c.train.out_dir, 5));
    edit(bad);
    save_checkpoint(scratch.path + "/" + name, bad, 0);
    RunConfig rc = micro_run_every_step(scratch.path + "/" + name + "_run", o);
    TrainOptions ro = quiet_options();
    ro.resume = scratch.path + "/" + name;
    test::expect_error_containing<std::runtime_error>([&] { train(rc, ro, *make_cpu_backend()); },
                                                      {needle, "corrupt checkpoint"},
                                                      "expected " + name + " to be refused");
  };
  refused(
      "scale3", [](Checkpoint& k) { k.state["loss_scale"]["scale"] = 3.0; },
      "loss_scale.scale is not a power of two");
  refused(
      "t9", [](Checkpoint& k) { k.state["optimizer_step"] = 9; }, "optimizer_step");
}

// S doubles after 2000 clean steps (not above 2^24), halves on a skip (not below 1), and a skip
// starts the clean count again.
TEST(LossScale, ScaleGrowsAfter2000CleanStepsAndHalvesOnASkip) {
  DynamicLossScale s;
  EXPECT_EQ(s.scale, 65536.0f);
  for (int i = 0; i < 1999; ++i) s.after_clean_step();
  EXPECT_EQ(s.scale, 65536.0f);
  s.after_clean_step();
  EXPECT_EQ(s.scale, 131072.0f);
  EXPECT_EQ(s.clean_steps, 0);
  for (int i = 0; i < 1500; ++i) s.after_clean_step();
  s.after_skipped_step();
  EXPECT_EQ(s.scale, 65536.0f);
  EXPECT_EQ(s.clean_steps, 0);
  EXPECT_EQ(s.skips_in_a_row, 1);
  for (int i = 0; i < 1999; ++i) s.after_clean_step();
  EXPECT_EQ(s.scale, 65536.0f);
  EXPECT_EQ(s.skips_in_a_row, 0);
  for (int i = 0; i < 40; ++i) s.after_skipped_step();
  EXPECT_EQ(s.scale, 1.0f);
  for (int i = 0; i < 2000 * 40; ++i) s.after_clean_step();
  EXPECT_EQ(s.scale, DynamicLossScale::kMaxScale);
  EXPECT_TRUE(DynamicLossScale::valid_scale(1.0));
  EXPECT_TRUE(DynamicLossScale::valid_scale(65536.0));
  EXPECT_FALSE(DynamicLossScale::valid_scale(0.5));
  EXPECT_FALSE(DynamicLossScale::valid_scale(3.0));
  EXPECT_FALSE(DynamicLossScale::valid_scale(2.0 * DynamicLossScale::kMaxScale));
  EXPECT_FALSE(DynamicLossScale::valid_scale(std::nan("")));
}

// (5) The key: parsed, written back, and an unknown value names the key and the valid values.
TEST(LossScale, ConfigKey) {
  const nlohmann::json base = to_json(RunConfig{});
  EXPECT_EQ(config_from_json(base, {}).train.loss_scale, LossScale::Off);
  const RunConfig d = config_from_json(base, {"train.loss_scale=dynamic"});
  EXPECT_EQ(d.train.loss_scale, LossScale::Dynamic);
  EXPECT_EQ(to_json(d)["train"]["loss_scale"], "dynamic");
  test::expect_error_containing<std::invalid_argument>(
      [&] { config_from_json(base, {"train.loss_scale=static"}); },
      {"train.loss_scale 'static' is not one of: off, dynamic"},
      "expected train.loss_scale=static to be refused");
}

}  // namespace
}  // namespace fp4sim::model
