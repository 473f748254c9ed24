// Shared helpers for the emulator tests: bit views and adversarial fills.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "emu/formats.hpp"

namespace fp4sim::test {

inline uint32_t bits(float x) { return f32_bits(x); }
inline float from_bits(uint32_t u) { return f32_from_bits(u); }

// Fills used by every quantizer test: each forces a different corner of the algorithm.
enum class Fill {
  Gaussian,     // ordinary data
  HeavyTailed,  // log-normal spread: many scales, underflowing blocks
  Zeros,        // all +0
  SignedZeros,  // ±0 mixed
  AllEqual,     // one value everywhere
  Specials,     // NaN, ±Inf sprinkled into gaussian data
  Subnormal,    // FP32 subnormals and tiny normals
  Ties,         // values whose scaled images land exactly on E2M1 rounding midpoints
  Boundaries,   // one ulp either side of E2M1 / E4M3 midpoints after scaling
  HugeTiny,     // 1e30 next to 1e-30
};

inline const char* fill_name(Fill f) {
  switch (f) {
    case Fill::Gaussian:
      return "gaussian";
    case Fill::HeavyTailed:
      return "heavy_tailed";
    case Fill::Zeros:
      return "zeros";
    case Fill::SignedZeros:
      return "signed_zeros";
    case Fill::AllEqual:
      return "all_equal";
    case Fill::Specials:
      return "specials";
    case Fill::Subnormal:
      return "subnormal";
    case Fill::Ties:
      return "ties";
    case Fill::Boundaries:
      return "boundaries";
    case Fill::HugeTiny:
      return "huge_tiny";
  }
  return "?";
}

inline const std::vector<Fill>& all_fills() {
  static const std::vector<Fill> f = {
      Fill::Gaussian, Fill::HeavyTailed, Fill::Zeros, Fill::SignedZeros, Fill::AllEqual,
      Fill::Specials, Fill::Subnormal,   Fill::Ties,  Fill::Boundaries,  Fill::HugeTiny};
  return f;
}

inline std::vector<float> make_fill(Fill f, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 1 << 30);
  std::vector<float> v(n);
  const float grid[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 0.5f, 1.0f, 6.0f};
  for (size_t i = 0; i < n; ++i) {
    float x = normal(rng);
    switch (f) {
      case Fill::Gaussian:
        break;
      case Fill::HeavyTailed:
        x *= std::exp(3.0f * normal(rng));
        break;
      case Fill::Zeros:
        x = 0.0f;
        break;
      case Fill::SignedZeros:
        x = (pick(rng) & 1) ? -0.0f : 0.0f;
        break;
      case Fill::AllEqual:
        x = 0.3f;
        break;
      case Fill::Specials: {
        const int k = pick(rng) % 23;
        if (k == 0) x = std::numeric_limits<float>::quiet_NaN();
        if (k == 1) x = from_bits(0xFFC00001u);  // negative NaN with payload
        if (k == 2) x = std::numeric_limits<float>::infinity();
        if (k == 3) x = -std::numeric_limits<float>::infinity();
        break;
      }
      case Fill::Subnormal:
        x = from_bits(static_cast<uint32_t>(pick(rng)) & 0x00FFFFFFu) *
            ((pick(rng) & 1) ? -1.0f : 1.0f);
        break;
      case Fill::Ties: {
        // every 16th element is 6.0 so that amax_b * enc maps near 6; the rest sit on midpoints
        x = (i % 16 == 0) ? 6.0f : grid[pick(rng) % 10] * ((pick(rng) & 1) ? -1.0f : 1.0f);
        break;
      }
      case Fill::Boundaries: {
        const float g = (i % 16 == 0) ? 6.0f : grid[pick(rng) % 7];
        const int d = pick(rng) % 3;
        x = d == 0 ? g : from_bits(bits(g) + (d == 1 ? 1u : static_cast<uint32_t>(-1)));
        break;
      }
      case Fill::HugeTiny:
        x = (pick(rng) & 1) ? 1e30f * x : 1e-30f * x;
        break;
    }
    v[i] = x;
  }
  return v;
}

// n seeded normal (mean 0, standard deviation scale) or uniform [lo, hi) FP32 values
// (std::mt19937_64 with the standard library's distributions).
inline std::vector<float> randn(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}
inline std::vector<float> uniform(size_t n, uint64_t seed, float lo, float hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

}  // namespace fp4sim::test
