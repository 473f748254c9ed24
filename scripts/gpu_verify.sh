#!/usr/bin/env bash
# One device call that checks and measures a change's GPU work (about 6 minutes on the H200):
#   1. build + every GPU test                         (gpu_check.sh quick)
#   2. gpt2-124m tokens/s and peak memory per recipe   (RUNS=3 gpu_check.sh recipes, with torch.compile)
#   3. per-kernel time of one gpt2-124m step          (RECIPE=$PROFILE_RECIPE gpu_check.sh trainprofile;
#      PROFILE_RECIPE defaults to bf16)
# Each part's logs come back as $OUT/<part>/gpu_check.tgz; the summaries print in order.
# Carry .deps and data. A part that fails does not stop the next (the tests' result is in part 1).
# BENCH_QUANT=1 adds part 4: the GPU quantizer benchmark (medians of 5); SKIP_PROFILE=1 drops part 3.
# PROFILE_BASE=RECIPE adds that recipe's profile to part 3 and prints the per-kernel difference.
set -uo pipefail
cd "$(dirname "$0")/.."
base=${OUT:-runs/verify}
mkdir -p "$base/tests" "$base/recipes" "$base/profile"
echo "== 1/3 GPU tests"
SKIP_EMU=1 OUT=$base/tests scripts/gpu_check.sh quick 2>&1 | tail -6
echo "== 2/3 recipes"
RUNS=${RUNS:-3} OUT=$base/recipes scripts/gpu_check.sh recipes 2>&1 | tail -7 | tee "$base/recipes/summary.txt"
# the issue bars as ratios, from the summary lines above (fp8 >= 1.05x and nvfp4 >= 0.85x BF16,
# BF16 >= 1.0x torch.compile)
python3 - "$base/recipes/summary.txt" <<'PY'
import re, sys
txt = open(sys.argv[1]).read()
med = {r: float(m) for r, m in re.findall(r"gpt2-124m (\w+) cublaslt tok/s \(runs:[^)]*\) median ([0-9.]+)", txt)}
torch = re.search(r"tokens_per_s=([0-9.]+)", txt)
bf = med.get("bf16")
if bf:
    for r, bar in (("fp8", 1.05), ("nvfp4", 0.85)):
        if r in med:
            print(f"ratio {r}/bf16 = {med[r] / bf:.3f} (bar {bar}: {'met' if med[r] / bf >= bar else 'not met'})")
    if torch:
        t = float(torch.group(1))
        print(f"ratio bf16/torch.compile = {bf / t:.3f} (bar 1.0: {'met' if bf >= t else 'not met'})")
PY
[ -n "${SKIP_PROFILE:-}" ] || echo "== 3/3 profile (${PROFILE_RECIPE:-bf16})"
[ -n "${SKIP_PROFILE:-}" ] || SKIP_STATS=1 RECIPE=${PROFILE_RECIPE:-bf16} OUT=$base/profile scripts/gpu_check.sh trainprofile 2>&1 | grep -v "^fp4sim\|^backends\|^default\|^CUDA\|^GPU\|^compiler\|^OpenMP\|^libraries\|^fp build\|^name\|^NVIDIA" | tail -40
# PROFILE_BASE=bf16 (with PROFILE_RECIPE=nvfp4, say): the base recipe's step too, then the
# per-kernel difference (validation/ncu_summary.py BASE OTHER), largest first
if [ -z "${SKIP_PROFILE:-}" ] && [ -n "${PROFILE_BASE:-}" ]; then
  cp runs/gpu_check/prof_ncu.csv "$base/profile/other.csv" 2>/dev/null
  SKIP_STATS=1 RECIPE=$PROFILE_BASE OUT=$base/profile/base scripts/gpu_check.sh trainprofile >/dev/null 2>&1
  cp runs/gpu_check/prof_ncu.csv "$base/profile/base.csv" 2>/dev/null
  echo "== per-kernel difference, ${PROFILE_RECIPE:-bf16} - $PROFILE_BASE"
  python3 validation/ncu_summary.py "$base/profile/base.csv" "$base/profile/other.csv" | head -30
fi
if [ -n "${BENCH_QUANT:-}" ]; then
  echo "== 4/4 quantizer benchmark (issue 2 bars: row+col RN >= 70%, row RN + col RHT+SR >= 50% of copy bandwidth)"
  build-gpu/bench_quantize --benchmark_filter='BM_GpuQuantize/8192/8192/./1/1' --benchmark_repetitions=5 \
    --benchmark_report_aggregates_only=true 2>&1 | grep -E "median" | sed 's/  */ /g'
fi
