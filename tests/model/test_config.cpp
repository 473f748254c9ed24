// Config files, overrides and the checks that run before any work.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "model/config.hpp"
#include "model/strict_json.hpp"

namespace fp4sim::model {
namespace {

void expect_error(const nlohmann::json& j, const std::vector<std::string>& o, const char* needle) {
  try {
    config_from_json(j, o);
    FAIL() << "expected an error containing '" << needle << "'";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Config, PresetsLoadAndOverridesApply) {
  for (const char* p : {"tiny", "gpt2-124m", "small"}) {
    const RunConfig c = load_config(std::string(FP4SIM_SOURCE_DIR) + "/configs/" + p + ".json", {});
    EXPECT_GT(parameter_count(c.model), 0) << p;
  }
  const RunConfig g = load_config(std::string(FP4SIM_SOURCE_DIR) + "/configs/gpt2-124m.json", {});
  // GPT-2 small with vocab 50304 and tied embeddings: 124.5M parameters (llm.c counts the same)
  EXPECT_NEAR(static_cast<double>(parameter_count(g.model)), 124.48e6, 0.05e6);
  // 6 N + 12 L T d with N = 124,475,904 - 1024 * 768 (positions) = 123,689,472
  EXPECT_DOUBLE_EQ(training_flops_per_token(g.model), 6.0 * 123689472.0 + 12.0 * 12 * 1024 * 768);
  const RunConfig t = load_config(std::string(FP4SIM_SOURCE_DIR) + "/configs/tiny.json",
                                  {"model.d_model=256", "train.lr=0.002", "train.data=synthetic",
                                   "model.tied_embeddings=false"});
  EXPECT_EQ(t.model.d_model, 256);
  EXPECT_DOUBLE_EQ(t.train.lr, 0.002);
  EXPECT_EQ(t.train.data, "synthetic");
  EXPECT_FALSE(t.model.tied_embeddings);
  EXPECT_EQ(to_json(t)["model"]["d_model"], 256);
  EXPECT_EQ(config_from_json(to_json(t), {}).model.d_model, 256);  // round trip
}

TEST(Config, BadInputIsAClearErrorBeforeAnyWork) {
  const nlohmann::json base = to_json(RunConfig{});
  expect_error(base, {"model.dmodel=3"}, "unknown config key 'model.dmodel'");
  expect_error(base, {"model.dmodel=3"}, "valid keys: model.vocab");
  expect_error(base, {"train.lr=1e400"}, "1e400 is out of the range of a double");
  EXPECT_EQ(config_from_json(base, {"train.out_dir=1e400"}).train.out_dir,
            "1e400");  // a string key: as written
  expect_error(base, {"model.d_model=130"}, "not divisible by model.n_heads");
  expect_error(base, {"model.n_kv_heads=3"}, "not divisible by model.n_kv_heads");
  expect_error(base, {"model.seq_len=1024"}, "longer than the learned positions table");
  expect_error(base, {"model.d_model=abc"}, "wrong type");
  expect_error(base, {"model.activation=relu"}, "is not one of");
  expect_error(base, {"recipe.name=int8"}, "recipe.name 'int8'");
  expect_error(base, {"d_model"}, "expected key=value");
  // range errors name the value given (and, for the warmup, the steps it must fit in)
  expect_error(base, {"train.steps=5", "train.warmup=20"},
               "train.warmup = 20 must be within 0..train.steps (5)");
  expect_error(base, {"train.lr=-0.5"}, "train.lr must be positive, got -0.5");
  expect_error(base, {"recipe.stats_every=-2"},
               "recipe.stats_every must be >= 0 (0: no statistics), got -2");
  nlohmann::json j = base;
  j["model"]["heads"] = 4;
  expect_error(j, {}, "unknown config key 'model.heads'");
  EXPECT_THROW(load_config("/nonexistent/config.json", {}), std::invalid_argument);
}

// model.pattern: the blocks spelled out; model.n_layers follows it, and the per-GEMM overrides
// and the high-precision rule count its blocks (DESIGN.md §11).
TEST(Config, PatternSetsTheBlocks) {
  const RunConfig c = config_from_json(nlohmann::json::object(), {"model.pattern=*--*-"});
  EXPECT_EQ(c.model.n_layers, 5);
  EXPECT_EQ(block_pattern(c.model), "*--*-");
  EXPECT_EQ(unit_prefix(c.model, 3), "blocks.3");
  EXPECT_EQ(block_pattern(RunConfig{}.model), "*-*-");
  EXPECT_EQ(unit_prefix(RunConfig{}.model, 1), "h.1");
  EXPECT_EQ(config_from_json(to_json(c), {}).model.pattern, "*--*-");  // round trip
  // the preset layout and a pattern of the same blocks have the same parameters
  RunConfig p = config_from_json(nlohmann::json::object(), {"model.pattern=*-*-*-"});
  RunConfig l = config_from_json(nlohmann::json::object(), {"model.n_layers=3"});
  EXPECT_EQ(parameter_count(p.model), parameter_count(l.model));
  EXPECT_DOUBLE_EQ(training_flops_per_token(p.model), training_flops_per_token(l.model));
  const nlohmann::json none = nlohmann::json::object();
  expect_error(none, {"model.pattern=*-x"}, "character 'x' at 2 is not a block");
  expect_error(none, {"model.pattern=*-", "model.n_layers=3"},
               "model.n_layers 3 differs from the 2 blocks of model.pattern '*-'");
  EXPECT_EQ(config_from_json(none, {"model.pattern=*-", "model.n_layers=2"}).model.n_layers, 2);
  // overrides name blocks, and the block's mixer must have that linear
  EXPECT_EQ(config_from_json(none, {"model.pattern=*-", "recipe.name=nvfp4",
                                    "recipe.override.blocks.1.mlp.c_fc.wgrad=bf16"})
                .recipe.override_gemms.size(),
            1u);
  expect_error(none, {"model.pattern=*-", "recipe.override.h.1.mlp.c_fc.wgrad=bf16"},
               "expected recipe.override.blocks.<block>.");
  expect_error(none, {"model.pattern=*-", "recipe.override.blocks.0.mlp.c_fc.wgrad=bf16"},
               "block 0 of model.pattern is attention ('*'), which has no mlp.c_fc");
  // the high-precision rule counts blocks: 62 blocks keep the first 2 and the last 8 (§9)
  std::string p62;
  for (int i = 0; i < 31; ++i) p62 += "*-";
  const RunConfig h =
      config_from_json(none, {"model.pattern=" + p62, "recipe.name=nvfp4", "train.batch=16"});
  const std::vector<bool> hp = high_precision_blocks(h);
  ASSERT_EQ(hp.size(), 62u);
  EXPECT_EQ(std::count(hp.begin(), hp.end(), true), 10);
  EXPECT_TRUE(hp[1] && !hp[2] && !hp[53] && hp[54]);
}

// Mamba-2 blocks ('M', DESIGN.md §12): the sizes, the parameter count, the overrides of in_proj
// and out_proj, and clear errors at start naming the key for every size that cannot work.
TEST(Config, MambaBlocks) {
  const nlohmann::json none = nlohmann::json::object();
  const std::vector<std::string> ok = {"model.pattern=M-*", "model.d_model=128",
                                       "model.mamba_head_dim=16", "model.mamba_groups=2",
                                       "model.mamba_state=16"};
  const RunConfig c = config_from_json(none, ok);
  const MambaDims d = mamba_dims(c.model);
  EXPECT_EQ(d.d_inner, 256);
  EXPECT_EQ(d.H, 16);
  EXPECT_EQ(d.in_proj_width(), 2 * 256 + 2 * 2 * 16 + 16);
  EXPECT_EQ(d.xbc_cols(), 256 + 64);
  // in_proj, conv weight + bias, dt_bias, A_log, D, the gated norm's weight, out_proj
  EXPECT_EQ(d.parameters(), 592 * 128 + 320 * 5 + 3 * 16 + 256 + 128 * 256);
  EXPECT_EQ(config_from_json(to_json(c), {}).model.mamba_state, 16);  // round trip
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> o = ok;
    o.insert(o.end(), extra.begin(), extra.end());
    return o;
  };
  expect_error(none, with({"model.pattern=M-x"}), "character 'x' at 2 is not a block");
  expect_error(none, with({"model.mamba_head_dim=24"}),
               "model.mamba_head_dim 24 does not divide d_inner");
  expect_error(none, with({"model.mamba_groups=3"}),
               "model.mamba_groups 3 does not divide the 16 Mamba heads");
  expect_error(none, with({"model.mamba_state=0"}), "model.mamba_state must be positive");
  expect_error(none, with({"model.mamba_chunk=-1"}), "model.mamba_chunk must be positive");
  // quantized Mamba layers need d_inner, G*N and the heads multiples of 16
  EXPECT_NO_THROW(config_from_json(none, with({"recipe.name=nvfp4"})));
  expect_error(none, with({"recipe.name=nvfp4", "model.mamba_head_dim=32"}),
               "the Mamba heads (d_inner / model.mamba_head_dim) = 8 must be a multiple of 16");
  expect_error(none, with({"recipe.name=nvfp4", "model.mamba_state=4"}),
               "G*N (model.mamba_groups x model.mamba_state) = 8 must be a multiple of 16");
  // ... unless every Mamba block stays in BF16 (the BF16 recipe, or hp_layers), or an override
  // quantizes one of them
  EXPECT_NO_THROW(config_from_json(none, with({"model.mamba_head_dim=32"})));
  EXPECT_NO_THROW(config_from_json(
      none, with({"recipe.name=nvfp4", "model.mamba_head_dim=32", "recipe.hp_layers=[0]"})));
  expect_error(
      none, with({"model.mamba_head_dim=32", "recipe.override.blocks.0.mamba.in_proj.fprop=nvfp4"}),
      "must be a multiple of 16");
  // FP8's 128-blocks: in_proj's width 2*256 + 2*2*16 + 16 = 592 does not tile; out_proj's d_inner
  // 256 does, so in_proj alone may stay in BF16
  std::vector<std::string> fp8 = with({"recipe.name=fp8", "train.batch=1"});
  expect_error(none, fp8,
               "mamba.in_proj is quantized, so its width 2 d_inner + 2 G N + H = 592 must be a "
               "multiple of 128 (the FP8 block)");
  for (const char* g : {"fprop", "dgrad", "wgrad"})
    fp8.push_back(std::string("recipe.override.blocks.0.mamba.in_proj.") + g + "=bf16");
  EXPECT_NO_THROW(config_from_json(none, fp8));
  // overrides of the Mamba linears, checked against the block's mixer
  EXPECT_EQ(config_from_json(none, with({"recipe.name=nvfp4",
                                         "recipe.override.blocks.0.mamba.out_proj.wgrad=bf16"}))
                .recipe.override_gemms.size(),
            1u);
  expect_error(none, with({"recipe.override.blocks.1.mamba.in_proj.fprop=bf16"}),
               "block 1 of model.pattern is an MLP ('-'), which has no mamba.in_proj");
  expect_error(none, with({"recipe.override.blocks.0.mlp.c_fc.fprop=bf16"}),
               "block 0 of model.pattern is Mamba-2 ('M'), which has no mlp.c_fc");
  expect_error(none, {"recipe.override.h.0.mamba.in_proj.fprop=bf16"},
               "expected recipe.override.h.<layer>.<attn.c_attn|attn.c_proj|mlp.c_fc|mlp.c_proj>");
  // positions none; a vocabulary past the 16-bit token files can be planned (the 12B's)
  EXPECT_EQ(config_from_json(none, with({"model.positions=none"})).model.positions,
            Positions::None);
  EXPECT_NO_THROW(config_from_json(none, with({"model.vocab=131072"})));
}

// Strict JSON: data after the value and a key given twice in one object are errors naming the
// source and the key; a repeated key in two different objects is not a duplicate.
TEST(Config, StrictJsonRefusesTrailingDataAndDuplicateKeys) {
  auto error_of = [](const std::string& text) {
    try {
      parse_strict_json(text, "cfg.json");
    } catch (const StrictJsonError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_EQ(parse_strict_json(R"({"a": {"x": 1}, "b": {"x": 2}} )", "s")["b"]["x"], 2);
  EXPECT_EQ(parse_strict_json("[1, {\"x\": [{\"y\": 1}, {\"y\": 2}]}]\n\n", "s")[0], 1);
  EXPECT_EQ(parse_strict_json("7", "s"), 7);
  EXPECT_EQ(error_of(R"({"train": {"lr": 1, "lr": 2}})"), "cfg.json: duplicate key 'train.lr'");
  EXPECT_EQ(error_of(R"({"a": 1, "a": 1})"), "cfg.json: duplicate key 'a'");
  EXPECT_EQ(error_of(R"({"m": [{"k": 1, "k": 2}]})"), "cfg.json: duplicate key 'm.k'");
  EXPECT_EQ(error_of(R"({"a": 1} x)"),
            "cfg.json: trailing data after the JSON value (at byte 10 of 10)");
  EXPECT_EQ(error_of(R"({"a": 1}{"a": 2})"),
            "cfg.json: trailing data after the JSON value (at byte 9 of 16)");
  EXPECT_EQ(error_of("3 4"), "cfg.json: trailing data after the JSON value (at byte 3 of 3)");
  EXPECT_NE(error_of(R"({"a": )").find("cfg.json: not valid JSON"), std::string::npos);
  EXPECT_NE(error_of("").find("cfg.json: not valid JSON"), std::string::npos);
  // load_config: the file's path and the key, as std::invalid_argument like every config error
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("fp4sim_strict_cfg_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "c.json").string();
  std::ofstream(path) << R"({"train": {"steps": 5, "steps": 6}})";
  try {
    load_config(path, {});
    ADD_FAILURE() << "a duplicate key was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), path + ": duplicate key 'train.steps'");
  }
  std::ofstream(path) << R"({"train": {"steps": 5}}})";
  try {
    load_config(path, {});
    ADD_FAILURE() << "trailing data was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(path + ": trailing data after the JSON value"),
              std::string::npos)
        << e.what();
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace fp4sim::model
