// Quantizer checks shared by the emulator and GPU tests: two quantized copies equal bit for bit
// (with the first differing byte named), and a property the recipes rely on (model/linear.cpp makes
// a tensor's row-wise and column-wise copies in one quantize call when it can): both copies from
// one call equal each copy from its own call, on any backend. And the quantization statistics'
// error sums against a reference written from the dequantized copy.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "emu/backend.hpp"
#include "tests/emu/test_util.hpp"

namespace fp4sim::test {

// The combinations the recipes request in one call: x (Fprop RN + Wgrad RHT), dy (Dgrad SR +
// Wgrad RHT SR), 2D weights, Four Over Six, MXFP4 with RHT and SR, FP8 1x128 and 128x128.
inline std::vector<std::pair<std::string, QuantizeConfig>> copy_pair_configs() {
  std::vector<std::pair<std::string, QuantizeConfig>> out;
  QuantizeConfig base;
  base.rowwise.enabled = base.columnwise.enabled = true;
  base.seed = 77;
  base.rowwise.stream = 5;
  base.columnwise.stream = 6;
  QuantizeConfig c = base;
  c.columnwise.rht = true;
  out.emplace_back("nvfp4 x: row RN, col RHT", c);
  c.rowwise.rounding = c.columnwise.rounding = Rounding::SR;
  out.emplace_back("nvfp4 dy: row SR, col RHT SR", c);
  c = base;
  c.block_2d = true;
  out.emplace_back("nvfp4 2D weight", c);
  c = base;
  c.rowwise.four_over_six = c.columnwise.four_over_six = true;
  out.emplace_back("nvfp4 Four Over Six", c);
  c = base;
  c.format = QFormat::MXFP4;
  c.columnwise.rht = true;
  c.columnwise.rounding = Rounding::SR;
  out.emplace_back("mxfp4 row RN, col RHT SR", c);
  c = base;
  c.format = QFormat::FP8;
  out.emplace_back("fp8 1x128", c);
  c.block_2d = true;
  out.emplace_back("fp8 128x128", c);
  return out;
}

inline std::string first_diff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (a[i] != b[i]) {
      char buf[96];
      std::snprintf(buf, sizeof buf, "first difference at byte %zu: 0x%02X vs 0x%02X", i, a[i],
                    b[i]);
      return buf;
    }
  return "sizes differ: " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
}

// Codes, scales and amax of two copies, bit for bit (fatal in the caller's sense of ASSERT: it
// returns at the first mismatch; check HasFatalFailure() to stop a loop).
inline void expect_same_quantized(const QuantizedHost& a, const QuantizedHost& b,
                                  const std::string& what) {
  ASSERT_EQ(bits(a.amax), bits(b.amax)) << what << ": amax " << a.amax << " vs " << b.amax;
  ASSERT_TRUE(a.scales == b.scales) << what << ": scales " << first_diff(a.scales, b.scales);
  ASSERT_TRUE(a.codes == b.codes) << what << ": codes " << first_diff(a.codes, b.codes);
}

// host_x: a host tensor (quantize_to_host uploads it where the backend needs it).
inline void expect_copies_independent(Backend& be, const TensorView& host_x,
                                      const QuantizeConfig& both, const std::string& what) {
  QuantizeConfig row_only = both, col_only = both;
  row_only.columnwise.enabled = false;
  col_only.rowwise.enabled = false;
  const QuantizeResult b = quantize_to_host(be, host_x, both);
  const QuantizeResult r = quantize_to_host(be, host_x, row_only);
  const QuantizeResult c = quantize_to_host(be, host_x, col_only);
  expect_same_quantized(b.rowwise, r.rowwise, what + ", row-wise copy: one call vs its own");
  expect_same_quantized(b.columnwise, c.columnwise,
                        what + ", column-wise copy: one call vs its own");
}

// Every pair configuration on a 256 x 256 tensor of each fill.
inline void check_copy_pairs(Backend& be) {
  const int64_t n = 256;
  for (const auto& [name, cfg] : copy_pair_configs()) {
    for (Fill f : {Fill::Gaussian, Fill::HeavyTailed, Fill::Specials}) {
      std::vector<float> x = make_fill(f, static_cast<size_t>(n * n), 4242);
      TensorView v;
      v.data = x.data();
      v.rows = n;
      v.cols = n;
      expect_copies_independent(be, v, cfg, name + " " + fill_name(f) + " on " + be.name());
    }
  }
}

