#include "python/dlpack_args.hpp"

#include <pybind11/numpy.h>

#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <utility>

#include "tools/backends.hpp"

namespace fp4sim::py_args {

namespace {

const char* dl_dtype_name(const DLDataType& t) {
  if (t.lanes != 1) return "a vector dtype";
  if (t.code == kDLFloat && t.bits == 32) return "float32";
  if (t.code == kDLFloat && t.bits == 16) return "float16";
  if (t.code == kDLFloat && t.bits == 64) return "float64";
  if (t.code == kDLBfloat && t.bits == 16) return "bfloat16";
  if (t.code == kDLUInt && t.bits == 8) return "uint8";
  if (t.code == kDLUInt && t.bits == 16) return "uint16";
  if (t.code == kDLInt && t.bits == 32) return "int32";
  if (t.code == kDLInt && t.bits == 64) return "int64";
  return "another dtype";
}

// The DType a DLPack dtype is read as (bfloat16 and uint16 both as BF16 bits), or false.
bool as_dtype(const DLDataType& t, DType* out) {
  if (t.lanes != 1) return false;
  if (t.code == kDLFloat && t.bits == 32)
    *out = DType::F32;
  else if ((t.code == kDLBfloat || t.code == kDLUInt) && t.bits == 16)
    *out = DType::BF16;
  else if (t.code == kDLUInt && t.bits == 8)
    *out = DType::U8;
  else if (t.code == kDLInt && t.bits == 32)
    *out = DType::I32;
  else
    return false;
  return true;
}

DLDataType dl_dtype_of(DType d) {
  switch (d) {
    case DType::F32:
      return {kDLFloat, 32, 1};
    case DType::BF16:
      return {kDLBfloat, 16, 1};
    case DType::U8:
      return {kDLUInt, 8, 1};
    case DType::I32:
      return {kDLInt, 32, 1};
  }
  return {kDLFloat, 32, 1};
}

int64_t product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

int64_t DlTensor::numel() const { return product(shape); }

DlTensor dlpack_arg(const py::handle& obj, const std::string& where, const py::object& stream) {
  DlTensor d;
  if (PyCapsule_CheckExact(obj.ptr())) {
    d.capsule = py::reinterpret_borrow<py::object>(obj);
  } else if (py::hasattr(obj, "__dlpack__")) {
    d.capsule = stream.is_none() ? obj.attr("__dlpack__")()
                                 : obj.attr("__dlpack__")(py::arg("stream") = stream);
  } else {
    throw py::type_error(where + ": " + py::str(py::type::of(obj)).cast<std::string>() +
                         " is not a DLPack tensor (a torch.Tensor, JAX array or numpy array)");
  }
  if (!PyCapsule_IsValid(d.capsule.ptr(), "dltensor"))
    throw py::value_error(where +
                          ": the DLPack capsule was already consumed or is not a 'dltensor' "
                          "capsule (DLPack 0.x)");
  auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(d.capsule.ptr(), "dltensor"));
  d.t = &m->dl_tensor;
  const int dev = d.t->device.device_type;
  if (dev != kDLCPU && dev != kDLCUDA && dev != kDLCUDAHost && dev != kDLCUDAManaged)
    throw py::value_error(where + ": DLPack device type " + std::to_string(dev) +
                          " is neither the host nor a CUDA GPU");
  d.shape.assign(d.t->shape, d.t->shape + d.t->ndim);
  return d;
}

TensorView matrix_view(const DlTensor& d, const std::string& where,
                       const std::vector<DType>& dtypes, const char* name) {
  DType dt;
  bool ok = as_dtype(d.t->dtype, &dt);
  if (ok) {
    ok = false;
    for (DType x : dtypes) ok = ok || x == dt;
  }
  if (!ok) {
    std::string want;
    for (DType x : dtypes) want += std::string(want.empty() ? "" : " or ") + dtype_name(x);
    throw py::type_error(where + ": dtype " + dl_dtype_name(d.t->dtype) + ", expected " + want +
                         " (nothing is converted silently)");
  }
  if (d.t->ndim < 1) throw py::value_error(where + ": a 0-D tensor (expected at least 1-D)");
  if (d.t->strides) {  // C-contiguous: each stride the product of the later sizes
    int64_t expect = 1;
    for (int i = d.t->ndim - 1; i >= 0; --i) {
      if (d.t->shape[i] != 1 && d.t->strides[i] != expect)
        throw py::value_error(where +
                              ": the tensor is not C-contiguous (.contiguous() makes a copy)");
      expect *= d.t->shape[i];
    }
  }
  TensorView v;
  v.dtype = dt;
  v.cols = d.shape.back();
  v.rows = v.cols ? d.numel() / v.cols : 0;
  v.data = static_cast<char*>(d.t->data) + d.t->byte_offset;
  v.device = d.cuda() ? Device::Cuda : Device::Host;
  v.name = name;
  return v;
}

Backend& module_backend(const std::string& name, int device, uintptr_t stream) {
  // (never destroyed: results alive at interpreter exit release their memory through them, and
  // the CUDA runtime may be torn down before static destructors would run)
  static std::mutex mu;
  static auto* emu = new std::unique_ptr<Backend>;
  static auto* cuda = new std::map<std::pair<int, uintptr_t>, std::unique_ptr<Backend>>;
  std::lock_guard<std::mutex> lock(mu);
  if (name == "emu") {
    if (!*emu) *emu = make_backend("emu");
    return **emu;
  }
  if (name != "cuda") throw py::value_error("backend '" + name + "' (valid: emu, cuda)");
  auto& b = (*cuda)[{device, stream}];
  if (!b)
    b = make_cuda_backend_on_stream(device, reinterpret_cast<void*>(stream));
  else
    cuda_set_device(device);  // (the calling thread's current device may be another one now)
  return *b;
}

DeviceArray::DeviceArray(Backend& be, DType dtype, std::vector<int64_t> shape, int device,
                         uintptr_t stream, const char* label)
    : be_(&be), dtype_(dtype), shape_(std::move(shape)), device_(device), stream_(stream) {
  buf_ = BackendBuffer(be, static_cast<size_t>(numel()) * dtype_size(dtype),
                       BufferLabel{"python result", label});
}

int64_t DeviceArray::numel() const { return product(shape_); }

py::object DeviceArray::to_numpy() const {
  std::vector<py::ssize_t> shape(shape_.begin(), shape_.end());
  py::array out;
  switch (dtype_) {
    case DType::F32:
      out = py::array_t<float>(shape);
      break;
    case DType::BF16:
      out = py::array_t<uint16_t>(shape);
      break;
    case DType::U8:
      out = py::array_t<uint8_t>(shape);
      break;
    case DType::I32:
      out = py::array_t<int32_t>(shape);
      break;
  }
  if (numel()) be_->download(out.mutable_data(), buf_.get(), buf_.bytes());
  return py::object(std::move(out));
}

namespace {
struct Export {
  DLManagedTensor m{};
  std::vector<int64_t> shape;
  py::object owner;  // the DeviceArray, alive while the consumer holds the tensor
};
void export_deleter(DLManagedTensor* self) {
  py::gil_scoped_acquire gil;
  delete static_cast<Export*>(self->manager_ctx);
}
}  // namespace

py::capsule DeviceArray::dlpack(const py::object& self, const py::object& consumer_stream) const {
  if (!consumer_stream.is_none()) {
    const auto s = consumer_stream.cast<int64_t>();
    if (s == 0)
      throw py::value_error(
          "__dlpack__: stream 0 is ambiguous for CUDA (DLPack: 1 = the legacy "
          "default stream, 2 = per-thread, else a cudaStream_t)");
    // (-1: the consumer synchronizes itself; 1 and the null stream are both the legacy default
    // stream, which a torch tensor's default stream reports as 0 and torch.from_dlpack asks as 1)
    const uintptr_t consumer = static_cast<uintptr_t>(s), producer = stream_ ? stream_ : 1;
    if (s != -1 && consumer != producer)
      cuda_stream_wait(reinterpret_cast<void*>(consumer), reinterpret_cast<void*>(stream_));
  }
  auto* e = new Export;
  e->shape = shape_;
  e->owner = self;
  e->m.dl_tensor.data = buf_.get();
  e->m.dl_tensor.device = {kDLCUDA, device_};
  e->m.dl_tensor.ndim = static_cast<int32_t>(shape_.size());
  e->m.dl_tensor.dtype = dl_dtype_of(dtype_);
  e->m.dl_tensor.shape = e->shape.data();
  e->m.dl_tensor.strides = nullptr;  // C-contiguous
  e->m.dl_tensor.byte_offset = 0;
  e->m.manager_ctx = e;
  e->m.deleter = export_deleter;
  // The capsule's destructor releases an unconsumed tensor (a consumer renames it "used_dltensor"
  // and calls the deleter itself).
  return py::capsule(&e->m, "dltensor", [](PyObject* cap) {
    if (PyCapsule_IsValid(cap, "dltensor")) {
      auto* mt = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
      mt->deleter(mt);
    }
  });
}

void register_device_array(py::module_& m) {
  py::class_<DeviceArray, std::shared_ptr<DeviceArray>>(
      m, "DeviceArray",
      "A result in GPU memory: take it with torch.from_dlpack / jax.dlpack.from_dlpack (no "
      "copy), or numpy() for a host copy")
      .def_property_readonly("shape",
                             [](const DeviceArray& a) {
                               py::tuple t(a.shape().size());
                               for (size_t i = 0; i < a.shape().size(); ++i) t[i] = a.shape()[i];
                               return t;
                             })
      .def_property_readonly(
          "dtype", [](const DeviceArray& a) { return std::string(dtype_name(a.dtype())); })
      .def("numpy", &DeviceArray::to_numpy, "A host copy as a numpy array")
      .def(
          "__dlpack__",
          [](const py::object& self, const py::object& stream) {
            return self.cast<const DeviceArray&>().dlpack(self, stream);
          },
          py::kw_only(), py::arg("stream") = py::none())
      .def("__dlpack_device__", &DeviceArray::dlpack_device);
}

}  // namespace fp4sim::py_args
