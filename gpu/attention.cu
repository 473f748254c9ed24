// Causal self-attention with grouped KV heads on the tensor cores: FlashAttention-2 kernels (Dao,
// 2023) on mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, the CUDA twins of
// emu/attention.hpp's attention_forward / attention_backward (same shapes, same saved lse, dqkv
// written as +0 + value). The (B,NH,T,T) probabilities are never stored; for HD <= 64 the backward
// pass stores bf16(dS) (B,NH, causal tiles) in a scratch the dQ kernel reads, and otherwise
// recomputes it in the dQ kernel (the same values either way). The kernels are in
// gpu/attention_forward.cuh and gpu/attention_backward.cuh (their building blocks in
// gpu/attention_tiles.cuh); this file has their launchers and CudaBackend's attention methods.
//
// Shapes: qkv (B,T,(NH+2NKV)*HD) FP32 holding the NH query heads, then NKV key heads, then NKV
// value heads; out and dout (B,T,NH*HD); lse and dsum (B,NH,T). Query head h reads KV head
// h / (NH/NKV). HD in {16, 32, 64, 128} (template argument).
//
// Tiling: a tile is kTile = 64 rows; a CTA is 4 warps, each warp owns 16 rows of the tile (the M of
// the m16n8k16 MMA). K, V, Q, dO tiles are staged in shared memory as BF16 rows padded by
// kSmemPad elements (so the 8 rows an ldmatrix phase reads fall on distinct banks).
//
// Numerics (emu/attention.hpp states the contract; this file agrees with it within a bound, not
// bitwise):
// - Operands: q, k, v, dout rounded FP32 -> BF16 RNE once per call into BF16 copies
// (cvt.rn.bf16x2.f32:
//   the value of emu/formats.hpp's bf16_rne for every input, NaN -> canonical NaN; a no-op on
//   BF16-stored activations), which the kernels stage with cp.async, the next tile's copy in flight
//   while the current one is used (two buffers for HD <= 64). P and dS rounded the same way in
//   registers before they feed an MMA.
// - Products exact, sums in FP32 inside the tensor core (its order, not the emulator's
//   sequential one); every MMA chain starts from +0.
// - s = acc * scale (one FP32 multiplication, scale = 1/sqrt(HD) as the emulator computes it).
// - Exponentials in base 2, as FlashAttention computes them: the scores are scaled by
//   scale * log2(e) (both FP32-rounded once, the product once more; one multiplication an element)
//   and exp(x) is ex2.approx.ftz (gpu/exp2.cuh: one MUFU instruction, ~2 ulp; results below
//   2^-126 flush to zero, p that small adds nothing a BF16 P can hold next to the row's largest
//   p = 1): a few ulp from the emulator's expf, more for large |x| where p is tiny.
// - Forward: online softmax per 64-key tile, FP32, in base-2 units u = s * scale * log2(e):
//   m_new = max(m, tile max); the running sum l and the output accumulator are rescaled by
//   2^(m - m_new); p = 2^(u - m_new) (the row's maximum gives exactly 1) is rounded to BF16 for
//   the PV MMA while l sums the unrounded p. So P is rounded relative to the running max, not the
//   final one: each term of out differs from the emulator's by up to one BF16 rounding (2^-8
//   relative) of each side. out = acc / l (IEEE division); lse = (m + log2f(l)) * ln(2), natural
//   units as the emulator saves it.
// - Backward: dsum = rowsum(bf16(dout) * out), FP32 from +0 in increasing i (the emulator's order:
//   bitwise). p = 2^(u - lse * log2(e)) recomputed; dS = p * (dP - dsum), FP32; dq = scale * (sum_j
//   bf16(dS_j) k_j), dk_j = scale * (sum_{h,t} bf16(dS_tj) q_t), dv_j = sum_{h,t} bf16(p_tj)
//   dout_t, each sum FP32 from +0 in registers over a fixed loop order (heads, then query tiles,
//   then 16-row chunks, each in increasing order), then one FP32 multiplication by scale (dq, dk)
//   and the store of +0 + value (BF16-rounded when the caller asks) by the one thread that owns
//   the element; dqkv is never read, so it needs no zeroing.
// - Deterministic: no atomics, no order that depends on scheduling: run to run bitwise.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "emu/formats.hpp"
#include "emu/op_checks.hpp"
#include "gpu/attention_backward.cuh"
#include "gpu/attention_forward.cuh"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/exp2.cuh"
#include "gpu/layers_state.hpp"
#include "gpu/op_checks.hpp"

