#!/usr/bin/env bash
# Data parallel training on the emulator through MPI (DESIGN.md §16, issue 39): N ranks under
# train.grad_reduce=ordered give exactly the losses, gradient norms, weights and optimizer state
# of one process with all N * grad_accum micro-batches, for every recipe; allreduce and BF16
# gradients stay within their stated bounds; rank 0 alone writes; a checkpoint resumes at another
# number of ranks; bad launches are refused with the key and the ranks named, and no rank hangs.
# usage: test_data_parallel.sh FP4SIM_BINARY WORKDIR   (needs mpirun: Debian openmpi-bin)
set -u
bin=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
work=$2
cfg=$(cd "$(dirname "$0")/../../configs" && pwd)/tiny.json
rm -rf "$work"
mkdir -p "$work"
cd "$work" || exit 1
command -v mpirun >/dev/null || { echo "NOT OK  mpirun not found (Debian: openmpi-bin)"; exit 1; }
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1  # (3 ranks on a 2-core machine)
fails=0
cases=0
ok() { echo "OK      $1"; cases=$((cases + 1)); }
bad() { echo "NOT OK  $1"; fails=$((fails + 1)); cases=$((cases + 1)); }

micro="model.d_model=32 model.n_layers=2 model.d_ff=64 model.n_heads=2 model.n_kv_heads=2
  model.seq_len=32 model.max_positions=32 train.batch=2 train.steps=3 train.warmup=1
  train.eval_every=0 train.data=synthetic train.checkpoint_every=3"
# shellcheck disable=SC2086
train() { "$bin" train --config "$cfg" $micro --backend emu "$@"; }
# shellcheck disable=SC2086
mpi() { local n=$1; shift; timeout 300 mpirun -np "$n" "$bin" train --config "$cfg" $micro --backend emu "$@"; }

# step, loss and grad_norm of each line of a log, exactly as written
steps() { python3 -c "
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l); print(d['step'], repr(d['loss']), repr(d['grad_norm']))" "$1"; }
same_run() {  # same_run A B WHAT: logs and the last checkpoint's tensors bit for bit
  if [ "$(steps "$1/log.jsonl")" = "$(steps "$2/log.jsonl")" ] &&
     cmp -s "$1/checkpoints/step_00000003/model.safetensors" "$2/checkpoints/step_00000003/model.safetensors" &&
     cmp -s "$1/checkpoints/step_00000003/optimizer.safetensors" "$2/checkpoints/step_00000003/optimizer.safetensors"; then
    ok "$3"
  else
    bad "$3"; diff <(steps "$1/log.jsonl") <(steps "$2/log.jsonl") | head -6
  fi
}
# the largest relative difference of the losses and of the gradient norms of two logs
worst() { python3 -c "
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]; b = [json.loads(l) for l in open(sys.argv[2])]
assert len(a) == len(b) and len(a) > 0
f = lambda k: max(abs(x[k] - y[k]) / abs(x[k]) for x, y in zip(a, b))
print(f'{f(\"loss\"):.3e} {f(\"grad_norm\"):.3e}')" "$1" "$2"; }
within() { python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) <= float(sys.argv[2]) else 1)" "$1" "$2"; }

# ---- bitwise: N ranks x grad_accum A == one process x N*A, every recipe --------------------------
for recipe in bf16 nvfp4 fp8 mxfp4; do
  # (FP8's 128-element blocks need d_model and d_ff multiples of 128)
  [ $recipe = fp8 ] && sized="model.d_model=128 model.d_ff=128 model.seq_len=64 model.max_positions=64" || sized=""
  # shellcheck disable=SC2086
  train() { "$bin" train --config "$cfg" $micro $sized --backend emu "$@"; }
  # shellcheck disable=SC2086
  mpi() { local n=$1; shift; timeout 300 mpirun -np "$n" "$bin" train --config "$cfg" $micro $sized --backend emu "$@"; }
  train recipe.name=$recipe train.grad_accum=2 train.out_dir=one2_$recipe >one2_$recipe.txt 2>&1 ||
    { bad "$recipe: one process, grad_accum 2: $(tail -2 one2_$recipe.txt)"; continue; }
  mpi 2 recipe.name=$recipe train.out_dir=np2_$recipe >np2_$recipe.txt 2>&1 ||
    { bad "$recipe: mpirun -np 2: $(tail -2 np2_$recipe.txt)"; continue; }
  same_run one2_$recipe np2_$recipe "$recipe: 2 ranks x 1 micro-batch == 1 process x 2 (losses, norms, weights, state)"
  train recipe.name=$recipe train.grad_accum=6 train.out_dir=one6_$recipe >one6_$recipe.txt 2>&1 ||
    { bad "$recipe: one process, grad_accum 6: $(tail -2 one6_$recipe.txt)"; continue; }
  mpi 3 recipe.name=$recipe train.grad_accum=2 train.out_dir=np3_$recipe >np3_$recipe.txt 2>&1 ||
    { bad "$recipe: mpirun -np 3: $(tail -2 np3_$recipe.txt)"; continue; }
  same_run one6_$recipe np3_$recipe "$recipe: 3 ranks x 2 micro-batches == 1 process x 6"
