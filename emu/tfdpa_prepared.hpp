// T-FDPA (DESIGN.md §7) for the emulator's BF16 and FP8 GEMMs, on the host only: the bits of
// emu/mma.hpp's tfdpa_bf16 and tfdpa_fp8_hopper, computed from operands prepared once per matrix
// (values as doubles and their exponent readings) with the products and truncations in double and
// the sum in int64, in loops the compiler vectorises. Each falls back to the readable function for
// special values and an exactly zero sum. tests/emu/test_mma.cpp and tests/emu/test_fp8.cpp hold
// them equal to the readable functions on millions of random cases.
#pragma once

#if defined(__CUDACC__)
#error "emu/tfdpa_prepared.hpp is host code (OpenMP SIMD loops): device code uses emu/mma.hpp"
#endif

#include <cmath>
#include <cstdint>

#include "emu/hd.hpp"
#include "emu/mma.hpp"

namespace fp4sim {

// The BF16 T-FDPA (L = 16, F = 25, RZ) evaluated with doubles, for the host's emulated BF16 GEMMs:
// each product of two BF16 values is exact in double; scaling by 2^-(e_max - 25) and truncation
// toward zero (the int64 conversion) give the truncated terms exactly; their sum (< 2^32 grid
// units) is exact in int64; the final RZ to FP32 steps the nearest float toward zero when it
// overshoots. Special values, and an exactly zero sum (whose sign has its own rule), take the
// literal path. Equal to tfdpa_bf16 on every input (tests/emu/test_mma.cpp checks millions of
// random cases).
//
// The operands come prepared: values as doubles (ad, bd), exponent readings E(x) =
// max(floor(log2|x|), -126) with kBf16ZeroReading for zeros (ae, be_), and the floats (af, bf) for
// the literal path. The caller guarantees no NaN/Inf among the 16 + 16 operands.
constexpr int32_t kBf16ZeroReading = -100000;

inline int32_t bf16_exponent_reading(float x) {
  const uint32_t u = f32_bits(x) & 0x7FFFFFFFu;
  if (u == 0) return kBf16ZeroReading;
  return (u >> 23) ? static_cast<int32_t>(u >> 23) - 127 : kFp32Emin;
}

inline float tfdpa_bf16_prepared(const double* ad, const int32_t* ae, const double* bd,
                                 const int32_t* be_, const float* af, const float* bf, float c) {
  const uint32_t uc = f32_bits(c) & 0x7FFFFFFFu;
  if (uc >= 0x7F800000u) return tfdpa_bf16(af, bf, c);  // an Inf/NaN accumulator: the literal rules
  int32_t e_max = kTfdpaZeroExp;
  for (int k = 0; k < kBf16FdpaL; ++k) {
    const int32_t e = ae[k] + be_[k];
    e_max = e > e_max ? e : e_max;
  }
  if (uc != 0) {
    const int32_t ec = bf16_exponent_reading(c);
    e_max = ec > e_max ? ec : e_max;
  }
  const int grid = e_max - kBf16FdpaF;
  // each term below 2^27 grid units: truncation toward zero is the int64 conversion (exact), and
  // the sum of 17 terms is exact in int64 (faster than std::trunc, a libm call without SSE4.1)
  // (terms first, then their sum: two simple loops the compiler vectorises where the CPU can
  // convert doubles to int64 in vector registers)
  const double down = pow2_double(-grid);
  int64_t terms[kBf16FdpaL];
#pragma omp simd
  for (int k = 0; k < kBf16FdpaL; ++k) terms[k] = static_cast<int64_t>(ad[k] * bd[k] * down);
  int64_t sum = static_cast<int64_t>(static_cast<double>(c) * down);
#pragma omp simd reduction(+ : sum)
  for (int k = 0; k < kBf16FdpaL; ++k) sum += terms[k];
  if (sum == 0) return tfdpa_bf16(af, bf, c);                         // the signed-zero rule
  const double exact = static_cast<double>(sum) * pow2_double(grid);  // exact: |sum| < 2^32
  if (std::fabs(exact) >= 0x1p128) return exact > 0 ? INFINITY : -INFINITY;
  return double_to_f32_rz(exact);
}

// The Hopper FP8 T-FDPA (L = 32, F = 13, RZ to E8M13) the same way, for the host's FP8 GEMM:
// products of E4M3 values are exact in double, every truncated term is below 2^15 grid units and
// their sum below 2^21, so the sum is exact; the RZ to 13 fraction bits is round_rz_to_f32_bits.
// Operands prepared as above with E4M3's emin (-6) and kFp8ZeroReading for zeros; the caller
// guarantees no NaN among the operands (E4M3 has no Inf). A non-finite C and an exactly zero sum
// take the literal path. Equal to tfdpa_fp8_hopper (tests/emu/test_fp8.cpp).
constexpr int32_t kFp8ZeroReading = -100000;
inline int32_t e4m3_exponent_reading(float x) {
  const uint32_t u = f32_bits(x) & 0x7FFFFFFFu;
  if (u == 0) return kFp8ZeroReading;
  const int fl = static_cast<int>(u >> 23) - 127;  // E4M3 values are FP32 normals
  return fl < kE4M3Operand.emin ? kE4M3Operand.emin : fl;
}

inline float tfdpa_fp8_hopper_prepared(const double* ad, const int32_t* ae, const double* bd,
                                       const int32_t* be_, const float* af, const float* bf,
                                       float c) {
  const uint32_t uc = f32_bits(c) & 0x7FFFFFFFu;
  if (uc >= 0x7F800000u) return tfdpa_fp8_hopper(af, bf, c, kE4M3Operand, kE4M3Operand);
  int32_t e_max = kTfdpaZeroExp;
  for (int k = 0; k < kFp8FdpaL; ++k) {
    const int32_t e = ae[k] + be_[k];
    e_max = e > e_max ? e : e_max;
  }
  if (uc != 0) {
    const int32_t ec = bf16_exponent_reading(c);  // max(floor(log2|c|), -126)
    e_max = ec > e_max ? ec : e_max;
  }
  const int grid = e_max - kFp8HopperF;
  const double down = pow2_double(-grid);  // terms below 2^15 grid units: int64 truncation is exact
  int64_t sum = static_cast<int64_t>(static_cast<double>(c) * down);
  for (int k = 0; k < kFp8FdpaL; ++k) sum += static_cast<int64_t>(ad[k] * bd[k] * down);
  if (sum == 0)
    return tfdpa_fp8_hopper(af, bf, c, kE4M3Operand, kE4M3Operand);  // the signed-zero rule
  const bool neg = sum < 0;
  return f32_from_bits(
      round_rz_to_f32_bits(static_cast<uint64_t>(neg ? -sum : sum), grid, neg, kE8M13ManBits));
}

// The same for one chunk of plain floats (BF16 values): prepares the operands, then as above.
inline float tfdpa_bf16_host(const float* a, const float* b, float c) {
  double ad[kBf16FdpaL], bd[kBf16FdpaL];
  int32_t ae[kBf16FdpaL], be_[kBf16FdpaL];
  for (int k = 0; k < kBf16FdpaL; ++k) {
    if (f32_isnan(a[k]) || f32_isinf(a[k]) || f32_isnan(b[k]) || f32_isinf(b[k]))
      return tfdpa_bf16(a, b, c);
    ad[k] = a[k];
    bd[k] = b[k];
    ae[k] = bf16_exponent_reading(a[k]);
    be_[k] = bf16_exponent_reading(b[k]);
  }
  return tfdpa_bf16_prepared(ad, ae, bd, be_, a, b, c);
}

}  // namespace fp4sim
