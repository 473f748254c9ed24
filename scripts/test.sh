#!/usr/bin/env bash
# Check the C++/CUDA layout, build (host warnings are errors) and run the test suite (GPU tests
# skip cleanly without a GPU).
# usage: scripts/test.sh [extra ctest args]   e.g. scripts/test.sh -LE slow   to skip the 2^32 sweeps
set -euo pipefail
cd "$(dirname "$0")/.."
FP4SIM_TEST_PACKAGES=1 scripts/setup.sh build
scripts/check_format.sh
cmake --build build -j"$(nproc)"
cd build
ctest --output-on-failure -j"$(nproc)" "$@"
