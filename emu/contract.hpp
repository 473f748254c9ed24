// The numerics contract version (DESIGN.md): recorded in every output file and checkpoint.
#pragma once

namespace fp4sim {
constexpr int kContractVersion = 2;
}
