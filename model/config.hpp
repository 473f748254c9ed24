// Run configuration (issue 4): model shape, training and recipe, read from a JSON file, overridden
// by key=value on the command line, validated before any work, printed and saved with every
// checkpoint. Keys are dotted paths: model.d_model, train.lr, recipe.name, ...
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "emu/backend.hpp"
#include "model/schedule.hpp"

namespace fp4sim::model {

// The config's choices, enums from parse time on (the names are those of the config files).
enum class Positions : uint8_t { Learned, Rope, None };
enum class ActivationStorage : uint8_t { BF16, FP32 };
// The format of a GEMM's operands: recipe.name, the values of recipe.override.*, and each GEMM of
// a resolved LinearRecipe. BF16 quantizes nothing; the others are quantized copies (QFormat).
enum class GemmFormat : uint8_t { BF16, FP8, NVFP4, MXFP4 };
// recipe.stochastic_rounding: SR on the gradient copies; off; on every copy (x and W too).
enum class StochasticRounding : uint8_t { Gradients, Off, All };
// recipe.four_over_six: the tensors whose NVFP4 copies get Four Over Six's block scales.
enum class FourOverSix : uint8_t { Off, Weights, Activations, All };
// recipe.bf16_switch: what the late switch to BF16 moves, the Fprop GEMMs or all three.
enum class Bf16Switch : uint8_t { Forward, All };
// train.loss_scale: the loss gradient as it is, or times a dynamic power-of-two scale (DESIGN.md
// §14, model/loss_scale.hpp).
enum class LossScale : uint8_t { Off, Dynamic };
// train.grad_reduce: how data-parallel ranks add their gradients (DESIGN.md §16): every
// micro-batch's gradient all-gathered and added in global micro-batch order (the bits of one rank
// with all the micro-batches), or each rank's sum all-reduced by the engine (its order: bounded).
enum class GradReduce : uint8_t { Ordered, AllReduce };
// train.grad_comm: the gradients' dtype between ranks (bf16: rounded to nearest even first).
enum class GradComm : uint8_t { FP32, BF16 };
// optim.name: the optimizer of the blocks' linear weights (DESIGN.md §13, model/optimizer.hpp);
// the other parameters stay on AdamW under every choice.
enum class OptimizerName : uint8_t { AdamW, Muon, Root };
// optim.ns_precision: the Newton–Schulz products of Muon and ROOT in FP32, BF16 or NVFP4 (Q-Root).
enum class NsPrecision : uint8_t { FP32, BF16, NVFP4 };
// optim.state: how AdamW's m and v are stored between steps (DESIGN.md §13; nvfp4 = Q-AdamW).
enum class OptimState : uint8_t { FP32, BF16, NVFP4 };
// optim.v_floor: Q-AdamW's v̂ floored at the smallest positive v of its tile (tile_min), or not.
enum class VFloor : uint8_t { Off, TileMin };
const char* name_of(Activation a);          // gelu_tanh | squared_relu | swiglu
const char* name_of(NormKind n);            // layernorm | rmsnorm
const char* name_of(Positions p);           // learned | rope | none
const char* name_of(ActivationStorage s);   // bf16 | fp32
const char* name_of(Schedule s);            // cosine | wsd
const char* name_of(GemmFormat f);          // bf16 | fp8 | nvfp4 | mxfp4
const char* name_of(GemmImpl g);            // exact | cublaslt
const char* name_of(StochasticRounding s);  // gradients | off | all
const char* name_of(FourOverSix f);         // off | weights | activations | all
const char* name_of(FourOverSixError e);    // mae | mse
const char* name_of(MxScaleRule r);         // floor | ceil
const char* name_of(Bf16Switch b);          // forward | all
const char* name_of(LossScale s);           // off | dynamic
const char* name_of(GradReduce r);          // ordered | allreduce
const char* name_of(GradComm g);            // fp32 | bf16
const char* name_of(OptimizerName o);       // adamw | muon | root
const char* name_of(NsPrecision p);         // fp32 | bf16 | nvfp4
const char* name_of(OptimState s);          // fp32 | bf16 | nvfp4
const char* name_of(VFloor f);              // off | tile_min

struct ModelConfig {
  int64_t vocab = 256;
  int64_t seq_len = 256;
  int64_t d_model = 128;
  int64_t n_layers = 2;  // GPT layers ("*-" each); with model.pattern: the number of blocks
  // model.pattern: the blocks, one character each ('*' attention, '-' MLP, 'M' Mamba-2; DESIGN.md
  // §11). Empty (the default): the GPT-2/Llama presets' layout, "*-" per layer, the layers named
  // h.<l>. Given: block i is named blocks.<i>, model.n_layers is the pattern's length (set from
  // it), and the high-precision rule and the per-GEMM overrides count blocks.
  std::string pattern;
  int64_t n_heads = 4;
  int64_t n_kv_heads = 4;  // GQA when < n_heads
  int64_t d_ff = 512;
  Activation activation =
      Activation::GeluTanh;                  // model.activation: gelu_tanh | squared_relu | swiglu
  NormKind norm = NormKind::LayerNorm;       // model.norm: layernorm | rmsnorm
  Positions positions = Positions::Learned;  // model.positions: learned | rope | none
  int64_t max_positions = 256;               // learned positions table size
  bool tied_embeddings = true;
  bool bias = true;  // biases in the linear layers (GPT-2 has them)
  // Storage of activations and their gradients between ops (DESIGN.md §9: BF16, compute in FP32):
  // bf16 rounds every stored activation and activation gradient to BF16 (RNE); fp32 keeps them
  // FP32 (for gradient checks and comparisons with FP32 references).
  ActivationStorage activation_dtype = ActivationStorage::BF16;
  // The Mamba-2 blocks ('M' in model.pattern; DESIGN.md §12): d_inner = mamba_expand * d_model,
  // heads H = d_inner / mamba_head_dim, mamba_groups groups of B and C (H % groups == 0), state
  // size mamba_state, conv width mamba_conv, and mamba_chunk: the SSD chunk (the CUDA chunked
  // scan's chunk, and the interval of the states both backends save for the backward pass).
  int64_t mamba_expand = 2;
  int64_t mamba_head_dim = 64;
  int64_t mamba_groups = 1;
  int64_t mamba_state = 128;
  int64_t mamba_conv = 4;
  int64_t mamba_chunk = 128;
};

// The Mamba-2 mixer's sizes from a model config (DESIGN.md §12).
struct MambaDims {
  int64_t D = 0, d_inner = 0, H = 0, P = 0, G = 0, N = 0, W = 0, Q = 0;
  int64_t xbc_cols() const { return d_inner + 2 * G * N; }  // the conv's channels [x | B | C]
  // in_proj's output [z | x | B | C | dt_raw]
  int64_t in_proj_width() const { return 2 * d_inner + 2 * G * N + H; }
  int64_t z_col() const { return 0; }
  int64_t xbc_col() const { return d_inner; }
  int64_t dt_col() const { return 2 * d_inner + 2 * G * N; }
  // parameters of one Mamba-2 mixer (without its block's norm)
  int64_t parameters() const {
    return in_proj_width() * D + xbc_cols() * (W + 1) + 3 * H + d_inner + D * d_inner;
  }
};
MambaDims mamba_dims(const ModelConfig& m);

struct TrainConfig {
  int64_t batch = 8;  // sequences per micro-batch
  int64_t grad_accum =
      1;  // micro-batches per step (gradient accumulation): batch * grad_accum sequences a step
  int64_t steps = 100;
  double lr = 3e-4;
  double min_lr_ratio = 0.1;
  int64_t warmup = 10;
  Schedule schedule = Schedule::Cosine;  // train.schedule: cosine | wsd
  double decay_fraction = 0.2;           // wsd: share of steps in the final decay
  double weight_decay = 0.1;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double grad_clip = 1.0;
  LossScale loss_scale = LossScale::Off;  // train.loss_scale: off | dynamic
  // data parallel runs (mpirun -np N fp4sim train ..., DESIGN.md §16); one process ignores them
  GradReduce grad_reduce = GradReduce::Ordered;
  GradComm grad_comm = GradComm::FP32;
  // allreduce: MiB of gradients a bucket, each reduced while the backward pass goes on
  double grad_bucket_mb = 25.0;
  // ZeRO stage: 0, or 1 (each tensor's optimizer state on one rank, the weights broadcast from it
  // after the step)
  int64_t zero = 0;
  uint64_t seed = 1337;
  std::string data = "data/corpus";  // PREFIX.train.tokens / PREFIX.val.tokens, or "synthetic"
  // false: each step reads the next B windows of the training split in file order, wrapping around;
  // true: each window starts at a random offset drawn from Philox (key seed, counter (step,
  // window)), so the order is a function of (seed, step) alone and a resumed run draws the same
  // batches
  bool shuffle = false;
  int64_t eval_every = 50;
  int64_t eval_batches = 8;
  int64_t checkpoint_every = 0;  // 0: no periodic checkpoints
  int64_t keep_last = 3;         // checkpoints kept (0: all)
  std::string out_dir = "runs/train";
};

// The low-precision recipe (DESIGN.md §9, issue 5). Defaults are the published NVFP4 recipe; they
// are ignored by recipe.name = bf16.
struct RecipeConfig {
  GemmFormat name = GemmFormat::BF16;  // bf16 | fp8 | nvfp4 | mxfp4 (fp8: exact GEMMs only)
  // exact (the tensor-core model) | cublaslt (cuda backend only)
  GemmImpl gemm = GemmImpl::Exact;
  bool rht = true;  // 16-point RHT on the Wgrad operands
  // gradients | off | all (all: unusual, warns)
  StochasticRounding stochastic_rounding = StochasticRounding::Gradients;
  bool weight_2d = true;  // NVFP4 16x16 weight blocks (Dgrad weight = Fprop weight^T)
  FourOverSix four_over_six = FourOverSix::Off;        // off | weights | activations | all
  FourOverSixError fos_error = FourOverSixError::MAE;  // mae | mse
  MxScaleRule mx_scale_rule = MxScaleRule::Floor;      // floor | ceil (mxfp4)
  int64_t hp_first = -1;  // blocks kept in BF16 at the start; -1 = the recipe's default (§9)
  int64_t hp_last = -1;   // ... at the end; -1 = default
  std::vector<int64_t> hp_layers;  // further blocks kept in BF16
  int64_t bf16_from_step =
      -1;  // the late switch to BF16 from this step on (1-based, as printed; -1 = never)
  Bf16Switch bf16_switch = Bf16Switch::All;  // forward (Fprop GEMMs only) | all
  int64_t stats_every = 0;  // per-tensor quantization statistics every N steps (0 = off)
  // Per-GEMM recipe ("blocks.<block>..." with a model.pattern):
  // "h.<layer>.<attn.c_attn|attn.c_proj|mlp.c_fc|mlp.c_proj>.<fprop|dgrad|wgrad>"
  // -> bf16 | nvfp4 | mxfp4 | fp8 (keys recipe.override.<that>).
  std::map<std::string, GemmFormat> override_gemms;
};

// The optimizer (DESIGN.md §13). AdamW's hyper-parameters and the learning-rate schedule are
// train.*'s and are shared: Muon and ROOT take train.lr, its schedule and train.weight_decay.
struct OptimConfig {
  OptimizerName name = OptimizerName::AdamW;  // adamw | muon | root
  double momentum = 0.95;                     // Muon/ROOT's Nesterov momentum
  NsPrecision ns_precision = NsPrecision::FP32;
  // nvfp4 only: the quantized copies of X are clamped to +-quantile(|X|, q) (1 = off)
  double ns_clip_quantile = 0.99;
  // AdamW's m and v between steps: float32, BF16 (RNE), or NVFP4 (Q-AdamW)
  OptimState state = OptimState::FP32;
  // nvfp4: elements per tile of v's BF16 mean of sqrt(v), a multiple of 16 (a tensor whose row
  // is not a whole number of tiles keeps float32 state)
  int64_t v_tile = 16;
  // nvfp4: no decoded v̂ of a tile below the tile's smallest positive v (one more BF16 a tile)
  VFloor v_floor = VFloor::Off;
  // ROOT's coefficient table: a JSON file as configs/optim/root_ns_coefficients.json ("" = that
  // file, compiled in)
  std::string root_table;
};

struct RunConfig {
  ModelConfig model;
  TrainConfig train;
  RecipeConfig recipe;
  OptimConfig optim;
};

nlohmann::json to_json(const RunConfig& c);

// Reads a JSON config file (nested objects, or dotted keys), then applies key=value overrides.
// Unknown keys, wrong types and impossible values throw std::invalid_argument naming the key and
// listing the valid ones; a name that is not one of its key's (an enum above) is refused as the
// key is read, listing the names; validate() is called on the result. to_json writes the enums'
// names back, so a config and a checkpoint's state.json read the same as they were written.
RunConfig load_config(const std::string& path, const std::vector<std::string>& overrides);
// `source` names the JSON in error messages (a config file's path, a checkpoint's state.json).
RunConfig config_from_json(const nlohmann::json& j, const std::vector<std::string>& overrides,
                           const std::string& source = "config file");

// d_model divisible by heads, heads by KV heads, sequence within the positions table, positive
// sizes, the recipe's combinations (Four Over Six, blocks, recipe.override.* keys).
void validate(const RunConfig& c);

std::vector<std::string> valid_keys();

// The blocks as a pattern string: model.pattern, or "*-" per layer for the presets' layout.
std::string block_pattern(const ModelConfig& m);
// The name prefix of recipe unit `unit` (the high-precision rule's and the overrides' index, 0 ..
// model.n_layers - 1): "h.<unit>" for the presets' layout, "blocks.<unit>" for a model.pattern.
std::string unit_prefix(const ModelConfig& m, int64_t unit);

// Parameters of the model (embeddings counted once when tied).
// Blocks whose linear layers stay in BF16 under the recipe (§9 defaults: nvfp4/mxfp4 first
// round(2L/62) and last round(8L/62); fp8 first round(L/62), last round(2L/62); plus hp_layers).
std::vector<bool> high_precision_blocks(const RunConfig& c);

int64_t parameter_count(const ModelConfig& m);

// Training FLOPs per token (forward + backward), the PaLM appendix B estimate used by nanoGPT and
// llm.c: 6 * N + 12 * L * T * d, N the parameters without the position table, L layers, T the
// sequence length, d_model. MFU = (tokens/s * this) / peak; the trainer's peak is the H200's dense
// BF16 989 TFLOP/s.
double training_flops_per_token(const ModelConfig& m);
constexpr double kH200DenseBf16Flops = 989e12;

}  // namespace fp4sim::model
