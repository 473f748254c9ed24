// Non-owning typed tensor views: what crosses the Backend interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fp4sim {

enum class DType : uint8_t { F32, BF16, U8, I32 };
enum class Device : uint8_t { Host, Cuda };

inline size_t dtype_size(DType t) {
  return t == DType::F32 || t == DType::I32 ? 4 : (t == DType::BF16 ? 2 : 1);
}
inline const char* dtype_name(DType t) {
  return t == DType::F32    ? "float32"
         : t == DType::BF16 ? "bfloat16"
         : t == DType::I32  ? "int32"
                            : "uint8";
}

// A row-major 2-D tensor: element (r, c) at data + (r * row_stride + c) * dtype_size. A view with
// null data is absent (an optional operand left out).
//
// dtype says what an op reads or writes: float32 or bfloat16 (BF16 bits) activations, gradients
// and weights; int32 token ids; uint8 codes. bf16_values marks a float32 tensor that holds BF16
// values (the model's BF16 activation storage kept in FP32 arrays): an op writing it rounds every
// value it writes to BF16 (RNE, NaN -> the canonical BF16 NaN); an op reading it reads every value
// rounded to BF16. Each op says which of its views may carry the mark; elsewhere it is an error
// (std::invalid_argument), never ignored.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::F32;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;  // in elements; 0 means cols
  Device device = Device::Host;
  const char* name = "tensor";  // for error messages
  bool bf16_values = false;

  int64_t stride() const { return row_stride ? row_stride : cols; }
  int64_t numel() const { return rows * cols; }
  bool present() const { return data != nullptr; }
  bool dense() const { return stride() == cols; }
  // BF16 storage of either kind: BF16 bits, or float32 holding BF16 values
  bool bf16_storage() const { return dtype == DType::BF16 || bf16_values; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data);
  }
};

std::string shape_str(int64_t rows, int64_t cols);

// A dense [rows, cols] view of p in `device` memory.
inline TensorView view_of(const void* p, DType dtype, int64_t rows, int64_t cols, Device device,
                          const char* name = "tensor", bool bf16_values = false) {
  TensorView v;
  v.data = const_cast<void*>(p);
  v.dtype = dtype;
  v.rows = rows;
  v.cols = cols;
  v.device = device;
  v.name = name;
  v.bf16_values = bf16_values;
  return v;
}

// A float32 [rows, cols] row-major view of host memory.
inline TensorView host_view(float* data, int64_t rows, int64_t cols, const char* name = "tensor") {
  return view_of(data, DType::F32, rows, cols, Device::Host, name);
}

}  // namespace fp4sim
