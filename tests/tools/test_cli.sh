#!/usr/bin/env bash
# CLI checks: outputs and their shapes, bad input -> clear error, non-zero exit, no files left.
# usage: test_cli.sh FP4SIM_BINARY WORKDIR
set -u
bin=$1
work=$2
rm -rf "$work"
mkdir -p "$work"
cd "$work" || exit 1
fails=0
ok() { echo "OK      $1"; }
bad() { echo "NOT OK  $1"; fails=$((fails + 1)); }

# expect_fail NAME NEEDLE CMD...: non-zero exit, stderr mentions NEEDLE, no out.* files written
expect_fail() {
  local name=$1 needle=$2
  shift 2
  rm -f out.*
  if "$@" >stdout.txt 2>stderr.txt; then
    bad "$name (exit 0)"
    return
  fi
  if ! grep -qF -- "$needle" stderr.txt stdout.txt; then
    bad "$name (message lacks '$needle': $(cat stderr.txt))"
    return
  fi
  if ls out.* >/dev/null 2>&1; then
    bad "$name (left files: $(ls out.*))"
    return
  fi
  ok "$name"
}

"$bin" make-tensor x.npy --rows 64 --cols 128 --kind heavy-tailed >/dev/null || bad "make-tensor"
"$bin" make-tensor xb.npy --rows 64 --cols 128 --dtype bf16 >/dev/null || bad "make-tensor bf16"
"$bin" make-tensor odd.npy --rows 24 --cols 40 >/dev/null || bad "make-tensor odd"

