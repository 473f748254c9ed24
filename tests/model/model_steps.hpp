// A short training run of a Gpt for the tests that compare two ways of computing the same step:
// seeded random tokens, forward and backward, every value that must match collected in order.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "model/config.hpp"
#include "model/gpt.hpp"

namespace fp4sim::model {

// `steps` steps of B x T tokens (uniform over the vocabulary, seed 3) of a model built on `be` from
// c (recipe set, init seed 7; `setup` runs before init, e.g. to flip a storage knob), statistics
// collected on step `stats_step` (none: -1). Returns per step the loss, then every gradient;
// saved_bytes (if given): the model's saved_activation_bytes after the last step.
inline std::vector<float> model_steps(Backend& be, const RunConfig& c, int64_t B, int64_t T,
                                      const std::function<void(Gpt&)>& setup = {},
                                      int64_t steps = 2, int64_t stats_step = -1,
                                      size_t* saved_bytes = nullptr) {
  Gpt m(c.model, be);
  m.set_recipe(c);
  if (setup) setup(m);
  m.init(7);
  std::mt19937 rng(3);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(c.model.vocab) - 1);
  std::vector<float> out;
  for (int64_t step = 0; step < steps; ++step) {
    std::vector<int32_t> t(static_cast<size_t>(B * T)), y(t.size());
    for (size_t i = 0; i < t.size(); ++i) {
      t[i] = tok(rng);
      y[i] = tok(rng);
    }
    m.set_step(step);
    if (step == stats_step) m.collect_stats_once();
    out.push_back(m.forward(t.data(), y.data(), B, T));
    m.backward();
    const std::vector<float> g = m.grads_to_host();
    out.insert(out.end(), g.begin(), g.end());
  }
  if (saved_bytes) *saved_bytes = m.saved_activation_bytes();
  return out;
}

}  // namespace fp4sim::model
