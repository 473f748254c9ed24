#!/usr/bin/env bash
# fp4sim golden write | check: the pack passes against itself and against the CLI's own outputs
# (fp4sim quantize / gemm / mma run on each case's inputs with its recorded flags), one flipped
# bit fails exactly its case at the right index, and a changed contract, a corrupted file or
# missing paths are refused with messages naming them.
# usage: test_golden.sh FP4SIM_BINARY WORKDIR   (needs python3 for reading JSON and npy headers)
set -u
bin=$1
work=$2
rm -rf "$work"
mkdir -p "$work"
cd "$work" || exit 1
fails=0
ok() { echo "OK      $1"; }
bad() { echo "NOT OK  $1"; fails=$((fails + 1)); }

# expect_fail NAME NEEDLE CMD...: non-zero exit and NEEDLE in stdout or stderr
expect_fail() {
  local name=$1 needle=$2
  shift 2
  if "$@" >stdout.txt 2>stderr.txt; then
    bad "$name (exit 0)"
    return
  fi
  if ! grep -qF -- "$needle" stderr.txt stdout.txt; then
    bad "$name (message lacks '$needle': $(cat stderr.txt stdout.txt | tail -5))"
    return
  fi
  ok "$name"
}

# flip_bit FILE INDEX: flips the lowest bit of element INDEX of an npy file (element size from
# its dtype)
flip_bit() {
  python3 - "$1" "$2" <<'EOF'
import ast, sys
path, index = sys.argv[1], int(sys.argv[2])
b = bytearray(open(path, "rb").read())
hlen = int.from_bytes(b[8:10], "little")
descr = ast.literal_eval(b[10:10 + hlen].decode())["descr"]
size = int(descr[2:])
b[10 + hlen + index * size] ^= 1
open(path, "wb").write(bytes(b))
EOF
}

if ! command -v python3 >/dev/null; then
  echo "SKIP  python3 not found"
  exit 0
fi

"$bin" golden write pack >write.txt 2>&1 && ok "golden write" || bad "golden write: $(cat write.txt)"
ncases=$(python3 -c 'import json; print(len(json.load(open("pack/manifest.json"))["cases"]))')
bytes=$(python3 -c 'import json; print(sum(f["bytes"] for f in json.load(open("pack/manifest.json"))["files"].values()))')
echo "        $ncases cases, $bytes bytes"
[ "$ncases" -ge 60 ] && ok "pack has $ncases cases" || bad "pack has only $ncases cases"
[ "$bytes" -lt 52428800 ] && ok "pack under 50 MB ($bytes bytes)" || bad "pack is $bytes bytes"
python3 - <<'EOF' && ok "manifest fields" || bad "manifest fields"
import json
m = json.load(open("pack/manifest.json"))
assert m["pack_version"] == 1 and m["contract_version"] == 2 and m["fp4sim_version"]
for rel, f in m["files"].items():
    assert len(f["sha256"]) == 64 and f["bytes"] > 0, rel
ops = {c["op"] for c in m["cases"]}
assert ops == {"quantize", "gemm", "mma"}, ops
for c in m["cases"]:
    j = json.load(open("pack/" + c["name"] + "/case.json"))
    assert j["op"] == c["op"] and j["args"][0] == c["op"] and j["outputs"] and j["inputs"]
    for f in j["inputs"]:
        assert c["name"] + "/inputs/" + f in m["files"], f
    for o in j["outputs"]:
        assert c["name"] + "/expected/" + o["file"] in m["files"], o
EOF

"$bin" golden check pack --outputs pack >check.txt 2>&1 && [ "$(grep -c '^PASS' check.txt)" = "$ncases" ] \
  && ok "the pack passes against itself" || bad "self check: $(tail -5 check.txt)"

# the CLI's own outputs: each case's command line, run in the case folder, writing into
# cli/<case>/expected/ (mma prints its result bits; they go into an npy with the pack's header)
mkdir -p cli
ran=0
while IFS= read -r name; do
  mkdir -p "cli/$name/expected"
  mapfile -t args < <(python3 -c 'import json,sys; print("\n".join(json.load(open(sys.argv[1]))["args"]))' "pack/$name/case.json")
  for i in "${!args[@]}"; do
    case ${args[$i]} in expected/*) args[$i]="$work/cli/$name/${args[$i]}" ;; esac
  done
  if ! (cd "pack/$name" && "$bin" "${args[@]}") >run.txt 2>&1; then
    bad "CLI on $name: ${args[*]}: $(tail -3 run.txt)"
    continue
  fi
  if [ "${args[0]}" = mma ]; then
    hex=$(sed -n 's/^result 0x\([0-9A-F]\{8\}\).*/\1/p' run.txt)
    exp="pack/$name/expected/d.npy"
    head -c $(($(stat -c %s "$exp") - 4)) "$exp" >"cli/$name/expected/d.npy"
    printf "\\x${hex:6:2}\\x${hex:4:2}\\x${hex:2:2}\\x${hex:0:2}" >>"cli/$name/expected/d.npy"
  fi
  ran=$((ran + 1))