if "$bin" quantize x.npy out/row --backend emu >log.txt 2>&1; then bad "missing out dir should fail"; else ok "missing output directory is an error"; fi
mkdir -p q
if "$bin" quantize x.npy q/row --backend emu >log.txt 2>&1; then
  for f in codes scales amax dequant; do
    [ -f "q/row.$f.npy" ] || bad "q/row.$f.npy missing"
  done
  [ -f q/row.meta.json ] && grep -q '"contract_version": 2' q/row.meta.json && ok "quantize writes 5 files with contract_version" || bad "meta.json"
  grep -q "saturated" log.txt && grep -q "scale exps" log.txt && ok "summary printed" || bad "summary"
  ls q/*.tmp.* >/dev/null 2>&1 && bad "temporary files left" || ok "no temporary files"
else
  bad "quantize failed: $(cat log.txt)"
fi
"$bin" quantize xb.npy q/colb --columnwise --rht --sr --seed 3 --stream 4 --backend emu >log.txt 2>&1 \
  && grep -q "written 128 x 64" log.txt && ok "bf16 column-wise RHT SR" || bad "bf16 column-wise RHT SR: $(cat log.txt)"
"$bin" quantize x.npy q/mx --format mxfp4 --mx-rule ceil --backend emu >/dev/null 2>&1 && ok "mxfp4" || bad "mxfp4"
"$bin" quantize x.npy q/fos --2d --four-over-six --error mse --backend emu >/dev/null 2>&1 && ok "2d four-over-six" || bad "2d four-over-six"
# FP8 (1x128 blocks): one code byte per element, float32 scales; the GEMM reads them back bit for bit
"$bin" quantize x.npy q/f8 --format fp8 --backend emu >log.txt 2>&1 && grep -q "fp8 1x128" log.txt \
  && grep -q '"scales": "float32' q/f8.meta.json && ok "fp8 quantize" || bad "fp8 quantize: $(cat log.txt)"
"$bin" gemm x.npy x.npy q/d8.npy --format fp8 --backend emu >/dev/null 2>&1 \
  && "$bin" gemm --a-prefix q/f8 --b-prefix q/f8 q/d8p.npy --backend emu >/dev/null 2>&1 \
  && cmp -s q/d8.npy q/d8p.npy && ok "fp8 gemm from floats == from the quantize files" || bad "fp8 gemm"
expect_fail "fp8 with sr" "--sr" "$bin" quantize x.npy out --format fp8 --sr --seed 1 --backend emu
expect_fail "fp8 2d rows not multiple of 128" "128" "$bin" quantize x.npy out --format fp8 --2d --backend emu

expect_fail "blocked dim not multiple of 16" "not a multiple of 16" "$bin" quantize odd.npy out --backend emu
expect_fail "mxfp4 with 2d" "--2d" "$bin" quantize x.npy out --format mxfp4 --2d --backend emu
expect_fail "four-over-six with sr" "--four-over-six" "$bin" quantize x.npy out --four-over-six --sr --backend emu
expect_fail "four-over-six with rht" "--four-over-six" "$bin" quantize x.npy out --four-over-six --rht --columnwise --backend emu
expect_fail "mxfp4 with four-over-six" "--four-over-six" "$bin" quantize x.npy out --format mxfp4 --four-over-six --backend emu
expect_fail "rht without columnwise" "--columnwise" "$bin" quantize x.npy out --rht --backend emu
expect_fail "unreadable file" "nope.npy" "$bin" quantize nope.npy out --backend emu
expect_fail "unknown flag" "--frobnicate" "$bin" quantize x.npy out --frobnicate
expect_fail "unknown backend" "backend" "$bin" quantize x.npy out --backend tpu
expect_fail "seed without sr" "--seed" "$bin" quantize x.npy out --seed 3 --backend emu
printf 'not an npy file at all' > junk.npy
expect_fail "not an npy" "junk.npy" "$bin" quantize junk.npy out --backend emu
head -c 1000 x.npy > trunc.npy
expect_fail "truncated npy" "truncated" "$bin" quantize trunc.npy out --backend emu
python3 - <<'PY' 2>/dev/null || printf '\x93NUMPY\x01\x00v\x00{"descr": "<f8", "fortran_order": False, "shape": (16, 16), }' > f64.npy
import struct
hdr = "{'descr': '<f8', 'fortran_order': False, 'shape': (16, 16), }"
hdr += " " * (118 - len(hdr)) + "\n"
open("f64.npy", "wb").write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(hdr)) + hdr.encode() + b"\0" * (16 * 16 * 8))
hdr = "{'descr': '<f4', 'fortran_order': False, 'shape': (4, 4, 16), }"
hdr += " " * (118 - len(hdr)) + "\n"
open("r3.npy", "wb").write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(hdr)) + hdr.encode() + b"\0" * (4 * 4 * 16 * 4))
PY
expect_fail "wrong dtype" "dtype '<f8'" "$bin" quantize f64.npy out --backend emu
# a header whose shape disagrees with the file: trailing bytes, or a product that overflows
cp x.npy trail.npy && printf '\0\0\0\0' >> trail.npy
expect_fail "npy with bytes after the data" "bytes after the data" "$bin" quantize trail.npy out --backend emu
python3 - <<'PY' 2>/dev/null
import struct
hdr = "{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776, 1099511627776), }"
hdr += " " * (118 - len(hdr)) + "\n"
open("huge.npy", "wb").write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(hdr)) + hdr.encode() + b"\0" * 64)
PY
[ -f huge.npy ] && expect_fail "npy shape overflowing" "too large" "$bin" quantize huge.npy out --backend emu
python3 - <<'PY' 2>/dev/null
import struct
hdr = "{'descr': '<f4', 'fortran_order': False, 'shape': (0, 9999999999999999999), }"
hdr += " " * (118 - len(hdr)) + "\n"
open("dim64.npy", "wb").write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(hdr)) + hdr.encode())
PY
[ -f dim64.npy ] && expect_fail "npy dimension past int64 (an empty array)" "9999999999999999999 is too large" "$bin" convert --format e2m1 dim64.npy out.npy
# sizes from flags: rows x cols overflowing 64 bits (a crash, and a 136-byte file with exit 0, once)
expect_fail "make-tensor 2^32 x 2^32" "is too large" "$bin" make-tensor out.npy --rows 4294967296 --cols 4294967296
expect_fail "make-tensor 3 x (2^64 + 2) / 3" "is too large" "$bin" make-tensor out.npy --rows 3 --cols 6148914691236517206
expect_fail "make-tensor too large to allocate" "cannot allocate 4611686018427387904 bytes" "$bin" make-tensor out.npy --rows 1073741824 --cols 1073741824
expect_fail "crosscheck shape overflowing" "is too large" "$bin" crosscheck gemm --shapes 4294967296x4294967296x64
[ -f r3.npy ] && expect_fail "wrong rank" "2-D" "$bin" quantize r3.npy out --backend emu
# gemm and mma
"$bin" make-tensor ga.npy --rows 32 --cols 128 >/dev/null && "$bin" make-tensor gb.npy --rows 16 --cols 128 --seed 5 >/dev/null
"$bin" make-tensor gk.npy --rows 16 --cols 96 >/dev/null
"$bin" gemm ga.npy gb.npy q/d.npy --backend emu >log.txt 2>&1 && [ -f q/d.npy ] && grep -q "contract_version" q/d.npy.meta.json \
  && ok "gemm writes D and meta" || bad "gemm: $(cat log.txt)"
"$bin" quantize ga.npy q/ga --2d --backend emu >/dev/null 2>&1 && "$bin" quantize gb.npy q/gb --four-over-six --backend emu >/dev/null 2>&1 \
  && "$bin" gemm --a-prefix q/ga --b-prefix q/gb q/d2.npy --out-dtype bf16 --backend emu >log.txt 2>&1 && [ -f q/d2.npy ] \
  && ok "gemm from quantized files (2D and Four Over Six operands)" || bad "gemm prefixes: $(cat log.txt)"
"$bin" mma --a 0:-4,16:-1,-1,-0.5 --b 0:4,16:1,0.5,0.5 --sfa 2^11,1,1,1 --sfb 2^8,2^-1,1,1 --c 2^23 >log.txt 2>&1 \
  && grep -q "0xBF600000" log.txt && ok "mma worked vector -0.875" || bad "mma: $(cat log.txt)"
# gemm says what quantize says about NaN and Inf inputs, and warns when the epilogue scale
# overflows in the contract's order (the bits stay the contract's)
python3 - <<'PY' 2>/dev/null
import random, struct
def save(name, vals):
    hdr = "{'descr': '<f4', 'fortran_order': False, 'shape': (16, 64), }"
    hdr += " " * (118 - len(hdr)) + "\n"
    open(name, "wb").write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(hdr)) + hdr.encode() + struct.pack("<1024f", *vals))
random.seed(1)
v = [random.gauss(0, 1) for _ in range(1024)]
save("g_ok.npy", v)
save("g_nan.npy", v[:3] + [float("nan")] + v[4:])
save("g_big.npy", v[:5] + [3e38] + v[6:])
PY
if [ -f g_big.npy ]; then
  "$bin" gemm g_nan.npy g_ok.npy q/dn.npy --backend emu >log.txt 2>&1 && grep -q "WARNING  A (g_nan.npy) holds 1 NaN and 0 Inf" log.txt \
    && ok "gemm reports NaN inputs" || bad "gemm NaN inputs: $(cat log.txt)"
  "$bin" gemm g_big.npy g_ok.npy q/db.npy --backend emu >log.txt 2>&1 && grep -q "WARNING  the epilogue scale .* overflows FP32 to inf although the factor is 1" log.txt \
    && grep -q "WARNING  D holds 256 Inf or NaN of 256 values" log.txt && ok "gemm warns when the epilogue scale overflows" \
    || bad "gemm epilogue overflow: $(cat log.txt)"
  "$bin" gemm g_ok.npy g_ok.npy q/dk.npy --backend emu >log.txt 2>&1 && ! grep -q WARNING log.txt \
    && ok "gemm of finite inputs: no warning" || bad "gemm finite inputs: $(cat log.txt)"
fi
expect_fail "gemm K mismatch" "K differs" "$bin" gemm ga.npy gk.npy out.npy --backend emu
expect_fail "gemm split-k" "--split-k 3" "$bin" gemm ga.npy gb.npy out.npy --split-k 3 --backend emu
expect_fail "gemm beta without C" "--beta needs C" "$bin" gemm ga.npy gb.npy out.npy --beta 1 --backend emu
expect_fail "gemm missing quantized file" "q/nope.meta.json" "$bin" gemm --a-prefix q/nope --b-prefix q/gb out.npy --backend emu
cp q/gb.scales.npy q/gbad.scales.npy; cp q/gb.meta.json q/gbad.meta.json; cp q/gb.amax.npy q/gbad.amax.npy; cp q/ga.codes.npy q/gbad.codes.npy
expect_fail "gemm inconsistent quantized files" "q/gbad.scales.npy" "$bin" gemm --a-prefix q/ga --b-prefix q/gbad out.npy --backend emu
expect_fail "gemm cublaslt on emu" "cublaslt" "$bin" gemm ga.npy gb.npy out.npy --gemm cublaslt --backend emu
expect_fail "gemm C without beta" "--beta" "$bin" gemm ga.npy gb.npy out.npy --c ga.npy --backend emu
expect_fail "gemm --format with prefixes" "--format does not go" "$bin" gemm --a-prefix q/ga --b-prefix q/gb out.npy --format mxfp4 --backend emu
expect_fail "gemm positional operands with prefixes" "give only the output" "$bin" gemm ga.npy gb.npy out.npy --a-prefix q/ga --b-prefix q/gb --backend emu
"$bin" make-tensor gc.npy --rows 128 --cols 32 >/dev/null && "$bin" make-tensor gd.npy --rows 128 --cols 16 --seed 7 >/dev/null \
  && "$bin" quantize gc.npy q/gc_rht --columnwise --rht --backend emu >/dev/null && "$bin" quantize gd.npy q/gd --columnwise --backend emu >/dev/null
expect_fail "gemm RHT with non-RHT operand" "RHT copy" "$bin" gemm --a-prefix q/gc_rht --b-prefix q/gd out.npy --backend emu
"$bin" quantize gb.npy q/gs --backend emu >/dev/null
"$bin" make-tensor ge.npy --rows 16 --cols 128 --seed 9 >/dev/null && "$bin" quantize ge.npy q/ge --backend emu >/dev/null && cp q/ge.scales.npy q/gs.scales.npy
expect_fail "gemm scales of another run" "do not decode" "$bin" gemm --a-prefix q/ga --b-prefix q/gs out.npy --backend emu
expect_fail "mma bad value" "not an E2M1 value" "$bin" mma --a 0:5 --b 0:1 --sfa 1,1,1,1 --sfb 1,1,1,1
expect_fail "mma bad scale" "not a power of two" "$bin" mma --a 0:1 --b 0:1 --sfa 3,1,1,1 --sfb 1,1,1,1
expect_fail "mma trailing junk" "--c: '1.5xyz' is not a number" "$bin" mma --a 0:1 --b 0:1 --sfa 1,1,1,1 --sfb 1,1,1,1 --c 1.5xyz
expect_fail "mma repeated index" "index 0 given twice" "$bin" mma --a 0:1,0:2 --b 0:1 --sfa 1,1,1,1 --sfb 1,1,1,1
expect_fail "mma negative UE4M3 scale" "unsigned" "$bin" mma --a 0:1 --b 0:1 --scale ue4m3 --sfa -2,1,1,1 --sfb 1,1,1,1

# train / eval / sample on a micro model with synthetic tokens
cfg=$(dirname "$0")/../../configs/tiny.json
micro="model.d_model=32 model.n_layers=1 model.d_ff=64 model.n_heads=2 model.n_kv_heads=2 model.seq_len=16 model.max_positions=16 train.batch=2 train.steps=4 train.warmup=1 train.eval_every=2 train.eval_batches=1 train.data=synthetic train.checkpoint_every=2 train.keep_last=1"
"$bin" train --config "$cfg" $micro train.out_dir=run --backend emu >log.txt 2>&1 && grep -q "step     4" log.txt && [ -f run/log.jsonl ] \
  && [ "$(ls run/checkpoints)" = "step_00000004" ] && ok "train writes log and keeps the last checkpoint" || bad "train: $(tail -5 log.txt)"
"$bin" train --config "$cfg" $micro train.out_dir=rund --dump rund/dump --backend emu >/dev/null 2>&1 \
  && [ -f rund/dump/weights.safetensors ] && [ -f rund/dump/step0_grads.safetensors ] && [ -f rund/dump/batches.safetensors ] \
  && [ -f rund/dump/config.json ] && ok "train --dump writes the PyTorch check's inputs" || bad "train --dump"
"$bin" eval --checkpoint run/checkpoints --batches 1 --backend emu >log.txt 2>&1 && grep -q "val loss" log.txt && ok "eval" || bad "eval: $(cat log.txt)"
"$bin" train --config "$cfg" $micro model.vocab=256 train.out_dir=run2 --backend emu >/dev/null 2>&1 \
  && "$bin" sample --checkpoint run2/checkpoints --prompt "ab" --tokens 5 --backend emu >log.txt 2>&1 && ok "sample" || bad "sample: $(cat log.txt)"
# a quantized recipe's checkpoint: sampling windows of 3..7 tokens (no multiple of 16 rows: the
# forward passes make no column-wise Wgrad copies)
for r in nvfp4 fp8; do
  shape=$([ $r = fp8 ] && echo "model.d_model=128 model.d_ff=128 train.batch=8")  # (FP8: 128-element blocks)
  "$bin" train --config "$cfg" $micro model.vocab=256 recipe.name=$r $shape train.steps=2 train.out_dir=run_$r --backend emu >/dev/null 2>&1 \
    && "$bin" sample --checkpoint run_$r/checkpoints --prompt "abc" --tokens 5 --backend emu >log.txt 2>&1 \
    && ok "sample from a $r checkpoint" || bad "sample $r: $(tail -3 log.txt)"
done
want=$("$bin" info 2>/dev/null | awk '/^default backend:/ {print $3}')
"$bin" train --config "$cfg" $micro train.steps=1 train.checkpoint_every=0 train.out_dir=rundef >log.txt 2>&1 \
  && grep -q "backend $want by default" log.txt && ok "train without --backend runs on the default backend ($want)" \
  || bad "train default backend: $(head -2 log.txt)"
# a full disk: /dev/full (every write fails with ENOSPC) under the log needs no root; where user
# namespaces allow, full_disk.sh runs every writing command on a filled tmpfs
mkdir -p run_devfull && ln -sf /dev/full run_devfull/log.jsonl
expect_fail "train with the log on a full disk" "run_devfull/log.jsonl: write failed (No space left on device)" \
  "$bin" train --config "$cfg" $micro train.checkpoint_every=0 train.out_dir=run_devfull --backend emu
expect_fail "stdout on a full disk" "standard output: write failed (No space left on device)" \
  sh -c '"$0" info >/dev/full' "$bin"
if unshare -rm true 2>/dev/null; then
  unshare -rm bash "$(dirname "$0")/full_disk.sh" "$bin" "$cfg" "$micro" >full_disk.txt 2>&1
  cat full_disk.txt
  fails=$((fails + $(grep -c "^NOT OK" full_disk.txt)))
  grep -q "^OK      full disk: train log" full_disk.txt || grep -q "^SKIP" full_disk.txt || bad "full_disk.sh did not run: $(tail -3 full_disk.txt)"
else
  echo "SKIP    full disk on a tmpfs (no user namespaces here); /dev/full checks ran"
fi
expect_fail "train unknown key" "valid keys" "$bin" train --config "$cfg" model.heads=3
expect_fail "train impossible shape" "not divisible by model.n_heads" "$bin" train --config "$cfg" model.d_model=130
expect_fail "train missing data" "/nonexistent/corpus.train.tokens" "$bin" train --config "$cfg" train.data=/nonexistent/corpus
# the memory plan: printed by config for both backends (no GPU needed), checked by train
"$bin" config --config "$cfg" $micro >log.txt 2>&1 && grep -q "^memory plan (emu backend, host memory): peak" log.txt \
  && grep -q "^memory plan (cuda backend, device memory" log.txt && ok "config prints the memory plans" \
  || bad "config memory plans: $(tail -3 log.txt)"
expect_fail "train over its memory limit" "memory plan: the run needs" "$bin" train --config "$cfg" $micro \
  train.out_dir=run_mem --memory-limit 64K --backend emu
grep -qF "64.00 KiB (65536 bytes) available (--memory-limit)" stderr.txt && [ ! -e run_mem ] \
  && ok "a refused run names its limit and writes nothing" || bad "memory refusal: $(head -2 stderr.txt)"
expect_fail "train bad --memory-limit" "--memory-limit: '12X'" "$bin" train --config "$cfg" $micro --memory-limit 12X
if ! nvidia-smi -L >/dev/null 2>&1; then
  expect_fail "train on cuda without a GPU" "--backend cuda" "$bin" train --config "$cfg" --backend cuda
fi
cp -r run2 run3 && truncate -s 100 run3/checkpoints/step_00000004/model.safetensors
expect_fail "eval truncated checkpoint" "model.safetensors" "$bin" eval --checkpoint run3/checkpoints
sed -i 's/"contract_version": 2/"contract_version": 7/' run2/checkpoints/step_00000004/state.json
expect_fail "eval edited state.json" "state.json: its SHA-256 differs from manifest.json's" "$bin" eval --checkpoint run2/checkpoints
"$bin" eval --checkpoint run/checkpoints --all --backend emu >log.txt 2>&1 && grep -q "val loss" log.txt \
  && ok "eval --all" || bad "eval --all: $(cat log.txt)"
expect_fail "eval --all with --batches" "excludes" "$bin" eval --checkpoint run/checkpoints --all --batches 2 --backend emu
# more validation batches than the split holds: an error (it reused batches and reported N)
vb=$(( (8192 - 1) / 32 ))  # the micro runs' synthetic split: 8192 tokens, batches of 2 x 16
expect_fail "eval --batches past the split" "--batches $((vb + 1)): the synthetic validation split holds 8192 tokens, $vb full batches of 2 x 16" \
  "$bin" eval --checkpoint run/checkpoints --batches $((vb + 1)) --backend emu
"$bin" eval --checkpoint run/checkpoints --batches $vb --backend emu >log.txt 2>&1 && grep -q "over $vb batches" log.txt \
  && ok "eval --batches of the whole split" || bad "eval --batches $vb: $(cat log.txt)"
expect_fail "train.eval_batches past the split" "train.eval_batches 300: the synthetic validation split" \
  "$bin" train --config "$cfg" $micro train.eval_batches=300 train.out_dir=out.evb --backend emu
expect_fail "eval zero batches" "--batches must be an integer >= 1" "$bin" eval --checkpoint run/checkpoints --batches 0 --backend emu
expect_fail "sample NaN temperature" "--temperature must be a finite number" "$bin" sample --checkpoint run/checkpoints --temperature nan --backend emu
expect_fail "sample negative tokens" "--tokens must be an integer >= 0" "$bin" sample --checkpoint run/checkpoints --tokens -5 --backend emu
# --resume with other settings: the model's are refused naming the key, the run's are said
cp -r run run_rs
expect_fail "resume with another model" "model.d_ff: 64 -> 128" "$bin" train --config "$cfg" $micro model.d_ff=128 train.steps=6 \
  train.out_dir=run_rs --resume run_rs/checkpoints --backend emu
"$bin" train --config "$cfg" $micro train.steps=6 train.seed=99 train.out_dir=run_rs --resume run_rs/checkpoints --backend emu >log.txt 2>&1 \
  && grep -q "warning: resuming with settings that differ.*train.seed: [0-9]* -> 99" log.txt \
  && ok "resume with another seed says so" || bad "resume with another seed: $(grep -i warning log.txt)"
# another train.steps stretches the learning-rate schedule: said, with the next step's rate
cp -r run run_st
"$bin" train --config "$cfg" $micro train.steps=6 train.out_dir=run_st --resume run_st/checkpoints --backend emu >log.txt 2>&1 \
  && grep -q "warning: resuming with settings that differ.*train.steps: 4 -> 6" log.txt \
  && grep -q "warning: train.steps 4 -> 6 changes the learning-rate schedule.*step 5 takes lr .* here (the checkpoint's run ended at step 4)" log.txt \
  && ok "resume with another train.steps warns about the schedule" || bad "resume with another train.steps: $(grep -i warning log.txt)"
expect_fail "resume past train.steps" "nothing left to train" "$bin" train --config "$cfg" $micro train.out_dir=out.run --resume run/checkpoints --backend emu
expect_fail "config integer key given a fraction" "must be an integer" "$bin" config --config "$cfg" model.d_model=128.5
expect_fail "config negative eval_every" "train.eval_every" "$bin" config --config "$cfg" train.eval_every=-1
expect_fail "config grad_accum 0" "train.grad_accum" "$bin" config --config "$cfg" train.grad_accum=0
expect_fail "config beta1 of 1" "train.beta1" "$bin" config --config "$cfg" train.beta1=1
expect_fail "config batch overflowing" "too large for one batch" "$bin" config --config "$cfg" train.batch=72057594037927936
expect_fail "config key past 2^63" "out of range" "$bin" config --config "$cfg" model.vocab=18446744073709551615
# a checkpoint folder of later steps than the run starts from: refused before any work
expect_fail "train into an out_dir with later checkpoints" "step_00000004" "$bin" train --config "$cfg" $micro train.out_dir=run --backend emu
expect_fail "train --dump with grad_accum" "train.grad_accum=1" "$bin" train --config "$cfg" $micro train.grad_accum=2 train.out_dir=out.ga --dump out.dump --backend emu
"$bin" config --config "$cfg" recipe.name=mxfp4 >log.txt 2>&1 && grep -q '"weight_2d": false' log.txt \
  && ok "config: mxfp4 defaults to 1-D weight blocks" || bad "config mxfp4 default: $(tail -2 log.txt)"
expect_fail "quantize --mx-rule with nvfp4" "--mx-rule" "$bin" quantize x.npy out --mx-rule ceil --backend emu
expect_fail "quantize negative seed" "--seed" "$bin" quantize x.npy out --sr --seed -1 --backend emu
mkdir -p blocked/q.meta.json
if "$bin" quantize x.npy blocked/q --backend emu >/dev/null 2>stderr.txt; then bad "quantize onto a directory (exit 0)"
elif ! grep -q "is a directory" stderr.txt; then bad "quantize onto a directory: $(cat stderr.txt)"
elif [ "$(ls blocked)" != "q.meta.json" ]; then bad "quantize onto a directory (left files: $(ls blocked))"
else ok "quantize onto a directory: error, nothing written"; fi
# long names: the temporary name's suffix must not push a name that fits past NAME_MAX (255)
long=$(printf 'n%.0s' $(seq 240))
"$bin" quantize x.npy "q/$long" --backend emu >log.txt 2>&1 && [ -f "q/$long.dequant.npy" ] && [ -f "q/$long.meta.json" ] \
  && ! ls q/ | grep -q '\.tmp\.' && ok "quantize with a 240-character prefix" || bad "240-character prefix: $(tail -2 log.txt)"
long=$(printf 'n%.0s' $(seq 250))
expect_fail "quantize prefix past NAME_MAX, refused before work" "the file name is 264 bytes" "$bin" quantize x.npy "out.$long" --backend emu
# an output is never an input: refused before anything is written, the input untouched
"$bin" make-tensor q/p.codes.npy --rows 16 --cols 64 >/dev/null && cp q/p.codes.npy q/p.codes.orig
expect_fail "quantize output prefix naming its input" "q/p.codes.npy: is an input" "$bin" quantize q/p.codes.npy q/p --backend emu
cmp -s q/p.codes.npy q/p.codes.orig && ok "quantize left its input alone" || bad "quantize replaced its input"
cp ga.npy ga.orig && ln -sf ga.npy galink.npy
expect_fail "gemm output naming input A" "ga.npy: is an input" "$bin" gemm ga.npy gb.npy ga.npy --backend emu
expect_fail "gemm output linked to input A" "galink.npy: is the input ga.npy" "$bin" gemm ga.npy gb.npy galink.npy --backend emu
expect_fail "gemm output naming a prefix's file" "q/ga.dequant.npy: is the input" "$bin" gemm --a-prefix q/ga --b-prefix q/gb ./q/ga.dequant.npy --backend emu
cmp -s ga.npy ga.orig && [ -L galink.npy ] && ok "gemm left its inputs alone" || bad "gemm replaced an input"
expect_fail "convert onto its input" "x.npy: is an input" "$bin" convert --format e4m3 x.npy x.npy
# a prefix that ends in a folder would write hidden files (pd/.codes.npy): refused
mkdir -p pd
expect_fail "quantize prefix ending in /" "OUT_PREFIX 'pd/' ends in a folder" "$bin" quantize x.npy pd/ --backend emu
printf 'text\n' > pd_in.txt
expect_fail "data build --out ending in /" "--out 'pd/' ends in a folder" "$bin" data build pd_in.txt --out pd/
[ -z "$(ls -A pd)" ] && ok "nothing written into pd/" || bad "pd/ holds $(ls -A pd)"
expect_fail "gemm output in a missing folder" "the folder nodir/ does not exist" "$bin" gemm ga.npy gb.npy nodir/out.npy --backend emu
# a folder given as an input is called one (it was "bad magic bytes")
mkdir -p adir adir2.meta.json
expect_fail "quantize a folder" "adir: is a directory, not a .npy file" "$bin" quantize adir out --backend emu
expect_fail "gemm a folder" "adir: is a directory, not a .npy file" "$bin" gemm ga.npy adir out.npy --backend emu
expect_fail "gemm a prefix whose meta.json is a folder" "adir2.meta.json: is a directory" "$bin" gemm --a-prefix adir2 --b-prefix q/gb out.npy --backend emu
expect_fail "data show a folder" "adir: is a directory, not a token file" "$bin" data show adir
expect_fail "quantize a missing file" "nope.npy: cannot open for reading (No such file or directory)" "$bin" quantize nope.npy out --backend emu
expect_fail "crosscheck malformed shape" "is not MxNxK" "$bin" crosscheck gemm --shapes 64x64

"$bin" info >info.txt 2>&1 && grep -q "contract_version 2" info.txt && ok "info" || bad "info: $(cat info.txt)"

echo "cli: $fails failure(s)"
[ "$fails" -eq 0 ]
