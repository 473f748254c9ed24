// The CUDA twins of the Mamba-2 core's ops (gpu/ssm.cu) against the emulator, bitwise: the ops
// chained as a Mamba block runs them (tests/emu/ssm_chain.hpp: strided slices of a wider in_proj
// buffer, input gradients written over NaN, parameter gradients added onto 0.25), forward and
// backward, every output compared bit for bit, with and without the BF16 storage marks, on shapes
// with T not a multiple of the chunk or of anything else, one group and several, N below and
// above P. Skips without a GPU.
#include <gtest/gtest.h>

#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "emu/backend.hpp"
#include "emu/formats.hpp"
#include "tests/emu/ssm_chain.hpp"
#include "tests/gpu/gpu_test_util.hpp"
#include "tools/backends.hpp"

namespace fp4sim {
namespace {

#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU: " << gpu_description()

struct Shape {
  const char* name;
  SsmShape s;
  int64_t W;
};

// (B, T, H, P, G, N, chunk)
const Shape kShapes[] = {
    {"small, T 19 over chunks of 5", {2, 19, 4, 8, 2, 8, 5}, 4},
    {"G 3, T 37 over chunks of 16, W 3", {1, 37, 6, 16, 3, 32, 16}, 3},
    {"G 1, P 64, T 130 over chunks of 128", {2, 130, 8, 64, 1, 64, 128}, 4},
    {"G 8, N 128 > P 32, T 77 over chunks of 32", {2, 77, 16, 32, 8, 128, 32}, 4},
};

void expect_bitwise(const test::SsmChainOutputs& emu, const test::SsmChainOutputs& cuda,
                    const std::string& what) {
  ASSERT_EQ(emu.size(), cuda.size());
  for (size_t k = 0; k < emu.size(); ++k) {
    const std::vector<float>& a = emu[k].second;
    const std::vector<float>& b = cuda[k].second;
    ASSERT_EQ(a.size(), b.size()) << emu[k].first;
    size_t differ = 0, first = 0;
    for (size_t i = 0; i < a.size(); ++i)
      if (f32_bits(a[i]) != f32_bits(b[i]) && differ++ == 0) first = i;
    std::printf("[ssm] %-44s %-15s %8zu values: %s\n", what.c_str(), emu[k].first.c_str(), a.size(),
                differ ? "NOT OK" : "OK (bitwise)");
    EXPECT_EQ(differ, 0u) << what << " " << emu[k].first << ": " << differ
                          << " values differ, the first at " << first << " (emu " << a[first]
                          << ", cuda " << b[first] << ")";
  }
}

TEST(SsmGpu, ChainMatchesEmulatorBitwise) {
  REQUIRE_GPU();
  auto emu = make_backend("emu");
  auto cuda = make_backend("cuda");
  for (const Shape& sh : kShapes)
    for (bool marks : {false, true}) {
      test::SsmChainCase c;
      c.s = sh.s;
      c.W = sh.W;
      c.seed = 900 + static_cast<uint64_t>(&sh - kShapes);
      c.bf16_marks = marks;
      const test::SsmChainInputs in = test::ssm_chain_inputs(c);
      expect_bitwise(test::run_ssm_chain(*emu, c, in), test::run_ssm_chain(*cuda, c, in),
                     std::string(sh.name) + (marks ? ", BF16 marks" : ""));
    }
}

// The same call twice gives the same bits (no atomics, no order that depends on scheduling).
TEST(SsmGpu, RepeatsBitwise) {
  REQUIRE_GPU();
  auto cuda = make_backend("cuda");
  test::SsmChainCase c;
  c.s = kShapes[3].s;
  c.seed = 950;
  const test::SsmChainInputs in = test::ssm_chain_inputs(c);
  expect_bitwise(test::run_ssm_chain(*cuda, c, in), test::run_ssm_chain(*cuda, c, in),
                 "cuda twice");
}

// The CUDA conv backward pass keeps a conv width's gradient sums in registers: wider convs are a
// named error, not a wrong answer.
TEST(SsmGpu, WideConvIsANamedError) {
  REQUIRE_GPU();
  auto cuda = make_backend("cuda");
  test::SsmChainCase c;
  c.s = kShapes[0].s;
  c.W = 9;
  const test::SsmChainInputs in = test::ssm_chain_inputs(c);
  try {
    test::run_ssm_chain(*cuda, c, in);
    ADD_FAILURE() << "a conv of width 9 ran";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("conv width 9"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace fp4sim
