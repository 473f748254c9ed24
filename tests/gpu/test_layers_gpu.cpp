// The CUDA twins of the training-stack ops (gpu/norm.cu, matmul.cu, ...) against the emulator
// (emu/norm.cpp, matmul.cpp, ..., emu/optim.hpp): the same seeded random inputs through both
// backends, outputs that accumulate starting from non-zero values, outputs that overwrite starting
// from NaN (every element must be written). Bitwise where the CUDA op claims it; elsewhere |cuda -
// emu| <= rtol * mag per element, mag the sum of the absolute values of the terms that make up the
// element (computed here in double), with the worst element and the share of the budget it used
// printed. BF16 storage is checked against the float32 op on the same values: a view marked
// bf16_values or a BF16 view gives the bits of the float32 op followed by rounding. Skips without a
// GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "emu/backend.hpp"
#include "emu/formats.hpp"
#include "emu/fused.hpp"
#include "tests/gpu/gpu_test_util.hpp"
#include "tools/backends.hpp"

namespace fp4sim {
namespace {

#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU: " << gpu_description()

using Vec = std::vector<float>;
using Mag = std::vector<double>;
using Outputs = std::vector<Vec>;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Tolerances (relative to mag), with the reasoning:
// - expf/logf/tanhf: CUDA's are within 2 ulp, glibc's within 1: a few ulp of the terms.
constexpr double kTranscendentalRtol = 4e-6;
// - FP32 row/column sums in a different order (tree or chunks vs sequential): ~sqrt(n) ulp of the
//   sum of |terms| typically, n ulp at worst; the shapes here keep n <= 768.
constexpr double kReductionRtol = 1e-5;
// - cuBLASLt FP32 GEMM (no TF32) vs sequential FP32 dot products.
constexpr double kFp32GemmRtol = 1e-5;
// - cuBLASLt BF16 GEMM (FP32 accumulation) vs the emulator's exact T-FDPA model, identical BF16
//   operands: both lose ~2^-23 of each 16-term group (seen on an H200: 0.5% of this budget); a
//   missing BF16 rounding on one side would show as ~2^-9 / sqrt(K) of mag, far above it.
constexpr double kBf16GemmRtol = 2e-5;
constexpr double kUlp = 0x1p-24;  // unit roundoff of FP32

Vec randn(size_t n, std::mt19937& rng, float scale = 1.0f, float offset = 0.0f) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  Vec v(n);
  for (auto& x : v) x = offset + scale * d(rng);
  return v;
}

std::vector<int32_t> randint(size_t n, int32_t hi, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> d(0, hi - 1);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

size_t sz(int64_t n) { return static_cast<size_t>(n); }

template <class T>
constexpr DType dtype_of() {
  static_assert(
      std::is_same_v<T, float> || std::is_same_v<T, uint16_t> || std::is_same_v<T, int32_t>,
      "float32, BF16 bits or int32");
  return std::is_same_v<T, float> ? DType::F32
                                  : (std::is_same_v<T, uint16_t> ? DType::BF16 : DType::I32);
}

// One op call on one backend: inputs uploaded, outputs (declared in order, starting from their
// initial values) downloaded by results(), each a dense view into the backend's memory. A BF16
// output comes back as its values widened to FP32 (exact: the bits show in the FP32 bits).
class Call {
 public:
  explicit Call(Backend& be) : be_(be) {}
  // h as a rows x cols input: float32 (bf16_values: marked as holding BF16 values), BF16 bits
  // (uint16_t) or int32
  template <class T>
  TensorView in(const std::vector<T>& h, int64_t rows, int64_t cols, bool bf16_values = false) {
    return view(put(h), dtype_of<T>(), rows, cols, h.size(), bf16_values);
  }
  // a float32 output rows x cols starting as init; bf16_values: the op writes it rounded
  TensorView out(const Vec& init, int64_t rows, int64_t cols, bool bf16_values = false) {
    outs_.push_back(view(put(init), DType::F32, rows, cols, init.size(), bf16_values));
    return outs_.back();
  }
  // a BF16 output rows x cols starting as NaN bits (0x7FFF each)
  TensorView out16(int64_t rows, int64_t cols) {
    const std::vector<uint16_t> init(sz(rows * cols), 0x7FFF);
    outs_.push_back(view(put(init), DType::BF16, rows, cols, init.size(), false));
    return outs_.back();
  }
  Outputs results() {
    be_.synchronize();
    Outputs r;
    for (const TensorView& o : outs_) {
      r.emplace_back(sz(o.numel()));
      if (!o.numel()) continue;
      if (o.dtype == DType::BF16) {
        std::vector<uint16_t> b(r.back().size());
        be_.download(b.data(), o.data, b.size() * sizeof(uint16_t));
        for (size_t i = 0; i < b.size(); ++i) r.back()[i] = bf16_to_f32(b[i]);
      } else {
        be_.download(r.back().data(), o.data, r.back().size() * sizeof(float));
      }
    }
    return r;
  }

 private:
  template <class T>
  void* put(const std::vector<T>& h) {
    bufs_.push_back(std::make_unique<BackendBuffer>(be_, h.size() * sizeof(T)));
    if (!h.empty()) be_.upload(bufs_.back()->get(), h.data(), h.size() * sizeof(T));
    return bufs_.back()->get();
  }
  TensorView view(void* p, DType dtype, int64_t rows, int64_t cols, size_t n, bool bf16_values) {
    if (sz(rows * cols) != n)
      throw std::logic_error("Call: a " + shape_str(rows, cols) + " view of " + std::to_string(n) +
                             " elements");
    return view_of(p, dtype, rows, cols, be_.device(), "tensor", bf16_values);
  }
  Backend& be_;
  std::vector<std::unique_ptr<BackendBuffer>> bufs_;
  std::vector<TensorView> outs_;
};

using Op = std::function<void(Backend&, Call&)>;

Outputs run(Backend& be, const Op& op) {
  Call c(be);
  op(be, c);
  return c.results();
}

// Equal bit patterns, or both NaN: NaN payloads are no part of these ops' contract (x86's default
// NaN is 0xFFC00000, CUDA's 0x7FFFFFFF, and x86 keeps an operand's payload where CUDA does not).
bool same_bits(float a, float b) {
  return f32_bits(a) == f32_bits(b) || (std::isnan(a) && std::isnan(b));
}

void show_first(const Vec& ref, const Vec& got, size_t count) {
  for (size_t i = 0; i < std::min(count, ref.size()); ++i)
    std::printf("    [%zu] %+.9e %+.9e %s\n", i, ref[i], got[i],
                same_bits(ref[i], got[i]) ? "OK" : "NOT OK (bits)");
}

// Every element's bit pattern equal (NaN: see same_bits).
void expect_bitwise(const std::string& what, const Vec& ref, const Vec& got) {
  ASSERT_EQ(ref.size(), got.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < ref.size(); ++i)
    if (!same_bits(ref[i], got[i]) && bad++ == 0) first = i;
  std::printf("[layers-gpu] %-44s bitwise: %zu of %zu differ\n", what.c_str(), bad, ref.size());
  show_first(ref, got, 2);
  if (bad)
    ADD_FAILURE() << what << ": " << bad << " of " << ref.size() << " elements differ; first at "
                  << first << ": " << ref[first] << " (0x" << std::hex << f32_bits(ref[first])
                  << ") vs " << got[first] << " (0x" << f32_bits(got[first]) << ")";
}

// |got - ref| <= rtol * mag[i] for every element; NaN exactly where ref has NaN, infinities equal.
void expect_bounded(const std::string& what, const Vec& ref, const Vec& got, const Mag& mag,
                    double rtol) {
  ASSERT_EQ(ref.size(), got.size()) << what;
  ASSERT_EQ(ref.size(), mag.size()) << what;
  size_t bad = 0, same = 0, worst = 0, first_bad = 0;
  double worst_frac = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (f32_bits(ref[i]) == f32_bits(got[i])) {
      ++same;
      continue;
    }
    const bool rn = std::isnan(ref[i]), gn = std::isnan(got[i]);
    double frac;
    if (rn || gn) {
      frac = rn == gn ? 0.0 : kInf;
    } else if (std::isinf(ref[i]) || std::isinf(got[i])) {
      frac = ref[i] == got[i] ? 0.0 : kInf;
    } else {
      const double diff = std::fabs(static_cast<double>(got[i]) - static_cast<double>(ref[i]));
      const double budget = rtol * mag[i];
      frac = diff == 0 ? 0.0 : (budget > 0 ? diff / budget : kInf);
    }
    if (frac > worst_frac) {
      worst_frac = frac;
      worst = i;
    }
    if (frac > 1.0 && bad++ == 0) first_bad = i;
  }
  const size_t n = ref.size();
  std::printf(
      "[layers-gpu] %-44s worst at %zu: %+.9e vs %+.9e, %.1f%% of budget (rtol %.0e), "
      "%.1f%% bitwise\n",
      what.c_str(), worst, n ? ref[worst] : 0.0f, n ? got[worst] : 0.0f, 100.0 * worst_frac, rtol,
      n ? 100.0 * static_cast<double>(same) / static_cast<double>(n) : 100.0);
  show_first(ref, got, 2);
  if (bad)
    ADD_FAILURE() << what << ": " << bad << " of " << n << " elements outside rtol " << rtol
                  << " * mag; first at " << first_bad << ": " << ref[first_bad] << " vs "
                  << got[first_bad] << " (mag " << mag[first_bad] << ")";
}

Mag abs_of(const Vec& v) {
  Mag m(v.size());
  for (size_t i = 0; i < v.size(); ++i) m[i] = std::fabs(static_cast<double>(v[i]));
  return m;
}

struct Backends {
  std::unique_ptr<Backend> emu = make_backend("emu");
  std::unique_ptr<Backend> cuda = make_backend("cuda");
};

std::vector<uint16_t> bf16_bits_of(const Vec& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = bf16_rne(v[i]);
  return b;
}
Vec bf16_values_of(const Vec& v) {
  Vec r(v);
  for (float& x : r) x = bf16_round(x);
  return r;
}

// The cross-entropy op on c's backend from logits [N, V] (float32, marked bf16_values: read
// rounded, or BF16 bits): outputs losses [N, 1] and dlogits [N, V], in this order, both starting as
// NaN. dlogits is stored as the logits are: float32 for float32 logits; for BF16-stored logits
// float32 marked bf16_values (written rounded), or BF16 bits where dlogits16.
void crossentropy_on(Backend& bk, Call& c, const TensorView& logits,
                     const std::vector<int32_t>& targets, const Vec& dlosses, bool dlogits16) {
  const int64_t N = logits.rows, V = logits.cols;
  const TensorView losses = c.out(Vec(sz(N), kNaN), N, 1);
  const TensorView dlogits =
      dlogits16 ? c.out16(N, V) : c.out(Vec(sz(N * V), kNaN), N, V, logits.bf16_storage());
  bk.crossentropy_forward_backward(losses, dlogits, logits, c.in(targets, N, 1),
                                   c.in(dlosses, N, 1));
}

// ---- embedding ----------------------------------------------------------------------------------

TEST(LayersGpu, EmbeddingBitwiseEqualsEmulator) {
  REQUIRE_GPU();
  Backends be;
  std::mt19937 rng(101);
  const int64_t N = 77, C = 45, V = 13, P = 40;
  std::vector<int32_t> tokens = randint(sz(N), V, rng), pos = randint(sz(N), P, rng);
  for (int64_t n = 0; n < 9; ++n) tokens[sz(n)] = 5;  // a long run of one token ...
  tokens[sz(N - 1)] = 5;                              // ... and the same token far away
  pos[3] = pos[40] = pos[76] = 7;
  const Vec wte = randn(sz(V * C), rng), wpe = randn(sz(P * C), rng), dout = randn(sz(N * C), rng);
  const Vec dwte0 = randn(sz(V * C), rng), dwpe0 = randn(sz(P * C), rng);
  for (bool with_wpe : {true, false}) {
    const std::string tag = with_wpe ? " (wpe)" : " (no wpe)";
    const Op fwd = [&](Backend& b, Call& c) {
      const TensorView out = c.out(Vec(sz(N * C), kNaN), N, C);
      b.embedding_forward(out, c.in(tokens, N, 1), c.in(pos, N, 1), c.in(wte, V, C),
                          with_wpe ? c.in(wpe, P, C) : TensorView{});
    };
    expect_bitwise("embedding_forward out" + tag, run(*be.emu, fwd)[0], run(*be.cuda, fwd)[0]);
    const Op bwd = [&](Backend& b, Call& c) {
      const TensorView dwte = c.out(dwte0, V, C);
      const TensorView dwpe = with_wpe ? c.out(dwpe0, P, C) : TensorView{};
      b.embedding_backward(dwte, dwpe, c.in(dout, N, C), c.in(tokens, N, 1), c.in(pos, N, 1));
    };
    const Outputs e = run(*be.emu, bwd), g = run(*be.cuda, bwd);
    expect_bitwise("embedding_backward dwte" + tag, e[0], g[0]);
    if (with_wpe) expect_bitwise("embedding_backward dwpe" + tag, e[1], g[1]);
  }
}

// ---- layernorm / rmsnorm ------------------------------------------------------------------------

struct RowsCols {
  int64_t N, C;
};
const RowsCols kNormShapes[] = {{5, 37}, {64, 300}, {130, 768}, {3, 1}};

TEST(LayersGpu, LayernormMatchesEmulator) {
  REQUIRE_GPU();
  Backends be;
  std::mt19937 rng(202);
  for (const RowsCols s : kNormShapes) {
    const int64_t N = s.N, C = s.C;
    const std::string tag = " " + std::to_string(N) + "x" + std::to_string(C);
    const Vec x = randn(sz(N * C), rng, 2.0f, 0.5f), w = randn(sz(C), rng, 1.0f, 1.0f),
              b = randn(sz(C), rng);
    const Op fwd = [&](Backend& bk, Call& c) {
      const TensorView out = c.out(Vec(sz(N * C), kNaN), N, C);
      const TensorView mean = c.out(Vec(sz(N), kNaN), N, 1);
      const TensorView rstd = c.out(Vec(sz(N), kNaN), N, 1);
      bk.norm_forward(NormKind::LayerNorm, out, mean, rstd, c.in(x, N, C), c.in(w, C, 1),
                      c.in(b, C, 1));
    };
    const Outputs e = run(*be.emu, fwd), g = run(*be.cuda, fwd);
    const Vec &mean = e[1], &rstd = e[2];
    Mag mag_out(sz(N * C)), mag_mean(sz(N)), mag_rstd = abs_of(rstd);
    for (int64_t n = 0; n < N; ++n) {
      double sabs = 0;
      for (int64_t i = 0; i < C; ++i) sabs += std::fabs(x[sz(n * C + i)]);
      mag_mean[sz(n)] = sabs / static_cast<double>(C);
      for (int64_t i = 0; i < C; ++i)
        mag_out[sz(n * C + i)] = std::fabs(w[sz(i)]) * rstd[sz(n)] *
                                     (std::fabs(x[sz(n * C + i)] - mean[sz(n)]) + mag_mean[sz(n)]) +
                                 std::fabs(b[sz(i)]);
    }
    expect_bounded("layernorm_forward out" + tag, e[0], g[0], mag_out, kReductionRtol);
    expect_bounded("layernorm_forward mean" + tag, e[1], g[1], mag_mean, kReductionRtol);
    expect_bounded("layernorm_forward rstd" + tag, e[2], g[2], mag_rstd, kReductionRtol);

    // backward from the emulator's saved mean/rstd, into non-zero gradients
    const Vec dout = randn(sz(N * C), rng), dinp0 = randn(sz(N * C), rng), dw0 = randn(sz(C), rng),
              db0 = randn(sz(C), rng);
    const Op bwd = [&](Backend& bk, Call& c) {
      const TensorView dinp = c.out(dinp0, N, C);
      const TensorView dw = c.out(dw0, C, 1);
      const TensorView db = c.out(db0, C, 1);
      bk.norm_backward(NormKind::LayerNorm, dinp, dw, db, c.in(dout, N, C), c.in(x, N, C),
                       c.in(w, C, 1), c.in(mean, N, 1), c.in(rstd, N, 1));
    };
    const Outputs eb = run(*be.emu, bwd), gb = run(*be.cuda, bwd);
    Mag mag_dx(sz(N * C)), mag_dw = abs_of(dw0), mag_db = abs_of(db0);
    for (int64_t n = 0; n < N; ++n) {
      double a = 0, bsum = 0;
      for (int64_t i = 0; i < C; ++i) {
        const double norm = (x[sz(n * C + i)] - mean[sz(n)]) * static_cast<double>(rstd[sz(n)]);
        const double dnorm = static_cast<double>(w[sz(i)]) * dout[sz(n * C + i)];
        a += std::fabs(dnorm);
        bsum += std::fabs(dnorm * norm);
        mag_dw[sz(i)] += std::fabs(norm * dout[sz(n * C + i)]);
        mag_db[sz(i)] += std::fabs(dout[sz(n * C + i)]);
      }
      for (int64_t i = 0; i < C; ++i) {
        const double norm = (x[sz(n * C + i)] - mean[sz(n)]) * static_cast<double>(rstd[sz(n)]);
        const double dnorm = static_cast<double>(w[sz(i)]) * dout[sz(n * C + i)];
        mag_dx[sz(n * C + i)] =
            std::fabs(dinp0[sz(n * C + i)]) +
            rstd[sz(n)] * (std::fabs(dnorm) + a / C + std::fabs(norm) * bsum / C);
      }
    }
    expect_bounded("layernorm_backward dinp" + tag, eb[0], gb[0], mag_dx, kReductionRtol);
    if (N <= 64) {  // one row chunk: the emulator's sequential column order exactly
      expect_bitwise("layernorm_backward dweight" + tag, eb[1], gb[1]);
      expect_bitwise("layernorm_backward dbias" + tag, eb[2], gb[2]);
    } else {
      expect_bounded("layernorm_backward dweight" + tag, eb[1], gb[1], mag_dw, kReductionRtol);
      expect_bounded("layernorm_backward dbias" + tag, eb[2], gb[2], mag_db, kReductionRtol);
    }
  }
}

TEST(LayersGpu, RmsnormMatchesEmulator) {
  REQUIRE_GPU();
  Backends be;
  std::mt19937 rng(303);
  for (const RowsCols s : kNormShapes) {
    const int64_t N = s.N, C = s.C;
    const std::string tag = " " + std::to_string(N) + "x" + std::to_string(C);
    const Vec x = randn(sz(N * C), rng, 2.0f, 0.5f), w = randn(sz(C), rng, 1.0f, 1.0f);
    const Op fwd = [&](Backend& bk, Call& c) {
      const TensorView out = c.out(Vec(sz(N * C), kNaN), N, C);
      const TensorView rstd = c.out(Vec(sz(N), kNaN), N, 1);
      bk.norm_forward(NormKind::RMSNorm, out, TensorView{}, rstd, c.in(x, N, C), c.in(w, C, 1),
                      TensorView{});
    };
    const Outputs e = run(*be.emu, fwd), g = run(*be.cuda, fwd);
    const Vec& rstd = e[1];
    Mag mag_out(sz(N * C));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < C; ++i)
        mag_out[sz(n * C + i)] =
            std::fabs(static_cast<double>(x[sz(n * C + i)]) * w[sz(i)] * rstd[sz(n)]);
    expect_bounded("rmsnorm_forward out" + tag, e[0], g[0], mag_out, kReductionRtol);
    expect_bounded("rmsnorm_forward rstd" + tag, e[1], g[1], abs_of(rstd), kReductionRtol);

    const Vec dout = randn(sz(N * C), rng), dinp0 = randn(sz(N * C), rng), dw0 = randn(sz(C), rng);
    const Op bwd = [&](Backend& bk, Call& c) {
      const TensorView dinp = c.out(dinp0, N, C);
      const TensorView dw = c.out(dw0, C, 1);
      bk.norm_backward(NormKind::RMSNorm, dinp, dw, TensorView{}, c.in(dout, N, C), c.in(x, N, C),
                       c.in(w, C, 1), TensorView{}, c.in(rstd, N, 1));
    };
    const Outputs eb = run(*be.emu, bwd), gb = run(*be.cuda, bwd);
    Mag mag_dx(sz(N * C)), mag_dw = abs_of(dw0);
    for (int64_t n = 0; n < N; ++n) {
      const double r = rstd[sz(n)];
      double dot = 0;
      for (int64_t i = 0; i < C; ++i) {
        const double dy = dout[sz(n * C + i)], xi = x[sz(n * C + i)];
        dot += std::fabs(dy * w[sz(i)] * xi);
        mag_dw[sz(i)] += std::fabs(dy * xi * r);
      }
      const double k = dot * r * r * r / C;
      for (int64_t i = 0; i < C; ++i)
        mag_dx[sz(n * C + i)] = std::fabs(dinp0[sz(n * C + i)]) +
                                std::fabs(static_cast<double>(dout[sz(n * C + i)]) * w[sz(i)] * r) +
                                std::fabs(x[sz(n * C + i)]) * k;
    }
    expect_bounded("rmsnorm_backward dinp" + tag, eb[0], gb[0], mag_dx, kReductionRtol);
    if (N <= 64)
      expect_bitwise("rmsnorm_backward dweight" + tag, eb[1], gb[1]);
    else
      expect_bounded("rmsnorm_backward dweight" + tag, eb[1], gb[1], mag_dw, kReductionRtol);
  }
}

