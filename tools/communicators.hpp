// How `fp4sim train` finds its ranks (DESIGN.md §16): launched by mpirun (OpenMPI's or another
// PMI's environment), or by the environment alone (FP4SIM_WORLD_SIZE, FP4SIM_RANK,
// FP4SIM_LOCAL_RANK, FP4SIM_BOOTSTRAP: NCCL's unique id through a shared file, for GPU machines
// without mpirun), or as one process. Emulator ranks talk through MPI, CUDA ranks through NCCL.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>

#include "emu/backend.hpp"
#include "model/communicator.hpp"

namespace fp4sim {

struct Launch {
  enum class Kind { Single, Mpi, Env };
  Kind kind = Kind::Single;
  int rank = 0, size = 1, local_rank = 0;
  std::string bootstrap;  // Kind::Env: the file that carries NCCL's unique id
  std::string source;     // the environment variables it was read from, for messages
};

// The launch this process is part of; std::invalid_argument naming the variable for a bad value.
Launch detect_launch();

// What this build can train data parallel with, for `fp4sim info`: "MPI (Open MPI v4.1.4) for
// emulator ranks; NCCL 2.27.3 (libnccl.so.2, opened now) for CUDA ranks", or why not.
std::string data_parallel_description();

// The rank this process prints as (0 until a launch is started).
int process_rank();

// The ranks' communication, for the backend the run uses: started before the backend is made
// (start: MPI_Init; a CUDA rank's GPU is its local rank), then connected on it (communicator:
// MPI for emu, NCCL for cuda). A Single launch has no communicator.
class DataParallelLaunch {
 public:
  DataParallelLaunch(const Launch& launch, const std::string& backend_name);
  ~DataParallelLaunch();
  const Launch& launch() const { return launch_; }
  // nullptr for a Single launch; made once, on `be`.
  model::Communicator* communicator(Backend& be);

 private:
  Launch launch_;
  std::string backend_;
  std::unique_ptr<model::Communicator> mpi_, comm_;
};

// An error already printed (by rank 0, for every rank): the CLI exits with 1 and says nothing.
struct ReportedError : std::runtime_error {
  ReportedError() : std::runtime_error("(reported)") {}
};

// After an error on one rank: end every rank (MPI_Abort where MPI runs), so none waits in a
// collective for the failed one. Without MPI (the file bootstrap) the others are left to NCCL.
void abort_other_ranks(int code);

}  // namespace fp4sim
