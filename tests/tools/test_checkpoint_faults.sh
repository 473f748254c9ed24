#!/usr/bin/env bash
# Checkpoint fault injection: kill -9 at every disk operation of a checkpoint save, injected write
# failures, a full disk (a small tmpfs, where this machine lets us mount one), a flipped byte in each
# checkpoint file, a file of another step, trailing bytes, and two writers on one run folder. Each
# case must end with the last good checkpoint intact (bitwise), a clear error and a non-zero exit,
# and a resume that reaches the uninterrupted run's weights and losses bit for bit.
# The faults are placed by the test hook (docs/cli.md, "Checkpoint files"): FP4SIM_FAULT_TRACE=1
# numbers a save's operations, FP4SIM_FAULT_AT=N / _FAIL_AT=N / _STOP_AT=N act at operation N.
# usage: test_checkpoint_faults.sh FP4SIM_BINARY WORKDIR
set -u
bin=$1
work=$2
cfg=$(cd "$(dirname "$0")/../../configs" && pwd)/tiny.json
rm -rf "$work"
mkdir -p "$work"
# on /dev/shm where there is one: the runs fsync some 30 times each, which on a disk is most of the
# test's time (a kill does not test durability: the page cache outlives the process either way)
if [ -d /dev/shm ] && [ -w /dev/shm ]; then
  work=$(mktemp -d /dev/shm/fp4sim_checkpoint_faults.XXXXXX) || exit 1
  trap 'rm -rf "$work"' EXIT
fi
cd "$work" || exit 1
export OMP_NUM_THREADS=1  # (a micro model: more threads only contend)
fails=0
cases=0
ok() { echo "OK      $1"; cases=$((cases + 1)); }
bad() { echo "NOT OK  $1"; fails=$((fails + 1)); cases=$((cases + 1)); }

# 6 steps, checkpoints at 2, 4 and 6; the faults hit the save of step 4
micro="model.d_model=32 model.n_layers=1 model.d_ff=64 model.n_heads=2 model.n_kv_heads=2
  model.seq_len=16 model.max_positions=16 train.batch=2 train.steps=6 train.warmup=1
  train.eval_every=0 train.data=synthetic train.checkpoint_every=2"
# shellcheck disable=SC2086
run() { "$bin" train --config "$cfg" $micro --backend emu "$@"; }

# the uninterrupted run, every checkpoint kept; the same run traced, keeping the last only (as the
# faulted runs do, so the trace has their pruning too)
run train.keep_last=0 train.out_dir=ref >ref.txt 2>&1 || { echo "NOT OK  reference run: $(tail -3 ref.txt)"; exit 1; }
FP4SIM_FAULT_TRACE=1 run train.keep_last=1 train.out_dir=traced >/dev/null 2>trace.txt \
  || { echo "NOT OK  traced run"; exit 1; }
mapfile -t points < <(sed -n 's/^fault point \([0-9]*\): step_00000004: .*/\1/p' trace.txt)
label_of() { sed -n "s/^fault point $1: step_00000004: //p" trace.txt; }
point_of() { grep -F ": step_00000004: $1" trace.txt | sed -n '1s/^fault point \([0-9]*\):.*/\1/p'; }
rename=$(point_of "rename into place")
if [ "${#points[@]}" -ge 20 ] && [ -n "$rename" ]; then
  ok "the step-4 save has ${#points[@]} fault points (${points[0]}..${points[-1]}), the rename at $rename"
else
  bad "fault points of the step-4 save: ${#points[@]}, rename '$rename'"
fi

# step, loss and gradient norm of every line of a log
losses() { grep -oE '"(grad_norm|loss|step)":[^,}]*' "$1" | paste -sd' '; }
ref_losses=$(losses ref/log.jsonl)
same_files() {
  cmp -s "$1/model.safetensors" "$2/model.safetensors" \
    && cmp -s "$1/optimizer.safetensors" "$2/optimizer.safetensors"
}
latest() { ls "$1/checkpoints" 2>/dev/null | grep -E '^step_[0-9]+$' | tail -1; }

