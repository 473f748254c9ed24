#include "emu/workspace.hpp"

#include <algorithm>

#include "emu/gemm.hpp"
#include "emu/mma.hpp"
#include "emu/quant_stats.hpp"

namespace fp4sim::emu::workspace {

namespace {

constexpr int64_t kF32 = sizeof(float);

// prepare_bf16 (emu/bf16_operand.hpp): rows x Kp floats, doubles and int32 exponent readings, and
// one flag byte a 16-chunk.
int64_t prepared_bf16(int64_t rows, int64_t Kp) {
  return rows * Kp * (kF32 + static_cast<int64_t>(sizeof(double)) + 4) + rows * (Kp / kBf16FdpaL);
}

// head_operand (emu/attention.cpp): the (T, HD) rows and their transpose, and the prepared rows for
// the BF16 row-by-row dot products.
int64_t head_operand(int64_t T, int64_t HD, bool bf16) {
  return 2 * T * HD * kF32 + (bf16 && HD % kBf16FdpaL == 0 ? prepared_bf16(T, HD) : 0);
}

// bias_as_added (emu/cpu_backend_ops.cpp): the bias read as float32, then its BF16 rounding copied
// where the output is stored as BF16.
int64_t bias_copy(const TensorView& bias, bool bf16_out) {
  if (!bias.present()) return 0;
  const int64_t r = read_copy(bias);
  return r > 0 || bf16_out ? bias.numel() * kF32 : 0;
}

}  // namespace

int64_t read_copy(const TensorView& v) {
  return v.present() && v.bf16_storage() ? v.numel() * kF32 : 0;
}

int64_t target_copy(const TensorView& v) {
  return v.present() && v.dtype == DType::BF16 ? v.numel() * kF32 : 0;
}

int64_t gemm_tn(int64_t M, int64_t N, int64_t K, GemmPrecision prec) {
  if (prec != GemmPrecision::BF16) return 0;
  const int64_t Kp = (K + kBf16FdpaL - 1) / kBf16FdpaL * kBf16FdpaL;
  return prepared_bf16(M, Kp) + prepared_bf16(N, Kp);
}

int64_t norm_forward(const TensorView& out) { return target_copy(out); }
int64_t norm_backward(const TensorView& dout) { return read_copy(dout); }

int64_t matmul_forward(const TensorView& out, const TensorView& inp, const TensorView& weight,
                       const TensorView& bias, GemmPrecision prec) {
  const int64_t N = inp.rows, K = inp.cols, OC = weight.rows;
  return target_copy(out) + read_copy(inp) + read_copy(weight) +
         bias_copy(bias, out.bf16_storage()) + gemm_tn(N, OC, K, prec);
}

int64_t matmul_backward(const TensorView& dinp, const TensorView& dweight, const TensorView& dout,
                        const TensorView& inp, const TensorView& weight, GemmPrecision prec) {
  const int64_t N = dout.rows, OC = dout.cols, K = weight.cols;
  // (emu::matmul_backward: W transposed for the Dgrad, freed before the Wgrad's transposes)
  const int64_t dgrad = dinp.present() ? K * OC * kF32 + gemm_tn(N, K, OC, prec) : 0;
  const int64_t wgrad =
      dweight.present() ? (OC * N + K * N + OC * K) * kF32 + gemm_tn(OC, K, N, prec) : 0;
  return target_copy(dinp) + read_copy(dout) + read_copy(inp) + read_copy(weight) +
         std::max(dgrad, wgrad);
}

int64_t bias_forward(const TensorView& out, const TensorView& bias) {
  return bias_copy(bias, out.bf16_storage());
}

int64_t attention_forward(const TensorView& out, const TensorView& qkv, const AttentionShape& s,
                          GemmPrecision prec, int threads) {
  const bool bf16 = prec == GemmPrecision::BF16;
  const int64_t per_iteration = 3 * head_operand(s.T, s.HD, bf16) + 2 * s.T * kF32;
  return target_copy(out) + read_copy(qkv) +
         std::min<int64_t>(std::max(threads, 1), s.B * s.NH) * per_iteration;
}

int64_t attention_backward(const TensorView& dqkv, const TensorView& dout, const TensorView& qkv,
                           const TensorView& out, const AttentionShape& s, GemmPrecision prec,
                           int threads) {
  const bool bf16 = prec == GemmPrecision::BF16;
  const int64_t group = s.NKV > 0 ? s.NH / s.NKV : 0;
  // one (b, KV head) an iteration: its k and v, the group's P and dS (group x T x T each), one ds
  // row, and the group's q and dout heads
  const int64_t per_iteration = 2 * head_operand(s.T, s.HD, bf16) + 2 * group * s.T * s.T * kF32 +
                                s.T * kF32 + 2 * group * head_operand(s.T, s.HD, bf16);
  return target_copy(dqkv) + read_copy(dout) + read_copy(qkv) + read_copy(out) +
         std::min<int64_t>(std::max(threads, 1), s.B * s.NKV) * per_iteration;
}

int64_t activation_backward(const TensorView& dout) { return read_copy(dout); }
int64_t residual_forward(const TensorView& b) { return read_copy(b); }

int64_t crossentropy(const TensorView& dlogits, const TensorView& logits) {
  return target_copy(dlogits) + (logits.dtype == DType::BF16 ? logits.numel() * kF32 : 0);
}

int64_t quantize(const TensorView& x, const QuantizeConfig& cfg) {
  const int64_t copy = x.dtype == DType::F32 && x.dense() ? 0 : x.numel() * kF32;
  return copy + (cfg.columnwise.enabled ? x.numel() * kF32 : 0);
}

int64_t quant_error_sums(const QuantizedView& q) {
  return q.rows * static_cast<int64_t>(sizeof(QuantErrorSums));
}

int64_t gemm(const QuantizedView& a, const QuantizedView& b) {
  auto decoded = [](const QuantizedView& q) {
    if (q.format == QFormat::FP8)  // (float, double, int32 a value; a NaN flag a 32-group)
      return q.rows * q.cols * (kF32 + static_cast<int64_t>(sizeof(double)) + 4) +
             q.rows * q.cols / kFp8FdpaL;
    // decode_operand: int8 codes (K padded to 64), sign and nonzero words, four scales as packed,
    // significand and exponent readings, a NaN flag a chunk
    const int64_t chunks = gemm_chunks(q.cols);
    return q.rows * chunks * kGemmChunk + q.rows * chunks * 16 + q.rows * chunks * kGstGroups * 12 +
           q.rows * chunks;
  };
  return decoded(a) + decoded(b);
}

void fail(const char* op, const char* tensor, int64_t bytes) {
  throw AllocationError("cannot allocate the workspace of emu " + std::string(op) + " on '" +
                            (tensor ? tensor : "?") + "' (" +
                            bytes_text(static_cast<uint64_t>(std::max<int64_t>(bytes, 0))) +
                            ", emu/workspace.hpp) in host memory: out of host memory "
                            "(std::bad_alloc)",
                        static_cast<size_t>(std::max<int64_t>(bytes, 0)));
}

// (emu/ssm.cpp: each OpenMP thread's vectors live at once; the channel blocks of the parameter
// sums are 64 wide)
namespace {
constexpr int64_t kSsmChannelBlock = 64;
int64_t thread_count(int threads, int64_t items) {
  return std::max<int64_t>(1, std::min<int64_t>(std::max(threads, 1), items));
}
}  // namespace

int64_t ssm_conv_forward(const SsmShape& s, int64_t W, int threads) {
  const int64_t C = s.xbc_cols();
  return (W * C + std::max(threads, 1) * C) * kF32;
}

int64_t ssm_conv_backward(const SsmShape& s, int64_t W, int threads) {
  const int64_t C = s.xbc_cols();
  const int64_t blocks = (C + kSsmChannelBlock - 1) / kSsmChannelBlock;
  return (W * C + s.B * s.T * C + std::max(threads, 1) * C +
          thread_count(threads, blocks) * (W + 1) * kSsmChannelBlock) *
         kF32;
}

int64_t ssm_scan_forward(const SsmShape& s, int threads) {
  return thread_count(threads, s.B * s.H) * s.P * s.N * kF32;
}

int64_t ssm_scan_backward(const SsmShape& s, int threads) {
  // CpuBackend's ddt and dA; the per-(b, h) sums; each (b, g) iteration's chunk states, decays,
  // state gradient and three N-vectors
  const int64_t per_iteration = (s.chunk + 1) * s.P * s.N + s.chunk + s.P * s.N + 3 * s.N;
  return (s.B * s.T * s.H + s.H + 2 * s.B * s.H +
          thread_count(threads, s.B * s.G) * per_iteration) *
         kF32;
}

int64_t gated_norm_forward(int64_t C, int64_t G, int threads) {
  return std::max(threads, 1) * (C / std::max<int64_t>(G, 1)) * kF32;
}

int64_t gated_norm_backward(const TensorView& dout, int64_t G, int threads) {
  const int64_t N = dout.rows, C = dout.cols;
  const int64_t blocks = (C + kSsmChannelBlock - 1) / kSsmChannelBlock;
  return read_copy(dout) + N * C * kF32 +
         std::max(threads, 1) * 3 * (C / std::max<int64_t>(G, 1)) * kF32 +
         thread_count(threads, blocks) * kSsmChannelBlock * kF32;
}

}  // namespace fp4sim::emu::workspace
