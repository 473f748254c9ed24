// Run configuration (issue 4): model shape, training and recipe, read from a JSON file, overridden
// by key=value on the command line, validated before any work, printed and saved with every
// checkpoint. Keys are dotted paths: model.d_model, train.lr, recipe.name, ...
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace fp4sim::model {

struct ModelConfig {
  int64_t vocab = 256;
  int64_t seq_len = 256;
  int64_t d_model = 128;
  int64_t n_layers = 2;
  int64_t n_heads = 4;
  int64_t n_kv_heads = 4;  // GQA when < n_heads
  int64_t d_ff = 512;
  std::string activation = "gelu_tanh";  // gelu_tanh | squared_relu | swiglu
  std::string norm = "layernorm";        // layernorm | rmsnorm
  std::string positions = "learned";     // learned | rope
  int64_t max_positions = 256;           // learned positions table size
  bool tied_embeddings = true;
  bool bias = true;  // biases in the linear layers (GPT-2 has them)
};

struct TrainConfig {
  int64_t batch = 8;     // sequences per step
  int64_t steps = 100;
  double lr = 3e-4;
  double min_lr_ratio = 0.1;
  int64_t warmup = 10;
  std::string schedule = "cosine";  // cosine | wsd
  double decay_fraction = 0.2;      // wsd: share of steps in the final decay
  double weight_decay = 0.1;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double grad_clip = 1.0;
  uint64_t seed = 1337;
  std::string data = "data/corpus";  // PREFIX.train.tokens / PREFIX.val.tokens, or "synthetic"
  int64_t eval_every = 50;
  int64_t eval_batches = 8;
  int64_t checkpoint_every = 0;  // 0: no periodic checkpoints
  int64_t keep_last = 3;
  std::string out_dir = "runs/train";
};

struct RecipeConfig {
  std::string name = "bf16";  // bf16 | fp8 | nvfp4 | mxfp4 (issue 5 wires the low-precision ones)
};

struct RunConfig {
  ModelConfig model;
  TrainConfig train;
  RecipeConfig recipe;
};

nlohmann::json to_json(const RunConfig& c);

// Reads a JSON config file (nested objects, or dotted keys), then applies key=value overrides.
// Unknown keys, wrong types and impossible values throw std::invalid_argument naming the key and
// listing the valid ones; validate() is called on the result.
RunConfig load_config(const std::string& path, const std::vector<std::string>& overrides);
RunConfig config_from_json(const nlohmann::json& j, const std::vector<std::string>& overrides);

// d_model divisible by heads, heads by KV heads, sequence within the positions table, known
// activation/norm/positions/schedule/recipe names, positive sizes.
void validate(const RunConfig& c);

std::vector<std::string> valid_keys();

// Parameters of the model (embeddings counted once when tied).
int64_t parameter_count(const ModelConfig& m);

// Training FLOPs per token (forward + backward), the PaLM appendix B estimate used by nanoGPT and
// llm.c: 6 * N + 12 * L * T * d, N the parameters without the position table, L layers, T the
// sequence length, d_model. MFU = (tokens/s * this) / peak; the trainer's peak is the H200's dense
// BF16 989 TFLOP/s.
double training_flops_per_token(const ModelConfig& m);
constexpr double kH200DenseBf16Flops = 989e12;

}  // namespace fp4sim::model
