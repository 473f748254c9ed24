#include "emu/gemm.hpp"

#include <cmath>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "emu/gst_fdpa_packed.hpp"
#include "emu/tfdpa_prepared.hpp"

namespace fp4sim {

ScaleKind scale_kind_of(QFormat f) {
  return f == QFormat::MXFP4 ? ScaleKind::UE8M0_32 : ScaleKind::UE4M3_16;
}

void validate_gemm(const QuantizedView& a, const QuantizedView& b, const TensorView* c,
                   const GemmConfig& cfg, const TensorView& d) {
  auto fail = [](const std::string& m) { throw std::invalid_argument("gemm: " + m); };
  if (a.cols != b.cols)
    fail("K differs: A is " + shape_str(a.rows, a.cols) + " and B is " + shape_str(b.rows, b.cols) +
         " (D = A * B^T needs A [M, K] and B [N, K])");
  if (a.format != b.format)
    fail(std::string("A is ") + qformat_name(a.format) + " but B is " + qformat_name(b.format));
  if (a.rows <= 0 || b.rows <= 0 || a.cols <= 0) fail("empty operand");
  if (a.cols % a.block() != 0)
    fail("K = " + std::to_string(a.cols) + " is not a multiple of the " + qformat_name(a.format) +
         " block (" + std::to_string(a.block()) + ")");
  const bool fp8 = a.format == QFormat::FP8;
  const int64_t chunks = fp8 ? a.cols / kFp8Block : gemm_chunks(a.cols);
  if (cfg.split_k < 1 || chunks % cfg.split_k != 0)
    fail("--split-k " + std::to_string(cfg.split_k) + " must divide the " + std::to_string(chunks) +
         (fp8 ? " 128-wide K blocks" : " 64-wide K chunks"));
  if (cfg.beta != 0.0f && !c) fail("--beta needs C (--c)");
  if (c && (c->rows != a.rows || c->cols != b.rows || c->dtype != DType::F32))
    fail("C must be float32 " + shape_str(a.rows, b.rows) + ", got " + dtype_name(c->dtype) + " " +
         shape_str(c->rows, c->cols));
  const DType want = cfg.out == GemmOut::BF16 ? DType::BF16 : DType::F32;
  if (d.rows != a.rows || d.cols != b.rows || d.dtype != want)
    fail("D must be " + std::string(dtype_name(want)) + " " + shape_str(a.rows, b.rows));
}

}  // namespace fp4sim

