// Tier 1, exhaustive (CTest label "slow"): all 2^32 FP32 bit patterns through FP32->E2M1,
// FP32->E4M3 and FP32->BF16 (and E5M2, UE8M0 rz/rp) against CUDA's cuda_fp4.h / cuda_fp8.h /
// cuda_bf16.h host conversions. Runs across OpenMP threads; prints progress.
#include <cuda_bf16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <utility>

#include "emu/formats.hpp"
#include "gpu/formats_device.cuh"

namespace fp4sim {
namespace {

struct Mismatch {
  std::atomic<uint64_t> count{0};
  std::atomic<uint32_t> first{0};
  void add(uint32_t u) {
    if (count.fetch_add(1) == 0) first = u;
  }
};

// Calls check(u, x) for every FP32 bit pattern u (x its float), in `slices` slices across OpenMP
// threads, printing progress every eighth of the way.
template <class Check>
void for_all_fp32(uint64_t slices, const char* what, Check check) {
  constexpr uint64_t kTotal = 1ull << 32;
  for (uint64_t slice = 0; slice < slices; ++slice) {
    const uint64_t begin = slice * (kTotal / slices), end = begin + kTotal / slices;
#pragma omp parallel for schedule(static)
    for (int64_t i = static_cast<int64_t>(begin); i < static_cast<int64_t>(end); ++i) {
      const uint32_t u = static_cast<uint32_t>(i);
      float x;
      std::memcpy(&x, &u, 4);
      check(u, x);
    }
    if ((slice + 1) % (slices / 8) == 0)
      std::printf("[exhaustive] %s: %3llu%% of 2^32 patterns\n", what,
                  static_cast<unsigned long long>((slice + 1) * 100 / slices));
    std::fflush(stdout);
  }
}

TEST(FormatsExhaustive, AllFp32BitPatternsMatchCudaHeaders) {
  Mismatch e2m1, e4m3, e5m2, bf16, rz, rp;
  for_all_fp32(64, "cuda headers", [&](uint32_t u, float x) {
    if (e2m1_rn_satfinite(x) != __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest)) e2m1.add(u);
    if (e4m3_rn_satfinite(x) != __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)) e4m3.add(u);
    if (e5m2_rn_satfinite(x) != __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2)) e5m2.add(u);
    if (ue8m0_rz_satfinite(x) != __nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundZero))
      rz.add(u);
    if (ue8m0_rp_satfinite(x) != __nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundPosInf))
      rp.add(u);
    const __nv_bfloat16 b = __float2bfloat16(x);
    uint16_t bb;
    std::memcpy(&bb, &b, 2);
    if (bf16_rne(x) != bb) bf16.add(u);
  });
  struct Row {
    const char* name;
    Mismatch* m;
  };
  for (const Row& r : {Row{"e2m1", &e2m1}, Row{"e4m3", &e4m3}, Row{"e5m2", &e5m2},
                       Row{"bf16", &bf16}, Row{"ue8m0.rz", &rz}, Row{"ue8m0.rp", &rp}}) {
    std::printf("%-9s mismatches: %llu of 4294967296\n", r.name,
                static_cast<unsigned long long>(r.m->count.load()));
    EXPECT_EQ(r.m->count.load(), 0u)
        << r.name << " first mismatch at 0x" << std::hex << r.m->first.load();
  }
}

// The GPU's E2M1 formulations (gpu/formats_device.cuh: e2m1_rn_magic, e2m1_rs_magic, one rounding
// addition, and the packers' offset-magic sums) against emu/'s e2m1_rn_satfinite and
// e2m1_rs_satfinite: every FP32 input, SR with a random byte derived from it and
// every random byte for every 4099th input (so each input region meets all 256 bytes); the
// magnitude both return must be the code's value.
TEST(FormatsExhaustive, E2m1MagicFormulationsEqualReference) {
  Mismatch rn, rs, mag, offset, rs_offset;
  auto check_rs = [&](uint32_t u, float x, uint8_t r) {
    float m = -1.0f;
    const uint32_t code = gpu::e2m1_rs_magic(x, r, &m);
    if (code != e2m1_rs_satfinite(x, r)) rs.add(u);
    // the packing formulation: the magnitude code in the low bits, bits 3..14 clear
    if ((gpu::e2m1_rs_offset_magic_code(x, r) & 0x7FFFu) != (e2m1_rs_satfinite(x, r) & 0x7u))
      rs_offset.add(u);
    if (f32_bits(m) != f32_bits(e2m1_to_f32(static_cast<uint8_t>(code & 0x7u)))) mag.add(u);
  };
  for_all_fp32(16, "e2m1 magic", [&](uint32_t u, float x) {
    float m = -1.0f;
    const uint32_t code = gpu::e2m1_rn_magic(x, &m);
    if (code != e2m1_rn_satfinite(x)) rn.add(u);
    // the packing formulation: the magnitude code in the sum's low bits, bits 3..22 clear
    const uint32_t sum = gpu::e2m1_rn_offset_magic_sum(x);
    if ((sum & 0x7FFFFFu) != (e2m1_rn_satfinite(x) & 0x7u)) offset.add(u);
    if (f32_bits(m) != f32_bits(e2m1_to_f32(static_cast<uint8_t>(code & 0x7u)))) mag.add(u);
    check_rs(u, x, static_cast<uint8_t>((u * 0x9E3779B1u) >> 24));
    if (u % 4099u == 0)
      for (int rr = 0; rr < 256; ++rr) check_rs(u, x, static_cast<uint8_t>(rr));
  });
  for (const auto& [name, m] : {std::pair<const char*, Mismatch*>{"e2m1.rn magic", &rn},
                                {"e2m1.rs magic", &rs},
                                {"e2m1 magic magnitude", &mag},
                                {"e2m1.rn offset magic", &offset},
                                {"e2m1.rs offset magic", &rs_offset}}) {
    std::printf("%s vs emu mismatches: %llu\n", name,
                static_cast<unsigned long long>(m->count.load()));
    EXPECT_EQ(m->count.load(), 0u)
        << name << ": first mismatch at 0x" << std::hex << m->first.load();
  }
}

}  // namespace
}  // namespace fp4sim
