#!/usr/bin/env bash
# Issue 36 evidence: `small` (configs/small.json) trained for one fixed token budget with each
# optimizer and with the Full-Stack FP4 optimizer modules, cuBLASLt GEMMs, 2 seeds each, the same
# seeds (same initialisation, same batches) across runs; then validation/evidence.py tabulates the
# final validation losses, the seed-paired gaps to BF16 AdamW and the curves (PNG). The runs:
#   bf16          BF16 GEMMs, AdamW (the baseline every gap is taken against)
#   muon, root    BF16 GEMMs, Muon / ROOT with FP32 Newton–Schulz
#   nvfp4         the NVFP4 recipe (§9), AdamW
#   nvfp4_rootq   the NVFP4 recipe, ROOT with NVFP4 Newton–Schulz products (Q-Root, p99 clipping)
#   nvfp4_qadamw  the NVFP4 recipe, AdamW with NVFP4 state (Q-AdamW)
# A run that does not finish in one device call is resumed from its latest checkpoint by the next
# call of this script (checkpoints every STEPS/10 steps); a finished run (its log has a "done"
# line) is skipped.
# usage: validation/optim_evidence.sh [STEPS] [OUT_DIR]   (STEPS x batch 32 x 512 tokens per run)
#   env: ONLY (space-separated run names, e.g. "bf16_s1 muon_s1"), RUN_TIMEOUT (seconds per run
#        and call), FP4SIM (binary), PNG (default OUT_DIR/evidence.png), EXTRA (key=value
#        overrides for every run), BACKEND (default cuda; emu runs exact GEMMs)
# Needs the corpus (data/corpus.*; scripts/fetch_corpus.sh) and a GPU build in build-gpu.
set -uo pipefail
cd "$(dirname "$0")/.."
steps=${1:-500}
out=${2:-runs/optim_evidence}
bin=${FP4SIM:-build-gpu/fp4sim}
backend=${BACKEND:-cuda}
gemm=cublaslt
[ "$backend" = emu ] && gemm=exact
mkdir -p "$out"
every=$(( steps / 10 > 0 ? steps / 10 : 1 ))
common=(--config configs/small.json --backend "$backend" train.steps="$steps"
        train.warmup=$((steps / 10)) train.eval_every=$((steps / 4)) train.eval_batches=16
        train.checkpoint_every="$every" train.keep_last=1 train.shuffle=true recipe.gemm=$gemm
        ${EXTRA:-})
# shellcheck source=validation/evidence_run.sh
source validation/evidence_run.sh  # run NAME OVERRIDES...
for seed in 1 2; do
  run bf16_s$seed recipe.name=bf16 train.seed=$seed
  run muon_s$seed recipe.name=bf16 optim.name=muon train.seed=$seed
  run root_s$seed recipe.name=bf16 optim.name=root train.seed=$seed
  run nvfp4_s$seed recipe.name=nvfp4 train.seed=$seed
  run nvfp4_rootq_s$seed recipe.name=nvfp4 optim.name=root optim.ns_precision=nvfp4 train.seed=$seed
  run nvfp4_qadamw_s$seed recipe.name=nvfp4 optim.state=nvfp4 train.seed=$seed
done
python3 validation/evidence.py "$out" --png "${PNG:-$out/evidence.png}" || true