namespace fp4sim {
namespace {

// One operand pre-decoded for integer group sums: per row and 64-wide chunk, 2*e2m1 as int8 (zero
// padded), the sign and nonzero bits, and the four groups' decoded scales.
struct DecodedOperand {
  int64_t rows = 0, chunks = 0;
  std::vector<int8_t> twice;            // [rows][chunks*64]
  std::vector<uint64_t> sign, nonzero;  // [rows][chunks]
  std::vector<uint32_t> scales;         // [rows][chunks][4], pack_scale(decode_scale(byte))
  // the same scales unpacked for gst_fdpa_core_lean: significand (0 for a zero scale), exponent
  // reading; nan_chunk: a NaN scale among the chunk's four (the lean core does not take those)
  std::vector<int32_t> sig, exp;   // [rows][chunks][4]
  std::vector<uint8_t> nan_chunk;  // [rows][chunks]
};

DecodedOperand decode_operand(const QuantizedView& q) {
  DecodedOperand d;
  d.rows = q.rows;
  d.chunks = gemm_chunks(q.cols);
  const int64_t kp = d.chunks * kGemmChunk, block = q.block(), spr = q.cols / block;
  const ScaleKind kind = scale_kind_of(q.format);
  d.twice.assign(static_cast<size_t>(d.rows * kp), 0);
  d.sign.assign(static_cast<size_t>(d.rows * d.chunks), 0);
  d.nonzero.assign(static_cast<size_t>(d.rows * d.chunks), 0);
  d.scales.resize(static_cast<size_t>(d.rows * d.chunks * kGstGroups));
  d.sig.resize(d.scales.size());
  d.exp.resize(d.scales.size());
  d.nan_chunk.assign(static_cast<size_t>(d.rows * d.chunks), 0);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < d.rows; ++r) {
    for (int64_t ch = 0; ch < d.chunks; ++ch) {
      uint64_t sign = 0, nz = 0;
      for (int k = 0; k < kGemmChunk; ++k) {
        const int64_t kk = ch * kGemmChunk + k;
        uint8_t code = 0;
        if (kk < q.cols) {
          const int64_t e = r * q.cols + kk;
          code = (q.codes[e / 2] >> (4 * (e & 1))) & 0xFu;
        }
        d.twice[r * kp + kk] = static_cast<int8_t>(e2m1_twice(code));
        sign |= static_cast<uint64_t>(code >> 3) << k;
        nz |= static_cast<uint64_t>((code & 7u) != 0) << k;
      }
      d.sign[r * d.chunks + ch] = sign;
      d.nonzero[r * d.chunks + ch] = nz;
      for (int g = 0; g < kGstGroups; ++g) {
        const int64_t kk = ch * kGemmChunk + g * kGstGroup;
        const uint8_t byte = kk < q.cols ? q.scales[r * spr + kk / block] : 0;  // padding: 0x00
        const DecodedScale ds = decode_scale(byte, kind);
        const size_t i = static_cast<size_t>((r * d.chunks + ch) * kGstGroups + g);
        d.scales[i] = pack_scale(ds);
        d.sig[i] = ds.zero ? 0 : static_cast<int32_t>(ds.sig);
        d.exp[i] = ds.exp;
        if (ds.nan) d.nan_chunk[static_cast<size_t>(r * d.chunks + ch)] = 1;
      }
    }
  }
  return d;
}

}  // namespace

namespace {

// FP8 (DESIGN.md §9): per 128-wide k-block, four chained Hopper FP8 T-FDPAs (L = 32, F = 13, E8M13
// RZ; the host's prepared evaluation, the literal one for groups with a NaN code) from +0, then t =
// s_a * s_b (RN) and acc = fmaf(t, partial, acc), the promotion of Hopper FP8 kernels (one FMA).
// Split-K ranges of k-blocks are added in order (RN).
void gemm_exact_fp8_host(const QuantizedView& a, const QuantizedView& b, const float* c,
                         const GemmConfig& cfg, void* out) {
  const int64_t M = a.rows, N = b.rows, K = a.cols, kb = K / kFp8Block;
  // operands decoded once: values (float and double), exponent readings, NaN codes per 32-group
  struct Decoded {
    std::vector<float> f;
    std::vector<double> d;
    std::vector<int32_t> e;
    std::vector<uint8_t> group_nan;
  };
  auto decode = [K](const QuantizedView& q) {
    Decoded o;
    const size_t n = static_cast<size_t>(q.rows * K);
    o.f.resize(n);
    o.d.resize(n);
    o.e.resize(n);
    o.group_nan.assign(n / kFp8FdpaL, 0);
    for (size_t i = 0; i < n; ++i) {
      o.f[i] = e4m3_to_f32(q.codes[i]);
      o.d[i] = o.f[i];
      if (f32_isnan(o.f[i]))
        o.group_nan[i / kFp8FdpaL] = 1;
      else
        o.e[i] = e4m3_exponent_reading(o.f[i]);
    }
    return o;
  };
  const Decoded da = decode(a), db = decode(b);
  auto scale = [](const QuantizedView& q, int64_t r, int64_t blk) {
    float s;
    std::memcpy(&s, q.scales + 4 * (r * (q.cols / kFp8Block) + blk), 4);
    return s;
  };
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      const float total = split_k_chain(cfg.split_k, kb, [&](int64_t blk, float acc) {
        float partial = 0.0f;
        for (int64_t k0 = blk * kFp8Block; k0 < (blk + 1) * kFp8Block; k0 += kFp8FdpaL) {
          const size_t ia = static_cast<size_t>(m * K + k0), ib = static_cast<size_t>(n * K + k0);
          partial =
              (da.group_nan[ia / kFp8FdpaL] || db.group_nan[ib / kFp8FdpaL])
                  ? tfdpa_fp8_hopper(&da.f[ia], &db.f[ib], partial, kE4M3Operand, kE4M3Operand)
                  : tfdpa_fp8_hopper_prepared(&da.d[ia], &da.e[ia], &db.d[ib], &db.e[ib], &da.f[ia],
                                              &db.f[ib], partial);
        }
        return std::fmaf(fmul_rn(scale(a, m, blk), scale(b, n, blk)), partial, acc);
      });
      gemm_store(cfg, cfg.alpha, total, c, m * N + n, out);
    }
  }
}

}  // namespace

