// fp4sim probe: native Blackwell FP4 conversions and block-scaled MMAs against the model
// (gpu/probe.cu).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "emu/mma.hpp"

namespace fp4sim::gpu {

struct NativeProbe {
  int cc_major, cc_minor;
  bool cvt_rn_supported;             // cvt.rn.satfinite.e2m1x2.f32 (sm_100a, sm_120a)
  unsigned long long rn_mismatches;  // over all 2^32 FP32 inputs, against e2m1_rn_satfinite
  unsigned int rn_first_mismatch;    // FP32 bits of the smallest mismatching input
  bool cvt_rs_supported;             // cvt.rs.satfinite.e2m1x4.f32 (sm_100a)
  uint32_t rs_rbits[6];              // rbits of each experiment
  uint32_t rs_results[6];            // 16-bit results for inputs {0.25, 1.25, 2.5, 5}
};

NativeProbe run_native_probe();

// ---- The native MMA probe: warp-level mma.sync ... kind::mxf4nvf4.block_scale (sm_120a) ---------
//
// Each test case is one 16x8 output tile of one m16n8k64 instruction; every one of its 128 outputs
// is compared bit for bit with gst_fdpa_fp4_bits on (row m of A, column n of B, their scale bytes,
// C[m][n]). The register fragment layouts are taken from the PTX ISA and have never run on hardware
// here: the "layout" cases have exact answers that do not depend on any rounding or alignment rule,
// so if they fail the layout is wrong, and the other verdicts mean nothing until they pass.

// One case class of one variant: how many outputs agree bitwise with the model.
struct MmaCaseClass {
  std::string name;  // "layout", "worked vector + probes", "random", "specials"
  uint64_t outputs = 0;
  uint64_t equal = 0;
};

struct MmaMismatch {
  std::string case_name;
  int m, n;
  uint32_t native, model;  // FP32 bits
};

// A named single-output case (worked vector, probes): output (0,0) of its tile.
struct MmaNamedResult {
  std::string name;
  uint32_t native, model;
};

struct NativeMmaVariantResult {
  std::string label;        // "UE4M3 per 16", ...
  std::string instruction;  // the PTX instruction, qualifiers and types
  ScaleKind kind;
  bool supported = false;  // the instruction ran on this GPU
  std::string why_not;     // when not supported: the reason
  std::vector<MmaCaseClass> classes;
  std::vector<MmaNamedResult> named;
  std::vector<MmaMismatch> first_mismatches;  // the first few, in case order
  bool layout_ok() const { return !classes.empty() && classes[0].outputs == classes[0].equal; }
};

struct NativeMmaProbe {
  int cc_major, cc_minor;
  std::vector<NativeMmaVariantResult> variants;
};

NativeMmaProbe run_native_mma_probe();

}  // namespace fp4sim::gpu
