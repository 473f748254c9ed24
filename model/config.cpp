#include "model/config.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "model/linear.hpp"
#include "model/strict_json.hpp"

namespace fp4sim::model {
namespace {

using Json = nlohmann::json;

// Every key once: how to set it from JSON and how to read it back.
struct Field {
  const char* key;
  std::function<void(RunConfig&, const Json&)> set;
  std::function<Json(const RunConfig&)> get;
};

// The enums' names, in declaration order (the first is the default's index 0 only by accident).
template <class E>
struct EnumNames;
template <>
struct EnumNames<Activation> {
  static constexpr const char* names[] = {"gelu_tanh", "squared_relu", "swiglu"};
};
template <>
struct EnumNames<NormKind> {
  static constexpr const char* names[] = {"layernorm", "rmsnorm"};
};
template <>
struct EnumNames<Positions> {
  static constexpr const char* names[] = {"learned", "rope", "none"};
};
template <>
struct EnumNames<ActivationStorage> {
  static constexpr const char* names[] = {"bf16", "fp32"};
};
template <>
struct EnumNames<GemmFormat> {
  static constexpr const char* names[] = {"bf16", "fp8", "nvfp4", "mxfp4"};
};
template <>
struct EnumNames<Schedule> {
  static constexpr const char* names[] = {"cosine", "wsd"};
};
template <>
struct EnumNames<GemmImpl> {
  static constexpr const char* names[] = {"exact", "cublaslt"};
};
template <>
struct EnumNames<StochasticRounding> {
  static constexpr const char* names[] = {"gradients", "off", "all"};
};
template <>
struct EnumNames<FourOverSix> {
  static constexpr const char* names[] = {"off", "weights", "activations", "all"};
};
template <>
struct EnumNames<FourOverSixError> {
  static constexpr const char* names[] = {"mae", "mse"};
};
template <>
struct EnumNames<MxScaleRule> {
  static constexpr const char* names[] = {"floor", "ceil"};
};
template <>
struct EnumNames<Bf16Switch> {
  static constexpr const char* names[] = {"forward", "all"};
};
template <>
struct EnumNames<LossScale> {
  static constexpr const char* names[] = {"off", "dynamic"};
};
template <>
struct EnumNames<GradReduce> {
  static constexpr const char* names[] = {"ordered", "allreduce"};
};
template <>
struct EnumNames<GradComm> {
  static constexpr const char* names[] = {"fp32", "bf16"};
};
template <>
struct EnumNames<OptimizerName> {
  static constexpr const char* names[] = {"adamw", "muon", "root"};
};
template <>
struct EnumNames<NsPrecision> {
  static constexpr const char* names[] = {"fp32", "bf16", "nvfp4"};
};
template <>
struct EnumNames<VFloor> {
  static constexpr const char* names[] = {"off", "tile_min"};
};
template <>
struct EnumNames<OptimState> {
  static constexpr const char* names[] = {"fp32", "bf16", "nvfp4"};
};

[[noreturn]] void bad(const std::string& m);

// E's names, "a, b, c".
template <class E>
std::string enum_names() {
  std::string list;
  for (size_t i = 0; i < std::size(EnumNames<E>::names); ++i)
    list += std::string(i ? ", " : "") + EnumNames<E>::names[i];
  return list;
}

// key's value (a JSON string) as an enum E: the error names the key and lists the names.
template <class E>
E parse_enum(const std::string& key, const Json& v) {
  const std::string s = v.get<std::string>();  // (a non-string: Json's type error, "wrong type")
  for (size_t i = 0; i < std::size(EnumNames<E>::names); ++i)
    if (s == EnumNames<E>::names[i]) return static_cast<E>(i);
  bad(key + " '" + s + "' is not one of: " + enum_names<E>());
}

// clang-format off
#define FP4SIM_ENUM_FIELD(part, name)                                                 \
  Field {                                                                             \
    #part "." #name,                                                                  \
        [](RunConfig& c, const Json& v) {                                             \
          c.part.name = parse_enum<decltype(c.part.name)>(#part "." #name, v);        \
        },                                                                            \
        [](const RunConfig& c) { return Json(name_of(c.part.name)); }                 \
  }
#define FP4SIM_FIELD(part, name)                                                      \
  Field {                                                                             \
    #part "." #name,                                                                  \
        [](RunConfig& c, const Json& v) { c.part.name = v.get<decltype(c.part.name)>(); }, \
        [](const RunConfig& c) { return Json(c.part.name); }                          \
  }
// clang-format on

const std::vector<Field>& fields() {
  static const std::vector<Field> f = {FP4SIM_FIELD(model, vocab),
                                       FP4SIM_FIELD(model, seq_len),
                                       FP4SIM_FIELD(model, d_model),
                                       FP4SIM_FIELD(model, n_layers),
                                       FP4SIM_FIELD(model, pattern),
                                       FP4SIM_FIELD(model, n_heads),
                                       FP4SIM_FIELD(model, n_kv_heads),
                                       FP4SIM_FIELD(model, d_ff),
                                       FP4SIM_ENUM_FIELD(model, activation),
                                       FP4SIM_ENUM_FIELD(model, norm),
                                       FP4SIM_ENUM_FIELD(model, positions),
                                       FP4SIM_FIELD(model, max_positions),
                                       FP4SIM_FIELD(model, tied_embeddings),
                                       FP4SIM_FIELD(model, bias),
                                       FP4SIM_ENUM_FIELD(model, activation_dtype),
                                       FP4SIM_FIELD(model, mamba_expand),
                                       FP4SIM_FIELD(model, mamba_head_dim),
                                       FP4SIM_FIELD(model, mamba_groups),
                                       FP4SIM_FIELD(model, mamba_state),
                                       FP4SIM_FIELD(model, mamba_conv),
                                       FP4SIM_FIELD(model, mamba_chunk),
                                       FP4SIM_FIELD(train, batch),
                                       FP4SIM_FIELD(train, grad_accum),
                                       FP4SIM_FIELD(train, steps),
                                       FP4SIM_FIELD(train, lr),
                                       FP4SIM_FIELD(train, min_lr_ratio),
                                       FP4SIM_FIELD(train, warmup),
                                       FP4SIM_ENUM_FIELD(train, schedule),
                                       FP4SIM_FIELD(train, decay_fraction),
                                       FP4SIM_FIELD(train, weight_decay),
                                       FP4SIM_FIELD(train, beta1),
                                       FP4SIM_FIELD(train, beta2),
                                       FP4SIM_FIELD(train, eps),
                                       FP4SIM_FIELD(train, grad_clip),
                                       FP4SIM_ENUM_FIELD(train, loss_scale),
                                       FP4SIM_ENUM_FIELD(train, grad_reduce),
                                       FP4SIM_ENUM_FIELD(train, grad_comm),
                                       FP4SIM_FIELD(train, zero),
                                       FP4SIM_FIELD(train, grad_bucket_mb),
                                       FP4SIM_FIELD(train, seed),
                                       FP4SIM_FIELD(train, data),
                                       FP4SIM_FIELD(train, shuffle),
                                       FP4SIM_FIELD(train, eval_every),
                                       FP4SIM_FIELD(train, eval_batches),
                                       FP4SIM_FIELD(train, checkpoint_every),
                                       FP4SIM_FIELD(train, keep_last),
                                       FP4SIM_FIELD(train, out_dir),
                                       FP4SIM_ENUM_FIELD(recipe, name),
                                       FP4SIM_ENUM_FIELD(recipe, gemm),
                                       FP4SIM_FIELD(recipe, rht),
                                       FP4SIM_ENUM_FIELD(recipe, stochastic_rounding),
                                       FP4SIM_FIELD(recipe, weight_2d),
                                       FP4SIM_ENUM_FIELD(recipe, four_over_six),
                                       FP4SIM_ENUM_FIELD(recipe, fos_error),
                                       FP4SIM_ENUM_FIELD(recipe, mx_scale_rule),
                                       FP4SIM_FIELD(recipe, hp_first),
                                       FP4SIM_FIELD(recipe, hp_last),
                                       FP4SIM_FIELD(recipe, hp_layers),
                                       FP4SIM_FIELD(recipe, bf16_from_step),
                                       FP4SIM_ENUM_FIELD(recipe, bf16_switch),
                                       FP4SIM_FIELD(recipe, stats_every),
                                       FP4SIM_ENUM_FIELD(optim, name),
                                       FP4SIM_FIELD(optim, momentum),
                                       FP4SIM_ENUM_FIELD(optim, ns_precision),
                                       FP4SIM_FIELD(optim, ns_clip_quantile),
                                       FP4SIM_ENUM_FIELD(optim, state),
                                       FP4SIM_FIELD(optim, v_tile),
                                       FP4SIM_ENUM_FIELD(optim, v_floor),
                                       FP4SIM_FIELD(optim, root_table)};
  return f;
}

#undef FP4SIM_FIELD
#undef FP4SIM_ENUM_FIELD

const Field* find_field(const std::string& key) {
  for (const Field& f : fields())
    if (key == f.key) return &f;
  return nullptr;
}

std::string key_list() {
  std::string s;
  for (const Field& f : fields()) s += std::string(s.empty() ? "" : ", ") + f.key;
  return s;
}

constexpr const char* kOverridePrefix = "recipe.override.";

void set_key(RunConfig& c, const std::string& key, const Json& v, const std::string& where) {
  if (key.rfind(kOverridePrefix, 0) == 0) {  // a per-GEMM recipe; its key is checked in validate()
    if (!v.is_string())
      throw std::invalid_argument(where + ": " + key + " = " + v.dump() +
                                  " must be a recipe name (" + enum_names<GemmFormat>() + ")");
    c.recipe.override_gemms[key.substr(std::string(kOverridePrefix).size())] =
        parse_enum<GemmFormat>(key, v);
    return;
  }
  const Field* f = find_field(key);
  if (!f)
    throw std::invalid_argument(where + ": unknown config key '" + key +
                                "'; valid keys: " + key_list());
  // integer keys: an integral float (1e3, 1000.0) is that integer; a fraction, or a negative value
  // for an unsigned key (train.seed), is an error rather than a silent truncation or wrap-around
  const Json def = f->get(RunConfig{});
  Json val = v;
  if (def.is_number_integer() && v.is_number_float()) {
    const double d = v.get<double>();
    if (!(std::trunc(d) == d && std::fabs(d) < 9.2e18))
      throw std::invalid_argument(where + ": " + key + " = " + v.dump() + " must be an integer");
    val = static_cast<int64_t>(d);
  }
  if (def.is_number_unsigned() && val.is_number_integer() && !val.is_number_unsigned() &&
      val.get<int64_t>() < 0)
    throw std::invalid_argument(where + ": " + key + " = " + v.dump() + " must be >= 0");
  // a signed key given a value past 2^63 - 1 (which would wrap to a negative number)
  if (def.is_number_integer() && !def.is_number_unsigned() && val.is_number_unsigned() &&
      val.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
    throw std::invalid_argument(where + ": " + key + " = " + v.dump() + " is out of range");
  if (def.is_array() &&
      val.is_array())  // integer lists (recipe.hp_layers): every element an integer
    for (size_t i = 0; i < val.size(); ++i)
      if (!val[i].is_number_integer())
        throw std::invalid_argument(where + ": " + key + "[" + std::to_string(i) +
                                    "] = " + val[i].dump() + " must be an integer");
  try {
    f->set(c, val);
  } catch (const Json::exception&) {
    throw std::invalid_argument(where + ": " + key + " = " + v.dump() +
                                " has the wrong type (expected " + f->get(RunConfig{}).type_name() +
                                ")");
  }
}

// {"model": {"d_model": 1}} and {"model.d_model": 1} both become ("model.d_model", 1).
void flatten(const Json& j, const std::string& prefix,
             std::vector<std::pair<std::string, Json>>& out) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string key = prefix.empty() ? it.key() : prefix + "." + it.key();
    if (it->is_object())
      flatten(*it, key, out);
    else
      out.emplace_back(key, *it);
  }
}

[[noreturn]] void bad(const std::string& m) { throw std::invalid_argument("config: " + m); }

// The Mamba-2 sizes (DESIGN.md §12), where model.pattern has an 'M' block.
void validate_mamba(const ModelConfig& m) {
  for (const auto& [k, v] : {std::pair<const char*, int64_t>{"model.mamba_expand", m.mamba_expand},
                             {"model.mamba_head_dim", m.mamba_head_dim},
                             {"model.mamba_groups", m.mamba_groups},
                             {"model.mamba_state", m.mamba_state},
                             {"model.mamba_conv", m.mamba_conv},
                             {"model.mamba_chunk", m.mamba_chunk}})
    if (v <= 0) bad(std::string(k) + " must be positive, got " + std::to_string(v));
  const MambaDims d = mamba_dims(m);
  if (d.d_inner % d.P != 0)
    bad("model.mamba_head_dim " + std::to_string(d.P) + " does not divide d_inner = " +
        "model.mamba_expand x model.d_model = " + std::to_string(d.d_inner));
  if (d.H % d.G != 0)
    bad("model.mamba_groups " + std::to_string(d.G) + " does not divide the " +
        std::to_string(d.H) + " Mamba heads (d_inner " + std::to_string(d.d_inner) +
        " / model.mamba_head_dim " + std::to_string(d.P) + ")");
}

// The largest block (16 NVFP4, 32 MXFP4, 128 FP8; 0: all three BF16) among the GEMMs of linear
// `linear` (kLinearNames) of pattern block i at step 0 under the recipe (resolve_linear_recipe; the
// late BF16 switch only removes quantization).
int64_t linear_block(const RunConfig& c, const std::vector<bool>& hp, int64_t i, int linear) {
  const LinearRecipe r = resolve_linear_recipe(c, hp, i, linear, 0);
  int64_t blk = 0;
  for (const GemmFormat f : {r.fprop, r.dgrad, r.wgrad})
    if (f != GemmFormat::BF16) blk = std::max(blk, qformat_block(qformat_of(f)));
  return blk;
}

void validate_recipe(const RunConfig& c) {
  const RecipeConfig& r = c.recipe;
  const ModelConfig& m = c.model;
  const int64_t L = m.n_layers;
  if (r.hp_first < -1 || r.hp_last < -1)
    bad("recipe.hp_first/hp_last (" + std::to_string(r.hp_first) + ", " +
        std::to_string(r.hp_last) + ") must be >= 0, or -1 for the recipe's default");
  if (r.hp_first > L || r.hp_last > L)
    bad("recipe.hp_first/hp_last (" + std::to_string(r.hp_first) + ", " +
        std::to_string(r.hp_last) + ") exceed model.n_layers " + std::to_string(L));
  for (int64_t l : r.hp_layers)
    if (l < 0 || l >= L)
      bad("recipe.hp_layers: block " + std::to_string(l) + " is outside 0.." +
          std::to_string(L - 1));
  if (r.stats_every < 0)
    bad("recipe.stats_every must be >= 0 (0: no statistics), got " + std::to_string(r.stats_every));
  if (r.bf16_from_step == 0 || r.bf16_from_step < -1)
    bad("recipe.bf16_from_step must be a step number >= 1 (steps count from 1), or -1 for never");
  const bool fos = r.four_over_six != FourOverSix::Off;
  const bool mx = r.name == GemmFormat::MXFP4;
  if (mx && r.weight_2d)
    bad("recipe.weight_2d: MXFP4 has no 2D blocks (set recipe.weight_2d=false)");
  if (mx && fos) bad("recipe.four_over_six: Four Over Six is an NVFP4 technique, not MXFP4");
  if (r.name == GemmFormat::FP8 && fos)
    bad("recipe.four_over_six: Four Over Six is an NVFP4 technique, not FP8");
  // Four Over Six needs RN and no RHT on every copy of the tensors it applies to
  if ((r.four_over_six == FourOverSix::Activations || r.four_over_six == FourOverSix::All) && r.rht)
    bad(std::string("recipe.four_over_six ") + name_of(r.four_over_six) +
        " with recipe.rht: the Wgrad copies get the RHT, which "
        "Four Over Six cannot follow; set recipe.rht=false");
  if (r.four_over_six == FourOverSix::All && r.stochastic_rounding != StochasticRounding::Off)
    bad("recipe.four_over_six all with stochastic rounding: Four Over Six is RN only; set "
        "recipe.stochastic_rounding=off");
  if (r.four_over_six == FourOverSix::Weights && r.stochastic_rounding == StochasticRounding::All)
    bad("recipe.four_over_six weights with recipe.stochastic_rounding all: Four Over Six is RN "
        "only");
  if (r.four_over_six == FourOverSix::Activations &&
      r.stochastic_rounding == StochasticRounding::All)
    bad("recipe.four_over_six activations with recipe.stochastic_rounding all: Four Over Six is RN "
        "only");
  // block sizes: every quantized GEMM's K dimension (d_model, d_ff, the qkv width, the tokens of a
  // step for Wgrad) must be a multiple of the block (16 NVFP4, 32 MXFP4), and so must the 2D rows
  bool any_mx = mx, any_fp8 = r.name == GemmFormat::FP8, any_q = r.name != GemmFormat::BF16;
  for (const auto& kv : r.override_gemms) {
    any_mx = any_mx || kv.second == GemmFormat::MXFP4;
    any_fp8 = any_fp8 || kv.second == GemmFormat::FP8;
    any_q = any_q || kv.second != GemmFormat::BF16;
  }
  if (any_q) {
    const int64_t blk = any_fp8 ? 128 : (any_mx ? 32 : 16), hd = m.d_model / m.n_heads;
    const std::pair<const char*, int64_t> dims[] = {
        {"model.d_model", m.d_model},
        {"model.d_ff", m.d_ff},
        {"the qkv width (n_heads + 2 n_kv_heads) * head_dim", (m.n_heads + 2 * m.n_kv_heads) * hd},
        {"the tokens of a step (train.batch * model.seq_len)", c.train.batch * m.seq_len}};
    for (const auto& [what, v] : dims)
      if (v % blk != 0)
        bad(std::string(what) + " = " + std::to_string(v) + " is not a multiple of " +
            std::to_string(blk) + ", the " + (any_fp8 ? "FP8" : (any_mx ? "MXFP4" : "NVFP4")) +
            " block the quantized GEMMs need");
    // a quantized Mamba linear: in_proj's output [z | x | B | C | dt_raw] is blocked by 16 in
    // d_inner, G*N and the heads (DESIGN.md §12) and as a whole by the recipe's block; out_proj's
    // input d_inner by the recipe's block
    const std::string p = block_pattern(m);
    const std::vector<bool> hp = high_precision_blocks(c);
    const MambaDims d = mamba_dims(m);
    for (size_t i = 0; i < p.size(); ++i) {
      if (p[i] != 'M') continue;
      const int64_t b = static_cast<int64_t>(i);
      const std::string where = "model.pattern block " + std::to_string(i) + " (Mamba-2): ";
      auto need = [&](const std::string& lin, const std::string& what, int64_t v, int64_t blk) {
        if (blk > 0 && v % blk != 0)
          bad(where + lin + " is quantized, so " + what + " = " + std::to_string(v) +
              " must be a multiple of " + std::to_string(blk) + " (the " +
              (blk == 128  ? "FP8"
               : blk == 32 ? "MXFP4"
                           : "NVFP4") +
              " block); keep it in BF16 (recipe.hp_layers, or recipe.override.blocks." +
              std::to_string(i) + "." + lin + ".<gemm>=bf16) or change the sizes");
      };
      const int64_t in_blk = linear_block(c, hp, b, 4);
      if (in_blk > 0) {
        need("mamba.in_proj", "d_inner (model.mamba_expand x model.d_model)", d.d_inner, 16);
        need("mamba.in_proj", "G*N (model.mamba_groups x model.mamba_state)", d.G * d.N, 16);
        need("mamba.in_proj", "the Mamba heads (d_inner / model.mamba_head_dim)", d.H, 16);
        need("mamba.in_proj", "its width 2 d_inner + 2 G N + H", d.in_proj_width(), in_blk);
      }
      need("mamba.out_proj", "d_inner", d.d_inner, linear_block(c, hp, b, 5));
    }
  }
  // h.<layer>.<linear>.<gemm> (the presets' layout), blocks.<block>.<linear>.<gemm> (a pattern,
  // the linear one of the block's mixer); the value is parsed already
  const std::string unit = m.pattern.empty() ? "h" : "blocks";
  for (const auto& kv : r.override_gemms) {
    const std::string& k = kv.first;
    const auto a = k.find('.'), b = k.find('.', a + 1), z = k.rfind('.');
    bool ok = k.rfind(unit + ".", 0) == 0 && b != std::string::npos && z > b;
    int64_t l = -1;
    if (ok) {
      try {
        l = std::stoll(k.substr(a + 1, b - a - 1));
      } catch (const std::exception&) {
        ok = false;
      }
    }
    const std::string lin = ok ? k.substr(b + 1, z - b - 1) : "", g = ok ? k.substr(z + 1) : "";
    const bool mamba_lin = lin == "mamba.in_proj" || lin == "mamba.out_proj";
    ok = ok &&
         (lin == "attn.c_attn" || lin == "attn.c_proj" || lin == "mlp.c_fc" ||
          lin == "mlp.c_proj" || (mamba_lin && !m.pattern.empty())) &&
         (g == "fprop" || g == "dgrad" || g == "wgrad");
    if (!ok)
      bad("recipe.override." + k + ": expected recipe.override." + unit + ".<" +
          (m.pattern.empty() ? "layer" : "block") +
          ">.<attn.c_attn|attn.c_proj|mlp.c_fc|mlp.c_proj" +
          (m.pattern.empty() ? "" : "|mamba.in_proj|mamba.out_proj") + ">.<fprop|dgrad|wgrad>");
    if (l < 0 || l >= L)
      bad("recipe.override." + k + ": block " + std::to_string(l) + " is outside 0.." +
          std::to_string(L - 1));
    if (!m.pattern.empty()) {
      const char want = lin.rfind("attn.", 0) == 0 ? '*' : (mamba_lin ? 'M' : '-');
      const char is = m.pattern[static_cast<size_t>(l)];
      if (want != is)
        bad("recipe.override." + k + ": block " + std::to_string(l) + " of model.pattern is " +
            (is == '-'   ? "an MLP ('-')"
             : is == '*' ? "attention ('*')"
                         : "Mamba-2 ('M')") +
            ", which has no " + lin);
    }
  }
}

}  // namespace

nlohmann::json to_json(const RunConfig& c) {
  Json j;
  for (const Field& f : fields()) {
    const std::string k = f.key;
    const auto dot = k.find('.');
    j[k.substr(0, dot)][k.substr(dot + 1)] = f.get(c);
  }
  for (const auto& [k, v] : c.recipe.override_gemms) j["recipe"]["override"][k] = name_of(v);
  return j;
}

std::vector<std::string> valid_keys() {
  std::vector<std::string> k;
  for (const Field& f : fields()) k.push_back(f.key);
  return k;
}

RunConfig config_from_json(const Json& j, const std::vector<std::string>& overrides,
                           const std::string& source) {
  RunConfig c;
  std::vector<std::pair<std::string, Json>> kv;
  flatten(j, "", kv);
  std::vector<std::string> set_keys;
  for (const auto& [k, v] : kv) {
    set_key(c, k, v, source);
    set_keys.push_back(k);
  }
  for (const std::string& o : overrides) {
    const auto eq = o.find('=');
    if (eq == std::string::npos || eq == 0)
      throw std::invalid_argument("override '" + o +
                                  "': expected key=value (e.g. model.d_model=256)");
    const std::string key = o.substr(0, eq), text = o.substr(eq + 1);
    Json v = Json::parse(text, nullptr, /*allow_exceptions=*/false);
    const Field* f = find_field(key);
    const bool as_written =
        (f && f->get(RunConfig{}).is_string()) || key.rfind(kOverridePrefix, 0) == 0;
    if (v.is_discarded() && !as_written) {
      // a number too large for a double (1e400) is not a word: say so rather than "wrong type"
      char* end = nullptr;
      errno = 0;
      (void)std::strtod(text.c_str(), &end);
      if (!text.empty() && end && *end == '\0' && errno == ERANGE)
        throw std::invalid_argument("override '" + o + "': " + text +
                                    " is out of the range of a double");
    }
    if (v.is_discarded() || as_written)
      v = text;  // a bare word, or a string key's value: as written
    set_key(c, key, v, "override '" + o + "'");
    set_keys.push_back(key);
  }
  // an explicit model.pattern sets the block count; a model.n_layers given with it must agree
  if (!c.model.pattern.empty()) {
    const int64_t blocks = static_cast<int64_t>(c.model.pattern.size());
    if (std::find(set_keys.begin(), set_keys.end(), "model.n_layers") != set_keys.end() &&
        c.model.n_layers != blocks)
      bad("model.n_layers " + std::to_string(c.model.n_layers) + " differs from the " +
          std::to_string(blocks) + " blocks of model.pattern '" + c.model.pattern +
          "' (with a pattern, model.n_layers counts its blocks: leave it out or set it to " +
          std::to_string(blocks) + ")");
    c.model.n_layers = blocks;
  }
  // recipe.weight_2d defaults to the NVFP4 recipe's true; MXFP4 has no 2D blocks, so there the
  // default is false (an explicit true stays an error)
  if (c.recipe.name == GemmFormat::MXFP4 &&
      std::find(set_keys.begin(), set_keys.end(), "recipe.weight_2d") == set_keys.end())
    c.recipe.weight_2d = false;
  validate(c);
  return c;
}

RunConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  if (!std::ifstream(path)) throw std::invalid_argument(path + ": cannot open config file");
  Json j;
  try {
    j = read_strict_json_file(path);  // (no trailing data, no duplicate keys)
  } catch (const StrictJsonError& e) {
    throw std::invalid_argument(e.what());
  }
  if (!j.is_object()) throw std::invalid_argument(path + ": a config file is a JSON object");
  return config_from_json(j, overrides, path);
}