// ---- matmul -------------------------------------------------------------------------------------

// mag (M,N) = sum_k |a[m,k]| |b[n,k]| over the values the GEMM reads (BF16-rounded for BF16).
Mag gemm_mag(const Vec& a, const Vec& b, int64_t M, int64_t N, int64_t K, bool bf16) {
  auto rd = [bf16](float v) { return std::fabs(static_cast<double>(bf16 ? bf16_round(v) : v)); };
  Mag m(sz(M * N), 0.0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += rd(a[sz(i * K + k)]) * rd(b[sz(j * K + k)]);
      m[sz(i * N + j)] = s;
    }
  return m;
}

Vec transpose(const Vec& x, int64_t rows, int64_t cols) {
  Vec t(x.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[sz(c * rows + r)] = x[sz(r * cols + c)];
  return t;
}

TEST(LayersGpu, MatmulMatchesEmulator) {
  REQUIRE_GPU();
  Backends be;
  std::mt19937 rng(404);
  struct Shape {
    int64_t N, K, OC;
  };
  for (const Shape s : {Shape{33, 70, 45}, Shape{130, 257, 96}, Shape{7, 16, 5}}) {
    for (emu::GemmPrecision prec : {emu::GemmPrecision::BF16, emu::GemmPrecision::FP32}) {
      for (bool with_bias : {true, false}) {
        const int64_t N = s.N, K = s.K, OC = s.OC;
        const bool bf16 = prec == emu::GemmPrecision::BF16;
        const double rtol = bf16 ? kBf16GemmRtol : kFp32GemmRtol;
        const std::string tag = std::string(bf16 ? " bf16 " : " fp32 ") + std::to_string(N) + "x" +
                                std::to_string(K) + "x" + std::to_string(OC) +
                                (with_bias ? " bias" : "");
        const Vec x = randn(sz(N * K), rng), w = randn(sz(OC * K), rng, 0.3f),
                  bias = randn(sz(OC), rng);
        const Op fwd = [&](Backend& bk, Call& c) {
          const TensorView out = c.out(Vec(sz(N * OC), kNaN), N, OC);
          bk.matmul_forward(out, c.in(x, N, K), c.in(w, OC, K),
                            with_bias ? c.in(bias, OC, 1) : TensorView{}, prec);
        };
        const Outputs e = run(*be.emu, fwd), g = run(*be.cuda, fwd);
        Mag mag = gemm_mag(x, w, N, OC, K, bf16);
        if (with_bias)
          for (int64_t n = 0; n < N; ++n)
            for (int64_t o = 0; o < OC; ++o) mag[sz(n * OC + o)] += std::fabs(bias[sz(o)]);
        expect_bounded("matmul_forward out" + tag, e[0], g[0], mag, rtol);

        // dinp starts as NaN: matmul_backward writes it without reading it (dW and db are added to)
        const Vec dout = randn(sz(N * OC), rng), dinp0(sz(N * K), kNaN),
                  dw0 = randn(sz(OC * K), rng), db0 = randn(sz(OC), rng);
        const Op bwd = [&](Backend& bk, Call& c) {
          const TensorView dinp = c.out(dinp0, N, K);
          const TensorView dw = c.out(dw0, OC, K);
          const TensorView db = with_bias ? c.out(db0, OC, 1) : TensorView{};
          bk.matmul_backward(dinp, dw, db, c.in(dout, N, OC), c.in(x, N, K), c.in(w, OC, K), prec);
        };
        const Outputs eb = run(*be.emu, bwd), gb = run(*be.cuda, bwd);
        // dinp (N,K) = dout (N,OC) . W^T^T: rows of dout against rows of W^T (K,OC)
        Mag mag_dx = gemm_mag(dout, transpose(w, OC, K), N, K, OC, bf16);
        Mag mag_dw = gemm_mag(transpose(dout, N, OC), transpose(x, N, K), OC, K, N, bf16);
        for (size_t i = 0; i < mag_dw.size(); ++i) mag_dw[i] += std::fabs(dw0[i]);
        expect_bounded("matmul_backward dinp" + tag, eb[0], gb[0], mag_dx, rtol);
        expect_bounded("matmul_backward dweight" + tag, eb[1], gb[1], mag_dw, rtol);
        if (with_bias) {
          if (N <= 64) {
            expect_bitwise("matmul_backward dbias" + tag, eb[2], gb[2]);
          } else {
            Mag mag_db = abs_of(db0);
            for (int64_t n = 0; n < N; ++n)
              for (int64_t o = 0; o < OC; ++o) mag_db[sz(o)] += std::fabs(dout[sz(n * OC + o)]);
            expect_bounded("matmul_backward dbias" + tag, eb[2], gb[2], mag_db, kReductionRtol);
          }
        }
      }
    }
  }
}

#if FP4SIM_HAVE_CUDA
// The training matmuls' algorithm rule (gpu/matmul.cu matmul_preferred_algo) on the twelve
// gpt2-124m Linear GEMMs (batch 16 x 1024 tokens) as matmul_forward / matmul_backward call
// lt_matmul: (transa, transb, m, n, k) = Fprop (T, N, OC, tokens, K), Dgrad (N, N, K, tokens, OC),
// Wgrad (N, T, K, OC, tokens). No GPU needed.
TEST(LayersGpu, MatmulPickRuleOnGpt2Shapes) {
  const int64_t T = 16384;
  struct Linear {
    const char* name;
    int64_t K, OC;
    int fprop, dgrad, wgrad;  // the index the rule must give
  };
  for (const Linear l : {Linear{"qkv", 768, 2304, 6, 0, 0}, Linear{"proj", 768, 768, 6, 6, 0},
                         Linear{"fc", 768, 3072, 6, 0, 1}, Linear{"fc2", 3072, 768, 0, 6, 1},
                         Linear{"head", 768, 50304, 0, 0, 0}}) {
    EXPECT_EQ(gpu::matmul_preferred_algo(true, true, true, false, l.OC, T, l.K), l.fprop)
        << "fprop " << l.name;
    EXPECT_EQ(gpu::matmul_preferred_algo(true, true, false, false, l.K, T, l.OC), l.dgrad)
        << "dgrad " << l.name;
    EXPECT_EQ(gpu::matmul_preferred_algo(true, true, false, true, l.K, l.OC, T), l.wgrad)
        << "wgrad " << l.name;
    // off Hopper / cuBLASLt 13.1, and for FP32 operands: always the heuristic's first
    EXPECT_EQ(gpu::matmul_preferred_algo(false, true, true, false, l.OC, T, l.K), 0) << l.name;
    EXPECT_EQ(gpu::matmul_preferred_algo(true, false, true, false, l.OC, T, l.K), 0) << l.name;
    EXPECT_EQ(gpu::matmul_preferred_algo(true, false, false, true, l.K, l.OC, T), 0) << l.name;
  }
  // the edges: the Wgrad rule's k >= 4 max(m, n) and 2^21 outputs, the other's n >= 4 max(m, k), k
  // <= 1024
  EXPECT_EQ(gpu::matmul_preferred_algo(true, true, false, true, 1024, 2048, 8192), 1);
  EXPECT_EQ(gpu::matmul_preferred_algo(true, true, false, true, 1024, 2048, 8191), 0);
  EXPECT_EQ(gpu::matmul_preferred_algo(true, true, false, true, 1024, 2047, 8192), 0);
  EXPECT_EQ(gpu::matmul_preferred_algo(true, true, true, false, 768, 4096, 1024), 6);
  EXPECT_EQ(gpu::matmul_preferred_algo(true, true, true, false, 768, 4100, 1025), 0);
  EXPECT_EQ(gpu::matmul_preferred_algo(true, true, true, false, 1025, 4099, 768), 0);
}

// The rule's algorithms compute the matmul: on three gpt2-124m shapes whose rule index is not 0
// (Fprop proj, index 6; Dgrad fc2, 6; Wgrad fc, 1), the plan takes the rule's index where the rules
// apply, and both its result and the heuristic's first algorithm's (a backend with
// CudaOptions::matmul_heuristic_pick = 0)
// are within the BF16 GEMM bound of an FP64 reference on 4096 sampled outputs (BF16-exact
// operands).
TEST(LayersGpu, MatmulPlanTakesTheRulesIndex) {
  REQUIRE_GPU();
  struct Case {
    const char* name;
    int kind;  // 0 Fprop, 1 Dgrad, 2 Wgrad
    int64_t N, K, OC;
    int index;
  };
  std::mt19937 rng(808);
  for (const Case cs :
       {Case{"fprop proj", 0, 16384, 768, 768, 6}, Case{"dgrad fc2", 1, 16384, 3072, 768, 6},
        Case{"wgrad fc", 2, 16384, 768, 3072, 1}}) {
    const int64_t N = cs.N, K = cs.K, OC = cs.OC;
    auto bf16_randn = [&](int64_t n) {
      Vec v = randn(sz(n), rng);
      for (auto& x : v) x = bf16_round(x);
      return v;
    };
    const Vec x = bf16_randn(N * K), w = bf16_randn(OC * K), dy = bf16_randn(N * OC);
    // the output (rows x cols, row-major) and its element (r, c) as a dot product of `len` terms
    const int64_t rows = cs.kind == 0   ? N
                         : cs.kind == 1 ? N
                                        : OC,
                  cols = cs.kind == 0 ? OC : K,
                  len = cs.kind == 0   ? K
                        : cs.kind == 1 ? OC
                                       : N;
    auto term = [&](int64_t r, int64_t c, int64_t i) -> std::pair<double, double> {
      if (cs.kind == 0) return {x[sz(r * K + i)], w[sz(c * K + i)]};  // out[n][o] = x[n] . w[o]
      if (cs.kind == 1)
        return {dy[sz(r * OC + i)], w[sz(i * K + c)]};  // dx[n][k] = dy[n] . w[:, k]
      return {dy[sz(i * OC + r)], x[sz(i * K + c)]};    // dw[o][k] = dy[:, o] . x[:, k]
    };
    const Op op = [&](Backend& bk, Call& c) {
      if (cs.kind == 0) {
        const TensorView out = c.out(Vec(sz(N * OC), kNaN), N, OC);
        bk.matmul_forward(out, c.in(x, N, K), c.in(w, OC, K), TensorView{},
                          emu::GemmPrecision::BF16);
      } else if (cs.kind == 1) {
        const TensorView dx = c.out(Vec(sz(N * K), kNaN), N, K);
        bk.matmul_backward(dx, TensorView{}, TensorView{}, c.in(dy, N, OC), c.in(x, N, K),
                           c.in(w, OC, K), emu::GemmPrecision::BF16);
      } else {
        const TensorView dw = c.out(Vec(sz(OC * K), 0.0f), OC, K);
        bk.matmul_backward(TensorView{}, dw, TensorView{}, c.in(dy, N, OC), c.in(x, N, K),
                           c.in(w, OC, K), emu::GemmPrecision::BF16);
      }
    };
    Backends be;
    const Vec ruled = run(*be.cuda, op)[0];
    const gpu::MatmulPlanPick pk = cuda_counters(*be.cuda).last_matmul_plan_pick;
    expect_rule_pick(pk, cs.index, cs.name);
    if (!pk.rules_active) {
      EXPECT_EQ(pk.preferred, 0) << cs.name;
    }
    gpu::CudaOptions first_pick;
    first_pick.matmul_heuristic_pick = 0;
    auto cuda_first = cuda_backend(first_pick);
    const Vec first = run(*cuda_first, op)[0];
    EXPECT_EQ(cuda_first->counters().last_matmul_plan_pick.used, 0) << cs.name;
    std::uniform_int_distribution<int64_t> pick_r(0, rows - 1), pick_c(0, cols - 1);
    int bad_ruled = 0, bad_first = 0;
    for (int s = 0; s < 4096; ++s) {
      const int64_t r = pick_r(rng), c = pick_c(rng);
      double ref = 0, mag = 0;
      for (int64_t i = 0; i < len; ++i) {
        const auto [a, b] = term(r, c, i);
        ref += a * b;
        mag += std::fabs(a * b);
      }
      const double tol = kBf16GemmRtol * mag;
      bad_ruled += !(std::fabs(ruled[sz(r * cols + c)] - ref) <= tol);
      bad_first += !(std::fabs(first[sz(r * cols + c)] - ref) <= tol);
    }
    EXPECT_EQ(bad_ruled, 0) << cs.name << ": rule's algorithm outside the bound";
    EXPECT_EQ(bad_first, 0) << cs.name << ": first algorithm outside the bound";
  }
}
#endif

// matmul_backward at BF16 precision with a bias takes dout's BF16 copy and the bias gradient's
// chunk sums from one pass (OC even): the same bits as the same call without dbias followed by
// bias_backward (the separate column pass), on the CUDA backend, for chunked N (3 whole 64-row
// chunks and a partial one), with an Inf and a NaN in dout; an odd OC, and a dout one float off
// 8-byte alignment, take the separate passes.
TEST(LayersGpu, MatmulBackwardBf16BiasFusedEqualsSeparate) {
  REQUIRE_GPU();
  Backends be;
  std::mt19937 rng(909);
  struct Shape {
    int64_t N, K, OC;
    bool misaligned, fused;
  };
  for (const Shape s : {Shape{200, 48, 96, false, true}, Shape{64, 32, 30, false, true},
                        Shape{130, 40, 45, false, false}, Shape{200, 48, 96, true, false}}) {
    const int64_t N = s.N, K = s.K, OC = s.OC;
    const Vec x = randn(sz(N * K), rng), w = randn(sz(OC * K), rng, 0.3f),
              dw0 = randn(sz(OC * K), rng), db0 = randn(sz(OC), rng);
    Vec dout = randn(sz(N * OC), rng);
    dout[sz(5 * OC + 3)] = kInf;
    dout[sz(70 * OC + 1)] = kNaN;
    // (misaligned: dout starts one float into its buffer)
    Vec dout_buf = dout;
    if (s.misaligned) dout_buf.insert(dout_buf.begin(), 0.0f);
    const std::string tag = std::to_string(N) + "x" + std::to_string(K) + "x" + std::to_string(OC) +
                            (s.misaligned ? " misaligned" : "");
    const uint64_t before = cuda_counters(*be.cuda).fused_matmul_bias;
    const Outputs fused = run(*be.cuda, [&](Backend& bk, Call& c) {
      const TensorView dinp = c.out(Vec(sz(N * K), kNaN), N, K);
      const TensorView dw = c.out(dw0, OC, K);
      const TensorView db = c.out(db0, OC, 1);
      const TensorView d = skip(c.in(dout_buf, 1, static_cast<int64_t>(dout_buf.size())),
                                s.misaligned ? 1 : 0, N, OC);
      bk.matmul_backward(dinp, dw, db, d, c.in(x, N, K), c.in(w, OC, K), emu::GemmPrecision::BF16);
    });
    EXPECT_EQ(cuda_counters(*be.cuda).fused_matmul_bias, before + (s.fused ? 1 : 0)) << tag;
    const Outputs separate = run(*be.cuda, [&](Backend& bk, Call& c) {
      const TensorView dinp = c.out(Vec(sz(N * K), kNaN), N, K);
      const TensorView dw = c.out(dw0, OC, K);
      const TensorView db = c.out(db0, OC, 1);
      const TensorView d = c.in(dout, N, OC);
      bk.matmul_backward(dinp, dw, TensorView{}, d, c.in(x, N, K), c.in(w, OC, K),
                         emu::GemmPrecision::BF16);
      bk.bias_backward(db, d);
    });
    expect_bitwise("fused matmul_backward dinp " + tag, separate[0], fused[0]);
    expect_bitwise("fused matmul_backward dweight " + tag, separate[1], fused[1]);
    expect_bitwise("fused matmul_backward dbias " + tag, separate[2], fused[2]);
  }
}

// A BF16 linear layer whose input GELU makes (matmul_forward_activation) and whose output gradient
// GELU's backward pass makes (matmul_backward_activation), fused on the GPU (the GEMM operand
// written by the op's pass; backward: with the bias gradient's sums, the gradient never stored) ==
// the op kernel then matmul_forward / matmul_backward, bit for bit: out and the stored activation;
// dinp, dweight, dbias, and the backward's output buffer left as it was. Specials in the
// pre-activation and the incoming gradient; with and without BF16 storage (the outputs marked
// bf16_values, the incoming gradient read rounded); shapes with partial 64-row chunks, odd widths
// and a view one float off alignment (those two take the composition: counted).
TEST(LayersGpu, MatmulActivationFusedEqualsOpThenMatmul) {
  REQUIRE_GPU();
  Backends be;
  gpu::CudaOptions unfused;
  unfused.activation_fusion = false;
  auto cuda_unfused = cuda_backend(unfused);
  std::mt19937 rng(5150);
  struct Shape {
    int64_t N, K, OC;
    bool misaligned, bwd_fused;
  };
  for (const Shape s : {Shape{200, 96, 64, false, true}, Shape{130, 64, 48, false, true},
                        Shape{64, 45, 33, false, false}, Shape{128, 64, 96, true, false}}) {
    for (bool rb : {true, false}) {
      const int64_t N = s.N, K = s.K, OC = s.OC;
      const std::string tag = std::to_string(N) + "x" + std::to_string(K) + "x" +
                              std::to_string(OC) + (s.misaligned ? " misaligned" : "") +
                              (rb ? " bf16" : " fp32");
      // forward: out (N, OC) = gelu(pre (N, K)) W^T + b
      Vec pre = randn(sz(N * K), rng, 2.0f), w = randn(sz(OC * K), rng, 0.3f),
          b = randn(sz(OC), rng);
      pre[3] = kInf;
      pre[sz(K + 1)] = -kInf;
      pre[sz(2 * K + 2)] = kNaN;
      auto fwd = [&](bool fused) {
        return run(fused ? *be.cuda : *cuda_unfused, [&](Backend& bk, Call& c) {
          const TensorView out = c.out(Vec(sz(N * OC), kNaN), N, OC, rb);
          const TensorView act = c.out(Vec(sz(N * K), kNaN), N, K, rb);
          const ActivationSource src{ActivationOp::GeluForward, c.in(pre, N, K), {}, act};
          bk.matmul_forward_activation(out, src, c.in(w, OC, K), c.in(b, OC, 1),
                                       emu::GemmPrecision::BF16);
        });
      };
      uint64_t before = cuda_counters(*be.cuda).fused_activation_matmul;
      const Outputs ff = fwd(true);
      EXPECT_EQ(cuda_counters(*be.cuda).fused_activation_matmul, before + 1)
          << tag << ": forward fused path";
      const Outputs fs = fwd(false);
      expect_bitwise("matmul_forward_activation out " + tag, fs[0], ff[0]);
      expect_bitwise("matmul_forward_activation act " + tag, fs[1], ff[1]);
      // backward: dout (N, OC) = gelu'(fc) * dact; dinp (N, K), dW (OC, K) +=, db (OC) +=
      Vec fc = randn(sz(N * OC), rng, 2.0f), dact = randn(sz(N * OC), rng),
          x = randn(sz(N * K), rng), dw0 = randn(sz(OC * K), rng), db0 = randn(sz(OC), rng);
      fc[5] = kNaN;
      dact[sz(OC + 7)] = kInf;
      Vec fc_buf = fc, dact_buf = dact;
      if (s.misaligned) dact_buf.insert(dact_buf.begin(), 0.0f);
      auto bwd = [&](bool fused) {
        return run(fused ? *be.cuda : *cuda_unfused, [&](Backend& bk, Call& c) {
          const TensorView dinp = c.out(Vec(sz(N * K), kNaN), N, K);
          const TensorView dw = c.out(dw0, OC, K);
          const TensorView db = c.out(db0, OC, 1);
          const TensorView dfc = c.out(Vec(sz(N * OC), kNaN), N, OC, rb);
          const TensorView dact_v = skip(c.in(dact_buf, 1, static_cast<int64_t>(dact_buf.size())),
                                         s.misaligned ? 1 : 0, N, OC);
          const ActivationSource src{ActivationOp::GeluBackward, c.in(fc_buf, N, OC),
                                     marked(dact_v, rb), dfc};
          bk.matmul_backward_activation(dinp, dw, db, src, c.in(x, N, K), c.in(w, OC, K),
                                        emu::GemmPrecision::BF16);
        });
      };
      before = cuda_counters(*be.cuda).fused_activation_matmul;
      const Outputs bf = bwd(true);
      EXPECT_EQ(cuda_counters(*be.cuda).fused_activation_matmul, before + (s.bwd_fused ? 1 : 0))
          << tag << ": backward fused path";
      const Outputs bs = bwd(false);
      expect_bitwise("matmul_backward_activation dinp " + tag, bs[0], bf[0]);
      expect_bitwise("matmul_backward_activation dweight " + tag, bs[1], bf[1]);
      expect_bitwise("matmul_backward_activation dbias " + tag, bs[2], bf[2]);
      if (s.bwd_fused) {
        size_t untouched = 0;
        for (float v : bf[3]) untouched += f32_bits(v) == f32_bits(kNaN);
        EXPECT_EQ(untouched, bf[3].size())
            << tag << ": the fused backward wrote the gradient buffer";
      }
    }
  }
}

// Operands that BF16 rounding changes and that every accumulation order sums exactly: both
// backends give the same bits, and BF16 differs from FP32 (the rounding happened, on both).
TEST(LayersGpu, MatmulBf16RoundsOperandsExactly) {
  REQUIRE_GPU();
  Backends be;
  const int64_t N = 3, K = 32, OC = 2;
  const Vec x(sz(N * K), 1.0f + 0x1p-9f), w(sz(OC * K), 1.0f);  // 1 + 2^-9 -> 1 in BF16
  for (emu::GemmPrecision prec : {emu::GemmPrecision::BF16, emu::GemmPrecision::FP32}) {
    const bool bf16 = prec == emu::GemmPrecision::BF16;
    const Op fwd = [&](Backend& bk, Call& c) {
      const TensorView out = c.out(Vec(sz(N * OC), kNaN), N, OC);
      bk.matmul_forward(out, c.in(x, N, K), c.in(w, OC, K), TensorView{}, prec);
    };
    const Outputs e = run(*be.emu, fwd), g = run(*be.cuda, fwd);
    expect_bitwise(std::string("matmul_forward exact ") + (bf16 ? "bf16" : "fp32"), e[0], g[0]);
    EXPECT_EQ(g[0][0], bf16 ? 32.0f : 32.0f + 32.0f * 0x1p-9f);
  }
}

// ---- attention ----------------------------------------------------------------------------------

const AttentionShape kAttentionShapes[] = {
    {2, 37, 6, 2, 32},     // GQA (group of 3), fewer rows than one 64-row tile
    {2, 100, 4, 2, 64},    // GQA, T not a multiple of the tile
    {1, 130, 4, 4, 32},    // MHA, three tiles, the last with 2 rows
    {2, 64, 3, 1, 16},     // MQA, exactly one tile, HD 16
    {1, 77, 2, 1, 128},    // HD 128
    {1, 1, 2, 1, 64},      // one position
    {2, 1024, 12, 12, 64}  // gpt2-124m's attention at B = 2
};

std::string attn_tag(const AttentionShape& s) {
  return " B" + std::to_string(s.B) + " T" + std::to_string(s.T) + " NH" + std::to_string(s.NH) +
         " NKV" + std::to_string(s.NKV) + " HD" + std::to_string(s.HD);
}

// Bounds of the CUDA attention against the emulator (emu/layers.hpp, gpu/attention.cu), relative to
// mag = the sum of |terms| of each element (double, exact softmax, BF16-rounded operands):
// - P and dS are rounded to BF16 on both sides, but not at the same point: the forward pass rounds
//   exp(s - running max) on the GPU and exp(s - final max) in the emulator, and in the backward
//   pass an FP32 difference of a few ulp can put p or dS on the other side of a BF16 rounding
//   boundary. Each side is within 2^-8 (half a BF16 ulp, 8 significant bits) of the exact term,
//   so the two within 2^-7 of it: kAttnBf16Rtol per unit of mag. (A missing rounding on one side
//   would still pass; an error in a mask, a scale, a tile or a head shows far above it: a wrong or
//   missing key moves short rows by a large part of their mag.)
// - FP32 arithmetic: scores are HD-term dot products summed in another order (<= HD ulp of
//   scale * sum |q k|, about 5 to 8 for these N(0,1) inputs), exp2f vs expf a few ulp of |s - m|,
//   row sums <= T ulp: under 2^-12 of mag for T <= 1024 and HD <= 128.
constexpr double kAttnBf16Rtol = 0x1p-7;
constexpr double kAttnFp32Rtol = 0x1p-12;
// lse has no BF16 rounding in it: |d lse| <= |d max| + |d l| / l, in ulps of the scores and of the
// row sum: (2 HD + T + 16) ulp of mag_lse = |lse| + 1 + scale * max_j sum_i |q_i k_ji|.
double lse_rtol(const AttentionShape& s) { return static_cast<double>(2 * s.HD + s.T + 16) * kUlp; }

struct AttnMags {
  Mag out, lse, dqkv;  // (B,T,NH*HD), (B,NH,T), (B,T,(NH+2NKV)*HD)
};

// The magnitudes of every attention output: forward from the exact softmax, backward from
// p = exp(s - lse) with the emulator's lse and out (the inputs both backward passes get):
// dS_j's magnitude is p_j (sum_i |dout_i v_ji| + sum_i |dout_i out_i|). One (b, g) per iteration
// (it owns dk, dv of KV head g and dq of the group's query heads).
AttnMags attention_mags(const AttentionShape& sh, const Vec& qkv, const Vec& dout, const Vec& out,
                        const Vec& lse, const Vec& dqkv_result) {
  const int64_t B = sh.B, T = sh.T, NH = sh.NH, NKV = sh.NKV, HD = sh.HD;
  const int64_t W = (NH + 2 * NKV) * HD, C = NH * HD, group = NH / NKV;
  const double scale = 1.0f / std::sqrt(static_cast<float>(HD));
  auto r = [](float x) { return static_cast<double>(bf16_round(x)); };
  AttnMags m{Mag(sz(B * T * C), 0.0), Mag(sz(B * NH * T), 0.0), Mag(sz(B * T * W), 0.0)};
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < NKV; ++g) {
      std::vector<double> s(sz(T));
      for (int64_t h = g * group; h < (g + 1) * group; ++h)
        for (int64_t t = 0; t < T; ++t) {
          const float* q = &qkv[sz((b * T + t) * W + h * HD)];
          const float* dy = &dout[sz((b * T + t) * C + h * HD)];
          const float* o = &out[sz((b * T + t) * C + h * HD)];
          double mx = -INFINITY, max_sabs = 0, dsum_mag = 0;
          for (int64_t i = 0; i < HD; ++i) dsum_mag += std::fabs(r(dy[i]) * o[i]);
          for (int64_t j = 0; j <= t; ++j) {
            const float* k = &qkv[sz((b * T + j) * W + (NH + g) * HD)];
            double d = 0, a = 0;
            for (int64_t i = 0; i < HD; ++i) {
              d += r(q[i]) * r(k[i]);
              a += std::fabs(r(q[i]) * r(k[i]));
            }
            s[sz(j)] = d * scale;
            mx = std::max(mx, s[sz(j)]);
            max_sabs = std::max(max_sabs, a * scale);
          }
          double l = 0;
          for (int64_t j = 0; j <= t; ++j) l += std::exp(s[sz(j)] - mx);
          const int64_t row = (b * NH + h) * T + t;
          m.lse[sz(row)] = std::fabs(lse[sz(row)]) + 1.0 + max_sabs;
          double* mo = &m.out[sz((b * T + t) * C + h * HD)];
          double* mdq = &m.dqkv[sz((b * T + t) * W + h * HD)];
          for (int64_t j = 0; j <= t; ++j) {
            const float* k = &qkv[sz((b * T + j) * W + (NH + g) * HD)];
            const float* v = &qkv[sz((b * T + j) * W + (NH + NKV + g) * HD)];
            double* mdk = &m.dqkv[sz((b * T + j) * W + (NH + g) * HD)];
            double* mdv = &m.dqkv[sz((b * T + j) * W + (NH + NKV + g) * HD)];
            const double pf = std::exp(s[sz(j)] - mx) / l;                             // forward
            const double pb = std::exp(s[sz(j)] - static_cast<double>(lse[sz(row)]));  // backward
            double dp_mag = 0;
            for (int64_t i = 0; i < HD; ++i) dp_mag += std::fabs(r(dy[i]) * r(v[i]));
            const double ds_mag = pb * (dp_mag + dsum_mag);
            for (int64_t i = 0; i < HD; ++i) {
              mo[i] += pf * std::fabs(r(v[i]));
              mdq[i] += scale * ds_mag * std::fabs(r(k[i]));
              mdk[i] += scale * ds_mag * std::fabs(r(q[i]));
              mdv[i] += pb * std::fabs(r(dy[i]));
            }
          }
        }
    }
  // an ulp of the result for the final store's rounding (+0 + value is exact; kept as margin)
  for (size_t i = 0; i < m.dqkv.size(); ++i) m.dqkv[i] += std::fabs(dqkv_result[i]) * 0x1p-16;
  return m;
}

