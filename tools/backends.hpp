// Run-time backend choice (--backend emu|cuda).
#pragma once

#include <memory>
#include <string>

#include "emu/backend.hpp"

namespace fp4sim {

// "emu" or "cuda"; throws std::invalid_argument with the valid choices, or std::runtime_error when
// the CUDA backend was not built or no GPU is present.
std::unique_ptr<Backend> make_backend(const std::string& name);

// The CUDA backend on GPU `device` running on the caller's `stream` (a cudaStream_t; nullptr: the
// legacy default stream), which it never destroys; std::runtime_error without a usable GPU.
std::unique_ptr<Backend> make_cuda_backend_on_stream(int device, void* stream);

// cudaSetDevice(device) for this thread (std::invalid_argument naming a device that does not
// exist; std::runtime_error without the CUDA backend).
void cuda_set_device(int device);

// Work queued on the CUDA stream `consumer` after this waits for what `producer` holds now.
void cuda_stream_wait(void* consumer, void* producer);

// "cuda" when this build has the CUDA backend and a GPU is present, else "emu".
std::string default_backend_name();

// The --backend option's help, and the backend a command runs on: the one named, else the default
// (cuda when usable, else emu).
inline constexpr const char* kBackendHelp =
    "emu (the bit-exact CPU emulator) or cuda; default: cuda when this build has the CUDA backend "
    "and a GPU is present, else emu";
inline std::string chosen_backend(const std::string& named) {
  return named.empty() ? default_backend_name() : named;
}

bool cuda_backend_built();
// Why the CUDA backend cannot run here (not built, or no GPU), or "" when it can.
std::string cuda_backend_unavailable_reason();
// One line describing the GPU, or why there is none.
std::string gpu_description();
std::string cuda_archs();
std::string cuda_compiler_version();
// The cuBLASLt library loaded at run time ("major.minor.patch"), or "" without the CUDA backend.
std::string cublaslt_runtime_version();

}  // namespace fp4sim
