// The matrices the Newton–Schulz tests share (tests/model/test_optimizer.cpp on the emulator,
// tests/gpu/test_optimizer_gpu.cpp against it): seeded Gaussian values, and a gradient-like matrix.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "tests/emu/test_util.hpp"

namespace fp4sim::model {

// (tests/emu/test_util.hpp's seeded normal values)
inline std::vector<float> ns_randn(size_t n, uint64_t seed, float scale = 1.0f) {
  return test::randn(n, seed, scale);
}

// A gradient-like R x C matrix: three strong directions over N(0, 0.1) noise.
inline std::vector<float> momentum_like(int64_t R, int64_t C, uint64_t seed) {
  std::vector<float> g = ns_randn(static_cast<size_t>(R * C), seed, 0.1f);
  const std::vector<float> u = ns_randn(static_cast<size_t>(R * 3), seed + 1),
                           v = ns_randn(static_cast<size_t>(C * 3), seed + 2);
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j)
      for (int r = 0; r < 3; ++r) g[i * C + j] += u[i * 3 + r] * v[j * 3 + r] / (1.0f + 3.0f * r);
  return g;
}

}  // namespace fp4sim::model