TEST(LayersGpu, AttentionMatchesEmulator) {
  REQUIRE_GPU();
  Backends be;
  std::mt19937 rng(505);
  for (const AttentionShape sh : kAttentionShapes) {
    const int64_t B = sh.B, T = sh.T, NH = sh.NH, NKV = sh.NKV, HD = sh.HD;
    const int64_t W = (NH + 2 * NKV) * HD, C = NH * HD;
    const std::string tag = attn_tag(sh);
    const Vec qkv = randn(sz(B * T * W), rng);
    const Op fwd = [&](Backend& bk, Call& c) {
      const TensorView out = c.out(Vec(sz(B * T * C), kNaN), B * T, C);  // every element written
      const TensorView lse = c.out(Vec(sz(B * NH * T), kNaN), B * NH, T);
      bk.attention_forward(out, lse, c.in(qkv, B * T, W), sh, emu::GemmPrecision::BF16);
    };
    const Outputs e = run(*be.emu, fwd), g = run(*be.cuda, fwd);
    const Vec &out = e[0], &lse = e[1];
    // with the BF16 storage asked of the op (out marked bf16_values): the bits of bf16_round of its
    // out, the same lse
    for (Backend* bk : {be.emu.get(), be.cuda.get()}) {
      const Outputs r = run(*bk, [&](Backend& k, Call& c) {
        const TensorView o = c.out(Vec(sz(B * T * C), kNaN), B * T, C, true);
        const TensorView ls = c.out(Vec(sz(B * NH * T), kNaN), B * NH, T);
        k.attention_forward(o, ls, c.in(qkv, B * T, W), sh, emu::GemmPrecision::BF16);
      });
      Vec rounded = bk == be.emu.get() ? e[0] : g[0];
      for (float& v : rounded) v = bf16_round(v);
      expect_bitwise("attention_forward round_bf16 out on " + bk->name() + tag, rounded, r[0]);
      expect_bitwise("attention_forward round_bf16 lse on " + bk->name() + tag,
                     bk == be.emu.get() ? e[1] : g[1], r[1]);
    }

    // backward from the emulator's out and lse, into a dqkv of NaN: every element is written
    const Vec dout = randn(sz(B * T * C), rng), dqkv0(sz(B * T * W), kNaN);
    const Op bwd = [&](Backend& bk, Call& c) {
      const TensorView dqkv = c.out(dqkv0, B * T, W);
      bk.attention_backward(dqkv, c.in(dout, B * T, C), c.in(qkv, B * T, W), c.in(out, B * T, C),
                            c.in(lse, B * NH, T), sh, emu::GemmPrecision::BF16);
    };
    const Outputs eb = run(*be.emu, bwd), gb = run(*be.cuda, bwd);
    const AttnMags m = attention_mags(sh, qkv, dout, out, lse, eb[0]);
    expect_bounded("attention_forward out" + tag, e[0], g[0], m.out, kAttnBf16Rtol + kAttnFp32Rtol);
    expect_bounded("attention_forward lse" + tag, e[1], g[1], m.lse, lse_rtol(sh));
    expect_bounded("attention_backward dqkv" + tag, eb[0], gb[0], m.dqkv,
                   kAttnBf16Rtol + kAttnFp32Rtol);
    // and the CUDA backward from the CUDA forward: run to run bitwise; with the BF16 storage asked
    // of the op, the bits of bf16_round of its unrounded output
    const auto bwd_cuda = [&](bool round) {
      return Op([&, round](Backend& bk, Call& c) {
        const TensorView dqkv = c.out(dqkv0, B * T, W, round);
        bk.attention_backward(dqkv, c.in(dout, B * T, C), c.in(qkv, B * T, W), c.in(g[0], B * T, C),
                              c.in(g[1], B * NH, T), sh, emu::GemmPrecision::BF16);
      });
    };
    const Vec plain = run(*be.cuda, bwd_cuda(false))[0];
    expect_bitwise("attention_backward twice" + tag, plain, run(*be.cuda, bwd_cuda(false))[0]);
    Vec rounded = plain;
    for (float& v : rounded) v = bf16_round(v);
    expect_bitwise("attention_backward round_bf16" + tag, rounded,
                   run(*be.cuda, bwd_cuda(true))[0]);
  }
}

// The cross-entropy kernel divides by the row's sum with a reciprocal made once a row and three
// FMAs a quotient (the fast path of __fdiv_rn's own sequence): the same bits as __fdiv_rn on its
// range (dividends in [2^-64, 1], divisors in [1, 2^24]).
TEST(LayersGpu, CeDivisionEqualsFdivRn) {
  REQUIRE_GPU();
  EXPECT_EQ(gpu::ce_division_mismatches(int64_t{1} << 26, 0x5eed), 0);
  EXPECT_EQ(gpu::ce_division_mismatches(int64_t{1} << 26, 0xfeed), 0);
}

