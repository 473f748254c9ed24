// Checkpoints (issue 4 groundwork): tensors in safetensors files, training state in JSON, one
// directory per step, written under a temporary name and renamed into place, so a crash mid-write
// never destroys the last good checkpoint; keep-last-k prunes older ones.
#pragma once

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
// Throws std::runtime_error naming the file on a truncated file, bad header, or offsets that do not
// match the dtype and shape.
TensorMap read_safetensors(const std::string& path,
                           std::map<std::string, std::string>* metadata = nullptr);

struct Checkpoint {
  int64_t step = 0;
  TensorMap model, optimizer;
  nlohmann::json state;  // config, RNG, data position, contract_version, ...
};

// dir/step_000123/{model.safetensors, optimizer.safetensors, state.json}; returns that path.
std::string save_checkpoint(const std::string& dir, const Checkpoint& ck, int keep_last);
// `path` is a step directory, or a run directory (its latest complete checkpoint). Checks
// contract_version against this build's.
Checkpoint load_checkpoint(const std::string& path);
// Complete checkpoints under dir, oldest first.
std::vector<std::string> list_checkpoints(const std::string& dir);
// The step of a checkpoint folder that list_checkpoints returned (step_NNNNNNNN).
int64_t checkpoint_step(const std::string& path);

}  // namespace fp4sim::model
