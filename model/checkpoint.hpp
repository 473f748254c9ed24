// Checkpoints: tensors in safetensors files, training state in JSON, one directory per step,
// written under a temporary name and renamed into place, so a crash mid-write never destroys the
// last good checkpoint; keep-last-k prunes older ones. Every file carries its step and a SHA-256
// (per tensor in the safetensors metadata, per file in manifest.json, written last), and load
// refuses a file that does not match, a non-finite value, and a file of another step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace fp4sim::model {

struct StoredTensor {
  std::string dtype;  // safetensors names: "F32", "BF16", "U8", "I64", ...
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

using TensorMap = std::map<std::string, StoredTensor>;  // sorted by name: stable files

// safetensors: 8-byte little-endian header length, JSON header (dtype, shape, data_offsets per
// tensor, optional string metadata), then the data.
void write_safetensors(const std::string& path, const TensorMap& tensors,
                       const std::map<std::string, std::string>& metadata = {});
// Throws std::runtime_error naming the file (and the tensor) on a truncated file, a header that is
// not strict JSON (duplicate keys, trailing data), offsets that do not match the dtype and shape,
// and data that do not tile the data section exactly (gaps, overlaps, trailing bytes).
TensorMap read_safetensors(const std::string& path,
                           std::map<std::string, std::string>* metadata = nullptr);

// SHA-256 of n bytes as 64 lowercase hex digits (OpenSSL's EVP interface).
std::string sha256_hex(const void* data, size_t n);

// The index of the first NaN or Inf of a floating-point tensor (F64, F32, F16, BF16); -1 when
// every element is finite or the dtype is not floating-point.
// An F32 tensor of `shape` holding the n floats at data (a checkpoint's or a dump's).
StoredTensor f32_tensor(const float* data, const std::vector<int64_t>& shape, int64_t n);

int64_t first_nonfinite(const StoredTensor& t);

struct Checkpoint {
  int64_t step = 0;
  TensorMap model, optimizer;
  nlohmann::json state;  // config, RNG, data position, contract_version, ...
};

// dir/step_000123/{model.safetensors, optimizer.safetensors, state.json, manifest.json}; returns
// that path. Refuses (std::runtime_error, nothing written) a NaN or Inf in ck.model or
// ck.optimizer. Files and folders are fsync'ed before the rename into place, the parent folder
// after it.
//
// Test hook: FP4SIM_FAULT_AT=N makes the process raise SIGKILL just before the Nth operation
// (create, write, fsync, close, rename, remove) of its checkpoint saves, counted from 1 over the
// whole process; FP4SIM_FAULT_STOP_AT=N raises SIGSTOP there instead (the process waits for a
// SIGCONT, mid-save); FP4SIM_FAULT_FAIL_AT=N makes that operation fail as on a full disk (ENOSPC);
// FP4SIM_FAULT_TRACE=1 prints each operation's number and name on stderr.
std::string save_checkpoint(const std::string& dir, const Checkpoint& ck, int keep_last);
// `path` is a step directory, or a run directory (its latest complete checkpoint). Checks
// contract_version against this build's, every file's step and SHA-256 against manifest.json and
// every value of model and optimizer for NaN/Inf; the errors name the file (and the tensor, and
// the element). A checkpoint without manifest.json (written before the hashes) is refused unless
// FP4SIM_ALLOW_UNVERIFIED_CHECKPOINT=1, which loads it with a warning on stderr (steps and values
// still checked).
Checkpoint load_checkpoint(const std::string& path);
// Complete checkpoints under dir, oldest first.
std::vector<std::string> list_checkpoints(const std::string& dir);
// The step of a checkpoint folder that list_checkpoints returned (step_NNNNNNNN).
int64_t checkpoint_step(const std::string& path);

}  // namespace fp4sim::model
