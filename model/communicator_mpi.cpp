// The Communicator on MPI (OpenMPI from Debian), between emulator processes: host memory,
// MPI_COMM_WORLD, one process a rank (mpirun -np N fp4sim train ...). Built where CMake finds MPI
// (FP4SIM_HAVE_MPI); model/communicator_mpi.hpp says what it offers.
#include "model/communicator_mpi.hpp"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace fp4sim::model {
namespace {

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw std::runtime_error(std::string("MPI: ") + what + " failed: " + std::string(text, len));
}

int count_of(size_t n, const char* what) {
  if (n > static_cast<size_t>(std::numeric_limits<int>::max()))
    throw std::invalid_argument(std::string("MPI: ") + what + " of " + std::to_string(n) +
                                " (elements or bytes) exceeds MPI's int counts");
  return static_cast<int>(n);
}

void require_host(const TensorView& x, const char* what) {
  if (x.device != Device::Host || !x.dense())
    throw std::logic_error(std::string("MPI communicator: ") + what + " '" + x.name +
                           "' is not dense host memory (CUDA ranks talk through NCCL)");
  if (x.dtype != DType::F32 && x.dtype != DType::BF16)
    throw std::logic_error(std::string("MPI communicator: ") + what + " '" + x.name +
                           "' is neither F32 nor BF16");
}

// BF16 sums (x = x + y per element, each add rounded to nearest even as the emulator's BF16
// arithmetic does), for MPI_Allreduce of BF16 gradients: MPI has no BF16 type of its own.
void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    uint32_t ua = static_cast<uint32_t>(a[i]) << 16, ub = static_cast<uint32_t>(b[i]) << 16;
    float fa, fb;
    std::memcpy(&fa, &ua, 4);
    std::memcpy(&fb, &ub, 4);
    const float s = fa + fb;
    uint32_t us;
    std::memcpy(&us, &s, 4);
    if ((us & 0x7fffffffu) > 0x7f800000u) {
      b[i] = static_cast<uint16_t>((us >> 16) | 0x40u);  // NaN stays NaN (quiet)
    } else {
      us += 0x7fffu + ((us >> 16) & 1u);  // RNE to BF16
      b[i] = static_cast<uint16_t>(us >> 16);
    }
  }
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator() {
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) check(MPI_Init(nullptr, nullptr), "MPI_Init");
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    check(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(MPI_COMM_WORLD, &size_), "MPI_Comm_size");
    check(MPI_Op_create(&bf16_sum, 1, &bf16_sum_op_), "MPI_Op_create");
  }
  ~MpiCommunicator() override {
    if (!pending_.empty())  // (an error left reductions running: finish them before finalizing)
      MPI_Waitall(static_cast<int>(pending_.size()), pending_.data(), MPI_STATUSES_IGNORE);
    MPI_Op_free(&bf16_sum_op_);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "mpi"; }

  void all_gather_host(const void* send, void* recv, size_t bytes) override {
    const int n = count_of(bytes, "all_gather_host");
    check(MPI_Allgather(send, n, MPI_BYTE, recv, n, MPI_BYTE, MPI_COMM_WORLD), "MPI_Allgather");
  }
  void all_gather(const TensorView& x, const TensorView& out) override {
    require_host(x, "all_gather of");
    require_host(out, "all_gather into");
    if (out.dtype != x.dtype || out.numel() != x.numel() * size_)
      throw std::logic_error(std::string("MPI all_gather: '") + out.name + "' is not " +
                             std::to_string(size_) + " x '" + x.name + "'");
    const int n = count_of(static_cast<size_t>(x.numel()), "all_gather");
    const MPI_Datatype t = x.dtype == DType::F32 ? MPI_FLOAT : MPI_UINT16_T;
    check(MPI_Allgather(x.data, n, t, out.data, n, t, MPI_COMM_WORLD), "MPI_Allgather");
  }
  void all_reduce_sum(const TensorView& x) override {
    require_host(x, "all_reduce_sum of");
    const int n = count_of(static_cast<size_t>(x.numel()), "all_reduce_sum");
    if (x.dtype == DType::F32)
      check(MPI_Allreduce(MPI_IN_PLACE, x.data, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
            "MPI_Allreduce");
    else
      check(MPI_Allreduce(MPI_IN_PLACE, x.data, n, MPI_UINT16_T, bf16_sum_op_, MPI_COMM_WORLD),
            "MPI_Allreduce");
  }
  void all_reduce_sum_async(const TensorView& x) override {
    require_host(x, "all_reduce_sum_async of");
    const int n = count_of(static_cast<size_t>(x.numel()), "all_reduce_sum_async");
    MPI_Request r;
    check(MPI_Iallreduce(MPI_IN_PLACE, x.data, n, x.dtype == DType::F32 ? MPI_FLOAT : MPI_UINT16_T,
                         x.dtype == DType::F32 ? MPI_SUM : bf16_sum_op_, MPI_COMM_WORLD, &r),
          "MPI_Iallreduce");
    pending_.push_back(r);
  }
  void wait() override {
    if (pending_.empty()) return;
    check(MPI_Waitall(static_cast<int>(pending_.size()), pending_.data(), MPI_STATUSES_IGNORE),
          "MPI_Waitall");
    pending_.clear();
  }
  void broadcast(const TensorView& x, int root) override {
    if (x.device != Device::Host || !x.dense())
      throw std::logic_error(std::string("MPI broadcast: '") + x.name +
                             "' is not dense host memory");
    const size_t bytes = static_cast<size_t>(x.numel()) * dtype_size(x.dtype);
    check(MPI_Bcast(x.data, count_of(bytes, "broadcast"), MPI_BYTE, root, MPI_COMM_WORLD),
          "MPI_Bcast");
  }

 private:
  int rank_ = 0, size_ = 1;
  MPI_Op bf16_sum_op_;
  std::vector<MPI_Request> pending_;  // all_reduce_sum_async's, until wait()
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator() {
  return std::make_unique<MpiCommunicator>();
}

std::string mpi_library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  if (MPI_Get_library_version(text, &len) != MPI_SUCCESS) return "unknown";
  std::string v(text, static_cast<size_t>(len));
  const size_t cut = v.find_first_of(",\n");  // ("Open MPI v4.1.4, package: ...")
  return cut == std::string::npos ? v : v.substr(0, cut);
}

void mpi_abort_world(int code) {
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (inited && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
}

}  // namespace fp4sim::model
