// The quantize command's options and how it maps them onto a QuantizeConfig: tools/cmd_quantize.cpp
// parses them, tools/golden_cases.cpp records them in a pack's cases and computes the expected
// outputs from the same mapping.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "emu/quantize.hpp"

namespace fp4sim::cli {

struct QuantizeOptions {
  std::string format = "nvfp4";  // nvfp4 | mxfp4 | fp8
  bool block_2d = false, columnwise = false, rht = false, sr = false, fos = false,
       mx_rule_given = false;
  uint64_t seed = 0, stream = 0;
  std::string error = "mae", mx_rule = "floor";
};

// One copy (column-wise with --columnwise, else row-wise) as the options ask; std::invalid_argument
// for what the command refuses: --rht without --columnwise, --mx-rule without --format mxfp4.
inline QuantizeConfig quantize_config(const QuantizeOptions& o) {
  QuantizeConfig cfg;
  cfg.format =
      o.format == "fp8" ? QFormat::FP8 : (o.format == "mxfp4" ? QFormat::MXFP4 : QFormat::NVFP4);
  cfg.block_2d = o.block_2d;
  cfg.mx_rule = o.mx_rule == "ceil" ? MxScaleRule::Ceil : MxScaleRule::Floor;
  cfg.fos_error = o.error == "mse" ? FourOverSixError::MSE : FourOverSixError::MAE;
  cfg.seed = o.seed;
  CopySpec spec;
  spec.enabled = true;
  spec.rounding = o.sr ? Rounding::SR : Rounding::RN;
  spec.stream = o.stream;
  spec.rht = o.rht;
  spec.four_over_six = o.fos;
  if (o.rht && !o.columnwise)
    throw std::invalid_argument("--rht: applies to the column-wise copy only; add --columnwise");
  if (o.mx_rule_given && cfg.format != QFormat::MXFP4)
    throw std::invalid_argument("--mx-rule: applies to --format mxfp4 only");
  (o.columnwise ? cfg.columnwise : cfg.rowwise) = spec;
  return cfg;
}

}  // namespace fp4sim::cli
