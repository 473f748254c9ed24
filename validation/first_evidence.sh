#!/usr/bin/env bash
# Issue 5 "first evidence": the `small` preset trained for one fixed token budget in several recipes
# on the CUDA backend, same data and (per seed) same initialisation; then validation/evidence.py
# tabulates the final validation losses against BF16 (and per evaluation), the quantization
# statistics of the quantized runs (logged every STEPS/10 steps), and plots the curves. Batches are
# drawn at random offsets (train.shuffle=true; EXTRA="train.shuffle=false" reads in file order).
# usage: validation/first_evidence.sh [STEPS] [OUT_DIR]     (STEPS x 32 x 512 tokens per run)
#   env: RUN_TIMEOUT (seconds per run), EVAL_BATCHES (default 16), FP4SIM (the binary),
#        CONFIG (default configs/small.json), BACKEND (default cuda; with emu every GEMM is exact, so
#        the cuBLASLt-vs-exact pair is not run), ONLY (space-separated run names: run just those,
#        e.g. ONLY=nvfp4_exact, to split the runs over several device calls), EXTRA (key=value
#        overrides for every run, e.g. EXTRA="train.shuffle=true"), PROBE (a number of steps: run
#        each selected run for that many steps only, with one evaluation and two statistics steps,
#        and print the projected time of the full STEPS-step run, to size device calls)
# Needs the corpus (data/corpus.*; scripts/fetch_corpus.sh) and a GPU build in build-gpu.
set -uo pipefail
cd "$(dirname "$0")/.."
steps=${1:-2000}
out=${2:-runs/evidence}
bin=${FP4SIM:-build-gpu/fp4sim}
mkdir -p "$out"
backend=${BACKEND:-cuda}
gemm=cublaslt
[ "$backend" = emu ] && gemm=exact
common=(--config "${CONFIG:-configs/small.json}" --backend "$backend" train.steps="$steps" train.warmup=$((steps / 10))
        train.eval_every=$((steps / 4)) train.eval_batches="${EVAL_BATCHES:-16}" train.checkpoint_every=0
        recipe.stats_every=$(( steps / 10 > 0 ? steps / 10 : 1 )) train.shuffle=true
        ${EXTRA:-})
probe=${PROBE:-}
run() {  # name, then overrides
  local name=$1
  shift
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
  echo "== $name: $*"
  local t0=$SECONDS
  if [ -n "$probe" ]; then
    # the full run's settings, then a short schedule: evaluation at the last step, statistics at
    # steps 0 and probe/2 (later keys win)
    timeout "${RUN_TIMEOUT:-86400}" "$bin" train "${common[@]}" train.out_dir="$out/probe_$name" "$@" \
      train.steps="$probe" train.warmup=$((probe / 2)) train.eval_every="$probe" \
      recipe.stats_every=$((probe / 2 > 0 ? probe / 2 : 1)) >"$out/probe_$name.log" 2>&1
    local rc=$?
    local wall=$((SECONDS - t0))
    if [ $rc -ne 0 ]; then
      echo "   probe failed (exit $rc): $(tail -1 "$out/probe_$name.log")"
      return 0
    fi
    python3 - "$out/probe_$name/log.jsonl" "$wall" "$steps" <<'PY'
import json, statistics, sys
path, wall, steps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
ms, stats_ms, evals = [], [], 0
for line in open(path):
    d = json.loads(line)
    if "ms" in d and "step" in d:
        (stats_ms if "quant_stats" in d else ms).append(d["ms"])
    evals += "val_loss" in d
if not ms:
    sys.exit("   probe: no step lines in " + path)
step = statistics.median(ms[1:] if len(ms) > 1 else ms)
stat = max(0.0, statistics.median(stats_ms) - step) if stats_ms else 0.0
other = max(0.0, wall - (sum(ms) + sum(stats_ms)) / 1000.0)  # start-up and the evaluation(s)
n_stats = steps // max(1, steps // 10)
full = steps * step / 1000.0 + n_stats * stat / 1000.0 + other * max(1, 4 // max(1, evals))
print(f"   probe: step {step:.1f} ms, statistics step +{stat:.0f} ms, start-up + {evals} evaluation(s) "
      f"{other:.1f} s -> projected {steps} steps: {full:.0f} s")
PY
    echo "   exit $rc, $wall s"
    return 0
  fi
  timeout "${RUN_TIMEOUT:-86400}" "$bin" train "${common[@]}" train.out_dir="$out/$name" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc, $((SECONDS - t0)) s, $(grep -E '^done' "$out/$name.log" || tail -2 "$out/$name.log")"
}
# most informative first, the slow exact-GEMM run last (a short RUN_TIMEOUT cuts only it)
run bf16_s1 recipe.name=bf16 train.seed=1
run nvfp4_s1 recipe.name=nvfp4 recipe.gemm=$gemm train.seed=1
run fp8 recipe.name=fp8 recipe.gemm=$gemm train.seed=1
run bf16_s2 recipe.name=bf16 train.seed=2
run nvfp4_s2 recipe.name=nvfp4 recipe.gemm=$gemm train.seed=2
run nvfp4_all_off recipe.name=nvfp4 recipe.gemm=$gemm recipe.rht=false recipe.stochastic_rounding=off \
  recipe.weight_2d=false recipe.hp_first=0 recipe.hp_last=0 train.seed=1
run mxfp4 recipe.name=mxfp4 recipe.weight_2d=false recipe.gemm=$gemm train.seed=1
# the paper's late precision switch: every GEMM in BF16 for the last 20% of the steps
run nvfp4_bf16_late recipe.name=nvfp4 recipe.gemm=$gemm recipe.bf16_from_step=$((steps * 4 / 5 + 1)) \
  recipe.bf16_switch=all train.seed=1
[ "$backend" = emu ] || run nvfp4_exact recipe.name=nvfp4 recipe.gemm=exact train.seed=1
[ -n "$probe" ] || python3 validation/evidence.py "$out" || true
