// Exact block-scaled FP4 GEMM on the GPU: one thread per output element, walking K in increasing
// 64-wide chunks through the shared GST-FDPA function (emu/mma.hpp), so its bits are the
// emulator's by construction. Correctness first: no tiling or tensor cores yet.
#include <cuda_runtime.h>

#include "emu/gemm.hpp"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"

namespace fp4sim::gpu {
namespace {

// Chunk ch of row r: 32 packed code bytes and the chunk's scale bytes, zero-padded past K.
__device__ void gather_chunk(const QuantizedView& q, int64_t r, int64_t ch, uint8_t* packed,
                             uint8_t* scales) {
  const int64_t K = q.cols, k0 = ch * kGemmChunk;
  const int64_t block = q.format == QFormat::MXFP4 ? kMxfp4Block : kNvfp4Block;
  const int64_t spr = K / block;
  if (k0 + kGemmChunk <= K) {
    const uint8_t* src = q.codes + (r * K + k0) / 2;
    for (int i = 0; i < kGemmChunk / 2; ++i) packed[i] = src[i];
  } else {
    for (int i = 0; i < kGemmChunk / 2; ++i)
      packed[i] = (k0 + 2 * i < K) ? q.codes[(r * K + k0) / 2 + i] : uint8_t(0);
  }
  const int nscales = q.format == QFormat::MXFP4 ? 2 : 4;
  for (int s = 0; s < nscales; ++s) {
    const int64_t kk = k0 + s * (kGemmChunk / nscales);
    scales[s] = kk < K ? q.scales[r * spr + kk / block] : uint8_t(0);
  }
}

__global__ void gemm_exact_kernel(QuantizedView a, QuantizedView b, const float* c, GemmConfig cfg,
                                  void* out) {
  const int64_t N = b.rows;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.rows * N) return;
  const int64_t m = idx / N, n = idx % N;
  const int64_t chunks = gemm_chunks(a.cols), per_split = chunks / cfg.split_k;
  const ScaleKind kind = a.format == QFormat::MXFP4 ? ScaleKind::UE8M0_32 : ScaleKind::UE4M3_16;
  float total = 0.0f;
  for (int s = 0; s < cfg.split_k; ++s) {
    float acc = 0.0f;
    for (int64_t ch = s * per_split; ch < (s + 1) * per_split; ++ch) {
      uint8_t pa[kGemmChunk / 2], pb[kGemmChunk / 2], sa[4], sb[4];
      gather_chunk(a, m, ch, pa, sa);
      gather_chunk(b, n, ch, pb, sb);
      acc = f32_from_bits(gst_fdpa_fp4_bits(pa, pb, sa, sb, kind, acc));
    }
    total = s == 0 ? acc : fadd_rn(total, acc);
  }
  const float alpha =
      gemm_epilogue_alpha(cfg.alpha, a.format, *a.amax, a.four_over_six, *b.amax, b.four_over_six);
  const float d = gemm_epilogue(alpha, total, cfg.beta, c ? c[idx] : 0.0f);
  if (cfg.out == GemmOut::BF16)
    static_cast<uint16_t*>(out)[idx] = bf16_rne(d);
  else
    static_cast<float*>(out)[idx] = d;
}

}  // namespace

void gemm_exact_launch(const QuantizedView& a, const QuantizedView& b, const float* c,
                       const GemmConfig& cfg, void* out, cudaStream_t stream) {
  const int64_t n = a.rows * b.rows;
  const int threads = 128;
  gemm_exact_kernel<<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0, stream>>>(
      a, b, c, cfg, out);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

}  // namespace fp4sim::gpu
