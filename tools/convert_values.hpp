// fp4sim convert's conversions (DESIGN.md §2) over n values, shared by the CLI (tools/cmd_convert)
// and the Python module (fp4sim.convert), so both give the same bits.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "emu/formats.hpp"

namespace fp4sim::cli {

// The formats convert encodes to and decodes from.
inline bool convert_encodes(const std::string& f) {
  return f == "e2m1" || f == "e4m3" || f == "e5m2" || f == "bf16" || f == "ue8m0_rz" ||
         f == "ue8m0_rp";
}
inline bool convert_decodes(const std::string& f) {
  return f == "e2m1" || f == "e4m3" || f == "e5m2" || f == "bf16" || f == "ue8m0";
}

// float32 -> codes: one byte a value, two (little-endian BF16 bits) for bf16; RN, satfinite.
inline std::vector<uint8_t> encode_values(const std::string& format, const float* x, size_t n) {
  if (!convert_encodes(format))
    throw std::invalid_argument("format '" + format +
                                "' cannot encode (e2m1, e4m3, e5m2, bf16, ue8m0_rz, ue8m0_rp)");
  if (format == "bf16") {
    std::vector<uint8_t> o(2 * n);
    for (size_t i = 0; i < n; ++i) {
      const uint16_t b = bf16_rne(x[i]);
      std::memcpy(o.data() + 2 * i, &b, 2);
    }
    return o;
  }
  std::vector<uint8_t> o(n);
  for (size_t i = 0; i < n; ++i)
    o[i] = format == "e2m1"       ? e2m1_rn_satfinite(x[i])
           : format == "e4m3"     ? e4m3_rn_satfinite(x[i])
           : format == "e5m2"     ? e5m2_rn_satfinite(x[i])
           : format == "ue8m0_rz" ? ue8m0_rz_satfinite(x[i])
                                  : ue8m0_rp_satfinite(x[i]);
  return o;
}

// codes -> float32: n codes of one byte (two, BF16 bits, for bf16). An E2M1 code above 15 is an
// error naming `where` and the code.
inline std::vector<float> decode_values(const std::string& format, const uint8_t* codes, size_t n,
                                        const std::string& where) {
  if (!convert_decodes(format))
    throw std::invalid_argument("format '" + format +
                                "' cannot decode (e2m1, e4m3, e5m2, bf16, ue8m0)");
  std::vector<float> o(n);
  for (size_t i = 0; i < n; ++i) {
    if (format == "bf16") {
      uint16_t b;
      std::memcpy(&b, codes + 2 * i, 2);
      o[i] = bf16_to_f32(b);
      continue;
    }
    const uint8_t c = codes[i];
    if (format == "e2m1" && c > 15)
      throw std::invalid_argument(where + ": E2M1 code " + std::to_string(c) + " > 15 (element " +
                                  std::to_string(i) + ")");
    o[i] = format == "e2m1"   ? e2m1_to_f32(c)
           : format == "e4m3" ? e4m3_to_f32(c)
           : format == "e5m2" ? e5m2_to_f32(c)
                              : ue8m0_to_f32(c);
  }
  return o;
}

}  // namespace fp4sim::cli
