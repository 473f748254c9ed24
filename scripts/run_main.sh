#!/usr/bin/env bash
# The main job: set up, build, write a sample tensor and quantize it on the default backend (CUDA
# when a GPU is present, else the emulator), printing what the quantizer did.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
cmake --build build --target fp4sim -j"$(nproc)"
mkdir -p runs/demo
build/fp4sim info
echo
build/fp4sim make-tensor runs/demo/activations.npy --rows 1024 --cols 4096 --kind heavy-tailed
echo
echo "== row-wise NVFP4 copy (Fprop operand: 1x16 blocks, round-to-nearest)"
build/fp4sim quantize runs/demo/activations.npy runs/demo/act_row
echo
echo "== column-wise copy with RHT and stochastic rounding (Wgrad operand)"
build/fp4sim quantize runs/demo/activations.npy runs/demo/act_col --columnwise --rht --sr --seed 1 --stream 2
echo
echo "== the same tensor in MXFP4 (1x32 blocks, UE8M0 scales)"
build/fp4sim quantize runs/demo/activations.npy runs/demo/act_mx --format mxfp4
