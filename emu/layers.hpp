// Every reference layer op of the training stack, for the files that use them all (emu/backend.hpp,
// emu/cpu_backend.hpp): one header per op family, with the stems of their CUDA twins in gpu/.
#pragma once

#include "emu/attention.hpp"
#include "emu/cross_entropy.hpp"
#include "emu/elementwise.hpp"
#include "emu/embedding.hpp"
#include "emu/matmul.hpp"
#include "emu/norm.hpp"