done < <(python3 -c 'import json; print("\n".join(c["name"] for c in json.load(open("pack/manifest.json"))["cases"]))')
[ "$ran" = "$ncases" ] && ok "the CLI ran every case ($ran)" || bad "the CLI ran $ran of $ncases cases"
"$bin" golden check pack --outputs cli >check.txt 2>&1 && [ "$(grep -c '^PASS' check.txt)" = "$ncases" ] \
  && ok "the CLI's outputs pass (fp4sim quantize/gemm/mma == the pack, bit for bit)" \
  || bad "CLI outputs: $(grep -A3 FAIL check.txt | head -20; tail -2 check.txt)"
grep -q "optional file(s) not written" check.txt && ok "the tiled scale layout is optional" \
  || bad "optional tiled scales not reported"

# one flipped bit: exactly that case fails, at that element
cp -r cli flip
flip_bit flip/quantize/nvfp4_1x16_rn_row/expected/q.codes.npy 197
expect_fail "a flipped code bit fails" "first at index 197 [3, 5]: expected 0x" \
  "$bin" golden check pack --outputs flip
[ "$(grep -c '^FAIL' stdout.txt)" = 1 ] && grep -q '^FAIL  quantize/nvfp4_1x16_rn_row$' stdout.txt \
  && grep -q "flip/quantize/nvfp4_1x16_rn_row/expected/q.codes.npy: 1 of 4096 elements differ" stdout.txt \
  && ok "exactly that case fails, naming the file" || bad "flip report: $(grep -A2 FAIL stdout.txt)"
cp -r cli flip2
flip_bit flip2/gemm/nvfp4_alpha_beta_bf16/expected/d.npy 41
expect_fail "a flipped bf16 D bit fails" "first at index 41 [1, 1]: expected 0x" \
  "$bin" golden check pack --outputs flip2
[ "$(grep -c '^FAIL' stdout.txt)" = 1 ] && grep -q '^FAIL  gemm/nvfp4_alpha_beta_bf16$' stdout.txt \
  && ok "exactly the GEMM case fails" || bad "gemm flip report: $(grep -A2 FAIL stdout.txt)"
grep "first at index 41" stdout.txt | grep -Eq "expected 0x[0-9A-F]{4}, got 0x[0-9A-F]{4}$" \
  && ok "bits printed as 4 hex digits for bf16" || bad "bf16 hex: $(grep 'first at' stdout.txt)"
flip_bit flip2/mma/ue4m3_random0/expected/d.npy 0
expect_fail "a flipped MMA bit fails" "first at index 0 [0]: expected 0x" \
  "$bin" golden check pack --outputs flip2
[ "$(grep -c '^FAIL' stdout.txt)" = 2 ] && ok "two flips, two failing cases" || bad "two flips: $(grep FAIL stdout.txt)"

# missing outputs, a changed contract, a corrupted pack, bad paths
rm flip2/gemm/fp8_f32/expected/d.npy
expect_fail "a missing output file fails its case" "flip2/gemm/fp8_f32/expected/d.npy: missing" \
  "$bin" golden check pack --outputs flip2
expect_fail "--outputs folder missing" "nowhere: no such folder" "$bin" golden check pack --outputs nowhere
expect_fail "pack folder missing" "nopack: no such folder" "$bin" golden check nopack --outputs cli
mkdir -p empty
expect_fail "not a pack" "empty: not a golden pack (no manifest.json" "$bin" golden check empty --outputs cli
cp -r pack pack_cv
sed -i 's/"contract_version": 2,/"contract_version": 3,/' pack_cv/manifest.json
expect_fail "another contract_version is refused" "pack_cv/manifest.json: contract_version 3, this fp4sim implements contract_version 2" \
  "$bin" golden check pack_cv --outputs cli
cp -r pack pack_bad
flip_bit pack_bad/quantize/mxfp4_floor_row/expected/q.scales.npy 3
expect_fail "a corrupted pack file is refused" "pack_bad/quantize/mxfp4_floor_row/expected/q.scales.npy: sha256" \
  "$bin" golden check pack_bad --outputs cli
rm pack_bad/quantize/mxfp4_floor_row/expected/q.scales.npy
expect_fail "a pack file missing is refused" "q.scales.npy: listed in the pack's manifest but missing" \
  "$bin" golden check pack_bad --outputs cli
expect_fail "write into an existing folder" "pack: exists" "$bin" golden write pack
expect_fail "write into a missing parent" "does not exist" "$bin" golden write no/such/pack
expect_fail "unknown case set" "--cases: unknown set 'bogus'" "$bin" golden write p2 --cases bogus
[ ! -e p2 ] && ! ls ./*.tmp.* >/dev/null 2>&1 && ok "nothing left by the failed writes" || bad "files left"

"$bin" golden write p_mma --cases mma >/dev/null 2>&1 && "$bin" golden check p_mma --outputs cli >check.txt 2>&1 \
  && ! grep -q "quantize/" check.txt && grep -q "PASS  mma/" check.txt \
  && ok "--cases mma writes only MMA cases" || bad "--cases mma: $(tail -3 check.txt)"
# deterministic: a second pack has the same bytes (a trailing slash names the same folder)
"$bin" golden write pack_again/ >/dev/null 2>&1 && diff -r pack pack_again >/dev/null \
  && ok "two writes give identical packs" || bad "packs differ between writes"

echo "$fails failure(s)"
[ "$fails" = 0 ]
