// Q-AdamW on the GPU: the CUDA twin of emu/qadamw.hpp's step (Backend::qadamw_update). One thread
// runs qadamw_tile on one tile, every segment's tiles in one launch a pass: pass 0 takes the new
// amaxes (atomicMax on the FP32 bits: non-negative floats order as their bits, and max is exact in
// any order), pass 1 encodes under them and writes the parameters. The same functions as the
// emulator on every tile: bitwise.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "emu/op_checks.hpp"
#include "emu/qadamw.hpp"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/formats_device.cuh"
#include "gpu/layers_state.hpp"

namespace fp4sim::gpu {

namespace {

constexpr int kQAdamWThreads = 128;

// One segment of a step: its elements of params and grads, its state offset, its first tile of
// the launch, its SR stream and step.
struct QAdamWSeg {
  int64_t offset, state_offset, tile0, tiles;
  uint64_t stream;
  AdamWStep step;
};

struct QAdamWArgs {
  float* params;
  const float* grads;
  uint16_t* p16;
  uint8_t *m_codes, *m_scales, *v_codes, *v_scales;
  uint16_t* v_mean;
  uint16_t* v_floor;  // or null
  float* amax;        // [4 * segments]: the stored encoding's (2i, 2i + 1), then the new ones
  const QAdamWSeg* segs;
  int64_t n_segs, total_tiles, v_tile;
  uint64_t seed;
};

// thread's tile -> (segment, tile within it), by binary search on tile0
__device__ int64_t segment_of(const QAdamWSeg* segs, int64_t n, int64_t tile) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (segs[mid].tile0 <= tile)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

__global__ void qadamw_kernel(QAdamWArgs a, bool encode) {
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (tile >= a.total_tiles) return;
  const int64_t s = segment_of(a.segs, a.n_segs, tile);
  const QAdamWSeg& sg = a.segs[s];
  const int64_t k = tile - sg.tile0, T = a.v_tile;
  const int64_t e = sg.state_offset + k * T;  // the tile's first state element
  const QAdamWTile t{a.m_codes + e / 2, a.m_scales + e / 16,
                     a.v_codes + e / 2, a.v_scales + e / 16,
                     a.v_mean + e / T,  a.v_floor ? a.v_floor + e / T : nullptr};
  // (the new amaxes are read in pass 1 only: pass 0 is still making them)
  const QAdamWAmax am{a.amax[2 * s], a.amax[2 * s + 1],
                      encode ? a.amax[2 * a.n_segs + 2 * s] : 0.0f,
                      encode ? a.amax[2 * a.n_segs + 2 * s + 1] : 0.0f};
  const int blocks = static_cast<int>(T / 16);
  float tm = 0.0f, tv = 0.0f;
  qadamw_tile<DeviceFormats>(encode, blocks, a.params + sg.offset + k * T,
                             a.grads + sg.offset + k * T, t, am, sg.step, a.seed, sg.stream,
                             static_cast<uint64_t>(k * blocks), &tm, &tv,
                             a.p16 ? a.p16 + sg.offset + k * T : nullptr);
  if (!encode) {
    // (tm, tv >= 0 and never NaN: NaN-ignoring maxima from 0)
    if (tm > 0.0f)
      atomicMax(reinterpret_cast<unsigned*>(a.amax + 2 * a.n_segs + 2 * s), __float_as_uint(tm));
    if (tv > 0.0f)
      atomicMax(reinterpret_cast<unsigned*>(a.amax + 2 * a.n_segs + 2 * s + 1),
                __float_as_uint(tv));
  }
}

}  // namespace

void CudaBackend::qadamw_update(const TensorView& params, const TensorView& params16,
                                const TensorView& grads, const QAdamWState& st,
                                const std::vector<Segment>& segments,
                                const std::vector<AdamWStep>& steps, uint64_t seed,
                                const std::vector<uint64_t>& streams) {
  op_checks::qadamw_update(params, params16, grads, st, segments, steps, streams);
  if (segments.empty()) return;
  const int64_t n_segs = static_cast<int64_t>(segments.size());
  std::vector<QAdamWSeg> table;
  int64_t state = 0, tiles = 0;
  for (size_t i = 0; i < segments.size(); ++i) {
    const int64_t nt = segments[i].count / st.v_tile;
    table.push_back({segments[i].offset, state, tiles, nt, streams[i], steps[i]});
    state += segments[i].count;
    tiles += nt;
  }
  LayersState& ls = layers_state();
  QAdamWSeg* dev = ls.qadamw_segs.get<QAdamWSeg>(table.size(), stream_);
  FP4SIM_CUDA_CHECK(cudaMemcpyAsync(dev, table.data(), table.size() * sizeof(QAdamWSeg),
                                    cudaMemcpyHostToDevice, stream_));
  float* amax = st.amax.as<float>();
  // the new amaxes start at 0 (every tile's maximum is >= 0)
  FP4SIM_CUDA_CHECK(
      cudaMemsetAsync(amax + 2 * n_segs, 0, static_cast<size_t>(2 * n_segs) * 4, stream_));
  QAdamWArgs a{params.as<float>(),
               grads.as<const float>(),
               params16.as<uint16_t>(),
               st.m_codes.as<uint8_t>(),
               st.m_scales.as<uint8_t>(),
               st.v_codes.as<uint8_t>(),
               st.v_scales.as<uint8_t>(),
               st.v_mean.as<uint16_t>(),
               st.v_floor.as<uint16_t>(),
               amax,
               dev,
               n_segs,
               tiles,
               st.v_tile,
               seed};
  if (tiles > 0) {
    const unsigned grid = static_cast<unsigned>((tiles + kQAdamWThreads - 1) / kQAdamWThreads);
    qadamw_kernel<<<grid, kQAdamWThreads, 0, stream_>>>(a, false);
    FP4SIM_CUDA_CHECK_LAUNCH();
    qadamw_kernel<<<grid, kQAdamWThreads, 0, stream_>>>(a, true);
    FP4SIM_CUDA_CHECK_LAUNCH();
  }
  // the new amaxes become the stored encoding's
  FP4SIM_CUDA_CHECK(cudaMemcpyAsync(amax, amax + 2 * n_segs, static_cast<size_t>(2 * n_segs) * 4,
                                    cudaMemcpyDeviceToDevice, stream_));
  FP4SIM_CUDA_CHECK(cudaStreamSynchronize(stream_));  // (table is a host temporary)
}

}  // namespace fp4sim::gpu