// The backward pass's two ways to dq (HD <= 64): dS stored by the dK/dV kernel and read by a plain
// GEMM, or recomputed in the dQ kernel (CudaOptions::attention_recompute_dq): the same BF16 dS
// values in the same MMA chain, so the same bits, with and without the BF16 storage of the result.
TEST(LayersGpu, AttentionStoredDsEqualsRecomputedDs) {
  REQUIRE_GPU();
  Backends be;
  gpu::CudaOptions recompute;
  recompute.attention_recompute_dq = true;
  auto cuda_recompute = cuda_backend(recompute);
  std::mt19937 rng(515);
  int compared = 0;
  for (const AttentionShape sh : kAttentionShapes) {
    const int64_t B = sh.B, T = sh.T, NH = sh.NH, NKV = sh.NKV, HD = sh.HD;
    if (HD > 64) {
      EXPECT_EQ(gpu::attention_ds_scratch_bytes(B, T, NH, HD), 0) << attn_tag(sh);
      continue;
    }
    const int64_t W = (NH + 2 * NKV) * HD, C = NH * HD;
    const std::string tag = attn_tag(sh);
    const Vec qkv = randn(sz(B * T * W), rng), dout = randn(sz(B * T * C), rng);
    const Outputs f = run(*be.cuda, [&](Backend& bk, Call& c) {
      const TensorView out = c.out(Vec(sz(B * T * C)), B * T, C);
      const TensorView lse = c.out(Vec(sz(B * NH * T)), B * NH, T);
      bk.attention_forward(out, lse, c.in(qkv, B * T, W), sh, emu::GemmPrecision::BF16);
    });
    for (const bool round : {false, true}) {
      const Op bwd = [&](Backend& bk, Call& c) {
        const TensorView dqkv = c.out(Vec(sz(B * T * W), kNaN), B * T, W, round);
        bk.attention_backward(dqkv, c.in(dout, B * T, C), c.in(qkv, B * T, W), c.in(f[0], B * T, C),
                              c.in(f[1], B * NH, T), sh, emu::GemmPrecision::BF16);
      };
      ASSERT_GT(gpu::attention_ds_scratch_bytes(B, T, NH, HD), 0)
          << tag;  // the stored path is taken
      const Vec stored = run(*be.cuda, bwd)[0];
      ASSERT_EQ(gpu::attention_ds_scratch_bytes(B, T, NH, HD, true), 0) << tag;
      const Vec recomputed = run(*cuda_recompute, bwd)[0];
      expect_bitwise(std::string("attention_backward stored dS vs recomputed") +
                         (round ? " round_bf16" : "") + tag,
                     recomputed, stored);
      ++compared;
    }
  }
  EXPECT_GE(compared, 10);
}

// Head sizes outside the kernels' templates and the emulator-only FP32 mode: errors that say so.
TEST(LayersGpu, AttentionRejectsUnsupportedHeadDimAndFp32) {
  REQUIRE_GPU();
  Backends be;
  const int64_t B = 1, T = 5, NH = 2, NKV = 1;
  // the op's views on zeroed buffers of s's shapes
  auto attention_forward = [&](const AttentionShape& s, emu::GemmPrecision prec) {
    Call c(*be.cuda);
    const TensorView out = c.out(Vec(sz(s.B * s.T * s.NH * s.HD)), s.B * s.T, s.NH * s.HD);
    const TensorView lse = c.out(Vec(sz(s.B * s.NH * s.T)), s.B * s.NH, s.T);
    be.cuda->attention_forward(
        out, lse, c.in(Vec(sz(s.B * s.T * s.qkv_cols())), s.B * s.T, s.qkv_cols()), s, prec);
  };
  for (const int64_t HD : {24, 7, 256}) {
    try {
      attention_forward({B, T, NH, NKV, HD}, emu::GemmPrecision::BF16);
      ADD_FAILURE() << "HD=" << HD << " accepted";
    } catch (const std::invalid_argument& ex) {
      EXPECT_NE(std::string(ex.what()).find("HD=" + std::to_string(HD)), std::string::npos)
          << ex.what();
    }
  }
  EXPECT_THROW(attention_forward({B, T, NH, NKV, 32}, emu::GemmPrecision::FP32),
               std::invalid_argument);
}

// One gpt2-124m layer's shape (B 16, NH 12, T 1024, HD 64) runs forward and backward with finite
// outputs (its speed is bench_gemm's BM_GpuAttention).
TEST(LayersGpu, AttentionGpt2LayerShapeRuns) {
  REQUIRE_GPU();
  Backends be;
  Backend& g = *be.cuda;
  const int64_t B = 16, T = 1024, NH = 12, NKV = 12, HD = 64, W = (NH + 2 * NKV) * HD, C = NH * HD;
  std::mt19937 rng(7);
  const AttentionShape s{B, T, NH, NKV, HD};
  Call c(g);
  const TensorView qkv = c.in(randn(sz(B * T * W), rng), B * T, W);
  const TensorView dout = c.in(randn(sz(B * T * C), rng), B * T, C);
  const TensorView out = c.out(Vec(sz(B * T * C)), B * T, C);
  const TensorView lse = c.out(Vec(sz(B * NH * T)), B * NH, T);
  const TensorView dqkv = c.out(Vec(sz(B * T * W)), B * T, W);
  g.attention_forward(out, lse, qkv, s, emu::GemmPrecision::BF16);
  g.attention_backward(dqkv, dout, qkv, out, lse, s, emu::GemmPrecision::BF16);
  const Outputs r = c.results();
  for (const Vec& v : r)
    for (float x : v) ASSERT_TRUE(std::isfinite(x));
}

TEST(LayersGpu, RopeBitwiseEqualsEmulator) {
  REQUIRE_GPU();
  Backends be;
  std::mt19937 rng(606);
  for (const AttentionShape s :
       {AttentionShape{2, 45, 6, 2, 24}, AttentionShape{1, 9, 2, 1, 10},
        AttentionShape{1, 300, 2, 2, 128}, AttentionShape{1, 4, 2, 1, 5}}) {
    const int64_t N = s.B * s.T, W = s.qkv_cols();
    const std::string tag = " T" + std::to_string(s.T) + " HD" + std::to_string(s.HD);
    const Vec x = randn(sz(N * W), rng);
    const Op fwd = [&](Backend& bk, Call& c) { bk.rope_forward(c.out(x, N, W), s); };
    const Op bwd = [&](Backend& bk, Call& c) { bk.rope_backward(c.out(x, N, W), s); };
    expect_bitwise("rope_forward qkv" + tag, run(*be.emu, fwd)[0], run(*be.cuda, fwd)[0]);
    expect_bitwise("rope_backward dqkv" + tag, run(*be.emu, bwd)[0], run(*be.cuda, bwd)[0]);
  }
}

// ---- elementwise --------------------------------------------------------------------------------

Vec with_specials(Vec v) {
  const float specials[] = {0.0f,   -0.0f, 1e-40f, -1e-40f, 1e-20f, 3.0f, -3.0f, 10.0f,
                            -10.0f, 30.0f, -30.0f, 1e20f,   -1e20f, kInf, -kInf, kNaN};
  for (float s : specials) v.push_back(s);
  return v;
}

TEST(LayersGpu, ElementwiseMatchesEmulator) {
  REQUIRE_GPU();
  Backends be;
  std::mt19937 rng(707);
  const Vec x = with_specials(randn(1037, rng, 2.0f));
  const int64_t n = static_cast<int64_t>(x.size());
  const Vec dout = randn(sz(n), rng), dinp0 = randn(sz(n), rng), y = randn(sz(n), rng);

  const Op gelu_f = [&](Backend& bk, Call& c) {
    bk.activation_forward(Activation::GeluTanh, c.out(Vec(sz(n), kNaN), 1, n), c.in(x, 1, n));
  };
  const Op gelu_b = [&](Backend& bk, Call& c) {
    bk.activation_backward(Activation::GeluTanh, c.out(dinp0, 1, n), c.in(x, 1, n),
                           c.in(dout, 1, n));
  };
  // GELU goes through tanhf: a few ulp of 0.5|x| (the 1 + tanh cancellation for x << 0), and of
  // the derivative's terms for the backward.
  constexpr double kScale = 0.7978845608028654, kCubic = 0.044715;
  Mag mag_f(sz(n)), mag_b(sz(n));
  const Vec ef = run(*be.emu, gelu_f)[0];
  for (size_t i = 0; i < sz(n); ++i) {
    const double xi = std::fabs(static_cast<double>(x[i]));
    mag_f[i] = std::fabs(ef[i]) + 0.5 * xi;
    mag_b[i] = std::fabs(dinp0[i]) +
               std::fabs(dout[i]) * (1.0 + xi * kScale * (1.0 + 3.0 * kCubic * xi * xi));
  }
  expect_bounded("gelu_forward out", ef, run(*be.cuda, gelu_f)[0], mag_f, kTranscendentalRtol);
  expect_bounded("gelu_backward dinp", run(*be.emu, gelu_b)[0], run(*be.cuda, gelu_b)[0], mag_b,
                 kTranscendentalRtol);

  const Op sq_f = [&](Backend& bk, Call& c) {
    bk.activation_forward(Activation::SquaredRelu, c.out(Vec(sz(n), kNaN), 1, n), c.in(x, 1, n));
  };
  const Op sq_b = [&](Backend& bk, Call& c) {
    bk.activation_backward(Activation::SquaredRelu, c.out(dinp0, 1, n), c.in(x, 1, n),
                           c.in(dout, 1, n));
  };
  const Op res = [&](Backend& bk, Call& c) {
    bk.residual_forward(c.out(Vec(sz(n), kNaN), 1, n), c.in(x, 1, n), c.in(y, 1, n));
  };
  expect_bitwise("squared_relu_forward out", run(*be.emu, sq_f)[0], run(*be.cuda, sq_f)[0]);
  expect_bitwise("squared_relu_backward dinp", run(*be.emu, sq_b)[0], run(*be.cuda, sq_b)[0]);
  expect_bitwise("residual_forward out", run(*be.emu, res)[0], run(*be.cuda, res)[0]);
}

// An output view marked bf16_values (the model's BF16 activation storage fused into the op) gives
// exactly the op's output followed by rounding to BF16 over it, on both backends, for every op
// whose output may carry the mark; an op that adds a bias adds it rounded to BF16 then
// (Backend::matmul_forward), so its unmarked run is given the rounded bias.
TEST(LayersGpu, FusedBf16RoundingEqualsSeparatePass) {
  REQUIRE_GPU();
  Backends be;
  std::mt19937 rng(909);
  const int64_t N = 37, C = 96, F = 53, K = 40;
  // (the ops read x's first N * C values: the specials appended lie past them)
  const Vec xs = with_specials(randn(sz(N * C), rng, 2.0f)), x(xs.begin(), xs.begin() + N * C),
            y = randn(sz(N * C), rng), w = randn(sz(C), rng, 1.0f, 1.0f), b = randn(sz(C), rng),
            dout = randn(sz(N * C), rng), dinp0 = randn(sz(N * C), rng);
  const Vec sw_in = randn(sz(N * 2 * F), rng, 2.0f), sw_dout = randn(sz(N * F), rng),
            sw_dinp0 = randn(sz(N * 2 * F), rng);
  const Vec mx = randn(sz(N * K), rng), mw = randn(sz(C * K), rng, 0.3f);
  Vec b16 = b;
  for (float& v : b16) v = bf16_round(v);
  // each op writes its activation output first (c.out index 0), marked bf16_values when r; the rest
  // are scratch it also needs
  using RoundOp = std::function<void(Backend&, Call&, bool)>;
  const std::vector<std::pair<std::string, RoundOp>> ops = {
      {"norm_forward LayerNorm",
       [&](Backend& bk, Call& c, bool r) {
         const TensorView out = c.out(Vec(sz(N * C), kNaN), N, C, r);
         const TensorView mean = c.out(Vec(sz(N), kNaN), N, 1);
         const TensorView rstd = c.out(Vec(sz(N), kNaN), N, 1);
         bk.norm_forward(NormKind::LayerNorm, out, mean, rstd, c.in(x, N, C), c.in(w, C, 1),
                         c.in(b, C, 1));
       }},
      {"norm_backward LayerNorm",
       [&](Backend& bk, Call& c, bool r) {
         const TensorView dinp = c.out(dinp0, N, C, r);
         const TensorView dw = c.out(Vec(sz(C), 0.0f), C, 1);
         const TensorView db = c.out(Vec(sz(C), 0.0f), C, 1);
         const Vec mean(sz(N), 0.25f), rstd(sz(N), 0.75f);
         bk.norm_backward(NormKind::LayerNorm, dinp, dw, db, c.in(dout, N, C), c.in(x, N, C),
                          c.in(w, C, 1), c.in(mean, N, 1), c.in(rstd, N, 1));
       }},
      {"norm_forward RMSNorm",
       [&](Backend& bk, Call& c, bool r) {
         const TensorView out = c.out(Vec(sz(N * C), kNaN), N, C, r);
         const TensorView rstd = c.out(Vec(sz(N), kNaN), N, 1);
         bk.norm_forward(NormKind::RMSNorm, out, TensorView{}, rstd, c.in(x, N, C), c.in(w, C, 1),
                         TensorView{});
       }},
      {"norm_backward RMSNorm",
       [&](Backend& bk, Call& c, bool r) {
         const TensorView dinp = c.out(dinp0, N, C, r);
         const TensorView dw = c.out(Vec(sz(C), 0.0f), C, 1);
         const Vec rstd(sz(N), 0.75f);
         bk.norm_backward(NormKind::RMSNorm, dinp, dw, TensorView{}, c.in(dout, N, C),
                          c.in(x, N, C), c.in(w, C, 1), TensorView{}, c.in(rstd, N, 1));
       }},
      {"matmul_forward bias",
       [&](Backend& bk, Call& c, bool r) {
         bk.matmul_forward(c.out(Vec(sz(N * C), kNaN), N, C, r), c.in(mx, N, K), c.in(mw, C, K),
                           c.in(r ? b : b16, C, 1), emu::GemmPrecision::BF16);
       }},
      {"matmul_forward",
       [&](Backend& bk, Call& c, bool r) {
         bk.matmul_forward(c.out(Vec(sz(N * C), kNaN), N, C, r), c.in(mx, N, K), c.in(mw, C, K),
                           TensorView{}, emu::GemmPrecision::BF16);
       }},
      {"bias_forward",
       [&](Backend& bk, Call& c, bool r) {
         const TensorView out = c.out(y, N, C, r);  // (in place: out is inp)
         bk.bias_forward(out, as_stored(out), c.in(r ? b : b16, C, 1));
       }},
      {"activation_forward GeluTanh",
       [&](Backend& bk, Call& c, bool r) {
         bk.activation_forward(Activation::GeluTanh, c.out(Vec(sz(N * C), kNaN), N, C, r),
                               c.in(x, N, C));
       }},
      {"activation_backward GeluTanh",
       [&](Backend& bk, Call& c, bool r) {
         bk.activation_backward(Activation::GeluTanh, c.out(dinp0, N, C, r), c.in(x, N, C),
                                c.in(dout, N, C));
       }},
      {"activation_forward SquaredRelu",
       [&](Backend& bk, Call& c, bool r) {
         bk.activation_forward(Activation::SquaredRelu, c.out(Vec(sz(N * C), kNaN), N, C, r),
                               c.in(x, N, C));
       }},
      {"activation_backward SquaredRelu",
       [&](Backend& bk, Call& c, bool r) {
         bk.activation_backward(Activation::SquaredRelu, c.out(dinp0, N, C, r), c.in(x, N, C),
                                c.in(dout, N, C));
       }},
      {"activation_forward SwiGLU",
       [&](Backend& bk, Call& c, bool r) {
         bk.activation_forward(Activation::SwiGLU, c.out(Vec(sz(N * F), kNaN), N, F, r),
                               c.in(sw_in, N, 2 * F));
       }},
      {"activation_backward SwiGLU",
       [&](Backend& bk, Call& c, bool r) {
         bk.activation_backward(Activation::SwiGLU, c.out(sw_dinp0, N, 2 * F, r),
                                c.in(sw_in, N, 2 * F), c.in(sw_dout, N, F));
       }},
      {"residual_forward",
       [&](Backend& bk, Call& c, bool r) {
         bk.residual_forward(c.out(Vec(sz(N * C), kNaN), N, C, r), c.in(x, N, C), c.in(y, N, C));
       }},
  };
  for (Backend* bk : {be.emu.get(), be.cuda.get()}) {
    for (const auto& [name, op] : ops) {
      const Vec fused = run(*bk, [&](Backend& k, Call& c) { op(k, c, true); })[0];
      Vec separate = run(*bk, [&](Backend& k, Call& c) { op(k, c, false); })[0];
      bool any_changed = false;
      for (float& v : separate) {
        const float r = bf16_round(v);
        any_changed = any_changed || !same_bits(r, v);
        v = r;
      }
      expect_bitwise(name + " bf16_values on " + bk->name(), separate, fused);
      EXPECT_TRUE(any_changed) << name << ": the case does not exercise the rounding";
    }
  }
}

