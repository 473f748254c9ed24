// The argument checks of the training-stack ops' CudaBackend methods (gpu/norm.cu, matmul.cu,
// attention.cu, ...): each throws naming the op and what was expected.
#pragma once

#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace fp4sim::gpu {

inline void require_rows(const char* op, int64_t rows) {
  if (rows < 0 || rows > INT_MAX)
    throw std::invalid_argument(std::string(op) + ": " + std::to_string(rows) +
                                " rows; expected 0.." + std::to_string(INT_MAX) +
                                " (one block per row)");
}

inline void require_heads(const char* op, int64_t NH, int64_t NKV, int64_t HD) {
  if (NH <= 0 || NKV <= 0 || NH % NKV != 0 || HD <= 0)
    throw std::invalid_argument(std::string(op) + ": NH=" + std::to_string(NH) +
                                " NKV=" + std::to_string(NKV) + " HD=" + std::to_string(HD) +
                                "; expected NH, NKV, HD > 0 and NH a multiple of NKV");
}

inline void require_one_of(const char* op, const char* tensor, const void* f32, const void* bf16) {
  if ((f32 == nullptr) == (bf16 == nullptr))
    throw std::logic_error(std::string(op) + ": exactly one of " + tensor + " and " + tensor +
                           "16 must be given (FP32 or BF16 storage)");
}

}  // namespace fp4sim::gpu
