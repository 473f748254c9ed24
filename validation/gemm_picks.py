#!/usr/bin/env python3
"""Table of cuBLASLt's heuristic algorithms per GEMM shape, from bench_gemm's CSV output.

usage: gemm_picks.py PICKS.csv
PICKS.csv: `bench_gemm --benchmark_filter='GpuGemmFp8/[0-9]+/0/|ScalarModes/[0-9]+/0/'
--benchmark_format=csv` (BM_GpuGemmFp8/<shape>/0/<index> and BM_GpuGemmScalarModes/<shape>/0/<index>,
medians of repetitions). Prints, per kind (fp8, bf16) and shape, the median microseconds of each
heuristic index, the fastest index and its gain over index 0 (the plans' default).
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
        m = re.match(r"BM_Gpu(GemmFp8|GemmScalarModes)/(\d+)/0/(\d+)/.*_median$", row["name"])
        if not m or row.get("error_occurred") == "true":
            continue
        kind = "fp8" if m.group(1) == "GemmFp8" else "bf16"
        us = float(row["us"]) if row.get("us") else float(row["real_time"])
        times.setdefault((kind, int(m.group(2))), {})[int(m.group(3))] = us
    if not times:
        sys.exit(f"{path}: no BM_GpuGemmFp8 or BM_GpuGemmScalarModes medians")
    picks = sorted({i for v in times.values() for i in v})
    print("kind shape        " + " ".join(f"{i:>7d}" for i in picks) + "   best  gain")
    for (kind, shape), v in sorted(times.items()):
        best = min(v, key=v.get)
        gain = f"{100 * (1 - v[best] / v[0]):5.1f}%" if 0 in v else "  n/a"
        cells = " ".join(f"{v[i]:7.1f}" if i in v else "      -" for i in picks)
        print(f"{kind:4s} {SHAPES[shape]:12s} {cells}   {best:4d} {gain}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