// out (F32 or BF16 bits) [M, N], row-major. Readable structure: for each output, the chunks of
// each split-K range in increasing k, GST-FDPA chained through the accumulator.
void gemm_exact_host(const QuantizedView& a, const QuantizedView& b, const float* c,
                     const GemmConfig& cfg, void* out) {
  if (a.format == QFormat::FP8) {
    gemm_exact_fp8_host(a, b, c, cfg, out);
    return;
  }
  const DecodedOperand da = decode_operand(a), db = decode_operand(b);
  const int64_t M = a.rows, N = b.rows, chunks = da.chunks, kp = chunks * kGemmChunk;
  const int man_bits = scale_kind_of(a.format) == ScaleKind::UE4M3_16 ? 3 : 0;
  const float alpha =
      gemm_epilogue_alpha(cfg.alpha, a.format, *a.amax, a.four_over_six, *b.amax, b.four_over_six);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      const float total = split_k_chain(cfg.split_k, chunks, [&](int64_t ch, float acc) {
        const int8_t* x = &da.twice[m * kp + ch * kGemmChunk];
        const int8_t* y = &db.twice[n * kp + ch * kGemmChunk];
        const uint64_t both_nz = da.nonzero[m * chunks + ch] & db.nonzero[n * chunks + ch];
        const uint64_t neg = da.sign[m * chunks + ch] ^ db.sign[n * chunks + ch];
        int32_t p4[kGstGroups];
        uint32_t all_zero = 0, all_neg_zero = 0;
        for (int g = 0; g < kGstGroups; ++g) {
          p4[g] = 0;
          for (int i = 0; i < kGstGroup; ++i)
            p4[g] += static_cast<int32_t>(x[g * kGstGroup + i]) * y[g * kGstGroup + i];
          const uint64_t mask = 0xFFFFull << (g * kGstGroup);
          const bool zero = (both_nz & mask) == 0;
          all_zero |= (zero ? 1u : 0u) << g;
          all_neg_zero |= (zero && (neg & mask) == mask ? 1u : 0u) << g;
        }
        const size_t sa = static_cast<size_t>((m * chunks + ch) * kGstGroups),
                     sb = static_cast<size_t>((n * chunks + ch) * kGstGroups);
        uint32_t bits;
        if (!(da.nan_chunk[static_cast<size_t>(m * chunks + ch)] |
              db.nan_chunk[static_cast<size_t>(n * chunks + ch)]) &&
            gst_fdpa_core_lean(p4, &da.sig[sa], &da.exp[sa], &db.sig[sb], &db.exp[sb], all_zero,
                               man_bits, acc, &bits))
          return f32_from_bits(bits);
        return f32_from_bits(gst_fdpa_core_packed_bits(p4, all_zero, all_neg_zero, &da.scales[sa],
                                                       &db.scales[sb], man_bits, acc));
      });
      gemm_store(cfg, alpha, total, c, m * N + n, out);
    }
  }
}

}  // namespace fp4sim
