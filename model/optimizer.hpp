// The optimizer of a training run (DESIGN.md §13): AdamW (emu/optim.hpp) on every parameter, or
// Muon / ROOT on the blocks' linear weights with AdamW on the rest (embeddings, head, norms,
// biases, the Mamba mixer's dt_bias, A_log, D and conv). Muon and ROOT share train.lr and its
// schedule and train.weight_decay with AdamW; gradient clipping (and loss scaling's 1/S) comes
// before both, as the step's grad_scale.
//
// Muon (Moonlight's scaling), per linear weight, each fused weight per sub-matrix (c_attn as Q, K,
// V; in_proj as z, x, B, C, dt; SwiGLU's c_fc as gate, up):
//   g = grad * grad_scale;  buf = mu * buf + g;  g' = g + mu * buf        (Nesterov, mu 0.95)
//   X = NS5(g');  p = p * (1 - lr * wd) - (lr * 0.2 * sqrt(max(m, n))) * X
// AdamW's m and v are stored between steps in float32, BF16 (RNE) or NVFP4 (Q-AdamW,
// emu/qadamw.hpp), optim.state; a tensor whose row is not a whole number of optim.v_tile keeps
// float32 state under nvfp4 (describe() counts them).
// ROOT: NS5 of clamp(g', -eps, eps), eps = quantile(|g'|, 0.9) + 1e-9, with coefficients keyed by
// the shape (configs/optim/root_ns_coefficients.json; other shapes Muon's).
// NS5 (NewtonSchulz below): X = g' (transposed when it has more rows than columns) divided by
// ||X||_F + 1e-7; five times A = X X^T, B = b A + c A A, X = a X + B X; transposed back. The three
// products per iteration in FP32, BF16 or NVFP4 (Q-Root, optim.ns_precision); every step a Backend
// op, so NVFP4 with exact GEMMs gives the same bits on the emulator and the CUDA backend.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "emu/backend.hpp"
#include "model/checkpoint.hpp"
#include "model/config.hpp"
#include "model/gpt.hpp"
#include "model/linear.hpp"

namespace fp4sim::model {

struct NsCoefficients {
  float a, b, c;
};
inline constexpr NsCoefficients kMuonNs{3.4445f, -4.7750f, 2.0315f};

// ROOT's shape-keyed table: coefficients by the (min, max) of a matrix's rows and cols.
struct RootTableEntry {
  int64_t min = 0, max = 0;
  NsCoefficients coef{};
};
using RootTable = std::vector<RootTableEntry>;
// A table from its JSON text ({"shapes": [{"min", "max", "a", "b", "c"}, ...]}, other top-level
// keys ignored): std::invalid_argument naming `source`, the entry and the key for anything else —
// a missing or unknown key, min or max not a positive integer, min > max, a coefficient that is not
// a finite number, a shape listed twice.
RootTable parse_root_table(const std::string& json_text, const std::string& source);
// The compiled-in table (configs/optim/root_ns_coefficients.json), or the file optim.root_table
// names.
const RootTable& builtin_root_table();
RootTable load_root_table(const std::string& path);
// The table's coefficients for a matrix of this shape; none where it has no such shape.
std::optional<NsCoefficients> root_table_coefficients(const RootTable& t, int64_t rows,
                                                      int64_t cols);
// ... from the compiled-in table.
std::optional<NsCoefficients> root_table_coefficients(int64_t rows, int64_t cols);

struct NsOptions {
  NsPrecision precision = NsPrecision::FP32;
  GemmImpl impl = GemmImpl::Exact;  // NVFP4: the quantized GEMMs' path
  double clip_quantile = 1.0;       // NVFP4: X's quantized copies clamped to +-quantile (1: off)
  NsCoefficients coef = kMuonNs;
  int iterations = 5;
};

// Newton–Schulz orthogonalisation with scratch for matrices whose smaller side is at most
// max_small and whose size is at most max_elems (allocated once, in the backend's memory).
class NewtonSchulz {
 public:
  NewtonSchulz(Backend& be, int64_t max_small, int64_t max_elems, NsPrecision precision);
  // out = NS(g), g and out float32 [r, c] (out may be g).
  void run(const TensorView& g, const TensorView& out, const NsOptions& o);

 private:
  Backend& be_;
  int64_t max_small_, max_elems_;
  NsPrecision precision_;
  BackendBuffer x_, xt_, bx_, a_, at_, aa_;  // X, X^T or X's clamped copy, B X, A, A^T, A A / B
  std::unique_ptr<QuantizedCopy> qx_row_, qx_col_, qa_row_, qa_col_, qb_row_;

