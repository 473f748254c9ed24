// Tier 3 on the device: the MMA models (GST-FDPA, the T-FDPA variants) evaluated by a kernel on
// >= 10^6 random bit patterns and compared with the host, bit for bit. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <random>
#include <vector>

#include "emu/mma.hpp"
#include "emu/rht.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/formats_device.cuh"
#include "gpu/rht_device.cuh"
#include "tests/gpu/gpu_test_util.hpp"

namespace fp4sim {
namespace {

struct GstCase {
  uint8_t a[32], b[32], sfa[4], sfb[4];
  float c;
  uint8_t kind;
};

struct Fp8Case {
  float a[32], b[32], c;
  uint8_t fa_e5m2, fb_e5m2;
};

__global__ void gst_kernel(const GstCase* cases, uint32_t* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const GstCase& k = cases[i];
  out[i] = gst_fdpa_fp4_bits(k.a, k.b, k.sfa, k.sfb, static_cast<ScaleKind>(k.kind), k.c);
}

__global__ void fp8_kernel(const Fp8Case* cases, uint32_t* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const Fp8Case& k = cases[i];
  const OperandFormat fa = k.fa_e5m2 ? kE5M2Operand : kE4M3Operand;
  const OperandFormat fb = k.fb_e5m2 ? kE5M2Operand : kE4M3Operand;
  out[2 * i] = f32_bits(tfdpa_fp8_hopper(k.a, k.b, k.c, fa, fb));
  out[2 * i + 1] = f32_bits(tfdpa_fp8_blackwell(k.a, k.b, k.c, fa, fb));
}

struct RhtCase {
  uint16_t x[16];
};

// Per chunk, as the quantize kernels compute them (the device's conversions): rht16_packed's 8
// words and its max |x|, rht16_abs_max_rounded_once's max |y| and max |x| (11 words).
__global__ void rht_kernel(const RhtCase* cases, uint32_t* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint16_t x[16];
  for (int k = 0; k < 16; ++k) x[k] = cases[i].x[k];
  uint32_t w[8];
  float in_packed = 0.0f, in_abs = 0.0f;
  rht16_packed<gpu::DeviceFormats>(x, w, &in_packed);
  const float ymax = gpu::rht16_abs_max_rounded_once<gpu::DeviceFormats>(x, &in_abs);
  for (int k = 0; k < 8; ++k) out[11 * i + k] = w[k];
  out[11 * i + 8] = f32_bits(in_packed);
  out[11 * i + 9] = f32_bits(ymax);
  out[11 * i + 10] = f32_bits(in_abs);
}

float random_c(std::mt19937_64& rng) {
  const uint32_t r = static_cast<uint32_t>(rng());
  switch (r % 8) {
    case 0:
      return 0.0f;
    case 1:
      return f32_from_bits(static_cast<uint32_t>(rng()));  // any bit pattern, Inf/NaN too
    default:
      return std::ldexp(std::normal_distribution<float>()(rng), static_cast<int>(r % 60) - 30);
  }
}

template <class Case, class Kernel>
std::vector<uint32_t> run_on_device(const std::vector<Case>& cases, int outs_per_case,
                                    Kernel kernel) {
  Case* dc = nullptr;
  uint32_t* dout = nullptr;
  FP4SIM_CUDA_CHECK(cudaMalloc(&dc, cases.size() * sizeof(Case)));
  FP4SIM_CUDA_CHECK(cudaMalloc(&dout, cases.size() * outs_per_case * sizeof(uint32_t)));
  FP4SIM_CUDA_CHECK(
      cudaMemcpy(dc, cases.data(), cases.size() * sizeof(Case), cudaMemcpyHostToDevice));
  const int n = static_cast<int>(cases.size());
  kernel<<<(n + 127) / 128, 128>>>(dc, dout, n);
  FP4SIM_CUDA_CHECK_LAUNCH();
  std::vector<uint32_t> out(cases.size() * outs_per_case);
  FP4SIM_CUDA_CHECK(
      cudaMemcpy(out.data(), dout, out.size() * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  cudaFree(dc);
  cudaFree(dout);
  return out;
}

TEST(MmaGpu, Gst_RandomBitPatterns_MatchHost) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  std::mt19937_64 rng(2026);
  std::vector<GstCase> cases(1200000);
  for (auto& k : cases) {
    const int zeros = static_cast<int>(rng() % 4);  // bias some cases towards zero codes
    for (int i = 0; i < 32; ++i) {
      k.a[i] = static_cast<uint8_t>(rng());
      k.b[i] = static_cast<uint8_t>(rng());
      if (zeros && rng() % 4 < static_cast<uint64_t>(zeros)) k.a[i] &= 0x88;
    }
    k.kind = static_cast<uint8_t>(rng() % 3);
    for (int g = 0; g < 4; ++g) {
      k.sfa[g] = static_cast<uint8_t>(rng());
      k.sfb[g] = static_cast<uint8_t>(rng());
      if (k.kind != 0 && rng() % 2) {  // keep UE8M0 products in range more often
        k.sfa[g] = static_cast<uint8_t>(100 + rng() % 56);
        k.sfb[g] = static_cast<uint8_t>(100 + rng() % 56);
      }
    }
    k.c = random_c(rng);
  }
  const std::vector<uint32_t> dev = run_on_device(cases, 1, gst_kernel);
  int bad = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const GstCase& k = cases[i];
    const uint32_t host =
        gst_fdpa_fp4_bits(k.a, k.b, k.sfa, k.sfb, static_cast<ScaleKind>(k.kind), k.c);
    if (host != dev[i] && ++bad <= 5)
      ADD_FAILURE() << "case " << i << " kind " << int(k.kind) << ": host 0x" << std::hex << host
                    << " device 0x" << dev[i];
  }
  std::printf("[mma-gpu] GST-FDPA: %zu random cases, %d differ\n", cases.size(), bad);
  EXPECT_EQ(bad, 0);
}

TEST(MmaGpu, Fp8Tfdpa_RandomBitPatterns_MatchHost) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  std::mt19937_64 rng(2027);
  std::vector<Fp8Case> cases(600000);  // two results each (Hopper, Blackwell)
  for (auto& k : cases) {
    k.fa_e5m2 = static_cast<uint8_t>(rng() % 2);
    k.fb_e5m2 = static_cast<uint8_t>(rng() % 2);
    for (int i = 0; i < 32; ++i) {
      const uint8_t ca = static_cast<uint8_t>(rng()), cb = static_cast<uint8_t>(rng());
      k.a[i] = k.fa_e5m2 ? e5m2_to_f32(ca) : e4m3_to_f32(ca);
      k.b[i] = k.fb_e5m2 ? e5m2_to_f32(cb) : e4m3_to_f32(cb);
      if (rng() % 64 == 0) k.a[i] = 0.0f;
    }
    k.c = random_c(rng);
  }
  const std::vector<uint32_t> dev = run_on_device(cases, 2, fp8_kernel);
  int bad = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Fp8Case& k = cases[i];
    const OperandFormat fa = k.fa_e5m2 ? kE5M2Operand : kE4M3Operand;
    const OperandFormat fb = k.fb_e5m2 ? kE5M2Operand : kE4M3Operand;
    const uint32_t h0 = f32_bits(tfdpa_fp8_hopper(k.a, k.b, k.c, fa, fb));
    const uint32_t h1 = f32_bits(tfdpa_fp8_blackwell(k.a, k.b, k.c, fa, fb));
    if ((h0 != dev[2 * i] || h1 != dev[2 * i + 1]) && ++bad <= 5)
      ADD_FAILURE() << "case " << i << ": host 0x" << std::hex << h0 << "/0x" << h1 << " device 0x"
                    << dev[2 * i] << "/0x" << dev[2 * i + 1];
  }
  std::printf("[mma-gpu] FP8 T-FDPA: %zu random cases x 2 instructions, %d differ\n", cases.size(),
              bad);
  EXPECT_EQ(bad, 0);
}

