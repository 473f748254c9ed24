#!/usr/bin/env bash
# Issue 35 evidence: nemotron-h-small (the Mamba-2 hybrid, configs/nemotron-h-small.json) trained
# for one fixed token budget in bf16, fp8 and nvfp4 (the full recipe with the §9 high-precision
# blocks), cuBLASLt GEMMs, 2 seeds each, the same seeds (same initialisation, same batches) across
# recipes; then validation/evidence.py tabulates the final validation losses, the seed-paired gaps
# and the curves (PNG). A run that does not finish in one device call is resumed from its latest
# checkpoint by the next call of this script (checkpoints every STEPS/10 steps); a finished run
# (its log has a "done" line) is skipped.
# usage: validation/hybrid_evidence.sh [STEPS] [OUT_DIR]   (STEPS x batch 8 x 1024 tokens per run)
#   env: ONLY (space-separated run names: bf16_s1 fp8_s1 nvfp4_s1 bf16_s2 fp8_s2 nvfp4_s2),
#        RUN_TIMEOUT (seconds per run and call; a run cut by it resumes next time), FP4SIM (binary),
#        PNG (the plot; default OUT_DIR/evidence.png), EXTRA (key=value overrides for every run),
#        CONFIG (default configs/nemotron-h-small.json), BACKEND (default cuda; emu runs exact GEMMs)
# FP8: the 128-blocks of the FP8 recipe do not tile in_proj's 6176 output rows (2 d_inner + 2 G N
# + H = 4096 + 2048 + 32), so the fp8 runs keep every Mamba block's in_proj in BF16 (all three
# GEMMs, by recipe.override) and run everything else of the recipe in FP8.
# Needs the corpus (data/corpus.*; scripts/fetch_corpus.sh) and a GPU build in build-gpu.
set -uo pipefail
cd "$(dirname "$0")/.."
steps=${1:-1500}
out=${2:-runs/hybrid_evidence}
bin=${FP4SIM:-build-gpu/fp4sim}
cfg=${CONFIG:-configs/nemotron-h-small.json}
backend=${BACKEND:-cuda}
gemm=cublaslt
[ "$backend" = emu ] && gemm=exact
mkdir -p "$out"
every=$(( steps / 10 > 0 ? steps / 10 : 1 ))
common=(--config "$cfg" --backend "$backend" train.steps="$steps" train.warmup=$((steps / 10))
        train.eval_every=$((steps / 4)) train.eval_batches=16 train.checkpoint_every="$every"
        train.keep_last=1 train.shuffle=true recipe.gemm=$gemm ${EXTRA:-})
# recipe.override.blocks.<i>.mamba.in_proj.<gemm>=bf16 for every 'M' of the preset's pattern
pattern=$(python3 -c "import json,sys; print(json.load(open('$cfg'))['model']['pattern'])")
fp8_in_proj=()
for ((i = 0; i < ${#pattern}; i++)); do
  [ "${pattern:$i:1}" = M ] || continue
  for g in fprop dgrad wgrad; do fp8_in_proj+=("recipe.override.blocks.$i.mamba.in_proj.$g=bf16"); done
done
# shellcheck source=validation/evidence_run.sh
source validation/evidence_run.sh  # run NAME OVERRIDES...
run bf16_s1 recipe.name=bf16 train.seed=1
run nvfp4_s1 recipe.name=nvfp4 train.seed=1
run fp8_s1 recipe.name=fp8 "${fp8_in_proj[@]}" train.seed=1
run bf16_s2 recipe.name=bf16 train.seed=2
run nvfp4_s2 recipe.name=nvfp4 train.seed=2
run fp8_s2 recipe.name=fp8 "${fp8_in_proj[@]}" train.seed=2
python3 validation/evidence.py "$out" --png "${PNG:-$out/evidence.png}" || true