namespace fp4sim::gpu {

namespace {

// ---- host side ----------------------------------------------------------------------------------

void require_aligned(const char* op, const char* tensor, const void* p) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0)
    throw std::invalid_argument(std::string(op) + ": " + tensor +
                                " must be 16-byte aligned (vector and cp.async loads)");
}

// dst (n FP32 values, n % 4 == 0) as BF16 bits.
void to_bf16(bf16* dst, const float* src, int64_t n, cudaStream_t stream) {
  const int64_t n4 = n / 4;
  const int64_t blocks = (n4 + 255) / 256;
  to_bf16_kernel<<<static_cast<unsigned>(blocks < 132 * 32 ? (blocks > 0 ? blocks : 1) : 132 * 32),
                   256, 0, stream>>>(dst, src, n4);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

template <int HD>
void forward_for(float* out, uint16_t* out16, float* lse, const bf16* qkv, int64_t B, int64_t T,
                 int64_t NH, int64_t NKV, bool round_bf16, cudaStream_t stream) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));  // as the emulator, on the host
  const dim3 grid(static_cast<unsigned>(B * NH), static_cast<unsigned>((T + kTile - 1) / kTile));
  const int t = static_cast<int>(T), nh = static_cast<int>(NH), nkv = static_cast<int>(NKV);
  if (out16)
    attention_forward_kernel<HD, true, uint16_t>
        <<<grid, kThreads, 0, stream>>>(out16, lse, qkv, t, nh, nkv, scale);
  else if (round_bf16)
    attention_forward_kernel<HD, true, float>
        <<<grid, kThreads, 0, stream>>>(out, lse, qkv, t, nh, nkv, scale);
  else
    attention_forward_kernel<HD, false, float>
        <<<grid, kThreads, 0, stream>>>(out, lse, qkv, t, nh, nkv, scale);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

template <int HD, bool kRound, class OutT>
void backward_kernels(OutT* dqkv, const float* dsum, uint4* ds, const bf16* dout16,
                      const bf16* qkv16, const float* lse2, int64_t B, int64_t T, int64_t NH,
                      int64_t NKV, float scale, cudaStream_t stream) {
  const int64_t tiles = (T + kTile - 1) / kTile;
  const int t = static_cast<int>(T), nh = static_cast<int>(NH), nkv = static_cast<int>(NKV);
  const dim3 kv_grid(static_cast<unsigned>(B * NKV), static_cast<unsigned>(tiles));
  const dim3 q_grid(static_cast<unsigned>(B * NH), static_cast<unsigned>(tiles));
  if constexpr (HD <= 64) {
    if (ds) {
      attention_backward_dkdv_kernel<HD, kRound, true, OutT><<<kv_grid, kThreads, 0, stream>>>(
          dqkv, ds, dout16, qkv16, lse2, dsum, t, nh, nkv, scale);
      FP4SIM_CUDA_CHECK_LAUNCH();
      attention_backward_dq_stored_kernel<HD, kRound, OutT>
          <<<q_grid, kThreads, 0, stream>>>(dqkv, ds, qkv16, t, nh, nkv, scale);
      FP4SIM_CUDA_CHECK_LAUNCH();
      return;
    }
  }
  attention_backward_dkdv_kernel<HD, kRound, false, OutT><<<kv_grid, kThreads, 0, stream>>>(
      dqkv, nullptr, dout16, qkv16, lse2, dsum, t, nh, nkv, scale);
  FP4SIM_CUDA_CHECK_LAUNCH();
  attention_backward_dq_kernel<HD, kRound, OutT>
      <<<q_grid, kThreads, 0, stream>>>(dqkv, dout16, qkv16, lse2, dsum, t, nh, nkv, scale);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

template <int HD, class DoutT, class OutT>
void dsum_launch(float* dsum, float* lse2, const float* lse, const DoutT* dout, const OutT* out,
                 int64_t rows, int T, int NH, cudaStream_t stream) {
  constexpr int R = DsumShape<HD, DoutT, OutT>::kRows;
  const int64_t blocks = (rows + R - 1) / R;
  attention_dsum_kernel<HD, DoutT, OutT>
      <<<static_cast<unsigned>(blocks < 65536 ? blocks : 65536), R, 0, stream>>>(
          dsum, lse2, lse, dout, out, rows, T, NH);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

template <int HD>
void backward_for(float* dqkv, uint16_t* dqkv16, float* dsum, uint4* ds, const float* dout,
                  const bf16* dout16, bool dout_bits, const bf16* qkv16, const float* out,
                  const uint16_t* out16, const float* lse, int64_t B, int64_t T, int64_t NH,
                  int64_t NKV, bool round_bf16, cudaStream_t stream) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
  const int64_t rows = B * T * NH;
  const int t = static_cast<int>(T), nh = static_cast<int>(NH);
  // (dout_bits: dout given as BF16 bits, read from dout16; the bits bf16_round(dout) would give)
  const uint16_t* d16 = reinterpret_cast<const uint16_t*>(dout16);
  // dsum's scratch holds rows values of dsum, then rows of lse2 = lse * log2(e)
  float* lse2 = dsum + rows;
  if (dout_bits && out16)
    dsum_launch<HD>(dsum, lse2, lse, d16, out16, rows, t, nh, stream);
  else if (dout_bits)
    dsum_launch<HD>(dsum, lse2, lse, d16, out, rows, t, nh, stream);
  else if (out16)
    dsum_launch<HD>(dsum, lse2, lse, dout, out16, rows, t, nh, stream);
  else
    dsum_launch<HD>(dsum, lse2, lse, dout, out, rows, t, nh, stream);
  if (dqkv16)
    backward_kernels<HD, true>(dqkv16, dsum, ds, dout16, qkv16, lse2, B, T, NH, NKV, scale, stream);
  else if (round_bf16)
    backward_kernels<HD, true>(dqkv, dsum, ds, dout16, qkv16, lse2, B, T, NH, NKV, scale, stream);
  else
    backward_kernels<HD, false>(dqkv, dsum, ds, dout16, qkv16, lse2, B, T, NH, NKV, scale, stream);
}

}  // namespace

