// fp4sim.torch's C++ half: Recipe, LinearRecipe, linear_forward and linear_backward on DLPack
// tensors (python/linear_binding.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace fp4sim::py_args {

void register_linear(pybind11::module_& m);

}  // namespace fp4sim::py_args