void validate(const RunConfig& c) {
  const ModelConfig& m = c.model;
  const TrainConfig& t = c.train;
  auto positive = [](const char* k, int64_t v) {
    if (v <= 0) bad(std::string(k) + " must be positive, got " + std::to_string(v));
  };
  positive("model.vocab", m.vocab);
  positive("model.seq_len", m.seq_len);
  positive("model.d_model", m.d_model);
  positive("model.n_layers", m.n_layers);
  positive("model.n_heads", m.n_heads);
  positive("model.n_kv_heads", m.n_kv_heads);
  positive("model.d_ff", m.d_ff);
  if (!m.pattern.empty()) {
    for (size_t i = 0; i < m.pattern.size(); ++i) {
      const char ch = m.pattern[i];
      if (ch != '*' && ch != '-' && ch != 'M')
        bad("model.pattern '" + m.pattern + "': character '" + std::string(1, ch) + "' at " +
            std::to_string(i) + " is not a block ('*' attention, '-' MLP, 'M' Mamba-2)");
    }
    if (m.n_layers != static_cast<int64_t>(m.pattern.size()))
      bad("model.n_layers " + std::to_string(m.n_layers) + " differs from the " +
          std::to_string(m.pattern.size()) + " blocks of model.pattern '" + m.pattern + "'");
  }
  positive("train.batch", t.batch);
  if (t.grad_accum < 1 || t.grad_accum > 256)
    bad("train.grad_accum must be within 1..256 (the SR stream has 8 bits for the micro-batch), "
        "got " +
        std::to_string(t.grad_accum));
  positive("train.steps", t.steps);
  if (t.zero != 0 && t.zero != 1)
    bad("train.zero must be 0 or 1 (ZeRO-1: optimizer state sharded over the ranks), got " +
        std::to_string(t.zero));
  if (m.d_model % m.n_heads != 0)
    bad("model.d_model " + std::to_string(m.d_model) + " is not divisible by model.n_heads " +
        std::to_string(m.n_heads));
  if (m.n_heads % m.n_kv_heads != 0)
    bad("model.n_heads " + std::to_string(m.n_heads) + " is not divisible by model.n_kv_heads " +
        std::to_string(m.n_kv_heads));
  if (block_pattern(m).find('M') != std::string::npos) validate_mamba(m);
  if (m.positions == Positions::Rope && (m.d_model / m.n_heads) % 2 != 0)
    bad("rope needs an even head dimension, got " + std::to_string(m.d_model / m.n_heads));
  if (m.positions == Positions::Learned && m.seq_len > m.max_positions)
    bad("model.seq_len " + std::to_string(m.seq_len) +
        " is longer than the learned positions table "
        "(model.max_positions " +
        std::to_string(m.max_positions) + ")");
  auto num = [](double v) {  // as the user wrote it: 3e-4, 0.1, 10
    std::ostringstream o;
    o << v;
    return o.str();
  };
  if (!(t.grad_bucket_mb > 0) || !(t.grad_bucket_mb <= 1048576))
    bad("train.grad_bucket_mb must be a number of MiB in (0, 1048576] (a gradient bucket), got " +
        num(t.grad_bucket_mb));
  if (t.lr <= 0) bad("train.lr must be positive, got " + num(t.lr));
  if (t.warmup < 0 || t.warmup > t.steps)
    bad("train.warmup = " + std::to_string(t.warmup) + " must be within 0..train.steps (" +
        std::to_string(t.steps) + "); set train.warmup too when shortening a run");
  if (t.grad_clip < 0)
    bad("train.grad_clip must be >= 0 (0 disables clipping), got " + num(t.grad_clip));
  if (t.decay_fraction < 0 || t.decay_fraction > 1)
    bad("train.decay_fraction must be within 0..1, got " + num(t.decay_fraction));
  if (t.eval_every < 0)
    bad("train.eval_every must be >= 0 (0: no periodic validation), got " +
        std::to_string(t.eval_every));
  if (t.eval_batches < 1)
    bad("train.eval_batches must be >= 1, got " + std::to_string(t.eval_batches));
  if (t.checkpoint_every < 0)
    bad("train.checkpoint_every must be >= 0 (0: no periodic checkpoints), got " +
        std::to_string(t.checkpoint_every));
  if (t.keep_last < 0)
    bad("train.keep_last must be >= 0 (0 keeps every checkpoint), got " +
        std::to_string(t.keep_last));
  // AdamW: beta1, beta2 in [0, 1) (1 divides by zero in the bias correction), eps > 0
  if (!(t.beta1 >= 0 && t.beta1 < 1)) bad("train.beta1 must be within [0, 1), got " + num(t.beta1));
  if (!(t.beta2 >= 0 && t.beta2 < 1)) bad("train.beta2 must be within [0, 1), got " + num(t.beta2));
  if (!(t.eps > 0)) bad("train.eps must be positive, got " + num(t.eps));
  if (!(t.weight_decay >= 0)) bad("train.weight_decay must be >= 0, got " + num(t.weight_decay));
  if (!(t.min_lr_ratio >= 0 && t.min_lr_ratio <= 1))
    bad("train.min_lr_ratio must be within 0..1, got " + num(t.min_lr_ratio));
  // a batch's token count must fit comfortably in 64 bits (and in memory): 2^40 tokens is far past
  // both
  if (t.batch > (int64_t{1} << 40) / m.seq_len)
    bad("train.batch " + std::to_string(t.batch) + " x model.seq_len " + std::to_string(m.seq_len) +
        " tokens is too large for one batch");
  const OptimConfig& o = c.optim;
  if (!(o.momentum >= 0 && o.momentum < 1))
    bad("optim.momentum must be within [0, 1), got " + num(o.momentum));
  if (!(o.ns_clip_quantile > 0 && o.ns_clip_quantile <= 1))
    bad("optim.ns_clip_quantile must be within (0, 1] (1: no clipping), got " +
        num(o.ns_clip_quantile));
  if (o.name == OptimizerName::AdamW && o.ns_precision != NsPrecision::FP32)
    bad(std::string("optim.ns_precision=") + name_of(o.ns_precision) +
        " sets the precision of Muon's and ROOT's Newton–Schulz products, and optim.name=adamw "
        "has none (use optim.name=muon or root, or leave optim.ns_precision at fp32)");
  if (o.v_tile < 16 || o.v_tile % 16 != 0)
    bad("optim.v_tile must be a positive multiple of 16 (the NVFP4 block), got " +
        std::to_string(o.v_tile));
  validate_recipe(c);
}

