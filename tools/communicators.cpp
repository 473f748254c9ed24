#include "tools/communicators.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <thread>
#include <vector>

#if FP4SIM_HAVE_MPI
#include "model/communicator_mpi.hpp"
#endif
#if FP4SIM_HAVE_CUDA
#include "gpu/cuda_backend.hpp"
#endif
#if FP4SIM_HAVE_NCCL
#include "gpu/communicator_nccl.hpp"
#endif

namespace fp4sim {
namespace {

int g_rank = 0;

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int env_int(const char* name, int lo) {
  const char* v = env(name);
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (!end || *end || n < lo || n > (1 << 20))
    throw std::invalid_argument(std::string(name) + "=" + v + ": not an integer within " +
                                std::to_string(lo) + ".." + std::to_string(1 << 20));
  return static_cast<int>(n);
}

#if FP4SIM_HAVE_NCCL
// Rank 0 writes the id beside `path` and renames it into place; the others wait for it.
void share_through_file(const std::string& path, int rank, void* id, size_t bytes) {
  namespace fs = std::filesystem;
  if (rank == 0) {
    if (fs::exists(path))
      throw std::invalid_argument("FP4SIM_BOOTSTRAP=" + path +
                                  ": the file exists (an earlier run's?); remove it or name a new "
                                  "one: rank 0 writes it, the other ranks read it");
    const std::string staged = path + ".partial";
    {
      std::ofstream f(staged, std::ios::binary);
      f.write(static_cast<const char*>(id), static_cast<std::streamsize>(bytes));
      if (!f) throw std::runtime_error("FP4SIM_BOOTSTRAP=" + path + ": cannot write " + staged);
    }
    fs::rename(staged, path);
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  // a file older than this process by more than a minute is an earlier run's, left behind
  const auto started = fs::file_time_type::clock::now() - std::chrono::seconds(60);
  for (;;) {
    std::error_code ec;
    if (fs::exists(path, ec) && fs::file_size(path, ec) == bytes &&
        fs::last_write_time(path, ec) >= started) {
      std::ifstream f(path, std::ios::binary);
      f.read(static_cast<char*>(id), static_cast<std::streamsize>(bytes));
      if (f) return;
    }
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(300))
      throw std::runtime_error("FP4SIM_BOOTSTRAP=" + path + ": rank 0 did not write it within " +
                               "300 s (is rank 0 running, and is the path on a shared disk?)");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}
#endif

}  // namespace

int process_rank() { return g_rank; }

std::string data_parallel_description() {
#if FP4SIM_HAVE_MPI
  std::string s = "MPI (" + model::mpi_library_version() + ") for emulator ranks";
#else
  std::string s = "no MPI in this build (emulator ranks: install libopenmpi-dev and rebuild)";
#endif
#if FP4SIM_HAVE_NCCL
  try {
    s += "; NCCL " + gpu::nccl_runtime_version() + " for CUDA ranks";
  } catch (const std::exception& e) {
    s += std::string("; CUDA ranks: ") + e.what();
  }
#elif FP4SIM_HAVE_CUDA
  s += "; no nccl.h at build time (CUDA ranks: install NCCL's headers and rebuild)";
#endif
  return s;
}

Launch detect_launch() {
  Launch l;
  if (env("OMPI_COMM_WORLD_SIZE")) {
    l.kind = Launch::Kind::Mpi;
    l.size = env_int("OMPI_COMM_WORLD_SIZE", 1);
    l.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
    l.local_rank =
        env("OMPI_COMM_WORLD_LOCAL_RANK") ? env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0) : l.rank;
    l.source = "OMPI_COMM_WORLD_SIZE=" + std::to_string(l.size) + " (mpirun)";
  } else if (env("PMI_SIZE")) {
    l.kind = Launch::Kind::Mpi;
    l.size = env_int("PMI_SIZE", 1);
    l.rank = env_int("PMI_RANK", 0);
    l.local_rank = env("MPI_LOCALRANKID") ? env_int("MPI_LOCALRANKID", 0) : l.rank;
    l.source = "PMI_SIZE=" + std::to_string(l.size) + " (mpirun)";
  } else if (env("FP4SIM_WORLD_SIZE")) {
    l.kind = Launch::Kind::Env;
    l.size = env_int("FP4SIM_WORLD_SIZE", 1);
    if (!env("FP4SIM_RANK"))
      throw std::invalid_argument(
          "FP4SIM_WORLD_SIZE is set and FP4SIM_RANK is not: give each "
          "process its rank (0 .. FP4SIM_WORLD_SIZE-1)");
    l.rank = env_int("FP4SIM_RANK", 0);
    l.local_rank = env("FP4SIM_LOCAL_RANK") ? env_int("FP4SIM_LOCAL_RANK", 0) : l.rank;
    if (!env("FP4SIM_BOOTSTRAP"))
      throw std::invalid_argument(
          "FP4SIM_WORLD_SIZE is set and FP4SIM_BOOTSTRAP is not: name a file on a disk every "
          "rank sees (rank 0 writes NCCL's unique id there)");
    l.bootstrap = env("FP4SIM_BOOTSTRAP");
    l.source = "FP4SIM_WORLD_SIZE=" + std::to_string(l.size);
  } else {
    return l;
  }
  if (l.rank >= l.size)
    throw std::invalid_argument(l.source + ": rank " + std::to_string(l.rank) +
                                " is not below the world size");
  return l;
}

DataParallelLaunch::DataParallelLaunch(const Launch& launch, const std::string& backend_name)
    : launch_(launch), backend_(backend_name) {
  if (launch_.kind == Launch::Kind::Single) return;
  g_rank = launch_.rank;
  if (launch_.kind == Launch::Kind::Env && backend_ != "cuda")
    throw std::invalid_argument(
        launch_.source +
        ": the environment bootstrap connects CUDA ranks through NCCL; emulator ranks run "
        "under mpirun (mpirun -np N fp4sim train --backend emu ...)");
  if (launch_.kind == Launch::Kind::Mpi) {
#if FP4SIM_HAVE_MPI
    mpi_ = model::make_mpi_communicator();
    if (mpi_->size() != launch_.size || mpi_->rank() != launch_.rank)
      throw std::runtime_error(
          launch_.source + ": MPI reports rank " + std::to_string(mpi_->rank()) + " of " +
          std::to_string(mpi_->size()) + ", the environment rank " + std::to_string(launch_.rank) +
          " of " + std::to_string(launch_.size) +
          " (another MPI's mpirun than the one fp4sim was built with?)");
#else
    throw std::runtime_error(launch_.source +
                             ": this process was started by mpirun, and this build of fp4sim "
                             "has no MPI (CMake found none: install libopenmpi-dev and rebuild)");
#endif
  }
  if (backend_ == "cuda") {
#if FP4SIM_HAVE_CUDA
    gpu::set_device(launch_.local_rank);  // (one GPU a rank: its local rank's)
#endif
  }
}

DataParallelLaunch::~DataParallelLaunch() = default;

model::Communicator* DataParallelLaunch::communicator(Backend& be) {
  if (launch_.kind == Launch::Kind::Single || comm_) return comm_.get();
  if (backend_ == "cuda") {
#if FP4SIM_HAVE_NCCL
    const int rank = launch_.rank;
    auto share = [&](void* id, size_t bytes) {
      if (mpi_) {
        mpi_->broadcast(
            view_of(id, DType::U8, 1, static_cast<int64_t>(bytes), Device::Host, "ncclUniqueId"),
            0);
      } else {
        share_through_file(launch_.bootstrap, rank, id, bytes);
      }
    };
    comm_ = gpu::make_nccl_communicator(be, launch_.rank, launch_.size, share);
    if (!mpi_) {  // every rank connected: rank 0 removes the id's file
      char done = 1;
      std::vector<char> all(static_cast<size_t>(launch_.size));
      comm_->all_gather_host(&done, all.data(), 1);
      if (rank == 0) std::filesystem::remove(launch_.bootstrap);
    }
#else
    (void)be;
    throw std::runtime_error(launch_.source +
                             ": CUDA ranks talk through NCCL, and this build found no nccl.h "
                             "(install NCCL's headers, e.g. libnccl-dev, and rebuild)");
#endif
  } else {
    comm_ = std::move(mpi_);
  }
  return comm_.get();
}

void abort_other_ranks(int code) {
#if FP4SIM_HAVE_MPI
  model::mpi_abort_world(code);
#else
  (void)code;
#endif
}

}  // namespace fp4sim