done
sized=""
# shuffled windows, SR on every copy, Muon: the global micro-batch index feeds data and SR streams
train recipe.name=nvfp4 recipe.stochastic_rounding=all train.shuffle=true optim.name=muon \
  train.grad_accum=6 train.out_dir=one6_sr >one6_sr.txt 2>&1 && \
  mpi 3 recipe.name=nvfp4 recipe.stochastic_rounding=all train.shuffle=true optim.name=muon \
    train.grad_accum=2 train.out_dir=np3_sr >np3_sr.txt 2>&1 &&
  same_run one6_sr np3_sr "nvfp4, SR everywhere, shuffled, Muon: 3 ranks x 2 == 1 process x 6" ||
  bad "nvfp4 SR shuffled Muon runs: $(tail -2 np3_sr.txt)"

# ---- ZeRO-1: the state sharded by whole tensors, the same bits ------------------------------------
for opt in "optim.state=fp32" "optim.state=bf16" "optim.state=nvfp4" "optim.name=muon"; do
  tag=$(echo "$opt" | tr '.=' '__')
  # shellcheck disable=SC2086
  train recipe.name=nvfp4 $opt train.grad_accum=6 train.out_dir=z1_$tag >z1_$tag.txt 2>&1 ||
    { bad "ZeRO reference ($opt): $(tail -2 z1_$tag.txt)"; continue; }
  # shellcheck disable=SC2086
  mpi 3 recipe.name=nvfp4 $opt train.grad_accum=2 train.zero=1 train.out_dir=z3_$tag >z3_$tag.txt 2>&1 ||
    { bad "ZeRO-1 3 ranks ($opt): $(tail -2 z3_$tag.txt)"; continue; }
  same_run z1_$tag z3_$tag "ZeRO-1, $opt: 3 ranks == 1 process (the checkpoint's state gathered whole)"
done
grep -q "ZeRO-1: optimizer state per rank" z3_optim_state_fp32.txt &&
  ok "ZeRO-1 reports the state per rank: $(grep -o 'per rank.*' z3_optim_state_fp32.txt)" ||
  bad "no per-rank state line"
# a ZeRO-1 checkpoint of 3 ranks resumed by 2 ranks with ZeRO-1 (3 x 2 = 2 x 3 micro-batches)
train recipe.name=nvfp4 train.grad_accum=6 train.steps=6 train.out_dir=zwhole >zwhole.txt 2>&1
mpi 3 recipe.name=nvfp4 train.grad_accum=2 train.zero=1 train.steps=6 train.out_dir=zsplit >zsplit1.txt 2>&1
rm -rf zsplit/checkpoints/step_00000006
sed -i '4,$d' zsplit/log.jsonl
mpi 2 recipe.name=nvfp4 train.grad_accum=3 train.zero=1 train.steps=6 --resume zsplit \
  train.out_dir=zsplit >zsplit2.txt 2>&1 || bad "ZeRO resume at 2 ranks: $(tail -2 zsplit2.txt)"
if [ "$(steps zwhole/log.jsonl)" = "$(steps zsplit/log.jsonl)" ] &&
   cmp -s zwhole/checkpoints/step_00000006/optimizer.safetensors zsplit/checkpoints/step_00000006/optimizer.safetensors; then
  ok "a ZeRO-1 checkpoint of 3 ranks resumed on 2 continues bit for bit"
else
  bad "ZeRO-1 resume at another number of ranks"
fi

# ---- bounded: the engine's all-reduce, BF16 gradients --------------------------------------------
mpi 3 recipe.name=nvfp4 train.grad_accum=2 train.grad_reduce=allreduce train.out_dir=np3_ar \
  >np3_ar.txt 2>&1 || bad "allreduce run: $(tail -2 np3_ar.txt)"
