// fp4sim probe: for owners of Blackwell GPUs. Prints the model's answers to DESIGN.md §7's worked
// vector and probes, then (on sm_100 / sm_120) checks the native FP4 conversions against the model:
// cvt.rn.satfinite.e2m1x2.f32 on all 2^32 inputs, and which random byte feeds which element of
// cvt.rs.satfinite.e2m1x4.f32; and (sm_120a) runs a layout check, the worked vector and probes, and
// random and special tiles through mma.sync ... kind::mxf4nvf4.block_scale (and kind::mxf4), every
// output against gst_fdpa_fp4_bits. tcgen05.mma (sm_100a) is not probed. On other GPUs it says that
// it needs sm_100/sm_120 and exits with 2. On an sm_90 GPU (H100/H200) it runs named Hopper FP8
// cases (DESIGN.md §7's FP8 row: alignment at F = 13, RZ to E8M13, the accumulator as a term)
// through the tensor cores (the exact FP8 GEMM's wgmma path) against the emulator.
#include <fmt/core.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "emu/backend.hpp"
#include "emu/formats.hpp"
#include "emu/mma.hpp"
#include "tools/backends.hpp"
#include "tools/commands.hpp"

#if FP4SIM_HAVE_CUDA
#include "gpu/cuda_backend.hpp"
#include "gpu/probe.hpp"
#endif

