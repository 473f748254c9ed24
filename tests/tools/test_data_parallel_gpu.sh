#!/usr/bin/env bash
# Data parallel CUDA ranks through NCCL on one GPU (issue 39, item 6): a run of one NCCL rank
# (started by the environment bootstrap: FP4SIM_WORLD_SIZE=1, FP4SIM_RANK=0, FP4SIM_BOOTSTRAP)
# gives the losses, gradient norms, weights and optimizer state of the same run as one plain
# process, bit for bit, under train.grad_reduce ordered and allreduce (one bucket, or many reduced
# on NCCL's stream during the backward pass) and ZeRO-1; the bootstrap file is gone
# after the start; a bootstrap file left behind is refused. Exit 77 (skipped) without a GPU.
# usage: test_data_parallel_gpu.sh FP4SIM_BINARY WORKDIR
set -u
bin=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
work=$2
cfg=$(cd "$(dirname "$0")/../../configs" && pwd)/tiny.json
"$bin" info | grep -q "^backends:.*cuda" && ! "$bin" info | grep -q "^GPU: *none" ||
  { echo "SKIP    no CUDA backend or no GPU"; exit 77; }
rm -rf "$work"
mkdir -p "$work"
cd "$work" || exit 1
fails=0
cases=0
ok() { echo "OK      $1"; cases=$((cases + 1)); }
bad() { echo "NOT OK  $1"; fails=$((fails + 1)); cases=$((cases + 1)); }
steps() { python3 -c "
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l); print(d['step'], repr(d['loss']), repr(d['grad_norm']))" "$1"; }
run="train.steps=4 train.warmup=1 train.eval_every=0 train.data=synthetic train.checkpoint_every=4
  train.grad_accum=2 recipe.name=nvfp4"
# shellcheck disable=SC2086
train() { "$bin" train --config "$cfg" $run --backend cuda "$@"; }
train train.out_dir=plain >plain.txt 2>&1 || bad "plain run: $(tail -2 plain.txt)"
for mode in ordered allreduce zero buckets; do
  case $mode in
    zero) extra="train.grad_reduce=ordered train.zero=1" ;;
    buckets) extra="train.grad_reduce=allreduce train.grad_bucket_mb=0.1" ;;  # (on NCCL's own stream)
    *) extra="train.grad_reduce=$mode" ;;
  esac
  # shellcheck disable=SC2086
  FP4SIM_WORLD_SIZE=1 FP4SIM_RANK=0 FP4SIM_BOOTSTRAP=$PWD/id_$mode \
    train $extra train.out_dir=nccl_$mode >nccl_$mode.txt 2>&1 ||
    { bad "one NCCL rank ($mode): $(tail -3 nccl_$mode.txt)"; continue; }
  grep -q "data parallel: 1 ranks through nccl" nccl_$mode.txt || bad "$mode: not through NCCL"
  [ $mode = buckets ] && echo "        $(grep -o '[0-9]* gradient buckets a step.*' nccl_$mode.txt)"
  if [ "$(steps plain/log.jsonl)" = "$(steps nccl_$mode/log.jsonl)" ] &&
     cmp -s plain/checkpoints/step_00000004/model.safetensors nccl_$mode/checkpoints/step_00000004/model.safetensors &&
     cmp -s plain/checkpoints/step_00000004/optimizer.safetensors nccl_$mode/checkpoints/step_00000004/optimizer.safetensors; then
    ok "one NCCL rank ($mode) == the plain run, bit for bit (4 steps, nvfp4, grad_accum 2)"
  else
    bad "one NCCL rank ($mode) differs from the plain run"; diff <(steps plain/log.jsonl) <(steps nccl_$mode/log.jsonl) | head -4
  fi
  [ ! -e "id_$mode" ] && ok "$mode: the bootstrap file removed after the start" || bad "$mode: id file left"
done
# BF16 gradients through ncclAllReduce (ncclBfloat16): rounded, so near the plain run, not equal
FP4SIM_WORLD_SIZE=1 FP4SIM_RANK=0 FP4SIM_BOOTSTRAP=$PWD/id_bf16 train train.grad_reduce=allreduce \
  train.grad_comm=bf16 train.out_dir=nccl_bf16 >nccl_bf16.txt 2>&1 || bad "bf16 allreduce: $(tail -2 nccl_bf16.txt)"
d=$(python3 -c "
import json, sys
a = [json.loads(l) for l in open('plain/log.jsonl')]; b = [json.loads(l) for l in open('nccl_bf16/log.jsonl')]
print(f'{max(abs(x[\"loss\"] - y[\"loss\"]) / abs(x[\"loss\"]) for x, y in zip(a, b)):.3e}')" 2>/dev/null)
echo "        BF16 gradients through NCCL: loss rel. diff $d after 4 steps (budget 1e-3)"
python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) <= 1e-3 else 1)" "${d:-1}" &&
  ok "BF16 gradients through ncclAllReduce within the bound" || bad "BF16 NCCL: $d"
touch stale_id
FP4SIM_WORLD_SIZE=1 FP4SIM_RANK=0 FP4SIM_BOOTSTRAP=$PWD/stale_id train train.out_dir=stale >stale.txt 2>&1
[ $? -ne 0 ] && grep -q "the file exists" stale.txt && ok "a bootstrap file left behind is refused" ||
  bad "stale bootstrap file: $(tail -2 stale.txt)"
echo "$cases cases, $fails failed"
[ "$fails" -eq 0 ]
