// fp4sim convert: the scalar conversions of DESIGN.md §2 over a whole array, for external oracles
// (validation/oracle_ml_dtypes.py) and users who check their own conversion code.
#include <fmt/core.h>

#include <stdexcept>

#include "tools/commands.hpp"
#include "tools/convert_values.hpp"
#include "tools/npy.hpp"

namespace fp4sim::cli {
namespace {

struct ConvertArgs {
  std::string input, output, format;
  bool decode = false;
};

void run_convert(const ConvertArgs& a) {
  io::check_outputs({a.output}, {a.input});
  const io::NpyArray in = io::read_npy(a.input);
  size_t n = 1;
  for (size_t d : in.shape) n *= d;
  io::AtomicOutputs out;
  if (!a.decode) {
    if (in.dtype != "<f4")
      throw std::runtime_error(a.input + ": dtype '" + in.dtype + "', expected float32 ('<f4')");
    const std::vector<uint8_t> o =
        encode_values(a.format, reinterpret_cast<const float*>(in.bytes.data()), n);
    if (a.format == "bf16")
      io::write_npy_u16(out.stage(a.output), reinterpret_cast<const uint16_t*>(o.data()), in.shape);
    else
      io::write_npy_u8(out.stage(a.output), o.data(), in.shape);
  } else {
    const bool wide = a.format == "bf16";
    if (in.dtype != (wide ? "<u2" : "|u1"))
      throw std::runtime_error(a.input + ": dtype '" + in.dtype + "', expected " +
                               (wide ? "uint16 ('<u2')" : "uint8 ('|u1')") + " codes");
    const std::vector<float> o = decode_values(a.format, in.bytes.data(), n, a.input);
    io::write_npy_f32(out.stage(a.output), o.data(), in.shape);
  }
  out.commit();
  fmt::print("{} {} values ({}) -> {}\n", a.decode ? "decoded" : "encoded", n, a.format, a.output);
}

}  // namespace

void register_convert(CLI::App& app) {
  auto args = std::make_shared<ConvertArgs>();
  auto* cmd =
      app.add_subcommand("convert", "Scalar format conversions over an array (float32 <-> codes)");
  cmd->add_option("input", args->input, "Input .npy (float32, or codes with --decode)")->required();
  cmd->add_option("output", args->output, "Output .npy")->required();
  cmd->add_option("--format", args->format,
                  "e2m1 | e4m3 | e5m2 | bf16 | ue8m0_rz | ue8m0_rp (encode); ue8m0 (decode)")
      ->required()
      ->check(CLI::IsMember({"e2m1", "e4m3", "e5m2", "bf16", "ue8m0_rz", "ue8m0_rp", "ue8m0"}));
  cmd->add_flag("--decode", args->decode, "Codes -> float32");
  cmd->callback([args]() { run_convert(*args); });
}

}  // namespace fp4sim::cli
