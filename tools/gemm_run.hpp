// fp4sim gemm's work once its operands are in memory, shared by the CLI (tools/cmd_gemm.cpp) and
// the Python module (fp4sim.gemm), so both give the same bits and the same warnings: the float
// operands' quantization, the checks (shapes, C, the epilogue scale's overflow and underflow), the
// GEMM on a backend and, for cuBLASLt, its distance to the exact GEMM.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "emu/backend.hpp"

namespace fp4sim::cli {

// A float32 operand [rows, cols] quantized as `fp4sim gemm A.npy B.npy` does: RN, row-wise, 1x16
// (NVFP4), 1x32 (MXFP4) or 1x128 (FP8) blocks, on the emulator. Warnings: NaN and Inf among the
// values ("A (path) holds ...").
QuantizedHost quantize_gemm_operand(std::vector<float>& x, int64_t rows, int64_t cols, QFormat fmt,
                                    const char* name, const std::string& source,
                                    std::vector<std::string>* warnings);

// The GEMM on a backend, no checks (validate_gemm's are the backend's): D's raw bits (BF16 in the
// low half), *ms its time.
std::vector<uint32_t> run_gemm_on(Backend& be, QuantizedHost& a, QuantizedHost& b,
                                  std::vector<float>* c, const GemmConfig& cfg, double* ms);

// The checks of D = A * B^T (+ C) before any work (validate_gemm's, D's size;
// std::invalid_argument) and the warnings on NVFP4's epilogue scale (overflow, underflow) from the
// copies' amaxes (a and b need their shapes and formats only).
void check_gemm(const QuantizedView& a, float amax_a, const QuantizedView& b, float amax_b,
                bool has_c, const GemmConfig& cfg, std::vector<std::string>* warnings);

struct GemmRun {
  std::vector<uint32_t> bits;  // D's elements: FP32 bits, or BF16 bits in the low half
  std::string backend;         // the backend's name
  double ms = 0;               // the GEMM's time
  double cublaslt_vs_exact = -1, ms_exact = 0;  // cuBLASLt: max |D - D_exact| (finite pairs)
  std::vector<std::string> warnings;            // appended to the caller's
};

// D = alpha * A * B^T (+ beta * C) on the named backend ("" = the default one) with cfg (impl,
// out, alpha, beta, split_k). c: float32 [M, N] or null ("c_source" names it in errors and
// warnings). Every shape or option error is thrown (std::invalid_argument) before any work.
GemmRun run_gemm_checked(QuantizedHost& a, QuantizedHost& b, std::vector<float>* c,
                         const std::string& c_source, const GemmConfig& cfg,
                         const std::string& backend_name);

}  // namespace fp4sim::cli
