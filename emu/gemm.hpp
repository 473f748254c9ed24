// Exact block-scaled FP4 GEMM (DESIGN.md §8): D = alpha * A * B^T (+ beta * C), A M x K and B N x
// K, both K-major ("TN") row-wise quantized copies (NVFP4 or MXFP4), modelling one CTA that walks K
// in increasing order with GST-FDPA (emu/mma.hpp) per 64-wide chunk.
#pragma once

#include <cstdint>

#include "emu/mma.hpp"
#include "emu/quantize.hpp"
#include "emu/tensor.hpp"

namespace fp4sim {

enum class GemmOut : uint8_t { F32, BF16 };

// exact: the tensor-core model (every backend, bit-identical); cublaslt: cuBLASLt on the CUDA
// backend (Hopper: BF16 after exact dequantization), within gemm_cublaslt_bound of exact.
enum class GemmImpl : uint8_t { Exact, CublasLt };

struct GemmConfig {
  GemmImpl impl = GemmImpl::Exact;
  float alpha = 1.0f;
  float beta = 0.0f;  // needs C
  int split_k = 1;    // must divide the number of K chunks (64-wide; FP8: 128-wide k-blocks)
  GemmOut out = GemmOut::F32;
};

// K padded to a multiple of 64 (groups of zero codes with scale byte 0x00).
constexpr int64_t kGemmChunk = kGstK;
FP4SIM_HD int64_t gemm_chunks(int64_t k) { return (k + kGemmChunk - 1) / kGemmChunk; }

// Throws std::invalid_argument naming the operand and shape when A and B cannot be multiplied:
// different K, different formats, K not a multiple of the block, split-K not dividing the chunks,
// beta without C, C of the wrong shape.
void validate_gemm(const QuantizedView& a, const QuantizedView& b, const TensorView* c,
                   const GemmConfig& cfg, const TensorView& d);

ScaleKind scale_kind_of(QFormat f);

// The exact GEMM on host memory (the emulator's implementation): integer group sums, OpenMP over
// rows of D. c: F32 [M, N] or null; out: F32 or BF16 bits [M, N].
void gemm_exact_host(const QuantizedView& a, const QuantizedView& b, const float* c,
                     const GemmConfig& cfg, void* out);

// Epilogue scale: NVFP4 ((alpha * amax_A) * amax_B) * k with k the FP32 constant
// 1 / (6 * 6 * m_A * m_B), m = 448 (256 for a Four Over Six operand); MXFP4 alpha itself.
FP4SIM_HD float gemm_epilogue_alpha(float alpha, QFormat fmt, float amax_a, bool fos_a,
                                    float amax_b, bool fos_b) {
  if (fmt != QFormat::NVFP4) return alpha;  // MXFP4 and FP8 have no global scales
  const float ma = fos_a ? 256.0f : kE4M3Max, mb = fos_b ? 256.0f : kE4M3Max;
  const float k = fdiv_rn(1.0f, fmul_rn(fmul_rn(36.0f, ma), mb));  // the product is exact
  return fmul_rn(fmul_rn(fmul_rn(alpha, amax_a), amax_b), k);
}

// t = alpha' * acc (RN); with beta != 0, D = t + (beta * C) (two RN operations, no FMA). A NaN
// result (Inf * 0 when an operand's amax is Inf, say) is the canonical 0x7FFFFFFF: CPUs and GPUs
// produce different NaN bit patterns for invalid operations.
FP4SIM_HD float gemm_epilogue(float alpha_eff, float acc, float beta, float c) {
  const float t = fmul_rn(alpha_eff, acc);
  const float d = beta != 0.0f ? fadd_rn(t, fmul_rn(beta, c)) : t;
  return f32_isnan(d) ? f32_from_bits(kCanonicalNaN) : d;
}

// Split-K as the contract orders it: the chunks (64-wide for FP4, 128-blocks for FP8) of each of
// split_k equal ranges chained through an accumulator from +0, acc = chunk(i, acc); then the
// ranges' results added in order, each addition RN. Both backends' exact GEMMs evaluate an output
// through this, except two CUDA kernels that keep the same order their own way: the tiled FP4
// kernel (4 x 4 outputs at once) and the FP8 tensor-core kernel (gpu/fp8_wgmma.cu: the chain in
// registers, the ranges added by its reduce kernel).
template <class Chunk>
FP4SIM_HD float split_k_chain(int split_k, int64_t chunks, const Chunk& chunk) {
  const int64_t per_split = chunks / split_k;
  float total = 0.0f;
  for (int s = 0; s < split_k; ++s) {
    float acc = 0.0f;
    for (int64_t i = s * per_split; i < (s + 1) * per_split; ++i) acc = chunk(i, acc);
    total = s == 0 ? acc : fadd_rn(total, acc);
  }
  return total;
}

// Output idx of an exact GEMM: D = gemm_epilogue(alpha_eff, acc, beta, C[idx]) as FP32, or its BF16
// (RNE, Fmt::bf16_rne) bits, per cfg.out.
template <class Fmt = ReferenceFormats>
FP4SIM_HD void gemm_store(const GemmConfig& cfg, float alpha_eff, float acc, const float* c,
                          int64_t idx, void* out) {
  const float d = gemm_epilogue(alpha_eff, acc, cfg.beta, c ? c[idx] : 0.0f);
  if (cfg.out == GemmOut::BF16)
    static_cast<uint16_t*>(out)[idx] = Fmt::bf16_rne(d);
  else
    static_cast<float*>(out)[idx] = d;
}

// Bound on |D_cublaslt - D_exact| for one output, from the two accumulation models (DESIGN.md §7),
// with S = sum_k |a_k||b_k| over the operands dequantized with their block scales (so every partial
// sum and every 2^e_max is at most 2S) and u = 2^-23:
//  - exact (GST-FDPA per 64-wide chunk): one RZ per chunk (< u * 2S... taken as u * S per unit of
//    `steps` below, with the factor 2 folded into the per-step constant) plus 5 truncations at
//    2^(e_max - 35) (< 2^-11 u S together): about 1 unit per chunk;
//  - Hopper BF16 wgmma (T-FDPA L = 16, F = 25, RZ) per 16-wide step: one RZ plus 17 truncations at
//    2^(e_max - 25) = u/4 * 2^e_max each: under 10 units per step.
//   bound = (ceil(K/64) + 10 * ceil(K/16) + 2) * u * S * |alpha'|  + 2 ulps of |D| (the epilogue)
FP4SIM_HD double gemm_cublaslt_bound(int64_t k, double sum_abs, double alpha_eff, double d_abs) {
  const double u = 1.1920928955078125e-07;
  const double steps = static_cast<double>((k + 63) / 64 + 10 * ((k + 15) / 16) + 2);
  return steps * u * sum_abs * (alpha_eff < 0 ? -alpha_eff : alpha_eff) + 2.0 * u * d_abs;
}

}  // namespace fp4sim
