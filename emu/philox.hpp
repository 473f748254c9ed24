// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"), as cuRAND draws it,
// and the stochastic-rounding bit layout of DESIGN.md §3. Host and device share this code, so the
// bits depend only on (seed, stream, position), never on threads or launch shape.
#pragma once

#include <cstdint>

#include "emu/hd.hpp"

namespace fp4sim {

struct Philox4x32 {
  uint32_t v[4];
};

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;

// counter (c0..c3), key (k0, k1) -> 4 random words.
FP4SIM_HD Philox4x32 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                   uint32_t k1) {
  for (int round = 0; round < kPhiloxRounds; ++round) {
    const uint32_t hi0 = mulhi32(kPhiloxM0, c0);
    const uint32_t lo0 = kPhiloxM0 * c0;
    const uint32_t hi1 = mulhi32(kPhiloxM1, c2);
    const uint32_t lo1 = kPhiloxM1 * c2;
    const uint32_t n0 = hi1 ^ c1 ^ k0;
    const uint32_t n1 = lo1;
    const uint32_t n2 = hi0 ^ c3 ^ k1;
    const uint32_t n3 = lo0;
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  return Philox4x32{{c0, c1, c2, c3}};
}

// The ten round keys of a key (k0, k1): round r adds r Weyl steps. A kernel that draws many
// chunks under one seed passes them in (its parameter space), so each round's key is an operand
// instead of two additions a round and chunk.
struct PhiloxKeys {
  uint32_t k0[kPhiloxRounds], k1[kPhiloxRounds];
};
FP4SIM_HD PhiloxKeys philox_round_keys(uint64_t seed) {
  PhiloxKeys keys{};
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < kPhiloxRounds; ++round) {
    keys.k0[round] = k0;
    keys.k1[round] = k1;
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  return keys;
}
// philox4x32_10 with its round keys given (the same bits).
FP4SIM_HD Philox4x32 philox4x32_10_keyed(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                         const PhiloxKeys& keys) {
  FP4SIM_UNROLL
  for (int round = 0; round < kPhiloxRounds; ++round) {
    const uint32_t hi0 = mulhi32(kPhiloxM0, c0);
    const uint32_t lo0 = kPhiloxM0 * c0;
    const uint32_t hi1 = mulhi32(kPhiloxM1, c2);
    const uint32_t lo1 = kPhiloxM1 * c2;
    c0 = hi1 ^ c1 ^ keys.k0[round];
    c1 = lo1;
    c2 = hi0 ^ c3 ^ keys.k1[round];
    c3 = lo0;
  }
  return Philox4x32{{c0, c1, c2, c3}};
}

// The random bits of one 16-element chunk of a tensor as written (R rows x C columns): chunk index
// g = r*(C/16) + c/16, counter (g lo, g hi, stream lo, stream hi), key = seed.
FP4SIM_HD Philox4x32 sr_chunk_bits(uint64_t seed, uint64_t stream, uint64_t chunk) {
  return philox4x32_10(static_cast<uint32_t>(chunk), static_cast<uint32_t>(chunk >> 32),
                       static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32),
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// sr_chunk_bits with the seed's round keys given (philox_round_keys(seed)).
FP4SIM_HD Philox4x32 sr_chunk_bits_keyed(const PhiloxKeys& keys, uint64_t stream, uint64_t chunk) {
  return philox4x32_10_keyed(static_cast<uint32_t>(chunk), static_cast<uint32_t>(chunk >> 32),
                             static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32),
                             keys);
}

// Which random byte feeds element j (0..15) of a chunk: byte j%4 (byte 0 = bits 7..0) of word j/4.
// The hardware's own alignment for cvt.rs...e2m1x4 is not public; this is the one place to change
// it.
FP4SIM_HD uint8_t sr_byte_for_element(const Philox4x32& bits, int j) {
  return static_cast<uint8_t>(bits.v[j >> 2] >> (8 * (j & 3)));
}

}  // namespace fp4sim
