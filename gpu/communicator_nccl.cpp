// The Communicator on NCCL, between CUDA processes (one GPU a rank): device memory, on the CUDA
// backend's stream. libnccl.so.2 is opened at run time, so a build runs without NCCL until a data
// parallel CUDA run asks for it (then a missing NCCL is an error naming the library). Compiled
// against nccl.h (the CUDA toolkit's, or the system's) for its types and signatures.
#include "gpu/communicator_nccl.hpp"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu/cuda_backend.hpp"

namespace fp4sim::gpu {
namespace {

// The NCCL functions fp4sim calls, from the library opened at run time.
struct NcclApi {
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclBroadcast) broadcast = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  decltype(&ncclGetVersion) get_version = nullptr;
};

const NcclApi& nccl() {
  static const NcclApi api = [] {
    NcclApi a;
    // FP4SIM_NCCL_LIBRARY (a path), else the loader's search (LD_LIBRARY_PATH, the cache, this
    // executable's run path), else the CUDA toolkit's folder
    std::vector<std::string> tried;
    if (const char* p = std::getenv("FP4SIM_NCCL_LIBRARY")) tried.push_back(p);
    for (const char* p : {"libnccl.so.2", "libnccl.so", "/usr/local/cuda/lib64/libnccl.so.2"})
      tried.push_back(p);
    void* h = nullptr;
    std::string errors;
    for (const std::string& p : tried) {
      h = dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (h) break;
      errors += (errors.empty() ? "" : "; ") + std::string(dlerror());
    }
    if (!h)
      throw std::runtime_error(
          "data parallel CUDA ranks need NCCL, and no libnccl.so.2 could be opened (" + errors +
          "); install NCCL (Debian/Ubuntu: libnccl2), add its folder to LD_LIBRARY_PATH or name "
          "the library in FP4SIM_NCCL_LIBRARY");
    auto sym = [&](auto& f, const char* name) {
      f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(h, name));
      if (!f) throw std::runtime_error(std::string("libnccl.so.2 has no ") + name);
    };
    sym(a.get_unique_id, "ncclGetUniqueId");
    sym(a.comm_init_rank, "ncclCommInitRank");
    sym(a.comm_destroy, "ncclCommDestroy");
    sym(a.all_gather, "ncclAllGather");
    sym(a.all_reduce, "ncclAllReduce");
    sym(a.broadcast, "ncclBroadcast");
    sym(a.error_string, "ncclGetErrorString");
    sym(a.get_version, "ncclGetVersion");
    return a;
  }();
  return api;
}

void check(ncclResult_t rc, const char* what) {
  if (rc != ncclSuccess)
    throw std::runtime_error(std::string("NCCL: ") + what + " failed: " + nccl().error_string(rc));
}

void check_cuda(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess)
    throw std::runtime_error(std::string("NCCL communicator: ") + what + ": " +
                             cudaGetErrorString(rc));
}

ncclDataType_t nccl_type(const TensorView& x, const char* what) {
  if (x.device != Device::Cuda || !x.dense())
    throw std::logic_error(std::string("NCCL communicator: ") + what + " '" + x.name +
                           "' is not dense device memory");
  if (x.dtype == DType::F32) return ncclFloat32;
  if (x.dtype == DType::BF16) return ncclBfloat16;
  throw std::logic_error(std::string("NCCL communicator: ") + what + " '" + x.name +
                         "' is neither F32 nor BF16");
}

class NcclCommunicator final : public model::Communicator {
 public:
  NcclCommunicator(Backend& cuda, int rank, int size,
                   const std::function<void(void*, size_t)>& share_id)
      : rank_(rank), size_(size) {
    auto* be = dynamic_cast<CudaBackend*>(&cuda);
    if (!be) throw std::logic_error("NCCL communicator: the backend is not the CUDA backend");
    stream_ = be->stream();
    ncclUniqueId id;
    std::memset(&id, 0, sizeof id);
    if (rank == 0) check(nccl().get_unique_id(&id), "ncclGetUniqueId");
    share_id(&id, sizeof id);  // (rank 0's id to every rank)
    check(nccl().comm_init_rank(&comm_, size, id, rank), "ncclCommInitRank");
    // the async collectives' stream, ordered after the backend's by events
    try {
      check_cuda(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking), "cudaStreamCreate");
      check_cuda(cudaEventCreateWithFlags(&queued_, cudaEventDisableTiming), "cudaEventCreate");
      check_cuda(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cudaEventCreate");
    } catch (...) {  // (the destructor does not run for a constructor that throws)
      release();
      throw;
    }
  }
  ~NcclCommunicator() override { release(); }
  void release() {
    if (comm_) nccl().comm_destroy(comm_);
    if (scratch_) cudaFree(scratch_);
    if (side_) cudaStreamDestroy(side_);
    if (queued_) cudaEventDestroy(queued_);
    if (done_) cudaEventDestroy(done_);
    comm_ = nullptr;
    scratch_ = nullptr;
    side_ = nullptr;
    queued_ = done_ = nullptr;
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "nccl"; }

