#!/usr/bin/env python3
"""Table of cuBLASLt's heuristic algorithms per GEMM shape, from bench_gemm's CSV output.

usage: gemm_picks.py PICKS.csv
PICKS.csv: `bench_gemm --benchmark_filter='GpuGemmFp8/[0-9]+/[01]/|ScalarModes/[0-9]+/[01]/|MatmulPicks'
--benchmark_format=csv` (BM_GpuGemmFp8/<shape>/<mode>/<index> and
BM_GpuGemmScalarModes/<shape>/<mode>/<index>, medians of repetitions). Prints, per kind and shape,
the median microseconds of each heuristic index (-1: the plan's own choice, gpu/gemm_cublaslt.cu's
rules, else index 0), the fastest index 0..7 and its gain over index 0 (the heuristic's first).
Kinds: fp8 (mode 0: the shape's beta, 1 for Dgrad and Wgrad), fp8b0 (mode 1: beta 0, as the
training's FP8 Dgrads run), bf16 (mode 0: host alpha and beta, the BF16 recipe's
setting of its TN plans) and bf16dev (mode 1: device alpha and beta, the FP4 path on Hopper); and
matmul (BM_GpuMatmulPicks/<shape>/<index>: the BF16 recipe's own matmuls, NN/NT plans, their FP32 ->
BF16 operand copies included in the time).
"""
import csv
import re
import sys

SHAPES = ["fprop_qkv", "fprop_proj", "fprop_fc", "fprop_fc2", "dgrad_qkv", "dgrad_proj", "dgrad_fc",
          "dgrad_fc2", "wgrad_qkv", "wgrad_proj", "wgrad_fc", "wgrad_fc2"]


def main(path):
    times = {}  # (kind, shape) -> {index: us}
    with open(path, newline="") as f:
        lines = [l for l in f if not l.startswith(("Run on", "CPU Caches", "Load Average", "  L", "*"))]
    start = next((i for i, l in enumerate(lines) if l.startswith("name,")), None)
    if start is None:
        sys.exit(f"{path}: no CSV header (name,...) found")
    for row in csv.DictReader(lines[start:]):
        mm = re.match(r"BM_GpuMatmulPicks/(\d+)/(-?\d+)/.*_median$", row["name"])
        m = re.match(r"BM_Gpu(GemmFp8|GemmScalarModes)/(\d+)/([01])/(-?\d+)/.*_median$", row["name"])
        if not (mm or m) or row.get("error_occurred") == "true":
            continue
        us = float(row["us"]) if row.get("us") else float(row["real_time"])
        if mm:  # the BF16 recipe's matmuls (operand copies included)
            times.setdefault(("matmul", int(mm.group(1))), {})[int(mm.group(2))] = us
            continue
        kind = ("fp8" if m.group(1) == "GemmFp8" else "bf16") + ("" if m.group(3) == "0" else
                                                                 ("b0" if m.group(1) == "GemmFp8" else "dev"))
        times.setdefault((kind, int(m.group(2))), {})[int(m.group(4))] = us
    if not times:
        sys.exit(f"{path}: no BM_GpuGemmFp8, BM_GpuGemmScalarModes or BM_GpuMatmulPicks medians")
    picks = sorted({i for v in times.values() for i in v})
    print("kind    shape        " + " ".join(f"{i:>7d}" for i in picks) + "   best  gain")
    for (kind, shape), v in sorted(times.items()):
        best = min((i for i in v if i >= 0), key=v.get, default=-1)
        gain = f"{100 * (1 - v[best] / v[0]):5.1f}%" if 0 in v else "  n/a"
        cells = " ".join(f"{v[i]:7.1f}" if i in v else "      -" for i in picks)
        print(f"{kind:7s} {SHAPES[shape]:12s} {cells}   {best:4d} {gain}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
