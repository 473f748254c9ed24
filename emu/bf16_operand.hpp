// The BF16 operands of the emulator's chained T-FDPA, prepared once: BF16 values as doubles and
// exponent readings for tfdpa_bf16_prepared (emu/tfdpa_prepared.hpp), and the chain over two
// prepared rows.
// Shared by bf16_gemm_tn (emu/matmul.cpp) and attention's row dot products (emu/attention.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "emu/formats.hpp"
#include "emu/mma.hpp"
#include "emu/tfdpa_prepared.hpp"

namespace fp4sim::emu {

// One operand prepared for the chained BF16 T-FDPA: BF16 values as doubles (products exact) and
// exponent readings E(x) = max(floor(log2|x|), -126), a large negative number for zeros so that a
// zero product never sets e_max. Rows padded with zeros to a multiple of 16.
struct Bf16Operand {
  std::vector<float> f;                // BF16 values as floats (for the literal fallback)
  std::vector<double> d;               // the same values as doubles
  std::vector<int32_t> e;              // exponent readings
  std::vector<uint8_t> special_chunk;  // per (row, chunk): a NaN or Inf in it
};

inline Bf16Operand prepare_bf16(const float* x, int64_t rows, int64_t K, int64_t Kp) {
  Bf16Operand o;
  o.f.assign(static_cast<size_t>(rows * Kp), 0.0f);
  o.d.assign(o.f.size(), 0.0);
  o.e.assign(o.f.size(), kBf16ZeroReading);
  o.special_chunk.assign(static_cast<size_t>(rows * (Kp / kBf16FdpaL)), 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const float v = bf16_round(x[r * K + k]);
      const size_t i = static_cast<size_t>(r * Kp + k);
      o.f[i] = v;
      o.d[i] = v;
      const uint32_t u = f32_bits(v) & 0x7FFFFFFFu;
      if (u >= 0x7F800000u)
        o.special_chunk[static_cast<size_t>(r * (Kp / kBf16FdpaL) + k / kBf16FdpaL)] = 1;
      else
        o.e[i] = bf16_exponent_reading(v);
    }
  return o;
}

// The chained T-FDPA of row ra of A and row rb of B (Kp = chunks * 16 prepared values each), from
// +0: the prepared T-FDPA per chunk, the literal one for chunks holding a NaN or Inf.
// (Always inlined: in bf16_gemm_row's AVX-512/AVX2 clones it must be compiled for their target.)
#if defined(__GNUC__)
__attribute__((always_inline))
#endif
inline float
bf16_row_dot(const Bf16Operand& A, int64_t ra, const Bf16Operand& B, int64_t rb, int64_t Kp,
             int64_t chunks) {
  float acc = 0.0f;
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const size_t ia = static_cast<size_t>(ra * Kp + ch * kBf16FdpaL),
                 ib = static_cast<size_t>(rb * Kp + ch * kBf16FdpaL);
    if (A.special_chunk[static_cast<size_t>(ra * chunks + ch)] |
        B.special_chunk[static_cast<size_t>(rb * chunks + ch)]) {
      acc = tfdpa_bf16(&A.f[ia], &B.f[ib], acc);
      continue;
    }
    acc = tfdpa_bf16_prepared(&A.d[ia], &A.e[ia], &B.d[ib], &B.e[ib], &A.f[ia], &B.f[ib], acc);
  }
  return acc;
}

}  // namespace fp4sim::emu
