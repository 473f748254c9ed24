// AdamW (one tensor, or all of them in one launch, optionally writing the weights' BF16 bits) and
// the FP64 sums of squares of the gradient norm: the CUDA twins of emu/optim.hpp's adamw_element
// and of Backend::sum_squares, and CudaBackend's methods.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cub/device/device_radix_sort.cuh>
#include <type_traits>
#include <vector>

#include "emu/op_checks.hpp"
#include "emu/optim.hpp"
#include "gpu/block_reduce.cuh"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/formats_device.cuh"
#include "gpu/layers_state.hpp"
#include "gpu/training_ops.cuh"

namespace fp4sim::gpu {

namespace {

constexpr int kSumSquaresBlocks = 1024;  // fixed: the FP64 reduction tree is shape-only

// adamw_update_many's one launch: CTA b updates the element range of work item b, a piece of at
// most kAdamWItemElems elements of one tensor, with that tensor's step (one of up to kAdamWSteps
// distinct ones, passed by value). adamw_element on every element: bitwise. Four elements a load
// where `vec` (the four arrays 16-byte aligned; the range's head and tail one by one).
constexpr int kAdamWSteps = 4;
constexpr int64_t kAdamWItemElems = 4 * 4 * kThreads;  // four float4s a thread
struct AdamWSteps {
  AdamWStep s[kAdamWSteps];
};
struct AdamWItem {
  int64_t begin, end;  // elements [begin, end) of the flat arrays
  int64_t step;        // index into AdamWSteps
};
// p16 (non-null): the BF16 bits of each updated parameter too (bf16_rne: narrow_to_bf16's), 8-byte
// aligned when `vec`. S: the moments' storage, float, or uint16_t for BF16 bits (optim.state =
// bf16: decoded, updated in FP32, stored RNE; one element at a time).
template <class S>
__global__ void adamw_many_kernel(float* params, const float* grads, S* m, S* v,
                                  const AdamWItem* items, AdamWSteps steps, bool vec,
                                  uint16_t* p16) {
  const AdamWItem it = items[blockIdx.x];
  const AdamWStep s = steps.s[it.step];
  auto one = [&](int64_t i) {
    if constexpr (std::is_same_v<S, float>) {
      adamw_element(params[i], grads[i], m[i], v[i], s);
    } else {
      float mi = bf16_to_f32(m[i]), vi = bf16_to_f32(v[i]);
      adamw_element(params[i], grads[i], mi, vi, s);
      m[i] = bf16_rne_cvt(mi);
      v[i] = bf16_rne_cvt(vi);
    }
    if (p16) p16[i] = bf16_rne_cvt(params[i]);
  };
  if constexpr (!std::is_same_v<S, float>) {
    for (int64_t i = it.begin + threadIdx.x; i < it.end; i += blockDim.x) one(i);
    return;
  }
  const int64_t a4 =
      vec ? (it.begin + 3) / 4 * 4 < it.end ? (it.begin + 3) / 4 * 4 : it.end : it.end;
  const int64_t nv = (it.end - a4) / 4, e4 = a4 + 4 * nv;
  for (int64_t i = it.begin + threadIdx.x; i < a4; i += blockDim.x) one(i);
  for (int64_t j = threadIdx.x; j < nv; j += blockDim.x) {
    const int64_t i = a4 + 4 * j;
    float4 p = *reinterpret_cast<float4*>(params + i), mm = *reinterpret_cast<float4*>(m + i),
           vv = *reinterpret_cast<float4*>(v + i);
    const float4 g = *reinterpret_cast<const float4*>(grads + i);
    adamw_element(p.x, g.x, mm.x, vv.x, s);
    adamw_element(p.y, g.y, mm.y, vv.y, s);
    adamw_element(p.z, g.z, mm.z, vv.z, s);
    adamw_element(p.w, g.w, mm.w, vv.w, s);
    *reinterpret_cast<float4*>(params + i) = p;
    *reinterpret_cast<float4*>(m + i) = mm;
    *reinterpret_cast<float4*>(v + i) = vv;
    if (p16)
      *reinterpret_cast<uint2*>(p16 + i) = make_uint2(
          static_cast<uint32_t>(bf16_rne_cvt(p.x)) | static_cast<uint32_t>(bf16_rne_cvt(p.y)) << 16,
          static_cast<uint32_t>(bf16_rne_cvt(p.z)) | static_cast<uint32_t>(bf16_rne_cvt(p.w))
                                                         << 16);
  }
  for (int64_t i = e4 + threadIdx.x; i < it.end; i += blockDim.x) one(i);
}

// sum x^2 in FP64 of tensor y = blockIdx.y, elements [offset, offset + count) of base (seg: the
// (offset, count) pairs): each product (double)x * (double)x is exact; each thread of a fixed grid
// (kSumSquaresBlocks x kThreads per tensor) sums its grid-strided elements in increasing index,
// block_sum per block into partial (tensor, kSumSquaresBlocks); a second pass, one block per
// tensor, sums a tensor's partials the same way. The tree depends only on the count:
// deterministic, identical on every GPU, and the same whether a tensor is summed alone or with
// others.
__global__ void sum_squares_partial_kernel(double* partial, const float* base, const int64_t* seg) {
  const float* x = base + seg[2 * blockIdx.y];
  const int64_t n = seg[2 * blockIdx.y + 1];
  double s = 0.0;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double d = static_cast<double>(x[j]);
    s = __dadd_rn(s, __dmul_rn(d, d));
  }
  s = block_sum(s);
  if (threadIdx.x == 0) partial[static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x] = s;
}

__global__ void sum_partials_kernel(double* out, const double* partial, int64_t per_tensor) {
  const double* p = partial + static_cast<int64_t>(blockIdx.x) * per_tensor;
  double s = 0.0;
  for (int64_t j = threadIdx.x; j < per_tensor; j += blockDim.x) s = __dadd_rn(s, p[j]);
  s = block_sum(s);
  if (threadIdx.x == 0) out[blockIdx.x] = s;
}

// ---- the orthogonalising optimizers' steps (emu/optim.hpp's element functions) ----------------

__global__ void axpby_kernel(float* out, float a, const float* x, float b, const float* y,
                             int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = y ? axpby_element(a, x[i], b, y[i]) : fmul_rn(a, x[i]);
}

__global__ void clamp_kernel(float* out, const float* x, float bound, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = clamp_element(x[i], bound);
}

// out [C, R] = x [R, C]^T through 32 x 32 tiles in shared memory (a column of padding against
// bank conflicts); 32 x 8 threads, four rows a thread.
constexpr int kTransposeTile = 32;
__global__ void transpose_kernel(float* out, const float* x, int64_t R, int64_t C) {
  __shared__ float tile[kTransposeTile][kTransposeTile + 1];
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTransposeTile,
                r0 = static_cast<int64_t>(blockIdx.y) * kTransposeTile;
  for (int k = threadIdx.y; k < kTransposeTile; k += blockDim.y) {
    const int64_t r = r0 + k, c = c0 + threadIdx.x;
    if (r < R && c < C) tile[k][threadIdx.x] = x[r * C + c];
  }
  __syncthreads();
  for (int k = threadIdx.y; k < kTransposeTile; k += blockDim.y) {
    const int64_t c = c0 + k, r = r0 + threadIdx.x;
    if (r < R && c < C) out[c * R + r] = tile[threadIdx.x][k];
  }
}

// Each row's squares in FP64 in index order, one thread a row (the emulator's order)
__global__ void row_sum_squares_kernel(double* rows, const float* x, int64_t R, int64_t C) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= R) return;
  double s = 0.0;
  for (int64_t c = 0; c < C; ++c) {
    const double d = static_cast<double>(x[r * C + c]);
    s = __dadd_rn(s, __dmul_rn(d, d));
  }
  rows[r] = s;
}