// dout marked bf16_values: an activation's or norm's backward pass reading dout as bf16_round(dout)
// gives the bits of the same pass on a dout rounded beforehand (every output: dinp, and the norms'
// weight and bias gradients), on both backends.
TEST(LayersGpu, BackwardPassesReadBf16Dout) {
  REQUIRE_GPU();
  Backends be;
  std::mt19937 rng(919);
  const int64_t N = 7, F = 96, n = N * F;
  const Vec x = randn(sz(n), rng), dout = randn(sz(n), rng), sw_in = randn(sz(2 * n), rng);
  const Vec w = randn(sz(F), rng), mean(sz(N), 0.25f), rstd(sz(N), 0.75f);
  Vec rounded = dout;
  for (float& v : rounded) v = bf16_round(v);
  // (dinp, output 0, marked: written rounded; b: dout marked, read rounded)
  using BwdOp = std::function<void(Backend&, Call&, const Vec&, bool)>;
  const std::vector<std::pair<std::string, BwdOp>> ops = {
      {"activation_backward GeluTanh",
       [&](Backend& bk, Call& c, const Vec& d, bool b) {
         bk.activation_backward(Activation::GeluTanh, c.out(Vec(sz(n), kNaN), N, F, true),
                                c.in(x, N, F), c.in(d, N, F, b));
       }},
      {"activation_backward SquaredRelu",
       [&](Backend& bk, Call& c, const Vec& d, bool b) {
         bk.activation_backward(Activation::SquaredRelu, c.out(Vec(sz(n), kNaN), N, F, true),
                                c.in(x, N, F), c.in(d, N, F, b));
       }},
      {"activation_backward SwiGLU",
       [&](Backend& bk, Call& c, const Vec& d, bool b) {
         bk.activation_backward(Activation::SwiGLU, c.out(Vec(sz(2 * n), kNaN), N, 2 * F, true),
                                c.in(sw_in, N, 2 * F), c.in(d, N, F, b));
       }},
      {"norm_backward LayerNorm",
       [&](Backend& bk, Call& c, const Vec& d, bool b) {
         const TensorView dinp = c.out(Vec(sz(n), 0.0f), N, F, true);
         const TensorView dw = c.out(Vec(sz(F), 0.0f), F, 1);
         const TensorView db = c.out(Vec(sz(F), 0.0f), F, 1);
         bk.norm_backward(NormKind::LayerNorm, dinp, dw, db, c.in(d, N, F, b), c.in(x, N, F),
                          c.in(w, F, 1), c.in(mean, N, 1), c.in(rstd, N, 1));
       }},
      {"norm_backward RMSNorm",
       [&](Backend& bk, Call& c, const Vec& d, bool b) {
         const TensorView dinp = c.out(Vec(sz(n), 0.0f), N, F, true);
         const TensorView dw = c.out(Vec(sz(F), 0.0f), F, 1);
         bk.norm_backward(NormKind::RMSNorm, dinp, dw, TensorView{}, c.in(d, N, F, b),
                          c.in(x, N, F), c.in(w, F, 1), TensorView{}, c.in(rstd, N, 1));
       }},
  };
  for (Backend* bk : {be.emu.get(), be.cuda.get()})
    for (const auto& [name, op] : ops) {
      const Outputs on_read = run(*bk, [&](Backend& k, Call& c) { op(k, c, dout, true); });
      const Outputs before = run(*bk, [&](Backend& k, Call& c) { op(k, c, rounded, false); });
      const Outputs raw = run(*bk, [&](Backend& k, Call& c) { op(k, c, dout, false); });
      for (size_t o = 0; o < on_read.size(); ++o)
        expect_bitwise(name + " output " + std::to_string(o) + " dout bf16_values on " + bk->name(),
                       before[o], on_read[o]);
      bool differs = false;
      for (size_t i = 0; i < raw[0].size(); ++i)
        differs = differs || !same_bits(raw[0][i], on_read[0][i]);
      EXPECT_TRUE(differs) << name << ": the case does not exercise the rounding of dout";
    }
}

// The cross-entropy kernel with its row cached in shared memory (the default where it fits) and
// reading the logits in every pass: the same bits, at gpt2's vocabulary (196.5 KiB of shared
// memory), just over the 48 KiB default limit (12288, which needs the opt-in), beyond the H200's
// opt-in (60000: both runs uncached), and small ones; with dlosses 1 (dlogits then hold the
// probabilities, less 1 at the target), with random dlosses, and in BF16 storage.
TEST(LayersGpu, CrossEntropyCachedEqualsUncached) {
  REQUIRE_GPU();
  auto cuda = make_backend("cuda");
  gpu::CudaOptions uncached;
  uncached.crossentropy_cached = false;
  auto cuda_uncached = cuda_backend(uncached);
  std::mt19937 rng(818);
  for (const RowsCols s : {RowsCols{6, 50304}, RowsCols{5, 12288}, RowsCols{3, 60000},
                           RowsCols{37, 256}, RowsCols{3, 13}}) {
    const int64_t N = s.N, V = s.C;
    const Vec logits = randn(sz(N * V), rng, 3.0f), dlosses = randn(sz(N), rng, 0.1f),
              ones(sz(N), 1.0f);
    const std::vector<int32_t> targets = randint(sz(N), static_cast<int32_t>(V), rng);
    for (int mode = 0; mode < 3; ++mode) {  // dlosses 1; random dlosses; BF16 storage
      const Op op = [&](Backend& bk, Call& c) {
        crossentropy_on(bk, c, c.in(logits, N, V, mode == 2), targets, mode == 0 ? ones : dlosses,
                        false);
      };
      const Outputs cached = run(*cuda, op), plain = run(*cuda_uncached, op);
      const std::string tag =
          " " + std::to_string(N) + "x" + std::to_string(V) + " mode " + std::to_string(mode);
      expect_bitwise("crossentropy losses cached vs not" + tag, plain[0], cached[0]);
      expect_bitwise("crossentropy dlogits cached vs not" + tag, plain[1], cached[1]);
    }
    // logits marked bf16_values are read rounded: the op on logits rounded beforehand, its gradient
    // then rounded (the mark's dlogits are written rounded)
    const Vec rounded = bf16_values_of(logits);
    auto fwd = [&](const Vec& z, bool bf16) {
      return run(*cuda, [&](Backend& bk, Call& c) {
        crossentropy_on(bk, c, c.in(z, N, V, bf16), targets, dlosses, false);
      });
    };
    const Outputs a = fwd(logits, true), b = fwd(rounded, false), unrounded = fwd(logits, false);
    const std::string tag = " " + std::to_string(N) + "x" + std::to_string(V);
    expect_bitwise("crossentropy bf16_values logits losses" + tag, b[0], a[0]);
    expect_bitwise("crossentropy bf16_values logits dlogits" + tag, bf16_values_of(b[1]), a[1]);
    EXPECT_NE(unrounded[0], a[0]) << "the rounding changed nothing" << tag;
  }
}

// A target far below its row's maximum: 2^x flushes to zero from a gap of ~87.3, the emulator's
// expf only from ~103.9; the CUDA op's loss stays finite and agrees in between with the emulator's
// reference functions, the forward pass alone (emu::crossentropy_softmax_forward) and fused with
// the backward pass (emu::crossentropy_softmax_forward_backward).
TEST(LayersGpu, CrossEntropyLossFiniteForFarTargets) {
  REQUIRE_GPU();
  auto cuda = make_backend("cuda");
  const int64_t N = 3, V = 64;
  Vec logits(sz(N * V), 0.0f);
  // (below ~96 the subnormal exp has over a thousand steps of 2^-149: both backends' expf within
  // a few of them, so the losses agree to ~1e-3)
  const float gaps[N] = {88.5f, 92.0f, 96.0f};
  const std::vector<int32_t> targets = {5, 17, 63};
  for (int64_t n = 0; n < N; ++n) logits[sz(n * V + targets[sz(n)])] = -gaps[n];
  const Vec dlosses(sz(N), 1.0f / static_cast<float>(N));
  const Vec g = run(*cuda, [&](Backend& bk, Call& c) {
    crossentropy_on(bk, c, c.in(logits, N, V), targets, dlosses, false);
  })[0];
  Vec forward(sz(N)), probs(sz(N * V)), fused(sz(N)), dlogits(sz(N * V));
  emu::crossentropy_softmax_forward(forward.data(), probs.data(), logits.data(), targets.data(), N,
                                    V, false);
  emu::crossentropy_softmax_forward_backward(fused.data(), dlogits.data(), logits.data(),
                                             targets.data(), dlosses.data(), N, V, false);
  for (int mode = 0; mode < 2; ++mode) {
    const Vec& e = mode == 0 ? forward : fused;
    for (int64_t n = 0; n < N; ++n) {
      EXPECT_TRUE(std::isfinite(g[sz(n)])) << "mode " << mode << " row " << n << ": " << g[sz(n)];
      EXPECT_NEAR(g[sz(n)], e[sz(n)], 5e-3) << "mode " << mode << " row " << n;
    }
  }
}

// What the cross-entropy op on bk computes from float32 logits z [N, V] before its gradient: the
// losses, and the probabilities from its dlogits with dlosses 1, (softmax - onehot) * 1, exact but
// at the target; the target's own from a second run with every target moved one class on (the
// probabilities do not depend on the targets: elsewhere both runs agree bit for bit).
struct CrossEntropyForward {
  Vec losses, probs;
};
CrossEntropyForward crossentropy_probs(Backend& bk, const Vec& z,
                                       const std::vector<int32_t>& targets, int64_t N, int64_t V,
                                       const std::string& tag) {
  std::vector<int32_t> moved(targets);
  for (int32_t& t : moved) t = static_cast<int32_t>((t + 1) % V);
  const Vec ones(sz(N), 1.0f);
  auto go = [&](const std::vector<int32_t>& t) {
    return run(bk,
               [&](Backend& k, Call& c) { crossentropy_on(k, c, c.in(z, N, V), t, ones, false); });
  };
  const Outputs a = go(targets), b = go(moved);
  Vec probs = a[1], other = b[1];
  for (int64_t n = 0; n < N; ++n) {
    probs[sz(n * V + targets[sz(n)])] = b[1][sz(n * V + targets[sz(n)])];
    other[sz(n * V + moved[sz(n)])] = a[1][sz(n * V + moved[sz(n)])];
  }
  expect_bitwise("crossentropy probabilities, targets moved, on " + bk.name() + tag, probs, other);
  return {a[0], probs};
}

// The CUDA op against the emulator's reference functions (emu/layers.hpp): the losses and the
// probabilities (crossentropy_probs) within the bounds below of emu::crossentropy_softmax_forward's
// and of a double-precision softmax; and on each backend the op's losses and dlogits, for random
// dlosses and in BF16 storage, are those of its own forward pass, and of
// emu::crossentropy_softmax_backward on its own forward pass's probabilities, bit for bit (so the
// CUDA gradient's arithmetic is the emulator's).
TEST(LayersGpu, CrossEntropyMatchesEmulator) {
  REQUIRE_GPU();
  Backends be;
  std::mt19937 rng(808);
  for (const RowsCols s : {RowsCols{37, 1003}, RowsCols{5, 50257}, RowsCols{2, 3}}) {
    const int64_t N = s.N, V = s.C;
    const std::string tag = " " + std::to_string(N) + "x" + std::to_string(V);
    const Vec logits = randn(sz(N * V), rng, 3.0f);
    const std::vector<int32_t> targets = randint(sz(N), static_cast<int32_t>(V), rng);
    Vec e_losses(sz(N)), e_probs(sz(N * V));
    emu::crossentropy_softmax_forward(e_losses.data(), e_probs.data(), logits.data(),
                                      targets.data(), N, V, false);
    const CrossEntropyForward g = crossentropy_probs(*be.cuda, logits, targets, N, V, tag);
    // The emulator sums the V exponentials sequentially in FP32: its own error reaches (V-1) ulp
    // of the sum (seen: 0.15 V ulp at V = 50257), so against it the budget grows with V. Against a
    // double-precision softmax the CUDA kernel (256 or, from V = 4096, 1024 strided sums of V/256
    // or V/1024 terms, then an 8- or 10-level tree) must stay within (V/256 + 10) ulp.
    const double rtol_emu = kTranscendentalRtol + static_cast<double>(V - 1) * kUlp;
    const double rtol_exact = kTranscendentalRtol + (static_cast<double>(V) / 256.0 + 10.0) * kUlp;
    Vec exact_probs(sz(N * V)), exact_losses(sz(N));
    Mag mag_loss(sz(N));  // -log p: its absolute error is about the relative error of p
    for (int64_t n = 0; n < N; ++n) {
      const float* z = &logits[sz(n * V)];
      const double mx = *std::max_element(z, z + V);
      double sum = 0;
      for (int64_t i = 0; i < V; ++i) sum += std::exp(static_cast<double>(z[i]) - mx);
      for (int64_t i = 0; i < V; ++i)
        exact_probs[sz(n * V + i)] =
            static_cast<float>(std::exp(static_cast<double>(z[i]) - mx) / sum);
      exact_losses[sz(n)] = static_cast<float>(std::log(sum) - (z[targets[sz(n)]] - mx));
      mag_loss[sz(n)] = 1.0 + std::fabs(e_losses[sz(n)]);
    }
    expect_bounded("crossentropy losses" + tag, e_losses, g.losses, mag_loss, rtol_emu);
    expect_bounded("crossentropy probs" + tag, e_probs, g.probs, abs_of(e_probs), rtol_emu);
    expect_bounded("crossentropy losses vs fp64" + tag, exact_losses, g.losses, mag_loss,
                   rtol_exact);
    expect_bounded("crossentropy probs vs fp64" + tag, exact_probs, g.probs, abs_of(exact_probs),
                   rtol_exact);

    const Vec dlosses = randn(sz(N), rng, 1.0f / static_cast<float>(N));
    for (bool round_bf16 : {false, true}) {
      // (in BF16 storage the op reads the logits rounded: its forward pass is the one on the
      // rounded logits; and it writes dlogits rounded)
      const Vec z = round_bf16 ? bf16_values_of(logits) : logits;
      for (Backend* bk : {be.emu.get(), be.cuda.get()}) {
        const std::string on = tag + (round_bf16 ? " bf16 " : " ") + bk->name();
        const CrossEntropyForward f =
            crossentropy_probs(*bk, z, targets, N, V, tag + (round_bf16 ? " bf16" : ""));
        Vec ref(sz(N * V));
        emu::crossentropy_softmax_backward(ref.data(), f.probs.data(), targets.data(),
                                           dlosses.data(), N, V, round_bf16);
        const Outputs fu = run(*bk, [&](Backend& k, Call& c) {
          crossentropy_on(k, c, c.in(logits, N, V, round_bf16), targets, dlosses, false);
        });
        expect_bitwise("crossentropy_forward_backward losses" + on, f.losses, fu[0]);
        expect_bitwise("crossentropy_forward_backward dlogits" + on, ref, fu[1]);
      }
    }
  }
}

// The output head's BF16-bits ops against their float32 twins on the same backend, bit for bit:
// the cross-entropy op's BF16 dlogits are the bits of its float32 dlogits marked bf16_values
// (losses equal), and matmul_backward reading a BF16 dout equals matmul_backward on the widened
// dout (dinp written over NaN, dweight added to), at both precisions. The emulator always; the CUDA
// backend where there is a GPU.
TEST(LayersGpu, Bf16DoutOpsEqualTheirFp32Twins) {
  std::vector<std::unique_ptr<Backend>> backends;
  backends.push_back(make_backend("emu"));
  if (have_gpu()) backends.push_back(make_backend("cuda"));
  std::mt19937 rng(515);
  // the CUDA cross-entropy kernel reading the row in every pass (the emulator has one path)
  std::unique_ptr<Backend> cuda_uncached;
  if (have_gpu()) {
    gpu::CudaOptions uncached;
    uncached.crossentropy_cached = false;
    cuda_uncached = gpu::make_cuda_backend(uncached);
  }
  for (auto& bk : backends) {
    for (int64_t V : {int64_t{300}, int64_t{5000}, int64_t{50304}}) {
      const int64_t N = V > 5000 ? 3 : 9;
      const Vec logits = randn(sz(N * V), rng, 3.0f), dlosses = randn(sz(N), rng, 0.1f);
      const std::vector<int32_t> targets = randint(sz(N), static_cast<int32_t>(V), rng);
      const Op fp32 = [&](Backend& k, Call& c) {
        crossentropy_on(k, c, c.in(logits, N, V, true), targets, dlosses, false);
      };
      const Op half = [&](Backend& k, Call& c) {
        crossentropy_on(k, c, c.in(logits, N, V, true), targets, dlosses, true);
      };
      const Outputs f = run(*bk, fp32);
      for (bool cached :
           {true, false}) {  // (CUDA: the row in shared memory, or read in every pass)
        const Outputs h = run(cached || bk->name() != "cuda" ? *bk : *cuda_uncached, half);
        const std::string tag =
            " V=" + std::to_string(V) + " " + bk->name() + (cached ? "" : " uncached");
        expect_bitwise("crossentropy bf16 losses" + tag, f[0], h[0]);
        expect_bitwise("crossentropy bf16 dlogits" + tag, f[1], h[1]);
      }
    }
    for (emu::GemmPrecision prec : {emu::GemmPrecision::BF16, emu::GemmPrecision::FP32}) {
      const int64_t N = 33, K = 70, OC = 45;
      const Vec x = randn(sz(N * K), rng), w = randn(sz(OC * K), rng, 0.3f),
                dw0 = randn(sz(OC * K), rng);
      std::vector<uint16_t> dout(sz(N * OC));
      Vec dout_f(dout.size());
      for (size_t i = 0; i < dout.size(); ++i) {
        dout[i] = bf16_rne(randn(1, rng)[0]);
        dout_f[i] = bf16_to_f32(dout[i]);
      }
      const Op ref = [&](Backend& k, Call& c) {
        const TensorView dinp = c.out(Vec(sz(N * K), kNaN), N, K);
        const TensorView dw = c.out(dw0, OC, K);
        k.matmul_backward(dinp, dw, TensorView{}, c.in(dout_f, N, OC), c.in(x, N, K),
                          c.in(w, OC, K), prec);
      };
      const Op got = [&](Backend& k, Call& c) {
        const TensorView dinp = c.out(Vec(sz(N * K), kNaN), N, K);
        const TensorView dw = c.out(dw0, OC, K);
        k.matmul_backward(dinp, dw, TensorView{}, c.in(dout, N, OC), c.in(x, N, K), c.in(w, OC, K),
                          prec);
      };
      const Outputs r = run(*bk, ref), g = run(*bk, got);
      const std::string tag =
          std::string(prec == emu::GemmPrecision::BF16 ? " bf16 " : " fp32 ") + bk->name();
      expect_bitwise("matmul_backward BF16 dout dinp" + tag, r[0], g[0]);
      expect_bitwise("matmul_backward BF16 dout dweight" + tag, r[1], g[1]);
    }
  }
}

