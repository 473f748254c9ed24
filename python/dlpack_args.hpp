// DLPack tensors as the Python module's arguments and results (DESIGN.md §15): a producer's tensor
// (PyTorch, JAX, CuPy; on the host or a CUDA GPU) read and written in place through its DLPack
// capsule, and DeviceArray, a result in GPU memory that consumers take through __dlpack__.
// The backends the module runs on live here too: one emulator, and one CUDA backend per (device,
// stream), made on first use and kept, so that a call pays for no handle or workspace creation.
#pragma once

#include <dlpack/dlpack.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "emu/backend.hpp"

namespace fp4sim::py_args {

namespace py = pybind11;

// A borrowed DLPack tensor: the capsule keeps the producer's memory alive while this lives (it is
// never renamed "used_dltensor", so the producer's capsule destructor releases the tensor).
struct DlTensor {
  py::object capsule;
  const DLTensor* t = nullptr;
  std::vector<int64_t> shape;
  bool cuda() const { return t->device.device_type == kDLCUDA; }
  int device_index() const { return static_cast<int>(t->device.device_id); }
  int64_t numel() const;
};

// obj: a DLPack capsule, or an object with __dlpack__ (called with stream= where given). `where`
// names the argument in errors ("fp4sim.torch.Linear: x"). Host, CUDA and CUDA-managed memory only.
DlTensor dlpack_arg(const py::handle& obj, const std::string& where,
                    const py::object& stream = py::none());

// The tensor as a [rows, cols] TensorView (rows = the product of all but the last dimension) of
// one of `dtypes`, C-contiguous (a 1-D tensor is [1, n]); TypeError / ValueError naming `where`
// otherwise. `name` is the view's name (it must outlive the view: a literal).
TensorView matrix_view(const DlTensor& d, const std::string& where,
                       const std::vector<DType>& dtypes, const char* name);

// The backend a call runs on: "emu", or "cuda" on `device` and `stream` (a cudaStream_t as an
// integer, 0 = the legacy default stream). Kept for the module's lifetime.
Backend& module_backend(const std::string& name, int device = 0, uintptr_t stream = 0);

// A result in device memory, exported through DLPack (consumer stream given: it waits for the
// stream the result was written on; the array stays alive while a consumer holds it).
class DeviceArray {
 public:
  DeviceArray(Backend& be, DType dtype, std::vector<int64_t> shape, int device, uintptr_t stream,
              const char* label);
  void* data() const { return buf_.get(); }
  const std::vector<int64_t>& shape() const { return shape_; }
  DType dtype() const { return dtype_; }
  int64_t numel() const;
  // Bytes to the host (numpy), on the backend's stream, then synchronized.
  py::object to_numpy() const;
  py::capsule dlpack(const py::object& self, const py::object& consumer_stream) const;
  py::tuple dlpack_device() const { return py::make_tuple(static_cast<int>(kDLCUDA), device_); }

 private:
  Backend* be_;
  BackendBuffer buf_;
  DType dtype_;
  std::vector<int64_t> shape_;
  int device_;
  uintptr_t stream_;
};

// Registers DeviceArray with the module (`__dlpack__`, `__dlpack_device__`, shape, dtype, numpy()).
void register_device_array(py::module_& m);

}  // namespace fp4sim::py_args