// The row-wise copies the statistics are taken of (model/linear.cpp's stat_of): every format and
// option of copy_pair_configs, with the row-wise copy made by SR too.
inline std::vector<std::pair<std::string, QuantizeConfig>> error_sum_configs() {
  std::vector<std::pair<std::string, QuantizeConfig>> out;
  for (auto [name, cfg] : copy_pair_configs()) {
    cfg.columnwise.enabled = false;
    out.emplace_back(name, cfg);
  }
  return out;
}

// The error sums element by element from the backend's dequantized copy, in flat order (not the
// per-block, per-row order of quant_error_sums, so the FP64 sums agree only to rounding).
inline QuantErrorSums reference_error_sums(Backend& be, const std::vector<float>& x,
                                           QuantizedHost& q) {
  const std::vector<float> d = dequantize_to_host(be, q);
  const bool mx = q.format == QFormat::MXFP4, fp8 = q.format == QFormat::FP8;
  const int64_t blk = q.block_size(), per_row = q.cols / blk;
  QuantErrorSums s;
  for (int64_t r = 0; r < q.rows; ++r)
    for (int64_t b = 0; b < per_row; ++b) {
      const size_t si = static_cast<size_t>(r * per_row + b);
      uint8_t sb = 0;
      float factor;
      if (fp8) {
        std::memcpy(&factor, &q.scales[4 * si], 4);
      } else {
        sb = q.scales[si];
        factor = mx ? ue8m0_to_f32(sb)
                    : nvfp4_decode_factor(sb, q.amax, q.four_over_six ? 1536.0f : 2688.0f);
      }
      bool nonzero = false;
      for (int64_t i = 0; i < blk; ++i) {
        const size_t e = static_cast<size_t>(r * q.cols + b * blk + i);
        const double diff = static_cast<double>(d[e]) - static_cast<double>(x[e]);
        s.err2 += diff * diff;
        s.ref2 += static_cast<double>(x[e]) * static_cast<double>(x[e]);
        nonzero = nonzero || (!std::isnan(x[e]) && x[e] != 0.0f);
        if (factor > 0.0f && std::fabs(x[e]) > (fp8 ? 448.0f : 6.0f) * factor) ++s.saturated;
      }
      if (nonzero && ((mx || fp8) ? factor == 0.0f : sb == 0)) ++s.underflow_blocks;
    }
  return s;
}

// Counts exactly; FP64 sums to 1e-10 relative (65,536 equal terms summed flat drift by ~1e-12), or
// both the same non-finite value.
inline void expect_error_sums_near(const QuantErrorSums& a, const QuantErrorSums& b,
                                   const std::string& what) {
  EXPECT_EQ(a.saturated, b.saturated) << what << ": saturated elements";
  EXPECT_EQ(a.underflow_blocks, b.underflow_blocks) << what << ": underflowed blocks";
  for (auto [u, v, n] : {std::tuple{a.err2, b.err2, "err2"}, std::tuple{a.ref2, b.ref2, "ref2"}}) {
    if (!std::isfinite(u) || !std::isfinite(v)) {
      EXPECT_EQ(std::isnan(u), std::isnan(v)) << what << ": " << n << " " << u << " vs " << v;
      if (!std::isnan(u)) {
        EXPECT_EQ(u, v) << what << ": " << n;
      }
    } else {
      EXPECT_LE(std::fabs(u - v), 1e-10 * std::max(std::fabs(u), std::fabs(v)))
          << what << ": " << n << " " << u << " vs " << v;
    }
  }
}

// Bit for bit (a NaN sum matches any NaN: CPUs and GPUs propagate different payloads).
inline void expect_error_sums_identical(const QuantErrorSums& a, const QuantErrorSums& b,
                                        const std::string& what) {
  EXPECT_EQ(a.saturated, b.saturated) << what << ": saturated elements";
  EXPECT_EQ(a.underflow_blocks, b.underflow_blocks) << what << ": underflowed blocks";
  for (auto [u, v, n] : {std::tuple{a.err2, b.err2, "err2"}, std::tuple{a.ref2, b.ref2, "ref2"}}) {
    if (std::isnan(u) && std::isnan(v)) continue;
    uint64_t ub, vb;
    std::memcpy(&ub, &u, 8);
    std::memcpy(&vb, &v, 8);
    EXPECT_EQ(ub, vb) << what << ": " << n << " " << u << " vs " << v;
  }
}

}  // namespace fp4sim::test
