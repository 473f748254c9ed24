// Tier 1 on the device: every FP32 bit pattern through each conversion, computed by a kernel with
// the device's formulation (gpu/formats_device.cuh where the device has its own, else the emu/
// function itself) and on the host by the emu/ reference, compared through per-slice hashes (all
// 2^32 inputs, every format); the first differing slice of a format is then compared input by
// input and its first mismatch printed.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "emu/formats.hpp"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/decode_bf16.cuh"
#include "gpu/exp2.cuh"
#include "gpu/formats_device.cuh"

namespace fp4sim {
namespace {

constexpr int kFormats = 15;
constexpr int kSliceBits = 22;  // 1024 slices of 4M inputs
constexpr uint64_t kSlices = 1ull << (32 - kSliceBits);

// The inputs of input bits u: x, and for the multi-input conversions more bijections of u (every
// 2^32 pattern once in each position over the run; a sign flip of x among them). bf16x16: u's two
// halves as BF16 patterns a (low) and b, alternating, in the other order in the second half of the
// chunk: every pair of BF16 patterns meets in the tree's first step, in both operand orders.
struct Inputs {
  float x, ax;
  float v8[8];
  uint8_t sr_byte;
  uint32_t r0, r1;
  uint8_t code_nonneg;
  uint16_t bf16x16[16];
};
FP4SIM_HD Inputs inputs_of(uint32_t u) {
  Inputs in;
  in.x = f32_from_bits(u);
  in.ax = f32_from_bits(u & 0x7FFFFFFFu);
  const uint32_t v[8] = {u,  u * 0x2545F491u, u ^ 0x80000000u, u * 0x9E3779B1u,
                         ~u, u * 0x85EBCA6Bu, u * 0xC2B2AE35u, u * 0x27D4EB2Fu};
  for (int i = 0; i < 8; ++i) in.v8[i] = f32_from_bits(v[i]);
  in.sr_byte = static_cast<uint8_t>((u * 0x9E3779B1u) >> 24);
  in.r0 = u * 0x9E3779B1u;
  in.r1 = ~u * 0x85EBCA6Bu;
  in.code_nonneg = static_cast<uint8_t>(u % 0x7Fu);
  const uint16_t a = static_cast<uint16_t>(u), b = static_cast<uint16_t>(u >> 16);
  for (int i = 0; i < 16; ++i) in.bf16x16[i] = ((i & 1) != 0) != (i >= 8) ? b : a;
  return in;
}

// The emu/ reference, one result per format. The block-scale forms (index 9, 10) are e4m3_rn_
// satfinite and e4m3_to_f32 on their domains (|x| of a non-NaN x; codes 0..0x7E); the eight-code
// words (11, 12) take their products times `one`, a kernel argument, so that the device computes
// them (its sign bytes rely on a NaN product being positive). The BF16 conversions (4, 13) include
// every NaN; the largest BF16 magnitude (14) sees every pair of BF16 patterns (gpu/
// formats_device.cuh says why that covers every chunk).
FP4SIM_HD void convert_all_reference(uint32_t u, float one, uint32_t* out) {
  const Inputs in = inputs_of(u);
  const float* v = in.v8;
  out[0] = e2m1_rn_satfinite(in.x);
  out[1] = e2m1_rs_satfinite(in.x, in.sr_byte);
  out[2] = e4m3_rn_satfinite(in.x);
  out[3] = e5m2_rn_satfinite(in.x);
  out[4] = bf16_rne(in.x);
  out[5] = ue8m0_rz_satfinite(in.x);
  out[6] = ue8m0_rp_satfinite(in.x);
  out[7] = e4m3x2_rn_satfinite(in.x, v[1]);
  out[8] = e4m3x4_rn_satfinite(in.x, v[1], v[3], v[4]);
  out[9] = f32_isnan(in.ax) ? 0u : e4m3_rn_satfinite(in.ax);
  out[10] = f32_bits(e4m3_to_f32(in.code_nonneg));
  out[11] = e2m1x8_rn_scaled(v, one);
  out[12] = e2m1x8_rs_scaled(v, one, in.r0, in.r1);
  out[13] = bf16x2_rne(in.x, v[1]);
  out[14] = bf16x16_max_magnitude_bits(in.bf16x16);
}

// The device's formulations, the same slots.
__device__ void convert_all_device(uint32_t u, float one, uint32_t* out) {
  const Inputs in = inputs_of(u);
  const float* v = in.v8;
  out[0] = gpu::e2m1_rn_satfinite_magic(in.x);
  out[1] = gpu::e2m1_rs_satfinite_magic(in.x, in.sr_byte);
  out[2] = gpu::e4m3_rn_satfinite_cvt(in.x);
  out[3] = e5m2_rn_satfinite(in.x);
  out[4] = gpu::bf16_rne_cvt(in.x);
  out[5] = ue8m0_rz_satfinite(in.x);
  out[6] = ue8m0_rp_satfinite(in.x);
  out[7] = gpu::e4m3x2_rn_satfinite_cvt(in.x, v[1]);
  out[8] = gpu::e4m3x4_rn_satfinite_cvt(in.x, v[1], v[3], v[4]);
  out[9] = f32_isnan(in.ax) ? 0u : gpu::e4m3_rn_satfinite_nonneg_cvt(in.ax);
  out[10] = f32_bits(gpu::e4m3_to_f32_nonneg_cvt(in.code_nonneg));
  out[11] = gpu::e2m1x8_rn_scaled_prmt(v, one);
  out[12] = gpu::e2m1x8_rs_scaled_prmt(v, one, in.r0, in.r1);
  out[13] = gpu::bf16x2_rne_cvt(in.x, v[1]);
  out[14] = gpu::bf16x16_max_magnitude_bits_fmnmx(in.bf16x16);
}

FP4SIM_HD uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  return h;
}

// Order-independent slice hash: sum over inputs of mix(u, result) (wrapping).
__global__ void hash_kernel(uint64_t* hashes, float one) {
  const uint64_t slice = blockIdx.x;
  uint64_t local[kFormats] = {};
  for (uint32_t i = threadIdx.x; i < (1u << kSliceBits); i += blockDim.x) {
    const uint32_t u = static_cast<uint32_t>((slice << kSliceBits) | i);
    uint32_t r[kFormats];
    convert_all_device(u, one, r);
    for (int f = 0; f < kFormats; ++f) local[f] += mix(u, r[f]);
  }
  for (int f = 0; f < kFormats; ++f)
    atomicAdd(reinterpret_cast<unsigned long long*>(&hashes[slice * kFormats + f]),
              static_cast<unsigned long long>(local[f]));
}

// Every result of one slice (input i's format f at i * kFormats + f), for the first-mismatch
// search.
__global__ void slice_results_kernel(uint64_t slice, float one, uint32_t* out) {
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < (1u << kSliceBits);
       i += gridDim.x * blockDim.x) {
    const uint32_t u = static_cast<uint32_t>((slice << kSliceBits) | i);
    convert_all_device(u, one, out + static_cast<uint64_t>(i) * kFormats);
  }
}

