#!/usr/bin/env bash
# The main job: set up, build, write a sample tensor and quantize it on the default backend (CUDA
# when a GPU is present, else the emulator), printing what the quantizer did; then fetch the corpus
# and train the tiny transformer for 20 steps on the default backend (the same rule) in BF16 and in
# NVFP4 (the published recipe, every GEMM through the exact tensor-core model) and print both losses
# side by side.
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
echo "== the 'tiny' transformer on the default backend ($(build/fp4sim info | awk '/^default backend:/ {print $3}')), 20 steps in BF16 and in NVFP4 (same seed and data)"
data=data/corpus
if ! scripts/fetch_corpus.sh build/fp4sim; then
  echo "(the corpus could not be fetched: training on synthetic tokens instead)"
  data=synthetic
fi
for recipe in bf16 nvfp4; do
  echo "-- recipe $recipe"
  build/fp4sim train --config configs/tiny.json recipe.name=$recipe train.steps=20 train.warmup=2 \
    train.eval_every=20 train.eval_batches=2 train.data="$data" train.out_dir=runs/demo/tiny_$recipe \
    | grep -E "^step|^done|^block 0|^recipe"
done
echo
echo "== loss, BF16 vs NVFP4 (exact tensor-core model)"
python3 - runs/demo/tiny_bf16/log.jsonl runs/demo/tiny_nvfp4/log.jsonl <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
b = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
print(f"{'step':>5} {'bf16':>8} {'nvfp4':>8} {'rel. diff':>10}")
for x, y in zip(a, b):
    print(f"{x['step']:>5} {x['loss']:>8.4f} {y['loss']:>8.4f} {100 * (y['loss'] - x['loss']) / x['loss']:>9.2f}%")
for x, y in zip(a, b):
    if 'val_loss' in x and 'val_loss' in y:
        print(f"validation loss at step {x['step']}: bf16 {x['val_loss']:.4f}, nvfp4 {y['val_loss']:.4f} "
              f"({100 * (y['val_loss'] - x['val_loss']) / x['val_loss']:+.2f}%)")
PY
