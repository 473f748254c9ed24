#include "emu/attention.hpp"

#include <cmath>
#include <vector>

#include "emu/bf16_operand.hpp"
#include "emu/formats.hpp"
#include "emu/mma.hpp"
#include "emu/tfdpa_prepared.hpp"

namespace fp4sim::emu {

// One (b, h) per iteration; row t's scores, then its probabilities, in p (T). rnd: the BF16
// rounding of an operand (the identity in FP32 mode).
namespace {

// sum_k a(k) * b(k) over k = k0 .. n-1 as the BF16 tensor core chains it (DESIGN.md §8): T-FDPA
// (L = 16, F = 25, RZ) over consecutive 16-term chunks, chunk boundaries at multiples of 16 from 0,
// in increasing k, starting from c; terms before k0 and from n on are zero (a chunk of zero terms
// returns c unchanged, so chunks wholly before k0 are skipped). The operands are BF16 values.
template <class A, class Bf>
float tfdpa_chain(int64_t k0, int64_t n, float c, const A& a, const Bf& b) {
  float x[kBf16FdpaL], y[kBf16FdpaL];
  for (int64_t base = k0 / kBf16FdpaL * kBf16FdpaL; base < n; base += kBf16FdpaL) {
    for (int k = 0; k < kBf16FdpaL; ++k) {
      const int64_t kk = base + k;
      const bool in = kk >= k0 && kk < n;
      x[k] = in ? a(kk) : 0.0f;
      y[k] = in ? b(kk) : 0.0f;
    }
    c = tfdpa_bf16_host(x, y, c);
  }
  return c;
}

// c + sum_k a(k) * b(k), k = k0 .. n-1, in FP32 in increasing k (the FP32 mode)
template <class A, class Bf>
float fp32_chain(int64_t k0, int64_t n, float c, const A& a, const Bf& b) {
  for (int64_t k = k0; k < n; ++k) c += a(k) * b(k);
  return c;
}

// a sum of products as the precision mode computes it: a T-FDPA chain (BF16) or FP32 in order
template <class A, class Bf>
float chain(bool bf16, int64_t k0, int64_t n, float c, const A& a, const Bf& b) {
  return bf16 ? tfdpa_chain(k0, n, c, a, b) : fp32_chain(k0, n, c, a, b);
}

// The operands of one (b, head): rows (T, HD) of qkv or dout rounded once as the precision mode
// reads them, and their transpose (HD, T), so every chain walks contiguous memory.
// For the row-by-row dot products (HD a multiple of 16, BF16 mode) the rows are also prepared as
// bf16_gemm_tn prepares its operands (prepare_bf16), and dot_rows chains them as it does.
struct HeadOperand {
  std::vector<float> rows, cols;  // rows[t * HD + i] == cols[i * T + t]
  Bf16Operand prepared;           // of rows, or empty
};
HeadOperand head_operand(const float* base, int64_t stride, int64_t T, int64_t HD, bool bf16) {
  HeadOperand o;
  o.rows.resize(static_cast<size_t>(T * HD));
  o.cols.resize(o.rows.size());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < HD; ++i) {
      const float x = bf16 ? bf16_round(base[t * stride + i]) : base[t * stride + i];
      o.rows[static_cast<size_t>(t * HD + i)] = x;
      o.cols[static_cast<size_t>(i * T + t)] = x;
    }
  if (bf16 && HD % kBf16FdpaL == 0) o.prepared = prepare_bf16(o.rows.data(), T, HD, HD);
  return o;
}

// chain over i of a_i b_i for row ra of a and row rb of b (both HD long): bf16_row_dot where the
// operands were prepared, else the generic chain
float dot_rows(bool bf16, const HeadOperand& a, int64_t ra, const HeadOperand& b, int64_t rb,
               int64_t HD) {
  if (bf16 && !a.prepared.d.empty() && !b.prepared.d.empty())
    return bf16_row_dot(a.prepared, ra, b.prepared, rb, HD, HD / kBf16FdpaL);
  const float* x = &a.rows[static_cast<size_t>(ra * HD)];
  const float* y = &b.rows[static_cast<size_t>(rb * HD)];
  return chain(
      bf16, 0, HD, 0.0f, [&](int64_t i) { return x[i]; }, [&](int64_t i) { return y[i]; });
}

}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t NH,
                       int64_t NKV, int64_t HD, GemmPrecision prec) {
  const int64_t W = (NH + 2 * NKV) * HD, group = NH / NKV;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
  const bool bf16 = prec == GemmPrecision::BF16;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < NH; ++h) {
      const int64_t g = h / group;
      const HeadOperand q = head_operand(qkv + b * T * W + h * HD, W, T, HD, bf16);
      const HeadOperand k = head_operand(qkv + b * T * W + (NH + g) * HD, W, T, HD, bf16);
      const HeadOperand v = head_operand(qkv + b * T * W + (NH + NKV + g) * HD, W, T, HD, bf16);
      std::vector<float> p(static_cast<size_t>(T)), pb(static_cast<size_t>(T));
      for (int64_t t = 0; t < T; ++t) {
        float m = -INFINITY;
        for (int64_t j = 0; j <= t; ++j) {
          const float s = dot_rows(bf16, q, t, k, j, HD) * scale;
          p[j] = s;
          m = s > m ? s : m;
        }
        float l = 0.0f;
        for (int64_t j = 0; j <= t; ++j) {
          p[j] = std::exp(p[j] - m);
          l += p[j];
          pb[j] = bf16 ? bf16_round(p[j]) : p[j];
        }
        float* o = out + (b * T + t) * NH * HD + h * HD;
        for (int64_t i = 0; i < HD; ++i) {
          const float* vi = &v.cols[static_cast<size_t>(i * T)];  // v_ji = vi[j]
          o[i] = chain(
                     bf16, 0, t + 1, 0.0f, [&](int64_t j) { return pb[j]; },
                     [&](int64_t j) { return vi[j]; }) /
                 l;
        }
        lse[(b * NH + h) * T + t] = m + std::log(l);
      }
    }
  }
}