std::vector<bool> high_precision_blocks(const RunConfig& c) {
  const int64_t L = c.model.n_layers;
  const bool fp8 = c.recipe.name == GemmFormat::FP8;
  auto round_div = [](int64_t num, int64_t den) {
    return (2 * num + den) / (2 * den);
  };  // round half up
  const int64_t first =
      c.recipe.hp_first >= 0 ? c.recipe.hp_first : round_div((fp8 ? 1 : 2) * L, 62);
  const int64_t last = c.recipe.hp_last >= 0 ? c.recipe.hp_last : round_div((fp8 ? 2 : 8) * L, 62);
  std::vector<bool> hp(static_cast<size_t>(L), c.recipe.name == GemmFormat::BF16);
  for (int64_t l = 0; l < L; ++l)
    if (l < first || l >= L - last) hp[static_cast<size_t>(l)] = true;
  for (int64_t l : c.recipe.hp_layers)
    if (l >= 0 && l < L) hp[static_cast<size_t>(l)] = true;
  return hp;
}

std::string block_pattern(const ModelConfig& m) {
  if (!m.pattern.empty()) return m.pattern;
  std::string p;
  for (int64_t l = 0; l < m.n_layers; ++l) p += "*-";
  return p;
}

MambaDims mamba_dims(const ModelConfig& m) {
  MambaDims d;
  d.D = m.d_model;
  d.d_inner = m.mamba_expand * m.d_model;
  d.P = m.mamba_head_dim;
  d.H = d.P > 0 ? d.d_inner / d.P : 0;
  d.G = m.mamba_groups;
  d.N = m.mamba_state;
  d.W = m.mamba_conv;
  d.Q = m.mamba_chunk;
  return d;
}