// The residual add fused into the norm that reads it (residual_norm_forward: one pass on the CUDA
// backend where the row kernel applies: LayerNorm, b and the output as BF16 bits, C <= 1024,
// C % 4 == 0, aligned; the composition elsewhere) against the two ops (residual_forward, then
// norm_forward), bit for bit: the residual stream, the norm's output, mean and rstd; with and
// without the residual's BF16 rounding (res marked bf16_values), b and the output each as BF16
// bits or float32 (the output marked bf16_values), LayerNorm and RMSNorm, at gpt2's C, a C the rows
// kernel covers with a partial quad set, and one past its limit.
TEST(LayersGpu, ResidualNormForwardEqualsTheTwoOps) {
  REQUIRE_GPU();
  Backends be;
  std::mt19937 rng(818);
  for (const int64_t C : {int64_t{768}, int64_t{100}, int64_t{1028}}) {
    for (const bool rb : {true, false}) {
      const int64_t N = 37;
      const Vec a = randn(sz(N * C), rng), w = randn(sz(C), rng), b = randn(sz(C), rng);
      const Vec p = bf16_values_of(randn(sz(N * C), rng));
      const std::vector<uint16_t> p16 = bf16_bits_of(p);
      for (const NormKind kind : {NormKind::LayerNorm, NormKind::RMSNorm}) {
        for (int storage = 0; storage < 4; ++storage) {  // bit 0: b as bits; bit 1: out as bits
          const bool ln = kind == NormKind::LayerNorm, b16 = storage & 1, out16 = storage & 2;
          const std::string tag = " C=" + std::to_string(C) + (rb ? " round_bf16" : "") +
                                  (ln ? " LayerNorm" : " RMSNorm") + (b16 ? " b16" : "") +
                                  (out16 ? " out16" : "");
          auto go = [&](bool fused) {
            return run(*be.cuda, [&](Backend& k, Call& c) {
              const TensorView res = c.out(Vec(sz(N * C), kNaN), N, C, rb);
              const TensorView out =
                  out16 ? c.out16(N, C) : c.out(Vec(sz(N * C), kNaN), N, C, true);
              const TensorView mean = c.out(Vec(sz(N), kNaN), N, 1);
              const TensorView rstd = c.out(Vec(sz(N), kNaN), N, 1);
              const TensorView av = c.in(a, N, C), bv = b16 ? c.in(p16, N, C) : c.in(p, N, C),
                               mv = ln ? mean : TensorView{}, wv = c.in(w, C, 1),
                               biasv = ln ? c.in(b, C, 1) : TensorView{};
              if (fused) {
                k.residual_norm_forward(kind, res, out, mv, rstd, av, bv, wv, biasv);
              } else {
                k.residual_forward(res, av, bv);
                k.norm_forward(kind, out, mv, rstd, as_stored(res), wv, biasv);
              }
            });
          };
          const Outputs two = go(false), one = go(true);
          const char* names[] = {"res", "out", "mean", "rstd"};
          for (size_t i = 0; i < 4; ++i)
            expect_bitwise(std::string("residual_norm_forward ") + names[i] + tag, two[i], one[i]);
        }
      }
    }
  }
}

// Every BF16 bit pattern once (65536 of them, in order), those `drop` rejects replaced by +0, as
// bits and as their FP32 values.
std::pair<std::vector<uint16_t>, Vec> every_bf16(const std::function<bool(uint16_t)>& drop) {
  std::vector<uint16_t> bits(size_t{1} << 16);
  Vec values(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) {
    bits[i] = drop(static_cast<uint16_t>(i)) ? uint16_t{0} : static_cast<uint16_t>(i);
    values[i] = bf16_to_f32(bits[i]);
  }
  return {bits, values};
}

// GELU into a BF16 linear with BF16 input and output bits takes the lookup table of GELU's bits
// (gpu/matmul.cu: gelu_forward_bf16_lut_kernel): on every finite BF16 input, the activation and the
// matmul's output equal the computing path's (FP32 input and activation) bit for bit.
TEST(LayersGpu, GeluLookupEqualsComputedOnEveryBf16) {
  REQUIRE_GPU();
  Backends be;
  const int64_t N = 256, K = 256, OC = 16;  // N * K = 65536: every bit pattern once
  std::mt19937 rng(717);
  const auto inputs =
      every_bf16([](uint16_t b) { return (b & 0x7F80u) == 0x7F80u; });  // (not Inf, NaN)
  const std::vector<uint16_t>& pre16 = inputs.first;
  const Vec& pre = inputs.second;
  const Vec w = randn(sz(OC * K), rng, 0.3f), b = randn(sz(OC), rng);
  const emu::GemmPrecision bf16 = emu::GemmPrecision::BF16;
  const Outputs r = run(*be.cuda, [&](Backend& k, Call& c) {
    const TensorView out = c.out(Vec(sz(N * OC), kNaN), N, OC, true);
    const TensorView act = c.out(Vec(sz(N * K), kNaN), N, K, true);
    const ActivationSource src{ActivationOp::GeluForward, c.in(pre, N, K), {}, act};
    k.matmul_forward_activation(out, src, c.in(w, OC, K), c.in(b, OC, 1), bf16);
  });
  const Outputs g = run(*be.cuda, [&](Backend& k, Call& c) {
    const TensorView out16 = c.out16(N, OC);
    const ActivationSource src{ActivationOp::GeluForward, c.in(pre16, N, K), {}, c.out16(N, K)};
    k.matmul_forward_activation(out16, src, c.in(w, OC, K), c.in(b, OC, 1), bf16);
  });
  expect_bitwise("GELU table: act", r[1], g[1]);
  Vec out_r = r[0];
  for (float& v : out_r) v = bf16_round(v);
  expect_bitwise("GELU table: out", out_r, g[0]);
}

// GELU's backward pass on BF16 bits (pre-activation and gradient) against the FP32 GELU path: on
// every finite BF16 pre-activation below 2^60 (larger ones make NaN gradients, which would hide
// every other bit), the BF16 linear's backward pass (dinp, dweight, dbias) is the same bit for bit.
// (Written for a lookup table of GELU's local gradient, which it passed on the H200; the table ran
// slower than computing, 1.71 against 1.48 ms a step, and was removed. The check stays.)
TEST(LayersGpu, GeluBackwardBitsEqualFp32OnEveryBf16) {
  REQUIRE_GPU();
  Backends be;
  const int64_t N = 256, OC = 256, K = 32;  // N * OC = 65536: every bit pattern once
  std::mt19937 rng(919);
  const auto inputs = every_bf16(
      [](uint16_t b) { return (b & 0x7FFFu) >= 0x5D80u; });  // (not |x| >= 2^60, Inf, NaN)
  const std::vector<uint16_t>& fc16 = inputs.first;
  const Vec& fc = inputs.second;
  const Vec dact = bf16_values_of(randn(sz(N * OC), rng)), x = randn(sz(N * K), rng),
            w = randn(sz(OC * K), rng, 0.3f);
  const std::vector<uint16_t> dact16 = bf16_bits_of(dact);
  const Vec dw0 = randn(sz(OC * K), rng), db0 = randn(sz(OC), rng);
  const emu::GemmPrecision bf16 = emu::GemmPrecision::BF16;
  const Outputs r = run(*be.cuda, [&](Backend& k, Call& c) {
    const TensorView dinp = c.out(Vec(sz(N * K), kNaN), N, K);
    const TensorView dw = c.out(dw0, OC, K);
    const TensorView db = c.out(db0, OC, 1);
    const TensorView dfc = c.out(Vec(sz(N * OC), kNaN), N, OC, true);
    const ActivationSource src{ActivationOp::GeluBackward, c.in(fc, N, OC), c.in(dact, N, OC, true),
                               dfc};
    k.matmul_backward_activation(dinp, dw, db, src, c.in(x, N, K), c.in(w, OC, K), bf16);
  });
  // (the pre-activation, the incoming gradient and dinp as BF16 bits)
  const Outputs g = run(*be.cuda, [&](Backend& k, Call& c) {
    const TensorView dinp16 = c.out16(N, K);
    const TensorView dw = c.out(dw0, OC, K);
    const TensorView db = c.out(db0, OC, 1);
    const TensorView dfc = c.out(Vec(sz(N * OC), kNaN), N, OC, true);
    const ActivationSource src{ActivationOp::GeluBackward, c.in(fc16, N, OC), c.in(dact16, N, OC),
                               dfc};
    k.matmul_backward_activation(dinp16, dw, db, src, c.in(x, N, K), c.in(w, OC, K), bf16);
  });
  expect_bitwise("GELU backward bits: dinp16", bf16_values_of(r[0]), g[0]);
  expect_bitwise("GELU backward bits: dweight", r[1], g[1]);
  expect_bitwise("GELU backward bits: dbias", r[2], g[2]);
}