// The row sums in row order, sqrt in FP64, rounded to FP32 (one thread)
__global__ void frobenius_finish_kernel(float* out, const double* rows, int64_t R) {
  double s = 0.0;
  for (int64_t r = 0; r < R; ++r) s = __dadd_rn(s, rows[r]);
  *out = static_cast<float>(__dsqrt_rn(s));
}

__global__ void abs_keys_kernel(uint32_t* keys, const float* x, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    keys[i] = abs_key(x[i]);
}

}  // namespace

void CudaBackend::axpby(const TensorView& out, float a, const TensorView& x, float b,
                        const TensorView& y) {
  op_checks::axpby(out, x, y);
  const int64_t n = x.numel();
  if (n == 0) return;
  axpby_kernel<<<elementwise_grid(n), kThreads, 0, stream_>>>(
      out.as<float>(), a, x.as<const float>(), b, y.present() ? y.as<const float>() : nullptr, n);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void CudaBackend::clamp(const TensorView& out, const TensorView& x, float bound) {
  op_checks::clamp(out, x, bound);
  const int64_t n = x.numel();
  if (n == 0) return;
  clamp_kernel<<<elementwise_grid(n), kThreads, 0, stream_>>>(out.as<float>(), x.as<const float>(),
                                                              bound, n);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

void CudaBackend::transpose(const TensorView& out, const TensorView& x) {
  op_checks::transpose(out, x);
  const int64_t R = x.rows, C = x.cols;
  if (R * C == 0) return;
  const dim3 grid(static_cast<unsigned>((C + kTransposeTile - 1) / kTransposeTile),
                  static_cast<unsigned>((R + kTransposeTile - 1) / kTransposeTile));
  transpose_kernel<<<grid, dim3(kTransposeTile, 8), 0, stream_>>>(out.as<float>(),
                                                                  x.as<const float>(), R, C);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

float CudaBackend::frobenius_norm(const TensorView& x) {
  op_checks::frobenius_norm(x);
  const int64_t R = x.rows;
  LayersState& st = layers_state();
  double* rows = st.ns_rows.get<double>(static_cast<size_t>(R) + 1, stream_);
  float* out = reinterpret_cast<float*>(rows + R);
  if (R > 0) {
    row_sum_squares_kernel<<<static_cast<unsigned>((R + kThreads - 1) / kThreads), kThreads, 0,
                             stream_>>>(rows, x.as<const float>(), R, x.cols);
    FP4SIM_CUDA_CHECK_LAUNCH();
  }
  frobenius_finish_kernel<<<1, 1, 0, stream_>>>(out, rows, R);
  FP4SIM_CUDA_CHECK_LAUNCH();
  float host = 0.0f;
  FP4SIM_CUDA_CHECK(cudaMemcpyAsync(&host, out, sizeof host, cudaMemcpyDeviceToHost, stream_));
  FP4SIM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return host;
}

// The keys of |x| sorted by CUB's radix sort (the emulator's order: every NaN above +Inf), then
// the two order statistics copied back and interpolated on the host.
float CudaBackend::abs_quantile(const TensorView& x, double q) {
  op_checks::abs_quantile(x, q);
  const int64_t n = x.numel();
  if (n > INT32_MAX)
    throw std::invalid_argument(std::string("abs_quantile: tensor '") + x.name + "' has " +
                                std::to_string(n) + " elements, more than CUB's 2^31 - 1");
  LayersState& st = layers_state();
  uint32_t* keys = st.quantile_keys.get<uint32_t>(static_cast<size_t>(n), stream_);
  uint32_t* sorted = st.quantile_sorted.get<uint32_t>(static_cast<size_t>(n), stream_);
  abs_keys_kernel<<<elementwise_grid(n), kThreads, 0, stream_>>>(keys, x.as<const float>(), n);
  FP4SIM_CUDA_CHECK_LAUNCH();
  size_t temp_bytes = 0;
  FP4SIM_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(nullptr, temp_bytes, keys, sorted,
                                                   static_cast<int>(n), 0, 32, stream_));
  void* temp = st.quantile_temp.get<unsigned char>(temp_bytes, stream_);
  FP4SIM_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(temp, temp_bytes, keys, sorted,
                                                   static_cast<int>(n), 0, 32, stream_));
  const int64_t lo = quantile_low(q, n), hi = std::min(lo + 1, n - 1);
  uint32_t k[2] = {0, 0};
  FP4SIM_CUDA_CHECK(cudaMemcpyAsync(&k[0], sorted + lo, 4, cudaMemcpyDeviceToHost, stream_));
  FP4SIM_CUDA_CHECK(cudaMemcpyAsync(&k[1], sorted + hi, 4, cudaMemcpyDeviceToHost, stream_));
  FP4SIM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return quantile_between(f32_from_bits(k[0]), f32_from_bits(k[1]), q, n);
}

// One launch over all segments (adamw_many_kernel): the work items (pieces of kAdamWItemElems
// elements of one tensor) are made and uploaded once for a layout, then reused while the segments
// and the pattern of distinct steps stay the same; the steps travel as a kernel parameter. With
// params16 the BF16 bits are written in the same pass. More than kAdamWSteps distinct steps: one
// launch a segment.
void CudaBackend::adamw_update(const TensorView& params, const TensorView& params16,
                               const TensorView& grads, const TensorView& m, const TensorView& v,
                               const std::vector<Segment>& segments,
                               const std::vector<AdamWStep>& steps) {
  op_checks::adamw_update(params, params16, grads, m, v, segments, steps);
  adamw_many(params.as<float>(), params16.as<uint16_t>(), grads.as<const float>(), m.data, v.data,
             m.dtype == DType::BF16, segments, steps);
}

// adamw_update's launch (p16 null: no BF16 bits); the segments already checked.
void CudaBackend::adamw_many(float* params, uint16_t* p16, const float* grads, void* m, void* v,
                             bool bf16_state, const std::vector<Segment>& segments,
                             const std::vector<AdamWStep>& steps) {
  AdamWSteps distinct{};
  int n_distinct = 0;
  std::vector<int64_t> key;
  key.reserve(3 * segments.size());
  for (size_t i = 0; i < segments.size(); ++i) {
    int k = 0;
    while (k < n_distinct && std::memcmp(&distinct.s[k], &steps[i], sizeof(AdamWStep)) != 0) ++k;
    if (k == n_distinct) {
      if (n_distinct == kAdamWSteps) {  // (one launch a segment, each with its own step)
        for (size_t t = 0; t < segments.size(); ++t)
          adamw_many(params, p16, grads, m, v, bf16_state, {segments[t]}, {steps[t]});
        return;
      }
      distinct.s[n_distinct++] = steps[i];
    }
    key.insert(key.end(), {segments[i].offset, segments[i].count, k});
  }
  LayersState& st = layers_state();
  if (key != st.adamw_key) {
    std::vector<AdamWItem> items;
    for (size_t i = 0; i < segments.size(); ++i) {
      const int64_t o = segments[i].offset, c = segments[i].count;
      for (int64_t b = 0; b < c; b += kAdamWItemElems)
        items.push_back({o + b, o + std::min(c, b + kAdamWItemElems), key[3 * i + 2]});
    }
    AdamWItem* dev = st.adamw_items.get<AdamWItem>(items.size(), stream_);
    if (!items.empty())
      FP4SIM_CUDA_CHECK(cudaMemcpyAsync(dev, items.data(), items.size() * sizeof(AdamWItem),
                                        cudaMemcpyHostToDevice, stream_));
    FP4SIM_CUDA_CHECK(cudaStreamSynchronize(stream_));  // (items is a host temporary)
    st.adamw_key = std::move(key);
    st.adamw_item_count = static_cast<int64_t>(items.size());
  }
  if (st.adamw_item_count == 0) return;
  const bool vec =
      aligned16(params) && aligned16(grads) && aligned16(m) && aligned16(v) && quad_aligned(p16);
  const unsigned grid = static_cast<unsigned>(st.adamw_item_count);
  const AdamWItem* items = st.adamw_items.get<AdamWItem>(grid, stream_);
  if (bf16_state)
    adamw_many_kernel<uint16_t>
        <<<grid, kThreads, 0, stream_>>>(params, grads, static_cast<uint16_t*>(m),
                                         static_cast<uint16_t*>(v), items, distinct, false, p16);
  else
    adamw_many_kernel<float><<<grid, kThreads, 0, stream_>>>(
        params, grads, static_cast<float*>(m), static_cast<float*>(v), items, distinct, vec, p16);
  FP4SIM_CUDA_CHECK_LAUNCH();
}

// All tensors in two launches and one copy back (the gradient norm: one round trip per step
// instead of one per parameter tensor).
void CudaBackend::sum_squares(const TensorView& x, const std::vector<Segment>& segments,
                              double* sums) {
  op_checks::sum_squares(x, segments);
  const float* base = x.as<const float>();
  LayersState& st = layers_state();
  constexpr size_t kMaxTensors = 65535;  // grid.y per launch
  for (size_t first = 0; first < segments.size(); first += kMaxTensors) {
    const size_t tensors = std::min(kMaxTensors, segments.size() - first);
    st.host_segments.resize(2 * tensors);
    for (size_t i = 0; i < tensors; ++i) {
      st.host_segments[2 * i] = segments[first + i].offset;
      st.host_segments[2 * i + 1] = segments[first + i].count;
    }
    int64_t* seg = st.segments.get<int64_t>(2 * tensors, stream_);
    FP4SIM_CUDA_CHECK(cudaMemcpyAsync(seg, st.host_segments.data(), 2 * tensors * sizeof(int64_t),
                                      cudaMemcpyHostToDevice, stream_));
    double* partial = st.sums.get<double>(tensors * (kSumSquaresBlocks + 1), stream_);
    double* out = partial + tensors * kSumSquaresBlocks;
    sum_squares_partial_kernel<<<dim3(kSumSquaresBlocks, static_cast<unsigned>(tensors)), kThreads,
                                 0, stream_>>>(partial, base, seg);
    FP4SIM_CUDA_CHECK_LAUNCH();
    sum_partials_kernel<<<static_cast<unsigned>(tensors), kThreads, 0, stream_>>>(
        out, partial, kSumSquaresBlocks);
    FP4SIM_CUDA_CHECK_LAUNCH();
    FP4SIM_CUDA_CHECK(cudaMemcpyAsync(sums + first, out, tensors * sizeof(double),
                                      cudaMemcpyDeviceToHost, stream_));
    FP4SIM_CUDA_CHECK(cudaStreamSynchronize(stream_));  // before the next batch reuses the buffers
  }
}

}  // namespace fp4sim::gpu