# check_resume NAME DIR WANT: DIR's latest checkpoint is WANT and bitwise the reference's; --resume
# DIR then ends with the reference's step-6 checkpoint and log, and no temporaries are left
check_resume() {
  local name=$1 dir=$2 want=$3 last
  last=$(latest "$dir")
  if [ "$last" != "$want" ]; then bad "$name: latest checkpoint '$last', expected $want"; return; fi
  if ! same_files "$dir/checkpoints/$last" "ref/checkpoints/$last"; then
    bad "$name: the last good checkpoint $last is not intact"; return
  fi
  if ! run train.keep_last=1 train.out_dir="$dir" --resume "$dir" >resume.txt 2>&1; then
    bad "$name: resume failed: $(tail -2 resume.txt)"; return
  fi
  if ! same_files "$dir/checkpoints/step_00000006" ref/checkpoints/step_00000006; then
    bad "$name: the resumed run's weights differ from the uninterrupted run's"; return
  fi
  if [ "$(losses "$dir/log.jsonl")" != "$ref_losses" ]; then
    bad "$name: the resumed run's losses differ from the uninterrupted run's"; return
  fi
  if ls "$dir/checkpoints" | grep -qE '\.(tmp|old)-'; then
    bad "$name: temporaries left: $(ls "$dir/checkpoints" | paste -sd' ')"; return
  fi
  ok "$name: $want intact, bitwise resume"
}

# ---- kill -9 at every operation of the step-4 save ------------------------------------------------
for n in "${points[@]}"; do
  rm -rf k
  FP4SIM_FAULT_AT=$n "$bin" train --config "$cfg" $micro --backend emu train.keep_last=1 \
    train.out_dir=k >k.txt 2>&1 &
  pid=$!
  { wait $pid; } 2>/dev/null  # (no "Killed" line from the shell)
  rc=$?
  name="kill -9 at point $n ($(label_of "$n"))"
  if [ $rc -ne 137 ]; then bad "$name: exit $rc, not killed"; continue; fi
  # the lock file names the dead writer; the resume is not blocked by it
  if [ "$(cat k/fp4sim.lock 2>/dev/null)" != "$pid" ]; then bad "$name: lock file lacks PID $pid"; continue; fi
  want=step_00000002
  [ "$n" -gt "$rename" ] && want=step_00000004
  check_resume "$name" k "$want"
done

# ---- injected write failures: a clear error, a non-zero exit, the run stops -------------------
for label in "model.safetensors: create" "model.safetensors: write 'wte'" \
  "optimizer.safetensors: fsync" "state.json: close" "manifest.json: write the manifest" \
  "fsync the temporary folder" "rename into place" "fsync the checkpoints folder" \
  "prune step_00000002: rename"; do
  n=$(point_of "$label")
  name="write failure at point $n ($label)"
  if [ -z "$n" ]; then bad "$name: no such point"; continue; fi
  rm -rf f
  FP4SIM_FAULT_FAIL_AT=$n run train.keep_last=1 train.out_dir=f >f.txt 2>&1
  rc=$?
  if [ $rc -ne 1 ] || ! grep -q "fp4sim: error: checkpoint .*step_00000004.*No space left on device (injected" f.txt; then
    bad "$name: exit $rc, message: $(grep error f.txt | tail -1)"; continue
  fi
  if grep -q "step     5" f.txt; then bad "$name: the run went on after the failed save"; continue; fi
  want=step_00000002
  [ "$n" -gt "$rename" ] && want=step_00000004
  check_resume "$name" f "$want"
done

# ---- a full disk: a 320 KiB tmpfs holds one checkpoint, not two (needs a private mount) ---------
if [ "$(id -u)" -eq 0 ] && unshare -m true 2>/dev/null; then
  rm -rf full fullrun && mkdir full
  bin=$bin cfg=$cfg micro=$micro unshare -m bash -c '
    mount -t tmpfs -o size=320k tmpfs full || exit 99
    "$bin" train --config "$cfg" $micro --backend emu train.keep_last=1 train.out_dir=full/run \
      >full.txt 2>&1
    echo $? >full.rc
    cp -a full/run fullrun'
  if [ "$(cat full.rc 2>/dev/null)" = 1 ] && grep -q "No space left on device" full.txt; then
    check_resume "full disk (tmpfs): $(grep -o '[a-z]*\.[a-z]*: [a-z]* failed: No space left on device' full.txt)" \
      fullrun step_00000002
  else
    bad "full disk (tmpfs): exit $(cat full.rc 2>/dev/null), $(grep error full.txt)"
  fi
else
  echo "SKIP    full disk on a tmpfs (no private mount here; the injected failures stand in)"
fi

