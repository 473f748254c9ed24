// The Communicator: what data parallel training (DESIGN.md §16) asks of a communication engine,
// over the backend's memory. Two implementations: MPI between emulator processes
// (model/communicator_mpi.cpp, host memory), NCCL between CUDA processes
// (gpu/communicator_nccl.cpp, device memory, bootstrapped through MPI or a shared file). model/
// talks to this interface only; tools/communicators.cpp picks one from how the processes were
// launched.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "emu/tensor.hpp"

namespace fp4sim::model {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* name() const = 0;  // "mpi", "nccl"

  // Host memory: every rank's `bytes` bytes at `send` into `recv` (size() * bytes), rank order.
  virtual void all_gather_host(const void* send, void* recv, size_t bytes) = 0;
  // The backend's memory: x (dense, F32 or BF16) of every rank into out (the same dtype,
  // size() * x.numel() elements), rank r's at r * x.numel().
  virtual void all_gather(const TensorView& x, const TensorView& out) = 0;
  // x (dense F32 or BF16) = the sum of every rank's x, added in the engine's order (not fixed:
  // bounded, not bitwise); every rank gets the same bits.
  virtual void all_reduce_sum(const TensorView& x) = 0;
  // x (dense, any dtype) of rank `root` into every rank's x.
  virtual void broadcast(const TensorView& x, int root) = 0;
  // all_reduce_sum started behind the backend's work so far, and left running while the caller
  // goes on (NCCL: on a stream of its own; MPI: nonblocking): x must not be read or written until
  // wait(). The same sums as all_reduce_sum of the same x.
  virtual void all_reduce_sum_async(const TensorView& x) { all_reduce_sum(x); }
  // The backend's work from here on comes after every async operation started so far.
  virtual void wait() {}
};

// An error every rank raises together (a start check that failed on some rank, ranks that
// disagree): the CLI prints it once, from rank 0.
struct CollectiveError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Host-side helpers on any communicator.

// Every rank's string (rank order).
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& s);

// Runs f on every rank; if it throws on any rank, every rank throws a CollectiveError with the
// lowest failing rank's message ("rank 1: ..." where it is not rank 0), so that no rank goes on
// to a collective call the failed one never makes. The ranks must all call it.
template <class F>
void on_every_rank(Communicator& comm, F&& f);

// The same values on every rank (config, build, contract_version, data, seed at start): `values`
// are (key, value) pairs, the same keys in the same order on every rank; a value that differs
// from rank 0's is an error (CollectiveError, on every rank) naming the key and the ranks.
void check_ranks_agree(Communicator& comm,
                       const std::vector<std::pair<std::string, std::string>>& values);

// ---- implementation of on_every_rank ----
void throw_first_failure(Communicator& comm, const std::string& my_error);
template <class F>
void on_every_rank(Communicator& comm, F&& f) {
  std::string error;
  try {
    f();
  } catch (const std::exception& e) {
    error = e.what();
    if (error.empty()) error = "an error without a message";
  }
  throw_first_failure(comm, error);
}

}  // namespace fp4sim::model