// (the sizes gpu/capabilities.hpp computes the stored-dS scratch from, for memory plans made
// without a GPU)
static_assert(kTile == kAttentionTileRows && kDsPairUint4 * 16 == kAttentionDsPairBytes,
              "gpu/capabilities.hpp's attention_ds_scratch_bytes follows these kernels' tiles");

void attention_check_shape(const char* op, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                           int64_t HD) {
  if (!attention_head_dim_supported(HD))
    throw std::invalid_argument(std::string(op) + ": head dim HD=" + std::to_string(HD) +
                                " is not supported by the CUDA attention kernels; expected 16, 32, "
                                "64 or 128");
  if (NH <= 0 || NKV <= 0 || NH % NKV != 0)
    throw std::invalid_argument(std::string(op) + ": NH=" + std::to_string(NH) +
                                " NKV=" + std::to_string(NKV) +
                                "; expected NH, NKV > 0 and NH a multiple of NKV");
  const int64_t tiles = (T + kTile - 1) / kTile;
  if (B < 0 || T < 0 || tiles > 65535 || B * NH > INT_MAX)
    throw std::invalid_argument(std::string(op) + ": B=" + std::to_string(B) +
                                " T=" + std::to_string(T) + " NH=" + std::to_string(NH) +
                                "; expected T <= " + std::to_string(65535 * kTile) +
                                " and B*NH < 2^31 (one CTA per head and 64-row tile)");
}

// qkv (FP32, converted into the qkv16 scratch here) or qkv_in16 (BF16 bits, read as they are);
// out (FP32, BF16-rounded when round_bf16) or out16 (BF16 bits).
void attention_forward_launch(float* out, uint16_t* out16, float* lse, const float* qkv,
                              const uint16_t* qkv_in16, uint16_t* qkv16, int64_t B, int64_t T,
                              int64_t NH, int64_t NKV, int64_t HD, bool round_bf16,
                              cudaStream_t stream) {
  attention_check_shape("attention_forward", B, T, NH, NKV, HD);
  if (B * T == 0) return;
  require_aligned("attention_forward", out16 ? "out16" : "out",
                  out16 ? static_cast<const void*>(out16) : out);
  const bf16* q16 = reinterpret_cast<const bf16*>(qkv_in16);
  if (!qkv_in16) {
    require_aligned("attention_forward", "qkv", qkv);
    require_aligned("attention_forward", "qkv16 (scratch)", qkv16);
    to_bf16(reinterpret_cast<bf16*>(qkv16), qkv, B * T * (NH + 2 * NKV) * HD, stream);
    q16 = reinterpret_cast<const bf16*>(qkv16);
  } else {
    require_aligned("attention_forward", "qkv16", qkv_in16);
  }
  switch (HD) {
    case 16:
      forward_for<16>(out, out16, lse, q16, B, T, NH, NKV, round_bf16, stream);
      break;
    case 32:
      forward_for<32>(out, out16, lse, q16, B, T, NH, NKV, round_bf16, stream);
      break;
    case 64:
      forward_for<64>(out, out16, lse, q16, B, T, NH, NKV, round_bf16, stream);
      break;
    default:
      forward_for<128>(out, out16, lse, q16, B, T, NH, NKV, round_bf16, stream);
      break;
  }
}

