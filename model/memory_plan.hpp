// Memory plans (issue 34): what a training run will hold at its peak, in the backend's memory and
// on the host, known before anything is allocated.
//
// A plan is made by running the run's code on a planning backend that allocates and computes
// nothing: the model is built, and the steps whose buffers differ (the first, a statistics step,
// the steps around the late BF16 switch) run their forward and backward passes and the optimizer
// step, so every buffer that the model, its linear layers and the fused ops' compositions allocate
// is counted by the code that allocates it in a real run (each carries a BufferLabel naming its
// line below). Each op adds the workspace the target backend takes inside it: the emulator's
// temporaries (emu/workspace.hpp) for the time of the op; the CUDA backend's scratch buffers, which
// grow to the largest call's need and stay, and its cuBLASLt workspaces (gpu/capabilities.hpp).
// The trainer's own memory is added where the trainer makes it: the token data, the AdamW moments,
// the host copies of initialisation, resume and checkpoints.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "emu/backend.hpp"

namespace fp4sim::model {

struct RunConfig;

// The lines of a plan (BufferLabel::use).
inline constexpr const char* kUseParameters = "parameters";
inline constexpr const char* kUseGradients = "gradients";
inline constexpr const char* kUseOptimizerState = "optimizer state (AdamW m, v; Muon momentum)";
inline constexpr const char* kUseOptimizerScratch = "optimizer scratch (Newton–Schulz)";
inline constexpr const char* kUseWeightShadow = "BF16 weight shadow";
inline constexpr const char* kUseActivations = "activations (kept for the backward pass)";
inline constexpr const char* kUseLogits = "logits and their gradient";
inline constexpr const char* kUseActivationGradients = "activation gradients";
inline constexpr const char* kUseSavedCopies = "saved quantized copies";
inline constexpr const char* kUseQuantizedOperands = "quantized GEMM operands";
inline constexpr const char* kUseOpTemporaries = "op temporaries";
inline constexpr const char* kUseBatch = "token batch";
inline constexpr const char* kUseWorkspace = "backend workspace";
inline constexpr const char* kUseTokenData = "token data (train and val splits)";
inline constexpr const char* kUseHostCopies = "host copies of the parameters and moments";

// The CUDA backend's options the plan for it depends on (gpu/cuda_backend.hpp CudaOptions; the
// defaults are CudaOptions' and the CLI's), and the device's compute capability (the H200's 9 by
// default: below 10 the cuBLASLt GEMMs read decoded BF16 FP4 operands).
struct CudaPlanOptions {
  int cc_major = 9;
  bool matmul_bf16_epilogue = true;
  bool activation_fusion = true;
  bool attention_recompute_dq = false;
  int quantize_keep_rht = -1;   // kQuantizeKeepRhtAuto: keep float32 input's RHT output
  bool ssm_sequential = false;  // CudaOptions::ssm_sequential: the Mamba scan's sequential twin
};

struct PlanRequest {
  std::string backend = "emu";  // emu | cuda
  CudaPlanOptions cuda;         // backend cuda
  bool resume = false;          // the run starts from a checkpoint (its host copies)
  // The run's backend, where it exists: its supports() decides the copies' extra buffers (the CUDA
  // backend's cuBLASLt operands); null: those of `backend` (cuda: cuda.cc_major).
  const Backend* run_backend = nullptr;
  // Data parallel (DESIGN.md §16): the plan of rank `rank` of `ranks` (its ZeRO-1 share of the
  // optimizer state, the gradient reducer's buffers); 1: one process.
  int ranks = 1, rank = 0;
  bool data_parallel = false;  // a communicator runs the reduction (also for one rank)
};

struct PlanLine {
  std::string use;
  int64_t bytes = 0;
};

struct MemoryPlan {
  std::string backend;  // emu | cuda
  std::string target;   // "host memory" or "device memory (compute capability 9.x, ...)"
  // The backend's memory (host memory on the emulator, where the token data and host copies are
  // lines too) at its peak, by line (largest first), and when the peak falls.
  std::vector<PlanLine> lines;
  int64_t peak = 0;
  std::string peak_at;
  // cuda: the host memory the run holds beside (token data, host copies) at its peak; empty and 0
  // on the emulator.
  std::vector<PlanLine> host_lines;
  int64_t host_peak = 0;
  std::string host_peak_at;
  // cuda: the backend's scratch buffers and cuBLASLt workspaces by name, as large as they grow
  // (the workspace line's parts), largest first.
  std::vector<PlanLine> workspace_parts;
  // The peak of the buffers allocated through Backend::allocate alone (no workspace, no trainer
  // host memory): what a backend that counts its allocations measures.
  int64_t buffers_peak = 0;
  // What the plan leaves out or estimates, one line each.
  std::vector<std::string> notes;
  // The plan as printed: a header line, then one line a line of the plan.
  std::string describe() const;
};

// The plan of `fp4sim train` with config c (model, train.batch, grad_accum, recipe, ...) on the
// request's backend. Throws std::invalid_argument for a config the model refuses.
MemoryPlan plan_training(const RunConfig& c, const PlanRequest& req);

// Memory available to a run, and where the figure comes from.
struct MemoryLimit {
  int64_t bytes = -1;  // -1: no limit (none, or nothing could be read)
  std::string source;  // "MemAvailable", "cgroup memory.max ...", "--memory-limit", ...
};

// Host memory this process may still take: the smaller of /proc/meminfo's MemAvailable and, for
// this process's memory cgroup and each of its ancestors with a limit, limit - usage + the
// inactive file cache (cgroup v2 memory.max / memory.current; v1 memory.limit_in_bytes /
// memory.usage_in_bytes, the fallback).
MemoryLimit host_memory_available();

// --memory-limit: auto (the backend's free memory: device memory on cuda, host memory on the
// emulator; cuda runs check their host memory too), none (no check), or a size in bytes with an
// optional K, M, G or T suffix (powers of 1024; KiB, MiB, GiB, TiB also read) replacing the
// backend memory's limit. Throws std::invalid_argument naming the flag.
struct MemoryLimitSetting {
  enum class Kind : uint8_t { Auto, None, Bytes } kind = Kind::Auto;
  int64_t bytes = 0;
};
MemoryLimitSetting parse_memory_limit(const std::string& text);

// Refuses (std::runtime_error, the plan and the limit in the message) a plan that does not fit:
// the backend's memory against `setting` (auto: be.device_memory_free() on a device backend, else
// host_memory_available()), and on a device backend its host lines against the host memory.
// Returns the lines saying the limits the plan was checked against ("" for none).
std::string check_memory_plan(const MemoryPlan& plan, const MemoryLimitSetting& setting,
                              const Backend& be);

// The trainer's plan, before it allocates anything: the plan for backend be (resume: the run loads
// a checkpoint), printed when print, then check_memory_plan (its limit lines printed too).
MemoryPlan plan_run(const RunConfig& c, const Backend& be, bool resume, bool data_parallel,
                    int ranks, int rank, const MemoryLimitSetting& setting, bool print);

// What a run measured, for the line next to its plan: memory in use at its start (before the plan;
// device memory on a device backend, else resident memory) and at its peak (device: the highest
// device_memory_used() after a step; host: VmHWM at the end).
struct MeasuredMemory {
  int64_t start = -1, peak = -1;
};
MeasuredMemory memory_at_start(const Backend& be);
// "peak device memory in use: ... ; the plan: ... (measured - plan: +x %)" (or resident memory).
std::string measured_against_plan(const MemoryPlan& plan, const Backend& be,
                                  const MeasuredMemory& m);

// This process's resident memory now and its high-water mark (/proc/self/status VmRSS, VmHWM),
// in bytes; -1 where unreadable.
int64_t resident_bytes();
int64_t peak_resident_bytes();

}  // namespace fp4sim::model