 public:
  size_t bytes() const;  // the scratch's
};

// A sub-matrix of an orthogonalised weight: rows [row0, row0 + rows) of it, all its columns.
struct MatrixPart {
  std::string name;  // "q", "k", "v", "z", "x", "B", "C", "dt", "gate", "up"; "" for a whole weight
  int64_t row0 = 0, rows = 0;
};
// A weight Muon or ROOT updates: the index of its ParamTensor and its sub-matrices.
struct OrthoTensor {
  size_t tensor = 0;
  std::vector<MatrixPart> parts;
};
// The blocks' linear weights of `model`, in parameter order, with their sub-matrices (§13).
std::vector<OrthoTensor> orthogonalised_tensors(const Gpt& model);

class Optimizer {
 public:
  // The state (AdamW's m and v, or the momentum of the orthogonalised weights in m) in the
  // model's backend, zeroed. Muon/ROOT with NVFP4 products need both sides of every sub-matrix a
  // multiple of 16 (std::invalid_argument naming the tensor and sub-matrix otherwise).
  // owned (ZeRO-1, train.zero=1): the parameter tensors whose state lives here, one flag each
  // (empty: all of them); the others' state and updates belong to other ranks, whose weights the
  // trainer broadcasts after each step.
  Optimizer(const RunConfig& c, Gpt& model, std::vector<bool> owned = {});
  // One step with learning rate lr at optimizer step t (1-based: AdamW's bias correction) on the
  // model's gradients times grad_scale (clipping factor / loss scale).
  void step(double lr, int64_t t, float grad_scale);
  // The state as checkpoint tensors: "<param>.exp_avg", "<param>.exp_avg_sq" (AdamW; float32, or
  // BF16 under optim.state=bf16, in the parameter's shape) and "<param>.momentum_buffer"
  // (Muon/ROOT, float32). Q-AdamW's encoded tensors instead: "<param>.exp_avg.codes",
  // ".exp_avg.scales", ".exp_avg_sq.codes", ".exp_avg_sq.scales" (U8: packed E2M1 codes, E4M3
  // scales, 1-D), ".exp_avg_sq.tile_mean" (BF16, one a tile), ".exp_avg_sq.tile_floor" (BF16,
  // one a tile, under optim.v_floor=tile_min) and ".qadamw_amax" (F32 [2]: m's and v's).
  void save(TensorMap& out) const;
  // The state from checkpoint tensors (save's names; the tensors this optimizer owns, others
  // ignored); `where` names the checkpoint in errors.
  void load(const TensorMap& in, const std::string& where);
  // "AdamW on 16 tensors; muon on 8 weights (12 sub-matrices, NS in fp32)"
  std::string describe() const;
  const std::vector<OrthoTensor>& orthogonalised() const { return ortho_; }
  // Bytes of the state kept between steps, and of the step's scratch, in the backend's memory.
  size_t state_bytes() const;
  size_t scratch_bytes() const;

 private:
  void ortho_step(double lr, float grad_scale);
  void allocate_adamw_state();
  QAdamWState q_state() const;
  const RunConfig& c_;
  Gpt& model_;
  std::vector<OrthoTensor> ortho_;
  RootTable root_table_;        // ROOT's coefficients (the compiled-in table or optim.root_table's)
  std::vector<bool> is_ortho_;  // per parameter tensor
  std::vector<bool> owned_;     // per parameter tensor (ZeRO-1; all true without it)
  bool sharded_ = false;        // some tensor's state lives on another rank
  // each owned tensor's offset in m_, v_, m16_ and v16_: its parameter offset, or (sharded) the
  // owned tensors packed in parameter order; n_state_ elements in all
  std::vector<int64_t> state_offset_;
  int64_t n_state_ = 0;
  std::vector<Segment> adamw_segs_;  // the AdamW tensors' spans
  std::vector<size_t> adamw_tensors_;
  // float32 m and v at the parameters' offsets (optim.state=fp32); Muon/ROOT's momentum in m_
  BackendBuffer m_, v_;
  BackendBuffer m16_, v16_;  // optim.state=bf16: BF16 m and v at the parameters' offsets
  // optim.state=nvfp4: the tensors with encoded state (q_segs_: their spans; state offsets in
  // order) and the others, whose float32 state lies packed in fb_m_ and fb_v_ at fb_offset_
  std::vector<size_t> q_tensors_, fb_tensors_;
  std::vector<Segment> q_segs_;
  std::vector<int64_t> fb_offset_;
  BackendBuffer qm_codes_, qm_scales_, qv_codes_, qv_scales_, qv_mean_, q_amax_;
  BackendBuffer qv_floor_;  // optim.v_floor = tile_min: the tiles' floors (BF16)
  BackendBuffer fb_m_, fb_v_;
  int64_t q_elems_ = 0, fb_elems_ = 0;
  BackendBuffer g_;  // Muon/ROOT: one weight's g'
  std::unique_ptr<NewtonSchulz> ns_;
};

}  // namespace fp4sim::model
