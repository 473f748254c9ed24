// Softmax cross-entropy: forward, backward, and both in one op writing the gradient (the training
// step's, on FP32 or BF16 logits): the CUDA twins of emu/cross_entropy.hpp and CudaBackend's
// methods.
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <type_traits>

#include "emu/op_checks.hpp"
#include "gpu/block_reduce.cuh"
#include "gpu/cuda_backend.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/exp2.cuh"
#include "gpu/formats_device.cuh"
#include "gpu/op_checks.hpp"
#include "gpu/training_ops.cuh"

namespace fp4sim::gpu {

namespace {

// Max as the emulator writes it (`s > m ? s : m`): NaN values are skipped, and the result is
// exact in any order.
__device__ __forceinline__ float max_skip_nan(float m, float s) { return s > m ? s : m; }

__device__ float block_max(float v) {
  __shared__ float warp_max[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int off = 16; off > 0; off >>= 1) v = max_skip_nan(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  float m = lane < warps ? warp_max[lane] : -INFINITY;
  for (int off = 16; off > 0; off >>= 1) m = max_skip_nan(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  __syncthreads();
  return m;
}

// One block per row n of logits (N,V): kCeThreads threads, or 256 for V < 4096 (a byte-level
// vocabulary would leave most of them idle). Thread t owns the chunks c = t, t + blockDim, ... of
// kCeVec consecutive logits [kCeVec c, kCeVec c + kCeVec) (the last one cut at V), and walks its
// logits chunk by chunk in increasing index. max: exact; p = exp(z - max) computed as
// exp2_ftz((z - max) log2 e) (gpu/exp2.cuh; as torch.compile's kernels compute it: one MUFU.EX2
// where CUDA's expf takes eight instructions; a few ulp for the probabilities that matter, up to
// |z - max| ulp for the tiny ones, +0 below 2^-126); sum: each thread's sequential sum in that
// order, then block_sum (FP32 tree); probs (N,V) = p / sum; losses (N) = -logf(probs[target])
// (CUDA logf), except where the target's exp2_ftz flushed to +0: then its expf (a finite loss).
// Bounded against the emulator (tree sum, its expf, logf); the tree depends only on V (the thread
// count and the chunking), never on the storage types or the pointers' alignment, so the FP32 and
// the BF16-bits instantiations give the same bits.
// kGrad (crossentropy_softmax_forward_backward): the third pass writes, instead of each
// probability, emu::crossentropy_softmax_backward's expression on it, (p - onehot) * dlosses[n]
// then bf16_round when round_bf16: the bits of the two kernels in turn, without the probabilities'
// write and read.
// bf16_logits: each logit is read as bf16_round(logit) (the model's BF16 storage of the logits,
// applied here instead of by a pass over them after the GEMM).
// kCached (the row fits in shared memory): the first pass copies the row there as it is stored (In:
// BF16 bits take 2 bytes a logit, so two CTAs share an SM at V = 50304 and one's loads overlap the
// other's arithmetic), the second and third read it from there: the logits are read from memory
// once. Without it the passes read the logits from memory again. The exponentials are computed in
// the second pass and again in the third (the same expression on the same value: the same bits).
// Memory: chunks move as 16-byte vectors (`vec`: V a multiple of the vector's elements and the
// pointers 16-byte aligned), else element by element; kCeBatch chunks are loaded before the first
// is used. The same values in the same order either way.
constexpr int kCeThreads = 512;
constexpr int kCeVec = 8;    // logits a chunk: 16 bytes of BF16 bits
constexpr int kCeBatch = 4;  // chunks a thread has in flight in the first pass

// Out = uint16_t (kGrad with round_bf16 only): the written values stored as BF16 bits, the same
// numbers (each is BF16-rounded) in half the bytes.
// In = uint16_t: the logits kept as BF16 bits (read widened: the values bf16_logits reads).
// (no alignas(16): it made ptxas spill 24 bytes in the cached BF16 kernel; a chunk lives in
// registers, where the 16-byte views of it cost nothing)
template <class T>
struct CeChunk {
  T v[kCeVec];
};

// chunk c of row z (count = its logits: kCeVec, or fewer for the last), as stored
template <class T>
__device__ __forceinline__ CeChunk<T> ce_load(const T* z, int64_t c, int count, bool vec) {
  CeChunk<T> k;
  if (vec && count == kCeVec) {
    static_assert(sizeof(CeChunk<T>) % 16 == 0, "a chunk is whole 16-byte vectors");
#pragma unroll
    for (int q = 0; q < static_cast<int>(sizeof(CeChunk<T>) / 16); ++q)
      reinterpret_cast<uint4*>(&k)[q] = reinterpret_cast<const uint4*>(z + c * kCeVec)[q];
  } else {
#pragma unroll
    for (int u = 0; u < kCeVec; ++u)
      if (u < count) k.v[u] = z[c * kCeVec + u];
  }
  return k;
}

template <class T>
__device__ __forceinline__ void ce_store(T* p, int64_t c, int count, bool vec,
                                         const CeChunk<T>& k) {
  if (vec && count == kCeVec) {
#pragma unroll
    for (int q = 0; q < static_cast<int>(sizeof(CeChunk<T>) / 16); ++q)
      reinterpret_cast<uint4*>(p + c * kCeVec)[q] = reinterpret_cast<const uint4*>(&k)[q];
  } else {
#pragma unroll
    for (int u = 0; u < kCeVec; ++u)
      if (u < count) p[c * kCeVec + u] = k.v[u];
  }
}

// a / b for many a and one b, the bits of __fdiv_rn(a, b): y is the reciprocal that the division's
// fast path refines from rcp.approx (one Newton step), q0 = a y, and the remainder's correction
// q = q0 + y (a - b q0) (Markstein): the fast path's own instructions, with y made once instead of
// for every quotient. Used only where that path is exact and the division takes it: b in [1, 2^24]
// and a in [2^-64, 1], so that a / b and the remainder are normal (a softmax: b >= 1 is the sum
// with the maximum's exp(0) = 1 in it, a <= 1). `fast` false: every quotient by __fdiv_rn.
// (tests/gpu: CeDivisionEqualsFdivRn compares it with __fdiv_rn on 2^26 pairs and the range's ends)
struct SumDivisor {
  static constexpr float kMinDividend = 0x1p-64f;
  float b, y;
  bool fast;
  __device__ __forceinline__ float quotient(float a) const {
    const float q0 = __fmaf_rn(y, a, 0.0f);
    return __fmaf_rn(y, __fmaf_rn(-b, q0, a), q0);
  }
};
__device__ __forceinline__ SumDivisor sum_divisor(float b) {
  float y0;
  asm("rcp.approx.f32 %0, %1;" : "=f"(y0) : "f"(b));
  return {b, __fmaf_rn(y0, __fmaf_rn(-b, y0, 1.0f), y0), b >= 1.0f && b <= 0x1p24f};
}

// The test's entry: for `pairs` pseudo-random (a, b) in the ranges above (every a exponent in
// [-64, 0], b in [1, 2^24]) and the ends of both, the number of quotients that differ from
// __fdiv_rn in any bit.
__global__ void ce_division_check_kernel(unsigned long long* mismatches, int64_t pairs,
                                         uint64_t seed) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < pairs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t x = seed + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;  // splitmix64
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    const uint32_t lo = static_cast<uint32_t>(x), hi = static_cast<uint32_t>(x >> 32);
    // a: exponent -64..0, any mantissa (a = 1 exactly when the exponent is 0 and the mantissa 0)
    const int ea = static_cast<int>(lo % 65u) - 64;
    float a = __uint_as_float((static_cast<uint32_t>(ea + 127) << 23) | (hi & 0x7FFFFFu));
    if (ea == 0) a = 1.0f;
    // b: exponent 0..23, any mantissa, or an end of the range
    const int eb = static_cast<int>((lo >> 8) % 24u);
    float b = __uint_as_float((static_cast<uint32_t>(eb + 127) << 23) |
                              ((hi >> 9) | (lo << 23)) & 0x7FFFFFu);
    if ((lo >> 16) % 64u == 0) b = (lo >> 22) & 1 ? 1.0f : 0x1p24f;
    if ((lo >> 24) % 64u == 1) a = SumDivisor::kMinDividend;
    const SumDivisor d = sum_divisor(b);
    if (!d.fast || __float_as_uint(d.quotient(a)) != __float_as_uint(__fdiv_rn(a, b)))
      atomicAdd(mismatches, 1ull);
  }
}

template <bool kGrad, bool kCached, class Out = float, class In = float>
__global__ void __launch_bounds__(kCeThreads, 2)
    crossentropy_softmax_forward_kernel(float* losses, Out* probs, const In* logits,
                                        const int32_t* targets, int64_t V, const float* dlosses,
                                        bool round_bf16, bool bf16_logits, bool vec_in,
                                        bool vec_out) {
  static_assert(kGrad || std::is_same_v<Out, float>,
                "BF16 output is for the gradient (dlogits) only");
  extern __shared__ uint4 ce_smem[];  // kCached: the row's logits as stored
  In* const row = reinterpret_cast<In*>(ce_smem);
  const int64_t n = blockIdx.x;
  const In* z = logits + n * V;
  Out* p = probs + n * V;
  const int64_t chunks = (V + kCeVec - 1) / kCeVec, step = blockDim.x;
  auto count_of = [&](int64_t c) {
    return static_cast<int>(V - c * kCeVec < kCeVec ? V - c * kCeVec : kCeVec);
  };
  auto value = [&](In s) {
    if constexpr (std::is_same_v<In, uint16_t>)
      return bf16_to_f32(s);
    else
      return bf16_logits ? bf16_round_cvt(s) : s;
  };
  // f(c, count, chunk) for this thread's chunks in increasing order: from memory, kCeBatch loads in
  // flight (each chunk is read before this thread writes it, so an output that aliases the logits
  // is still safe), or from the cache
  auto for_each_chunk = [&](bool from_cache, auto&& f) {
    constexpr int batch = kCached ? kCeBatch : 2;  // (the uncached passes: fewer, so no spills)
    int64_t c = threadIdx.x;
    if (!from_cache) {
      for (; c + (batch - 1) * step < chunks; c += batch * step) {
        CeChunk<In> k[batch];
#pragma unroll
        for (int b = 0; b < batch; ++b)
          k[b] = ce_load(z, c + b * step, count_of(c + b * step), vec_in);
#pragma unroll
        for (int b = 0; b < batch; ++b) f(c + b * step, count_of(c + b * step), k[b]);
      }
    }
    for (; c < chunks; c += step)
      f(c, count_of(c),
        from_cache ? ce_load(row, c, count_of(c), true) : ce_load(z, c, count_of(c), vec_in));
  };
  // g(u) on the chunk's logits u < count, in increasing u: a whole chunk (the common case) without
  // a test per logit
  auto each = [&](int count, auto&& g) {
    if (count == kCeVec) {
#pragma unroll
      for (int u = 0; u < kCeVec; ++u) g(u);
    } else {
#pragma unroll
      for (int u = 0; u < kCeVec; ++u)
        if (u < count) g(u);
    }
  };
  float m = -INFINITY;
  for_each_chunk(false, [&](int64_t c, int count, const CeChunk<In>& k) {
    if (kCached) ce_store(row, c, count, true, k);
    each(count, [&](int u) { m = max_skip_nan(m, value(k.v[u])); });
  });
  const float maxv = block_max(m);  // (ends with a barrier: the cached row is complete)
  // e^(z - max) as 2^((z - max) log2 e): one subtraction, one multiplication, one MUFU.EX2
  auto exp_of = [&](In z_u) { return exp2_ftz(__fmul_rn(__fsub_rn(value(z_u), maxv), kLog2e)); };
  float s = 0.0f;
  for_each_chunk(kCached, [&](int64_t, int count, const CeChunk<In>& k) {
    each(count, [&](int u) { s = __fadd_rn(s, exp_of(k.v[u])); });
  });
  const float sum = block_sum(s);
  const int64_t target = targets[n];
  // the loss before the third pass, which may overwrite the logits when the output aliases them
  // (exp_of flushes below 2^-126, a target more than ~87.3 below the row's maximum: there expf's
  // subnormal keeps the loss finite, as the emulator's is, up to a gap of ~103.9)
  if (threadIdx.x == 0) {
    const In zt = kCached ? row[target] : z[target];
    float et = exp_of(zt);
    if (et == 0.0f) et = expf(__fsub_rn(value(zt), maxv));
    losses[n] = -logf(__fdiv_rn(et, sum));
  }
  __syncthreads();
  const float dl = kGrad ? dlosses[n] : 0.0f;
  const SumDivisor div = sum_divisor(sum);
  for_each_chunk(kCached, [&](int64_t c, int count, const CeChunk<In>& k) {
    float prob[kCeVec];
    bool fast =
        div.fast;  // every quotient of the chunk in div's fast range (else all by __fdiv_rn)
    each(count, [&](int u) {
      const float e = exp_of(k.v[u]);
      prob[u] = div.quotient(e);
      fast = fast && e >= SumDivisor::kMinDividend;
    });
    if (!fast) each(count, [&](int u) { prob[u] = __fdiv_rn(exp_of(k.v[u]), sum); });
    const int64_t t_off = target - c * kCeVec;  // the target's place in this chunk, if it is here
    const int tu = t_off >= 0 && t_off < kCeVec ? static_cast<int>(t_off) : -1;
    CeChunk<Out> o;
    auto put = [&](int u, float g) {
      if constexpr (std::is_same_v<Out, uint16_t>)
        o.v[u] = bf16_rne_cvt(g);
      else
        o.v[u] = kGrad ? stored(g, round_bf16) : prob[u];
    };
    // (p - onehot) dl; a chunk without the target (all but one of a row's) as p dl: p - 0 is p
    if (!kGrad || tu < 0)
      each(count, [&](int u) { put(u, __fmul_rn(prob[u], dl)); });
    else
      each(count, [&](int u) { put(u, __fmul_rn(__fsub_rn(prob[u], u == tu ? 1.0f : 0.0f), dl)); });
    ce_store(p, c, count, vec_out, o);
  });
}

// The most dynamic shared memory the cached cross-entropy kernel may use on the current device: the
// per-block opt-in limit less the kernel's static shared memory (block_max and block_sum), allowed
// once per instantiation and device (V = 50304 needs 98.3 KiB as BF16 bits, 196.5 KiB as FP32, of
// the H200's 227 KiB); the cache is guarded (several host threads may launch).
template <bool kGrad, class Out, class In>
size_t crossentropy_cache_bytes() {
  static std::mutex mutex;
  static std::map<int, size_t> limits;  // by device
  int device = 0;
  FP4SIM_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  const auto it = limits.find(device);
  if (it != limits.end()) return it->second;
  int optin = 0;
  FP4SIM_CUDA_CHECK(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes fa{};
  FP4SIM_CUDA_CHECK(
      cudaFuncGetAttributes(&fa, crossentropy_softmax_forward_kernel<kGrad, true, Out, In>));
  const size_t dynamic = static_cast<size_t>(optin) > fa.sharedSizeBytes
                             ? static_cast<size_t>(optin) - fa.sharedSizeBytes
                             : 0;
  FP4SIM_CUDA_CHECK(cudaFuncSetAttribute(crossentropy_softmax_forward_kernel<kGrad, true, Out, In>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(dynamic)));
  // (the most shared memory an SM has, so two CTAs of a BF16 row fit side by side)
  FP4SIM_CUDA_CHECK(cudaFuncSetAttribute(crossentropy_softmax_forward_kernel<kGrad, true, Out, In>,
                                         cudaFuncAttributePreferredSharedMemoryCarveout,
                                         static_cast<int>(cudaSharedmemCarveoutMaxShared)));
  limits[device] = dynamic;
  return dynamic;
}

// Launches the cross-entropy kernel, with the row cached in shared memory when `cached`
// (CudaOptions::crossentropy_cached) and it fits.
template <bool kGrad, class Out = float, class In = float>
void launch_crossentropy(float* losses, Out* out, const In* logits, const int32_t* targets,
                         int64_t N, int64_t V, const float* dlosses, bool round_bf16,
                         bool bf16_logits, bool cached, cudaStream_t stream) {
  // (a row's chunks are whole 16-byte vectors when V is a multiple of a vector's elements)
  const bool vec_in = V % static_cast<int64_t>(16 / sizeof(In)) == 0 && aligned16(logits);
  const bool vec_out = V % static_cast<int64_t>(16 / sizeof(Out)) == 0 && aligned16(out);
  const size_t bytes = (static_cast<size_t>((V + kCeVec - 1) / kCeVec) * kCeVec) * sizeof(In);
  const unsigned threads = V >= 4096 ? kCeThreads : 256;
  if (cached && bytes <= crossentropy_cache_bytes<kGrad, Out, In>()) {
    crossentropy_softmax_forward_kernel<kGrad, true, Out, In>
        <<<static_cast<unsigned>(N), threads, bytes, stream>>>(
            losses, out, logits, targets, V, dlosses, round_bf16, bf16_logits, vec_in, vec_out);
  } else {
    crossentropy_softmax_forward_kernel<kGrad, false, Out, In>
        <<<static_cast<unsigned>(N), threads, 0, stream>>>(
            losses, out, logits, targets, V, dlosses, round_bf16, bf16_logits, vec_in, vec_out);
  }
  FP4SIM_CUDA_CHECK_LAUNCH();
}

}  // namespace

// The logits' and dlogits' storage picks the kernel's template: float32 (read rounded and written
// rounded under BF16 storage, or neither) or BF16 bits.
void CudaBackend::crossentropy_forward_backward(const TensorView& losses, const TensorView& dlogits,
                                                const TensorView& logits, const TensorView& targets,
                                                const TensorView& dlosses) {
  op_checks::crossentropy_forward_backward(losses, dlogits, logits, targets, dlosses);
  const int64_t N = logits.rows, V = logits.cols;
  require_rows("crossentropy_forward_backward", N);
  if (N == 0) return;
  const bool rb = logits.bf16_storage();
  float* l = losses.as<float>();
  const int32_t* t = targets.as<const int32_t>();
  const float* dl = dlosses.as<const float>();
  const bool cached = options_.crossentropy_cached;
  if (logits.dtype == DType::BF16 && dlogits.dtype == DType::BF16)
    launch_crossentropy<true, uint16_t, uint16_t>(l, dlogits.as<uint16_t>(),
                                                  logits.as<const uint16_t>(), t, N, V, dl, true,
                                                  true, cached, stream_);
  else if (dlogits.dtype == DType::BF16)
    launch_crossentropy<true, uint16_t>(l, dlogits.as<uint16_t>(), logits.as<const float>(), t, N,
                                        V, dl, true, true, cached, stream_);
  else if (logits.dtype == DType::F32)
    launch_crossentropy<true>(l, dlogits.as<float>(), logits.as<const float>(), t, N, V, dl, rb, rb,
                              cached, stream_);
  else
    throw std::invalid_argument(
        "crossentropy_forward_backward: BF16 logits with float32 dlogits: the CUDA backend writes "
        "dlogits as BF16 bits from BF16 logits");
}

int64_t ce_division_mismatches(int64_t pairs, uint64_t seed) {
  unsigned long long* d = nullptr;
  FP4SIM_CUDA_CHECK(cudaMalloc(&d, sizeof(unsigned long long)));
  unsigned long long h = 0;
  cudaError_t err = cudaMemset(d, 0, sizeof(h));
  if (err == cudaSuccess) {
    ce_division_check_kernel<<<1024, kThreads>>>(d, pairs, seed);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) err = cudaMemcpy(&h, d, sizeof(h), cudaMemcpyDeviceToHost);
  cudaFree(d);
  FP4SIM_CUDA_CHECK(err);
  return static_cast<int64_t>(h);
}

}  // namespace fp4sim::gpu
