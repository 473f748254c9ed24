#include "tools/backends.hpp"

#include <stdexcept>

#if FP4SIM_HAVE_CUDA
#include "gpu/cuda_backend.hpp"
#endif

namespace fp4sim {

bool cuda_backend_built() {
#if FP4SIM_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

std::string cuda_archs() {
#ifdef FP4SIM_CUDA_ARCHS
  return FP4SIM_CUDA_ARCHS;
#else
  return "";
#endif
}

std::string cuda_compiler_version() {
#ifdef FP4SIM_CUDA_VERSION
  return FP4SIM_CUDA_VERSION;
#else
  return "";
#endif
}

std::string cublaslt_runtime_version() {
#if FP4SIM_HAVE_CUDA
  return gpu::cublaslt_version();
#else
  return "";
#endif
}

std::string gpu_description() {
#if FP4SIM_HAVE_CUDA
  return gpu::describe_gpu();
#else
  return "none (this build has no CUDA backend)";
#endif
}

std::string cuda_backend_unavailable_reason() {
#if FP4SIM_HAVE_CUDA
  return gpu::gpu_available() ? "" : "no CUDA GPU is available (" + gpu_description() + ")";
#else
  return "this build of fp4sim has no CUDA backend (nvcc was not found at configure time)";
#endif
}

std::string default_backend_name() {
  return cuda_backend_unavailable_reason().empty() ? "cuda" : "emu";
}

std::unique_ptr<Backend> make_backend(const std::string& name) {
  if (name == "emu") return make_cpu_backend();
  if (name == "cuda") {
    const std::string why = cuda_backend_unavailable_reason();
    if (!why.empty()) throw std::runtime_error("--backend cuda: " + why + "; use --backend emu");
#if FP4SIM_HAVE_CUDA
    return gpu::make_cuda_backend();
#endif
  }
  throw std::invalid_argument("--backend: unknown backend '" + name + "' (valid: emu, cuda)");
}

std::unique_ptr<Backend> make_cuda_backend_on_stream(int device, void* stream) {
  const std::string why = cuda_backend_unavailable_reason();
  if (!why.empty()) throw std::runtime_error("the CUDA backend: " + why);
#if FP4SIM_HAVE_CUDA
  gpu::set_device(device);
  gpu::CudaOptions o;
  o.use_external_stream = true;
  o.external_stream = stream;
  return gpu::make_cuda_backend(o);
#else
  (void)device;
  (void)stream;
  return nullptr;
#endif
}

void cuda_set_device(int device) {
#if FP4SIM_HAVE_CUDA
  gpu::set_device(device);
#else
  (void)device;
  throw std::runtime_error("cuda_set_device: this build of fp4sim has no CUDA backend");
#endif
}

void cuda_stream_wait(void* consumer, void* producer) {
#if FP4SIM_HAVE_CUDA
  gpu::stream_wait(consumer, producer);
#else
  (void)consumer;
  (void)producer;
  throw std::runtime_error("cuda_stream_wait: this build of fp4sim has no CUDA backend");
#endif
}

}  // namespace fp4sim
