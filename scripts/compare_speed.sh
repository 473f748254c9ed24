#!/usr/bin/env bash
# Same-call training speed of two fp4sim binaries on the CUDA backend: gpt2-124m (batch 16 x 1024,
# synthetic tokens), runs of STEPS steps (default 24) alternating between the binaries, RUNS runs
# (default 3) of each recipe in RECIPES (default "bf16 nvfp4"). A run's figure is the median of the
# trainer's tokens/s over steps 4..STEPS; a binary's figure the median over its runs. Prints a
# table with new / base last. Logs in $OUT (or runs/compare_speed).
# usage: scripts/compare_speed.sh BASE_BINARY NEW_BINARY
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || { echo "usage: scripts/compare_speed.sh BASE_BINARY NEW_BINARY" >&2; exit 2; }
base=$1 new=$2
for b in "$base" "$new"; do [ -x "$b" ] || { echo "compare_speed: '$b' is not an executable" >&2; exit 2; }; done
out=${OUT:-runs/compare_speed}
mkdir -p "$out"
steps=${STEPS:-24}
median() { tr ' ' '\n' | grep -v '^$' | sort -n | awk '{a[NR]=$1} END {if (NR) print a[int((NR+1)/2)]; else print "n/a"}'; }
one_run() {  # binary recipe log -> the run's median tok/s over steps 4..steps
  timeout 300 "$1" train --config configs/gpt2-124m.json --backend cuda train.data=synthetic \
    train.batch=16 train.steps="$steps" train.warmup=1 train.eval_every=0 train.checkpoint_every=0 \
    train.out_dir="runs/compare_$$" recipe.name="$2" recipe.gemm=cublaslt >"$3" 2>&1
  rm -rf "runs/compare_$$"
  grep -E "^step" "$3" | awk -F'|' 'NR>3 {gsub(/ tok\/s/,"",$6); print $6+0}' | median
}
table=()
for r in ${RECIPES:-bf16 nvfp4}; do
  b_runs="" n_runs=""
  for i in $(seq 1 "${RUNS:-3}"); do
    b_runs="$b_runs $(one_run "$base" "$r" "$out/${r}_base_$i.log")"
    n_runs="$n_runs $(one_run "$new" "$r" "$out/${r}_new_$i.log")"
    echo "compare_speed: $r run $i: base $(echo "$b_runs" | awk '{print $NF}') new $(echo "$n_runs" | awk '{print $NF}') tok/s"
  done
  bm=$(echo "$b_runs" | median) nm=$(echo "$n_runs" | median)
  ratio=$(awk -v a="$nm" -v b="$bm" 'BEGIN {if (b > 0) printf "%.3f", a / b; else print "n/a"}')
  table+=("$(printf '%-6s base %-26s new %-26s median %s / %s = %s' "$r" "[$b_runs ]" "[$n_runs ]" "$nm" "$bm" "$ratio")")
done
echo "== gpt2-124m tokens/s, $steps-step runs (steps 4..$steps), alternating; new / base"
printf '%s\n' "${table[@]}"
