#!/usr/bin/env bash
# Every command that writes files, on a full disk: a non-zero exit, the file and "No space left on
# device" in the message, and no output (not even a temporary file) left behind. Runs as root in a
# mount namespace of its own (test_cli.sh starts it with `unshare -rm` where the system allows),
# so the 64 KiB tmpfs it fills is seen by this script alone.
# usage: full_disk.sh FP4SIM_BINARY CONFIG "MICRO OVERRIDES"   (in test_cli.sh's work folder)
set -u
bin=$1
cfg=$2
micro=$3
mkdir -p fulldisk
mount -t tmpfs -o size=64k tmpfs fulldisk || {
  echo "SKIP    full disk: cannot mount a tmpfs here"
  exit 0
}
cat /dev/zero >fulldisk/fill 2>/dev/null  # every byte taken; new (empty) files still fit
# check NAME NEEDLE CMD...: fails, the message has NEEDLE, and no file is left but the fill, a
# log.jsonl (the log is written as the run goes) and the run folder's lock file (fp4sim.lock, which
# stays: a lock no process holds does not block)
check() {
  local name=$1 needle=$2
  shift 2
  if "$@" >stdout.txt 2>stderr.txt; then
    echo "NOT OK  full disk: $name (exit 0)"
  elif ! grep -qE "$needle" stderr.txt; then
    echo "NOT OK  full disk: $name (message: $(cat stderr.txt))"
  elif [ -n "$(find fulldisk -type f ! -name fill ! -name log.jsonl ! -name fp4sim.lock)" ]; then
    echo "NOT OK  full disk: $name (left: $(find fulldisk -type f ! -name fill))"
  else
    echo "OK      full disk: $name"
  fi
  find fulldisk -mindepth 1 ! -name fill -delete 2>/dev/null
}
enospc="No space left on device"
check "make-tensor" "fulldisk/t.npy: write failed \($enospc\)" \
  "$bin" make-tensor fulldisk/t.npy --rows 64 --cols 128
check "quantize" "fulldisk/q.codes.npy: write failed \($enospc\)" \
  "$bin" quantize x.npy fulldisk/q --backend emu
check "convert" "fulldisk/c.npy: write failed \($enospc\)" \
  "$bin" convert --format e4m3 x.npy fulldisk/c.npy
check "gemm" "fulldisk/d.npy: write failed \($enospc\)" \
  "$bin" gemm ga.npy gb.npy fulldisk/d.npy --backend emu
printf 'some text for the corpus\n%.0s' $(seq 40) >corpus_full.txt
check "data build" "fulldisk/tk.train.tokens: write failed \($enospc\)" \
  "$bin" data build corpus_full.txt --out fulldisk/tk
# room for the lock file's page (the holder's PID), none for the log
truncate -s -4K fulldisk/fill
check "train log" "fulldisk/run/log.jsonl: write failed \($enospc\)" \
  "$bin" train --config "$cfg" $micro train.checkpoint_every=0 train.out_dir=fulldisk/run --backend emu
# room for the lock's and the log's pages, none for the checkpoint
truncate -s -4K fulldisk/fill
check "train checkpoint" "checkpoint .*not written.*($enospc|disk full)" \
  "$bin" train --config "$cfg" $micro train.checkpoint_every=1 train.out_dir=fulldisk/runck --backend emu
check "train --dump" "fulldisk/dump/weights.safetensors.*($enospc|disk full)" \
  "$bin" train --config "$cfg" $micro train.checkpoint_every=0 train.out_dir=run_fulldump \
  --dump fulldisk/dump --backend emu
umount fulldisk