read -r dl dg < <(worst one6_nvfp4/log.jsonl np3_ar/log.jsonl)
echo "        allreduce vs ordered (nvfp4, 3 x 2, 3 steps): loss rel. diff $dl, grad norm $dg (budgets 1e-5, 1e-5)"
within "$dl" 1e-5 && within "$dg" 1e-5 && ok "train.grad_reduce=allreduce within its bound" ||
  bad "allreduce: loss $dl, grad norm $dg"
# buckets reduced during the backward pass: one rank's all-reduce is its own sum, so one rank with
# many small buckets gives the plain run's bits; 3 ranks stay within the bound
mpi 1 recipe.name=nvfp4 train.grad_accum=2 train.grad_reduce=allreduce train.grad_bucket_mb=0.01 \
  train.out_dir=np1_buckets >np1_buckets.txt 2>&1 || bad "bucketed run: $(tail -2 np1_buckets.txt)"
same_run one2_nvfp4 np1_buckets "allreduce in $(grep -o '[0-9]* gradient buckets' np1_buckets.txt) during the backward pass, 1 rank == 1 process"
mpi 3 recipe.name=nvfp4 train.grad_accum=2 train.grad_reduce=allreduce train.grad_bucket_mb=0.01 \
  train.out_dir=np3_buckets >np3_buckets.txt 2>&1 || bad "bucketed 3 ranks: $(tail -2 np3_buckets.txt)"
read -r dl dg < <(worst one6_nvfp4/log.jsonl np3_buckets/log.jsonl)
within "$dl" 1e-5 && within "$dg" 1e-5 && ok "bucketed allreduce, 3 ranks: loss $dl, grad norm $dg (budgets 1e-5)" ||
  bad "bucketed allreduce: loss $dl, grad norm $dg"
mpi 2 recipe.name=nvfp4 train.grad_comm=bf16 train.out_dir=np2_bf16comm >np2_bf16comm.txt 2>&1 ||
  bad "bf16 gradients run: $(tail -2 np2_bf16comm.txt)"
read -r dl dg < <(worst one2_nvfp4/log.jsonl np2_bf16comm/log.jsonl)
echo "        BF16 gradients vs FP32 (nvfp4, 2 x 1, 3 steps): loss rel. diff $dl, grad norm $dg (budgets 1e-3, 1e-2)"
within "$dl" 1e-3 && within "$dg" 1e-2 && ok "train.grad_comm=bf16 within its bound" ||
  bad "bf16 gradients: loss $dl, grad norm $dg"
# the all-reduce of BF16 gradients too
mpi 2 recipe.name=bf16 train.grad_comm=bf16 train.grad_reduce=allreduce train.out_dir=np2_bf16ar \
  >np2_bf16ar.txt 2>&1 && ok "allreduce of BF16 gradients runs" ||
  bad "allreduce of BF16 gradients: $(tail -2 np2_bf16ar.txt)"

# ---- rank 0 alone writes and prints; resume at another number of ranks ---------------------------
n_lines=$(grep -c '^step ' np2_nvfp4.txt)
[ "$n_lines" = 3 ] && grep -q "data parallel: 2 ranks through mpi" np2_nvfp4.txt &&
  ok "one step line a step (rank 0 prints), the ranks said" || bad "step lines printed: $n_lines"
# 2 ranks for 3 steps, then 6 steps resumed by 1 process x 2: the uninterrupted 1-process run's bits
train recipe.name=nvfp4 train.grad_accum=2 train.steps=6 train.checkpoint_every=3 \
  train.out_dir=whole >whole.txt 2>&1 || bad "6-step run: $(tail -2 whole.txt)"
mpi 2 recipe.name=nvfp4 train.steps=6 train.checkpoint_every=3 train.out_dir=split >split1.txt 2>&1
rm -rf split/checkpoints/step_00000006
sed -i '4,$d' split/log.jsonl
train recipe.name=nvfp4 train.grad_accum=2 train.steps=6 train.checkpoint_every=3 \
  --resume split train.out_dir=split >split2.txt 2>&1 || bad "resume at 1 rank: $(tail -2 split2.txt)"