std::string unit_prefix(const ModelConfig& m, int64_t unit) {
  return (m.pattern.empty() ? "h." : "blocks.") + std::to_string(unit);
}

int64_t parameter_count(const ModelConfig& m) {
  const int64_t hd = m.d_model / m.n_heads, qkv = m.d_model + 2 * m.n_kv_heads * hd;
  const int64_t swiglu = m.activation == Activation::SwiGLU ? 1 : 0;
  const int64_t norm = (m.norm == NormKind::LayerNorm ? 2 : 1) * m.d_model;  // weight (+ bias)
  const int64_t attn = m.d_model * qkv + m.d_model * m.d_model + (m.bias ? qkv + m.d_model : 0);
  const int64_t mlp =
      (2 + swiglu) * m.d_model * m.d_ff + (m.bias ? (1 + swiglu) * m.d_ff + m.d_model : 0);
  const int64_t emb = m.vocab * m.d_model * (m.tied_embeddings ? 1 : 2);
  const int64_t pos = m.positions == Positions::Learned ? m.max_positions * m.d_model : 0;
  const int64_t mamba =
      block_pattern(m).find('M') != std::string::npos ? mamba_dims(m).parameters() : 0;
  int64_t blocks = 0;
  for (char b : block_pattern(m)) blocks += norm + (b == '*' ? attn : (b == 'M' ? mamba : mlp));
  return blocks + emb + pos + norm;  // (+ ln_f)
}