  void all_gather_host(const void* send, void* recv, size_t bytes) override {
    char* d = static_cast<char*>(scratch(bytes * static_cast<size_t>(size_ + 1)));
    check_cuda(cudaMemcpyAsync(d, send, bytes, cudaMemcpyHostToDevice, stream_), "upload");
    check(nccl().all_gather(d, d + bytes, bytes, ncclUint8, comm_, stream_), "ncclAllGather");
    check_cuda(cudaMemcpyAsync(recv, d + bytes, bytes * static_cast<size_t>(size_),
                               cudaMemcpyDeviceToHost, stream_),
               "download");
    check_cuda(cudaStreamSynchronize(stream_), "synchronize");
    if (scratch_bytes_ > (size_t{64} << 20)) {  // (a large exchange's buffer is not kept)
      check_cuda(cudaFree(scratch_), "cudaFree");
      scratch_ = nullptr;
      scratch_bytes_ = 0;
    }
  }
  void all_gather(const TensorView& x, const TensorView& out) override {
    const ncclDataType_t t = nccl_type(x, "all_gather of");
    if (nccl_type(out, "all_gather into") != t || out.numel() != x.numel() * size_)
      throw std::logic_error(std::string("NCCL all_gather: '") + out.name + "' is not " +
                             std::to_string(size_) + " x '" + x.name + "'");
    check(nccl().all_gather(x.data, out.data, static_cast<size_t>(x.numel()), t, comm_, stream_),
          "ncclAllGather");
  }
  void all_reduce_sum(const TensorView& x) override {
    const ncclDataType_t t = nccl_type(x, "all_reduce_sum of");
    check(nccl().all_reduce(x.data, x.data, static_cast<size_t>(x.numel()), t, ncclSum, comm_,
                            stream_),
          "ncclAllReduce");
  }
  void all_reduce_sum_async(const TensorView& x) override {
    const ncclDataType_t t = nccl_type(x, "all_reduce_sum_async of");
    check_cuda(cudaEventRecord(queued_, stream_), "cudaEventRecord");  // (x as written so far)
    check_cuda(cudaStreamWaitEvent(side_, queued_, 0), "cudaStreamWaitEvent");
    check(
        nccl().all_reduce(x.data, x.data, static_cast<size_t>(x.numel()), t, ncclSum, comm_, side_),
        "ncclAllReduce");
    pending_ = true;
  }
  void wait() override {
    if (!pending_) return;
    check_cuda(cudaEventRecord(done_, side_), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(stream_, done_, 0), "cudaStreamWaitEvent");
    pending_ = false;
  }
  void broadcast(const TensorView& x, int root) override {
    if (x.device != Device::Cuda || !x.dense())
      throw std::logic_error(std::string("NCCL broadcast: '") + x.name +
                             "' is not dense device memory");
    const size_t bytes = static_cast<size_t>(x.numel()) * dtype_size(x.dtype);
    check(nccl().broadcast(x.data, x.data, bytes, ncclUint8, root, comm_, stream_),
          "ncclBroadcast");
  }

 private:
  void* scratch(size_t bytes) {
    if (bytes > scratch_bytes_) {
      if (scratch_) check_cuda(cudaFree(scratch_), "cudaFree");
      scratch_ = nullptr;
      check_cuda(cudaMalloc(&scratch_, bytes), "cudaMalloc of the host-exchange buffer");
      scratch_bytes_ = bytes;
    }
    return scratch_;
  }
  int rank_, size_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t side_ = nullptr;  // all_reduce_sum_async's
  cudaEvent_t queued_ = nullptr, done_ = nullptr;
  bool pending_ = false;
  ncclComm_t comm_ = nullptr;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
};

}  // namespace

std::unique_ptr<model::Communicator> make_nccl_communicator(
    Backend& cuda, int rank, int size, const std::function<void(void*, size_t)>& share_id) {
  return std::make_unique<NcclCommunicator>(cuda, rank, size, share_id);
}

std::string nccl_runtime_version() {
  int v = 0;
  check(nccl().get_version(&v), "ncclGetVersion");
  // NCCL_VERSION_CODE: major * 10000 + minor * 100 + patch (since 2.9)
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

}  // namespace fp4sim::gpu
