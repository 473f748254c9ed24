// A decoder-only transformer (GPT-2 family, config-driven) on the emulator's layer functions:
// forward, backward, and the named FP32 parameter tensors the optimizer and checkpoints use.
//
// First version (issue 4): every op goes through Backend (emu/layers.hpp's names and argument
// orders), but the buffers are host std::vectors, so only a host backend (the emulator) can run it;
// placing them in backend memory comes with the CUDA twins. FP32 activations, BF16 GEMMs emulated
// with the tensor-core T-FDPA chain. SwiGLU is not wired yet.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "emu/backend.hpp"
#include "emu/layers.hpp"
#include "model/config.hpp"

namespace fp4sim::model {

struct ParamTensor {
  std::string name;
  std::vector<int64_t> shape;
  size_t offset;  // into the flat parameter vector
  int64_t numel() const;
};

class Gpt {
 public:
  Gpt(const ModelConfig& cfg, Backend& backend);

  // GPT-2 style initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers),
  // LayerNorm weights 1, biases 0. Deterministic in the seed.
  void init(uint64_t seed);

  // tokens, targets (B,T). Returns the mean cross-entropy loss; keeps the activations.
  float forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T);
  // Gradients of the mean loss of the last forward into grads() (zeroed first).
  void backward();

  // FP32 GEMMs instead of the emulated BF16 ones (gradient checks only).
  void set_gemm_precision(emu::GemmPrecision p) { prec_ = p; }

  const ModelConfig& config() const { return cfg_; }
  std::vector<float>& params() { return params_; }
  std::vector<float>& grads() { return grads_; }
  const std::vector<ParamTensor>& tensors() const { return tensors_; }
  const ParamTensor& tensor(const std::string& name) const;
  // Logits (B,T,V) of the last forward.
  const std::vector<float>& logits() const { return logits_; }

 private:
  struct LayerActs {
    std::vector<float> ln1, ln1_mean, ln1_rstd, qkv, att, atty, attproj, res1;
    std::vector<float> ln2, ln2_mean, ln2_rstd, fc, act, fcproj, res2;
  };
  float* p(const std::string& name) { return params_.data() + tensor(name).offset; }
  float* g(const std::string& name) { return grads_.data() + tensor(name).offset; }
  void add(const std::string& name, std::vector<int64_t> shape);
  std::string lname(int64_t l, const char* what) const;

  ModelConfig cfg_;
  Backend& be_;
  emu::GemmPrecision prec_ = emu::GemmPrecision::BF16;
  std::vector<ParamTensor> tensors_;
  std::vector<float> params_, grads_;
  // last forward
  int64_t B_ = 0, T_ = 0;
  std::vector<int32_t> tokens_, targets_, pos_;
  std::vector<float> emb_, lnf_, lnf_mean_, lnf_rstd_, logits_, probs_, losses_;
  std::vector<LayerActs> acts_;
};

}  // namespace fp4sim::model