double training_flops_per_token(const ModelConfig& m) {
  const double pos =
      m.positions == Positions::Learned ? static_cast<double>(m.max_positions * m.d_model) : 0.0;
  const double n = static_cast<double>(parameter_count(m)) - pos;
  const std::string p = block_pattern(m);
  const int64_t attention_blocks = std::count(p.begin(), p.end(), '*');
  return 6.0 * n + 12.0 * static_cast<double>(attention_blocks * m.seq_len * m.d_model);
}

const char* name_of(Activation a) { return EnumNames<Activation>::names[static_cast<int>(a)]; }
const char* name_of(NormKind n) { return EnumNames<NormKind>::names[static_cast<int>(n)]; }
const char* name_of(Positions p) { return EnumNames<Positions>::names[static_cast<int>(p)]; }
const char* name_of(ActivationStorage s) {
  return EnumNames<ActivationStorage>::names[static_cast<int>(s)];
}
const char* name_of(GemmFormat f) { return EnumNames<GemmFormat>::names[static_cast<int>(f)]; }
const char* name_of(Schedule s) { return EnumNames<Schedule>::names[static_cast<int>(s)]; }
const char* name_of(GemmImpl g) { return EnumNames<GemmImpl>::names[static_cast<int>(g)]; }
const char* name_of(StochasticRounding s) {
  return EnumNames<StochasticRounding>::names[static_cast<int>(s)];
}
const char* name_of(FourOverSix f) { return EnumNames<FourOverSix>::names[static_cast<int>(f)]; }
const char* name_of(FourOverSixError e) {
  return EnumNames<FourOverSixError>::names[static_cast<int>(e)];
}
const char* name_of(MxScaleRule r) { return EnumNames<MxScaleRule>::names[static_cast<int>(r)]; }
const char* name_of(Bf16Switch b) { return EnumNames<Bf16Switch>::names[static_cast<int>(b)]; }
const char* name_of(LossScale s) { return EnumNames<LossScale>::names[static_cast<int>(s)]; }
const char* name_of(GradReduce r) { return EnumNames<GradReduce>::names[static_cast<int>(r)]; }
const char* name_of(GradComm g) { return EnumNames<GradComm>::names[static_cast<int>(g)]; }
const char* name_of(OptimizerName o) {
  return EnumNames<OptimizerName>::names[static_cast<int>(o)];
}
const char* name_of(NsPrecision p) { return EnumNames<NsPrecision>::names[static_cast<int>(p)]; }
const char* name_of(OptimState s) { return EnumNames<OptimState>::names[static_cast<int>(s)]; }
const char* name_of(VFloor f) { return EnumNames<VFloor>::names[static_cast<int>(f)]; }

}  // namespace fp4sim::model
