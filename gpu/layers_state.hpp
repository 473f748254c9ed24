// The training ops' state, shared by their files (gpu/norm.cu, matmul.cu, elementwise.cu, ...):
// CudaBackend::LayersState, made on first use by CudaBackend::layers_state (gpu/cuda_backend.cu),
// holds the matmuls' cuBLASLt handle and plans, the ops' scratch buffers and the RoPE table; and
// the activation-fusion knob, which the matmuls and the quantizer's fused activations both read.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "gpu/cuda_backend.hpp"
#include "gpu/device_scratch.hpp"

namespace fp4sim::gpu {

// State of the training ops, owned by CudaBackend::LayersState (below).
namespace training_ops {

using gpu::DeviceScratch;  // gpu/device_scratch.hpp

// One matmul's cuBLASLt descriptors, destroyed with it.
struct LtDescriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  LtDescriptors() = default;
  LtDescriptors(const LtDescriptors&) = delete;
  LtDescriptors& operator=(const LtDescriptors&) = delete;
  ~LtDescriptors() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (ld) cublasLtMatrixLayoutDestroy(ld);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// The matmuls' own cuBLASLt handle and workspace (gpu/gemm_cublaslt.cu keeps its own), and their
// plans: descriptors and the heuristic's algorithm per (operand type, transposes, m, n, k, leading
// dimensions, pointer alignments), built on a matmul's first call with them and reused after (the
// heuristic answers the same for the same question, so the algorithm, and the bits, are those of a
// per-call query; the host skips four descriptor builds and a heuristic query a GEMM).
struct CublasLt {
  struct Plan {
    std::unique_ptr<LtDescriptors> d;
    cublasLtMatmulAlgo_t algo{};
    bool supported =
        true;  // false: a BF16-output or bias-epilogue question cuBLASLt has no algorithm for
  };
  // (the last two: D stored as BF16, a bias epilogue)
  using PlanKey = std::tuple<bool, bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t,
                             uint32_t, uint32_t, uint32_t, int, bool, bool>;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  bool rules_active = false;  // matmul_preferred_algo's rules apply (Hopper, cuBLASLt 13.1.x)
  int pick = kPlanOwnPick;    // CudaOptions::matmul_heuristic_pick
  std::map<PlanKey, Plan> plans;
  MatmulPlanPick last_pick;           // CudaCounters::last_matmul_plan_pick
  std::string last_epilogue_refusal;  // CudaCounters::last_matmul_epilogue_refusal
  CublasLt() = default;
  CublasLt(const CublasLt&) = delete;
  CublasLt& operator=(const CublasLt&) = delete;
  ~CublasLt() {
    plans.clear();  // (the descriptors before the handle, as they were made)
    if (workspace) cudaFree(workspace);
    if (handle) cublasLtDestroy(handle);
  }
};

// The RoPE cos/sin table (T, HD/2, 2) for head size HD and positions 0..T-1.
struct RopeTable {
  DeviceScratch device{"RoPE table"};
  std::vector<float> host;  // kept: the source of the asynchronous upload
  int64_t T = 0, HD = 0;
};

}  // namespace training_ops

struct CudaBackend::LayersState {
  training_ops::CublasLt lt;  // created on the first matmul
  training_ops::DeviceScratch bf16_a{"matmul BF16 operand a"}, bf16_b{"matmul BF16 operand b"},
      bf16_c{"matmul BF16 operand c"};  // BF16 operands of the matmuls
  // matmul_forward_bf16's FP32 output where the epilogue does not write BF16
  training_ops::DeviceScratch f32_out{"matmul FP32 output"};
  // matmul_backward_bf16_dout's dout widened, FP32 GEMMs only (kept, as the others; no training
  // configuration pairs BF16 activations with them)
  training_ops::DeviceScratch f32_dout{"matmul widened dout"};
  training_ops::DeviceScratch bias16{"bias BF16 bits"};  // for the BF16-output epilogue
  training_ops::DeviceScratch bias32{"bias widened"};  // a BF16 bias view's values, for the passes
  training_ops::DeviceScratch columns{"partial column sums"};
  // attention backward rowsum(dO*O), then lse*log2(e): 2 x (B,NH,T)
  training_ops::DeviceScratch att_dsum{"attention dsum"};
  training_ops::DeviceScratch att_qkv16{"attention BF16 qkv"},
      att_dout16{"attention BF16 dout"};  // attention's BF16 copies of qkv and dout
  training_ops::DeviceScratch att_ds{"attention stored dS"};  // the backward's bf16(dS) tiles
  training_ops::DeviceScratch gelu_lut{"GELU table"};  // GELU's BF16 output bits by input bits
  int gelu_lut_ctas = 0;  // the table's kernel's grid, one CTA an SM (0: the table is not made yet)
  training_ops::DeviceScratch sort_keys{"embedding sort keys"}, sort_rows_in{"embedding rows"},
      sort_rows_out{"embedding sorted rows"}, sort_temp{"embedding sort temp"};  // embedding bwd
  training_ops::DeviceScratch sums{"sum_squares partials"};      // sum_squares partials and results
  training_ops::DeviceScratch segments{"sum_squares segments"};  // (offset, count) pairs
  training_ops::DeviceScratch adamw_items{"adamw work items"};   // adamw_update's (AdamWItem)
  training_ops::DeviceScratch qadamw_segs{"Q-AdamW segments"};   // qadamw_update's table
  // frobenius_norm's row sums (and its result); abs_quantile's keys, sorted keys and CUB's storage
  training_ops::DeviceScratch ns_rows{"Frobenius norm row sums"};
  training_ops::DeviceScratch quantile_keys{"quantile keys"},
      quantile_sorted{"quantile sorted keys"}, quantile_temp{"quantile sort temp"};
  std::vector<int64_t> adamw_key;  // the (offset, count, step index) they were made for
  int64_t adamw_item_count = 0;
  // the Mamba-2 ops' scratch (gpu/ssm.cu): per-element terms (the conv's du, the softplus
  // backward's du, the gated norm's dweight terms); the scan backward pass's recomputed chunk
  // states, its per-head dB and dC terms, and its ddt, dA and per-(batch, head) sums
  training_ops::DeviceScratch ssm_terms, ssm_states, ssm_contrib, ssm_small;
  // the parameter gradients' partial sums (a row block's, emu/ssm.hpp's kSsmSumRows)
  training_ops::DeviceScratch ssm_partials{"Mamba parameter-gradient partial sums"};
  training_ops::RopeTable rope;
  std::vector<int64_t> host_segments;
};

}  // namespace fp4sim::gpu
