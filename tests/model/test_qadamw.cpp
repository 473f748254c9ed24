// Q-AdamW and BF16 AdamW state (DESIGN.md §13, emu/qadamw.hpp): the transform and a whole step
// against a reference written here from §13's text (from the scalar conversions up), BF16 state
// against the FP32 step rounded, and training: resume bit for bit, the encoded checkpoint tensors,
// the state's size, bad input refused.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "emu/cpu_backend.hpp"
#include "emu/formats.hpp"
#include "emu/philox.hpp"
#include "emu/qadamw.hpp"
#include "model/checkpoint.hpp"
#include "model/gpt.hpp"
#include "model/optimizer.hpp"
#include "model/trainer.hpp"
#include "tests/model/ns_matrices.hpp"
#include "tests/model/trainer_fixtures.hpp"

namespace fp4sim::model {
namespace {

using Vec = std::vector<float>;

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

// ---- the reference, from §13's and §5's text ---------------------------------------------------

// H = diag(s)·H16/4: s from §6, H16[i][j] = (-1)^popcount(i & j)
const int kS[16] = {1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1};
int h16(int i, int j) { return __builtin_popcount(static_cast<unsigned>(i & j)) % 2 ? -1 : 1; }

void ref_forward(const float* x, float* y) {
  for (int j = 0; j < 16; ++j) {
    float acc = static_cast<float>(kS[0] * h16(0, j)) * x[0];
    for (int i = 1; i < 16; ++i) acc = acc + static_cast<float>(kS[i] * h16(i, j)) * x[i];
    y[j] = 0.25f * acc;
  }
}
void ref_inverse(const float* y, float* x) {
  for (int i = 0; i < 16; ++i) {
    float acc = static_cast<float>(h16(i, 0)) * y[0];
    for (int j = 1; j < 16; ++j) acc = acc + static_cast<float>(h16(i, j)) * y[j];
    x[i] = static_cast<float>(kS[i]) * (0.25f * acc);
  }
}

struct RefTensor {                      // one tensor's encoded state
  std::vector<uint8_t> mq, ms, vq, vs;  // one code a byte here, one scale a block
  std::vector<uint16_t> mean, floor;    // floor: optim.v_floor=tile_min's, else empty
  float amax_m = 0, amax_v = 0;
  RefTensor(size_t n, size_t tile, bool with_floor)
      : mq(n, 0),
        ms(n / 16, 0),
        vq(n, 0),
        vs(n / 16, 0),
        mean(n / tile, 0),
        floor(with_floor ? n / tile : 0, 0) {}
};

int g_map4_wins = 0, g_map6_wins = 0;  // Four Over Six's choices in ref_step

float s_enc_of(float amax, float range) {
  float s = range / amax;
  if (s > FLT_MAX) s = FLT_MAX;
  if (amax == 0.0f || s == 0.0f) s = 1.0f;
  return s;
}
float enc_of(uint8_t scale, float s_dec) {
  const float e = 1.0f / (e4m3_to_f32(scale) * s_dec);
  return e > FLT_MAX ? FLT_MAX : e;
}
float decoded(uint8_t q, uint8_t scale, float amax, float range) {
  return e2m1_to_f32(q) * ((e4m3_to_f32(scale) * amax) * (1.0f / range));
}

// One step of the reference on a tensor of n elements with tile T: p, g in; state in and out.
void ref_step(Vec& p, const Vec& g, RefTensor& st, size_t T, const AdamWStep& s, uint64_t seed,
              uint64_t stream) {
  const size_t n = p.size();
  Vec m(n), v(n);
  // decode, update
  for (size_t b = 0; b < n / 16; ++b) {
    float y[16], x[16];
    for (int i = 0; i < 16; ++i) y[i] = decoded(st.mq[16 * b + i], st.ms[b], st.amax_m, 1536.0f);
    ref_inverse(y, m.data() + 16 * b);
    for (int i = 0; i < 16; ++i) y[i] = decoded(st.vq[16 * b + i], st.vs[b], st.amax_v, 2688.0f);
    ref_inverse(y, x);
    const float mu = bf16_to_f32(st.mean[16 * b / T]);
    const float fl = st.floor.empty() ? 0.0f : bf16_to_f32(st.floor[16 * b / T]);
    for (int i = 0; i < 16; ++i) {
      const float t = std::max(mu + x[i], 0.0f);
      v[16 * b + i] = std::max(t * t, fl);
    }
  }
  for (size_t i = 0; i < n; ++i) adamw_element(p[i], g[i], m[i], v[i], s);
  // transform the new state
  Vec ym(n), yv(n), r(n);
  for (size_t k = 0; k < n / T; ++k) {
    float sum = 0.0f;
    for (size_t i = 0; i < T; ++i) sum = sum + std::sqrt(v[k * T + i]);
    st.mean[k] = bf16_rne(sum / static_cast<float>(T));
    for (size_t i = 0; i < T; ++i) r[k * T + i] = std::sqrt(v[k * T + i]) - bf16_to_f32(st.mean[k]);
    if (!st.floor.empty()) {  // the smallest positive v, its BF16 bits truncated (toward zero)
      float lo = 0.0f;
      for (size_t i = 0; i < T; ++i)
        if (v[k * T + i] > 0.0f && (lo == 0.0f || v[k * T + i] < lo)) lo = v[k * T + i];
      st.floor[k] = static_cast<uint16_t>(bits(lo) >> 16);
    }
  }
  for (size_t b = 0; b < n / 16; ++b) {
    ref_forward(m.data() + 16 * b, ym.data() + 16 * b);
    ref_forward(r.data() + 16 * b, yv.data() + 16 * b);
  }
  st.amax_m = st.amax_v = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    st.amax_m = std::max(st.amax_m, std::fabs(ym[i]));
    st.amax_v = std::max(st.amax_v, std::fabs(yv[i]));
  }
  // m: Four Over Six (range 1536) on RN error, then SR under the chosen scale
  const float em = s_enc_of(st.amax_m, 1536.0f), dm = 1.0f / em;
  for (size_t b = 0; b < n / 16; ++b) {
    const float* x = ym.data() + 16 * b;
    float ab = 0.0f;
    for (int i = 0; i < 16; ++i) ab = std::max(ab, std::fabs(x[i]));
    const float base = (ab / 6.0f) * em;
    const uint8_t cand[2] = {e4m3_rn_satfinite(std::min(base, 448.0f)),
                             e4m3_rn_satfinite(std::min(base * 1.5f, 448.0f))};
    float err[2] = {0.0f, 0.0f};
    for (int c = 0; c < 2; ++c)
      for (int i = 0; i < 16; ++i) {
        const uint8_t q = e2m1_rn_satfinite(x[i] * enc_of(cand[c], dm));
        const float val = ((e2m1_to_f32(q) * e4m3_to_f32(cand[c])) * st.amax_m) / 1536.0f;
        err[c] = err[c] + std::fabs(val - x[i]);
      }
    st.ms[b] = err[1] < err[0] ? cand[1] : cand[0];
    ++(err[1] < err[0] ? g_map4_wins : g_map6_wins);
    const Philox4x32 rb = sr_chunk_bits(seed, stream, b);
    for (int i = 0; i < 16; ++i) {
      const uint8_t rbyte = static_cast<uint8_t>(rb.v[i / 4] >> (8 * (i % 4)));
      st.mq[16 * b + i] = e2m1_rs_satfinite(x[i] * enc_of(st.ms[b], dm), rbyte);
    }
  }
  // v: standard NVFP4 (range 2688), RN
  const float ev = s_enc_of(st.amax_v, 2688.0f), dv = 1.0f / ev;
  for (size_t b = 0; b < n / 16; ++b) {
    const float* x = yv.data() + 16 * b;
    float ab = 0.0f;
    for (int i = 0; i < 16; ++i) ab = std::max(ab, std::fabs(x[i]));
    st.vs[b] = e4m3_rn_satfinite(ab * (ev * (1.0f / 6.0f)));
    for (int i = 0; i < 16; ++i) st.vq[16 * b + i] = e2m1_rn_satfinite(x[i] * enc_of(st.vs[b], dv));
  }
}

TEST(QAdamW, TransformAsWrittenAndOrthonormal) {
  const Vec x = ns_randn(16 * 64, 5);
  for (size_t b = 0; b < 64; ++b) {
    float y[16], yr[16], z[16];
    qadamw_forward16(x.data() + 16 * b, y);
    ref_forward(x.data() + 16 * b, yr);
    for (int j = 0; j < 16; ++j) ASSERT_EQ(bits(y[j]), bits(yr[j])) << "block " << b << " " << j;
    qadamw_inverse16(y, z);
    ref_inverse(y, yr);
    for (int i = 0; i < 16; ++i) {
      ASSERT_EQ(bits(z[i]), bits(yr[i])) << "block " << b << " " << i;
      EXPECT_NEAR(z[i], x[16 * b + i], 1e-6f * (1.0f + std::fabs(x[16 * b + i])));
    }
  }
}

// Two tensors ([2, 64] and [96]) through Backend::qadamw_update for 4 steps against ref_step;
// with_floor: optim.v_floor=tile_min.
void expect_step_matches_reference(int64_t T, bool with_floor = false) {
  emu::CpuBackend be;
  const std::vector<Segment> segs{{0, 128}, {128, 96}};
  const int64_t n = 224;
  Vec p = ns_randn(n, 1, 0.1f);
  std::vector<uint8_t> mc(n / 2, 0), ms(n / 16, 0), vc(n / 2, 0), vs(n / 16, 0);
  std::vector<uint16_t> mean(n / T, 0), floor(n / T, 0);
  Vec amax(8, 0.0f);
  QAdamWState st;
  st.m_codes = view_of(mc.data(), DType::U8, 1, n / 2, Device::Host, "m codes");
  st.m_scales = view_of(ms.data(), DType::U8, 1, n / 16, Device::Host, "m scales");
  st.v_codes = view_of(vc.data(), DType::U8, 1, n / 2, Device::Host, "v codes");
  st.v_scales = view_of(vs.data(), DType::U8, 1, n / 16, Device::Host, "v scales");
  st.v_mean = view_of(mean.data(), DType::BF16, 1, n / T, Device::Host, "v mean");
  st.amax = view_of(amax.data(), DType::F32, 1, 8, Device::Host, "amax");
  if (with_floor) st.v_floor = view_of(floor.data(), DType::BF16, 1, n / T, Device::Host, "floor");
  st.v_tile = T;
  std::vector<Vec> rp{Vec(p.begin(), p.begin() + 128), Vec(p.begin() + 128, p.end())};
  std::vector<RefTensor> rs{RefTensor(128, T, with_floor), RefTensor(96, T, with_floor)};
  const uint64_t seed = 77;
  for (int64_t t = 1; t <= 4; ++t) {
    Vec g = ns_randn(n, 100 + t, t == 3 ? 1e-3f : 1.0f);  // (a small step: scales far from 1)
    const AdamWStep s0 = make_adamw_step(1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, t, 1.0f);
    AdamWStep s1 = s0;
    s1.weight_decay = 0.0f;
    const std::vector<uint64_t> streams{(uint64_t(t) << 32) | 7, (uint64_t(t) << 32) | 9};
    be.qadamw_update(view_of(p.data(), DType::F32, 1, n, Device::Host, "params"), TensorView{},
                     view_of(g.data(), DType::F32, 1, n, Device::Host, "grads"), st, segs, {s0, s1},
                     seed, streams);
    ref_step(rp[0], Vec(g.begin(), g.begin() + 128), rs[0], T, s0, seed, streams[0]);
    ref_step(rp[1], Vec(g.begin() + 128, g.end()), rs[1], T, s1, seed, streams[1]);
    for (int k = 0; k < 2; ++k) {
      const int64_t o = segs[k].offset, cnt = segs[k].count;
      const RefTensor& r = rs[k];
      EXPECT_EQ(bits(amax[2 * k]), bits(r.amax_m)) << "step " << t << " tensor " << k;
      EXPECT_EQ(bits(amax[2 * k + 1]), bits(r.amax_v)) << "step " << t << " tensor " << k;
      for (int64_t i = 0; i < cnt; ++i) {
        ASSERT_EQ(bits(p[o + i]), bits(rp[k][i])) << "step " << t << " tensor " << k << " " << i;
        ASSERT_EQ((mc[(o + i) / 2] >> (4 * (i & 1))) & 0xF, r.mq[i]) << "m code " << i;
        ASSERT_EQ((vc[(o + i) / 2] >> (4 * (i & 1))) & 0xF, r.vq[i]) << "v code " << i;
      }
      for (int64_t b = 0; b < cnt / 16; ++b) {
        ASSERT_EQ(ms[o / 16 + b], r.ms[b]) << "step " << t << " m scale " << b;
        ASSERT_EQ(vs[o / 16 + b], r.vs[b]) << "step " << t << " v scale " << b;
      }
      for (int64_t b = 0; b < cnt / T; ++b) ASSERT_EQ(mean[o / T + b], r.mean[b]) << "mean " << b;
      if (with_floor) {
        for (int64_t b = 0; b < cnt / T; ++b)
          ASSERT_EQ(floor[o / T + b], r.floor[b]) << "floor " << b;
      }
    }
  }
  // the cases are not trivial: each Four Over Six candidate won somewhere
  EXPECT_GT(g_map4_wins, 0);
  EXPECT_GT(g_map6_wins, 0);
}
TEST(QAdamW, StepMatchesTheReferenceTile16) { expect_step_matches_reference(16); }
TEST(QAdamW, StepMatchesTheReferenceTile32) { expect_step_matches_reference(32); }
TEST(QAdamW, StepMatchesTheReferenceWithTheFloor) { expect_step_matches_reference(16, true); }

TEST(QAdamW, Bf16StateIsTheFp32StepRounded) {
  emu::CpuBackend be;
  const int64_t n = 64;
  Vec p = ns_randn(n, 3, 0.1f), p32 = p;
  std::vector<uint16_t> m16(n, 0), v16(n, 0);
  for (int64_t t = 1; t <= 3; ++t) {
    Vec g = ns_randn(n, 10 + t);
    const AdamWStep s = make_adamw_step(1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, t, 1.0f);
    std::vector<uint16_t> em = m16, ev = v16;
    be.adamw_update(view_of(p.data(), DType::F32, 1, n, Device::Host, "params"), TensorView{},
                    view_of(g.data(), DType::F32, 1, n, Device::Host, "grads"),
                    view_of(m16.data(), DType::BF16, 1, n, Device::Host, "m"),
                    view_of(v16.data(), DType::BF16, 1, n, Device::Host, "v"), {{0, n}}, {s});
    for (int64_t i = 0; i < n; ++i) {
      float m = bf16_to_f32(em[i]), v = bf16_to_f32(ev[i]);
      adamw_element(p32[i], g[i], m, v, s);
      ASSERT_EQ(bits(p[i]), bits(p32[i])) << "step " << t << " element " << i;
      ASSERT_EQ(m16[i], bf16_rne(m));
      ASSERT_EQ(v16[i], bf16_rne(v));
    }
  }
  // mixed storage is refused, naming the tensor
  Vec v32(n, 0.0f), g(n, 0.0f);
  EXPECT_THROW(
      be.adamw_update(view_of(p.data(), DType::F32, 1, n, Device::Host, "params"), TensorView{},
                      view_of(g.data(), DType::F32, 1, n, Device::Host, "grads"),
                      view_of(m16.data(), DType::BF16, 1, n, Device::Host, "m"),
                      view_of(v32.data(), DType::F32, 1, n, Device::Host, "v"), {{0, n}},
                      {make_adamw_step(1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 1, 1.0f)}),
      std::invalid_argument);
}

// ---- training ------------------------------------------------------------------------------

void expect_state_resume_bitwise(const std::string& tag, const std::vector<std::string>& o,
                                 const char* expect_tensor) {
  const ScratchDir scratch("fp4sim_qadamw_" + tag);
  RunConfig c = micro_run(scratch.path + "/full", o);
  const TrainResult full = train(c, quiet_options(), *make_cpu_backend());
  TrainOptions resume = quiet_options();
  resume.resume = scratch.path + "/full/checkpoints/step_00000005";
  c.train.out_dir = scratch.path + "/cont";
  const TrainResult cont = train(c, resume, *make_cpu_backend());
  ASSERT_EQ(full.steps.size(), 10u);
  ASSERT_EQ(cont.steps.size(), 5u);
  for (size_t i = 0; i < 5; ++i)
    EXPECT_EQ(bits(cont.steps[i].loss), bits(full.steps[5 + i].loss)) << tag << " step " << 6 + i;
  EXPECT_LT(full.steps.back().loss, full.steps.front().loss) << tag;
  const Checkpoint a = load_checkpoint(scratch.path + "/full/checkpoints");
  const Checkpoint b = load_checkpoint(scratch.path + "/cont/checkpoints");
  EXPECT_TRUE(a.optimizer.count(expect_tensor)) << expect_tensor;
  for (const auto& [name, t] : a.model) EXPECT_EQ(t.bytes, b.model.at(name).bytes) << name;
  for (const auto& [name, t] : a.optimizer) EXPECT_EQ(t.bytes, b.optimizer.at(name).bytes) << name;
}
TEST(QAdamWTraining, Nvfp4StateResumesBitwise) {
  expect_state_resume_bitwise("nvfp4", {"optim.state=nvfp4", "recipe.name=nvfp4"},
                              "h.0.attn.c_attn.weight.exp_avg.codes");
}
TEST(QAdamWTraining, Nvfp4StateWithWholeRowTilesAndFallbackResumesBitwise) {
  // v_tile 64: the 32-wide tensors keep float32 state
  expect_state_resume_bitwise("nvfp4_t64", {"optim.state=nvfp4", "optim.v_tile=64"},
                              "h.0.ln_1.weight.exp_avg");
}
TEST(QAdamWTraining, Nvfp4StateWithTheFloorResumesBitwise) {
  expect_state_resume_bitwise("nvfp4_floor", {"optim.state=nvfp4", "optim.v_floor=tile_min"},
                              "h.1.mlp.c_fc.weight.exp_avg_sq.tile_floor");
}
TEST(QAdamWTraining, Bf16StateResumesBitwise) {
  expect_state_resume_bitwise("bf16", {"optim.state=bf16"}, "h.0.attn.c_attn.weight.exp_avg");
}
TEST(QAdamWTraining, MuonWithQAdamWResumesBitwise) {
  expect_state_resume_bitwise("muon_nvfp4", {"optim.name=muon", "optim.state=nvfp4"},
                              "wte.exp_avg_sq.tile_mean");
}

TEST(QAdamWTraining, StateSizeAndDescription) {
  emu::CpuBackend be;
  auto bytes = [&](const std::vector<std::string>& o, std::string* what = nullptr) {
    const RunConfig c = micro_run("unused", o);
    Gpt model(c.model, be);
    const Optimizer opt(c, model);
    if (what) *what = opt.describe();
    return std::make_pair(opt.state_bytes(), model.num_params());
  };
  const auto [f32, n] = bytes({});
  EXPECT_EQ(f32, n * 8);
  EXPECT_EQ(bytes({"optim.state=bf16"}).first, n * 4);
  // every tensor of micro_run has rows of a multiple of 16 elements: 2 x (n/2 + n/16) + 2 n/16
  // (the tile means) + 8 bytes of amaxes a tensor
  std::string what;
  const size_t q = bytes({"optim.state=nvfp4"}, &what).first;
  EXPECT_GT(q, n * 5 / 4);
  EXPECT_LT(q, n * 5 / 4 + 4096);
  EXPECT_NE(what.find("Q-AdamW: state in NVFP4 for"), std::string::npos) << what;
  // the floor: one more BF16 a 16-tile
  EXPECT_EQ(bytes({"optim.state=nvfp4", "optim.v_floor=tile_min"}, &what).first, q + n / 8);
  EXPECT_NE(what.find("floored"), std::string::npos) << what;
  bytes({"optim.state=nvfp4", "optim.v_tile=64"}, &what);
  EXPECT_NE(what.find("float32 for"), std::string::npos) << what;
}

TEST(QAdamWTraining, BadInputIsRefused) {
  auto refused = [](const std::vector<std::string>& o, const std::string& needle) {
    try {
      micro_run("unused", o);
      ADD_FAILURE() << "expected an error for " << o.back();
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused({"optim.state=nvfp4", "optim.v_tile=24"}, "optim.v_tile must be a positive multiple");
  refused({"optim.v_tile=0"}, "optim.v_tile");
  refused({"optim.state=fp8"}, "optim.state");
  refused({"optim.v_floor=min"}, "optim.v_floor");
  refused({"optim.ns_precision=nvfp4"}, "optim.name=adamw has none");
  // resuming another state's checkpoint is refused, naming both
  const ScratchDir scratch("fp4sim_qadamw_switch");
  RunConfig c = micro_run(scratch.path + "/a");
  c.train.steps = 5;
  train(c, quiet_options(), *make_cpu_backend());
  RunConfig q = micro_run(scratch.path + "/b", {"optim.state=nvfp4"});
  TrainOptions o = quiet_options();
  o.resume = scratch.path + "/a/checkpoints/step_00000005";
  try {
    train(q, o, *make_cpu_backend());
    ADD_FAILURE() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("optim.state=fp32"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace fp4sim::model
