// Strict number parsing for CLI flags: the whole text must be the number, and an error names the
// flag and the text (std::stoi alone accepts "1x" and says only "stoi"). Used by mma's value lists
// and by the range validators of eval and sample.
#pragma once

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace fp4sim::cli {

// An integer in `base` (10, or 16 for bytes), the whole text; else std::invalid_argument.
inline long long parse_integer(const std::string& text, const std::string& flag, int base = 10) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used, base);
  } catch (const std::exception&) {
    used = 0;
  }
  if (text.empty() || used != text.size())
    throw std::invalid_argument(flag + ": '" + text + "' is not " +
                                (base == 16 ? "a hex byte" : "an integer"));
  return v;
}

// A decimal number (inf and nan accepted), the whole text; else std::invalid_argument.
inline double parse_decimal(const std::string& text, const std::string& flag) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (text.empty() || used != text.size())
    throw std::invalid_argument(flag + ": '" + text + "' is not a number");
  return v;
}

// A number written as 2^N or in decimal, as a double.
inline double parse_number(const std::string& text, const std::string& flag) {
  if (text.rfind("2^", 0) == 0) {
    const long long e = parse_integer(text.substr(2), flag);
    if (e < -1074 || e > 1023) throw std::invalid_argument(flag + ": " + text + " is out of range");
    return std::ldexp(1.0, static_cast<int>(e));
  }
  return parse_decimal(text, flag);
}

// Validators: an integer flag >= min, and a finite decimal flag >= 0, with messages that name the
// flag and the bound.
inline CLI::Validator at_least(const std::string& flag, int64_t min) {
  return CLI::Validator(
      [flag, min](const std::string& v) -> std::string {
        try {
          if (parse_integer(v, flag) >= min) return "";
        } catch (const std::invalid_argument&) {
        }
        return flag + " must be an integer >= " + std::to_string(min) + ", got '" + v + "'";
      },
      "INT >= " + std::to_string(min));
}
inline CLI::Validator finite_non_negative(const std::string& flag) {
  return CLI::Validator(
      [flag](const std::string& v) -> std::string {
        try {
          const double x = parse_decimal(v, flag);
          if (std::isfinite(x) && x >= 0) return "";
        } catch (const std::invalid_argument&) {
        }
        return flag + " must be a finite number >= 0, got '" + v + "'";
      },
      "FLOAT >= 0");
}

}  // namespace fp4sim::cli
