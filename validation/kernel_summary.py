#!/usr/bin/env python3
"""Per-kernel GPU time of a run traced by tools/cupti_trace.cpp (CSV: kind,name,start_ns,end_ns,bytes).

usage: validation/kernel_summary.py TRACE.csv [--steps N] [--top K]
Sums each kernel's GPU time (by its name up to the argument list, template arguments kept short)
over the whole trace, divides by --steps (the training steps the run made; default 1), and prints
the kernels by time, the largest first, with their share and launch count per step; the first line
is the total kernel time per step.
"""
import csv
import re
import sys


def short(name):
    n = name.split("(")[0]
    n = re.sub(r"<.*>", "<>", n)  # template arguments elided
    return n[-90:]


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 2
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 1
    top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 30
    total, count = {}, {}
    with open(sys.argv[1]) as f:
        for row in csv.DictReader(f):
            if row["kind"] != "kernel":
                continue
            k = short(row["name"])
            total[k] = total.get(k, 0) + int(row["end_ns"]) - int(row["start_ns"])
            count[k] = count.get(k, 0) + 1
    if not total:
        print(f"kernel_summary: no kernels in {sys.argv[1]}")
        return 1
    all_ns = sum(total.values())
    print(f"total kernel time {all_ns / 1e6 / steps:.2f} ms per step ({steps} steps, {len(total)} kernels)")
    for k, ns in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{ns / 1e6 / steps:8.3f} ms {100 * ns / all_ns:5.1f}% {count[k] / steps:7.1f}x  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
