// Token and position embeddings, forward and backward: the CUDA twins of emu/embedding.hpp
// (bitwise) and CudaBackend's methods.
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/device/device_radix_sort.cuh>

#include "emu/op_checks.hpp"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/layers_state.hpp"
#include "gpu/op_checks.hpp"
#include "gpu/training_ops.cuh"

namespace fp4sim::gpu {

namespace {

// out (N,C) = wte[tokens[n]] + (wpe ? wpe[pos[n]] : +0). One FP32 RN addition: bitwise.
__global__ void embedding_forward_kernel(float* out, const int32_t* tokens, const int32_t* pos,
                                         const float* wte, const float* wpe, int64_t N, int64_t C) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < N * C;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = e / C, i = e % C;
    out[e] = __fadd_rn(wte[static_cast<int64_t>(tokens[n]) * C + i],
                       wpe ? wpe[static_cast<int64_t>(pos[n]) * C + i] : 0.0f);
  }
}

__global__ void iota_kernel(int32_t* idx, int64_t N) {
  for (int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; n < N;
       n += static_cast<int64_t>(gridDim.x) * blockDim.x)
    idx[n] = static_cast<int32_t>(n);
}

// dtable[ids[n]] += dout[n] for the rows sorted stably by id: sorted_ids (N), rows (N) the
// original row of each sorted entry. One block per sorted position; the block that starts a run
// of equal ids owns that table row and adds the run's dout rows in increasing n, starting from
// the table's value: exactly the emulator's sequential order, so bitwise.
__global__ void embedding_scatter_kernel(float* dtable, const float* dout,
                                         const int32_t* sorted_ids, const int32_t* rows, int64_t N,
                                         int64_t C) {
  const int64_t j = blockIdx.x;
  const int32_t id = sorted_ids[j];
  if (j > 0 && sorted_ids[j - 1] == id) return;
  float* d = dtable + static_cast<int64_t>(id) * C;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    float acc = d[i];
    for (int64_t k = j; k < N && sorted_ids[k] == id; ++k)
      acc = __fadd_rn(acc, dout[static_cast<int64_t>(rows[k]) * C + i]);
    d[i] = acc;
  }
}

}  // namespace

void CudaBackend::embedding_forward(const TensorView& out, const TensorView& tokens,
                                    const TensorView& pos, const TensorView& wte,
                                    const TensorView& wpe) {
  op_checks::embedding_forward(out, tokens, pos, wte, wpe);
  const int64_t N = out.rows, C = out.cols;
  if (N * C == 0) return;
  embedding_forward_kernel<<<elementwise_grid(N * C), kThreads, 0, stream_>>>(
      out.as<float>(), tokens.as<const int32_t>(), pos.as<const int32_t>(), wte.as<const float>(),
      wpe.as<const float>(), N, C);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

// Bitwise: rows are sorted stably by id (CUB radix sort: deterministic), then each table row adds
// its dout rows in increasing n (embedding_scatter_kernel).
void CudaBackend::embedding_backward(const TensorView& dwte_v, const TensorView& dwpe_v,
                                     const TensorView& dout_v, const TensorView& tokens_v,
                                     const TensorView& pos_v) {
  op_checks::embedding_backward(dwte_v, dwpe_v, dout_v, tokens_v, pos_v);
  const int64_t N = dout_v.rows, C = dout_v.cols;
  float *dwte = dwte_v.as<float>(), *dwpe = dwpe_v.as<float>();
  const float* dout = dout_v.as<const float>();
  const int32_t *tokens = tokens_v.as<const int32_t>(), *pos = pos_v.as<const int32_t>();
  require_rows("embedding_backward", N);
  if (N * C == 0) return;
  LayersState& st = layers_state();
  int32_t* rows_in = st.sort_rows_in.get<int32_t>(static_cast<size_t>(N), stream_);
  int32_t* rows_out = st.sort_rows_out.get<int32_t>(static_cast<size_t>(N), stream_);
  int32_t* keys_out = st.sort_keys.get<int32_t>(static_cast<size_t>(N), stream_);
  iota_kernel<<<elementwise_grid(N), kThreads, 0, stream_>>>(rows_in, N);
  FP4SIM_CUDA_CHECK_LAUNCH();
  const int n = static_cast<int>(N);
  for (int table = 0; table < 2; ++table) {
    float* dtable = table == 0 ? dwte : dwpe;
    const int32_t* ids = table == 0 ? tokens : pos;
    if (!dtable) continue;
    size_t temp_bytes = 0;
    FP4SIM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, ids, keys_out, rows_in,
                                                      rows_out, n, 0, 32, stream_));
    void* temp = st.sort_temp.get<unsigned char>(temp_bytes, stream_);
    FP4SIM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, ids, keys_out, rows_in,
                                                      rows_out, n, 0, 32, stream_));
    embedding_scatter_kernel<<<static_cast<unsigned>(N), kThreads, 0, stream_>>>(
        dtable, dout, keys_out, rows_out, N, C);
    FP4SIM_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace fp4sim::gpu
