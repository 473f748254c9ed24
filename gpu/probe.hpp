// fp4sim probe: native Blackwell FP4 conversions against the model (gpu/probe.cu).
#pragma once

#include <cstdint>

namespace fp4sim::gpu {

struct NativeProbe {
  int cc_major, cc_minor;
  bool cvt_rn_supported;               // cvt.rn.satfinite.e2m1x2.f32 (sm_100a, sm_120a)
  unsigned long long rn_mismatches;    // over all 2^32 FP32 inputs, against e2m1_rn_satfinite
  unsigned int rn_first_mismatch;      // FP32 bits of the smallest mismatching input
  bool cvt_rs_supported;               // cvt.rs.satfinite.e2m1x4.f32 (sm_100a)
  uint32_t rs_rbits[6];                // rbits of each experiment
  uint32_t rs_results[6];              // 16-bit results for inputs {0.25, 1.25, 2.5, 5}
};

NativeProbe run_native_probe();

}  // namespace fp4sim::gpu
