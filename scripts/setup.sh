#!/usr/bin/env bash
# Install the build dependencies (Debian/Ubuntu packages) when missing, then configure the build.
# usage: scripts/setup.sh [BUILD_DIR]   (default: build)
# The CUDA backend is built when nvcc is found (FP4SIM_CUDA=AUTO); set FP4SIM_CUDA=OFF to skip it.
# FP4SIM_TEST_PACKAGES=1 (scripts/test.sh) adds what only the tests need: python3-torch, for
# tests/python/test_torch.py (fp4sim.torch against the trainer; skipped without it).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}

need=()
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
if command -v dpkg-query >/dev/null 2>&1; then
  for p in cmake ninja-build g++ libgtest-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev \
           libfmt-dev libxtensor-dev xtl-dev libssl-dev python3 clang-format \
           python3-dev pybind11-dev libdlpack-dev python3-numpy python3-pytest libopenmpi-dev \
           liblapacke-dev libopenblas-dev \
           openmpi-bin; do
    have_pkg "$p" || need+=("$p")
  done
  if [ -n "${FP4SIM_TEST_PACKAGES:-}" ]; then
    have_pkg python3-torch || need+=(python3-torch)
  fi
fi
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need[@]}" >/dev/null
fi

cuda=${FP4SIM_CUDA:-AUTO}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFP4SIM_CUDA="$cuda" >/dev/null
echo "setup: configured $build (FP4SIM_CUDA=$cuda)"