# ---- damaged checkpoints: refused by --resume, eval and sample, naming the file ---------------
# damaged_copy: the reference stopped after step 4 (its checkpoints 2 and 4)
damaged_copy() { rm -rf x && cp -a ref x && rm -rf x/checkpoints/step_00000006; }
flip_byte() {  # flip_byte FILE OFFSET: all bits of one byte
  local b
  b=$(od -An -tu1 -j "$2" -N1 "$1" | tr -d ' ')
  printf "$(printf '\\%03o' $((b ^ 255)))" | dd of="$1" bs=1 seek="$2" count=1 conv=notrunc 2>/dev/null
}
# refused NAME NEEDLE: --resume x, eval and sample of x fail naming NEEDLE
refused() {
  local name=$1 needle=$2 cmd
  for cmd in resume eval sample; do
    case $cmd in
      resume) run train.keep_last=1 train.out_dir=x --resume x >d.txt 2>&1 ;;
      eval) "$bin" eval --checkpoint x --batches 1 --backend emu >d.txt 2>&1 ;;
      sample) "$bin" sample --checkpoint x --tokens 2 --backend emu >d.txt 2>&1 ;;
    esac
    local rc=$?
    if [ $rc -eq 0 ] || ! grep -qF -- "$needle" d.txt || ! grep -q "the one before it is step_00000002" d.txt; then
      bad "$name: $cmd exit $rc, message: $(tail -1 d.txt)"; return 1
    fi
  done
  return 0
}
ck=x/checkpoints/step_00000004
for f in model.safetensors optimizer.safetensors state.json manifest.json; do
  damaged_copy
  size=$(stat -c %s "$ck/$f")
  flip_byte "$ck/$f" $((size / 2))
  needle="$ck/$f"
  case $f in *.safetensors) needle="$ck/$f: tensor '" ;; esac
  refused "flipped byte in $f" "$needle" || continue
  ok "flipped byte in $f: --resume, eval and sample refuse it naming it ($(grep -o 'error: .*' d.txt | cut -c8-90)...)"
  rm -rf "$ck"  # as the error says: remove the damaged latest to resume from the one before
  check_resume "flipped byte in $f, then the damaged checkpoint removed" x step_00000002
done
damaged_copy && cp ref/checkpoints/step_00000002/model.safetensors "$ck/"
refused "step 2's model.safetensors in step 4's folder" "model.safetensors holds step 2, its checkpoint's state.json step 4" \
  && ok "step 2's model.safetensors in step 4's folder: refused (step mismatch)"
damaged_copy && printf 'junk' >>"$ck/optimizer.safetensors"
refused "trailing bytes" "optimizer.safetensors: 4 trailing bytes after the data" \
  && ok "trailing bytes after a safetensors file's data: refused"

# ---- two writers on one run folder --------------------------------------------------------------
# writer A stops itself mid-save (SIGSTOP, holding the lock); B, fresh and --resume, must be refused
# at once naming A's PID; A then goes on, and its run is the uninterrupted one
rm -rf c
stop=$(point_of "model.safetensors: write 'wte'")
FP4SIM_FAULT_STOP_AT=$stop "$bin" train --config "$cfg" $micro --backend emu train.keep_last=1 \
  train.out_dir=c >a.txt 2>&1 &
a=$!
state=""
for _ in $(seq 1 600); do  # (waits for A's state, at most 30 s)
  state=$(cut -d' ' -f3 /proc/$a/stat 2>/dev/null)
  [ "$state" = T ] && break
  sleep 0.05
done
if [ "$state" != T ]; then
  bad "two writers: writer A did not stop at point $stop (state '$state')"
else
  both=1
  for extra in "" "--resume c"; do
    # shellcheck disable=SC2086
    if run train.keep_last=1 train.out_dir=c $extra >b.txt 2>&1 \
      || ! grep -qF "train.out_dir c is in use by another fp4sim (PID $a, holding c/fp4sim.lock)" b.txt; then
      bad "two writers: a second writer ${extra:-(fresh)} was not refused: $(tail -1 b.txt)"
      both=0
    fi
  done
  kill -CONT $a
  wait $a
  rc=$?
  if [ $both -eq 1 ] && [ $rc -eq 0 ] && same_files c/checkpoints/step_00000006 ref/checkpoints/step_00000006 \
    && [ "$(losses c/log.jsonl)" = "$ref_losses" ]; then
    ok "two writers: the second (fresh and --resume) refused naming PID $a; the first ran on, bitwise"
  elif [ $both -eq 1 ]; then
    bad "two writers: the first writer's run was disturbed (exit $rc)"
  fi
fi
kill -CONT $a 2>/dev/null

echo "checkpoint faults: $cases cases, $fails failure(s)"
[ "$fails" -eq 0 ]
