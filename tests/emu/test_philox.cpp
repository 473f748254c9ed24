// Philox4x32-10 known answers (Random123) and launch-shape independence of the SR bits.
#include <gtest/gtest.h>

#include "emu/philox.hpp"

namespace fp4sim {
namespace {

TEST(Philox, KnownAnswerZero) {
  const Philox4x32 r = philox4x32_10(0, 0, 0, 0, 0, 0);
  EXPECT_EQ(r.v[0], 0x6627e8d5u);
  EXPECT_EQ(r.v[1], 0xe169c58du);
  EXPECT_EQ(r.v[2], 0xbc57ac4cu);
  EXPECT_EQ(r.v[3], 0x9b00dbd8u);
}

TEST(Philox, KnownAnswerAllOnes) {
  const uint32_t f = 0xffffffffu;
  const Philox4x32 r = philox4x32_10(f, f, f, f, f, f);
  EXPECT_EQ(r.v[0], 0x408f276du);
  EXPECT_EQ(r.v[1], 0x41c83b0eu);
  EXPECT_EQ(r.v[2], 0xa20bc7c6u);
  EXPECT_EQ(r.v[3], 0x6d5451fdu);
}

TEST(Philox, ChunkCounterLayout) {
  // (g lo, g hi, stream lo, stream hi), key (seed lo, seed hi)
  const uint64_t seed = 0x0123456789ABCDEFull, stream = 0xFEDCBA9876543210ull, g = 0x100000003ull;
  const Philox4x32 a = sr_chunk_bits(seed, stream, g);
  const Philox4x32 b = philox4x32_10(3, 1, 0x76543210u, 0xFEDCBA98u, 0x89ABCDEFu, 0x01234567u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(a.v[i], b.v[i]);
  // element j uses byte j%4 of word j/4, byte 0 = bits 7..0
  for (int j = 0; j < 16; ++j)
    EXPECT_EQ(sr_byte_for_element(a, j), static_cast<uint8_t>(a.v[j / 4] >> (8 * (j % 4))));
}

// The keyed form (round keys computed once per seed, as the GPU kernels take them) draws the same
// bits, including both known answers and keys whose Weyl steps wrap.
TEST(Philox, KeyedEqualsPlain) {
  const uint32_t f = 0xffffffffu;
  const Philox4x32 z = philox4x32_10_keyed(0, 0, 0, 0, philox_round_keys(0));
  EXPECT_EQ(z.v[0], 0x6627e8d5u);
  const Philox4x32 o = philox4x32_10_keyed(f, f, f, f, philox_round_keys(~0ull));
  EXPECT_EQ(o.v[3], 0x6d5451fdu);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (int trial = 0; trial < 20000; ++trial) {
    auto next = [&x]() {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      return x;
    };
    const uint64_t seed = next(), stream = next(), chunk = trial % 3 == 0 ? next() : next() >> 40;
    const Philox4x32 a = sr_chunk_bits(seed, stream, chunk);
    const Philox4x32 b = sr_chunk_bits_keyed(philox_round_keys(seed), stream, chunk);
    for (int i = 0; i < 4; ++i) ASSERT_EQ(a.v[i], b.v[i]) << "trial " << trial << " word " << i;
  }
}

TEST(Philox, StreamsAndChunksDiffer) {
  const Philox4x32 a = sr_chunk_bits(1, 0, 0), b = sr_chunk_bits(1, 1, 0),
                   c = sr_chunk_bits(1, 0, 1), d = sr_chunk_bits(2, 0, 0);
  EXPECT_NE(a.v[0], b.v[0]);
  EXPECT_NE(a.v[0], c.v[0]);
  EXPECT_NE(a.v[0], d.v[0]);
}

}  // namespace
}  // namespace fp4sim
