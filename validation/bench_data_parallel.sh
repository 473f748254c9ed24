#!/usr/bin/env bash
# What data parallel training's machinery costs on one GPU (issue 39): gpt2-124m BF16 tokens/s of
# a plain process against one NCCL rank (FP4SIM_WORLD_SIZE=1: the environment bootstrap) under
# train.grad_reduce=allreduce (25 MiB buckets on NCCL's stream during the backward pass) and
# ordered (every micro-batch's gradient all-gathered and folded), RUNS runs each (default 3),
# alternating; each run's tokens/s is the median of its steps 4..STEPS (default 12).
# usage: validation/bench_data_parallel.sh FP4SIM_BINARY OUT_DIR
set -u
bin=$1
out=$2
runs=${RUNS:-3}
steps=${STEPS:-12}
mkdir -p "$out"
common="--config configs/gpt2-124m.json --backend cuda train.steps=$steps train.warmup=1
  train.eval_every=0 train.data=synthetic"
tok_s() { python3 -c "
import json, statistics, sys
v = [json.loads(l)['tok_per_s'] for l in open(sys.argv[1])][3:]
print(f'{statistics.median(v):.0f}')" "$1"; }
declare -A results
for r in $(seq 1 "$runs"); do
  for v in plain allreduce ordered; do
    dir=$out/$v.$r
    rm -rf "$dir" "$out/id.$v.$r"
    if [ $v = plain ]; then
      # shellcheck disable=SC2086
      "$bin" train $common train.out_dir="$dir" >"$dir.log" 2>&1
    else
      # shellcheck disable=SC2086
      FP4SIM_WORLD_SIZE=1 FP4SIM_RANK=0 FP4SIM_BOOTSTRAP="$out/id.$v.$r" \
        "$bin" train $common train.grad_reduce=$v train.out_dir="$dir" >"$dir.log" 2>&1
    fi || { echo "$v run $r failed: $(tail -2 "$dir.log")"; continue; }
    results[$v]="${results[$v]:-} $(tok_s "$dir/log.jsonl")"
  done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
base=$(echo "${results[plain]}" | median)
printf '%-34s %12s %8s   %s\n' "gpt2-124m BF16, 1 GPU" "tokens/s" "ratio" "runs"
for v in plain allreduce ordered; do
  m=$(echo "${results[$v]:-0}" | median)
  printf '%-34s %12s %8s   %s\n' "$v" "$m" "$(python3 -c "print(f'{$m / $base:.3f}x')")" "${results[$v]:-}"
done