namespace fp4sim::cli {
namespace {

struct Probe64 {
  uint8_t a[32] = {}, b[32] = {}, sa[4] = {127, 127, 127, 127}, sb[4] = {127, 127, 127, 127};
  void set(int k, float x, float y) {
    a[k / 2] |= e2m1_rn_satfinite(x) << (4 * (k & 1));
    b[k / 2] |= e2m1_rn_satfinite(y) << (4 * (k & 1));
  }
};

void print_model_answers() {
  fmt::print(
      "The model's answers (GST-FDPA, UE8M0 16-block scales), what a Blackwell GPU should give:\n");
  Probe64 w;
  w.set(0, -4, 4);
  w.set(16, -1, 1);
  w.set(17, -1, 0.5f);
  w.set(18, -0.5f, 0.5f);
  w.sa[0] = 127 + 11;
  w.sb[0] = 127 + 8;
  w.sb[1] = 126;
  auto show = [](const char* name, const Probe64& p, float c) {
    const uint32_t r = gst_fdpa_fp4_bits(p.a, p.b, p.sa, p.sb, ScaleKind::UE8M0_16, c);
    float f;
    std::memcpy(&f, &r, 4);
    fmt::print("  {:<46} 0x{:08X}  {:.9g}\n", name, r, f);
  };
  show("worked vector (expect -0.875)", w, std::ldexp(1.0f, 23));
  for (int e : {-35, -36}) {
    Probe64 p;
    p.set(0, 1, 1);
    p.set(32, -1, 1);
    p.set(16, 1, 1);
    p.sa[1] = static_cast<uint8_t>(127 + e);
    show(e == -35 ? "probe 1, g1 at 2^-35 (expect 2^-35)" : "probe 1, g1 at 2^-36 (expect 0)", p,
         0.0f);
  }
  {
    Probe64 p;
    p.set(0, 0.5f, 0.5f);
    p.set(1, -0.5f, 0.5f);
    p.set(16, 1, 1);
    p.sa[1] = 127 - 36;
    show("probe 2, cancelled group keeps its exponent (0)", p, 0.0f);
  }
  {
    Probe64 p;
    p.set(0, 6, 6);
    p.set(16, -6, 6);
    p.set(32, 1, 1);
    p.sa[2] = 127 - 35;
    show("probe 3, alignment by scale exponent (2^-35)", p, 0.0f);
  }
  {
    Probe64 p;
    p.set(0, 1, 1);
    p.set(16, -1, 1);
    p.sa[0] = p.sa[1] = 127 + 13;
    show("probe 4, C is truncated too (1.0)", p, 1.0f + std::ldexp(1.0f, -23));
  }
}

// ---- Hopper FP8 (wgmma m64nNk32 E4M3): named cases through the exact FP8 GEMM ------------------
// Each case is one output: A and B one row of 128 E4M3 codes (one k-block, four k32 instructions),
// block scales 1, so D is the k-block's chained T-FDPA result (L = 32, F = 13, RZ to E8M13).

struct Fp8Term {
  int k;
  float a, b;
};
struct Fp8NamedCase {
  const char* name;
  std::vector<Fp8Term> terms;
};

std::vector<Fp8NamedCase> hopper_fp8_cases() {
  const float t7 = std::ldexp(1.0f, -7), t6 = std::ldexp(1.0f, -6);
  std::vector<Fp8Term> tiny(32);
  for (int k = 0; k < 32; ++k) tiny[static_cast<size_t>(k)] = {k, t7, t7};
  return {
      {"1 + 2^-13: kept (grid 2^(e_max - 13))", {{0, 1, 1}, {1, t6, t7}}},
      {"1 + 2^-14: dropped (F = 13)", {{0, 1, 1}, {1, t7, t7}}},
      {"1 - 2^-14: term truncated toward zero", {{0, 1, 1}, {1, -t7, t7}}},
      {"2 + 2^-13: sum RZ to 13 fraction bits", {{0, 1, 1}, {1, 1, 1}, {2, t6, t7}}},
      {"-(2 + 2^-13): RZ toward zero", {{0, -1, 1}, {1, -1, 1}, {2, -t6, t7}}},
      {"1 (k 0) + 2^-14 (k 32): C aligned too", {{0, 1, 1}, {32, t7, t7}}},
      {"32 x 2^-14 alone: alignment is relative", tiny},
  };
}

// A 1 x 128 FP8 row with the case's a (or b) values, block scale 1.
QuantizedHost fp8_probe_row(const Fp8NamedCase& c, bool b_side) {
  QuantizedHost q;
  q.rows = 1;
  q.cols = kFp8Block;
  q.format = QFormat::FP8;
  q.codes.assign(kFp8Block, 0);
  for (const Fp8Term& t : c.terms)
    q.codes[static_cast<size_t>(t.k)] = e4m3_rn_satfinite(b_side ? t.b : t.a);
  const float one = 1.0f;
  q.scales.resize(4);
  std::memcpy(q.scales.data(), &one, 4);
  return q;
}

// D's bits for the case on a backend (exact FP8 GEMM).
uint32_t fp8_probe_on(Backend& be, const Fp8NamedCase& c) {
  QuantizedHost a = fp8_probe_row(c, false), b = fp8_probe_row(c, true);
  QuantizedBuffers da = QuantizedBuffers::uploaded(be, a), db = QuantizedBuffers::uploaded(be, b);
  BackendBuffer d(be, 4);
  TensorView dv;
  dv.data = d.get();
  dv.rows = 1;
  dv.cols = 1;
  dv.device = be.device();
  be.gemm(da.view, db.view, nullptr, GemmConfig{}, dv);
  be.synchronize();
  uint32_t bits = 0;
  be.download(&bits, d.get(), 4);
  return bits;
}

// The same chain with Blackwell's f8f6f4 accumulation (F = 25, RZ-FP32), for contrast.
float fp8_probe_blackwell(const Fp8NamedCase& c) {
  float va[kFp8Block] = {}, vb[kFp8Block] = {};
  for (const Fp8Term& t : c.terms) va[t.k] = t.a, vb[t.k] = t.b;
  float acc = 0.0f;
  for (int k0 = 0; k0 < kFp8Block; k0 += kFp8FdpaL)
    acc = tfdpa_fp8_blackwell(va + k0, vb + k0, acc, kE4M3Operand, kE4M3Operand);
  return acc;
}

// Prints the model's answers (the emulator's exact FP8 GEMM) to the cases and returns their bits,
// in hopper_fp8_cases() order.
std::vector<uint32_t> print_hopper_fp8_model() {
  fmt::print(
      "\nThe model's answers for Hopper FP8 (wgmma E4M3, T-FDPA L = 32, F = 13, RZ to E8M13), one "
      "128-wide\n"
      "k-block, scales 1 (what an H100/H200 should give; Blackwell's F = 25 for contrast):\n");
  auto emu = make_backend("emu");
  std::vector<uint32_t> model;
  for (const Fp8NamedCase& c : hopper_fp8_cases()) {
    const uint32_t m = fp8_probe_on(*emu, c);
    fmt::print("  {:<44} 0x{:08X}  {:<16.12g} (F = 25: {:.12g})\n", c.name, m, f32_from_bits(m),
               fp8_probe_blackwell(c));
    model.push_back(m);
  }
  return model;
}

#if FP4SIM_HAVE_CUDA
// The native MMA section; true when some output that ran differs from the model.
bool print_native_mma(const gpu::NativeMmaProbe& p) {
  fmt::print(
      "native MMA (mma.sync ... kind::mxf4nvf4.block_scale), one m16n8k64 tile per case, all 128 "
      "outputs of each\nagainst the model (gst_fdpa_fp4_bits, bitwise):\n");
  fmt::print(
      "  The register fragment layouts are taken from the PTX ISA (9.7.14.5.11 fragments, 9.7.14.3 "
      "block scaling)\n  and have never run on hardware here: a mismatch may be a layout error "
      "before it is a model error.\n  The \"layout\" line decides: its answers are exact whatever "
      "the rounding; if it fails, the layout is wrong.\n");
  bool differs = false;
  for (const gpu::NativeMmaVariantResult& v : p.variants) {
    fmt::print("\n  {}:\n    {}\n", v.label, v.instruction);
    if (!v.supported) {
      fmt::print("    not run: {}\n", v.why_not);
      continue;
    }
    for (const gpu::MmaCaseClass& c : v.classes) {
      fmt::print("    {:<38} {} of {} outputs bitwise equal to the model   {}\n", c.name, c.equal,
                 c.outputs, c.equal == c.outputs ? "OK" : "DIFFER");
      if (c.equal != c.outputs) differs = true;
    }
    if (!v.layout_ok()) {
      fmt::print(
          "    LAYOUT CHECK FAILED: the fragment or scale layout in gpu/probe.cu is wrong (not the "
          "model);\n    the lines below mean nothing until it passes.\n");
    }
    for (const gpu::MmaNamedResult& r : v.named) {
      fmt::print("      {:<56} native 0x{:08X}  model 0x{:08X}  {}\n", r.name, r.native, r.model,
                 r.native == r.model ? "equal" : "DIFFER");
    }
    if (!v.first_mismatches.empty()) fmt::print("    first mismatches (case, row m, column n):\n");
    for (const gpu::MmaMismatch& x : v.first_mismatches) {
      float got, want;
      std::memcpy(&got, &x.native, 4);
      std::memcpy(&want, &x.model, 4);
      fmt::print("      {:<14} ({:2},{}) native 0x{:08X} {:<15.9g} model 0x{:08X} {:.9g}\n",
                 x.case_name, x.m, x.n, x.native, got, x.model, want);
      if (x.case_name == "layout" && std::isfinite(got)) {
        // D = 512 * (8m + n + 1) + the one product (|product| < 256): which C and which product
        const long idx = std::lround(got / 512.0f) - 1;
        fmt::print(
            "        native decodes as C[{}][{}] + product {}; the model's is C[{}][{}] + product "
            "{}\n",
            idx / 8, idx % 8, got - 512.0f * static_cast<float>(idx + 1), x.m, x.n,
            want - 512.0f * static_cast<float>(8 * x.m + x.n + 1));
      }
    }
  }
  fmt::print(
      "\n  tcgen05.mma ... kind::mxf4nvf4 (sm_100a): not probed. It is issued by one thread on "
      "shared-memory\n  descriptors into tensor memory (tcgen05.alloc, scales copied into tensor "
      "memory, an mbarrier\n  commit, tcgen05.ld back), a different path from mma.sync; not "
      "written here.\n");
  if (p.cc_major != 12)
    fmt::print(
        "  mma.sync ... kind::mxf4nvf4 needs an sm_120 GPU (RTX 50xx, RTX PRO Blackwell); this one "
        "is sm_{}{}.\n",
        p.cc_major, p.cc_minor);
  return differs;
}

// The Hopper FP8 cases on this GPU's tensor cores (the exact FP8 GEMM's wgmma path) against the
// model's answers (print_hopper_fp8_model's); true when one differs.
bool print_native_hopper_fp8(const std::vector<uint32_t>& model) {
  fmt::print(
      "native Hopper FP8 (wgmma.mma_async m64n128k32 E4M3 through the exact FP8 GEMM, "
      "gpu/fp8_wgmma.cu):\n");
  gpu::CudaBackend cuda_backend;
  Backend* cuda = &cuda_backend;
  const std::vector<Fp8NamedCase> cases = hopper_fp8_cases();
  bool differs = false;
  for (size_t i = 0; i < cases.size(); ++i) {
    const uint32_t n = fp8_probe_on(*cuda, cases[i]), m = model[i];
    fmt::print("  {:<44} native 0x{:08X} {:<16.12g} model 0x{:08X}  {}\n", cases[i].name, n,
               f32_from_bits(n), m, n == m ? "equal" : "DIFFER");
    differs = differs || n != m;
  }
  if (cuda_backend.counters().fp8_wgmma_gemms != cases.size()) {
    fmt::print(
        "  (the tensor-core path did not run: these are the model kernel's answers, not the "
        "hardware's)\n");
    return true;
  }
  fmt::print(
      "  Random codes over the whole E4M3 range: tests/gpu/test_fp8_gpu.cpp "
      "(Fp8Gpu.TensorCoreAccumulationEqualsModelOnRawCodes).\n");
  return differs;
}
#endif

int run_probe() {
  fmt::print(
      "fp4sim probe: native tensor-core arithmetic against the model (docs/numerics.md §7)\n\n");
  print_model_answers();
  const std::vector<uint32_t> fp8_model = print_hopper_fp8_model();
  fmt::print("\n");
#if FP4SIM_HAVE_CUDA
  if (!gpu::gpu_available()) {
    fmt::print("No CUDA GPU found ({}). The native checks need an sm_90, sm_100 or sm_120 GPU.\n",
               gpu_description());
    return 2;
  }
  const gpu::NativeProbe p = gpu::run_native_probe();
  if (p.cc_major == 9 && p.cc_minor == 0) {
    fmt::print("GPU: {}\n", gpu_description());
    const bool fp8_differs = print_native_hopper_fp8(fp8_model);
    fmt::print(
        "\nThe FP4 checks need an sm_100 (B200/GB200) or sm_120 (RTX 50xx) GPU: not run here.\n");
    return fp8_differs ? 1 : 0;
  }
  if (p.cc_major < 10) {
    fmt::print(
        "This GPU is sm_{}{} ({}): the native checks need an sm_90 (H100/H200), sm_100 "
        "(B200/GB200) or "
        "sm_120 (RTX 50xx) GPU. Nothing was checked.\n",
        p.cc_major, p.cc_minor, gpu_description());
    return 2;
  }
  fmt::print("GPU: {}\n", gpu_description());
  if (!p.cvt_rn_supported) {
    fmt::print(
        "cvt.rn.satfinite.e2m1x2.f32: not in this build's code for sm_{}{} (build with {}a)\n",
        p.cc_major, p.cc_minor, p.cc_major * 10 + p.cc_minor);
  } else if (p.rn_mismatches == 0) {
    fmt::print("cvt.rn.satfinite.e2m1x2.f32: all 2^32 FP32 inputs agree with the model   OK\n");
  } else {
    fmt::print(
        "cvt.rn.satfinite.e2m1x2.f32: {} of 2^32 inputs DIFFER from the model, first at 0x{:08X}\n",
        p.rn_mismatches, p.rn_first_mismatch);
  }
  if (!p.cvt_rs_supported) {
    fmt::print("cvt.rs.satfinite.e2m1x4.f32: not available on this GPU/build (sm_100a only)\n");
  } else {
    // inputs 0.25, 1.25, 2.5, 5: code pairs {0,1}, {2,3}, {4,5}, {6,7}; odd code = rounded up
    fmt::print(
        "cvt.rs.satfinite.e2m1x4.f32 on {{0.25, 1.25, 2.5, 5}} (each half way between grid "
        "points):\n");
    fmt::print("  {:<12} nibbles (bits 15..12 .. 3..0) -> input, rounded up?\n", "rbits");
    for (int i = 0; i < 6; ++i) {
      std::string row;
      for (int nib = 3; nib >= 0; --nib) {
        const uint32_t code = (p.rs_results[i] >> (4 * nib)) & 0x7u;
        const char* input[4] = {"0.25", "1.25", "2.5", "5"};
        row += fmt::format("  {}:{}", input[code / 2], code & 1 ? "up" : "down");
      }
      fmt::print("  0x{:08X} {}\n", p.rs_rbits[i], row);
    }
    fmt::print(
        "  The model assumes element j of a 4-element conversion uses byte j of its random word "
        "(byte 0 = bits 7..0); compare the single-byte rows above.\n");
  }
  fmt::print("\n");
  const bool mma_differs = print_native_mma(gpu::run_native_mma_probe());
  return (p.cvt_rn_supported && p.rn_mismatches != 0) || mma_differs ? 1 : 0;
#else
  fmt::print(
      "This build has no CUDA backend: the native checks need an sm_90, sm_100 or sm_120 GPU.\n");
  return 2;
#endif
}

}  // namespace

void register_probe(CLI::App& app) {
  auto* cmd = app.add_subcommand("probe",
                                 "Check a GPU's native tensor-core arithmetic against the model: "
                                 "Hopper FP8 wgmma (sm_90), Blackwell FP4 conversions and "
                                 "block-scaled MMAs (sm_100/sm_120); prints the model's answers");
  cmd->callback([]() {
    const int rc = run_probe();
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace fp4sim::cli
