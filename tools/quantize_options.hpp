// The quantize command's options, how it maps them onto a QuantizeConfig and the meta.json it
// writes: tools/cmd_quantize.cpp parses them, tools/golden_cases.cpp records them in a pack's cases
// and computes the expected outputs from the same mapping, and the Python module (python/) takes
// them as keyword arguments and returns the same meta.
#pragma once

#include <fmt/core.h>

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

#include "emu/contract.hpp"
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
// for what the command refuses: an unknown format, error metric or MX rule (the CLI's parser
// refuses them first; the Python module and the packs come here), --rht without --columnwise,
// --mx-rule without --format mxfp4.
inline QuantizeConfig quantize_config(const QuantizeOptions& o) {
  if (o.format != "nvfp4" && o.format != "mxfp4" && o.format != "fp8")
    throw std::invalid_argument("format '" + o.format + "' (nvfp4 | mxfp4 | fp8)");
  if (o.error != "mae" && o.error != "mse")
    throw std::invalid_argument("error '" + o.error + "' (mae | mse)");
  if (o.mx_rule != "floor" && o.mx_rule != "ceil")
    throw std::invalid_argument("mx_rule '" + o.mx_rule + "' (floor | ceil)");
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

inline const char* quantize_block_name(QFormat f, bool two_d) {
  if (f == QFormat::FP8) return two_d ? "128x128" : "1x128";
  if (f == QFormat::MXFP4) return "1x32";
  return two_d ? "16x16" : "1x16";
}

// The meta.json of one quantized copy q of an input of in_dtype, in_rows x in_cols (the CLI adds
// the input's path).
inline nlohmann::json quantize_meta(const QuantizeOptions& o, DType in_dtype, int64_t in_rows,
                                    int64_t in_cols, const QuantizedHost& q,
                                    const std::string& backend, const char* generator) {
  const bool fp8 = q.format == QFormat::FP8;
  return {{"contract_version", kContractVersion},
          {"generator", generator},
          {"input_dtype", dtype_name(in_dtype)},
          {"input_shape", {in_rows, in_cols}},
          {"written_shape", {q.rows, q.cols}},
          {"format", o.format},
          {"copy", o.columnwise ? "columnwise" : "rowwise"},
          {"block", quantize_block_name(q.format, o.block_2d)},
          {"rounding", o.sr ? "sr" : "rn"},
          {"rht", o.rht},
          {"four_over_six", o.fos},
          {"four_over_six_error", o.error},
          {"mx_rule", o.mx_rule},
          {"seed", o.seed},
          {"stream", o.stream},
          {"amax", std::isfinite(q.amax) ? nlohmann::json(q.amax)
                                         : nlohmann::json(fmt::format("{}", q.amax))},
          {"backend", backend},
          {"files",
           {{"codes", fp8 ? "uint8 E4M3 [rows, cols]"
                          : "uint8 [rows, cols/2], element 2i in the low nibble"},
            {"scales", fp8 ? "float32 [rows, cols/128] (the decode scale 1/enc)"
                       : q.format == QFormat::MXFP4 ? "uint8 UE8M0 [rows, cols/32]"
                                                    : "uint8 E4M3 [rows, cols/16]"},
            {"amax", "float32 [1]"},
            {"dequant", "float32 [rows, cols]"}}}};
}

}  // namespace fp4sim::cli
