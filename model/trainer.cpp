#include "model/trainer.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <random>
#include <stdexcept>

#include "emu/contract.hpp"
#include "emu/formats.hpp"
#include "emu/optim.hpp"
#include "emu/philox.hpp"
#include "model/checkpoint.hpp"
#include "model/data.hpp"
#include "model/data_parallel.hpp"
#include "model/gpt.hpp"
#include "model/loss_scale.hpp"
#include "model/optimizer.hpp"
#include "model/output_file.hpp"
#include "model/run_lock.hpp"
#include "model/schedule.hpp"

namespace fp4sim::model {
namespace {

struct Dataset {
  TokenFile train, val;
};

// The training and validation token files (the validation split only with need_train = false, as
// eval needs), each checked against the model's vocabulary and one batch's length.
Dataset load_data(const RunConfig& c, bool need_train = true) {
  if (c.model.vocab > 65536)
    throw std::invalid_argument("model.vocab " + std::to_string(c.model.vocab) +
                                " exceeds the 16-bit tokens fp4sim trains on (at most 65536): "
                                "such a model can be planned (fp4sim config), not trained");
  Dataset d;
  const bool synthetic = c.train.data == "synthetic";
  const int64_t n_synthetic =
      std::max<int64_t>(c.train.batch * (c.model.seq_len + 1) * 64, 1 << 16);
  auto check = [&](const TokenFile& f, const std::string& name) {
    if (f.vocab > static_cast<uint32_t>(c.model.vocab))
      throw std::invalid_argument(name + ": tokens of vocabulary " + std::to_string(f.vocab) +
                                  " do not fit model.vocab " + std::to_string(c.model.vocab));
    if (static_cast<int64_t>(f.tokens.size()) < c.train.batch * c.model.seq_len + 1)
      throw std::invalid_argument(name + ": too few tokens (" + std::to_string(f.tokens.size()) +
                                  ") for one batch of " + std::to_string(c.train.batch) + " x " +
                                  std::to_string(c.model.seq_len));
  };
  if (need_train) {
    d.train = synthetic ? synthetic_tokens(n_synthetic, static_cast<uint32_t>(c.model.vocab),
                                           c.train.seed)
                        : read_token_file(c.train.data + ".train.tokens");
    check(d.train, synthetic ? "synthetic training tokens" : c.train.data + ".train.tokens");
  }
  d.val = synthetic ? synthetic_tokens(n_synthetic / 8, static_cast<uint32_t>(c.model.vocab),
                                       c.train.seed + 1)
                    : read_token_file(c.train.data + ".val.tokens");
  check(d.val, synthetic ? "synthetic validation tokens" : c.train.data + ".val.tokens");
  return d;
}

// Window b of a batch: tokens pos .. pos+T-1 as inputs, pos+1 .. pos+T as targets.
void copy_window(const TokenFile& f, int64_t pos, int64_t b, int64_t T, std::vector<int32_t>& tok,
                 std::vector<int32_t>& tgt) {
  for (int64_t t = 0; t < T; ++t) {
    tok[b * T + t] = f.tokens[static_cast<size_t>(pos + t)];
    tgt[b * T + t] = f.tokens[static_cast<size_t>(pos + t + 1)];
  }
}

// Batch at data position `pos`: B consecutive windows of T+1 tokens, wrapping around.
int64_t next_batch(const TokenFile& f, int64_t pos, int64_t B, int64_t T, std::vector<int32_t>& tok,
                   std::vector<int32_t>& tgt) {
  const int64_t n = static_cast<int64_t>(f.tokens.size());
  tok.resize(static_cast<size_t>(B * T));
  tgt.resize(static_cast<size_t>(B * T));
  for (int64_t b = 0; b < B; ++b) {
    if (pos + T + 1 > n) pos = 0;
    copy_window(f, pos, b, T, tok, tgt);
    pos += T;
  }
  return pos;
}

// train.shuffle: window w of step `step` (w = micro_batch * batch + b) starts at a uniform offset
// in [0, n - T - 1], from Philox with key = seed and counter (step lo, step hi, w, "data"). The SR
// streams share the key but put chunk indices in counter words 0-1 and their stream (step << 32 |
// ...) in words 2-3, so the two meet only if an SR stream's high word equals "data" (step
// 0x64617461). Independent of the position, so resume needs no data state.
void sample_batch(const TokenFile& f, uint64_t seed, int64_t step, int64_t first_window, int64_t B,
                  int64_t T, std::vector<int32_t>& tok, std::vector<int32_t>& tgt) {
  const uint64_t starts =
      static_cast<uint64_t>(static_cast<int64_t>(f.tokens.size()) - T);  // >= 1 (load_data)
  tok.resize(static_cast<size_t>(B * T));
  tgt.resize(static_cast<size_t>(B * T));
  for (int64_t b = 0; b < B; ++b) {
    const Philox4x32 r = philox4x32_10(
        static_cast<uint32_t>(step), static_cast<uint32_t>(static_cast<uint64_t>(step) >> 32),
        static_cast<uint32_t>(first_window + b), 0x64617461u /* "data" */,
        static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
    copy_window(f, static_cast<int64_t>(((static_cast<uint64_t>(r.v[1]) << 32) | r.v[0]) % starts),
                b, T, tok, tgt);
  }
}

// A learning rate as the step lines print it: 3.00e-04.
std::string fmt_rate(double lr) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2e", lr);
  return text;
}

// 75 -> "1m15s", 4000 -> "1h6m", 8 -> "8s".
std::string duration_text(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return std::to_string(s / 3600) + "h" + std::to_string(s % 3600 / 60) + "m";
  if (s >= 60) return std::to_string(s / 60) + "m" + std::to_string(s % 60) + "s";
  return std::to_string(s) + "s";
}

// A view's values as a float32 tensor [rows, cols] (BF16 bits widened: exact), for --dump.
StoredTensor tensor_to_stored(Backend& be, const TensorView& v) {
  if (!v.dense() || (v.dtype != DType::F32 && v.dtype != DType::BF16))
    throw std::logic_error(std::string("--dump: ") + v.name + " is not a dense float32/BF16 view");
  std::vector<float> h(static_cast<size_t>(v.numel()));
  if (v.dtype == DType::BF16) {
    std::vector<uint16_t> bits(h.size());
    be.download(bits.data(), v.data, bits.size() * 2);
    for (size_t i = 0; i < h.size(); ++i) h[i] = bf16_to_f32(bits[i]);
  } else {
    be.download(h.data(), v.data, h.size() * 4);
  }
  return f32_tensor(h.data(), {v.rows, v.cols}, v.numel());
}

// A --dump file, whole or not at all: written beside its name, then renamed into place.
void write_dump_file(const std::string& path, const TensorMap& tensors) {
  const std::string staged = staged_path(path);
  try {
    write_safetensors(staged, tensors);
    if (std::rename(staged.c_str(), path.c_str()) != 0)
      throw std::runtime_error(std::string("cannot move it into place: ") + std::strerror(errno));
  } catch (const std::exception& e) {
    std::remove(staged.c_str());
    forget_staged(staged);
    throw std::runtime_error("--dump " + path + " not written (" + e.what() + ")");
  }
  forget_staged(staged);
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string t = "[";
  for (size_t i = 0; i < shape.size(); ++i) t += (i ? ", " : "") + std::to_string(shape[i]);
  return t + "]";
}

// Tensor `name` of m into dst: F32 of exactly `shape` (the model's), else an error naming both.
void load_stored(const TensorMap& m, const std::string& name, float* dst,
                 const std::vector<int64_t>& shape, const std::string& where) {
  const auto it = m.find(name);
  if (it == m.end()) throw std::runtime_error(where + ": tensor '" + name + "' missing");
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  if (it->second.dtype != "F32" || it->second.shape != shape ||
      static_cast<int64_t>(it->second.bytes.size()) != n * 4)
    throw std::runtime_error(where + ": tensor '" + name + "' is " + it->second.dtype + " " +
                             shape_text(it->second.shape) + ", the model's is F32 " +
                             shape_text(shape));
  std::memcpy(dst, it->second.bytes.data(), it->second.bytes.size());
}

}  // namespace

namespace {

// `batches` validation batches must be there once each: batch i reads tokens i*B*T ..
// (i+1)*B*T (its last target included), so the split holds (n - 1) / (B*T) of them, and more
// would wrap around and count batches twice. `what` names the option that asked.
void check_validation_batches(const RunConfig& c, const TokenFile& val, int64_t batches,
                              const std::string& what) {
  const int64_t n = static_cast<int64_t>(val.tokens.size());
  const int64_t available = (n - 1) / (c.train.batch * c.model.seq_len);
  if (batches <= available) return;
  const std::string split =
      c.train.data == "synthetic" ? "the synthetic validation split" : c.train.data + ".val.tokens";
  throw std::invalid_argument(
      what + " " + std::to_string(batches) + ": " + split + " holds " + std::to_string(n) +
      " tokens, " + std::to_string(available) + " full batches of " +
      std::to_string(c.train.batch) + " x " + std::to_string(c.model.seq_len) +
      " (more would reuse batches); ask for at most " + std::to_string(available) +
      (what == "--batches" ? " (or --all)" : ""));
}

float evaluate_on(const RunConfig& c, const TokenFile& val, Gpt& model, int64_t batches,
                  const std::function<void(int64_t, int64_t)>& progress = {}) {
  std::vector<int32_t> tok, tgt;
  int64_t pos = 0;
  double sum = 0;
  for (int64_t i = 0; i < batches; ++i) {
    pos = next_batch(val, pos, c.train.batch, c.model.seq_len, tok, tgt);
    sum += model.forward(tok.data(), tgt.data(), c.train.batch, c.model.seq_len);
    if (progress) progress(i + 1, batches);
  }
  return static_cast<float>(sum / static_cast<double>(batches));
}

}  // namespace

float evaluate(const RunConfig& c, const std::vector<float>& params, int64_t batches, Backend& be,
               int64_t* used, const std::function<void(int64_t, int64_t)>& progress) {
  Gpt model(c.model, be);
  model.params_from_host(params);
  model.set_recipe(c);  // the forward pass of the trained recipe, as at the end of training
  model.set_step(c.train.steps);
  const Dataset data = load_data(c, false);
  if (batches == kAllValidationBatches)  // each batch reads B*T tokens plus the last target
    batches =
        (static_cast<int64_t>(data.val.tokens.size()) - 1) / (c.train.batch * c.model.seq_len);
  if (batches < 1)
    throw std::invalid_argument("evaluate: batches must be >= 1, got " + std::to_string(batches));
  check_validation_batches(c, data.val, batches, "--batches");
  if (used) *used = batches;
  return evaluate_on(c, data.val, model, batches, progress);
}

LoadedModel load_trained(const std::string& checkpoint, Backend& be) {
  const Checkpoint ck = load_checkpoint(checkpoint);
  if (!ck.state.contains("run_config"))
    throw std::runtime_error(checkpoint + ": the checkpoint carries no run_config");
  LoadedModel lm;
  lm.config =
      config_from_json(ck.state.at("run_config"), {}, checkpoint + " (state.json run_config)");
  Gpt model(lm.config.model, be);
  lm.params.assign(model.num_params(), 0.0f);
  for (const ParamTensor& t : model.tensors())
    load_stored(ck.model, t.name, lm.params.data() + t.offset, t.shape, checkpoint);
  return lm;
}

std::vector<int32_t> sample_tokens(const LoadedModel& m, const std::vector<int32_t>& prompt,
                                   int64_t count, float temperature, uint64_t seed, Backend& be) {
  Gpt model(m.config.model, be);
  model.params_from_host(m.params);
  model.set_recipe(m.config);
  model.set_step(m.config.train.steps);
  model.set_inference(
      true);  // (windows of any length: no Wgrad copies, which block along the rows)
  std::vector<int32_t> seq = prompt;
  if (seq.empty()) seq.push_back('\n');
  std::mt19937_64 rng(seed);
  const int64_t V = m.config.model.vocab, ctx = m.config.model.seq_len;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t start =
        static_cast<int64_t>(seq.size()) > ctx ? static_cast<int64_t>(seq.size()) - ctx : 0;
    std::vector<int32_t> window(seq.begin() + start, seq.end());
    const int64_t T = static_cast<int64_t>(window.size());
    model.forward(window.data(), window.data(), 1, T);  // targets unused for sampling
    const std::vector<float> logits = model.logits_row_to_host(T - 1);
    const float* z = logits.data();
    int32_t next = 0;
    if (temperature <= 0.0f) {
      for (int64_t v = 1; v < V; ++v)
        if (z[v] > z[next]) next = static_cast<int32_t>(v);
    } else {
      std::vector<double> p(static_cast<size_t>(V));
      double mx = z[0], sum = 0;
      for (int64_t v = 1; v < V; ++v) mx = std::max(mx, static_cast<double>(z[v]));
      for (int64_t v = 0; v < V; ++v)
        sum += p[static_cast<size_t>(v)] = std::exp((z[v] - mx) / temperature);
      double r = std::uniform_real_distribution<double>(0.0, sum)(rng);
      for (int64_t v = 0; v < V; ++v) {
        r -= p[static_cast<size_t>(v)];
        next = static_cast<int32_t>(v);
        if (r <= 0) break;
      }
    }
    seq.push_back(next);
  }
  return std::vector<int32_t>(
      seq.begin() + static_cast<int64_t>(prompt.empty() ? 1 : prompt.size()), seq.end());
}