// The ops on BF16 views (the model's BF16 bits storage) against the same ops on float32 views of
// the same values (marked bf16_values where the op writes them rounded): bit for bit, on the
// emulator (widening and narrowing at each op's edges) and the CUDA backend (kernels reading and
// writing the bits; CudaOptions::matmul_bf16_epilogue off, so the GEMMs run the plans of FP32
// outputs: MatmulBf16EpilogueRoundsLikeAddBias covers the epilogue). A BF16 weight view (the
// model's weight shadow, narrowed from the float32 weights by convert) gives the BF16 GEMMs the
// float32 weights' bits.
TEST(LayersGpu, Bf16StorageOpsEqualTheirFp32Twins) {
  std::vector<std::unique_ptr<Backend>> backends;
  backends.push_back(make_backend("emu"));
  // (CUDA: also one whose cross-entropy kernel reads the logits in every pass)
  std::unique_ptr<Backend> cuda_uncached;
  if (have_gpu()) {
    gpu::CudaOptions no_epilogue;
    no_epilogue.matmul_bf16_epilogue = false;
    backends.push_back(gpu::make_cuda_backend(no_epilogue));
    gpu::CudaOptions uncached = no_epilogue;
    uncached.crossentropy_cached = false;
    cuda_uncached = gpu::make_cuda_backend(uncached);
  }
  std::mt19937 rng(616);
  const auto bf16 = emu::GemmPrecision::BF16;
  for (auto& bk : backends) {
    const bool cuda = bk->name() == "cuda";
    // norms
    {
      const int64_t N = 37, C = 96;
      const Vec x = randn(sz(N * C), rng, 2.0f, 0.5f), w = randn(sz(C), rng), b = randn(sz(C), rng);
      for (bool layernorm : {true, false}) {
        const NormKind kind = layernorm ? NormKind::LayerNorm : NormKind::RMSNorm;
        auto norm = [&](bool out16) {
          return run(*bk, [&](Backend& k, Call& c) {
            const TensorView out = out16 ? c.out16(N, C) : c.out(Vec(sz(N * C), kNaN), N, C, true);
            const TensorView mean = c.out(Vec(sz(N), kNaN), N, 1);
            const TensorView rstd = c.out(Vec(sz(N), kNaN), N, 1);
            k.norm_forward(kind, out, layernorm ? mean : TensorView{}, rstd, c.in(x, N, C),
                           c.in(w, C, 1), layernorm ? c.in(b, C, 1) : TensorView{});
          });
        };
        const Outputs r = norm(false), g = norm(true);
        const std::string tag =
            std::string(layernorm ? "layernorm" : "rmsnorm") + "_forward BF16 out " + bk->name();
        expect_bitwise(tag + " out", r[0], g[0]);
        if (layernorm) expect_bitwise(tag + " mean", r[1], g[1]);
        expect_bitwise(tag + " rstd", r[2], g[2]);
      }
    }
    // matmuls: inputs, outputs and weights as bits, with and without a bias
    for (bool with_bias : {true, false}) {
      const int64_t N = 70, K = 48, OC = 40;
      const Vec x = bf16_values_of(randn(sz(N * K), rng)), w = randn(sz(OC * K), rng, 0.3f),
                b = randn(sz(OC), rng);
      const std::vector<uint16_t> x16 = bf16_bits_of(x);
      const std::string tag = std::string(with_bias ? " bias " : " ") + bk->name();
      // the GEMM's weight operand: w, or its BF16 bits narrowed on the backend (a Call output,
      // declared after the op's own)
      auto weight = [&](Backend& k, Call& c, bool w16) {
        if (!w16) return c.in(w, OC, K);
        const TensorView v = c.out16(OC, K);
        k.convert(v, c.in(w, OC, K));
        return v;
      };
      const Outputs r = run(*bk, [&](Backend& k, Call& c) {
        const TensorView out = c.out(Vec(sz(N * OC), kNaN), N, OC, true);
        k.matmul_forward(out, c.in(x, N, K), c.in(w, OC, K),
                         with_bias ? c.in(b, OC, 1) : TensorView{}, bf16);
      });
      for (int mode = 0; mode < 6; ++mode) {  // bits in / bits out / both; float32 or BF16 weight
        const Outputs g = run(*bk, [&](Backend& k, Call& c) {
          const bool in16 = mode % 3 != 1, out16 = mode % 3 != 0;
          const TensorView out = out16 ? c.out16(N, OC) : c.out(Vec(sz(N * OC), kNaN), N, OC, true);
          k.matmul_forward(out, in16 ? c.in(x16, N, K) : c.in(x, N, K), weight(k, c, mode >= 3),
                           with_bias ? c.in(b, OC, 1) : TensorView{}, bf16);
        });
        expect_bitwise("matmul_forward BF16 storage mode " + std::to_string(mode) + tag, r[0],
                       g[0]);
      }
      // backward with the input as bits, and the weight as bits (dbias with the bias case)
      const Vec dout = randn(sz(N * OC), rng), dw0 = randn(sz(OC * K), rng),
                db0 = randn(sz(OC), rng);
      auto backward = [&](bool x_bits, bool w16) {
        return run(*bk, [&](Backend& k, Call& c) {
          const TensorView dinp = c.out(Vec(sz(N * K), kNaN), N, K);
          const TensorView dw = c.out(dw0, OC, K);
          const TensorView db = c.out(db0, OC, 1);
          k.matmul_backward(dinp, dw, with_bias ? db : TensorView{}, c.in(dout, N, OC),
                            x_bits ? c.in(x16, N, K) : c.in(x, N, K), weight(k, c, w16), bf16);
        });
      };
      const Outputs rb = backward(false, false);
      for (int mode = 1; mode < 4; ++mode) {  // x as bits / the weight as bits / both
        const Outputs gb = backward(mode & 1, mode & 2);
        for (size_t i = 0; i < 3; ++i)
          expect_bitwise("matmul_backward BF16 storage mode " + std::to_string(mode) + " output " +
                             std::to_string(i) + tag,
                         rb[i], gb[i]);
      }
    }
    // GELU into a BF16 linear: forward with the activation kept as bits, backward with the input as
    // bits
    {
      const int64_t N = 64, K = 96, OC = 32;
      const Vec pre = randn(sz(N * K), rng, 2.0f), w = randn(sz(OC * K), rng, 0.3f),
                b = randn(sz(OC), rng);
      const Outputs r = run(*bk, [&](Backend& k, Call& c) {
        const TensorView out = c.out(Vec(sz(N * OC), kNaN), N, OC, true);
        const TensorView act = c.out(Vec(sz(N * K), kNaN), N, K, true);
        const ActivationSource src{ActivationOp::GeluForward, c.in(pre, N, K), {}, act};
        k.matmul_forward_activation(out, src, c.in(w, OC, K), c.in(b, OC, 1), bf16);
      });
      const Outputs g = run(*bk, [&](Backend& k, Call& c) {
        const TensorView out = c.out(Vec(sz(N * OC), kNaN), N, OC, true);
        const ActivationSource src{ActivationOp::GeluForward, c.in(pre, N, K), {}, c.out16(N, K)};
        k.matmul_forward_activation(out, src, c.in(w, OC, K), c.in(b, OC, 1), bf16);
      });
      expect_bitwise("matmul_forward_activation BF16 act: out " + bk->name(), r[0], g[0]);
      expect_bitwise("matmul_forward_activation BF16 act: act " + bk->name(), r[1], g[1]);
      // the pre-activation as bits (its values BF16) and the matmul's output as bits
      const Vec pre_r = bf16_values_of(pre);
      const std::vector<uint16_t> pre16 = bf16_bits_of(pre);
      const Outputs r2 = run(*bk, [&](Backend& k, Call& c) {
        const TensorView out = c.out(Vec(sz(N * OC), kNaN), N, OC, true);
        const TensorView act = c.out(Vec(sz(N * K), kNaN), N, K, true);
        const ActivationSource src{ActivationOp::GeluForward, c.in(pre_r, N, K), {}, act};
        k.matmul_forward_activation(out, src, c.in(w, OC, K), c.in(b, OC, 1), bf16);
      });
      const Outputs g2 = run(*bk, [&](Backend& k, Call& c) {
        const TensorView out16 = c.out16(N, OC);
        const ActivationSource src{ActivationOp::GeluForward, c.in(pre16, N, K), {}, c.out16(N, K)};
        k.matmul_forward_activation(out16, src, c.in(w, OC, K), c.in(b, OC, 1), bf16);
      });
      expect_bitwise("matmul_forward_activation BF16 inp, act, out: out " + bk->name(), r2[0],
                     g2[0]);
      expect_bitwise("matmul_forward_activation BF16 inp, act, out: act " + bk->name(), r2[1],
                     g2[1]);
      // the residual add reading b as bits
      const Vec ra = randn(sz(N * OC), rng);
      const Outputs rr = run(*bk, [&](Backend& k, Call& c) {
        k.residual_forward(c.out(Vec(sz(N * OC), kNaN), N, OC, true), c.in(ra, N, OC),
                           c.in(r2[0], N, OC));
      });
      const std::vector<uint16_t> b16 = bf16_bits_of(r2[0]);
      const Outputs gr = run(*bk, [&](Backend& k, Call& c) {
        k.residual_forward(c.out(Vec(sz(N * OC), kNaN), N, OC, true), c.in(ra, N, OC),
                           c.in(b16, N, OC));
      });
      expect_bitwise("residual_forward BF16 b " + bk->name(), rr[0], gr[0]);
      const Vec fc = randn(sz(N * OC), rng, 2.0f), dact = randn(sz(N * OC), rng),
                x = bf16_values_of(randn(sz(N * K), rng)), dw0 = randn(sz(OC * K), rng),
                db0 = randn(sz(OC), rng);
      const std::vector<uint16_t> x16 = bf16_bits_of(x);
      // GELU's backward pass from fc (float32, or BF16 bits: fc16) into the linear's backward pass
      // with its input x as float32 or as BF16 bits
      auto gelu_backward = [&](const Vec& fc_in, bool fc_bits, bool x_bits) {
        const std::vector<uint16_t> fc16 = bf16_bits_of(fc_in);
        return run(*bk, [&](Backend& k, Call& c) {
          const TensorView dinp = c.out(Vec(sz(N * K), kNaN), N, K);
          const TensorView dw = c.out(dw0, OC, K);
          const TensorView db = c.out(db0, OC, 1);
          const TensorView dfc = c.out(Vec(sz(N * OC), kNaN), N, OC, true);
          const ActivationSource src{ActivationOp::GeluBackward,
                                     fc_bits ? c.in(fc16, N, OC) : c.in(fc_in, N, OC),
                                     c.in(dact, N, OC, true), dfc};
          k.matmul_backward_activation(dinp, dw, db, src, x_bits ? c.in(x16, N, K) : c.in(x, N, K),
                                       c.in(w, OC, K), bf16);
        });
      };
      const Outputs rb = gelu_backward(fc, false, false), gb = gelu_backward(fc, false, true);
      for (size_t i = 0; i < 3; ++i)
        expect_bitwise(
            "matmul_backward_activation BF16 inp " + std::to_string(i) + " " + bk->name(), rb[i],
            gb[i]);
      // GELU's input (fc) as bits too: the bits of the float32 fc holding the same values
      const Vec fc_r = bf16_values_of(fc);
      const Outputs rf = gelu_backward(fc_r, false, false);
      for (bool x_bits : {false, true}) {
        const Outputs gf = gelu_backward(fc_r, true, x_bits);
        for (size_t i = 0; i < 3; ++i)
          expect_bitwise("matmul_backward_activation BF16 src.inp " + std::to_string(i) +
                             (x_bits ? " x16 " : " ") + bk->name(),
                         rf[i], gf[i]);
      }
    }
    // attention with qkv and out as bits (either or both)
    {
      const int64_t B = 2, T = 70, NH = 4, NKV = 2, HD = 32, W = (NH + 2 * NKV) * HD, C = NH * HD;
      const AttentionShape s{B, T, NH, NKV, HD};
      const Vec qkv = bf16_values_of(randn(sz(B * T * W), rng));
      const std::vector<uint16_t> qkv16 = bf16_bits_of(qkv);
      const Outputs r = run(*bk, [&](Backend& k, Call& c) {
        const TensorView out = c.out(Vec(sz(B * T * C), kNaN), B * T, C, true);
        const TensorView lse = c.out(Vec(sz(B * NH * T), kNaN), B * NH, T);
        k.attention_forward(out, lse, c.in(qkv, B * T, W), s, bf16);
      });
      for (int mode = 0; mode < 3; ++mode) {
        const bool q16 = mode != 1, o16 = mode != 0;
        const Outputs g = run(*bk, [&](Backend& k, Call& c) {
          const TensorView out =
              o16 ? c.out16(B * T, C) : c.out(Vec(sz(B * T * C), kNaN), B * T, C, true);
          const TensorView lse = c.out(Vec(sz(B * NH * T), kNaN), B * NH, T);
          k.attention_forward(out, lse, q16 ? c.in(qkv16, B * T, W) : c.in(qkv, B * T, W), s, bf16);
        });
        const std::string tag = " mode " + std::to_string(mode) + " " + bk->name();
        expect_bitwise("attention_forward BF16 storage out" + tag, r[0], g[0]);
        expect_bitwise("attention_forward BF16 storage lse" + tag, r[1], g[1]);
      }
      const Vec dout = randn(sz(B * T * C), rng);
      const std::vector<uint16_t> out16 = bf16_bits_of(r[0]);
      const Outputs rb = run(*bk, [&](Backend& k, Call& c) {
        const TensorView dqkv = c.out(Vec(sz(B * T * W), kNaN), B * T, W, true);
        k.attention_backward(dqkv, c.in(dout, B * T, C), c.in(qkv, B * T, W), c.in(r[0], B * T, C),
                             c.in(r[1], B * NH, T), s, bf16);
      });
      for (int mode = 0; mode < 3; ++mode) {
        const bool q16 = mode != 1, o16 = mode != 0;
        // dout as bits too (its values BF16: the kernels read it rounded); dqkv as bits (g16: the
        // bits of the rounded values)
        for (int io = 0; io < 4; ++io) {
          const bool d16 = io & 1, g16 = io & 2;
          const std::vector<uint16_t> dout16 = bf16_bits_of(dout);
          const Outputs gb = run(*bk, [&](Backend& k, Call& c) {
            const TensorView dqkv =
                g16 ? c.out16(B * T, W) : c.out(Vec(sz(B * T * W), kNaN), B * T, W, true);
            k.attention_backward(dqkv, d16 ? c.in(dout16, B * T, C) : c.in(dout, B * T, C),
                                 q16 ? c.in(qkv16, B * T, W) : c.in(qkv, B * T, W),
                                 o16 ? c.in(out16, B * T, C) : c.in(r[0], B * T, C),
                                 c.in(r[1], B * NH, T), s, bf16);
          });
          expect_bitwise("attention_backward BF16 storage dqkv mode " + std::to_string(mode) +
                             (d16 ? " dout16" : "") + (g16 ? " dqkv16 " : " ") + bk->name(),
                         rb[0], gb[0]);
        }
      }
    }
    // the norms' backward passes reading dout as bits
    {
      const int64_t N = 37, C = 96;
      const Vec x = randn(sz(N * C), rng, 2.0f, 0.5f), w = randn(sz(C), rng),
                dout = randn(sz(N * C), rng), dx0 = randn(sz(N * C), rng), dw0 = randn(sz(C), rng),
                db0 = randn(sz(C), rng), mean = randn(sz(N), rng, 0.1f),
                rstd = randn(sz(N), rng, 0.1f, 1.0f);
      const std::vector<uint16_t> dout16 = bf16_bits_of(dout);
      for (bool layernorm : {true, false}) {
        const NormKind kind = layernorm ? NormKind::LayerNorm : NormKind::RMSNorm;
        // dout marked bf16_values (read rounded) or as BF16 bits
        auto backward = [&](bool bits) {
          return run(*bk, [&](Backend& k, Call& c) {
            const TensorView dx = c.out(dx0, N, C, true);
            const TensorView dw = c.out(dw0, C, 1);
            const TensorView db = c.out(db0, C, 1);
            k.norm_backward(kind, dx, dw, layernorm ? db : TensorView{},
                            bits ? c.in(dout16, N, C) : c.in(dout, N, C, true), c.in(x, N, C),
                            c.in(w, C, 1), layernorm ? c.in(mean, N, 1) : TensorView{},
                            c.in(rstd, N, 1));
          });
        };
        const Outputs r = backward(false), g = backward(true);
        for (size_t i = 0; i < 3; ++i)
          expect_bitwise(std::string(layernorm ? "layernorm" : "rmsnorm") + "_backward BF16 dout " +
                             std::to_string(i) + " " + bk->name(),
                         r[i], g[i]);
      }
    }
    // the linear backward with bits: dinp as bits, with inp as bits, GELU's pending gradient with
    // its input and incoming gradient as bits, dout as bits, against matmul_backward(_activation)
    // on float32 views of the values
    {
      const int64_t N = 64, K = 96, OC = 32;
      const Vec w = randn(sz(OC * K), rng, 0.3f), x = bf16_values_of(randn(sz(N * K), rng)),
                dout = randn(sz(N * OC), rng), fc = bf16_values_of(randn(sz(N * OC), rng, 2.0f)),
                dact = bf16_values_of(randn(sz(N * OC), rng)), dw0 = randn(sz(OC * K), rng),
                db0 = randn(sz(OC), rng);
      const std::vector<uint16_t> x16 = bf16_bits_of(x), fc16 = bf16_bits_of(fc),
                                  dact16 = bf16_bits_of(dact);
      const Vec dout_r = bf16_values_of(dout);
      const std::vector<uint16_t> dout16 = bf16_bits_of(dout);
      // dout / GELU (float32) / GELU (inp bits) / GELU (inp + dout bits) / dout bits (BF16 values)
      for (int mode = 0; mode < 5; ++mode) {
        const bool gelu = mode > 0 && mode < 4, bits = mode == 4;
        const Outputs r = run(*bk, [&](Backend& k, Call& c) {
          const TensorView dinp = c.out(Vec(sz(N * K), kNaN), N, K);
          const TensorView dw = c.out(dw0, OC, K);
          const TensorView db = c.out(db0, OC, 1);
          if (gelu) {
            const TensorView dfc = c.out(Vec(sz(N * OC), kNaN), N, OC, true);
            const ActivationSource src{ActivationOp::GeluBackward, c.in(fc, N, OC),
                                       c.in(dact, N, OC, true), dfc};
            k.matmul_backward_activation(dinp, dw, db, src, c.in(x, N, K), c.in(w, OC, K), bf16);
          } else {
            k.matmul_backward(dinp, dw, db, c.in(bits ? dout_r : dout, N, OC), c.in(x, N, K),
                              c.in(w, OC, K), bf16);
          }
        });
        for (bool x_bits : {false, true}) {
          const Outputs g = run(*bk, [&](Backend& k, Call& c) {
            const TensorView dinp16 = c.out16(N, K);
            const TensorView dw = c.out(dw0, OC, K);
            const TensorView db = c.out(db0, OC, 1);
            const TensorView xv = x_bits ? c.in(x16, N, K) : c.in(x, N, K);
            if (gelu) {
              const TensorView dfc = c.out(Vec(sz(N * OC), kNaN), N, OC, true);
              const ActivationSource src{
                  ActivationOp::GeluBackward, mode >= 2 ? c.in(fc16, N, OC) : c.in(fc, N, OC),
                  mode == 3 ? c.in(dact16, N, OC) : c.in(dact, N, OC, true), dfc};
              k.matmul_backward_activation(dinp16, dw, db, src, xv, c.in(w, OC, K), bf16);
            } else {
              k.matmul_backward(dinp16, dw, db, bits ? c.in(dout16, N, OC) : c.in(dout, N, OC), xv,
                                c.in(w, OC, K), bf16);
            }
          });
          const std::string tag =
              " mode " + std::to_string(mode) + (x_bits ? " x16 " : " ") + bk->name();
          expect_bitwise("linear backward BF16 dinp" + tag, bf16_values_of(r[0]), g[0]);
          expect_bitwise("linear backward BF16 dweight" + tag, r[1], g[1]);
          expect_bitwise("linear backward BF16 dbias" + tag, r[2], g[2]);
        }
      }
    }
    // the cross-entropy reading the logits as bits (cached row and not, on CUDA)
    for (int64_t V : {int64_t{300}, int64_t{50304}}) {
      const int64_t N = V > 5000 ? 3 : 9;
      const Vec logits = bf16_values_of(randn(sz(N * V), rng, 3.0f)),
                dlosses = randn(sz(N), rng, 0.1f);
      const std::vector<uint16_t> logits16 = bf16_bits_of(logits);
      const std::vector<int32_t> targets = randint(sz(N), static_cast<int32_t>(V), rng);
      const Outputs r = run(*bk, [&](Backend& k, Call& c) {
        crossentropy_on(k, c, c.in(logits, N, V, true), targets, dlosses, true);
      });
      for (bool cached : {true, false}) {
        const Outputs g = run(cached || !cuda ? *bk : *cuda_uncached, [&](Backend& k, Call& c) {
          crossentropy_on(k, c, c.in(logits16, N, V), targets, dlosses, true);
        });
        const std::string tag =
            " V=" + std::to_string(V) + (cached ? " " : " uncached ") + bk->name();
        expect_bitwise("crossentropy BF16 logits losses" + tag, r[0], g[0]);
        expect_bitwise("crossentropy BF16 logits dlogits" + tag, r[1], g[1]);
      }
    }
    // a view the op must have, absent: std::invalid_argument
    {
      Call c(*bk);
      const TensorView x = c.in(Vec(16, 1.0f), 1, 16), w = c.in(Vec(16, 1.0f), 1, 16);
      EXPECT_THROW(bk->matmul_forward(TensorView{}, x, w, TensorView{}, bf16),
                   std::invalid_argument);
    }
  }
}

// cuBLASLt's BF16-output epilogue with the bias (matmul_forward to a BF16 view, the default): the
// bits of RNE(fl32(acc + bf16(bias))) computed here (the bias added as its BF16 rounding:
// Backend::matmul_forward), where every accumulation order gives the same exact acc (small
// integers): so the epilogue's addition and rounding are what is tested, ties included (bias values
// that put acc + bias on an odd integer above 256, halfway between BF16 values). On the training
// shapes of gpt2-124m's c_attn (N 4096 of its 16384 rows) and small odd ones.
TEST(LayersGpu, MatmulBf16EpilogueRoundsLikeAddBias) {
  REQUIRE_GPU();
  auto be = make_backend("cuda");
  std::mt19937 rng(717);
  std::uniform_int_distribution<int> small(-4, 4);
  struct Shape {
    int64_t N, K, OC;
  };
  // (gpt2-124m's four Fprops at its 16384 rows: c_attn, attn c_proj, c_fc, mlp c_proj; every 61st
  // row checked there, every row of the small ones)
  for (const Shape s : {Shape{16384, 768, 2304}, Shape{16384, 768, 768}, Shape{16384, 768, 3072},
                        Shape{16384, 3072, 768}, Shape{256, 64, 96}, Shape{100, 40, 24}}) {
    const int64_t N = s.N, K = s.K, OC = s.OC;
    Vec x(sz(N * K)), w(sz(OC * K)), b(sz(OC));
    for (float& v : x) v = static_cast<float>(small(rng));
    for (float& v : w) v = static_cast<float>(small(rng));
    for (size_t j = 0; j < b.size(); ++j)  // ties (odd integers near 300), large, fractional
      b[j] = j % 3 == 0   ? 301.0f + 2.0f * static_cast<float>(j % 7)
             : j % 3 == 1 ? 1e5f * randn(1, rng)[0]
                          : randn(1, rng)[0];
    const std::vector<uint16_t> x16 = bf16_bits_of(x);
    for (bool with_bias : {true, false}) {
      const auto before = cuda_counters(*be).matmul_bf16_epilogue;
      const Outputs g = run(*be, [&](Backend& k, Call& c) {
        k.matmul_forward(c.out16(N, OC), c.in(x16, N, K), c.in(w, OC, K),
                         with_bias ? c.in(b, OC, 1) : TensorView{}, emu::GemmPrecision::BF16);
      });
      const gpu::CudaCounters counted = cuda_counters(*be);
      const auto after = counted.matmul_bf16_epilogue;
      std::printf("[layers-gpu] %lldx%lldx%lld%s: %s (last refusal: %s)\n",
                  static_cast<long long>(N), static_cast<long long>(K), static_cast<long long>(OC),
                  with_bias ? " bias" : "",
                  after > before ? "cuBLASLt wrote BF16 (epilogue)"
                                 : "separate passes (no epilogue algorithm listed)",
                  counted.last_matmul_epilogue_refusal.c_str());
      const int64_t step = N > 1024 ? 61 : 1;
      Vec ref, got;
      const Vec& all = g[0];
      for (int64_t n = 0; n < N; n += step)
        for (int64_t o = 0; o < OC; ++o) {
          int64_t acc = 0;  // exact
          for (int64_t k = 0; k < K; ++k)
            acc += static_cast<int64_t>(x[sz(n * K + k)]) * static_cast<int64_t>(w[sz(o * K + k)]);
          const float sum =
              with_bias ? static_cast<float>(acc) + bf16_round(b[sz(o)]) : static_cast<float>(acc);
          ref.push_back(bf16_round(sum));
          got.push_back(all[sz(n * OC + o)]);
        }
      expect_bitwise("matmul_forward BF16 epilogue " + std::to_string(N) + "x" + std::to_string(K) +
                         "x" + std::to_string(OC) + (with_bias ? " bias" : ""),
                     ref, got);
    }
  }
}

// ---- optimizer ----------------------------------------------------------------------------------

// Segments of a flat tensor from their offsets and counts.
std::vector<Segment> segments_of(const std::vector<int64_t>& offsets,
                                 const std::vector<int64_t>& counts) {
  std::vector<Segment> s;
  for (size_t i = 0; i < offsets.size(); ++i) s.push_back({offsets[i], counts[i]});
  return s;
}

TEST(LayersGpu, AdamWBitwiseEqualsEmulator) {
  REQUIRE_GPU();
  Backends be;
  std::mt19937 rng(909);
  const int64_t n = 1037;
  const Vec p0 = randn(sz(n), rng), grads = with_specials(randn(sz(n) - 16, rng, 0.01f)),
            m0 = randn(sz(n), rng, 0.01f);
  Vec v0 = randn(sz(n), rng, 1e-4f);
  for (auto& v : v0) v = std::fabs(v);
  for (int64_t t : {1, 2, 1000}) {
    const AdamWStep step =
        make_adamw_step(3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, t, t == 2 ? 0.7f : 1.0f);
    const Op op = [&](Backend& bk, Call& c) {
      const TensorView p = c.out(p0, 1, n);
      const TensorView m = c.out(m0, 1, n);
      const TensorView v = c.out(v0, 1, n);
      bk.adamw_update(p, TensorView{}, c.in(grads, 1, n), m, v, {{0, n}}, {step});
    };
    const Outputs e = run(*be.emu, op), g = run(*be.cuda, op);
    const std::string tag = " t=" + std::to_string(t);
    expect_bitwise("adamw params" + tag, e[0], g[0]);
    expect_bitwise("adamw m" + tag, e[1], g[1]);
    expect_bitwise("adamw v" + tag, e[2], g[2]);
  }
}

// adamw_update with params16 (the BF16 bits written in the update's own launch) equals adamw_update
// without it followed by convert of each tensor to BF16, on CUDA, bit for bit: tensors off
// alignment, longer than a work item, empty; two distinct steps (the one launch) and six (the
// per-tensor fallback).
TEST(LayersGpu, AdamWParams16AreTheNarrowedParameters) {
  REQUIRE_GPU();
  Backends be;
  std::mt19937 rng(929);
  const std::vector<int64_t> offsets{0, 5, 4101, 4101, 20000, 20771},
      counts{5, 4096, 0, 15899, 771, 3};
  const std::vector<Segment> segments = segments_of(offsets, counts);
  const int64_t n = 20774;
  const Vec p0 = randn(sz(n), rng), grads = randn(sz(n), rng, 0.01f), m0 = randn(sz(n), rng, 0.01f);
  Vec v0 = randn(sz(n), rng, 1e-4f);
  for (auto& v : v0) v = std::fabs(v);
  for (const bool six : {false, true}) {
    std::vector<AdamWStep> steps;
    for (size_t i = 0; i < offsets.size(); ++i)
      steps.push_back(make_adamw_step(3e-4f, 0.9f, 0.95f, 1e-8f, i % 2 ? 0.0f : 0.1f,
                                      six ? static_cast<int64_t>(i) + 1 : 3, 0.8f));
    const Outputs two = run(*be.cuda, [&](Backend& bk, Call& c) {
      const TensorView p = c.out(p0, 1, n);
      const TensorView m = c.out(m0, 1, n);
      const TensorView v = c.out(v0, 1, n);
      const TensorView p16 = c.out16(1, n);
      bk.adamw_update(p, TensorView{}, c.in(grads, 1, n), m, v, segments, steps);
      for (const Segment& s : segments)
        bk.convert(skip(p16, s.offset, 1, s.count), skip(p, s.offset, 1, s.count));
    });
    const Outputs one = run(*be.cuda, [&](Backend& bk, Call& c) {
      const TensorView p = c.out(p0, 1, n);
      const TensorView m = c.out(m0, 1, n);
      const TensorView v = c.out(v0, 1, n);
      const TensorView p16 = c.out16(1, n);
      bk.adamw_update(p, p16, c.in(grads, 1, n), m, v, segments, steps);
    });
    const std::string tag = six ? " six steps" : " two steps";
    const char* names[] = {"params", "m", "v", "params16"};
    for (size_t i = 0; i < 4; ++i)
      expect_bitwise(std::string("adamw_update params16 ") + names[i] + tag, two[i], one[i]);
  }
}