// One (b, g) per iteration: it owns the KV head's dk and dv and the dq of the group's query heads,
// so the iterations are independent and each sum has the fixed order the header states. P and dS
// of the group's heads are kept for the (b, g) (group * T * T floats each, transposed to (j, t) so
// that dk and dv chain over t in contiguous memory).
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HD,
                        GemmPrecision prec) {
  const int64_t W = (NH + 2 * NKV) * HD, group = NH / NKV;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
  const bool bf16 = prec == GemmPrecision::BF16;
  auto rnd = [bf16](float x) { return bf16 ? bf16_round(x) : x; };
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < NKV; ++g) {
      const HeadOperand k = head_operand(qkv + b * T * W + (NH + g) * HD, W, T, HD, bf16);
      const HeadOperand v = head_operand(qkv + b * T * W + (NH + NKV + g) * HD, W, T, HD, bf16);
      // pbt, dsbt (group, T (j), T (t)): bf16(p_tj) and bf16(dS_tj) of the group's heads, 0 above
      // the diagonal; q, dy: the group's query and output-gradient heads
      std::vector<float> pbt(static_cast<size_t>(group * T * T), 0.0f), dsbt(pbt.size(), 0.0f);
      std::vector<float> ds(static_cast<size_t>(T));
      std::vector<HeadOperand> q, dy;
      for (int64_t hh = 0; hh < group; ++hh) {
        const int64_t h = g * group + hh;
        q.push_back(head_operand(qkv + b * T * W + h * HD, W, T, HD, bf16));
        dy.push_back(head_operand(dout + b * T * NH * HD + h * HD, NH * HD, T, HD, bf16));
        for (int64_t t = 0; t < T; ++t) {
          const float* dyt = &dy[hh].rows[static_cast<size_t>(t * HD)];
          const float* o = out + (b * T + t) * NH * HD + h * HD;
          const float row_lse = lse[(b * NH + h) * T + t];
          float dsum = 0.0f;  // FP32 in increasing i on both backends (the CUDA twin: bitwise)
          for (int64_t i = 0; i < HD; ++i) dsum += dyt[i] * o[i];
          for (int64_t j = 0; j <= t; ++j) {
            const float s = dot_rows(bf16, q[static_cast<size_t>(hh)], t, k, j, HD);
            const float dp = dot_rows(bf16, dy[static_cast<size_t>(hh)], t, v, j, HD);
            const float p = std::exp(s * scale - row_lse);
            ds[j] = rnd(p * (dp - dsum));
            pbt[static_cast<size_t>((hh * T + j) * T + t)] = rnd(p);
            dsbt[static_cast<size_t>((hh * T + j) * T + t)] = ds[j];
          }
          // dq_t = scale * sum_j bf16(dS_tj) k_j
          float* dq = dqkv + (b * T + t) * W + h * HD;
          for (int64_t i = 0; i < HD; ++i) {
            const float* ki = &k.cols[static_cast<size_t>(i * T)];
            dq[i] = 0.0f + chain(
                               bf16, 0, t + 1, 0.0f, [&](int64_t j) { return ds[j]; },
                               [&](int64_t j) { return ki[j]; }) *
                               scale;
          }
        }
      }
      // dk_j = scale * sum_{h,t} bf16(dS_tj) q_t and dv_j = sum_{h,t} bf16(p_tj) dout_t: one chain
      // per head over t = j .. T-1 (chunks of 16 t from 0), heads in increasing order, continued
      for (int64_t j = 0; j < T; ++j) {
        float* dk = dqkv + (b * T + j) * W + (NH + g) * HD;
        float* dv = dqkv + (b * T + j) * W + (NH + NKV + g) * HD;
        for (int64_t i = 0; i < HD; ++i) {
          float sk = 0.0f, sv = 0.0f;
          for (int64_t hh = 0; hh < group; ++hh) {
            const float* ds_j = &dsbt[static_cast<size_t>((hh * T + j) * T)];
            const float* p_j = &pbt[static_cast<size_t>((hh * T + j) * T)];
            const float* qi = &q[static_cast<size_t>(hh)].cols[static_cast<size_t>(i * T)];
            const float* dyi = &dy[static_cast<size_t>(hh)].cols[static_cast<size_t>(i * T)];
            sk = chain(
                bf16, j, T, sk, [&](int64_t t) { return ds_j[t]; },
                [&](int64_t t) { return qi[t]; });
            sv = chain(
                bf16, j, T, sv, [&](int64_t t) { return p_j[t]; },
                [&](int64_t t) { return dyi[t]; });
          }
          dk[i] = 0.0f + sk * scale;
          dv[i] = 0.0f + sv;
        }
      }
    }
  }
}

}  // namespace fp4sim::emu
