// NCCL as a Communicator for CUDA ranks (DESIGN.md §16): collectives on the CUDA backend's stream,
// libnccl.so.2 opened at run time (gpu/communicator_nccl.cpp).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "emu/backend.hpp"
#include "model/communicator.hpp"

namespace fp4sim::gpu {

// Rank `rank` of `size` on the CUDA backend `cuda` (its stream runs the collectives). share_id is
// called on every rank with the bytes of an ncclUniqueId (rank 0's filled in): it must leave rank
// 0's bytes there on every rank (through MPI, or a shared file). std::runtime_error without NCCL.
std::unique_ptr<model::Communicator> make_nccl_communicator(
    Backend& cuda, int rank, int size, const std::function<void(void*, size_t)>& share_id);

// The NCCL library opened at run time ("major.minor.patch"); std::runtime_error without one.
std::string nccl_runtime_version();

}  // namespace fp4sim::gpu
