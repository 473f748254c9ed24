// The host workspace of CpuBackend's ops: the temporaries each op allocates beyond its views (BF16
// inputs widened to float32, operands transposed or prepared for the T-FDPA chains, the quantizer's
// transposed copy, the attention's per-thread head operands), in bytes at the op's peak. Memory
// plans (model/memory_plan.hpp) add them to the emulator's plan, and CpuBackend names them when one
// cannot be allocated. Each function follows the allocations of the op it is named for
// (emu/cpu_backend_ops.cpp, emu/cpu_backend.cpp, emu/matmul.cpp, emu/attention.cpp, emu/gemm.cpp):
// a change to an op's temporaries changes its function here.
#pragma once

#include <cstdint>
#include <new>

#include "emu/backend.hpp"

namespace fp4sim::emu::workspace {

// read(): a float32 copy of an input stored as BF16 bits or marked bf16_values (else none).
int64_t read_copy(const TensorView& v);
// target(): a float32 output buffer for an output stored as BF16 bits (else none).
int64_t target_copy(const TensorView& v);
// bf16_gemm_tn's prepared operands (M x K and N x K, K padded to 16: values as float and double,
// exponent readings, a flag a chunk); 0 at FP32 precision.
int64_t gemm_tn(int64_t M, int64_t N, int64_t K, GemmPrecision prec);

int64_t norm_forward(const TensorView& out);
int64_t norm_backward(const TensorView& dout);
int64_t matmul_forward(const TensorView& out, const TensorView& inp, const TensorView& weight,
                       const TensorView& bias, GemmPrecision prec);
int64_t matmul_backward(const TensorView& dinp, const TensorView& dweight, const TensorView& dout,
                        const TensorView& inp, const TensorView& weight, GemmPrecision prec);
int64_t bias_forward(const TensorView& out, const TensorView& bias);
// threads: the OpenMP threads the op's parallel loop runs on (omp_get_max_threads()).
int64_t attention_forward(const TensorView& out, const TensorView& qkv, const AttentionShape& s,
                          GemmPrecision prec, int threads);
int64_t attention_backward(const TensorView& dqkv, const TensorView& dout, const TensorView& qkv,
                           const TensorView& out, const AttentionShape& s, GemmPrecision prec,
                           int threads);
int64_t activation_backward(const TensorView& dout);
int64_t residual_forward(const TensorView& b);
int64_t crossentropy(const TensorView& dlogits, const TensorView& logits);
// x's float32 copy (BF16 or strided input) and the column-wise copy's transposed (or RHT) input.
int64_t quantize(const TensorView& x, const QuantizeConfig& cfg);
int64_t quant_error_sums(const QuantizedView& q);
// The exact GEMM's decoded operands (FP4: codes, sign and nonzero bits, scales per 64-chunk; FP8:
// values as float and double, exponent readings).
int64_t gemm(const QuantizedView& a, const QuantizedView& b);

// The Mamba-2 core's ops (emu/ssm.cpp, emu/cpu_backend_ops.cpp): the conv's transposed weight, the
// per-thread rows, states and chunk buffers, the backward passes' per-element terms. W: the conv
// width; threads: as above.
int64_t ssm_conv_forward(const SsmShape& s, int64_t W, int threads);
int64_t ssm_conv_backward(const SsmShape& s, int64_t W, int threads);
int64_t ssm_scan_forward(const SsmShape& s, int threads);
int64_t ssm_scan_backward(const SsmShape& s, int threads);
int64_t gated_norm_forward(int64_t C, int64_t G, int threads);
int64_t gated_norm_backward(const TensorView& dout, int64_t G, int threads);

// The AllocationError of an op whose temporaries could not be allocated: "cannot allocate the
// workspace of emu <op> on '<tensor>' (<bytes>) in host memory: out of host memory".
[[noreturn]] void fail(const char* op, const char* tensor, int64_t bytes);

// body(), with std::bad_alloc from the op's temporaries (bytes of them) named: fail(op, ...).
template <class Body>
auto named(const char* op, const TensorView& t, int64_t bytes, Body&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    fail(op, t.name, bytes);
  }
}

}  // namespace fp4sim::emu::workspace