TrainResult train(const RunConfig& c, const TrainOptions& opt, Backend& be) {
  namespace fs = std::filesystem;
  // data parallel (DESIGN.md §16): rank 0 of `world` prints, logs, evaluates and writes
  Communicator* comm = opt.comm;
  const int rank = comm ? comm->rank() : 0, world = comm ? comm->size() : 1;
  const bool writer = rank == 0, print = opt.print && writer;
  // a check whose outcome may differ between ranks (free memory, the run folder): every rank
  // learns of a failure on any, and all stop together
  const auto everywhere = [&](const auto& f) {
    if (comm)
      on_every_rank(*comm, f);
    else
      f();
  };
  if (!opt.dump_dir.empty() && c.train.grad_accum > 1)
    throw std::invalid_argument(
        "--dump writes one batch per step for the PyTorch check: it needs train.grad_accum=1");
  if (!opt.dump_dir.empty() && comm)
    throw std::invalid_argument("--dump: run the PyTorch check's dump as one process, not " +
                                std::to_string(world) + " ranks");
  if (world * c.train.grad_accum > 256)
    throw std::invalid_argument(
        "train.grad_accum " + std::to_string(c.train.grad_accum) + " on " + std::to_string(world) +
        " ranks makes " + std::to_string(world * c.train.grad_accum) +
        " micro-batches a step; the SR stream numbers at most 256 (lower train.grad_accum)");
  if (comm)  // the same run on every rank, before any work
    check_ranks_agree(*comm, {{"the config", to_json(c).dump()},
                              {"the build", opt.build_id},
                              {"contract_version", std::to_string(kContractVersion)},
                              {"train.seed", std::to_string(c.train.seed)},
                              {"--resume", opt.resume.empty() ? "(none)" : "given"}});
  // the memory plan, before anything is allocated: printed, and a run that does not fit refused
  MeasuredMemory measured = memory_at_start(be);
  MemoryPlan plan;
  everywhere([&] {
    plan =
        plan_run(c, be, !opt.resume.empty(), comm != nullptr, world, rank, opt.memory_limit, print);
  });
  Dataset data;
  everywhere([&] {
    data = load_data(c);  // every input error before any work
    if (c.train.eval_every > 0)
      check_validation_batches(c, data.val, c.train.eval_batches, "train.eval_batches");
  });
  if (comm)  // the same tokens on every rank (a corpus file of another version, a mount)
    check_ranks_agree(*comm,
                      {{"the training data (" + c.train.data + ")",
                        sha256_hex(data.train.tokens.data(), data.train.tokens.size() * 2) + " " +
                            sha256_hex(data.val.tokens.data(), data.val.tokens.size() * 2)}});
  // one writer per run folder, for the whole run, taken before any of its files is read or
  // written: here when the folder exists, else where it is created below (a folder that does not
  // exist has no writer, and a run refused before then leaves none behind). Rank 0's alone.
  std::optional<RunLock> lock;
  everywhere([&] {
    if (writer && fs::is_directory(c.train.out_dir)) lock.emplace(c.train.out_dir, "train.out_dir");
  });
  Gpt model(c.model, be);
  model.init(c.train.seed);
  model.set_recipe(c);
  if (print && c.recipe.name != GemmFormat::BF16) {
    std::printf("recipe %s (gemm %s):\n%s", name_of(c.recipe.name), name_of(c.recipe.gemm),
                model.describe_recipe().c_str());
    const std::vector<bool> hp = high_precision_blocks(c);
    if (std::all_of(hp.begin(), hp.end(), [](bool b) { return b; }))
      std::printf(
          "warning: recipe %s keeps every block in BF16 (recipe.hp_first/hp_last/hp_layers)\n",
          name_of(c.recipe.name));
    if (c.recipe.bf16_from_step > 0)
      std::printf("late switch: from step %lld, %s in BF16\n",
                  static_cast<long long>(c.recipe.bf16_from_step),
                  c.recipe.bf16_switch == Bf16Switch::All ? "every GEMM" : "the Fprop GEMMs");
    if (c.recipe.stochastic_rounding == StochasticRounding::All)
      std::printf(
          "warning: recipe.stochastic_rounding all puts SR on weights and activations too "
          "(unusual)\n");
  }
  // the optimizer's state in the backend's memory, beside the parameters
  const size_t n_params = model.num_params();
  // ZeRO-1: each tensor's optimizer state on one rank (model/data_parallel.hpp), which updates it
  // and broadcasts its weights after the step
  const bool zero1 = comm && c.train.zero == 1;
  std::vector<int> owner;
  std::vector<bool> owned;
  if (zero1) {
    std::vector<int64_t> numels;
    for (const ParamTensor& t : model.tensors()) numels.push_back(t.numel());
    owner = shard_tensors(numels, world);
    for (int o : owner) owned.push_back(o == rank);
  } else if (print && c.train.zero == 1) {
    std::printf("train.zero=1: one process, no optimizer state to shard\n");
  }
  std::optional<Optimizer> optimizer_made;  // (its checks, e.g. NVFP4 NS shapes, on its ranks)
  everywhere([&] { optimizer_made.emplace(c, model, owned); });
  Optimizer& optimizer = *optimizer_made;
  if (print && (c.optim.name != OptimizerName::AdamW || c.optim.state != OptimState::FP32))
    std::printf("%s\n", optimizer.describe().c_str());
  if (zero1) {  // the state each rank holds
    const uint64_t mine = optimizer.state_bytes();
    std::vector<uint64_t> all(static_cast<size_t>(world));
    comm->all_gather_host(&mine, all.data(), sizeof mine);
    if (print) {
      const auto size = [](uint64_t b) {  // "1.50 GiB"
        const std::string t = bytes_text(b);
        return t.substr(0, t.find(" ("));
      };
      std::string per;
      uint64_t total = 0;
      for (int r = 0; r < world; ++r) {
        per += (r ? ", " : "") + size(all[static_cast<size_t>(r)]);
        total += all[static_cast<size_t>(r)];
      }
      std::printf("ZeRO-1: optimizer state per rank %s (all ranks %s)\n", per.c_str(),
                  size(total).c_str());
    }
  }
  int64_t step0 = 0, pos = 0;
  // loss scaling (DESIGN.md §14): S, its clean-step count and the optimizer's own step count
  // (AdamW's t, which a skipped step does not advance) are part of the checkpoint
  const bool dynamic_scale = c.train.loss_scale == LossScale::Dynamic;
  DynamicLossScale scaler;
  int64_t optimizer_steps = 0;
  if (!opt.resume.empty()) {
    const Checkpoint ck = load_checkpoint(opt.resume);
    for (const char* key : {"config", "data_position"})
      if (!ck.state.contains(key))
        throw std::runtime_error(opt.resume + ": its state.json has no '" + key +
                                 "' (corrupt checkpoint)");
    // "prefix.key: a -> b" for each key whose value differs between two JSON objects
    auto differences = [](const nlohmann::json& a, const nlohmann::json& b,
                          const std::string& prefix) {
      std::vector<std::string> out;
      if (!a.is_object() || !b.is_object()) return out;
      for (const auto& [k, va] : a.items())
        if (!b.contains(k) || b.at(k) != va)
          out.push_back(prefix + k + ": " + va.dump() + " -> " +
                        (b.contains(k) ? b.at(k).dump() : "(none)"));
      for (const auto& [k, vb] : b.items())
        if (!a.contains(k)) out.push_back(prefix + k + ": (none) -> " + vb.dump());
      return out;
    };
    auto joined = [](const std::vector<std::string>& v) {
      std::string t;
      for (const std::string& x : v) t += (t.empty() ? "" : ", ") + x;
      return t;
    };
    const nlohmann::json now = to_json(c);
    if (ck.state.at("config") != now.at("model"))
      throw std::runtime_error(
          opt.resume +
          ": the checkpoint's model config differs from this run's (checkpoint -> "
          "this run: " +
          joined(differences(ck.state.at("config"), now.at("model"), "model.")) + ")");
    // settings that make the continuation another run than the uninterrupted one: said, not refused
    // (a recipe change on resume can be deliberate). train.steps among them: the learning-rate
    // schedule spans train.steps, so a longer or shorter run changes every rate from here on
    if (print && ck.state.contains("run_config")) {
      const nlohmann::json& was = ck.state.at("run_config");
      std::vector<std::string> changed =
          differences(was.value("recipe", nlohmann::json::object()), now.at("recipe"), "recipe.");
      for (const std::string& d :
           differences(was.value("optim", nlohmann::json::object()), now.at("optim"), "optim."))
        // (a new name, state, v_tile or v_floor is refused below)
        if (d.rfind("optim.name:", 0) != 0 && d.rfind("optim.state:", 0) != 0 &&
            d.rfind("optim.v_tile:", 0) != 0 && d.rfind("optim.v_floor:", 0) != 0)
          changed.push_back(d);
      const nlohmann::json was_train = was.value("train", nlohmann::json::object()),
                           now_train = now.at("train");
      for (const char* k : {"seed", "batch", "grad_accum", "data", "steps", "lr", "min_lr_ratio",
                            "warmup", "schedule", "decay_fraction", "weight_decay", "beta1",
                            "beta2", "eps", "grad_clip", "loss_scale"})
        if (was_train.contains(k) && now_train.contains(k) && was_train.at(k) != now_train.at(k))
          changed.push_back(std::string("train.") + k + ": " + was_train.at(k).dump() + " -> " +
                            now_train.at(k).dump());
      if (!changed.empty())
        std::printf(
            "warning: resuming with settings that differ from the checkpoint's run (so not its "
            "uninterrupted continuation): %s\n",
            joined(changed).c_str());
      // what another train.steps does to the next step's rate (the other schedule keys as now)
      if (was_train.contains("steps") && was_train.at("steps").is_number_integer() &&
          was_train.at("steps").get<int64_t>() != c.train.steps) {
        const int64_t was_steps = was_train.at("steps").get<int64_t>();
        auto rate = [&](int64_t steps) {
          return learning_rate(c.train.schedule, ck.step, steps, c.train.warmup, c.train.lr,
                               c.train.min_lr_ratio, c.train.decay_fraction);
        };
        const std::string then =
            ck.step < was_steps ? fmt_rate(rate(was_steps)) + " in the checkpoint's run of " +
                                      std::to_string(was_steps) + " steps"
                                : "the checkpoint's run ended at step " + std::to_string(was_steps);
        std::printf(
            "warning: train.steps %lld -> %lld changes the learning-rate schedule, which spans "
            "train.steps: step %lld takes lr %s here (%s)\n",
            static_cast<long long>(was_steps), static_cast<long long>(c.train.steps),
            static_cast<long long>(ck.step + 1), fmt_rate(rate(c.train.steps)).c_str(),
            then.c_str());
      }
    }
    step0 = ck.step;
    if (comm) {  // the same checkpoint on every rank (its state: step, data position, RNG, ...)
      const std::string state = ck.state.dump();
      check_ranks_agree(*comm,
                        {{"the checkpoint resumed (" + opt.resume + ")",
                          std::to_string(ck.step) + " " + sha256_hex(state.data(), state.size())}});
    }
    // the checkpoint's ranks (1 before data parallel runs): its state is whole on every rank, so
    // any number of ranks resumes it; the same global micro-batches (ranks x grad_accum) under
    // train.grad_reduce=ordered continue its bits
    const int64_t ck_world = ck.state.value("world_size", int64_t{1});
    const int64_t ck_micro = ck.state.value(
        "global_micro_batches", ck_world * ck.state.value("run_config", nlohmann::json::object())
                                               .value("train", nlohmann::json::object())
                                               .value("grad_accum", int64_t{1}));
    if (print && (ck_world != world || ck_micro != world * c.train.grad_accum))
      std::printf(
          "resuming a checkpoint of %lld rank(s) x %lld micro-batches a step on %d rank(s) x "
          "%lld%s\n",
          static_cast<long long>(ck_world),
          static_cast<long long>(ck_micro / std::max<int64_t>(ck_world, 1)), world,
          static_cast<long long>(c.train.grad_accum),
          ck_micro == world * c.train.grad_accum ? "" : " (another step: not its continuation)");
    if (step0 >= c.train.steps)
      throw std::invalid_argument(opt.resume + " is at step " + std::to_string(step0) +
                                  " and train.steps is " + std::to_string(c.train.steps) +
                                  ": nothing left to train (raise train.steps)");
    // the batch order must continue as it began: file order from data_position, or shuffled
    const bool ck_shuffle = ck.state.contains("run_config") &&
                            ck.state["run_config"].contains("train") &&
                            ck.state["run_config"]["train"].value("shuffle", false);
    if (ck_shuffle != c.train.shuffle)
      throw std::invalid_argument(
          opt.resume + " was trained with train.shuffle=" + (ck_shuffle ? "true" : "false") +
          "; resume with the same setting");
    if (!ck.state.at("data_position").is_number_integer())
      throw std::runtime_error(
          opt.resume + ": data_position in its state.json is not an integer (corrupt checkpoint)");
    pos = ck.state.at("data_position").get<int64_t>();
    if (pos < 0 || pos >= static_cast<int64_t>(data.train.tokens.size()))
      throw std::runtime_error(opt.resume + ": data_position " + std::to_string(pos) +
                               " is outside the training split (" +
                               std::to_string(data.train.tokens.size()) +
                               " tokens): a corrupt checkpoint, or another corpus");
    // a checkpoint written before loss scaling: every step so far was an optimizer step, and S
    // starts as in a fresh run
    auto corrupt = [&](const std::string& what) {
      return std::runtime_error(opt.resume + ": " + what +
                                " in its state.json (corrupt checkpoint)");
    };
    auto count_in = [&](const nlohmann::json& j, const char* key, int64_t lo, int64_t hi,
                        const std::string& name) {
      if (!j.contains(key) || !j.at(key).is_number_integer() || j.at(key).get<int64_t>() < lo ||
          j.at(key).get<int64_t>() > hi)
        throw corrupt(name + " is missing or not an integer in " + std::to_string(lo) + ".." +
                      std::to_string(hi));
      return j.at(key).get<int64_t>();
    };
    optimizer_steps = ck.state.contains("optimizer_step")
                          ? count_in(ck.state, "optimizer_step", 0, step0, "optimizer_step")
                          : step0;
    if (dynamic_scale && ck.state.contains("loss_scale")) {
      const nlohmann::json& ls = ck.state.at("loss_scale");
      if (!ls.is_object() || !ls.contains("scale") || !ls.at("scale").is_number() ||
          !DynamicLossScale::valid_scale(ls.at("scale").get<double>()))
        throw corrupt("loss_scale.scale is not a power of two in 1.." +
                      std::to_string(static_cast<int64_t>(DynamicLossScale::kMaxScale)));
      scaler.scale = ls.at("scale").get<float>();
      scaler.clean_steps = count_in(ls, "clean_steps", 0, DynamicLossScale::kGrowthInterval - 1,
                                    "loss_scale.clean_steps");
      scaler.skips_in_a_row =
          count_in(ls, "skips_in_a_row", 0, DynamicLossScale::kMaxSkipsInARow - 1,
                   "loss_scale.skips_in_a_row");
    }
    // the optimizer's state is the one its optimizer writes: another optim.name cannot take it
    // (nor another optim.state, optim.v_tile or optim.v_floor: the state is stored in its
    // encoding)
    const nlohmann::json ck_oc =
        ck.state.contains("run_config")
            ? ck.state["run_config"].value("optim", nlohmann::json::object())
            : nlohmann::json::object();
    const std::string ck_optim = ck_oc.value("name", std::string("adamw"));
    if (ck_optim != name_of(c.optim.name))
      throw std::invalid_argument(opt.resume + " holds the state of optim.name=" + ck_optim +
                                  "; this run's is optim.name=" + name_of(c.optim.name) +
                                  ": resume with optim.name=" + ck_optim);
    const std::string ck_state = ck_oc.value("state", std::string("fp32"));
    const int64_t ck_tile = ck_oc.value("v_tile", int64_t{16});
    const std::string ck_floor = ck_oc.value("v_floor", std::string("off"));
    if (ck_state != name_of(c.optim.state) ||
        (c.optim.state == OptimState::NVFP4 &&
         (ck_tile != c.optim.v_tile || ck_floor != name_of(c.optim.v_floor))))
      throw std::invalid_argument(
          opt.resume + " holds AdamW's state stored as optim.state=" + ck_state +
          (ck_state == "nvfp4"
               ? " (optim.v_tile=" + std::to_string(ck_tile) + ", optim.v_floor=" + ck_floor + ")"
               : "") +
          "; this run's is optim.state=" + name_of(c.optim.state) +
          (c.optim.state == OptimState::NVFP4
               ? " (optim.v_tile=" + std::to_string(c.optim.v_tile) +
                     ", optim.v_floor=" + name_of(c.optim.v_floor) + ")"
               : "") +
          ": resume with the checkpoint's");
    std::vector<float> hp(n_params);
    for (const ParamTensor& t : model.tensors())
      load_stored(ck.model, t.name, hp.data() + t.offset, t.shape, opt.resume);
    model.params_from_host(hp);
    optimizer.load(ck.optimizer, opt.resume);
    if (print)
      std::printf("resumed from %s at step %lld\n", opt.resume.c_str(),
                  static_cast<long long>(step0));
  }
  // the output folders before anything is written, each error naming its option (rank 0)
  std::optional<OutputFile> log;
  everywhere([&] {
    if (!writer) return;
    auto make_dir = [](const std::string& dir, const std::string& option) {
      std::error_code ec;
      fs::create_directories(dir, ec);
      if (ec || !fs::is_directory(dir))
        throw std::runtime_error(option + " " + dir + ": cannot create the folder (" +
                                 (ec ? ec.message() : std::string("a file is in the way")) + ")");
    };
    if (!opt.dump_dir.empty()) make_dir(opt.dump_dir, "--dump");
    make_dir(c.train.out_dir, "train.out_dir");
    if (!lock) lock.emplace(c.train.out_dir, "train.out_dir");
    // checkpoints of later steps in this out_dir come from another run (or an abandoned future of
    // this one): keep-last and `--resume DIR` pick by step, so they would be mixed with this run's.
    // A fresh run is refused even when it writes no checkpoints: it would replace that run's
    // log.jsonl (a resumed run without checkpoints only trims the log to its step, below).
    if (c.train.checkpoint_every > 0 || step0 == 0) {
      std::string later;
      for (const std::string& ck_dir : list_checkpoints(c.train.out_dir + "/checkpoints"))
        if (checkpoint_step(ck_dir) > step0)
          later += (later.empty() ? "" : ", ") + fs::path(ck_dir).filename().string();
      if (!later.empty())
        throw std::invalid_argument("train.out_dir " + c.train.out_dir +
                                    " already holds checkpoints of later steps (" + later +
                                    ") than this run starts from (step " + std::to_string(step0) +
                                    "): use another train.out_dir, or remove them");
    }
    // on resume, the log keeps the records up to the resumed step (a longer earlier run's later
    // records would otherwise appear twice), written beside it and renamed over it: a full disk
    // leaves the old log as it was
    const std::string log_path = c.train.out_dir + "/log.jsonl";
    if (step0 > 0 && fs::exists(log_path)) {
      std::ifstream old_log(log_path);
      std::string kept, text;
      while (std::getline(old_log, text)) {
        const nlohmann::json rec = nlohmann::json::parse(text, nullptr, false);
        if (!rec.is_discarded() && rec.is_object() && rec.value("step", int64_t{0}) <= step0)
          kept += text + "\n";
      }
      if (old_log.bad())
        throw std::runtime_error(log_path +
                                 ": cannot read the log to keep its records up to step " +
                                 std::to_string(step0));
      old_log.close();
      const std::string staged = staged_path(log_path);
      try {
        write_whole_file(staged, kept);
        if (std::rename(staged.c_str(), log_path.c_str()) != 0)
          throw std::runtime_error(log_path + ": cannot replace it with its records up to step " +
                                   std::to_string(step0) + " (" + std::strerror(errno) + ")");
      } catch (...) {
        std::remove(staged.c_str());
        forget_staged(staged);
        throw;
      }
      forget_staged(staged);
    }
    // every line is written, and checked, as its step ends (a full disk stops the run there)
    log.emplace(log_path, step0 ? OutputFile::Mode::Append : OutputFile::Mode::Truncate);
  });
  const int64_t B = c.train.batch, T = c.model.seq_len, A = c.train.grad_accum;
  TrainResult res;
  res.planned_memory = plan.peak;
  std::vector<int32_t> tok, tgt;  // (the file order's windows of other ranks' micro-batches)
  TensorMap dump_batches;
  TensorMap dump_linears;  // --dump: each linear's x, y, dy, dx, dweight, dbias of the first step
  // the parameter tensors' places in grads(), for the gradient norm's one sum_squares call
  const std::vector<Segment> spans = model.tensor_spans();
  const TensorView grads =
      f32_view(be, model.grads(), 1, static_cast<int64_t>(model.num_params()), "gradients");
  std::vector<double> sums(spans.size());
  // N ranks: the step's gradient from every rank's micro-batches (model/data_parallel.hpp)
  std::optional<GradientReducer> reducer;
  if (comm)
    reducer.emplace(*comm, be, static_cast<int64_t>(n_params), c.train.grad_reduce,
                    c.train.grad_comm, int64_t{1} << 22,
                    std::max<int64_t>(1, static_cast<int64_t>(c.train.grad_bucket_mb * 262144.0)));
  const bool ordered = reducer && reducer->mode() == GradReduce::Ordered;
  const int64_t micro_total = world * A;  // the step's micro-batches, over all ranks
  std::vector<std::vector<int32_t>> step_tok(static_cast<size_t>(A)),
      step_tgt(static_cast<size_t>(A));
  std::vector<float> local_losses(static_cast<size_t>(A)),
      all_losses(static_cast<size_t>(micro_total));
  const auto run_start = std::chrono::steady_clock::now();
  for (int64_t step = step0; step < c.train.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    model.set_step(step);
    const float scale = dynamic_scale ? scaler.scale : 1.0f;  // S of this step
    model.set_loss_scale(scale);
    if (print && c.recipe.name != GemmFormat::BF16 && step + 1 == c.recipe.bf16_from_step &&
        step > 0)
      std::printf("step %5lld | late switch to BF16 (%s)\n", static_cast<long long>(step + 1),
                  name_of(c.recipe.bf16_switch));
    const bool stats_now = c.recipe.stats_every > 0 && c.recipe.name != GemmFormat::BF16 &&
                           step % c.recipe.stats_every == 0;
    // the step's micro-batches of B sequences, world * grad_accum of them numbered globally:
    // micro-batch m of this rank is g = rank + m * world (its data and its SR streams). The file
    // order reads them all in g order (each rank keeps its own); shuffled windows are drawn by g
    for (int64_t g = 0; g < micro_total; ++g) {
      const bool mine = g % world == rank;
      const size_t m = static_cast<size_t>(g / world);
      if (c.train.shuffle) {
        if (mine)
          sample_batch(data.train, c.train.seed, step, g * B, B, T, step_tok[m], step_tgt[m]);
      } else {
        pos = next_batch(data.train, pos, B, T, mine ? step_tok[m] : tok, mine ? step_tgt[m] : tgt);
      }
    }
    // the gradients: each micro-batch's computed from zero and scaled by 1 / (tokens of all the
    // step's micro-batches), added in global micro-batch order (DESIGN.md §16); the step's loss
    // is the mean of the micro-batches' means, added in that order too
    std::string loss_error;  // (with ranks: reported by every rank after the step's micro-batches)
    int64_t loss_error_g = -1;  // its global micro-batch
    for (int64_t mb = 0; mb < A; ++mb) {
      const int64_t g = rank + mb * world;
      const std::vector<int32_t>& mb_tok = step_tok[static_cast<size_t>(mb)];
      const std::vector<int32_t>& mb_tgt = step_tgt[static_cast<size_t>(mb)];
      model.set_micro_batch(g);
      if (stats_now && g == 0) model.collect_stats_once();  // the first micro-batch's statistics
      const bool tap_now = !opt.dump_dir.empty() && step == step0;  // (grad_accum is 1 there)
      if (tap_now)
        model.set_linear_tap([&](const std::string& name, const char* what, const TensorView& v) {
          dump_linears[name + "." + what] = tensor_to_stored(be, v);
        });
      const float mb_loss = model.forward(mb_tok.data(), mb_tgt.data(), B, T, micro_total);
      if (!std::isfinite(mb_loss) && loss_error.empty()) {
        loss_error = "step " + std::to_string(step + 1) +
                     (micro_total > 1 ? " (micro-batch " + std::to_string(g) + ")" : "") +
                     ": the loss is " + std::to_string(mb_loss) +
                     "; the first non-finite tensor: " + model.first_nonfinite_in_forward();
        loss_error_g = g;
        if (!comm) throw std::runtime_error(loss_error);
      }
      local_losses[static_cast<size_t>(mb)] = mb_loss;
      if (ordered) {  // this micro-batch's gradient alone, then every rank's added in rank order
        model.backward(micro_total, false);
        reducer->add_micro_batch(grads, mb);
      } else if (reducer && mb + 1 == A) {  // the last: its buckets reduced as they complete
        model.set_grads_ready([&](int64_t offset) { reducer->ready(grads, offset); });
        model.backward(micro_total, mb > 0);
        model.set_grads_ready(nullptr);
      } else {
        model.backward(micro_total, mb > 0);
      }
      if (tap_now) model.set_linear_tap(nullptr);
    }
    double loss_sum = 0;
    if (comm) {
      reducer->finish(grads);  // (no reduction left running when a loss error stops the step)
      // a non-finite loss on any rank: every rank reports the lowest global micro-batch's
      int64_t first = loss_error.empty() ? std::numeric_limits<int64_t>::max() : loss_error_g;
      std::vector<int64_t> firsts(static_cast<size_t>(world));
      comm->all_gather_host(&first, firsts.data(), sizeof first);
      const int64_t lowest = *std::min_element(firsts.begin(), firsts.end());
      throw_first_failure(*comm, lowest != std::numeric_limits<int64_t>::max() && first == lowest
                                     ? loss_error
                                     : "");
      if (print && step == step0 && !ordered)
        std::printf(
            "data parallel: %lld gradient buckets a step (train.grad_bucket_mb %g), "
            "all-reduced while the last micro-batch's backward pass goes on\n",
            static_cast<long long>(reducer->buckets_started()), c.train.grad_bucket_mb);
      comm->all_gather_host(local_losses.data(), all_losses.data(),
                            local_losses.size() * sizeof(float));
      for (int64_t g = 0; g < micro_total; ++g)  // rank g % world's micro-batch g / world
        loss_sum += all_losses[static_cast<size_t>((g % world) * A + g / world)];
    } else {
      for (float l : local_losses) loss_sum += l;
    }
    const float loss = static_cast<float>(loss_sum / static_cast<double>(micro_total));
    if (std::find(opt.nonfinite_gradient_steps.begin(), opt.nonfinite_gradient_steps.end(),
                  step + 1) != opt.nonfinite_gradient_steps.end()) {  // (a test's fault)
      const float inf = std::numeric_limits<float>::infinity();
      be.upload(model.grads(), &inf, 4);
    }
    // --dump (grad_accum is 1 there, so tok and tgt hold the step's one batch)
    if (!opt.dump_dir.empty() && step - step0 < opt.dump_steps) {
      auto i32 = [&](const std::vector<int32_t>& v) {
        StoredTensor st;
        st.dtype = "I32";
        st.shape = {B, T};
        st.bytes.resize(v.size() * 4);
        std::memcpy(st.bytes.data(), v.data(), st.bytes.size());
        return st;
      };
      dump_batches["tokens." + std::to_string(step)] = i32(step_tok[0]);
      dump_batches["targets." + std::to_string(step)] = i32(step_tgt[0]);
    }
    if (!opt.dump_dir.empty() && step == step0) {  // weights before this step's update, gradients
      TensorMap w;
      const std::vector<float> hp = model.params_to_host();
      for (const ParamTensor& t : model.tensors())
        w[t.name] = f32_tensor(hp.data() + t.offset, t.shape, t.numel());
      write_dump_file(opt.dump_dir + "/weights.safetensors", w);
      TensorMap gr;
      std::vector<float> hg = model.grads_to_host();
      for (float& g : hg) g /= scale;  // (the loss scale's power of two: exact)
      for (const ParamTensor& t : model.tensors())
        gr[t.name] = f32_tensor(hg.data() + t.offset, t.shape, t.numel());
      gr["loss"] = f32_tensor(&loss, {1}, 1);
      write_dump_file(opt.dump_dir + "/step0_grads.safetensors", gr);
      write_dump_file(opt.dump_dir + "/linears.safetensors", dump_linears);
      dump_linears.clear();
      write_whole_file(opt.dump_dir + "/config.json", to_json(c).dump(2) + "\n");
    }
    // every tensor's sum of squares in one backend call, then added in tensor order. Under loss
    // scaling these are of the gradients times S: each square and sum is S^2 times the unscaled
    // one exactly (FP64, powers of two), so sqrt(sq) / S is the unscaled norm bit for bit
    be.sum_squares(grads, spans, sums.data());
    double sq = 0;
    std::vector<std::string>
        bad;  // the tensors whose gradient holds a NaN or an Inf, in parameter order
    for (size_t i = 0; i < sums.size(); ++i) {
      if (!std::isfinite(sums[i])) bad.push_back(model.tensors()[i].name);
      sq += sums[i];
    }
    // non-finite gradients stop the run, or under dynamic loss scaling skip the step (the
    // optimizer and its step count stay; S halves), until kMaxSkipsInARow skips in a row stop it
    const bool skipped = !bad.empty();
    if (skipped &&
        (!dynamic_scale || scaler.skips_in_a_row + 1 >= DynamicLossScale::kMaxSkipsInARow)) {
      std::string names;
      for (size_t i = 0; i < bad.size() && i < 6; ++i) names += (i ? ", '" : "'") + bad[i] + "'";
      if (bad.size() > 6) names += ", ...";
      throw std::runtime_error(
          "step " + std::to_string(step + 1) + ": gradient of '" + bad[0] + "' is not finite (" +
          std::to_string(bad.size()) + " of " + std::to_string(sums.size()) +
          " tensors, in parameter order: " + names + ")" +
          (dynamic_scale ? "; the " + std::to_string(DynamicLossScale::kMaxSkipsInARow) +
                               "th step in a row skipped under train.loss_scale=dynamic (loss "
                               "scale " +
                               std::to_string(static_cast<int64_t>(scale)) + ")"
                         : std::string()));
    }
    const double norm = std::sqrt(sq) / static_cast<double>(scale);  // (NaN or Inf when skipped)
    const double lr = learning_rate(c.train.schedule, step, c.train.steps, c.train.warmup,
                                    c.train.lr, c.train.min_lr_ratio, c.train.decay_fraction);
    if (!skipped) {
      ++optimizer_steps;
      // the clipping factor divided by S (powers of two: exact), so AdamW's one product
      // grad * grad_scale rounds (g * S) * (c / S) = g * c as the unscaled run rounds g * c
      // (AdamW: and the BF16 weight shadow, where in use)
      optimizer.step(lr, optimizer_steps, clip_factor(norm, c.train.grad_clip) / scale);
      if (zero1) {  // every tensor's new weights from the rank that updated them
        float* const w = model.params();
        for (size_t i = 0; i < model.tensors().size(); ++i) {
          const ParamTensor& t = model.tensors()[i];
          comm->broadcast(f32_view(be, w + t.offset, 1, t.numel(), "parameters"), owner[i]);
        }
      }
    }
    if (dynamic_scale) {
      if (skipped)
        scaler.after_skipped_step();
      else
        scaler.after_clean_step();
    }
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    res.steps.push_back({step + 1, loss, norm, lr, skipped, scale});
    const int64_t mem = be.device_memory_used();
    res.peak_device_memory = std::max(res.peak_device_memory, mem);
    const double tok_s = static_cast<double>(B * T * micro_total) / (ms / 1000.0);
    const double mfu = tok_s * training_flops_per_token(c.model) / kH200DenseBf16Flops;
    if (print && skipped)
      std::printf(
          "step %5lld | loss %.4f | skipped: gradient of '%s' not finite (%zu of %zu tensors) | "
          "loss scale %lld -> %lld | lr %.2e | %.1f ms\n",
          static_cast<long long>(step + 1), loss, bad[0].c_str(), bad.size(), sums.size(),
          static_cast<long long>(scale), static_cast<long long>(scaler.scale), lr, ms);
    if (print && !skipped) {
      // time left at the run's mean wall time per step so far (validation and checkpoints included)
      const double elapsed_s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
      const int64_t done = step + 1 - step0, left = c.train.steps - (step + 1);
      const std::string eta =
          duration_text(elapsed_s / static_cast<double>(done) * static_cast<double>(left));
      std::printf(
          "step %5lld | loss %.4f | grad norm %.3f | lr %.2e | %.1f ms | %.0f tok/s | MFU %.4f%% | "
          "eta %s\n",
          static_cast<long long>(step + 1), loss, norm, lr, ms, tok_s, 100.0 * mfu, eta.c_str());
    }
    nlohmann::json line = {{"step", step + 1},  {"loss", loss},
                           {"grad_norm", norm}, {"lr", lr},
                           {"ms", ms},          {"tok_per_s", tok_s},
                           {"mfu", mfu},        {"contract_version", kContractVersion}};
    if (print && dynamic_scale && !skipped && scaler.scale != scale)
      std::printf("step %5lld | loss scale %lld -> %lld after %lld clean steps\n",
                  static_cast<long long>(step + 1), static_cast<long long>(scale),
                  static_cast<long long>(scaler.scale),
                  static_cast<long long>(DynamicLossScale::kGrowthInterval));
    if (dynamic_scale) line["loss_scale"] = scale;
    if (skipped) line["skipped"] = true;  // (and grad_norm null: it is not finite)
    if (mem >= 0) line["device_mem_gib"] = static_cast<double>(mem) / (1 << 30);
    if (stats_now) {
      nlohmann::json qs = nlohmann::json::object();
      for (const QuantStat& q : model.take_stats())
        qs[q.tensor] = {{"amax", q.amax},
                        {"saturated", q.saturated},
                        {"underflow_blocks", q.underflow_blocks},
                        {"rel_error", q.rel_error},
                        {"elements", q.elements}};
      line["quant_stats"] = qs;
    }
    if (writer && c.train.eval_every > 0 && (step + 1) % c.train.eval_every == 0) {
      const float vl = evaluate_on(c, data.val, model, c.train.eval_batches);
      res.val_losses.emplace_back(step + 1, vl);
      line["val_loss"] = vl;
      if (print) std::printf("step %5lld | val loss %.4f\n", static_cast<long long>(step + 1), vl);
    }
    if (writer) log->write(line.dump() + "\n");  // (a step's line before its checkpoint)
    const bool checkpoint_now =
        c.train.checkpoint_every > 0 &&
        ((step + 1) % c.train.checkpoint_every == 0 || step + 1 == c.train.steps);
    std::vector<float> hp;  // the weights on the host: the checkpoint's, and what ranks compare
    if (checkpoint_now && (writer || comm)) hp = model.params_to_host();
    if (comm && checkpoint_now)  // the ranks still hold the same weights (an engine's all-reduce
      // that gave ranks different bits would show here)
      check_ranks_agree(*comm, {{"the weights at step " + std::to_string(step + 1),
                                 sha256_hex(hp.data(), hp.size() * sizeof(float))}});
    TensorMap sharded_state;  // ZeRO-1: every rank's optimizer state, for rank 0's checkpoint
    if (zero1 && checkpoint_now) {
      TensorMap mine;
      optimizer.save(mine);
      sharded_state = gather_tensor_maps(*comm, mine);
    }
    if (writer && checkpoint_now) {
      Checkpoint ck;
      ck.step = step + 1;
      for (const ParamTensor& t : model.tensors())
        ck.model[t.name] = f32_tensor(hp.data() + t.offset, t.shape, t.numel());
      if (zero1)
        ck.optimizer = std::move(sharded_state);  // (one file, as an unsharded run writes it)
      else
        optimizer.save(ck.optimizer);
      ck.state = {
          {"data_position", pos},
          {"optimizer_step", optimizer_steps},    // AdamW's t: the steps not skipped
          {"world_size", world},                  // the ranks that trained it
          {"global_micro_batches", micro_total},  // a step's, over all ranks
          {"zero", zero1 ? 1 : 0},                // the optimizer state was sharded
          {"config", to_json(c).at("model")},
          {"run_config", to_json(c)},
          // the training's random draws (SR, RHT signs, shuffled windows) are Philox4x32-10
          // keyed by the seed with the step (and micro-batch, layer, role) in the counter:
          // the generator's whole state is the pair below
          {"rng",
           {{"generator", "philox4x32-10"}, {"key", c.train.seed}, {"next_step", step + 1}}}};
      if (dynamic_scale)  // S for the next step, and the counts that change it
        ck.state["loss_scale"] = {{"scale", scaler.scale},
                                  {"clean_steps", scaler.clean_steps},
                                  {"skips_in_a_row", scaler.skips_in_a_row}};
      const std::string where = save_checkpoint(c.train.out_dir + "/checkpoints", ck,
                                                static_cast<int>(c.train.keep_last));
      if (print) std::printf("checkpoint %s\n", where.c_str());
    }
  }
  if (!opt.dump_dir.empty()) write_dump_file(opt.dump_dir + "/batches.safetensors", dump_batches);
  if (log) {
    log->sync();
    log->close();
  }
  measured.peak = res.peak_device_memory;
  if (print) std::printf("%s", measured_against_plan(plan, be, measured).c_str());
  return res;
}

}  // namespace fp4sim::model