// qkv / qkv_in16 and out / out16 as attention_forward_launch's (one of each pair); dqkv or dqkv16.
void attention_backward_launch(float* dqkv, uint16_t* dqkv16, float* dsum, const float* dout,
                               const uint16_t* dout_in16, const float* qkv,
                               const uint16_t* qkv_in16, const float* out, const uint16_t* out16,
                               const float* lse, uint16_t* qkv16, uint16_t* dout16, void* ds,
                               int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HD,
                               bool round_bf16, cudaStream_t stream) {
  attention_check_shape("attention_backward", B, T, NH, NKV, HD);
  if (B * T == 0) return;
  require_aligned("attention_backward", dqkv16 ? "dqkv16" : "dqkv",
                  dqkv16 ? static_cast<const void*>(dqkv16) : dqkv);
  require_aligned("attention_backward", dout_in16 ? "dout16" : "dout",
                  dout_in16 ? static_cast<const void*>(dout_in16) : dout);
  require_aligned("attention_backward", out16 ? "out16" : "out",
                  out16 ? static_cast<const void*>(out16) : out);
  if (!dout_in16) require_aligned("attention_backward", "dout16 (scratch)", dout16);
  const bf16* q16 = reinterpret_cast<const bf16*>(qkv_in16);
  if (!qkv_in16) {
    require_aligned("attention_backward", "qkv", qkv);
    require_aligned("attention_backward", "qkv16 (scratch)", qkv16);
    to_bf16(reinterpret_cast<bf16*>(qkv16), qkv, B * T * (NH + 2 * NKV) * HD, stream);
    q16 = reinterpret_cast<const bf16*>(qkv16);
  } else {
    require_aligned("attention_backward", "qkv16", qkv_in16);
  }
  const bf16* d16 = reinterpret_cast<const bf16*>(dout_in16);
  if (!dout_in16) {
    to_bf16(reinterpret_cast<bf16*>(dout16), dout, B * T * NH * HD, stream);
    d16 = reinterpret_cast<const bf16*>(dout16);
  }
  const bool bits = dout_in16 != nullptr;
  if (ds) require_aligned("attention_backward", "ds (scratch)", ds);
  uint4* ds4 = static_cast<uint4*>(ds);
  switch (HD) {
    case 16:
      backward_for<16>(dqkv, dqkv16, dsum, ds4, dout, d16, bits, q16, out, out16, lse, B, T, NH,
                       NKV, round_bf16, stream);
      break;
    case 32:
      backward_for<32>(dqkv, dqkv16, dsum, ds4, dout, d16, bits, q16, out, out16, lse, B, T, NH,
                       NKV, round_bf16, stream);
      break;
    case 64:
      backward_for<64>(dqkv, dqkv16, dsum, ds4, dout, d16, bits, q16, out, out16, lse, B, T, NH,
                       NKV, round_bf16, stream);
      break;
    default:
      backward_for<128>(dqkv, dqkv16, dsum, ds4, dout, d16, bits, q16, out, out16, lse, B, T, NH,
                        NKV, round_bf16, stream);
      break;
  }
}