if [ "$(steps whole/log.jsonl)" = "$(steps split/log.jsonl)" ] &&
   cmp -s whole/checkpoints/step_00000006/model.safetensors split/checkpoints/step_00000006/model.safetensors; then
  ok "a 2-rank checkpoint resumed by 1 process x 2 micro-batches continues bit for bit"
else
  bad "resume at another number of ranks"
fi
grep -q "resuming a checkpoint of 2 rank(s)" split2.txt && ok "resume says the ranks changed" ||
  bad "no word on the ranks at resume"

# ---- bad input: the key and the ranks named, every rank stops ------------------------------------
expect() {  # expect WHAT PATTERN CMD...: fails, names PATTERN on stderr, within the timeout
  local what=$1 pat=$2; shift 2
  "$@" >out.txt 2>err.txt
  local rc=$?
  if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q -- "$pat" err.txt; then
    ok "$what"
  else
    bad "$what (rc $rc): $(tail -3 err.txt)"
  fi
}
expect "ranks with different configs" "the config of rank 1 differs from rank 0's" \
  timeout 120 mpirun -np 1 "$bin" train --config "$cfg" $micro --backend emu train.out_dir=m1 : \
  -np 1 "$bin" train --config "$cfg" $micro --backend emu train.out_dir=m1 train.lr=2e-3
expect "ranks with different builds" "the build of rank 1 differs" \
  timeout 120 mpirun -np 1 -x FP4SIM_TEST_BUILD_ID=a "$bin" train --config "$cfg" $micro --backend emu \
  train.out_dir=m2 : -np 1 -x FP4SIM_TEST_BUILD_ID=b "$bin" train --config "$cfg" $micro --backend emu \
  train.out_dir=m2
# shellcheck disable=SC2086
expect "--resume on one rank only" "--resume of rank 1 differs from rank 0" \
  timeout 120 mpirun -np 1 "$bin" train --config "$cfg" $micro --backend emu train.out_dir=m10 : \
  -np 1 "$bin" train --config "$cfg" $micro --backend emu train.out_dir=m10 --resume np2_nvfp4
# shellcheck disable=SC2086
expect "one rank failing alone at start: no rank waits for it" "train.bogus" \
  timeout 120 mpirun -np 1 "$bin" train --config "$cfg" $micro --backend emu train.out_dir=m11 : \
  -np 1 "$bin" train --config "$cfg" $micro --backend emu train.out_dir=m11 train.bogus=1
expect "more micro-batches than the SR stream numbers" "micro-batches a step; the SR stream numbers at most 256" \
  mpi 2 train.grad_accum=200 train.out_dir=m3
touch a_file
expect "rank 0's run folder cannot be made: every rank stops" "train.out_dir a_file" \
  mpi 2 train.out_dir=a_file
[ "$(grep -c 'train.out_dir a_file' err.txt)" = 1 ] && ok "a collective error is printed once" ||
  bad "collective error printed $(grep -c 'train.out_dir a_file' err.txt) times"
expect "train.zero=2" "train.zero must be 0 or 1" mpi 2 train.zero=2 train.out_dir=m8
expect "train.grad_bucket_mb=0" "train.grad_bucket_mb must be a number of MiB" mpi 2 \
  train.grad_bucket_mb=0 train.out_dir=m9
expect "--dump with ranks" "run the PyTorch check's dump as one process" mpi 2 --dump d4 train.out_dir=m4
expect "the file bootstrap with emulator ranks" "emulator ranks run under mpirun" \
  env FP4SIM_WORLD_SIZE=2 FP4SIM_RANK=0 FP4SIM_BOOTSTRAP=boot "$bin" train --config "$cfg" $micro \
  --backend emu train.out_dir=m5
expect "FP4SIM_WORLD_SIZE without FP4SIM_RANK" "FP4SIM_RANK is not" \
  env FP4SIM_WORLD_SIZE=2 "$bin" train --config "$cfg" $micro --backend emu train.out_dir=m6
expect "a bad FP4SIM_RANK" "FP4SIM_RANK=x: not an integer within" \
  env FP4SIM_WORLD_SIZE=2 FP4SIM_RANK=x FP4SIM_BOOTSTRAP=boot "$bin" train --config "$cfg" $micro \
  --backend emu train.out_dir=m7
[ ! -e m1 ] && [ ! -e m2 ] && [ ! -e m3 ] && ok "refused runs leave no run folder" ||
  bad "a refused run left a folder: $(ls -d m? 2>/dev/null)"

echo "$cases cases, $fails failed"
[ "$fails" -eq 0 ]
