// The training loop (issue 4, first version: the emulator backend only). One line per step, a
// JSONL log, periodic validation, atomic checkpoints with keep-last-k and bitwise resume, and a
// stop with the step and the first bad tensor on a NaN/Inf in the loss or the gradients (under
// train.loss_scale=dynamic, non-finite gradients skip the step; 10 skips in a row stop the run).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "emu/backend.hpp"
#include "model/communicator.hpp"
#include "model/config.hpp"
#include "model/memory_plan.hpp"

namespace fp4sim::model {

struct TrainOptions {
  std::string resume;  // a checkpoint directory or a run directory ("" = fresh start)
  bool print = true;
  // For outside checks (validation/torch_gpt_check.py): the initial weights, the first step's loss
  // and gradients, and the batches of the first dump_steps steps, as safetensors in this folder.
  std::string dump_dir;
  int64_t dump_steps = 10;
  // The memory check of the run's plan (model/memory_plan.hpp; --memory-limit): auto refuses a run
  // whose plan exceeds the free memory before anything is allocated.
  MemoryLimitSetting memory_limit;
  // Test-only: the steps (counted from 1, as printed) whose gradients are made non-finite after
  // the backward pass (the first gradient element set to +Inf), so tests can reach the NaN stop and
  // loss scaling's skipped steps (DESIGN.md §14) without an overflow of their own.
  std::vector<int64_t> nonfinite_gradient_steps;
  // Data parallel training (DESIGN.md §16): this process is rank comm->rank() of comm->size(); the
  // step's N * train.grad_accum micro-batches are numbered globally (micro-batch m of rank r is
  // r + m * N: its data and SR streams), the gradients reduced as train.grad_reduce says. Only
  // rank 0 prints (with print), logs, evaluates and writes checkpoints; it alone takes the run
  // folder's lock. nullptr: one process.
  Communicator* comm = nullptr;
  // What the ranks must agree on besides config, contract_version, data and seed: this
  // executable's identity (tools/: the SHA-256 of the running binary).
  std::string build_id;
};

struct StepRecord {
  int64_t step;
  float loss;
  double grad_norm;
  double lr;
  bool skipped = false;     // train.loss_scale=dynamic: non-finite gradients, no optimizer step
  float loss_scale = 1.0f;  // the loss scale S the step ran with (1 under train.loss_scale=off)
};

struct TrainResult {
  std::vector<StepRecord> steps;
  std::vector<std::pair<int64_t, float>> val_losses;
  int64_t peak_device_memory = -1;  // bytes, where the backend has device memory
  int64_t planned_memory = -1;      // the plan's peak (MemoryPlan::peak), bytes
};

TrainResult train(const RunConfig& cfg, const TrainOptions& opt, Backend& backend);

// Validation loss of a model config + parameters on the first `batches` batches of the val split,
// each read once: more than the split holds is an error (std::invalid_argument naming the split,
// its full batches and "--batches"). batches = kAllValidationBatches: every full batch of the
// split; *used (when given) receives the number of batches evaluated.
constexpr int64_t kAllValidationBatches = -1;
// progress (when given) is called after each batch with (done, total).
float evaluate(const RunConfig& cfg, const std::vector<float>& params, int64_t batches,
               Backend& backend, int64_t* used = nullptr,
               const std::function<void(int64_t, int64_t)>& progress = {});

// The run configuration and parameters stored in a checkpoint (a step directory, or a run's
// checkpoints directory for its latest).
struct LoadedModel {
  RunConfig config;
  std::vector<float> params;
};
LoadedModel load_trained(const std::string& checkpoint, Backend& backend);

// Autoregressive sampling: continue `prompt` by `count` tokens (temperature 0 = greedy).
std::vector<int32_t> sample_tokens(const LoadedModel& m, const std::vector<int32_t>& prompt,
                                   int64_t count, float temperature, uint64_t seed,
                                   Backend& backend);

}  // namespace fp4sim::model
