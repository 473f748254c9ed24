// MPI_COMM_WORLD as a Communicator (host memory; the emulator's ranks). Only in builds with MPI
// (FP4SIM_HAVE_MPI): tools/communicators.cpp refuses an MPI launch of a build without it.
#pragma once

#include <memory>
#include <string>

#include "model/communicator.hpp"

namespace fp4sim::model {

// Initialises MPI (once per process) and wraps MPI_COMM_WORLD; the destructor finalizes it.
std::unique_ptr<Communicator> make_mpi_communicator();

// MPI_Abort(MPI_COMM_WORLD, code) where MPI is running: a failure no collective can report (an
// error thrown on one rank between collectives) ends every rank instead of leaving them waiting.
void mpi_abort_world(int code);

// The MPI library's own version line (MPI_Get_library_version; callable before MPI_Init).
std::string mpi_library_version();

}  // namespace fp4sim::model
