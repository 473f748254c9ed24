// The emulator's arithmetic must be IEEE binary32 with subnormals (DESIGN.md §1). A library loaded
// into the process may leave flush-to-zero / denormals-are-zero set in MXCSR (some math libraries
// and fast-math builds do); these helpers clear them on the calling thread and on every OpenMP
// worker before the emulator computes. Defensive: the one FTZ-like mismatch seen so far (GPU host,
// 2026-11-29) turned out to be g++ 13 folding the S_enc overflow test, fixed in quantize_block.hpp.
#pragma once

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace fp4sim::emu {

constexpr unsigned kMxcsrFlushToZero = 0x8000u;
constexpr unsigned kMxcsrDenormalsAreZero = 0x0040u;

// Clears FTZ and DAZ on this thread; returns true when either was set.
inline bool clear_flush_to_zero() {
#if defined(__SSE__) || defined(__x86_64__)
  const unsigned csr = _mm_getcsr();
  const unsigned bad = csr & (kMxcsrFlushToZero | kMxcsrDenormalsAreZero);
  if (bad) _mm_setcsr(csr & ~bad);
  return bad != 0;
#else
  return false;
#endif
}

// On this thread and on every OpenMP worker (workers persist, so the setting sticks).
inline void require_ieee_fp_env() {
  clear_flush_to_zero();
#pragma omp parallel
  { clear_flush_to_zero(); }
}

}  // namespace fp4sim::emu