namespace {

// The attention kernels take BF16 operands; the unrounded FP32 mode is the emulator's alone.
void require_bf16_attention(const char* op, emu::GemmPrecision prec) {
  if (prec != emu::GemmPrecision::BF16)
    throw std::invalid_argument(std::string(op) +
                                ": GemmPrecision::FP32 (no BF16 operand rounding, for gradient "
                                "checks) is emulator-only; the CUDA kernels take BF16 operands");
}

// The attention backward pass's dS scratch from `scratch`, or null where the dQ kernel recomputes
// dS (attention_ds_scratch_bytes 0).
void* attention_ds_scratch(DeviceScratch& scratch, int64_t B, int64_t T, int64_t NH, int64_t HD,
                           bool recompute_dq, cudaStream_t stream) {
  const int64_t bytes = attention_ds_scratch_bytes(B, T, NH, HD, recompute_dq);
  return bytes > 0 ? scratch.get<uint8_t>(static_cast<size_t>(bytes), stream) : nullptr;
}

}  // namespace

// The checks and the scratch (BF16 copies of the float32 operands the kernels read, the backward
// pass's dS); the kernels run through the launchers above, each view as float32 or BF16 bits.
void CudaBackend::attention_forward(const TensorView& out, const TensorView& lse,
                                    const TensorView& qkv, const AttentionShape& s,
                                    GemmPrecision prec) {
  op_checks::attention_forward(out, lse, qkv, s, prec);
  const int64_t B = s.B, T = s.T, NH = s.NH, NKV = s.NKV, HD = s.HD;
  require_heads("attention_forward", NH, NKV, HD);
  require_bf16_attention("attention_forward", prec);
  attention_check_shape("attention_forward", B, T, NH, NKV, HD);  // before any scratch is sized
  const bool qkv_bits = qkv.dtype == DType::BF16, out_bits = out.dtype == DType::BF16;
  uint16_t* scratch = nullptr;
  if (!qkv_bits) {
    const size_t qkv_n = B > 0 && T > 0 ? static_cast<size_t>(B * T * (NH + 2 * NKV) * HD) : 0;
    scratch = layers_state().att_qkv16.get<uint16_t>(qkv_n, stream_);
  }
  attention_forward_launch(out_bits ? nullptr : out.as<float>(),
                           out_bits ? out.as<uint16_t>() : nullptr, lse.as<float>(),
                           qkv_bits ? nullptr : qkv.as<const float>(),
                           qkv_bits ? qkv.as<const uint16_t>() : nullptr, scratch, B, T, NH, NKV,
                           HD, out.bf16_storage(), stream_);
}

void CudaBackend::attention_backward(const TensorView& dqkv, const TensorView& dout,
                                     const TensorView& qkv, const TensorView& out,
                                     const TensorView& lse, const AttentionShape& s,
                                     GemmPrecision prec) {
  op_checks::attention_backward(dqkv, dout, qkv, out, lse, s, prec);
  const int64_t B = s.B, T = s.T, NH = s.NH, NKV = s.NKV, HD = s.HD;
  require_heads("attention_backward", NH, NKV, HD);
  require_bf16_attention("attention_backward", prec);
  attention_check_shape("attention_backward", B, T, NH, NKV, HD);  // before any scratch is sized
  if (B * T == 0) return;
  auto bits = [](const TensorView& v) { return v.dtype == DType::BF16; };
  LayersState& st = layers_state();
  float* dsum = st.att_dsum.get<float>(static_cast<size_t>(2 * B * NH * T), stream_);
  const size_t bt = static_cast<size_t>(B * T);
  uint16_t* scratch = bits(qkv) ? nullptr
                                : st.att_qkv16.get<uint16_t>(
                                      bt * static_cast<size_t>((NH + 2 * NKV) * HD), stream_);
  uint16_t* dscratch =
      bits(dout) ? nullptr
                 : st.att_dout16.get<uint16_t>(bt * static_cast<size_t>(NH * HD), stream_);
  void* ds =
      attention_ds_scratch(st.att_ds, B, T, NH, HD, options_.attention_recompute_dq, stream_);
  attention_backward_launch(
      bits(dqkv) ? nullptr : dqkv.as<float>(), bits(dqkv) ? dqkv.as<uint16_t>() : nullptr, dsum,
      bits(dout) ? nullptr : dout.as<const float>(),
      bits(dout) ? dout.as<const uint16_t>() : nullptr, bits(qkv) ? nullptr : qkv.as<const float>(),
      bits(qkv) ? qkv.as<const uint16_t>() : nullptr, bits(out) ? nullptr : out.as<const float>(),
      bits(out) ? out.as<const uint16_t>() : nullptr, lse.as<const float>(), scratch, dscratch, ds,
      B, T, NH, NKV, HD, dqkv.bf16_storage(), stream_);
}

}  // namespace fp4sim::gpu