// The RHT's GPU forms (packed outputs with the device's conversions, max |y| from one rounding a
// chunk with the common path computed for every chunk, the input max from a NaN-propagating FP32
// tree) against the emu/ references on the host (rht16_packed, rht16_abs_max: the max over
// rht16's rounded outputs), over chunks at every scale, with NaN, Inf, zeros, subnormals and both
// ends of the BF16 range.
TEST(MmaGpu, Rht16_RandomChunks_MatchHost) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  std::mt19937_64 rng(2028);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<RhtCase> cases(1000000);
  for (size_t c = 0; c < cases.size(); ++c) {
    RhtCase& k = cases[c];
    const int kind = static_cast<int>(c % 8);
    const int center = kind == 0   ? 0
                       : kind == 1 ? -110
                       : kind == 2 ? 118
                                   : static_cast<int>(rng() % 240) - 120;
    const int spread = kind == 3 ? 40 : kind == 4 ? 1 : 8;
    for (int i = 0; i < 16; ++i) {
      const float v =
          std::ldexp(nd(rng), center + static_cast<int>(rng() % (2 * spread + 1)) - spread);
      k.x[i] = bf16_rne(v);
      const uint32_t r = static_cast<uint32_t>(rng() % 1000);
      if (r == 0) k.x[i] = 0x7FC0;                                              // NaN
      if (r == 1) k.x[i] = static_cast<uint16_t>(rng() & 1 ? 0x7F80 : 0xFF80);  // Inf
      if (r == 2) k.x[i] = static_cast<uint16_t>(rng() & 0x807F);               // subnormal or zero
      if (r == 3) k.x[i] = static_cast<uint16_t>(rng());                        // any pattern
    }
    if (kind == 5 && rng() % 4 == 0)
      for (int i = 0; i < 16; ++i)
        k.x[i] = static_cast<uint16_t>(rng() & 1 ? 0x8000 : 0);  // all zeros
  }
  const std::vector<uint32_t> dev = run_on_device(cases, 11, rht_kernel);
  int bad = 0;
  for (size_t c = 0; c < cases.size(); ++c) {
    uint32_t w[8];
    float in_packed = 0.0f, in_abs = 0.0f;
    rht16_packed(cases[c].x, w, &in_packed);
    const float ymax = rht16_abs_max(cases[c].x, &in_abs);
    uint32_t host[11];
    for (int k = 0; k < 8; ++k) host[k] = w[k];
    host[8] = f32_bits(in_packed);
    host[9] = f32_bits(ymax);
    host[10] = f32_bits(in_abs);
    for (int k = 0; k < 11; ++k) {
      if (host[k] != dev[11 * c + k] && ++bad <= 5)
        ADD_FAILURE() << "chunk " << c << " word " << k << ": host 0x" << std::hex << host[k]
                      << " device 0x" << dev[11 * c + k];
    }
  }
  std::printf("[mma-gpu] RHT: %zu random chunks x 11 words, %d differ\n", cases.size(), bad);
  EXPECT_EQ(bad, 0);
}

}  // namespace
}  // namespace fp4sim
