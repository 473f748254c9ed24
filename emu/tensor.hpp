// Non-owning tensor views: what crosses the Backend interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fp4sim {

enum class DType : uint8_t { F32, BF16, U8 };
enum class Device : uint8_t { Host, Cuda };

inline size_t dtype_size(DType t) { return t == DType::F32 ? 4 : (t == DType::BF16 ? 2 : 1); }
inline const char* dtype_name(DType t) {
  return t == DType::F32 ? "float32" : (t == DType::BF16 ? "bfloat16" : "uint8");
}

// A row-major 2-D tensor: element (r, c) at data + (r * row_stride + c) * dtype_size.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::F32;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;  // in elements; 0 means cols
  Device device = Device::Host;
  const char* name = "tensor";  // for error messages

  int64_t stride() const { return row_stride ? row_stride : cols; }
  int64_t numel() const { return rows * cols; }
};

std::string shape_str(int64_t rows, int64_t cols);

// A float32 [rows, cols] row-major view of host memory.
inline TensorView host_view(float* data, int64_t rows, int64_t cols, const char* name = "tensor") {
  TensorView v;
  v.data = data;
  v.rows = rows;
  v.cols = cols;
  v.name = name;
  return v;
}

}  // namespace fp4sim
