#!/usr/bin/env bash
# The main job: set up, build, write a sample tensor and quantize it on the default backend (CUDA
# when a GPU is present, else the emulator), printing what the quantizer did; then fetch the corpus
# and train the tiny transformer for 20 steps on the emulator, printing the loss falling.
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

echo
echo "== a short BF16 training run of the 'tiny' transformer on the emulator (the CUDA backend and"
echo "   the NVFP4 recipe are not wired into training yet: issues 4 and 5)"
data=data/corpus
if ! scripts/fetch_corpus.sh build/fp4sim; then
  echo "(the corpus could not be fetched: training on synthetic tokens instead)"
  data=synthetic
fi
build/fp4sim train --config configs/tiny.json train.steps=20 train.warmup=2 train.eval_every=10 \
  train.eval_batches=2 train.data="$data" train.out_dir=runs/demo/tiny | grep -E "^step|^done|^parameters"