// adamw_update over segments (one launch on CUDA) equals the emulator's adamw_update of each tensor
// on its own bit for bit: tensors at offsets off 16-byte alignment, longer than one work item,
// empty, with two distinct steps (the trainer's decay / no-decay pair) and with six (more than the
// launch takes: the per-tensor fallback); then the same layout again (the cached work items) with
// new steps. Segment lists the op refuses: a step short, a negative offset.
TEST(LayersGpu, AdamWSegmentsEqualPerTensorUpdates) {
  REQUIRE_GPU();
  Backends be;
  std::mt19937 rng(919);
  const std::vector<int64_t> offsets{0, 5, 4101, 4101, 20000, 20771},
      counts{5, 4096, 0, 15899, 771, 3};
  const std::vector<Segment> segments = segments_of(offsets, counts);
  const int64_t n = 20774;
  const Vec p0 = randn(sz(n), rng), grads = with_specials(randn(sz(n) - 16, rng, 0.01f)),
            m0 = randn(sz(n), rng, 0.01f);
  Vec v0 = randn(sz(n), rng, 1e-4f);
  for (auto& v : v0) v = std::fabs(v);
  for (int variant = 0; variant < 3; ++variant) {
    std::vector<AdamWStep> steps;
    for (size_t i = 0; i < offsets.size(); ++i) {
      const int64_t t = variant == 1 ? static_cast<int64_t>(i) + 1
                                     : variant + 1;  // variant 1: six distinct steps
      steps.push_back(make_adamw_step(3e-4f, 0.9f, 0.95f, 1e-8f, i % 2 ? 0.0f : 0.1f, t, 0.8f));
    }
    const Outputs e = run(*be.emu, [&](Backend& bk, Call& c) {
      const TensorView p = c.out(p0, 1, n);
      const TensorView m = c.out(m0, 1, n);
      const TensorView v = c.out(v0, 1, n);
      const TensorView gr = c.in(grads, 1, n);
      for (size_t i = 0; i < segments.size(); ++i) {
        const int64_t o = segments[i].offset, k = segments[i].count;
        bk.adamw_update(skip(p, o, 1, k), TensorView{}, skip(gr, o, 1, k), skip(m, o, 1, k),
                        skip(v, o, 1, k), {{0, k}}, {steps[i]});
      }
    });
    const Outputs g = run(*be.cuda, [&](Backend& bk, Call& c) {
      const TensorView p = c.out(p0, 1, n);
      const TensorView m = c.out(m0, 1, n);
      const TensorView v = c.out(v0, 1, n);
      bk.adamw_update(p, TensorView{}, c.in(grads, 1, n), m, v, segments, steps);
    });
    const std::string tag = " variant " + std::to_string(variant);
    expect_bitwise("adamw_update segments params" + tag, e[0], g[0]);
    expect_bitwise("adamw_update segments m" + tag, e[1], g[1]);
    expect_bitwise("adamw_update segments v" + tag, e[2], g[2]);
  }
  auto refused = [](Backend& bk, const std::vector<Segment>& segs) {
    Call c(bk);
    const TensorView p = c.out(Vec(2), 1, 2), m = c.out(Vec(2), 1, 2), v = c.out(Vec(2), 1, 2);
    bk.adamw_update(p, TensorView{}, c.in(Vec(2), 1, 2), m, v, segs, std::vector<AdamWStep>(1));
  };
  EXPECT_THROW(refused(*be.cuda, {{0, 1}, {1, 1}}), std::invalid_argument);
  EXPECT_THROW(refused(*be.emu, {{-1, 1}}), std::invalid_argument);
}

// The sum of squares of x (one segment, all of it) on bk.
double sum_squares_on(Backend& bk, const Vec& x) {
  const int64_t n = static_cast<int64_t>(x.size());
  BackendBuffer b(bk, std::max<size_t>(x.size(), 1) * sizeof(float));  // (a view even when empty)
  if (n) bk.upload(b.get(), x.data(), x.size() * sizeof(float));
  double s = 0;
  bk.sum_squares(buffer_view(bk, b, DType::F32, 1, n, "x"), {{0, n}}, &s);
  return s;
}

TEST(LayersGpu, SumSquaresMatchesEmulator) {
  REQUIRE_GPU();
  Backends be;
  std::mt19937 rng(1010);
  for (size_t n : {size_t{0}, size_t{1}, size_t{1037}, (size_t{1} << 20) + 3}) {
    const Vec x = randn(n, rng, 0.01f);
    const double e = sum_squares_on(*be.emu, x), g = sum_squares_on(*be.cuda, x);
    std::printf("[layers-gpu] sum_squares n=%zu: emu %.17g cuda %.17g\n", n, e, g);
    EXPECT_LE(std::fabs(g - e), 1e-12 * e) << "n=" << n;
  }
  // integer values: every partial sum is exact in FP64, so any order gives the same bits
  Vec x(300007);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(static_cast<int>(i % 7) - 3);
  const double e = sum_squares_on(*be.emu, x), g = sum_squares_on(*be.cuda, x);
  EXPECT_EQ(e, g);
  EXPECT_GT(g, 0.0);
}

// The CUDA sum of squares' documented tree (gpu/optim.cu), on the host: 1024 blocks x 256 threads,
// each thread adding its grid-strided squares in increasing index; per block a butterfly within
// each warp (lane l adds lane l ^ off, off = 16 .. 1), then the same over the 8 warp sums padded
// with +0; then one block over the 1024 partials (thread t: t, t + 256, ...) the same way.
double gpu_tree_sum_squares(const float* x, int64_t n) {
  constexpr int kBlocks = 1024, kThreadsPerBlock = 256;
  using Lanes = std::array<double, 32>;
  auto butterfly = [](Lanes v) {  // 32 lanes -> their common sum
    for (int off = 16; off > 0; off >>= 1) {
      Lanes w{};
      for (int l = 0; l < 32; ++l)
        w[static_cast<size_t>(l)] = v[static_cast<size_t>(l)] + v[static_cast<size_t>(l ^ off)];
      v = w;
    }
    return v[0];
  };
  auto block_sum = [&](const std::vector<double>& t) {  // 256 thread values
    Lanes warps{};                                      // +0 where a block has fewer than 32 warps
    for (int w = 0; w < kThreadsPerBlock / 32; ++w) {
      Lanes lanes{};
      for (int l = 0; l < 32; ++l)
        lanes[static_cast<size_t>(l)] = t[static_cast<size_t>(32 * w + l)];
      warps[static_cast<size_t>(w)] = butterfly(lanes);
    }
    return butterfly(warps);
  };
  std::vector<double> partial(kBlocks);
  const int64_t stride = int64_t{kBlocks} * kThreadsPerBlock;
  for (int b = 0; b < kBlocks; ++b) {
    std::vector<double> t(kThreadsPerBlock, 0.0);
    for (int i = 0; i < kThreadsPerBlock; ++i)
      for (int64_t j = int64_t{b} * kThreadsPerBlock + i; j < n; j += stride) {
        const double d = static_cast<double>(x[j]);
        t[static_cast<size_t>(i)] += d * d;
      }
    partial[static_cast<size_t>(b)] = block_sum(t);
  }
  std::vector<double> t(kThreadsPerBlock, 0.0);
  for (int i = 0; i < kThreadsPerBlock; ++i)
    for (int j = i; j < kBlocks; j += kThreadsPerBlock)
      t[static_cast<size_t>(i)] += partial[static_cast<size_t>(j)];
  return block_sum(t);
}

// Every segment's sum from one sum_squares call over all of them equals the sum_squares call of its
// own tensor bit for bit, on both backends (the trainer's gradient norm makes one call for all
// parameter tensors), and on the GPU equals the documented tree computed on the host. A negative
// count is refused.
TEST(LayersGpu, SumSquaresSegmentsEqualOneByOne) {
  REQUIRE_GPU();
  Backends be;
  std::mt19937 rng(1011);
  const std::vector<int64_t> counts = {5, 0, 1037, (int64_t{1} << 20) + 3, 1, 768, 300007};
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (int64_t n : counts) {
    offsets.push_back(total);
    total += n;
  }
  const Vec x = randn(sz(total), rng, 0.01f);
  const std::vector<Segment> segments = segments_of(offsets, counts);
  for (Backend* bk : {be.emu.get(), be.cuda.get()}) {
    BackendBuffer b(*bk, x.size() * sizeof(float));
    bk->upload(b.get(), x.data(), x.size() * sizeof(float));
    const TensorView xv = buffer_view(*bk, b, DType::F32, 1, total, "x");
    std::vector<double> many(counts.size());
    bk->sum_squares(xv, segments, many.data());
    for (size_t i = 0; i < counts.size(); ++i) {
      double one = 0;
      bk->sum_squares(skip(xv, offsets[i], 1, counts[i]), {{0, counts[i]}}, &one);
      EXPECT_EQ(std::memcmp(&one, &many[i], sizeof(double)), 0)
          << bk->name() << " tensor " << i << " (" << counts[i] << "): " << one << " vs "
          << many[i];
      if (bk == be.cuda.get()) {
        const double tree = gpu_tree_sum_squares(x.data() + offsets[i], counts[i]);
        EXPECT_EQ(std::memcmp(&tree, &many[i], sizeof(double)), 0)
            << "tensor " << i << " (" << counts[i] << "): host model of the tree " << tree
            << " vs cuda " << many[i];
      }
    }
  }
  std::vector<double> out(2);
  BackendBuffer b(*be.cuda, x.size() * sizeof(float));
  EXPECT_THROW(be.cuda->sum_squares(buffer_view(*be.cuda, b, DType::F32, 1, total, "x"),
                                    {{0, 1}, {1, -1}}, out.data()),
               std::invalid_argument);
}

// The bias add (forward) and the bias gradient's column sums, bitwise against the emulator: rows
// beyond the kernel's row-block cap, column counts that are and are not multiples of 4, and a
// bias pointer off 16-byte alignment (the scalar path).
TEST(LayersGpu, BiasForwardAndBackwardBitwise) {
  REQUIRE_GPU();
  Backends be;
  std::mt19937 rng(1212);
  // (16448 and 20000 rows: 257 and 313 64-row chunks, past the finalize pass's 256-chunk tile)
  for (const auto& [N, OC] : {std::pair<int64_t, int64_t>{1, 5},
                              {37, 96},
                              {5000, 3072},
                              {4099, 45},
                              {16448, 33},
                              {20000, 70}}) {
    const Vec y = randn(sz(N * OC), rng), b = randn(sz(OC + 1), rng), dy = randn(sz(N * OC), rng),
              db = randn(sz(OC), rng);
    Vec y1(y.size() + 1, 0.5f);  // y after one leading element: an output off 16-byte alignment
    std::copy(y.begin(), y.end(), y1.begin() + 1);
    for (int shift : {0, 1, 2}) {  // 1: the bias pointer shifted, 2: the output pointer shifted
      for (bool rb : {false, true}) {
        const Op fwd = [&](Backend& bk, Call& c) {
          // (in place: the output is the input, marked bf16_values for the BF16 storage)
          const TensorView out =
              shift == 2 ? skip(c.out(y1, 1, N * OC + 1), 1, N, OC) : c.out(y, N, OC);
          bk.bias_forward(marked(out, rb), out,
                          skip(c.in(b, OC + 1, 1), shift == 1 ? 1 : 0, OC, 1));
        };
        expect_bitwise("bias_forward N=" + std::to_string(N) + " OC=" + std::to_string(OC) +
                           " shift " + std::to_string(shift) + (rb ? " bf16" : ""),
                       run(*be.emu, fwd)[0], run(*be.cuda, fwd)[0]);
      }
    }
    const Op bwd = [&](Backend& bk, Call& c) {
      bk.bias_backward(c.out(db, OC, 1), c.in(dy, N, OC));
    };
    expect_bitwise("bias_backward N=" + std::to_string(N) + " OC=" + std::to_string(OC),
                   run(*be.emu, bwd)[0], run(*be.cuda, bwd)[0]);
  }
}

// ---- determinism
// ----------------------------------------------------------------------------------

// Every op with a reduction or a scatter, twice on the GPU from the same inputs: the same bits
// (save/resume must reproduce a run exactly).
TEST(LayersGpu, ReductionsAreDeterministic) {
  REQUIRE_GPU();
  Backends be;
  Backend& g = *be.cuda;
  std::mt19937 rng(1111);
  auto twice = [&](const std::string& what, const Op& op) {
    const Outputs a = run(g, op), b = run(g, op);
    for (size_t i = 0; i < a.size(); ++i)
      expect_bitwise(what + " output " + std::to_string(i), a[i], b[i]);
  };
  const int64_t N = 200, C = 300;
  const Vec x = randn(sz(N * C), rng), w = randn(sz(C), rng), bias = randn(sz(C), rng),
            dout = randn(sz(N * C), rng), mean = randn(sz(N), rng), dC = randn(sz(C), rng);
  Vec rstd = randn(sz(N), rng);
  for (auto& r : rstd) r = std::fabs(r) + 0.5f;
  twice("layernorm_forward", [&](Backend& bk, Call& c) {
    const TensorView out = c.out(Vec(sz(N * C)), N, C);
    const TensorView m = c.out(Vec(sz(N)), N, 1);
    const TensorView r = c.out(Vec(sz(N)), N, 1);
    bk.norm_forward(NormKind::LayerNorm, out, m, r, c.in(x, N, C), c.in(w, C, 1), c.in(bias, C, 1));
  });
  twice("layernorm_backward", [&](Backend& bk, Call& c) {
    const TensorView dinp = c.out(x, N, C);
    const TensorView dw = c.out(dC, C, 1);
    const TensorView db = c.out(bias, C, 1);
    bk.norm_backward(NormKind::LayerNorm, dinp, dw, db, c.in(dout, N, C), c.in(x, N, C),
                     c.in(w, C, 1), c.in(mean, N, 1), c.in(rstd, N, 1));
  });
  twice("rmsnorm_backward", [&](Backend& bk, Call& c) {
    const TensorView dinp = c.out(x, N, C);
    const TensorView dw = c.out(dC, C, 1);
    bk.norm_backward(NormKind::RMSNorm, dinp, dw, TensorView{}, c.in(dout, N, C), c.in(x, N, C),
                     c.in(w, C, 1), TensorView{}, c.in(rstd, N, 1));
  });
  for (emu::GemmPrecision prec : {emu::GemmPrecision::BF16, emu::GemmPrecision::FP32}) {
    const int64_t K = 130, OC = C;  // dout (N,OC) reused
    const Vec in = randn(sz(N * K), rng), wt = randn(sz(OC * K), rng);
    twice(prec == emu::GemmPrecision::BF16 ? "matmul_backward bf16" : "matmul_backward fp32",
          [&](Backend& bk, Call& c) {
            const TensorView dinp = c.out(in, N, K);
            const TensorView dw = c.out(wt, OC, K);
            const TensorView db = c.out(bias, OC, 1);
            bk.matmul_backward(dinp, dw, db, c.in(dout, N, OC), c.in(in, N, K), c.in(wt, OC, K),
                               prec);
          });
  }
  {
    const int64_t B = 2, T = 100, NH = 4, NKV = 2, HD = 32, W = (NH + 2 * NKV) * HD;
    const AttentionShape s{B, T, NH, NKV, HD};
    const Vec qkv = randn(sz(B * T * W), rng), dy = randn(sz(B * T * NH * HD), rng);
    const Op fwd = [&](Backend& bk, Call& c) {
      const TensorView out = c.out(Vec(sz(B * T * NH * HD)), B * T, NH * HD);
      const TensorView lse = c.out(Vec(sz(B * NH * T)), B * NH, T);
      bk.attention_forward(out, lse, c.in(qkv, B * T, W), s, emu::GemmPrecision::BF16);
    };
    twice("attention_forward", fwd);
    const Outputs f = run(g, fwd);
    twice("attention_backward", [&](Backend& bk, Call& c) {
      const TensorView dqkv = c.out(qkv, B * T, W);
      bk.attention_backward(dqkv, c.in(dy, B * T, NH * HD), c.in(qkv, B * T, W),
                            c.in(f[0], B * T, NH * HD), c.in(f[1], B * NH, T), s,
                            emu::GemmPrecision::BF16);
    });
  }
  {
    const int64_t V = 50;
    const std::vector<int32_t> tokens = randint(sz(N), static_cast<int32_t>(V), rng),
                               pos = randint(sz(N), 64, rng);
    const Vec dwte = randn(sz(V * C), rng), dwpe = randn(sz(64 * C), rng);
    twice("embedding_backward", [&](Backend& bk, Call& c) {
      const TensorView a = c.out(dwte, V, C);
      const TensorView p = c.out(dwpe, 64, C);
      bk.embedding_backward(a, p, c.in(dout, N, C), c.in(tokens, N, 1), c.in(pos, N, 1));
    });
    const Vec dlosses = randn(sz(N), rng, 1.0f / static_cast<float>(N));
    twice("crossentropy_forward_backward", [&](Backend& bk, Call& c) {
      crossentropy_on(bk, c, c.in(x, N, C), tokens, dlosses, false);
    });
  }
  const Vec big = randn((size_t{1} << 20) + 7, rng);
  const double s1 = sum_squares_on(g, big), s2 = sum_squares_on(g, big);
  EXPECT_EQ(s1, s2);
}

}  // namespace
}  // namespace fp4sim