// The first input of `slice` where format f's device result differs from the reference, printed.
void print_first_mismatch(uint64_t slice, int f, const char* name) {
  const uint64_t n = (1ull << kSliceBits) * kFormats;
  uint32_t* d = nullptr;
  FP4SIM_CUDA_CHECK(cudaMalloc(&d, n * sizeof(uint32_t)));
  slice_results_kernel<<<1024, 256>>>(slice, 1.0f, d);
  FP4SIM_CUDA_CHECK_LAUNCH();
  std::vector<uint32_t> dev(n);
  FP4SIM_CUDA_CHECK(cudaMemcpy(dev.data(), d, n * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  cudaFree(d);
  for (uint32_t i = 0; i < (1u << kSliceBits); ++i) {
    const uint32_t u = static_cast<uint32_t>((slice << kSliceBits) | i);
    uint32_t r[kFormats];
    convert_all_reference(u, 1.0f, r);
    if (r[f] != dev[static_cast<uint64_t>(i) * kFormats + f]) {
      std::printf("[formats-gpu] %s first mismatch: input 0x%08x, device 0x%08x, emu 0x%08x\n",
                  name, u, dev[static_cast<uint64_t>(i) * kFormats + f], r[f]);
      return;
    }
  }
  std::printf("[formats-gpu] %s: slice %llu hashes differ, no input differs\n", name,
              static_cast<unsigned long long>(slice));
}

TEST(FormatsGpu, AllFp32BitPatternsMatchEmulator) {
  if (!gpu::gpu_available()) GTEST_SKIP() << "no CUDA GPU";
  uint64_t* d = nullptr;
  FP4SIM_CUDA_CHECK(cudaMalloc(&d, kSlices * kFormats * sizeof(uint64_t)));
  FP4SIM_CUDA_CHECK(cudaMemset(d, 0, kSlices * kFormats * sizeof(uint64_t)));
  hash_kernel<<<kSlices, 256>>>(d, 1.0f);
  FP4SIM_CUDA_CHECK_LAUNCH();
  std::vector<uint64_t> gpu(kSlices * kFormats);
  FP4SIM_CUDA_CHECK(
      cudaMemcpy(gpu.data(), d, gpu.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  cudaFree(d);
  std::vector<uint64_t> host(kSlices * kFormats, 0);
#pragma omp parallel for schedule(dynamic)
  for (int64_t s = 0; s < static_cast<int64_t>(kSlices); ++s) {
    uint64_t local[kFormats] = {};
    for (uint32_t i = 0; i < (1u << kSliceBits); ++i) {
      const uint32_t u = static_cast<uint32_t>((static_cast<uint64_t>(s) << kSliceBits) | i);
      uint32_t r[kFormats];
      convert_all_reference(u, 1.0f, r);
      for (int f = 0; f < kFormats; ++f) local[f] += mix(u, r[f]);
    }
    for (int f = 0; f < kFormats; ++f) host[s * kFormats + f] = local[f];
  }
  const char* names[kFormats] = {
      "e2m1.rn",          "e2m1.rs",   "e4m3",      "e5m2",   "bf16",
      "ue8m0.rz",         "ue8m0.rp",  "e4m3x2",    "e4m3x4", "e4m3.nonneg",
      "e4m3->f32.nonneg", "e2m1x8.rn", "e2m1x8.rs", "bf16x2", "bf16x16.max"};
  for (int f = 0; f < kFormats; ++f) {
    int bad = 0;
    uint64_t first = kSlices;
    for (uint64_t s = 0; s < kSlices; ++s) {
      const bool differs = host[s * kFormats + f] != gpu[s * kFormats + f];
      bad += differs;
      if (differs && first == kSlices) first = s;
    }
    std::printf("[formats-gpu] %-9s 2^32 inputs, %d of %llu slices differ\n", names[f], bad,
                static_cast<unsigned long long>(kSlices));
    if (first != kSlices) print_first_mismatch(first, f, names[f]);
    EXPECT_EQ(bad, 0) << names[f];
  }
}

// The NVFP4 decode of saved copies (decode8_bf16_nvfp4: byte permutes and a packed BF16 multiply)
// against the FP32 formulation (decode8_bf16) for every scale byte: 2^16 code words a scale (every
// pair of bytes, repeated in the word's halves: every code in every position, with both signs)
// plus 2^16 hashed words; the same BF16 bits, a NaN for a NaN.
__global__ void decode_compare_kernel(unsigned long long* mismatches) {
  const uint8_t scale = static_cast<uint8_t>(blockIdx.x);
  const float sv = e4m3_to_f32(scale);
  unsigned long long bad = 0;
  for (uint32_t i = threadIdx.x; i < (1u << 17); i += blockDim.x) {
    const uint32_t p = i & 0xFFFFu;
    const uint32_t w = i < (1u << 16) ? (p | (p << 16)) : (p * 0x9E3779B1u) ^ (scale * 0x85EBCA6Bu);
    alignas(16) uint16_t a[8], b[8];
    gpu::decode8_bf16(w, sv, a);
    gpu::decode8_bf16_nvfp4(w, sv, b);
    for (int k = 0; k < 8; ++k) {
      const bool nan_a = (a[k] & 0x7FFFu) > 0x7F80u, nan_b = (b[k] & 0x7FFFu) > 0x7F80u;
      bad += (nan_a || nan_b) ? (nan_a != nan_b) : (a[k] != b[k]);
    }
  }
  atomicAdd(mismatches, bad);
}

TEST(FormatsGpu, Nvfp4DecodeEqualsFp32Formulation) {
  if (!gpu::gpu_available()) GTEST_SKIP() << "no CUDA GPU";
  unsigned long long* d = nullptr;
  FP4SIM_CUDA_CHECK(cudaMalloc(&d, sizeof(unsigned long long)));
  FP4SIM_CUDA_CHECK(cudaMemset(d, 0, sizeof(unsigned long long)));
  decode_compare_kernel<<<256, 256>>>(d);
  FP4SIM_CUDA_CHECK_LAUNCH();
  unsigned long long bad = 0;
  FP4SIM_CUDA_CHECK(cudaMemcpy(&bad, d, sizeof bad, cudaMemcpyDeviceToHost));
  cudaFree(d);
  std::printf(
      "[formats-gpu] decode8_bf16_nvfp4: 256 scales x 2^17 words x 8, %llu elements differ\n", bad);
  EXPECT_EQ(bad, 0u);
}

// exp2_ftz (ex2.approx.ftz), which the attention and cross-entropy kernels rely on for two things:
// an integer power of two is exact (2^0 = 1: a softmax row's maximum gives exactly 1, so its sum
// is >= 1), and any other result is within about 2 ulp of 2^x (against exp2 in double for 2^20
// arguments spread over [-126, 0]: the H200's worst was 2.05 ulp of the exact value, 2026-12-01;
// below 2^-126 the result is +0).
__global__ void exp2_check_kernel(float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n)
    out[i] = gpu::exp2_ftz(i < 254 ? static_cast<float>(i - 126) : -126.0f * (i - 254) / (n - 254));
}

TEST(FormatsGpu, Exp2FtzExactPowersAndAboutTwoUlp) {
  if (!gpu::gpu_available()) GTEST_SKIP() << "no CUDA GPU";
  const int n = 254 + (1 << 20);
  float* d = nullptr;
  FP4SIM_CUDA_CHECK(cudaMalloc(&d, sizeof(float) * n));
  exp2_check_kernel<<<(n + 255) / 256, 256>>>(d, n);
  FP4SIM_CUDA_CHECK_LAUNCH();
  std::vector<float> h(static_cast<size_t>(n));
  FP4SIM_CUDA_CHECK(cudaMemcpy(h.data(), d, sizeof(float) * n, cudaMemcpyDeviceToHost));
  cudaFree(d);
  for (int i = 0; i < 254; ++i) EXPECT_EQ(h[i], std::ldexp(1.0f, i - 126)) << "2^" << i - 126;
  double worst = 0;
  for (int i = 254; i < n; ++i) {
    const float x =
        -126.0f * (i - 254) / (n - 254);  // (the kernel's argument, the same FP32 steps)
    const double ref = std::exp2(static_cast<double>(x));
    const double ulp = std::ldexp(1.0, std::ilogb(ref) - 23);
    worst = std::max(worst, std::fabs(static_cast<double>(h[i]) - ref) / ulp);
  }
  std::printf(
      "[formats-gpu] exp2_ftz: 2^k exact for k in [-126, 127]; worst error %.2f ulp over 2^20 "
      "arguments\n",
      worst);
  EXPECT_LE(worst, 2.5);
}

}  // namespace
}  // namespace fp4sim
