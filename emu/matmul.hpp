// Reference matmuls of the training stack: the BF16 GEMM as the tensor core computes it (and a
// plain FP32 one for gradient checks), the linear layer's forward and backward, and its bias add
// and bias gradient in the chunked order both backends share. The CUDA twins (gpu/matmul.cu) keep
// these names and argument orders.
#pragma once

#include <cstdint>

namespace fp4sim::emu {

// BF16 GEMM as the tensor core computes it (DESIGN.md §8): out (M,N) = A (M,K) * B (N,K)^T with
// both operands rounded to BF16 (RNE) and each output a chain of T-FDPA(L=16, F=25, RZ) over K in
// increasing order from +0 (K padded with zeros to a multiple of 16). Exact emulation: slow.
void bf16_gemm_tn(float* out, const float* a, const float* b, int64_t M, int64_t N, int64_t K);

// out (M,N) = A (M,K) * B (N,K)^T in plain FP32 (index-order sums): for gradient checks, where
// BF16 rounding would make finite differences meaningless.
void fp32_gemm_tn(float* out, const float* a, const float* b, int64_t M, int64_t N, int64_t K);

enum class GemmPrecision { BF16, FP32 };

// out (N,OC) += bias (OC) broadcast over rows (FP32 RN); dbias (OC) += column sums of dout (N,OC)
// in a fixed chunking both backends share: rows in chunks of kColumnChunkRows, each chunk summed in
// FP32 from +0 in increasing n, the chunk sums added in increasing order, then added to dbias (the
// bias half of matmul_forward/backward, also used alone by layers whose GEMMs are quantized).
constexpr int64_t kColumnChunkRows = 64;
void bias_forward(float* out, const float* bias, int64_t N, int64_t OC);
void bias_backward(float* dbias, const float* dout, int64_t N, int64_t OC);

// Linear layer y = x W^T + bias (x (N,K), W (OC,K), y (N,OC)), the GEMMs in BF16 as above.
void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N,
                    int64_t K, int64_t OC, GemmPrecision prec = GemmPrecision::BF16);
// dinp (N,K) = dout W (written: what dinp held does not matter); dweight (OC,K) += dout^T inp;
// dbias (OC) += column sums of dout (FP32, bias_backward's order).
// Any of dinp, dweight, dbias may be null (that product is skipped).
void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t N, int64_t K, int64_t OC,
                     GemmPrecision prec = GemmPrecision::BF16);

}  // namespace fp4sim::emu
